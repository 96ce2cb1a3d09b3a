//! What both backends share: request/record types, statements with one text for both, and the
//! Rust side of every store operation (`impl_inbox_connection!`).

use crate::envelope::SourceMetadata;
use crate::status::{ClaimMode, Status};

/// What one claim asks the inbox for (see [`ClaimStore::claim`](super::ClaimStore::claim)).
#[derive(Debug, Clone, Copy)]
pub struct ClaimRequest<'a> {
    /// The consumer (inbox scope).
    pub consumer: &'a str,
    /// The idempotency key.
    pub message_key: &'a str,
    /// The message's routing name (stored with the key).
    pub message_name: &'a str,
    /// The delivery's fingerprint, lower-case hex SHA-256 (64 characters).
    pub payload_hash: &'a str,
    /// Where the delivery came from, stored with the key.
    pub source: Option<&'a SourceMetadata>,
    /// Which existing rows the claim may take over.
    pub mode: ClaimMode,
}

/// What the claim statement found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ClaimResult {
    /// The key is now held by this transaction.
    Claimed {
        /// Attempts for the key, this one included (1 for a free key).
        attempts: u32,
    },
    /// A row for the key exists and was not taken.
    Existing {
        /// Its status.
        status: Status,
        /// Its stored fingerprint (hex).
        payload_hash: String,
        /// Its attempts so far.
        attempts: u32,
        /// For a `failed` row whose next attempt is not due yet: how long until it is (database
        /// clock); `None` otherwise.
        retry_in: Option<std::time::Duration>,
    },
}

/// A failed attempt to record (see [`ClaimStore::record_failure`](super::ClaimStore::record_failure)).
#[derive(Debug, Clone, Copy)]
pub struct FailureRecord<'a> {
    /// The consumer.
    pub consumer: &'a str,
    /// The idempotency key.
    pub message_key: &'a str,
    /// The message's routing name.
    pub message_name: &'a str,
    /// The delivery's fingerprint (hex); a row with another fingerprint is left alone.
    pub payload_hash: &'a str,
    /// `dead` at once (a permanent error).
    pub permanent: bool,
    /// `dead` once the attempts reach this many.
    pub max_attempts: u32,
    /// The error text to keep, already bounded.
    pub last_error: &'a str,
    /// The delay before the next attempt, in milliseconds, added to the database clock.
    pub retry_delay_ms: i64,
    /// The payload to keep for the retry or a replay.
    pub payload: &'a [u8],
    /// Where the delivery came from.
    pub source: Option<&'a SourceMetadata>,
    /// The aggregate of an ordered message.
    pub aggregate_id: Option<&'a str>,
    /// Its sequence.
    pub sequence: Option<i64>,
}

/// A parked (or failed) message of an aggregate, found by sequence.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ParkedMessage {
    /// The consumer.
    pub consumer: String,
    /// The idempotency key.
    pub message_key: String,
    /// The routing name.
    pub message_name: String,
    /// The aggregate.
    pub aggregate_id: String,
    /// The message's sequence in it.
    pub sequence: i64,
}

/// Why a delivery was rejected.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[non_exhaustive]
pub enum RejectionReason {
    /// Same idempotency key as a processed message, different payload.
    Conflict,
    /// The payload could not be decoded as the message type.
    Malformed,
    /// No handler is registered for the message name.
    UnknownMessage,
    /// The message's idempotency key is null (an `Option` key field), empty, blank, too long
    /// or invalid. (A missing or null key field of another type fails to decode: `Malformed`.)
    InvalidKey,
    /// The payload is over the dispatcher's size limit (kept cut to the limit).
    TooLarge,
}

impl RejectionReason {
    /// The stored name: `conflict`, `malformed`, `unknown_message`, `invalid_key`, `too_large`.
    pub fn as_str(self) -> &'static str {
        match self {
            RejectionReason::Conflict => "conflict",
            RejectionReason::Malformed => "malformed",
            RejectionReason::UnknownMessage => "unknown_message",
            RejectionReason::InvalidKey => "invalid_key",
            RejectionReason::TooLarge => "too_large",
        }
    }
}

impl std::str::FromStr for RejectionReason {
    type Err = String;

    /// Parses the stored name.
    fn from_str(text: &str) -> Result<Self, Self::Err> {
        [
            RejectionReason::Conflict,
            RejectionReason::Malformed,
            RejectionReason::UnknownMessage,
            RejectionReason::InvalidKey,
            RejectionReason::TooLarge,
        ]
        .into_iter()
        .find(|reason| reason.as_str() == text)
        .ok_or_else(|| format!("unknown rejection reason `{text}`"))
    }
}

/// What one [`StatsRow`] counts: inbox rows in one status, or rejected deliveries for one
/// reason.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum StatsStatus {
    /// Rows of `inbox_messages` in this status.
    Message(Status),
    /// Rows of `inbox_rejections` with this reason.
    Rejected(RejectionReason),
}

impl StatsStatus {
    /// The text form: the status (`processed`, …), or `rejected:<reason>`.
    pub fn as_str(self) -> &'static str {
        match self {
            StatsStatus::Message(status) => status.as_str(),
            StatsStatus::Rejected(RejectionReason::Conflict) => "rejected:conflict",
            StatsStatus::Rejected(RejectionReason::Malformed) => "rejected:malformed",
            StatsStatus::Rejected(RejectionReason::UnknownMessage) => "rejected:unknown_message",
            StatsStatus::Rejected(RejectionReason::InvalidKey) => "rejected:invalid_key",
            StatsStatus::Rejected(RejectionReason::TooLarge) => "rejected:too_large",
        }
    }

    fn parse(text: &str) -> Result<Self, sqlx::Error> {
        let decode = |e: String| sqlx::Error::Decode(e.into());
        match text.strip_prefix("rejected:") {
            Some(reason) => Ok(StatsStatus::Rejected(reason.parse().map_err(decode)?)),
            None => Ok(StatsStatus::Message(text.parse().map_err(
                |e: crate::status::UnknownStatus| decode(e.to_string()),
            )?)),
        }
    }
}

impl std::fmt::Display for StatsStatus {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

impl PartialEq<&str> for StatsStatus {
    fn eq(&self, other: &&str) -> bool {
        self.as_str() == *other
    }
}

/// A rejected delivery to record in `inbox_rejections`, payload included.
#[derive(Debug, Clone, Copy)]
pub struct Rejection<'a> {
    /// The consumer, when one could be named.
    pub consumer: Option<&'a str>,
    /// The key, when it could be read.
    pub message_key: Option<&'a str>,
    /// The message name as delivered (may be empty).
    pub message_name: &'a str,
    /// Why it was rejected.
    pub reason: RejectionReason,
    /// The error, as text.
    pub detail: &'a str,
    /// The delivery's fingerprint (hex), if computed.
    pub payload_hash: Option<&'a str>,
    /// The payload bytes as delivered (cut to the payload limit when too large).
    pub payload: &'a [u8],
    /// The payload's real size in bytes when `payload` was cut (`None`: kept whole).
    pub payload_size: Option<i64>,
    /// Where the delivery came from.
    pub source: Option<&'a SourceMetadata>,
}

/// One row of the inbox, as the admin API shows it. Timestamps are the database's text form
/// (UTC).
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct StoredMessage {
    /// The consumer.
    pub consumer: String,
    /// The idempotency key.
    pub message_key: String,
    /// The routing name.
    pub message_name: String,
    /// Its state.
    pub status: Status,
    /// Attempts that ran the handler.
    pub attempts: u32,
    /// The last error, cut to [`crate::RetryPolicy::max_error_bytes`].
    pub last_error: Option<String>,
    /// Payload fingerprint (hex SHA-256).
    pub payload_hash: String,
    /// The payload (JSON), kept for `failed`, `dead` and `parked` rows.
    pub payload: Option<Vec<u8>>,
    /// When the first delivery arrived.
    pub received_at: String,
    /// When it was processed (or discarded).
    pub processed_at: Option<String>,
    /// Earliest time of the next attempt, for `failed` rows.
    pub next_attempt_at: Option<String>,
    /// Source of the first recorded delivery.
    pub source: Option<String>,
    /// The aggregate, for ordered messages that were parked, stale or failed.
    pub aggregate_id: Option<String>,
    /// The sequence within the aggregate, likewise.
    pub sequence: Option<i64>,
    /// The result a claim session stored with the key (see
    /// [`ClaimedKey::complete`](crate::ClaimedKey::complete)), if any.
    pub result: Option<Vec<u8>>,
}

impl StoredMessage {
    /// The row's ordering, if it has one (parked, stale and failed ordered messages).
    pub(crate) fn ordering(&self) -> Option<crate::Ordering> {
        Some(crate::Ordering {
            aggregate_id: self.aggregate_id.clone()?,
            sequence: self.sequence?,
        })
    }
}

/// The clocks a purge goes by, as [`AdminStore::purge_clock`](crate::AdminStore::purge_clock)
/// reads them. Times are the database's text form (UTC; [`crate::admin::utc_time`] shows them).
#[derive(Debug, Clone, PartialEq)]
pub struct PurgeClock {
    /// The purging connection's clock: the server's on PostgreSQL, this process's on SQLite.
    pub now: String,
    /// Rows settled before this go: `now` minus the window on PostgreSQL; on SQLite the
    /// earlier of `now` and `newest`, minus the window.
    pub cutoff: String,
    /// SQLite: the newest time written into the inbox tables by any process (`None` when they
    /// are empty). `None` on PostgreSQL, where one clock stamps every row.
    pub newest: Option<String>,
    /// How many seconds `newest` lies ahead of `now` (negative: behind).
    pub newest_ahead_secs: Option<f64>,
}

/// One line of [`crate::admin::stats`]: a count per consumer and status (or rejection reason).
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct StatsRow {
    /// The consumer (`None` for rejections no consumer could be named for).
    pub consumer: Option<String>,
    /// A status of `inbox_messages` (every one that has rows, `stale` included), or a rejection
    /// reason.
    pub status: StatsStatus,
    /// How many rows.
    pub count: i64,
    /// The oldest `received_at` among them.
    pub oldest: Option<String>,
}

pub(super) const STORE_RESULT: &str =
    "UPDATE inbox_messages SET result = $3 WHERE consumer = $1 AND message_key = $2";

pub(super) const FETCH_RESULT: &str =
    "SELECT result FROM inbox_messages WHERE consumer = $1 AND message_key = $2";

pub(super) const RECORD_REJECTION: &str = "INSERT INTO inbox_rejections \
     (consumer, message_key, message_name, reason, detail, payload_hash, payload, \
      source, source_partition, source_offset, payload_size) \
     VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11)";

macro_rules! message_columns {
    () => {
        "consumer, message_key, message_name, status, attempts, last_error, payload_hash, \
         payload, CAST(received_at AS TEXT), \
         CAST(COALESCE(processed_at, CASE WHEN status IN ('processed', 'discarded', 'stale') \
           THEN received_at END) AS TEXT), \
         CAST(next_attempt_at AS TEXT), source, aggregate_id, sequence, result"
    };
}

pub(super) const FETCH: &str = concat!(
    "SELECT ",
    message_columns!(),
    " FROM inbox_messages WHERE consumer = $1 AND message_key = $2"
);

pub(super) const STATS: &str = "SELECT consumer, status, COUNT(*), CAST(MIN(received_at) AS TEXT) \
     FROM inbox_messages GROUP BY status, consumer \
     UNION ALL \
     SELECT consumer, 'rejected:' || reason, COUNT(*), CAST(MIN(received_at) AS TEXT) \
     FROM inbox_rejections GROUP BY consumer, reason \
     ORDER BY 1 NULLS FIRST, 2";

/// Locks the aggregate's state row (creating it at sequence 0) and reads its last applied
/// sequence; a concurrent transaction on the same aggregate waits here until this one ends.
pub(super) const LOCK_AGGREGATE: &str = "INSERT INTO inbox_aggregate_state \
     (consumer, aggregate_id, last_sequence) VALUES ($1, $2, 0) \
     ON CONFLICT (consumer, aggregate_id) DO UPDATE \
     SET last_sequence = inbox_aggregate_state.last_sequence \
     RETURNING last_sequence";

/// A key claimed fresh in this transaction has `attempts = 1`.
pub(super) const UNCLAIM_FRESH: &str = "DELETE FROM inbox_messages \
     WHERE consumer = $1 AND message_key = $2 AND status = 'processed' AND attempts = 1";

/// A `failed` key taken over in this transaction counted one more attempt and dropped its payload.
pub(super) const UNCLAIM_TAKEN_OVER: &str = "UPDATE inbox_messages \
     SET status = 'failed', attempts = attempts - 1, processed_at = NULL, payload = $3 \
     WHERE consumer = $1 AND message_key = $2 AND status = 'processed' AND attempts > 1";

pub(super) const ADVANCE_AGGREGATE: &str = "UPDATE inbox_aggregate_state SET last_sequence = $3 \
     WHERE consumer = $1 AND aggregate_id = $2";

/// A parked row is not settled: it loses the `processed_at` its claim gave it (retention ages
/// it from its first delivery, and never purges it).
pub(super) const MARK_MESSAGE: &str = "UPDATE inbox_messages \
     SET status = $3, aggregate_id = $4, sequence = $5, payload = $6, \
     processed_at = CASE WHEN $3 = 'parked' THEN NULL ELSE processed_at END \
     WHERE consumer = $1 AND message_key = $2";

pub(super) const FIND_PARKED: &str = "SELECT consumer, message_key, message_name, aggregate_id, \
     sequence FROM inbox_messages \
     WHERE consumer = $1 AND aggregate_id = $2 AND sequence = $3 \
     AND status IN ('parked', 'failed') LIMIT 1";

pub(super) const DEAD_LETTER_PARKED: &str = "UPDATE inbox_messages \
     SET status = 'dead', last_error = $3 \
     WHERE consumer = $1 AND message_key = $2 AND status = 'parked'";

/// A fingerprint as the PostgreSQL inbox stores it (`payload_hash BYTEA`, migration 0006): the
/// 32 raw bytes of a 64-lower-case-hex-digit SHA-256 digest, or, for any other text (never
/// written by the runtime), that text's UTF-8 bytes, so that it reads back unchanged through
/// [`hash_text`].
pub(super) fn hash_bytes(hex_text: &str) -> Vec<u8> {
    let lower_hex = hex_text.len() == 64
        && hex_text
            .bytes()
            .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b));
    match hex::decode(hex_text) {
        Ok(bytes) if lower_hex => bytes,
        _ => hex_text.as_bytes().to_vec(),
    }
}

/// A stored fingerprint as text: 32 bytes (PostgreSQL's `BYTEA` digest) as 64 lower-case hex
/// digits; anything else (SQLite's and MySQL's hex text, a damaged value) as its UTF-8 text.
pub(super) fn hash_text(stored: Vec<u8>) -> String {
    if stored.len() == 32 {
        hex::encode(stored)
    } else {
        String::from_utf8(stored)
            .unwrap_or_else(|e| String::from_utf8_lossy(e.as_bytes()).into_owned())
    }
}

/// A `retry_in_ms` column as a delay (`None`: due, or not `failed`).
pub(super) fn retry_in(ms: Option<i64>) -> Option<std::time::Duration> {
    ms.filter(|&ms| ms > 0)
        .map(|ms| std::time::Duration::from_millis(ms.unsigned_abs()))
}

pub(crate) fn stats_status(text: &str) -> Result<StatsStatus, sqlx::Error> {
    StatsStatus::parse(text)
}

pub(super) fn parked(row: (String, String, String, String, i64)) -> ParkedMessage {
    let (consumer, message_key, message_name, aggregate_id, sequence) = row;
    ParkedMessage {
        consumer,
        message_key,
        message_name,
        aggregate_id,
        sequence,
    }
}

/// Implements `InboxConnection` for one backend's connection type. `$sql` is the backend's
/// module with `CLAIM`, `RECORD_FAILURE`, `DISCARD` and `PURGE`.
macro_rules! impl_inbox_connection {
    ($conn:ty, $db:ty, $variant:ident, $sql:path, begin = |$this:ident| $begin:expr, begin_statement = |$that:ident| $statement:expr) => {
        impl $crate::store::InboxConnection for $conn {
            const BACKEND: $crate::store::Backend = $crate::store::Backend::$variant;

            fn begin_inbox(
                &mut self,
            ) -> $crate::BoxFuture<'_, Result<sqlx::Transaction<'_, $db>, sqlx::Error>> {
                let $this = self;
                $begin
            }

            fn begin_statement(&self) -> Option<sqlx::SqlStr> {
                let $that = self;
                $statement
            }

            fn in_transaction<'t>(tx: &'t mut sqlx::Transaction<'_, $db>) -> &'t mut Self {
                &mut *tx
            }

        }

        impl $crate::store::ClaimStore for $conn {
            fn claim<'c>(
                &'c mut self,
                request: &'c $crate::store::ClaimRequest<'c>,
            ) -> $crate::BoxFuture<'c, Result<$crate::store::ClaimResult, sqlx::Error>> {
                use sqlx::Row as _;
                use $crate::store::ClaimResult;
                use $crate::store::shared::claimable;
                use $sql as sql;
                fn decode(
                    row: Option<<$db as sqlx::Database>::Row>,
                ) -> Result<Option<ClaimResult>, sqlx::Error> {
                    let Some(row) = row else { return Ok(None) };
                    let status: &str = row.try_get(0)?;
                    let attempts: i32 = row.try_get(2)?;
                    let attempts = u32::try_from(attempts).unwrap_or(0);
                    Ok(Some(if status == "claimed" {
                        ClaimResult::Claimed { attempts }
                    } else {
                        let retry_in: Option<i64> = row.try_get(3)?;
                        ClaimResult::Existing {
                            status: status.parse().map_err(|e| sqlx::Error::Decode(Box::new(e)))?,
                            payload_hash: $crate::store::shared::hash_text(row.try_get(1)?),
                            attempts,
                            retry_in: $crate::store::shared::retry_in(retry_in),
                        }
                    }))
                }
                Box::pin(async move {
                    let (source, partition, offset) = $crate::store::source_parts(request.source);
                    // A key deleted by a retention purge between the claim and the read is
                    // claimed again; three rounds are more than such a race can take.
                    for _ in 0..3 {
                        let row = sqlx::query(sql::CLAIM)
                            .bind(request.consumer)
                            .bind(request.message_key)
                            .bind(request.message_name)
                            .bind(sql::hash_param(request.payload_hash))
                            .bind(source)
                            .bind(partition)
                            .bind(offset)
                            .bind(request.mode.as_str())
                            .fetch_optional(&mut *self)
                            .await?;
                        let mut found = decode(row)?;
                        if let Some(ClaimResult::Claimed { .. }) = found {
                            return Ok(found.expect("checked"));
                        }
                        // The claim statement's snapshot predates any wait on a concurrent
                        // claim of the key: it may miss a row committed meanwhile, or show one
                        // that a concurrent transaction has taken over since (a row the claim
                        // itself would have taken, had it still been so). Read it anew.
                        if found
                            .as_ref()
                            .is_none_or(|existing| claimable(existing, request))
                        {
                            let row = sqlx::query(sql::EXISTING)
                                .bind(request.consumer)
                                .bind(request.message_key)
                                .fetch_optional(&mut *self)
                                .await?;
                            found = decode(row)?;
                        }
                        match found {
                            // Deleted by a purge, or released by a rolled-back concurrent
                            // attempt: claim again.
                            None => continue,
                            Some(ref existing) if claimable(existing, request) => continue,
                            Some(existing) => return Ok(existing),
                        }
                    }
                    // Transient (see `Classify for sqlx::Error`): retried by the caller.
                    Err(sqlx::Error::Protocol(
                        "inbox claim: key neither claimable nor settled after 3 rounds".into(),
                    ))
                })
            }

            fn claim_no_wait<'c>(
                &'c mut self,
                request: &'c $crate::store::ClaimRequest<'c>,
            ) -> $crate::BoxFuture<'c, Result<Option<$crate::store::ClaimResult>, sqlx::Error>>
            {
                use $sql as sql;
                Box::pin(async move {
                    let Some((set, reset)) = sql::NO_WAIT else {
                        return self.claim(request).await.map(Some);
                    };
                    let grace = format!("{}ms", $crate::Wait::NO_WAIT_GRACE.as_millis());
                    let previous: String = sqlx::query_scalar(set)
                        .bind(grace)
                        .fetch_one(&mut *self)
                        .await?;
                    match self.claim(request).await {
                        Ok(found) => {
                            sqlx::query(reset).bind(previous).execute(&mut *self).await?;
                            Ok(Some(found))
                        }
                        Err(sqlx::Error::Database(error))
                            if error.code().as_deref() == Some(sql::LOCK_NOT_AVAILABLE) =>
                        {
                            Ok(None)
                        }
                        Err(error) => Err(error),
                    }
                })
            }

            fn verify_claim<'c>(
                &'c mut self,
                consumer: &'c str,
                key: &'c str,
            ) -> $crate::BoxFuture<'c, Result<(), sqlx::Error>> {
                use $sql as sql;
                Box::pin(async move {
                    let Some(verify) = sql::VERIFY_CLAIM else {
                        return Ok(());
                    };
                    let found: Option<i32> = sqlx::query_scalar(verify)
                        .bind(consumer)
                        .bind(key)
                        .fetch_optional(&mut *self)
                        .await?;
                    match found {
                        Some(_) => Ok(()),
                        None => Err(sqlx::Error::Protocol(
                            "the claim is gone from the handler's transaction".into(),
                        )),
                    }
                })
            }

            fn existing<'c>(
                &'c mut self,
                consumer: &'c str,
                key: &'c str,
            ) -> $crate::BoxFuture<'c, Result<Option<$crate::store::ClaimResult>, sqlx::Error>> {
                use $sql as sql;
                Box::pin(async move {
                    let row: Option<($crate::status::Status, Vec<u8>, i32, Option<i64>)> =
                        sqlx::query_as(sql::EXISTING)
                            .bind(consumer)
                            .bind(key)
                            .fetch_optional(&mut *self)
                            .await?;
                    Ok(row.map(|(status, payload_hash, attempts, retry_in)| {
                        $crate::store::ClaimResult::Existing {
                            status,
                            payload_hash: $crate::store::shared::hash_text(payload_hash),
                            attempts: u32::try_from(attempts).unwrap_or(0),
                            retry_in: $crate::store::shared::retry_in(retry_in),
                        }
                    }))
                })
            }

            fn record_failure<'c>(
                &'c mut self,
                r: &'c $crate::store::FailureRecord<'c>,
            ) -> $crate::BoxFuture<'c, Result<Option<($crate::status::Status, u32)>, sqlx::Error>> {
                use $sql as sql;
                Box::pin(async move {
                    let (source, partition, offset) = $crate::store::source_parts(r.source);
                    let row: Option<($crate::status::Status, i32)> = sqlx::query_as(sql::RECORD_FAILURE)
                        .bind(r.consumer)
                        .bind(r.message_key)
                        .bind(r.message_name)
                        .bind(sql::hash_param(r.payload_hash))
                        .bind(r.permanent)
                        .bind(i32::try_from(r.max_attempts).unwrap_or(i32::MAX))
                        .bind(r.last_error)
                        .bind(r.retry_delay_ms)
                        .bind(r.payload)
                        .bind(source)
                        .bind(partition)
                        .bind(offset)
                        .bind(r.aggregate_id)
                        .bind(r.sequence)
                        .fetch_optional(&mut *self)
                        .await?;
                    Ok(
                        row.map(|(status, attempts)| {
                            (status, u32::try_from(attempts).unwrap_or(0))
                        }),
                    )
                })
            }

            fn record_rejection<'c>(
                &'c mut self,
                r: &'c $crate::store::Rejection<'c>,
            ) -> $crate::BoxFuture<'c, Result<(), sqlx::Error>> {
                Box::pin(async move {
                    let (source, partition, offset) = $crate::store::source_parts(r.source);
                    sqlx::query($crate::store::shared::RECORD_REJECTION)
                        .bind(r.consumer)
                        .bind(r.message_key)
                        .bind(r.message_name)
                        .bind(r.reason.as_str())
                        .bind(r.detail)
                        .bind(r.payload_hash)
                        .bind(r.payload)
                        .bind(source)
                        .bind(partition)
                        .bind(offset)
                        .bind(r.payload_size)
                        .execute(&mut *self)
                        .await?;
                    Ok(())
                })
            }

            fn claim_batch<'c>(
                &'c mut self,
                requests: &'c [$crate::store::ClaimRequest<'c>],
            ) -> $crate::BoxFuture<'c, Result<Vec<Option<u32>>, sqlx::Error>> {
                use $sql as sql;
                Box::pin(async move {
                    let mut claimed = vec![None; requests.len()];
                    if requests.is_empty() {
                        return Ok(claimed);
                    }
                    let mut query = sqlx::QueryBuilder::<$db>::new(
                        "INSERT INTO inbox_messages (consumer, message_key, message_name, \
                         payload_hash, status, attempts, received_at, processed_at, source, \
                         source_partition, source_offset) ",
                    );
                    query.push_values(requests, |mut row, request| {
                        let (source, partition, offset) =
                            $crate::store::source_parts(request.source);
                        row.push_bind(request.consumer)
                            .push_bind(request.message_key)
                            .push_bind(request.message_name)
                            .push_bind(sql::hash_param(request.payload_hash))
                            .push("'processed'")
                            .push("1")
                            .push(sql::NOW)
                            .push(sql::CLAIMED_PROCESSED_AT)
                            .push_bind(source)
                            .push_bind(partition)
                            .push_bind(offset);
                    });
                    query.push(concat!(
                        " ON CONFLICT (consumer, message_key) DO UPDATE SET ",
                        "status = 'processed', attempts = inbox_messages.attempts + 1, ",
                        "processed_at = ",
                    ));
                    query.push(sql::TAKEOVER_PROCESSED_AT);
                    query.push(concat!(
                        ", next_attempt_at = NULL, payload = NULL ",
                        "WHERE inbox_messages.payload_hash = excluded.payload_hash AND ",
                    ));
                    query.push(sql::BATCH_TAKEOVER);
                    query.push(" RETURNING consumer, message_key, attempts");
                    let rows: Vec<(String, String, i32)> =
                        query.build_query_as().fetch_all(&mut *self).await?;
                    let index = $crate::store::request_index(requests);
                    for (consumer, key, attempts) in rows {
                        if let Some(&at) = index.get(&(consumer.as_str(), key.as_str())) {
                            claimed[at] = Some(u32::try_from(attempts).unwrap_or(0));
                        }
                    }
                    Ok(claimed)
                })
            }

            fn existing_batch<'c>(
                &'c mut self,
                keys: &'c [(&'c str, &'c str)],
            ) -> $crate::BoxFuture<'c, Result<Vec<(String, String, $crate::store::ClaimResult)>, sqlx::Error>>
            {
                use $sql as sql;
                Box::pin(async move {
                    if keys.is_empty() {
                        return Ok(Vec::new());
                    }
                    let mut query = sqlx::QueryBuilder::<$db>::new(sql::EXISTING_BATCH);
                    query.push_tuples(keys, |mut row, (consumer, key)| {
                        row.push_bind(*consumer).push_bind(*key);
                    });
                    let rows: Vec<(String, String, $crate::status::Status, Vec<u8>, i32, Option<i64>)> =
                        query.build_query_as().fetch_all(&mut *self).await?;
                    Ok(rows
                        .into_iter()
                        .map(|(consumer, key, status, payload_hash, attempts, retry_in)| {
                            let attempts = u32::try_from(attempts).unwrap_or(0);
                            (consumer, key, $crate::store::ClaimResult::Existing {
                                status,
                                payload_hash: $crate::store::shared::hash_text(payload_hash),
                                attempts,
                                retry_in: $crate::store::shared::retry_in(retry_in),
                            })
                        })
                        .collect())
                })
            }

            fn unclaim<'c>(
                &'c mut self,
                consumer: &'c str,
                key: &'c str,
                payload: &'c [u8],
            ) -> $crate::BoxFuture<'c, Result<(), sqlx::Error>> {
                Box::pin(async move {
                    sqlx::query($crate::store::shared::UNCLAIM_FRESH)
                        .bind(consumer)
                        .bind(key)
                        .execute(&mut *self)
                        .await?;
                    sqlx::query($crate::store::shared::UNCLAIM_TAKEN_OVER)
                        .bind(consumer)
                        .bind(key)
                        .bind(payload)
                        .execute(&mut *self)
                        .await?;
                    Ok(())
                })
            }

            fn fail_claimed<'c>(
                &'c mut self,
                r: &'c $crate::store::FailureRecord<'c>,
            ) -> $crate::BoxFuture<'c, Result<Option<($crate::status::Status, u32)>, sqlx::Error>> {
                use $sql as sql;
                Box::pin(async move {
                    let row: Option<($crate::status::Status, i32)> = sqlx::query_as(sql::FAIL_CLAIMED)
                        .bind(r.consumer)
                        .bind(r.message_key)
                        .bind(r.permanent)
                        .bind(i32::try_from(r.max_attempts).unwrap_or(i32::MAX))
                        .bind(r.last_error)
                        .bind(r.retry_delay_ms)
                        .bind(r.payload)
                        .fetch_optional(&mut *self)
                        .await?;
                    Ok(row.map(|(status, attempts)| (status, u32::try_from(attempts).unwrap_or(0))))
                })
            }

            fn store_result<'c>(
                &'c mut self,
                consumer: &'c str,
                key: &'c str,
                result: &'c [u8],
            ) -> $crate::BoxFuture<'c, Result<(), sqlx::Error>> {
                Box::pin(async move {
                    sqlx::query($crate::store::shared::STORE_RESULT)
                        .bind(consumer)
                        .bind(key)
                        .bind(result)
                        .execute(&mut *self)
                        .await?;
                    Ok(())
                })
            }

            fn fetch_result<'c>(
                &'c mut self,
                consumer: &'c str,
                key: &'c str,
            ) -> $crate::BoxFuture<'c, Result<Option<Vec<u8>>, sqlx::Error>> {
                Box::pin(async move {
                    let found: Option<Option<Vec<u8>>> =
                        sqlx::query_scalar($crate::store::shared::FETCH_RESULT)
                            .bind(consumer)
                            .bind(key)
                            .fetch_optional(&mut *self)
                            .await?;
                    Ok(found.flatten())
                })
            }

        }

        impl $crate::store::AdminStore for $conn {
            fn fetch_message<'c>(
                &'c mut self,
                consumer: &'c str,
                key: &'c str,
            ) -> $crate::BoxFuture<'c, Result<Option<$crate::store::StoredMessage>, sqlx::Error>>
            {
                Box::pin(async move {
                    let row = sqlx::query($crate::store::shared::FETCH)
                        .bind(consumer)
                        .bind(key)
                        .fetch_optional(&mut *self)
                        .await?;
                    row.as_ref()
                        .map($crate::store::shared::stored_message)
                        .transpose()
                })
            }

            fn list_messages<'c>(
                &'c mut self,
                consumer: Option<&'c str>,
                statuses: &'c [$crate::status::Status],
                limit: i64,
            ) -> $crate::BoxFuture<'c, Result<Vec<$crate::store::StoredMessage>, sqlx::Error>> {
                Box::pin(async move {
                    if statuses.is_empty() {
                        return Ok(Vec::new());
                    }
                    let mut query = sqlx::QueryBuilder::<$db>::new(concat!(
                        "SELECT ",
                        message_columns!(),
                        " FROM inbox_messages WHERE ("
                    ));
                    query.push_bind(consumer).push(" IS NULL OR consumer = ");
                    query.push_bind(consumer).push(") AND status IN (");
                    let mut each = query.separated(", ");
                    for status in statuses {
                        each.push_bind(status.as_str());
                    }
                    query
                        .push(") ORDER BY received_at, consumer, message_key LIMIT ")
                        .push_bind(limit);
                    let rows = query.build().fetch_all(&mut *self).await?;
                    rows.iter()
                        .map($crate::store::shared::stored_message)
                        .collect()
                })
            }

            fn discard_message<'c>(
                &'c mut self,
                consumer: &'c str,
                key: &'c str,
            ) -> $crate::BoxFuture<'c, Result<bool, sqlx::Error>> {
                use $sql as sql;
                Box::pin(async move {
                    let done = sqlx::query(sql::DISCARD)
                        .bind(consumer)
                        .bind(key)
                        .execute(&mut *self)
                        .await?;
                    Ok(done.rows_affected() > 0)
                })
            }

            fn stats(
                &mut self,
            ) -> $crate::BoxFuture<'_, Result<Vec<$crate::store::StatsRow>, sqlx::Error>> {
                Box::pin(async move {
                    let rows: Vec<(Option<String>, String, i64, Option<String>)> =
                        sqlx::query_as($crate::store::shared::STATS)
                            .fetch_all(&mut *self)
                            .await?;
                    rows.into_iter()
                        .map(|(consumer, status, count, oldest)| {
                            Ok($crate::store::StatsRow {
                                consumer,
                                status: $crate::store::shared::stats_status(&status)?,
                                count,
                                oldest,
                            })
                        })
                        .collect()
                })
            }

            fn purge_batch<'c>(
                &'c mut self,
                statuses: &'c [$crate::status::Status],
                older_than_secs: f64,
                batch: i64,
            ) -> $crate::BoxFuture<'c, Result<u64, sqlx::Error>> {
                use $sql as sql;
                Box::pin(async move {
                    let status = |i: usize| statuses.get(i).map(|s| s.as_str());
                    let done = sqlx::query(sql::PURGE)
                        .bind(status(0))
                        .bind(status(1))
                        .bind(status(2))
                        .bind(older_than_secs)
                        .bind(batch)
                        .execute(&mut *self)
                        .await?;
                    Ok(done.rows_affected())
                })
            }

            fn purge_rejections_batch(
                &mut self,
                older_than_secs: f64,
                batch: i64,
            ) -> $crate::BoxFuture<'_, Result<u64, sqlx::Error>> {
                use $sql as sql;
                Box::pin(async move {
                    let done = sqlx::query(sql::PURGE_REJECTIONS)
                        .bind(older_than_secs)
                        .bind(batch)
                        .execute(&mut *self)
                        .await?;
                    Ok(done.rows_affected())
                })
            }

            fn purge_clock(
                &mut self,
                older_than_secs: f64,
            ) -> $crate::BoxFuture<'_, Result<$crate::store::PurgeClock, sqlx::Error>> {
                use $sql as sql;
                Box::pin(async move {
                    let (now, cutoff, newest, newest_ahead_secs): (
                        String,
                        String,
                        Option<String>,
                        Option<f64>,
                    ) = sqlx::query_as(sql::PURGE_CLOCK)
                        .bind(older_than_secs)
                        .fetch_one(&mut *self)
                        .await?;
                    Ok($crate::store::PurgeClock {
                        now,
                        cutoff,
                        newest,
                        newest_ahead_secs,
                    })
                })
            }

            fn purge_preview<'c>(
                &'c mut self,
                statuses: &'c [$crate::status::Status],
                older_than_secs: f64,
                rejections: bool,
            ) -> $crate::BoxFuture<'c, Result<Vec<$crate::store::StatsRow>, sqlx::Error>> {
                use $sql as sql;
                Box::pin(async move {
                    let status = |i: usize| statuses.get(i).map(|s| s.as_str());
                    let rows: Vec<(Option<String>, String, i64, Option<String>)> =
                        sqlx::query_as(sql::PURGE_PREVIEW)
                            .bind(status(0))
                            .bind(status(1))
                            .bind(status(2))
                            .bind(status(3))
                            .bind(status(4))
                            .bind(older_than_secs)
                            .bind(rejections)
                            .fetch_all(&mut *self)
                            .await?;
                    rows.into_iter()
                        .map(|(consumer, status, count, oldest)| {
                            Ok($crate::store::StatsRow {
                                consumer,
                                status: $crate::store::shared::stats_status(&status)?,
                                count,
                                oldest,
                            })
                        })
                        .collect()
                })
            }

        }

        impl $crate::store::OrderingStore for $conn {
            fn lock_aggregate<'c>(
                &'c mut self,
                consumer: &'c str,
                aggregate_id: &'c str,
            ) -> $crate::BoxFuture<'c, Result<i64, sqlx::Error>> {
                Box::pin(async move {
                    sqlx::query_scalar($crate::store::shared::LOCK_AGGREGATE)
                        .bind(consumer)
                        .bind(aggregate_id)
                        .fetch_one(&mut *self)
                        .await
                })
            }

            fn advance_aggregate<'c>(
                &'c mut self,
                consumer: &'c str,
                aggregate_id: &'c str,
                sequence: i64,
            ) -> $crate::BoxFuture<'c, Result<(), sqlx::Error>> {
                Box::pin(async move {
                    sqlx::query($crate::store::shared::ADVANCE_AGGREGATE)
                        .bind(consumer)
                        .bind(aggregate_id)
                        .bind(sequence)
                        .execute(&mut *self)
                        .await?;
                    Ok(())
                })
            }

            fn mark_message<'c>(
                &'c mut self,
                consumer: &'c str,
                key: &'c str,
                status: $crate::status::Status,
                ordering: &'c $crate::Ordering,
                payload: Option<&'c [u8]>,
            ) -> $crate::BoxFuture<'c, Result<(), sqlx::Error>> {
                Box::pin(async move {
                    sqlx::query($crate::store::shared::MARK_MESSAGE)
                        .bind(consumer)
                        .bind(key)
                        .bind(status.as_str())
                        .bind(ordering.aggregate_id.as_str())
                        .bind(ordering.sequence)
                        .bind(payload)
                        .execute(&mut *self)
                        .await?;
                    Ok(())
                })
            }

            fn find_parked<'c>(
                &'c mut self,
                consumer: &'c str,
                aggregate_id: &'c str,
                sequence: i64,
            ) -> $crate::BoxFuture<'c, Result<Option<$crate::store::ParkedMessage>, sqlx::Error>>
            {
                Box::pin(async move {
                    let row: Option<(String, String, String, String, i64)> =
                        sqlx::query_as($crate::store::shared::FIND_PARKED)
                            .bind(consumer)
                            .bind(aggregate_id)
                            .bind(sequence)
                            .fetch_optional(&mut *self)
                            .await?;
                    Ok(row.map($crate::store::shared::parked))
                })
            }

            fn expired_parked<'c>(
                &'c mut self,
                older_than_secs: f64,
                limit: i64,
            ) -> $crate::BoxFuture<'c, Result<Vec<$crate::store::ParkedMessage>, sqlx::Error>> {
                use $sql as sql;
                Box::pin(async move {
                    let rows: Vec<(String, String, String, String, i64)> =
                        sqlx::query_as(sql::EXPIRED_PARKED)
                            .bind(older_than_secs)
                            .bind(limit)
                            .fetch_all(&mut *self)
                            .await?;
                    Ok(rows
                        .into_iter()
                        .map($crate::store::shared::parked)
                        .collect())
                })
            }

            fn dead_letter_parked<'c>(
                &'c mut self,
                consumer: &'c str,
                key: &'c str,
                reason: &'c str,
            ) -> $crate::BoxFuture<'c, Result<bool, sqlx::Error>> {
                Box::pin(async move {
                    let done = sqlx::query($crate::store::shared::DEAD_LETTER_PARKED)
                        .bind(consumer)
                        .bind(key)
                        .bind(reason)
                        .execute(&mut *self)
                        .await?;
                    Ok(done.rows_affected() > 0)
                })
            }

        }
    };
}

/// Whether the claim statement would have taken this row (see [`ClaimMode::takes_over`]):
/// seeing one after the claim means it changed since.
pub(super) fn claimable(existing: &ClaimResult, request: &ClaimRequest<'_>) -> bool {
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

/// Decodes a row of `MESSAGE_COLUMNS`.
pub(super) fn stored_message<R>(row: &R) -> Result<StoredMessage, sqlx::Error>
where
    R: sqlx::Row,
    usize: sqlx::ColumnIndex<R>,
    for<'r> String: sqlx::Decode<'r, R::Database> + sqlx::Type<R::Database>,
    for<'r> Status: sqlx::Decode<'r, R::Database> + sqlx::Type<R::Database>,
    for<'r> Option<String>: sqlx::Decode<'r, R::Database> + sqlx::Type<R::Database>,
    for<'r> i32: sqlx::Decode<'r, R::Database> + sqlx::Type<R::Database>,
    for<'r> Option<Vec<u8>>: sqlx::Decode<'r, R::Database> + sqlx::Type<R::Database>,
    for<'r> Vec<u8>: sqlx::Decode<'r, R::Database> + sqlx::Type<R::Database>,
    for<'r> Option<i64>: sqlx::Decode<'r, R::Database> + sqlx::Type<R::Database>,
{
    let attempts: i32 = row.try_get(4)?;
    Ok(StoredMessage {
        consumer: row.try_get(0)?,
        message_key: row.try_get(1)?,
        message_name: row.try_get(2)?,
        status: row.try_get(3)?,
        attempts: u32::try_from(attempts).unwrap_or(0),
        last_error: row.try_get(5)?,
        payload_hash: hash_text(row.try_get(6)?),
        payload: row.try_get(7)?,
        received_at: row.try_get(8)?,
        processed_at: row.try_get(9)?,
        next_attempt_at: row.try_get(10)?,
        source: row.try_get(11)?,
        aggregate_id: row.try_get(12)?,
        sequence: row.try_get(13)?,
        result: row.try_get(14)?,
    })
}

#[cfg(test)]
mod tests {
    use super::{hash_bytes, hash_text};

    #[test]
    fn a_digest_is_stored_as_its_32_bytes_and_reads_back_as_hex() {
        let digest = "00ff".repeat(16);
        let stored = hash_bytes(&digest);
        assert_eq!(stored, [0x00, 0xff].repeat(16));
        assert_eq!(hash_text(stored), digest);
    }

    #[test]
    fn other_text_is_stored_as_its_bytes_and_reads_back_unchanged() {
        for text in [
            "00FF".repeat(16),               // upper-case hex: not what the runtime writes
            "00ff".repeat(15),               // 60 digits
            format!("{}zz", "0".repeat(62)), // 64 characters, not all hex
            "damaged".to_owned(),
        ] {
            let stored = hash_bytes(&text);
            assert_eq!(stored, text.as_bytes(), "{text}");
            assert_eq!(hash_text(stored), text);
        }
    }
}
