//! SQS batches run through a [`DynamoDispatcher`]: [`DynamoLambdaSqs`] (features `lambda` and
//! `dynamodb`). The mapping of outcomes is in the [parent module's documentation](super).

use std::collections::HashMap;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, SystemTime};

use futures_util::stream::{self, StreamExt};
use tokio::time::Instant;

use super::sqs::{SqsBatchResponse, SqsEvent};
use super::{
    Batch, BatchRunner, DEFAULT_DEADLINE_MARGIN, DEFAULT_NAME_ATTRIBUTE, Fate, LambdaSqsError,
    answer, envelope, serve, time_to_margin,
};
use crate::dynamodb::{DynamoConsumerOutcome, DynamoDispatcher, DynamoError};
use crate::setters::setters;
use crate::types::envelope::Envelope;
use crate::types::error::Disposition;
use crate::types::outcome::Outcome;

/// How many records (FIFO: groups) [`DynamoLambdaSqs`] runs at once unless
/// [`DynamoLambdaSqs::concurrency`] says otherwise: 8, as the [`Worker`](crate::Worker)'s
/// default.
pub const DEFAULT_DYNAMO_CONCURRENCY: usize = 8;

/// Runs an SQS event source mapping's batches through a [`DynamoDispatcher`] (the claim and the
/// handler's DynamoDB writes in one `TransactWriteItems` per record and consumer), answering
/// each with the partial batch response: the DynamoDB counterpart of
/// [`LambdaSqs`](super::LambdaSqs), which runs them through the SQL [`Worker`](crate::Worker).
/// The mapping of outcomes to the response is in the
/// [module documentation](super#on-dynamodb).
///
/// Build it once per execution environment (a cold start), outside the handler, so that its
/// DynamoDB client is reused by every invocation; clones share the dispatcher.
///
/// ```no_run
/// use inbox_runtime::dynamodb::{DynamoDispatcher, DynamoInbox};
/// use inbox_runtime::source::lambda::DynamoLambdaSqs;
///
/// #[tokio::main]
/// async fn main() -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
///     // AWS_REGION and the function's role, as Lambda sets them.
///     let client = inbox_runtime::dynamodb::client(None).await;
///     let dispatcher = DynamoDispatcher::from_registry(DynamoInbox::new(client, "inbox"))?;
///     DynamoLambdaSqs::new(dispatcher).concurrency(4).run().await
/// }
/// ```
#[derive(Debug, Clone)]
pub struct DynamoLambdaSqs {
    dispatcher: Arc<DynamoDispatcher>,
    name_attribute: Arc<str>,
    deadline_margin: Duration,
    concurrency: usize,
}

/// What one [`DynamoLambdaSqs`] invocation did. Consumer counts are per consumer outcome (a
/// message routed to two consumers counts twice); record counts are per SQS record.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct DynamoLambdaReport {
    /// Records in the event.
    pub records: u64,
    /// Records not listed: Lambda deletes them.
    pub deleted: u64,
    /// Records listed in `batchItemFailures`: received again after the visibility timeout.
    pub listed: u64,
    /// Consumer outcomes [`Outcome::Processed`]: effects committed by this invocation.
    pub processed: u64,
    /// Consumer outcomes [`Outcome::Duplicate`].
    pub duplicates: u64,
    /// Consumer outcomes [`Outcome::Dead`] (dead-lettered earlier), and handler failures
    /// recorded as dead now ([`Disposition::Dead`]): deleted, the payload kept in the inbox.
    pub dead: u64,
    /// Consumer outcomes [`Outcome::Discarded`]: keys an operator discarded, not run.
    pub discarded: u64,
    /// Consumer outcomes [`Outcome::NotYet`]: a failed key received again before its next
    /// attempt was due; listed.
    pub not_yet: u64,
    /// Consumer results [`DynamoError::Conflict`]: the conflicting payload is kept in the inbox
    /// table (one too large for an item is not), and the record listed, logged (for the
    /// dead-letter queue too).
    pub conflicts: u64,
    /// Consumer failures to receive again: a retryable handler failure, a failure not recorded,
    /// a DynamoDB error (any [`DynamoError`] but a conflict or a dead letter); listed.
    pub failed: u64,
    /// Records the dispatcher refused ([`DispatchError`](crate::DispatchError): no or unknown
    /// message name, malformed payload, bad key, too large): kept in the inbox table
    /// ([`DynamoDispatcher::record_rejection`]) and deleted; listed if they could not be kept
    /// (DynamoDB failed, or the item would pass its 400 KB limit). Logged either way.
    pub refused: u64,
    /// Records listed unrun: later records of a FIFO group with a listed record, and records not
    /// started before the deadline margin.
    pub not_run: u64,
    /// Records still running half the deadline margin after it began: dropped, listed.
    pub abandoned: u64,
}

impl DynamoLambdaSqs {
    /// Batches run by `dispatcher`, up to [`DEFAULT_DYNAMO_CONCURRENCY`] records (FIFO: groups)
    /// at once, with the message name in the attribute [`DEFAULT_NAME_ATTRIBUTE`] and a
    /// deadline margin of [`DEFAULT_DEADLINE_MARGIN`].
    pub fn new(dispatcher: DynamoDispatcher) -> Self {
        Self {
            dispatcher: Arc::new(dispatcher),
            name_attribute: Arc::from(DEFAULT_NAME_ATTRIBUTE),
            deadline_margin: DEFAULT_DEADLINE_MARGIN,
            concurrency: DEFAULT_DYNAMO_CONCURRENCY,
        }
    }

    setters! {
        /// Sets how long before the invocation's deadline (the function's timeout) no record
        /// starts any more (default [`DEFAULT_DEADLINE_MARGIN`], 3 s): the records not started
        /// are listed; those running get half the margin to settle, then are dropped and listed
        /// (a transaction that committed meanwhile is a duplicate on the next receive).
        pub fn deadline_margin(margin: Duration);

        /// Sets the String message attribute that holds the message name (default
        /// [`DEFAULT_NAME_ATTRIBUTE`]). A record without it gets the empty name, which the
        /// dispatcher refuses: it is listed.
        pub fn name_attribute(attribute: impl Into<String>) {
            self.name_attribute = Arc::from(attribute.into());
        }

        /// Sets how many records run at once, at least 1 (default
        /// [`DEFAULT_DYNAMO_CONCURRENCY`], 8). On a FIFO queue it bounds the groups running at
        /// once: a group's records run one at a time.
        pub fn concurrency(n: usize) {
            self.concurrency = n.max(1);
        }
    }

    /// The dispatcher that runs the records.
    pub fn dispatcher(&self) -> &DynamoDispatcher {
        &self.dispatcher
    }

    /// Runs one invocation's batch: every record dispatched, the response listing the
    /// `messageId` of each record to receive again, in the order of `event.records`.
    ///
    /// # Errors
    /// [`LambdaSqsError::MissingMessageId`] if a record to list has no `messageId` (the whole
    /// batch is then retried by Lambda).
    pub async fn handle(&self, event: SqsEvent) -> Result<SqsBatchResponse, LambdaSqsError> {
        answer(self, event).await
    }

    /// [`handle`](Self::handle), with the counts of the batch.
    ///
    /// # Errors
    /// As [`handle`](Self::handle).
    pub async fn handle_reporting(
        &self,
        event: SqsEvent,
    ) -> Result<(SqsBatchResponse, DynamoLambdaReport), LambdaSqsError> {
        self.run_batch(event, None).await
    }

    /// [`handle_reporting`](Self::handle_reporting) for an invocation that must answer by
    /// `deadline` (Lambda's `Lambda-Runtime-Deadline-Ms`, [`lambda_runtime::Context::deadline`]):
    /// no record starts [`deadline_margin`](Self::deadline_margin) before it, and the records
    /// not settled half the margin later are listed.
    ///
    /// # Errors
    /// As [`handle`](Self::handle).
    pub async fn handle_by(
        &self,
        event: SqsEvent,
        deadline: SystemTime,
    ) -> Result<(SqsBatchResponse, DynamoLambdaReport), LambdaSqsError> {
        self.run_batch(event, Some(deadline)).await
    }

    /// Runs the function: polls the Lambda runtime API (`AWS_LAMBDA_RUNTIME_API`) for SQS
    /// events, answers each with [`handle_by`](Self::handle_by)'s response under the
    /// invocation's deadline, until the runtime API stops answering.
    ///
    /// # Errors
    /// As [`LambdaSqs::run`](super::LambdaSqs::run).
    ///
    /// # Panics
    /// As [`LambdaSqs::run`](super::LambdaSqs::run): if the environment variables Lambda sets are
    /// missing.
    pub async fn run(self) -> Result<(), lambda_runtime::Error> {
        serve(self).await
    }
}

impl BatchRunner for DynamoLambdaSqs {
    type Report = DynamoLambdaReport;

    async fn run_batch(
        &self,
        event: SqsEvent,
        deadline: Option<SystemTime>,
    ) -> Result<(SqsBatchResponse, DynamoLambdaReport), LambdaSqsError> {
        let batch = Batch::new(&event.records);
        let records = event.records.len();
        // A lane per FIFO group (its records in the event's order), and one per other record.
        let mut lanes: Vec<Vec<(usize, Envelope)>> = Vec::new();
        let mut groups: HashMap<String, usize> = HashMap::new();
        for (index, record) in event.records.into_iter().enumerate() {
            let (envelope, group) = envelope(record, &self.name_attribute);
            match group {
                Some(group) => {
                    let lane = *groups.entry(group).or_insert_with(|| {
                        lanes.push(Vec::new());
                        lanes.len() - 1
                    });
                    lanes[lane].push((index, envelope));
                }
                None => lanes.push(vec![(index, envelope)]),
            }
        }
        let start_by = deadline
            .map(|deadline| Instant::now() + time_to_margin(deadline, self.deadline_margin));
        let run = Run {
            this: self,
            batch: &batch,
            start_by,
            counts: Mutex::new(Counts::default()),
        };
        let lanes = stream::iter(lanes)
            .map(|lane| run.lane(lane))
            .buffer_unordered(self.concurrency)
            .for_each(|()| async {});
        match start_by {
            Some(start_by) => {
                let settle_by = start_by + self.deadline_margin / 2;
                if tokio::time::timeout_at(settle_by, lanes).await.is_err() {
                    tracing::warn!(
                        "the invocation's deadline is near: SQS records still running are \
                         dropped and listed"
                    );
                }
            }
            None => lanes.await,
        }
        let response = batch.response()?;
        let counts = run
            .counts
            .into_inner()
            .unwrap_or_else(PoisonError::into_inner);
        let mut report = counts.report;
        report.records = records as u64;
        report.listed = response.batch_item_failures.len() as u64;
        report.deleted = report.records - report.listed;
        report.not_run = report.records - counts.started;
        report.abandoned = counts.started - counts.settled;
        tracing::info!(
            records = report.records,
            failures = report.listed,
            processed = report.processed,
            duplicates = report.duplicates,
            dead = report.dead,
            conflicts = report.conflicts,
            refused = report.refused,
            "SQS batch handled on DynamoDB"
        );
        Ok((response, report))
    }
}

/// The counts of one invocation so far.
#[derive(Default)]
struct Counts {
    report: DynamoLambdaReport,
    /// Records started.
    started: u64,
    /// Records started and settled (deleted or listed).
    settled: u64,
}

/// One invocation's run.
struct Run<'a> {
    this: &'a DynamoLambdaSqs,
    batch: &'a Batch,
    /// No record starts from then on.
    start_by: Option<Instant>,
    counts: Mutex<Counts>,
}

impl Run<'_> {
    fn counts(&self) -> std::sync::MutexGuard<'_, Counts> {
        self.counts.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Runs a lane's records in order, until one is listed (the rest of a FIFO group is then
    /// listed unrun) or the deadline margin begins.
    async fn lane(&self, records: Vec<(usize, Envelope)>) {
        for (index, envelope) in records {
            if self.start_by.is_some_and(|at| Instant::now() >= at) {
                tracing::warn!(
                    message_id = envelope_message_id(&envelope),
                    "the invocation's deadline is near: SQS record not started, listed"
                );
                return;
            }
            self.counts().started += 1;
            let fate = self.record(&envelope).await;
            self.batch.settle(index, fate, None);
            self.counts().settled += 1;
            if fate == Fate::Listed {
                return;
            }
        }
    }

    /// Dispatches one record: deleted if every consumer is done with it, else listed.
    async fn record(&self, envelope: &Envelope) -> Fate {
        let message_id = envelope_message_id(envelope);
        match self.this.dispatcher.dispatch(envelope).await {
            Err(error) => {
                self.counts().report.refused += 1;
                self.keep_refused(envelope, &error, message_id).await
            }
            Ok(outcomes) => {
                let mut fate = Fate::Deleted;
                for outcome in &outcomes {
                    if !self.consumer_done(outcome, message_id) {
                        fate = Fate::Listed;
                    }
                }
                fate
            }
        }
    }

    /// A record the dispatcher refused: kept in the inbox table, then deleted; listed if it
    /// could not be kept (DynamoDB failed) or was kept cut to DynamoDB's item limit though its
    /// payload was within the dispatcher's (the queue's redrive policy keeps it whole).
    async fn keep_refused(
        &self,
        envelope: &Envelope,
        error: &crate::DispatchError,
        message_id: &str,
    ) -> Fate {
        let kept = self.this.dispatcher.record_rejection(envelope, error).await;
        let (fate, what) = match &kept {
            Ok(kept) if kept.loses_nothing(error) => (
                Fate::Deleted,
                "SQS record refused by the DynamoDB dispatcher: kept as a rejection in the inbox \
                 table, deleted",
            ),
            Ok(_) => (
                Fate::Listed,
                "SQS record refused by the DynamoDB dispatcher: kept cut to DynamoDB's item size \
                 limit, listed, so that the queue's redrive policy keeps it whole",
            ),
            Err(_) => (
                Fate::Listed,
                "SQS record refused by the DynamoDB dispatcher and not kept: listed, so that it is \
                 received again or the queue's redrive policy moves it to its dead-letter queue",
            ),
        };
        match &kept {
            Ok(_) if fate == Fate::Deleted => tracing::warn!(
                message_id,
                message_name = %envelope.message_name,
                reason = %error,
                "{what}"
            ),
            _ => tracing::error!(
                message_id,
                message_name = %envelope.message_name,
                reason = %error,
                error = kept.as_ref().err().map(tracing::field::display),
                "{what}"
            ),
        }
        fate
    }

    /// Counts one consumer's outcome; `true` if the record may be deleted for it.
    fn consumer_done(&self, outcome: &DynamoConsumerOutcome, message_id: &str) -> bool {
        let consumer = outcome.consumer;
        let mut counts = self.counts();
        let report = &mut counts.report;
        match &outcome.result {
            Ok(Outcome::Processed(())) => report.processed += 1,
            Ok(Outcome::Duplicate) => report.duplicates += 1,
            Ok(Outcome::Dead) => report.dead += 1,
            Ok(Outcome::Discarded) => report.discarded += 1,
            // Not on DynamoDB (no per-aggregate ordering): consumed, as the SQL worker acks them.
            Ok(Outcome::Stale | Outcome::Parked) => {}
            Ok(Outcome::NotYet { .. }) => {
                report.not_yet += 1;
                return false;
            }
            // Kept in the inbox table unless too large for an item: listed, so that the queue's
            // redrive policy moves it to its dead-letter queue in either case.
            Err(DynamoError::Conflict(conflict)) => {
                tracing::warn!(message_id, consumer, %conflict, "SQS record in conflict: listed");
                report.conflicts += 1;
                return false;
            }
            Err(DynamoError::Handler(failure)) if failure.disposition == Disposition::Dead => {
                tracing::warn!(message_id, consumer, %failure, "SQS record dead-lettered: deleted");
                report.dead += 1;
            }
            Err(error) => {
                tracing::warn!(message_id, consumer, %error, "SQS record failed: listed");
                report.failed += 1;
                return false;
            }
        }
        true
    }
}

/// The record's `messageId` (empty if it has none), for the logs.
fn envelope_message_id(envelope: &Envelope) -> &str {
    envelope
        .source
        .as_ref()
        .and_then(|source| source.message_id.as_deref())
        .unwrap_or_default()
}
