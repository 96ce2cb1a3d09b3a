//! The two message types of the payments stream.

use serde::{Deserialize, Serialize};
use uuid::Uuid;

/// A payment was captured: credit `amount_cents` to the account.
#[derive(Debug, Clone, Serialize, Deserialize, inbox_runtime::Message)]
#[message(name = "payments.captured")]
pub(crate) struct PaymentCaptured {
    /// The producer's event id: the idempotency key.
    #[message(key)]
    pub(crate) event_id: Uuid,
    pub(crate) account_id: String,
    pub(crate) amount_cents: i64,
}

/// A payment was refunded: debit `amount_cents` from the account.
#[derive(Debug, Clone, Serialize, Deserialize, inbox_runtime::Message)]
#[message(name = "payments.refunded")]
pub(crate) struct PaymentRefunded {
    /// The producer's event id: the idempotency key.
    #[message(key)]
    pub(crate) event_id: Uuid,
    pub(crate) account_id: String,
    pub(crate) amount_cents: i64,
}
