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

mod batching;
mod drain;
pub(crate) mod ending;
pub(crate) mod keys;
mod poll;
mod ready;
mod report;
mod run;
pub(crate) mod settings;
pub(crate) mod settle;
pub(crate) mod signal;
pub(crate) mod sweep;

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use crate::dispatch::dispatcher::Dispatcher;
#[cfg(doc)]
use crate::source::Delivery;
use crate::source::Source;
use crate::store::InboxDatabase;
use crate::types::envelope::Envelope;
use crate::types::slot::ConnectionSlot;

pub use report::{StopReason, WorkerError, WorkerReport};
pub use settle::settlement_for;
pub use signal::{cancel_on_signal, shutdown_signal};

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
/// * **Partitions**: messages that declare the aggregates their handlers lock
///   ([`Message::partitions`](crate::Message::partitions), or
///   [`partition_by`](Self::partition_by)) run in batches that never share a partition with a
///   batch in flight (a delivery waits for its partition's batch to end), so up to
///   `concurrency` batches run side by side from the start without deadlocking each other.
/// * **Order**: deliveries with the same [ordering key](Delivery::ordering_key) run one at a
///   time, in the order the source handed them out. A requeued delivery comes back when the
///   source redelivers it, possibly after later ones of its key.
/// * **Shutdown**: when the token is cancelled the worker stops fetching, requeues deliveries
///   that have not started, lets running ones finish (commit, then ack) for up to the
///   [drain timeout](Self::drain_timeout), then drops the rest unsettled (their transactions roll
///   back; the broker redelivers them), calls [`Source::close`] and, beside it, waits for a
///   parked-message sweep in flight (each for up to the drain timeout; see
///   [`park_sweep`](Self::park_sweep)), and returns.
/// * **Source failure**: the worker stops fetching and lets running and queued deliveries finish,
///   also for up to the drain timeout from the failure (a settlement on a connection that just
///   died may never answer), then drops the rest unsettled as on shutdown and returns the error.
///   [`Source::close`] gets the drain timeout too; past it, `run` returns a `close` error.
#[derive(Debug)]
pub struct Worker<DB: InboxDatabase> {
    dispatcher: Arc<Dispatcher<DB>>,
    settings: settings::Settings,
    /// The most deliveries one transaction runs (1: one per transaction).
    batch_size: usize,
    /// How long a batch that has not filled may wait for more deliveries (zero: it starts with
    /// whatever is ready).
    linger: Duration,
    /// The partitions of every delivery, if set (else its message's declaration).
    partition_by: Option<PartitionFn>,
    /// The table prefix its runs use: its dispatcher's, else the scope's it was built in.
    prefix: Option<crate::store::TablePrefix>,
}

/// A [`Worker::partition_by`] function's signature: an envelope's partitions, or `None`.
type PartitionOf = dyn Fn(&Envelope) -> Option<Vec<String>> + Send + Sync;

/// A [`Worker::partition_by`] function.
#[derive(Clone)]
struct PartitionFn(Arc<PartitionOf>);

impl std::fmt::Debug for PartitionFn {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("PartitionFn(..)")
    }
}

/// The default [`Worker::batch_size`]: at most this many ready deliveries per transaction.
pub const DEFAULT_BATCH_SIZE: usize = 100;

/// `at + after`, or a year after `at` if that overflows (`Duration::MAX` means "never").
pub(crate) fn later(at: Instant, after: Duration) -> Instant {
    at.checked_add(after).unwrap_or_else(|| at + FAR)
}

/// How long a kept connection may go unused before the worker gives it back to the pool.
const SLOT_IDLE: Duration = Duration::from_secs(1);

/// A deadline that never comes, counted from now: a year.
const FAR: Duration = Duration::from_secs(86_400 * 365);

/// The worker's running tasks, its kept connection slots and the batch being gathered.
struct Running<DB: InboxDatabase> {
    tasks: run::Tasks<DB>,
    meta: HashMap<u64, run::TaskMeta>,
    /// The id of the next task.
    next_id: u64,
    slots: Vec<ConnectionSlot<DB>>,
    /// Deliveries gathered for batches: ready, or waiting for a partition a task holds.
    ready: ready::Ready,
    /// When the first ready delivery arrived (or the previous batch took the ones before).
    batch_since: Option<Instant>,
    /// Batches running now, and the open ones among them (see [`ready::Kind`]).
    batches: usize,
    open_batches: usize,
    /// How many batches may run at once while open batches run (or would start): 1 at first,
    /// up by one after every 4 clean batches up to the concurrency, back to 1 after a batch lost
    /// to concurrent transactions.
    open_ramp: batching::Ramp,
    /// How many partitioned batches may run at once while no open batch runs: the concurrency,
    /// back to 1 after one lost to concurrent transactions.
    partitioned_ramp: batching::Ramp,
    /// The batches' gate (see [`crate::protocol::batch::BatchOptions::gate`]).
    gate: Arc<tokio::sync::RwLock<()>>,
    /// The most batches that ran at once (for the report).
    peak_batches: usize,
    /// Batches started, and the deliveries in them (for the report).
    batch_runs: u64,
    batched: u64,
}

impl<DB: InboxDatabase> Running<DB> {
    /// Nothing running yet, with the kept connection slots of `worker`'s [`run`](Worker::run).
    ///
    /// Connection slots kept across deliveries (each holds one pooled connection once used): at
    /// most `concurrency`, and at least one connection of the pool is never kept, so that a
    /// delivery without a kept slot, the parked-message sweep and other users of the pool always
    /// get one. A slot gives its connection back to the pool when a delivery without a kept slot
    /// is running (it may be waiting for one), and after `SLOT_IDLE` unused (so that an idle
    /// worker does not sit on connections that another user of the pool needs).
    fn new(worker: &Worker<DB>) -> Self {
        let max_connections = worker.dispatcher.pool().options().get_max_connections() as usize;
        Self {
            tasks: run::Tasks::new(),
            meta: HashMap::new(),
            next_id: 0,
            slots: (0..worker
                .settings
                .concurrency
                .min(max_connections.saturating_sub(1)))
                .map(|_| ConnectionSlot::new())
                .collect(),
            ready: ready::Ready::default(),
            batch_since: None,
            batches: 0,
            open_batches: 0,
            open_ramp: batching::Ramp::open(),
            partitioned_ramp: batching::Ramp::partitioned(worker.settings.concurrency),
            gate: Arc::default(),
            peak_batches: 0,
            batch_runs: 0,
            batched: 0,
        }
    }
}

/// The state one [`Worker::run`] shares between its steps: [`poll`](Loop::poll) (the loop),
/// then [`finish`](Loop::finish) (see `drain.rs`).
struct Loop<'w, DB: InboxDatabase> {
    worker: &'w Worker<DB>,
    report: WorkerReport,
    running: Running<DB>,
    /// Deliveries fetched and not yet settled.
    in_flight: usize,
    /// The most deliveries fetched and not yet settled: one per transaction in flight, or
    /// (batching) full batches in flight and one more batch ready.
    fetch_bound: usize,
    /// Ordering keys busy, and the deliveries waiting for an earlier one of their key.
    keys: keys::KeyQueues,
    /// Why and when the run stops, and when something last happened.
    end: ending::Ending,
    /// Whether the timer that gives idle kept connections back to the pool is set.
    release_armed: bool,
}

impl<'w, DB: InboxDatabase> Loop<'w, DB> {
    fn new(worker: &'w Worker<DB>) -> Self {
        let fetch_bound = match worker.batching() {
            Some((size, _)) => worker
                .settings
                .concurrency
                .saturating_add(1)
                .saturating_mul(size),
            None => worker.settings.concurrency,
        };
        Self {
            worker,
            report: WorkerReport::default(),
            running: Running::new(worker),
            in_flight: 0,
            fetch_bound,
            keys: keys::KeyQueues::default(),
            end: ending::Ending::new(&worker.settings),
            release_armed: false,
        }
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
        let prefix = dispatcher
            .prefix
            .clone()
            .or_else(crate::store::TablePrefix::current);
        Self {
            prefix,
            dispatcher,
            settings: settings::Settings::default(),
            batch_size: DEFAULT_BATCH_SIZE,
            linger: Duration::ZERO,
            partition_by: None,
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
    /// flight; declare what the effects lock to run batches side by side (below). A fallback
    /// costs the batch's neighbours their transaction, not their effects: the handlers that ran
    /// before the failure run again (their writes were rolled back), each effect commits once.
    ///
    /// `max_wait` is latency every delivery of a batch that does not fill may pay: keep it to
    /// milliseconds. A batch that cannot fill — the source has nothing more for now, or the
    /// deliveries still to come share ordering keys with it — starts when `max_wait` is up.
    /// A handler that panics rolls its batch back; the batch's deliveries then run one by one
    /// (the panicking one is dropped unsettled, for the source to deliver again).
    ///
    /// **Partitions.** When every delivery of a batch declares its partitions — the aggregates
    /// whose rows its handlers lock ([`Message::partitions`](crate::Message::partitions):
    /// `#[message(partition)]`, or the ordering aggregate; or [`partition_by`](Self::partition_by))
    /// — the batch never shares a partition with a batch in flight: a delivery whose partition a
    /// running batch (or single delivery) holds waits for it to end, then joins a later batch,
    /// as a Kafka partition's records wait for the ones before. The deliveries of a partition
    /// start in their order of arrival (one also waits behind an earlier one of its partitions
    /// that waits), and a partitioned batch runs its deliveries in that order (not sorted by
    /// key: no batch in flight shares their keys). Such batches cannot deadlock each other, so
    /// they run side by side from the start, up to `concurrency`, without a lock timeout.
    /// Deliveries without a declaration gather apart, in open batches that keep the cautious
    /// rules above; while an open batch runs, partitioned batches count against the open
    /// batches' limit and wait at most 30 ms for a lock. Waiting deliveries count among the fetched ones, so memory stays
    /// bounded by `(concurrency + 1) × size` deliveries (each held decoded: the worker decodes a
    /// delivery when it arrives, to read its partitions, and the dispatch uses that decoding).
    pub fn batch(mut self, size: usize, max_wait: Duration) -> Self {
        self.batch_size = size.max(1);
        self.linger = max_wait;
        self
    }

    /// Takes every delivery's partitions from `partition` instead of its message's
    /// declaration (see [`batch`](Self::batch), "Partitions"): for messages you cannot
    /// annotate (another crate's types, a raw payload), or to partition by what the broker
    /// carries (the Kafka record key in [`SourceMetadata::record_key`](crate::SourceMetadata),
    /// a header). `partition` gets the envelope as the source delivered it (payload not
    /// decoded: the worker then decodes each payload once, in the dispatch) and returns the
    /// partitions of the delivery, or `None` if it does not know them: that delivery then
    /// counts as undeclared (its batch is an open one). Partitions are any strings, compared
    /// byte-exactly; `Some(vec![])` says the delivery locks nothing another one locks.
    /// Message declarations are not read at all while a function is set. Unused without
    /// batches ([`one_per_transaction`](Self::one_per_transaction)).
    ///
    /// The function promises what a declaration does ([`Message::partitions`](crate::Message::partitions)):
    /// deliveries with no partition in common lock no row in common. It runs on the worker's
    /// task for every delivery, when it arrives: keep it cheap, and do not block in it.
    ///
    /// ```no_run
    /// # fn demo(worker: inbox_runtime::Worker<sqlx::Postgres>) {
    /// // Kafka: the record key is the account id the handlers lock.
    /// let worker = worker.partition_by(|envelope| {
    ///     let key = envelope.source.as_ref()?.record_key.as_ref()?;
    ///     Some(vec![String::from_utf8_lossy(key).into_owned()])
    /// });
    /// # }
    /// ```
    pub fn partition_by(
        mut self,
        partition: impl Fn(&Envelope) -> Option<Vec<String>> + Send + Sync + 'static,
    ) -> Self {
        self.partition_by = Some(PartitionFn(Arc::new(partition)));
        self
    }

    settings::shared_methods! {
        dispatcher: Dispatcher<DB>,
        sweep_parked: "[`Dispatcher::sweep_parked`]",
        settlement: "[`settlement_for`]",
        /// At most `n` transactions in flight at once, each one delivery or (with
        /// [`batch`](Self::batch)) one batch; at least 1. Default 8. Without batching that is also
        /// the bound on deliveries fetched and not yet settled; with batches of `size`, at most
        /// `(n + 1) × size` deliveries are.
        concurrency;
    }

    /// Runs until the source is exhausted, the worker is idle (if set), `shutdown` is
    /// cancelled, or the source fails; then closes the source and waits for a parked-message
    /// sweep in flight (both for up to the [drain timeout](Self::drain_timeout)). First gives
    /// the source the dispatcher's payload limit ([`Source::set_payload_limit`]).
    ///
    /// # Errors
    /// [`WorkerError`] if fetching from the source failed (in-flight work is finished first, for
    /// up to the [drain timeout](Self::drain_timeout)), or closing it did.
    pub async fn run<S: Source>(
        &self,
        mut source: S,
        shutdown: CancellationToken,
    ) -> Result<WorkerReport, WorkerError> {
        // The source stops reading a delivery at the dispatcher's limit.
        source.set_payload_limit(self.dispatcher.payload_limit());
        // In the dispatcher's table prefix (the scope it was built in), else in the one of the
        // scope the worker was built in, if any.
        crate::store::within(self.prefix.as_ref(), async {
            let mut run = Loop::new(self);
            // The parked-message sweep runs beside the loop; a sweep in flight when the loop
            // ends finishes (within the drain timeout) before `run` returns.
            let sweep = self.sweep_parked_beside();
            run.poll(&mut source, &shutdown).await;
            let (result, ()) =
                tokio::join!(run.finish(source), sweep.stop(self.settings.drain_timeout));
            result
        })
        .await
    }
}
