//! The claim context: the claim a body runs for (its consumer and idempotency key), in a
//! task-local set by the protocol around each run of a body — an `#[idempotent]` handler's,
//! single or batched, an HTTP request's handler under an `Idempotency-Key` — and by the
//! outbox's `scoped`. Modules above the protocol read it from here: the outbox's `publish`
//! derives stable message ids from it, [`StepKey::current`](crate::types::StepKey::current) step
//! keys.
//!
//! A leaf module: it depends on nothing else of the crate.

use std::future::Future;
use std::sync::atomic::{AtomicU32, Ordering};

/// One run of a handler body: its consumer, its idempotency key, and how many messages it
/// published so far.
pub(crate) struct Claim {
    pub(crate) consumer: String,
    pub(crate) key: String,
    next: AtomicU32,
}

tokio::task_local! {
    static CLAIM: Claim;
}

/// Runs `body` with `(consumer, key)` as the current claim; publish positions start at 0.
pub(crate) async fn scope<F: Future>(consumer: &str, key: &str, body: F) -> F::Output {
    let claim = Claim {
        consumer: consumer.to_owned(),
        key: key.to_owned(),
        next: AtomicU32::new(0),
    };
    CLAIM.scope(claim, body).await
}

/// The current claim's consumer and key and the next publish position (counted), or `None`
/// outside any claim.
pub(crate) fn next_position() -> Option<(String, String, u32)> {
    CLAIM
        .try_with(|claim| {
            let index = claim.next.fetch_add(1, Ordering::Relaxed);
            (claim.consumer.clone(), claim.key.clone(), index)
        })
        .ok()
}

/// The current claim's consumer (scope) and key, or `None` outside any claim.
pub(crate) fn current() -> Option<(String, String)> {
    CLAIM
        .try_with(|claim| (claim.consumer.clone(), claim.key.clone()))
        .ok()
}
