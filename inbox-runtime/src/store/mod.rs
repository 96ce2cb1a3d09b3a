//! Inbox stores: the SQL of each backend, behind one trait implemented for `PgConnection` and
//! `SqliteConnection`.
//!
//! The backend of a handler follows from its connection type. Statements whose text is the same
//! on both backends live here (both accept `$N` parameters when each first appears in order);
//! those that differ (clock arithmetic, the claim) live in the backend's module. The Rust side
//! of every operation is written once, in `impl_inbox_connection!`, and instantiated per backend.

use std::borrow::Cow;

use sqlx::migrate::{MigrateError, Migration, MigrationType, Migrator};
use sqlx::{Pool, SqlSafeStr as _, Transaction};

use crate::BoxFuture;
use crate::envelope::SourceMetadata;
use crate::status::Status;

#[macro_use]
mod shared;
mod postgres;
mod sqlite;

pub use shared::{
    ClaimRequest, ClaimResult, RejectionReason, StatsRow, StatsStatus, StoredMessage,
};
pub(crate) use shared::{FailureRecord, ParkedMessage, Rejection};

/// Name of the table where the inbox's own schema migrations are recorded.
///
/// Kept apart from `_sqlx_migrations` so that the application's own `sqlx migrate` history and
/// the inbox's never see each other's versions.
pub const MIGRATIONS_TABLE: &str = "_inbox_migrations";

/// Which database an inbox lives in.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Backend {
    /// PostgreSQL (12 or newer), through `sqlx::PgConnection`.
    Postgres,
    /// SQLite (3.35 or newer, for `RETURNING`), through `sqlx::SqliteConnection`.
    Sqlite,
}

impl std::fmt::Display for Backend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Backend::Postgres => "postgres",
            Backend::Sqlite => "sqlite",
        })
    }
}

mod sealed {
    pub trait Sealed {}
    impl Sealed for sqlx::PgConnection {}
    impl Sealed for sqlx::SqliteConnection {}
    impl Sealed for sqlx::Postgres {}
    impl Sealed for sqlx::Sqlite {}
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

/// A stored row found by the batch claim: `(consumer, key, Existing { .. })`.
#[doc(hidden)]
pub(crate) type ExistingRow = (String, String, ClaimResult);

/// A borrowed connection of any supported backend (used by the type-erased dispatcher).
#[doc(hidden)]
pub enum AnyConnection<'c> {
    /// A PostgreSQL connection.
    Postgres(&'c mut sqlx::PgConnection),
    /// A SQLite connection.
    Sqlite(&'c mut sqlx::SqliteConnection),
}

impl<'c> AnyConnection<'c> {
    /// A shorter-lived copy of this borrow.
    pub(crate) fn reborrow(&mut self) -> AnyConnection<'_> {
        match self {
            AnyConnection::Postgres(conn) => AnyConnection::Postgres(conn),
            AnyConnection::Sqlite(conn) => AnyConnection::Sqlite(conn),
        }
    }

    /// The connection's store operations, whatever its backend.
    pub(crate) fn store(self) -> &'c mut dyn Store {
        match self {
            AnyConnection::Postgres(conn) => conn,
            AnyConnection::Sqlite(conn) => conn,
        }
    }
}

/// The store operations that do not depend on a handler's types, object-safe, for the
/// dispatcher and the admin API. Blanket-implemented for every [`InboxConnection`].
pub(crate) trait Store: Send {
    fn record_rejection<'c>(
        &'c mut self,
        rejection: &'c Rejection<'c>,
    ) -> BoxFuture<'c, Result<(), sqlx::Error>>;
    fn fetch_message<'c>(
        &'c mut self,
        consumer: &'c str,
        key: &'c str,
    ) -> BoxFuture<'c, Result<Option<StoredMessage>, sqlx::Error>>;
    fn list_messages<'c>(
        &'c mut self,
        consumer: Option<&'c str>,
        statuses: &'c [Status],
        limit: i64,
    ) -> BoxFuture<'c, Result<Vec<StoredMessage>, sqlx::Error>>;
    fn discard_message<'c>(
        &'c mut self,
        consumer: &'c str,
        key: &'c str,
    ) -> BoxFuture<'c, Result<bool, sqlx::Error>>;
    fn stats(&mut self) -> BoxFuture<'_, Result<Vec<StatsRow>, sqlx::Error>>;
    fn find_parked<'c>(
        &'c mut self,
        consumer: &'c str,
        aggregate_id: &'c str,
        sequence: i64,
    ) -> BoxFuture<'c, Result<Option<ParkedMessage>, sqlx::Error>>;
    fn expired_parked<'c>(
        &'c mut self,
        older_than_secs: f64,
        limit: i64,
    ) -> BoxFuture<'c, Result<Vec<ParkedMessage>, sqlx::Error>>;
    fn dead_letter_parked<'c>(
        &'c mut self,
        consumer: &'c str,
        key: &'c str,
        reason: &'c str,
    ) -> BoxFuture<'c, Result<bool, sqlx::Error>>;
    fn purge_batch<'c>(
        &'c mut self,
        statuses: &'c [Status],
        older_than_secs: f64,
        batch: i64,
    ) -> BoxFuture<'c, Result<u64, sqlx::Error>>;
    fn purge_rejections_batch(
        &mut self,
        older_than_secs: f64,
        batch: i64,
    ) -> BoxFuture<'_, Result<u64, sqlx::Error>>;
}

impl<C: InboxConnection> Store for C {
    fn record_rejection<'c>(
        &'c mut self,
        rejection: &'c Rejection<'c>,
    ) -> BoxFuture<'c, Result<(), sqlx::Error>> {
        InboxConnection::record_rejection(self, rejection)
    }
    fn fetch_message<'c>(
        &'c mut self,
        consumer: &'c str,
        key: &'c str,
    ) -> BoxFuture<'c, Result<Option<StoredMessage>, sqlx::Error>> {
        InboxConnection::fetch_message(self, consumer, key)
    }
    fn list_messages<'c>(
        &'c mut self,
        consumer: Option<&'c str>,
        statuses: &'c [Status],
        limit: i64,
    ) -> BoxFuture<'c, Result<Vec<StoredMessage>, sqlx::Error>> {
        InboxConnection::list_messages(self, consumer, statuses, limit)
    }
    fn discard_message<'c>(
        &'c mut self,
        consumer: &'c str,
        key: &'c str,
    ) -> BoxFuture<'c, Result<bool, sqlx::Error>> {
        InboxConnection::discard_message(self, consumer, key)
    }
    fn stats(&mut self) -> BoxFuture<'_, Result<Vec<StatsRow>, sqlx::Error>> {
        InboxConnection::stats(self)
    }
    fn find_parked<'c>(
        &'c mut self,
        consumer: &'c str,
        aggregate_id: &'c str,
        sequence: i64,
    ) -> BoxFuture<'c, Result<Option<ParkedMessage>, sqlx::Error>> {
        InboxConnection::find_parked(self, consumer, aggregate_id, sequence)
    }
    fn expired_parked<'c>(
        &'c mut self,
        older_than_secs: f64,
        limit: i64,
    ) -> BoxFuture<'c, Result<Vec<ParkedMessage>, sqlx::Error>> {
        InboxConnection::expired_parked(self, older_than_secs, limit)
    }
    fn dead_letter_parked<'c>(
        &'c mut self,
        consumer: &'c str,
        key: &'c str,
        reason: &'c str,
    ) -> BoxFuture<'c, Result<bool, sqlx::Error>> {
        InboxConnection::dead_letter_parked(self, consumer, key, reason)
    }
    fn purge_batch<'c>(
        &'c mut self,
        statuses: &'c [Status],
        older_than_secs: f64,
        batch: i64,
    ) -> BoxFuture<'c, Result<u64, sqlx::Error>> {
        InboxConnection::purge_batch(self, statuses, older_than_secs, batch)
    }
    fn purge_rejections_batch(
        &mut self,
        older_than_secs: f64,
        batch: i64,
    ) -> BoxFuture<'_, Result<u64, sqlx::Error>> {
        InboxConnection::purge_rejections_batch(self, older_than_secs, batch)
    }
}

/// A connection type an `#[idempotent]` handler can take as its first parameter.
///
/// Implemented for `sqlx::PgConnection` and `sqlx::SqliteConnection`; sealed. The methods are
/// the runtime's, not part of the public API.
pub trait InboxConnection: sqlx::Connection + sealed::Sealed + Send + 'static {
    /// The backend this connection talks to.
    const BACKEND: Backend;

    /// Opens the transaction the claim and the handler body share (a savepoint if the
    /// connection is already inside a transaction).
    #[doc(hidden)]
    fn begin_inbox(
        &mut self,
    ) -> BoxFuture<'_, Result<Transaction<'_, Self::Database>, sqlx::Error>>;

    /// The statement that opens a claim's transaction on this connection: `None` for the
    /// driver's default (`BEGIN`, or a savepoint inside a transaction).
    #[doc(hidden)]
    fn begin_statement(&self) -> Option<sqlx::SqlStr>;

    /// The connection inside a transaction opened by [`InboxConnection::begin_inbox`].
    #[doc(hidden)]
    fn in_transaction<'t>(tx: &'t mut Transaction<'_, Self::Database>) -> &'t mut Self;

    /// The claim: the transaction's first statement. Takes a free key, or a `failed` one (and,
    /// when `replay`, a `dead` one) whose stored fingerprint equals the request's; otherwise
    /// reports what is stored.
    #[doc(hidden)]
    fn claim<'c>(
        &'c mut self,
        request: &'c ClaimRequest<'c>,
    ) -> BoxFuture<'c, Result<ClaimResult, sqlx::Error>>;

    /// The claim without waiting for another transaction that holds the key uncommitted:
    /// `None` if one does (the transaction is then unusable and must be rolled back). On
    /// PostgreSQL the claim runs with a `lock_timeout` of [`crate::Wait::NO_WAIT_GRACE`]; on
    /// SQLite it is the plain claim (the protocol checks the claims of this process first).
    #[doc(hidden)]
    fn claim_no_wait<'c>(
        &'c mut self,
        request: &'c ClaimRequest<'c>,
    ) -> BoxFuture<'c, Result<Option<ClaimResult>, sqlx::Error>>;

    /// Stores a claim session's result with the key claimed in this transaction.
    #[doc(hidden)]
    fn store_result<'c>(
        &'c mut self,
        consumer: &'c str,
        key: &'c str,
        result: &'c [u8],
    ) -> BoxFuture<'c, Result<(), sqlx::Error>>;

    /// The stored result of a key, if any.
    #[doc(hidden)]
    fn fetch_result<'c>(
        &'c mut self,
        consumer: &'c str,
        key: &'c str,
    ) -> BoxFuture<'c, Result<Option<Vec<u8>>, sqlx::Error>>;

    /// Checks, before COMMIT, that the transaction holding the claim of `key` is still usable:
    /// on PostgreSQL one cheap read that fails if the handler left the transaction aborted
    /// (there COMMIT would silently roll back); nothing on SQLite (a failed statement does not
    /// abort a SQLite transaction, and one that rolls it back makes COMMIT fail).
    #[doc(hidden)]
    fn verify_claim<'c>(
        &'c mut self,
        consumer: &'c str,
        key: &'c str,
    ) -> BoxFuture<'c, Result<(), sqlx::Error>>;

    /// The stored status, fingerprint and attempts of a key, read outside any transaction (the
    /// redelivery fast path), or `None`.
    #[doc(hidden)]
    fn existing<'c>(
        &'c mut self,
        consumer: &'c str,
        key: &'c str,
    ) -> BoxFuture<'c, Result<Option<ClaimResult>, sqlx::Error>>;

    /// Records a failed attempt in its own statement (autocommit): `failed` or `dead`, attempts
    /// + 1, last error, next attempt time, payload. Returns the stored status and attempts, or
    /// `None` if the key is no longer failed (processed by a concurrent delivery meanwhile).
    #[doc(hidden)]
    fn record_failure<'c>(
        &'c mut self,
        record: &'c FailureRecord<'c>,
    ) -> BoxFuture<'c, Result<Option<(Status, u32)>, sqlx::Error>>;

    /// Records a delivery that can never be applied (conflict, malformed, unknown, bad key).
    #[doc(hidden)]
    fn record_rejection<'c>(
        &'c mut self,
        rejection: &'c Rejection<'c>,
    ) -> BoxFuture<'c, Result<(), sqlx::Error>>;

    /// One stored row, payload included.
    #[doc(hidden)]
    fn fetch_message<'c>(
        &'c mut self,
        consumer: &'c str,
        key: &'c str,
    ) -> BoxFuture<'c, Result<Option<StoredMessage>, sqlx::Error>>;

    /// Rows in `statuses`, optionally of one consumer, oldest first, at most `limit`.
    #[doc(hidden)]
    fn list_messages<'c>(
        &'c mut self,
        consumer: Option<&'c str>,
        statuses: &'c [Status],
        limit: i64,
    ) -> BoxFuture<'c, Result<Vec<StoredMessage>, sqlx::Error>>;

    /// Marks a `failed` or `dead` row `discarded` (kept as a final state, payload dropped).
    /// Returns whether a row changed.
    #[doc(hidden)]
    fn discard_message<'c>(
        &'c mut self,
        consumer: &'c str,
        key: &'c str,
    ) -> BoxFuture<'c, Result<bool, sqlx::Error>>;

    /// Per consumer and status: count and oldest `received_at`; plus rejections per consumer
    /// and reason.
    #[doc(hidden)]
    fn stats(&mut self) -> BoxFuture<'_, Result<Vec<StatsRow>, sqlx::Error>>;

    /// Deletes at most `batch` rows in `statuses` whose `processed_at` (or `received_at` when
    /// unset) is older than `older_than_secs`. Returns how many went.
    #[doc(hidden)]
    fn purge_batch<'c>(
        &'c mut self,
        statuses: &'c [Status],
        older_than_secs: f64,
        batch: i64,
    ) -> BoxFuture<'c, Result<u64, sqlx::Error>>;

    /// Deletes at most `batch` rows of `inbox_rejections` received more than `older_than_secs`
    /// ago, oldest first. Returns how many went.
    #[doc(hidden)]
    fn purge_rejections_batch(
        &mut self,
        older_than_secs: f64,
        batch: i64,
    ) -> BoxFuture<'_, Result<u64, sqlx::Error>>;

    /// Locks the aggregate's state row (created at 0) and returns its last applied sequence.
    #[doc(hidden)]
    fn lock_aggregate<'c>(
        &'c mut self,
        consumer: &'c str,
        aggregate_id: &'c str,
    ) -> BoxFuture<'c, Result<i64, sqlx::Error>>;

    /// Sets the aggregate's last applied sequence.
    #[doc(hidden)]
    fn advance_aggregate<'c>(
        &'c mut self,
        consumer: &'c str,
        aggregate_id: &'c str,
        sequence: i64,
    ) -> BoxFuture<'c, Result<(), sqlx::Error>>;

    /// Sets a claimed row's status (`stale`, `parked`), ordering and payload.
    #[doc(hidden)]
    fn mark_message<'c>(
        &'c mut self,
        consumer: &'c str,
        key: &'c str,
        status: Status,
        ordering: &'c crate::Ordering,
        payload: Option<&'c [u8]>,
    ) -> BoxFuture<'c, Result<(), sqlx::Error>>;

    /// The parked (or failed) message of `aggregate_id` with `sequence`, if any.
    #[doc(hidden)]
    fn find_parked<'c>(
        &'c mut self,
        consumer: &'c str,
        aggregate_id: &'c str,
        sequence: i64,
    ) -> BoxFuture<'c, Result<Option<ParkedMessage>, sqlx::Error>>;

    /// Parked messages first delivered more than `older_than_secs` ago, oldest aggregates and
    /// sequences first, at most `limit`.
    #[doc(hidden)]
    fn expired_parked<'c>(
        &'c mut self,
        older_than_secs: f64,
        limit: i64,
    ) -> BoxFuture<'c, Result<Vec<ParkedMessage>, sqlx::Error>>;

    /// Turns a parked message dead, with `reason` as its last error.
    #[doc(hidden)]
    fn dead_letter_parked<'c>(
        &'c mut self,
        consumer: &'c str,
        key: &'c str,
        reason: &'c str,
    ) -> BoxFuture<'c, Result<bool, sqlx::Error>>;

    /// The batch claim: one multi-row `INSERT … ON CONFLICT` for keys that are unique within
    /// the batch. Per request, the attempts if claimed (free, or a failed key with the same
    /// fingerprint), else `None`.
    #[doc(hidden)]
    fn claim_batch<'c>(
        &'c mut self,
        requests: &'c [ClaimRequest<'c>],
    ) -> BoxFuture<'c, Result<Vec<Option<u32>>, sqlx::Error>>;

    /// The stored rows of `(consumer, key)` pairs, as `(consumer, key, Existing { .. })`.
    #[doc(hidden)]
    fn existing_batch<'c>(
        &'c mut self,
        keys: &'c [(&'c str, &'c str)],
    ) -> BoxFuture<'c, Result<Vec<ExistingRow>, sqlx::Error>>;

    /// Undoes this transaction's claim of a key (after its handler's savepoint was rolled back):
    /// deletes a freshly inserted row, or gives a taken-over `failed` row back its state.
    #[doc(hidden)]
    fn unclaim<'c>(
        &'c mut self,
        consumer: &'c str,
        key: &'c str,
        payload: &'c [u8],
    ) -> BoxFuture<'c, Result<(), sqlx::Error>>;

    /// Turns a row claimed in the current transaction into a failed (or dead) attempt.
    #[doc(hidden)]
    fn fail_claimed<'c>(
        &'c mut self,
        record: &'c FailureRecord<'c>,
    ) -> BoxFuture<'c, Result<Option<(Status, u32)>, sqlx::Error>>;

    /// Type-erases this connection.
    #[doc(hidden)]
    fn as_any(&mut self) -> AnyConnection<'_>;

    /// Narrows a type-erased connection to this backend's, if it is one.
    #[doc(hidden)]
    fn from_any(conn: AnyConnection<'_>) -> Option<&mut Self>;
}

/// A database an inbox can live in: `sqlx::Postgres` or `sqlx::Sqlite`. Sealed.
pub trait InboxDatabase: sqlx::Database<Connection: InboxConnection> + sealed::Sealed {
    /// The backend.
    const BACKEND: Backend;

    /// Applies the inbox migrations (see [`crate::migrate`]).
    #[doc(hidden)]
    fn migrate(pool: &Pool<Self>) -> BoxFuture<'_, Result<(), MigrateError>>;

    /// Type-erases a connection of this database.
    #[doc(hidden)]
    fn any_connection(conn: &mut Self::Connection) -> AnyConnection<'_>;
}

fn migrator(migrations: &[(i64, &'static str, &'static str)]) -> Migrator {
    let mut migrator = Migrator::with_migrations(
        migrations
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
    migrator.dangerous_set_table_name(MIGRATIONS_TABLE);
    migrator
}

/// Where a record's source metadata comes from.
fn source_parts(source: Option<&SourceMetadata>) -> (Option<&str>, Option<&str>, Option<i64>) {
    match source {
        Some(s) => (Some(s.source.as_str()), s.partition.as_deref(), s.offset),
        None => (None, None, None),
    }
}
