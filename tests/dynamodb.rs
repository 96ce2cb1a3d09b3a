//! The DynamoDB store (feature `dynamodb`, `inbox_runtime::dynamodb`) against moto's DynamoDB on
//! loopback: `DYNAMODB_ENDPOINT`, started by scripts/sqs.sh. That is a moto server of its own that
//! answers one request at a time: moto's threaded server (the SQS one) runs concurrent
//! `TransactWriteItems` without isolation (two claims of one key can both pass their condition,
//! and a cancelled transaction restores the tables as they were when it began, undoing writes
//! that committed meanwhile), which DynamoDB does not do.
//!
//! Each test has tables of its own (a fresh name), so they run side by side.

use inbox_tests::dynamo::endpoint;
use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use inbox_runtime::dynamodb::sdk::types::{AttributeValue, ConditionCheck, Put, Update};
use inbox_runtime::dynamodb::{
    self, DynamoError, DynamoInbox, DynamoTx, Failed, MAX_HANDLER_ITEMS,
};
use inbox_runtime::{Disposition, ErrorClass, Fingerprint, Message, Outcome, RetryPolicy};
use rand::SeedableRng;
use rand::seq::SliceRandom;

#[derive(Clone, Debug, serde::Serialize, serde::Deserialize, Message)]
#[message(name = "accounts.credited")]
struct Credit {
    #[message(key)]
    id: String,
    account: String,
    amount: i64,
}

fn credit(id: &str, account: &str, amount: i64) -> Credit {
    Credit {
        id: id.to_owned(),
        account: account.to_owned(),
        amount,
    }
}

use inbox_tests::dynamo::TestError;

type Result2<T> = Result<Outcome<T>, DynamoError<TestError>>;

/// The runtime's client with long timeouts (120 s an attempt): moto answers one request at a
/// time, so a storm's queue (or a busy CI machine) can hold an answer past the runtime's 10 s. A
/// timed-out commit is resent by the SDK, and moto, which ignores client request tokens, answers
/// the resend with a failed claim: the delivery that committed would be counted a duplicate
/// (its effect still applied once), and the tests' exact tallies would not hold.
async fn patient_client() -> dynamodb::sdk::Client {
    use inbox_runtime::dynamodb::sdk::config::timeout::TimeoutConfig;
    let client = dynamodb::client(Some(&endpoint())).await;
    let timeouts = TimeoutConfig::builder()
        .connect_timeout(Duration::from_secs(5))
        .read_timeout(Duration::from_secs(120))
        .operation_attempt_timeout(Duration::from_secs(120))
        .operation_timeout(Duration::from_secs(300))
        .build();
    dynamodb::sdk::Client::from_conf(
        client
            .config()
            .to_builder()
            .timeout_config(timeouts)
            .build(),
    )
}

/// A fresh inbox table and counters table (`id` string key) on the test server.
async fn setup(policy: RetryPolicy) -> (DynamoInbox, String) {
    let client = patient_client().await;
    let suffix = uuid::Uuid::new_v4().simple().to_string();
    let inbox = DynamoInbox::new(client.clone(), format!("inbox_{suffix}")).retry_policy(policy);
    inbox.ensure_table().await.expect("inbox table");
    // Twice: idempotent.
    inbox.ensure_table().await.expect("inbox table again");
    let counters = format!("counters_{suffix}");
    inbox_tests::dynamo::create_id_table(&client, &counters).await;
    (inbox, counters)
}

fn no_delays() -> RetryPolicy {
    RetryPolicy::default().retry_delays(Duration::ZERO, Duration::ZERO)
}

/// The effect: `ADD n :amount` on the account's counter item.
fn add_counter(
    tx: &mut DynamoTx,
    table: &str,
    account: &str,
    amount: i64,
) -> Result<(), TestError> {
    tx.update(
        Update::builder()
            .table_name(table)
            .key("id", AttributeValue::S(account.to_owned()))
            .update_expression("ADD n :amount")
            .expression_attribute_values(":amount", AttributeValue::N(amount.to_string()))
            .build()
            .map_err(|e| TestError::Build(e.to_string()))?,
    );
    Ok(())
}

/// Runs `msg` with the counter effect; `calls` counts handler runs.
async fn deliver(
    inbox: &DynamoInbox,
    counters: &str,
    msg: &Credit,
    calls: &AtomicUsize,
) -> Result2<()> {
    inbox
        .process("ledger", msg, |mut tx| async move {
            calls.fetch_add(1, Ordering::SeqCst);
            add_counter(&mut tx, counters, &msg.account, msg.amount)?;
            Ok((tx, ()))
        })
        .await
}

async fn counter(inbox: &DynamoInbox, table: &str, account: &str) -> Option<i64> {
    let item = inbox
        .client()
        .get_item()
        .table_name(table)
        .key("id", AttributeValue::S(account.to_owned()))
        .consistent_read(true)
        .send()
        .await
        .unwrap()
        .item?;
    match item.get("n") {
        Some(AttributeValue::N(n)) => Some(n.parse().unwrap()),
        other => panic!("counter {account}: {other:?}"),
    }
}

async fn inbox_item(inbox: &DynamoInbox, key: &str) -> Option<HashMap<String, AttributeValue>> {
    let key = inbox_runtime::IdempotencyKey::new(key, "test", "id").unwrap();
    inbox
        .client()
        .get_item()
        .table_name(inbox.table())
        .key(
            "pk",
            AttributeValue::S(dynamodb::partition_key("ledger", &key)),
        )
        .consistent_read(true)
        .send()
        .await
        .unwrap()
        .item
}

fn text(item: &HashMap<String, AttributeValue>, name: &str) -> String {
    match item.get(name) {
        Some(AttributeValue::S(s)) => s.clone(),
        other => panic!("{name}: {other:?}"),
    }
}

fn number(item: &HashMap<String, AttributeValue>, name: &str) -> i64 {
    match item.get(name) {
        Some(AttributeValue::N(n)) => n.parse().unwrap(),
        other => panic!("{name}: {other:?}"),
    }
}

fn payload(item: &HashMap<String, AttributeValue>) -> Option<Vec<u8>> {
    match item.get("payload") {
        Some(AttributeValue::B(b)) => Some(b.as_ref().to_vec()),
        None => None,
        other => panic!("payload: {other:?}"),
    }
}

#[tokio::test]
async fn claim_duplicate_and_conflict() {
    let (inbox, counters) = setup(RetryPolicy::default()).await;
    let calls = AtomicUsize::new(0);
    let msg = credit("e1", "acct-1", 70);

    let first = deliver(&inbox, &counters, &msg, &calls).await.unwrap();
    assert!(matches!(first, Outcome::Processed(())));
    // DynamoDB calls per delivery: a new key 2 (read, transaction), a duplicate 1 (read).
    assert_eq!(inbox.stats().calls, 2);
    let second = deliver(&inbox, &counters, &msg, &calls).await.unwrap();
    assert!(matches!(second, Outcome::Duplicate));
    assert_eq!(inbox.stats().calls, 3);
    assert_eq!(
        calls.load(Ordering::SeqCst),
        1,
        "a duplicate runs no handler"
    );
    assert_eq!(counter(&inbox, &counters, "acct-1").await, Some(70));

    let item = inbox_item(&inbox, "e1").await.unwrap();
    assert_eq!(text(&item, "status"), "processed");
    assert_eq!(number(&item, "attempts"), 1);
    assert_eq!(text(&item, "consumer"), "ledger");
    assert_eq!(text(&item, "message_key"), "e1");
    assert_eq!(text(&item, "message_name"), "accounts.credited");
    let fingerprint = Fingerprint::of(Credit::NAME, &msg).unwrap();
    assert_eq!(text(&item, "payload_hash"), fingerprint.to_hex());
    assert_eq!(payload(&item), None, "a processed item keeps no payload");
    let expires = number(&item, "expires_at");
    let processed = number(&item, "processed_at");
    assert_eq!(expires, processed / 1000 + 7 * 86_400);

    // The same key with another payload: a conflict, not applied.
    let other = credit("e1", "acct-1", 71);
    let error = deliver(&inbox, &counters, &other, &calls)
        .await
        .unwrap_err();
    let DynamoError::Conflict(conflict) = error else {
        panic!("expected a conflict, got {error:?}");
    };
    assert_eq!(conflict.consumer, "ledger");
    assert_eq!(conflict.key.as_str(), "e1");
    assert_eq!(conflict.stored, fingerprint);
    assert_eq!(
        conflict.received,
        Fingerprint::of(Credit::NAME, &other).unwrap()
    );
    assert_eq!(calls.load(Ordering::SeqCst), 1);
    assert_eq!(counter(&inbox, &counters, "acct-1").await, Some(70));
    // The conflicting delivery is kept in the table, payload included (`dynamodb::rejections`).
    let kept = inbox
        .client()
        .scan()
        .table_name(inbox.table())
        .filter_expression("attribute_exists(rejection)")
        .send()
        .await
        .unwrap()
        .items
        .unwrap_or_default();
    assert_eq!(kept.len(), 1, "{kept:?}");
    assert_eq!(text(&kept[0], "rejection"), "conflict");
    assert_eq!(text(&kept[0], "consumer"), "ledger");
    assert_eq!(text(&kept[0], "message_key"), "e1");
    assert_eq!(
        text(&kept[0], "payload_hash"),
        Fingerprint::of(Credit::NAME, &other).unwrap().to_hex()
    );
    assert_eq!(payload(&kept[0]), Some(serde_json::to_vec(&other).unwrap()));

    // Another consumer has its own scope: the same message is processed there.
    let outcome = inbox
        .process("audit", &msg, |mut tx| {
            let counters = &counters;
            async move {
                add_counter(&mut tx, counters, "audit", 1)?;
                Ok::<_, TestError>((tx, ()))
            }
        })
        .await
        .unwrap();
    assert!(outcome.is_processed());
    assert_eq!(counter(&inbox, &counters, "audit").await, Some(1));
}

#[tokio::test]
async fn failure_is_retried_then_processed() {
    let (inbox, counters) = setup(no_delays()).await;
    let msg = credit("f1", "acct-f", 5);
    let error = inbox
        .process("ledger", &msg, |mut tx| {
            let counters = &counters;
            async move {
                add_counter(&mut tx, counters, "acct-f", 5)?;
                Err::<(DynamoTx, ()), _>(TestError::Boom)
            }
        })
        .await
        .unwrap_err();
    let DynamoError::Handler(failure) = error else {
        panic!("expected a handler failure, got {error:?}");
    };
    assert!(matches!(failure.error, Failed::Handler(TestError::Boom)));
    assert_eq!(failure.attempts, 1);
    assert_eq!(failure.class, ErrorClass::Retryable);
    assert_eq!(
        failure.disposition,
        Disposition::Retry {
            after: Duration::ZERO
        }
    );
    assert_eq!(
        counter(&inbox, &counters, "acct-f").await,
        None,
        "nothing was submitted"
    );
    let item = inbox_item(&inbox, "f1").await.unwrap();
    assert_eq!(text(&item, "status"), "failed");
    assert_eq!(number(&item, "attempts"), 1);
    assert_eq!(text(&item, "last_error"), "boom");
    assert_eq!(payload(&item).unwrap(), serde_json::to_vec(&msg).unwrap());
    let received = number(&item, "received_at");

    let calls = AtomicUsize::new(0);
    let outcome = deliver(&inbox, &counters, &msg, &calls).await.unwrap();
    assert!(outcome.is_processed());
    assert_eq!(counter(&inbox, &counters, "acct-f").await, Some(5));
    let item = inbox_item(&inbox, "f1").await.unwrap();
    assert_eq!(text(&item, "status"), "processed");
    assert_eq!(number(&item, "attempts"), 2);
    assert_eq!(
        number(&item, "received_at"),
        received,
        "kept from the first attempt"
    );
    assert_eq!(payload(&item), None);
    assert!(
        deliver(&inbox, &counters, &msg, &calls)
            .await
            .unwrap()
            .is_duplicate()
    );
    assert_eq!(calls.load(Ordering::SeqCst), 1);

    // A failure whose next attempt is not due: NotYet, the handler not run.
    let (inbox, counters) = setup(
        RetryPolicy::default().retry_delays(Duration::from_secs(3600), Duration::from_secs(3600)),
    )
    .await;
    let error = inbox
        .process("ledger", &msg, |_tx| async {
            Err::<(DynamoTx, ()), _>(TestError::Boom)
        })
        .await
        .unwrap_err();
    let DynamoError::Handler(failure) = error else {
        panic!("{error:?}")
    };
    let Disposition::Retry { after } = failure.disposition else {
        panic!("{failure:?}")
    };
    // The policy's delay with backon's jitter (up to one more delay).
    assert!(
        after >= Duration::from_secs(3600) && after <= Duration::from_secs(7200),
        "{after:?}"
    );
    let outcome = deliver(&inbox, &counters, &msg, &calls).await.unwrap();
    let Outcome::NotYet { retry_in } = outcome else {
        panic!("{outcome:?}")
    };
    assert!(
        retry_in <= after && retry_in > after - Duration::from_secs(60),
        "{retry_in:?}"
    );
    assert_eq!(calls.load(Ordering::SeqCst), 1);
    // A different payload on a failed key is a conflict too.
    let error = deliver(&inbox, &counters, &credit("f1", "x", 1), &calls)
        .await
        .unwrap_err();
    assert!(matches!(error, DynamoError::Conflict(_)), "{error:?}");
}

#[tokio::test]
async fn dead_letter_after_max_attempts_and_permanent_errors() {
    let (inbox, counters) = setup(no_delays().max_attempts(3)).await;
    let msg = credit("d1", "acct-d", 1);
    let mut dispositions = Vec::new();
    for _ in 0..3 {
        let error = inbox
            .process("ledger", &msg, |_tx| async {
                Err::<(DynamoTx, ()), _>(TestError::Boom)
            })
            .await
            .unwrap_err();
        let DynamoError::Handler(failure) = error else {
            panic!("{error:?}")
        };
        dispositions.push((failure.attempts, failure.disposition));
    }
    assert_eq!(
        dispositions,
        [
            (
                1,
                Disposition::Retry {
                    after: Duration::ZERO
                }
            ),
            (
                2,
                Disposition::Retry {
                    after: Duration::ZERO
                }
            ),
            (3, Disposition::Dead),
        ]
    );
    let calls = AtomicUsize::new(0);
    let outcome = deliver(&inbox, &counters, &msg, &calls).await.unwrap();
    assert!(matches!(outcome, Outcome::Dead), "{outcome:?}");
    assert_eq!(calls.load(Ordering::SeqCst), 0);
    let item = inbox_item(&inbox, "d1").await.unwrap();
    assert_eq!(text(&item, "status"), "dead");
    assert_eq!(number(&item, "attempts"), 3);
    assert_eq!(payload(&item).unwrap(), serde_json::to_vec(&msg).unwrap());
    assert!(!item.contains_key("next_attempt_at"));

    // A permanent error is dead at once.
    let msg = credit("d2", "acct-d", 1);
    let error = inbox
        .process("ledger", &msg, |_tx| async {
            Err::<(DynamoTx, ()), _>(TestError::Fatal)
        })
        .await
        .unwrap_err();
    let DynamoError::Handler(failure) = error else {
        panic!("{error:?}")
    };
    assert_eq!(
        (failure.attempts, failure.disposition),
        (1, Disposition::Dead)
    );
    assert_eq!(failure.class, ErrorClass::Permanent);
    assert!(matches!(
        deliver(&inbox, &counters, &msg, &calls).await.unwrap(),
        Outcome::Dead
    ));
    assert_eq!(counter(&inbox, &counters, "acct-d").await, None);
}

/// The claim's condition fails when another delivery of the key commits while this one's
/// handler runs: the cancellation's item (or a read) decides it — a duplicate, or a conflict.
#[tokio::test]
async fn claim_condition_failure_is_a_duplicate_or_a_conflict() {
    let (inbox, counters) = setup(RetryPolicy::default()).await;
    let msg = credit("c1", "acct-c", 10);
    let calls = AtomicUsize::new(0);
    let outcome = inbox
        .process("ledger", &msg, |mut tx| {
            let (inbox, counters, msg, calls) = (&inbox, &counters, &msg, &calls);
            async move {
                // A concurrent delivery of the same message commits first.
                let inner = deliver(inbox, counters, msg, calls).await.unwrap();
                assert!(inner.is_processed());
                add_counter(&mut tx, counters, &msg.account, msg.amount)?;
                Ok::<_, TestError>((tx, ()))
            }
        })
        .await
        .unwrap();
    assert!(outcome.is_duplicate(), "{outcome:?}");
    assert_eq!(counter(&inbox, &counters, "acct-c").await, Some(10));

    // The same, with a different payload committed meanwhile: a conflict.
    let msg = credit("c2", "acct-c2", 10);
    let error = inbox
        .process("ledger", &msg, |mut tx| {
            let (inbox, counters, msg, calls) = (&inbox, &counters, &msg, &calls);
            async move {
                let other = credit("c2", "acct-c2", 99);
                assert!(
                    deliver(inbox, counters, &other, calls)
                        .await
                        .unwrap()
                        .is_processed()
                );
                add_counter(&mut tx, counters, &msg.account, msg.amount)?;
                Ok::<_, TestError>((tx, ()))
            }
        })
        .await
        .unwrap_err();
    let DynamoError::Conflict(conflict) = error else {
        panic!("{error:?}")
    };
    assert_eq!(
        conflict.received,
        Fingerprint::of(Credit::NAME, &msg).unwrap()
    );
    assert_eq!(counter(&inbox, &counters, "acct-c2").await, Some(99));
}

/// A handler action's condition fails: the handler's business failure, nothing of the
/// transaction written, the attempt recorded; a later delivery whose condition holds commits.
#[tokio::test]
async fn user_condition_failure_is_the_handlers_failure() {
    let (inbox, counters) = setup(no_delays()).await;
    let msg = credit("u1", "acct-u", 3);
    let run = |tx: DynamoTx| {
        let counters = counters.clone();
        async move {
            let mut tx = tx;
            add_counter(&mut tx, &counters, "acct-u", 3)?;
            tx.condition_check(
                ConditionCheck::builder()
                    .table_name(&counters)
                    .key("id", AttributeValue::S("gate".into()))
                    .condition_expression("attribute_exists(id)")
                    .build()
                    .map_err(|e| TestError::Build(e.to_string()))?,
            );
            Ok::<_, TestError>((tx, ()))
        }
    };
    let error = inbox.process("ledger", &msg, run).await.unwrap_err();
    let DynamoError::Handler(failure) = error else {
        panic!("{error:?}")
    };
    let Failed::Condition(condition) = &failure.error else {
        panic!("{failure:?}")
    };
    assert_eq!((condition.index, condition.action), (1, "ConditionCheck"));
    assert_eq!(condition.table, counters);
    assert_eq!(
        failure.disposition,
        Disposition::Retry {
            after: Duration::ZERO
        }
    );
    assert_eq!(
        counter(&inbox, &counters, "acct-u").await,
        None,
        "the update was not applied"
    );
    let item = inbox_item(&inbox, "u1").await.unwrap();
    assert_eq!(text(&item, "status"), "failed");
    assert_eq!(number(&item, "attempts"), 1);
    assert!(
        text(&item, "last_error")
            .starts_with("the condition of the handler's action 1 (ConditionCheck")
    );

    // Open the gate: the redelivery commits.
    inbox
        .client()
        .put_item()
        .table_name(&counters)
        .item("id", AttributeValue::S("gate".into()))
        .send()
        .await
        .unwrap();
    assert!(
        inbox
            .process("ledger", &msg, run)
            .await
            .unwrap()
            .is_processed()
    );
    assert_eq!(counter(&inbox, &counters, "acct-u").await, Some(3));
    assert_eq!(
        number(&inbox_item(&inbox, "u1").await.unwrap(), "attempts"),
        2
    );
}

/// Limits checked before any call, and a request DynamoDB refuses: nothing written, nothing
/// recorded.
#[tokio::test]
async fn limits_and_refused_requests() {
    let (inbox, counters) = setup(RetryPolicy::default()).await;
    let msg = credit("l1", "acct-l", 1);
    let many = |count: usize| {
        let counters = counters.clone();
        move |mut tx: DynamoTx| {
            let counters = counters.clone();
            async move {
                for i in 0..count {
                    add_counter(&mut tx, &counters, &format!("a{i}"), 1)?;
                }
                Ok::<_, TestError>((tx, ()))
            }
        }
    };
    let error = inbox
        .process("ledger", &msg, many(MAX_HANDLER_ITEMS + 1))
        .await
        .unwrap_err();
    assert!(
        matches!(
            error,
            DynamoError::TooManyItems {
                items: 100,
                max: 99
            }
        ),
        "{error:?}"
    );
    assert!(inbox_item(&inbox, "l1").await.is_none());

    let big = |count: usize, bytes: usize| {
        let counters = counters.clone();
        move |mut tx: DynamoTx| {
            let counters = counters.clone();
            async move {
                for i in 0..count {
                    tx.put(
                        Put::builder()
                            .table_name(&counters)
                            .item("id", AttributeValue::S(format!("big{i}")))
                            .item("blob", AttributeValue::S("x".repeat(bytes)))
                            .build()
                            .map_err(|e| TestError::Build(e.to_string()))?,
                    );
                }
                Ok::<_, TestError>((tx, ()))
            }
        }
    };
    let error = inbox
        .process("ledger", &msg, big(1, 400 * 1024))
        .await
        .unwrap_err();
    let DynamoError::TooLarge { what, bytes, max } = error else {
        panic!("{error:?}")
    };
    assert_eq!(
        (what.as_str(), bytes, max),
        ("the Put item of action 0", 400 * 1024 + 2 + 4 + 4, 409_600)
    );
    let error = inbox
        .process("ledger", &msg, big(11, 390 * 1024))
        .await
        .unwrap_err();
    let DynamoError::TooLarge { what, max, .. } = error else {
        panic!("{error:?}")
    };
    assert_eq!((what.as_str(), max), ("the transaction", 4 * 1024 * 1024));
    assert!(inbox_item(&inbox, "l1").await.is_none());

    // Two actions on one item: DynamoDB refuses the request (moto: ValidationException).
    let error = inbox
        .process("ledger", &msg, |mut tx| {
            let counters = &counters;
            async move {
                add_counter(&mut tx, counters, "same", 1)?;
                add_counter(&mut tx, counters, "same", 1)?;
                Ok::<_, TestError>((tx, ()))
            }
        })
        .await
        .unwrap_err();
    let DynamoError::Dynamo { operation, .. } = &error else {
        panic!("{error:?}")
    };
    assert_eq!(*operation, "TransactWriteItems");
    assert!(inbox_item(&inbox, "l1").await.is_none());
    assert_eq!(counter(&inbox, &counters, "same").await, None);

    // And then the message goes through.
    let calls = AtomicUsize::new(0);
    assert!(
        deliver(&inbox, &counters, &msg, &calls)
            .await
            .unwrap()
            .is_processed()
    );
}

/// DynamoDB's TTL deletes lazily: an item past `expires_at` is absent to the inbox, whatever it
/// holds.
#[tokio::test]
async fn expired_items_are_absent() {
    let (inbox, counters) = setup(RetryPolicy::default()).await;
    let calls = AtomicUsize::new(0);
    // A retention window of zero: every item expires at once.
    let zero = inbox.clone().retention(Duration::ZERO);
    let msg = credit("x1", "acct-x", 2);
    assert!(
        deliver(&zero, &counters, &msg, &calls)
            .await
            .unwrap()
            .is_processed()
    );
    assert!(
        deliver(&zero, &counters, &msg, &calls)
            .await
            .unwrap()
            .is_processed()
    );
    assert_eq!(counter(&inbox, &counters, "acct-x").await, Some(4));

    // An expired item with another payload (TTL has not deleted it yet): not a conflict.
    let msg = credit("x2", "acct-x2", 5);
    let key = inbox_runtime::IdempotencyKey::new("x2", "test", "id").unwrap();
    let stale = Fingerprint::of(Credit::NAME, &credit("x2", "other", 1)).unwrap();
    inbox
        .client()
        .put_item()
        .table_name(inbox.table())
        .item(
            "pk",
            AttributeValue::S(dynamodb::partition_key("ledger", &key)),
        )
        .item("status", AttributeValue::S("processed".into()))
        .item("payload_hash", AttributeValue::S(stale.to_hex()))
        .item("attempts", AttributeValue::N("1".into()))
        .item("expires_at", AttributeValue::N("1000".into()))
        .send()
        .await
        .unwrap();
    assert!(
        deliver(&inbox, &counters, &msg, &calls)
            .await
            .unwrap()
            .is_processed()
    );
    assert!(
        deliver(&inbox, &counters, &msg, &calls)
            .await
            .unwrap()
            .is_duplicate()
    );
    assert_eq!(counter(&inbox, &counters, "acct-x2").await, Some(5));
    let item = inbox_item(&inbox, "x2").await.unwrap();
    assert_eq!(number(&item, "attempts"), 1);
    assert!(number(&item, "expires_at") > 1000);
}

/// 16 tasks take 3 deliveries of each of 500 keys in a shuffled order; each delivery's effect is
/// a counter `Update` in the claim's transaction. Each counter ends at exactly 1.
#[tokio::test]
async fn storm_of_concurrent_deliveries() {
    const KEYS: usize = 500;
    let (inbox, counters) = setup(RetryPolicy::default()).await;
    let mut work: Vec<usize> = (0..KEYS).flat_map(|k| [k, k, k]).collect();
    work.shuffle(&mut rand_chacha::ChaCha8Rng::seed_from_u64(35));
    let work = Arc::new(std::sync::Mutex::new(work));
    let mut tasks = Vec::new();
    for _ in 0..16 {
        let (inbox, counters, work) = (inbox.clone(), counters.clone(), work.clone());
        tasks.push(tokio::spawn(async move {
            let (mut processed, mut duplicates) = (0_usize, 0_usize);
            loop {
                let Some(k) = work.lock().unwrap().pop() else {
                    break;
                };
                let msg = credit(&format!("storm-{k}"), &format!("acct-{k}"), 1);
                let calls = AtomicUsize::new(0);
                match deliver(&inbox, &counters, &msg, &calls).await.unwrap() {
                    Outcome::Processed(()) => processed += 1,
                    Outcome::Duplicate => duplicates += 1,
                    other => panic!("key {k}: {other:?}"),
                }
            }
            (processed, duplicates)
        }));
    }
    let (mut processed, mut duplicates) = (0, 0);
    for task in tasks {
        let (p, d) = task.await.unwrap();
        processed += p;
        duplicates += d;
    }
    assert_eq!((processed, duplicates), (KEYS, 2 * KEYS));

    let mut values = HashMap::new();
    let mut start = None;
    loop {
        let page = inbox
            .client()
            .scan()
            .table_name(&counters)
            .consistent_read(true)
            .set_exclusive_start_key(start)
            .send()
            .await
            .unwrap();
        for item in page.items() {
            values.insert(text(item, "id"), number(item, "n"));
        }
        start = page.last_evaluated_key().cloned();
        if start.is_none() {
            break;
        }
    }
    assert_eq!(values.len(), KEYS);
    let wrong: Vec<_> = values.iter().filter(|(_, n)| **n != 1).collect();
    assert!(wrong.is_empty(), "counters not 1: {wrong:?}");
    println!(
        "storm: {KEYS} keys × 3 deliveries over 16 tasks: processed={processed} duplicates={duplicates} transient retries={}",
        inbox.stats().transient_retries
    );
    // Every delivery reads once; every processed one and every duplicate that raced it past
    // the read submits once.
    let calls = inbox.stats().calls;
    assert!(
        (3 * KEYS as u64 + KEYS as u64..=6 * KEYS as u64).contains(&calls),
        "{calls}"
    );
    println!("storm: {calls} DynamoDB calls for {} deliveries", 3 * KEYS);
}

/// Bad input from outside: a table with another key schema, an item this store did not write.
#[tokio::test]
async fn foreign_tables_and_items_are_refused() {
    let (inbox, counters) = setup(RetryPolicy::default()).await;
    // The counters table's key is `id`, not `pk`.
    let wrong = DynamoInbox::new(inbox.client().clone(), counters.clone());
    let error = wrong.ensure_table().await.unwrap_err();
    assert_eq!(
        (error.table.as_str(), error.operation),
        (counters.as_str(), "DescribeTable")
    );
    assert!(
        error.source.to_string().contains("not `pk` alone"),
        "{error}"
    );

    // An item whose status is not one this store writes: an error, the handler not run.
    let key = inbox_runtime::IdempotencyKey::new("m1", "test", "id").unwrap();
    let msg = credit("m1", "acct-m", 1);
    let fingerprint = Fingerprint::of(Credit::NAME, &msg).unwrap();
    inbox
        .client()
        .put_item()
        .table_name(inbox.table())
        .item(
            "pk",
            AttributeValue::S(dynamodb::partition_key("ledger", &key)),
        )
        .item("status", AttributeValue::S("frozen".into()))
        .item("payload_hash", AttributeValue::S(fingerprint.to_hex()))
        .send()
        .await
        .unwrap();
    let calls = AtomicUsize::new(0);
    let error = deliver(&inbox, &counters, &msg, &calls).await.unwrap_err();
    let DynamoError::Malformed {
        consumer,
        key,
        reason,
    } = error
    else {
        panic!("{error:?}")
    };
    assert_eq!((consumer.as_str(), key.as_str()), ("ledger", "m1"));
    assert_eq!(reason, "status `frozen` is not one this store writes");
    assert_eq!(calls.load(Ordering::SeqCst), 0);
}

/// Failed and dead items are not the retention window's: as on the SQL stores (whose purge keeps
/// failed and dead rows unless asked), a dead letter stays, with its payload, and a failed key
/// keeps counting its attempts, however short the window. DynamoDB's TTL must not delete them,
/// and the runtime must not treat them as absent.
#[tokio::test]
async fn dead_letters_and_failed_attempts_outlive_the_retention_window() {
    let (inbox, counters) = setup(no_delays().max_attempts(3)).await;
    let zero = inbox.clone().retention(Duration::ZERO);
    let calls = AtomicUsize::new(0);

    // A permanent error: dead at once, and a redelivery is `Dead`, the handler not run.
    let msg = credit("r1", "acct-r", 7);
    let error = zero
        .process("ledger", &msg, |_tx| async {
            Err::<(DynamoTx, ()), _>(TestError::Fatal)
        })
        .await
        .unwrap_err();
    let DynamoError::Handler(failure) = error else {
        panic!("{error:?}")
    };
    assert_eq!(
        (failure.attempts, failure.disposition),
        (1, Disposition::Dead)
    );
    let outcome = deliver(&zero, &counters, &msg, &calls).await.unwrap();
    assert!(matches!(outcome, Outcome::Dead), "{outcome:?}");
    assert_eq!(calls.load(Ordering::SeqCst), 0);
    assert_eq!(counter(&inbox, &counters, "acct-r").await, None);
    let item = inbox_item(&inbox, "r1").await.unwrap();
    assert_eq!(text(&item, "status"), "dead");
    assert_eq!(payload(&item).unwrap(), serde_json::to_vec(&msg).unwrap());
    assert!(
        !item.contains_key("expires_at"),
        "DynamoDB's TTL would delete the dead letter: {item:?}"
    );

    // Retryable errors: the attempts count 1, 2, 3 and the third is dead.
    let msg = credit("r2", "acct-r", 7);
    let mut dispositions = Vec::new();
    for _ in 0..3 {
        let error = zero
            .process("ledger", &msg, |_tx| async {
                Err::<(DynamoTx, ()), _>(TestError::Boom)
            })
            .await
            .unwrap_err();
        let DynamoError::Handler(failure) = error else {
            panic!("{error:?}")
        };
        dispositions.push((failure.attempts, failure.disposition));
    }
    let retry = Disposition::Retry {
        after: Duration::ZERO,
    };
    assert_eq!(
        dispositions,
        [(1, retry), (2, retry), (3, Disposition::Dead)]
    );
    let item = inbox_item(&inbox, "r2").await.unwrap();
    assert_eq!(number(&item, "attempts"), 3);
    assert!(!item.contains_key("expires_at"), "{item:?}");

    // A failed key that is then processed gets its retention window from the claim.
    let msg = credit("r3", "acct-r3", 1);
    let error = inbox
        .process("ledger", &msg, |_tx| async {
            Err::<(DynamoTx, ()), _>(TestError::Boom)
        })
        .await
        .unwrap_err();
    assert!(matches!(error, DynamoError::Handler(_)), "{error:?}");
    assert!(
        !inbox_item(&inbox, "r3")
            .await
            .unwrap()
            .contains_key("expires_at")
    );
    assert!(
        deliver(&inbox, &counters, &msg, &calls)
            .await
            .unwrap()
            .is_processed()
    );
    let item = inbox_item(&inbox, "r3").await.unwrap();
    assert_eq!(number(&item, "attempts"), 2);
    assert_eq!(
        number(&item, "expires_at"),
        number(&item, "processed_at") / 1000 + 7 * 86_400
    );
    assert_eq!(counter(&inbox, &counters, "acct-r3").await, Some(1));
}

/// A handler action on the claim's own inbox item (two actions on one item): DynamoDB refuses
/// the request; the error says why (the SDK's own `Display` says only "service error"), and
/// nothing is written or recorded.
#[tokio::test]
async fn an_action_on_the_claims_own_item_is_refused_with_the_reason() {
    let (inbox, counters) = setup(RetryPolicy::default()).await;
    let msg = credit("own1", "acct-own", 4);
    let key = inbox_runtime::IdempotencyKey::new("own1", "test", "id").unwrap();
    let pk = dynamodb::partition_key("ledger", &key);
    let table = inbox.table().to_owned();
    let error = inbox
        .process("ledger", &msg, |mut tx| {
            let (counters, pk, table) = (&counters, &pk, &table);
            async move {
                add_counter(&mut tx, counters, "acct-own", 4)?;
                tx.update(
                    Update::builder()
                        .table_name(table)
                        .key("pk", AttributeValue::S(pk.clone()))
                        .update_expression("SET note = :note")
                        .expression_attribute_values(":note", AttributeValue::S("x".into()))
                        .build()
                        .map_err(|e| TestError::Build(e.to_string()))?,
                );
                Ok::<_, TestError>((tx, ()))
            }
        })
        .await
        .unwrap_err();
    let DynamoError::Dynamo { operation, .. } = &error else {
        panic!("{error:?}")
    };
    assert_eq!(*operation, "TransactWriteItems");
    let text = error.to_string();
    assert!(
        text.starts_with(
            "DynamoDB TransactWriteItems failed for consumer `ledger`, key `own1`: service error: unhandled error (ValidationException): "
        ),
        "{text}"
    );
    assert!(text.contains("multiple operations on one item"), "{text}");
    assert!(inbox_item(&inbox, "own1").await.is_none());
    assert_eq!(counter(&inbox, &counters, "acct-own").await, None);
}

/// A failure whose item (with the payload) would pass DynamoDB's 400 KB is not recorded, and
/// that is found before any call: `NotRecorded`, nothing written, one call (the read). The
/// message itself can be processed: a processed item keeps no payload.
#[tokio::test]
async fn a_failure_too_large_to_record_is_not_recorded() {
    let (inbox, counters) = setup(no_delays()).await;
    let msg = credit("big1", &"a".repeat(410 * 1024), 1);
    let error = inbox
        .process("ledger", &msg, |_tx| async {
            Err::<(DynamoTx, ()), _>(TestError::Fatal)
        })
        .await
        .unwrap_err();
    let DynamoError::Handler(failure) = error else {
        panic!("{error:?}")
    };
    assert_eq!(
        (failure.attempts, failure.disposition),
        (1, Disposition::NotRecorded)
    );
    assert_eq!(inbox.stats().calls, 1, "the read; no PutItem sent");
    assert!(inbox_item(&inbox, "big1").await.is_none());

    let calls = AtomicUsize::new(0);
    assert!(
        inbox
            .process("ledger", &msg, |mut tx| {
                let (counters, calls) = (&counters, &calls);
                async move {
                    calls.fetch_add(1, Ordering::SeqCst);
                    add_counter(&mut tx, counters, "acct-big", 1)?;
                    Ok::<_, TestError>((tx, ()))
                }
            })
            .await
            .unwrap()
            .is_processed()
    );
    assert_eq!(counter(&inbox, &counters, "acct-big").await, Some(1));
    assert_eq!(inbox.stats().calls, 3);
}

/// Keys at DynamoDB's partition key limit (2048 bytes, `pk` = consumer's length, `:`, consumer,
/// key): a 512-byte key of 4-byte characters with a consumer that brings `pk` to exactly 2048
/// bytes is processed and then a duplicate; one byte more is refused before any call.
#[tokio::test]
async fn partition_keys_at_dynamodbs_limit() {
    let (inbox, counters) = setup(RetryPolicy::default()).await;
    let id = "\u{1D11E}".repeat(128); // 512 bytes, the largest key
    let msg = credit(&id, "acct-pk", 1);
    let key = msg.idempotency_key().unwrap();
    assert_eq!(key.as_str().len(), 512);
    // 2048 = 4 ("1531") + 1 + 1531 + 512.
    let consumer = "c".repeat(1531);
    assert_eq!(dynamodb::partition_key(&consumer, &key).len(), 2048);
    let run = |consumer: String| {
        let (inbox, counters, msg) = (&inbox, &counters, &msg);
        async move {
            inbox
                .process(&consumer, msg, |mut tx| async move {
                    add_counter(&mut tx, counters, "acct-pk", 1)?;
                    Ok::<_, TestError>((tx, ()))
                })
                .await
        }
    };
    assert!(run(consumer.clone()).await.unwrap().is_processed());
    assert!(run(consumer.clone()).await.unwrap().is_duplicate());
    assert_eq!(counter(&inbox, &counters, "acct-pk").await, Some(1));
    let calls = inbox.stats().calls;

    let longer = "c".repeat(1532);
    let error = run(longer.clone()).await.unwrap_err();
    let DynamoError::PartitionKeyTooLong {
        consumer,
        key,
        bytes,
        max,
    } = &error
    else {
        panic!("{error:?}")
    };
    assert_eq!(
        (consumer.as_str(), key.as_str(), *bytes, *max),
        (longer.as_str(), id.as_str(), 2049, 2048)
    );
    assert_eq!(inbox.stats().calls, calls, "no call");
    assert_eq!(counter(&inbox, &counters, "acct-pk").await, Some(1));
}

/// The 400 KB item limit at its edge: a handler `Put` of 409,601 bytes (names and values) is
/// refused before any call as the handler's action 0; the claim's own
/// item too large (a huge message name through `process_raw`) is named as the claim's, not as
/// the handler's action 0.
#[tokio::test]
async fn item_size_limit_at_the_edge() {
    let (inbox, counters) = setup(RetryPolicy::default()).await;
    let put = |value_bytes: usize| {
        let counters = counters.clone();
        move |mut tx: DynamoTx| {
            let counters = counters.clone();
            async move {
                tx.put(
                    Put::builder()
                        .table_name(&counters)
                        .item("id", AttributeValue::S("edge".into()))
                        .item("blob", AttributeValue::S("x".repeat(value_bytes)))
                        .build()
                        .map_err(|e| TestError::Build(e.to_string()))?,
                );
                Ok::<_, TestError>((tx, ()))
            }
        }
    };
    // 2 ("id") + 4 ("edge") + 4 ("blob") + the value.
    let error = inbox
        .process("ledger", &credit("edge1", "a", 1), put(409_600 - 10 + 1))
        .await
        .unwrap_err();
    let DynamoError::TooLarge { what, bytes, max } = error else {
        panic!("{error:?}")
    };
    assert_eq!(
        (what.as_str(), bytes, max),
        ("the Put item of action 0", 409_601, 409_600)
    );
    // 409,600 bytes exactly passes the check; moto itself refuses items above 405,000 bytes (its
    // approximation of DynamoDB's limit), so that side of the edge is not submitted here.
    assert_eq!(counter(&inbox, &counters, "edge").await, None);
    assert_eq!(inbox.stats().calls, 1, "the read; nothing submitted");

    let key = inbox_runtime::IdempotencyKey::new("edge2", "test", "id").unwrap();
    let name = "n".repeat(409_600);
    let fingerprint = Fingerprint::of(&name, &"{}").unwrap();
    let error = inbox
        .process_raw("ledger", &name, &key, fingerprint, b"{}", |tx| async move {
            Ok::<_, TestError>((tx, ()))
        })
        .await
        .unwrap_err();
    let DynamoError::TooLarge { what, max, .. } = error else {
        panic!("{error:?}")
    };
    assert_eq!((what.as_str(), max), ("the claim's inbox item", 409_600));
    assert!(inbox_item(&inbox, "edge2").await.is_none());
}

/// DynamoDB's 100 actions exactly: 99 handler actions and the claim commit together, each
/// effect once; a redelivery is a duplicate.
#[tokio::test]
async fn ninety_nine_actions_and_the_claim_commit() {
    let (inbox, counters) = setup(RetryPolicy::default()).await;
    let msg = credit("n99", "acct-n", 1);
    let run = |mut tx: DynamoTx| {
        let counters = counters.clone();
        async move {
            for i in 0..MAX_HANDLER_ITEMS {
                add_counter(&mut tx, &counters, &format!("n{i}"), 1)?;
            }
            assert_eq!(tx.len(), 99);
            Ok::<_, TestError>((tx, ()))
        }
    };
    assert!(
        inbox
            .process("ledger", &msg, run)
            .await
            .unwrap()
            .is_processed()
    );
    assert!(
        inbox
            .process("ledger", &msg, run)
            .await
            .unwrap()
            .is_duplicate()
    );
    for i in [0, 50, 98] {
        assert_eq!(counter(&inbox, &counters, &format!("n{i}")).await, Some(1));
    }
    assert_eq!(counter(&inbox, &counters, "n99").await, None);
    assert_eq!(inbox.stats().calls, 3);
}

/// More foreign data: a table whose `pk` is a number (every read would fail), a failed item
/// whose `attempts` is out of range. Each is a clear error naming what is wrong.
#[tokio::test]
async fn foreign_key_types_and_attempt_counts_are_named() {
    let (inbox, counters) = setup(RetryPolicy::default()).await;
    let numeric = format!("{}_numeric", inbox.table());
    use inbox_runtime::dynamodb::sdk::types::{
        AttributeDefinition, BillingMode, KeySchemaElement, KeyType, ScalarAttributeType,
    };
    inbox
        .client()
        .create_table()
        .table_name(&numeric)
        .billing_mode(BillingMode::PayPerRequest)
        .attribute_definitions(
            AttributeDefinition::builder()
                .attribute_name("pk")
                .attribute_type(ScalarAttributeType::N)
                .build()
                .unwrap(),
        )
        .key_schema(
            KeySchemaElement::builder()
                .attribute_name("pk")
                .key_type(KeyType::Hash)
                .build()
                .unwrap(),
        )
        .send()
        .await
        .unwrap();
    let error = DynamoInbox::new(inbox.client().clone(), numeric.clone())
        .ensure_table()
        .await
        .unwrap_err();
    assert_eq!(error.operation, "DescribeTable");
    assert_eq!(
        error.source.to_string(),
        "the table's partition key `pk` is of type N, not S (string)"
    );

    let key = inbox_runtime::IdempotencyKey::new("m2", "test", "id").unwrap();
    let msg = credit("m2", "acct-m2", 1);
    let fingerprint = Fingerprint::of(Credit::NAME, &msg).unwrap();
    inbox
        .client()
        .put_item()
        .table_name(inbox.table())
        .item(
            "pk",
            AttributeValue::S(dynamodb::partition_key("ledger", &key)),
        )
        .item("status", AttributeValue::S("failed".into()))
        .item("payload_hash", AttributeValue::S(fingerprint.to_hex()))
        .item("attempts", AttributeValue::N("-1".into()))
        .send()
        .await
        .unwrap();
    let calls = AtomicUsize::new(0);
    let error = deliver(&inbox, &counters, &msg, &calls).await.unwrap_err();
    let DynamoError::Malformed { reason, .. } = error else {
        panic!("{error:?}")
    };
    assert_eq!(reason, "`attempts` is not a count from 0 to 4294967295: -1");
    assert_eq!(calls.load(Ordering::SeqCst), 0);
}

/// A failed key's takeover racing another delivery's: while this delivery's handler runs,
/// another takes the key over and fails it again (attempts 2, due at once); this delivery's
/// claim (taking over attempt 1) fails, the item it gets back is due, and the next round takes
/// over attempt 2 and commits attempt 3. The effect once; a handler that adds nothing commits
/// the claim alone.
#[tokio::test]
async fn a_takeover_racing_another_takeover() {
    let (inbox, counters) = setup(no_delays()).await;
    let msg = credit("t1", "acct-t", 9);
    let fail = |_tx: DynamoTx| async { Err::<(DynamoTx, ()), _>(TestError::Boom) };
    assert!(matches!(
        inbox.process("ledger", &msg, fail).await.unwrap_err(),
        DynamoError::Handler(_)
    ));
    let rounds = AtomicUsize::new(0);
    let outcome = inbox
        .process("ledger", &msg, |mut tx| {
            let (inbox, counters, msg, rounds) = (&inbox, &counters, &msg, &rounds);
            async move {
                if rounds.fetch_add(1, Ordering::SeqCst) == 0 {
                    let error = inbox.process("ledger", msg, fail).await.unwrap_err();
                    let DynamoError::Handler(failure) = error else {
                        panic!("{error:?}")
                    };
                    assert_eq!(failure.attempts, 2);
                }
                assert_eq!(tx.attempt(), 2 + rounds.load(Ordering::SeqCst) as u32 - 1);
                add_counter(&mut tx, counters, &msg.account, msg.amount)?;
                Ok::<_, TestError>((tx, ()))
            }
        })
        .await
        .unwrap();
    assert!(outcome.is_processed(), "{outcome:?}");
    assert_eq!(rounds.load(Ordering::SeqCst), 2);
    assert_eq!(counter(&inbox, &counters, "acct-t").await, Some(9));
    let item = inbox_item(&inbox, "t1").await.unwrap();
    assert_eq!(
        (text(&item, "status").as_str(), number(&item, "attempts")),
        ("processed", 3)
    );

    // Ok with no actions: the claim alone commits; then a duplicate.
    let msg = credit("t2", "acct-t2", 1);
    let empty = |tx: DynamoTx| async move { Ok::<_, TestError>((tx, 7_u8)) };
    let outcome = inbox.process("ledger", &msg, empty).await.unwrap();
    assert!(matches!(outcome, Outcome::Processed(7)), "{outcome:?}");
    assert!(
        inbox
            .process("ledger", &msg, empty)
            .await
            .unwrap()
            .is_duplicate()
    );
    assert_eq!(
        text(&inbox_item(&inbox, "t2").await.unwrap(), "status"),
        "processed"
    );
}

/// A key failed again by another delivery in each of this delivery's [`MAX_ROUNDS`] rounds:
/// `Contended`, nothing of this delivery written, the other's attempts counted exactly.
#[tokio::test]
async fn a_key_contended_for_every_round() {
    let (inbox, counters) = setup(no_delays().max_attempts(10)).await;
    let msg = credit("k1", "acct-k", 1);
    let fail = |_tx: DynamoTx| async { Err::<(DynamoTx, ()), _>(TestError::Boom) };
    let rounds = AtomicUsize::new(0);
    let error = inbox
        .process("ledger", &msg, |mut tx| {
            let (inbox, counters, msg, rounds) = (&inbox, &counters, &msg, &rounds);
            async move {
                rounds.fetch_add(1, Ordering::SeqCst);
                assert!(inbox.process("ledger", msg, fail).await.is_err());
                add_counter(&mut tx, counters, &msg.account, msg.amount)?;
                Ok::<_, TestError>((tx, ()))
            }
        })
        .await
        .unwrap_err();
    let DynamoError::Contended { consumer, key } = &error else {
        panic!("{error:?}")
    };
    assert_eq!((consumer.as_str(), key.as_str()), ("ledger", "k1"));
    assert_eq!(rounds.load(Ordering::SeqCst), dynamodb::MAX_ROUNDS as usize);
    assert_eq!(counter(&inbox, &counters, "acct-k").await, None);
    let item = inbox_item(&inbox, "k1").await.unwrap();
    assert_eq!(
        (text(&item, "status").as_str(), number(&item, "attempts")),
        ("failed", 3)
    );
}

/// A proxy to the test server that forwards each request (one per connection: the serial moto
/// answers HTTP/1.0 and closes) and, for the first `TransactWriteItems`, closes the client's
/// connection after the server answered: the transaction committed, its answer lost.
async fn losing_proxy(dropped: Arc<AtomicUsize>) -> String {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let upstream = endpoint().trim_start_matches("http://").to_owned();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let address = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(async move {
        loop {
            let (mut client, _) = listener.accept().await.unwrap();
            let (upstream, dropped) = (upstream.clone(), dropped.clone());
            tokio::spawn(async move {
                let mut request = Vec::new();
                let mut buffer = [0u8; 65536];
                loop {
                    let n = client.read(&mut buffer).await.unwrap_or(0);
                    if n == 0 {
                        return;
                    }
                    request.extend_from_slice(&buffer[..n]);
                    let text = String::from_utf8_lossy(&request).to_ascii_lowercase();
                    if let Some(end) = text.find("\r\n\r\n") {
                        let length = text[..end]
                            .lines()
                            .find_map(|l| l.strip_prefix("content-length:"))
                            .and_then(|v| v.trim().parse::<usize>().ok())
                            .unwrap_or(0);
                        if request.len() >= end + 4 + length {
                            break;
                        }
                    }
                }
                let transaction = String::from_utf8_lossy(&request)
                    .contains("DynamoDB_20120810.TransactWriteItems");
                let mut server = tokio::net::TcpStream::connect(&upstream).await.unwrap();
                server.write_all(&request).await.unwrap();
                let mut response = Vec::new();
                server.read_to_end(&mut response).await.unwrap();
                if transaction && dropped.fetch_add(1, Ordering::SeqCst) == 0 {
                    return; // The answer is lost: the client's connection closes.
                }
                let _ = client.write_all(&response).await;
                let _ = client.shutdown().await;
            });
        }
    });
    address
}

/// The answer of a committed transaction is lost: the SDK resends it (the same client request
/// token; moto ignores tokens and evaluates it again, so the claim's condition fails on the
/// item the first send wrote). The effect applies once, and the delivery says so.
#[tokio::test]
async fn a_lost_answer_after_commit_applies_once() {
    let (inbox, counters) = setup(RetryPolicy::default()).await;
    let dropped = Arc::new(AtomicUsize::new(0));
    let proxied = DynamoInbox::new(
        dynamodb::client(Some(&losing_proxy(dropped.clone()).await)).await,
        inbox.table(),
    );
    let msg = credit("lost1", "acct-lost", 25);
    let calls = AtomicUsize::new(0);
    let first = deliver(&proxied, &counters, &msg, &calls).await.unwrap();
    // On DynamoDB the resend's token returns the first send's success: `Processed`. Moto
    // evaluates the resend: the claim finds the item the first send wrote, a duplicate.
    assert!(first.is_duplicate(), "{first:?}");
    assert_eq!(dropped.load(Ordering::SeqCst), 2, "the SDK resent once");
    assert_eq!(calls.load(Ordering::SeqCst), 1, "the handler ran once");
    assert_eq!(
        proxied.stats().calls,
        2,
        "one read, one submit (its resend is the SDK's)"
    );
    assert_eq!(counter(&inbox, &counters, "acct-lost").await, Some(25));
    assert!(
        deliver(&inbox, &counters, &msg, &calls)
            .await
            .unwrap()
            .is_duplicate()
    );
    assert_eq!(counter(&inbox, &counters, "acct-lost").await, Some(25));

    // A debit on the condition that the balance covers it, its answer lost: on the resend both
    // the claim's and the debit's conditions fail (the first send took the 25). The claim
    // decides: a duplicate, not the handler's failure, and nothing recorded over the item.
    let dropped = Arc::new(AtomicUsize::new(0));
    let proxied = DynamoInbox::new(
        dynamodb::client(Some(&losing_proxy(dropped.clone()).await)).await,
        inbox.table(),
    );
    let debit = credit("lost2", "acct-lost", 25);
    let outcome = proxied
        .process("ledger", &debit, |mut tx| {
            let counters = &counters;
            async move {
                tx.update(
                    Update::builder()
                        .table_name(counters)
                        .key("id", AttributeValue::S("acct-lost".into()))
                        .update_expression("ADD n :minus")
                        .condition_expression("n >= :amount")
                        .expression_attribute_values(":minus", AttributeValue::N("-25".into()))
                        .expression_attribute_values(":amount", AttributeValue::N("25".into()))
                        .build()
                        .map_err(|e| TestError::Build(e.to_string()))?,
                );
                Ok::<_, TestError>((tx, ()))
            }
        })
        .await
        .unwrap();
    assert!(outcome.is_duplicate(), "{outcome:?}");
    assert_eq!(dropped.load(Ordering::SeqCst), 2);
    assert_eq!(counter(&inbox, &counters, "acct-lost").await, Some(0));
    let item = inbox_item(&inbox, "lost2").await.unwrap();
    assert_eq!(
        (text(&item, "status").as_str(), number(&item, "attempts")),
        ("processed", 1)
    );
}

/// A storm with failures: 16 tasks, 200 keys, each delivered 3 times at first; a handler fails
/// (retryable) on its first and second attempts of every third key, and a failed delivery goes
/// back in the queue. Failure records race takeovers and claims. Each key is processed exactly
/// once, its counter is 1, and its item's `attempts` is exactly its recorded failures + 1.
#[tokio::test]
async fn storm_with_failures_and_takeovers() {
    const KEYS: usize = 200;
    let (inbox, counters) = setup(no_delays().max_attempts(10)).await;
    let mut work: Vec<usize> = (0..KEYS).flat_map(|k| [k, k, k]).collect();
    work.shuffle(&mut rand_chacha::ChaCha8Rng::seed_from_u64(36));
    let work = Arc::new(std::sync::Mutex::new(work));
    let processed = Arc::new(std::sync::Mutex::new(vec![0_u32; KEYS]));
    let recorded = Arc::new(std::sync::Mutex::new(vec![0_i64; KEYS]));
    let mut tasks = Vec::new();
    for _ in 0..16 {
        let (inbox, counters, work) = (inbox.clone(), counters.clone(), work.clone());
        let (processed, recorded) = (processed.clone(), recorded.clone());
        tasks.push(tokio::spawn(async move {
            loop {
                let Some(k) = work.lock().unwrap().pop() else {
                    break;
                };
                let msg = credit(&format!("sf-{k}"), &format!("sf-acct-{k}"), 1);
                let result = inbox
                    .process("ledger", &msg, |mut tx| {
                        let (counters, msg) = (&counters, &msg);
                        async move {
                            if k % 3 == 0 && tx.attempt() < 3 {
                                return Err(TestError::Boom);
                            }
                            add_counter(&mut tx, counters, &msg.account, 1)?;
                            Ok((tx, ()))
                        }
                    })
                    .await;
                match result {
                    Ok(Outcome::Processed(())) => processed.lock().unwrap()[k] += 1,
                    Ok(Outcome::Duplicate) => {}
                    Err(DynamoError::Handler(failure)) => {
                        match failure.disposition {
                            Disposition::Retry { .. } => recorded.lock().unwrap()[k] += 1,
                            Disposition::NotRecorded => {}
                            other => panic!("key {k}: {other:?}"),
                        }
                        work.lock().unwrap().insert(0, k);
                    }
                    Err(DynamoError::Contended { .. }) => work.lock().unwrap().insert(0, k),
                    other => panic!("key {k}: {other:?}"),
                }
            }
        }));
    }
    for task in tasks {
        task.await.unwrap();
    }
    let processed = processed.lock().unwrap().clone();
    let recorded = recorded.lock().unwrap().clone();
    assert_eq!(recorded.len(), KEYS);
    assert!(processed.iter().all(|&p| p == 1), "{processed:?}");
    for (k, &failures) in recorded.iter().enumerate() {
        assert_eq!(
            counter(&inbox, &counters, &format!("sf-acct-{k}")).await,
            Some(1),
            "key {k}"
        );
        let item = inbox_item(&inbox, &format!("sf-{k}")).await.unwrap();
        assert_eq!(text(&item, "status"), "processed", "key {k}");
        assert_eq!(number(&item, "attempts"), failures + 1, "key {k}");
        let expected = if k % 3 == 0 { 2 } else { 0 }; // attempts 1 and 2 failed
        assert_eq!(failures, expected, "key {k}");
    }
}
