//! What the README tells a new user, checked: its code compiles and runs as shown (the blocks
//! between the `README block` markers below are in README.md word for word), the handler error
//! bound it states, what becomes of a missing, null, empty or blank key, and how the `Worker`
//! settles refused deliveries and conflicts.

#![allow(missing_docs, dead_code)]

use serde::{Deserialize, Serialize};

// ---- README block: intro ----
use inbox_runtime::{Message, idempotent};

#[rustfmt::skip]
#[derive(Clone, serde::Serialize, serde::Deserialize, Message)]
#[message(name = "payments.captured")]           // routing name (default: the type name)
struct PaymentCaptured {
    #[message(key)] event_id: uuid::Uuid,         // the idempotency key
    account_id: String,
    amount_cents: i64,
}

#[rustfmt::skip]
/// Credits the captured amount to the account.
#[idempotent(consumer = "ledger")]
async fn credit(conn: &mut sqlx::PgConnection, msg: PaymentCaptured) -> Result<(), sqlx::Error> {
    sqlx::query("UPDATE accounts SET balance = balance + $1 WHERE id = $2")
        .bind(msg.amount_cents).bind(&msg.account_id)
        .execute(conn).await?;
    Ok(())
}
// ---- end README block ----

// ---- README block: worker ----
use inbox_runtime::source::memory::MemorySource;
use inbox_runtime::{CancellationToken, Dispatcher, Envelope, Worker, WorkerReport};

/// Runs a worker over an in-memory source holding one event, delivered twice.
async fn consume(pool: sqlx::PgPool) -> Result<WorkerReport, Box<dyn std::error::Error>> {
    inbox_runtime::migrate(&pool).await?;

    let source = MemorySource::new("payments"); // or FileSource, AmqpSource, NatsSource
    let queue = source.handle(); // cheap to clone; push from any task
    let event = PaymentCaptured {
        event_id: uuid::Uuid::now_v7(),
        account_id: "acct-1".into(),
        amount_cents: 500,
    };
    // An envelope carries the payload as JSON bytes: serialize the message (or a
    // serde_json::Value) with serde_json::to_vec.
    let payload: Vec<u8> = serde_json::to_vec(&event)?;
    queue.push(Envelope::new(PaymentCaptured::NAME, payload.clone()));
    queue.push(Envelope::new(PaymentCaptured::NAME, payload)); // a redelivery
    queue.close(); // no more pushes: the run ends once both are settled

    let worker = Worker::new(Dispatcher::from_registry(pool)?).concurrency(4);
    // A service passes `inbox_runtime::cancel_on_signal()?` (SIGINT/SIGTERM) instead.
    let report = worker.run(source, CancellationToken::new()).await?;
    assert_eq!(
        (report.processed, report.duplicates, report.acked),
        (1, 1, 2)
    );
    Ok(report)
}
// ---- end README block ----

// ---- README block: testing ----
use inbox_runtime::{handler, testing::Check};

#[rustfmt::skip]
/// `credit` through every scenario, on a test database: call it from your `#[tokio::test]`.
async fn credit_is_effectively_once(pool: sqlx::PgPool) -> Result<(), Box<dyn std::error::Error>> {
    sqlx::query("CREATE TABLE IF NOT EXISTS accounts (id TEXT PRIMARY KEY, balance BIGINT NOT NULL)")
        .execute(&pool).await?;
    let msg = PaymentCaptured {
        event_id: uuid::Uuid::now_v7(),
        account_id: "acct-1".into(),
        amount_cents: 500,
    };
    let report = Check::new(handler!(credit), &msg)
        .run(
            &pool,
            async |pool: &sqlx::PgPool| { // before each scenario: the state the message meets
                sqlx::query("DELETE FROM accounts").execute(pool).await?;
                sqlx::query("INSERT INTO accounts VALUES ('acct-1', 0)").execute(pool).await?;
                Ok(())
            },
            async |pool: &sqlx::PgPool| { // after each: the state to compare (any PartialEq + Debug)
                sqlx::query_scalar::<_, i64>("SELECT balance FROM accounts WHERE id = 'acct-1'")
                    .fetch_one(pool).await
            },
        )
        .await?; // Err(CheckError): the scenario that diverged, both states
    assert_eq!(report.state, 500); // what one delivery leaves: every scenario left it too
    Ok(())
}
// ---- end README block ----

/// The README's test kit example, run on PostgreSQL (a fresh database).
#[tokio::test]
async fn the_readme_test_kit_runs() {
    let pool = inbox_tests::pg_pool(4).await;
    credit_is_effectively_once(pool).await.unwrap();
}

/// The README's RabbitMQ and NATS JetStream sources, compiled.
#[rustfmt::skip]
mod brokers {
// ---- README block: brokers ----
use std::time::Duration;

use inbox_runtime::source::amqp::{AmqpConfig, AmqpSource};
use inbox_runtime::source::nats::{NatsConfig, NatsSource};
use inbox_runtime::{Dispatcher, Worker, WorkerReport};

/// RabbitMQ (feature `amqp`): a consumer on the queue `payments`, with manual acks.
async fn from_rabbitmq(pool: sqlx::PgPool) -> Result<WorkerReport, Box<dyn std::error::Error>> {
    let config = AmqpConfig::new("amqp://guest:guest@127.0.0.1:5672/%2f", "payments")
        .prefetch(32) // unacked deliveries at most
        .route("payments.captured.v1", "payments.captured"); // routing key → message name
    let worker = Worker::new(Dispatcher::from_registry(pool)?).concurrency(32);
    Ok(worker.run_until_signal(AmqpSource::connect(config).await?).await?)
}

/// NATS JetStream (feature `nats`): the durable pull consumer `ledger` of the stream `PAYMENTS`.
async fn from_nats(pool: sqlx::PgPool) -> Result<WorkerReport, Box<dyn std::error::Error>> {
    let config = NatsConfig::new("nats://127.0.0.1:4222", "PAYMENTS", "ledger")
        .ack_wait(Duration::from_secs(30)) // redelivered when not acked by then
        .max_ack_pending(32);
    let worker = Worker::new(Dispatcher::from_registry(pool)?).concurrency(32);
    Ok(worker.run_until_signal(NatsSource::connect(config).await?).await?)
}
// ---- end README block ----
}

/// The README's Kafka source, compiled.
#[rustfmt::skip]
mod kafka {
// ---- README block: kafka ----
use inbox_runtime::source::kafka::{KafkaConfig, KafkaSource};
use inbox_runtime::{Component, Dispatcher, Worker, WorkerReport};

/// Kafka (feature `kafka`): the consumer group `ledger` on the topic `payments`, its positions
/// kept in the database.
async fn from_kafka(pool: sqlx::PgPool) -> Result<WorkerReport, Box<dyn std::error::Error>> {
    inbox_runtime::migrate_components(&pool, &[Component::Inbox, Component::Positions]).await?;
    let config = KafkaConfig::new("kafka-1:9092,kafka-2:9092", "ledger", ["payments"]);
    // The source installs its position hook on the dispatcher: run the one it gives back.
    let (source, dispatcher) = KafkaSource::connect(config, Dispatcher::from_registry(pool)?).await?;
    Ok(Worker::new(dispatcher).concurrency(16).run_until_signal(source).await?)
}
// ---- end README block ----
}

/// The README's SQS source, compiled.
#[rustfmt::skip]
mod sqs {
// ---- README block: sqs ----
use std::time::Duration;

use inbox_runtime::source::sqs::{SqsConfig, SqsSource};
use inbox_runtime::{Dispatcher, Worker, WorkerReport};

/// Amazon SQS (feature `sqs`): the FIFO queue `payments.fifo`, until SIGINT or SIGTERM.
async fn from_sqs(pool: sqlx::PgPool) -> Result<WorkerReport, Box<dyn std::error::Error>> {
    let config = SqsConfig::new("payments.fifo") // a queue name or URL
        .visibility_timeout(Duration::from_secs(30)) // renewed while a delivery is in flight
        .max_processing_time(Duration::from_secs(30 * 60)) // then the renewals stop
        .max_in_flight(32);
    let worker = Worker::new(Dispatcher::from_registry(pool)?).concurrency(32);
    Ok(worker.run_until_signal(SqsSource::connect(config).await?).await?)
}
// ---- end README block ----
}

/// The README's Lambda function, compiled.
#[rustfmt::skip]
mod lambda {
// ---- README block: lambda ----
use inbox_runtime::source::lambda::LambdaSqs;
use inbox_runtime::{Dispatcher, Worker};

/// AWS Lambda (feature `lambda`): what the function's `main` awaits (after building the pool and
/// `migrate`; the binary registers its handlers), polling the Lambda runtime API for the SQS
/// event source mapping's batches and answering each with its `batchItemFailures`.
async fn lambda_main(pool: sqlx::PgPool) -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
    // Once per execution environment: every invocation reuses the worker and its pool.
    let worker = Worker::new(Dispatcher::from_registry(pool)?).concurrency(4);
    LambdaSqs::new(worker).run().await
}
// ---- end README block ----
}

/// The README's DynamoDB store, compiled.
#[rustfmt::skip]
mod dynamo {
use super::PaymentCaptured;
// ---- README block: dynamodb ----
use inbox_runtime::dynamodb::sdk::types::{AttributeValue, Update};
use inbox_runtime::dynamodb::{DynamoError, DynamoInbox};
use inbox_runtime::{Outcome, Permanent};

/// DynamoDB (feature `dynamodb`): the claim and the credit commit in one TransactWriteItems.
async fn credit_on_dynamodb(
    inbox: &DynamoInbox, // DynamoInbox::new(dynamodb::client(None).await, "inbox")
    msg: &PaymentCaptured,
) -> Result<Outcome<()>, DynamoError<Permanent>> {
    inbox
        .process("ledger", msg, |mut tx| async move {
            let credit = Update::builder()
                .table_name("accounts")
                .key("id", AttributeValue::S(msg.account_id.clone()))
                .update_expression("ADD balance :amount")
                .expression_attribute_values(":amount", AttributeValue::N(msg.amount_cents.to_string()))
                .build()
                .map_err(Permanent::new)?;
            tx.update(credit);
            Ok((tx, ()))
        })
        .await
}
// ---- end README block ----

// ---- README block: dynamodb handler ----
use inbox_runtime::dynamodb::{DynamoDispatcher, DynamoTx};
use inbox_runtime::{Envelope, idempotent};

/// On DynamoDB, `#[idempotent]` takes `&mut DynamoTx`: the handler adds its writes, the runtime
/// adds the claim and submits them as one TransactWriteItems.
#[idempotent(consumer = "ledger")]
async fn credit(tx: &mut DynamoTx, msg: PaymentCaptured) -> Result<(), Permanent> {
    let credit = Update::builder()
        .table_name("accounts")
        .key("id", AttributeValue::S(msg.account_id.clone()))
        .update_expression("ADD balance :amount")
        .expression_attribute_values(":amount", AttributeValue::N(msg.amount_cents.to_string()))
        .build()
        .map_err(Permanent::new)?;
    tx.update(credit);
    Ok(())
}

/// The rewritten `credit(&inbox, msg)`, raw deliveries by message name, a dead letter's replay.
async fn run_on_dynamodb(
    inbox: DynamoInbox,
    msg: PaymentCaptured,
    delivery: Envelope,
    dead_key: &str,
) -> Result<(), Box<dyn std::error::Error>> {
    let outcome: Outcome<()> = credit(&inbox, msg).await?; // Err: DynamoError<Permanent>
    println!("{outcome:?}");
    let dispatcher = DynamoDispatcher::from_registry(inbox)?;
    for outcome in dispatcher.dispatch(&delivery).await? {
        println!("{}: {:?}", outcome.consumer, outcome.result);
    }
    let replayed = dispatcher.replay("ledger", dead_key).await?;
    println!("{:?}", replayed.result);
    Ok(())
}
// ---- end README block ----

// ---- README block: dynamodb worker ----
use std::time::Duration;

use inbox_runtime::dynamodb::DynamoWorker;
use inbox_runtime::source::sqs::{RejectAction, SqsConfig, SqsSource};

/// A DynamoDB inbox fed by SQS outside Lambda (ECS, EC2): until SIGINT or SIGTERM.
async fn worker_on_dynamodb(inbox: DynamoInbox) -> Result<(), Box<dyn std::error::Error>> {
    let config = SqsConfig::new("payments") // give the queue a redrive policy
        .reject(RejectAction::LeaveToRedrive) // refused deliveries go to its dead-letter queue
        .max_in_flight(16);
    let worker = DynamoWorker::new(DynamoDispatcher::from_registry(inbox)?)
        .concurrency(16)
        .requeue_delay(Duration::from_secs(5));
    let report = worker.run_until_signal(SqsSource::connect(config).await?).await?;
    println!("processed {}, duplicates {}, rejected {}", report.processed, report.duplicates, report.rejected);
    Ok(())
}
// ---- end README block ----
}

/// The README's outbox: a handler that publishes, and the relay. Compiled.
#[rustfmt::skip]
mod outbox {
// ---- README block: outbox ----
use inbox_runtime::outbox::{Outbox, OutboxMessage, Relay, RelayReport};
use inbox_runtime::sink::nats::NatsSink; // feature `nats`; `sink::MemorySink` for tests
use inbox_runtime::{BoxError, CancellationToken, Component, Message, idempotent};

/// The destinations this service publishes to.
const OUTBOX: Outbox = Outbox::new(&["orders.events"]);

#[derive(Clone, serde::Serialize, serde::Deserialize, Message)]
#[message(name = "orders.payment_received")]
struct PaymentReceived {
    #[message(key)] event_id: uuid::Uuid,
    order_id: String,
}

#[derive(Clone, serde::Serialize, serde::Deserialize, Message)]
#[message(name = "orders.paid")]
struct OrderPaid {
    #[message(key)] order_id: String,
}

/// Marks the order paid and publishes `orders.paid`: both commit, or neither.
#[idempotent(consumer = "orders")]
async fn on_payment(conn: &mut sqlx::PgConnection, msg: PaymentReceived) -> Result<(), sqlx::Error> {
    sqlx::query("UPDATE orders SET paid = true WHERE id = $1")
        .bind(&msg.order_id).execute(&mut *conn).await?;
    let paid = OrderPaid { order_id: msg.order_id.clone() };
    OUTBOX.publish(conn, OutboxMessage::new("orders.events", &paid).aggregate(&msg.order_id)).await?;
    Ok(())
}

/// Sends the committed rows to NATS until `shutdown`; run it in one process or many.
async fn relay(pool: sqlx::PgPool, shutdown: CancellationToken) -> Result<RelayReport, BoxError> {
    // At start: the outbox is a schema component of its own.
    inbox_runtime::migrate_components(&pool, &[Component::Inbox, Component::Outbox]).await?;
    let sink = NatsSink::connect("nats://127.0.0.1:4222").await?;
    Ok(Relay::new(pool, sink).run(shutdown).await)
}
// ---- end README block ----
}

/// The README's HTTP API with `Idempotency-Key`, compiled; the application's own types first.
#[rustfmt::skip]
mod http_api {
#[derive(serde::Deserialize)]
struct NewPayment { account: String, amount_cents: i64 }
#[derive(serde::Serialize)]
struct Payment { id: String, account: String, amount_cents: i64 }
impl Payment {
    fn new(p: NewPayment) -> Self {
        Self { id: uuid::Uuid::now_v7().to_string(), account: p.account, amount_cents: p.amount_cents }
    }
}
#[derive(Clone)]
struct UserId(String);

// ---- README block: http ----
use axum::{Json, Router, http::StatusCode, routing::post};
use inbox_runtime::http::{IdempotencyLayer, IdempotencyTx};

/// `POST /payments`: the insert, the key and the stored response commit together.
async fn create_payment(mut tx: IdempotencyTx<sqlx::Sqlite>, Json(p): Json<NewPayment>)
    -> Result<(StatusCode, Json<Payment>), StatusCode>
{
    let payment = Payment::new(p);
    sqlx::query("INSERT INTO payments (id, account, amount_cents) VALUES ($1, $2, $3)")
        .bind(&payment.id).bind(&payment.account).bind(payment.amount_cents)
        .execute(&mut *tx).await.map_err(|_| StatusCode::INTERNAL_SERVER_ERROR)?;
    Ok((StatusCode::CREATED, Json(payment))) // stored with the key, committed with the insert
}

/// The API on a migrated pool, keys scoped by the signed-in user (`UserId`, from your auth layer).
fn payments_api(pool: sqlx::SqlitePool) -> Router {
    Router::new()
        .route("/payments", post(create_payment))
        .route_layer(IdempotencyLayer::new(pool)
            .principal(|parts| parts.extensions.get::<UserId>().map(|u| u.0.clone())))
}
// ---- end README block ----
}

/// The README's Idempotency-Key layer on DynamoDB, compiled.
#[rustfmt::skip]
mod http_dynamodb {
// ---- README block: http-dynamodb ----
use axum::{Router, http::StatusCode, routing::post};
use inbox_runtime::dynamodb::{DynamoInbox, sdk::types::{AttributeValue, Update}};
use inbox_runtime::http::{DynamoIdempotencyLayer, DynamoIdempotencyTx};

/// `POST /accounts/acct-1/credits`: the update, the key and the stored response in one
/// TransactWriteItems.
async fn credit(mut tx: DynamoIdempotencyTx) -> Result<StatusCode, StatusCode> {
    let update = Update::builder().table_name("accounts")
        .key("id", AttributeValue::S("acct-1".into()))
        .update_expression("ADD balance :amount")
        .expression_attribute_values(":amount", AttributeValue::N("500".into()))
        .build().map_err(|_| StatusCode::INTERNAL_SERVER_ERROR)?;
    tx.update(update);
    Ok(StatusCode::CREATED)
}

fn credits_api(inbox: DynamoInbox) -> Router {
    Router::new()
        .route("/accounts/acct-1/credits", post(credit))
        .route_layer(DynamoIdempotencyLayer::new(inbox)) // lease 30 s, keys kept 7 days
}
// ---- end README block ----
}

/// The README's step key for a call to a payment provider, compiled; the message, the error
/// and a stand-in for the provider's client first.
#[rustfmt::skip]
mod step_keys {
#[derive(Clone, serde::Serialize, serde::Deserialize, inbox_runtime::Message)]
#[message(name = "shop.order_placed")]
struct OrderPlaced { #[message(key)] order_id: String, amount_cents: i64 }

#[derive(Debug, thiserror::Error)]
enum BillingError {
    #[error(transparent)]
    Database(#[from] sqlx::Error),
}

mod provider {
    pub(super) struct Charge { pub(super) id: String }
    pub(super) async fn charge(order_id: &str, _amount_cents: i64, idempotency_key: &str) -> Result<Charge, super::BillingError> {
        Ok(Charge { id: format!("ch-{order_id}-{idempotency_key}") })
    }
}

// ---- README block: step-key ----
use inbox_runtime::{types::StepKey, idempotent};

/// Charges the order once, however often it runs: the provider deduplicates on the step key.
#[idempotent(consumer = "billing")]
async fn charge(conn: &mut sqlx::PgConnection, msg: OrderPlaced) -> Result<(), BillingError> {
    let key = StepKey::current("charge").expect("inside a handler"); // the same on every run
    let charge = provider::charge(&msg.order_id, msg.amount_cents, &key.to_string()).await?;
    sqlx::query("INSERT INTO charges (order_id, charge_id) VALUES ($1, $2)")
        .bind(&msg.order_id).bind(&charge.id).execute(conn).await?;
    Ok(())
}
// ---- end README block ----
}

/// The README's dedupe cache, compiled.
#[rustfmt::skip]
mod cache {
// ---- README block: cache ----
use std::time::Duration;

use inbox_runtime::{Dispatcher, cache::MemoryCache, ops::admin::Retention};

/// The registered handlers behind an in-process cache of at most a million settled keys.
fn cached(pool: sqlx::PgPool) -> Result<Dispatcher<sqlx::Postgres>, Box<dyn std::error::Error>> {
    let retention = Retention::new(Duration::from_secs(7 * 86_400), Duration::from_secs(3600))?;
    let cache = MemoryCache::new(1_000_000, Duration::from_secs(3600)); // entries, time to live
    // or one cache shared by every worker (feature `redis`):
    // let cache = RedisCache::connect("redis://127.0.0.1:6379/", ttl).await?;
    Ok(Dispatcher::from_registry(pool)?.with_cache(cache, &retention)?)
}
// ---- end README block ----
}

/// The README's operator console, compiled.
#[rustfmt::skip]
mod console {
// ---- README block: console ----
use inbox_runtime::Dispatcher;
use inbox_runtime::ops::console::{Console, ConsoleError, Refusal};

/// The console under `/ops`, for requests that carry the operators' bearer token.
fn ops(dispatcher: Dispatcher<sqlx::Postgres>) -> Result<axum::Router, ConsoleError> {
    let console = Console::new(dispatcher) // a Dispatcher, or the Arc your worker uses
        .authorize(|parts| match parts.headers.get("authorization").and_then(|v| v.to_str().ok()) {
            Some("Bearer s3cret") => Ok("alice".to_owned()),     // the operator's name, logged
            Some(_) => Err(Refusal::forbidden("unknown token")), // 403
            None => Err(Refusal::unauthenticated("Bearer")),     // 401 + WWW-Authenticate
        })
        .build()?; // no authorization, no console
    Ok(axum::Router::new().nest("/ops", console)) // any prefix: links follow it
}
// ---- end README block ----
}

/// The README's PostgreSQL schema, compiled.
#[rustfmt::skip]
#[allow(dead_code)]
mod schema {
// ---- README block: schema ----
use inbox_runtime::PgSchema;
use sqlx::postgres::{PgConnectOptions, PgPool, PgPoolOptions};

/// The billing service's pool: its inbox in the schema `billing` (`migrate_components` adds the
/// outbox and positions there).
async fn billing_pool(url: &str) -> Result<PgPool, Box<dyn std::error::Error>> {
    let schema = PgSchema::new("billing")?; // checked: letters, digits, '_'; quoted in SQL
    let options: PgConnectOptions = url.parse()?;
    let pool = PgPoolOptions::new()
        .connect_with(schema.connect_options(options)) // search_path "billing", alone
        .await?;
    schema.create(&pool).await?; // CREATE SCHEMA IF NOT EXISTS "billing"
    inbox_runtime::migrate(&pool).await?; // billing.inbox_messages, …
    Ok(pool)
}
// ---- end README block ----
}

/// The README's table prefix (MySQL/MariaDB, SQLite), compiled.
#[rustfmt::skip]
#[allow(dead_code)]
mod prefix {
// ---- README block: prefix ----
use inbox_runtime::store::TablePrefix;
use inbox_runtime::{Component, Dispatcher, Relay, Worker};
use inbox_runtime::{CancellationToken, sink::Sink, source::Source};

/// The billing service, on a MySQL/MariaDB database it shares with other services: every table
/// of the runtime under `billing_` (`billing_inbox_messages`, `billing_inbox_outbox`, …).
async fn billing(
    pool: sqlx::MySqlPool,
    source: impl Source,
    sink: impl Sink,
    shutdown: CancellationToken,
) -> Result<(), Box<dyn std::error::Error>> {
    let prefix = TablePrefix::new("billing_")?; // checked: a-z, 0-9, '_', at most 30 bytes
    prefix.scope(async move {
        inbox_runtime::migrate_components(&pool, &[Component::Inbox, Component::Outbox]).await?;
        // Built in the scope, they keep the prefix, on tasks of their own too.
        let relay = tokio::spawn(Relay::new(pool.clone(), sink).run(shutdown.clone()));
        Worker::new(Dispatcher::from_registry(pool)?).run(source, shutdown).await?;
        relay.await?;
        Ok(())
    }).await
}
// ---- end README block ----
}

/// The README's retention read from a configuration file, compiled and run.
#[rustfmt::skip]
mod retention {
// ---- README block: retention ----
use inbox_runtime::ops::admin::Retention;

/// A retention from a configuration file: checked as `Retention::new` checks it.
fn from_config() -> Result<Retention, serde_json::Error> {
    let retention: Retention =
        serde_json::from_str(r#"{"window": "7d", "redelivery_horizon": "3d", "batch_size": 500}"#)?;
    assert_eq!(retention.get_batch_size(), 500);
    let refused = serde_json::from_str::<Retention>(r#"{"window": "1d", "redelivery_horizon": "3d"}"#);
    assert_eq!(
        refused.unwrap_err().to_string(),
        "retention window of 1d is shorter than the redelivery horizon of 3d: \
         redeliveries after the window would be processed again"
    );
    Ok(retention)
}
// ---- end README block ----

#[test]
fn the_readme_retention_is_checked() {
    let retention = from_config().unwrap();
    assert_eq!(retention.window(), std::time::Duration::from_secs(7 * 86_400));
    assert_eq!(retention.redelivery_horizon(), std::time::Duration::from_secs(3 * 86_400));
}
}

/// The README's tracing subscriber (feature `otel`), compiled and installed.
#[rustfmt::skip]
mod tracing_otel {
// ---- README block: tracing ----
use opentelemetry::trace::TracerProvider as _;
use opentelemetry_sdk::trace::{SdkTracerProvider, SpanExporter};
use tracing_subscriber::layer::SubscriberExt as _;

/// `tracing` spans exported as OpenTelemetry spans by `exporter` (OTLP, stdout, in memory…).
fn install(exporter: impl SpanExporter + 'static) -> SdkTracerProvider {
    let provider = SdkTracerProvider::builder().with_simple_exporter(exporter).build();
    let layer = tracing_opentelemetry::layer().with_tracer(provider.tracer("orders"));
    tracing::subscriber::set_global_default(tracing_subscriber::registry().with(layer))
        .expect("no other global subscriber");
    provider // keep it: dropping its last clone shuts the exporter down
}
// ---- end README block ----

#[test]
fn the_readme_subscriber_exports_spans() {
    use opentelemetry::trace::TraceContextExt as _;
    use tracing_opentelemetry::OpenTelemetrySpanExt as _;
    let exporter = opentelemetry_sdk::trace::InMemorySpanExporter::default();
    let _provider = install(exporter.clone());
    let span = tracing::info_span!("readme.span");
    assert!(span.context().span().span_context().is_valid());
    drop(span);
    // The other tests of this binary may export their spans too: count this one.
    let spans = exporter.get_finished_spans().unwrap();
    assert_eq!(spans.iter().filter(|s| s.name == "readme.span").count(), 1);
}
}

/// The blocks of this file marked `README block`, without `#[rustfmt::skip]` lines.
fn blocks() -> Vec<(String, String)> {
    let source = include_str!("readme.rs");
    let mut blocks = Vec::new();
    let mut current: Option<(String, Vec<&str>)> = None;
    for line in source.lines() {
        if let Some(name) = line.strip_prefix("// ---- README block: ") {
            current = Some((name.trim_end_matches(" ----").to_owned(), Vec::new()));
        } else if line == "// ---- end README block ----" {
            let (name, lines) = current.take().expect("a block was open");
            blocks.push((name, lines.join("\n") + "\n"));
        } else if let Some((_, lines)) = &mut current
            && line != "#[rustfmt::skip]"
        {
            lines.push(line);
        }
    }
    blocks
}

#[test]
fn the_readme_shows_these_blocks_word_for_word() {
    let readme = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../README.md"))
        .expect("read README.md");
    let blocks = blocks();
    assert_eq!(blocks.len(), 20);
    for (name, text) in blocks {
        let fenced = format!("```rust\n{text}```\n");
        assert!(
            readme.contains(&fenced),
            "README.md lacks the block `{name}`, word for word:\n{fenced}"
        );
    }
}

/// Every Rust block of the README is one of this file's blocks: none goes uncompiled.
#[test]
fn every_rust_block_of_the_readme_is_compiled_here() {
    let readme = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../README.md"))
        .expect("read README.md");
    let compiled: Vec<String> = blocks().into_iter().map(|(_, text)| text).collect();
    let mut fenced = Vec::new();
    let mut current: Option<Vec<&str>> = None;
    for line in readme.lines() {
        match &mut current {
            None if line.trim_start().starts_with("```rust") => current = Some(Vec::new()),
            None => {}
            Some(lines) if line.trim_start() == "```" => {
                fenced.push(lines.join("\n") + "\n");
                current = None;
            }
            Some(lines) => lines.push(line),
        }
    }
    assert_eq!(
        fenced.len(),
        compiled.len(),
        "Rust blocks in README.md vs. compiled here"
    );
    for block in fenced {
        assert!(
            compiled.contains(&block),
            "README.md shows a Rust block that tests/readme.rs does not compile:\n{block}"
        );
    }
}

/// The README's worker, run on PostgreSQL: the event credits the account once.
#[tokio::test]
async fn the_readme_worker_runs() {
    let pool = inbox_tests::pg_pool(5).await;
    sqlx::raw_sql(
        "CREATE TABLE accounts (id TEXT PRIMARY KEY, balance BIGINT NOT NULL);\
         INSERT INTO accounts VALUES ('acct-1', 0)",
    )
    .execute(&pool)
    .await
    .unwrap();
    let report = consume(pool.clone()).await.unwrap();
    assert_eq!(report.deliveries, 2);
    let balance: i64 = sqlx::query_scalar("SELECT balance FROM accounts WHERE id = 'acct-1'")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(balance, 500);
}

/// A message keyed by a string field.
#[derive(Debug, Clone, Serialize, Deserialize, Message)]
#[message(name = "nu.field")]
pub struct FieldKey {
    #[message(key)]
    pub id: String,
    pub amount: i64,
}

/// A message keyed by a template of two fields.
#[derive(Debug, Clone, Serialize, Deserialize, Message)]
#[message(name = "nu.template", key = "pay:{region}:{seq}")]
pub struct TemplateKey {
    pub region: String,
    pub seq: u64,
}

/// A message keyed by a UUID field (not an `Option`).
#[derive(Debug, Clone, Serialize, Deserialize, Message)]
#[message(name = "orders.placed")]
pub struct UuidKey {
    #[message(key)]
    pub event_id: uuid::Uuid,
}

/// A message keyed by an optional field.
#[derive(Debug, Clone, Serialize, Deserialize, Message)]
#[message(name = "orders.tagged")]
pub struct OptionKey {
    #[message(key)]
    pub id: Option<String>,
}

/// A message whose handlers fail with plain strings when asked to.
#[derive(Debug, Clone, Serialize, Deserialize, Message)]
#[message(name = "nu.plain")]
pub struct Plain {
    #[message(key)]
    pub id: String,
    pub fail: bool,
}

fn raw(name: &str, json: &str) -> Envelope {
    Envelope::new(name, json.as_bytes().to_vec())
}

/// Through the derive, without a database: whitespace-only keys are refused like empty ones.
#[test]
fn blank_keys_through_the_derive() {
    use inbox_runtime::KeyError;
    for blank in [" ", "\t", "\u{a0}", " \n "] {
        let field = FieldKey {
            id: blank.into(),
            amount: 1,
        };
        assert_eq!(
            field.idempotency_key(),
            Err(KeyError::Blank {
                message: "nu.field",
                field: "id"
            })
        );
        let template = TemplateKey {
            region: blank.into(),
            seq: 1,
        };
        assert_eq!(
            template.idempotency_key(),
            Err(KeyError::Blank {
                message: "nu.template",
                field: "region"
            })
        );
    }
    let padded = TemplateKey {
        region: " eu".into(),
        seq: 7,
    };
    assert_eq!(padded.idempotency_key().unwrap().as_str(), "pay: eu:7");
    assert_eq!(
        FieldKey {
            id: "".into(),
            amount: 1
        }
        .idempotency_key(),
        Err(KeyError::Empty {
            message: "nu.field",
            field: "id"
        })
    );
}

inbox_tests::backend_matrix! {
    use std::time::Duration;

    use inbox_runtime::source::Settlement;
    use inbox_runtime::{
        DispatchError, Disposition, Error, ErrorClass, KeyError, Outcome, handler,
    };
    use inbox_tests::{count, inbox_row};

    #[inbox_runtime::idempotent(consumer = "keys")]
    async fn by_field(_conn: &mut Conn, _msg: FieldKey) -> Result<(), sqlx::Error> {
        Ok(())
    }

    #[inbox_runtime::idempotent(consumer = "keys")]
    async fn by_template(_conn: &mut Conn, _msg: TemplateKey) -> Result<(), sqlx::Error> {
        Ok(())
    }

    #[inbox_runtime::idempotent(consumer = "keys")]
    async fn by_uuid(_conn: &mut Conn, _msg: UuidKey) -> Result<(), sqlx::Error> {
        Ok(())
    }

    #[inbox_runtime::idempotent(consumer = "keys")]
    async fn by_option(_conn: &mut Conn, _msg: OptionKey) -> Result<(), sqlx::Error> {
        Ok(())
    }

    /// A handler whose error type is a plain `String`.
    #[inbox_runtime::idempotent(consumer = "strings")]
    async fn fails_with_string(_conn: &mut Conn, msg: Plain) -> Result<(), String> {
        if msg.fail {
            return Err(format!("account {} is closed", msg.id));
        }
        Ok(())
    }

    /// A handler whose error type is `&'static str`.
    #[inbox_runtime::idempotent(consumer = "strs")]
    async fn fails_with_str(_conn: &mut Conn, msg: Plain) -> Result<(), &'static str> {
        if msg.fail {
            return Err("account closed");
        }
        Ok(())
    }

    fn dispatcher(pool: Pool) -> Dispatcher<Db> {
        Dispatcher::from_handlers(
            pool,
            [
                handler!(by_field),
                handler!(by_template),
                handler!(by_uuid),
                handler!(by_option),
                handler!(fails_with_string),
                handler!(fails_with_str),
            ],
        )
        .expect("handlers")
    }

    /// The text of the dispatcher's refusal of `envelope`.
    async fn refusal(dispatcher: &Dispatcher<Db>, envelope: &Envelope) -> DispatchError {
        match dispatcher.dispatch(envelope).await {
            Err(error) => error,
            Ok(outcomes) => panic!("not refused: {:?}", outcomes[0].result),
        }
    }

    /// Missing and null keys: a malformed payload for a key field that is not an `Option`, a
    /// key error for one that is; empty and blank keys are key errors. Exact texts.
    #[tokio::test]
    async fn missing_null_empty_and_blank_keys() {
        let (pool, _guard) = fixture().await;
        let dispatcher = dispatcher(pool);

        let missing = refusal(&dispatcher, &raw("orders.placed", "{}")).await;
        assert!(matches!(missing, DispatchError::Decode { line: 1, column: 2, .. }), "{missing:?}");
        // (serde_json's own text may repeat the position after this; not asserted.)
        let text = missing.to_string();
        assert!(
            text.starts_with(
                "malformed payload for message `orders.placed` at line 1, column 2: \
                 missing field `event_id`"
            ),
            "{text}"
        );
        let null = refusal(&dispatcher, &raw("orders.placed", r#"{"event_id":null}"#)).await;
        assert!(matches!(null, DispatchError::Decode { .. }), "{null:?}");
        let text = null.to_string();
        assert!(
            text.starts_with(
                "malformed payload for message `orders.placed` at line 1, column 16: \
                 invalid type: null, expected a formatted UUID string"
            ),
            "{text}"
        );

        for json in [r#"{"id":null}"#, "{}"] {
            let error = refusal(&dispatcher, &raw("orders.tagged", json)).await;
            assert!(
                matches!(
                    error,
                    DispatchError::Key {
                        consumer: "keys",
                        source: KeyError::Null { message: "orders.tagged", field: "id" }
                    }
                ),
                "{json}: {error:?}"
            );
            assert_eq!(
                error.to_string(),
                "consumer `keys`: message `orders.tagged`: idempotency key field `id` is null"
            );
        }

        let empty = refusal(&dispatcher, &raw("nu.field", r#"{"id":"","amount":1}"#)).await;
        assert_eq!(
            empty.to_string(),
            "consumer `keys`: message `nu.field`: idempotency key field `id` is empty"
        );
        for json in [r#"{"id":" ","amount":1}"#, r#"{"id":"\t\n\u00a0","amount":1}"#] {
            let blank = refusal(&dispatcher, &raw("nu.field", json)).await;
            assert!(
                matches!(
                    blank,
                    DispatchError::Key {
                        consumer: "keys",
                        source: KeyError::Blank { message: "nu.field", field: "id" }
                    }
                ),
                "{json}: {blank:?}"
            );
            assert_eq!(
                blank.to_string(),
                "consumer `keys`: message `nu.field`: idempotency key field `id` is blank \
                 (whitespace only)"
            );
        }
        let blank = refusal(&dispatcher, &raw("nu.template", r#"{"region":"  ","seq":1}"#)).await;
        assert_eq!(
            blank.to_string(),
            "consumer `keys`: message `nu.template`: idempotency key field `region` is blank \
             (whitespace only)"
        );
        // Whitespace around other characters is part of the key.
        let padded = dispatcher.dispatch(&raw("nu.field", r#"{"id":" a ","amount":1}"#)).await;
        assert!(matches!(padded.unwrap()[0].result, Ok(Outcome::Processed(()))));
    }

    /// The handler's error type needs `Display + Send + 'static` and a conversion into
    /// `BoxError`: a `String` or a `&'static str` does. Such errors have no class of their own:
    /// retryable, recorded `failed` with their text.
    #[tokio::test]
    async fn string_errors_are_handler_errors() {
        let (pool, _guard) = fixture().await;
        let dispatcher = dispatcher(pool.clone());
        let outcomes = dispatcher
            .dispatch(&raw("nu.plain", r#"{"id":"p-1","fail":true}"#))
            .await
            .unwrap();
        assert_eq!(outcomes.len(), 2);
        for outcome in &outcomes {
            let Err(Error::Handler(failure)) = &outcome.result else {
                panic!("{}: {:?}", outcome.consumer, outcome.result);
            };
            assert_eq!(failure.class, ErrorClass::Retryable);
            assert!(matches!(failure.disposition, Disposition::Retry { .. }));
            let text = match outcome.consumer {
                "strings" => "account p-1 is closed",
                _ => "account closed",
            };
            assert_eq!(failure.error.to_string(), text);
            assert_eq!(
                inbox_row(&pool, outcome.consumer, "p-1").await,
                Some(("failed".to_owned(), 1))
            );
        }
        // The text is what the inbox keeps as the last error.
        let last_error: String = sqlx::query_scalar(
            sql("SELECT last_error FROM inbox_messages WHERE consumer = 'strings' AND message_key = 'p-1'"),
        )
        .fetch_one(&pool)
        .await
        .unwrap();
        assert_eq!(last_error, "retryable error: account p-1 is closed");
        let ok = dispatcher.dispatch(&raw("nu.plain", r#"{"id":"p-2","fail":false}"#)).await;
        assert!(ok.unwrap().iter().all(|o| matches!(o.result, Ok(Outcome::Processed(())))));
    }

    /// The Worker keeps every refused delivery in `inbox_rejections` and then **acks** it (it is
    /// kept: nothing is lost, and a broker would only redeliver it in vain); a conflict is kept
    /// there too, by the dispatcher, and the delivery **rejected** (nack without requeue).
    #[tokio::test]
    async fn the_worker_acks_refused_deliveries_and_rejects_conflicts() {
        let (pool, _guard) = fixture().await;
        let worker = Worker::new(dispatcher(pool.clone()))
            .concurrency(1)
            .requeue_delay(Duration::from_millis(10));
        let source = MemorySource::new("test");
        let queue = source.handle();
        let deliveries = [
            raw("nu.field", r#"{"id":"a","amount":1}"#),  // 0 processed: ack
            raw("nu.field", r#"{"id":"a","amount":2}"#),  // 1 conflict: reject
            raw("nu.field", r#"{"id":"a","amount":1}"#),  // 2 duplicate: ack
            raw("orders.placed", "{}"),                          // 3 malformed: ack
            raw("nu.field", r#"{"id":" ","amount":1}"#),  // 4 blank key: ack
            raw("orders.tagged", r#"{"id":null}"#),            // 5 null key: ack
            raw("nu.unknown", "{}"),                       // 6 unknown message: ack
            raw("", "not json"),                           // 7 no message name: ack
        ];
        for envelope in deliveries {
            queue.push(envelope);
        }
        queue.close();
        let report = worker.run(source, CancellationToken::new()).await.unwrap();
        let mut settled = queue.settlements();
        settled.sort_by_key(|(id, _)| *id);
        let reject = Settlement::Reject;
        let ack = Settlement::Ack;
        assert_eq!(
            settled,
            [(0, ack), (1, reject), (2, ack), (3, ack), (4, ack), (5, ack), (6, ack), (7, ack)]
        );
        assert_eq!(
            (report.processed, report.duplicates, report.conflicts, report.invalid),
            (1, 1, 1, 5)
        );
        assert_eq!((report.acked, report.rejected), (7, 1));
        let reasons = [
            ("SELECT COUNT(*) FROM inbox_rejections WHERE reason = 'conflict'", 1),
            ("SELECT COUNT(*) FROM inbox_rejections WHERE reason = 'malformed'", 2),
            ("SELECT COUNT(*) FROM inbox_rejections WHERE reason = 'invalid_key'", 2),
            ("SELECT COUNT(*) FROM inbox_rejections WHERE reason = 'unknown_message'", 1),
        ];
        for (sql, expected) in reasons {
            assert_eq!(count(&pool, sql).await, expected, "{sql}");
        }
    }
}
