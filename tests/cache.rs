//! The fast-path dedupe cache, in-process and on Redis, on both backends: duplicates answered
//! without the database (proved by closing the pool), nothing but final states cached, operators'
//! changes invalidating, conflicts caught on a hit, a flushed cache still safe; then on
//! PostgreSQL, Redis killed mid-stream and two workers sharing Redis through a duplicate storm.
//!
//! Redis comes from `REDIS_URL` (the test command starts one); each test writes under a prefix
//! of its own. The kill test starts a Redis server of its own.

#![allow(missing_docs)]

use inbox_runtime::Message;
use serde::{Deserialize, Serialize};

/// A payment: its id is the idempotency key.
#[derive(Debug, Clone, Serialize, Deserialize, Message)]
#[message(name = "cache.pay")]
pub struct Pay {
    #[message(key)]
    pub id: String,
    pub cents: i64,
    /// Fail with a retryable error (`"retry"`) or a permanent one (`"refuse"`) while the test's
    /// switch for it is on.
    #[serde(default)]
    pub fail: String,
}

pub fn pay(id: &str, cents: i64) -> Pay {
    Pay {
        id: id.to_owned(),
        cents,
        fail: String::new(),
    }
}

/// A Redis cache on `REDIS_URL` under a prefix of its own.
#[cfg(test)]
pub async fn redis_cache(
    prefix: &str,
    ttl: std::time::Duration,
) -> inbox_runtime::cache::redis::RedisCache {
    let url = std::env::var("REDIS_URL").expect("REDIS_URL (run the tests with scripts/test.sh)");
    inbox_runtime::cache::redis::RedisCache::connect(&url, ttl)
        .await
        .expect("connect to Redis")
        .prefix(format!("test:{prefix}:{}:", uuid::Uuid::new_v4()))
}

inbox_tests::backend_matrix! {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicBool, Ordering::SeqCst};
    use std::time::Duration;

    use inbox_runtime::ops::admin::Retention;
    use inbox_runtime::cache::{CacheEntry, DedupeCache, Fill, MemoryCache};
    use inbox_runtime::{
        Classify, Dispatcher, ErrorClass, Fingerprint, Outcome, RetryPolicy, Status, handler,
        ops::admin,
    };
    use inbox_tests::{envelope, outcome_kinds};

    /// A handler error: retryable or permanent.
    #[derive(Debug)]
    struct PayError(ErrorClass);

    impl std::fmt::Display for PayError {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            write!(f, "payment refused ({})", self.0.as_str())
        }
    }

    impl std::error::Error for PayError {}

    impl Classify for PayError {
        fn class(&self) -> ErrorClass {
            self.0
        }
    }

    /// Payments marked `retry` fail while this is on (only the retry test sends them).
    static RETRY_FAILS: AtomicBool = AtomicBool::new(true);
    /// Payments marked `refuse` fail for good while this is on (only the operators test).
    static REFUSE_FAILS: AtomicBool = AtomicBool::new(true);

    #[inbox_runtime::idempotent(consumer = "payments")]
    async fn take(conn: &mut Conn, msg: Pay) -> Result<(), PayError> {
        if msg.fail == "retry" && RETRY_FAILS.load(SeqCst) {
            return Err(PayError(ErrorClass::Retryable));
        }
        if msg.fail == "refuse" && REFUSE_FAILS.load(SeqCst) {
            return Err(PayError(ErrorClass::Permanent));
        }
        sqlx::query(APPLY_EFFECT)
            .bind(format!("pay:{}", msg.id))
            .bind(msg.cents)
            .execute(conn)
            .await
            .map_err(|_| PayError(ErrorClass::Retryable))?;
        Ok(())
    }

    fn retention() -> Retention {
        Retention::new(Duration::from_secs(7 * 86_400), Duration::from_secs(3600)).unwrap()
    }

    async fn dispatcher(pool: &Pool, cache: impl DedupeCache) -> Dispatcher<Db> {
        Dispatcher::from_handlers(pool.clone(), [handler!(take)])
            .unwrap()
            .with_retry_policy(
                RetryPolicy::default().retry_delays(Duration::from_millis(1), Duration::from_millis(1)),
            )
            .with_cache(cache, &retention())
            .unwrap()
    }

    /// Both caches, each on a fresh database: the body runs once per cache.
    async fn each_cache<F, Fut>(name: &str, body: F)
    where
        F: Fn(Pool, Arc<dyn DedupeCache>) -> Fut,
        Fut: std::future::Future<Output = ()>,
    {
        let ttl = Duration::from_secs(600);
        let caches: [Arc<dyn DedupeCache>; 2] = [
            Arc::new(MemoryCache::new(10_000, ttl)),
            Arc::new(crate::redis_cache(name, ttl).await),
        ];
        for cache in caches {
            let (pool, _guard) = fixture().await;
            eprintln!("{name}: {} cache", cache.name());
            body(pool, cache).await;
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn duplicates_are_answered_without_the_database() {
        each_cache("no_db", |pool, cache| async move {
            let dispatcher = dispatcher(&pool, cache).await;
            let first = envelope(&pay("p1", 500));
            assert_eq!(outcome_kinds(&dispatcher.dispatch(&first).await.unwrap()), [Ok("processed")]);
            // The pool is closed: only the cache can answer now.
            pool.close().await;
            let again = dispatcher.dispatch(&first).await.unwrap();
            assert_eq!(outcome_kinds(&again), [Ok("duplicate")]);
            // A field order and whitespace of its own: the same fingerprint, a duplicate.
            let reformatted = inbox_runtime::Envelope::new(
                "cache.pay",
                br#"{ "cents": 500, "id": "p1" }"#.to_vec(),
            );
            assert_eq!(outcome_kinds(&dispatcher.dispatch(&reformatted).await.unwrap()), [Ok("duplicate")]);
            let batch = dispatcher.dispatch_batch(&[first.clone(), first.clone()]).await;
            let kinds: Vec<_> = batch.iter().map(|r| outcome_kinds(r.as_ref().unwrap())).collect();
            assert_eq!(kinds, [[Ok("duplicate")], [Ok("duplicate")]]);
            // A key the cache does not know needs the database, which is closed.
            let new = dispatcher.dispatch(&envelope(&pay("p2", 1))).await.unwrap();
            assert_eq!(outcome_kinds(&new), [Err("database")]);
        })
        .await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_batch_fills_the_cache_after_its_commit() {
        each_cache("batch", |pool, cache| async move {
            let dispatcher = dispatcher(&pool, cache).await;
            let batch: Vec<_> = (0..10).map(|i| envelope(&pay(&format!("b{i}"), i))).collect();
            let results = dispatcher.dispatch_batch(&batch).await;
            assert!(results.iter().all(|r| outcome_kinds(r.as_ref().unwrap()) == [Ok("processed")]));
            pool.close().await;
            let again = dispatcher.dispatch_batch(&batch).await;
            assert!(
                again.iter().all(|r| outcome_kinds(r.as_ref().unwrap()) == [Ok("duplicate")]),
                "{again:?}"
            );
        })
        .await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_retryable_failure_is_not_cached_and_its_redelivery_runs() {
        each_cache("retry", |pool, cache| async move {
            RETRY_FAILS.store(true, SeqCst);
            let dispatcher = dispatcher(&pool, Arc::clone(&cache)).await;
            let mut msg = pay("r1", 700);
            msg.fail = "retry".into();
            let failed = dispatcher.dispatch(&envelope(&msg)).await.unwrap();
            assert_eq!(outcome_kinds(&failed), [Err("handler")]);
            assert_eq!(cache.get("payments", "r1").await.unwrap(), None, "a failed key is never cached");
            assert_eq!(inbox_tests::make_due(&pool).await, 1);
            // Redelivered once the cause is gone: it runs (the cache did not answer it).
            RETRY_FAILS.store(false, SeqCst);
            let retried = dispatcher.dispatch(&envelope(&msg)).await.unwrap();
            assert_eq!(outcome_kinds(&retried), [Ok("processed")]);
            assert_eq!(inbox_tests::effect(&pool, "pay:r1").await, Some((1, 700)));
            let again = dispatcher.dispatch(&envelope(&msg)).await.unwrap();
            assert_eq!(outcome_kinds(&again), [Ok("duplicate")]);
            let row = admin::show(&pool, "payments", "r1").await.unwrap().unwrap();
            assert_eq!((row.status, row.attempts), (Status::Processed, 2));
        })
        .await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_conflict_is_detected_on_a_cache_hit() {
        each_cache("conflict", |pool, cache| async move {
            let dispatcher = dispatcher(&pool, cache).await;
            let original = envelope(&pay("c1", 500));
            dispatcher.dispatch(&original).await.unwrap();
            dispatcher.dispatch(&original).await.unwrap(); // a hit
            let other = dispatcher.dispatch(&envelope(&pay("c1", 900))).await.unwrap();
            assert_eq!(outcome_kinds(&other), [Err("conflict")]);
            assert_eq!(inbox_tests::effect(&pool, "pay:c1").await, Some((1, 500)));
            assert_eq!(
                inbox_tests::count(&pool, "SELECT count(*) FROM inbox_rejections WHERE reason = 'conflict'").await,
                1,
                "reported as without a cache"
            );
        })
        .await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_flushed_cache_still_catches_duplicates() {
        each_cache("flush", |pool, cache| async move {
            let dispatcher = dispatcher(&pool, Arc::clone(&cache)).await;
            let msg = envelope(&pay("f1", 300));
            dispatcher.dispatch(&msg).await.unwrap();
            cache.invalidate("payments", "f1").await.unwrap(); // flushed, or expired early
            let again = dispatcher.dispatch(&msg).await.unwrap();
            assert_eq!(outcome_kinds(&again), [Ok("duplicate")]);
            assert_eq!(inbox_tests::effect(&pool, "pay:f1").await, Some((1, 300)));
            // The database's answer was cached again.
            let fingerprint = Fingerprint::of("cache.pay", &pay("f1", 300)).unwrap();
            assert_eq!(
                cache.get("payments", "f1").await.unwrap(),
                CacheEntry::new(Status::Processed, fingerprint)
            );
        })
        .await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn operators_changes_invalidate_the_cache() {
        each_cache("operators", |pool, cache| async move {
            REFUSE_FAILS.store(true, SeqCst);
            let dispatcher = dispatcher(&pool, Arc::clone(&cache)).await;
            let mut refused = pay("d1", 400);
            refused.fail = "refuse".into();
            let mut discarded = pay("d2", 50);
            discarded.fail = "refuse".into();
            for msg in [&refused, &discarded] {
                let dead = dispatcher.dispatch(&envelope(msg)).await.unwrap();
                assert_eq!(outcome_kinds(&dead), [Err("handler")]);
                // Cached dead: a redelivery is answered `dead`.
                assert_eq!(outcome_kinds(&dispatcher.dispatch(&envelope(msg)).await.unwrap()), [Ok("dead")]);
            }
            let fingerprint = Fingerprint::of("cache.pay", &refused).unwrap();
            assert_eq!(cache.get("payments", "d1").await.unwrap(), CacheEntry::new(Status::Dead, fingerprint));

            // Replayed once the cause is fixed: the cache says processed, not dead.
            REFUSE_FAILS.store(false, SeqCst);
            let replayed = dispatcher.replay("payments", "d1").await.unwrap();
            assert_eq!(replayed.result.unwrap(), Outcome::Processed(()));
            assert_eq!(cache.get("payments", "d1").await.unwrap(), CacheEntry::new(Status::Processed, fingerprint));
            assert_eq!(outcome_kinds(&dispatcher.dispatch(&envelope(&refused)).await.unwrap()), [Ok("duplicate")]);
            assert_eq!(inbox_tests::effect(&pool, "pay:d1").await, Some((1, 400)));

            // Discarded: the next delivery reads `discarded` from the inbox.
            assert!(dispatcher.discard("payments", "d2").await.unwrap());
            assert_eq!(cache.get("payments", "d2").await.unwrap(), None);
            assert_eq!(outcome_kinds(&dispatcher.dispatch(&envelope(&discarded)).await.unwrap()), [Ok("discarded")]);
            assert_eq!(inbox_tests::effect(&pool, "pay:d2").await, None);
        })
        .await;
    }

    #[tokio::test]
    async fn a_time_to_live_longer_than_the_retention_window_is_refused() {
        let (pool, _guard) = fixture().await;
        let day = Retention::new(Duration::from_secs(86_400), Duration::from_secs(3600)).unwrap();
        let two_days = MemoryCache::new(10, Duration::from_secs(2 * 86_400));
        let refused = Dispatcher::from_handlers(pool.clone(), [handler!(take)])
            .unwrap()
            .with_cache(two_days, &day)
            .unwrap_err();
        assert_eq!((refused.ttl, refused.window), (Duration::from_secs(2 * 86_400), Duration::from_secs(86_400)));
        let zero = MemoryCache::new(10, Duration::ZERO);
        assert!(Dispatcher::from_handlers(pool.clone(), [handler!(take)]).unwrap().with_cache(zero, &day).is_err());
        let one_day = MemoryCache::new(10, Duration::from_secs(86_400));
        assert!(Dispatcher::from_handlers(pool, [handler!(take)]).unwrap().with_cache(one_day, &day).is_ok());
    }

    /// The in-process cache fills "if absent": a late fill never overwrites a newer state.
    #[tokio::test]
    async fn a_late_fill_does_not_overwrite_a_newer_entry() {
        let ttl = Duration::from_secs(60);
        let caches: [Arc<dyn DedupeCache>; 2] =
            [Arc::new(MemoryCache::new(10, ttl)), Arc::new(crate::redis_cache("late", ttl).await)];
        let fingerprint = Fingerprint::of("cache.pay", &pay("l1", 1)).unwrap();
        let processed = CacheEntry::new(Status::Processed, fingerprint).unwrap();
        let dead = CacheEntry::new(Status::Dead, fingerprint).unwrap();
        for cache in caches {
            cache.fill("payments", "l1", processed, Fill::Replace).await.unwrap();
            cache.fill("payments", "l1", dead, Fill::IfAbsent).await.unwrap();
            assert_eq!(cache.get("payments", "l1").await.unwrap(), Some(processed), "{}", cache.name());
            // Consumers and keys that run into each other stay apart.
            assert_eq!(cache.get("payment", "sl1").await.unwrap(), None);
            assert_eq!(cache.get("payments:l", "1").await.unwrap(), None);
        }
        // Only final states are entries at all.
        for status in [Status::Failed, Status::Parked, Status::Stale] {
            assert_eq!(CacheEntry::new(status, fingerprint), None);
        }
    }
}

/// Redis drills on PostgreSQL: the cache server killed mid-stream, and two workers sharing one
/// Redis through a duplicate storm.
mod redis_drills {
    use std::process::{Command, Stdio};
    use std::time::Duration;

    use inbox_runtime::cache::redis::RedisCache;
    use inbox_runtime::source::memory::MemorySource;
    use inbox_runtime::{CancellationToken, Dispatcher, Worker, handler, ops::admin::Retention};
    use inbox_tests::{APPLY_EFFECT, ChildGuard, envelope, outcome_kinds};
    use sqlx::{PgConnection, PgPool};

    use super::{Pay, pay};

    #[inbox_runtime::idempotent(consumer = "storm")]
    async fn storm(conn: &mut PgConnection, msg: Pay) -> Result<(), sqlx::Error> {
        sqlx::query(APPLY_EFFECT)
            .bind(format!("storm:{}", msg.id))
            .bind(msg.cents)
            .execute(conn)
            .await?;
        Ok(())
    }

    fn retention() -> Retention {
        Retention::new(Duration::from_secs(86_400), Duration::from_secs(3600)).unwrap()
    }

    fn dispatcher(pool: &PgPool, cache: RedisCache) -> Dispatcher<sqlx::Postgres> {
        Dispatcher::from_handlers(pool.clone(), [handler!(storm)])
            .unwrap()
            .with_cache(cache, &retention())
            .unwrap()
    }

    /// Every key applied exactly once, with its amount: (rows, applied, sum).
    async fn effects(pool: &PgPool) -> (i64, i64, i64) {
        sqlx::query_as(
            "SELECT count(*), sum(applied)::BIGINT, sum(total)::BIGINT FROM effects \
             WHERE effect_key LIKE 'storm:%'",
        )
        .fetch_one(pool)
        .await
        .unwrap()
    }

    /// A Redis server of this test's own on a free loopback port.
    fn start_redis() -> (ChildGuard, String) {
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let child = Command::new("redis-server")
            .args(["--bind", "127.0.0.1", "--port", &port.to_string()])
            .args(["--save", "", "--appendonly", "no"])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("start redis-server (scripts/redis.sh install)");
        let guard = ChildGuard::new(child);
        let deadline = std::time::Instant::now() + Duration::from_secs(20);
        while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
            assert!(
                std::time::Instant::now() < deadline,
                "redis-server did not start"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        (guard, format!("redis://127.0.0.1:{port}/"))
    }

    /// Redis killed halfway through a stream of deliveries (each payment delivered three
    /// times): every outcome stays right, the database answering what the cache no longer can.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn redis_killed_mid_stream_processing_goes_on_on_the_database() {
        let pool = inbox_tests::pg_pool(4).await;
        let (mut redis, url) = start_redis();
        let cache = RedisCache::connect(&url, Duration::from_secs(600))
            .await
            .unwrap();
        let dispatcher = dispatcher(&pool, cache);
        let payments: Vec<Pay> = (0..60).map(|i| pay(&format!("k{i}"), 100 + i)).collect();
        let mut kinds = std::collections::BTreeMap::<String, u32>::new();
        let mut deliver = async |msg: &Pay| {
            let outcomes = dispatcher.dispatch(&envelope(msg)).await.unwrap();
            let kind = match outcome_kinds(&outcomes)[0] {
                Ok(kind) | Err(kind) => kind,
            };
            *kinds.entry(kind.to_owned()).or_default() += 1;
        };
        // The first half, each delivered twice: the second answered by Redis.
        for msg in &payments[..30] {
            deliver(msg).await;
            deliver(msg).await;
        }
        redis.kill().unwrap();
        redis.wait().unwrap();
        // The second half twice, then every payment once more, with Redis gone.
        for msg in &payments[30..] {
            deliver(msg).await;
            deliver(msg).await;
        }
        for msg in &payments {
            deliver(msg).await;
        }
        assert_eq!(
            kinds.into_iter().collect::<Vec<_>>(),
            [("duplicate".to_owned(), 120), ("processed".to_owned(), 60)]
        );
        let sum: i64 = payments.iter().map(|p| p.cents).sum();
        assert_eq!(effects(&pool).await, (60, 60, sum));
    }

    /// Two workers, 16 deliveries at a time each, sharing one Redis, both fed every payment
    /// twice (four deliveries of each in all, concurrently): each applied once.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn two_workers_sharing_redis_through_a_duplicate_storm() {
        let pool = inbox_tests::pg_pool(40).await;
        let payments: Vec<Pay> = (0..300).map(|i| pay(&format!("s{i}"), 1 + i)).collect();
        let prefix = format!("test:storm:{}:", uuid::Uuid::new_v4());
        let url = std::env::var("REDIS_URL").expect("REDIS_URL");
        let mut runs = Vec::new();
        for _ in 0..2 {
            let cache = RedisCache::connect(&url, Duration::from_secs(600))
                .await
                .unwrap()
                .prefix(prefix.clone());
            let source = MemorySource::new("storm");
            let handle = source.handle();
            for _ in 0..2 {
                for msg in &payments {
                    handle.push(envelope(msg));
                }
            }
            handle.close();
            let worker = Worker::new(dispatcher(&pool, cache)).concurrency(16);
            runs.push(tokio::spawn(async move {
                worker.run(source, CancellationToken::new()).await.unwrap()
            }));
        }
        let mut processed = 0;
        let mut duplicates = 0;
        for run in runs {
            let report = run.await.unwrap();
            assert_eq!(
                (report.acked, report.failed, report.conflicts),
                (600, 0, 0),
                "{report:?}"
            );
            processed += report.processed;
            duplicates += report.duplicates;
        }
        assert_eq!((processed, duplicates), (300, 900));
        let sum: i64 = payments.iter().map(|p| p.cents).sum();
        assert_eq!(effects(&pool).await, (300, 300, sum));
    }
}
