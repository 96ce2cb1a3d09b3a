//! The single-delivery driver: one consumer's processing of one message, in its own
//! transaction, with in-process retries of transient faults and the failure recorded.

use std::time::Instant;

use serde::Serialize;
use tracing::Instrument as _;

use super::Decision;
use super::Wait;
use super::failure::{Attempt, Subject, aborted_transaction_text, record_conflict};
use super::hooks::{ClaimInfo, Fenced, HookRunner};
use super::machine::{Claimed, Found, Opened, Uncommitted, commit, open, peek, run_body};
use super::tx::{ClaimTx, Hold, Owner, Verify, end_spare};
use crate::BoxFuture;
use crate::store::{ClaimRequest, InboxConnection, MessageMark, OrderingStore as _};
use crate::types::classify::{BoxError, Classify as _, ErrorClass};
use crate::types::envelope::SourceMetadata;
use crate::types::error::StoreOperation;
use crate::types::error::{Conflict, Disposition, Error, HandlerFailure, HookError, StoreError};
use crate::types::fingerprint::Fingerprint;
use crate::types::key::{IdempotencyKey, KeyError};
use crate::types::message::Message;
use crate::types::ordering::{GapPolicy, Ordering};
use crate::types::outcome::Outcome;
use crate::types::policy::RetryPolicy;
use crate::types::status::{ClaimMode, Status};

/// The `Ok` and `Err` types of a handler's declared return type (any alias of `Result`).
#[doc(hidden)]
pub trait HandlerResult {
    type Ok;
    type Err;
}

impl<T, E> HandlerResult for Result<T, E> {
    type Ok = T;
    type Err = E;
}

/// What every `#[idempotent]` function declares, whatever its backend: its message, its
/// result types, its consumer and the policies of its attribute. The SQL [`Handler`] and the
/// DynamoDB handler add the connection and the call (generated code only).
#[doc(hidden)]
pub trait HandlerSpec: Send + Sync + 'static {
    /// The message type of the second parameter.
    type Message: Message;
    /// The handler's `Ok` type.
    type Output: Send + 'static;
    /// The handler's `Err` type.
    type Error: std::fmt::Display + Send + 'static;
    /// The consumer name: the inbox scope of this handler.
    const CONSUMER: &'static str;
    /// Module path and name of the function, for diagnostics.
    const FUNCTION: &'static str;
    /// `#[idempotent(max_attempts = N)]`, overriding the dispatcher's [`RetryPolicy`] (on
    /// DynamoDB, the inbox's).
    const MAX_ATTEMPTS: Option<u32> = None;
    /// `#[idempotent(gaps = "park")]`: what an ordered message does on a gap.
    const GAPS: GapPolicy = GapPolicy::Apply;

    /// The ordering of `msg` for this handler: the message's own (`#[message(aggregate)]`,
    /// `#[message(sequence)]`) unless `#[idempotent(aggregate = …, sequence = …)]` names other
    /// fields.
    fn ordering(msg: &Self::Message) -> Result<Option<Ordering>, KeyError> {
        msg.ordering()
    }

    /// The idempotency key of `msg` for this handler.
    fn key(msg: &Self::Message) -> Result<IdempotencyKey, KeyError>;

    /// The class of a handler error (generated: `Classify`, else the error chain).
    fn classify(_error: &Self::Error) -> ErrorClass {
        ErrorClass::Retryable
    }
}

/// One `#[idempotent]` function on a SQL connection, as the macro describes it to the runtime.
#[doc(hidden)]
pub trait Handler: HandlerSpec {
    /// The connection type of the handler's first parameter; decides the backend.
    type Connection: InboxConnection;

    /// The original function body, run on the inbox transaction.
    fn call<'c>(
        conn: &'c mut Self::Connection,
        msg: Self::Message,
    ) -> BoxFuture<'c, Result<Self::Output, Self::Error>>;
}

/// Everything about one delivery that stays the same across its attempts.
#[doc(hidden)]
pub struct AttemptPlan<'a> {
    pub(crate) key: &'a IdempotencyKey,
    pub(crate) fingerprint: &'a Fingerprint,
    pub(crate) source: Option<&'a SourceMetadata>,
    /// The delivery's headers, where its W3C Trace Context is read (feature `otel`), if any.
    pub(crate) headers: Option<&'a std::collections::BTreeMap<String, String>>,
    /// The payload as delivered, if known (else the message is serialized when needed).
    pub(crate) payload: Option<&'a [u8]>,
    pub(crate) policy: &'a RetryPolicy,
    /// Whose connection the delivery runs on: the caller's own (nothing is left open on it) or
    /// one the runtime keeps (its transaction ends in one round trip where it can).
    pub(crate) owner: Owner,
    /// Which existing rows the claim may take over.
    pub(crate) mode: ClaimMode,
    /// The message's place in its aggregate, if the handler orders it.
    pub(crate) ordering: Option<&'a Ordering>,
    /// The dispatcher's hooks, if any.
    pub(crate) hooks: Option<&'a dyn HookRunner>,
}

/// One delivery on one connection: attempts with in-process retries of transient faults, then
/// the failure, if any, recorded.
pub(crate) async fn run_delivery<H: Handler>(
    conn: &mut H::Connection,
    msg: &H::Message,
    delivery: &AttemptPlan<'_>,
) -> Result<Outcome<H::Output>, Error<H::Error>> {
    let span = tracing::info_span!(
        "inbox.message",
        consumer = H::CONSUMER,
        message = <H::Message as Message>::NAME,
        key = %delivery.key,
        outcome = tracing::field::Empty,
        attempts = tracing::field::Empty,
    );
    // A single delivery continues its producer's trace: the span is a child of the remote
    // context (a malformed or missing one is ignored, see `crate::trace`).
    crate::trace::continue_headers(&span, delivery.headers);
    async move {
        let mut delays = delivery.policy.transient_schedule();
        let mut result = attempt::<H>(conn, msg.clone(), delivery).await;
        while is_transient::<H, _>(&result) {
            let Some(delay) = delays.next() else { break };
            tracing::debug!(
                delay_ms = delay.as_millis() as u64,
                "transient failure; retrying"
            );
            tokio::time::sleep(delay).await;
            result = attempt::<H>(conn, msg.clone(), delivery).await;
        }
        let result = match result {
            Err(failed) => Err(record::<H>(conn, msg, delivery, failed).await),
            Ok(outcome) => Ok(outcome),
        };
        observe(H::CONSUMER, &result);
        result
    }
    .instrument(span)
    .await
}

/// How one attempt failed, before anything is recorded.
enum Failed<E> {
    /// The error to report as it is (nothing to record).
    Report(Error<E>),
    /// The handler returned an error.
    Handler(HandlerFailure<E>),
    /// A hook failed after the handler returned `Ok`.
    Hook { source: BoxError, attempts: u32 },
    /// The handler returned `Ok` from an aborted transaction: its attempt counts, so that a
    /// handler that always does so ends dead instead of being redelivered forever.
    Aborted(StoreError),
    /// Same key, another payload.
    Conflict(Conflict),
}

/// Records what a failed delivery leaves behind (after its last attempt) and builds its error.
async fn record<H: Handler>(
    conn: &mut H::Connection,
    msg: &H::Message,
    delivery: &AttemptPlan<'_>,
    failed: Failed<H::Error>,
) -> Error<H::Error> {
    let failed = match failed {
        Failed::Report(error) => return error,
        failed => failed,
    };
    // What follows writes outside any transaction: not in the slot's spare one.
    end_spare(conn, delivery.owner);
    let payload = payload_of(msg, delivery);
    let payload_hash = delivery.fingerprint.to_hex();
    let subject = Subject::of_claim(
        &claim_request::<H>(delivery, &payload_hash),
        &payload,
        delivery.ordering,
    );
    let attempt = |class, text: &str, attempts| {
        Attempt::new(delivery.policy, H::MAX_ATTEMPTS, class, text, attempts)
    };
    match failed {
        Failed::Report(error) => error,
        Failed::Handler(mut failure) => {
            let text = failure.error.to_string();
            let (disposition, attempts) = attempt(failure.class, &text, failure.attempts)
                .record_after_rollback(conn, &subject, failure.attempts)
                .await;
            failure.disposition = disposition;
            failure.attempts = attempts;
            Error::Handler(failure)
        }
        Failed::Hook { source, .. } if Fenced::is_in(&*source) => {
            // A zombie's transaction: nothing of it may stay, not even a failed attempt (the
            // partition's new owner processes the key).
            Error::Hook(HookError {
                consumer: H::CONSUMER.to_owned(),
                key: delivery.key.clone(),
                disposition: Disposition::NotRecorded,
                source,
            })
        }
        Failed::Hook { source, attempts } => {
            let text = format!("before-commit hook failed: {source}");
            let (disposition, _) = attempt(ErrorClass::Retryable, &text, attempts)
                .record_after_rollback(conn, &subject, attempts)
                .await;
            Error::Hook(HookError {
                consumer: H::CONSUMER.to_owned(),
                key: delivery.key.clone(),
                disposition,
                source,
            })
        }
        Failed::Aborted(error) => {
            let text = aborted_transaction_text(&error.source);
            attempt(ErrorClass::Retryable, &text, 0)
                .record_after_rollback(conn, &subject, 0)
                .await;
            Error::Database(error)
        }
        // A conflict that could not be kept is a database error: settled as a conflict, the
        // delivery would be dropped (rejected to the broker) stored nowhere.
        Failed::Conflict(conflict) => match record_conflict(conn, &subject, &conflict).await {
            Ok(()) => Error::Conflict(conflict),
            Err(source) => {
                tracing::error!(error = %source, %conflict, "could not keep the conflicting delivery");
                Error::Database(StoreError {
                    consumer: conflict.consumer,
                    key: conflict.key,
                    operation: StoreOperation::Rejection,
                    source,
                })
            }
        },
    }
}

fn is_transient<H: Handler, T>(result: &Result<T, Failed<H::Error>>) -> bool {
    match result {
        Err(Failed::Handler(failure)) => failure.class == ErrorClass::Transient,
        // A commit whose answer was lost is retried too: the claim tells whether it landed.
        Err(Failed::Report(Error::Database(error))) => {
            error.source.class() == ErrorClass::Transient
        }
        _ => false,
    }
}

/// Counts the outcome and records it on the current span.
pub(crate) fn observe<T, E>(consumer: &'static str, result: &Result<Outcome<T>, Error<E>>) {
    let outcome = match result {
        Ok(outcome) => outcome.kind(),
        Err(Error::Handler(failure)) => match failure.disposition {
            Disposition::Dead => "dead",
            _ => "failed",
        },
        Err(error) => error.kind(),
    };
    tracing::Span::current().record("outcome", outcome);
    if let Err(error) = result {
        tracing::warn!(error = %ErrorDisplay(error), "message not processed");
    }
    metrics::counter!("inbox_messages_total", "consumer" => consumer, "outcome" => outcome)
        .increment(1);
}

/// Displays an `Error<E>` without requiring `E: Display` on the public type.
struct ErrorDisplay<'a, E>(&'a Error<E>);

impl<E> std::fmt::Display for ErrorDisplay<'_, E> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.0 {
            Error::Handler(failure) => write!(
                f,
                "handler failed ({}, attempt {})",
                failure.class.as_str(),
                failure.attempts
            ),
            Error::Conflict(error) => error.fmt(f),
            Error::Key(error) => error.fmt(f),
            Error::Fingerprint(error) => error.fmt(f),
            Error::Database(error) => error.fmt(f),
            Error::Hook(error) => error.fmt(f),
        }
    }
}

/// An attempt's result: its outcome, or how it failed. (A failure, a conflict above all, is as
/// large as the other errors: the outcome of a rare path, never boxed; hence the
/// `result_large_err` allowances of the steps that return it as their error.)
type Done<H> = Result<Outcome<<H as HandlerSpec>::Output>, Failed<<H as HandlerSpec>::Error>>;

/// One attempt: BEGIN, claim, body, hooks, verify, COMMIT — or ROLLBACK on a duplicate, a
/// conflict or a handler error.
async fn attempt<H: Handler>(
    conn: &mut H::Connection,
    msg: H::Message,
    delivery: &AttemptPlan<'_>,
) -> Done<H> {
    match steps::<H>(conn, msg, delivery).await {
        Ok(done) | Err(done) => done,
    }
}

/// The steps of one attempt, in order; a step that ends the attempt early (a settled key, a
/// failure) returns its result as the `Err`.
async fn steps<H: Handler>(
    conn: &mut H::Connection,
    msg: H::Message,
    delivery: &AttemptPlan<'_>,
) -> Result<Done<H>, Done<H>> {
    settle_redelivery::<H>(conn, delivery).await?;
    let Claimed { mut tx, attempts } = claim::<H>(conn, delivery).await?;
    tracing::Span::current().record("attempts", attempts);
    if let Some(ordering) = delivery.ordering {
        order_step::<H>(&mut tx, &msg, delivery, ordering).await?;
    }
    let value = run_handler::<H>(&mut tx, msg, delivery.key, attempts).await?;
    commit_step::<H>(&mut tx, delivery, attempts).await?;
    Ok(Ok(Outcome::Processed(value)))
}

/// The error of a failed store operation of `H`'s claim of `key`.
fn store_error<H: Handler>(
    key: &IdempotencyKey,
    (operation, source): (StoreOperation, sqlx::Error),
) -> StoreError {
    StoreError {
        consumer: H::CONSUMER.to_owned(),
        key: key.clone(),
        operation,
        source,
    }
}

/// A failed store operation, reported as it is.
#[allow(clippy::result_large_err)] // See `Done`.
fn report<H: Handler>(key: &IdempotencyKey, error: (StoreOperation, sqlx::Error)) -> Done<H> {
    Err(Failed::Report(store_error::<H>(key, error).into()))
}

/// A delivery the source marks as a redelivery is most likely a duplicate: one read, with no
/// transaction, settles it. A key that is free or `failed` takes the usual path.
#[allow(clippy::result_large_err)] // See `Done`.
async fn settle_redelivery<H: Handler>(
    conn: &mut H::Connection,
    delivery: &AttemptPlan<'_>,
) -> Result<(), Done<H>> {
    if delivery.mode != ClaimMode::Deliver || !delivery.source.is_some_and(|s| s.redelivered) {
        return Ok(());
    }
    // A read outside any transaction: not in the slot's spare one.
    end_spare(conn, delivery.owner);
    let found = peek(
        conn,
        H::CONSUMER,
        delivery.key.as_str(),
        delivery.fingerprint,
        delivery.mode,
    )
    .await
    .map_err(|e| report::<H>(delivery.key, (StoreOperation::Claim, e)))?;
    match found {
        Some(found) if found.status != Status::Failed || found.retry_in.is_some() => {
            Err(settle_found::<H>(found, delivery))
        }
        _ => Ok(()),
    }
}

/// The claim of `delivery` for `H`'s consumer, its fingerprint as `payload_hash` (hex).
fn claim_request<'a, H: Handler>(
    delivery: &AttemptPlan<'a>,
    payload_hash: &'a str,
) -> ClaimRequest<'a> {
    ClaimRequest {
        consumer: H::CONSUMER,
        message_key: delivery.key.as_str(),
        message_name: <H::Message as Message>::NAME,
        payload_hash,
        source: delivery.source,
        mode: delivery.mode,
    }
}

/// Steps 1 and 2: the claim; a key that is not free ends the attempt with its decision.
#[allow(clippy::result_large_err)] // See `Done`.
async fn claim<'c, H: Handler>(
    conn: &'c mut H::Connection,
    delivery: &AttemptPlan<'_>,
) -> Result<Claimed<'c, H::Connection>, Done<H>> {
    let payload_hash = delivery.fingerprint.to_hex();
    let request = claim_request::<H>(delivery, &payload_hash);
    let started = Instant::now();
    let opened = open(
        Hold::of(conn, delivery.owner),
        &request,
        Wait::Block,
        delivery.fingerprint,
    )
    .await
    .map_err(|error| report::<H>(delivery.key, error))?;
    metrics::histogram!("inbox_claim_duration_seconds", "consumer" => H::CONSUMER)
        .record(started.elapsed().as_secs_f64());
    match opened {
        Opened::Claimed(claimed) => Ok(claimed),
        Opened::Found(_, found) => {
            tracing::Span::current().record("attempts", found.attempts);
            Err(settle_found::<H>(found, delivery))
        }
        Opened::InProgress(_) => unreachable!("a blocking claim waits"),
    }
}

/// The sequence guard as a step: a message it settles (stale, parked) commits without its
/// body.
async fn order_step<H: Handler>(
    tx: &mut ClaimTx<'_, H::Connection>,
    msg: &H::Message,
    delivery: &AttemptPlan<'_>,
    ordering: &Ordering,
) -> Result<(), Done<H>> {
    match order::<H>(tx.conn(), msg, delivery, ordering).await {
        Ok(None) => Ok(()),
        Ok(Some(outcome)) => match tx.finish(Verify::Nothing).await {
            Ok(()) => Err(Ok(outcome)),
            Err(error) => Err(report::<H>(delivery.key, error)),
        },
        Err(source) => {
            let _ = tx.rollback().await;
            Err(report::<H>(delivery.key, (StoreOperation::Order, source)))
        }
    }
}

/// Step 3: the handler's body on the claim's transaction; its error rolls the transaction back.
async fn run_handler<H: Handler>(
    tx: &mut ClaimTx<'_, H::Connection>,
    msg: H::Message,
    key: &IdempotencyKey,
    attempts: u32,
) -> Result<H::Output, Done<H>> {
    let started = Instant::now();
    let result = run_body(H::CONSUMER, key.as_str(), H::call(tx.conn(), msg)).await;
    metrics::histogram!("inbox_handler_duration_seconds", "consumer" => H::CONSUMER)
        .record(started.elapsed().as_secs_f64());
    match result {
        Ok(value) => Ok(value),
        Err(error) => {
            // The handler's error is what the caller needs; a failing rollback means the
            // connection is gone, and the server rolls back with it.
            let _ = tx.rollback().await;
            Err(Err(Failed::Handler(HandlerFailure {
                class: H::classify(&error),
                error,
                attempts,
                disposition: Disposition::NotRecorded,
            })))
        }
    }
}

/// Steps 4 to 6: hooks, verify, COMMIT, after-commit callbacks.
async fn commit_step<H: Handler>(
    tx: &mut ClaimTx<'_, H::Connection>,
    delivery: &AttemptPlan<'_>,
    attempts: u32,
) -> Result<(), Done<H>> {
    let key = delivery.key.as_str();
    let info = ClaimInfo {
        consumer: H::CONSUMER,
        key,
        message_name: <H::Message as Message>::NAME,
        payload: delivery.payload,
        source: delivery.source,
    };
    let verify = Verify::Claim {
        consumer: H::CONSUMER,
        key,
    };
    match commit(tx, delivery.hooks, &info, verify).await {
        Ok(()) => Ok(()),
        Err(Uncommitted::Hook(source)) => Err(Err(Failed::Hook { source, attempts })),
        Err(Uncommitted::Store(StoreOperation::Verify, error)) => Err(Err(Failed::Aborted(
            store_error::<H>(delivery.key, (StoreOperation::Verify, error)),
        ))),
        Err(Uncommitted::Store(operation, error)) => {
            Err(report::<H>(delivery.key, (operation, error)))
        }
    }
}

/// The outcome of a delivery whose key is already taken in the inbox (by
/// [`decide`](super::decide)).
#[allow(clippy::result_large_err)] // See `Done`.
fn settle_found<H: Handler>(found: Found, delivery: &AttemptPlan<'_>) -> Done<H> {
    let decision = match found.decision {
        Ok(decision) => decision,
        Err(damaged) => {
            return report::<H>(delivery.key, (StoreOperation::Claim, damaged.into_sqlx()));
        }
    };
    match decision {
        Decision::Settled(outcome) => Ok(outcome.map(|()| unreachable!("settled, not processed"))),
        Decision::Conflict { stored } => Err(Failed::Conflict(Conflict {
            consumer: H::CONSUMER.to_owned(),
            message_name: <H::Message as Message>::NAME.to_owned(),
            key: delivery.key.clone(),
            stored,
            received: *delivery.fingerprint,
        })),
        // The claim statement retries a row it would take over until it settles; the fast path
        // does not read such a row; seen here, it changed under the claim: a transient state.
        Decision::Claimable => report::<H>(
            delivery.key,
            (
                StoreOperation::Claim,
                sqlx::Error::Protocol("inbox claim: key neither claimable nor settled".into()),
            ),
        ),
    }
}

/// The sequence guard, inside the claim's transaction: locks the aggregate (serializing its
/// messages), then either lets the body run (advancing the aggregate's sequence), or settles the
/// claim as `stale` or `parked` without running it.
async fn order<H: Handler>(
    conn: &mut H::Connection,
    msg: &H::Message,
    delivery: &AttemptPlan<'_>,
    ordering: &Ordering,
) -> Result<Option<Outcome<H::Output>>, sqlx::Error> {
    let last = conn
        .lock_aggregate(H::CONSUMER, &ordering.aggregate_id)
        .await?;
    let stale = MessageMark {
        consumer: H::CONSUMER,
        message_key: delivery.key.as_str(),
        status: Status::Stale,
        ordering,
        payload: None,
    };
    if ordering.sequence <= last {
        conn.mark_message(&stale).await?;
        return Ok(Some(Outcome::Stale));
    }
    let gap = ordering.sequence > last + 1;
    if gap && H::GAPS == GapPolicy::Park && delivery.mode != ClaimMode::Release {
        let payload = payload_of(msg, delivery);
        let parked = MessageMark {
            status: Status::Parked,
            payload: Some(&payload),
            ..stale
        };
        conn.mark_message(&parked).await?;
        return Ok(Some(Outcome::Parked));
    }
    conn.advance_aggregate(H::CONSUMER, &ordering.aggregate_id, ordering.sequence)
        .await?;
    Ok(None)
}

fn payload_of<M: Serialize>(msg: &M, delivery: &AttemptPlan<'_>) -> Vec<u8> {
    match delivery.payload {
        Some(payload) => payload.to_vec(),
        // A message that fingerprinted serializes: the fingerprint was computed over it.
        None => serde_json::to_vec(msg).unwrap_or_default(),
    }
}
