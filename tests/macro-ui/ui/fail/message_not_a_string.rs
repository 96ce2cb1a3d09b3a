#![allow(unused)]

use inbox_runtime::Message;
use serde::{Deserialize, Serialize};

#[derive(Message)]
#[message(name = 1)]
struct NumberName {
    #[message(key)]
    id: u64,
}

#[derive(Message)]
#[message(name)]
struct NoValue {
    #[message(key)]
    id: u64,
}

#[derive(Message)]
#[message(key = order_id)]
struct IdentTemplate {
    order_id: u64,
}

fn main() {}
