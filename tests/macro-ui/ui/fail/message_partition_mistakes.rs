#![allow(unused)]

use inbox_runtime::Message;
use serde::{Deserialize, Serialize};

// On the struct: a field marker.
#[derive(Message)]
#[message(partition)]
struct OnTheStruct {
    #[message(key)]
    id: u64,
    account: u64,
}

// With a value, in either form.
#[derive(Message)]
struct WithValues {
    #[message(key)]
    id: u64,
    #[message(partition = "account")]
    account: u64,
    #[message(partition(other))]
    other: u64,
}

// Twice on one field.
#[derive(Message)]
struct Twice {
    #[message(key)]
    id: u64,
    #[message(partition, partition)]
    account: u64,
}

fn main() {}
