#![allow(unused)]

use inbox_runtime::Message;
use serde::{Deserialize, Serialize};

#[derive(Message)]
#[message(name = "")]
struct Empty {
    #[message(key)]
    id: u64,
}

#[derive(Message)]
#[message(name = "orders.placed ")]
struct Padded {
    #[message(key)]
    id: u64,
}

#[derive(Message)]
#[message(name = "orders\nplaced")]
struct Control {
    #[message(key)]
    id: u64,
}

fn main() {}
