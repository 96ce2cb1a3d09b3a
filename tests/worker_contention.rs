//! Batches that contend (issue 19): concurrent batches whose effects lock the same rows in
//! different orders deadlock; the batch that loses runs its deliveries one per transaction, and
//! the run finishes with every effect exact. And the batch size and the concurrency are separate
//! knobs: `concurrency(2)` with `batch(100, …)` runs batches of 100.

#![allow(missing_docs)]

use std::collections::HashSet;
use std::time::Duration;

use inbox_runtime::source::memory::MemorySource;
use inbox_runtime::{Dispatcher, Message, StopReason, Worker, WorkerReport};
use serde::{Deserialize, Serialize};
use sqlx::{MySqlConnection, MySqlPool, PgConnection, PgPool};
use tokio_util::sync::CancellationToken;

/// Hot accounts of the contention tests.
const ACCOUNTS: i32 = 20;

#[derive(Debug, Clone, Serialize, Deserialize, Message)]
#[message(name = "wc.credit")]
pub struct Credit {
    #[message(key)]
    pub id: String,
    pub account: i32,
    pub amount: i64,
}

/// The effect: one row lock per message, taken in message order; and the transaction it ran in.
#[inbox_runtime::idempotent(consumer = "wc-credit")]
pub async fn credit(conn: &mut PgConnection, msg: Credit) -> Result<(), sqlx::Error> {
    sqlx::query("UPDATE hot_accounts SET balance = balance + $1 WHERE id = $2")
        .bind(msg.amount)
        .bind(msg.account)
        .execute(&mut *conn)
        .await?;
    sqlx::query("INSERT INTO applied_in (id, tx) VALUES ($1, txid_current())")
        .bind(&msg.id)
        .execute(&mut *conn)
        .await?;
    Ok(())
}

#[derive(Debug, Clone, Serialize, Deserialize, Message)]
#[message(name = "wc.credit.mysql")]
pub struct MyCredit {
    #[message(key)]
    pub id: String,
    pub account: i32,
    pub amount: i64,
}

#[inbox_runtime::idempotent(consumer = "wc-credit-mysql")]
pub async fn my_credit(conn: &mut MySqlConnection, msg: MyCredit) -> Result<(), sqlx::Error> {
    sqlx::query("UPDATE hot_accounts SET balance = balance + ? WHERE id = ?")
        .bind(msg.amount)
        .bind(msg.account)
        .execute(&mut *conn)
        .await?;
    Ok(())
}

/// A seeded stream: `(key, account, amount)` per delivery, `redeliveries` of them repeating an
/// earlier key (same payload); and the balance each account must end with.
fn stream(deliveries: usize, redeliveries: usize) -> (Vec<(String, i32, i64)>, Vec<i64>) {
    let mut state: u64 = 0x5EED_C0DE;
    let mut next = move |n: u64| {
        state = state
            .wrapping_mul(6_364_136_223_846_793_005)
            .wrapping_add(1_442_695_040_888_963_407);
        (state >> 33) % n
    };
    let mut expected = vec![0_i64; ACCOUNTS as usize];
    let mut list: Vec<(String, i32, i64)> = (0..deliveries - redeliveries)
        .map(|i| {
            let account = 1 + next(ACCOUNTS as u64) as i32;
            let amount = 1 + next(100) as i64;
            expected[(account - 1) as usize] += amount;
            (format!("wc-{i}"), account, amount)
        })
        .collect();
    for _ in 0..redeliveries {
        let at = 1 + next(list.len() as u64) as usize;
        let original = list[next(at as u64) as usize].clone();
        list.insert(at, original);
    }
    (list, expected)
}

async fn run_to_end<DB: inbox_runtime::store::InboxDatabase>(
    worker: Worker<DB>,
    source: MemorySource,
) -> WorkerReport {
    tokio::time::timeout(
        Duration::from_secs(120),
        worker.run(source, CancellationToken::new()),
    )
    .await
    .expect("worker did not finish in 120 s")
    .unwrap()
}

/// Runs [`stream`]`(2_000, 200)` of the messages `make` builds through a Worker with batches of
/// 50 and 8 in flight; asserts that it finished with every delivery settled once and at least
/// one contention fallback; returns the balances the accounts must end with.
async fn run_contending<DB: inbox_runtime::store::InboxDatabase, M: Message>(
    pool: sqlx::Pool<DB>,
    make: impl Fn(String, i32, i64) -> M,
) -> Vec<i64> {
    let (list, expected) = stream(2_000, 200);
    let source = MemorySource::new("mem");
    let handle = source.handle();
    for (id, account, amount) in list {
        handle.push(inbox_tests::envelope(&make(id, account, amount)));
    }
    handle.close();
    let worker = Worker::new(Dispatcher::from_registry(pool).unwrap())
        .concurrency(8)
        .batch(50, Duration::from_millis(5))
        .park_sweep(None);
    let report = run_to_end(worker, source).await;
    assert_eq!(report.stop, StopReason::SourceExhausted);
    assert_eq!(
        (
            report.deliveries,
            report.processed,
            report.duplicates,
            report.acked,
            report.failed,
            report.abandoned
        ),
        (2_000, 1_800, 200, 2_000, 0, 0),
        "{report:?}"
    );
    assert!(report.contention_fallbacks > 0, "{report:?}");
    expected
}

/// Every hot account's balance (on `$pool`, PostgreSQL or MySQL) equals `$expected`'s.
macro_rules! assert_exact {
    ($pool:expr, $expected:expr) => {{
        let balances: Vec<(i32, i64)> =
            sqlx::query_as("SELECT id, balance FROM hot_accounts ORDER BY id")
                .fetch_all($pool)
                .await
                .unwrap();
        let want: Vec<(i32, i64)> = (1..=ACCOUNTS).zip($expected).collect();
        assert_eq!(balances, want);
    }};
}

/// `$consumer` has exactly `$n` processed keys in the inbox.
macro_rules! assert_processed {
    ($pool:expr, $consumer:literal, $n:expr) => {{
        let processed: i64 = sqlx::query_scalar(concat!(
            "SELECT COUNT(*) FROM inbox_messages WHERE consumer = '",
            $consumer,
            "' AND status = 'processed'"
        ))
        .fetch_one($pool)
        .await
        .unwrap();
        assert_eq!(processed, $n);
    }};
}

async fn pg_pool() -> PgPool {
    let pool = inbox_tests::pg_pool(12).await;
    sqlx::query("CREATE TABLE hot_accounts (id INT PRIMARY KEY, balance BIGINT NOT NULL)")
        .execute(&pool)
        .await
        .unwrap();
    sqlx::query("INSERT INTO hot_accounts SELECT generate_series(1, $1), 0")
        .bind(ACCOUNTS)
        .execute(&pool)
        .await
        .unwrap();
    sqlx::query(
        "CREATE TABLE applied_in (seq BIGSERIAL PRIMARY KEY, id TEXT NOT NULL, tx BIGINT NOT NULL)",
    )
    .execute(&pool)
    .await
    .unwrap();
    pool
}

/// 2,000 deliveries (200 of them redeliveries) over 20 hot accounts, batches of 50, 8 batches
/// in flight: batches deadlock; the ones that lose run their deliveries alone; every key is
/// processed once and every balance is exact.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn contending_batches_fall_back_and_finish_exact() {
    let pool = pg_pool().await;
    let expected = run_contending(pool.clone(), |id, account, amount| Credit {
        id,
        account,
        amount,
    })
    .await;
    assert_exact!(&pool, expected);
    // Every key applied once, in one committed transaction.
    let applied: Vec<String> = sqlx::query_scalar("SELECT id FROM applied_in")
        .fetch_all(&pool)
        .await
        .unwrap();
    let distinct: HashSet<&String> = applied.iter().collect();
    assert_eq!((applied.len(), distinct.len()), (1_800, 1_800));
    assert_processed!(&pool, "wc-credit", 1_800);
}

/// The same on MySQL/MariaDB, whose deadlocks (1213) roll the whole batch transaction back:
/// the same fallback, the same exact effects.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn contending_batches_fall_back_and_finish_exact_on_mysql() {
    let pool: MySqlPool = inbox_tests::mysql_pool(12).await;
    sqlx::query("CREATE TABLE hot_accounts (id INT PRIMARY KEY, balance BIGINT NOT NULL)")
        .execute(&pool)
        .await
        .unwrap();
    for id in 1..=ACCOUNTS {
        sqlx::query("INSERT INTO hot_accounts VALUES (?, 0)")
            .bind(id)
            .execute(&pool)
            .await
            .unwrap();
    }
    let expected = run_contending(pool.clone(), |id, account, amount| MyCredit {
        id,
        account,
        amount,
    })
    .await;
    assert_exact!(&pool, expected);
    assert_processed!(&pool, "wc-credit-mysql", 1_800);
}

/// `concurrency(2)` with `batch(100, …)` over a backlog of 300 ready deliveries: three batches
/// of 100 (the concurrency bounds the batches in flight, not what a batch holds).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrency_does_not_bound_the_batch_size() {
    let pool = pg_pool().await;
    let source = MemorySource::new("mem");
    let handle = source.handle();
    for i in 0..300 {
        // One account per batch of 100: batches running side by side share no row.
        handle.push(inbox_tests::envelope(&Credit {
            id: format!("knob-{i}"),
            account: 1 + i / 100,
            amount: 1,
        }));
    }
    handle.close();
    let worker = Worker::new(Dispatcher::from_registry(pool.clone()).unwrap())
        .concurrency(2)
        .batch(100, Duration::from_secs(10))
        .park_sweep(None);
    let report = run_to_end(worker, source).await;
    assert_eq!(
        (report.processed, report.acked, report.contention_fallbacks),
        (300, 300, 0),
        "{report:?}"
    );
    let sizes: Vec<i64> =
        sqlx::query_scalar("SELECT COUNT(*) FROM applied_in GROUP BY tx ORDER BY MIN(seq)")
            .fetch_all(&pool)
            .await
            .unwrap();
    assert_eq!(sizes, [100, 100, 100]);
}
