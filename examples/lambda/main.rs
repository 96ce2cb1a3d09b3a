//! An AWS Lambda function behind an SQS event source mapping: each batch runs through the
//! inbox, and the function answers with the partial batch response, so that only the messages
//! that failed for a passing reason are received again.
//!
//! Build it for Lambda (the `provided.al2023` runtime, a binary named `bootstrap`), e.g. with
//! cargo-lambda: `cargo lambda build --release -p inbox-examples --example lambda --features
//! lambda`; or check it here with `cargo build -p inbox-examples --example lambda --features
//! lambda`. Configure the event source mapping with
//! `FunctionResponseTypes: ["ReportBatchItemFailures"]`, and the function with `DATABASE_URL`
//! (PostgreSQL).
//!
//! Messages: `ledger.credit` with a JSON body `{"id": "…", "account": "…", "amount_cents": 1}`
//! and the String message attribute `message-name` = `ledger.credit` (as `sink::sqs` writes it).
//! A credit of a negative amount is refused for good: dead-lettered in the inbox (payload kept
//! for `dead replay`) and deleted from the queue.

use std::time::Duration;

use inbox_runtime::source::lambda::LambdaSqs;
use inbox_runtime::{Dispatcher, ErrorClass, Message, Worker, idempotent};

/// A credit to an account, once per `id` (the producer's event id).
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize, Message)]
#[message(name = "ledger.credit")]
struct Credit {
    #[message(key)]
    id: String,
    account: String,
    amount_cents: i64,
}

/// Why a credit failed.
#[derive(Debug, thiserror::Error)]
enum CreditError {
    /// Permanent: dead-lettered in the inbox.
    #[error("a credit of {0} cents is negative")]
    Negative(i64),
    /// The database: retried (listed in `batchItemFailures`) when it may pass.
    #[error(transparent)]
    Db(#[from] sqlx::Error),
}

impl inbox_runtime::Classify for CreditError {
    fn class(&self) -> ErrorClass {
        match self {
            CreditError::Negative(_) => ErrorClass::Permanent,
            CreditError::Db(error) => error.class(),
        }
    }
}

#[idempotent(consumer = "lambda-ledger")]
async fn credit(conn: &mut sqlx::PgConnection, msg: Credit) -> Result<(), CreditError> {
    if msg.amount_cents < 0 {
        return Err(CreditError::Negative(msg.amount_cents));
    }
    sqlx::query(
        "INSERT INTO accounts (id, balance_cents) VALUES ($1, $2) \
         ON CONFLICT (id) DO UPDATE SET balance_cents = accounts.balance_cents + $2",
    )
    .bind(&msg.account)
    .bind(msg.amount_cents)
    .execute(&mut *conn)
    .await?;
    Ok(())
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
    tracing_subscriber::fmt()
        .with_env_filter(std::env::var("RUST_LOG").unwrap_or_else(|_| "info".into()))
        .without_time() // CloudWatch stamps each line
        .init();
    // Once per execution environment (a cold start): every invocation reuses the pool.
    let url = std::env::var("DATABASE_URL").map_err(|_| "DATABASE_URL is not set")?;
    let pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(5)
        .connect(&url)
        .await?;
    inbox_runtime::migrate(&pool).await?;
    sqlx::raw_sql(
        "CREATE TABLE IF NOT EXISTS accounts (id TEXT PRIMARY KEY, balance_cents BIGINT NOT NULL)",
    )
    .execute(&pool)
    .await?;
    // Records still running 3 s before the function's timeout get 2 s to commit; the rest are
    // listed in `batchItemFailures`, so that the function answers before Lambda stops it.
    let worker = Worker::new(Dispatcher::<sqlx::Postgres>::from_registry(pool)?)
        .concurrency(4)
        .drain_timeout(Duration::from_secs(2));
    LambdaSqs::new(worker)
        .deadline_margin(Duration::from_secs(3))
        .run()
        .await
}
