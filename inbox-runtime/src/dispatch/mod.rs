//! Dispatch: the [`Dispatcher`] that routes an envelope to every consumer registered for its
//! message name (with what it returns: [`ConsumerOutcome`], [`SweepReport`]), the handler
//! registry it routes with ([`registered_handlers`], [`HandlerInfo`], [`Registration`]), and what
//! an `#[idempotent]` function calls when it is called directly.

pub(crate) mod direct;
pub(crate) mod dispatcher;
pub(crate) mod registry;

pub use dispatcher::{ConsumerOutcome, Dispatcher, SweepReport};
pub use registry::{HandlerInfo, Registration, registered_handlers};
