//! Memory per dispatch is bounded by a small multiple of the payload limit: the peak resident
//! memory while dispatching a payload at the limit (64 MiB here), measured from
//! `/proc/self/status` (`VmHWM`, reset through `/proc/self/clear_refs`). Alone in its test
//! binary, so that no other test's memory is counted.

#![allow(missing_docs)]

use inbox_runtime::{Dispatcher, Envelope, Message, Outcome, handler};
use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, Serialize, Deserialize, Message)]
#[message(name = "memory.blob")]
pub struct Blob {
    #[message(key)]
    pub id: String,
    pub data: String,
}

#[inbox_runtime::idempotent(consumer = "memory")]
async fn keep(conn: &mut sqlx::PgConnection, msg: Blob) -> Result<(), sqlx::Error> {
    sqlx::query(inbox_tests::APPLY_EFFECT)
        .bind(msg.id)
        .bind(i64::try_from(msg.data.len()).unwrap())
        .execute(conn)
        .await?;
    Ok(())
}

const LIMIT: usize = 64 * 1024 * 1024;

/// The multiple of the payload's size that one dispatch may hold at its peak, the payload
/// itself excluded: the decoded message, its canonical form for the fingerprint, and the copy
/// the handler takes.
const BOUND: usize = 4;

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

#[tokio::test]
async fn peak_memory_of_a_dispatch_at_the_limit_is_a_small_multiple_of_it() {
    let pool = inbox_tests::pg_pool(2).await;
    let dispatcher = Dispatcher::from_handlers(pool.clone(), [handler!(keep)])
        .unwrap()
        .with_max_payload_bytes(LIMIT)
        .unwrap();
    // Warm up the connection and the code paths with a small message.
    let small = Envelope::new(Blob::NAME, br#"{"id":"small","data":"x"}"#.to_vec());
    dispatcher.dispatch(&small).await.unwrap();

    let head = br#"{"id":"big","data":""#;
    let mut payload = Vec::with_capacity(LIMIT);
    payload.extend_from_slice(head);
    payload.resize(LIMIT - 2, b'x');
    payload.extend_from_slice(br#""}"#);
    let envelope = Envelope::new(Blob::NAME, payload);

    // Reset the peak to the current resident set (Linux ≥ 4.0).
    std::fs::write("/proc/self/clear_refs", "5").unwrap();
    let before = status_bytes("VmHWM:");
    let outcomes = dispatcher.dispatch(&envelope).await.unwrap();
    let peak = status_bytes("VmHWM:");
    assert_eq!(
        outcomes[0].result.as_ref().unwrap(),
        &Outcome::Processed(())
    );
    assert_eq!(
        inbox_tests::effect(&pool, "big").await,
        Some((1, i64::try_from(LIMIT - head.len() - 2).unwrap()))
    );
    let extra = peak.saturating_sub(before);
    eprintln!(
        "payload {} MiB: peak {} MiB over the {} MiB before ({:.2}x the payload)",
        LIMIT >> 20,
        extra >> 20,
        before >> 20,
        extra as f64 / LIMIT as f64
    );
    assert!(
        extra < BOUND * LIMIT,
        "a dispatch of a {LIMIT}-byte payload peaked {extra} bytes over its start"
    );
}
