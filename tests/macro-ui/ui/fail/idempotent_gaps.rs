#![allow(unused)]

use inbox_runtime::{idempotent, Message};
use serde::{Deserialize, Serialize};
use sqlx::PgConnection;

#[derive(Clone, Serialize, Deserialize, Message)]
struct Msg {
    #[message(key)]
    id: u64,
}

#[idempotent(consumer = "a", gaps = "wait")]
async fn unknown(conn: &mut PgConnection, msg: Msg) -> Result<(), sqlx::Error> {
    Ok(())
}

#[idempotent(consumer = "b", gaps = "Park")]
async fn capitalized(conn: &mut PgConnection, msg: Msg) -> Result<(), sqlx::Error> {
    Ok(())
}

#[idempotent(consumer = "c", gaps = park)]
async fn not_a_string(conn: &mut PgConnection, msg: Msg) -> Result<(), sqlx::Error> {
    Ok(())
}

#[idempotent(consumer = "d", gaps = true)]
async fn boolean(conn: &mut PgConnection, msg: Msg) -> Result<(), sqlx::Error> {
    Ok(())
}

#[idempotent(consumer = "e", gaps)]
async fn no_value(conn: &mut PgConnection, msg: Msg) -> Result<(), sqlx::Error> {
    Ok(())
}
fn main() {}
