//! The NATS JetStream source and the ledger demo on a real nats-server (`NATS_URL`, started by
//! `scripts/test.sh`), with PostgreSQL (`DATABASE_URL`).
//!
//! The tests of this file run one at a time (they time SIGKILLs against the demo's progress).

#![allow(missing_docs)]

#[path = "ledger_support.rs"]
mod support;

use std::collections::BTreeMap;
use std::time::Duration;

use async_nats::jetstream::{self, consumer, stream};
use inbox_runtime::source::nats::{NatsConfig, NatsSource};
use inbox_runtime::source::{Settlement, Source};
use support::*;

/// One test at a time.
static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

async fn context() -> jetstream::Context {
    jetstream::new(async_nats::connect(env("NATS_URL")).await.unwrap())
}

/// The durable consumer's state, as the server reports it.
async fn consumer_info(stream: &str, consumer: &str) -> consumer::Info {
    context()
        .await
        .get_stream(stream)
        .await
        .unwrap()
        .consumer_info(consumer)
        .await
        .unwrap()
}

/// A stream (deleted first if it exists) on `subject`.
async fn fresh_stream(name: &str, subject: &str) -> stream::Stream {
    let context = context().await;
    let _ = context.delete_stream(name).await;
    context
        .create_stream(stream::Config {
            name: name.into(),
            subjects: vec![subject.into()],
            ..Default::default()
        })
        .await
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nats_source_maps_and_settles_deliveries() {
    let _serial = SERIAL.lock().await;
    let name = unique("UNIT").to_uppercase();
    let subject = format!("unit.{}", std::process::id());
    fresh_stream(&name, &format!("{subject}.>")).await;
    let context = context().await;
    let mut headers = async_nats::HeaderMap::new();
    headers.insert("message-name", "a.header");
    headers.insert("order", "k-1");
    headers.insert("Nats-Msg-Id", "m-1");
    for (suffix, headers, body) in [
        ("x", headers, "1"),
        ("b.subject", async_nats::HeaderMap::new(), "2"),
        ("c", async_nats::HeaderMap::new(), "3"),
    ] {
        context
            .publish_with_headers(format!("{subject}.{suffix}"), headers, body.into())
            .await
            .unwrap()
            .await
            .unwrap();
    }

    let config = NatsConfig::new(env("NATS_URL"), &name, "unit")
        .ack_wait(Duration::from_secs(1))
        .subject_prefix(format!("{subject}."))
        .ordering_key_header("order");
    let mut source = NatsSource::connect(config).await.unwrap();
    assert_eq!(source.name(), format!("{name}/unit"));
    let mut deliveries = Vec::new();
    for _ in 0..3 {
        deliveries.push(source.next().await.unwrap().unwrap());
    }
    let names: Vec<&str> = deliveries
        .iter()
        .map(|d| d.envelope().message_name.as_str())
        .collect();
    assert_eq!(names, ["a.header", "b.subject", "c"]);
    let meta = deliveries[0].envelope().source.clone().unwrap();
    assert_eq!(meta.offset, Some(1), "the stream sequence");
    assert_eq!(meta.delivery_count, Some(1));
    assert_eq!(meta.message_id.as_deref(), Some("m-1"));
    assert_eq!(deliveries[0].ordering_key(), Some("k-1"));
    assert_eq!(deliveries[0].envelope().payload, b"1");

    // Ack 1, reject (TERM) 2, requeue 3 with a 200 ms delay.
    let mut it = deliveries.into_iter();
    it.next().unwrap().ack().await.unwrap();
    it.next().unwrap().reject().await.unwrap();
    let started = std::time::Instant::now();
    it.next()
        .unwrap()
        .settle(Settlement::Requeue {
            delay: Some(Duration::from_millis(200)),
        })
        .await
        .unwrap();
    let again = tokio::time::timeout(Duration::from_secs(5), source.next())
        .await
        .unwrap()
        .unwrap()
        .unwrap();
    assert!(
        started.elapsed() >= Duration::from_millis(190),
        "NAK delay honoured"
    );
    let meta = again.envelope().source.clone().unwrap();
    assert_eq!(
        (meta.offset, meta.delivery_count, meta.redelivered),
        (Some(3), Some(2), true)
    );
    // Abandoned: JetStream redelivers it after AckWait (1 s).
    drop(again);
    let third = tokio::time::timeout(Duration::from_secs(5), source.next())
        .await
        .unwrap()
        .unwrap()
        .unwrap();
    assert_eq!(
        third.envelope().source.as_ref().unwrap().delivery_count,
        Some(3)
    );
    third.ack().await.unwrap();
    source.close().await.unwrap();
    tokio::time::sleep(Duration::from_millis(100)).await;
    let info = consumer_info(&name, "unit").await;
    assert_eq!((info.num_pending, info.num_ack_pending), (0, 0));
    assert_eq!(
        info.delivered.consumer_sequence, 5,
        "3 messages, 2 redeliveries"
    );
    context.delete_stream(&name).await.unwrap();
}

/// `ledger publish` then `ledger --source`, SIGKILLed 5 times at random moments and restarted:
/// exact balances, every valid event applied once, nothing pending or unacked on the consumer,
/// redeliveries counted by JetStream.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nats_ledger_survives_five_sigkills() {
    let _serial = SERIAL.lock().await;
    let stream = unique("KILL").to_uppercase();
    let subject = format!("ledger.kill.{}", std::process::id());
    let db = fresh_database(&unique("nats_kill")).await;
    let log = log_file("nats_kill");
    let url = env("NATS_URL");
    let _ = context().await.delete_stream(&stream).await;
    run_ledger(
        &[
            "publish",
            "--to",
            &url,
            "--stream",
            &stream,
            "--subject",
            &subject,
        ],
        &db,
        &log,
    );
    let args = [
        "--source",
        &url,
        "--stream",
        &stream,
        "--concurrency",
        "16",
        "--ack-wait",
        "1",
        "--idle-exit",
        "2",
        // An original redelivered after its ack wait can come after its conflicting variant:
        // which one applies is a race, checked below against what the inbox applied.
        "--no-check",
    ];
    let stdout = kill_and_restart(&args, &db, &log, 5, 0xBEEF);
    assert_eq!(summary(&stdout)["balances"], "unchecked", "{}", tail(&log));

    assert_ledger_exact(&db_state(&db).await);
    let info = consumer_info(&stream, "ledger").await;
    assert_eq!(info.num_pending, 0, "nothing left to deliver");
    assert_eq!(info.num_ack_pending, 0, "nothing delivered and unacked");
    assert_eq!(info.ack_floor.stream_sequence, expected().lines);
    let redeliveries = info.delivered.consumer_sequence - expected().lines;
    assert!(redeliveries > 0, "JetStream redelivered nothing");
    eprintln!("nats: JetStream redelivered {redeliveries} messages after 5 SIGKILLs");
    context().await.delete_stream(&stream).await.unwrap();
}

/// SIGTERM mid-stream: exit code 0, and every message up to the consumer's ack floor has its
/// event committed; then a second run completes the ledger exactly.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nats_ledger_sigterm_acks_only_committed() {
    let _serial = SERIAL.lock().await;
    let stream = unique("TERM").to_uppercase();
    let subject = format!("ledger.term.{}", std::process::id());
    let db = fresh_database(&unique("nats_term")).await;
    let log = log_file("nats_term");
    let url = env("NATS_URL");
    let _ = context().await.delete_stream(&stream).await;
    run_ledger(
        &[
            "publish",
            "--to",
            &url,
            "--stream",
            &stream,
            "--subject",
            &subject,
        ],
        &db,
        &log,
    );
    let args = [
        "--source",
        &url,
        "--stream",
        &stream,
        "--ack-wait",
        "1",
        "--idle-exit",
        "2",
    ];
    let child = spawn_ledger(&args, &db, &log);
    wait_for_handlers(&log);
    std::thread::sleep(Duration::from_millis(700));
    sigterm(&child);
    let (status, stdout) = wait_ledger(child, &log, Duration::from_secs(30));
    assert_eq!(status.code(), Some(0), "{}", tail(&log));
    assert!(stdout.contains("stopped: Shutdown"), "{stdout}");

    let info = consumer_info(&stream, "ledger").await;
    let floor = info.ack_floor.stream_sequence;
    let total = expected().lines;
    assert!(
        floor > 0 && floor < total,
        "stopped mid-stream: ack floor {floor} of {total}"
    );
    // Stream sequence n is line n (published in order, no duplicates added).
    let state = db_state(&db).await;
    let events: BTreeMap<u64, String> = sample_event_ids();
    for (line, key) in events.range(1..=floor) {
        assert!(
            state.processed_keys.contains(key),
            "line {line} ({key}) is below the ack floor but its event is not committed"
        );
    }

    let stdout = run_ledger(&args, &db, &log);
    assert_eq!(summary(&stdout)["balances"], "ok");
    assert_ledger_exact(&db_state(&db).await);
    context().await.delete_stream(&stream).await.unwrap();
}

/// Two consumer processes on one durable consumer, with 20 % extra duplicates from the
/// publisher: exact balances.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nats_two_workers_with_injected_duplicates() {
    let _serial = SERIAL.lock().await;
    let stream = unique("TWO").to_uppercase();
    let subject = format!("ledger.two.{}", std::process::id());
    let db = fresh_database(&unique("nats_two")).await;
    let log = log_file("nats_two");
    let url = env("NATS_URL");
    let _ = context().await.delete_stream(&stream).await;
    run_ledger(
        &[
            "publish",
            "--to",
            &url,
            "--stream",
            &stream,
            "--subject",
            &subject,
            "--duplicate",
            "20",
            "--seed",
            "7",
        ],
        &db,
        &log,
    );
    let messages = context()
        .await
        .get_stream(&stream)
        .await
        .unwrap()
        .info()
        .await
        .unwrap()
        .state
        .messages;
    assert!(
        messages > expected().lines + 5000,
        "duplicates injected: {messages}"
    );

    let args = [
        "--source",
        &url,
        "--stream",
        &stream,
        "--concurrency",
        "8",
        "--ack-wait",
        "5",
        "--idle-exit",
        "2",
        "--no-check",
    ];
    let log_b = log.with_extension("b.log");
    let a = spawn_ledger(&args, &db, &log);
    // The demo creates its tables at start, and PostgreSQL's CREATE TABLE IF NOT EXISTS is not
    // safe against a concurrent twin: start the second once the first is consuming.
    wait_for_handlers(&log);
    let b = spawn_ledger(&args, &db, &log_b);
    let (status_a, out_a) = wait_ledger(a, &log, Duration::from_secs(120));
    let (status_b, out_b) = wait_ledger(b, &log_b, Duration::from_secs(120));
    assert!(status_a.success() && status_b.success(), "{}", tail(&log));
    let processed = |out: &str| summary(out)["processed"].parse::<u64>().unwrap();
    assert!(
        processed(&out_a) > 0 && processed(&out_b) > 0,
        "both worked"
    );
    assert_eq!(processed(&out_a) + processed(&out_b), expected().processed);
    assert_ledger_exact(&db_state(&db).await);
    let info = consumer_info(&stream, "ledger").await;
    assert_eq!((info.num_pending, info.num_ack_pending), (0, 0));
    context().await.delete_stream(&stream).await.unwrap();
}
