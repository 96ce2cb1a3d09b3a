#![allow(unused)]

use inbox_runtime::Message;
use serde::{Deserialize, Serialize};

#[derive(Message)]
#[message(key = "")]
struct Empty {
    id: u64,
}

#[derive(Message)]
#[message(key = "orders")]
struct NoPlaceholder {
    id: u64,
}

#[derive(Message)]
#[message(key = "{{id}}")]
struct OnlyEscapes {
    id: u64,
}

#[derive(Message)]
#[message(key = "order:{order_id}:{line}")]
struct UnknownFields {
    id: u64,
    line_no: u32,
}

#[derive(Message)]
#[message(key = "order:{id}{line}")]
struct Adjacent {
    id: u64,
    line: u32,
}

#[derive(Message)]
#[message(key = "order:{id")]
struct Unclosed {
    id: u64,
}

#[derive(Message)]
#[message(key = "order}:{id}")]
struct UnmatchedClose {
    id: u64,
}

#[derive(Message)]
#[message(key = "order:{}")]
struct EmptyPlaceholder {
    id: u64,
}

#[derive(Message)]
#[message(key = "order:{a{id}")]
struct NestedOpen {
    id: u64,
}

#[derive(Message)]
#[message(key = "order:{id:?}")]
struct FormatSpec {
    id: u64,
}

#[derive(Message)]
#[message(key = "order:{ id }")]
struct Spaces {
    id: u64,
}

fn main() {}
