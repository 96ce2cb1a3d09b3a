//! `DynamoWorker`: a `DynamoDispatcher` run from a long-running `Source` (the memory source, and
//! moto's SQS on `SQS_ENDPOINT`), against moto's DynamoDB (`DYNAMODB_ENDPOINT`): duplicates,
//! retries with exact attempts, dead letters, refused deliveries kept in the table (or, cut to
//! fit an item, rejected at the broker too), conflicts kept, ordering keys,
//! shutdown with a delivery in flight (nothing settled before its commit), the drain timeout,
//! a failing source, `stop_when_idle`.
//!
//! Each test has an inbox table of its own and accounts of its own (fresh ids) in one accounts
//! table shared by the binary.

#![allow(missing_docs)]

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use aws_sdk_sqs::types::{MessageAttributeValue, QueueAttributeName};
use inbox_runtime::dynamodb::sdk::types::{AttributeValue, Update};
use inbox_runtime::dynamodb::{self, DynamoDispatcher, DynamoTx, DynamoWorker};
use inbox_runtime::source::memory::{MemoryHandle, MemorySource};
use inbox_runtime::source::sqs::{AwsSettings, RejectAction, SqsConfig, SqsSource};
use inbox_runtime::source::{Delivery, Settlement, Source, SourceError};
use inbox_runtime::store::{Rejection, RejectionReason};
use inbox_runtime::{
    BoxFuture, CancellationToken, Envelope, Message, StopReason, WorkerReport, idempotent,
};
use inbox_tests::dynamo::{TestError, endpoint};
use tokio::sync::Notify;

#[derive(Clone, Debug, serde::Serialize, serde::Deserialize, Message)]
#[message(name = "dw.credited")]
struct Credit {
    #[message(key)]
    id: String,
    account: String,
    amount: i64,
}

/// What the handler does per account before it credits.
enum Step {
    Fail(TestError),
    /// Panic.
    Panic,
    /// Tell `entered`, then wait for `release`.
    Block {
        entered: Arc<Notify>,
        release: Arc<Notify>,
    },
}

static ACCOUNTS: tokio::sync::OnceCell<String> = tokio::sync::OnceCell::const_new();
static SCRIPT: Mutex<Option<HashMap<String, Vec<Step>>>> = Mutex::new(None);
/// Per account: the attempts the handler ran (its `DynamoTx::attempt`), and the message ids in
/// the order it ran them.
static RUNS: Mutex<Option<HashMap<String, Vec<Ran>>>> = Mutex::new(None);

/// One run of the handler: its attempt and the message id.
type Ran = (u32, String);

fn script(account: &str, steps: Vec<Step>) {
    SCRIPT
        .lock()
        .unwrap()
        .get_or_insert_with(HashMap::new)
        .insert(account.to_owned(), steps);
}

fn next_step(account: &str) -> Option<Step> {
    let mut script = SCRIPT.lock().unwrap();
    let steps = script.as_mut()?.get_mut(account)?;
    (!steps.is_empty()).then(|| steps.remove(0))
}

fn runs(account: &str) -> Vec<Ran> {
    RUNS.lock()
        .unwrap()
        .get_or_insert_with(HashMap::new)
        .get(account)
        .cloned()
        .unwrap_or_default()
}

/// Adds `amount` to the account's balance (`ADD balance`), in the delivery's transaction.
fn add(tx: &mut DynamoTx, account: String, amount: i64) -> Result<(), TestError> {
    let table = ACCOUNTS.get().expect("setup made the accounts table");
    tx.update(
        Update::builder()
            .table_name(table)
            .key("id", AttributeValue::S(account))
            .update_expression("ADD balance :amount")
            .expression_attribute_values(":amount", AttributeValue::N(amount.to_string()))
            .build()
            .map_err(|e| TestError::Build(e.to_string()))?,
    );
    Ok(())
}

/// Credits the account (`ADD balance`); runs the account's script first. At most 3 attempts.
#[idempotent(consumer = "dw-ledger", max_attempts = 3)]
async fn credit(tx: &mut DynamoTx, msg: Credit) -> Result<(), TestError> {
    RUNS.lock()
        .unwrap()
        .get_or_insert_with(HashMap::new)
        .entry(msg.account.clone())
        .or_default()
        .push((tx.attempt(), msg.id.clone()));
    match next_step(&msg.account) {
        Some(Step::Fail(error)) => return Err(error),
        Some(Step::Panic) => panic!("scripted panic"),
        Some(Step::Block { entered, release }) => {
            entered.notify_one();
            release.notified().await;
        }
        None => {}
    }
    add(tx, msg.account, msg.amount)
}

fn fresh(prefix: &str) -> String {
    format!("{prefix}-{}", uuid::Uuid::new_v4().simple())
}

/// A dispatcher over a fresh inbox table (retries due at once), and the binary's accounts table.
async fn setup() -> DynamoDispatcher {
    let inbox = inbox_tests::dynamo::setup_with_table(&ACCOUNTS, "accounts").await;
    DynamoDispatcher::from_registry(inbox).expect("the registry")
}

async fn balance(dispatcher: &DynamoDispatcher, account: &str) -> Option<i64> {
    let client = dispatcher.inbox().client();
    inbox_tests::dynamo::number(client, ACCOUNTS.get().unwrap(), account, "balance").await
}

/// The memory source's settlements, by delivery id.
fn settled(handle: &MemoryHandle) -> Vec<(u64, Settlement)> {
    let mut settled = handle.settlements();
    settled.sort_by_key(|(id, _)| *id);
    settled
}

/// The inbox item's status of `key` for the ledger consumer.
async fn status(dispatcher: &DynamoDispatcher, key: &str) -> Option<String> {
    let stored = dispatcher
        .inbox()
        .admin()
        .show("dw-ledger", key)
        .await
        .unwrap()?;
    Some(stored.status.as_str().to_owned())
}

fn credit_msg(account: &str, amount: i64) -> Credit {
    Credit {
        id: fresh("c"),
        account: account.to_owned(),
        amount,
    }
}

fn envelope(msg: &Credit) -> Envelope {
    inbox_tests::envelope(msg)
}

/// A closed memory source holding `msgs` (ordering key: the account), and its handle.
fn memory(msgs: &[Credit]) -> (MemorySource, MemoryHandle, Vec<u64>) {
    let source = MemorySource::new("dw-memory");
    let handle = source.handle();
    let ids = msgs
        .iter()
        .map(|msg| handle.push_keyed(envelope(msg), msg.account.clone()))
        .collect();
    (source, handle, ids)
}

fn report(build: impl FnOnce(&mut WorkerReport)) -> WorkerReport {
    let mut report = WorkerReport::default();
    build(&mut report);
    report
}

/// The rejections kept in the inbox table (`dynamodb::rejections`), as (reason, consumer,
/// message name, payload, payload size) in that order.
async fn kept_rejections(
    dispatcher: &DynamoDispatcher,
) -> Vec<(String, Option<String>, Option<String>, Vec<u8>, Option<i64>)> {
    let inbox = dispatcher.inbox();
    let items = inbox
        .client()
        .scan()
        .table_name(inbox.table())
        .filter_expression("attribute_exists(#r)")
        .expression_attribute_names("#r", dynamodb::REJECTION_ATTRIBUTE)
        .send()
        .await
        .unwrap()
        .items
        .unwrap_or_default();
    let text = |item: &HashMap<String, AttributeValue>, name: &str| {
        item.get(name).map(|v| v.as_s().unwrap().clone())
    };
    let mut kept: Vec<_> = items
        .iter()
        .map(|item| {
            assert!(
                item["pk"].as_s().unwrap().starts_with("rejection#"),
                "{item:?}"
            );
            (
                text(item, "rejection").unwrap(),
                text(item, "consumer"),
                text(item, "message_name"),
                item.get("payload")
                    .map_or_else(Vec::new, |v| v.as_b().unwrap().as_ref().to_vec()),
                item.get("payload_size")
                    .map(|v| v.as_n().unwrap().parse().unwrap()),
            )
        })
        .collect();
    kept.sort();
    kept
}

#[tokio::test]
async fn duplicates_credit_once_and_every_delivery_is_acked_after_its_commit() {
    let dispatcher = setup().await;
    let accounts: Vec<String> = (0..4).map(|_| fresh("acct")).collect();
    let mut msgs: Vec<Credit> = (0..16)
        .map(|i| credit_msg(&accounts[i % 4], 10 + i as i64))
        .collect();
    // Four duplicates, delivered again later in the stream.
    let duplicates: Vec<Credit> = msgs[..4].to_vec();
    msgs.extend(duplicates);
    let (source, handle, ids) = memory(&msgs);
    handle.close();
    let worker = DynamoWorker::new(dispatcher).concurrency(4);
    let run = worker.run(source, CancellationToken::new()).await.unwrap();
    assert_eq!(
        run,
        report(|r| {
            r.deliveries = 20;
            r.processed = 16;
            r.duplicates = 4;
            r.acked = 20;
            r.stop = StopReason::SourceExhausted;
        })
    );
    assert_eq!(
        settled(&handle),
        ids.iter()
            .map(|id| (*id, Settlement::Ack))
            .collect::<Vec<_>>()
    );
    for (a, account) in accounts.iter().enumerate() {
        let expected: i64 = (0..16).filter(|i| i % 4 == a).map(|i| 10 + i as i64).sum();
        assert_eq!(balance(worker.dispatcher(), account).await, Some(expected));
    }
}

#[tokio::test]
async fn a_failing_then_succeeding_handler_is_requeued_then_processed() {
    let dispatcher = setup().await;
    let account = fresh("acct");
    script(
        &account,
        vec![Step::Fail(TestError::Boom), Step::Fail(TestError::Boom)],
    );
    let msg = credit_msg(&account, 700);
    let (source, handle, ids) = memory(std::slice::from_ref(&msg));
    handle.close();
    let worker = DynamoWorker::new(dispatcher).requeue_delay(Duration::from_secs(3600));
    let run = worker.run(source, CancellationToken::new()).await.unwrap();
    assert_eq!(
        run,
        report(|r| {
            r.deliveries = 3;
            r.failed = 2;
            r.requeued = 2;
            r.processed = 1;
            r.acked = 1;
            r.stop = StopReason::SourceExhausted;
        })
    );
    // The handler's retry delay (zero), not the worker's hour.
    let requeue = Settlement::Requeue {
        delay: Some(Duration::ZERO),
    };
    assert_eq!(
        handle.settlements(),
        [
            (ids[0], requeue),
            (ids[0], requeue),
            (ids[0], Settlement::Ack)
        ]
    );
    let attempts: Vec<u32> = runs(&account).into_iter().map(|(a, _)| a).collect();
    assert_eq!(attempts, [1, 2, 3]);
    assert_eq!(balance(worker.dispatcher(), &account).await, Some(700));
    assert_eq!(
        status(worker.dispatcher(), &msg.id).await.as_deref(),
        Some("processed")
    );
}

#[tokio::test]
async fn a_permanent_failure_is_dead_lettered_in_the_table_and_acked() {
    let dispatcher = setup().await;
    let account = fresh("acct");
    script(&account, vec![Step::Fail(TestError::Fatal)]);
    let msg = credit_msg(&account, 300);
    let (source, handle, ids) = memory(std::slice::from_ref(&msg));
    handle.close();
    let worker = DynamoWorker::new(dispatcher);
    let run = worker.run(source, CancellationToken::new()).await.unwrap();
    assert_eq!(
        run,
        report(|r| {
            r.deliveries = 1;
            r.dead = 1;
            r.acked = 1;
            r.stop = StopReason::SourceExhausted;
        })
    );
    assert_eq!(handle.settlements(), [(ids[0], Settlement::Ack)]);
    assert_eq!(balance(worker.dispatcher(), &account).await, None);
    assert_eq!(
        status(worker.dispatcher(), &msg.id).await.as_deref(),
        Some("dead")
    );
    let dead = worker
        .dispatcher()
        .inbox()
        .admin()
        .show("dw-ledger", &msg.id)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(
        dead.payload.as_deref(),
        Some(&serde_json::to_vec(&msg).unwrap()[..])
    );
}

#[tokio::test]
async fn refused_deliveries_are_kept_in_the_table_and_acked() {
    let dispatcher = setup().await;
    let source = MemorySource::new("dw-refused");
    let handle = source.handle();
    let malformed = handle.push(Envelope::new("dw.credited", b"{not json".to_vec()));
    let unknown = handle.push(Envelope::new("dw.unknown", b"{}".to_vec()));
    let no_key = handle.push(Envelope::new(
        "dw.credited",
        br#"{"id":"","account":"a","amount":1}"#.to_vec(),
    ));
    handle.close();
    let worker = DynamoWorker::new(dispatcher);
    let run = worker.run(source, CancellationToken::new()).await.unwrap();
    assert_eq!(
        run,
        report(|r| {
            r.deliveries = 3;
            r.invalid = 3;
            r.acked = 3;
            r.stop = StopReason::SourceExhausted;
        })
    );
    assert_eq!(
        settled(&handle),
        [
            (malformed, Settlement::Ack),
            (unknown, Settlement::Ack),
            (no_key, Settlement::Ack)
        ]
    );
    let named = |name: &str| Some(name.to_owned());
    assert_eq!(
        kept_rejections(worker.dispatcher()).await,
        [
            (
                "invalid_key".to_owned(),
                named("dw-ledger"),
                named("dw.credited"),
                br#"{"id":"","account":"a","amount":1}"#.to_vec(),
                None
            ),
            (
                "malformed".to_owned(),
                None,
                named("dw.credited"),
                b"{not json".to_vec(),
                None
            ),
            (
                "unknown_message".to_owned(),
                None,
                named("dw.unknown"),
                b"{}".to_vec(),
                None
            ),
        ]
    );
    let stats = inbox_tests::dynamo::stats_rows(worker.dispatcher().inbox()).await;
    assert_eq!(
        stats,
        [
            (None, "rejected:malformed".to_owned(), 1),
            (None, "rejected:unknown_message".to_owned(), 1),
            (named("dw-ledger"), "rejected:invalid_key".to_owned(), 1),
        ]
    );
}

/// Refused deliveries whose payload would take their item past DynamoDB's 400 KB item limit
/// are kept cut to fit, with their real size. One within the dispatcher's limit (malformed, 500
/// KB) lost bytes by the cut: it is rejected at the broker too, whose dead-lettering keeps it
/// whole. One over the limit (1.2 MiB, with the default 1 MiB limit) was cut anyway: acked.
#[tokio::test]
async fn refused_deliveries_too_large_for_an_item_are_kept_cut() {
    let dispatcher = setup().await;
    let source = MemorySource::new("dw-huge");
    let handle = source.handle();
    let mut malformed_body = b"{not json ".to_vec();
    malformed_body.resize(500 * 1024, b'x');
    let malformed = handle.push(Envelope::new("dw.credited", malformed_body.clone()));
    let mut huge_body = b"{\"id\": \"".to_vec();
    huge_body.resize(1200 * 1024, b'y');
    let huge = handle.push(Envelope::new("dw.credited", huge_body.clone()));
    handle.close();
    let worker = DynamoWorker::new(dispatcher);
    let run = worker.run(source, CancellationToken::new()).await.unwrap();
    assert_eq!(
        run,
        report(|r| {
            r.deliveries = 2;
            r.invalid = 2;
            r.rejected = 1;
            r.acked = 1;
            r.stop = StopReason::SourceExhausted;
        })
    );
    assert_eq!(
        settled(&handle),
        [(malformed, Settlement::Reject), (huge, Settlement::Ack)]
    );
    let kept = kept_rejections(worker.dispatcher()).await;
    let [
        (reason_1, _, _, cut_1, size_1),
        (reason_2, _, _, cut_2, size_2),
    ] = &kept[..]
    else {
        panic!("{} kept", kept.len());
    };
    assert_eq!(
        (reason_1.as_str(), reason_2.as_str()),
        ("malformed", "too_large")
    );
    assert_eq!(*size_1, Some(500 * 1024));
    assert_eq!(*size_2, Some(1200 * 1024));
    for cut in [cut_1, cut_2] {
        // Three quarters of DynamoDB's 409,600-byte limit less a 1 KB margin and the item's
        // other attributes (moto counts a binary by its base64 text).
        assert!((300_000..=306_432).contains(&cut.len()), "{}", cut.len());
    }
    assert_eq!(&cut_1[..], &malformed_body[..cut_1.len()]);
    assert_eq!(&cut_2[..], &huge_body[..cut_2.len()]);
}

#[tokio::test]
async fn deliveries_of_one_ordering_key_run_one_at_a_time_in_order() {
    let dispatcher = setup().await;
    let account = fresh("acct");
    let other = fresh("acct");
    // The first of `account` fails once: its requeue goes to the back of the memory queue.
    script(&account, vec![Step::Fail(TestError::Boom)]);
    let msgs: Vec<Credit> = (0..12)
        .map(|i| credit_msg(if i % 3 == 2 { &other } else { &account }, 1 << i))
        .collect();
    let (source, handle, _) = memory(&msgs);
    handle.close();
    let worker = DynamoWorker::new(dispatcher).concurrency(8);
    let run = worker.run(source, CancellationToken::new()).await.unwrap();
    assert_eq!((run.processed, run.failed, run.acked), (12, 1, 12));
    let of = |acct: &str| -> Vec<String> {
        msgs.iter()
            .filter(|m| m.account == acct)
            .map(|m| m.id.clone())
            .collect()
    };
    let ran: Vec<String> = runs(&account).into_iter().map(|(_, id)| id).collect();
    // In the order pushed; the failed first one again after the ones admitted behind it.
    let mut expected = of(&account);
    expected.push(expected[0].clone());
    assert_eq!(ran, expected);
    let ran_other: Vec<String> = runs(&other).into_iter().map(|(_, id)| id).collect();
    assert_eq!(ran_other, of(&other));
    let sum = |acct: &str| {
        msgs.iter()
            .filter(|m| m.account == acct)
            .map(|m| m.amount)
            .sum()
    };
    assert_eq!(
        balance(worker.dispatcher(), &account).await,
        Some(sum(&account))
    );
    assert_eq!(
        balance(worker.dispatcher(), &other).await,
        Some(sum(&other))
    );
}

/// A worker over `source` in a task, and the run's result.
fn spawn_run(
    worker: DynamoWorker,
    source: impl Source + 'static,
    token: CancellationToken,
) -> tokio::task::JoinHandle<(
    DynamoWorker,
    Result<WorkerReport, inbox_runtime::WorkerError>,
)> {
    tokio::spawn(async move {
        let result = worker.run(source, token).await;
        (worker, result)
    })
}

#[tokio::test]
async fn shutdown_hands_back_waiting_deliveries_and_acks_the_running_one_after_its_commit() {
    let dispatcher = setup().await;
    let account = fresh("acct");
    let (entered, release) = (Arc::new(Notify::new()), Arc::new(Notify::new()));
    script(
        &account,
        vec![Step::Block {
            entered: entered.clone(),
            release: release.clone(),
        }],
    );
    let msgs: Vec<Credit> = (0..3).map(|i| credit_msg(&account, 100 + i)).collect();
    let (source, handle, ids) = memory(&msgs);
    let token = CancellationToken::new();
    let task = spawn_run(DynamoWorker::new(dispatcher), source, token.clone());
    entered.notified().await;
    // The other two were fetched and wait behind the blocked one of their key.
    while handle.deliveries() < 3 {
        tokio::task::yield_now().await;
    }
    token.cancel();
    // Handed back at shutdown, while the first one still runs: it is not settled.
    while handle.settlements().len() < 2 {
        tokio::task::yield_now().await;
    }
    let requeued = Settlement::Requeue { delay: None };
    assert_eq!(
        handle.settlements(),
        [(ids[1], requeued), (ids[2], requeued)]
    );
    release.notify_one();
    let (worker, result) = task.await.unwrap();
    let run = result.unwrap();
    assert_eq!(
        run,
        report(|r| {
            r.deliveries = 3;
            r.processed = 1;
            r.acked = 1;
            r.requeued = 2;
            r.stop = StopReason::Shutdown;
        })
    );
    assert_eq!(handle.settlements()[2], (ids[0], Settlement::Ack));
    assert_eq!(balance(worker.dispatcher(), &account).await, Some(100));
}

#[tokio::test]
async fn past_the_drain_timeout_a_running_delivery_is_abandoned_uncommitted() {
    let dispatcher = setup().await;
    let account = fresh("acct");
    let (entered, release) = (Arc::new(Notify::new()), Arc::new(Notify::new()));
    script(
        &account,
        vec![Step::Block {
            entered: entered.clone(),
            release,
        }],
    );
    let msg = credit_msg(&account, 5);
    let (source, handle, ids) = memory(std::slice::from_ref(&msg));
    let token = CancellationToken::new();
    let worker = DynamoWorker::new(dispatcher).drain_timeout(Duration::from_millis(200));
    let task = spawn_run(worker, source, token.clone());
    entered.notified().await;
    token.cancel();
    let (worker, result) = task.await.unwrap();
    let run = result.unwrap();
    assert_eq!(
        run,
        report(|r| {
            r.deliveries = 1;
            r.abandoned = 1;
            r.stop = StopReason::Shutdown;
        })
    );
    assert!(handle.settlements().is_empty());
    assert_eq!(handle.abandoned(), ids);
    assert_eq!(balance(worker.dispatcher(), &account).await, None);
    assert_eq!(status(worker.dispatcher(), &msg.id).await, None);
}

/// A memory source that fails with `receive` once its queue is empty.
struct FailingWhenEmpty {
    inner: MemorySource,
    handle: MemoryHandle,
}

impl Source for FailingWhenEmpty {
    fn name(&self) -> &str {
        self.inner.name()
    }

    fn next(&mut self) -> BoxFuture<'_, Result<Option<Delivery>, SourceError>> {
        if self.handle.queued() == 0 {
            return Box::pin(async { Err(SourceError::new("dw-failing", "receive", "gone")) });
        }
        self.inner.next()
    }
}

#[tokio::test]
async fn a_source_failure_finishes_running_deliveries_and_returns_the_error() {
    let dispatcher = setup().await;
    let account = fresh("acct");
    let msgs: Vec<Credit> = (0..2).map(|i| credit_msg(&account, 1 + i)).collect();
    let (inner, handle, ids) = memory(&msgs);
    let source = FailingWhenEmpty {
        inner,
        handle: handle.clone(),
    };
    let worker = DynamoWorker::new(dispatcher);
    let error = worker
        .run(source, CancellationToken::new())
        .await
        .unwrap_err();
    assert_eq!(error.error.operation, "receive");
    assert_eq!(
        error.report,
        report(|r| {
            r.deliveries = 2;
            r.processed = 2;
            r.acked = 2;
            r.stop = StopReason::SourceFailed;
        })
    );
    assert_eq!(
        settled(&handle),
        [(ids[0], Settlement::Ack), (ids[1], Settlement::Ack)]
    );
    assert_eq!(balance(worker.dispatcher(), &account).await, Some(3));
}

// --- SQS (moto) ---

fn sqs_settings() -> AwsSettings {
    let endpoint = std::env::var("SQS_ENDPOINT").expect("SQS_ENDPOINT (moto's SQS)");
    AwsSettings::default().endpoint_url(endpoint)
}

async fn sqs_client() -> aws_sdk_sqs::Client {
    inbox_runtime::source::sqs::client(&sqs_settings(), Duration::from_secs(20)).await
}

/// A new standard queue with visibility timeout 1 s; with a redrive policy to a new dead-letter
/// queue after `max_receives`, if given. Returns its URL and the dead-letter queue's.
async fn sqs_queue(
    client: &aws_sdk_sqs::Client,
    max_receives: Option<u32>,
) -> (String, Option<String>) {
    let create = |name: String| client.create_queue().queue_name(name);
    let mut queue = create(fresh("dw")).attributes(QueueAttributeName::VisibilityTimeout, "1");
    let mut dlq_url = None;
    if let Some(max) = max_receives {
        let url = create(fresh("dw-dlq"))
            .send()
            .await
            .unwrap()
            .queue_url
            .unwrap();
        let arn = client
            .get_queue_attributes()
            .queue_url(&url)
            .attribute_names(QueueAttributeName::QueueArn)
            .send()
            .await
            .unwrap()
            .attributes
            .unwrap()[&QueueAttributeName::QueueArn]
            .clone();
        let policy = format!(r#"{{"deadLetterTargetArn":"{arn}","maxReceiveCount":"{max}"}}"#);
        queue = queue.attributes(QueueAttributeName::RedrivePolicy, policy);
        dlq_url = Some(url);
    }
    (queue.send().await.unwrap().queue_url.unwrap(), dlq_url)
}

/// Sends `body` as message `name`; with `fifo`, in that group with that deduplication id.
async fn sqs_send(
    client: &aws_sdk_sqs::Client,
    url: &str,
    name: &str,
    body: &[u8],
    fifo: Option<(&str, &str)>,
) {
    let name = MessageAttributeValue::builder()
        .data_type("String")
        .string_value(name)
        .build()
        .unwrap();
    let mut send = client
        .send_message()
        .queue_url(url)
        .message_body(String::from_utf8(body.to_vec()).unwrap())
        .message_attributes("message-name", name);
    if let Some((group, dedup)) = fifo {
        send = send.message_group_id(group).message_deduplication_id(dedup);
    }
    send.send().await.unwrap();
}

fn sqs_config(url: &str) -> SqsConfig {
    SqsConfig::new(url)
        .aws(sqs_settings())
        .wait_time(Duration::from_secs(1))
        .visibility_timeout(Duration::from_secs(1))
}

#[tokio::test]
async fn an_sqs_queue_with_duplicates_and_a_retry_drains_until_idle() {
    let dispatcher = setup().await;
    let client = sqs_client().await;
    let (url, _) = sqs_queue(&client, None).await;
    let accounts: Vec<String> = (0..3).map(|_| fresh("acct")).collect();
    let failing = fresh("acct");
    script(&failing, vec![Step::Fail(TestError::Boom)]);
    let msgs: Vec<Credit> = (0..9)
        .map(|i| credit_msg(&accounts[i % 3], 1 + i as i64))
        .chain([credit_msg(&failing, 50)])
        .collect();
    for msg in msgs.iter().chain(&msgs[..3]) {
        sqs_send(
            &client,
            &url,
            "dw.credited",
            &serde_json::to_vec(msg).unwrap(),
            None,
        )
        .await;
    }
    let source = SqsSource::connect(sqs_config(&url)).await.unwrap();
    let worker = DynamoWorker::new(dispatcher)
        .concurrency(4)
        .stop_when_idle(Duration::from_secs(3));
    let run = worker.run(source, CancellationToken::new()).await.unwrap();
    assert_eq!(
        run,
        report(|r| {
            r.deliveries = 14;
            r.processed = 10;
            r.duplicates = 3;
            r.failed = 1;
            r.requeued = 1;
            r.acked = 13;
            r.stop = StopReason::Idle;
        })
    );
    assert_eq!(
        runs(&failing).iter().map(|(a, _)| *a).collect::<Vec<_>>(),
        [1, 2]
    );
    assert_eq!(balance(worker.dispatcher(), &failing).await, Some(50));
    for (a, account) in accounts.iter().enumerate() {
        let expected: i64 = (0..9).filter(|i| i % 3 == a).map(|i| 1 + i as i64).sum();
        assert_eq!(balance(worker.dispatcher(), account).await, Some(expected));
    }
    let left = client
        .get_queue_attributes()
        .queue_url(&url)
        .attribute_names(QueueAttributeName::All)
        .send()
        .await
        .unwrap()
        .attributes
        .unwrap();
    assert_eq!(left[&QueueAttributeName::ApproximateNumberOfMessages], "0");
    assert_eq!(
        left[&QueueAttributeName::ApproximateNumberOfMessagesNotVisible],
        "0"
    );
}

/// A malformed SQS message is kept in the table and deleted from its queue: neither the queue
/// nor its dead-letter queue holds it afterwards.
#[tokio::test]
async fn a_malformed_sqs_message_is_kept_in_the_table_and_deleted_from_the_queue() {
    let dispatcher = setup().await;
    let client = sqs_client().await;
    let (url, dlq) = sqs_queue(&client, Some(1)).await;
    let dlq = dlq.unwrap();
    sqs_send(&client, &url, "dw.credited", b"{not json", None).await;
    let source = SqsSource::connect(sqs_config(&url).reject(RejectAction::LeaveToRedrive))
        .await
        .unwrap();
    let worker = DynamoWorker::new(dispatcher).stop_when_idle(Duration::from_secs(4));
    let run = worker.run(source, CancellationToken::new()).await.unwrap();
    assert_eq!(
        run,
        report(|r| {
            r.deliveries = 1;
            r.invalid = 1;
            r.acked = 1;
            r.stop = StopReason::Idle;
        })
    );
    let kept = kept_rejections(worker.dispatcher()).await;
    assert_eq!(
        kept,
        [(
            "malformed".to_owned(),
            None,
            Some("dw.credited".to_owned()),
            b"{not json".to_vec(),
            None
        )]
    );
    for queue in [&url, &dlq] {
        let received = client
            .receive_message()
            .queue_url(queue)
            .wait_time_seconds(2)
            .send()
            .await
            .unwrap()
            .messages
            .unwrap_or_default();
        assert_eq!(received.len(), 0, "{queue}");
    }
}

#[tokio::test]
async fn a_fifo_group_keeps_its_order_across_a_retry() {
    let dispatcher = setup().await;
    let client = sqs_client().await;
    let url = client
        .create_queue()
        .queue_name(format!("{}.fifo", fresh("dw")))
        .attributes(QueueAttributeName::FifoQueue, "true")
        .attributes(QueueAttributeName::VisibilityTimeout, "1")
        .send()
        .await
        .unwrap()
        .queue_url
        .unwrap();
    let account = fresh("acct");
    // The first message fails once: the later ones of its group must not run before it.
    script(&account, vec![Step::Fail(TestError::Boom)]);
    let msgs: Vec<Credit> = (0..4).map(|i| credit_msg(&account, 1 << i)).collect();
    for msg in &msgs {
        let body = serde_json::to_vec(msg).unwrap();
        sqs_send(&client, &url, "dw.credited", &body, Some(("g", &msg.id))).await;
    }
    let source = SqsSource::connect(sqs_config(&url)).await.unwrap();
    let worker = DynamoWorker::new(dispatcher)
        .concurrency(8)
        .stop_when_idle(Duration::from_secs(3));
    let run = worker.run(source, CancellationToken::new()).await.unwrap();
    let ran: Vec<Ran> = runs(&account);
    let first = msgs[0].id.clone();
    let mut expected = vec![(1, first.clone()), (2, first)];
    expected.extend(msgs[1..].iter().map(|m| (1, m.id.clone())));
    assert_eq!(ran, expected);
    // The later messages received with the failed one were given up unrun, then received again.
    assert_eq!(
        (
            run.processed,
            run.failed,
            run.requeued,
            run.acked,
            run.duplicates
        ),
        (4, 1, 1, 4, 0)
    );
    assert_eq!(run.deliveries, 5 + run.revoked);
    assert_eq!(run.stop, StopReason::Idle);
    assert_eq!(balance(worker.dispatcher(), &account).await, Some(15));
}

// ---- Review: a DynamoDB that does not answer, and several consumers of one message name ----

/// A message two consumers take, each crediting an account of its own (`{account}-a`,
/// `{account}-b`); the second runs the script of its account first.
#[derive(Clone, Debug, serde::Serialize, serde::Deserialize, Message)]
#[message(name = "dw.split")]
struct Split {
    #[message(key)]
    id: String,
    account: String,
    amount: i64,
}

#[idempotent(consumer = "dw-split-a", max_attempts = 3)]
async fn split_a(tx: &mut DynamoTx, msg: Split) -> Result<(), TestError> {
    add(tx, format!("{}-a", msg.account), msg.amount)
}

#[idempotent(consumer = "dw-split-b", max_attempts = 3)]
async fn split_b(tx: &mut DynamoTx, msg: Split) -> Result<(), TestError> {
    let account = format!("{}-b", msg.account);
    if let Some(Step::Fail(error)) = next_step(&account) {
        return Err(error);
    }
    add(tx, account, msg.amount)
}

fn split_msg(account: &str, amount: i64) -> Split {
    Split {
        id: fresh("s"),
        account: account.to_owned(),
        amount,
    }
}

/// `reachable`'s dispatcher, its client's endpoint a closed port: every call fails with
/// connection refused.
fn unreachable(reachable: &DynamoDispatcher) -> DynamoDispatcher {
    let config = reachable
        .inbox()
        .client()
        .config()
        .to_builder()
        .endpoint_url("http://127.0.0.1:9")
        .build();
    let client = dynamodb::sdk::Client::from_conf(config);
    let inbox = dynamodb::DynamoInbox::new(client, reachable.inbox().table().to_owned());
    DynamoDispatcher::from_registry(inbox).unwrap()
}

/// A rejection too large for an item even without its payload (a detail of 500,000 bytes) is
/// refused with `AdminError::ItemTooLarge` before any call: nothing is kept (the worker then
/// rejects the delivery at the broker, whose dead-lettering keeps it whole).
#[tokio::test]
async fn a_rejection_too_large_without_its_payload_is_refused_and_nothing_is_kept() {
    let dispatcher = setup().await;
    let detail = "d".repeat(500_000);
    let rejection = Rejection {
        consumer: Some("dw-huge"),
        message_key: None,
        message_name: "dw.credited",
        reason: RejectionReason::Malformed,
        detail: &detail,
        payload_hash: None,
        payload: b"{not json",
        payload_size: None,
        source: None,
    };
    let error = dispatcher
        .inbox()
        .record_rejection(&rejection)
        .await
        .unwrap_err();
    let dynamodb::AdminError::ItemTooLarge { table, bytes, max } = error else {
        panic!("not ItemTooLarge: {error:?}");
    };
    assert_eq!(table, dispatcher.inbox().table());
    assert_eq!(max, 409_600);
    assert!(bytes > 500_000, "{bytes}");
    assert_eq!(kept_rejections(&dispatcher).await, []);
}

/// Runs `worker` over `source` until `handle` has seen `settlements` settlements, then shuts it
/// down: what `run` returned. (The source stays open: the worker would otherwise go on.)
async fn run_until_settled(
    worker: DynamoWorker,
    source: MemorySource,
    handle: &MemoryHandle,
    settlements: usize,
) -> Result<WorkerReport, inbox_runtime::WorkerError> {
    let token = CancellationToken::new();
    let task = spawn_run(worker, source, token.clone());
    while handle.settlements().len() < settlements {
        tokio::task::yield_now().await;
    }
    token.cancel();
    task.await.unwrap().1
}

/// A refused delivery that DynamoDB cannot keep (unreachable) is requeued, never acked nor
/// rejected: it is kept on a later delivery, or stays with the broker.
#[tokio::test]
async fn a_refused_delivery_dynamodb_cannot_keep_is_requeued() {
    let reachable = setup().await;
    let dispatcher = unreachable(&reachable);
    let source = MemorySource::new("dw-down-refused");
    let handle = source.handle();
    let malformed = handle.push(Envelope::new("dw.credited", b"{not json".to_vec()));
    let delay = Duration::from_secs(3600);
    let worker = DynamoWorker::new(dispatcher).requeue_delay(delay);
    assert_eq!(
        run_until_settled(worker, source, &handle, 1).await.unwrap(),
        report(|r| {
            r.deliveries = 1;
            r.invalid = 1;
            r.requeued = 1;
            r.stop = StopReason::Shutdown;
        })
    );
    assert_eq!(
        settled(&handle),
        [(malformed, Settlement::Requeue { delay: Some(delay) })]
    );
    assert_eq!(kept_rejections(&reachable).await, []);
}

#[tokio::test]
async fn with_dynamodb_unreachable_the_delivery_is_requeued_never_acked_nor_rejected() {
    let reachable = setup().await;
    // Connection refused: every call fails, the outcome of nothing is known.
    let dispatcher = unreachable(&reachable);
    let account = fresh("acct");
    let credit = credit_msg(&account, 5);
    let split = split_msg(&account, 7);
    let source = MemorySource::new("dw-down");
    let handle = source.handle();
    let one = handle.push(envelope(&credit));
    let two = handle.push(inbox_tests::envelope(&split));
    let delay = Duration::from_secs(3600);
    let worker = DynamoWorker::new(dispatcher).requeue_delay(delay);
    assert_eq!(
        run_until_settled(worker, source, &handle, 2).await.unwrap(),
        report(|r| {
            r.deliveries = 2;
            r.failed = 3;
            r.requeued = 2;
            r.stop = StopReason::Shutdown;
        })
    );
    let requeue = Settlement::Requeue { delay: Some(delay) };
    assert_eq!(settled(&handle), [(one, requeue), (two, requeue)]);
    assert_eq!(balance(&reachable, &account).await, None);
    assert_eq!(status(&reachable, &credit.id).await, None);
}

#[tokio::test]
async fn two_consumers_one_failing_requeue_then_each_applies_once() {
    let dispatcher = setup().await;
    let account = fresh("acct");
    script(&format!("{account}-b"), vec![Step::Fail(TestError::Boom)]);
    let msg = split_msg(&account, 40);
    let source = MemorySource::new("dw-split");
    let handle = source.handle();
    let id = handle.push(inbox_tests::envelope(&msg));
    handle.close();
    let worker = DynamoWorker::new(dispatcher).requeue_delay(Duration::from_secs(3600));
    let run = worker.run(source, CancellationToken::new()).await.unwrap();
    assert_eq!(
        run,
        report(|r| {
            r.deliveries = 2;
            r.processed = 2;
            r.failed = 1;
            r.duplicates = 1;
            r.requeued = 1;
            r.acked = 1;
            r.stop = StopReason::SourceExhausted;
        })
    );
    // The handler's retry delay (zero: the inbox's policy), not the worker's hour.
    let requeue = Settlement::Requeue {
        delay: Some(Duration::ZERO),
    };
    assert_eq!(handle.settlements(), [(id, requeue), (id, Settlement::Ack)]);
    let d = worker.dispatcher();
    assert_eq!(balance(d, &format!("{account}-a")).await, Some(40));
    assert_eq!(balance(d, &format!("{account}-b")).await, Some(40));
}

#[tokio::test]
async fn two_consumers_one_dead_the_other_processed_is_acked_with_the_dead_letter_kept() {
    let dispatcher = setup().await;
    let account = fresh("acct");
    script(&format!("{account}-b"), vec![Step::Fail(TestError::Fatal)]);
    let msg = split_msg(&account, 9);
    let source = MemorySource::new("dw-split-dead");
    let handle = source.handle();
    let id = handle.push(inbox_tests::envelope(&msg));
    handle.close();
    let worker = DynamoWorker::new(dispatcher);
    let run = worker.run(source, CancellationToken::new()).await.unwrap();
    assert_eq!(
        run,
        report(|r| {
            r.deliveries = 1;
            r.processed = 1;
            r.dead = 1;
            r.acked = 1;
            r.stop = StopReason::SourceExhausted;
        })
    );
    assert_eq!(handle.settlements(), [(id, Settlement::Ack)]);
    let d = worker.dispatcher();
    assert_eq!(balance(d, &format!("{account}-a")).await, Some(9));
    assert_eq!(balance(d, &format!("{account}-b")).await, None);
    let dead = d.inbox().admin().show("dw-split-b", &msg.id).await.unwrap();
    assert_eq!(dead.unwrap().status.as_str(), "dead");
}

#[tokio::test]
async fn a_panicking_handler_drops_its_delivery_unsettled_and_the_redelivery_applies_once() {
    let dispatcher = setup().await;
    let account = fresh("acct");
    script(&account, vec![Step::Panic]);
    let msg = credit_msg(&account, 11);
    let other = credit_msg(&fresh("acct"), 12);
    let (source, handle, ids) = memory(&[msg.clone(), other.clone()]);
    handle.close();
    let worker = DynamoWorker::new(dispatcher).concurrency(1);
    let run = worker.run(source, CancellationToken::new()).await.unwrap();
    assert_eq!(
        run,
        report(|r| {
            r.deliveries = 3;
            r.abandoned = 1;
            r.processed = 2;
            r.acked = 2;
            r.stop = StopReason::SourceExhausted;
        })
    );
    assert_eq!(handle.abandoned(), [ids[0]]);
    assert_eq!(
        settled(&handle),
        [(ids[0], Settlement::Ack), (ids[1], Settlement::Ack)]
    );
    assert_eq!(balance(worker.dispatcher(), &account).await, Some(11));
    assert_eq!(balance(worker.dispatcher(), &other.account).await, Some(12));
}

/// A delivery over the dispatcher's payload limit is kept cut to the limit (with its real size)
/// and acked; nothing of it is applied or claimed.
#[tokio::test]
async fn an_oversized_delivery_is_kept_cut_to_the_limit_and_nothing_is_applied() {
    let dispatcher = setup().await.with_max_payload_bytes(256).unwrap();
    let account = fresh("acct");
    let mut big = credit_msg(&account, 1);
    big.account = format!("{account}{}", "x".repeat(300));
    let small = Credit {
        id: "k".to_owned(),
        account: account.clone(),
        amount: 2,
    };
    let (source, handle, ids) = memory(&[big.clone(), small]);
    handle.close();
    let worker = DynamoWorker::new(dispatcher);
    let run = worker.run(source, CancellationToken::new()).await.unwrap();
    assert_eq!(
        run,
        report(|r| {
            r.deliveries = 2;
            r.invalid = 1;
            r.processed = 1;
            r.acked = 2;
            r.stop = StopReason::SourceExhausted;
        })
    );
    assert_eq!(
        settled(&handle),
        [(ids[0], Settlement::Ack), (ids[1], Settlement::Ack)]
    );
    assert_eq!(balance(worker.dispatcher(), &big.account).await, None);
    assert_eq!(status(worker.dispatcher(), &big.id).await, None);
    let whole = envelope(&big).payload;
    assert_eq!(
        kept_rejections(worker.dispatcher()).await,
        [(
            "too_large".to_owned(),
            None,
            Some("dw.credited".to_owned()),
            whole[..256].to_vec(),
            Some(i64::try_from(whole.len()).unwrap())
        )]
    );
}

#[tokio::test]
async fn a_conflict_is_rejected_and_the_first_payload_stays_applied_once() {
    let dispatcher = setup().await;
    let account = fresh("acct");
    let first = credit_msg(&account, 50);
    let mut other = first.clone();
    other.amount = 51;
    let (source, handle, ids) = memory(&[first.clone(), other.clone(), first]);
    handle.close();
    let worker = DynamoWorker::new(dispatcher).concurrency(1);
    let run = worker.run(source, CancellationToken::new()).await.unwrap();
    assert_eq!(
        run,
        report(|r| {
            r.deliveries = 3;
            r.processed = 1;
            r.conflicts = 1;
            r.duplicates = 1;
            r.acked = 2;
            r.rejected = 1;
            r.stop = StopReason::SourceExhausted;
        })
    );
    assert_eq!(
        settled(&handle),
        [
            (ids[0], Settlement::Ack),
            (ids[1], Settlement::Reject),
            (ids[2], Settlement::Ack)
        ]
    );
    assert_eq!(balance(worker.dispatcher(), &account).await, Some(50));
    // The conflicting payload is kept in the table before the reject, as on the SQL stores.
    assert_eq!(
        kept_rejections(worker.dispatcher()).await,
        [(
            "conflict".to_owned(),
            Some("dw-ledger".to_owned()),
            Some("dw.credited".to_owned()),
            envelope(&other).payload,
            None
        )]
    );
}

/// A TCP proxy to moto's DynamoDB that forwards everything but the answer to the first
/// `TransactWriteItems`: that one is committed by moto, its answer dropped and the connection
/// closed (an unknown outcome). Returns the proxy's endpoint and how many answers it dropped.
async fn lossy_proxy() -> (String, Arc<std::sync::atomic::AtomicUsize>) {
    use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
    let upstream = endpoint().trim_start_matches("http://").to_owned();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let address = listener.local_addr().unwrap();
    let armed = Arc::new(AtomicBool::new(true));
    let dropped = Arc::new(AtomicUsize::new(0));
    let counter = Arc::clone(&dropped);
    tokio::spawn(async move {
        loop {
            let Ok((client, _)) = listener.accept().await else {
                return;
            };
            let server = tokio::net::TcpStream::connect(&upstream).await.unwrap();
            let (mut client_read, mut client_write) = client.into_split();
            let (mut server_read, mut server_write) = server.into_split();
            // The request bytes since the last answer.
            let request = Arc::new(Mutex::new(Vec::<u8>::new()));
            let seen = Arc::clone(&request);
            tokio::spawn(async move {
                let mut buf = vec![0; 64 * 1024];
                while let Ok(n @ 1..) = client_read.read(&mut buf).await {
                    seen.lock().unwrap().extend_from_slice(&buf[..n]);
                    if server_write.write_all(&buf[..n]).await.is_err() {
                        return;
                    }
                }
            });
            let (armed, dropped) = (Arc::clone(&armed), Arc::clone(&counter));
            tokio::spawn(async move {
                let mut buf = vec![0; 64 * 1024];
                while let Ok(n @ 1..) = server_read.read(&mut buf).await {
                    let asked = std::mem::take(&mut *request.lock().unwrap());
                    let transact = asked
                        .windows(b"TransactWriteItems".len())
                        .any(|w| w == b"TransactWriteItems");
                    if transact && armed.swap(false, Ordering::SeqCst) {
                        dropped.fetch_add(1, Ordering::SeqCst);
                        return; // both halves dropped: the client sees the connection close
                    }
                    if client_write.write_all(&buf[..n]).await.is_err() {
                        return;
                    }
                }
            });
        }
    });
    (format!("http://{address}"), dropped)
}

#[tokio::test]
async fn a_commit_whose_answer_is_lost_is_applied_once_and_acked_only_after_it() {
    let direct = setup().await;
    let (proxy, dropped) = lossy_proxy().await;
    let config = direct
        .inbox()
        .client()
        .config()
        .to_builder()
        .endpoint_url(proxy)
        .build();
    let inbox = dynamodb::DynamoInbox::new(
        dynamodb::sdk::Client::from_conf(config),
        direct.inbox().table().to_owned(),
    );
    let dispatcher = DynamoDispatcher::from_registry(inbox).unwrap();
    let account = fresh("acct");
    let msg = credit_msg(&account, 77);
    let (source, handle, ids) = memory(&[msg.clone(), msg.clone()]);
    handle.close();
    let run = DynamoWorker::new(dispatcher)
        .requeue_delay(Duration::ZERO)
        .run(source, CancellationToken::new())
        .await
        .unwrap();
    assert_eq!(dropped.load(std::sync::atomic::Ordering::SeqCst), 1);
    // The SDK resends the lost submit: DynamoDB answers it from its client request token
    // (`Processed`), moto, which ignores the token, with the claim's condition (read as a
    // `Duplicate`). Either way the effect is there once and both deliveries are acked after it.
    assert_eq!(balance(&direct, &account).await, Some(77));
    assert_eq!(status(&direct, &msg.id).await.as_deref(), Some("processed"));
    assert_eq!(run.processed + run.duplicates, run.acked);
    assert_eq!(run.acked, 2);
    assert_eq!(run.rejected, 0);
    let acks: Vec<u64> = settled(&handle)
        .into_iter()
        .filter(|(_, s)| *s == Settlement::Ack)
        .map(|(id, _)| id)
        .collect();
    assert_eq!(acks, ids);
    assert_eq!(
        (run.deliveries, run.failed, run.requeued, run.abandoned),
        (2, 0, 0, 0)
    );
}

#[tokio::test]
async fn a_fifo_group_keeps_its_order_across_a_shutdown_that_hands_back_its_waiting_messages() {
    let dispatcher = Arc::new(setup().await);
    let client = sqs_client().await;
    let url = client
        .create_queue()
        .queue_name(format!("{}.fifo", fresh("dw")))
        .attributes(QueueAttributeName::FifoQueue, "true")
        .attributes(QueueAttributeName::VisibilityTimeout, "1")
        .send()
        .await
        .unwrap()
        .queue_url
        .unwrap();
    let account = fresh("acct");
    let (entered, release) = (Arc::new(Notify::new()), Arc::new(Notify::new()));
    script(
        &account,
        vec![Step::Block {
            entered: entered.clone(),
            release: release.clone(),
        }],
    );
    let msgs: Vec<Credit> = (0..3).map(|i| credit_msg(&account, 1 << i)).collect();
    for msg in &msgs {
        let body = serde_json::to_vec(msg).unwrap();
        sqs_send(&client, &url, "dw.credited", &body, Some(("g", &msg.id))).await;
    }
    let token = CancellationToken::new();
    let first = DynamoWorker::from_arc(Arc::clone(&dispatcher));
    let source = SqsSource::connect(sqs_config(&url)).await.unwrap();
    let task = spawn_run(first, source, token.clone());
    entered.notified().await;
    token.cancel();
    release.notify_one();
    let (_, result) = task.await.unwrap();
    let stopped = result.unwrap();
    assert_eq!(
        (stopped.processed, stopped.acked, stopped.stop),
        (1, 1, StopReason::Shutdown)
    );
    // The next worker runs the rest of the group, in order, each once.
    let source = SqsSource::connect(sqs_config(&url)).await.unwrap();
    let second =
        DynamoWorker::from_arc(Arc::clone(&dispatcher)).stop_when_idle(Duration::from_secs(3));
    let run = second.run(source, CancellationToken::new()).await.unwrap();
    assert_eq!((run.processed, run.acked, run.duplicates), (2, 2, 0));
    let expected: Vec<Ran> = msgs.iter().map(|m| (1, m.id.clone())).collect();
    assert_eq!(runs(&account), expected);
    assert_eq!(balance(&dispatcher, &account).await, Some(7));
}

#[tokio::test]
async fn at_most_concurrency_deliveries_are_fetched_and_unsettled() {
    let dispatcher = setup().await;
    let accounts: Vec<String> = (0..4).map(|_| fresh("acct")).collect();
    let gates: Vec<(Arc<Notify>, Arc<Notify>)> = accounts
        .iter()
        .map(|account| {
            let gate = (Arc::new(Notify::new()), Arc::new(Notify::new()));
            script(
                account,
                vec![Step::Block {
                    entered: gate.0.clone(),
                    release: gate.1.clone(),
                }],
            );
            gate
        })
        .collect();
    let msgs: Vec<Credit> = accounts.iter().map(|a| credit_msg(a, 3)).collect();
    let (source, handle, _) = memory(&msgs);
    handle.close();
    let task = spawn_run(
        DynamoWorker::new(dispatcher).concurrency(2),
        source,
        CancellationToken::new(),
    );
    gates[0].0.notified().await;
    gates[1].0.notified().await;
    for _ in 0..200 {
        tokio::task::yield_now().await;
    }
    // Two running, none more fetched.
    assert_eq!((handle.deliveries(), handle.settlements().len()), (2, 0));
    gates[0].1.notify_one();
    gates[2].0.notified().await;
    assert_eq!((handle.deliveries(), handle.settlements().len()), (3, 1));
    gates[1].1.notify_one();
    gates[2].1.notify_one();
    gates[3].0.notified().await;
    gates[3].1.notify_one();
    let (worker, result) = task.await.unwrap();
    assert_eq!(
        result.unwrap(),
        report(|r| {
            r.deliveries = 4;
            r.processed = 4;
            r.acked = 4;
            r.stop = StopReason::SourceExhausted;
        })
    );
    for account in &accounts {
        assert_eq!(balance(worker.dispatcher(), account).await, Some(3));
    }
}
