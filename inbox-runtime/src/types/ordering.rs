//! Per-aggregate ordering: a sequence guard, and a durable reorder buffer for gaps.

use std::time::Duration;

use crate::types::key::{KeyError, KeyPart};

/// Where a message stands in its aggregate's history: the aggregate's id and the message's
/// sequence number in it (positive, starting at 1, one more for each message of the aggregate).
///
/// Given by `#[message(aggregate)]` / `#[message(sequence)]` fields of a message, or the
/// `aggregate = "…"`, `sequence = "…"` arguments of `#[idempotent]`.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Ordering {
    /// The aggregate (an order id, an account id); compared byte-exactly.
    pub aggregate_id: String,
    /// The message's sequence number within the aggregate, ≥ 1.
    pub sequence: i64,
}

/// What a consumer does with a message whose sequence is newer than the next one expected.
///
/// Either way, a message whose sequence is *not* newer than the aggregate's last applied one is
/// [`Outcome::Stale`](crate::Outcome::Stale): recorded as consumed, not applied.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
#[non_exhaustive]
pub enum GapPolicy {
    /// Apply any newer sequence at once, skipping the gap; an older message arriving later is
    /// then stale. For state that each message overwrites whole ("last writer wins").
    #[default]
    Apply,
    /// Hold a message that arrives before its predecessor: it is stored durably as `parked`
    /// ([`Outcome::Parked`](crate::Outcome::Parked); the delivery can be acked) and applied, in
    /// order, as soon as the missing sequence has been applied. For state built step by step
    /// (placed → paid → shipped).
    Park,
}

/// What to do with a parked message whose gap stays open longer than
/// [`ParkPolicy::timeout`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum ParkTimeout {
    /// Dead-letter it (payload kept), for an operator to replay or discard.
    DeadLetter,
    /// Apply it anyway, giving up on the missing predecessors (they become stale if they come).
    Release,
}

/// How long parked messages may wait for their gap to fill, and what happens then (see
/// [`crate::Dispatcher::sweep_parked`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct ParkPolicy {
    /// Measured from the parked message's first delivery, on the database clock. Default 1 h.
    /// One over [`ParkPolicy::MAX_TIMEOUT`] (100 years; `Duration::MAX` says "never") is taken
    /// as that, which no parked message reaches: a longer window overflows the databases' time
    /// arithmetic (PostgreSQL: `interval out of range`).
    pub timeout: Duration,
    /// Default [`ParkTimeout::DeadLetter`].
    pub on_timeout: ParkTimeout,
}

impl Default for ParkPolicy {
    fn default() -> Self {
        Self {
            timeout: Duration::from_secs(3600),
            on_timeout: ParkTimeout::DeadLetter,
        }
    }
}

impl ParkPolicy {
    /// The longest [`timeout`](Self::timeout) the sweep uses: 100 years of 365 days
    /// (3,153,600,000 s), within every backend's time arithmetic and reached by no parked message.
    pub const MAX_TIMEOUT: Duration = Duration::from_secs(100 * 365 * 86_400);

    /// The timeout the sweep uses: [`timeout`](Self::timeout), at most
    /// [`MAX_TIMEOUT`](Self::MAX_TIMEOUT).
    pub(crate) fn effective_timeout(&self) -> Duration {
        self.timeout.min(Self::MAX_TIMEOUT)
    }

    /// A policy with `timeout` and `on_timeout`.
    pub fn new(timeout: Duration, on_timeout: ParkTimeout) -> Self {
        Self {
            timeout,
            on_timeout,
        }
    }
}

/// A value that can be a sequence number: the integer types and `Option` of them.
pub trait SequencePart {
    /// The sequence as an `i64`, or `None` if null or out of range.
    fn sequence_part(&self) -> Option<i64>;
}

macro_rules! sequence_part {
    ($($ty:ty),*) => {$(
        impl SequencePart for $ty {
            fn sequence_part(&self) -> Option<i64> {
                i64::try_from(*self).ok()
            }
        }
    )*};
}
sequence_part!(
    i8, i16, i32, i64, i128, isize, u8, u16, u32, u64, u128, usize
);

impl<T: SequencePart> SequencePart for Option<T> {
    fn sequence_part(&self) -> Option<i64> {
        self.as_ref().and_then(SequencePart::sequence_part)
    }
}

impl<T: SequencePart + ?Sized> SequencePart for &T {
    fn sequence_part(&self) -> Option<i64> {
        (**self).sequence_part()
    }
}

/// The ordering of `message` from its aggregate and sequence fields.
///
/// # Errors
/// [`KeyError::Null`] / [`KeyError::Empty`] for a null or empty aggregate id,
/// [`KeyError::Null`] for a null sequence, [`KeyError::Invalid`] for a sequence below 1 or
/// beyond `i64`.
pub fn ordering_from_fields(
    message: &'static str,
    aggregate_field: &'static str,
    aggregate: &dyn KeyPart,
    sequence_field: &'static str,
    sequence: &dyn SequencePart,
) -> Result<Option<Ordering>, KeyError> {
    let aggregate_id = match aggregate.key_part() {
        None => {
            return Err(KeyError::Null {
                message,
                field: aggregate_field,
            });
        }
        Some(id) if id.is_empty() => {
            return Err(KeyError::Empty {
                message,
                field: aggregate_field,
            });
        }
        Some(id) => id.into_owned(),
    };
    let sequence = sequence.sequence_part();
    match sequence {
        Some(sequence) if sequence >= 1 => Ok(Some(Ordering {
            aggregate_id,
            sequence,
        })),
        Some(_) => Err(KeyError::Invalid {
            message,
            field: sequence_field,
            reason: "a sequence number must be at least 1",
        }),
        None => Err(KeyError::Invalid {
            message,
            field: sequence_field,
            reason: "the sequence is null or does not fit in an i64",
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ordering_fields_are_validated() {
        assert_eq!(
            ordering_from_fields("m", "a", &"o-1", "s", &3_u32),
            Ok(Some(Ordering {
                aggregate_id: "o-1".into(),
                sequence: 3
            }))
        );
        assert!(matches!(
            ordering_from_fields("m", "a", &"", "s", &1_u32),
            Err(KeyError::Empty { field: "a", .. })
        ));
        assert!(matches!(
            ordering_from_fields("m", "a", &"o", "s", &0_i64),
            Err(KeyError::Invalid { field: "s", .. })
        ));
        assert!(matches!(
            ordering_from_fields("m", "a", &"o", "s", &u64::MAX),
            Err(KeyError::Invalid { field: "s", .. })
        ));
        assert!(matches!(
            ordering_from_fields("m", "a", &"o", "s", &None::<i64>),
            Err(KeyError::Invalid { field: "s", .. })
        ));
    }
}
