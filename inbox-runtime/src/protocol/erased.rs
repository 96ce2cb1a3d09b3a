//! Handlers with their types erased, as the dispatcher and the batch driver drive them.

use std::any::{Any, TypeId};

use super::single::{AttemptPlan, Handler, HandlerSpec, run_delivery};
use crate::BoxFuture;
use crate::store::{AnyConnection, Backend, InboxConnection};
use crate::types::classify::{BoxError, ErrorClass};
use crate::types::envelope::Envelope;
use crate::types::error::{DispatchError, Error, ReplayError};
use crate::types::fingerprint::{Fingerprint, FingerprintError};
use crate::types::key::{IdempotencyKey, KeyError};
use crate::types::message::Message;
use crate::types::ordering::{GapPolicy, Ordering};
use crate::types::outcome::Outcome;

/// A decoded message of any type.
pub(crate) type AnyMessage = dyn Any + Send + Sync;

/// The messages of one envelope decoded so far: one per message type among its consumers, with
/// its fingerprint.
pub(crate) type DecodedMessages = Vec<(TypeId, Box<AnyMessage>, Fingerprint)>;

/// The index in `decoded` of the message of type `message_type` (a consumer's handler): decoded
/// from `text` with `decode` and fingerprinted with `fingerprint` if no consumer before it has
/// this type (the SQL and the DynamoDB dispatcher both decode a payload once per type).
pub(crate) fn decode_once(
    message_type: TypeId,
    decode: impl FnOnce(&str) -> Result<Box<AnyMessage>, serde_json::Error>,
    fingerprint: impl FnOnce(&AnyMessage) -> Result<Fingerprint, FingerprintError>,
    envelope: &Envelope,
    text: &str,
    decoded: &mut DecodedMessages,
) -> Result<usize, DispatchError> {
    if let Some(index) = decoded.iter().position(|(ty, ..)| *ty == message_type) {
        return Ok(index);
    }
    let msg = decode(text).map_err(|source| DispatchError::Decode {
        message_name: envelope.message_name.clone(),
        line: source.line(),
        column: source.column(),
        source,
    })?;
    let fingerprint = fingerprint(&*msg).map_err(|source| DispatchError::Fingerprint {
        message_name: envelope.message_name.clone(),
        source,
    })?;
    decoded.push((message_type, msg, fingerprint));
    Ok(decoded.len() - 1)
}

/// What every handler with its types erased answers, whatever its backend: who it is, and how
/// its message decodes, keys, orders and fingerprints.
#[doc(hidden)]
pub trait ErasedHandler: Send + Sync + 'static {
    fn consumer(&self) -> &'static str;
    fn message_name(&self) -> &'static str;
    fn function(&self) -> &'static str;
    fn message_type(&self) -> TypeId;
    fn decode(&self, payload: &str) -> Result<Box<AnyMessage>, serde_json::Error>;
    fn key(&self, msg: &AnyMessage) -> Result<IdempotencyKey, KeyError>;
    fn ordering(&self, msg: &AnyMessage) -> Result<Option<Ordering>, KeyError>;
    /// The message's declared partitions ([`Message::partitions`]).
    fn partitions(&self, msg: &AnyMessage) -> Option<Vec<String>>;
    fn gaps(&self) -> GapPolicy;
    fn fingerprint(&self, msg: &AnyMessage) -> Result<Fingerprint, FingerprintError>;
    fn max_attempts(&self) -> Option<u32>;
}

impl<H: HandlerSpec> ErasedHandler for H {
    fn consumer(&self) -> &'static str {
        H::CONSUMER
    }
    fn message_name(&self) -> &'static str {
        <H::Message as Message>::NAME
    }
    fn function(&self) -> &'static str {
        H::FUNCTION
    }
    fn message_type(&self) -> TypeId {
        TypeId::of::<H::Message>()
    }
    fn decode(&self, payload: &str) -> Result<Box<AnyMessage>, serde_json::Error> {
        Ok(Box::new(serde_json::from_str::<H::Message>(payload)?))
    }
    fn key(&self, msg: &AnyMessage) -> Result<IdempotencyKey, KeyError> {
        H::key(downcast::<H::Message>(msg))
    }
    fn ordering(&self, msg: &AnyMessage) -> Result<Option<Ordering>, KeyError> {
        H::ordering(downcast::<H::Message>(msg))
    }
    fn partitions(&self, msg: &AnyMessage) -> Option<Vec<String>> {
        downcast::<H::Message>(msg).partitions()
    }
    fn gaps(&self) -> GapPolicy {
        H::GAPS
    }
    fn fingerprint(&self, msg: &AnyMessage) -> Result<Fingerprint, FingerprintError> {
        Fingerprint::of(<H::Message as Message>::NAME, downcast::<H::Message>(msg))
    }
    fn max_attempts(&self) -> Option<u32> {
        H::MAX_ATTEMPTS
    }
}

/// A SQL handler with its types erased, as the dispatcher drives it.
#[doc(hidden)]
pub trait DynHandler: ErasedHandler {
    fn backend(&self) -> Backend;
    fn invoke<'c>(
        &'c self,
        conn: AnyConnection<'c>,
        msg: &'c AnyMessage,
        delivery: &'c AttemptPlan<'c>,
    ) -> BoxFuture<'c, Result<Outcome<()>, Error<BoxError>>>;
    /// Runs only the handler's body on `conn` (inside a caller's transaction, which set the
    /// claim context), for batches.
    fn call_body<'c>(
        &'c self,
        conn: AnyConnection<'c>,
        msg: &'c AnyMessage,
    ) -> BoxFuture<'c, Result<(), BodyError>>;
}

/// A handler body's error, boxed, with its class and text.
#[doc(hidden)]
pub struct BodyError {
    pub(crate) class: ErrorClass,
    pub(crate) text: String,
    pub(crate) error: BoxError,
}

/// The decoded message as its handler's type (the dispatchers, SQL and DynamoDB, decode each
/// message once per message type and hand it only to the handlers of that type).
pub(crate) fn downcast<M: 'static>(msg: &AnyMessage) -> &M {
    msg.downcast_ref::<M>()
        .expect("dispatcher grouped handlers by message type")
}

impl<H> DynHandler for H
where
    H: Handler,
    H::Error: Into<BoxError>,
{
    fn backend(&self) -> Backend {
        <H::Connection as InboxConnection>::BACKEND
    }
    fn invoke<'c>(
        &'c self,
        conn: AnyConnection<'c>,
        msg: &'c AnyMessage,
        delivery: &'c AttemptPlan<'c>,
    ) -> BoxFuture<'c, Result<Outcome<()>, Error<BoxError>>> {
        Box::pin(async move {
            let conn = H::Connection::from_any(conn)
                .expect("dispatcher routes only handlers of its own backend");
            run_delivery::<H>(conn, downcast::<H::Message>(msg), delivery)
                .await
                .map(|outcome| outcome.map(|_| ()))
                .map_err(|error| error.map_handler(Into::into))
        })
    }
    fn call_body<'c>(
        &'c self,
        conn: AnyConnection<'c>,
        msg: &'c AnyMessage,
    ) -> BoxFuture<'c, Result<(), BodyError>> {
        Box::pin(async move {
            let conn = H::Connection::from_any(conn)
                .expect("dispatcher routes only handlers of its own backend");
            let msg = downcast::<H::Message>(msg).clone();
            H::call(conn, msg)
                .await
                .map(|_| ())
                .map_err(|error| BodyError {
                    class: H::classify(&error),
                    text: error.to_string(),
                    error: error.into(),
                })
        })
    }
}

/// A stored message (a replay, a parked successor) as its handler reads it again.
pub(crate) struct DecodedStored {
    pub(crate) msg: Box<AnyMessage>,
    /// Its key, as the handler reads it from the payload: the stored one.
    pub(crate) key: IdempotencyKey,
    /// Its place in its aggregate for the handler, if ordered.
    pub(crate) ordering: Option<Ordering>,
    pub(crate) fingerprint: Fingerprint,
}

/// The stored `payload` of `stored_key` decoded by `handler` (Unicode text by the dispatcher's
/// rule, JSON of its message type), its key checked against the stored one, its ordering read,
/// fingerprinted: the SQL and the DynamoDB replays' first steps, in this order.
///
/// # Errors
/// [`ReplayError::Decode`] if the payload is not UTF-8 (`invalid UTF-8 at byte N`), holds an
/// escape of an unpaired surrogate or does not decode; [`ReplayError::Key`] if the message has
/// no valid key; [`ReplayError::KeyMismatch`] if it is not the stored key; [`ReplayError::Key`]
/// if its ordering fields are invalid; [`ReplayError::Fingerprint`] if it cannot be
/// fingerprinted.
pub(crate) fn decode_stored<H: ErasedHandler + ?Sized>(
    handler: &H,
    stored_key: &str,
    payload: &[u8],
) -> Result<DecodedStored, ReplayError> {
    let decode_error = |source| ReplayError::Decode {
        message_name: handler.message_name().to_owned(),
        source,
    };
    let text = std::str::from_utf8(payload).map_err(|error| {
        decode_error(<serde_json::Error as serde::de::Error>::custom(format!(
            "invalid UTF-8 at byte {}",
            error.valid_up_to()
        )))
    })?;
    // The dispatcher's rule for escapes too, for payloads stored before it held.
    crate::types::json_text::json_text(payload)
        .map_err(|error| decode_error(<serde_json::Error as serde::de::Error>::custom(error)))?;
    let msg = handler.decode(text).map_err(decode_error)?;
    let key = handler.key(&*msg).map_err(ReplayError::Key)?;
    if key.as_str() != stored_key {
        return Err(ReplayError::KeyMismatch {
            stored: stored_key.to_owned(),
            decoded: key.into_string(),
        });
    }
    let ordering = handler.ordering(&*msg).map_err(ReplayError::Key)?;
    let fingerprint = handler
        .fingerprint(&*msg)
        .map_err(ReplayError::Fingerprint)?;
    Ok(DecodedStored {
        msg,
        key,
        ordering,
        fingerprint,
    })
}
