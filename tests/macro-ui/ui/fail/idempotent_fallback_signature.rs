// A mistake in the signature is the only error: the function still gets the signature
// `#[idempotent]` would give it (`async`, returning `Result<Outcome<T>, Error<E>>`), with its
// parameters as written, so its callers compile; its body is checked as an `async` one.
use inbox_runtime::{idempotent, Message, Outcome};
use serde::{Deserialize, Serialize};
use sqlx::PgConnection;

#[derive(Clone, Serialize, Deserialize, Message)]
struct Payment {
    #[message(key)]
    id: u64,
    amount: i64,
}

#[idempotent(consumer = "ledger")]
fn credit(conn: &mut PgConnection, msg: Payment) -> Result<i64, sqlx::Error> {
    sqlx::query("UPDATE accounts SET balance = balance + $1")
        .bind(msg.amount)
        .execute(&mut *conn)
        .await?;
    Ok(msg.amount)
}

#[idempotent(consumer = "audit")]
async fn audit(conn: &mut PgConnection, msg: &Payment) -> Result<(), sqlx::Error> {
    sqlx::query("INSERT INTO audit (id) VALUES ($1)")
        .bind(msg.id as i64)
        .execute(&mut *conn)
        .await?;
    Ok(())
}

async fn caller(conn: &mut PgConnection, msg: Payment) -> Result<i64, Box<dyn std::error::Error>> {
    if let Outcome::Processed(()) = audit(conn, &msg).await? {}
    match credit(conn, msg).await? {
        Outcome::Processed(amount) => Ok(amount),
        _ => Ok(0),
    }
}

fn main() {
    let _ = caller;
}
