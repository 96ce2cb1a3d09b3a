//! Messages, handlers and the claim-then-act wrapper every `#[idempotent]` function runs in.

use std::time::Instant;

use serde::Serialize;
use serde::de::DeserializeOwned;
use tracing::Instrument as _;

use crate::BoxFuture;
use crate::classify::{Classify as _, ErrorClass};
use crate::envelope::SourceMetadata;
use crate::error::{Conflict, Disposition, Error, HandlerFailure, StoreError};
use crate::fingerprint::Fingerprint;
use crate::key::{IdempotencyKey, KeyError};
use crate::ordering::{GapPolicy, Ordering};
use crate::outcome::Outcome;
use crate::policy::RetryPolicy;
use crate::store::{
    ClaimMode, ClaimRequest, ClaimResult, FailureRecord, InboxConnection, Rejection,
    RejectionReason,
};

/// A message type: its routing name and its idempotency key. Derive it with
/// [`#[derive(Message)]`](macro@crate::Message).
///
/// The payload is JSON (serde); `Clone` lets the dispatcher decode a payload once and hand each
/// consumer its own copy.
pub trait Message: Serialize + DeserializeOwned + Clone + Send + Sync + 'static {
    /// The routing name, matched against [`crate::Envelope::message_name`].
    const NAME: &'static str;

    /// The idempotency key of this message.
    ///
    /// # Errors
    /// A [`KeyError`] if the key is null, empty, too long or invalid.
    fn idempotency_key(&self) -> Result<IdempotencyKey, KeyError>;

    /// The message's aggregate and sequence, for per-aggregate ordering; `None` (the default)
    /// for messages without one. Derived from `#[message(aggregate)]` and `#[message(sequence)]`
    /// fields.
    ///
    /// # Errors
    /// A [`KeyError`] if the aggregate id is null or empty, or the sequence is null or below 1.
    fn ordering(&self) -> Result<Option<Ordering>, KeyError> {
        Ok(None)
    }
}

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

/// One `#[idempotent]` function, as the macro describes it to the runtime.
#[doc(hidden)]
pub trait Handler: Send + Sync + 'static {
    /// The connection type of the handler's first parameter; decides the backend.
    type Connection: InboxConnection;
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
    /// `#[idempotent(max_attempts = N)]`, overriding the dispatcher's [`RetryPolicy`].
    const MAX_ATTEMPTS: Option<u32> = None;
    /// `#[idempotent(gaps = "park")]`.
    const GAPS: GapPolicy = GapPolicy::Apply;

    /// The ordering of `msg` for this handler (generated from `aggregate`/`sequence`
    /// arguments, else the message's own).
    fn ordering(msg: &Self::Message) -> Result<Option<Ordering>, KeyError> {
        msg.ordering()
    }

    /// The idempotency key of `msg` for this handler.
    fn key(msg: &Self::Message) -> Result<IdempotencyKey, KeyError>;

    /// The class of a handler error (generated: `Classify`, else the error chain).
    fn classify(_error: &Self::Error) -> ErrorClass {
        ErrorClass::Retryable
    }

    /// The original function body, run on the inbox transaction.
    fn call<'c>(
        conn: &'c mut Self::Connection,
        msg: Self::Message,
    ) -> BoxFuture<'c, Result<Self::Output, Self::Error>>;
}

/// Everything about one delivery that stays the same across its attempts.
#[doc(hidden)]
pub struct Delivery<'a> {
    pub(crate) key: &'a IdempotencyKey,
    pub(crate) fingerprint: &'a Fingerprint,
    pub(crate) source: Option<&'a SourceMetadata>,
    /// The payload as delivered, if known (else the message is serialized when needed).
    pub(crate) payload: Option<&'a [u8]>,
    pub(crate) policy: &'a RetryPolicy,
    /// Which existing rows the claim may take over.
    pub(crate) mode: ClaimMode,
    /// The message's place in its aggregate, if the handler orders it.
    pub(crate) ordering: Option<&'a Ordering>,
}

/// Runs `H` on `msg` over `conn` with the default [`RetryPolicy`]: what the rewritten function
/// calls.
#[doc(hidden)]
pub async fn run<H: Handler>(
    conn: &mut H::Connection,
    msg: H::Message,
) -> Result<Outcome<H::Output>, Error<H::Error>> {
    let key = H::key(&msg)?;
    let ordering = H::ordering(&msg)?;
    let fingerprint = Fingerprint::of(<H::Message as Message>::NAME, &msg)?;
    let policy = RetryPolicy::default();
    let delivery = Delivery {
        key: &key,
        fingerprint: &fingerprint,
        source: None,
        payload: None,
        policy: &policy,
        mode: ClaimMode::Deliver,
        ordering: ordering.as_ref(),
    };
    let result = run_delivery::<H>(conn, &msg, &delivery).await;
    if let (Ok(Outcome::Processed(_)), Some(ordering)) = (&result, &ordering)
        && H::GAPS == GapPolicy::Park
    {
        {
            crate::registry::apply_parked_successors(conn.as_any(), H::CONSUMER, ordering, &policy)
                .await;
        }
    }
    result
}

/// One delivery on one connection: attempts with in-process retries of transient faults, then
/// the failure, if any, recorded.
pub(crate) async fn run_delivery<H: Handler>(
    conn: &mut H::Connection,
    msg: &H::Message,
    delivery: &Delivery<'_>,
) -> Result<Outcome<H::Output>, Error<H::Error>> {
    let span = tracing::info_span!(
        "inbox.message",
        consumer = H::CONSUMER,
        message = <H::Message as Message>::NAME,
        key = %delivery.key,
        outcome = tracing::field::Empty,
        attempts = tracing::field::Empty,
    );
    async move {
        let mut delays = delivery.policy.transient_delays();
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
            Err(Error::Handler(failure)) => Err(Error::Handler(
                record_failure::<H>(conn, msg, delivery, failure).await,
            )),
            Err(Error::Conflict(conflict)) => {
                record_conflict::<H>(conn, msg, delivery, &conflict).await;
                Err(Error::Conflict(conflict))
            }
            // The handler returned Ok from an aborted transaction: its attempt counts, so that
            // a handler that always does so ends dead instead of being redelivered forever.
            Err(Error::Database(error)) if error.operation == "verify" => {
                let text = aborted_transaction_text(&error.source);
                record_attempt::<H>(conn, msg, delivery, ErrorClass::Retryable, &text, 0).await;
                Err(Error::Database(error))
            }
            other => other,
        };
        observe(H::CONSUMER, &result);
        result
    }
    .instrument(span)
    .await
}

fn is_transient<H: Handler, T>(result: &Result<T, Error<H::Error>>) -> bool {
    match result {
        Err(Error::Handler(failure)) => failure.class == ErrorClass::Transient,
        // A commit whose answer was lost is retried too: the claim tells whether it landed.
        Err(Error::Database(error)) => error.source.class() == ErrorClass::Transient,
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
        }
    }
}

/// One attempt: BEGIN, claim, body, COMMIT — or ROLLBACK on a duplicate, a conflict or a
/// handler error.
async fn attempt<H: Handler>(
    conn: &mut H::Connection,
    msg: H::Message,
    delivery: &Delivery<'_>,
) -> Result<Outcome<H::Output>, Error<H::Error>> {
    let key = delivery.key;
    let store_error = |operation: &'static str| {
        move |source: sqlx::Error| StoreError {
            consumer: H::CONSUMER,
            key: key.clone(),
            operation,
            source,
        }
    };
    let payload_hash = delivery.fingerprint.to_hex();
    let request = ClaimRequest {
        consumer: H::CONSUMER,
        message_key: key.as_str(),
        message_name: <H::Message as Message>::NAME,
        payload_hash: &payload_hash,
        source: delivery.source,
        mode: delivery.mode,
    };

    // A delivery the source marks as a redelivery is most likely a duplicate: one read, with no
    // transaction, settles it. A key that is free or `failed` takes the usual path.
    if delivery.mode == ClaimMode::Deliver && delivery.source.is_some_and(|s| s.redelivered) {
        let existing = conn
            .existing(H::CONSUMER, key.as_str())
            .await
            .map_err(store_error("claim"))?;
        if let Some(ClaimResult::Existing {
            status,
            payload_hash: stored_hash,
            ..
        }) = existing
            && status != "failed"
        {
            {
                return settle_existing::<H>(&status, &stored_hash, delivery);
            }
        }
    }

    let started = Instant::now();
    let mut tx = conn.begin_inbox().await.map_err(store_error("begin"))?;
    let claimed = H::Connection::in_transaction(&mut tx).claim(&request).await;
    metrics::histogram!("inbox_claim_duration_seconds", "consumer" => H::CONSUMER)
        .record(started.elapsed().as_secs_f64());
    let (status, stored_hash, attempts) = match claimed {
        Ok(ClaimResult::Claimed { attempts }) => {
            tracing::Span::current().record("attempts", attempts);
            if let Some(ordering) = delivery.ordering {
                let this = H::Connection::in_transaction(&mut tx);
                match order::<H>(this, &msg, delivery, ordering).await {
                    Ok(None) => {}
                    Ok(Some(outcome)) => {
                        tx.commit().await.map_err(store_error("commit"))?;
                        return Ok(outcome);
                    }
                    Err(source) => {
                        let _ = tx.rollback().await;
                        return Err(store_error("order")(source).into());
                    }
                }
            }
            let started = Instant::now();
            let result = H::call(H::Connection::in_transaction(&mut tx), msg).await;
            metrics::histogram!("inbox_handler_duration_seconds", "consumer" => H::CONSUMER)
                .record(started.elapsed().as_secs_f64());
            return match result {
                Ok(value) => {
                    // A handler that swallowed a database error and returned `Ok` leaves a
                    // PostgreSQL transaction aborted, and COMMIT would then roll back without an
                    // error: check first, so that such a message is not reported processed.
                    let verified = H::Connection::in_transaction(&mut tx)
                        .verify_claim(H::CONSUMER, key.as_str())
                        .await;
                    if let Err(source) = verified {
                        let _ = tx.rollback().await;
                        return Err(store_error("verify")(source).into());
                    }
                    tx.commit().await.map_err(store_error("commit"))?;
                    Ok(Outcome::Processed(value))
                }
                Err(error) => {
                    // The handler's error is what the caller needs; a failing rollback means
                    // the connection is gone, and the server rolls back with it.
                    let _ = tx.rollback().await;
                    Err(Error::Handler(HandlerFailure {
                        class: H::classify(&error),
                        error,
                        attempts,
                        disposition: Disposition::NotRecorded,
                    }))
                }
            };
        }
        Ok(ClaimResult::Existing {
            status,
            payload_hash,
            attempts,
        }) => (status, payload_hash, attempts),
        Err(source) => {
            // Nothing of ours is written. Roll back explicitly (a rollback on drop is deferred
            // and reports nothing); the claim's error is the one to report.
            let _ = tx.rollback().await;
            return Err(store_error("claim")(source).into());
        }
    };
    tx.rollback().await.map_err(store_error("rollback"))?;
    tracing::Span::current().record("attempts", attempts);
    settle_existing::<H>(&status, &stored_hash, delivery)
}

/// The outcome of a delivery whose key is already settled in the inbox (not claimable).
fn settle_existing<H: Handler>(
    status: &str,
    stored_hash: &str,
    delivery: &Delivery<'_>,
) -> Result<Outcome<H::Output>, Error<H::Error>> {
    let stored = Fingerprint::from_hex(stored_hash).ok_or_else(|| StoreError {
        consumer: H::CONSUMER,
        key: delivery.key.clone(),
        operation: "claim",
        source: sqlx::Error::Decode(
            format!("stored payload_hash {stored_hash:?} is not a SHA-256 hex digest").into(),
        ),
    })?;
    if stored != *delivery.fingerprint {
        return Err(Error::Conflict(Conflict {
            consumer: H::CONSUMER,
            message_name: <H::Message as Message>::NAME,
            key: delivery.key.clone(),
            stored,
            received: *delivery.fingerprint,
        }));
    }
    Ok(match status {
        "dead" => Outcome::Dead,
        "discarded" => Outcome::Discarded,
        "parked" => Outcome::Parked,
        "stale" => Outcome::Stale,
        _ => Outcome::Duplicate,
    })
}

/// The sequence guard, inside the claim's transaction: locks the aggregate (serializing its
/// messages), then either lets the body run (advancing the aggregate's sequence), or settles the
/// claim as `stale` or `parked` without running it.
async fn order<H: Handler>(
    conn: &mut H::Connection,
    msg: &H::Message,
    delivery: &Delivery<'_>,
    ordering: &Ordering,
) -> Result<Option<Outcome<H::Output>>, sqlx::Error> {
    let last = conn
        .lock_aggregate(H::CONSUMER, &ordering.aggregate_id)
        .await?;
    let key = delivery.key.as_str();
    if ordering.sequence <= last {
        conn.mark_message(H::CONSUMER, key, "stale", ordering, None)
            .await?;
        return Ok(Some(Outcome::Stale));
    }
    let gap = ordering.sequence > last + 1;
    if gap && H::GAPS == GapPolicy::Park && delivery.mode != ClaimMode::Release {
        let payload = payload_of(msg, delivery);
        conn.mark_message(H::CONSUMER, key, "parked", ordering, Some(&payload))
            .await?;
        return Ok(Some(Outcome::Parked));
    }
    conn.advance_aggregate(H::CONSUMER, &ordering.aggregate_id, ordering.sequence)
        .await?;
    Ok(None)
}

fn payload_of<M: Serialize>(msg: &M, delivery: &Delivery<'_>) -> Vec<u8> {
    match delivery.payload {
        Some(payload) => payload.to_vec(),
        // A message that fingerprinted serializes: the fingerprint was computed over it.
        None => serde_json::to_vec(msg).unwrap_or_default(),
    }
}

/// Records a failed attempt in its own statement, after the rollback.
async fn record_failure<H: Handler>(
    conn: &mut H::Connection,
    msg: &H::Message,
    delivery: &Delivery<'_>,
    mut failure: HandlerFailure<H::Error>,
) -> HandlerFailure<H::Error> {
    let text = failure.error.to_string();
    let (disposition, attempts) =
        record_attempt::<H>(conn, msg, delivery, failure.class, &text, failure.attempts).await;
    failure.disposition = disposition;
    failure.attempts = attempts;
    failure
}

/// The text recorded for a handler that returned `Ok` from an aborted transaction.
pub(crate) fn aborted_transaction_text(error: &sqlx::Error) -> String {
    format!(
        "the handler returned Ok, but its transaction was aborted (a database error it did not return?): {error}"
    )
}

/// Records one failed attempt in its own statement (autocommit), after the rollback: `failed`
/// with a next attempt time, or `dead`. Returns what was recorded and the attempts so far.
async fn record_attempt<H: Handler>(
    conn: &mut H::Connection,
    msg: &H::Message,
    delivery: &Delivery<'_>,
    class: ErrorClass,
    text: &str,
    attempts: u32,
) -> (Disposition, u32) {
    let max_attempts = H::MAX_ATTEMPTS
        .unwrap_or(delivery.policy.max_attempts)
        .max(1);
    let retry_delay = delivery.policy.retry_delay(attempts.max(1));
    let last_error = delivery
        .policy
        .bounded_error(format!("{} error: {}", class.as_str(), text));
    let payload_hash = delivery.fingerprint.to_hex();
    let payload = payload_of(msg, delivery);
    let record = FailureRecord {
        consumer: H::CONSUMER,
        message_key: delivery.key.as_str(),
        message_name: <H::Message as Message>::NAME,
        payload_hash: &payload_hash,
        permanent: class == ErrorClass::Permanent,
        max_attempts,
        last_error: &last_error,
        retry_delay_ms: i64::try_from(retry_delay.as_millis()).unwrap_or(i64::MAX),
        payload: &payload,
        source: delivery.source,
        aggregate_id: delivery.ordering.map(|o| o.aggregate_id.as_str()),
        sequence: delivery.ordering.map(|o| o.sequence),
    };
    match conn.record_failure(&record).await {
        Ok(Some((status, attempts))) if status == "dead" => (Disposition::Dead, attempts),
        Ok(Some((_, attempts))) => (Disposition::Retry { after: retry_delay }, attempts),
        // Processed by a concurrent delivery since: nothing to record.
        Ok(None) => (Disposition::NotRecorded, attempts),
        Err(error) => {
            tracing::error!(%error, "could not record the failed attempt");
            (Disposition::NotRecorded, attempts)
        }
    }
}

/// Keeps a conflicting delivery (payload included) in `inbox_rejections`.
async fn record_conflict<H: Handler>(
    conn: &mut H::Connection,
    msg: &H::Message,
    delivery: &Delivery<'_>,
    conflict: &Conflict,
) {
    let payload = payload_of(msg, delivery);
    let detail = conflict.to_string();
    let received = conflict.received.to_hex();
    let rejection = Rejection {
        consumer: Some(H::CONSUMER),
        message_key: Some(delivery.key.as_str()),
        message_name: <H::Message as Message>::NAME,
        reason: RejectionReason::Conflict,
        detail: &detail,
        payload_hash: Some(&received),
        payload: &payload,
        source: delivery.source,
    };
    if let Err(error) = conn.record_rejection(&rejection).await {
        tracing::error!(%error, "could not record the conflicting delivery");
    }
}
