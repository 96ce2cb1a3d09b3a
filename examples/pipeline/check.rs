//! The end-to-end check: every upstream payment produced exactly one downstream effect, in each
//! customer's order, and the outbox lost nothing.

use std::collections::BTreeSet;

use crate::db::State;
use crate::stream::Stream;

/// Every difference between `state` and what `stream` must produce, as lines for stderr; empty
/// when everything holds:
///
/// * orders: each order's payments and paid total; each customer's count of paid events;
/// * outbox: one row per payment to the orders destination, every one `sent` (none pending,
///   none dead);
/// * shipping: each order's shipment (payments, cents: none missing, none doubled), each
///   customer's event count and total, its last sequence equal to its count, and no event applied
///   out of sequence;
/// * inboxes: one `processed` row per payment for each consumer, no other status.
pub(crate) fn mismatches(stream: &Stream, state: &State) -> Vec<String> {
    let mut out = Vec::new();
    let payments = stream.payments as i64;

    let order_ids: BTreeSet<&String> = stream
        .orders
        .keys()
        .chain(state.orders.keys())
        .chain(state.shipments.keys())
        .collect();
    for order in order_ids {
        let expected = stream
            .orders
            .get(order)
            .map(|o| (o.customer_id.clone(), o.payments, o.paid_cents));
        for (service, rows) in [("orders", &state.orders), ("shipping", &state.shipments)] {
            let found = rows.get(order).cloned();
            if found != expected {
                out.push(format!(
                    "{service}: order {order} has {} (customer, payments, cents), expected {}",
                    show(&found),
                    show(&expected)
                ));
            }
        }
    }

    let customer_ids: BTreeSet<&String> = stream
        .customers
        .keys()
        .chain(state.customers.keys())
        .chain(state.totals.keys())
        .collect();
    for customer in customer_ids {
        let expected = stream.customers.get(customer).copied().unwrap_or_default();
        let seq = state.customers.get(customer).copied().unwrap_or(0);
        if seq != expected.events {
            out.push(format!(
                "orders: customer {customer} has {seq} paid events, expected {}",
                expected.events
            ));
        }
        let (events, total, last_seq, out_of_order) =
            state.totals.get(customer).copied().unwrap_or_default();
        if (events, total) != (expected.events, expected.total_cents) {
            out.push(format!(
                "shipping: customer {customer} has {events} events totalling {total} cents, \
                 expected {} totalling {}",
                expected.events, expected.total_cents
            ));
        }
        if last_seq != events {
            out.push(format!(
                "shipping: customer {customer}'s last sequence is {last_seq} after {events} events"
            ));
        }
        if out_of_order != 0 {
            out.push(format!(
                "shipping: customer {customer} had {out_of_order} events applied out of sequence"
            ));
        }
    }

    let rows: i64 = state.outbox.values().sum();
    let sent = state.outbox.get("sent").copied().unwrap_or(0);
    if rows != payments || sent != payments {
        out.push(format!(
            "outbox: {rows} rows ({}), expected {payments} sent",
            show_counts(state.outbox.iter().map(|(status, n)| (status.as_str(), *n)))
        ));
    }
    for consumer in ["orders", "shipping"] {
        let statuses: Vec<(&str, i64)> = state
            .inbox
            .iter()
            .filter(|((c, _), _)| c == consumer)
            .map(|((_, status), n)| (status.as_str(), *n))
            .collect();
        if statuses != [("processed", payments)] {
            out.push(format!(
                "inbox of {consumer}: {}, expected processed={payments}",
                show_counts(statuses.into_iter())
            ));
        }
    }
    out
}

fn show(row: &Option<(String, i64, i64)>) -> String {
    match row {
        Some((customer, payments, cents)) => format!("({customer}, {payments}, {cents})"),
        None => "nothing".into(),
    }
}

fn show_counts<'a>(counts: impl Iterator<Item = (&'a str, i64)>) -> String {
    let shown: Vec<String> = counts.map(|(name, n)| format!("{name}={n}")).collect();
    if shown.is_empty() {
        "none".into()
    } else {
        shown.join(" ")
    }
}
