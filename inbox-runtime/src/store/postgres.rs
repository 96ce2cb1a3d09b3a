//! PostgreSQL inbox store.

use sqlx::migrate::MigrateError;
use sqlx::{Connection, PgConnection, Pool, Postgres, Row, Transaction};

use super::{AnyConnection, Backend, ClaimRequest, ClaimResult, InboxConnection, InboxDatabase};
use crate::BoxFuture;

/// The claim. First statement of the transaction; `ON CONFLICT DO NOTHING` never raises a
/// unique violation (which would abort the PostgreSQL transaction). When another transaction
/// holds an uncommitted claim on the same key, this statement waits for it to finish.
const CLAIM: &str = "INSERT INTO inbox_messages \
     (consumer, message_key, message_name, payload_hash, status, attempts, received_at, \
      processed_at, source, source_partition, source_offset) \
     VALUES ($1, $2, $3, $4, 'processed', 1, now(), now(), $5, $6, $7) \
     ON CONFLICT (consumer, message_key) DO NOTHING \
     RETURNING 1";

/// Read only when the claim found the key taken. A separate statement, so that under READ
/// COMMITTED it sees a row committed by a concurrent transaction while the claim waited.
const EXISTING: &str = "SELECT payload_hash, status FROM inbox_messages \
     WHERE consumer = $1 AND message_key = $2";

const MIGRATION: &str = include_str!("../../migrations/postgres/0001_inbox.sql");

impl InboxConnection for PgConnection {
    const BACKEND: Backend = Backend::Postgres;

    fn begin_inbox(&mut self) -> BoxFuture<'_, Result<Transaction<'_, Postgres>, sqlx::Error>> {
        Box::pin(self.begin())
    }

    fn in_transaction<'t>(tx: &'t mut Transaction<'_, Postgres>) -> &'t mut Self {
        &mut *tx
    }

    fn claim<'c>(
        &'c mut self,
        request: &'c ClaimRequest<'c>,
    ) -> BoxFuture<'c, Result<ClaimResult, sqlx::Error>> {
        Box::pin(async move {
            // A key deleted by a retention purge between the two statements is claimed again;
            // three rounds are more than such a race can take.
            for _ in 0..3 {
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
                let existing = sqlx::query(EXISTING)
                    .bind(request.consumer)
                    .bind(request.message_key)
                    .fetch_optional(&mut *self)
                    .await?;
                if let Some(row) = existing {
                    return Ok(ClaimResult::Existing {
                        payload_hash: row.try_get(0)?,
                        status: row.try_get(1)?,
                    });
                }
            }
            Err(sqlx::Error::Protocol(
                "inbox claim: key neither claimable nor present after 3 rounds".into(),
            ))
        })
    }

    fn from_any(conn: AnyConnection<'_>) -> Option<&mut Self> {
        match conn {
            AnyConnection::Postgres(conn) => Some(conn),
            AnyConnection::Sqlite(_) => None,
        }
    }
}

impl InboxDatabase for Postgres {
    const BACKEND: Backend = Backend::Postgres;

    fn migrate(pool: &Pool<Self>) -> BoxFuture<'_, Result<(), MigrateError>> {
        Box::pin(async move { super::migrator(MIGRATION).run(pool).await })
    }

    fn any_connection(conn: &mut PgConnection) -> AnyConnection<'_> {
        AnyConnection::Postgres(conn)
    }
}
