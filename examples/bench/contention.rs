//! Contention: concurrent batches whose effects lock the same rows in different orders.
//!
//! 20,000 deliveries (18,000 events, 2,000 redeliveries of earlier ones, seeded) over 1,000
//! accounts; each effect is `UPDATE contention_accounts SET balance = balance + $1 WHERE id =
//! $2`, in message order. The `Worker` runs them in batches of 100, with several batches in flight
//! and with one in flight, side by side, each round on a fresh inbox and zeroed balances. Reported:
//! deliveries/s, PostgreSQL's deadlocks (the `pg_stat_database.deadlocks` delta), the runtime's
//! contention fallbacks (batches that lost a deadlock or serialization failure and ran their
//! messages alone), and whether every balance came out exact.

use std::sync::Arc;
use std::time::{Duration, Instant};

use inbox_runtime::source::memory::MemorySource;
use inbox_runtime::{Dispatcher, Envelope, Worker, WorkerReport};
use serde::{Deserialize, Serialize};
use sqlx::postgres::PgPoolOptions;
use sqlx::{PgConnection, PgPool};
use tokio_util::sync::CancellationToken;

use crate::measure::{BoxError, Rng};

/// Accounts the effects spread over.
pub(crate) const ACCOUNTS: i32 = 1_000;
/// Deliveries per run (events plus redeliveries).
pub(crate) const DELIVERIES: usize = 20_000;
/// Redeliveries among them.
pub(crate) const REDELIVERIES: usize = 2_000;
/// Messages per batch.
pub(crate) const BATCH: usize = 100;

/// One credit of an account.
#[derive(Debug, Clone, Serialize, Deserialize, inbox_runtime::Message)]
#[message(name = "bench.contention")]
pub(crate) struct Contended {
    /// The producer's event id: the idempotency key.
    #[message(key)]
    pub(crate) event_id: uuid::Uuid,
    pub(crate) account: i32,
    pub(crate) amount: i64,
}

/// The effect: one row lock per message, taken in message order.
#[inbox_runtime::idempotent(consumer = "contention")]
pub(crate) async fn contended(conn: &mut PgConnection, msg: Contended) -> Result<(), sqlx::Error> {
    sqlx::query("UPDATE contention_accounts SET balance = balance + $1 WHERE id = $2")
        .bind(msg.amount)
        .bind(msg.account)
        .execute(conn)
        .await?;
    Ok(())
}

/// The seeded workload: deliveries in order, and the balance each account must end with.
pub(crate) struct Workload {
    pub(crate) deliveries: Vec<Contended>,
    pub(crate) expected: Vec<i64>,
}

impl Workload {
    pub(crate) fn new(seed: u64, deliveries: usize, redeliveries: usize, accounts: i32) -> Self {
        let mut rng = Rng::new(seed);
        let events = deliveries - redeliveries;
        let mut expected = vec![0_i64; accounts as usize];
        let mut list: Vec<Contended> = (0..events)
            .map(|_| {
                let account = rng.range(accounts as u64) as i32;
                let amount = rng.range(100) as i64;
                expected[(account - 1) as usize] += amount;
                Contended {
                    event_id: rng.uuid_v4(),
                    account,
                    amount,
                }
            })
            .collect();
        // Each redelivery comes after its original, somewhere later in the stream.
        for _ in 0..redeliveries {
            let at = rng.range(list.len() as u64) as usize;
            let original = list[rng.next_u64() as usize % at].clone();
            list.insert(at, original);
        }
        Self {
            deliveries: list,
            expected,
        }
    }
}

/// One row of the section: a number of batches in flight, with or without the aggregate
/// declared, over the rounds.
pub(crate) struct Row {
    pub(crate) batches: usize,
    /// The Worker knows each delivery's aggregate (its account: [`declare_aggregate`]).
    pub(crate) declared: bool,
    /// Deliveries/s of the finished runs.
    pub(crate) rates: Vec<f64>,
    pub(crate) deadlocks: Vec<i64>,
    pub(crate) fallbacks: Vec<u64>,
    /// Every finished run exact.
    pub(crate) exact: bool,
    /// What the unfinished runs applied.
    pub(crate) unfinished: Vec<String>,
}

impl Row {
    pub(crate) fn new(batches: usize, declared: bool) -> Self {
        Self {
            batches,
            declared,
            rates: Vec::new(),
            deadlocks: Vec::new(),
            fallbacks: Vec::new(),
            exact: true,
            unfinished: Vec::new(),
        }
    }
}

/// One run's figures.
pub(crate) struct Run {
    pub(crate) seconds: f64,
    pub(crate) finished: bool,
    pub(crate) applied: u64,
    pub(crate) deadlocks: i64,
    pub(crate) report: WorkerReport,
    pub(crate) exact: bool,
}

/// Creates the accounts table (dropped first).
pub(crate) async fn setup(pool: &PgPool) -> Result<(), BoxError> {
    sqlx::query("DROP TABLE IF EXISTS contention_accounts")
        .execute(pool)
        .await?;
    sqlx::query(
        "CREATE TABLE contention_accounts (id int PRIMARY KEY, balance bigint NOT NULL DEFAULT 0)",
    )
    .execute(pool)
    .await?;
    sqlx::query("INSERT INTO contention_accounts (id) SELECT generate_series(1, $1)")
        .bind(ACCOUNTS)
        .execute(pool)
        .await?;
    Ok(())
}

async fn deadlocks(pool: &PgPool) -> Result<i64, BoxError> {
    // The statistics of other backends arrive within about a second of their transactions.
    tokio::time::sleep(Duration::from_millis(1_100)).await;
    let mut conn = pool.acquire().await?;
    sqlx::query("SELECT pg_stat_clear_snapshot()")
        .execute(&mut *conn)
        .await?;
    let (n,): (i64,) =
        sqlx::query_as("SELECT deadlocks FROM pg_stat_database WHERE datname = current_database()")
            .fetch_one(&mut *conn)
            .await?;
    Ok(n)
}

/// Runs the workload once through a Worker built by `configure`, for at most `limit`.
pub(crate) async fn run(
    admin: &PgPool,
    opts: &sqlx::postgres::PgConnectOptions,
    workload: &Workload,
    connections: u32,
    limit: Duration,
    configure: impl FnOnce(Worker<sqlx::Postgres>) -> Worker<sqlx::Postgres>,
) -> Result<Run, BoxError> {
    sqlx::query("UPDATE contention_accounts SET balance = 0")
        .execute(admin)
        .await?;
    sqlx::query("DELETE FROM inbox_messages WHERE consumer = 'contention'")
        .execute(admin)
        .await?;
    let pool = PgPoolOptions::new()
        .max_connections(connections)
        .min_connections(connections)
        .acquire_timeout(Duration::from_secs(120))
        .connect_with(opts.clone())
        .await?;
    let source = MemorySource::new("contention");
    let handle = source.handle();
    for message in &workload.deliveries {
        handle.push(Envelope::new(
            "bench.contention",
            serde_json::to_vec(message).expect("serializable"),
        ));
    }
    handle.close();
    let worker = configure(Worker::from_arc(Arc::new(Dispatcher::from_registry(
        pool.clone(),
    )?)));
    let before = deadlocks(admin).await?;
    let shutdown = CancellationToken::new();
    let stop = shutdown.clone();
    let timer = tokio::spawn(async move {
        tokio::time::sleep(limit).await;
        stop.cancel();
    });
    let started = Instant::now();
    let report = worker.run(source, shutdown).await?;
    let seconds = started.elapsed().as_secs_f64();
    timer.abort();
    pool.close().await;
    let deadlocks = deadlocks(admin).await? - before;
    let (applied,): (i64,) =
        sqlx::query_as("SELECT count(*) FROM inbox_messages WHERE consumer = 'contention'")
            .fetch_one(admin)
            .await?;
    let balances: Vec<(i32, i64)> =
        sqlx::query_as("SELECT id, balance FROM contention_accounts ORDER BY id")
            .fetch_all(admin)
            .await?;
    let finished = report.stop == inbox_runtime::StopReason::SourceExhausted;
    let exact = finished
        && balances.len() == workload.expected.len()
        && balances
            .iter()
            .all(|(id, balance)| workload.expected[(*id - 1) as usize] == *balance);
    Ok(Run {
        seconds,
        finished,
        applied: applied as u64,
        deadlocks,
        report,
        exact,
    })
}

/// A Worker with batches of [`BATCH`] and at most `batches` of them in flight.
pub(crate) fn configure(worker: Worker<sqlx::Postgres>, batches: usize) -> Worker<sqlx::Postgres> {
    // `concurrency` bounds the transactions (batches) in flight.
    worker
        .batch(BATCH, Duration::from_millis(5))
        .concurrency(batches)
        .park_sweep(None)
}

/// A Worker's configuration step.
pub(crate) type Configure = Box<dyn Fn(Worker<sqlx::Postgres>) -> Worker<sqlx::Postgres>>;

/// How to tell a Worker the aggregate each delivery's handler contends on — `account` of its
/// message `M` (decoded from the JSON payload), the row its `UPDATE` locks — so that it never
/// runs two batches sharing an account side by side (issue 33, item 2: partitioned batches).
/// The contention section and the peers' declared default Worker use it. `Err` says why this
/// build cannot: the rows that need it are then reported as skipped.
///
/// With `Worker::partition_by`: the account, read from the payload, is the delivery's partition.
///
/// (Not `#[message(partition)]` on the message types: the undeclared rows run the same types.)
pub(crate) fn declare_aggregate<M: serde::de::DeserializeOwned + 'static>(
    account: fn(&M) -> i32,
) -> Result<Configure, String> {
    Ok(Box::new(move |worker| {
        worker.partition_by(move |envelope| {
            let msg: M = serde_json::from_slice(&envelope.payload).ok()?;
            Some(vec![account(&msg).to_string()])
        })
    }))
}

/// The contention fallbacks a Worker report counts.
pub(crate) fn fallbacks(report: &WorkerReport) -> u64 {
    report.contention_fallbacks
}
