//! What a run did and why it stopped: [`WorkerReport`], [`StopReason`], [`WorkerError`].

use crate::source::SourceError;

#[cfg(doc)]
use super::{Worker, cancel_on_signal};
#[cfg(doc)]
use crate::{DispatchError, Error, source::Delivery, types::outcome::Outcome};

/// Why [`Worker::run`] (or `dynamodb::DynamoWorker::run`) returned.
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

/// What one [`Worker::run`] (or, feature `dynamodb`, one `dynamodb::DynamoWorker::run`) did.
/// Consumer counts are per consumer outcome (a message routed to
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
    /// ([`Fenced`](crate::protocol::Fenced): their partition belongs to another consumer now):
    /// rolled back, nothing recorded, not acked; the partition's new owner processes them.
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
    /// The most batch transactions that ran at once (see [`Worker::concurrency`]; batches whose
    /// deliveries declare their partitions run side by side from the start, see
    /// [`Worker::batch`]).
    pub max_batches_in_flight: u64,
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
            max_batches_in_flight: 0,
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

impl WorkerReport {
    /// Adds `one`'s counts (not its `deliveries`, `abandoned` or `stop`) to these.
    pub(crate) fn add(&mut self, one: &WorkerReport) {
        self.processed += one.processed;
        self.duplicates += one.duplicates;
        self.conflicts += one.conflicts;
        self.stale += one.stale;
        self.parked += one.parked;
        self.not_yet += one.not_yet;
        self.invalid += one.invalid;
        self.dead += one.dead;
        self.discarded += one.discarded;
        self.failed += one.failed;
        self.acked += one.acked;
        self.rejected += one.rejected;
        self.requeued += one.requeued;
        self.settle_errors += one.settle_errors;
        self.fenced += one.fenced;
        self.revoked += one.revoked;
        self.contention_fallbacks += one.contention_fallbacks;
        self.batches += one.batches;
        self.batched += one.batched;
    }
}
