//! Error classes: what a failure means for the message (retry now, retry later, or never).

use std::error::Error as StdError;
use std::fmt;

/// A lost race between concurrent transactions (deadlock, serialization failure, lock wait
/// timeout), as each backend's error codes say: see the `store` backends.
pub(crate) use crate::store::Contention;
use crate::store::ErrorKind;

/// A boxed error, as the dispatcher carries handler errors of any type.
pub type BoxError = Box<dyn std::error::Error + Send + Sync + 'static>;

/// How a failure is handled.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum ErrorClass {
    /// A passing fault (serialization failure, deadlock, lost connection, pool timeout, SQLite
    /// busy): the whole transaction is retried in-process at once, with exponential backoff and
    /// jitter, a bounded number of times ([`crate::RetryPolicy::transient_retries`]).
    Transient,
    /// Worth another try later: recorded as `failed` with a next attempt time, redelivered, and
    /// dead-lettered once [`crate::RetryPolicy::max_attempts`] is reached. The default for
    /// handler errors.
    Retryable,
    /// Will never succeed (invalid data, a business rule): recorded as `dead` with its payload at
    /// once, for an operator to inspect, replay or discard.
    Permanent,
}

impl ErrorClass {
    /// The class's name as used in logs: `"transient"`, `"retryable"` or `"permanent"`.
    pub fn as_str(self) -> &'static str {
        match self {
            ErrorClass::Transient => "transient",
            ErrorClass::Retryable => "retryable",
            ErrorClass::Permanent => "permanent",
        }
    }
}

/// Lets a handler's error type say which [`ErrorClass`] each of its values belongs to.
///
/// Optional: without it, an error that implements `std::error::Error` (or `AsRef<dyn Error>`,
/// like `anyhow::Error`) is classified by walking its `source()` chain — a [`Permanent`] anywhere
/// in it makes it permanent, a transient `sqlx::Error` transient — and anything else is
/// [`ErrorClass::Retryable`].
///
/// ```
/// use inbox_runtime::{Classify, ErrorClass};
///
/// #[derive(Debug)]
/// enum PaymentError { UnknownAccount(String), Db(sqlx::Error) }
///
/// impl Classify for PaymentError {
///     fn class(&self) -> ErrorClass {
///         match self {
///             PaymentError::UnknownAccount(_) => ErrorClass::Permanent,
///             PaymentError::Db(error) => error.class(),
///         }
///     }
/// }
/// assert_eq!(PaymentError::UnknownAccount("a".into()).class(), ErrorClass::Permanent);
/// ```
pub trait Classify {
    /// The class of this error.
    fn class(&self) -> ErrorClass;
}

impl Classify for sqlx::Error {
    /// Transient: I/O, TLS, protocol and pool-timeout errors, a crashed connection worker, and
    /// database errors whose SQLSTATE says so (PostgreSQL `40001` serialization failure, `40P01`
    /// deadlock, `55P03` lock not available, class `08` connection exceptions, `53300` too many
    /// connections, `57P01`–`57P03` shutdown, `57P05` idle session and `25P03` idle
    /// transaction timeouts; SQLite `BUSY`/`LOCKED` codes 5, 6, 261, 262, 517; MySQL/MariaDB
    /// errors 1213 deadlock (SQLSTATE `40001`) and 1205 lock wait timeout).
    /// [`ErrorClass::Permanent`]: MySQL/MariaDB error 1153, a statement larger than the server's
    /// `max_allowed_packet` (SQLSTATE `08S01`, but no connection problem: the same statement
    /// fails again). Everything else is [`ErrorClass::Retryable`].
    fn class(&self) -> ErrorClass {
        match self {
            sqlx::Error::Io(_)
            | sqlx::Error::Tls(_)
            | sqlx::Error::Protocol(_)
            | sqlx::Error::PoolTimedOut
            | sqlx::Error::WorkerCrashed => ErrorClass::Transient,
            // What the code means is the backend's to say (see the `store` backends).
            sqlx::Error::Database(db) => match crate::store::database_error_kind(&**db) {
                Some(ErrorKind::Transient) => ErrorClass::Transient,
                Some(ErrorKind::Permanent) => ErrorClass::Permanent,
                None => ErrorClass::Retryable,
            },
            _ => ErrorClass::Retryable,
        }
    }
}

/// Marks an error as permanent: the message is dead-lettered at once, without retries.
///
/// ```
/// use inbox_runtime::Permanent;
///
/// fn check(amount: i64) -> Result<(), Permanent> {
///     if amount < 0 {
///         return Err(Permanent::new(format!("negative amount {amount}")));
///     }
///     Ok(())
/// }
/// assert_eq!(check(-1).unwrap_err().to_string(), "negative amount -1");
/// ```
pub struct Permanent(BoxError);

impl Permanent {
    /// Wraps `error` (anything convertible to a boxed error, including a `String`).
    pub fn new(error: impl Into<BoxError>) -> Self {
        Self(error.into())
    }

    /// The wrapped error.
    pub fn into_inner(self) -> BoxError {
        self.0
    }
}

impl fmt::Debug for Permanent {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_tuple("Permanent").field(&self.0).finish()
    }
}

impl fmt::Display for Permanent {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(&self.0, f)
    }
}

impl StdError for Permanent {
    fn source(&self) -> Option<&(dyn StdError + 'static)> {
        self.0.source()
    }
}

impl Classify for Permanent {
    fn class(&self) -> ErrorClass {
        ErrorClass::Permanent
    }
}

/// Classifies an error by its `source()` chain: the first [`Permanent`] or `sqlx::Error` found
/// decides; otherwise [`ErrorClass::Retryable`].
pub fn classify_error_chain(error: &(dyn StdError + 'static)) -> ErrorClass {
    let mut next = Some(error);
    while let Some(error) = next {
        if error.is::<Permanent>() {
            return ErrorClass::Permanent;
        }
        if let Some(error) = error.downcast_ref::<sqlx::Error>() {
            return error.class();
        }
        next = error.source();
    }
    ErrorClass::Retryable
}

/// Autoref-specialized classification for generated code: `Classify` if implemented, else the
/// error chain of a `std::error::Error` or an `AsRef<dyn Error>` (anyhow), else `Retryable`.
#[doc(hidden)]
pub(crate) mod probe {
    use super::{Classify, ErrorClass, StdError, classify_error_chain};

    pub struct Probe<'a, E>(pub &'a E);

    impl<E> Clone for Probe<'_, E> {
        fn clone(&self) -> Self {
            *self
        }
    }
    impl<E> Copy for Probe<'_, E> {}

    pub trait ViaClassify {
        fn inbox_class(self) -> ErrorClass;
    }
    impl<E: Classify> ViaClassify for &&&Probe<'_, E> {
        fn inbox_class(self) -> ErrorClass {
            self.0.class()
        }
    }

    pub trait ViaStdError {
        fn inbox_class(self) -> ErrorClass;
    }
    impl<E: StdError + 'static> ViaStdError for &&Probe<'_, E> {
        fn inbox_class(self) -> ErrorClass {
            classify_error_chain(self.0)
        }
    }

    pub trait ViaAsRefError {
        fn inbox_class(self) -> ErrorClass;
    }
    impl<E: AsRef<dyn StdError + Send + Sync + 'static>> ViaAsRefError for &Probe<'_, E> {
        fn inbox_class(self) -> ErrorClass {
            classify_error_chain(self.0.as_ref())
        }
    }

    pub trait ViaFallback {
        fn inbox_class(self) -> ErrorClass;
    }
    impl<E> ViaFallback for Probe<'_, E> {
        fn inbox_class(self) -> ErrorClass {
            ErrorClass::Retryable
        }
    }
}

#[cfg(test)]
mod tests {
    use super::probe::*;
    use super::*;

    #[derive(Debug)]
    struct Plain;

    #[derive(Debug, thiserror::Error)]
    #[error("wrapped")]
    struct Wrapper(#[source] Permanent);

    #[test]
    // The borrows are the mechanism: each `&` level selects another probe.
    #[allow(clippy::needless_borrow)]
    fn probes_pick_the_most_specific_classification() {
        assert_eq!(
            (&&&Probe(&Permanent::new("x"))).inbox_class(),
            ErrorClass::Permanent
        );
        assert_eq!(
            (&&&Probe(&Wrapper(Permanent::new("x")))).inbox_class(),
            ErrorClass::Permanent
        );
        assert_eq!(
            (&&&Probe(&sqlx::Error::PoolTimedOut)).inbox_class(),
            ErrorClass::Transient
        );
        assert_eq!(
            (&&&Probe(&sqlx::Error::RowNotFound)).inbox_class(),
            ErrorClass::Retryable
        );
        let boxed: BoxError = Box::new(Permanent::new("x"));
        assert_eq!((&&&Probe(&boxed)).inbox_class(), ErrorClass::Permanent);
        assert_eq!((&&&Probe(&Plain)).inbox_class(), ErrorClass::Retryable);
        assert_eq!((&&&Probe(&"text")).inbox_class(), ErrorClass::Retryable);
    }
}
