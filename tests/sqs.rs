//! The Amazon SQS source and sink (feature `sqs`) against a real SQS-compatible server: moto in
//! server mode on loopback (`SQS_ENDPOINT`, with `AWS_REGION` and dummy credentials, started by
//! `scripts/test.sh` through `scripts/sqs.sh`), with SQLite.
//!
//! Moto accepts stale receipt handles (SQS does not): no test here relies on a delete with an
//! old handle; every delete that counts is made with the handle of the receive that got it.
//!
//! The tests of this file run one at a time (they time visibility timeouts).

#![allow(missing_docs)]

#[path = "ledger_support.rs"]
mod support;

use std::collections::HashMap;
use std::sync::Mutex as StdMutex;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::time::{Duration, Instant};

use aws_sdk_sqs::Client;
use aws_sdk_sqs::types::{MessageAttributeValue, QueueAttributeName};
use inbox_runtime::outbox::{Outbox, OutboxMessage, Relay};
use inbox_runtime::sink::sqs::SqsSink;
use inbox_runtime::source::sqs::{AwsSettings, SqsConfig, SqsCounts, SqsSource};
use inbox_runtime::source::{Settlement, Source};
use inbox_runtime::{
    CancellationToken, Classify, Component, Dispatcher, ErrorClass, Worker, WorkerReport,
};
use inbox_tests::{APPLY_EFFECT, TempFile, effect};
use sqlx::SqlitePool;

/// One test at a time.
static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

fn env(name: &str) -> String {
    std::env::var(name).unwrap_or_else(|_| {
        panic!(
            "{name} is not set: run the tests with scripts/test.sh, which starts moto \
             (or: exports=$(scripts/sqs.sh start); eval \"$exports\")"
        )
    })
}

fn settings() -> AwsSettings {
    AwsSettings::default().endpoint_url(env("SQS_ENDPOINT"))
}

async fn client() -> Client {
    inbox_runtime::source::sqs::client(&settings(), Duration::from_secs(20)).await
}

fn logs() {
    let _ = tracing_subscriber::fmt()
        .with_env_filter(std::env::var("RUST_LOG").unwrap_or_else(|_| "inbox_runtime=info".into()))
        .with_test_writer()
        .try_init();
}

/// A new queue (a unique name from `prefix`; FIFO if `fifo`) with the visibility timeout
/// `visibility` seconds; returns its name and URL.
async fn queue(client: &Client, prefix: &str, fifo: bool, visibility: u32) -> (String, String) {
    let mut name = format!("{prefix}-{}", inbox_tests::unique_name("q"));
    let mut create = client.create_queue().attributes(
        QueueAttributeName::VisibilityTimeout,
        visibility.to_string(),
    );
    if fifo {
        name.push_str(".fifo");
        create = create.attributes(QueueAttributeName::FifoQueue, "true");
    }
    let url = create
        .queue_name(&name)
        .send()
        .await
        .expect("create the queue")
        .queue_url
        .unwrap();
    (name, url)
}

/// Sends one message: body, name attribute (if any), FIFO group and deduplication id (if any).
async fn send(client: &Client, url: &str, body: &str, name: Option<&str>, group: Option<&str>) {
    let mut send = client.send_message().queue_url(url).message_body(body);
    if let Some(name) = name {
        send = send.message_attributes(
            "message-name",
            MessageAttributeValue::builder()
                .data_type("String")
                .string_value(name)
                .build()
                .unwrap(),
        );
    }
    if let Some(group) = group {
        send = send.message_group_id(group).message_deduplication_id(
            format!("{group}-{body}").replace(['{', '}', '"', ':', ','], "_"),
        );
    }
    send.send().await.expect("send a message");
}

/// Messages in the queue, visible and in flight (SQS's approximate counts; exact on moto).
async fn queue_depth(client: &Client, url: &str) -> (i64, i64) {
    let attributes = client
        .get_queue_attributes()
        .queue_url(url)
        .attribute_names(QueueAttributeName::All)
        .send()
        .await
        .unwrap()
        .attributes
        .unwrap_or_default();
    let get = |name: QueueAttributeName| {
        attributes
            .get(&name)
            .and_then(|v| v.parse().ok())
            .unwrap_or(-1)
    };
    (
        get(QueueAttributeName::ApproximateNumberOfMessages),
        get(QueueAttributeName::ApproximateNumberOfMessagesNotVisible),
    )
}

#[derive(Debug, Clone, serde::Serialize, serde::Deserialize, inbox_runtime::Message)]
#[message(name = "sqs.credit")]
struct Credit {
    #[message(key)]
    id: String,
    amount: i64,
    /// The FIFO group it was sent in and its place there ("" and 0 on standard queues).
    group: String,
    seq: i64,
}

fn credit(id: &str, amount: i64, group: &str, seq: i64) -> String {
    serde_json::to_string(&Credit {
        id: id.into(),
        amount,
        group: group.into(),
        seq,
    })
    .unwrap()
}

#[derive(Debug, thiserror::Error)]
enum CreditError {
    #[error("flaky dependency")]
    Flaky,
    #[error(transparent)]
    Db(#[from] sqlx::Error),
}

impl Classify for CreditError {
    fn class(&self) -> ErrorClass {
        match self {
            CreditError::Flaky => ErrorClass::Retryable,
            CreditError::Db(error) => error.class(),
        }
    }
}

/// How many times each id's handler body started.
static STARTED: StdMutex<Option<HashMap<String, u32>>> = StdMutex::new(None);
/// Ids starting with this prefix: their handler sleeps this long.
static SLOW: StdMutex<Option<(String, Duration)>> = StdMutex::new(None);
/// The id whose first attempt fails (retryable), and whether it has failed yet.
static FAIL_ONCE: StdMutex<Option<String>> = StdMutex::new(None);
static FAILED: AtomicBool = AtomicBool::new(false);

#[inbox_runtime::idempotent(consumer = "sqs-credits")]
async fn apply_credit(conn: &mut sqlx::SqliteConnection, msg: Credit) -> Result<(), CreditError> {
    *STARTED
        .lock()
        .unwrap()
        .get_or_insert_with(HashMap::new)
        .entry(msg.id.clone())
        .or_default() += 1;
    let slow = SLOW.lock().unwrap().clone();
    if let Some((prefix, pause)) = slow
        && msg.id.starts_with(&prefix)
    {
        tokio::time::sleep(pause).await;
    }
    if FAIL_ONCE.lock().unwrap().as_deref() == Some(msg.id.as_str())
        && !FAILED.swap(true, Ordering::SeqCst)
    {
        return Err(CreditError::Flaky);
    }
    sqlx::query(APPLY_EFFECT)
        .bind(&msg.id)
        .bind(msg.amount)
        .execute(&mut *conn)
        .await?;
    sqlx::query("INSERT INTO sqs_seen (grp, seq) VALUES ($1, $2)")
        .bind(&msg.group)
        .bind(msg.seq)
        .execute(&mut *conn)
        .await?;
    Ok(())
}

fn reset_hooks() {
    *STARTED.lock().unwrap() = None;
    *SLOW.lock().unwrap() = None;
    *FAIL_ONCE.lock().unwrap() = None;
    FAILED.store(false, Ordering::SeqCst);
}

fn started(id: &str) -> u32 {
    STARTED
        .lock()
        .unwrap()
        .as_ref()
        .and_then(|s| s.get(id).copied())
        .unwrap_or(0)
}

async fn pool() -> (SqlitePool, TempFile) {
    let (pool, guard) = inbox_tests::sqlite_pool(4).await;
    inbox_runtime::migrate_components(&pool, &[Component::Inbox, Component::Outbox])
        .await
        .unwrap();
    sqlx::raw_sql(
        "CREATE TABLE sqs_seen (id INTEGER PRIMARY KEY AUTOINCREMENT, grp TEXT NOT NULL, \
         seq BIGINT NOT NULL)",
    )
    .execute(&pool)
    .await
    .unwrap();
    (pool, guard)
}

fn dispatcher(pool: &SqlitePool) -> Dispatcher<sqlx::Sqlite> {
    Dispatcher::from_handlers(pool.clone(), [inbox_runtime::handler!(apply_credit)]).unwrap()
}

/// `(group, seq)` in the order the effects were applied.
async fn seen(pool: &SqlitePool) -> Vec<(String, i64)> {
    sqlx::query_as("SELECT grp, seq FROM sqs_seen ORDER BY id")
        .fetch_all(pool)
        .await
        .unwrap()
}

/// A config for `url` with short polls (1 s) and the visibility timeout `visibility` seconds.
fn config(url: &str, visibility: u64) -> SqsConfig {
    SqsConfig::new(url)
        .aws(settings())
        .wait_time(Duration::from_secs(1))
        .visibility_timeout(Duration::from_secs(visibility))
}

/// A worker over `config`'s queue in a task, stopped by its token.
struct Running {
    stop: CancellationToken,
    task: tokio::task::JoinHandle<WorkerReport>,
    stats: inbox_runtime::source::sqs::SqsStats,
}

impl Running {
    async fn start(pool: &SqlitePool, config: SqsConfig, concurrency: usize) -> Self {
        logs();
        let source = SqsSource::connect(config).await.unwrap();
        let stats = source.stats();
        let worker = Worker::new(dispatcher(pool))
            .concurrency(concurrency)
            .requeue_delay(Duration::from_secs(1))
            .drain_timeout(Duration::from_secs(30));
        let stop = CancellationToken::new();
        let token = stop.clone();
        let task =
            tokio::spawn(async move { worker.run(source, token).await.expect("the worker runs") });
        Self { stop, task, stats }
    }

    async fn stop(self) -> (WorkerReport, SqsCounts) {
        self.stop.cancel();
        let report = tokio::time::timeout(Duration::from_secs(60), self.task)
            .await
            .expect("the worker stops")
            .expect("the worker task");
        (report, self.stats.counts())
    }
}

/// Waits until `check` holds, polling every 100 ms, up to `deadline`; panics with `what`.
async fn wait_until<F, Fut>(what: &str, deadline: Duration, mut check: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let until = Instant::now() + deadline;
    while !check().await {
        assert!(Instant::now() < until, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqs_source_maps_and_settles_deliveries() {
    let _serial = SERIAL.lock().await;
    let client = client().await;
    let (name, url) = queue(&client, "unit", true, 30).await;
    send(&client, &url, "1", Some("a.name"), Some("g1")).await;
    send(&client, &url, "2", None, Some("g2")).await;
    // The same deduplication id again: dropped by the queue.
    send(&client, &url, "1", Some("a.name"), Some("g1")).await;

    // The queue by name (resolved with GetQueueUrl).
    let mut source = SqsSource::connect(
        SqsConfig::new(&name)
            .aws(settings())
            .wait_time(Duration::from_secs(1)),
    )
    .await
    .unwrap();
    assert_eq!(source.name(), name);
    let first = source.next().await.unwrap().unwrap();
    let second = source.next().await.unwrap().unwrap();
    let (first, second) = if first.envelope().payload == b"1" {
        (first, second)
    } else {
        (second, first)
    };
    assert_eq!(first.envelope().message_name, "a.name");
    assert_eq!(
        first.envelope().headers.get("message-name").unwrap(),
        "a.name"
    );
    assert_eq!(
        second.envelope().message_name,
        "",
        "no name attribute: the empty name"
    );
    assert_eq!(first.ordering_key(), Some("g1"));
    let meta = first.envelope().source.clone().unwrap();
    assert_eq!(meta.source, name);
    assert_eq!(meta.partition.as_deref(), Some("g1"));
    assert_eq!(meta.deduplication_id.as_deref(), Some("g1-1"));
    assert_eq!((meta.delivery_count, meta.redelivered), (Some(1), false));
    let sequence = meta
        .sequence_number
        .clone()
        .expect("a FIFO sequence number");
    assert!(
        sequence.len() >= 20 && sequence.bytes().all(|b| b.is_ascii_digit()),
        "kept as the broker's decimal text: {sequence}"
    );
    assert!(meta.message_id.is_some() && meta.published_at.is_some());

    // Ack deletes; requeue with 2 s makes it visible again after 2 s, as a redelivery.
    first.ack().await.unwrap();
    let requeued_at = Instant::now();
    second
        .settle(Settlement::Requeue {
            delay: Some(Duration::from_secs(2)),
        })
        .await
        .unwrap();
    let again = tokio::time::timeout(Duration::from_secs(10), source.next())
        .await
        .unwrap()
        .unwrap()
        .unwrap();
    assert!(requeued_at.elapsed() >= Duration::from_millis(1900));
    let meta = again.envelope().source.clone().unwrap();
    assert_eq!((meta.delivery_count, meta.redelivered), (Some(2), true));
    assert_eq!(again.envelope().payload, b"2");
    // Abandoned: visible again at once.
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
    assert_eq!(queue_depth(&client, &url).await, (0, 0), "both deleted");
    let counts = source.stats().counts();
    assert_eq!((counts.deleted, counts.invalid_receipts), (2, 0));
}

/// A queue that does not exist: connecting by name fails (`connect`); by URL, the first receive
/// fails (`receive`) and the source says so at once, instead of retrying forever.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_missing_queue_fails_the_source() {
    let _serial = SERIAL.lock().await;
    let error = SqsSource::connect(SqsConfig::new("no-such-queue").aws(settings()))
        .await
        .unwrap_err();
    assert_eq!(error.operation, "connect", "{error}");
    let url = format!("{}/123456789012/no-such-queue", env("SQS_ENDPOINT"));
    let mut source = SqsSource::connect(config(&url, 2)).await.unwrap();
    let error = tokio::time::timeout(Duration::from_secs(30), source.next())
        .await
        .expect("no retrying forever")
        .unwrap_err();
    assert_eq!(error.operation, "receive", "{error}");
    source.close().await.unwrap();
}

/// A fake SQS endpoint on loopback: each call's answer is `answer(its X-Amz-Target)`, a status
/// and a JSON body, or `None` to never answer (the connection is held open). Returns the
/// endpoint and the server task.
async fn fake_sqs<F>(answer: F) -> (String, tokio::task::JoinHandle<()>)
where
    F: Fn(&str) -> Option<(u16, String)> + Send + Sync + 'static,
{
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let endpoint = format!("http://{}", listener.local_addr().unwrap());
    let answer = std::sync::Arc::new(answer);
    let server = tokio::spawn(async move {
        loop {
            let (mut stream, _) = listener.accept().await.unwrap();
            let answer = answer.clone();
            tokio::spawn(async move {
                // Reads the request (headers, then Content-Length bytes).
                let mut request = Vec::new();
                let mut buffer = [0u8; 4096];
                let target = loop {
                    let n = stream.read(&mut buffer).await.unwrap_or(0);
                    if n == 0 {
                        return;
                    }
                    request.extend_from_slice(&buffer[..n]);
                    let text = String::from_utf8_lossy(&request).to_ascii_lowercase();
                    if let Some(end) = text.find("\r\n\r\n") {
                        let header = |name: &str| {
                            text.lines()
                                .find_map(|l| l.strip_prefix(name))
                                .map(|v| v.trim().to_owned())
                        };
                        let length = header("content-length:")
                            .and_then(|l| l.parse::<usize>().ok())
                            .unwrap_or(0);
                        if request.len() >= end + 4 + length {
                            break header("x-amz-target:").unwrap_or_default();
                        }
                    }
                };
                let Some((status, body)) = answer(&target) else {
                    tokio::time::sleep(Duration::from_secs(3600)).await;
                    return;
                };
                let response = format!(
                    "HTTP/1.1 {status} Fake\r\ncontent-type: application/x-amz-json-1.0\r\n\
                     content-length: {}\r\nconnection: close\r\n\r\n{body}",
                    body.len()
                );
                let _ = stream.write_all(response.as_bytes()).await;
                let _ = stream.shutdown().await;
            });
        }
    });
    (endpoint, server)
}

/// A server error (HTTP 500) with an error code the source does not know is a passing failure:
/// the receive is retried, the source does not fail. (A fake endpoint answering every call so.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_error_with_an_unknown_code_is_retried() {
    let calls = std::sync::Arc::new(AtomicU32::new(0));
    let (endpoint, server) = fake_sqs({
        let calls = calls.clone();
        move |_| {
            calls.fetch_add(1, Ordering::Relaxed);
            let body = r#"{"__type":"com.amazonaws.sqs#SomethingNew","message":"boom"}"#;
            Some((500, body.to_owned()))
        }
    })
    .await;
    logs();
    let url = format!("{endpoint}/123456789012/failing");
    let config = SqsConfig::new(url)
        .aws(AwsSettings::default().endpoint_url(&endpoint))
        .wait_time(Duration::from_secs(1));
    let mut source = SqsSource::connect(config).await.unwrap();
    // The SDK's own 3 attempts, then the source's retries: more calls, and no error.
    let next = tokio::time::timeout(Duration::from_secs(8), source.next()).await;
    assert!(
        next.is_err(),
        "the source failed: {:?}",
        next.map(|r| r.err())
    );
    let calls = calls.load(Ordering::Relaxed);
    assert!(calls > 3, "retried after the SDK's attempts: {calls} calls");
    drop(source);
    server.abort();
}

/// A visibility call that never answers does not stop the heartbeats: batch calls time out far
/// sooner than the long poll's client would (attempts of 1 s here, not 30 s), so the heartbeat
/// keeps trying within the visibility timeout. (A fake endpoint: one message received, every
/// `ChangeMessageVisibilityBatch` left unanswered.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stalled_visibility_call_does_not_stop_the_heartbeats() {
    let visibility_calls = std::sync::Arc::new(AtomicU32::new(0));
    let received = std::sync::Arc::new(AtomicBool::new(false));
    let (endpoint, server) = fake_sqs({
        let visibility_calls = visibility_calls.clone();
        move |target| {
            if target.ends_with("changemessagevisibilitybatch") {
                visibility_calls.fetch_add(1, Ordering::Relaxed);
                None
            } else if target.ends_with("receivemessage") && !received.swap(true, Ordering::Relaxed)
            {
                let body = r#"{"Messages":[{"MessageId":"m-1","ReceiptHandle":"rh-1","Body":"{}","Attributes":{"ApproximateReceiveCount":"1"}}]}"#;
                Some((200, body.to_owned()))
            } else {
                Some((200, "{}".to_owned()))
            }
        }
    })
    .await;
    logs();
    let url = format!("{endpoint}/123456789012/stalling");
    let config = SqsConfig::new(url)
        .aws(AwsSettings::default().endpoint_url(&endpoint))
        .wait_time(Duration::from_secs(1))
        .visibility_timeout(Duration::from_secs(3));
    let mut source = SqsSource::connect(config).await.unwrap();
    let delivery = tokio::time::timeout(Duration::from_secs(10), source.next())
        .await
        .expect("the message")
        .unwrap()
        .unwrap();
    // Heartbeats due every second; each call's attempts time out after 1 s (the SDK retries
    // them): within 6 s, several attempts reach the server (one, stalled for 30 s, before).
    tokio::time::sleep(Duration::from_secs(6)).await;
    let calls = visibility_calls.load(Ordering::Relaxed);
    assert!(calls >= 3, "visibility calls attempted: {calls}");
    drop(delivery);
    drop(source);
    server.abort();
}

/// A batch entry SQS fails (not for a stale receipt handle) is sent once more. (A fake endpoint:
/// one message received; the first `DeleteMessageBatch` fails its entry, the second succeeds.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_batch_entry_is_sent_once_more() {
    let delete_calls = std::sync::Arc::new(AtomicU32::new(0));
    let received = std::sync::Arc::new(AtomicBool::new(false));
    let (endpoint, server) = fake_sqs({
        let delete_calls = delete_calls.clone();
        move |target| {
            if target.ends_with("deletemessagebatch") {
                let body = if delete_calls.fetch_add(1, Ordering::Relaxed) == 0 {
                    r#"{"Successful":[],"Failed":[{"Id":"0","Code":"InternalError","SenderFault":false}]}"#
                } else {
                    r#"{"Successful":[{"Id":"0"}],"Failed":[]}"#
                };
                Some((200, body.to_owned()))
            } else if target.ends_with("receivemessage") && !received.swap(true, Ordering::Relaxed)
            {
                let body = r#"{"Messages":[{"MessageId":"m-1","ReceiptHandle":"rh-1","Body":"{}","Attributes":{"ApproximateReceiveCount":"1"}}]}"#;
                Some((200, body.to_owned()))
            } else {
                Some((200, "{}".to_owned()))
            }
        }
    })
    .await;
    logs();
    let url = format!("{endpoint}/123456789012/flaky");
    let config = SqsConfig::new(url)
        .aws(AwsSettings::default().endpoint_url(&endpoint))
        .wait_time(Duration::from_secs(1));
    let mut source = SqsSource::connect(config).await.unwrap();
    let stats = source.stats();
    let delivery = tokio::time::timeout(Duration::from_secs(10), source.next())
        .await
        .expect("the message")
        .unwrap()
        .unwrap();
    delivery.ack().await.unwrap();
    wait_until("the delete sent again", Duration::from_secs(10), || async {
        delete_calls.load(Ordering::Relaxed) >= 2
    })
    .await;
    source.close().await.unwrap();
    assert_eq!(delete_calls.load(Ordering::Relaxed), 2);
    assert_eq!(stats.counts().delete_calls, 2);
    server.abort();
}

/// The seed's scenario: a worker commits and dies before its delete. After the visibility
/// timeout another worker receives the message (redelivered): a duplicate, deleted; the effect
/// exists once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_commit_whose_delete_is_lost_is_a_duplicate_on_redelivery() {
    let _serial = SERIAL.lock().await;
    reset_hooks();
    let client = client().await;
    let (_, url) = queue(&client, "seed", false, 2).await;
    let (pool, _guard) = pool().await;
    send(
        &client,
        &url,
        &credit("seed-1", 250, "", 0),
        Some("sqs.credit"),
        None,
    )
    .await;

    // The first worker: receives, commits, and is killed before DeleteMessage.
    let mut doomed = SqsSource::connect(config(&url, 2)).await.unwrap();
    let delivery = doomed.next().await.unwrap().unwrap();
    let outcomes = dispatcher(&pool)
        .dispatch(delivery.envelope())
        .await
        .unwrap();
    assert_eq!(inbox_tests::outcome_kinds(&outcomes), [Ok("processed")]);
    // As a SIGKILL: nothing more reaches SQS about it (no delete, no release; the source's
    // receive and heartbeat tasks stop with it).
    std::mem::forget(delivery);
    drop(doomed);
    assert_eq!(effect(&pool, "seed-1").await, Some((1, 250)));
    assert_eq!(
        queue_depth(&client, &url).await,
        (0, 1),
        "in flight, not deleted"
    );

    // Another worker receives it once the visibility timeout (2 s) has passed.
    let running = Running::start(&pool, config(&url, 2), 4).await;
    wait_until(
        "the redelivery deleted",
        Duration::from_secs(20),
        || async { queue_depth(&client, &url).await == (0, 0) },
    )
    .await;
    let (report, counts) = running.stop().await;
    assert_eq!(
        (report.deliveries, report.duplicates, report.processed),
        (1, 1, 0)
    );
    assert_eq!(
        effect(&pool, "seed-1").await,
        Some((1, 250)),
        "the effect exists once"
    );
    assert_eq!(started("seed-1"), 1, "the handler ran once");
    assert_eq!((counts.deleted, counts.invalid_receipts), (1, 0));
    let delivery_count: Option<i64> =
        sqlx::query_scalar("SELECT MAX(attempts) FROM inbox_messages")
            .fetch_one(&pool)
            .await
            .unwrap();
    assert_eq!(delivery_count, Some(1));
}

/// A handler running 3× the visibility timeout: the heartbeat keeps the message invisible, so a
/// second worker polling the same queue never receives it; it is deleted once, after commit.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slow_handler_is_not_delivered_to_a_second_worker() {
    let _serial = SERIAL.lock().await;
    reset_hooks();
    let client = client().await;
    let (_, url) = queue(&client, "slow", false, 2).await;
    let (pool, _guard) = pool().await;
    *SLOW.lock().unwrap() = Some(("slow-1".into(), Duration::from_secs(6)));
    send(
        &client,
        &url,
        &credit("slow-1", 7, "", 0),
        Some("sqs.credit"),
        None,
    )
    .await;

    let one = Running::start(&pool, config(&url, 2), 2).await;
    wait_until(
        "the slow handler started",
        Duration::from_secs(10),
        || async { started("slow-1") == 1 },
    )
    .await;
    let two = Running::start(&pool, config(&url, 2), 2).await;
    wait_until("the effect", Duration::from_secs(20), || async {
        effect(&pool, "slow-1").await.is_some()
    })
    .await;
    wait_until("the delete", Duration::from_secs(10), || async {
        queue_depth(&client, &url).await == (0, 0)
    })
    .await;
    // Past another visibility timeout: nothing comes back.
    tokio::time::sleep(Duration::from_secs(3)).await;
    let (report_one, counts_one) = one.stop().await;
    let (report_two, counts_two) = two.stop().await;
    assert_eq!(started("slow-1"), 1, "never started a second time");
    assert_eq!(effect(&pool, "slow-1").await, Some((1, 7)));
    assert_eq!((report_one.deliveries, report_one.processed), (1, 1));
    assert_eq!(
        report_two.deliveries, 0,
        "the second worker never received it"
    );
    assert_eq!((counts_one.deleted, counts_one.invalid_receipts), (1, 0));
    assert!(
        counts_one.visibility_changes >= 5,
        "heartbeats every third of the timeout: {counts_one:?}"
    );
    assert_eq!(counts_two.received, 0);
    eprintln!("slow handler (6 s, visibility 2 s): worker one {counts_one:?}");
}

/// FIFO: two groups interleaved, each applied in order; one group's failing message (retried
/// after about 1 s) delays only its own group.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fifo_groups_apply_in_order_and_a_failure_delays_only_its_group() {
    let _serial = SERIAL.lock().await;
    reset_hooks();
    let client = client().await;
    let (_, url) = queue(&client, "groups", true, 5).await;
    let (pool, _guard) = pool().await;
    *FAIL_ONCE.lock().unwrap() = Some("a-2".into());
    for seq in 1..=5 {
        for group in ["a", "b"] {
            let id = format!("{group}-{seq}");
            send(
                &client,
                &url,
                &credit(&id, seq, group, seq),
                Some("sqs.credit"),
                Some(group),
            )
            .await;
        }
    }

    let running = Running::start(&pool, config(&url, 5), 8).await;
    wait_until("all ten applied", Duration::from_secs(30), || async {
        seen(&pool).await.len() == 10
    })
    .await;
    wait_until("all deleted", Duration::from_secs(10), || async {
        queue_depth(&client, &url).await == (0, 0)
    })
    .await;
    let (report, counts) = running.stop().await;
    let order = seen(&pool).await;
    for group in ["a", "b"] {
        let seqs: Vec<i64> = order
            .iter()
            .filter(|(g, _)| g == group)
            .map(|(_, s)| *s)
            .collect();
        assert_eq!(seqs, [1, 2, 3, 4, 5], "group {group} in order: {order:?}");
    }
    let position = |group: &str, seq: i64| {
        order
            .iter()
            .position(|(g, s)| g == group && *s == seq)
            .unwrap()
    };
    assert!(
        position("b", 5) < position("a", 2),
        "group b did not wait for a's retry: {order:?}"
    );
    assert!(FAILED.load(Ordering::SeqCst));
    assert_eq!(started("a-2"), 2, "failed once, then applied");
    assert_eq!(report.processed, 10);
    eprintln!("FIFO, 10 messages in 2 groups, one retry: {counts:?}, {report:?}");
}

/// Bad input: no name attribute, a malformed body, an unknown name. Each is kept in
/// `inbox_rejections` and deleted: never received again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_input_is_kept_in_rejections_and_deleted() {
    let _serial = SERIAL.lock().await;
    reset_hooks();
    let client = client().await;
    let (_, url) = queue(&client, "bad", false, 2).await;
    let (pool, _guard) = pool().await;
    send(&client, &url, &credit("no-name", 1, "", 0), None, None).await;
    send(&client, &url, "{not json", Some("sqs.credit"), None).await;
    send(
        &client,
        &url,
        &credit("unknown", 1, "", 0),
        Some("sqs.unknown"),
        None,
    )
    .await;
    send(
        &client,
        &url,
        &credit("good", 5, "", 0),
        Some("sqs.credit"),
        None,
    )
    .await;

    let running = Running::start(&pool, config(&url, 2), 4).await;
    wait_until("the good one applied", Duration::from_secs(20), || async {
        effect(&pool, "good").await.is_some()
    })
    .await;
    // Deleted (none in flight to come back), each delete under its one receive, the three kept.
    wait_until(
        "all deleted, the three kept",
        Duration::from_secs(10),
        || async {
            let c = running.stats.counts();
            queue_depth(&client, &url).await == (0, 0)
                && (c.received, c.deleted, c.redelivered) == (4, 4, 0)
                && inbox_tests::count(&pool, "SELECT COUNT(*) FROM inbox_rejections").await == 3
        },
    )
    .await;
    let (report, counts) = running.stop().await;
    assert_eq!(
        (report.deliveries, report.invalid, report.processed),
        (4, 3, 1)
    );
    assert_eq!(counts.deleted, 4);
    let mut names: Vec<(String, Option<String>)> =
        sqlx::query_as("SELECT message_name, source FROM inbox_rejections ORDER BY message_name")
            .fetch_all(&pool)
            .await
            .unwrap();
    names.sort();
    assert_eq!(names.len(), 3, "{names:?}");
    assert_eq!(
        names.iter().map(|(n, _)| n.as_str()).collect::<Vec<_>>(),
        ["", "sqs.credit", "sqs.unknown"]
    );
    assert!(
        names
            .iter()
            .all(|(_, s)| s.as_deref().is_some_and(|s| s.starts_with("bad-")))
    );
}

/// The sink: SendMessageBatch, the outbox message id as the FIFO deduplication id (a re-publish
/// is dropped by the queue), the aggregate id as the message group; read back by the source.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_sink_publishes_with_deduplication_ids_and_groups() {
    let _serial = SERIAL.lock().await;
    let client = client().await;
    let (name, url) = queue(&client, "sink", true, 30).await;
    let (pool, _guard) = pool().await;
    let destination: &'static str = Box::leak(name.clone().into_boxed_str());
    let destinations: &'static [&'static str] = Box::leak(vec![destination].into_boxed_slice());
    let outbox = Outbox::new(destinations);
    let mut tx = pool.begin().await.unwrap();
    let mut ids = Vec::new();
    for i in 0..12 {
        let group = if i % 2 == 0 { "acct-1" } else { "acct-2" };
        let message = credit(&format!("out-{i}"), i, group, i);
        let message: Credit = serde_json::from_str(&message).unwrap();
        let id = outbox
            .publish(
                &mut *tx,
                OutboxMessage::new(destination, &message)
                    .aggregate(group)
                    .header("trace-id", format!("t-{i}")),
            )
            .await
            .unwrap();
        ids.push(id);
    }
    tx.commit().await.unwrap();

    let relay = Relay::new(pool.clone(), SqsSink::connect(&settings()).await);
    let mut published = 0;
    let deadline = Instant::now() + Duration::from_secs(20);
    while published < 12 && Instant::now() < deadline {
        published += relay.run_once().await.unwrap().published;
    }
    assert_eq!(published, 12);
    // As after a crash before the relay marked them sent: published again, dropped by SQS.
    sqlx::query("UPDATE inbox_outbox SET status = 'pending'")
        .execute(&pool)
        .await
        .unwrap();
    let mut again = 0;
    let deadline = Instant::now() + Duration::from_secs(20);
    while again < 12 && Instant::now() < deadline {
        again += relay.run_once().await.unwrap().published;
    }
    assert_eq!(again, 12);
    assert_eq!(
        queue_depth(&client, &url).await,
        (12, 0),
        "re-publishes dropped"
    );

    let mut source = SqsSource::connect(config(&url, 30)).await.unwrap();
    let mut by_group: HashMap<String, Vec<i64>> = HashMap::new();
    for _ in 0..12 {
        let delivery = tokio::time::timeout(Duration::from_secs(10), source.next())
            .await
            .unwrap()
            .unwrap()
            .unwrap();
        let envelope = delivery.envelope().clone();
        assert_eq!(envelope.message_name, "sqs.credit");
        let meta = envelope.source.clone().unwrap();
        let message: Credit = serde_json::from_slice(&envelope.payload).unwrap();
        assert_eq!(meta.partition.as_deref(), Some(message.group.as_str()));
        assert_eq!(
            meta.deduplication_id.as_deref(),
            Some(ids[message.seq as usize].as_str())
        );
        assert_eq!(
            envelope.headers.get("trace-id").map(String::as_str),
            Some(format!("t-{}", message.seq).as_str())
        );
        by_group.entry(message.group).or_default().push(message.seq);
        delivery.ack().await.unwrap();
    }
    assert_eq!(by_group["acct-1"], [0, 2, 4, 6, 8, 10]);
    assert_eq!(by_group["acct-2"], [1, 3, 5, 7, 9, 11]);
    source.close().await.unwrap();
    assert_eq!(queue_depth(&client, &url).await, (0, 0));
}

/// The sink on a standard queue (by URL): no deduplication id, no group; the name attribute and
/// the headers as message attributes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_sink_publishes_to_a_standard_queue_by_url() {
    let _serial = SERIAL.lock().await;
    let client = client().await;
    let (_, url) = queue(&client, "plain", false, 30).await;
    let (pool, _guard) = pool().await;
    let destination: &'static str = Box::leak(url.clone().into_boxed_str());
    let destinations: &'static [&'static str] = Box::leak(vec![destination].into_boxed_slice());
    let outbox = Outbox::new(destinations);
    let mut tx = pool.begin().await.unwrap();
    for i in 0..3 {
        let message: Credit =
            serde_json::from_str(&credit(&format!("plain-{i}"), i, "", i)).unwrap();
        outbox
            .publish(&mut *tx, OutboxMessage::new(destination, &message))
            .await
            .unwrap();
    }
    tx.commit().await.unwrap();
    let relay = Relay::new(pool.clone(), SqsSink::connect(&settings()).await);
    let mut published = 0;
    let deadline = Instant::now() + Duration::from_secs(20);
    while published < 3 && Instant::now() < deadline {
        published += relay.run_once().await.unwrap().published;
    }
    assert_eq!(published, 3);
    let mut source = SqsSource::connect(config(&url, 30)).await.unwrap();
    for _ in 0..3 {
        let delivery = tokio::time::timeout(Duration::from_secs(10), source.next())
            .await
            .unwrap()
            .unwrap()
            .unwrap();
        let envelope = delivery.envelope();
        assert_eq!(envelope.message_name, "sqs.credit");
        let meta = envelope.source.as_ref().unwrap();
        assert_eq!(
            (meta.partition.as_deref(), meta.deduplication_id.as_deref()),
            (None, None)
        );
        assert_eq!(delivery.ordering_key(), None);
        delivery.ack().await.unwrap();
    }
    source.close().await.unwrap();
    assert_eq!(queue_depth(&client, &url).await, (0, 0));
}

/// Batches split by size: ten 200 KiB messages (SQS allows 256 KiB per message and per
/// `SendMessageBatch`) all go out in one relay round, none refused as a too-long batch; a
/// message over 256 KiB fails for good, alone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_sink_splits_batches_by_size() {
    let _serial = SERIAL.lock().await;
    let client = client().await;
    let (name, url) = queue(&client, "big", false, 30).await;
    let (pool, _guard) = pool().await;
    let destination: &'static str = Box::leak(name.into_boxed_str());
    let destinations: &'static [&'static str] = Box::leak(vec![destination].into_boxed_slice());
    let outbox = Outbox::new(destinations);
    let mut tx = pool.begin().await.unwrap();
    for i in 0..10 {
        let id = format!("big-{i}-{}", "x".repeat(200 * 1024));
        let message: Credit = serde_json::from_str(&credit(&id, i, "", i)).unwrap();
        outbox
            .publish(&mut *tx, OutboxMessage::new(destination, &message))
            .await
            .unwrap();
    }
    tx.commit().await.unwrap();
    let relay = Relay::new(pool.clone(), SqsSink::connect(&settings()).await);
    let round = relay.run_once().await.unwrap();
    assert_eq!((round.published, round.failed), (10, 0), "{round:?}");
    assert_eq!(queue_depth(&client, &url).await, (10, 0));

    // Over the limit: that row fails for good; the small one beside it is published.
    let mut tx = pool.begin().await.unwrap();
    for (i, size) in [(10, 300 * 1024), (11, 10)] {
        let id = format!("big-{i}-{}", "x".repeat(size));
        let message: Credit = serde_json::from_str(&credit(&id, i, "", i)).unwrap();
        outbox
            .publish(&mut *tx, OutboxMessage::new(destination, &message))
            .await
            .unwrap();
    }
    tx.commit().await.unwrap();
    let round = relay.run_once().await.unwrap();
    assert_eq!(round.published, 1, "{round:?}");
    assert_eq!(round.failed + round.dead, 1, "{round:?}");
    assert_eq!(queue_depth(&client, &url).await, (11, 0));
}

/// A message whose text or attributes SQS refuses fails for good, alone, before the call: SQS
/// (moto too, for a bad attribute name) refuses a `SendMessageBatch` whole when one entry breaks
/// its rules, which would hold the good messages of the batch back with it, round after round.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_message_sqs_refuses_fails_alone() {
    let _serial = SERIAL.lock().await;
    let client = client().await;
    let (name, url) = queue(&client, "refused", false, 30).await;
    let (pool, _guard) = pool().await;
    let destination: &'static str = Box::leak(name.into_boxed_str());
    let destinations: &'static [&'static str] = Box::leak(vec![destination].into_boxed_slice());
    let outbox = Outbox::new(destinations);
    let message = |id: &str| -> Credit { serde_json::from_str(&credit(id, 1, "", 1)).unwrap() };
    let eleven = (0..10).fold(
        OutboxMessage::new(destination, &message("eleven")),
        |m, i| m.header(format!("h{i}"), "v"),
    );
    // The name attribute and nine headers: ten attributes, SQS's most.
    let ten = (0..9).fold(OutboxMessage::new(destination, &message("ten")), |m, i| {
        m.header(format!("h{i}"), "v")
    });
    let rows = [
        OutboxMessage::new(destination, &message("good-1")),
        OutboxMessage::new(destination, &message("bad-name")).header("a b", "v"),
        OutboxMessage::new(destination, &message("reserved")).header("AWS.trace", "v"),
        OutboxMessage::new(destination, &message("dots")).header("a..b", "v"),
        OutboxMessage::new(destination, &message("empty")).header("tenant", ""),
        OutboxMessage::new(destination, &message("control")).header("tenant", "a\u{1}b"),
        eleven,
        ten,
        OutboxMessage::new(destination, &message("good-2")).header("trace.id-1_x", "v"),
    ];
    let mut tx = pool.begin().await.unwrap();
    for row in rows {
        outbox.publish(&mut *tx, row).await.unwrap();
    }
    tx.commit().await.unwrap();
    let relay = Relay::new(pool.clone(), SqsSink::connect(&settings()).await);
    let round = relay.run_once().await.unwrap();
    assert_eq!(
        (round.published, round.dead, round.failed),
        (3, 6, 0),
        "{round:?}"
    );
    assert_eq!(queue_depth(&client, &url).await, (3, 0));
    let errors: Vec<(String, String)> = sqlx::query_as(
        "SELECT json_extract(CAST(payload AS TEXT), '$.id'), last_error FROM inbox_outbox \
         WHERE status = 'dead' ORDER BY id",
    )
    .fetch_all(&pool)
    .await
    .unwrap();
    let expected = [
        (
            "bad-name",
            r#"SQS refuses the message attribute name "a b": only A-Z, a-z, 0-9, '_', '-' and '.'"#,
        ),
        (
            "reserved",
            r#"SQS refuses the message attribute name "AWS.trace": the prefixes 'AWS.' and 'Amazon.' are reserved"#,
        ),
        (
            "dots",
            r#"SQS refuses the message attribute name "a..b": no '.' first or last, and no '..'"#,
        ),
        (
            "empty",
            r#"SQS refuses the message attribute "tenant": an empty value"#,
        ),
        (
            "control",
            r#"SQS refuses the message attribute "tenant": character 1 of its value is not one SQS allows in message text"#,
        ),
        (
            "eleven",
            "SQS allows 10 message attributes; this message has 11 (the name attribute `message-name` and 10 headers)",
        ),
    ];
    let expected: Vec<(String, String)> = expected
        .iter()
        .map(|(id, error)| (id.to_string(), format!("permanent: {error}")))
        .collect();
    assert_eq!(errors, expected);
}

/// A malformed message whose rejection cannot be recorded (the database is gone) is requeued,
/// not rejected: with the default `RejectAction::Delete` a reject would delete it, kept nowhere.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_input_that_cannot_be_kept_is_not_deleted() {
    let _serial = SERIAL.lock().await;
    reset_hooks();
    let client = client().await;
    let (_, url) = queue(&client, "unkept", false, 30).await;
    let (pool, _guard) = pool().await;
    send(&client, &url, "{not json", Some("sqs.credit"), None).await;
    let dispatcher = dispatcher(&pool);
    pool.close().await;
    logs();
    let source = SqsSource::connect(config(&url, 30)).await.unwrap();
    let stats = source.stats();
    let worker = Worker::new(dispatcher)
        .concurrency(1)
        .requeue_delay(Duration::from_secs(60))
        .drain_timeout(Duration::from_secs(30));
    let stop = CancellationToken::new();
    let task = tokio::spawn({
        let stop = stop.clone();
        async move { worker.run(source, stop).await.expect("the worker runs") }
    });
    // Settled: a visibility change (the requeue), no delete.
    wait_until("the requeue", Duration::from_secs(20), || async {
        stats.counts().visibility_changes >= 1
    })
    .await;
    stop.cancel();
    let report = tokio::time::timeout(Duration::from_secs(60), task)
        .await
        .unwrap()
        .unwrap();
    let counts = stats.counts();
    assert_eq!(
        (report.invalid, report.requeued, report.rejected),
        (1, 1, 0),
        "{report:?}"
    );
    assert_eq!(counts.deleted, 0, "{counts:?}");
    // Still in the queue, invisible for the requeue delay.
    assert_eq!(queue_depth(&client, &url).await, (0, 1));
}

/// SQS calls per 100 messages: deletes and visibility changes go in batches.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deletes_and_visibility_changes_are_batched() {
    let _serial = SERIAL.lock().await;
    reset_hooks();
    let client = client().await;
    // Standard, FIFO (10 groups), and standard with 100 received at once by a worker that runs
    // one at a time, 30 ms each, under a 1 s visibility timeout: the waiting ones get heartbeats.
    for (fifo, heartbeats) in [(false, false), (true, false), (false, true)] {
        *SLOW.lock().unwrap() = heartbeats.then(|| ("c-".to_owned(), Duration::from_millis(30)));
        let (_, url) = queue(&client, "count", fifo, 30).await;
        let (pool, _guard) = pool().await;
        for chunk in 0..10 {
            let entries = (0..10)
                .map(|i| {
                    let n = chunk * 10 + i;
                    let group = format!("g{}", n % 10);
                    let mut entry = aws_sdk_sqs::types::SendMessageBatchRequestEntry::builder()
                        .id(i.to_string())
                        .message_body(credit(&format!("c-{fifo}-{n}"), 1, &group, n))
                        .message_attributes(
                            "message-name",
                            MessageAttributeValue::builder()
                                .data_type("String")
                                .string_value("sqs.credit")
                                .build()
                                .unwrap(),
                        );
                    if fifo {
                        entry = entry
                            .message_group_id(group)
                            .message_deduplication_id(format!("d{n}"));
                    }
                    entry.build().unwrap()
                })
                .collect();
            client
                .send_message_batch()
                .queue_url(&url)
                .set_entries(Some(entries))
                .send()
                .await
                .unwrap();
        }
        let running = if heartbeats {
            Running::start(&pool, config(&url, 1).max_in_flight(100), 1).await
        } else {
            Running::start(&pool, config(&url, 30), 16).await
        };
        wait_until("100 applied", Duration::from_secs(60), || async {
            seen(&pool).await.len() == 100
        })
        .await;
        wait_until("100 deleted", Duration::from_secs(10), || async {
            queue_depth(&client, &url).await == (0, 0)
        })
        .await;
        let (report, counts) = running.stop().await;
        assert_eq!(report.processed, 100);
        assert_eq!(counts.deleted, 100);
        eprintln!(
            "{} queue, 100 messages, {}: {counts:?}",
            if fifo { "FIFO" } else { "standard" },
            if heartbeats {
                "concurrency 1, 100 in flight, visibility 1 s"
            } else {
                "concurrency 16"
            }
        );
        if heartbeats {
            assert!(
                counts.visibility_changes >= 5 * counts.visibility_calls,
                "visibility changes batched: {counts:?}"
            );
            // The heartbeats kept every waiting message from being received again.
            assert_eq!(
                (counts.received, counts.redelivered, report.duplicates),
                (100, 0, 0),
                "no redelivery: {counts:?}, {report:?}"
            );
        }
        assert!(
            counts.delete_calls <= 40,
            "deletes batched: {} calls for 100",
            counts.delete_calls
        );
    }
}

/// A small stream for the ledger demo (moto slows down with deep queues): `events` payments over
/// 10 accounts, every 10th line sent twice; written to `dir` with its `expected.json`.
fn ledger_input(dir: &std::path::Path, events: u64) -> (std::path::PathBuf, std::path::PathBuf) {
    let mut lines = String::new();
    let mut balances = std::collections::BTreeMap::<String, i64>::new();
    let mut duplicates = 0;
    for i in 0..events {
        let account = format!("acct-{:04}", i % 10);
        let amount = (i as i64 * 37) % 5000 + 1;
        let (name, signed) = if i % 4 == 3 {
            ("payments.refunded", -amount)
        } else {
            ("payments.captured", amount)
        };
        *balances.entry(account.clone()).or_default() += signed;
        let line = serde_json::json!({
            "message": name,
            "payload": {
                "event_id": uuid::Uuid::from_u128(0x5157_0000_0000_0000_0000_0000_0000_0000 + u128::from(i)),
                "account_id": account,
                "amount_cents": amount,
            }
        })
        .to_string();
        lines.push_str(&line);
        lines.push('\n');
        if i % 10 == 0 {
            lines.push_str(&line);
            lines.push('\n');
            duplicates += 1;
        }
    }
    let input = dir.join(format!("sqs-ledger-{}.jsonl", std::process::id()));
    let expected = dir.join(format!("sqs-ledger-{}.expected.json", std::process::id()));
    std::fs::write(&input, lines).unwrap();
    std::fs::write(
        &expected,
        serde_json::json!({
            "processed": events,
            "duplicates": duplicates,
            "conflicts": 0,
            "rejected": 0,
            "balances": balances,
        })
        .to_string(),
    )
    .unwrap();
    (input, expected)
}

/// The `sqs: … (N messages, M redelivered)` count M of a ledger run's output.
fn redelivered(stdout: &str) -> i64 {
    stdout
        .lines()
        .find(|line| line.starts_with("sqs: "))
        .and_then(|line| {
            let before = line.split(" redelivered").next()?;
            before.rsplit(' ').next()?.parse().ok()
        })
        .unwrap_or_else(|| panic!("no sqs line in\n{stdout}"))
}

/// `ledger publish --to sqs://QUEUE` (the queue created) then `ledger --source sqs://QUEUE`:
/// every event applied once, `balances=ok`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_ledger_demo_publishes_to_and_consumes_from_sqs() {
    let _serial = SERIAL.lock().await;
    env("SQS_ENDPOINT");
    let bin = support::ledger_sqs_bin();
    let dir = support::scratch_dir();
    let (input, expected) = ledger_input(dir, 200);
    let queue = format!("sqs://ledger-demo-{}", std::process::id());
    let db = dir.join(format!("sqs-ledger-{}.db", std::process::id()));
    let _db_guard = TempFile(db.clone());
    let database_url = format!("sqlite:{}?mode=rwc", db.display());
    let log = support::log_file("sqs-ledger");
    let published = support::run_program(
        bin,
        &["publish", "--to", &queue, input.to_str().unwrap()],
        &database_url,
        &log,
    );
    assert!(published.contains("published 220 messages"), "{published}");
    let stdout = support::run_program(
        bin,
        &[
            "--source",
            &queue,
            "--expected",
            expected.to_str().unwrap(),
            "--ack-wait",
            "5",
            "--idle-exit",
            "3",
        ],
        &database_url,
        &log,
    );
    let summary = support::summary(&stdout);
    assert_eq!(summary["balances"], "ok", "{stdout}");
    assert_eq!(
        (
            summary["processed"].as_str(),
            summary["duplicates"].as_str()
        ),
        ("200", "20")
    );
    eprintln!(
        "{}",
        stdout.lines().find(|l| l.starts_with("sqs: ")).unwrap()
    );
    let _ = std::fs::remove_file(input);
    let _ = std::fs::remove_file(expected);
}

/// The demo consuming from SQS is SIGKILLed 10 times at random (seeded) moments and restarted,
/// then runs to the end: balances exact, the queue empty. The messages a kill left received and
/// not deleted (in flight, as the queue counts them just after it) are received again after the
/// visibility timeout (2 s): the last run counts them as redeliveries.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_ledger_demo_on_sqs_survives_sigkills() {
    use rand::{Rng as _, SeedableRng as _};
    let _serial = SERIAL.lock().await;
    let client = client().await;
    let bin = support::ledger_sqs_bin();
    let dir = support::scratch_dir();
    let (input, expected) = ledger_input(dir, 400);
    let name = format!("ledger-kills-{}", std::process::id());
    let queue = format!("sqs://{name}");
    let db = dir.join(format!("sqs-kills-{}.db", std::process::id()));
    let _db_guard = TempFile(db.clone());
    let database_url = format!("sqlite:{}?mode=rwc", db.display());
    let log = support::log_file("sqs-kills");
    support::run_program(
        bin,
        &["publish", "--to", &queue, input.to_str().unwrap()],
        &database_url,
        &log,
    );
    let url = client
        .get_queue_url()
        .queue_name(&name)
        .send()
        .await
        .unwrap()
        .queue_url
        .unwrap();
    let consume = [
        "--source",
        queue.as_str(),
        "--expected",
        expected.to_str().unwrap(),
        "--ack-wait",
        "2",
        "--idle-exit",
        "4",
        "--concurrency",
        "8",
    ];
    let mut rng = rand::rngs::StdRng::seed_from_u64(14);
    let mut in_flight_at_kills = Vec::new();
    // Each kill with messages in flight (received, not yet deleted); no more kills once the
    // backlog runs low, so that the last one leaves in flight what the last run receives again.
    for _ in 0..10 {
        let child = support::spawn_program(bin, &consume, &database_url, &log);
        std::thread::sleep(Duration::from_millis(rng.random_range(300..1500)));
        let until = Instant::now() + Duration::from_secs(10);
        while queue_depth(&client, &url).await.1 == 0 && Instant::now() < until {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        drop(child); // SIGKILL, and reaped
        let (visible, in_flight) = queue_depth(&client, &url).await;
        in_flight_at_kills.push(in_flight);
        if visible < 100 {
            break;
        }
    }
    let child = support::spawn_program(bin, &consume, &database_url, &log);
    let (status, stdout) = support::wait_ledger(child, &log, Duration::from_secs(300));
    assert!(status.success(), "{stdout}\n{}", support::tail(&log));
    let summary = support::summary(&stdout);
    assert_eq!(summary["balances"], "ok", "{stdout}");
    assert_eq!(
        queue_depth(&client, &url).await,
        (0, 0),
        "every message deleted"
    );
    // Every message in flight at the last kill (its own and earlier kills' not yet visible
    // again) is received again by the last run: a redelivery.
    let last = *in_flight_at_kills.last().unwrap();
    let redeliveries = redelivered(&stdout);
    eprintln!(
        "10 SIGKILLs: in flight just after each kill {in_flight_at_kills:?}; the last run: {}; {}",
        stdout.lines().find(|l| l.starts_with("summary: ")).unwrap(),
        stdout.lines().find(|l| l.starts_with("sqs: ")).unwrap()
    );
    assert!(
        last > 0 && redeliveries >= last,
        "messages in flight at the last kill, received again: {in_flight_at_kills:?}, \
         {redeliveries}"
    );
    let _ = std::fs::remove_file(input);
    let _ = std::fs::remove_file(expected);
}
