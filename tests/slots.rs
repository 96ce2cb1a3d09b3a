//! Held connections (`ConnectionSlot`, the Worker's kept slots) and optimistic batches under
//! adversity: killed and timed-out connections, cancellation, small and shared pools, handlers
//! that fail once or swallow errors. Each test marked "Regression" describes the failure a review
//! of the first version found (as it was then) and asserts the correct behaviour.
//!
//! PostgreSQL, except a SQLite regression and the Worker with small pools, which runs on both
//! backends (`inbox_tests::backend_matrix!`).

#![allow(missing_docs)]

use std::collections::HashSet;
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, Ordering as AtomicOrdering};
use std::time::Duration;

use inbox_runtime::source::Settlement;
use inbox_runtime::source::memory::MemorySource;
use inbox_runtime::{
    Classify, ConnectionSlot, Dispatcher, Envelope, Error, ErrorClass, Message, Outcome, Worker,
};
use inbox_tests::{APPLY_EFFECT, effect, envelope, inbox_row};
use serde::{Deserialize, Serialize};
use sqlx::{PgConnection, PgPool, SqliteConnection};
use tokio_util::sync::CancellationToken;

#[derive(Debug, Clone, Serialize, Deserialize, Message)]
#[message(name = "review.pay")]
pub struct Pay {
    #[message(key)]
    pub id: String,
    pub amount: i64,
    /// "", "sleep", "swallow", "flaky", "frozen", "slow"
    #[serde(default)]
    pub mode: String,
}

#[derive(Debug, thiserror::Error)]
pub enum PayError {
    #[error("permanent: {0}")]
    Permanent(String),
    #[error("transient: {0}")]
    Transient(String),
    #[error(transparent)]
    Db(#[from] sqlx::Error),
}

impl Classify for PayError {
    fn class(&self) -> ErrorClass {
        match self {
            PayError::Permanent(_) => ErrorClass::Permanent,
            PayError::Transient(_) => ErrorClass::Transient,
            PayError::Db(error) => error.class(),
        }
    }
}

/// Ids whose first call has already failed (mode "flaky").
static FLAKY_SEEN: Mutex<Vec<String>> = Mutex::new(Vec::new());
/// Calls so far per id (mode "blip": fails transiently on the first `BLIPS` calls).
static BLIP_SEEN: Mutex<Vec<String>> = Mutex::new(Vec::new());
const BLIPS: usize = 1;
/// While set, mode "sleep" sleeps 3 s after its write.
static SLEEPY: AtomicBool = AtomicBool::new(true);

#[inbox_runtime::idempotent(consumer = "review-pay")]
pub async fn pg_pay(conn: &mut PgConnection, msg: Pay) -> Result<(), PayError> {
    sqlx::query(APPLY_EFFECT)
        .bind(&msg.id)
        .bind(msg.amount)
        .execute(&mut *conn)
        .await?;
    match msg.mode.as_str() {
        "sleep" if SLEEPY.load(AtomicOrdering::SeqCst) => {
            tokio::time::sleep(Duration::from_secs(3)).await;
        }
        "slow" => tokio::time::sleep(Duration::from_millis(5)).await,
        "sec" => tokio::time::sleep(Duration::from_secs(1)).await,
        "swallow" => {
            let _ = sqlx::query("SELECT 1 / 0").execute(&mut *conn).await;
        }
        "flaky" => {
            let mut seen = FLAKY_SEEN.lock().unwrap();
            if !seen.contains(&msg.id) {
                seen.push(msg.id.clone());
                return Err(PayError::Permanent(format!("first call of {}", msg.id)));
            }
        }
        "frozen" => return Err(PayError::Permanent("frozen".into())),
        "blip" => {
            let mut seen = BLIP_SEEN.lock().unwrap();
            let calls = seen.iter().filter(|id| **id == msg.id).count();
            seen.push(msg.id.clone());
            if calls < BLIPS {
                return Err(PayError::Transient(format!(
                    "call {} of {}",
                    calls + 1,
                    msg.id
                )));
            }
        }
        _ => {}
    }
    Ok(())
}

#[derive(Debug, Clone, Serialize, Deserialize, Message)]
#[message(name = "review.lite")]
pub struct Lite {
    #[message(key)]
    pub id: String,
    pub amount: i64,
    #[serde(default)]
    pub poison: bool,
}

/// SQLite: writes its effect; a `poison` message also makes a best-effort insert into a table
/// with a unique key (`INSERT OR ROLLBACK`) and ignores its failure.
#[inbox_runtime::idempotent(consumer = "review-lite")]
pub async fn lite(conn: &mut SqliteConnection, msg: Lite) -> Result<(), sqlx::Error> {
    if msg.poison {
        let _ = sqlx::query("INSERT OR ROLLBACK INTO audit (k) VALUES ('dup')")
            .execute(&mut *conn)
            .await;
        return Ok(());
    }
    sqlx::query(APPLY_EFFECT)
        .bind(&msg.id)
        .bind(msg.amount)
        .execute(&mut *conn)
        .await?;
    Ok(())
}

fn pay(id: &str, amount: i64, mode: &str) -> Envelope {
    envelope(&Pay {
        id: id.into(),
        amount,
        mode: mode.into(),
    })
}

fn lite_env(id: &str, poison: bool) -> Envelope {
    envelope(&Lite {
        id: id.into(),
        amount: 1,
        poison,
    })
}

fn kind(result: &Result<Outcome<()>, Error<inbox_runtime::BoxError>>) -> String {
    match result {
        Ok(outcome) => outcome.kind().to_owned(),
        Err(Error::Handler(f)) => format!("handler:{:?}", f.disposition),
        Err(Error::Database(e)) => format!("database:{}", e.operation),
        Err(e) => e.kind().to_owned(),
    }
}

/// The kind of each envelope's (single) consumer outcome in a batch.
fn batch_kinds(
    batch: &[Result<Vec<inbox_runtime::ConsumerOutcome>, inbox_runtime::DispatchError>],
) -> Vec<String> {
    batch
        .iter()
        .map(|r| kind(&r.as_ref().unwrap()[0].result))
        .collect()
}

/// `{prefix}-single` through `dispatch`, then `{prefix}-a`, `{prefix}-batch` (with `mode`),
/// `{prefix}-z` through `dispatch_batch`: the single outcome's kind and the batch's kinds.
async fn single_and_batch(
    dispatcher: &Dispatcher<sqlx::Postgres>,
    prefix: &str,
    mode: &str,
) -> (String, Vec<String>) {
    let single = dispatcher
        .dispatch(&pay(&format!("{prefix}-single"), 1, mode))
        .await
        .unwrap();
    let batch = dispatcher
        .dispatch_batch(&[
            pay(&format!("{prefix}-a"), 1, ""),
            pay(&format!("{prefix}-batch"), 1, mode),
            pay(&format!("{prefix}-z"), 1, ""),
        ])
        .await;
    (kind(&single[0].result), batch_kinds(&batch))
}

async fn count_conflicts(pool: &PgPool) -> i64 {
    sqlx::query_scalar("SELECT COUNT(*) FROM inbox_rejections WHERE reason = 'conflict'")
        .fetch_one(pool)
        .await
        .unwrap()
}

/// The `(status, attempts)` of a `review-pay` key.
async fn row(pool: &PgPool, key: &str) -> Option<(String, i32)> {
    inbox_row(pool, "review-pay", key).await
}

/// Terminates every client backend of the pool's database except the caller's own.
async fn kill_others(pool: &PgPool) -> usize {
    let killed: Vec<bool> = sqlx::query_scalar(
        "SELECT pg_terminate_backend(pid) FROM pg_stat_activity \
         WHERE datname = current_database() AND pid <> pg_backend_pid() \
         AND backend_type = 'client backend'",
    )
    .fetch_all(pool)
    .await
    .unwrap();
    killed.len()
}

// ---------------------------------------------------------------------------------------------
// Killed held connection, then a refused delivery.
// ---------------------------------------------------------------------------------------------

/// Regression: after the server kills the connection a slot holds (idle between deliveries),
/// `record_rejection_on` fails on the dead connection instead of using a live one; `dispatch_on`
/// retries on a new connection, `record_rejection_on` does not. The plain `record_rejection`
/// (fresh pool acquire, which pings first) succeeds in the same situation.
#[tokio::test]
async fn record_rejection_on_after_held_connection_killed() {
    let pool = inbox_tests::pg_pool(4).await;
    let dispatcher = Dispatcher::from_registry(pool.clone()).unwrap();
    let mut slot = ConnectionSlot::new();
    let out = dispatcher
        .dispatch_on(&mut slot, &pay("k1", 1, ""))
        .await
        .unwrap();
    assert_eq!(kind(&out[0].result), "processed");
    assert!(kill_others(&pool).await >= 1);
    tokio::time::sleep(Duration::from_millis(200)).await;

    let unknown = Envelope::new("review.nope", b"{}".to_vec());
    let error = dispatcher
        .dispatch_on(&mut slot, &unknown)
        .await
        .unwrap_err();
    let recorded = dispatcher
        .record_rejection_on(&mut slot, &unknown, &error)
        .await;
    let kept: i64 = sqlx::query_scalar("SELECT COUNT(*) FROM inbox_rejections")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert!(
        recorded.is_ok() && kept == 1,
        "record_rejection_on: {recorded:?}, rows kept: {kept}"
    );
}

/// The same through a Worker: a refused delivery (unknown message name) arriving after the
/// held connection was killed is rejected to the broker instead of being kept and acked.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn worker_keeps_refused_delivery_after_held_connection_killed() {
    let pool = inbox_tests::pg_pool(3).await;
    let dispatcher = Dispatcher::from_registry(pool.clone()).unwrap();
    let source = MemorySource::new("mem");
    let handle = source.handle();
    let worker = Worker::new(dispatcher).concurrency(1);
    let running = tokio::spawn(async move { worker.run(source, CancellationToken::new()).await });

    handle.push(pay("w1", 1, ""));
    for _ in 0..100 {
        if handle.settlements().len() == 1 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(handle.settlements().len(), 1);
    assert!(kill_others(&pool).await >= 1);
    tokio::time::sleep(Duration::from_millis(200)).await;

    let refused = handle.push(Envelope::new("review.nope", b"{}".to_vec()));
    handle.close();
    let report = running.await.unwrap().unwrap();
    let settled: Vec<Settlement> = handle
        .settlements()
        .into_iter()
        .filter(|(id, _)| *id == refused)
        .map(|(_, s)| s)
        .collect();
    let kept: i64 = sqlx::query_scalar("SELECT COUNT(*) FROM inbox_rejections")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(
        (settled, kept),
        (vec![Settlement::Ack], 1),
        "report: {report:?}"
    );
}

// ---------------------------------------------------------------------------------------------
// Cancellation while the slot's connection is mid-transaction.
// ---------------------------------------------------------------------------------------------

/// Regression: a `dispatch_on` future dropped mid-handler leaves the transaction (and the claim's row
/// lock) open on the server for as long as the slot is not used again: the rollback sqlx queues
/// on drop is only sent with the connection's next statement. Another delivery of the same key on
/// another connection blocks until then. With `dispatch` (connection returned to the pool, which
/// pings it and so flushes the rollback) the second delivery goes through at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cancelled_dispatch_on_releases_the_claim_at_once() {
    let pool = inbox_tests::pg_pool(4).await;
    let dispatcher = Dispatcher::from_registry(pool.clone()).unwrap();
    SLEEPY.store(true, AtomicOrdering::SeqCst);

    // Control: `dispatch` cancelled, then the key redelivered on another connection.
    let control = pay("c-control", 1, "sleep");
    let cancelled =
        tokio::time::timeout(Duration::from_millis(300), dispatcher.dispatch(&control)).await;
    assert!(cancelled.is_err());
    SLEEPY.store(false, AtomicOrdering::SeqCst);
    let again = tokio::time::timeout(Duration::from_secs(2), dispatcher.dispatch(&control)).await;
    let control_kind = again.map(|r| kind(&r.unwrap()[0].result));
    SLEEPY.store(true, AtomicOrdering::SeqCst);

    // The same with a slot that stays alive (and idle) after the cancellation.
    let mut slot = ConnectionSlot::new();
    let held = pay("c-held", 1, "sleep");
    let cancelled = tokio::time::timeout(
        Duration::from_millis(300),
        dispatcher.dispatch_on(&mut slot, &held),
    )
    .await;
    assert!(cancelled.is_err());
    SLEEPY.store(false, AtomicOrdering::SeqCst);
    tokio::time::sleep(Duration::from_secs(3)).await; // the cancelled handler's sleep is long over
    let idle_in_tx: i64 = sqlx::query_scalar(
        "SELECT COUNT(*) FROM pg_stat_activity WHERE datname = current_database() \
         AND state = 'idle in transaction'",
    )
    .fetch_one(&pool)
    .await
    .unwrap();
    let again = tokio::time::timeout(Duration::from_secs(2), dispatcher.dispatch(&held)).await;
    let held_kind = again.map(|r| kind(&r.unwrap()[0].result));
    // The slot is reusable afterwards.
    let reuse = dispatcher
        .dispatch_on(&mut slot, &pay("c-after", 1, ""))
        .await
        .unwrap();
    assert_eq!(kind(&reuse[0].result), "processed");
    drop(slot);

    assert_eq!(
        (control_kind.as_deref().ok(), held_kind.as_deref().ok()),
        (Some("processed"), Some("processed")),
        "None = the redelivery was still blocked after 2 s; sessions idle in transaction \
         3 s after the cancellation: {idle_in_tx}"
    );
}

/// reusing a slot after its dispatch was cancelled mid-transaction: the queued rollback
/// runs first; the cancelled attempt leaves nothing; the key is then processed once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slot_reused_after_cancellation_applies_once() {
    let pool = inbox_tests::pg_pool(4).await;
    let dispatcher = Dispatcher::from_registry(pool.clone()).unwrap();
    SLEEPY.store(true, AtomicOrdering::SeqCst);
    let mut slot = ConnectionSlot::new();
    let env = pay("r1", 5, "sleep");
    let cancelled = tokio::time::timeout(
        Duration::from_millis(300),
        dispatcher.dispatch_on(&mut slot, &env),
    )
    .await;
    assert!(cancelled.is_err());
    SLEEPY.store(false, AtomicOrdering::SeqCst);
    let out = dispatcher.dispatch_on(&mut slot, &env).await.unwrap();
    assert_eq!(kind(&out[0].result), "processed");
    let out = dispatcher.dispatch_on(&mut slot, &env).await.unwrap();
    assert_eq!(kind(&out[0].result), "duplicate");
    assert_eq!(effect(&pool, "r1").await, Some((1, 5)));
    assert_eq!(row(&pool, "r1").await, Some(("processed".into(), 1)));
    // Batches on the same slot after a cancelled batch.
    SLEEPY.store(true, AtomicOrdering::SeqCst);
    let batch = [pay("r2", 1, ""), pay("r3", 1, "sleep")];
    let cancelled = tokio::time::timeout(
        Duration::from_millis(300),
        dispatcher.dispatch_batch_on(&mut slot, &batch),
    )
    .await;
    assert!(cancelled.is_err());
    SLEEPY.store(false, AtomicOrdering::SeqCst);
    let out = dispatcher.dispatch_batch_on(&mut slot, &batch).await;
    let kinds: Vec<String> = out
        .iter()
        .map(|r| kind(&r.as_ref().unwrap()[0].result))
        .collect();
    assert_eq!(kinds, ["processed", "processed"]);
    assert_eq!(effect(&pool, "r2").await, Some((1, 1)));
    assert_eq!(effect(&pool, "r3").await, Some((1, 1)));
}

// ---------------------------------------------------------------------------------------------
// Optimistic batches.
// ---------------------------------------------------------------------------------------------

/// a handler that swallows a database error inside an optimistic batch: the same outcome
/// as `dispatch` (database/verify error, attempt counted, no effect), the others processed once.
#[tokio::test]
async fn swallowed_error_in_optimistic_batch_matches_dispatch() {
    let pool = inbox_tests::pg_pool(4).await;
    let dispatcher = Dispatcher::from_registry(pool.clone()).unwrap();
    let (single, kinds) = single_and_batch(&dispatcher, "s", "swallow").await;
    assert_eq!(single, "database:verify");
    assert_eq!(kinds, ["processed", "database:verify", "processed"]);
    assert_eq!(row(&pool, "s-single").await, row(&pool, "s-batch").await);
    assert_eq!(row(&pool, "s-batch").await, Some(("failed".into(), 1)));
    assert_eq!(effect(&pool, "s-batch").await, None);
    assert_eq!(effect(&pool, "s-a").await, Some((1, 1)));
    assert_eq!(effect(&pool, "s-z").await, Some((1, 1)));
}

/// Regression: a handler that fails (permanently) on its first call only. `dispatch` reports it
/// dead (the attempt counted, the message dead-lettered); `dispatch_batch` silently calls it a
/// second time (the isolated re-run) and reports it processed: the first failure is neither
/// returned nor recorded, although `dispatch_batch` promises "exactly as dispatch would".
#[tokio::test]
async fn handler_failing_on_first_call_only_batch_matches_dispatch() {
    let pool = inbox_tests::pg_pool(4).await;
    let dispatcher = Dispatcher::from_registry(pool.clone()).unwrap();
    let (single, kinds) = single_and_batch(&dispatcher, "f", "flaky").await;
    assert_eq!(
        (single.as_str(), row(&pool, "f-single").await),
        (kinds[1].as_str(), row(&pool, "f-batch").await),
        "dispatch vs dispatch_batch"
    );
    assert_eq!(kinds[0], "processed");
}

/// conflicts recorded in the optimistic run are not recorded again when it is rolled
/// back and re-run isolated.
#[tokio::test]
async fn conflict_recorded_once_when_optimistic_run_is_rerun() {
    let pool = inbox_tests::pg_pool(4).await;
    let dispatcher = Dispatcher::from_registry(pool.clone()).unwrap();
    dispatcher.dispatch(&pay("x0", 1, "")).await.unwrap();
    let batch = dispatcher
        .dispatch_batch(&[pay("x0", 2, ""), pay("x1", 1, ""), pay("x2", 1, "frozen")])
        .await;
    let kinds = batch_kinds(&batch);
    assert_eq!(kinds, ["conflict", "processed", "handler:Dead"]);
    let conflicts = count_conflicts(&pool).await;
    assert_eq!(conflicts, 1);
    // And a batch whose isolated run fails as a whole (swallowed error) → single path.
    let batch = dispatcher
        .dispatch_batch(&[pay("x0", 3, ""), pay("x3", 1, "swallow")])
        .await;
    let kinds = batch_kinds(&batch);
    assert_eq!(kinds, ["conflict", "database:verify"]);
    let conflicts = count_conflicts(&pool).await;
    assert_eq!(conflicts, 2);
}

/// Regression (SQLite): in the optimistic run a handler that swallows an error which rolls the whole
/// SQLite transaction back (`INSERT OR ROLLBACK`, `RAISE(ROLLBACK)` in a trigger, SQLITE_FULL…)
/// leaves the connection in autocommit: the handlers after it in the batch then commit their
/// writes statement by statement, without their claims; COMMIT fails, the batch falls back to
/// the single path, and those messages are applied a second time. (Before the optimistic run,
/// the savepoint's RELEASE failed right after the swallowing handler, so nothing after it ran
/// outside the transaction; `dispatch` runs each message in its own transaction.)
#[tokio::test]
async fn sqlite_batch_applies_once_after_a_swallowed_rollback() {
    let (pool, _guard) = inbox_tests::sqlite_pool(2).await;
    sqlx::query("CREATE TABLE audit (k TEXT PRIMARY KEY)")
        .execute(&pool)
        .await
        .unwrap();
    sqlx::query("INSERT INTO audit (k) VALUES ('dup')")
        .execute(&pool)
        .await
        .unwrap();
    let dispatcher = Dispatcher::from_registry(pool.clone()).unwrap();
    let batch = dispatcher
        .dispatch_batch(&[
            lite_env("l1", false),
            lite_env("l2", true),
            lite_env("l3", false),
        ])
        .await;
    let kinds = batch_kinds(&batch);
    let applied: Vec<(String, i64)> =
        sqlx::query_as("SELECT effect_key, applied FROM effects ORDER BY effect_key")
            .fetch_all(&pool)
            .await
            .unwrap();
    assert_eq!(
        applied,
        [("l1".to_owned(), 1), ("l3".to_owned(), 1)],
        "outcomes: {kinds:?}"
    );
}

// ---------------------------------------------------------------------------------------------
// Worker with small pools.
// ---------------------------------------------------------------------------------------------

/// For the Worker with small pools, on both backends.
#[derive(Debug, Clone, Serialize, Deserialize, Message)]
#[message(name = "review.small")]
pub struct Small {
    #[message(key)]
    pub id: String,
}

inbox_tests::backend_matrix! {
    /// Writes its effect, then takes 5 ms inside the transaction.
    #[inbox_runtime::idempotent(consumer = "review-small")]
    async fn small(conn: &mut Conn, msg: Small) -> Result<(), sqlx::Error> {
        sqlx::query(APPLY_EFFECT)
            .bind(&msg.id)
            .bind(1_i64)
            .execute(&mut *conn)
            .await?;
        tokio::time::sleep(Duration::from_millis(5)).await;
        Ok(())
    }

    /// `n` messages through a Worker of `concurrency` on a fresh pool of `connections`.
    async fn run_worker(connections: u32, concurrency: usize, n: usize) -> inbox_runtime::WorkerReport {
        let (pool, _guard) = fixture_with(connections).await;
        let dispatcher = Dispatcher::from_registry(pool.clone()).unwrap();
        let source = MemorySource::new("mem");
        let handle = source.handle();
        for i in 0..n {
            handle.push(envelope(&Small { id: format!("w{i}") }));
        }
        handle.close();
        let worker = Worker::new(dispatcher)
            .concurrency(concurrency)
            .requeue_delay(Duration::from_millis(10));
        tokio::time::timeout(
            Duration::from_secs(60),
            worker.run(source, CancellationToken::new()),
        )
        .await
        .expect("worker did not finish in 60 s")
        .unwrap()
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn worker_pool_of_one_concurrency_four() {
        let report = run_worker(1, 4, 60).await;
        assert_eq!(
            (report.processed, report.acked, report.failed),
            (60, 60, 0),
            "{report:?}"
        );
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn worker_pool_of_two_concurrency_four() {
        let report = run_worker(2, 4, 60).await;
        assert_eq!(
            (report.processed, report.acked, report.failed),
            (60, 60, 0),
            "{report:?}"
        );
    }
}

/// connections killed repeatedly while a Worker runs: every message applied exactly
/// once, every delivery eventually acked.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn worker_with_connections_killed_applies_each_message_once() {
    let pool = inbox_tests::pg_pool(4).await;
    // A separate pool for the killer, so that it is not killed itself.
    let killer_pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(1)
        .connect_with((*pool.connect_options()).clone())
        .await
        .unwrap();
    let dispatcher = Dispatcher::from_registry(pool.clone()).unwrap();
    let source = MemorySource::new("mem");
    let handle = source.handle();
    let n = 300;
    for i in 0..n {
        handle.push(pay(&format!("k{i}"), 1, "slow"));
    }
    handle.close();
    let stop = CancellationToken::new();
    let killer = {
        let stop = stop.clone();
        tokio::spawn(async move {
            let mut kills = 0;
            while !stop.is_cancelled() {
                tokio::time::sleep(Duration::from_millis(40)).await;
                kills += kill_others(&killer_pool).await;
            }
            kills
        })
    };
    let worker = Worker::new(dispatcher)
        .concurrency(3)
        .requeue_delay(Duration::from_millis(10));
    let report = tokio::time::timeout(
        Duration::from_secs(120),
        worker.run(source, CancellationToken::new()),
    )
    .await
    .expect("worker stuck")
    .unwrap();
    stop.cancel();
    let kills = killer.await.unwrap();
    let applied: Vec<(String, i64)> = sqlx::query_as("SELECT effect_key, applied FROM effects")
        .fetch_all(&pool)
        .await
        .unwrap();
    let twice: Vec<&(String, i64)> = applied.iter().filter(|(_, a)| *a != 1).collect();
    let keys: HashSet<&String> = applied.iter().map(|(k, _)| k).collect();
    eprintln!("kills: {kills}, report: {report:?}");
    assert!(twice.is_empty(), "applied more than once: {twice:?}");
    assert_eq!(keys.len(), n, "missing effects; report {report:?}");
    let acked = handle
        .settlements()
        .iter()
        .filter(|(_, s)| *s == Settlement::Ack)
        .count();
    assert_eq!(acked, n);
}

// ---------------------------------------------------------------------------------------------
// Server-side idle timeout of a held connection (PostgreSQL `idle_session_timeout`).
// ---------------------------------------------------------------------------------------------

/// A pool whose sessions the server closes after 1 s idle (`idle_session_timeout`, PG 14+).
async fn pool_with_idle_timeout(base: &PgPool, max: u32) -> PgPool {
    let options = (*base.connect_options())
        .clone()
        .options([("idle_session_timeout", "1000")]);
    sqlx::postgres::PgPoolOptions::new()
        .max_connections(max)
        .connect_with(options)
        .await
        .unwrap()
}

/// Regression: with `idle_session_timeout`, a slot's connection idle longer than the timeout is closed
/// by the server (FATAL 57P05). The next `dispatch_on` does not notice a lost connection (57P05
/// arrives as a database error, not I/O, and is not classified transient), so the delivery fails
/// with a database error instead of running on a new connection. `dispatch` (pool acquire pings
/// first) processes it.
#[tokio::test]
async fn dispatch_on_after_server_idle_timeout() {
    let base = inbox_tests::pg_pool(2).await;
    let pool = pool_with_idle_timeout(&base, 3).await;
    let dispatcher = Dispatcher::from_registry(pool.clone()).unwrap();
    let mut slot = ConnectionSlot::new();
    let out = dispatcher
        .dispatch_on(&mut slot, &pay("i1", 1, ""))
        .await
        .unwrap();
    assert_eq!(kind(&out[0].result), "processed");
    tokio::time::sleep(Duration::from_millis(2500)).await;
    let out = dispatcher
        .dispatch_on(&mut slot, &pay("i2", 1, ""))
        .await
        .unwrap();
    let second = format!(
        "{} {:?}",
        kind(&out[0].result),
        out[0].result.as_ref().err()
    );
    // Control: the same wait, then `dispatch` (fresh acquire).
    tokio::time::sleep(Duration::from_millis(2500)).await;
    let out = dispatcher.dispatch(&pay("i3", 1, "")).await.unwrap();
    assert_eq!(kind(&out[0].result), "processed");
    assert!(
        second.starts_with("processed "),
        "dispatch_on after idle timeout: {second}"
    );
}

/// The same through a Worker: a delivery arriving after the worker was idle longer than the
/// server's idle timeout is requeued (counted failed) instead of processed; a refused one is
/// rejected to the broker instead of kept.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn worker_after_server_idle_timeout() {
    let base = inbox_tests::pg_pool(2).await;
    let pool = pool_with_idle_timeout(&base, 3).await;
    let dispatcher = Dispatcher::from_registry(pool.clone()).unwrap();
    let source = MemorySource::new("mem");
    let handle = source.handle();
    let worker = Worker::new(dispatcher)
        .concurrency(1)
        .requeue_delay(Duration::from_millis(10));
    let running = tokio::spawn(async move { worker.run(source, CancellationToken::new()).await });
    let settled = |n: usize| {
        let handle = handle.clone();
        async move {
            for _ in 0..200 {
                if handle.settlements().len() >= n {
                    return;
                }
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            panic!("not settled");
        }
    };
    handle.push(pay("wi1", 1, ""));
    settled(1).await;
    tokio::time::sleep(Duration::from_millis(2500)).await;
    handle.push(pay("wi2", 1, ""));
    settled(2).await;
    tokio::time::sleep(Duration::from_millis(2500)).await;
    handle.push(Envelope::new("review.nope", b"{}".to_vec()));
    handle.close();
    let report = running.await.unwrap().unwrap();
    let settlements: Vec<Settlement> = handle.settlements().into_iter().map(|(_, s)| s).collect();
    assert_eq!(
        settlements,
        [Settlement::Ack, Settlement::Ack, Settlement::Ack],
        "report: {report:?}"
    );
}

/// a pool of ONE connection, held by a slot and killed: `dispatch_on` and
/// `dispatch_batch_on` replace it (the discarded connection's permit comes back) and apply once.
#[tokio::test]
async fn pool_of_one_held_connection_killed() {
    let pool = inbox_tests::pg_pool(1).await;
    let killer = sqlx::postgres::PgPoolOptions::new()
        .max_connections(1)
        .connect_with((*pool.connect_options()).clone())
        .await
        .unwrap();
    let dispatcher = Dispatcher::from_registry(pool.clone()).unwrap();
    let mut slot = ConnectionSlot::new();
    let out = dispatcher
        .dispatch_on(&mut slot, &pay("o1", 1, ""))
        .await
        .unwrap();
    assert_eq!(kind(&out[0].result), "processed");
    assert_eq!(kill_others(&killer).await, 1);
    let out = tokio::time::timeout(
        Duration::from_secs(20),
        dispatcher.dispatch_on(&mut slot, &pay("o2", 1, "")),
    )
    .await
    .expect("stuck")
    .unwrap();
    assert_eq!(kind(&out[0].result), "processed");
    assert_eq!(kill_others(&killer).await, 1);
    let out = tokio::time::timeout(
        Duration::from_secs(20),
        dispatcher.dispatch_batch_on(&mut slot, &[pay("o3", 1, ""), pay("o4", 1, "")]),
    )
    .await
    .expect("stuck");
    let kinds: Vec<String> = out
        .iter()
        .map(|r| kind(&r.as_ref().unwrap()[0].result))
        .collect();
    assert_eq!(kinds, ["processed", "processed"]);
    drop(slot);
    for k in ["o1", "o2", "o3", "o4"] {
        assert_eq!(effect(&pool, k).await, Some((1, 1)), "{k}");
    }
}

/// a batch on a slot whose connection the server closed for idleness (57P05).
#[tokio::test]
async fn dispatch_batch_on_after_server_idle_timeout() {
    let base = inbox_tests::pg_pool(2).await;
    let pool = pool_with_idle_timeout(&base, 3).await;
    let dispatcher = Dispatcher::from_registry(pool.clone()).unwrap();
    let mut slot = ConnectionSlot::new();
    let out = dispatcher
        .dispatch_batch_on(&mut slot, &[pay("bi1", 1, "")])
        .await;
    assert_eq!(kind(&out[0].as_ref().unwrap()[0].result), "processed");
    tokio::time::sleep(Duration::from_millis(2500)).await;
    let out = dispatcher
        .dispatch_batch_on(&mut slot, &[pay("bi2", 1, ""), pay("bi3", 1, "")])
        .await;
    let kinds: Vec<String> = out
        .iter()
        .map(|r| kind(&r.as_ref().unwrap()[0].result))
        .collect();
    assert_eq!(kinds, ["processed", "processed"]);
}

// ---------------------------------------------------------------------------------------------
// Two Workers sharing one pool.
// ---------------------------------------------------------------------------------------------

/// Regression: each Worker keeps up to `max_connections - 1` connections for as long as it runs, even
/// idle. Two Workers on one pool (two queues consumed by one service): the first, idle, keeps
/// its connections; the second cannot get a connection for its second concurrent delivery
/// (PoolTimedOut after the pool's acquire timeout, deliveries requeued). Before, connections were
/// only taken for the duration of a dispatch and both workers shared the pool.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_workers_sharing_a_pool() {
    let base = inbox_tests::pg_pool(1).await;
    let pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(3)
        .acquire_timeout(Duration::from_secs(2))
        .connect_with((*base.connect_options()).clone())
        .await
        .unwrap();

    // Worker A: processes two deliveries concurrently, then waits (idle) on its open source.
    let source_a = MemorySource::new("a");
    let handle_a = source_a.handle();
    for i in 0..4 {
        handle_a.push(pay(&format!("a{i}"), 1, "slow"));
    }
    let worker_a = Worker::new(Dispatcher::from_registry(pool.clone()).unwrap()).concurrency(2);
    let stop_a = CancellationToken::new();
    let running_a = {
        let stop_a = stop_a.clone();
        tokio::spawn(async move { worker_a.run(source_a, stop_a).await })
    };
    for _ in 0..200 {
        if handle_a.settlements().len() == 4 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(handle_a.settlements().len(), 4);

    // Worker B, same pool, concurrency 2.
    let source_b = MemorySource::new("b");
    let handle_b = source_b.handle();
    for i in 0..20 {
        handle_b.push(pay(&format!("b{i}"), 1, "slow"));
    }
    handle_b.close();
    let worker_b = Worker::new(Dispatcher::from_registry(pool.clone()).unwrap())
        .concurrency(2)
        .requeue_delay(Duration::from_millis(10));
    let started = std::time::Instant::now();
    let stop_b = CancellationToken::new();
    let running_b = {
        let stop_b = stop_b.clone();
        tokio::spawn(async move { worker_b.run(source_b, stop_b).await })
    };
    while !running_b.is_finished() && started.elapsed() < Duration::from_secs(30) {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    stop_b.cancel();
    let report_b = running_b.await.unwrap().unwrap();
    let took = started.elapsed();
    stop_a.cancel();
    running_a.await.unwrap().unwrap();
    assert_eq!(
        (report_b.processed, report_b.failed, report_b.requeued),
        (20, 0, 0),
        "worker B took {took:?}: {report_b:?}"
    );
}

/// Regression: concurrency above the pool size. Pool of 3 (acquire timeout 3.5 s), concurrency 8, eight
/// deliveries whose handler takes 1 s. Before: 8 deliveries over 3 connections, the longest
/// wait for a connection 2 s. Now: the worker keeps 2 connections for 2 "kept" slots, which
/// finish their delivery after 1 s and then sit idle in the free list holding their connections,
/// while the 6 other deliveries queue for the one remaining connection (waits of up to 5 s):
/// the later ones fail with PoolTimedOut and are requeued.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn worker_concurrency_above_pool_size_does_not_time_out() {
    let base = inbox_tests::pg_pool(1).await;
    let pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(3)
        .acquire_timeout(Duration::from_millis(3500))
        .connect_with((*base.connect_options()).clone())
        .await
        .unwrap();
    let source = MemorySource::new("mem");
    let handle = source.handle();
    for i in 0..8 {
        handle.push(pay(&format!("c{i}"), 1, "sec"));
    }
    handle.close();
    let worker = Worker::new(Dispatcher::from_registry(pool.clone()).unwrap())
        .concurrency(8)
        .requeue_delay(Duration::from_millis(10));
    let started = std::time::Instant::now();
    let report = worker.run(source, CancellationToken::new()).await.unwrap();
    let took = started.elapsed();
    assert_eq!(
        (report.processed, report.failed, report.requeued),
        (8, 0, 0),
        "took {took:?}: {report:?}"
    );
}

/// a handler failing transiently on its first call, in a batch: optimistic run fails,
/// isolated run succeeds; same outcome and row as `dispatch` (which retries in-process).
#[tokio::test]
async fn transient_first_call_in_batch_matches_dispatch() {
    let pool = inbox_tests::pg_pool(4).await;
    let dispatcher = Dispatcher::from_registry(pool.clone()).unwrap();
    let (single, kinds) = single_and_batch(&dispatcher, "t", "blip").await;
    assert_eq!(single, "processed");
    assert_eq!(kinds, ["processed", "processed", "processed"]);
    assert_eq!(row(&pool, "t-single").await, row(&pool, "t-batch").await);
    for k in ["t-single", "t-a", "t-batch", "t-z"] {
        assert_eq!(effect(&pool, k).await, Some((1, 1)), "{k}");
    }
}

/// Pool `max_lifetime` is not honoured by a held slot (only MAX_HOLD = 5 min is): with a
/// max_lifetime of 1 s, `dispatch_on` keeps using the same server session after 2 s, while
/// `dispatch` (pool acquire) replaces it.
#[tokio::test]
async fn held_slot_honours_pool_max_lifetime() {
    let base = inbox_tests::pg_pool(1).await;
    let pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(2)
        .max_lifetime(Duration::from_secs(1))
        .connect_with((*base.connect_options()).clone())
        .await
        .unwrap();
    let observer = base; // a connection of another pool to look at pg_stat_activity
    let sessions = || async {
        let mut pids: Vec<i32> = sqlx::query_scalar(
            "SELECT pid FROM pg_stat_activity WHERE datname = current_database() \
             AND backend_type = 'client backend' AND pid <> pg_backend_pid()",
        )
        .fetch_all(&observer)
        .await
        .unwrap();
        pids.sort();
        pids
    };
    let dispatcher = Dispatcher::from_registry(pool.clone()).unwrap();
    let mut slot = ConnectionSlot::new();
    dispatcher
        .dispatch_on(&mut slot, &pay("ml1", 1, ""))
        .await
        .unwrap();
    let before = sessions().await;
    tokio::time::sleep(Duration::from_secs(2)).await;
    dispatcher
        .dispatch_on(&mut slot, &pay("ml2", 1, ""))
        .await
        .unwrap();
    let after = sessions().await;
    assert!(
        before.iter().all(|pid| !after.contains(pid)),
        "sessions older than max_lifetime still in use: before {before:?}, after {after:?}"
    );
}

/// batches on one held slot while connections are killed repeatedly: every message
/// applied once; a message not reported processed is redelivered in the next batch.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn batches_on_a_slot_with_connections_killed_apply_once() {
    let pool = inbox_tests::pg_pool(3).await;
    let killer_pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(1)
        .connect_with((*pool.connect_options()).clone())
        .await
        .unwrap();
    let stop = CancellationToken::new();
    let killer = {
        let stop = stop.clone();
        tokio::spawn(async move {
            let mut kills = 0;
            while !stop.is_cancelled() {
                tokio::time::sleep(Duration::from_millis(25)).await;
                kills += kill_others(&killer_pool).await;
            }
            kills
        })
    };
    let dispatcher = Dispatcher::from_registry(pool.clone()).unwrap();
    let mut slot = ConnectionSlot::new();
    let mut pending: Vec<String> = (0..100).map(|i| format!("b{i}")).collect();
    let mut rounds = 0;
    while !pending.is_empty() && rounds < 500 {
        rounds += 1;
        let chunk: Vec<String> = pending.iter().take(20).cloned().collect();
        let envs: Vec<Envelope> = chunk.iter().map(|id| pay(id, 1, "slow")).collect();
        let results = dispatcher.dispatch_batch_on(&mut slot, &envs).await;
        for (id, r) in chunk.iter().zip(results) {
            let done = matches!(
                r.as_ref().map(|o| o[0].result.as_ref().map(|x| x.kind())),
                Ok(Ok("processed" | "duplicate"))
            );
            if done {
                pending.retain(|p| p != id);
            }
        }
    }
    stop.cancel();
    let kills = killer.await.unwrap();
    drop(slot);
    let applied: Vec<(String, i64)> = sqlx::query_as("SELECT effect_key, applied FROM effects")
        .fetch_all(&pool)
        .await
        .unwrap();
    let twice: Vec<&(String, i64)> = applied.iter().filter(|(_, a)| *a != 1).collect();
    eprintln!("kills {kills}, rounds {rounds}");
    assert!(pending.is_empty(), "never processed: {pending:?}");
    assert!(twice.is_empty(), "{twice:?}");
    assert_eq!(applied.len(), 100);
}

/// Regression (found by a first-time user): one slot used with dispatchers of two pools (two
/// databases) ran the second dispatcher's handlers on the first pool's connection. The slot now
/// hands its connection back when the pool changes.
#[tokio::test]
async fn one_slot_with_two_pools_writes_each_to_its_own_database() {
    let first = inbox_tests::pg_pool(2).await;
    let second = inbox_tests::pg_pool(2).await;
    let one = Dispatcher::from_registry(first.clone()).unwrap();
    let two = Dispatcher::from_registry(second.clone()).unwrap();
    let mut slot = ConnectionSlot::new();
    for (dispatcher, id) in [(&one, "p1"), (&two, "p2"), (&one, "p3"), (&two, "p4")] {
        let outcomes = dispatcher
            .dispatch_on(&mut slot, &pay(id, 5, ""))
            .await
            .unwrap();
        assert_eq!(kind(&outcomes[0].result), "processed");
    }
    let keys = |pool: PgPool| async move {
        let keys: Vec<String> =
            sqlx::query_scalar("SELECT message_key FROM inbox_messages ORDER BY message_key")
                .fetch_all(&pool)
                .await
                .unwrap();
        keys
    };
    assert_eq!(keys(first).await, ["p1", "p3"]);
    assert_eq!(keys(second).await, ["p2", "p4"]);
}
