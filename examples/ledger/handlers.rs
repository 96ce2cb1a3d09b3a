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
//! On DynamoDB (`--store dynamodb://TABLE`, examples feature `dynamodb`) the same two effects are
//! [`credit_dynamodb`] and [`debit_dynamodb`]: each adds an `Update` of the account's item to the
//! delivery's [`DynamoTx`](inbox_runtime::dynamodb::DynamoTx), which commits with the claim in one
//! `TransactWriteItems`; `crate::dynamo` routes each line to them by message name.
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
    /// A DynamoDB action could not be built (a required field missing): permanent, as another
    /// attempt builds it the same way.
    #[cfg(feature = "dynamodb")]
    Request(inbox_runtime::dynamodb::sdk::error::BuildError),
}

impl std::fmt::Display for LedgerError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            LedgerError::UnknownAccount(account) => {
                write!(f, "`{account}` is not a ledger account (acct-<digits>)")
            }
            LedgerError::Db(error) => error.fmt(f),
            #[cfg(feature = "dynamodb")]
            LedgerError::Request(error) => write!(f, "cannot build the DynamoDB action: {error}"),
        }
    }
}

impl std::error::Error for LedgerError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            LedgerError::UnknownAccount(_) => None,
            LedgerError::Db(error) => Some(error),
            #[cfg(feature = "dynamodb")]
            LedgerError::Request(error) => Some(error),
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
            #[cfg(feature = "dynamodb")]
            LedgerError::Request(_) => ErrorClass::Permanent,
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

/// The `Update` that adds `cents` (negative for a debit) to the balance of `account`, the item
/// `{"id": S, "balance_cents": N}` of the DynamoDB table `accounts` (`ADD` creates the item, and
/// the attribute at 0, if missing).
#[cfg(feature = "dynamodb")]
fn add_to_balance(
    accounts: &str,
    account: &str,
    cents: i64,
) -> Result<inbox_runtime::dynamodb::sdk::types::Update, LedgerError> {
    use inbox_runtime::dynamodb::sdk::types::{AttributeValue, Update};
    Update::builder()
        .table_name(accounts)
        .key("id", AttributeValue::S(account.to_owned()))
        .update_expression("ADD balance_cents :cents")
        .expression_attribute_values(":cents", AttributeValue::N(cents.to_string()))
        .build()
        .map_err(LedgerError::Request)
}

/// Credits a captured payment (DynamoDB): adds the `Update` of the account's balance in the
/// table `accounts` to the delivery's transaction, committed with the claim.
#[cfg(feature = "dynamodb")]
pub(crate) fn credit_dynamodb(
    tx: &mut inbox_runtime::dynamodb::DynamoTx,
    accounts: &str,
    msg: &PaymentCaptured,
) -> Result<(), LedgerError> {
    check_account(&msg.account_id)?;
    tx.update(add_to_balance(accounts, &msg.account_id, msg.amount_cents)?);
    Ok(())
}

/// Debits a refunded payment (DynamoDB), as [`credit_dynamodb`] credits.
#[cfg(feature = "dynamodb")]
pub(crate) fn debit_dynamodb(
    tx: &mut inbox_runtime::dynamodb::DynamoTx,
    accounts: &str,
    msg: &PaymentRefunded,
) -> Result<(), LedgerError> {
    check_account(&msg.account_id)?;
    tx.update(add_to_balance(
        accounts,
        &msg.account_id,
        -msg.amount_cents,
    )?);
    Ok(())
}
