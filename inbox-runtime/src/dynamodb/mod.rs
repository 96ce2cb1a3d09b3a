//! Amazon DynamoDB as the inbox's store: the claim and the handler's DynamoDB writes in **one
//! `TransactWriteItems`**, for services whose state lives in DynamoDB. Cargo feature `dynamodb`
//! (the official [aws-sdk-dynamodb](https://docs.rs/aws-sdk-dynamodb), rustls with ring;
//! re-exported as [`sdk`], so the handler's items need no dependency of their own).
//!
//! ```no_run
//! use inbox_runtime::dynamodb::DynamoInbox;
//! use inbox_runtime::dynamodb::sdk::types::{AttributeValue, Update};
//! use inbox_runtime::{Message, Outcome, Permanent};
//!
//! #[derive(Clone, serde::Serialize, serde::Deserialize, Message)]
//! #[message(name = "payments.captured")]
//! struct PaymentCaptured {
//!     #[message(key)]
//!     event_id: String,
//!     account_id: String,
//!     amount_cents: i64,
//! }
//!
//! # async fn demo(msg: PaymentCaptured) -> Result<(), Box<dyn std::error::Error>> {
//! let client = inbox_runtime::dynamodb::client(None).await; // AWS_ENDPOINT_URL, AWS_REGION, …
//! let inbox = DynamoInbox::new(client, "inbox");
//! inbox.ensure_table().await?;
//! let msg = &msg;
//! let outcome = inbox
//!     .process("ledger", msg, |mut tx| async move {
//!         let credit = Update::builder()
//!             .table_name("accounts")
//!             .key("id", AttributeValue::S(msg.account_id.clone()))
//!             .update_expression("ADD balance :amount")
//!             .expression_attribute_values(":amount", AttributeValue::N(msg.amount_cents.to_string()))
//!             .build()
//!             .map_err(Permanent::new)?; // the handler's error type says its class
//!         tx.update(credit);
//!         Ok::<_, Permanent>((tx, ()))
//!     })
//!     .await?;
//! match outcome {
//!     Outcome::Processed(()) => println!("credited"),
//!     Outcome::Duplicate => println!("already credited"),
//!     other => println!("not now: {other:?}"),
//! }
//! # Ok(()) }
//! ```
//!
//! ## `#[idempotent]` handlers and the dispatcher
//!
//! `#[idempotent]` on an `async fn` whose first parameter is `&mut DynamoTx` makes a DynamoDB
//! handler: its body adds the actions, and the function becomes
//! `fn(inbox: &DynamoInbox, msg: M) -> Result<Outcome<T>, DynamoError<E>>` (the SQL form takes
//! the connection and returns [`crate::Error<E>`]), run as [`DynamoInbox::process`] runs a
//! closure, with the handler's `key`, `max_attempts` and error class, and per-aggregate ordering
//! (`aggregate`, `sequence`, `gaps = "park"`; see [`ordering`]). The handlers register apart
//! from the SQL ones: [`DynamoDispatcher`] runs raw deliveries by message name and replays dead
//! letters ([`DynamoDispatcher::replay`]).
//!
//! ```no_run
//! use inbox_runtime::dynamodb::sdk::types::{AttributeValue, Update};
//! use inbox_runtime::dynamodb::{DynamoDispatcher, DynamoInbox, DynamoTx};
//! use inbox_runtime::{Envelope, Message, Outcome, Permanent, idempotent};
//!
//! #[derive(Clone, serde::Serialize, serde::Deserialize, Message)]
//! #[message(name = "payments.captured")]
//! struct PaymentCaptured {
//!     #[message(key)]
//!     event_id: String,
//!     account_id: String,
//!     amount_cents: i64,
//! }
//!
//! #[idempotent(consumer = "ledger", max_attempts = 5)]
//! async fn credit(tx: &mut DynamoTx, msg: PaymentCaptured) -> Result<(), Permanent> {
//!     let credit = Update::builder()
//!         .table_name("accounts")
//!         .key("id", AttributeValue::S(msg.account_id.clone()))
//!         .update_expression("ADD balance :amount")
//!         .expression_attribute_values(":amount", AttributeValue::N(msg.amount_cents.to_string()))
//!         .build()
//!         .map_err(Permanent::new)?;
//!     tx.update(credit);
//!     Ok(())
//! }
//!
//! # async fn demo(inbox: DynamoInbox, msg: PaymentCaptured, delivery: Envelope) -> Result<(), Box<dyn std::error::Error>> {
//! assert!(matches!(credit(&inbox, msg).await?, Outcome::Processed(()) | Outcome::Duplicate));
//! let dispatcher = DynamoDispatcher::from_registry(inbox)?;
//! for outcome in dispatcher.dispatch(&delivery).await? {
//!     println!("{}: {:?}", outcome.consumer, outcome.result);
//! }
//! # Ok(()) }
//! ```
//!
//! ## How one delivery runs ([`DynamoInbox::process`])
//!
//! 1. **Read** the key's inbox item (`GetItem`, strongly consistent). A processed item whose
//!    `expires_at` (the retention window's end, epoch seconds) has passed counts as absent:
//!    DynamoDB's TTL deletes expired items lazily (typically within days), so the runtime never
//!    treats an expired key as a duplicate. Failed and dead items have no `expires_at`: TTL
//!    never deletes them (a dead letter keeps its payload, a failed key its attempt count), as
//!    the SQL stores' purge keeps failed and dead rows. Processed with the same fingerprint →
//!    [`Outcome::Duplicate`]; a different fingerprint → [`DynamoError::Conflict`]; dead →
//!    [`Outcome::Dead`]; failed and its next attempt not due → [`Outcome::NotYet`]. Nothing
//!    else is called (but for a conflict, whose payload is kept: one `PutItem`,
//!    [`rejections`]): a duplicate costs one read.
//! 2. **Run the handler**: it gets a [`DynamoTx`] and adds its `Put`, `Update`, `Delete` and
//!    `ConditionCheck` actions (at most 99, [`MAX_HANDLER_ITEMS`]), and returns it with its value.
//!    It should write nowhere else: only what it adds commits with the claim.
//! 3. **Submit** the claim and the handler's actions as one `TransactWriteItems`. The claim is
//!    the first action: a conditional `Put` of the inbox item (status `processed`, the payload's
//!    fingerprint, the attempt count), on the condition that the item is still as it was read:
//!    `attribute_not_exists(pk) OR expires_at <= :now` for a new (or expired) key, or
//!    `status = failed AND attempts = :read AND payload_hash = :hash` to take over a failed
//!    attempt (`status = dead AND …` for a replay of a dead letter,
//!    [`DynamoInbox::replay_stored`]). The call carries a client request token derived from consumer, key, attempt
//!    number and this delivery's resend number, so that the SDK's own retry of a submit whose
//!    answer was lost is not applied twice (DynamoDB keeps tokens for 10 minutes). The claim's
//!    condition, not the token, is what keeps an effect from applying twice: another delivery
//!    that reuses a token with other parameters gets `IdempotentParameterMismatch`, read as
//!    a failed claim (the item decides).
//! 4. **Map a cancellation** (`TransactionCanceledException`) by its reasons, one per action:
//!    * the claim's `ConditionalCheckFailed`: another delivery changed the item since the read.
//!      The item as it is now comes with the reason (`ALL_OLD`) or from a new read, and is
//!      decided as in step 1 (duplicate, conflict, dead, not yet due); if it can be claimed
//!      again, the delivery starts over (at most [`MAX_ROUNDS`] rounds);
//!    * for a message ordered per aggregate, the sequence guard's `ConditionalCheckFailed`
//!      (action 1, between the claim and the handler's actions): stale, or parked
//!      ([`ordering`]);
//!    * a handler action's `ConditionalCheckFailed`: the handler's own business failure
//!      ([`ConditionFailed`]), recorded like a handler error;
//!    * `TransactionConflict` (another transaction on one of the items), `ThrottlingError`,
//!      `ProvisionedThroughputExceeded`, `RequestLimitExceeded`: transient; the same actions
//!      are sent again after the policy's in-process delays
//!      ([`RetryPolicy::transient_retries`]) under a new client request token (a cancelled
//!      transaction wrote nothing; an error with no cancellation, such as
//!      `TransactionInProgressException`, is resent under the same token, as it may have
//!      applied); counted in [`DynamoStats::transient_retries`]; when they
//!      run out, [`DynamoError::Transient`];
//!    * anything else (`ValidationError`, `ItemCollectionSizeLimitExceeded`, …):
//!      [`DynamoError::Cancelled`] with every reason; nothing was written or recorded.
//! 5. **Record a failure** (the handler's error, or a condition of its actions) in a write of its
//!    own, after nothing of the transaction committed: a conditional `Put` of the inbox item with
//!    the same condition as the claim, status `failed` (attempts, `next_attempt_at` from the
//!    [`RetryPolicy`], `last_error`, the payload) or `dead` when the error is
//!    [`ErrorClass::Permanent`] or the attempts reached `max_attempts`. A record whose condition
//!    fails (another delivery got there first) is [`Disposition::NotRecorded`].
//!
//! ## The inbox table
//!
//! One table, partition key `pk` (string): `<len>:<consumer><key>`, the consumer's length in
//! UTF-8 bytes, a colon, the consumer and the idempotency key (no two pairs share one). On-demand
//! billing; TTL on `expires_at`. Attributes: `consumer`, `message_key`, `message_name`,
//! `payload_hash` (64 hex digits, [`Fingerprint`]), `status` (`processed`, `failed`, `dead`,
//! `parked` or `stale`, with `aggregate_id` and `sequence` for ordered messages: see
//! [`ordering`], which also describes the aggregates' positions and the parked messages'
//! pointers kept in the same table; `in_progress` for the lease of an HTTP request still running, see
//! `http::DynamoIdempotencyLayer`, with `lease_owner` and `lease_until`: skipped by the admin's
//! `stats` and `show`), `result` (binary: the stored response of an HTTP request's processed
//! key, in [`StoredMessage::result`](crate::store::StoredMessage) of the admin's `show` and
//! `list`),
//! `attempts`, `received_at`, `processed_at`, `next_attempt_at` (epoch milliseconds),
//! `last_error`, `payload` (binary; failed and dead only), `expires_at` (epoch seconds;
//! processed, and discarded from the discard on), [`DEAD_LETTER_ATTRIBUTE`] (the consumer;
//! failed and dead only: the key of the sparse global secondary index [`DEAD_LETTER_INDEX`],
//! sorted by `received_at`). A `discarded` item (an operator's
//! [`DynamoAdmin::discard`]) answers its key's redeliveries [`Outcome::Discarded`] until its
//! retention window ends; another payload under it is a [`DynamoError::Conflict`].
//!
//! ## From a broker
//!
//! [`DynamoWorker`] runs the [`DynamoDispatcher`] from any long-running
//! [`Source`](crate::source::Source) (SQS, RabbitMQ, NATS, Kafka, a file) with the
//! [`Worker`](crate::Worker)'s guarantees: settled after commit ([`dynamo_settlement_for`]),
//! bounded concurrency, ordering keys, graceful shutdown. In AWS Lambda,
//! [`DynamoLambdaSqs`](crate::source::lambda::DynamoLambdaSqs) (feature `lambda`) answers SQS
//! batches instead.
//!
//! ## Operating it
//!
//! [`DynamoInbox::admin`] gives the SQL admin's operations on the table ([`DynamoAdmin`]:
//! stats, list, show, discard; their DynamoDB calls and read costs are in its module's docs),
//! [`DynamoInbox::replay_stored`] runs a failed or dead message once more through the claim,
//! and `ops::cli::dynamodb` (features `cli` and `dynamodb`) is the command line on it, store URL
//! `dynamodb://TABLE` ([`DynamoInbox::from_url`]).
//!
//! ## Limits and differences from the SQL stores
//!
//! * At most 99 handler actions (DynamoDB's 100 per transaction, less the claim), and about
//!   4 MB per transaction ([`DynamoError::TooManyItems`], [`DynamoError::TooLarge`], checked
//!   before any call); an item is at most 400 KB, a failed or dead item's payload included. A
//!   failure whose item would be larger is not recorded ([`Disposition::NotRecorded`], logged,
//!   no call): such a message is redelivered by the broker, never counted toward
//!   `max_attempts` and never dead-lettered here. Give its queue a dead-letter queue of its own
//!   (SQS: a redrive policy's `maxReceiveCount`).
//! * Times come from this process's clock (DynamoDB has no clock a condition can read): the
//!   workers' clocks should agree to well under the retry delays and the retention window.
//! * A handler action on the inbox table's own item of this key is refused by DynamoDB (one
//!   action per item per transaction): [`DynamoError::Cancelled`] or [`DynamoError::Dynamo`].
//! * Not yet: the console, the outbox's listing and command line (dead outbox items:
//!   [`DynamoOutbox::retry`] and [`DynamoOutbox::discard`]), a listing of the kept rejections
//!   (they are items of the inbox table, see [`rejections`]; `stats` counts them).
//! * [`DynamoWorker`] is the [`Worker`](crate::Worker) without what is SQL-only: batches of
//!   deliveries per transaction, kept connection slots, partitions.
//!
//! ## Per-aggregate ordering
//!
//! Ordered messages (`#[message(aggregate)]`, `#[message(sequence)]`) go through a sequence
//! guard in the claim's own transaction: [`Outcome::Stale`], [`Outcome::Parked`] and the release
//! of parked successors in order, as on the SQL stores, with the aggregate's position and parked
//! messages' pointers as items of the inbox table. The items, each path's calls and the sweep:
//! [`ordering`].
//!
//! ## The outbox
//!
//! [`DynamoTx::publish`] writes an outbox item in the delivery's transaction (stable ids, as on
//! the SQL stores), into a table of its own ([`DynamoOutbox`]); a polling [`DynamoRelay`]
//! publishes the committed items to a [`Sink`](crate::sink::Sink). What it guarantees, in what
//! order, its limits and its calls: [`outbox`].

mod admin;
pub(crate) mod dispatch;
pub(crate) mod handler;
#[cfg(feature = "http")]
pub(crate) mod lease;
pub mod ordering;
pub mod outbox;
pub mod rejections;
mod size;
mod sweep;
mod worker;

pub use admin::{AdminError, DEAD_LETTER_ATTRIBUTE, DEAD_LETTER_INDEX, DynamoAdmin, INDEX_WAIT};
pub use dispatch::{DynamoConsumerOutcome, DynamoDispatcher};
pub use handler::{DynamoRegistration, registered_dynamo_handlers};

use std::collections::HashMap;
use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use aws_sdk_dynamodb::Client;
use aws_sdk_dynamodb::client::Waiters as _;
use aws_sdk_dynamodb::error::SdkError;
use aws_sdk_dynamodb::operation::delete_item::builders::DeleteItemFluentBuilder;
use aws_sdk_dynamodb::operation::get_item::builders::GetItemFluentBuilder;
use aws_sdk_dynamodb::operation::transact_write_items::TransactWriteItemsError;
use aws_sdk_dynamodb::operation::update_item::builders::UpdateItemFluentBuilder;
use aws_sdk_dynamodb::primitives::Blob;
use aws_sdk_dynamodb::types::{
    AttributeDefinition, AttributeValue, BillingMode, ConditionCheck, Delete, GlobalSecondaryIndex,
    KeySchemaElement, KeyType, Put, ReturnValuesOnConditionCheckFailure, ScalarAttributeType,
    TimeToLiveSpecification, TransactWriteItem, Update,
};
use serde::Serialize;
use sha2::{Digest, Sha256};

use crate::types::classify::{BoxError, Classify, ErrorClass};
use crate::types::error::{Conflict, Disposition, HandlerFailure};
use crate::types::fingerprint::{Fingerprint, FingerprintError};
use crate::types::key::{IdempotencyKey, KeyError};
use crate::types::message::Message;
use crate::types::outcome::Outcome;
use crate::types::policy::RetryPolicy;

/// The official DynamoDB SDK this module is built on (`aws-sdk-dynamodb` 1.x), for the
/// handler's actions (`sdk::types::{Put, Update, Delete, ConditionCheck, AttributeValue}`) and
/// the [`sdk::Client`].
pub use aws_sdk_dynamodb as sdk;
pub use outbox::{DynamoOutbox, DynamoRelay, OutboxCallError, PENDING_INDEX};
pub use worker::{DynamoWorker, dynamo_settlement_for};

/// The most actions a handler may add to one [`DynamoTx`]: 99 (DynamoDB's 100 per
/// `TransactWriteItems`, less the claim).
pub const MAX_HANDLER_ITEMS: usize = size::MAX_TRANSACTION_ITEMS - 1;

/// The most rounds of one delivery in [`DynamoInbox::process`]: a claim whose condition failed
/// because a concurrent delivery failed the key meanwhile (and it is due again) starts over, at
/// most this many times in all; then [`DynamoError::Contended`].
pub const MAX_ROUNDS: u32 = 3;

/// DynamoDB's longest partition key: 2048 bytes (UTF-8). The inbox's [`partition_key`] is at
/// most this long, or [`DynamoError::PartitionKeyTooLong`].
pub const MAX_PARTITION_KEY_BYTES: usize = 2048;

/// The attribute that marks a kept rejection (a refused delivery or a conflict, see
/// [`rejections`]) and holds its reason.
pub const REJECTION_ATTRIBUTE: &str = "rejection";

/// The partition key prefix of kept rejections ([`rejections`]).
pub(crate) const REJECTION_PREFIX: &str = "rejection#";

/// The attribute DynamoDB's TTL is enabled on: the end of the retention window, epoch seconds.
pub const TTL_ATTRIBUTE: &str = "expires_at";

/// The status of the key item of an HTTP request still running: its lease
/// (`crate::http::DynamoIdempotencyLayer`).
pub(crate) const LEASED_STATUS: &str = "in_progress";

/// The default retention window: 7 days.
pub const DEFAULT_RETENTION: Duration = Duration::from_secs(7 * 86_400);

/// A DynamoDB client from the standard AWS configuration (environment variables such as
/// `AWS_ENDPOINT_URL`, `AWS_REGION`, `AWS_ACCESS_KEY_ID`; profiles; instance and container
/// roles), with `endpoint_url` overriding the endpoint if given, on hyper and rustls (ring).
/// Every call attempt times out after 10 s (connect: 5 s); the SDK's standard retry policy
/// applies (3 attempts).
pub async fn client(endpoint_url: Option<&str>) -> Client {
    use aws_smithy_http_client::tls::{Provider, rustls_provider::CryptoMode};
    let http = aws_smithy_http_client::Builder::new()
        .tls_provider(Provider::Rustls(CryptoMode::Ring))
        .build_https();
    let timeouts = aws_config::timeout::TimeoutConfig::builder()
        .connect_timeout(Duration::from_secs(5))
        .read_timeout(Duration::from_secs(10))
        .operation_attempt_timeout(Duration::from_secs(10))
        .operation_timeout(Duration::from_secs(35))
        .build();
    let mut loader = aws_config::defaults(aws_config::BehaviorVersion::latest())
        .http_client(http)
        .timeout_config(timeouts);
    if let Some(url) = endpoint_url {
        loader = loader.endpoint_url(url);
    }
    Client::new(&loader.load().await)
}

/// A business condition of the handler's actions failed: the action at `index` (0-based, in the
/// order the handler added them) had a condition expression that did not hold. Nothing of the
/// transaction was written; the attempt was recorded like a handler error, class
/// [`ErrorClass::Retryable`].
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "the condition of the handler's action {index} ({action} on table `{table}`) failed: {message}"
)]
#[non_exhaustive]
pub struct ConditionFailed {
    /// The action's index among the handler's actions, from 0.
    pub index: usize,
    /// `Put`, `Update`, `Delete` or `ConditionCheck`.
    pub action: &'static str,
    /// The action's table.
    pub table: String,
    /// DynamoDB's message for it.
    pub message: String,
}

impl Classify for ConditionFailed {
    fn class(&self) -> ErrorClass {
        ErrorClass::Retryable
    }
}

/// Why a handler's attempt failed: its own error, or a condition of one of its actions.
#[derive(Debug, thiserror::Error)]
pub enum Failed<E> {
    /// The handler returned this error; nothing was submitted.
    #[error("{0}")]
    Handler(E),
    /// The transaction was cancelled by a condition of the handler's actions.
    #[error(transparent)]
    Condition(ConditionFailed),
}

/// One reason of a cancelled `TransactWriteItems`, for the action at `index` (0 is the claim,
/// 1.. the handler's actions).
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct CancellationReason {
    /// The action's index in the request: 0 is the claim, `i + 1` the handler's action `i`.
    pub index: usize,
    /// DynamoDB's code: `ConditionalCheckFailed`, `TransactionConflict`, `ValidationError`, ….
    pub code: String,
    /// DynamoDB's message, if any.
    pub message: Option<String>,
}

/// Why [`DynamoInbox::process`] did not process a delivery (or does not know whether it did).
/// `E` is the handler's own error type, kept intact in [`DynamoError::Handler`].
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum DynamoError<E> {
    /// The handler failed (its error, or a condition of its actions); nothing of its
    /// transaction was written, and the attempt was then recorded (see
    /// [`HandlerFailure::disposition`]).
    #[error("{0}")]
    Handler(HandlerFailure<Failed<E>>),
    /// The key was processed (or failed, or dead-lettered) with a *different* payload: nothing
    /// ran; the conflicting payload was kept as a rejection item ([`rejections`]), nothing
    /// else was written.
    #[error(transparent)]
    Conflict(#[from] Conflict),
    /// The message has no usable idempotency key: nothing ran.
    #[error(transparent)]
    Key(#[from] KeyError),
    /// The message could not be serialized or fingerprinted: nothing ran.
    #[error(transparent)]
    Fingerprint(#[from] FingerprintError),
    /// The handler added more than [`MAX_HANDLER_ITEMS`] actions (a handler of an ordered
    /// message: 98; see [`ordering`]): nothing was
    /// submitted or recorded.
    #[error(
        "the handler added {items} DynamoDB actions; a transaction takes at most {max} besides the claim"
    )]
    TooManyItems {
        /// Actions the handler added.
        items: usize,
        /// The most this handler may add: [`MAX_HANDLER_ITEMS`], less the sequence guard's actions.
        max: usize,
    },
    /// The transaction (claim and actions) is larger than DynamoDB's 4 MB, or one `Put` item
    /// larger than 400 KB, as estimated by DynamoDB's size rules: nothing was submitted or
    /// recorded.
    #[error("the DynamoDB transaction is too large: {what} is about {bytes} bytes, at most {max}")]
    TooLarge {
        /// `"the transaction"`, `"the Put item of action N"` (the handler's action `N`, from
        /// 0) or `"the claim's inbox item"` (a message name or consumer that large).
        what: String,
        /// Its estimated size in bytes.
        bytes: usize,
        /// The limit in bytes (4,194,304 or 409,600).
        max: usize,
    },
    /// The transaction was cancelled for transient reasons (`TransactionConflict`, throttling)
    /// on every try ([`RetryPolicy::transient_retries`] resends): nothing was written or
    /// recorded; redeliver.
    #[error("the DynamoDB transaction was cancelled on {tries} tries, last for {reasons:?}")]
    Transient {
        /// Submits made.
        tries: usize,
        /// The last cancellation's reasons (codes other than `None`).
        reasons: Vec<CancellationReason>,
    },
    /// The transaction was cancelled for a reason that another try would not change
    /// (`ValidationError`, `ItemCollectionSizeLimitExceeded`, …): nothing was written or
    /// recorded.
    #[error("the DynamoDB transaction was cancelled: {reasons:?}")]
    Cancelled {
        /// Every reason other than `None`.
        reasons: Vec<CancellationReason>,
    },
    /// Concurrent deliveries of the key kept changing its item for [`MAX_ROUNDS`] rounds:
    /// nothing of this delivery was written; redeliver.
    #[error(
        "the inbox item of consumer `{consumer}`, key `{key}` changed under {MAX_ROUNDS} rounds of this delivery"
    )]
    Contended {
        /// The consumer.
        consumer: String,
        /// The idempotency key.
        key: IdempotencyKey,
    },
    /// A DynamoDB call failed; the message gives DynamoDB's error code and text. After a failed
    /// `TransactWriteItems` the outcome is unknown (it may have committed before the answer was
    /// lost): do not ack; the redelivery's read will tell (a duplicate if it had). After a
    /// failed `PutItem` of a conflict's rejection item ([`rejections`]) that item may have been
    /// written: a redelivery keeps another. Any other operation failed before anything was
    /// written. A request DynamoDB refuses
    /// (`ValidationException`: two actions on one item, the handler's action on this key's own
    /// inbox item, a bad expression) wrote nothing, is not recorded as an attempt and is refused
    /// again on every redelivery: it never reaches `max_attempts` or the dead letters.
    #[error("DynamoDB {operation} failed for consumer `{consumer}`, key `{key}`: {}", Chain(source.as_ref()))]
    Dynamo {
        /// The consumer.
        consumer: String,
        /// The idempotency key.
        key: IdempotencyKey,
        /// `GetItem` or `TransactWriteItems` (a failure record that fails is not an error:
        /// [`Disposition::NotRecorded`], logged).
        operation: &'static str,
        /// The SDK's error.
        #[source]
        source: BoxError,
    },
    /// The partition key of consumer and idempotency key ([`partition_key`]) is longer than
    /// DynamoDB's 2048 bytes: a consumer name too long for this key (keys are at most
    /// [`MAX_KEY_BYTES`](crate::types::key::MAX_KEY_BYTES), 512 bytes). Nothing was called.
    #[error(
        "the DynamoDB partition key of consumer `{consumer}`, key `{key}` is {bytes} bytes, at most {max}"
    )]
    PartitionKeyTooLong {
        /// The consumer.
        consumer: String,
        /// The idempotency key.
        key: IdempotencyKey,
        /// The partition key's length in UTF-8 bytes.
        bytes: usize,
        /// DynamoDB's limit, [`MAX_PARTITION_KEY_BYTES`]: 2048.
        max: usize,
    },
    /// The consumer is the empty string: DynamoDB refuses an empty string as the key of the
    /// dead-letter index ([`DEAD_LETTER_ATTRIBUTE`]), so none of its failures could be recorded
    /// (never counted toward `max_attempts`, never dead-lettered). Nothing ran, nothing was
    /// called. (`#[idempotent]` refuses `consumer = ""` when it compiles.)
    #[error("the consumer name is empty: DynamoDB cannot record a failure of it; nothing ran")]
    EmptyConsumer,
    /// The key's inbox item has an attribute missing or malformed (written by something else):
    /// nothing ran.
    #[error("the inbox item of consumer `{consumer}`, key `{key}` is malformed: {reason}")]
    Malformed {
        /// The consumer.
        consumer: String,
        /// The idempotency key.
        key: IdempotencyKey,
        /// What is wrong with it.
        reason: String,
    },
}

/// The error of [`DynamoInbox::ensure_table`]: the SDK's error of `operation`
/// (`CreateTable`, `DescribeTable`, `DescribeTimeToLive`, `UpdateTimeToLive`), or a table that
/// exists with another key schema.
#[derive(Debug, thiserror::Error)]
#[error("DynamoDB {operation} on table `{table}` failed: {}", Chain(source.as_ref()))]
pub struct TableError {
    /// The table.
    pub table: String,
    /// The call that failed.
    pub operation: &'static str,
    /// What went wrong.
    #[source]
    pub source: BoxError,
}

/// The handler's transaction: the DynamoDB actions it adds, submitted with the claim as one
/// `TransactWriteItems` once the handler returns it. At most [`MAX_HANDLER_ITEMS`] actions, on
/// distinct items (DynamoDB refuses two actions on one item).
#[derive(Debug)]
pub struct DynamoTx {
    consumer: String,
    key: IdempotencyKey,
    attempt: u32,
    items: Vec<TransactWriteItem>,
    /// What [`DynamoTx::publish`] has published in this run.
    outbox: outbox::Published,
}

impl DynamoTx {
    /// The consumer (inbox scope) the delivery runs for.
    pub fn consumer(&self) -> &str {
        &self.consumer
    }

    /// The message's idempotency key.
    pub fn key(&self) -> &IdempotencyKey {
        &self.key
    }

    /// This attempt's number for this key, from 1.
    pub fn attempt(&self) -> u32 {
        self.attempt
    }

    /// Adds a `Put` (with its condition, if any). Its item must be at most 400 KB (names and
    /// values, DynamoDB's rules) and on an item no other action of the transaction touches;
    /// checked at submit ([`DynamoError::TooLarge`], or DynamoDB's refusal).
    pub fn put(&mut self, put: Put) -> &mut Self {
        self.push(TransactWriteItem::builder().put(put).build())
    }

    /// Adds an `Update` (with its condition, if any). A condition that fails is the handler's
    /// failure ([`Failed::Condition`]), recorded as a retryable attempt.
    pub fn update(&mut self, update: Update) -> &mut Self {
        self.push(TransactWriteItem::builder().update(update).build())
    }

    /// Adds a `Delete` (with its condition, if any). A condition that fails is the handler's
    /// failure ([`Failed::Condition`]).
    pub fn delete(&mut self, delete: Delete) -> &mut Self {
        self.push(TransactWriteItem::builder().delete(delete).build())
    }

    /// Adds a `ConditionCheck`: the transaction commits only if it holds; if not, the handler's
    /// failure ([`Failed::Condition`]). Every action counts toward [`MAX_HANDLER_ITEMS`] (99):
    /// more are [`DynamoError::TooManyItems`] at submit, nothing sent.
    pub fn condition_check(&mut self, check: ConditionCheck) -> &mut Self {
        self.push(TransactWriteItem::builder().condition_check(check).build())
    }

    /// Adds an action built by hand. An action with none of `Put`, `Update`, `Delete`,
    /// `ConditionCheck` set is refused by DynamoDB ([`DynamoError::Dynamo`]).
    pub fn push(&mut self, item: TransactWriteItem) -> &mut Self {
        self.items.push(item);
        self
    }

    /// The actions added so far.
    pub fn len(&self) -> usize {
        self.items.len()
    }

    /// `true` if the handler added no action (the claim is then submitted alone).
    pub fn is_empty(&self) -> bool {
        self.items.is_empty()
    }
}

/// The inbox on one DynamoDB table: [`process`](Self::process) runs a delivery (see the
/// module's docs). Cheap to clone (the client and the counters are shared).
#[derive(Debug, Clone)]
pub struct DynamoInbox {
    client: Client,
    table: String,
    retention: Duration,
    policy: RetryPolicy,
    counters: Arc<Counters>,
}

/// The counters behind [`DynamoInbox::stats`].
#[derive(Debug, Default)]
struct Counters {
    calls: AtomicU64,
    transient_retries: AtomicU64,
}

/// What a [`DynamoInbox`] (and its clones) did since it was made.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub struct DynamoStats {
    /// DynamoDB calls made by [`DynamoInbox::process`] (`GetItem`, `TransactWriteItems`,
    /// `PutItem`), each counted once whatever the SDK's own retries of it: a new key costs 2
    /// (read, transaction), a duplicate 1 (read), a failure 2 (read, record), a conflict 2 (read,
    /// the kept rejection; [`DynamoInbox::record_rejection`] counts 1), plus the rounds
    /// and resends of contended keys. Ordered messages' paths (stale, parked, the release of
    /// parked successors, the sweep) are counted too: see [`ordering`].
    pub calls: u64,
    /// Resends of a transaction after a transient cancellation (`TransactionConflict`,
    /// throttling) or a transient error.
    pub transient_retries: u64,
}

/// What a read of the key's item says, at `now`.
enum Decision {
    /// Claim it: no item (or an expired one, or a failed one due again).
    Claim(Claim),
    /// Settled or not due: return this (never `Processed`).
    Settled(Outcome<std::convert::Infallible>),
    /// A different payload holds the key.
    Conflict(Fingerprint),
}

/// How the claim's condition reads, after what the read found.
#[derive(Clone, Copy)]
enum Claim {
    /// No item, or an expired one.
    New,
    /// A failed item with this many attempts, due again (or a failed or dead one that a replay
    /// takes over, a parked or failed one that a release takes over); `read` is its status.
    Takeover {
        attempts: u32,
        received_at: i64,
        read: &'static str,
    },
}

impl Claim {
    fn attempts_before(self) -> u32 {
        match self {
            Claim::New => 0,
            Claim::Takeover { attempts, .. } => attempts,
        }
    }

    /// The number of the attempt this claim makes: one more than the attempts before it.
    fn attempt(self) -> u32 {
        self.attempts_before().saturating_add(1)
    }
}

/// Times of one round: now in epoch milliseconds and seconds.
#[derive(Clone, Copy)]
struct Now {
    ms: i64,
}

impl Now {
    fn read() -> Self {
        let ms = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| i64::try_from(d.as_millis()).unwrap_or(i64::MAX));
        Self { ms }
    }

    fn secs(self) -> i64 {
        self.ms.div_euclid(1000)
    }
}

/// A table and its client, for the requests on one item by its key `pk`: each method returns
/// the SDK's request builder with the table and the key set, for the caller to add the rest.
#[derive(Clone, Copy)]
struct ByKey<'a> {
    client: &'a Client,
    table: &'a str,
}

impl ByKey<'_> {
    fn get_item(self, pk: &str) -> GetItemFluentBuilder {
        self.client
            .get_item()
            .table_name(self.table)
            .key("pk", s(pk))
    }

    fn update_item(self, pk: &str) -> UpdateItemFluentBuilder {
        self.client
            .update_item()
            .table_name(self.table)
            .key("pk", s(pk))
    }

    fn delete_item(self, pk: &str) -> DeleteItemFluentBuilder {
        self.client
            .delete_item()
            .table_name(self.table)
            .key("pk", s(pk))
    }
}

/// The definition of the attribute `name` of type `kind`, for a key of a table or an index.
fn attribute(name: &str, kind: ScalarAttributeType) -> AttributeDefinition {
    AttributeDefinition::builder()
        .attribute_name(name)
        .attribute_type(kind)
        .build()
        .expect("name and type are set")
}

/// The element of a table's or an index's key schema that makes `name` its `kind` of key
/// (hash or range).
fn key_element(name: &str, kind: KeyType) -> KeySchemaElement {
    KeySchemaElement::builder()
        .attribute_name(name)
        .key_type(kind)
        .build()
        .expect("name and type are set")
}

/// An error and its sources, `error: source: …`: the SDK's `SdkError` says only "service
/// error" by itself, DynamoDB's code and message are in its source.
struct Chain<'a>(&'a (dyn std::error::Error + 'static));

impl std::fmt::Display for Chain<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}", self.0)?;
        let mut source = self.0.source();
        while let Some(error) = source {
            write!(f, ": {error}")?;
            source = error.source();
        }
        Ok(())
    }
}

fn s(text: impl Into<String>) -> AttributeValue {
    AttributeValue::S(text.into())
}

fn n(number: impl ToString) -> AttributeValue {
    AttributeValue::N(number.to_string())
}

/// The string attribute `name` of `item`; `None` if it is missing or not a string.
fn text_of<'i>(item: &'i HashMap<String, AttributeValue>, name: &str) -> Option<&'i str> {
    match item.get(name) {
        Some(AttributeValue::S(text)) => Some(text),
        _ => None,
    }
}

/// The number attribute `name` of `item` as an integer; `None` if it is missing, not a number
/// or not an `i64`.
fn number_of(item: &HashMap<String, AttributeValue>, name: &str) -> Option<i64> {
    match item.get(name) {
        Some(AttributeValue::N(text)) => text.parse::<i64>().ok(),
        _ => None,
    }
}

fn duration_ms(duration: Duration) -> i64 {
    i64::try_from(duration.as_millis()).unwrap_or(i64::MAX)
}

/// The partition key of `(consumer, key)`: the consumer's byte length (decimal), a colon,
/// consumer, key. [`DynamoInbox::process`] refuses one longer than
/// [`MAX_PARTITION_KEY_BYTES`] (2048 bytes).
pub fn partition_key(consumer: &str, key: &IdempotencyKey) -> String {
    format!("{}:{consumer}{}", consumer.len(), key.as_str())
}

/// The key's [`partition_key`], refused before any call: [`DynamoError::EmptyConsumer`], or
/// [`DynamoError::PartitionKeyTooLong`] above [`MAX_PARTITION_KEY_BYTES`].
#[allow(clippy::result_large_err)] // See `decide`.
fn checked_partition_key<E>(
    consumer: &str,
    key: &IdempotencyKey,
) -> Result<String, DynamoError<E>> {
    if consumer.is_empty() {
        return Err(DynamoError::EmptyConsumer);
    }
    let pk = partition_key(consumer, key);
    if pk.len() > MAX_PARTITION_KEY_BYTES {
        return Err(DynamoError::PartitionKeyTooLong {
            consumer: consumer.to_owned(),
            key: key.clone(),
            bytes: pk.len(),
            max: MAX_PARTITION_KEY_BYTES,
        });
    }
    Ok(pk)
}

/// The client request token of an attempt's `resend`: 32 hex digits of SHA-256 over consumer,
/// key, attempt number and resend number (DynamoDB takes 1 to 36 characters). The SDK's own
/// retries of one send (an answer lost) keep its token; a resend after a cancellation, which
/// wrote nothing, gets the next one.
fn request_token(consumer: &str, key: &IdempotencyKey, attempt: u32, resend: usize) -> String {
    let mut hasher = Sha256::new();
    hasher.update(consumer.as_bytes());
    hasher.update(b"\n");
    hasher.update(key.as_str().as_bytes());
    hasher.update(b"\n");
    hasher.update(attempt.to_string().as_bytes());
    hasher.update(b"\n");
    hasher.update(resend.to_string().as_bytes());
    hex::encode(&hasher.finalize()[..16])
}

/// The handler's failed condition at request `index` (1..), from DynamoDB's reasons, the
/// request's first `guard` actions after the claim being the sequence guard's (not the
/// handler's). An index past the request's actions (DynamoDB answered with more reasons than
/// actions) is named `(unknown action)`, not a panic.
fn condition_failed(
    items: &[TransactWriteItem],
    listed: &[CancellationReason],
    index: usize,
    guard: usize,
) -> ConditionFailed {
    let (action, table) = items
        .get(index)
        .map_or(("(unknown action)", String::new()), action_name);
    let message = listed
        .iter()
        .find(|r| r.index == index)
        .and_then(|r| r.message.clone())
        .unwrap_or_default();
    ConditionFailed {
        index: index.saturating_sub(1 + guard),
        action,
        table,
        message,
    }
}

fn action_name(item: &TransactWriteItem) -> (&'static str, String) {
    if let Some(put) = item.put() {
        ("Put", put.table_name().to_owned())
    } else if let Some(update) = item.update() {
        ("Update", update.table_name().to_owned())
    } else if let Some(delete) = item.delete() {
        ("Delete", delete.table_name().to_owned())
    } else if let Some(check) = item.condition_check() {
        ("ConditionCheck", check.table_name().to_owned())
    } else {
        ("(empty action)", String::new())
    }
}

/// Cancellation codes that another try of the same request may not meet.
fn is_transient_code(code: &str) -> bool {
    matches!(
        code,
        "TransactionConflict"
            | "ThrottlingError"
            | "ProvisionedThroughputExceeded"
            | "RequestLimitExceeded"
    )
}

impl DynamoInbox {
    /// The inbox on `table` through `client`, with a retention window of
    /// [`DEFAULT_RETENTION`] and the default [`RetryPolicy`].
    pub fn new(client: Client, table: impl Into<String>) -> Self {
        Self {
            client,
            table: table.into(),
            retention: DEFAULT_RETENTION,
            policy: RetryPolicy::default(),
            counters: Arc::new(Counters::default()),
        }
    }

    /// Sets the retention window: how long a processed item keeps its key claimed
    /// (`expires_at` = the claim's time + this, in whole seconds: a window under 1 s is 0). It
    /// is the deduplication guarantee: make it longer than the broker's redelivery horizon.
    /// `Duration::ZERO` makes every processed item expire at once. Failed and dead items do not
    /// expire (DynamoDB's TTL never deletes them).
    pub fn retention(mut self, window: Duration) -> Self {
        self.retention = window;
        self
    }

    /// Sets the retry policy: attempts before dead, redelivery delays, in-process resends of a
    /// transient cancellation, error text limit.
    pub fn retry_policy(mut self, policy: RetryPolicy) -> Self {
        self.policy = policy;
        self
    }

    /// The table's name.
    pub fn table(&self) -> &str {
        &self.table
    }

    /// The client.
    pub fn client(&self) -> &Client {
        &self.client
    }

    /// What this inbox and its clones did so far: DynamoDB calls, transient resends.
    pub fn stats(&self) -> DynamoStats {
        DynamoStats {
            calls: self.counters.calls.load(Ordering::Relaxed),
            transient_retries: self.counters.transient_retries.load(Ordering::Relaxed),
        }
    }

    fn count_call(&self) {
        self.counters.calls.fetch_add(1, Ordering::Relaxed);
    }

    /// This inbox's table, for requests on one item by its key.
    fn by_key(&self) -> ByKey<'_> {
        ByKey {
            client: &self.client,
            table: &self.table,
        }
    }

    fn count_retry(&self) {
        self.counters
            .transient_retries
            .fetch_add(1, Ordering::Relaxed);
        metrics::counter!("inbox_dynamodb_transient_retries_total").increment(1);
    }

    /// Creates the inbox table if it does not exist (partition key `pk`, string; on-demand
    /// billing; with the sparse [`DEAD_LETTER_INDEX`] of failed and dead items, see
    /// [`DynamoAdmin`]), waits until it is `ACTIVE` (the SDK's waiter polls `DescribeTable`, at
    /// most 2 minutes), adds the dead-letter index to a table that lacks it and waits until the
    /// index is `ACTIVE` (polling every second, at most [`INDEX_WAIT`]: 10 minutes), and enables
    /// TTL on [`TTL_ATTRIBUTE`] if it is not. Idempotent: run it at every start.
    ///
    /// # Errors
    /// [`TableError`] if a call fails, if the table exists with a key schema other than `pk`
    /// (string) alone, or is not `ACTIVE` after 2 minutes; if an index named
    /// [`DEAD_LETTER_INDEX`] has other keys, or the index is not `ACTIVE` after
    /// [`INDEX_WAIT`].
    pub async fn ensure_table(&self) -> Result<(), TableError> {
        let table = create_pk_table(
            &self.client,
            &self.table,
            admin::dead_letter_index(),
            admin::index_attribute_definitions(),
        )
        .await?;
        let table = &table;
        self.ensure_dead_letter_index(table).await?;
        ensure_ttl(&self.client, &self.table).await
    }

    /// Runs one delivery of `msg` for `consumer`: the key is `msg`'s idempotency key, the
    /// fingerprint `Fingerprint::of(M::NAME, msg)` (as the SQL stores compute it), the payload
    /// kept for failed and dead items its JSON. See the module's docs for the steps.
    ///
    /// `handler` gets a fresh [`DynamoTx`] and returns it with its value; it may be called again
    /// in a later round (when a concurrent delivery changed the item), so it should only add
    /// actions. Its error type must say its class ([`Classify`]; [`crate::Permanent`] wraps any
    /// error as permanent).
    ///
    /// A message ordered per aggregate (`#[message(aggregate)]`, `#[message(sequence)]`) goes
    /// through the sequence guard with `gaps = "apply"` (see [`ordering`]): one not newer than
    /// its aggregate's last applied message is [`Outcome::Stale`], the closure's actions not
    /// committed.
    ///
    /// # Returns
    /// [`Outcome::Processed`] with the handler's value (committed: the source may ack),
    /// [`Outcome::Duplicate`], [`Outcome::Dead`] (dead-lettered earlier), [`Outcome::Discarded`],
    /// [`Outcome::Stale`], [`Outcome::Parked`] (a key parked by a `gaps = "park"` handler), or
    /// [`Outcome::NotYet`] (a failed attempt's next attempt is not due).
    ///
    /// # Errors
    /// Every [`DynamoError`] variant, as documented there.
    pub async fn process<M, T, E, F, Fut>(
        &self,
        consumer: &str,
        msg: &M,
        handler: F,
    ) -> Result<Outcome<T>, DynamoError<E>>
    where
        M: Message + Serialize,
        E: Classify + std::fmt::Display,
        F: FnMut(DynamoTx) -> Fut,
        Fut: Future<Output = Result<(DynamoTx, T), E>>,
    {
        let key = msg.idempotency_key()?;
        let fingerprint = Fingerprint::of(M::NAME, msg)?;
        let payload = serde_json::to_vec(msg).map_err(FingerprintError::from_json)?;
        // An ordered message goes through the sequence guard (`gaps = "apply"`: a closure has
        // no parked successors to release).
        let ordered = msg.ordering()?.map(|ordering| Ordered {
            ordering,
            gaps: crate::types::ordering::GapPolicy::Apply,
        });
        let delivery = Delivery {
            consumer,
            message_name: M::NAME,
            key: &key,
            fingerprint,
            payload: &payload,
            mode: Mode::Deliver,
            ordering: ordered.as_ref(),
        };
        self.deliver(&delivery, |error: &E| error.class(), handler)
            .await
    }

    /// [`process`](Self::process) for a payload that is not a [`Message`]: `message_name`,
    /// `key`, its `fingerprint` and the `payload` kept for failed and dead items given as they
    /// are.
    ///
    /// # Errors
    /// As [`process`](Self::process).
    pub async fn process_raw<T, E, F, Fut>(
        &self,
        consumer: &str,
        message_name: &str,
        key: &IdempotencyKey,
        fingerprint: Fingerprint,
        payload: &[u8],
        handler: F,
    ) -> Result<Outcome<T>, DynamoError<E>>
    where
        E: Classify + std::fmt::Display,
        F: FnMut(DynamoTx) -> Fut,
        Fut: Future<Output = Result<(DynamoTx, T), E>>,
    {
        let delivery = Delivery {
            consumer,
            message_name,
            key,
            fingerprint,
            payload,
            mode: Mode::Deliver,
            ordering: None,
        };
        self.deliver(&delivery, |error: &E| error.class(), handler)
            .await
    }

    /// [`process_raw`](Self::process_raw) in `delivery.mode`, the handler's errors classified by
    /// `classify` (what `#[idempotent]` handlers and the [`DynamoDispatcher`] run through).
    pub(crate) async fn deliver<T, E, C, F, Fut>(
        &self,
        delivery: &Delivery<'_>,
        classify: C,
        handler: F,
    ) -> Result<Outcome<T>, DynamoError<E>>
    where
        E: std::fmt::Display,
        C: Fn(&E) -> ErrorClass,
        F: FnMut(DynamoTx) -> Fut,
        Fut: Future<Output = Result<(DynamoTx, T), E>>,
    {
        let Delivery {
            consumer,
            message_name,
            key,
            ..
        } = *delivery;
        let result = self.run(delivery, classify, handler).await;
        let outcome = match &result {
            Ok(outcome) => outcome.kind(),
            Err(DynamoError::Conflict(_)) => "conflict",
            Err(DynamoError::Handler(_)) => "failed",
            Err(_) => "error",
        };
        metrics::counter!("inbox_dynamodb_deliveries_total", "consumer" => consumer.to_owned(), "outcome" => outcome)
            .increment(1);
        tracing::debug!(
            consumer,
            key = key.as_str(),
            message_name,
            outcome,
            "DynamoDB inbox delivery"
        );
        result
    }

    async fn run<T, E, C, F, Fut>(
        &self,
        delivery: &Delivery<'_>,
        classify: C,
        mut handler: F,
    ) -> Result<Outcome<T>, DynamoError<E>>
    where
        E: std::fmt::Display,
        C: Fn(&E) -> ErrorClass,
        F: FnMut(DynamoTx) -> Fut,
        Fut: Future<Output = Result<(DynamoTx, T), E>>,
    {
        let Delivery {
            consumer,
            message_name,
            key,
            fingerprint,
            payload,
            mode,
            ordering: ordered,
        } = *delivery;
        let pk = checked_partition_key(consumer, key)?;
        let guard = match ordered {
            Some(ordered) => Some(ordering::Guard::new(consumer, key, ordered, mode)?),
            None => None,
        };
        let ctx = Ctx {
            consumer,
            message_name,
            key,
            fingerprint,
            pk: &pk,
            guard: guard.as_ref(),
        };
        let mut item = self.read(&ctx).await?;
        // Numbers the client request tokens of this delivery's sends (see `request_token`).
        let mut resend = 0;
        for _ in 0..MAX_ROUNDS {
            let now = Now::read();
            let claim = match self.decide(&ctx, item.as_ref(), now, mode)? {
                Decision::Claim(claim) => claim,
                Decision::Settled(outcome) => {
                    return Ok(outcome.map(|never| match never {}));
                }
                Decision::Conflict(stored) => {
                    let conflict = ctx.conflict(stored);
                    self.keep_conflict(&ctx, payload, &conflict).await?;
                    return Err(conflict.into());
                }
            };
            let tx = DynamoTx {
                consumer: consumer.to_owned(),
                key: key.clone(),
                attempt: claim.attempt(),
                items: Vec::new(),
                outbox: outbox::Published::default(),
            };
            let (tx, value) = match handler(tx).await {
                Ok(done) => done,
                Err(error) => {
                    let class = classify(&error);
                    let failed = Failed::Handler(error);
                    return Err(self.failed(&ctx, claim, now, class, failed, payload).await);
                }
            };
            match self.submit(&ctx, claim, now, &mut resend, tx.items).await? {
                Submitted::Committed => return Ok(Outcome::Processed(value)),
                Submitted::ClaimFailed(current) => item = self.reread(&ctx, current).await?,
                // The sequence guard's condition failed: stale, or a gap (see `ordering`).
                Submitted::GuardFailed(position) => {
                    let settled = self
                        .out_of_order(&ctx, claim, now, &mut resend, position, payload)
                        .await?;
                    match settled {
                        ordering::Settled::Done(outcome) => {
                            return Ok(outcome.map(|never| match never {}));
                        }
                        ordering::Settled::Again(current) => {
                            item = self.reread(&ctx, current).await?;
                        }
                    }
                }
                Submitted::ConditionFailed(failed) => {
                    let class = failed.class();
                    let failed = Failed::Condition(failed);
                    return Err(self.failed(&ctx, claim, now, class, failed, payload).await);
                }
            }
        }
        Err(DynamoError::Contended {
            consumer: consumer.to_owned(),
            key: key.clone(),
        })
    }

    /// The item as a cancellation returned it (`ALL_OLD`), or a consistent read where it did not.
    async fn reread<E>(
        &self,
        ctx: &Ctx<'_>,
        returned: Option<HashMap<String, AttributeValue>>,
    ) -> Result<Option<HashMap<String, AttributeValue>>, DynamoError<E>> {
        match returned {
            Some(current) => Ok(Some(current)),
            None => self.read(ctx).await,
        }
    }

    /// A handler's failure (its error, or a condition of its actions) recorded on the claim's
    /// condition ([`Self::record_failure`]): [`DynamoError::Handler`] with the disposition, or
    /// the error of the record's write.
    async fn failed<E: std::fmt::Display>(
        &self,
        ctx: &Ctx<'_>,
        claim: Claim,
        now: Now,
        class: ErrorClass,
        failed: Failed<E>,
        payload: &[u8],
    ) -> DynamoError<E> {
        let attempts = claim.attempt();
        match self
            .record_failure(ctx, claim, now, class, failed.to_string(), payload)
            .await
        {
            Ok(disposition) => DynamoError::Handler(HandlerFailure {
                error: failed,
                class,
                attempts,
                disposition,
            }),
            Err(error) => error,
        }
    }

    /// A consistent read of the key's item.
    async fn read<E>(
        &self,
        ctx: &Ctx<'_>,
    ) -> Result<Option<HashMap<String, AttributeValue>>, DynamoError<E>> {
        self.get_consistent(ctx.pk)
            .await
            .map_err(|e| ctx.dynamo("GetItem", e))
    }

    /// Sends `delete` (a conditional `DeleteItem` of this table, counted in
    /// [`stats`](Self::stats)' calls). A failed condition is not an error (the item is not the
    /// one the condition names any more: there is nothing of the caller's to delete); any other
    /// failure is returned, the SDK's error.
    pub(super) async fn delete_unless_changed(
        &self,
        delete: aws_sdk_dynamodb::operation::delete_item::builders::DeleteItemFluentBuilder,
    ) -> Result<(), SdkError<aws_sdk_dynamodb::operation::delete_item::DeleteItemError>> {
        self.count_call();
        match delete.send().await {
            Err(error)
                if error
                    .as_service_error()
                    .is_some_and(|e| e.is_conditional_check_failed_exception()) =>
            {
                Ok(())
            }
            other => other.map(|_| ()),
        }
    }

    /// One strongly consistent `GetItem` of the item keyed `pk` (counted in
    /// [`stats`](Self::stats)' calls): the item, `None` if there is none, or the SDK's error.
    pub(super) async fn get_consistent(
        &self,
        pk: &str,
    ) -> Result<Option<HashMap<String, AttributeValue>>, BoxError> {
        self.count_call();
        let answer = self
            .by_key()
            .get_item(pk)
            .consistent_read(true)
            .send()
            .await?;
        Ok(answer.item)
    }

    /// The decision on the key's item as read (`None`: no item) at `now`.
    // `DynamoError` carries a `Conflict` unboxed, as `crate::Error` does: what callers match on.
    #[allow(clippy::result_large_err)]
    fn decide<E>(
        &self,
        ctx: &Ctx<'_>,
        item: Option<&HashMap<String, AttributeValue>>,
        now: Now,
        mode: Mode,
    ) -> Result<Decision, DynamoError<E>> {
        let Some(item) = item else {
            return Ok(Decision::Claim(Claim::New));
        };
        let number = |name: &str| -> Result<Option<i64>, DynamoError<E>> {
            match item.get(name) {
                None => Ok(None),
                Some(AttributeValue::N(text)) => text
                    .parse::<i64>()
                    .map(Some)
                    .map_err(|_| ctx.malformed(format!("`{name}` is not an integer: {text}"))),
                Some(other) => Err(ctx.malformed(format!("`{name}` is not a number: {other:?}"))),
            }
        };
        let text = |name: &str| -> Result<&str, DynamoError<E>> {
            match item.get(name) {
                Some(AttributeValue::S(text)) => Ok(text),
                _ => Err(ctx.malformed(format!("`{name}` is missing or not a string"))),
            }
        };
        // DynamoDB's TTL deletes lazily: an expired item is absent to the inbox.
        if number(TTL_ATTRIBUTE)?.is_some_and(|expires| expires <= now.secs()) {
            return Ok(Decision::Claim(Claim::New));
        }
        let stored = Fingerprint::from_hex(text("payload_hash")?)
            .ok_or_else(|| ctx.malformed("`payload_hash` is not 64 hex digits".to_owned()))?;
        let status = text("status")?;
        // A different payload is a conflict whatever the status (discarded included), as on
        // the SQL stores (`protocol::decide`).
        if stored != ctx.fingerprint {
            return Ok(Decision::Conflict(stored));
        }
        let read = match status {
            "dead" => "dead",
            "parked" => "parked",
            _ => "failed",
        };
        match status {
            "processed" => Ok(Decision::Settled(Outcome::Duplicate)),
            "discarded" => Ok(Decision::Settled(Outcome::Discarded)),
            "stale" => Ok(Decision::Settled(Outcome::Stale)),
            "dead" if mode != Mode::Replay => Ok(Decision::Settled(Outcome::Dead)),
            // Only the release of its predecessor's successors, or the sweep, takes a parked
            // item over (as `ClaimMode::takes_over` on the SQL stores).
            "parked" if !matches!(mode, Mode::Resume | Mode::Release) => {
                Ok(Decision::Settled(Outcome::Parked))
            }
            // A replay takes over a dead item, and a failed one without waiting for its next
            // attempt, as the SQL stores' replay claim does (a release, a failed one too).
            "failed" | "dead" | "parked" => {
                let attempts = number("attempts")?
                    .ok_or_else(|| ctx.malformed("`attempts` is missing".to_owned()))?;
                let attempts = u32::try_from(attempts).map_err(|_| {
                    ctx.malformed(format!(
                        "`attempts` is not a count from 0 to {}: {attempts}",
                        u32::MAX
                    ))
                })?;
                let next = number("next_attempt_at")?.unwrap_or(0);
                if next > now.ms && mode == Mode::Deliver {
                    let wait = u64::try_from(next - now.ms).unwrap_or(0);
                    return Ok(Decision::Settled(Outcome::NotYet {
                        retry_in: Duration::from_millis(wait),
                    }));
                }
                let received_at = number("received_at")?.unwrap_or(now.ms);
                Ok(Decision::Claim(Claim::Takeover {
                    attempts,
                    received_at,
                    read,
                }))
            }
            other => Err(ctx.malformed(format!("status `{other}` is not one this store writes"))),
        }
    }

    /// The end of the retention window of an item processed at `now`: epoch seconds.
    fn expires_at(&self, now: Now) -> i64 {
        now.secs()
            .saturating_add(i64::try_from(self.retention.as_secs()).unwrap_or(i64::MAX))
    }

    /// The inbox item of a key settled now with `status` (`processed`, or `stale`: consumed,
    /// not applied), with its retention window: only such items expire (`expires_at`); failed
    /// and dead ones stay until the admin API settles them, as on the SQL stores.
    #[allow(clippy::result_large_err)] // See `decide`.
    fn settled_put<E>(
        &self,
        ctx: &Ctx<'_>,
        claim: Claim,
        now: Now,
        status: &str,
    ) -> Result<Put, DynamoError<E>> {
        self.inbox_put(
            ctx,
            claim,
            now,
            HashMap::from([
                ("status".to_owned(), s(status)),
                ("processed_at".to_owned(), n(now.ms)),
                (TTL_ATTRIBUTE.to_owned(), n(self.expires_at(now))),
            ]),
        )
    }

    /// The inbox item written by a claim or a failure record, and its condition.
    #[allow(clippy::result_large_err)] // See `decide`.
    fn inbox_put<E>(
        &self,
        ctx: &Ctx<'_>,
        claim: Claim,
        now: Now,
        mut attributes: HashMap<String, AttributeValue>,
    ) -> Result<Put, DynamoError<E>> {
        let received_at = match claim {
            Claim::New => now.ms,
            Claim::Takeover { received_at, .. } => received_at,
        };
        attributes.insert("pk".into(), s(ctx.pk));
        attributes.insert("consumer".into(), s(ctx.consumer));
        attributes.insert("message_key".into(), s(ctx.key.as_str()));
        attributes.insert("message_name".into(), s(ctx.message_name));
        attributes.insert("payload_hash".into(), s(ctx.fingerprint.to_hex()));
        attributes.insert("attempts".into(), n(claim.attempt()));
        attributes.insert("received_at".into(), n(received_at));
        if let Some(guard) = ctx.guard {
            guard.attributes(&mut attributes);
        }
        let builder = Put::builder()
            .table_name(&self.table)
            .set_item(Some(attributes))
            .return_values_on_condition_check_failure(ReturnValuesOnConditionCheckFailure::AllOld);
        let builder = match claim {
            Claim::New => builder
                .condition_expression("attribute_not_exists(pk) OR #expires <= :now")
                .expression_attribute_names("#expires", TTL_ATTRIBUTE)
                .expression_attribute_values(":now", n(now.secs())),
            Claim::Takeover { attempts, read, .. } => builder
                .condition_expression(
                    "#status = :read AND attempts = :attempts AND payload_hash = :hash",
                )
                .expression_attribute_names("#status", "status")
                .expression_attribute_values(":read", s(read))
                .expression_attribute_values(":attempts", n(attempts))
                .expression_attribute_values(":hash", s(ctx.fingerprint.to_hex())),
        };
        // Table name and item are set: the builder does not fail.
        builder
            .build()
            .map_err(|e| ctx.dynamo("TransactWriteItems", e.into()))
    }

    /// Submits the claim and the handler's actions as one transaction.
    async fn submit<E>(
        &self,
        ctx: &Ctx<'_>,
        claim: Claim,
        now: Now,
        resend: &mut usize,
        actions: Vec<TransactWriteItem>,
    ) -> Result<Submitted, DynamoError<E>> {
        // The sequence guard's actions go between the claim and the handler's.
        let mut guarded = match ctx.guard {
            Some(guard) => guard.actions(self, ctx, claim)?,
            None => Vec::new(),
        };
        // A takeover's pointer `Delete` (the guard's second action) leaves its place to a
        // handler's 98th action, and follows the commit instead (see `ordering`).
        let mut pointer_after = false;
        if guarded.len() == 2 && actions.len() + guarded.len() > MAX_HANDLER_ITEMS {
            guarded.truncate(1);
            pointer_after = true;
        }
        let max = MAX_HANDLER_ITEMS - guarded.len();
        if actions.len() > max {
            return Err(DynamoError::TooManyItems {
                items: actions.len(),
                max,
            });
        }
        let claim_put = self.settled_put(ctx, claim, now, "processed")?;
        let layout = Layout {
            guard: ctx.guard.map(|_| 1),
            guard_actions: guarded.len(),
        };
        let mut items = Vec::with_capacity(actions.len() + 1 + guarded.len());
        items.push(TransactWriteItem::builder().put(claim_put).build());
        items.extend(guarded);
        items.extend(actions);
        check_sizes(&items, layout.guard_actions)?;
        let submitted = self
            .transact(ctx, &items, layout, ctx.tokens(claim), resend)
            .await?;
        if let (Submitted::Committed, true, Some(guard)) = (&submitted, pointer_after, ctx.guard) {
            guard.delete_pointer_after_commit(self, ctx).await;
        }
        Ok(submitted)
    }

    /// Sends `items` (action 0 the key's own conditional `Put`, then the handler's actions) as
    /// one `TransactWriteItems` under the client request token `token(resend)`, resending after
    /// transient cancellations and errors by the policy, and maps a cancellation by its reasons
    /// (see the module's docs, step 4). `resend` is bumped after each definite cancellation.
    async fn transact<E>(
        &self,
        ctx: &Ctx<'_>,
        items: &[TransactWriteItem],
        layout: Layout,
        token: impl Fn(usize) -> String,
        resend: &mut usize,
    ) -> Result<Submitted, DynamoError<E>> {
        let mut delays = self.policy.transient_schedule();
        let mut tries = 0;
        loop {
            // The same token while the request may have been applied (an error with no
            // cancellation: throttled, in progress, an answer lost); the next after a definite
            // cancellation, which applied nothing.
            let token = token(*resend);
            tries += 1;
            self.count_call();
            let sent = self
                .client
                .transact_write_items()
                .set_transact_items(Some(items.to_vec()))
                .client_request_token(&token)
                .send()
                .await;
            let error = match sent {
                Ok(_) => return Ok(Submitted::Committed),
                Err(error) => error,
            };
            let cancelled = match &error {
                SdkError::ServiceError(service) => match service.err() {
                    TransactWriteItemsError::TransactionCanceledException(cancelled) => {
                        Some(cancelled.cancellation_reasons().to_vec())
                    }
                    // Another delivery submitted this very attempt (same token, other
                    // parameters) within DynamoDB's 10 minutes: the item tells what happened.
                    TransactWriteItemsError::IdempotentParameterMismatchException(_) => {
                        *resend += 1;
                        return Ok(Submitted::ClaimFailed(None));
                    }
                    _ => None,
                },
                _ => None,
            };
            let transient_error = matches!(
                error.as_service_error(),
                Some(
                    TransactWriteItemsError::TransactionInProgressException(_)
                        | TransactWriteItemsError::ThrottlingException(_)
                        | TransactWriteItemsError::ProvisionedThroughputExceededException(_)
                        | TransactWriteItemsError::RequestLimitExceeded(_)
                )
            );
            let Some(reasons) = cancelled else {
                if transient_error && let Some(delay) = delays.next() {
                    self.count_retry();
                    tokio::time::sleep(delay).await;
                    continue;
                }
                return Err(ctx.dynamo("TransactWriteItems", error.into()));
            };
            let listed = listed_reasons(&reasons);
            match verdict(&listed, layout.guard) {
                Verdict::ClaimTaken => {
                    *resend += 1;
                    let current = reasons.first().and_then(|r| r.item().cloned());
                    return Ok(Submitted::ClaimFailed(current));
                }
                Verdict::GuardFailed(index) => {
                    *resend += 1;
                    let current = reasons.get(index).and_then(|r| r.item().cloned());
                    return Ok(Submitted::GuardFailed(current));
                }
                Verdict::ConditionFailed(index) => {
                    return Ok(Submitted::ConditionFailed(condition_failed(
                        items,
                        &listed,
                        index,
                        layout.guard_actions,
                    )));
                }
                Verdict::Transient => {
                    if let Some(delay) = delays.next() {
                        *resend += 1;
                        self.count_retry();
                        tokio::time::sleep(delay).await;
                        continue;
                    }
                    return Err(DynamoError::Transient {
                        tries,
                        reasons: listed,
                    });
                }
                Verdict::Cancelled => return Err(DynamoError::Cancelled { reasons: listed }),
            }
        }
    }

    /// Records a failed attempt (nothing of its transaction committed): `failed` with its next
    /// attempt time, or `dead`; conditional on the item being as the claim found it.
    async fn record_failure<E>(
        &self,
        ctx: &Ctx<'_>,
        claim: Claim,
        now: Now,
        class: ErrorClass,
        error: String,
        payload: &[u8],
    ) -> Result<Disposition, DynamoError<E>> {
        let attempts = claim.attempt();
        let dead = class == ErrorClass::Permanent || attempts >= self.policy.get_max_attempts();
        let delay = self.policy.retry_delay(attempts);
        let mut attributes = HashMap::from([
            ("status".to_owned(), s(if dead { "dead" } else { "failed" })),
            ("last_error".to_owned(), s(self.policy.bounded_error(error))),
            ("payload".to_owned(), AttributeValue::B(Blob::new(payload))),
            // Puts the item in the sparse dead-letter index (a claim's `Put` replaces the whole
            // item, and so takes it out again).
            (DEAD_LETTER_ATTRIBUTE.to_owned(), s(ctx.consumer)),
        ]);
        if !dead {
            attributes.insert(
                "next_attempt_at".to_owned(),
                n(now.ms.saturating_add(duration_ms(delay))),
            );
        }
        let put = self.inbox_put(ctx, claim, now, attributes)?;
        let bytes = size::item_size(put.item());
        if bytes > size::MAX_ITEM_BYTES {
            tracing::warn!(
                consumer = ctx.consumer,
                key = ctx.key.as_str(),
                bytes,
                max = size::MAX_ITEM_BYTES,
                "the failed attempt is not recorded: its inbox item with the payload would pass DynamoDB's item size limit"
            );
            return Ok(Disposition::NotRecorded);
        }
        let mut request = self
            .client
            .put_item()
            .table_name(&self.table)
            .set_item(Some(put.item().clone()))
            .set_condition_expression(put.condition_expression().map(str::to_owned))
            .set_expression_attribute_names(put.expression_attribute_names().cloned());
        request =
            request.set_expression_attribute_values(put.expression_attribute_values().cloned());
        self.count_call();
        match request.send().await {
            Ok(_) => {
                metrics::counter!("inbox_dynamodb_failures_total", "dead" => dead.to_string())
                    .increment(1);
                Ok(if dead {
                    Disposition::Dead
                } else {
                    Disposition::Retry { after: delay }
                })
            }
            Err(e)
                if e.as_service_error()
                    .is_some_and(|e| e.is_conditional_check_failed_exception()) =>
            {
                Ok(Disposition::NotRecorded)
            }
            Err(e) => {
                tracing::warn!(
                    consumer = ctx.consumer,
                    key = ctx.key.as_str(),
                    error = %Chain(&e),
                    "the failed attempt could not be recorded in DynamoDB"
                );
                Ok(Disposition::NotRecorded)
            }
        }
    }
}

/// Creates `table` keyed by `pk` (string) alone, billed on demand, with the global secondary
/// `index` whose keys `index_keys` define (a table that exists already is not an error), waits
/// until the table is `ACTIVE` (the SDK's waiter polls `DescribeTable`,
/// at most 2 minutes) and checks that its key schema is `pk` (string) alone: what the inbox's
/// and the outbox's `ensure_table` share. Returns the table's description.
///
/// # Errors
/// [`TableError`] if a call fails, the table is not `ACTIVE` after 2 minutes, or its key schema
/// is another.
async fn create_pk_table(
    client: &Client,
    table: &str,
    index: GlobalSecondaryIndex,
    index_keys: [AttributeDefinition; 2],
) -> Result<aws_sdk_dynamodb::types::TableDescription, TableError> {
    let error = |operation: &'static str, source: BoxError| TableError {
        table: table.to_owned(),
        operation,
        source,
    };
    let [hash, range] = index_keys;
    let create = client
        .create_table()
        .table_name(table)
        .billing_mode(BillingMode::PayPerRequest)
        .attribute_definitions(attribute("pk", ScalarAttributeType::S))
        .attribute_definitions(hash)
        .attribute_definitions(range)
        .key_schema(key_element("pk", KeyType::Hash))
        .global_secondary_indexes(index);
    if let Err(e) = create.send().await {
        let exists = e
            .as_service_error()
            .is_some_and(|e| e.is_resource_in_use_exception());
        if !exists {
            return Err(error("CreateTable", e.into()));
        }
    }
    let described = client
        .wait_until_table_exists()
        .table_name(table)
        .wait(Duration::from_secs(120))
        .await
        .map_err(|e| error("DescribeTable", e.into()))?
        .into_result()
        .map_err(|e| error("DescribeTable", e.into()))?;
    let Some(description) = described.table() else {
        return Err(error("DescribeTable", "no table in the answer".into()));
    };
    let schema = description.key_schema();
    if schema.len() != 1 || schema[0].attribute_name() != "pk" {
        return Err(error(
            "DescribeTable",
            format!("the table's key schema is {schema:?}, not `pk` alone").into(),
        ));
    }
    let pk_type = description
        .attribute_definitions()
        .iter()
        .find(|d| d.attribute_name() == "pk")
        .map(|d| d.attribute_type().clone());
    if pk_type != Some(ScalarAttributeType::S) {
        let shown = pk_type.map_or_else(|| "unknown".to_owned(), |t| t.as_str().to_owned());
        return Err(error(
            "DescribeTable",
            format!("the table's partition key `pk` is of type {shown}, not S (string)").into(),
        ));
    }
    Ok(description.clone())
}

/// Enables DynamoDB's TTL on [`TTL_ATTRIBUTE`] of `table` unless it is enabled (or being
/// enabled) already.
///
/// # Errors
/// [`TableError`] of `DescribeTimeToLive` or `UpdateTimeToLive`.
async fn ensure_ttl(client: &Client, table: &str) -> Result<(), TableError> {
    let error = |operation: &'static str, source: BoxError| TableError {
        table: table.to_owned(),
        operation,
        source,
    };
    let ttl = client
        .describe_time_to_live()
        .table_name(table)
        .send()
        .await
        .map_err(|e| error("DescribeTimeToLive", e.into()))?;
    let enabled = ttl.time_to_live_description().is_some_and(|d| {
        d.attribute_name() == Some(TTL_ATTRIBUTE)
            && matches!(
                d.time_to_live_status().map(|s| s.as_str()),
                Some("ENABLED" | "ENABLING")
            )
    });
    if !enabled {
        client
            .update_time_to_live()
            .table_name(table)
            .time_to_live_specification(
                TimeToLiveSpecification::builder()
                    .enabled(true)
                    .attribute_name(TTL_ATTRIBUTE)
                    .build()
                    .map_err(|e| error("UpdateTimeToLive", e.into()))?,
            )
            .send()
            .await
            .map_err(|e| error("UpdateTimeToLive", e.into()))?;
    }
    Ok(())
}

/// What a cancellation's reasons mean, first match wins.
#[derive(Debug, PartialEq, Eq)]
enum Verdict {
    /// The claim's (action 0) condition failed: the key was taken or changed meanwhile; this
    /// decides the delivery, whatever else failed.
    ClaimTaken,
    /// The sequence guard's condition (the action at this index) failed: the message is stale,
    /// or a gap is open before it.
    GuardFailed(usize),
    /// The condition of the action at this request index (1..) failed: the handler's business
    /// failure.
    ConditionFailed(usize),
    /// Every reason is transient (`TransactionConflict`, throttling): send it again.
    Transient,
    /// Anything else, or no reason given.
    Cancelled,
}

/// Maps a cancellation's reasons (codes other than `None`) to what the delivery does;
/// `guard` is the index of the sequence guard's conditional action, if there is one.
fn verdict(reasons: &[CancellationReason], guard: Option<usize>) -> Verdict {
    if reasons
        .iter()
        .any(|r| r.index == 0 && r.code == "ConditionalCheckFailed")
    {
        return Verdict::ClaimTaken;
    }
    if let Some(guard) = guard
        && reasons
            .iter()
            .any(|r| r.index == guard && r.code == "ConditionalCheckFailed")
    {
        return Verdict::GuardFailed(guard);
    }
    if let Some(reason) = reasons
        .iter()
        .find(|r| r.index > 0 && r.code == "ConditionalCheckFailed")
    {
        return Verdict::ConditionFailed(reason.index);
    }
    if !reasons.is_empty() && reasons.iter().all(|r| is_transient_code(&r.code)) {
        return Verdict::Transient;
    }
    Verdict::Cancelled
}

/// Where the actions of a transaction are, after the claim (action 0): the sequence guard's
/// conditional action's index, if any, and how many actions of the guard come before the
/// handler's.
#[derive(Clone, Copy, Default)]
struct Layout {
    guard: Option<usize>,
    guard_actions: usize,
}

/// What a submit found.
enum Submitted {
    Committed,
    /// The claim's condition failed; the item as it is now, if DynamoDB returned it.
    ClaimFailed(Option<HashMap<String, AttributeValue>>),
    /// The sequence guard's condition failed; the aggregate's position item as it is now, if
    /// DynamoDB returned it.
    GuardFailed(Option<HashMap<String, AttributeValue>>),
    ConditionFailed(ConditionFailed),
}

/// Which items a delivery may claim.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Mode {
    /// A delivery from a source or a direct call: a new key, or a failed one that is due.
    Deliver,
    /// An operator's replay: also a dead key, and a failed one before its next attempt is due.
    Replay,
    /// A parked successor released after its predecessor was applied: a parked key, or a
    /// failed one (a released successor that failed), in order only.
    Resume,
    /// A parked message released by the sweep despite its gap (the position jumps to it).
    Release,
}

/// One delivery as [`DynamoInbox::deliver`] runs it.
#[derive(Clone, Copy)]
pub(crate) struct Delivery<'a> {
    pub(crate) consumer: &'a str,
    pub(crate) message_name: &'a str,
    pub(crate) key: &'a IdempotencyKey,
    pub(crate) fingerprint: Fingerprint,
    /// The payload kept in a failed or dead item.
    pub(crate) payload: &'a [u8],
    pub(crate) mode: Mode,
    /// The message's place in its aggregate and the handler's gap policy, if it is ordered.
    pub(crate) ordering: Option<&'a Ordered>,
}

/// The delivery's identity, for the calls and their errors.
struct Ctx<'a> {
    consumer: &'a str,
    message_name: &'a str,
    key: &'a IdempotencyKey,
    fingerprint: Fingerprint,
    pk: &'a str,
    /// The sequence guard of an ordered message.
    guard: Option<&'a ordering::Guard>,
}

impl Ctx<'_> {
    /// The client request tokens of `claim`'s attempt, by resend number ([`request_token`]).
    fn tokens(&self, claim: Claim) -> impl Fn(usize) -> String {
        let attempt = claim.attempt();
        move |resend| request_token(self.consumer, self.key, attempt, resend)
    }

    fn dynamo<E>(&self, operation: &'static str, source: BoxError) -> DynamoError<E> {
        DynamoError::Dynamo {
            consumer: self.consumer.to_owned(),
            key: self.key.clone(),
            operation,
            source,
        }
    }

    fn malformed<E>(&self, reason: String) -> DynamoError<E> {
        DynamoError::Malformed {
            consumer: self.consumer.to_owned(),
            key: self.key.clone(),
            reason,
        }
    }

    fn conflict(&self, stored: Fingerprint) -> Conflict {
        Conflict {
            consumer: self.consumer.to_owned(),
            message_name: self.message_name.to_owned(),
            key: self.key.clone(),
            stored,
            received: self.fingerprint,
        }
    }
}

/// Checks a transaction against DynamoDB's size limits before it is sent: each `Put` item at most
/// [`size::MAX_ITEM_BYTES`] (400 KB; item 0 is the claim's inbox item, item `i` the handler's
/// action `i - 1`) and the whole at most [`size::MAX_TRANSACTION_BYTES`] (4 MB).
///
/// # Errors
/// [`DynamoError::TooLarge`] naming the item or the transaction, its size and the limit in bytes.
#[allow(clippy::result_large_err)] // See `decide`.
fn check_sizes<E>(items: &[TransactWriteItem], guard: usize) -> Result<(), DynamoError<E>> {
    let mut total = 0;
    for (index, item) in items.iter().enumerate() {
        if let Some(put) = item.put() {
            let bytes = size::item_size(put.item());
            if bytes > size::MAX_ITEM_BYTES {
                return Err(DynamoError::TooLarge {
                    what: match index {
                        0 => "the claim's inbox item".to_owned(),
                        _ if index <= guard => "the sequence guard's item".to_owned(),
                        _ => format!("the Put item of action {}", index - 1 - guard),
                    },
                    bytes,
                    max: size::MAX_ITEM_BYTES,
                });
            }
        }
        total += size::action_size(item);
    }
    if total > size::MAX_TRANSACTION_BYTES {
        return Err(DynamoError::TooLarge {
            what: "the transaction".to_owned(),
            bytes: total,
            max: size::MAX_TRANSACTION_BYTES,
        });
    }
    Ok(())
}

/// The cancellation reasons DynamoDB gave per action (in the transaction's order), without the
/// actions whose code is `None` (those that did not fail).
fn listed_reasons(
    reasons: &[aws_sdk_dynamodb::types::CancellationReason],
) -> Vec<CancellationReason> {
    reasons
        .iter()
        .enumerate()
        .filter_map(|(index, reason)| {
            let code = reason.code().unwrap_or("None");
            (code != "None").then(|| CancellationReason {
                index,
                code: code.to_owned(),
                message: reason.message().map(str::to_owned),
            })
        })
        .collect()
}

/// An ordered message's place in its aggregate, with its handler's gap policy.
#[derive(Debug, Clone)]
pub(crate) struct Ordered {
    pub(crate) ordering: crate::types::ordering::Ordering,
    pub(crate) gaps: crate::types::ordering::GapPolicy,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn reason(index: usize, code: &str) -> CancellationReason {
        CancellationReason {
            index,
            code: code.to_owned(),
            message: None,
        }
    }

    #[test]
    fn cancellation_reasons_map_to_verdicts() {
        use Verdict::*;
        let cases: [(&[CancellationReason], Verdict); 9] = [
            (&[reason(0, "ConditionalCheckFailed")], ClaimTaken),
            // The claim decides even when a handler action failed too.
            (
                &[
                    reason(0, "ConditionalCheckFailed"),
                    reason(2, "ConditionalCheckFailed"),
                ],
                ClaimTaken,
            ),
            (&[reason(3, "ConditionalCheckFailed")], ConditionFailed(3)),
            (
                &[
                    reason(1, "TransactionConflict"),
                    reason(3, "ConditionalCheckFailed"),
                ],
                ConditionFailed(3),
            ),
            (&[reason(0, "TransactionConflict")], Transient),
            (
                &[
                    reason(1, "ThrottlingError"),
                    reason(2, "ProvisionedThroughputExceeded"),
                ],
                Transient,
            ),
            (
                &[
                    reason(1, "TransactionConflict"),
                    reason(2, "ValidationError"),
                ],
                Cancelled,
            ),
            (&[reason(1, "ItemCollectionSizeLimitExceeded")], Cancelled),
            (&[], Cancelled),
        ];
        for (reasons, expected) in cases {
            assert_eq!(verdict(reasons, None), expected, "{reasons:?}");
        }
        // With the sequence guard at index 1: its condition is told apart from the claim's
        // (which still decides) and from the handler's actions' (after it).
        let guarded: [(&[CancellationReason], Verdict); 4] = [
            (&[reason(1, "ConditionalCheckFailed")], GuardFailed(1)),
            (
                &[
                    reason(0, "ConditionalCheckFailed"),
                    reason(1, "ConditionalCheckFailed"),
                ],
                ClaimTaken,
            ),
            (
                &[
                    reason(1, "ConditionalCheckFailed"),
                    reason(3, "ConditionalCheckFailed"),
                ],
                GuardFailed(1),
            ),
            (&[reason(3, "ConditionalCheckFailed")], ConditionFailed(3)),
        ];
        for (reasons, expected) in guarded {
            assert_eq!(verdict(reasons, Some(1)), expected, "{reasons:?}");
        }
    }

    #[test]
    fn a_condition_reason_past_the_actions_is_not_a_panic() {
        let check = ConditionCheck::builder()
            .table_name("t")
            .key("id", s("a"))
            .condition_expression("attribute_exists(id)")
            .build()
            .unwrap();
        let items = vec![
            TransactWriteItem::builder().build(),
            TransactWriteItem::builder().condition_check(check).build(),
        ];
        let mut failing = reason(1, "ConditionalCheckFailed");
        failing.message = Some("The conditional request failed".into());
        let failed = condition_failed(&items, &[failing], 1, 0);
        assert_eq!(
            (failed.index, failed.action, failed.table.as_str()),
            (0, "ConditionCheck", "t")
        );
        assert_eq!(failed.message, "The conditional request failed");
        // DynamoDB answered with more reasons than the request had actions.
        // After a sequence guard of 2 actions, request index 5 is the handler's action 2.
        let failed = condition_failed(&items, &[reason(5, "ConditionalCheckFailed")], 5, 2);
        assert_eq!(failed.index, 2);
        let failed = condition_failed(&items, &[reason(5, "ConditionalCheckFailed")], 5, 0);
        assert_eq!(
            (failed.index, failed.action, failed.table.as_str()),
            (4, "(unknown action)", "")
        );
    }

    #[test]
    fn partition_keys_and_tokens() {
        let key = IdempotencyKey::new("k:1", "m", "f").unwrap();
        assert_eq!(partition_key("ledger", &key), "6:ledgerk:1");
        // `a` + `bc` and `ab` + `c` do not share a partition key.
        let bc = IdempotencyKey::new("bc", "m", "f").unwrap();
        let c = IdempotencyKey::new("c", "m", "f").unwrap();
        assert_ne!(partition_key("a", &bc), partition_key("ab", &c));
        let token = request_token("ledger", &key, 1, 0);
        assert_eq!(token.len(), 32);
        assert_eq!(token, request_token("ledger", &key, 1, 0));
        assert_ne!(token, request_token("ledger", &key, 2, 0));
        assert_ne!(token, request_token("ledger", &key, 1, 1));
    }
}
