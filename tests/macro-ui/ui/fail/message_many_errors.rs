#![allow(unused)]

use inbox_runtime::Message;
use serde::{Deserialize, Serialize};

// Every problem is reported at once, each at its own token.
#[derive(Message)]
#[message(name = "", topic = "t")]
#[message(key = "{missing}")]
struct Many {
    #[message(key, ordered)]
    id: u64,
}

fn main() {}
