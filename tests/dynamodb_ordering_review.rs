//! An adversarial review of per-aggregate ordering on DynamoDB (`inbox_runtime::dynamodb::ordering`)
//! against moto's serial DynamoDB (`DYNAMODB_ENDPOINT`): attempts to lose a message, apply an
//! effect twice or out of order, or leave one parked for ever — one aggregate hammered by many
//! tasks, the sweep's order of release, a failed release, a conflicting redelivery of a parked
//! key, ids that could collide in the position's and pointer's keys, sequence bounds, the admin
//! on the ordering items, and the transaction's action limit with the guard.
//!
//! Each test has an inbox table of its own and orders of its own (fresh ids) in one orders table
//! shared by the binary: a handler appends its event's kind to the order's `history` list, so the
//! list is the order in which the effects committed.

use std::sync::Arc;
use std::time::Duration;

use inbox_runtime::dynamodb::sdk::types::{AttributeValue, Update};
use inbox_runtime::dynamodb::{DynamoDispatcher, DynamoInbox, DynamoTx};
use inbox_runtime::types::{ParkPolicy, ParkTimeout, Status};
use inbox_runtime::{DispatchError, KeyError, Message, Outcome, idempotent};
use inbox_tests::dynamo::{TestError, status};
use inbox_tests::envelope;
use serde::{Deserialize, Serialize};

/// One event of an order's lifecycle; `kind` `boom` fails once (retryable), `fatal` fails
/// (permanent) while its id is in [`FATAL`].
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, Message)]
#[message(name = "rv.order.event")]
struct RvEvent {
    #[message(key)]
    event_id: String,
    #[message(aggregate)]
    order_id: String,
    #[message(sequence)]
    seq: i64,
    kind: String,
    /// How many effects (items of the orders table) the handler writes besides the history.
    #[serde(default)]
    extra: usize,
}

fn event(order: &str, seq: i64, kind: &str) -> RvEvent {
    RvEvent {
        event_id: format!("{order}/{seq}"),
        order_id: order.to_owned(),
        seq,
        kind: kind.to_owned(),
        extra: 0,
    }
}

/// The orders table of this binary (`id` string key), made once.
static ORDERS: tokio::sync::OnceCell<String> = tokio::sync::OnceCell::const_new();

/// `<consumer>:<event id>`s whose next run fails (retryable), once each.
static FAIL_ONCE: std::sync::Mutex<Vec<String>> = std::sync::Mutex::new(Vec::new());
/// `<consumer>:<event id>`s whose runs fail (permanent) while listed.
static FATAL: std::sync::Mutex<Vec<String>> = std::sync::Mutex::new(Vec::new());

fn append(tx: &mut DynamoTx, id: String, kind: &str) -> Result<(), TestError> {
    let table = ORDERS.get().expect("setup made the orders table");
    tx.update(
        Update::builder()
            .table_name(table)
            .key("id", AttributeValue::S(id))
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

async fn effects(tx: &mut DynamoTx, consumer: &str, msg: &RvEvent) -> Result<(), TestError> {
    {
        let mut failing = FAIL_ONCE.lock().unwrap();
        let id = format!("{consumer}:{}", msg.event_id);
        if let Some(at) = failing.iter().position(|failing| *failing == id) {
            failing.remove(at);
            return Err(TestError::Boom);
        }
    }
    if FATAL
        .lock()
        .unwrap()
        .contains(&format!("{consumer}:{}", msg.event_id))
    {
        return Err(TestError::Fatal);
    }
    append(tx, format!("{consumer}:{}", msg.order_id), &msg.kind)?;
    for i in 0..msg.extra {
        append(tx, format!("{consumer}:{}:x{i}", msg.order_id), &msg.kind)?;
    }
    Ok(())
}

#[idempotent(consumer = "rv-park", gaps = "park")]
async fn rv_parked(tx: &mut DynamoTx, msg: RvEvent) -> Result<(), TestError> {
    effects(tx, "rv-park", &msg).await
}

#[idempotent(consumer = "rv-apply")]
async fn rv_newest(tx: &mut DynamoTx, msg: RvEvent) -> Result<(), TestError> {
    effects(tx, "rv-apply", &msg).await
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

/// The history of `id` in the orders table, comma-joined; `None` if nothing was applied.
async fn history_of(inbox: &DynamoInbox, id: &str) -> Option<String> {
    inbox_tests::dynamo::history(inbox, ORDERS.get().unwrap(), id).await
}

async fn history(inbox: &DynamoInbox, consumer: &str, order: &str) -> Option<String> {
    history_of(inbox, &format!("{consumer}:{order}")).await
}

/// The result of `consumer` in a dispatch of `e`.
async fn result_of(
    dispatcher: &DynamoDispatcher,
    e: &RvEvent,
    consumer: &str,
) -> Result<Outcome<()>, String> {
    let outcomes = dispatcher.dispatch(&envelope(e)).await.unwrap();
    let outcome = outcomes
        .into_iter()
        .find(|o| o.consumer == consumer)
        .unwrap();
    outcome.result.map_err(|e| format!("{e:?}"))
}

/// The `rv-park` result of a dispatch.
async fn park(dispatcher: &DynamoDispatcher, e: &RvEvent) -> Result<Outcome<()>, String> {
    result_of(dispatcher, e, "rv-park").await
}

/// The `rv-apply` result of a dispatch.
async fn apply(dispatcher: &DynamoDispatcher, e: &RvEvent) -> Result<Outcome<()>, String> {
    result_of(dispatcher, e, "rv-apply").await
}

/// Every item of the inbox table (a consistent scan), as (pk, item).
async fn all_items(
    inbox: &DynamoInbox,
) -> Vec<(String, std::collections::HashMap<String, AttributeValue>)> {
    let mut items = Vec::new();
    let mut start = None;
    loop {
        let page = inbox
            .client()
            .scan()
            .table_name(inbox.table())
            .consistent_read(true)
            .set_exclusive_start_key(start.take())
            .send()
            .await
            .unwrap();
        for item in page.items() {
            let pk = item.get("pk").unwrap().as_s().unwrap().clone();
            items.push((pk, item.clone()));
        }
        match page.last_evaluated_key {
            Some(key) if !key.is_empty() => start = Some(key),
            _ => break,
        }
    }
    items.sort_by(|a, b| a.0.cmp(&b.0));
    items
}

/// The pointers (`park:…`) of the inbox table.
async fn pointers(inbox: &DynamoInbox) -> Vec<String> {
    all_items(inbox)
        .await
        .into_iter()
        .map(|(pk, _)| pk)
        .filter(|pk| pk.starts_with("park:"))
        .collect()
}

/// One aggregate, eight sequences, each delivered three times, shuffled, from eight tasks at
/// once, over three rounds (fresh aggregates): each effect once and in order, nothing parked,
/// no pointer left behind.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn one_hot_aggregate_from_eight_tasks_applies_each_effect_once_in_order() {
    use rand::SeedableRng;
    use rand::seq::SliceRandom;
    let inbox = setup().await;
    let dispatcher = Arc::new(DynamoDispatcher::from_registry(inbox.clone()).unwrap());
    for round in 0..3u64 {
        let order = fresh("hot");
        let mut events = Vec::new();
        for seq in 1..=8 {
            for _ in 0..3 {
                events.push(event(&order, seq, &seq.to_string()));
            }
        }
        events.shuffle(&mut rand_chacha::ChaCha8Rng::seed_from_u64(round));
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
                        assert!(tries < 20, "{failed:?}");
                    }
                }
            }));
        }
        for task in tasks {
            task.await.unwrap();
        }
        assert_eq!(
            history(&inbox, "rv-park", &order).await.as_deref(),
            Some("1,2,3,4,5,6,7,8"),
            "round {round}"
        );
        let applied = history(&inbox, "rv-apply", &order).await.unwrap();
        let applied: Vec<i64> = applied.split(',').map(|n| n.parse().unwrap()).collect();
        assert!(
            applied.windows(2).all(|w| w[0] < w[1]) && applied.last() == Some(&8),
            "{applied:?}"
        );
    }
    assert_eq!(pointers(&inbox).await, Vec::<String>::new());
    let parked = inbox
        .admin()
        .list(None, &[Status::Parked], 100)
        .await
        .unwrap();
    assert_eq!(parked.len(), 0);
}

/// The sweep releases an aggregate's expired parked messages in sequence order, as the SQL
/// stores' sweep does (`ORDER BY consumer, aggregate_id, sequence`): 3 parked before 2 (so 3 is
/// the older in the dead-letter index), both past the timeout, the gap at 1 never filled. 2 is
/// released over the gap and 3 follows it; neither is skipped as stale.
#[tokio::test]
async fn the_sweep_releases_parked_messages_in_sequence_order_not_arrival_order() {
    let inbox = setup().await;
    let dispatcher = DynamoDispatcher::from_registry(inbox.clone()).unwrap();
    let order = fresh("sw");
    for seq in [4, 3, 2] {
        assert_eq!(
            park(&dispatcher, &event(&order, seq, &seq.to_string())).await,
            Ok(Outcome::Parked)
        );
    }
    let release = DynamoDispatcher::from_registry(inbox.clone())
        .unwrap()
        .with_park_policy(ParkPolicy::new(Duration::ZERO, ParkTimeout::Release));
    let report = release.sweep_parked().await.unwrap();
    assert_eq!(
        (report.released, report.dead_lettered),
        (1, 0),
        "{report:?}"
    );
    assert_eq!(
        history(&inbox, "rv-park", &order).await.as_deref(),
        Some("2,3,4")
    );
    for seq in [2, 3, 4] {
        assert_eq!(
            status(&inbox, "rv-park", &format!("{order}/{seq}")).await,
            Some(Status::Processed),
            "{seq}"
        );
    }
    assert_eq!(pointers(&inbox).await, Vec::<String>::new());
    // The missing predecessor, arriving late, is stale.
    assert_eq!(
        park(&dispatcher, &event(&order, 1, "1")).await,
        Ok(Outcome::Stale)
    );
    assert_eq!(
        history(&inbox, "rv-park", &order).await.as_deref(),
        Some("2,3,4")
    );
}

/// A parked key redelivered with another payload is a conflict; the parked payload is the one
/// released, once.
#[tokio::test]
async fn a_parked_key_redelivered_with_another_payload_is_a_conflict() {
    let inbox = setup().await;
    let dispatcher = DynamoDispatcher::from_registry(inbox.clone()).unwrap();
    let order = fresh("cf");
    assert_eq!(
        park(&dispatcher, &event(&order, 2, "first")).await,
        Ok(Outcome::Parked)
    );
    let result = park(&dispatcher, &event(&order, 2, "second")).await;
    assert!(
        result.as_ref().is_err_and(|e| e.starts_with("Conflict")),
        "{result:?}"
    );
    assert_eq!(
        park(&dispatcher, &event(&order, 2, "first")).await,
        Ok(Outcome::Parked)
    );
    assert_eq!(
        park(&dispatcher, &event(&order, 1, "one")).await,
        Ok(Outcome::Processed(()))
    );
    assert_eq!(
        history(&inbox, "rv-park", &order).await.as_deref(),
        Some("one,first")
    );
    assert_eq!(pointers(&inbox).await, Vec::<String>::new());
}

/// A parked successor whose handler fails for good when released is dead (payload kept, in the
/// dead-letter listing), its successors stay parked, nothing is applied out of order; the
/// replay of the dead one applies it and releases the rest in order.
#[tokio::test]
async fn a_released_successor_that_fails_for_good_is_dead_and_its_replay_releases_the_rest() {
    let inbox = setup().await;
    let dispatcher = DynamoDispatcher::from_registry(inbox.clone()).unwrap();
    let order = fresh("pf");
    for seq in [3, 2] {
        assert_eq!(
            park(&dispatcher, &event(&order, seq, &seq.to_string())).await,
            Ok(Outcome::Parked)
        );
    }
    FATAL.lock().unwrap().push(format!("rv-park:{order}/2"));
    assert_eq!(
        park(&dispatcher, &event(&order, 1, "1")).await,
        Ok(Outcome::Processed(()))
    );
    assert_eq!(
        history(&inbox, "rv-park", &order).await.as_deref(),
        Some("1")
    );
    let row = inbox
        .admin()
        .show("rv-park", &format!("{order}/2"))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(
        (row.status, row.attempts, row.last_error.as_deref()),
        // The park was its first attempt, the release its second.
        (Status::Dead, 2, Some("fatal"))
    );
    assert!(row.payload.is_some());
    assert_eq!(
        status(&inbox, "rv-park", &format!("{order}/3")).await,
        Some(Status::Parked)
    );
    let dead = inbox
        .admin()
        .list(Some("rv-park"), &[Status::Dead], 10)
        .await
        .unwrap();
    assert_eq!(dead.len(), 1);
    // The redelivery of 3 (parked) runs nothing; of 1 (a duplicate) does not apply 3 over 2.
    assert_eq!(
        park(&dispatcher, &event(&order, 3, "3")).await,
        Ok(Outcome::Parked)
    );
    assert_eq!(
        park(&dispatcher, &event(&order, 1, "1")).await,
        Ok(Outcome::Duplicate)
    );
    assert_eq!(
        history(&inbox, "rv-park", &order).await.as_deref(),
        Some("1")
    );
    FATAL
        .lock()
        .unwrap()
        .retain(|id| *id != format!("rv-park:{order}/2"));
    let replayed = dispatcher
        .replay("rv-park", &format!("{order}/2"))
        .await
        .unwrap();
    assert_eq!(replayed.result.unwrap(), Outcome::Processed(()));
    assert_eq!(
        history(&inbox, "rv-park", &order).await.as_deref(),
        Some("1,2,3")
    );
    assert_eq!(pointers(&inbox).await, Vec::<String>::new());
}

/// The sweep's dead-letter policy races a release: the parked message is either released (and
/// applied once) or dead-lettered (not applied), never both; its pointer is gone either way.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_sweep_racing_a_release_settles_each_parked_message_once() {
    let inbox = setup().await;
    let dispatcher = Arc::new(DynamoDispatcher::from_registry(inbox.clone()).unwrap());
    let dead = Arc::new(
        DynamoDispatcher::from_registry(inbox.clone())
            .unwrap()
            .with_park_policy(ParkPolicy::new(Duration::ZERO, ParkTimeout::DeadLetter)),
    );
    let orders: Vec<String> = (0..6).map(|_| fresh("race")).collect();
    for order in &orders {
        assert_eq!(
            park(&dispatcher, &event(order, 2, "2")).await,
            Ok(Outcome::Parked)
        );
    }
    let sweeping = tokio::spawn({
        let dead = dead.clone();
        async move { dead.sweep_parked().await.unwrap() }
    });
    let mut releases = Vec::new();
    for order in orders.clone() {
        let dispatcher = dispatcher.clone();
        releases.push(tokio::spawn(async move {
            park(&dispatcher, &event(&order, 1, "1")).await
        }));
    }
    for release in releases {
        assert_eq!(release.await.unwrap(), Ok(Outcome::Processed(())));
    }
    let report = sweeping.await.unwrap();
    let mut dead_count = 0;
    for order in &orders {
        let applied = history(&inbox, "rv-park", order).await.unwrap();
        match status(&inbox, "rv-park", &format!("{order}/2")).await {
            Some(Status::Processed) => assert_eq!(applied, "1,2"),
            Some(Status::Dead) => {
                dead_count += 1;
                assert_eq!(applied, "1");
            }
            other => panic!("{order}: {other:?}"),
        }
    }
    assert_eq!(report.dead_lettered, dead_count);
    assert_eq!(pointers(&inbox).await, Vec::<String>::new());
}

/// Aggregate ids and sequences chosen so that a naive concatenation would collide: aggregate
/// `o1` at 2 and `o` at 12, ids with `:` and digits, `pos:`/`park:` look-alike keys. Each
/// aggregate is parked and released on its own.
#[tokio::test]
async fn ids_that_look_alike_in_the_keys_do_not_collide() {
    let inbox = setup().await;
    let dispatcher = DynamoDispatcher::from_registry(inbox.clone()).unwrap();
    let base = fresh("k");
    let a = format!("{base}o1");
    let b = format!("{base}o");
    let c = format!("{base}:3:x");
    let d = format!("{base}:3");
    // a@2 and b@12 would both be `…o12` without the aggregate's length.
    assert_eq!(
        park(&dispatcher, &event(&a, 2, "a2")).await,
        Ok(Outcome::Parked)
    );
    assert_eq!(
        park(&dispatcher, &event(&b, 12, "b12")).await,
        Ok(Outcome::Parked)
    );
    assert_eq!(
        park(&dispatcher, &event(&c, 2, "c2")).await,
        Ok(Outcome::Parked)
    );
    assert_eq!(
        park(&dispatcher, &event(&d, 2, "d2")).await,
        Ok(Outcome::Parked)
    );
    assert_eq!(pointers(&inbox).await.len(), 4);
    assert_eq!(
        park(&dispatcher, &event(&a, 1, "a1")).await,
        Ok(Outcome::Processed(()))
    );
    assert_eq!(
        history(&inbox, "rv-park", &a).await.as_deref(),
        Some("a1,a2")
    );
    assert_eq!(history(&inbox, "rv-park", &b).await, None);
    assert_eq!(
        status(&inbox, "rv-park", &format!("{b}/12")).await,
        Some(Status::Parked)
    );
    assert_eq!(
        park(&dispatcher, &event(&d, 1, "d1")).await,
        Ok(Outcome::Processed(()))
    );
    assert_eq!(
        history(&inbox, "rv-park", &d).await.as_deref(),
        Some("d1,d2")
    );
    assert_eq!(history(&inbox, "rv-park", &c).await, None);
    assert_eq!(
        park(&dispatcher, &event(&c, 1, "c1")).await,
        Ok(Outcome::Processed(()))
    );
    assert_eq!(
        history(&inbox, "rv-park", &c).await.as_deref(),
        Some("c1,c2")
    );
    // Positions are per consumer and aggregate: `rv-apply` saw each once too.
    let positions: Vec<String> = all_items(&inbox)
        .await
        .into_iter()
        .map(|(pk, _)| pk)
        .filter(|pk| pk.starts_with("pos:"))
        .collect();
    // rv-park: a, c, d (b has none yet); rv-apply: a, b, c, d.
    assert_eq!(positions.len(), 7, "{positions:?}");
    assert_eq!(pointers(&inbox).await.len(), 1);
}

/// An aggregate id too long for the position's or the pointer's partition key is refused with
/// `PartitionKeyTooLong` before anything is written (no inbox item, no effect); the longest that
/// fits is ordered as any other.
#[tokio::test]
async fn an_aggregate_id_too_long_for_the_keys_is_refused_and_writes_nothing() {
    let inbox = setup().await;
    let dispatcher = DynamoDispatcher::from_registry(inbox.clone()).unwrap();
    let order = "a".repeat(2100);
    let mut e = event(&order, 1, "1");
    e.event_id = fresh("long");
    let result = park(&dispatcher, &e).await;
    assert!(
        result
            .as_ref()
            .is_err_and(|e| e.starts_with("PartitionKeyTooLong")),
        "{result:?}"
    );
    assert!(all_items(&inbox).await.is_empty());
    // `park:7:rv-park` + `<len>:` + aggregate + sequence: 2048 bytes with a 1-digit sequence.
    let fits = "b".repeat(2048 - "park:7:rv-park".len() - "2028:".len() - 1);
    assert_eq!(fits.len(), 2028);
    let mut e = event(&fits, 2, "2");
    e.event_id = fresh("fit2");
    assert_eq!(park(&dispatcher, &e).await, Ok(Outcome::Parked));
    let mut e = event(&fits, 1, "1");
    e.event_id = fresh("fit1");
    assert_eq!(park(&dispatcher, &e).await, Ok(Outcome::Processed(())));
    assert_eq!(
        history_of(&inbox, &format!("rv-park:{fits}"))
            .await
            .as_deref(),
        Some("1,2")
    );
}

/// Sequence `i64::MAX`: parked, released by the sweep (no successor after it: the release stops
/// without overflowing), and a later lower sequence is stale; sequence 0 and negatives are
/// refused before any write.
#[tokio::test]
async fn the_largest_sequence_parks_releases_and_stops() {
    let inbox = setup().await;
    let dispatcher = DynamoDispatcher::from_registry(inbox.clone()).unwrap();
    let order = fresh("max");
    assert_eq!(
        park(&dispatcher, &event(&order, i64::MAX, "max")).await,
        Ok(Outcome::Parked)
    );
    let release = DynamoDispatcher::from_registry(inbox.clone())
        .unwrap()
        .with_park_policy(ParkPolicy::new(Duration::ZERO, ParkTimeout::Release));
    let report = release.sweep_parked().await.unwrap();
    assert_eq!((report.released, report.dead_lettered), (1, 0));
    assert_eq!(
        history(&inbox, "rv-park", &order).await.as_deref(),
        Some("max")
    );
    assert_eq!(
        park(&dispatcher, &event(&order, i64::MAX - 1, "late")).await,
        Ok(Outcome::Stale)
    );
    // Redelivered: a duplicate, which reads the position and looks for nothing past it.
    assert_eq!(
        park(&dispatcher, &event(&order, i64::MAX, "max")).await,
        Ok(Outcome::Duplicate)
    );
    assert_eq!(
        apply(&dispatcher, &event(&order, i64::MAX, "max")).await,
        Ok(Outcome::Duplicate)
    );
    // A sequence below 1 is a key error before any call (the dispatcher reads every consumer's
    // ordering first, as on SQL): the first consumer in name order is named, nothing is stored.
    for seq in [0, -1, i64::MIN] {
        let e = event(&fresh("bad"), seq, "bad");
        let refused = dispatcher.dispatch(&envelope(&e)).await.unwrap_err();
        assert!(
            matches!(
                &refused,
                DispatchError::Key {
                    consumer: "rv-apply",
                    source: KeyError::Invalid { .. }
                }
            ),
            "{refused:?}"
        );
        assert_eq!(status(&inbox, "rv-park", &e.event_id).await, None);
    }
    assert_eq!(
        history(&inbox, "rv-park", &order).await.as_deref(),
        Some("max")
    );
}

/// The admin on a table holding positions, pointers, parked, stale and dead ordered items:
/// `stats` counts inbox items only, `list` of each status and `show` read them, the dead-letter
/// listing (failed and dead) shows no parked item, discarding a parked item is refused (it is
/// not a dead letter), and a replay of a parked key through the dispatcher runs nothing; the
/// replay of the dead predecessor releases the parked ones in order. (Each dispatch runs both
/// consumers: `rv-park` parks, `rv-apply` applies the newest.)
#[tokio::test]
async fn the_admin_reads_ordering_items_as_they_are() {
    let inbox = setup().await;
    let dispatcher = DynamoDispatcher::from_registry(inbox.clone()).unwrap();
    let order = fresh("adm");
    let key = |seq: i64| format!("{order}/{seq}");
    // rv-park: 3 and 5 parked; rv-apply: both processed.
    assert_eq!(
        park(&dispatcher, &event(&order, 3, "3")).await,
        Ok(Outcome::Parked)
    );
    assert_eq!(
        park(&dispatcher, &event(&order, 5, "5")).await,
        Ok(Outcome::Parked)
    );
    // 1 fails for good on both: dead.
    FATAL.lock().unwrap().push(format!("rv-park:{}", key(1)));
    FATAL.lock().unwrap().push(format!("rv-apply:{}", key(1)));
    let outcomes = dispatcher
        .dispatch(&envelope(&event(&order, 1, "1")))
        .await
        .unwrap();
    assert!(outcomes.iter().all(|o| o.result.is_err()), "{outcomes:?}");
    FATAL.lock().unwrap().clear();
    // rv-apply: 2 is stale (5 applied); rv-park: 2 parked (1 is dead).
    assert_eq!(
        apply(&dispatcher, &event(&order, 2, "2")).await,
        Ok(Outcome::Stale)
    );
    assert_eq!(
        status(&inbox, "rv-park", &key(2)).await,
        Some(Status::Parked)
    );
    let stats = inbox.admin().stats().await.unwrap();
    let count = |consumer: &str, status: &str| {
        stats
            .iter()
            .find(|s| s.consumer.as_deref() == Some(consumer) && s.status.as_str() == status)
            .map_or(0, |s| s.count)
    };
    assert_eq!(
        (
            count("rv-park", "parked"),
            count("rv-park", "dead"),
            count("rv-apply", "processed"),
            count("rv-apply", "stale"),
            count("rv-apply", "dead"),
        ),
        (3, 1, 2, 1, 1),
        "{stats:?}"
    );
    // 8 inbox items; rv-apply's position (rv-park has applied nothing) and rv-park's 3
    // pointers are not counted.
    let total: i64 = stats.iter().map(|s| s.count).sum();
    assert_eq!(total, 8, "{stats:?}");
    assert_eq!(all_items(&inbox).await.len(), 12);
    let parked = inbox
        .admin()
        .list(Some("rv-park"), &[Status::Parked], 10)
        .await
        .unwrap();
    let mut places: Vec<(String, i64)> = parked
        .iter()
        .map(|row| (row.aggregate_id.clone().unwrap(), row.sequence.unwrap()))
        .collect();
    places.sort();
    assert_eq!(
        places,
        vec![(order.clone(), 2), (order.clone(), 3), (order.clone(), 5)]
    );
    let stale = inbox
        .admin()
        .list(None, &[Status::Stale], 10)
        .await
        .unwrap();
    assert_eq!(
        stale
            .iter()
            .map(|row| (row.consumer.as_str(), row.message_key.clone(), row.sequence))
            .collect::<Vec<_>>(),
        vec![("rv-apply", key(2), Some(2))]
    );
    for consumer in [None, Some("rv-park")] {
        let letters = inbox
            .admin()
            .list(consumer, &[Status::Failed, Status::Dead], 10)
            .await
            .unwrap();
        assert!(
            letters
                .iter()
                .all(|row| row.status == Status::Dead && row.message_key == key(1)),
            "{letters:?}"
        );
        assert_eq!(letters.len(), if consumer.is_none() { 2 } else { 1 });
    }
    // Not a dead letter: a discard of a parked item changes nothing.
    assert!(!inbox.admin().discard("rv-park", &key(3)).await.unwrap());
    assert_eq!(
        status(&inbox, "rv-park", &key(3)).await,
        Some(Status::Parked)
    );
    let replayed = dispatcher.replay("rv-park", &key(3)).await.unwrap();
    assert_eq!(replayed.result.unwrap(), Outcome::Parked);
    // The dead 1 replayed: applied, and 2 and 3 follow; 5 waits for 4.
    let replayed = dispatcher.replay("rv-park", &key(1)).await.unwrap();
    assert_eq!(replayed.result.unwrap(), Outcome::Processed(()));
    assert_eq!(
        history(&inbox, "rv-park", &order).await.as_deref(),
        Some("1,2,3")
    );
    assert_eq!(
        status(&inbox, "rv-park", &key(5)).await,
        Some(Status::Parked)
    );
    assert_eq!(pointers(&inbox).await.len(), 1);
    assert_eq!(
        park(&dispatcher, &event(&order, 4, "4")).await,
        Ok(Outcome::Processed(()))
    );
    assert_eq!(
        history(&inbox, "rv-park", &order).await.as_deref(),
        Some("1,2,3,4,5")
    );
    assert_eq!(pointers(&inbox).await, Vec::<String>::new());
}

/// An ordered handler with 98 actions (the claim, the position's `Update` and 98 make
/// DynamoDB's 100) commits in order; a retry of it after a failure (a takeover of its failed
/// item) commits too, and so does its release after it was parked: each effect once.
#[tokio::test]
async fn an_ordered_handler_with_ninety_eight_actions_commits_first_time_on_retry_and_released() {
    let inbox = setup().await;
    let dispatcher = DynamoDispatcher::from_registry(inbox.clone()).unwrap();
    let order = fresh("wide");
    let wide = |seq: i64| {
        let mut e = event(&order, seq, &seq.to_string());
        e.extra = 97;
        e
    };
    // In order: 98 actions (history + 97).
    assert_eq!(
        park(&dispatcher, &wide(1)).await,
        Ok(Outcome::Processed(()))
    );
    // 99 is one too many.
    let mut too_wide = wide(2);
    too_wide.extra = 98;
    too_wide.event_id = fresh("too");
    let result = park(&dispatcher, &too_wide).await;
    assert!(
        result
            .as_ref()
            .is_err_and(|e| e.starts_with("TooManyItems { items: 99, max: 98 }")),
        "{result:?}"
    );
    // A retry of a failed one: its takeover.
    FAIL_ONCE.lock().unwrap().push(format!("rv-park:{order}/2"));
    let result = park(&dispatcher, &wide(2)).await;
    assert!(
        result.as_ref().is_err_and(|e| e.starts_with("Handler")),
        "{result:?}"
    );
    assert_eq!(
        park(&dispatcher, &wide(2)).await,
        Ok(Outcome::Processed(()))
    );
    // Parked, then released by its predecessor.
    assert_eq!(park(&dispatcher, &wide(4)).await, Ok(Outcome::Parked));
    assert_eq!(
        park(&dispatcher, &wide(3)).await,
        Ok(Outcome::Processed(()))
    );
    assert_eq!(
        history(&inbox, "rv-park", &order).await.as_deref(),
        Some("1,2,3,4")
    );
    assert_eq!(
        history_of(&inbox, &format!("rv-park:{order}:x96"))
            .await
            .as_deref(),
        Some("1,2,3,4")
    );
    assert_eq!(
        status(&inbox, "rv-park", &format!("{order}/4")).await,
        Some(Status::Processed)
    );
    assert_eq!(pointers(&inbox).await, Vec::<String>::new());
}

/// A release that stops at a successor (its handler failed once: `failed`, with its pointer)
/// leaves it and the rest behind with the gap before them closed, and the message that started
/// the release was acked (processed). The sweep, even with the dead-letter policy, must not
/// dead-letter them (nor leave the failed one for ever: no delivery of it will come again): it
/// goes on from the aggregate's position and applies them in order.
#[tokio::test]
async fn the_sweep_releases_a_successor_whose_gap_closed_instead_of_dead_lettering_it() {
    let inbox = setup().await;
    let dispatcher = DynamoDispatcher::from_registry(inbox.clone()).unwrap();
    let order = fresh("gc");
    assert_eq!(
        park(&dispatcher, &event(&order, 2, "2")).await,
        Ok(Outcome::Parked)
    );
    assert_eq!(
        park(&dispatcher, &event(&order, 3, "3")).await,
        Ok(Outcome::Parked)
    );
    // Sequence 1 applied while the release finds 2's handler failing once (it stays, failed
    // with its pointer, and 3 stays parked): the gap before 2 is closed.
    FAIL_ONCE.lock().unwrap().push(format!("rv-park:{order}/2"));
    assert_eq!(
        park(&dispatcher, &event(&order, 1, "1")).await,
        Ok(Outcome::Processed(()))
    );
    assert_eq!(
        history(&inbox, "rv-park", &order).await.as_deref(),
        Some("1")
    );
    assert_eq!(
        status(&inbox, "rv-park", &format!("{order}/2")).await,
        Some(Status::Failed)
    );
    let dead = DynamoDispatcher::from_registry(inbox.clone())
        .unwrap()
        .with_park_policy(ParkPolicy::new(Duration::ZERO, ParkTimeout::DeadLetter));
    let report = dead.sweep_parked().await.unwrap();
    assert_eq!(
        (report.released, report.dead_lettered),
        (0, 0),
        "{report:?}"
    );
    assert_eq!(
        history(&inbox, "rv-park", &order).await.as_deref(),
        Some("1,2,3")
    );
    assert_eq!(pointers(&inbox).await, Vec::<String>::new());
}

/// Two keys parked at one aggregate's same sequence (a producer's mistake) share a pointer. The
/// sweep's release applies one of them (the aggregate's position jumps to it) and settles the
/// other as stale: neither is left parked for ever, nothing is applied twice, no pointer stays.
#[tokio::test]
async fn two_keys_parked_at_one_sequence_are_both_settled_by_the_sweep() {
    let inbox = setup().await;
    let dispatcher = DynamoDispatcher::from_registry(inbox.clone()).unwrap();
    let order = fresh("dup");
    let mut first = event(&order, 3, "first");
    first.event_id = format!("{order}/3a");
    let mut second = event(&order, 3, "second");
    second.event_id = format!("{order}/3b");
    assert_eq!(park(&dispatcher, &first).await, Ok(Outcome::Parked));
    assert_eq!(park(&dispatcher, &second).await, Ok(Outcome::Parked));
    assert_eq!(pointers(&inbox).await.len(), 1);
    let release = DynamoDispatcher::from_registry(inbox.clone())
        .unwrap()
        .with_park_policy(ParkPolicy::new(Duration::ZERO, ParkTimeout::Release));
    let report = release.sweep_parked().await.unwrap();
    assert_eq!(
        (report.released, report.dead_lettered),
        (1, 0),
        "{report:?}"
    );
    assert_eq!(
        history(&inbox, "rv-park", &order).await.as_deref(),
        Some("first")
    );
    assert_eq!(
        (
            status(&inbox, "rv-park", &first.event_id).await,
            status(&inbox, "rv-park", &second.event_id).await
        ),
        (Some(Status::Processed), Some(Status::Stale))
    );
    assert_eq!(pointers(&inbox).await, Vec::<String>::new());
    // Swept again: nothing left.
    let report = release.sweep_parked().await.unwrap();
    assert_eq!(
        (report.released, report.dead_lettered),
        (0, 0),
        "{report:?}"
    );
}

/// A successor whose release failed (retryable: `failed`, its pointer kept) and the one parked
/// behind it are applied in order by the next sweep with the release policy, not released over
/// a gap: `released` counts none (no gap was open), and each effect is once.
#[tokio::test]
async fn the_release_sweep_goes_on_from_the_position_past_a_failed_successor() {
    let inbox = setup().await;
    let dispatcher = DynamoDispatcher::from_registry(inbox.clone()).unwrap();
    let order = fresh("fr");
    for seq in [4, 3, 2] {
        assert_eq!(
            park(&dispatcher, &event(&order, seq, &seq.to_string())).await,
            Ok(Outcome::Parked)
        );
    }
    FAIL_ONCE.lock().unwrap().push(format!("rv-park:{order}/2"));
    assert_eq!(
        park(&dispatcher, &event(&order, 1, "1")).await,
        Ok(Outcome::Processed(()))
    );
    assert_eq!(
        history(&inbox, "rv-park", &order).await.as_deref(),
        Some("1")
    );
    let release = DynamoDispatcher::from_registry(inbox.clone())
        .unwrap()
        .with_park_policy(ParkPolicy::new(Duration::ZERO, ParkTimeout::Release));
    let report = release.sweep_parked().await.unwrap();
    assert_eq!(
        (report.released, report.dead_lettered),
        (0, 0),
        "{report:?}"
    );
    assert_eq!(
        history(&inbox, "rv-park", &order).await.as_deref(),
        Some("1,2,3,4")
    );
    for seq in 2..=4 {
        assert_eq!(
            status(&inbox, "rv-park", &format!("{order}/{seq}")).await,
            Some(Status::Processed)
        );
    }
    assert_eq!(pointers(&inbox).await, Vec::<String>::new());
}

/// Writes `attributes` as the item keyed `pk` of the inbox table (an item the runtime did not
/// write: a hand edit, another program).
async fn put_raw(inbox: &DynamoInbox, pk: &str, attributes: &[(&str, AttributeValue)]) {
    let mut put = inbox
        .client()
        .put_item()
        .table_name(inbox.table())
        .item("pk", AttributeValue::S(pk.to_owned()));
    for (name, value) in attributes {
        put = put.item(*name, value.clone());
    }
    put.send().await.unwrap();
}

/// An aggregate's position item whose `last_sequence` is not an integer (written by hand) makes
/// the next ordered delivery of that aggregate a `Malformed` error naming the attribute: the
/// handler's effect is not applied and no inbox item is written, so the delivery is not acked
/// as done and can be applied once the item is repaired.
#[tokio::test]
async fn a_malformed_position_is_an_error_and_applies_nothing() {
    let inbox = setup().await;
    let dispatcher = DynamoDispatcher::from_registry(inbox.clone()).unwrap();
    let order = fresh("mp");
    let position = format!("pos:{}:rv-park{order}", "rv-park".len());
    put_raw(
        &inbox,
        &position,
        &[("last_sequence", AttributeValue::N("1.5".into()))],
    )
    .await;
    let result = park(&dispatcher, &event(&order, 1, "1")).await;
    assert!(
        result
            .as_ref()
            .is_err_and(|e| e.starts_with("Malformed") && e.contains("last_sequence")),
        "{result:?}"
    );
    assert_eq!(history(&inbox, "rv-park", &order).await, None);
    assert_eq!(status(&inbox, "rv-park", &format!("{order}/1")).await, None);
    // Repaired (the item removed): the same delivery applies, once.
    inbox
        .client()
        .delete_item()
        .table_name(inbox.table())
        .key("pk", AttributeValue::S(position))
        .send()
        .await
        .unwrap();
    assert_eq!(
        park(&dispatcher, &event(&order, 1, "1")).await,
        Ok(Outcome::Processed(()))
    );
    assert_eq!(
        history(&inbox, "rv-park", &order).await.as_deref(),
        Some("1")
    );
}

/// A pointer item without its payload (written by hand) stops the release at it: the
/// predecessor that triggered the release is processed all the same, nothing after the bad
/// pointer is applied, and the pointer is left for an operator.
#[tokio::test]
async fn a_malformed_pointer_stops_the_release_and_the_predecessor_still_commits() {
    let inbox = setup().await;
    let dispatcher = DynamoDispatcher::from_registry(inbox.clone()).unwrap();
    let order = fresh("mq");
    let pointer = format!("park:{}:rv-park{}:{order}2", "rv-park".len(), order.len());
    put_raw(
        &inbox,
        &pointer,
        &[
            ("message_key", AttributeValue::S(format!("{order}/2"))),
            ("message_name", AttributeValue::S("rv.order.event".into())),
        ],
    )
    .await;
    assert_eq!(
        park(&dispatcher, &event(&order, 3, "3")).await,
        Ok(Outcome::Parked)
    );
    assert_eq!(
        park(&dispatcher, &event(&order, 1, "1")).await,
        Ok(Outcome::Processed(()))
    );
    assert_eq!(
        history(&inbox, "rv-park", &order).await.as_deref(),
        Some("1")
    );
    assert_eq!(
        status(&inbox, "rv-park", &format!("{order}/3")).await,
        Some(Status::Parked)
    );
    let mut left = pointers(&inbox).await;
    left.retain(|pk| pk.contains(&order));
    assert_eq!(left.len(), 2, "{left:?}");
    assert!(left.contains(&pointer), "{left:?}");
}
