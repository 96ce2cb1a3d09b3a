//! The payload limit: the largest payload a dispatcher decodes and a source hands out whole.

use std::fmt;
use std::num::NonZeroUsize;

use serde::{Deserialize, Serialize};

/// The largest payload, in bytes, that a [`Dispatcher`](crate::Dispatcher) decodes and a
/// [`Source`](crate::source::Source) hands out whole: at least [`MIN_BYTES`](Self::MIN_BYTES)
/// (1), at most [`MAX_BYTES`](Self::MAX_BYTES) (256 MiB). Every way to get one checks that —
/// [`new`](Self::new), [`TryFrom<usize>`](#impl-TryFrom<usize>-for-PayloadLimit), deserializing
/// (a plain number of bytes), [`Default`] ([`DEFAULT`](Self::DEFAULT), 1 MiB) — so a value of
/// this type is always safe to act on.
///
/// * **0 is refused**: it would refuse every delivery, and the worker would shunt a whole stream
///   into `inbox_rejections`.
/// * **Above 256 MiB is refused**: a dispatch holds a few copies of a payload at once (the
///   bytes, the decoded message, its canonical form for the fingerprint), once per delivery in
///   flight, and a failed or refused payload must fit one value of every backend's payload
///   column (SQLite's default `SQLITE_MAX_LENGTH` is 10⁹ bytes, PostgreSQL's `bytea` 1 GiB,
///   MySQL's `max_allowed_packet` at most 1 GiB).
///
/// ```
/// use inbox_runtime::types::{PayloadLimit, PayloadLimitError};
///
/// let limit = PayloadLimit::new(64 * 1024)?;
/// assert_eq!(limit.bytes(), 65_536);
/// assert_eq!(PayloadLimit::default(), PayloadLimit::DEFAULT);
/// assert_eq!(PayloadLimit::new(0), Err(PayloadLimitError::Zero));
/// assert!(serde_json::from_str::<PayloadLimit>("0").is_err());
/// # Ok::<(), PayloadLimitError>(())
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(try_from = "usize", into = "usize")]
pub struct PayloadLimit(NonZeroUsize);

impl PayloadLimit {
    /// The smallest limit: 1 byte.
    pub const MIN_BYTES: usize = 1;

    /// The largest limit: 256 MiB (268,435,456 bytes).
    pub const MAX_BYTES: usize = 256 * 1024 * 1024;

    /// The default: 1 MiB (1,048,576 bytes), about the largest message the common brokers
    /// carry by default (SQS: 1 MiB; Kafka: `message.max.bytes` ≈ 1 MB; NATS: 1 MB
    /// `max_payload`).
    pub const DEFAULT: Self = match NonZeroUsize::new(1024 * 1024) {
        Some(bytes) => Self(bytes),
        None => unreachable!(),
    };

    /// A limit of `bytes` bytes.
    ///
    /// # Errors
    /// [`PayloadLimitError::Zero`] for 0; [`PayloadLimitError::AboveMaximum`] above
    /// [`MAX_BYTES`](Self::MAX_BYTES).
    pub const fn new(bytes: usize) -> Result<Self, PayloadLimitError> {
        if bytes > Self::MAX_BYTES {
            return Err(PayloadLimitError::AboveMaximum { bytes });
        }
        match NonZeroUsize::new(bytes) {
            Some(bytes) => Ok(Self(bytes)),
            None => Err(PayloadLimitError::Zero),
        }
    }

    /// The limit, in bytes (1 to [`MAX_BYTES`](Self::MAX_BYTES)).
    pub const fn bytes(self) -> usize {
        self.0.get()
    }
}

impl Default for PayloadLimit {
    fn default() -> Self {
        Self::DEFAULT
    }
}

impl TryFrom<usize> for PayloadLimit {
    type Error = PayloadLimitError;

    fn try_from(bytes: usize) -> Result<Self, Self::Error> {
        Self::new(bytes)
    }
}

impl From<PayloadLimit> for usize {
    fn from(limit: PayloadLimit) -> Self {
        limit.bytes()
    }
}

impl fmt::Display for PayloadLimit {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} bytes", self.bytes())
    }
}

/// Why a number of bytes is not a [`PayloadLimit`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum PayloadLimitError {
    /// The limit is 0 bytes.
    #[error(
        "a payload limit of 0 bytes would refuse every delivery: the limit must be at least 1 byte"
    )]
    Zero,
    /// The limit is above [`PayloadLimit::MAX_BYTES`].
    #[error(
        "a payload limit of {bytes} bytes is above the maximum of 268435456 bytes (256 MiB): a \
         dispatch holds a few copies of a payload, and a refused or failed one must fit one \
         database value"
    )]
    AboveMaximum {
        /// The limit asked for, in bytes.
        bytes: usize,
    },
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_way_to_a_limit_checks_it() {
        // The constructor.
        assert_eq!(PayloadLimit::new(0), Err(PayloadLimitError::Zero));
        assert_eq!(PayloadLimit::new(1).map(PayloadLimit::bytes), Ok(1));
        assert_eq!(
            PayloadLimit::new(PayloadLimit::MAX_BYTES).map(PayloadLimit::bytes),
            Ok(268_435_456)
        );
        assert_eq!(
            PayloadLimit::new(PayloadLimit::MAX_BYTES + 1),
            Err(PayloadLimitError::AboveMaximum { bytes: 268_435_457 })
        );
        assert_eq!(
            PayloadLimit::new(usize::MAX),
            Err(PayloadLimitError::AboveMaximum { bytes: usize::MAX })
        );
        // TryFrom: the same checks and errors.
        assert_eq!(PayloadLimit::try_from(0), Err(PayloadLimitError::Zero));
        assert_eq!(
            PayloadLimit::try_from(PayloadLimit::MAX_BYTES + 1),
            Err(PayloadLimitError::AboveMaximum { bytes: 268_435_457 })
        );
        assert_eq!(PayloadLimit::try_from(4096).map(usize::from), Ok(4096));
        // Default and the constant.
        assert_eq!(PayloadLimit::default().bytes(), 1_048_576);
        assert_eq!(PayloadLimit::DEFAULT.bytes(), 1_048_576);
        // Deserializing: the same checks, the same texts.
        let zero = serde_json::from_str::<PayloadLimit>("0").unwrap_err();
        assert_eq!(zero.to_string(), PayloadLimitError::Zero.to_string());
        let above = serde_json::from_str::<PayloadLimit>("268435457").unwrap_err();
        assert_eq!(
            above.to_string(),
            PayloadLimitError::AboveMaximum { bytes: 268_435_457 }.to_string()
        );
        assert!(serde_json::from_str::<PayloadLimit>("-1").is_err());
        assert_eq!(
            serde_json::from_str::<PayloadLimit>("4096")
                .unwrap()
                .bytes(),
            4096
        );
        assert_eq!(
            serde_json::to_string(&PayloadLimit::new(4096).unwrap()).unwrap(),
            "4096"
        );
        // The texts.
        assert_eq!(
            PayloadLimitError::Zero.to_string(),
            "a payload limit of 0 bytes would refuse every delivery: the limit must be at least 1 \
             byte"
        );
        assert_eq!(
            PayloadLimitError::AboveMaximum { bytes: 268_435_457 }.to_string(),
            "a payload limit of 268435457 bytes is above the maximum of 268435456 bytes (256 MiB): \
             a dispatch holds a few copies of a payload, and a refused or failed one must fit one \
             database value"
        );
        assert_eq!(PayloadLimit::new(10).unwrap().to_string(), "10 bytes");
    }
}
