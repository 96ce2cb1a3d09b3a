//! The database: connection, schema, and what the check reads back.
//!
//! Both services keep their tables in the same database here (for the demo's convenience; each
//! has its own tables and its own inbox consumer, and nothing but the broker connects them).

use std::collections::BTreeMap;
use std::str::FromStr as _;
use std::time::Duration;

use inbox_runtime::Component;
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::sqlite::{SqliteConnectOptions, SqliteJournalMode, SqlitePoolOptions, SqliteSynchronous};
use sqlx::{PgPool, SqlitePool};

use crate::handlers::ORDERS_DESTINATION;

/// The SQLite file used when no database URL is given, in the current directory.
pub(crate) const DEFAULT_SQLITE_FILE: &str = "pipeline.db";

/// The services' tables: orders' `pipeline_orders` and `pipeline_customers`, shipping's
/// `pipeline_shipments` and `pipeline_customer_totals`.
const TABLES: [&str; 4] = [
    "CREATE TABLE IF NOT EXISTS pipeline_orders (order_id TEXT PRIMARY KEY, \
       customer_id TEXT NOT NULL, paid_cents BIGINT NOT NULL, payments BIGINT NOT NULL)",
    "CREATE TABLE IF NOT EXISTS pipeline_customers (customer_id TEXT PRIMARY KEY, \
       paid_events BIGINT NOT NULL)",
    "CREATE TABLE IF NOT EXISTS pipeline_shipments (order_id TEXT PRIMARY KEY, \
       customer_id TEXT NOT NULL, payments BIGINT NOT NULL, shipped_cents BIGINT NOT NULL)",
    "CREATE TABLE IF NOT EXISTS pipeline_customer_totals (customer_id TEXT PRIMARY KEY, \
       events BIGINT NOT NULL, total_cents BIGINT NOT NULL, last_seq BIGINT NOT NULL, \
       out_of_order BIGINT NOT NULL)",
];

/// Serializes the table creation of processes starting together (PostgreSQL's `CREATE TABLE IF
/// NOT EXISTS` is not safe against a concurrent twin).
const SETUP_LOCK: &str = "SELECT pg_advisory_lock(7201)";
const SETUP_UNLOCK: &str = "SELECT pg_advisory_unlock(7201)";

const ORDERS: &str =
    "SELECT order_id, customer_id, payments, paid_cents FROM pipeline_orders ORDER BY order_id";
const CUSTOMERS: &str =
    "SELECT customer_id, paid_events FROM pipeline_customers ORDER BY customer_id";
const SHIPMENTS: &str = "SELECT order_id, customer_id, payments, shipped_cents \
     FROM pipeline_shipments ORDER BY order_id";
const TOTALS: &str = "SELECT customer_id, events, total_cents, last_seq, out_of_order \
     FROM pipeline_customer_totals ORDER BY customer_id";
const OUTBOX: &str = "SELECT status, COUNT(*) FROM inbox_outbox WHERE destination = $1 \
     GROUP BY status";
const INBOX: &str = "SELECT consumer, status, COUNT(*) FROM inbox_messages \
     WHERE consumer IN ('orders', 'shipping') GROUP BY consumer, status";
const PROGRESS: &str = "SELECT \
       (SELECT CAST(COALESCE(SUM(payments), 0) AS BIGINT) FROM pipeline_orders), \
       (SELECT COUNT(*) FROM inbox_outbox WHERE destination = $1 AND status = 'sent'), \
       (SELECT COUNT(*) FROM inbox_outbox WHERE destination = $2 AND status = 'pending'), \
       (SELECT CAST(COALESCE(SUM(payments), 0) AS BIGINT) FROM pipeline_shipments), \
       (SELECT COUNT(*) FROM inbox_messages WHERE consumer = 'shipping')";

/// A pool of either backend.
#[derive(Debug, Clone)]
pub(crate) enum Db {
    Postgres(PgPool),
    Sqlite(SqlitePool),
}

/// An order's row (orders' `pipeline_orders` or shipping's `pipeline_shipments`): customer,
/// payments, cents.
pub(crate) type OrderRow = (String, i64, i64);

/// A customer's downstream total: events, total cents, last sequence, events out of sequence.
pub(crate) type TotalRow = (i64, i64, i64, i64);

/// Everything the check compares with the stream's truth.
#[derive(Debug, Default)]
pub(crate) struct State {
    pub(crate) orders: BTreeMap<String, OrderRow>,
    /// The orders service's count of paid events per customer (the last sequence it assigned).
    pub(crate) customers: BTreeMap<String, i64>,
    pub(crate) shipments: BTreeMap<String, OrderRow>,
    pub(crate) totals: BTreeMap<String, TotalRow>,
    /// Outbox rows to the orders destination by status.
    pub(crate) outbox: BTreeMap<String, i64>,
    /// Inbox rows by (consumer, status).
    pub(crate) inbox: BTreeMap<(String, String), i64>,
}

/// How far the pipeline got, in totals over every run: payments applied by orders, outbox rows
/// sent and pending, payments applied by shipping, shipping's inbox rows (any status).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct Progress {
    pub(crate) orders_applied: i64,
    pub(crate) sent: i64,
    pub(crate) pending: i64,
    pub(crate) shipped: i64,
    pub(crate) shipping_claims: i64,
}

fn sqlite_options(options: SqliteConnectOptions) -> SqliteConnectOptions {
    options
        .create_if_missing(true)
        .journal_mode(SqliteJournalMode::Wal)
        // With WAL, NORMAL loses no committed transaction on an application crash (only on a
        // power loss), and spares one fsync per transaction.
        .synchronous(SqliteSynchronous::Normal)
        .busy_timeout(Duration::from_secs(30))
}

fn sql_error(what: &'static str) -> impl Fn(sqlx::Error) -> String {
    move |error| format!("{what}: {error}")
}

/// Runs `query_as(sql)` (binding `binds`) on whichever pool `db` is, fetching all rows as `T`.
macro_rules! fetch_all {
    ($db:expr, $sql:expr, $t:ty $(, $bind:expr)*) => {
        match $db {
            Db::Postgres(pool) => sqlx::query_as::<_, $t>($sql)$(.bind($bind))*.fetch_all(pool).await,
            Db::Sqlite(pool) => sqlx::query_as::<_, $t>($sql)$(.bind($bind))*.fetch_all(pool).await,
        }
    };
}

impl Db {
    /// Connects to `url` (`postgres://…`, `postgresql://…` or `sqlite:…`), or to
    /// [`DEFAULT_SQLITE_FILE`] in the current directory if there is none, with at most
    /// `connections` connections; on PostgreSQL as `application_name` `role` (what
    /// `pg_stat_activity` shows: `pipeline orders`, `pipeline relay`, …). Returns the pool and a
    /// description without credentials.
    pub(crate) async fn connect(
        url: Option<&str>,
        connections: u32,
        role: &str,
    ) -> Result<(Db, String), String> {
        let connect_error = sql_error("cannot connect to the database");
        match url {
            None => {
                let options =
                    sqlite_options(SqliteConnectOptions::new().filename(DEFAULT_SQLITE_FILE));
                let pool = SqlitePoolOptions::new()
                    .max_connections(connections)
                    .connect_with(options)
                    .await
                    .map_err(connect_error)?;
                Ok((Db::Sqlite(pool), format!("sqlite ./{DEFAULT_SQLITE_FILE}")))
            }
            Some(url) if url.starts_with("sqlite:") => {
                let options = SqliteConnectOptions::from_str(url).map_err(&connect_error)?;
                let description = format!("sqlite {}", options.get_filename().display());
                let pool = SqlitePoolOptions::new()
                    .max_connections(connections)
                    .connect_with(sqlite_options(options))
                    .await
                    .map_err(connect_error)?;
                Ok((Db::Sqlite(pool), description))
            }
            Some(url) if url.starts_with("postgres://") || url.starts_with("postgresql://") => {
                let options = PgConnectOptions::from_str(url)
                    .map_err(&connect_error)?
                    .application_name(role);
                let description = format!(
                    "postgres {}:{}/{}",
                    options.get_host(),
                    options.get_port(),
                    options.get_database().unwrap_or("")
                );
                let pool = PgPoolOptions::new()
                    .max_connections(connections)
                    .connect_with(options)
                    .await
                    .map_err(connect_error)?;
                Ok((Db::Postgres(pool), description))
            }
            Some(url) => Err(format!(
                "unsupported database URL `{url}`: expected postgres://… or sqlite:…"
            )),
        }
    }

    /// Creates the inbox and outbox tables and the services' tables if they are missing.
    pub(crate) async fn setup(&self) -> Result<(), String> {
        let components = [Component::Inbox, Component::Outbox];
        let migrate_error = |e| format!("inbox migrations failed: {e}");
        let create_error = sql_error("cannot create the pipeline's tables");
        match self {
            Db::Postgres(pool) => {
                inbox_runtime::migrate_components(pool, &components)
                    .await
                    .map_err(migrate_error)?;
                let mut conn = pool.acquire().await.map_err(&create_error)?;
                sqlx::query(SETUP_LOCK)
                    .execute(&mut *conn)
                    .await
                    .map_err(&create_error)?;
                for table in TABLES {
                    sqlx::query(table)
                        .execute(&mut *conn)
                        .await
                        .map_err(&create_error)?;
                }
                sqlx::query(SETUP_UNLOCK)
                    .execute(&mut *conn)
                    .await
                    .map_err(&create_error)?;
            }
            Db::Sqlite(pool) => {
                inbox_runtime::migrate_components(pool, &components)
                    .await
                    .map_err(migrate_error)?;
                for table in TABLES {
                    sqlx::query(table)
                        .execute(pool)
                        .await
                        .map_err(&create_error)?;
                }
            }
        }
        Ok(())
    }

    /// How far the pipeline got (totals over every run).
    pub(crate) async fn progress(&self) -> Result<Progress, String> {
        let rows = fetch_all!(
            self,
            PROGRESS,
            (i64, i64, i64, i64, i64),
            ORDERS_DESTINATION,
            ORDERS_DESTINATION
        )
        .map_err(sql_error("cannot read the progress"))?;
        let (orders_applied, sent, pending, shipped, shipping_claims) =
            rows.into_iter().next().unwrap_or_default();
        Ok(Progress {
            orders_applied,
            sent,
            pending,
            shipped,
            shipping_claims,
        })
    }

    /// Everything the check needs.
    pub(crate) async fn state(&self) -> Result<State, String> {
        let read = sql_error("cannot read the pipeline's state");
        let orders = fetch_all!(self, ORDERS, (String, String, i64, i64)).map_err(&read)?;
        let customers = fetch_all!(self, CUSTOMERS, (String, i64)).map_err(&read)?;
        let shipments = fetch_all!(self, SHIPMENTS, (String, String, i64, i64)).map_err(&read)?;
        let totals = fetch_all!(self, TOTALS, (String, i64, i64, i64, i64)).map_err(&read)?;
        let outbox = fetch_all!(self, OUTBOX, (String, i64), ORDERS_DESTINATION).map_err(&read)?;
        let inbox = fetch_all!(self, INBOX, (String, String, i64)).map_err(&read)?;
        let by_order = |rows: Vec<(String, String, i64, i64)>| {
            rows.into_iter()
                .map(|(order, customer, payments, cents)| (order, (customer, payments, cents)))
                .collect()
        };
        Ok(State {
            orders: by_order(orders),
            customers: customers.into_iter().collect(),
            shipments: by_order(shipments),
            totals: totals
                .into_iter()
                .map(|(customer, events, total, last, out)| (customer, (events, total, last, out)))
                .collect(),
            outbox: outbox.into_iter().collect(),
            inbox: inbox
                .into_iter()
                .map(|(consumer, status, n)| ((consumer, status), n))
                .collect(),
        })
    }

    /// Closes the pool (so that SQLite checkpoints its WAL into the database file).
    pub(crate) async fn close(&self) {
        match self {
            Db::Postgres(pool) => pool.close().await,
            Db::Sqlite(pool) => pool.close().await,
        }
    }
}
