//! The outbox's store capability ([`OutboxStore`]) and its two dialects, with the
//! [`Component::Outbox`](super::Component::Outbox) migrations.
//!
//! Which rows the relay may publish, and in what order, is decided here, in one statement per
//! backend (see [`OutboxStore::lease_outbox`]):
//!
//! * **PostgreSQL**: a row is eligible once its writing transaction's id (`txid`, an `xid8`
//!   filled with `pg_current_xact_id()`) is below `pg_snapshot_xmin(pg_current_snapshot())`,
//!   the oldest transaction still running: every transaction that could still commit a row is
//!   then newer than every eligible row's. Rows are selected by status, never by an
//!   "id > last seen" cursor, so a row whose transaction commits late (with a lower id) is found
//!   by the first lease after its commit.
//! * **SQLite**: one writer at a time. A row's id is allocated inside its writing transaction,
//!   which holds the write lock until it commits, so transactions commit in id order and every
//!   committed row is eligible.

use std::future::Future;
use std::pin::Pin;

use sqlx::{Connection as _, PgConnection, Pool, Postgres, Row as _, Sqlite, SqliteConnection};

use super::InboxDatabase;
use crate::BoxFuture;

/// One row to write into `inbox_outbox`, validated by [`crate::outbox::Outbox::publish`].
#[derive(Debug, Clone, Copy)]
#[non_exhaustive]
pub struct OutboxRow<'a> {
    /// The stable message id (unique in the table).
    pub message_id: &'a str,
    /// Where the relay sends it: a sink's destination (a NATS subject, an AMQP exchange).
    pub destination: &'a str,
    /// The message's routing name.
    pub message_name: &'a str,
    /// The payload bytes (JSON for messages of this crate).
    pub payload: &'a [u8],
    /// The headers, as a JSON object of strings.
    pub headers_json: &'a str,
    /// The aggregate whose rows are published in order, if any.
    pub aggregate_id: Option<&'a str>,
}

impl<'a> OutboxRow<'a> {
    /// A row of these parts.
    pub fn new(
        message_id: &'a str,
        destination: &'a str,
        message_name: &'a str,
        payload: &'a [u8],
        headers_json: &'a str,
        aggregate_id: Option<&'a str>,
    ) -> Self {
        Self {
            message_id,
            destination,
            message_name,
            payload,
            headers_json,
            aggregate_id,
        }
    }
}

/// A row leased by the relay ([`OutboxStore::lease_outbox`]).
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct OutboxRecord {
    /// The row's id (its position in publication order).
    pub id: i64,
    /// The stable message id.
    pub message_id: String,
    /// The destination.
    pub destination: String,
    /// The message's routing name.
    pub message_name: String,
    /// The payload bytes.
    pub payload: Vec<u8>,
    /// The headers, as stored: a JSON object of strings.
    pub headers_json: String,
    /// The aggregate, if any.
    pub aggregate_id: Option<String>,
    /// Publish attempts so far, this one included (≥ 1).
    pub attempts: u32,
}

/// The status of an outbox row.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum OutboxStatus {
    /// Written and not yet published (or published and not yet marked, or failed and waiting
    /// for its next attempt).
    Pending,
    /// Published and acknowledged by the sink.
    Sent,
    /// Failed permanently or too often; blocks the rows after it of its aggregate until an
    /// operator intervenes.
    Dead,
}

impl OutboxStatus {
    /// The stored text: `pending`, `sent` or `dead`.
    pub fn as_str(self) -> &'static str {
        match self {
            OutboxStatus::Pending => "pending",
            OutboxStatus::Sent => "sent",
            OutboxStatus::Dead => "dead",
        }
    }

    fn parse(text: &str) -> Result<Self, sqlx::Error> {
        match text {
            "pending" => Ok(OutboxStatus::Pending),
            "sent" => Ok(OutboxStatus::Sent),
            "dead" => Ok(OutboxStatus::Dead),
            other => Err(sqlx::Error::Decode(
                format!("unknown outbox status {other:?}").into(),
            )),
        }
    }
}

impl std::fmt::Display for OutboxStatus {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// The outbox's statements on one connection. Implemented for `sqlx::PgConnection` and
/// `sqlx::SqliteConnection`; see [`ClaimStore`](super::ClaimStore) for implementing a backend of
/// your own. Every method but [`enqueue_outbox`](Self::enqueue_outbox) manages its own short
/// transaction (call them outside one).
pub trait OutboxStore: Send {
    /// Writes one row in the connection's current transaction (the caller's): `Ok(true)` if
    /// written, `Ok(false)` if a row with the same message id exists (nothing written, the
    /// transaction stays usable). With `notify`, PostgreSQL also queues a `NOTIFY inbox_outbox`
    /// (delivered at commit; dropped on rollback).
    fn enqueue_outbox<'c>(
        &'c mut self,
        row: &'c OutboxRow<'c>,
        notify: bool,
    ) -> BoxFuture<'c, Result<bool, sqlx::Error>>;

    /// Leases at most `limit` publishable rows for `lease_ms` milliseconds, counting an attempt
    /// on each, and returns them in id order. Publishable: `pending`, committed (see the module
    /// docs for each backend's rule), due (`next_attempt_at` passed), not leased by another
    /// relay, and without an earlier `pending` or `dead` row of the same aggregate, so that at
    /// most one row per aggregate is out at a time. Concurrent relays never lease the same row
    /// while its lease runs.
    fn lease_outbox(
        &mut self,
        limit: i64,
        lease_ms: i64,
    ) -> BoxFuture<'_, Result<Vec<OutboxRecord>, sqlx::Error>>;

    /// Marks the rows with these ids `sent` (only `pending` ones). Returns how many changed.
    fn mark_outbox_sent<'c>(
        &'c mut self,
        ids: &'c [i64],
    ) -> BoxFuture<'c, Result<u64, sqlx::Error>>;

    /// Records a failed publish of the `pending` row `id`: `dead` if `permanent` or its attempts
    /// reached `max_attempts`, else `pending` again with its next attempt `retry_in_ms` from now;
    /// the lease is released and `error` kept as its last error. Returns the new status, or
    /// `None` if the row is no longer pending.
    fn mark_outbox_failed<'c>(
        &'c mut self,
        id: i64,
        error: &'c str,
        permanent: bool,
        max_attempts: u32,
        retry_in_ms: i64,
    ) -> BoxFuture<'c, Result<Option<OutboxStatus>, sqlx::Error>>;

    /// Deletes at most `batch` `sent` rows sent more than `older_than_secs` ago. Returns how
    /// many went.
    fn purge_outbox_sent(
        &mut self,
        older_than_secs: f64,
        batch: i64,
    ) -> BoxFuture<'_, Result<u64, sqlx::Error>>;

    /// The backlog: how many rows are `pending`, and the age in seconds of the oldest (0 if
    /// none).
    fn outbox_backlog(&mut self) -> BoxFuture<'_, Result<(i64, f64), sqlx::Error>>;
}

/// Wake-ups for a relay: each item is a hint that rows may have been committed.
pub type Wakeups = Pin<Box<dyn futures_util::Stream<Item = ()> + Send>>;

/// A database an outbox can live in: its connections implement [`OutboxStore`], and it may
/// offer wake-ups (PostgreSQL: `LISTEN inbox_outbox`).
pub trait OutboxDatabase: InboxDatabase<Connection: OutboxStore> {
    /// A stream of wake-up hints, or `None` if the backend has none (the relay then polls).
    fn wakeups(pool: &Pool<Self>) -> impl Future<Output = Option<Wakeups>> + Send;
}

/// The notification channel the relay listens on and [`OutboxStore::enqueue_outbox`] notifies.
pub const NOTIFY_CHANNEL: &str = "inbox_outbox";

/// The outbox component's migrations on PostgreSQL.
pub(super) const POSTGRES_MIGRATIONS: &[(i64, &str, &str)] = &[(
    1,
    "outbox",
    include_str!("../../migrations/postgres/outbox/0001_outbox.sql"),
)];

/// The outbox component's migrations on SQLite.
pub(super) const SQLITE_MIGRATIONS: &[(i64, &str, &str)] = &[(
    1,
    "outbox",
    include_str!("../../migrations/sqlite/outbox/0001_outbox.sql"),
)];

/// The columns a lease returns, in [`record`]'s order (SQLite's `RETURNING` takes them
/// unqualified).
macro_rules! leased_columns {
    ($t:literal) => {
        concat!(
            $t,
            ".id, ",
            $t,
            ".message_id, ",
            $t,
            ".destination, ",
            $t,
            ".message_name, ",
            $t,
            ".payload, ",
            $t,
            ".headers, ",
            $t,
            ".aggregate_id, ",
            $t,
            ".attempts"
        )
    };
}

mod postgres {
    /// The insert; with `$7`, a notification queued in the same statement (the `note` CTE runs
    /// because the final SELECT reads it).
    pub(super) const ENQUEUE: &str = "WITH ins AS ( \
         INSERT INTO inbox_outbox \
           (message_id, destination, message_name, payload, headers, aggregate_id) \
         VALUES ($1, $2, $3, $4, $5, $6) \
         ON CONFLICT (message_id) DO NOTHING RETURNING id), \
       note AS (SELECT pg_notify('inbox_outbox', '') FROM ins WHERE $7) \
       SELECT id, (SELECT count(*) FROM note) AS notified FROM ins";

    /// The lease. `horizon`: the oldest transaction still running, as of this statement's
    /// snapshot; rows of older transactions are final (committed and visible, or rolled back
    /// and gone). `FOR UPDATE … SKIP LOCKED` and the re-checked lease keep two relays off the
    /// same row.
    pub(super) const LEASE: &str = concat!(
        "WITH horizon AS MATERIALIZED (SELECT pg_snapshot_xmin(pg_current_snapshot()) AS xmin), \
         picked AS ( \
           SELECT o.id FROM inbox_outbox o \
           WHERE o.status = 'pending' \
             AND o.txid < (SELECT xmin FROM horizon) \
             AND (o.next_attempt_at IS NULL OR o.next_attempt_at <= now()) \
             AND (o.leased_until IS NULL OR o.leased_until <= now()) \
             AND (o.aggregate_id IS NULL OR NOT EXISTS ( \
                   SELECT 1 FROM inbox_outbox e \
                   WHERE e.aggregate_id = o.aggregate_id AND e.id < o.id \
                     AND e.status IN ('pending', 'dead'))) \
           ORDER BY o.id LIMIT $1 \
           FOR UPDATE OF o SKIP LOCKED) \
         UPDATE inbox_outbox t SET attempts = t.attempts + 1, \
           leased_until = now() + $2 * interval '1 millisecond' \
         FROM picked WHERE t.id = picked.id \
         RETURNING ",
        leased_columns!("t")
    );

    pub(super) const MARK_SENT: &str = "UPDATE inbox_outbox SET status = 'sent', sent_at = now(), \
         leased_until = NULL, next_attempt_at = NULL, last_error = NULL \
       WHERE id = ANY($1) AND status = 'pending'";

    pub(super) const MARK_FAILED: &str = "UPDATE inbox_outbox SET \
         status = CASE WHEN $1 OR attempts >= $2 THEN 'dead' ELSE 'pending' END, \
         last_error = $3, leased_until = NULL, \
         next_attempt_at = now() + $4 * interval '1 millisecond' \
       WHERE id = $5 AND status = 'pending' RETURNING status";

    pub(super) const PURGE: &str = "DELETE FROM inbox_outbox WHERE id IN ( \
         SELECT id FROM inbox_outbox \
         WHERE status = 'sent' AND sent_at < now() - $1 * interval '1 second' \
         ORDER BY id LIMIT $2 FOR UPDATE SKIP LOCKED)";

    pub(super) const BACKLOG: &str = "SELECT COUNT(*), \
         COALESCE(EXTRACT(EPOCH FROM now() - MIN(created_at)), 0)::float8 \
       FROM inbox_outbox WHERE status = 'pending'";
}

mod sqlite {
    /// The database clock, as the outbox stores it.
    macro_rules! now {
        () => {
            "strftime('%Y-%m-%dT%H:%M:%fZ', 'now')"
        };
    }

    pub(super) const ENQUEUE: &str = "INSERT INTO inbox_outbox \
         (message_id, destination, message_name, payload, headers, aggregate_id) \
       VALUES ($1, $2, $3, $4, $5, $6) \
       ON CONFLICT (message_id) DO NOTHING RETURNING id";

    /// The lease, in a `BEGIN IMMEDIATE` transaction (the write lock held from the first read).
    /// SQLite numbers `$N` parameters in order of appearance: the lease (ms) is `$1` here.
    pub(super) const LEASE: &str = concat!(
        "UPDATE inbox_outbox AS t SET attempts = t.attempts + 1, \
           leased_until = strftime('%Y-%m-%dT%H:%M:%fZ', 'now', printf('+%.3f seconds', $1 / 1000.0)) \
         WHERE t.id IN ( \
           SELECT o.id FROM inbox_outbox o \
           WHERE o.status = 'pending' \
             AND (o.next_attempt_at IS NULL OR o.next_attempt_at <= ",
        now!(),
        ") AND (o.leased_until IS NULL OR o.leased_until <= ",
        now!(),
        ") AND (o.aggregate_id IS NULL OR NOT EXISTS ( \
                   SELECT 1 FROM inbox_outbox e \
                   WHERE e.aggregate_id = o.aggregate_id AND e.id < o.id \
                     AND e.status IN ('pending', 'dead'))) \
           ORDER BY o.id LIMIT $2) \
         RETURNING id, message_id, destination, message_name, payload, headers, aggregate_id, \
           attempts"
    );

    pub(super) const MARK_SENT: &str = concat!(
        "UPDATE inbox_outbox SET status = 'sent', sent_at = ",
        now!(),
        ", leased_until = NULL, next_attempt_at = NULL, last_error = NULL \
         WHERE id IN (SELECT value FROM json_each($1)) AND status = 'pending'"
    );

    pub(super) const MARK_FAILED: &str = "UPDATE inbox_outbox SET \
         status = CASE WHEN $1 OR attempts >= $2 THEN 'dead' ELSE 'pending' END, \
         last_error = $3, leased_until = NULL, \
         next_attempt_at = strftime('%Y-%m-%dT%H:%M:%fZ', 'now', printf('+%.3f seconds', $4 / 1000.0)) \
       WHERE id = $5 AND status = 'pending' RETURNING status";

    pub(super) const PURGE: &str = "DELETE FROM inbox_outbox WHERE id IN ( \
         SELECT id FROM inbox_outbox \
         WHERE status = 'sent' \
           AND sent_at < strftime('%Y-%m-%dT%H:%M:%fZ', 'now', printf('-%.3f seconds', $1)) \
         ORDER BY id LIMIT $2)";

    pub(super) const BACKLOG: &str = concat!(
        "SELECT COUNT(*), COALESCE((julianday(",
        now!(),
        ") - julianday(MIN(created_at))) * 86400.0, 0.0) \
         FROM inbox_outbox WHERE status = 'pending'"
    );
}

/// A leased row, from [`leased_columns`].
fn record<R>(row: &R) -> Result<OutboxRecord, sqlx::Error>
where
    R: sqlx::Row,
    for<'r> i64: sqlx::Decode<'r, R::Database> + sqlx::Type<R::Database>,
    for<'r> i32: sqlx::Decode<'r, R::Database> + sqlx::Type<R::Database>,
    for<'r> String: sqlx::Decode<'r, R::Database> + sqlx::Type<R::Database>,
    for<'r> Vec<u8>: sqlx::Decode<'r, R::Database> + sqlx::Type<R::Database>,
    usize: sqlx::ColumnIndex<R>,
{
    let attempts: i32 = row.try_get(7)?;
    Ok(OutboxRecord {
        id: row.try_get(0)?,
        message_id: row.try_get(1)?,
        destination: row.try_get(2)?,
        message_name: row.try_get(3)?,
        payload: row.try_get(4)?,
        headers_json: row.try_get(5)?,
        aggregate_id: row.try_get(6)?,
        attempts: u32::try_from(attempts).unwrap_or(0),
    })
}

fn sorted(mut records: Vec<OutboxRecord>) -> Vec<OutboxRecord> {
    records.sort_by_key(|r| r.id);
    records
}

impl OutboxStore for PgConnection {
    fn enqueue_outbox<'c>(
        &'c mut self,
        row: &'c OutboxRow<'c>,
        notify: bool,
    ) -> BoxFuture<'c, Result<bool, sqlx::Error>> {
        Box::pin(async move {
            let written = sqlx::query(postgres::ENQUEUE)
                .bind(row.message_id)
                .bind(row.destination)
                .bind(row.message_name)
                .bind(row.payload)
                .bind(row.headers_json)
                .bind(row.aggregate_id)
                .bind(notify)
                .fetch_optional(&mut *self)
                .await?;
            Ok(written.is_some())
        })
    }

    fn lease_outbox(
        &mut self,
        limit: i64,
        lease_ms: i64,
    ) -> BoxFuture<'_, Result<Vec<OutboxRecord>, sqlx::Error>> {
        Box::pin(async move {
            let rows = sqlx::query(postgres::LEASE)
                .bind(limit)
                .bind(lease_ms)
                .fetch_all(&mut *self)
                .await?;
            rows.iter()
                .map(record)
                .collect::<Result<_, _>>()
                .map(sorted)
        })
    }

    fn mark_outbox_sent<'c>(
        &'c mut self,
        ids: &'c [i64],
    ) -> BoxFuture<'c, Result<u64, sqlx::Error>> {
        Box::pin(async move {
            let done = sqlx::query(postgres::MARK_SENT)
                .bind(ids)
                .execute(&mut *self)
                .await?;
            Ok(done.rows_affected())
        })
    }

    fn mark_outbox_failed<'c>(
        &'c mut self,
        id: i64,
        error: &'c str,
        permanent: bool,
        max_attempts: u32,
        retry_in_ms: i64,
    ) -> BoxFuture<'c, Result<Option<OutboxStatus>, sqlx::Error>> {
        Box::pin(async move {
            let status: Option<String> = sqlx::query_scalar(postgres::MARK_FAILED)
                .bind(permanent)
                .bind(i32::try_from(max_attempts).unwrap_or(i32::MAX))
                .bind(error)
                .bind(retry_in_ms)
                .bind(id)
                .fetch_optional(&mut *self)
                .await?;
            status.as_deref().map(OutboxStatus::parse).transpose()
        })
    }

    fn purge_outbox_sent(
        &mut self,
        older_than_secs: f64,
        batch: i64,
    ) -> BoxFuture<'_, Result<u64, sqlx::Error>> {
        Box::pin(async move {
            let done = sqlx::query(postgres::PURGE)
                .bind(older_than_secs)
                .bind(batch)
                .execute(&mut *self)
                .await?;
            Ok(done.rows_affected())
        })
    }

    fn outbox_backlog(&mut self) -> BoxFuture<'_, Result<(i64, f64), sqlx::Error>> {
        Box::pin(async move {
            let row = sqlx::query(postgres::BACKLOG).fetch_one(&mut *self).await?;
            Ok((row.try_get(0)?, row.try_get(1)?))
        })
    }
}

impl OutboxStore for SqliteConnection {
    fn enqueue_outbox<'c>(
        &'c mut self,
        row: &'c OutboxRow<'c>,
        _notify: bool,
    ) -> BoxFuture<'c, Result<bool, sqlx::Error>> {
        Box::pin(async move {
            let written = sqlx::query(sqlite::ENQUEUE)
                .bind(row.message_id)
                .bind(row.destination)
                .bind(row.message_name)
                .bind(row.payload)
                .bind(row.headers_json)
                .bind(row.aggregate_id)
                .fetch_optional(&mut *self)
                .await?;
            Ok(written.is_some())
        })
    }

    fn lease_outbox(
        &mut self,
        limit: i64,
        lease_ms: i64,
    ) -> BoxFuture<'_, Result<Vec<OutboxRecord>, sqlx::Error>> {
        Box::pin(async move {
            let mut tx = self.begin_with("BEGIN IMMEDIATE").await?;
            let rows = sqlx::query(sqlite::LEASE)
                .bind(lease_ms)
                .bind(limit)
                .fetch_all(&mut *tx)
                .await?;
            let records = rows.iter().map(record).collect::<Result<_, _>>()?;
            tx.commit().await?;
            Ok(sorted(records))
        })
    }

    fn mark_outbox_sent<'c>(
        &'c mut self,
        ids: &'c [i64],
    ) -> BoxFuture<'c, Result<u64, sqlx::Error>> {
        Box::pin(async move {
            let ids = serde_json::to_string(ids).expect("integers serialize");
            let mut tx = self.begin_with("BEGIN IMMEDIATE").await?;
            let done = sqlx::query(sqlite::MARK_SENT)
                .bind(ids)
                .execute(&mut *tx)
                .await?;
            tx.commit().await?;
            Ok(done.rows_affected())
        })
    }

    fn mark_outbox_failed<'c>(
        &'c mut self,
        id: i64,
        error: &'c str,
        permanent: bool,
        max_attempts: u32,
        retry_in_ms: i64,
    ) -> BoxFuture<'c, Result<Option<OutboxStatus>, sqlx::Error>> {
        Box::pin(async move {
            let mut tx = self.begin_with("BEGIN IMMEDIATE").await?;
            let status: Option<String> = sqlx::query_scalar(sqlite::MARK_FAILED)
                .bind(permanent)
                .bind(i64::from(max_attempts))
                .bind(error)
                .bind(retry_in_ms)
                .bind(id)
                .fetch_optional(&mut *tx)
                .await?;
            tx.commit().await?;
            status.as_deref().map(OutboxStatus::parse).transpose()
        })
    }

    fn purge_outbox_sent(
        &mut self,
        older_than_secs: f64,
        batch: i64,
    ) -> BoxFuture<'_, Result<u64, sqlx::Error>> {
        Box::pin(async move {
            let mut tx = self.begin_with("BEGIN IMMEDIATE").await?;
            let done = sqlx::query(sqlite::PURGE)
                .bind(older_than_secs)
                .bind(batch)
                .execute(&mut *tx)
                .await?;
            tx.commit().await?;
            Ok(done.rows_affected())
        })
    }

    fn outbox_backlog(&mut self) -> BoxFuture<'_, Result<(i64, f64), sqlx::Error>> {
        Box::pin(async move {
            let row = sqlx::query(sqlite::BACKLOG).fetch_one(&mut *self).await?;
            Ok((row.try_get(0)?, row.try_get(1)?))
        })
    }
}

impl OutboxDatabase for Postgres {
    async fn wakeups(pool: &Pool<Self>) -> Option<Wakeups> {
        use futures_util::StreamExt as _;
        let mut listener = match sqlx::postgres::PgListener::connect_with(pool).await {
            Ok(listener) => listener,
            Err(error) => {
                tracing::warn!(%error, "outbox relay: LISTEN unavailable; polling only");
                return None;
            }
        };
        if let Err(error) = listener.listen(NOTIFY_CHANNEL).await {
            tracing::warn!(%error, "outbox relay: LISTEN failed; polling only");
            return None;
        }
        // A notification, or an error of the listener (it reconnects on the next receive, and
        // notifications sent meanwhile are lost): either way a hint to poll now.
        Some(Box::pin(listener.into_stream().map(|_| ())))
    }
}

impl OutboxDatabase for Sqlite {
    async fn wakeups(_pool: &Pool<Self>) -> Option<Wakeups> {
        None
    }
}
