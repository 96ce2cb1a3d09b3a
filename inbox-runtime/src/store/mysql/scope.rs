//! How the store's own statements run on MySQL/MariaDB ([`Scoped`]): in autocommit or a
//! transaction of the store's own, retried on a deadlock (1213) or lock wait timeout (1205)
//! like the inbox's statements (counted in
//! [`mysql_lock_retries`](crate::store::mysql_lock_retries)); or in the caller's transaction, where
//! such an error is returned (it may have rolled the caller's work back: transient, see
//! [`crate::Classify`]).
//!
//! "In the caller's transaction" is asked of the server when sqlx counts none: a transaction
//! begun with a raw `BEGIN` is the caller's too, and a `BEGIN` of the store's would commit it
//! implicitly.

use sqlx::{Connection as _, MySql, MySqlConnection};
use sqlx_core::transaction::TransactionManager as _;

use super::{LOCK_ATTEMPTS, in_transaction, lock_retry_pause, retryable};
use crate::store::sql::{Done, Run, Scope, Scoped, Step};

impl Scoped for MySql {
    fn scoped<'c, A: Sync, T: Send + 'c>(run: Run<'c, Self, A, T>) -> Done<'c, T> {
        Box::pin(async move {
            let Run {
                conn,
                args,
                step,
                scope,
                operation,
            } = run;
            let joined = match scope {
                Scope::Statement | Scope::Transaction => false,
                Scope::JoinElseStatement | Scope::JoinElseTransaction => {
                    in_transaction(conn).await?
                }
                Scope::RawElseTransaction => {
                    <MySql as sqlx::Database>::TransactionManager::get_transaction_depth(conn) == 0
                        && in_transaction(conn).await?
                }
            };
            if joined {
                return step(conn, args).await;
            }
            let own_transaction = !matches!(scope, Scope::Statement | Scope::JoinElseStatement);
            let mut attempt = 1;
            loop {
                let error = match once(conn, own_transaction, args, step).await {
                    Ok(done) => return Ok(done),
                    Err(error) => error,
                };
                // Retried only where a failed attempt has ended all it began (`conn` back at
                // depth 0), so that nothing of the caller's is lost.
                match retryable(conn, 0, &error) {
                    Some(label) if attempt < LOCK_ATTEMPTS => {
                        lock_retry_pause(label, attempt, operation).await;
                        attempt += 1;
                    }
                    _ => return Err(error),
                }
            }
        })
    }
}

/// One attempt: `step` in autocommit, or in a transaction of its own (a savepoint inside one
/// sqlx counts), committed if it succeeds and rolled back if it fails.
async fn once<A, T>(
    conn: &mut MySqlConnection,
    own_transaction: bool,
    args: &A,
    step: Step<MySqlConnection, A, T>,
) -> Result<T, sqlx::Error> {
    if !own_transaction {
        return step(conn, args).await;
    }
    let mut tx = conn.begin().await?;
    let done = step(&mut tx, args).await?;
    tx.commit().await?;
    Ok(done)
}
