//! Issue 31, item 1: invariants at the point of use. For each public type whose values the
//! runtime validates, every way around its constructor is tried — the constructor or setter
//! itself, `Deserialize`, the CLI's public argument structs built without the parser, the
//! purger — and the code that acts on the value (the purge, the purger, the dispatcher recording
//! a failure, the relay, the worker, the SQS source) is shown refusing it with the constructor's
//! own error, or acting within the bounds its setters keep. Mutating a private field, a struct
//! literal or update, and `Default` where there is none do not compile: the `compile_fail`
//! examples on `admin::Retention` and `RetryPolicy` (run with the doctests).
//!
//! On every backend (PostgreSQL, SQLite, MySQL/MariaDB): a retention below the redelivery
//! horizon deletes nothing, whatever path it took, and the key's redelivery is still a
//! duplicate; a retry policy's out-of-range delays and error text limit are recorded within the
//! bounds (MySQL's `TEXT` column, the databases' time arithmetic); the relay refuses a lease out
//! of range and marks a failure with a capped backoff. Without a backend: the worker's counts,
//! the dedupe cache's TTL; with moto (`SQS_ENDPOINT`): the SQS source's fields set directly.

#![allow(missing_docs)]

use std::time::Duration;

use inbox_runtime::Message;
use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, Serialize, Deserialize, Message)]
#[message(name = "invariants.note")]
pub struct Note {
    #[message(key)]
    pub id: String,
    pub amount: i64,
    /// If set, the handler fails (retryably) with an error text of this many bytes.
    pub fail_with: Option<usize>,
}

const MINUTE: Duration = Duration::from_secs(60);
const HOUR: Duration = Duration::from_secs(3600);

/// Sets every inbox row's times to 40 minutes ago: inside any redelivery horizon
/// `Retention::new` accepts (an hour at least), outside a window of 30 minutes.
const AGE_POSTGRES: &str = "UPDATE inbox_messages SET received_at = now() - interval '40 minutes', \
     processed_at = CASE WHEN processed_at IS NULL THEN NULL \
     ELSE now() - interval '40 minutes' END";
const AGE_SQLITE: &str = "UPDATE inbox_messages SET \
     received_at = strftime('%Y-%m-%dT%H:%M:%fZ', 'now', '-40 minutes'), \
     processed_at = CASE WHEN processed_at IS NULL THEN NULL \
     ELSE strftime('%Y-%m-%dT%H:%M:%fZ', 'now', '-40 minutes') END";
const AGE_MYSQL: &str = "UPDATE inbox_messages SET \
     received_at = UTC_TIMESTAMP(6) - INTERVAL 40 MINUTE, \
     processed_at = CASE WHEN processed_at IS NULL THEN NULL \
     ELSE UTC_TIMESTAMP(6) - INTERVAL 40 MINUTE END";

/// The bytes of `k-long`'s `last_error`.
const ERROR_BYTES_POSTGRES: &str = "SELECT CAST(octet_length(last_error) AS BIGINT) \
     FROM inbox_messages WHERE message_key = 'k-long'";
const ERROR_BYTES_SQLITE: &str = "SELECT length(CAST(last_error AS BLOB)) \
     FROM inbox_messages WHERE message_key = 'k-long'";
const ERROR_BYTES_MYSQL: &str = "SELECT CAST(LENGTH(last_error) AS SIGNED) \
     FROM inbox_messages WHERE message_key = 'k-long'";

/// Days (rounded) until `k-long`'s next attempt.
const RETRY_DAYS_POSTGRES: &str = "SELECT CAST(round(EXTRACT(EPOCH FROM \
     (next_attempt_at - now())) / 86400) AS BIGINT) FROM inbox_messages \
     WHERE message_key = 'k-long'";
const RETRY_DAYS_SQLITE: &str = "SELECT CAST(round(julianday(next_attempt_at) - \
     julianday('now')) AS INTEGER) FROM inbox_messages WHERE message_key = 'k-long'";
const RETRY_DAYS_MYSQL: &str = "SELECT CAST(ROUND(TIMESTAMPDIFF(SECOND, UTC_TIMESTAMP(6), \
     next_attempt_at) / 86400) AS SIGNED) FROM inbox_messages WHERE message_key = 'k-long'";

/// Days (rounded) until the outbox row's next attempt.
const OUTBOX_DAYS_POSTGRES: &str = "SELECT CAST(round(EXTRACT(EPOCH FROM \
     (next_attempt_at - now())) / 86400) AS BIGINT) FROM inbox_outbox";
const OUTBOX_DAYS_SQLITE: &str = "SELECT CAST(round(julianday(next_attempt_at) - \
     julianday('now')) AS INTEGER) FROM inbox_outbox";
const OUTBOX_DAYS_MYSQL: &str = "SELECT CAST(ROUND(TIMESTAMPDIFF(SECOND, UTC_TIMESTAMP(6), \
     next_attempt_at) / 86400) AS SIGNED) FROM inbox_outbox";

/// `RetentionError`'s reason for a horizon below the minimum.
const HORIZON_TEXT: &str = "every broker can deliver a message again at least that long after \
    the first delivery (ack deadlines and visibility timeouts that lapse, consumer restarts and \
    rebalances, producer retries), so a purge this short would forget keys that can still come \
    again";

inbox_tests::backend_matrix! {
    connections(postgres = 4, sqlite = 4);

    use clap::Parser as _;
    use inbox_runtime::ops::admin::{self, PurgerError, Retention, RetentionError};
    use inbox_runtime::ops::cli::{AdminCli, AdminCommand, CliError, PurgeArgs, execute_to};
    use inbox_runtime::outbox::{
        MAX_BACKOFF, MAX_LEASE, MIN_LEASE, Outbox, OutboxMessage, Relay, RelayConfigError,
    };
    use inbox_runtime::sink::{MemorySink, SinkError};
    use inbox_runtime::{Component, Dispatcher, Disposition, Error, RetryPolicy, handler};

    /// A dispatcher of this backend's `note` handler only.
    fn dispatcher(pool: &Pool) -> Dispatcher<Db> {
        Dispatcher::from_handlers(pool.clone(), [handler!(note)]).unwrap()
    }

    #[inbox_runtime::idempotent(consumer = "invariants")]
    async fn note(conn: &mut Conn, msg: Note) -> Result<(), String> {
        sqlx::query(APPLY_EFFECT)
            .bind(format!("note:{}", msg.id))
            .bind(msg.amount)
            .execute(&mut *conn)
            .await
            .map_err(|e| e.to_string())?;
        match msg.fail_with {
            Some(bytes) => Err("x".repeat(bytes)),
            None => Ok(()),
        }
    }

    fn envelope(id: &str, fail_with: Option<usize>) -> inbox_runtime::Envelope {
        inbox_tests::envelope(&Note { id: id.into(), amount: 1, fail_with })
    }

    /// One delivery of note `id`: its outcome's kind.
    async fn send(dispatcher: &Dispatcher<Db>, id: &str) -> &'static str {
        let outcomes = dispatcher.dispatch(&envelope(id, None)).await.unwrap();
        match inbox_tests::outcome_kinds(&outcomes)[..] {
            [Ok(kind) | Err(kind)] => kind,
            ref other => panic!("{other:?}"),
        }
    }

    async fn age(pool: &Pool) {
        let sql = match BACKEND {
            Backend::Postgres => AGE_POSTGRES,
            Backend::MySql => AGE_MYSQL,
            _ => AGE_SQLITE,
        };
        sqlx::query(sql).execute(pool).await.unwrap();
    }

    async fn inbox_rows(pool: &Pool) -> i64 {
        inbox_tests::count(pool, "SELECT COUNT(*) FROM inbox_messages").await
    }

    /// Retention: a window below the redelivery horizon (and a horizon below an hour) is
    /// refused by every path there is — the constructor, `Deserialize`, the CLI's `PurgeArgs`
    /// built without the parser (dry run or not), `--batch-size 0` at the parser — and the
    /// purger refuses an interval below a second. Nothing is deleted: the key processed 40
    /// minutes ago (which a 30-minute window would have purged) stays, and its redelivery is
    /// still a duplicate, applied once. A valid retention of an hour keeps it too.
    #[tokio::test]
    async fn a_retention_below_the_horizon_deletes_nothing_whatever_built_it() {
        let (pool, _guard) = fixture().await;
        let dispatcher = self::dispatcher(&pool);
        assert_eq!(send(&dispatcher, "k-1").await, "processed");
        age(&pool).await;

        // The constructor.
        let below = Retention::new(30 * MINUTE, HOUR).unwrap_err();
        assert_eq!(
            below,
            RetentionError::WindowBelowHorizon { window: 30 * MINUTE, horizon: HOUR }
        );
        let zero = Retention::new(Duration::ZERO, Duration::ZERO).unwrap_err();
        assert_eq!(
            zero.to_string(),
            format!("redelivery horizon of 0s is below the minimum of 1h: {HORIZON_TEXT}")
        );

        // `Deserialize`: the constructor's error, with its text.
        for (json, refused) in [
            (r#"{"window": "30m", "redelivery_horizon": "1h"}"#, &below),
            (r#"{"window": "0s", "redelivery_horizon": "0s"}"#, &zero),
        ] {
            let error = serde_json::from_str::<Retention>(json).unwrap_err();
            assert_eq!(error.to_string(), refused.to_string());
        }

        // The CLI's public arguments, built without the parser: the command builds the
        // retention through the constructor, and refuses with its error.
        for dry_run in [false, true] {
            let args = PurgeArgs {
                window: 30 * MINUTE,
                redelivery_horizon: HOUR,
                dry_run,
                yes: true,
                include_failed_and_dead: true,
                include_rejections: true,
                batch_size: 0,
            };
            let mut out = Vec::new();
            let error = execute_to(&AdminCommand::Purge(args), &pool, &mut out)
                .await
                .unwrap_err();
            match &error {
                CliError::Retention(error) => assert_eq!(error, &below),
                other => panic!("{other:?}"),
            }
            assert_eq!(error.to_string(), below.to_string());
            assert_eq!(out, b"");
        }
        // The parser refuses a batch of zero rows (the library raises it to one).
        let parsed = AdminCli::try_parse_from([
            "admin", "purge", "--window", "7d", "--redelivery-horizon", "3d", "--batch-size", "0",
        ]);
        let parse_error = parsed.unwrap_err().to_string();
        assert!(
            parse_error.contains("invalid value '0' for '--batch-size <BATCH_SIZE>'"),
            "{parse_error}"
        );

        // The purger: its retention can only be a checked one; its interval is checked.
        let hour = Retention::new(HOUR, HOUR).unwrap();
        assert_eq!(
            admin::spawn_purger(pool.clone(), hour.clone(), Duration::ZERO).unwrap_err(),
            PurgerError::IntervalBelowMinimum {
                every: Duration::ZERO,
                minimum: admin::MIN_PURGE_INTERVAL
            }
        );

        // Nothing was deleted: the redelivery is a duplicate, the effect applied once.
        assert_eq!(inbox_rows(&pool).await, 1);
        assert_eq!(send(&dispatcher, "k-1").await, "duplicate");
        assert_eq!(inbox_tests::effect(&pool, "note:k-1").await, Some((1, 1)));

        // A valid retention of an hour: the key is inside its window, and stays.
        let report = admin::purge(&pool, &hour, |_| {}).await.unwrap();
        assert_eq!(report.deleted, 0);
        assert_eq!(send(&dispatcher, "k-1").await, "duplicate");
        assert_eq!(inbox_tests::effect(&pool, "note:k-1").await, Some((1, 1)));
    }

    /// Retry policy: out-of-range values given to its setters are brought within the bounds
    /// where the dispatcher records a failure. A redelivery delay of `Duration::MAX` becomes 30
    /// days (not an interval the databases cannot add), an error text limit of `usize::MAX`
    /// becomes 65,535 bytes (a 70,000-byte `last_error` would not fit MySQL's `TEXT` column:
    /// the failure could not be recorded, and the message would never be counted or
    /// dead-lettered), `max_attempts(0)` dead-letters at the first failure.
    #[tokio::test]
    async fn a_retry_policy_out_of_range_is_recorded_within_its_bounds() {
        let (pool, _guard) = fixture().await;
        let policy = RetryPolicy::default()
            .transient_retries(0)
            .retry_delays(Duration::MAX, Duration::MAX)
            .max_error_bytes(usize::MAX);
        assert_eq!(
            policy.get_retry_delays(),
            (RetryPolicy::MAX_RETRY_DELAY, RetryPolicy::MAX_RETRY_DELAY)
        );
        assert_eq!(policy.get_max_error_bytes(), RetryPolicy::MAX_ERROR_BYTES);
        let bounded = dispatcher(&pool).with_retry_policy(policy.clone());

        let outcomes = bounded.dispatch(&envelope("k-long", Some(70_000))).await.unwrap();
        let after = match &outcomes[0].result {
            Err(Error::Handler(failure)) => match failure.disposition {
                Disposition::Retry { after } => after,
                other => panic!("{other:?}"),
            },
            other => panic!("{other:?}"),
        };
        let days = |d: Duration| d.as_secs() / 86_400;
        assert!((30..60).contains(&days(after)), "{after:?}");
        assert_eq!(
            inbox_tests::inbox_row(&pool, "invariants", "k-long").await,
            Some(("failed".into(), 1))
        );
        let (bytes, retry_days) = match BACKEND {
            Backend::Postgres => (ERROR_BYTES_POSTGRES, RETRY_DAYS_POSTGRES),
            Backend::MySql => (ERROR_BYTES_MYSQL, RETRY_DAYS_MYSQL),
            _ => (ERROR_BYTES_SQLITE, RETRY_DAYS_SQLITE),
        };
        assert_eq!(inbox_tests::count(&pool, bytes).await, 65_535);
        let stored_days = inbox_tests::count(&pool, retry_days).await;
        assert!((30..=60).contains(&stored_days), "{stored_days}");
        // Its redelivery waits (not yet due), and the effect was rolled back.
        let again = bounded.dispatch(&envelope("k-long", Some(70_000))).await.unwrap();
        assert_eq!(inbox_tests::outcome_kinds(&again), [Ok("not_yet")]);
        assert_eq!(inbox_tests::effect(&pool, "note:k-long").await, None);

        // `max_attempts(0)` counts as 1: the first failure is the last.
        let once = dispatcher(&pool).with_retry_policy(policy.max_attempts(0));
        let outcomes = once.dispatch(&envelope("k-once", Some(10))).await.unwrap();
        match &outcomes[0].result {
            Err(Error::Handler(failure)) => {
                assert_eq!(failure.disposition, Disposition::Dead);
                assert_eq!(failure.attempts, 1);
            }
            other => panic!("{other:?}"),
        }
        assert_eq!(
            inbox_tests::inbox_row(&pool, "invariants", "k-once").await,
            Some(("dead".into(), 1))
        );
    }

    /// Relay: a lease outside 100 ms..=1 h is refused by its setter (a shorter one times every
    /// round out and dead-letters rows unpublished); the other settings are brought within
    /// bounds (batch and attempts at least 1, a poll of at least 1 ms, backoffs of at most 30
    /// days). Where the relay acts: a failed publish is marked with the capped backoff — 30
    /// days, not a `Duration::MAX` the databases cannot add — and waits for it.
    #[tokio::test]
    async fn a_relay_refuses_a_lease_out_of_range_and_marks_within_its_bounds() {
        let (pool, _guard) = fixture().await;
        inbox_runtime::migrate_components(&pool, &[Component::Inbox, Component::Outbox])
            .await
            .unwrap();
        for lease in [
            Duration::ZERO,
            Duration::from_millis(99),
            MAX_LEASE + Duration::from_nanos(1),
            Duration::MAX,
        ] {
            let refused = Relay::new(pool.clone(), MemorySink::new()).lease(lease).unwrap_err();
            assert_eq!(
                refused,
                RelayConfigError::LeaseOutOfRange { lease, min: MIN_LEASE, max: MAX_LEASE }
            );
        }
        assert_eq!(
            Relay::new(pool.clone(), MemorySink::new())
                .lease(Duration::ZERO)
                .unwrap_err()
                .to_string(),
            "relay lease of 0s is outside 100ms..=1h: a lease shorter than a publish times every \
             round out and dead-letters rows unpublished; a longer one is a unit slip"
        );
        for lease in [MIN_LEASE, MAX_LEASE] {
            assert!(Relay::new(pool.clone(), MemorySink::new()).lease(lease).is_ok());
        }

        let failing = MemorySink::new().fail_when(|_| Some(SinkError::retryable("broker down")));
        let relay = Relay::new(pool.clone(), failing)
            .lease(MIN_LEASE)
            .unwrap()
            .batch_size(0)
            .max_attempts(0)
            .poll_interval(Duration::ZERO)
            .backoff(Duration::MAX, Duration::MAX);
        let shown = format!("{relay:?}");
        for field in [
            "batch_size: 1,",
            "lease: 100ms,",
            "poll_interval: 1ms,",
            "max_attempts: 1,",
            "backoff: 2592000s,",
            "max_backoff: 2592000s,",
        ] {
            assert!(shown.contains(field), "{field} in {shown}");
        }
        assert_eq!(MAX_BACKOFF, 30 * 24 * HOUR);

        // A relay allowed two attempts, so that the failure waits for its backoff.
        let relay = Relay::new(
            pool.clone(),
            MemorySink::new().fail_when(|_| Some(SinkError::retryable("broker down"))),
        )
        .lease(MIN_LEASE)
        .unwrap()
        .max_attempts(2)
        .backoff(Duration::MAX, Duration::MAX);
        const OUTBOX: Outbox = Outbox::new(&["orders"]);
        let mut tx = pool.begin().await.unwrap();
        OUTBOX
            .publish(&mut *tx, OutboxMessage::raw("orders", "orders.paid", "{}").message_id("m-1"))
            .await
            .unwrap();
        tx.commit().await.unwrap();
        // On PostgreSQL a row is leased once every transaction older than it has ended, on the
        // whole server (other tests' included): a bound on the wait, not a timing.
        let deadline = std::time::Instant::now() + Duration::from_secs(120);
        let round = loop {
            let round = relay.run_once().await.unwrap();
            if round.leased > 0 || std::time::Instant::now() > deadline {
                break round;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        };
        assert_eq!((round.leased, round.failed, round.dead), (1, 1, 0));
        let days = match BACKEND {
            Backend::Postgres => OUTBOX_DAYS_POSTGRES,
            Backend::MySql => OUTBOX_DAYS_MYSQL,
            _ => OUTBOX_DAYS_SQLITE,
        };
        assert_eq!(inbox_tests::count(&pool, days).await, 30);
        assert_eq!(relay.run_once().await.unwrap().leased, 0, "it waits for its backoff");
    }
}

/// Worker: its fields are private and its setters raise a zero concurrency and a zero batch
/// size to 1 (documented); where it runs, it runs with them — every delivery processed, once.
#[tokio::test]
async fn a_worker_with_zero_concurrency_and_batch_runs_one_at_a_time() {
    use inbox_runtime::source::memory::MemorySource;
    use inbox_runtime::{CancellationToken, Dispatcher, StopReason, Worker, handler};

    let (pool, _guard) = inbox_tests::sqlite_pool(4).await;
    let dispatcher =
        Dispatcher::from_handlers(pool.clone(), [handler!(plain::worker_note)]).unwrap();
    let source = MemorySource::new("invariants");
    let handle = source.handle();
    for id in ["w-1", "w-2", "w-3", "w-1"] {
        handle.push(inbox_tests::envelope(&Note {
            id: id.into(),
            amount: 1,
            fail_with: None,
        }));
    }
    handle.close();
    let worker = Worker::new(dispatcher)
        .concurrency(0)
        .batch(0, Duration::ZERO);
    let report = worker.run(source, CancellationToken::new()).await.unwrap();
    assert_eq!(
        (
            report.processed,
            report.duplicates,
            report.acked,
            report.batches
        ),
        (3, 1, 4, 0)
    );
    assert_eq!(report.stop, StopReason::SourceExhausted);
    for id in ["w-1", "w-2", "w-3"] {
        assert_eq!(
            inbox_tests::effect(&pool, &format!("worker:{id}")).await,
            Some((1, 1))
        );
    }
}

/// Handlers of the tests outside the backend matrix (SQLite). Dispatchers list their handlers
/// (`from_handlers`), so that the matrix's and these never share a dispatcher.
mod plain {
    use super::Note;

    /// The worker and cache tests' handler.
    #[inbox_runtime::idempotent(consumer = "invariants-worker")]
    pub(crate) async fn worker_note(
        conn: &mut sqlx::SqliteConnection,
        msg: Note,
    ) -> Result<(), sqlx::Error> {
        sqlx::query(inbox_tests::APPLY_EFFECT)
            .bind(format!("worker:{}", msg.id))
            .bind(msg.amount)
            .execute(&mut *conn)
            .await?;
        Ok(())
    }
}

/// Dedupe cache: its TTL is checked against the retention where the cache is put in front of
/// the inbox (`Dispatcher::with_cache`), and the retention's window cannot be widened after its
/// checks (private fields): a zero TTL and one above the window are refused.
#[tokio::test]
async fn a_cache_ttl_outside_the_window_is_refused() {
    use inbox_runtime::cache::{CacheTtlError, MemoryCache};
    use inbox_runtime::ops::admin::Retention;
    use inbox_runtime::{Dispatcher, handler};

    let (pool, _guard) = inbox_tests::sqlite_pool(2).await;
    let retention = Retention::new(24 * HOUR, HOUR).unwrap();
    let dispatcher =
        || Dispatcher::from_handlers(pool.clone(), [handler!(plain::worker_note)]).unwrap();
    for ttl in [Duration::ZERO, 24 * HOUR + Duration::from_millis(1)] {
        let refused = dispatcher()
            .with_cache(MemoryCache::new(100, ttl), &retention)
            .unwrap_err();
        assert_eq!(
            refused,
            CacheTtlError {
                ttl,
                window: 24 * HOUR
            }
        );
    }
    assert!(
        dispatcher()
            .with_cache(MemoryCache::new(100, 24 * HOUR), &retention)
            .is_ok()
    );
}

/// SQS source: `SqsConfig`'s fields are public; set directly past the setters' limits (a
/// visibility timeout of zero, which would make the heartbeat tick every 0 s; a receive wait of
/// zero, short polling; no deliveries in flight), they are brought within the same limits when
/// the source connects, where they are acted on.
#[tokio::test]
async fn an_sqs_config_set_directly_is_brought_within_limits_at_connect() {
    use aws_sdk_sqs::types::QueueAttributeName;
    use inbox_runtime::source::Source as _;
    use inbox_runtime::source::sqs::{AwsSettings, SqsConfig, SqsSource};

    let endpoint = std::env::var("SQS_ENDPOINT").unwrap_or_else(|_| {
        panic!("SQS_ENDPOINT is not set: run the tests with scripts/test.sh, which starts moto")
    });
    let settings = AwsSettings::default().endpoint_url(&endpoint);
    let client = inbox_runtime::source::sqs::client(&settings, Duration::from_secs(20)).await;
    let name = format!("invariants-{}", std::process::id());
    client
        .create_queue()
        .queue_name(&name)
        .attributes(QueueAttributeName::VisibilityTimeout, "30")
        .send()
        .await
        .expect("create the queue");
    let mut config = SqsConfig::new(&name).aws(settings);
    config.visibility_timeout = Duration::ZERO;
    config.wait_time = Duration::ZERO;
    config.max_in_flight = 0;
    config.max_processing_time = Duration::MAX;
    let mut source = SqsSource::connect(config).await.unwrap();
    let used = source.config();
    assert_eq!(
        (
            used.visibility_timeout,
            used.wait_time,
            used.max_in_flight,
            used.max_processing_time
        ),
        (
            Duration::from_secs(1),
            Duration::from_secs(1),
            1,
            Duration::from_secs(12 * 3600)
        )
    );
    source.close().await.unwrap();
}
