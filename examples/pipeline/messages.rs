//! The two messages of the pipeline: the upstream `payments.captured`, and the `orders.paid` the
//! orders service publishes through its outbox.

use serde::{Deserialize, Serialize};
use uuid::Uuid;

/// A payment was captured for an order (upstream, from the payments service).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, inbox_runtime::Message)]
#[message(name = "payments.captured")]
pub(crate) struct PaymentCaptured {
    /// The payment service's event id: the orders service's idempotency key.
    #[message(key)]
    pub(crate) event_id: Uuid,
    pub(crate) order_id: String,
    pub(crate) customer_id: String,
    pub(crate) amount_cents: i64,
}

/// An order received a payment: published by the orders service, in the transaction that
/// applied the payment, one per captured payment.
///
/// Its aggregate is the customer and its sequence the customer's count of paid events, assigned
/// by the orders service under the customer row's lock: the shipping service applies a
/// customer's events in that order (`gaps = "park"` holds one that arrives early).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, inbox_runtime::Message)]
#[message(name = "orders.paid")]
pub(crate) struct OrderPaid {
    /// The captured payment's event id: the shipping service's idempotency key.
    #[message(key)]
    pub(crate) payment_id: Uuid,
    pub(crate) order_id: String,
    #[message(aggregate)]
    pub(crate) customer_id: String,
    /// 1, 2, 3, … per customer.
    #[message(sequence)]
    pub(crate) seq: i64,
    pub(crate) amount_cents: i64,
    /// The order's paid total with this payment.
    pub(crate) order_paid_cents: i64,
}
