//! How the store's own statements run on SQLite ([`Scoped`]): a write of the store's own
//! ([`Scope::Statement`], [`Scope::Transaction`]) runs in a `BEGIN IMMEDIATE` transaction, which
//! takes the database's write lock at once (waiting up to the busy timeout) instead of failing
//! at its first write when a reader upgraded first; statements in the caller's transaction run
//! as they come.

use sqlx::{Connection as _, Sqlite};

use crate::store::sql::{Done, Run, Scope, Scoped};

impl Scoped for Sqlite {
    fn scoped<'c, A: Sync, T: Send + 'c>(run: Run<'c, Self, A, T>) -> Done<'c, T> {
        let Run {
            conn, args, step, ..
        } = run;
        match run.scope {
            Scope::Statement | Scope::Transaction => Box::pin(async move {
                let mut tx = conn.begin_with("BEGIN IMMEDIATE").await?;
                let done = step(&mut tx, args).await?;
                tx.commit().await?;
                Ok(done)
            }),
            Scope::JoinElseStatement | Scope::JoinElseTransaction | Scope::RawElseTransaction => {
                step(conn, args)
            }
        }
    }
}
