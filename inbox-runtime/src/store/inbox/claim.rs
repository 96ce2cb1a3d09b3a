//! The claim protocol's statements ([`ClaimStore`](crate::store::ClaimStore)), written once over
//! [`InboxDialect`].

use sqlx::{Connection as _, QueryBuilder};

use super::{
    BatchClaim, ClaimShape, HashParam, InboxDialect, Item, Param, Stmt, Write, attempts_at,
    existing_at, key_values, push_key_tuples, push_row, push_template, source_args, standard,
    status_at, token,
};
use crate::store::retry::{Retry, with_retries};
use crate::store::sql::Arg;
use crate::store::{ClaimRequest, ClaimResult, ExistingRow, FailureRecord, Rejection};
use crate::types::status::Status;

/// The claim, retried after a lock error (see [`Retry`]) as the first statement of the claim's
/// own transaction. With `no_wait`, a lock wait timeout is the caller's.
pub(crate) async fn claim<D: InboxDialect>(
    conn: &mut D::Connection,
    request: &ClaimRequest<'_>,
    no_wait: bool,
) -> Result<ClaimResult, sqlx::Error> {
    let retry = Retry::claim_transaction("claim", no_wait);
    with_retries::<D, _, _>(conn, retry, request, |conn, request| {
        Box::pin(claim_once::<D>(conn, request))
    })
    .await
}

async fn claim_once<D: InboxDialect>(
    conn: &mut D::Connection,
    request: &ClaimRequest<'_>,
) -> Result<ClaimResult, sqlx::Error> {
    match D::CLAIM {
        ClaimShape::Returning(stmt) => claim_returning::<D>(conn, request, &stmt).await,
        ClaimShape::Stamped {
            upsert,
            read,
            remember,
        } => claim_stamped::<D>(conn, request, [&upsert, &read, &remember]).await,
    }
}

/// A claim's values.
fn claim_values<'a>(
    request: &ClaimRequest<'a>,
    hash: Arg<'a>,
    token: Option<&'a [u8]>,
) -> [(Param, Arg<'a>); 9] {
    let [source, partition, offset] = source_args(request.source);
    [
        (Param::Consumer, request.consumer.into()),
        (Param::Key, request.message_key.into()),
        (Param::Name, request.message_name.into()),
        (Param::Hash, hash),
        source,
        partition,
        offset,
        (Param::Mode, request.mode.as_str().into()),
        (Param::Token, token.into()),
    ]
}

/// [`ClaimShape::Returning`].
async fn claim_returning<D: InboxDialect>(
    conn: &mut D::Connection,
    request: &ClaimRequest<'_>,
    stmt: &Stmt,
) -> Result<ClaimResult, sqlx::Error> {
    let hash = HashParam::new::<D>(request.payload_hash);
    let values = claim_values(request, hash.arg(), None);
    // A key deleted by a retention purge between the claim and the read is claimed again;
    // three rounds are more than such a race can take.
    for _ in 0..3 {
        let row = stmt.run(conn, &values, D::fetch_optional).await?;
        let mut found = row.as_ref().map(returned::<D>).transpose()?;
        if let Some(ClaimResult::Claimed { .. }) = found {
            return Ok(found.expect("checked"));
        }
        // The claim statement's snapshot predates any wait on a concurrent claim of the key:
        // it may miss a row committed meanwhile, or show one that a concurrent transaction has
        // taken over since (a row the claim itself would have taken, had it still been so).
        // Read it anew.
        if found
            .as_ref()
            .is_none_or(|existing| claimable(existing, request))
        {
            found = existing::<D>(conn, request.consumer, request.message_key).await?;
        }
        match found {
            // Deleted by a purge, or released by a rolled-back concurrent attempt: claim again.
            None => continue,
            Some(ref existing) if claimable(existing, request) => continue,
            Some(existing) => return Ok(existing),
        }
    }
    // Transient (see `Classify for sqlx::Error`): retried by the caller.
    Err(sqlx::Error::Protocol(
        "inbox claim: key neither claimable nor settled after 3 rounds".into(),
    ))
}

/// A row of [`ClaimShape::Returning`]'s statement.
fn returned<D: InboxDialect>(row: &D::Row) -> Result<ClaimResult, sqlx::Error> {
    if D::str_with(row, 0, |status| status == Some("claimed"))? {
        return Ok(ClaimResult::Claimed {
            attempts: attempts_at::<D>(row, 2)?,
        });
    }
    existing_at::<D>(row, 0)
}

/// Whether the claim statement would have taken this row (see
/// [`ClaimMode::takes_over`](crate::types::ClaimMode::takes_over)): seeing one after the claim means
/// it changed since.
fn claimable(existing: &ClaimResult, request: &ClaimRequest<'_>) -> bool {
    match existing {
        ClaimResult::Claimed { .. } => false,
        ClaimResult::Existing {
            status,
            payload_hash,
            retry_in,
            ..
        } => {
            payload_hash == request.payload_hash && request.mode.takes_over_now(*status, *retry_in)
        }
    }
}

/// [`ClaimShape::Stamped`]: the upsert, the locking read, and the token kept if claimed.
async fn claim_stamped<D: InboxDialect>(
    conn: &mut D::Connection,
    request: &ClaimRequest<'_>,
    [upsert, read, remember]: [&Stmt; 3],
) -> Result<ClaimResult, sqlx::Error> {
    let token = token();
    let hash = HashParam::new::<D>(request.payload_hash);
    let values = claim_values(request, hash.arg(), Some(&token));
    upsert.run(conn, &values, D::execute).await?;
    let Some(row) = read.run(conn, &values, D::fetch_optional).await? else {
        // The upsert holds the row's lock until the transaction ends: never missing.
        return Err(sqlx::Error::Protocol(
            "inbox claim: the claimed row is missing after the upsert".into(),
        ));
    };
    let attempts = attempts_at::<D>(&row, 2)?;
    if D::i64(&row, 3)? == Some(1) {
        remember.run(conn, &values, D::execute).await?;
        return Ok(ClaimResult::Claimed { attempts });
    }
    Ok(ClaimResult::Existing {
        status: status_at::<D>(&row, 0)?,
        payload_hash: super::hash_at::<D>(&row, 1)?,
        attempts,
        retry_in: super::retry_in(D::i64(&row, 4)?),
    })
}

/// See [`ClaimStore::verify_claim`](crate::store::ClaimStore::verify_claim).
pub(super) async fn verify<D: InboxDialect>(
    conn: &mut D::Connection,
    consumer: &str,
    key: &str,
) -> Result<(), sqlx::Error> {
    let Some(stmt) = D::VERIFY_CLAIM else {
        return Ok(());
    };
    let values = key_values(consumer, key);
    match stmt.run(conn, &values, D::fetch_optional).await? {
        Some(_) => Ok(()),
        None => Err(sqlx::Error::Database(Box::new(ClaimGone(D::CLAIM_GONE)))),
    }
}

/// What [`verify`] returns when the transaction no longer holds its claim (the handler ended it
/// with a raw `ROLLBACK`, or InnoDB rolled it back on a deadlock the handler swallowed): an
/// error the database's answer implies, with no SQLSTATE. Not `sqlx::Error::Protocol`, which
/// reads as a lost connection: the connection is fine, and the attempt is a failure to record
/// ([`ErrorClass::Retryable`](crate::ErrorClass::Retryable)), not a delivery whose commit is
/// unknown.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
struct ClaimGone(&'static str);

impl sqlx::error::DatabaseError for ClaimGone {
    fn message(&self) -> &str {
        self.0
    }

    fn as_error(&self) -> &(dyn std::error::Error + Send + Sync + 'static) {
        self
    }

    fn as_error_mut(&mut self) -> &mut (dyn std::error::Error + Send + Sync + 'static) {
        self
    }

    fn into_error(self: Box<Self>) -> Box<dyn std::error::Error + Send + Sync + 'static> {
        self
    }

    fn kind(&self) -> sqlx::error::ErrorKind {
        sqlx::error::ErrorKind::Other
    }
}

/// See [`ClaimStore::existing`](crate::store::ClaimStore::existing).
pub(super) async fn existing<D: InboxDialect>(
    conn: &mut D::Connection,
    consumer: &str,
    key: &str,
) -> Result<Option<ClaimResult>, sqlx::Error> {
    let row = D::EXISTING
        .run(conn, &key_values(consumer, key), D::fetch_optional)
        .await?;
    row.as_ref().map(|row| existing_at::<D>(row, 0)).transpose()
}

/// A failure's values.
fn failure_values<'a>(
    r: &FailureRecord<'a>,
    hash: Arg<'a>,
    token: Option<&'a [u8]>,
) -> [(Param, Arg<'a>); 16] {
    let [source, partition, offset] = source_args(r.source);
    [
        (Param::Consumer, r.consumer.into()),
        (Param::Key, r.message_key.into()),
        (Param::Name, r.message_name.into()),
        (Param::Hash, hash),
        (Param::Permanent, r.permanent.into()),
        (
            Param::MaxTries,
            i32::try_from(r.max_attempts).unwrap_or(i32::MAX).into(),
        ),
        (Param::LastError, r.last_error.into()),
        (Param::DelayMs, r.retry_delay_ms.into()),
        (Param::DelayUs, r.retry_delay_ms.saturating_mul(1000).into()),
        (Param::Payload, r.payload.into()),
        source,
        partition,
        offset,
        (Param::Aggregate, r.aggregate_id.into()),
        (Param::Sequence, r.sequence.into()),
        (Param::Token, token.into()),
    ]
}

/// See [`ClaimStore::record_failure`](crate::store::ClaimStore::record_failure): in autocommit (or
/// a transaction of its own), retried after a lock error.
pub(super) async fn record_failure<D: InboxDialect>(
    conn: &mut D::Connection,
    record: &FailureRecord<'_>,
) -> Result<Option<(Status, u32)>, sqlx::Error> {
    let retry = Retry::autocommit("record_failure");
    with_retries::<D, _, _>(conn, retry, record, |conn, record| {
        Box::pin(record_failure_once::<D>(conn, record))
    })
    .await
}

async fn record_failure_once<D: InboxDialect>(
    conn: &mut D::Connection,
    r: &FailureRecord<'_>,
) -> Result<Option<(Status, u32)>, sqlx::Error> {
    let hash = HashParam::new::<D>(r.payload_hash);
    let token = matches!(D::RECORD_FAILURE, Write::Stamped { .. }).then(token);
    let values = failure_values(r, hash.arg(), token.as_ref().map(|token| &token[..]));
    let row = match D::RECORD_FAILURE {
        Write::Returning(stmt) => stmt.run(conn, &values, D::fetch_optional).await?,
        Write::ReadBack { write, read } => {
            written::<D>(conn, [&write, &read], &values, true).await?
        }
        Write::Stamped { write, read } => {
            let mut tx = conn.begin().await?;
            write.run(&mut *tx, &values, D::execute).await?;
            let row = read.run(&mut *tx, &values, D::fetch_optional).await?;
            tx.commit().await?;
            match row {
                Some(row) if D::i64(&row, 2)? == Some(1) => Some(row),
                _ => None,
            }
        }
    };
    row.as_ref().map(status_attempts::<D>).transpose()
}

/// The columns `status, attempts` of a row a write reported.
fn status_attempts<D: InboxDialect>(row: &D::Row) -> Result<(Status, u32), sqlx::Error> {
    Ok((status_at::<D>(row, 0)?, attempts_at::<D>(row, 1)?))
}

/// [`Write::ReadBack`]: the write, then the read (none if `stop_if_none` and the write matched
/// no row).
pub(super) async fn written<D: InboxDialect>(
    conn: &mut D::Connection,
    [write, read]: [&Stmt; 2],
    values: &[(Param, Arg<'_>)],
    stop_if_none: bool,
) -> Result<Option<D::Row>, sqlx::Error> {
    let matched = write.run(conn, values, D::execute).await?;
    if stop_if_none && matched == 0 {
        return Ok(None);
    }
    read.run(conn, values, D::fetch_optional).await
}

/// See [`ClaimStore::record_rejection`](crate::store::ClaimStore::record_rejection).
pub(super) async fn record_rejection<D: InboxDialect>(
    conn: &mut D::Connection,
    r: &Rejection<'_>,
) -> Result<(), sqlx::Error> {
    let [source, partition, offset] = source_args(r.source);
    let values = [
        (Param::Consumer, r.consumer.into()),
        (Param::Key, r.message_key.into()),
        (Param::Name, r.message_name.into()),
        (Param::Reason, r.reason.as_str().into()),
        (Param::Detail, r.detail.into()),
        (Param::Hash, r.payload_hash.into()),
        (Param::Payload, r.payload.into()),
        source,
        partition,
        offset,
        (Param::PayloadSize, r.payload_size.into()),
    ];
    D::RECORD_REJECTION.run(conn, &values, D::execute).await?;
    Ok(())
}

/// See [`ClaimStore::claim_batch`](crate::store::ClaimStore::claim_batch): retried like the claim
/// when it is the first statement of the batch's transaction.
pub(super) async fn claim_batch<D: InboxDialect>(
    conn: &mut D::Connection,
    requests: &[ClaimRequest<'_>],
) -> Result<Vec<Option<u32>>, sqlx::Error> {
    let retry = Retry::claim_transaction("claim_batch", false);
    with_retries::<D, _, _>(conn, retry, requests, |conn, requests| {
        Box::pin(claim_batch_once::<D>(conn, requests))
    })
    .await
}

async fn claim_batch_once<D: InboxDialect>(
    conn: &mut D::Connection,
    requests: &[ClaimRequest<'_>],
) -> Result<Vec<Option<u32>>, sqlx::Error> {
    let mut claimed = vec![None; requests.len()];
    if requests.is_empty() {
        return Ok(claimed);
    }
    let token = matches!(D::BATCH, BatchClaim::Stamped { .. }).then(token);
    let token = token.as_ref().map(|token| &token[..]);
    let hashes: Vec<HashParam<'_>> = requests
        .iter()
        .map(|request| HashParam::new::<D>(request.payload_hash))
        .collect();
    let mut query = QueryBuilder::<D>::new(D::BATCH_INSERT);
    query.push("VALUES ");
    for (n, (request, hash)) in requests.iter().zip(&hashes).enumerate() {
        if n > 0 {
            query.push(", ");
        }
        push_batch_row::<D>(&mut query, request, hash.arg(), token);
    }
    let rows = match D::BATCH {
        BatchClaim::Returning {
            takeover_processed_at,
            takeover,
        } => {
            let [head, middle, tail] = standard::BATCH_CONFLICT;
            query
                .push(head)
                .push(takeover_processed_at)
                .push(middle)
                .push(takeover)
                .push(tail)
                .push(D::BATCH_CLAIM_MARK);
            D::fetch_all_built(conn, &mut query).await?
        }
        BatchClaim::Stamped {
            update,
            read,
            remember,
        } => {
            let values = [(Param::Token, Arg::from(token))];
            push_template(&mut query, &update, &values)?;
            D::execute_built(conn, &mut query).await?;
            let mut read = QueryBuilder::<D>::new(read);
            D::push_arg(&mut read, token.into());
            read.push(" AND (consumer, message_key) IN ");
            push_key_tuples(
                &mut read,
                requests.iter().map(|r| (r.consumer, r.message_key)),
            );
            let rows = D::fetch_all_built(conn, &mut read).await?;
            // For `verify_claim`, as after a single claim.
            remember.run(conn, &values, D::execute).await?;
            rows
        }
    };
    let index = crate::store::request_index(requests);
    for row in &rows {
        let consumer = super::required(D::text(row, 0)?, 0)?;
        let key = super::required(D::text(row, 1)?, 1)?;
        if let Some(&at) = index.get(&(consumer.as_str(), key.as_str())) {
            claimed[at] = Some(attempts_at::<D>(row, 2)?);
        }
    }
    Ok(claimed)
}

/// One row of the batch claim's `VALUES`.
fn push_batch_row<D: InboxDialect>(
    query: &mut QueryBuilder<D>,
    request: &ClaimRequest<'_>,
    hash: Arg<'_>,
    token: Option<&[u8]>,
) {
    let (source, partition, offset) = crate::store::source_parts(request.source);
    let row = [
        Item::Arg(request.consumer.into()),
        Item::Arg(request.message_key.into()),
        Item::Arg(request.message_name.into()),
        Item::Arg(hash),
        Item::Sql("'processed'"),
        Item::Sql("1"),
        Item::Sql(D::BATCH_NOW),
        Item::Sql(D::BATCH_CLAIMED_PROCESSED_AT),
        Item::Arg(source.into()),
        Item::Arg(partition.into()),
        Item::Arg(offset.into()),
        Item::Arg(token.into()),
    ];
    let len = if token.is_some() { 12 } else { 11 };
    push_row(query, &row[..len]);
}

/// See [`ClaimStore::existing_batch`](crate::store::ClaimStore::existing_batch).
pub(super) async fn existing_batch<D: InboxDialect>(
    conn: &mut D::Connection,
    keys: &[(&str, &str)],
) -> Result<Vec<ExistingRow>, sqlx::Error> {
    if keys.is_empty() {
        return Ok(Vec::new());
    }
    let mut query = QueryBuilder::<D>::new(D::EXISTING_BATCH);
    push_key_tuples(&mut query, keys.iter().copied());
    let rows = D::fetch_all_built(conn, &mut query).await?;
    rows.iter()
        .map(|row| {
            Ok((
                super::required(D::text(row, 0)?, 0)?,
                super::required(D::text(row, 1)?, 1)?,
                existing_at::<D>(row, 2)?,
            ))
        })
        .collect()
}

/// See [`ClaimStore::unclaim`](crate::store::ClaimStore::unclaim).
pub(super) async fn unclaim<D: InboxDialect>(
    conn: &mut D::Connection,
    consumer: &str,
    key: &str,
    payload: &[u8],
) -> Result<(), sqlx::Error> {
    let [consumer, key] = key_values(consumer, key);
    let values = [consumer, key, (Param::Payload, payload.into())];
    D::UNCLAIM_FRESH.run(conn, &values, D::execute).await?;
    D::UNCLAIM_TAKEN_OVER.run(conn, &values, D::execute).await?;
    Ok(())
}

/// See [`ClaimStore::fail_claimed`](crate::store::ClaimStore::fail_claimed).
pub(super) async fn fail_claimed<D: InboxDialect>(
    conn: &mut D::Connection,
    r: &FailureRecord<'_>,
) -> Result<Option<(Status, u32)>, sqlx::Error> {
    let hash = HashParam::new::<D>(r.payload_hash);
    let values = failure_values(r, hash.arg(), None);
    let row = match D::FAIL_CLAIMED {
        Write::Returning(stmt) => stmt.run(conn, &values, D::fetch_optional).await?,
        Write::ReadBack { write, read } | Write::Stamped { write, read } => {
            written::<D>(conn, [&write, &read], &values, true).await?
        }
    };
    row.as_ref().map(status_attempts::<D>).transpose()
}

/// See [`ClaimStore::store_result`](crate::store::ClaimStore::store_result).
pub(super) async fn store_result<D: InboxDialect>(
    conn: &mut D::Connection,
    consumer: &str,
    key: &str,
    result: &[u8],
) -> Result<(), sqlx::Error> {
    let [consumer, key] = key_values(consumer, key);
    let values = [consumer, key, (Param::ResultBytes, result.into())];
    D::STORE_RESULT.run(conn, &values, D::execute).await?;
    Ok(())
}

/// See [`ClaimStore::fetch_result`](crate::store::ClaimStore::fetch_result).
pub(super) async fn fetch_result<D: InboxDialect>(
    conn: &mut D::Connection,
    consumer: &str,
    key: &str,
) -> Result<Option<Vec<u8>>, sqlx::Error> {
    let row = D::FETCH_RESULT
        .run(conn, &key_values(consumer, key), D::fetch_optional)
        .await?;
    Ok(match row {
        Some(row) => D::bytes(&row, 0)?,
        None => None,
    })
}
