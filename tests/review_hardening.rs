//! An adversarial review of issues 31 (invariants at the point of use, one Unicode rule) and 36
//! (the Kafka source's takeover): values that no constructor checks and that reached code which
//! panicked on them, and a Kafka record whose name header is not UTF-8.
//!
//! Against the real servers: librdkafka's mock cluster (in process), RabbitMQ (`AMQP_URL`), the
//! SQS server (`SQS_ENDPOINT`), MariaDB (`MYSQL_URL`), with SQLite.

#![allow(missing_docs)]

use std::time::Duration;

use inbox_runtime::source::Source as _;
use inbox_runtime::{Component, Dispatcher};
use inbox_tests::{APPLY_EFFECT, TempFile};
use rdkafka::ClientConfig;
use rdkafka::message::{Header, OwnedHeaders};
use rdkafka::mocking::MockCluster;
use rdkafka::producer::{FutureProducer, FutureRecord};
use sqlx::SqlitePool;

/// Longer than any clock can add to an instant: `Instant + Duration::MAX` panics.
const FOREVER: Duration = Duration::MAX;

/// The message of these tests.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize, inbox_runtime::Message)]
#[message(name = "review.note")]
struct Note {
    #[message(key)]
    id: String,
}

#[inbox_runtime::idempotent(consumer = "review")]
async fn note(conn: &mut sqlx::SqliteConnection, msg: Note) -> Result<(), sqlx::Error> {
    sqlx::query(APPLY_EFFECT)
        .bind(&msg.id)
        .bind(1_i64)
        .execute(&mut *conn)
        .await?;
    Ok(())
}

/// A SQLite inbox with `components` migrated too, and a dispatcher of [`note`].
async fn sqlite(components: &[Component]) -> (SqlitePool, TempFile, Dispatcher<sqlx::Sqlite>) {
    let (pool, guard) = inbox_tests::sqlite_pool(4).await;
    inbox_runtime::migrate_components(&pool, components)
        .await
        .unwrap();
    let dispatcher =
        Dispatcher::from_handlers(pool.clone(), [inbox_runtime::handler!(note)]).unwrap();
    (pool, guard, dispatcher)
}

fn env(name: &str) -> String {
    std::env::var(name).unwrap_or_else(|_| panic!("{name} is not set: source the servers' env"))
}

fn unique(prefix: &str) -> String {
    format!(
        "{prefix}-{}-{}",
        std::process::id(),
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_nanos()
    )
}

mod kafka {
    use super::*;
    use inbox_runtime::source::kafka::{KafkaConfig, KafkaSource};

    /// One test at a time: each starts a mock cluster and a consumer group.
    pub(super) static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

    pub(super) fn mock() -> MockCluster<'static, rdkafka::producer::DefaultProducerContext> {
        MockCluster::new(1).expect("start librdkafka's mock cluster")
    }

    /// Produces one record with these headers (raw bytes) and payload to partition 0.
    pub(super) async fn produce(
        bootstrap: &str,
        topic: &str,
        headers: &[(&str, &[u8])],
        payload: &[u8],
    ) {
        let producer: FutureProducer = ClientConfig::new()
            .set("bootstrap.servers", bootstrap)
            .create()
            .expect("a producer");
        let mut owned = OwnedHeaders::new();
        for (key, value) in headers {
            owned = owned.insert(Header {
                key,
                value: Some(*value),
            });
        }
        let record: FutureRecord<'_, str, [u8]> = FutureRecord::to(topic)
            .partition(0)
            .headers(owned)
            .payload(payload);
        producer
            .send(record, Duration::from_secs(30))
            .await
            .map_err(|(error, _)| error)
            .expect("produce");
    }

    pub(super) fn config(bootstrap: &str, topic: &str) -> KafkaConfig {
        KafkaConfig::new(bootstrap, unique("review"), [topic])
            .property("session.timeout.ms", "6000")
            .property("heartbeat.interval.ms", "300")
            .property("topic.metadata.refresh.interval.ms", "1000")
    }

    /// The first delivery of `source`, within three minutes (the mock cluster's group join is
    /// slow on a loaded machine: one CI run waited more than a minute).
    pub(super) async fn first(source: &mut KafkaSource) -> inbox_runtime::source::Delivery {
        tokio::time::timeout(Duration::from_secs(180), source.next())
            .await
            .expect("a delivery within three minutes")
            .expect("the source works")
            .expect("the source is not exhausted")
    }

    /// A requeue with a delay no clock can add (`Delivery::requeue`, a public API; the worker's
    /// `requeue_delay(Duration::MAX)` makes the same settlement) panicked in the Kafka settler
    /// (`Instant::now() + delay`), in the worker's task. The memory, file, AMQP, NATS and SQS
    /// settlers take it (a sleep that never ends, a capped visibility change).
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_kafka_requeue_with_an_unbounded_delay_does_not_panic() {
        let _serial = SERIAL.lock().await;
        let (_pool, _guard, dispatcher) = sqlite(&[Component::Positions]).await;
        let cluster = mock();
        let bootstrap = cluster.bootstrap_servers();
        cluster.create_topic("requeue", 1, 1).unwrap();
        let payload = serde_json::to_vec(&Note { id: "n-1".into() }).unwrap();
        produce(
            &bootstrap,
            "requeue",
            &[("message-name", b"review.note")],
            &payload,
        )
        .await;
        let (mut source, _dispatcher) =
            KafkaSource::connect(config(&bootstrap, "requeue"), dispatcher)
                .await
                .unwrap();
        let delivery = first(&mut source).await;
        assert_eq!(delivery.envelope().payload, payload);
        let requeued = tokio::spawn(delivery.requeue(Some(FOREVER))).await;
        assert!(
            matches!(requeued, Ok(Ok(()))),
            "the requeue panicked or failed: {requeued:?}"
        );
        // Not delivered again before its (never-ending) delay.
        assert!(
            tokio::time::timeout(Duration::from_secs(2), source.next())
                .await
                .is_err()
        );
        source.close().await.unwrap();
    }

    /// A record whose name header is present but not UTF-8 (here a CESU-8 surrogate, `ED A0
    /// 80`) was routed by the topic's configured name instead (`KafkaConfig::topic_name`,
    /// meant for records *without* the header): a record of another type, misnamed, could be
    /// applied as the topic's default message. Now its name is the header's text, with U+FFFD
    /// for the bytes that are not UTF-8, as the AMQP source reads it: unknown, kept in
    /// `inbox_rejections`.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_name_header_that_is_not_utf8_is_not_replaced_by_the_topic_name() {
        let _serial = SERIAL.lock().await;
        let (pool, _guard, dispatcher) = sqlite(&[Component::Positions]).await;
        let cluster = mock();
        let bootstrap = cluster.bootstrap_servers();
        cluster.create_topic("names", 1, 1).unwrap();
        let payload = serde_json::to_vec(&Note { id: "n-2".into() }).unwrap();
        produce(
            &bootstrap,
            "names",
            &[("message-name", b"review.\xed\xa0\x80other")],
            &payload,
        )
        .await;
        let config = config(&bootstrap, "names").topic_name("names", "review.note");
        let (mut source, dispatcher) = KafkaSource::connect(config, dispatcher).await.unwrap();
        let delivery = first(&mut source).await;
        assert_eq!(
            delivery.envelope().message_name,
            "review.\u{FFFD}\u{FFFD}\u{FFFD}other"
        );
        let refused = dispatcher.dispatch(delivery.envelope()).await.unwrap_err();
        assert_eq!(
            refused.to_string(),
            "unknown message `review.\u{FFFD}\u{FFFD}\u{FFFD}other`: no handler is registered \
             for it"
        );
        delivery.ack().await.unwrap();
        source.close().await.unwrap();
        assert_eq!(
            inbox_tests::effect::<sqlx::Sqlite>(&pool, "n-2").await,
            None
        );
    }
}

/// `KafkaConfig::revoke_wait` is a public field and its setter takes any duration: at
/// `Duration::MAX` every revocation (a rebalance, or the close) panicked in the rebalance
/// callback (`Instant::now() + revoke_wait`): the consumer thread died, and the close waited for
/// it forever (a rebalance: the source stopped polling, its partitions stalled).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_kafka_revoke_wait_without_end_does_not_abort_the_close() {
    use inbox_runtime::source::kafka::KafkaSource;
    let _serial = kafka::SERIAL.lock().await;
    let (_pool, _guard, dispatcher) = sqlite(&[Component::Positions]).await;
    let cluster = kafka::mock();
    let bootstrap = cluster.bootstrap_servers();
    cluster.create_topic("revoke", 1, 1).unwrap();
    let payload = serde_json::to_vec(&Note { id: "n-3".into() }).unwrap();
    kafka::produce(
        &bootstrap,
        "revoke",
        &[("message-name", b"review.note")],
        &payload,
    )
    .await;
    let config = kafka::config(&bootstrap, "revoke").revoke_wait(FOREVER);
    let (mut source, _dispatcher) = KafkaSource::connect(config, dispatcher).await.unwrap();
    // Assigned (the record came), nothing running: the close revokes the partition.
    let delivery = kafka::first(&mut source).await;
    delivery.ack().await.unwrap();
    tokio::time::timeout(Duration::from_secs(60), source.close())
        .await
        .expect("the close ends")
        .unwrap();
}

/// `AmqpSinkConfig::confirm_timeout` is a public field and its setter takes any duration: at
/// `Duration::MAX` every publish panicked (`Instant::now() + timeout`), in the relay's round.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_amqp_sink_without_a_confirm_deadline_publishes() {
    use inbox_runtime::outbox::Relay;
    use inbox_runtime::sink::amqp::{AmqpSink, AmqpSinkConfig};
    use inbox_runtime::store::{OutboxRow, OutboxStore as _};
    use lapin::options::BasicGetOptions;

    let (pool, _guard, _) = sqlite(&[Component::Outbox]).await;
    let queue = unique("review-confirm");
    {
        let mut conn = pool.acquire().await.unwrap();
        let row = OutboxRow::new("m-1", &queue, "review.note", b"{\"id\":\"m\"}", "{}", None);
        assert!(conn.enqueue_outbox(&row, false).await.unwrap());
    }
    let sink = AmqpSink::connect(
        AmqpSinkConfig::new(env("AMQP_URL"))
            .declare(true)
            .confirm_timeout(FOREVER),
    )
    .await
    .unwrap();
    let round = tokio::spawn(async move { Relay::new(pool, sink).run_once().await }).await;
    let round = round.expect("the round panicked").unwrap();
    assert_eq!((round.leased, round.published, round.failed), (1, 1, 0));

    let connection =
        lapin::Connection::connect(&env("AMQP_URL"), lapin::ConnectionProperties::default())
            .await
            .unwrap();
    let channel = connection.create_channel().await.unwrap();
    let got = channel
        .basic_get(queue.as_str().into(), BasicGetOptions { no_ack: true })
        .await
        .unwrap()
        .expect("the message is in its queue");
    assert_eq!(got.delivery.data, b"{\"id\":\"m\"}");
    channel
        .queue_delete(queue.as_str().into(), Default::default())
        .await
        .unwrap();
    connection.close(200, "OK".into()).await.ok();
}

/// `SqsConfig::settle_linger` is a public field and its setter takes any duration: at
/// `Duration::MAX` the batcher of deletes panicked at the first ack (`Instant::now() +
/// linger`), so no delete was ever sent and the close failed; now the ack waits for the close's
/// flush, which deletes the message.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_sqs_source_with_an_unbounded_linger_deletes_at_close() {
    use aws_sdk_sqs::types::QueueAttributeName;
    use inbox_runtime::source::sqs::{AwsSettings, SqsConfig, SqsSource};

    let settings = AwsSettings::default().endpoint_url(env("SQS_ENDPOINT"));
    let client = inbox_runtime::source::sqs::client(&settings, Duration::from_secs(20)).await;
    let name = unique("review-linger");
    let url = client
        .create_queue()
        .queue_name(&name)
        .send()
        .await
        .unwrap()
        .queue_url
        .unwrap();
    client
        .send_message()
        .queue_url(&url)
        .message_body("{\"id\":\"s-1\"}")
        .send()
        .await
        .unwrap();
    let config = SqsConfig::new(&url)
        .aws(settings)
        .wait_time(Duration::from_secs(1))
        .settle_linger(FOREVER);
    let mut source = SqsSource::connect(config).await.unwrap();
    let delivery = tokio::time::timeout(Duration::from_secs(30), source.next())
        .await
        .unwrap()
        .unwrap()
        .unwrap();
    delivery.ack().await.unwrap();
    source.close().await.unwrap();
    let attributes = client
        .get_queue_attributes()
        .queue_url(&url)
        .attribute_names(QueueAttributeName::ApproximateNumberOfMessages)
        .attribute_names(QueueAttributeName::ApproximateNumberOfMessagesNotVisible)
        .send()
        .await
        .unwrap()
        .attributes
        .unwrap();
    let count = |name: QueueAttributeName| attributes[&name].parse::<i64>().unwrap();
    assert_eq!(
        (
            count(QueueAttributeName::ApproximateNumberOfMessages),
            count(QueueAttributeName::ApproximateNumberOfMessagesNotVisible)
        ),
        (0, 0),
        "the acked message is deleted"
    );
    client.delete_queue().queue_url(&url).send().await.unwrap();
}

/// `sqs::client` is public; its `longest_call` of `Duration::MAX` overflowed the timeouts'
/// arithmetic (`longest_call + 10 s`, `attempt * 3`) and panicked.
#[tokio::test]
async fn an_sqs_client_for_calls_without_end_is_built() {
    let settings =
        inbox_runtime::source::sqs::AwsSettings::default().endpoint_url(env("SQS_ENDPOINT"));
    let built = tokio::spawn(async move {
        inbox_runtime::source::sqs::client(&settings, FOREVER)
            .await
            .list_queues()
            .queue_name_prefix("review-none")
            .send()
            .await
            .map(|listed| listed.queue_urls.unwrap_or_default().len())
    })
    .await;
    assert!(
        matches!(built, Ok(Ok(0))),
        "the client panicked or failed: {built:?}"
    );
}

/// `PositionStore::try_acquire_position` is public and takes the lock wait: on MySQL/MariaDB a
/// wait of `Duration::MAX` panicked (`Instant::now() + lock_wait`) before the first statement
/// (PostgreSQL and SQLite clamp it).
#[tokio::test]
async fn a_mysql_position_attempt_with_an_unbounded_wait_takes_the_row() {
    use inbox_runtime::store::{PositionKey, PositionStore as _};
    let pool = inbox_tests::mysql_pool(2).await;
    inbox_runtime::migrate_components(&pool, &[Component::Positions])
        .await
        .unwrap();
    let key = PositionKey::new("review", "t", 0);
    let taken = tokio::spawn(async move {
        let mut conn = pool.acquire().await.unwrap();
        conn.try_acquire_position(&key, "owner-1", FOREVER)
            .await
            .map(|acquired| acquired.map(|a| (a.epoch, a.next_offset)))
    })
    .await;
    assert!(
        matches!(taken, Ok(Ok(Some((1, None))))),
        "the attempt panicked or failed: {taken:?}"
    );
}

mod http {
    use super::*;
    use axum::Router;
    use axum::body::Body;
    use axum::http::{Request, StatusCode};
    use axum::routing::post;
    use inbox_runtime::http::IdempotencyLayer;
    use tower::ServiceExt as _;

    /// A pool whose database cannot be opened (a directory that does not exist): every claim
    /// is a 503 `store-unavailable`, with `Retry-After`.
    fn unreachable() -> SqlitePool {
        sqlx::sqlite::SqlitePoolOptions::new()
            .acquire_timeout(Duration::from_secs(5))
            .connect_lazy("sqlite:///nonexistent-review-dir/inbox.db")
            .unwrap()
    }

    async fn call(
        layer: IdempotencyLayer<sqlx::Sqlite>,
        length: Option<&str>,
    ) -> (StatusCode, Option<String>, String) {
        let app = Router::new()
            .route("/pay", post(|| async { "paid" }))
            .route_layer(layer);
        let mut request = Request::post("/pay")
            .header("content-type", "application/json")
            .header("idempotency-key", "\"k-1\"");
        if let Some(length) = length {
            request = request.header("content-length", length);
        }
        let response = tokio::spawn(app.oneshot(request.body(Body::from("{}")).unwrap()))
            .await
            .expect("the layer panicked")
            .unwrap();
        let status = response.status();
        let retry_after = response
            .headers()
            .get("retry-after")
            .map(|v| v.to_str().unwrap().to_owned());
        let body = axum::body::to_bytes(response.into_body(), 1 << 20)
            .await
            .unwrap();
        (
            status,
            retry_after,
            String::from_utf8(body.to_vec()).unwrap(),
        )
    }

    /// `IdempotencyLayer::retry_after(Duration::MAX)` (the setter takes any duration) panicked
    /// in a debug build when the layer answered a 409 or 503 (`secs + 1` overflowed); in a
    /// release build the sum wrapped and the client was told to retry after 1 s. Now the
    /// header says the largest number of seconds.
    #[tokio::test]
    async fn a_retry_after_without_end_is_the_largest_number_of_seconds() {
        let layer = IdempotencyLayer::new(unreachable()).retry_after(FOREVER);
        let (status, retry_after, body) = call(layer, None).await;
        assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE, "{body}");
        assert_eq!(retry_after.as_deref(), Some("18446744073709551615"));
    }

    /// `max_body_bytes` and `max_response_bytes` took any size: `usize::MAX` turned the
    /// request body's bound off (the whole body is held, and fingerprinted, in memory) and let
    /// responses be stored that no backend's value holds. Both are lowered to
    /// `PayloadLimit::MAX_BYTES` (256 MiB), as `max_key_len` is to its maximum: a request
    /// declaring more is a 413 before anything is read or claimed.
    #[tokio::test]
    async fn the_body_limit_is_bounded_by_the_payload_maximum() {
        let layer = IdempotencyLayer::new(unreachable())
            .max_body_bytes(usize::MAX)
            .max_response_bytes(usize::MAX);
        let debug = format!("{layer:?}");
        assert!(debug.contains("max_body_bytes: 268435456"), "{debug}");
        assert!(debug.contains("max_response_bytes: 268435456"), "{debug}");
        let (status, _, body) = call(layer, Some("268435457")).await;
        assert_eq!(status, StatusCode::PAYLOAD_TOO_LARGE, "{body}");
        assert!(
            body.contains("the request body is 268435457 bytes, more than the 268435456 bytes"),
            "{body}"
        );
        // At the maximum: read, then the claim (here: the store is unavailable).
        let layer = IdempotencyLayer::new(unreachable()).max_body_bytes(usize::MAX);
        let (status, _, body) = call(layer, Some("2")).await;
        assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE, "{body}");
    }
}

/// The file source's envelope line (`{"message", "payload", "headers"}`) is decoded before the
/// dispatcher sees anything: text that is not Unicode in it — raw bytes that are not UTF-8 in
/// the payload (a CESU-8 surrogate, `ED A0 80`), an unpaired surrogate escape in a header —
/// made the whole line "not a message envelope", rejected as `the delivery carries no message
/// name` although it has one. Now such a line goes to the dispatcher under its name, whole, and
/// is refused by the one Unicode rule with its position in the line (`NotUtf8`,
/// `UnpairedSurrogate`), kept whole in `inbox_rejections`; nothing is applied. A surrogate in
/// the payload was refused so already (the first line's neighbour, for comparison).
#[tokio::test]
async fn file_lines_that_are_not_unicode_are_refused_by_the_unicode_rule() {
    use inbox_runtime::source::file::FileSource;
    use inbox_runtime::{CancellationToken, Worker};
    use std::io::Write as _;

    let (pool, _guard, dispatcher) = sqlite(&[]).await;
    let dir = tempfile::tempdir_in(inbox_tests::scratch_dir()).unwrap();
    let path = dir.path().join("lines.jsonl");
    let lines: [&[u8]; 4] = [
        b"{\"message\":\"review.note\",\"payload\":{\"id\":\"a\",\"x\":\"\xed\xa0\x80\"}}",
        b"{\"message\":\"review.note\",\"payload\":{\"id\":\"b\",\"x\":\"\\ud800\"}}",
        b"{\"message\":\"review.note\",\"headers\":{\"h\":\"\\uDFFF\"},\"payload\":{\"id\":\"c\"}}",
        b"{\"message\":\"review.note\",\"payload\":{\"id\":\"d\"}}",
    ];
    let mut file = std::fs::File::create(&path).unwrap();
    for line in lines {
        file.write_all(line).unwrap();
        file.write_all(b"\n").unwrap();
    }
    drop(file);
    let source = FileSource::open(&path).await.unwrap();
    let report = Worker::new(dispatcher)
        .run(source, CancellationToken::new())
        .await
        .unwrap();
    assert_eq!((report.processed, report.invalid, report.acked), (1, 3, 4));
    let rejected: Vec<(String, String, String, Vec<u8>)> = sqlx::query_as(
        "SELECT message_name, reason, detail, payload FROM inbox_rejections ORDER BY id",
    )
    .fetch_all(&pool)
    .await
    .unwrap();
    let row = |detail: &str, payload: &[u8]| {
        (
            "review.note".to_owned(),
            "malformed".to_owned(),
            detail.to_owned(),
            payload.to_vec(),
        )
    };
    assert_eq!(
        rejected,
        [
            row(
                "malformed payload for message `review.note` at line 1, column 51: invalid UTF-8",
                lines[0]
            ),
            row(
                "malformed payload for message `review.note` at line 1, column 16: invalid \
                 Unicode: the escape `\\ud800` is an unpaired surrogate",
                b"{\"id\":\"b\",\"x\":\"\\ud800\"}"
            ),
            row(
                "malformed payload for message `review.note` at line 1, column 42: invalid \
                 Unicode: the escape `\\uDFFF` is an unpaired surrogate",
                lines[2]
            ),
        ]
    );
    let effects: Vec<String> = sqlx::query_scalar("SELECT effect_key FROM effects")
        .fetch_all(&pool)
        .await
        .unwrap();
    assert_eq!(effects, ["d"]);
}

/// Rows leased before outbox migration 3 (by a relay of the previous version: no lease token),
/// on every backend: one whose lease ran out is leased again as an orphan and published and
/// marked sent by the token of the new lease; one whose lease still runs is left to its holder;
/// one out of attempts is dead-lettered as abandoned. (The token column is nullable, and a
/// mark of this version never matches `NULL`.)
mod legacy_leases {
    use super::*;
    use inbox_runtime::outbox::Relay;
    use inbox_runtime::sink::MemorySink;
    use inbox_runtime::store::{OutboxDatabase, OutboxRow, OutboxStore as _};
    use inbox_tests::matrix::TestBackend;

    /// Updates that lease `expired`, `held` and `abandoned` as an old relay did: attempts
    /// counted, `leased_until` set, no token.
    struct OldLeases {
        expired: &'static str,
        held: &'static str,
        abandoned: &'static str,
    }

    async fn run<DB: TestBackend + OutboxDatabase>(old: OldLeases) {
        let (pool, _guard) = DB::fixture(2).await;
        inbox_runtime::migrate_components(&pool, &[Component::Inbox, Component::Outbox])
            .await
            .unwrap();
        {
            let mut conn = pool.acquire().await.unwrap();
            for id in ["expired", "held", "abandoned"] {
                let row = OutboxRow::new(id, "orders", "review.note", b"{}", "{}", None);
                assert!(conn.enqueue_outbox(&row, false).await.unwrap());
            }
        }
        for update in [old.expired, old.held, old.abandoned] {
            assert_eq!(DB::execute(&pool, update).await, 1, "{update}");
        }
        let sink = MemorySink::new();
        let relay = Relay::new(pool.clone(), sink.clone()).max_attempts(3);
        // Rounds until both old leases are dealt with (on PostgreSQL a row also waits for every
        // older writing transaction on the shared server, other tests' included).
        let mut total = (0, 0, 0, 0);
        let deadline = std::time::Instant::now() + Duration::from_secs(60);
        while total.1 + total.2 < 2 {
            assert!(std::time::Instant::now() < deadline, "{total:?}");
            let round = relay.run_once().await.unwrap();
            total.0 += round.leased;
            total.1 += round.published;
            total.2 += round.abandoned;
            total.3 += round.lease_lost;
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        assert_eq!(total, (1, 1, 1, 0));
        let round = relay.run_once().await.unwrap();
        assert_eq!(
            (round.leased, round.published),
            (0, 0),
            "`held` is left to its holder"
        );
        let published: Vec<String> = sink.published().into_iter().map(|m| m.message_id).collect();
        assert_eq!(published, ["expired"]);
        let count = |status: &'static str| DB::count(&pool, status);
        assert_eq!(
            count(
                "SELECT COUNT(*) FROM inbox_outbox WHERE message_id = 'expired' \
                 AND status = 'sent' AND lease_token IS NOT NULL AND attempts = 2"
            )
            .await,
            1
        );
        assert_eq!(
            count(
                "SELECT COUNT(*) FROM inbox_outbox WHERE message_id = 'held' \
                 AND status = 'pending' AND lease_token IS NULL AND attempts = 1"
            )
            .await,
            1
        );
        assert_eq!(
            count(
                "SELECT COUNT(*) FROM inbox_outbox WHERE message_id = 'abandoned' \
                 AND status = 'dead' AND lease_token IS NULL"
            )
            .await,
            1
        );
    }

    #[tokio::test]
    async fn sqlite() {
        run::<sqlx::Sqlite>(OldLeases {
            expired: "UPDATE inbox_outbox SET attempts = 1, leased_until = \
                      strftime('%Y-%m-%dT%H:%M:%fZ', 'now', '-1 minutes') WHERE message_id = 'expired'",
            held: "UPDATE inbox_outbox SET attempts = 1, leased_until = \
                   strftime('%Y-%m-%dT%H:%M:%fZ', 'now', '+1 hours') WHERE message_id = 'held'",
            abandoned: "UPDATE inbox_outbox SET attempts = 3, leased_until = \
                        strftime('%Y-%m-%dT%H:%M:%fZ', 'now', '-1 minutes') \
                        WHERE message_id = 'abandoned'",
        })
        .await;
    }

    #[tokio::test]
    async fn postgres() {
        run::<sqlx::Postgres>(OldLeases {
            expired: "UPDATE inbox_outbox SET attempts = 1, leased_until = now() - interval '1 minute' \
                      WHERE message_id = 'expired'",
            held: "UPDATE inbox_outbox SET attempts = 1, leased_until = now() + interval '1 hour' \
                   WHERE message_id = 'held'",
            abandoned: "UPDATE inbox_outbox SET attempts = 3, \
                        leased_until = now() - interval '1 minute' WHERE message_id = 'abandoned'",
        })
        .await;
    }

    #[tokio::test]
    async fn mysql() {
        run::<sqlx::MySql>(OldLeases {
            expired: "UPDATE inbox_outbox SET attempts = 1, \
                      leased_until = UTC_TIMESTAMP(6) - INTERVAL 1 MINUTE WHERE message_id = 'expired'",
            held: "UPDATE inbox_outbox SET attempts = 1, \
                   leased_until = UTC_TIMESTAMP(6) + INTERVAL 1 HOUR WHERE message_id = 'held'",
            abandoned: "UPDATE inbox_outbox SET attempts = 3, \
                        leased_until = UTC_TIMESTAMP(6) - INTERVAL 1 MINUTE \
                        WHERE message_id = 'abandoned'",
        })
        .await;
    }
}
