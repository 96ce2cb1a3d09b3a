//! Settling one delivery after its transactions committed: the policy ([`settlement_for`]),
//! what the run counts and logs of each consumer's outcome, and the ack, reject or requeue.

use std::time::Duration;

use crate::dispatch::dispatcher::{ConsumerOutcome, Dispatcher};
use crate::source::{Delivery, Settlement};
use crate::store::InboxDatabase;
use crate::types::classify::BoxError;
use crate::types::envelope::Envelope;
use crate::types::error::{DispatchError, Disposition, Error, HookError};
use crate::types::outcome::Outcome;
use crate::types::slot::ConnectionSlot;

#[cfg(doc)]
use super::Worker;
use super::WorkerReport;

/// The dispatcher's result for one delivery: each consumer's outcome, or why none ran.
type Dispatched = Result<Vec<ConsumerOutcome>, DispatchError>;

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
    match result {
        Ok(outcomes) => settlement_of(
            outcomes.iter().map(|outcome| Verdict::of(&outcome.result)),
            requeue_delay,
        ),
        Err(_) => Settlement::Reject,
    }
}

/// What one consumer's result means for its delivery and for the run's report: the input of the
/// settlement policy, from the SQL dispatcher's results ([`Verdict::of`]) or the DynamoDB one's.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Verdict {
    /// [`Outcome::Processed`].
    Processed,
    /// [`Outcome::Duplicate`].
    Duplicate,
    /// [`Outcome::Dead`]: dead-lettered earlier.
    Dead,
    /// [`Outcome::Discarded`].
    Discarded,
    /// [`Outcome::Stale`].
    Stale,
    /// [`Outcome::Parked`].
    Parked,
    /// A handler failure recorded as dead now (the payload is kept in the inbox).
    DeadNow,
    /// [`Outcome::NotYet`]: requeue with the time left.
    NotYet(Duration),
    /// The same key with another payload.
    Conflict,
    /// The message has no usable key or cannot be fingerprinted.
    Invalid,
    /// A failure to requeue: after this delay (a handler's [`Disposition::Retry`]), or after the
    /// worker's `requeue_delay` (`None`: a database error, a failure not recorded, an outcome the
    /// policy does not know).
    Failed(Option<Duration>),
}

impl Verdict {
    /// The verdict of an outcome.
    pub(crate) fn of_outcome(outcome: &Outcome<()>) -> Self {
        match outcome {
            Outcome::Processed(()) => Self::Processed,
            Outcome::Duplicate => Self::Duplicate,
            Outcome::Dead => Self::Dead,
            Outcome::Discarded => Self::Discarded,
            Outcome::Stale => Self::Stale,
            Outcome::Parked => Self::Parked,
            Outcome::NotYet { retry_in } => Self::NotYet(*retry_in),
            // Outcomes added later, until the policy knows them.
            #[allow(unreachable_patterns)]
            _ => Self::Failed(None),
        }
    }

    /// The verdict of a handler failure of `disposition`.
    pub(crate) fn of_failure(disposition: Disposition) -> Self {
        match disposition {
            _ if disposition.is_settled() => Self::DeadNow,
            Disposition::Retry { after } => Self::Failed(Some(after)),
            _ => Self::Failed(None),
        }
    }

    /// The verdict of one consumer's result of the SQL [`Dispatcher`].
    fn of(result: &Result<Outcome<()>, Error<BoxError>>) -> Self {
        match result {
            Ok(outcome) => Self::of_outcome(outcome),
            Err(Error::Handler(failure)) => Self::of_failure(failure.disposition),
            Err(Error::Conflict(_)) => Self::Conflict,
            Err(Error::Key(_) | Error::Fingerprint(_)) => Self::Invalid,
            Err(_) => Self::Failed(None),
        }
    }
}

/// The settlement of a delivery whose consumers' results are `verdicts` (see
/// [`settlement_for`]): requeue wins over reject, reject over ack; of several requeue delays the
/// longest is used.
pub(crate) fn settlement_of(
    verdicts: impl IntoIterator<Item = Verdict>,
    requeue_delay: Duration,
) -> Settlement {
    let mut reject = false;
    let mut requeue: Option<Duration> = None;
    for verdict in verdicts {
        let delay = match verdict {
            Verdict::NotYet(retry_in) => retry_in,
            Verdict::Failed(after) => after.unwrap_or(requeue_delay),
            Verdict::Conflict | Verdict::Invalid => {
                reject = true;
                continue;
            }
            Verdict::Processed
            | Verdict::Duplicate
            | Verdict::Dead
            | Verdict::Discarded
            | Verdict::Stale
            | Verdict::Parked
            | Verdict::DeadNow => continue,
        };
        requeue = Some(requeue.map_or(delay, |d| d.max(delay)));
    }
    match (requeue, reject) {
        (Some(delay), _) => Settlement::Requeue { delay: Some(delay) },
        (None, true) => Settlement::Reject,
        (None, false) => Settlement::Ack,
    }
}

/// Settles one delivery by the dispatcher's `result` for it: decide, count and log, settle.
pub(super) async fn settle<DB: InboxDatabase>(
    dispatcher: &Dispatcher<DB>,
    slot: &mut ConnectionSlot<DB>,
    delivery: Delivery,
    result: Dispatched,
    requeue_delay: Duration,
) -> WorkerReport {
    let mut report = WorkerReport::default();
    // A transaction fenced by a hook belongs to another consumer now: not settled at all.
    if let Some(fenced) = fenced(&result) {
        tracing::warn!(
            message_name = delivery.envelope().message_name.as_str(),
            reason = %fenced.source,
            "fenced: the partition belongs to another consumer now; delivery dropped unsettled"
        );
        report.fenced += 1;
        drop(delivery);
        return report;
    }
    let settlement = decide(
        dispatcher,
        slot,
        delivery.envelope(),
        &result,
        requeue_delay,
    )
    .await;
    count(&mut report, delivery.envelope(), &result, settlement);
    drop(result);
    carry_out(&mut report, delivery, settlement).await;
    report
}

/// Drops `delivery`, which its source gave up since it was fetched ([`Delivery::is_current`]
/// false: a Kafka partition revoked, a later delivery of an SQS FIFO group whose earlier one was
/// requeued), unsettled and never run: the report of one revoked delivery.
pub(crate) fn drop_revoked(delivery: Delivery) -> WorkerReport {
    tracing::debug!(
        message_name = delivery.envelope().message_name.as_str(),
        "delivery no longer current (its source gave it up); dropped before it ran"
    );
    drop(delivery);
    WorkerReport {
        revoked: 1,
        ..WorkerReport::default()
    }
}

/// The hook error of a consumer whose transaction a hook fenced, if any.
fn fenced(result: &Dispatched) -> Option<&HookError> {
    result
        .as_ref()
        .ok()?
        .iter()
        .find_map(|outcome| match &outcome.result {
            Err(Error::Hook(hook)) if hook.is_fenced() => Some(hook),
            _ => None,
        })
}

/// The settlement of `result` ([`settlement_for`]). A delivery the dispatcher refuses is kept in
/// `inbox_rejections` (payload included); once it is, acking it loses nothing. If it cannot be
/// kept (the database failed), it is requeued after `requeue_delay`: a reject would make many
/// sources drop it (SQS deletes, AMQP without a dead-letter exchange drops, NATS terminates,
/// Kafka moves past it), stored nowhere. Its redelivery tries to keep it again.
async fn decide<DB: InboxDatabase>(
    dispatcher: &Dispatcher<DB>,
    slot: &mut ConnectionSlot<DB>,
    envelope: &Envelope,
    result: &Dispatched,
    requeue_delay: Duration,
) -> Settlement {
    let Err(error) = result else {
        return settlement_for(result, requeue_delay);
    };
    match dispatcher.record_rejection_on(slot, envelope, error).await {
        Ok(()) => Settlement::Ack,
        Err(record_error) => {
            tracing::error!(
                error = %record_error,
                "could not keep the refused delivery in inbox_rejections; requeueing it"
            );
            Settlement::Requeue {
                delay: Some(requeue_delay),
            }
        }
    }
}

/// Where a delivery came from, for the log lines about its consumers.
pub(crate) struct Origin<'a> {
    pub(crate) message_name: &'a str,
    pub(crate) source: &'a str,
    pub(crate) offset: Option<i64>,
}

impl<'a> Origin<'a> {
    pub(crate) fn of(envelope: &'a Envelope) -> Self {
        let source = envelope.source.as_ref();
        Self {
            message_name: envelope.message_name.as_str(),
            source: source.map_or("", |s| s.source.as_str()),
            offset: source.and_then(|s| s.offset),
        }
    }
}

/// Logs, at `$level` (`error` or `warn`), why `$consumer` did not settle its outcome as usual,
/// with where the delivery came from (an [`Origin`]).
macro_rules! consumer_event {
    ($level:ident, $origin:expr, $consumer:expr, $reason:expr, $what:literal) => {
        tracing::$level!(
            message_name = $origin.message_name,
            consumer = $consumer,
            source = $origin.source,
            offset = $origin.offset,
            reason = %$reason,
            $what
        )
    };
}

/// Counts (and logs) the refusal or each consumer's outcome, and the settlement, in `report`.
fn count(
    report: &mut WorkerReport,
    envelope: &Envelope,
    result: &Dispatched,
    settlement: Settlement,
) {
    let origin = Origin::of(envelope);
    match result {
        Err(error) => {
            report.invalid += 1;
            tracing::warn!(
                message_name = origin.message_name,
                source = origin.source,
                offset = origin.offset,
                reason = %error,
                "{}",
                if matches!(settlement, Settlement::Ack) {
                    "refused delivery: the dispatcher cannot route it; kept in inbox_rejections"
                } else {
                    "refused delivery: the dispatcher cannot route it; not kept, requeued"
                }
            );
        }
        Ok(outcomes) => {
            for outcome in outcomes {
                count_outcome(report, &origin, outcome);
            }
        }
    }
    count_settlement(report, settlement);
}

/// Counts one consumer's outcome in `report`, and logs the ones that are not plain.
fn count_outcome(report: &mut WorkerReport, origin: &Origin<'_>, outcome: &ConsumerOutcome) {
    let verdict = Verdict::of(&outcome.result);
    count_result(report, origin, outcome.consumer, verdict, &outcome.result);
}

/// Counts one consumer's `verdict` on its `result` (see [`count_verdict`]; the reason logged is
/// its error, or its outcome's kind).
pub(crate) fn count_result<E: std::fmt::Display>(
    report: &mut WorkerReport,
    origin: &Origin<'_>,
    consumer: &str,
    verdict: Verdict,
    result: &Result<Outcome<()>, E>,
) {
    match result {
        Err(error) => count_verdict(report, origin, consumer, verdict, error),
        Ok(other) => count_verdict(report, origin, consumer, verdict, &other.kind()),
    }
}

/// Counts one consumer's `verdict` in `report`, and logs the ones that are not plain with their
/// `reason` (the consumer's error, or its outcome's kind).
fn count_verdict(
    report: &mut WorkerReport,
    origin: &Origin<'_>,
    consumer: &str,
    verdict: Verdict,
    reason: &dyn std::fmt::Display,
) {
    match verdict {
        Verdict::Processed => report.processed += 1,
        Verdict::Duplicate => report.duplicates += 1,
        Verdict::Dead => report.dead += 1,
        Verdict::Discarded => report.discarded += 1,
        Verdict::Stale => report.stale += 1,
        Verdict::Parked => report.parked += 1,
        Verdict::NotYet(_) => report.not_yet += 1,
        Verdict::DeadNow => {
            report.dead += 1;
            consumer_event!(
                error,
                origin,
                consumer,
                reason,
                "dead-lettered in the inbox; acking the delivery"
            );
        }
        Verdict::Conflict => {
            report.conflicts += 1;
            consumer_event!(
                error,
                origin,
                consumer,
                reason,
                "rejecting delivery: conflict"
            );
        }
        Verdict::Invalid => {
            report.invalid += 1;
            consumer_event!(
                error,
                origin,
                consumer,
                reason,
                "rejecting delivery: invalid message"
            );
        }
        Verdict::Failed(_) => {
            report.failed += 1;
            consumer_event!(
                warn,
                origin,
                consumer,
                reason,
                "consumer failed; requeueing the delivery"
            );
        }
    }
}

/// Counts `settlement` in `report`: acked, rejected or requeued.
pub(crate) fn count_settlement(report: &mut WorkerReport, settlement: Settlement) {
    match settlement {
        Settlement::Ack => report.acked += 1,
        Settlement::Reject => report.rejected += 1,
        Settlement::Requeue { .. } => report.requeued += 1,
    }
}

/// Carries `settlement` out on the source; a settlement that fails is counted and logged (the
/// source delivers the message again).
pub(crate) async fn carry_out(
    report: &mut WorkerReport,
    delivery: Delivery,
    settlement: Settlement,
) {
    let message_name = delivery.envelope().message_name.clone();
    if let Err(error) = delivery.settle(settlement).await {
        report.settle_errors += 1;
        tracing::warn!(
            message_name,
            settlement = settlement.kind(),
            %error,
            "cannot settle the delivery; the source will deliver it again"
        );
    }
}
