//! The outbox's store capabilities ([`OutboxStore`], [`OutboxAdminStore`]), written once for
//! every backend whose database implements [`OutboxDialect`]: each backend's statements and
//! behavioural hooks live in its folder (`postgres/outbox.rs`, `sqlite/outbox.rs`,
//! `mysql/outbox.rs`), with the [`Component::Outbox`](super::Component::Outbox) migrations
//! beside them.
//!
//! Which rows the relay may publish, and in what order, is decided by each backend's lease (see
//! [`OutboxStore::lease_outbox`] and [`OutboxDialect::lease_rows`]): rows are selected by
//! status, never by an "id > last seen" cursor, so a row whose transaction commits late (with a
//! lower id) is found by the first lease after its commit. How a backend knows a row is
//! committed, and that no earlier row of its aggregate can still appear:
//!
//! * **PostgreSQL**: by the transaction horizon (`pg_snapshot_xmin`);
//! * **SQLite**: one writer at a time, so transactions commit in id order;
//! * **MySQL/MariaDB**: writers of one aggregate take turns on a lock row, and the relay decides
//!   from one snapshot, then locks by primary key.
//!
//! The details are in each backend's module.
//!
//! A mark (sent, failed) changes a row only while it carries the token of the lease that handed
//! it out ([`Lease::token`]).

use std::future::Future;
use std::pin::Pin;

use sqlx::{Pool, QueryBuilder};

use super::InboxDatabase;
use super::sql::{self, Arg, Done, Run, Scope, Scoped, Sql, Stmt};
use crate::BoxFuture;
use crate::setters::setters;

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
    /// The publishing span's W3C Trace Context, a JSON object of the `traceparent` and
    /// `tracestate` headers (see [`crate::trace`]); `None` ([`OutboxRow::new`]) without the
    /// feature `otel` or a valid current span: the column stays `NULL`.
    pub trace_context: Option<&'a str>,
    /// Write the row already `sent` (its `sent_at` its creation time), for an outbox that change
    /// data capture reads ([`Transport::ChangeDataCapture`](crate::outbox::Transport)): no relay
    /// ever leases it, and only the retention purge removes it. `false` ([`OutboxRow::new`]):
    /// `pending`, for the relay.
    pub sent: bool,
}

impl<'a> OutboxRow<'a> {
    /// A `pending` row of these parts.
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
            trace_context: None,
            sent: false,
        }
    }

    setters! {
        /// The same row with this W3C Trace Context (see [`OutboxRow::trace_context`]).
        pub fn traced(trace_context: Option<&'a str>) {
            self.trace_context = trace_context;
        }

        /// The same row, written already `sent` if `sent` (see [`OutboxRow::sent`]).
        pub fn settled(sent: bool) {
            self.sent = sent;
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
    /// The publishing span's W3C Trace Context as stored (a JSON object of the `traceparent`
    /// and `tracestate` headers, see [`crate::trace`]), if any.
    pub trace_context: Option<String>,
    /// Leases so far, this one included (≥ 1): each lease counts as an attempt, whether its
    /// publish then succeeded, failed, or never finished.
    pub attempts: u32,
    /// How old the row was when it was leased: the database clock's now minus `created_at`
    /// (PostgreSQL: the start of the writing transaction). Zero if the clocks disagree.
    pub age: std::time::Duration,
}

/// What one [`OutboxStore::lease_outbox`] did: the rows leased, and the rows it dead-lettered
/// because their leases ran out too often.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct Lease {
    /// The lease's token: a fresh UUID (version 7, as text) written into every row it leased.
    /// [`OutboxStore::mark_outbox_sent`] and [`OutboxStore::mark_outbox_failed`] change a row
    /// only while it still carries this token, so a relay that lost its lease (the lease ran out
    /// and another relay leased the row again, or an operator retried or discarded it) changes
    /// nothing.
    pub token: String,
    /// The rows leased to the caller, in id order.
    pub records: Vec<OutboxRecord>,
    /// Rows turned `dead` by this call: `pending` rows whose lease had run out (leased, never
    /// marked sent or failed: the relay that held them crashed, hung or was stopped
    /// mid-publish) after `max_attempts` leases. Their `attempts` is the number of leases.
    pub abandoned: Vec<OutboxRecord>,
}

/// The backlog of one destination: what the relay's gauges show
/// ([`OutboxStore::outbox_backlog`]).
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub struct OutboxBacklog {
    /// The destination.
    pub destination: String,
    /// Rows `pending` for it.
    pub pending: i64,
    /// Age of the oldest of them, in seconds on the database clock (from `created_at`).
    pub oldest_pending_secs: f64,
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
    /// Every status, in the order rows pass through them.
    pub const ALL: [OutboxStatus; 3] = [
        OutboxStatus::Pending,
        OutboxStatus::Sent,
        OutboxStatus::Dead,
    ];

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

/// The outbox's statements on one connection. Implemented for `sqlx::PgConnection`,
/// `sqlx::SqliteConnection` and `sqlx::MySqlConnection`. Every method but
/// [`enqueue_outbox`](Self::enqueue_outbox) manages its own short transaction (call them
/// outside one).
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

    /// Leases publishable rows for `lease_ms` milliseconds, counting an attempt on each and
    /// writing a fresh token into each ([`Lease::token`]: the marks require it), and returns
    /// them in id order. Publishable: `pending`, committed (see the module docs for each
    /// backend's rule), due (`next_attempt_at` passed), not leased by another relay, and without
    /// an earlier `pending` or `dead` row of the same aggregate, so that at most one row per
    /// aggregate is out at a time. Concurrent relays never lease the same row while its lease
    /// runs.
    ///
    /// Rows whose last lease ran out without a mark (**orphans**: a relay crashed, hung or was
    /// stopped while publishing them) come first, and **alone**: when one is publishable, only
    /// it is leased (the one with the fewest attempts, then the lowest id), so that a row that
    /// crashes every relay publishing it takes no other row down with it. Otherwise up to
    /// `limit` rows are leased. Before leasing, every orphan that already has `max_attempts`
    /// leases goes `dead` with `abandoned_error` as its last error
    /// ([`Lease::abandoned`]): a row that kills the relay every time ends dead instead of
    /// looping forever.
    fn lease_outbox<'c>(
        &'c mut self,
        limit: i64,
        lease_ms: i64,
        max_attempts: u32,
        abandoned_error: &'c str,
    ) -> BoxFuture<'c, Result<Lease, sqlx::Error>>;

    /// Marks the rows with these ids `sent`: the sink confirmed them. Only rows that still
    /// carry `token` (the [`Lease::token`] of the lease that handed them out): `pending` rows,
    /// and `dead` ones too (a row dead-lettered as abandoned while its relay was still
    /// publishing it, and then confirmed by that relay: it *was* sent). The token stays on the
    /// row. Returns the ids marked, ascending; an id left out changed nothing: its lease was
    /// lost (the row was leased again by another relay, retried or discarded by an operator,
    /// or is `sent` already).
    fn mark_outbox_sent<'c>(
        &'c mut self,
        ids: &'c [i64],
        token: &'c str,
    ) -> BoxFuture<'c, Result<Vec<i64>, sqlx::Error>>;

    /// Records a failed publish of the `pending` row `failure.id`, if it still carries
    /// `failure.token` (its [`Lease::token`]): `dead` if `failure.permanent` or its attempts
    /// reached `failure.max_attempts`, else `pending` again with its next attempt
    /// `failure.retry_in_ms` from now; the lease is released (its time and token cleared) and
    /// `failure.error` kept as its last error. Returns the new status, or
    /// `None` if nothing changed: the row is no longer pending, or its lease was lost (leased
    /// again by another relay, retried or discarded by an operator).
    fn mark_outbox_failed<'c>(
        &'c mut self,
        failure: OutboxFailure<'c>,
    ) -> BoxFuture<'c, Result<Option<OutboxStatus>, sqlx::Error>>;

    /// Deletes at most `batch` `sent` rows sent more than `older_than_secs` ago. Returns how
    /// many went.
    fn purge_outbox_sent(
        &mut self,
        older_than_secs: f64,
        batch: i64,
    ) -> BoxFuture<'_, Result<u64, sqlx::Error>>;

    /// The backlog per destination that has `pending` rows: how many, and the age of the
    /// oldest, by destination.
    fn outbox_backlog(&mut self) -> BoxFuture<'_, Result<Vec<OutboxBacklog>, sqlx::Error>>;
}

/// A failed publish to record ([`OutboxStore::mark_outbox_failed`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct OutboxFailure<'a> {
    /// The row's id ([`OutboxRecord::id`]).
    pub id: i64,
    /// The token of the lease the row was published under ([`Lease::token`]).
    pub token: &'a str,
    /// What went wrong, kept as the row's last error.
    pub error: &'a str,
    /// Whether the failure is permanent: the row turns `dead` whatever its attempts.
    pub permanent: bool,
    /// The attempts (leases) after which the row turns `dead`.
    pub max_attempts: u32,
    /// When the row may be leased again, in milliseconds from now (if it stays `pending`).
    pub retry_in_ms: i64,
}

/// One outbox row as operators see it ([`OutboxAdminStore`]): every column, times in the
/// database's text form (UTC on SQLite and MySQL; the session's time zone on PostgreSQL:
/// [`crate::ops::admin::utc_time`] shows either in UTC).
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct OutboxEntry {
    /// The row's id (its position in publication order).
    pub id: i64,
    /// The stable message id.
    pub message_id: String,
    /// The destination.
    pub destination: String,
    /// The message's routing name.
    pub message_name: String,
    /// The payload bytes; `None` in listings ([`OutboxAdminStore::list_outbox`]), which do not
    /// load them.
    pub payload: Option<Vec<u8>>,
    /// The payload's size in bytes.
    pub payload_size: i64,
    /// The headers as stored: a JSON object of strings.
    pub headers_json: String,
    /// The aggregate, if any.
    pub aggregate_id: Option<String>,
    /// PostgreSQL: the id of the transaction that wrote the row (`xid8`, as text); `None` on
    /// SQLite and MySQL.
    pub txid: Option<String>,
    /// When the row was written (PostgreSQL: when its transaction began).
    pub created_at: String,
    /// `pending`, `sent` or `dead`.
    pub status: OutboxStatus,
    /// Leases so far (each lease is an attempt).
    pub attempts: u32,
    /// When a failed row may be leased again, if it failed.
    pub next_attempt_at: Option<String>,
    /// Until when the row is leased to a relay, if it is (or was, and the lease ran out unmarked).
    pub leased_until: Option<String>,
    /// The last failed publish's error (kept after a retry, cleared when sent).
    pub last_error: Option<String>,
    /// When the sink confirmed it (or, for change data capture, when it was written).
    pub sent_at: Option<String>,
}

/// One line of the outbox's statistics ([`OutboxAdminStore::outbox_stats`]): the rows of one
/// destination in one status.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct OutboxStatsRow {
    /// The destination.
    pub destination: String,
    /// The status.
    pub status: OutboxStatus,
    /// How many rows.
    pub count: i64,
    /// The oldest time among them (database text form): `created_at` in
    /// [`OutboxAdminStore::outbox_stats`], `sent_at` in
    /// [`OutboxAdminStore::outbox_purge_preview`].
    pub oldest: Option<String>,
}

/// Operators' reads and writes on the outbox: statistics, listing, inspection, retry, discard,
/// the retention purge. Implemented for `sqlx::PgConnection`, `sqlx::SqliteConnection` and
/// `sqlx::MySqlConnection`; each method runs its own short statement (call them outside a
/// transaction). Every method but
/// [`outbox_installed`](Self::outbox_installed) fails with the database's "no such table" error
/// when the outbox component is not migrated.
pub trait OutboxAdminStore: Send {
    /// Whether the outbox table exists (the [`Component::Outbox`](super::Component::Outbox)
    /// migrations ran).
    fn outbox_installed(&mut self) -> BoxFuture<'_, Result<bool, sqlx::Error>>;

    /// Per destination and status: how many rows, and the oldest `created_at`; by destination,
    /// then status.
    fn outbox_stats(&mut self) -> BoxFuture<'_, Result<Vec<OutboxStatsRow>, sqlx::Error>>;

    /// Rows whose status is one of `statuses` (at most three; empty lists nothing), of one
    /// destination or all, by id (oldest first), at most `limit`, without their payloads.
    fn list_outbox<'c>(
        &'c mut self,
        statuses: &'c [OutboxStatus],
        destination: Option<&'c str>,
        limit: i64,
    ) -> BoxFuture<'c, Result<Vec<OutboxEntry>, sqlx::Error>>;

    /// The row with this message id, payload included, or `None`.
    fn fetch_outbox<'c>(
        &'c mut self,
        message_id: &'c str,
    ) -> BoxFuture<'c, Result<Option<OutboxEntry>, sqlx::Error>>;

    /// Turns `dead` rows `pending` again, their attempts reset to 0, lease (time and token) and
    /// retry time cleared (the last error stays until they are sent; a relay still holding an
    /// old lease on one can no longer mark it): the row with `message_id`, or, with
    /// `None`, every dead row (of `destination`, if given). PostgreSQL then notifies relays.
    /// Returns how many rows changed.
    fn retry_outbox<'c>(
        &'c mut self,
        message_id: Option<&'c str>,
        destination: Option<&'c str>,
    ) -> BoxFuture<'c, Result<u64, sqlx::Error>>;

    /// Deletes the `dead` row with `message_id`: it is never sent, and the rows after it of its
    /// aggregate are no longer held back (a relay still holding an old lease on it marks
    /// nothing). Returns whether a row went.
    fn discard_outbox<'c>(
        &'c mut self,
        message_id: &'c str,
    ) -> BoxFuture<'c, Result<bool, sqlx::Error>>;

    /// Deletes at most `batch` `sent` rows whose `sent_at` is before `cutoff` (a time in the
    /// database's text form, as [`PurgeClock::cutoff`](super::PurgeClock::cutoff) gives it).
    /// Returns how many went.
    fn purge_outbox_before<'c>(
        &'c mut self,
        cutoff: &'c str,
        batch: i64,
    ) -> BoxFuture<'c, Result<u64, sqlx::Error>>;

    /// What [`purge_outbox_before`](Self::purge_outbox_before) would delete, per destination:
    /// `sent` rows with `sent_at` before `cutoff`, their count and oldest `sent_at`.
    fn outbox_purge_preview<'c>(
        &'c mut self,
        cutoff: &'c str,
    ) -> BoxFuture<'c, Result<Vec<OutboxStatsRow>, sqlx::Error>>;
}

/// Wake-ups for a relay: each item is a hint that rows may have been committed.
pub type Wakeups = Pin<Box<dyn futures_util::Stream<Item = ()> + Send>>;

/// A database an outbox can live in: its connections implement [`OutboxStore`], and it may
/// offer wake-ups (PostgreSQL: `LISTEN inbox_outbox`).
pub trait OutboxDatabase: InboxDatabase<Connection: OutboxStore + OutboxAdminStore> {
    /// A stream of wake-up hints, or `None` if the backend has none (the relay then polls).
    fn wakeups(pool: &Pool<Self>) -> impl Future<Output = Option<Wakeups>> + Send;
}

impl<DB> OutboxDatabase for DB
where
    DB: OutboxDialect + InboxDatabase,
{
    fn wakeups(pool: &Pool<Self>) -> impl Future<Output = Option<Wakeups>> + Send {
        <DB as OutboxDialect>::wakeups(pool)
    }
}

/// The outbox component's migrations on a backend whose migration of each version is `sql`
/// (in version order): `(version, description, SQL)`.
pub(crate) const fn migrations(sql: [&'static str; 4]) -> [(i64, &'static str, &'static str); 4] {
    let [outbox, leases, tokens, trace] = sql;
    [
        (1, "outbox", outbox),
        (2, "outbox leases", leases),
        (3, "outbox lease tokens", tokens),
        (4, "outbox trace context", trace),
    ]
}

/// The notification channel the relay listens on and [`OutboxStore::enqueue_outbox`] notifies.
pub const NOTIFY_CHANNEL: &str = "inbox_outbox";

/// One backend's outbox statements and behavioural hooks; [`OutboxStore`] and
/// [`OutboxAdminStore`] are written once on top of them, for every connection of a database that
/// implements this.
///
/// The statements take their parameters (see [`Stmt`]) from each operation's list:
/// * [`ENQUEUE`](Self::ENQUEUE): message id, destination, message name, payload (bytes),
///   headers (JSON text), aggregate id (text or `NULL`), notify (bool), sent (bool), trace
///   context (JSON text or `NULL`);
/// * [`LOCK_AGGREGATE`](Self::LOCK_AGGREGATE): the aggregate id;
/// * [`MARK_FAILED`](Self::MARK_FAILED) and [`MARK_FAILED_READ`](Self::MARK_FAILED_READ):
///   permanent (bool), the maximum attempts ([`attempts_arg`](Self::attempts_arg)), the error,
///   the retry delay ([`delay_arg`](Self::delay_arg)), the row's id, the lease's token;
/// * [`PURGE`](Self::PURGE): the window in seconds (`f64`), the batch;
/// * [`LIST`](Self::LIST): three statuses, the destination (or `NULL`), the limit;
/// * [`FETCH`](Self::FETCH), [`DISCARD`](Self::DISCARD): the message id;
/// * [`RETRY`](Self::RETRY): the message id and the destination (each text or `NULL`);
/// * [`PURGE_BEFORE`](Self::PURGE_BEFORE): the cutoff (text), the batch;
///   [`PURGE_PREVIEW`](Self::PURGE_PREVIEW): the cutoff.
///
/// [`MARK_SENT`](Self::MARK_SENT) and [`MARK_SENT_LOCKED`](Self::MARK_SENT_LOCKED) are
/// templates for [`sql::assemble`]: `{list}` the ids, `{}` the lease's token.
pub(crate) trait OutboxDialect: Scoped {
    /// Writes a row, skipping a duplicate message id (see [`insert`](Self::insert)).
    const ENQUEUE: Stmt;
    /// On a dialect whose writers of one aggregate take turns on a lock row (MySQL): the
    /// upsert that locks the aggregate's row until the writing transaction ends, run before
    /// [`ENQUEUE`](Self::ENQUEUE) for a `pending` row with an aggregate.
    const LOCK_AGGREGATE: Option<Stmt> = None;
    /// The rows among `{list}` that still carry the token `{}` and may be marked sent: marked
    /// (`UPDATE … RETURNING id`), or, where [`MARK_SENT_LOCKED`](Self::MARK_SENT_LOCKED) is
    /// set, locked (`SELECT id … FOR UPDATE`). Their ids.
    const MARK_SENT: &'static str;
    /// On a dialect whose `UPDATE` returns no rows: marks sent the rows `{list}` that
    /// [`MARK_SENT`](Self::MARK_SENT) locked.
    const MARK_SENT_LOCKED: Option<&'static str> = None;
    /// A failed publish: `dead` or `pending` again, the lease released; returns the status
    /// unless [`MARK_FAILED_READ`](Self::MARK_FAILED_READ) reads it.
    const MARK_FAILED: Stmt;
    /// On a dialect whose `UPDATE` returns no rows: the status [`MARK_FAILED`](Self::MARK_FAILED)
    /// set, read in its transaction.
    const MARK_FAILED_READ: Option<Stmt> = None;
    /// Deletes a batch of `sent` rows sent before the window.
    const PURGE: Stmt;
    /// `destination, pending, oldest age (seconds, f64)` of the destinations with pending rows.
    const BACKLOG: Stmt;
    /// Whether the table exists ([`installed`](Self::installed) reads the answer).
    const INSTALLED: Stmt;
    /// `destination, status, count, oldest created_at (text)`.
    const STATS: Stmt;
    /// The [`entry_columns`] of rows in the statuses, of the destination if any, by id.
    const LIST: Stmt;
    /// The [`entry_columns`] (payload included) of the row with the message id.
    const FETCH: Stmt;
    /// Turns `dead` rows `pending` again, attempts, lease and retry time cleared.
    const RETRY: Stmt;
    /// Run after a [`RETRY`](Self::RETRY) that changed rows (PostgreSQL: a notification).
    const NOTIFY: Option<Stmt> = None;
    /// Deletes a `dead` row.
    const DISCARD: Stmt;
    /// Deletes a batch of `sent` rows sent before the cutoff, oldest first.
    const PURGE_BEFORE: Stmt;
    /// `destination, 'sent', count, oldest sent_at (text)` of the rows sent before the cutoff.
    const PURGE_PREVIEW: Stmt;

    /// The argument of a maximum of attempts: an `INT` (SQLite: a 64-bit integer).
    fn attempts_arg(max_attempts: u32) -> Arg<'static> {
        Arg::I32(Some(i32::try_from(max_attempts).unwrap_or(i32::MAX)))
    }

    /// The argument of a delay of `ms` milliseconds added to the database clock: the
    /// milliseconds (MySQL: microseconds, capped).
    fn delay_arg(ms: i64) -> Arg<'static> {
        Arg::I64(Some(ms))
    }

    /// Pushes a list of ids in this dialect's form (the `{list}` of a template).
    fn push_ids(builder: &mut QueryBuilder<Self>, ids: &[i64]);

    /// Runs [`ENQUEUE`](Self::ENQUEUE) with `params`: whether it wrote the row (`false`: a row
    /// with its message id exists; nothing written, the transaction stays usable). By default
    /// the insert returns the new row (`ON CONFLICT DO NOTHING RETURNING id`).
    fn insert<'c>(conn: &'c mut Self::Connection, params: &'c [Arg<'c>]) -> Done<'c, bool> {
        Box::pin(async move {
            let row = Self::ENQUEUE
                .run(conn, params, Self::fetch_optional)
                .await?;
            Ok(row.is_some())
        })
    }

    /// Whether the answer of [`INSTALLED`](Self::INSTALLED) says the table exists: by default
    /// a count of tables.
    fn installed(row: &Self::Row) -> Result<bool, sqlx::Error> {
        Ok(Self::i64_required(row, 0)? > 0)
    }

    /// The lease's statements (see [`OutboxStore::lease_outbox`]), in the lease's transaction
    /// (its [`Scope::Transaction`]): the rows leased with `lease.token`, and the rows turned
    /// dead as abandoned, each as the [`leased_columns`] give them ([`record`]).
    fn lease_rows<'c>(conn: &'c mut Self::Connection, lease: &'c Leasing<'c>) -> Done<'c, Leased>;

    /// After a purge: forgets what the writers no longer need of rows purged (MySQL: the lock
    /// rows of aggregates not written to since `cutoff`, at most `batch`). Nothing by default.
    fn forget_aggregates<'c>(
        _conn: &'c mut Self::Connection,
        _cutoff: Cutoff<'c>,
        _batch: i64,
    ) -> Done<'c, ()> {
        Box::pin(async { Ok(()) })
    }

    /// Wake-ups for a relay (see [`OutboxDatabase::wakeups`]): none by default.
    fn wakeups(_pool: &Pool<Self>) -> impl Future<Output = Option<Wakeups>> + Send {
        async { None }
    }
}

/// What a lease asks for ([`OutboxDialect::lease_rows`]).
#[derive(Debug, Clone, Copy)]
pub(crate) struct Leasing<'a> {
    /// The most rows to lease.
    pub(crate) limit: i64,
    /// How long, in milliseconds.
    pub(crate) lease_ms: i64,
    /// The leases a row may have had before it is dead as abandoned.
    pub(crate) max_attempts: u32,
    /// The last error of rows dead as abandoned.
    pub(crate) abandoned_error: &'a str,
    /// The lease's token.
    pub(crate) token: &'a str,
}

/// The rows a lease leased, and the rows it turned dead as abandoned.
pub(crate) type Leased = (Vec<OutboxRecord>, Vec<OutboxRecord>);

/// The cutoff of a purge ([`OutboxDialect::forget_aggregates`]).
#[derive(Debug, Clone, Copy)]
pub(crate) enum Cutoff<'a> {
    /// Now minus this many seconds.
    Window(f64),
    /// A time, in the database's text form.
    Before(&'a str),
}

/// The columns a lease returns, in [`record`]'s order, each prefixed with `$t` (`"t."`, or
/// `""`: SQLite's `RETURNING` takes them unqualified): the row's parts, its attempts, and its
/// age in milliseconds on the database clock (`$age`: the dialect's expression).
macro_rules! leased_columns {
    ($t:literal, $age:expr) => {
        concat!(
            $t,
            "id, ",
            $t,
            "message_id, ",
            $t,
            "destination, ",
            $t,
            "message_name, ",
            $t,
            "payload, ",
            $t,
            "headers, ",
            $t,
            "aggregate_id, ",
            $t,
            "trace_context, ",
            $t,
            "attempts, ",
            $age
        )
    };
}
pub(crate) use leased_columns;

/// The columns of an [`OutboxEntry`], in [`entry`]'s order, with the dialect's payload (or a
/// `NULL` of its type), transaction id and text cast.
macro_rules! entry_columns {
    ($payload:literal, $size:literal, $txid:literal) => {
        concat!(
            "id, message_id, destination, message_name, ",
            $payload,
            ", ",
            $size,
            ", headers, aggregate_id, ",
            $txid,
            ", CAST(created_at AS TEXT), status, attempts, CAST(next_attempt_at AS TEXT), \
             CAST(leased_until AS TEXT), last_error, CAST(sent_at AS TEXT)"
        )
    };
}
pub(crate) use entry_columns;

/// A leased row, from the [`leased_columns`] starting at column `from`.
pub(crate) fn record<D: Sql>(row: &D::Row, from: usize) -> Result<OutboxRecord, sqlx::Error> {
    let attempts = D::required(row, from + 8, D::i32)?;
    let age_ms = D::i64(row, from + 9)?;
    Ok(OutboxRecord {
        id: D::i64_required(row, from)?,
        message_id: D::text_required(row, from + 1)?,
        destination: D::text_required(row, from + 2)?,
        message_name: D::text_required(row, from + 3)?,
        payload: D::required(row, from + 4, D::bytes)?,
        headers_json: D::text_required(row, from + 5)?,
        aggregate_id: D::text(row, from + 6)?,
        trace_context: D::text(row, from + 7)?,
        attempts: u32::try_from(attempts).unwrap_or(0),
        age: std::time::Duration::from_millis(u64::try_from(age_ms.unwrap_or(0)).unwrap_or(0)),
    })
}

/// The first column of each row, an id.
pub(crate) fn ids<D: Sql>(rows: &[D::Row]) -> Result<Vec<i64>, sqlx::Error> {
    rows.iter().map(|row| D::i64_required(row, 0)).collect()
}

/// An [`OutboxEntry`], from the [`entry_columns`].
fn entry<D: Sql>(row: &D::Row) -> Result<OutboxEntry, sqlx::Error> {
    let status = D::text_required(row, 10)?;
    let attempts = D::required(row, 11, D::i32)?;
    Ok(OutboxEntry {
        id: D::i64_required(row, 0)?,
        message_id: D::text_required(row, 1)?,
        destination: D::text_required(row, 2)?,
        message_name: D::text_required(row, 3)?,
        payload: D::bytes(row, 4)?,
        payload_size: D::i64(row, 5)?.unwrap_or(0),
        headers_json: D::text_required(row, 6)?,
        aggregate_id: D::text(row, 7)?,
        txid: D::text(row, 8)?,
        created_at: D::text_required(row, 9)?,
        status: OutboxStatus::parse(&status)?,
        attempts: u32::try_from(attempts).unwrap_or(0),
        next_attempt_at: D::text(row, 12)?,
        leased_until: D::text(row, 13)?,
        last_error: D::text(row, 14)?,
        sent_at: D::text(row, 15)?,
    })
}

/// A line of statistics: destination, status, count, oldest.
fn stats_row<D: Sql>(row: &D::Row) -> Result<OutboxStatsRow, sqlx::Error> {
    let status = D::text_required(row, 1)?;
    Ok(OutboxStatsRow {
        destination: D::text_required(row, 0)?,
        status: OutboxStatus::parse(&status)?,
        count: D::i64_required(row, 2)?,
        oldest: D::text(row, 3)?,
    })
}

/// A line of the backlog: destination, pending, oldest age.
fn backlog_row<D: Sql>(row: &D::Row) -> Result<OutboxBacklog, sqlx::Error> {
    Ok(OutboxBacklog {
        destination: D::text_required(row, 0)?,
        pending: D::i64_required(row, 1)?,
        oldest_pending_secs: D::required(row, 2, D::f64)?,
    })
}

/// The statuses of a listing as three binds (repeating the last; `None` binds nothing).
fn three_statuses(statuses: &[OutboxStatus]) -> [Option<&'static str>; 3] {
    let mut out = [None; 3];
    for (slot, index) in out.iter_mut().zip(0..) {
        *slot = statuses
            .get(index)
            .or(statuses.last())
            .map(|status| status.as_str());
    }
    out
}

/// A fresh lease token ([`Lease::token`]): a UUIDv7 in text form, unique across relays and
/// processes (74 random bits beside the time).
fn lease_token() -> String {
    uuid::Uuid::now_v7().to_string()
}

fn sorted(mut records: Vec<OutboxRecord>) -> Vec<OutboxRecord> {
    records.sort_by_key(|r| r.id);
    records
}

/// A write of the store's own: one statement and its arguments.
type Write<'a> = (Stmt, Vec<Arg<'a>>);

/// Runs a [`Write`]: the rows it changed.
fn write_step<'t, D: Sql>(
    conn: &'t mut D::Connection,
    (stmt, args): &'t Write<'_>,
) -> Done<'t, u64> {
    Box::pin(stmt.run(conn, args, D::execute))
}

/// The enqueue's statements: the aggregate's lock row where the dialect has one (a row with an
/// aggregate, to be published by a relay), then the row.
fn enqueue_step<'t, D: OutboxDialect>(
    conn: &'t mut D::Connection,
    (row, notify): &'t (&OutboxRow<'_>, bool),
) -> Done<'t, bool> {
    Box::pin(async move {
        if let (Some(lock), Some(aggregate), false) =
            (D::LOCK_AGGREGATE, row.aggregate_id, row.sent)
        {
            lock.run(conn, &[aggregate.into()], D::execute).await?;
        }
        let params = [
            row.message_id.into(),
            row.destination.into(),
            row.message_name.into(),
            row.payload.into(),
            row.headers_json.into(),
            row.aggregate_id.into(),
            (*notify).into(),
            row.sent.into(),
            row.trace_context.into(),
        ];
        D::insert(conn, &params).await
    })
}

/// One lease, with a fresh token.
fn lease_step<'t, D: OutboxDialect>(
    conn: &'t mut D::Connection,
    (limit, lease_ms, max_attempts, abandoned_error): &'t (i64, i64, u32, &str),
) -> Done<'t, Lease> {
    Box::pin(async move {
        let token = lease_token();
        let leasing = Leasing {
            limit: *limit,
            lease_ms: *lease_ms,
            max_attempts: *max_attempts,
            abandoned_error,
            token: &token,
        };
        let (records, abandoned) = D::lease_rows(conn, &leasing).await?;
        Ok(Lease {
            token,
            records: sorted(records),
            abandoned: sorted(abandoned),
        })
    })
}

/// The sent marks: the markable rows among `ids` marked (or locked, then marked); their ids,
/// ascending.
fn mark_sent_step<'t, D: OutboxDialect>(
    conn: &'t mut D::Connection,
    (ids, token): &'t (&[i64], &str),
) -> Done<'t, Vec<i64>> {
    Box::pin(async move {
        let token = [Arg::from(*token)];
        let mut marking = sql::assemble::<D>(D::MARK_SENT, |b| D::push_ids(b, ids), &token);
        let mut marked = self::ids::<D>(&D::fetch_all_built(conn, &mut marking).await?)?;
        if let (Some(apply), false) = (D::MARK_SENT_LOCKED, marked.is_empty()) {
            let mut update = sql::assemble::<D>(apply, |b| D::push_ids(b, &marked), &[]);
            D::execute_built(conn, &mut update).await?;
        }
        marked.sort_unstable();
        Ok(marked)
    })
}

/// The failed mark: the status it set, if it changed the row.
fn mark_failed_step<'t, D: OutboxDialect>(
    conn: &'t mut D::Connection,
    failure: &'t OutboxFailure<'_>,
) -> Done<'t, Option<OutboxStatus>> {
    Box::pin(async move {
        let params = [
            failure.permanent.into(),
            D::attempts_arg(failure.max_attempts),
            failure.error.into(),
            D::delay_arg(failure.retry_in_ms),
            failure.id.into(),
            failure.token.into(),
        ];
        let row =
            sql::write_returning::<D>(conn, D::MARK_FAILED, D::MARK_FAILED_READ, &params).await?;
        let status = row.map(|row| D::text_required(&row, 0)).transpose()?;
        status.as_deref().map(OutboxStatus::parse).transpose()
    })
}

/// Runs `write` on its own ([`Scope::Statement`]): the rows it changed.
async fn write_alone<D: Scoped>(
    conn: &mut D::Connection,
    operation: &'static str,
    write: Write<'_>,
) -> Result<u64, sqlx::Error> {
    D::scoped(Run::new(
        conn,
        (Scope::Statement, operation),
        &write,
        write_step::<D>,
    ))
    .await
}

/// Deletes at most `batch` `sent` rows older than `cutoff` (a statement on its own), then what
/// the dialect forgets with them ([`OutboxDialect::forget_aggregates`]): the rows deleted.
async fn purge_sent<D: OutboxDialect>(
    conn: &mut D::Connection,
    cutoff: Cutoff<'_>,
    batch: i64,
) -> Result<u64, sqlx::Error> {
    let write = match cutoff {
        Cutoff::Window(older_than_secs) => (D::PURGE, vec![older_than_secs.into(), batch.into()]),
        Cutoff::Before(time) => (D::PURGE_BEFORE, vec![time.into(), batch.into()]),
    };
    let purged = write_alone::<D>(conn, "purge_outbox", write).await?;
    D::forget_aggregates(conn, cutoff, batch).await?;
    Ok(purged)
}

/// The operations that run in a [`Scope`], with their names.
const ENQUEUE: (Scope, &str) = (Scope::JoinElseTransaction, "enqueue_outbox");
const LEASE: (Scope, &str) = (Scope::Transaction, "lease_outbox");
const MARK_SENT: (Scope, &str) = (Scope::Transaction, "mark_outbox_sent");
const MARK_FAILED: (Scope, &str) = (Scope::Transaction, "mark_outbox_failed");

/// Every connection whose database has the outbox dialect.
impl<C> OutboxStore for C
where
    C: sqlx::Connection,
    C::Database: OutboxDialect<Connection = C>,
{
    fn enqueue_outbox<'c>(
        &'c mut self,
        row: &'c OutboxRow<'c>,
        notify: bool,
    ) -> BoxFuture<'c, Result<bool, sqlx::Error>> {
        let step = enqueue_step::<C::Database>;
        sql::scoped::<C::Database, _, _>(self, ENQUEUE, (row, notify), step)
    }

    fn lease_outbox<'c>(
        &'c mut self,
        limit: i64,
        lease_ms: i64,
        max_attempts: u32,
        abandoned_error: &'c str,
    ) -> BoxFuture<'c, Result<Lease, sqlx::Error>> {
        let args = (limit, lease_ms, max_attempts, abandoned_error);
        sql::scoped::<C::Database, _, _>(self, LEASE, args, lease_step::<C::Database>)
    }

    fn mark_outbox_sent<'c>(
        &'c mut self,
        ids: &'c [i64],
        token: &'c str,
    ) -> BoxFuture<'c, Result<Vec<i64>, sqlx::Error>> {
        if ids.is_empty() {
            return Box::pin(async { Ok(Vec::new()) });
        }
        let step = mark_sent_step::<C::Database>;
        sql::scoped::<C::Database, _, _>(self, MARK_SENT, (ids, token), step)
    }

    fn mark_outbox_failed<'c>(
        &'c mut self,
        failure: OutboxFailure<'c>,
    ) -> BoxFuture<'c, Result<Option<OutboxStatus>, sqlx::Error>> {
        let step = mark_failed_step::<C::Database>;
        sql::scoped::<C::Database, _, _>(self, MARK_FAILED, failure, step)
    }

    fn purge_outbox_sent(
        &mut self,
        older_than_secs: f64,
        batch: i64,
    ) -> BoxFuture<'_, Result<u64, sqlx::Error>> {
        let cutoff = Cutoff::Window(older_than_secs);
        Box::pin(purge_sent::<C::Database>(self, cutoff, batch))
    }

    fn outbox_backlog(&mut self) -> BoxFuture<'_, Result<Vec<OutboxBacklog>, sqlx::Error>> {
        let read = backlog_row::<C::Database>;
        Box::pin(sql::read_all::<C::Database, _>(
            self,
            C::Database::BACKLOG,
            &[],
            read,
        ))
    }
}

/// Every connection whose database has the outbox dialect.
impl<C> OutboxAdminStore for C
where
    C: sqlx::Connection,
    C::Database: OutboxDialect<Connection = C>,
{
    fn outbox_installed(&mut self) -> BoxFuture<'_, Result<bool, sqlx::Error>> {
        Box::pin(async move {
            let sql = sql::text(C::Database::INSTALLED.sql);
            let row = C::Database::fetch_one(self, sql, &[]).await?;
            C::Database::installed(&row)
        })
    }

    fn outbox_stats(&mut self) -> BoxFuture<'_, Result<Vec<OutboxStatsRow>, sqlx::Error>> {
        let read = stats_row::<C::Database>;
        Box::pin(sql::read_all::<C::Database, _>(
            self,
            C::Database::STATS,
            &[],
            read,
        ))
    }

    fn list_outbox<'c>(
        &'c mut self,
        statuses: &'c [OutboxStatus],
        destination: Option<&'c str>,
        limit: i64,
    ) -> BoxFuture<'c, Result<Vec<OutboxEntry>, sqlx::Error>> {
        Box::pin(async move {
            let [a, b, c] = three_statuses(statuses);
            let params = [
                a.into(),
                b.into(),
                c.into(),
                destination.into(),
                limit.into(),
            ];
            let read = entry::<C::Database>;
            sql::read_all::<C::Database, _>(self, C::Database::LIST, &params, read).await
        })
    }

    fn fetch_outbox<'c>(
        &'c mut self,
        message_id: &'c str,
    ) -> BoxFuture<'c, Result<Option<OutboxEntry>, sqlx::Error>> {
        Box::pin(async move {
            let params = [message_id.into()];
            let row = C::Database::FETCH
                .run(self, &params, C::Database::fetch_optional)
                .await?;
            row.as_ref().map(entry::<C::Database>).transpose()
        })
    }

    fn retry_outbox<'c>(
        &'c mut self,
        message_id: Option<&'c str>,
        destination: Option<&'c str>,
    ) -> BoxFuture<'c, Result<u64, sqlx::Error>> {
        Box::pin(async move {
            let write = (
                C::Database::RETRY,
                vec![message_id.into(), destination.into()],
            );
            let retried = write_alone::<C::Database>(self, "retry_outbox", write).await?;
            if let (Some(notify), true) = (C::Database::NOTIFY, retried > 0) {
                notify.run(self, &[], C::Database::execute).await?;
            }
            Ok(retried)
        })
    }

    fn discard_outbox<'c>(
        &'c mut self,
        message_id: &'c str,
    ) -> BoxFuture<'c, Result<bool, sqlx::Error>> {
        Box::pin(async move {
            let write = (C::Database::DISCARD, vec![message_id.into()]);
            Ok(write_alone::<C::Database>(self, "discard_outbox", write).await? > 0)
        })
    }

    fn purge_outbox_before<'c>(
        &'c mut self,
        cutoff: &'c str,
        batch: i64,
    ) -> BoxFuture<'c, Result<u64, sqlx::Error>> {
        Box::pin(purge_sent::<C::Database>(
            self,
            Cutoff::Before(cutoff),
            batch,
        ))
    }

    fn outbox_purge_preview<'c>(
        &'c mut self,
        cutoff: &'c str,
    ) -> BoxFuture<'c, Result<Vec<OutboxStatsRow>, sqlx::Error>> {
        Box::pin(async move {
            let (preview, read) = (C::Database::PURGE_PREVIEW, stats_row::<C::Database>);
            sql::read_all::<C::Database, _>(self, preview, &[cutoff.into()], read).await
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::sql::{check_binds, for_every_dialect};

    fn every_statement<D: OutboxDialect>() {
        check_binds("ENQUEUE", D::ENQUEUE, 9);
        for (name, stmt) in [("LOCK_AGGREGATE", D::LOCK_AGGREGATE), ("NOTIFY", D::NOTIFY)] {
            if let Some(stmt) = stmt {
                check_binds(name, stmt, if name == "NOTIFY" { 0 } else { 1 });
            }
        }
        check_binds("MARK_FAILED", D::MARK_FAILED, 6);
        if let Some(read) = D::MARK_FAILED_READ {
            check_binds("MARK_FAILED_READ", read, 6);
        }
        check_binds("PURGE", D::PURGE, 2);
        check_binds("BACKLOG", D::BACKLOG, 0);
        check_binds("INSTALLED", D::INSTALLED, 0);
        check_binds("STATS", D::STATS, 0);
        check_binds("LIST", D::LIST, 5);
        check_binds("FETCH", D::FETCH, 1);
        check_binds("RETRY", D::RETRY, 2);
        check_binds("DISCARD", D::DISCARD, 1);
        check_binds("PURGE_BEFORE", D::PURGE_BEFORE, 2);
        check_binds("PURGE_PREVIEW", D::PURGE_PREVIEW, 1);
    }

    /// Every dialect's statements bind as many arguments as their text takes.
    #[test]
    fn every_dialect_binds_what_its_statements_take() {
        for_every_dialect!(every_statement);
    }
}
