//! The parked-message sweep a worker runs beside its loop (the SQL [`Worker`](super::Worker)
//! and the DynamoDB worker alike).

use std::fmt::Display;
use std::future::Future;
use std::panic::AssertUnwindSafe;
use std::time::Duration;

use futures_util::FutureExt as _;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use crate::dispatch::SweepReport;

/// The parked-message sweep running beside a worker's loop, on its own task: started by
/// [`start`](Self::start), ended by [`stop`](Self::stop) when the loop has ended, so that no
/// sweep outlives the worker's `run`. Dropped without `stop` (the run's future dropped), it
/// starts no further sweep; one in flight then finishes on its own.
#[must_use = "dropping the sweep stops it at once"]
pub(crate) struct ParkedSweep {
    stopping: CancellationToken,
    task: Option<JoinHandle<()>>,
}

impl ParkedSweep {
    /// Starts `sweep` (a dispatcher's `sweep_parked`) every `every`, if set, and logs what it
    /// did: a warning for parked messages it dead-lettered or released (their gap stayed open)
    /// and for a sweep that failed, an error for one that panicked (a released message's
    /// handler runs in it); the next sweep runs as planned either way.
    pub(crate) fn start<F, Fut, E>(every: Option<Duration>, sweep: F) -> Self
    where
        F: Fn() -> Fut + Send + 'static,
        Fut: Future<Output = Result<SweepReport, E>> + Send,
        E: Display,
    {
        let stopping = CancellationToken::new();
        let Some(every) = every else {
            return Self {
                stopping,
                task: None,
            };
        };
        let stopped = stopping.clone();
        let task = crate::store::spawn(async move {
            loop {
                tokio::select! {
                    // Stopping wins over a due sweep: none starts once stopped.
                    biased;
                    () = stopped.cancelled() => break,
                    () = tokio::time::sleep(every) => {}
                }
                match AssertUnwindSafe(sweep()).catch_unwind().await {
                    Ok(Ok(report)) if report.dead_lettered + report.released > 0 => {
                        tracing::warn!(
                            dead_lettered = report.dead_lettered,
                            released = report.released,
                            "parked messages whose gap stayed open"
                        );
                    }
                    Ok(Ok(_)) => {}
                    Ok(Err(error)) => tracing::warn!(%error, "parked-message sweep failed"),
                    Err(panic) => tracing::error!(
                        panic = panic_text(panic.as_ref()),
                        "parked-message sweep panicked"
                    ),
                }
            }
        });
        Self {
            stopping,
            task: Some(task),
        }
    }

    /// Starts no further sweep and waits for the one in flight, if any, to finish: at most
    /// `grace` (the worker's drain timeout). A sweep still running then is abandoned with a
    /// warning (its task aborted at its next await; a statement the database is running may
    /// still complete, each of the sweep's steps being a transaction of its own).
    pub(crate) async fn stop(mut self, grace: Duration) {
        self.stopping.cancel();
        let Some(mut task) = self.task.take() else {
            return;
        };
        match tokio::time::timeout(grace, &mut task).await {
            Ok(Ok(())) => {}
            // A panic is caught per sweep; this is the task's own end (aborted: never here).
            Ok(Err(error)) => tracing::error!(%error, "parked-message sweep task ended early"),
            Err(_) => {
                tracing::warn!(
                    grace_ms = u64::try_from(grace.as_millis()).unwrap_or(u64::MAX),
                    "parked-message sweep still running after the drain timeout; abandoned"
                );
                task.abort();
            }
        }
    }
}

impl Drop for ParkedSweep {
    fn drop(&mut self) {
        self.stopping.cancel();
    }
}

/// A panic's message, when it is text (a sweep's, a worker's delivery task's).
pub(super) fn panic_text(panic: &(dyn std::any::Any + Send)) -> &str {
    panic
        .downcast_ref::<&str>()
        .copied()
        .or_else(|| panic.downcast_ref::<String>().map(String::as_str))
        .unwrap_or("(not text)")
}
