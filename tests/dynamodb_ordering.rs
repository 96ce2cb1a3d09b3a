//! Per-aggregate ordering on DynamoDB (`inbox_runtime::dynamodb::ordering`) against moto's
//! DynamoDB on loopback (`DYNAMODB_ENDPOINT`, the serial moto server of scripts/sqs.sh): the
//! sequence guard (`gaps = "apply"`), the durable reorder buffer (`gaps = "park"`), the release
//! of parked successors in order, the sweep, a concurrent storm and the worker; the cases of
//! tests/ordering.rs, with the DynamoDB calls of each path counted.
//!
//! Each test has an inbox table of its own and orders of its own (fresh ids) in one orders table
//! shared by the binary: a handler appends its event's kind to the order's `history` list, so the
//! list is the order in which the effects committed.

use std::sync::Arc;
use std::time::Duration;

use inbox_runtime::dynamodb::sdk::types::{AttributeValue, Update};
use inbox_runtime::dynamodb::{self, DynamoDispatcher, DynamoInbox, DynamoTx, DynamoWorker};
use inbox_runtime::source::Settlement;
use inbox_runtime::source::memory::MemorySource;
use inbox_runtime::types::{ParkPolicy, ParkTimeout, Status};
use inbox_runtime::{CancellationToken, Envelope, Message, Outcome, handler, idempotent};
use inbox_tests::dynamo::{TestError, status};
use inbox_tests::envelope;
use serde::{Deserialize, Serialize};

/// One event of an order's lifecycle.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, Message)]
#[message(name = "dyn.order.event")]
struct OrderEvent {
    #[message(key)]
    event_id: String,
    #[message(aggregate)]
    order_id: String,
    #[message(sequence)]
    seq: i64,
    kind: String,
}

fn event(order: &str, seq: i64, kind: &str) -> OrderEvent {
    OrderEvent {
        event_id: format!("{order}/{seq}"),
        order_id: order.to_owned(),
        seq,
        kind: kind.to_owned(),
    }
}

/// An order was opened (sequence 1), for the consumer `orders-resume`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, Message)]
#[message(name = "dyn.order.opened")]
struct OrderOpened {
    #[message(key)]
    event_id: String,
    #[message(aggregate)]
    order_id: String,
    #[message(sequence)]
    seq: i64,
}

/// A note on an order (sequence 2 and later), for the consumer `orders-resume`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, Message)]
#[message(name = "dyn.order.note")]
struct OrderNote {
    #[message(key)]
    event_id: String,
    #[message(aggregate)]
    order_id: String,
    #[message(sequence)]
    seq: i64,
}

/// The orders table of this binary (`id` string key: `<consumer>:<order>`), made once.
static ORDERS: tokio::sync::OnceCell<String> = tokio::sync::OnceCell::const_new();

/// Appends `kind` to the `history` list of the consumer's order.
fn append(tx: &mut DynamoTx, consumer: &str, order: &str, kind: &str) -> Result<(), TestError> {
    let table = ORDERS.get().expect("setup made the orders table");
    tx.update(
        Update::builder()
            .table_name(table)
            .key("id", AttributeValue::S(format!("{consumer}:{order}")))
            .update_expression("SET history = list_append(if_not_exists(history, :empty), :kind)")
            .expression_attribute_values(":empty", AttributeValue::L(Vec::new()))
            .expression_attribute_values(
                ":kind",
                AttributeValue::L(vec![AttributeValue::S(kind.to_owned())]),
            )
            .build()
            .map_err(|e| TestError::Build(e.to_string()))?,
    );
    Ok(())
}

#[idempotent(consumer = "orders-park", gaps = "park")]
async fn track_parked(tx: &mut DynamoTx, msg: OrderEvent) -> Result<(), TestError> {
    append(tx, "orders-park", &msg.order_id, &msg.kind)
}

#[idempotent(consumer = "orders-apply")]
async fn track_newest(tx: &mut DynamoTx, msg: OrderEvent) -> Result<(), TestError> {
    append(tx, "orders-apply", &msg.order_id, &msg.kind)
}

#[idempotent(consumer = "orders-resume", gaps = "park")]
async fn resume_opened(tx: &mut DynamoTx, msg: OrderOpened) -> Result<(), TestError> {
    append(tx, "orders-resume", &msg.order_id, "opened")
}

/// Event ids whose next run fails (retryable), once each.
static FAIL_ONCE: std::sync::Mutex<Vec<String>> = std::sync::Mutex::new(Vec::new());

#[idempotent(consumer = "orders-resume", gaps = "park")]
async fn resume_note(tx: &mut DynamoTx, msg: OrderNote) -> Result<(), TestError> {
    let mut failing = FAIL_ONCE.lock().unwrap();
    if let Some(at) = failing.iter().position(|id| *id == msg.event_id) {
        failing.remove(at);
        return Err(TestError::Boom);
    }
    drop(failing);
    append(
        tx,
        "orders-resume",
        &msg.order_id,
        &format!("note{}", msg.seq),
    )
}

fn fresh(prefix: &str) -> String {
    format!(
        "{prefix}{}",
        &uuid::Uuid::new_v4().simple().to_string()[..12]
    )
}

/// A fresh inbox table (retries due at once), and the binary's orders table.
async fn setup() -> DynamoInbox {
    inbox_tests::dynamo::setup_with_table(&ORDERS, "orders").await
}

/// The history of the consumer's order, comma-joined; `None` if nothing was applied.
async fn history(inbox: &DynamoInbox, consumer: &str, order: &str) -> Option<String> {
    let id = format!("{consumer}:{order}");
    inbox_tests::dynamo::history(inbox, ORDERS.get().unwrap(), &id).await
}

/// How many parked messages the inbox holds (the admin's `list`).
async fn parked(inbox: &DynamoInbox) -> usize {
    inbox
        .admin()
        .list(None, &[Status::Parked], 10_000)
        .await
        .unwrap()
        .len()
}

/// The DynamoDB calls `run` made on `inbox`, and its value.
async fn calls<T>(inbox: &DynamoInbox, run: impl std::future::Future<Output = T>) -> (u64, T) {
    let before = inbox.stats().calls;
    let value = run.await;
    (inbox.stats().calls - before, value)
}

/// The result of `consumer` in a dispatch's outcomes.
fn of(outcomes: &[dynamodb::DynamoConsumerOutcome], consumer: &str) -> Outcome<()> {
    let outcome = outcomes.iter().find(|o| o.consumer == consumer).unwrap();
    outcome.result.as_ref().unwrap().clone()
}

#[tokio::test]
async fn in_order_deliveries_cost_two_calls_with_apply_and_three_with_park() {
    let inbox = setup().await;
    let order = fresh("io");
    for (seq, kind) in [(1, "placed"), (2, "paid"), (3, "packed")] {
        let (n, outcome) = calls(&inbox, track_newest(&inbox, event(&order, seq, kind))).await;
        assert_eq!((n, outcome.unwrap()), (2, Outcome::Processed(())));
        // The release looks up the next pointer (none): one `GetItem` more.
        let (n, outcome) = calls(&inbox, track_parked(&inbox, event(&order, seq, kind))).await;
        assert_eq!((n, outcome.unwrap()), (3, Outcome::Processed(())));
    }
    for consumer in ["orders-apply", "orders-park"] {
        assert_eq!(
            history(&inbox, consumer, &order).await.as_deref(),
            Some("placed,paid,packed")
        );
    }
    // A duplicate: one read (and with `park`, the lookup of successors left parked: the
    // position, then the pointer after it).
    let (n, outcome) = calls(&inbox, track_newest(&inbox, event(&order, 2, "paid"))).await;
    assert_eq!((n, outcome.unwrap()), (1, Outcome::Duplicate));
    let (n, outcome) = calls(&inbox, track_parked(&inbox, event(&order, 2, "paid"))).await;
    assert_eq!((n, outcome.unwrap()), (3, Outcome::Duplicate));
}

#[tokio::test]
async fn a_stale_message_is_recorded_once_and_not_applied() {
    let inbox = setup().await;
    let order = fresh("st");
    for seq in [1, 2] {
        let outcome = track_newest(&inbox, event(&order, seq, &format!("k{seq}"))).await;
        assert_eq!(outcome.unwrap(), Outcome::Processed(()));
    }
    let mut late = event(&order, 2, "late");
    late.event_id = format!("{order}/2-late");
    // Read, the cancelled transaction (the guard's condition), the stale record.
    let (n, outcome) = calls(&inbox, track_newest(&inbox, late.clone())).await;
    assert_eq!((n, outcome.unwrap()), (3, Outcome::Stale));
    // Redelivered: one read, stale again.
    let (n, outcome) = calls(&inbox, track_newest(&inbox, late.clone())).await;
    assert_eq!((n, outcome.unwrap()), (1, Outcome::Stale));
    assert_eq!(
        history(&inbox, "orders-apply", &order).await.as_deref(),
        Some("k1,k2")
    );
    let key = format!("{order}/2-late");
    let row = inbox
        .admin()
        .show("orders-apply", &key)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(
        (
            row.status,
            row.attempts,
            row.aggregate_id.as_deref(),
            row.sequence,
            row.payload.is_none(),
            row.processed_at.is_some()
        ),
        (Status::Stale, 1, Some(order.as_str()), Some(2), true, true)
    );
    // Counted once by the admin; the position item is not an inbox item.
    let stats = inbox.admin().stats().await.unwrap();
    let counts: Vec<(&str, &str, i64)> = stats
        .iter()
        .map(|row| {
            (
                row.consumer.as_deref().unwrap(),
                row.status.as_str(),
                row.count,
            )
        })
        .collect();
    assert_eq!(
        counts,
        [
            ("orders-apply", "processed", 2),
            ("orders-apply", "stale", 1)
        ]
    );
}

#[tokio::test]
async fn apply_skips_a_gap_and_the_older_message_is_then_stale() {
    let inbox = setup().await;
    let order = fresh("ap");
    let outcome = track_newest(&inbox, event(&order, 3, "packed")).await;
    assert_eq!(outcome.unwrap(), Outcome::Processed(()));
    for (seq, kind) in [(1, "placed"), (2, "paid")] {
        let outcome = track_newest(&inbox, event(&order, seq, kind)).await;
        assert_eq!(outcome.unwrap(), Outcome::Stale, "seq {seq}");
    }
    let outcome = track_newest(&inbox, event(&order, 5, "delivered")).await;
    assert_eq!(outcome.unwrap(), Outcome::Processed(()));
    assert_eq!(
        history(&inbox, "orders-apply", &order).await.as_deref(),
        Some("packed,delivered")
    );
}

/// tests/ordering.rs's `outcomes_of_the_guard`, with the calls of each path.
#[tokio::test]
async fn park_holds_three_and_two_until_one_then_applies_them_in_order() {
    let inbox = setup().await;
    let g = fresh("g");
    // Read, the cancelled transaction (the guard's condition, with the position), the park.
    let (n, outcome) = calls(&inbox, track_parked(&inbox, event(&g, 3, "packed"))).await;
    assert_eq!((n, outcome.unwrap()), (3, Outcome::Parked));
    // A duplicate of a parked message: one read, parked still, nothing run.
    let (n, outcome) = calls(&inbox, track_parked(&inbox, event(&g, 3, "packed"))).await;
    assert_eq!((n, outcome.unwrap()), (1, Outcome::Parked));
    let outcome = track_parked(&inbox, event(&g, 2, "paid")).await;
    assert_eq!(outcome.unwrap(), Outcome::Parked);
    assert_eq!(history(&inbox, "orders-park", &g).await, None);
    assert_eq!(parked(&inbox).await, 2);
    // 1 applies (read, transaction), then each successor: its pointer, its item, its
    // transaction; then the pointer of 4 (none).
    let (n, outcome) = calls(&inbox, track_parked(&inbox, event(&g, 1, "placed"))).await;
    assert_eq!(
        (n, outcome.unwrap()),
        (2 + 3 + 3 + 1, Outcome::Processed(()))
    );
    assert_eq!(
        history(&inbox, "orders-park", &g).await.as_deref(),
        Some("placed,paid,packed")
    );
    assert_eq!(parked(&inbox).await, 0);
    let outcome = track_parked(&inbox, event(&g, 3, "packed")).await;
    assert_eq!(outcome.unwrap(), Outcome::Duplicate);
    // Another event with an old sequence is stale, and stays so when redelivered.
    let mut late = event(&g, 2, "paid-again");
    late.event_id = format!("{g}/2-late");
    for _ in 0..2 {
        let outcome = track_parked(&inbox, late.clone()).await;
        assert_eq!(outcome.unwrap(), Outcome::Stale);
    }
    assert_eq!(
        history(&inbox, "orders-park", &g).await.as_deref(),
        Some("placed,paid,packed")
    );
    // The same key with another payload is a conflict, parked or not.
    let outcome = track_parked(&inbox, event(&g, 9, "x")).await;
    assert_eq!(outcome.unwrap(), Outcome::Parked);
    let mut other = event(&g, 9, "y");
    other.event_id = format!("{g}/9");
    let conflict = track_parked(&inbox, other).await.unwrap_err();
    assert!(
        matches!(conflict, dynamodb::DynamoError::Conflict(_)),
        "{conflict:?}"
    );
    let mut statuses = Vec::new();
    for key in ["1", "2", "2-late", "3", "9"] {
        let key = format!("{g}/{key}");
        statuses.push(status(&inbox, "orders-park", &key).await.unwrap());
    }
    assert_eq!(
        statuses,
        [
            Status::Processed,
            Status::Processed,
            Status::Stale,
            Status::Processed,
            Status::Parked
        ]
    );
    // The parked message as the admin lists it: its place in the aggregate, its payload kept.
    let rows = inbox
        .admin()
        .list(Some("orders-park"), &[Status::Parked], 10)
        .await
        .unwrap();
    assert_eq!(rows.len(), 1);
    assert_eq!(
        (
            rows[0].message_key.clone(),
            rows[0].aggregate_id.clone(),
            rows[0].sequence
        ),
        (format!("{g}/9"), Some(g.clone()), Some(9))
    );
    let shown = inbox
        .admin()
        .show("orders-park", &format!("{g}/9"))
        .await
        .unwrap()
        .unwrap();
    let payload: OrderEvent = serde_json::from_slice(&shown.payload.unwrap()).unwrap();
    assert_eq!(payload, event(&g, 9, "x"));
}

#[tokio::test]
async fn two_aggregates_are_ordered_independently() {
    let inbox = setup().await;
    let (a, b) = (fresh("a"), fresh("b"));
    let outcome = track_parked(&inbox, event(&a, 2, "paid")).await;
    assert_eq!(outcome.unwrap(), Outcome::Parked);
    for (seq, kind) in [(1, "placed"), (2, "paid"), (3, "packed")] {
        let outcome = track_parked(&inbox, event(&b, seq, kind)).await;
        assert_eq!(outcome.unwrap(), Outcome::Processed(()));
    }
    assert_eq!(history(&inbox, "orders-park", &a).await, None);
    assert_eq!(parked(&inbox).await, 1);
    let outcome = track_parked(&inbox, event(&a, 1, "placed")).await;
    assert_eq!(outcome.unwrap(), Outcome::Processed(()));
    assert_eq!(
        history(&inbox, "orders-park", &a).await.as_deref(),
        Some("placed,paid")
    );
    assert_eq!(
        history(&inbox, "orders-park", &b).await.as_deref(),
        Some("placed,paid,packed")
    );
    assert_eq!(parked(&inbox).await, 0);
}

/// A process that stopped between a message's commit and the release of its parked successors
/// (here: a dispatcher without a route to the successors' message, which cannot release them)
/// leaves them parked; the redelivery of that message, never acked, is a duplicate, and releases
/// them in order.
#[tokio::test]
async fn a_redelivered_predecessor_releases_successors_left_parked() {
    let inbox = setup().await;
    let full = DynamoDispatcher::from_registry(inbox.clone()).unwrap();
    let stopped =
        DynamoDispatcher::from_handlers(inbox.clone(), [handler!(resume_opened)]).unwrap();
    let outcome = |outcomes: Vec<dynamodb::DynamoConsumerOutcome>| {
        assert_eq!(outcomes.len(), 1);
        outcomes.into_iter().next().unwrap().result.unwrap()
    };
    let r = fresh("r");
    let opened = OrderOpened {
        event_id: format!("{r}/1"),
        order_id: r.clone(),
        seq: 1,
    };
    let note = |seq: i64| OrderNote {
        event_id: format!("{r}/{seq}"),
        order_id: r.clone(),
        seq,
    };
    for seq in [3, 2] {
        let dispatched = full.dispatch(&envelope(&note(seq))).await.unwrap();
        assert_eq!(outcome(dispatched), Outcome::Parked);
    }
    let dispatched = stopped.dispatch(&envelope(&opened)).await.unwrap();
    assert_eq!(outcome(dispatched), Outcome::Processed(()));
    assert_eq!(
        history(&inbox, "orders-resume", &r).await.as_deref(),
        Some("opened")
    );
    assert_eq!(parked(&inbox).await, 2);
    let dispatched = full.dispatch(&envelope(&opened)).await.unwrap();
    assert_eq!(outcome(dispatched), Outcome::Duplicate);
    assert_eq!(
        history(&inbox, "orders-resume", &r).await.as_deref(),
        Some("opened,note2,note3")
    );
    assert_eq!(parked(&inbox).await, 0);
    // The same through a direct call of the handler (routed through every linked handler).
    let s = fresh("s");
    let note = OrderNote {
        event_id: format!("{s}/2"),
        order_id: s.clone(),
        seq: 2,
    };
    assert_eq!(resume_note(&inbox, note).await.unwrap(), Outcome::Parked);
    let opened = OrderOpened {
        event_id: format!("{s}/1"),
        order_id: s.clone(),
        seq: 1,
    };
    let dispatched = stopped.dispatch(&envelope(&opened)).await.unwrap();
    assert_eq!(outcome(dispatched), Outcome::Processed(()));
    assert_eq!(parked(&inbox).await, 1);
    assert_eq!(
        resume_opened(&inbox, opened).await.unwrap(),
        Outcome::Duplicate
    );
    assert_eq!(
        history(&inbox, "orders-resume", &s).await.as_deref(),
        Some("opened,note2")
    );
    assert_eq!(parked(&inbox).await, 0);
}

/// A successor that fails when released stays (failed, with its pointer) and stops the release:
/// the rest stay parked. The redelivery of the message that started the release (never acked)
/// is a duplicate, and goes on from the aggregate's position: the failed one, then the rest.
#[tokio::test]
async fn a_release_stopped_midway_goes_on_from_the_position_on_a_duplicate() {
    let inbox = setup().await;
    let m = fresh("m");
    let note = |seq: i64| OrderNote {
        event_id: format!("{m}/{seq}"),
        order_id: m.clone(),
        seq,
    };
    for seq in [4, 3, 2] {
        assert_eq!(
            resume_note(&inbox, note(seq)).await.unwrap(),
            Outcome::Parked
        );
    }
    FAIL_ONCE.lock().unwrap().push(format!("{m}/3"));
    let opened = OrderOpened {
        event_id: format!("{m}/1"),
        order_id: m.clone(),
        seq: 1,
    };
    let outcome = resume_opened(&inbox, opened.clone()).await.unwrap();
    assert_eq!(outcome, Outcome::Processed(()));
    assert_eq!(
        history(&inbox, "orders-resume", &m).await.as_deref(),
        Some("opened,note2")
    );
    let row = inbox
        .admin()
        .show("orders-resume", &format!("{m}/3"))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(
        (row.status, row.attempts, row.last_error.as_deref()),
        (Status::Failed, 2, Some("boom"))
    );
    assert_eq!(parked(&inbox).await, 1);
    let outcome = resume_opened(&inbox, opened).await.unwrap();
    assert_eq!(outcome, Outcome::Duplicate);
    assert_eq!(
        history(&inbox, "orders-resume", &m).await.as_deref(),
        Some("opened,note2,note3,note4")
    );
    assert_eq!(parked(&inbox).await, 0);
    assert_eq!(
        status(&inbox, "orders-resume", &format!("{m}/3")).await,
        Some(Status::Processed)
    );
}

#[tokio::test]
async fn a_gap_left_open_is_dead_lettered_or_released_by_policy() {
    let inbox = setup().await;
    let dispatcher = DynamoDispatcher::from_registry(inbox.clone()).unwrap();
    let (t1, t2, t3) = (fresh("t1"), fresh("t2"), fresh("t3"));
    for e in [
        event(&t1, 2, "paid"),
        event(&t2, 2, "paid"),
        event(&t2, 3, "packed"),
    ] {
        let outcomes = dispatcher.dispatch(&envelope(&e)).await.unwrap();
        assert_eq!(of(&outcomes, "orders-park"), Outcome::Parked);
    }
    // Not yet expired (the default policy: 1 h): nothing happens.
    let report = dispatcher.sweep_parked().await.unwrap();
    assert_eq!((report.released, report.dead_lettered), (0, 0));
    let stats = inbox.admin().stats().await.unwrap();
    assert!(
        stats
            .iter()
            .any(|s| s.consumer.as_deref() == Some("orders-park")
                && s.status.as_str() == "parked"
                && s.count == 3),
        "{stats:?}"
    );
    // A timeout no parked message reaches (`Duration::MAX`: never) sweeps nothing.
    for on_timeout in [ParkTimeout::DeadLetter, ParkTimeout::Release] {
        let never = DynamoDispatcher::from_registry(inbox.clone())
            .unwrap()
            .with_park_policy(ParkPolicy::new(Duration::MAX, on_timeout));
        let report = never.sweep_parked().await.unwrap();
        assert_eq!(
            (report.released, report.dead_lettered),
            (0, 0),
            "{report:?}"
        );
    }
    assert_eq!(parked(&inbox).await, 3);

    // A zero timeout: every parked message received until now is due.
    let release = DynamoDispatcher::from_registry(inbox.clone())
        .unwrap()
        .with_park_policy(ParkPolicy::new(Duration::ZERO, ParkTimeout::Release));
    let dead = DynamoDispatcher::from_registry(inbox.clone())
        .unwrap()
        .with_park_policy(ParkPolicy::new(Duration::ZERO, ParkTimeout::DeadLetter));
    // t1/2 and t2/2 are released over their gaps; t2/3 then follows t2/2 in order.
    let report = release.sweep_parked().await.unwrap();
    assert_eq!(
        (report.released, report.dead_lettered),
        (2, 0),
        "{report:?}"
    );
    assert_eq!(
        (
            history(&inbox, "orders-park", &t1).await,
            history(&inbox, "orders-park", &t2).await
        ),
        (Some("paid".to_owned()), Some("paid,packed".to_owned()))
    );
    assert_eq!(parked(&inbox).await, 0);
    // A late predecessor of a released message is stale.
    let late = dispatcher
        .dispatch(&envelope(&event(&t1, 1, "placed")))
        .await
        .unwrap();
    assert_eq!(of(&late, "orders-park"), Outcome::Stale);
    // Dead-lettering: a fresh gap, swept with the dead-letter policy.
    let outcomes = dispatcher
        .dispatch(&envelope(&event(&t3, 5, "delivered")))
        .await
        .unwrap();
    assert_eq!(of(&outcomes, "orders-park"), Outcome::Parked);
    let report = dead.sweep_parked().await.unwrap();
    assert_eq!(
        (report.released, report.dead_lettered),
        (0, 1),
        "{report:?}"
    );
    let row = inbox
        .admin()
        .show("orders-park", &format!("{t3}/5"))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(row.status, Status::Dead);
    let reason = format!("parked for more than 0 s waiting for sequence 4 of aggregate `{t3}`");
    assert_eq!(row.last_error.as_deref(), Some(reason.as_str()));
    assert!(row.payload.is_some());
    // A dead letter is listed as one, and its pointer is gone: 4 arriving releases nothing.
    let dead_letters = inbox
        .admin()
        .list(Some("orders-park"), &[Status::Dead], 10)
        .await
        .unwrap();
    assert_eq!(dead_letters.len(), 1);
    let outcomes = dispatcher
        .dispatch(&envelope(&event(&t3, 4, "shipped")))
        .await
        .unwrap();
    assert_eq!(of(&outcomes, "orders-park"), Outcome::Parked);
    assert_eq!(
        dispatcher
            .dispatch(&envelope(&event(&t3, 5, "delivered")))
            .await
            .unwrap()
            .iter()
            .find(|o| o.consumer == "orders-park")
            .unwrap()
            .result
            .as_ref()
            .unwrap(),
        &Outcome::Dead
    );
}

/// 8 tasks deliver 20 aggregates × 10 events, each twice, in a shuffled order, through the
/// dispatcher (both consumers): every aggregate ends with its effects applied once each, in
/// order (`park`), or once each in increasing order ending at 10 (`apply`); nothing parked.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn eight_tasks_on_twenty_aggregates_end_in_order() {
    use rand::SeedableRng;
    use rand::seq::SliceRandom;
    let inbox = setup().await;
    let dispatcher = Arc::new(DynamoDispatcher::from_registry(inbox.clone()).unwrap());
    let prefix = fresh("storm");
    let orders: Vec<String> = (0..20).map(|a| format!("{prefix}-{a}")).collect();
    let mut events = Vec::new();
    for order in &orders {
        for seq in 1..=10 {
            let e = event(order, seq, &seq.to_string());
            events.push(e.clone());
            events.push(e);
        }
    }
    events.shuffle(&mut rand_chacha::ChaCha8Rng::seed_from_u64(35));
    let queue = Arc::new(std::sync::Mutex::new(events));
    let mut tasks = Vec::new();
    for _ in 0..8 {
        let queue = queue.clone();
        let dispatcher = dispatcher.clone();
        tasks.push(tokio::spawn(async move {
            loop {
                let Some(e) = queue.lock().unwrap().pop() else {
                    break;
                };
                // A broker redelivers what did not settle: contention, a transient error.
                let mut tries = 0;
                loop {
                    tries += 1;
                    let outcomes = dispatcher.dispatch(&envelope(&e)).await.unwrap();
                    let failed: Vec<String> = outcomes
                        .iter()
                        .filter_map(|o| o.result.as_ref().err().map(ToString::to_string))
                        .collect();
                    if failed.is_empty() {
                        break;
                    }
                    assert!(tries < 10, "{failed:?}");
                }
            }
        }));
    }
    for task in tasks {
        task.await.unwrap();
    }
    let in_order = (1..=10)
        .map(|n| n.to_string())
        .collect::<Vec<_>>()
        .join(",");
    for order in &orders {
        assert_eq!(
            history(&inbox, "orders-park", order).await.as_deref(),
            Some(in_order.as_str()),
            "{order}"
        );
        let applied = history(&inbox, "orders-apply", order).await.unwrap();
        let applied: Vec<i64> = applied.split(',').map(|n| n.parse().unwrap()).collect();
        assert!(
            applied.windows(2).all(|w| w[0] < w[1]) && applied.last() == Some(&10),
            "{order}: {applied:?}"
        );
    }
    assert_eq!(parked(&inbox).await, 0);
    // Every key settled once: 200 processed for `park`; `apply`'s processed and stale make 200.
    let stats = inbox.admin().stats().await.unwrap();
    let count = |consumer: &str, status: &str| {
        stats
            .iter()
            .find(|s| s.consumer.as_deref() == Some(consumer) && s.status.as_str() == status)
            .map_or(0, |s| s.count)
    };
    assert_eq!(count("orders-park", "processed"), 200);
    assert_eq!(
        count("orders-apply", "processed") + count("orders-apply", "stale"),
        200
    );
}

/// The worker acks parked deliveries (3, 2 before 1, one ordering key), and the applied ones;
/// the effects come in order.
#[tokio::test]
async fn the_worker_acks_parked_messages_and_applies_them_in_order() {
    let inbox = setup().await;
    let dispatcher = DynamoDispatcher::from_registry(inbox.clone()).unwrap();
    let w = fresh("w");
    let source = MemorySource::new("mem");
    let handle = source.handle();
    let ids: Vec<u64> = [(3, "packed"), (2, "paid"), (1, "placed")]
        .iter()
        .map(|(seq, kind)| handle.push_keyed(envelope(&event(&w, *seq, kind)), w.clone()))
        .collect();
    handle.close();
    let report = DynamoWorker::new(dispatcher)
        .park_sweep(None)
        .run(source, CancellationToken::new())
        .await
        .unwrap();
    // orders-park parked 3 and 2, applied 1 (and with it 2 and 3); orders-apply applied 3 and
    // found 2 and 1 stale: every delivery is acked.
    assert_eq!(
        (
            report.deliveries,
            report.parked,
            report.stale,
            report.processed,
            report.acked
        ),
        (3, 2, 2, 2, 3),
        "{report:?}"
    );
    let acked: Vec<(u64, Settlement)> = ids.iter().map(|id| (*id, Settlement::Ack)).collect();
    assert_eq!(handle.settlements(), acked);
    assert_eq!(
        history(&inbox, "orders-park", &w).await.as_deref(),
        Some("placed,paid,packed")
    );
    assert_eq!(
        history(&inbox, "orders-apply", &w).await.as_deref(),
        Some("packed")
    );
}

/// tests/ordering.rs's worker case: a parked delivery is acked, and the periodic sweep
/// dead-letters it once its (zero) timeout has passed, while the worker runs. The worker is
/// stopped once the sweep did it (at most 30 s: the serial moto is shared by every DynamoDB
/// test binary, so a sweep's duration is not bounded by a fixed idle time).
#[tokio::test]
async fn the_worker_sweeps_expired_parked_messages() {
    let inbox = setup().await;
    let dispatcher = DynamoDispatcher::from_registry(inbox.clone())
        .unwrap()
        .with_park_policy(ParkPolicy::new(Duration::ZERO, ParkTimeout::DeadLetter));
    let x = fresh("x");
    let key = format!("{x}/2");
    let source = MemorySource::new("mem");
    let handle = source.handle();
    let id = handle.push(envelope(&event(&x, 2, "paid")));
    let shutdown = CancellationToken::new();
    let worker = DynamoWorker::new(dispatcher).park_sweep(Some(Duration::from_millis(50)));
    let running = tokio::spawn({
        let shutdown = shutdown.clone();
        async move { worker.run(source, shutdown).await }
    });
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    while status(&inbox, "orders-park", &key).await != Some(Status::Dead) {
        assert!(
            std::time::Instant::now() < deadline,
            "not dead-lettered by the sweep within 30 s: {:?}",
            status(&inbox, "orders-park", &key).await
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    shutdown.cancel();
    let report = running.await.unwrap().unwrap();
    // orders-park parked it, orders-apply applied it: the delivery is acked.
    assert_eq!(
        (report.parked, report.processed, report.acked),
        (1, 1, 1),
        "{report:?}"
    );
    assert_eq!(handle.settlements(), [(id, Settlement::Ack)]);
    assert_eq!(
        status(&inbox, "orders-park", &key).await,
        Some(Status::Dead)
    );
}

/// Envelopes of an unknown shape are refused before any call, ordered or not.
#[tokio::test]
async fn an_ordered_message_with_a_bad_sequence_is_refused_before_any_call() {
    let inbox = setup().await;
    let dispatcher = DynamoDispatcher::from_registry(inbox.clone()).unwrap();
    let payload = br#"{"event_id":"z/0","order_id":"z","seq":0,"kind":"none"}"#;
    let (n, result) = calls(
        &inbox,
        dispatcher.dispatch(&Envelope::new("dyn.order.event", payload.to_vec())),
    )
    .await;
    assert_eq!(n, 0);
    let refused = result.unwrap_err();
    assert!(
        matches!(
            &refused,
            inbox_runtime::DispatchError::Key {
                source: inbox_runtime::KeyError::Invalid { field: "seq", .. },
                ..
            }
        ),
        "{refused:?}"
    );
}
