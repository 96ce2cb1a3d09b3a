#![allow(unused)]

use inbox_runtime::Message;
use serde::{Deserialize, Serialize};

#[derive(Message)]
struct Repeated {
    #[message(key, aggregate, aggregate)]
    order_id: u64,
    #[message(sequence)]
    #[message(sequence)]
    seq: u32,
}

#[derive(Message)]
struct TwoAggregates {
    #[message(key, aggregate)]
    order_id: u64,
    #[message(aggregate)]
    customer_id: u64,
    #[message(sequence)]
    seq: u32,
}

#[derive(Message)]
struct TwoSequences {
    #[message(key, aggregate)]
    order_id: u64,
    #[message(sequence)]
    seq: u32,
    #[message(sequence)]
    version: u32,
}

fn main() {}
