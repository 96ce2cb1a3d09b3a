//! Broker positions on MySQL/MariaDB: the [`PositionsDialect`] (an upsert and a locking read
//! of the row it locked, no `RETURNING`; a lock wait bounded by `NOWAIT` reads tried again),
//! with the positions component's migrations.
//!
//! The assignment is an `INSERT … ON DUPLICATE KEY UPDATE`
//! (an exclusive lock on the row's primary-key record, waiting for a transaction that wrote the
//! position, under REPEATABLE READ and READ COMMITTED alike) followed by a locking read of the
//! row (`FOR UPDATE`: the latest committed version, whatever the isolation level; it never
//! waits, the row being locked already), both in one transaction (a savepoint inside the
//! caller's). The fenced write is one `UPDATE` by primary key (a record lock). A deadlock (1213)
//! or lock wait timeout (1205) of an assignment made outside a transaction is retried
//! internally and counted in [`mysql_lock_retries`](crate::store::mysql_lock_retries), and so is
//! one of a fenced write in autocommit; inside the caller's transaction it is returned (transient:
//! see [`crate::Classify`]). Inside: sqlx counts a transaction, or the server reports one (a raw
//! `BEGIN`, which sqlx does not count): there the assignment runs in it (a `BEGIN` of ours would
//! commit it implicitly) and nothing is retried (a deadlock rolled the caller's back).

use std::time::{Duration, Instant};

use sqlx::{Connection as _, MySql, MySqlConnection};
use sqlx_core::transaction::TransactionManager as _;

use super::{ER_LOCK_WAIT_TIMEOUT, error_number, in_transaction, server_in_transaction};
use crate::store::positions::{self, Lock, PositionsDialect, Tried};
use crate::store::sql::{self, Arg, Run, Sql, Stmt};

/// The positions component's migrations on MySQL/MariaDB.
pub(super) const MIGRATIONS: &[(i64, &str, &str)] =
    &positions::migrations([include_str!("migrations/positions/0001_positions.sql")]);

/// Locks the row, or fails at once if another transaction holds it. Binds: group, topic,
/// partition.
const LOCK_NOWAIT: &str = "SELECT epoch FROM inbox_positions \
   WHERE consumer_group = ? AND topic = ? AND partition_id = ? FOR UPDATE NOWAIT";

/// MySQL's error number for a `NOWAIT` lock another transaction holds (`ER_LOCK_NOWAIT`);
/// MariaDB reports a lock wait timeout (1205) instead.
const ER_LOCK_NOWAIT: u16 = 3572;

impl PositionsDialect for MySql {
    const ACQUIRE: Stmt = Stmt::new(
        "INSERT INTO inbox_positions \
         (consumer_group, topic, partition_id, owner) VALUES (?, ?, ?, ?) \
       ON DUPLICATE KEY UPDATE epoch = epoch + 1, owner = VALUES(owner), \
         assigned_at = UTC_TIMESTAMP(6), updated_at = UTC_TIMESTAMP(6)",
    );

    const ACQUIRED: Option<Stmt> = Some(Stmt::binding(
        "SELECT epoch, next_offset FROM inbox_positions \
       WHERE consumer_group = ? AND topic = ? AND partition_id = ? FOR UPDATE",
        &[0, 1, 2],
    ));

    const ADVANCE: Stmt = Stmt::binding(
        "UPDATE inbox_positions SET \
         next_offset = GREATEST(COALESCE(next_offset, ?), ?), updated_at = UTC_TIMESTAMP(6) \
       WHERE consumer_group = ? AND topic = ? AND partition_id = ? AND epoch = ?",
        &[4, 4, 0, 1, 2, 3],
    );

    const FETCH: Stmt = Stmt::new(
        "SELECT CONVERT(consumer_group USING utf8mb4), \
         CONVERT(topic USING utf8mb4), partition_id, next_offset, epoch, owner \
       FROM inbox_positions WHERE consumer_group = ? ORDER BY topic, partition_id",
    );

    /// [`lock_row`], then the step, both in a transaction of their own (a savepoint inside the
    /// caller's; in one the server has open and sqlx does not count, a raw `BEGIN`, in that
    /// one: a `BEGIN` of ours would commit it): committed, or rolled back if the row stayed
    /// locked for the wait.
    fn bounded<'c, A: Sync, T: Send + 'c>(run: Run<'c, Self, A, T>, row: Lock<'c>) -> Tried<'c, T> {
        Box::pin(async move {
            let (conn, args, step) = (run.conn, run.args, run.step);
            let depth = <MySql as sqlx::Database>::TransactionManager::get_transaction_depth(conn);
            if depth == 0 && in_transaction(conn).await? {
                if lock_row(conn, row).await? {
                    return step(conn, args).await.map(Some);
                }
                return Ok(None);
            }
            let mut tx = conn.begin().await?;
            if lock_row(&mut tx, row).await? {
                let done = step(&mut tx, args).await?;
                tx.commit().await?;
                Ok(Some(done))
            } else {
                tx.rollback().await?;
                Ok(None)
            }
        })
    }
}

/// Whether a MySQL/MariaDB error is a `NOWAIT` lock refused: MySQL's 3572, MariaDB's 1205.
fn nowait_refused(error: &sqlx::Error) -> bool {
    matches!(
        error_number(error),
        Some(ER_LOCK_NOWAIT | ER_LOCK_WAIT_TIMEOUT)
    )
}

/// Locks the position's row in `conn`'s transaction, trying again every 10 ms while another
/// transaction holds it, until `lock_wait` has passed: `false` if it still held it then. A
/// missing row is no wait (the statement that follows creates it). A refusal that ended the
/// transaction (MariaDB's 1205 under `innodb_rollback_on_timeout`) is returned as the error.
async fn lock_row(conn: &mut MySqlConnection, lock: Lock<'_>) -> Result<bool, sqlx::Error> {
    // A wait no clock can add (`Duration::MAX`): a year, "until the row is free".
    let deadline = Instant::now()
        .checked_add(lock.wait)
        .unwrap_or_else(|| Instant::now() + Duration::from_secs(365 * 86_400));
    let key = lock.key;
    let args = [
        Arg::from(key.group),
        Arg::from(key.topic),
        Arg::I32(Some(key.partition)),
    ];
    loop {
        match MySql::execute(conn, sql::text(LOCK_NOWAIT), &args).await {
            Ok(_) => return Ok(true),
            Err(error) if nowait_refused(&error) => {
                if !server_in_transaction(conn).await? {
                    return Err(error);
                }
                let left = deadline.saturating_duration_since(Instant::now());
                if left.is_zero() {
                    return Ok(false);
                }
                tokio::time::sleep(left.min(Duration::from_millis(10))).await;
            }
            Err(error) => return Err(error),
        }
    }
}
