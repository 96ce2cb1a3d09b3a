//! Lock-error retries inside the store, for backends whose [`Dialect::lock_error`] names some
//! (MySQL/MariaDB: InnoDB's deadlock 1213 and lock wait timeout 1205; see the `mysql` store).
//!
//! A statement that hit one is retried by the store itself, after a short jittered backoff, when
//! nothing of the caller's went with it: it ran in autocommit or in a transaction the store
//! opened for it (depth 0), or it was the first statement of the claim's own transaction
//! (depth 1), which is then rolled back and begun anew. Any other error, or the last lock error,
//! is the caller's. Backends without lock errors (PostgreSQL, SQLite) never retry here.

use std::sync::atomic::{AtomicU64, Ordering as AtomicOrdering};

use sqlx_core::transaction::TransactionManager as _;

use super::dialect::{Dialect, database_error};
use super::sql::text;
use crate::BoxFuture;

/// How often a statement that hit a lock error is tried in all.
pub(crate) const LOCK_ATTEMPTS: u32 = 30;

/// The lock error label of a lock wait that timed out (retried unless the claim is no-wait).
pub(crate) const LOCK_WAIT_TIMEOUT: &str = "lock_wait_timeout";

static LOCK_RETRIES: AtomicU64 = AtomicU64::new(0);

/// How many statements of the store were retried after a lock error, in this process.
pub(crate) fn lock_retries() -> u64 {
    LOCK_RETRIES.load(AtomicOrdering::Relaxed)
}

/// How an operation retries lock errors.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Retry {
    /// The operation's name, for the log.
    pub(crate) operation: &'static str,
    /// The transaction depth at which the operation's statements are the first of a transaction
    /// of the store's own: 0 (autocommit, or a transaction it opens and ends itself), or 1 (the
    /// claim's transaction, which a retry rolls back and begins anew).
    pub(crate) depth: usize,
    /// A no-wait claim: a lock wait timeout is the answer, not a reason to retry.
    pub(crate) no_wait: bool,
}

impl Retry {
    /// An operation in autocommit, or in a transaction it opens and ends itself (depth 0).
    pub(crate) fn autocommit(operation: &'static str) -> Self {
        Self {
            operation,
            depth: 0,
            no_wait: false,
        }
    }

    /// An operation whose statements are the first of the claim's transaction (depth 1).
    pub(crate) fn claim_transaction(operation: &'static str, no_wait: bool) -> Self {
        Self {
            operation,
            depth: 1,
            no_wait,
        }
    }
}

/// One attempt of an operation on a connection, with its argument.
pub(crate) type Once<C, A, T> =
    for<'x> fn(&'x mut C, &'x A) -> BoxFuture<'x, Result<T, sqlx::Error>>;

/// Runs `once(conn, arg)` and runs it again after each lock error that [`Retry`] allows, up to
/// [`LOCK_ATTEMPTS`] runs in all; once only on a backend without lock retries
/// ([`Dialect::LOCK_RETRIES`]).
pub(crate) async fn with_retries<D: Dialect, A: ?Sized + Sync, T>(
    conn: &mut D::Connection,
    retry: Retry,
    arg: &A,
    once: Once<D::Connection, A, T>,
) -> Result<T, sqlx::Error> {
    if !D::LOCK_RETRIES {
        return once(conn, arg).await;
    }
    let mut attempt = 0;
    loop {
        attempt += 1;
        let error = match once(conn, arg).await {
            Ok(done) => return Ok(done),
            Err(error) => error,
        };
        let label = match retryable::<D>(conn, retry.depth, &error) {
            Some(label)
                if attempt < LOCK_ATTEMPTS && !(retry.no_wait && label == LOCK_WAIT_TIMEOUT) =>
            {
                label
            }
            _ => return Err(error),
        };
        if retry.depth == 1 {
            restart_transaction::<D>(conn).await?;
        }
        pause(D::BACKEND.name(), label, attempt, retry.operation).await;
    }
}

/// Whether a statement on `conn` that failed with `error` may be retried: a lock error of `D`'s,
/// and `conn` is at `depth` (a deadlock that rolled back a transaction the caller opened leaves
/// `conn` elsewhere).
pub(crate) fn retryable<D: Dialect>(
    conn: &D::Connection,
    depth: usize,
    error: &sqlx::Error,
) -> Option<&'static str> {
    let label = database_error::<D>(error).and_then(D::lock_error)?;
    (<D as sqlx::Database>::TransactionManager::get_transaction_depth(conn) == depth)
        .then_some(label)
}

/// After a lock error in the claim's own transaction: end it (a deadlock already rolled it
/// back, a lock wait timeout only the statement) and begin anew, at the same depth for sqlx.
async fn restart_transaction<D: Dialect>(conn: &mut D::Connection) -> Result<(), sqlx::Error> {
    D::execute_raw(conn, text("ROLLBACK")).await?;
    D::execute_raw(conn, text("BEGIN")).await?;
    Ok(())
}

/// Counts one retry of `backend`'s and waits a short, jittered, growing time before it.
pub(crate) async fn pause(
    backend: &'static str,
    label: &'static str,
    attempt: u32,
    operation: &'static str,
) {
    LOCK_RETRIES.fetch_add(1, AtomicOrdering::Relaxed);
    metrics::counter!("inbox_store_lock_retries_total", "backend" => backend, "error" => label)
        .increment(1);
    tracing::debug!(
        backend,
        error = label,
        attempt,
        operation,
        "lock error, retrying"
    );
    let base = 1u64 << attempt.min(6);
    let jitter = u64::from(uuid::Uuid::new_v4().as_bytes()[0]) % (base + 1);
    tokio::time::sleep(std::time::Duration::from_millis(base / 2 + jitter)).await;
}
