#![allow(unused)]

use inbox_runtime::Message;
use serde::{Deserialize, Serialize};

#[derive(Message)]
#[message]
struct Bare {
    #[message(key)]
    id: u64,
}

#[derive(Message)]
#[message = "name"]
struct NameValue {
    #[message(key)]
    id: u64,
}

#[derive(Message)]
#[message(name = )]
struct MissingValue {
    #[message(key)]
    id: u64,
}

#[derive(Message)]
struct FieldSyntax {
    #[message(key;)]
    id: u64,
}

fn main() {}
