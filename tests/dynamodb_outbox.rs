//! The outbox on DynamoDB (feature `dynamodb`: `DynamoTx::publish`, `DynamoOutbox`,
//! `DynamoRelay`) against the serial moto DynamoDB on loopback (`DYNAMODB_ENDPOINT`, started by
//! scripts/sqs.sh; see tests/dynamodb.rs for why a serial server). Rounds are driven with
//! `run_once`: no timed waits.
//!
//! Each test has tables of its own (a fresh name), so they run side by side.

use inbox_tests::dynamo::endpoint;
use std::collections::{BTreeSet, HashMap};
use std::time::Duration;

use inbox_runtime::dynamodb::sdk::types::{AttributeValue, ConditionCheck, Update};
use inbox_runtime::dynamodb::{
    self, DynamoError, DynamoInbox, DynamoOutbox, DynamoRelay, DynamoTx, Failed, MAX_HANDLER_ITEMS,
};
use inbox_runtime::outbox::{Outbox, OutboxError, OutboxMessage};
use inbox_runtime::sink::{MemorySink, OutgoingMessage, SinkError};
use inbox_runtime::{Classify, Disposition, ErrorClass, Message, Outcome, RetryPolicy};

#[derive(Clone, Debug, serde::Serialize, serde::Deserialize, Message)]
#[message(name = "accounts.credit")]
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

/// The handlers' errors: the outbox's own, or an SDK builder's.
#[derive(Debug, thiserror::Error)]
enum HandlerError {
    #[error(transparent)]
    Outbox(#[from] OutboxError),
    #[error("build: {0}")]
    Build(String),
}

impl Classify for HandlerError {
    fn class(&self) -> ErrorClass {
        match self {
            HandlerError::Outbox(error) => error.class(),
            HandlerError::Build(_) => ErrorClass::Permanent,
        }
    }
}

const CONSUMER: &str = "ledger";
const OUTBOX: Outbox = Outbox::new(&["ledger-events"]);

struct Setup {
    inbox: DynamoInbox,
    outbox: DynamoOutbox,
    counters: String,
}

/// Fresh inbox, outbox and counters tables on the test server.
async fn setup() -> Setup {
    let client = dynamodb::client(Some(&endpoint())).await;
    let suffix = uuid::Uuid::new_v4().simple().to_string();
    let policy = RetryPolicy::default().retry_delays(Duration::ZERO, Duration::ZERO);
    let inbox = DynamoInbox::new(client.clone(), format!("inbox_{suffix}")).retry_policy(policy);
    inbox.ensure_table().await.expect("inbox table");
    let outbox = DynamoOutbox::new(client.clone(), format!("outbox_{suffix}"), OUTBOX);
    outbox.ensure_table().await.expect("outbox table");
    // Twice: idempotent.
    outbox.ensure_table().await.expect("outbox table again");
    let counters = format!("counters_{suffix}");
    inbox_tests::dynamo::create_id_table(&client, &counters).await;
    Setup {
        inbox,
        outbox,
        counters,
    }
}

/// A relay with no backoff, so that a failed item is due again at the next round.
fn relay(outbox: &DynamoOutbox, sink: &MemorySink) -> DynamoRelay {
    DynamoRelay::new(outbox.clone(), sink.clone()).backoff(Duration::ZERO, Duration::ZERO)
}

fn add_counter(
    tx: &mut DynamoTx,
    table: &str,
    account: &str,
    amount: i64,
) -> Result<(), HandlerError> {
    tx.update(
        Update::builder()
            .table_name(table)
            .key("id", AttributeValue::S(account.to_owned()))
            .update_expression("ADD n :amount")
            .expression_attribute_values(":amount", AttributeValue::N(amount.to_string()))
            .build()
            .map_err(|e| HandlerError::Build(e.to_string()))?,
    );
    Ok(())
}

/// The `i`-th message of a delivery of `msg`: to `ledger-events`, named `ledger.credited`,
/// payload `<account>:<amount>:<i>`, aggregate as given.
fn event(msg: &Credit, i: usize, aggregate: Option<&str>) -> OutboxMessage {
    let out = OutboxMessage::raw(
        "ledger-events",
        "ledger.credited",
        format!("{}:{}:{i}", msg.account, msg.amount),
    );
    match aggregate {
        Some(aggregate) => out.aggregate(aggregate),
        None => out,
    }
}

/// Credits `msg.amount` and publishes `count` messages (aggregate as given) in one transaction.
async fn deliver(
    setup: &Setup,
    msg: &Credit,
    count: usize,
    aggregate: Option<&str>,
) -> Result<Outcome<Vec<String>>, DynamoError<HandlerError>> {
    let (counters, outbox) = (&setup.counters, &setup.outbox);
    setup
        .inbox
        .process(CONSUMER, msg, |mut tx| async move {
            add_counter(&mut tx, counters, &msg.account, msg.amount)?;
            let mut ids = Vec::new();
            for i in 0..count {
                ids.push(tx.publish(outbox, event(msg, i, aggregate))?);
            }
            Ok((tx, ids))
        })
        .await
}

/// [`deliver`], which must commit: the ids it published.
async fn committed(
    setup: &Setup,
    msg: &Credit,
    count: usize,
    aggregate: Option<&str>,
) -> Vec<String> {
    match deliver(setup, msg, count, aggregate).await.unwrap() {
        Outcome::Processed(ids) => ids,
        other => panic!("{other:?}"),
    }
}

async fn counter(setup: &Setup, account: &str) -> Option<i64> {
    let item = setup
        .inbox
        .client()
        .get_item()
        .table_name(&setup.counters)
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

/// Every outbox item, by message id.
async fn outbox_items(setup: &Setup) -> HashMap<String, HashMap<String, AttributeValue>> {
    let answer = setup
        .inbox
        .client()
        .scan()
        .table_name(setup.outbox.table())
        .consistent_read(true)
        .send()
        .await
        .unwrap();
    assert!(answer.last_evaluated_key().is_none(), "one page");
    answer
        .items()
        .iter()
        .map(|item| (text(item, "pk"), item.clone()))
        .collect()
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

fn id(key: &str, index: u32) -> String {
    Outbox::message_id_for(CONSUMER, key, index)
}

/// `(message_id, payload as text, attempt)` of each published message, in order.
fn published(sink: &MemorySink) -> Vec<(String, String, u32)> {
    sink.published()
        .iter()
        .map(|m| {
            (
                m.message_id.clone(),
                String::from_utf8(m.payload.clone()).unwrap(),
                m.attempt,
            )
        })
        .collect()
}

#[tokio::test]
async fn a_handler_credits_and_publishes_two_messages_relayed_with_their_derived_ids() {
    let setup = setup().await;
    let msg = credit("c-1", "acct-1", 100);
    let outcome = deliver(&setup, &msg, 2, None).await.unwrap();
    let ids = vec![id("c-1", 0), id("c-1", 1)];
    assert_eq!(outcome, Outcome::Processed(ids.clone()));
    assert_eq!(counter(&setup, "acct-1").await, Some(100));
    let items = outbox_items(&setup).await;
    assert_eq!(items.len(), 2);
    for (i, message_id) in ids.iter().enumerate() {
        let item = &items[message_id];
        assert_eq!(text(item, "status"), "pending");
        assert_eq!(text(item, "consumer"), CONSUMER);
        assert_eq!(text(item, "message_key"), "c-1");
        assert_eq!(text(item, "destination"), "ledger-events");
        assert_eq!(number(item, "attempts"), 0);
        assert_eq!(
            item.get("payload"),
            Some(&AttributeValue::B(
                format!("acct-1:100:{i}").into_bytes().into()
            ))
        );
    }

    let sink = MemorySink::new();
    let relay = relay(&setup.outbox, &sink);
    let report = relay.run_once().await.unwrap();
    assert_eq!(
        (report.leased, report.published, report.failed, report.dead),
        (2, 2, 0, 0)
    );
    assert_eq!(
        published(&sink),
        vec![
            (ids[0].clone(), "acct-1:100:0".to_owned(), 1),
            (ids[1].clone(), "acct-1:100:1".to_owned(), 1),
        ]
    );
    let first = &sink.published()[0];
    assert_eq!(
        (
            first.destination.as_str(),
            first.message_name.as_str(),
            first.aggregate_id.as_deref()
        ),
        ("ledger-events", "ledger.credited", None)
    );
    // Sent: out of the index, with a retention window.
    let items = outbox_items(&setup).await;
    for message_id in &ids {
        let item = &items[message_id];
        assert_eq!(text(item, "status"), "sent");
        assert_eq!(number(item, "attempts"), 1);
        assert!(!item.contains_key("pending_pk") && !item.contains_key("lease_owner"));
        let ttl = number(item, dynamodb::TTL_ATTRIBUTE) - number(item, "sent_at") / 1000;
        assert!((7 * 86_400 - 1..=7 * 86_400).contains(&ttl), "{ttl}");
    }
    assert_eq!(relay.run_once().await.unwrap().leased, 0);

    // A redelivery is a duplicate: it publishes nothing more.
    assert_eq!(
        deliver(&setup, &msg, 2, None).await.unwrap(),
        Outcome::Duplicate
    );
    assert_eq!(relay.run_once().await.unwrap().leased, 0);
    assert_eq!(sink.published().len(), 2);
    assert_eq!(outbox_items(&setup).await.len(), 2);
    assert_eq!(counter(&setup, "acct-1").await, Some(100));
}

#[tokio::test]
async fn a_cancelled_transaction_publishes_nothing_and_its_rerun_the_same_ids() {
    let setup = &setup().await;
    let (counters, outbox) = (&setup.counters, &setup.outbox);
    // A handler condition fails (the account must exist, and it does not yet).
    let msg = credit("c-2", "acct-2", 5);
    let guarded = |msg: Credit| async move {
        setup
            .inbox
            .process(CONSUMER, &msg, |mut tx| {
                let msg = msg.clone();
                async move {
                    let first = tx.publish(outbox, event(&msg, 0, Some("acct-2")))?;
                    tx.condition_check(
                        ConditionCheck::builder()
                            .table_name(counters)
                            .key("id", AttributeValue::S("acct-2".to_owned()))
                            .condition_expression("attribute_exists(id)")
                            .build()
                            .map_err(|e| HandlerError::Build(e.to_string()))?,
                    );
                    let second = tx.publish(outbox, event(&msg, 1, Some("acct-2")))?;
                    Ok::<_, HandlerError>((tx, vec![first, second]))
                }
            })
            .await
    };
    let failed = guarded(msg.clone()).await.unwrap_err();
    let DynamoError::Handler(failure) = failed else {
        panic!("{failed:?}")
    };
    let Failed::Condition(condition) = &failure.error else {
        panic!("{failure:?}")
    };
    assert_eq!((condition.index, condition.action), (1, "ConditionCheck"));
    assert_eq!(failure.attempts, 1);
    assert!(matches!(failure.disposition, Disposition::Retry { .. }));
    assert!(outbox_items(setup).await.is_empty());
    let sink = MemorySink::new();
    let relay = relay(&setup.outbox, &sink);
    assert_eq!(relay.run_once().await.unwrap().leased, 0);

    // The account appears; the redelivery publishes the same ids, once.
    add_account(setup, "acct-2").await;
    let outcome = guarded(msg.clone()).await.unwrap();
    assert_eq!(
        outcome,
        Outcome::Processed(vec![id("c-2", 0), id("c-2", 1)])
    );
    assert_eq!(outbox_items(setup).await.len(), 2);

    // A duplicate delivery that loses the claim to a concurrent one publishes nothing: the
    // handler of the outer delivery runs the inner one to commit before its own submit.
    let msg = credit("c-3", "acct-3", 7);
    let inner = &msg;
    let outer = setup
        .inbox
        .process(CONSUMER, &msg, |mut tx| async move {
            let ids = vec![tx.publish(outbox, event(inner, 0, None))?];
            let concurrent = deliver(setup, inner, 1, None).await.unwrap();
            assert_eq!(concurrent, Outcome::Processed(vec![id("c-3", 0)]));
            Ok::<_, HandlerError>((tx, ids))
        })
        .await
        .unwrap();
    assert_eq!(outer, Outcome::Duplicate);
    assert_eq!(counter(setup, "acct-3").await, Some(7));
    let items = outbox_items(setup).await;
    assert_eq!(items.len(), 3);
    assert_eq!(text(&items[&id("c-3", 0)], "message_key"), "c-3");

    // One round: acct-2's first message and c-3's (acct-2's second waits behind its first).
    let report = relay.run_once().await.unwrap();
    assert_eq!((report.leased, report.published), (2, 2));
    let report = relay.run_once().await.unwrap();
    assert_eq!((report.leased, report.published), (1, 1));
    assert_eq!(relay.run_once().await.unwrap().leased, 0);
    assert_eq!(
        published(&sink),
        vec![
            (id("c-2", 0), "acct-2:5:0".to_owned(), 1),
            (id("c-3", 0), "acct-3:7:0".to_owned(), 1),
            (id("c-2", 1), "acct-2:5:1".to_owned(), 1),
        ]
    );
}

async fn add_account(setup: &Setup, account: &str) {
    setup
        .inbox
        .client()
        .put_item()
        .table_name(&setup.counters)
        .item("id", AttributeValue::S(account.to_owned()))
        .item("n", AttributeValue::N("0".to_owned()))
        .send()
        .await
        .unwrap();
}

#[tokio::test]
async fn two_relays_at_once_publish_each_item_once() {
    let setup = setup().await;
    let mut ids = BTreeSet::new();
    for i in 0..4 {
        let msg = credit(&format!("r-{i}"), &format!("acct-{i}"), 1);
        let Outcome::Processed(published) = deliver(&setup, &msg, 2, None).await.unwrap() else {
            panic!("not processed")
        };
        ids.extend(published);
    }
    assert_eq!(ids.len(), 8);
    let (one, two) = (MemorySink::new(), MemorySink::new());
    let (a, b) = (relay(&setup.outbox, &one), relay(&setup.outbox, &two));
    let (ra, rb) = tokio::join!(a.run_once(), b.run_once());
    let (ra, rb) = (ra.unwrap(), rb.unwrap());
    assert_eq!(ra.published + rb.published, 8, "{ra:?} {rb:?}");
    assert_eq!(ra.leased + rb.leased, 8);
    assert_eq!((ra.lease_lost, rb.lease_lost), (0, 0));
    let sent: Vec<String> = one
        .published()
        .into_iter()
        .chain(two.published())
        .map(|m| m.message_id)
        .collect();
    assert_eq!(sent.len(), 8);
    assert_eq!(sent.into_iter().collect::<BTreeSet<_>>(), ids);
    let (ra, rb) = tokio::join!(a.run_once(), b.run_once());
    assert_eq!((ra.unwrap().leased, rb.unwrap().leased), (0, 0));
}

#[tokio::test]
async fn a_retryable_failure_is_retried_and_published_once_with_attempt_2() {
    let setup = setup().await;
    committed(&setup, &credit("f-1", "acct-1", 1), 1, None).await;
    let sink = MemorySink::new().fail_when(|m: &OutgoingMessage| {
        (m.attempt == 1).then(|| SinkError::retryable("broker unreachable"))
    });
    let relay = relay(&setup.outbox, &sink);
    let report = relay.run_once().await.unwrap();
    assert_eq!(
        (report.leased, report.published, report.failed, report.dead),
        (1, 0, 1, 0)
    );
    let item = &outbox_items(&setup).await[&id("f-1", 0)];
    assert_eq!(text(item, "status"), "pending");
    assert_eq!(text(item, "last_error"), "retryable: broker unreachable");
    assert!(!item.contains_key("lease_owner"));
    let report = relay.run_once().await.unwrap();
    assert_eq!(
        (report.leased, report.published, report.failed, report.dead),
        (1, 1, 0, 0)
    );
    assert_eq!(
        published(&sink),
        vec![(id("f-1", 0), "acct-1:1:0".to_owned(), 2)]
    );
    assert_eq!(relay.run_once().await.unwrap().leased, 0);
}

#[tokio::test]
async fn a_permanent_failure_is_dead_and_blocks_only_its_aggregate() {
    let setup = setup().await;
    committed(&setup, &credit("p-1", "acct-a", 1), 2, Some("a")).await;
    committed(&setup, &credit("p-2", "acct-b", 1), 1, Some("b")).await;
    let poison = id("p-1", 0);
    let refused = poison.clone();
    let sink = MemorySink::new().fail_when(move |m: &OutgoingMessage| {
        (m.message_id == refused).then(|| SinkError::permanent("message too large"))
    });
    let relay = relay(&setup.outbox, &sink);
    let report = relay.run_once().await.unwrap();
    assert_eq!(
        (report.leased, report.published, report.failed, report.dead),
        (2, 1, 0, 1)
    );
    assert_eq!(
        published(&sink),
        vec![(id("p-2", 0), "acct-b:1:0".to_owned(), 1)]
    );
    // The aggregate's second message waits behind the dead one, round after round.
    for _ in 0..2 {
        assert_eq!(relay.run_once().await.unwrap().leased, 0);
    }
    let items = outbox_items(&setup).await;
    assert_eq!(text(&items[&poison], "status"), "dead");
    assert_eq!(
        text(&items[&poison], "last_error"),
        "permanent: message too large"
    );
    assert_eq!(text(&items[&id("p-1", 1)], "status"), "pending");
    assert_eq!(number(&items[&id("p-1", 1)], "attempts"), 0);
    // Another aggregate is not held back.
    committed(&setup, &credit("p-3", "acct-b", 1), 1, Some("b")).await;
    let report = relay.run_once().await.unwrap();
    assert_eq!((report.leased, report.published), (1, 1));
    assert_eq!(sink.published().len(), 2);
}

#[tokio::test]
async fn retries_run_out_into_the_dead_letters() {
    let setup = setup().await;
    committed(&setup, &credit("x-1", "acct-1", 1), 1, None).await;
    let sink =
        MemorySink::new().fail_when(|_: &OutgoingMessage| Some(SinkError::retryable("down")));
    let relay = relay(&setup.outbox, &sink).max_attempts(3);
    let mut rounds = Vec::new();
    for _ in 0..4 {
        let r = relay.run_once().await.unwrap();
        rounds.push((r.leased, r.failed, r.dead));
    }
    assert_eq!(rounds, vec![(1, 1, 0), (1, 1, 0), (1, 0, 1), (0, 0, 0)]);
    let item = &outbox_items(&setup).await[&id("x-1", 0)];
    assert_eq!(
        (text(item, "status"), number(item, "attempts")),
        ("dead".to_owned(), 3)
    );
    // Without an aggregate a dead item leaves the index.
    assert!(!item.contains_key("pending_pk"));
}

#[tokio::test]
async fn an_aggregate_goes_out_in_creation_order_one_at_a_time() {
    let setup = setup().await;
    committed(&setup, &credit("o-1", "acct-1", 1), 2, Some("order-1")).await;
    committed(&setup, &credit("o-2", "acct-1", 1), 2, Some("order-1")).await;
    let items = outbox_items(&setup).await;
    assert_eq!(text(&items[&id("o-1", 1)], "after"), id("o-1", 0));
    assert!(!items[&id("o-2", 0)].contains_key("after"));
    let sink = MemorySink::new();
    let relay = relay(&setup.outbox, &sink);
    let mut leased = Vec::new();
    for _ in 0..5 {
        leased.push(relay.run_once().await.unwrap().leased);
    }
    assert_eq!(leased, vec![1, 1, 1, 1, 0]);
    let order: Vec<String> = sink.published().into_iter().map(|m| m.message_id).collect();
    assert_eq!(
        order,
        vec![id("o-1", 0), id("o-1", 1), id("o-2", 0), id("o-2", 1)]
    );
}

#[tokio::test]
async fn bad_input_is_refused_and_nothing_is_written() {
    let setup = &setup().await;
    let outbox = &setup.outbox;
    let attempt = |message: fn() -> OutboxMessage, fill: usize, key: &'static str| async move {
        setup
            .inbox
            .process(CONSUMER, &credit(key, "acct-1", 1), |mut tx| async move {
                for i in 0..fill {
                    add_counter(&mut tx, &setup.counters, &format!("acct-{i}"), 1)?;
                }
                let id = tx.publish(outbox, message())?;
                Ok::<_, HandlerError>((tx, id))
            })
            .await
    };
    let error = |result: Result<Outcome<String>, DynamoError<HandlerError>>| match result {
        Err(DynamoError::Handler(failure)) => {
            assert_eq!(failure.class, ErrorClass::Permanent);
            assert_eq!(failure.disposition, Disposition::Dead);
            match failure.error {
                Failed::Handler(HandlerError::Outbox(error)) => error,
                other => panic!("{other:?}"),
            }
        }
        other => panic!("{other:?}"),
    };
    let unknown = error(attempt(|| OutboxMessage::raw("ledger", "n", "{}"), 0, "b-1").await);
    assert!(matches!(
        &unknown,
        OutboxError::UnknownDestination { destination, known }
            if destination == "ledger" && known == &["ledger-events".to_owned()]
    ));
    assert_eq!(
        unknown.to_string(),
        "unknown outbox destination \"ledger\" (known: ledger-events)"
    );
    let empty = error(attempt(|| OutboxMessage::raw("ledger-events", "", "{}"), 0, "b-2").await);
    assert_eq!(
        empty.to_string(),
        "outbox message to \"ledger-events\" has an empty message name"
    );
    let no_destination = error(attempt(|| OutboxMessage::raw("", "n", "{}"), 0, "b-3").await);
    assert!(matches!(no_destination, OutboxError::EmptyDestination));
    let bad_id = error(
        attempt(
            || OutboxMessage::raw("ledger-events", "n", "{}").message_id(""),
            0,
            "b-4",
        )
        .await,
    );
    assert!(matches!(
        bad_id,
        OutboxError::InvalidMessageId { length: 0, .. }
    ));
    let full = error(
        attempt(
            || OutboxMessage::raw("ledger-events", "n", "{}"),
            MAX_HANDLER_ITEMS,
            "b-5",
        )
        .await,
    );
    assert!(matches!(
        full,
        OutboxError::TransactionFull {
            actions: 99,
            max: 99
        }
    ));
    assert_eq!(
        full.to_string(),
        "the DynamoDB transaction holds 99 actions already, at most 99 besides the claim: no \
         room for the outbox message"
    );
    // One action short of full: the publish fits (99 actions in all) and commits.
    let fits = attempt(
        || OutboxMessage::raw("ledger-events", "n", "{}"),
        MAX_HANDLER_ITEMS - 1,
        "b-6",
    )
    .await
    .unwrap();
    assert_eq!(fits, Outcome::Processed(id("b-6", 0)));
    let items = outbox_items(setup).await;
    assert_eq!(
        items.keys().cloned().collect::<Vec<_>>(),
        vec![id("b-6", 0)]
    );
    // Only the committed delivery credited.
    assert_eq!(counter(setup, "acct-0").await, Some(1));
}

#[tokio::test]
async fn a_message_id_published_before_fails_the_transaction_as_a_condition() {
    let setup = &setup().await;
    let outbox = &setup.outbox;
    let with_id = |key: &'static str| async move {
        setup
            .inbox
            .process(CONSUMER, &credit(key, "acct-1", 1), |mut tx| async move {
                let id = tx.publish(
                    outbox,
                    OutboxMessage::raw("ledger-events", "n", "{}").message_id("order-7-paid"),
                )?;
                Ok::<_, HandlerError>((tx, id))
            })
            .await
    };
    assert_eq!(
        with_id("d-1").await.unwrap(),
        Outcome::Processed("order-7-paid".to_owned())
    );
    let failed = with_id("d-2").await.unwrap_err();
    let DynamoError::Handler(failure) = failed else {
        panic!("{failed:?}")
    };
    let Failed::Condition(condition) = &failure.error else {
        panic!("{failure:?}")
    };
    assert_eq!(
        (condition.index, condition.action, condition.table.as_str()),
        (0, "Put", setup.outbox.table())
    );
    assert_eq!(outbox_items(setup).await.len(), 1);
}

/// A sink that, while it publishes, has "another relay" take over each message's lease (as
/// after this relay's lease ran out): it rewrites `lease_owner`, then accepts the message.
struct TakenOver {
    client: dynamodb::sdk::Client,
    table: String,
    inner: MemorySink,
}

impl inbox_runtime::sink::Sink for TakenOver {
    fn publish_batch<'a>(
        &'a self,
        messages: &'a [OutgoingMessage],
    ) -> inbox_runtime::sink::PublishFuture<'a> {
        Box::pin(async move {
            for message in messages {
                self.client
                    .update_item()
                    .table_name(&self.table)
                    .key("pk", AttributeValue::S(message.message_id.clone()))
                    .update_expression("SET lease_owner = :other")
                    .expression_attribute_values(":other", AttributeValue::S("other".into()))
                    .send()
                    .await
                    .unwrap();
            }
            self.inner.publish_batch(messages).await
        })
    }
}

#[tokio::test]
async fn a_relay_that_lost_its_lease_marks_nothing() {
    let setup = setup().await;
    let ids = committed(&setup, &credit("l-1", "acct-1", 1), 1, None).await;
    let sink = MemorySink::new();
    let taken = TakenOver {
        client: setup.inbox.client().clone(),
        table: setup.outbox.table().to_owned(),
        inner: sink.clone(),
    };
    let relay = DynamoRelay::new(setup.outbox.clone(), taken);
    let report = relay.run_once().await.unwrap();
    assert_eq!(
        (report.leased, report.published, report.lease_lost),
        (1, 0, 1)
    );
    assert_eq!(sink.published().len(), 1);
    let item = &outbox_items(&setup).await[&ids[0]];
    // Still the other relay's: pending, leased by it, in the index.
    assert_eq!(text(item, "status"), "pending");
    assert_eq!(text(item, "lease_owner"), "other");
    assert_eq!(text(item, "pending_pk"), "pending");
}

#[tokio::test]
async fn an_item_whose_leases_ran_out_too_often_is_dead_as_abandoned() {
    let setup = setup().await;
    let ids = committed(&setup, &credit("a-1", "acct-1", 1), 1, Some("a")).await;
    // As three relays that crashed holding it would leave it: three leases, the last run out.
    setup
        .inbox
        .client()
        .update_item()
        .table_name(setup.outbox.table())
        .key("pk", AttributeValue::S(ids[0].clone()))
        .update_expression("SET attempts = :three, lease_owner = :crashed, lease_until = :past")
        .expression_attribute_values(":three", AttributeValue::N("3".into()))
        .expression_attribute_values(":crashed", AttributeValue::S("crashed".into()))
        .expression_attribute_values(":past", AttributeValue::N("1".into()))
        .send()
        .await
        .unwrap();
    let sink = MemorySink::new();
    let relay = relay(&setup.outbox, &sink).max_attempts(3);
    let report = relay.run_once().await.unwrap();
    assert_eq!((report.leased, report.abandoned, report.dead), (0, 1, 0));
    let item = &outbox_items(&setup).await[&ids[0]];
    assert_eq!(text(item, "status"), "dead");
    assert!(text(item, "last_error").starts_with("the relay never finished publishing it"));
    assert!(!item.contains_key("lease_owner"));
    // With an aggregate it stays in the index, blocking the aggregate.
    assert_eq!(text(item, "pending_pk"), "pending");
    assert_eq!(relay.run_once().await.unwrap().abandoned, 0);
    assert!(sink.published().is_empty());
}

#[tokio::test]
async fn change_data_capture_writes_items_already_sent_for_no_relay() {
    let setup = setup().await;
    let cdc = DynamoOutbox::new(
        setup.inbox.client().clone(),
        setup.outbox.table(),
        OUTBOX.transport(inbox_runtime::outbox::Transport::ChangeDataCapture),
    );
    let msg = credit("cdc-1", "acct-1", 3);
    let outcome = setup
        .inbox
        .process(CONSUMER, &msg, |mut tx| {
            let (cdc, msg) = (cdc.clone(), msg.clone());
            async move {
                let id = tx.publish(&cdc, event(&msg, 0, None))?;
                Ok::<_, HandlerError>((tx, id))
            }
        })
        .await
        .unwrap();
    assert_eq!(outcome, Outcome::Processed(id("cdc-1", 0)));
    let item = &outbox_items(&setup).await[&id("cdc-1", 0)];
    assert_eq!(text(item, "status"), "sent");
    assert!(!item.contains_key("pending_pk"));
    let ttl = number(item, dynamodb::TTL_ATTRIBUTE) - number(item, "sent_at") / 1000;
    assert!((7 * 86_400 - 1..=7 * 86_400).contains(&ttl), "{ttl}");
    let sink = MemorySink::new();
    assert_eq!(
        relay(&setup.outbox, &sink).run_once().await.unwrap().leased,
        0
    );
}

#[tokio::test]
async fn a_dead_item_retried_is_published_again_with_its_id() {
    let setup = setup().await;
    // One without an aggregate (it left the index), one with (it stayed, blocking "b").
    committed(&setup, &credit("s-1", "acct-1", 1), 1, None).await;
    committed(&setup, &credit("s-2", "acct-2", 1), 2, Some("b")).await;
    let failing = MemorySink::new().fail_when(|m: &OutgoingMessage| {
        (m.message_id != id("s-2", 1)).then(|| SinkError::retryable("down"))
    });
    let relay_failing = relay(&setup.outbox, &failing).max_attempts(2);
    let mut rounds = Vec::new();
    for _ in 0..3 {
        let r = relay_failing.run_once().await.unwrap();
        rounds.push((r.leased, r.failed, r.dead));
    }
    assert_eq!(rounds, vec![(2, 2, 0), (2, 0, 2), (0, 0, 0)]);
    let items = outbox_items(&setup).await;
    assert!(!items[&id("s-1", 0)].contains_key("pending_pk"));
    assert_eq!(text(&items[&id("s-2", 0)], "pending_pk"), "pending");
    let place = text(&items[&id("s-2", 0)], "pending_sk");

    assert!(setup.outbox.retry(&id("s-1", 0)).await.unwrap());
    assert!(setup.outbox.retry(&id("s-2", 0)).await.unwrap());
    // Not dead (any more, or at all): nothing to retry or discard.
    assert!(!setup.outbox.retry(&id("s-2", 0)).await.unwrap());
    assert!(!setup.outbox.retry(&id("s-2", 1)).await.unwrap());
    assert!(!setup.outbox.discard(&id("s-2", 1)).await.unwrap());
    assert!(!setup.outbox.discard("no-such-id").await.unwrap());
    let items = outbox_items(&setup).await;
    // The aggregate's item kept its place; the other is back in the index; attempts reset.
    assert_eq!(text(&items[&id("s-2", 0)], "pending_sk"), place);
    assert_eq!(text(&items[&id("s-1", 0)], "pending_pk"), "pending");
    assert_eq!(number(&items[&id("s-1", 0)], "attempts"), 0);
    let sink = MemorySink::new();
    let relay = relay(&setup.outbox, &sink).max_attempts(2);
    let mut leased = Vec::new();
    for _ in 0..3 {
        leased.push(relay.run_once().await.unwrap().leased);
    }
    assert_eq!(leased, vec![2, 1, 0]);
    assert_eq!(
        published(&sink),
        // The item without an aggregate came back at the end of the index.
        vec![
            (id("s-2", 0), "acct-2:1:0".to_owned(), 1),
            (id("s-1", 0), "acct-1:1:0".to_owned(), 1),
            (id("s-2", 1), "acct-2:1:1".to_owned(), 1),
        ]
    );
}

#[tokio::test]
async fn a_message_id_published_twice_in_one_transaction_is_refused_at_the_second_publish() {
    let setup = &setup().await;
    let outbox = &setup.outbox;
    let msg = credit("d-1", "acct-1", 1);
    let outcome = setup
        .inbox
        .process(CONSUMER, &msg, |mut tx| async move {
            let message = || OutboxMessage::raw("ledger-events", "n", "{}").message_id("dup-1");
            let first = tx.publish(outbox, message())?;
            let second = tx.publish(outbox, message());
            // A derived id is not refused for an explicit one before it.
            let derived = tx.publish(outbox, OutboxMessage::raw("ledger-events", "n", "{}"))?;
            Ok::<_, HandlerError>((tx, (first, second.map_err(|e| e.to_string()), derived)))
        })
        .await
        .unwrap();
    assert_eq!(
        outcome,
        Outcome::Processed((
            "dup-1".to_owned(),
            Err("outbox message id \"dup-1\" was published before".to_owned()),
            id("d-1", 0)
        ))
    );
    let items = outbox_items(setup).await;
    assert_eq!(
        items.keys().cloned().collect::<BTreeSet<_>>(),
        BTreeSet::from(["dup-1".to_owned(), id("d-1", 0)])
    );
}

#[tokio::test]
async fn an_item_whose_predecessor_the_index_does_not_show_yet_waits_for_it() {
    let setup = setup().await;
    let ids = committed(&setup, &credit("i-1", "acct-1", 1), 2, Some("x")).await;
    // As a lagging index would show it: the first item not in the index yet (moto's index is
    // always current, so take it out of the index by hand, then put it back).
    let client = setup.inbox.client();
    let sort_key = text(&outbox_items(&setup).await[&ids[0]], "pending_sk");
    client
        .update_item()
        .table_name(setup.outbox.table())
        .key("pk", AttributeValue::S(ids[0].clone()))
        .update_expression("REMOVE pending_pk, pending_sk")
        .send()
        .await
        .unwrap();
    let sink = MemorySink::new();
    let relay = relay(&setup.outbox, &sink);
    assert_eq!(relay.run_once().await.unwrap().leased, 0);
    assert!(sink.published().is_empty());
    client
        .update_item()
        .table_name(setup.outbox.table())
        .key("pk", AttributeValue::S(ids[0].clone()))
        .update_expression("SET pending_pk = :pending, pending_sk = :sk")
        .expression_attribute_values(":pending", AttributeValue::S("pending".into()))
        .expression_attribute_values(":sk", AttributeValue::S(sort_key))
        .send()
        .await
        .unwrap();
    let mut leased = Vec::new();
    for _ in 0..3 {
        leased.push(relay.run_once().await.unwrap().leased);
    }
    assert_eq!(leased, vec![1, 1, 0]);
    let order: Vec<String> = sink.published().into_iter().map(|m| m.message_id).collect();
    assert_eq!(order, ids);
}

#[tokio::test]
async fn a_failed_lease_call_ends_the_leasing_and_what_was_leased_is_still_published() {
    let setup = setup().await;
    let first = committed(&setup, &credit("e-1", "acct-1", 1), 1, None).await;
    let damaged = committed(&setup, &credit("e-2", "acct-2", 1), 1, Some("z")).await;
    // A predecessor link DynamoDB cannot read (an empty key): the second lease's GetItem fails.
    setup
        .inbox
        .client()
        .update_item()
        .table_name(setup.outbox.table())
        .key("pk", AttributeValue::S(damaged[0].clone()))
        .update_expression("SET #after = :empty")
        .expression_attribute_names("#after", "after")
        .expression_attribute_values(":empty", AttributeValue::S(String::new()))
        .send()
        .await
        .unwrap();
    let sink = MemorySink::new();
    let relay = relay(&setup.outbox, &sink);
    let error = relay.run_once().await.unwrap_err();
    assert_eq!(error.operation, "GetItem");
    assert_eq!(error.table, setup.outbox.table());
    // The item leased before the failed call went out and is marked sent.
    assert_eq!(
        published(&sink),
        vec![(first[0].clone(), "acct-1:1:0".to_owned(), 1)]
    );
    let items = outbox_items(&setup).await;
    assert_eq!(text(&items[&first[0]], "status"), "sent");
    assert_eq!(text(&items[&damaged[0]], "status"), "pending");
    assert_eq!(number(&items[&damaged[0]], "attempts"), 0);
}

/// A sink that never answers.
struct Silent;

impl inbox_runtime::sink::Sink for Silent {
    fn publish_batch<'a>(
        &'a self,
        _messages: &'a [OutgoingMessage],
    ) -> inbox_runtime::sink::PublishFuture<'a> {
        Box::pin(std::future::pending())
    }
}

/// A sink that does not answer within the lease: the round stops waiting at the lease's end
/// (`timed_out`), marks nothing, and the item is published by a later lease with its id, the
/// attempt counted.
#[tokio::test]
async fn a_publish_that_outlives_its_lease_is_timed_out_and_published_again_with_its_id() {
    let setup = setup().await;
    let ids = committed(&setup, &credit("t-1", "acct-1", 1), 1, None).await;
    let lease = Duration::from_millis(300);
    let silent = DynamoRelay::new(setup.outbox.clone(), Silent)
        .lease(lease)
        .unwrap();
    let report = silent.run_once().await.unwrap();
    assert_eq!(
        (
            report.leased,
            report.published,
            report.timed_out,
            report.failed
        ),
        (1, 0, 1, 0)
    );
    let item = &outbox_items(&setup).await[&ids[0]];
    assert_eq!(text(item, "status"), "pending");
    assert_eq!(number(item, "attempts"), 1);
    // The round stopped waiting as its lease ran out (a few milliseconds before the lease's
    // end, which is read from the clock after the wait began): the next lease takes it.
    let sink = MemorySink::new();
    let relay = relay(&setup.outbox, &sink);
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    let report = loop {
        let report = relay.run_once().await.unwrap();
        if report.leased > 0 {
            break report;
        }
        assert!(std::time::Instant::now() < deadline, "never leased again");
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    assert_eq!((report.leased, report.published), (1, 1));
    assert_eq!(
        published(&sink),
        [(ids[0].clone(), "acct-1:1:0".to_owned(), 2)]
    );
    let item = &outbox_items(&setup).await[&ids[0]];
    assert_eq!(text(item, "status"), "sent");
}

/// A dead item discarded is deleted: never sent, and its aggregate's later items go ahead.
#[tokio::test]
async fn a_dead_item_discarded_lets_its_aggregate_go_ahead() {
    let setup = setup().await;
    committed(&setup, &credit("d-1", "acct-1", 1), 2, Some("d")).await;
    let refusing = MemorySink::new().fail_when(|m: &OutgoingMessage| {
        (m.message_id == id("d-1", 0)).then(|| SinkError::permanent("refused"))
    });
    let report = relay(&setup.outbox, &refusing).run_once().await.unwrap();
    assert_eq!((report.leased, report.dead), (1, 1));
    // The dead item blocks its aggregate.
    assert_eq!(
        relay(&setup.outbox, &refusing)
            .run_once()
            .await
            .unwrap()
            .leased,
        0
    );
    assert!(setup.outbox.discard(&id("d-1", 0)).await.unwrap());
    assert!(!setup.outbox.discard(&id("d-1", 0)).await.unwrap());
    assert!(!outbox_items(&setup).await.contains_key(&id("d-1", 0)));
    let sink = MemorySink::new();
    let report = relay(&setup.outbox, &sink).run_once().await.unwrap();
    assert_eq!((report.leased, report.published), (1, 1));
    assert_eq!(
        published(&sink),
        [(id("d-1", 1), "acct-1:1:1".to_owned(), 1)]
    );
}

/// `retry` and `discard` on an unreachable DynamoDB: the call's error, naming the table and the
/// operation, not a `false` (which would read as "no dead item").
#[tokio::test]
async fn retry_and_discard_report_a_failed_call() {
    let client = dynamodb::client(Some("http://127.0.0.1:9")).await;
    let outbox = DynamoOutbox::new(client, "unreachable", OUTBOX);
    let error = outbox.retry("m-1").await.unwrap_err();
    assert_eq!(
        (error.table.as_str(), error.operation),
        ("unreachable", "UpdateItem")
    );
    let error = outbox.discard("m-1").await.unwrap_err();
    assert_eq!(
        (error.table.as_str(), error.operation),
        ("unreachable", "DeleteItem")
    );
}
