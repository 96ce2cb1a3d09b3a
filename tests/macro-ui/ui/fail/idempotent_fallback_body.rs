// The body of a rejected handler is still checked: its own mistakes are reported in the same
// compile, next to the macro's.
use inbox_runtime::{idempotent, Message};
use serde::{Deserialize, Serialize};
use sqlx::PgConnection;

#[derive(Clone, Serialize, Deserialize, Message)]
struct Payment {
    #[message(key)]
    id: u64,
}

#[idempotent(key = "id")]
async fn credit(_conn: &mut PgConnection, msg: Payment) -> Result<u64, sqlx::Error> {
    let id: u32 = msg.id;
    Ok(id.into())
}

fn main() {}
