#![allow(unused)]

use inbox_runtime::{handler, idempotent, Message};
use serde::{Deserialize, Serialize};

#[derive(Clone, Serialize, Deserialize, Message)]
struct Msg {
    #[message(key)]
    id: u64,
}

#[idempotent(consumer = "a")]
async fn credit(conn: &mut sqlx::PgConnection, msg: Msg) -> Result<(), sqlx::Error> {
    Ok(())
}

fn main() {
    let not_a_path = handler!(1 + 2);
    let generic = handler!(credit::<u8>);
    let empty = handler!();
}
