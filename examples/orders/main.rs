//! # Per-aggregate ordering: an order's lifecycle delivered out of order
//!
//! ```text
//! cargo run --example orders
//! ```
//!
//! An order goes `placed → paid → shipped`, or `placed → cancelled`. A broker may deliver these
//! events out of order and more than once; applied naively, a late `OrderPlaced` after an
//! `OrderCancelled` resurrects the order. Here every event carries its order id (the
//! *aggregate*) and its position in that order's history (the *sequence*), and all four handlers
//! share the consumer `orders` with `gaps = "park"`:
//!
//! * an event whose sequence is not newer than the order's last applied one is **stale**:
//!   recorded, not applied;
//! * an event that arrives before its predecessor is **parked**: stored in the inbox (the delivery
//!   can be acked) and applied, in order, as soon as the missing event has been applied.
//!
//! The demo runs on an in-memory SQLite database and prints each delivery's outcome and the
//! orders' final states.

use inbox_runtime::{Dispatcher, Envelope, Message, idempotent};
use serde::{Deserialize, Serialize};
use sqlx::SqliteConnection;
use sqlx::sqlite::SqlitePoolOptions;

/// An order was placed (sequence 1 of its order).
#[derive(Debug, Clone, Serialize, Deserialize, Message)]
#[message(name = "order.placed")]
struct OrderPlaced {
    #[message(key)]
    event_id: String,
    #[message(aggregate)]
    order_id: String,
    #[message(sequence)]
    seq: i64,
    customer: String,
}

/// An order was paid.
#[derive(Debug, Clone, Serialize, Deserialize, Message)]
#[message(name = "order.paid")]
struct OrderPaid {
    #[message(key)]
    event_id: String,
    #[message(aggregate)]
    order_id: String,
    #[message(sequence)]
    seq: i64,
    amount_cents: i64,
}

/// An order was shipped.
#[derive(Debug, Clone, Serialize, Deserialize, Message)]
#[message(name = "order.shipped")]
struct OrderShipped {
    #[message(key)]
    event_id: String,
    #[message(aggregate)]
    order_id: String,
    #[message(sequence)]
    seq: i64,
}

/// An order was cancelled.
#[derive(Debug, Clone, Serialize, Deserialize, Message)]
#[message(name = "order.cancelled")]
struct OrderCancelled {
    #[message(key)]
    event_id: String,
    #[message(aggregate)]
    order_id: String,
    #[message(sequence)]
    seq: i64,
}

/// Sets an order's status (and history) — the effect each event applies.
async fn set_status(
    conn: &mut SqliteConnection,
    order_id: &str,
    status: &str,
) -> Result<(), sqlx::Error> {
    sqlx::query(
        "INSERT INTO orders (id, status, history) VALUES ($1, $2, $2) \
         ON CONFLICT (id) DO UPDATE SET status = excluded.status, \
         history = orders.history || ' > ' || excluded.status",
    )
    .bind(order_id)
    .bind(status)
    .execute(conn)
    .await?;
    Ok(())
}

/// Creates the order.
#[idempotent(consumer = "orders", gaps = "park")]
async fn on_placed(conn: &mut SqliteConnection, msg: OrderPlaced) -> Result<(), sqlx::Error> {
    set_status(conn, &msg.order_id, &format!("placed by {}", msg.customer)).await
}

/// Marks it paid.
#[idempotent(consumer = "orders", gaps = "park")]
async fn on_paid(conn: &mut SqliteConnection, msg: OrderPaid) -> Result<(), sqlx::Error> {
    set_status(conn, &msg.order_id, &format!("paid {}", msg.amount_cents)).await
}

/// Marks it shipped.
#[idempotent(consumer = "orders", gaps = "park")]
async fn on_shipped(conn: &mut SqliteConnection, msg: OrderShipped) -> Result<(), sqlx::Error> {
    set_status(conn, &msg.order_id, "shipped").await
}

/// Marks it cancelled.
#[idempotent(consumer = "orders", gaps = "park")]
async fn on_cancelled(conn: &mut SqliteConnection, msg: OrderCancelled) -> Result<(), sqlx::Error> {
    set_status(conn, &msg.order_id, "cancelled").await
}

fn delivery<M: Message>(msg: &M) -> Envelope {
    Envelope::new(
        M::NAME,
        serde_json::to_vec(msg).expect("messages serialize"),
    )
}

#[tokio::main(flavor = "current_thread")]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    for (id, status, history) in run().await? {
        println!("order {id}: {status:<10} ({history})");
    }
    Ok(())
}

/// Runs the scenario, printing each delivery's outcome; returns the orders' final
/// `(id, status, history)`.
async fn run() -> Result<Vec<(String, String, String)>, Box<dyn std::error::Error>> {
    // One connection: every connection to `sqlite::memory:` would be a database of its own.
    let pool = SqlitePoolOptions::new()
        .max_connections(1)
        .connect("sqlite::memory:")
        .await?;
    inbox_runtime::migrate(&pool).await?;
    sqlx::raw_sql(
        "CREATE TABLE orders (id TEXT PRIMARY KEY, status TEXT NOT NULL, history TEXT NOT NULL)",
    )
    .execute(&pool)
    .await?;
    let dispatcher = Dispatcher::from_registry(pool.clone())?;

    let placed = |order: &str| OrderPlaced {
        event_id: format!("{order}-1"),
        order_id: order.into(),
        seq: 1,
        customer: "ada".into(),
    };
    let a_paid = OrderPaid {
        event_id: "A-2".into(),
        order_id: "A".into(),
        seq: 2,
        amount_cents: 4200,
    };
    let a_shipped = OrderShipped {
        event_id: "A-3".into(),
        order_id: "A".into(),
        seq: 3,
    };
    let b_cancelled = OrderCancelled {
        event_id: "B-2".into(),
        order_id: "B".into(),
        seq: 2,
    };
    // What the broker delivers: out of order, with redeliveries.
    let deliveries = [
        ("A shipped (3) before anything else", delivery(&a_shipped)),
        ("B cancelled (2) before B placed", delivery(&b_cancelled)),
        ("A placed (1)", delivery(&placed("A"))),
        (
            "A paid (2): fills the gap, A shipped follows",
            delivery(&a_paid),
        ),
        ("B placed (1): B cancelled follows", delivery(&placed("B"))),
        ("B placed again (redelivery)", delivery(&placed("B"))),
        ("A paid again (redelivery)", delivery(&a_paid)),
    ];
    for (what, envelope) in &deliveries {
        for outcome in dispatcher.dispatch(envelope).await? {
            let shown = match &outcome.result {
                Ok(outcome) => outcome.kind().to_owned(),
                Err(error) => format!("error: {error}"),
            };
            println!("{what:<46} -> {shown}");
        }
    }
    // An event with an old sequence but a new id: stale, not applied — B stays cancelled.
    let late = OrderPlaced {
        event_id: "B-1-replayed-by-producer".into(),
        ..placed("B")
    };
    for outcome in dispatcher.dispatch(&delivery(&late)).await? {
        let shown = outcome.result.map(|o| o.kind()).unwrap_or("error");
        println!("{:<46} -> {shown}", "B placed under a new event id (seq 1)");
    }

    println!();
    Ok(
        sqlx::query_as("SELECT id, status, history FROM orders ORDER BY id")
            .fetch_all(&pool)
            .await?,
    )
}

#[cfg(test)]
mod tests {
    #[tokio::test]
    async fn out_of_order_deliveries_end_in_the_lifecycle_order() {
        let rows = super::run().await.unwrap();
        let rows: Vec<(&str, &str, &str)> = rows
            .iter()
            .map(|(id, status, history)| (id.as_str(), status.as_str(), history.as_str()))
            .collect();
        assert_eq!(
            rows,
            [
                ("A", "shipped", "placed by ada > paid 4200 > shipped"),
                ("B", "cancelled", "placed by ada > cancelled"),
            ]
        );
    }
}
