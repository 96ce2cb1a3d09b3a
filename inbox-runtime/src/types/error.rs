//! Errors of the claim-then-act wrapper and the dispatcher.

use std::time::Duration;

use crate::store::Backend;
use crate::types::classify::{BoxError, ErrorClass};
use crate::types::fingerprint::{Fingerprint, FingerprintError};
use crate::types::key::{IdempotencyKey, KeyError};
use crate::types::status::text_as_str;

/// Why one message was not processed (or not known to be) by one consumer.
///
/// `E` is the handler's own error type, kept intact in [`Error::Handler`].
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error<E> {
    /// The handler returned an error. Its transaction, claim included, was rolled back; the
    /// attempt was then recorded (see [`HandlerFailure::disposition`]).
    #[error("{0}")]
    Handler(HandlerFailure<E>),
    /// The key was processed before with a *different* payload. Nothing ran; nothing written.
    #[error(transparent)]
    Conflict(#[from] Conflict),
    /// The message has no usable idempotency key. Nothing ran; nothing written.
    #[error(transparent)]
    Key(#[from] KeyError),
    /// The message could not be fingerprinted. Nothing ran; nothing written.
    #[error(transparent)]
    Fingerprint(#[from] FingerprintError),
    /// The database failed. See [`StoreError::operation`] for whether the outcome is known.
    #[error(transparent)]
    Database(#[from] StoreError),
    /// A [`TransactionHook`](crate::TransactionHook)'s `before_commit` failed after the handler
    /// returned `Ok`: the transaction (claim, handler writes, hook writes) was rolled back and
    /// the attempt recorded as failed (see [`HookError::disposition`]).
    #[error(transparent)]
    Hook(#[from] HookError),
}

impl<E> Error<E> {
    /// The handler's error, if that is what this is.
    pub fn into_handler_error(self) -> Option<E> {
        match self {
            Error::Handler(failure) => Some(failure.error),
            _ => None,
        }
    }

    /// The conflict, if that is what this is.
    pub fn as_conflict(&self) -> Option<&Conflict> {
        match self {
            Error::Conflict(conflict) => Some(conflict),
            _ => None,
        }
    }

    /// The error's name as used in logs and metrics: `"handler"`, `"conflict"`, `"key"`,
    /// `"fingerprint"`, `"database"` or `"hook"`.
    pub fn kind(&self) -> &'static str {
        match self {
            Error::Handler(_) => "handler",
            Error::Conflict(_) => "conflict",
            Error::Key(_) => "key",
            Error::Fingerprint(_) => "fingerprint",
            Error::Database(_) => "database",
            Error::Hook(_) => "hook",
        }
    }

    /// The handler failure, if that is what this is.
    pub fn as_handler_failure(&self) -> Option<&HandlerFailure<E>> {
        match self {
            Error::Handler(failure) => Some(failure),
            _ => None,
        }
    }

    /// Converts the handler error type, keeping every other variant.
    pub fn map_handler<F>(self, f: impl FnOnce(E) -> F) -> Error<F> {
        match self {
            Error::Handler(failure) => Error::Handler(HandlerFailure {
                error: f(failure.error),
                class: failure.class,
                attempts: failure.attempts,
                disposition: failure.disposition,
            }),
            Error::Conflict(conflict) => Error::Conflict(conflict),
            Error::Key(error) => Error::Key(error),
            Error::Fingerprint(error) => Error::Fingerprint(error),
            Error::Database(error) => Error::Database(error),
            Error::Hook(error) => Error::Hook(error),
        }
    }
}

/// A handler error, with what became of the attempt.
#[derive(Debug)]
#[non_exhaustive]
pub struct HandlerFailure<E> {
    /// The handler's own error, intact.
    pub error: E,
    /// Its class ([`crate::Classify`], or the error chain, or `Retryable`).
    pub class: ErrorClass,
    /// Attempts that ran the handler for this key so far, this one included.
    pub attempts: u32,
    /// What was recorded.
    pub disposition: Disposition,
}

impl<E: std::fmt::Display> std::fmt::Display for HandlerFailure<E> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "handler failed ({} error, attempt {}",
            self.class.as_str(),
            self.attempts
        )?;
        match self.disposition {
            Disposition::Retry { after } => write!(f, ", retry in {} ms", after.as_millis())?,
            Disposition::Dead => f.write_str(", dead-lettered")?,
            Disposition::NotRecorded => f.write_str(", not recorded")?,
        }
        write!(f, "): {}", self.error)
    }
}

/// What was recorded for a failed attempt, and so what a source should do with the delivery.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Disposition {
    /// Recorded as `failed` (payload kept): redeliver it, no earlier than `after`.
    Retry {
        /// Delay before the next attempt (also stored as `next_attempt_at`, database clock).
        after: Duration,
    },
    /// Recorded as `dead` with its payload (permanent, or `max_attempts` reached): ack the
    /// delivery; an operator can replay or discard it.
    Dead,
    /// Nothing was recorded (the database failed too, or a concurrent delivery processed the
    /// key meanwhile): redeliver it.
    NotRecorded,
}

impl Disposition {
    /// `true` if the delivery may be acked: the message is safe in the inbox as `dead`.
    pub fn is_settled(&self) -> bool {
        matches!(self, Disposition::Dead)
    }
}

/// The same idempotency key arrived with a different payload than the one processed.
///
/// A producer that reuses an id for a different intent, or a corrupted redelivery: it must not
/// be applied (it is not the processed message) and must not pass as a duplicate (it is not the
/// same message either). The two fingerprints are SHA-256 over the RFC 8785 canonical JSON of each
/// payload (see [`Fingerprint`]).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "conflict: consumer `{consumer}` already processed message `{message_name}` with key `{key}` \
     and payload fingerprint {stored}, but this delivery has fingerprint {received}"
)]
pub struct Conflict {
    /// The consumer (inbox scope) that holds the key.
    pub consumer: String,
    /// Routing name of the message (for a claim session: the name it was opened with).
    pub message_name: String,
    /// The idempotency key.
    pub key: IdempotencyKey,
    /// Fingerprint stored when the key was processed.
    pub stored: Fingerprint,
    /// Fingerprint of this delivery.
    pub received: Fingerprint,
}

/// The database failed during one of the inbox's operations.
#[derive(Debug, thiserror::Error)]
#[error("inbox {operation} failed for consumer `{consumer}`, key `{key}`: {source}")]
pub struct StoreError {
    /// The consumer (inbox scope).
    pub consumer: String,
    /// The idempotency key.
    pub key: IdempotencyKey,
    /// What failed. After a failed [`StoreOperation::Commit`] the outcome is unknown (the server
    /// may have committed before the connection broke): do not ack; the redelivery's claim will
    /// tell (a `Duplicate` if it had committed). Every other operation failed before anything
    /// was committed.
    pub operation: StoreOperation,
    /// The driver's error.
    #[source]
    pub source: sqlx::Error,
}

/// A decoder error's text without the position serde_json appends to it (` at line L column
/// C`), which [`DispatchError::Decode`] states itself.
fn without_position(error: &serde_json::Error) -> String {
    let text = error.to_string();
    let suffix = format!(" at line {} column {}", error.line(), error.column());
    match text.strip_suffix(&suffix) {
        Some(message) if error.line() > 0 => message.to_owned(),
        _ => text,
    }
}

/// A before-commit hook failed; everything of the transaction was rolled back.
#[derive(Debug, thiserror::Error)]
#[error("before-commit hook failed for consumer `{consumer}`, key `{key}`: {source}")]
#[non_exhaustive]
pub struct HookError {
    /// The consumer.
    pub consumer: String,
    /// The idempotency key.
    pub key: IdempotencyKey,
    /// What was recorded for the attempt.
    pub disposition: Disposition,
    /// The hook's error.
    #[source]
    pub source: BoxError,
}

impl HookError {
    /// Whether the hook fenced the claim ([`Fenced`](crate::protocol::Fenced)): the delivery
    /// belongs to another consumer now; nothing was recorded and it must not be settled.
    pub fn is_fenced(&self) -> bool {
        crate::protocol::Fenced::is_in(&*self.source)
    }
}

/// The step of the claim protocol during which the database failed (see [`StoreError`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum StoreOperation {
    /// Taking a connection from the pool.
    Acquire,
    /// `BEGIN`.
    Begin,
    /// The claim statement (or the read of a settled key).
    Claim,
    /// The per-aggregate sequence guard (lock, park, stale).
    Order,
    /// A before-commit hook's own statements (see [`crate::TransactionHook`]).
    Hook,
    /// Storing a claim session's result.
    Complete,
    /// The check before `COMMIT` that the transaction is not aborted: it was (the handler
    /// returned `Ok` after a database error it swallowed). Nothing was committed; the attempt is
    /// recorded as failed.
    Verify,
    /// `ROLLBACK`.
    Rollback,
    /// `COMMIT`: the outcome is unknown.
    Commit,
    /// Keeping a conflicting delivery in `inbox_rejections` (after its transaction was rolled
    /// back): nothing was kept, so the delivery must not be settled as a conflict; its
    /// redelivery is a conflict again and is kept then.
    Rejection,
}

impl StoreOperation {
    /// The operation's name in messages and logs: `acquire`, `begin`, `claim`, `order`, `hook`,
    /// `complete`, `verify`, `rollback`, `commit` or `rejection`.
    pub const fn as_str(self) -> &'static str {
        match self {
            StoreOperation::Acquire => "acquire",
            StoreOperation::Begin => "begin",
            StoreOperation::Claim => "claim",
            StoreOperation::Order => "order",
            StoreOperation::Hook => "hook",
            StoreOperation::Complete => "complete",
            StoreOperation::Verify => "verify",
            StoreOperation::Rollback => "rollback",
            StoreOperation::Commit => "commit",
            StoreOperation::Rejection => "rejection",
        }
    }
}

text_as_str!(StoreOperation);

/// How a program lists the handlers of `backend`'s dispatcher explicitly.
fn from_handlers_hint(backend: Backend) -> &'static str {
    match backend {
        Backend::DynamoDb => {
            "DynamoDispatcher::from_handlers(inbox, [handler!(path::to::function)])"
        }
        _ => "Dispatcher::from_handlers(pool, [handler!(path::to::function)])",
    }
}

/// What [`RegistryError::NoHandlers`] adds when handlers of other backends exist: the handler's
/// connection type is what picks its backend.
fn backend_mismatch_hint(other: usize) -> &'static str {
    if other == 0 {
        ""
    } else {
        ": a handler's first parameter picks its backend (`&mut PgConnection`: postgres, \
         `&mut SqliteConnection`: sqlite, `&mut MySqlConnection`: mysql, `&mut DynamoTx`: \
         dynamodb), so a handler written for another backend is not one of these"
    }
}

/// The registry found no usable set of handlers.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum RegistryError {
    /// No `#[idempotent]` handler for this backend is linked into the program.
    #[error(
        "no #[idempotent] handlers for {backend} are registered ({other} for other backends){mismatch}; \
         a crate whose handlers nothing references is not linked: add `use that_crate as _;`, \
         or list the handlers with `{hint}`",
        hint = from_handlers_hint(*.backend),
        mismatch = backend_mismatch_hint(*.other)
    )]
    NoHandlers {
        /// The dispatcher's backend.
        backend: Backend,
        /// Handlers registered for other backends: for a SQL dispatcher, of the other SQL
        /// backends; for the DynamoDB dispatcher, of the SQL backends.
        other: usize,
    },
    /// [`Dispatcher::from_handlers`](crate::Dispatcher::from_handlers) (or the DynamoDB
    /// dispatcher's `from_handlers`) got an empty list.
    #[error("no handlers listed for the {backend} dispatcher")]
    NoHandlersListed {
        /// The dispatcher's backend.
        backend: Backend,
    },
    /// A handler listed for [`Dispatcher::from_handlers`](crate::Dispatcher::from_handlers)
    /// takes another backend's connection than the pool's.
    #[error(
        "handler `{function}` takes a {backend} connection, but the dispatcher's pool is {expected}"
    )]
    WrongBackend {
        /// The handler (module path and function name).
        function: &'static str,
        /// The backend of its connection type.
        backend: Backend,
        /// The backend of the dispatcher's pool.
        expected: Backend,
    },
    /// Two handlers claim the same message under the same consumer name: they would share one
    /// inbox scope, so one of them would see every message as a duplicate.
    #[error(
        "consumer `{consumer}` has two handlers for message `{message_name}`: `{first}` and `{second}`"
    )]
    DuplicateConsumer {
        /// The consumer name.
        consumer: &'static str,
        /// The message's routing name.
        message_name: &'static str,
        /// One handler (module path and function name).
        first: &'static str,
        /// The other one.
        second: &'static str,
    },
}

/// An envelope the dispatcher could not route to any handler. Nothing was written.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum DispatchError {
    /// The delivery carries no message name (its name is empty): a source could not read one,
    /// or the bytes were not a message envelope at all. Recorded as `malformed`.
    #[error("the delivery carries no message name (not a message envelope?)")]
    NoMessageName,
    /// No handler is registered for this message name.
    #[error("unknown message `{message_name}`: no handler is registered for it")]
    UnknownMessage {
        /// The envelope's message name.
        message_name: String,
    },
    /// The payload is larger than the dispatcher's limit
    /// ([`Dispatcher::with_max_payload_bytes`](crate::Dispatcher::with_max_payload_bytes)), or
    /// its source cut it at the source's limit ([`Envelope::cut`](crate::Envelope::cut)): refused
    /// before it is decoded. Recorded as `too_large`, with the payload cut to the limit and its
    /// real size. `limit` is the dispatcher's limit if the real size is over it, else the size
    /// the source cut the payload to.
    #[error("payload of message `{message_name}` is {size} bytes, over the limit of {limit} bytes")]
    TooLarge {
        /// The message name.
        message_name: String,
        /// The payload's size, in bytes.
        size: usize,
        /// The limit, in bytes.
        limit: usize,
    },
    /// The payload is not UTF-8 (JSON must be), anywhere in it, members the message type does
    /// not declare included.
    #[error(
        "malformed payload for message `{message_name}` at line {line}, column {column}: invalid UTF-8"
    )]
    NotUtf8 {
        /// The message name.
        message_name: String,
        /// 1-based line of the first invalid byte.
        line: usize,
        /// 1-based column (in bytes) of the first invalid byte.
        column: usize,
    },
    /// The payload's text is not Unicode: a JSON escape in it decodes to an unpaired surrogate
    /// (`\ud800` to `\udfff` outside a high-low pair: a lone one, a high one followed by
    /// anything but a low one, a low one first), anywhere in it — the key, declared and
    /// undeclared members, member names, nested arrays and objects. Recorded as `malformed`, the
    /// payload kept whole.
    #[error(
        "malformed payload for message `{message_name}` at line {line}, column {column}: invalid \
         Unicode: the escape `{escape}` is an unpaired surrogate"
    )]
    UnpairedSurrogate {
        /// The message name.
        message_name: String,
        /// 1-based line of the escape.
        line: usize,
        /// 1-based column (in bytes) of the escape's backslash.
        column: usize,
        /// The escape as written: a backslash, `u` and four hex digits (`\ud800`, `\uDFFF`, …).
        escape: String,
    },
    /// The payload is not a valid message of this name: not JSON as a whole (trailing
    /// characters included), or not of the message type.
    #[error(
        "malformed payload for message `{message_name}` at line {line}, column {column}: {}",
        without_position(.source)
    )]
    Decode {
        /// The message name.
        message_name: String,
        /// 1-based line of the payload where decoding failed.
        line: usize,
        /// 1-based column where decoding failed.
        column: usize,
        /// The decoder's error.
        #[source]
        source: serde_json::Error,
    },
    /// The message has no usable idempotency key for one of its consumers.
    #[error("consumer `{consumer}`: {source}")]
    Key {
        /// The consumer whose key could not be read.
        consumer: &'static str,
        /// What is wrong with the key.
        #[source]
        source: KeyError,
    },
    /// The message could not be fingerprinted.
    #[error("message `{message_name}`: {source}")]
    Fingerprint {
        /// The message name.
        message_name: String,
        /// The error.
        #[source]
        source: FingerprintError,
    },
}

/// Why [`Dispatcher::replay`](crate::Dispatcher::replay) (or the DynamoDB dispatcher's
/// `replay`) could not run a message. Nothing was written.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ReplayError {
    /// No row (DynamoDB: item) for this consumer and key, or an expired processed one.
    #[error("consumer `{consumer}` has no message with key `{key}`")]
    NotFound {
        /// The consumer.
        consumer: String,
        /// The key.
        key: String,
    },
    /// The row (item) keeps no payload: a processed one does not.
    #[error("message `{key}` of consumer `{consumer}` is {status} and keeps no payload")]
    NoPayload {
        /// The consumer.
        consumer: String,
        /// The key.
        key: String,
        /// Its status.
        status: String,
    },
    /// No handler of this dispatcher serves that consumer and message.
    #[error("no registered handler for consumer `{consumer}` and message `{message_name}`")]
    NoHandler {
        /// The consumer.
        consumer: String,
        /// The message name.
        message_name: String,
    },
    /// The stored payload does not decode as the handler's message type (any more).
    #[error("stored payload of `{message_name}` does not decode: {source}")]
    Decode {
        /// The message name.
        message_name: String,
        /// The decoder's error.
        #[source]
        source: serde_json::Error,
    },
    /// The key given is not a valid idempotency key, or the decoded message has none (or
    /// no valid ordering).
    #[error(transparent)]
    Key(KeyError),
    /// The decoded message cannot be fingerprinted.
    #[error(transparent)]
    Fingerprint(FingerprintError),
    /// The decoded message's key is not the stored key (the key's definition changed).
    #[error("stored key `{stored}` but the payload now yields key `{decoded}`")]
    KeyMismatch {
        /// The stored key.
        stored: String,
        /// The key the handler reads from the payload now.
        decoded: String,
    },
    /// The database failed.
    #[error(transparent)]
    Database(#[from] sqlx::Error),
    /// Reading the stored message failed on a store that is not SQL (DynamoDB: the admin's
    /// `show`, a `GetItem`, with DynamoDB's error code, or a malformed item).
    #[error("reading the stored message failed: {0}")]
    Read(#[source] BoxError),
}
