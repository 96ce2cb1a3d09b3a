//! Running deliveries: one delivery in its own transaction, or a batch in one transaction,
//! as a task polled on the worker's own task; what each task settled, even if it panicked.

use std::panic::AssertUnwindSafe;
use std::sync::{Arc, MutexGuard};
use std::time::Duration;

use futures_util::FutureExt as _;
use futures_util::StreamExt as _;
use futures_util::stream::FuturesUnordered;

use crate::dispatch::dispatcher::{ConsumerOutcome, Dispatcher};
use crate::protocol::batch::BatchOptions;
use crate::source::Delivery;
use crate::store::InboxDatabase;
use crate::types::error::DispatchError;
use crate::types::slot::ConnectionSlot;

use super::ready::{Kind, Pending};
use super::settle::{drop_revoked, settle};
use super::{Running, Worker, WorkerReport};

/// A finished task.
pub(super) struct Done<DB: InboxDatabase> {
    /// The task's connection slot, back for the next delivery (if it may be kept).
    slot: Option<ConnectionSlot<DB>>,
    /// Whether its batch lost to concurrent transactions (its deliveries then ran alone).
    contended: bool,
}

/// What a task has settled so far (read even if the task is aborted or panics).
#[derive(Default)]
struct Progress {
    report: WorkerReport,
    /// Deliveries settled, or abandoned by a panicking handler.
    done: usize,
}

type SharedProgress = Arc<std::sync::Mutex<Progress>>;

/// What the worker knows of a running task.
pub(super) struct TaskMeta {
    /// The deliveries it settles.
    pub(super) deliveries: usize,
    /// How far it got.
    progress: SharedProgress,
    /// Their ordering keys (busy until the task ends).
    pub(super) keys: Vec<String>,
    /// Whether it took one of the kept connection slots.
    kept: bool,
    /// Whether it runs a batch (more than one delivery in one transaction).
    batch: bool,
    /// What its deliveries may lock, and the batches whose limit its outcome adapts.
    kind: Kind,
    ramp: Kind,
    /// The partitions it holds until it ends.
    partitions: Vec<String>,
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
pub(super) struct Tasks<DB: InboxDatabase> {
    set: FuturesUnordered<TaskFuture<DB>>,
}

impl<DB: InboxDatabase> Tasks<DB> {
    pub(super) fn new() -> Self {
        let set = FuturesUnordered::new();
        set.push(Box::pin(std::future::pending()) as TaskFuture<DB>);
        Self { set }
    }

    /// Running tasks.
    pub(super) fn len(&self) -> usize {
        self.set.len() - 1
    }

    pub(super) fn is_empty(&self) -> bool {
        self.len() == 0
    }

    fn push(&self, task: TaskFuture<DB>) {
        self.set.push(task);
    }

    /// The next task to end (pending while none runs).
    pub(super) async fn next(&mut self) -> (u64, std::thread::Result<Done<DB>>) {
        match self.set.next().await {
            Some(done) => done,
            None => std::future::pending().await,
        }
    }

    /// Drops every running task.
    pub(super) fn clear(&mut self) {
        *self = Self::new();
    }
}

impl<DB: InboxDatabase> Running<DB> {
    /// Runs `deliveries` (one, or a batch of `kind`) in a task, on a kept slot if one is free;
    /// the task holds `partitions` until it ends.
    pub(super) fn spawn(
        &mut self,
        worker: &Worker<DB>,
        deliveries: Vec<Pending>,
        kind: Kind,
        partitions: Vec<String>,
    ) {
        let dispatcher = Arc::clone(&worker.dispatcher);
        let requeue_delay = worker.settings.requeue_delay;
        let started = self.batch_options(deliveries.len(), kind);
        let options = started.options;
        let kept = self.slots.pop();
        let progress = SharedProgress::default();
        let meta = TaskMeta {
            deliveries: deliveries.len(),
            progress: Arc::clone(&progress),
            keys: deliveries
                .iter()
                .filter_map(|p| p.delivery.ordering_key().map(str::to_owned))
                .collect(),
            kept: kept.is_some(),
            batch: deliveries.len() > 1,
            kind,
            ramp: started.ramp,
            partitions,
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

    /// Task `id` ended (`joined`: its [`Done`], or the panic that escaped it): adds what it
    /// settled to `report`, adapts the batch limit if it ran a batch, takes its kept slot back.
    /// Returns what the worker knew of it (its ordering keys are still busy).
    pub(super) fn ended(
        &mut self,
        worker: &Worker<DB>,
        id: u64,
        joined: std::thread::Result<Done<DB>>,
        report: &mut WorkerReport,
    ) -> TaskMeta {
        let mut meta = self.meta.remove(&id).expect("every task has its meta");
        Self::account(&meta, report);
        if meta.batch {
            let contended = matches!(&joined, Ok(done) if done.contended);
            self.batch_ended(worker, meta.kind, meta.ramp, contended);
        }
        self.release(&std::mem::take(&mut meta.partitions));
        match joined {
            Ok(done) => {
                if let Some(mut slot) = done.slot {
                    // Another task without a kept slot may be waiting for a connection: give
                    // this one back.
                    if self.tasks.len() > self.kept_running() {
                        slot.release();
                    }
                    self.slots.push(slot);
                }
            }
            Err(panic) => {
                // The task panicked outside a handler (handlers' panics are caught): its
                // unsettled deliveries were dropped (and its slot with them).
                if meta.kept {
                    self.slots.push(ConnectionSlot::new());
                }
                tracing::error!(
                    panic = super::sweep::panic_text(panic.as_ref()),
                    "delivery task panicked; unsettled deliveries abandoned"
                );
            }
        }
        meta
    }

    /// Drops every running task (their transactions roll back) and adds what they settled to
    /// `report`; the rest count as abandoned.
    pub(super) fn abandon_all(&mut self, report: &mut WorkerReport) {
        self.tasks.clear();
        for meta in self.meta.values() {
            Self::account(meta, report);
        }
    }

    /// Adds what a finished, aborted or panicked task settled to `report`; the deliveries it
    /// did not settle count as abandoned (dropped unsettled: the source delivers them again).
    fn account(meta: &TaskMeta, report: &mut WorkerReport) {
        let progress = lock(&meta.progress);
        report.add(&progress.report);
        report.abandoned += meta.deliveries.saturating_sub(progress.done) as u64;
    }

    /// Running tasks that took a kept slot.
    fn kept_running(&self) -> usize {
        self.meta.values().filter(|meta| meta.kept).count()
    }
}

/// A task's progress, locked (a task that panicked holding it left it as it was).
fn lock(progress: &SharedProgress) -> MutexGuard<'_, Progress> {
    progress
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// What the steps of one task share: the dispatcher, the requeue delay, and where the task
/// records each delivery it settled.
struct Task<'a, DB: InboxDatabase> {
    dispatcher: &'a Dispatcher<DB>,
    requeue_delay: Duration,
    progress: &'a SharedProgress,
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
    deliveries: Vec<Pending>,
    requeue_delay: Duration,
    options: BatchOptions,
    progress: &SharedProgress,
) -> bool {
    let task = Task {
        dispatcher,
        requeue_delay,
        progress,
    };
    let mut deliveries = task.drop_revoked(deliveries);
    if deliveries.len() > 1 {
        match task.run_batch(slot, deliveries, options).await {
            Ok(contended) => return contended,
            Err(panicked) => {
                deliveries = panicked
                    .into_iter()
                    .map(|delivery| Pending::new(delivery, None, None))
                    .collect();
            }
        }
    }
    task.run_one_by_one(slot, deliveries).await;
    false
}

impl<DB: InboxDatabase> Task<'_, DB> {
    /// Records one settled delivery's report.
    fn record(&self, one: &WorkerReport) {
        let mut progress = lock(self.progress);
        progress.report.add(one);
        progress.done += 1;
    }

    /// Settles `delivery` by its `result` (see [`settle`]) and records it.
    async fn settle(
        &self,
        slot: &mut ConnectionSlot<DB>,
        delivery: Delivery,
        result: Result<Vec<ConsumerOutcome>, DispatchError>,
    ) {
        let report = settle(self.dispatcher, slot, delivery, result, self.requeue_delay).await;
        self.record(&report);
    }

    /// The deliveries still current; those their source gave up since they were fetched (a
    /// revoked partition) are dropped, never run, and recorded as revoked.
    fn drop_revoked(&self, deliveries: Vec<Pending>) -> Vec<Pending> {
        let (deliveries, gone): (Vec<Pending>, Vec<Pending>) = deliveries
            .into_iter()
            .partition(|pending| pending.delivery.is_current());
        for Pending { delivery, .. } in gone {
            self.record(&drop_revoked(delivery));
        }
        deliveries
    }

    /// Runs `deliveries` as one batch transaction, then settles each: whether the batch lost
    /// to concurrent transactions, or the deliveries back if a handler panicked (rolled back).
    async fn run_batch(
        &self,
        slot: &mut ConnectionSlot<DB>,
        pending: Vec<Pending>,
        options: BatchOptions,
    ) -> Result<bool, Vec<Delivery>> {
        let (deliveries, decoded): (Vec<Delivery>, Vec<_>) = pending
            .into_iter()
            .map(|pending| (pending.delivery, pending.decoded))
            .unzip();
        let envelopes: Vec<&crate::Envelope> = deliveries.iter().map(Delivery::envelope).collect();
        let dispatched = AssertUnwindSafe(
            self.dispatcher
                .dispatch_batch_with(slot, &envelopes, decoded, options),
        )
        .catch_unwind()
        .await;
        drop(envelopes);
        let Ok((results, stats)) = dispatched else {
            tracing::error!(
                size = deliveries.len(),
                "a handler panicked in a batch (rolled back); running its deliveries one by one"
            );
            return Err(deliveries);
        };
        if stats.contention.is_some() {
            lock(self.progress).report.contention_fallbacks += 1;
        }
        for (delivery, result) in deliveries.into_iter().zip(results) {
            self.settle(slot, delivery, result).await;
        }
        Ok(stats.contention.is_some())
    }

    /// Runs each delivery in its own transaction and settles it; one whose handler panics is
    /// dropped unsettled (abandoned), and the others go on.
    async fn run_one_by_one(&self, slot: &mut ConnectionSlot<DB>, deliveries: Vec<Pending>) {
        for Pending {
            delivery, decoded, ..
        } in deliveries
        {
            let dispatched = AssertUnwindSafe(self.dispatcher.dispatch_decoded_on(
                slot,
                delivery.envelope(),
                decoded,
            ))
            .catch_unwind()
            .await;
            match dispatched {
                Ok(result) => self.settle(slot, delivery, result).await,
                Err(_) => {
                    tracing::error!(
                        message_name = delivery.envelope().message_name.as_str(),
                        "a handler panicked; delivery abandoned unsettled (the source delivers it again)"
                    );
                    drop(delivery);
                    let mut progress = lock(self.progress);
                    progress.report.abandoned += 1;
                    progress.done += 1;
                }
            }
        }
    }
}
