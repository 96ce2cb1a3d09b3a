//! PostgreSQL (12 or newer), through `sqlx::PgConnection`: this backend's dialect, what its
//! errors mean, and its migrations. The inbox's statements are in [`inbox`].

mod console;
mod inbox;
mod outbox;
mod positions;
mod schema;
mod scope;

pub use schema::{PgSchema, PgSchemaError};

use sqlx::Postgres;
use sqlx::postgres::PgDatabaseError;

use super::Backend;
use super::dialect::{Contention, Dialect, ErrorKind, Migrations};

/// The inbox component's migrations (`migrations/inbox/`).
const INBOX_MIGRATIONS: &[(i64, &str, &str)] = super::dialect::migrations! { "inbox":
    1 "inbox" "0001_inbox.sql", 2 "rejections" "0002_rejections.sql", 3 "results" "0003_results.sql",
    4 "rejection sizes" "0004_rejection_sizes.sql", 5 "console indexes" "0005_console_indexes.sql",
    6 "narrow row" "0006_narrow_row.sql",
};

impl Dialect for Postgres {
    const BACKEND: Backend = Backend::Postgres;

    type DatabaseError = PgDatabaseError;

    const MIGRATIONS: Migrations = Migrations {
        inbox: INBOX_MIGRATIONS,
        outbox: outbox::MIGRATIONS,
        positions: positions::MIGRATIONS,
    };

    /// Transient: SQLSTATE `40001` serialization failure, `40P01` deadlock, `55P03` lock not
    /// available, class `08` connection exceptions, `53300` too many connections,
    /// `57P01`–`57P03` shutdown, `57P05` idle session and `25P03` idle transaction timeouts.
    fn error_kind(error: &PgDatabaseError) -> Option<ErrorKind> {
        let code = error.code();
        let transient = matches!(
            code,
            "40001" | "40P01" | "55P03" | "53300" | "57P01" | "57P02" | "57P03" | "57P05" | "25P03"
        ) || code.starts_with("08");
        transient.then_some(ErrorKind::Transient)
    }

    fn contention(error: &PgDatabaseError) -> Option<Contention> {
        match error.code() {
            "40P01" => Some(Contention::Deadlock),
            "40001" => Some(Contention::Serialization),
            "55P03" => Some(Contention::LockTimeout),
            _ => None,
        }
    }
}
