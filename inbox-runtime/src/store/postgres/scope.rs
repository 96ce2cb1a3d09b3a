//! How the store's own statements run on PostgreSQL ([`Scoped`]): as they come, in whatever
//! transaction the connection is in. Every statement the outbox and positions stores run on
//! their own is a single statement (atomic by itself), and PostgreSQL has no lock errors worth
//! retrying there.

use sqlx::Postgres;

use crate::store::sql::{Done, Run, Scoped};

impl Scoped for Postgres {
    fn scoped<'c, A: Sync, T: Send + 'c>(run: Run<'c, Self, A, T>) -> Done<'c, T> {
        (run.step)(run.conn, run.args)
    }
}
