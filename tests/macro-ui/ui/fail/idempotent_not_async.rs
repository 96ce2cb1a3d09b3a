#![allow(unused)]

use inbox_runtime::{idempotent, Message};
use serde::{Deserialize, Serialize};
use sqlx::PgConnection;

#[derive(Clone, Serialize, Deserialize, Message)]
struct Msg {
    #[message(key)]
    id: u64,
}

#[idempotent(consumer = "ledger")]
fn handler(conn: &mut PgConnection, msg: Msg) -> Result<(), sqlx::Error> {
    Ok(())
}

#[idempotent(consumer = "ledger")]
pub fn public_handler(conn: &mut PgConnection, msg: Msg) -> Result<(), sqlx::Error> {
    Ok(())
}
fn main() {}
