#![allow(unused)]

use inbox_runtime::{idempotent, Message};
use serde::{Deserialize, Serialize};
use sqlx::PgConnection;

#[derive(Clone, Serialize, Deserialize, Message)]
struct Msg {
    #[message(key)]
    id: u64,
    order_id: u64,
    version: String,
    weight: f64,
    seq: u32,
}

#[idempotent(consumer = "a", aggregate = "order_id", sequence = "version")]
async fn text_sequence(conn: &mut PgConnection, msg: Msg) -> Result<(), sqlx::Error> {
    Ok(())
}

#[idempotent(consumer = "b", aggregate = "weight", sequence = "seq")]
async fn float_aggregate(conn: &mut PgConnection, msg: Msg) -> Result<(), sqlx::Error> {
    Ok(())
}
fn main() {}
