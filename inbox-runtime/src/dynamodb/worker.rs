//! The worker over DynamoDB: [`DynamoWorker`] pulls deliveries from a long-running broker
//! [`Source`] (SQS, RabbitMQ, NATS, Kafka, a file, memory), runs a [`DynamoDispatcher`] on each
//! and settles each after its consumers' `TransactWriteItems` committed, as the SQL
//! [`Worker`](crate::Worker) does with a [`Dispatcher`](crate::Dispatcher).

use std::panic::AssertUnwindSafe;
use std::sync::Arc;
use std::time::Duration;

use futures_util::FutureExt as _;
use futures_util::stream::{FuturesUnordered, StreamExt as _};
use tokio_util::sync::CancellationToken;

use super::{AdminError, DynamoConsumerOutcome, DynamoDispatcher, DynamoError};
use crate::source::{Delivery, Settlement, Source};
use crate::types::error::DispatchError;
use crate::worker::ending::{Ending, hand_back};
use crate::worker::keys::KeyQueues;
use crate::worker::settings::{Settings, shared_methods};
use crate::worker::settle::{
    Origin, Verdict, carry_out, count_result, count_settlement, drop_revoked, settlement_of,
};
use crate::worker::{StopReason, WorkerError, WorkerReport};

#[cfg(doc)]
use crate::Outcome;
#[cfg(doc)]
use crate::types::error::Disposition;

/// Pulls deliveries from a [`Source`], runs the [`DynamoDispatcher`] on each with bounded
/// concurrency, and settles each delivery strictly **after** every consumer's
/// `TransactWriteItems` committed (or its failure was recorded in the inbox table), as
/// [`dynamo_settlement_for`] says: the DynamoDB counterpart of the SQL
/// [`Worker`](crate::Worker), for a DynamoDB inbox fed by a queue outside Lambda (ECS, EC2, a
/// container). In Lambda, use [`DynamoLambdaSqs`](crate::source::lambda::DynamoLambdaSqs).
///
/// * **Concurrency**: at most [`concurrency`](Self::concurrency) deliveries are fetched and not
///   yet settled (running, or waiting for an earlier one of their ordering key); each runs its
///   consumers one after the other, each consumer in its own `TransactWriteItems`. Size the
///   broker's prefetch (SQS: [`SqsConfig::max_in_flight`](crate::source::sqs::SqsConfig)) to at
///   least that.
/// * **Tasks**: the deliveries in flight are polled on the task that runs [`run`](Self::run)
///   (no Tokio task per delivery): keep blocking work out of handlers, and await `run` inside
///   a spawned task.
/// * **Order**: deliveries with the same [ordering key](Delivery::ordering_key) (SQS FIFO: the
///   `MessageGroupId`) run one at a time, in the order the source handed them out. A requeued
///   delivery comes back when the source redelivers it. A delivery its source gave up before it
///   ran ([`Delivery::is_current`] false: a later message of an SQS FIFO group whose earlier one
///   was requeued, a revoked Kafka partition) is dropped unrun and unsettled
///   ([`WorkerReport::revoked`]); the source delivers it again in order.
/// * **Shutdown**: when the token is cancelled the worker stops fetching, requeues the
///   deliveries that wait for their ordering key (not started), lets running ones finish
///   (commit, then settle) for up to the [drain timeout](Self::drain_timeout), then drops the
///   rest unsettled (a transaction that committed meanwhile is a duplicate on the redelivery),
///   calls [`Source::close`] and, beside it, waits for a parked-message sweep in flight (each
///   for up to the drain timeout; see [`park_sweep`](Self::park_sweep)), and returns.
/// * **Source failure**: the worker stops fetching and lets running deliveries finish, for up
///   to the drain timeout from the failure, then drops the rest unsettled and returns the error.
///   [`Source::close`] gets the drain timeout too; past it, `run` returns a `close` error.
/// * **Panics**: a handler that panics drops its delivery unsettled (counted in
///   [`WorkerReport::abandoned`]; the source delivers it again); the others go on.
///
/// **Refused deliveries.** A delivery the dispatcher refuses ([`DispatchError`]: unknown or
/// missing message name, malformed payload, bad key, over the payload limit) is kept in the
/// inbox table, payload included ([`DynamoDispatcher::record_rejection`], see
/// [`rejections`](super::rejections)), logged at `warn` level, and acked, as the SQL
/// [`Worker`](crate::Worker) keeps its refusals in `inbox_rejections`. If DynamoDB fails to keep
/// it, it is requeued after [`requeue_delay`](Self::requeue_delay). Only a refused delivery
/// whose item would pass DynamoDB's 400 KB item limit (a payload over about 400 KB) cannot be
/// kept: it is logged at `error` level (message name, source, message id, offset, reason,
/// payload size) and **rejected** ([`Settlement::Reject`]), and the broker's dead-lettering
/// keeps it. So does a conflict's delivery (kept in the table too, unless too large). Configure
/// dead-lettering, or such a delivery is gone but for the log line: SQS —
/// [`RejectAction::LeaveToRedrive`](crate::source::sqs::RejectAction::LeaveToRedrive) and a
/// redrive policy (the default [`RejectAction::Delete`](crate::source::sqs::RejectAction::Delete)
/// deletes it); RabbitMQ — a dead-letter exchange on the queue; JetStream — terminated
/// (`+TERM`, an advisory is published; the message stays in the stream); Kafka and the file
/// source move past it (it stays in the log or file).
///
/// **Parked messages**: while it runs, the worker calls
/// [`DynamoDispatcher::sweep_parked`] every [`park_sweep`](Self::park_sweep) (default 60 s), as
/// the SQL [`Worker`](crate::Worker) does; parked and stale deliveries are acked (counted in
/// [`WorkerReport::parked`] and [`WorkerReport::stale`]).
///
/// **Not here** (SQL only): batches of deliveries per transaction, kept connection slots,
/// partitions, fencing hooks. [`WorkerReport`]'s `batches`, `batched`,
/// `max_batches_in_flight`, `contention_fallbacks` and `fenced` stay 0.
///
/// ```no_run
/// # async fn demo(source: impl inbox_runtime::source::Source) -> Result<(), Box<dyn std::error::Error>> {
/// use std::time::Duration;
/// use inbox_runtime::dynamodb::{DynamoDispatcher, DynamoInbox, DynamoWorker};
///
/// // `source`: an `SqsSource` (feature `sqs`) with `RejectAction::LeaveToRedrive` and a
/// // redrive policy on the queue, an `AmqpSource`, a `NatsSource`, a `KafkaSource`, a file.
/// let client = inbox_runtime::dynamodb::client(None).await;
/// let dispatcher = DynamoDispatcher::from_registry(DynamoInbox::new(client, "inbox"))?;
/// let report = DynamoWorker::new(dispatcher)
///     .concurrency(16)
///     .requeue_delay(Duration::from_secs(5))
///     .run_until_signal(source)
///     .await?;
/// println!("processed {}, rejected {}", report.processed, report.rejected);
/// # Ok(()) }
/// ```
#[derive(Debug, Clone)]
pub struct DynamoWorker {
    dispatcher: Arc<DynamoDispatcher>,
    settings: Settings,
}

/// The settlement policy of [`DynamoWorker`]: how the [`DynamoDispatcher`]'s result for one
/// delivery settles it; the SQL [`settlement_for`](crate::worker::settlement_for) over DynamoDB's
/// per-consumer results.
///
/// * every consumer's outcome is [`Outcome::Processed`], [`Outcome::Duplicate`],
///   [`Outcome::Dead`] or [`Outcome::Discarded`], or a handler failure recorded as dead now
///   ([`Disposition::Dead`]: the payload is kept in the inbox table, see
///   [`DynamoAdmin`](super::DynamoAdmin)) → [`Settlement::Ack`];
/// * a [`DispatchError`] (refused: nothing was written; the [`DynamoWorker`] first keeps it in
///   the table and acks it, and uses this policy only for one it cannot keep, see "Refused
///   deliveries"), or a consumer's [`DynamoError::Conflict`], [`DynamoError::Key`],
///   [`DynamoError::Fingerprint`] or [`DynamoError::PartitionKeyTooLong`] (consumer and key too
///   long for a DynamoDB partition key: it can never be claimed) → [`Settlement::Reject`];
/// * [`Outcome::NotYet`] → [`Settlement::Requeue`] after the time left; a handler failure to
///   retry ([`Disposition::Retry`]) → after its `after` delay; any other [`DynamoError`] (a
///   DynamoDB call that failed, a transient cancellation, contention, a transaction too large,
///   a failure not recorded) → after `requeue_delay`. Nothing of the failed consumer was
///   written; on the redelivery the consumers that did commit see a duplicate.
///
/// Requeue wins over reject, reject over ack; of several requeue delays the longest is used.
pub fn dynamo_settlement_for(
    result: &Result<Vec<DynamoConsumerOutcome>, DispatchError>,
    requeue_delay: Duration,
) -> Settlement {
    match result {
        Ok(outcomes) => settlement_of(outcomes.iter().map(verdict), requeue_delay),
        Err(_) => Settlement::Reject,
    }
}

/// The verdict of one DynamoDB consumer's result.
fn verdict(outcome: &DynamoConsumerOutcome) -> Verdict {
    match &outcome.result {
        Ok(outcome) => Verdict::of_outcome(outcome),
        Err(DynamoError::Handler(failure)) => Verdict::of_failure(failure.disposition),
        Err(DynamoError::Conflict(_)) => Verdict::Conflict,
        // A partition key too long is a key this store cannot hold, ever: a bad key.
        Err(
            DynamoError::Key(_)
            | DynamoError::Fingerprint(_)
            | DynamoError::PartitionKeyTooLong { .. },
        ) => Verdict::Invalid,
        Err(_) => Verdict::Failed(None),
    }
}

impl DynamoWorker {
    /// A worker over `dispatcher`: concurrency 8, requeue delay 1 s, drain timeout 30 s, no idle
    /// stop, the parked-message sweep every 60 s.
    pub fn new(dispatcher: DynamoDispatcher) -> Self {
        Self::from_arc(Arc::new(dispatcher))
    }

    /// A worker over a shared dispatcher.
    pub fn from_arc(dispatcher: Arc<DynamoDispatcher>) -> Self {
        Self {
            dispatcher,
            settings: Settings::default(),
        }
    }

    shared_methods! {
        dispatcher: DynamoDispatcher,
        sweep_parked: "[`DynamoDispatcher::sweep_parked`]",
        settlement: "[`dynamo_settlement_for`]",
        /// At most `n` deliveries fetched and not yet settled (at least 1). Default 8.
        concurrency;
    }

    /// As [`Worker::run`](crate::Worker::run), with this worker's DynamoDB dispatcher: runs the
    /// deliveries of `source` until it is exhausted or fails, the worker is idle (if set) or
    /// `shutdown` is cancelled; then closes the source and waits for a parked-message sweep in
    /// flight (both for up to the [drain timeout](Self::drain_timeout)), and returns what it did.
    ///
    /// # Errors
    /// As [`Worker::run`](crate::Worker::run): a [`WorkerError`] (with the report so far, `stop`
    /// [`StopReason::SourceFailed`]) if fetching from the source failed (running deliveries are
    /// finished first, for up to the drain timeout), or closing it failed or took longer than the
    /// drain timeout.
    pub async fn run<S: Source>(
        &self,
        mut source: S,
        shutdown: CancellationToken,
    ) -> Result<WorkerReport, WorkerError> {
        source.set_payload_limit(self.dispatcher.payload_limit());
        let mut run = Run::new(self);
        // The parked-message sweep runs beside the loop; a sweep in flight when the loop ends
        // finishes (within the drain timeout) before `run` returns.
        let sweep = self.sweep_parked_beside();
        run.poll(&mut source, &shutdown).await;
        let (result, ()) =
            tokio::join!(run.finish(source), sweep.stop(self.settings.drain_timeout));
        result
    }
}

/// A running delivery: its ordering key, and what it settled (or the panic that dropped it).
type Task = crate::BoxFuture<'static, (Option<String>, std::thread::Result<WorkerReport>)>;

/// The state of one [`DynamoWorker::run`].
struct Run<'w> {
    worker: &'w DynamoWorker,
    report: WorkerReport,
    tasks: FuturesUnordered<Task>,
    /// Deliveries fetched and not yet settled (running or waiting for their ordering key).
    in_flight: usize,
    keys: KeyQueues,
    end: Ending,
}

impl<'w> Run<'w> {
    fn new(worker: &'w DynamoWorker) -> Self {
        Self {
            worker,
            report: WorkerReport::default(),
            tasks: FuturesUnordered::new(),
            in_flight: 0,
            keys: KeyQueues::default(),
            end: Ending::new(&worker.settings),
        }
    }

    /// Runs the loop until it stops: the source is exhausted or failed, the worker is idle, or
    /// `shutdown` is cancelled, and nothing runs any more; or the drain deadline passed.
    async fn poll<S: Source>(&mut self, source: &mut S, shutdown: &CancellationToken) {
        let cancelled = shutdown.cancelled();
        tokio::pin!(cancelled);
        loop {
            if self.end.stop.is_some() && self.tasks.is_empty() {
                break;
            }
            let can_fetch =
                self.end.stop.is_none() && self.in_flight < self.worker.settings.concurrency;
            let at = self.end.deadlines(self.in_flight);
            tokio::select! {
                biased;
                () = &mut cancelled, if self.end.drain_deadline.is_none() => {
                    self.shut_down(source.name()).await;
                }
                () = at.timer(at.abandon), if at.abandon.is_some() => {
                    self.end.abandoning(source.name(), self.tasks.len());
                    self.report.abandoned += self.tasks.len() as u64;
                    self.tasks = FuturesUnordered::new();
                    break;
                }
                Some((key, joined)) = self.tasks.next(), if !self.tasks.is_empty() => {
                    self.ended(key, joined);
                }
                fetched = source.next(), if can_fetch => {
                    if let Some(delivery) = self.end.fetched(source.name(), fetched) {
                        self.report.deliveries += 1;
                        self.in_flight += 1;
                        if let Some(delivery) = self.keys.admit(delivery) {
                            self.start(delivery);
                        }
                    }
                }
                () = at.timer(at.idle), if at.idle.is_some() => {
                    self.end.stop = Some(StopReason::Idle);
                }
            }
        }
    }

    /// Starts `delivery`: dispatch, then settle, polled with the others on the worker's task.
    fn start(&mut self, delivery: Delivery) {
        let dispatcher = Arc::clone(&self.worker.dispatcher);
        let requeue_delay = self.worker.settings.requeue_delay;
        let key = delivery.ordering_key().map(str::to_owned);
        let task = AssertUnwindSafe(process(dispatcher, delivery, requeue_delay))
            .catch_unwind()
            .map(move |joined| (key, joined));
        self.tasks.push(Box::pin(task));
    }

    /// A delivery's task ended: count it, and start the next delivery of its ordering key.
    fn ended(&mut self, key: Option<String>, joined: std::thread::Result<WorkerReport>) {
        self.end.last_activity = tokio::time::Instant::now();
        self.in_flight -= 1;
        match joined {
            Ok(one) => self.report.add(&one),
            Err(_) => {
                tracing::error!(
                    "a DynamoDB handler panicked; delivery abandoned unsettled (the source delivers it again)"
                );
                self.report.abandoned += 1;
            }
        }
        let start = self.end.drain_deadline.is_none();
        if let Some(next) = key.and_then(|key| self.keys.ended(&key, start)) {
            self.start(next);
        }
    }

    /// Shutdown: no more fetching; the deliveries waiting for their ordering key are handed
    /// back (requeued), and the running ones get the drain timeout.
    async fn shut_down(&mut self, source: &str) {
        self.end.shut_down();
        self.in_flight -= hand_back(self.keys.drain(), &mut self.report).await;
        tracing::info!(
            source,
            running = self.tasks.len(),
            "shutdown: no more fetching; finishing running deliveries"
        );
    }

    /// After the loop: hands back what still waits (after a source failure), closes the source
    /// and says how the run ended.
    async fn finish<S: Source>(mut self, source: S) -> Result<WorkerReport, WorkerError> {
        hand_back(self.keys.drain(), &mut self.report).await;
        self.end.close(source, self.report).await
    }
}

/// Dispatches `delivery`, then settles it by [`dynamo_settlement_for`]: what it did, for the
/// report. A refused delivery is logged with what identifies it; one its source gave up since
/// it was fetched (see [`Delivery::is_current`]) is dropped unrun and unsettled (revoked).
async fn process(
    dispatcher: Arc<DynamoDispatcher>,
    delivery: Delivery,
    requeue_delay: Duration,
) -> WorkerReport {
    if !delivery.is_current() {
        return drop_revoked(delivery);
    }
    let result = dispatcher.dispatch(delivery.envelope()).await;
    let mut report = WorkerReport::default();
    let envelope = delivery.envelope();
    let origin = Origin::of(envelope);
    let settlement = match &result {
        Err(error) => {
            report.invalid += 1;
            keep_refused(&dispatcher, envelope, &origin, error, requeue_delay).await
        }
        Ok(outcomes) => {
            for outcome in outcomes {
                let verdict = verdict(outcome);
                count_result(
                    &mut report,
                    &origin,
                    outcome.consumer,
                    verdict,
                    &outcome.result,
                );
            }
            dynamo_settlement_for(&result, requeue_delay)
        }
    };
    count_settlement(&mut report, settlement);
    drop(result);
    carry_out(&mut report, delivery, settlement).await;
    report
}

/// The settlement of a delivery the dispatcher refused: kept in the inbox table
/// ([`DynamoDispatcher::record_rejection`]), then acked: nothing is lost. If it cannot be kept
/// (DynamoDB failed), it is requeued after `requeue_delay`, as on the SQL stores: a reject would
/// make many sources drop it. If it can never be kept (its item would pass DynamoDB's 400 KB
/// limit), it is rejected: the broker's dead-lettering is then what keeps it.
async fn keep_refused(
    dispatcher: &DynamoDispatcher,
    envelope: &crate::Envelope,
    origin: &Origin<'_>,
    error: &DispatchError,
    requeue_delay: Duration,
) -> Settlement {
    let message_id = envelope
        .source
        .as_ref()
        .and_then(|m| m.message_id.as_deref());
    let kept = dispatcher.record_rejection(envelope, error).await;
    let (settlement, what) = match &kept {
        Ok(kept) if kept.loses_nothing(error) => (
            Settlement::Ack,
            "refused delivery kept as a rejection in the inbox table; acking it",
        ),
        Ok(_) => (
            Settlement::Reject,
            "refused delivery kept cut to DynamoDB's item size limit; rejecting it at the \
             broker, whose dead-lettering keeps it whole",
        ),
        Err(AdminError::ItemTooLarge { .. }) => (
            Settlement::Reject,
            "refused delivery too large to keep in DynamoDB; rejecting it at the broker (its \
             dead-lettering keeps it)",
        ),
        Err(_) => (
            Settlement::Requeue {
                delay: Some(requeue_delay),
            },
            "refused delivery not kept (DynamoDB failed); requeueing it",
        ),
    };
    let error_text = kept.as_ref().err().map(tracing::field::display);
    if settlement == Settlement::Ack {
        tracing::warn!(
            message_name = origin.message_name,
            source = origin.source,
            message_id,
            offset = origin.offset,
            reason = %error,
            "{what}"
        );
    } else {
        tracing::error!(
            message_name = origin.message_name,
            source = origin.source,
            message_id,
            offset = origin.offset,
            payload_bytes = envelope.payload.len(),
            reason = %error,
            error = error_text,
            "{what}"
        );
    }
    settlement
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Outcome;
    use crate::dynamodb::CancellationReason;
    use crate::types::classify::ErrorClass;
    use crate::types::error::{Disposition, HandlerFailure};
    use crate::types::key::IdempotencyKey;

    const DELAY: Duration = Duration::from_secs(7);

    fn outcome(result: Result<Outcome<()>, DynamoError<crate::BoxError>>) -> DynamoConsumerOutcome {
        DynamoConsumerOutcome {
            consumer: "c",
            function: "f",
            result,
        }
    }

    fn key() -> IdempotencyKey {
        IdempotencyKey::new("k", "m", "id").unwrap()
    }

    fn failure(disposition: Disposition) -> DynamoError<crate::BoxError> {
        DynamoError::Handler(HandlerFailure {
            error: super::super::Failed::Handler("boom".into()),
            class: ErrorClass::Retryable,
            attempts: 1,
            disposition,
        })
    }

    fn settle(results: Vec<Result<Outcome<()>, DynamoError<crate::BoxError>>>) -> Settlement {
        dynamo_settlement_for(&Ok(results.into_iter().map(outcome).collect()), DELAY)
    }

    /// Throttling and transaction conflicts on every try, contention, an unknown outcome, a
    /// failure not recorded: requeued after `requeue_delay`, never acked or rejected.
    #[test]
    fn transient_and_unknown_outcomes_are_requeued() {
        let requeue = Settlement::Requeue { delay: Some(DELAY) };
        let transient = DynamoError::Transient {
            tries: 3,
            reasons: vec![CancellationReason {
                index: 0,
                code: "ThrottlingError".to_owned(),
                message: None,
            }],
        };
        let contended = DynamoError::Contended {
            consumer: "c".to_owned(),
            key: key(),
        };
        let unknown = DynamoError::Dynamo {
            consumer: "c".to_owned(),
            key: key(),
            operation: "TransactWriteItems",
            source: "connection reset".into(),
        };
        for error in [
            transient,
            contended,
            unknown,
            failure(Disposition::NotRecorded),
        ] {
            assert_eq!(settle(vec![Err(error)]), requeue);
        }
        // With a consumer that committed: still requeued (it sees a duplicate next time).
        let unknown = DynamoError::Dynamo {
            consumer: "c".to_owned(),
            key: key(),
            operation: "TransactWriteItems",
            source: "timeout".into(),
        };
        assert_eq!(
            settle(vec![Ok(Outcome::Processed(())), Err(unknown)]),
            requeue
        );
    }

    /// A key this store can never hold is rejected as a bad key is, beside a processed one.
    #[test]
    fn a_partition_key_too_long_is_rejected_as_a_bad_key() {
        let too_long = DynamoError::PartitionKeyTooLong {
            consumer: "c".repeat(2000),
            key: key(),
            bytes: 2004,
            max: crate::dynamodb::MAX_PARTITION_KEY_BYTES,
        };
        assert_eq!(
            settle(vec![Ok(Outcome::Processed(())), Err(too_long)]),
            Settlement::Reject
        );
    }

    #[test]
    fn dead_now_acks_and_a_retry_waits_its_own_delay() {
        assert_eq!(
            settle(vec![
                Ok(Outcome::Processed(())),
                Err(failure(Disposition::Dead))
            ]),
            Settlement::Ack
        );
        let after = Duration::from_secs(60);
        assert_eq!(
            settle(vec![
                Err(failure(Disposition::Retry { after })),
                Ok(Outcome::NotYet {
                    retry_in: Duration::from_secs(2)
                })
            ]),
            Settlement::Requeue { delay: Some(after) }
        );
    }
}
