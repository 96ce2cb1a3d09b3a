//! The RabbitMQ source, the RabbitMQ sink of the outbox, and the ledger demo on a real RabbitMQ
//! (`AMQP_URL`, started by `scripts/test.sh`), with PostgreSQL (`DATABASE_URL`).
//!
//! The tests of this file run one at a time (they read broker-wide counters, they time SIGKILLs
//! against the demo's progress, and one restarts RabbitMQ).

#![allow(missing_docs)]

#[path = "ledger_support.rs"]
mod support;

use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, Instant};

use inbox_runtime::Envelope;
use inbox_runtime::source::amqp::{AmqpConfig, AmqpSource};
use inbox_runtime::source::{Settlement, Source};
use lapin::options::{BasicGetOptions, BasicPublishOptions, QueueDeclareOptions};
use lapin::types::{AMQPValue, FieldTable};
use lapin::{BasicProperties, Connection, ConnectionProperties};
use support::*;

/// One test at a time.
static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// RabbitMQ's own count of redeliveries from classic queues, since it started.
fn redelivered_total() -> u64 {
    rabbitmqctl(&[
        "-q",
        "eval",
        "maps:get(messages_redelivered_total, maps:get([{protocol,amqp091},\
         {queue_type,rabbit_classic_queue}], rabbit_global_counters:overview())).",
    ])
    .trim()
    .parse()
    .unwrap()
}

/// (ready, unacked) messages of `queue`, as RabbitMQ counts them.
fn queue_counts(queue: &str) -> (u64, u64) {
    let listing = rabbitmqctl(&[
        "-q",
        "list_queues",
        "--no-table-headers",
        "name",
        "messages_ready",
        "messages_unacknowledged",
    ]);
    let line = listing
        .lines()
        .find(|line| line.split_whitespace().next() == Some(queue))
        .unwrap_or_else(|| panic!("queue {queue} not listed:\n{listing}"));
    let fields: Vec<u64> = line
        .split_whitespace()
        .skip(1)
        .map(|n| n.parse().unwrap())
        .collect();
    (fields[0], fields[1])
}

async fn connect() -> Connection {
    Connection::connect(&env("AMQP_URL"), ConnectionProperties::default())
        .await
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn amqp_source_maps_and_settles_deliveries() {
    let _serial = SERIAL.lock().await;
    let queue = unique("amqp_unit");
    let connection = connect().await;
    let channel = connection.create_channel().await.unwrap();
    channel
        .queue_delete(queue.as_str().into(), Default::default())
        .await
        .ok();
    let channel = connection.create_channel().await.unwrap();
    channel
        .queue_declare(
            queue.as_str().into(),
            QueueDeclareOptions::durable(),
            FieldTable::default(),
        )
        .await
        .unwrap();
    let mut headers = FieldTable::default();
    headers.insert(
        "message-name".into(),
        AMQPValue::LongString("a.header".into()),
    );
    headers.insert("order".into(), AMQPValue::LongString("k-1".into()));
    let publish = |routing_key: &str, properties: BasicProperties, body: &'static [u8]| {
        let channel = channel.clone();
        let routing_key = routing_key.to_owned();
        async move {
            channel
                .basic_publish(
                    "".into(),
                    routing_key.as_str().into(),
                    BasicPublishOptions::default(),
                    body,
                    properties,
                )
                .await
                .unwrap()
                .await
                .unwrap();
        }
    };
    publish(
        &queue,
        BasicProperties::default()
            .with_headers(headers)
            .with_type("a.type".into())
            .with_message_id("m-1".into()),
        b"1",
    )
    .await;
    publish(
        &queue,
        BasicProperties::default().with_type("a.type".into()),
        b"2",
    )
    .await;
    publish(&queue, BasicProperties::default(), b"3").await;

    let config = AmqpConfig::new(env("AMQP_URL"), &queue)
        .prefetch(10)
        .route(&queue, "by.route")
        .ordering_key_header("order");
    let mut source = AmqpSource::connect(config).await.unwrap();
    let mut deliveries = Vec::new();
    for _ in 0..3 {
        deliveries.push(source.next().await.unwrap().unwrap());
    }
    let names: Vec<&str> = deliveries
        .iter()
        .map(|d| d.envelope().message_name.as_str())
        .collect();
    assert_eq!(names, ["a.header", "a.type", "by.route"]);
    let first: &Envelope = deliveries[0].envelope();
    let meta = first.source.as_ref().unwrap();
    assert_eq!(meta.source, queue);
    assert_eq!(meta.message_id.as_deref(), Some("m-1"));
    assert!(!meta.redelivered);
    assert_eq!(first.headers["order"], "k-1");
    assert_eq!(first.payload, b"1");
    assert_eq!(deliveries[0].ordering_key(), Some("k-1"));
    assert_eq!(deliveries[1].ordering_key(), None);

    // Ack 1, reject 2, requeue 3 (after 100 ms): 3 comes back, redelivered.
    let mut deliveries = deliveries.into_iter();
    deliveries.next().unwrap().ack().await.unwrap();
    deliveries.next().unwrap().reject().await.unwrap();
    deliveries
        .next()
        .unwrap()
        .settle(Settlement::Requeue {
            delay: Some(Duration::from_millis(100)),
        })
        .await
        .unwrap();
    let again = tokio::time::timeout(Duration::from_secs(5), source.next())
        .await
        .unwrap()
        .unwrap()
        .unwrap();
    assert_eq!(again.envelope().payload, b"3");
    assert!(again.envelope().source.as_ref().unwrap().redelivered);
    // Abandoned: back in the queue when the channel closes.
    drop(again);
    source.close().await.unwrap();
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert_eq!(queue_counts(&queue), (1, 0));
    let left = channel
        .basic_get(queue.as_str().into(), BasicGetOptions { no_ack: true })
        .await
        .unwrap()
        .unwrap();
    assert_eq!(left.delivery.data, b"3");
    channel
        .queue_delete(queue.as_str().into(), Default::default())
        .await
        .unwrap();
    connection.close(200, "OK".into()).await.ok();
}

/// `ledger publish` then `ledger --source`, SIGKILLed 5 times at random moments and restarted:
/// exact balances, every valid event applied once, nothing left in the queue, redeliveries seen
/// by the broker.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn amqp_ledger_survives_five_sigkills() {
    let _serial = SERIAL.lock().await;
    let queue = unique("ledger_kill");
    let db = fresh_database(&unique("amqp_kill")).await;
    let log = log_file("amqp_kill");
    let url = env("AMQP_URL");
    run_ledger(&["publish", "--to", &url, "--queue", &queue], &db, &log);
    assert_eq!(queue_counts(&queue), (expected().lines, 0));

    let redelivered_before = redelivered_total();
    let args = [
        "--source",
        &url,
        "--queue",
        &queue,
        "--concurrency",
        "16",
        "--idle-exit",
        "1.5",
        // A requeued original can come back after its conflicting variant: which one applies is
        // a race, checked below against what the inbox applied, not against expected.json.
        "--no-check",
    ];
    let stdout = kill_and_restart(&args, &db, &log, 5, 0xA11CE);
    let summary = summary(&stdout);
    assert_eq!(summary["balances"], "unchecked", "{}", tail(&log));

    assert_ledger_exact(&db_state(&db).await);
    assert_eq!(
        queue_counts(&queue),
        (0, 0),
        "nothing left, nothing unacked"
    );
    let redelivered = redelivered_total() - redelivered_before;
    assert!(redelivered > 0, "RabbitMQ redelivered nothing");
    eprintln!("amqp: RabbitMQ redelivered {redelivered} messages after 5 SIGKILLs");
}

/// SIGTERM mid-stream: exit code 0, and every message gone from the queue (acked or rejected)
/// has its event committed; then a second run completes the ledger exactly.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn amqp_ledger_sigterm_acks_only_committed() {
    let _serial = SERIAL.lock().await;
    let queue = unique("ledger_term");
    let db = fresh_database(&unique("amqp_term")).await;
    let log = log_file("amqp_term");
    let url = env("AMQP_URL");
    run_ledger(&["publish", "--to", &url, "--queue", &queue], &db, &log);
    let args = ["--source", &url, "--queue", &queue, "--idle-exit", "1.5"];

    let child = spawn_ledger(&args, &db, &log);
    wait_for_handlers(&log);
    std::thread::sleep(Duration::from_millis(700));
    sigterm(&child);
    let (status, stdout) = wait_ledger(child, &log, Duration::from_secs(30));
    assert_eq!(status.code(), Some(0), "{}", tail(&log));
    assert!(stdout.contains("stopped: Shutdown"), "{stdout}");
    assert_eq!(summary(&stdout)["balances"], "unchecked");

    // What is still in the queue, by line; everything else was settled by the stopped run.
    let (ready, unacked) = queue_counts(&queue);
    assert_eq!(unacked, 0);
    let total = expected().lines;
    assert!(
        ready > 0 && ready < total,
        "stopped mid-stream: {ready} of {total} left"
    );
    let connection = connect().await;
    let channel = connection.create_channel().await.unwrap();
    let mut remaining: BTreeSet<u64> = BTreeSet::new();
    while let Some(message) = channel
        .basic_get(queue.as_str().into(), BasicGetOptions { no_ack: false })
        .await
        .unwrap()
    {
        let id = message.delivery.properties.message_id().clone().unwrap();
        let line: u64 = id.as_str().strip_prefix("line-").unwrap().parse().unwrap();
        assert!(remaining.insert(line), "line {line} twice in the queue");
    }
    assert_eq!(remaining.len() as u64, ready);
    // Unacked gets go back to the queue with the channel.
    channel.close(200, "OK".into()).await.unwrap();

    let state = db_state(&db).await;
    let events: BTreeMap<u64, String> = sample_event_ids();
    let mut settled_valid = 0;
    for (line, key) in &events {
        if !remaining.contains(line) {
            settled_valid += 1;
            assert!(
                state.processed_keys.contains(key),
                "line {line} ({key}) was settled but its event is not committed"
            );
        }
    }
    assert!(settled_valid > 0);

    // The rest, to the end.
    let stdout = run_ledger(&args, &db, &log);
    assert_eq!(summary(&stdout)["balances"], "ok");
    assert_ledger_exact(&db_state(&db).await);
    assert_eq!(queue_counts(&queue), (0, 0));
    connection.close(200, "OK".into()).await.ok();
}

/// Two consumer processes on one queue, with 20 % extra duplicates from the publisher: exact
/// balances.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn amqp_two_workers_with_injected_duplicates() {
    let _serial = SERIAL.lock().await;
    let queue = unique("ledger_two");
    let db = fresh_database(&unique("amqp_two")).await;
    let log = log_file("amqp_two");
    let url = env("AMQP_URL");
    let published = run_ledger(
        &[
            "publish",
            "--to",
            &url,
            "--queue",
            &queue,
            "--duplicate",
            "20",
            "--seed",
            "7",
        ],
        &db,
        &log,
    );
    assert!(published.contains("published"), "{published}");
    let (ready, _) = queue_counts(&queue);
    assert!(
        ready > expected().lines + 5000,
        "duplicates injected: {ready}"
    );

    let args = [
        "--source",
        &url,
        "--queue",
        &queue,
        "--concurrency",
        "8",
        "--idle-exit",
        "1.5",
        "--no-check",
    ];
    let a = spawn_ledger(&args, &db, &log);
    // The demo creates its tables at start, and PostgreSQL's CREATE TABLE IF NOT EXISTS is not
    // safe against a concurrent twin: start the second once the first is consuming.
    wait_for_handlers(&log);
    let b = spawn_ledger(&args, &db, &log.with_extension("b.log"));
    let (status_a, out_a) = wait_ledger(a, &log, Duration::from_secs(120));
    let (status_b, out_b) = wait_ledger(b, &log.with_extension("b.log"), Duration::from_secs(120));
    assert!(status_a.success() && status_b.success(), "{}", tail(&log));
    let (sa, sb) = (summary(&out_a), summary(&out_b));
    let count = |s: &BTreeMap<String, String>, k: &str| s[k].parse::<u64>().unwrap();
    assert!(
        count(&sa, "processed") > 0 && count(&sb, "processed") > 0,
        "both worked"
    );
    assert_eq!(
        count(&sa, "processed") + count(&sb, "processed"),
        expected().processed
    );
    assert_eq!(
        count(&sa, "processed")
            + count(&sb, "processed")
            + count(&sa, "duplicates")
            + count(&sb, "duplicates")
            + count(&sa, "conflicts")
            + count(&sb, "conflicts")
            + count(&sa, "rejected")
            + count(&sb, "rejected"),
        ready
    );
    assert_ledger_exact(&db_state(&db).await);
    assert_eq!(queue_counts(&queue), (0, 0));
}

/// A fresh PostgreSQL database with the inbox and the outbox.
async fn outbox_pool() -> sqlx::PgPool {
    let pool = inbox_tests::pg_pool(4).await;
    inbox_runtime::migrate_components(
        &pool,
        &[
            inbox_runtime::Component::Inbox,
            inbox_runtime::Component::Outbox,
        ],
    )
    .await
    .unwrap();
    pool
}

/// `(message_id, status, attempts, last_error)` of every outbox row, by id.
async fn outbox_rows(pool: &sqlx::PgPool) -> Vec<(String, String, i32, Option<String>)> {
    sqlx::query_as("SELECT message_id, status, attempts, last_error FROM inbox_outbox ORDER BY id")
        .fetch_all(pool)
        .await
        .unwrap()
}

/// Deletes `queue` if it exists.
async fn delete_queue(connection: &Connection, queue: &str) {
    let channel = connection.create_channel().await.unwrap();
    channel
        .queue_delete(queue.into(), Default::default())
        .await
        .ok();
}

/// Relay rounds until `rows` rows went out (sent or dead), or 30 s passed; the sum of the rounds.
async fn relay_rounds<DB: inbox_runtime::store::OutboxDatabase>(
    relay: &inbox_runtime::outbox::Relay<DB>,
    rows: usize,
) -> inbox_runtime::outbox::RoundReport {
    let deadline = Instant::now() + Duration::from_secs(30);
    let mut total = inbox_runtime::outbox::RoundReport::default();
    while total.published + total.dead < rows && Instant::now() < deadline {
        let round = relay.run_once().await.unwrap();
        total.leased += round.leased;
        total.published += round.published;
        total.failed += round.failed;
        total.dead += round.dead;
        if round.leased == 0 {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
    total
}

/// The RabbitMQ sink end to end: what the relay publishes comes back through the RabbitMQ source
/// with the same message id, name, headers and payload; a re-publish carries the same id; a
/// destination with no queue is retried as unroutable, and goes out once its queue exists; what
/// AMQP cannot carry (a 300-byte header name) is dead at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn amqp_sink_round_trip_through_the_amqp_source() {
    use inbox_runtime::outbox::{Outbox, OutboxMessage, Relay};
    use inbox_runtime::sink::amqp::{AmqpSink, AmqpSinkConfig};

    let _serial = SERIAL.lock().await;
    let queue = unique("outbox_amqp");
    let missing = unique("outbox_amqp_missing");
    let connection = connect().await;
    delete_queue(&connection, &queue).await;
    delete_queue(&connection, &missing).await;
    const OUTBOX: Outbox = Outbox::new(&["orders", "nowhere"]);

    let pool = outbox_pool().await;
    let mut tx = pool.begin().await.unwrap();
    let mut sent = Vec::new();
    for i in 1..=3 {
        let payload = format!(r#"{{"order_id":"order-{i}","amount":{}}}"#, i * 100);
        let id = OUTBOX
            .publish(
                &mut *tx,
                OutboxMessage::raw("orders", "orders.paid", payload.clone())
                    .header("trace-id", format!("t-{i}"))
                    .header("tenant", "acme")
                    .aggregate(format!("order-{i}")),
            )
            .await
            .unwrap();
        sent.push((id, payload, format!("t-{i}")));
    }
    let unroutable = OUTBOX
        .publish(
            &mut *tx,
            OutboxMessage::raw("nowhere", "orders.paid", "{}").aggregate("other"),
        )
        .await
        .unwrap();
    let long_header = "h".repeat(300);
    let too_long = OUTBOX
        .publish(
            &mut *tx,
            OutboxMessage::raw("orders", "orders.paid", "{}")
                .header(long_header.as_str(), "x")
                .aggregate("poison"),
        )
        .await
        .unwrap();
    tx.commit().await.unwrap();

    // `orders` → the queue `queue` on the default exchange (declared by the sink); `nowhere` →
    // the queue `missing`, which does not exist yet.
    let config = AmqpSinkConfig::new(env("AMQP_URL"))
        .route("orders", "", &queue)
        .route("nowhere", "", &missing)
        .declare(false);
    let channel = connection.create_channel().await.unwrap();
    channel
        .queue_declare(
            queue.as_str().into(),
            QueueDeclareOptions::durable(),
            FieldTable::default(),
        )
        .await
        .unwrap();
    let relay = Relay::new(pool.clone(), AmqpSink::connect(config).await.unwrap())
        .backoff(Duration::from_millis(50), Duration::from_millis(50));
    let first = relay_rounds(&relay, 4).await;
    assert_eq!((first.published, first.dead), (3, 1), "{first:?}");
    assert!(first.failed >= 1, "the unroutable row failed: {first:?}");

    let rows = outbox_rows(&pool).await;
    assert_eq!(rows[3].0, unroutable);
    assert_eq!(rows[3].1, "pending", "unroutable is retryable: {rows:?}");
    let error = rows[3].3.as_deref().unwrap();
    assert!(
        error.starts_with("retryable: unroutable: RabbitMQ returned the message (312 NO_ROUTE)"),
        "{error}"
    );
    assert_eq!(rows[4].0, too_long);
    assert_eq!(rows[4].1, "dead");
    assert_eq!(rows[4].2, 1, "dead at the first attempt");
    assert_eq!(
        rows[4].3.as_deref(),
        Some(
            format!(
                "permanent: the header name {long_header:?} is 300 bytes; AMQP allows at most 255"
            )
            .as_str()
        )
    );

    // Its queue declared, the unroutable row goes out at its next attempt.
    channel
        .queue_declare(
            missing.as_str().into(),
            QueueDeclareOptions::durable(),
            FieldTable::default(),
        )
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_millis(60)).await;
    assert_eq!(relay_rounds(&relay, 1).await.published, 1);
    assert_eq!(queue_counts(&missing), (1, 0));

    // As after a crash before the mark: the rows go again, with the same message ids (RabbitMQ
    // keeps both copies; the consumer's inbox deduplicates on the key).
    sqlx::query("UPDATE inbox_outbox SET status = 'pending' WHERE status = 'sent' AND destination = 'orders'")
        .execute(&pool)
        .await
        .unwrap();
    assert_eq!(relay_rounds(&relay, 3).await.published, 3);
    assert_eq!(queue_counts(&queue), (6, 0));

    let config = AmqpSource::connect(AmqpConfig::new(env("AMQP_URL"), &queue).prefetch(10));
    let mut source = config.await.unwrap();
    for copy in 0..2 {
        for (id, payload, trace) in &sent {
            let delivery = tokio::time::timeout(Duration::from_secs(10), source.next())
                .await
                .unwrap()
                .unwrap()
                .unwrap();
            let envelope = delivery.envelope().clone();
            let meta = envelope.source.as_ref().unwrap();
            assert_eq!(envelope.message_name, "orders.paid", "copy {copy}");
            assert_eq!(envelope.payload, payload.as_bytes());
            assert_eq!(meta.message_id.as_deref(), Some(id.as_str()));
            assert_eq!(meta.source, queue);
            assert_eq!(
                envelope.headers,
                BTreeMap::from([
                    ("message-name".to_owned(), "orders.paid".to_owned()),
                    ("tenant".to_owned(), "acme".to_owned()),
                    ("trace-id".to_owned(), trace.clone()),
                ])
            );
            delivery.ack().await.unwrap();
        }
    }
    source.close().await.unwrap();
    assert_eq!(queue_counts(&queue), (0, 0));
    delete_queue(&connection, &queue).await;
    delete_queue(&connection, &missing).await;
    connection.close(200, "OK".into()).await.ok();
}

/// RabbitMQ restarted while a relay publishes through the RabbitMQ sink (rows written all along):
/// the sink reconnects by itself, every row ends `sent`, none `dead`, and every message id is in
/// the queue (some possibly twice: a confirm lost in the restart is re-published with the same
/// id).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn amqp_sink_survives_a_broker_restart() {
    use inbox_runtime::outbox::{Outbox, OutboxMessage, Relay};
    use inbox_runtime::sink::amqp::{AmqpSink, AmqpSinkConfig};

    let _serial = SERIAL.lock().await;
    let queue = unique("outbox_restart");
    let connection = connect().await;
    delete_queue(&connection, &queue).await;
    connection.close(200, "OK".into()).await.ok();
    const OUTBOX: Outbox = Outbox::new(&["events"]);

    let pool = outbox_pool().await;
    let config = AmqpSinkConfig::new(env("AMQP_URL"))
        .route("events", "", &queue)
        .declare(true);
    let relay = Relay::new(pool.clone(), AmqpSink::connect(config).await.unwrap())
        .batch_size(50)
        .poll_interval(Duration::from_millis(50))
        .backoff(Duration::from_millis(100), Duration::from_millis(500))
        .max_attempts(10_000);
    let shutdown = tokio_util::sync::CancellationToken::new();
    let relay = tokio::spawn(relay.run(shutdown.clone()));

    // Rows written all along: 10 every 20 ms, until 1 s after the broker is back.
    let writing = tokio_util::sync::CancellationToken::new();
    let writer = {
        let (pool, writing) = (pool.clone(), writing.clone());
        tokio::spawn(async move {
            let mut written = 0_u32;
            while !writing.is_cancelled() {
                let mut tx = pool.begin().await.unwrap();
                for _ in 0..10 {
                    written += 1;
                    OUTBOX
                        .publish(
                            &mut *tx,
                            OutboxMessage::raw("events", "event", format!(r#"{{"n":{written}}}"#))
                                .aggregate(format!("a-{}", written % 50)),
                        )
                        .await
                        .unwrap();
                }
                tx.commit().await.unwrap();
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            written
        })
    };
    let sent = |pool: sqlx::PgPool| async move {
        inbox_tests::count(
            &pool,
            "SELECT COUNT(*) FROM inbox_outbox WHERE status = 'sent'",
        )
        .await
    };
    let deadline = Instant::now() + Duration::from_secs(60);
    while sent(pool.clone()).await < 100 {
        assert!(Instant::now() < deadline, "the relay published nothing");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let before = sent(pool.clone()).await;
    let down = tokio::task::spawn_blocking(restart_rabbitmq).await.unwrap();
    tokio::time::sleep(Duration::from_secs(1)).await;
    writing.cancel();
    let written = i64::from(writer.await.unwrap());
    assert!(
        before < written,
        "the restart came mid-stream ({before} of {written} sent)"
    );

    let deadline = Instant::now() + Duration::from_secs(90);
    while sent(pool.clone()).await < written {
        assert!(
            Instant::now() < deadline,
            "not every row was sent: {} of {written}: {:?}",
            sent(pool.clone()).await,
            outbox_rows(&pool).await.iter().find(|r| r.1 != "sent")
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    shutdown.cancel();
    let report = relay.await.unwrap();
    let dead = inbox_tests::count(
        &pool,
        "SELECT COUNT(*) FROM inbox_outbox WHERE status <> 'sent'",
    )
    .await;
    assert_eq!(dead, 0);

    // Every message id in the queue, at least once.
    let ids: BTreeSet<String> = outbox_rows(&pool).await.into_iter().map(|r| r.0).collect();
    assert_eq!(ids.len() as i64, written);
    let (ready, _) = queue_counts(&queue);
    let connection = connect().await;
    let channel = connection.create_channel().await.unwrap();
    let mut seen = BTreeMap::<String, u32>::new();
    while let Some(message) = channel
        .basic_get(queue.as_str().into(), BasicGetOptions { no_ack: true })
        .await
        .unwrap()
    {
        let id = message.delivery.properties.message_id().clone().unwrap();
        *seen.entry(id.as_str().to_owned()).or_default() += 1;
    }
    assert_eq!(seen.values().map(|n| u64::from(*n)).sum::<u64>(), ready);
    let seen_ids: BTreeSet<String> = seen.keys().cloned().collect();
    assert_eq!(
        seen_ids, ids,
        "every row's message id is in the queue, no other"
    );
    let twice = seen.values().filter(|n| **n > 1).count();
    eprintln!(
        "amqp sink: RabbitMQ down for {down:?} after {before} of {written} rows; relay: {report:?}; \
         {twice} message ids in the queue twice"
    );
    delete_queue(&connection, &queue).await;
    connection.close(200, "OK".into()).await.ok();
}
