//! W3C Trace Context propagation (feature `otel`) with OpenTelemetry's SDK and its in-memory
//! exporter behind a `tracing` subscriber with the tracing-opentelemetry layer: one trace from
//! an HTTP request through its handler, the outbox row, the relay and NATS JetStream (NATS_URL)
//! to the consumer's handler, on PostgreSQL, with every span's exact name and parent; the
//! broker hop on RabbitMQ (AMQP_URL), Kafka (librdkafka's mock cluster) and SQS (SQS_ENDPOINT);
//! the outbox row → headers hop on SQLite and MariaDB (MYSQL_URL); a batch's span linked to each
//! of its deliveries' traces; a malformed `traceparent` ignored (a new trace, the delivery
//! processed, the request served).
#![allow(missing_docs)]

use std::collections::BTreeMap;
use std::sync::{Mutex, OnceLock};
use std::time::Duration;

use axum::http::StatusCode;
use axum::routing::post;
use axum::{Json, Router};
use inbox_runtime::http::{IdempotencyLayer, IdempotencyTx};
use inbox_runtime::outbox::{Outbox, OutboxMessage, Relay};
use inbox_runtime::store::Component;
use inbox_runtime::{Dispatcher, Envelope, Message as _, idempotent};
use opentelemetry::trace::{SpanId, TraceContextExt as _, TraceId, TracerProvider as _};
use opentelemetry_sdk::trace::{InMemorySpanExporter, SdkTracerProvider, SpanData};
use sqlx::{PgConnection, PgPool, Postgres};
use tracing_opentelemetry::OpenTelemetrySpanExt as _;
use tracing_subscriber::layer::SubscriberExt as _;

/// The subject the HTTP handler publishes to, and the stream that holds it.
const SUBJECT: &str = "inbox-trace-test.orders";
const STREAM: &str = "INBOX_TRACE_TEST";
const OUTBOX: Outbox = Outbox::new(&[SUBJECT]);

/// An order, placed over HTTP and shipped downstream.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize, inbox_runtime::Message)]
#[message(name = "trace.orders.placed")]
struct OrderPlaced {
    #[message(key)]
    order_id: String,
    amount: i64,
}

/// The trace id each run of the downstream handler saw in its own span, by order id.
static SEEN: Mutex<BTreeMap<String, TraceId>> = Mutex::new(BTreeMap::new());

/// The downstream consumer: applies the order's effect and notes its span's trace id.
#[idempotent(consumer = "trace-shipping")]
async fn ship(conn: &mut PgConnection, msg: OrderPlaced) -> Result<(), sqlx::Error> {
    let trace_id = tracing::Span::current()
        .context()
        .span()
        .span_context()
        .trace_id();
    SEEN.lock().unwrap().insert(msg.order_id.clone(), trace_id);
    sqlx::query(inbox_tests::APPLY_EFFECT)
        .bind(&msg.order_id)
        .bind(msg.amount)
        .execute(conn)
        .await?;
    Ok(())
}

/// `POST /orders`: publishes the order through the outbox on the request's transaction, in the
/// handler's own span `orders.place`.
#[tracing::instrument(name = "orders.place", skip_all)]
async fn place(mut tx: IdempotencyTx<Postgres>, Json(order): Json<OrderPlaced>) -> StatusCode {
    OUTBOX
        .publish(&mut *tx, OutboxMessage::new(SUBJECT, &order))
        .await
        .expect("the outbox row");
    StatusCode::CREATED
}

/// The in-memory exporter behind the process's global subscriber (installed once).
fn exporter() -> &'static InMemorySpanExporter {
    static EXPORTER: OnceLock<InMemorySpanExporter> = OnceLock::new();
    EXPORTER.get_or_init(|| {
        let exporter = InMemorySpanExporter::default();
        let provider = SdkTracerProvider::builder()
            .with_simple_exporter(exporter.clone())
            .build();
        let subscriber = tracing_subscriber::registry()
            .with(tracing_opentelemetry::layer().with_tracer(provider.tracer("inbox-tests")));
        tracing::subscriber::set_global_default(subscriber).expect("the only subscriber");
        exporter
    })
}

/// The finished spans of trace `trace_id`.
fn spans_of(trace_id: TraceId) -> Vec<SpanData> {
    exporter()
        .get_finished_spans()
        .unwrap()
        .into_iter()
        .filter(|span| span.span_context.trace_id() == trace_id)
        .collect()
}

/// The value of a span's attribute `key` (a `tracing` field), as text.
fn attribute(span: &SpanData, key: &str) -> Option<String> {
    span.attributes
        .iter()
        .find(|kv| kv.key.as_str() == key)
        .map(|kv| kv.value.as_str().into_owned())
}

/// A fresh random trace id and span id, as a sampled W3C `traceparent`.
fn remote_parent() -> (TraceId, SpanId, String) {
    let trace = uuid::Uuid::new_v4().simple().to_string();
    let span = &uuid::Uuid::new_v4().simple().to_string()[..16];
    let header = format!("00-{trace}-{span}-01");
    (
        TraceId::from_hex(&trace).unwrap(),
        SpanId::from_hex(span).unwrap(),
        header,
    )
}

async fn pool() -> PgPool {
    let pool = inbox_tests::pg_pool(6).await;
    inbox_runtime::migrate_components(&pool, &[Component::Inbox, Component::Outbox])
        .await
        .unwrap();
    pool
}

/// HTTP request → `inbox.http` → `orders.place` (publishes) → the relay's
/// `inbox.outbox.publish` → NATS JetStream → the consumer's `inbox.message`: one trace, each
/// span the child of the one before.
#[tokio::test]
async fn one_trace_from_the_http_request_to_the_downstream_handler() {
    use async_nats::jetstream::{self, stream};
    use inbox_runtime::sink::nats::NatsSink;
    use inbox_runtime::source::Source as _;
    use inbox_runtime::source::nats::{NatsConfig, NatsSource};

    exporter();
    let pool = pool().await;
    let url = std::env::var("NATS_URL").expect("NATS_URL (scripts/brokers.sh) is set");
    let context = jetstream::new(async_nats::connect(&url).await.unwrap());
    let _ = context.delete_stream(STREAM).await;
    context
        .create_stream(stream::Config {
            name: STREAM.into(),
            subjects: vec![SUBJECT.into()],
            duplicate_window: Duration::from_secs(120),
            ..Default::default()
        })
        .await
        .unwrap();

    // Hop 1: the request, with the client's trace context.
    let app = Router::new()
        .route("/orders", post(place))
        .route_layer(IdempotencyLayer::new(pool.clone()));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let server = tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    let (trace_id, client_span, traceparent) = remote_parent();
    let response = reqwest::Client::new()
        .post(format!("http://{addr}/orders"))
        .header("content-type", "application/json")
        .header("idempotency-key", "\"order-1\"")
        .header("traceparent", &traceparent)
        .header("tracestate", "inbox=t1")
        .body(r#"{"order_id": "order-1", "amount": 250}"#)
        .send()
        .await
        .unwrap();
    assert_eq!(response.status().as_u16(), 201);
    server.abort();

    // Hop 2: the outbox row holds the handler's span context.
    let stored: Option<String> = sqlx::query_scalar("SELECT trace_context FROM inbox_outbox")
        .fetch_one(&pool)
        .await
        .unwrap();
    let stored: BTreeMap<String, String> = serde_json::from_str(&stored.unwrap()).unwrap();

    // Hop 3: the relay sends it to NATS.
    let relay = Relay::new(pool.clone(), NatsSink::new(context.clone()));
    let mut published = 0;
    for _ in 0..100 {
        published += relay.run_once().await.unwrap().published;
        if published == 1 {
            break;
        }
    }
    assert_eq!(published, 1);

    // Hop 4: the downstream consumer reads it and runs its handler.
    let dispatcher = Dispatcher::from_registry(pool.clone()).unwrap();
    let mut source = NatsSource::connect(NatsConfig::new(url, STREAM, "shipping"))
        .await
        .unwrap();
    let delivery = tokio::time::timeout(Duration::from_secs(10), source.next())
        .await
        .unwrap()
        .unwrap()
        .unwrap();
    let headers = delivery.envelope().headers.clone();
    let outcomes = dispatcher.dispatch(delivery.envelope()).await.unwrap();
    assert_eq!(inbox_tests::outcome_kinds(&outcomes), [Ok("processed")]);
    delivery.ack().await.unwrap();
    let _ = context.delete_stream(STREAM).await;

    let spans = spans_of(trace_id);
    let named = |name: &str| -> &SpanData {
        let found: Vec<&SpanData> = spans.iter().filter(|s| s.name == name).collect();
        assert_eq!(found.len(), 1, "one span {name} in the trace: {spans:#?}");
        found[0]
    };
    let http = named("inbox.http");
    let place = named("orders.place");
    let relayed = named("inbox.outbox.publish");
    let handled = named("inbox.message");
    let mut names: Vec<&str> = spans.iter().map(|s| &*s.name).collect();
    names.sort_unstable();
    assert_eq!(
        names,
        [
            "inbox.http",
            "inbox.message",
            "inbox.outbox.publish",
            "orders.place"
        ]
    );
    // The chain: client → inbox.http → orders.place → inbox.outbox.publish → inbox.message.
    assert_eq!(http.parent_span_id, client_span);
    assert!(http.parent_span_is_remote);
    assert_eq!(http.span_context.trace_state().header(), "inbox=t1");
    assert_eq!(place.parent_span_id, http.span_context.span_id());
    assert_eq!(relayed.parent_span_id, place.span_context.span_id());
    assert!(
        relayed.parent_span_is_remote,
        "continued from the stored row"
    );
    assert_eq!(handled.parent_span_id, relayed.span_context.span_id());
    assert!(
        handled.parent_span_is_remote,
        "continued from the NATS headers"
    );
    assert_eq!(
        attribute(handled, "consumer").as_deref(),
        Some("trace-shipping")
    );
    assert_eq!(attribute(handled, "key").as_deref(), Some("order-1"));
    assert_eq!(attribute(handled, "outcome").as_deref(), Some("processed"));
    // What travelled: the row holds orders.place's context, the NATS headers the relay's.
    assert_eq!(
        stored,
        BTreeMap::from([
            (
                "traceparent".to_owned(),
                format!("00-{trace_id}-{}-01", place.span_context.span_id())
            ),
            ("tracestate".to_owned(), "inbox=t1".to_owned()),
        ])
    );
    assert_eq!(
        headers.get("traceparent"),
        Some(&format!(
            "00-{trace_id}-{}-01",
            relayed.span_context.span_id()
        ))
    );
    assert_eq!(
        headers.get("tracestate").map(String::as_str),
        Some("inbox=t1")
    );
    // The handler ran in that trace, once.
    assert_eq!(SEEN.lock().unwrap().get("order-1"), Some(&trace_id));
    let applied: i64 =
        sqlx::query_scalar("SELECT applied FROM effects WHERE effect_key = 'order-1'")
            .fetch_one(&pool)
            .await
            .unwrap();
    assert_eq!(applied, 1);
}

/// A batch transaction serves deliveries of several traces: its span `inbox.batch` is linked to
/// each, and is the child of none.
#[tokio::test]
async fn a_batch_links_each_of_its_traces() {
    exporter();
    let pool = pool().await;
    let dispatcher = Dispatcher::from_registry(pool.clone()).unwrap();
    let parents: Vec<(TraceId, SpanId, String)> = (0..3).map(|_| remote_parent()).collect();
    let envelopes: Vec<Envelope> = parents
        .iter()
        .enumerate()
        .map(|(i, (_, _, traceparent))| {
            let order = OrderPlaced {
                order_id: format!("batch-{i}"),
                amount: 10,
            };
            Envelope::new(OrderPlaced::NAME, serde_json::to_vec(&order).unwrap())
                .with_header("traceparent", traceparent.clone())
        })
        .collect();
    let results = dispatcher.dispatch_batch(&envelopes).await;
    let kinds: Vec<_> = results
        .iter()
        .map(|r| inbox_tests::outcome_kinds(r.as_ref().unwrap()))
        .collect();
    assert_eq!(kinds, vec![vec![Ok("processed")]; 3]);

    let batch: Vec<SpanData> = exporter()
        .get_finished_spans()
        .unwrap()
        .into_iter()
        .filter(|s| {
            s.name == "inbox.batch"
                && s.links
                    .iter()
                    .any(|l| l.span_context.trace_id() == parents[0].0)
        })
        .collect();
    assert_eq!(batch.len(), 1, "one batch span linked to the first trace");
    let batch = &batch[0];
    assert_eq!(attribute(batch, "messages").as_deref(), Some("3"));
    assert_eq!(batch.parent_span_id, SpanId::INVALID, "a child of none");
    let mut linked: Vec<(TraceId, SpanId)> = batch
        .links
        .iter()
        .map(|l| (l.span_context.trace_id(), l.span_context.span_id()))
        .collect();
    let mut expected: Vec<(TraceId, SpanId)> = parents.iter().map(|(t, s, _)| (*t, *s)).collect();
    linked.sort_unstable_by_key(|(t, s)| (t.to_string(), s.to_string()));
    expected.sort_unstable_by_key(|(t, s)| (t.to_string(), s.to_string()));
    assert_eq!(linked, expected);
    // No span joined any of the three traces: the batch did not claim one for itself.
    for (trace_id, _, _) in &parents {
        assert_eq!(spans_of(*trace_id).len(), 0);
    }
}

/// Malformed or unsupported `traceparent`s are ignored: the delivery is processed, and the HTTP
/// request served, in a span of a new trace (no parent); an outbox row published outside any
/// span stores `NULL`.
#[tokio::test]
async fn a_malformed_traceparent_starts_a_new_trace_and_fails_nothing() {
    exporter();
    let pool = pool().await;
    let dispatcher = Dispatcher::from_registry(pool.clone()).unwrap();
    let bad = [
        "not a traceparent",
        "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331",
        "00-00000000000000000000000000000000-b7ad6b7169203331-01",
        "00-0af7651916cd43dd8448eb211c80319c-0000000000000000-01",
        "ff-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
        "00-0af7651916cd43dd8448eb211c80319g-b7ad6b7169203331-01",
        "",
    ];
    for (i, traceparent) in bad.iter().enumerate() {
        let key = format!("malformed-{i}");
        let order = OrderPlaced {
            order_id: key.clone(),
            amount: 1,
        };
        let envelope = Envelope::new(OrderPlaced::NAME, serde_json::to_vec(&order).unwrap())
            .with_header("traceparent", *traceparent)
            .with_header("tracestate", "inbox=bad");
        let outcomes = dispatcher.dispatch(&envelope).await.unwrap();
        assert_eq!(
            inbox_tests::outcome_kinds(&outcomes),
            [Ok("processed")],
            "{traceparent:?}"
        );
        let spans: Vec<SpanData> = exporter()
            .get_finished_spans()
            .unwrap()
            .into_iter()
            .filter(|s| s.name == "inbox.message" && attribute(s, "key") == Some(key.clone()))
            .collect();
        assert_eq!(spans.len(), 1, "{traceparent:?}");
        assert_eq!(
            spans[0].parent_span_id,
            SpanId::INVALID,
            "{traceparent:?}: a root"
        );
        assert!(!spans[0].parent_span_is_remote);
        assert_ne!(spans[0].span_context.trace_id(), TraceId::INVALID);
        assert_eq!(
            SEEN.lock().unwrap().get(&key),
            Some(&spans[0].span_context.trace_id())
        );
    }
    // An HTTP request with a malformed traceparent is served, in a span of a new trace.
    let app = Router::new()
        .route("/malformed", post(place))
        .route_layer(IdempotencyLayer::new(pool.clone()));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let server = tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    let response = reqwest::Client::new()
        .post(format!("http://{addr}/malformed"))
        .header("content-type", "application/json")
        .header("idempotency-key", "\"malformed-http\"")
        .header("traceparent", "00-xyz-01")
        .body(r#"{"order_id": "malformed-http", "amount": 1}"#)
        .send()
        .await
        .unwrap();
    assert_eq!(response.status().as_u16(), 201);
    server.abort();
    let http: Vec<SpanData> = exporter()
        .get_finished_spans()
        .unwrap()
        .into_iter()
        .filter(|s| s.name == "inbox.http" && attribute(s, "path").as_deref() == Some("/malformed"))
        .collect();
    assert_eq!(http.len(), 1);
    assert_eq!(http[0].parent_span_id, SpanId::INVALID, "a root");
    let stored: Option<String> = sqlx::query_scalar("SELECT trace_context FROM inbox_outbox")
        .fetch_one(&pool)
        .await
        .unwrap();
    let stored: BTreeMap<String, String> = serde_json::from_str(&stored.unwrap()).unwrap();
    assert_eq!(
        stored["traceparent"].split('-').nth(1),
        Some(http[0].span_context.trace_id().to_string().as_str()),
        "the row continues the new trace"
    );
    sqlx::query("DELETE FROM inbox_outbox")
        .execute(&pool)
        .await
        .unwrap();

    // Outside any span: the column stays NULL.
    let mut tx = pool.begin().await.unwrap();
    let order = OrderPlaced {
        order_id: "untraced".into(),
        amount: 1,
    };
    OUTBOX
        .publish(&mut *tx, OutboxMessage::new(SUBJECT, &order))
        .await
        .unwrap();
    tx.commit().await.unwrap();
    let stored: Option<String> = sqlx::query_scalar("SELECT trace_context FROM inbox_outbox")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(stored, None);
}

/// Publishes one order inside a span that continues `traceparent`, relays it into a
/// [`MemorySink`](inbox_runtime::sink::MemorySink), and checks the stored column, the sent
/// headers and the relay span's parent (the outbox row → headers hop, on any backend).
macro_rules! stored_and_relayed {
    ($pool:expr) => {{
        use inbox_runtime::sink::MemorySink;
        let pool = $pool;
        inbox_runtime::migrate_components(&pool, &[Component::Inbox, Component::Outbox])
            .await
            .unwrap();
        let (trace_id, parent, traceparent) = remote_parent();
        let span = tracing::info_span!("test.publish");
        let remote = opentelemetry_sdk::propagation::TraceContextPropagator::new();
        let headers = std::collections::HashMap::from([("traceparent".to_owned(), traceparent)]);
        let _ = span.set_parent(opentelemetry::propagation::TextMapPropagator::extract(
            &remote, &headers,
        ));
        let order = OrderPlaced {
            order_id: "relayed".into(),
            amount: 5,
        };
        let mut tx = pool.begin().await.unwrap();
        OUTBOX
            .publish(&mut *tx, OutboxMessage::new(SUBJECT, &order))
            .instrument(span.clone())
            .await
            .unwrap();
        tx.commit().await.unwrap();
        drop(span);
        let stored: Option<String> = sqlx::query_scalar("SELECT trace_context FROM inbox_outbox")
            .fetch_one(&pool)
            .await
            .unwrap();
        let sink = MemorySink::new();
        let relay = Relay::new(pool.clone(), sink.clone());
        assert_eq!(relay.run_once().await.unwrap().published, 1);
        let spans = spans_of(trace_id);
        let publish = spans.iter().find(|s| s.name == "test.publish").unwrap();
        let relayed = spans
            .iter()
            .find(|s| s.name == "inbox.outbox.publish")
            .unwrap();
        assert_eq!(publish.parent_span_id, parent);
        assert_eq!(relayed.parent_span_id, publish.span_context.span_id());
        assert_eq!(
            stored.as_deref(),
            Some(
                format!(
                    r#"{{"traceparent":"00-{trace_id}-{}-01"}}"#,
                    publish.span_context.span_id()
                )
                .as_str()
            )
        );
        let sent = sink.published();
        assert_eq!(sent.len(), 1);
        assert_eq!(
            sent[0].headers,
            BTreeMap::from([(
                "traceparent".to_owned(),
                format!("00-{trace_id}-{}-01", relayed.span_context.span_id())
            )])
        );
    }};
}

/// The outbox row → headers hop on SQLite and MySQL/MariaDB (PostgreSQL: the end-to-end test):
/// the new column is there after the migrations, and the relay continues it.
#[tokio::test]
async fn sqlite_and_mysql_store_and_relay_the_trace_context() {
    use tracing::Instrument as _;
    exporter();
    let (sqlite, _file) = inbox_tests::sqlite_pool(2).await;
    stored_and_relayed!(sqlite);
    stored_and_relayed!(inbox_tests::mysql_pool(2).await);
}

/// An outbox whose only destination is `destination` (made `'static` for the test).
fn outbox_to(destination: &str) -> (Outbox, &'static str) {
    let destination: &'static str = Box::leak(destination.to_owned().into_boxed_str());
    let destinations: &'static [&'static str] = Box::leak(Box::new([destination]));
    (Outbox::new(destinations), destination)
}

/// The broker hop on any sink and source: an order published in a span that continues a remote
/// parent, relayed through `sink`, read back from `source` and dispatched. The consumer's
/// `inbox.message` is the child of the relay's `inbox.outbox.publish`, itself the child of the
/// publishing span, all in the remote parent's trace; the delivery's headers carry the relay
/// span's `traceparent` and the publisher's `tracestate`.
async fn through_broker(
    pool: &PgPool,
    destination: &str,
    sink: impl inbox_runtime::sink::Sink,
    mut source: impl inbox_runtime::source::Source,
    dispatcher: Dispatcher<Postgres>,
    order_id: &str,
) {
    use tracing::Instrument as _;
    let (outbox, destination) = outbox_to(destination);
    let (trace_id, parent, traceparent) = remote_parent();
    let span = tracing::info_span!("test.publish");
    let carrier = std::collections::HashMap::from([
        ("traceparent".to_owned(), traceparent),
        ("tracestate".to_owned(), "inbox=broker".to_owned()),
    ]);
    let _ = span.set_parent(opentelemetry::propagation::TextMapPropagator::extract(
        &opentelemetry_sdk::propagation::TraceContextPropagator::new(),
        &carrier,
    ));
    let order = OrderPlaced {
        order_id: order_id.to_owned(),
        amount: 7,
    };
    let mut tx = pool.begin().await.unwrap();
    outbox
        .publish(&mut *tx, OutboxMessage::new(destination, &order))
        .instrument(span.clone())
        .await
        .unwrap();
    tx.commit().await.unwrap();
    drop(span);
    let relay = Relay::new(pool.clone(), sink);
    let mut published = 0;
    for _ in 0..100 {
        published += relay.run_once().await.unwrap().published;
        if published == 1 {
            break;
        }
    }
    assert_eq!(published, 1);
    let delivery = tokio::time::timeout(Duration::from_secs(20), source.next())
        .await
        .unwrap()
        .unwrap()
        .unwrap();
    let headers = delivery.envelope().headers.clone();
    let outcomes = dispatcher.dispatch(delivery.envelope()).await.unwrap();
    assert_eq!(inbox_tests::outcome_kinds(&outcomes), [Ok("processed")]);
    delivery.ack().await.unwrap();

    let spans = spans_of(trace_id);
    let one = |name: &str| -> &SpanData {
        let found: Vec<&SpanData> = spans.iter().filter(|s| s.name == name).collect();
        assert_eq!(found.len(), 1, "one span {name}: {spans:#?}");
        found[0]
    };
    let publish = one("test.publish");
    let relayed = one("inbox.outbox.publish");
    let handled = one("inbox.message");
    assert_eq!(spans.len(), 3, "{spans:#?}");
    assert_eq!(publish.parent_span_id, parent);
    assert_eq!(relayed.parent_span_id, publish.span_context.span_id());
    assert_eq!(handled.parent_span_id, relayed.span_context.span_id());
    assert_eq!(attribute(handled, "key").as_deref(), Some(order_id));
    assert_eq!(
        headers.get("traceparent"),
        Some(&format!(
            "00-{trace_id}-{}-01",
            relayed.span_context.span_id()
        ))
    );
    assert_eq!(
        headers.get("tracestate").map(String::as_str),
        Some("inbox=broker")
    );
    assert_eq!(SEEN.lock().unwrap().get(order_id), Some(&trace_id));
}

/// RabbitMQ (AMQP_URL): the trace context in the AMQP headers table, sink to source.
#[tokio::test]
async fn rabbitmq_headers_carry_the_trace() {
    use inbox_runtime::sink::amqp::{AmqpSink, AmqpSinkConfig};
    use inbox_runtime::source::amqp::{AmqpConfig, AmqpSource};
    use lapin::options::QueueDeclareOptions;
    use lapin::types::FieldTable;

    exporter();
    let pool = pool().await;
    let url = std::env::var("AMQP_URL").expect("AMQP_URL (scripts/brokers.sh) is set");
    let queue = inbox_tests::unique_name("trace");
    let connection = lapin::Connection::connect(&url, lapin::ConnectionProperties::default())
        .await
        .unwrap();
    let channel = connection.create_channel().await.unwrap();
    channel
        .queue_declare(
            queue.as_str().into(),
            QueueDeclareOptions::durable(),
            FieldTable::default(),
        )
        .await
        .unwrap();
    let sink = AmqpSink::connect(
        AmqpSinkConfig::new(url.clone())
            .route("trace-orders", "", &queue)
            .declare(false),
    )
    .await
    .unwrap();
    let source = AmqpSource::connect(AmqpConfig::new(url, &queue))
        .await
        .unwrap();
    let dispatcher = Dispatcher::from_registry(pool.clone()).unwrap();
    through_broker(&pool, "trace-orders", sink, source, dispatcher, "amqp-1").await;
    channel
        .queue_delete(queue.as_str().into(), Default::default())
        .await
        .ok();
}

/// Amazon SQS (SQS_ENDPOINT, a moto server): the trace context in String message attributes.
#[tokio::test]
async fn sqs_message_attributes_carry_the_trace() {
    use inbox_runtime::sink::sqs::SqsSink;
    use inbox_runtime::source::sqs::{AwsSettings, SqsConfig, SqsSource};

    exporter();
    let pool = pool().await;
    let endpoint = std::env::var("SQS_ENDPOINT").expect("SQS_ENDPOINT (scripts/sqs.sh) is set");
    let settings = AwsSettings::default().endpoint_url(endpoint);
    let client = inbox_runtime::source::sqs::client(&settings, Duration::from_secs(20)).await;
    let name = inbox_tests::unique_name("trace");
    let url = client
        .create_queue()
        .queue_name(&name)
        .send()
        .await
        .unwrap()
        .queue_url
        .unwrap();
    let source = SqsSource::connect(
        SqsConfig::new(&url)
            .aws(settings.clone())
            .wait_time(Duration::from_secs(1)),
    )
    .await
    .unwrap();
    let sink = SqsSink::connect(&settings).await;
    let dispatcher = Dispatcher::from_registry(pool.clone()).unwrap();
    through_broker(&pool, &name, sink, source, dispatcher, "sqs-1").await;
    client.delete_queue().queue_url(&url).send().await.ok();
}

/// Kafka (librdkafka's mock cluster, in process): the trace context in the record headers; the
/// source's position hook on the dispatcher, as the Worker runs it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kafka_record_headers_carry_the_trace() {
    use inbox_runtime::sink::kafka::KafkaSink;
    use inbox_runtime::source::kafka::{KafkaConfig, KafkaSource};

    exporter();
    let pool = pool().await;
    inbox_runtime::migrate_components(&pool, &[Component::Positions])
        .await
        .unwrap();
    let cluster =
        rdkafka::mocking::MockCluster::<rdkafka::producer::DefaultProducerContext>::new(1)
            .expect("start librdkafka's mock cluster");
    let bootstrap = cluster.bootstrap_servers();
    cluster.create_topic("trace-orders", 1, 1).unwrap();
    let config = KafkaConfig::new(&bootstrap, "trace-shipping", ["trace-orders"])
        .property("session.timeout.ms", "6000")
        .property("heartbeat.interval.ms", "300");
    let (source, dispatcher) =
        KafkaSource::connect(config, Dispatcher::from_registry(pool.clone()).unwrap())
            .await
            .unwrap();
    let sink = KafkaSink::new(&bootstrap).unwrap();
    through_broker(&pool, "trace-orders", sink, source, dispatcher, "kafka-1").await;
}
