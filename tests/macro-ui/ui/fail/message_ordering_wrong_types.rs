#![allow(unused)]

use inbox_runtime::Message;
use serde::{Deserialize, Serialize};

#[derive(Clone, Serialize, Deserialize, Message)]
struct TextSequence {
    #[message(key, aggregate)]
    order_id: u64,
    #[message(sequence)]
    seq: String,
}

#[derive(Clone, Serialize, Deserialize, Message)]
struct FloatAggregate {
    #[message(key)]
    event_id: u64,
    #[message(aggregate)]
    shard: f64,
    #[message(sequence)]
    seq: Option<u32>,
}

fn main() {}
