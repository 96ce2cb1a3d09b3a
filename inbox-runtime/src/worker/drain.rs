//! Draining: on shutdown the unstarted deliveries go back to the source and the running ones
//! get the drain timeout; past it they are abandoned unsettled. Then the source is closed.

use tokio::time::Instant;

use crate::source::{Source, SourceError};
use crate::store::InboxDatabase;

use super::{Loop, StopReason, WorkerError, WorkerReport, later};

impl<DB: InboxDatabase> Loop<'_, DB> {
    /// Shutdown: no more fetching; the deliveries that have not started are handed back now
    /// (requeued), and the running ones get the drain timeout.
    pub(super) async fn shut_down(&mut self, source: &str) {
        self.stop.get_or_insert(StopReason::Shutdown);
        self.drain_deadline = Some(later(Instant::now(), self.worker.drain_timeout));
        let gathered = self.running.take_unstarted();
        let queued = self.waiting.drain().flat_map(|(_, queue)| queue);
        for delivery in gathered.into_iter().chain(queued) {
            self.in_flight -= 1;
            self.report.requeued += 1;
            if let Err(error) = delivery.requeue(None).await {
                self.report.settle_errors += 1;
                tracing::warn!(%error, "cannot requeue an unstarted delivery at shutdown");
            }
        }
        tracing::info!(
            source,
            running = self.running.tasks.len(),
            "shutdown: no more fetching; finishing running deliveries"
        );
    }

    /// The drain timeout passed: the running deliveries are dropped unsettled (their
    /// transactions roll back; the source delivers them again).
    pub(super) fn abandon(&mut self, source: &str) {
        tracing::warn!(
            source,
            running = self.running.tasks.len(),
            "drain timeout: abandoning running deliveries unsettled"
        );
        self.running.abandon_all(&mut self.report);
    }

    /// After the loop: requeues the deliveries not started (after a source failure whose drain
    /// deadline passed; shutdown handed them back already), closes the source (bounded by the drain timeout), and says
    /// how the run ended.
    pub(super) async fn finish<S: Source>(
        mut self,
        mut source: S,
    ) -> Result<WorkerReport, WorkerError> {
        let unstarted = self.running.take_unstarted();
        let queued = self.waiting.drain().flat_map(|(_, queue)| queue);
        for delivery in unstarted.into_iter().chain(queued) {
            self.report.requeued += 1;
            if delivery.requeue(None).await.is_err() {
                self.report.settle_errors += 1;
            }
        }
        let mut report = self.report;
        report.batches = self.running.batch_runs;
        report.batched = self.running.batched;
        report.max_batches_in_flight = self.running.peak_batches as u64;
        report.stop = self.stop.unwrap_or(StopReason::Shutdown);
        let drain_timeout = self.worker.drain_timeout;
        // A close on a connection that just died may never answer: bounded like the drain.
        let closed = match tokio::time::timeout(drain_timeout, source.close()).await {
            Ok(closed) => closed,
            Err(_) => Err(SourceError::new(
                source.name(),
                "close",
                format!("no answer within {} ms", drain_timeout.as_millis()),
            )),
        };
        match (self.failure, closed) {
            (Some(error), _) | (None, Err(error)) => {
                report.stop = StopReason::SourceFailed;
                Err(WorkerError { error, report })
            }
            (None, Ok(())) => Ok(report),
        }
    }
}
