#![allow(unused)]

use inbox_runtime::Message;
use serde::{Deserialize, Serialize};

// On the struct, like `key = "..."`: they are field markers.
#[derive(Message)]
#[message(aggregate = "order_id", sequence = "seq")]
struct OnTheStruct {
    #[message(key)]
    order_id: u64,
    seq: u32,
}

// With values.
#[derive(Message)]
struct WithValues {
    #[message(key, aggregate = "order_id")]
    order_id: u64,
    #[message(sequence(seq))]
    seq: u32,
}

fn main() {}
