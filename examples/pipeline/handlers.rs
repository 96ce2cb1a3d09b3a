//! The two services' handlers, one of each per backend (`#[idempotent]` takes its backend from
//! the connection type; a dispatcher routes only to its own pool's backend).
//!
//! * `orders` (consumer `orders`, key: the payment's event id) applies `payments.captured` to
//!   the order row, counts the customer's paid events (the row lock serializes a customer's
//!   payments), and publishes `orders.paid` through the [`OUTBOX`] — all in the claim's
//!   transaction: the event goes out if and only if the payment was applied, once.
//! * `shipping` (consumer `shipping`, key: the payment id, aggregate: the customer, `gaps =
//!   "park"`) applies `orders.paid`: a shipment row per order and a per-customer total. It also
//!   counts the events it applied out of sequence (`out_of_order`: an event whose sequence is not
//!   the customer's last one plus one), which the check requires to be 0.
//!
//! Both SQL texts work on both backends (each `$N` appears once, in order).

use inbox_runtime::outbox::{Outbox, OutboxError, OutboxMessage};
use inbox_runtime::{Classify, ErrorClass, idempotent};
use sqlx::{PgConnection, SqliteConnection};

use crate::messages::{OrderPaid, PaymentCaptured};

/// Where `orders.paid` goes: the RabbitMQ queue, the NATS subject, the stand-in's queue.
pub(crate) const ORDERS_DESTINATION: &str = "pipeline.orders";

/// The orders service's outbox.
pub(crate) const OUTBOX: Outbox = Outbox::new(&[ORDERS_DESTINATION]);

/// The header carrying the customer: the shipping consumer's ordering key.
pub(crate) const CUSTOMER_HEADER: &str = "customer-id";

/// Adds a payment to its order; returns the order's paid total.
const ORDER_PAID: &str = "INSERT INTO pipeline_orders (order_id, customer_id, paid_cents, payments) \
     VALUES ($1, $2, $3, 1) \
     ON CONFLICT (order_id) DO UPDATE SET \
       paid_cents = pipeline_orders.paid_cents + excluded.paid_cents, \
       payments = pipeline_orders.payments + 1 \
     RETURNING paid_cents";

/// Counts a customer's paid events (locking the customer's row until commit); returns the new
/// count, the event's sequence.
const CUSTOMER_SEQ: &str = "INSERT INTO pipeline_customers (customer_id, paid_events) VALUES ($1, 1) \
     ON CONFLICT (customer_id) DO UPDATE SET paid_events = pipeline_customers.paid_events + 1 \
     RETURNING paid_events";

/// A shipment row per order: payments seen and their sum.
const SHIPMENT: &str = "INSERT INTO pipeline_shipments (order_id, customer_id, payments, shipped_cents) \
     VALUES ($1, $2, 1, $3) \
     ON CONFLICT (order_id) DO UPDATE SET \
       payments = pipeline_shipments.payments + 1, \
       shipped_cents = pipeline_shipments.shipped_cents + excluded.shipped_cents";

/// The customer's total, last applied sequence, and how many events came out of sequence.
const CUSTOMER_TOTAL: &str = "INSERT INTO pipeline_customer_totals \
       (customer_id, events, total_cents, last_seq, out_of_order) \
     VALUES ($1, 1, $2, $3, $4) \
     ON CONFLICT (customer_id) DO UPDATE SET \
       events = pipeline_customer_totals.events + 1, \
       total_cents = pipeline_customer_totals.total_cents + excluded.total_cents, \
       out_of_order = pipeline_customer_totals.out_of_order + \
         CASE WHEN excluded.last_seq = pipeline_customer_totals.last_seq + 1 THEN 0 ELSE 1 END, \
       last_seq = excluded.last_seq";

/// Why a handler failed.
#[derive(Debug)]
pub(crate) enum PipelineError {
    /// The database failed (classified as sqlx errors are).
    Db(sqlx::Error),
    /// The outbox refused the message (bad input: permanent) or could not write it.
    Outbox(OutboxError),
}

impl std::fmt::Display for PipelineError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            PipelineError::Db(error) => error.fmt(f),
            PipelineError::Outbox(error) => error.fmt(f),
        }
    }
}

impl std::error::Error for PipelineError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            PipelineError::Db(error) => Some(error),
            PipelineError::Outbox(error) => Some(error),
        }
    }
}

impl From<sqlx::Error> for PipelineError {
    fn from(error: sqlx::Error) -> Self {
        PipelineError::Db(error)
    }
}

impl From<OutboxError> for PipelineError {
    fn from(error: OutboxError) -> Self {
        PipelineError::Outbox(error)
    }
}

impl Classify for PipelineError {
    fn class(&self) -> ErrorClass {
        match self {
            PipelineError::Db(error) => error.class(),
            PipelineError::Outbox(error) => error.class(),
        }
    }
}

/// The `orders.paid` of a payment: the customer's `seq`-th, the order now paid `order_paid`.
fn order_paid(msg: &PaymentCaptured, seq: i64, order_paid: i64) -> OutboxMessage {
    let paid = OrderPaid {
        payment_id: msg.event_id,
        order_id: msg.order_id.clone(),
        customer_id: msg.customer_id.clone(),
        seq,
        amount_cents: msg.amount_cents,
        order_paid_cents: order_paid,
    };
    // Aggregate and sequence come from the message (`#[message(aggregate)]`).
    OutboxMessage::new(ORDERS_DESTINATION, &paid).header(CUSTOMER_HEADER, &msg.customer_id)
}

/// Applies a captured payment and publishes `orders.paid` (PostgreSQL).
#[idempotent(consumer = "orders")]
async fn orders_pg(conn: &mut PgConnection, msg: PaymentCaptured) -> Result<(), PipelineError> {
    let paid: i64 = sqlx::query_scalar(ORDER_PAID)
        .bind(&msg.order_id)
        .bind(&msg.customer_id)
        .bind(msg.amount_cents)
        .fetch_one(&mut *conn)
        .await?;
    let seq: i64 = sqlx::query_scalar(CUSTOMER_SEQ)
        .bind(&msg.customer_id)
        .fetch_one(&mut *conn)
        .await?;
    OUTBOX.publish(conn, order_paid(&msg, seq, paid)).await?;
    Ok(())
}

/// Applies a captured payment and publishes `orders.paid` (SQLite).
#[idempotent(consumer = "orders")]
async fn orders_sqlite(
    conn: &mut SqliteConnection,
    msg: PaymentCaptured,
) -> Result<(), PipelineError> {
    let paid: i64 = sqlx::query_scalar(ORDER_PAID)
        .bind(&msg.order_id)
        .bind(&msg.customer_id)
        .bind(msg.amount_cents)
        .fetch_one(&mut *conn)
        .await?;
    let seq: i64 = sqlx::query_scalar(CUSTOMER_SEQ)
        .bind(&msg.customer_id)
        .fetch_one(&mut *conn)
        .await?;
    OUTBOX.publish(conn, order_paid(&msg, seq, paid)).await?;
    Ok(())
}

/// 1 if `seq` cannot follow a customer with no event yet (the upsert's insert branch).
fn first_out_of_order(seq: i64) -> i64 {
    i64::from(seq != 1)
}

/// Ships an order's payment (PostgreSQL).
#[idempotent(consumer = "shipping", gaps = "park")]
async fn shipping_pg(conn: &mut PgConnection, msg: OrderPaid) -> Result<(), PipelineError> {
    sqlx::query(SHIPMENT)
        .bind(&msg.order_id)
        .bind(&msg.customer_id)
        .bind(msg.amount_cents)
        .execute(&mut *conn)
        .await?;
    sqlx::query(CUSTOMER_TOTAL)
        .bind(&msg.customer_id)
        .bind(msg.amount_cents)
        .bind(msg.seq)
        .bind(first_out_of_order(msg.seq))
        .execute(&mut *conn)
        .await?;
    Ok(())
}

/// Ships an order's payment (SQLite).
#[idempotent(consumer = "shipping", gaps = "park")]
async fn shipping_sqlite(conn: &mut SqliteConnection, msg: OrderPaid) -> Result<(), PipelineError> {
    sqlx::query(SHIPMENT)
        .bind(&msg.order_id)
        .bind(&msg.customer_id)
        .bind(msg.amount_cents)
        .execute(&mut *conn)
        .await?;
    sqlx::query(CUSTOMER_TOTAL)
        .bind(&msg.customer_id)
        .bind(msg.amount_cents)
        .bind(msg.seq)
        .bind(first_out_of_order(msg.seq))
        .execute(&mut *conn)
        .await?;
    Ok(())
}
