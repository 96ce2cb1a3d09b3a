//! Workspace-level tests of `inbox`, and the support they share.
//!
//! * `macros.rs`: the generated code (the compile-fail cases of every macro error are in
//!   `macro-ui/`, a package of its own).
//! * `inbox.rs`: the claim-then-act core on both backends; `postgres.rs`: PostgreSQL-only
//!   concurrency and connection loss; `registry.rs`: registry checks at start.
//! * `batch.rs`, `failures.rs`, `ordering.rs`, `adversarial.rs`: batches, failures, ordering and
//!   attempts to break the guarantees, on both backends.
//!
//! Tests that run on both backends are written once, inside [`backend_matrix!`], which stamps a
//! `mod postgres` and a `mod sqlite` from one body (see [`matrix`]). The fixtures ([`pg_pool`],
//! [`sqlite_pool`]) and the helpers several files use ([`effect`], [`effects`], [`count`],
//! [`inbox_row`], [`envelope`], [`outcome_kind`], [`outcome_kinds`]) live here.
//!
//! PostgreSQL tests need `DATABASE_URL` (set by `scripts/test.sh`, which starts a throwaway
//! server); each test gets a database of its own, created here. A test that needs PostgreSQL and
//! finds no `DATABASE_URL` fails: it never passes by skipping.

pub mod dynamo;
pub mod lambda;
pub mod matrix;
pub mod process;

pub use matrix::{Backend, TestBackend, count, effect, effects, inbox_row, make_due};
pub use process::{ChildGuard, scratch_dir};

#[doc(hidden)]
pub use inbox_runtime as __inbox_runtime;
#[doc(hidden)]
pub use sqlx as __sqlx;

use std::path::PathBuf;
use std::str::FromStr;
use std::sync::atomic::{AtomicU32, Ordering};

use inbox_runtime::{ConsumerOutcome, Envelope, Error, Message, Outcome};
use sqlx::mysql::{MySqlConnectOptions, MySqlPoolOptions};
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::sqlite::{SqliteConnectOptions, SqliteJournalMode, SqlitePoolOptions, SqliteSynchronous};
use sqlx::{Connection, MySqlPool, PgPool, SqlitePool};

static COUNTER: AtomicU32 = AtomicU32::new(0);

/// A name no other test process of this run has used: `{prefix}_{pid}_{run}_{n}`, where `run` is
/// fixed per process (the microseconds of its first call, in base 36) and `n` counts the calls.
/// The process id alone is not enough: ids wrap (`pid_max` is 32,768 on the CI machines), and a
/// later test binary with an earlier one's id found that one's databases still there
/// (`CREATE DATABASE` failed with "already exists").
pub fn unique_name(prefix: &str) -> String {
    static RUN: std::sync::OnceLock<String> = std::sync::OnceLock::new();
    let run = RUN.get_or_init(|| {
        let micros = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |elapsed| elapsed.as_micros());
        let mut left = micros % 36u128.pow(8);
        let mut digits = Vec::new();
        while digits.len() < 8 {
            digits.push(char::from_digit((left % 36) as u32, 36).unwrap_or('0'));
            left /= 36;
        }
        digits.into_iter().rev().collect()
    });
    format!(
        "{prefix}_{}_{run}_{}",
        std::process::id(),
        COUNTER.fetch_add(1, Ordering::Relaxed)
    )
}

/// The server URL from `DATABASE_URL`; panics with how to get one if unset.
pub fn database_url() -> String {
    std::env::var("DATABASE_URL").unwrap_or_else(|_| {
        panic!(
            "DATABASE_URL is not set: run the tests with scripts/test.sh, which starts PostgreSQL"
        )
    })
}

/// A fresh PostgreSQL database (migrated, with the test `effects` table) and a pool of at most
/// `max_connections` on it.
pub async fn pg_pool(max_connections: u32) -> PgPool {
    let base = PgConnectOptions::from_str(&database_url()).expect("DATABASE_URL is a postgres URL");
    let name = unique_name("inbox_test");
    let mut admin = sqlx::PgConnection::connect_with(&base)
        .await
        .expect("connect to PostgreSQL");
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!("CREATE DATABASE {name}")))
        .execute(&mut admin)
        .await
        .unwrap_or_else(|error| panic!("create test database {name}: {error}"));
    admin.close().await.ok();
    let pool = PgPoolOptions::new()
        .max_connections(max_connections)
        .connect_with(base.database(&name))
        .await
        .expect("connect to the test database");
    inbox_runtime::migrate(&pool).await.expect("migrate");
    sqlx::raw_sql(EFFECTS_TABLE)
        .execute(&pool)
        .await
        .expect("create effects");
    pool
}

/// A fresh SQLite database file (WAL, busy timeout 30 s), migrated, with the `effects` table.
/// The file lives in [`scratch_dir`] and is removed when the guard drops.
pub async fn sqlite_pool(max_connections: u32) -> (SqlitePool, TempFile) {
    let path = scratch_dir().join(format!("{}.db", unique_name("inbox_test")));
    let options = SqliteConnectOptions::new()
        .filename(&path)
        .create_if_missing(true)
        .journal_mode(SqliteJournalMode::Wal)
        .synchronous(SqliteSynchronous::Full)
        .busy_timeout(std::time::Duration::from_secs(30));
    let pool = SqlitePoolOptions::new()
        .max_connections(max_connections)
        .connect_with(options)
        .await
        .expect("open SQLite");
    inbox_runtime::migrate(&pool).await.expect("migrate");
    sqlx::raw_sql(EFFECTS_TABLE)
        .execute(&pool)
        .await
        .expect("create effects");
    (pool, TempFile(path))
}

/// The business table the test handlers write to: one row per effect key, `applied` counts how
/// often the effect ran, `total` sums the amounts.
pub const EFFECTS_TABLE: &str = "CREATE TABLE effects (\
     effect_key TEXT PRIMARY KEY, applied BIGINT NOT NULL, total BIGINT NOT NULL)";

/// The upsert every test handler runs; the same text works on both backends (each parameter
/// appears once, in order).
pub const APPLY_EFFECT: &str = "INSERT INTO effects (effect_key, applied, total) VALUES ($1, 1, $2) \
     ON CONFLICT (effect_key) DO UPDATE SET applied = effects.applied + 1, \
     total = effects.total + excluded.total";

/// The server URL from `MYSQL_URL`; panics with how to get one if unset. `mariadb://` is
/// taken as `mysql://`.
pub fn mysql_url() -> String {
    let url = std::env::var("MYSQL_URL").unwrap_or_else(|_| {
        panic!(
            "MYSQL_URL is not set: run the tests with scripts/test.sh, which starts MariaDB \
             (or start one with `scripts/mariadb.sh start`)"
        )
    });
    match url.strip_prefix("mariadb://") {
        Some(rest) => format!("mysql://{rest}"),
        None => url,
    }
}

/// A fresh MySQL/MariaDB database (migrated, with the test `effects` table) and a pool of at
/// most `max_connections` on it (a database of its own on the shared server, as on PostgreSQL).
pub async fn mysql_pool(max_connections: u32) -> MySqlPool {
    let base = MySqlConnectOptions::from_str(&mysql_url()).expect("MYSQL_URL is a mysql URL");
    let name = unique_name("inbox_test");
    let mut admin = sqlx::MySqlConnection::connect_with(&base)
        .await
        .expect("connect to MySQL");
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!("CREATE DATABASE {name}")))
        .execute(&mut admin)
        .await
        .unwrap_or_else(|error| panic!("create test database {name}: {error}"));
    admin.close().await.ok();
    let pool = MySqlPoolOptions::new()
        .max_connections(max_connections)
        .connect_with(base.database(&name))
        .await
        .expect("connect to the test database");
    inbox_runtime::migrate(&pool).await.expect("migrate");
    sqlx::raw_sql(MYSQL_EFFECTS_TABLE)
        .execute(&pool)
        .await
        .expect("create effects");
    pool
}

/// [`EFFECTS_TABLE`] on MySQL/MariaDB: a primary key needs a bounded type, and `VARBINARY`
/// compares byte for byte (a `VARCHAR` with a `_bin` collation ignores trailing spaces).
pub const MYSQL_EFFECTS_TABLE: &str = "CREATE TABLE effects (\
     effect_key VARBINARY(760) PRIMARY KEY, applied BIGINT NOT NULL, total BIGINT NOT NULL)";

/// [`APPLY_EFFECT`] on MySQL/MariaDB.
pub const MYSQL_APPLY_EFFECT: &str = "INSERT INTO effects (effect_key, applied, total) \
     VALUES (?, 1, ?) ON DUPLICATE KEY UPDATE applied = applied + 1, \
     total = total + VALUES(total)";

/// Deletes a file (and its SQLite `-wal`/`-shm` companions) on drop.
#[derive(Debug)]
pub struct TempFile(pub PathBuf);

impl Drop for TempFile {
    fn drop(&mut self) {
        for suffix in ["", "-wal", "-shm"] {
            let mut path = self.0.clone().into_os_string();
            path.push(suffix);
            let _ = std::fs::remove_file(path);
        }
    }
}

/// The envelope a source would deliver for `msg`: its name and its JSON.
pub fn envelope<M: Message>(msg: &M) -> Envelope {
    Envelope::new(
        M::NAME,
        serde_json::to_vec(msg).expect("a message serializes"),
    )
}

/// An outcome's or an error's kind (`Ok("processed")`, `Err("conflict")`, …).
pub fn outcome_kind<T, E>(
    result: &Result<Outcome<T>, Error<E>>,
) -> Result<&'static str, &'static str> {
    result.as_ref().map(Outcome::kind).map_err(Error::kind)
}

/// [`outcome_kind`] of each consumer's outcome, in the dispatcher's order.
pub fn outcome_kinds(outcomes: &[ConsumerOutcome]) -> Vec<Result<&'static str, &'static str>> {
    outcomes.iter().map(|o| outcome_kind(&o.result)).collect()
}

/// Whether `id` is in `ids` (a test's switchable set of ids: the handlers that fail, or hold,
/// while their id is in it).
pub fn in_set(ids: &std::sync::Mutex<Option<std::collections::HashSet<String>>>, id: &str) -> bool {
    ids.lock()
        .unwrap()
        .as_ref()
        .is_some_and(|ids| ids.contains(id))
}
