#![allow(unused)]

use inbox_runtime::Message;
use serde::{Deserialize, Serialize};

// An aggregate without a sequence: nothing to order its messages by.
#[derive(Message)]
struct AggregateOnly {
    #[message(key, aggregate)]
    order_id: u64,
}

// A sequence without an aggregate: nothing to compare it within.
#[derive(Message)]
struct SequenceOnly {
    #[message(key)]
    event_id: u64,
    #[message(sequence)]
    seq: u32,
}

fn main() {}
