//! The states an inbox row can be in, with their stored text in one place.

use std::str::FromStr;

/// `Display` as the type's `as_str()` text, and `PartialEq<&str>` with that text, for the
/// crate's enums stored and shown as text (`Status`, `StoreOperation`, `StatsStatus`).
macro_rules! text_as_str {
    ($ty:ty) => {
        impl std::fmt::Display for $ty {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str(self.as_str())
            }
        }

        impl PartialEq<&str> for $ty {
            fn eq(&self, other: &&str) -> bool {
                self.as_str() == *other
            }
        }
    };
}
pub(crate) use text_as_str;

/// The state of one `(consumer, key)` row of `inbox_messages`, as stored in its `status` column.
///
/// Every key has one row whatever its state, so the uniqueness of `(consumer, message_key)`
/// spans all of them: a `failed` key is claimed again by its own retry, and every other state
/// blocks redeliveries. A claim that is still running holds its row uncommitted: other
/// transactions never see it (see [`crate::ClaimState::InProgress`] for how the claim session
/// reports one).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[non_exhaustive]
pub enum Status {
    /// The handler ran and its transaction committed. Redeliveries are duplicates.
    Processed,
    /// The last attempt failed with a retryable error; the payload is kept and the key is
    /// claimed again by its next delivery (no earlier than `next_attempt_at`).
    Failed,
    /// Dead-lettered: a permanent error, or `max_attempts` reached. The payload is kept for an
    /// operator to replay or discard.
    Dead,
    /// Per-aggregate ordering: held until its predecessor has been applied (payload kept).
    Parked,
    /// Per-aggregate ordering: not newer than the aggregate's last applied sequence; consumed
    /// without running the handler.
    Stale,
    /// An operator discarded a failed or dead message: it never runs, and blocks redeliveries.
    Discarded,
}

impl Status {
    /// Every status, in the order above.
    pub const ALL: [Status; 6] = [
        Status::Processed,
        Status::Failed,
        Status::Dead,
        Status::Parked,
        Status::Stale,
        Status::Discarded,
    ];

    /// The stored text: `processed`, `failed`, `dead`, `parked`, `stale` or `discarded`.
    pub const fn as_str(self) -> &'static str {
        match self {
            Status::Processed => "processed",
            Status::Failed => "failed",
            Status::Dead => "dead",
            Status::Parked => "parked",
            Status::Stale => "stale",
            Status::Discarded => "discarded",
        }
    }

    /// `true` for the states a retention purge deletes by default, because the key is settled
    /// for good: `processed`, `discarded` and `stale`.
    pub const fn is_settled(self) -> bool {
        matches!(self, Status::Processed | Status::Discarded | Status::Stale)
    }

    /// `true` for the states that keep the payload for a later run: `failed`, `dead`, `parked`.
    pub const fn keeps_payload(self) -> bool {
        matches!(self, Status::Failed | Status::Dead | Status::Parked)
    }
}

text_as_str!(Status);

impl PartialEq<str> for Status {
    fn eq(&self, other: &str) -> bool {
        self.as_str() == other
    }
}

/// Which existing rows (with the request's fingerprint) a claim may take over, besides a free
/// key: a delivery retries a `failed` one; a replay also a `dead` one; resuming or releasing a
/// parked message takes its `parked` (or, after a failed try, `failed`) row.
///
/// This is the protocol's takeover rule; each backend's claim statement encodes the same rule
/// in SQL, and [`ClaimMode::takes_over`] is what the Rust side checks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ClaimMode {
    /// A delivery from a source (or a direct call).
    Deliver,
    /// An operator's replay of a failed or dead message.
    Replay,
    /// A parked message whose gap filled.
    Resume,
    /// A parked message released despite its gap (park timeout).
    Release,
}

impl ClaimMode {
    /// The text bound into the claim statement: `deliver`, `replay`, `resume` or `release`.
    pub fn as_str(self) -> &'static str {
        match self {
            ClaimMode::Deliver => "deliver",
            ClaimMode::Replay => "replay",
            ClaimMode::Resume => "resume",
            ClaimMode::Release => "release",
        }
    }

    /// Whether a claim in this mode takes over a row in `status` that has the request's
    /// fingerprint, when the row is due (see [`ClaimMode::takes_over_now`]).
    pub fn takes_over(self, status: Status) -> bool {
        match status {
            Status::Failed => true,
            Status::Dead => self == ClaimMode::Replay,
            Status::Parked => matches!(self, ClaimMode::Resume | ClaimMode::Release),
            Status::Processed | Status::Stale | Status::Discarded => false,
        }
    }
}

impl ClaimMode {
    /// Whether a claim in this mode takes over such a row now: as [`ClaimMode::takes_over`],
    /// except that a delivery leaves a `failed` row alone until its next attempt is due
    /// (`retry_in` is the time left, `None` when due). Replays and parked releases do not wait.
    pub fn takes_over_now(self, status: Status, retry_in: Option<std::time::Duration>) -> bool {
        self.takes_over(status)
            && !(status == Status::Failed && self == ClaimMode::Deliver && retry_in.is_some())
    }
}

/// A text that is not one of the stored statuses.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "unknown inbox status `{0}` (expected one of: processed, failed, dead, parked, stale, discarded)"
)]
pub struct UnknownStatus(pub String);

impl FromStr for Status {
    type Err = UnknownStatus;

    /// Parses the stored text (exact, lower case).
    fn from_str(text: &str) -> Result<Self, Self::Err> {
        Status::ALL
            .into_iter()
            .find(|status| status.as_str() == text)
            .ok_or_else(|| UnknownStatus(text.to_owned()))
    }
}

/// Stored as text, on every backend whose text type sqlx knows.
impl<DB: sqlx::Database> sqlx::Type<DB> for Status
where
    String: sqlx::Type<DB>,
{
    fn type_info() -> DB::TypeInfo {
        <String as sqlx::Type<DB>>::type_info()
    }
    fn compatible(ty: &DB::TypeInfo) -> bool {
        <String as sqlx::Type<DB>>::compatible(ty)
    }
}

impl<'r, DB: sqlx::Database> sqlx::Decode<'r, DB> for Status
where
    &'r str: sqlx::Decode<'r, DB>,
{
    fn decode(value: DB::ValueRef<'r>) -> Result<Self, sqlx::error::BoxDynError> {
        let text = <&'r str as sqlx::Decode<'r, DB>>::decode(value)?;
        Ok(text.parse()?)
    }
}

impl<'q, DB: sqlx::Database> sqlx::Encode<'q, DB> for Status
where
    &'static str: sqlx::Encode<'q, DB>,
{
    fn encode_by_ref(
        &self,
        buf: &mut <DB as sqlx::Database>::ArgumentBuffer,
    ) -> Result<sqlx::encode::IsNull, sqlx::error::BoxDynError> {
        self.as_str().encode_by_ref(buf)
    }
}

#[cfg(test)]
mod tests {
    use super::Status;

    #[test]
    fn every_status_round_trips_through_its_text() {
        for status in Status::ALL {
            assert_eq!(status.as_str().parse::<Status>(), Ok(status));
        }
        assert!("PROCESSED".parse::<Status>().is_err());
        assert!("claimed".parse::<Status>().is_err());
    }
}
