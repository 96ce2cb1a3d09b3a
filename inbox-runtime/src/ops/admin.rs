//! Operations on the inbox for operators: statistics, listing, inspecting and discarding failed
//! and dead messages, and the retention purge (of the inbox, and of the outbox's `sent` rows
//! when the outbox is migrated). Replaying needs the registered handlers and lives on
//! [`crate::Dispatcher::replay`]; the outbox's own operations are in [`crate::outbox::admin`].
//! The `inbox_runtime::ops::cli` entry point wraps all of them.

use std::time::Duration;

use sqlx::Pool;

use crate::store::{
    AdminStore as _, InboxDatabase, OutboxAdminStore as _, OutboxDatabase, OutboxStatsRow,
    StatsRow, StatsStatus, StoredMessage,
};
use crate::types::status::Status;

/// Per consumer and status (every [`Status`] that has rows, `stale` included): how many rows
/// and the oldest `received_at`; rejected deliveries (conflicts, malformed, unknown, bad keys)
/// per consumer and reason ([`crate::store::StatsStatus::Rejected`]).
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

/// The shortest redelivery horizon [`Retention::new`] accepts: one hour.
///
/// Every broker can deliver a message again some time after its first delivery, and that time
/// is never zero: an ack deadline or visibility timeout that lapses while a consumer is slow
/// (RabbitMQ closes a consumer that holds a delivery unacknowledged for 30 minutes by default,
/// and requeues what it held), a consumer that restarts or loses its partitions in a rebalance
/// and leaves its unacknowledged messages to another, a producer that retries a send. A horizon
/// below an hour is then a typo (`0s`, `5m`), not a broker: refused, so that a slip of the
/// fingers cannot purge keys that can still come again. It is a floor, not a recommendation:
/// real horizons are usually days (SQS keeps an unacknowledged message up to 14 days, Kafka
/// keeps a topic 7 days by default, and consumers can rewind within it).
pub const MIN_REDELIVERY_HORIZON: Duration = Duration::from_secs(3600);

/// How far ahead of the purging process's clock the newest time in the inbox may lie before a
/// purge on SQLite refuses to run: 5 seconds (clocks kept by NTP agree far better; more than
/// this is a clock that is wrong, or faked). See [`Retention`].
pub const CLOCK_TOLERANCE: Duration = Duration::from_secs(5);

/// How long processed keys are kept, and so how long a redelivery is recognised.
///
/// The retention window *is* the deduplication guarantee: a redelivery that arrives after its
/// key was purged is processed again. It must cover the broker's redelivery horizon (the longest
/// time after a first delivery that the same message can come again: the queue's message TTL,
/// Kafka's topic retention if consumers may rewind, the producer's retry window), and the
/// horizon is at least [`MIN_REDELIVERY_HORIZON`] (one hour).
///
/// # Clocks
///
/// A row's age is measured on the database clock. On PostgreSQL that is one clock, the
/// server's: every row is stamped with it and the purge measures with it. **On SQLite, "the
/// database clock" is each process's own clock**: SQLite is a library, so every process that
/// opens the file stamps `received_at`, `processed_at` and `next_attempt_at` with its own
/// system clock. Processes on one host share that clock; one whose time is skewed or faked
/// (`faketime`, a container with a shifted clock, a test) does not. Two rules keep a purge on
/// SQLite from deleting what another process has just written:
///
/// * The window is measured back from the **earlier** of the purging process's clock and the
///   newest time written into the inbox (the latest `processed_at`/`received_at` of any row,
///   or the latest rejection): a row goes only when it is older than the window by the purging
///   process's clock *and* by the newest write. A purging process whose clock is ahead, by any
///   amount, therefore cannot delete rows that a process with a correct clock wrote within the
///   window. (When nothing has been written for a while, the purge deletes correspondingly
///   less: it catches up as soon as messages flow again.)
/// * A purge **refuses to run** ([`PurgeError::ClockSkew`]) when the newest time in the inbox
///   lies more than [`CLOCK_TOLERANCE`] (5 s) ahead of the purging process's clock: another
///   process writing the file has a clock ahead of this one, and ages cannot be trusted until
///   the clocks agree.
///
/// What this does not cover: processes that *write* with clocks that disagree. A process whose
/// clock is ahead stamps its own rows ahead, so when it purges, its own newest write looks
/// recent, and rows a correct-clock process wrote can go up to the skew early; and a retry's
/// `next_attempt_at` comes from whichever process recorded the failure. Run every process that
/// opens one SQLite file on the host's clock.
///
/// # Invariants
///
/// A `Retention` that exists has passed [`Retention::new`]'s checks, whatever built it: its
/// fields are private (read them with [`window`](Self::window),
/// [`redelivery_horizon`](Self::redelivery_horizon) and the `get_` methods), it has no
/// `Default`, and its `Deserialize` runs the same checks (see [below](#configuration-files)).
/// [`purge`], [`purge_preview`] and [`spawn_purger`] check it again before they delete anything,
/// and refuse with the same [`RetentionError`].
///
/// ```compile_fail
/// # use std::time::Duration;
/// # use inbox_runtime::ops::admin::Retention;
/// let mut retention = Retention::new(Duration::from_secs(7 * 86_400), Duration::from_secs(3600)).unwrap();
/// retention.window = Duration::ZERO; // private field: does not compile
/// ```
///
/// ```compile_fail
/// # use inbox_runtime::ops::admin::Retention;
/// let retention = Retention::default(); // no default window: does not compile
/// ```
///
/// # Configuration files
///
/// `Retention` deserializes (serde) from a map with the durations in humantime's form (`7d`,
/// `36h`, `1h 30m`, `90s`): `window` and `redelivery_horizon` (required), `batch_size`
/// (default 1000), `include_failed_and_dead` and `include_rejections` (default `false`); any other
/// field is an error. The checks of [`Retention::new`] run on it, and their
/// [`RetentionError`] is the deserializer's error:
///
/// ```
/// use inbox_runtime::ops::admin::Retention;
///
/// let retention: Retention =
///     serde_json::from_str(r#"{"window": "7d", "redelivery_horizon": "3d"}"#).unwrap();
/// assert_eq!(retention.window().as_secs(), 7 * 86_400);
///
/// let refused = serde_json::from_str::<Retention>(r#"{"window": "1d", "redelivery_horizon": "3d"}"#);
/// assert!(refused.unwrap_err().to_string().starts_with(
///     "retention window of 1d is shorter than the redelivery horizon of 3d"
/// ));
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Retention {
    /// Keep `processed` (and `discarded`, `stale`) rows this long after they were settled.
    window: Duration,
    /// The broker's redelivery horizon the window was checked against.
    redelivery_horizon: Duration,
    /// Rows deleted per statement (one short transaction each), at least 1. Default 1000.
    batch_size: u32,
    /// Also purge `failed` and `dead` rows older than the window.
    include_failed_and_dead: bool,
    /// Also purge `inbox_rejections` rows received longer ago than the window.
    include_rejections: bool,
}

/// A retention [`Retention::new`] refuses.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum RetentionError {
    /// The redelivery horizon is below [`MIN_REDELIVERY_HORIZON`].
    #[error(
        "redelivery horizon of {} is below the minimum of {}: every broker can deliver a \
         message again at least that long after the first delivery (ack deadlines and \
         visibility timeouts that lapse, consumer restarts and rebalances, producer retries), \
         so a purge this short would forget keys that can still come again",
        format_duration(*horizon),
        format_duration(*minimum)
    )]
    HorizonBelowMinimum {
        /// The horizon asked for.
        horizon: Duration,
        /// [`MIN_REDELIVERY_HORIZON`].
        minimum: Duration,
    },
    /// The window is shorter than the redelivery horizon it must cover.
    #[error(
        "retention window of {} is shorter than the redelivery horizon of {}: \
         redeliveries after the window would be processed again",
        format_duration(*window),
        format_duration(*horizon)
    )]
    WindowBelowHorizon {
        /// The window asked for.
        window: Duration,
        /// The horizon it must cover.
        horizon: Duration,
    },
}

impl Retention {
    /// A retention of `window`, checked against the broker's `redelivery_horizon`.
    ///
    /// ```
    /// use std::time::Duration;
    /// use inbox_runtime::ops::admin::{Retention, RetentionError};
    ///
    /// let day = Duration::from_secs(86_400);
    /// assert!(Retention::new(7 * day, 3 * day).is_ok());
    /// assert!(matches!(
    ///     Retention::new(Duration::ZERO, Duration::ZERO),
    ///     Err(RetentionError::HorizonBelowMinimum { .. })
    /// ));
    /// assert!(matches!(
    ///     Retention::new(day, 3 * day),
    ///     Err(RetentionError::WindowBelowHorizon { .. })
    /// ));
    /// ```
    ///
    /// # Errors
    /// [`RetentionError::HorizonBelowMinimum`] if `redelivery_horizon` is below
    /// [`MIN_REDELIVERY_HORIZON`] (checked first), [`RetentionError::WindowBelowHorizon`] if
    /// `window < redelivery_horizon`.
    pub fn new(window: Duration, redelivery_horizon: Duration) -> Result<Self, RetentionError> {
        check_window(window, redelivery_horizon)?;
        Ok(Self {
            window,
            redelivery_horizon,
            batch_size: DEFAULT_PURGE_BATCH_SIZE,
            include_failed_and_dead: false,
            include_rejections: false,
        })
    }

    /// Checks this retention again, where it is acted on ([`purge`], [`purge_preview`],
    /// [`spawn_purger`]): the same checks, and so the same [`RetentionError`], as
    /// [`Retention::new`].
    fn check(&self) -> Result<(), RetentionError> {
        check_window(self.window, self.redelivery_horizon)
    }

    /// How long settled rows are kept: the deduplication guarantee.
    pub fn window(&self) -> Duration {
        self.window
    }

    /// The broker's redelivery horizon the window was checked against (at least
    /// [`MIN_REDELIVERY_HORIZON`], at most the window).
    pub fn redelivery_horizon(&self) -> Duration {
        self.redelivery_horizon
    }

    /// Sets the rows deleted per statement, one short transaction each (default 1000; 0 counts
    /// as 1: a purge always deletes in batches of at least one row).
    pub fn batch_size(mut self, batch_size: u32) -> Self {
        self.batch_size = batch_size.max(1);
        self
    }

    /// The rows deleted per statement (at least 1).
    pub fn get_batch_size(&self) -> u32 {
        self.batch_size
    }

    /// Also purges `failed` and `dead` rows older than the window (off by default: they hold
    /// payloads nobody has looked at yet).
    pub fn include_failed_and_dead(mut self, include: bool) -> Self {
        self.include_failed_and_dead = include;
        self
    }

    /// Whether `failed` and `dead` rows older than the window are purged too.
    pub fn get_include_failed_and_dead(&self) -> bool {
        self.include_failed_and_dead
    }

    /// Also purges rejected deliveries (`inbox_rejections`: conflicts, malformed payloads,
    /// unknown names, bad keys) received longer ago than the window (off by default, for the
    /// same reason).
    pub fn include_rejections(mut self, include: bool) -> Self {
        self.include_rejections = include;
        self
    }

    /// Whether rejected deliveries received longer ago than the window are purged too.
    pub fn get_include_rejections(&self) -> bool {
        self.include_rejections
    }

    /// The statuses a purge deletes: settled rows, and failed and dead ones when asked. Parked
    /// ones never: they wait for their gap (see `Dispatcher::sweep_parked`).
    fn statuses(&self) -> &'static [Status] {
        if self.include_failed_and_dead {
            &[
                Status::Processed,
                Status::Discarded,
                Status::Stale,
                Status::Failed,
                Status::Dead,
            ]
        } else {
            &[Status::Processed, Status::Discarded, Status::Stale]
        }
    }
}

/// Rows a purge deletes per statement unless [`Retention::batch_size`] says otherwise.
const DEFAULT_PURGE_BATCH_SIZE: u32 = 1000;

/// [`Retention::new`]'s checks: the horizon against [`MIN_REDELIVERY_HORIZON`] first, then the
/// window against the horizon.
fn check_window(window: Duration, redelivery_horizon: Duration) -> Result<(), RetentionError> {
    if redelivery_horizon < MIN_REDELIVERY_HORIZON {
        return Err(RetentionError::HorizonBelowMinimum {
            horizon: redelivery_horizon,
            minimum: MIN_REDELIVERY_HORIZON,
        });
    }
    if window < redelivery_horizon {
        return Err(RetentionError::WindowBelowHorizon {
            window,
            horizon: redelivery_horizon,
        });
    }
    Ok(())
}

/// What a [`Retention`] is deserialized from: its fields, durations in humantime's form.
#[derive(serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct RetentionSpec {
    window: HumanDuration,
    redelivery_horizon: HumanDuration,
    #[serde(default = "default_purge_batch_size")]
    batch_size: u32,
    #[serde(default)]
    include_failed_and_dead: bool,
    #[serde(default)]
    include_rejections: bool,
}

fn default_purge_batch_size() -> u32 {
    DEFAULT_PURGE_BATCH_SIZE
}

/// A duration written as humantime writes it: `7d`, `36h`, `1h 30m`, `90s`.
struct HumanDuration(Duration);

impl<'de> serde::Deserialize<'de> for HumanDuration {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let text = String::deserialize(deserializer)?;
        humantime::parse_duration(&text).map(Self).map_err(|error| {
            serde::de::Error::custom(format!(
                "`{text}` is not a duration: {error} (examples: 7d, 36h, 1h 30m, 90s)"
            ))
        })
    }
}

/// Runs [`Retention::new`]'s checks: a retention it would refuse is a deserialization error
/// whose text is the [`RetentionError`]'s (see [`Retention`]'s configuration files).
impl<'de> serde::Deserialize<'de> for Retention {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let spec = RetentionSpec::deserialize(deserializer)?;
        let retention = Retention::new(spec.window.0, spec.redelivery_horizon.0)
            .map_err(serde::de::Error::custom)?;
        Ok(retention
            .batch_size(spec.batch_size)
            .include_failed_and_dead(spec.include_failed_and_dead)
            .include_rejections(spec.include_rejections))
    }
}

/// Why [`purge`] or [`purge_preview`] did not run (or stopped).
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum PurgeError {
    /// The retention is one [`Retention::new`] refuses (checked again before anything is
    /// deleted, however the value was built): the same error, with the same text. Nothing was
    /// deleted.
    #[error(transparent)]
    Retention(#[from] RetentionError),
    /// The database failed; rows deleted before it stay deleted.
    #[error(transparent)]
    Database(#[from] sqlx::Error),
    /// The inbox holds a time more than [`CLOCK_TOLERANCE`] ahead of the purging process's
    /// clock (SQLite: see [`Retention`]'s clocks). Nothing was deleted.
    #[error(
        "refusing to purge: the newest time in the inbox, {}, is {} ahead of this process's \
         clock, {} (tolerance {}): on SQLite every process stamps rows with its own clock, and \
         another process writing this database has a clock ahead of this one, so the rows' \
         ages cannot be trusted; fix the clocks, then purge again",
        utc_time(newest),
        format_skew(*ahead),
        utc_time(now),
        format_duration(CLOCK_TOLERANCE)
    )]
    ClockSkew {
        /// The purging process's clock (database text form, UTC).
        now: String,
        /// The newest time written into the inbox (database text form, UTC).
        newest: String,
        /// How far `newest` lies ahead of `now`, to the second.
        ahead: Duration,
    },
}

pub use crate::store::PurgeClock;

/// [`PurgeError::ClockSkew`] if `newest` lies more than [`CLOCK_TOLERANCE`] ahead of `now`.
fn check_clock(clock: PurgeClock) -> Result<PurgeClock, PurgeError> {
    match (&clock.newest, clock.newest_ahead_secs) {
        (Some(newest), Some(ahead)) if ahead > CLOCK_TOLERANCE.as_secs_f64() => {
            Err(PurgeError::ClockSkew {
                now: clock.now.clone(),
                newest: newest.clone(),
                ahead: Duration::from_secs(ahead.round() as u64),
            })
        }
        _ => Ok(clock),
    }
}

/// What a [`purge`] with the same retention would delete now ([`purge_preview`]).
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct PurgePreview {
    /// Per consumer and status (rejections: per consumer and reason), the rows that would go
    /// and the oldest settled time among them (`processed_at`, else `received_at`), in the
    /// order of [`stats`].
    pub rows: Vec<StatsRow>,
    /// Per destination, the outbox's `sent` rows that would go (sent before the cutoff) and the
    /// oldest `sent_at` among them; empty when the outbox is not migrated.
    pub outbox: Vec<OutboxStatsRow>,
    /// Rows settled before this would go (database text form, UTC; see
    /// [`PurgeClock::cutoff`]).
    pub cutoff: String,
}

impl PurgePreview {
    /// Rows of `inbox_messages` that would go.
    pub fn messages(&self) -> u64 {
        self.count(|status| matches!(status, StatsStatus::Message(_)))
    }

    /// Rows of `inbox_rejections` that would go.
    pub fn rejections(&self) -> u64 {
        self.count(|status| matches!(status, StatsStatus::Rejected(_)))
    }

    /// `sent` rows of the outbox that would go.
    pub fn outbox_sent(&self) -> u64 {
        self.outbox
            .iter()
            .map(|row| u64::try_from(row.count).unwrap_or(0))
            .sum()
    }

    fn count(&self, which: impl Fn(StatsStatus) -> bool) -> u64 {
        self.rows
            .iter()
            .filter(|row| which(row.status))
            .map(|row| u64::try_from(row.count).unwrap_or(0))
            .sum()
    }
}

/// What [`purge`] would delete with `retention` now, per consumer and status (and rejection
/// reason, with [`Retention::include_rejections`]), and per outbox destination, deleting
/// nothing: a dry run.
///
/// # Errors
/// As [`purge`]: [`PurgeError::Retention`], the database's error, or [`PurgeError::ClockSkew`].
pub async fn purge_preview<DB: OutboxDatabase>(
    pool: &Pool<DB>,
    retention: &Retention,
) -> Result<PurgePreview, PurgeError> {
    retention.check()?;
    let mut conn = pool.acquire().await?;
    let store = &mut *conn;
    let window = retention.window.as_secs_f64();
    let clock = check_clock(store.purge_clock(window).await?)?;
    let rows = store
        .purge_preview(retention.statuses(), window, retention.include_rejections)
        .await?;
    let outbox = if store.outbox_installed().await? {
        store.outbox_purge_preview(&clock.cutoff).await?
    } else {
        Vec::new()
    };
    Ok(PurgePreview {
        rows,
        outbox,
        cutoff: clock.cutoff,
    })
}

/// What one [`purge`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub struct PurgeReport {
    /// Rows of `inbox_messages` deleted.
    pub deleted: u64,
    /// Rows of `inbox_rejections` deleted (with [`Retention::include_rejections`]).
    pub rejections_deleted: u64,
    /// `sent` rows of the outbox deleted (0 when the outbox is not migrated).
    pub outbox_deleted: u64,
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
/// the window go too, after the messages. When the outbox is migrated
/// ([`Component::Outbox`](crate::Component::Outbox)), its `sent` rows sent before the same cutoff
/// go last (`pending` and `dead` rows never: they are not delivered yet). `progress` is called
/// after each batch with the running total of rows deleted (messages, rejections, outbox rows).
///
/// On SQLite, where each process stamps rows with its own clock, the window is measured back
/// from the earlier of this process's clock and the newest time written into the inbox, and a
/// purge refuses to run when the inbox holds times more than [`CLOCK_TOLERANCE`] ahead of this
/// process's clock: see [`Retention`]'s clocks for what that guarantees. [`purge_preview`] shows
/// what a purge would delete, without deleting.
///
/// Before anything else the retention is checked again ([`Retention::new`]'s checks): whatever
/// built it, a window below the redelivery horizon, or a horizon below
/// [`MIN_REDELIVERY_HORIZON`], is refused with the same [`RetentionError`] and nothing is
/// deleted, so that no key within the redelivery horizon can go.
///
/// # Errors
/// [`PurgeError::Retention`] and [`PurgeError::ClockSkew`] before anything is deleted; the
/// database's error (rows deleted before it stay deleted).
pub async fn purge<DB: OutboxDatabase>(
    pool: &Pool<DB>,
    retention: &Retention,
    mut progress: impl FnMut(u64),
) -> Result<PurgeReport, PurgeError> {
    retention.check()?;
    let statuses = retention.statuses();
    let window = retention.window.as_secs_f64();
    // At least one row per statement: a batch of zero rows would never come back short.
    let batch = retention.batch_size.max(1);
    let mut report = PurgeReport::default();
    let mut conn = pool.acquire().await?;
    let store = &mut *conn;
    let clock = check_clock(store.purge_clock(window).await?)?;
    // Two statements when failed and dead are included (the statement takes three statuses).
    for chunk in statuses.chunks(3) {
        loop {
            let deleted = store.purge_batch(chunk, window, i64::from(batch)).await?;
            report.deleted += deleted;
            report.batches += 1;
            progress(report.deleted);
            metrics::counter!("inbox_purged_total").increment(deleted);
            if deleted < u64::from(batch) {
                break;
            }
        }
    }
    if retention.include_rejections {
        loop {
            let deleted = store
                .purge_rejections_batch(window, i64::from(batch))
                .await?;
            report.rejections_deleted += deleted;
            report.batches += 1;
            progress(report.deleted + report.rejections_deleted);
            metrics::counter!("inbox_rejections_purged_total").increment(deleted);
            if deleted < u64::from(batch) {
                break;
            }
        }
    }
    if store.outbox_installed().await? {
        loop {
            let deleted = store
                .purge_outbox_before(&clock.cutoff, i64::from(batch))
                .await?;
            report.outbox_deleted += deleted;
            report.batches += 1;
            progress(report.deleted + report.rejections_deleted + report.outbox_deleted);
            metrics::counter!("inbox_outbox_purged_total").increment(deleted);
            if deleted < u64::from(batch) {
                break;
            }
        }
    }
    Ok(report)
}

/// The shortest interval [`spawn_purger`] accepts between two purges: one second. Zero would
/// make Tokio's interval panic inside the task, and anything close to it runs purges back to
/// back (a unit slip: `ms` for `s`); real intervals are minutes to hours.
pub const MIN_PURGE_INTERVAL: Duration = Duration::from_secs(1);

/// Why [`spawn_purger`] refused to start.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum PurgerError {
    /// The retention is one [`Retention::new`] refuses: the same error, with the same text.
    #[error(transparent)]
    Retention(#[from] RetentionError),
    /// The interval between purges is below [`MIN_PURGE_INTERVAL`].
    #[error(
        "purge interval of {} is below the minimum of {}: the purger would run purges back to \
         back",
        format_duration(*every),
        format_duration(*minimum)
    )]
    IntervalBelowMinimum {
        /// The interval asked for.
        every: Duration,
        /// [`MIN_PURGE_INTERVAL`].
        minimum: Duration,
    },
}

/// Runs [`purge`] every `every` (the first at once) until the task is aborted, logging each
/// run's result (a refused purge, [`PurgeError::ClockSkew`], is logged as an error and tried
/// again next time).
///
/// # Errors
/// Before starting anything: [`PurgerError::Retention`] if `retention` is one
/// [`Retention::new`] refuses (each [`purge`] checks it again too), and
/// [`PurgerError::IntervalBelowMinimum`] if `every` is below [`MIN_PURGE_INTERVAL`] (1 s).
pub fn spawn_purger<DB: OutboxDatabase>(
    pool: Pool<DB>,
    retention: Retention,
    every: Duration,
) -> Result<tokio::task::JoinHandle<()>, PurgerError> {
    retention.check()?;
    if every < MIN_PURGE_INTERVAL {
        return Err(PurgerError::IntervalBelowMinimum {
            every,
            minimum: MIN_PURGE_INTERVAL,
        });
    }
    Ok(crate::store::spawn(async move {
        let mut ticks = tokio::time::interval(every);
        loop {
            ticks.tick().await;
            match purge(&pool, &retention, |_| {}).await {
                Ok(report) => tracing::info!(
                    deleted = report.deleted,
                    rejections_deleted = report.rejections_deleted,
                    outbox_deleted = report.outbox_deleted,
                    "inbox retention purge"
                ),
                Err(error) => tracing::error!(%error, "inbox retention purge failed"),
            }
        }
    }))
}

/// A skew to the second, in every unit it spans: `2h`, `1h 56m 11s`, `3s`.
pub(crate) fn format_skew(skew: Duration) -> String {
    let secs = skew.as_secs();
    let parts: Vec<String> = [
        ("d", secs / 86_400),
        ("h", secs / 3600 % 24),
        ("m", secs / 60 % 60),
        ("s", secs % 60),
    ]
    .into_iter()
    .filter(|(_, n)| *n > 0)
    .map(|(unit, n)| format!("{n}{unit}"))
    .collect();
    if parts.is_empty() {
        "0s".to_owned()
    } else {
        parts.join(" ")
    }
}

/// A database time as operators read it, to the second, with its zone: `2026-05-21 10:04:31
/// UTC`. Takes SQLite's form (`2026-05-21T10:04:31.123Z`) and PostgreSQL's (`2026-05-21
/// 10:04:31.123456+00`, or with another session time zone, `…+05:30`, converted to UTC); any
/// other text comes back unchanged.
pub fn utc_time(text: &str) -> String {
    match parse_time(text) {
        Some(secs) => {
            let (days, secs) = (secs.div_euclid(86_400), secs.rem_euclid(86_400));
            let (year, month, day) = civil_from_days(days);
            format!(
                "{year:04}-{month:02}-{day:02} {:02}:{:02}:{:02} UTC",
                secs / 3600,
                secs / 60 % 60,
                secs % 60
            )
        }
        None => text.to_owned(),
    }
}

/// Seconds since 1970-01-01 00:00:00 UTC of `YYYY-MM-DD[T ]HH:MM:SS[.frac][Z|±HH[[:]MM]]` (no
/// zone: UTC). Fractions of a second are cut.
pub(crate) fn parse_time(text: &str) -> Option<i64> {
    let digits = |from: usize, to: usize| -> Option<i64> {
        let part = text.get(from..to)?;
        part.bytes()
            .all(|b| b.is_ascii_digit())
            .then(|| part.parse().ok())?
    };
    let at = |index: usize, allowed: &[u8]| {
        text.as_bytes()
            .get(index)
            .is_some_and(|b| allowed.contains(b))
    };
    if !(at(4, b"-") && at(7, b"-") && at(10, b" T") && at(13, b":") && at(16, b":")) {
        return None;
    }
    let (year, month, day) = (digits(0, 4)?, digits(5, 7)?, digits(8, 10)?);
    let (hour, minute, second) = (digits(11, 13)?, digits(14, 16)?, digits(17, 19)?);
    if !(1..=12).contains(&month) || !(1..=31).contains(&day) || hour > 23 || minute > 59 {
        return None;
    }
    let mut rest = text.get(19..)?;
    if let Some(fraction) = rest.strip_prefix('.') {
        let end = fraction
            .find(|c: char| !c.is_ascii_digit())
            .unwrap_or(fraction.len());
        rest = &fraction[end..];
    }
    let offset = match rest.as_bytes().first() {
        None => 0,
        Some(b'Z') if rest.len() == 1 => 0,
        Some(&sign @ (b'+' | b'-')) => {
            let zone = rest[1..].replace(':', "");
            if zone.len() != 2 && zone.len() != 4 || !zone.bytes().all(|b| b.is_ascii_digit()) {
                return None;
            }
            let hours: i64 = zone[..2].parse().ok()?;
            let minutes: i64 = zone
                .get(2..)
                .filter(|m| !m.is_empty())
                .map_or(Some(0), |m| m.parse().ok())?;
            let offset = hours * 3600 + minutes * 60;
            if sign == b'-' { -offset } else { offset }
        }
        Some(_) => return None,
    };
    let days = days_from_civil(year, month, day);
    Some(days * 86_400 + hour * 3600 + minute * 60 + second - offset)
}

/// Days since 1970-01-01 of a proleptic Gregorian date (H. Hinnant's `days_from_civil`).
fn days_from_civil(year: i64, month: i64, day: i64) -> i64 {
    let year = if month <= 2 { year - 1 } else { year };
    let era = year.div_euclid(400);
    let year_of_era = year - era * 400;
    let day_of_year = (153 * ((month + 9) % 12) + 2) / 5 + day - 1;
    let day_of_era = year_of_era * 365 + year_of_era / 4 - year_of_era / 100 + day_of_year;
    era * 146_097 + day_of_era - 719_468
}

/// The date of a day since 1970-01-01 (H. Hinnant's `civil_from_days`).
fn civil_from_days(days: i64) -> (i64, i64, i64) {
    let days = days + 719_468;
    let era = days.div_euclid(146_097);
    let day_of_era = days - era * 146_097;
    let year_of_era =
        (day_of_era - day_of_era / 1460 + day_of_era / 36_524 - day_of_era / 146_096) / 365;
    let day_of_year = day_of_era - (365 * year_of_era + year_of_era / 4 - year_of_era / 100);
    let mp = (5 * day_of_year + 2) / 153;
    let day = day_of_year - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = year_of_era + era * 400 + i64::from(month <= 2);
    (year, month, day)
}

/// A duration the way operators write it: `7d`, `36h`, `90m`, `45s`, `1500ms` (the largest unit
/// that divides it exactly; zero is `0s`).
pub(crate) fn format_duration(duration: Duration) -> String {
    let millis = duration.as_millis();
    if millis == 0 {
        return "0s".to_owned();
    }
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
    use super::{format_duration, utc_time};
    use std::time::Duration;

    use super::{
        MIN_PURGE_INTERVAL, PurgeError, PurgerError, Retention, RetentionError, purge,
        purge_preview, spawn_purger,
    };
    use crate::{ClaimSession, ClaimState, Fingerprint, IdempotencyKey};

    const MINUTE: Duration = Duration::from_secs(60);
    const HOUR: Duration = Duration::from_secs(3600);

    /// A retention built past [`Retention::new`] (only code inside this module can): what a
    /// public field, a `Default`, an unchecked `Deserialize` or a struct update would have let
    /// a user build.
    fn unchecked(window: Duration, redelivery_horizon: Duration, batch_size: u32) -> Retention {
        Retention {
            window,
            redelivery_horizon,
            batch_size,
            include_failed_and_dead: true,
            include_rejections: true,
        }
    }

    /// Claims `key` on a SQLite pool through the public claim session; whether it was free.
    async fn claim(pool: &sqlx::SqlitePool, key: &str) -> bool {
        let key = IdempotencyKey::new(key, "note", "id").unwrap();
        let fingerprint = Fingerprint::of_bytes("note", b"{}");
        let mut conn = pool.acquire().await.unwrap();
        match ClaimSession::new("ops", &key, "note", fingerprint)
            .open(&mut *conn)
            .await
            .unwrap()
        {
            ClaimState::Claimed(claim) => {
                claim.complete(None).await.unwrap();
                true
            }
            ClaimState::Settled(_) => false,
            _ => panic!("neither claimed nor settled"),
        }
    }

    /// An in-memory SQLite inbox with key `k-1` processed 40 minutes ago: inside any
    /// redelivery horizon `Retention::new` accepts, outside a 30-minute window.
    async fn inbox_with_a_recent_key() -> sqlx::SqlitePool {
        let pool = sqlx::sqlite::SqlitePoolOptions::new()
            .max_connections(1)
            .connect("sqlite::memory:")
            .await
            .unwrap();
        crate::migrate(&pool).await.unwrap();
        assert!(claim(&pool, "k-1").await);
        sqlx::query(
            "UPDATE inbox_messages SET \
             received_at = strftime('%Y-%m-%dT%H:%M:%fZ', 'now', '-40 minutes'), \
             processed_at = strftime('%Y-%m-%dT%H:%M:%fZ', 'now', '-40 minutes')",
        )
        .execute(&pool)
        .await
        .unwrap();
        pool
    }

    async fn rows(pool: &sqlx::SqlitePool) -> i64 {
        sqlx::query_scalar("SELECT COUNT(*) FROM inbox_messages")
            .fetch_one(pool)
            .await
            .unwrap()
    }

    /// Issue 31: a retention that did not go through `Retention::new` is refused where it is
    /// acted on — `purge`, `purge_preview`, `spawn_purger` — with the constructor's own error,
    /// before anything is deleted; the key 40 minutes old stays, and its redelivery is still a
    /// duplicate.
    #[tokio::test]
    async fn the_purge_refuses_a_retention_built_past_the_constructor() {
        let pool = inbox_with_a_recent_key().await;
        let cases = [
            (
                unchecked(30 * MINUTE, 30 * MINUTE, 1000),
                30 * MINUTE,
                30 * MINUTE,
            ),
            (
                unchecked(Duration::ZERO, Duration::ZERO, 1000),
                Duration::ZERO,
                Duration::ZERO,
            ),
            (unchecked(30 * MINUTE, HOUR, 1000), 30 * MINUTE, HOUR),
        ];
        for (retention, window, horizon) in cases {
            let constructor = Retention::new(window, horizon).unwrap_err();
            match purge(&pool, &retention, |_| panic!("nothing may be deleted")).await {
                Err(PurgeError::Retention(error)) => {
                    assert_eq!(error, constructor);
                    assert_eq!(
                        PurgeError::Retention(error).to_string(),
                        constructor.to_string()
                    );
                }
                other => panic!("{other:?}"),
            }
            match purge_preview(&pool, &retention).await {
                Err(PurgeError::Retention(error)) => assert_eq!(error, constructor),
                other => panic!("{other:?}"),
            }
            let refused = spawn_purger(pool.clone(), retention, HOUR).unwrap_err();
            assert_eq!(refused, PurgerError::Retention(constructor.clone()));
            assert_eq!(refused.to_string(), constructor.to_string());
        }
        assert_eq!(rows(&pool).await, 1);
        assert!(!claim(&pool, "k-1").await, "the redelivery is a duplicate");

        // The first case's text, as an operator reads it.
        assert_eq!(
            purge(&pool, &unchecked(30 * MINUTE, 30 * MINUTE, 1000), |_| {})
                .await
                .unwrap_err()
                .to_string(),
            "redelivery horizon of 30m is below the minimum of 1h: every broker can deliver a \
             message again at least that long after the first delivery (ack deadlines and \
             visibility timeouts that lapse, consumer restarts and rebalances, producer \
             retries), so a purge this short would forget keys that can still come again"
        );

        // A valid retention of an hour keeps the key too: it is inside the window.
        let hour = Retention::new(HOUR, HOUR).unwrap();
        assert_eq!(purge(&pool, &hour, |_| {}).await.unwrap().deleted, 0);
        assert!(!claim(&pool, "k-1").await, "the redelivery is a duplicate");
    }

    /// A batch size of zero (which the setter raises to 1) is raised where the purge acts on it
    /// too: the purge ends, deleting in batches of one row, instead of never coming back short.
    #[tokio::test]
    async fn the_purge_deletes_a_zero_batch_one_row_at_a_time() {
        let pool = inbox_with_a_recent_key().await;
        assert!(claim(&pool, "k-2").await);
        assert!(claim(&pool, "k-3").await);
        sqlx::query(
            "UPDATE inbox_messages SET received_at = '2026-01-02T03:04:05.000Z', \
             processed_at = '2026-01-02T03:04:05.000Z' WHERE message_key <> 'k-1'",
        )
        .execute(&pool)
        .await
        .unwrap();
        let zero = unchecked(HOUR, HOUR, 0);
        let report = purge(&pool, &zero, |_| {}).await.unwrap();
        // Two old rows in batches of one: two full batches and a short one, then one statement
        // for the failed and dead rows and one for the rejections.
        assert_eq!((report.deleted, report.batches), (2, 5));
        assert_eq!(rows(&pool).await, 1);
        assert!(claim(&pool, "k-2").await, "purged: the key is free again");
        assert!(
            !claim(&pool, "k-1").await,
            "inside the window: still a duplicate"
        );
    }

    /// The purger's interval: below a second is refused before anything runs (zero would panic
    /// inside Tokio's interval).
    #[tokio::test]
    async fn the_purger_refuses_an_interval_below_a_second() {
        let pool = inbox_with_a_recent_key().await;
        let retention = Retention::new(HOUR, HOUR).unwrap();
        for every in [Duration::ZERO, Duration::from_millis(999)] {
            let refused = spawn_purger(pool.clone(), retention.clone(), every).unwrap_err();
            assert_eq!(
                refused,
                PurgerError::IntervalBelowMinimum {
                    every,
                    minimum: MIN_PURGE_INTERVAL
                }
            );
        }
        assert_eq!(
            spawn_purger(pool.clone(), retention.clone(), Duration::ZERO)
                .unwrap_err()
                .to_string(),
            "purge interval of 0s is below the minimum of 1s: the purger would run purges back \
             to back"
        );
        let purger = spawn_purger(pool.clone(), retention, MIN_PURGE_INTERVAL).unwrap();
        purger.abort();
        assert!(purger.await.unwrap_err().is_cancelled());
        assert_eq!(rows(&pool).await, 1);
    }

    /// `Deserialize` runs `Retention::new`'s checks: a retention it refuses is the
    /// deserializer's error, with exactly the constructor's text; unknown fields and durations that do
    /// not parse are errors too.
    #[test]
    fn deserializing_checks_what_the_constructor_checks() {
        let parsed: Retention = serde_json::from_str(
            r#"{"window": "7d", "redelivery_horizon": "3d", "batch_size": 0,
                "include_failed_and_dead": true}"#,
        )
        .unwrap();
        let built = Retention::new(7 * 24 * HOUR, 3 * 24 * HOUR)
            .unwrap()
            .batch_size(1)
            .include_failed_and_dead(true);
        assert_eq!(parsed, built);
        assert_eq!(parsed.get_batch_size(), 1);
        assert!(!parsed.get_include_rejections());

        for (json, window, horizon) in [
            (
                r#"{"window": "30m", "redelivery_horizon": "1h"}"#,
                30 * MINUTE,
                HOUR,
            ),
            (
                r#"{"window": "0s", "redelivery_horizon": "0s"}"#,
                Duration::ZERO,
                Duration::ZERO,
            ),
            (
                r#"{"window": "1d", "redelivery_horizon": "59m"}"#,
                24 * HOUR,
                59 * MINUTE,
            ),
        ] {
            let constructor: RetentionError = Retention::new(window, horizon).unwrap_err();
            let error = serde_json::from_str::<Retention>(json)
                .unwrap_err()
                .to_string();
            assert_eq!(error, constructor.to_string());
        }
        let unknown = serde_json::from_str::<Retention>(
            r#"{"window": "7d", "redelivery_horizon": "3d", "horizon": "1h"}"#,
        );
        assert!(
            unknown
                .unwrap_err()
                .to_string()
                .starts_with("unknown field `horizon`")
        );
        let missing = serde_json::from_str::<Retention>(r#"{"window": "7d"}"#);
        assert!(
            missing
                .unwrap_err()
                .to_string()
                .starts_with("missing field `redelivery_horizon`")
        );
        let typo =
            serde_json::from_str::<Retention>(r#"{"window": "7d", "redelivery_horizon": "3dd"}"#);
        let typo = typo.unwrap_err().to_string();
        assert!(typo.starts_with("`3dd` is not a duration: "), "{typo}");
        assert!(typo.contains("(examples: 7d, 36h, 1h 30m, 90s)"), "{typo}");
    }

    #[test]
    fn skews_in_every_unit() {
        let cases = [
            (7200, "2h"),
            (6971, "1h 56m 11s"),
            (90_061, "1d 1h 1m 1s"),
            (6, "6s"),
            (0, "0s"),
        ];
        for (secs, text) in cases {
            assert_eq!(super::format_skew(Duration::from_secs(secs)), text);
        }
    }

    #[test]
    fn times_in_utc_to_the_second() {
        let cases = [
            ("2026-05-21T10:04:31.123Z", "2026-05-21 10:04:31 UTC"),
            ("2026-05-21 10:04:31.123456+00", "2026-05-21 10:04:31 UTC"),
            ("2026-05-21 10:04:31+00", "2026-05-21 10:04:31 UTC"),
            ("2026-05-21 10:04:31", "2026-05-21 10:04:31 UTC"),
            ("2026-05-21 12:04:31.5+02", "2026-05-21 10:04:31 UTC"),
            ("2026-05-21 02:34:31+05:30", "2026-05-20 21:04:31 UTC"),
            ("2026-12-31 22:00:00-03", "2027-01-01 01:00:00 UTC"),
            ("2024-02-29 23:59:59Z", "2024-02-29 23:59:59 UTC"),
            ("1970-01-01 00:00:00Z", "1970-01-01 00:00:00 UTC"),
            ("infinity", "infinity"),
            ("2026-05-21 10:04", "2026-05-21 10:04"),
            ("2026-13-21 10:04:31Z", "2026-13-21 10:04:31Z"),
            ("2026-05-21 10:04:31 garbage", "2026-05-21 10:04:31 garbage"),
        ];
        for (text, shown) in cases {
            assert_eq!(utc_time(text), shown, "{text}");
        }
    }

    #[test]
    fn durations_in_operators_units() {
        let cases = [
            (Duration::from_secs(7 * 86_400), "7d"),
            (Duration::from_secs(36 * 3600), "36h"),
            (Duration::from_secs(90 * 60), "90m"),
            (Duration::from_secs(45), "45s"),
            (Duration::from_millis(1500), "1500ms"),
            (Duration::ZERO, "0s"),
        ];
        for (duration, text) in cases {
            assert_eq!(format_duration(duration), text);
        }
    }
}
