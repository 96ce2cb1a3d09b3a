//! Operations on the inbox for operators: statistics, listing, inspecting and discarding failed
//! and dead messages, and the retention purge. Replaying needs the registered handlers and lives
//! on [`crate::Dispatcher::replay`]. The `inbox_runtime::cli` entry point wraps all of them.

use std::time::Duration;

use sqlx::Pool;

use crate::status::Status;
use crate::store::{AdminStore as _, InboxDatabase, StatsRow, StoredMessage};

/// Per consumer and status (every [`Status`] that has rows, `stale` included): how many rows
/// and the oldest `received_at`; rejected deliveries (conflicts, malformed, unknown, bad keys)
/// per consumer and reason ([`crate::StatsStatus::Rejected`]).
///
/// # Errors
/// The database's error.
pub async fn stats<DB: InboxDatabase>(pool: &Pool<DB>) -> Result<Vec<StatsRow>, sqlx::Error> {
    let mut conn = pool.acquire().await?;
    conn.stats().await
}

/// Rows whose status is one of `statuses` (any number, e.g. `&[Status::Failed, Status::Dead]`,
/// or [`Status::ALL`]), of one consumer or all, oldest first (by `received_at`), at most `limit`.
/// An empty `statuses` lists nothing.
///
/// # Errors
/// The database's error.
pub async fn list<DB: InboxDatabase>(
    pool: &Pool<DB>,
    consumer: Option<&str>,
    statuses: &[Status],
    limit: u32,
) -> Result<Vec<StoredMessage>, sqlx::Error> {
    let mut conn = pool.acquire().await?;
    conn.list_messages(consumer, statuses, i64::from(limit))
        .await
}

/// One row, payload included, or `None`.
///
/// # Errors
/// The database's error.
pub async fn show<DB: InboxDatabase>(
    pool: &Pool<DB>,
    consumer: &str,
    key: &str,
) -> Result<Option<StoredMessage>, sqlx::Error> {
    let mut conn = pool.acquire().await?;
    conn.fetch_message(consumer, key).await
}

/// Marks a `failed` or `dead` message `discarded`: it will never run, its payload is dropped,
/// and the key keeps blocking redeliveries (they come back as [`crate::Outcome::Discarded`])
/// until the retention purge removes it. Returns `false` if no failed or dead row matched.
///
/// # Errors
/// The database's error.
pub async fn discard<DB: InboxDatabase>(
    pool: &Pool<DB>,
    consumer: &str,
    key: &str,
) -> Result<bool, sqlx::Error> {
    let mut conn = pool.acquire().await?;
    conn.discard_message(consumer, key).await
}

/// How long processed keys are kept, and so how long a redelivery is recognised.
///
/// The retention window *is* the deduplication guarantee: a redelivery that arrives after its
/// key was purged is processed again. It must cover the broker's redelivery horizon (the longest
/// time after a first delivery that the same message can come again: the queue's message TTL,
/// Kafka's topic retention if consumers may rewind, the producer's retry window).
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct Retention {
    /// Keep `processed` (and `discarded`, `stale`) rows this long after they were settled.
    pub window: Duration,
    /// The broker's redelivery horizon the window was checked against.
    pub redelivery_horizon: Duration,
    /// Rows deleted per statement (one short transaction each). Default 1000.
    pub batch_size: u32,
    /// Also purge `failed` and `dead` rows older than the window (off by default: they hold
    /// payloads nobody has looked at yet).
    pub include_failed_and_dead: bool,
    /// Also purge `inbox_rejections` rows (conflicts, malformed payloads, unknown names, bad
    /// keys) received longer ago than the window (off by default, for the same reason).
    pub include_rejections: bool,
}

/// A retention window shorter than the redelivery horizon it must cover.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "retention window of {} is shorter than the redelivery horizon of {}: \
     redeliveries after the window would be processed again",
    format_duration(*window),
    format_duration(*horizon)
)]
pub struct RetentionError {
    /// The window asked for.
    pub window: Duration,
    /// The horizon it must cover.
    pub horizon: Duration,
}

impl Retention {
    /// A retention of `window`, checked against the broker's `redelivery_horizon`.
    ///
    /// # Errors
    /// [`RetentionError`] if `window < redelivery_horizon`.
    pub fn new(window: Duration, redelivery_horizon: Duration) -> Result<Self, RetentionError> {
        if window < redelivery_horizon {
            return Err(RetentionError {
                window,
                horizon: redelivery_horizon,
            });
        }
        Ok(Self {
            window,
            redelivery_horizon,
            batch_size: 1000,
            include_failed_and_dead: false,
            include_rejections: false,
        })
    }

    /// Sets the rows deleted per statement (at least 1).
    pub fn batch_size(mut self, batch_size: u32) -> Self {
        self.batch_size = batch_size.max(1);
        self
    }

    /// Also purges `failed` and `dead` rows older than the window.
    pub fn include_failed_and_dead(mut self, include: bool) -> Self {
        self.include_failed_and_dead = include;
        self
    }

    /// Also purges rejected deliveries (`inbox_rejections`) received longer ago than the
    /// window.
    pub fn include_rejections(mut self, include: bool) -> Self {
        self.include_rejections = include;
        self
    }
}

/// What one [`purge`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub struct PurgeReport {
    /// Rows of `inbox_messages` deleted.
    pub deleted: u64,
    /// Rows of `inbox_rejections` deleted (with [`Retention::include_rejections`]).
    pub rejections_deleted: u64,
    /// Statements (batches) run.
    pub batches: u32,
}

/// Deletes rows older than the retention window, in batches of `retention.batch_size`, each its
/// own short statement (no long locks; on PostgreSQL rows locked by running transactions are
/// skipped). Runs until a batch comes back short. A row's age is measured on the database clock
/// from when it was settled (`processed_at`: processed, discarded or stale), or else from its
/// first delivery (`received_at`: failed, dead). `processed`, `discarded` and `stale` rows go;
/// `failed` and `dead` ones only with [`Retention::include_failed_and_dead`]; `parked` ones
/// never. With [`Retention::include_rejections`], rejected deliveries received longer ago than
/// the window go too, after the messages. `progress` is called after each batch with the running
/// total of rows deleted (messages and rejections).
///
/// # Errors
/// The database's error; rows deleted before it stay deleted.
pub async fn purge<DB: InboxDatabase>(
    pool: &Pool<DB>,
    retention: &Retention,
    mut progress: impl FnMut(u64),
) -> Result<PurgeReport, sqlx::Error> {
    // Settled rows; failed and dead ones only when asked. Parked ones never: they wait for
    // their gap (see `Dispatcher::sweep_parked`).
    let statuses: &[Status] = if retention.include_failed_and_dead {
        &[
            Status::Processed,
            Status::Discarded,
            Status::Stale,
            Status::Failed,
            Status::Dead,
        ][..]
    } else {
        &[Status::Processed, Status::Discarded, Status::Stale][..]
    };
    let mut report = PurgeReport::default();
    let mut conn = pool.acquire().await?;
    let store = &mut *conn;
    // Two statements when failed and dead are included (the statement takes three statuses).
    for chunk in statuses.chunks(3) {
        loop {
            let deleted = store
                .purge_batch(
                    chunk,
                    retention.window.as_secs_f64(),
                    i64::from(retention.batch_size),
                )
                .await?;
            report.deleted += deleted;
            report.batches += 1;
            progress(report.deleted);
            metrics::counter!("inbox_purged_total").increment(deleted);
            if deleted < u64::from(retention.batch_size) {
                break;
            }
        }
    }
    if retention.include_rejections {
        loop {
            let deleted = store
                .purge_rejections_batch(
                    retention.window.as_secs_f64(),
                    i64::from(retention.batch_size),
                )
                .await?;
            report.rejections_deleted += deleted;
            report.batches += 1;
            progress(report.deleted + report.rejections_deleted);
            metrics::counter!("inbox_rejections_purged_total").increment(deleted);
            if deleted < u64::from(retention.batch_size) {
                break;
            }
        }
    }
    Ok(report)
}

/// Runs [`purge`] every `every` until the task is aborted, logging each run's result.
pub fn spawn_purger<DB: InboxDatabase>(
    pool: Pool<DB>,
    retention: Retention,
    every: Duration,
) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        let mut ticks = tokio::time::interval(every);
        loop {
            ticks.tick().await;
            match purge(&pool, &retention, |_| {}).await {
                Ok(report) => tracing::info!(
                    deleted = report.deleted,
                    rejections_deleted = report.rejections_deleted,
                    "inbox retention purge"
                ),
                Err(error) => tracing::error!(%error, "inbox retention purge failed"),
            }
        }
    })
}

/// A duration the way operators write it: `7d`, `36h`, `90m`, `45s`, `1500ms` (the largest unit
/// that divides it exactly).
pub(crate) fn format_duration(duration: Duration) -> String {
    let millis = duration.as_millis();
    for (unit, per) in [
        ("d", 86_400_000),
        ("h", 3_600_000),
        ("m", 60_000),
        ("s", 1000),
    ] {
        if millis >= per && millis.is_multiple_of(per) {
            return format!("{}{unit}", millis / per);
        }
    }
    format!("{millis}ms")
}

#[cfg(test)]
mod tests {
    use super::format_duration;
    use std::time::Duration;

    #[test]
    fn durations_in_operators_units() {
        let cases = [
            (Duration::from_secs(7 * 86_400), "7d"),
            (Duration::from_secs(36 * 3600), "36h"),
            (Duration::from_secs(90 * 60), "90m"),
            (Duration::from_secs(45), "45s"),
            (Duration::from_millis(1500), "1500ms"),
            (Duration::ZERO, "0ms"),
        ];
        for (duration, text) in cases {
            assert_eq!(format_duration(duration), text);
        }
    }
}
