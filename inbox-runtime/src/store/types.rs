//! The values the store traits take and return: claim requests and results, failure and
//! rejection records, stored rows, statistics, the purge's clocks, and the backend's name.

use crate::types::envelope::{Envelope, SourceMetadata};
use crate::types::error::DispatchError;
use crate::types::status::{ClaimMode, Status, text_as_str};

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

/// The settlement of an ordered message whose body does not run (see
/// [`OrderingStore::mark_message`](super::OrderingStore::mark_message)).
#[derive(Debug, Clone, Copy)]
pub struct MessageMark<'a> {
    /// The consumer.
    pub consumer: &'a str,
    /// The idempotency key, claimed in the current transaction.
    pub message_key: &'a str,
    /// The status to set: `stale` (behind its aggregate) or `parked` (ahead of it).
    pub status: Status,
    /// The message's aggregate and sequence.
    pub ordering: &'a crate::types::Ordering,
    /// The payload to keep (a parked message's, for its later run), if any.
    pub payload: Option<&'a [u8]>,
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
                |e: crate::types::status::UnknownStatus| decode(e.to_string()),
            )?)),
        }
    }
}

text_as_str!(StatsStatus);

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

impl<'a> Rejection<'a> {
    /// The rejection of `envelope`, which a dispatcher refused with `error` (its text given as
    /// `detail`): the reason and the consumer the error names, the payload cut to `limit` bytes
    /// (with its real size when cut), the delivery's source. Every store keeps refused
    /// deliveries this way.
    pub(crate) fn of_refused(
        envelope: &'a Envelope,
        error: &'a DispatchError,
        detail: &'a str,
        limit: usize,
    ) -> Self {
        let (reason, consumer) = match error {
            DispatchError::UnknownMessage { .. } => (RejectionReason::UnknownMessage, None),
            DispatchError::NoMessageName
            | DispatchError::NotUtf8 { .. }
            | DispatchError::UnpairedSurrogate { .. }
            | DispatchError::Decode { .. }
            | DispatchError::Fingerprint { .. } => (RejectionReason::Malformed, None),
            DispatchError::TooLarge { .. } => (RejectionReason::TooLarge, None),
            DispatchError::Key { consumer, .. } => (RejectionReason::InvalidKey, Some(*consumer)),
        };
        // An oversized payload is kept cut to the limit, with its real size: never whole.
        let size = envelope.payload_size();
        let kept = envelope.payload.len().min(limit);
        Rejection {
            consumer,
            message_key: None,
            message_name: &envelope.message_name,
            reason,
            detail,
            payload_hash: None,
            payload: &envelope.payload[..kept],
            payload_size: (kept < size).then(|| i64::try_from(size).unwrap_or(i64::MAX)),
            source: envelope.source.as_ref(),
        }
    }
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
    /// [`ClaimedKey::complete`](crate::protocol::ClaimedKey::complete)), if any.
    pub result: Option<Vec<u8>>,
}

impl StoredMessage {
    /// The row's ordering, if it has one (parked, stale and failed ordered messages).
    pub(crate) fn ordering(&self) -> Option<crate::types::Ordering> {
        Some(crate::types::Ordering {
            aggregate_id: self.aggregate_id.clone()?,
            sequence: self.sequence?,
        })
    }
}

/// The clocks a purge goes by, as
/// [`AdminStore::purge_clock`](crate::store::AdminStore::purge_clock) reads them. Times are the
/// database's text form (UTC; [`crate::ops::admin::utc_time`] shows them).
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

/// One line of [`crate::ops::admin::stats`]: a count per consumer and status (or rejection reason).
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

/// Which database an inbox lives in.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Backend {
    /// PostgreSQL (12 or newer), through `sqlx::PgConnection`.
    Postgres,
    /// SQLite (3.35 or newer, for `RETURNING`), through `sqlx::SqliteConnection`.
    Sqlite,
    /// MySQL (8.0.16 or newer) or MariaDB (10.6 or newer), InnoDB, through
    /// `sqlx::MySqlConnection`.
    MySql,
    /// Amazon DynamoDB, through the AWS SDK (feature `dynamodb`: handlers taking
    /// `&mut DynamoTx`).
    DynamoDb,
    /// A backend implemented outside this crate (see [`ClaimStore`](super::ClaimStore)), by its
    /// name.
    Other(&'static str),
}

impl Backend {
    /// The backend's name: `postgres`, `sqlite`, `mysql`, `dynamodb`, or the name of another.
    pub(crate) fn name(self) -> &'static str {
        match self {
            Backend::Postgres => "postgres",
            Backend::Sqlite => "sqlite",
            Backend::MySql => "mysql",
            Backend::DynamoDb => "dynamodb",
            Backend::Other(name) => name,
        }
    }
}

impl std::fmt::Display for Backend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// A stored row found by [`ClaimStore::existing_batch`](super::ClaimStore::existing_batch):
/// `(consumer, key, Existing { .. })`.
pub type ExistingRow = (String, String, ClaimResult);

/// Parses the status column of a statistics row: a status, or `rejected:<reason>`.
pub(crate) fn stats_status(text: &str) -> Result<StatsStatus, sqlx::Error> {
    StatsStatus::parse(text)
}

/// Where each `(consumer, key)` of a batch's requests is (keys are unique within a batch).
pub(crate) fn request_index<'a>(
    requests: &'a [ClaimRequest<'a>],
) -> std::collections::HashMap<(&'a str, &'a str), usize> {
    requests
        .iter()
        .enumerate()
        .map(|(index, r)| ((r.consumer, r.message_key), index))
        .collect()
}

/// Where a record's source metadata comes from.
pub(crate) fn source_parts(
    source: Option<&SourceMetadata>,
) -> (Option<&str>, Option<&str>, Option<i64>) {
    match source {
        Some(s) => (Some(s.source.as_str()), s.partition.as_deref(), s.offset),
        None => (None, None, None),
    }
}
