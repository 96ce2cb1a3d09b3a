//! `#[idempotent]` with a `key` override, a `Result` alias, and unusual parameter patterns.
#![deny(warnings)]

use inbox_runtime::{idempotent, Message};
use serde::{Deserialize, Serialize};

#[derive(Clone, Serialize, Deserialize, Message)]
#[message(name = "orders.placed", key = "order:{order_id}")]
struct OrderPlaced {
    order_id: u64,
    event_id: String,
    lines: Vec<String>,
}

#[derive(Debug)]
struct LedgerError;

impl std::fmt::Display for LedgerError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ledger error")
    }
}

impl std::error::Error for LedgerError {}

type LedgerResult<T> = Result<T, LedgerError>;

/// Keyed by the producer's event id rather than by the order.
#[idempotent(consumer = "shipping", key = "event_id")]
pub(crate) async fn ship(
    conn: &mut sqlx::SqliteConnection,
    mut msg: OrderPlaced,
) -> LedgerResult<usize> {
    let _ = conn;
    msg.lines.push("gift wrap".into());
    if msg.order_id == 0 {
        return Err(LedgerError);
    }
    Ok(msg.lines.len())
}

/// Destructuring the message, with a lint allowance that reaches the body.
#[idempotent(consumer = "billing")]
#[allow(clippy::needless_return)]
async fn bill(
    _: &mut sqlx::PgConnection,
    OrderPlaced { order_id, .. }: OrderPlaced,
) -> Result<u64, Box<dyn std::error::Error + Send + Sync>> {
    return Ok(order_id);
}

async fn callers(pg: &mut sqlx::PgConnection, lite: &mut sqlx::SqliteConnection, msg: OrderPlaced) {
    let _ = ship(lite, msg.clone()).await;
    let _ = bill(pg, msg).await;
}

fn main() {
    let _ = callers;
}
