//! `Worker::batch(size, max_wait)` under adversity (from a review of its first version): shutdown,
//! drain timeout, source failure, per-key order, panicking handlers, failures, duplicates,
//! conflicts, small pools, SQLite — each delivery settled as one-at-a-time processing would.

#![allow(missing_docs)]

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::Mutex;
use std::time::Duration;

use inbox_runtime::source::Settlement;
use inbox_runtime::source::memory::{MemoryHandle, MemorySource};
use inbox_runtime::{
    Classify, Dispatcher, Envelope, ErrorClass, Message, RetryPolicy, StopReason, Worker,
    WorkerReport,
};
use inbox_tests::{APPLY_EFFECT, effects, envelope};
use serde::{Deserialize, Serialize};
use sqlx::{PgConnection, PgPool, SqliteConnection};
use tokio_util::sync::CancellationToken;

// ---------------------------------------------------------------------------------------------
// Messages and handlers.
// ---------------------------------------------------------------------------------------------

#[derive(Debug, Clone, Serialize, Deserialize, Message)]
#[message(name = "rb.pay")]
pub struct RbPay {
    #[message(key)]
    pub id: String,
    pub amount: i64,
    /// "", "frozen", "flaky", "blip", "retry", "swallow", "panic", "panic_once"
    #[serde(default)]
    pub mode: String,
    /// Sleep (tokio) after the write, inside the transaction.
    #[serde(default)]
    pub sleep_ms: u64,
}

#[derive(Debug, thiserror::Error)]
pub enum RbError {
    #[error("permanent: {0}")]
    Permanent(String),
    #[error("transient: {0}")]
    Transient(String),
    #[error("retryable: {0}")]
    Retryable(String),
    #[error(transparent)]
    Db(#[from] sqlx::Error),
}

impl Classify for RbError {
    fn class(&self) -> ErrorClass {
        match self {
            RbError::Permanent(_) => ErrorClass::Permanent,
            RbError::Transient(_) => ErrorClass::Transient,
            RbError::Retryable(_) => ErrorClass::Retryable,
            RbError::Db(error) => error.class(),
        }
    }
}

/// Ids whose first call happened (modes flaky, blip, retry, panic_once).
static SEEN: Mutex<Vec<String>> = Mutex::new(Vec::new());
/// Ids that swallow a database error while they are in this set (mode "swallow").
static SWALLOWING: Mutex<Vec<String>> = Mutex::new(Vec::new());

fn first_call(id: &str) -> bool {
    let mut seen = SEEN.lock().unwrap();
    if seen.iter().any(|s| s == id) {
        false
    } else {
        seen.push(id.to_owned());
        true
    }
}

#[inbox_runtime::idempotent(consumer = "rb-pay")]
pub async fn rb_pay(conn: &mut PgConnection, msg: RbPay) -> Result<(), RbError> {
    match msg.mode.as_str() {
        "panic" => panic!("poison message {}", msg.id),
        "panic_once" if first_call(&msg.id) => panic!("first call of {} panics", msg.id),
        _ => {}
    }
    sqlx::query(APPLY_EFFECT)
        .bind(&msg.id)
        .bind(msg.amount)
        .execute(&mut *conn)
        .await?;
    sqlx::query("INSERT INTO applied_order (id, tx) VALUES ($1, txid_current())")
        .bind(&msg.id)
        .execute(&mut *conn)
        .await?;
    if msg.sleep_ms > 0 {
        tokio::time::sleep(Duration::from_millis(msg.sleep_ms)).await;
    }
    match msg.mode.as_str() {
        "frozen" => return Err(RbError::Permanent("frozen".into())),
        "flaky" if first_call(&msg.id) => return Err(RbError::Permanent("first call".into())),
        "blip" if first_call(&msg.id) => return Err(RbError::Transient("first call".into())),
        "retry" if first_call(&msg.id) => return Err(RbError::Retryable("first call".into())),
        "swallow" if SWALLOWING.lock().unwrap().contains(&msg.id) => {
            let _ = sqlx::query("SELECT 1 / 0").execute(&mut *conn).await;
        }
        _ => {}
    }
    Ok(())
}

#[derive(Debug, Clone, Serialize, Deserialize, Message)]
#[message(name = "rb.lite")]
pub struct RbLite {
    #[message(key)]
    pub id: String,
    pub amount: i64,
    /// "", "frozen", "retry"
    #[serde(default)]
    pub mode: String,
}

#[inbox_runtime::idempotent(consumer = "rb-lite")]
pub async fn rb_lite(conn: &mut SqliteConnection, msg: RbLite) -> Result<(), RbError> {
    sqlx::query(APPLY_EFFECT)
        .bind(&msg.id)
        .bind(msg.amount)
        .execute(&mut *conn)
        .await?;
    match msg.mode.as_str() {
        "frozen" => return Err(RbError::Permanent("frozen".into())),
        "retry" if first_call(&msg.id) => return Err(RbError::Retryable("first call".into())),
        _ => {}
    }
    Ok(())
}

fn pay(id: &str, amount: i64, mode: &str) -> Envelope {
    pay_sleep(id, amount, mode, 0)
}

fn pay_sleep(id: &str, amount: i64, mode: &str, sleep_ms: u64) -> Envelope {
    envelope(&RbPay {
        id: id.into(),
        amount,
        mode: mode.into(),
        sleep_ms,
    })
}

fn lite(id: &str, mode: &str) -> Envelope {
    envelope(&RbLite {
        id: id.into(),
        amount: 1,
        mode: mode.into(),
    })
}

fn unknown() -> Envelope {
    Envelope::new("rb.unknown", b"{}".to_vec())
}

async fn pool(max: u32) -> PgPool {
    let pool = inbox_tests::pg_pool(max).await;
    sqlx::query(
        "CREATE TABLE applied_order (seq BIGSERIAL PRIMARY KEY, id TEXT NOT NULL, tx BIGINT NOT NULL)",
    )
    .execute(&pool)
    .await
    .unwrap();
    pool
}

fn dispatcher(pool: &PgPool) -> Dispatcher<sqlx::Postgres> {
    Dispatcher::from_registry(pool.clone())
        .unwrap()
        .with_retry_policy(
            RetryPolicy::default()
                .retry_delays(Duration::from_millis(50), Duration::from_millis(100)),
        )
}

async fn applied_order(pool: &PgPool) -> Vec<(String, i64)> {
    sqlx::query_as("SELECT id, tx FROM applied_order ORDER BY seq")
        .fetch_all(pool)
        .await
        .unwrap()
}

/// Settlements per message id, in order.
fn by_id(handle: &MemoryHandle) -> BTreeMap<u64, Vec<Settlement>> {
    let mut out: BTreeMap<u64, Vec<Settlement>> = BTreeMap::new();
    for (id, s) in handle.settlements() {
        // Retry delays have jitter: keep whether there was one.
        let s = match s {
            Settlement::Requeue { delay: Some(d) } if !d.is_zero() => Settlement::Requeue {
                delay: Some(Duration::from_millis(1)),
            },
            s => s,
        };
        out.entry(id).or_default().push(s);
    }
    out
}

fn count(handle: &MemoryHandle, wanted: fn(&Settlement) -> bool) -> u64 {
    handle
        .settlements()
        .iter()
        .filter(|(_, s)| wanted(s))
        .count() as u64
}

async fn wait_for(what: &str, mut cond: impl FnMut() -> bool) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    while !cond() {
        assert!(
            tokio::time::Instant::now() < deadline,
            "timed out waiting for {what}"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

async fn run_to_end<DB: inbox_runtime::store::InboxDatabase>(
    worker: Worker<DB>,
    source: MemorySource,
) -> WorkerReport {
    tokio::time::timeout(
        Duration::from_secs(60),
        worker.run(source, CancellationToken::new()),
    )
    .await
    .expect("worker did not finish in 60 s")
    .unwrap()
}

// ---------------------------------------------------------------------------------------------
// Findings (fail today).
// ---------------------------------------------------------------------------------------------

/// Drain timeout while a batch task is settling its deliveries one by one after its commit: the
/// report counts what was settled (the first delivery, acked) and only the rest as abandoned.
/// (The first version counted the whole batch as abandoned.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn drain_timeout_counts_what_a_settling_batch_settled() {
    let pool = pool(8).await;
    // Another session holds a SHARE lock on inbox_rejections: keeping the refused delivery
    // there (the Worker does it after the batch commit, before settling it) waits.
    let mut locker = pool.acquire().await.unwrap();
    sqlx::query("BEGIN").execute(&mut *locker).await.unwrap();
    sqlx::query("LOCK TABLE inbox_rejections IN SHARE MODE")
        .execute(&mut *locker)
        .await
        .unwrap();

    let source = MemorySource::new("mem");
    let handle = source.handle();
    handle.push(pay("dt-a", 1, "")); // id 0
    handle.push(unknown()); // id 1
    handle.push(pay("dt-b", 1, "")); // id 2
    let worker = Worker::new(dispatcher(&pool))
        .concurrency(8)
        .batch(3, Duration::from_secs(5))
        .drain_timeout(Duration::from_millis(300));
    let token = CancellationToken::new();
    let run = tokio::spawn({
        let token = token.clone();
        async move { worker.run(source, token).await }
    });
    // The batch committed and its first delivery is acked; the second waits for the lock.
    wait_for("the first ack", || !handle.settlements().is_empty()).await;
    tokio::time::sleep(Duration::from_millis(100)).await;
    token.cancel();
    let report = run.await.unwrap().unwrap();
    sqlx::query("ROLLBACK").execute(&mut *locker).await.unwrap();

    assert_eq!(handle.settlements(), [(0, Settlement::Ack)]);
    let mut abandoned = handle.abandoned();
    abandoned.sort_unstable();
    assert_eq!(abandoned, [1, 2]);
    assert_eq!(
        (report.acked, report.abandoned),
        (1, 2),
        "the report must match what the source saw: {report:?}"
    );
}

/// A message whose handler panics takes its whole batch down; the batch's deliveries are
/// requeued together by the source, form the same batch again, and the innocent ones are
/// never processed (one at a time, they are processed and acked at once).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn panicking_message_does_not_starve_its_batch_mates() {
    for batch in [false, true] {
        let pool = pool(8).await;
        let source = MemorySource::new("mem");
        let handle = source.handle();
        let tag = if batch { "b" } else { "s" };
        handle.push(pay(&format!("pp-{tag}-poison"), 1, "panic")); // id 0
        handle.push(pay(&format!("pp-{tag}-a"), 1, "")); // id 1
        handle.push(pay(&format!("pp-{tag}-b"), 1, "")); // id 2
        let mut worker = Worker::new(dispatcher(&pool))
            .concurrency(8)
            .drain_timeout(Duration::from_secs(1));
        if batch {
            worker = worker.batch(3, Duration::from_millis(50));
        }
        let token = CancellationToken::new();
        let run = tokio::spawn({
            let token = token.clone();
            async move { worker.run(source, token).await }
        });
        tokio::time::sleep(Duration::from_secs(2)).await;
        token.cancel();
        let report = run.await.unwrap().unwrap();
        let settled = by_id(&handle);
        let abandoned_innocents = handle.abandoned().iter().filter(|id| **id != 0).count();
        eprintln!(
            "batch={batch}: deliveries {}, abandoned innocents {abandoned_innocents}, settlements {settled:?}",
            handle.deliveries()
        );
        assert_eq!(
            (settled.get(&1).map(|s| s[0]), settled.get(&2).map(|s| s[0])),
            (Some(Settlement::Ack), Some(Settlement::Ack)),
            "batch={batch}: the innocent messages must be processed and acked; {report:?}"
        );
    }
}

/// A panic in one ordering key's handler breaks the order of another key whose delivery
/// happened to share its batch: that delivery is abandoned and redelivered after its key's
/// successor, which the worker started at once (one at a time the order is kept).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn panic_in_a_batch_keeps_the_order_of_the_other_keys() {
    for batch in [false, true] {
        let pool = pool(8).await;
        let source = MemorySource::new("mem");
        let handle = source.handle();
        let tag = if batch { "b" } else { "s" };
        let x = format!("po-{tag}-x");
        let y1 = format!("po-{tag}-y1");
        let y2 = format!("po-{tag}-y2");
        handle.push_keyed(pay(&x, 1, "panic_once"), "kx");
        handle.push_keyed(pay(&y1, 1, ""), "ky");
        handle.push_keyed(pay(&y2, 1, ""), "ky");
        handle.close();
        let mut worker = Worker::new(dispatcher(&pool)).concurrency(8);
        if batch {
            worker = worker.batch(2, Duration::from_millis(50));
        }
        let report = run_to_end(worker, source).await;
        let order: Vec<String> = applied_order(&pool)
            .await
            .into_iter()
            .map(|(id, _)| id)
            .filter(|id| id.contains("-y"))
            .collect();
        assert_eq!(
            order,
            [y1.clone(), y2.clone()],
            "batch={batch}: order of key ky; {report:?}"
        );
    }
}

/// `max_wait` of `Duration::MAX` ("only full batches, however long"): the worker panics with an
/// `Instant` overflow as soon as a batch starts gathering.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn batch_with_unbounded_max_wait_does_not_panic() {
    let pool = pool(8).await;
    let source = MemorySource::new("mem");
    let handle = source.handle();
    for i in 0..4 {
        handle.push(pay(&format!("mx-{i}"), 1, ""));
    }
    handle.close();
    let worker = Worker::new(dispatcher(&pool))
        .concurrency(8)
        .batch(4, Duration::MAX);
    let run = tokio::spawn(run_to_end(worker, source));
    let report = run.await.expect("Worker::run panicked");
    assert_eq!((report.processed, report.acked), (4, 4));
}

// ---------------------------------------------------------------------------------------------
// What held up.
// ---------------------------------------------------------------------------------------------

/// Shutdown while a batch is gathering: its deliveries are requeued, nothing is processed,
/// acked or abandoned.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_requeues_a_gathering_batch() {
    let pool = pool(8).await;
    let source = MemorySource::new("mem");
    let handle = source.handle();
    handle.push(pay("sg-a", 1, ""));
    handle.push_keyed(pay("sg-b", 1, ""), "k");
    handle.push_keyed(pay("sg-c", 1, ""), "k"); // waits for sg-b
    let worker = Worker::new(dispatcher(&pool))
        .concurrency(8)
        .batch(10, Duration::from_secs(30));
    let token = CancellationToken::new();
    let run = tokio::spawn({
        let token = token.clone();
        async move { worker.run(source, token).await }
    });
    wait_for("3 outstanding", || handle.outstanding() == 3).await;
    tokio::time::sleep(Duration::from_millis(50)).await;
    token.cancel();
    let report = tokio::time::timeout(Duration::from_secs(5), run)
        .await
        .expect("shutdown within 5 s")
        .unwrap()
        .unwrap();
    assert_eq!(report.stop, StopReason::Shutdown);
    assert_eq!(
        (
            report.requeued,
            report.acked,
            report.abandoned,
            report.processed
        ),
        (3, 0, 0, 0),
        "{report:?}"
    );
    assert_eq!(
        count(&handle, |s| *s == Settlement::Requeue { delay: None }),
        3
    );
    assert!(handle.abandoned().is_empty());
    assert!(effects(&pool).await.is_empty());
    // Per-key order kept in the queue: sg-b (id 1) before sg-c (id 2).
    let order: Vec<u64> = handle.settlements().iter().map(|(id, _)| *id).collect();
    let b = order.iter().position(|id| *id == 1).unwrap();
    let c = order.iter().position(|id| *id == 2).unwrap();
    assert!(b < c, "{order:?}");
}

/// Shutdown while a batch runs: it finishes, commits, each delivery is acked; the batch
/// gathering meanwhile is requeued.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_lets_a_running_batch_commit_and_ack() {
    let pool = pool(8).await;
    let source = MemorySource::new("mem");
    let handle = source.handle();
    handle.push(pay_sleep("sr-a", 1, "", 1500));
    handle.push(pay("sr-b", 1, ""));
    let worker = Worker::new(dispatcher(&pool))
        .concurrency(8)
        .batch(2, Duration::from_secs(30));
    let token = CancellationToken::new();
    let run = tokio::spawn({
        let token = token.clone();
        async move { worker.run(source, token).await }
    });
    wait_for("2 outstanding", || handle.outstanding() == 2).await;
    handle.push(pay("sr-c", 1, ""));
    wait_for("3 outstanding", || handle.outstanding() == 3).await;
    tokio::time::sleep(Duration::from_millis(100)).await;
    token.cancel();
    let report = run.await.unwrap().unwrap();
    assert_eq!(
        (
            report.acked,
            report.requeued,
            report.abandoned,
            report.processed
        ),
        (2, 1, 0, 2),
        "{report:?}"
    );
    let settled = by_id(&handle);
    assert_eq!(settled[&0], [Settlement::Ack]);
    assert_eq!(settled[&1], [Settlement::Ack]);
    assert_eq!(settled[&2], [Settlement::Requeue { delay: None }]);
    let effects = effects(&pool).await;
    assert_eq!(
        effects.keys().cloned().collect::<Vec<_>>(),
        ["sr-a", "sr-b"]
    );
}

/// Drain timeout with a batch still in its transaction: every delivery of it abandoned, none
/// acked, nothing committed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn drain_timeout_abandons_a_running_batch_unsettled() {
    let pool = pool(8).await;
    let source = MemorySource::new("mem");
    let handle = source.handle();
    handle.push(pay_sleep("dr-a", 1, "", 5000));
    handle.push(pay("dr-b", 1, ""));
    handle.push_keyed(pay("dr-c", 1, ""), "k");
    let worker = Worker::new(dispatcher(&pool))
        .concurrency(8)
        .batch(3, Duration::from_secs(30))
        .drain_timeout(Duration::from_millis(300));
    let token = CancellationToken::new();
    let run = tokio::spawn({
        let token = token.clone();
        async move { worker.run(source, token).await }
    });
    wait_for("3 outstanding", || handle.outstanding() == 3).await;
    tokio::time::sleep(Duration::from_millis(200)).await;
    token.cancel();
    let report = run.await.unwrap().unwrap();
    assert_eq!((report.abandoned, report.acked), (3, 0), "{report:?}");
    assert!(handle.settlements().is_empty());
    assert_eq!(handle.abandoned().len(), 3);
    assert!(effects(&pool).await.is_empty());
    let claims: i64 = sqlx::query_scalar("SELECT COUNT(*) FROM inbox_messages")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(claims, 0);
}

/// One stream through the worker one at a time (concurrency 1) and in one batch: settlements
/// per delivery (in order) and effects. `items`: (name, mode, amount); name "unknown" is an
/// unroutable message, "malformed" a payload that does not decode. Mode "swallow" swallows a
/// database error until that delivery's first settlement.
async fn single_vs_batch(
    test: &str,
    items: &[(&str, &str, i64)],
) -> [(
    BTreeMap<u64, Vec<Settlement>>,
    Vec<(String, (i64, i64))>,
    WorkerReport,
); 2] {
    async fn run(
        test: &str,
        items: &[(&str, &str, i64)],
        batch: bool,
    ) -> (
        BTreeMap<u64, Vec<Settlement>>,
        Vec<(String, (i64, i64))>,
        WorkerReport,
    ) {
        let pool = pool(8).await;
        let source = MemorySource::new("mem");
        let handle = source.handle();
        let tag = if batch { "b" } else { "s" };
        let id = |name: &str| format!("{test}-{tag}-{name}");
        let mut swallowing = Vec::new();
        for (name, mode, amount) in items {
            let index = match *name {
                "unknown" => handle.push(unknown()),
                "malformed" => handle.push(Envelope::new(RbPay::NAME, b"not json".to_vec())),
                _ => handle.push(pay(&id(name), *amount, mode)),
            };
            if *mode == "swallow" {
                SWALLOWING.lock().unwrap().push(id(name));
                swallowing.push((index, id(name)));
            }
        }
        handle.close();
        // Stop swallowing once the first attempt was settled.
        let watcher = tokio::spawn({
            let handle = handle.clone();
            async move {
                while !swallowing.is_empty() {
                    let settled: Vec<u64> =
                        handle.settlements().iter().map(|(id, _)| *id).collect();
                    swallowing.retain(|(index, name)| {
                        let done = settled.contains(index);
                        if done {
                            SWALLOWING.lock().unwrap().retain(|s| s != name);
                        }
                        !done
                    });
                    tokio::time::sleep(Duration::from_millis(2)).await;
                }
            }
        });
        let mut worker = Worker::new(dispatcher(&pool)).requeue_delay(Duration::from_millis(300));
        worker = if batch {
            worker
                .concurrency(items.len())
                .batch(items.len(), Duration::from_millis(200))
        } else {
            worker.concurrency(1)
        };
        let report = run_to_end(worker, source).await;
        watcher.abort();
        let effects = effects(&pool)
            .await
            .into_iter()
            .map(|(k, v)| (k.replace(&format!("{test}-{tag}-"), ""), v))
            .collect();
        (by_id(&handle), effects, report)
    }
    let single = run(test, items, false).await;
    let batch = run(test, items, true).await;
    eprintln!(
        "single: {:?}\n  {:?}\nbatch:  {:?}\n  {:?}",
        single.0, single.2, batch.0, batch.2
    );
    [single, batch]
}

/// Every kind of message in one Worker batch (failing permanently, on the first call only,
/// transiently, retryably, unroutable, malformed, duplicate, conflicting): the same
/// settlements and effects as one at a time.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn batch_settlements_match_one_at_a_time() {
    let [single, batch] = single_vs_batch(
        "cmp",
        &[
            ("ok1", "", 1),
            ("frozen", "frozen", 1),
            ("flaky", "flaky", 1),
            ("blip", "blip", 1),
            ("retry", "retry", 1),
            ("unknown", "", 0),
            ("malformed", "", 0),
            ("dup", "", 1),
            ("dup", "", 1),
            ("conflict", "", 1),
            ("conflict", "", 2),
            ("dupretry", "retry", 1),
            ("dupretry", "retry", 1),
            ("dupflaky", "flaky", 1),
            ("dupflaky", "flaky", 1),
            ("ok2", "", 1),
        ],
    )
    .await;
    assert_eq!(batch.1, single.1, "effects");
    assert_eq!(batch.0, single.0, "settlements");
}

/// A handler swallowing a database error in a Worker batch, beside plain ones: the same as one
/// at a time.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn swallowed_error_in_a_worker_batch_matches_one_at_a_time() {
    let [single, batch] = single_vs_batch(
        "swl",
        &[
            ("a", "", 1),
            ("swallow", "swallow", 1),
            ("z", "", 1),
            ("frozen", "frozen", 1),
        ],
    )
    .await;
    assert_eq!(batch.1, single.1, "effects");
    assert_eq!(batch.0, single.0, "settlements");
}

/// Deliveries of one ordering key are never in one transaction, and keep their order, with
/// failing (requeued) ones among them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn same_key_never_in_one_batch_and_order_kept() {
    let pool = pool(8).await;
    let source = MemorySource::new("mem");
    let handle = source.handle();
    let keys = ["k0", "k1", "k2", "k3", "k4"];
    let mut expected: BTreeMap<String, Vec<String>> = BTreeMap::new();
    for i in 0..12 {
        for key in keys {
            let id = format!("{key}-{i:02}");
            // k4 has failing ones (redelivered later: its order is not checked).
            let mode = match (key, i % 4) {
                ("k4", 1) => "retry",
                ("k4", 2) => "blip",
                ("k4", 3) => "frozen",
                _ => "",
            };
            handle.push_keyed(pay(&id, 1, mode), key);
            if key != "k4" {
                expected.entry(key.into()).or_default().push(id.clone());
            }
            // Unkeyed traffic beside.
            handle.push(pay(&format!("free-{key}-{i}"), 1, ""));
        }
    }
    handle.close();
    let report = run_to_end(
        Worker::new(dispatcher(&pool))
            .concurrency(12)
            .requeue_delay(Duration::from_millis(20))
            .batch(6, Duration::from_millis(5)),
        source,
    )
    .await;
    assert_eq!(report.acked + report.rejected, 120, "{report:?}");
    let rows = applied_order(&pool).await;
    let mut per_tx: HashMap<i64, HashSet<String>> = HashMap::new();
    for (id, tx) in &rows {
        if id.starts_with("free-") {
            continue;
        }
        let key = id.split('-').next().unwrap().to_owned();
        assert!(
            per_tx.entry(*tx).or_default().insert(key.clone()),
            "two deliveries of key {key} in transaction {tx}"
        );
    }
    let mut found: BTreeMap<String, Vec<String>> = BTreeMap::new();
    for (id, _) in rows {
        if id.starts_with("free-") || id.starts_with("k4") {
            continue;
        }
        let key = id.split('-').next().unwrap().to_owned();
        found.entry(key).or_default().push(id);
    }
    assert_eq!(found, expected);
    let effects = effects(&pool).await;
    assert!(
        effects.values().all(|(applied, _)| *applied == 1),
        "{effects:?}"
    );
}

/// Small concurrency against the batch size (1, equal, smaller, 2): everything processed once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn small_concurrency_and_batch_sizes() {
    for (concurrency, size) in [(1, 4), (2, 2), (3, 8), (4, 2), (5, 3)] {
        let pool = pool(8).await;
        let source = MemorySource::new("mem");
        let handle = source.handle();
        for i in 0..40 {
            let id = format!("sc-{concurrency}-{size}-{i}");
            if i % 3 == 0 {
                handle.push_keyed(pay(&id, 1, ""), format!("k{}", i % 2));
            } else {
                handle.push(pay(&id, 1, ""));
            }
            if i % 7 == 0 {
                handle.push(pay(&id, 1, ""));
            }
        }
        handle.close();
        let report = run_to_end(
            Worker::new(dispatcher(&pool))
                .concurrency(concurrency)
                .batch(size, Duration::from_millis(20)),
            source,
        )
        .await;
        assert_eq!(
            (
                report.processed,
                report.duplicates,
                report.acked,
                report.abandoned
            ),
            (40, 6, 46, 0),
            "concurrency {concurrency} size {size}: {report:?}"
        );
        assert!(effects(&pool).await.values().all(|e| *e == (1, 1)));
    }
}

/// `stop_when_idle` with batches: the last batch runs, then the worker stops idle.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stop_when_idle_with_batches() {
    let pool = pool(8).await;
    let source = MemorySource::new("mem");
    let handle = source.handle();
    for i in 0..21 {
        handle.push(pay(&format!("id-{i}"), 1, ""));
    }
    let report = run_to_end(
        Worker::new(dispatcher(&pool))
            .concurrency(16)
            .batch(8, Duration::from_millis(300))
            .stop_when_idle(Duration::from_millis(100)),
        source,
    )
    .await;
    assert_eq!(report.stop, StopReason::Idle);
    assert_eq!((report.processed, report.acked), (21, 21), "{report:?}");
    assert_eq!(handle.outstanding(), 0);
}

/// A handler that panics on its first call: the batch is rolled back and its deliveries run one
/// by one (the second call succeeds), so nothing is abandoned and every message is processed
/// once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn panic_once_in_a_batch_worker_recovers() {
    let pool = pool(8).await;
    let source = MemorySource::new("mem");
    let handle = source.handle();
    for i in 0..20 {
        let mode = if i == 5 { "panic_once" } else { "" };
        handle.push_keyed(pay(&format!("pr-{i}"), 1, mode), format!("k{}", i % 3));
    }
    handle.close();
    let report = run_to_end(
        Worker::new(dispatcher(&pool))
            .concurrency(8)
            .batch(4, Duration::from_millis(20)),
        source,
    )
    .await;
    assert_eq!((report.processed, report.acked), (20, 20), "{report:?}");
    assert_eq!(report.abandoned, 0);
    assert!(handle.abandoned().is_empty());
    assert!(effects(&pool).await.values().all(|e| *e == (1, 1)));
}

/// Pools smaller than the concurrency (PostgreSQL), batches with duplicates across batches.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn small_pools_with_batches() {
    for max in [1, 2, 3] {
        let pool = pool(max).await;
        let source = MemorySource::new("mem");
        let handle = source.handle();
        for i in 0..120 {
            handle.push(pay(&format!("sp-{max}-{i}"), 1, ""));
            if i % 10 == 9 {
                handle.push(pay(&format!("sp-{max}-{}", i - 1), 1, ""));
            }
        }
        handle.push(unknown());
        handle.close();
        let report = run_to_end(
            Worker::new(dispatcher(&pool))
                .concurrency(16)
                .batch(4, Duration::from_millis(5)),
            source,
        )
        .await;
        assert_eq!(
            (
                report.processed,
                report.duplicates,
                report.acked,
                report.invalid
            ),
            (120, 12, 133, 1),
            "pool {max}: {report:?}"
        );
        assert!(effects(&pool).await.values().all(|e| *e == (1, 1)));
    }
}

/// SQLite (savepoints always): failing, duplicate, conflicting and keyed messages in batches,
/// small pools; the same settlements per delivery as one at a time.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_batches_match_one_at_a_time() {
    async fn run(
        max: u32,
        batch: bool,
    ) -> (BTreeMap<u64, Vec<Settlement>>, BTreeMap<String, (i64, i64)>) {
        let (pool, _guard) = inbox_tests::sqlite_pool(max).await;
        let source = MemorySource::new("mem");
        let handle = source.handle();
        let tag = format!("{max}{batch}");
        for i in 0..30 {
            let id = format!("sl-{tag}-{i}");
            let mode = match i % 10 {
                3 => "frozen",
                6 => "retry",
                _ => "",
            };
            if i % 4 == 0 {
                handle.push_keyed(lite(&id, mode), format!("k{}", i % 3));
            } else {
                handle.push(lite(&id, mode));
            }
            if i % 9 == 0 {
                handle.push(lite(&id, mode));
            }
        }
        // A conflict: the same key as message 0, another payload. Both share message 0's
        // ordering key, so that the original is applied first in both runs (unordered, two
        // payloads of one key race under concurrency, and either may win).
        handle.push_keyed(lite(&format!("sl-{tag}-0"), "frozen"), "k0");
        handle.push(unknown());
        handle.close();
        let dispatcher = Dispatcher::from_registry(pool.clone())
            .unwrap()
            .with_retry_policy(
                RetryPolicy::default()
                    .retry_delays(Duration::from_millis(50), Duration::from_millis(100)),
            );
        let mut worker = Worker::new(dispatcher);
        worker = if batch {
            worker.concurrency(8).batch(4, Duration::from_millis(10))
        } else {
            worker.concurrency(1)
        };
        let _report = run_to_end(worker, source).await;
        let effects = effects(&pool)
            .await
            .into_iter()
            .map(|(k, v)| (k.replace(&format!("sl-{tag}-"), ""), v))
            .collect();
        (by_id(&handle), effects)
    }
    let (single, single_effects) = run(2, false).await;
    for max in [1, 2, 4] {
        let (batch, batch_effects) = run(max, true).await;
        assert_eq!(batch_effects, single_effects, "pool {max}");
        assert_eq!(batch, single, "pool {max}");
    }
}

/// A source that hands out `left` deliveries of a memory source, then fails.
struct FailingAfter {
    inner: MemorySource,
    left: usize,
}

impl inbox_runtime::source::Source for FailingAfter {
    fn name(&self) -> &str {
        "failing"
    }

    fn next(
        &mut self,
    ) -> inbox_runtime::BoxFuture<
        '_,
        Result<Option<inbox_runtime::source::Delivery>, inbox_runtime::source::SourceError>,
    > {
        Box::pin(async move {
            if self.left == 0 {
                return Err(inbox_runtime::source::SourceError::new(
                    "failing",
                    "receive",
                    "broker went away",
                ));
            }
            self.left -= 1;
            inbox_runtime::source::Source::next(&mut self.inner).await
        })
    }
}

/// The source fails with a batch gathering and keyed deliveries waiting: the batch starts at
/// once, the waiting ones after it, all acked; the run reports the failure.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn source_failure_runs_the_gathering_batch_and_the_waiting_ones() {
    let pool = pool(8).await;
    let inner = MemorySource::new("mem");
    let handle = inner.handle();
    handle.push(pay("sf-a", 1, ""));
    handle.push_keyed(pay("sf-b", 1, ""), "k");
    handle.push_keyed(pay("sf-c", 1, ""), "k");
    handle.push(pay("sf-d", 1, "")); // never fetched
    let worker = Worker::new(dispatcher(&pool))
        .concurrency(8)
        .batch(8, Duration::from_secs(10));
    let started = std::time::Instant::now();
    let error = tokio::time::timeout(
        Duration::from_secs(30),
        worker.run(FailingAfter { inner, left: 3 }, CancellationToken::new()),
    )
    .await
    .unwrap()
    .unwrap_err();
    assert_eq!(error.report.stop, StopReason::SourceFailed);
    assert_eq!(
        (error.report.acked, error.report.processed),
        (3, 3),
        "{:?}",
        error.report
    );
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "{:?}",
        started.elapsed()
    );
    let order: Vec<String> = applied_order(&pool)
        .await
        .into_iter()
        .map(|(id, _)| id)
        .collect();
    let b = order.iter().position(|id| id == "sf-b").unwrap();
    let c = order.iter().position(|id| id == "sf-c").unwrap();
    assert!(b < c, "{order:?}");
}

/// Shutdown while a batch runs and deliveries of its keys wait behind it: the waiting ones are
/// requeued (in key order), the batch acked after its commit.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_requeues_deliveries_waiting_behind_a_running_batch() {
    let pool = pool(8).await;
    let source = MemorySource::new("mem");
    let handle = source.handle();
    handle.push_keyed(pay_sleep("sw-a1", 1, "", 1000), "a"); // 0
    handle.push_keyed(pay("sw-b1", 1, ""), "b"); // 1
    handle.push_keyed(pay("sw-a2", 1, ""), "a"); // 2
    handle.push_keyed(pay("sw-b2", 1, ""), "b"); // 3
    handle.push_keyed(pay("sw-a3", 1, ""), "a"); // 4
    let worker = Worker::new(dispatcher(&pool))
        .concurrency(8)
        .batch(2, Duration::from_secs(30));
    let token = CancellationToken::new();
    let run = tokio::spawn({
        let token = token.clone();
        async move { worker.run(source, token).await }
    });
    wait_for("5 outstanding", || handle.outstanding() == 5).await;
    tokio::time::sleep(Duration::from_millis(100)).await;
    token.cancel();
    let report = run.await.unwrap().unwrap();
    assert_eq!(
        (report.acked, report.requeued, report.abandoned),
        (2, 3, 0),
        "{report:?}"
    );
    let settlements = handle.settlements();
    let pos = |id: u64| settlements.iter().position(|(i, _)| *i == id).unwrap();
    assert!(pos(2) < pos(4), "{settlements:?}");
    assert_eq!(by_id(&handle)[&0], [Settlement::Ack]);
    assert_eq!(by_id(&handle)[&1], [Settlement::Ack]);
    let effects = effects(&pool).await;
    assert_eq!(
        effects.keys().cloned().collect::<Vec<_>>(),
        ["sw-a1", "sw-b1"]
    );
}

/// File source, batch mode: shutdown mid-file, then resume: the persisted position covers only
/// committed lines, every line applied once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn file_source_batches_shutdown_and_resume() {
    use inbox_runtime::source::file::{FileSource, read_offset_file};
    use std::io::Write as _;
    let pool = pool(8).await;
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("events.jsonl");
    {
        let mut file = std::fs::File::create(&path).unwrap();
        for i in 0..300 {
            let mode = if i % 50 == 7 { "retry" } else { "" };
            writeln!(
                file,
                r#"{{"message":"rb.pay","payload":{{"id":"fl-{i:03}","amount":1,"mode":"{mode}","sleep_ms":3}}}}"#
            )
            .unwrap();
        }
    }
    for run in 0..2 {
        let source = FileSource::open(&path).await.unwrap();
        let token = CancellationToken::new();
        if run == 0 {
            let cancel = token.clone();
            tokio::spawn(async move {
                tokio::time::sleep(Duration::from_millis(300)).await;
                cancel.cancel();
            });
        }
        let report = tokio::time::timeout(
            Duration::from_secs(60),
            Worker::new(dispatcher(&pool))
                .concurrency(16)
                .requeue_delay(Duration::from_millis(20))
                .batch(8, Duration::from_millis(5))
                .run(source, token),
        )
        .await
        .unwrap()
        .unwrap();
        let position = read_offset_file(&path.with_extension("jsonl.offset"))
            .unwrap()
            .unwrap();
        let effects = effects(&pool).await;
        for line in 1..=position.line {
            let key = format!("fl-{:03}", line - 1);
            assert_eq!(
                effects.get(&key),
                Some(&(1, 1)),
                "line {line} run {run}: {report:?}"
            );
        }
        if run == 0 {
            assert_eq!(report.stop, StopReason::Shutdown);
            assert!(position.line < 300, "{position:?}");
        } else {
            assert_eq!(report.stop, StopReason::SourceExhausted);
            assert_eq!(position.line, 300);
            assert_eq!(effects.len(), 300);
            assert!(effects.values().all(|e| *e == (1, 1)));
        }
    }
}

/// Shutdown after the source failed: the running delivery gets the drain timeout like any other
/// (the first version ignored a shutdown once the source had ended, and waited for it).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_after_the_source_failed_still_drains_with_its_timeout() {
    let pool = pool(4).await;
    let inner = MemorySource::new("mem");
    let handle = inner.handle();
    handle.push(pay_sleep("late-a", 1, "", 20_000));
    let token = CancellationToken::new();
    let cancel = token.clone();
    tokio::spawn(async move {
        tokio::time::sleep(Duration::from_millis(500)).await;
        cancel.cancel();
    });
    let worker = Worker::new(dispatcher(&pool))
        .concurrency(4)
        .drain_timeout(Duration::from_millis(300));
    let error = tokio::time::timeout(
        Duration::from_secs(10),
        worker.run(FailingAfter { inner, left: 1 }, token),
    )
    .await
    .expect("the shutdown's drain timeout ends the run")
    .unwrap_err();
    assert_eq!(error.report.stop, StopReason::SourceFailed);
    assert_eq!(
        (error.report.acked, error.report.abandoned),
        (0, 1),
        "{:?}",
        error.report
    );
    assert_eq!(effects(&pool).await.len(), 0);
}

/// The source failed and no shutdown comes: a running delivery still gets the drain timeout from
/// the failure (a settlement on a connection that just died may never answer; the first version
/// waited for it forever), then the run returns the failure with that delivery abandoned.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn source_failure_alone_drains_with_its_timeout() {
    let pool = pool(4).await;
    let inner = MemorySource::new("mem");
    let handle = inner.handle();
    handle.push(pay_sleep("stuck-a", 1, "", 20_000));
    let worker = Worker::new(dispatcher(&pool))
        .concurrency(4)
        .drain_timeout(Duration::from_millis(300));
    let error = tokio::time::timeout(
        Duration::from_secs(10),
        worker.run(FailingAfter { inner, left: 1 }, CancellationToken::new()),
    )
    .await
    .expect("the drain timeout after the failure ends the run")
    .unwrap_err();
    assert_eq!(error.report.stop, StopReason::SourceFailed);
    assert_eq!(
        (error.report.acked, error.report.abandoned),
        (0, 1),
        "{:?}",
        error.report
    );
    assert_eq!(handle.abandoned().len(), 1);
    assert_eq!(effects(&pool).await.len(), 0);
}
