//! The file source reads no further than the payload limit: the peak resident memory of a worker
//! running a file with one oversized line (100× the 1 MiB limit, then 200 MiB with no newline at
//! the end of the file) stays a small multiple of the limit, measured from `/proc/self/status`
//! (`VmHWM`, reset through `/proc/self/clear_refs`). Alone in its test binary, so that no other
//! test's memory is counted; the two files run one after the other in one test.
//!
//! The oversized line is kept in `inbox_rejections` as `too_large`: its first 1 MiB, the line's
//! real size, its message name; the lines around it are processed.

#![allow(missing_docs)]

use std::io::Write as _;
use std::path::Path;
use std::sync::Arc;

use inbox_runtime::source::file::FileSource;
use inbox_runtime::{CancellationToken, Dispatcher, Message, Worker, handler};
use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, Serialize, Deserialize, Message)]
#[message(name = "memory.blob")]
pub struct Blob {
    #[message(key)]
    pub id: String,
    pub data: String,
}

#[inbox_runtime::idempotent(consumer = "memory")]
async fn keep(conn: &mut sqlx::SqliteConnection, msg: Blob) -> Result<(), sqlx::Error> {
    sqlx::query(inbox_tests::APPLY_EFFECT)
        .bind(msg.id)
        .bind(i64::try_from(msg.data.len()).unwrap())
        .execute(conn)
        .await?;
    Ok(())
}

const MIB: usize = 1024 * 1024;

/// The default payload limit, which the worker gives the file source.
const LIMIT: usize = MIB;

/// The multiple of the limit that a run may hold at its peak over its start: the line's kept
/// bytes (the limit and 64 KiB), the envelope handed to the worker, its copy bound into the
/// rejection's insert, the reader's buffer.
const BOUND: usize = 8;

/// A `/proc/self/status` field, in bytes.
fn status_bytes(field: &str) -> usize {
    let status = std::fs::read_to_string("/proc/self/status").unwrap();
    let line = status
        .lines()
        .find(|line| line.starts_with(field))
        .unwrap_or_else(|| panic!("no {field} in /proc/self/status"));
    let kib: usize = line
        .split_whitespace()
        .nth(1)
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("cannot read {line:?}"));
    kib * 1024
}

/// A line of the file: `memory.blob` with `data` of `size` bytes, a newline after it if `ended`.
fn write_line(file: &mut impl std::io::Write, id: &str, size: usize, ended: bool) -> usize {
    let head = format!(r#"{{"message":"memory.blob","payload":{{"id":"{id}","data":""#);
    file.write_all(head.as_bytes()).unwrap();
    let chunk = vec![b'x'; MIB];
    let mut left = size;
    while left > 0 {
        let n = left.min(chunk.len());
        file.write_all(&chunk[..n]).unwrap();
        left -= n;
    }
    file.write_all(br#""}}"#).unwrap();
    if ended {
        file.write_all(b"\n").unwrap();
    }
    head.len() + size + 3
}

/// Writes `small`, then a line with `big` bytes of data (a newline after it if `ended`), then
/// (if `ended`) `after`; returns the big line's length.
fn write_file(path: &Path, big: usize, ended: bool) -> usize {
    let mut file = std::io::BufWriter::new(std::fs::File::create(path).unwrap());
    write_line(&mut file, "small", 10, true);
    let length = write_line(&mut file, "big", big, ended);
    if ended {
        write_line(&mut file, "after", 20, true);
    }
    file.flush().unwrap();
    length
}

/// Runs a worker over the file; returns the peak memory over the start, in bytes, and the
/// processed and refused deliveries.
async fn run(dispatcher: &Arc<Dispatcher<sqlx::Sqlite>>, path: &Path) -> (usize, u64, u64) {
    // Reset the peak to the current resident set (Linux ≥ 4.0).
    std::fs::write("/proc/self/clear_refs", "5").unwrap();
    let before = status_bytes("VmHWM:");
    let source = FileSource::open(path).await.unwrap();
    let report = Worker::from_arc(Arc::clone(dispatcher))
        .run(source, CancellationToken::new())
        .await
        .unwrap();
    let peak = status_bytes("VmHWM:");
    (
        peak.saturating_sub(before),
        report.processed,
        report.invalid,
    )
}

async fn rejection(pool: &sqlx::SqlitePool) -> (String, String, i64, Option<i64>) {
    sqlx::query_as(
        "SELECT reason, message_name, length(payload), payload_size FROM inbox_rejections \
         ORDER BY id DESC LIMIT 1",
    )
    .fetch_one(pool)
    .await
    .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_oversized_line_costs_a_small_multiple_of_the_limit() {
    let (pool, _guard) = inbox_tests::sqlite_pool(2).await;
    let dispatcher = Arc::new(Dispatcher::from_handlers(pool.clone(), [handler!(keep)]).unwrap());
    assert_eq!(dispatcher.max_payload_bytes(), LIMIT);
    let dir = tempfile::tempdir_in(inbox_tests::scratch_dir()).unwrap();

    // Warm up the pool, the worker and the code paths with a small file.
    let path = dir.path().join("warm.jsonl");
    let mut file = std::fs::File::create(&path).unwrap();
    write_line(&mut file, "warm", 5, true);
    drop(file);
    assert_eq!(run(&dispatcher, &path).await.1, 1);

    // A line 100× the limit, between two small ones.
    let path = dir.path().join("hundred.jsonl");
    let length = write_file(&path, 100 * LIMIT, true);
    let (extra, processed, invalid) = run(&dispatcher, &path).await;
    eprintln!(
        "a {length}-byte line (100x the limit): peak {:.1} MiB over the start ({:.2}x the limit)",
        extra as f64 / MIB as f64,
        extra as f64 / LIMIT as f64
    );
    assert_eq!((processed, invalid), (2, 1));
    assert_eq!(
        rejection(&pool).await,
        (
            "too_large".to_owned(),
            "memory.blob".to_owned(),
            i64::try_from(LIMIT).unwrap(),
            Some(i64::try_from(length).unwrap())
        )
    );
    assert_eq!(inbox_tests::effect(&pool, "small").await, Some((1, 10)));
    assert_eq!(inbox_tests::effect(&pool, "after").await, Some((1, 20)));
    assert_eq!(inbox_tests::effect(&pool, "big").await, None);
    assert!(extra < BOUND * LIMIT, "peaked {extra} bytes over the start");

    // 200 MiB with no newline at the end of the file.
    let path = dir.path().join("unended.jsonl");
    let length = write_file(&path, 200 * MIB, false);
    let (extra, processed, invalid) = run(&dispatcher, &path).await;
    eprintln!(
        "a {length}-byte last line without a newline: peak {:.1} MiB over the start ({:.2}x the \
         limit)",
        extra as f64 / MIB as f64,
        extra as f64 / LIMIT as f64
    );
    assert_eq!((processed, invalid), (0, 1)); // `small` is a duplicate now
    assert_eq!(
        rejection(&pool).await,
        (
            "too_large".to_owned(),
            "memory.blob".to_owned(),
            i64::try_from(LIMIT).unwrap(),
            Some(i64::try_from(length).unwrap())
        )
    );
    assert_eq!(inbox_tests::effect(&pool, "small").await, Some((1, 10)));
    assert_eq!(inbox_tests::effect(&pool, "big").await, None);
    assert!(extra < BOUND * LIMIT, "peaked {extra} bytes over the start");
}
