//! Per-aggregate ordering: `#[message(aggregate)]` / `#[message(sequence)]` on the message, and
//! the `aggregate`, `sequence` and `gaps` arguments of `#[idempotent]`, which override them.
#![deny(warnings, missing_docs)]

// The hidden handler types are named here only to check what the macro generated.
use inbox_runtime::__private::HandlerSpec;
use inbox_runtime::{idempotent, GapPolicy, KeyError, Message, types::Ordering};
use serde::{Deserialize, Serialize};
use sqlx::PgConnection;

/// An event of an order's lifecycle: the order is the aggregate, keyed by its id and version.
#[derive(Clone, Serialize, Deserialize, Message)]
#[message(name = "orders.event", key = "order:{order_id}:{version}")]
pub struct OrderEvent {
    /// The aggregate.
    #[message(aggregate)]
    pub order_id: String,
    /// Its position in the order's history, from 1.
    #[message(sequence)]
    pub version: u32,
    /// Another numbering, which a handler may order by instead.
    pub seq: Option<i64>,
    /// What happened.
    pub kind: String,
}

/// The key field can also be the aggregate, and the markers can have attributes of their own.
#[derive(Clone, Serialize, Deserialize, Message)]
struct AccountEntry {
    #[message(key)]
    event_id: uuid::Uuid,
    #[message(aggregate)]
    r#type: u64,
    #[message(sequence)]
    seq: Option<u16>,
}

/// Ordered by its own fields, unless a handler says otherwise.
#[derive(Clone, Serialize, Deserialize, Message)]
struct Unordered {
    #[message(key, aggregate)]
    id: u64,
    #[message(sequence)]
    seq: u8,
    other: u64,
}

/// No markers: the trait's default.
#[derive(Clone, Serialize, Deserialize, Message)]
struct Plain {
    #[message(key)]
    id: u64,
}

/// The message's own ordering, with parking.
#[idempotent(consumer = "orders", gaps = "park")]
pub async fn apply(conn: &mut PgConnection, msg: OrderEvent) -> Result<(), sqlx::Error> {
    let _ = (conn, msg.kind);
    Ok(())
}

/// Another numbering, for this consumer only, with the default gap policy spelled out.
#[idempotent(consumer = "audit", aggregate = "order_id", sequence = "seq", gaps = "apply")]
async fn audit(_: &mut PgConnection, _: OrderEvent) -> Result<(), sqlx::Error> {
    Ok(())
}

/// Ordered by other fields than the message's own (one spelled `r#`), with a key override.
#[idempotent(consumer = "ledger", key = "id", aggregate = "other", sequence = "r#seq")]
async fn ledger(_: &mut PgConnection, _: Unordered) -> Result<(), sqlx::Error> {
    Ok(())
}

#[idempotent(consumer = "accounts")]
async fn accounts(_: &mut PgConnection, _: AccountEntry) -> Result<(), sqlx::Error> {
    Ok(())
}

#[idempotent(consumer = "plain", gaps = "park")]
async fn plain(_: &mut PgConnection, _: Plain) -> Result<(), sqlx::Error> {
    Ok(())
}

// Arguments passed through a `macro_rules!` macro.
macro_rules! ordered_handler {
    ($name:ident, $consumer:literal, $aggregate:literal, $sequence:literal, $gaps:literal) => {
        #[idempotent(
            consumer = $consumer,
            aggregate = $aggregate,
            sequence = $sequence,
            gaps = $gaps
        )]
        async fn $name(_: &mut PgConnection, msg: OrderEvent) -> Result<(), sqlx::Error> {
            let _ = msg;
            Ok(())
        }
    };
}

ordered_handler!(from_a_macro, "from-a-macro", "kind", "version", "park");

fn ordering(aggregate_id: &str, sequence: i64) -> Result<Option<Ordering>, KeyError> {
    Ok(Some(Ordering { aggregate_id: aggregate_id.into(), sequence }))
}

fn main() {
    let event = OrderEvent { order_id: "o-1".into(), version: 3, seq: Some(7), kind: "paid".into() };
    assert_eq!(event.ordering(), ordering("o-1", 3));
    assert_eq!(event.idempotency_key().unwrap().as_str(), "order:o-1:3");
    assert_eq!(<__inbox_handler_apply as HandlerSpec>::ordering(&event), ordering("o-1", 3));
    assert_eq!(<__inbox_handler_audit as HandlerSpec>::ordering(&event), ordering("o-1", 7));
    assert_eq!(<__inbox_handler_from_a_macro as HandlerSpec>::ordering(&event), ordering("paid", 3));
    assert_eq!(<__inbox_handler_apply as HandlerSpec>::GAPS, GapPolicy::Park);
    assert_eq!(<__inbox_handler_audit as HandlerSpec>::GAPS, GapPolicy::Apply);
    assert_eq!(<__inbox_handler_from_a_macro as HandlerSpec>::GAPS, GapPolicy::Park);

    // Run-time checks of the values: a null or zero sequence is an error.
    let null = OrderEvent { seq: None, ..event.clone() };
    assert!(matches!(
        <__inbox_handler_audit as HandlerSpec>::ordering(&null),
        Err(KeyError::Invalid { message: "orders.event", field: "seq", .. })
    ));
    let zero = OrderEvent { version: 0, ..event };
    assert!(matches!(
        zero.ordering(),
        Err(KeyError::Invalid { message: "orders.event", field: "version", .. })
    ));

    let entry = AccountEntry { event_id: uuid::Uuid::nil(), r#type: 42, seq: Some(1) };
    assert_eq!(entry.ordering(), ordering("42", 1));
    assert_eq!(<__inbox_handler_accounts as HandlerSpec>::ordering(&entry), ordering("42", 1));
    assert_eq!(<__inbox_handler_accounts as HandlerSpec>::GAPS, GapPolicy::Apply);

    let unordered = Unordered { id: 1, seq: 2, other: 9 };
    assert_eq!(unordered.ordering(), ordering("1", 2));
    assert_eq!(<__inbox_handler_ledger as HandlerSpec>::ordering(&unordered), ordering("9", 2));

    let plain = Plain { id: 1 };
    assert_eq!(plain.ordering(), Ok(None));
    assert_eq!(<__inbox_handler_plain as HandlerSpec>::ordering(&plain), Ok(None));
    assert_eq!(<__inbox_handler_plain as HandlerSpec>::GAPS, GapPolicy::Park);
}
