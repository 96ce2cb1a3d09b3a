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

#[idempotent(consumer = "a", aggregate = order_id, sequence = 1)]
async fn not_strings(conn: &mut PgConnection, msg: Msg) -> Result<(), sqlx::Error> {
    Ok(())
}

#[idempotent(consumer = "b", aggregate = "order id", sequence = "{seq}")]
async fn not_field_names(conn: &mut PgConnection, msg: Msg) -> Result<(), sqlx::Error> {
    Ok(())
}

#[idempotent(consumer = "c", aggregate(order_id), sequence = "seq")]
async fn list(conn: &mut PgConnection, msg: Msg) -> Result<(), sqlx::Error> {
    Ok(())
}
fn main() {}
