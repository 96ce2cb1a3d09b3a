//! The handler registry (filled by `#[idempotent]` through `inventory`) and the dispatcher.

use std::any::{Any, TypeId};
use std::collections::{BTreeMap, HashMap};
use std::fmt;

use sqlx::Pool;

use crate::BoxFuture;
use crate::envelope::Envelope;
use crate::error::{BoxError, DispatchError, Error, RegistryError, StoreError};
use crate::fingerprint::{Fingerprint, FingerprintError};
use crate::handler::{Delivery, Handler, Message, run_delivery};
use crate::key::{IdempotencyKey, KeyError};
use crate::ordering::{GapPolicy, Ordering, ParkPolicy, ParkTimeout};
use crate::outcome::Outcome;
use crate::policy::RetryPolicy;
use crate::slot::ConnectionSlot;
use crate::store::{AnyConnection, Backend, InboxConnection, InboxDatabase};
use crate::store::{ClaimMode, Rejection, RejectionReason, StoredMessage};

type AnyMessage = dyn Any + Send + Sync;

/// A handler with its types erased, as the dispatcher drives it.
#[doc(hidden)]
pub trait DynHandler: Send + Sync + 'static {
    fn consumer(&self) -> &'static str;
    fn message_name(&self) -> &'static str;
    fn function(&self) -> &'static str;
    fn backend(&self) -> Backend;
    fn message_type(&self) -> TypeId;
    fn decode(&self, payload: &[u8]) -> Result<Box<AnyMessage>, serde_json::Error>;
    fn key(&self, msg: &AnyMessage) -> Result<IdempotencyKey, KeyError>;
    fn ordering(&self, msg: &AnyMessage) -> Result<Option<Ordering>, KeyError>;
    fn gaps(&self) -> GapPolicy;
    fn fingerprint(&self, msg: &AnyMessage) -> Result<Fingerprint, FingerprintError>;
    fn invoke<'c>(
        &'c self,
        conn: AnyConnection<'c>,
        msg: &'c AnyMessage,
        delivery: &'c Delivery<'c>,
    ) -> BoxFuture<'c, Result<Outcome<()>, Error<BoxError>>>;
    /// Runs only the handler's body on `conn` (inside a caller's transaction), for batches.
    fn call_body<'c>(
        &'c self,
        conn: AnyConnection<'c>,
        msg: &'c AnyMessage,
    ) -> BoxFuture<'c, Result<(), BodyError>>;
    fn max_attempts(&self) -> Option<u32>;
}

/// A handler body's error, boxed, with its class and text.
#[doc(hidden)]
pub struct BodyError {
    pub(crate) class: crate::ErrorClass,
    pub(crate) text: String,
    pub(crate) error: BoxError,
}

fn downcast<M: 'static>(msg: &AnyMessage) -> &M {
    msg.downcast_ref::<M>()
        .expect("dispatcher grouped handlers by message type")
}

impl<H> DynHandler for H
where
    H: Handler,
    H::Error: Into<BoxError>,
{
    fn consumer(&self) -> &'static str {
        H::CONSUMER
    }
    fn message_name(&self) -> &'static str {
        <H::Message as Message>::NAME
    }
    fn function(&self) -> &'static str {
        H::FUNCTION
    }
    fn backend(&self) -> Backend {
        <H::Connection as InboxConnection>::BACKEND
    }
    fn message_type(&self) -> TypeId {
        TypeId::of::<H::Message>()
    }
    fn decode(&self, payload: &[u8]) -> Result<Box<AnyMessage>, serde_json::Error> {
        Ok(Box::new(serde_json::from_slice::<H::Message>(payload)?))
    }
    fn key(&self, msg: &AnyMessage) -> Result<IdempotencyKey, KeyError> {
        H::key(downcast::<H::Message>(msg))
    }
    fn ordering(&self, msg: &AnyMessage) -> Result<Option<Ordering>, KeyError> {
        H::ordering(downcast::<H::Message>(msg))
    }
    fn gaps(&self) -> GapPolicy {
        H::GAPS
    }
    fn fingerprint(&self, msg: &AnyMessage) -> Result<Fingerprint, FingerprintError> {
        Fingerprint::of(<H::Message as Message>::NAME, downcast::<H::Message>(msg))
    }
    fn invoke<'c>(
        &'c self,
        conn: AnyConnection<'c>,
        msg: &'c AnyMessage,
        delivery: &'c Delivery<'c>,
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
    fn max_attempts(&self) -> Option<u32> {
        H::MAX_ATTEMPTS
    }
}

/// One `#[idempotent]` handler, as the registry holds it: what
/// [`handler!(path::to::function)`](crate::handler!) gives, for
/// [`Dispatcher::from_handlers`]. `#[idempotent]` submits one of these to the `inventory`
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

fn info(handler: &dyn DynHandler) -> HandlerInfo {
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

/// The result of one message for one consumer.
#[derive(Debug)]
#[non_exhaustive]
pub struct ConsumerOutcome {
    /// The consumer.
    pub consumer: &'static str,
    /// The handler function (module path and name).
    pub function: &'static str,
    /// The outcome, or why there is none. Handler errors are boxed.
    pub result: Result<Outcome<()>, Error<BoxError>>,
}

/// Routes envelopes to every consumer registered for their message name.
///
/// Built from the `inventory` registry of `#[idempotent]` handlers whose connection type belongs
/// to the pool's backend (`PgPool` → handlers taking `&mut PgConnection`).
///
/// ```no_run
/// # async fn demo(pool: sqlx::PgPool) -> Result<(), Box<dyn std::error::Error>> {
/// use inbox_runtime::{Dispatcher, Envelope};
///
/// inbox_runtime::migrate(&pool).await?;
/// let dispatcher = Dispatcher::from_registry(pool)?;
/// for handler in dispatcher.handlers() {
///     println!("{handler}");
/// }
/// let payload = br#"{"event_id":"0190c7f8-9d3e-7b21-8c4a-5e6f7a8b9c0d","account_id":"a-1","amount_cents":500}"#;
/// for outcome in dispatcher.dispatch(&Envelope::new("payments.captured", payload.to_vec())).await? {
///     println!("{}: {:?}", outcome.consumer, outcome.result);
/// }
/// # Ok(()) }
/// ```
pub struct Dispatcher<DB: InboxDatabase> {
    pub(crate) pool: Pool<DB>,
    pub(crate) routes: HashMap<&'static str, Vec<&'static dyn DynHandler>>,
    pub(crate) policy: RetryPolicy,
    pub(crate) park: ParkPolicy,
}

impl<DB: InboxDatabase> fmt::Debug for Dispatcher<DB> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Dispatcher")
            .field("backend", &DB::BACKEND)
            .field("handlers", &self.handlers())
            .finish()
    }
}

impl<DB: InboxDatabase> Dispatcher<DB> {
    /// A dispatcher over `pool` with every registered handler of this backend.
    ///
    /// # Errors
    /// [`RegistryError::NoHandlers`] if no handler of this backend is linked in;
    /// [`RegistryError::DuplicateConsumer`] if two handlers share a consumer name for the same
    /// message.
    pub fn from_registry(pool: Pool<DB>) -> Result<Self, RegistryError> {
        let registrations = inventory::iter::<Registration>
            .into_iter()
            .map(|registration| registration.handler)
            .collect();
        Self::build(pool, registrations, false)
    }

    /// A dispatcher over `pool` with exactly the handlers listed, each named with
    /// [`handler!`](crate::handler!): the explicit alternative to [`from_registry`](Self::from_registry),
    /// which only sees handlers in crates that are linked into the program (a crate that
    /// nothing references is not). Listing one handler twice is harmless.
    ///
    /// ```no_run
    /// # mod ledger {
    /// #     #[derive(Clone, serde::Serialize, serde::Deserialize, inbox_runtime::Message)]
    /// #     pub struct Credit { #[message(key)] pub id: String }
    /// #     #[inbox_runtime::idempotent(consumer = "ledger")]
    /// #     pub async fn credit(conn: &mut sqlx::PgConnection, msg: Credit) -> Result<(), sqlx::Error> { Ok(()) }
    /// # }
    /// # fn demo(pool: sqlx::PgPool) -> Result<(), inbox_runtime::RegistryError> {
    /// use inbox_runtime::{Dispatcher, handler};
    ///
    /// let dispatcher = Dispatcher::from_handlers(pool, [handler!(ledger::credit)])?;
    /// # Ok(()) }
    /// ```
    ///
    /// # Errors
    /// [`RegistryError::NoHandlers`] if the list is empty; [`RegistryError::WrongBackend`] if a
    /// handler takes another backend's connection; [`RegistryError::DuplicateConsumer`] if two
    /// handlers share a consumer name for the same message.
    pub fn from_handlers(
        pool: Pool<DB>,
        handlers: impl IntoIterator<Item = Registration>,
    ) -> Result<Self, RegistryError> {
        let mut listed: Vec<&'static dyn DynHandler> = Vec::new();
        for registration in handlers {
            let handler = registration.handler;
            if handler.backend() != DB::BACKEND {
                return Err(RegistryError::WrongBackend {
                    function: handler.function(),
                    backend: handler.backend(),
                    expected: DB::BACKEND,
                });
            }
            if !listed.iter().any(|h| h.function() == handler.function()) {
                listed.push(handler);
            }
        }
        Self::build(pool, listed, true)
    }

    fn build(
        pool: Pool<DB>,
        mut registrations: Vec<&'static dyn DynHandler>,
        explicit: bool,
    ) -> Result<Self, RegistryError> {
        let mut routes: HashMap<&'static str, Vec<&'static dyn DynHandler>> = HashMap::new();
        let mut other = 0;
        let mut seen: BTreeMap<(&'static str, &'static str), &'static str> = BTreeMap::new();
        registrations.sort_by_key(|h| (h.message_name(), h.consumer(), h.function()));
        for handler in registrations {
            if handler.backend() != DB::BACKEND {
                other += 1;
                continue;
            }
            if let Some(first) = seen.insert(
                (handler.consumer(), handler.message_name()),
                handler.function(),
            ) {
                return Err(RegistryError::DuplicateConsumer {
                    consumer: handler.consumer(),
                    message_name: handler.message_name(),
                    first,
                    second: handler.function(),
                });
            }
            routes
                .entry(handler.message_name())
                .or_default()
                .push(handler);
        }
        if routes.is_empty() {
            return Err(if explicit {
                RegistryError::NoHandlersListed {
                    backend: DB::BACKEND,
                }
            } else {
                RegistryError::NoHandlers {
                    backend: DB::BACKEND,
                    other,
                }
            });
        }
        Ok(Self {
            pool,
            routes,
            policy: RetryPolicy::default(),
            park: ParkPolicy::default(),
        })
    }

    /// Replaces the default [`ParkPolicy`] used by [`Dispatcher::sweep_parked`].
    pub fn with_park_policy(mut self, park: ParkPolicy) -> Self {
        self.park = park;
        self
    }

    /// Replaces the default [`RetryPolicy`] (handlers' own `max_attempts` still win).
    pub fn with_retry_policy(mut self, policy: RetryPolicy) -> Self {
        self.policy = policy;
        self
    }

    /// The retry policy in force.
    pub fn retry_policy(&self) -> &RetryPolicy {
        &self.policy
    }

    /// The handlers this dispatcher routes to, sorted by message name and consumer.
    pub fn handlers(&self) -> Vec<HandlerInfo> {
        let mut all: Vec<HandlerInfo> = self
            .routes
            .values()
            .flatten()
            .map(|handler| info(*handler))
            .collect();
        all.sort_by(|a, b| (a.message_name, a.consumer).cmp(&(b.message_name, b.consumer)));
        all
    }

    /// The pool the dispatcher runs handlers on.
    pub fn pool(&self) -> &Pool<DB> {
        &self.pool
    }

    /// Runs every consumer registered for `envelope.message_name`, each in its own transaction
    /// and inbox scope, one after the other in consumer-name order. Returns one
    /// [`ConsumerOutcome`] per consumer.
    ///
    /// The payload is decoded once per message type, and every consumer's key is read, before
    /// any database work: a bad envelope writes nothing.
    ///
    /// If the envelope's [`SourceMetadata::published_at`](crate::SourceMetadata::published_at)
    /// is set, the lag (now minus that time, in seconds) is recorded per consumer in the
    /// histogram `inbox_lag_seconds{consumer}`.
    ///
    /// # Errors
    /// [`DispatchError::NoMessageName`] if the envelope's name is empty,
    /// [`DispatchError::UnknownMessage`] if no handler takes this name,
    /// [`DispatchError::Decode`] (with line and column) if the payload is not valid JSON of the
    /// message type, [`DispatchError::Key`] if a consumer's key is missing, null, empty or too
    /// long, [`DispatchError::Fingerprint`] if the message cannot be fingerprinted. Per-consumer
    /// failures (handler error, conflict, database) are in each [`ConsumerOutcome::result`].
    ///
    /// Each call acquires a connection from the pool and gives it back: sqlx's pool pings on
    /// both (two round trips more per envelope). A loop that dispatches many envelopes should
    /// hold a connection across them with [`dispatch_on`](Self::dispatch_on), as the
    /// [`Worker`](crate::Worker) does.
    pub async fn dispatch(
        &self,
        envelope: &Envelope,
    ) -> Result<Vec<ConsumerOutcome>, DispatchError> {
        self.dispatch_on(&mut ConnectionSlot::new(), envelope).await
    }

    /// [`dispatch`](Self::dispatch) on the connection held by `slot` (acquired from the pool if
    /// the slot is empty, replaced if it was lost): the same outcomes, errors and guarantees,
    /// without the pool's round trips per envelope. See [`ConnectionSlot`].
    ///
    /// # Errors
    /// As [`dispatch`](Self::dispatch).
    pub async fn dispatch_on(
        &self,
        slot: &mut ConnectionSlot<DB>,
        envelope: &Envelope,
    ) -> Result<Vec<ConsumerOutcome>, DispatchError> {
        let prepared = self.prepare(envelope)?;
        let mut slot = slot.guard();
        let mut outcomes = Vec::with_capacity(prepared.items.len());
        for item in &prepared.items {
            outcomes.push(self.run_item(&mut slot, &prepared, item).await);
        }
        slot.done();
        Ok(outcomes)
    }

    /// Decodes an envelope once per message type and reads every consumer's key and ordering.
    pub(crate) fn prepare<'e>(
        &self,
        envelope: &'e Envelope,
    ) -> Result<Prepared<'e>, DispatchError> {
        if envelope.message_name.is_empty() {
            return Err(DispatchError::NoMessageName);
        }
        let handlers = self
            .routes
            .get(envelope.message_name.as_str())
            .ok_or_else(|| DispatchError::UnknownMessage {
                message_name: envelope.message_name.clone(),
            })?;

        // Decode once per message type (consumers of one name almost always share one type).
        let mut decoded: Vec<(TypeId, Box<AnyMessage>, Fingerprint)> = Vec::with_capacity(1);
        let mut items = Vec::with_capacity(handlers.len());
        for handler in handlers {
            let index = match decoded
                .iter()
                .position(|(ty, ..)| *ty == handler.message_type())
            {
                Some(index) => index,
                None => {
                    let msg = handler.decode(&envelope.payload).map_err(|source| {
                        DispatchError::Decode {
                            message_name: envelope.message_name.clone(),
                            line: source.line(),
                            column: source.column(),
                            source,
                        }
                    })?;
                    let fingerprint = handler.fingerprint(&*msg).map_err(|source| {
                        DispatchError::Fingerprint {
                            message_name: envelope.message_name.clone(),
                            source,
                        }
                    })?;
                    decoded.push((handler.message_type(), msg, fingerprint));
                    decoded.len() - 1
                }
            };
            let key_error = |source| DispatchError::Key {
                consumer: handler.consumer(),
                source,
            };
            let key = handler.key(&*decoded[index].1).map_err(key_error)?;
            let ordering = handler.ordering(&*decoded[index].1).map_err(key_error)?;
            items.push(PreparedItem {
                handler: *handler,
                message: index,
                key,
                ordering,
            });
        }
        // Lag: how long after its production the message reaches its consumers.
        let lag = envelope
            .source
            .as_ref()
            .and_then(|source| source.published_at)
            .map(|at| {
                std::time::SystemTime::now()
                    .duration_since(at)
                    .unwrap_or_default()
            });
        Ok(Prepared {
            envelope,
            decoded,
            items,
            lag,
        })
    }

    /// Runs one consumer of a prepared envelope in its own transaction (the single path).
    pub(crate) async fn run_item(
        &self,
        slot: &mut ConnectionSlot<DB>,
        prepared: &Prepared<'_>,
        item: &PreparedItem,
    ) -> ConsumerOutcome {
        let handler = item.handler;
        if let Some(lag) = prepared.lag {
            metrics::histogram!("inbox_lag_seconds", "consumer" => handler.consumer())
                .record(lag.as_secs_f64());
        }
        let (_, msg, fingerprint) = &prepared.decoded[item.message];
        let delivery = Delivery {
            key: &item.key,
            fingerprint,
            source: prepared.envelope.source.as_ref(),
            payload: Some(&prepared.envelope.payload),
            policy: &self.policy,
            mode: ClaimMode::Deliver,
            ordering: item.ordering.as_ref(),
        };
        let result = self.invoke(slot, handler, &**msg, &delivery).await;
        if let (Ok(Outcome::Processed(())), Some(ordering)) = (&result, &item.ordering) {
            self.apply_parked_successors(slot, handler, ordering).await;
        }
        ConsumerOutcome {
            consumer: handler.consumer(),
            function: handler.function(),
            result,
        }
    }

    /// Runs one handler on the slot's connection; a connection lost on the way (the attempt's
    /// failure not even recorded) is replaced once and the delivery run again — the claim makes
    /// that safe.
    async fn invoke(
        &self,
        slot: &mut ConnectionSlot<DB>,
        handler: &'static dyn DynHandler,
        msg: &AnyMessage,
        delivery: &Delivery<'_>,
    ) -> Result<Outcome<()>, Error<BoxError>> {
        let mut result = self.invoke_once(slot, handler, msg, delivery).await;
        if lost_connection(&result) {
            slot.discard();
            tracing::warn!(
                consumer = handler.consumer(),
                "connection lost; retrying on a new one"
            );
            result = self.invoke_once(slot, handler, msg, delivery).await;
            if lost_connection(&result) {
                slot.discard();
            }
        }
        result
    }

    async fn invoke_once(
        &self,
        slot: &mut ConnectionSlot<DB>,
        handler: &'static dyn DynHandler,
        msg: &AnyMessage,
        delivery: &Delivery<'_>,
    ) -> Result<Outcome<()>, Error<BoxError>> {
        match slot.get(&self.pool).await {
            Ok(conn) => {
                handler
                    .invoke(DB::any_connection(conn), msg, delivery)
                    .await
            }
            Err(source) => Err(Error::Database(StoreError {
                consumer: handler.consumer(),
                key: delivery.key.clone(),
                operation: "acquire",
                source,
            })),
        }
    }

    /// Keeps an envelope the dispatcher refused ([`DispatchError`]) in `inbox_rejections`,
    /// payload included, so that a source can ack it without losing it.
    ///
    /// # Errors
    /// The database's error if the row could not be written (then do not ack).
    pub async fn record_rejection(
        &self,
        envelope: &Envelope,
        error: &DispatchError,
    ) -> Result<(), sqlx::Error> {
        self.record_rejection_on(&mut ConnectionSlot::new(), envelope, error)
            .await
    }

    /// [`record_rejection`](Self::record_rejection) on the connection held by `slot`.
    ///
    /// # Errors
    /// As [`record_rejection`](Self::record_rejection).
    pub async fn record_rejection_on(
        &self,
        slot: &mut ConnectionSlot<DB>,
        envelope: &Envelope,
        error: &DispatchError,
    ) -> Result<(), sqlx::Error> {
        let (reason, consumer) = match error {
            DispatchError::UnknownMessage { .. } => (RejectionReason::UnknownMessage, None),
            DispatchError::NoMessageName
            | DispatchError::Decode { .. }
            | DispatchError::Fingerprint { .. } => (RejectionReason::Malformed, None),
            DispatchError::Key { consumer, .. } => (RejectionReason::InvalidKey, Some(*consumer)),
        };
        let detail = error.to_string();
        let rejection = Rejection {
            consumer,
            message_key: None,
            message_name: &envelope.message_name,
            reason,
            detail: &detail,
            payload_hash: None,
            payload: &envelope.payload,
            source: envelope.source.as_ref(),
        };
        let mut slot = slot.guard();
        let mut recorded = self.record_once(&mut slot, &rejection).await;
        // A connection lost since its last use is replaced once: the insert is not idempotent,
        // but a lost connection means it did not commit (or, at worst, that the same delivery
        // is kept twice, which loses nothing).
        if slot.discard_if_lost(&recorded) {
            recorded = self.record_once(&mut slot, &rejection).await;
            slot.discard_if_lost(&recorded);
        }
        slot.done();
        recorded
    }

    async fn record_once(
        &self,
        slot: &mut ConnectionSlot<DB>,
        rejection: &Rejection<'_>,
    ) -> Result<(), sqlx::Error> {
        let conn = slot.get(&self.pool).await?;
        DB::any_connection(conn)
            .store()
            .record_rejection(rejection)
            .await
    }

    /// Replays one `failed` or `dead` message: decodes its stored payload and runs its
    /// registered handler once, through the same claim (a `dead` key may be claimed by a replay).
    ///
    /// Replaying a key that is `processed` by now is a [`Outcome::Duplicate`]; two concurrent
    /// replays of one key apply it once (the second waits on the first's claim).
    ///
    /// # Errors
    /// [`ReplayError`] if the key is unknown, has no payload, no registered handler, or its
    /// payload no longer decodes or yields the stored key.
    pub async fn replay(&self, consumer: &str, key: &str) -> Result<ConsumerOutcome, ReplayError> {
        let stored = {
            let mut conn = self.pool.acquire().await?;
            DB::any_connection(&mut conn)
                .store()
                .fetch_message(consumer, key)
                .await?
        }
        .ok_or_else(|| ReplayError::NotFound {
            consumer: consumer.to_owned(),
            key: key.to_owned(),
        })?;
        let handler = self
            .routes
            .get(stored.message_name.as_str())
            .and_then(|handlers| handlers.iter().find(|h| h.consumer() == consumer))
            .copied()
            .ok_or_else(|| ReplayError::NoHandler {
                consumer: consumer.to_owned(),
                message_name: stored.message_name.clone(),
            })?;
        if stored.status == "processed" || stored.status == "discarded" {
            let outcome = if stored.status == "processed" {
                Outcome::Duplicate
            } else {
                Outcome::Discarded
            };
            return Ok(ConsumerOutcome {
                consumer: handler.consumer(),
                function: handler.function(),
                result: Ok(outcome),
            });
        }
        let mut conn = self.pool.acquire().await?;
        let result = run_stored(
            handler,
            DB::any_connection(&mut conn),
            &stored,
            ClaimMode::Replay,
            &self.policy,
        )
        .await?;
        drop(conn);
        if let (Ok(Outcome::Processed(())), Some(ordering)) = (&result, &stored.ordering()) {
            self.apply_parked_successors(&mut ConnectionSlot::new(), handler, ordering)
                .await;
        }
        Ok(ConsumerOutcome {
            consumer: handler.consumer(),
            function: handler.function(),
            result,
        })
    }

    /// Applies the parked successors of `ordering` that its processing made applicable.
    async fn apply_parked_successors(
        &self,
        slot: &mut ConnectionSlot<DB>,
        handler: &'static dyn DynHandler,
        ordering: &Ordering,
    ) {
        if handler.gaps() != GapPolicy::Park {
            return;
        }
        match slot.get(&self.pool).await {
            Ok(conn) => {
                apply_parked_successors(
                    DB::any_connection(conn),
                    handler.consumer(),
                    ordering,
                    &self.policy,
                )
                .await;
            }
            Err(error) => tracing::warn!(%error, "cannot apply parked successors now"),
        }
    }

    /// Surfaces parked messages whose gap has stayed open longer than the [`ParkPolicy`]'s
    /// timeout: dead-letters them, or releases them (applies them despite the gap, then their
    /// parked successors), as the policy says. At most 1000 per call; call it periodically
    /// (the worker does) or from the admin CLI.
    ///
    /// # Errors
    /// The database's error; messages handled before it stay handled.
    pub async fn sweep_parked(&self) -> Result<SweepReport, sqlx::Error> {
        let mut report = SweepReport::default();
        let expired = {
            let mut conn = self.pool.acquire().await?;
            DB::any_connection(&mut conn)
                .store()
                .expired_parked(self.park.timeout.as_secs_f64(), 1000)
                .await?
        };
        for parked in expired {
            let mut conn = self.pool.acquire().await?;
            match self.park.on_timeout {
                ParkTimeout::DeadLetter => {
                    let reason = format!(
                        "parked for more than {} s waiting for sequence {} of aggregate `{}`",
                        self.park.timeout.as_secs(),
                        parked.sequence - 1,
                        parked.aggregate_id
                    );
                    if DB::any_connection(&mut conn)
                        .store()
                        .dead_letter_parked(&parked.consumer, &parked.message_key, &reason)
                        .await?
                    {
                        report.dead_lettered += 1;
                    }
                }
                ParkTimeout::Release => {
                    let Some(handler) = self
                        .routes
                        .get(parked.message_name.as_str())
                        .and_then(|hs| hs.iter().find(|h| h.consumer() == parked.consumer))
                        .copied()
                    else {
                        continue;
                    };
                    let Some(stored) = DB::any_connection(&mut conn)
                        .store()
                        .fetch_message(&parked.consumer, &parked.message_key)
                        .await?
                    else {
                        continue;
                    };
                    let result = run_stored(
                        handler,
                        DB::any_connection(&mut conn),
                        &stored,
                        ClaimMode::Release,
                        &self.policy,
                    )
                    .await;
                    drop(conn);
                    if let Ok(Ok(Outcome::Processed(()))) = result {
                        report.released += 1;
                        let ordering = Ordering {
                            aggregate_id: parked.aggregate_id.clone(),
                            sequence: parked.sequence,
                        };
                        self.apply_parked_successors(
                            &mut ConnectionSlot::new(),
                            handler,
                            &ordering,
                        )
                        .await;
                    }
                }
            }
        }
        Ok(report)
    }
}

/// An envelope decoded and keyed for each of its consumers.
pub(crate) struct Prepared<'e> {
    pub(crate) envelope: &'e Envelope,
    /// One decoded message (and its fingerprint) per message type.
    pub(crate) decoded: Vec<(TypeId, Box<AnyMessage>, Fingerprint)>,
    /// One item per consumer, in consumer order.
    pub(crate) items: Vec<PreparedItem>,
    lag: Option<std::time::Duration>,
}

/// One consumer of a prepared envelope.
pub(crate) struct PreparedItem {
    pub(crate) handler: &'static dyn DynHandler,
    /// Index into [`Prepared::decoded`].
    pub(crate) message: usize,
    pub(crate) key: IdempotencyKey,
    pub(crate) ordering: Option<Ordering>,
}

/// What one [`Dispatcher::sweep_parked`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub struct SweepReport {
    /// Parked messages turned dead.
    pub dead_lettered: u64,
    /// Parked messages applied despite their gap.
    pub released: u64,
}

/// Runs a stored (failed, dead or parked) message through its handler in `mode`.
async fn run_stored(
    handler: &'static dyn DynHandler,
    conn: AnyConnection<'_>,
    stored: &StoredMessage,
    mode: ClaimMode,
    policy: &RetryPolicy,
) -> Result<Result<Outcome<()>, Error<BoxError>>, ReplayError> {
    let payload = stored
        .payload
        .as_deref()
        .ok_or_else(|| ReplayError::NoPayload {
            consumer: stored.consumer.clone(),
            key: stored.message_key.clone(),
            status: stored.status.clone(),
        })?;
    let msg = handler
        .decode(payload)
        .map_err(|source| ReplayError::Decode {
            message_name: stored.message_name.clone(),
            source,
        })?;
    let message_key = handler.key(&*msg).map_err(ReplayError::Key)?;
    if message_key.as_str() != stored.message_key {
        return Err(ReplayError::KeyMismatch {
            stored: stored.message_key.clone(),
            decoded: message_key.into_string(),
        });
    }
    let ordering = handler.ordering(&*msg).map_err(ReplayError::Key)?;
    let fingerprint = handler
        .fingerprint(&*msg)
        .map_err(ReplayError::Fingerprint)?;
    let delivery = Delivery {
        key: &message_key,
        fingerprint: &fingerprint,
        source: None,
        payload: Some(payload),
        policy,
        mode,
        ordering: ordering.as_ref(),
    };
    Ok(handler.invoke(conn, &*msg, &delivery).await)
}

/// After `ordering` was applied: applies, in order, each parked successor of its aggregate
/// (sequence + 1, + 2, …), each in its own transaction, until one is missing or does not apply.
/// Problems are logged, not returned: the message that triggered this was processed.
pub(crate) async fn apply_parked_successors(
    mut conn: AnyConnection<'_>,
    consumer: &str,
    ordering: &Ordering,
    policy: &RetryPolicy,
) {
    let mut sequence = ordering.sequence;
    loop {
        let next = async {
            let store = conn.reborrow().store();
            let Some(parked) = store
                .find_parked(consumer, &ordering.aggregate_id, sequence + 1)
                .await?
            else {
                return Ok(None);
            };
            let stored = store.fetch_message(consumer, &parked.message_key).await?;
            Ok::<_, sqlx::Error>(stored.map(|stored| (parked, stored)))
        }
        .await;
        let (parked, stored) = match next {
            Ok(Some(found)) => found,
            Ok(None) => return,
            Err(error) => {
                tracing::warn!(%error, consumer, "cannot look up parked successors");
                return;
            }
        };
        let Some(handler) = find_handler(conn.backend(), consumer, &parked.message_name) else {
            tracing::warn!(
                consumer,
                message = parked.message_name,
                "parked message has no registered handler"
            );
            return;
        };
        match run_stored(handler, conn.reborrow(), &stored, ClaimMode::Resume, policy).await {
            Ok(Ok(Outcome::Processed(()))) => sequence += 1,
            Ok(other) => {
                tracing::info!(
                    consumer,
                    key = parked.message_key,
                    outcome = ?other.map(|o| o.kind()).map_err(|e| e.kind()),
                    "parked successor not applied"
                );
                return;
            }
            Err(error) => {
                tracing::warn!(%error, consumer, key = parked.message_key, "parked successor cannot run");
                return;
            }
        }
    }
}

/// The registered handler of `consumer` for `message_name` on `backend`.
fn find_handler(
    backend: Backend,
    consumer: &str,
    message_name: &str,
) -> Option<&'static dyn DynHandler> {
    inventory::iter::<Registration>
        .into_iter()
        .map(|registration| registration.handler)
        .find(|h| {
            h.backend() == backend && h.consumer() == consumer && h.message_name() == message_name
        })
}

fn lost_connection<T>(result: &Result<T, Error<BoxError>>) -> bool {
    let is_lost = crate::slot::connection_lost;
    match result {
        Err(Error::Database(error)) => is_lost(&error.source),
        Err(Error::Handler(failure)) => {
            failure.disposition == crate::Disposition::NotRecorded
                && failure
                    .error
                    .downcast_ref::<sqlx::Error>()
                    .is_some_and(is_lost)
        }
        _ => false,
    }
}

/// Why [`Dispatcher::replay`] could not run a message.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ReplayError {
    /// No row for this consumer and key.
    #[error("consumer `{consumer}` has no message with key `{key}`")]
    NotFound {
        /// The consumer.
        consumer: String,
        /// The key.
        key: String,
    },
    /// The row keeps no payload.
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
    /// The decoded message has no valid key.
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
}
