#![allow(unused)]

use inbox_runtime::Message;
use serde::{Deserialize, Serialize};

#[derive(Message)]
#[message(name = "a", version = 2)]
struct StructLevel {
    #[message(key)]
    id: u64,
}

#[derive(Message)]
struct FieldLevel {
    #[message(key, skip)]
    id: u64,
    #[message(name = "x")]
    other: u64,
}

fn main() {}
