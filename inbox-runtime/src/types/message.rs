//! The `Message` trait: a message type's routing name, idempotency key, ordering and partitions.

use serde::Serialize;
use serde::de::DeserializeOwned;

use crate::types::key::{IdempotencyKey, KeyError};
use crate::types::ordering::Ordering;

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

    /// The **partitions** of this message: the aggregates (an account id, an order id) whose
    /// rows its handlers lock, for the [`Worker`](crate::Worker)'s batches; `None` (the
    /// default) if the type does not declare them. Derived from the `#[message(partition)]`
    /// fields, one partition each, in field order, repeats removed (a transfer marks both
    /// accounts); each field's type must be a [`KeyPart`](crate::types::KeyPart), whose key text is
    /// the partition. Implement it by hand for anything else (a prefix per kind of aggregate,
    /// a computed value).
    ///
    /// **What the Worker does with them.** Two batches in flight never share a partition: a
    /// delivery whose partition a running batch holds waits until that batch ends (as a Kafka
    /// partition's next records wait for the ones before), then joins a later batch, in its
    /// order of arrival. Batches whose deliveries all declare their partitions therefore run
    /// side by side from the start, up to the Worker's concurrency, without deadlocking each
    /// other. Batches with an undeclared delivery keep the cautious default (one batch in
    /// flight after a batch lost to a deadlock; see [`Worker::batch`](crate::Worker::batch)).
    /// A message routed to several consumers has the partitions of all of them; if one
    /// consumer's message type declares none, the delivery is undeclared. A consumer's
    /// ordering aggregate (`#[message(aggregate)]`, or `#[idempotent(aggregate = "…")]`)
    /// counts as one more partition, and declares the message by itself.
    ///
    /// **What a declaration promises.** Every row the message's handlers lock, other than
    /// rows no other message locks (an insert with a fresh key, the inbox row), belongs to one
    /// of its partitions: messages with no partition in common lock no row in common.
    /// Partitions are compared across message types, byte-exactly: give a credit and a debit
    /// of one account the same value. Two aggregates whose ids coincide by accident (account
    /// `7` and order `7`) share a partition, which only costs parallelism. A declaration that
    /// leaves out a row the handlers lock brings the deadlocks back (each one then handled as
    /// for undeclared batches: the batch runs again alone, counted in
    /// [`WorkerReport::contention_fallbacks`](crate::WorkerReport); effects stay exact).
    ///
    /// A partition field that is null (`None` of an `Option` field) makes that message
    /// undeclared (never an error: the partition only schedules; the key still decides
    /// everything else). An empty string is a partition like any other.
    fn partitions(&self) -> Option<Vec<String>> {
        None
    }
}
