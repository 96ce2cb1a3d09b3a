//! MySQL/MariaDB only: the concurrent duplicate storm of issue 16 on InnoDB.
//!
//! 16 tasks deliver 500 keys three times each, shuffled; the first attempt of every 25th key
//! fails (its effect and its fresh claim roll back while other deliveries of the key wait, the
//! case where InnoDB reports deadlocks); then 8 tasks redeliver at once a key whose first attempt
//! failed; then 8 tasks deliver 20 fresh keys 8 times each, each key's first attempt failing
//! while the other deliveries of it wait for its lock. Every key's effect is applied exactly once, no deadlock (1213) or lock wait timeout
//! (1205) reaches a caller, and the store's internal retries are counted
//! (`inbox_runtime::store::mysql_lock_retries()` and the metric `inbox_store_lock_retries_total`).
//!
//! Also: a transaction InnoDB rolled back under a handler that did not notice (a swallowed
//! deadlock) is caught before `COMMIT`.
//!
//! Needs `MYSQL_URL` (set by `scripts/test.sh`, which starts a throwaway MariaDB).

#![allow(missing_docs)]

use std::collections::HashSet;
use std::sync::{Arc, LazyLock, Mutex};
use std::time::Duration;

use inbox_runtime::{Dispatcher, Envelope, Message, Outcome, RetryPolicy};
use inbox_tests::{MYSQL_APPLY_EFFECT, count};
use metrics_util::debugging::{DebugValue, DebuggingRecorder};
use serde::{Deserialize, Serialize};
use sqlx::MySql;

#[derive(Debug, Clone, Serialize, Deserialize, Message)]
#[message(name = "storm.item")]
pub struct Item {
    #[message(key)]
    pub id: String,
    pub amount: i64,
}

/// Keys whose first attempt fails.
static FAIL_FIRST: LazyLock<Mutex<HashSet<String>>> = LazyLock::new(|| Mutex::new(HashSet::new()));

#[derive(Debug, thiserror::Error)]
pub enum StormError {
    #[error("first attempt of {0} fails")]
    FirstAttempt(String),
    #[error(transparent)]
    Db(#[from] sqlx::Error),
}

#[inbox_runtime::idempotent(consumer = "storm")]
async fn apply(conn: &mut sqlx::MySqlConnection, msg: Item) -> Result<(), StormError> {
    sqlx::query(MYSQL_APPLY_EFFECT)
        .bind(format!("item:{}", msg.id))
        .bind(msg.amount)
        .execute(&mut *conn)
        .await?;
    // Fails after writing: the effect and the claim roll back (after holding the key a while,
    // so that other deliveries of it queue up behind the lock).
    if FAIL_FIRST.lock().unwrap().remove(&msg.id) {
        tokio::time::sleep(Duration::from_millis(30)).await;
        return Err(StormError::FirstAttempt(msg.id));
    }
    Ok(())
}

fn envelope(id: &str, amount: i64) -> Envelope {
    let item = Item {
        id: id.to_owned(),
        amount,
    };
    Envelope::new(Item::NAME, serde_json::to_vec(&item).unwrap())
}

/// What the deliveries came to.
#[derive(Debug, Default, PartialEq, Eq)]
struct Tally {
    processed: usize,
    duplicates: usize,
    first_attempts_failed: usize,
}

/// Delivers `queue` from `tasks` concurrent tasks; panics on any outcome but processed,
/// duplicate and the designed first-attempt failures.
async fn deliver(dispatcher: Arc<Dispatcher<MySql>>, queue: Vec<Envelope>, tasks: usize) -> Tally {
    let queue = Arc::new(Mutex::new(queue));
    let mut handles = Vec::new();
    for _ in 0..tasks {
        let (queue, dispatcher) = (queue.clone(), dispatcher.clone());
        handles.push(tokio::spawn(async move {
            let mut tally = Tally::default();
            loop {
                let Some(envelope) = queue.lock().unwrap().pop() else {
                    break;
                };
                for outcome in dispatcher.dispatch(&envelope).await.unwrap() {
                    match outcome.result {
                        Ok(Outcome::Processed(())) => tally.processed += 1,
                        Ok(Outcome::Duplicate) => tally.duplicates += 1,
                        Err(error) if error.kind() == "handler" => {
                            assert!(error.to_string().contains("first attempt of"), "{error}");
                            tally.first_attempts_failed += 1;
                        }
                        // A deadlock or lock wait timeout would come out here (`database`).
                        other => panic!("unexpected outcome {other:?}"),
                    }
                }
            }
            tally
        }));
    }
    let mut total = Tally::default();
    for handle in handles {
        let tally = handle.await.unwrap();
        total.processed += tally.processed;
        total.duplicates += tally.duplicates;
        total.first_attempts_failed += tally.first_attempts_failed;
    }
    total
}

/// The sum of the counter `name` in a snapshot.
fn counter(
    snapshot: Vec<(
        metrics_util::CompositeKey,
        Option<metrics::Unit>,
        Option<metrics::SharedString>,
        DebugValue,
    )>,
    name: &str,
) -> u64 {
    snapshot
        .into_iter()
        .filter(|(key, ..)| key.key().name() == name)
        .map(|(.., value)| match value {
            DebugValue::Counter(n) => n,
            _ => 0,
        })
        .sum()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_duplicate_storm_applies_every_key_once_and_hides_innodb_lock_errors() {
    let recorder = DebuggingRecorder::new();
    let snapshotter = recorder.snapshotter();
    recorder
        .install()
        .expect("the only recorder of this binary");

    let pool = inbox_tests::mysql_pool(24).await;
    let policy = RetryPolicy::default().retry_delays(Duration::ZERO, Duration::ZERO);
    let dispatcher = Arc::new(
        Dispatcher::from_registry(pool.clone())
            .unwrap()
            .with_retry_policy(policy),
    );
    let retries_before = inbox_runtime::store::mysql_lock_retries();

    // 500 keys × 3 deliveries, shuffled; every 25th key's first attempt fails.
    let keys: Vec<String> = (0..500).map(|i| format!("k{i:03}")).collect();
    FAIL_FIRST
        .lock()
        .unwrap()
        .extend(keys.iter().step_by(25).cloned());
    let mut queue: Vec<Envelope> = keys
        .iter()
        .enumerate()
        .flat_map(|(i, key)| std::iter::repeat_n(envelope(key, i as i64), 3))
        .collect();
    {
        use rand::SeedableRng;
        use rand::seq::SliceRandom;
        queue.shuffle(&mut rand_chacha::ChaCha8Rng::seed_from_u64(16));
    }
    let storm = deliver(dispatcher.clone(), queue, 16).await;
    assert_eq!(
        storm,
        Tally {
            processed: 500,
            duplicates: 1500 - 500 - 20,
            first_attempts_failed: 20
        }
    );

    // A key whose first attempt failed, redelivered by 8 tasks at once.
    FAIL_FIRST.lock().unwrap().insert("again".to_owned());
    let first = dispatcher.dispatch(&envelope("again", 7)).await.unwrap();
    assert_eq!(first[0].result.as_ref().unwrap_err().kind(), "handler");
    let redelivered = deliver(dispatcher.clone(), vec![envelope("again", 7); 8], 8).await;
    assert_eq!(
        redelivered,
        Tally {
            processed: 1,
            duplicates: 7,
            first_attempts_failed: 0
        }
    );

    // Fresh keys whose first attempt fails while 7 more deliveries of each wait for it: the
    // rolled-back insert is where InnoDB reports deadlocks among the waiters.
    let fresh: Vec<String> = (0..20).map(|i| format!("w{i:02}")).collect();
    FAIL_FIRST.lock().unwrap().extend(fresh.iter().cloned());
    let queue: Vec<Envelope> = fresh
        .iter()
        .flat_map(|key| std::iter::repeat_n(envelope(key, 1), 8))
        .collect();
    let waiting = deliver(dispatcher.clone(), queue, 8).await;
    assert_eq!(
        waiting,
        Tally {
            processed: 20,
            duplicates: 20 * 8 - 20 - 20,
            first_attempts_failed: 20
        }
    );

    // Exactly one effect per key.
    assert_eq!(
        count::<MySql>(&pool, "SELECT COUNT(*) FROM effects").await,
        521
    );
    assert_eq!(
        count::<MySql>(&pool, "SELECT COUNT(*) FROM effects WHERE applied <> 1").await,
        0
    );
    assert_eq!(
        count::<MySql>(&pool, "SELECT CAST(SUM(total) AS SIGNED) FROM effects").await,
        (0..500).sum::<i64>() + 7 + 20
    );
    assert_eq!(
        count::<MySql>(
            &pool,
            "SELECT COUNT(*) FROM inbox_messages WHERE status = 'processed'"
        )
        .await,
        521
    );

    let retries = inbox_runtime::store::mysql_lock_retries() - retries_before;
    let metric = counter(
        snapshotter.snapshot().into_vec(),
        "inbox_store_lock_retries_total",
    );
    println!("storm: InnoDB deadlocks and lock wait timeouts retried internally: {retries}");
    // The failed first attempts make InnoDB report deadlocks to the deliveries waiting on them
    // (120 in every run measured): the retry path ran, and the metric saw each retry.
    assert!(
        retries > 0,
        "no internal retry: the lock-error path was not exercised"
    );
    assert_eq!(metric, retries, "the metric counts every internal retry");
}

#[derive(Debug, Clone, Serialize, Deserialize, Message)]
#[message(name = "storm.swallow")]
pub struct Swallow {
    #[message(key)]
    pub id: String,
}

/// Writes its effect, then ends the transaction as an InnoDB deadlock does (a `ROLLBACK` the
/// handler does not see as an error), writes again (in autocommit now) and returns `Ok`.
#[inbox_runtime::idempotent(consumer = "swallow")]
async fn swallow(conn: &mut sqlx::MySqlConnection, msg: Swallow) -> Result<(), sqlx::Error> {
    sqlx::query(MYSQL_APPLY_EFFECT)
        .bind(format!("before:{}", msg.id))
        .bind(1_i64)
        .execute(&mut *conn)
        .await?;
    sqlx::raw_sql("ROLLBACK").execute(&mut *conn).await?;
    sqlx::query(MYSQL_APPLY_EFFECT)
        .bind(format!("after:{}", msg.id))
        .bind(1_i64)
        .execute(&mut *conn)
        .await?;
    Ok(())
}

/// A transaction that InnoDB rolled back under the handler (as on a deadlock the handler
/// swallowed) is caught before `COMMIT`: the claim is gone, so the message is an error, never
/// processed; the write made before the rollback is undone (the one after it ran in autocommit,
/// as the README says).
#[tokio::test]
async fn a_transaction_rolled_back_under_the_handler_is_not_processed() {
    let pool = inbox_tests::mysql_pool(2).await;
    let mut conn = pool.acquire().await.unwrap();
    let result = swallow(&mut conn, Swallow { id: "s".into() }).await;
    assert!(
        result.is_err(),
        "reported {result:?} after the claim was rolled back"
    );
    assert_eq!(
        count::<MySql>(
            &pool,
            "SELECT COUNT(*) FROM inbox_messages WHERE status = 'processed'"
        )
        .await,
        0
    );
    assert_eq!(inbox_tests::effect::<MySql>(&pool, "before:s").await, None);
    assert_eq!(
        inbox_tests::effect::<MySql>(&pool, "after:s").await,
        Some((1, 1))
    );
}
