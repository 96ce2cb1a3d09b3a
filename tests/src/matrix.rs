//! The backend matrix: a test body written once, run on PostgreSQL, SQLite and MySQL/MariaDB.
//!
//! Two parts, after sqlx's `TestSupport` idea (one small description per backend, one runner):
//!
//! * [`TestBackend`], implemented for `sqlx::Postgres`, `sqlx::Sqlite` and `sqlx::MySql`: a fresh
//!   database for one test (with the guard that keeps it) and the few reads the tests check
//!   results with.
//! * [`backend_matrix!`](crate::backend_matrix), which stamps a module body three times, as
//!   `mod postgres`, `mod sqlite` and `mod mysql`, each with the aliases and the fixture of its
//!   backend.
//!
//! A macro, not a generic function: `#[idempotent]` handlers in the body take `&mut Conn`, and
//! each backend's copy must be a handler of its own, registered (through `inventory`) for that
//! backend's dispatchers.

use std::collections::BTreeMap;
use std::future::Future;

use sqlx::{MySqlPool, PgPool, Pool, SqlitePool};

pub use inbox_runtime::store::Backend;

/// What a test needs to know of one backend.
pub trait TestBackend: inbox_runtime::store::InboxDatabase {
    /// The effect upsert the test handlers run, in this backend's dialect: binds the effect
    /// key and the amount (see [`crate::APPLY_EFFECT`]).
    const APPLY_EFFECT: &'static str;

    /// A test's SQL text in this backend's dialect: the text itself on PostgreSQL and SQLite,
    /// [`mysql_dialect`] of it on MySQL.
    fn dialect(sql: &str) -> String {
        sql.to_owned()
    }

    /// Keeps the test's database for as long as it lives: nothing for PostgreSQL and MySQL (a
    /// database of its own on the shared server), the temporary file for SQLite.
    type Guard: std::fmt::Debug + Send + Sync + 'static;

    /// A fresh database (migrated, with the `effects` table) and a pool of at most
    /// `max_connections` on it.
    fn fixture(max_connections: u32) -> impl Future<Output = (Pool<Self>, Self::Guard)> + Send;

    /// See [`effect`].
    fn effect(pool: &Pool<Self>, key: &str) -> impl Future<Output = Option<(i64, i64)>> + Send;

    /// See [`effects`].
    fn effects(pool: &Pool<Self>) -> impl Future<Output = BTreeMap<String, (i64, i64)>> + Send;

    /// See [`count`].
    fn count(pool: &Pool<Self>, sql: &'static str) -> impl Future<Output = i64> + Send;
    /// See [`make_due`].
    fn execute(pool: &Pool<Self>, sql: &'static str) -> impl Future<Output = u64> + Send;

    /// See [`inbox_row`].
    fn inbox_row(
        pool: &Pool<Self>,
        consumer: &str,
        key: &str,
    ) -> impl Future<Output = Option<(String, i32)>> + Send;
}

/// The reads of [`TestBackend`], written once and implemented for each backend.
macro_rules! reads {
    ($pool:ty) => {
        reads!($pool, "$1", "$2");
    };
    ($pool:ty, $p1:literal, $p2:literal) => {
        async fn effect(pool: &$pool, key: &str) -> Option<(i64, i64)> {
            sqlx::query_as::<_, (i64, i64)>(concat!(
                "SELECT applied, total FROM effects WHERE effect_key = ",
                $p1
            ))
            .bind(key)
            .fetch_optional(pool)
            .await
            .expect("read effects")
        }

        async fn effects(pool: &$pool) -> BTreeMap<String, (i64, i64)> {
            sqlx::query_as::<_, (String, i64, i64)>(sqlx::AssertSqlSafe(Self::dialect(
                "SELECT effect_key, applied, total FROM effects",
            )))
            .fetch_all(pool)
            .await
            .expect("read effects")
            .into_iter()
            .map(|(key, applied, total)| (key, (applied, total)))
            .collect()
        }

        async fn execute(pool: &$pool, sql: &'static str) -> u64 {
            sqlx::query(sqlx::AssertSqlSafe(Self::dialect(sql)))
                .execute(pool)
                .await
                .expect("execute")
                .rows_affected()
        }

        async fn count(pool: &$pool, sql: &'static str) -> i64 {
            sqlx::query_scalar::<_, i64>(sqlx::AssertSqlSafe(Self::dialect(sql)))
                .fetch_one(pool)
                .await
                .expect("count")
        }

        async fn inbox_row(pool: &$pool, consumer: &str, key: &str) -> Option<(String, i32)> {
            sqlx::query_as::<_, (String, i32)>(concat!(
                "SELECT status, attempts FROM inbox_messages WHERE consumer = ",
                $p1,
                " AND message_key = ",
                $p2
            ))
            .bind(consumer)
            .bind(key)
            .fetch_optional(pool)
            .await
            .expect("read inbox_messages")
        }
    };
}

impl TestBackend for sqlx::Postgres {
    const APPLY_EFFECT: &'static str = crate::APPLY_EFFECT;
    type Guard = ();

    async fn fixture(max_connections: u32) -> (PgPool, ()) {
        (crate::pg_pool(max_connections).await, ())
    }

    reads!(PgPool);
}

impl TestBackend for sqlx::Sqlite {
    const APPLY_EFFECT: &'static str = crate::APPLY_EFFECT;
    type Guard = crate::TempFile;

    async fn fixture(max_connections: u32) -> (SqlitePool, crate::TempFile) {
        crate::sqlite_pool(max_connections).await
    }

    reads!(SqlitePool);
}

impl TestBackend for sqlx::MySql {
    const APPLY_EFFECT: &'static str = crate::MYSQL_APPLY_EFFECT;

    fn dialect(sql: &str) -> String {
        mysql_dialect(sql)
    }
    type Guard = ();

    async fn fixture(max_connections: u32) -> (MySqlPool, ()) {
        (crate::mysql_pool(max_connections).await, ())
    }

    reads!(MySqlPool, "?", "?");
}

/// A test's SQL, written for PostgreSQL and SQLite, in MySQL's dialect: `$N` parameters become
/// `?` (so each must appear once, in order), `CAST(… AS BIGINT)`/`INTEGER` become
/// `CAST(… AS SIGNED)` and `CAST(… AS TEXT)` `CAST(… AS CHAR)`, and the `consumer`,
/// `message_key`, `aggregate_id` and `effect_key` columns of the first `SELECT` list
/// (`VARBINARY` on MySQL) are converted to text. Anything else must be written per backend.
pub fn mysql_dialect(sql: &str) -> String {
    let mut out = String::with_capacity(sql.len());
    let mut chars = sql.chars().peekable();
    while let Some(c) = chars.next() {
        if c == '$' && chars.peek().is_some_and(char::is_ascii_digit) {
            while chars.peek().is_some_and(char::is_ascii_digit) {
                chars.next();
            }
            out.push('?');
        } else {
            out.push(c);
        }
    }
    let out = out
        .replace(" AS BIGINT)", " AS SIGNED)")
        .replace(" AS INTEGER)", " AS SIGNED)")
        .replace(" AS TEXT)", " AS CHAR)");
    let Some(start) = out.find("SELECT ") else {
        return out;
    };
    let list_start = start + "SELECT ".len();
    let Some(list_len) = out[list_start..].find(" FROM ") else {
        return out;
    };
    let list = &out[list_start..list_start + list_len];
    let mut items = Vec::new();
    let (mut depth, mut from) = (0, 0);
    for (i, c) in list.char_indices() {
        match c {
            '(' => depth += 1,
            ')' => depth -= 1,
            ',' if depth == 0 => {
                items.push(&list[from..i]);
                from = i + 1;
            }
            _ => {}
        }
    }
    items.push(&list[from..]);
    let converted: Vec<String> = items
        .iter()
        .map(|item| match item.trim() {
            name @ ("consumer" | "message_key" | "aggregate_id" | "effect_key") => {
                format!("CONVERT({name} USING utf8mb4) AS {name}")
            }
            other => other.to_owned(),
        })
        .collect();
    format!(
        "{}{}{}",
        &out[..list_start],
        converted.join(", "),
        &out[list_start + list_len..]
    )
}

/// The effect row of `key` in the `effects` table: `(applied, total)`, `None` if never applied.
pub async fn effect<DB: TestBackend>(pool: &Pool<DB>, key: &str) -> Option<(i64, i64)> {
    DB::effect(pool, key).await
}

/// Every effect row: key → `(applied, total)`.
pub async fn effects<DB: TestBackend>(pool: &Pool<DB>) -> BTreeMap<String, (i64, i64)> {
    DB::effects(pool).await
}

/// Makes every `failed` key's next attempt due now, as if its retry delay had passed (a
/// redelivery before it is due is [`Outcome::NotYet`](inbox_runtime::Outcome::NotYet)). Returns
/// how many keys it changed.
pub async fn make_due<DB: TestBackend>(pool: &Pool<DB>) -> u64 {
    DB::execute(
        pool,
        "UPDATE inbox_messages SET next_attempt_at = NULL WHERE status = 'failed'",
    )
    .await
}

/// The single `BIGINT` a query returns (`SELECT COUNT(*) …`).
pub async fn count<DB: TestBackend>(pool: &Pool<DB>, sql: &'static str) -> i64 {
    DB::count(pool, sql).await
}

/// The `(status, attempts)` of a consumer's key in `inbox_messages`, `None` if it has no row.
pub async fn inbox_row<DB: TestBackend>(
    pool: &Pool<DB>,
    consumer: &str,
    key: &str,
) -> Option<(String, i32)> {
    DB::inbox_row(pool, consumer, key).await
}

/// Stamps a module body once per backend: `mod postgres`, `mod sqlite` and `mod mysql`
/// (MySQL/MariaDB at `MYSQL_URL`); every file runs on all three.
///
/// ```text
/// inbox_tests::backend_matrix! {
///     connections(postgres = 16, sqlite = 8);
///
///     #[inbox_runtime::idempotent(consumer = "effects")]
///     async fn apply(conn: &mut Conn, msg: Note) -> Result<(), sqlx::Error> { … }
///
///     #[tokio::test]
///     async fn processed_once() {
///         let (pool, _guard) = fixture().await;
///         …
///         if BACKEND == Backend::Postgres { … } else { … }
///     }
/// }
/// ```
///
/// Each module starts with `use super::*;` (the file's messages, imports and helpers: import
/// the shared ones, e.g. `use inbox_tests::{effect, count};`, at the top of the file) and has:
///
/// * `Db`: `sqlx::Postgres` / `sqlx::Sqlite` / `sqlx::MySql`; `Conn`: its connection
///   (`sqlx::PgConnection` / `sqlx::SqliteConnection` / `sqlx::MySqlConnection`), what the
///   body's handlers take; `Pool`: `sqlx::Pool<Db>`; `APPLY_EFFECT`: the effect upsert in the
///   backend's dialect;
/// * `BACKEND`: the [`Backend`] (its `Display` is the module's name), and `Backend` itself, to
///   branch where the backends genuinely differ;
/// * `fixture()`: a fresh database and its pool of `CONNECTIONS` connections, plus the guard to
///   keep while the pool is in use; `fixture_with(n)` for another pool size.
///
/// `connections(…)` is optional (default: 8 on PostgreSQL, 4 on SQLite, whose writers wait on
/// one another anyway; MySQL as PostgreSQL unless `mysql = n` is given).
#[macro_export]
macro_rules! backend_matrix {
    (connections(postgres = $pg:expr, sqlite = $lite:expr $(, mysql = $my:expr)? $(,)?); $($body:tt)*) => {
        $crate::backend_matrix!(@module postgres, $crate::__sqlx::Postgres, $pg, $($body)*);
        $crate::backend_matrix!(@module sqlite, $crate::__sqlx::Sqlite, $lite, $($body)*);
        $crate::backend_matrix!(@module mysql, $crate::__sqlx::MySql, [$($my,)? $pg][0], $($body)*);
    };
    (@module $name:ident, $db:ty, $connections:expr, $($body:tt)*) => {
        #[allow(dead_code, unused_imports)]
        mod $name {
            use super::*;
            use $crate::Backend;

            /// The backend's `sqlx::Database`.
            type Db = $db;
            /// The connection the body's handlers take.
            type Conn = <Db as $crate::__sqlx::Database>::Connection;
            /// A pool of the backend.
            type Pool = $crate::__sqlx::Pool<Db>;
            /// What keeps a fixture's database.
            type Guard = <Db as $crate::TestBackend>::Guard;
            /// This module's backend (`Display`: the module's name).
            const BACKEND: Backend = <Db as $crate::__inbox_runtime::store::InboxDatabase>::BACKEND;
            /// The pool size of `fixture()`.
            const CONNECTIONS: u32 = $connections;
            /// The effect upsert in this backend's dialect (binds: effect key, amount).
            const APPLY_EFFECT: &str = <Db as $crate::TestBackend>::APPLY_EFFECT;

            /// A test's SQL in this backend's dialect (see [`$crate::matrix::mysql_dialect`]).
            fn sql(text: &str) -> $crate::__sqlx::AssertSqlSafe<String> {
                $crate::__sqlx::AssertSqlSafe(<Db as $crate::TestBackend>::dialect(text))
            }

            /// A fresh database, a pool of `CONNECTIONS` on it, and the guard to keep.
            async fn fixture() -> (Pool, Guard) {
                <Db as $crate::TestBackend>::fixture(CONNECTIONS).await
            }

            /// A fresh database, a pool of `max_connections` on it, and the guard to keep.
            async fn fixture_with(max_connections: u32) -> (Pool, Guard) {
                <Db as $crate::TestBackend>::fixture(max_connections).await
            }

            $($body)*
        }
    };
    ($($body:tt)*) => {
        $crate::backend_matrix!(connections(postgres = 8, sqlite = 4); $($body)*);
    };
}
