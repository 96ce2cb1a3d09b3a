#![allow(unused)]

use inbox_runtime::Message;
use serde::{Deserialize, Serialize};

#[derive(Clone, Serialize, Deserialize, Message)]
struct FloatKey {
    #[message(key)]
    amount: f64,
}

#[derive(Clone, Serialize, Deserialize, Message)]
#[message(key = "{id}:{tags}")]
struct VecInTemplate {
    id: u64,
    tags: Vec<String>,
}

fn main() {}
