//! The dispatcher: routes envelopes to every consumer registered for their message name, runs
//! each through the claim protocol, replays stored messages and sweeps parked ones.

mod batch;

use std::fmt;
use std::sync::Arc;

use sqlx::Pool;

use crate::cache::{CacheLayer, DedupeCache, Fill};
pub(crate) use crate::dispatch::registry::{Decoded, PreparedItem};
use crate::dispatch::registry::{HandlerInfo, HandlerRoutes, Registration};
use crate::ops::admin::Retention;
use crate::protocol::erased::{AnyMessage, DecodedMessages, DynHandler, ErasedHandler};
use crate::protocol::hooks::{HookRunner, Hooks, TransactionHook};
use crate::protocol::park::{Routes, apply_parked_successors, run_stored};
use crate::protocol::single::AttemptPlan;
use crate::setters::setters;
use crate::store::{
    AdminStore as _, ClaimStore as _, InboxConnection as _, InboxDatabase, OrderingStore as _,
    Rejection,
};
use crate::types::classify::BoxError;
use crate::types::envelope::Envelope;
use crate::types::error::{
    DispatchError, Disposition, Error, RegistryError, ReplayError, StoreError, StoreOperation,
};
use crate::types::fingerprint::Fingerprint;
use crate::types::limit::{PayloadLimit, PayloadLimitError};
use crate::types::ordering::{GapPolicy, Ordering, ParkPolicy, ParkTimeout};
use crate::types::outcome::Outcome;
use crate::types::policy::RetryPolicy;
use crate::types::slot::ConnectionSlot;
use crate::types::status::{ClaimMode, Status};

/// The result of one message for one consumer: of the SQL [`Dispatcher`] (`E` is
/// [`Error<BoxError>`], the default) or of the DynamoDB dispatcher (`DynamoConsumerOutcome`,
/// `E` is `DynamoError<BoxError>`; feature `dynamodb`).
#[derive(Debug)]
#[non_exhaustive]
pub struct ConsumerOutcome<E = Error<BoxError>> {
    /// The consumer.
    pub consumer: &'static str,
    /// The handler function (module path and name).
    pub function: &'static str,
    /// The outcome, or why there is none. Handler errors are boxed.
    pub result: Result<Outcome<()>, E>,
}

impl<E> ConsumerOutcome<E> {
    /// The result of `handler`.
    pub(crate) fn of<H: ErasedHandler + ?Sized>(
        handler: &H,
        result: Result<Outcome<()>, E>,
    ) -> Self {
        Self {
            consumer: handler.consumer(),
            function: handler.function(),
            result,
        }
    }
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
    pub(crate) routes: HandlerRoutes<dyn DynHandler>,
    pub(crate) policy: RetryPolicy,
    pub(crate) park: ParkPolicy,
    pub(crate) hooks: Hooks<DB>,
    pub(crate) max_payload_bytes: PayloadLimit,
    pub(crate) cache: Option<CacheLayer>,
    /// The table prefix of the scope it was built in: its operations run in it.
    pub(crate) prefix: Option<crate::store::TablePrefix>,
}

/// What a cache hit means for a delivery of `received`: the settled outcome when the cached
/// fingerprint is the same; `None` (ask the database, which reports the conflict as it always
/// does) when it is not.
pub(crate) fn answer(
    cache: &CacheLayer,
    handler: &dyn DynHandler,
    entry: crate::cache::CacheEntry,
    received: &Fingerprint,
) -> Option<Result<Outcome<()>, Error<BoxError>>> {
    if entry.fingerprint != *received {
        cache.hit(handler.consumer(), true);
        return None;
    }
    cache.hit(handler.consumer(), false);
    Some(Ok(match entry.status {
        Status::Dead => Outcome::Dead,
        Status::Discarded => Outcome::Discarded,
        _ => Outcome::Duplicate,
    }))
}

impl<DB: InboxDatabase> Routes for Dispatcher<DB> {
    fn route(&self, consumer: &str, message_name: &str) -> Option<&'static dyn DynHandler> {
        self.routes.route(consumer, message_name)
    }
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
            .map(|registration| registration.handler())
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
        let mut listed = Vec::new();
        for registration in handlers {
            let handler = registration.handler();
            if handler.backend() != DB::BACKEND {
                return Err(RegistryError::WrongBackend {
                    function: handler.function(),
                    backend: handler.backend(),
                    expected: DB::BACKEND,
                });
            }
            listed.push(handler);
        }
        Self::build(pool, HandlerRoutes::listed(listed), true)
    }

    fn build(
        pool: Pool<DB>,
        mut registrations: Vec<&'static dyn DynHandler>,
        explicit: bool,
    ) -> Result<Self, RegistryError> {
        let other = registrations
            .iter()
            .filter(|h| h.backend() != DB::BACKEND)
            .count();
        registrations.retain(|h| h.backend() == DB::BACKEND);
        Ok(Self {
            pool,
            routes: HandlerRoutes::new(registrations, DB::BACKEND, explicit, other)?,
            policy: RetryPolicy::default(),
            park: ParkPolicy::default(),
            hooks: Hooks::default(),
            max_payload_bytes: PayloadLimit::DEFAULT,
            cache: None,
            prefix: crate::store::TablePrefix::current(),
        })
    }

    /// The default payload limit: 1 MiB (1,048,576 bytes), [`PayloadLimit::DEFAULT`]. About the
    /// largest message the common brokers carry by default (SQS: 1 MiB; Kafka:
    /// `message.max.bytes` ≈ 1 MB; NATS: 1 MB `max_payload`), so a payload over it would not
    /// survive a relay either; and a dispatch holds a few copies of a payload at once (the
    /// bytes, the decoded message, its canonical form for the fingerprint), so the limit bounds
    /// a worker's memory per delivery.
    pub const DEFAULT_MAX_PAYLOAD_BYTES: usize = PayloadLimit::DEFAULT.bytes();

    /// Sets the largest payload this dispatcher decodes, in bytes (default
    /// [`DEFAULT_MAX_PAYLOAD_BYTES`](Self::DEFAULT_MAX_PAYLOAD_BYTES), 1 MiB; from 1 to
    /// [`PayloadLimit::MAX_BYTES`], 256 MiB). A larger one is refused before decoding with
    /// [`DispatchError::TooLarge`], and kept in `inbox_rejections` cut to the limit, with its
    /// real size. The [`Worker`](crate::Worker) gives the limit to its source
    /// ([`Source::set_payload_limit`](crate::source::Source::set_payload_limit)), which then
    /// stops reading a delivery at it.
    ///
    /// # Errors
    /// [`PayloadLimitError`] if `limit` is 0 or above 256 MiB (see [`PayloadLimit`]).
    pub fn with_max_payload_bytes(self, limit: usize) -> Result<Self, PayloadLimitError> {
        Ok(self.with_payload_limit(PayloadLimit::new(limit)?))
    }

    /// [`with_max_payload_bytes`](Self::with_max_payload_bytes) with a limit already checked.
    pub fn with_payload_limit(mut self, limit: PayloadLimit) -> Self {
        self.max_payload_bytes = limit;
        self
    }

    /// The payload limit in force, in bytes.
    pub fn max_payload_bytes(&self) -> usize {
        self.max_payload_bytes.bytes()
    }

    /// The payload limit in force.
    pub fn payload_limit(&self) -> PayloadLimit {
        self.max_payload_bytes
    }

    /// Adds a [`TransactionHook`]: its `before_commit` runs on the claim's transaction after
    /// each handler that returned `Ok` (after the hooks added before it), its `after_commit`
    /// once that transaction committed. Applies to every path of this dispatcher: single
    /// deliveries, batches, replays and parked successors.
    pub fn with_hook(mut self, hook: impl TransactionHook<DB>) -> Self {
        self.hooks.push(Arc::new(hook));
        self
    }

    /// The hooks, as the protocol runs them (`None` when there are none: nothing to call).
    pub(crate) fn hook_runner(&self) -> Option<&dyn HookRunner> {
        self.hooks.runner()
    }

    /// Puts a fast-path [dedupe cache](crate::cache) in front of the inbox: a delivery whose
    /// key the cache knows as settled with the same fingerprint is answered without a database
    /// round trip (`Duplicate`, `Dead` or `Discarded`); everything else — a miss, another
    /// fingerprint, a cache error or timeout — takes the claim as without a cache. The cache is
    /// filled after commit with final states only. Used by the single path, batches and the
    /// [`Worker`](crate::Worker) alike; [`replay`](Self::replay) and
    /// [`discard`](Self::discard) invalidate the keys they change. Off by default.
    ///
    /// `retention` is the inbox's retention (what [`admin::purge`](crate::ops::admin::purge) runs
    /// with): the cache's time to live must not be longer than its window, so that no entry
    /// outlives the inbox row it stands for by more than the window.
    ///
    /// # Errors
    /// [`CacheTtlError`](crate::cache::CacheTtlError) if `cache.ttl()` is longer than
    /// `retention.window()`, or zero.
    pub fn with_cache(
        mut self,
        cache: impl DedupeCache,
        retention: &Retention,
    ) -> Result<Self, crate::cache::CacheTtlError> {
        let ttl = cache.ttl();
        if ttl.is_zero() || ttl > retention.window() {
            return Err(crate::cache::CacheTtlError {
                ttl,
                window: retention.window(),
            });
        }
        self.cache = Some(CacheLayer::new(Arc::new(cache)));
        Ok(self)
    }

    setters! {
        /// Replaces the default [`ParkPolicy`] used by [`Dispatcher::sweep_parked`].
        pub fn with_park_policy(park: ParkPolicy) {
            self.park = park;
        }

        /// Replaces the default [`RetryPolicy`] (handlers' own `max_attempts` still win).
        pub fn with_retry_policy(policy: RetryPolicy) {
            self.policy = policy;
        }
    }

    /// The retry policy in force.
    pub fn retry_policy(&self) -> &RetryPolicy {
        &self.policy
    }

    /// The handlers this dispatcher routes to, sorted by message name and consumer.
    pub fn handlers(&self) -> Vec<HandlerInfo> {
        self.routes.infos(|handler| handler.backend())
    }

    /// The pool the dispatcher runs handlers on.
    pub fn pool(&self) -> &Pool<DB> {
        &self.pool
    }

    /// Runs every consumer registered for `envelope.message_name`, each in its own transaction
    /// and inbox scope, one after the other in consumer-name order. Returns one
    /// [`ConsumerOutcome`] per consumer.
    ///
    /// The payload is decoded once per message type, and every consumer's key and ordering are
    /// read, before any database work: a bad envelope writes nothing.
    ///
    /// If the envelope's [`SourceMetadata::published_at`](crate::SourceMetadata::published_at)
    /// is set, the lag (now minus that time, in seconds) is recorded per consumer in the
    /// histogram `inbox_lag_seconds{consumer}`.
    ///
    /// # Errors
    /// [`DispatchError::NoMessageName`] if the envelope's name is empty,
    /// [`DispatchError::TooLarge`] if the payload is over the limit or its source cut it,
    /// [`DispatchError::UnknownMessage`] if no handler takes this name,
    /// [`DispatchError::NotUtf8`] if the payload is not UTF-8 (anywhere in it),
    /// [`DispatchError::UnpairedSurrogate`] if an escape in it (anywhere) decodes to an
    /// unpaired surrogate,
    /// [`DispatchError::Decode`] (with line and column) if the payload is not valid JSON of the
    /// message type (as a whole: members the type does not declare and trailing characters
    /// included), [`DispatchError::Key`] if a consumer's key (or, for an ordered consumer, its
    /// aggregate or sequence) is missing, null, empty, too long or out of range,
    /// [`DispatchError::Fingerprint`] if the message cannot be fingerprinted. Per-consumer
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
        crate::store::within(self.prefix.as_ref(), async {
            self.dispatch_on(&mut ConnectionSlot::new(), envelope).await
        })
        .await
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
        crate::store::within(self.prefix.as_ref(), async {
            self.dispatch_decoded_on(slot, envelope, None).await
        })
        .await
    }

    /// [`dispatch_on`](Self::dispatch_on) with the envelope already [decoded](Self::decode)
    /// (`decoded`, if `Some`: what [`decode`](Self::decode) returned for it), so that it is not
    /// decoded twice.
    pub(crate) async fn dispatch_decoded_on(
        &self,
        slot: &mut ConnectionSlot<DB>,
        envelope: &Envelope,
        decoded: Option<Result<Decoded, DispatchError>>,
    ) -> Result<Vec<ConsumerOutcome>, DispatchError> {
        let prepared = self.prepare_from(envelope, decoded)?;
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
        self.decode(envelope)
            .map(|decoded| Prepared::of(envelope, decoded))
    }

    /// [`prepare`](Self::prepare), from what [`decode`](Self::decode) already returned for
    /// `envelope` if `decoded` is `Some`.
    pub(crate) fn prepare_from<'e>(
        &self,
        envelope: &'e Envelope,
        decoded: Option<Result<Decoded, DispatchError>>,
    ) -> Result<Prepared<'e>, DispatchError> {
        match decoded {
            Some(decoded) => decoded.map(|decoded| Prepared::of(envelope, decoded)),
            None => self.prepare(envelope),
        }
    }

    /// The checks of [`dispatch`](Self::dispatch), then the payload decoded once per message
    /// type and every consumer's key and ordering read: what a dispatch of `envelope` needs
    /// before any database work, kept apart from the envelope (the [`Worker`](crate::Worker)
    /// decodes a delivery when it arrives, to read its partitions, and hands this back to the
    /// dispatch).
    ///
    /// # Errors
    /// As [`dispatch`](Self::dispatch), for a refused envelope.
    pub(crate) fn decode(&self, envelope: &Envelope) -> Result<Decoded, DispatchError> {
        self.routes.decode(envelope, self.max_payload_bytes)
    }

    /// Runs one consumer of a prepared envelope in its own transaction (the single path).
    pub(crate) async fn run_item(
        &self,
        slot: &mut ConnectionSlot<DB>,
        prepared: &Prepared<'_>,
        item: &PreparedItem,
    ) -> ConsumerOutcome {
        self.run_item_looked_up(slot, prepared, item, true).await
    }

    /// [`run_item`](Self::run_item), asking the dedupe cache first only if `lookup` (a batch
    /// asked it already).
    pub(crate) async fn run_item_looked_up(
        &self,
        slot: &mut ConnectionSlot<DB>,
        prepared: &Prepared<'_>,
        item: &PreparedItem,
        lookup: bool,
    ) -> ConsumerOutcome {
        let handler = item.handler;
        if let Some(lag) = prepared.lag {
            metrics::histogram!("inbox_lag_seconds", "consumer" => handler.consumer())
                .record(lag.as_secs_f64());
        }
        let (_, msg, fingerprint) = &prepared.decoded[item.message];
        if let Some(cache) = self.cache.as_ref().filter(|_| lookup) {
            let cached = cache.get(handler.consumer(), item.key.as_str()).await;
            if let Some(result) =
                cached.and_then(|entry| answer(cache, handler, entry, fingerprint))
            {
                crate::protocol::single::observe(handler.consumer(), &result);
                return ConsumerOutcome::of(handler, result);
            }
        }
        let delivery = AttemptPlan {
            key: &item.key,
            fingerprint,
            source: prepared.envelope.source.as_ref(),
            headers: Some(&prepared.envelope.headers),
            payload: Some(&prepared.envelope.payload),
            policy: &self.policy,
            owner: crate::protocol::tx::Owner::Runtime,
            mode: ClaimMode::Deliver,
            ordering: item.ordering.as_ref(),
            hooks: self.hook_runner(),
        };
        let result = self.invoke(slot, handler, &**msg, &delivery).await;
        self.fill_cache(
            handler.consumer(),
            item.key.as_str(),
            fingerprint,
            &result,
            Fill::IfAbsent,
        )
        .await;
        // After a duplicate too: a process that stopped between a message's commit and the
        // release of its parked successors left them parked, and the message, never acked, is
        // delivered again: its duplicate releases them (one lookup when there are none).
        if let (Ok(Outcome::Processed(()) | Outcome::Duplicate), Some(ordering)) =
            (&result, &item.ordering)
        {
            self.apply_parked_successors(slot, handler, ordering).await;
        }
        ConsumerOutcome::of(handler, result)
    }

    /// After a delivery or replay: caches the key's state if the result is final and
    /// committed (processed, a duplicate of a processed key, dead, discarded).
    pub(crate) async fn fill_cache(
        &self,
        consumer: &str,
        key: &str,
        fingerprint: &Fingerprint,
        result: &Result<Outcome<()>, Error<BoxError>>,
        mode: Fill,
    ) {
        let Some(cache) = &self.cache else { return };
        let status = match result {
            Ok(Outcome::Processed(()) | Outcome::Duplicate) => Status::Processed,
            Ok(Outcome::Dead) => Status::Dead,
            Ok(Outcome::Discarded) => Status::Discarded,
            Err(Error::Handler(failure)) if failure.disposition == Disposition::Dead => {
                Status::Dead
            }
            Err(Error::Hook(error)) if error.disposition == Disposition::Dead => Status::Dead,
            _ => return,
        };
        cache.fill(consumer, key, status, *fingerprint, mode).await;
    }

    /// Runs one handler on the slot's connection; a connection lost on the way (the attempt's
    /// failure not even recorded) is replaced once and the delivery run again — the claim makes
    /// that safe.
    async fn invoke(
        &self,
        slot: &mut ConnectionSlot<DB>,
        handler: &'static dyn DynHandler,
        msg: &AnyMessage,
        delivery: &AttemptPlan<'_>,
    ) -> Result<Outcome<()>, Error<BoxError>> {
        let mut retried = false;
        loop {
            let result = match slot.get_for_claim(&self.pool).await {
                Ok(conn) => handler.invoke(conn.as_any(), msg, delivery).await,
                Err(source) => Err(Error::Database(StoreError {
                    consumer: handler.consumer().to_owned(),
                    key: delivery.key.clone(),
                    operation: StoreOperation::Acquire,
                    source,
                })),
            };
            if !lost_connection(&result) {
                return result;
            }
            slot.discard();
            if retried {
                return result;
            }
            retried = true;
            tracing::warn!(
                consumer = handler.consumer(),
                "connection lost; retrying on a new one"
            );
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
        crate::store::within(self.prefix.as_ref(), async {
            self.record_rejection_on(&mut ConnectionSlot::new(), envelope, error)
                .await
        })
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
        crate::store::within(self.prefix.as_ref(), async {
            let detail = error.to_string();
            let rejection =
                Rejection::of_refused(envelope, error, &detail, self.max_payload_bytes.bytes());
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
            if recorded.is_ok() {
                metrics::counter!("inbox_rejections_total", "reason" => rejection.reason.as_str())
                    .increment(1);
            }
            recorded
        })
        .await
    }

    async fn record_once(
        &self,
        slot: &mut ConnectionSlot<DB>,
        rejection: &Rejection<'_>,
    ) -> Result<(), sqlx::Error> {
        let conn = slot.get(&self.pool).await?;
        conn.record_rejection(rejection).await
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
        crate::store::within(self.prefix.as_ref(), async {
            let stored = {
                let mut conn = self.pool.acquire().await?;
                conn.fetch_message(consumer, key).await?
            }
            .ok_or_else(|| ReplayError::NotFound {
                consumer: consumer.to_owned(),
                key: key.to_owned(),
            })?;
            let handler = self.route(consumer, &stored.message_name).ok_or_else(|| {
                ReplayError::NoHandler {
                    consumer: consumer.to_owned(),
                    message_name: stored.message_name.clone(),
                }
            })?;
            if matches!(stored.status, Status::Processed | Status::Discarded) {
                let outcome = if stored.status == Status::Processed {
                    Outcome::Duplicate
                } else {
                    Outcome::Discarded
                };
                return Ok(ConsumerOutcome::of(handler, Ok(outcome)));
            }
            // The key's state changes under the cache: forget it first, then cache what committed.
            if let Some(cache) = &self.cache {
                cache.invalidate(consumer, key).await;
            }
            let mut conn = self.pool.acquire().await?;
            let result = run_stored(
                handler,
                conn.as_any(),
                &stored,
                ClaimMode::Replay,
                &self.policy,
                self.hook_runner(),
            )
            .await?;
            drop(conn);
            if let Some(fingerprint) = Fingerprint::from_hex(&stored.payload_hash) {
                self.fill_cache(consumer, key, &fingerprint, &result, Fill::Replace)
                    .await;
            }
            if let (Ok(Outcome::Processed(())), Some(ordering)) = (&result, &stored.ordering()) {
                self.apply_parked_successors(&mut ConnectionSlot::new(), handler, ordering)
                    .await;
            }
            Ok(ConsumerOutcome::of(handler, result))
        })
        .await
    }

    /// Discards one `failed` or `dead` key, as [`admin::discard`](crate::ops::admin::discard) does,
    /// and forgets it in this dispatcher's [dedupe cache](Self::with_cache), if any (the next
    /// delivery of the key reads `discarded` from the inbox and caches that). Returns `false` if
    /// no failed or dead row matched.
    ///
    /// # Errors
    /// The database's error.
    pub async fn discard(&self, consumer: &str, key: &str) -> Result<bool, sqlx::Error> {
        crate::store::within(self.prefix.as_ref(), async {
            let discarded = crate::ops::admin::discard(&self.pool, consumer, key).await?;
            if let Some(cache) = &self.cache {
                cache.invalidate(consumer, key).await;
            }
            Ok(discarded)
        })
        .await
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
                    &mut **conn,
                    self,
                    handler.consumer(),
                    ordering,
                    &self.policy,
                    self.hook_runner(),
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
        crate::store::within(self.prefix.as_ref(), async {
            let mut report = SweepReport::default();
            let expired = {
                let mut conn = self.pool.acquire().await?;
                conn.expired_parked(self.park.effective_timeout().as_secs_f64(), 1000)
                    .await?
            };
            for parked in expired {
                let mut conn = self.pool.acquire().await?;
                match self.park.on_timeout {
                    ParkTimeout::DeadLetter => {
                        let reason = format!(
                            "parked for more than {} s waiting for sequence {} of aggregate `{}`",
                            self.park.effective_timeout().as_secs(),
                            parked.sequence - 1,
                            parked.aggregate_id
                        );
                        if conn
                            .dead_letter_parked(&parked.consumer, &parked.message_key, &reason)
                            .await?
                        {
                            report.dead_lettered += 1;
                        }
                    }
                    ParkTimeout::Release => {
                        let Some(handler) = self.route(&parked.consumer, &parked.message_name)
                        else {
                            continue;
                        };
                        let Some(stored) = conn
                            .fetch_message(&parked.consumer, &parked.message_key)
                            .await?
                        else {
                            continue;
                        };
                        let result = run_stored(
                            handler,
                            conn.as_any(),
                            &stored,
                            ClaimMode::Release,
                            &self.policy,
                            self.hook_runner(),
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
        })
        .await
    }
}

/// An envelope decoded and keyed for each of its consumers.
pub(crate) struct Prepared<'e> {
    pub(crate) envelope: &'e Envelope,
    /// One decoded message (and its fingerprint) per message type.
    pub(crate) decoded: DecodedMessages,
    /// One item per consumer, in consumer order.
    pub(crate) items: Vec<PreparedItem>,
    lag: Option<std::time::Duration>,
}

impl<'e> Prepared<'e> {
    /// `envelope`, decoded: its consumers' lag (how long after its production the message
    /// reaches them) measured now.
    fn of(envelope: &'e Envelope, decoded: Decoded) -> Self {
        let lag = envelope
            .source
            .as_ref()
            .and_then(|source| source.published_at)
            .map(|at| {
                std::time::SystemTime::now()
                    .duration_since(at)
                    .unwrap_or_default()
            });
        Self {
            envelope,
            decoded: decoded.messages,
            items: decoded.items,
            lag,
        }
    }
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

fn lost_connection<T>(result: &Result<T, Error<BoxError>>) -> bool {
    let is_lost = crate::types::slot::connection_lost;
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
