//! Idempotency keys for a handler's calls to the outside world (a payment provider, an e-mail
//! service, another team's HTTP API): one deterministic key per step of a handler run.

use std::fmt;

use sha2::{Digest as _, Sha256};

/// The idempotency key of one external call ("step") made while handling one message (or one
/// HTTP request with an `Idempotency-Key`): derived from the consumer, the message's
/// idempotency key and the step's name, so that every run of the handler for that message — a
/// retry after a rollback, a redelivery after a crash, a dead-letter replay, another worker
/// process — sends the **same** key to the provider, and the provider deduplicates the call.
///
/// Why it is needed: the inbox makes the handler's *database* writes effectively once, but an
/// HTTP call the handler makes is not rolled back with them. If the transaction rolls back (a
/// later error, a crash before `COMMIT`, a lost commit answer), the message runs again and calls
/// the provider again; with the same key, the provider answers the second call with the result
/// of the first instead of charging twice. This is the "deterministic idempotency key derived
/// from the message" of the idempotent-consumer pattern (seed 004; Stripe's
/// `idempotencyKey: order-${orderId}-charge`).
///
/// # The derivation (fixed: never changes within this crate's major version)
///
/// The key is a UUID, version 8 (RFC 9562, section 5.8: custom, here name-based on SHA-256): its
/// 122 free bits are the first bits of SHA-256 over the domain tag `inbox-step-key-v1`, a NUL,
/// then the consumer, the message key and the step name, each preceded by its length in bytes
/// (64-bit big-endian). Length prefixes make the encoding unambiguous: `("a:b", "c")` and
/// `("a", "b:c")` give different keys. Nothing random or time-based enters it.
///
/// Changing the consumer name, the message key or the step name changes the key: a deployment
/// that renames a step while messages are in flight makes their retries call the provider with a
/// new key. Keep step names stable, like consumer names.
///
/// # Fits the providers' limits
///
/// [`Display`](fmt::Display) / [`to_string`](ToString::to_string) gives the hyphenated form,
/// **36 characters** of `0-9a-f` and `-`; [`simple`](Self::simple) gives **32 characters** of
/// `0-9a-f`. Published limits of idempotency keys (as documented by each provider at the time of
/// writing; check yours):
///
/// | provider | header or field | limit | fits |
/// |---|---|---|---|
/// | Stripe | `Idempotency-Key` | 255 characters | both forms |
/// | Adyen | `Idempotency-Key` | 64 characters (a UUID recommended) | both forms |
/// | Plaid (payment initiation) | `idempotency_key` | 128 characters | both forms |
/// | Alpaca | `Idempotency-Key` | 128 characters, moving to 36 (a UUID) | both forms |
/// | Worldline Direct | idempotence key | 40 ASCII characters | both forms |
/// | Amazon Pay | `x-amz-pay-idempotency-key` | 32 characters of `A-Za-z0-9_-` | [`simple`](Self::simple) only |
/// | this crate's HTTP layer | `Idempotency-Key` | 255 by default | both forms (send it as an sf-string: `"…"`) |
///
/// A provider that wants an opaque string takes either form; one that validates UUIDs takes the
/// hyphenated form ([`as_uuid`](Self::as_uuid) gives the `uuid::Uuid`).
///
/// # From inside a handler
///
/// [`StepKey::current`] derives it from the claim the code runs for: the consumer and key of the
/// `#[idempotent]` handler (also when it runs from a `Dispatcher`, a batch or a replay), or the
/// scope and `Idempotency-Key` of a request behind the HTTP layer (feature `http`).
///
/// ```
/// use inbox_runtime::types::StepKey;
///
/// let key = StepKey::new("billing", "order-42", "charge");
/// // Deterministic: the same inputs give the same key, in every process.
/// assert_eq!(key, StepKey::new("billing", "order-42", "charge"));
/// assert_eq!(key.to_string().len(), 36);
/// assert_eq!(key.simple().len(), 32);
/// // Another step of the same run, another message or another consumer: another key.
/// assert_ne!(key, StepKey::new("billing", "order-42", "refund"));
/// assert_ne!(key, StepKey::new("billing", "order-43", "charge"));
/// assert_ne!(key, StepKey::new("shipping", "order-42", "charge"));
/// ```
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct StepKey(uuid::Uuid);

impl StepKey {
    /// The key of step `step` of consumer `consumer`'s run for the message (or request) whose
    /// idempotency key is `message_key`. Any strings are accepted (an empty step name is a step
    /// name like any other); see the type's documentation for the derivation.
    pub fn new(consumer: &str, message_key: &str, step: &str) -> Self {
        let mut hash = Sha256::new();
        hash.update(b"inbox-step-key-v1\0");
        for part in [consumer, message_key, step] {
            hash.update((part.len() as u64).to_be_bytes());
            hash.update(part.as_bytes());
        }
        let digest = hash.finalize();
        let mut bytes = [0_u8; 16];
        bytes.copy_from_slice(&digest[..16]);
        Self(uuid::Builder::from_custom_bytes(bytes).into_uuid())
    }

    /// The key of step `step` of the claim this code runs for: inside the body of an
    /// `#[idempotent]` handler (called directly or through a `Dispatcher`, in a batch or a
    /// replay), inside a handler behind the HTTP layer (`http::IdempotencyLayer`, feature
    /// `http`: the request's scope and `Idempotency-Key`), or inside
    /// [`outbox::scoped`](crate::outbox::scoped). `None` anywhere else — including tasks
    /// spawned from a handler, which do not inherit its claim (derive the key before spawning,
    /// or use [`StepKey::new`]).
    ///
    /// ```
    /// use inbox_runtime::{idempotent, Message, types::StepKey};
    ///
    /// #[derive(Clone, serde::Serialize, serde::Deserialize, Message)]
    /// struct OrderPlaced {
    ///     #[message(key)]
    ///     order_id: String,
    ///     amount_cents: i64,
    /// }
    ///
    /// #[idempotent(consumer = "billing")]
    /// async fn charge(conn: &mut sqlx::SqliteConnection, msg: OrderPlaced) -> Result<String, sqlx::Error> {
    ///     let key = StepKey::current("charge").expect("inside a handler");
    ///     assert_eq!(key, StepKey::new("billing", &msg.order_id, "charge"));
    ///     // provider.charge(msg.amount_cents).idempotency_key(key.to_string()).send().await?;
    ///     Ok(key.to_string())
    /// }
    ///
    /// assert_eq!(StepKey::current("charge"), None); // outside any handler
    /// ```
    pub fn current(step: &str) -> Option<Self> {
        crate::protocol::context::current().map(|(consumer, key)| Self::new(&consumer, &key, step))
    }

    /// The key as a UUID (version 8, RFC 9562).
    pub fn as_uuid(&self) -> uuid::Uuid {
        self.0
    }

    /// The key as 32 lower-case hex digits, without hyphens (for providers that allow only
    /// alphanumerics, or fewer than 36 characters).
    pub fn simple(&self) -> String {
        self.0.simple().to_string()
    }
}

/// The hyphenated form: 36 characters, `xxxxxxxx-xxxx-8xxx-xxxx-xxxxxxxxxxxx`.
impl fmt::Display for StepKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(&self.0.hyphenated(), f)
    }
}

impl fmt::Debug for StepKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "StepKey({})", self.0.hyphenated())
    }
}

impl From<StepKey> for uuid::Uuid {
    fn from(key: StepKey) -> Self {
        key.0
    }
}

/// The key of step `step` of consumer `consumer`'s run for the message whose idempotency key is
/// `message_key`: [`StepKey::new`].
pub fn step_key(consumer: &str, message_key: &str, step: &str) -> StepKey {
    StepKey::new(consumer, message_key, step)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_derivation_is_fixed() {
        // A changed derivation would give every in-flight message a new provider key: this
        // value must never change.
        let key = StepKey::new("billing", "order-42", "charge");
        assert_eq!(key.to_string(), EXPECTED_BILLING_ORDER_42_CHARGE);
        assert_eq!(key.as_uuid().get_version_num(), 8);
        assert_eq!(key.simple(), key.to_string().replace('-', ""));
    }

    /// Computed independently (Python: hashlib, the same framing, RFC 9562 version and variant
    /// bits).
    const EXPECTED_BILLING_ORDER_42_CHARGE: &str = "7e82de49-60cd-856a-b6e4-94e51df7b1a8";

    #[test]
    fn parts_are_length_prefixed() {
        assert_ne!(StepKey::new("a:b", "c", "d"), StepKey::new("a", "b:c", "d"));
        assert_ne!(StepKey::new("a", "bc", ""), StepKey::new("a", "b", "c"));
        assert_ne!(StepKey::new("", "", ""), StepKey::new("", "", " "));
    }

    #[test]
    fn current_follows_the_claim() {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .build()
            .unwrap();
        runtime.block_on(async {
            assert_eq!(StepKey::current("charge"), None);
            let inside =
                crate::outbox::scoped("billing", "order-42", async { StepKey::current("charge") })
                    .await;
            assert_eq!(inside, Some(StepKey::new("billing", "order-42", "charge")));
        });
    }
}
