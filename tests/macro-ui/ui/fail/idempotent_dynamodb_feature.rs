#![allow(unused)]

// This package builds inbox-runtime without its `dynamodb` feature (see Cargo.toml): a handler
// taking `&mut DynamoTx` says which feature to enable, at its first parameter.

use inbox_runtime::{idempotent, Message};
use serde::{Deserialize, Serialize};

#[derive(Clone, Serialize, Deserialize, Message)]
struct Msg {
    #[message(key)]
    id: u64,
}

#[idempotent(consumer = "ledger")]
async fn credit(tx: &mut inbox_runtime::dynamodb::DynamoTx, msg: Msg) -> Result<(), std::io::Error> {
    Ok(())
}

fn main() {}
