//! The parked-message sweep a worker runs beside its loop (the SQL [`Worker`](super::Worker)
//! and the DynamoDB worker alike).

use std::fmt::Display;
use std::future::Future;
use std::time::Duration;

use tokio_util::sync::{CancellationToken, DropGuard};

use crate::dispatch::SweepReport;

/// Starts `sweep` (a dispatcher's `sweep_parked`) every `every`, if set, on its own task, and
/// logs what it did: a warning for parked messages it dead-lettered or released (their gap
/// stayed open) and for a sweep that failed. The task stops when the returned guard is dropped;
/// a sweep in flight then finishes.
pub(crate) fn sweep_parked_beside<F, Fut, E>(every: Option<Duration>, sweep: F) -> DropGuard
where
    F: Fn() -> Fut + Send + 'static,
    Fut: Future<Output = Result<SweepReport, E>> + Send,
    E: Display,
{
    let sweeping = CancellationToken::new();
    let guard = sweeping.clone().drop_guard();
    let Some(every) = every else {
        return guard;
    };
    crate::store::spawn(async move {
        loop {
            tokio::select! {
                () = sweeping.cancelled() => break,
                () = tokio::time::sleep(every) => {}
            }
            match sweep().await {
                Ok(report) if report.dead_lettered + report.released > 0 => tracing::warn!(
                    dead_lettered = report.dead_lettered,
                    released = report.released,
                    "parked messages whose gap stayed open"
                ),
                Ok(_) => {}
                Err(error) => tracing::warn!(%error, "parked-message sweep failed"),
            }
        }
    });
    guard
}
