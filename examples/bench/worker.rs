//! Worker overhead: the `Worker` against `Dispatcher::dispatch_on` at the same concurrency.
//!
//! The seeded workload of the contention section (`contention.rs`: credits of 1,000 accounts,
//! a tenth of the deliveries redeliveries of earlier ones; `UPDATE … SET balance = balance + $1`)
//! runs, each round on a fresh inbox and zeroed balances, through:
//!
//! * **dispatch_on**: `concurrency` Tokio tasks, each holding a `ConnectionSlot` and calling
//!   `Dispatcher::dispatch_on` on the next envelope of a shared list (no source, no settling);
//! * **Worker, one per transaction**: a `Worker` over a `MemorySource` holding the same
//!   envelopes, `Worker::one_per_transaction()`, `concurrency(n)`, its `run` in a spawned task
//!   (as the dispatch_on tasks);
//! * **Worker, default**: the same `Worker` with its default batching (deliveries that are
//!   ready together in one transaction, up to 100).
//!
//! Each run uses a pool of `concurrency + 1` connections (the Worker keeps one per transaction
//! in flight). Reported: median deliveries/s, `× dispatch_on`, and whether every balance came
//! out exact. `INBOX_BENCH_WORKER_PATHS` (comma-separated: `dispatch_on`, `single`, `default`)
//! runs only those paths, e.g. to count a path's system calls under `strace -f -c`;
//! `INBOX_BENCH_WORKER_CONCURRENCY` (comma-separated) replaces the profile's concurrencies.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use inbox_runtime::source::memory::MemorySource;
use inbox_runtime::{ConnectionSlot, Dispatcher, Envelope, Worker, WorkerReport};
use sqlx::PgPool;
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use tokio_util::sync::CancellationToken;

use crate::contention::{ACCOUNTS, Workload};
use crate::measure::BoxError;

/// The ways of running the workload.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Path {
    /// `Dispatcher::dispatch_on` in `concurrency` tasks.
    DispatchOn,
    /// `Worker::one_per_transaction()`.
    Single,
    /// The Worker's defaults (batching what is ready together).
    Default,
}

impl Path {
    pub(crate) const ALL: [Path; 3] = [Path::DispatchOn, Path::Single, Path::Default];

    pub(crate) fn name(self) -> &'static str {
        match self {
            Path::DispatchOn => "dispatch_on",
            Path::Single => "single",
            Path::Default => "default",
        }
    }

    pub(crate) fn label(self) -> &'static str {
        match self {
            Path::DispatchOn => "`Dispatcher::dispatch_on` (tasks)",
            Path::Single => "`Worker`, one per transaction",
            Path::Default => "`Worker`, default (batches what is ready)",
        }
    }

    /// The paths `INBOX_BENCH_WORKER_PATHS` asks for (all by default).
    pub(crate) fn wanted() -> Vec<Path> {
        match std::env::var("INBOX_BENCH_WORKER_PATHS") {
            Ok(list) if !list.trim().is_empty() => Path::ALL
                .into_iter()
                .filter(|p| list.split(',').any(|name| name.trim() == p.name()))
                .collect(),
            _ => Path::ALL.to_vec(),
        }
    }
}

/// One run's figures.
pub(crate) struct Run {
    pub(crate) seconds: f64,
    pub(crate) exact: bool,
    /// The Worker's report (none for `dispatch_on`).
    pub(crate) report: Option<WorkerReport>,
}

fn envelopes(workload: &Workload) -> Vec<Envelope> {
    workload
        .deliveries
        .iter()
        .map(|message| {
            Envelope::new(
                "bench.contention",
                serde_json::to_vec(message).expect("serializable"),
            )
        })
        .collect()
}

/// Runs the workload once along `path` at `concurrency`.
pub(crate) async fn run(
    admin: &PgPool,
    opts: &PgConnectOptions,
    workload: &Workload,
    path: Path,
    concurrency: usize,
) -> Result<Run, BoxError> {
    sqlx::query("UPDATE contention_accounts SET balance = 0")
        .execute(admin)
        .await?;
    sqlx::query("DELETE FROM inbox_messages WHERE consumer = 'contention'")
        .execute(admin)
        .await?;
    let connections = concurrency as u32 + 1;
    let pool = PgPoolOptions::new()
        .max_connections(connections)
        .min_connections(connections)
        .acquire_timeout(Duration::from_secs(120))
        .connect_with(opts.clone())
        .await?;
    let dispatcher = Arc::new(Dispatcher::from_registry(pool.clone())?);
    let list = envelopes(workload);
    let (seconds, report) = match path {
        Path::DispatchOn => {
            let list = Arc::new(list);
            let next = Arc::new(AtomicUsize::new(0));
            let started = Instant::now();
            let tasks: Vec<_> = (0..concurrency)
                .map(|_| {
                    let (list, next, dispatcher) = (
                        Arc::clone(&list),
                        Arc::clone(&next),
                        Arc::clone(&dispatcher),
                    );
                    tokio::spawn(async move {
                        let mut slot = ConnectionSlot::new();
                        loop {
                            let i = next.fetch_add(1, Ordering::Relaxed);
                            let Some(envelope) = list.get(i) else { break };
                            let outcomes = dispatcher
                                .dispatch_on(&mut slot, envelope)
                                .await
                                .map_err(|e| e.to_string())?;
                            for outcome in outcomes {
                                let _ = outcome.result.map_err(|e| e.to_string())?;
                            }
                        }
                        Ok::<(), String>(())
                    })
                })
                .collect();
            for task in tasks {
                task.await??;
            }
            (started.elapsed().as_secs_f64(), None)
        }
        Path::Single | Path::Default => {
            let source = MemorySource::new("worker-bench");
            let handle = source.handle();
            for envelope in list {
                handle.push(envelope);
            }
            handle.close();
            let worker = Worker::from_arc(Arc::clone(&dispatcher))
                .concurrency(concurrency)
                .park_sweep(None);
            let worker = match path {
                Path::Single => worker.one_per_transaction(),
                _ => worker,
            };
            let started = Instant::now();
            // On a runtime worker thread, as the dispatch_on tasks are (not on `block_on`'s
            // thread, which every I/O wake-up would have to unpark).
            // `INBOX_BENCH_WORKER_ON_MAIN=1`: awaited directly, on `block_on`'s thread.
            let report = if std::env::var_os("INBOX_BENCH_WORKER_ON_MAIN").is_some() {
                worker.run(source, CancellationToken::new()).await?
            } else {
                tokio::spawn(async move { worker.run(source, CancellationToken::new()).await })
                    .await??
            };
            (started.elapsed().as_secs_f64(), Some(report))
        }
    };
    drop(dispatcher);
    pool.close().await;
    let balances: Vec<(i32, i64)> =
        sqlx::query_as("SELECT id, balance FROM contention_accounts ORDER BY id")
            .fetch_all(admin)
            .await?;
    let exact = balances.len() == workload.expected.len()
        && balances
            .iter()
            .all(|(id, balance)| workload.expected[(*id - 1) as usize] == *balance)
        && report.as_ref().is_none_or(|r| {
            r.acked == workload.deliveries.len() as u64 && r.failed == 0 && r.abandoned == 0
        });
    Ok(Run {
        seconds,
        exact,
        report,
    })
}

/// One cell of the table: path, concurrency, rates, transactions per run (Worker), exact.
type Cell = (Path, usize, Vec<f64>, Vec<String>, bool);

/// The section: every wanted path at each concurrency, `rounds` times, interleaved.
pub(crate) async fn section(
    out: &mut crate::Out,
    admin: &PgPool,
    opts: &PgConnectOptions,
    profile: &str,
    rounds: usize,
) -> Result<(), BoxError> {
    let (deliveries, concurrencies) = match profile {
        "smoke" => (500, vec![1, 4]),
        "quick" => (5_000, vec![1, 4]),
        _ => (20_000, vec![1, 4, 16]),
    };
    let concurrencies: Vec<usize> = match std::env::var("INBOX_BENCH_WORKER_CONCURRENCY") {
        Ok(list) if !list.trim().is_empty() => list
            .split(',')
            .map(|n| n.trim().parse())
            .collect::<Result<_, _>>()?,
        _ => concurrencies,
    };
    crate::contention::setup(admin).await?;
    let workload = Workload::new(0x3012_4E12, deliveries, deliveries / 10, ACCOUNTS);
    let paths = Path::wanted();
    // (path, concurrency) → rates, transactions per run (Worker), exact.
    let mut rates: Vec<Cell> = Vec::new();
    for &c in &concurrencies {
        for &path in &paths {
            rates.push((path, c, Vec::new(), Vec::new(), true));
        }
    }
    for round in 0..rounds {
        for (path, c, rs, txs, exact) in &mut rates {
            crate::progress(format!(
                "worker: round {}/{rounds}, {} at concurrency {c}",
                round + 1,
                path.name()
            ));
            let run = run(admin, opts, &workload, *path, *c).await?;
            rs.push(deliveries as f64 / run.seconds);
            if let Some(report) = &run.report {
                txs.push(format!(
                    "{}+{} ({} fallbacks)",
                    report.batches,
                    report.deliveries - report.batched,
                    report.contention_fallbacks
                ));
            }
            *exact &= run.exact;
        }
    }
    let table: Vec<Vec<String>> = rates
        .iter()
        .map(|(path, c, rs, txs, exact)| {
            let rate = crate::median(rs);
            let base = rates
                .iter()
                .find(|(p, c2, ..)| *p == Path::DispatchOn && c2 == c)
                .map(|(_, _, r, ..)| crate::median(r));
            vec![
                path.label().into(),
                c.to_string(),
                format!("{rate:.0}"),
                crate::ratio(rate, base),
                if txs.is_empty() {
                    "—".into()
                } else {
                    txs[0].clone()
                },
                if *exact { "yes" } else { "no" }.into(),
            ]
        })
        .collect();
    out.line("## Worker overhead: the Worker against `dispatch_on` (PostgreSQL)");
    out.line("");
    out.line(format!(
        "{deliveries} deliveries ({} of them redeliveries, seeded) over {ACCOUNTS} accounts, \
         each effect `UPDATE contention_accounts SET balance = balance + $1 WHERE id = $2`; \
         fresh inbox and zeroed balances per run, a pool of concurrency + 1 connections, \
         {rounds} rounds interleaved, median deliveries/s. `× dispatch_on`: ÷ \
         `Dispatcher::dispatch_on` in as many tasks. Transactions: batches + deliveries run \
         alone, of the first round, and the batches that lost to concurrent transactions (run \
         again alone or one delivery per transaction: `WorkerReport::contention_fallbacks`). \
         Exact: every balance equals the sum of its distinct events, every delivery acked.",
        deliveries / 10
    ));
    out.line("");
    out.table(
        &[
            "path",
            "concurrency",
            "deliveries/s",
            "× dispatch_on",
            "transactions",
            "exact",
        ],
        &table,
    );
    Ok(())
}
