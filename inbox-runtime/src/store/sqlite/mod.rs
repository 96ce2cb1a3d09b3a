//! SQLite (3.35 or newer, for `RETURNING`), through `sqlx::SqliteConnection`: this backend's
//! dialect, what its errors mean, and its migrations. The inbox's statements are in [`inbox`].

mod console;
mod inbox;
mod outbox;
mod positions;
mod scope;

use sqlx::Sqlite;
use sqlx::error::DatabaseError as _;
use sqlx::sqlite::SqliteError;

use super::Backend;
use super::dialect::{Dialect, ErrorKind, Migrations};

/// The inbox component's migrations (`migrations/inbox/`).
const INBOX_MIGRATIONS: &[(i64, &str, &str)] = super::dialect::migrations! { "inbox":
    1 "inbox" "0001_inbox.sql", 2 "rejections" "0002_rejections.sql", 3 "results" "0003_results.sql",
    4 "rejection sizes" "0004_rejection_sizes.sql", 5 "console indexes" "0005_console_indexes.sql",
};

impl Dialect for Sqlite {
    const BACKEND: Backend = Backend::Sqlite;

    type DatabaseError = SqliteError;

    const MIGRATIONS: Migrations = Migrations {
        inbox: INBOX_MIGRATIONS,
        outbox: outbox::MIGRATIONS,
        positions: positions::MIGRATIONS,
    };

    /// Transient: `SQLITE_BUSY` and `SQLITE_LOCKED` with their extended codes (5, 6, 261, 262,
    /// 517).
    fn error_kind(error: &SqliteError) -> Option<ErrorKind> {
        matches!(
            error.code().as_deref(),
            Some("5" | "6" | "261" | "262" | "517")
        )
        .then_some(ErrorKind::Transient)
    }
}
