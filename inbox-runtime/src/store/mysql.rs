//! MySQL / MariaDB inbox store (InnoDB): MySQL 8.0.16 or newer, MariaDB 10.6 or newer.
//!
//! MySQL has no `RETURNING` (MariaDB's `INSERT … RETURNING` is not in MySQL, so neither is used),
//! no `ON CONFLICT … WHERE`, and `?` parameters that bind by position only, so this backend
//! implements the store traits itself instead of through `impl_inbox_connection!`.
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

use std::sync::atomic::{AtomicU64, Ordering as AtomicOrdering};

use sqlx::mysql::MySqlRow;
use sqlx::{Connection, MySql, MySqlConnection, Row as _};
use sqlx_core::transaction::TransactionManager as _;

use super::{
    AdminStore, Backend, ClaimRequest, ClaimResult, ClaimStore, Component, ExistingRow,
    FailureRecord, InboxConnection, InboxDatabase, OrderingStore, ParkedMessage, PurgeClock,
    Rejection, StatsRow, StoredMessage, shared,
};
use crate::BoxFuture;
use crate::status::Status;

/// How often a statement that hit a deadlock or a lock wait timeout is tried in all.
pub(super) const LOCK_ATTEMPTS: u32 = 30;

static LOCK_RETRIES: AtomicU64 = AtomicU64::new(0);

/// How many times, in this process, a MySQL/MariaDB statement of the store (a claim, a failure
/// record, a batch claim, a purge, an outbox lease or mark, a position assignment) hit InnoDB's deadlock (1213) or lock wait timeout (1205) and
/// was retried internally. Also counted by the metric `inbox_store_lock_retries_total`
/// (labels `backend = "mysql"` and `error = "deadlock" | "lock_wait_timeout"`).
///
/// ```
/// let before = inbox_runtime::mysql_lock_retries();
/// assert!(inbox_runtime::mysql_lock_retries() >= before);
/// ```
pub fn mysql_lock_retries() -> u64 {
    LOCK_RETRIES.load(AtomicOrdering::Relaxed)
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
    match error {
        sqlx::Error::Database(db) => db
            .try_downcast_ref::<sqlx::mysql::MySqlDatabaseError>()
            .map(|e| e.number()),
        _ => None,
    }
}

/// `Some(label)` if `error` is a deadlock or a lock wait timeout.
fn lock_error(error: &sqlx::Error) -> Option<&'static str> {
    match error_number(error)? {
        ER_LOCK_DEADLOCK => Some("deadlock"),
        ER_LOCK_WAIT_TIMEOUT => Some("lock_wait_timeout"),
        _ => None,
    }
}

/// Counts one internal retry and waits a short, jittered, growing time before it.
pub(super) async fn lock_retry_pause(label: &'static str, attempt: u32, operation: &'static str) {
    LOCK_RETRIES.fetch_add(1, AtomicOrdering::Relaxed);
    metrics::counter!("inbox_store_lock_retries_total", "backend" => "mysql", "error" => label)
        .increment(1);
    tracing::debug!(
        error = label,
        attempt,
        operation,
        "InnoDB lock error, retrying"
    );
    let base = 1u64 << attempt.min(6);
    let jitter = u64::from(uuid::Uuid::new_v4().as_bytes()[0]) % (base + 1);
    tokio::time::sleep(std::time::Duration::from_millis(base / 2 + jitter)).await;
}

/// Runs `$once` (a future on `$conn`, built anew for each attempt) and retries it on a deadlock
/// (1213) or a lock wait timeout (1205), counted as [`lock_retry_pause`] counts, up to
/// [`LOCK_ATTEMPTS`] attempts in all: for operations that run in autocommit or in a
/// transaction of their own that a failed attempt has already ended (`$conn` back at depth 0),
/// so that nothing of the caller's is lost. Any other error, or the last lock error, is the
/// result. `$operation` names the operation in the log.
macro_rules! retry_lock_errors {
    ($conn:expr, $operation:literal, $once:expr) => {{
        let mut attempt = 0;
        loop {
            attempt += 1;
            match $once.await {
                Ok(done) => break Ok(done),
                Err(error) => match super::mysql::retryable(&*$conn, 0, &error) {
                    Some(label) if attempt < super::mysql::LOCK_ATTEMPTS => {
                        super::mysql::lock_retry_pause(label, attempt, $operation).await;
                    }
                    _ => break Err(error),
                },
            }
        }
    }};
}
pub(super) use retry_lock_errors;

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
    let label = lock_error(error)?;
    (<MySql as sqlx::Database>::TransactionManager::get_transaction_depth(conn) == depth)
        .then_some(label)
}

/// After a lock error in the claim's own transaction: end it (a deadlock already rolled it
/// back; a lock wait timeout only the statement) and begin anew, at the same depth for sqlx.
async fn restart_transaction(conn: &mut MySqlConnection) -> Result<(), sqlx::Error> {
    sqlx::raw_sql("ROLLBACK").execute(&mut *conn).await?;
    sqlx::raw_sql("BEGIN").execute(&mut *conn).await?;
    Ok(())
}

/// A fresh claim token.
fn token() -> [u8; 16] {
    uuid::Uuid::new_v4().into_bytes()
}

/// The text form of a timestamp column (UTC, microseconds).
macro_rules! text_time {
    ($column:literal) => {
        concat!("DATE_FORMAT(", $column, ", '%Y-%m-%d %H:%i:%s.%f')")
    };
}
pub(super) use text_time;

/// The database clock.
macro_rules! now {
    () => {
        "UTC_TIMESTAMP(6)"
    };
}

/// `now` minus the window bound as seconds (a `DOUBLE`).
macro_rules! window_start {
    () => {
        "DATE_SUB(UTC_TIMESTAMP(6), INTERVAL CAST(? * 1000000 AS SIGNED) MICROSECOND)"
    };
}
pub(super) use window_start;

/// Milliseconds until a `failed` row's next attempt is due, `NULL` if it is (or it is not
/// `failed`). Rounded up, so that a due time in the future never reads as 0.
macro_rules! retry_in_ms {
    () => {
        "CASE WHEN status = 'failed' AND next_attempt_at > UTC_TIMESTAMP(6) \
         THEN CAST(CEIL(TIMESTAMPDIFF(MICROSECOND, UTC_TIMESTAMP(6), next_attempt_at) / 1000) \
         AS SIGNED) END"
    };
}

/// The columns of a [`StoredMessage`].
macro_rules! message_columns {
    () => {
        concat!(
            "CONVERT(consumer USING utf8mb4), CONVERT(message_key USING utf8mb4), message_name, \
             status, attempts, last_error, payload_hash, payload, ",
            text_time!("received_at"),
            ", ",
            text_time!("processed_at"),
            ", ",
            text_time!("next_attempt_at"),
            ", source, CONVERT(aggregate_id USING utf8mb4), sequence, result"
        )
    };
}

mod sql {
    /// The claim's upsert (see the module's documentation). Binds: consumer, key, name, hash,
    /// source, partition, offset, token; then hash, mode, mode, mode, token (the takeover);
    /// then the token five times.
    pub(super) const CLAIM: &str = concat!(
        "INSERT INTO inbox_messages \
           (consumer, message_key, message_name, payload_hash, status, attempts, received_at, \
            processed_at, source, source_partition, source_offset, claim_token) \
         VALUES (?, ?, ?, ?, 'processed', 1, ",
        now!(),
        ", ",
        now!(),
        ", ?, ?, ?, ?) \
         ON DUPLICATE KEY UPDATE \
           claim_token = IF(payload_hash = ? AND ( \
               (status = 'failed' AND (? <> 'deliver' OR next_attempt_at IS NULL \
                 OR next_attempt_at <= UTC_TIMESTAMP(6))) \
               OR (status = 'dead' AND ? = 'replay') \
               OR (status = 'parked' AND ? IN ('resume', 'release'))), ?, claim_token), \
           status = IF(claim_token <=> ?, 'processed', status), \
           attempts = IF(claim_token <=> ?, attempts + 1, attempts), \
           processed_at = IF(claim_token <=> ?, UTC_TIMESTAMP(6), processed_at), \
           next_attempt_at = IF(claim_token <=> ?, NULL, next_attempt_at), \
           payload = IF(claim_token <=> ?, NULL, payload)"
    );

    /// The claim's locking read. Binds: token, consumer, key.
    pub(super) const CLAIM_READ: &str = concat!(
        "SELECT status, payload_hash, attempts, CAST(claim_token <=> ? AS SIGNED), ",
        retry_in_ms!(),
        " FROM inbox_messages WHERE consumer = ? AND message_key = ? FOR UPDATE"
    );

    /// A row's status, fingerprint, attempts, and the milliseconds until a `failed` row is due.
    pub(super) const EXISTING: &str = concat!(
        "SELECT status, payload_hash, attempts, ",
        retry_in_ms!(),
        " FROM inbox_messages WHERE consumer = ? AND message_key = ?"
    );

    /// [`EXISTING`] for many keys; `(consumer, message_key) IN (…)` follows.
    pub(super) const EXISTING_BATCH: &str = concat!(
        "SELECT CONVERT(consumer USING utf8mb4), CONVERT(message_key USING utf8mb4), status, \
         payload_hash, attempts, ",
        retry_in_ms!(),
        " FROM inbox_messages WHERE (consumer, message_key) IN "
    );

    /// The batch claim's `ON DUPLICATE KEY UPDATE`: takes over a `failed` row with the same
    /// fingerprint that is due. Binds: the token six times. `VALUES(payload_hash)` is each
    /// row's own fingerprint (deprecated since MySQL 8.0.20, still supported by MySQL 8 and 9;
    /// MariaDB has no row alias syntax, so it is the form both accept).
    pub(super) const BATCH_UPDATE: &str = " ON DUPLICATE KEY UPDATE \
         claim_token = IF(payload_hash = VALUES(payload_hash) AND status = 'failed' \
           AND (next_attempt_at IS NULL OR next_attempt_at <= UTC_TIMESTAMP(6)), ?, claim_token), \
         status = IF(claim_token <=> ?, 'processed', status), \
         attempts = IF(claim_token <=> ?, attempts + 1, attempts), \
         processed_at = IF(claim_token <=> ?, UTC_TIMESTAMP(6), processed_at), \
         next_attempt_at = IF(claim_token <=> ?, NULL, next_attempt_at), \
         payload = IF(claim_token <=> ?, NULL, payload)";

    /// The rows a batch claimed, among its keys: the token and `AND (consumer, message_key)
    /// IN (…)` follow.
    pub(super) const BATCH_CLAIMED: &str = "SELECT CONVERT(consumer USING utf8mb4), \
         CONVERT(message_key USING utf8mb4), attempts FROM inbox_messages \
         WHERE claim_token = ";

    /// A failed attempt: a first failure inserts the row; a later one (same payload, still
    /// `failed`, `dead` or `parked`) counts another attempt. Binds: consumer, key, name, hash,
    /// permanent, max_attempts, last_error, delay (µs), payload, source, partition, offset,
    /// aggregate, sequence, token; then hash, token; token, permanent, max_attempts; token;
    /// token, last_error; token, delay (µs); token, payload.
    pub(super) const RECORD_FAILURE: &str = "INSERT INTO inbox_messages \
         (consumer, message_key, message_name, payload_hash, status, attempts, last_error, \
          next_attempt_at, payload, received_at, source, source_partition, source_offset, \
          aggregate_id, sequence, claim_token) \
       VALUES (?, ?, ?, ?, IF(? OR ? <= 1, 'dead', 'failed'), 1, ?, \
          DATE_ADD(UTC_TIMESTAMP(6), INTERVAL ? MICROSECOND), ?, UTC_TIMESTAMP(6), ?, ?, ?, \
          ?, ?, ?) \
       ON DUPLICATE KEY UPDATE \
         claim_token = IF(payload_hash = ? AND status IN ('failed', 'dead', 'parked'), ?, \
           claim_token), \
         status = IF(claim_token <=> ?, IF(? OR attempts + 1 >= ?, 'dead', 'failed'), status), \
         attempts = IF(claim_token <=> ?, attempts + 1, attempts), \
         last_error = IF(claim_token <=> ?, ?, last_error), \
         next_attempt_at = IF(claim_token <=> ?, \
           DATE_ADD(UTC_TIMESTAMP(6), INTERVAL ? MICROSECOND), next_attempt_at), \
         payload = IF(claim_token <=> ?, ?, payload)";

    /// The row a statement of ours stamped with `token`. Binds: token, consumer, key.
    pub(super) const STAMPED: &str = "SELECT status, attempts, CAST(claim_token <=> ? AS SIGNED) \
         FROM inbox_messages WHERE consumer = ? AND message_key = ?";

    /// Turns a row claimed in this (batch) transaction into a failed attempt, after the
    /// handler's savepoint was rolled back; `attempts` already counts this attempt. Binds:
    /// permanent, max_attempts, last_error, delay (µs), payload, consumer, key.
    pub(super) const FAIL_CLAIMED: &str = "UPDATE inbox_messages SET \
         status = IF(? OR attempts >= ?, 'dead', 'failed'), last_error = ?, \
         next_attempt_at = DATE_ADD(UTC_TIMESTAMP(6), INTERVAL ? MICROSECOND), payload = ?, \
         processed_at = NULL \
       WHERE consumer = ? AND message_key = ?";

    pub(super) const READ_STATUS: &str =
        "SELECT status, attempts FROM inbox_messages WHERE consumer = ? AND message_key = ?";

    /// Marks the claim held by this transaction, for `VERIFY_CLAIM`. Binds: token.
    pub(super) const REMEMBER_CLAIM: &str = "SET @inbox_claim_token = ?";

    /// Finds the claim only while the transaction that made it is alive: InnoDB rolls a
    /// transaction back on a deadlock, and later statements then run in autocommit, so a
    /// handler that swallowed the error would otherwise "commit" without the claim.
    pub(super) const VERIFY_CLAIM: &str = "SELECT 1 FROM inbox_messages \
         WHERE consumer = ? AND message_key = ? AND claim_token <=> @inbox_claim_token";

    pub(super) const STORE_RESULT: &str =
        "UPDATE inbox_messages SET result = ? WHERE consumer = ? AND message_key = ?";

    pub(super) const FETCH_RESULT: &str =
        "SELECT result FROM inbox_messages WHERE consumer = ? AND message_key = ?";

    pub(super) const RECORD_REJECTION: &str = "INSERT INTO inbox_rejections \
         (consumer, message_key, message_name, reason, detail, payload_hash, payload, \
          source, source_partition, source_offset, payload_size, received_at) \
         VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, UTC_TIMESTAMP(6))";

    /// A key claimed fresh in this transaction has `attempts = 1`.
    pub(super) const UNCLAIM_FRESH: &str = "DELETE FROM inbox_messages \
         WHERE consumer = ? AND message_key = ? AND status = 'processed' AND attempts = 1";

    /// A `failed` key taken over in this transaction counted one more attempt and dropped its
    /// payload. Binds: payload, consumer, key.
    pub(super) const UNCLAIM_TAKEN_OVER: &str = "UPDATE inbox_messages \
         SET status = 'failed', attempts = attempts - 1, processed_at = NULL, payload = ? \
         WHERE consumer = ? AND message_key = ? AND status = 'processed' AND attempts > 1";

    pub(super) const FETCH: &str = concat!(
        "SELECT ",
        message_columns!(),
        " FROM inbox_messages WHERE consumer = ? AND message_key = ?"
    );

    pub(super) const STATS: &str = concat!(
        "SELECT CONVERT(consumer USING utf8mb4) AS c, status AS s, COUNT(*), ",
        text_time!("MIN(received_at)"),
        " FROM inbox_messages GROUP BY status, consumer \
         UNION ALL \
         SELECT consumer, CONCAT('rejected:', reason), COUNT(*), ",
        text_time!("MIN(received_at)"),
        " FROM inbox_rejections GROUP BY consumer, reason \
         ORDER BY 1, 2"
    );

    /// Creates the aggregate's state row at 0, or locks the existing one (the duplicate check
    /// takes an exclusive lock). Binds: consumer, aggregate.
    pub(super) const LOCK_AGGREGATE: &str = "INSERT INTO inbox_aggregate_state \
         (consumer, aggregate_id, last_sequence) VALUES (?, ?, 0) \
         ON DUPLICATE KEY UPDATE last_sequence = last_sequence";

    pub(super) const READ_AGGREGATE: &str = "SELECT last_sequence FROM inbox_aggregate_state \
         WHERE consumer = ? AND aggregate_id = ? FOR UPDATE";

    pub(super) const ADVANCE_AGGREGATE: &str = "UPDATE inbox_aggregate_state \
         SET last_sequence = ? WHERE consumer = ? AND aggregate_id = ?";

    /// A parked row is not settled: it loses the `processed_at` its claim gave it. Binds:
    /// status, aggregate, sequence, payload, status, consumer, key.
    pub(super) const MARK_MESSAGE: &str = "UPDATE inbox_messages \
         SET status = ?, aggregate_id = ?, sequence = ?, payload = ?, \
         processed_at = IF(? = 'parked', NULL, processed_at) \
         WHERE consumer = ? AND message_key = ?";

    pub(super) const FIND_PARKED: &str = "SELECT CONVERT(consumer USING utf8mb4), \
         CONVERT(message_key USING utf8mb4), message_name, CONVERT(aggregate_id USING utf8mb4), \
         sequence FROM inbox_messages \
         WHERE consumer = ? AND aggregate_id = ? AND sequence = ? \
         AND status IN ('parked', 'failed') LIMIT 1";

    pub(super) const EXPIRED_PARKED: &str = concat!(
        "SELECT CONVERT(consumer USING utf8mb4), CONVERT(message_key USING utf8mb4), \
         message_name, CONVERT(aggregate_id USING utf8mb4), sequence FROM inbox_messages \
         WHERE status = 'parked' AND received_at < ",
        window_start!(),
        " ORDER BY consumer, aggregate_id, sequence LIMIT ?"
    );

    /// Binds: reason, consumer, key.
    pub(super) const DEAD_LETTER_PARKED: &str = "UPDATE inbox_messages \
         SET status = 'dead', last_error = ? \
         WHERE consumer = ? AND message_key = ? AND status = 'parked'";

    pub(super) const DISCARD: &str = "UPDATE inbox_messages \
         SET status = 'discarded', payload = NULL, next_attempt_at = NULL, \
         processed_at = UTC_TIMESTAMP(6) \
         WHERE consumer = ? AND message_key = ? AND status IN ('failed', 'dead')";

    /// One bounded batch of rejections received before the window, oldest first.
    pub(super) const PURGE_REJECTIONS: &str = concat!(
        "DELETE FROM inbox_rejections WHERE received_at < ",
        window_start!(),
        " ORDER BY id LIMIT ?"
    );

    /// One bounded batch of rows settled before the window, oldest first (on
    /// `inbox_messages_status_age`).
    pub(super) const PURGE: &str = concat!(
        "DELETE FROM inbox_messages WHERE status IN (?, ?, ?) AND settled_at < ",
        window_start!(),
        " ORDER BY settled_at LIMIT ?"
    );

    /// The purge's clock: one clock, the server's, stamps every row.
    pub(super) const PURGE_CLOCK: &str = concat!(
        "SELECT ",
        text_time!("UTC_TIMESTAMP(6)"),
        ", DATE_FORMAT(",
        window_start!(),
        ", '%Y-%m-%d %H:%i:%s.%f'), NULL, NULL"
    );

    /// What `PURGE` (with up to five statuses) and, when asked, `PURGE_REJECTIONS` would
    /// delete. Binds: five statuses, window, rejections, window.
    pub(super) const PURGE_PREVIEW: &str = concat!(
        "SELECT CONVERT(consumer USING utf8mb4), status, COUNT(*), ",
        text_time!("MIN(settled_at)"),
        " FROM inbox_messages WHERE status IN (?, ?, ?, ?, ?) AND settled_at < ",
        window_start!(),
        " GROUP BY consumer, status \
         UNION ALL \
         SELECT consumer, CONCAT('rejected:', reason), COUNT(*), ",
        text_time!("MIN(received_at)"),
        " FROM inbox_rejections WHERE ? AND received_at < ",
        window_start!(),
        " GROUP BY consumer, reason ORDER BY 1, 2"
    );
}

/// The inbox component's migrations.
const INBOX_MIGRATIONS: &[(i64, &str, &str)] = &[
    (
        1,
        "inbox",
        include_str!("../../migrations/mysql/0001_inbox.sql"),
    ),
    (
        2,
        "console indexes",
        include_str!("../../migrations/mysql/0002_console_indexes.sql"),
    ),
];

impl InboxDatabase for MySql {
    const BACKEND: Backend = Backend::MySql;

    fn migrations(component: Component) -> &'static [(i64, &'static str, &'static str)] {
        match component {
            Component::Inbox => INBOX_MIGRATIONS,
            Component::Outbox => super::outbox::MYSQL_MIGRATIONS,
            Component::Positions => super::positions::MYSQL_MIGRATIONS,
        }
    }
}

impl InboxConnection for MySqlConnection {
    const BACKEND: Backend = Backend::MySql;

    fn begin_inbox(&mut self) -> BoxFuture<'_, Result<sqlx::Transaction<'_, MySql>, sqlx::Error>> {
        Box::pin(self.begin())
    }

    fn begin_statement(&self) -> Option<sqlx::SqlStr> {
        None
    }

    fn in_transaction<'t>(tx: &'t mut sqlx::Transaction<'_, MySql>) -> &'t mut Self {
        &mut *tx
    }
}

/// Milliseconds to a delay in microseconds (as `INTERVAL … MICROSECOND` takes it).
fn micros(ms: i64) -> i64 {
    ms.saturating_mul(1000)
}

fn attempts(value: i32) -> u32 {
    u32::try_from(value).unwrap_or(0)
}

fn parse_status(text: &str) -> Result<Status, sqlx::Error> {
    text.parse().map_err(|e| sqlx::Error::Decode(Box::new(e)))
}

/// Decodes a [`sql::CLAIM_READ`] row.
fn decode_claim(row: &MySqlRow) -> Result<ClaimResult, sqlx::Error> {
    let status: String = row.try_get(0)?;
    let claimed: i64 = row.try_get(3)?;
    let attempts = attempts(row.try_get(2)?);
    if claimed == 1 {
        return Ok(ClaimResult::Claimed { attempts });
    }
    let retry_in: Option<i64> = row.try_get(4)?;
    Ok(ClaimResult::Existing {
        status: parse_status(&status)?,
        payload_hash: row.try_get(1)?,
        attempts,
        retry_in: shared::retry_in(retry_in),
    })
}

fn stats_rows(
    rows: Vec<(Option<String>, String, i64, Option<String>)>,
) -> Result<Vec<StatsRow>, sqlx::Error> {
    rows.into_iter()
        .map(|(consumer, status, count, oldest)| {
            Ok(StatsRow {
                consumer,
                status: shared::stats_status(&status)?,
                count,
                oldest,
            })
        })
        .collect()
}

/// One round of the claim: the upsert and the locking read.
async fn claim_once(
    conn: &mut MySqlConnection,
    request: &ClaimRequest<'_>,
) -> Result<ClaimResult, sqlx::Error> {
    let token = token();
    let token = &token[..];
    let (source, partition, offset) = super::source_parts(request.source);
    let mode = request.mode.as_str();
    sqlx::query(sql::CLAIM)
        .bind(request.consumer)
        .bind(request.message_key)
        .bind(request.message_name)
        .bind(request.payload_hash)
        .bind(source)
        .bind(partition)
        .bind(offset)
        .bind(token)
        .bind(request.payload_hash)
        .bind(mode)
        .bind(mode)
        .bind(mode)
        .bind(token)
        .bind(token)
        .bind(token)
        .bind(token)
        .bind(token)
        .bind(token)
        .execute(&mut *conn)
        .await?;
    let row = sqlx::query(sql::CLAIM_READ)
        .bind(token)
        .bind(request.consumer)
        .bind(request.message_key)
        .fetch_optional(&mut *conn)
        .await?;
    let Some(row) = row else {
        // The upsert holds the row's lock until the transaction ends: never missing.
        return Err(sqlx::Error::Protocol(
            "inbox claim: the claimed row is missing after the upsert".into(),
        ));
    };
    let found = decode_claim(&row)?;
    if let ClaimResult::Claimed { .. } = found {
        sqlx::query(sql::REMEMBER_CLAIM)
            .bind(token)
            .execute(&mut *conn)
            .await?;
    }
    Ok(found)
}

/// The claim, retried on deadlocks and lock wait timeouts when it is the first statement of
/// the claim's own transaction (depth 1). With `no_wait`, a lock wait timeout is returned.
async fn claim_retrying(
    conn: &mut MySqlConnection,
    request: &ClaimRequest<'_>,
    no_wait: bool,
) -> Result<ClaimResult, sqlx::Error> {
    let mut attempt = 0;
    loop {
        attempt += 1;
        match claim_once(conn, request).await {
            Ok(found) => return Ok(found),
            Err(error) => {
                let Some(label) = retryable(conn, 1, &error) else {
                    return Err(error);
                };
                if attempt >= LOCK_ATTEMPTS || (no_wait && label == "lock_wait_timeout") {
                    return Err(error);
                }
                restart_transaction(conn).await?;
                lock_retry_pause(label, attempt, "claim").await;
            }
        }
    }
}

/// A failure record in its own transaction (or savepoint): the upsert and the read back.
async fn record_failure_once(
    conn: &mut MySqlConnection,
    r: &FailureRecord<'_>,
) -> Result<Option<(Status, u32)>, sqlx::Error> {
    let token = token();
    let token = &token[..];
    let (source, partition, offset) = super::source_parts(r.source);
    let max_attempts = i32::try_from(r.max_attempts).unwrap_or(i32::MAX);
    let delay = micros(r.retry_delay_ms);
    let mut tx = conn.begin().await?;
    sqlx::query(sql::RECORD_FAILURE)
        .bind(r.consumer)
        .bind(r.message_key)
        .bind(r.message_name)
        .bind(r.payload_hash)
        .bind(r.permanent)
        .bind(max_attempts)
        .bind(r.last_error)
        .bind(delay)
        .bind(r.payload)
        .bind(source)
        .bind(partition)
        .bind(offset)
        .bind(r.aggregate_id)
        .bind(r.sequence)
        .bind(token)
        .bind(r.payload_hash)
        .bind(token)
        .bind(token)
        .bind(r.permanent)
        .bind(max_attempts)
        .bind(token)
        .bind(token)
        .bind(r.last_error)
        .bind(token)
        .bind(delay)
        .bind(token)
        .bind(r.payload)
        .execute(&mut *tx)
        .await?;
    let row: Option<(String, i32, i64)> = sqlx::query_as(sql::STAMPED)
        .bind(token)
        .bind(r.consumer)
        .bind(r.message_key)
        .fetch_optional(&mut *tx)
        .await?;
    tx.commit().await?;
    match row {
        Some((status, count, 1)) => Ok(Some((parse_status(&status)?, attempts(count)))),
        _ => Ok(None),
    }
}

impl ClaimStore for MySqlConnection {
    fn claim<'c>(
        &'c mut self,
        request: &'c ClaimRequest<'c>,
    ) -> BoxFuture<'c, Result<ClaimResult, sqlx::Error>> {
        Box::pin(claim_retrying(self, request, false))
    }

    /// The claim with `innodb_lock_wait_timeout` at its minimum (1 second on MySQL; MariaDB
    /// takes 0, no wait at all, but 1 works on both) for the claim's statements; a lock wait
    /// timeout (1205) means another transaction holds the key.
    fn claim_no_wait<'c>(
        &'c mut self,
        request: &'c ClaimRequest<'c>,
    ) -> BoxFuture<'c, Result<Option<ClaimResult>, sqlx::Error>> {
        Box::pin(async move {
            let previous: i64 =
                sqlx::query_scalar("SELECT CAST(@@SESSION.innodb_lock_wait_timeout AS SIGNED)")
                    .fetch_one(&mut *self)
                    .await?;
            sqlx::raw_sql("SET SESSION innodb_lock_wait_timeout = 1")
                .execute(&mut *self)
                .await?;
            let found = claim_retrying(self, request, true).await;
            sqlx::query("SET SESSION innodb_lock_wait_timeout = ?")
                .bind(previous)
                .execute(&mut *self)
                .await?;
            match found {
                Ok(found) => Ok(Some(found)),
                Err(error) if error_number(&error) == Some(ER_LOCK_WAIT_TIMEOUT) => Ok(None),
                Err(error) => Err(error),
            }
        })
    }

    fn verify_claim<'c>(
        &'c mut self,
        consumer: &'c str,
        key: &'c str,
    ) -> BoxFuture<'c, Result<(), sqlx::Error>> {
        Box::pin(async move {
            let found: Option<i32> = sqlx::query_scalar(sql::VERIFY_CLAIM)
                .bind(consumer)
                .bind(key)
                .fetch_optional(&mut *self)
                .await?;
            match found {
                Some(_) => Ok(()),
                None => Err(sqlx::Error::Protocol(
                    "the claim is gone from the handler's transaction (rolled back by InnoDB?)"
                        .into(),
                )),
            }
        })
    }

    fn existing<'c>(
        &'c mut self,
        consumer: &'c str,
        key: &'c str,
    ) -> BoxFuture<'c, Result<Option<ClaimResult>, sqlx::Error>> {
        Box::pin(async move {
            let row: Option<(String, String, i32, Option<i64>)> = sqlx::query_as(sql::EXISTING)
                .bind(consumer)
                .bind(key)
                .fetch_optional(&mut *self)
                .await?;
            row.map(|(status, payload_hash, count, retry_in)| {
                Ok(ClaimResult::Existing {
                    status: parse_status(&status)?,
                    payload_hash,
                    attempts: attempts(count),
                    retry_in: shared::retry_in(retry_in),
                })
            })
            .transpose()
        })
    }

    fn record_failure<'c>(
        &'c mut self,
        record: &'c FailureRecord<'c>,
    ) -> BoxFuture<'c, Result<Option<(Status, u32)>, sqlx::Error>> {
        Box::pin(async move {
            retry_lock_errors!(self, "record_failure", record_failure_once(self, record))
        })
    }

    fn record_rejection<'c>(
        &'c mut self,
        r: &'c Rejection<'c>,
    ) -> BoxFuture<'c, Result<(), sqlx::Error>> {
        Box::pin(async move {
            let (source, partition, offset) = super::source_parts(r.source);
            sqlx::query(sql::RECORD_REJECTION)
                .bind(r.consumer)
                .bind(r.message_key)
                .bind(r.message_name)
                .bind(r.reason.as_str())
                .bind(r.detail)
                .bind(r.payload_hash)
                .bind(r.payload)
                .bind(source)
                .bind(partition)
                .bind(offset)
                .bind(r.payload_size)
                .execute(&mut *self)
                .await?;
            Ok(())
        })
    }

    /// One multi-row upsert stamping the rows it inserts or takes over with one token, then
    /// one read of the stamped rows. Retried like the claim when it is the first statement of
    /// the batch's transaction.
    fn claim_batch<'c>(
        &'c mut self,
        requests: &'c [ClaimRequest<'c>],
    ) -> BoxFuture<'c, Result<Vec<Option<u32>>, sqlx::Error>> {
        Box::pin(async move {
            let mut attempt = 0;
            loop {
                attempt += 1;
                match claim_batch_once(self, requests).await {
                    Ok(claimed) => return Ok(claimed),
                    Err(error) => match retryable(self, 1, &error) {
                        Some(label) if attempt < LOCK_ATTEMPTS => {
                            restart_transaction(self).await?;
                            lock_retry_pause(label, attempt, "claim_batch").await;
                        }
                        _ => return Err(error),
                    },
                }
            }
        })
    }

    fn existing_batch<'c>(
        &'c mut self,
        keys: &'c [(&'c str, &'c str)],
    ) -> BoxFuture<'c, Result<Vec<ExistingRow>, sqlx::Error>> {
        Box::pin(async move {
            if keys.is_empty() {
                return Ok(Vec::new());
            }
            let mut query = sqlx::QueryBuilder::<MySql>::new(sql::EXISTING_BATCH);
            query.push_tuples(keys, |mut row, (consumer, key)| {
                row.push_bind(*consumer).push_bind(*key);
            });
            let rows: Vec<(String, String, String, String, i32, Option<i64>)> =
                query.build_query_as().fetch_all(&mut *self).await?;
            rows.into_iter()
                .map(|(consumer, key, status, payload_hash, count, retry_in)| {
                    Ok((
                        consumer,
                        key,
                        ClaimResult::Existing {
                            status: parse_status(&status)?,
                            payload_hash,
                            attempts: attempts(count),
                            retry_in: shared::retry_in(retry_in),
                        },
                    ))
                })
                .collect()
        })
    }

    fn unclaim<'c>(
        &'c mut self,
        consumer: &'c str,
        key: &'c str,
        payload: &'c [u8],
    ) -> BoxFuture<'c, Result<(), sqlx::Error>> {
        Box::pin(async move {
            sqlx::query(sql::UNCLAIM_FRESH)
                .bind(consumer)
                .bind(key)
                .execute(&mut *self)
                .await?;
            sqlx::query(sql::UNCLAIM_TAKEN_OVER)
                .bind(payload)
                .bind(consumer)
                .bind(key)
                .execute(&mut *self)
                .await?;
            Ok(())
        })
    }

    fn fail_claimed<'c>(
        &'c mut self,
        r: &'c FailureRecord<'c>,
    ) -> BoxFuture<'c, Result<Option<(Status, u32)>, sqlx::Error>> {
        Box::pin(async move {
            let done = sqlx::query(sql::FAIL_CLAIMED)
                .bind(r.permanent)
                .bind(i32::try_from(r.max_attempts).unwrap_or(i32::MAX))
                .bind(r.last_error)
                .bind(micros(r.retry_delay_ms))
                .bind(r.payload)
                .bind(r.consumer)
                .bind(r.message_key)
                .execute(&mut *self)
                .await?;
            if done.rows_affected() == 0 {
                return Ok(None);
            }
            let row: Option<(String, i32)> = sqlx::query_as(sql::READ_STATUS)
                .bind(r.consumer)
                .bind(r.message_key)
                .fetch_optional(&mut *self)
                .await?;
            row.map(|(status, count)| Ok((parse_status(&status)?, attempts(count))))
                .transpose()
        })
    }

    fn store_result<'c>(
        &'c mut self,
        consumer: &'c str,
        key: &'c str,
        result: &'c [u8],
    ) -> BoxFuture<'c, Result<(), sqlx::Error>> {
        Box::pin(async move {
            sqlx::query(sql::STORE_RESULT)
                .bind(result)
                .bind(consumer)
                .bind(key)
                .execute(&mut *self)
                .await?;
            Ok(())
        })
    }

    fn fetch_result<'c>(
        &'c mut self,
        consumer: &'c str,
        key: &'c str,
    ) -> BoxFuture<'c, Result<Option<Vec<u8>>, sqlx::Error>> {
        Box::pin(async move {
            let found: Option<Option<Vec<u8>>> = sqlx::query_scalar(sql::FETCH_RESULT)
                .bind(consumer)
                .bind(key)
                .fetch_optional(&mut *self)
                .await?;
            Ok(found.flatten())
        })
    }
}

/// One round of the batch claim.
async fn claim_batch_once(
    conn: &mut MySqlConnection,
    requests: &[ClaimRequest<'_>],
) -> Result<Vec<Option<u32>>, sqlx::Error> {
    let mut claimed = vec![None; requests.len()];
    if requests.is_empty() {
        return Ok(claimed);
    }
    let token = token();
    let token = &token[..];
    let mut query = sqlx::QueryBuilder::<MySql>::new(
        "INSERT INTO inbox_messages (consumer, message_key, message_name, payload_hash, status, \
         attempts, received_at, processed_at, source, source_partition, source_offset, \
         claim_token) ",
    );
    query.push_values(requests, |mut row, request| {
        let (source, partition, offset) = super::source_parts(request.source);
        row.push_bind(request.consumer)
            .push_bind(request.message_key)
            .push_bind(request.message_name)
            .push_bind(request.payload_hash)
            .push("'processed'")
            .push("1")
            .push(now!())
            .push(now!())
            .push_bind(source)
            .push_bind(partition)
            .push_bind(offset)
            .push_bind(token);
    });
    query.push(sql::BATCH_UPDATE);
    let mut query = query.build();
    for _ in 0..6 {
        query = query.bind(token);
    }
    query.execute(&mut *conn).await?;
    let mut read = sqlx::QueryBuilder::<MySql>::new(sql::BATCH_CLAIMED);
    read.push_bind(token)
        .push(" AND (consumer, message_key) IN ");
    read.push_tuples(requests, |mut row, request| {
        row.push_bind(request.consumer)
            .push_bind(request.message_key);
    });
    let rows: Vec<(String, String, i32)> = read.build_query_as().fetch_all(&mut *conn).await?;
    // For `verify_claim`, as after a single claim.
    sqlx::query(sql::REMEMBER_CLAIM)
        .bind(token)
        .execute(&mut *conn)
        .await?;
    let index = super::request_index(requests);
    for (consumer, key, count) in rows {
        if let Some(&at) = index.get(&(consumer.as_str(), key.as_str())) {
            claimed[at] = Some(attempts(count));
        }
    }
    Ok(claimed)
}

impl AdminStore for MySqlConnection {
    fn fetch_message<'c>(
        &'c mut self,
        consumer: &'c str,
        key: &'c str,
    ) -> BoxFuture<'c, Result<Option<StoredMessage>, sqlx::Error>> {
        Box::pin(async move {
            let row = sqlx::query(sql::FETCH)
                .bind(consumer)
                .bind(key)
                .fetch_optional(&mut *self)
                .await?;
            row.as_ref().map(shared::stored_message).transpose()
        })
    }

    fn list_messages<'c>(
        &'c mut self,
        consumer: Option<&'c str>,
        statuses: &'c [Status],
        limit: i64,
    ) -> BoxFuture<'c, Result<Vec<StoredMessage>, sqlx::Error>> {
        Box::pin(async move {
            if statuses.is_empty() {
                return Ok(Vec::new());
            }
            let mut query = sqlx::QueryBuilder::<MySql>::new(concat!(
                "SELECT ",
                message_columns!(),
                " FROM inbox_messages WHERE ("
            ));
            query.push_bind(consumer).push(" IS NULL OR consumer = ");
            query.push_bind(consumer).push(") AND status IN (");
            let mut each = query.separated(", ");
            for status in statuses {
                each.push_bind(status.as_str());
            }
            query
                .push(") ORDER BY received_at, consumer, message_key LIMIT ")
                .push_bind(limit);
            let rows = query.build().fetch_all(&mut *self).await?;
            rows.iter().map(shared::stored_message).collect()
        })
    }

    fn discard_message<'c>(
        &'c mut self,
        consumer: &'c str,
        key: &'c str,
    ) -> BoxFuture<'c, Result<bool, sqlx::Error>> {
        Box::pin(async move {
            let done = sqlx::query(sql::DISCARD)
                .bind(consumer)
                .bind(key)
                .execute(&mut *self)
                .await?;
            Ok(done.rows_affected() > 0)
        })
    }

    fn stats(&mut self) -> BoxFuture<'_, Result<Vec<StatsRow>, sqlx::Error>> {
        Box::pin(async move {
            let rows = sqlx::query_as(sql::STATS).fetch_all(&mut *self).await?;
            stats_rows(rows)
        })
    }

    fn purge_batch<'c>(
        &'c mut self,
        statuses: &'c [Status],
        older_than_secs: f64,
        batch: i64,
    ) -> BoxFuture<'c, Result<u64, sqlx::Error>> {
        Box::pin(async move {
            let status = |i: usize| statuses.get(i).map(|s| s.as_str());
            let done = retry_lock_errors!(
                self,
                "purge",
                sqlx::query(sql::PURGE)
                    .bind(status(0))
                    .bind(status(1))
                    .bind(status(2))
                    .bind(older_than_secs)
                    .bind(batch)
                    .execute(&mut *self)
            )?;
            Ok(done.rows_affected())
        })
    }

    fn purge_rejections_batch(
        &mut self,
        older_than_secs: f64,
        batch: i64,
    ) -> BoxFuture<'_, Result<u64, sqlx::Error>> {
        Box::pin(async move {
            let done = retry_lock_errors!(
                self,
                "purge_rejections",
                sqlx::query(sql::PURGE_REJECTIONS)
                    .bind(older_than_secs)
                    .bind(batch)
                    .execute(&mut *self)
            )?;
            Ok(done.rows_affected())
        })
    }

    fn purge_clock(
        &mut self,
        older_than_secs: f64,
    ) -> BoxFuture<'_, Result<PurgeClock, sqlx::Error>> {
        Box::pin(async move {
            let (now, cutoff, newest, newest_ahead_secs): (
                String,
                String,
                Option<String>,
                Option<f64>,
            ) = sqlx::query_as(sql::PURGE_CLOCK)
                .bind(older_than_secs)
                .fetch_one(&mut *self)
                .await?;
            Ok(PurgeClock {
                now,
                cutoff,
                newest,
                newest_ahead_secs,
            })
        })
    }

    fn purge_preview<'c>(
        &'c mut self,
        statuses: &'c [Status],
        older_than_secs: f64,
        rejections: bool,
    ) -> BoxFuture<'c, Result<Vec<StatsRow>, sqlx::Error>> {
        Box::pin(async move {
            let status = |i: usize| statuses.get(i).map(|s| s.as_str());
            let rows = sqlx::query_as(sql::PURGE_PREVIEW)
                .bind(status(0))
                .bind(status(1))
                .bind(status(2))
                .bind(status(3))
                .bind(status(4))
                .bind(older_than_secs)
                .bind(rejections)
                .bind(older_than_secs)
                .fetch_all(&mut *self)
                .await?;
            stats_rows(rows)
        })
    }
}

impl OrderingStore for MySqlConnection {
    fn lock_aggregate<'c>(
        &'c mut self,
        consumer: &'c str,
        aggregate_id: &'c str,
    ) -> BoxFuture<'c, Result<i64, sqlx::Error>> {
        Box::pin(async move {
            sqlx::query(sql::LOCK_AGGREGATE)
                .bind(consumer)
                .bind(aggregate_id)
                .execute(&mut *self)
                .await?;
            sqlx::query_scalar(sql::READ_AGGREGATE)
                .bind(consumer)
                .bind(aggregate_id)
                .fetch_one(&mut *self)
                .await
        })
    }

    fn advance_aggregate<'c>(
        &'c mut self,
        consumer: &'c str,
        aggregate_id: &'c str,
        sequence: i64,
    ) -> BoxFuture<'c, Result<(), sqlx::Error>> {
        Box::pin(async move {
            sqlx::query(sql::ADVANCE_AGGREGATE)
                .bind(sequence)
                .bind(consumer)
                .bind(aggregate_id)
                .execute(&mut *self)
                .await?;
            Ok(())
        })
    }

    fn mark_message<'c>(
        &'c mut self,
        consumer: &'c str,
        key: &'c str,
        status: Status,
        ordering: &'c crate::Ordering,
        payload: Option<&'c [u8]>,
    ) -> BoxFuture<'c, Result<(), sqlx::Error>> {
        Box::pin(async move {
            sqlx::query(sql::MARK_MESSAGE)
                .bind(status.as_str())
                .bind(ordering.aggregate_id.as_str())
                .bind(ordering.sequence)
                .bind(payload)
                .bind(status.as_str())
                .bind(consumer)
                .bind(key)
                .execute(&mut *self)
                .await?;
            Ok(())
        })
    }

    fn find_parked<'c>(
        &'c mut self,
        consumer: &'c str,
        aggregate_id: &'c str,
        sequence: i64,
    ) -> BoxFuture<'c, Result<Option<ParkedMessage>, sqlx::Error>> {
        Box::pin(async move {
            let row: Option<(String, String, String, String, i64)> =
                sqlx::query_as(sql::FIND_PARKED)
                    .bind(consumer)
                    .bind(aggregate_id)
                    .bind(sequence)
                    .fetch_optional(&mut *self)
                    .await?;
            Ok(row.map(shared::parked))
        })
    }

    fn expired_parked<'c>(
        &'c mut self,
        older_than_secs: f64,
        limit: i64,
    ) -> BoxFuture<'c, Result<Vec<ParkedMessage>, sqlx::Error>> {
        Box::pin(async move {
            let rows: Vec<(String, String, String, String, i64)> =
                sqlx::query_as(sql::EXPIRED_PARKED)
                    .bind(older_than_secs)
                    .bind(limit)
                    .fetch_all(&mut *self)
                    .await?;
            Ok(rows.into_iter().map(shared::parked).collect())
        })
    }

    fn dead_letter_parked<'c>(
        &'c mut self,
        consumer: &'c str,
        key: &'c str,
        reason: &'c str,
    ) -> BoxFuture<'c, Result<bool, sqlx::Error>> {
        Box::pin(async move {
            let done = sqlx::query(sql::DEAD_LETTER_PARKED)
                .bind(reason)
                .bind(consumer)
                .bind(key)
                .execute(&mut *self)
                .await?;
            Ok(done.rows_affected() > 0)
        })
    }
}
