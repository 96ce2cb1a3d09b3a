//! Failed attempts and conflicts: what is recorded for them, in one place for every driver.

use std::time::Duration;

use crate::protocol::hooks::ClaimInfo;
use crate::store::{ClaimRequest, ClaimStore, FailureRecord, Rejection, RejectionReason};
use crate::types::classify::ErrorClass;
use crate::types::envelope::SourceMetadata;
use crate::types::error::{Conflict, Disposition};
use crate::types::ordering::Ordering;
use crate::types::policy::RetryPolicy;
use crate::types::status::Status;

/// The message a failure or a conflict is recorded for.
pub(crate) struct Subject<'a> {
    pub(crate) consumer: &'a str,
    pub(crate) key: &'a str,
    pub(crate) message_name: &'a str,
    /// The delivery's fingerprint, hex.
    pub(crate) payload_hash: &'a str,
    /// The payload as delivered (or serialized), kept with the row for a later run.
    pub(crate) payload: &'a [u8],
    pub(crate) source: Option<&'a SourceMetadata>,
    pub(crate) ordering: Option<&'a Ordering>,
}

impl<'a> Subject<'a> {
    /// The message `request` claims (its consumer, key, name, fingerprint and source), with
    /// its `payload` and its place in its aggregate (`ordering`), if the handler orders it.
    pub(crate) fn of_claim(
        request: &ClaimRequest<'a>,
        payload: &'a [u8],
        ordering: Option<&'a Ordering>,
    ) -> Self {
        Subject {
            consumer: request.consumer,
            key: request.message_key,
            message_name: request.message_name,
            payload_hash: request.payload_hash,
            payload,
            source: request.source,
            ordering,
        }
    }

    /// The message as hooks see it ([`ClaimInfo`]), payload included.
    pub(crate) fn info(&self) -> ClaimInfo<'a> {
        ClaimInfo {
            consumer: self.consumer,
            key: self.key,
            message_name: self.message_name,
            payload: Some(self.payload),
            source: self.source,
        }
    }
}

/// One failed attempt, ready to record: the bounded error text and the delay before the next
/// attempt, by the retry policy.
pub(crate) struct Attempt {
    class: ErrorClass,
    max_attempts: u32,
    last_error: String,
    retry_delay: Duration,
}

impl Attempt {
    /// A failed attempt of class `class` with error text `text`; `attempts` counts it;
    /// `max_attempts` is the handler's own, if it has one, else the policy's.
    pub(crate) fn new(
        policy: &RetryPolicy,
        max_attempts: Option<u32>,
        class: ErrorClass,
        text: &str,
        attempts: u32,
    ) -> Self {
        Self {
            class,
            max_attempts: max_attempts.unwrap_or(policy.get_max_attempts()).max(1),
            last_error: policy.bounded_error(format!("{} error: {}", class.as_str(), text)),
            retry_delay: policy.retry_delay(attempts.max(1)),
        }
    }

    /// The record the store writes for it.
    pub(crate) fn record<'a>(&'a self, subject: &'a Subject<'a>) -> FailureRecord<'a> {
        FailureRecord {
            consumer: subject.consumer,
            message_key: subject.key,
            message_name: subject.message_name,
            payload_hash: subject.payload_hash,
            permanent: self.class == ErrorClass::Permanent,
            max_attempts: self.max_attempts,
            last_error: &self.last_error,
            retry_delay_ms: i64::try_from(self.retry_delay.as_millis()).unwrap_or(i64::MAX),
            payload: subject.payload,
            source: subject.source,
            aggregate_id: subject.ordering.map(|o| o.aggregate_id.as_str()),
            sequence: subject.ordering.map(|o| o.sequence),
        }
    }

    /// What the store's answer means for the delivery: dead, retry after the delay, or (no row
    /// recorded: a concurrent delivery processed the key meanwhile) not recorded. Returns the
    /// attempts so far too (`attempts` if nothing was recorded).
    pub(crate) fn disposition(
        &self,
        recorded: Option<(Status, u32)>,
        attempts: u32,
    ) -> (Disposition, u32) {
        match recorded {
            Some((Status::Dead, attempts)) => (Disposition::Dead, attempts),
            Some((_, attempts)) => (
                Disposition::Retry {
                    after: self.retry_delay,
                },
                attempts,
            ),
            None => (Disposition::NotRecorded, attempts),
        }
    }

    /// Records the attempt in its own statement (autocommit), after the claim's transaction
    /// was rolled back. A database error is logged and reported as not recorded.
    pub(crate) async fn record_after_rollback<C: ClaimStore + ?Sized>(
        &self,
        conn: &mut C,
        subject: &Subject<'_>,
        attempts: u32,
    ) -> (Disposition, u32) {
        match conn.record_failure(&self.record(subject)).await {
            Ok(recorded) => self.disposition(recorded, attempts),
            Err(error) => {
                tracing::error!(%error, "could not record the failed attempt");
                (Disposition::NotRecorded, attempts)
            }
        }
    }

    /// Records the attempt in the batch transaction that claimed the key (after the handler's
    /// savepoint was rolled back).
    pub(crate) async fn record_in_transaction<C: ClaimStore + ?Sized>(
        &self,
        conn: &mut C,
        subject: &Subject<'_>,
        attempts: u32,
    ) -> Result<(Disposition, u32), sqlx::Error> {
        let recorded = conn.fail_claimed(&self.record(subject)).await?;
        Ok(self.disposition(recorded, attempts))
    }
}

/// The text recorded for a handler that returned `Ok` from an aborted transaction, or from one
/// it ended itself.
pub(crate) fn aborted_transaction_text(error: &sqlx::Error) -> String {
    format!(
        "the handler returned Ok, but its transaction was aborted or ended before COMMIT \
         (a database error it did not return? a COMMIT or ROLLBACK of its own?): {error}"
    )
}

/// The rejection kept for a conflicting delivery (payload included).
pub(crate) fn conflict_rejection<'a>(subject: &'a Subject<'a>, detail: &'a str) -> Rejection<'a> {
    Rejection {
        consumer: Some(subject.consumer),
        message_key: Some(subject.key),
        message_name: subject.message_name,
        reason: RejectionReason::Conflict,
        detail,
        payload_hash: Some(subject.payload_hash),
        payload: subject.payload,
        payload_size: None,
        source: subject.source,
    }
}

/// Keeps a conflicting delivery in `inbox_rejections`, in its own statement.
///
/// # Errors
/// The database's error: nothing was kept, and the caller must report a database error, not
/// the conflict (which a source settles by dropping the delivery).
pub(crate) async fn record_conflict<C: ClaimStore + ?Sized>(
    conn: &mut C,
    subject: &Subject<'_>,
    conflict: &Conflict,
) -> Result<(), sqlx::Error> {
    let detail = conflict.to_string();
    conn.record_rejection(&conflict_rejection(subject, &detail))
        .await
}
