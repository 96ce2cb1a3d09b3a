//! Draining: on shutdown the unstarted deliveries go back to the source and the running ones
//! get the drain timeout; past it they are abandoned unsettled. Then the source is closed.

use crate::source::Source;
use crate::store::InboxDatabase;

use super::ending::hand_back;
use super::{Loop, WorkerError, WorkerReport};

impl<DB: InboxDatabase> Loop<'_, DB> {
    /// Shutdown: no more fetching; the deliveries that have not started are handed back now
    /// (requeued), and the running ones get the drain timeout.
    pub(super) async fn shut_down(&mut self, source: &str) {
        self.end.shut_down();
        let gathered = self.running.take_unstarted();
        let queued = self.keys.drain();
        self.in_flight -= hand_back(gathered.into_iter().chain(queued), &mut self.report).await;
        tracing::info!(
            source,
            running = self.running.tasks.len(),
            "shutdown: no more fetching; finishing running deliveries"
        );
    }

    /// The drain timeout passed: the running deliveries are dropped unsettled (their
    /// transactions roll back; the source delivers them again).
    pub(super) fn abandon(&mut self, source: &str) {
        self.end.abandoning(source, self.running.tasks.len());
        self.running.abandon_all(&mut self.report);
    }

    /// After the loop: requeues the deliveries not started (after a source failure whose drain
    /// deadline passed; shutdown handed them back already), closes the source (bounded by the
    /// drain timeout), and says how the run ended.
    pub(super) async fn finish<S: Source>(
        mut self,
        source: S,
    ) -> Result<WorkerReport, WorkerError> {
        let unstarted = self.running.take_unstarted();
        let queued = self.keys.drain();
        hand_back(unstarted.into_iter().chain(queued), &mut self.report).await;
        let mut report = self.report;
        report.batches = self.running.batch_runs;
        report.batched = self.running.batched;
        report.max_batches_in_flight = self.running.peak_batches as u64;
        self.end.close(source, report).await
    }
}
