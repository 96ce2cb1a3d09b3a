//! Polling: the loop of [`Worker::run`](super::Worker::run). Each turn starts what is ready,
//! then waits for whichever comes first: shutdown, the drain deadline, a task's end, a delivery
//! from the source, idleness, a batch's linger, or a kept connection gone idle.

use std::collections::VecDeque;
use std::pin::Pin;

use tokio::time::{Instant, Sleep};
use tokio_util::sync::CancellationToken;

use crate::source::{Delivery, Source, SourceError};
use crate::store::InboxDatabase;
use crate::types::slot::ConnectionSlot;

use super::run::Done;
use super::{FAR, Loop, SLOT_IDLE, StopReason, later};

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
            if self.stop.is_some() && self.running.tasks.is_empty() {
                break;
            }
            let batch_at = self.running.batch_at(worker);
            self.arm_release(release_timer.as_mut());
            let can_fetch = self.stop.is_none() && self.in_flight < self.fetch_bound;
            let abandon_at = self.abandon_at();
            let idle_at = self.idle_at();
            let never = self.last_activity + FAR;
            tokio::select! {
                biased;
                // Also after the source ended (exhausted, failed): running deliveries then get
                // the drain timeout too.
                () = &mut cancelled, if self.drain_deadline.is_none() => {
                    self.shut_down(source.name()).await;
                }
                () = tokio::time::sleep_until(abandon_at.unwrap_or(never)),
                    if abandon_at.is_some() =>
                {
                    self.abandon(source.name());
                    break;
                }
                (id, joined) = self.running.tasks.next(), if !self.running.tasks.is_empty() => {
                    self.task_ended(id, joined);
                }
                fetched = source.next(), if can_fetch => self.fetched(source.name(), fetched),
                () = tokio::time::sleep_until(idle_at),
                    if worker.idle.is_some() && self.stop.is_none() && self.in_flight == 0 =>
                {
                    self.stop = Some(StopReason::Idle);
                }
                // No linger: the gathered deliveries start as soon as the source has no more
                // ready (this branch comes after the fetch).
                () = std::future::ready(()),
                    if batch_at.is_some() && can_batch && worker.linger.is_zero() =>
                {
                    self.running.flush(worker);
                }
                () = tokio::time::sleep_until(batch_at.unwrap_or(never)),
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
        if self.stop.is_some() || self.in_flight >= self.fetch_bound {
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

    /// When running deliveries are abandoned: the drain deadline of a shutdown or of a source
    /// failure, whichever is earlier; none before either.
    fn abandon_at(&self) -> Option<Instant> {
        match (self.drain_deadline, self.failed_deadline) {
            (Some(drain), Some(failed)) => Some(drain.min(failed)),
            (drain, failed) => drain.or(failed),
        }
    }

    /// When the worker stops for idleness (if [`stop_when_idle`](super::Worker::stop_when_idle)
    /// is set, nothing stops it yet and nothing is in flight).
    fn idle_at(&self) -> Instant {
        match (self.worker.idle, self.stop, self.in_flight) {
            (Some(idle), None, 0) => later(self.last_activity, idle),
            _ => self.last_activity + FAR,
        }
    }

    /// Task `id` ended: account for it, and start the next delivery waiting for each of its
    /// ordering keys.
    fn task_ended(&mut self, id: u64, joined: std::thread::Result<Done<DB>>) {
        self.last_activity = Instant::now();
        let meta = self
            .running
            .ended(self.worker, id, joined, &mut self.report);
        self.in_flight -= meta.deliveries;
        for key in meta.keys {
            let next = self.waiting.get_mut(&key).and_then(VecDeque::pop_front);
            match next {
                Some(delivery) if self.drain_deadline.is_none() => {
                    self.running.start(self.worker, delivery);
                }
                Some(delivery) => {
                    // Shutdown emptied the queues; nothing is queued since.
                    self.waiting.entry(key).or_default().push_front(delivery);
                }
                None => {
                    self.waiting.remove(&key);
                    self.busy.remove(&key);
                }
            }
        }
    }

    /// The source answered: a delivery to admit, the end of its deliveries, or its failure.
    fn fetched(&mut self, source: &str, fetched: Result<Option<Delivery>, SourceError>) {
        self.last_activity = Instant::now();
        match fetched {
            Ok(Some(delivery)) => {
                self.report.deliveries += 1;
                self.in_flight += 1;
                self.admit(delivery);
            }
            Ok(None) => self.stop = Some(StopReason::SourceExhausted),
            Err(error) => {
                tracing::error!(
                    source,
                    %error,
                    "source failed; finishing in-flight deliveries"
                );
                self.stop = Some(StopReason::SourceFailed);
                self.failure = Some(error);
                self.failed_deadline = Some(later(Instant::now(), self.worker.drain_timeout));
            }
        }
    }

    /// Starts `delivery`, or queues it behind a running (or queued) one of its ordering key.
    fn admit(&mut self, delivery: Delivery) {
        match delivery.ordering_key() {
            Some(key) if self.busy.contains(key) => {
                self.waiting
                    .entry(key.to_owned())
                    .or_default()
                    .push_back(delivery);
            }
            Some(key) => {
                self.busy.insert(key.to_owned());
                self.running.start(self.worker, delivery);
            }
            None => self.running.start(self.worker, delivery),
        }
    }
}
