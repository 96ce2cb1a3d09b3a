#![allow(unused)]

use inbox_runtime::{idempotent, Message};
use serde::{Deserialize, Serialize};
use sqlx::PgConnection;

#[derive(Clone, Serialize, Deserialize, Message)]
struct Msg {
    #[message(key)]
    id: u64,
    order_id: u64,
    seq: u32,
}

#[idempotent(
    consumer = "a",
    aggregate = "order_id",
    sequence = "seq",
    gaps = "park",
    aggregate = "order_id",
    sequence = "seq",
    gaps = "apply"
)]
async fn repeated(conn: &mut PgConnection, msg: Msg) -> Result<(), sqlx::Error> {
    Ok(())
}

#[idempotent(consumer = "b", aggregate = "order_id", sequence = "order_id")]
async fn same_field(conn: &mut PgConnection, msg: Msg) -> Result<(), sqlx::Error> {
    Ok(())
}
fn main() {}
