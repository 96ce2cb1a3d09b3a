#![allow(unused)]

use inbox_runtime::Message;
use serde::{Deserialize, Serialize};

#[derive(Clone, Serialize, Deserialize, Message)]
struct ListPartition {
    #[message(key)]
    id: u64,
    #[message(partition)]
    accounts: Vec<String>,
}

fn main() {}
