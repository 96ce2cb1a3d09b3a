//! The RabbitMQ source and the ledger demo on a real RabbitMQ (`AMQP_URL`, started by
//! `scripts/test.sh`), with PostgreSQL (`DATABASE_URL`).
//!
//! The tests of this file run one at a time (they read broker-wide counters, and they time
//! SIGKILLs against the demo's progress).

#![allow(missing_docs)]

#[path = "ledger_support.rs"]
mod support;

use std::collections::{BTreeMap, BTreeSet};
use std::process::Command;
use std::time::Duration;

use inbox_runtime::Envelope;
use inbox_runtime::source::amqp::{AmqpConfig, AmqpSource};
use inbox_runtime::source::{Settlement, Source};
use lapin::options::{BasicGetOptions, BasicPublishOptions, QueueDeclareOptions};
use lapin::types::{AMQPValue, FieldTable};
use lapin::{BasicProperties, Connection, ConnectionProperties};
use support::*;

/// One test at a time.
static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

fn rabbitmqctl(args: &[&str]) -> String {
    let output = Command::new(root().join("scripts/brokers.sh"))
        .arg("rabbitmqctl")
        .args(args)
        .output()
        .unwrap();
    assert!(
        output.status.success(),
        "rabbitmqctl {args:?}: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    String::from_utf8(output.stdout).unwrap()
}

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
