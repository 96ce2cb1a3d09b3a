//! `#[idempotent]` handlers on DynamoDB, and the [`DynamoDispatcher`] that runs them by message
//! name.
//!
//! A function annotated `#[idempotent(consumer = "...")]` whose first parameter is
//! `&mut DynamoTx` adds its writes to the transaction; the macro rewrites it into
//! `fn(inbox: &DynamoInbox, msg: M) -> Result<Outcome<T>, DynamoError<E>>`, which runs it through
//! [`DynamoInbox::process`]'s protocol (the claim and the handler's actions in one
//! `TransactWriteItems`), and registers it (`inventory`, a collection of its own: the SQL
//! [`Dispatcher`](crate::Dispatcher) never sees it) for [`DynamoDispatcher::from_registry`].

use std::fmt;

use super::handler::{DynDynamoHandler, DynamoRegistration, Run, run_payload};
use super::{DynamoError, DynamoInbox, Mode};
use crate::dispatch::registry::HandlerRoutes;
use crate::dispatch::{ConsumerOutcome, HandlerInfo};
use crate::store::Backend;
use crate::types::classify::BoxError;
use crate::types::envelope::Envelope;
use crate::types::error::{DispatchError, RegistryError, ReplayError};
use crate::types::key::IdempotencyKey;
use crate::types::limit::{PayloadLimit, PayloadLimitError};
use crate::types::ordering::ParkPolicy;
use crate::types::outcome::Outcome;
use crate::types::status::Status;

/// The result of one message for one consumer of a [`DynamoDispatcher`]: the SQL
/// dispatcher's [`ConsumerOutcome`] with DynamoDB's error.
pub type DynamoConsumerOutcome = ConsumerOutcome<DynamoError<BoxError>>;

/// Routes raw deliveries (message name and JSON payload, an [`Envelope`]) to every DynamoDB
/// handler registered for their message name, each through the claim protocol of its
/// [`DynamoInbox`]: the DynamoDB counterpart of the SQL [`Dispatcher`](crate::Dispatcher), with
/// the same checks before anything runs ([`DispatchError`]) and the same payload limit.
///
/// ```no_run
/// # async fn demo(client: inbox_runtime::dynamodb::sdk::Client) -> Result<(), Box<dyn std::error::Error>> {
/// use inbox_runtime::Envelope;
/// use inbox_runtime::dynamodb::{DynamoDispatcher, DynamoInbox};
///
/// let inbox = DynamoInbox::new(client, "inbox");
/// inbox.ensure_table().await?;
/// let dispatcher = DynamoDispatcher::from_registry(inbox)?;
/// let payload = br#"{"event_id":"e-1","account_id":"a-1","amount_cents":500}"#;
/// let envelope = Envelope::new("payments.captured", payload.to_vec());
/// for outcome in dispatcher.dispatch(&envelope).await? {
///     println!("{}: {:?}", outcome.consumer, outcome.result);
/// }
/// # Ok(()) }
/// ```
pub struct DynamoDispatcher {
    inbox: DynamoInbox,
    routes: HandlerRoutes<dyn DynDynamoHandler>,
    max_payload_bytes: PayloadLimit,
    /// What [`sweep_parked`](Self::sweep_parked) does with parked messages.
    pub(super) park: ParkPolicy,
}

impl fmt::Debug for DynamoDispatcher {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("DynamoDispatcher")
            .field("table", &self.inbox.table())
            .field("handlers", &self.handlers())
            .finish()
    }
}

impl DynamoDispatcher {
    /// A dispatcher over `inbox` with every registered `#[idempotent]` DynamoDB handler.
    ///
    /// # Errors
    /// [`RegistryError::NoHandlers`] (backend [`Backend::DynamoDb`]) if none is linked in;
    /// [`RegistryError::DuplicateConsumer`] if two handlers share a consumer name for the same
    /// message.
    pub fn from_registry(inbox: DynamoInbox) -> Result<Self, RegistryError> {
        let handlers = inventory::iter::<DynamoRegistration>
            .into_iter()
            .map(|registration| registration.handler())
            .collect();
        let other = crate::dispatch::registered_handlers().len();
        Self::build(inbox, handlers, false, other)
    }

    /// A dispatcher over `inbox` with exactly the handlers listed, each named with
    /// [`handler!`](crate::handler!). Listing one handler twice is harmless.
    ///
    /// # Errors
    /// [`RegistryError::NoHandlersListed`] if the list is empty;
    /// [`RegistryError::DuplicateConsumer`] if two handlers share a consumer name for the same
    /// message.
    pub fn from_handlers(
        inbox: DynamoInbox,
        handlers: impl IntoIterator<Item = DynamoRegistration>,
    ) -> Result<Self, RegistryError> {
        let listed = HandlerRoutes::listed(handlers.into_iter().map(|r| r.handler()));
        Self::build(inbox, listed, true, 0)
    }

    fn build(
        inbox: DynamoInbox,
        handlers: Vec<&'static dyn DynDynamoHandler>,
        explicit: bool,
        other: usize,
    ) -> Result<Self, RegistryError> {
        Ok(Self {
            inbox,
            routes: HandlerRoutes::new(handlers, Backend::DynamoDb, explicit, other)?,
            max_payload_bytes: PayloadLimit::DEFAULT,
            park: ParkPolicy::default(),
        })
    }

    /// Sets the largest payload this dispatcher decodes, in bytes (default 1 MiB, as the SQL
    /// [`Dispatcher`](crate::Dispatcher)'s; from 1 to [`PayloadLimit::MAX_BYTES`], 256 MiB). A
    /// larger one is refused before decoding with [`DispatchError::TooLarge`].
    ///
    /// # Errors
    /// [`PayloadLimitError`] if `limit` is 0 or above 256 MiB.
    pub fn with_max_payload_bytes(mut self, limit: usize) -> Result<Self, PayloadLimitError> {
        self.max_payload_bytes = PayloadLimit::new(limit)?;
        Ok(self)
    }

    /// The payload limit in force, in bytes.
    pub fn max_payload_bytes(&self) -> usize {
        self.max_payload_bytes.bytes()
    }

    /// The payload limit, for a source ([`Source::set_payload_limit`](crate::source::Source::set_payload_limit)).
    pub(crate) fn payload_limit(&self) -> PayloadLimit {
        self.max_payload_bytes
    }

    /// The inbox the handlers run on.
    pub fn inbox(&self) -> &DynamoInbox {
        &self.inbox
    }

    /// The handlers this dispatcher routes to, sorted by message name and consumer.
    pub fn handlers(&self) -> Vec<HandlerInfo> {
        self.routes.infos(|_| Backend::DynamoDb)
    }

    pub(crate) fn route(
        &self,
        consumer: &str,
        message_name: &str,
    ) -> Option<&'static dyn DynDynamoHandler> {
        self.routes.route(consumer, message_name)
    }

    /// Runs every consumer registered for `envelope.message_name`, one after the other in
    /// consumer-name order, each through its own claim (its own `TransactWriteItems`). Returns
    /// one [`DynamoConsumerOutcome`] per consumer; the payload as delivered is what a failed or
    /// dead item keeps.
    ///
    /// The payload is decoded once per message type, and every consumer's key and ordering are
    /// read, before any DynamoDB call: a refused envelope writes nothing. Keep it with
    /// [`record_rejection`](Self::record_rejection) before acking it (the
    /// [`DynamoWorker`](super::DynamoWorker) does), as on the SQL stores.
    ///
    /// # Errors
    /// As the SQL [`Dispatcher::dispatch`](crate::Dispatcher::dispatch), in this order:
    /// [`DispatchError::TooLarge`] if the payload is over the limit or its source cut it,
    /// [`DispatchError::NoMessageName`] if the envelope's name is empty,
    /// [`DispatchError::UnknownMessage`] if no handler takes this name,
    /// [`DispatchError::NotUtf8`] / [`DispatchError::UnpairedSurrogate`] for a payload that is
    /// no Unicode text, [`DispatchError::Decode`] (with line and column) if it is not valid
    /// JSON of the message type, [`DispatchError::Key`] if a consumer's key (or, for an ordered
    /// consumer, its aggregate or sequence) is missing, null, empty, too long or out of range,
    /// [`DispatchError::Fingerprint`] if the message cannot be
    /// fingerprinted. Per-consumer failures (handler error, conflict, DynamoDB) are in each
    /// [`DynamoConsumerOutcome::result`].
    pub async fn dispatch(
        &self,
        envelope: &Envelope,
    ) -> Result<Vec<DynamoConsumerOutcome>, DispatchError> {
        let decoded = self.routes.decode(envelope, self.max_payload_bytes)?;
        let mut outcomes = Vec::with_capacity(decoded.items.len());
        for item in &decoded.items {
            let (_, msg, fingerprint) = &decoded.messages[item.message];
            let run = Run {
                key: &item.key,
                ordering: item.ordering.as_ref(),
                fingerprint: *fingerprint,
                payload: &envelope.payload,
                mode: Mode::Deliver,
                routes: self,
            };
            let result = item.handler.invoke(&self.inbox, &**msg, run).await;
            outcomes.push(DynamoConsumerOutcome::of(item.handler, result));
        }
        Ok(outcomes)
    }

    /// Replays one `failed` or `dead` message: reads its item (`GetItem`, strongly consistent),
    /// decodes its stored payload (`payload`, under its stored `message_name`) and runs its
    /// registered handler once through the same claim, which a replay may take over from a
    /// `dead` item, or from a `failed` one before its next attempt is due. A handler that fails
    /// again is recorded as any attempt is (failed, or dead if permanent or at `max_attempts`).
    ///
    /// A key that is `processed` by now is [`Outcome::Duplicate`], a discarded one
    /// [`Outcome::Discarded`]: nothing runs. Two concurrent replays of one key apply it once
    /// (the second's claim condition fails, and it reads the item as processed).
    ///
    /// # Errors
    /// [`ReplayError`] if the key is unknown, its item keeps no payload or is malformed,
    /// no handler of this dispatcher serves its consumer and message, its payload no longer
    /// decodes or yields the stored key, or the read failed. The run's own errors are in the
    /// returned [`DynamoConsumerOutcome::result`].
    pub async fn replay(
        &self,
        consumer: &str,
        key: &str,
    ) -> Result<DynamoConsumerOutcome, ReplayError> {
        // A key that could not have been stored is refused before any call.
        IdempotencyKey::new(key, "(replay)", "key").map_err(ReplayError::Key)?;
        let stored = self
            .inbox
            .admin()
            .show(consumer, key)
            .await
            .map_err(|error| ReplayError::Read(Box::new(error)))?
            .ok_or_else(|| ReplayError::NotFound {
                consumer: consumer.to_owned(),
                key: key.to_owned(),
            })?;
        let message_name = stored.message_name.as_str();
        let handler = self
            .route(consumer, message_name)
            .ok_or_else(|| ReplayError::NoHandler {
                consumer: consumer.to_owned(),
                message_name: message_name.to_owned(),
            })?;
        match stored.status {
            Status::Processed => {
                return Ok(DynamoConsumerOutcome::of(handler, Ok(Outcome::Duplicate)));
            }
            Status::Discarded => {
                return Ok(DynamoConsumerOutcome::of(handler, Ok(Outcome::Discarded)));
            }
            _ => {}
        }
        let Some(payload) = &stored.payload else {
            return Err(ReplayError::NoPayload {
                consumer: consumer.to_owned(),
                key: key.to_owned(),
                status: stored.status.as_str().to_owned(),
            });
        };
        let result = run_payload(&self.inbox, self, handler, key, payload, Mode::Replay).await?;
        Ok(DynamoConsumerOutcome::of(handler, result))
    }
}
