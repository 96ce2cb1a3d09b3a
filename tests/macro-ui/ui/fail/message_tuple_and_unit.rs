#![allow(unused)]

use inbox_runtime::Message;
use serde::{Deserialize, Serialize};

#[derive(Message)]
struct Tuple(#[message(key)] u64);

#[derive(Message)]
struct Unit;

fn main() {}
