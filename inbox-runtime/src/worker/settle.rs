//! Settling one delivery after its transactions committed: the policy ([`settlement_for`]),
//! what the run counts and logs of each consumer's outcome, and the ack, reject or requeue.

use std::time::Duration;

use crate::dispatch::dispatcher::{ConsumerOutcome, Dispatcher};
use crate::source::{Delivery, Settlement};
use crate::store::InboxDatabase;
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
    let outcomes = match result {
        Ok(outcomes) => outcomes,
        Err(_) => return Settlement::Reject,
    };
    let mut reject = false;
    let mut requeue: Option<Duration> = None;
    for outcome in outcomes {
        match &outcome.result {
            Ok(
                Outcome::Processed(())
                | Outcome::Duplicate
                | Outcome::Dead
                | Outcome::Discarded
                | Outcome::Stale
                | Outcome::Parked,
            ) => {}
            Err(Error::Handler(failure)) if failure.disposition.is_settled() => {}
            Ok(Outcome::NotYet { retry_in }) => {
                requeue = Some(requeue.map_or(*retry_in, |d| d.max(*retry_in)));
            }
            Err(Error::Conflict(_) | Error::Key(_) | Error::Fingerprint(_)) => reject = true,
            Err(Error::Handler(failure)) => {
                let delay = match failure.disposition {
                    Disposition::Retry { after } => after,
                    _ => requeue_delay,
                };
                requeue = Some(requeue.map_or(delay, |d| d.max(delay)));
            }
            // Database errors, and outcomes added later until they are known here.
            _ => requeue = Some(requeue.map_or(requeue_delay, |d| d.max(requeue_delay))),
        }
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
struct Origin<'a> {
    message_name: &'a str,
    source: &'a str,
    offset: Option<i64>,
}

impl<'a> Origin<'a> {
    fn of(envelope: &'a Envelope) -> Self {
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
    match settlement {
        Settlement::Ack => report.acked += 1,
        Settlement::Reject => report.rejected += 1,
        Settlement::Requeue { .. } => report.requeued += 1,
    }
}

/// Counts one consumer's outcome in `report`, and logs the ones that are not plain.
fn count_outcome(report: &mut WorkerReport, origin: &Origin<'_>, outcome: &ConsumerOutcome) {
    let consumer = outcome.consumer;
    match &outcome.result {
        Ok(Outcome::Processed(())) => report.processed += 1,
        Ok(Outcome::Duplicate) => report.duplicates += 1,
        Ok(Outcome::Dead) => report.dead += 1,
        Ok(Outcome::Discarded) => report.discarded += 1,
        Ok(Outcome::Stale) => report.stale += 1,
        Ok(Outcome::Parked) => report.parked += 1,
        Ok(Outcome::NotYet { .. }) => report.not_yet += 1,
        Err(Error::Handler(failure)) if failure.disposition.is_settled() => {
            report.dead += 1;
            consumer_event!(
                error,
                origin,
                consumer,
                failure,
                "dead-lettered in the inbox; acking the delivery"
            );
        }
        Err(error @ Error::Conflict(_)) => {
            report.conflicts += 1;
            consumer_event!(
                error,
                origin,
                consumer,
                error,
                "rejecting delivery: conflict"
            );
        }
        Err(error @ (Error::Key(_) | Error::Fingerprint(_))) => {
            report.invalid += 1;
            consumer_event!(
                error,
                origin,
                consumer,
                error,
                "rejecting delivery: invalid message"
            );
        }
        Err(error) => {
            report.failed += 1;
            consumer_event!(
                warn,
                origin,
                consumer,
                error,
                "consumer failed; requeueing the delivery"
            );
        }
        // Outcomes added later, until the policy knows them.
        #[allow(unreachable_patterns)]
        Ok(other) => {
            report.failed += 1;
            tracing::warn!(
                message_name = origin.message_name,
                consumer,
                outcome = other.kind(),
                "outcome unknown to the settlement policy; requeueing the delivery"
            );
        }
    }
}

/// Carries `settlement` out on the source; a settlement that fails is counted and logged (the
/// source delivers the message again).
async fn carry_out(report: &mut WorkerReport, delivery: Delivery, settlement: Settlement) {
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
