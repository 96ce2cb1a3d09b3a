//! `#[derive(Message)]` with a key field and the default routing name.
#![deny(warnings, missing_docs)]

use inbox_runtime::{KeyError, Message};
use serde::{Deserialize, Serialize};

/// A captured payment.
#[derive(Clone, Serialize, Deserialize, Message)]
pub struct PaymentCaptured {
    /// The producer's event id.
    #[message(key)]
    pub event_id: uuid::Uuid,
    /// Amount, in cents.
    pub amount_cents: i64,
}

/// A key field may be optional: `None` is a key error at run time.
#[derive(Clone, Serialize, Deserialize, Message)]
#[message(name = "orders.placed")]
struct OrderPlaced {
    #[message(key)]
    r#ref: Option<String>,
}

fn main() {
    assert_eq!(PaymentCaptured::NAME, "PaymentCaptured");
    let id = uuid::Uuid::nil();
    let msg = PaymentCaptured { event_id: id, amount_cents: 5 };
    assert_eq!(msg.idempotency_key().unwrap().as_str(), id.to_string());
    assert_eq!(msg.amount_cents, 5);

    assert_eq!(OrderPlaced::NAME, "orders.placed");
    let placed = OrderPlaced { r#ref: Some("o-1".into()) };
    assert_eq!(placed.idempotency_key().unwrap().as_str(), "o-1");
    let missing = OrderPlaced { r#ref: None };
    assert_eq!(
        missing.idempotency_key(),
        Err(KeyError::Null { message: "orders.placed", field: "ref" })
    );
}
