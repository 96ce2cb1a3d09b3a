//! AWS Lambda's SQS batches: an SQS event source mapping's [`SqsEvent`] run through the
//! [`Worker`] and its [`Dispatcher`](crate::Dispatcher), answered with the partial batch response
//! [`SqsBatchResponse`]. Cargo feature `lambda`, on the official
//! [lambda_runtime](https://docs.rs/lambda_runtime) and the event shapes of
//! [aws_lambda_events](https://docs.rs/aws_lambda_events).
//!
//! ```no_run
//! use inbox_runtime::source::lambda::LambdaSqs;
//! use inbox_runtime::{Dispatcher, Worker};
//!
//! #[tokio::main]
//! async fn main() -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
//!     // Outside the handler: one pool per execution environment, reused by every invocation.
//!     let pool = sqlx::PgPool::connect(&std::env::var("DATABASE_URL")?).await?;
//!     let worker = Worker::new(Dispatcher::from_registry(pool)?).concurrency(4);
//!     // Polls the Lambda runtime API (`AWS_LAMBDA_RUNTIME_API`) until the environment ends.
//!     LambdaSqs::new(worker).run().await
//! }
//! ```
//!
//! It follows the AWS Lambda Developer Guide, "Using Lambda with Amazon SQS", section
//! "Handling errors for an SQS event source in Lambda" — "Implementing partial batch
//! responses" (reporting batch item failures): the event source mapping must have
//! `FunctionResponseTypes: ["ReportBatchItemFailures"]`, else Lambda ignores the response and
//! retries the whole batch whenever the function fails (and deletes it whenever it returns).
//!
//! **One invocation** ([`LambdaSqs::handle`]): each record becomes one delivery of a source that
//! ends after the batch's last record; the worker runs them (its concurrency, batches and
//! ordering keys), settles each after its transaction committed, and returns once all are
//! settled. The response lists, in the order of the event's records, the `messageId` of every
//! record that Lambda must leave on the queue (`{"batchItemFailures": [{"itemIdentifier":
//! "…"}]}`); every record not listed is deleted by Lambda.
//!
//! | the worker's settlement ([`settlement_for`](crate::worker::settlement_for)) | when | the response |
//! | --- | --- | --- |
//! | ack | committed; a duplicate; dead-lettered in the inbox (a permanent handler failure, or retries exhausted: status `dead`, payload kept for replay); stale, parked, discarded; bad input kept in `inbox_rejections` | not listed: deleted |
//! | reject | a conflict (the same idempotency key with another payload; kept in `inbox_rejections` by the dispatcher), a bad key | not listed: deleted |
//! | requeue | a retryable handler failure, a database error, a redelivery before the inbox's retry delay has passed (not yet due: not run), bad input that could not be kept (database down) | listed: received again after the queue's visibility timeout |
//! | not started, or dropped unsettled | a later record of a FIFO group whose earlier record is listed; a record not started when the invocation's deadline is near, or not committed within the worker's drain timeout after that | listed |
//!
//! A requeue's own delay is not carried out: Lambda has no per-message delay in its response,
//! so a listed record is received again when its visibility timeout (the queue's, at least six
//! times the function's timeout as AWS recommends) has passed; a visibility timeout shorter than
//! the dispatcher's retry delays only lists the record again unrun until its retry is due. Set
//! the queue's redrive policy `maxReceiveCount` above the number of receives you want the inbox
//! to retry over: a permanent failure is dead-lettered in the inbox and deleted from the queue,
//! so the queue's own dead-letter queue only receives messages that kept failing for a passing
//! reason.
//!
//! **Bad input** is treated as the other sources treat it (see
//! [`source::sqs`](crate::source) with feature `sqs`): a record without a body (the empty
//! payload), without the name attribute (the empty name), with an unknown message name or a
//! malformed body is refused by the dispatcher and kept by the worker in `inbox_rejections`,
//! payload included, and then reported as a success (deleted): a poison message is not received
//! again and again, and nothing is lost. If it cannot be kept (the database is down), it is
//! listed and received again. A body over the dispatcher's payload limit is cut to the limit and
//! kept as `too_large` with its real size.
//!
//! **FIFO queues** (an `eventSourceARN` ending in `.fifo`): the record's `MessageGroupId`
//! attribute is its delivery's ordering key, so the records of one group run one at a time, in
//! the event's order, and groups run side by side. AWS requires that once a record of a group
//! fails, the group's later records are not processed but listed too (else SQS would deliver
//! them before the failed one): the worker drops them unrun, and the response lists them after
//! the failed one. The other groups of the batch go on (as Powertools' `skip_group_on_error`
//! does: SQS orders messages within a group only).
//!
//! **Message name**: the String message attribute [`LambdaSqs::name_attribute`] (default
//! `message-name`, as [`SqsSink`](crate::sink) with feature `sqs` writes it). String and Number
//! message attributes are copied into [`Envelope::headers`].
//!
//! **Metadata**: `source` = the queue name (the last `:` field of `eventSourceARN`; `sqs` if the
//! record has none), `message_id` = `messageId`, `delivery_count` = `ApproximateReceiveCount`,
//! `redelivered` = that count > 1, `published_at` = `SentTimestamp`; `partition` =
//! `MessageGroupId`, `deduplication_id` = `MessageDeduplicationId` and `sequence_number` =
//! `SequenceNumber` where the record has them.
//!
//! **Errors**: a record to list without a `messageId` (Lambda always sends one) cannot be
//! listed, since Lambda treats an empty identifier as a failure of the whole batch:
//! [`LambdaSqs::handle`] then returns [`LambdaSqsError::MissingMessageId`], the invocation
//! fails, and Lambda makes the whole batch visible again (what committed is a duplicate on its
//! next receive). A function that times out is treated the same way by Lambda; to answer
//! before that, [`LambdaSqs::run`] stops starting records [`LambdaSqs::deadline_margin`] before
//! the invocation's deadline and lists those it did not settle.
//!
//! ## On DynamoDB
//!
//! With the features `lambda` and `dynamodb`, [`DynamoLambdaSqs`] runs the batches through a
//! [`DynamoDispatcher`](crate::dynamodb::DynamoDispatcher) instead: each record's consumers
//! claim its idempotency key and apply their DynamoDB writes in one `TransactWriteItems` each
//! (the AWS Powertools idempotency use case, with the claim and the effect in one transaction).
//! The records, their envelopes and metadata, the response, FIFO groups, the deadline margin and
//! [`LambdaSqsError`] are as above; there is no [`Worker`], so the runner has its own
//! [`concurrency`](DynamoLambdaSqs::concurrency). A record is deleted only if every consumer is
//! done with it:
//!
//! | a consumer's result ([`DynamoConsumerOutcome::result`](crate::dynamodb::DynamoConsumerOutcome::result)) | the response |
//! | --- | --- |
//! | [`Processed`](crate::Outcome::Processed), [`Duplicate`](crate::Outcome::Duplicate), [`Dead`](crate::Outcome::Dead) (dead-lettered earlier), [`Discarded`](crate::Outcome::Discarded); a handler failure recorded as dead now ([`Disposition::Dead`](crate::Disposition::Dead): permanent, or `max_attempts` reached; payload kept in the inbox table for replay) | not listed: deleted |
//! | a conflict ([`DynamoError::Conflict`](crate::dynamodb::DynamoError::Conflict): the same idempotency key with another payload; the conflicting payload kept in the inbox table unless too large for an item), logged | listed: for the queue's dead-letter queue |
//! | [`NotYet`](crate::Outcome::NotYet) (a failed key before its next attempt is due); a retryable handler failure recorded ([`Disposition::Retry`](crate::Disposition::Retry)) or not recorded; any other [`DynamoError`](crate::dynamodb::DynamoError) (a DynamoDB error, a transient cancellation, contention, …) | listed: received again after the visibility timeout |
//!
//! | the record | the response |
//! | --- | --- |
//! | refused by the dispatcher ([`DispatchError`](crate::DispatchError): no body, no or an unknown message name, a malformed payload, a bad key, too large), logged with the reason, and kept in the inbox table ([`DynamoDispatcher::record_rejection`](crate::dynamodb::DynamoDispatcher::record_rejection)) | deleted |
//! | refused, and not kept (DynamoDB failed; or the item, payload included, would pass DynamoDB's 400 KB item limit) | listed |
//! | a later record of a FIFO group whose earlier record is listed (not run) | listed |
//! | not started before the deadline margin; or still running half the margin later (dropped: a transaction that committed meanwhile is a duplicate on the next receive) | listed |
//!
//! **Refused records are kept, then deleted**, as the SQL stores keep theirs in
//! `inbox_rejections` (see [`crate::dynamodb::rejections`]). A refused record that cannot be
//! kept, and a conflict, are listed: received again until the queue's redrive policy
//! (`maxReceiveCount`) moves them to the queue's dead-letter queue: give every queue read this
//! way a redrive policy. A FIFO group is held behind such a record until then.

use std::collections::{BTreeMap, HashSet, VecDeque};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, SystemTime};

use aws_lambda_events::event::sqs::{BatchItemFailure, SqsBatchResponse, SqsEvent, SqsMessage};
use lambda_runtime::{LambdaEvent, service_fn};
use tokio_util::sync::CancellationToken;

use crate::BoxFuture;
use crate::setters::setters;
use crate::source::{Delivery, Settle, SettleFuture, Settlement, Source, SourceError};
use crate::store::InboxDatabase;
use crate::types::envelope::{Envelope, SourceMetadata};
use crate::types::limit::PayloadLimit;
use crate::worker::{Worker, WorkerReport};

#[cfg(feature = "dynamodb")]
mod dynamodb;
#[cfg(feature = "dynamodb")]
pub use dynamodb::{DEFAULT_DYNAMO_CONCURRENCY, DynamoLambdaReport, DynamoLambdaSqs};

/// The event and response shapes of aws_lambda_events (`SqsEvent`, `SqsMessage`,
/// `SqsBatchResponse`, `BatchItemFailure`), so that callers of [`LambdaSqs::handle`] need no
/// dependency of their own.
pub use aws_lambda_events::event::sqs;

/// The message attribute that names a message unless [`LambdaSqs::name_attribute`] says
/// otherwise: `message-name`, as the SQS sink writes it.
pub const DEFAULT_NAME_ATTRIBUTE: &str = "message-name";

/// How long before an invocation's deadline the worker stops starting records unless
/// [`LambdaSqs::deadline_margin`] says otherwise: 3 s.
pub const DEFAULT_DEADLINE_MARGIN: Duration = Duration::from_secs(3);

/// An invocation that cannot be answered with a partial batch response.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum LambdaSqsError {
    /// The record at `index` (0-based, in the event's `Records`) must be received again, but
    /// has no `messageId` to list it by (Lambda treats an empty identifier as a failure of the
    /// whole batch). The invocation fails instead, so Lambda retries the whole batch; what
    /// committed is a duplicate then.
    #[error(
        "SQS record {index} must be received again but has no messageId to list it by; \
         failing the invocation so that Lambda retries the whole batch"
    )]
    MissingMessageId {
        /// The record's position in the event's `Records`, from 0.
        index: usize,
    },
}

/// The invocation's error as Lambda reports it (`errorType` `LambdaSqsError`, `errorMessage`
/// the error's text).
impl From<LambdaSqsError> for lambda_runtime::Diagnostic {
    fn from(error: LambdaSqsError) -> Self {
        Self {
            error_type: "LambdaSqsError".to_owned(),
            error_message: error.to_string(),
        }
    }
}

/// Runs an SQS event source mapping's batches through a [`Worker`], answering each with the
/// partial batch response (see the [module documentation](self) for the mapping of outcomes).
///
/// Build it once per execution environment (a cold start), outside the handler, so that its
/// pool is reused by every invocation; clones share the worker.
#[derive(Debug)]
pub struct LambdaSqs<DB: InboxDatabase> {
    worker: Arc<Worker<DB>>,
    name_attribute: Arc<str>,
    deadline_margin: Duration,
}

impl<DB: InboxDatabase> Clone for LambdaSqs<DB> {
    fn clone(&self) -> Self {
        Self {
            worker: Arc::clone(&self.worker),
            name_attribute: Arc::clone(&self.name_attribute),
            deadline_margin: self.deadline_margin,
        }
    }
}

impl<DB: InboxDatabase> LambdaSqs<DB> {
    /// Batches run by `worker` (its concurrency, batch size, drain timeout and dispatcher), with
    /// the message name in the attribute [`DEFAULT_NAME_ATTRIBUTE`] and a deadline margin of
    /// [`DEFAULT_DEADLINE_MARGIN`].
    pub fn new(worker: Worker<DB>) -> Self {
        Self {
            worker: Arc::new(worker),
            name_attribute: Arc::from(DEFAULT_NAME_ATTRIBUTE),
            deadline_margin: DEFAULT_DEADLINE_MARGIN,
        }
    }

    setters! {
        /// Sets how long before the invocation's deadline (the function's timeout) the worker stops
        /// starting records (default [`DEFAULT_DEADLINE_MARGIN`], 3 s): the records not started
        /// are listed, those running get the worker's
        /// [`drain_timeout`](Worker::drain_timeout) to commit (keep it below the margin; past it
        /// they are rolled back and listed), and the function answers before Lambda stops it. A
        /// function stopped at its timeout has its whole batch retried instead.
        pub fn deadline_margin(margin: Duration);

        /// Sets the String message attribute that holds the message name (default
        /// [`DEFAULT_NAME_ATTRIBUTE`]). A record without it gets the empty name, which no handler
        /// has: it is kept in `inbox_rejections` and deleted.
        pub fn name_attribute(attribute: impl Into<String>) {
            self.name_attribute = Arc::from(attribute.into());
        }
    }

    /// The worker that runs the batches.
    pub fn worker(&self) -> &Worker<DB> {
        &self.worker
    }

    /// Runs one invocation's batch: every record dispatched and settled, the response listing
    /// the `messageId` of each record to receive again, in the order of `event.records`.
    ///
    /// # Errors
    /// [`LambdaSqsError::MissingMessageId`] if a record to list has no `messageId` (the whole
    /// batch is then retried by Lambda).
    pub async fn handle(&self, event: SqsEvent) -> Result<SqsBatchResponse, LambdaSqsError> {
        answer(self, event).await
    }

    /// [`handle`](Self::handle), with the worker's counts for the batch (processed,
    /// duplicates, dead, conflicts, invalid, requeued, …).
    ///
    /// # Errors
    /// As [`handle`](Self::handle).
    pub async fn handle_reporting(
        &self,
        event: SqsEvent,
    ) -> Result<(SqsBatchResponse, WorkerReport), LambdaSqsError> {
        self.run_batch(event, None).await
    }

    /// [`handle_reporting`](Self::handle_reporting) for an invocation that must answer by
    /// `deadline` (Lambda's `Lambda-Runtime-Deadline-Ms`, [`lambda_runtime::Context::deadline`]):
    /// the worker stops starting records [`deadline_margin`](Self::deadline_margin) before it,
    /// and the records it did not settle by then are listed.
    ///
    /// # Errors
    /// As [`handle`](Self::handle).
    pub async fn handle_by(
        &self,
        event: SqsEvent,
        deadline: SystemTime,
    ) -> Result<(SqsBatchResponse, WorkerReport), LambdaSqsError> {
        self.run_batch(event, Some(deadline)).await
    }

    /// Runs the function: polls the Lambda runtime API (`AWS_LAMBDA_RUNTIME_API`) for SQS
    /// events, answers each with [`handle_by`](Self::handle_by)'s response under the
    /// invocation's deadline, until the runtime API stops answering.
    ///
    /// # Errors
    /// What [`lambda_runtime::run`] returns: the runtime API could not be reached or answered
    /// with an error. (An invocation's own [`LambdaSqsError`] is reported to Lambda as that
    /// invocation's error, and the function goes on.)
    ///
    /// # Panics
    /// As [`lambda_runtime::run`]: if the environment variables Lambda sets
    /// (`AWS_LAMBDA_FUNCTION_NAME`, `AWS_LAMBDA_FUNCTION_MEMORY_SIZE`,
    /// `AWS_LAMBDA_FUNCTION_VERSION`, `AWS_LAMBDA_RUNTIME_API`) are missing.
    pub async fn run(self) -> Result<(), lambda_runtime::Error> {
        serve(self).await
    }
}

impl<DB: InboxDatabase> BatchRunner for LambdaSqs<DB> {
    type Report = WorkerReport;

    async fn run_batch(
        &self,
        event: SqsEvent,
        deadline: Option<SystemTime>,
    ) -> Result<(SqsBatchResponse, WorkerReport), LambdaSqsError> {
        let (source, batch) = BatchSource::new(event.records, &self.name_attribute);
        let stop = CancellationToken::new();
        let timer = deadline.map(|deadline| {
            let left = time_to_margin(deadline, self.deadline_margin);
            if left.is_zero() {
                stop.cancel();
            }
            let stop = stop.clone();
            crate::store::spawn(async move {
                tokio::time::sleep(left).await;
                tracing::warn!("the invocation's deadline is near: no more SQS records start");
                stop.cancel();
            })
        });
        // The source never fails and its close does nothing: an error here only carries the
        // report of a run that still settled or dropped every delivery.
        let report = match self.worker.run(source, stop).await {
            Ok(report) => report,
            Err(error) => {
                tracing::warn!(error = %error.error, "worker run over an SQS batch failed");
                error.report
            }
        };
        if let Some(timer) = timer {
            timer.abort();
        }
        let response = batch.response()?;
        tracing::info!(
            records = batch.len(),
            failures = response.batch_item_failures.len(),
            processed = report.processed,
            duplicates = report.duplicates,
            dead = report.dead,
            conflicts = report.conflicts,
            invalid = report.invalid,
            "SQS batch handled"
        );
        Ok((response, report))
    }
}

/// How long from now until `margin` before `deadline`: zero if that has passed.
fn time_to_margin(deadline: SystemTime, margin: Duration) -> Duration {
    deadline
        .duration_since(SystemTime::now())
        .unwrap_or_default()
        .saturating_sub(margin)
}

/// What the functions of both stores do with one invocation's batch: [`LambdaSqs`] runs it
/// through the SQL [`Worker`], `DynamoLambdaSqs` through a DynamoDB dispatcher. Their `handle`
/// ([`answer`]) and `run` ([`serve`]) are written once over it.
trait BatchRunner: Clone + Send + Sync + 'static {
    /// The counts of one batch.
    type Report;

    /// Runs `event`'s batch (under the invocation's `deadline`, if given): its partial batch
    /// response and its counts.
    fn run_batch(
        &self,
        event: SqsEvent,
        deadline: Option<SystemTime>,
    ) -> impl Future<Output = Result<(SqsBatchResponse, Self::Report), LambdaSqsError>> + Send;
}

/// `runner`'s partial batch response to `event`, with no deadline: `handle` of both functions.
async fn answer(
    runner: &impl BatchRunner,
    event: SqsEvent,
) -> Result<SqsBatchResponse, LambdaSqsError> {
    runner
        .run_batch(event, None)
        .await
        .map(|(response, _report)| response)
}

/// Polls the Lambda runtime API for SQS events until it stops answering, answering each with
/// `runner`'s response under the invocation's deadline (an error is reported as the
/// invocation's): `run` of both functions.
async fn serve(runner: impl BatchRunner) -> Result<(), lambda_runtime::Error> {
    lambda_runtime::run(service_fn(move |event: LambdaEvent<SqsEvent>| {
        let runner = runner.clone();
        async move {
            runner
                .run_batch(event.payload, Some(event.context.deadline()))
                .await
                .map(|(response, _)| response)
        }
    }))
    .await
}

/// What became of one record.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Fate {
    /// Not settled yet (or never: the run ended without it): listed.
    Pending,
    /// Acked or rejected: deleted.
    Deleted,
    /// Requeued or dropped unsettled: listed.
    Listed,
}

#[derive(Debug)]
struct BatchState {
    fates: Vec<Fate>,
    /// FIFO groups with a listed record: their later records are no longer current.
    failed_groups: HashSet<String>,
}

/// The records of one invocation and what became of each.
#[derive(Debug)]
struct Batch {
    message_ids: Vec<Option<String>>,
    state: Mutex<BatchState>,
}

impl Batch {
    /// The records' `messageId`s, none settled yet.
    fn new(records: &[SqsMessage]) -> Self {
        Self {
            message_ids: records.iter().map(|r| r.message_id.clone()).collect(),
            state: Mutex::new(BatchState {
                fates: vec![Fate::Pending; records.len()],
                failed_groups: HashSet::new(),
            }),
        }
    }

    fn len(&self) -> usize {
        self.message_ids.len()
    }

    fn settle(&self, index: usize, fate: Fate, group: Option<&str>) {
        let mut state = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(slot) = state.fates.get_mut(index) {
            *slot = fate;
        }
        if fate == Fate::Listed
            && let Some(group) = group
        {
            state.failed_groups.insert(group.to_owned());
        }
    }

    fn group_failed(&self, group: &str) -> bool {
        self.state
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .failed_groups
            .contains(group)
    }

    /// The response: every record not deleted, by `messageId`, in the event's order.
    fn response(&self) -> Result<SqsBatchResponse, LambdaSqsError> {
        let state = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        let mut response = SqsBatchResponse::default();
        for (index, (fate, id)) in state.fates.iter().zip(&self.message_ids).enumerate() {
            if *fate == Fate::Deleted {
                continue;
            }
            match id.as_deref().filter(|id| !id.is_empty()) {
                Some(id) => {
                    let mut failure = BatchItemFailure::default();
                    failure.item_identifier = id.to_owned();
                    response.batch_item_failures.push(failure);
                }
                None => return Err(LambdaSqsError::MissingMessageId { index }),
            }
        }
        Ok(response)
    }
}

/// A source of one batch's records, exhausted after the last.
struct BatchSource {
    name: String,
    pending: VecDeque<Delivery>,
    limit: PayloadLimit,
}

impl BatchSource {
    fn new(records: Vec<SqsMessage>, name_attribute: &str) -> (Self, Arc<Batch>) {
        let batch = Arc::new(Batch::new(&records));
        let name = records.first().map_or_else(|| "sqs".to_owned(), queue_name);
        let pending = records
            .into_iter()
            .enumerate()
            .map(|(index, record)| delivery(&batch, index, record, name_attribute))
            .collect();
        let source = Self {
            name,
            pending,
            limit: PayloadLimit::DEFAULT,
        };
        (source, batch)
    }
}

/// The queue's name: the last `:` field of the record's `eventSourceARN`, or `sqs`.
fn queue_name(record: &SqsMessage) -> String {
    record
        .event_source_arn
        .as_deref()
        .and_then(|arn| arn.rsplit(':').next())
        .filter(|name| !name.is_empty())
        .unwrap_or("sqs")
        .to_owned()
}

/// The delivery of the record at `index`.
fn delivery(
    batch: &Arc<Batch>,
    index: usize,
    record: SqsMessage,
    name_attribute: &str,
) -> Delivery {
    let (envelope, group) = envelope(record, name_attribute);
    let delivery = Delivery::new(
        envelope,
        RecordSettler {
            batch: Arc::clone(batch),
            index,
            group: group.clone(),
        },
    );
    match group {
        Some(group) => delivery.with_ordering_key(group),
        None => delivery,
    }
}

/// The envelope of `record` (see the module documentation's "Message name" and "Metadata"),
/// and its FIFO group: its `MessageGroupId` on a FIFO queue, `None` on a standard queue.
fn envelope(record: SqsMessage, name_attribute: &str) -> (Envelope, Option<String>) {
    let queue = queue_name(&record);
    let fifo = queue.ends_with(".fifo");
    let attributes = record.attributes;
    let mut headers = BTreeMap::new();
    for (name, value) in record.message_attributes {
        if let Some(text) = value.string_value {
            headers.insert(name, text);
        }
    }
    let message_name = headers.get(name_attribute).cloned().unwrap_or_default();

    let mut metadata = SourceMetadata::new(queue);
    if let Some(id) = &record.message_id {
        metadata = metadata.message_id(id.clone());
    }
    if let Some(count) = attributes
        .get("ApproximateReceiveCount")
        .and_then(|count| count.parse::<u64>().ok())
    {
        metadata = metadata.delivery_count(count).redelivered(count > 1);
    }
    if let Some(sent) = attributes
        .get("SentTimestamp")
        .and_then(|ms| ms.parse::<u64>().ok())
    {
        metadata = metadata.published_at(SystemTime::UNIX_EPOCH + Duration::from_millis(sent));
    }
    let group = attributes.get("MessageGroupId").cloned();
    if let Some(group) = &group {
        metadata = metadata.partition(group.clone());
    }
    if let Some(id) = attributes.get("MessageDeduplicationId") {
        metadata = metadata.deduplication_id(id.clone());
    }
    if let Some(sequence) = attributes.get("SequenceNumber") {
        metadata = metadata.sequence_number(sequence.clone());
    }

    let mut envelope =
        Envelope::new(message_name, record.body.unwrap_or_default()).with_source(metadata);
    envelope.headers = headers;
    // Only FIFO queues order a group (a standard queue's fair-queue groups do not).
    (envelope, group.filter(|_| fifo))
}

impl Source for BatchSource {
    fn name(&self) -> &str {
        &self.name
    }

    /// A body over `limit` is cut as it is handed out, its memory given back.
    fn set_payload_limit(&mut self, limit: PayloadLimit) {
        self.limit = limit;
    }

    fn next(&mut self) -> BoxFuture<'_, Result<Option<Delivery>, SourceError>> {
        let next = self.pending.pop_front().map(|mut delivery| {
            delivery.envelope.limit_to(self.limit);
            delivery
        });
        Box::pin(async move { Ok(next) })
    }
}

/// Settles one record: deleted (not listed) or listed in the response.
struct RecordSettler {
    batch: Arc<Batch>,
    index: usize,
    /// The FIFO group.
    group: Option<String>,
}

impl Settle for RecordSettler {
    fn settle(self: Box<Self>, settlement: Settlement) -> SettleFuture {
        let fate = match settlement {
            Settlement::Ack | Settlement::Reject => Fate::Deleted,
            Settlement::Requeue { .. } => Fate::Listed,
        };
        self.batch.settle(self.index, fate, self.group.as_deref());
        Box::pin(async { Ok(()) })
    }

    fn abandon(self: Box<Self>) {
        self.batch
            .settle(self.index, Fate::Listed, self.group.as_deref());
    }

    fn is_current(&self) -> bool {
        self.group
            .as_deref()
            .is_none_or(|group| !self.batch.group_failed(group))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record(id: Option<&str>, arn: &str) -> SqsMessage {
        let mut record = SqsMessage::default();
        record.message_id = id.map(str::to_owned);
        record.event_source_arn = Some(arn.to_owned());
        record
    }

    #[test]
    fn the_response_lists_what_was_not_deleted_in_the_event_order() {
        let arn = "arn:aws:sqs:eu-west-1:123456789012:payments";
        let records = vec![
            record(Some("a"), arn),
            record(Some("b"), arn),
            record(Some("c"), arn),
        ];
        let (source, batch) = BatchSource::new(records, DEFAULT_NAME_ATTRIBUTE);
        assert_eq!(source.name, "payments");
        batch.settle(2, Fate::Listed, None);
        batch.settle(1, Fate::Deleted, None);
        let ids: Vec<_> = batch
            .response()
            .unwrap()
            .batch_item_failures
            .into_iter()
            .map(|f| f.item_identifier)
            .collect();
        // `a` was never settled: listed too.
        assert_eq!(ids, ["a", "c"]);
    }

    #[test]
    fn a_record_to_list_without_a_message_id_fails_the_invocation() {
        let arn = "arn:aws:sqs:eu-west-1:123456789012:q";
        let records = vec![record(Some("a"), arn), record(None, arn)];
        let (_source, batch) = BatchSource::new(records, DEFAULT_NAME_ATTRIBUTE);
        batch.settle(0, Fate::Deleted, None);
        assert!(matches!(
            batch.response(),
            Err(LambdaSqsError::MissingMessageId { index: 1 })
        ));
        batch.settle(1, Fate::Deleted, None);
        assert!(batch.response().unwrap().batch_item_failures.is_empty());
    }

    #[test]
    fn queue_names_come_from_the_arn() {
        assert_eq!(
            queue_name(&record(None, "arn:aws:sqs:r:1:orders.fifo")),
            "orders.fifo"
        );
        assert_eq!(queue_name(&SqsMessage::default()), "sqs");
    }
}
