//! Per-aggregate ordering on DynamoDB: the sequence guard (`gaps = "apply"`), the durable
//! reorder buffer (`gaps = "park"`), the release of parked successors in order, and the sweep
//! of parked messages whose gap stays open ([`DynamoDispatcher::sweep_parked`]); the same
//! semantics as the SQL stores' (`Outcome::Stale`, `Outcome::Parked`, [`ParkPolicy`]).
//!
//! ## The items
//!
//! Two kinds of items share the inbox table with the inbox items, under partition keys that
//! never equal an inbox item's (`<len>:<consumer><key>` always starts with a decimal digit):
//!
//! * the aggregate's **position**, `pos:<len>:<consumer><aggregate>` (`<len>` the consumer's
//!   length in UTF-8 bytes): `last_sequence`, the sequence of the last message applied, with
//!   `consumer` and `aggregate_id`. No status: the admin's `stats` and `list` skip it.
//! * a parked message's **pointer**, `park:<len>:<consumer><len>:<aggregate><sequence>` (the
//!   consumer's and the aggregate's lengths): `message_key`, `message_name` and `payload`,
//!   so that the release finds sequence `n + 1` and runs it from one `GetItem`.
//!
//! Positions have no retention window (TTL never deletes them), as the SQL stores keep their
//! aggregate state rows. A pointer is deleted in the transaction that applies, releases or
//! dead-letters its message (or, for a handler with 98 actions, right after that transaction).
//! Two keys parked at one aggregate's same sequence share a pointer: the later park replaces
//! it, and the earlier message is settled by the sweep only.
//!
//! Inbox items of ordered messages carry `aggregate_id` and `sequence`. A `parked` item keeps
//! its payload and the dead-letter index's attribute ([`DEAD_LETTER_ATTRIBUTE`]: the sweep finds
//! the consumer's parked items through the index, by `received_at`); it has no retention window
//! (TTL never deletes it). A `stale` item is settled as a processed one is (retention window,
//! no payload).
//!
//! ## How an ordered delivery runs
//!
//! The claim's `TransactWriteItems` has one more action after the claim (index 1): a
//! conditional `Update` of the aggregate's position to the message's sequence, on
//! `attribute_not_exists(last_sequence) OR last_sequence < :seq` (`gaps = "apply"`, and a
//! release by the sweep) or `last_sequence = :seq - 1` (`gaps = "park"`; for sequence 1 also
//! `attribute_not_exists(last_sequence)`: a fresh aggregate starts at 0, as on SQL). A claim
//! that takes a parked (or failed) item over also deletes its pointer in the same transaction.
//! The handler's actions follow (so an ordered handler has at most 98 actions; when one with
//! 98 takes an item over, the pointer's `Delete` has no room, and a `DeleteItem` on the
//! pointer follows the commit instead — a pointer that outlives it, the process stopped
//! between them, leads the release to a processed item, which it goes past). When the position's condition fails (told apart from the claim's and the
//! handler's by its index), the position as it is now comes with the cancellation reason
//! (`ALL_OLD`), or from a consistent `GetItem`, and:
//!
//! * **stale** (`last_sequence ≥ sequence`): one `TransactWriteItems` writes the inbox item
//!   `stale` (on the claim's condition), nothing of the handler: [`Outcome::Stale`], and its
//!   redeliveries read `stale` (as the SQL stores record it);
//! * **parked** (`gaps = "park"`, a gap before it): one `TransactWriteItems` writes the inbox
//!   item `parked` (payload kept), its pointer, and a `ConditionCheck` that the gap is still
//!   open (`last_sequence < :seq - 1`; a predecessor applied meanwhile makes the delivery start
//!   over, and apply). [`Outcome::Parked`]; a redelivery of a parked key reads it and answers
//!   `Parked` (one `GetItem`), nothing runs.
//!
//! DynamoDB serializes transactions: a predecessor either commits its position before the
//! park's `ConditionCheck` (the park fails and the delivery applies) or after the pointer
//! exists (its release, which reads after its commit, finds it). Nothing is lost between them.
//!
//! ## Release in order
//!
//! After a `gaps = "park"` message is applied, the pointer of sequence `n + 1` is read
//! (`GetItem`; after a duplicate, `n` is the aggregate's position, read first: a process that
//! stopped between a commit and the release, or inside the release, left successors parked,
//! and the message that started it, never acked, comes again); if there is one, its
//! payload runs through its handler (routed by consumer and message name, as
//! [`DynamoDispatcher::replay`]) with a claim that takes the `parked` item over (`status =
//! parked AND attempts = … AND payload_hash = …`), the position's condition and the pointer's
//! `Delete` in its transaction; then `n + 2`, …, until a pointer is missing or a successor is not
//! applied (it stays parked, or failed, with its pointer: the next commit of its aggregate, a
//! redelivery of its predecessor, or the sweep releases it). Each successor commits on its own:
//! a crash between two loses nothing.
//!
//! ## DynamoDB calls per delivery
//!
//! | path | calls |
//! |---|---|
//! | in order, `gaps = "apply"` | 2: `GetItem`, `TransactWriteItems` |
//! | in order, `gaps = "park"` | 3: the same, and the `GetItem` of the next pointer (none) |
//! | stale | 3: `GetItem`, `TransactWriteItems` (cancelled), `TransactWriteItems` (the record) |
//! | parked | 3: `GetItem`, `TransactWriteItems` (cancelled), `TransactWriteItems` (the park) |
//! | a redelivery of a parked or stale key | 1: `GetItem` |
//! | a duplicate, `gaps = "park"` | 3: `GetItem`, the position's `GetItem`, the next pointer's |
//! | each parked successor released | 3: `GetItem` of its pointer, `GetItem` of its item, `TransactWriteItems` |
//!
//! (DynamoDB returns the position with the cancellation reason, `ALL_OLD`, when it exists; a
//! store that did not would cost one `GetItem` more for a stale message.)
//!
//! ## The sweep
//!
//! [`DynamoDispatcher::sweep_parked`] finds, per consumer of the dispatcher, the parked items
//! received at least [`ParkPolicy::timeout`] ago (a `Query` of the dead-letter index on the
//! consumer and `received_at`, filtered on `status = parked`, eventually consistent), reads each
//! (`GetItem`) and takes them in each aggregate's sequence order (the index gives them by
//! arrival: a later one released first would make the earlier ones stale). Per aggregate it
//! first goes on from the aggregate's position, as a duplicate does: successors a release left
//! behind with their gap closed (its process stopped after the commit, or a successor's handler
//! failed: `failed`, with its pointer — no delivery of it comes again, it was acked as parked)
//! are applied in order. Then, by [`ParkPolicy::on_timeout`], each one still parked is
//! dead-lettered (one `TransactWriteItems`: the item `dead` with the reason, payload kept, and
//! its pointer deleted) or released (its handler runs with the position's condition
//! `last_sequence < :seq`: the position jumps to it, then its own successors follow in order). [`DynamoWorker`](super::DynamoWorker) runs it
//! periodically ([`DynamoWorker::park_sweep`](super::DynamoWorker::park_sweep)).

use std::collections::{BTreeSet, HashMap};
use std::convert::Infallible;

use aws_sdk_dynamodb::primitives::Blob;
use aws_sdk_dynamodb::types::{
    AttributeValue, ConditionCheck, Delete, Put, ReturnValuesOnConditionCheckFailure,
    TransactWriteItem, Update,
};

use super::admin::{AdminError, DEAD_LETTER_ATTRIBUTE, DEAD_LETTER_INDEX};
use super::dispatch::{DynDynamoHandler, DynamoDispatcher, DynamoReplayError, Run};
use super::{
    Claim, Ctx, DynamoError, DynamoInbox, Layout, MAX_PARTITION_KEY_BYTES, Mode, Now, Submitted,
    TTL_ATTRIBUTE, n, request_token, s,
};
use crate::dispatch::SweepReport;
use crate::types::classify::BoxError;
use crate::types::json_text::json_text;
use crate::types::key::IdempotencyKey;
use crate::types::ordering::{GapPolicy, Ordering, ParkPolicy, ParkTimeout};
use crate::types::outcome::Outcome;
use crate::types::status::Status;

/// An item as read.
type Item = HashMap<String, AttributeValue>;

/// An ordered message's place in its aggregate, with its handler's gap policy.
#[derive(Debug, Clone)]
pub(crate) struct Ordered {
    pub(crate) ordering: Ordering,
    pub(crate) gaps: GapPolicy,
}

/// The partition key of `consumer`'s position on `aggregate`: `pos:<len>:<consumer><aggregate>`.
fn position_key(consumer: &str, aggregate: &str) -> String {
    format!("pos:{}:{consumer}{aggregate}", consumer.len())
}

/// The partition key of the pointer to `consumer`'s parked message of `aggregate` at
/// `sequence`: `park:<len>:<consumer><len>:<aggregate><sequence>`.
fn pointer_key(consumer: &str, aggregate: &str, sequence: i64) -> String {
    format!(
        "park:{}:{consumer}{}:{aggregate}{sequence}",
        consumer.len(),
        aggregate.len()
    )
}

/// The sequence guard of one ordered delivery.
pub(crate) struct Guard {
    ordering: Ordering,
    gaps: GapPolicy,
    mode: Mode,
    position_pk: String,
    pointer_pk: String,
}

/// What the guard's failure settled: an outcome, or a round to start over with the key's item
/// as it is now (`None`: read it).
pub(super) enum Settled {
    Done(Outcome<Infallible>),
    Again(Option<Item>),
}

impl Guard {
    /// The guard of `ordered`, delivered for `consumer` under `key` in `mode`.
    ///
    /// # Errors
    /// [`DynamoError::PartitionKeyTooLong`] if the position's or the pointer's partition key
    /// is longer than DynamoDB's 2048 bytes (a consumer and an aggregate id that long).
    #[allow(clippy::result_large_err)] // `DynamoError`, as `DynamoInbox::decide`'s.
    pub(super) fn new<E>(
        consumer: &str,
        key: &IdempotencyKey,
        ordered: &Ordered,
        mode: Mode,
    ) -> Result<Self, DynamoError<E>> {
        let aggregate = &ordered.ordering.aggregate_id;
        let position_pk = position_key(consumer, aggregate);
        let pointer_pk = pointer_key(consumer, aggregate, ordered.ordering.sequence);
        let longest = position_pk.len().max(pointer_pk.len());
        if longest > MAX_PARTITION_KEY_BYTES {
            return Err(DynamoError::PartitionKeyTooLong {
                consumer: consumer.to_owned(),
                key: key.clone(),
                bytes: longest,
                max: MAX_PARTITION_KEY_BYTES,
            });
        }
        Ok(Self {
            ordering: ordered.ordering.clone(),
            gaps: ordered.gaps,
            mode,
            position_pk,
            pointer_pk,
        })
    }

    /// Whether the position must be exactly the previous sequence (parking on a gap), or only
    /// older than this one (applying over a gap).
    fn parks(&self) -> bool {
        self.gaps == GapPolicy::Park && self.mode != Mode::Release
    }

    /// The attributes an ordered message's inbox item carries.
    pub(super) fn attributes(&self, attributes: &mut Item) {
        attributes.insert("aggregate_id".into(), s(&self.ordering.aggregate_id));
        attributes.insert("sequence".into(), n(self.ordering.sequence));
    }

    /// The guard's actions in the claim's transaction, after the claim: the position's
    /// conditional `Update` (index 1), and the `Delete` of the pointer when the claim takes an
    /// item over (a parked one, or a released successor that failed).
    #[allow(clippy::result_large_err)] // See `new`.
    pub(super) fn actions<E>(
        &self,
        inbox: &DynamoInbox,
        ctx: &Ctx<'_>,
        claim: Claim,
    ) -> Result<Vec<TransactWriteItem>, DynamoError<E>> {
        let sequence = self.ordering.sequence;
        let mut update = Update::builder()
            .table_name(&inbox.table)
            .key("pk", s(&self.position_pk))
            .update_expression("SET #last = :seq, #consumer = :consumer, #aggregate = :aggregate")
            .expression_attribute_names("#last", "last_sequence")
            .expression_attribute_names("#consumer", "consumer")
            .expression_attribute_names("#aggregate", "aggregate_id")
            .expression_attribute_values(":seq", n(sequence))
            .expression_attribute_values(":consumer", s(ctx.consumer))
            .expression_attribute_values(":aggregate", s(&self.ordering.aggregate_id))
            .return_values_on_condition_check_failure(ReturnValuesOnConditionCheckFailure::AllOld);
        update = if !self.parks() {
            update.condition_expression("attribute_not_exists(#last) OR #last < :seq")
        } else if sequence == 1 {
            update.condition_expression("attribute_not_exists(#last)")
        } else {
            update
                .condition_expression("#last = :prev")
                .expression_attribute_values(":prev", n(sequence - 1))
        };
        let update = update
            .build()
            .map_err(|e| ctx.dynamo("TransactWriteItems", e.into()))?;
        let mut actions = vec![TransactWriteItem::builder().update(update).build()];
        if let Claim::Takeover { .. } = claim {
            actions.push(self.delete_pointer(inbox, ctx)?);
        }
        Ok(actions)
    }

    /// Deletes the pointer of this message after its takeover committed without the pointer's
    /// `Delete` (a handler with 98 actions left it no room): one `DeleteItem`, on the
    /// condition that the pointer is this key's. A failure is logged: a pointer left to a
    /// processed item reads as a duplicate to the release, which goes on past it.
    pub(super) async fn delete_pointer_after_commit(&self, inbox: &DynamoInbox, ctx: &Ctx<'_>) {
        inbox.count_call();
        let deleted = inbox
            .client
            .delete_item()
            .table_name(&inbox.table)
            .key("pk", s(&self.pointer_pk))
            .condition_expression("message_key = :key")
            .expression_attribute_values(":key", s(ctx.key.as_str()))
            .send()
            .await;
        if let Err(error) = deleted
            && !error
                .as_service_error()
                .is_some_and(|e| e.is_conditional_check_failed_exception())
        {
            tracing::warn!(
                consumer = ctx.consumer,
                key = ctx.key.as_str(),
                error = %super::Chain(&error),
                "the parked message's pointer could not be deleted after its commit"
            );
        }
    }

    #[allow(clippy::result_large_err)] // See `new`.
    fn delete_pointer<E>(
        &self,
        inbox: &DynamoInbox,
        ctx: &Ctx<'_>,
    ) -> Result<TransactWriteItem, DynamoError<E>> {
        let delete = Delete::builder()
            .table_name(&inbox.table)
            .key("pk", s(&self.pointer_pk))
            .build()
            .map_err(|e| ctx.dynamo("TransactWriteItems", e.into()))?;
        Ok(TransactWriteItem::builder().delete(delete).build())
    }
}

/// The `last_sequence` of a position item (0 for none).
#[allow(clippy::result_large_err)] // See `Guard::new`.
fn last_sequence<E>(ctx: &Ctx<'_>, position: Option<&Item>) -> Result<i64, DynamoError<E>> {
    match position.and_then(|item| item.get("last_sequence")) {
        None => Ok(0),
        Some(AttributeValue::N(text)) => text.parse().map_err(|_| {
            ctx.malformed(format!(
                "the aggregate's position `last_sequence` is not an integer: {text}"
            ))
        }),
        Some(other) => Err(ctx.malformed(format!(
            "the aggregate's position `last_sequence` is not a number: {other:?}"
        ))),
    }
}

impl DynamoInbox {
    /// After the guard's condition failed: records the message `stale`, or parks it, or (the
    /// position moved since) starts the delivery over. `position` is the position item as the
    /// cancellation returned it, if it did.
    #[allow(clippy::too_many_arguments)]
    pub(super) async fn out_of_order<E>(
        &self,
        ctx: &Ctx<'_>,
        claim: Claim,
        now: Now,
        attempt: u32,
        resend: &mut usize,
        position: Option<Item>,
        payload: &[u8],
    ) -> Result<Settled, DynamoError<E>> {
        let guard = ctx
            .guard
            .expect("the guard failed: the delivery is ordered");
        let sequence = guard.ordering.sequence;
        // DynamoDB returns the position with the reason when it exists (`ALL_OLD`). Without
        // one, the condition of `gaps = "park"` past sequence 1 failed on a missing position
        // (0); any other condition cannot fail on a missing item: the position was not
        // returned, and is read. (Were a missing position not, the park's `ConditionCheck`
        // would fail, and the delivery start over: nothing is written on a wrong guess.)
        let position = match position {
            Some(position) => Some(position),
            None if guard.parks() && sequence > 1 => None,
            None => self.read_position(ctx, guard).await?,
        };
        let last = last_sequence(ctx, position.as_ref())?;
        let mut items = Vec::with_capacity(3);
        let layout;
        let outcome;
        if sequence <= last {
            // Consumed, not applied: settled as a processed key is.
            let put = self.inbox_put(
                ctx,
                claim,
                now,
                HashMap::from([
                    ("status".to_owned(), s("stale")),
                    ("processed_at".to_owned(), n(now.ms)),
                    (TTL_ATTRIBUTE.to_owned(), n(self.expires_at(now))),
                ]),
            )?;
            items.push(TransactWriteItem::builder().put(put).build());
            if let Claim::Takeover { .. } = claim {
                items.push(guard.delete_pointer(self, ctx)?);
            }
            layout = Layout::default();
            outcome = Outcome::Stale;
        } else if !guard.parks() || sequence - 1 == last {
            // The position moved since the condition was checked: the guard may hold now.
            return Ok(Settled::Again(None));
        } else if guard.mode == Mode::Resume {
            // A successor whose gap is open again (it was released before its turn): it stays
            // as it is, with its pointer.
            return Ok(Settled::Done(Outcome::Parked));
        } else {
            let put = self.inbox_put(
                ctx,
                claim,
                now,
                HashMap::from([
                    ("status".to_owned(), s("parked")),
                    ("payload".to_owned(), AttributeValue::B(Blob::new(payload))),
                    // In the sparse index, for the sweep.
                    (DEAD_LETTER_ATTRIBUTE.to_owned(), s(ctx.consumer)),
                ]),
            )?;
            items.push(TransactWriteItem::builder().put(put).build());
            let pointer = Put::builder()
                .table_name(&self.table)
                .item("pk", s(&guard.pointer_pk))
                .item("consumer", s(ctx.consumer))
                .item("message_key", s(ctx.key.as_str()))
                .item("message_name", s(ctx.message_name))
                .item("aggregate_id", s(&guard.ordering.aggregate_id))
                .item("sequence", n(sequence))
                .item("payload", AttributeValue::B(Blob::new(payload)))
                .build()
                .map_err(|e| ctx.dynamo("TransactWriteItems", e.into()))?;
            items.push(TransactWriteItem::builder().put(pointer).build());
            // The gap is still open when the park commits.
            let check = ConditionCheck::builder()
                .table_name(&self.table)
                .key("pk", s(&guard.position_pk))
                .condition_expression("attribute_not_exists(#last) OR #last < :prev")
                .expression_attribute_names("#last", "last_sequence")
                .expression_attribute_values(":prev", n(sequence - 1))
                .build()
                .map_err(|e| ctx.dynamo("TransactWriteItems", e.into()))?;
            items.push(TransactWriteItem::builder().condition_check(check).build());
            layout = Layout {
                guard: Some(2),
                guard_actions: 2,
            };
            outcome = Outcome::Parked;
        }
        super::check_sizes(&items, layout.guard_actions)?;
        let token = |resend: usize| request_token(ctx.consumer, ctx.key, attempt, resend);
        match self.transact(ctx, &items, layout, token, resend).await? {
            Submitted::Committed => Ok(Settled::Done(outcome)),
            Submitted::ClaimFailed(current) => Ok(Settled::Again(current)),
            // The gap closed meanwhile (or, for none of these actions, a condition failed):
            // decide again.
            Submitted::GuardFailed(_) | Submitted::ConditionFailed(_) => Ok(Settled::Again(None)),
        }
    }

    /// A consistent read of the aggregate's position item.
    async fn read_position<E>(
        &self,
        ctx: &Ctx<'_>,
        guard: &Guard,
    ) -> Result<Option<Item>, DynamoError<E>> {
        self.count_call();
        let answer = self
            .client
            .get_item()
            .table_name(&self.table)
            .key("pk", s(&guard.position_pk))
            .consistent_read(true)
            .send()
            .await
            .map_err(|e| ctx.dynamo("GetItem", e.into()))?;
        Ok(answer.item)
    }

    /// The `last_sequence` of `consumer`'s position on `aggregate` (0 for none): one consistent
    /// `GetItem`.
    async fn position(&self, consumer: &str, aggregate: &str) -> Result<i64, AdminError> {
        let pk = position_key(consumer, aggregate);
        let error = |operation: &'static str, source: BoxError| AdminError::Dynamo {
            table: self.table.clone(),
            operation,
            source,
        };
        self.count_call();
        let answer = self
            .client
            .get_item()
            .table_name(&self.table)
            .key("pk", s(&pk))
            .consistent_read(true)
            .send()
            .await
            .map_err(|e| error("GetItem", e.into()))?;
        match answer
            .item
            .as_ref()
            .and_then(|item| item.get("last_sequence"))
        {
            None => Ok(0),
            Some(AttributeValue::N(text)) => text.parse().map_err(|_| AdminError::Malformed {
                table: self.table.clone(),
                pk,
                reason: format!("`last_sequence` is not an integer: {text}"),
            }),
            Some(other) => Err(AdminError::Malformed {
                table: self.table.clone(),
                pk,
                reason: format!("`last_sequence` is not a number: {other:?}"),
            }),
        }
    }

    /// The pointer to `consumer`'s parked message of `aggregate` at `sequence`: its key,
    /// message name and payload (one consistent `GetItem`).
    async fn read_pointer(
        &self,
        consumer: &str,
        aggregate: &str,
        sequence: i64,
    ) -> Result<Option<Pointer>, AdminError> {
        let pk = pointer_key(consumer, aggregate, sequence);
        if pk.len() > MAX_PARTITION_KEY_BYTES {
            return Ok(None);
        }
        self.count_call();
        let answer = self
            .client
            .get_item()
            .table_name(&self.table)
            .key("pk", s(&pk))
            .consistent_read(true)
            .send()
            .await
            .map_err(|e| AdminError::Dynamo {
                table: self.table.clone(),
                operation: "GetItem",
                source: e.into(),
            })?;
        let Some(item) = answer.item else {
            return Ok(None);
        };
        let malformed = |reason: &str| AdminError::Malformed {
            table: self.table.clone(),
            pk: pk.clone(),
            reason: reason.to_owned(),
        };
        let text = |name: &str| match item.get(name) {
            Some(AttributeValue::S(text)) => Ok(text.clone()),
            _ => Err(malformed(&format!("`{name}` is missing or not a string"))),
        };
        let payload = match item.get("payload") {
            Some(AttributeValue::B(bytes)) => bytes.as_ref().to_vec(),
            _ => return Err(malformed("`payload` is missing or not binary")),
        };
        Ok(Some(Pointer {
            message_key: text("message_key")?,
            message_name: text("message_name")?,
            payload,
        }))
    }
}

/// A parked message as its pointer gives it.
struct Pointer {
    message_key: String,
    message_name: String,
    payload: Vec<u8>,
}

/// Which handler runs a stored message of a consumer: a dispatcher's own routes, or (for a
/// handler called directly) every DynamoDB handler linked into the program.
pub(crate) trait DynamoRoutes: Sync {
    /// The handler of `consumer` for `message_name`, if there is one.
    fn route(&self, consumer: &str, message_name: &str) -> Option<&'static dyn DynDynamoHandler>;
}

/// Every `#[idempotent]` DynamoDB handler linked into the program.
pub(crate) struct Registered;

impl DynamoRoutes for Registered {
    fn route(&self, consumer: &str, message_name: &str) -> Option<&'static dyn DynDynamoHandler> {
        inventory::iter::<super::DynamoRegistration>
            .into_iter()
            .map(|registration| registration.handler())
            .find(|h| h.consumer() == consumer && h.message_name() == message_name)
    }
}

/// Runs a stored payload of `key` through `handler` in `mode` (decoded, its key checked against
/// the stored one, fingerprinted), as [`DynamoDispatcher::replay`] does.
pub(crate) async fn run_payload(
    inbox: &DynamoInbox,
    routes: &dyn DynamoRoutes,
    handler: &'static dyn DynDynamoHandler,
    key: &str,
    payload: &[u8],
    mode: Mode,
) -> Result<Result<Outcome<()>, DynamoError<BoxError>>, DynamoReplayError> {
    let message_name = handler.message_name();
    let decode_error = |reason: String| DynamoReplayError::Decode {
        message_name: message_name.to_owned(),
        reason,
    };
    let text = json_text(payload).map_err(|error| {
        decode_error(format!(
            "not Unicode text at line {}, column {}",
            error.line, error.column
        ))
    })?;
    let msg = handler
        .decode(text)
        .map_err(|error| decode_error(error.to_string()))?;
    let decoded = handler.key(&*msg).map_err(DynamoReplayError::Key)?;
    if decoded.as_str() != key {
        return Err(DynamoReplayError::KeyMismatch {
            stored: key.to_owned(),
            decoded: decoded.into_string(),
        });
    }
    let fingerprint = handler
        .fingerprint(&*msg)
        .map_err(DynamoReplayError::Fingerprint)?;
    let run = Run::new(&decoded, fingerprint, payload, mode, routes);
    Ok(handler.invoke(inbox, &*msg, run).await)
}

/// After `ordering` of `consumer` was applied (`duplicate` false) or read as a duplicate:
/// applies, in order, each parked successor of its aggregate, each in its own transaction,
/// until one is missing or is not applied. The first is the one after the message's sequence,
/// or after a duplicate, the one after the aggregate's position (read first: a process that
/// stopped inside this loop left the rest parked, and the message that started it, never
/// acked, comes again). A successor already processed (a concurrent release applied it, or its
/// pointer outlived its commit) is gone past. Problems are logged, not returned: the message
/// that triggered this was processed. Returns the sequence of the last successor applied (or
/// gone past), else the one it started after.
pub(crate) async fn release_successors(
    inbox: &DynamoInbox,
    routes: &dyn DynamoRoutes,
    consumer: &str,
    ordering: &Ordering,
    duplicate: bool,
) -> i64 {
    let aggregate = ordering.aggregate_id.as_str();
    let mut sequence = ordering.sequence;
    if duplicate {
        match inbox.position(consumer, aggregate).await {
            Ok(last) => sequence = sequence.max(last),
            Err(error) => {
                tracing::warn!(%error, consumer, aggregate, "cannot read the aggregate's position");
                return sequence;
            }
        }
    }
    while let Some(next) = sequence.checked_add(1) {
        let pointer = match inbox.read_pointer(consumer, aggregate, next).await {
            Ok(Some(pointer)) => pointer,
            Ok(None) => return sequence,
            Err(error) => {
                tracing::warn!(%error, consumer, aggregate, "cannot look up parked successors");
                return sequence;
            }
        };
        let Some(handler) = routes.route(consumer, &pointer.message_name) else {
            tracing::warn!(
                consumer,
                message = pointer.message_name,
                "parked message has no registered handler"
            );
            return sequence;
        };
        let result = run_payload(
            inbox,
            routes,
            handler,
            &pointer.message_key,
            &pointer.payload,
            Mode::Resume,
        )
        .await;
        match result {
            Ok(Ok(Outcome::Processed(()) | Outcome::Duplicate)) => sequence = next,
            Ok(other) => {
                tracing::info!(
                    consumer,
                    key = pointer.message_key,
                    outcome = ?other.as_ref().map(|o| o.kind()).map_err(ToString::to_string),
                    "parked successor not applied"
                );
                return sequence;
            }
            Err(error) => {
                tracing::warn!(%error, consumer, key = pointer.message_key, "parked successor cannot run");
                return sequence;
            }
        }
    }
    sequence
}

impl DynamoDispatcher {
    /// Sets what happens to parked messages whose gap stays open (default: dead-lettered after
    /// 1 h), as the SQL [`Dispatcher::with_park_policy`](crate::Dispatcher::with_park_policy);
    /// applied by [`sweep_parked`](Self::sweep_parked).
    pub fn with_park_policy(mut self, policy: ParkPolicy) -> Self {
        self.park = policy;
        self
    }

    /// The park policy in force.
    pub fn park_policy(&self) -> ParkPolicy {
        self.park
    }

    /// Settles the parked messages of this dispatcher's consumers received at least the
    /// [`ParkPolicy::timeout`] ago (by this process's clock), at most 1000 per consumer per
    /// call, oldest first: dead-lettered (payload kept, the reason in `last_error`) or released
    /// (applied despite the gap, the aggregate's position jumping to it; its own parked
    /// successors follow in order), as [`Dispatcher::sweep_parked`](crate::Dispatcher::sweep_parked).
    /// A parked message of a consumer this dispatcher has no handler for is left alone. The
    /// messages are taken in each aggregate's sequence order, and each aggregate's successors
    /// whose gap is closed (a release stopped by a failure or a crash) are first applied in
    /// order, not swept. Calls: a `Query` of the dead-letter index per consumer (one per 1 MB
    /// page), a `GetItem` per message found, per aggregate a `GetItem` of its position and one
    /// of the pointer after it (and a release's calls per successor applied), then one
    /// `TransactWriteItems` to dead-letter a message, or a release's calls (see the
    /// [module's docs](self)). The index is eventually consistent: a message parked a
    /// moment ago may be swept by the next call.
    ///
    /// # Errors
    /// [`AdminError::Dynamo`] if a `Query`, `GetItem` or the dead letter's
    /// `TransactWriteItems` fails (the messages settled before it stay settled);
    /// [`AdminError::Malformed`] for an item that does not read as an inbox item. A release
    /// whose handler fails is recorded as any attempt is (`failed`, with its pointer kept) and
    /// is not an error here.
    pub async fn sweep_parked(&self) -> Result<SweepReport, AdminError> {
        let inbox = self.inbox();
        let admin = inbox.admin();
        let timeout = self.park.effective_timeout();
        let cutoff = Now::read()
            .ms
            .saturating_sub(i64::try_from(timeout.as_millis()).unwrap_or(i64::MAX));
        let consumers: BTreeSet<&'static str> =
            self.handlers().iter().map(|info| info.consumer).collect();
        let mut report = SweepReport::default();
        for consumer in consumers {
            // The expired parked messages, in each aggregate's sequence order (as the SQL
            // stores' sweep: a later one released first would make the earlier ones stale).
            let mut expired = Vec::new();
            for key in self.expired_parked(consumer, cutoff).await? {
                let Some(stored) = admin.show(consumer, &key).await? else {
                    continue;
                };
                let (Some(aggregate), Some(sequence)) =
                    (stored.aggregate_id.clone(), stored.sequence)
                else {
                    continue;
                };
                if stored.status != Status::Parked {
                    continue;
                }
                expired.push((aggregate, sequence, key, stored));
            }
            expired.sort_by(|a, b| (&a.0, a.1).cmp(&(&b.0, b.1)));
            // Per aggregate, the sequence its messages were applied up to, once read.
            let mut reached: Option<(&str, i64)> = None;
            for (aggregate, sequence, key, stored) in &expired {
                let applied_to = match reached {
                    Some((of, to)) if of == aggregate => to,
                    // First, what a release left behind (stopped by a failure or a crash after
                    // the commit that closed the gap): the successors of the aggregate's
                    // position, applied in order, neither dead-lettered nor released over a
                    // gap that is closed.
                    _ => {
                        let ordering = Ordering {
                            aggregate_id: aggregate.clone(),
                            sequence: 0,
                        };
                        release_successors(inbox, self, consumer, &ordering, true).await
                    }
                };
                reached = Some((aggregate, applied_to));
                // Applied meanwhile, most likely: read again. One still parked (another key
                // at a sequence applied) is settled by the policy (released: stale).
                if *sequence <= applied_to
                    && admin
                        .show(consumer, key)
                        .await?
                        .is_none_or(|now| now.status != Status::Parked)
                {
                    continue;
                }
                match self.park.on_timeout {
                    ParkTimeout::DeadLetter => {
                        let reason = format!(
                            "parked for more than {} s waiting for sequence {} of aggregate `{}`",
                            timeout.as_secs(),
                            sequence - 1,
                            aggregate
                        );
                        if self
                            .dead_letter_parked(consumer, key, aggregate, *sequence, &reason)
                            .await?
                        {
                            report.dead_lettered += 1;
                        }
                    }
                    ParkTimeout::Release => {
                        let (Some(handler), Some(payload)) = (
                            DynamoRoutes::route(self, consumer, &stored.message_name),
                            &stored.payload,
                        ) else {
                            continue;
                        };
                        let result =
                            run_payload(inbox, self, handler, key, payload, Mode::Release).await;
                        if let Ok(Ok(Outcome::Processed(()))) = result {
                            report.released += 1;
                            let ordering = Ordering {
                                aggregate_id: aggregate.clone(),
                                sequence: *sequence,
                            };
                            let to =
                                release_successors(inbox, self, consumer, &ordering, false).await;
                            reached = Some((aggregate, to));
                        }
                    }
                }
            }
        }
        Ok(report)
    }

    /// The keys of `consumer`'s parked items received at or before `cutoff` (epoch
    /// milliseconds), oldest first, at most 1000: `Query`s of the dead-letter index.
    async fn expired_parked(&self, consumer: &str, cutoff: i64) -> Result<Vec<String>, AdminError> {
        let inbox = self.inbox();
        let mut keys = Vec::new();
        let mut start = None;
        loop {
            inbox.count_call();
            let page = inbox
                .client
                .query()
                .table_name(&inbox.table)
                .index_name(DEAD_LETTER_INDEX)
                .key_condition_expression("#consumer = :consumer AND #received <= :cutoff")
                .filter_expression("#status = :parked")
                .expression_attribute_names("#consumer", DEAD_LETTER_ATTRIBUTE)
                .expression_attribute_names("#received", "received_at")
                .expression_attribute_names("#status", "status")
                .expression_attribute_values(":consumer", s(consumer))
                .expression_attribute_values(":cutoff", n(cutoff))
                .expression_attribute_values(":parked", s("parked"))
                .scan_index_forward(true)
                .set_exclusive_start_key(start.take())
                .send()
                .await
                .map_err(|e| AdminError::Dynamo {
                    table: inbox.table.clone(),
                    operation: "Query",
                    source: e.into(),
                })?;
            for item in page.items() {
                if let Some(AttributeValue::S(key)) = item.get("message_key") {
                    keys.push(key.clone());
                }
            }
            match page.last_evaluated_key.filter(|key| !key.is_empty()) {
                Some(key) if keys.len() < 1000 => start = Some(key),
                _ => break,
            }
        }
        keys.truncate(1000);
        Ok(keys)
    }

    /// Turns a parked item dead with `reason` (payload kept) and deletes its pointer, in one
    /// transaction on the condition that it is still parked. `false` if it is not.
    async fn dead_letter_parked(
        &self,
        consumer: &str,
        key: &str,
        aggregate: &str,
        sequence: i64,
        reason: &str,
    ) -> Result<bool, AdminError> {
        let inbox = self.inbox();
        let dynamo = |e: BoxError| AdminError::Dynamo {
            table: inbox.table.clone(),
            operation: "TransactWriteItems",
            source: e,
        };
        let update = Update::builder()
            .table_name(&inbox.table)
            .key("pk", s(format!("{}:{consumer}{key}", consumer.len())))
            .update_expression("SET #status = :dead, #error = :reason")
            .condition_expression("#status = :parked")
            .expression_attribute_names("#status", "status")
            .expression_attribute_names("#error", "last_error")
            .expression_attribute_values(":dead", s("dead"))
            .expression_attribute_values(":parked", s("parked"))
            .expression_attribute_values(
                ":reason",
                s(inbox.policy.bounded_error(reason.to_owned())),
            )
            .build()
            .map_err(|e| dynamo(e.into()))?;
        let delete = Delete::builder()
            .table_name(&inbox.table)
            .key("pk", s(pointer_key(consumer, aggregate, sequence)))
            .build()
            .map_err(|e| dynamo(e.into()))?;
        inbox.count_call();
        let sent = inbox
            .client
            .transact_write_items()
            .transact_items(TransactWriteItem::builder().update(update).build())
            .transact_items(TransactWriteItem::builder().delete(delete).build())
            .send()
            .await;
        match sent {
            Ok(_) => Ok(true),
            Err(e)
                if e.as_service_error()
                    .is_some_and(|e| e.is_transaction_canceled_exception()) =>
            {
                Ok(false)
            }
            Err(e) => Err(dynamo(e.into())),
        }
    }
}

impl DynamoRoutes for DynamoDispatcher {
    fn route(&self, consumer: &str, message_name: &str) -> Option<&'static dyn DynDynamoHandler> {
        DynamoDispatcher::route(self, consumer, message_name)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ordering_keys_never_collide_with_inbox_keys_or_each_other() {
        assert_eq!(position_key("orders", "o-1"), "pos:6:orderso-1");
        assert_eq!(pointer_key("orders", "o-1", 12), "park:6:orders3:o-112");
        // `a` + `bc` and `ab` + `c` do not share a key; nor do aggregate `o1` at 2 and `o` at 12.
        assert_ne!(position_key("a", "bc"), position_key("ab", "c"));
        assert_ne!(pointer_key("c", "o1", 2), pointer_key("c", "o", 12));
        let key = IdempotencyKey::new("pos:1:ab", "m", "f").unwrap();
        assert!(super::super::partition_key("c", &key).starts_with(|c: char| c.is_ascii_digit()));
    }
}
