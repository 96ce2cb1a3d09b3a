//! SQLite inbox store.

use sqlx::{Connection, Sqlite, SqliteConnection};

use super::{Backend, Component, InboxDatabase};

/// Milliseconds until a `failed` row's next attempt is due, `NULL` if it is (or it is not
/// `failed`). Rounded up, so that a due time in the future never reads as 0.
macro_rules! retry_in_ms {
    () => {
        "CASE WHEN status = 'failed' \
           AND next_attempt_at > strftime('%Y-%m-%dT%H:%M:%fZ', 'now') \
         THEN CAST((julianday(next_attempt_at) - julianday('now')) * 86400000.0 AS INTEGER) + 1 \
         END"
    };
}

mod sql {
    /// A request's fingerprint as a parameter: SQLite keeps the 64 hex digits as text.
    pub(super) fn hash_param(hex_text: &str) -> &str {
        hex_text
    }

    /// No lock timeout on SQLite: see `InboxConnection::claim_no_wait`.
    pub(super) const NO_WAIT: Option<(&str, &str)> = None;

    /// Unused on SQLite.
    pub(super) const LOCK_NOT_AVAILABLE: &str = "";

    /// Not needed on SQLite (see `InboxConnection::verify_claim`).
    pub(super) const VERIFY_CLAIM: Option<&str> = None;

    /// The database clock, as the batch claim writes it.
    pub(super) const NOW: &str = "strftime('%Y-%m-%dT%H:%M:%fZ', 'now')";

    /// `processed_at` of a key claimed fresh by the batch claim: the clock.
    pub(super) const CLAIMED_PROCESSED_AT: &str = NOW;

    /// `processed_at` of a key taken over by the batch claim: the value its row would have had.
    pub(super) const TAKEOVER_PROCESSED_AT: &str = "excluded.processed_at";

    /// See the PostgreSQL store.
    pub(super) const FAIL_CLAIMED: &str = "UPDATE inbox_messages SET \
         status = CASE WHEN $3 OR attempts >= $4 THEN 'dead' ELSE 'failed' END, \
         last_error = $5, \
         next_attempt_at = strftime('%Y-%m-%dT%H:%M:%fZ', 'now', printf('%+.3f seconds', $6 / 1000.0)), \
         payload = $7, processed_at = NULL \
       WHERE consumer = $1 AND message_key = $2 \
       RETURNING status, attempts";

    /// The claim (see the PostgreSQL store). SQLite serializes writers and the transaction is
    /// opened with `BEGIN IMMEDIATE`, so nothing can commit the key between this statement and
    /// the read that follows it when it returns no row.
    pub(super) const CLAIM: &str = "INSERT INTO inbox_messages \
         (consumer, message_key, message_name, payload_hash, status, attempts, received_at, \
          processed_at, source, source_partition, source_offset) \
       VALUES ($1, $2, $3, $4, 'processed', 1, strftime('%Y-%m-%dT%H:%M:%fZ', 'now'), \
          strftime('%Y-%m-%dT%H:%M:%fZ', 'now'), $5, $6, $7) \
       ON CONFLICT (consumer, message_key) DO UPDATE SET \
         status = 'processed', attempts = inbox_messages.attempts + 1, \
         processed_at = strftime('%Y-%m-%dT%H:%M:%fZ', 'now'), next_attempt_at = NULL, \
         payload = NULL \
       WHERE inbox_messages.payload_hash = excluded.payload_hash \
         AND ((inbox_messages.status = 'failed' AND ($8 <> 'deliver' OR \
               inbox_messages.next_attempt_at IS NULL \
               OR inbox_messages.next_attempt_at <= strftime('%Y-%m-%dT%H:%M:%fZ', 'now'))) \
           OR (inbox_messages.status = 'dead' AND $8 = 'replay') \
           OR (inbox_messages.status = 'parked' AND $8 IN ('resume', 'release'))) \
       RETURNING 'claimed', NULL, attempts, NULL";

    /// A row's status, fingerprint, attempts, and the milliseconds until a `failed` row is due.
    pub(super) const EXISTING: &str = concat!(
        "SELECT status, payload_hash, attempts, ",
        retry_in_ms!(),
        " FROM inbox_messages WHERE consumer = $1 AND message_key = $2"
    );

    /// [`EXISTING`] for many keys; `(consumer, message_key) IN (…)` follows.
    pub(super) const EXISTING_BATCH: &str = concat!(
        "SELECT consumer, message_key, status, payload_hash, attempts, ",
        retry_in_ms!(),
        " FROM inbox_messages WHERE (consumer, message_key) IN "
    );

    /// The batch claim's takeover condition: a `failed` row that is due.
    pub(super) const BATCH_TAKEOVER: &str = "inbox_messages.status = 'failed' \
       AND (inbox_messages.next_attempt_at IS NULL \
         OR inbox_messages.next_attempt_at <= strftime('%Y-%m-%dT%H:%M:%fZ', 'now'))";

    pub(super) const RECORD_FAILURE: &str = "INSERT INTO inbox_messages \
         (consumer, message_key, message_name, payload_hash, status, attempts, last_error, \
          next_attempt_at, payload, received_at, source, source_partition, source_offset, \
          aggregate_id, sequence) \
       VALUES ($1, $2, $3, $4, CASE WHEN $5 OR $6 <= 1 THEN 'dead' ELSE 'failed' END, 1, $7, \
          strftime('%Y-%m-%dT%H:%M:%fZ', 'now', printf('%+.3f seconds', $8 / 1000.0)), $9, \
          strftime('%Y-%m-%dT%H:%M:%fZ', 'now'), $10, $11, $12, $13, $14) \
       ON CONFLICT (consumer, message_key) DO UPDATE SET \
         attempts = inbox_messages.attempts + 1, \
         status = CASE WHEN $5 OR inbox_messages.attempts + 1 >= $6 THEN 'dead' ELSE 'failed' END, \
         last_error = excluded.last_error, next_attempt_at = excluded.next_attempt_at, \
         payload = excluded.payload \
       WHERE inbox_messages.payload_hash = excluded.payload_hash \
         AND inbox_messages.status IN ('failed', 'dead', 'parked') \
       RETURNING status, attempts";

    pub(super) const EXPIRED_PARKED: &str = "SELECT consumer, message_key, message_name, \
         aggregate_id, sequence FROM inbox_messages \
       WHERE status = 'parked' AND received_at < strftime('%Y-%m-%dT%H:%M:%fZ', 'now', printf('-%.3f seconds', $1)) \
       ORDER BY consumer, aggregate_id, sequence LIMIT $2";

    pub(super) const DISCARD: &str = "UPDATE inbox_messages \
       SET status = 'discarded', payload = NULL, next_attempt_at = NULL, \
           processed_at = strftime('%Y-%m-%dT%H:%M:%fZ', 'now') \
       WHERE consumer = $1 AND message_key = $2 AND status IN ('failed', 'dead')";

    /// This process's clock, in the form SQLite rows are stamped with (it sorts as text).
    macro_rules! now {
        () => {
            "strftime('%Y-%m-%dT%H:%M:%fZ', 'now')"
        };
    }

    /// The newest time any process wrote into the inbox tables: the latest settled time (or
    /// first delivery) of each status, one seek each on `inbox_messages_status_age`, and the
    /// received time of the latest rejection. NULL when both tables are empty.
    macro_rules! newest {
        () => {
            "(SELECT max(t) FROM ( \
               SELECT max(COALESCE(processed_at, received_at)) AS t FROM inbox_messages \
                 WHERE status = 'processed' \
               UNION ALL SELECT max(COALESCE(processed_at, received_at)) FROM inbox_messages \
                 WHERE status = 'discarded' \
               UNION ALL SELECT max(COALESCE(processed_at, received_at)) FROM inbox_messages \
                 WHERE status = 'stale' \
               UNION ALL SELECT max(COALESCE(processed_at, received_at)) FROM inbox_messages \
                 WHERE status = 'failed' \
               UNION ALL SELECT max(COALESCE(processed_at, received_at)) FROM inbox_messages \
                 WHERE status = 'dead' \
               UNION ALL SELECT max(COALESCE(processed_at, received_at)) FROM inbox_messages \
                 WHERE status = 'parked' \
               UNION ALL SELECT received_at FROM \
                 (SELECT received_at FROM inbox_rejections ORDER BY id DESC LIMIT 1)))"
        };
    }

    /// The purge's cutoff for a window of `$secs` seconds. On SQLite every process stamps rows
    /// with its own clock, so the window is measured back from the *earlier* of this process's
    /// clock and the newest time written into the inbox: a purging process whose clock is ahead
    /// cannot reach rows that a process with a correct clock wrote within the window.
    macro_rules! cutoff {
        ($secs:literal) => {
            concat!(
                "strftime('%Y-%m-%dT%H:%M:%fZ', min(",
                now!(),
                ", COALESCE(",
                newest!(),
                ", ",
                now!(),
                ")), printf('-%.3f seconds', ",
                $secs,
                "))"
            )
        };
    }

    /// One bounded batch of rejections received before the cutoff, oldest first.
    pub(super) const PURGE_REJECTIONS: &str = concat!(
        "DELETE FROM inbox_rejections WHERE id IN ( \
         SELECT id FROM inbox_rejections WHERE received_at < ",
        cutoff!("$1"),
        " ORDER BY id LIMIT $2)"
    );

    /// One bounded batch of rows settled before the cutoff.
    pub(super) const PURGE: &str = concat!(
        "DELETE FROM inbox_messages WHERE (consumer, message_key) IN ( \
         SELECT consumer, message_key FROM inbox_messages \
         WHERE status IN ($1, $2, $3) AND COALESCE(processed_at, received_at) < ",
        cutoff!("$4"),
        " LIMIT $5)"
    );

    /// This process's clock, the cutoff for a window of `$1` seconds, the newest time written
    /// into the inbox, and how many seconds that lies ahead of this process's clock.
    pub(super) const PURGE_CLOCK: &str = concat!(
        "SELECT ",
        now!(),
        ", ",
        cutoff!("$1"),
        ", n.newest, (julianday(n.newest) - julianday('now')) * 86400.0 FROM (SELECT ",
        newest!(),
        " AS newest) AS n"
    );

    /// What `PURGE` (with up to five statuses) and, when `$7`, `PURGE_REJECTIONS` would delete.
    pub(super) const PURGE_PREVIEW: &str = concat!(
        "SELECT consumer, status, COUNT(*), MIN(COALESCE(processed_at, received_at)) \
         FROM inbox_messages WHERE status IN ($1, $2, $3, $4, $5) \
         AND COALESCE(processed_at, received_at) < ",
        cutoff!("$6"),
        " GROUP BY consumer, status \
         UNION ALL \
         SELECT consumer, 'rejected:' || reason, COUNT(*), MIN(received_at) \
         FROM inbox_rejections WHERE $7 AND received_at < ",
        cutoff!("$6"),
        " GROUP BY consumer, reason ORDER BY 1 NULLS FIRST, 2"
    );
}

/// The inbox component's migrations.
const INBOX_MIGRATIONS: &[(i64, &str, &str)] = &[
    (
        1,
        "inbox",
        include_str!("../../migrations/sqlite/0001_inbox.sql"),
    ),
    (
        2,
        "rejections",
        include_str!("../../migrations/sqlite/0002_rejections.sql"),
    ),
    (
        3,
        "results",
        include_str!("../../migrations/sqlite/0003_results.sql"),
    ),
    (
        4,
        "rejection sizes",
        include_str!("../../migrations/sqlite/0004_rejection_sizes.sql"),
    ),
    (
        5,
        "console indexes",
        include_str!("../../migrations/sqlite/0005_console_indexes.sql"),
    ),
];

impl_inbox_connection!(
    SqliteConnection,
    Sqlite,
    Sqlite,
    self::sql,
    begin = |conn| if conn.is_in_transaction() {
        // Nested: a savepoint inside the caller's transaction.
        Box::pin(conn.begin())
    } else {
        // Take the write lock up front: a deferred transaction that reads and then writes can
        // fail with SQLITE_BUSY instead of waiting out the busy timeout.
        Box::pin(conn.begin_with("BEGIN IMMEDIATE"))
    },
    // As `begin`: the write lock up front, unless nested.
    begin_statement = |conn| if conn.is_in_transaction() {
        None
    } else {
        Some(sqlx::SqlSafeStr::into_sql_str("BEGIN IMMEDIATE"))
    }
);

impl InboxDatabase for Sqlite {
    const BACKEND: Backend = Backend::Sqlite;

    fn migrations(component: Component) -> &'static [(i64, &'static str, &'static str)] {
        match component {
            Component::Inbox => INBOX_MIGRATIONS,
            Component::Outbox => super::outbox::SQLITE_MIGRATIONS,
            Component::Positions => super::positions::SQLITE_MIGRATIONS,
        }
    }
}
