//! The relay: leases committed outbox rows, publishes them to a sink, marks them sent.

use std::collections::BTreeSet;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures_util::StreamExt as _;
use tokio_util::sync::CancellationToken;
use tracing::Instrument as _;

use crate::setters::setters;
use crate::sink::{OutgoingMessage, Sink, SinkError};
use crate::store::{
    OutboxBacklog, OutboxDatabase, OutboxFailure, OutboxRecord, OutboxStatus, OutboxStore as _,
};

/// Publishes committed outbox rows to a [`Sink`] and marks them sent.
///
/// Each round ([`run_once`](Self::run_once)) **leases** up to [`batch_size`](Self::batch_size)
/// publishable rows for [`lease`](Self::lease) (one short statement: rows are selected by
/// status, so a row committed late is found by the next round; on PostgreSQL only rows whose
/// transaction is older than every running one, see
/// [`OutboxStore::lease_outbox`](crate::store::OutboxStore::lease_outbox)), **publishes**
/// them with one [`Sink::publish_batch`], then **marks** the accepted ones `sent` and records
/// each failure: retried after a backoff (`backoff` doubled per attempt, capped), `dead` once
/// permanent or at [`max_attempts`](Self::max_attempts).
///
/// * **Per-aggregate order**: a row is not leased while an earlier-created row of its aggregate
///   (a lower id) that the relay can see is `pending` (unpublished, failing, or out with another
///   relay) or `dead`; a row whose transaction is still open is not seen and holds nothing back.
///   Rows of an aggregate therefore go out one at a time, never one ahead of an earlier-created
///   row that had committed by then, and in creation order when the aggregate's writers are
///   serialized: always on SQLite (one writer)
///   and MySQL/MariaDB (the publish locks the aggregate's lock row until the transaction ends);
///   on PostgreSQL only when the writers lock the aggregate (its row, `FOR UPDATE`, or
///   `pg_advisory_xact_lock` keyed by it) before publishing; see the
///   [module docs](crate::outbox#no-skips-and-in-what-order). A poison row blocks only its own
///   aggregate.
/// * **Many relays**: leases keep two relays off the same row (PostgreSQL: `FOR UPDATE SKIP
///   LOCKED`; SQLite: the single writer lock). A relay that dies after publishing and before
///   marking leaves the row leased; once the lease runs out another relay publishes it again,
///   with the **same** message id. Keep the lease longer than a batch's publish takes.
/// * **Lease-owned marks**: each lease writes a token into its rows, and a relay marks a row
///   sent or failed only while the row still carries its lease's token. A relay that was
///   paused (or whose mark was slow) past its lease, while another relay leased the row again,
///   changes nothing: it neither releases the other relay's lease nor marks the row sent ahead
///   of the other's publish (which would let the aggregate's next row overtake it). Its mark is
///   counted ([`RoundReport::lease_lost`], `inbox_outbox_lease_lost_total`) and logged, and
///   the round goes on.
/// * **Wake-up**: [`run`](Self::run) rounds back to back while there is work, then waits for a
///   PostgreSQL notification (a hint, see [`Outbox::notify`](super::Outbox::notify)) or the
///   [`poll_interval`](Self::poll_interval), whichever comes first: latency stays bounded by the
///   poll interval even if every notification is lost.
/// * **Crashes and hangs**: each lease counts an attempt before the publish. A row whose lease
///   runs out unmarked (its relay crashed, hung or was stopped) is leased again alone, and goes
///   `dead` once it has used [`max_attempts`](Self::max_attempts) leases ("the relay never
///   finished publishing it"), so a row that kills every relay cannot loop forever. A round
///   waits for the sink at most the lease ([`RoundReport::timed_out`]).
/// * **Observability**: the metrics and spans are listed in the README ("Observability"):
///   counters `inbox_outbox_published_total`, `inbox_outbox_failed_total`,
///   `inbox_outbox_dead_total` (labels `destination`, `reason`),
///   `inbox_outbox_timed_out_total`, `inbox_outbox_relay_errors_total`; histograms
///   `inbox_outbox_publish_latency_seconds` (from the row's creation to the sink's
///   confirmation) and `inbox_outbox_sink_batch_seconds`; gauges `inbox_outbox_pending` and
///   `inbox_outbox_oldest_pending_seconds` (per destination, [`backlog`](Self::backlog)); spans
///   `inbox.outbox.round`, `inbox.outbox.sink`, `inbox.outbox.publish`.
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
    backoff: Backoff,
    backlog_interval: Duration,
    /// The destinations whose backlog gauges this relay has set (to zero them when emptied).
    gauged: Mutex<BTreeSet<String>>,
    /// The table prefix of the scope it was built in: its rounds run in it.
    prefix: Option<crate::store::TablePrefix>,
}

impl<DB: OutboxDatabase> std::fmt::Debug for Relay<DB> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Relay")
            .field("batch_size", &self.batch_size)
            .field("lease", &self.lease)
            .field("poll_interval", &self.poll_interval)
            .field("max_attempts", &self.max_attempts)
            .field("backoff", &self.backoff.first)
            .field("max_backoff", &self.backoff.max)
            .field("backlog_interval", &self.backlog_interval)
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
    /// Rows this round's lease turned `dead` because their leases had run out
    /// [`max_attempts`](Relay::max_attempts) times unmarked (relays crashed, hung or were stopped
    /// while publishing them): see
    /// [`OutboxStore::lease_outbox`](crate::store::OutboxStore::lease_outbox).
    pub abandoned: usize,
    /// Rows whose publish did not answer within the lease: the relay stopped waiting and left
    /// them unmarked (their lease has run out; the next lease takes them as orphans, counting
    /// the attempt).
    pub timed_out: usize,
    /// Rows whose mark (sent or failed) changed nothing because this relay's lease on them was
    /// lost by the time it marked: their lease ran out and another relay leased them again, an
    /// operator retried or discarded them, or (a failure) they were dead-lettered as abandoned.
    /// The row stays as its current holder leaves it; a publish the sink accepted is published
    /// again by that holder, with the same message id.
    pub lease_lost: usize,
}

/// Runs `round` in the span `inbox.outbox.round` and records the counts of its report on the
/// span (`leased`, `published`, `failed`, `dead`, `abandoned`, `timed_out`, `lease_lost`): the
/// round span of every relay (SQL and DynamoDB).
pub(crate) async fn in_round_span<E>(
    round: impl Future<Output = Result<RoundReport, E>>,
) -> Result<RoundReport, E> {
    let span = tracing::info_span!(
        "inbox.outbox.round",
        leased = tracing::field::Empty,
        published = tracing::field::Empty,
        failed = tracing::field::Empty,
        dead = tracing::field::Empty,
        abandoned = tracing::field::Empty,
        timed_out = tracing::field::Empty,
        lease_lost = tracing::field::Empty,
    );
    let report = round.instrument(span.clone()).await?;
    span.record("leased", report.leased);
    span.record("published", report.published);
    span.record("failed", report.failed);
    span.record("dead", report.dead);
    span.record("abandoned", report.abandoned);
    span.record("timed_out", report.timed_out);
    span.record("lease_lost", report.lease_lost);
    Ok(report)
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
    /// Rows that went `dead` after a failed publish.
    pub dead: u64,
    /// Rows dead-lettered because their leases ran out too often ([`RoundReport::abandoned`]).
    pub abandoned: u64,
    /// Rows whose publish did not answer within the lease ([`RoundReport::timed_out`]).
    pub timed_out: u64,
    /// Marks that changed nothing, the lease having been lost ([`RoundReport::lease_lost`]).
    pub lease_lost: u64,
    /// Rounds that failed on a database error (logged, retried after the poll interval).
    pub errors: u64,
}

/// The shortest lease [`Relay::lease`] accepts: 100 ms. Below it no sink answers a batch in
/// time: every round would time out, and every row would be leased again and again until it went
/// `dead` unpublished (or published, but never marked).
pub const MIN_LEASE: Duration = Duration::from_millis(100);

/// The longest lease [`Relay::lease`] accepts: 1 hour. A round waits for its sink up to the
/// lease, and the rows of a relay that crashed wait that long for another: a longer lease is a
/// unit slip, not a sink (and one beyond the databases' time arithmetic would fail every round).
pub const MAX_LEASE: Duration = Duration::from_secs(3600);

/// The longest backoff [`Relay::backoff`] sets: 30 days (larger values are lowered to it; beyond
/// the databases' time arithmetic they would fail the failed row's mark).
pub const MAX_BACKOFF: Duration = Duration::from_secs(30 * 86_400);

/// A relay setting that [`Relay`]'s setters refuse.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum RelayConfigError {
    /// The lease is below [`MIN_LEASE`] or above [`MAX_LEASE`].
    #[error(
        "relay lease of {} is outside {}..={}: a lease shorter than a publish times every round \
         out and dead-letters rows unpublished; a longer one is a unit slip",
        crate::ops::admin::format_duration(*lease),
        crate::ops::admin::format_duration(*min),
        crate::ops::admin::format_duration(*max)
    )]
    LeaseOutOfRange {
        /// The lease asked for.
        lease: Duration,
        /// [`MIN_LEASE`].
        min: Duration,
        /// [`MAX_LEASE`].
        max: Duration,
    },
}

/// `Ok` if `lease` is within [`MIN_LEASE`]..=[`MAX_LEASE`].
pub(crate) fn check_lease(lease: Duration) -> Result<(), RelayConfigError> {
    if (MIN_LEASE..=MAX_LEASE).contains(&lease) {
        Ok(())
    } else {
        Err(RelayConfigError::LeaseOutOfRange {
            lease,
            min: MIN_LEASE,
            max: MAX_LEASE,
        })
    }
}

impl<DB: OutboxDatabase> Relay<DB> {
    /// A relay from the outbox behind `pool` to `sink`, with the defaults: batches of 100,
    /// leases of 30 s, a poll every 500 ms, 10 attempts, backoff from 1 s doubling to 5 min,
    /// backlog gauges refreshed every 5 s.
    pub fn new(pool: sqlx::Pool<DB>, sink: impl Sink) -> Self {
        Self {
            pool,
            sink: Arc::new(sink),
            batch_size: 100,
            lease: Duration::from_secs(30),
            poll_interval: Duration::from_millis(500),
            max_attempts: 10,
            backoff: Backoff::DEFAULT,
            backlog_interval: Duration::from_secs(5),
            gauged: Mutex::new(BTreeSet::new()),
            prefix: crate::store::TablePrefix::current(),
        }
    }

    /// At most this many rows per round (at least 1).
    pub fn batch_size(mut self, rows: u32) -> Self {
        self.batch_size = rows.max(1);
        self
    }

    /// How long a leased row stays with this relay before another may publish it again, and how
    /// long a round waits for the sink to answer: a publish that takes longer is abandoned
    /// ([`RoundReport::timed_out`]; the future is dropped) and its rows are leased again as
    /// orphans, each lease an attempt. Keep it well above the sink's worst publish time. Default
    /// 30 s.
    ///
    /// # Errors
    /// [`RelayConfigError::LeaseOutOfRange`] if `lease` is below [`MIN_LEASE`] (100 ms) or above
    /// [`MAX_LEASE`] (1 hour); the relay is consumed.
    pub fn lease(mut self, lease: Duration) -> Result<Self, RelayConfigError> {
        check_lease(lease)?;
        self.lease = lease;
        Ok(self)
    }

    setters! {
        /// The longest wait between rounds when idle (the latency bound without notifications).
        /// Default 500 ms; at least 1 ms (0 counts as 1 ms: an idle relay never polls back to
        /// back).
        pub fn poll_interval(interval: Duration) {
            self.poll_interval = interval.max(Duration::from_millis(1));
        }

        /// Leases (publish attempts) after which a row goes `dead` (at least 1): a row whose
        /// publish failed that often, or whose lease ran out unmarked that often (the relay
        /// publishing it crashed, hung or was stopped each time).
        pub fn max_attempts(attempts: u32) {
            self.max_attempts = attempts.max(1);
        }
    }

    /// The wait before a failed row's second attempt, doubled for each later one up to `max`
    /// (default 1 s to 5 min). Both are lowered to [`MAX_BACKOFF`] (30 days) if above it, and
    /// `max` is raised to `first` if below it.
    pub fn backoff(mut self, first: Duration, max: Duration) -> Self {
        self.backoff = Backoff::new(first, max);
        self
    }

    /// How often [`run`](Self::run) refreshes the backlog gauges (`inbox_outbox_pending`,
    /// `inbox_outbox_oldest_pending_seconds`) with one `GROUP BY` over the pending rows: at most
    /// this often, busy or idle, and once more each time the relay runs out of work. Default
    /// 5 s.
    pub fn backlog_interval(mut self, interval: Duration) -> Self {
        self.backlog_interval = interval;
        self
    }

    /// One round: lease, publish, mark. Returns what it did (`leased == 0`: nothing to do).
    ///
    /// Runs in the span `inbox.outbox.round` (fields `leased`, `published`, `failed`, `dead`,
    /// `abandoned`, `timed_out`, `lease_lost`), the sink's call in `inbox.outbox.sink`
    /// (`messages`), and each leased row in `inbox.outbox.publish` (`message_id`,
    /// `destination`, `message_name`, `aggregate`, `attempt`, `outcome`: `sent`, `failed`,
    /// `dead`, `timed_out` or `lease_lost`), where its warnings and errors are logged. With the
    /// feature `otel`, a row's `inbox.outbox.publish` is a child of the trace context stored
    /// with it, and its own context is sent in the message's `traceparent`/`tracestate`
    /// headers (see [`crate::trace`]).
    ///
    /// # Errors
    /// A database error while leasing or marking. Rows published but not marked stay leased
    /// and are published again, with the same message ids, after their lease.
    pub async fn run_once(&self) -> Result<RoundReport, sqlx::Error> {
        crate::store::within(self.prefix.as_ref(), async {
            in_round_span(self.round()).await
        })
        .await
    }

    /// One round's steps: lease (dead-lettering the abandoned rows), publish the leased rows in
    /// one sink call bounded by the lease, then mark each sent or failed.
    async fn round(&self) -> Result<RoundReport, sqlx::Error> {
        let mut conn = self.pool.acquire().await?;
        let lease_ms = i64::try_from(self.lease.as_millis()).unwrap_or(i64::MAX);
        let abandoned_error = format!(
            "the relay never finished publishing it: its lease ran out unmarked {} times (each \
             relay that leased it crashed, hung or was stopped before the sink answered)",
            self.max_attempts
        );
        let lease = conn
            .lease_outbox(
                i64::from(self.batch_size),
                lease_ms,
                self.max_attempts,
                &abandoned_error,
            )
            .await?;
        let leased_at = Instant::now();
        report_abandoned(&lease.abandoned, &abandoned_error);
        let records = lease.records;
        let mut report = RoundReport {
            leased: records.len(),
            abandoned: lease.abandoned.len(),
            ..RoundReport::default()
        };
        if records.is_empty() {
            return Ok(report);
        }
        let answered = publish_leased(
            self.sink.as_ref(),
            &records,
            self.lease,
            || self.lease,
            &mut report,
        );
        let Some(answered) = answered.await else {
            return Ok(report);
        };
        let leased = Leased {
            token: &lease.token,
            records: &records,
            spans: &answered.spans,
        };
        let since_lease = answered.confirmed_at.saturating_duration_since(leased_at);
        self.mark_sent(&mut conn, &leased, &answered.sent, since_lease, &mut report)
            .await?;
        for (index, error) in answered.failures {
            self.mark_failed(&mut conn, &leased, index, &error, &mut report)
                .await?;
        }
        Ok(report)
    }

    /// Marks the rows at `sent` (indices into the lease's records) sent, and reports each: the
    /// published ones, and those whose lease was lost.
    async fn mark_sent(
        &self,
        conn: &mut DB::Connection,
        leased: &Leased<'_>,
        sent: &[usize],
        since_lease: Duration,
        report: &mut RoundReport,
    ) -> Result<(), sqlx::Error> {
        let ids: Vec<i64> = sent.iter().map(|index| leased.records[*index].id).collect();
        let marked: BTreeSet<i64> = conn
            .mark_outbox_sent(&ids, leased.token)
            .await?
            .into_iter()
            .collect();
        for index in sent {
            let record = &leased.records[*index];
            let latency = record.age + since_lease;
            let span = &leased.spans[*index];
            report_marked_sent(record, span, marked.contains(&record.id), latency, report);
        }
        Ok(())
    }

    /// Records the failed publish of the lease's record at `index`, and reports it: retried,
    /// dead, or its lease lost.
    async fn mark_failed(
        &self,
        conn: &mut DB::Connection,
        leased: &Leased<'_>,
        index: usize,
        error: &SinkError,
        report: &mut RoundReport,
    ) -> Result<(), sqlx::Error> {
        let record = &leased.records[index];
        let span = &leased.spans[index];
        let text = error.to_string();
        let retry_in = self.backoff.retry_in(record.attempts);
        let status = conn
            .mark_outbox_failed(OutboxFailure {
                id: record.id,
                token: leased.token,
                error: &text,
                permanent: error.is_permanent(),
                max_attempts: self.max_attempts,
                retry_in_ms: i64::try_from(retry_in.as_millis()).unwrap_or(i64::MAX),
            })
            .await?;
        let dead = status.map(|status| status == OutboxStatus::Dead);
        report_marked_failed(record, span, dead, error, retry_in, report);
        Ok(())
    }

    /// Runs rounds until `shutdown` is cancelled (a round under way is finished first), then
    /// returns what it did. Rounds follow each other at once while they find rows; when idle
    /// the relay waits for a wake-up or the poll interval. A database error is logged, counted
    /// (`inbox_outbox_relay_errors_total`) and the round retried after the poll interval. The
    /// backlog gauges are refreshed as [`backlog_interval`](Self::backlog_interval) says.
    pub async fn run(self, shutdown: CancellationToken) -> RelayReport {
        let prefix = self.prefix.clone();
        crate::store::within(prefix.as_ref(), self.run_in_scope(shutdown)).await
    }

    /// [`run`](Self::run), in the relay's table prefix.
    async fn run_in_scope(self, shutdown: CancellationToken) -> RelayReport {
        let mut wakeups = DB::wakeups(&self.pool).await;
        let mut report = RelayReport::default();
        let mut gauged_at: Option<Instant> = None;
        let mut busy = false;
        while !shutdown.is_cancelled() {
            let was_busy = busy;
            busy = tally(&mut report, self.run_once().await, "outbox relay");
            let due = gauged_at.is_none_or(|at| at.elapsed() >= self.backlog_interval);
            if due || (was_busy && !busy) {
                gauged_at = Some(Instant::now());
                if let Err(error) = self.backlog().await {
                    tracing::debug!(%error, "outbox relay: backlog gauges not refreshed");
                }
            }
            if busy {
                continue;
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

    /// Reads the backlog per destination and sets the gauges `inbox_outbox_pending` and
    /// `inbox_outbox_oldest_pending_seconds` (label `destination`) to it; a destination this
    /// relay reported before and that has no pending row left is set to 0. [`run`](Self::run)
    /// calls it on its own; call it yourself to read the backlog.
    ///
    /// # Errors
    /// The database's error (the gauges keep their values).
    pub async fn backlog(&self) -> Result<Vec<OutboxBacklog>, sqlx::Error> {
        crate::store::within(self.prefix.as_ref(), async {
            let mut conn = self.pool.acquire().await?;
            let backlog = conn.outbox_backlog().await?;
            let mut gauged = self.gauged.lock().unwrap_or_else(|e| e.into_inner());
            for line in &backlog {
                let destination = line.destination.clone();
                metrics::gauge!("inbox_outbox_pending", "destination" => destination.clone())
                    .set(line.pending as f64);
                metrics::gauge!(
                    "inbox_outbox_oldest_pending_seconds",
                    "destination" => destination
                )
                .set(line.oldest_pending_secs);
            }
            let now: BTreeSet<String> = backlog.iter().map(|l| l.destination.clone()).collect();
            for gone in gauged.difference(&now) {
                metrics::gauge!("inbox_outbox_pending", "destination" => gone.clone()).set(0.0);
                metrics::gauge!("inbox_outbox_oldest_pending_seconds", "destination" => gone.clone())
                    .set(0.0);
            }
            *gauged = now;
            Ok(backlog)
        })
        .await
    }
}

/// A relay's backoff between a failed publish and the next attempt (SQL and DynamoDB relays).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Backoff {
    /// The wait before the second attempt.
    pub(crate) first: Duration,
    /// The longest wait, at least `first`.
    pub(crate) max: Duration,
}

impl Backoff {
    /// The relays' default: 1 s doubling to 5 min.
    pub(crate) const DEFAULT: Self = Self {
        first: Duration::from_secs(1),
        max: Duration::from_secs(300),
    };

    /// From `first` doubling to `max`: both lowered to [`MAX_BACKOFF`] if above it, then `max`
    /// raised to `first` if below it.
    pub(crate) fn new(first: Duration, max: Duration) -> Self {
        let first = first.min(MAX_BACKOFF);
        Self {
            first,
            max: max.min(MAX_BACKOFF).max(first),
        }
    }

    /// The wait after a message's `attempts`-th failed publish: `first` doubled per attempt
    /// after the first, at most `max`.
    pub(crate) fn retry_in(self, attempts: u32) -> Duration {
        let doublings = attempts.saturating_sub(1).min(30);
        self.first.saturating_mul(1u32 << doublings).min(self.max)
    }
}

/// Adds a relay's round to `report`: its counts, or, if it failed, an error (counted,
/// `inbox_outbox_relay_errors_total`, logged as the warning "`relay` round failed; retrying").
/// `true` if the round leased rows: there may be more, the next round follows at once. The tally
/// of every relay's `run` (SQL and DynamoDB).
pub(crate) fn tally(
    report: &mut RelayReport,
    round: Result<RoundReport, impl std::fmt::Display>,
    relay: &str,
) -> bool {
    match round {
        Ok(round) => {
            report.abandoned += round.abandoned as u64;
            report.timed_out += round.timed_out as u64;
            report.lease_lost += round.lease_lost as u64;
            if round.leased == 0 {
                return false;
            }
            report.rounds += 1;
            report.published += round.published as u64;
            report.failed += round.failed as u64;
            report.dead += round.dead as u64;
            true
        }
        Err(error) => {
            report.errors += 1;
            metrics::counter!("inbox_outbox_relay_errors_total").increment(1);
            tracing::warn!(%error, "{relay} round failed; retrying");
            false
        }
    }
}

/// A round's leased records once the sink answered ([`publish_leased`]).
pub(crate) struct Answered {
    /// Each record's span (`inbox.outbox.publish`), by index.
    pub(crate) spans: Vec<tracing::Span>,
    /// The indices of the records the sink accepted, ascending.
    pub(crate) sent: Vec<usize>,
    /// The records the sink refused, or whose stored headers do not parse, by index
    /// (ascending), with the error.
    pub(crate) failures: Vec<(usize, SinkError)>,
    /// When the sink answered.
    pub(crate) confirmed_at: Instant,
}

/// Publishes a round's leased `records` (leased for `lease`) in one sink call: each record in
/// its span ([`message_span`]), its message from [`outgoing`], the sink waited for at most
/// `wait()` (asked once there are messages; zero: no call). `None` if the sink did not answer
/// in time: the messages are reported timed out ([`report_timed_out`], `report.timed_out`) and
/// left unmarked, orphans whose next lease counts another attempt. The publish step of every
/// relay's round (SQL and DynamoDB); the marks are the relay's own.
pub(crate) async fn publish_leased(
    sink: &dyn Sink,
    records: &[OutboxRecord],
    lease: Duration,
    wait: impl FnOnce() -> Duration,
    report: &mut RoundReport,
) -> Option<Answered> {
    let spans: Vec<tracing::Span> = records.iter().map(|r| message_span(r, "")).collect();
    let (indices, messages, mut failures) = outgoing(records, &spans);
    let results = publish(sink, &messages, wait).await;
    let confirmed_at = Instant::now();
    let Some(results) = results else {
        // The lease ran out while the sink said nothing: stop waiting and leave the rows as
        // they are. They are orphans now; the next lease counts another attempt on each.
        let lease_ms = i64::try_from(lease.as_millis()).unwrap_or(i64::MAX);
        for index in &indices {
            report_timed_out(&records[*index], &spans[*index], lease_ms);
            report.timed_out += 1;
        }
        return None;
    };
    let mut sent = Vec::new();
    for (index, result) in indices.iter().zip(one_per_message(results, messages.len())) {
        match result {
            Ok(()) => sent.push(*index),
            Err(error) => failures.push((*index, error)),
        }
    }
    failures.sort_by_key(|(index, _)| *index);
    Some(Answered {
        spans,
        sent,
        failures,
        confirmed_at,
    })
}

/// Publishes `messages` in one sink call (span `inbox.outbox.sink`, its time in
/// `inbox_outbox_sink_batch_seconds`), waiting at most `wait()` (asked only if there are
/// messages): one result per message as the sink gave them, or `None` if it did not answer in
/// time or no time was left (`wait()` zero: no call). No messages: no call, no results.
async fn publish(
    sink: &dyn Sink,
    messages: &[OutgoingMessage],
    wait: impl FnOnce() -> Duration,
) -> Option<Vec<Result<(), SinkError>>> {
    if messages.is_empty() {
        return Some(Vec::new());
    }
    let wait = wait();
    if wait.is_zero() {
        return None;
    }
    let started = Instant::now();
    let publish = sink.publish_batch(messages).instrument(tracing::info_span!(
        "inbox.outbox.sink",
        messages = messages.len()
    ));
    let results = tokio::time::timeout(wait, publish).await.ok();
    metrics::histogram!("inbox_outbox_sink_batch_seconds").record(started.elapsed().as_secs_f64());
    results
}

/// Reports the mark of a publish the sink accepted: published if `marked` ([`report_sent`],
/// `latency` after the row's creation), else its lease lost ([`lease_lost`], mark `sent`).
pub(crate) fn report_marked_sent(
    record: &OutboxRecord,
    span: &tracing::Span,
    marked: bool,
    latency: Duration,
    report: &mut RoundReport,
) {
    if marked {
        report_sent(record, span, latency, report);
    } else {
        lease_lost(record, span, "sent", report);
    }
}

/// Reports the mark of a failed publish: `Some(dead)`, recorded `dead` or to be retried in
/// `retry_in` ([`report_failed`]); `None`, its lease lost ([`lease_lost`], mark `failed`).
pub(crate) fn report_marked_failed(
    record: &OutboxRecord,
    span: &tracing::Span,
    marked: Option<bool>,
    error: &SinkError,
    retry_in: Duration,
    report: &mut RoundReport,
) {
    match marked {
        Some(dead) => report_failed(record, span, dead, error, retry_in, report),
        None => lease_lost(record, span, "failed", report),
    }
}

/// What a round's marks need of its lease: the token, the records and their spans.
struct Leased<'a> {
    token: &'a str,
    records: &'a [OutboxRecord],
    spans: &'a [tracing::Span],
}

/// Reports a publish the sink accepted and that was marked sent, `latency` after the row's
/// creation: counted, `inbox_outbox_published_total` and `inbox_outbox_publish_latency_seconds`
/// (label `destination`), logged in the row's span (outcome `sent`).
fn report_sent(
    record: &OutboxRecord,
    span: &tracing::Span,
    latency: Duration,
    report: &mut RoundReport,
) {
    let destination = record.destination.clone();
    metrics::counter!("inbox_outbox_published_total", "destination" => destination.clone())
        .increment(1);
    metrics::histogram!(
        "inbox_outbox_publish_latency_seconds",
        "destination" => destination
    )
    .record(latency.as_secs_f64());
    span.record("outcome", "sent");
    span.in_scope(|| {
        tracing::debug!(
            latency_ms = latency.as_millis() as u64,
            "outbox message published"
        )
    });
    report.published += 1;
}

/// Reports a failed publish that was recorded: `dead` (counted in [`RoundReport::dead`],
/// `inbox_outbox_dead_total` with `reason` `permanent` or `exhausted`, logged as an error) or
/// to be retried in `retry_in` ([`RoundReport::failed`], `inbox_outbox_failed_total`, a
/// warning), in the row's span.
fn report_failed(
    record: &OutboxRecord,
    span: &tracing::Span,
    dead: bool,
    error: &SinkError,
    retry_in: Duration,
    report: &mut RoundReport,
) {
    let destination = record.destination.clone();
    let text = error.to_string();
    if dead {
        report.dead += 1;
        let reason = if error.is_permanent() {
            "permanent"
        } else {
            "exhausted"
        };
        metrics::counter!(
            "inbox_outbox_dead_total",
            "destination" => destination,
            "reason" => reason
        )
        .increment(1);
        span.record("outcome", "dead");
        span.in_scope(|| {
            tracing::error!(
                attempts = record.attempts,
                error = %text,
                "outbox message dead"
            )
        });
    } else {
        report.failed += 1;
        metrics::counter!("inbox_outbox_failed_total", "destination" => destination).increment(1);
        span.record("outcome", "failed");
        span.in_scope(|| {
            tracing::warn!(
                attempts = record.attempts,
                retry_in_ms = retry_in.as_millis() as u64,
                error = %text,
                "outbox publish failed; will retry"
            )
        });
    }
}

/// Reports a mark (`mark`: `sent` or `failed`) that changed nothing because the lease on
/// `record` was lost: counted, `inbox_outbox_lease_lost_total` (labels `destination`, `mark`),
/// logged as a warning in the row's span (outcome `lease_lost`).
fn lease_lost(
    record: &OutboxRecord,
    span: &tracing::Span,
    mark: &'static str,
    report: &mut RoundReport,
) {
    report.lease_lost += 1;
    metrics::counter!(
        "inbox_outbox_lease_lost_total",
        "destination" => record.destination.clone(),
        "mark" => mark
    )
    .increment(1);
    span.record("outcome", "lease_lost");
    span.in_scope(|| {
        tracing::warn!(
            attempts = record.attempts,
            mark,
            "outbox mark skipped: this relay's lease on the row was lost (its lease ran out and \
             another relay leased it again, or an operator retried or discarded it)"
        )
    });
}

/// Reports the rows a lease turned dead as abandoned (`error`: their last error):
/// `inbox_outbox_dead_total` (labels `destination`, `reason` `abandoned`), logged as an error in
/// each row's span (outcome `dead`).
pub(crate) fn report_abandoned(abandoned: &[OutboxRecord], error: &str) {
    for record in abandoned {
        metrics::counter!(
            "inbox_outbox_dead_total",
            "destination" => record.destination.clone(),
            "reason" => "abandoned"
        )
        .increment(1);
        message_span(record, "dead").in_scope(|| {
            tracing::error!(
                attempts = record.attempts,
                error = %error,
                "outbox message dead"
            )
        });
    }
}

/// Reports a row whose publish did not answer within the lease (`lease_ms`):
/// `inbox_outbox_timed_out_total` (label `destination`), logged as a warning in its span
/// (outcome `timed_out`).
fn report_timed_out(record: &OutboxRecord, span: &tracing::Span, lease_ms: i64) {
    metrics::counter!(
        "inbox_outbox_timed_out_total",
        "destination" => record.destination.clone()
    )
    .increment(1);
    span.record("outcome", "timed_out");
    span.in_scope(|| {
        tracing::warn!(
            attempts = record.attempts,
            lease_ms,
            "outbox publish did not answer within the lease; leaving it unmarked"
        )
    });
}

/// The sink's `results`, or, if it did not answer one per message (of `messages`), a retryable
/// error for each message.
fn one_per_message(
    results: Vec<Result<(), SinkError>>,
    messages: usize,
) -> Vec<Result<(), SinkError>> {
    if results.len() == messages {
        return results;
    }
    let text = format!(
        "the sink answered {} results for {} messages",
        results.len(),
        messages
    );
    (0..messages)
        .map(|_| Err(SinkError::retryable(text.clone())))
        .collect()
}

/// The span of one leased row (`outcome` recorded when known).
fn message_span(record: &OutboxRecord, outcome: &str) -> tracing::Span {
    let span = tracing::info_span!(
        "inbox.outbox.publish",
        message_id = %record.message_id,
        destination = %record.destination,
        message_name = %record.message_name,
        aggregate = record.aggregate_id.as_deref().unwrap_or(""),
        attempt = record.attempts,
        outcome = tracing::field::Empty,
    );
    if !outcome.is_empty() {
        span.record("outcome", outcome);
    }
    crate::trace::continue_stored(&span, record.trace_context.as_deref());
    span
}

/// The sink's messages for `records`, with their records' indices, and the records whose
/// stored headers do not parse (a damaged row: dead at once), by index. Each message's headers
/// carry the W3C Trace Context of its record's span in `spans` (feature `otel`, see
/// [`crate::trace`]).
fn outgoing(records: &[OutboxRecord], spans: &[tracing::Span]) -> Outgoing {
    let mut indices = Vec::with_capacity(records.len());
    let mut messages = Vec::with_capacity(records.len());
    let mut unreadable = Vec::new();
    for (index, record) in records.iter().enumerate() {
        match serde_json::from_str(&record.headers_json) {
            Ok(mut headers) => {
                crate::trace::inject_headers(&spans[index], &mut headers);
                indices.push(index);
                messages.push(OutgoingMessage {
                    message_id: record.message_id.clone(),
                    destination: record.destination.clone(),
                    message_name: record.message_name.clone(),
                    payload: record.payload.clone(),
                    headers,
                    aggregate_id: record.aggregate_id.clone(),
                    attempt: record.attempts,
                });
            }
            Err(error) => unreadable.push((
                index,
                SinkError::permanent(format!("stored headers are not a JSON object: {error}")),
            )),
        }
    }
    (indices, messages, unreadable)
}

/// [`outgoing`]'s answer: the records' indices and their messages, and the unreadable ones.
type Outgoing = (Vec<usize>, Vec<OutgoingMessage>, Vec<(usize, SinkError)>);
