//! Outcomes of one message for one consumer.

/// What happened to one message for one consumer, when nothing went wrong.
///
/// Errors (a handler error, a [`crate::Conflict`], a bad key, a database fault) are the `Err` side
/// of [`crate::Error`], never an outcome: a duplicate is never reported as an error, and an error
/// never as "already processed".
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
#[must_use = "an outcome tells whether the effect was applied"]
pub enum Outcome<T> {
    /// The key was claimed, the handler ran and its transaction committed; carries the handler's
    /// return value. The source may now ack the delivery.
    Processed(T),
    /// The key had already been processed with the same payload fingerprint: nothing ran,
    /// nothing was written. The source may ack the delivery.
    Duplicate,
    /// The key is dead-lettered (a permanent error, or `max_attempts` reached, earlier): nothing
    /// ran. The payload is kept in the inbox; the source may ack the delivery. Replay it with
    /// [`crate::Dispatcher::replay`] or the admin CLI.
    Dead,
    /// An operator discarded the key: nothing ran, nothing will. The source may ack.
    Discarded,
    /// Per-aggregate ordering: the message's sequence is not newer than the last one applied
    /// to its aggregate. Recorded as consumed (`stale`), not applied. The source may ack.
    Stale,
    /// The key's last attempt failed and its next attempt is not due yet (`next_attempt_at`,
    /// database clock): nothing ran, and the attempt is not counted. Redeliver it after
    /// `retry_in` (the [`Worker`](crate::Worker) requeues it with that delay). Replays do not
    /// wait.
    NotYet {
        /// How long until the next attempt is due.
        retry_in: std::time::Duration,
    },
    /// Per-aggregate ordering with `gaps = "park"`: the message came before its predecessor.
    /// Stored durably (`parked`, payload kept) and applied, in order, once the gap fills. The
    /// source may ack.
    Parked,
}

impl<T> Outcome<T> {
    /// `true` for [`Outcome::Processed`].
    pub fn is_processed(&self) -> bool {
        matches!(self, Outcome::Processed(_))
    }

    /// `true` for [`Outcome::Duplicate`].
    pub fn is_duplicate(&self) -> bool {
        matches!(self, Outcome::Duplicate)
    }

    /// The handler's value, if the message was processed now.
    pub fn processed(self) -> Option<T> {
        match self {
            Outcome::Processed(value) => Some(value),
            _ => None,
        }
    }

    /// Maps the processed value, keeping the other outcomes.
    pub fn map<U>(self, f: impl FnOnce(T) -> U) -> Outcome<U> {
        match self {
            Outcome::Processed(value) => Outcome::Processed(f(value)),
            Outcome::Duplicate => Outcome::Duplicate,
            Outcome::Dead => Outcome::Dead,
            Outcome::Discarded => Outcome::Discarded,
            Outcome::Stale => Outcome::Stale,
            Outcome::Parked => Outcome::Parked,
            Outcome::NotYet { retry_in } => Outcome::NotYet { retry_in },
        }
    }

    /// The outcome's name as used in logs and metrics: `"processed"`, `"duplicate"`, `"dead"`,
    /// `"discarded"`, `"stale"`, `"parked"` or `"not_yet"`.
    pub fn kind(&self) -> &'static str {
        match self {
            Outcome::Processed(_) => "processed",
            Outcome::Duplicate => "duplicate",
            Outcome::Dead => "dead",
            Outcome::Discarded => "discarded",
            Outcome::Stale => "stale",
            Outcome::Parked => "parked",
            Outcome::NotYet { .. } => "not_yet",
        }
    }
}
