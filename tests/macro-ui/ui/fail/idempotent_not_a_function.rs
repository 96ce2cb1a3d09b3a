#![allow(unused)]

use inbox_runtime::{idempotent, Message};
use serde::{Deserialize, Serialize};
use sqlx::PgConnection;

#[derive(Clone, Serialize, Deserialize, Message)]
struct Msg {
    #[message(key)]
    id: u64,
}

#[idempotent(consumer = "ledger")]
struct NotAFunction;

#[idempotent(consumer = "ledger")]
impl Msg {}

#[idempotent(consumer = "ledger")]
const NOT_A_FUNCTION: u8 = 0;
fn main() {}
