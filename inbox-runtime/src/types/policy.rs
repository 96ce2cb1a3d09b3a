//! Retry policy: in-process retries of transient faults, and the schedule of later attempts.

use std::time::Duration;

use backon::{BackoffBuilder, ExponentialBuilder};

/// How failures are retried and when a message is dead-lettered.
///
/// * A [`Transient`](crate::ErrorClass::Transient) failure is retried in-process, the whole
///   transaction again, up to [`transient_retries`](Self::transient_retries) times, after
///   exponential delays from the [transient delays](Self::transient_delays)' minimum up to their
///   maximum, each with jitter (see below).
/// * A [`Retryable`](crate::ErrorClass::Retryable) failure (or a transient one that outlived its
///   in-process retries) is recorded as `failed` with `next_attempt_at = now + delay`, the delay
///   doubling from the [redelivery delays](Self::retry_delays)' minimum up to their maximum,
///   with jitter, measured on the database clock. The source redelivers it.
///
/// **Jitter** (the `backon` crate's, added to a delay): a delay `d` of the schedule above becomes
/// a random one in `[d, 2d)`, so that workers that failed together do not retry together; the
/// longest is under twice the maximum (with the defaults, redeliveries 1–2 s after a first
/// failure and at most 10 minutes apart later).
/// * The attempt that reaches [`max_attempts`](Self::max_attempts), and any
///   [`Permanent`](crate::ErrorClass::Permanent) failure, is recorded as `dead` with its payload.
///
/// # Invariants
///
/// Every `RetryPolicy` keeps the rules its setters apply, whatever built it: the fields are
/// private (read them with the `get_` methods), and [`Default`] is a valid policy. The setters
/// bring what would break the runtime within bounds that keep every guarantee: `max_attempts(0)`
/// counts as 1; a delay's maximum below its minimum is raised to it; redelivery delays above
/// [`MAX_RETRY_DELAY`](Self::MAX_RETRY_DELAY) (30 days: a longer one overflows the databases'
/// time arithmetic, the failure could not be recorded, and the message would never be counted)
/// and in-process delays above [`MAX_TRANSIENT_DELAY`](Self::MAX_TRANSIENT_DELAY) (1 minute:
/// the delivery holds its connection while it waits) are lowered to them, and so are in-process
/// retries above [`MAX_TRANSIENT_RETRIES`](Self::MAX_TRANSIENT_RETRIES) (100); an error text limit
/// above [`MAX_ERROR_BYTES`](Self::MAX_ERROR_BYTES) (65,535 bytes, what MySQL's `TEXT` column
/// holds: a longer `last_error` fails the failure record) is lowered to it.
///
/// ```
/// use std::time::Duration;
/// use inbox_runtime::RetryPolicy;
///
/// let policy = RetryPolicy::default()
///     .max_attempts(0)
///     .retry_delays(Duration::from_secs(5), Duration::MAX)
///     .max_error_bytes(1 << 20);
/// assert_eq!(policy.get_max_attempts(), 1);
/// assert_eq!(policy.get_retry_delays(), (Duration::from_secs(5), RetryPolicy::MAX_RETRY_DELAY));
/// assert_eq!(policy.get_max_error_bytes(), RetryPolicy::MAX_ERROR_BYTES);
/// ```
///
/// ```compile_fail
/// # use inbox_runtime::RetryPolicy;
/// let mut policy = RetryPolicy::default();
/// policy.max_error_bytes = 1 << 20; // private field: does not compile
/// ```
///
/// ```compile_fail
/// # use inbox_runtime::RetryPolicy;
/// // private fields: neither a literal nor a struct update compiles
/// let policy = RetryPolicy { max_attempts: 0, ..RetryPolicy::default() };
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RetryPolicy {
    /// Attempts (deliveries that ran the handler) before a message is dead; at least 1.
    max_attempts: u32,
    /// In-process retries of a transient failure.
    transient_retries: usize,
    /// In-process retry delays: the first and the longest.
    transient_delays: Delays,
    /// Redelivery delays of a failed message: before the first redelivery, and the longest.
    retry_delays: Delays,
    /// `last_error` is cut to at most this many bytes.
    max_error_bytes: usize,
}

impl Default for RetryPolicy {
    /// 5 attempts; 3 in-process retries of a transient failure, 10 ms to 1 s apart; redeliveries
    /// 1 s to 5 min apart (before jitter, which makes a delay `d` one in `[d, 2d)`); error texts
    /// cut to 2048 bytes.
    fn default() -> Self {
        Self {
            max_attempts: 5,
            transient_retries: 3,
            transient_delays: Delays {
                min: Duration::from_millis(10),
                max: Duration::from_secs(1),
            },
            retry_delays: Delays {
                min: Duration::from_secs(1),
                max: Duration::from_secs(300),
            },
            max_error_bytes: 2048,
        }
    }
}

/// Exponential delays: the first `min`, doubling up to `max`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Delays {
    /// The first delay.
    min: Duration,
    /// The longest delay.
    max: Duration,
}

impl Delays {
    /// `min` and `max`, both at most `maximum` and `max` at least `min`.
    fn bounded(min: Duration, max: Duration, maximum: Duration) -> Self {
        let min = min.min(maximum);
        Self {
            min,
            max: max.min(maximum).max(min),
        }
    }

    /// `(min, max)`.
    fn pair(self) -> (Duration, Duration) {
        (self.min, self.max)
    }

    /// The backoff from `min` to `max`, each delay `d` jittered into `[d, 2d)`.
    fn backoff(self) -> ExponentialBuilder {
        ExponentialBuilder::new()
            .with_min_delay(self.min)
            .with_max_delay(self.max)
            .with_jitter()
    }
}

impl RetryPolicy {
    /// The longest redelivery delay a policy has: 30 days. A message that should wait longer
    /// belongs in the dead letters (replay it when it can run).
    pub const MAX_RETRY_DELAY: Duration = Duration::from_secs(30 * 86_400);

    /// The longest in-process retry delay a policy has: 1 minute (the delivery keeps its
    /// database connection while it waits; longer waits are what redeliveries are for).
    pub const MAX_TRANSIENT_DELAY: Duration = Duration::from_secs(60);

    /// The most in-process retries of a transient failure a policy has: 100 (the delivery keeps
    /// its database connection through them; a fault that outlives them is recorded as `failed`
    /// and redelivered, so that it is counted against [`max_attempts`](Self::max_attempts)).
    pub const MAX_TRANSIENT_RETRIES: usize = 100;

    /// The largest error text limit a policy has, in bytes: 65,535, what MySQL's `TEXT`
    /// column `last_error` holds.
    pub const MAX_ERROR_BYTES: usize = 65_535;

    /// Sets the attempts (deliveries that ran the handler) before a message is dead (default 5;
    /// 0 counts as 1: the first failure is then the last). A handler's
    /// `#[idempotent(max_attempts = N)]` overrides it.
    pub fn max_attempts(mut self, max_attempts: u32) -> Self {
        self.max_attempts = max_attempts.max(1);
        self
    }

    /// The attempts before a message is dead (at least 1).
    pub fn get_max_attempts(&self) -> u32 {
        self.max_attempts
    }

    /// Sets the in-process retries of a transient failure (default 3; 0: none, the failure is
    /// recorded at once). Lowered to [`MAX_TRANSIENT_RETRIES`](Self::MAX_TRANSIENT_RETRIES)
    /// (100) if above it: a fault retried forever would never be recorded or counted.
    pub fn transient_retries(mut self, retries: usize) -> Self {
        self.transient_retries = retries.min(Self::MAX_TRANSIENT_RETRIES);
        self
    }

    /// The in-process retries of a transient failure.
    pub fn get_transient_retries(&self) -> usize {
        self.transient_retries
    }

    /// Sets the in-process retry delays of transient failures: the first `min`, doubling up to
    /// `max`, each with jitter in `[d, 2d)` (default 10 ms to 1 s before jitter). Both are lowered to
    /// [`MAX_TRANSIENT_DELAY`](Self::MAX_TRANSIENT_DELAY) (1 minute) if above it, and `max` is
    /// raised to `min` if below it.
    pub fn transient_delays(mut self, min: Duration, max: Duration) -> Self {
        self.transient_delays = Delays::bounded(min, max, Self::MAX_TRANSIENT_DELAY);
        self
    }

    /// The in-process retry delays of transient failures: (first, longest).
    pub fn get_transient_delays(&self) -> (Duration, Duration) {
        self.transient_delays.pair()
    }

    /// Sets the redelivery delays of failed messages: the first `min`, doubling up to `max`,
    /// each with jitter in `[d, 2d)` (default 1 s to 5 min before jitter). Both are lowered to
    /// [`MAX_RETRY_DELAY`](Self::MAX_RETRY_DELAY) (30 days) if above it, and `max` is raised to
    /// `min` if below it.
    pub fn retry_delays(mut self, min: Duration, max: Duration) -> Self {
        self.retry_delays = Delays::bounded(min, max, Self::MAX_RETRY_DELAY);
        self
    }

    /// The redelivery delays of failed messages: (first, longest).
    pub fn get_retry_delays(&self) -> (Duration, Duration) {
        self.retry_delays.pair()
    }

    /// Sets the most bytes of an error text kept as `last_error` (default 2048; values above
    /// [`MAX_ERROR_BYTES`](Self::MAX_ERROR_BYTES), 65,535, are lowered to it): a longer text is
    /// cut at a character boundary and ends with `...` (a limit under 4 bytes cuts without it).
    pub fn max_error_bytes(mut self, bytes: usize) -> Self {
        self.max_error_bytes = bytes.min(Self::MAX_ERROR_BYTES);
        self
    }

    /// The most bytes of an error text kept as `last_error`.
    pub fn get_max_error_bytes(&self) -> usize {
        self.max_error_bytes
    }

    /// The in-process retry delays for transient faults, at most `transient_retries` of them.
    pub(crate) fn transient_schedule(&self) -> impl Iterator<Item = Duration> + use<> {
        self.transient_delays
            .backoff()
            .with_max_times(self.transient_retries)
            .build()
    }

    /// The delay before attempt `attempts + 1`, after `attempts` failed ones (1-based).
    pub(crate) fn retry_delay(&self, attempts: u32) -> Duration {
        self.retry_delays
            .backoff()
            .without_max_times()
            .build()
            .nth(attempts.saturating_sub(1).min(64) as usize)
            .unwrap_or(self.retry_delays.max)
    }

    /// Cuts an error text to `max_error_bytes`.
    pub(crate) fn bounded_error(&self, text: String) -> String {
        if text.len() <= self.max_error_bytes {
            return text;
        }
        let ellipsis = if self.max_error_bytes > 3 { "..." } else { "" };
        let mut end = self.max_error_bytes - ellipsis.len();
        while !text.is_char_boundary(end) {
            end -= 1;
        }
        format!("{}{ellipsis}", &text[..end])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn delays_grow_and_stay_bounded() {
        let policy = RetryPolicy::default();
        assert_eq!(policy.transient_schedule().count(), 3);
        for delay in policy.transient_schedule() {
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
        let policy = RetryPolicy::default().max_error_bytes(8);
        assert_eq!(policy.bounded_error("short".into()), "short");
        assert_eq!(policy.bounded_error("ééééé".into()), "éé...");
    }

    /// Issue 31: every way to set a policy's values ends within the bounds — the setters raise
    /// or lower what would break the runtime, `Default` is within them, and the fields cannot
    /// be set otherwise (private: the `compile_fail` examples on `RetryPolicy`).
    #[test]
    fn every_setter_keeps_the_bounds() {
        let day = Duration::from_secs(86_400);
        let default = RetryPolicy::default();
        assert_eq!(default.get_max_attempts(), 5);
        assert_eq!(default.get_transient_retries(), 3);
        assert_eq!(
            default.get_transient_delays(),
            (Duration::from_millis(10), Duration::from_secs(1))
        );
        assert_eq!(
            default.get_retry_delays(),
            (Duration::from_secs(1), Duration::from_secs(300))
        );
        assert_eq!(default.get_max_error_bytes(), 2048);

        let policy = RetryPolicy::default()
            .max_attempts(0)
            .retry_delays(Duration::MAX, Duration::MAX)
            .transient_delays(Duration::MAX, Duration::ZERO)
            .transient_retries(usize::MAX)
            .max_error_bytes(usize::MAX);
        assert_eq!(policy.get_max_attempts(), 1);
        assert_eq!(policy.get_transient_retries(), 100);
        assert_eq!(policy.transient_schedule().count(), 100);
        assert_eq!(
            policy.get_retry_delays(),
            (RetryPolicy::MAX_RETRY_DELAY, RetryPolicy::MAX_RETRY_DELAY)
        );
        assert_eq!(RetryPolicy::MAX_RETRY_DELAY, 30 * day);
        assert_eq!(
            policy.get_transient_delays(),
            (
                RetryPolicy::MAX_TRANSIENT_DELAY,
                RetryPolicy::MAX_TRANSIENT_DELAY
            )
        );
        assert_eq!(policy.get_max_error_bytes(), 65_535);
        // A maximum below the minimum is raised to it.
        let swapped = RetryPolicy::default().retry_delays(Duration::from_secs(60), Duration::ZERO);
        assert_eq!(
            swapped.get_retry_delays(),
            (Duration::from_secs(60), Duration::from_secs(60))
        );

        // Where the policy is acted on: the longest delay, jitter included, is under twice the
        // cap (60 days), which every backend's time arithmetic holds.
        for attempts in [1, 2, 40, u32::MAX] {
            let delay = policy.retry_delay(attempts);
            assert!(delay >= 30 * day && delay < 60 * day, "{delay:?}");
            assert!(i64::try_from(delay.as_millis()).is_ok());
        }
        assert!(
            policy
                .transient_schedule()
                .all(|d| d < Duration::from_secs(120))
        );
        let text = "x".repeat(100_000);
        assert_eq!(policy.bounded_error(text).len(), 65_535);
    }

    /// A limit too small for the ellipsis cuts without it, and never exceeds the limit.
    #[test]
    fn tiny_error_limits_are_never_exceeded() {
        for limit in 0..=4 {
            let policy = RetryPolicy::default().max_error_bytes(limit);
            let cut = policy.bounded_error("abcdef".into());
            assert!(cut.len() <= limit, "{limit}: {cut}");
        }
        let three = RetryPolicy::default().max_error_bytes(3);
        assert_eq!(three.bounded_error("abcdef".into()), "abc");
        let four = RetryPolicy::default().max_error_bytes(4);
        assert_eq!(four.bounded_error("abcdef".into()), "a...");
    }
}
