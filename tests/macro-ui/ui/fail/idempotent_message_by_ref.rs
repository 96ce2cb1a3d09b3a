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
async fn borrowed(conn: &mut PgConnection, msg: &Msg) -> Result<(), sqlx::Error> {
    Ok(())
}

#[idempotent(consumer = "b")]
async fn opaque(conn: &mut PgConnection, msg: impl Message) -> Result<(), sqlx::Error> {
    Ok(())
}
fn main() {}
