//! The ledger's handlers: one per message type and backend.
//!
//! `#[idempotent]` takes its backend from the connection type, so a program that runs on both
//! PostgreSQL and SQLite has one handler of each message for each; a dispatcher routes only to
//! the handlers of its own pool's backend. All four share the consumer name `ledger`: one inbox
//! scope, so an event id is applied at most once whichever message carries it.
//!
//! Nothing in the demo calls these functions by name: `#[idempotent]` registers them, and the
//! dispatcher finds them in the registry.

use inbox_runtime::idempotent;
use sqlx::{PgConnection, SqliteConnection};

use crate::messages::{PaymentCaptured, PaymentRefunded};

/// Adds `$2` (negative for a debit) to account `$1`, creating the account at 0 if needed.
const UPSERT_PG: &str = "INSERT INTO accounts (id, balance_cents) VALUES ($1, $2) \
     ON CONFLICT (id) DO UPDATE SET balance_cents = accounts.balance_cents + excluded.balance_cents";

/// [`UPSERT_PG`] in SQLite's placeholder syntax.
const UPSERT_SQLITE: &str = "INSERT INTO accounts (id, balance_cents) VALUES (?1, ?2) \
     ON CONFLICT (id) DO UPDATE SET balance_cents = accounts.balance_cents + excluded.balance_cents";

/// Credits a captured payment (PostgreSQL).
#[idempotent(consumer = "ledger")]
async fn credit_pg(conn: &mut PgConnection, msg: PaymentCaptured) -> Result<(), sqlx::Error> {
    sqlx::query(UPSERT_PG)
        .bind(&msg.account_id)
        .bind(msg.amount_cents)
        .execute(conn)
        .await?;
    Ok(())
}

/// Debits a refunded payment (PostgreSQL).
#[idempotent(consumer = "ledger")]
async fn debit_pg(conn: &mut PgConnection, msg: PaymentRefunded) -> Result<(), sqlx::Error> {
    sqlx::query(UPSERT_PG)
        .bind(&msg.account_id)
        .bind(-msg.amount_cents)
        .execute(conn)
        .await?;
    Ok(())
}

/// Credits a captured payment (SQLite).
#[idempotent(consumer = "ledger")]
async fn credit_sqlite(
    conn: &mut SqliteConnection,
    msg: PaymentCaptured,
) -> Result<(), sqlx::Error> {
    sqlx::query(UPSERT_SQLITE)
        .bind(&msg.account_id)
        .bind(msg.amount_cents)
        .execute(conn)
        .await?;
    Ok(())
}

/// Debits a refunded payment (SQLite).
#[idempotent(consumer = "ledger")]
async fn debit_sqlite(
    conn: &mut SqliteConnection,
    msg: PaymentRefunded,
) -> Result<(), sqlx::Error> {
    sqlx::query(UPSERT_SQLITE)
        .bind(&msg.account_id)
        .bind(-msg.amount_cents)
        .execute(conn)
        .await?;
    Ok(())
}
