#![allow(unused)]

use inbox_runtime::Message;
use serde::{Deserialize, Serialize};

#[derive(Clone, Message)]
struct NotSerde {
    #[message(key)]
    id: u64,
}

fn main() {}
