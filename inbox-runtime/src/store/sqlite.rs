//! SQLite inbox store.

use sqlx::migrate::MigrateError;
use sqlx::{Connection, Pool, Row, Sqlite, SqliteConnection, Transaction};

use super::{AnyConnection, Backend, ClaimRequest, ClaimResult, InboxConnection, InboxDatabase};
use crate::BoxFuture;

/// The claim (see the PostgreSQL store). SQLite serializes writers, and the transaction is
/// opened with `BEGIN IMMEDIATE`, so the claim never races another writer inside SQLite.
const CLAIM: &str = "INSERT INTO inbox_messages \
     (consumer, message_key, message_name, payload_hash, status, attempts, received_at, \
      processed_at, source, source_partition, source_offset) \
     VALUES (?1, ?2, ?3, ?4, 'processed', 1, strftime('%Y-%m-%dT%H:%M:%fZ', 'now'), \
      strftime('%Y-%m-%dT%H:%M:%fZ', 'now'), ?5, ?6, ?7) \
     ON CONFLICT (consumer, message_key) DO NOTHING \
     RETURNING 1";

const EXISTING: &str = "SELECT payload_hash, status FROM inbox_messages \
     WHERE consumer = ?1 AND message_key = ?2";

const MIGRATION: &str = include_str!("../../migrations/sqlite/0001_inbox.sql");

impl InboxConnection for SqliteConnection {
    const BACKEND: Backend = Backend::Sqlite;

    fn begin_inbox(&mut self) -> BoxFuture<'_, Result<Transaction<'_, Sqlite>, sqlx::Error>> {
        if self.is_in_transaction() {
            // Nested: a savepoint inside the caller's transaction.
            Box::pin(self.begin())
        } else {
            // Take the write lock up front: a deferred transaction that reads and then writes
            // can fail with SQLITE_BUSY instead of waiting for the busy timeout.
            Box::pin(self.begin_with("BEGIN IMMEDIATE"))
        }
    }

    fn in_transaction<'t>(tx: &'t mut Transaction<'_, Sqlite>) -> &'t mut Self {
        &mut *tx
    }

    fn claim<'c>(
        &'c mut self,
        request: &'c ClaimRequest<'c>,
    ) -> BoxFuture<'c, Result<ClaimResult, sqlx::Error>> {
        Box::pin(async move {
            let claimed = sqlx::query(CLAIM)
                .bind(request.consumer)
                .bind(request.message_key)
                .bind(request.message_name)
                .bind(request.payload_hash)
                .bind(request.source.map(|s| s.source.as_str()))
                .bind(request.source.and_then(|s| s.partition.as_deref()))
                .bind(request.source.and_then(|s| s.offset))
                .fetch_optional(&mut *self)
                .await?;
            if claimed.is_some() {
                return Ok(ClaimResult::Claimed);
            }
            let row = sqlx::query(EXISTING)
                .bind(request.consumer)
                .bind(request.message_key)
                .fetch_one(&mut *self)
                .await?;
            Ok(ClaimResult::Existing {
                payload_hash: row.try_get(0)?,
                status: row.try_get(1)?,
            })
        })
    }

    fn from_any(conn: AnyConnection<'_>) -> Option<&mut Self> {
        match conn {
            AnyConnection::Sqlite(conn) => Some(conn),
            AnyConnection::Postgres(_) => None,
        }
    }
}

impl InboxDatabase for Sqlite {
    const BACKEND: Backend = Backend::Sqlite;

    fn migrate(pool: &Pool<Self>) -> BoxFuture<'_, Result<(), MigrateError>> {
        Box::pin(async move { super::migrator(MIGRATION).run(pool).await })
    }

    fn any_connection(conn: &mut SqliteConnection) -> AnyConnection<'_> {
        AnyConnection::Sqlite(conn)
    }
}
