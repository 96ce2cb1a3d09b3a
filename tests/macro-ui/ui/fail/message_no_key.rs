#![allow(unused)]

use inbox_runtime::Message;
use serde::{Deserialize, Serialize};

#[derive(Message)]
struct NoKey {
    id: u64,
}

#[derive(Message)]
#[message(name = "named")]
struct NamedNoKey {
    id: u64,
}

#[derive(Message)]
struct NoFields {}

fn main() {}
