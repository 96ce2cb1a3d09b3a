//! Bad input and retry timing on both backends: the payload size limit (one byte over is
//! refused and kept cut, at the limit is processed), payloads that are not UTF-8 or not JSON as
//! a whole, and a failed key redelivered before its next attempt is due.

#![allow(missing_docs)]

use inbox_runtime::{Envelope, Message};
use serde::{Deserialize, Serialize};

/// A message with a free-form body, to size payloads exactly.
#[derive(Debug, Clone, Serialize, Deserialize, Message)]
#[message(name = "hard.blob")]
pub struct Blob {
    #[message(key)]
    pub id: String,
    pub data: String,
}

/// A payload of exactly `size` bytes: `{"id":"<id>","data":"xxx…"}`.
pub fn blob_of_size(id: &str, size: usize) -> Envelope {
    let head = format!(r#"{{"id":"{id}","data":""#);
    let tail = br#""}"#;
    let mut payload = Vec::with_capacity(size);
    payload.extend_from_slice(head.as_bytes());
    payload.resize(size - tail.len(), b'x');
    payload.extend_from_slice(tail);
    assert_eq!(payload.len(), size);
    Envelope::new(Blob::NAME, payload)
}

/// A job that fails while `FAIL` is set (per backend module).
#[derive(Debug, Clone, Serialize, Deserialize, Message)]
#[message(name = "hard.job")]
pub struct Job {
    #[message(key)]
    pub id: String,
}

pub fn job(id: &str) -> Envelope {
    inbox_tests::envelope(&Job { id: id.into() })
}

/// A task that takes `slow_ms` and fails when asked to.
#[derive(Debug, Clone, Serialize, Deserialize, Message)]
#[message(name = "hard.task")]
pub struct Task {
    #[message(key)]
    pub id: String,
    pub slow_ms: u64,
    pub fail: bool,
}

pub fn task(id: &str, slow_ms: u64, fail: bool) -> Envelope {
    inbox_tests::envelope(&Task {
        id: id.into(),
        slow_ms,
        fail,
    })
}

inbox_tests::backend_matrix! {
    use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering::SeqCst};
    use std::time::Duration;

    use inbox_runtime::{
        DispatchError, Dispatcher, Disposition, Error, Outcome, RetryPolicy, Status, handler,
        ops::admin, worker::settlement_for,
    };
    use inbox_runtime::source::Settlement;

    const LIMIT: usize = 4096;

    #[inbox_runtime::idempotent(consumer = "blobs")]
    async fn keep_blob(conn: &mut Conn, msg: Blob) -> Result<(), sqlx::Error> {
        sqlx::query(APPLY_EFFECT)
            .bind(format!("blob:{}", msg.id))
            .bind(i64::try_from(msg.data.len()).unwrap())
            .execute(conn)
            .await?;
        Ok(())
    }

    static FAIL: AtomicBool = AtomicBool::new(true);
    static CALLS: AtomicUsize = AtomicUsize::new(0);

    #[inbox_runtime::idempotent(consumer = "jobs")]
    async fn run_job(conn: &mut Conn, msg: Job) -> Result<(), String> {
        CALLS.fetch_add(1, SeqCst);
        if FAIL.load(SeqCst) {
            return Err(format!("job {} is not ready", msg.id));
        }
        sqlx::query(APPLY_EFFECT)
            .bind(format!("job:{}", msg.id))
            .bind(1_i64)
            .execute(conn)
            .await
            .map_err(|e| e.to_string())?;
        Ok(())
    }

    static CHORE_FAILS: AtomicBool = AtomicBool::new(true);
    static CHORE_CALLS: AtomicUsize = AtomicUsize::new(0);

    /// [`run_job`]'s twin with its own switches, for the Worker test (tests run in parallel).
    #[inbox_runtime::idempotent(consumer = "chores")]
    async fn run_chore(conn: &mut Conn, msg: Job) -> Result<(), String> {
        CHORE_CALLS.fetch_add(1, SeqCst);
        if CHORE_FAILS.load(SeqCst) {
            return Err(format!("chore {} is not ready", msg.id));
        }
        sqlx::query(APPLY_EFFECT)
            .bind(format!("chore:{}", msg.id))
            .bind(1_i64)
            .execute(conn)
            .await
            .map_err(|e| e.to_string())?;
        Ok(())
    }

    static TASK_CALLS: AtomicUsize = AtomicUsize::new(0);

    #[inbox_runtime::idempotent(consumer = "tasks")]
    async fn run_task(conn: &mut Conn, msg: Task) -> Result<(), String> {
        TASK_CALLS.fetch_add(1, SeqCst);
        let _ = &conn;
        tokio::time::sleep(Duration::from_millis(msg.slow_ms)).await;
        if msg.fail {
            return Err(format!("task {} is not ready", msg.id));
        }
        Ok(())
    }

    /// A failure recorded inside a batch is due its delay after the failure, not after the
    /// batch transaction began (found by review: PostgreSQL's `now()` is the transaction's
    /// start, and this batch runs longer than the delay).
    #[tokio::test]
    async fn a_failure_in_a_slow_batch_waits_its_whole_delay() {
        let (pool, _guard) = fixture().await;
        let dispatcher = Dispatcher::from_handlers(pool.clone(), [handler!(run_task)])
            .unwrap()
            .with_retry_policy(
                RetryPolicy::default()
                    .retry_delays(Duration::from_millis(1000), Duration::from_millis(1000)),
            );
        // "a" is slow and succeeds; "b", after it in the batch, fails at once.
        let out = dispatcher
            .dispatch_batch(&[task("a", 1300, false), task("b", 0, true)])
            .await;
        let Err(Error::Handler(failure)) = &out[1].as_ref().unwrap()[0].result else {
            panic!("{out:?}")
        };
        assert!(matches!(failure.disposition, Disposition::Retry { .. }), "{failure:?}");
        let calls = TASK_CALLS.load(SeqCst);
        let again = dispatcher.dispatch(&task("b", 0, true)).await.unwrap();
        assert!(
            matches!(again[0].result, Ok(Outcome::NotYet { retry_in }) if retry_in > Duration::from_millis(500)),
            "ran early: {:?}",
            again[0].result
        );
        assert_eq!(TASK_CALLS.load(SeqCst), calls);
        let row = admin::show(&pool, "tasks", "b").await.unwrap().unwrap();
        assert_eq!((row.status, row.attempts), (Status::Failed, 1));
    }

    /// `(reason, kept bytes, real size)` of the rejections of a message name.
    async fn rejections(pool: &Pool, name: &str) -> Vec<(String, i64, Option<i64>)> {
        sqlx::query_as(
            sql("SELECT reason, CAST(length(payload) AS BIGINT), payload_size FROM inbox_rejections \
             WHERE message_name = $1 ORDER BY id"),
        )
        .bind(name.to_owned())
        .fetch_all(pool)
        .await
        .unwrap()
    }

    #[tokio::test]
    async fn a_payload_over_the_limit_is_refused_and_kept_cut_to_it() {
        let (pool, _guard) = fixture().await;
        let dispatcher = Dispatcher::from_handlers(pool.clone(), [handler!(keep_blob)])
            .unwrap()
            .with_max_payload_bytes(LIMIT)
            .unwrap();
        assert_eq!(dispatcher.max_payload_bytes(), LIMIT);

        // At the limit: processed.
        let at_limit = blob_of_size("at", LIMIT);
        let outcomes = dispatcher.dispatch(&at_limit).await.unwrap();
        assert_eq!(outcomes[0].result.as_ref().unwrap(), &Outcome::Processed(()));
        assert_eq!(inbox_tests::effect(&pool, "blob:at").await, Some((1, 4075)));

        // One byte over: refused before decoding, with the sizes, and kept cut to the limit.
        let over = blob_of_size("over", LIMIT + 1);
        let error = dispatcher.dispatch(&over).await.unwrap_err();
        assert!(
            matches!(&error, DispatchError::TooLarge { size: 4097, limit: 4096, message_name } if message_name == "hard.blob"),
            "{error:?}"
        );
        assert_eq!(
            error.to_string(),
            "payload of message `hard.blob` is 4097 bytes, over the limit of 4096 bytes"
        );
        dispatcher.record_rejection(&over, &error).await.unwrap();
        assert_eq!(
            rejections(&pool, "hard.blob").await,
            [("too_large".to_owned(), 4096, Some(4097))]
        );
        assert_eq!(inbox_tests::effect(&pool, "blob:over").await, None);
        let stats = admin::stats(&pool).await.unwrap();
        assert!(
            stats.iter().any(|s| s.status.as_str() == "rejected:too_large" && s.count == 1),
            "{stats:?}"
        );

        // The default limit is 1 MiB.
        let default = Dispatcher::from_handlers(pool.clone(), [handler!(keep_blob)]).unwrap();
        assert_eq!(default.max_payload_bytes(), 1024 * 1024);
        let big = blob_of_size("big", 1024 * 1024 + 1);
        assert!(matches!(
            default.dispatch(&big).await.unwrap_err(),
            DispatchError::TooLarge { size: 1_048_577, limit: 1_048_576, .. }
        ));
    }

    #[tokio::test]
    async fn a_payload_that_is_not_utf8_or_not_json_as_a_whole_is_malformed_and_kept() {
        // A real recorder, local to this (current-thread) test: `inbox_rejections_total`.
        let recorder = metrics_util::debugging::DebuggingRecorder::new();
        let snapshotter = recorder.snapshotter();
        let _local = metrics::set_default_local_recorder(&recorder);
        let (pool, _guard) = fixture().await;
        let dispatcher = Dispatcher::from_handlers(pool.clone(), [handler!(keep_blob)]).unwrap();

        // Invalid UTF-8 in a member the message type does not declare.
        let mut bytes = br#"{"id":"u1","data":"ok","extra":""#.to_vec();
        bytes.extend_from_slice(&[0xff, 0xfe]);
        bytes.extend_from_slice(br#""}"#);
        let not_utf8 = Envelope::new(Blob::NAME, bytes.clone());
        let error = dispatcher.dispatch(&not_utf8).await.unwrap_err();
        assert!(
            matches!(error, DispatchError::NotUtf8 { line: 1, column: 33, .. }),
            "{error:?}"
        );
        assert_eq!(
            error.to_string(),
            "malformed payload for message `hard.blob` at line 1, column 33: invalid UTF-8"
        );
        dispatcher.record_rejection(&not_utf8, &error).await.unwrap();

        // Trailing characters after the JSON value.
        let trailing = Envelope::new(Blob::NAME, br#"{"id":"t1","data":"ok"} garbage"#.to_vec());
        let error = dispatcher.dispatch(&trailing).await.unwrap_err();
        assert!(matches!(error, DispatchError::Decode { line: 1, column: 25, .. }), "{error:?}");
        assert_eq!(
            error.to_string(),
            "malformed payload for message `hard.blob` at line 1, column 25: trailing characters"
        );
        dispatcher.record_rejection(&trailing, &error).await.unwrap();

        // Both kept whole, as malformed; nothing applied.
        assert_eq!(
            rejections(&pool, "hard.blob").await,
            [("malformed".to_owned(), 36, None), ("malformed".to_owned(), 31, None)]
        );
        let kept: Vec<Vec<u8>> =
            sqlx::query_scalar(sql("SELECT payload FROM inbox_rejections ORDER BY id"))
                .fetch_all(&pool)
                .await
                .unwrap();
        assert_eq!(kept[0], bytes);
        assert_eq!(inbox_tests::effect(&pool, "blob:u1").await, None);
        assert_eq!(inbox_tests::effect(&pool, "blob:t1").await, None);
        let counted: Vec<(String, Vec<String>, u64)> = snapshotter
            .snapshot()
            .into_vec()
            .into_iter()
            .filter_map(|(key, _, _, value)| match value {
                metrics_util::debugging::DebugValue::Counter(n) => Some((
                    key.key().name().to_owned(),
                    key.key().labels().map(|l| format!("{}={}", l.key(), l.value())).collect(),
                    n,
                )),
                _ => None,
            })
            .filter(|(name, _, _)| name == "inbox_rejections_total")
            .collect();
        assert_eq!(
            counted,
            [("inbox_rejections_total".to_owned(), vec!["reason=malformed".to_owned()], 2)]
        );
    }

    #[tokio::test]
    async fn a_failed_key_redelivered_before_its_time_is_not_run() {
        let (pool, _guard) = fixture().await;
        let dispatcher = Dispatcher::from_handlers(pool.clone(), [handler!(run_job)])
            .unwrap()
            .with_retry_policy(
                RetryPolicy::default()
                    .retry_delays(Duration::from_millis(400), Duration::from_millis(400)),
            );
        FAIL.store(true, SeqCst);
        let first = dispatcher.dispatch(&job("j1")).await.unwrap();
        let Err(Error::Handler(failure)) = &first[0].result else {
            panic!("{first:?}")
        };
        let Disposition::Retry { after } = failure.disposition else {
            panic!("{failure:?}")
        };
        assert_eq!(CALLS.load(SeqCst), 1);

        // Redelivered at once (a broker that requeues immediately, a second consumer): not
        // run, not counted, and told how long to wait.
        FAIL.store(false, SeqCst);
        let early = dispatcher.dispatch(&job("j1")).await.unwrap();
        let Ok(Outcome::NotYet { retry_in }) = early[0].result else {
            panic!("{early:?}")
        };
        assert!(retry_in > Duration::ZERO && retry_in <= after, "{retry_in:?} vs {after:?}");
        assert_eq!(
            settlement_for(&Ok(early), Duration::from_secs(5)),
            Settlement::Requeue { delay: Some(retry_in) }
        );
        // The batch path says the same.
        let batched = dispatcher.dispatch_batch(&[job("j1")]).await;
        assert!(
            matches!(batched[0].as_ref().unwrap()[0].result, Ok(Outcome::NotYet { .. })),
            "{batched:?}"
        );
        assert_eq!(CALLS.load(SeqCst), 1);
        let row = admin::show(&pool, "jobs", "j1").await.unwrap().unwrap();
        assert_eq!((row.status, row.attempts), (Status::Failed, 1));

        // Once due, it runs once.
        tokio::time::sleep(retry_in + Duration::from_millis(50)).await;
        let due = dispatcher.dispatch(&job("j1")).await.unwrap();
        assert_eq!(due[0].result.as_ref().unwrap(), &Outcome::Processed(()));
        assert_eq!(CALLS.load(SeqCst), 2);
        let row = admin::show(&pool, "jobs", "j1").await.unwrap().unwrap();
        assert_eq!((row.status, row.attempts), (Status::Processed, 2));
        assert_eq!(inbox_tests::effect(&pool, "job:j1").await, Some((1, 1)));

        // An operator's replay does not wait for the next attempt.
        FAIL.store(true, SeqCst);
        assert!(dispatcher.dispatch(&job("j2")).await.unwrap()[0].result.is_err());
        FAIL.store(false, SeqCst);
        let replayed = dispatcher.replay("jobs", "j2").await.unwrap();
        assert_eq!(replayed.result.unwrap(), Outcome::Processed(()));
        assert_eq!(CALLS.load(SeqCst), 4);
    }

    /// Through the Worker: a failed key redelivered early is counted `not_yet` and requeued
    /// with the time left (then runs once due), and a discarded key is counted `discarded`,
    /// not `dead`.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn the_worker_reports_not_yet_and_discarded_keys_as_such() {
        use inbox_runtime::source::memory::MemorySource;
        use inbox_runtime::{CancellationToken, Worker};

        let (pool, _guard) = fixture().await;
        let dispatcher = Dispatcher::from_handlers(pool.clone(), [handler!(run_chore)])
            .unwrap()
            .with_retry_policy(
                RetryPolicy::default()
                    .retry_delays(Duration::from_secs(2), Duration::from_secs(2)),
            );
        CHORE_FAILS.store(true, SeqCst);
        for id in ["w-early", "w-discarded"] {
            assert!(dispatcher.dispatch(&job(id)).await.unwrap()[0].result.is_err());
        }
        assert!(admin::discard(&pool, "chores", "w-discarded").await.unwrap());
        CHORE_FAILS.store(false, SeqCst);
        let calls = CHORE_CALLS.load(SeqCst);

        let source = MemorySource::new("mem");
        let handle = source.handle();
        handle.push(job("w-early"));
        handle.push(job("w-discarded"));
        handle.close();
        let report = Worker::new(dispatcher)
            .concurrency(1)
            .run(source, CancellationToken::new())
            .await
            .unwrap();
        assert_eq!(
            (report.not_yet, report.processed, report.discarded, report.dead),
            (1, 1, 1, 0),
            "{report:?}"
        );
        assert_eq!((report.deliveries, report.acked, report.requeued), (3, 2, 1), "{report:?}");
        assert_eq!(CHORE_CALLS.load(SeqCst), calls + 1, "the early key ran once, when due");
        assert_eq!(inbox_tests::effect(&pool, "chore:w-early").await, Some((1, 1)));
        let row = admin::show(&pool, "chores", "w-discarded").await.unwrap().unwrap();
        assert_eq!(row.status, Status::Discarded);
    }

    /// A stored payload that is no longer UTF-8 (damaged in the database) is refused by the
    /// replay with a clear error; the handler does not run and the row is kept as it was.
    #[tokio::test]
    async fn a_replay_of_a_damaged_stored_payload_is_a_decode_error() {
        let (pool, _guard) = fixture().await;
        let dispatcher = Dispatcher::from_handlers(pool.clone(), [handler!(run_job)]).unwrap();
        FAIL.store(true, SeqCst);
        assert!(dispatcher.dispatch(&job("j3")).await.unwrap()[0].result.is_err());
        let calls = CALLS.load(SeqCst);
        sqlx::query(sql("UPDATE inbox_messages SET payload = $1 WHERE message_key = 'j3'"))
            .bind(vec![b'{', 0xff, b'}'])
            .execute(&pool)
            .await
            .unwrap();
        let error = dispatcher.replay("jobs", "j3").await.unwrap_err();
        assert_eq!(
            error.to_string(),
            "stored payload of `hard.job` does not decode: invalid UTF-8 at byte 1"
        );
        assert_eq!(CALLS.load(SeqCst), calls);
        let row = admin::show(&pool, "jobs", "j3").await.unwrap().unwrap();
        assert_eq!((row.status, row.attempts), (Status::Failed, 1));
    }
}
