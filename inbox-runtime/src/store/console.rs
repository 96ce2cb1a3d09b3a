//! The operator console's reads (see [`crate::ops::console`]): rejected deliveries with their
//! payloads, parked messages per aggregate, and arrivals per hour. Each reads through an index
//! (the `inbox_messages_console` and `inbox_rejections_console` indexes of the inbox's console
//! migration, the rejections' primary key, the aggregate state's primary key).
//!
//! [`ConsoleStore`] is written once, for every connection of a database that implements
//! [`ConsoleDialect`] (each backend's statements live in its folder: `postgres/console.rs`,
//! `sqlite/console.rs`, `mysql/console.rs`).

use super::sql::{Arg, Sql, text};
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
    /// When it was recorded (database text form: [`crate::ops::admin::utc_time`] shows it in UTC).
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

/// The console's reads. Implemented for `sqlx::PgConnection`, `sqlx::SqliteConnection` and
/// `sqlx::MySqlConnection`.
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

impl<DB> ConsoleDatabase for DB where DB: ConsoleDialect + super::OutboxDatabase {}

/// One backend's console statements; [`ConsoleStore`] is written once on top of them, for every
/// connection of a database that implements this. Parameters appear once each, in order (a
/// value used twice is bound twice), so that `$N` and `?` dialects bind alike.
pub(crate) trait ConsoleDialect: Sql {
    /// `id, consumer, key, name, reason, detail, hash, received (text), source, kept bytes,
    /// size` of rejections, newest first. Binds: consumer twice, reason twice, limit.
    const LIST_REJECTIONS: &'static str;
    /// The columns of [`LIST_REJECTIONS`](Self::LIST_REJECTIONS), then the payload, of one
    /// rejection. Binds: the id.
    const FETCH_REJECTION: &'static str = "SELECT id, consumer, message_key, message_name, \
         reason, detail, payload_hash, CAST(received_at AS TEXT), source, \
         CAST(LENGTH(payload) AS BIGINT), payload_size, payload FROM inbox_rejections WHERE id = $1";
    /// `consumer, aggregate, sequence, key, received (text), last applied sequence` of parked
    /// messages. Binds: consumer twice, limit.
    const LIST_PARKED: &'static str;
    /// The database clock's hour (hours since the epoch).
    const NOW_HOUR: &'static str;
    /// `consumer, series, hour, count` of the inbox rows and rejections of the last hours.
    /// Binds: the hours twice.
    const ARRIVALS: &'static str;
    /// `consumer, due, oldest due (text)` of failed messages whose retry is due.
    const RETRIES_DUE: &'static str;
    /// `destination, hour, count` of outbox rows sent in the last hours. Binds: the hours.
    const OUTBOX_SENT: &'static str;
}

/// The listing of rejections of the `$N` dialects, `$null` the cast an untyped `NULL` test
/// needs.
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
pub(crate) use list_rejections;

/// The listing of parked messages of the `$N` dialects, `$null` as in `list_rejections!`.
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
pub(crate) use list_parked;

/// A [`RejectionEntry`] from the columns of [`ConsoleDialect::LIST_REJECTIONS`], with the
/// payload column after them if `with_payload`.
fn rejection<D: Sql>(row: &D::Row, with_payload: bool) -> Result<RejectionEntry, sqlx::Error> {
    let reason = D::text_required(row, 4)?;
    Ok(RejectionEntry {
        id: D::i64_required(row, 0)?,
        consumer: D::text(row, 1)?,
        message_key: D::text(row, 2)?,
        message_name: D::text_required(row, 3)?,
        reason: reason
            .parse()
            .map_err(|error: String| sqlx::Error::Decode(error.into()))?,
        detail: D::text_required(row, 5)?,
        payload_hash: D::text(row, 6)?,
        received_at: D::text_required(row, 7)?,
        source: D::text(row, 8)?,
        kept_bytes: D::i64_required(row, 9)?,
        payload_size: D::i64(row, 10)?,
        payload: if with_payload {
            Some(D::required(row, 11, D::bytes)?)
        } else {
            None
        },
    })
}

/// A [`ParkedEntry`] from the columns of [`ConsoleDialect::LIST_PARKED`].
fn parked<D: Sql>(row: &D::Row) -> Result<ParkedEntry, sqlx::Error> {
    Ok(ParkedEntry {
        consumer: D::text_required(row, 0)?,
        aggregate_id: D::text_required(row, 1)?,
        sequence: D::i64_required(row, 2)?,
        message_key: D::text_required(row, 3)?,
        received_at: D::text_required(row, 4)?,
        last_sequence: D::i64_required(row, 5)?,
    })
}

/// An [`ArrivalRow`] from the columns of [`ConsoleDialect::ARRIVALS`].
fn arrival<D: Sql>(row: &D::Row) -> Result<ArrivalRow, sqlx::Error> {
    Ok(ArrivalRow {
        consumer: D::text(row, 0)?,
        series: super::types::stats_status(&D::text_required(row, 1)?)?,
        hour: D::i64_required(row, 2)?,
        count: D::i64_required(row, 3)?,
    })
}

/// A [`RetryLag`] from the columns of [`ConsoleDialect::RETRIES_DUE`].
fn retry_lag<D: Sql>(row: &D::Row) -> Result<RetryLag, sqlx::Error> {
    Ok(RetryLag {
        consumer: D::text_required(row, 0)?,
        due: D::i64_required(row, 1)?,
        oldest_due: D::text_required(row, 2)?,
    })
}

/// A [`SentRow`] from the columns of [`ConsoleDialect::OUTBOX_SENT`].
fn sent<D: Sql>(row: &D::Row) -> Result<SentRow, sqlx::Error> {
    Ok((
        D::text_required(row, 0)?,
        D::i64_required(row, 1)?,
        D::i64_required(row, 2)?,
    ))
}

/// Every connection whose database has the console's dialect.
impl<C> ConsoleStore for C
where
    C: sqlx::Connection,
    C::Database: ConsoleDialect<Connection = C>,
{
    fn list_rejections<'c>(
        &'c mut self,
        consumer: Option<&'c str>,
        reason: Option<RejectionReason>,
        limit: i64,
    ) -> BoxFuture<'c, Result<Vec<RejectionEntry>, sqlx::Error>> {
        Box::pin(async move {
            let reason = reason.map(RejectionReason::as_str);
            let args = [
                consumer.into(),
                consumer.into(),
                reason.into(),
                reason.into(),
                limit.into(),
            ];
            let sql = text(C::Database::LIST_REJECTIONS);
            let rows = C::Database::fetch_all(self, sql, &args).await?;
            rows.iter()
                .map(|row| rejection::<C::Database>(row, false))
                .collect()
        })
    }

    fn fetch_rejection(
        &mut self,
        id: i64,
    ) -> BoxFuture<'_, Result<Option<RejectionEntry>, sqlx::Error>> {
        Box::pin(async move {
            let sql = text(C::Database::FETCH_REJECTION);
            let row = C::Database::fetch_optional(self, sql, &[id.into()]).await?;
            row.map(|row| rejection::<C::Database>(&row, true))
                .transpose()
        })
    }

    fn list_parked<'c>(
        &'c mut self,
        consumer: Option<&'c str>,
        limit: i64,
    ) -> BoxFuture<'c, Result<Vec<ParkedEntry>, sqlx::Error>> {
        Box::pin(async move {
            let args = [consumer.into(), consumer.into(), limit.into()];
            let sql = text(C::Database::LIST_PARKED);
            let rows = C::Database::fetch_all(self, sql, &args).await?;
            rows.iter().map(parked::<C::Database>).collect()
        })
    }

    fn arrivals(
        &mut self,
        hours: i64,
    ) -> BoxFuture<'_, Result<(i64, Vec<ArrivalRow>), sqlx::Error>> {
        Box::pin(async move {
            let now = C::Database::fetch_one(self, text(C::Database::NOW_HOUR), &[]).await?;
            let now = C::Database::i64_required(&now, 0)?;
            let args: [Arg<'_>; 2] = [hours.into(), hours.into()];
            let sql = text(C::Database::ARRIVALS);
            let rows = C::Database::fetch_all(self, sql, &args).await?;
            let rows = rows
                .iter()
                .map(arrival::<C::Database>)
                .collect::<Result<Vec<_>, _>>()?;
            Ok((now, rows))
        })
    }

    fn retries_due(&mut self) -> BoxFuture<'_, Result<Vec<RetryLag>, sqlx::Error>> {
        Box::pin(async move {
            let sql = text(C::Database::RETRIES_DUE);
            let rows = C::Database::fetch_all(self, sql, &[]).await?;
            rows.iter().map(retry_lag::<C::Database>).collect()
        })
    }

    fn outbox_sent(&mut self, hours: i64) -> BoxFuture<'_, Result<Vec<SentRow>, sqlx::Error>> {
        Box::pin(async move {
            let sql = text(C::Database::OUTBOX_SENT);
            let rows = C::Database::fetch_all(self, sql, &[hours.into()]).await?;
            rows.iter().map(sent::<C::Database>).collect()
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::sql::{for_every_dialect, placeholders};

    fn every_statement<D: ConsoleDialect>() {
        for (sql, args) in [
            (D::LIST_REJECTIONS, 5),
            (D::FETCH_REJECTION, 1),
            (D::LIST_PARKED, 3),
            (D::NOW_HOUR, 0),
            (D::ARRIVALS, 2),
            (D::RETRIES_DUE, 0),
            (D::OUTBOX_SENT, 1),
        ] {
            assert_eq!(placeholders(sql), args, "{sql}");
        }
    }

    /// Every dialect's statements take the arguments the console binds.
    #[test]
    fn every_dialect_takes_what_the_console_binds() {
        for_every_dialect!(every_statement);
    }
}
