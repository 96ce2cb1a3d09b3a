//! `#[idempotent]` handlers on DynamoDB (first parameter `&mut DynamoTx`) and the
//! `DynamoDispatcher`, against moto's DynamoDB on loopback (`DYNAMODB_ENDPOINT`, the serial moto
//! server of scripts/sqs.sh; see tests/dynamodb.rs): direct calls of the rewritten functions,
//! duplicates, conflicts, retries, dead letters and their replay, dispatch by message name with
//! its refusals, and a `key = "..."` override.
//!
//! Each test has an inbox table of its own (a fresh name) and accounts of its own (fresh ids) in
//! one accounts table shared by the binary (the handlers are plain functions: they name it
//! through [`ACCOUNTS`]).

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::Duration;

use inbox_runtime::dynamodb::sdk::types::{AttributeValue, Update};
use inbox_runtime::dynamodb::{self, DynamoDispatcher, DynamoError, DynamoInbox, DynamoTx};
use inbox_runtime::{
    DispatchError, Disposition, Envelope, ErrorClass, KeyError, Message, Outcome, RegistryError,
    ReplayError, RetryPolicy, handler, idempotent, store::Backend,
};

#[derive(Clone, Debug, serde::Serialize, serde::Deserialize, Message)]
#[message(name = "dyn.credited")]
struct Credit {
    #[message(key)]
    id: String,
    account: String,
    amount: i64,
}

/// A message whose handler takes its key from another field than the message's own.
#[derive(Clone, Debug, serde::Serialize, serde::Deserialize, Message)]
#[message(name = "dyn.transferred")]
struct Transfer {
    #[message(key)]
    event_id: String,
    transfer_id: String,
    account: String,
    amount: i64,
}

/// A message ordered per aggregate: through the sequence guard (tests/dynamodb_ordering.rs has
/// the rest of ordering on DynamoDB).
#[derive(Clone, Debug, serde::Serialize, serde::Deserialize, Message)]
#[message(name = "dyn.ordered", key = "{order_id}:{seq}")]
struct Ordered {
    #[message(aggregate)]
    order_id: String,
    #[message(sequence)]
    seq: u64,
}

use inbox_tests::dynamo::TestError;

/// The accounts table of this test binary (`id` string key), made once.
static ACCOUNTS: tokio::sync::OnceCell<String> = tokio::sync::OnceCell::const_new();

/// Errors the handlers return, per account, in order, before they credit it.
static SCRIPT: Mutex<Option<HashMap<String, Vec<TestError>>>> = Mutex::new(None);

fn script(account: &str, errors: Vec<TestError>) {
    SCRIPT
        .lock()
        .unwrap()
        .get_or_insert_with(HashMap::new)
        .insert(account.to_owned(), errors);
}

fn scripted(account: &str) -> Option<TestError> {
    let mut script = SCRIPT.lock().unwrap();
    let errors = script.as_mut()?.get_mut(account)?;
    (!errors.is_empty()).then(|| errors.remove(0))
}

/// `ADD balance :amount` on the account's item.
fn add(tx: &mut DynamoTx, account: &str, amount: i64) -> Result<(), TestError> {
    let table = ACCOUNTS.get().expect("setup made the accounts table");
    tx.update(
        Update::builder()
            .table_name(table)
            .key("id", AttributeValue::S(account.to_owned()))
            .update_expression("ADD balance :amount")
            .expression_attribute_values(":amount", AttributeValue::N(amount.to_string()))
            .build()
            .map_err(|e| TestError::Build(e.to_string()))?,
    );
    Ok(())
}

/// Credits the account; fails first as [`script`]ed for it. At most 3 attempts.
#[idempotent(consumer = "ledger", max_attempts = 3)]
async fn credit(tx: &mut DynamoTx, msg: Credit) -> Result<i64, TestError> {
    if let Some(error) = scripted(&msg.account) {
        return Err(error);
    }
    add(tx, &msg.account, msg.amount)?;
    Ok(msg.amount)
}

/// A second consumer of `dyn.credited`: counts the credits of the account on `audit:<account>`.
#[idempotent(consumer = "audit")]
async fn audit(tx: &mut inbox_runtime::dynamodb::DynamoTx, msg: Credit) -> Result<(), TestError> {
    add(tx, &format!("audit:{}", msg.account), 1)
}

/// Keyed by `transfer_id`, not by the message's own key (`event_id`).
#[idempotent(consumer = "transfers", key = "transfer_id")]
async fn transfer(tx: &mut DynamoTx, msg: Transfer) -> Result<(), TestError> {
    add(tx, &msg.account, msg.amount)
}

/// Counts the applied messages of the order on `order:<order_id>` (`gaps = "apply"`).
#[idempotent(consumer = "orders")]
async fn apply_ordered(tx: &mut DynamoTx, msg: Ordered) -> Result<(), TestError> {
    add(tx, &format!("order:{}", msg.order_id), 1)
}

fn fresh(prefix: &str) -> String {
    format!("{prefix}-{}", uuid::Uuid::new_v4().simple())
}

/// A fresh inbox table (retries due at once), and the binary's accounts table.
async fn setup() -> DynamoInbox {
    inbox_tests::dynamo::setup_with_table(&ACCOUNTS, "accounts").await
}

async fn balance(inbox: &DynamoInbox, account: &str) -> Option<i64> {
    let item = inbox
        .client()
        .get_item()
        .table_name(ACCOUNTS.get().unwrap())
        .key("id", AttributeValue::S(account.to_owned()))
        .consistent_read(true)
        .send()
        .await
        .unwrap()
        .item?;
    match item.get("balance") {
        Some(AttributeValue::N(n)) => Some(n.parse().unwrap()),
        other => panic!("balance of {account}: {other:?}"),
    }
}

async fn inbox_status(inbox: &DynamoInbox, consumer: &str, key: &str) -> Option<String> {
    let key = inbox_runtime::IdempotencyKey::new(key, "test", "id").unwrap();
    let item = inbox
        .client()
        .get_item()
        .table_name(inbox.table())
        .key(
            "pk",
            AttributeValue::S(dynamodb::partition_key(consumer, &key)),
        )
        .consistent_read(true)
        .send()
        .await
        .unwrap()
        .item?;
    match item.get("status") {
        Some(AttributeValue::S(status)) => Some(status.clone()),
        other => panic!("status: {other:?}"),
    }
}

fn message(account: &str, amount: i64) -> Credit {
    Credit {
        id: fresh("credit"),
        account: account.to_owned(),
        amount,
    }
}

/// The handler failure of `result`: its error's text, class, attempts and disposition.
fn failure<T: std::fmt::Debug, E: std::fmt::Display + std::fmt::Debug>(
    result: Result<Outcome<T>, DynamoError<E>>,
) -> (String, ErrorClass, u32, Disposition) {
    match result {
        Err(DynamoError::Handler(failure)) => (
            failure.error.to_string(),
            failure.class,
            failure.attempts,
            failure.disposition,
        ),
        other => panic!("expected a handler failure, got {other:?}"),
    }
}

#[tokio::test]
async fn a_handler_credits_once_across_three_deliveries() {
    let inbox = setup().await;
    let account = fresh("acct");
    let msg = message(&account, 500);
    let mut outcomes = Vec::new();
    for _ in 0..3 {
        outcomes.push(credit(&inbox, msg.clone()).await.unwrap());
    }
    assert_eq!(
        outcomes,
        [
            Outcome::Processed(500),
            Outcome::Duplicate,
            Outcome::Duplicate
        ]
    );
    assert_eq!(balance(&inbox, &account).await, Some(500));
    // Read, transaction; then one read per duplicate.
    assert_eq!(inbox.stats().calls, 4);

    // The same key with another payload: a conflict, nothing written.
    let other = Credit {
        amount: 900,
        ..msg.clone()
    };
    match credit(&inbox, other).await {
        Err(DynamoError::Conflict(conflict)) => {
            assert_eq!(conflict.consumer, "ledger");
            assert_eq!(conflict.message_name, "dyn.credited");
            assert_eq!(conflict.key.as_str(), msg.id);
        }
        other => panic!("expected a conflict, got {other:?}"),
    }
    assert_eq!(balance(&inbox, &account).await, Some(500));
    assert_eq!(
        inbox_status(&inbox, "ledger", &msg.id).await.as_deref(),
        Some("processed")
    );
}

#[tokio::test]
async fn a_retryable_error_then_success_and_max_attempts() {
    let inbox = setup().await;
    let account = fresh("acct");
    script(&account, vec![TestError::Boom]);
    let msg = message(&account, 250);
    let (text, class, attempts, disposition) = failure(credit(&inbox, msg.clone()).await);
    assert_eq!(text, "boom");
    assert_eq!(class, ErrorClass::Retryable);
    assert_eq!(attempts, 1);
    assert_eq!(
        disposition,
        Disposition::Retry {
            after: Duration::ZERO
        }
    );
    assert_eq!(balance(&inbox, &account).await, None);
    assert_eq!(
        inbox_status(&inbox, "ledger", &msg.id).await.as_deref(),
        Some("failed")
    );
    // The redelivery takes the failed item over and commits.
    assert_eq!(
        credit(&inbox, msg.clone()).await.unwrap(),
        Outcome::Processed(250)
    );
    assert_eq!(credit(&inbox, msg).await.unwrap(), Outcome::Duplicate);
    assert_eq!(balance(&inbox, &account).await, Some(250));

    // `max_attempts = 3` of the handler (the inbox's policy says 5): dead at the third.
    let account = fresh("acct");
    script(
        &account,
        vec![TestError::Boom, TestError::Boom, TestError::Boom],
    );
    let msg = message(&account, 1);
    let mut dispositions = Vec::new();
    for _ in 0..3 {
        let (_, _, attempts, disposition) = failure(credit(&inbox, msg.clone()).await);
        dispositions.push((attempts, disposition));
    }
    let retry = Disposition::Retry {
        after: Duration::ZERO,
    };
    assert_eq!(
        dispositions,
        [(1, retry), (2, retry), (3, Disposition::Dead)]
    );
    assert_eq!(credit(&inbox, msg).await.unwrap(), Outcome::Dead);
    assert_eq!(balance(&inbox, &account).await, None);
}

#[tokio::test]
async fn a_permanent_error_dead_letters_and_its_replay_processes_once() {
    let inbox = setup().await;
    let dispatcher = DynamoDispatcher::from_registry(inbox.clone()).unwrap();
    let account = fresh("acct");
    script(&account, vec![TestError::Fatal]);
    let msg = message(&account, 700);
    let (text, class, attempts, disposition) = failure(credit(&inbox, msg.clone()).await);
    assert_eq!(
        (text.as_str(), class, attempts, disposition),
        ("fatal", ErrorClass::Permanent, 1, Disposition::Dead)
    );
    assert_eq!(credit(&inbox, msg.clone()).await.unwrap(), Outcome::Dead);
    assert_eq!(
        inbox_status(&inbox, "ledger", &msg.id).await.as_deref(),
        Some("dead")
    );
    assert_eq!(balance(&inbox, &account).await, None);

    // The cause is fixed (the script is empty now): the replay runs the stored payload once.
    let replayed = dispatcher.replay("ledger", &msg.id).await.unwrap();
    assert_eq!(
        (replayed.consumer, replayed.function),
        ("ledger", "dynamodb_handlers::credit")
    );
    assert_eq!(replayed.result.unwrap(), Outcome::Processed(()));
    assert_eq!(balance(&inbox, &account).await, Some(700));
    assert_eq!(
        inbox_status(&inbox, "ledger", &msg.id).await.as_deref(),
        Some("processed")
    );
    // Again: a duplicate, as is a delivery now.
    let again = dispatcher.replay("ledger", &msg.id).await.unwrap();
    assert_eq!(again.result.unwrap(), Outcome::Duplicate);
    assert_eq!(credit(&inbox, msg).await.unwrap(), Outcome::Duplicate);
    assert_eq!(balance(&inbox, &account).await, Some(700));

    // A failed key whose next attempt is not due: a delivery waits, a replay does not.
    let slow = inbox.clone().retry_policy(
        RetryPolicy::default().retry_delays(Duration::from_secs(60), Duration::from_secs(60)),
    );
    let dispatcher = DynamoDispatcher::from_registry(slow.clone()).unwrap();
    let account = fresh("acct");
    script(&account, vec![TestError::Boom]);
    let msg = message(&account, 20);
    let (_, _, _, disposition) = failure(credit(&slow, msg.clone()).await);
    // The policy's delay, with its jitter: at least the minimum.
    assert!(
        matches!(disposition, Disposition::Retry { after } if after >= Duration::from_secs(60))
    );
    assert!(matches!(
        credit(&slow, msg.clone()).await.unwrap(),
        Outcome::NotYet { .. }
    ));
    let replayed = dispatcher.replay("ledger", &msg.id).await.unwrap();
    assert_eq!(replayed.result.unwrap(), Outcome::Processed(()));
    assert_eq!(balance(&inbox, &account).await, Some(20));

    // Unknown keys and consumers.
    match dispatcher.replay("ledger", "no-such-key").await {
        Err(ReplayError::NotFound { consumer, key }) => {
            assert_eq!((consumer.as_str(), key.as_str()), ("ledger", "no-such-key"));
        }
        other => panic!("expected NotFound, got {other:?}"),
    }
    assert!(matches!(
        dispatcher.replay("ledger", "").await,
        Err(ReplayError::Key(KeyError::Empty { .. }))
    ));

    // A failed item whose stored payload was damaged (not UTF-8): a decode error, as on SQL,
    // and the item stays failed with its payload, for an operator.
    let account = fresh("acct");
    script(&account, vec![TestError::Boom]);
    let damaged = message(&account, 5);
    failure(credit(&slow, damaged.clone()).await);
    let key = inbox_runtime::IdempotencyKey::new(&damaged.id, "test", "id").unwrap();
    inbox
        .client()
        .update_item()
        .table_name(inbox.table())
        .key(
            "pk",
            AttributeValue::S(dynamodb::partition_key("ledger", &key)),
        )
        .update_expression("SET payload = :p")
        .expression_attribute_values(
            ":p",
            AttributeValue::B(dynamodb::sdk::primitives::Blob::new(b"{\xff}".to_vec())),
        )
        .send()
        .await
        .unwrap();
    match dispatcher.replay("ledger", &damaged.id).await {
        Err(ReplayError::Decode {
            message_name,
            source,
        }) => {
            assert_eq!(message_name, "dyn.credited");
            assert_eq!(source.to_string(), "invalid UTF-8 at byte 1");
        }
        other => panic!("expected Decode, got {other:?}"),
    }
    assert_eq!(
        inbox_status(&inbox, "ledger", &damaged.id).await.as_deref(),
        Some("failed")
    );
    assert_eq!(balance(&inbox, &account).await, None);
}

#[tokio::test]
async fn dispatch_by_message_name_and_its_refusals() {
    let inbox = setup().await;
    let dispatcher = DynamoDispatcher::from_registry(inbox.clone()).unwrap();
    let names: Vec<String> = dispatcher
        .handlers()
        .iter()
        .map(ToString::to_string)
        .collect();
    assert_eq!(
        names,
        [
            "audit <- dyn.credited (dynamodb_handlers::audit, dynamodb)",
            "ledger <- dyn.credited (dynamodb_handlers::credit, dynamodb)",
            "orders <- dyn.ordered (dynamodb_handlers::apply_ordered, dynamodb)",
            "transfers <- dyn.transferred (dynamodb_handlers::transfer, dynamodb)",
        ]
    );
    let account = fresh("acct");
    let id = fresh("credit");
    let payload = format!(r#"{{"id":"{id}","account":"{account}","amount":300}}"#);
    let envelope = Envelope::new("dyn.credited", payload.clone().into_bytes());
    for expected in [Outcome::Processed(()), Outcome::Duplicate] {
        let outcomes = dispatcher.dispatch(&envelope).await.unwrap();
        let got: Vec<(&str, Outcome<()>)> = outcomes
            .into_iter()
            .map(|o| (o.consumer, o.result.unwrap()))
            .collect();
        assert_eq!(got, [("audit", expected.clone()), ("ledger", expected)]);
    }
    assert_eq!(balance(&inbox, &account).await, Some(300));
    assert_eq!(balance(&inbox, &format!("audit:{account}")).await, Some(1));
    // The same delivery by a direct call: the same key, the same fingerprint.
    let msg = Credit {
        id: id.clone(),
        account: account.clone(),
        amount: 300,
    };
    assert_eq!(credit(&inbox, msg).await.unwrap(), Outcome::Duplicate);

    let calls = inbox.stats().calls;
    let refused = |name: &str, payload: &[u8]| {
        let envelope = Envelope::new(name, payload.to_vec());
        let dispatcher = &dispatcher;
        async move { dispatcher.dispatch(&envelope).await.unwrap_err() }
    };
    match refused("dyn.unknown", payload.as_bytes()).await {
        DispatchError::UnknownMessage { message_name } => assert_eq!(message_name, "dyn.unknown"),
        other => panic!("expected UnknownMessage, got {other:?}"),
    }
    assert!(matches!(
        refused("", payload.as_bytes()).await,
        DispatchError::NoMessageName
    ));
    match refused("dyn.credited", br#"{"id":"x","account":"a"}"#).await {
        DispatchError::Decode {
            message_name,
            line,
            column,
            source,
        } => {
            assert_eq!(
                (message_name.as_str(), line, column),
                ("dyn.credited", 1, 24)
            );
            assert_eq!(
                source.to_string(),
                "missing field `amount` at line 1 column 24"
            );
        }
        other => panic!("expected Decode, got {other:?}"),
    }
    assert!(matches!(
        refused("dyn.credited", b"{\"id\":\"\xff\"}").await,
        DispatchError::NotUtf8 {
            line: 1,
            column: 8,
            ..
        }
    ));
    match refused("dyn.credited", br#"{"id":"","account":"a","amount":1}"#).await {
        // Both consumers key on `id`: the first in consumer order is named.
        DispatchError::Key { consumer, source } => {
            assert_eq!(consumer, "audit");
            assert!(matches!(source, KeyError::Empty { field: "id", .. }));
        }
        other => panic!("expected Key, got {other:?}"),
    }
    let long = format!(r#"{{"id":"{}","account":"a","amount":1}}"#, "k".repeat(513));
    match refused("dyn.credited", long.as_bytes()).await {
        DispatchError::Key { consumer, source } => {
            assert_eq!(consumer, "audit");
            assert!(matches!(
                source,
                KeyError::TooLong {
                    len: 513,
                    max: 512,
                    ..
                }
            ));
        }
        other => panic!("expected Key, got {other:?}"),
    }
    // An ordered consumer's ordering is read before any call too, as on SQL: sequence 0 (a
    // valid key, `{order}:0`, but no sequence number) refuses the envelope, and nothing of it
    // is stored.
    let unordered = fresh("o");
    let bad_sequence = format!(r#"{{"order_id":"{unordered}","seq":0}}"#);
    match refused("dyn.ordered", bad_sequence.as_bytes()).await {
        DispatchError::Key { consumer, source } => {
            assert_eq!(consumer, "orders");
            assert!(
                matches!(source, KeyError::Invalid { field: "seq", .. }),
                "{source:?}"
            );
        }
        other => panic!("expected Key, got {other:?}"),
    }
    assert_eq!(
        inbox_status(&inbox, "orders", &format!("{unordered}:0")).await,
        None
    );
    let small = DynamoDispatcher::from_registry(inbox.clone())
        .unwrap()
        .with_max_payload_bytes(16)
        .unwrap();
    match small.dispatch(&envelope).await.unwrap_err() {
        DispatchError::TooLarge {
            message_name,
            size,
            limit,
        } => assert_eq!(
            (message_name.as_str(), size, limit),
            ("dyn.credited", payload.len(), 16)
        ),
        other => panic!("expected TooLarge, got {other:?}"),
    }
    // A refused envelope made no call.
    assert_eq!(inbox.stats().calls, calls);

    // An ordered message goes through the sequence guard: 2 applies over the gap, 1 is stale.
    let order = fresh("o");
    let payload = format!(r#"{{"order_id":"{order}","seq":2}}"#);
    let ordered = Envelope::new("dyn.ordered", payload.into_bytes());
    let outcomes = dispatcher.dispatch(&ordered).await.unwrap();
    assert_eq!(outcomes.len(), 1);
    assert_eq!(
        outcomes[0].result.as_ref().unwrap(),
        &Outcome::Processed(())
    );
    let direct = apply_ordered(
        &inbox,
        Ordered {
            order_id: order.clone(),
            seq: 1,
        },
    )
    .await;
    assert_eq!(direct.unwrap(), Outcome::Stale);
    assert_eq!(balance(&inbox, &format!("order:{order}")).await, Some(1));
}

#[tokio::test]
async fn a_key_attribute_on_a_field() {
    let inbox = setup().await;
    let account = fresh("acct");
    let transfer_id = fresh("transfer");
    let msg = Transfer {
        event_id: fresh("event"),
        transfer_id: transfer_id.clone(),
        account: account.clone(),
        amount: 40,
    };
    assert_eq!(
        transfer(&inbox, msg.clone()).await.unwrap(),
        Outcome::Processed(())
    );
    assert_eq!(
        transfer(&inbox, msg.clone()).await.unwrap(),
        Outcome::Duplicate
    );
    // The inbox item is under `transfer_id`, not under the message's own key.
    assert_eq!(
        inbox_status(&inbox, "transfers", &transfer_id)
            .await
            .as_deref(),
        Some("processed")
    );
    assert_eq!(inbox_status(&inbox, "transfers", &msg.event_id).await, None);
    // Another event for the same transfer is another payload under the same key: a conflict.
    let again = Transfer {
        event_id: fresh("event"),
        ..msg
    };
    assert!(matches!(
        transfer(&inbox, again).await,
        Err(DynamoError::Conflict(_))
    ));
    assert_eq!(balance(&inbox, &account).await, Some(40));
}

#[tokio::test]
async fn explicit_handler_lists() {
    // No DynamoDB call: the client is never used.
    let client = dynamodb::client(Some("http://127.0.0.1:9")).await;
    let inbox = DynamoInbox::new(client, "unused");
    let dispatcher =
        DynamoDispatcher::from_handlers(inbox.clone(), [handler!(credit), handler!(credit)])
            .unwrap();
    let listed: Vec<_> = dispatcher
        .handlers()
        .into_iter()
        .map(|h| h.function)
        .collect();
    assert_eq!(listed, ["dynamodb_handlers::credit"]);
    // No DynamoDB to read the stored message from: the read's error, with its source.
    match dispatcher.replay("ledger", "k-1").await {
        Err(error @ ReplayError::Read(_)) => {
            assert!(
                error
                    .to_string()
                    .starts_with("reading the stored message failed: "),
                "{error}"
            );
            assert!(std::error::Error::source(&error).is_some(), "{error:?}");
        }
        other => panic!("expected Read, got {other:?}"),
    }
    assert_eq!(
        DynamoDispatcher::from_handlers(inbox, []).unwrap_err(),
        RegistryError::NoHandlersListed {
            backend: Backend::DynamoDb
        }
    );
    let registered: Vec<_> = dynamodb::registered_dynamo_handlers()
        .into_iter()
        .map(|h| (h.message_name, h.consumer))
        .collect();
    assert_eq!(
        registered,
        [
            ("dyn.credited", "audit"),
            ("dyn.credited", "ledger"),
            ("dyn.ordered", "orders"),
            ("dyn.transferred", "transfers"),
        ]
    );
}

/// `DynamoInbox::process` (the closure API) given a message ordered per aggregate runs it
/// through the sequence guard (`gaps = "apply"`): 2 applies over the gap; 1 is stale, and what
/// its closure added is not committed.
#[tokio::test]
async fn the_closure_api_guards_an_ordered_message() {
    let inbox = setup().await;
    let order = fresh("o");
    let counter = format!("order:{order}");
    for (seq, expected) in [(2, Outcome::Processed(())), (1, Outcome::Stale)] {
        let msg = Ordered {
            order_id: order.clone(),
            seq,
        };
        let outcome = inbox
            .process("orders", &msg, |mut tx| {
                let result = add(&mut tx, &counter, 1);
                async move { result.map(|()| (tx, ())) }
            })
            .await
            .unwrap();
        assert_eq!(outcome, expected, "seq {seq}");
    }
    assert_eq!(balance(&inbox, &counter).await, Some(1));
    assert_eq!(
        inbox_status(&inbox, "orders", &format!("{order}:2"))
            .await
            .as_deref(),
        Some("processed")
    );
    assert_eq!(
        inbox_status(&inbox, "orders", &format!("{order}:1"))
            .await
            .as_deref(),
        Some("stale")
    );
}

/// Runs the admin command line (`ops::cli::dynamodb`) with `args` on `inbox`: what it printed,
/// and its error's text if it failed.
async fn cli(inbox: &DynamoInbox, args: &[&str]) -> (String, Option<String>) {
    use clap::Parser as _;
    let command = inbox_runtime::ops::cli::AdminCli::try_parse_from(
        std::iter::once("admin").chain(args.iter().copied()),
    )
    .unwrap()
    .command;
    let mut out = Vec::new();
    let result = inbox_runtime::ops::cli::dynamodb::execute_to(&command, inbox, &mut out).await;
    (
        String::from_utf8(out).unwrap(),
        result.err().map(|error| error.to_string()),
    )
}

/// `dead replay` on the command line runs the program's registered DynamoDB handlers: one key
/// (then a duplicate), and `--all` with a message whose cause is not fixed yet, then fixed.
#[tokio::test]
async fn the_command_line_replays_dead_letters_through_the_registered_handlers() {
    let inbox = setup().await;
    let (a, b) = (fresh("acct"), fresh("acct"));
    let (first, second) = (message(&a, 100), message(&b, 200));
    for msg in [&first, &second] {
        script(&msg.account, vec![TestError::Fatal]);
        let (_, _, _, disposition) = failure(credit(&inbox, msg.clone()).await);
        assert_eq!(disposition, Disposition::Dead);
    }

    let one = ["dead", "replay", "ledger", first.id.as_str()];
    assert_eq!(
        cli(&inbox, &one).await,
        (format!("ledger/{}: processed\n", first.id), None)
    );
    assert_eq!(balance(&inbox, &a).await, Some(100));
    assert_eq!(
        cli(&inbox, &one).await,
        (
            format!("ledger/{}: duplicate (processed meanwhile)\n", first.id),
            None
        )
    );
    assert_eq!(balance(&inbox, &a).await, Some(100));

    // The second one's cause is not fixed: its replay fails again and it stays dead.
    script(&b, vec![TestError::Fatal]);
    assert_eq!(
        cli(&inbox, &["dead", "replay", "--all"]).await,
        (
            format!(
                "ledger/{}: handler failed (permanent error, attempt 2, dead-lettered): fatal\n\
                 replayed 1: 0 processed, 0 duplicates, 1 not processed\n",
                second.id
            ),
            Some("1 of 1 replays did not succeed".to_owned())
        )
    );
    assert_eq!(balance(&inbox, &b).await, None);
    assert_eq!(
        inbox_status(&inbox, "ledger", &second.id).await.as_deref(),
        Some("dead")
    );
    // Fixed now.
    assert_eq!(
        cli(&inbox, &["dead", "replay", "--all", "--consumer", "ledger"]).await,
        (
            "replayed 1: 1 processed, 0 duplicates, 0 not processed\n".to_owned(),
            None
        )
    );
    assert_eq!(balance(&inbox, &b).await, Some(200));
    assert_eq!(
        cli(&inbox, &["dead", "replay", "ledger", "no-such-key"]).await,
        (
            String::new(),
            Some("consumer `ledger` has no message with key `no-such-key`".to_owned())
        )
    );
}
