//! `#[derive(Message)]` with a key template, escaped braces and a renamed message.
#![deny(warnings)]

use inbox_runtime::Message;
use serde::{Deserialize, Serialize};

#[derive(Clone, Serialize, Deserialize, Message)]
#[message(name = "payments.refunded", key = "{{refund}}:{payment_id}:{seq}")]
struct PaymentRefunded {
    payment_id: String,
    seq: u32,
    #[serde(default)]
    note: String,
}

/// The template may also come in its own attribute, and name a raw-identifier field.
#[derive(Clone, Serialize, Deserialize, Message)]
#[message(key = "{type}-{r#type}")]
#[message(name = "typed")]
struct Typed {
    r#type: char,
}

fn main() {
    assert_eq!(PaymentRefunded::NAME, "payments.refunded");
    let msg = PaymentRefunded { payment_id: "p-1".into(), seq: 2, note: String::new() };
    assert_eq!(msg.idempotency_key().unwrap().as_str(), "{refund}:p-1:2");
    assert!(msg.note.is_empty());

    assert_eq!(Typed::NAME, "typed");
    assert_eq!(Typed { r#type: 'x' }.idempotency_key().unwrap().as_str(), "x-x");
}
