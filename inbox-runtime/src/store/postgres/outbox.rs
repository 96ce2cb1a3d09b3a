//! The outbox on PostgreSQL: the [`OutboxDialect`], with the outbox component's migrations.
//!
//! A row is eligible once its writing transaction's id (`txid`, an `xid8`
//! filled with `pg_current_xact_id()`) is below `pg_snapshot_xmin(pg_current_snapshot())`,
//! the oldest transaction still running: every transaction that could still commit a row is
//! then newer than every eligible row's. Rows are selected by status, never by an
//! "id > last seen" cursor, so a row whose transaction commits late (with a lower id) is found
//! by the first lease after its commit.
//!
//! Every statement is one statement: the lease (abandoned orphans, one orphan alone or fresh
//! rows, the lease itself) included; the enqueue queues a `NOTIFY inbox_outbox` in the same
//! statement when asked to, and an operator's retry that changed rows is followed by one.

use futures_util::StreamExt as _;
use sqlx::postgres::PgRow;
use sqlx::{PgConnection, Pool, Postgres, QueryBuilder};

use crate::store::outbox::{
    self, Leased, Leasing, NOTIFY_CHANNEL, OutboxDialect, Wakeups, entry_columns, leased_columns,
    record,
};
use crate::store::sql::{Done, Sql, Stmt, text};

/// The outbox component's migrations on PostgreSQL.
pub(super) const MIGRATIONS: &[(i64, &str, &str)] = &outbox::migrations([
    include_str!("migrations/outbox/0001_outbox.sql"),
    include_str!("migrations/outbox/0002_outbox_leases.sql"),
    include_str!("migrations/outbox/0003_outbox_lease_tokens.sql"),
    include_str!("migrations/outbox/0004_outbox_trace_context.sql"),
]);

/// A leased row's age in milliseconds.
macro_rules! age {
    ($t:literal) => {
        concat!(
            "CAST(EXTRACT(EPOCH FROM (now() - ",
            $t,
            ".created_at)) * 1000 AS BIGINT)"
        )
    };
}

/// Whether a row may be leased now (alias `o`): pending, due, not under a running lease
/// (an orphan whose lease ran out may be, if it has attempts left: `$3`), its transaction
/// older than every running one (`horizon`), first of its aggregate.
macro_rules! leasable {
    () => {
        "o.status = 'pending' \
         AND o.txid < (SELECT xmin FROM horizon) \
         AND (o.next_attempt_at IS NULL OR o.next_attempt_at <= now()) \
         AND (o.leased_until IS NULL OR (o.leased_until <= now() AND o.attempts < $3)) \
         AND (o.aggregate_id IS NULL OR NOT EXISTS ( \
               SELECT 1 FROM inbox_outbox e \
               WHERE e.aggregate_id = o.aggregate_id AND e.id < o.id \
                 AND e.status IN ('pending', 'dead')))"
    };
}

/// The lease, in one statement. `horizon`: the oldest transaction still running, as of this
/// statement's snapshot; rows of older transactions are final (committed and visible, or
/// rolled back and gone). `abandoned`: orphans out of attempts go dead (`$4`: the error).
/// `orphan`: one orphan with attempts left, alone; `fresh`: otherwise up to `$1` rows never
/// leased or settled since. `FOR UPDATE … SKIP LOCKED` and the re-checked lease keep two
/// relays off the same row; `$5` is the lease's token. The result: `kind` ('leased' or 'abandoned'), then the
/// [`leased_columns`].
const LEASE: &str = concat!(
    "WITH horizon AS MATERIALIZED (SELECT pg_snapshot_xmin(pg_current_snapshot()) AS xmin), \
     abandoned AS ( \
       UPDATE inbox_outbox t SET status = 'dead', last_error = $4, leased_until = NULL, \
         next_attempt_at = NULL \
       WHERE t.id IN ( \
         SELECT o.id FROM inbox_outbox o \
         WHERE o.status = 'pending' AND o.leased_until <= now() AND o.attempts >= $3 \
         ORDER BY o.id FOR UPDATE SKIP LOCKED) \
       RETURNING ",
    leased_columns!("t.", age!("t")),
    " AS age_ms), \
     orphan AS ( \
       SELECT o.id FROM inbox_outbox o \
       WHERE o.leased_until IS NOT NULL AND ",
    leasable!(),
    " ORDER BY o.attempts, o.id LIMIT 1 \
       FOR UPDATE OF o SKIP LOCKED), \
     fresh AS ( \
       SELECT o.id FROM inbox_outbox o \
       WHERE o.leased_until IS NULL AND NOT EXISTS (SELECT 1 FROM orphan) AND ",
    leasable!(),
    " ORDER BY o.id LIMIT $1 \
       FOR UPDATE OF o SKIP LOCKED), \
     leased AS ( \
       UPDATE inbox_outbox t SET attempts = t.attempts + 1, \
         leased_until = now() + $2 * interval '1 millisecond', lease_token = $5 \
       WHERE t.id IN (SELECT id FROM orphan UNION ALL SELECT id FROM fresh) \
       RETURNING ",
    leased_columns!("t.", age!("t")),
    " AS age_ms) \
     SELECT 'leased' AS kind, * FROM leased \
     UNION ALL SELECT 'abandoned', * FROM abandoned"
);

impl OutboxDialect for Postgres {
    /// With notify (`$7`), a notification queued in the same statement (the `note` CTE runs
    /// because the final SELECT reads it). With sent (`$8`), the row is written `sent` (change
    /// data capture).
    const ENQUEUE: Stmt = Stmt::new(
        "WITH ins AS ( \
         INSERT INTO inbox_outbox \
           (message_id, destination, message_name, payload, headers, aggregate_id, status, \
            sent_at, trace_context) \
         VALUES ($1, $2, $3, $4, $5, $6, CASE WHEN $8 THEN 'sent' ELSE 'pending' END, \
           CASE WHEN $8 THEN now() END, $9) \
         ON CONFLICT (message_id) DO NOTHING RETURNING id), \
       note AS (SELECT pg_notify('inbox_outbox', '') FROM ins WHERE $7 AND NOT $8) \
       SELECT id, (SELECT count(*) FROM note) AS notified FROM ins",
    );

    const MARK_SENT: &'static str = "UPDATE inbox_outbox SET status = 'sent', sent_at = now(), \
         leased_until = NULL, next_attempt_at = NULL, last_error = NULL \
       WHERE id = ANY({list}) AND lease_token = {} AND status IN ('pending', 'dead') RETURNING id";

    const MARK_FAILED: Stmt = Stmt::new(
        "UPDATE inbox_outbox SET \
         status = CASE WHEN $1 OR attempts >= $2 THEN 'dead' ELSE 'pending' END, \
         last_error = $3, leased_until = NULL, lease_token = NULL, \
         next_attempt_at = now() + $4 * interval '1 millisecond' \
       WHERE id = $5 AND lease_token = $6 AND status = 'pending' RETURNING status",
    );

    const PURGE: Stmt = Stmt::new(
        "DELETE FROM inbox_outbox WHERE id IN ( \
         SELECT id FROM inbox_outbox \
         WHERE status = 'sent' AND sent_at < now() - $1 * interval '1 second' \
         ORDER BY id LIMIT $2 FOR UPDATE SKIP LOCKED)",
    );

    const BACKLOG: Stmt = Stmt::new(
        "SELECT destination, COUNT(*), \
         COALESCE(EXTRACT(EPOCH FROM now() - MIN(created_at)), 0)::float8 \
       FROM inbox_outbox WHERE status = 'pending' GROUP BY destination ORDER BY destination",
    );

    /// In the schema the runtime's tables are created in (`current_schema()`, the first
    /// existing schema of the `search_path`: a [`PgSchema`](crate::PgSchema)'s), not wherever
    /// the `search_path` finds one: a service whose schema has no outbox must not see (and
    /// purge) the outbox of the service that uses `public`.
    const INSTALLED: Stmt = Stmt::new(
        "SELECT EXISTS (SELECT 1 FROM pg_catalog.pg_tables \
         WHERE schemaname = current_schema() AND tablename = 'inbox_outbox')",
    );

    const STATS: Stmt = Stmt::new(
        "SELECT destination, status, COUNT(*), \
         CAST(MIN(created_at) AS TEXT) FROM inbox_outbox \
       GROUP BY destination, status ORDER BY destination, status",
    );

    const LIST: Stmt = Stmt::new(concat!(
        "SELECT ",
        entry_columns!(
            "CAST(NULL AS BYTEA)",
            "CAST(octet_length(payload) AS BIGINT)",
            "CAST(txid AS TEXT)"
        ),
        " FROM inbox_outbox WHERE status IN ($1, $2, $3) \
           AND ($4::text IS NULL OR destination = $4) ORDER BY id LIMIT $5"
    ));

    const FETCH: Stmt = Stmt::new(concat!(
        "SELECT ",
        entry_columns!(
            "payload",
            "CAST(octet_length(payload) AS BIGINT)",
            "CAST(txid AS TEXT)"
        ),
        " FROM inbox_outbox WHERE message_id = $1"
    ));

    const RETRY: Stmt = Stmt::new(
        "UPDATE inbox_outbox SET status = 'pending', attempts = 0, \
         leased_until = NULL, lease_token = NULL, next_attempt_at = NULL \
       WHERE status = 'dead' AND ($1::text IS NULL OR message_id = $1) \
         AND ($2::text IS NULL OR destination = $2)",
    );

    const NOTIFY: Option<Stmt> = Some(Stmt::new("SELECT pg_notify('inbox_outbox', '')"));

    const DISCARD: Stmt =
        Stmt::new("DELETE FROM inbox_outbox WHERE message_id = $1 AND status = 'dead'");

    const PURGE_BEFORE: Stmt = Stmt::new(
        "DELETE FROM inbox_outbox WHERE id IN ( \
         SELECT id FROM inbox_outbox \
         WHERE status = 'sent' AND sent_at < CAST($1 AS TIMESTAMPTZ) \
         ORDER BY sent_at LIMIT $2 FOR UPDATE SKIP LOCKED)",
    );

    const PURGE_PREVIEW: Stmt = Stmt::new(
        "SELECT destination, 'sent', COUNT(*), \
         CAST(MIN(sent_at) AS TEXT) FROM inbox_outbox \
       WHERE status = 'sent' AND sent_at < CAST($1 AS TIMESTAMPTZ) \
       GROUP BY destination ORDER BY destination",
    );

    /// One array parameter (`int8[]`).
    fn push_ids(builder: &mut QueryBuilder<Self>, ids: &[i64]) {
        builder.push_bind(ids.to_vec());
    }

    /// A boolean.
    fn installed(row: &PgRow) -> Result<bool, sqlx::Error> {
        Self::required(row, 0, Self::bool)
    }

    /// The lease in one statement ([`LEASE`]): each row says whether it was leased or
    /// abandoned.
    fn lease_rows<'c>(conn: &'c mut PgConnection, lease: &'c Leasing<'c>) -> Done<'c, Leased> {
        Box::pin(async move {
            let params = [
                lease.limit.into(),
                lease.lease_ms.into(),
                Self::attempts_arg(lease.max_attempts),
                lease.abandoned_error.into(),
                lease.token.into(),
            ];
            let rows = Self::fetch_all(conn, text(LEASE), &params).await?;
            let (mut leased, mut abandoned) = (Vec::new(), Vec::new());
            for row in &rows {
                let kind = Self::text_required(row, 0)?;
                let record = record::<Self>(row, 1)?;
                if kind == "abandoned" {
                    abandoned.push(record);
                } else {
                    leased.push(record);
                }
            }
            Ok((leased, abandoned))
        })
    }

    /// `LISTEN inbox_outbox` (the channel under the [`TablePrefix`](crate::store::TablePrefix) in
    /// scope, as the publishes' `pg_notify` name it), on a connection of its own.
    async fn wakeups(pool: &Pool<Self>) -> Option<Wakeups> {
        let mut listener = match sqlx::postgres::PgListener::connect_with(pool).await {
            Ok(listener) => listener,
            Err(error) => {
                tracing::warn!(%error, "outbox relay: LISTEN unavailable; polling only");
                return None;
            }
        };
        let channel = match crate::store::TablePrefix::current() {
            Some(prefix) => prefix.table(NOTIFY_CHANNEL),
            None => NOTIFY_CHANNEL.to_owned(),
        };
        if let Err(error) = listener.listen(&channel).await {
            tracing::warn!(%error, "outbox relay: LISTEN failed; polling only");
            return None;
        }
        // A notification, or an error of the listener (it reconnects on the next receive, and
        // notifications sent meanwhile are lost): either way a hint to poll now.
        Some(Box::pin(listener.into_stream().map(|_| ())))
    }
}
