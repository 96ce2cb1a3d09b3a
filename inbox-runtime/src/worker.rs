//! The worker: pulls deliveries from a [`Source`], dispatches them, settles each after commit.
//!
//! ```no_run
//! # async fn demo(pool: sqlx::PgPool) -> Result<(), Box<dyn std::error::Error>> {
//! use std::time::Duration;
//! use inbox_runtime::{Dispatcher, Worker};
//! use inbox_runtime::source::file::FileSource;
//!
//! inbox_runtime::migrate(&pool).await?;
//! let worker = Worker::new(Dispatcher::from_registry(pool)?)
//!     .concurrency(8)
//!     .requeue_delay(Duration::from_secs(1));
//! let shutdown = inbox_runtime::cancel_on_signal()?; // SIGINT / SIGTERM
//! let report = worker.run(FileSource::open("events.jsonl").await?, shutdown).await?;
//! println!("processed {} messages", report.processed);
//! # Ok(()) }
//! ```

use std::collections::{HashMap, HashSet, VecDeque};
use std::panic::AssertUnwindSafe;
use std::sync::Arc;
use std::time::Duration;

use futures_util::FutureExt as _;
use futures_util::StreamExt as _;
use futures_util::stream::FuturesUnordered;

use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use crate::dispatcher::{ConsumerOutcome, Dispatcher};
use crate::error::{DispatchError, Disposition, Error};
use crate::outcome::Outcome;
use crate::slot::ConnectionSlot;
use crate::source::{Delivery, Settlement, Source, SourceError};
use crate::store::InboxDatabase;

/// The settlement policy: how the dispatcher's result for one delivery settles it.
///
/// * every consumer's outcome is [`Outcome::Processed`], [`Outcome::Duplicate`],
///   [`Outcome::Dead`], [`Outcome::Discarded`], [`Outcome::Stale`] or [`Outcome::Parked`] (all
///   settled in the inbox), or a handler failure recorded as dead
///   ([`Disposition::Dead`]: the payload is kept in the inbox) → [`Settlement::Ack`]: the
///   transactions have committed;
/// * a [`DispatchError`] (unknown message, malformed payload, bad key — permanent, nothing
///   written), or a consumer's [`Error::Conflict`], [`Error::Key`] or [`Error::Fingerprint`] →
///   [`Settlement::Reject`]: nack without requeue. (The [`Worker`] first keeps a refused
///   delivery in `inbox_rejections`, payload included, and acks it when that succeeded, or
///   requeues it after `requeue_delay` when it could not be kept: never rejected unkept;
///   conflicts are kept there by the dispatcher itself.)
/// * a handler failure to retry ([`Disposition::Retry`]) → [`Settlement::Requeue`] after its
///   `after` delay; any other handler failure, a database error, or an outcome this policy does
///   not know → [`Settlement::Requeue`] after `requeue_delay`. The failed consumer's transaction
///   rolled back; on the redelivery the consumers that did commit see a duplicate.
///
/// Requeue wins over reject, reject over ack; of several requeue delays the longest is used.
pub fn settlement_for(
    result: &Result<Vec<ConsumerOutcome>, DispatchError>,
    requeue_delay: Duration,
) -> Settlement {
    let outcomes = match result {
        Ok(outcomes) => outcomes,
        Err(_) => return Settlement::Reject,
    };
    let mut reject = false;
    let mut requeue: Option<Duration> = None;
    for outcome in outcomes {
        match &outcome.result {
            Ok(
                Outcome::Processed(())
                | Outcome::Duplicate
                | Outcome::Dead
                | Outcome::Discarded
                | Outcome::Stale
                | Outcome::Parked,
            ) => {}
            Err(Error::Handler(failure)) if failure.disposition.is_settled() => {}
            Ok(Outcome::NotYet { retry_in }) => {
                requeue = Some(requeue.map_or(*retry_in, |d| d.max(*retry_in)));
            }
            Err(Error::Conflict(_) | Error::Key(_) | Error::Fingerprint(_)) => reject = true,
            Err(Error::Handler(failure)) => {
                let delay = match failure.disposition {
                    Disposition::Retry { after } => after,
                    _ => requeue_delay,
                };
                requeue = Some(requeue.map_or(delay, |d| d.max(delay)));
            }
            // Database errors, and outcomes added later until they are known here.
            _ => requeue = Some(requeue.map_or(requeue_delay, |d| d.max(requeue_delay))),
        }
    }
    match (requeue, reject) {
        (Some(delay), _) => Settlement::Requeue { delay: Some(delay) },
        (None, true) => Settlement::Reject,
        (None, false) => Settlement::Ack,
    }
}

/// Why [`Worker::run`] returned.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum StopReason {
    /// The source said no delivery will come again, and every one was settled.
    SourceExhausted,
    /// Nothing arrived for the idle time set with [`Worker::stop_when_idle`], with nothing in
    /// flight.
    Idle,
    /// The shutdown token was cancelled (SIGINT/SIGTERM with [`cancel_on_signal`]).
    Shutdown,
    /// The source failed; the error is in [`WorkerError`].
    SourceFailed,
}

/// What one [`Worker::run`] did. Consumer counts are per consumer outcome (a message routed to
/// two consumers counts twice); delivery counts are per delivery.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct WorkerReport {
    /// Deliveries fetched from the source (redeliveries included).
    pub deliveries: u64,
    /// Consumer outcomes [`Outcome::Processed`]: effects committed by this run.
    pub processed: u64,
    /// Consumer outcomes [`Outcome::Duplicate`].
    pub duplicates: u64,
    /// Consumer outcomes [`Outcome::Stale`] (ordering: older than the aggregate's state).
    pub stale: u64,
    /// Consumer outcomes [`Outcome::Parked`] (ordering: held until their gap fills).
    pub parked: u64,
    /// Consumer outcomes [`Outcome::NotYet`]: a failed key redelivered before its next attempt
    /// was due (requeued with the time left).
    pub not_yet: u64,
    /// Consumer results [`Error::Conflict`].
    pub conflicts: u64,
    /// Deliveries the dispatcher refused ([`DispatchError`]: unknown message, malformed payload,
    /// bad key), plus consumer key or fingerprint errors.
    pub invalid: u64,
    /// Consumer outcomes [`Outcome::Dead`] (dead-lettered earlier), and handler failures
    /// recorded as dead now: acked, the payload kept in the inbox.
    pub dead: u64,
    /// Consumer outcomes [`Outcome::Discarded`]: keys an operator discarded, acked, not run.
    pub discarded: u64,
    /// Consumer handler failures to retry, database errors (and unknown outcomes): requeued.
    pub failed: u64,
    /// Deliveries acked.
    pub acked: u64,
    /// Deliveries rejected (nacked without requeue).
    pub rejected: u64,
    /// Deliveries requeued: after a failure, or because shutdown came before they started.
    pub requeued: u64,
    /// Deliveries dropped unsettled: still running when the drain timeout passed, or whose task
    /// panicked. The source redelivers them.
    pub abandoned: u64,
    /// Settlements the source could not carry out (the broker redelivers those messages).
    pub settle_errors: u64,
    /// Deliveries dropped unsettled because a hook fenced their transaction
    /// ([`Fenced`](crate::Fenced): their partition belongs to another consumer now): rolled
    /// back, nothing recorded, not acked; the partition's new owner processes them.
    pub fenced: u64,
    /// Deliveries dropped unsettled before they ran because their source gave them up
    /// ([`Delivery::is_current`] false: a Kafka partition revoked since they were fetched).
    pub revoked: u64,
    /// Batches that lost to concurrent transactions (a deadlock, a serialization failure, a
    /// lock wait that timed out) and therefore ran again alone, or (losing again) one delivery
    /// per transaction (see [`Worker::batch`]); each such batch also made the worker run one
    /// batch at a time for a while. Each lost run is also counted in the
    /// `inbox_batch_contention_total` counter.
    pub contention_fallbacks: u64,
    /// Batch transactions run (two or more deliveries in one transaction, see
    /// [`Worker::batch_size`]); a batch that lost to concurrent transactions and ran again
    /// counts once.
    pub batches: u64,
    /// Deliveries run in those batches; the other deliveries that ran, ran one per transaction.
    pub batched: u64,
    /// Why the run ended.
    pub stop: StopReason,
}

impl Default for WorkerReport {
    fn default() -> Self {
        Self {
            deliveries: 0,
            stale: 0,
            parked: 0,
            not_yet: 0,
            processed: 0,
            duplicates: 0,
            conflicts: 0,
            invalid: 0,
            dead: 0,
            discarded: 0,
            failed: 0,
            acked: 0,
            rejected: 0,
            requeued: 0,
            abandoned: 0,
            settle_errors: 0,
            fenced: 0,
            revoked: 0,
            contention_fallbacks: 0,
            batches: 0,
            batched: 0,
            stop: StopReason::SourceExhausted,
        }
    }
}

/// The source failed, so the worker stopped (after finishing its in-flight work).
#[derive(Debug, thiserror::Error)]
#[error("worker stopped: {error}")]
pub struct WorkerError {
    /// The source's error.
    #[source]
    pub error: SourceError,
    /// What the run did until then (`stop` is [`StopReason::SourceFailed`]).
    pub report: WorkerReport,
}

/// Pulls deliveries from a [`Source`], runs the [`Dispatcher`] on each with bounded
/// concurrency, and settles each delivery strictly **after** its inbox transactions committed,
/// as [`settlement_for`] says.
///
/// * **Concurrency**: at most [`concurrency`](Self::concurrency) transactions run at any time
///   (each one delivery, or one batch); without batching at most that many deliveries are
///   fetched and not yet settled, with batches of `size` at most `(concurrency + 1) × size`
///   (size the database pool and the broker's prefetch to it).
/// * **Connections**: while deliveries keep coming, the worker keeps up to
///   `min(concurrency, max_connections − 1)` pooled connections across them
///   ([`ConnectionSlot`]s), so that sqlx's pool round trips are not paid per message. A kept
///   connection goes back to the pool when it has been unused for 1 s, and at once when a
///   delivery without one is running (it may be waiting for a connection), so that neither
///   deliveries beyond the kept ones nor other users of the pool (the parked-message sweep,
///   another worker) wait for a connection the worker is not using. A pool of
///   `concurrency + 1` connections lets every delivery keep its connection.
/// * **Tasks**: the deliveries in flight are polled on the task that runs [`run`](Self::run)
///   (no Tokio task per delivery: no spawn, no hand-over between threads per delivery), so
///   handlers share that task: keep CPU-heavy or blocking work out of them
///   ([`tokio::task::spawn_blocking`]), and run several workers to use several cores for the
///   handlers' own work. Await `run` inside a spawned task (`tokio::spawn`), not directly in
///   `#[tokio::main]`'s `block_on`: there every I/O wake-up of a delivery has to wake the main
///   thread (measured: ~5.6 futex calls per delivery at concurrency 1 on `block_on`'s thread,
///   under 1 in a spawned task).
/// * **Batches** (on by default, see [`batch_size`](Self::batch_size); off with
///   [`one_per_transaction`](Self::one_per_transaction)): deliveries that are ready together
///   run in one transaction (up to 100), each settled after its commit by its own outcome; one
///   delivery ready alone runs alone, with no wait. A batch
///   that loses to concurrent transactions (a deadlock) runs again alone (or, losing again,
///   one delivery per transaction), and the worker then runs one batch at a time for a while.
/// * **Order**: deliveries with the same [ordering key](Delivery::ordering_key) run one at a
///   time, in the order the source handed them out. A requeued delivery comes back when the
///   source redelivers it, possibly after later ones of its key.
/// * **Shutdown**: when the token is cancelled the worker stops fetching, requeues deliveries
///   that have not started, lets running ones finish (commit, then ack) for up to the
///   [drain timeout](Self::drain_timeout), then drops the rest unsettled (their transactions roll
///   back; the broker redelivers them), calls [`Source::close`] and returns.
/// * **Source failure**: the worker stops fetching and lets running and queued deliveries finish,
///   also for up to the drain timeout from the failure (a settlement on a connection that just
///   died may never answer), then drops the rest unsettled as on shutdown and returns the error.
///   [`Source::close`] gets the drain timeout too; past it, `run` returns a `close` error.
#[derive(Debug)]
pub struct Worker<DB: InboxDatabase> {
    dispatcher: Arc<Dispatcher<DB>>,
    concurrency: usize,
    requeue_delay: Duration,
    drain_timeout: Duration,
    idle: Option<Duration>,
    park_sweep: Option<Duration>,
    /// The most deliveries one transaction runs (1: one per transaction).
    batch_size: usize,
    /// How long a batch that has not filled may wait for more deliveries (zero: it starts with
    /// whatever is ready).
    linger: Duration,
}

/// The default [`Worker::batch_size`]: at most this many ready deliveries per transaction.
pub const DEFAULT_BATCH_SIZE: usize = 100;

/// `at + after`, or a year after `at` if that overflows (`Duration::MAX` means "never").
fn later(at: Instant, after: Duration) -> Instant {
    at.checked_add(after)
        .unwrap_or_else(|| at + Duration::from_secs(86_400 * 365))
}

/// How long a kept connection may go unused before the worker gives it back to the pool.
const SLOT_IDLE: Duration = Duration::from_secs(1);

/// A finished task.
struct Done<DB: InboxDatabase> {
    /// The task's connection slot, back for the next delivery (if it may be kept).
    slot: Option<ConnectionSlot<DB>>,
    /// Whether its batch lost to concurrent transactions (its deliveries then ran alone).
    contended: bool,
}

/// The `lock_timeout` of a batch started while other batches run (PostgreSQL): a batch that
/// waits this long for a row lock is most likely in a deadlock with another batch, which the
/// server would only find after its `deadlock_timeout` (1 s by default). It gives up, and its
/// deliveries run one per transaction (without this timeout).
const BATCH_LOCK_TIMEOUT: Duration = Duration::from_millis(30);

/// Clean batches before one more batch may run beside the others, until a batch first lost
/// to concurrent transactions: the worker starts with one batch in flight and ramps up.
const RAMP_BATCHES: usize = 4;
/// Clean batches the worker runs one at a time after the first contention, before it lets one
/// more batch run beside them; four times as many after every further contention (up to
/// [`CALM_BATCHES_MAX`]).
const CALM_BATCHES: usize = 64;
/// The most clean batches [`CALM_BATCHES`] grows to.
const CALM_BATCHES_MAX: usize = 4096;

/// What a task has settled so far (read even if the task is aborted or panics).
#[derive(Default)]
struct Progress {
    report: WorkerReport,
    /// Deliveries settled, or abandoned by a panicking handler.
    done: usize,
}

type SharedProgress = Arc<std::sync::Mutex<Progress>>;

/// What the worker knows of a running task.
struct TaskMeta {
    /// The deliveries it settles.
    deliveries: usize,
    /// How far it got.
    progress: SharedProgress,
    /// Their ordering keys (busy until the task ends).
    keys: Vec<String>,
    /// Whether it took one of the kept connection slots.
    kept: bool,
    /// Whether it runs a batch (more than one delivery in one transaction).
    batch: bool,
}

/// A running task: one delivery or one batch, polled on the worker's own task (no Tokio task
/// per delivery: no spawn, no hand-over between threads, no join wake-up). It ends with its id
/// and its [`Done`], or the panic that escaped it (handlers' own panics are caught inside).
type TaskFuture<DB> = crate::BoxFuture<'static, (u64, std::thread::Result<Done<DB>>)>;

/// The running tasks, polled together on the worker's task.
///
/// A [`FuturesUnordered`] that polled all of its futures in one call wakes its own task before
/// returning (to yield to the executor), which with one delivery in flight would be after
/// every poll: a spurious wake-up per I/O event, which Tokio's scheduler answers by waking
/// another worker thread. One future that never completes (and, never woken, is polled only
/// once) keeps that from happening while fewer than 32 futures are woken at once.
struct Tasks<DB: InboxDatabase> {
    set: FuturesUnordered<TaskFuture<DB>>,
}

impl<DB: InboxDatabase> Tasks<DB> {
    fn new() -> Self {
        let set = FuturesUnordered::new();
        set.push(Box::pin(std::future::pending()) as TaskFuture<DB>);
        Self { set }
    }

    /// Running tasks.
    fn len(&self) -> usize {
        self.set.len() - 1
    }

    fn is_empty(&self) -> bool {
        self.len() == 0
    }

    fn push(&self, task: TaskFuture<DB>) {
        self.set.push(task);
    }

    /// The next task to end (pending while none runs).
    async fn next(&mut self) -> (u64, std::thread::Result<Done<DB>>) {
        match self.set.next().await {
            Some(done) => done,
            None => std::future::pending().await,
        }
    }

    /// Drops every running task.
    fn clear(&mut self) {
        *self = Self::new();
    }
}

/// The worker's running tasks, its kept connection slots and the batch being gathered.
struct Running<DB: InboxDatabase> {
    tasks: Tasks<DB>,
    meta: HashMap<u64, TaskMeta>,
    /// The id of the next task.
    next_id: u64,
    slots: Vec<ConnectionSlot<DB>>,
    /// Deliveries ready to run in a batch (batches take up to the batch size from the front).
    batch: Vec<Delivery>,
    /// When the first delivery of `batch` arrived (or the previous batch took the ones before).
    batch_since: Option<Instant>,
    /// Batches running now.
    batches: usize,
    /// How many batches may run at once: 1 at first, up by one after every `calm_needed` clean
    /// batches up to the concurrency, back to 1 after a batch lost to concurrent transactions.
    batch_limit: usize,
    /// Clean batches since the limit last changed.
    calm: usize,
    /// Clean batches needed before the limit goes up by one.
    calm_needed: usize,
    /// The batches' gate (see [`crate::batch::BatchOptions::gate`]).
    gate: Arc<tokio::sync::RwLock<()>>,
    /// Batches started, and the deliveries in them (for the report).
    batch_runs: u64,
    batched: u64,
}

impl<DB: InboxDatabase> Running<DB> {
    /// Starts `delivery`: at once, or (when batching) among the deliveries ready for a batch,
    /// which starts when it is full, or on [`flush`](Self::flush).
    fn start(&mut self, worker: &Worker<DB>, delivery: Delivery) {
        match worker.batching() {
            Some(_) => {
                self.batch_since.get_or_insert_with(Instant::now);
                self.batch.push(delivery);
                self.flush_full(worker);
            }
            None => self.spawn(worker, vec![delivery]),
        }
    }

    /// Whether one more transaction (a batch) may start now: fewer than `concurrency`
    /// transactions and fewer than the batch limit's batches run.
    fn can_start_batch(&self, worker: &Worker<DB>) -> bool {
        self.tasks.len() < worker.concurrency && self.batches < self.batch_limit
    }

    /// Starts full batches while they may start.
    fn flush_full(&mut self, worker: &Worker<DB>) {
        let Some((size, _)) = worker.batching() else {
            return;
        };
        while self.batch.len() >= size && self.can_start_batch(worker) {
            self.flush(worker);
        }
    }

    /// Starts a batch of the ready deliveries (up to the batch size), if any.
    fn flush(&mut self, worker: &Worker<DB>) {
        let size = worker.batch_size;
        let rest = if self.batch.len() > size {
            self.batch.split_off(size)
        } else {
            Vec::new()
        };
        let batch = std::mem::replace(&mut self.batch, rest);
        self.batch_since = (!self.batch.is_empty()).then(Instant::now);
        if !batch.is_empty() {
            self.spawn(worker, batch);
        }
    }

    /// A batch ended: whether it lost to concurrent transactions adapts the batch limit.
    fn batch_ended(&mut self, worker: &Worker<DB>, contended: bool) {
        self.batches = self.batches.saturating_sub(1);
        if contended {
            if self.batch_limit > 1 {
                tracing::info!(
                    was = self.batch_limit,
                    calm_batches = self.calm_needed,
                    "a batch lost to concurrent transactions; running one batch at a time for a while"
                );
            }
            self.calm_needed = if self.batch_limit > 1 || self.calm_needed < CALM_BATCHES {
                (self.calm_needed * 4).clamp(CALM_BATCHES, CALM_BATCHES_MAX)
            } else {
                self.calm_needed
            };
            self.batch_limit = 1;
            self.calm = 0;
        } else if self.batch_limit < worker.concurrency {
            self.calm += 1;
            if self.calm >= self.calm_needed {
                self.batch_limit += 1;
                self.calm = 0;
            }
        }
    }

    /// Runs `deliveries` (one, or a batch) in a task, on a kept slot if one is free.
    fn spawn(&mut self, worker: &Worker<DB>, deliveries: Vec<Delivery>) {
        let dispatcher = Arc::clone(&worker.dispatcher);
        let requeue_delay = worker.requeue_delay;
        let is_batch = deliveries.len() > 1;
        // A batch that starts while others run may be in a deadlock with them: it waits for
        // a lock at most `BATCH_LOCK_TIMEOUT`.
        // Only a batch uses the options (a single delivery runs `dispatch_on`).
        let options = crate::batch::BatchOptions {
            lock_timeout: (is_batch && self.batches > 0).then_some(BATCH_LOCK_TIMEOUT),
            gate: is_batch.then(|| Arc::clone(&self.gate)),
        };
        if is_batch {
            self.batches += 1;
            self.batch_runs += 1;
            self.batched += deliveries.len() as u64;
        }
        let kept = self.slots.pop();
        let progress = SharedProgress::default();
        let meta = TaskMeta {
            deliveries: deliveries.len(),
            progress: Arc::clone(&progress),
            keys: deliveries
                .iter()
                .filter_map(|d| d.ordering_key().map(str::to_owned))
                .collect(),
            kept: kept.is_some(),
            batch: is_batch,
        };
        let keep = meta.kept;
        let id = self.next_id;
        self.next_id += 1;
        let task = async move {
            // A task without a kept slot uses a connection for itself only.
            let mut slot = kept.unwrap_or_default();
            let contended = process(
                &dispatcher,
                &mut slot,
                deliveries,
                requeue_delay,
                options,
                &progress,
            )
            .await;
            Done {
                slot: keep.then_some(slot),
                contended,
            }
        };
        self.meta.insert(id, meta);
        self.tasks.push(Box::pin(
            AssertUnwindSafe(task)
                .catch_unwind()
                .map(move |done| (id, done)),
        ));
    }

    /// Adds what a finished, aborted or panicked task settled to `report`; the deliveries it
    /// did not settle count as abandoned (dropped unsettled: the source delivers them again).
    fn account(meta: &TaskMeta, report: &mut WorkerReport) {
        let progress = meta
            .progress
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        add(report, &progress.report);
        report.abandoned += meta.deliveries.saturating_sub(progress.done) as u64;
    }

    /// Running tasks that took a kept slot.
    fn kept_running(&self) -> usize {
        self.meta.values().filter(|meta| meta.kept).count()
    }
}

impl<DB: InboxDatabase> Worker<DB> {
    /// A worker over `dispatcher`: concurrency 8, batches of up to [`DEFAULT_BATCH_SIZE`] (100)
    /// ready deliveries with no wait for more (see [`batch_size`](Self::batch_size)), requeue
    /// delay 1 s, drain timeout 30 s, no idle stop.
    pub fn new(dispatcher: Dispatcher<DB>) -> Self {
        Self::from_arc(Arc::new(dispatcher))
    }

    /// A worker over a shared dispatcher.
    pub fn from_arc(dispatcher: Arc<Dispatcher<DB>>) -> Self {
        Self {
            dispatcher,
            concurrency: 8,
            requeue_delay: Duration::from_secs(1),
            drain_timeout: Duration::from_secs(30),
            idle: None,
            park_sweep: Some(Duration::from_secs(60)),
            batch_size: DEFAULT_BATCH_SIZE,
            linger: Duration::ZERO,
        }
    }

    /// Batch size and linger, if batching (a batch size of 2 or more).
    fn batching(&self) -> Option<(usize, Duration)> {
        (self.batch_size >= 2).then_some((self.batch_size, self.linger))
    }

    /// At most `n` deliveries per transaction (at least 1; default [`DEFAULT_BATCH_SIZE`],
    /// 100): the deliveries that are **ready together** run as one batch transaction
    /// ([`Dispatcher::dispatch_batch_on`]), without waiting for more when there are none. A
    /// delivery that is ready alone runs alone, on the one-message path
    /// ([`Dispatcher::dispatch_on`]), with no added latency; a backlog runs in batches of up to
    /// `n`. `n = 1` runs one delivery per transaction (as [`one_per_transaction`](Self::one_per_transaction)).
    /// To wait a few milliseconds for a batch to fill, see [`batch`](Self::batch).
    ///
    /// **The trade-off.** A batch commits once for all its deliveries, so a backlog costs far
    /// fewer round trips and commits. In exchange, a handler that fails in a batch costs its
    /// neighbours their transaction, not their effects: the batch runs again with each handler
    /// isolated by a savepoint, and the handlers that ran before the failure run once more
    /// (their database writes were rolled back; effects outside the database happen twice, as
    /// on any retry). A batch that loses to concurrent transactions (a deadlock) runs again
    /// alone, or one delivery per transaction (see [`batch`](Self::batch)). Deliveries the batch
    /// path cannot run inside the batch — per-aggregate ordering, a key repeated in the batch,
    /// a key found `failed`, transient failures — take the one-message path after the batch
    /// commits; deliveries of one source ordering key never share a batch. Handlers that need
    /// their own transaction (their own timing of locks and commit) should use
    /// [`one_per_transaction`](Self::one_per_transaction).
    ///
    /// `n` bounds one transaction; [`concurrency`](Self::concurrency) bounds how many
    /// transactions run at once: up to `concurrency × n` deliveries run, and
    /// `(concurrency + 1) × n` are fetched and not yet settled (size the broker's prefetch to
    /// it).
    pub fn batch_size(mut self, n: usize) -> Self {
        self.batch_size = n.max(1);
        self.linger = Duration::ZERO;
        self
    }

    /// One delivery per transaction: no batches (the same as [`batch_size(1)`](Self::batch_size)).
    /// Every delivery runs [`Dispatcher::dispatch_on`] in its own transaction and is settled
    /// after it commits; at most [`concurrency`](Self::concurrency) deliveries are fetched and
    /// not yet settled. Use it for handlers that need their own transaction timing, or to keep
    /// a failing handler from re-running its neighbours' transaction.
    pub fn one_per_transaction(self) -> Self {
        self.batch_size(1)
    }

    /// Processes deliveries in batches of at most `size` deliveries, each batch in **one**
    /// transaction ([`Dispatcher::dispatch_batch_on`]: one multi-row claim, the handlers, one
    /// commit), each delivery settled after that commit by its own outcome, as
    /// [`settlement_for`] says. A batch starts when `size` deliveries are ready, `max_wait`
    /// after its first one arrived, or as soon as no more can be fetched (shutdown, source
    /// failed, `(concurrency + 1) × size` deliveries fetched and not settled) — each time only
    /// while fewer than [`concurrency`](Self::concurrency) transactions run. Deliveries of one
    /// ordering key are never in the same batch (the next waits for the batch to end).
    ///
    /// The two knobs are separate: `size` bounds what one transaction holds, `concurrency`
    /// how many transactions (batches) run at once; `concurrency(4).batch(100, …)` runs up to
    /// four batches of up to 100. `size` below 2 turns batching off (one delivery per
    /// transaction, as [`one_per_transaction`](Self::one_per_transaction)); `max_wait` zero is
    /// the default batching ([`batch_size`](Self::batch_size): what is ready, no wait).
    ///
    /// **Contention.** Batches hold their effects' row locks until their one commit, and take
    /// them in the order of their handlers' effects, which the runtime cannot sort: concurrent
    /// batches that touch the same rows in different orders deadlock. So a batch that loses a
    /// deadlock, a serialization failure or a lock wait is never run again against the same
    /// competitors: it runs once more **alone** (after the batches in flight with it have
    /// ended, none started beside it), and if it loses even then (to transactions outside the
    /// worker), its deliveries run one per transaction; counted in
    /// [`WorkerReport::contention_fallbacks`]. A batch started while others run waits at most
    /// 30 ms for a lock on PostgreSQL (instead of the server's 1 s `deadlock_timeout` before a
    /// deadlock is found). The worker starts with one batch in flight and lets one more run
    /// beside them after every 4 clean batches, up to `concurrency`; after a fallback it runs
    /// **one batch at a time** again, letting one more run beside it after 64 clean batches
    /// (256, 1024, … after further fallbacks). A stream whose effects contend thus runs about as fast as one batch in
    /// flight; partition it by what the effects lock to run batches side by side. A fallback
    /// costs the batch's neighbours their transaction, not their effects: the handlers that ran
    /// before the failure run again (their writes were rolled back), each effect commits once.
    ///
    /// `max_wait` is latency every delivery of a batch that does not fill may pay: keep it to
    /// milliseconds. A batch that cannot fill — the source has nothing more for now, or the
    /// deliveries still to come share ordering keys with it — starts when `max_wait` is up.
    /// A handler that panics rolls its batch back; the batch's deliveries then run one by one
    /// (the panicking one is dropped unsettled, for the source to deliver again).
    pub fn batch(mut self, size: usize, max_wait: Duration) -> Self {
        self.batch_size = size.max(1);
        self.linger = max_wait;
        self
    }

    /// How often, while running, the worker calls [`Dispatcher::sweep_parked`] (parked
    /// messages whose gap stayed open past the dispatcher's [`crate::ParkPolicy`] are
    /// dead-lettered or released). Default every 60 s; `None` turns it off.
    pub fn park_sweep(mut self, every: Option<Duration>) -> Self {
        self.park_sweep = every;
        self
    }

    /// At most `n` transactions in flight at once, each one delivery or (with
    /// [`batch`](Self::batch)) one batch; at least 1. Default 8. Without batching that is also
    /// the bound on deliveries fetched and not yet settled; with batches of `size`, at most
    /// `(n + 1) × size` deliveries are.
    pub fn concurrency(mut self, n: usize) -> Self {
        self.concurrency = n.max(1);
        self
    }

    /// How long a failed delivery waits before its redelivery (see [`Settlement::Requeue`]).
    pub fn requeue_delay(mut self, delay: Duration) -> Self {
        self.requeue_delay = delay;
        self
    }

    /// On shutdown, or after the source failed, how long running deliveries may take to finish
    /// before they are abandoned unsettled (default 30 s).
    pub fn drain_timeout(mut self, timeout: Duration) -> Self {
        self.drain_timeout = timeout;
        self
    }

    /// Stop (with [`StopReason::Idle`]) once nothing is in flight and the source has delivered
    /// nothing for `idle`: for batch jobs that drain a queue and exit.
    pub fn stop_when_idle(mut self, idle: Duration) -> Self {
        self.idle = Some(idle);
        self
    }

    /// The dispatcher.
    pub fn dispatcher(&self) -> &Dispatcher<DB> {
        &self.dispatcher
    }

    /// Runs until the source is exhausted, the worker is idle (if set), `shutdown` is
    /// cancelled, or the source fails; then closes the source.
    ///
    /// # Errors
    /// [`WorkerError`] if fetching from the source failed (in-flight work is finished first, for
    /// up to the [drain timeout](Self::drain_timeout)), or closing it did.
    pub async fn run<S: Source>(
        &self,
        mut source: S,
        shutdown: CancellationToken,
    ) -> Result<WorkerReport, WorkerError> {
        let mut report = WorkerReport::default();
        // Connection slots kept across deliveries (each holds one pooled connection once used):
        // at most `concurrency`, and at least one connection of the pool is never kept, so that
        // a delivery without a kept slot, the parked-message sweep and other users of the pool
        // always get one.
        // A slot gives its connection back to the pool when a delivery without a kept slot is
        // running (it may be waiting for one), and after `SLOT_IDLE` unused (so that an idle
        // worker does not sit on connections that another user of the pool needs).
        let max_connections = self.dispatcher.pool().options().get_max_connections() as usize;
        let mut running = Running {
            tasks: Tasks::new(),
            meta: HashMap::new(),
            next_id: 0,
            slots: (0..self.concurrency.min(max_connections.saturating_sub(1)))
                .map(|_| ConnectionSlot::new())
                .collect(),
            batch: Vec::new(),
            batch_since: None,
            batches: 0,
            batch_limit: 1,
            calm: 0,
            calm_needed: RAMP_BATCHES,
            gate: Arc::default(),
            batch_runs: 0,
            batched: 0,
        };
        // Deliveries fetched and not yet settled: one per transaction in flight, or (batching)
        // full batches in flight and one more batch ready.
        let fetch_bound = match self.batching() {
            Some((size, _)) => self.concurrency.saturating_add(1).saturating_mul(size),
            None => self.concurrency,
        };
        // Deliveries waiting for an earlier one of their ordering key; and the busy keys.
        let mut waiting: HashMap<String, VecDeque<Delivery>> = HashMap::new();
        let mut busy: HashSet<String> = HashSet::new();
        let mut in_flight = 0_usize;
        let mut stop: Option<StopReason> = None;
        let mut failure: Option<SourceError> = None;
        let mut drain_deadline: Option<Instant> = None;
        // After a source failure: when running deliveries are abandoned (shutdown's deadline, if
        // earlier, wins).
        let mut failed_deadline: Option<Instant> = None;
        let mut last_activity = Instant::now();
        let far = Duration::from_secs(86_400 * 365);
        let cancelled = shutdown.cancelled();
        tokio::pin!(cancelled);
        let release_timer = tokio::time::sleep_until(Instant::now());
        tokio::pin!(release_timer);
        let mut release_armed = false;
        // The parked-message sweep runs beside the loop and stops with it.
        let sweeping = CancellationToken::new();
        let _stop_sweeping = sweeping.clone().drop_guard();
        if let Some(every) = self.park_sweep {
            let dispatcher = self.dispatcher.clone();
            tokio::spawn(async move {
                loop {
                    tokio::select! {
                        () = sweeping.cancelled() => break,
                        () = tokio::time::sleep(every) => {}
                    }
                    match dispatcher.sweep_parked().await {
                        Ok(report) if report.dead_lettered + report.released > 0 => tracing::warn!(
                            dead_lettered = report.dead_lettered,
                            released = report.released,
                            "parked messages whose gap stayed open"
                        ),
                        Ok(_) => {}
                        Err(error) => tracing::warn!(%error, "parked-message sweep failed"),
                    }
                }
            });
        }

        loop {
            // Full batches start while they may; the ready deliveries start (as batches of
            // whatever is there) once nothing more can join them.
            running.flush_full(self);
            if stop.is_some() || in_flight >= fetch_bound {
                while !running.batch.is_empty() && running.can_start_batch(self) {
                    running.flush(self);
                }
            }
            let can_batch = running.can_start_batch(self);
            if stop.is_some() && running.tasks.is_empty() {
                break;
            }
            let batch_at = running
                .batch_since
                .zip(self.batching())
                .map(|(since, (_, max_wait))| later(since, max_wait));
            // The next time a kept slot's connection has been unused for `SLOT_IDLE`: one timer,
            // armed at most once per `SLOT_IDLE` (not a timer per delivery); firing early only
            // re-checks.
            if !release_armed
                && let Some(at) = running
                    .slots
                    .iter()
                    .filter_map(ConnectionSlot::idle_for)
                    .map(|idle| SLOT_IDLE.saturating_sub(idle))
                    .min()
                    .map(|wait| later(Instant::now(), wait))
            {
                release_timer.as_mut().reset(at);
                release_armed = true;
            }
            let can_fetch = stop.is_none() && in_flight < fetch_bound;
            let abandon_at = match (drain_deadline, failed_deadline) {
                (Some(drain), Some(failed)) => Some(drain.min(failed)),
                (drain, failed) => drain.or(failed),
            };
            let idle_at = match (self.idle, stop, in_flight) {
                (Some(idle), None, 0) => later(last_activity, idle),
                _ => last_activity + far,
            };
            tokio::select! {
                biased;
                // Also after the source ended (exhausted, failed): running deliveries then get
                // the drain timeout too.
                () = &mut cancelled, if drain_deadline.is_none() => {
                    stop.get_or_insert(StopReason::Shutdown);
                    drain_deadline = Some(later(Instant::now(), self.drain_timeout));
                    // Deliveries that have not started: hand them back now.
                    running.batch_since = None;
                    let gathered = std::mem::take(&mut running.batch);
                    let queued = waiting.drain().flat_map(|(_, queue)| queue);
                    for delivery in gathered.into_iter().chain(queued) {
                        in_flight -= 1;
                        report.requeued += 1;
                        if let Err(error) = delivery.requeue(None).await {
                            report.settle_errors += 1;
                            tracing::warn!(%error, "cannot requeue an unstarted delivery at shutdown");
                        }
                    }
                    tracing::info!(
                        source = source.name(),
                        running = running.tasks.len(),
                        "shutdown: no more fetching; finishing running deliveries"
                    );
                }
                () = tokio::time::sleep_until(abandon_at.unwrap_or(last_activity + far)),
                    if abandon_at.is_some() =>
                {
                    tracing::warn!(
                        source = source.name(),
                        running = running.tasks.len(),
                        "drain timeout: abandoning running deliveries unsettled"
                    );
                    // Dropping the running tasks rolls their transactions back.
                    running.tasks.clear();
                    for meta in running.meta.values() {
                        Running::<DB>::account(meta, &mut report);
                    }
                    break;
                }
                (id, joined) = running.tasks.next(), if !running.tasks.is_empty() => {
                    last_activity = Instant::now();
                    let meta = running.meta.remove(&id).expect("every task has its meta");
                    in_flight -= meta.deliveries;
                    Running::<DB>::account(&meta, &mut report);
                    if meta.batch {
                        let contended = matches!(&joined, Ok(done) if done.contended);
                        running.batch_ended(self, contended);
                    }
                    match joined {
                        Ok(done) => {
                            if let Some(mut slot) = done.slot {
                                // Another task without a kept slot may be waiting for a
                                // connection: give this one back.
                                if running.tasks.len() > running.kept_running() {
                                    slot.release();
                                }
                                running.slots.push(slot);
                            }
                        }
                        Err(panic) => {
                            // The task panicked outside a handler (handlers' panics are caught):
                            // its unsettled deliveries were dropped (and its slot with them).
                            if meta.kept {
                                running.slots.push(ConnectionSlot::new());
                            }
                            let error = panic
                                .downcast_ref::<&str>()
                                .map(|s| (*s).to_owned())
                                .or_else(|| panic.downcast_ref::<String>().cloned())
                                .unwrap_or_else(|| "panic".to_owned());
                            tracing::error!(%error, "delivery task panicked; unsettled deliveries abandoned");
                        }
                    }
                    for key in meta.keys {
                        let next = waiting.get_mut(&key).and_then(VecDeque::pop_front);
                        match next {
                            Some(delivery) if drain_deadline.is_none() => {
                                running.start(self, delivery);
                            }
                            Some(delivery) => {
                                // Shutdown emptied the queues; nothing is queued since.
                                waiting.entry(key).or_default().push_front(delivery);
                            }
                            None => {
                                waiting.remove(&key);
                                busy.remove(&key);
                            }
                        }
                    }
                }
                fetched = source.next(), if can_fetch => {
                    last_activity = Instant::now();
                    match fetched {
                        Ok(Some(delivery)) => {
                            report.deliveries += 1;
                            in_flight += 1;
                            match delivery.ordering_key() {
                                Some(key) if busy.contains(key) => {
                                    waiting.entry(key.to_owned()).or_default().push_back(delivery);
                                }
                                Some(key) => {
                                    busy.insert(key.to_owned());
                                    running.start(self, delivery);
                                }
                                None => running.start(self, delivery),
                            }
                        }
                        Ok(None) => stop = Some(StopReason::SourceExhausted),
                        Err(error) => {
                            tracing::error!(source = source.name(), %error, "source failed; finishing in-flight deliveries");
                            stop = Some(StopReason::SourceFailed);
                            failure = Some(error);
                            failed_deadline = Some(later(Instant::now(), self.drain_timeout));
                        }
                    }
                }
                () = tokio::time::sleep_until(idle_at), if self.idle.is_some() && stop.is_none() && in_flight == 0 => {
                    stop = Some(StopReason::Idle);
                }
                // No linger: the gathered deliveries start as soon as the source has no more
                // ready (this branch comes after the fetch).
                () = std::future::ready(()), if batch_at.is_some() && can_batch && self.linger.is_zero() => {
                    running.flush(self);
                }
                () = tokio::time::sleep_until(batch_at.unwrap_or(last_activity + far)), if batch_at.is_some() && can_batch && !self.linger.is_zero() => {
                    running.flush(self);
                }
                () = &mut release_timer, if release_armed => {
                    release_armed = false;
                    for slot in &mut running.slots {
                        if slot.idle_for().is_some_and(|idle| idle >= SLOT_IDLE) {
                            slot.release();
                        }
                    }
                }
            }
        }

        // Waiting deliveries left after a source failure (shutdown handled them already).
        for (_, queue) in waiting.drain() {
            for delivery in queue {
                report.requeued += 1;
                if delivery.requeue(None).await.is_err() {
                    report.settle_errors += 1;
                }
            }
        }
        report.batches = running.batch_runs;
        report.batched = running.batched;
        report.stop = stop.unwrap_or(StopReason::Shutdown);
        // A close on a connection that just died may never answer: bounded like the drain.
        let closed = match tokio::time::timeout(self.drain_timeout, source.close()).await {
            Ok(closed) => closed,
            Err(_) => Err(SourceError::new(
                source.name(),
                "close",
                format!("no answer within {} ms", self.drain_timeout.as_millis()),
            )),
        };
        match (failure, closed) {
            (Some(error), _) | (None, Err(error)) => {
                report.stop = StopReason::SourceFailed;
                Err(WorkerError { error, report })
            }
            (None, Ok(())) => Ok(report),
        }
    }

    /// Like [`run`](Self::run), shutting down gracefully on SIGINT or SIGTERM (see
    /// [`cancel_on_signal`]).
    ///
    /// # Errors
    /// As [`run`](Self::run); a [`SourceError`] with operation `"install signal handlers"` if
    /// the handlers cannot be installed.
    pub async fn run_until_signal<S: Source>(
        &self,
        source: S,
    ) -> Result<WorkerReport, WorkerError> {
        let token = cancel_on_signal().map_err(|e| WorkerError {
            error: SourceError::new(source.name(), "install signal handlers", e),
            report: WorkerReport::default(),
        })?;
        self.run(source, token).await
    }
}

fn add(total: &mut WorkerReport, one: &WorkerReport) {
    total.processed += one.processed;
    total.duplicates += one.duplicates;
    total.conflicts += one.conflicts;
    total.stale += one.stale;
    total.parked += one.parked;
    total.not_yet += one.not_yet;
    total.invalid += one.invalid;
    total.dead += one.dead;
    total.discarded += one.discarded;
    total.failed += one.failed;
    total.acked += one.acked;
    total.rejected += one.rejected;
    total.requeued += one.requeued;
    total.settle_errors += one.settle_errors;
    total.fenced += one.fenced;
    total.revoked += one.revoked;
    total.contention_fallbacks += one.contention_fallbacks;
    total.batches += one.batches;
    total.batched += one.batched;
}

/// One delivery (its own transaction) or a batch (one transaction): dispatch, then settle each,
/// recording each settled delivery in `progress`. Returns whether the batch lost to concurrent
/// transactions (its deliveries then ran one per transaction).
///
/// A handler that panics is caught here: in a batch, the batch transaction is rolled back and
/// its deliveries run one by one (so that one poison message does not hold back the others);
/// a delivery whose own handler panics is dropped unsettled (abandoned: the source delivers it
/// again), and the others go on.
async fn process<DB: InboxDatabase>(
    dispatcher: &Dispatcher<DB>,
    slot: &mut ConnectionSlot<DB>,
    deliveries: Vec<Delivery>,
    requeue_delay: Duration,
    options: crate::batch::BatchOptions,
    progress: &SharedProgress,
) -> bool {
    let record = |one: &WorkerReport| {
        let mut progress = progress
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        add(&mut progress.report, one);
        progress.done += 1;
    };
    // Deliveries their source gave up since they were fetched (a revoked partition) never run.
    let (deliveries, gone): (Vec<Delivery>, Vec<Delivery>) =
        deliveries.into_iter().partition(Delivery::is_current);
    for delivery in gone {
        tracing::debug!(
            message_name = delivery.envelope().message_name.as_str(),
            "delivery no longer current (partition revoked); dropped before it ran"
        );
        drop(delivery);
        record(&WorkerReport {
            revoked: 1,
            ..WorkerReport::default()
        });
    }
    if deliveries.len() > 1 {
        let envelopes: Vec<&crate::Envelope> = deliveries.iter().map(Delivery::envelope).collect();
        let dispatched =
            AssertUnwindSafe(dispatcher.dispatch_batch_with(slot, &envelopes, options))
                .catch_unwind()
                .await;
        drop(envelopes);
        match dispatched {
            Ok((results, stats)) => {
                if stats.contention.is_some() {
                    let mut progress = progress
                        .lock()
                        .unwrap_or_else(std::sync::PoisonError::into_inner);
                    progress.report.contention_fallbacks += 1;
                }
                for (delivery, result) in deliveries.into_iter().zip(results) {
                    record(&settle(dispatcher, slot, delivery, result, requeue_delay).await);
                }
                return stats.contention.is_some();
            }
            Err(_) => tracing::error!(
                size = deliveries.len(),
                "a handler panicked in a batch (rolled back); running its deliveries one by one"
            ),
        }
    }
    for delivery in deliveries {
        let dispatched = AssertUnwindSafe(dispatcher.dispatch_on(slot, delivery.envelope()))
            .catch_unwind()
            .await;
        match dispatched {
            Ok(result) => {
                record(&settle(dispatcher, slot, delivery, result, requeue_delay).await);
            }
            Err(_) => {
                tracing::error!(
                    message_name = delivery.envelope().message_name.as_str(),
                    "a handler panicked; delivery abandoned unsettled (the source delivers it again)"
                );
                drop(delivery);
                let mut progress = progress
                    .lock()
                    .unwrap_or_else(std::sync::PoisonError::into_inner);
                progress.report.abandoned += 1;
                progress.done += 1;
            }
        }
    }
    false
}

/// Settles one delivery by the dispatcher's `result` for it: decide, log, settle.
async fn settle<DB: InboxDatabase>(
    dispatcher: &Dispatcher<DB>,
    slot: &mut ConnectionSlot<DB>,
    delivery: Delivery,
    result: Result<Vec<ConsumerOutcome>, DispatchError>,
    requeue_delay: Duration,
) -> WorkerReport {
    let mut report = WorkerReport::default();
    let envelope = delivery.envelope();
    // A transaction fenced by a hook belongs to another consumer now: not settled at all.
    if let Ok(outcomes) = &result
        && let Some(fenced) = outcomes.iter().find_map(|outcome| match &outcome.result {
            Err(Error::Hook(hook)) if hook.is_fenced() => Some(hook),
            _ => None,
        })
    {
        tracing::warn!(
            message_name = envelope.message_name.as_str(),
            reason = %fenced.source,
            "fenced: the partition belongs to another consumer now; delivery dropped unsettled"
        );
        report.fenced += 1;
        drop(delivery);
        return report;
    }
    let mut settlement = settlement_for(&result, requeue_delay);
    // A delivery the dispatcher refuses is kept in `inbox_rejections` (payload included); once
    // it is, acking it loses nothing. If it cannot be kept (the database failed), it is
    // requeued after `requeue_delay`: a reject would make many sources drop it (SQS deletes,
    // AMQP without a dead-letter exchange drops, NATS terminates, Kafka moves past it), stored
    // nowhere. Its redelivery tries to keep it again.
    if let Err(error) = &result {
        match dispatcher.record_rejection_on(slot, envelope, error).await {
            Ok(()) => settlement = Settlement::Ack,
            Err(record_error) => {
                settlement = Settlement::Requeue {
                    delay: Some(requeue_delay),
                };
                tracing::error!(
                    error = %record_error,
                    "could not keep the refused delivery in inbox_rejections; requeueing it"
                );
            }
        }
    }

    let message_name = envelope.message_name.as_str();
    let source = envelope.source.as_ref();
    let source_name = source.map_or("", |s| s.source.as_str());
    let offset = source.and_then(|s| s.offset);
    match &result {
        Err(error) => {
            report.invalid += 1;
            let kept = matches!(settlement, Settlement::Ack);
            tracing::warn!(
                message_name,
                source = source_name,
                offset,
                reason = %error,
                "{}",
                if kept {
                    "refused delivery: the dispatcher cannot route it; kept in inbox_rejections"
                } else {
                    "refused delivery: the dispatcher cannot route it; not kept, requeued"
                }
            );
        }
        Ok(outcomes) => {
            for outcome in outcomes {
                match &outcome.result {
                    Ok(Outcome::Processed(())) => report.processed += 1,
                    Ok(Outcome::Duplicate) => report.duplicates += 1,
                    Ok(Outcome::Dead) => report.dead += 1,
                    Ok(Outcome::Discarded) => report.discarded += 1,
                    Ok(Outcome::Stale) => report.stale += 1,
                    Ok(Outcome::Parked) => report.parked += 1,
                    Ok(Outcome::NotYet { .. }) => report.not_yet += 1,
                    Err(Error::Handler(failure)) if failure.disposition.is_settled() => {
                        report.dead += 1;
                        tracing::error!(
                            message_name,
                            consumer = outcome.consumer,
                            source = source_name,
                            offset,
                            reason = %failure,
                            "dead-lettered in the inbox; acking the delivery"
                        );
                    }
                    Err(error @ Error::Conflict(_)) => {
                        report.conflicts += 1;
                        tracing::error!(
                            message_name,
                            consumer = outcome.consumer,
                            source = source_name,
                            offset,
                            reason = %error,
                            "rejecting delivery: conflict"
                        );
                    }
                    Err(error @ (Error::Key(_) | Error::Fingerprint(_))) => {
                        report.invalid += 1;
                        tracing::error!(
                            message_name,
                            consumer = outcome.consumer,
                            source = source_name,
                            offset,
                            reason = %error,
                            "rejecting delivery: invalid message"
                        );
                    }
                    Err(error) => {
                        report.failed += 1;
                        tracing::warn!(
                            message_name,
                            consumer = outcome.consumer,
                            source = source_name,
                            offset,
                            reason = %error,
                            "consumer failed; requeueing the delivery"
                        );
                    }
                    // Outcomes added later, until the policy knows them.
                    #[allow(unreachable_patterns)]
                    Ok(other) => {
                        report.failed += 1;
                        tracing::warn!(
                            message_name,
                            consumer = outcome.consumer,
                            outcome = other.kind(),
                            "outcome unknown to the settlement policy; requeueing the delivery"
                        );
                    }
                }
            }
        }
    }
    drop(result);

    match settlement {
        Settlement::Ack => report.acked += 1,
        Settlement::Reject => report.rejected += 1,
        Settlement::Requeue { .. } => report.requeued += 1,
    }
    let message_name = message_name.to_owned();
    if let Err(error) = delivery.settle(settlement).await {
        report.settle_errors += 1;
        tracing::warn!(
            message_name,
            settlement = settlement.kind(),
            %error,
            "cannot settle the delivery; the source will deliver it again"
        );
    }
    report
}

/// Resolves on the first SIGINT or SIGTERM (on non-Unix platforms: Ctrl-C).
///
/// # Errors
/// An [`std::io::Error`] if the signal handlers cannot be installed.
pub async fn shutdown_signal() -> std::io::Result<()> {
    let signal = install_signal_handlers()?;
    signal.await;
    Ok(())
}

/// Installs SIGINT and SIGTERM handlers now and returns a token that is cancelled on the first
/// of them (on non-Unix platforms: Ctrl-C). From then on these signals no longer end the process
/// on their own: pass the token to [`Worker::run`] so that it shuts down gracefully.
///
/// Call it early (before connecting to anything) so that a signal during start-up is not lost.
/// Needs a Tokio runtime.
///
/// # Errors
/// An [`std::io::Error`] if the signal handlers cannot be installed.
pub fn cancel_on_signal() -> std::io::Result<CancellationToken> {
    let token = CancellationToken::new();
    let signal = install_signal_handlers()?;
    let cancel = token.clone();
    tokio::spawn(async move {
        signal.await;
        cancel.cancel();
    });
    Ok(token)
}

fn install_signal_handlers() -> std::io::Result<crate::BoxFuture<'static, ()>> {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{SignalKind, signal};
        let mut interrupt = signal(SignalKind::interrupt())?;
        let mut terminate = signal(SignalKind::terminate())?;
        Ok(Box::pin(async move {
            tokio::select! {
                _ = interrupt.recv() => tracing::info!("SIGINT received"),
                _ = terminate.recv() => tracing::info!("SIGTERM received"),
            }
        }))
    }
    #[cfg(not(unix))]
    {
        Ok(Box::pin(async {
            let _ = tokio::signal::ctrl_c().await;
        }))
    }
}
