#![allow(unused)]

use inbox_runtime::{idempotent, Message};
use serde::{Deserialize, Serialize};
use sqlx::PgConnection;

#[derive(Clone, Serialize, Deserialize, Message)]
struct Msg {
    #[message(key)]
    id: u64,
}

#[derive(Debug)]
struct NotAnError;

#[idempotent(consumer = "ledger")]
async fn handler(conn: &mut PgConnection, msg: Msg) -> Result<(), NotAnError> {
    Ok(())
}
fn main() {}
