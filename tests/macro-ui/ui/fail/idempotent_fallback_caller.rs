// A mistake in the arguments is the only error: the function keeps the signature
// `#[idempotent]` gives it, so its caller compiles.
use inbox_runtime::{idempotent, Message, Outcome};
use serde::{Deserialize, Serialize};
use sqlx::PgConnection;

#[derive(Clone, Serialize, Deserialize, Message)]
struct Payment {
    #[message(key)]
    id: u64,
    amount: i64,
}

#[idempotent(consumer = "ledger", gaps = "wait")]
async fn credit(conn: &mut PgConnection, msg: Payment) -> Result<i64, sqlx::Error> {
    sqlx::query("UPDATE accounts SET balance = balance + $1")
        .bind(msg.amount)
        .execute(&mut *conn)
        .await?;
    Ok(msg.amount)
}

async fn caller(conn: &mut PgConnection, msg: Payment) -> Result<i64, Box<dyn std::error::Error>> {
    match credit(conn, msg).await? {
        Outcome::Processed(amount) => Ok(amount),
        _ => Ok(0),
    }
}

fn main() {
    let _ = caller;
}
