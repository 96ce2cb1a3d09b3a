//! The database: connection, schema, balances.

use std::collections::BTreeMap;
use std::str::FromStr as _;
use std::time::Duration;

use sqlx::mysql::{MySqlConnectOptions, MySqlPoolOptions};
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::sqlite::{SqliteConnectOptions, SqliteJournalMode, SqlitePoolOptions, SqliteSynchronous};
use sqlx::{MySqlPool, PgPool, SqlitePool};

/// The SQLite file used when no database URL is given, in the current directory.
pub(crate) const DEFAULT_SQLITE_FILE: &str = "ledger.db";

/// The demo's own table (the inbox's tables come from `inbox_runtime::migrate`).
const CREATE_ACCOUNTS: &str =
    "CREATE TABLE IF NOT EXISTS accounts (id TEXT PRIMARY KEY, balance_cents BIGINT NOT NULL)";

/// [`CREATE_ACCOUNTS`] on MySQL/MariaDB (a primary key needs a bounded type).
const CREATE_ACCOUNTS_MYSQL: &str = "CREATE TABLE IF NOT EXISTS accounts \
     (id VARCHAR(64) COLLATE utf8mb4_bin PRIMARY KEY, balance_cents BIGINT NOT NULL)";

const SELECT_BALANCES: &str = "SELECT id, balance_cents FROM accounts ORDER BY id";

/// A pool of any backend.
pub(crate) enum Db {
    Postgres(PgPool),
    Sqlite(SqlitePool),
    MySql(MySqlPool),
}

/// Why the database could not be used.
#[derive(Debug)]
pub(crate) enum DbError {
    /// The URL names no supported database.
    Url(String),
    /// The URL names a DynamoDB store (`dynamodb://TABLE`), where a SQL database is needed.
    NotSql(String),
    /// Connecting, migrating or querying failed.
    Sql(String, sqlx::Error),
    /// The inbox migrations failed.
    Migrate(sqlx::migrate::MigrateError),
}

impl std::fmt::Display for DbError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            DbError::Url(url) => write!(
                f,
                "unsupported database URL `{url}`: expected postgres://…, mysql://…, mariadb://… \
                 or sqlite:… (or dynamodb://TABLE, file mode only)"
            ),
            DbError::NotSql(url) => write!(
                f,
                "`{url}` is a DynamoDB store: this command needs a SQL database (postgres://…, \
                 mysql://…, mariadb://… or sqlite:…), not available on DynamoDB yet; on DynamoDB \
                 the ledger runs in file mode only: ledger --store {url} [PATH|-]"
            ),
            DbError::Sql(what, error) => write!(f, "{what}: {error}"),
            DbError::Migrate(error) => write!(f, "inbox migrations failed: {error}"),
        }
    }
}

fn sqlite_options(options: SqliteConnectOptions) -> SqliteConnectOptions {
    options
        .create_if_missing(true)
        .journal_mode(SqliteJournalMode::Wal)
        // With WAL, NORMAL loses no committed transaction on an application crash (only on a
        // power loss), and spares one fsync per transaction.
        .synchronous(SqliteSynchronous::Normal)
        .busy_timeout(Duration::from_secs(10))
}

impl Db {
    /// Connects to `url` (`postgres://…`, `postgresql://…` or `sqlite:…`), or to
    /// [`DEFAULT_SQLITE_FILE`] in the current directory if there is none. Returns the pool and
    /// a description of the database without credentials.
    pub(crate) async fn connect(url: Option<&str>) -> Result<(Db, String), DbError> {
        Self::connect_with(url, 2).await
    }

    /// [`Db::connect`], with at most `pg_connections` connections to PostgreSQL (SQLite always
    /// gets one).
    pub(crate) async fn connect_with(
        url: Option<&str>,
        pg_connections: u32,
    ) -> Result<(Db, String), DbError> {
        let connect_error = |e| DbError::Sql("cannot read the database URL".into(), e);
        // Names the database it could not reach (no credentials), and where the URL came from.
        let unreachable = |description: &str| {
            let what =
                format!("cannot connect to the database {description} (DATABASE_URL, or --store)");
            move |e| DbError::Sql(what, e)
        };
        match url {
            None => {
                let options =
                    sqlite_options(SqliteConnectOptions::new().filename(DEFAULT_SQLITE_FILE));
                let description = format!("sqlite ./{DEFAULT_SQLITE_FILE}");
                let pool = SqlitePoolOptions::new()
                    .max_connections(1)
                    .connect_with(options)
                    .await
                    .map_err(unreachable(&description))?;
                Ok((Db::Sqlite(pool), description))
            }
            Some(url) if url.starts_with("sqlite:") => {
                let options = SqliteConnectOptions::from_str(url).map_err(connect_error)?;
                let description = format!("sqlite {}", options.get_filename().display());
                let pool = SqlitePoolOptions::new()
                    .max_connections(1)
                    .connect_with(sqlite_options(options))
                    .await
                    .map_err(unreachable(&description))?;
                Ok((Db::Sqlite(pool), description))
            }
            Some(url) if url.starts_with("postgres://") || url.starts_with("postgresql://") => {
                let options = PgConnectOptions::from_str(url).map_err(connect_error)?;
                let description = format!(
                    "postgres {}:{}/{}",
                    options.get_host(),
                    options.get_port(),
                    options.get_database().unwrap_or("")
                );
                let pool = PgPoolOptions::new()
                    .max_connections(pg_connections)
                    .connect_with(options)
                    .await
                    .map_err(unreachable(&description))?;
                Ok((Db::Postgres(pool), description))
            }
            Some(url) if url.starts_with("mysql://") || url.starts_with("mariadb://") => {
                // sqlx's MySQL driver speaks to MariaDB too, under the `mysql` scheme.
                let url = match url.strip_prefix("mariadb://") {
                    Some(rest) => format!("mysql://{rest}"),
                    None => url.to_owned(),
                };
                let options = MySqlConnectOptions::from_str(&url).map_err(connect_error)?;
                let description = format!(
                    "mysql {}:{}/{}",
                    options.get_host(),
                    options.get_port(),
                    options.get_database().unwrap_or("")
                );
                let pool = MySqlPoolOptions::new()
                    .max_connections(pg_connections)
                    .connect_with(options)
                    .await
                    .map_err(unreachable(&description))?;
                Ok((Db::MySql(pool), description))
            }
            Some(url) if url.starts_with("dynamodb://") => Err(DbError::NotSql(url.to_owned())),
            Some(url) => Err(DbError::Url(url.to_owned())),
        }
    }

    /// Creates the inbox tables and the `accounts` table if they are missing.
    pub(crate) async fn setup(&self) -> Result<(), DbError> {
        let create_error = |e| DbError::Sql("cannot create the accounts table".into(), e);
        match self {
            Db::Postgres(pool) => {
                inbox_runtime::migrate(pool)
                    .await
                    .map_err(DbError::Migrate)?;
                sqlx::query(CREATE_ACCOUNTS)
                    .execute(pool)
                    .await
                    .map_err(create_error)?;
            }
            Db::Sqlite(pool) => {
                inbox_runtime::migrate(pool)
                    .await
                    .map_err(DbError::Migrate)?;
                sqlx::query(CREATE_ACCOUNTS)
                    .execute(pool)
                    .await
                    .map_err(create_error)?;
            }
            Db::MySql(pool) => {
                inbox_runtime::migrate(pool)
                    .await
                    .map_err(DbError::Migrate)?;
                sqlx::query(CREATE_ACCOUNTS_MYSQL)
                    .execute(pool)
                    .await
                    .map_err(create_error)?;
            }
        }
        Ok(())
    }

    /// Every account's balance.
    pub(crate) async fn balances(&self) -> Result<BTreeMap<String, i64>, DbError> {
        let rows: Vec<(String, i64)> = match self {
            Db::Postgres(pool) => sqlx::query_as(SELECT_BALANCES).fetch_all(pool).await,
            Db::Sqlite(pool) => sqlx::query_as(SELECT_BALANCES).fetch_all(pool).await,
            Db::MySql(pool) => sqlx::query_as(SELECT_BALANCES).fetch_all(pool).await,
        }
        .map_err(|e| DbError::Sql("cannot read the balances".into(), e))?;
        Ok(rows.into_iter().collect())
    }

    /// Closes the pool (so that SQLite checkpoints its WAL into the database file).
    pub(crate) async fn close(&self) {
        match self {
            Db::Postgres(pool) => pool.close().await,
            Db::Sqlite(pool) => pool.close().await,
            Db::MySql(pool) => pool.close().await,
        }
    }
}
