//! `#[idempotent]` keeps the function's documentation, attributes and visibility, and the
//! wrapper is usable (and not dead code) even when nothing calls it.
#![deny(warnings, missing_docs)]

use inbox_runtime::{idempotent, Message, Outcome};
use serde::{Deserialize, Serialize};
use sqlx::PgConnection;

/// A captured payment.
#[derive(Clone, Serialize, Deserialize, Message)]
pub struct PaymentCaptured {
    /// The producer's event id.
    #[message(key)]
    pub event_id: uuid::Uuid,
    /// Amount, in cents.
    pub amount_cents: i64,
}

/// Credits the account; documented, public, with the message's own key.
#[idempotent(consumer = "ledger")]
#[must_use = "the outcome matters"]
pub async fn credit(conn: &mut PgConnection, msg: PaymentCaptured) -> Result<i64, sqlx::Error> {
    let _ = conn;
    Ok(msg.amount_cents)
}

// Private and never called: registered all the same, and not reported as dead code.
#[idempotent(consumer = "audit")]
async fn audit(_conn: &mut sqlx::SqliteConnection, _: PaymentCaptured) -> Result<(), std::io::Error> {
    Ok(())
}

/// Never compiled: `#[cfg]` applies to everything the macro generates.
#[idempotent(consumer = "nowhere")]
#[cfg(any())]
pub async fn nowhere(conn: &mut PgConnection, msg: PaymentCaptured) -> Result<(), sqlx::Error> {
    compile_error!("cfg'd out");
}

/// The wrapper's type, spelled out.
pub async fn call(conn: &mut PgConnection, msg: PaymentCaptured) -> Option<i64> {
    let outcome: Result<Outcome<i64>, inbox_runtime::Error<sqlx::Error>> = credit(conn, msg).await;
    outcome.ok().and_then(Outcome::processed)
}

fn main() {}
