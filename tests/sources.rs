//! Sources and the worker, without a broker: the file source's resume from its acked prefix, and
//! the worker's settlement policy, per-key order and shutdown on the in-memory source
//! (PostgreSQL).

#![allow(missing_docs)]

use std::collections::{BTreeMap, HashMap, HashSet};
use std::io::Write as _;
use std::sync::Mutex;
use std::time::Duration;

use inbox_runtime::source::file::{FilePosition, FileSource, read_offset_file};
use inbox_runtime::source::memory::MemorySource;
use inbox_runtime::source::{Settlement, Source};
use inbox_runtime::{Dispatcher, Envelope, Message, StopReason, Worker, worker::settlement_for};
use inbox_tests::{APPLY_EFFECT, effects};
use serde::{Deserialize, Serialize};
use sqlx::{PgConnection, PgPool};
use tokio_util::sync::CancellationToken;

/// A payment: one effect per event id, `delay_ms` of sleep in the database first.
#[derive(Debug, Clone, Serialize, Deserialize, Message)]
#[message(name = "src.payment")]
pub struct Payment {
    #[message(key)]
    pub event_id: String,
    pub amount_cents: i64,
    #[serde(default)]
    pub delay_ms: u64,
}

/// Ids whose first attempt fails (a transient handler error).
static FAIL_ONCE: Mutex<Vec<String>> = Mutex::new(Vec::new());

#[derive(Debug, thiserror::Error)]
#[error("transient failure of {0}")]
pub struct Transient(String);

impl From<sqlx::Error> for Transient {
    fn from(error: sqlx::Error) -> Self {
        Transient(error.to_string())
    }
}

/// Applies the effect `event_id` (with a sequence number, for order checks).
#[inbox_runtime::idempotent(consumer = "sources")]
pub async fn pay(conn: &mut PgConnection, msg: Payment) -> Result<(), Transient> {
    {
        let mut fail = FAIL_ONCE.lock().unwrap();
        if let Some(index) = fail.iter().position(|id| *id == msg.event_id) {
            fail.remove(index);
            return Err(Transient(msg.event_id));
        }
    }
    if msg.delay_ms > 0 {
        sqlx::query("SELECT pg_sleep($1)")
            .bind(msg.delay_ms as f64 / 1000.0)
            .execute(&mut *conn)
            .await?;
    }
    sqlx::query(APPLY_EFFECT)
        .bind(&msg.event_id)
        .bind(msg.amount_cents)
        .execute(&mut *conn)
        .await?;
    sqlx::query("INSERT INTO applied_order (event_id) VALUES ($1)")
        .bind(&msg.event_id)
        .execute(&mut *conn)
        .await?;
    Ok(())
}

fn payment(id: &str, amount: i64, delay_ms: u64) -> Envelope {
    Envelope::new(
        "src.payment",
        serde_json::to_vec(&serde_json::json!({
            "event_id": id, "amount_cents": amount, "delay_ms": delay_ms
        }))
        .unwrap(),
    )
}

async fn pool() -> PgPool {
    let pool = inbox_tests::pg_pool(8).await;
    sqlx::query("CREATE TABLE applied_order (seq BIGSERIAL PRIMARY KEY, event_id TEXT NOT NULL)")
        .execute(&pool)
        .await
        .unwrap();
    pool
}

fn write_lines(lines: &[&str]) -> (tempfile::TempDir, std::path::PathBuf) {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("events.jsonl");
    let mut file = std::fs::File::create(&path).unwrap();
    for line in lines {
        writeln!(file, "{line}").unwrap();
    }
    (dir, path)
}

/// Line numbers of the next `n` deliveries.
async fn take(source: &mut FileSource, n: usize) -> Vec<(i64, inbox_runtime::source::Delivery)> {
    let mut out = Vec::new();
    for _ in 0..n {
        let delivery = tokio::time::timeout(Duration::from_secs(5), source.next())
            .await
            .expect("a delivery within 5 s")
            .unwrap()
            .expect("not the end");
        let line = delivery.envelope().source.as_ref().unwrap().offset.unwrap();
        out.push((line, delivery));
    }
    out
}

#[tokio::test]
async fn file_source_resumes_after_the_contiguous_acked_prefix() {
    let (_dir, path) = write_lines(&[
        r#"{"message":"a","payload":{"n":1}}"#,
        r#"{"message":"a","payload":{"n":2},"headers":{"trace":"t-2"}}"#,
        "",
        r#"{"message":"a","payload":{"n":4}}"#,
        "not json",
        r#"{"message":"a","payload":{"n":6}}"#,
    ]);
    let offset = path.with_extension("jsonl.offset");

    // Run 1: ack 1 and 2, requeue 4 (comes back in the same run), reject 5, leave 6 unsettled.
    let mut source = FileSource::open(&path).await.unwrap();
    assert_eq!(source.offset_path(), offset);
    assert_eq!(source.start_position(), FilePosition::default());
    let mut got = take(&mut source, 5).await;
    let lines: Vec<i64> = got.iter().map(|(line, _)| *line).collect();
    assert_eq!(lines, [1, 2, 4, 5, 6], "the blank line 3 is skipped");
    let (_, d6) = got.pop().unwrap();
    let (_, d5) = got.pop().unwrap();
    let (_, d4) = got.pop().unwrap();
    let (_, d2) = got.pop().unwrap();
    let (_, d1) = got.pop().unwrap();
    assert_eq!(d1.envelope().message_name, "a");
    assert_eq!(d1.envelope().payload, br#"{"n":1}"#);
    assert_eq!(d2.envelope().headers["trace"], "t-2");
    assert_eq!(
        d5.envelope().message_name,
        "",
        "a malformed line has no name"
    );
    assert_eq!(d5.envelope().payload, b"not json");

    d2.ack().await.unwrap();
    assert_eq!(
        source.position(),
        FilePosition::default(),
        "line 1 is still open"
    );
    d1.ack().await.unwrap();
    let after_3 = FilePosition {
        line: 3,
        byte: std::fs::read_to_string(&path)
            .unwrap()
            .split_inclusive('\n')
            .take(3)
            .map(|l| l.len() as u64)
            .sum(),
    };
    assert_eq!(
        source.position(),
        after_3,
        "1, 2 and the blank 3 are settled"
    );
    d4.requeue(None).await.unwrap();
    let (line, again) = take(&mut source, 1).await.pop().unwrap();
    assert_eq!(line, 4);
    let meta = again.envelope().source.clone().unwrap();
    assert!(meta.redelivered);
    assert_eq!(meta.delivery_count, Some(2));
    d5.reject().await.unwrap();
    assert_eq!(source.position(), after_3, "4 is open again");
    drop(again); // abandoned: redelivered in this run, not settled
    let (line, again) = take(&mut source, 1).await.pop().unwrap();
    assert_eq!(line, 4);
    again.ack().await.unwrap();
    assert_eq!(
        source.position().line,
        5,
        "4 and the rejected 5 are settled; 6 is open"
    );
    drop(d6);
    source.close().await.unwrap();
    assert_eq!(read_offset_file(&offset).unwrap(), Some(source.position()));
    drop(source);

    // Run 2: starts at line 6.
    let mut source = FileSource::open(&path).await.unwrap();
    assert_eq!(source.start_position().line, 5);
    let (line, d6) = take(&mut source, 1).await.pop().unwrap();
    assert_eq!(line, 6);
    assert_eq!(d6.envelope().payload, br#"{"n":6}"#);
    d6.ack().await.unwrap();
    let end = tokio::time::timeout(Duration::from_secs(5), source.next())
        .await
        .unwrap()
        .unwrap();
    assert!(end.is_none(), "end of file, everything settled");
    source.close().await.unwrap();
    let len = std::fs::metadata(&path).unwrap().len();
    assert_eq!(
        read_offset_file(&offset).unwrap(),
        Some(FilePosition { line: 6, byte: len })
    );

    // Run 3: nothing left.
    let mut source = FileSource::open(&path).await.unwrap();
    assert!(source.next().await.unwrap().is_none());

    // A file shorter than its offset is refused.
    std::fs::write(&path, "{}\n").unwrap();
    let error = FileSource::open(&path).await.unwrap_err();
    assert_eq!(error.operation, "open");
    assert!(
        error.to_string().contains("replaced or truncated"),
        "{error}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn worker_settles_by_the_policy_on_the_memory_source() {
    let pool = pool().await;
    let dispatcher = Dispatcher::from_registry(pool.clone()).unwrap();
    FAIL_ONCE.lock().unwrap().push("p-flaky".into());

    let source = MemorySource::new("mem");
    let handle = source.handle();
    let ok = handle.push(payment("p-1", 100, 0));
    let dup = handle.push(payment("p-1", 100, 0));
    let conflict = handle.push(payment("p-1", 999, 0));
    let unknown = handle.push(Envelope::new("src.nope", b"{}".to_vec()));
    let malformed = handle.push(Envelope::new("src.payment", b"{\"event_id\":".to_vec()));
    let no_key = handle.push(Envelope::new(
        "src.payment",
        br#"{"event_id":"","amount_cents":1}"#.to_vec(),
    ));
    let flaky = handle.push(payment("p-flaky", 7, 0));
    handle.close();

    let worker = Worker::new(dispatcher)
        .concurrency(1) // one at a time: p-1's duplicate and conflict come after it
        .requeue_delay(Duration::from_millis(50));
    let report = worker.run(source, CancellationToken::new()).await.unwrap();

    let mut by_id: HashMap<u64, Vec<Settlement>> = HashMap::new();
    for (id, settlement) in handle.settlements() {
        by_id.entry(id).or_default().push(settlement);
    }
    assert_eq!(by_id[&ok], [Settlement::Ack]);
    assert_eq!(by_id[&dup], [Settlement::Ack]);
    assert_eq!(by_id[&conflict], [Settlement::Reject]);
    // Refused deliveries are kept in inbox_rejections (payload included), then acked.
    assert_eq!(by_id[&unknown], [Settlement::Ack]);
    assert_eq!(by_id[&malformed], [Settlement::Ack]);
    assert_eq!(by_id[&no_key], [Settlement::Ack]);
    let kept: Vec<(String, Vec<u8>)> = sqlx::query_as(
        "SELECT reason, payload FROM inbox_rejections WHERE reason <> 'conflict' ORDER BY id",
    )
    .fetch_all(&pool)
    .await
    .unwrap();
    assert_eq!(
        kept,
        [
            ("unknown_message".to_owned(), b"{}".to_vec()),
            ("malformed".to_owned(), b"{\"event_id\":".to_vec()),
            (
                "invalid_key".to_owned(),
                br#"{"event_id":"","amount_cents":1}"#.to_vec()
            ),
        ]
    );
    // Requeued after the delay the inbox's retry policy chose (or the worker's 50 ms), then acked.
    assert!(
        matches!(
            by_id[&flaky][..],
            [Settlement::Requeue { delay: Some(d) }, Settlement::Ack] if d >= Duration::from_millis(50)
        ),
        "{:?}",
        by_id[&flaky]
    );
    assert_eq!(handle.abandoned(), Vec::<u64>::new());
    assert_eq!(handle.deliveries(), 8);

    assert_eq!(report.stop, StopReason::SourceExhausted);
    assert_eq!(report.deliveries, 8);
    assert_eq!(
        (
            report.processed,
            report.duplicates,
            report.conflicts,
            report.invalid,
            report.failed
        ),
        (2, 1, 1, 3, 1)
    );
    assert_eq!((report.acked, report.rejected, report.requeued), (6, 1, 1));
    assert_eq!(report.abandoned, 0);
    assert_eq!(report.settle_errors, 0);

    let effects = effects(&pool).await;
    assert_eq!(
        effects,
        BTreeMap::from([("p-1".into(), (1, 100)), ("p-flaky".into(), (1, 7))])
    );

    // The policy function itself, on a dispatch error.
    let refused = worker
        .dispatcher()
        .dispatch(&Envelope::new("src.nope", b"{}".to_vec()))
        .await;
    assert_eq!(
        settlement_for(&refused, Duration::from_secs(1)),
        Settlement::Reject
    );
    assert_eq!(
        settlement_for(&Ok(Vec::new()), Duration::from_secs(1)),
        Settlement::Ack
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn worker_keeps_per_key_order_with_concurrency() {
    let pool = pool().await;
    let dispatcher = Dispatcher::from_registry(pool.clone()).unwrap();
    let source = MemorySource::new("mem");
    let handle = source.handle();
    // Four keys, ten messages each, interleaved; earlier messages sleep longer, so that without
    // the per-key queue later ones would overtake them.
    let mut expected: BTreeMap<String, Vec<String>> = BTreeMap::new();
    for i in 0..10_u64 {
        for key in ["k0", "k1", "k2", "k3"] {
            let id = format!("{key}-{i:02}");
            handle.push_keyed(payment(&id, 1, (10 - i) * 3), key);
            expected.entry(key.into()).or_default().push(id);
        }
    }
    // Unkeyed ones run alongside.
    for i in 0..8 {
        handle.push(payment(&format!("free-{i}"), 1, 5));
    }
    handle.close();
    let report = Worker::new(dispatcher)
        .concurrency(8)
        .run(source, CancellationToken::new())
        .await
        .unwrap();
    assert_eq!((report.processed, report.acked), (48, 48));

    let order: Vec<String> = sqlx::query_scalar("SELECT event_id FROM applied_order ORDER BY seq")
        .fetch_all(&pool)
        .await
        .unwrap();
    let mut found: BTreeMap<String, Vec<String>> = BTreeMap::new();
    for id in &order {
        let key = id.split('-').next().unwrap();
        if key.starts_with('k') {
            found.entry(key.into()).or_default().push(id.clone());
        }
    }
    assert_eq!(found, expected);
    // And the keys did run concurrently: the first message of each key committed before the
    // last message of any other.
    let position = |id: &str| order.iter().position(|x| x == id).unwrap();
    assert!(position("k3-00") < position("k0-09"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn worker_shutdown_acks_only_what_committed() {
    let pool = pool().await;
    let dispatcher = Dispatcher::from_registry(pool.clone()).unwrap();
    let source = MemorySource::new("mem");
    let handle = source.handle();
    for i in 0..200 {
        handle.push(payment(&format!("s-{i:03}"), 1, 20));
    }
    handle.close();
    let token = CancellationToken::new();
    let cancel = token.clone();
    let stopper = tokio::spawn(async move {
        tokio::time::sleep(Duration::from_millis(300)).await;
        cancel.cancel();
    });
    let report = Worker::new(dispatcher)
        .concurrency(6)
        .run(source, token)
        .await
        .unwrap();
    stopper.await.unwrap();
    assert_eq!(report.stop, StopReason::Shutdown);
    assert!(report.acked > 0 && report.acked < 200, "{report:?}");
    assert_eq!(
        report.abandoned, 0,
        "20 ms handlers finish within the drain timeout"
    );

    let acked: HashSet<u64> = handle
        .settlements()
        .into_iter()
        .filter(|(_, s)| *s == Settlement::Ack)
        .map(|(id, _)| id)
        .collect();
    let effects = effects(&pool).await;
    let committed: HashSet<u64> = effects
        .keys()
        .map(|k| k.trim_start_matches("s-").parse().unwrap())
        .collect();
    assert_eq!(acked, committed, "acked exactly the committed messages");
    assert!(effects.values().all(|&(applied, _)| applied == 1));
    assert_eq!(handle.outstanding(), 0);
    assert_eq!(handle.queued() as u64, 200 - report.acked);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn file_source_position_after_shutdown_covers_only_committed_lines() {
    let pool = pool().await;
    let lines: Vec<String> = (0..300)
        .map(|i| {
            format!(
                r#"{{"message":"src.payment","payload":{{"event_id":"f-{i:03}","amount_cents":1,"delay_ms":5}}}}"#
            )
        })
        .collect();
    let refs: Vec<&str> = lines.iter().map(String::as_str).collect();
    let (_dir, path) = write_lines(&refs);

    for run in 0..2 {
        let source = FileSource::open(&path).await.unwrap();
        let start = source.start_position().line;
        let token = CancellationToken::new();
        if run == 0 {
            let cancel = token.clone();
            tokio::spawn(async move {
                tokio::time::sleep(Duration::from_millis(250)).await;
                cancel.cancel();
            });
        }
        let report = Worker::new(Dispatcher::from_registry(pool.clone()).unwrap())
            .concurrency(4)
            .run(source, token)
            .await
            .unwrap();
        let position = read_offset_file(&path.with_extension("jsonl.offset"))
            .unwrap()
            .unwrap();
        let effects = effects(&pool).await;
        // Every line inside the persisted prefix has committed.
        for line in 1..=position.line {
            let key = format!("f-{:03}", line - 1);
            assert_eq!(effects.get(&key), Some(&(1, 1)), "line {line} run {run}");
        }
        if run == 0 {
            assert_eq!(report.stop, StopReason::Shutdown);
            assert!(position.line > 0 && position.line < 300, "{position:?}");
        } else {
            assert_eq!(report.stop, StopReason::SourceExhausted);
            assert_eq!(position.line, 300);
            assert_eq!(effects.len(), 300);
            assert_eq!(report.processed + report.duplicates, 300 - start);
        }
    }
}

/// Batch mode: 300 payments and 60 redeliveries through `Worker::batch`: each applied once,
/// each delivery acked after its batch committed, a failed one recorded and requeued on its own
/// (then processed on its redelivery), and the claims made by few multi-row statements (one
/// database clock reading each), not one per message.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn worker_batches_apply_each_once_and_ack_each() {
    let pool = pool().await;
    let dispatcher = Dispatcher::from_registry(pool.clone()).unwrap();
    let source = MemorySource::new("mem");
    let handle = source.handle();
    FAIL_ONCE.lock().unwrap().push("b-150".into());
    for i in 0..300 {
        handle.push(payment(&format!("b-{i:03}"), 2, 0));
        if i % 5 == 4 {
            // A redelivery of an earlier one, possibly in the same batch.
            handle.push(payment(&format!("b-{:03}", i - 3), 2, 0));
        }
    }
    // Not even routable: kept in inbox_rejections and acked, batch or not.
    handle.push(Envelope::new("src.unknown", b"{}".to_vec()));
    handle.close();
    let report = Worker::new(dispatcher)
        .concurrency(64)
        .batch(32, Duration::from_millis(20))
        .run(source, CancellationToken::new())
        .await
        .unwrap();
    assert_eq!(
        (
            report.deliveries,
            report.processed,
            report.duplicates,
            report.invalid,
            report.failed,
            report.requeued,
            report.acked
        ),
        (362, 300, 60, 1, 1, 1, 361),
        "{report:?}"
    );
    let settlements = handle.settlements();
    let acks = settlements
        .iter()
        .filter(|(_, s)| *s == Settlement::Ack)
        .count();
    assert_eq!((settlements.len(), acks), (362, 361));
    let effects = effects(&pool).await;
    assert_eq!(effects.len(), 300);
    assert!(effects.values().all(|e| *e == (1, 2)), "{effects:?}");
    let claims: i64 = sqlx::query_scalar("SELECT COUNT(DISTINCT received_at) FROM inbox_messages")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert!(claims <= 40, "{claims} claim statements for 300 messages");
}

/// Batch mode keeps per-key order: one delivery per ordering key in a batch, the next after it.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn worker_batches_keep_per_key_order() {
    let pool = pool().await;
    let dispatcher = Dispatcher::from_registry(pool.clone()).unwrap();
    let source = MemorySource::new("mem");
    let handle = source.handle();
    let mut expected: BTreeMap<String, Vec<String>> = BTreeMap::new();
    for i in 0..10_u64 {
        for key in ["q0", "q1", "q2", "q3"] {
            let id = format!("{key}-{i:02}");
            handle.push_keyed(payment(&id, 1, (10 - i) * 2), key);
            expected.entry(key.into()).or_default().push(id);
        }
    }
    handle.close();
    let report = Worker::new(dispatcher)
        .concurrency(16)
        .batch(8, Duration::from_millis(5))
        .run(source, CancellationToken::new())
        .await
        .unwrap();
    assert_eq!((report.processed, report.acked), (40, 40));
    let order: Vec<String> = sqlx::query_scalar("SELECT event_id FROM applied_order ORDER BY seq")
        .fetch_all(&pool)
        .await
        .unwrap();
    let mut found: BTreeMap<String, Vec<String>> = BTreeMap::new();
    for id in order {
        let key = id.split('-').next().unwrap().to_owned();
        found.entry(key).or_default().push(id);
    }
    assert_eq!(found, expected);
}
