//! Per-aggregate ordering on DynamoDB: the sequence guard (`gaps = "apply"`), the durable
//! reorder buffer (`gaps = "park"`), the release of parked successors in order, and the sweep
//! of parked messages whose gap stays open ([`DynamoDispatcher::sweep_parked`](super::DynamoDispatcher::sweep_parked)); the same
//! semantics as the SQL stores' (`Outcome::Stale`, `Outcome::Parked`, [`ParkPolicy`](crate::types::ParkPolicy)).
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
//! [`DynamoDispatcher::replay`](super::DynamoDispatcher::replay)) with a claim that takes the `parked` item over (`status =
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
//! [`DynamoDispatcher::sweep_parked`](super::DynamoDispatcher::sweep_parked) finds, per consumer of the dispatcher, the parked items
//! received at least [`ParkPolicy::timeout`](crate::types::ParkPolicy::timeout) ago (a `Query` of the dead-letter index on the
//! consumer and `received_at`, filtered on `status = parked`, eventually consistent), reads each
//! (`GetItem`) and takes them in each aggregate's sequence order (the index gives them by
//! arrival: a later one released first would make the earlier ones stale). Per aggregate it
//! first goes on from the aggregate's position, as a duplicate does: successors a release left
//! behind with their gap closed (its process stopped after the commit, or a successor's handler
//! failed: `failed`, with its pointer — no delivery of it comes again, it was acked as parked)
//! are applied in order. Then, by [`ParkPolicy::on_timeout`](crate::types::ParkPolicy::on_timeout), each one still parked is
//! dead-lettered (one `TransactWriteItems`: the item `dead` with the reason, payload kept, and
//! its pointer deleted) or released (its handler runs with the position's condition
//! `last_sequence < :seq`: the position jumps to it, then its own successors follow in order). [`DynamoWorker`](super::DynamoWorker) runs it
//! periodically ([`DynamoWorker::park_sweep`](super::DynamoWorker::park_sweep)).

use std::collections::HashMap;
use std::convert::Infallible;

use aws_sdk_dynamodb::primitives::Blob;
use aws_sdk_dynamodb::types::{
    AttributeValue, ConditionCheck, Delete, Put, ReturnValuesOnConditionCheckFailure,
    TransactWriteItem, Update,
};

use super::admin::{AdminError, DEAD_LETTER_ATTRIBUTE};
use super::{
    Claim, Ctx, DynamoError, DynamoInbox, Layout, MAX_PARTITION_KEY_BYTES, Mode, Now, Ordered,
    Submitted, n, s,
};
use crate::types::classify::BoxError;
use crate::types::key::IdempotencyKey;
use crate::types::ordering::{GapPolicy, Ordering};
use crate::types::outcome::Outcome;

/// An item as read.
type Item = HashMap<String, AttributeValue>;

/// The partition key of `consumer`'s position on `aggregate`: `pos:<len>:<consumer><aggregate>`.
fn position_key(consumer: &str, aggregate: &str) -> String {
    format!("pos:{}:{consumer}{aggregate}", consumer.len())
}

/// The partition key of the pointer to `consumer`'s parked message of `aggregate` at
/// `sequence`: `park:<len>:<consumer><len>:<aggregate><sequence>`.
pub(super) fn pointer_key(consumer: &str, aggregate: &str, sequence: i64) -> String {
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
        let delete = inbox
            .by_key()
            .delete_item(&self.pointer_pk)
            .condition_expression("message_key = :key")
            .expression_attribute_values(":key", s(ctx.key.as_str()));
        if let Err(error) = inbox.delete_unless_changed(delete).await {
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
    pub(super) async fn out_of_order<E>(
        &self,
        ctx: &Ctx<'_>,
        claim: Claim,
        now: Now,
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
            let put = self.settled_put(ctx, claim, now, "stale")?;
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
            items = self.park_items(ctx, guard, claim, now, payload)?;
            layout = Layout {
                guard: Some(2),
                guard_actions: 2,
            };
            outcome = Outcome::Parked;
        }
        super::check_sizes(&items, layout.guard_actions)?;
        match self
            .transact(ctx, &items, layout, ctx.tokens(claim), resend)
            .await?
        {
            Submitted::Committed => Ok(Settled::Done(outcome)),
            Submitted::ClaimFailed(current) => Ok(Settled::Again(current)),
            // The gap closed meanwhile (or, for none of these actions, a condition failed):
            // decide again.
            Submitted::GuardFailed(_) | Submitted::ConditionFailed(_) => Ok(Settled::Again(None)),
        }
    }

    /// The actions that park a message ahead of its gap: its inbox item `parked` with its
    /// payload (in the sparse index, for the sweep), the pointer item of its (consumer,
    /// aggregate, sequence), and a check that the gap is still open when they commit.
    #[allow(clippy::result_large_err)] // See `Guard::new`.
    fn park_items<E>(
        &self,
        ctx: &Ctx<'_>,
        guard: &Guard,
        claim: Claim,
        now: Now,
        payload: &[u8],
    ) -> Result<Vec<TransactWriteItem>, DynamoError<E>> {
        let sequence = guard.ordering.sequence;
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
        let check = ConditionCheck::builder()
            .table_name(&self.table)
            .key("pk", s(&guard.position_pk))
            .condition_expression("attribute_not_exists(#last) OR #last < :prev")
            .expression_attribute_names("#last", "last_sequence")
            .expression_attribute_values(":prev", n(sequence - 1))
            .build()
            .map_err(|e| ctx.dynamo("TransactWriteItems", e.into()))?;
        Ok(vec![
            TransactWriteItem::builder().put(put).build(),
            TransactWriteItem::builder().put(pointer).build(),
            TransactWriteItem::builder().condition_check(check).build(),
        ])
    }

    /// A consistent read of the aggregate's position item.
    async fn read_position<E>(
        &self,
        ctx: &Ctx<'_>,
        guard: &Guard,
    ) -> Result<Option<Item>, DynamoError<E>> {
        self.get_consistent(&guard.position_pk)
            .await
            .map_err(|e| ctx.dynamo("GetItem", e))
    }

    /// The `last_sequence` of `consumer`'s position on `aggregate` (0 for none): one consistent
    /// `GetItem`.
    pub(super) async fn position(
        &self,
        consumer: &str,
        aggregate: &str,
    ) -> Result<i64, AdminError> {
        let pk = position_key(consumer, aggregate);
        let error = |operation: &'static str, source: BoxError| AdminError::Dynamo {
            table: self.table.clone(),
            operation,
            source,
        };
        let item = self
            .get_consistent(&pk)
            .await
            .map_err(|e| error("GetItem", e))?;
        match item.as_ref().and_then(|item| item.get("last_sequence")) {
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
    pub(super) async fn read_pointer(
        &self,
        consumer: &str,
        aggregate: &str,
        sequence: i64,
    ) -> Result<Option<Pointer>, AdminError> {
        let pk = pointer_key(consumer, aggregate, sequence);
        if pk.len() > MAX_PARTITION_KEY_BYTES {
            return Ok(None);
        }
        let item = self
            .get_consistent(&pk)
            .await
            .map_err(|source| AdminError::Dynamo {
                table: self.table.clone(),
                operation: "GetItem",
                source,
            })?;
        let Some(item) = item else {
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
pub(super) struct Pointer {
    pub(super) message_key: String,
    pub(super) message_name: String,
    pub(super) payload: Vec<u8>,
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
