//! The handler registry: every `#[idempotent]` handler linked into the program (collected by
//! `inventory`), or an explicit list of them.

use std::fmt;

use crate::protocol::erased::DynHandler;
use crate::protocol::park::Routes;
use crate::store::Backend;

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
    HandlerInfo {
        consumer: handler.consumer(),
        message_name: handler.message_name(),
        function: handler.function(),
        backend: handler.backend(),
    }
}

/// Every `#[idempotent]` handler linked into this program, for every backend, sorted by message
/// name, consumer and function.
pub fn registered_handlers() -> Vec<HandlerInfo> {
    let mut all: Vec<HandlerInfo> = inventory::iter::<Registration>
        .into_iter()
        .map(|registration| info(registration.handler))
        .collect();
    all.sort_by(|a, b| {
        (a.message_name, a.consumer, a.function).cmp(&(b.message_name, b.consumer, b.function))
    });
    all
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
