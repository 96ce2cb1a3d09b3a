//! How a run ends, shared by the SQL [`Worker`](super::Worker) and the DynamoDB worker: why it
//! stops, the drain deadlines of a shutdown and of a source failure, idleness, handing
//! unstarted deliveries back, and closing the source.

use std::time::Duration;

use tokio::time::Instant;

use crate::source::{Delivery, Source, SourceError};

use super::settings::Settings;
use super::{FAR, StopReason, WorkerError, WorkerReport, later};

/// A loop's timers: when running deliveries are abandoned, when the run stops for idleness
/// (each `None` while it does not apply), and a deadline that never comes for the timer
/// branches that do not apply.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Deadlines {
    pub(crate) abandon: Option<Instant>,
    pub(crate) idle: Option<Instant>,
    never: Instant,
}

impl Deadlines {
    /// A timer for a loop's `select!` branch: it fires at `at`, or, while `at` is `None` (the
    /// branch is disabled then, but its future is still built), never.
    pub(crate) fn timer(&self, at: Option<Instant>) -> tokio::time::Sleep {
        tokio::time::sleep_until(at.unwrap_or(self.never))
    }
}

/// Why and when a run stops.
#[derive(Debug)]
pub(crate) struct Ending {
    /// Why the loop stops (it stops fetching at once, and ends when nothing runs).
    pub(crate) stop: Option<StopReason>,
    /// The source's error, if it failed.
    pub(crate) failure: Option<SourceError>,
    /// After shutdown: when running deliveries are abandoned.
    pub(crate) drain_deadline: Option<Instant>,
    /// After a source failure: when running deliveries are abandoned (shutdown's deadline, if
    /// earlier, wins).
    failed_deadline: Option<Instant>,
    /// When a delivery last arrived or a task last ended.
    pub(crate) last_activity: Instant,
    drain_timeout: Duration,
    idle: Option<Duration>,
}

impl Ending {
    /// A run that has not begun to end, with the drain timeout and idle time of `settings`.
    pub(crate) fn new(settings: &Settings) -> Self {
        Self {
            stop: None,
            failure: None,
            drain_deadline: None,
            failed_deadline: None,
            last_activity: Instant::now(),
            drain_timeout: settings.drain_timeout,
            idle: settings.idle,
        }
    }

    /// Shutdown: stop fetching (unless stopping already), running deliveries get the drain
    /// timeout from now.
    pub(crate) fn shut_down(&mut self) {
        self.stop.get_or_insert(StopReason::Shutdown);
        self.drain_deadline = Some(later(Instant::now(), self.drain_timeout));
    }

    /// The source answered: its delivery, or `None` after it ended (exhausted: stop) or failed
    /// (stop; running deliveries get the drain timeout from now).
    pub(crate) fn fetched(
        &mut self,
        source: &str,
        fetched: Result<Option<Delivery>, SourceError>,
    ) -> Option<Delivery> {
        self.last_activity = Instant::now();
        match fetched {
            Ok(Some(delivery)) => return Some(delivery),
            Ok(None) => self.stop = Some(StopReason::SourceExhausted),
            Err(error) => {
                tracing::error!(source, %error, "source failed; finishing in-flight deliveries");
                self.stop = Some(StopReason::SourceFailed);
                self.failure = Some(error);
                self.failed_deadline = Some(later(Instant::now(), self.drain_timeout));
            }
        }
        None
    }

    /// The loop's timers now, with `in_flight` deliveries fetched and not settled.
    pub(crate) fn deadlines(&self, in_flight: usize) -> Deadlines {
        Deadlines {
            abandon: self.abandon_at(),
            idle: self.idle_at(in_flight),
            never: self.last_activity + FAR,
        }
    }

    /// When running deliveries are abandoned: the drain deadline of a shutdown or of a source
    /// failure, whichever is earlier; none before either.
    fn abandon_at(&self) -> Option<Instant> {
        match (self.drain_deadline, self.failed_deadline) {
            (Some(drain), Some(failed)) => Some(drain.min(failed)),
            (drain, failed) => drain.or(failed),
        }
    }

    /// Whether the run may stop for idleness (an idle time is set, nothing stops it yet and
    /// nothing is in flight), and when: `idle` after the last activity.
    fn idle_at(&self, in_flight: usize) -> Option<Instant> {
        match (self.idle, self.stop, in_flight) {
            (Some(idle), None, 0) => Some(later(self.last_activity, idle)),
            _ => None,
        }
    }

    /// The drain timeout passed with `running` deliveries running: logs that they are
    /// abandoned unsettled (their transactions roll back; the source delivers them again).
    pub(crate) fn abandoning(&self, source: &str, running: usize) {
        tracing::warn!(
            source,
            running,
            "drain timeout: abandoning running deliveries unsettled"
        );
    }

    /// After the loop: the report's stop reason set, closes the source (bounded by the drain
    /// timeout: a close on a connection that just died may never answer), and says how the run
    /// ended: the source's failure, or the close's, is a [`WorkerError`].
    pub(crate) async fn close<S: Source>(
        self,
        mut source: S,
        mut report: WorkerReport,
    ) -> Result<WorkerReport, WorkerError> {
        report.stop = self.stop.unwrap_or(StopReason::Shutdown);
        let drain_timeout = self.drain_timeout;
        let closed = match tokio::time::timeout(drain_timeout, source.close()).await {
            Ok(closed) => closed,
            Err(_) => Err(SourceError::new(
                source.name(),
                "close",
                format!("no answer within {} ms", drain_timeout.as_millis()),
            )),
        };
        match (self.failure, closed) {
            (Some(error), _) | (None, Err(error)) => {
                report.stop = StopReason::SourceFailed;
                Err(WorkerError { error, report })
            }
            (None, Ok(())) => Ok(report),
        }
    }
}

/// Hands `deliveries` that never started back to their source (requeued at once), counting them
/// in `report` (requeued, or settle errors); returns how many there were.
pub(crate) async fn hand_back(
    deliveries: impl IntoIterator<Item = Delivery>,
    report: &mut WorkerReport,
) -> usize {
    let mut n = 0;
    for delivery in deliveries {
        n += 1;
        report.requeued += 1;
        if let Err(error) = delivery.requeue(None).await {
            report.settle_errors += 1;
            tracing::warn!(%error, "cannot requeue an unstarted delivery");
        }
    }
    n
}
