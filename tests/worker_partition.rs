//! Partitioned batches (issue 33): a message type that declares the aggregate its handler locks
//! (`#[message(partition)]`, or [`Worker::partition_by`]) lets the Worker run several batches
//! in flight that never share one. The contention workload (many deliveries over few accounts,
//! handlers locking their account in message order, which deadlocks undeclared batches; see
//! `worker_contention.rs`) then finishes with no deadlock and no contention fallback, exact
//! balances and effect counts, and each account's effects in the order of its deliveries.
//!
//! What the tests observe, not what the Worker says of itself: each handler takes a
//! transaction-level advisory lock on its account (PostgreSQL), held until its batch commits. A
//! handler that finds it taken met another batch in flight on its partition; the number of
//! sessions holding such locks at once shows the batches that ran side by side.
//!
//! SQLite is left out: it runs one writing transaction at a time, so its batches never run side
//! by side.

#![allow(missing_docs)]

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicI64, AtomicUsize, Ordering};
use std::time::Duration;

use inbox_runtime::source::Settlement;
use inbox_runtime::source::memory::MemorySource;
use inbox_runtime::{Dispatcher, Envelope, Message, StopReason, Worker, WorkerReport};
use serde::{Deserialize, Serialize};
use sqlx::{Connection, MySqlConnection, MySqlPool, PgConnection, PgPool};
use tokio::sync::Semaphore;
use tokio_util::sync::CancellationToken;

/// What the handlers of one test saw of the batches in flight.
struct Observed {
    /// Handlers that found their account's advisory lock held by another transaction in
    /// flight (a partition shared by two batches in flight).
    shared: AtomicUsize,
    /// The most sessions of the test's database that held account locks at once.
    max_holders: AtomicI64,
}

impl Observed {
    const fn new() -> Self {
        Self {
            shared: AtomicUsize::new(0),
            max_holders: AtomicI64::new(0),
        }
    }
}

/// Takes `account`'s advisory lock for the rest of the transaction and records what it saw.
async fn observe(
    conn: &mut PgConnection,
    account: i32,
    observed: &Observed,
) -> Result<(), sqlx::Error> {
    let free: bool = sqlx::query_scalar("SELECT pg_try_advisory_xact_lock(33, $1)")
        .bind(account)
        .fetch_one(&mut *conn)
        .await?;
    if !free {
        observed.shared.fetch_add(1, Ordering::SeqCst);
    }
    let holders: i64 = sqlx::query_scalar(
        "SELECT count(DISTINCT pid) FROM pg_locks WHERE locktype = 'advisory' AND granted \
         AND classid = 33 \
         AND database = (SELECT oid FROM pg_database WHERE datname = current_database())",
    )
    .fetch_one(&mut *conn)
    .await?;
    observed.max_holders.fetch_max(holders, Ordering::SeqCst);
    Ok(())
}

/// The effect shared by the PostgreSQL handlers: the account's row lock, and the effect's row
/// (its `seq` gives the order in which effects ran).
async fn apply(
    conn: &mut PgConnection,
    id: &str,
    account: i32,
    amount: i64,
) -> Result<(), sqlx::Error> {
    sqlx::query("UPDATE hot_accounts SET balance = balance + $1 WHERE id = $2")
        .bind(amount)
        .bind(account)
        .execute(&mut *conn)
        .await?;
    sqlx::query("INSERT INTO applied_in (id, account) VALUES ($1, $2)")
        .bind(id)
        .bind(account)
        .execute(&mut *conn)
        .await?;
    Ok(())
}

#[derive(Debug, Clone, Serialize, Deserialize, Message)]
#[message(name = "wp.credit")]
pub struct Credit {
    #[message(key)]
    pub id: String,
    #[message(partition)]
    pub account: i32,
    pub amount: i64,
}

static CREDIT: Observed = Observed::new();

#[inbox_runtime::idempotent(consumer = "wp-credit")]
pub async fn credit(conn: &mut PgConnection, msg: Credit) -> Result<(), sqlx::Error> {
    observe(conn, msg.account, &CREDIT).await?;
    apply(conn, &msg.id, msg.account, msg.amount).await
}

/// The same credit without a declaration: partitioned by [`Worker::partition_by`].
#[derive(Debug, Clone, Serialize, Deserialize, Message)]
#[message(name = "wp.plain")]
pub struct PlainCredit {
    #[message(key)]
    pub id: String,
    pub account: i32,
    pub amount: i64,
}

static PLAIN: Observed = Observed::new();

#[inbox_runtime::idempotent(consumer = "wp-plain")]
pub async fn plain_credit(conn: &mut PgConnection, msg: PlainCredit) -> Result<(), sqlx::Error> {
    observe(conn, msg.account, &PLAIN).await?;
    apply(conn, &msg.id, msg.account, msg.amount).await
}

/// An undeclared message mixed into the `partition_by` stream: it only inserts a fresh row.
#[derive(Debug, Clone, Serialize, Deserialize, Message)]
#[message(name = "wp.note")]
pub struct Note {
    #[message(key)]
    pub id: String,
}

#[inbox_runtime::idempotent(consumer = "wp-note")]
pub async fn note(conn: &mut PgConnection, msg: Note) -> Result<(), sqlx::Error> {
    sqlx::query("INSERT INTO notes (id) VALUES ($1)")
        .bind(&msg.id)
        .execute(&mut *conn)
        .await?;
    Ok(())
}

#[derive(Debug, Clone, Serialize, Deserialize, Message)]
#[message(name = "wp.credit.mysql")]
pub struct MyCredit {
    #[message(key)]
    pub id: String,
    #[message(partition)]
    pub account: i32,
    pub amount: i64,
}

#[inbox_runtime::idempotent(consumer = "wp-credit-mysql")]
pub async fn my_credit(conn: &mut MySqlConnection, msg: MyCredit) -> Result<(), sqlx::Error> {
    sqlx::query("UPDATE hot_accounts SET balance = balance + ? WHERE id = ?")
        .bind(msg.amount)
        .bind(msg.account)
        .execute(&mut *conn)
        .await?;
    sqlx::query("INSERT INTO applied_in (id, account) VALUES (?, ?)")
        .bind(&msg.id)
        .bind(msg.account)
        .execute(&mut *conn)
        .await?;
    Ok(())
}

/// A transfer locks two accounts, in message order (debit first): two partitions.
#[derive(Debug, Clone, Serialize, Deserialize, Message)]
#[message(name = "wp.transfer")]
pub struct Transfer {
    #[message(key)]
    pub id: String,
    #[message(partition)]
    pub from: i32,
    #[message(partition)]
    pub to: i32,
    pub amount: i64,
}

static TRANSFER: Observed = Observed::new();

#[inbox_runtime::idempotent(consumer = "wp-transfer")]
pub async fn transfer(conn: &mut PgConnection, msg: Transfer) -> Result<(), sqlx::Error> {
    observe(conn, msg.from, &TRANSFER).await?;
    observe(conn, msg.to, &TRANSFER).await?;
    apply(conn, &msg.id, msg.from, -msg.amount).await?;
    apply(conn, &format!("{}:to", msg.id), msg.to, msg.amount).await
}

/// A credit whose handler, for `hold`, waits until the test lets it go.
#[derive(Debug, Clone, Serialize, Deserialize, Message)]
#[message(name = "wp.held")]
pub struct Held {
    #[message(key)]
    pub id: String,
    #[message(partition)]
    pub account: i32,
    pub hold: bool,
}

/// A permit per held handler that started; the test adds one to `RELEASE` to let it go.
static ENTERED: Semaphore = Semaphore::const_new(0);
static RELEASE: Semaphore = Semaphore::const_new(0);

#[inbox_runtime::idempotent(consumer = "wp-held")]
pub async fn held(conn: &mut PgConnection, msg: Held) -> Result<(), sqlx::Error> {
    if msg.hold {
        ENTERED.add_permits(1);
        RELEASE.acquire().await.expect("never closed").forget();
    }
    apply(conn, &msg.id, msg.account, 1).await
}

/// A seeded stream over `accounts` accounts: `(key, account, amount)` per delivery,
/// `redeliveries` of them repeating an earlier key (same payload) later in the stream.
fn stream(deliveries: usize, redeliveries: usize, accounts: i32) -> Vec<(String, i32, i64)> {
    let mut state: u64 = 0x0033_5EED;
    let mut next = move |n: u64| {
        state = state
            .wrapping_mul(6_364_136_223_846_793_005)
            .wrapping_add(1_442_695_040_888_963_407);
        (state >> 33) % n
    };
    let mut list: Vec<(String, i32, i64)> = (0..deliveries - redeliveries)
        .map(|i| {
            let account = 1 + next(accounts as u64) as i32;
            let amount = 1 + next(100) as i64;
            (format!("wp-{i}"), account, amount)
        })
        .collect();
    for _ in 0..redeliveries {
        let at = 1 + next(list.len() as u64) as usize;
        let original = list[next(at as u64) as usize].clone();
        list.insert(at, original);
    }
    list
}

/// Each account's expected balance, and its keys in the order their effects must run: the
/// first delivery of each key, in stream order.
fn expected(list: &[(String, i32, i64)], accounts: i32) -> (Vec<i64>, HashMap<i32, Vec<String>>) {
    let mut balances = vec![0_i64; accounts as usize];
    let mut order: HashMap<i32, Vec<String>> = HashMap::new();
    let mut seen = HashSet::new();
    for (id, account, amount) in list {
        if seen.insert(id.clone()) {
            balances[(*account - 1) as usize] += amount;
            order.entry(*account).or_default().push(id.clone());
        }
    }
    (balances, order)
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

/// A database with `accounts` accounts at balance 0 and an empty `applied_in`.
async fn pg_pool(accounts: i32) -> PgPool {
    let pool = inbox_tests::pg_pool(12).await;
    for statement in [
        "CREATE TABLE hot_accounts (id INT PRIMARY KEY, balance BIGINT NOT NULL)",
        "CREATE TABLE applied_in (seq BIGSERIAL PRIMARY KEY, id TEXT NOT NULL, account INT NOT NULL)",
        "CREATE TABLE notes (id TEXT PRIMARY KEY)",
    ] {
        sqlx::query(statement).execute(&pool).await.unwrap();
    }
    sqlx::query("INSERT INTO hot_accounts SELECT generate_series(1, $1), 0")
        .bind(accounts)
        .execute(&pool)
        .await
        .unwrap();
    pool
}

/// Every account's balance is `$balances`', and `applied_in` holds each key once, each
/// account's keys in `$order`.
macro_rules! assert_exact {
    ($pool:expr, $balances:expr, $order:expr) => {{
        let balances: Vec<i64> = sqlx::query_scalar("SELECT balance FROM hot_accounts ORDER BY id")
            .fetch_all($pool)
            .await
            .unwrap();
        assert_eq!(balances, $balances);
        let applied: Vec<(String, i32)> =
            sqlx::query_as("SELECT id, account FROM applied_in ORDER BY seq")
                .fetch_all($pool)
                .await
                .unwrap();
        let distinct: HashSet<&String> = applied.iter().map(|(id, _)| id).collect();
        assert_eq!(distinct.len(), applied.len(), "an effect ran twice");
        let mut order: HashMap<i32, Vec<String>> = HashMap::new();
        for (id, account) in applied {
            order.entry(account).or_default().push(id);
        }
        assert_eq!(order, $order, "effects out of their partition's order");
    }};
}

/// The deadlocks PostgreSQL counted in `pool`'s database, read after every session of the run
/// ended (a session's counters reach `pg_stat_database` when it ends at the latest).
async fn pg_deadlocks(pool: PgPool) -> i64 {
    let options = pool.connect_options().as_ref().clone();
    pool.close().await;
    let mut conn = PgConnection::connect_with(&options).await.unwrap();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    loop {
        let others: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM pg_stat_activity \
             WHERE datname = current_database() AND pid <> pg_backend_pid()",
        )
        .fetch_one(&mut conn)
        .await
        .unwrap();
        if others == 0 {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "the run's sessions did not end in 10 s"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    sqlx::query_scalar("SELECT deadlocks FROM pg_stat_database WHERE datname = current_database()")
        .fetch_one(&mut conn)
        .await
        .unwrap()
}

/// The declared-partition workload on `pool`: 2,000 deliveries (200 redeliveries) over
/// `accounts`, each the message `message` makes of `(id, account, amount)`, through a Worker of
/// batches of 50, 4 in flight, to the end of its source. Asserts that it ran to the end with
/// every delivery settled and batches side by side; returns the balances and per-account order
/// the list expects.
async fn declared_workload<DB: inbox_runtime::store::InboxDatabase, M: Message>(
    pool: &sqlx::Pool<DB>,
    accounts: i32,
    message: impl Fn(String, i32, i64) -> M,
) -> (Vec<i64>, HashMap<i32, Vec<String>>) {
    let list = stream(2_000, 200, accounts);
    let (balances, order) = expected(&list, accounts);
    let source = MemorySource::new("mem");
    let handle = source.handle();
    for (id, account, amount) in list {
        handle.push(inbox_tests::envelope(&message(id, account, amount)));
    }
    handle.close();
    let worker = Worker::new(Dispatcher::from_registry(pool.clone()).unwrap())
        .concurrency(4)
        .batch(50, Duration::from_millis(5))
        .park_sweep(None);
    let report = run_to_end(worker, source).await;
    assert_eq!(report.stop, StopReason::SourceExhausted);
    assert_eq!(
        counts(&report),
        (2_000, 1_800, 200, 2_000, 0, 0, 0),
        "{report:?}"
    );
    assert!(report.max_batches_in_flight > 1, "{report:?}");
    (balances, order)
}

/// The counts every run of a stream of `n` deliveries with `r` redeliveries must end with:
/// `(deliveries, processed, duplicates, acked, failed, abandoned, contention fallbacks)`.
fn counts(report: &WorkerReport) -> (u64, u64, u64, u64, u64, u64, u64) {
    (
        report.deliveries,
        report.processed,
        report.duplicates,
        report.acked,
        report.failed,
        report.abandoned,
        report.contention_fallbacks,
    )
}

/// The contention workload with the account declared: 2,000 deliveries (200 redeliveries) over
/// 200 accounts, batches of 50, 4 in flight. No batch shares an account with a batch in
/// flight, several run side by side, none deadlocks or falls back, and every effect is exact
/// and in its account's order.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn declared_partitions_run_batches_side_by_side_without_deadlocks() {
    const ACCOUNTS: i32 = 200;
    let pool = pg_pool(ACCOUNTS).await;
    let (balances, order) = declared_workload(&pool, ACCOUNTS, |id, account, amount| Credit {
        id,
        account,
        amount,
    })
    .await;
    assert_eq!(
        CREDIT.shared.load(Ordering::SeqCst),
        0,
        "a partition was shared"
    );
    let holders = CREDIT.max_holders.load(Ordering::SeqCst);
    assert!(
        (2..=4).contains(&holders),
        "batches side by side, at most the concurrency: {holders}"
    );
    assert_exact!(&pool, balances, order);
    let processed: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM inbox_messages WHERE consumer = 'wp-credit' AND status = 'processed'",
    )
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!(processed, 1_800);
    assert_eq!(pg_deadlocks(pool).await, 0);
}

/// The same workload through [`Worker::partition_by`] (the message type declares nothing),
/// with undeclared messages mixed in (the function knows nothing of them: open batches):
/// exact, no partition shared, no contention fallback.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn partition_by_a_function_with_undeclared_messages_mixed_in() {
    const ACCOUNTS: i32 = 100;
    let pool = pg_pool(ACCOUNTS).await;
    let list = stream(1_000, 100, ACCOUNTS);
    let (balances, order) = expected(&list, ACCOUNTS);
    let source = MemorySource::new("mem");
    let handle = source.handle();
    for (i, (id, account, amount)) in list.into_iter().enumerate() {
        handle.push(inbox_tests::envelope(&PlainCredit {
            id,
            account,
            amount,
        }));
        if i % 10 == 0 {
            handle.push(inbox_tests::envelope(&Note {
                id: format!("note-{i}"),
            }));
        }
    }
    handle.close();
    let worker = Worker::new(Dispatcher::from_registry(pool.clone()).unwrap())
        .concurrency(4)
        .batch(25, Duration::from_millis(5))
        .park_sweep(None)
        .partition_by(|envelope: &Envelope| {
            if envelope.message_name != PlainCredit::NAME {
                return None;
            }
            let credit: PlainCredit = serde_json::from_slice(&envelope.payload).ok()?;
            Some(vec![credit.account.to_string()])
        });
    let report = run_to_end(worker, source).await;
    assert_eq!(report.stop, StopReason::SourceExhausted);
    assert_eq!(
        counts(&report),
        (1_100, 1_000, 100, 1_100, 0, 0, 0),
        "{report:?}"
    );
    assert!(report.max_batches_in_flight > 1, "{report:?}");
    assert_eq!(
        PLAIN.shared.load(Ordering::SeqCst),
        0,
        "a partition was shared"
    );
    assert!(PLAIN.max_holders.load(Ordering::SeqCst) >= 2);
    assert_exact!(&pool, balances, order);
    let notes: i64 = sqlx::query_scalar("SELECT count(*) FROM notes")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(notes, 100);
    assert_eq!(pg_deadlocks(pool).await, 0);
}

/// Transfers between two accounts (each locks both, debit first: two batches with transfers
/// a→b and b→a deadlock unless declared), both accounts declared: no partition shared, no
/// contention fallback, exact balances (the money is conserved), each account's effects in
/// order.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn transfers_declare_both_accounts() {
    const ACCOUNTS: i32 = 200;
    let pool = pg_pool(ACCOUNTS).await;
    let list = stream(1_000, 100, ACCOUNTS);
    // The counterpart of each transfer: another account, from the key's number.
    let to_of = |id: &str, from: i32| -> i32 {
        let n: i32 = id.trim_start_matches("wp-").parse().unwrap();
        (from + 1 + n % (ACCOUNTS - 1) - 1) % ACCOUNTS + 1
    };
    let mut balances = vec![0_i64; ACCOUNTS as usize];
    let mut order: HashMap<i32, Vec<String>> = HashMap::new();
    let mut seen = HashSet::new();
    let source = MemorySource::new("mem");
    let handle = source.handle();
    for (id, from, amount) in list {
        let to = to_of(&id, from);
        assert_ne!(from, to);
        if seen.insert(id.clone()) {
            balances[(from - 1) as usize] -= amount;
            balances[(to - 1) as usize] += amount;
            order.entry(from).or_default().push(id.clone());
            order.entry(to).or_default().push(format!("{id}:to"));
        }
        handle.push(inbox_tests::envelope(&Transfer {
            id,
            from,
            to,
            amount,
        }));
    }
    handle.close();
    assert_eq!(balances.iter().sum::<i64>(), 0);
    let worker = Worker::new(Dispatcher::from_registry(pool.clone()).unwrap())
        .concurrency(4)
        .batch(20, Duration::from_millis(5))
        .park_sweep(None);
    let report = run_to_end(worker, source).await;
    assert_eq!(report.stop, StopReason::SourceExhausted);
    assert_eq!(
        counts(&report),
        (1_000, 900, 100, 1_000, 0, 0, 0),
        "{report:?}"
    );
    assert!(report.max_batches_in_flight > 1, "{report:?}");
    assert_eq!(
        TRANSFER.shared.load(Ordering::SeqCst),
        0,
        "a partition was shared"
    );
    assert!(TRANSFER.max_holders.load(Ordering::SeqCst) >= 2);
    assert_exact!(&pool, balances, order);
    assert_eq!(pg_deadlocks(pool).await, 0);
}

/// The declared contention workload on MySQL/MariaDB: no contention fallback, exact effects in
/// each account's order.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn declared_partitions_on_mysql() {
    const ACCOUNTS: i32 = 200;
    let pool: MySqlPool = inbox_tests::mysql_pool(12).await;
    sqlx::query("CREATE TABLE hot_accounts (id INT PRIMARY KEY, balance BIGINT NOT NULL)")
        .execute(&pool)
        .await
        .unwrap();
    sqlx::query(
        "CREATE TABLE applied_in (seq BIGINT AUTO_INCREMENT PRIMARY KEY, \
         id VARCHAR(64) NOT NULL, account INT NOT NULL)",
    )
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
    let (balances, order) = declared_workload(&pool, ACCOUNTS, |id, account, amount| MyCredit {
        id,
        account,
        amount,
    })
    .await;
    assert_exact!(&pool, balances, order);
}

/// Shutdown while a batch holds a partition and later deliveries of it wait: the running
/// batch commits and is acked, the delivery of another partition ran beside it, and the waiting
/// ones are handed back to the source (requeued, in their order), never abandoned or run.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_requeues_the_deliveries_waiting_for_a_partition() {
    let pool = pg_pool(2).await;
    let source = MemorySource::new("mem");
    let handle = source.handle();
    let held = |id: &str, account: i32, hold: bool| {
        inbox_tests::envelope(&Held {
            id: id.to_owned(),
            account,
            hold,
        })
    };
    let first = handle.push(held("h-1", 1, true));
    let worker = Worker::new(Dispatcher::from_registry(pool.clone()).unwrap())
        .concurrency(4)
        .batch(10, Duration::ZERO)
        .park_sweep(None);
    let token = CancellationToken::new();
    let run = tokio::spawn({
        let token = token.clone();
        async move { worker.run(source, token).await }
    });
    // h-1 runs (and holds account 1); h-2 and h-3 wait for it; h-4 (account 2) runs beside.
    tokio::time::timeout(Duration::from_secs(10), ENTERED.acquire())
        .await
        .expect("h-1 started")
        .unwrap()
        .forget();
    let second = handle.push(held("h-2", 1, false));
    let third = handle.push(held("h-3", 1, false));
    let other = handle.push(held("h-4", 2, false));
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while !handle.settlements().contains(&(other, Settlement::Ack)) {
        assert!(
            tokio::time::Instant::now() < deadline,
            "h-4 not acked in 10 s"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    token.cancel();
    RELEASE.add_permits(1);
    let report = tokio::time::timeout(Duration::from_secs(10), run)
        .await
        .expect("shutdown within 10 s")
        .unwrap()
        .unwrap();
    assert_eq!(report.stop, StopReason::Shutdown);
    assert_eq!(
        (
            report.processed,
            report.acked,
            report.requeued,
            report.abandoned
        ),
        (2, 2, 2, 0),
        "{report:?}"
    );
    let requeue = Settlement::Requeue { delay: None };
    let settlements = handle.settlements();
    let requeued: Vec<u64> = settlements
        .iter()
        .filter(|(_, s)| *s == requeue)
        .map(|(id, _)| *id)
        .collect();
    assert_eq!(requeued, [second, third], "{settlements:?}");
    let mut acked: Vec<u64> = settlements
        .iter()
        .filter(|(_, s)| *s == Settlement::Ack)
        .map(|(id, _)| *id)
        .collect();
    acked.sort_unstable();
    assert_eq!((acked, settlements.len()), (vec![first, other], 4));
    assert!(handle.abandoned().is_empty());
    let applied: Vec<String> = sqlx::query_scalar("SELECT id FROM applied_in ORDER BY id")
        .fetch_all(&pool)
        .await
        .unwrap();
    assert_eq!(applied, ["h-1", "h-4"]);
}
