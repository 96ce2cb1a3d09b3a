#![allow(unused)]

use inbox_runtime::Message;
use serde::{Deserialize, Serialize};

#[derive(Message)]
enum Event {
    Created { id: u64 },
}

#[derive(Message)]
union Bits {
    int: u32,
    float: f32,
}

fn main() {}
