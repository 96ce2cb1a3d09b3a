//! Retry policy: in-process retries of transient faults, and the schedule of later attempts.

use std::time::Duration;

use backon::{BackoffBuilder, ExponentialBuilder};

/// How failures are retried and when a message is dead-lettered.
///
/// * A [`Transient`](crate::ErrorClass::Transient) failure is retried in-process, the whole
///   transaction again, up to `transient_retries` times, after exponential delays with full
///   jitter between `transient_min_delay` and `transient_max_delay`.
/// * A [`Retryable`](crate::ErrorClass::Retryable) failure (or a transient one that outlived its
///   in-process retries) is recorded as `failed` with `next_attempt_at = now + delay`, the delay
///   doubling from `retry_min_delay` up to `retry_max_delay` (with jitter), measured on the
///   database clock. The source redelivers it.
/// * The attempt that reaches `max_attempts`, and any [`Permanent`](crate::ErrorClass::Permanent)
///   failure, is recorded as `dead` with its payload.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct RetryPolicy {
    /// Attempts (deliveries that ran the handler) before a message is dead; at least 1.
    /// Default 5. A handler's `#[idempotent(max_attempts = N)]` overrides it.
    pub max_attempts: u32,
    /// In-process retries of a transient failure. Default 3.
    pub transient_retries: usize,
    /// First in-process retry delay. Default 10 ms.
    pub transient_min_delay: Duration,
    /// Longest in-process retry delay. Default 1 s.
    pub transient_max_delay: Duration,
    /// Delay before the first redelivery of a failed message. Default 1 s.
    pub retry_min_delay: Duration,
    /// Longest delay before a redelivery. Default 5 min.
    pub retry_max_delay: Duration,
    /// `last_error` is cut to at most this many bytes (at a character boundary). Default 2048.
    pub max_error_bytes: usize,
}

impl Default for RetryPolicy {
    fn default() -> Self {
        Self {
            max_attempts: 5,
            transient_retries: 3,
            transient_min_delay: Duration::from_millis(10),
            transient_max_delay: Duration::from_secs(1),
            retry_min_delay: Duration::from_secs(1),
            retry_max_delay: Duration::from_secs(300),
            max_error_bytes: 2048,
        }
    }
}

impl RetryPolicy {
    /// Sets [`RetryPolicy::max_attempts`] (values below 1 count as 1).
    pub fn max_attempts(mut self, max_attempts: u32) -> Self {
        self.max_attempts = max_attempts.max(1);
        self
    }

    /// Sets [`RetryPolicy::transient_retries`].
    pub fn transient_retries(mut self, retries: usize) -> Self {
        self.transient_retries = retries;
        self
    }

    /// Sets the redelivery delays ([`RetryPolicy::retry_min_delay`], [`RetryPolicy::retry_max_delay`]).
    pub fn retry_delays(mut self, min: Duration, max: Duration) -> Self {
        self.retry_min_delay = min;
        self.retry_max_delay = max.max(min);
        self
    }

    /// The in-process retry delays for transient faults, at most `transient_retries` of them.
    pub(crate) fn transient_delays(&self) -> impl Iterator<Item = Duration> + use<> {
        ExponentialBuilder::new()
            .with_min_delay(self.transient_min_delay)
            .with_max_delay(self.transient_max_delay)
            .with_max_times(self.transient_retries)
            .with_jitter()
            .build()
    }

    /// The delay before attempt `attempts + 1`, after `attempts` failed ones (1-based).
    pub(crate) fn retry_delay(&self, attempts: u32) -> Duration {
        ExponentialBuilder::new()
            .with_min_delay(self.retry_min_delay)
            .with_max_delay(self.retry_max_delay)
            .without_max_times()
            .with_jitter()
            .build()
            .nth(attempts.saturating_sub(1).min(64) as usize)
            .unwrap_or(self.retry_max_delay)
    }

    /// Cuts an error text to `max_error_bytes`.
    pub(crate) fn bounded_error(&self, text: String) -> String {
        if text.len() <= self.max_error_bytes {
            return text;
        }
        let mut end = self.max_error_bytes.saturating_sub(3);
        while !text.is_char_boundary(end) {
            end -= 1;
        }
        format!("{}...", &text[..end])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn delays_grow_and_stay_bounded() {
        let policy = RetryPolicy::default();
        assert_eq!(policy.transient_delays().count(), 3);
        for delay in policy.transient_delays() {
            assert!(delay <= Duration::from_secs(2), "{delay:?}");
        }
        let first = policy.retry_delay(1);
        assert!(
            first >= Duration::from_secs(1) && first <= Duration::from_secs(2),
            "{first:?}"
        );
        let late = policy.retry_delay(40);
        assert!(late <= Duration::from_secs(600), "{late:?}");
    }

    #[test]
    fn error_text_is_cut_at_a_char_boundary() {
        let policy = RetryPolicy {
            max_error_bytes: 8,
            ..RetryPolicy::default()
        };
        assert_eq!(policy.bounded_error("short".into()), "short");
        assert_eq!(policy.bounded_error("ééééé".into()), "éé...");
    }
}
