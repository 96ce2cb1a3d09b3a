#![allow(unused)]

use inbox_runtime::{idempotent, Message};
use serde::{Deserialize, Serialize};
use sqlx::PgConnection;

#[derive(Clone, Serialize, Deserialize, Message)]
struct Msg {
    #[message(key)]
    id: u64,
}

#[idempotent(consumer = "a", foo = 1)]
async fn unknown(conn: &mut PgConnection, msg: Msg) -> Result<(), sqlx::Error> {
    Ok(())
}

#[idempotent(retries = 3, consumer = "b")]
async fn future_argument(conn: &mut PgConnection, msg: Msg) -> Result<(), sqlx::Error> {
    Ok(())
}

#[idempotent(consumer = "c", inbox::key = "id", Consumer = "c")]
async fn paths(conn: &mut PgConnection, msg: Msg) -> Result<(), sqlx::Error> {
    Ok(())
}
fn main() {}
