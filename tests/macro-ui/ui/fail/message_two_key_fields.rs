#![allow(unused)]

use inbox_runtime::Message;
use serde::{Deserialize, Serialize};

#[derive(Message)]
struct TwoKeys {
    #[message(key)]
    event_id: u64,
    #[message(key)]
    order_id: u64,
}

fn main() {}
