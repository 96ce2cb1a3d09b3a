//! PostgreSQL inbox store.

use sqlx::{Connection, PgConnection, Postgres};

use super::{Backend, Component, InboxDatabase};

/// A `failed` row's next attempt is due (on the database clock).
macro_rules! due {
    () => {
        "(inbox_messages.next_attempt_at IS NULL OR inbox_messages.next_attempt_at <= now())"
    };
}

/// Milliseconds until a `failed` row's next attempt is due, `NULL` if it is (or it is not
/// `failed`).
macro_rules! retry_in_ms {
    () => {
        "CASE WHEN status = 'failed' AND next_attempt_at > now() \
         THEN CEIL(EXTRACT(EPOCH FROM (next_attempt_at - now())) * 1000)::bigint END"
    };
}

mod sql {
    /// A request's fingerprint as a parameter: 32 raw bytes for `payload_hash BYTEA`.
    pub(super) fn hash_param(hex_text: &str) -> Vec<u8> {
        crate::store::shared::hash_bytes(hex_text)
    }

    /// No-wait claims: the `lock_timeout` set for the claim (returning the previous one), and
    /// its reset after it.
    pub(super) const NO_WAIT: Option<(&str, &str)> = Some((
        "SELECT current_setting('lock_timeout') AS previous, set_config('lock_timeout', $1, true)",
        "SELECT set_config('lock_timeout', $1, true)",
    ));

    /// SQLSTATE of a lock wait that ran out of `lock_timeout`.
    pub(super) const LOCK_NOT_AVAILABLE: &str = "55P03";

    /// Fails with SQLSTATE 25P02 if the transaction was left aborted.
    pub(super) const VERIFY_CLAIM: Option<&str> =
        Some("SELECT 1 FROM inbox_messages WHERE consumer = $1 AND message_key = $2");

    /// The database clock, as the batch claim writes it.
    pub(super) const NOW: &str = "now()";

    /// `processed_at` of a key claimed fresh: not written (NULL), since it would equal
    /// `received_at` (both `now()`); readers take `received_at` for a settled row without one.
    pub(super) const CLAIMED_PROCESSED_AT: &str = "NULL";

    /// `processed_at` of a key taken over by the batch claim.
    pub(super) const TAKEOVER_PROCESSED_AT: &str = "now()";

    /// Turns a row claimed in this (batch) transaction into a failed attempt, after the
    /// handler's savepoint was rolled back. `attempts` already counts this attempt.
    /// The next attempt is timed from the failure (`clock_timestamp()`), not from the start of
    /// the batch transaction (`now()`), which may have run for longer than the delay.
    pub(super) const FAIL_CLAIMED: &str = "UPDATE inbox_messages SET \
         status = CASE WHEN $3 OR attempts >= $4 THEN 'dead' ELSE 'failed' END, \
         last_error = $5, next_attempt_at = clock_timestamp() + $6 * interval '1 millisecond', \
         payload = $7, processed_at = NULL \
       WHERE consumer = $1 AND message_key = $2 \
       RETURNING status, attempts";

    /// The claim, in one round trip. The INSERT is the transaction's first statement and never
    /// raises a unique violation (which would abort a PostgreSQL transaction): a free key is
    /// inserted (`processed_at` left NULL: see [`CLAIMED_PROCESSED_AT`]); a `failed` key with
    /// the same fingerprint (or a `dead` one, on replay) is taken over, its row locked; any other row is left alone and read back by the second branch.
    /// When another transaction holds an uncommitted claim on the key, the INSERT waits for it.
    pub(super) const CLAIM: &str = concat!(
        "WITH claim AS ( \
         INSERT INTO inbox_messages \
           (consumer, message_key, message_name, payload_hash, status, attempts, received_at, \
            source, source_partition, source_offset) \
         VALUES ($1, $2, $3, $4, 'processed', 1, now(), $5, $6, $7) \
         ON CONFLICT (consumer, message_key) DO UPDATE SET \
           status = 'processed', attempts = inbox_messages.attempts + 1, processed_at = now(), \
           next_attempt_at = NULL, payload = NULL \
         WHERE inbox_messages.payload_hash = excluded.payload_hash \
           AND ((inbox_messages.status = 'failed' AND ($8 <> 'deliver' OR ",
        due!(),
        ")) OR (inbox_messages.status = 'dead' AND $8 = 'replay') \
           OR (inbox_messages.status = 'parked' AND $8 IN ('resume', 'release'))) \
         RETURNING attempts) \
       SELECT 'claimed' AS status, NULL::bytea AS payload_hash, attempts, \
         NULL::bigint AS retry_in_ms FROM claim \
       UNION ALL \
       SELECT status, payload_hash, attempts, ",
        retry_in_ms!(),
        " FROM inbox_messages \
       WHERE consumer = $1 AND message_key = $2 AND NOT EXISTS (SELECT 1 FROM claim)"
    );

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
    pub(super) const BATCH_TAKEOVER: &str =
        concat!("inbox_messages.status = 'failed' AND ", due!());

    /// One statement, autocommit: a first failure inserts the row; a later one (of the same
    /// payload, still `failed` or `dead`) counts another attempt. Dead when permanent or at
    /// `max_attempts` ($6).
    pub(super) const RECORD_FAILURE: &str = "INSERT INTO inbox_messages \
         (consumer, message_key, message_name, payload_hash, status, attempts, last_error, \
          next_attempt_at, payload, received_at, source, source_partition, source_offset, \
          aggregate_id, sequence) \
       VALUES ($1, $2, $3, $4, CASE WHEN $5 OR $6 <= 1 THEN 'dead' ELSE 'failed' END, 1, $7, \
          now() + $8 * interval '1 millisecond', $9, now(), $10, $11, $12, $13, $14) \
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
       WHERE status = 'parked' AND received_at < now() - $1 * interval '1 second' \
       ORDER BY consumer, aggregate_id, sequence LIMIT $2";

    pub(super) const DISCARD: &str = "UPDATE inbox_messages \
       SET status = 'discarded', payload = NULL, next_attempt_at = NULL, processed_at = now() \
       WHERE consumer = $1 AND message_key = $2 AND status IN ('failed', 'dead')";

    /// One bounded batch of rejections received before the window, oldest first.
    pub(super) const PURGE_REJECTIONS: &str = "DELETE FROM inbox_rejections WHERE id IN ( \
         SELECT id FROM inbox_rejections \
         WHERE received_at < now() - $1 * interval '1 second' \
         ORDER BY id LIMIT $2 FOR UPDATE SKIP LOCKED)";

    /// One bounded batch; rows locked by a running transaction are skipped, not waited for.
    pub(super) const PURGE: &str = "DELETE FROM inbox_messages WHERE (consumer, message_key) IN ( \
         SELECT consumer, message_key FROM inbox_messages \
         WHERE status IN ($1, $2, $3) \
           AND COALESCE(processed_at, received_at) < now() - $4 * interval '1 second' \
         LIMIT $5 FOR UPDATE SKIP LOCKED)";

    /// The purge's clock: one clock, the server's, stamps every row, so there is no newest
    /// write to compare with (`NULL`s).
    pub(super) const PURGE_CLOCK: &str = "SELECT CAST(now() AS TEXT), \
         CAST(now() - $1 * interval '1 second' AS TEXT), CAST(NULL AS TEXT), \
         CAST(NULL AS DOUBLE PRECISION)";

    /// What `PURGE` (with up to five statuses) and, when `$7`, `PURGE_REJECTIONS` would delete.
    pub(super) const PURGE_PREVIEW: &str = "SELECT consumer, status, COUNT(*), \
         CAST(MIN(COALESCE(processed_at, received_at)) AS TEXT) FROM inbox_messages \
       WHERE status IN ($1, $2, $3, $4, $5) \
         AND COALESCE(processed_at, received_at) < now() - $6 * interval '1 second' \
       GROUP BY consumer, status \
       UNION ALL \
       SELECT consumer, 'rejected:' || reason, COUNT(*), CAST(MIN(received_at) AS TEXT) \
       FROM inbox_rejections WHERE $7 AND received_at < now() - $6 * interval '1 second' \
       GROUP BY consumer, reason \
       ORDER BY 1 NULLS FIRST, 2";
}

/// The inbox component's migrations.
const INBOX_MIGRATIONS: &[(i64, &str, &str)] = &[
    (
        1,
        "inbox",
        include_str!("../../migrations/postgres/0001_inbox.sql"),
    ),
    (
        2,
        "rejections",
        include_str!("../../migrations/postgres/0002_rejections.sql"),
    ),
    (
        3,
        "results",
        include_str!("../../migrations/postgres/0003_results.sql"),
    ),
    (
        4,
        "rejection sizes",
        include_str!("../../migrations/postgres/0004_rejection_sizes.sql"),
    ),
    (
        5,
        "console indexes",
        include_str!("../../migrations/postgres/0005_console_indexes.sql"),
    ),
    (
        6,
        "narrow row",
        include_str!("../../migrations/postgres/0006_narrow_row.sql"),
    ),
];

impl_inbox_connection!(
    PgConnection,
    Postgres,
    Postgres,
    self::sql,
    begin = |conn| Box::pin(conn.begin()),
    begin_statement = |_conn| None
);

impl InboxDatabase for Postgres {
    const BACKEND: Backend = Backend::Postgres;

    fn migrations(component: Component) -> &'static [(i64, &'static str, &'static str)] {
        match component {
            Component::Inbox => INBOX_MIGRATIONS,
            Component::Outbox => super::outbox::POSTGRES_MIGRATIONS,
            Component::Positions => super::positions::POSTGRES_MIGRATIONS,
        }
    }
}
