//! Polling: the loop of [`Worker::run`](super::Worker::run). Each turn starts what is ready,
//! then waits for whichever comes first: shutdown, the drain deadline, a task's end, a delivery
//! from the source, idleness, a batch's linger, or a kept connection gone idle.

use std::pin::Pin;

use tokio::time::{Instant, Sleep};
use tokio_util::sync::CancellationToken;

use crate::source::{Delivery, Source, SourceError};
use crate::store::InboxDatabase;
use crate::types::slot::ConnectionSlot;

use super::run::Done;
use super::{Loop, SLOT_IDLE, StopReason, later};

impl<DB: InboxDatabase> Loop<'_, DB> {
    /// Runs the loop until it stops: the source is exhausted or failed, the worker is idle, or
    /// `shutdown` is cancelled, and nothing runs any more; or the drain deadline passed.
    pub(super) async fn poll<S: Source>(&mut self, source: &mut S, shutdown: &CancellationToken) {
        let worker = self.worker;
        let cancelled = shutdown.cancelled();
        tokio::pin!(cancelled);
        let release_timer = tokio::time::sleep_until(Instant::now());
        tokio::pin!(release_timer);
        loop {
            self.start_ready();
            let can_batch = self.running.can_start_batch(worker);
            if self.end.stop.is_some() && self.running.tasks.is_empty() {
                break;
            }
            let batch_at = self.running.batch_at(worker);
            self.arm_release(release_timer.as_mut());
            let can_fetch = self.end.stop.is_none() && self.in_flight < self.fetch_bound;
            let at = self.end.deadlines(self.in_flight);
            tokio::select! {
                biased;
                // Also after the source ended (exhausted, failed): running deliveries then get
                // the drain timeout too.
                () = &mut cancelled, if self.end.drain_deadline.is_none() => {
                    self.shut_down(source.name()).await;
                }
                () = at.timer(at.abandon), if at.abandon.is_some() => {
                    self.abandon(source.name());
                    break;
                }
                (id, joined) = self.running.tasks.next(), if !self.running.tasks.is_empty() => {
                    self.task_ended(id, joined);
                }
                fetched = source.next(), if can_fetch => self.fetched(source.name(), fetched),
                () = at.timer(at.idle), if at.idle.is_some() => {
                    self.end.stop = Some(StopReason::Idle);
                }
                // No linger: the gathered deliveries start as soon as the source has no more
                // ready (this branch comes after the fetch).
                () = std::future::ready(()),
                    if batch_at.is_some() && can_batch && worker.linger.is_zero() =>
                {
                    self.running.flush(worker);
                }
                () = at.timer(batch_at),
                    if batch_at.is_some() && can_batch && !worker.linger.is_zero() =>
                {
                    self.running.flush(worker);
                }
                () = &mut release_timer, if self.release_armed => self.release_idle_slots(),
            }
        }
    }

    /// Full batches start while they may; the ready deliveries start (as batches of whatever
    /// is there) once nothing more can join them.
    fn start_ready(&mut self) {
        self.running.flush_full(self.worker);
        if self.end.stop.is_some() || self.in_flight >= self.fetch_bound {
            self.running.flush_all(self.worker);
        }
    }

    /// Sets `timer` to the next time a kept slot's connection has been unused for `SLOT_IDLE`:
    /// one timer, armed at most once per `SLOT_IDLE` (not a timer per delivery); firing early
    /// only re-checks.
    fn arm_release(&mut self, timer: Pin<&mut Sleep>) {
        if self.release_armed {
            return;
        }
        if let Some(at) = self
            .running
            .slots
            .iter()
            .filter_map(ConnectionSlot::idle_for)
            .map(|idle| SLOT_IDLE.saturating_sub(idle))
            .min()
            .map(|wait| later(Instant::now(), wait))
        {
            timer.reset(at);
            self.release_armed = true;
        }
    }

    /// Gives the connections of kept slots unused for `SLOT_IDLE` back to the pool.
    fn release_idle_slots(&mut self) {
        self.release_armed = false;
        for slot in &mut self.running.slots {
            if slot.idle_for().is_some_and(|idle| idle >= SLOT_IDLE) {
                slot.release();
            }
        }
    }

    /// Task `id` ended: account for it, and start the next delivery waiting for each of its
    /// ordering keys.
    fn task_ended(&mut self, id: u64, joined: std::thread::Result<Done<DB>>) {
        self.end.last_activity = Instant::now();
        let meta = self
            .running
            .ended(self.worker, id, joined, &mut self.report);
        self.in_flight -= meta.deliveries;
        for key in meta.keys {
            // After shutdown nothing waits (it went back to the source) and nothing starts.
            let start = self.end.drain_deadline.is_none();
            if let Some(delivery) = self.keys.ended(&key, start) {
                self.running.start(self.worker, delivery);
            }
        }
    }

    /// The source answered: a delivery to admit, the end of its deliveries, or its failure.
    fn fetched(&mut self, source: &str, fetched: Result<Option<Delivery>, SourceError>) {
        if let Some(delivery) = self.end.fetched(source, fetched) {
            self.report.deliveries += 1;
            self.in_flight += 1;
            self.admit(delivery);
        }
    }

    /// Starts `delivery`, or queues it behind a running (or queued) one of its ordering key.
    fn admit(&mut self, delivery: Delivery) {
        if let Some(delivery) = self.keys.admit(delivery) {
            self.running.start(self.worker, delivery);
        }
    }
}
