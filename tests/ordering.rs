//! Per-aggregate ordering on both backends: the sequence guard (`gaps = "apply"`) and the
//! durable reorder buffer (`gaps = "park"`), against a model; concurrency; a parked message that
//! outlives its process; the park timeout.

#![allow(missing_docs)]

use std::collections::{BTreeMap, HashSet};

use inbox_runtime::{Message, Outcome};
use inbox_tests::envelope;
use serde::{Deserialize, Serialize};

/// One event of an order's lifecycle.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, Message)]
#[message(name = "order.event")]
pub struct OrderEvent {
    #[message(key)]
    pub event_id: String,
    #[message(aggregate)]
    pub order_id: String,
    #[message(sequence)]
    pub seq: i64,
    pub kind: String,
}

pub fn event(order: &str, seq: i64, kind: &str) -> OrderEvent {
    OrderEvent {
        event_id: format!("{order}/{seq}"),
        order_id: order.to_owned(),
        seq,
        kind: kind.to_owned(),
    }
}

/// The lifecycle kinds by sequence.
pub const KINDS: [&str; 6] = ["placed", "paid", "packed", "shipped", "delivered", "closed"];

/// `aggregates` orders of 1..=6 events each, every event delivered once plus `extra` random
/// duplicates, in a seeded random order.
pub fn stream(seed: u64, aggregates: usize, extra: usize, prefix: &str) -> Vec<OrderEvent> {
    use rand::seq::SliceRandom;
    use rand::{Rng, SeedableRng};
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
    let mut events = Vec::new();
    for a in 0..aggregates {
        let len = rng.random_range(1..=KINDS.len());
        for seq in 1..=len {
            events.push(event(&format!("{prefix}o{a}"), seq as i64, KINDS[seq - 1]));
        }
    }
    for _ in 0..extra {
        let pick = events[rng.random_range(0..events.len())].clone();
        events.push(pick);
    }
    events.shuffle(&mut rng);
    events
}

/// In-order application: every order's full history.
pub fn in_order(events: &[OrderEvent]) -> BTreeMap<String, String> {
    let mut last: BTreeMap<String, i64> = BTreeMap::new();
    for e in events {
        let entry = last.entry(e.order_id.clone()).or_default();
        *entry = (*entry).max(e.seq);
    }
    last.into_iter()
        .map(|(order, n)| (order, KINDS[..n as usize].join(",")))
        .collect()
}

/// `gaps = "apply"`: in arrival order, a first delivery applies if newer than the state held.
pub fn apply_newer(events: &[OrderEvent]) -> BTreeMap<String, String> {
    let mut seen = HashSet::new();
    let mut state: BTreeMap<String, (i64, Vec<&str>)> = BTreeMap::new();
    for e in events {
        if !seen.insert(e.event_id.clone()) {
            continue;
        }
        let (last, history) = state.entry(e.order_id.clone()).or_default();
        if e.seq > *last {
            *last = e.seq;
            history.push(&e.kind);
        }
    }
    state
        .into_iter()
        .filter(|(_, (_, h))| !h.is_empty())
        .map(|(order, (_, h))| (order, h.join(",")))
        .collect()
}

/// An order was opened (sequence 1), for the consumer `orders-resume`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, Message)]
#[message(name = "order.opened")]
pub struct OrderOpened {
    #[message(key)]
    pub event_id: String,
    #[message(aggregate)]
    pub order_id: String,
    #[message(sequence)]
    pub seq: i64,
}

/// A note on an order (sequence 2 and later), for the consumer `orders-resume`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, Message)]
#[message(name = "order.note")]
pub struct OrderNote {
    #[message(key)]
    pub event_id: String,
    #[message(aggregate)]
    pub order_id: String,
    #[message(sequence)]
    pub seq: i64,
}

pub const ORDERS_TABLE: &str = "CREATE TABLE orders (consumer TEXT NOT NULL, order_id TEXT NOT NULL, \
     history TEXT NOT NULL, PRIMARY KEY (consumer, order_id))";

/// Appends the event's kind to the order's history (both backends: `||` concatenates).
pub const APPEND: &str = "INSERT INTO orders (consumer, order_id, history) VALUES ($1, $2, $3) \
     ON CONFLICT (consumer, order_id) DO UPDATE SET history = orders.history || ',' || excluded.history";

/// [`ORDERS_TABLE`] on MySQL (a primary key needs bounded types).
pub const MYSQL_ORDERS_TABLE: &str = "CREATE TABLE orders (consumer VARCHAR(255) NOT NULL, \
     order_id VARCHAR(255) NOT NULL, history TEXT NOT NULL, PRIMARY KEY (consumer, order_id))";

/// [`APPEND`] on MySQL.
pub const MYSQL_APPEND: &str = "INSERT INTO orders (consumer, order_id, history) VALUES (?, ?, ?) \
     ON DUPLICATE KEY UPDATE history = CONCAT(history, ',', VALUES(history))";

inbox_tests::backend_matrix! {
    connections(postgres = 8, sqlite = 4);

    /// [`APPEND`] in this backend's dialect.
    fn append() -> &'static str {
        if BACKEND == Backend::MySql { MYSQL_APPEND } else { APPEND }
    }

    use inbox_runtime::{Dispatcher, types::{ParkPolicy, ParkTimeout}};
    use std::sync::Arc;

    #[inbox_runtime::idempotent(consumer = "orders-park", gaps = "park")]
    async fn track_parked(conn: &mut Conn, msg: OrderEvent) -> Result<(), sqlx::Error> {
        sqlx::query(append())
            .bind("orders-park")
            .bind(&msg.order_id)
            .bind(&msg.kind)
            .execute(conn)
            .await?;
        Ok(())
    }

    #[inbox_runtime::idempotent(consumer = "orders-apply")]
    async fn track_newest(conn: &mut Conn, msg: OrderEvent) -> Result<(), sqlx::Error> {
        sqlx::query(append())
            .bind("orders-apply")
            .bind(&msg.order_id)
            .bind(&msg.kind)
            .execute(conn)
            .await?;
        Ok(())
    }

    #[inbox_runtime::idempotent(consumer = "orders-resume", gaps = "park")]
    async fn resume_opened(conn: &mut Conn, msg: OrderOpened) -> Result<(), sqlx::Error> {
        sqlx::query(append()).bind("orders-resume").bind(&msg.order_id).bind("opened").execute(conn).await?;
        Ok(())
    }

    #[inbox_runtime::idempotent(consumer = "orders-resume", gaps = "park")]
    async fn resume_note(conn: &mut Conn, msg: OrderNote) -> Result<(), sqlx::Error> {
        sqlx::query(append()).bind("orders-resume").bind(&msg.order_id).bind(format!("note{}", msg.seq)).execute(conn).await?;
        Ok(())
    }

    async fn setup() -> (Pool, Guard) {
        let (pool, guard) = fixture().await;
        sqlx::raw_sql(if BACKEND == Backend::MySql { MYSQL_ORDERS_TABLE } else { ORDERS_TABLE }).execute(&pool).await.unwrap();
        (pool, guard)
    }

    async fn histories(pool: &Pool, consumer: &str, prefix: &str) -> BTreeMap<String, String> {
        let rows: Vec<(String, String)> = sqlx::query_as(
            sql("SELECT order_id, history FROM orders WHERE consumer = $1 AND order_id LIKE $2"),
        )
        .bind(consumer)
        .bind(format!("{prefix}%"))
        .fetch_all(pool)
        .await
        .unwrap();
        rows.into_iter().collect()
    }

    async fn parked(pool: &Pool) -> i64 {
        sqlx::query_scalar(sql("SELECT COUNT(*) FROM inbox_messages WHERE status = 'parked'"))
            .fetch_one(pool)
            .await
            .unwrap()
    }

    #[test]
    fn random_permutations_with_duplicates_match_the_model() {
        let runtime = tokio::runtime::Runtime::new().unwrap();
        let (pool, _guard) = runtime.block_on(setup());
        let dispatcher = Dispatcher::from_registry(pool.clone()).unwrap();
        let case = std::sync::atomic::AtomicU32::new(0);
        proptest::proptest!(proptest::prelude::ProptestConfig::with_cases(24), |(seed in proptest::prelude::any::<u64>(), aggregates in 1_usize..8, extra in 0_usize..12)| {
            let n = case.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            let prefix = format!("c{n}-");
            let events = stream(seed, aggregates, extra, &prefix);
            runtime.block_on(async {
                for e in &events {
                    let outcomes = dispatcher.dispatch(&envelope(e)).await.unwrap();
                    for outcome in outcomes {
                        let _settled = outcome.result.unwrap();
                    }
                }
                assert_eq!(histories(&pool, "orders-park", &prefix).await, in_order(&events));
                assert_eq!(histories(&pool, "orders-apply", &prefix).await, apply_newer(&events));
            });
        });
        assert_eq!(runtime.block_on(parked(&pool)), 0);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn eight_tasks_on_fifty_aggregates_end_in_order() {
        let (pool, _guard) = setup().await;
        let dispatcher = Arc::new(Dispatcher::from_registry(pool.clone()).unwrap());
        let events = stream(8, 50, 60, "conc-");
        let queue = Arc::new(std::sync::Mutex::new(events.clone()));
        let mut tasks = Vec::new();
        for _ in 0..8 {
            let queue = queue.clone();
            let dispatcher = dispatcher.clone();
            tasks.push(tokio::spawn(async move {
                loop {
                    let Some(e) = queue.lock().unwrap().pop() else { break };
                    for outcome in dispatcher.dispatch(&envelope(&e)).await.unwrap() {
                        if let Err(error) = outcome.result {
                            panic!("{}: {error}", outcome.consumer);
                        }
                    }
                }
            }));
        }
        for task in tasks {
            task.await.unwrap();
        }
        assert_eq!(histories(&pool, "orders-park", "conc-").await, in_order(&events));
        assert_eq!(parked(&pool).await, 0);
    }

    #[tokio::test]
    async fn the_worker_acks_parked_messages_and_sweeps_expired_ones() {
        use inbox_runtime::source::memory::MemorySource;
        use std::time::Duration;
        let (pool, _guard) = setup().await;
        let dispatcher = Dispatcher::from_registry(pool.clone())
            .unwrap()
            .with_park_policy(ParkPolicy::new(Duration::ZERO, ParkTimeout::DeadLetter));
        let source = MemorySource::new("mem");
        let handle = source.handle();
        let parked = handle.push(envelope(&event("w", 2, "paid")));
        let report = inbox_runtime::Worker::new(dispatcher)
            .park_sweep(Some(Duration::from_millis(50)))
            .stop_when_idle(Duration::from_millis(500))
            .run(source, tokio_util::sync::CancellationToken::new())
            .await
            .unwrap();
        // orders-park parked it, orders-apply applied it: the delivery is acked.
        assert_eq!((report.parked, report.processed, report.acked), (1, 1, 1));
        assert_eq!(handle.settlements(), [(parked, inbox_runtime::source::Settlement::Ack)]);
        // The gap stayed open past the (zero) timeout: the sweep dead-lettered it.
        let row = inbox_runtime::ops::admin::show(&pool, "orders-park", "w/2")
            .await
            .unwrap()
            .unwrap();
        assert_eq!(row.status, "dead");
    }

    /// A worker whose parked-message sweep is waiting for a row lock: the message `sweep/2` of
    /// `orders-park` parked (its gap past the zero timeout: the sweep dead-letters it), the row
    /// held by `holder`, the worker running on an empty source with `drain` as its drain
    /// timeout, and the sweep's `UPDATE` seen waiting (pg_stat_activity).
    struct WaitingSweep {
        holder: sqlx::Transaction<'static, Db>,
        shutdown: tokio_util::sync::CancellationToken,
        run: tokio::task::JoinHandle<Result<inbox_runtime::WorkerReport, inbox_runtime::WorkerError>>,
    }

    async fn sweep_waiting_for_a_row(pool: &Pool, drain: std::time::Duration) -> WaitingSweep {
        use inbox_runtime::source::memory::MemorySource;
        use std::time::{Duration, Instant};
        let dispatcher = Dispatcher::from_registry(pool.clone())
            .unwrap()
            .with_park_policy(ParkPolicy::new(Duration::ZERO, ParkTimeout::DeadLetter));
        let mut conn = pool.acquire().await.unwrap();
        assert_eq!(track_parked(&mut conn, event("sweep", 2, "paid")).await.unwrap(), Outcome::Parked);
        drop(conn);
        let mut holder = pool.begin().await.unwrap();
        sqlx::query(
            "SELECT 1 FROM inbox_messages \
             WHERE consumer = 'orders-park' AND message_key = 'sweep/2' FOR UPDATE",
        )
        .fetch_one(&mut *holder)
        .await
        .unwrap();
        let shutdown = tokio_util::sync::CancellationToken::new();
        let worker = inbox_runtime::Worker::new(dispatcher)
            .park_sweep(Some(Duration::from_millis(10)))
            .drain_timeout(drain);
        let run = tokio::spawn({
            let shutdown = shutdown.clone();
            async move { worker.run(MemorySource::new("mem"), shutdown).await }
        });
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let waiting: i64 = sqlx::query_scalar(
                "SELECT COUNT(*) FROM pg_stat_activity WHERE datname = current_database() \
                 AND wait_event_type = 'Lock' AND query LIKE '%UPDATE inbox_messages%'",
            )
            .fetch_one(pool)
            .await
            .unwrap();
            if waiting == 1 {
                break;
            }
            assert!(Instant::now() < deadline, "the sweep never waited for the row");
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        WaitingSweep { holder, shutdown, run }
    }

    async fn status_of_sweep_2(pool: &Pool) -> String {
        inbox_runtime::ops::admin::show(pool, "orders-park", "sweep/2")
            .await
            .unwrap()
            .unwrap()
            .status
            .to_string()
    }

    /// The worker's `run` returns only once the parked-message sweep in flight has finished
    /// (within the drain timeout): the sweep's dead-letter is done when `run` returns.
    #[tokio::test]
    async fn the_worker_returns_after_its_sweep_in_flight() {
        use std::time::Duration;
        if BACKEND != Backend::Postgres {
            return; // The sweep is seen waiting for the row lock through pg_stat_activity.
        }
        let (pool, _guard) = setup().await;
        let sweep = sweep_waiting_for_a_row(&pool, Duration::from_secs(30)).await;
        sweep.shutdown.cancel();
        tokio::time::sleep(Duration::from_millis(500)).await;
        assert!(!sweep.run.is_finished(), "run returned while its sweep was still running");
        sweep.holder.commit().await.unwrap();
        let report = tokio::time::timeout(Duration::from_secs(30), sweep.run)
            .await
            .expect("run returns once the sweep is done")
            .unwrap()
            .unwrap();
        assert_eq!(report.stop, inbox_runtime::StopReason::Shutdown);
        // Dead-lettered by the sweep before run returned.
        assert_eq!(status_of_sweep_2(&pool).await, "dead");
    }

    /// A sweep still running after the drain timeout is abandoned: `run` returns while the
    /// sweep's dead-letter still waits for the row (which stays parked).
    #[tokio::test]
    async fn a_sweep_past_the_drain_timeout_is_abandoned() {
        use std::time::Duration;
        if BACKEND != Backend::Postgres {
            return; // The sweep is seen waiting for the row lock through pg_stat_activity.
        }
        let (pool, _guard) = setup().await;
        let sweep = sweep_waiting_for_a_row(&pool, Duration::from_millis(200)).await;
        sweep.shutdown.cancel();
        let report = tokio::time::timeout(Duration::from_secs(30), sweep.run)
            .await
            .expect("run returns after the drain timeout, the row still held")
            .unwrap()
            .unwrap();
        assert_eq!(report.stop, inbox_runtime::StopReason::Shutdown);
        assert_eq!(status_of_sweep_2(&pool).await, "parked");
        sweep.holder.rollback().await.unwrap();
    }

    #[tokio::test]
    async fn outcomes_of_the_guard() {
        let (pool, _guard) = setup().await;
        let mut conn = pool.acquire().await.unwrap();
        // Park: 3 and 2 before 1 are held; 1 applies and brings 2 and 3 with it, in order.
        assert_eq!(track_parked(&mut conn, event("g", 3, "packed")).await.unwrap(), Outcome::Parked);
        assert_eq!(track_parked(&mut conn, event("g", 3, "packed")).await.unwrap(), Outcome::Parked);
        assert_eq!(track_parked(&mut conn, event("g", 2, "paid")).await.unwrap(), Outcome::Parked);
        assert_eq!(histories(&pool, "orders-park", "g").await.get("g"), None);
        assert_eq!(track_parked(&mut conn, event("g", 1, "placed")).await.unwrap(), Outcome::Processed(()));
        assert_eq!(histories(&pool, "orders-park", "g").await["g"], "placed,paid,packed");
        assert_eq!(track_parked(&mut conn, event("g", 3, "packed")).await.unwrap(), Outcome::Duplicate);
        // Another event with an old sequence is stale, and stays so when redelivered.
        let mut late = event("g", 2, "paid-again");
        late.event_id = "g/2-late".into();
        assert_eq!(track_parked(&mut conn, late.clone()).await.unwrap(), Outcome::Stale);
        assert_eq!(track_parked(&mut conn, late).await.unwrap(), Outcome::Stale);
        assert_eq!(histories(&pool, "orders-park", "g").await["g"], "placed,paid,packed");
        // The same key with another payload is a conflict, parked or not.
        assert_eq!(track_parked(&mut conn, event("g", 9, "x")).await.unwrap(), Outcome::Parked);
        let mut other = event("g", 9, "y");
        other.event_id = "g/9".into();
        assert_eq!(track_parked(&mut conn, other).await.unwrap_err().kind(), "conflict");
        // Apply: newer applies over a gap; older is stale.
        assert_eq!(track_newest(&mut conn, event("h", 2, "paid")).await.unwrap(), Outcome::Processed(()));
        assert_eq!(track_newest(&mut conn, event("h", 1, "placed")).await.unwrap(), Outcome::Stale);
        assert_eq!(histories(&pool, "orders-apply", "h").await["h"], "paid");
        let statuses: Vec<(String, String)> = sqlx::query_as(
            sql("SELECT message_key, status FROM inbox_messages WHERE consumer = 'orders-park' ORDER BY message_key"),
        )
        .fetch_all(&pool)
        .await
        .unwrap();
        let statuses: Vec<(&str, &str)> = statuses.iter().map(|(k, s)| (k.as_str(), s.as_str())).collect();
        assert_eq!(
            statuses,
            [("g/1", "processed"), ("g/2", "processed"), ("g/2-late", "stale"), ("g/3", "processed"), ("g/9", "parked")]
        );
    }

    /// A process that stopped between a message's commit and the release of its parked
    /// successors (here: a dispatcher without a route to the successors' message, which cannot
    /// release them) leaves them parked; the redelivery of that message, never acked, is a
    /// duplicate, and releases them in order.
    #[tokio::test]
    async fn a_redelivered_predecessor_releases_successors_left_parked() {
        let (pool, _guard) = setup().await;
        let full = Dispatcher::from_registry(pool.clone()).unwrap();
        let stopped = Dispatcher::from_handlers(pool.clone(), [inbox_runtime::handler!(resume_opened)]).unwrap();
        let outcome = |outcomes: Vec<inbox_runtime::ConsumerOutcome>| {
            assert_eq!(outcomes.len(), 1);
            outcomes.into_iter().next().unwrap().result.unwrap()
        };
        let opened = OrderOpened { event_id: "r/1".into(), order_id: "r".into(), seq: 1 };
        let note = |seq: i64| OrderNote { event_id: format!("r/{seq}"), order_id: "r".into(), seq };
        for seq in [3, 2] {
            assert_eq!(outcome(full.dispatch(&envelope(&note(seq))).await.unwrap()), Outcome::Parked);
        }
        assert_eq!(outcome(stopped.dispatch(&envelope(&opened)).await.unwrap()), Outcome::Processed(()));
        assert_eq!(histories(&pool, "orders-resume", "r").await["r"], "opened");
        assert_eq!(parked(&pool).await, 2);
        assert_eq!(outcome(full.dispatch(&envelope(&opened)).await.unwrap()), Outcome::Duplicate);
        assert_eq!(histories(&pool, "orders-resume", "r").await["r"], "opened,note2,note3");
        assert_eq!(parked(&pool).await, 0);
        // The same through a direct call of the handler.
        let mut conn = pool.acquire().await.unwrap();
        assert_eq!(resume_note(&mut conn, OrderNote { event_id: "s/2".into(), order_id: "s".into(), seq: 2 }).await.unwrap(), Outcome::Parked);
        assert_eq!(outcome(stopped.dispatch(&envelope(&OrderOpened { event_id: "s/1".into(), order_id: "s".into(), seq: 1 })).await.unwrap()), Outcome::Processed(()));
        assert_eq!(parked(&pool).await, 1);
        assert_eq!(resume_opened(&mut conn, OrderOpened { event_id: "s/1".into(), order_id: "s".into(), seq: 1 }).await.unwrap(), Outcome::Duplicate);
        assert_eq!(histories(&pool, "orders-resume", "s").await["s"], "opened,note2");
        assert_eq!(parked(&pool).await, 0);
    }

    #[tokio::test]
    async fn a_gap_left_open_is_dead_lettered_or_released_by_policy() {
        let (pool, _guard) = setup().await;
        let dispatcher = Dispatcher::from_registry(pool.clone()).unwrap();
        for e in [event("t1", 2, "paid"), event("t2", 2, "paid"), event("t2", 3, "packed")] {
            let outcomes = dispatcher.dispatch(&envelope(&e)).await.unwrap();
            assert_eq!(outcomes.iter().find(|o| o.consumer == "orders-park").unwrap().result.as_ref().unwrap(), &Outcome::Parked);
        }
        // Not yet expired: nothing happens.
        assert_eq!(dispatcher.sweep_parked().await.unwrap().dead_lettered, 0);
        let stats = inbox_runtime::ops::admin::stats(&pool).await.unwrap();
        assert!(stats.iter().any(|s| s.consumer.as_deref() == Some("orders-park") && s.status == "parked" && s.count == 3), "{stats:?}");

        // A timeout no parked message reaches (`Duration::MAX`: never) sweeps nothing, on every
        // backend's time arithmetic.
        for on_timeout in [ParkTimeout::DeadLetter, ParkTimeout::Release] {
            let never = Dispatcher::from_registry(pool.clone())
                .unwrap()
                .with_park_policy(ParkPolicy::new(std::time::Duration::MAX, on_timeout));
            let report = never.sweep_parked().await.unwrap();
            assert_eq!((report.released, report.dead_lettered), (0, 0), "{report:?}");
        }
        assert_eq!(parked(&pool).await, 3);

        let zero = std::time::Duration::ZERO;
        let release = Dispatcher::from_registry(pool.clone())
            .unwrap()
            .with_park_policy(ParkPolicy::new(zero, ParkTimeout::Release));
        let dead = Dispatcher::from_registry(pool.clone())
            .unwrap()
            .with_park_policy(ParkPolicy::new(zero, ParkTimeout::DeadLetter));
        // Timestamps have millisecond resolution: let the parked ones be strictly older.
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
        // t1/2 and t2/2 are released over their gaps; t2/3 then follows t2/2 in order.
        let report = release.sweep_parked().await.unwrap();
        assert_eq!((report.released, report.dead_lettered), (2, 0), "{report:?}");
        assert_eq!(
            histories(&pool, "orders-park", "t").await,
            BTreeMap::from([("t1".to_owned(), "paid".to_owned()), ("t2".to_owned(), "paid,packed".to_owned())])
        );
        assert_eq!(parked(&pool).await, 0);
        // A late predecessor of a released message is stale.
        let late = dispatcher.dispatch(&envelope(&event("t1", 1, "placed"))).await.unwrap();
        assert_eq!(late.iter().find(|o| o.consumer == "orders-park").unwrap().result.as_ref().unwrap(), &Outcome::Stale);
        // Dead-lettering: a fresh gap, swept with the dead-letter policy.
        let outcomes = dispatcher.dispatch(&envelope(&event("t3", 5, "delivered"))).await.unwrap();
        assert_eq!(outcomes.iter().find(|o| o.consumer == "orders-park").unwrap().result.as_ref().unwrap(), &Outcome::Parked);
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
        assert_eq!(dead.sweep_parked().await.unwrap().dead_lettered, 1);
        let row = inbox_runtime::ops::admin::show(&pool, "orders-park", "t3/5")
            .await
            .unwrap()
            .unwrap();
        assert_eq!(row.status, "dead");
        assert!(row.last_error.unwrap().contains("waiting for sequence 4 of aggregate `t3`"));
        assert!(row.payload.is_some());
    }
}

/// The SQLite file of the restart test, shared between the parent and the child process.
fn restart_db(parent: &str) -> std::path::PathBuf {
    std::env::temp_dir().join(format!("inbox_ordering_restart_{parent}.db"))
}

/// Child of `parked_messages_survive_a_kill`: parks sequences 2 and 3, says so, then hangs until
/// killed. Ignored: only the parent runs it.
#[tokio::test]
#[ignore = "run by parked_messages_survive_a_kill as a child process"]
async fn restart_child() {
    use std::io::Write;
    let options = sqlx::sqlite::SqliteConnectOptions::new()
        .filename(restart_db(&std::env::var("INBOX_RESTART_PARENT").unwrap()))
        .journal_mode(sqlx::sqlite::SqliteJournalMode::Wal);
    let pool = sqlx::SqlitePool::connect_with(options).await.unwrap();
    let dispatcher = inbox_runtime::Dispatcher::from_registry(pool).unwrap();
    for e in [event("r", 3, "packed"), event("r", 2, "paid")] {
        let outcomes = dispatcher.dispatch(&envelope(&e)).await.unwrap();
        let park = outcomes
            .iter()
            .find(|o| o.consumer == "orders-park")
            .unwrap();
        assert_eq!(park.result.as_ref().unwrap(), &Outcome::Parked);
    }
    println!("PARKED");
    std::io::stdout().flush().unwrap();
    tokio::time::sleep(std::time::Duration::from_secs(600)).await;
}

#[tokio::test]
async fn parked_messages_survive_a_kill() {
    use std::io::BufRead;
    let id = format!("{}", std::process::id());
    let path = restart_db(&id);
    let _guard = inbox_tests::TempFile(path.clone());
    let options = sqlx::sqlite::SqliteConnectOptions::new()
        .filename(&path)
        .create_if_missing(true)
        .journal_mode(sqlx::sqlite::SqliteJournalMode::Wal);
    let pool = sqlx::SqlitePool::connect_with(options).await.unwrap();
    inbox_runtime::migrate(&pool).await.unwrap();
    sqlx::raw_sql(ORDERS_TABLE).execute(&pool).await.unwrap();

    // Killed when dropped: also if the child never parks (it would wait 600 s).
    let mut child = inbox_tests::ChildGuard::new(
        std::process::Command::new(std::env::current_exe().unwrap())
            .args(["--exact", "restart_child", "--ignored", "--nocapture"])
            .env("INBOX_RESTART_PARENT", &id)
            .stdout(std::process::Stdio::piped())
            .spawn()
            .unwrap(),
    );
    let stdout = std::io::BufReader::new(child.stdout.take().unwrap());
    let parked_line = stdout
        .lines()
        .map_while(Result::ok)
        .any(|line| line.contains("PARKED"));
    assert!(parked_line, "the child did not park its messages");
    child.kill().unwrap(); // SIGKILL
    child.wait().unwrap();

    let parked: i64 = sqlx::query_scalar(
        "SELECT COUNT(*) FROM inbox_messages WHERE status = 'parked' AND consumer = 'orders-park'",
    )
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!(parked, 2);
    // A new process (this one) fills the gap: 1 applies, then 2 and 3 in order.
    let dispatcher = inbox_runtime::Dispatcher::from_registry(pool.clone()).unwrap();
    let outcomes = dispatcher
        .dispatch(&envelope(&event("r", 1, "placed")))
        .await
        .unwrap();
    let park = outcomes
        .iter()
        .find(|o| o.consumer == "orders-park")
        .unwrap();
    assert_eq!(park.result.as_ref().unwrap(), &Outcome::Processed(()));
    let history: String = sqlx::query_scalar(
        "SELECT history FROM orders WHERE consumer = 'orders-park' AND order_id = 'r'",
    )
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!(history, "placed,paid,packed");
}
