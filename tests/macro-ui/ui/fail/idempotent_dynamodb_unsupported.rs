#![allow(unused)]

// A DynamoDB handler is one whose first parameter is `&mut` a type path ending in `DynamoTx`.
// This package builds inbox-runtime without its `dynamodb` feature (see Cargo.toml), so the
// case names a `DynamoTx` of its own: the errors below come from the macro's argument checks,
// before any DynamoDB type is used (and a rejected DynamoDB handler expands to nothing more
// without the feature).

use inbox_runtime::{idempotent, Message};
use serde::{Deserialize, Serialize};

struct DynamoTx;

#[derive(Clone, Serialize, Deserialize, Message)]
struct Msg {
    #[message(key)]
    id: u64,
    order_id: String,
    seq: u64,
}

#[idempotent(consumer = "a", aggregate = "order_id", sequence = "seq")]
async fn ordered(tx: &mut DynamoTx, msg: Msg) -> Result<(), std::io::Error> {
    Ok(())
}

#[idempotent(consumer = "b", gaps = "park")]
async fn parked(tx: &mut DynamoTx, msg: Msg) -> Result<(), std::io::Error> {
    Ok(())
}

#[idempotent(consumer = "c", sequence = "seq", aggregate = "order_id", gaps = "park")]
async fn both(tx: &mut self::DynamoTx, msg: Msg) -> Result<(), std::io::Error> {
    Ok(())
}

fn main() {}
