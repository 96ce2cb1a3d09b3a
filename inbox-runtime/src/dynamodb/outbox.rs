//! The transactional outbox on DynamoDB: [`DynamoTx::publish`] adds the outbox item to the
//! delivery's `TransactWriteItems`, and a polling [`DynamoRelay`] publishes committed items to a
//! [`Sink`] and marks them sent.
//!
//! ```text
//! handler ──► DynamoTx::publish (same TransactWriteItems as the claim) ──► outbox table
//!         ──► DynamoRelay (Query of the sparse `pending` index, leases by conditional UpdateItem)
//!         ──► Sink (broker)
//! ```
//!
//! ## Why a table of its own, and why a polling relay rather than DynamoDB Streams
//!
//! The outbox items live in **a table of their own** ([`DynamoOutbox::ensure_table`]), not in
//! the inbox table: the relay's sparse global secondary index then indexes outbox items only
//! (an index on the inbox table would be one more thing every claim pays for), the admin and
//! TTL of the two tables stay apart, and the inbox table keeps the one key schema its
//! `ensure_table` checks. One `TransactWriteItems` may span tables of one account and region,
//! so the item still commits with the claim.
//!
//! The relay **polls a sparse index** instead of reading DynamoDB Streams:
//!
//! * a stream keeps records for **24 hours** only: a relay stopped for a day (or a poison
//!   message retried past it) would lose messages whose effects committed: the outbox's one
//!   promise. The index keeps a pending item until it is sent, however long that takes;
//! * Streams need their own SDK crate (`aws-sdk-dynamodbstreams`), shard discovery, shard
//!   lineage (a child shard may be read only after its parent, for order) and checkpoints and
//!   leases for many readers in a table of their own (what the Kinesis Client Library does);
//!   retries with backoff and dead letters need per-item state written back anyway. The index
//!   puts that state in the item itself, and a lease is a conditional `UpdateItem`;
//! * what makes Streams hard could not be tested here: the tests' DynamoDB (moto 5.2) emulates
//!   one shard per table, never split and never trimmed. Its indexes, on the other hand, are
//!   always current, so the tests cannot show index lag either: what covers that lag is the
//!   design (the lease's and marks' conditions on the table, the `after` link), not a test.
//!
//! The price: the index is **eventually consistent** (an item shows up in it, and changes
//! there, typically within a second of its write), so the index only proposes candidates: a
//! lease is taken by a conditional `UpdateItem` on the table itself, which decides ownership
//! (`status = pending`, no lease running, due, attempts left), and every mark is conditional on
//! the lease's owner. A stale index can delay an item (a round), never publish it twice within a
//! lease or mark it for a relay that lost it; across transactions it can let an aggregate's
//! later item go ahead of an earlier one the index does not show yet (see the order, below).
//!
//! ## The outbox table
//!
//! Partition key `pk` (string): the message id. On-demand billing; TTL on `expires_at` (sent
//! items only, [`DynamoOutbox::retention`]). Attributes: `status` (`pending` | `sent` | `dead`),
//! `destination`, `message_name`, `payload` (binary), `headers` (a JSON object of strings),
//! `aggregate_id`, `trace_context`, `consumer` and `message_key` (the delivery that published
//! it), `created_at` (epoch milliseconds, the publishing process's clock), `after` (the message
//! id of the item of the same aggregate published before it in the same transaction, if any),
//! `attempts` (leases so far), `lease_owner`, `lease_until`, `next_attempt_at` (epoch
//! milliseconds), `last_error`, `sent_at`, `expires_at` (epoch seconds).
//!
//! The global secondary index `pending` (partition key `pending_pk`, always `pending`; sort key
//! `pending_sk`: the creation time in nanoseconds (the transaction's first publish, 20 digits),
//! `#`, the action's position in its transaction (5 digits), `#`, the message id) holds the items that are `pending`, and the `dead` ones
//! of an aggregate (they block it); an item leaves it when it is sent (or dead without an
//! aggregate). It projects what a round decides on (`status`, `aggregate_id`, `attempts`,
//! `lease_until`, `next_attempt_at`, `after`), not the payloads.
//!
//! ## What is guaranteed, and in what order
//!
//! * **Atomic with the effect**: the outbox item is an action of the delivery's transaction: it
//!   exists if and only if the claim and the handler's writes committed. A cancelled transaction
//!   (a duplicate delivery, a failed condition, a conflict) writes no item.
//! * **Stable ids**: the id is [`Outbox::message_id_for`]`(consumer, key, index)`, `index` the
//!   number of messages the run published before (with a derived id): a run after a cancelled
//!   transaction, a failed attempt or a later round writes the same ids, as on the SQL stores.
//!   The relay sends the stored id with every (re-)publish.
//! * **Never skips**: a round reads the index by status, not from a cursor: an item committed
//!   late is found by the first round after it shows up in the index, if it is among the
//!   first [`scan_limit`](DynamoRelay::scan_limit) entries (see the limits below: entries of
//!   dead items' aggregates stay ahead of it until settled).
//! * **Leases**: many relays may run at once; an item is published by one relay per lease, and
//!   marked sent or failed only by the relay that holds its lease. A relay that dies after the
//!   publish and before the mark leaves the item leased: after the lease another relay publishes
//!   it again, with the same id. An item whose leases run out unmarked
//!   [`max_attempts`](DynamoRelay::max_attempts) times goes `dead` ("abandoned"). A lease's
//!   end (`lease_until`) is the leasing relay's clock plus the lease, and other relays compare
//!   it with their own clocks (the SQL relay uses the database's one clock): a relay whose
//!   clock runs ahead of the leasing one's by more than the lease may publish an item still
//!   leased (its mark then fails, as a lost lease's). Keep the relays' clocks synchronized.
//! * **Per aggregate, one at a time**: a round walks the index in creation order and takes only
//!   the first item it sees of each aggregate, and only if that one is due and not leased; a
//!   `dead` item blocks its aggregate (and only it). An item with a predecessor in its own
//!   transaction (`after`) is leased only once a strongly consistent read finds that
//!   predecessor `sent`.
//! * **Order guaranteed**: within one transaction, the order of the `publish` calls, always
//!   (the `after` link does not depend on the index or on clocks). Across transactions, the
//!   order of the `created_at` timestamps, which come from the publishing processes' clocks: it
//!   is creation order only as far as those clocks agree, and only for items that are in the
//!   index when the round reads it. **Not guaranteed**: an item of an earlier transaction that
//!   commits (or shows up in the index) after a later transaction's item of its aggregate was
//!   leased is published after it; two writers whose clocks disagree by more than the time
//!   between their publishes may be published in the order of their timestamps, not of their
//!   commits. Serialize an aggregate's writers (its state item's condition, as a handler that
//!   changes the aggregate has anyway) and keep clocks synchronized (NTP, Amazon Time Sync) to
//!   get creation order across transactions in practice.
//! * **Retries**: a failed publish is retried after the backoff (doubled per attempt, capped,
//!   as the SQL [`Relay`](crate::outbox::Relay)'s), and dead-lettered when the sink says the
//!   failure is permanent or after [`max_attempts`](DynamoRelay::max_attempts) leases.
//! * **Retention**: a sent item gets `expires_at` = its sending + [`DynamoOutbox::retention`]
//!   (default 7 days), and DynamoDB's TTL deletes it (lazily). Dead items never expire.
//!
//! ## Limits and costs
//!
//! * **Per publish**: no call of its own; one more `Put` in the delivery's transaction (it counts
//!   toward [`MAX_HANDLER_ITEMS`], 99: a full transaction is
//!   [`OutboxError::TransactionFull`]), written transactionally (2 write units per KB), and one
//!   index write.
//! * **Per relay round**: one `Query` of the index per page (1 MB, or up to
//!   [`scan_limit`](DynamoRelay::scan_limit) items, default 1000), then per leased item one
//!   `UpdateItem` (the lease), one sink call for the batch, and one `UpdateItem` (the mark);
//!   plus one `GetItem` per item that has a predecessor in its transaction, and one `UpdateItem`
//!   per abandoned item. An idle round is one `Query`. Each lease and mark also writes the index.
//! * A round reads at most [`scan_limit`](DynamoRelay::scan_limit) index entries, oldest first:
//!   more entries than that ahead of a due item (say, thousands of items of one aggregate
//!   behind a dead one, or failing ones waiting for their backoff) keep that item from being
//!   seen until they clear. Settle dead items: [`DynamoOutbox::discard`] (never sent; the
//!   aggregate's later items go ahead) or [`DynamoOutbox::retry`] (sent again with its id, as the
//!   SQL [`admin::retry`](crate::outbox::admin::retry)). Do not set `status` back to `pending`
//!   by hand: one without an aggregate left the index when it went dead (no relay would ever
//!   see it again), and one whose attempts ran out would go dead again at the next round;
//!   `retry` puts it back in the index and resets its attempts.
//! * The index has one partition key value: DynamoDB's throughput per index partition (about
//!   1000 writes per second) bounds the outbox's rate.
//! * [`Transport::ChangeDataCapture`](crate::outbox::Transport::ChangeDataCapture): items are
//!   written already `sent` (with `expires_at`), outside the index, for a reader of the table's
//!   stream (enable it yourself) instead of a relay; `notify` has no effect on DynamoDB.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use aws_sdk_dynamodb::Client;
use aws_sdk_dynamodb::primitives::Blob;
use aws_sdk_dynamodb::types::{
    AttributeValue, GlobalSecondaryIndex, KeyType, Projection, ProjectionType, Put, ReturnValue,
    ScalarAttributeType,
};
use tokio_util::sync::CancellationToken;

use super::{
    ByKey, Chain, DynamoTx, MAX_HANDLER_ITEMS, TTL_ATTRIBUTE, TableError, attribute,
    create_pk_table, duration_ms, ensure_ttl, key_element, n, number_of, s, text_of,
};
use crate::outbox::relay::{
    Backoff, check_lease, in_round_span, publish_leased, report_abandoned, report_marked_failed,
    report_marked_sent, tally,
};
use crate::outbox::{
    Outbox, OutboxError, OutboxMessage, RelayConfigError, RelayReport, RoundReport,
};
use crate::sink::{Sink, SinkError};
use crate::store::OutboxRecord;
use crate::types::classify::BoxError;

/// The name of the outbox table's sparse index of pending (and blocking dead) items.
pub const PENDING_INDEX: &str = "pending";

/// The one value of the index's partition key `pending_pk`.
const PENDING: &str = "pending";

/// What [`DynamoTx::publish`] has published in the delivery's current run.
#[derive(Debug, Default)]
pub(super) struct Published {
    /// Messages published with a derived id: the next one's index for
    /// [`Outbox::message_id_for`].
    derived: u32,
    /// The creation time of the run's items: the first publish's, epoch nanoseconds (one time
    /// for the whole transaction, so that a clock step between two publishes cannot reorder
    /// them; nanoseconds, so that a writer that starts after another committed gets a later
    /// time even within one millisecond).
    created_ns: Option<u128>,
    /// Per aggregate, the message id of the run's last item: the next one's `after`.
    last_of_aggregate: HashMap<String, String>,
    /// The message ids published in this run: a second `Put` of one would make DynamoDB refuse
    /// the whole transaction (two actions on one item), on every redelivery.
    ids: HashSet<String>,
}

fn now_ms() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| i64::try_from(d.as_millis()).unwrap_or(i64::MAX))
}

impl DynamoTx {
    /// Publishes `message` through `outbox`: validates it as [`Outbox::publish`] does, derives
    /// its id, and adds a conditional `Put` of its outbox item to this transaction, so that it
    /// is written if and only if the claim and the handler's other actions commit. Returns the
    /// message id.
    ///
    /// The id is the one set with [`OutboxMessage::message_id`], or else
    /// [`Outbox::message_id_for`]`(consumer, key, index)` of this delivery's consumer and
    /// idempotency key, `index` the number of messages this run published before with a
    /// derived id (0, 1, …): the same ids as on the SQL stores, and the same on every run of the
    /// delivery (after a cancelled transaction, a failed attempt, another round) as long as the
    /// handler publishes in the same order.
    ///
    /// The `Put`'s condition is `attribute_not_exists(pk) OR expires_at <= now`: a message id
    /// whose item exists (pending, dead, or sent and still within the relay's retention) fails
    /// the transaction as the handler's condition ([`Failed::Condition`](super::Failed), action
    /// `Put` on the outbox table; retryable); a sent item past its retention (not yet deleted
    /// by TTL) is replaced, as the inbox treats an expired key as absent. The item is at most
    /// 400 KB (checked at submit: [`DynamoError::TooLarge`](super::DynamoError::TooLarge)).
    ///
    /// # Errors
    /// Nothing is added on error; return it from the handler (nothing of the transaction is
    /// submitted then). Bad input, as [`Outbox::publish`]: [`OutboxError::EmptyDestination`],
    /// [`OutboxError::UnknownDestination`], [`OutboxError::EmptyMessageName`],
    /// [`OutboxError::Serialize`], [`OutboxError::InvalidMessageId`],
    /// [`OutboxError::InvalidHeader`], [`OutboxError::InvalidAggregate`];
    /// [`OutboxError::TransactionFull`] if the transaction holds [`MAX_HANDLER_ITEMS`] (99)
    /// actions already. All are [`ErrorClass::Permanent`](crate::ErrorClass::Permanent). And
    /// [`OutboxError::DuplicateMessageId`] if this run published the message id already (as
    /// the SQL stores' second insert; retryable, as there: a handler that returns it is
    /// retried and dead-lettered after its attempts, where DynamoDB would refuse the whole
    /// transaction, two actions on one item, on every redelivery without recording an
    /// attempt). A refused derived id still advances the index, as on the SQL stores.
    pub fn publish(
        &mut self,
        outbox: &DynamoOutbox,
        message: OutboxMessage,
    ) -> Result<String, OutboxError> {
        let message = outbox.outbox.validate(message)?;
        if self.items.len() >= MAX_HANDLER_ITEMS {
            return Err(OutboxError::TransactionFull {
                actions: self.items.len(),
                max: MAX_HANDLER_ITEMS,
            });
        }
        let message_id = match message.message_id {
            Some(id) => id,
            None => {
                let index = self.outbox.derived;
                self.outbox.derived += 1;
                Outbox::message_id_for(&self.consumer, self.key.as_str(), index)
            }
        };
        if !self.outbox.ids.insert(message_id.clone()) {
            return Err(OutboxError::DuplicateMessageId { message_id });
        }
        let now_ns = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos());
        let created_ns = *self.outbox.created_ns.get_or_insert(now_ns);
        let created_ms = i64::try_from(created_ns / 1_000_000).unwrap_or(i64::MAX);
        let now = now_ms();
        let headers = serde_json::to_string(&message.headers).expect("strings serialize");
        let settled = outbox.outbox.settled();
        let mut item = HashMap::from([
            ("pk".to_owned(), s(&message_id)),
            (
                "status".to_owned(),
                s(if settled { "sent" } else { "pending" }),
            ),
            ("destination".to_owned(), s(message.destination)),
            ("message_name".to_owned(), s(message.message_name)),
            (
                "payload".to_owned(),
                AttributeValue::B(Blob::new(message.payload)),
            ),
            ("headers".to_owned(), s(headers)),
            ("consumer".to_owned(), s(&self.consumer)),
            ("message_key".to_owned(), s(self.key.as_str())),
            ("created_at".to_owned(), n(created_ms)),
            ("attempts".to_owned(), n(0)),
        ]);
        if let Some(trace) = crate::trace::current_json() {
            item.insert("trace_context".to_owned(), s(trace));
        }
        if settled {
            item.insert("sent_at".to_owned(), n(now));
            item.insert(
                TTL_ATTRIBUTE.to_owned(),
                n(now.div_euclid(1000).saturating_add(secs(outbox.retention))),
            );
        } else {
            item.insert("pending_pk".to_owned(), s(PENDING));
            item.insert(
                "pending_sk".to_owned(),
                s(format!(
                    "{created_ns:020}#{:05}#{message_id}",
                    self.items.len()
                )),
            );
        }
        if let Some(aggregate) = message.aggregate_id {
            if let Some(before) = self
                .outbox
                .last_of_aggregate
                .insert(aggregate.clone(), message_id.clone())
            {
                item.insert("after".to_owned(), s(before));
            }
            item.insert("aggregate_id".to_owned(), s(aggregate));
        }
        let put = Put::builder()
            .table_name(&outbox.table)
            .set_item(Some(item))
            .condition_expression("attribute_not_exists(pk) OR #expires <= :now")
            .expression_attribute_names("#expires", TTL_ATTRIBUTE)
            .expression_attribute_values(":now", n(now.div_euclid(1000)))
            .build()
            .expect("the table name and the item are set");
        self.put(put);
        Ok(message_id)
    }
}

fn secs(duration: Duration) -> i64 {
    i64::try_from(duration.as_secs()).unwrap_or(i64::MAX)
}

/// The outbox on one DynamoDB table: where [`DynamoTx::publish`] writes (with the
/// destinations of its [`Outbox`]) and what a [`DynamoRelay`] reads. See the
/// [module docs](self). Cheap to clone.
///
/// ```no_run
/// use inbox_runtime::dynamodb::{DynamoInbox, DynamoOutbox, DynamoRelay};
/// use inbox_runtime::outbox::{Outbox, OutboxMessage};
/// use inbox_runtime::sink::MemorySink;
/// use inbox_runtime::{Message, Outcome, Permanent};
///
/// #[derive(Clone, serde::Serialize, serde::Deserialize, Message)]
/// #[message(name = "payments.captured")]
/// struct PaymentCaptured { #[message(key)] event_id: String, order_id: String }
///
/// #[derive(Clone, serde::Serialize, serde::Deserialize, Message)]
/// #[message(name = "orders.paid")]
/// struct OrderPaid { #[message(key)] order_id: String }
///
/// # async fn demo(msg: PaymentCaptured) -> Result<(), Box<dyn std::error::Error>> {
/// let client = inbox_runtime::dynamodb::client(None).await;
/// let inbox = DynamoInbox::new(client.clone(), "inbox");
/// let outbox = DynamoOutbox::new(client, "outbox", Outbox::new(&["orders"]));
/// inbox.ensure_table().await?;
/// outbox.ensure_table().await?;
/// let (msg, out) = (&msg, &outbox);
/// let outcome = inbox
///     .process("orders", msg, |mut tx| async move {
///         let paid = OrderPaid { order_id: msg.order_id.clone() };
///         tx.publish(out, OutboxMessage::new("orders", &paid).aggregate(&msg.order_id))
///             .map_err(Permanent::new)?;
///         Ok::<_, Permanent>((tx, ()))
///     })
///     .await?;
/// if let Outcome::Processed(()) = outcome {
///     println!("paid; the event is in the outbox");
/// }
/// let report = DynamoRelay::new(outbox, MemorySink::new()).run_once().await?;
/// println!("published {}", report.published);
/// # Ok(()) }
/// ```
#[derive(Debug, Clone)]
pub struct DynamoOutbox {
    client: Client,
    table: String,
    outbox: Outbox,
    retention: Duration,
}

impl DynamoOutbox {
    /// This outbox's table, for requests on one item by its key.
    fn by_key(&self) -> ByKey<'_> {
        ByKey {
            client: &self.client,
            table: &self.table,
        }
    }

    /// The outbox on `table` through `client`, publishing to `outbox`'s destinations.
    pub fn new(client: Client, table: impl Into<String>, outbox: Outbox) -> Self {
        Self {
            client,
            table: table.into(),
            outbox,
            retention: super::DEFAULT_RETENTION,
        }
    }

    /// How long a sent item stays before DynamoDB's TTL may delete it (`expires_at` = its
    /// sending + this, whole seconds; items written for change data capture: their writing +
    /// this). Default 7 days ([`DEFAULT_RETENTION`](super::DEFAULT_RETENTION)). Keep it at least
    /// the inbox's retention window: a delivery processed again after its inbox item expired
    /// publishes the same ids, and fails (retryably) while their sent items are still there.
    pub fn retention(mut self, window: Duration) -> Self {
        self.retention = window;
        self
    }

    /// The table's name.
    pub fn table(&self) -> &str {
        &self.table
    }

    /// Sends the `dead` item `message_id` again, as the SQL
    /// [`admin::retry`](crate::outbox::admin::retry): it becomes `pending` with its attempts
    /// reset to 0 and no retry time (its `last_error` stays until it is sent), back in the index
    /// [`PENDING_INDEX`] (an item of an aggregate never left it and keeps its place, so the
    /// aggregate's later items wait for it again; one without an aggregate comes back at the
    /// end), and relays publish it with the **same** message id. One conditional `UpdateItem`.
    /// Returns `false` if no dead item has this id (none, or one `pending` or `sent`).
    ///
    /// # Errors
    /// [`OutboxCallError`] (operation `UpdateItem`) if the call fails.
    pub async fn retry(&self, message_id: &str) -> Result<bool, OutboxCallError> {
        let created_ns = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |elapsed| elapsed.as_nanos());
        let answer = self
            .by_key()
            .update_item(message_id)
            .update_expression(
                "SET #status = :pending, attempts = :zero, pending_pk = :pending, \
                 pending_sk = if_not_exists(pending_sk, :sk) \
                 REMOVE next_attempt_at, lease_owner, lease_until",
            )
            .condition_expression("#status = :dead")
            .expression_attribute_names("#status", "status")
            .expression_attribute_values(":pending", s(PENDING))
            .expression_attribute_values(":zero", n(0))
            .expression_attribute_values(
                ":sk",
                s(format!("{created_ns:020}#{:05}#{message_id}", 0)),
            )
            .expression_attribute_values(":dead", s("dead"))
            .send()
            .await;
        self.settled(answer.map(|_| ()), "UpdateItem")
    }

    /// Deletes the `dead` item `message_id`, as the SQL
    /// [`admin::discard`](crate::outbox::admin::discard): the message is never sent, and its
    /// aggregate's later items, which waited behind it, go out next. One conditional
    /// `DeleteItem`. Returns `false` if no dead item has this id (a `pending` one may be out with
    /// a relay; a `sent` one is TTL's).
    ///
    /// # Errors
    /// [`OutboxCallError`] (operation `DeleteItem`) if the call fails.
    pub async fn discard(&self, message_id: &str) -> Result<bool, OutboxCallError> {
        let answer = self
            .by_key()
            .delete_item(message_id)
            .condition_expression("#status = :dead")
            .expression_attribute_names("#status", "status")
            .expression_attribute_values(":dead", s("dead"))
            .send()
            .await;
        self.settled(answer.map(|_| ()), "DeleteItem")
    }

    /// `true` if a conditional call on a dead item applied, `false` if its condition failed.
    fn settled<E>(
        &self,
        answer: Result<(), aws_sdk_dynamodb::error::SdkError<E>>,
        operation: &'static str,
    ) -> Result<bool, OutboxCallError>
    where
        E: aws_sdk_dynamodb::error::ProvideErrorMetadata
            + std::error::Error
            + Send
            + Sync
            + 'static,
    {
        match answer {
            Ok(()) => Ok(true),
            Err(e) if is_condition_failure(&e) => Ok(false),
            Err(e) => Err(OutboxCallError {
                table: self.table.clone(),
                operation,
                source: e.into(),
            }),
        }
    }

    /// Creates the outbox table if it does not exist (partition key `pk`, string; on-demand
    /// billing; the global secondary index [`PENDING_INDEX`] on `pending_pk`, `pending_sk`),
    /// waits until it is `ACTIVE` (at most 2 minutes) and enables TTL on [`TTL_ATTRIBUTE`].
    /// Idempotent: run it at every start.
    ///
    /// # Errors
    /// [`TableError`] if a call fails, or if the table exists with a key schema other than `pk`
    /// alone or without the index [`PENDING_INDEX`].
    pub async fn ensure_table(&self) -> Result<(), TableError> {
        let error = |operation: &'static str, source: BoxError| TableError {
            table: self.table.clone(),
            operation,
            source,
        };
        let index = GlobalSecondaryIndex::builder()
            .index_name(PENDING_INDEX)
            .key_schema(key_element("pending_pk", KeyType::Hash))
            .key_schema(key_element("pending_sk", KeyType::Range))
            .projection(
                Projection::builder()
                    .projection_type(ProjectionType::Include)
                    .set_non_key_attributes(Some(
                        [
                            "status",
                            "aggregate_id",
                            "attempts",
                            "lease_until",
                            "next_attempt_at",
                            "after",
                        ]
                        .map(str::to_owned)
                        .to_vec(),
                    ))
                    .build(),
            )
            .build()
            .map_err(|e| error("CreateTable", e.into()))?;
        let index_keys = [
            attribute("pending_pk", ScalarAttributeType::S),
            attribute("pending_sk", ScalarAttributeType::S),
        ];
        let table = create_pk_table(&self.client, &self.table, index, index_keys).await?;
        let indexed = table
            .global_secondary_indexes()
            .iter()
            .any(|i| i.index_name() == Some(PENDING_INDEX));
        if !indexed {
            return Err(error(
                "DescribeTable",
                format!("the table has no global secondary index `{PENDING_INDEX}`").into(),
            ));
        }
        ensure_ttl(&self.client, &self.table).await
    }
}

/// A DynamoDB call of the [`DynamoRelay`] failed: nothing after it in the round was done but
/// the publishing and marking of the items leased before it (items leased and not marked are
/// published again after their lease, with the same ids).
#[derive(Debug, thiserror::Error)]
#[error("DynamoDB {operation} on outbox table `{table}` failed: {}", Chain(source.as_ref()))]
pub struct OutboxCallError {
    /// The outbox table.
    pub table: String,
    /// `Query`, `GetItem` or `UpdateItem`.
    pub operation: &'static str,
    /// The SDK's error.
    #[source]
    pub source: BoxError,
}

/// Publishes committed DynamoDB outbox items to a [`Sink`] and marks them sent: the polling
/// relay of the [module docs](self), with the SQL [`Relay`](crate::outbox::Relay)'s rules
/// (leases, lease-owned marks, backoff, dead letters, one item of an aggregate at a time), its
/// reports ([`RoundReport`], [`RelayReport`]), metrics and spans.
pub struct DynamoRelay {
    outbox: DynamoOutbox,
    sink: Arc<dyn Sink>,
    batch_size: u32,
    scan_limit: u32,
    lease: Duration,
    poll_interval: Duration,
    max_attempts: u32,
    backoff: Backoff,
}

impl std::fmt::Debug for DynamoRelay {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DynamoRelay")
            .field("table", &self.outbox.table)
            .field("batch_size", &self.batch_size)
            .field("scan_limit", &self.scan_limit)
            .field("lease", &self.lease)
            .field("poll_interval", &self.poll_interval)
            .field("max_attempts", &self.max_attempts)
            .field("backoff", &self.backoff.first)
            .field("max_backoff", &self.backoff.max)
            .finish_non_exhaustive()
    }
}

/// An index entry a round may lease.
struct Candidate {
    message_id: String,
    after: Option<String>,
}

impl DynamoRelay {
    /// A relay from `outbox`'s table to `sink`, with the SQL relay's defaults: batches of 100,
    /// index reads of at most 1000 entries a round, leases of 30 s, a poll every 500 ms,
    /// 10 attempts, backoff from 1 s doubling to 5 min. Sent items expire after the outbox's
    /// [`retention`](DynamoOutbox::retention).
    pub fn new(outbox: DynamoOutbox, sink: impl Sink) -> Self {
        Self {
            outbox,
            sink: Arc::new(sink),
            batch_size: 100,
            scan_limit: 1000,
            lease: Duration::from_secs(30),
            poll_interval: Duration::from_millis(500),
            max_attempts: 10,
            backoff: Backoff::DEFAULT,
        }
    }

    /// At most this many items leased per round (at least 1).
    pub fn batch_size(mut self, items: u32) -> Self {
        self.batch_size = items.max(1);
        self
    }

    /// At most this many index entries read per round, oldest first (at least 1; default 1000):
    /// the round's cost bound, and how far past blocked or waiting items it looks.
    pub fn scan_limit(mut self, entries: u32) -> Self {
        self.scan_limit = entries.max(1);
        self
    }

    /// How long a leased item stays with this relay before another may publish it again, and
    /// how long a round waits for the sink, counted from its first lease (the leases are
    /// taken one call at a time, for at most half of it; [`RoundReport::timed_out`]). Default
    /// 30 s.
    ///
    /// # Errors
    /// [`RelayConfigError::LeaseOutOfRange`] below [`MIN_LEASE`](crate::outbox::MIN_LEASE)
    /// (100 ms) or above [`MAX_LEASE`](crate::outbox::MAX_LEASE) (1 hour).
    pub fn lease(mut self, lease: Duration) -> Result<Self, RelayConfigError> {
        check_lease(lease)?;
        self.lease = lease;
        Ok(self)
    }

    /// The wait between rounds of [`run`](Self::run) when idle (default 500 ms, at least 1 ms).
    pub fn poll_interval(mut self, interval: Duration) -> Self {
        self.poll_interval = interval.max(Duration::from_millis(1));
        self
    }

    /// Leases (publish attempts) after which an item goes `dead` (at least 1; default 10): a
    /// failed publish that often, or a lease run out unmarked that often.
    pub fn max_attempts(mut self, attempts: u32) -> Self {
        self.max_attempts = attempts.max(1);
        self
    }

    /// The wait before a failed item's second attempt, doubled for each later one up to `max`
    /// (default 1 s to 5 min; both at most [`MAX_BACKOFF`](crate::outbox::MAX_BACKOFF), `max`
    /// at least `first`).
    pub fn backoff(mut self, first: Duration, max: Duration) -> Self {
        self.backoff = Backoff::new(first, max);
        self
    }

    fn call_error(&self, operation: &'static str, source: impl Into<BoxError>) -> OutboxCallError {
        OutboxCallError {
            table: self.outbox.table.clone(),
            operation,
            source: source.into(),
        }
    }

    /// One round: read the index, lease, publish, mark (see the [module docs](self) for its
    /// calls). Returns what it did (`leased == 0`: nothing to do). Spans and metrics as the SQL
    /// relay's `run_once`.
    ///
    /// # Errors
    /// [`OutboxCallError`] of the first DynamoDB call that failed. A failed read of the index
    /// or mark stops the round there; a failed lease (or the read of a predecessor before it)
    /// ends the leasing: the items leased before it are published and marked first, then the
    /// error is returned (their outcomes are in the metrics and spans, not in a report).
    /// Items leased and not marked are published again after their lease, with the same ids.
    pub async fn run_once(&self) -> Result<RoundReport, OutboxCallError> {
        in_round_span(self.round()).await
    }

    async fn round(&self) -> Result<RoundReport, OutboxCallError> {
        let mut report = RoundReport::default();
        let now = now_ms();
        let candidates = self.candidates(now, &mut report).await?;
        let token = uuid::Uuid::now_v7().to_string();
        // Before the first lease's clock reading: the round's earliest lease runs out no sooner
        // than a lease after this (the sink is waited for only that long). Leases are taken
        // while at least half of it is left for the sink; the other candidates wait a round.
        let first_lease = Instant::now();
        let mut records = Vec::new();
        // A call that fails ends the leasing, not the round: the items leased before it are
        // published and marked first (else each such round would spend an attempt of theirs,
        // and enough of them in a row would turn them dead unpublished); then the error.
        let mut lease_error = None;
        for candidate in candidates {
            if first_lease.elapsed() >= self.lease / 2 {
                break;
            }
            match self.take_lease(&candidate, &token, records.len()).await {
                Ok(Some(record)) => records.push(record),
                Ok(None) => {}
                Err(error) => {
                    lease_error = Some(error);
                    break;
                }
            }
        }
        let report = self
            .publish_and_mark(report, records, &token, first_lease)
            .await?;
        match lease_error {
            Some(error) => Err(error),
            None => Ok(report),
        }
    }

    /// Publishes the round's leased `records` (leases taken after `first_lease`) and marks
    /// them.
    async fn publish_and_mark(
        &self,
        mut report: RoundReport,
        records: Vec<OutboxRecord>,
        token: &str,
        first_lease: Instant,
    ) -> Result<RoundReport, OutboxCallError> {
        let leased_at = Instant::now();
        report.leased = records.len();
        if records.is_empty() {
            return Ok(report);
        }
        // The sink is waited for until the round's first lease runs out: the leases are taken
        // one call at a time, and a sink still publishing after the first of them ran out could
        // publish an item that another relay has leased since.
        let left = || self.lease.saturating_sub(first_lease.elapsed());
        let answered = publish_leased(self.sink.as_ref(), &records, self.lease, left, &mut report);
        let Some(answered) = answered.await else {
            return Ok(report);
        };
        let since_lease = answered.confirmed_at.saturating_duration_since(leased_at);
        for index in answered.sent {
            let record = &records[index];
            let marked = self.mark_sent(record, token).await?;
            let latency = record.age + since_lease;
            report_marked_sent(record, &answered.spans[index], marked, latency, &mut report);
        }
        for (index, error) in answered.failures {
            let record = &records[index];
            let dead = error.is_permanent() || record.attempts >= self.max_attempts;
            let wait = self.backoff.retry_in(record.attempts);
            let marked = self.mark_failed(record, token, &error, dead, wait).await?;
            let span = &answered.spans[index];
            let outcome = marked.then_some(dead);
            report_marked_failed(record, span, outcome, &error, wait, &mut report);
        }
        Ok(report)
    }

    /// Reads the index oldest first (at most `scan_limit` entries) and returns the items to try
    /// to lease: per aggregate the first entry only, if it is pending, due and not leased; up
    /// to `batch_size`. Entries whose leases ran out `max_attempts` times go `dead` here
    /// ([`RoundReport::abandoned`]).
    async fn candidates(
        &self,
        now: i64,
        report: &mut RoundReport,
    ) -> Result<Vec<Candidate>, OutboxCallError> {
        let mut seen_aggregates = HashSet::new();
        let mut candidates = Vec::new();
        let mut read = 0u32;
        let mut start: Option<HashMap<String, AttributeValue>> = None;
        loop {
            let page = self
                .outbox
                .client
                .query()
                .table_name(&self.outbox.table)
                .index_name(PENDING_INDEX)
                .key_condition_expression("pending_pk = :pending")
                .expression_attribute_values(":pending", s(PENDING))
                .limit(i32::try_from(self.scan_limit - read).unwrap_or(i32::MAX))
                .set_exclusive_start_key(start.take())
                .send()
                .await
                .map_err(|e| self.call_error("Query", e))?;
            for entry in page.items() {
                read += 1;
                let text = |name: &str| text_of(entry, name).map(str::to_owned);
                let number = |name: &str| number_of(entry, name);
                let Some(message_id) = text("pk") else {
                    continue;
                };
                let aggregate = text("aggregate_id");
                if let Some(aggregate) = &aggregate
                    && !seen_aggregates.insert(aggregate.clone())
                {
                    continue; // An earlier item of its aggregate is pending or dead.
                }
                if text("status").as_deref() != Some("pending")
                    || number("lease_until").is_some_and(|until| until > now)
                    || number("next_attempt_at").is_some_and(|at| at > now)
                {
                    continue;
                }
                let attempts = number("attempts").unwrap_or(0);
                if attempts >= i64::from(self.max_attempts) {
                    if self
                        .abandon(&message_id, aggregate.is_some(), attempts, now)
                        .await?
                    {
                        report.abandoned += 1;
                    }
                    continue;
                }
                if candidates.len() < self.batch_size as usize {
                    candidates.push(Candidate {
                        message_id,
                        after: text("after"),
                    });
                }
            }
            start = page.last_evaluated_key().cloned();
            if start.is_none()
                || read >= self.scan_limit
                || candidates.len() >= self.batch_size as usize
            {
                return Ok(candidates);
            }
        }
    }

    /// Leases `candidate` for `token` (the `position`-th item of the round) if the table agrees:
    /// `pending`, not leased, due, attempts left, and its predecessor in its transaction (if
    /// any) sent. Returns its record (attempts counted), or `None` if it is not to be had.
    async fn take_lease(
        &self,
        candidate: &Candidate,
        token: &str,
        position: usize,
    ) -> Result<Option<OutboxRecord>, OutboxCallError> {
        if let Some(after) = &candidate.after {
            let before = self
                .outbox
                .by_key()
                .get_item(after)
                .consistent_read(true)
                .projection_expression("#status")
                .expression_attribute_names("#status", "status")
                .send()
                .await
                .map_err(|e| self.call_error("GetItem", e))?;
            // Gone (expired after it was sent) or sent: the way is clear.
            let blocked = before
                .item()
                .and_then(|i| i.get("status"))
                .is_some_and(|status| status != &s("sent"));
            if blocked {
                return Ok(None);
            }
        }
        let now = now_ms();
        let answer = self
            .outbox
            .by_key()
            .update_item(&candidate.message_id)
            .update_expression(
                "SET lease_owner = :token, lease_until = :until, attempts = attempts + :one",
            )
            .condition_expression(
                "#status = :pending AND attempts < :max \
                 AND (attribute_not_exists(lease_until) OR lease_until <= :now) \
                 AND (attribute_not_exists(next_attempt_at) OR next_attempt_at <= :now)",
            )
            .expression_attribute_names("#status", "status")
            .expression_attribute_values(":token", s(token))
            .expression_attribute_values(":until", n(now.saturating_add(duration_ms(self.lease))))
            .expression_attribute_values(":one", n(1))
            .expression_attribute_values(":pending", s("pending"))
            .expression_attribute_values(":max", n(self.max_attempts))
            .expression_attribute_values(":now", n(now))
            .return_values(ReturnValue::AllNew)
            .send()
            .await;
        match answer {
            Ok(answer) => Ok(answer.attributes().map(|item| record(item, position, now))),
            Err(e) if is_condition_failure(&e) => Ok(None),
            Err(e) => Err(self.call_error("UpdateItem", e)),
        }
    }

    /// Turns an item whose leases ran out `attempts` (≥ `max_attempts`) times `dead`, if it is
    /// still so (pending, lease over, same attempts); one without an aggregate leaves the index
    /// (one with an aggregate stays, blocking it). `true` if it did.
    async fn abandon(
        &self,
        message_id: &str,
        in_aggregate: bool,
        attempts: i64,
        now: i64,
    ) -> Result<bool, OutboxCallError> {
        let leaves = if in_aggregate {
            ""
        } else {
            ", pending_pk, pending_sk"
        };
        let error = format!(
            "the relay never finished publishing it: its lease ran out unmarked {} times (each \
             relay that leased it crashed, hung or was stopped before the sink answered)",
            self.max_attempts
        );
        let answer = self
            .outbox
            .by_key()
            .update_item(message_id)
            .update_expression(format!(
                "SET #status = :dead, last_error = :error REMOVE lease_owner, lease_until{leaves}"
            ))
            .condition_expression(
                "#status = :pending AND attempts = :attempts \
                 AND (attribute_not_exists(lease_until) OR lease_until <= :now)",
            )
            .expression_attribute_names("#status", "status")
            .expression_attribute_values(":dead", s("dead"))
            .expression_attribute_values(":error", s(&error))
            .expression_attribute_values(":pending", s("pending"))
            .expression_attribute_values(":attempts", n(attempts))
            .expression_attribute_values(":now", n(now))
            .return_values(ReturnValue::AllNew)
            .send()
            .await;
        match answer {
            Ok(answer) => {
                if let Some(item) = answer.attributes() {
                    report_abandoned(&[record(item, 0, now)], &error);
                }
                Ok(true)
            }
            Err(e) if is_condition_failure(&e) => Ok(false),
            Err(e) => Err(self.call_error("UpdateItem", e)),
        }
    }

    /// Marks `record` sent (out of the index, `expires_at` set) if `token` still holds its
    /// lease. `false`: the lease was lost.
    async fn mark_sent(&self, record: &OutboxRecord, token: &str) -> Result<bool, OutboxCallError> {
        let now = now_ms();
        let expires = now
            .div_euclid(1000)
            .saturating_add(secs(self.outbox.retention));
        let answer = self
            .outbox
            .by_key()
            .update_item(&record.message_id)
            .update_expression(
                "SET #status = :sent, sent_at = :now, #expires = :expires \
                 REMOVE pending_pk, pending_sk, lease_owner, lease_until, next_attempt_at",
            )
            .condition_expression("#status = :pending AND lease_owner = :token")
            .expression_attribute_names("#status", "status")
            .expression_attribute_names("#expires", TTL_ATTRIBUTE)
            .expression_attribute_values(":sent", s("sent"))
            .expression_attribute_values(":now", n(now))
            .expression_attribute_values(":expires", n(expires))
            .expression_attribute_values(":pending", s("pending"))
            .expression_attribute_values(":token", s(token))
            .send()
            .await;
        match answer {
            Ok(_) => Ok(true),
            Err(e) if is_condition_failure(&e) => Ok(false),
            Err(e) => Err(self.call_error("UpdateItem", e)),
        }
    }

    /// Records `record`'s failed publish if `token` still holds its lease: `dead` (an item of an
    /// aggregate stays in the index, blocking it; one without leaves it), or due again after
    /// `wait`. `false`: the lease was lost.
    async fn mark_failed(
        &self,
        record: &OutboxRecord,
        token: &str,
        error: &SinkError,
        dead: bool,
        wait: Duration,
    ) -> Result<bool, OutboxCallError> {
        let now = now_ms();
        let mut request = self
            .outbox
            .by_key()
            .update_item(&record.message_id)
            .condition_expression("#status = :pending AND lease_owner = :token")
            .expression_attribute_names("#status", "status")
            .expression_attribute_values(":pending", s("pending"))
            .expression_attribute_values(":token", s(token))
            .expression_attribute_values(":error", s(bounded(error.to_string())));
        request = if dead {
            let leaves = if record.aggregate_id.is_none() {
                ", pending_pk, pending_sk"
            } else {
                ""
            };
            request
                .update_expression(format!(
                    "SET #status = :dead, last_error = :error \
                     REMOVE lease_owner, lease_until, next_attempt_at{leaves}"
                ))
                .expression_attribute_values(":dead", s("dead"))
        } else {
            request
                .update_expression(
                    "SET next_attempt_at = :next, last_error = :error \
                     REMOVE lease_owner, lease_until",
                )
                .expression_attribute_values(":next", n(now.saturating_add(duration_ms(wait))))
        };
        match request.send().await {
            Ok(_) => Ok(true),
            Err(e) if is_condition_failure(&e) => Ok(false),
            Err(e) => Err(self.call_error("UpdateItem", e)),
        }
    }

    /// Runs rounds until `shutdown` is cancelled (a round under way is finished first), then
    /// returns what it did: back to back while rounds lease items, else every
    /// [`poll_interval`](Self::poll_interval). A failed round is logged, counted
    /// ([`RelayReport::errors`], `inbox_outbox_relay_errors_total`) and tried again after the
    /// poll interval.
    pub async fn run(self, shutdown: CancellationToken) -> RelayReport {
        let mut report = RelayReport::default();
        while !shutdown.is_cancelled() {
            if tally(&mut report, self.run_once().await, "DynamoDB outbox relay") {
                continue;
            }
            tokio::select! {
                () = shutdown.cancelled() => {}
                () = tokio::time::sleep(self.poll_interval) => {}
            }
        }
        report
    }
}

/// The longest `last_error` stored: 4096 bytes (cut at a character boundary).
const MAX_ERROR_BYTES: usize = 4096;

fn bounded(mut text: String) -> String {
    if text.len() > MAX_ERROR_BYTES {
        let mut end = MAX_ERROR_BYTES;
        while !text.is_char_boundary(end) {
            end -= 1;
        }
        text.truncate(end);
    }
    text
}

fn is_condition_failure<E, R>(error: &aws_sdk_dynamodb::error::SdkError<E, R>) -> bool
where
    E: aws_sdk_dynamodb::error::ProvideErrorMetadata,
{
    error
        .as_service_error()
        .and_then(|e| e.code())
        .is_some_and(|code| code == "ConditionalCheckFailedException")
}

/// The relay's record of a leased item (`id`: its position in the round), as the SQL relay's
/// reporting takes it. An attribute missing or of another type reads as empty: the item was
/// written by [`DynamoTx::publish`], and the sink then refuses what is unusable (headers that
/// are not a JSON object go `dead` at once).
fn record(item: &HashMap<String, AttributeValue>, position: usize, now: i64) -> OutboxRecord {
    let text = |name: &str| text_of(item, name).map(str::to_owned);
    let number = |name: &str| number_of(item, name);
    let created = number("created_at").unwrap_or(now);
    OutboxRecord {
        id: i64::try_from(position).unwrap_or(i64::MAX),
        message_id: text("pk").unwrap_or_default(),
        destination: text("destination").unwrap_or_default(),
        message_name: text("message_name").unwrap_or_default(),
        payload: match item.get("payload") {
            Some(AttributeValue::B(blob)) => blob.clone().into_inner(),
            _ => Vec::new(),
        },
        headers_json: text("headers").unwrap_or_default(),
        aggregate_id: text("aggregate_id"),
        trace_context: text("trace_context"),
        attempts: number("attempts")
            .and_then(|a| u32::try_from(a).ok())
            .unwrap_or(1),
        age: Duration::from_millis(u64::try_from(now - created).unwrap_or(0)),
    }
}
