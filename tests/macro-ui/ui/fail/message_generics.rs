#![allow(unused)]

use inbox_runtime::Message;
use serde::{Deserialize, Serialize};

#[derive(Message)]
struct Generic<T> {
    #[message(key)]
    id: T,
}

#[derive(Message)]
struct Borrowed<'a> {
    #[message(key)]
    id: &'a str,
}

#[derive(Message)]
struct Where
where
    u64: Copy,
{
    #[message(key)]
    id: u64,
}

fn main() {}
