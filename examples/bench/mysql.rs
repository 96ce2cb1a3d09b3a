//! The MySQL/MariaDB section (issue 16): the same workload as on PostgreSQL — the bare effect,
//! one message per transaction through a real `#[idempotent]` handler (called directly, through
//! `Dispatcher::dispatch` and `Dispatcher::dispatch_on`) and batches of 100
//! (`Dispatcher::dispatch_batch_on`) — on the server of `MYSQL_URL` (`--mysql-url`), in its own
//! database. After every measurement the effects are checked exact: the balances grew by exactly
//! the amounts the paths reported done, and the inbox by exactly one row per message.

use std::str::FromStr as _;
use std::sync::Arc;
use std::sync::atomic::{AtomicI64, Ordering};
use std::time::Duration;

use inbox_runtime::{ConnectionSlot, Dispatcher, Envelope, idempotent};
use sqlx::mysql::{MySqlConnectOptions, MySqlPoolOptions};
use sqlx::pool::PoolConnection;
use sqlx::{Connection as _, MySql, MySqlConnection, MySqlPool};

use crate::measure::{BoxError, BoxFuture, CpuProbe, Op, Sample, run_ops};
use crate::paths::{self, ACCOUNTS, Credit, KeyKind, MESSAGE, Stream};

/// The business effect in MySQL's syntax: the same ledger upsert as `paths::UPSERT_PG`.
const UPSERT: &str = "INSERT INTO bench_accounts (id, balance_cents) VALUES (?, ?) \
     ON DUPLICATE KEY UPDATE balance_cents = balance_cents + VALUES(balance_cents)";

/// Credits the amount (MySQL/MariaDB).
#[idempotent(consumer = "bench")]
pub(crate) async fn credit_mysql(
    conn: &mut MySqlConnection,
    msg: Credit,
) -> Result<(), sqlx::Error> {
    sqlx::query(UPSERT)
        .bind(&msg.account_id)
        .bind(msg.amount_cents)
        .execute(conn)
        .await?;
    Ok(())
}

/// The rows of the section.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) enum Path {
    /// The upsert alone, autocommit: the baseline.
    Bare,
    /// The upsert in `BEGIN` … `COMMIT`.
    BareTx,
    /// `#[idempotent]` called directly on a held connection.
    Direct,
    /// `Dispatcher::dispatch`: a pooled connection per message.
    Dispatch,
    /// `Dispatcher::dispatch_on`: a held `ConnectionSlot`, as the `Worker` does.
    DispatchOn,
    /// `Dispatcher::dispatch_batch_on` with this many envelopes per transaction.
    Batch(usize),
}

pub(crate) const PATHS: [Path; 6] = [
    Path::Bare,
    Path::BareTx,
    Path::Direct,
    Path::Dispatch,
    Path::DispatchOn,
    Path::Batch(100),
];

impl Path {
    pub(crate) fn label(self) -> String {
        match self {
            Path::Bare => "bare effect (autocommit) — baseline".into(),
            Path::BareTx => "bare effect in BEGIN … COMMIT".into(),
            Path::Direct => "#[idempotent] called directly".into(),
            Path::Dispatch => "Dispatcher::dispatch (a pooled connection per message)".into(),
            Path::DispatchOn => "Dispatcher::dispatch_on (held connection, as the Worker)".into(),
            Path::Batch(n) => format!("Dispatcher::dispatch_batch_on, {n} per transaction"),
        }
    }

    /// Whether the path writes an inbox row per message.
    fn claims(self) -> bool {
        !matches!(self, Path::Bare | Path::BareTx)
    }
}

/// The server under test, in the harness's own database.
pub(crate) struct My {
    pub(crate) opts: MySqlConnectOptions,
    pub(crate) admin: MySqlPool,
    pub(crate) cpu: CpuProbe,
}

/// Drops and creates `db_name` on the server of `url`, creates the inbox tables and the
/// accounts there.
pub(crate) async fn connect(url: &str, db_name: &str) -> Result<My, BoxError> {
    let base = MySqlConnectOptions::from_str(url)?;
    let mut conn = MySqlConnection::connect_with(&base).await?;
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "DROP DATABASE IF EXISTS {db_name}"
    )))
    .execute(&mut conn)
    .await?;
    sqlx::query(sqlx::AssertSqlSafe(format!("CREATE DATABASE {db_name}")))
        .execute(&mut conn)
        .await?;
    conn.close().await?;
    let opts = base.database(db_name);
    let admin = MySqlPoolOptions::new()
        .max_connections(2)
        .connect_with(opts.clone())
        .await?;
    inbox_runtime::migrate(&admin).await?;
    sqlx::query(
        "CREATE TABLE bench_accounts (id VARCHAR(16) PRIMARY KEY, balance_cents BIGINT NOT NULL) \
         ENGINE = InnoDB",
    )
    .execute(&admin)
    .await?;
    {
        // The accounts at 0, in chunks of 1000 rows, one transaction.
        let mut tx = admin.begin().await?;
        for chunk in (1..=ACCOUNTS).collect::<Vec<_>>().chunks(1_000) {
            let values = vec!["(?, 0)"; chunk.len()].join(", ");
            let mut query = sqlx::query(sqlx::AssertSqlSafe(format!(
                "INSERT IGNORE INTO bench_accounts (id, balance_cents) VALUES {values}"
            )));
            for id in chunk {
                query = query.bind(id.to_string());
            }
            query.execute(&mut *tx).await?;
        }
        tx.commit().await?;
    }
    sqlx::query("ANALYZE TABLE bench_accounts")
        .execute(&admin)
        .await?;
    // The server's pid (its threads' CPU is the server CPU), if it runs here.
    let (pid_file,): (String,) = sqlx::query_as("SELECT @@pid_file")
        .fetch_one(&admin)
        .await
        .unwrap_or_default();
    let pid = std::fs::read_to_string(&pid_file)
        .ok()
        .and_then(|t| t.trim().parse::<u32>().ok())
        .filter(|pid| std::path::Path::new(&format!("/proc/{pid}")).exists());
    Ok(My {
        opts,
        admin,
        cpu: CpuProbe { postmaster: pid },
    })
}

/// The server's version and durability-relevant settings.
pub(crate) async fn describe(my: &My) -> Result<(String, String), BoxError> {
    let (version,): (String,) = sqlx::query_as("SELECT VERSION()")
        .fetch_one(&my.admin)
        .await?;
    let settings: Vec<(String, String)> = sqlx::query_as(
        "SHOW GLOBAL VARIABLES WHERE Variable_name IN ('innodb_flush_log_at_trx_commit', \
         'sync_binlog', 'log_bin', 'innodb_buffer_pool_size', 'innodb_log_file_size', \
         'innodb_flush_method', 'innodb_doublewrite', 'tx_isolation', 'transaction_isolation', \
         'max_connections')",
    )
    .fetch_all(&my.admin)
    .await?;
    let settings = settings
        .iter()
        .map(|(n, v)| format!("{n}={v}"))
        .collect::<Vec<_>>()
        .join(", ");
    Ok((version, settings))
}

/// Balance total and inbox rows: what the effects left behind.
async fn totals(my: &My) -> Result<(i64, i64), BoxError> {
    let (balance, rows): (i64, i64) = sqlx::query_as(
        "SELECT CAST(COALESCE(SUM(balance_cents), 0) AS SIGNED), \
           (SELECT COUNT(*) FROM inbox_messages) FROM bench_accounts",
    )
    .fetch_one(&my.admin)
    .await?;
    Ok((balance, rows))
}

/// What a measurement's ops reported done, for the check.
#[derive(Default)]
struct Done {
    /// Cents credited by calls that succeeded.
    cents: AtomicI64,
    /// Messages of calls that succeeded.
    msgs: AtomicI64,
}

/// One measurement: the sample, and whether the effects were exact (or how they were not).
pub(crate) struct Measured {
    pub(crate) sample: Sample,
    pub(crate) exact: Result<(), String>,
}

/// Measures `path` at `workers` once, and checks the effects.
pub(crate) async fn measure(
    my: &My,
    path: Path,
    workers: usize,
    warmup: Duration,
    duration: Duration,
    seed: &dyn Fn() -> u64,
) -> Result<Measured, BoxError> {
    let pool = MySqlPoolOptions::new()
        .max_connections(workers as u32)
        .min_connections(workers as u32)
        .acquire_timeout(Duration::from_secs(60))
        .connect_with(my.opts.clone())
        .await?;
    let done = Arc::new(Done::default());
    let dispatcher = match path {
        Path::Dispatch | Path::DispatchOn | Path::Batch(_) => {
            Some(Arc::new(Dispatcher::from_registry(pool.clone())?))
        }
        _ => None,
    };
    let mut ops: Vec<Box<dyn Op>> = Vec::with_capacity(workers);
    for worker in 0..workers {
        let stream = Stream::fresh(seed(), KeyKind::Random, worker, workers);
        let conn = match path {
            Path::Bare | Path::BareTx | Path::Direct => Some(pool.acquire().await?),
            _ => None,
        };
        ops.push(Box::new(MyOp {
            path,
            conn,
            dispatcher: dispatcher.clone(),
            slot: ConnectionSlot::new(),
            stream,
            done: done.clone(),
        }));
    }
    let before = totals(my).await?;
    let sample = run_ops(ops, warmup, duration, &my.cpu, &|| {}).await;
    pool.close().await;
    let after = totals(my).await?;
    let cents = done.cents.load(Ordering::Relaxed);
    let msgs = done.msgs.load(Ordering::Relaxed);
    let rows = if path.claims() { msgs } else { 0 };
    let (d_balance, d_rows) = (after.0 - before.0, after.1 - before.1);
    let exact = if d_balance == cents && d_rows == rows {
        Ok(())
    } else {
        Err(format!(
            "balances +{d_balance} for {cents} credited, inbox +{d_rows} rows for {rows} messages"
        ))
    };
    Ok(Measured { sample, exact })
}

/// One task's loop body.
struct MyOp {
    path: Path,
    conn: Option<PoolConnection<MySql>>,
    dispatcher: Option<Arc<Dispatcher<MySql>>>,
    slot: ConnectionSlot<MySql>,
    stream: Stream,
    done: Arc<Done>,
}

impl MyOp {
    fn record(&self, msgs: &[Credit]) -> u64 {
        let cents: i64 = msgs.iter().map(|m| m.amount_cents).sum();
        self.done.cents.fetch_add(cents, Ordering::Relaxed);
        self.done
            .msgs
            .fetch_add(msgs.len() as i64, Ordering::Relaxed);
        msgs.len() as u64
    }
}

impl Op for MyOp {
    fn call(&mut self) -> BoxFuture<'_, Result<u64, BoxError>> {
        Box::pin(async move {
            let size = match self.path {
                Path::Batch(n) => n,
                _ => 1,
            };
            let msgs: Vec<Credit> = (0..size).map(|_| self.stream.next().0).collect();
            match self.path {
                Path::Bare => {
                    let conn = self.conn.as_mut().ok_or("no connection")?;
                    effect(conn, &msgs[0]).await?;
                }
                Path::BareTx => {
                    let conn = self.conn.as_mut().ok_or("no connection")?;
                    let mut tx = conn.begin().await?;
                    effect(&mut tx, &msgs[0]).await?;
                    tx.commit().await?;
                }
                Path::Direct => {
                    let conn = self.conn.as_mut().ok_or("no connection")?;
                    paths::check(credit_mysql(conn, msgs[0].clone()).await, false)?;
                }
                Path::Dispatch | Path::DispatchOn => {
                    let dispatcher = self.dispatcher.as_ref().ok_or("no dispatcher")?;
                    let envelope = Envelope::new(MESSAGE, serde_json::to_vec(&msgs[0])?);
                    let mut outcomes = if self.path == Path::DispatchOn {
                        dispatcher.dispatch_on(&mut self.slot, &envelope).await?
                    } else {
                        dispatcher.dispatch(&envelope).await?
                    };
                    if outcomes.len() != 1 {
                        return Err(format!("{} consumer outcomes", outcomes.len()).into());
                    }
                    paths::check(outcomes.remove(0).result, false)?;
                }
                Path::Batch(_) => {
                    let dispatcher = self.dispatcher.as_ref().ok_or("no dispatcher")?;
                    let mut envelopes = Vec::with_capacity(size);
                    for msg in &msgs {
                        envelopes.push(Envelope::new(MESSAGE, serde_json::to_vec(msg)?));
                    }
                    let results = dispatcher
                        .dispatch_batch_on(&mut self.slot, &envelopes)
                        .await;
                    if results.len() != size {
                        return Err(
                            format!("{} results for {size} envelopes", results.len()).into()
                        );
                    }
                    // Count what committed even when one failed, so that the check stays exact.
                    let mut ok = Vec::with_capacity(size);
                    let mut first_error = None;
                    for (msg, result) in msgs.iter().zip(results) {
                        let outcome = result.map_err(BoxError::from).and_then(|mut o| {
                            if o.len() != 1 {
                                return Err(format!("{} consumer outcomes", o.len()).into());
                            }
                            paths::check(o.remove(0).result, false)
                        });
                        match outcome {
                            Ok(_) => ok.push(msg.clone()),
                            Err(e) => {
                                first_error.get_or_insert(e);
                            }
                        }
                    }
                    self.record(&ok);
                    return match first_error {
                        None => Ok(size as u64),
                        Some(e) => Err(e),
                    };
                }
            }
            Ok(self.record(&msgs))
        })
    }
}

async fn effect(conn: &mut MySqlConnection, msg: &Credit) -> Result<(), sqlx::Error> {
    sqlx::query(UPSERT)
        .bind(&msg.account_id)
        .bind(msg.amount_cents)
        .execute(conn)
        .await?;
    Ok(())
}

/// Drops the harness's database.
pub(crate) async fn drop_database(url: &str, db_name: &str) -> Result<(), BoxError> {
    let mut conn = MySqlConnection::connect_with(&MySqlConnectOptions::from_str(url)?).await?;
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "DROP DATABASE IF EXISTS {db_name}"
    )))
    .execute(&mut conn)
    .await?;
    conn.close().await?;
    Ok(())
}
