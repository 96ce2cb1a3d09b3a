//! Broker positions on PostgreSQL: the [`PositionsDialect`] (an upsert that returns the row,
//! and a lock wait bounded by `lock_timeout`), with the positions component's migrations.

use sqlx::{Connection as _, Postgres};
use sqlx_core::transaction::TransactionManager as _;

use crate::store::positions::{self, Lock, PositionsDialect, Tried, acquire_upsert};
use crate::store::sql::{self, Arg, Run, Sql, Stmt};

/// The positions component's migrations on PostgreSQL.
pub(super) const MIGRATIONS: &[(i64, &str, &str)] =
    &positions::migrations([include_str!("migrations/positions/0001_positions.sql")]);

/// Sets the transaction's `lock_timeout` (bind: the value), returning the one in force.
const SET_LOCK_TIMEOUT: &str = "SELECT current_setting('lock_timeout') AS previous, \
     set_config('lock_timeout', $1, true)";

/// Puts a transaction's `lock_timeout` back (bind: the value).
const RESET_LOCK_TIMEOUT: &str = "SELECT set_config('lock_timeout', $1, true)";

/// SQLSTATE of a lock wait that ran out of `lock_timeout`.
const LOCK_NOT_AVAILABLE: &str = "55P03";

impl PositionsDialect for Postgres {
    const ACQUIRE: Stmt = Stmt::new(acquire_upsert!("now()"));

    const ADVANCE: Stmt = Stmt::new(
        "UPDATE inbox_positions SET \
         next_offset = GREATEST(COALESCE(next_offset, $5), $5), updated_at = now() \
       WHERE consumer_group = $1 AND topic = $2 AND partition_id = $3 AND epoch = $4",
    );

    /// The step in a transaction of its own (a savepoint inside the caller's) whose
    /// `lock_timeout` is the wait (at least 1 ms; put back before a savepoint is released):
    /// committed, or rolled back if a lock wait ran out.
    fn bounded<'c, A: Sync, T: Send + 'c>(run: Run<'c, Self, A, T>, row: Lock<'c>) -> Tried<'c, T> {
        Box::pin(async move {
            let (conn, args, step) = (run.conn, run.args, run.step);
            let nested =
                <Postgres as sqlx::Database>::TransactionManager::get_transaction_depth(conn) > 0;
            let mut tx = conn.begin().await?;
            // Zero would mean no timeout at all.
            let millis = row.wait.as_millis().clamp(1, i32::MAX as u128);
            let timeout = format!("{millis}ms");
            let set = [Arg::from(timeout.as_str())];
            let row = Postgres::fetch_one(&mut tx, sql::text(SET_LOCK_TIMEOUT), &set).await?;
            let previous = Postgres::text_required(&row, 0)?;
            match step(&mut tx, args).await {
                Ok(done) => {
                    if nested {
                        // Transaction-local: it would outlive the savepoint.
                        let reset = [Arg::from(previous.as_str())];
                        Postgres::execute(&mut tx, sql::text(RESET_LOCK_TIMEOUT), &reset).await?;
                    }
                    tx.commit().await?;
                    Ok(Some(done))
                }
                Err(error) if sql::error_code(&error).as_deref() == Some(LOCK_NOT_AVAILABLE) => {
                    tx.rollback().await?;
                    Ok(None)
                }
                Err(error) => Err(error),
            }
        })
    }
}
