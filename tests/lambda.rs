//! AWS Lambda's SQS batches (feature `lambda`) through the real Lambda runtime API protocol:
//! `lambda_runtime` polls a runtime API played by an axum server on loopback
//! (`GET /2018-06-01/runtime/invocation/next` answers with an SQS event,
//! `POST …/{request id}/response` carries the partial batch response back), on PostgreSQL.
//!
//! `lambda_runtime` reads the runtime API's address from `AWS_LAMBDA_RUNTIME_API` when it starts,
//! so the tests of this binary run one at a time (`SERIAL`), each setting the variable to its
//! own server before its function instances start.

#![allow(missing_docs)]

use std::collections::HashSet;
use std::sync::Mutex as StdMutex;
use std::time::Duration;

use inbox_runtime::source::lambda::LambdaSqs;
use inbox_runtime::source::lambda::sqs::SqsEvent;
use inbox_runtime::{Classify, Dispatcher, ErrorClass, Worker};
use inbox_tests::lambda::{Answer, Event, invoke, listed, record, runtime_api};
use serde_json::{Value, json};
use sqlx::PgPool;
use tokio::sync::{Mutex, mpsc};

static SERIAL: Mutex<()> = Mutex::const_new(());

const CONSUMER: &str = "lambda-credits";
const QUEUE_ARN: &str = "arn:aws:sqs:eu-west-1:123456789012:credits";
const FIFO_ARN: &str = "arn:aws:sqs:eu-west-1:123456789012:credits.fifo";

#[derive(Debug, Clone, serde::Serialize, serde::Deserialize, inbox_runtime::Message)]
#[message(name = "lambda.credit")]
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
    #[error(transparent)]
    Db(#[from] sqlx::Error),
}

impl Classify for CreditError {
    fn class(&self) -> ErrorClass {
        match self {
            CreditError::Unavailable => ErrorClass::Retryable,
            CreditError::Negative(_) => ErrorClass::Permanent,
            CreditError::Db(error) => error.class(),
        }
    }
}

/// Ids whose handler fails with a retryable error while they are in here.
static UNAVAILABLE: StdMutex<Option<HashSet<String>>> = StdMutex::new(None);

fn set_unavailable(ids: &[&str]) {
    *UNAVAILABLE.lock().unwrap() = Some(ids.iter().map(|id| (*id).to_owned()).collect());
}

/// Ids whose handler never answers while they are in here.
static HELD: StdMutex<Option<HashSet<String>>> = StdMutex::new(None);

#[inbox_runtime::idempotent(consumer = "lambda-credits")]
async fn credit(conn: &mut sqlx::PgConnection, msg: Credit) -> Result<(), CreditError> {
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
    sqlx::query(inbox_tests::APPLY_EFFECT)
        .bind(&msg.account)
        .bind(msg.amount)
        .execute(&mut *conn)
        .await?;
    Ok(())
}

/// A runtime API on loopback per function instance, and the instances that poll them.
struct Harness {
    /// The events of the current instance's runtime API.
    events: Option<mpsc::UnboundedSender<Event>>,
    answers_tx: mpsc::UnboundedSender<Answer>,
    answers: mpsc::UnboundedReceiver<Answer>,
    invocations: u32,
    pool: PgPool,
}

impl Harness {
    async fn start() -> Self {
        let (answers_tx, answers) = mpsc::unbounded_channel();
        let pool = inbox_tests::pg_pool(4).await;
        Self {
            events: None,
            answers_tx,
            answers,
            invocations: 0,
            pool,
        }
    }

    /// Starts a function instance (a cold start: its own runtime API on a new port, its own
    /// pool on the same database), polling until `abort`ed. Events go to it from now on; a
    /// `next` that an earlier instance left waiting gets none.
    async fn cold_start(&mut self) -> tokio::task::JoinHandle<Result<(), lambda_runtime::Error>> {
        self.events = Some(runtime_api(self.answers_tx.clone()).await);
        let options = self.pool.connect_options().as_ref().clone();
        let pool = sqlx::postgres::PgPoolOptions::new()
            .max_connections(4)
            .connect_with(options)
            .await
            .unwrap();
        let dispatcher =
            Dispatcher::from_handlers(pool, [inbox_runtime::handler!(credit)]).unwrap();
        let function = LambdaSqs::new(Worker::new(dispatcher).requeue_delay(Duration::ZERO));
        tokio::spawn(function.run())
    }

    /// One invocation with `records`, due in 60 s: what the function answered.
    async fn invoke(&mut self, records: Vec<Value>) -> Answer {
        self.invoke_within(records, Duration::from_secs(60)).await
    }

    /// One invocation with `records`, whose deadline is `left` from now.
    async fn invoke_within(&mut self, records: Vec<Value>, left: Duration) -> Answer {
        self.invocations += 1;
        let events = self.events.as_ref().expect("a function instance started");
        let request_id = format!("request-{}", self.invocations);
        invoke(events, &mut self.answers, request_id, records, left).await
    }

    /// One invocation that must succeed: the ids it lists in `batchItemFailures`, in order.
    async fn failures(&mut self, records: Vec<Value>) -> Vec<String> {
        let answer = self.invoke(records).await;
        Self::listed(answer)
    }

    fn listed(answer: Answer) -> Vec<String> {
        listed(answer)
    }

    async fn effect(&self, account: &str) -> Option<(i64, i64)> {
        inbox_tests::effect(&self.pool, account).await
    }

    async fn status(&self, key: &str) -> Option<(String, i32)> {
        inbox_tests::inbox_row(&self.pool, CONSUMER, key).await
    }

    async fn count(&self, sql: &'static str) -> i64 {
        inbox_tests::count(&self.pool, sql).await
    }
}

fn credit_body(id: &str, account: &str, amount: i64) -> String {
    json!({ "id": id, "account": account, "amount": amount }).to_string()
}

/// A credit on the standard queue.
fn credit_record(message_id: &str, id: &str, account: &str, amount: i64) -> Value {
    let body = credit_body(id, account, amount);
    record(
        message_id,
        QUEUE_ARN,
        Some(body),
        Some("lambda.credit"),
        None,
    )
}

/// A credit on the FIFO queue, in `group`.
fn fifo_record(message_id: &str, id: &str, group: &str, amount: i64) -> Value {
    let body = credit_body(id, group, amount);
    let name = Some("lambda.credit");
    record(message_id, FIFO_ARN, Some(body), name, Some(group))
}

/// A duplicate (a redelivery, and a producer's retry under a new messageId) and a conflict (the
/// same idempotency key with another amount) are successes: not listed, nothing applied twice.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn duplicates_and_conflicts_across_invocations_are_successes() {
    let _serial = SERIAL.lock().await;
    let mut api = Harness::start().await;
    set_unavailable(&[]);
    let function = api.cold_start().await;

    let first = vec![
        credit_record("m-1", "c-1", "alice", 100),
        credit_record("m-2", "c-2", "alice", 50),
    ];
    assert_eq!(api.failures(first).await, Vec::<String>::new());
    // Lambda redelivers m-1 (its delete was lost); the producer retries c-2 as m-3; m-4 reuses
    // the key c-1 with another amount (a conflict); c-3 is new.
    let second = vec![
        credit_record("m-1", "c-1", "alice", 100),
        credit_record("m-3", "c-2", "alice", 50),
        credit_record("m-4", "c-1", "alice", 999),
        credit_record("m-5", "c-3", "alice", 7),
    ];
    assert_eq!(api.failures(second).await, Vec::<String>::new());

    // Three credits, each applied once.
    assert_eq!(api.effect("alice").await, Some((3, 157)));
    assert_eq!(
        api.count("SELECT COUNT(*) FROM inbox_messages WHERE status = 'processed'")
            .await,
        3
    );
    assert_eq!(
        api.count("SELECT COUNT(*) FROM inbox_rejections WHERE reason = 'conflict'")
            .await,
        1
    );
    function.abort();
}

/// Retryable failures are listed by messageId, exactly, in the event's order; the rest commit.
/// Their redelivery, once the failure passed, applies them once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_partial_failure_lists_exactly_the_failed_records() {
    let _serial = SERIAL.lock().await;
    let mut api = Harness::start().await;
    set_unavailable(&["c-2", "c-4"]);
    let function = api.cold_start().await;

    let batch = vec![
        credit_record("m-1", "c-1", "alice", 1),
        credit_record("m-2", "c-2", "bob", 10),
        credit_record("m-3", "c-3", "alice", 100),
        credit_record("m-4", "c-4", "bob", 1000),
        credit_record("m-5", "c-5", "carol", 5),
    ];
    assert_eq!(api.failures(batch).await, ["m-2", "m-4"]);
    assert_eq!(api.effect("alice").await, Some((2, 101)));
    assert_eq!(api.effect("bob").await, None);
    assert_eq!(api.effect("carol").await, Some((1, 5)));
    assert_eq!(api.status("c-2").await, Some(("failed".to_owned(), 1)));
    assert_eq!(api.status("c-4").await, Some(("failed".to_owned(), 1)));

    // Redelivered before the inbox's retry delay has passed: listed again, not run.
    set_unavailable(&["c-4"]);
    let early = vec![credit_record("m-2", "c-2", "bob", 10)];
    assert_eq!(api.failures(early).await, ["m-2"]);
    assert_eq!(api.status("c-2").await, Some(("failed".to_owned(), 1)));

    // Once due: still failing for c-4, so only it is listed.
    assert_eq!(inbox_tests::make_due(&api.pool).await, 2);
    let again = vec![
        credit_record("m-2", "c-2", "bob", 10),
        credit_record("m-4", "c-4", "bob", 1000),
    ];
    assert_eq!(api.failures(again).await, ["m-4"]);
    set_unavailable(&[]);
    assert_eq!(inbox_tests::make_due(&api.pool).await, 1);
    let last = vec![credit_record("m-4", "c-4", "bob", 1000)];
    assert_eq!(api.failures(last).await, Vec::<String>::new());

    assert_eq!(api.effect("alice").await, Some((2, 101)));
    assert_eq!(api.effect("bob").await, Some((2, 1010)));
    assert_eq!(api.effect("carol").await, Some((1, 5)));
    assert_eq!(api.status("c-4").await, Some(("processed".to_owned(), 3)));
    function.abort();
}

/// FIFO: once a record of a group fails, the group's later records of the batch are listed
/// too, unrun; the other group goes on. Redelivered in order, each applies once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fifo_group_after_a_failure_is_listed_whole() {
    let _serial = SERIAL.lock().await;
    let mut api = Harness::start().await;
    set_unavailable(&["a-2"]);
    let function = api.cold_start().await;

    let batch = vec![
        fifo_record("m-a1", "a-1", "ga", 1),
        fifo_record("m-b1", "b-1", "gb", 10),
        fifo_record("m-a2", "a-2", "ga", 100),
        fifo_record("m-b2", "b-2", "gb", 20),
        fifo_record("m-a3", "a-3", "ga", 1000),
        fifo_record("m-a4", "a-4", "ga", 10000),
        fifo_record("m-b3", "b-3", "gb", 30),
    ];
    assert_eq!(api.failures(batch).await, ["m-a2", "m-a3", "m-a4"]);
    assert_eq!(api.effect("ga").await, Some((1, 1)));
    assert_eq!(api.effect("gb").await, Some((3, 60)));
    // a-3 and a-4 never ran: no inbox row.
    assert_eq!(api.status("a-3").await, None);
    assert_eq!(api.status("a-4").await, None);

    set_unavailable(&[]);
    assert_eq!(inbox_tests::make_due(&api.pool).await, 1);
    let again = vec![
        fifo_record("m-a2", "a-2", "ga", 100),
        fifo_record("m-a3", "a-3", "ga", 1000),
        fifo_record("m-a4", "a-4", "ga", 10000),
    ];
    assert_eq!(api.failures(again).await, Vec::<String>::new());
    assert_eq!(api.effect("ga").await, Some((4, 11101)));
    assert_eq!(api.effect("gb").await, Some((3, 60)));
    function.abort();
}

/// A permanent failure is dead-lettered in the inbox (payload kept) and reported as a success,
/// so that SQS does not deliver it again and again; a retryable one beside it is listed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_permanent_failure_is_dead_lettered_and_reported_as_a_success() {
    let _serial = SERIAL.lock().await;
    let mut api = Harness::start().await;
    set_unavailable(&["c-3"]);
    let function = api.cold_start().await;

    let batch = vec![
        credit_record("m-1", "c-1", "alice", 5),
        credit_record("m-2", "c-2", "alice", -40),
        credit_record("m-3", "c-3", "alice", 3),
    ];
    assert_eq!(api.failures(batch).await, ["m-3"]);
    assert_eq!(api.status("c-2").await, Some(("dead".to_owned(), 1)));
    let payload: Vec<u8> = sqlx::query_scalar(
        "SELECT payload FROM inbox_messages WHERE consumer = $1 AND message_key = 'c-2'",
    )
    .bind(CONSUMER)
    .fetch_one(&api.pool)
    .await
    .unwrap();
    let payload: Value = serde_json::from_slice(&payload).unwrap();
    assert_eq!(payload["amount"], -40);
    assert_eq!(api.effect("alice").await, Some((1, 5)));

    // Sent again anyway (a producer's retry): a duplicate of a dead message, still a success.
    let again = vec![credit_record("m-9", "c-2", "alice", -40)];
    assert_eq!(api.failures(again).await, Vec::<String>::new());
    assert_eq!(api.status("c-2").await, Some(("dead".to_owned(), 1)));
    assert_eq!(api.effect("alice").await, Some((1, 5)));
    function.abort();
}

/// Bad input (no body, no name attribute, an unknown name, a malformed body) is refused as the
/// other sources' is (the empty name is `malformed`, an unknown one `unknown_message`), kept in
/// `inbox_rejections`, payload included, and reported as a success: nothing lost, never
/// received again and again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn malformed_records_are_kept_and_reported_as_successes() {
    let _serial = SERIAL.lock().await;
    let mut api = Harness::start().await;
    set_unavailable(&[]);
    let function = api.cold_start().await;

    let name = Some("lambda.credit");
    let batch = vec![
        record("m-1", QUEUE_ARN, None, name, None),
        record(
            "m-2",
            QUEUE_ARN,
            Some(credit_body("c-2", "x", 1)),
            None,
            None,
        ),
        record(
            "m-3",
            QUEUE_ARN,
            Some(credit_body("c-3", "x", 1)),
            Some("lambda.nope"),
            None,
        ),
        record("m-4", QUEUE_ARN, Some("{\"id\": ".into()), name, None),
        credit_record("m-5", "c-5", "alice", 8),
    ];
    assert_eq!(api.failures(batch).await, Vec::<String>::new());
    let kept: Vec<(String, String, Vec<u8>, Option<String>)> = sqlx::query_as(
        "SELECT message_name, reason, payload, source FROM inbox_rejections ORDER BY id",
    )
    .fetch_all(&api.pool)
    .await
    .unwrap();
    let mut kept: Vec<_> = kept
        .into_iter()
        .map(|(name, reason, payload, source)| {
            (name, reason, String::from_utf8(payload).unwrap(), source)
        })
        .collect();
    kept.sort();
    let credits = Some("credits".to_owned());
    assert_eq!(
        kept,
        [
            (
                String::new(),
                "malformed".to_owned(),
                credit_body("c-2", "x", 1),
                credits.clone()
            ),
            (
                "lambda.credit".to_owned(),
                "malformed".to_owned(),
                String::new(),
                credits.clone()
            ),
            (
                "lambda.credit".to_owned(),
                "malformed".to_owned(),
                "{\"id\": ".to_owned(),
                credits.clone()
            ),
            (
                "lambda.nope".to_owned(),
                "unknown_message".to_owned(),
                credit_body("c-3", "x", 1),
                credits.clone()
            ),
        ]
    );
    assert_eq!(api.effect("alice").await, Some((1, 8)));
    assert_eq!(api.effect("x").await, None);
    function.abort();
}

/// A cold start replays a batch: the first instance committed part of a batch and then died, so
/// Lambda sends the same batch again (as after a lost answer or a timeout) to a new instance: a
/// new runtime on a new port, a new pool, the same database. Every effect is applied exactly
/// once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cold_start_replaying_a_batch_applies_each_effect_once() {
    let _serial = SERIAL.lock().await;
    let mut api = Harness::start().await;
    set_unavailable(&["c-3"]);
    let batch = |receive_count: u32| {
        let mut records = vec![
            credit_record("m-1", "c-1", "alice", 100),
            credit_record("m-2", "c-2", "bob", 20),
            credit_record("m-3", "c-3", "alice", 3),
        ];
        for record in &mut records {
            record["attributes"]["ApproximateReceiveCount"] = json!(receive_count.to_string());
        }
        records
    };

    let first = api.cold_start().await;
    assert_eq!(api.failures(batch(1)).await, ["m-3"]);
    // The instance dies; Lambda takes it as a failed invocation: the whole batch comes back.
    first.abort();
    let _ = first.await;

    set_unavailable(&[]);
    assert_eq!(inbox_tests::make_due(&api.pool).await, 1);
    let second = api.cold_start().await;
    assert_eq!(api.failures(batch(2)).await, Vec::<String>::new());
    assert_eq!(api.effect("alice").await, Some((2, 103)));
    assert_eq!(api.effect("bob").await, Some((1, 20)));
    assert_eq!(api.status("c-1").await, Some(("processed".to_owned(), 1)));
    assert_eq!(api.status("c-3").await, Some(("processed".to_owned(), 2)));

    // And once more on a third instance: all duplicates.
    second.abort();
    let _ = second.await;
    let third = api.cold_start().await;
    assert_eq!(api.failures(batch(3)).await, Vec::<String>::new());
    assert_eq!(api.effect("alice").await, Some((2, 103)));
    assert_eq!(api.effect("bob").await, Some((1, 20)));
    assert_eq!(
        api.count("SELECT COUNT(*) FROM inbox_messages WHERE status = 'processed'")
            .await,
        3
    );
    third.abort();
}

/// A record still running the worker's drain timeout after the deadline margin began is
/// dropped unsettled and listed: its transaction rolls back, nothing of it is written; its
/// redelivery applies it once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_record_still_running_past_the_drain_timeout_is_dropped_and_listed() {
    let _serial = SERIAL.lock().await;
    set_unavailable(&[]);
    let pool = inbox_tests::pg_pool(4).await;
    *HELD.lock().unwrap() = Some(HashSet::from(["c-held".to_owned()]));
    let dispatcher =
        Dispatcher::from_handlers(pool.clone(), [inbox_runtime::handler!(credit)]).unwrap();
    let worker = Worker::new(dispatcher)
        .requeue_delay(Duration::ZERO)
        .drain_timeout(Duration::from_millis(200));
    let function = LambdaSqs::new(worker).deadline_margin(Duration::from_millis(400));
    let records = vec![credit_record("m-1", "c-held", "hal", 5)];
    let event: SqsEvent = serde_json::from_value(json!({ "Records": records.clone() })).unwrap();
    // The margin begins 300 ms from now; the held record is dropped 200 ms later.
    let deadline = std::time::SystemTime::now() + Duration::from_millis(700);
    let (response, report) = function.handle_by(event, deadline).await.unwrap();
    let listed: Vec<_> = response
        .batch_item_failures
        .into_iter()
        .map(|failure| failure.item_identifier)
        .collect();
    assert_eq!(listed, ["m-1"]);
    assert_eq!(
        (report.abandoned, report.processed, report.acked),
        (1, 0, 0)
    );
    assert_eq!(inbox_tests::effect(&pool, "hal").await, None);
    assert_eq!(
        inbox_tests::inbox_row(&pool, CONSUMER, "c-held").await,
        None
    );

    *HELD.lock().unwrap() = None;
    let event: SqsEvent = serde_json::from_value(json!({ "Records": records })).unwrap();
    let (response, report) = function.handle_reporting(event).await.unwrap();
    assert!(response.batch_item_failures.is_empty());
    assert_eq!((report.processed, report.abandoned), (1, 0));
    assert_eq!(inbox_tests::effect(&pool, "hal").await, Some((1, 5)));
    assert_eq!(
        inbox_tests::inbox_row(&pool, CONSUMER, "c-held").await,
        Some(("processed".to_owned(), 1))
    );
}

/// An invocation whose deadline is within the function's margin (3 s by default): no record
/// starts, all are listed in the event's order, nothing is applied; with time, all commit.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn records_not_started_before_the_deadline_margin_are_listed() {
    let _serial = SERIAL.lock().await;
    let mut api = Harness::start().await;
    set_unavailable(&[]);
    let function = api.cold_start().await;

    let batch = || {
        vec![
            credit_record("m-1", "c-1", "alice", 1),
            credit_record("m-2", "c-2", "alice", 2),
            credit_record("m-3", "c-3", "bob", 4),
        ]
    };
    let answer = api.invoke_within(batch(), Duration::from_secs(2)).await;
    assert_eq!(answer.kind, "response", "{answer:?}");
    assert_eq!(Harness::listed(answer), ["m-1", "m-2", "m-3"]);
    assert_eq!(api.count("SELECT COUNT(*) FROM inbox_messages").await, 0);
    assert_eq!(api.effect("alice").await, None);

    assert_eq!(api.failures(batch()).await, Vec::<String>::new());
    assert_eq!(api.effect("alice").await, Some((2, 3)));
    assert_eq!(api.effect("bob").await, Some((1, 4)));
    function.abort();
}
