//! The operator console's reads (see [`crate::console`]): rejected deliveries with their
//! payloads, parked messages per aggregate, and arrivals per hour. Each reads through an index
//! (the `inbox_messages_console` and `inbox_rejections_console` indexes of the inbox's console
//! migration, the rejections' primary key, the aggregate state's primary key).

use sqlx::{MySqlConnection, PgConnection, SqliteConnection};

use super::{RejectionReason, StatsStatus};
use crate::BoxFuture;

/// One row of `inbox_rejections`: a delivery the dispatcher refused and kept.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct RejectionEntry {
    /// The row's id (ascending in the order rejections were recorded).
    pub id: i64,
    /// The consumer, when one could be named (`None`: an unknown message name).
    pub consumer: Option<String>,
    /// The idempotency key, when one could be read.
    pub message_key: Option<String>,
    /// The message name of the delivery.
    pub message_name: String,
    /// Why it was refused.
    pub reason: RejectionReason,
    /// What was wrong, in words (a decode error, the conflicting fingerprints, …).
    pub detail: String,
    /// The payload's fingerprint, when one was computed.
    pub payload_hash: Option<String>,
    /// When it was recorded (database text form: [`crate::admin::utc_time`] shows it in UTC).
    pub received_at: String,
    /// The source it came from, if known.
    pub source: Option<String>,
    /// How many payload bytes are kept.
    pub kept_bytes: i64,
    /// The payload's real size in bytes when it was over the size limit and is kept cut to
    /// it (`too_large`); `None`: the payload is kept whole.
    pub payload_size: Option<i64>,
    /// The kept payload bytes: loaded by [`ConsoleStore::fetch_rejection`] only.
    pub payload: Option<Vec<u8>>,
}

/// A parked message and where its aggregate stands.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct ParkedEntry {
    /// The consumer.
    pub consumer: String,
    /// The aggregate the message belongs to.
    pub aggregate_id: String,
    /// The parked message's sequence number.
    pub sequence: i64,
    /// The parked message's idempotency key.
    pub message_key: String,
    /// Its first delivery (database text form).
    pub received_at: String,
    /// The aggregate's last applied sequence (0 when none has been applied).
    pub last_sequence: i64,
}

/// How many rows of one series arrived in one hour.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct ArrivalRow {
    /// The consumer (`None`: rejections no consumer could be named for).
    pub consumer: Option<String>,
    /// The series: inbox rows by their status now, or rejections by reason.
    pub series: StatsStatus,
    /// The hour, as whole hours since 1970-01-01 00:00 UTC (database clock).
    pub hour: i64,
    /// How many rows: inbox rows first delivered (`received_at`) in that hour, or rejections
    /// recorded in it.
    pub count: i64,
}

/// Outbox rows sent in one hour to one destination: `(destination, hour, count)`, the hour as
/// whole hours since 1970-01-01 00:00 UTC.
pub type SentRow = (String, i64, i64);

/// Failed messages of one consumer whose retry is due (`next_attempt_at` passed) and that no
/// redelivery has claimed yet: how far retries lag.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct RetryLag {
    /// The consumer.
    pub consumer: String,
    /// How many failed messages are due.
    pub due: i64,
    /// The earliest `next_attempt_at` among them (database text form).
    pub oldest_due: String,
}

/// The console's reads, per backend. Implemented for `sqlx::PgConnection`,
/// `sqlx::SqliteConnection` and `sqlx::MySqlConnection`.
pub trait ConsoleStore: Send {
    /// Rejections, newest first, of `consumer` and `reason` if given, at most `limit`, without
    /// their payloads.
    fn list_rejections<'c>(
        &'c mut self,
        consumer: Option<&'c str>,
        reason: Option<RejectionReason>,
        limit: i64,
    ) -> BoxFuture<'c, Result<Vec<RejectionEntry>, sqlx::Error>>;

    /// The rejection with `id`, payload included, or `None`.
    fn fetch_rejection(
        &mut self,
        id: i64,
    ) -> BoxFuture<'_, Result<Option<RejectionEntry>, sqlx::Error>>;

    /// Parked messages (of `consumer` if given) with their aggregate's last applied sequence,
    /// by consumer, aggregate and sequence, at most `limit`.
    fn list_parked<'c>(
        &'c mut self,
        consumer: Option<&'c str>,
        limit: i64,
    ) -> BoxFuture<'c, Result<Vec<ParkedEntry>, sqlx::Error>>;

    /// The database's current hour (hours since the epoch, UTC) and the arrivals per consumer,
    /// series and hour of the last `hours` hours (hours without arrivals have no row).
    fn arrivals(
        &mut self,
        hours: i64,
    ) -> BoxFuture<'_, Result<(i64, Vec<ArrivalRow>), sqlx::Error>>;

    /// Per consumer with any, the failed messages whose retry is due (read through the
    /// `inbox_messages_retry` index).
    fn retries_due(&mut self) -> BoxFuture<'_, Result<Vec<RetryLag>, sqlx::Error>>;

    /// Outbox rows sent per destination and hour (hours since the epoch, UTC) in the last
    /// `hours` hours, as `(destination, hour, count)` (read through the `sent_at` index of the
    /// outbox; fails with the database's error when the outbox is not migrated).
    fn outbox_sent(&mut self, hours: i64) -> BoxFuture<'_, Result<Vec<SentRow>, sqlx::Error>>;
}

/// A database whose connections have the console's reads: PostgreSQL, SQLite, MySQL.
pub trait ConsoleDatabase: super::OutboxDatabase<Connection: ConsoleStore> {}

impl ConsoleDatabase for sqlx::Postgres {}
impl ConsoleDatabase for sqlx::Sqlite {}
impl ConsoleDatabase for sqlx::MySql {}

/// `id, consumer, key, name, reason, detail, hash, received, source, kept, size`.
type RejectionTuple = (
    i64,
    Option<String>,
    Option<String>,
    String,
    String,
    String,
    Option<String>,
    String,
    Option<String>,
    i64,
    Option<i64>,
);

fn rejection(row: RejectionTuple, payload: Option<Vec<u8>>) -> Result<RejectionEntry, sqlx::Error> {
    let (id, consumer, message_key, message_name, reason, detail, payload_hash, received_at) =
        (row.0, row.1, row.2, row.3, row.4, row.5, row.6, row.7);
    Ok(RejectionEntry {
        id,
        consumer,
        message_key,
        message_name,
        reason: reason
            .parse()
            .map_err(|error: String| sqlx::Error::Decode(error.into()))?,
        detail,
        payload_hash,
        received_at,
        source: row.8,
        kept_bytes: row.9,
        payload_size: row.10,
        payload,
    })
}

fn arrival(row: (Option<String>, String, i64, i64)) -> Result<ArrivalRow, sqlx::Error> {
    Ok(ArrivalRow {
        consumer: row.0,
        series: super::shared::stats_status(&row.1)?,
        hour: row.2,
        count: row.3,
    })
}

/// The statements of one backend. Parameters appear once each, in order (a value used twice is
/// bound twice), so that `$N` and `?` dialects bind alike.
struct Sql {
    list_rejections: &'static str,
    fetch_rejection: &'static str,
    list_parked: &'static str,
    now_hour: &'static str,
    arrivals: &'static str,
    retries_due: &'static str,
    outbox_sent: &'static str,
}

/// Rejections of PostgreSQL and SQLite, `$null` the cast an untyped NULL test needs.
macro_rules! list_rejections {
    ($null:literal) => {
        concat!(
            "SELECT id, consumer, message_key, message_name, reason, detail, payload_hash, \
             CAST(received_at AS TEXT), source, CAST(LENGTH(payload) AS BIGINT), payload_size \
             FROM inbox_rejections WHERE ($1",
            $null,
            " IS NULL OR consumer = $2) AND ($3",
            $null,
            " IS NULL OR reason = $4) ORDER BY id DESC LIMIT $5"
        )
    };
}

/// Parked rows of PostgreSQL and SQLite, `$null` as in `list_rejections!`.
macro_rules! list_parked {
    ($null:literal) => {
        concat!(
            "SELECT m.consumer, m.aggregate_id, m.sequence, m.message_key, \
             CAST(m.received_at AS TEXT), COALESCE(s.last_sequence, 0) \
             FROM inbox_messages m LEFT JOIN inbox_aggregate_state s \
               ON s.consumer = m.consumer AND s.aggregate_id = m.aggregate_id \
             WHERE m.status = 'parked' AND m.aggregate_id IS NOT NULL \
               AND m.sequence IS NOT NULL AND ($1",
            $null,
            " IS NULL OR m.consumer = $2) ORDER BY m.consumer, m.aggregate_id, m.sequence LIMIT $3"
        )
    };
}

/// One rejection with its payload, on PostgreSQL and SQLite.
const FETCH_REJECTION: &str = "SELECT id, consumer, message_key, message_name, reason, detail, \
     payload_hash, CAST(received_at AS TEXT), source, CAST(LENGTH(payload) AS BIGINT), \
     payload_size, payload FROM inbox_rejections WHERE id = $1";

const POSTGRES: Sql = Sql {
    list_rejections: list_rejections!("::TEXT"),
    fetch_rejection: FETCH_REJECTION,
    list_parked: list_parked!("::TEXT"),
    now_hour: "SELECT CAST(FLOOR(EXTRACT(EPOCH FROM now()) / 3600) AS BIGINT)",
    arrivals: "SELECT consumer, status, CAST(FLOOR(EXTRACT(EPOCH FROM received_at) / 3600) AS BIGINT), \
         COUNT(*) FROM inbox_messages \
         WHERE status IN ('processed', 'failed', 'dead', 'parked', 'stale', 'discarded') \
           AND received_at >= now() - $1 * interval '1 hour' \
         GROUP BY 1, 2, 3 \
         UNION ALL \
         SELECT consumer, 'rejected:' || reason, \
           CAST(FLOOR(EXTRACT(EPOCH FROM received_at) / 3600) AS BIGINT), COUNT(*) \
         FROM inbox_rejections WHERE received_at >= now() - $2 * interval '1 hour' \
         GROUP BY 1, 2, 3",
    retries_due: "SELECT consumer, COUNT(*), CAST(MIN(next_attempt_at) AS TEXT) \
         FROM inbox_messages WHERE status = 'failed' AND next_attempt_at <= now() \
         GROUP BY consumer",
    outbox_sent: "SELECT destination, CAST(FLOOR(EXTRACT(EPOCH FROM sent_at) / 3600) AS BIGINT), \
         COUNT(*) FROM inbox_outbox \
         WHERE status = 'sent' AND sent_at >= now() - $1 * interval '1 hour' GROUP BY 1, 2",
};

const SQLITE: Sql = Sql {
    list_rejections: list_rejections!(""),
    fetch_rejection: FETCH_REJECTION,
    list_parked: list_parked!(""),
    now_hour: "SELECT CAST(strftime('%s', 'now') AS INTEGER) / 3600",
    arrivals: "SELECT consumer, status, CAST(strftime('%s', received_at) AS INTEGER) / 3600, \
         COUNT(*) FROM inbox_messages \
         WHERE status IN ('processed', 'failed', 'dead', 'parked', 'stale', 'discarded') \
           AND received_at >= strftime('%Y-%m-%dT%H:%M:%fZ', 'now', '-' || $1 || ' hours') \
         GROUP BY 1, 2, 3 \
         UNION ALL \
         SELECT consumer, 'rejected:' || reason, \
           CAST(strftime('%s', received_at) AS INTEGER) / 3600, COUNT(*) \
         FROM inbox_rejections \
         WHERE received_at >= strftime('%Y-%m-%dT%H:%M:%fZ', 'now', '-' || $2 || ' hours') \
         GROUP BY 1, 2, 3",
    retries_due: "SELECT consumer, COUNT(*), CAST(MIN(next_attempt_at) AS TEXT) \
         FROM inbox_messages WHERE status = 'failed' \
           AND next_attempt_at <= strftime('%Y-%m-%dT%H:%M:%fZ', 'now') \
         GROUP BY consumer",
    outbox_sent: "SELECT destination, CAST(strftime('%s', sent_at) AS INTEGER) / 3600, COUNT(*) \
         FROM inbox_outbox WHERE status = 'sent' \
           AND sent_at >= strftime('%Y-%m-%dT%H:%M:%fZ', 'now', '-' || $1 || ' hours') \
         GROUP BY 1, 2",
};

const MYSQL: Sql = Sql {
    list_rejections: "SELECT id, consumer, message_key, message_name, reason, detail, \
         payload_hash, DATE_FORMAT(received_at, '%Y-%m-%d %H:%i:%s.%f'), source, \
         CAST(LENGTH(payload) AS SIGNED), payload_size FROM inbox_rejections \
         WHERE (? IS NULL OR consumer = ?) AND (? IS NULL OR reason = ?) \
         ORDER BY id DESC LIMIT ?",
    fetch_rejection: "SELECT id, consumer, message_key, message_name, reason, detail, \
         payload_hash, DATE_FORMAT(received_at, '%Y-%m-%d %H:%i:%s.%f'), source, \
         CAST(LENGTH(payload) AS SIGNED), payload_size, payload FROM inbox_rejections WHERE id = ?",
    list_parked: "SELECT CONVERT(m.consumer USING utf8mb4), CONVERT(m.aggregate_id USING utf8mb4), \
         m.sequence, CONVERT(m.message_key USING utf8mb4), \
         DATE_FORMAT(m.received_at, '%Y-%m-%d %H:%i:%s.%f'), COALESCE(s.last_sequence, 0) \
         FROM inbox_messages m LEFT JOIN inbox_aggregate_state s \
           ON s.consumer = m.consumer AND s.aggregate_id = m.aggregate_id \
         WHERE m.status = 'parked' AND m.aggregate_id IS NOT NULL AND m.sequence IS NOT NULL \
           AND (? IS NULL OR m.consumer = ?) \
         ORDER BY m.consumer, m.aggregate_id, m.sequence LIMIT ?",
    now_hour: "SELECT CAST(TIMESTAMPDIFF(SECOND, '1970-01-01 00:00:00', UTC_TIMESTAMP()) DIV 3600 \
         AS SIGNED)",
    arrivals: "SELECT CONVERT(consumer USING utf8mb4), status, \
         CAST(TIMESTAMPDIFF(SECOND, '1970-01-01 00:00:00', received_at) DIV 3600 AS SIGNED) AS h, \
         COUNT(*) FROM inbox_messages \
         WHERE status IN ('processed', 'failed', 'dead', 'parked', 'stale', 'discarded') \
           AND received_at >= UTC_TIMESTAMP(6) - INTERVAL ? HOUR \
         GROUP BY 1, 2, 3 \
         UNION ALL \
         SELECT consumer, CONCAT('rejected:', reason), \
           CAST(TIMESTAMPDIFF(SECOND, '1970-01-01 00:00:00', received_at) DIV 3600 AS SIGNED), \
           COUNT(*) FROM inbox_rejections WHERE received_at >= UTC_TIMESTAMP(6) - INTERVAL ? HOUR \
         GROUP BY 1, 2, 3",
    retries_due: "SELECT CONVERT(consumer USING utf8mb4), COUNT(*), \
         DATE_FORMAT(MIN(next_attempt_at), '%Y-%m-%d %H:%i:%s.%f') \
         FROM inbox_messages WHERE status = 'failed' AND next_attempt_at <= UTC_TIMESTAMP(6) \
         GROUP BY consumer",
    outbox_sent: "SELECT destination, \
         CAST(TIMESTAMPDIFF(SECOND, '1970-01-01 00:00:00', sent_at) DIV 3600 AS SIGNED), \
         COUNT(*) FROM inbox_outbox \
         WHERE status = 'sent' AND sent_at >= UTC_TIMESTAMP(6) - INTERVAL ? HOUR GROUP BY 1, 2",
};

macro_rules! impl_console_store {
    ($conn:ty, $sql:expr) => {
        impl ConsoleStore for $conn {
            fn list_rejections<'c>(
                &'c mut self,
                consumer: Option<&'c str>,
                reason: Option<RejectionReason>,
                limit: i64,
            ) -> BoxFuture<'c, Result<Vec<RejectionEntry>, sqlx::Error>> {
                Box::pin(async move {
                    let reason = reason.map(RejectionReason::as_str);
                    let rows: Vec<RejectionTuple> = sqlx::query_as($sql.list_rejections)
                        .bind(consumer)
                        .bind(consumer)
                        .bind(reason)
                        .bind(reason)
                        .bind(limit)
                        .fetch_all(&mut *self)
                        .await?;
                    rows.into_iter().map(|row| rejection(row, None)).collect()
                })
            }

            fn fetch_rejection(
                &mut self,
                id: i64,
            ) -> BoxFuture<'_, Result<Option<RejectionEntry>, sqlx::Error>> {
                Box::pin(async move {
                    let row = sqlx::query($sql.fetch_rejection)
                        .bind(id)
                        .fetch_optional(&mut *self)
                        .await?;
                    let Some(row) = row else { return Ok(None) };
                    use sqlx::Row as _;
                    let tuple: RejectionTuple = (
                        row.try_get(0)?,
                        row.try_get(1)?,
                        row.try_get(2)?,
                        row.try_get(3)?,
                        row.try_get(4)?,
                        row.try_get(5)?,
                        row.try_get(6)?,
                        row.try_get(7)?,
                        row.try_get(8)?,
                        row.try_get(9)?,
                        row.try_get(10)?,
                    );
                    let payload: Vec<u8> = row.try_get(11)?;
                    rejection(tuple, Some(payload)).map(Some)
                })
            }

            fn list_parked<'c>(
                &'c mut self,
                consumer: Option<&'c str>,
                limit: i64,
            ) -> BoxFuture<'c, Result<Vec<ParkedEntry>, sqlx::Error>> {
                Box::pin(async move {
                    let rows: Vec<(String, String, i64, String, String, i64)> =
                        sqlx::query_as($sql.list_parked)
                            .bind(consumer)
                            .bind(consumer)
                            .bind(limit)
                            .fetch_all(&mut *self)
                            .await?;
                    Ok(rows
                        .into_iter()
                        .map(
                            |(consumer, aggregate_id, sequence, message_key, received_at, last)| {
                                ParkedEntry {
                                    consumer,
                                    aggregate_id,
                                    sequence,
                                    message_key,
                                    received_at,
                                    last_sequence: last,
                                }
                            },
                        )
                        .collect())
                })
            }

            fn arrivals(
                &mut self,
                hours: i64,
            ) -> BoxFuture<'_, Result<(i64, Vec<ArrivalRow>), sqlx::Error>> {
                Box::pin(async move {
                    let (now,): (i64,) =
                        sqlx::query_as($sql.now_hour).fetch_one(&mut *self).await?;
                    let rows: Vec<(Option<String>, String, i64, i64)> =
                        sqlx::query_as($sql.arrivals)
                            .bind(hours)
                            .bind(hours)
                            .fetch_all(&mut *self)
                            .await?;
                    let rows = rows
                        .into_iter()
                        .map(arrival)
                        .collect::<Result<Vec<_>, _>>()?;
                    Ok((now, rows))
                })
            }

            fn retries_due(&mut self) -> BoxFuture<'_, Result<Vec<RetryLag>, sqlx::Error>> {
                Box::pin(async move {
                    let rows: Vec<(String, i64, String)> = sqlx::query_as($sql.retries_due)
                        .fetch_all(&mut *self)
                        .await?;
                    Ok(rows
                        .into_iter()
                        .map(|(consumer, due, oldest_due)| RetryLag {
                            consumer,
                            due,
                            oldest_due,
                        })
                        .collect())
                })
            }

            fn outbox_sent(
                &mut self,
                hours: i64,
            ) -> BoxFuture<'_, Result<Vec<SentRow>, sqlx::Error>> {
                Box::pin(async move {
                    sqlx::query_as($sql.outbox_sent)
                        .bind(hours)
                        .fetch_all(&mut *self)
                        .await
                })
            }
        }
    };
}

impl_console_store!(PgConnection, POSTGRES);
impl_console_store!(SqliteConnection, SQLITE);
impl_console_store!(MySqlConnection, MYSQL);
