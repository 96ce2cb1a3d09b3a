//! Ordering ([`OrderingStore`](crate::store::OrderingStore)) and operators' statements
//! ([`AdminStore`](crate::store::AdminStore)), written once over [`InboxDialect`].

use sqlx::QueryBuilder;

use super::{
    InboxDialect, Param, Write, attempts_at, hash_at, key_values, null_column, required, status_at,
};
use crate::store::retry::{Retry, with_retries};
use crate::store::sql::{Arg, text};
use crate::store::types::stats_status;
use crate::store::{MessageMark, ParkedMessage, PurgeClock, StatsRow, StoredMessage};
use crate::types::status::Status;

/// An aggregate's values.
fn aggregate_values<'a>(consumer: &'a str, aggregate_id: &'a str) -> [(Param, Arg<'a>); 2] {
    [
        (Param::Consumer, consumer.into()),
        (Param::Aggregate, aggregate_id.into()),
    ]
}

/// See [`OrderingStore::lock_aggregate`](crate::store::OrderingStore::lock_aggregate).
pub(super) async fn lock_aggregate<D: InboxDialect>(
    conn: &mut D::Connection,
    consumer: &str,
    aggregate_id: &str,
) -> Result<i64, sqlx::Error> {
    let values = aggregate_values(consumer, aggregate_id);
    let row = match D::LOCK_AGGREGATE {
        Write::Returning(stmt) => stmt.run(conn, &values, D::fetch_optional).await?,
        Write::ReadBack { write, read } | Write::Stamped { write, read } => {
            super::claim::written::<D>(conn, [&write, &read], &values, false).await?
        }
    };
    let row = row.ok_or(sqlx::Error::RowNotFound)?;
    required(D::i64(&row, 0)?, 0)
}

/// See [`OrderingStore::advance_aggregate`](crate::store::OrderingStore::advance_aggregate).
pub(super) async fn advance_aggregate<D: InboxDialect>(
    conn: &mut D::Connection,
    consumer: &str,
    aggregate_id: &str,
    sequence: i64,
) -> Result<(), sqlx::Error> {
    let [consumer, aggregate] = aggregate_values(consumer, aggregate_id);
    let values = [consumer, aggregate, (Param::Sequence, sequence.into())];
    D::ADVANCE_AGGREGATE.run(conn, &values, D::execute).await?;
    Ok(())
}

/// See [`OrderingStore::mark_message`](crate::store::OrderingStore::mark_message).
pub(super) async fn mark_message<D: InboxDialect>(
    conn: &mut D::Connection,
    mark: &MessageMark<'_>,
) -> Result<(), sqlx::Error> {
    let [consumer, key] = key_values(mark.consumer, mark.message_key);
    let values = [
        consumer,
        key,
        (Param::NewStatus, mark.status.as_str().into()),
        (Param::Aggregate, mark.ordering.aggregate_id.as_str().into()),
        (Param::Sequence, mark.ordering.sequence.into()),
        (Param::Payload, mark.payload.into()),
    ];
    D::MARK_MESSAGE.run(conn, &values, D::execute).await?;
    Ok(())
}

/// A row of `consumer, message_key, message_name, aggregate_id, sequence`.
fn parked<D: InboxDialect>(row: &D::Row) -> Result<ParkedMessage, sqlx::Error> {
    Ok(ParkedMessage {
        consumer: D::text_required(row, 0)?,
        message_key: D::text_required(row, 1)?,
        message_name: D::text_required(row, 2)?,
        aggregate_id: D::text_required(row, 3)?,
        sequence: D::i64_required(row, 4)?,
    })
}

/// See [`OrderingStore::find_parked`](crate::store::OrderingStore::find_parked).
pub(super) async fn find_parked<D: InboxDialect>(
    conn: &mut D::Connection,
    consumer: &str,
    aggregate_id: &str,
    sequence: i64,
) -> Result<Option<ParkedMessage>, sqlx::Error> {
    let [consumer, aggregate] = aggregate_values(consumer, aggregate_id);
    let values = [consumer, aggregate, (Param::Sequence, sequence.into())];
    let row = D::FIND_PARKED.run(conn, &values, D::fetch_optional).await?;
    row.as_ref().map(parked::<D>).transpose()
}

/// See [`OrderingStore::expired_parked`](crate::store::OrderingStore::expired_parked).
pub(super) async fn expired_parked<D: InboxDialect>(
    conn: &mut D::Connection,
    older_than_secs: f64,
    limit: i64,
) -> Result<Vec<ParkedMessage>, sqlx::Error> {
    let values = window_limit(older_than_secs, limit);
    let rows = D::EXPIRED_PARKED.run(conn, &values, D::fetch_all).await?;
    rows.iter().map(parked::<D>).collect()
}

/// A window in seconds and a row limit.
fn window_limit<'a>(older_than_secs: f64, limit: i64) -> [(Param, Arg<'a>); 2] {
    [
        (Param::Window, older_than_secs.into()),
        (Param::Limit, limit.into()),
    ]
}

/// See [`OrderingStore::dead_letter_parked`](crate::store::OrderingStore::dead_letter_parked).
pub(super) async fn dead_letter_parked<D: InboxDialect>(
    conn: &mut D::Connection,
    consumer: &str,
    key: &str,
    reason: &str,
) -> Result<bool, sqlx::Error> {
    let [consumer, key] = key_values(consumer, key);
    let values = [consumer, key, (Param::Reason, reason.into())];
    Ok(D::DEAD_LETTER_PARKED.run(conn, &values, D::execute).await? > 0)
}

/// A row of [`InboxDialect::MESSAGE_COLUMNS`].
fn stored_message<D: InboxDialect>(row: &D::Row) -> Result<StoredMessage, sqlx::Error> {
    Ok(StoredMessage {
        consumer: D::text_required(row, 0)?,
        message_key: D::text_required(row, 1)?,
        message_name: D::text_required(row, 2)?,
        status: status_at::<D>(row, 3)?,
        attempts: attempts_at::<D>(row, 4)?,
        last_error: D::text(row, 5)?,
        payload_hash: hash_at::<D>(row, 6)?,
        payload: D::bytes(row, 7)?,
        received_at: D::text_required(row, 8)?,
        processed_at: D::text(row, 9)?,
        next_attempt_at: D::text(row, 10)?,
        source: D::text(row, 11)?,
        aggregate_id: D::text(row, 12)?,
        sequence: D::i64(row, 13)?,
        result: D::bytes(row, 14)?,
    })
}

/// See [`AdminStore::fetch_message`](crate::store::AdminStore::fetch_message).
pub(super) async fn fetch_message<D: InboxDialect>(
    conn: &mut D::Connection,
    consumer: &str,
    key: &str,
) -> Result<Option<StoredMessage>, sqlx::Error> {
    let values = key_values(consumer, key);
    let row = D::FETCH.run(conn, &values, D::fetch_optional).await?;
    row.as_ref().map(stored_message::<D>).transpose()
}

/// See [`AdminStore::list_messages`](crate::store::AdminStore::list_messages).
pub(super) async fn list_messages<D: InboxDialect>(
    conn: &mut D::Connection,
    consumer: Option<&str>,
    statuses: &[Status],
    limit: i64,
) -> Result<Vec<StoredMessage>, sqlx::Error> {
    if statuses.is_empty() {
        return Ok(Vec::new());
    }
    let mut query = QueryBuilder::<D>::new("SELECT ");
    query
        .push(D::MESSAGE_COLUMNS)
        .push(" FROM inbox_messages WHERE (");
    D::push_arg(&mut query, consumer.into());
    query.push(" IS NULL OR consumer = ");
    D::push_arg(&mut query, consumer.into());
    query.push(") AND status IN (");
    for (n, status) in statuses.iter().enumerate() {
        if n > 0 {
            query.push(", ");
        }
        D::push_arg(&mut query, status.as_str().into());
    }
    query.push(") ORDER BY received_at, consumer, message_key LIMIT ");
    D::push_arg(&mut query, limit.into());
    let rows = D::fetch_all_built(conn, &mut query).await?;
    rows.iter().map(stored_message::<D>).collect()
}

/// See [`AdminStore::discard_message`](crate::store::AdminStore::discard_message).
pub(super) async fn discard_message<D: InboxDialect>(
    conn: &mut D::Connection,
    consumer: &str,
    key: &str,
) -> Result<bool, sqlx::Error> {
    let values = key_values(consumer, key);
    Ok(D::DISCARD.run(conn, &values, D::execute).await? > 0)
}

/// Rows of `consumer, status (or rejected:<reason>), count, oldest`.
fn stats_rows<D: InboxDialect>(rows: &[D::Row]) -> Result<Vec<StatsRow>, sqlx::Error> {
    rows.iter()
        .map(|row| {
            Ok(StatsRow {
                consumer: D::text(row, 0)?,
                status: D::str_with(row, 1, |text| text.map(stats_status))?
                    .ok_or_else(|| null_column(1))??,
                count: D::i64_required(row, 2)?,
                oldest: D::text(row, 3)?,
            })
        })
        .collect()
}

/// See [`AdminStore::stats`](crate::store::AdminStore::stats).
pub(super) async fn stats<D: InboxDialect>(
    conn: &mut D::Connection,
) -> Result<Vec<StatsRow>, sqlx::Error> {
    let rows = D::fetch_all(conn, text(D::STATS), &[]).await?;
    stats_rows::<D>(&rows)
}

/// A list of statuses as five values (`NULL` past its end).
fn listed(statuses: &[Status]) -> [(Param, Arg<'static>); 5] {
    let params = [
        Param::Status1,
        Param::Status2,
        Param::Status3,
        Param::Status4,
        Param::Status5,
    ];
    let mut values = params.map(|param| (param, Arg::Text(None)));
    for ((_, value), status) in values.iter_mut().zip(statuses) {
        *value = Arg::from(status.as_str());
    }
    values
}

/// See [`AdminStore::purge_batch`](crate::store::AdminStore::purge_batch): retried after a lock
/// error.
pub(super) async fn purge_batch<D: InboxDialect>(
    conn: &mut D::Connection,
    statuses: &[Status],
    older_than_secs: f64,
    batch: i64,
) -> Result<u64, sqlx::Error> {
    let [first, second, third, ..] = listed(statuses);
    let [window, limit] = window_limit(older_than_secs, batch);
    let values = [first, second, third, window, limit];
    purge::<D, 5>(conn, "purge", &(D::PURGE, values)).await
}

/// See [`AdminStore::purge_rejections_batch`](crate::store::AdminStore::purge_rejections_batch):
/// retried after a lock error.
pub(super) async fn purge_rejections_batch<D: InboxDialect>(
    conn: &mut D::Connection,
    older_than_secs: f64,
    batch: i64,
) -> Result<u64, sqlx::Error> {
    let values = window_limit(older_than_secs, batch);
    purge::<D, 2>(conn, "purge_rejections", &(D::PURGE_REJECTIONS, values)).await
}

/// One purge statement, in autocommit, retried after a lock error.
async fn purge<D: InboxDialect, const N: usize>(
    conn: &mut D::Connection,
    operation: &'static str,
    statement: &(super::Stmt, [(Param, Arg<'_>); N]),
) -> Result<u64, sqlx::Error> {
    with_retries::<D, _, _>(
        conn,
        Retry::autocommit(operation),
        statement,
        |conn, (stmt, values)| Box::pin(stmt.run(conn, values, D::execute)),
    )
    .await
}

/// See [`AdminStore::purge_clock`](crate::store::AdminStore::purge_clock).
pub(super) async fn purge_clock<D: InboxDialect>(
    conn: &mut D::Connection,
    older_than_secs: f64,
) -> Result<PurgeClock, sqlx::Error> {
    let values = [(Param::Window, older_than_secs.into())];
    let row = D::PURGE_CLOCK.run(conn, &values, D::fetch_one).await?;
    Ok(PurgeClock {
        now: D::text_required(&row, 0)?,
        cutoff: D::text_required(&row, 1)?,
        newest: D::text(&row, 2)?,
        newest_ahead_secs: D::f64(&row, 3)?,
    })
}

/// See [`AdminStore::purge_preview`](crate::store::AdminStore::purge_preview).
pub(super) async fn purge_preview<D: InboxDialect>(
    conn: &mut D::Connection,
    statuses: &[Status],
    older_than_secs: f64,
    rejections: bool,
) -> Result<Vec<StatsRow>, sqlx::Error> {
    let [s0, s1, s2, s3, s4] = listed(statuses);
    let values = [
        s0,
        s1,
        s2,
        s3,
        s4,
        (Param::Window, older_than_secs.into()),
        (Param::Rejections, rejections.into()),
    ];
    let rows = D::PURGE_PREVIEW.run(conn, &values, D::fetch_all).await?;
    stats_rows::<D>(&rows)
}
