// A mistake in `#[derive(Message)]` is the only error: the type still implements `Message`, so
// its handlers and other uses compile.
use inbox_runtime::{idempotent, Message};
use serde::{Deserialize, Serialize};
use sqlx::PgConnection;

#[derive(Clone, Serialize, Deserialize, Message)]
#[message(name = "payments.captured", topic = "payments")]
struct Payment {
    #[message(key)]
    id: u64,
}

#[idempotent(consumer = "ledger")]
async fn credit(_conn: &mut PgConnection, msg: Payment) -> Result<u64, sqlx::Error> {
    Ok(msg.id)
}

fn main() {
    let _ = <Payment as Message>::NAME;
}
