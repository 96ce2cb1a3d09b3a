//! The handler registry: every `#[idempotent]` handler linked into the program (collected by
//! `inventory`), or an explicit list of them.

use std::collections::{BTreeMap, HashMap};
use std::fmt;

use crate::protocol::erased::{DecodedMessages, DynHandler, ErasedHandler, decode_once};
use crate::protocol::park::Routes;
use crate::store::Backend;
use crate::types::envelope::Envelope;
use crate::types::error::{DispatchError, RegistryError};
use crate::types::key::IdempotencyKey;
use crate::types::limit::PayloadLimit;
use crate::types::ordering::Ordering;

/// One `#[idempotent]` handler, as the registry holds it: what
/// [`handler!(path::to::function)`](crate::handler!) gives, for
/// [`Dispatcher::from_handlers`](crate::Dispatcher::from_handlers). `#[idempotent]` submits one of these to the `inventory`
/// registry for every handler.
#[derive(Clone, Copy)]
pub struct Registration {
    handler: &'static dyn DynHandler,
}

impl Registration {
    /// Wraps a handler (generated code only).
    #[doc(hidden)]
    pub const fn new(handler: &'static dyn DynHandler) -> Self {
        Self { handler }
    }

    /// The handler's consumer, message, function and backend.
    pub fn info(&self) -> HandlerInfo {
        info(self.handler)
    }
}

impl fmt::Debug for Registration {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_tuple("Registration").field(&self.info()).finish()
    }
}

inventory::collect!(Registration);

/// What the registry knows of one handler.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct HandlerInfo {
    /// The consumer name (the handler's inbox scope).
    pub consumer: &'static str,
    /// The routing name of the message it handles.
    pub message_name: &'static str,
    /// Module path and name of the function.
    pub function: &'static str,
    /// The backend its connection type belongs to.
    pub backend: Backend,
}

impl fmt::Display for HandlerInfo {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} <- {} ({}, {})",
            self.consumer, self.message_name, self.function, self.backend
        )
    }
}

pub(crate) fn info(handler: &dyn DynHandler) -> HandlerInfo {
    HandlerInfo::of(handler, handler.backend())
}

impl HandlerInfo {
    /// What the registry knows of `handler`, a handler of `backend`.
    pub(crate) fn of<H: ErasedHandler + ?Sized>(handler: &H, backend: Backend) -> Self {
        Self {
            consumer: handler.consumer(),
            message_name: handler.message_name(),
            function: handler.function(),
            backend,
        }
    }

    /// `handlers` sorted by message name, consumer and function.
    pub(crate) fn sorted(mut handlers: Vec<Self>) -> Vec<Self> {
        handlers.sort_by(|a, b| {
            (a.message_name, a.consumer, a.function).cmp(&(b.message_name, b.consumer, b.function))
        });
        handlers
    }
}

/// Every `#[idempotent]` handler on a SQL connection linked into this program, for every SQL
/// backend, sorted by message name, consumer and function (the DynamoDB handlers:
/// `dynamodb::registered_dynamo_handlers`).
pub fn registered_handlers() -> Vec<HandlerInfo> {
    HandlerInfo::sorted(
        inventory::iter::<Registration>
            .into_iter()
            .map(|registration| info(registration.handler))
            .collect(),
    )
}

impl Registration {
    /// The type-erased handler.
    pub(crate) fn handler(&self) -> &'static dyn DynHandler {
        self.handler
    }
}

/// Every registered handler of `backend`, as routes for parked successors of a handler called
/// directly (no dispatcher: the whole registry is its set of handlers).
pub(crate) struct GlobalRoutes(pub(crate) Backend);

impl Routes for GlobalRoutes {
    fn route(&self, consumer: &str, message_name: &str) -> Option<&'static dyn DynHandler> {
        inventory::iter::<Registration>
            .into_iter()
            .map(|registration| registration.handler)
            .find(|h| {
                h.backend() == self.0
                    && h.consumer() == consumer
                    && h.message_name() == message_name
            })
    }
}

/// A dispatcher's handlers (SQL or DynamoDB) by message name, each name's handlers sorted by
/// consumer and function.
pub(crate) struct HandlerRoutes<H: ?Sized + 'static> {
    by_name: HashMap<&'static str, Vec<&'static H>>,
}

impl<H: ErasedHandler + ?Sized> HandlerRoutes<H> {
    /// The routes of `handlers`, of a dispatcher of `backend`: `explicit` if they were listed
    /// (`from_handlers`), else the registry's; `other` handlers of the registry are of other
    /// backends.
    ///
    /// # Errors
    /// [`RegistryError::DuplicateConsumer`] for the first two handlers of one consumer and
    /// message name; [`RegistryError::NoHandlersListed`] / [`RegistryError::NoHandlers`] if
    /// there are none.
    pub(crate) fn new(
        mut handlers: Vec<&'static H>,
        backend: Backend,
        explicit: bool,
        other: usize,
    ) -> Result<Self, RegistryError> {
        handlers.sort_by_key(|h| (h.message_name(), h.consumer(), h.function()));
        let mut by_name: HashMap<&'static str, Vec<&'static H>> = HashMap::new();
        let mut seen = BTreeMap::new();
        for handler in handlers {
            let (consumer, message_name) = (handler.consumer(), handler.message_name());
            if let Some(first) = seen.insert((consumer, message_name), handler.function()) {
                return Err(RegistryError::DuplicateConsumer {
                    consumer,
                    message_name,
                    first,
                    second: handler.function(),
                });
            }
            by_name.entry(message_name).or_default().push(handler);
        }
        if by_name.is_empty() {
            return Err(if explicit {
                RegistryError::NoHandlersListed { backend }
            } else {
                RegistryError::NoHandlers { backend, other }
            });
        }
        Ok(Self { by_name })
    }

    /// The handlers of a `from_handlers` list, each once (listing one twice is harmless).
    pub(crate) fn listed(handlers: impl IntoIterator<Item = &'static H>) -> Vec<&'static H> {
        let mut listed: Vec<&'static H> = Vec::new();
        for handler in handlers {
            if !listed.iter().any(|h| h.function() == handler.function()) {
                listed.push(handler);
            }
        }
        listed
    }

    /// The dispatch checks of `envelope` (its size against `limit`, its name, a route for it,
    /// Unicode text), then its payload decoded once per message type and every consumer's key
    /// and ordering read: what a dispatch needs before any write.
    ///
    /// # Errors
    /// The [`DispatchError`] of the first check that fails, in that order, then
    /// [`DispatchError::Decode`], [`DispatchError::Fingerprint`] or [`DispatchError::Key`] (a
    /// consumer's key or ordering fields missing, null, empty or too long).
    pub(crate) fn decode(
        &self,
        envelope: &Envelope,
        limit: PayloadLimit,
    ) -> Result<Decoded<H>, DispatchError> {
        let (handlers, text) = envelope.admit(limit, &self.by_name)?;
        // Decode once per message type (consumers of one name almost always share one type).
        let mut messages: DecodedMessages = Vec::with_capacity(1);
        let mut items = Vec::with_capacity(handlers.len());
        for handler in handlers {
            let index = decode_once(
                handler.message_type(),
                |text| handler.decode(text),
                |msg| handler.fingerprint(msg),
                envelope,
                text,
                &mut messages,
            )?;
            let key_error = |source| DispatchError::Key {
                consumer: handler.consumer(),
                source,
            };
            let key = handler.key(&*messages[index].1).map_err(key_error)?;
            let ordering = handler.ordering(&*messages[index].1).map_err(key_error)?;
            items.push(PreparedItem {
                handler: *handler,
                message: index,
                key,
                ordering,
            });
        }
        Ok(Decoded { messages, items })
    }

    /// The handler of `consumer` for `message_name`, if there is one.
    pub(crate) fn route(&self, consumer: &str, message_name: &str) -> Option<&'static H> {
        self.by_name
            .get(message_name)
            .and_then(|handlers| handlers.iter().find(|h| h.consumer() == consumer))
            .copied()
    }

    /// What the registry knows of every handler, `backend` giving each one's backend, sorted
    /// by message name, consumer and function.
    pub(crate) fn infos(&self, backend: impl Fn(&H) -> Backend) -> Vec<HandlerInfo> {
        HandlerInfo::sorted(
            self.by_name
                .values()
                .flatten()
                .map(|handler| HandlerInfo::of(*handler, backend(handler)))
                .collect(),
        )
    }
}

/// An envelope decoded and keyed for each of its consumers, apart from the envelope (see
/// [`HandlerRoutes::decode`]).
pub(crate) struct Decoded<H: ?Sized + 'static = dyn DynHandler> {
    /// One decoded message (and its fingerprint) per message type.
    pub(crate) messages: DecodedMessages,
    /// One item per consumer, in consumer order.
    pub(crate) items: Vec<PreparedItem<H>>,
}

impl<H: ErasedHandler + ?Sized> Decoded<H> {
    /// The partitions of the envelope: those every consumer's message declares
    /// ([`Message::partitions`](crate::Message::partitions)) and every consumer's ordering
    /// aggregate, without repeats; `None` if some consumer has neither (undeclared).
    pub(crate) fn partitions(&self) -> Option<Vec<String>> {
        let mut all: Vec<String> = Vec::new();
        for item in &self.items {
            let declared = item.handler.partitions(&*self.messages[item.message].1);
            let aggregate = item.ordering.as_ref().map(|o| &o.aggregate_id);
            if declared.is_none() && aggregate.is_none() {
                return None;
            }
            for partition in declared.into_iter().flatten().chain(aggregate.cloned()) {
                if !all.contains(&partition) {
                    all.push(partition);
                }
            }
        }
        Some(all)
    }
}

/// One consumer of a decoded envelope.
pub(crate) struct PreparedItem<H: ?Sized + 'static = dyn DynHandler> {
    pub(crate) handler: &'static H,
    /// Index into the decoded messages.
    pub(crate) message: usize,
    pub(crate) key: IdempotencyKey,
    pub(crate) ordering: Option<Ordering>,
}
