//! Broker positions on SQLite: the [`PositionsDialect`] (an upsert that returns the row, and a
//! lock wait bounded by the connection's busy timeout), with the positions component's
//! migrations.

use sqlx::{Sqlite, SqliteConnection};

use crate::store::positions::{self, Lock, PositionsDialect, Tried, acquire_upsert};
use crate::store::sql::{self, Run, Sql, Stmt};

/// The positions component's migrations on SQLite.
pub(super) const MIGRATIONS: &[(i64, &str, &str)] =
    &positions::migrations([include_str!("migrations/positions/0001_positions.sql")]);

impl PositionsDialect for Sqlite {
    const ACQUIRE: Stmt = Stmt::new(acquire_upsert!("strftime('%Y-%m-%dT%H:%M:%fZ', 'now')"));

    const ADVANCE: Stmt = Stmt::new(
        "UPDATE inbox_positions SET \
         next_offset = max(COALESCE(next_offset, $5), $5), \
         updated_at = strftime('%Y-%m-%dT%H:%M:%fZ', 'now') \
       WHERE consumer_group = $1 AND topic = $2 AND partition_id = $3 AND epoch = $4",
    );

    /// The step on its connection with the busy timeout at the wait, then the previous
    /// one put back: `None` if the database stayed locked (`SQLITE_BUSY`, `SQLITE_LOCKED`)
    /// that long.
    fn bounded<'c, A: Sync, T: Send + 'c>(run: Run<'c, Self, A, T>, row: Lock<'c>) -> Tried<'c, T> {
        Box::pin(async move {
            let (conn, args, step) = (run.conn, run.args, run.step);
            let timeout = Sqlite::fetch_one(conn, sql::text("PRAGMA busy_timeout"), &[]).await?;
            let previous = Sqlite::i64_required(&timeout, 0)?;
            let millis = row.wait.as_millis().min(i32::MAX as u128);
            set_busy_timeout(conn, millis).await?;
            let done = step(conn, args).await;
            set_busy_timeout(conn, previous).await?;
            match done {
                Ok(done) => Ok(Some(done)),
                Err(error) if locked(&error) => Ok(None),
                Err(error) => Err(error),
            }
        })
    }
}

/// Sets the connection's busy timeout, in milliseconds.
async fn set_busy_timeout(
    conn: &mut SqliteConnection,
    millis: impl std::fmt::Display,
) -> Result<(), sqlx::Error> {
    let pragma = sqlx::AssertSqlSafe(format!("PRAGMA busy_timeout = {millis}"));
    Sqlite::execute(conn, sql::text(pragma), &[]).await?;
    Ok(())
}

/// Whether a SQLite error is `SQLITE_BUSY` or `SQLITE_LOCKED` (primary codes 5 and 6, whatever
/// the extended code).
fn locked(error: &sqlx::Error) -> bool {
    sql::error_code(error)
        .and_then(|code| code.parse::<i32>().ok())
        .is_some_and(|code| matches!(code & 0xff, 5 | 6))
}
