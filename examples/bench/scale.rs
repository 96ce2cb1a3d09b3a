//! The cost of scale: filling the inbox fast, the retention purge, and a worker's memory over a
//! long run.

use std::collections::VecDeque;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use inbox_runtime::ops::admin::{PurgeReport, Retention};
use inbox_runtime::source::{Delivery, Settle, Settlement, Source, SourceError};
use inbox_runtime::{Dispatcher, Envelope, SourceMetadata, Worker};
use sqlx::PgPool;
use tokio_util::sync::CancellationToken;

use crate::measure::{BoxError, Rng, rss_kib};
use crate::paths::{CONSUMER, KeyKind, MESSAGE, fresh};

/// A fingerprint for rows that no delivery will ever compare against.
const FILL_HASH: &str = "0000000000000000000000000000000000000000000000000000000000000000";

/// Adds `rows` processed rows of consumer [`CONSUMER`] to the inbox with `INSERT … SELECT
/// generate_series`, in statements of at most a million rows; `existing` rows are already there
/// (time-ordered keys continue after them). Keys are UUID text like the runtime stores: random
/// (`gen_random_uuid()`), or UUIDv7 with millisecond timestamps from 2020 on, older than any key
/// made now. Their `received_at` is a day ago (kept by any retention window).
pub(crate) async fn fill(
    pool: &PgPool,
    kind: KeyKind,
    existing: u64,
    rows: u64,
) -> Result<(), BoxError> {
    const CHUNK: u64 = 1_000_000;
    let mut done = 0;
    while done < rows {
        let n = (rows - done).min(CHUNK);
        let key = match kind {
            KeyKind::Random => "gen_random_uuid()::text",
            KeyKind::TimeOrdered => {
                "substr(t, 1, 8) || '-' || substr(t, 9, 4) || '-7' || substr(gen_random_uuid()::text, 16)"
            }
        };
        let sql = format!(
            "INSERT INTO inbox_messages (consumer, message_key, message_name, payload_hash, \
               status, attempts, received_at, processed_at) \
             SELECT $1, {key}, $2, decode('{FILL_HASH}', 'hex'), 'processed', 1, \
               now() - interval '1 day', now() - interval '1 day' \
             FROM (SELECT lpad(to_hex(1577836800000 + $3 + g), 12, '0') AS t \
                   FROM generate_series(1, $4::bigint) g) s"
        );
        sqlx::query(sqlx::AssertSqlSafe(sql))
            .bind(CONSUMER)
            .bind(MESSAGE)
            .bind((existing + done) as i64)
            .bind(n as i64)
            .execute(pool)
            .await?;
        done += n;
    }
    Ok(())
}

/// Empties the inbox tables.
pub(crate) async fn truncate(pool: &PgPool) -> Result<(), BoxError> {
    sqlx::query("TRUNCATE inbox_messages, inbox_rejections, inbox_aggregate_state")
        .execute(pool)
        .await?;
    Ok(())
}

/// `ANALYZE` and a `CHECKPOINT` (if allowed), so that a fill's dirty pages are not written
/// during the next measurement; then every page of `bench_accounts` is touched (row locks,
/// rolled back) so that their full-page images after the checkpoint are written now, not by
/// whichever row is measured first.
pub(crate) async fn settle(pool: &PgPool) {
    let _ = sqlx::query("ANALYZE inbox_messages").execute(pool).await;
    let _ = sqlx::query("CHECKPOINT").execute(pool).await;
    if let Ok(mut tx) = pool.begin().await {
        let _ = sqlx::query("SELECT count(*) FROM (SELECT 1 FROM bench_accounts FOR UPDATE) s")
            .execute(&mut *tx)
            .await;
        let _ = tx.rollback().await;
    }
}

/// Heap and index size of `inbox_messages`, pretty.
pub(crate) async fn sizes(pool: &PgPool) -> Result<(String, String), BoxError> {
    Ok(sqlx::query_as(
        "SELECT pg_size_pretty(pg_table_size('inbox_messages')), \
                pg_size_pretty(pg_indexes_size('inbox_messages'))",
    )
    .fetch_one(pool)
    .await?)
}

/// What one purge measured.
pub(crate) struct PurgeRun {
    pub(crate) report: PurgeReport,
    pub(crate) elapsed: Duration,
    pub(crate) kept: u64,
    /// Mean time of a batch among the first and the last tenth of the batches.
    pub(crate) first_batches: Duration,
    pub(crate) last_batches: Duration,
}

/// Fills `old` rows received 30 days ago and `recent` rows received a day ago, then runs
/// `inbox_runtime::ops::admin::purge` with a 7-day window in batches of `batch`.
pub(crate) async fn purge(
    pool: &PgPool,
    old: u64,
    recent: u64,
    batch: u32,
) -> Result<PurgeRun, BoxError> {
    truncate(pool).await?;
    fill(pool, KeyKind::Random, 0, recent).await?;
    sqlx::query(
        "INSERT INTO inbox_messages (consumer, message_key, message_name, payload_hash, \
           status, attempts, received_at, processed_at) \
         SELECT $1, gen_random_uuid()::text, $2, decode($3, 'hex'), 'processed', 1, \
           now() - interval '30 days', now() - interval '30 days' \
         FROM generate_series(1, $4::bigint)",
    )
    .bind(CONSUMER)
    .bind(MESSAGE)
    .bind(FILL_HASH)
    .bind(old as i64)
    .execute(pool)
    .await?;
    settle(pool).await;
    let week = Duration::from_secs(7 * 86_400);
    let retention = Retention::new(week, week)?.batch_size(batch);
    let started = Instant::now();
    let mut marks = vec![started];
    let report =
        inbox_runtime::ops::admin::purge(pool, &retention, |_| marks.push(Instant::now())).await?;
    let elapsed = started.elapsed();
    let batches: Vec<Duration> = marks.windows(2).map(|w| w[1] - w[0]).collect();
    let tenth = (batches.len() / 10).max(1);
    let mean = |d: &[Duration]| d.iter().sum::<Duration>() / (d.len().max(1) as u32);
    let first_batches = mean(&batches[..tenth.min(batches.len())]);
    let last_batches = mean(&batches[batches.len().saturating_sub(tenth)..]);
    let (kept,): (i64,) = sqlx::query_as("SELECT count(*) FROM inbox_messages")
        .fetch_one(pool)
        .await?;
    Ok(PurgeRun {
        report,
        elapsed,
        kept: kept as u64,
        first_batches,
        last_batches,
    })
}

// ---------------------------------------------------------------------------------------------
// The worker's memory over a long run.

/// An endless source of new payment messages, with a share of redeliveries of recent ones
/// (marked as such); settling only counts.
struct GenSource {
    rng: Rng,
    recent: VecDeque<Vec<u8>>,
    redeliver_percent: u64,
    settled: Arc<AtomicU64>,
}

struct Count(Arc<AtomicU64>);

impl Settle for Count {
    fn settle(
        self: Box<Self>,
        _: Settlement,
    ) -> inbox_runtime::BoxFuture<'static, Result<(), SourceError>> {
        self.0.fetch_add(1, Ordering::Relaxed);
        Box::pin(std::future::ready(Ok(())))
    }
}

impl Source for GenSource {
    fn name(&self) -> &str {
        "bench-generator"
    }

    fn next(&mut self) -> inbox_runtime::BoxFuture<'_, Result<Option<Delivery>, SourceError>> {
        let redeliver = !self.recent.is_empty() && self.rng.range(100) <= self.redeliver_percent;
        let (payload, redelivered) = if redeliver {
            let i = self.rng.next_u64() as usize % self.recent.len();
            (self.recent[i].clone(), true)
        } else {
            let msg = fresh(&mut self.rng, KeyKind::TimeOrdered);
            let payload = serde_json::to_vec(&msg).expect("serializable");
            if self.recent.len() == 1000 {
                self.recent.pop_front();
            }
            self.recent.push_back(payload.clone());
            (payload, false)
        };
        let envelope = Envelope::new(MESSAGE, payload)
            .with_source(SourceMetadata::new("bench-generator").redelivered(redelivered));
        let delivery = Delivery::new(envelope, Count(self.settled.clone()));
        Box::pin(std::future::ready(Ok(Some(delivery))))
    }
}

/// RSS samples of a long worker run.
pub(crate) struct MemoryRun {
    pub(crate) settled: u64,
    pub(crate) elapsed: Duration,
    /// (messages settled so far, RSS KiB), every quarter second.
    pub(crate) samples: Vec<(u64, u64)>,
    pub(crate) processed: u64,
    pub(crate) duplicates: u64,
    pub(crate) failed: u64,
}

impl MemoryRun {
    /// RSS once warm (after the first fifth of the run), at its peak, at the end (KiB).
    pub(crate) fn rss(&self) -> (u64, u64, u64) {
        let warm = self.samples.get(self.samples.len() / 5).map_or(0, |s| s.1);
        let peak = self.samples.iter().map(|s| s.1).max().unwrap_or(0);
        let end = self.samples.last().map_or(0, |s| s.1);
        (warm, peak, end)
    }

    /// Least-squares slope of RSS over messages after warm-up, KiB per 100,000 messages.
    pub(crate) fn slope_per_100k(&self) -> f64 {
        let points = &self.samples[self.samples.len() / 5..];
        if points.len() < 3 {
            return 0.0;
        }
        let n = points.len() as f64;
        let mx = points.iter().map(|p| p.0 as f64).sum::<f64>() / n;
        let my = points.iter().map(|p| p.1 as f64).sum::<f64>() / n;
        let sxy: f64 = points
            .iter()
            .map(|p| (p.0 as f64 - mx) * (p.1 as f64 - my))
            .sum();
        let sxx: f64 = points.iter().map(|p| (p.0 as f64 - mx).powi(2)).sum();
        if sxx == 0.0 {
            0.0
        } else {
            sxy / sxx * 100_000.0
        }
    }
}

/// Runs an `inbox_runtime::Worker` (concurrency `workers`, a pool of as many connections) over
/// an endless generated stream (10 % redeliveries) for `duration`, sampling RSS.
pub(crate) async fn memory(
    pool: PgPool,
    workers: usize,
    batch: Option<usize>,
    duration: Duration,
) -> Result<MemoryRun, BoxError> {
    let settled = Arc::new(AtomicU64::new(0));
    let source = GenSource {
        rng: Rng::new(7),
        recent: VecDeque::with_capacity(1000),
        redeliver_percent: 10,
        settled: settled.clone(),
    };
    let mut worker = Worker::new(Dispatcher::from_registry(pool)?)
        .concurrency(workers)
        .one_per_transaction();
    if let Some(size) = batch {
        // One batch runs while the next one gathers (`concurrency` bounds the batches running).
        worker = worker.concurrency(1).batch(size, Duration::from_millis(5));
    }
    let shutdown = CancellationToken::new();
    let started = Instant::now();
    let sampler = {
        let (settled, shutdown) = (settled.clone(), shutdown.clone());
        tokio::spawn(async move {
            let mut samples = Vec::new();
            let mut tick = tokio::time::interval(Duration::from_millis(250));
            while started.elapsed() < duration {
                tick.tick().await;
                samples.push((settled.load(Ordering::Relaxed), rss_kib().unwrap_or(0)));
            }
            shutdown.cancel();
            samples
        })
    };
    let report = worker.run(source, shutdown).await?;
    let elapsed = started.elapsed();
    let samples = sampler.await?;
    Ok(MemoryRun {
        settled: settled.load(Ordering::Relaxed),
        elapsed,
        samples,
        processed: report.processed,
        duplicates: report.duplicates,
        failed: report.failed + report.conflicts + report.invalid,
    })
}
