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
//! * **MySQL/MariaDB** (InnoDB): neither a transaction horizon nor one writer. AUTO_INCREMENT ids
//!   are allocated at insert and transactions commit out of id order, so the rule is per
//!   aggregate, and rests on the writers:
//!   1. *Writers of one aggregate take turns.* [`OutboxStore::enqueue_outbox`] first upserts the
//!      aggregate's row in `inbox_outbox_aggregates` (`INSERT … ON DUPLICATE KEY UPDATE`, keyed
//!      by the SHA-256 of the aggregate id), which locks it until the writing transaction ends,
//!      and only then inserts the outbox row (allocating its id). A second writer of the
//!      aggregate waits on the lock row until the first commits or rolls back, and allocates its
//!      ids after that. So whenever a row of an aggregate exists (committed or not), every
//!      lower-id row of the aggregate is final: committed, or rolled back and gone; and an
//!      aggregate's ids follow the order its writers took the lock. (Outside a transaction the
//!      two statements run in one of the store's own. "Outside" is asked of the server when
//!      sqlx counts no transaction: one begun with a raw `BEGIN` is the caller's too, and a
//!      `BEGIN` of the store's would commit it implicitly.) Rows without an aggregate take no lock
//!      row and promise no order among themselves: each is eligible once it is committed.
//!   2. *The relay decides from one snapshot, then locks by primary key.* The lease runs in a
//!      transaction of its own: consistent (non-locking) reads pick the candidates: `pending`,
//!      due, not under a running lease, and without an earlier `pending` or `dead` row of the
//!      aggregate, all as of one snapshot (REPEATABLE READ: the transaction's, taken at its
//!      first read; READ COMMITTED: each statement's). A candidate visible in the snapshot was
//!      committed before it, so by 1. every earlier row of its aggregate is in the snapshot in
//!      a final state: the per-aggregate check cannot miss a row still being written. Then
//!      `SELECT … WHERE id IN (…) … FOR UPDATE SKIP LOCKED` locks the candidates that are still
//!      leasable at their latest committed version (a row another relay is leasing or marking is
//!      skipped, one it leased meanwhile fails the re-check), and an `UPDATE … WHERE id IN (…)`
//!      leases them. Rows are chosen by status, never by an "id > last seen" cursor, so a row
//!      committed late is found by the next lease.
//!
//!   Locks, under REPEATABLE READ (InnoDB's default) and READ COMMITTED alike: the writer's
//!   upsert takes an exclusive lock on the aggregate's lock-row record (a new row: an
//!   insert-intention lock on its gap, then the record; an existing one: the duplicate check's
//!   exclusive next-key lock, gap locks included even in READ COMMITTED), held until the writer
//!   ends; the outbox insert takes insert-intention locks and the new row's record lock (and a
//!   shared lock on the existing entry when the message id is a duplicate). The relay's
//!   consistent reads take no locks; its `FOR UPDATE SKIP LOCKED`, `UPDATE`s, marks, retries
//!   and discards look rows up by primary key or by message id (a unique index): record locks
//!   on the rows they name (REPEATABLE READ adds a gap lock only where a named row no longer
//!   exists). The purges delete `sent` rows through the `(status, sent_at)` index: next-key
//!   locks on that range under REPEATABLE READ (so a change-data-capture insert, written `sent`,
//!   may wait for a purge, or a purge for it), record locks under READ COMMITTED. Apart from
//!   that, no relay statement waits for a writer nor a writer for a relay: writers lock only
//!   their own new rows and the lock rows, which relays never touch, and relays lock only rows
//!   they read as committed. SERIALIZABLE (where plain reads lock) is not supported.
//!
//!   A deadlock (1213) or lock wait timeout (1205) in a statement the store runs on its own
//!   (every [`OutboxStore`] and [`OutboxAdminStore`] method, and the enqueue outside a
//!   transaction) is retried internally, as the inbox's are, and counted in
//!   [`mysql_lock_retries`](crate::mysql_lock_retries). In the caller's transaction the enqueue
//!   returns them (transient: see [`crate::Classify`]); a transaction
//!   that publishes to several aggregates takes their lock rows in the order it publishes, so
//!   two that publish to the same aggregates in opposite orders can deadlock (and are retried
//!   as a whole by the protocol). A duplicate message id fails only the insert (MySQL rolls back
//!   the statement, not the transaction): the enqueue answers `Ok(false)`. The retention purges
//!   ([`OutboxStore::purge_outbox_sent`], [`OutboxAdminStore::purge_outbox_before`]) also delete
//!   the lock rows of aggregates not written to since their cutoff (skipping those a writer
//!   holds): a lock row only makes concurrent writers take turns, and the next writer of the
//!   aggregate creates it again (writers queued behind the purge's delete re-create it one at a
//!   time: `tests/mysql_outbox.rs`).
//!
//!   Limits: an aggregate's writers run one at a time for as long as each transaction lasts;
//!   the order rests on one primary's locks and `AUTO_INCREMENT` (not Galera or other
//!   multi-primary setups); a row must fit the server's `max_allowed_packet` (a larger one fails
//!   the publish with 1153, never truncated); leases and retry delays are capped at 100 years
//!   (`DATE_ADD` past the year 9999 fails or answers NULL, which would read as "not leased").

use std::future::Future;
use std::pin::Pin;

use sqlx::{
    Connection as _, MySql, MySqlConnection, PgConnection, Pool, Postgres, Row as _, Sqlite,
    SqliteConnection,
};

use super::InboxDatabase;
use super::mysql::retry_lock_errors;
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
    /// Write the row already `sent` (its `sent_at` its creation time), for an outbox that change
    /// data capture reads ([`Delivery::ChangeDataCapture`](crate::outbox::Delivery)): no relay
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
            sent: false,
        }
    }

    /// The same row, written already `sent` if `sent` (see [`OutboxRow::sent`]).
    pub fn settled(mut self, sent: bool) -> Self {
        self.sent = sent;
        self
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
/// `sqlx::SqliteConnection` and `sqlx::MySqlConnection`; see [`ClaimStore`](super::ClaimStore) for implementing a backend of
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

    /// Leases publishable rows for `lease_ms` milliseconds, counting an attempt on each, and
    /// returns them in id order. Publishable: `pending`, committed (see the module docs for each
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

    /// Marks the rows with these ids `sent`: the sink confirmed them. `pending` rows, and
    /// `dead` ones too (a row dead-lettered while a relay that had lost its lease was still
    /// publishing it, and then confirmed: it *was* sent). Returns how many changed.
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

    /// The backlog per destination that has `pending` rows: how many, and the age of the
    /// oldest, by destination.
    fn outbox_backlog(&mut self) -> BoxFuture<'_, Result<Vec<OutboxBacklog>, sqlx::Error>>;
}

/// One outbox row as operators see it ([`OutboxAdminStore`]): every column, times in the
/// database's text form (UTC on SQLite and MySQL; the session's time zone on PostgreSQL:
/// [`crate::admin::utc_time`] shows either in UTC).
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
/// `sqlx::MySqlConnection`; each
/// method runs its own short statement (call them outside a transaction). Every method but
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

    /// Turns `dead` rows `pending` again, their attempts reset to 0, lease and retry time
    /// cleared (the last error stays until they are sent): the row with `message_id`, or, with
    /// `None`, every dead row (of `destination`, if given). PostgreSQL then notifies relays.
    /// Returns how many rows changed.
    fn retry_outbox<'c>(
        &'c mut self,
        message_id: Option<&'c str>,
        destination: Option<&'c str>,
    ) -> BoxFuture<'c, Result<u64, sqlx::Error>>;

    /// Deletes the `dead` row with `message_id`: it is never sent, and the rows after it of its
    /// aggregate are no longer held back. Returns whether a row went.
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

/// The notification channel the relay listens on and [`OutboxStore::enqueue_outbox`] notifies.
pub const NOTIFY_CHANNEL: &str = "inbox_outbox";

/// The outbox component's migrations on PostgreSQL.
pub(super) const POSTGRES_MIGRATIONS: &[(i64, &str, &str)] = &[
    (
        1,
        "outbox",
        include_str!("../../migrations/postgres/outbox/0001_outbox.sql"),
    ),
    (
        2,
        "outbox leases",
        include_str!("../../migrations/postgres/outbox/0002_outbox_leases.sql"),
    ),
];

/// The outbox component's migrations on SQLite.
pub(super) const SQLITE_MIGRATIONS: &[(i64, &str, &str)] = &[
    (
        1,
        "outbox",
        include_str!("../../migrations/sqlite/outbox/0001_outbox.sql"),
    ),
    (
        2,
        "outbox leases",
        include_str!("../../migrations/sqlite/outbox/0002_outbox_leases.sql"),
    ),
];

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
            "attempts, ",
            $age
        )
    };
}

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

mod postgres {
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

    /// The insert; with `$7`, a notification queued in the same statement (the `note` CTE runs
    /// because the final SELECT reads it). With `$8`, the row is written `sent` (change data
    /// capture).
    pub(super) const ENQUEUE: &str = "WITH ins AS ( \
         INSERT INTO inbox_outbox \
           (message_id, destination, message_name, payload, headers, aggregate_id, status, \
            sent_at) \
         VALUES ($1, $2, $3, $4, $5, $6, CASE WHEN $8 THEN 'sent' ELSE 'pending' END, \
           CASE WHEN $8 THEN now() END) \
         ON CONFLICT (message_id) DO NOTHING RETURNING id), \
       note AS (SELECT pg_notify('inbox_outbox', '') FROM ins WHERE $7 AND NOT $8) \
       SELECT id, (SELECT count(*) FROM note) AS notified FROM ins";

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
    /// relays off the same row. The result: `kind` ('leased' or 'abandoned'), then the
    /// [`leased_columns`].
    pub(super) const LEASE: &str = concat!(
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
             leased_until = now() + $2 * interval '1 millisecond' \
           WHERE t.id IN (SELECT id FROM orphan UNION ALL SELECT id FROM fresh) \
           RETURNING ",
        leased_columns!("t.", age!("t")),
        " AS age_ms) \
         SELECT 'leased' AS kind, * FROM leased \
         UNION ALL SELECT 'abandoned', * FROM abandoned"
    );

    pub(super) const MARK_SENT: &str = "UPDATE inbox_outbox SET status = 'sent', sent_at = now(), \
         leased_until = NULL, next_attempt_at = NULL, last_error = NULL \
       WHERE id = ANY($1) AND status IN ('pending', 'dead')";

    pub(super) const MARK_FAILED: &str = "UPDATE inbox_outbox SET \
         status = CASE WHEN $1 OR attempts >= $2 THEN 'dead' ELSE 'pending' END, \
         last_error = $3, leased_until = NULL, \
         next_attempt_at = now() + $4 * interval '1 millisecond' \
       WHERE id = $5 AND status = 'pending' RETURNING status";

    pub(super) const PURGE: &str = "DELETE FROM inbox_outbox WHERE id IN ( \
         SELECT id FROM inbox_outbox \
         WHERE status = 'sent' AND sent_at < now() - $1 * interval '1 second' \
         ORDER BY id LIMIT $2 FOR UPDATE SKIP LOCKED)";

    pub(super) const BACKLOG: &str = "SELECT destination, COUNT(*), \
         COALESCE(EXTRACT(EPOCH FROM now() - MIN(created_at)), 0)::float8 \
       FROM inbox_outbox WHERE status = 'pending' GROUP BY destination ORDER BY destination";

    pub(super) const INSTALLED: &str = "SELECT to_regclass('inbox_outbox') IS NOT NULL";

    pub(super) const STATS: &str = "SELECT destination, status, COUNT(*), \
         CAST(MIN(created_at) AS TEXT) FROM inbox_outbox \
       GROUP BY destination, status ORDER BY destination, status";

    pub(super) const LIST: &str = concat!(
        "SELECT ",
        entry_columns!(
            "CAST(NULL AS BYTEA)",
            "CAST(octet_length(payload) AS BIGINT)",
            "CAST(txid AS TEXT)"
        ),
        " FROM inbox_outbox WHERE status IN ($1, $2, $3) \
           AND ($4::text IS NULL OR destination = $4) ORDER BY id LIMIT $5"
    );

    pub(super) const FETCH: &str = concat!(
        "SELECT ",
        entry_columns!(
            "payload",
            "CAST(octet_length(payload) AS BIGINT)",
            "CAST(txid AS TEXT)"
        ),
        " FROM inbox_outbox WHERE message_id = $1"
    );

    pub(super) const RETRY: &str = "UPDATE inbox_outbox SET status = 'pending', attempts = 0, \
         leased_until = NULL, next_attempt_at = NULL \
       WHERE status = 'dead' AND ($1::text IS NULL OR message_id = $1) \
         AND ($2::text IS NULL OR destination = $2)";

    pub(super) const NOTIFY: &str = "SELECT pg_notify('inbox_outbox', '')";

    pub(super) const DISCARD: &str =
        "DELETE FROM inbox_outbox WHERE message_id = $1 AND status = 'dead'";

    pub(super) const PURGE_BEFORE: &str = "DELETE FROM inbox_outbox WHERE id IN ( \
         SELECT id FROM inbox_outbox \
         WHERE status = 'sent' AND sent_at < CAST($1 AS TIMESTAMPTZ) \
         ORDER BY sent_at LIMIT $2 FOR UPDATE SKIP LOCKED)";

    pub(super) const PURGE_PREVIEW: &str = "SELECT destination, 'sent', COUNT(*), \
         CAST(MIN(sent_at) AS TEXT) FROM inbox_outbox \
       WHERE status = 'sent' AND sent_at < CAST($1 AS TIMESTAMPTZ) \
       GROUP BY destination ORDER BY destination";
}

mod sqlite {
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

    /// With `$7`, the row is written `sent` (change data capture).
    pub(super) const ENQUEUE: &str = concat!(
        "INSERT INTO inbox_outbox \
         (message_id, destination, message_name, payload, headers, aggregate_id, status, sent_at) \
       VALUES ($1, $2, $3, $4, $5, $6, CASE WHEN $7 THEN 'sent' ELSE 'pending' END, \
         CASE WHEN $7 THEN ",
        now!(),
        " END) \
       ON CONFLICT (message_id) DO NOTHING RETURNING id"
    );

    /// Orphans out of attempts go dead (the first statement of the lease's `BEGIN IMMEDIATE`
    /// transaction). `$1`: the error, `$2`: the maximum attempts.
    pub(super) const ABANDON: &str = concat!(
        "UPDATE inbox_outbox SET status = 'dead', last_error = $1, leased_until = NULL, \
           next_attempt_at = NULL \
         WHERE status = 'pending' AND leased_until IS NOT NULL AND leased_until <= ",
        now!(),
        " AND attempts >= $2 RETURNING ",
        leased_columns!("", age!())
    );

    /// Leases the rows of the inner SELECT (its `o.leased_until` condition and LIMIT follow).
    /// SQLite numbers `$N` parameters in order of appearance: the lease (ms) is `$1` here, the
    /// maximum attempts `$2` (an orphan out of attempts was dead-lettered just before, in the
    /// same transaction).
    macro_rules! lease {
        ($which:literal, $order:literal) => {
            concat!(
                "UPDATE inbox_outbox SET attempts = attempts + 1, \
                   leased_until = strftime('%Y-%m-%dT%H:%M:%fZ', 'now', \
                     printf('+%.3f seconds', $1 / 1000.0)) \
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
    pub(super) const LEASE_ORPHAN: &str = lease!("o.leased_until IS NOT NULL", "o.attempts, o.id");

    /// Up to `$3` rows never leased or settled since.
    pub(super) const LEASE_FRESH: &str = lease!("o.leased_until IS NULL", "o.id");

    pub(super) const MARK_SENT: &str = concat!(
        "UPDATE inbox_outbox SET status = 'sent', sent_at = ",
        now!(),
        ", leased_until = NULL, next_attempt_at = NULL, last_error = NULL \
         WHERE id IN (SELECT value FROM json_each($1)) AND status IN ('pending', 'dead')"
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
        "SELECT destination, COUNT(*), COALESCE((julianday(",
        now!(),
        ") - julianday(MIN(created_at))) * 86400.0, 0.0) \
         FROM inbox_outbox WHERE status = 'pending' GROUP BY destination ORDER BY destination"
    );

    pub(super) const INSTALLED: &str = "SELECT COUNT(*) FROM sqlite_master \
       WHERE type = 'table' AND name = 'inbox_outbox'";

    pub(super) const STATS: &str = "SELECT destination, status, COUNT(*), MIN(created_at) \
       FROM inbox_outbox GROUP BY destination, status ORDER BY destination, status";

    pub(super) const LIST: &str = concat!(
        "SELECT ",
        entry_columns!(
            "CAST(NULL AS BLOB)",
            "length(payload)",
            "CAST(NULL AS TEXT)"
        ),
        " FROM inbox_outbox WHERE status IN ($1, $2, $3) \
           AND ($4 IS NULL OR destination = $4) ORDER BY id LIMIT $5"
    );

    pub(super) const FETCH: &str = concat!(
        "SELECT ",
        entry_columns!("payload", "length(payload)", "CAST(NULL AS TEXT)"),
        " FROM inbox_outbox WHERE message_id = $1"
    );

    pub(super) const RETRY: &str = "UPDATE inbox_outbox SET status = 'pending', attempts = 0, \
         leased_until = NULL, next_attempt_at = NULL \
       WHERE status = 'dead' AND ($1 IS NULL OR message_id = $1) \
         AND ($2 IS NULL OR destination = $2)";

    pub(super) const DISCARD: &str =
        "DELETE FROM inbox_outbox WHERE message_id = $1 AND status = 'dead'";

    pub(super) const PURGE_BEFORE: &str = "DELETE FROM inbox_outbox WHERE id IN ( \
         SELECT id FROM inbox_outbox WHERE status = 'sent' AND sent_at < $1 \
         ORDER BY sent_at LIMIT $2)";

    pub(super) const PURGE_PREVIEW: &str = "SELECT destination, 'sent', COUNT(*), MIN(sent_at) \
       FROM inbox_outbox WHERE status = 'sent' AND sent_at < $1 \
       GROUP BY destination ORDER BY destination";
}

/// A leased row, from the [`leased_columns`] starting at column `from`.
fn record<R>(row: &R, from: usize) -> Result<OutboxRecord, sqlx::Error>
where
    R: sqlx::Row,
    for<'r> i64: sqlx::Decode<'r, R::Database> + sqlx::Type<R::Database>,
    for<'r> i32: sqlx::Decode<'r, R::Database> + sqlx::Type<R::Database>,
    for<'r> String: sqlx::Decode<'r, R::Database> + sqlx::Type<R::Database>,
    for<'r> Vec<u8>: sqlx::Decode<'r, R::Database> + sqlx::Type<R::Database>,
    usize: sqlx::ColumnIndex<R>,
{
    let attempts: i32 = row.try_get(from + 7)?;
    let age_ms: Option<i64> = row.try_get(from + 8)?;
    Ok(OutboxRecord {
        id: row.try_get(from)?,
        message_id: row.try_get(from + 1)?,
        destination: row.try_get(from + 2)?,
        message_name: row.try_get(from + 3)?,
        payload: row.try_get(from + 4)?,
        headers_json: row.try_get(from + 5)?,
        aggregate_id: row.try_get(from + 6)?,
        attempts: u32::try_from(attempts).unwrap_or(0),
        age: std::time::Duration::from_millis(u64::try_from(age_ms.unwrap_or(0)).unwrap_or(0)),
    })
}

/// An [`OutboxEntry`], from the [`entry_columns`].
fn entry<R>(row: &R) -> Result<OutboxEntry, sqlx::Error>
where
    R: sqlx::Row,
    for<'r> i64: sqlx::Decode<'r, R::Database> + sqlx::Type<R::Database>,
    for<'r> i32: sqlx::Decode<'r, R::Database> + sqlx::Type<R::Database>,
    for<'r> String: sqlx::Decode<'r, R::Database> + sqlx::Type<R::Database>,
    for<'r> Vec<u8>: sqlx::Decode<'r, R::Database> + sqlx::Type<R::Database>,
    usize: sqlx::ColumnIndex<R>,
{
    let status: String = row.try_get(10)?;
    let attempts: i32 = row.try_get(11)?;
    Ok(OutboxEntry {
        id: row.try_get(0)?,
        message_id: row.try_get(1)?,
        destination: row.try_get(2)?,
        message_name: row.try_get(3)?,
        payload: row.try_get(4)?,
        payload_size: row.try_get::<Option<i64>, _>(5)?.unwrap_or(0),
        headers_json: row.try_get(6)?,
        aggregate_id: row.try_get(7)?,
        txid: row.try_get(8)?,
        created_at: row.try_get(9)?,
        status: OutboxStatus::parse(&status)?,
        attempts: u32::try_from(attempts).unwrap_or(0),
        next_attempt_at: row.try_get(12)?,
        leased_until: row.try_get(13)?,
        last_error: row.try_get(14)?,
        sent_at: row.try_get(15)?,
    })
}

/// A line of statistics: destination, status, count, oldest.
fn stats_row<R>(row: &R) -> Result<OutboxStatsRow, sqlx::Error>
where
    R: sqlx::Row,
    for<'r> i64: sqlx::Decode<'r, R::Database> + sqlx::Type<R::Database>,
    for<'r> String: sqlx::Decode<'r, R::Database> + sqlx::Type<R::Database>,
    usize: sqlx::ColumnIndex<R>,
{
    let status: String = row.try_get(1)?;
    Ok(OutboxStatsRow {
        destination: row.try_get(0)?,
        status: OutboxStatus::parse(&status)?,
        count: row.try_get(2)?,
        oldest: row.try_get(3)?,
    })
}

/// A line of the backlog: destination, pending, oldest age.
fn backlog_row<R>(row: &R) -> Result<OutboxBacklog, sqlx::Error>
where
    R: sqlx::Row,
    for<'r> i64: sqlx::Decode<'r, R::Database> + sqlx::Type<R::Database>,
    for<'r> f64: sqlx::Decode<'r, R::Database> + sqlx::Type<R::Database>,
    for<'r> String: sqlx::Decode<'r, R::Database> + sqlx::Type<R::Database>,
    usize: sqlx::ColumnIndex<R>,
{
    Ok(OutboxBacklog {
        destination: row.try_get(0)?,
        pending: row.try_get(1)?,
        oldest_pending_secs: row.try_get(2)?,
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

fn sorted(mut records: Vec<OutboxRecord>) -> Vec<OutboxRecord> {
    records.sort_by_key(|r| r.id);
    records
}

/// The [`OutboxAdminStore`] reads whose Rust is the same on every backend: one statement of
/// the dialect module `$dialect` each, outside any transaction.
macro_rules! outbox_admin_reads {
    ($dialect:ident) => {
        fn outbox_stats(&mut self) -> BoxFuture<'_, Result<Vec<OutboxStatsRow>, sqlx::Error>> {
            Box::pin(async move {
                let rows = sqlx::query($dialect::STATS).fetch_all(&mut *self).await?;
                rows.iter().map(stats_row).collect()
            })
        }

        fn fetch_outbox<'c>(
            &'c mut self,
            message_id: &'c str,
        ) -> BoxFuture<'c, Result<Option<OutboxEntry>, sqlx::Error>> {
            Box::pin(async move {
                let row = sqlx::query($dialect::FETCH)
                    .bind(message_id)
                    .fetch_optional(&mut *self)
                    .await?;
                row.as_ref().map(entry).transpose()
            })
        }

        fn outbox_purge_preview<'c>(
            &'c mut self,
            cutoff: &'c str,
        ) -> BoxFuture<'c, Result<Vec<OutboxStatsRow>, sqlx::Error>> {
            Box::pin(async move {
                let rows = sqlx::query($dialect::PURGE_PREVIEW)
                    .bind(cutoff)
                    .fetch_all(&mut *self)
                    .await?;
                rows.iter().map(stats_row).collect()
            })
        }
    };
}

/// [`OutboxStore::outbox_backlog`], the same on every backend but for the dialect's statement.
macro_rules! outbox_backlog_read {
    ($dialect:ident) => {
        fn outbox_backlog(&mut self) -> BoxFuture<'_, Result<Vec<OutboxBacklog>, sqlx::Error>> {
            Box::pin(async move {
                let rows = sqlx::query($dialect::BACKLOG).fetch_all(&mut *self).await?;
                rows.iter().map(backlog_row).collect()
            })
        }
    };
}

impl OutboxStore for PgConnection {
    outbox_backlog_read!(postgres);

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
                .bind(row.sent)
                .fetch_optional(&mut *self)
                .await?;
            Ok(written.is_some())
        })
    }

    fn lease_outbox<'c>(
        &'c mut self,
        limit: i64,
        lease_ms: i64,
        max_attempts: u32,
        abandoned_error: &'c str,
    ) -> BoxFuture<'c, Result<Lease, sqlx::Error>> {
        Box::pin(async move {
            let rows = sqlx::query(postgres::LEASE)
                .bind(limit)
                .bind(lease_ms)
                .bind(i32::try_from(max_attempts).unwrap_or(i32::MAX))
                .bind(abandoned_error)
                .fetch_all(&mut *self)
                .await?;
            let mut lease = Lease::default();
            for row in &rows {
                let kind: String = row.try_get(0)?;
                let record = record(row, 1)?;
                if kind == "abandoned" {
                    lease.abandoned.push(record);
                } else {
                    lease.records.push(record);
                }
            }
            lease.records = sorted(lease.records);
            lease.abandoned = sorted(lease.abandoned);
            Ok(lease)
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
}

impl OutboxAdminStore for PgConnection {
    outbox_admin_reads!(postgres);

    fn outbox_installed(&mut self) -> BoxFuture<'_, Result<bool, sqlx::Error>> {
        Box::pin(async move {
            sqlx::query_scalar(postgres::INSTALLED)
                .fetch_one(&mut *self)
                .await
        })
    }

    fn list_outbox<'c>(
        &'c mut self,
        statuses: &'c [OutboxStatus],
        destination: Option<&'c str>,
        limit: i64,
    ) -> BoxFuture<'c, Result<Vec<OutboxEntry>, sqlx::Error>> {
        Box::pin(async move {
            let [a, b, c] = three_statuses(statuses);
            let rows = sqlx::query(postgres::LIST)
                .bind(a)
                .bind(b)
                .bind(c)
                .bind(destination)
                .bind(limit)
                .fetch_all(&mut *self)
                .await?;
            rows.iter().map(entry).collect()
        })
    }

    fn retry_outbox<'c>(
        &'c mut self,
        message_id: Option<&'c str>,
        destination: Option<&'c str>,
    ) -> BoxFuture<'c, Result<u64, sqlx::Error>> {
        Box::pin(async move {
            let done = sqlx::query(postgres::RETRY)
                .bind(message_id)
                .bind(destination)
                .execute(&mut *self)
                .await?;
            if done.rows_affected() > 0 {
                sqlx::query(postgres::NOTIFY).execute(&mut *self).await?;
            }
            Ok(done.rows_affected())
        })
    }

    fn discard_outbox<'c>(
        &'c mut self,
        message_id: &'c str,
    ) -> BoxFuture<'c, Result<bool, sqlx::Error>> {
        Box::pin(async move {
            let done = sqlx::query(postgres::DISCARD)
                .bind(message_id)
                .execute(&mut *self)
                .await?;
            Ok(done.rows_affected() > 0)
        })
    }

    fn purge_outbox_before<'c>(
        &'c mut self,
        cutoff: &'c str,
        batch: i64,
    ) -> BoxFuture<'c, Result<u64, sqlx::Error>> {
        Box::pin(async move {
            let done = sqlx::query(postgres::PURGE_BEFORE)
                .bind(cutoff)
                .bind(batch)
                .execute(&mut *self)
                .await?;
            Ok(done.rows_affected())
        })
    }
}

impl OutboxStore for SqliteConnection {
    outbox_backlog_read!(sqlite);

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
                .bind(row.sent)
                .fetch_optional(&mut *self)
                .await?;
            Ok(written.is_some())
        })
    }

    fn lease_outbox<'c>(
        &'c mut self,
        limit: i64,
        lease_ms: i64,
        max_attempts: u32,
        abandoned_error: &'c str,
    ) -> BoxFuture<'c, Result<Lease, sqlx::Error>> {
        Box::pin(async move {
            let max_attempts = i64::from(max_attempts);
            let mut tx = self.begin_with("BEGIN IMMEDIATE").await?;
            let abandoned = sqlx::query(sqlite::ABANDON)
                .bind(abandoned_error)
                .bind(max_attempts)
                .fetch_all(&mut *tx)
                .await?;
            let mut rows = sqlx::query(sqlite::LEASE_ORPHAN)
                .bind(lease_ms)
                .bind(max_attempts)
                .bind(1_i64)
                .fetch_all(&mut *tx)
                .await?;
            if rows.is_empty() {
                rows = sqlx::query(sqlite::LEASE_FRESH)
                    .bind(lease_ms)
                    .bind(max_attempts)
                    .bind(limit)
                    .fetch_all(&mut *tx)
                    .await?;
            }
            let lease = Lease {
                records: sorted(
                    rows.iter()
                        .map(|row| record(row, 0))
                        .collect::<Result<_, _>>()?,
                ),
                abandoned: sorted(
                    abandoned
                        .iter()
                        .map(|row| record(row, 0))
                        .collect::<Result<_, _>>()?,
                ),
            };
            tx.commit().await?;
            Ok(lease)
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
}

impl OutboxAdminStore for SqliteConnection {
    outbox_admin_reads!(sqlite);

    fn outbox_installed(&mut self) -> BoxFuture<'_, Result<bool, sqlx::Error>> {
        Box::pin(async move {
            let tables: i64 = sqlx::query_scalar(sqlite::INSTALLED)
                .fetch_one(&mut *self)
                .await?;
            Ok(tables > 0)
        })
    }

    fn list_outbox<'c>(
        &'c mut self,
        statuses: &'c [OutboxStatus],
        destination: Option<&'c str>,
        limit: i64,
    ) -> BoxFuture<'c, Result<Vec<OutboxEntry>, sqlx::Error>> {
        Box::pin(async move {
            let [a, b, c] = three_statuses(statuses);
            let rows = sqlx::query(sqlite::LIST)
                .bind(a)
                .bind(b)
                .bind(c)
                .bind(destination)
                .bind(limit)
                .fetch_all(&mut *self)
                .await?;
            rows.iter().map(entry).collect()
        })
    }

    fn retry_outbox<'c>(
        &'c mut self,
        message_id: Option<&'c str>,
        destination: Option<&'c str>,
    ) -> BoxFuture<'c, Result<u64, sqlx::Error>> {
        Box::pin(async move {
            let mut tx = self.begin_with("BEGIN IMMEDIATE").await?;
            let done = sqlx::query(sqlite::RETRY)
                .bind(message_id)
                .bind(destination)
                .execute(&mut *tx)
                .await?;
            tx.commit().await?;
            Ok(done.rows_affected())
        })
    }

    fn discard_outbox<'c>(
        &'c mut self,
        message_id: &'c str,
    ) -> BoxFuture<'c, Result<bool, sqlx::Error>> {
        Box::pin(async move {
            let mut tx = self.begin_with("BEGIN IMMEDIATE").await?;
            let done = sqlx::query(sqlite::DISCARD)
                .bind(message_id)
                .execute(&mut *tx)
                .await?;
            tx.commit().await?;
            Ok(done.rows_affected() > 0)
        })
    }

    fn purge_outbox_before<'c>(
        &'c mut self,
        cutoff: &'c str,
        batch: i64,
    ) -> BoxFuture<'c, Result<u64, sqlx::Error>> {
        Box::pin(async move {
            let mut tx = self.begin_with("BEGIN IMMEDIATE").await?;
            let done = sqlx::query(sqlite::PURGE_BEFORE)
                .bind(cutoff)
                .bind(batch)
                .execute(&mut *tx)
                .await?;
            tx.commit().await?;
            Ok(done.rows_affected())
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

/// The outbox component's migrations on MySQL/MariaDB.
pub(super) const MYSQL_MIGRATIONS: &[(i64, &str, &str)] = &[
    (
        1,
        "outbox",
        include_str!("../../migrations/mysql/outbox/0001_outbox.sql"),
    ),
    (
        2,
        "outbox leases",
        include_str!("../../migrations/mysql/outbox/0002_outbox_leases.sql"),
    ),
];

/// MySQL/MariaDB's statements (`?` parameters, bound in order of appearance). The lease's
/// statements that take locks are built at run time with one `?` per id
/// ([`mysql::by_ids`]): primary-key lookups, so they lock the rows they name and nothing else.
mod mysql {
    use super::super::mysql::{text_time, window_start};

    /// A row's age in milliseconds on the database clock.
    macro_rules! age {
        () => {
            "TIMESTAMPDIFF(MICROSECOND, created_at, UTC_TIMESTAMP(6)) DIV 1000"
        };
    }

    /// The aggregate's lock row, upserted (and so locked until the writing transaction ends)
    /// before the row is inserted. Binds: the aggregate id.
    pub(super) const LOCK_AGGREGATE: &str = "INSERT INTO inbox_outbox_aggregates (aggregate_hash) \
         VALUES (UNHEX(SHA2(?, 256))) \
       ON DUPLICATE KEY UPDATE rows_written = rows_written + 1, \
         written_at = UTC_TIMESTAMP(6)";

    /// Binds: message id, destination, name, payload, headers, aggregate, then "sent" twice.
    pub(super) const ENQUEUE: &str = "INSERT INTO inbox_outbox \
         (message_id, destination, message_name, payload, headers, aggregate_id, status, \
          sent_at) \
       VALUES (?, ?, ?, ?, ?, ?, IF(?, 'sent', 'pending'), IF(?, UTC_TIMESTAMP(6), NULL))";

    /// Whether a row may be leased (alias `o`), as of the reading statement's snapshot:
    /// pending, due, not under a running lease (an orphan with attempts left may be: `?`, the
    /// maximum attempts), without an earlier pending or dead row of its aggregate.
    macro_rules! leasable {
        () => {
            "o.status = 'pending' \
             AND (o.next_attempt_at IS NULL OR o.next_attempt_at <= UTC_TIMESTAMP(6)) \
             AND (o.leased_until IS NULL \
                  OR (o.leased_until <= UTC_TIMESTAMP(6) AND o.attempts < ?)) \
             AND (o.aggregate_hash IS NULL OR NOT EXISTS ( \
                   SELECT 1 FROM inbox_outbox e \
                   WHERE e.aggregate_hash = o.aggregate_hash AND e.id < o.id \
                     AND e.status IN ('pending', 'dead')))"
        };
    }

    /// Orphans out of attempts (a consistent read). Binds: the maximum attempts.
    pub(super) const ABANDONED: &str = "SELECT id FROM inbox_outbox \
       WHERE status = 'pending' AND leased_until <= UTC_TIMESTAMP(6) AND attempts >= ? \
       ORDER BY id";

    /// Orphans that may be leased, fewest attempts first (a consistent read). Binds: the
    /// maximum attempts, the limit.
    pub(super) const ORPHANS: &str = concat!(
        "SELECT o.id FROM inbox_outbox o WHERE o.leased_until IS NOT NULL AND ",
        leasable!(),
        " ORDER BY o.attempts, o.id LIMIT ?"
    );

    /// Rows never leased (or settled since) that may be leased, in id order (a consistent
    /// read). Binds: the maximum attempts, the limit.
    pub(super) const FRESH: &str = concat!(
        "SELECT o.id FROM inbox_outbox o WHERE o.leased_until IS NULL AND ",
        leasable!(),
        " ORDER BY o.id LIMIT ?"
    );

    /// The statement `head … WHERE id IN (?, …) tail` with `ids` placeholders.
    pub(super) fn by_ids(head: &str, ids: usize, tail: &str) -> sqlx::AssertSqlSafe<String> {
        in_list(head, "id", ids, tail)
    }

    /// The statement `head … WHERE column IN (?, …) tail` with `n` placeholders.
    pub(super) fn in_list(
        head: &str,
        column: &str,
        n: usize,
        tail: &str,
    ) -> sqlx::AssertSqlSafe<String> {
        let marks = vec!["?"; n].join(", ");
        sqlx::AssertSqlSafe(format!("{head} WHERE {column} IN ({marks}){tail}"))
    }

    /// Lock rows of aggregates not written since the cutoff (a window in seconds), at most
    /// `?` of them, skipping those a writer holds.
    pub(super) const STALE_AGGREGATES: &str = concat!(
        "SELECT aggregate_hash FROM inbox_outbox_aggregates WHERE written_at < ",
        window_start!(),
        " ORDER BY written_at LIMIT ? FOR UPDATE SKIP LOCKED"
    );

    /// [`STALE_AGGREGATES`] with the cutoff as a time (text).
    pub(super) const STALE_AGGREGATES_BEFORE: &str = "SELECT aggregate_hash \
       FROM inbox_outbox_aggregates WHERE written_at < CAST(? AS DATETIME(6)) \
       ORDER BY written_at LIMIT ? FOR UPDATE SKIP LOCKED";

    /// Deletes the lock rows picked (`in_list` on `aggregate_hash`).
    pub(super) const FORGET_AGGREGATES: &str = "DELETE FROM inbox_outbox_aggregates";

    /// Locks the abandoned orphans among the ids (`by_ids`), skipping rows another transaction
    /// holds. Binds (after the ids): the maximum attempts.
    pub(super) const LOCK_ABANDONED: (&str, &str) = (
        "SELECT id FROM inbox_outbox",
        " AND status = 'pending' AND leased_until <= UTC_TIMESTAMP(6) AND attempts >= ? \
         ORDER BY id FOR UPDATE SKIP LOCKED",
    );

    /// Dead-letters the locked orphans. Binds: the error, then the ids.
    pub(super) const ABANDON: &str = "UPDATE inbox_outbox SET status = 'dead', last_error = ?, \
         leased_until = NULL, next_attempt_at = NULL";

    /// Locks the candidates that are still leasable (their own state, re-read at its latest
    /// committed version), skipping rows another transaction holds; the order follows. Binds
    /// (after the ids): the maximum attempts, the limit.
    pub(super) const LOCK_LEASABLE: &str = " AND status = 'pending' \
         AND (next_attempt_at IS NULL OR next_attempt_at <= UTC_TIMESTAMP(6)) \
         AND (leased_until IS NULL OR (leased_until <= UTC_TIMESTAMP(6) AND attempts < ?)) \
         ORDER BY ";

    /// Leases the locked rows. Binds: the lease in microseconds, then the ids.
    pub(super) const LEASE: &str = "UPDATE inbox_outbox SET attempts = attempts + 1, \
         leased_until = DATE_ADD(UTC_TIMESTAMP(6), INTERVAL ? MICROSECOND)";

    /// The [`leased_columns`] of rows by id (`by_ids`).
    pub(super) const LEASED: &str =
        concat!("SELECT ", leased_columns!("", age!()), " FROM inbox_outbox");

    /// Binds: the ids (`by_ids`).
    pub(super) const MARK_SENT: &str = "UPDATE inbox_outbox SET status = 'sent', \
         sent_at = UTC_TIMESTAMP(6), leased_until = NULL, next_attempt_at = NULL, \
         last_error = NULL";

    /// Binds: permanent, the maximum attempts, the error, the delay in microseconds, the id.
    pub(super) const MARK_FAILED: &str = "UPDATE inbox_outbox SET \
         status = IF(? OR attempts >= ?, 'dead', 'pending'), \
         last_error = ?, leased_until = NULL, \
         next_attempt_at = DATE_ADD(UTC_TIMESTAMP(6), INTERVAL ? MICROSECOND) \
       WHERE id = ? AND status = 'pending'";

    /// The status [`MARK_FAILED`] set, read in its transaction. Binds: the id.
    pub(super) const FAILED_STATUS: &str = "SELECT status FROM inbox_outbox WHERE id = ?";

    pub(super) const PURGE: &str = concat!(
        "DELETE FROM inbox_outbox WHERE status = 'sent' AND sent_at < ",
        window_start!(),
        " ORDER BY sent_at LIMIT ?"
    );

    pub(super) const BACKLOG: &str = "SELECT destination, COUNT(*), \
         COALESCE(TIMESTAMPDIFF(MICROSECOND, MIN(created_at), UTC_TIMESTAMP(6)) / 1e6, 0e0) \
       FROM inbox_outbox WHERE status = 'pending' GROUP BY destination ORDER BY destination";

    pub(super) const INSTALLED: &str = "SELECT COUNT(*) FROM information_schema.tables \
       WHERE table_schema = DATABASE() AND table_name = 'inbox_outbox'";

    pub(super) const STATS: &str = concat!(
        "SELECT destination, status, COUNT(*), ",
        text_time!("MIN(created_at)"),
        " FROM inbox_outbox GROUP BY destination, status ORDER BY destination, status"
    );

    /// The columns of an [`OutboxEntry`](super::OutboxEntry), with `$payload` (or `NULL`).
    macro_rules! entry_columns_mysql {
        ($payload:literal) => {
            concat!(
                "id, message_id, destination, message_name, ",
                $payload,
                ", CAST(LENGTH(payload) AS SIGNED), headers, aggregate_id, CAST(NULL AS CHAR), ",
                text_time!("created_at"),
                ", status, attempts, ",
                text_time!("next_attempt_at"),
                ", ",
                text_time!("leased_until"),
                ", last_error, ",
                text_time!("sent_at")
            )
        };
    }

    /// Binds: three statuses, the destination twice, the limit.
    pub(super) const LIST: &str = concat!(
        "SELECT ",
        entry_columns_mysql!("NULL"),
        " FROM inbox_outbox WHERE status IN (?, ?, ?) \
           AND (? IS NULL OR destination = ?) ORDER BY id LIMIT ?"
    );

    pub(super) const FETCH: &str = concat!(
        "SELECT ",
        entry_columns_mysql!("payload"),
        " FROM inbox_outbox WHERE message_id_hash = UNHEX(SHA2(?, 256))"
    );

    /// Binds: the message id twice, the destination twice.
    pub(super) const RETRY: &str = "UPDATE inbox_outbox SET status = 'pending', attempts = 0, \
         leased_until = NULL, next_attempt_at = NULL \
       WHERE status = 'dead' AND (? IS NULL OR message_id_hash = UNHEX(SHA2(?, 256))) \
         AND (? IS NULL OR destination = ?)";

    pub(super) const DISCARD: &str = "DELETE FROM inbox_outbox \
       WHERE message_id_hash = UNHEX(SHA2(?, 256)) AND status = 'dead'";

    pub(super) const PURGE_BEFORE: &str = "DELETE FROM inbox_outbox \
       WHERE status = 'sent' AND sent_at < CAST(? AS DATETIME(6)) ORDER BY sent_at LIMIT ?";

    pub(super) const PURGE_PREVIEW: &str = concat!(
        "SELECT destination, 'sent', COUNT(*), ",
        text_time!("MIN(sent_at)"),
        " FROM inbox_outbox WHERE status = 'sent' AND sent_at < CAST(? AS DATETIME(6)) \
         GROUP BY destination ORDER BY destination"
    );
}

/// MySQL's error number of a duplicate key (`ER_DUP_ENTRY`): here, a message id already stored.
const ER_DUP_ENTRY: u16 = 1062;

/// The longest interval added to the clock, in microseconds: 100 years. A `DATETIME` ends with
/// the year 9999; past it `DATE_ADD` fails ("datetime field overflow", strict mode) or answers
/// NULL, which a lease would read as "not leased" (another relay takes the row at once) and a
/// retry delay as "due now".
const MAX_INTERVAL_US: i64 = 100 * 366 * 86_400 * 1_000_000;

/// `ms` milliseconds as the microseconds of an interval added to the clock (at most
/// [`MAX_INTERVAL_US`], at least 0).
fn interval_us(ms: i64) -> i64 {
    ms.saturating_mul(1000).clamp(0, MAX_INTERVAL_US)
}

/// Binds each id in turn onto `query`.
fn bind_ids<'q>(
    mut query: sqlx::query::Query<'q, MySql, sqlx::mysql::MySqlArguments>,
    ids: &[i64],
) -> sqlx::query::Query<'q, MySql, sqlx::mysql::MySqlArguments> {
    for id in ids {
        query = query.bind(*id);
    }
    query
}

/// The enqueue's two statements: the aggregate's lock row (a row with an aggregate, to be
/// published by a relay), then the row. A duplicate message id fails only its own statement on
/// MySQL (the transaction stays usable): it is the `Ok(false)` answer.
async fn mysql_enqueue(
    conn: &mut MySqlConnection,
    row: &OutboxRow<'_>,
) -> Result<bool, sqlx::Error> {
    if let (Some(aggregate), false) = (row.aggregate_id, row.sent) {
        sqlx::query(mysql::LOCK_AGGREGATE)
            .bind(aggregate)
            .execute(&mut *conn)
            .await?;
    }
    let written = sqlx::query(mysql::ENQUEUE)
        .bind(row.message_id)
        .bind(row.destination)
        .bind(row.message_name)
        .bind(row.payload)
        .bind(row.headers_json)
        .bind(row.aggregate_id)
        .bind(row.sent)
        .bind(row.sent)
        .execute(&mut *conn)
        .await;
    match written {
        Ok(_) => Ok(true),
        Err(error) if super::mysql_error_number(&error) == Some(ER_DUP_ENTRY) => Ok(false),
        Err(error) => Err(error),
    }
}

/// [`mysql_enqueue`] in a transaction of its own.
async fn mysql_enqueue_alone(
    conn: &mut MySqlConnection,
    row: &OutboxRow<'_>,
) -> Result<bool, sqlx::Error> {
    let mut tx = conn.begin().await?;
    let written = mysql_enqueue(&mut tx, row).await?;
    tx.commit().await?;
    Ok(written)
}

/// Locks the rows among `candidates` that `lock` (`(head, tail)` around the ids) still
/// selects, skipping rows another transaction holds; `binds` follow the ids.
async fn mysql_lock_ids(
    tx: &mut MySqlConnection,
    candidates: &[i64],
    head: &str,
    tail: &str,
    max_attempts: i32,
    limit: Option<i64>,
) -> Result<Vec<i64>, sqlx::Error> {
    if candidates.is_empty() {
        return Ok(Vec::new());
    }
    let sql = mysql::by_ids(head, candidates.len(), tail);
    let mut query = bind_ids(sqlx::query(sql), candidates).bind(max_attempts);
    if let Some(limit) = limit {
        query = query.bind(limit);
    }
    let rows = query.fetch_all(&mut *tx).await?;
    rows.iter().map(|row| row.try_get(0)).collect()
}

/// The rows with these ids, as leased records, in id order.
async fn mysql_records(
    tx: &mut MySqlConnection,
    ids: &[i64],
) -> Result<Vec<OutboxRecord>, sqlx::Error> {
    if ids.is_empty() {
        return Ok(Vec::new());
    }
    let sql = mysql::by_ids(mysql::LEASED, ids.len(), " ORDER BY id");
    let rows = bind_ids(sqlx::query(sql), ids).fetch_all(&mut *tx).await?;
    rows.iter().map(|row| record(row, 0)).collect()
}

/// One lease in a transaction of its own (see the module docs: eligibility is read from one
/// consistent snapshot, then the chosen rows are locked by primary key with `SKIP LOCKED` and
/// their own state re-checked at its latest committed version).
async fn mysql_lease_once(
    conn: &mut MySqlConnection,
    limit: i64,
    lease_ms: i64,
    max_attempts: u32,
    abandoned_error: &str,
) -> Result<Lease, sqlx::Error> {
    let max_attempts = i32::try_from(max_attempts).unwrap_or(i32::MAX);
    let mut tx = conn.begin().await?;
    // Orphans out of attempts go dead.
    let abandoned: Vec<i64> = sqlx::query_scalar(mysql::ABANDONED)
        .bind(max_attempts)
        .fetch_all(&mut *tx)
        .await?;
    let (head, tail) = mysql::LOCK_ABANDONED;
    let abandoned = mysql_lock_ids(&mut tx, &abandoned, head, tail, max_attempts, None).await?;
    if !abandoned.is_empty() {
        let sql = mysql::by_ids(mysql::ABANDON, abandoned.len(), "");
        bind_ids(sqlx::query(sql).bind(abandoned_error), &abandoned)
            .execute(&mut *tx)
            .await?;
    }
    // One orphan alone, else fresh rows.
    let orphans: Vec<i64> = sqlx::query_scalar(mysql::ORPHANS)
        .bind(max_attempts)
        .bind(limit)
        .fetch_all(&mut *tx)
        .await?;
    let lock_tail = |order: &str| format!("{}{order} FOR UPDATE SKIP LOCKED", mysql::LOCK_LEASABLE);
    let lock_head = "SELECT id FROM inbox_outbox";
    let order = lock_tail("attempts, id LIMIT ?");
    let mut leased =
        mysql_lock_ids(&mut tx, &orphans, lock_head, &order, max_attempts, Some(1)).await?;
    if leased.is_empty() {
        let fresh: Vec<i64> = sqlx::query_scalar(mysql::FRESH)
            .bind(max_attempts)
            .bind(limit)
            .fetch_all(&mut *tx)
            .await?;
        let order = lock_tail("id LIMIT ?");
        leased = mysql_lock_ids(
            &mut tx,
            &fresh,
            lock_head,
            &order,
            max_attempts,
            Some(limit),
        )
        .await?;
    }
    if !leased.is_empty() {
        let sql = mysql::by_ids(mysql::LEASE, leased.len(), "");
        bind_ids(sqlx::query(sql).bind(interval_us(lease_ms)), &leased)
            .execute(&mut *tx)
            .await?;
    }
    let lease = Lease {
        records: mysql_records(&mut tx, &leased).await?,
        abandoned: mysql_records(&mut tx, &abandoned).await?,
    };
    tx.commit().await?;
    Ok(lease)
}

/// Deletes at most `batch` lock rows of aggregates not written since the cutoff (`pick`, bound
/// with `cutoff`): `inbox_outbox_aggregates` would otherwise keep a row for every aggregate
/// ever published. Safe at any time: a lock row only makes concurrent writers of its aggregate
/// take turns, and the next writer creates it again (rows a writer holds are skipped).
async fn mysql_forget_aggregates_once<T>(
    conn: &mut MySqlConnection,
    pick: &'static str,
    cutoff: T,
    batch: i64,
) -> Result<(), sqlx::Error>
where
    T: for<'q> sqlx::Encode<'q, MySql> + sqlx::Type<MySql> + Send + Copy,
{
    let mut tx = conn.begin().await?;
    let stale: Vec<Vec<u8>> = sqlx::query_scalar(pick)
        .bind(cutoff)
        .bind(batch)
        .fetch_all(&mut *tx)
        .await?;
    if !stale.is_empty() {
        let sql = mysql::in_list(mysql::FORGET_AGGREGATES, "aggregate_hash", stale.len(), "");
        let mut query = sqlx::query(sql);
        for hash in &stale {
            query = query.bind(hash.as_slice());
        }
        query.execute(&mut *tx).await?;
    }
    tx.commit().await
}

/// A failed publish in a transaction of its own: the update, then the status it set.
async fn mysql_mark_failed_once(
    conn: &mut MySqlConnection,
    id: i64,
    error: &str,
    permanent: bool,
    max_attempts: u32,
    retry_in_ms: i64,
) -> Result<Option<OutboxStatus>, sqlx::Error> {
    let mut tx = conn.begin().await?;
    let done = sqlx::query(mysql::MARK_FAILED)
        .bind(permanent)
        .bind(i32::try_from(max_attempts).unwrap_or(i32::MAX))
        .bind(error)
        .bind(interval_us(retry_in_ms))
        .bind(id)
        .execute(&mut *tx)
        .await?;
    let status: Option<String> = if done.rows_affected() == 1 {
        sqlx::query_scalar(mysql::FAILED_STATUS)
            .bind(id)
            .fetch_optional(&mut *tx)
            .await?
    } else {
        None
    };
    tx.commit().await?;
    status.as_deref().map(OutboxStatus::parse).transpose()
}

/// Every method that writes runs in autocommit or a transaction of its own, and is retried on
/// a deadlock (1213) or lock wait timeout (1205) like the inbox's statements (counted in
/// [`mysql_lock_retries`](crate::mysql_lock_retries)); [`enqueue_outbox`](OutboxStore::enqueue_outbox)
/// runs in the caller's transaction and returns them (transient: see [`crate::Classify`]).
impl OutboxStore for MySqlConnection {
    outbox_backlog_read!(mysql);

    fn enqueue_outbox<'c>(
        &'c mut self,
        row: &'c OutboxRow<'c>,
        _notify: bool,
    ) -> BoxFuture<'c, Result<bool, sqlx::Error>> {
        Box::pin(async move {
            // In the caller's transaction, also one sqlx does not count (a raw `BEGIN`: a
            // `BEGIN` of ours would commit it implicitly).
            if super::mysql::in_transaction(self).await? {
                return mysql_enqueue(self, row).await;
            }
            // Outside a transaction: one of our own, so that the aggregate stays locked until
            // the row is committed (retried on lock errors, nothing of the caller's being in it).
            retry_lock_errors!(self, "enqueue_outbox", mysql_enqueue_alone(self, row))
        })
    }

    fn lease_outbox<'c>(
        &'c mut self,
        limit: i64,
        lease_ms: i64,
        max_attempts: u32,
        abandoned_error: &'c str,
    ) -> BoxFuture<'c, Result<Lease, sqlx::Error>> {
        Box::pin(async move {
            retry_lock_errors!(
                self,
                "lease_outbox",
                mysql_lease_once(self, limit, lease_ms, max_attempts, abandoned_error)
            )
        })
    }

    fn mark_outbox_sent<'c>(
        &'c mut self,
        ids: &'c [i64],
    ) -> BoxFuture<'c, Result<u64, sqlx::Error>> {
        Box::pin(async move {
            if ids.is_empty() {
                return Ok(0);
            }
            let tail = " AND status IN ('pending', 'dead')";
            let done = retry_lock_errors!(
                self,
                "mark_outbox_sent",
                bind_ids(
                    sqlx::query(mysql::by_ids(mysql::MARK_SENT, ids.len(), tail)),
                    ids
                )
                .execute(&mut *self)
            )?;
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
            retry_lock_errors!(
                self,
                "mark_outbox_failed",
                mysql_mark_failed_once(self, id, error, permanent, max_attempts, retry_in_ms)
            )
        })
    }

    fn purge_outbox_sent(
        &mut self,
        older_than_secs: f64,
        batch: i64,
    ) -> BoxFuture<'_, Result<u64, sqlx::Error>> {
        Box::pin(async move {
            let done = retry_lock_errors!(
                self,
                "purge_outbox",
                sqlx::query(mysql::PURGE)
                    .bind(older_than_secs)
                    .bind(batch)
                    .execute(&mut *self)
            )?;
            retry_lock_errors!(
                self,
                "forget_aggregates",
                mysql_forget_aggregates_once(self, mysql::STALE_AGGREGATES, older_than_secs, batch)
            )?;
            Ok(done.rows_affected())
        })
    }
}

impl OutboxAdminStore for MySqlConnection {
    outbox_admin_reads!(mysql);

    fn outbox_installed(&mut self) -> BoxFuture<'_, Result<bool, sqlx::Error>> {
        Box::pin(async move {
            let tables: i64 = sqlx::query_scalar(mysql::INSTALLED)
                .fetch_one(&mut *self)
                .await?;
            Ok(tables > 0)
        })
    }

    fn list_outbox<'c>(
        &'c mut self,
        statuses: &'c [OutboxStatus],
        destination: Option<&'c str>,
        limit: i64,
    ) -> BoxFuture<'c, Result<Vec<OutboxEntry>, sqlx::Error>> {
        Box::pin(async move {
            let [a, b, c] = three_statuses(statuses);
            let rows = sqlx::query(mysql::LIST)
                .bind(a)
                .bind(b)
                .bind(c)
                .bind(destination)
                .bind(destination)
                .bind(limit)
                .fetch_all(&mut *self)
                .await?;
            rows.iter().map(entry).collect()
        })
    }

    fn retry_outbox<'c>(
        &'c mut self,
        message_id: Option<&'c str>,
        destination: Option<&'c str>,
    ) -> BoxFuture<'c, Result<u64, sqlx::Error>> {
        Box::pin(async move {
            let done = retry_lock_errors!(
                self,
                "retry_outbox",
                sqlx::query(mysql::RETRY)
                    .bind(message_id)
                    .bind(message_id)
                    .bind(destination)
                    .bind(destination)
                    .execute(&mut *self)
            )?;
            Ok(done.rows_affected())
        })
    }

    fn discard_outbox<'c>(
        &'c mut self,
        message_id: &'c str,
    ) -> BoxFuture<'c, Result<bool, sqlx::Error>> {
        Box::pin(async move {
            let done = retry_lock_errors!(
                self,
                "discard_outbox",
                sqlx::query(mysql::DISCARD)
                    .bind(message_id)
                    .execute(&mut *self)
            )?;
            Ok(done.rows_affected() > 0)
        })
    }

    fn purge_outbox_before<'c>(
        &'c mut self,
        cutoff: &'c str,
        batch: i64,
    ) -> BoxFuture<'c, Result<u64, sqlx::Error>> {
        Box::pin(async move {
            let done = retry_lock_errors!(
                self,
                "purge_outbox",
                sqlx::query(mysql::PURGE_BEFORE)
                    .bind(cutoff)
                    .bind(batch)
                    .execute(&mut *self)
            )?;
            retry_lock_errors!(
                self,
                "forget_aggregates",
                mysql_forget_aggregates_once(self, mysql::STALE_AGGREGATES_BEFORE, cutoff, batch)
            )?;
            Ok(done.rows_affected())
        })
    }
}

/// No wake-ups on MySQL: the relay polls.
impl OutboxDatabase for MySql {
    async fn wakeups(_pool: &Pool<Self>) -> Option<Wakeups> {
        None
    }
}
