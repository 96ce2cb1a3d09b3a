//! The ledger's handlers: one per message type and backend.
//!
//! `#[idempotent]` takes its backend from the connection type, so a program that runs on
//! PostgreSQL, SQLite and MySQL/MariaDB has one handler of each message for each; a dispatcher
//! routes only to the handlers of its own pool's backend. All six share the consumer name
//! `ledger`: one inbox
//! scope, so an event id is applied at most once whichever message carries it.
//!
//! Nothing in the demo calls these functions by name: `#[idempotent]` registers them, and the
//! dispatcher finds them in the registry.
//!
//! An event whose account id is not a ledger account (`acct-` followed by 1 to 8 digits) can
//! never be applied: the handlers refuse it with a permanent error, so the inbox dead-letters it
//! at once with its payload (see `ledger admin dead list`).

use inbox_runtime::{Classify, ErrorClass, idempotent};
use sqlx::{MySqlConnection, PgConnection, SqliteConnection};

use crate::messages::{PaymentCaptured, PaymentRefunded};

/// Adds `$2` (negative for a debit) to account `$1`, creating the account at 0 if needed.
const UPSERT_PG: &str = "INSERT INTO accounts (id, balance_cents) VALUES ($1, $2) \
     ON CONFLICT (id) DO UPDATE SET balance_cents = accounts.balance_cents + excluded.balance_cents";

/// [`UPSERT_PG`] in SQLite's placeholder syntax.
const UPSERT_SQLITE: &str = "INSERT INTO accounts (id, balance_cents) VALUES (?1, ?2) \
     ON CONFLICT (id) DO UPDATE SET balance_cents = accounts.balance_cents + excluded.balance_cents";

/// [`UPSERT_PG`] on MySQL/MariaDB.
const UPSERT_MYSQL: &str = "INSERT INTO accounts (id, balance_cents) VALUES (?, ?) \
     ON DUPLICATE KEY UPDATE balance_cents = balance_cents + VALUES(balance_cents)";

/// Why a ledger handler failed.
#[derive(Debug)]
pub(crate) enum LedgerError {
    /// The account id is not of the form `acct-<digits>`: permanent.
    UnknownAccount(String),
    /// The database failed (classified as sqlx errors are: transient or retryable).
    Db(sqlx::Error),
}

impl std::fmt::Display for LedgerError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            LedgerError::UnknownAccount(account) => {
                write!(f, "`{account}` is not a ledger account (acct-<digits>)")
            }
            LedgerError::Db(error) => error.fmt(f),
        }
    }
}

impl std::error::Error for LedgerError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            LedgerError::UnknownAccount(_) => None,
            LedgerError::Db(error) => Some(error),
        }
    }
}

impl From<sqlx::Error> for LedgerError {
    fn from(error: sqlx::Error) -> Self {
        LedgerError::Db(error)
    }
}

impl Classify for LedgerError {
    fn class(&self) -> ErrorClass {
        match self {
            LedgerError::UnknownAccount(_) => ErrorClass::Permanent,
            LedgerError::Db(error) => error.class(),
        }
    }
}

/// Refuses account ids that are not `acct-` followed by 1 to 8 ASCII digits.
fn check_account(account: &str) -> Result<(), LedgerError> {
    match account.strip_prefix("acct-") {
        Some(digits)
            if (1..=8).contains(&digits.len()) && digits.bytes().all(|b| b.is_ascii_digit()) =>
        {
            Ok(())
        }
        _ => Err(LedgerError::UnknownAccount(account.to_owned())),
    }
}

/// Credits a captured payment (PostgreSQL).
#[idempotent(consumer = "ledger")]
async fn credit_pg(conn: &mut PgConnection, msg: PaymentCaptured) -> Result<(), LedgerError> {
    check_account(&msg.account_id)?;
    sqlx::query(UPSERT_PG)
        .bind(&msg.account_id)
        .bind(msg.amount_cents)
        .execute(conn)
        .await?;
    Ok(())
}

/// Debits a refunded payment (PostgreSQL).
#[idempotent(consumer = "ledger")]
async fn debit_pg(conn: &mut PgConnection, msg: PaymentRefunded) -> Result<(), LedgerError> {
    check_account(&msg.account_id)?;
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
) -> Result<(), LedgerError> {
    check_account(&msg.account_id)?;
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
) -> Result<(), LedgerError> {
    check_account(&msg.account_id)?;
    sqlx::query(UPSERT_SQLITE)
        .bind(&msg.account_id)
        .bind(-msg.amount_cents)
        .execute(conn)
        .await?;
    Ok(())
}

/// Credits a captured payment (MySQL/MariaDB).
#[idempotent(consumer = "ledger")]
async fn credit_mysql(conn: &mut MySqlConnection, msg: PaymentCaptured) -> Result<(), LedgerError> {
    check_account(&msg.account_id)?;
    sqlx::query(UPSERT_MYSQL)
        .bind(&msg.account_id)
        .bind(msg.amount_cents)
        .execute(conn)
        .await?;
    Ok(())
}

/// Debits a refunded payment (MySQL/MariaDB).
#[idempotent(consumer = "ledger")]
async fn debit_mysql(conn: &mut MySqlConnection, msg: PaymentRefunded) -> Result<(), LedgerError> {
    check_account(&msg.account_id)?;
    sqlx::query(UPSERT_MYSQL)
        .bind(&msg.account_id)
        .bind(-msg.amount_cents)
        .execute(conn)
        .await?;
    Ok(())
}
