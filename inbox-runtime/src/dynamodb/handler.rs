//! `#[idempotent]` handlers on DynamoDB with their types erased, as the [`DynamoDispatcher`](super::DynamoDispatcher),
//! a direct call and a release of parked successors run them: the handler traits, the registry
//! (`inventory`), the run of a stored payload (a replay, a parked successor) and the release of
//! an aggregate's parked successors in order.

use std::fmt;

use super::{DynamoError, DynamoInbox, DynamoTx, Failed, Mode, Ordered};
use crate::BoxFuture;
use crate::dispatch::HandlerInfo;
use crate::protocol::erased::{AnyMessage, ErasedHandler, decode_stored, downcast};
use crate::protocol::single::HandlerSpec;
use crate::store::Backend;
use crate::types::classify::BoxError;
use crate::types::error::HandlerFailure;
use crate::types::error::ReplayError;
use crate::types::fingerprint::{Fingerprint, FingerprintError};
use crate::types::key::IdempotencyKey;
use crate::types::message::Message;
use crate::types::ordering::{GapPolicy, Ordering};
use crate::types::outcome::Outcome;

/// One `#[idempotent]` function whose first parameter is `&mut DynamoTx`, as the macro
/// describes it to the runtime (generated code only).
#[doc(hidden)]
pub trait DynamoHandler: HandlerSpec {
    /// The original function body: adds its actions to `tx`.
    fn call<'t>(
        tx: &'t mut DynamoTx,
        msg: Self::Message,
    ) -> BoxFuture<'t, Result<Self::Output, Self::Error>>;
}

/// What the rewritten function calls: one delivery of `msg` to `H` on `inbox` (its key from
/// `H::key`, its fingerprint `Fingerprint::of(M::NAME, &msg)`, its JSON kept for a failed or dead
/// item), with `H`'s `max_attempts` if it has one.
#[doc(hidden)]
pub async fn run<H: DynamoHandler>(
    inbox: &DynamoInbox,
    msg: H::Message,
) -> Result<Outcome<H::Output>, DynamoError<H::Error>> {
    let key = H::key(&msg)?;
    let fingerprint = Fingerprint::of(<H::Message as Message>::NAME, &msg)?;
    let payload = serde_json::to_vec(&msg).map_err(FingerprintError::from_json)?;
    let ordering = H::ordering(&msg)?;
    let run = Run {
        key: &key,
        ordering: ordering.as_ref(),
        fingerprint,
        payload: &payload,
        mode: Mode::Deliver,
        routes: &Registered,
    };
    run_with::<H>(inbox, &msg, run).await
}

/// One delivery of `msg` to `H` as `run` says (its key, ordering, fingerprint, payload, mode, and the
/// routes of parked successors to release after it).
async fn run_with<H: DynamoHandler>(
    inbox: &DynamoInbox,
    msg: &H::Message,
    run: Run<'_>,
) -> Result<Outcome<H::Output>, DynamoError<H::Error>> {
    let Run {
        key,
        ordering,
        fingerprint,
        payload,
        mode,
        routes,
    } = run;
    let ordered = ordering.map(|ordering| Ordered {
        ordering: ordering.clone(),
        gaps: H::GAPS,
    });
    let own;
    let base = inbox;
    let inbox = match H::MAX_ATTEMPTS {
        Some(max) => {
            // A clone shares the client and the counters: only the policy differs.
            own = inbox
                .clone()
                .retry_policy(inbox.policy.clone().max_attempts(max));
            &own
        }
        None => inbox,
    };
    let delivery = super::Delivery {
        consumer: H::CONSUMER,
        message_name: <H::Message as Message>::NAME,
        key,
        fingerprint,
        payload,
        mode,
        ordering: ordered.as_ref(),
    };
    let result = inbox
        .deliver(&delivery, H::classify, |mut tx| {
            let msg = msg.clone();
            async move {
                let value = H::call(&mut tx, msg).await?;
                Ok((tx, value))
            }
        })
        .await;
    // After a duplicate too: a process that stopped between a message's commit and the release
    // of its parked successors left them parked, and the message, never acked, comes again. A
    // released successor (`Resume`) does not release: the loop that runs it goes on itself.
    if let (Ok(Outcome::Processed(_) | Outcome::Duplicate), Some(ordered)) = (&result, &ordered)
        && H::GAPS == GapPolicy::Park
        && matches!(mode, Mode::Deliver | Mode::Replay)
    {
        let duplicate = matches!(result, Ok(Outcome::Duplicate));
        // On the inbox as given: each successor's handler applies its own `max_attempts`.
        release_successors(base, routes, H::CONSUMER, &ordered.ordering, duplicate).await;
    }
    result
}

/// A DynamoDB handler with its types erased, as the [`DynamoDispatcher`](super::DynamoDispatcher) drives it.
#[doc(hidden)]
pub trait DynDynamoHandler: ErasedHandler {
    fn invoke<'a>(
        &'a self,
        inbox: &'a DynamoInbox,
        msg: &'a AnyMessage,
        run: Run<'a>,
    ) -> BoxFuture<'a, Result<Outcome<()>, DynamoError<BoxError>>>;
}

/// What one erased run needs besides the message.
#[doc(hidden)]
#[derive(Clone, Copy)]
pub struct Run<'a> {
    pub(crate) key: &'a IdempotencyKey,
    /// The message's place in its aggregate for the handler (read once, where it was keyed).
    pub(crate) ordering: Option<&'a Ordering>,
    pub(crate) fingerprint: Fingerprint,
    pub(crate) payload: &'a [u8],
    pub(crate) mode: Mode,
    /// Where parked successors released after this run are routed.
    pub(crate) routes: &'a dyn DynamoRoutes,
}

impl<H> DynDynamoHandler for H
where
    H: DynamoHandler,
    H::Error: Into<BoxError>,
{
    fn invoke<'a>(
        &'a self,
        inbox: &'a DynamoInbox,
        msg: &'a AnyMessage,
        run: Run<'a>,
    ) -> BoxFuture<'a, Result<Outcome<()>, DynamoError<BoxError>>> {
        Box::pin(async move {
            let msg = downcast::<H::Message>(msg);
            run_with::<H>(inbox, msg, run)
                .await
                .map(|outcome| outcome.map(|_| ()))
                .map_err(|error| map_handler_error(error, Into::into))
        })
    }
}

/// `error` with its handler error mapped by `f` (every other variant as it is).
fn map_handler_error<E, F>(error: DynamoError<E>, f: impl FnOnce(E) -> F) -> DynamoError<F> {
    match error {
        DynamoError::Handler(HandlerFailure {
            error,
            class,
            attempts,
            disposition,
        }) => DynamoError::Handler(HandlerFailure {
            error: match error {
                Failed::Handler(error) => Failed::Handler(f(error)),
                Failed::Condition(condition) => Failed::Condition(condition),
            },
            class,
            attempts,
            disposition,
        }),
        DynamoError::Conflict(e) => DynamoError::Conflict(e),
        DynamoError::Key(e) => DynamoError::Key(e),
        DynamoError::Fingerprint(e) => DynamoError::Fingerprint(e),
        DynamoError::TooManyItems { items, max } => DynamoError::TooManyItems { items, max },
        DynamoError::TooLarge { what, bytes, max } => DynamoError::TooLarge { what, bytes, max },
        DynamoError::Transient { tries, reasons } => DynamoError::Transient { tries, reasons },
        DynamoError::Cancelled { reasons } => DynamoError::Cancelled { reasons },
        DynamoError::Contended { consumer, key } => DynamoError::Contended { consumer, key },
        DynamoError::Dynamo {
            consumer,
            key,
            operation,
            source,
        } => DynamoError::Dynamo {
            consumer,
            key,
            operation,
            source,
        },
        DynamoError::PartitionKeyTooLong {
            consumer,
            key,
            bytes,
            max,
        } => DynamoError::PartitionKeyTooLong {
            consumer,
            key,
            bytes,
            max,
        },
        DynamoError::Malformed {
            consumer,
            key,
            reason,
        } => DynamoError::Malformed {
            consumer,
            key,
            reason,
        },
        DynamoError::EmptyConsumer => DynamoError::EmptyConsumer,
    }
}

/// One `#[idempotent]` DynamoDB handler, as the registry holds it: what
/// [`handler!(path::to::function)`](crate::handler!) gives for a function whose first parameter
/// is `&mut DynamoTx`, for [`DynamoDispatcher::from_handlers`](super::DynamoDispatcher::from_handlers). `#[idempotent]` submits one of
/// these to a registry of its own (not the SQL [`Registration`](crate::dispatch::Registration)s')
/// for every such handler.
#[derive(Clone, Copy)]
pub struct DynamoRegistration {
    handler: &'static dyn DynDynamoHandler,
}

impl DynamoRegistration {
    /// Wraps a handler (generated code only).
    #[doc(hidden)]
    pub const fn new(handler: &'static dyn DynDynamoHandler) -> Self {
        Self { handler }
    }

    /// The handler.
    pub(crate) fn handler(&self) -> &'static dyn DynDynamoHandler {
        self.handler
    }

    /// The handler's consumer, message and function (backend [`Backend::DynamoDb`]).
    pub fn info(&self) -> HandlerInfo {
        HandlerInfo::of(self.handler, Backend::DynamoDb)
    }
}

impl fmt::Debug for DynamoRegistration {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_tuple("DynamoRegistration")
            .field(&self.info())
            .finish()
    }
}

inventory::collect!(DynamoRegistration);

/// Every `#[idempotent]` DynamoDB handler linked into this program (backend
/// [`Backend::DynamoDb`]), sorted by message name, consumer and function.
pub fn registered_dynamo_handlers() -> Vec<HandlerInfo> {
    HandlerInfo::sorted(
        inventory::iter::<DynamoRegistration>
            .into_iter()
            .map(|registration| registration.info())
            .collect(),
    )
}

/// Which handler runs a stored message of a consumer: a dispatcher's own routes, or (for a
/// handler called directly) every DynamoDB handler linked into the program.
pub(crate) trait DynamoRoutes: Sync {
    /// The handler of `consumer` for `message_name`, if there is one.
    fn route(&self, consumer: &str, message_name: &str) -> Option<&'static dyn DynDynamoHandler>;
}

/// Every `#[idempotent]` DynamoDB handler linked into the program.
pub(crate) struct Registered;

impl DynamoRoutes for Registered {
    fn route(&self, consumer: &str, message_name: &str) -> Option<&'static dyn DynDynamoHandler> {
        inventory::iter::<super::DynamoRegistration>
            .into_iter()
            .map(|registration| registration.handler())
            .find(|h| h.consumer() == consumer && h.message_name() == message_name)
    }
}

/// Runs a stored payload of `key` through `handler` in `mode` (decoded, its key checked against
/// the stored one, fingerprinted), as [`DynamoDispatcher::replay`](super::DynamoDispatcher::replay) does.
pub(crate) async fn run_payload(
    inbox: &DynamoInbox,
    routes: &dyn DynamoRoutes,
    handler: &'static dyn DynDynamoHandler,
    key: &str,
    payload: &[u8],
    mode: Mode,
) -> Result<Result<Outcome<()>, DynamoError<BoxError>>, ReplayError> {
    let decoded = decode_stored(handler, key, payload)?;
    let run = Run {
        key: &decoded.key,
        ordering: decoded.ordering.as_ref(),
        fingerprint: decoded.fingerprint,
        payload,
        mode,
        routes,
    };
    Ok(handler.invoke(inbox, &*decoded.msg, run).await)
}

/// After `ordering` of `consumer` was applied (`duplicate` false) or read as a duplicate:
/// applies, in order, each parked successor of its aggregate, each in its own transaction,
/// until one is missing or is not applied. The first is the one after the message's sequence,
/// or after a duplicate, the one after the aggregate's position (read first: a process that
/// stopped inside this loop left the rest parked, and the message that started it, never
/// acked, comes again). A successor already processed (a concurrent release applied it, or its
/// pointer outlived its commit) is gone past. Problems are logged, not returned: the message
/// that triggered this was processed. Returns the sequence of the last successor applied (or
/// gone past), else the one it started after.
pub(crate) async fn release_successors(
    inbox: &DynamoInbox,
    routes: &dyn DynamoRoutes,
    consumer: &str,
    ordering: &Ordering,
    duplicate: bool,
) -> i64 {
    let aggregate = ordering.aggregate_id.as_str();
    let mut sequence = ordering.sequence;
    if duplicate {
        match inbox.position(consumer, aggregate).await {
            Ok(last) => sequence = sequence.max(last),
            Err(error) => {
                tracing::warn!(%error, consumer, aggregate, "cannot read the aggregate's position");
                return sequence;
            }
        }
    }
    while let Some(next) = sequence.checked_add(1) {
        let pointer = match inbox.read_pointer(consumer, aggregate, next).await {
            Ok(Some(pointer)) => pointer,
            Ok(None) => return sequence,
            Err(error) => {
                tracing::warn!(%error, consumer, aggregate, "cannot look up parked successors");
                return sequence;
            }
        };
        let Some(handler) = routes.route(consumer, &pointer.message_name) else {
            tracing::warn!(
                consumer,
                message = pointer.message_name,
                "parked message has no registered handler"
            );
            return sequence;
        };
        let result = run_payload(
            inbox,
            routes,
            handler,
            &pointer.message_key,
            &pointer.payload,
            Mode::Resume,
        )
        .await;
        match result {
            Ok(Ok(Outcome::Processed(()) | Outcome::Duplicate)) => sequence = next,
            Ok(other) => {
                tracing::info!(
                    consumer,
                    key = pointer.message_key,
                    outcome = ?other.as_ref().map(|o| o.kind()).map_err(ToString::to_string),
                    "parked successor not applied"
                );
                return sequence;
            }
            Err(error) => {
                tracing::warn!(%error, consumer, key = pointer.message_key, "parked successor cannot run");
                return sequence;
            }
        }
    }
    sequence
}
