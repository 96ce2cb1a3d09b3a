#![allow(unused)]

use inbox_runtime::{idempotent, Message};
use serde::{Deserialize, Serialize};
use sqlx::PgConnection;

#[derive(Clone, Serialize, Deserialize, Message)]
struct Msg {
    #[message(key)]
    id: u64,
}

#[idempotent(consumer = )]
async fn missing_value(conn: &mut PgConnection, msg: Msg) -> Result<(), sqlx::Error> {
    Ok(())
}

#[idempotent(consumer: "ledger")]
async fn colon(conn: &mut PgConnection, msg: Msg) -> Result<(), sqlx::Error> {
    Ok(())
}

#[idempotent("ledger")]
async fn positional(conn: &mut PgConnection, msg: Msg) -> Result<(), sqlx::Error> {
    Ok(())
}
fn main() {}
