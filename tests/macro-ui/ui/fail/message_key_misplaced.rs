#![allow(unused)]

use inbox_runtime::Message;
use serde::{Deserialize, Serialize};

#[derive(Message)]
#[message(key)]
struct StructKeyWithoutTemplate {
    id: u64,
}

#[derive(Message)]
struct FieldKeyWithValue {
    #[message(key = "{id}")]
    id: u64,
}

#[derive(Message)]
struct FieldKeyAsList {
    #[message(key(id))]
    id: u64,
}

fn main() {}
