//! The `Idempotency-Key` layer on the DynamoDB store (features `http` and `dynamodb`): the
//! handler's DynamoDB actions, the key's item and the stored response in one
//! `TransactWriteItems`.

use std::sync::Arc;

use std::time::Duration;

use aws_sdk_dynamodb::error::SdkError;
use aws_sdk_dynamodb::operation::transact_write_items::TransactWriteItemsError;
use axum::body::Body;
use axum::extract::FromRequestParts;
use bytes::Bytes;
use http::request::Parts;
use http::{HeaderName, Method, Request, Response, StatusCode};

use crate::debug::some_fields;
use crate::dynamodb::lease::{
    Committed, KeyRequest, KeyState, Lease, LeaseError, Leased, Unsettled,
};
use crate::dynamodb::{DynamoError, DynamoInbox, DynamoTx};
use crate::types::key::IdempotencyKey;

use super::extract::{MissingTransaction, Slot, Taken, extractor_accessors};
use super::problem::Problem;
use super::service::{
    Incoming, RequestBody, RequestInfo, ResponseBody, Route, Served, Wrapped, count, in_flight,
    keyed, layer_service, outcome_unknown, outlived, read_request, replay_stored, respond, reused,
    traced, transaction_failed, unavailable_problem,
};
use super::stored::StoredResponse;
use super::{Settings, settings_setters};

/// The default [`DynamoIdempotencyLayer::lease`]: 30 s.
pub const DEFAULT_LEASE: Duration = Duration::from_secs(30);

/// The `Idempotency-Key` layer on a [`DynamoInbox`]'s table (features `http` and `dynamodb`):
/// what [`IdempotencyLayer`](super::IdempotencyLayer) does on SQL, with the handler's DynamoDB
/// actions ([`DynamoIdempotencyTx`]), the key's item and the stored response committed in
/// **one `TransactWriteItems`**. Every setting of the SQL layer is here with the same default
/// (but [`with_hook`](super::IdempotencyLayer::with_hook): no hooks), plus
/// [`lease`](Self::lease).
///
/// # How a request with a key runs, and its DynamoDB calls
///
/// The key's item is the inbox item of `(scope, key)` ([`crate::dynamodb::partition_key`]) in
/// the inbox's table: the same table, `pk` and attributes as [`DynamoInbox::process`] writes,
/// the scope as the consumer, `message_name` the method and target.
///
/// 1. **Lease** (one conditional `PutItem`): the item with status `in_progress`, the request's
///    fingerprint, `lease_owner` (a random token of this request) and `lease_until` (now +
///    [`lease`](Self::lease), epoch milliseconds), on the condition that there is no item, or
///    it expired (`expires_at`, the retention window, as [`DynamoInbox`]), or it is a lease that
///    ended. When the condition fails, DynamoDB returns the item (`ALL_OLD`; a service that
///    does not is asked with a consistent `GetItem`), and it answers the request:
///    * processed with the same fingerprint: the stored response, byte for byte, with
///      `Idempotent-Replayed: true` (the handler does not run);
///    * processed or leased with another fingerprint: **422** `idempotency-key-reused`;
///    * leased by a running request (same fingerprint): **409** `idempotency-key-in-use` with
///      `Retry-After` ([`retry_after`](Self::retry_after));
///    * a claim session's `failed`, `dead` or `discarded` item under the same scope, or an
///      item without a stored response: **500** `stored-response-unreadable`.
/// 2. **The handler** runs with a [`DynamoTx`] ([`DynamoIdempotencyTx`]) and adds its actions
///    (at most [`MAX_HANDLER_ITEMS`](crate::dynamodb::MAX_HANDLER_ITEMS), 99); its response is
///    read whole (up to [`max_response_bytes`](Self::max_response_bytes)).
/// 3. **Commit** (one `TransactWriteItems`) when the status is stored
///    ([`store_statuses`](Self::store_statuses)): action 0 replaces the lease with the
///    `processed` item (fingerprint; `result`, binary: the stored response in the SQL layer's
///    format, `IKR1`, the status, the stored headers and the body; `expires_at`), on
///    the condition that the lease is still this request's (`status = in_progress AND
///    lease_owner = :token`), then the handler's actions. Its client request token is the
///    lease's token (a SDK retry of a send whose answer was lost is not applied twice). Any
///    other status: the lease is **released** (a conditional `DeleteItem`) and nothing of the
///    handler's is written; the key is free at once, as the SQL layer's rollback leaves it.
///    So is it when the request's future is dropped before it answers (the client went away:
///    hyper drops it): the lease is released in a task of its own.
///
/// Calls per request (measured against moto in `tests/http_dynamodb.rs`): a **new key** 2
/// (`PutItem`, `TransactWriteItems`); a **replay**, a **422** or a **409** 1 (`PutItem`; 2
/// where the service does not return the item with the failed condition: a consistent
/// `GetItem` then); a response **not stored** 2
/// (`PutItem`, `DeleteItem`); a commit cancelled by a **failed condition** of the handler's
/// actions or **refused** by DynamoDB (409 `condition-failed`, 500 `transaction-failed`) 3
/// (`PutItem`, `TransactWriteItems`, `DeleteItem`); a commit whose **lease was taken over** 2
/// (3 where the cancellation does not return the item: a `GetItem`); plus the resends of a transient cancellation
/// ([`RetryPolicy::transient_retries`](crate::RetryPolicy)). A request without a key (where it
/// is optional) runs as one with a fresh random key (UUIDv7) that no client knows: 2 calls, and
/// its response is never replayed.
///
/// # Why a lease
///
/// DynamoDB has no locks: without the lease, two concurrent duplicates would both run the
/// handler, and one commit would win (the loser answered with the winner's response). The lease
/// costs one write per request, and buys the SQL layer's contract: a concurrent duplicate gets a
/// 409 while the first runs, so side effects outside DynamoDB (a call to a payment provider)
/// run once in the common case. The commit's condition on the lease makes it safe when a
/// request outlives its lease: a second request may take the key over once `lease_until` has
/// passed and run the handler again, but only one of the two commits (the other's condition
/// fails; it writes nothing and answers with the item as it is then: the winner's stored
/// response, or a 409 while the winner runs). Set the lease well above the handler's longest
/// run (outside effects of a request that outlives it may happen twice); AWS Lambda Powertools'
/// idempotency utility does the same (`INPROGRESS` with an expiry).
///
/// # Errors and statuses
///
/// The SQL layer's, as problem details (see the [module's table](super#problems)), with these
/// causes on DynamoDB:
///
/// | status | `type` slug | when |
/// |---|---|---|
/// | 409 | `condition-failed` | a `ConditionCheck` (or the condition of a `Put`, `Update`, `Delete`) the handler added failed at the commit: nothing written, the lease released (a retry runs the handler again); the detail names the action (index from 0) and its table |
/// | 500 | `response-too-large` | the response body is above `max_response_bytes`, or the key's item with the stored response would be above DynamoDB's 400 KB item limit (409,600 bytes, attribute names and values; about 400 KB less the key, scope and headers): nothing written, the lease released |
/// | 500 | `transaction-failed` | the transaction is above 4 MB or 99 actions, DynamoDB refused it (`ValidationException`: two actions on one item, a bad expression), or its scope and key make a partition key above 2048 bytes: nothing written |
/// | 503 | `store-unavailable` | a `PutItem` or `GetItem` failed, or the transaction was cancelled for transient reasons on every resend: nothing written (`Retry-After`) |
/// | 503 | `outcome-unknown` | the `TransactWriteItems` failed without an answer: it may have committed; a retry with the same key replays it if it did (`Retry-After`) |
///
/// # Retention
///
/// The `processed` item carries `expires_at` (epoch seconds, the processing time + the
/// inbox's [`retention`](DynamoInbox::retention) window, 7 days by default): DynamoDB's TTL
/// deletes it lazily, and an expired item counts as absent at once (the same key runs the
/// handler again), as for [`DynamoInbox`]. A lease carries it too, so an abandoned one is
/// deleted by TTL as well (at the end of the retention window, or of the lease if that is later: a
/// window shorter than the lease does not free a running request's key).
///
/// ```no_run
/// use axum::{Json, Router, http::StatusCode, routing::post};
/// use inbox_runtime::dynamodb::DynamoInbox;
/// use inbox_runtime::dynamodb::sdk::types::{AttributeValue, Put};
/// use inbox_runtime::http::{DynamoIdempotencyLayer, DynamoIdempotencyTx};
///
/// async fn create_order(
///     mut tx: DynamoIdempotencyTx,
///     Json(order): Json<serde_json::Value>,
/// ) -> Result<(StatusCode, Json<serde_json::Value>), StatusCode> {
///     let id = uuid::Uuid::now_v7().to_string();
///     let put = Put::builder()
///         .table_name("orders")
///         .item("id", AttributeValue::S(id.clone()))
///         .item("body", AttributeValue::S(order.to_string()))
///         .build()
///         .map_err(|_| StatusCode::INTERNAL_SERVER_ERROR)?;
///     tx.put(put); // committed with the key and this response, or not at all
///     Ok((StatusCode::CREATED, Json(serde_json::json!({ "id": id }))))
/// }
///
/// # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
/// let inbox = DynamoInbox::new(inbox_runtime::dynamodb::client(None).await, "inbox");
/// inbox.ensure_table().await?;
/// let app: Router = Router::new()
///     .route("/orders", post(create_order))
///     .route_layer(DynamoIdempotencyLayer::new(inbox));
/// let listener = tokio::net::TcpListener::bind("127.0.0.1:3000").await?;
/// axum::serve(listener, app).await?;
/// # Ok(()) }
/// ```
#[derive(Clone)]
pub struct DynamoIdempotencyLayer {
    config: Arc<DynamoConfig>,
}

#[derive(Clone)]
pub(crate) struct DynamoConfig {
    settings: Settings,
    inbox: DynamoInbox,
    lease: Duration,
}

impl std::ops::Deref for DynamoConfig {
    type Target = Settings;

    fn deref(&self) -> &Settings {
        &self.settings
    }
}

impl std::fmt::Debug for DynamoIdempotencyLayer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DynamoIdempotencyLayer")
            .field("settings", &self.config.settings)
            .field("table", &self.config.inbox.table())
            .field("lease", &self.config.lease)
            .finish_non_exhaustive()
    }
}

impl DynamoIdempotencyLayer {
    /// A layer claiming keys in `inbox`'s table (made with [`DynamoInbox::new`]; its table must
    /// exist: [`DynamoInbox::ensure_table`]), with the SQL layer's defaults and a lease of
    /// [`DEFAULT_LEASE`] (30 s). Keys expire with the inbox's retention window.
    pub fn new(inbox: DynamoInbox) -> Self {
        Self {
            config: Arc::new(DynamoConfig {
                settings: Settings::default(),
                inbox,
                lease: DEFAULT_LEASE,
            }),
        }
    }

    fn settings_mut(&mut self) -> &mut Settings {
        &mut Arc::make_mut(&mut self.config).settings
    }

    settings_setters!();

    /// How long a request holds its key while its handler runs (default [`DEFAULT_LEASE`],
    /// 30 s; millisecond precision): concurrent duplicates get a 409 until the request answers
    /// or its lease ends. A request that runs past it may see its key taken over by a
    /// duplicate; only one of them commits (see [the type's docs](Self#why-a-lease)).
    /// `Duration::ZERO` makes every lease end at once (for tests).
    pub fn lease(mut self, lease: Duration) -> Self {
        Arc::make_mut(&mut self.config).lease = lease;
        self
    }
}

impl<S> tower::Layer<S> for DynamoIdempotencyLayer {
    type Service = DynamoIdempotencyService<S>;

    fn layer(&self, inner: S) -> Self::Service {
        DynamoIdempotencyService {
            inner,
            config: Arc::clone(&self.config),
        }
    }
}

/// The service [`DynamoIdempotencyLayer`] wraps around `S`: the same request and response
/// bodies as [`IdempotencyService`](super::IdempotencyService); its errors are `S`'s, the
/// layer's own failures are responses.
#[derive(Clone)]
pub struct DynamoIdempotencyService<S> {
    inner: S,
    config: Arc<DynamoConfig>,
}

impl<S: std::fmt::Debug> std::fmt::Debug for DynamoIdempotencyService<S> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        some_fields(f, "DynamoIdempotencyService", &[("inner", &self.inner)])
    }
}

layer_service!(impl<> for DynamoIdempotencyService<S> => serve);

/// One request through the layer, traced.
fn serve<S, ReqBody, ResBody>(
    config: Arc<DynamoConfig>,
    inner: S,
    request: Request<ReqBody>,
) -> crate::BoxFuture<'static, Result<Response<Body>, S::Error>>
where
    S: Served<ResBody>,
    ReqBody: RequestBody,
    ResBody: ResponseBody,
{
    traced(request, |request| handle(config, inner, request))
}

async fn handle<S, ReqBody, ResBody>(
    config: Arc<DynamoConfig>,
    mut inner: S,
    request: Request<ReqBody>,
) -> Result<Response<Body>, S::Error>
where
    S: Wrapped<ResBody>,
    ReqBody: RequestBody,
    ResBody: ResponseBody,
{
    let (parts, Incoming { info, key, bytes }) =
        match read_request(&config, &mut inner, request).await {
            Ok(read) => read,
            Err(answer) => return answer,
        };
    let keyless = key.is_none();
    if keyless {
        count(&info.route, "no_key");
    }
    // A request without a key (where it is optional) runs under a key no client knows, its
    // body fingerprinted as bytes: as on SQL, the layer does not judge its JSON.
    let no_headers = http::HeaderMap::new();
    let (key, headers) = match key {
        Some(key) => (key, &parts.headers),
        None => (uuid::Uuid::now_v7().to_string(), &no_headers),
    };
    let (fingerprint, key) = match keyed(&config, &info, headers, &bytes, key) {
        Ok(keyed) => keyed,
        Err(answer) => return Ok(answer),
    };
    let request = KeyRequest {
        scope: &info.scope,
        name: &info.name,
        key: &key,
        fingerprint,
    };
    let lease = match config.inbox.lease(&request, config.lease).await {
        Ok(Leased::Acquired(lease)) => lease,
        Ok(Leased::Held(state)) => return Ok(held(&config, &info, &key, state)),
        Err(error) => return Ok(failed(&config, &info.route, &error)),
    };
    let leased = Running {
        config: &config,
        info: &info,
        request,
        keyless,
    };
    leased.run(&mut inner, parts, bytes, lease).await
}

/// A request that holds its key's lease.
struct Running<'a> {
    config: &'a DynamoConfig,
    info: &'a RequestInfo,
    request: KeyRequest<'a>,
    keyless: bool,
}

impl Running<'_> {
    /// Runs the handler with a fresh [`DynamoTx`], then commits its actions with the stored
    /// response (or releases the lease) and answers.
    async fn run<S, ResBody>(
        &self,
        inner: &mut S,
        mut parts: Parts,
        bytes: Bytes,
        lease: Lease,
    ) -> Result<Response<Body>, S::Error>
    where
        S: Wrapped<ResBody>,
        ResBody: ResponseBody,
    {
        let (config, route) = (self.config, &self.info.route);
        let lease = Unsettled::new(&config.inbox, self.request, lease);
        let key = (!self.keyless).then(|| self.request.key.clone());
        let slot = Slot::new(
            DynamoInbox::leased_tx(&self.request),
            self.info.scope.clone(),
            key,
        );
        parts.extensions.insert(slot.clone());
        let request = Request::from_parts(parts, Body::from(bytes));
        let (head, body) = match respond(config, route, inner, request).await {
            Ok(Ok(response)) => response,
            Ok(Err(problem)) => return Ok(self.release(lease, problem).await),
            Err(error) => {
                lease.release().await;
                return Err(error);
            }
        };
        let Some(tx) = slot.take() else {
            return Ok(self.release(lease, outlived(route)).await);
        };
        if !(config.stores)(head.status) {
            lease.release().await;
            count(route, "not_stored");
            return Ok(Response::from_parts(head, Body::from(body)));
        }
        let stored = StoredResponse::select(
            head.status,
            &head.headers,
            &config.stored_headers,
            body.clone(),
        )
        .encode();
        let committed = config
            .inbox
            .commit_leased(&self.request, lease.lease(), tx, &stored)
            .await;
        let problem = match committed {
            Ok(Committed::Done) => {
                lease.settle();
                if !self.keyless {
                    count(route, "first");
                }
                return Ok(Response::from_parts(head, Body::from(body)));
            }
            Ok(Committed::LeaseLost(state)) => {
                lease.settle();
                return Ok(held(config, self.info, self.request.key, state));
            }
            Ok(Committed::Condition(failed)) => {
                count(route, "not_stored");
                Problem::new(
                    StatusCode::CONFLICT,
                    "condition-failed",
                    "A condition of the request's writes failed",
                    format!("{failed}; nothing was written, and a retry runs the handler again"),
                )
            }
            Ok(Committed::ResponseTooLarge { bytes, max }) => {
                count(route, "failed");
                Problem::new(
                    StatusCode::INTERNAL_SERVER_ERROR,
                    "response-too-large",
                    "The response is too large to store",
                    format!(
                        "the key's item with the handler's response would be {bytes} bytes, \
                         more than DynamoDB's {max}-byte item limit; nothing was written"
                    ),
                )
            }
            Err(error) => commit_failed(config, route, &error),
        };
        Ok(self.release(lease, problem).await)
    }

    /// Releases the lease (nothing of the handler's was written) and answers `problem`.
    async fn release(&self, lease: Unsettled<'_>, problem: Problem) -> Response<Body> {
        lease.release().await;
        problem.into_response(&self.config.problem_base)
    }
}

/// The answer to a request whose key another request's item holds (counted).
fn held(
    config: &Settings,
    info: &RequestInfo,
    key: &IdempotencyKey,
    state: KeyState,
) -> Response<Body> {
    match state {
        KeyState::Stored(result) => replay_stored(config, info, key, Ok(result)),
        KeyState::Mismatch => reused(config, &info.route),
        KeyState::InFlight(_) => {
            count(&info.route, "in_flight");
            in_flight(config.retry_after).into_response(&config.problem_base)
        }
        KeyState::Unreadable(reason) => replay_stored(config, info, key, Err(reason)),
    }
}

/// The answer to a lease that could not be taken (counted): the store unreachable (503) or a
/// partition key too long (500).
fn failed(config: &Settings, route: &Route, error: &LeaseError) -> Response<Body> {
    count(route, "failed");
    let problem = match error {
        DynamoError::Dynamo { .. } => {
            tracing::warn!(error = %error, "idempotency store unavailable");
            unavailable_problem(
                config,
                "the request could not be checked against its Idempotency-Key; \
                 nothing was done: retry with the same key",
            )
        }
        other => transaction_failed(route, &other.to_string()),
    };
    problem.into_response(&config.problem_base)
}

/// The answer to a commit that failed (counted): its outcome unknown (503), transient (503), or
/// refused (500: too large, or DynamoDB's `ValidationException`, which applied nothing).
fn commit_failed(config: &Settings, route: &Route, error: &LeaseError) -> Problem {
    count(route, "failed");
    match error {
        DynamoError::Dynamo {
            operation: "TransactWriteItems",
            source,
            ..
        } if refused(source.as_ref()) => transaction_failed(route, &error.to_string()),
        DynamoError::Dynamo {
            operation: "TransactWriteItems",
            ..
        } => outcome_unknown(route, &error.to_string(), config),
        DynamoError::Dynamo { .. } | DynamoError::Transient { .. } => {
            tracing::warn!(error = %error, "idempotency commit not applied");
            unavailable_problem(
                config,
                "DynamoDB did not apply the request's transaction (throttled or contended); \
                 nothing was written: retry with the same key",
            )
        }
        other => transaction_failed(route, &other.to_string()),
    }
}

/// Whether DynamoDB answered the `TransactWriteItems` with a `ValidationException` (two actions
/// on one item, a bad expression, an item too large): it refused the request, nothing applied,
/// and a resend is refused again.
fn refused(source: &(dyn std::error::Error + 'static)) -> bool {
    source
        .downcast_ref::<SdkError<TransactWriteItemsError>>()
        .and_then(SdkError::as_service_error)
        .is_some_and(|e| e.meta().code() == Some("ValidationException"))
}

/// The request's DynamoDB transaction, for a handler behind [`DynamoIdempotencyLayer`]: an
/// axum extractor that derefs to the [`DynamoTx`]. Add the request's writes to it (`tx.put(…)`,
/// `update`, `delete`, `condition_check`, [`DynamoTx::publish`]); the layer commits them with the
/// key and the stored response in one `TransactWriteItems` after the handler returned, when the
/// response's status is stored (else nothing of them is written). Write nowhere else in
/// DynamoDB: only what is added here commits with the key. Do not keep it beyond the handler
/// (the request then fails with 500, nothing written).
///
/// On a route or method the layer does not cover, extracting it fails with a 500 problem
/// response ([`MissingTransaction`]).
pub struct DynamoIdempotencyTx {
    taken: Taken<DynamoTx>,
}

impl DynamoIdempotencyTx {
    extractor_accessors!();
}

impl std::ops::Deref for DynamoIdempotencyTx {
    type Target = DynamoTx;

    fn deref(&self) -> &DynamoTx {
        self.taken.get()
    }
}

impl std::ops::DerefMut for DynamoIdempotencyTx {
    fn deref_mut(&mut self) -> &mut DynamoTx {
        self.taken.get_mut()
    }
}

impl std::fmt::Debug for DynamoIdempotencyTx {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        some_fields(
            f,
            "DynamoIdempotencyTx",
            &[("scope", &self.scope()), ("key", &self.key())],
        )
    }
}

impl<S: Send + Sync> FromRequestParts<S> for DynamoIdempotencyTx {
    type Rejection = MissingTransaction;

    async fn from_request_parts(parts: &mut Parts, _state: &S) -> Result<Self, Self::Rejection> {
        Taken::from_parts(parts).map(|taken| Self { taken })
    }
}
