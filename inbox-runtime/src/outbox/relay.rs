//! The relay: leases committed outbox rows, publishes them to a sink, marks them sent.

use std::sync::Arc;
use std::time::{Duration, Instant};

use futures_util::StreamExt as _;
use tokio_util::sync::CancellationToken;
use tracing::Instrument as _;

use crate::sink::{OutgoingMessage, Sink, SinkError};
use crate::store::{OutboxDatabase, OutboxRecord, OutboxStatus, OutboxStore as _};

/// Publishes committed outbox rows to a [`Sink`] and marks them sent.
///
/// Each round ([`run_once`](Self::run_once)) **leases** up to [`batch_size`](Self::batch_size)
/// publishable rows for [`lease`](Self::lease) (one short statement: rows are selected by
/// status, so a row committed late is found by the next round; on PostgreSQL only rows whose
/// transaction is older than every running one, see
/// [`OutboxStore::lease_outbox`](crate::OutboxStore::lease_outbox)), **publishes**
/// them with one [`Sink::publish_batch`], then **marks** the accepted ones `sent` and records
/// each failure: retried after a backoff (`backoff` doubled per attempt, capped), `dead` once
/// permanent or at [`max_attempts`](Self::max_attempts).
///
/// * **Per-aggregate order**: a row is not leased while an earlier row of its aggregate is
///   `pending` (unpublished, failing, or out with another relay) or `dead`; rows of an aggregate
///   are published one at a time in id order, which is their commit order when the writers of
///   one aggregate are serialized (they lock the aggregate's row, as they must for its state
///   anyway). A poison row blocks only its own aggregate.
/// * **Many relays**: leases keep two relays off the same row (PostgreSQL: `FOR UPDATE SKIP
///   LOCKED`; SQLite: the single writer lock). A relay that dies after publishing and before
///   marking leaves the row leased; once the lease runs out another relay publishes it again,
///   with the **same** message id. Keep the lease longer than a batch's publish takes.
/// * **Wake-up**: [`run`](Self::run) rounds back to back while there is work, then waits for a
///   PostgreSQL notification (a hint, see [`Outbox::notify`](super::Outbox::notify)) or the
///   [`poll_interval`](Self::poll_interval), whichever comes first: latency stays bounded by the
///   poll interval even if every notification is lost.
/// * **Observability**: counters `inbox_outbox_published_total`, `inbox_outbox_failed_total`,
///   `inbox_outbox_dead_total` (label `destination`), histogram
///   `inbox_outbox_publish_seconds` (one batch's publish), gauges `inbox_outbox_pending` and
///   `inbox_outbox_oldest_pending_seconds` (refreshed when idle); span `inbox.outbox.round`.
///
/// ```no_run
/// # async fn demo(pool: sqlx::PgPool) -> Result<(), sqlx::Error> {
/// use inbox_runtime::outbox::Relay;
/// use inbox_runtime::sink::MemorySink;
///
/// let shutdown = tokio_util::sync::CancellationToken::new();
/// let report = Relay::new(pool, MemorySink::new())
///     .batch_size(100)
///     .run(shutdown.clone())
///     .await;
/// println!("published {}", report.published);
/// # Ok(()) }
/// ```
pub struct Relay<DB: OutboxDatabase> {
    pool: sqlx::Pool<DB>,
    sink: Arc<dyn Sink>,
    batch_size: u32,
    lease: Duration,
    poll_interval: Duration,
    max_attempts: u32,
    backoff: Duration,
    max_backoff: Duration,
}

impl<DB: OutboxDatabase> std::fmt::Debug for Relay<DB> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Relay")
            .field("batch_size", &self.batch_size)
            .field("lease", &self.lease)
            .field("poll_interval", &self.poll_interval)
            .field("max_attempts", &self.max_attempts)
            .field("backoff", &self.backoff)
            .field("max_backoff", &self.max_backoff)
            .finish_non_exhaustive()
    }
}

/// What one round did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct RoundReport {
    /// Rows leased.
    pub leased: usize,
    /// Rows the sink accepted and that were marked sent.
    pub published: usize,
    /// Rows whose publish failed and that will be retried.
    pub failed: usize,
    /// Rows whose publish failed and that went `dead`.
    pub dead: usize,
}

/// What [`Relay::run`] did until it stopped.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct RelayReport {
    /// Rounds that leased at least one row.
    pub rounds: u64,
    /// Rows published and marked sent.
    pub published: u64,
    /// Failed publishes to be retried.
    pub failed: u64,
    /// Rows that went `dead`.
    pub dead: u64,
    /// Rounds that failed on a database error (logged, retried after the poll interval).
    pub errors: u64,
}

impl<DB: OutboxDatabase> Relay<DB> {
    /// A relay from the outbox behind `pool` to `sink`, with the defaults: batches of 100,
    /// leases of 30 s, a poll every 500 ms, 10 attempts, backoff from 1 s doubling to 5 min.
    pub fn new(pool: sqlx::Pool<DB>, sink: impl Sink) -> Self {
        Self {
            pool,
            sink: Arc::new(sink),
            batch_size: 100,
            lease: Duration::from_secs(30),
            poll_interval: Duration::from_millis(500),
            max_attempts: 10,
            backoff: Duration::from_secs(1),
            max_backoff: Duration::from_secs(300),
        }
    }

    /// At most this many rows per round (at least 1).
    pub fn batch_size(mut self, rows: u32) -> Self {
        self.batch_size = rows.max(1);
        self
    }

    /// How long a leased row stays with this relay before another may publish it again.
    pub fn lease(mut self, lease: Duration) -> Self {
        self.lease = lease;
        self
    }

    /// The longest wait between rounds when idle (the latency bound without notifications).
    pub fn poll_interval(mut self, interval: Duration) -> Self {
        self.poll_interval = interval;
        self
    }

    /// Publish attempts after which a failing row goes `dead` (at least 1).
    pub fn max_attempts(mut self, attempts: u32) -> Self {
        self.max_attempts = attempts.max(1);
        self
    }

    /// The wait before a failed row's second attempt, doubled for each later one up to `max`.
    pub fn backoff(mut self, first: Duration, max: Duration) -> Self {
        self.backoff = first;
        self.max_backoff = max.max(first);
        self
    }

    /// The wait after a row's `attempts`-th failed publish.
    fn retry_in(&self, attempts: u32) -> Duration {
        let doublings = attempts.saturating_sub(1).min(30);
        self.backoff
            .saturating_mul(1u32 << doublings)
            .min(self.max_backoff)
    }

    /// One round: lease, publish, mark. Returns what it did (`leased == 0`: nothing to do).
    ///
    /// # Errors
    /// A database error while leasing or marking. Rows published but not marked stay leased
    /// and are published again, with the same message ids, after their lease.
    pub async fn run_once(&self) -> Result<RoundReport, sqlx::Error> {
        let span = tracing::info_span!(
            "inbox.outbox.round",
            leased = tracing::field::Empty,
            published = tracing::field::Empty,
            failed = tracing::field::Empty,
            dead = tracing::field::Empty,
        );
        self.round().instrument(span).await
    }

    async fn round(&self) -> Result<RoundReport, sqlx::Error> {
        let mut conn = self.pool.acquire().await?;
        let lease_ms = i64::try_from(self.lease.as_millis()).unwrap_or(i64::MAX);
        let records = conn
            .lease_outbox(i64::from(self.batch_size), lease_ms)
            .await?;
        let mut report = RoundReport {
            leased: records.len(),
            ..RoundReport::default()
        };
        if records.is_empty() {
            return Ok(report);
        }
        let (messages, unreadable) = outgoing(&records);
        let started = Instant::now();
        let mut results = if messages.is_empty() {
            Vec::new()
        } else {
            self.sink.publish_batch(&messages).await
        };
        metrics::histogram!("inbox_outbox_publish_seconds").record(started.elapsed().as_secs_f64());
        if results.len() != messages.len() {
            let text = format!(
                "the sink answered {} results for {} messages",
                results.len(),
                messages.len()
            );
            results = messages
                .iter()
                .map(|_| Err(SinkError::retryable(text.clone())))
                .collect();
        }
        let mut sent = Vec::new();
        let mut failures: Vec<(&OutboxRecord, SinkError)> = unreadable;
        let mut by_id = records.iter();
        for (message, result) in messages.iter().zip(results) {
            let record = by_id
                .find(|r| r.message_id == message.message_id)
                .expect("messages follow their records");
            match result {
                Ok(()) => sent.push(record),
                Err(error) => failures.push((record, error)),
            }
        }
        let ids: Vec<i64> = sent.iter().map(|r| r.id).collect();
        conn.mark_outbox_sent(&ids).await?;
        for record in &sent {
            let destination = record.destination.clone();
            metrics::counter!("inbox_outbox_published_total", "destination" => destination)
                .increment(1);
        }
        report.published = sent.len();
        for (record, error) in failures {
            let text = error.to_string();
            let retry_in = self.retry_in(record.attempts);
            let status = conn
                .mark_outbox_failed(
                    record.id,
                    &text,
                    error.is_permanent(),
                    self.max_attempts,
                    i64::try_from(retry_in.as_millis()).unwrap_or(i64::MAX),
                )
                .await?;
            let destination = record.destination.clone();
            if status == Some(OutboxStatus::Dead) {
                report.dead += 1;
                metrics::counter!("inbox_outbox_dead_total", "destination" => destination)
                    .increment(1);
                tracing::error!(
                    message_id = %record.message_id,
                    attempts = record.attempts,
                    error = %text,
                    "outbox message dead"
                );
            } else {
                report.failed += 1;
                metrics::counter!("inbox_outbox_failed_total", "destination" => destination)
                    .increment(1);
                tracing::warn!(
                    message_id = %record.message_id,
                    attempts = record.attempts,
                    retry_in_ms = retry_in.as_millis() as u64,
                    error = %text,
                    "outbox publish failed; will retry"
                );
            }
        }
        let span = tracing::Span::current();
        span.record("leased", report.leased);
        span.record("published", report.published);
        span.record("failed", report.failed);
        span.record("dead", report.dead);
        Ok(report)
    }

    /// Runs rounds until `shutdown` is cancelled (a round under way is finished first), then
    /// returns what it did. Rounds follow each other at once while they find rows; when idle
    /// the relay waits for a wake-up or the poll interval. A database error is logged and the
    /// round retried after the poll interval.
    pub async fn run(self, shutdown: CancellationToken) -> RelayReport {
        let mut wakeups = DB::wakeups(&self.pool).await;
        let mut report = RelayReport::default();
        while !shutdown.is_cancelled() {
            match self.run_once().await {
                Ok(round) if round.leased > 0 => {
                    report.rounds += 1;
                    report.published += round.published as u64;
                    report.failed += round.failed as u64;
                    report.dead += round.dead as u64;
                    continue;
                }
                Ok(_) => self.observe_backlog().await,
                Err(error) => {
                    report.errors += 1;
                    tracing::warn!(%error, "outbox relay round failed; retrying");
                }
            }
            let poll = tokio::time::sleep(self.poll_interval);
            match wakeups.as_mut() {
                Some(stream) => tokio::select! {
                    () = shutdown.cancelled() => {}
                    () = poll => {}
                    next = stream.next() => if next.is_none() {
                        tracing::warn!("outbox relay: notifications ended; polling only");
                        wakeups = None;
                    },
                },
                None => tokio::select! {
                    () = shutdown.cancelled() => {}
                    () = poll => {}
                },
            }
        }
        report
    }

    /// Sets the backlog gauges.
    async fn observe_backlog(&self) {
        let backlog = async {
            let mut conn = self.pool.acquire().await?;
            conn.outbox_backlog().await
        };
        if let Ok((pending, oldest)) = backlog.await {
            metrics::gauge!("inbox_outbox_pending").set(pending as f64);
            metrics::gauge!("inbox_outbox_oldest_pending_seconds").set(oldest);
        }
    }
}

/// The sink's messages for `records`, and the records whose stored headers do not parse (a
/// damaged row: dead at once).
fn outgoing(records: &[OutboxRecord]) -> (Vec<OutgoingMessage>, Vec<(&OutboxRecord, SinkError)>) {
    let mut messages = Vec::with_capacity(records.len());
    let mut unreadable = Vec::new();
    for record in records {
        match serde_json::from_str(&record.headers_json) {
            Ok(headers) => messages.push(OutgoingMessage {
                message_id: record.message_id.clone(),
                destination: record.destination.clone(),
                message_name: record.message_name.clone(),
                payload: record.payload.clone(),
                headers,
                aggregate_id: record.aggregate_id.clone(),
                attempt: record.attempts,
            }),
            Err(error) => unreadable.push((
                record,
                SinkError::permanent(format!("stored headers are not a JSON object: {error}")),
            )),
        }
    }
    (messages, unreadable)
}
