//! Inbox stores: the claim statement and migrations of each backend.
//!
//! The backend of a handler follows from its connection type: `&mut sqlx::PgConnection` claims
//! in PostgreSQL, `&mut sqlx::SqliteConnection` in SQLite. The SQL text of each backend lives in
//! its own module.

use std::borrow::Cow;

use sqlx::migrate::{MigrateError, Migration, MigrationType, Migrator};
use sqlx::{Pool, Transaction};

use crate::BoxFuture;
use crate::envelope::SourceMetadata;

mod postgres;
mod sqlite;

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

/// A borrowed connection of any supported backend (used by the type-erased dispatcher).
#[doc(hidden)]
pub enum AnyConnection<'c> {
    /// A PostgreSQL connection.
    Postgres(&'c mut sqlx::PgConnection),
    /// A SQLite connection.
    Sqlite(&'c mut sqlx::SqliteConnection),
}

/// What one claim asks the inbox for.
#[doc(hidden)]
pub struct ClaimRequest<'a> {
    pub consumer: &'a str,
    pub message_key: &'a str,
    pub message_name: &'a str,
    pub payload_hash: &'a str,
    pub source: Option<&'a SourceMetadata>,
}

/// What the claim statement found.
#[doc(hidden)]
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ClaimResult {
    /// The key was free and is now held by this transaction.
    Claimed,
    /// A row for the key exists (committed by an earlier or a concurrent transaction).
    Existing {
        /// The stored fingerprint (hex).
        payload_hash: String,
        /// The stored status.
        status: String,
    },
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

    /// The connection inside a transaction opened by [`InboxConnection::begin_inbox`].
    #[doc(hidden)]
    fn in_transaction<'t>(tx: &'t mut Transaction<'_, Self::Database>) -> &'t mut Self;

    /// Runs the claim: `INSERT … ON CONFLICT DO NOTHING` first, then, only if the key was
    /// taken, reads the stored fingerprint.
    #[doc(hidden)]
    fn claim<'c>(
        &'c mut self,
        request: &'c ClaimRequest<'c>,
    ) -> BoxFuture<'c, Result<ClaimResult, sqlx::Error>>;

    /// Narrows a type-erased connection to this backend's, if it is one.
    #[doc(hidden)]
    fn from_any(conn: AnyConnection<'_>) -> Option<&mut Self>;
}

/// A database an inbox can live in: `sqlx::Postgres` or `sqlx::Sqlite`. Sealed.
pub trait InboxDatabase: sqlx::Database + sealed::Sealed {
    /// The backend.
    const BACKEND: Backend;

    /// Applies the inbox migrations (see [`crate::migrate`]).
    #[doc(hidden)]
    fn migrate(pool: &Pool<Self>) -> BoxFuture<'_, Result<(), MigrateError>>;

    /// Type-erases a connection of this database.
    #[doc(hidden)]
    fn any_connection(conn: &mut Self::Connection) -> AnyConnection<'_>;
}

fn migrator(sql: &'static str) -> Migrator {
    let mut migrator = Migrator::with_migrations(vec![Migration::new(
        1,
        Cow::Borrowed("inbox"),
        MigrationType::Simple,
        sqlx::AssertSqlSafe(sql).into_sql_str(),
        false,
    )]);
    migrator.dangerous_set_table_name(MIGRATIONS_TABLE);
    migrator
}

use sqlx::SqlSafeStr as _;
