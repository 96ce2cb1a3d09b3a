//! Failures on both backends: recorded attempts, retries, dead letters, replay, discard,
//! conflicts kept, and the retention purge.

#![allow(missing_docs)]

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::Duration;

use inbox_runtime::{Classify, ErrorClass, Message, Outcome};
use inbox_tests::effect;
use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, Serialize, Deserialize, Message)]
#[message(name = "test.job")]
pub struct Job {
    #[message(key)]
    pub id: String,
    pub amount: i64,
}

#[derive(Debug, Clone, Serialize, Deserialize, Message)]
#[message(name = "test.strict")]
pub struct StrictJob {
    #[message(key)]
    pub id: String,
}

/// Per job id: how many more attempts fail, and how (`true`: permanently).
static FAILURES: Mutex<Vec<(String, u32, bool)>> = Mutex::new(Vec::new());

fn fail_next(id: &str, times: u32, permanent: bool) {
    let mut failures = FAILURES.lock().unwrap();
    failures.retain(|(other, ..)| other != id);
    failures.push((id.to_owned(), times, permanent));
}

/// Whether this attempt of `id` fails, and how.
fn take_failure(id: &str) -> Option<bool> {
    let mut failures = FAILURES.lock().unwrap();
    let entry = failures.iter_mut().find(|(other, ..)| other == id)?;
    if entry.1 == 0 {
        return None;
    }
    entry.1 -= 1;
    Some(entry.2)
}

#[derive(Debug, thiserror::Error)]
pub enum JobError {
    #[error("flaky dependency")]
    Flaky,
    #[error("invalid job: {0}")]
    Invalid(String),
    #[error(transparent)]
    Db(#[from] sqlx::Error),
}

impl Classify for JobError {
    fn class(&self) -> ErrorClass {
        match self {
            JobError::Flaky => ErrorClass::Retryable,
            JobError::Invalid(_) => ErrorClass::Permanent,
            JobError::Db(error) => error.class(),
        }
    }
}

static CALLS: Mutex<Option<HashMap<String, u32>>> = Mutex::new(None);

fn count_call(id: &str) {
    *CALLS
        .lock()
        .unwrap()
        .get_or_insert_with(HashMap::new)
        .entry(id.to_owned())
        .or_default() += 1;
}

fn calls(id: &str) -> u32 {
    CALLS
        .lock()
        .unwrap()
        .as_ref()
        .and_then(|calls| calls.get(id).copied())
        .unwrap_or(0)
}

/// Makes the `old-%` messages two days older (each backend has its own date arithmetic).
const AGE_POSTGRES: &str = "UPDATE inbox_messages SET received_at = received_at - interval '2 days', \
     processed_at = processed_at - interval '2 days' WHERE message_key LIKE 'old-%'";
const AGE_SQLITE: &str = "UPDATE inbox_messages \
     SET received_at = strftime('%Y-%m-%dT%H:%M:%fZ', received_at, '-2 days'), \
     processed_at = strftime('%Y-%m-%dT%H:%M:%fZ', processed_at, '-2 days') \
     WHERE message_key LIKE 'old-%'";

const AGE_MYSQL: &str = "UPDATE inbox_messages \
     SET received_at = received_at - INTERVAL 2 DAY, processed_at = processed_at - INTERVAL 2 DAY \
     WHERE message_key LIKE 'old-%'";

/// Makes the `old.%` rejections two days older.
const AGE_REJECTIONS_POSTGRES: &str = "UPDATE inbox_rejections \
     SET received_at = received_at - interval '2 days' WHERE message_name LIKE 'old.%'";
const AGE_REJECTIONS_SQLITE: &str = "UPDATE inbox_rejections \
     SET received_at = strftime('%Y-%m-%dT%H:%M:%fZ', received_at, '-2 days') \
     WHERE message_name LIKE 'old.%'";
const AGE_REJECTIONS_MYSQL: &str = "UPDATE inbox_rejections \
     SET received_at = received_at - INTERVAL 2 DAY WHERE message_name LIKE 'old.%'";

inbox_tests::backend_matrix! {
    connections(postgres = 8, sqlite = 4);

    use inbox_runtime::ops::admin::{self, Retention};
    use inbox_runtime::{Dispatcher, Disposition, Envelope, Error, RetryPolicy};

    #[inbox_runtime::idempotent(consumer = "jobs")]
    async fn run_job(conn: &mut Conn, msg: Job) -> Result<(), JobError> {
        let id = format!("{BACKEND}:{}", msg.id);
        count_call(&id);
        sqlx::query(APPLY_EFFECT)
            .bind(format!("job:{}", msg.id))
            .bind(msg.amount)
            .execute(&mut *conn)
            .await?;
        match take_failure(&id) {
            Some(true) => Err(JobError::Invalid(msg.id)),
            Some(false) => Err(JobError::Flaky),
            None => Ok(()),
        }
    }

    /// Always fails, retryably; dead at the second attempt by its own `max_attempts`.
    #[inbox_runtime::idempotent(consumer = "strict", max_attempts = 2)]
    async fn strict(_conn: &mut Conn, msg: StrictJob) -> Result<(), JobError> {
        count_call(&id(&msg.id));
        Err(JobError::Flaky)
    }

    #[tokio::test]
    async fn the_handlers_max_attempts_overrides_the_default() {
        let (pool, _guard) = fixture().await;
        let mut conn = pool.acquire().await.unwrap();
        let job = || StrictJob { id: "s".into() };
        let first = strict(&mut conn, job()).await.unwrap_err();
        let first = first.as_handler_failure().unwrap();
        assert!(
            matches!(first.disposition, Disposition::Retry { .. }),
            "{first:?}"
        );
        inbox_tests::make_due(&pool).await;
        let second = strict(&mut conn, job()).await.unwrap_err();
        let second = second.as_handler_failure().unwrap();
        assert_eq!(
            (second.attempts, second.disposition),
            (2, Disposition::Dead)
        );
        assert_eq!(strict(&mut conn, job()).await.unwrap(), Outcome::Dead);
        assert_eq!(calls(&id("s")), 2);
    }

    fn id(job: &str) -> String {
        format!("{BACKEND}:{job}")
    }

    fn envelope(job: &str, amount: i64) -> Envelope {
        inbox_tests::envelope(&Job {
            id: job.into(),
            amount,
        })
    }

    async fn applied(pool: &Pool, job: &str) -> i64 {
        effect(pool, &format!("job:{job}"))
            .await
            .map_or(0, |(applied, _)| applied)
    }

    async fn one(
        dispatcher: &Dispatcher<Db>,
        envelope: &Envelope,
    ) -> Result<Outcome<()>, Error<inbox_runtime::BoxError>> {
        let mut outcomes = dispatcher.dispatch(envelope).await.unwrap();
        assert_eq!(outcomes.len(), 1);
        outcomes.remove(0).result
    }

    #[tokio::test]
    async fn fails_twice_then_succeeds_with_three_attempts_recorded() {
        let (pool, _guard) = fixture().await;
        let dispatcher = Dispatcher::from_registry(pool.clone()).unwrap();
        fail_next(&id("twice"), 2, false);
        for attempt in 1..=2_u32 {
            inbox_tests::make_due(&pool).await;
            let error = one(&dispatcher, &envelope("twice", 5)).await.unwrap_err();
            let Error::Handler(failure) = error else {
                panic!("{error:?}")
            };
            assert_eq!(failure.attempts, attempt);
            assert_eq!(failure.class, ErrorClass::Retryable);
            assert!(
                matches!(failure.disposition, Disposition::Retry { .. }),
                "{failure:?}"
            );
            assert_eq!(failure.error.to_string(), "flaky dependency");
            let row = admin::show(&pool, "jobs", "twice").await.unwrap().unwrap();
            assert_eq!((row.status.as_str(), row.attempts), ("failed", attempt));
            assert!(row.payload.is_some());
            assert!(row.next_attempt_at.is_some());
            assert_eq!(
                row.last_error.as_deref(),
                Some("retryable error: flaky dependency")
            );
            // The failed attempt's effect was rolled back with it.
            assert_eq!(applied(&pool, "twice").await, 0);
        }
        inbox_tests::make_due(&pool).await;
        assert_eq!(
            one(&dispatcher, &envelope("twice", 5)).await.unwrap(),
            Outcome::Processed(())
        );
        let row = admin::show(&pool, "jobs", "twice").await.unwrap().unwrap();
        assert_eq!(
            (row.status.as_str(), row.attempts, row.payload),
            ("processed", 3, None)
        );
        assert_eq!(applied(&pool, "twice").await, 1);
        assert_eq!(calls(&id("twice")), 3);
        // Processed: never runs again.
        assert_eq!(
            one(&dispatcher, &envelope("twice", 5)).await.unwrap(),
            Outcome::Duplicate
        );
        assert_eq!(calls(&id("twice")), 3);
        // A different payload under the failed-then-processed key is a conflict, kept.
        assert_eq!(
            one(&dispatcher, &envelope("twice", 6))
                .await
                .unwrap_err()
                .kind(),
            "conflict"
        );
        let rejected: Vec<(String, Option<String>, Vec<u8>)> =
            sqlx::query_as(sql("SELECT reason, message_key, payload FROM inbox_rejections"))
                .fetch_all(&pool)
                .await
                .unwrap();
        assert_eq!(rejected.len(), 1);
        assert_eq!(
            (rejected[0].0.as_str(), rejected[0].1.as_deref()),
            ("conflict", Some("twice"))
        );
        let kept: Job = serde_json::from_slice(&rejected[0].2).unwrap();
        assert_eq!(kept.amount, 6);
    }

    #[tokio::test]
    async fn exhausted_attempts_go_dead_with_payload_then_replay_once() {
        let (pool, _guard) = fixture().await;
        let dispatcher = Dispatcher::from_registry(pool.clone())
            .unwrap()
            .with_retry_policy(RetryPolicy::default().max_attempts(3));
        fail_next(&id("poison"), 3, false);
        let mut dispositions = Vec::new();
        for _ in 0..3 {
            inbox_tests::make_due(&pool).await;
            let error = one(&dispatcher, &envelope("poison", 7)).await.unwrap_err();
            let Error::Handler(failure) = error else {
                panic!("{error:?}")
            };
            dispositions.push((failure.attempts, failure.disposition.is_settled()));
        }
        assert_eq!(dispositions, [(1, false), (2, false), (3, true)]);
        let dead = admin::list(&pool, Some("jobs"), &[inbox_runtime::Status::Dead], 10)
            .await
            .unwrap();
        assert_eq!(dead.len(), 1);
        assert_eq!(
            (dead[0].message_key.as_str(), dead[0].attempts),
            ("poison", 3)
        );
        let payload: Job =
            serde_json::from_slice(dead[0].payload.as_ref().unwrap()).unwrap();
        assert_eq!(payload.amount, 7);
        // A redelivery of a dead message runs nothing: it is settled.
        assert_eq!(
            one(&dispatcher, &envelope("poison", 7)).await.unwrap(),
            Outcome::Dead
        );
        assert_eq!(calls(&id("poison")), 3);
        // The fault is fixed; the operator replays it: applied exactly once.
        let replayed = dispatcher.replay("jobs", "poison").await.unwrap();
        assert_eq!(replayed.result.unwrap(), Outcome::Processed(()));
        assert_eq!(applied(&pool, "poison").await, 1);
        let again = dispatcher.replay("jobs", "poison").await.unwrap();
        assert_eq!(again.result.unwrap(), Outcome::Duplicate);
        assert_eq!(
            one(&dispatcher, &envelope("poison", 7)).await.unwrap(),
            Outcome::Duplicate
        );
        assert_eq!(applied(&pool, "poison").await, 1);
        assert_eq!(calls(&id("poison")), 4);
        let row = admin::show(&pool, "jobs", "poison").await.unwrap().unwrap();
        assert_eq!((row.status.as_str(), row.attempts), ("processed", 4));
    }

    #[tokio::test]
    async fn permanent_errors_go_dead_at_once_and_can_be_discarded() {
        let (pool, _guard) = fixture().await;
        let dispatcher = Dispatcher::from_registry(pool.clone()).unwrap();
        fail_next(&id("invalid"), 1, true);
        let error = one(&dispatcher, &envelope("invalid", 1)).await.unwrap_err();
        let Error::Handler(failure) = error else {
            panic!("{error:?}")
        };
        assert_eq!(
            (failure.class, failure.attempts, failure.disposition),
            (ErrorClass::Permanent, 1, Disposition::Dead)
        );
        assert!(admin::discard(&pool, "jobs", "invalid").await.unwrap());
        assert!(!admin::discard(&pool, "jobs", "invalid").await.unwrap());
        assert_eq!(
            one(&dispatcher, &envelope("invalid", 1)).await.unwrap(),
            Outcome::Discarded
        );
        let row = admin::show(&pool, "jobs", "invalid")
            .await
            .unwrap()
            .unwrap();
        assert_eq!((row.status.as_str(), row.payload), ("discarded", None));
        assert_eq!(applied(&pool, "invalid").await, 0);
        assert!(matches!(
            dispatcher.replay("jobs", "nope").await,
            Err(inbox_runtime::ReplayError::NotFound { .. })
        ));
    }

    #[tokio::test]
    async fn a_dead_message_replayed_twice_concurrently_applies_once() {
        let (pool, _guard) = fixture().await;
        let dispatcher =
            std::sync::Arc::new(Dispatcher::from_registry(pool.clone()).unwrap());
        fail_next(&id("twin"), 1, true);
        assert!(one(&dispatcher, &envelope("twin", 3)).await.is_err());
        let tasks: Vec<_> = (0..2)
            .map(|_| {
                let dispatcher = dispatcher.clone();
                tokio::spawn(async move {
                    dispatcher
                        .replay("jobs", "twin")
                        .await
                        .unwrap()
                        .result
                        .unwrap()
                })
            })
            .collect();
        let mut outcomes = Vec::new();
        for task in tasks {
            outcomes.push(task.await.unwrap().kind());
        }
        outcomes.sort();
        assert_eq!(outcomes, ["duplicate", "processed"]);
        assert_eq!(applied(&pool, "twin").await, 1);
    }

    #[tokio::test]
    async fn rejected_envelopes_are_kept() {
        let (pool, _guard) = fixture().await;
        let dispatcher = Dispatcher::from_registry(pool.clone()).unwrap();
        for (name, payload) in [
            ("test.job", &b"{not json"[..]),
            ("test.nope", &b"{}"[..]),
            ("test.job", &br#"{"id":"","amount":1}"#[..]),
        ] {
            let envelope = Envelope::new(name, payload.to_vec());
            let error = dispatcher.dispatch(&envelope).await.unwrap_err();
            dispatcher
                .record_rejection(&envelope, &error)
                .await
                .unwrap();
        }
        let rows: Vec<(String, String, Vec<u8>)> = sqlx::query_as(
            sql("SELECT reason, message_name, payload FROM inbox_rejections ORDER BY id"),
        )
        .fetch_all(&pool)
        .await
        .unwrap();
        let rows: Vec<(&str, &str, &[u8])> = rows
            .iter()
            .map(|(r, n, p)| (r.as_str(), n.as_str(), p.as_slice()))
            .collect();
        assert_eq!(
            rows,
            [
                ("malformed", "test.job", &b"{not json"[..]),
                ("unknown_message", "test.nope", &b"{}"[..]),
                ("invalid_key", "test.job", &br#"{"id":"","amount":1}"#[..]),
            ]
        );
        let stats = admin::stats(&pool).await.unwrap();
        let stats: Vec<(Option<&str>, &str, i64)> = stats
            .iter()
            .map(|s| (s.consumer.as_deref(), s.status.as_str(), s.count))
            .collect();
        assert!(
            stats.contains(&(None, "rejected:malformed", 1)),
            "{stats:?}"
        );
        assert!(
            stats.contains(&(Some("jobs"), "rejected:invalid_key", 1)),
            "{stats:?}"
        );
    }

    #[tokio::test]
    async fn retention_purges_old_processed_rows_only() {
        let (pool, _guard) = fixture().await;
        let dispatcher = Dispatcher::from_registry(pool.clone()).unwrap();
        for job in ["old-1", "old-2", "old-3", "new-1"] {
            assert!(
                one(&dispatcher, &envelope(job, 1))
                    .await
                    .unwrap()
                    .is_processed()
            );
        }
        fail_next(&id("old-failed"), 1, false);
        fail_next(&id("old-dead"), 1, true);
        assert!(one(&dispatcher, &envelope("old-failed", 1)).await.is_err());
        assert!(one(&dispatcher, &envelope("old-dead", 1)).await.is_err());
        let age = match BACKEND {
            Backend::Postgres => AGE_POSTGRES,
            Backend::MySql => AGE_MYSQL,
            _ => AGE_SQLITE,
        };
        sqlx::query(age).execute(&pool).await.unwrap();

        let too_short =
            Retention::new(Duration::from_secs(3600), Duration::from_secs(7200));
        assert!(
            matches!(
                too_short,
                Err(admin::RetentionError::WindowBelowHorizon { horizon, .. })
                    if horizon == Duration::from_secs(7200)
            ),
            "{too_short:?}"
        );

        let retention =
            Retention::new(Duration::from_secs(86_400), Duration::from_secs(43_200))
                .unwrap()
                .batch_size(2);
        let mut seen = Vec::new();
        let report = admin::purge(&pool, &retention, |n| seen.push(n))
            .await
            .unwrap();
        assert_eq!((report.deleted, report.batches), (3, 2));
        assert_eq!(seen, [2, 3]);
        let mut keys: Vec<String> =
            sqlx::query_scalar(sql("SELECT message_key FROM inbox_messages"))
                .fetch_all(&pool)
                .await
                .unwrap();
        keys.sort();
        assert_eq!(keys, ["new-1", "old-dead", "old-failed"]);
        // A purged key is outside the window: its redelivery is processed again.
        assert!(
            one(&dispatcher, &envelope("old-1", 1))
                .await
                .unwrap()
                .is_processed()
        );

        let everything = retention.include_failed_and_dead(true);
        let report = admin::purge(&pool, &everything, |_| {}).await.unwrap();
        assert_eq!(report.deleted, 2);
    }

    #[tokio::test]
    async fn retention_purges_old_rejections_only_when_asked() {
        let (pool, _guard) = fixture().await;
        let dispatcher = Dispatcher::from_registry(pool.clone()).unwrap();
        for name in ["old.a", "old.b", "old.c", "new.a"] {
            let unknown = Envelope::new(name, b"{}".to_vec());
            let error = dispatcher.dispatch(&unknown).await.unwrap_err();
            dispatcher.record_rejection(&unknown, &error).await.unwrap();
        }
        let age = match BACKEND {
            Backend::Postgres => AGE_REJECTIONS_POSTGRES,
            Backend::MySql => AGE_REJECTIONS_MYSQL,
            _ => AGE_REJECTIONS_SQLITE,
        };
        sqlx::query(age).execute(&pool).await.unwrap();
        let names = |pool| async move {
            let mut names: Vec<String> =
                sqlx::query_scalar(sql("SELECT message_name FROM inbox_rejections"))
                    .fetch_all(pool)
                    .await
                    .unwrap();
            names.sort();
            names
        };

        let retention =
            Retention::new(Duration::from_secs(86_400), Duration::from_secs(43_200))
                .unwrap()
                .batch_size(2);
        let report = admin::purge(&pool, &retention, |_| {}).await.unwrap();
        assert_eq!((report.deleted, report.rejections_deleted), (0, 0));
        assert_eq!(names(&pool).await, ["new.a", "old.a", "old.b", "old.c"]);

        let mut seen = Vec::new();
        let with_rejections = retention.include_rejections(true);
        let report = admin::purge(&pool, &with_rejections, |n| seen.push(n))
            .await
            .unwrap();
        // One (empty) batch of messages, then rejections 2 + 1.
        assert_eq!(
            (report.deleted, report.rejections_deleted, report.batches),
            (0, 3, 3)
        );
        assert_eq!(seen, [0, 2, 3]);
        assert_eq!(names(&pool).await, ["new.a"]);
    }
}
