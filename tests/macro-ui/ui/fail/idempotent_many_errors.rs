#![allow(unused)]

use inbox_runtime::{idempotent, Message};
use serde::{Deserialize, Serialize};
use sqlx::PgConnection;

#[derive(Clone, Serialize, Deserialize, Message)]
struct Msg {
    #[message(key)]
    id: u64,
}

// Every problem is reported at once, each at its own token.
#[idempotent(consumer = "", key = "a b", retries = 3)]
fn handler<T>(conn: &PgConnection, msg: &Msg)
where
    T: Copy,
{
}
fn main() {}
