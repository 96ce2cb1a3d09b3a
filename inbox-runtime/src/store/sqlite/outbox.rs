//! The outbox on SQLite: the [`OutboxDialect`], with the outbox component's migrations.
//!
//! One writer at a time. A row's id is allocated inside its writing transaction,
//! which holds the write lock until it commits, so transactions commit in id order and every
//! committed row is eligible.
//!
//! The store's own writes (the lease, the marks, the purges, an operator's retry and discard)
//! each run in a `BEGIN IMMEDIATE` transaction (see the SQLite [`Scoped`](crate::store::sql::Scoped)).

use sqlx::{QueryBuilder, Sqlite, SqliteConnection};

use crate::store::outbox::{
    self, Leased, Leasing, OutboxDialect, entry_columns, leased_columns, record,
};
use crate::store::sql::{Arg, Done, Sql, Stmt, text};

/// The outbox component's migrations on SQLite.
pub(super) const MIGRATIONS: &[(i64, &str, &str)] = &outbox::migrations([
    include_str!("migrations/outbox/0001_outbox.sql"),
    include_str!("migrations/outbox/0002_outbox_leases.sql"),
    include_str!("migrations/outbox/0003_outbox_lease_tokens.sql"),
    include_str!("migrations/outbox/0004_outbox_trace_context.sql"),
]);

/// The database clock, as the outbox stores it.
macro_rules! now {
    () => {
        "strftime('%Y-%m-%dT%H:%M:%fZ', 'now')"
    };
}

/// A leased row's age in milliseconds.
macro_rules! age {
    () => {
        "CAST((julianday('now') - julianday(created_at)) * 86400000.0 AS INTEGER)"
    };
}

/// Orphans out of attempts go dead (the first statement of the lease's `BEGIN IMMEDIATE`
/// transaction). `$1`: the error, `$2`: the maximum attempts.
const ABANDON: &str = concat!(
    "UPDATE inbox_outbox SET status = 'dead', last_error = $1, leased_until = NULL, \
       next_attempt_at = NULL \
     WHERE status = 'pending' AND leased_until IS NOT NULL AND leased_until <= ",
    now!(),
    " AND attempts >= $2 RETURNING ",
    leased_columns!("", age!())
);

/// Leases the rows of the inner SELECT (its `o.leased_until` condition and LIMIT follow).
/// Binds: the lease (ms) `$1`, the maximum attempts `$2` (an orphan out of attempts was
/// dead-lettered just before, in the same transaction), the limit `$3`, the lease's token
/// `$4` (sqlx binds `$N` to the N-th value).
macro_rules! lease {
    ($which:literal, $order:literal) => {
        concat!(
            "UPDATE inbox_outbox SET attempts = attempts + 1, \
               leased_until = strftime('%Y-%m-%dT%H:%M:%fZ', 'now', \
                 printf('+%.3f seconds', $1 / 1000.0)), \
               lease_token = $4 \
             WHERE id IN ( \
               SELECT o.id FROM inbox_outbox o \
               WHERE o.status = 'pending' AND ",
            $which,
            " AND (o.next_attempt_at IS NULL OR o.next_attempt_at <= ",
            now!(),
            ") AND (o.leased_until IS NULL OR (o.leased_until <= ",
            now!(),
            " AND o.attempts < $2)) \
               AND (o.aggregate_id IS NULL OR NOT EXISTS ( \
                 SELECT 1 FROM inbox_outbox e \
                 WHERE e.aggregate_id = o.aggregate_id AND e.id < o.id \
                   AND e.status IN ('pending', 'dead'))) \
               ORDER BY ",
            $order,
            " LIMIT $3) RETURNING ",
            leased_columns!("", age!())
        )
    };
}

/// One orphan, alone (`$3` is 1).
const LEASE_ORPHAN: &str = lease!("o.leased_until IS NOT NULL", "o.attempts, o.id");

/// Up to `$3` rows never leased or settled since.
const LEASE_FRESH: &str = lease!("o.leased_until IS NULL", "o.id");

impl OutboxDialect for Sqlite {
    /// With sent (`$7`), the row is written `sent` (change data capture); notify is not bound.
    const ENQUEUE: Stmt = Stmt::binding(
        concat!(
            "INSERT INTO inbox_outbox \
             (message_id, destination, message_name, payload, headers, aggregate_id, status, \
              sent_at, trace_context) \
           VALUES ($1, $2, $3, $4, $5, $6, CASE WHEN $7 THEN 'sent' ELSE 'pending' END, \
             CASE WHEN $7 THEN ",
            now!(),
            " END, $8) \
           ON CONFLICT (message_id) DO NOTHING RETURNING id"
        ),
        &[0, 1, 2, 3, 4, 5, 7, 8],
    );

    const MARK_SENT: &'static str = concat!(
        "UPDATE inbox_outbox SET status = 'sent', sent_at = ",
        now!(),
        ", leased_until = NULL, next_attempt_at = NULL, last_error = NULL \
         WHERE id IN (SELECT value FROM json_each({list})) AND lease_token = {} \
           AND status IN ('pending', 'dead') RETURNING id"
    );

    const MARK_FAILED: Stmt = Stmt::new(
        "UPDATE inbox_outbox SET \
         status = CASE WHEN $1 OR attempts >= $2 THEN 'dead' ELSE 'pending' END, \
         last_error = $3, leased_until = NULL, lease_token = NULL, \
         next_attempt_at = strftime('%Y-%m-%dT%H:%M:%fZ', 'now', \
           printf('+%.3f seconds', $4 / 1000.0)) \
       WHERE id = $5 AND lease_token = $6 AND status = 'pending' RETURNING status",
    );

    const PURGE: Stmt = Stmt::new(
        "DELETE FROM inbox_outbox WHERE id IN ( \
         SELECT id FROM inbox_outbox \
         WHERE status = 'sent' \
           AND sent_at < strftime('%Y-%m-%dT%H:%M:%fZ', 'now', printf('-%.3f seconds', $1)) \
         ORDER BY id LIMIT $2)",
    );

    const BACKLOG: Stmt = Stmt::new(concat!(
        "SELECT destination, COUNT(*), COALESCE((julianday(",
        now!(),
        ") - julianday(MIN(created_at))) * 86400.0, 0.0) \
         FROM inbox_outbox WHERE status = 'pending' GROUP BY destination ORDER BY destination"
    ));

    const INSTALLED: Stmt = Stmt::new(
        "SELECT COUNT(*) FROM sqlite_master \
       WHERE type = 'table' AND name = 'inbox_outbox'",
    );

    const STATS: Stmt = Stmt::new(
        "SELECT destination, status, COUNT(*), MIN(created_at) \
       FROM inbox_outbox GROUP BY destination, status ORDER BY destination, status",
    );

    const LIST: Stmt = Stmt::new(concat!(
        "SELECT ",
        entry_columns!(
            "CAST(NULL AS BLOB)",
            "length(payload)",
            "CAST(NULL AS TEXT)"
        ),
        " FROM inbox_outbox WHERE status IN ($1, $2, $3) \
           AND ($4 IS NULL OR destination = $4) ORDER BY id LIMIT $5"
    ));

    const FETCH: Stmt = Stmt::new(concat!(
        "SELECT ",
        entry_columns!("payload", "length(payload)", "CAST(NULL AS TEXT)"),
        " FROM inbox_outbox WHERE message_id = $1"
    ));

    const RETRY: Stmt = Stmt::new(
        "UPDATE inbox_outbox SET status = 'pending', attempts = 0, \
         leased_until = NULL, lease_token = NULL, next_attempt_at = NULL \
       WHERE status = 'dead' AND ($1 IS NULL OR message_id = $1) \
         AND ($2 IS NULL OR destination = $2)",
    );

    const DISCARD: Stmt =
        Stmt::new("DELETE FROM inbox_outbox WHERE message_id = $1 AND status = 'dead'");

    const PURGE_BEFORE: Stmt = Stmt::new(
        "DELETE FROM inbox_outbox WHERE id IN ( \
         SELECT id FROM inbox_outbox WHERE status = 'sent' AND sent_at < $1 \
         ORDER BY sent_at LIMIT $2)",
    );

    const PURGE_PREVIEW: Stmt = Stmt::new(
        "SELECT destination, 'sent', COUNT(*), MIN(sent_at) \
       FROM inbox_outbox WHERE status = 'sent' AND sent_at < $1 \
       GROUP BY destination ORDER BY destination",
    );

    /// A 64-bit integer.
    fn attempts_arg(max_attempts: u32) -> Arg<'static> {
        Arg::I64(Some(i64::from(max_attempts)))
    }

    /// One parameter: the ids as a JSON array (read with `json_each`).
    fn push_ids(builder: &mut QueryBuilder<Self>, ids: &[i64]) {
        builder.push_bind(serde_json::to_string(ids).expect("integers serialize"));
    }

    /// Orphans out of attempts go dead; then one orphan is leased alone, or else fresh rows.
    fn lease_rows<'c>(conn: &'c mut SqliteConnection, lease: &'c Leasing<'c>) -> Done<'c, Leased> {
        Box::pin(async move {
            let max_attempts = Self::attempts_arg(lease.max_attempts);
            let abandon = [lease.abandoned_error.into(), max_attempts];
            let abandoned = Self::fetch_all(conn, text(ABANDON), &abandon).await?;
            let orphan = [
                lease.lease_ms.into(),
                max_attempts,
                1_i64.into(),
                lease.token.into(),
            ];
            let mut rows = Self::fetch_all(conn, text(LEASE_ORPHAN), &orphan).await?;
            if rows.is_empty() {
                let fresh = [
                    lease.lease_ms.into(),
                    max_attempts,
                    lease.limit.into(),
                    lease.token.into(),
                ];
                rows = Self::fetch_all(conn, text(LEASE_FRESH), &fresh).await?;
            }
            let records = |rows: &[_]| -> Result<Vec<_>, sqlx::Error> {
                rows.iter().map(|row| record::<Self>(row, 0)).collect()
            };
            Ok((records(&rows)?, records(&abandoned)?))
        })
    }
}
