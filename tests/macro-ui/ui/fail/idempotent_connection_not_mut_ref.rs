#![allow(unused)]

use inbox_runtime::{idempotent, Message};
use serde::{Deserialize, Serialize};
use sqlx::PgConnection;

#[derive(Clone, Serialize, Deserialize, Message)]
struct Msg {
    #[message(key)]
    id: u64,
}

#[idempotent(consumer = "a")]
async fn owned(conn: PgConnection, msg: Msg) -> Result<(), sqlx::Error> {
    Ok(())
}

#[idempotent(consumer = "b")]
async fn shared(conn: &PgConnection, msg: Msg) -> Result<(), sqlx::Error> {
    Ok(())
}

#[idempotent(consumer = "c")]
async fn swapped(msg: Msg, conn: &mut PgConnection) -> Result<(), sqlx::Error> {
    Ok(())
}

#[idempotent(consumer = "d")]
async fn opaque(conn: &mut impl sqlx::Connection, msg: Msg) -> Result<(), sqlx::Error> {
    Ok(())
}
fn main() {}
