//! Batch forming: deliveries that are ready together run in one transaction. Batches whose
//! deliveries all declare their partitions never share one with a batch in flight, and run side
//! by side up to the concurrency; how many other (open) batches may run at once adapts to
//! contention (one at a time after a batch lost to a deadlock).

use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;

use crate::dispatch::dispatcher::Decoded;
use crate::protocol::batch::BatchOptions;
use crate::source::Delivery;
use crate::store::InboxDatabase;

use super::ready::{Kind, Pending};
use super::{Running, Worker, later};

/// The `lock_timeout` of a batch that may be in a lock cycle with a batch in flight
/// (PostgreSQL): an open batch started while other batches run, or a partitioned one started
/// while open batches run. A batch that waits this long for a row lock is most likely in a
/// deadlock with another batch, which the server would only find after its
/// `deadlock_timeout` (1 s by default). It gives up, and runs again alone.
const BATCH_LOCK_TIMEOUT: Duration = Duration::from_millis(30);

/// Clean batches before one more open batch may run beside the others, until a batch first
/// lost to concurrent transactions: the worker starts with one open batch in flight and ramps
/// up.
pub(super) const RAMP_BATCHES: usize = 4;
/// Clean batches the worker runs one at a time after the first contention, before it lets one
/// more batch run beside them; four times as many after every further contention (up to
/// [`CALM_BATCHES_MAX`]).
const CALM_BATCHES: usize = 64;
/// The most clean batches [`CALM_BATCHES`] grows to.
const CALM_BATCHES_MAX: usize = 4096;

/// How many batches of one kind may run at once, adapting to contention: down to 1 after a
/// batch lost to concurrent transactions, up by one after every `calm_needed` clean batches.
#[derive(Debug)]
pub(super) struct Ramp {
    /// How many may run at once.
    pub(super) limit: usize,
    /// Clean batches since the limit last changed.
    calm: usize,
    /// Clean batches needed before the limit goes up by one.
    calm_needed: usize,
}

impl Ramp {
    /// Open batches: one at first, ramping up after every [`RAMP_BATCHES`] clean batches.
    pub(super) fn open() -> Self {
        Self {
            limit: 1,
            calm: 0,
            calm_needed: RAMP_BATCHES,
        }
    }

    /// Partitioned batches: `concurrency` at once from the start (they cannot deadlock each
    /// other), the same adaptation after a loss (a declaration that left out a row).
    pub(super) fn partitioned(concurrency: usize) -> Self {
        Self {
            limit: concurrency,
            calm: 0,
            calm_needed: CALM_BATCHES,
        }
    }

    /// A batch of this kind ended, losing to concurrent transactions or not.
    fn ended(&mut self, contended: bool, concurrency: usize, kind: Kind) {
        if contended {
            if self.limit > 1 {
                tracing::info!(
                    ?kind,
                    was = self.limit,
                    calm_batches = self.calm_needed,
                    "a batch lost to concurrent transactions; running one batch at a time for a while"
                );
            }
            self.calm_needed = if self.limit > 1 || self.calm_needed < CALM_BATCHES {
                (self.calm_needed * 4).clamp(CALM_BATCHES, CALM_BATCHES_MAX)
            } else {
                self.calm_needed
            };
            self.limit = 1;
            self.calm = 0;
        } else if self.limit < concurrency {
            self.calm += 1;
            if self.calm >= self.calm_needed {
                self.limit += 1;
                self.calm = 0;
            }
        }
    }
}

/// What a task's batch options decided: the options, and the ramp its outcome counts in.
pub(super) struct Started {
    pub(super) options: BatchOptions,
    /// Partitioned only if no open batch ran beside it when it started (a loss is then its
    /// declaration's, not an open batch's).
    pub(super) ramp: Kind,
}

impl<DB: InboxDatabase> Running<DB> {
    /// Starts `delivery`: at once, or (when batching) among the deliveries gathered for
    /// batches, which start when full, or on [`flush`](Self::flush).
    ///
    /// When batching, its partitions are read now: from [`Worker::partition_by`], else from
    /// its message (the envelope is decoded now, once: the dispatch reuses it). A delivery the
    /// dispatcher refuses counts as undeclared (it batches as it did before partitions).
    pub(super) fn start(&mut self, worker: &Worker<DB>, delivery: Delivery) {
        if worker.batching().is_none() {
            self.spawn(
                worker,
                vec![Pending::new(delivery, None, None)],
                Kind::Open,
                Vec::new(),
            );
            return;
        }
        let pending = match &worker.partition_by {
            Some(partition_by) => {
                let partitions = (partition_by.0)(delivery.envelope());
                Pending::new(delivery, None, partitions)
            }
            None => {
                let decoded = worker.dispatcher.decode(delivery.envelope());
                let partitions = decoded.as_ref().ok().and_then(Decoded::partitions);
                Pending::new(delivery, Some(decoded), partitions)
            }
        };
        self.ready.push(pending);
        self.note_ready();
        self.flush_full(worker);
    }

    /// Starts the clock of a batch's linger if deliveries are ready and it is not running.
    fn note_ready(&mut self) {
        if self.ready.any_ready() {
            self.batch_since.get_or_insert_with(Instant::now);
        }
    }

    /// Whether one more batch of `kind` may start now: fewer than `concurrency` transactions
    /// run, and fewer batches than its limit. A partitioned batch counts against the open
    /// batches' limit while open batches run (it may be in a lock cycle with them), and waits
    /// while an open batch is due.
    fn can_start(&self, worker: &Worker<DB>, kind: Kind) -> bool {
        if self.tasks.len() >= worker.settings.concurrency {
            return false;
        }
        match kind {
            Kind::Open => self.batches < self.open_ramp.limit,
            Kind::Partitioned if self.ready.open_due => false,
            Kind::Partitioned if self.open_batches > 0 => self.batches < self.open_ramp.limit,
            Kind::Partitioned => self.batches < self.partitioned_ramp.limit,
        }
    }

    /// The kind of the next batch of whatever is ready, the kind whose first delivery came
    /// first first: `Err(true)` if an open batch is due but cannot start yet (no partitioned
    /// batch may overtake it), `Err(false)` if none can start.
    fn next_kind(&self, worker: &Worker<DB>) -> Result<Kind, bool> {
        for kind in self.ready.by_age() {
            if self.can_start(worker, kind) {
                return Ok(kind);
            }
            if kind == Kind::Open {
                return Err(true);
            }
        }
        Err(false)
    }

    /// Whether [`flush`](Self::flush) would start a batch now.
    pub(super) fn can_start_batch(&self, worker: &Worker<DB>) -> bool {
        self.next_kind(worker).is_ok()
    }

    /// Starts full batches while they may start.
    pub(super) fn flush_full(&mut self, worker: &Worker<DB>) {
        let Some((size, _)) = worker.batching() else {
            return;
        };
        for kind in [Kind::Open, Kind::Partitioned] {
            while self.ready.len(kind) >= size && self.can_start(worker, kind) {
                self.flush_kind(worker, kind);
            }
        }
    }

    /// Starts batches of all the ready deliveries while they may start (once nothing more can
    /// join them).
    pub(super) fn flush_all(&mut self, worker: &Worker<DB>) {
        while self.try_flush(worker) {}
    }

    /// Starts one batch of the ready deliveries (up to the batch size), if one may start.
    pub(super) fn flush(&mut self, worker: &Worker<DB>) {
        self.try_flush(worker);
    }

    /// [`flush`](Self::flush): whether it started one.
    fn try_flush(&mut self, worker: &Worker<DB>) -> bool {
        match self.next_kind(worker) {
            Ok(kind) => {
                self.flush_kind(worker, kind);
                true
            }
            Err(due) => {
                self.ready.open_due |= due;
                false
            }
        }
    }

    /// Starts a batch of up to the batch size of the ready deliveries of `kind`.
    fn flush_kind(&mut self, worker: &Worker<DB>, kind: Kind) {
        let (batch, partitions) = self.ready.take(kind, worker.batch_size);
        self.batch_since = self.ready.any_ready().then(Instant::now);
        if !batch.is_empty() {
            self.spawn(worker, batch, kind, partitions);
        }
    }

    /// When the ready deliveries' batch starts even if it has not filled (their linger is up).
    pub(super) fn batch_at(&self, worker: &Worker<DB>) -> Option<Instant> {
        self.batch_since
            .zip(worker.batching())
            .map(|(since, (_, max_wait))| later(since, max_wait))
    }

    /// A task that held `partitions` ended: the deliveries waiting for them are ready again.
    pub(super) fn release(&mut self, partitions: &[String]) {
        if !partitions.is_empty() {
            self.ready.release(partitions);
            self.note_ready();
        }
    }

    /// Every delivery gathered and not started, for shutdown: handed back in order of arrival.
    pub(super) fn take_unstarted(&mut self) -> Vec<Delivery> {
        self.batch_since = None;
        self.ready.take_all()
    }

    /// A batch of `kind` ended: whether it lost to concurrent transactions adapts the limit
    /// of the batches of `ramp`.
    pub(super) fn batch_ended(
        &mut self,
        worker: &Worker<DB>,
        kind: Kind,
        ramp: Kind,
        contended: bool,
    ) {
        self.batches = self.batches.saturating_sub(1);
        if kind == Kind::Open {
            self.open_batches = self.open_batches.saturating_sub(1);
        }
        let limits = match ramp {
            Kind::Open => &mut self.open_ramp,
            Kind::Partitioned => &mut self.partitioned_ramp,
        };
        limits.ended(contended, worker.settings.concurrency, ramp);
    }

    /// The batch options of a task about to run `n` deliveries of `kind`; a batch (two or
    /// more) is counted as running. A batch that starts while batches it may be in a lock cycle
    /// with run (any batch, for an open one; an open one, for a partitioned one) waits for a
    /// lock at most [`BATCH_LOCK_TIMEOUT`]. Only a batch uses the options (a single delivery
    /// runs `dispatch_on`).
    pub(super) fn batch_options(&mut self, n: usize, kind: Kind) -> Started {
        let is_batch = n > 1;
        let beside = match kind {
            Kind::Open => self.batches,
            Kind::Partitioned => self.open_batches,
        };
        let started = Started {
            options: BatchOptions {
                lock_timeout: (is_batch && beside > 0).then_some(BATCH_LOCK_TIMEOUT),
                gate: is_batch.then(|| Arc::clone(&self.gate)),
                keep_order: kind == Kind::Partitioned,
            },
            ramp: if kind == Kind::Partitioned && self.open_batches == 0 {
                Kind::Partitioned
            } else {
                Kind::Open
            },
        };
        if is_batch {
            self.batches += 1;
            if kind == Kind::Open {
                self.open_batches += 1;
            }
            self.peak_batches = self.peak_batches.max(self.batches);
            self.batch_runs += 1;
            self.batched += n as u64;
        }
        started
    }
}
