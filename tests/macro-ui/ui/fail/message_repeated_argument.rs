#![allow(unused)]

use inbox_runtime::Message;
use serde::{Deserialize, Serialize};

#[derive(Message)]
#[message(name = "a")]
#[message(name = "b")]
struct TwoNames {
    #[message(key)]
    id: u64,
}

#[derive(Message)]
#[message(key = "{id}", key = "{id}")]
struct TwoTemplates {
    id: u64,
}

#[derive(Message)]
struct TwiceOnAField {
    #[message(key, key)]
    id: u64,
}

fn main() {}
