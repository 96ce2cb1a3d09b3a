#![allow(unused)]

use inbox_runtime::Message;
use serde::{Deserialize, Serialize};

#[derive(Message)]
struct OneAttribute {
    #[message(key)]
    event_id: u64,
    #[message(aggregate, sequence)]
    order_id: u64,
}

#[derive(Message)]
struct TwoAttributes {
    #[message(key)]
    event_id: u64,
    #[message(sequence)]
    #[message(aggregate)]
    order_id: u64,
}

fn main() {}
