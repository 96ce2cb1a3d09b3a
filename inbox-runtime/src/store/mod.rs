//! Stores: small capability traits — the inbox's ([`ClaimStore`], [`OrderingStore`],
//! [`AdminStore`], joined by [`InboxConnection`]), the outbox's ([`OutboxStore`],
//! [`OutboxAdminStore`]), broker positions' ([`PositionStore`]) and the console's
//! ([`ConsoleStore`]) — implemented for `PgConnection`, `SqliteConnection` and `MySqlConnection`
//! (MySQL and MariaDB).
//!
//! The protocol calls only these traits. They are implemented once, in `inbox`, for every sqlx
//! connection whose database states an inbox dialect: its SQL (each statement with the values
//! it binds) and its behavioural hooks. Each backend is one folder (`postgres/`, `sqlite/`,
//! `mysql/`) with its dialect and its migrations; `dialect` is what every backend says about
//! itself (its name, its migrations, what its errors mean), `retry` the lock-error retries of a
//! backend that has them, `sql` the sqlx glue the generic code runs statements with, `types`
//! the values the traits take and return. The backend of a handler follows from its connection
//! type.
//!
//! Schema migrations come per [`Component`], each with its own version record.
//!
//! What is here serves whoever implements or calls a store directly (a new backend, a test, an
//! operator's tool); a service needs only [`Component`] (also at the crate root) and
//! [`crate::migrate_components`].

use std::borrow::Cow;

use sqlx::migrate::{Migration, MigrationType, Migrator};
use sqlx::{SqlSafeStr as _, Transaction};

use crate::BoxFuture;
use crate::types::status::Status;

mod console;
mod dialect;
mod inbox;
mod mysql;
mod outbox;
mod positions;
mod postgres;
mod prefix;
mod retry;
#[allow(dead_code)]
// The glue is shared with the outbox, positions and console stores as they move onto it.
pub(crate) mod sql;
mod sqlite;
mod types;

pub use console::{
    ArrivalRow, ConsoleDatabase, ConsoleStore, ParkedEntry, RejectionEntry, RetryLag, SentRow,
};
pub use mysql::mysql_lock_retries;
pub use postgres::{PgSchema, PgSchemaError};
pub use prefix::{TablePrefix, TablePrefixError};
pub(crate) use prefix::{spawn, within};

pub use outbox::{
    Lease, NOTIFY_CHANNEL, OutboxAdminStore, OutboxBacklog, OutboxDatabase, OutboxEntry,
    OutboxFailure, OutboxRecord, OutboxRow, OutboxStatsRow, OutboxStatus, OutboxStore, Wakeups,
};

pub use positions::{Acquired, PositionKey, PositionRow, PositionStore, PositionsDatabase};

pub use types::{
    Backend, ClaimRequest, ClaimResult, ExistingRow, FailureRecord, MessageMark, ParkedMessage,
    PurgeClock, Rejection, RejectionReason, StatsRow, StatsStatus, StoredMessage,
};
pub(crate) use types::{request_index, source_parts};

pub(crate) use dialect::{Contention, ErrorKind, database_error_kind};

/// Every shipped backend's answers about its driver's errors, asked in this order (each answers
/// only for its own driver's errors).
const ERROR_HOOKS: [dialect::ErrorHooks; 3] = [
    dialect::ErrorHooks::of::<sqlx::MySql>(),
    dialect::ErrorHooks::of::<sqlx::Postgres>(),
    dialect::ErrorHooks::of::<sqlx::Sqlite>(),
];

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
/// Implemented once for `sqlx::PgConnection`, `sqlx::SqliteConnection` and
/// `sqlx::MySqlConnection`, over each backend's SQL dialect (MySQL's claim is an upsert and a
/// locking read: see the `mysql` store). The protocol only ever calls these methods, so a
/// backend without `RETURNING` or `ON CONFLICT … WHERE` (MySQL) is added without touching it. Every method runs on the
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

    /// Sets a claimed row's status (`stale`, `parked`), ordering and payload, as `mark` says.
    fn mark_message<'c>(
        &'c mut self,
        mark: &'c MessageMark<'c>,
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
/// Implemented for `sqlx::PgConnection`, `sqlx::SqliteConnection` and `sqlx::MySqlConnection`
/// (one implementation, over each backend's SQL dialect). A backend of your own implements this
/// and the three capability traits for its connection type, and [`InboxDatabase`] for its sqlx
/// database type.
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

    /// Whether a batch may first run optimistically, every handler straight on the batch's
    /// transaction (a failure then rolls the batch back and it runs again with a savepoint
    /// per handler): only where a handler cannot end the transaction under the batch's feet.
    /// On PostgreSQL an error leaves the transaction aborted (later statements fail, and COMMIT
    /// is checked first); elsewhere (`false`, the default) every handler runs in a savepoint.
    const OPTIMISTIC_BATCHES: bool = false;

    /// Whether claims on this backend wait on a lock that any writer holds, whatever its key
    /// (SQLite's one write lock), so that the database cannot tell a no-wait claim whether
    /// another claim holds the key: claim sessions then register their keys in a registry of
    /// this process, which a no-wait session checks first. `false` by default.
    const LOCAL_CLAIM_REGISTRY: bool = false;

    /// Whether a transaction can end and the next begin in one round trip
    /// ([`verify_commit_begin`](Self::verify_commit_begin),
    /// [`rollback_begin`](Self::rollback_begin)), so that a connection the runtime keeps may
    /// hold an empty *spare* transaction between deliveries (see
    /// [`ConnectionSlot`](crate::ConnectionSlot)). PostgreSQL: `true`; `false` by default.
    const CHAINED_TRANSACTIONS: bool = false;

    /// Ends the claim's transaction (the outermost one, not a savepoint) in one round trip, if
    /// the backend can: checks that the transaction still holds its claim, commits, and begins
    /// the next transaction, left empty and open (`None`: the backend cannot; the protocol then
    /// checks with [`ClaimStore::verify_claim`] and commits, two round trips). The connection's
    /// transaction depth stays 1, truthfully: the caller ends the empty transaction (the claim
    /// protocol queues its `ROLLBACK`, which goes out with the connection's next statement, or
    /// with the pool's check when the connection goes back to its pool).
    ///
    /// PostgreSQL: one simple query, `SELECT 1/(coalesce(current_setting('inbox.claim', true),
    /// '') = '1')::int; COMMIT; BEGIN`, where `inbox.claim` is a transaction-local setting that
    /// the claim statement sets: an aborted transaction fails at the first statement (SQLSTATE
    /// `25P02`), one that the handler ended itself (a `COMMIT` or `ROLLBACK` of its own) has lost
    /// the setting, and `COMMIT` is never reached. `None` elsewhere (the default).
    ///
    /// # Errors
    /// [`StoreOperation::Verify`](crate::types::StoreOperation::Verify) if the check failed (nothing
    /// committed; the transaction is left to roll back), [`StoreOperation::Commit`](crate::types::StoreOperation::Commit)
    /// if `COMMIT` failed (a deferred constraint, a serialization failure: rolled back; a lost
    /// connection: unknown). An error after `COMMIT` completed (the connection terminated
    /// before the `BEGIN`) is not one: the transaction committed, and the connection's next
    /// statement finds it gone.
    fn verify_commit_begin(
        &mut self,
    ) -> Option<BoxFuture<'_, Result<(), (crate::types::StoreOperation, sqlx::Error)>>> {
        None
    }

    /// `ROLLBACK` and `BEGIN` in one round trip, for a claim's transaction that found its key
    /// taken (a duplicate) on a connection the runtime keeps: the next delivery's claim runs in
    /// the new, empty transaction. PostgreSQL: one simple query, `ROLLBACK; BEGIN`; `None`
    /// elsewhere (the default).
    ///
    /// # Errors
    /// The database's error if either statement failed (a lost connection): the transaction
    /// is then ended as after a failed `ROLLBACK`.
    fn rollback_begin(&mut self) -> Option<BoxFuture<'_, Result<(), sqlx::Error>>> {
        None
    }

    /// Gives up on any lock the rest of this transaction waits for longer than `timeout`
    /// (whole milliseconds, at least 1): PostgreSQL's `lock_timeout`, set for the transaction
    /// (`SET LOCAL`). A batch that runs beside others sets it, so that a lock cycle between
    /// batches ends at once instead of after the server's deadlock detection. Nothing on a
    /// backend without such a setting (the default).
    ///
    /// # Errors
    /// The statement's error.
    fn set_lock_timeout(
        &mut self,
        timeout: std::time::Duration,
    ) -> BoxFuture<'_, Result<(), sqlx::Error>> {
        let _ = timeout;
        Box::pin(async { Ok(()) })
    }

    /// Type-erases this connection (for the type-erased dispatcher and hooks).
    fn as_any(&mut self) -> AnyConnection<'_> {
        AnyConnection(self)
    }

    /// Narrows a type-erased connection to this type, if it is one.
    fn from_any(conn: AnyConnection<'_>) -> Option<&mut Self> {
        conn.0.downcast_mut::<Self>()
    }
}

/// A database an inbox can live in: `sqlx::Postgres`, `sqlx::Sqlite` or `sqlx::MySql` (or a
/// backend of your own: see [`ClaimStore`]).
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

/// The migrator of one component on `DB`, recording its versions in the component's table: with
/// the names of the [`TablePrefix`] in scope, if any (its tables, indexes, constraints and
/// version table).
pub(crate) fn migrator<DB: InboxDatabase>(component: Component) -> Migrator {
    let prefix = TablePrefix::current();
    let mut migrator = Migrator::with_migrations(
        DB::migrations(component)
            .iter()
            .map(|&(version, description, sql)| {
                // The checksum is the rewritten text's: each prefix's history is its own.
                let sql = match &prefix {
                    Some(prefix) => sqlx::AssertSqlSafe(prefix.rewrite(sql)).into_sql_str(),
                    None => sqlx::AssertSqlSafe(sql).into_sql_str(),
                };
                Migration::new(
                    version,
                    Cow::Borrowed(description),
                    MigrationType::Simple,
                    sql,
                    false,
                )
            })
            .collect(),
    );
    migrator.dangerous_set_table_name(prefix::version_table(component.version_table()));
    migrator
}
