//! MySQL / MariaDB inbox store (InnoDB): MySQL 8.0.16 or newer, MariaDB 10.6 or newer.
//!
//! MySQL has no `RETURNING` (MariaDB's `INSERT … RETURNING` is not in MySQL, so neither is used),
//! no `ON CONFLICT … WHERE`, and `?` parameters that bind by position only: its inbox dialect
//! ([`inbox`]) picks the generic store's stamped shapes (an upsert that stamps the row it
//! writes with a fresh token, then a read of the row) and lists each statement's parameters in
//! placeholder order. This module is the backend itself: what its errors mean (and which the
//! store retries), its migrations, and the helpers its outbox and positions statements share.
//!
//! # The claim on InnoDB
//!
//! The claim is the transaction's **first** statement, an upsert, followed by a locking read:
//!
//! 1. `INSERT … ON DUPLICATE KEY UPDATE claim_token = IF(<may be taken over>, <fresh token>,
//!    claim_token), status = IF(claim_token <=> <fresh token>, 'processed', status), …`.
//!    A free key is inserted with the fresh token. On an existing row the first assignment
//!    sets the token only when the row may be taken over (same fingerprint and a `failed` row
//!    that is due, a `dead` one on replay, a `parked` one on resume/release); every later
//!    assignment compares the token (MySQL evaluates `ON DUPLICATE KEY UPDATE` assignments left
//!    to right, each seeing the columns assigned before it), so any other row is left as it
//!    was. It never raises a duplicate-key error: no `INSERT IGNORE`, whose warnings would hide
//!    real errors, and no shared lock left behind by a failed insert.
//! 2. `SELECT status, payload_hash, attempts, claim_token <=> <fresh token>, … FOR UPDATE`:
//!    a locking (current) read of the row, so it sees the latest committed version even under
//!    REPEATABLE READ; the token tells whether this transaction claimed the key. The row is
//!    already locked by step 1, so it never waits. (Nothing relies on affected-row counts:
//!    sqlx connects with `CLIENT_FOUND_ROWS`, so an `UPDATE` reports the rows it matched, not
//!    the rows it changed; the statements here that use the count — discard, dead-letter of a
//!    parked row, purges — change every row they match.)
//!
//! Locks. Under REPEATABLE READ (InnoDB's default) and READ COMMITTED alike, step 1 on a free
//! key takes an insert-intention lock on the gap and an exclusive record lock on the new row;
//! on an existing key InnoDB's duplicate check takes an **exclusive next-key lock** (the record
//! and the gap before it) on the primary-key record (duplicate checking keeps its gap locks in
//! READ COMMITTED too). Either way the transaction holds the key's record exclusively until
//! it ends, which is what makes a concurrent delivery of the same key wait for the first to
//! commit (it then sees a `processed` row: a duplicate) or roll back.
//!
//! Deadlocks. Every claim of one key asks for the same first lock, on the same record, so
//! concurrent deliveries of one key queue behind each other and cannot form a cycle while the
//! holder commits. InnoDB may still report a deadlock (1213) when a holder that *inserted* the
//! row rolls back while two others wait for it: the waiters' locks are inherited by the gap
//! and each then needs an insert-intention lock that the other's gap lock blocks. It may also
//! report a lock wait timeout (1205) on a busy key. Both are transient: the claim being the
//! first statement, nothing of the caller's is lost, so the store rolls back, begins again and
//! repeats the claim (with a short jittered backoff), counting each retry in
//! [`mysql_lock_retries`] and the metric `inbox_store_lock_retries_total`; the caller never
//! sees them. (Inside a transaction of the caller's, where the claim is not the first
//! statement, the error is returned instead: classified transient, see [`crate::Classify`].)
//! The autocommit statements (failure records, batch claims, purges) are retried the same way,
//! and so are the outbox's and the broker positions' statements that run on their own (see
//! the `outbox` and `positions` stores, whose MySQL dialects live beside the other backends').

use sqlx::mysql::MySqlDatabaseError;
use sqlx::{MySql, MySqlConnection};
use sqlx_core::transaction::TransactionManager as _;

use super::Backend;
use super::dialect::{Contention, Dialect, ErrorKind, Migrations};
use super::retry;

pub(super) use super::retry::LOCK_ATTEMPTS;

/// How many times, in this process, a MySQL/MariaDB statement of the store (a claim, a failure
/// record, a batch claim, a purge, an outbox lease or mark, a position assignment) hit InnoDB's deadlock (1213) or lock wait timeout (1205) and
/// was retried internally. Also counted by the metric `inbox_store_lock_retries_total`
/// (labels `backend = "mysql"` and `error = "deadlock" | "lock_wait_timeout"`).
///
/// ```
/// let before = inbox_runtime::store::mysql_lock_retries();
/// assert!(inbox_runtime::store::mysql_lock_retries() >= before);
/// ```
pub fn mysql_lock_retries() -> u64 {
    retry::lock_retries()
}

/// MySQL's error number of a deadlock (`ER_LOCK_DEADLOCK`): the whole transaction was rolled
/// back.
pub(crate) const ER_LOCK_DEADLOCK: u16 = 1213;
/// MySQL's error number of a lock wait timeout (`ER_LOCK_WAIT_TIMEOUT`): the statement was
/// rolled back (the whole transaction with `innodb_rollback_on_timeout`).
pub(crate) const ER_LOCK_WAIT_TIMEOUT: u16 = 1205;
/// MySQL's error number of a statement larger than the server's `max_allowed_packet`
/// (`ER_NET_PACKET_TOO_LARGE`, SQLSTATE `08S01`): the server closes the connection, and the
/// same statement fails the same way every time.
pub(crate) const ER_NET_PACKET_TOO_LARGE: u16 = 1153;

/// The MySQL error number of a database error, if it is one.
pub(crate) fn error_number(error: &sqlx::Error) -> Option<u16> {
    super::dialect::database_error::<MySql>(error).map(MySqlDatabaseError::number)
}

/// Counts one internal retry and waits a short, jittered, growing time before it.
pub(super) async fn lock_retry_pause(label: &'static str, attempt: u32, operation: &'static str) {
    retry::pause(
        <MySql as Dialect>::BACKEND.name(),
        label,
        attempt,
        operation,
    )
    .await;
}

/// MySQL's error number for `SET TRANSACTION` inside a transaction
/// (`ER_CANT_CHANGE_TX_CHARACTERISTICS`).
const ER_CANT_CHANGE_TX_CHARACTERISTICS: u16 = 1568;

/// Whether `conn` is inside a transaction: one sqlx began (its depth), or one the server has open
/// that sqlx does not count (a raw `BEGIN` or `START TRANSACTION`, or `autocommit = 0` after a
/// statement). A `BEGIN` commits the open transaction implicitly on MySQL, so a store method
/// that would open one of its own (or retry a statement after a deadlock rolled the caller's
/// back) must ask first. At depth 0 the server is asked with `SET TRANSACTION READ WRITE`:
/// refused (1568) inside a transaction, and otherwise harmless (the next transaction's access
/// mode, the default, for the store's own next statement).
pub(super) async fn in_transaction(conn: &mut MySqlConnection) -> Result<bool, sqlx::Error> {
    if <MySql as sqlx::Database>::TransactionManager::get_transaction_depth(conn) > 0 {
        return Ok(true);
    }
    server_in_transaction(conn).await
}

/// Whether the server has a transaction open on `conn`, whatever sqlx counts: `SET TRANSACTION`
/// is refused inside one (and otherwise sets the next transaction's access mode to the default).
pub(super) async fn server_in_transaction(conn: &mut MySqlConnection) -> Result<bool, sqlx::Error> {
    match sqlx::raw_sql("SET TRANSACTION READ WRITE")
        .execute(&mut *conn)
        .await
    {
        Ok(_) => Ok(false),
        Err(error) if error_number(&error) == Some(ER_CANT_CHANGE_TX_CHARACTERISTICS) => Ok(true),
        Err(error) => Err(error),
    }
}

/// Whether a failed statement on `conn` may be retried internally: a lock error, and the
/// statement is the first of a transaction of ours (depth `depth`, 1 for a claim's own
/// transaction, 0 for autocommit), so that nothing of the caller's was rolled back with it.
pub(super) fn retryable(
    conn: &MySqlConnection,
    depth: usize,
    error: &sqlx::Error,
) -> Option<&'static str> {
    retry::retryable::<MySql>(conn, depth, error)
}

/// The text form of a timestamp column (UTC, microseconds).
macro_rules! text_time {
    ($column:literal) => {
        concat!("DATE_FORMAT(", $column, ", '%Y-%m-%d %H:%i:%s.%f')")
    };
}

/// `now` minus the window bound as seconds (a `DOUBLE`).
macro_rules! window_start {
    () => {
        "DATE_SUB(UTC_TIMESTAMP(6), INTERVAL CAST(? * 1000000 AS SIGNED) MICROSECOND)"
    };
}

mod console;
mod inbox;
mod outbox;
mod positions;
mod scope;

/// The inbox component's migrations (`migrations/inbox/`).
const INBOX_MIGRATIONS: &[(i64, &str, &str)] = super::dialect::migrations! { "inbox":
    1 "inbox" "0001_inbox.sql", 2 "console indexes" "0002_console_indexes.sql",
};

impl Dialect for MySql {
    const BACKEND: Backend = Backend::MySql;

    type DatabaseError = MySqlDatabaseError;

    const LOCK_RETRIES: bool = true;

    const MIGRATIONS: Migrations = Migrations {
        inbox: INBOX_MIGRATIONS,
        outbox: outbox::MIGRATIONS,
        positions: positions::MIGRATIONS,
    };

    /// [`ErrorKind::Permanent`]: error 1153, a statement larger than the server's
    /// `max_allowed_packet` (SQLSTATE `08S01`, but no connection problem: the same statement
    /// fails again). Transient: errors 1213 deadlock and 1205 lock wait timeout, and the
    /// SQLSTATEs `40001` and class `08` (connection exceptions).
    fn error_kind(error: &MySqlDatabaseError) -> Option<ErrorKind> {
        match error.number() {
            ER_NET_PACKET_TOO_LARGE => Some(ErrorKind::Permanent),
            ER_LOCK_DEADLOCK | ER_LOCK_WAIT_TIMEOUT => Some(ErrorKind::Transient),
            _ => error
                .code()
                .is_some_and(|code| code == "40001" || code.starts_with("08"))
                .then_some(ErrorKind::Transient),
        }
    }

    fn contention(error: &MySqlDatabaseError) -> Option<Contention> {
        match error.number() {
            ER_LOCK_DEADLOCK => Some(Contention::Deadlock),
            ER_LOCK_WAIT_TIMEOUT => Some(Contention::LockTimeout),
            _ => None,
        }
    }

    /// InnoDB's deadlock (1213) and lock wait timeout (1205), retried by the store where
    /// nothing of the caller's went with them (see the module's documentation).
    fn lock_error(error: &MySqlDatabaseError) -> Option<&'static str> {
        match error.number() {
            ER_LOCK_DEADLOCK => Some("deadlock"),
            ER_LOCK_WAIT_TIMEOUT => Some(retry::LOCK_WAIT_TIMEOUT),
            _ => None,
        }
    }
}
