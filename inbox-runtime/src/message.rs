//! The `Message` trait: a message type's routing name, idempotency key and ordering.

use serde::Serialize;
use serde::de::DeserializeOwned;

use crate::key::{IdempotencyKey, KeyError};
use crate::ordering::Ordering;

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
