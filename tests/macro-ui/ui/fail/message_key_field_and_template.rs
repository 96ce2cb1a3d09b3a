#![allow(unused)]

use inbox_runtime::Message;
use serde::{Deserialize, Serialize};

#[derive(Message)]
#[message(key = "order:{order_id}")]
struct Both {
    #[message(key)]
    event_id: u64,
    order_id: u64,
}

fn main() {}
