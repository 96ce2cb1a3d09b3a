//! AWS Lambda's SQS batches on the DynamoDB store (features `lambda` and `dynamodb`):
//! `DynamoLambdaSqs` over a `DynamoDispatcher` of `#[idempotent]` DynamoDB handlers, against
//! moto's DynamoDB on loopback (`DYNAMODB_ENDPOINT`, the serial moto server of scripts/sqs.sh):
//! duplicates across invocations, partial failures, conflicts, dead letters, refused records,
//! FIFO groups, the deadline margin, a record to list without a `messageId`; and `run()` on the
//! real runtime API protocol (`lambda_runtime` against a runtime API on loopback, shared with
//! tests/lambda.rs).
//!
//! Each test has an inbox table of its own (a fresh name, retries due at once) and ids and
//! accounts of its own (fresh) in one accounts table shared by the binary.

#![allow(missing_docs)]

use std::collections::HashSet;
use std::sync::Mutex;
use std::time::{Duration, SystemTime};

use inbox_runtime::dynamodb::sdk::types::{AttributeValue, Update};
use inbox_runtime::dynamodb::{self, DynamoDispatcher, DynamoInbox, DynamoTx};
use inbox_runtime::source::lambda::sqs::SqsEvent;
use inbox_runtime::source::lambda::{DynamoLambdaReport, DynamoLambdaSqs, LambdaSqsError};
use inbox_runtime::{Classify, ErrorClass, Message, RetryPolicy, handler, idempotent};
use inbox_tests::dynamo::{create_id_table, endpoint};
use inbox_tests::lambda::{invoke as runtime_invoke, listed as lambda_listed, record, runtime_api};
use serde_json::{Value, json};

const QUEUE_ARN: &str = "arn:aws:sqs:eu-west-1:123456789012:credits";
const FIFO_ARN: &str = "arn:aws:sqs:eu-west-1:123456789012:credits.fifo";
const NAME: &str = "lambda.dyn.credit";
const CONSUMER: &str = "lambda-ledger";

#[derive(Clone, Debug, serde::Serialize, serde::Deserialize, Message)]
#[message(name = "lambda.dyn.credit")]
struct Credit {
    #[message(key)]
    id: String,
    account: String,
    amount: i64,
}

#[derive(Debug, thiserror::Error)]
enum CreditError {
    #[error("the ledger service is unavailable")]
    Unavailable,
    #[error("a negative credit ({0}) is refused for good")]
    Negative(i64),
    #[error("build: {0}")]
    Build(String),
}

impl Classify for CreditError {
    fn class(&self) -> ErrorClass {
        match self {
            CreditError::Negative(_) => ErrorClass::Permanent,
            _ => ErrorClass::Retryable,
        }
    }
}

/// Credit ids whose handler fails with a retryable error while they are in here (ids are fresh
/// per test, so the tests of this binary may run side by side).
static UNAVAILABLE: Mutex<Option<HashSet<String>>> = Mutex::new(None);

fn set_unavailable(ids: &[&str], unavailable: bool) {
    let mut set = UNAVAILABLE.lock().unwrap();
    let set = set.get_or_insert_with(HashSet::new);
    for id in ids {
        if unavailable {
            set.insert((*id).to_owned());
        } else {
            set.remove(*id);
        }
    }
}

/// Credit ids whose handler never answers while they are in here.
static HELD: Mutex<Option<HashSet<String>>> = Mutex::new(None);

/// The accounts table of this test binary (`id` string key), made once.
static ACCOUNTS: tokio::sync::OnceCell<String> = tokio::sync::OnceCell::const_new();

#[idempotent(consumer = "lambda-ledger", max_attempts = 5)]
async fn credit(tx: &mut DynamoTx, msg: Credit) -> Result<(), CreditError> {
    if msg.amount < 0 {
        return Err(CreditError::Negative(msg.amount));
    }
    if inbox_tests::in_set(&UNAVAILABLE, &msg.id) {
        return Err(CreditError::Unavailable);
    }
    if inbox_tests::in_set(&HELD, &msg.id) {
        // Never answers: the invocation's deadline has to drop it.
        std::future::pending::<()>().await;
    }
    let table = ACCOUNTS.get().expect("setup made the accounts table");
    tx.update(
        Update::builder()
            .table_name(table)
            .key("id", AttributeValue::S(msg.account.clone()))
            .update_expression("ADD balance :amount, credits :one")
            .expression_attribute_values(":amount", AttributeValue::N(msg.amount.to_string()))
            .expression_attribute_values(":one", AttributeValue::N("1".to_owned()))
            .build()
            .map_err(|e| CreditError::Build(e.to_string()))?,
    );
    Ok(())
}

/// Ids of this test: `{prefix}-{n}` for each of `names`, under one fresh prefix.
struct Ids(String);

impl Ids {
    fn new() -> Self {
        Self(uuid::Uuid::new_v4().simple().to_string()[..12].to_owned())
    }

    fn of(&self, name: &str) -> String {
        format!("{name}-{}", self.0)
    }
}

/// A fresh inbox table with retries due after `delay`, and the binary's accounts table.
async fn inbox_with(delay: Duration) -> DynamoInbox {
    let client = dynamodb::client(Some(&endpoint())).await;
    ACCOUNTS
        .get_or_init(|| async {
            let name = format!("accounts_{}", uuid::Uuid::new_v4().simple());
            create_id_table(&client, &name).await;
            name
        })
        .await;
    let inbox = DynamoInbox::new(client, format!("inbox_{}", uuid::Uuid::new_v4().simple()))
        .retry_policy(RetryPolicy::default().retry_delays(delay, delay));
    inbox.ensure_table().await.expect("inbox table");
    inbox
}

/// The function over a fresh inbox whose retries are due at once.
async fn function() -> DynamoLambdaSqs {
    function_with(Duration::ZERO).await
}

async fn function_with(delay: Duration) -> DynamoLambdaSqs {
    let dispatcher = DynamoDispatcher::from_handlers(inbox_with(delay).await, [handler!(credit)])
        .expect("one handler");
    DynamoLambdaSqs::new(dispatcher)
}

/// The account's credits and balance, if it has any.
async fn effect(function: &DynamoLambdaSqs, account: &str) -> Option<(i64, i64)> {
    let item = function
        .dispatcher()
        .inbox()
        .client()
        .get_item()
        .table_name(ACCOUNTS.get().unwrap())
        .key("id", AttributeValue::S(account.to_owned()))
        .consistent_read(true)
        .send()
        .await
        .unwrap()
        .item?;
    let number = |name: &str| match item.get(name) {
        Some(AttributeValue::N(n)) => n.parse::<i64>().unwrap(),
        other => panic!("{name} of {account}: {other:?}"),
    };
    Some((number("credits"), number("balance")))
}

/// The status and attempts of the key's inbox item, if it has one.
async fn status(function: &DynamoLambdaSqs, key: &str) -> Option<(String, u32)> {
    let shown = function
        .dispatcher()
        .inbox()
        .admin()
        .show(CONSUMER, key)
        .await
        .unwrap()?;
    Some((shown.status.as_str().to_owned(), shown.attempts))
}

/// One invocation: the ids listed in `batchItemFailures`, in order, and the report.
async fn invoke(
    function: &DynamoLambdaSqs,
    records: Vec<Value>,
) -> (Vec<String>, DynamoLambdaReport) {
    let event: SqsEvent = serde_json::from_value(json!({ "Records": records })).unwrap();
    let (response, report) = function.handle_reporting(event).await.unwrap();
    let listed = response
        .batch_item_failures
        .into_iter()
        .map(|failure| failure.item_identifier)
        .collect();
    (listed, report)
}

async fn listed(function: &DynamoLambdaSqs, records: Vec<Value>) -> Vec<String> {
    invoke(function, records).await.0
}

fn credit_body(id: &str, account: &str, amount: i64) -> String {
    json!({ "id": id, "account": account, "amount": amount }).to_string()
}

/// A credit on the standard queue.
fn credit_record(message_id: &str, id: &str, account: &str, amount: i64) -> Value {
    let body = credit_body(id, account, amount);
    record(message_id, QUEUE_ARN, Some(body), Some(NAME), None)
}

/// A credit on the FIFO queue, in `group` (credited to the account named as the group).
fn fifo_record(message_id: &str, id: &str, group: &str, amount: i64) -> Value {
    let body = credit_body(id, group, amount);
    record(message_id, FIFO_ARN, Some(body), Some(NAME), Some(group))
}

const NONE: Vec<String> = Vec::new();

/// A redelivery and a producer's retry under a new messageId are duplicates; the same key with
/// another amount is a conflict: kept in the table and listed (the queue's dead-letter queue keeps
/// it too), the rest deleted, each credit applied once.
#[tokio::test]
async fn duplicates_across_invocations_are_successes_and_a_conflict_is_listed() {
    let function = function().await;
    let ids = Ids::new();
    let (c1, c2, c3, alice) = (ids.of("c1"), ids.of("c2"), ids.of("c3"), ids.of("alice"));

    let first = vec![
        credit_record("m-1", &c1, &alice, 100),
        credit_record("m-2", &c2, &alice, 50),
    ];
    let (failures, report) = invoke(&function, first).await;
    assert_eq!(failures, NONE);
    assert_eq!(
        (report.records, report.deleted, report.processed),
        (2, 2, 2)
    );

    let second = vec![
        credit_record("m-1", &c1, &alice, 100),
        credit_record("m-3", &c2, &alice, 50),
        credit_record("m-4", &c1, &alice, 999),
        credit_record("m-5", &c3, &alice, 7),
    ];
    let (failures, report) = invoke(&function, second).await;
    assert_eq!(failures, ["m-4"]);
    let counts = |r: &DynamoLambdaReport| {
        [
            r.records,
            r.deleted,
            r.listed,
            r.processed,
            r.duplicates,
            r.conflicts,
            r.dead,
            r.failed,
            r.refused,
            r.not_run,
            r.abandoned,
        ]
    };
    assert_eq!(counts(&report), [4, 3, 1, 1, 2, 1, 0, 0, 0, 0, 0]);

    assert_eq!(effect(&function, &alice).await, Some((3, 157)));
    assert_eq!(
        status(&function, &c1).await,
        Some(("processed".to_owned(), 1))
    );
}

/// Retryable failures are listed by messageId, exactly, in the event's order; the rest commit.
/// Their redeliveries apply them once.
#[tokio::test]
async fn a_partial_failure_lists_exactly_the_failed_records() {
    let function = function().await;
    let ids = Ids::new();
    let c: Vec<String> = (1..=5).map(|n| ids.of(&format!("c{n}"))).collect();
    let (alice, bob, carol) = (ids.of("alice"), ids.of("bob"), ids.of("carol"));
    set_unavailable(&[&c[1], &c[3]], true);

    let batch = vec![
        credit_record("m-1", &c[0], &alice, 1),
        credit_record("m-2", &c[1], &bob, 10),
        credit_record("m-3", &c[2], &alice, 100),
        credit_record("m-4", &c[3], &bob, 1000),
        credit_record("m-5", &c[4], &carol, 5),
    ];
    let (failures, report) = invoke(&function, batch).await;
    assert_eq!(failures, ["m-2", "m-4"]);
    assert_eq!(
        (
            report.processed,
            report.failed,
            report.listed,
            report.deleted
        ),
        (3, 2, 2, 3)
    );
    assert_eq!(effect(&function, &alice).await, Some((2, 101)));
    assert_eq!(effect(&function, &bob).await, None);
    assert_eq!(effect(&function, &carol).await, Some((1, 5)));
    assert_eq!(
        status(&function, &c[1]).await,
        Some(("failed".to_owned(), 1))
    );
    assert_eq!(
        status(&function, &c[3]).await,
        Some(("failed".to_owned(), 1))
    );

    // Received again: c-4 still fails, so only it is listed.
    set_unavailable(&[&c[1]], false);
    let again = vec![
        credit_record("m-2", &c[1], &bob, 10),
        credit_record("m-4", &c[3], &bob, 1000),
    ];
    assert_eq!(listed(&function, again).await, ["m-4"]);
    set_unavailable(&[&c[3]], false);
    let last = vec![credit_record("m-4", &c[3], &bob, 1000)];
    assert_eq!(listed(&function, last).await, NONE);

    assert_eq!(effect(&function, &alice).await, Some((2, 101)));
    assert_eq!(effect(&function, &bob).await, Some((2, 1010)));
    assert_eq!(effect(&function, &carol).await, Some((1, 5)));
    assert_eq!(
        status(&function, &c[3]).await,
        Some(("processed".to_owned(), 3))
    );
}

/// A failed key received again before its next attempt is due is listed unrun (`NotYet`).
#[tokio::test]
async fn a_failed_key_before_its_retry_is_due_is_listed_unrun() {
    let function = function_with(Duration::from_secs(3600)).await;
    let ids = Ids::new();
    let (c1, dave) = (ids.of("c1"), ids.of("dave"));
    set_unavailable(&[&c1], true);
    assert_eq!(
        listed(&function, vec![credit_record("m-1", &c1, &dave, 3)]).await,
        ["m-1"]
    );
    set_unavailable(&[&c1], false);
    let (failures, report) = invoke(&function, vec![credit_record("m-1", &c1, &dave, 3)]).await;
    assert_eq!(failures, ["m-1"]);
    assert_eq!((report.not_yet, report.failed, report.listed), (1, 0, 1));
    assert_eq!(status(&function, &c1).await, Some(("failed".to_owned(), 1)));
    assert_eq!(effect(&function, &dave).await, None);
}

/// A permanent failure is dead-lettered in the inbox table (payload kept) and deleted; a
/// retryable one beside it is listed; the dead key sent again is deleted, not run.
#[tokio::test]
async fn a_permanent_failure_is_dead_lettered_and_deleted() {
    let function = function().await;
    let ids = Ids::new();
    let (c1, c2, c3, erin) = (ids.of("c1"), ids.of("c2"), ids.of("c3"), ids.of("erin"));
    set_unavailable(&[&c3], true);

    let batch = vec![
        credit_record("m-1", &c1, &erin, 5),
        credit_record("m-2", &c2, &erin, -40),
        credit_record("m-3", &c3, &erin, 3),
    ];
    let (failures, report) = invoke(&function, batch).await;
    assert_eq!(failures, ["m-3"]);
    assert_eq!((report.processed, report.dead, report.failed), (1, 1, 1));
    assert_eq!(status(&function, &c2).await, Some(("dead".to_owned(), 1)));
    let shown = function
        .dispatcher()
        .inbox()
        .admin()
        .show(CONSUMER, &c2)
        .await
        .unwrap()
        .unwrap();
    let payload: Value = serde_json::from_slice(&shown.payload.unwrap()).unwrap();
    assert_eq!(payload["amount"], -40);
    assert_eq!(effect(&function, &erin).await, Some((1, 5)));

    let (failures, report) = invoke(&function, vec![credit_record("m-9", &c2, &erin, -40)]).await;
    assert_eq!(failures, NONE);
    assert_eq!((report.dead, report.deleted), (1, 1));
    assert_eq!(status(&function, &c2).await, Some(("dead".to_owned(), 1)));
    assert_eq!(effect(&function, &erin).await, Some((1, 5)));
    set_unavailable(&[&c3], false);
}

/// Records the dispatcher refuses (no body, no name attribute, an unknown name, a malformed
/// body, an empty key) are kept in the inbox table as rejections, then deleted: nothing of them
/// is applied or claimed; the good one commits.
#[tokio::test]
async fn refused_records_are_kept_and_deleted() {
    let function = function().await;
    let ids = Ids::new();
    let (c5, frank, x) = (ids.of("c5"), ids.of("frank"), ids.of("x"));
    let name = Some(NAME);
    let batch = vec![
        record("m-1", QUEUE_ARN, None, name, None),
        record("m-2", QUEUE_ARN, Some(credit_body("k2", &x, 1)), None, None),
        record(
            "m-3",
            QUEUE_ARN,
            Some(credit_body("k3", &x, 1)),
            Some("lambda.nope"),
            None,
        ),
        record("m-4", QUEUE_ARN, Some("{\"id\": ".into()), name, None),
        record("m-5", QUEUE_ARN, Some(credit_body("", &x, 1)), name, None),
        credit_record("m-6", &c5, &frank, 8),
    ];
    let (failures, report) = invoke(&function, batch).await;
    assert_eq!(failures, NONE);
    assert_eq!(
        (report.refused, report.processed, report.deleted),
        (5, 1, 6)
    );
    assert_eq!(effect(&function, &frank).await, Some((1, 8)));
    assert_eq!(effect(&function, &x).await, None);
    let stats = inbox_tests::dynamo::stats_rows(function.dispatcher().inbox()).await;
    let ledger = Some("lambda-ledger".to_owned());
    assert_eq!(
        stats,
        [
            (None, "rejected:malformed".to_owned(), 3),
            (None, "rejected:unknown_message".to_owned(), 1),
            (ledger.clone(), "processed".to_owned(), 1),
            (ledger, "rejected:invalid_key".to_owned(), 1),
        ]
    );
}

/// FIFO: once a record of a group is listed, the group's later records are listed unrun; the
/// other group goes on. Received again in order, each applies once.
#[tokio::test]
async fn a_fifo_group_after_a_failure_is_listed_whole() {
    let function = function().await.concurrency(2);
    let ids = Ids::new();
    let (ga, gb) = (ids.of("ga"), ids.of("gb"));
    let id = |name: &str| ids.of(name);
    set_unavailable(&[&id("a2")], true);

    let batch = vec![
        fifo_record("m-a1", &id("a1"), &ga, 1),
        fifo_record("m-b1", &id("b1"), &gb, 10),
        fifo_record("m-a2", &id("a2"), &ga, 100),
        fifo_record("m-b2", &id("b2"), &gb, 20),
        fifo_record("m-a3", &id("a3"), &ga, 1000),
        fifo_record("m-a4", &id("a4"), &ga, 10000),
        fifo_record("m-b3", &id("b3"), &gb, 30),
    ];
    let (failures, report) = invoke(&function, batch).await;
    assert_eq!(failures, ["m-a2", "m-a3", "m-a4"]);
    assert_eq!(
        (
            report.processed,
            report.failed,
            report.not_run,
            report.listed
        ),
        (4, 1, 2, 3)
    );
    assert_eq!(effect(&function, &ga).await, Some((1, 1)));
    assert_eq!(effect(&function, &gb).await, Some((3, 60)));
    assert_eq!(status(&function, &id("a3")).await, None);
    assert_eq!(status(&function, &id("a4")).await, None);

    set_unavailable(&[&id("a2")], false);
    let again = vec![
        fifo_record("m-a2", &id("a2"), &ga, 100),
        fifo_record("m-a3", &id("a3"), &ga, 1000),
        fifo_record("m-a4", &id("a4"), &ga, 10000),
    ];
    assert_eq!(listed(&function, again).await, NONE);
    assert_eq!(effect(&function, &ga).await, Some((4, 11101)));
    assert_eq!(effect(&function, &gb).await, Some((3, 60)));
}

/// An invocation whose deadline is within the margin (3 s by default): no record starts, all
/// are listed in the event's order, nothing is written.
#[tokio::test]
async fn records_not_started_before_the_deadline_margin_are_listed() {
    let function = function().await;
    let ids = Ids::new();
    let gus = ids.of("gus");
    let records = vec![
        credit_record("m-1", &ids.of("c1"), &gus, 1),
        credit_record("m-2", &ids.of("c2"), &gus, 2),
    ];
    let event: SqsEvent = serde_json::from_value(json!({ "Records": records })).unwrap();
    let deadline = SystemTime::now() + Duration::from_secs(2);
    let (response, report) = function.handle_by(event, deadline).await.unwrap();
    let listed: Vec<_> = response
        .batch_item_failures
        .into_iter()
        .map(|failure| failure.item_identifier)
        .collect();
    assert_eq!(listed, ["m-1", "m-2"]);
    assert_eq!((report.not_run, report.listed, report.processed), (2, 2, 0));
    assert_eq!(effect(&function, &gus).await, None);
}

/// A record still running half the deadline margin after the margin began is dropped and
/// listed: nothing of it is written, and its redelivery applies it once.
#[tokio::test]
async fn a_record_still_running_half_the_margin_after_it_began_is_dropped_and_listed() {
    let function = function().await.deadline_margin(Duration::from_millis(400));
    let ids = Ids::new();
    let (c1, hal) = (ids.of("c1"), ids.of("hal"));
    HELD.lock()
        .unwrap()
        .get_or_insert_with(HashSet::new)
        .insert(c1.clone());
    let records = vec![credit_record("m-1", &c1, &hal, 5)];
    let event: SqsEvent = serde_json::from_value(json!({ "Records": records.clone() })).unwrap();
    // The margin begins 300 ms from now; the held record is dropped 200 ms later.
    let deadline = SystemTime::now() + Duration::from_millis(700);
    let (response, report) = function.handle_by(event, deadline).await.unwrap();
    let listed: Vec<_> = response
        .batch_item_failures
        .into_iter()
        .map(|failure| failure.item_identifier)
        .collect();
    assert_eq!(listed, ["m-1"]);
    assert_eq!(
        (
            report.abandoned,
            report.listed,
            report.processed,
            report.not_run
        ),
        (1, 1, 0, 0)
    );
    assert_eq!(effect(&function, &hal).await, None);
    assert_eq!(status(&function, &c1).await, None);

    HELD.lock().unwrap().as_mut().unwrap().remove(&c1);
    let (failures, report) = invoke(&function, records).await;
    assert_eq!(failures, NONE);
    assert_eq!((report.processed, report.abandoned), (1, 0));
    assert_eq!(effect(&function, &hal).await, Some((1, 5)));
    assert_eq!(
        status(&function, &c1).await,
        Some(("processed".to_owned(), 1))
    );
}

/// A record to list without a `messageId` fails the invocation (Lambda retries the whole batch).
#[tokio::test]
async fn a_record_to_list_without_a_message_id_fails_the_invocation() {
    let function = function().await;
    let ids = Ids::new();
    // A retryable failure: the record is to be listed (a refused one is kept and deleted).
    let c2 = ids.of("c2");
    set_unavailable(&[&c2], true);
    let mut unnamed = credit_record("m-2", &c2, &ids.of("hal"), 2);
    unnamed["messageId"] = Value::Null;
    let records = vec![
        credit_record("m-1", &ids.of("c1"), &ids.of("hal"), 1),
        unnamed,
    ];
    let event: SqsEvent = serde_json::from_value(json!({ "Records": records })).unwrap();
    let answer = function.handle(event).await;
    set_unavailable(&[&c2], false);
    match answer {
        Err(LambdaSqsError::MissingMessageId { index }) => assert_eq!(index, 1),
        other => panic!("expected MissingMessageId, got {other:?}"),
    }
}

/// `run()`: the function polls a runtime API on loopback (lambda_runtime's own client) and
/// answers two invocations with their partial batch responses: a retryable failure listed, then
/// its redelivery and a duplicate deleted; each credit applied once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn run_answers_the_runtime_api_with_partial_batch_responses() {
    let function = function().await;
    let probe = function.clone();
    let ids = Ids::new();
    let (c1, c2, ivy) = (ids.of("c1"), ids.of("c2"), ids.of("ivy"));
    set_unavailable(&[&c2], true);

    // The only test of this binary that sets AWS_LAMBDA_RUNTIME_API.
    let (answers_tx, mut answers) = tokio::sync::mpsc::unbounded_channel();
    let events = runtime_api(answers_tx).await;
    let running = tokio::spawn(function.run());

    let batch = vec![
        credit_record("m-1", &c1, &ivy, 10),
        credit_record("m-2", &c2, &ivy, 20),
    ];
    let left = Duration::from_secs(60);
    let answer = runtime_invoke(&events, &mut answers, "request-1".into(), batch, left).await;
    assert_eq!(lambda_listed(answer), ["m-2"]);
    set_unavailable(&[&c2], false);
    let batch = vec![
        credit_record("m-2", &c2, &ivy, 20),
        credit_record("m-1", &c1, &ivy, 10),
    ];
    let answer = runtime_invoke(&events, &mut answers, "request-2".into(), batch, left).await;
    assert_eq!(lambda_listed(answer), NONE);
    assert_eq!(effect(&probe, &ivy).await, Some((2, 30)));
    assert_eq!(status(&probe, &c2).await, Some(("processed".to_owned(), 2)));
    running.abort();
}
