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
async fn none() -> Result<(), sqlx::Error> {
    Ok(())
}

#[idempotent(consumer = "b")]
async fn one(msg: Msg) -> Result<(), sqlx::Error> {
    Ok(())
}

#[idempotent(consumer = "c")]
async fn three(
    conn: &mut PgConnection,
    msg: Msg,
    extra: u32,
) -> Result<(), sqlx::Error> {
    Ok(())
}
fn main() {}
