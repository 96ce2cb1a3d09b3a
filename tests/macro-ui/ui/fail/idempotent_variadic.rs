#![allow(unused)]

use inbox_runtime::{idempotent, Message};
use serde::{Deserialize, Serialize};
use sqlx::PgConnection;

#[derive(Clone, Serialize, Deserialize, Message)]
struct Msg {
    #[message(key)]
    id: u64,
}

// Reported once: the function emitted in its place has no `...`, which rustc would reject too.
#[idempotent(consumer = "a")]
async fn variadic(conn: &mut PgConnection, msg: Msg, _: ...) -> Result<(), sqlx::Error> {
    Ok(())
}
fn main() {}
