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
async fn nothing(conn: &mut PgConnection, msg: Msg) {}

#[idempotent(consumer = "b")]
async fn unit(conn: &mut PgConnection, msg: Msg) -> () {}

#[idempotent(consumer = "c")]
async fn opaque(conn: &mut PgConnection, msg: Msg) -> impl Sized {}

#[idempotent(consumer = "d")]
async fn never(conn: &mut PgConnection, msg: Msg) -> ! {
    loop {}
}
fn main() {}
