//! Inbox stores: small capability traits ([`ClaimStore`], [`OrderingStore`], [`AdminStore`],
//! joined by [`InboxConnection`]), implemented for `PgConnection`, `SqliteConnection` and
//! `MySqlConnection` (MySQL and MariaDB).
//!
//! The protocol calls only these traits; each backend implements them in its own SQL dialect.
//! The backend of a handler follows from its connection type. Statements whose text is the same
//! on PostgreSQL and SQLite live in `shared` (both accept `$N` parameters when each first
//! appears in order); those that differ (clock arithmetic, the claim, no-wait claims) live in
//! the backend's `sql` module, its dialect. The Rust side of every operation is written once, in
//! `impl_inbox_connection!`, and instantiated for both; a backend whose SQL differs more (MySQL:
//! no `RETURNING`, no `ON CONFLICT … WHERE`) implements the traits itself.
//!
//! Schema migrations come per [`Component`], each with its own version record.

use std::borrow::Cow;

use sqlx::migrate::{Migration, MigrationType, Migrator};
use sqlx::{SqlSafeStr as _, Transaction};

use crate::BoxFuture;
use crate::envelope::SourceMetadata;
use crate::status::Status;

#[macro_use]
mod shared;
mod console;
mod mysql;
mod outbox;
mod positions;
mod postgres;
mod sqlite;

pub use console::{
    ArrivalRow, ConsoleDatabase, ConsoleStore, ParkedEntry, RejectionEntry, RetryLag, SentRow,
};
pub use mysql::mysql_lock_retries;
pub(crate) use mysql::{
    ER_LOCK_DEADLOCK, ER_LOCK_WAIT_TIMEOUT, ER_NET_PACKET_TOO_LARGE,
    error_number as mysql_error_number,
};

pub use outbox::{
    Lease, NOTIFY_CHANNEL, OutboxAdminStore, OutboxBacklog, OutboxDatabase, OutboxEntry,
    OutboxRecord, OutboxRow, OutboxStatsRow, OutboxStatus, OutboxStore, Wakeups,
};

pub use positions::{Acquired, PositionKey, PositionRow, PositionStore, PositionsDatabase};

pub use shared::{
    ClaimRequest, ClaimResult, FailureRecord, ParkedMessage, PurgeClock, Rejection,
    RejectionReason, StatsRow, StatsStatus, StoredMessage,
};

/// Name of the table where the inbox's own schema migrations are recorded.
///
/// Kept apart from `_sqlx_migrations` so that the application's own `sqlx migrate` history and
/// the inbox's never see each other's versions.
pub const MIGRATIONS_TABLE: &str = "_inbox_migrations";

/// Name of the table where the outbox's schema migrations ([`Component::Outbox`]) are recorded.
pub const OUTBOX_MIGRATIONS_TABLE: &str = "_inbox_outbox_migrations";

/// Name of the table where the broker positions' schema migrations ([`Component::Positions`])
/// are recorded.
pub const POSITIONS_MIGRATIONS_TABLE: &str = "_inbox_positions_migrations";

/// Which database an inbox lives in.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Backend {
    /// PostgreSQL (12 or newer), through `sqlx::PgConnection`.
    Postgres,
    /// SQLite (3.35 or newer, for `RETURNING`), through `sqlx::SqliteConnection`.
    Sqlite,
    /// MySQL (8.0.16 or newer) or MariaDB (10.6 or newer), InnoDB, through
    /// `sqlx::MySqlConnection`.
    MySql,
    /// A backend implemented outside this crate (see [`ClaimStore`]), by its name.
    Other(&'static str),
}

impl std::fmt::Display for Backend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Backend::Postgres => "postgres",
            Backend::Sqlite => "sqlite",
            Backend::MySql => "mysql",
            Backend::Other(name) => name,
        })
    }
}

/// Where each `(consumer, key)` of a batch's requests is (keys are unique within a batch).
pub(crate) fn request_index<'a>(
    requests: &'a [ClaimRequest<'a>],
) -> std::collections::HashMap<(&'a str, &'a str), usize> {
    requests
        .iter()
        .enumerate()
        .map(|(index, r)| ((r.consumer, r.message_key), index))
        .collect()
}

/// A stored row found by [`ClaimStore::existing_batch`]: `(consumer, key, Existing { .. })`.
pub type ExistingRow = (String, String, ClaimResult);

/// A borrowed connection of any backend, its type erased (what the type-erased dispatcher hands
/// a handler; [`InboxConnection::from_any`] narrows it back).
pub struct AnyConnection<'c>(&'c mut (dyn std::any::Any + Send));

impl std::fmt::Debug for AnyConnection<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("AnyConnection")
    }
}

/// The claim protocol's statements on one connection: the capability every backend must have.
///
/// Implemented for `sqlx::PgConnection`, `sqlx::SqliteConnection` and `sqlx::MySqlConnection`
/// (whose claim is an upsert and a locking read: see the `mysql` store). A backend of your own
/// implements it (with [`OrderingStore`], [`AdminStore`] and [`InboxConnection`]) in its own SQL
/// dialect; the protocol only ever calls these methods, so a backend without `RETURNING` or
/// `ON CONFLICT … WHERE` (MySQL) can be added without touching it. Every method runs on the
/// connection it is called on, inside whatever transaction that connection is in; the contract
/// of each is what the protocol relies on.
pub trait ClaimStore: Send {
    /// The claim: the transaction's first statement. Takes a free key, or a `failed` one (and,
    /// when `replay`, a `dead` one) whose stored fingerprint equals the request's; otherwise
    /// reports what is stored.
    fn claim<'c>(
        &'c mut self,
        request: &'c ClaimRequest<'c>,
    ) -> BoxFuture<'c, Result<ClaimResult, sqlx::Error>>;

    /// The claim without waiting for another transaction that holds the key uncommitted:
    /// `None` if one does (the transaction is then unusable and must be rolled back). On
    /// PostgreSQL the claim runs with a `lock_timeout` of [`crate::Wait::NO_WAIT_GRACE`]; on
    /// SQLite it is the plain claim (the protocol checks the claims of this process first).
    fn claim_no_wait<'c>(
        &'c mut self,
        request: &'c ClaimRequest<'c>,
    ) -> BoxFuture<'c, Result<Option<ClaimResult>, sqlx::Error>>;

    /// Checks, before COMMIT, that the transaction holding the claim of `key` is still usable:
    /// on PostgreSQL one cheap read that fails if the handler left the transaction aborted
    /// (there COMMIT would silently roll back); nothing on SQLite (a failed statement does not
    /// abort a SQLite transaction, and one that rolls it back makes COMMIT fail).
    fn verify_claim<'c>(
        &'c mut self,
        consumer: &'c str,
        key: &'c str,
    ) -> BoxFuture<'c, Result<(), sqlx::Error>>;

    /// The stored status, fingerprint and attempts of a key, read outside any transaction (the
    /// redelivery fast path), or `None`.
    fn existing<'c>(
        &'c mut self,
        consumer: &'c str,
        key: &'c str,
    ) -> BoxFuture<'c, Result<Option<ClaimResult>, sqlx::Error>>;

    /// Records a failed attempt in its own statement (autocommit): `failed` or `dead`, one more
    /// attempt, last error, next attempt time, payload. Returns the stored status and attempts,
    /// or `None` if the key is no longer failed (processed by a concurrent delivery meanwhile).
    fn record_failure<'c>(
        &'c mut self,
        record: &'c FailureRecord<'c>,
    ) -> BoxFuture<'c, Result<Option<(Status, u32)>, sqlx::Error>>;

    /// Records a delivery that can never be applied (conflict, malformed, unknown, bad key).
    fn record_rejection<'c>(
        &'c mut self,
        rejection: &'c Rejection<'c>,
    ) -> BoxFuture<'c, Result<(), sqlx::Error>>;

    /// The batch claim: one multi-row `INSERT … ON CONFLICT` for keys that are unique within
    /// the batch. Per request, the attempts if claimed (free, or a failed key with the same
    /// fingerprint), else `None`.
    fn claim_batch<'c>(
        &'c mut self,
        requests: &'c [ClaimRequest<'c>],
    ) -> BoxFuture<'c, Result<Vec<Option<u32>>, sqlx::Error>>;

    /// The stored rows of `(consumer, key)` pairs, as `(consumer, key, Existing { .. })`.
    fn existing_batch<'c>(
        &'c mut self,
        keys: &'c [(&'c str, &'c str)],
    ) -> BoxFuture<'c, Result<Vec<ExistingRow>, sqlx::Error>>;

    /// Undoes this transaction's claim of a key (after its handler's savepoint was rolled back):
    /// deletes a freshly inserted row, or gives a taken-over `failed` row back its state.
    fn unclaim<'c>(
        &'c mut self,
        consumer: &'c str,
        key: &'c str,
        payload: &'c [u8],
    ) -> BoxFuture<'c, Result<(), sqlx::Error>>;

    /// Turns a row claimed in the current transaction into a failed (or dead) attempt.
    fn fail_claimed<'c>(
        &'c mut self,
        record: &'c FailureRecord<'c>,
    ) -> BoxFuture<'c, Result<Option<(Status, u32)>, sqlx::Error>>;

    /// Stores a claim session's result with the key claimed in this transaction.
    fn store_result<'c>(
        &'c mut self,
        consumer: &'c str,
        key: &'c str,
        result: &'c [u8],
    ) -> BoxFuture<'c, Result<(), sqlx::Error>>;

    /// The stored result of a key, if any.
    fn fetch_result<'c>(
        &'c mut self,
        consumer: &'c str,
        key: &'c str,
    ) -> BoxFuture<'c, Result<Option<Vec<u8>>, sqlx::Error>>;
}

/// Per-aggregate ordering: the sequence guard and the durable reorder buffer (`parked` rows).
/// See [`ClaimStore`] for implementing it.
pub trait OrderingStore: Send {
    /// Locks the aggregate's state row (created at 0) and returns its last applied sequence.
    fn lock_aggregate<'c>(
        &'c mut self,
        consumer: &'c str,
        aggregate_id: &'c str,
    ) -> BoxFuture<'c, Result<i64, sqlx::Error>>;

    /// Sets the aggregate's last applied sequence.
    fn advance_aggregate<'c>(
        &'c mut self,
        consumer: &'c str,
        aggregate_id: &'c str,
        sequence: i64,
    ) -> BoxFuture<'c, Result<(), sqlx::Error>>;

    /// Sets a claimed row's status (`stale`, `parked`), ordering and payload.
    fn mark_message<'c>(
        &'c mut self,
        consumer: &'c str,
        key: &'c str,
        status: Status,
        ordering: &'c crate::Ordering,
        payload: Option<&'c [u8]>,
    ) -> BoxFuture<'c, Result<(), sqlx::Error>>;

    /// The parked (or failed) message of `aggregate_id` with `sequence`, if any.
    fn find_parked<'c>(
        &'c mut self,
        consumer: &'c str,
        aggregate_id: &'c str,
        sequence: i64,
    ) -> BoxFuture<'c, Result<Option<ParkedMessage>, sqlx::Error>>;

    /// Parked messages first delivered more than `older_than_secs` ago, oldest aggregates and
    /// sequences first, at most `limit`.
    fn expired_parked<'c>(
        &'c mut self,
        older_than_secs: f64,
        limit: i64,
    ) -> BoxFuture<'c, Result<Vec<ParkedMessage>, sqlx::Error>>;

    /// Turns a parked message dead, with `reason` as its last error.
    fn dead_letter_parked<'c>(
        &'c mut self,
        consumer: &'c str,
        key: &'c str,
        reason: &'c str,
    ) -> BoxFuture<'c, Result<bool, sqlx::Error>>;
}

/// Operators' reads and writes: statistics, listing, inspection, discard, retention purge. See
/// [`ClaimStore`] for implementing it.
pub trait AdminStore: Send {
    /// One stored row, payload included.
    fn fetch_message<'c>(
        &'c mut self,
        consumer: &'c str,
        key: &'c str,
    ) -> BoxFuture<'c, Result<Option<StoredMessage>, sqlx::Error>>;

    /// Rows in `statuses`, optionally of one consumer, oldest first, at most `limit`.
    fn list_messages<'c>(
        &'c mut self,
        consumer: Option<&'c str>,
        statuses: &'c [Status],
        limit: i64,
    ) -> BoxFuture<'c, Result<Vec<StoredMessage>, sqlx::Error>>;

    /// Marks a `failed` or `dead` row `discarded` (kept as a final state, payload dropped).
    /// Returns whether a row changed.
    fn discard_message<'c>(
        &'c mut self,
        consumer: &'c str,
        key: &'c str,
    ) -> BoxFuture<'c, Result<bool, sqlx::Error>>;

    /// Per consumer and status: count and oldest `received_at`; plus rejections per consumer
    /// and reason.
    fn stats(&mut self) -> BoxFuture<'_, Result<Vec<StatsRow>, sqlx::Error>>;

    /// Deletes at most `batch` rows in `statuses` whose `processed_at` (or `received_at` when
    /// unset) is older than `older_than_secs`. Returns how many went.
    fn purge_batch<'c>(
        &'c mut self,
        statuses: &'c [Status],
        older_than_secs: f64,
        batch: i64,
    ) -> BoxFuture<'c, Result<u64, sqlx::Error>>;

    /// Deletes at most `batch` rows of `inbox_rejections` received more than `older_than_secs`
    /// ago, oldest first. Returns how many went.
    fn purge_rejections_batch(
        &mut self,
        older_than_secs: f64,
        batch: i64,
    ) -> BoxFuture<'_, Result<u64, sqlx::Error>>;

    /// The clocks a purge of `older_than_secs` goes by (see [`PurgeClock`]): the
    /// connection's clock, the cutoff [`AdminStore::purge_batch`] would use now, and, where
    /// each process stamps rows with its own clock (SQLite), the newest time written into the
    /// inbox tables and how far it lies ahead of this connection's clock.
    fn purge_clock(
        &mut self,
        older_than_secs: f64,
    ) -> BoxFuture<'_, Result<PurgeClock, sqlx::Error>>;

    /// What [`AdminStore::purge_batch`] (and, with `rejections`,
    /// [`AdminStore::purge_rejections_batch`]) would delete now, without deleting: per consumer
    /// and status (or rejection reason), the count and the oldest settled time (`processed_at`,
    /// else `received_at`).
    fn purge_preview<'c>(
        &'c mut self,
        statuses: &'c [Status],
        older_than_secs: f64,
        rejections: bool,
    ) -> BoxFuture<'c, Result<Vec<StatsRow>, sqlx::Error>>;
}

/// A connection type an `#[idempotent]` handler can take as its first parameter: the backend's
/// transactions plus its store capabilities.
///
/// Implemented for `sqlx::PgConnection`, `sqlx::SqliteConnection` and `sqlx::MySqlConnection`.
/// To add a backend,
/// implement this and the three capability traits for its sqlx connection type, and
/// [`InboxDatabase`] for its sqlx database type.
pub trait InboxConnection:
    sqlx::Connection + ClaimStore + OrderingStore + AdminStore + Send + Sized + 'static
{
    /// The backend this connection talks to.
    const BACKEND: Backend;

    /// Opens the transaction the claim and the handler body share (a savepoint if the
    /// connection is already inside a transaction).
    fn begin_inbox(
        &mut self,
    ) -> BoxFuture<'_, Result<Transaction<'_, Self::Database>, sqlx::Error>>;

    /// The statement that opens a claim's transaction on this connection: `None` for the
    /// driver's default (`BEGIN`, or a savepoint inside a transaction).
    fn begin_statement(&self) -> Option<sqlx::SqlStr>;

    /// The connection inside a transaction opened by [`InboxConnection::begin_inbox`].
    fn in_transaction<'t>(tx: &'t mut Transaction<'_, Self::Database>) -> &'t mut Self;

    /// Type-erases this connection (for the type-erased dispatcher and hooks).
    fn as_any(&mut self) -> AnyConnection<'_> {
        AnyConnection(self)
    }

    /// Narrows a type-erased connection to this type, if it is one.
    fn from_any(conn: AnyConnection<'_>) -> Option<&mut Self> {
        conn.0.downcast_mut::<Self>()
    }
}

/// A database an inbox can live in: `sqlx::Postgres`, `sqlx::Sqlite` or `sqlx::MySql` (or a backend of your
/// own: see [`ClaimStore`]).
pub trait InboxDatabase:
    sqlx::Database<Connection: InboxConnection + sqlx::migrate::Migrate>
{
    /// The backend.
    const BACKEND: Backend;

    /// The schema migrations of `component` on this backend: `(version, description, SQL)` in
    /// version order, applied by [`crate::migrate_components`]; empty if the backend does not
    /// have the component.
    fn migrations(component: Component) -> &'static [(i64, &'static str, &'static str)];
}

/// A part of the inbox's schema with migrations (and a version record) of its own, so that an
/// application gets only the tables of what it uses: the inbox itself, the transactional
/// outbox, broker positions.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Component {
    /// `inbox_messages`, `inbox_aggregate_state`, `inbox_rejections`; versions recorded in
    /// [`MIGRATIONS_TABLE`] (`_inbox_migrations`).
    Inbox,
    /// The transactional outbox: `inbox_outbox` (see [`crate::outbox`]); versions recorded in
    /// [`OUTBOX_MIGRATIONS_TABLE`] (`_inbox_outbox_migrations`). PostgreSQL 13 or newer; MySQL
    /// 8.0.16 or newer, MariaDB 10.6 or newer (for `FOR UPDATE SKIP LOCKED`), where it adds
    /// `inbox_outbox_aggregates`, the per-aggregate lock rows of its ordering.
    Outbox,
    /// Broker positions: `inbox_positions`, a consumer group's next offset per topic partition
    /// with its fencing epoch (see [`PositionStore`]; the Kafka source keeps its offsets
    /// there); versions recorded in [`POSITIONS_MIGRATIONS_TABLE`]
    /// (`_inbox_positions_migrations`).
    Positions,
}

impl Component {
    /// The table where this component's applied migration versions are recorded.
    pub fn version_table(self) -> &'static str {
        match self {
            Component::Inbox => MIGRATIONS_TABLE,
            Component::Outbox => OUTBOX_MIGRATIONS_TABLE,
            Component::Positions => POSITIONS_MIGRATIONS_TABLE,
        }
    }
}

/// The migrator of one component on `DB`, recording its versions in the component's table.
pub(crate) fn migrator<DB: InboxDatabase>(component: Component) -> Migrator {
    let mut migrator = Migrator::with_migrations(
        DB::migrations(component)
            .iter()
            .map(|&(version, description, sql)| {
                Migration::new(
                    version,
                    Cow::Borrowed(description),
                    MigrationType::Simple,
                    sqlx::AssertSqlSafe(sql).into_sql_str(),
                    false,
                )
            })
            .collect(),
    );
    migrator.dangerous_set_table_name(component.version_table());
    migrator
}

/// Where a record's source metadata comes from.
fn source_parts(source: Option<&SourceMetadata>) -> (Option<&str>, Option<&str>, Option<i64>) {
    match source {
        Some(s) => (Some(s.source.as_str()), s.partition.as_deref(), s.offset),
        None => (None, None, None),
    }
}
