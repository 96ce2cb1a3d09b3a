//! The layer's service: one request through key, body, fingerprint, claim, handler and the
//! stored response.

use std::panic::AssertUnwindSafe;
use std::sync::Arc;

use axum::body::Body;
use axum::extract::MatchedPath;
use bytes::Bytes;
use futures_util::FutureExt as _;
use http::{HeaderValue, Request, Response, StatusCode, header};
use http_body_util::{BodyExt as _, LengthLimitError, Limited};

use crate::debug::some_fields;
use crate::protocol::Wait;
use crate::protocol::hooks::ClaimInfo;
use crate::protocol::machine::{Uncommitted, commit, run_body};
use crate::protocol::session::{ClaimSession, ClaimState, ClaimedKey, Incomplete, Settled};
use crate::protocol::tx::{ClaimTx, Hold, Verify};
use crate::store::InboxDatabase;
use crate::types::classify::BoxError;
use crate::types::error::StoreOperation;
use crate::types::fingerprint::Fingerprint;
use crate::types::key::IdempotencyKey;
use crate::types::status::Status;

use super::extract::{Held, TxSlot};
use super::key::{self, KeyProblem};
use super::problem::Problem;
use super::stored::StoredResponse;
use super::{Config, IDEMPOTENT_REPLAYED, Settings};

/// The service [`IdempotencyLayer`](super::IdempotencyLayer) wraps around `S`. It takes any
/// request body (`http_body::Body` with `Bytes` data, as hyper and axum give), hands `S` an
/// `axum::body::Body`, and answers with one. Its errors are `S`'s (for axum routes:
/// `Infallible`); the layer's own failures are responses (see the module documentation).
pub struct IdempotencyService<S, DB: InboxDatabase> {
    inner: S,
    config: Arc<Config<DB>>,
}

impl<S, DB: InboxDatabase> IdempotencyService<S, DB> {
    pub(crate) fn new(inner: S, config: Arc<Config<DB>>) -> Self {
        Self { inner, config }
    }
}

impl<S: Clone, DB: InboxDatabase> Clone for IdempotencyService<S, DB> {
    fn clone(&self) -> Self {
        Self {
            inner: self.inner.clone(),
            config: Arc::clone(&self.config),
        }
    }
}

impl<S: std::fmt::Debug, DB: InboxDatabase> std::fmt::Debug for IdempotencyService<S, DB> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        some_fields(f, "IdempotencyService", &[("inner", &self.inner)])
    }
}

/// The `tower::Service` impl of a layer's service (a struct with fields `inner: S` and
/// `config: Arc<…>`), written once: `poll_ready` is the wrapped service's, `call` hands the
/// service that was polled ready, the config and the request to `$serve` (a clone of the
/// wrapped service stays for the next request).
macro_rules! layer_service {
    (impl<$($generic:ident: $bound:path),*> for $service:ty => $serve:ident) => {
        impl<S, $($generic: $bound,)* ReqBody, ResBody> tower::Service<http::Request<ReqBody>>
            for $service
        where
            S: tower::Service<http::Request<axum::body::Body>, Response = http::Response<ResBody>>
                + Clone
                + Send
                + 'static,
            S::Future: Send + 'static,
            S::Error: Send + 'static,
            ReqBody: http_body::Body<Data = bytes::Bytes> + Send + 'static,
            ReqBody::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
            ResBody: http_body::Body<Data = bytes::Bytes> + Send + 'static,
            ResBody::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
        {
            type Response = http::Response<axum::body::Body>;
            type Error = S::Error;
            type Future =
                $crate::BoxFuture<'static, Result<http::Response<axum::body::Body>, S::Error>>;

            fn poll_ready(
                &mut self,
                cx: &mut std::task::Context<'_>,
            ) -> std::task::Poll<Result<(), Self::Error>> {
                self.inner.poll_ready(cx)
            }

            fn call(&mut self, request: http::Request<ReqBody>) -> Self::Future {
                let ready = self.inner.clone();
                let inner = std::mem::replace(&mut self.inner, ready);
                $serve(std::sync::Arc::clone(&self.config), inner, request)
            }
        }
    };
}
#[cfg(feature = "dynamodb")]
pub(crate) use layer_service;

layer_service!(impl<DB: InboxDatabase> for IdempotencyService<S, DB> => serve);

/// One request through the SQL layer: in the table prefix of the scope the layer was built in
/// (requests are served on the server's tasks, outside any scope), traced.
fn serve<S, DB, ReqBody, ResBody>(
    config: Arc<Config<DB>>,
    inner: S,
    request: Request<ReqBody>,
) -> crate::BoxFuture<'static, Result<Response<Body>, S::Error>>
where
    S: Served<ResBody>,
    DB: InboxDatabase,
    ReqBody: RequestBody,
    ResBody: ResponseBody,
{
    let prefix = config.prefix.clone();
    let handle = |config, inner, request| async move {
        crate::store::within(prefix.as_ref(), handle(config, inner, request)).await
    };
    traced(request, |request| handle(config, inner, request))
}

/// `serve(request)`, the future that answers `request`, boxed; with the feature `otel`, in the
/// span `inbox.http`, a child of the request's W3C Trace Context.
pub(crate) fn traced<B, F>(
    request: Request<B>,
    serve: impl FnOnce(Request<B>) -> F,
) -> crate::BoxFuture<'static, F::Output>
where
    F: std::future::Future + Send + 'static,
{
    #[cfg(feature = "otel")]
    {
        use tracing::Instrument as _;
        // The request continues its client's trace: `inbox.http` is a child of the request's
        // W3C Trace Context (a malformed or missing one is ignored, see `crate::trace`), and
        // the handler, its claim and its outbox rows run in it.
        let span = tracing::info_span!(
            "inbox.http",
            method = %request.method(),
            path = request.uri().path(),
        );
        crate::trace::continue_http(&span, request.headers());
        Box::pin(serve(request).instrument(span))
    }
    #[cfg(not(feature = "otel"))]
    Box::pin(serve(request))
}

/// A body the layer reads whole: the handler's response body.
pub(crate) trait ResponseBody:
    http_body::Body<Data = Bytes, Error: Into<BoxError>> + Send + 'static
{
}

impl<B> ResponseBody for B where
    B: http_body::Body<Data = Bytes, Error: Into<BoxError>> + Send + 'static
{
}

/// The label of the `route` in metrics and logs, and the scope's first part.
pub(crate) struct Route {
    /// `POST /payments/{id}`.
    pub(crate) label: String,
}

/// What the layer knows of a request it runs.
pub(crate) struct RequestInfo {
    pub(crate) route: Route,
    /// The scope its key is claimed in: `http <METHOD> <route>`, then the principal if any.
    pub(crate) scope: String,
    /// The method and target: `POST /payments/7?draft=1`.
    pub(crate) name: String,
}

/// A request read, before its claim.
pub(crate) struct Incoming {
    pub(crate) info: RequestInfo,
    /// The `Idempotency-Key`, unquoted, if one was sent.
    pub(crate) key: Option<String>,
    /// The body, read whole.
    pub(crate) bytes: Bytes,
}

/// A request body the layer reads whole.
pub(crate) trait RequestBody:
    http_body::Body<Data = Bytes, Error: Into<BoxError>> + Send + 'static
{
}

impl<B> RequestBody for B where
    B: http_body::Body<Data = Bytes, Error: Into<BoxError>> + Send + 'static
{
}

/// The service a layer wraps, as its boxed future serves it: [`Wrapped`], sent to the future's
/// task.
pub(crate) trait Served<ResBody>:
    Wrapped<ResBody, Future: Send + 'static, Error: Send + 'static> + Send + 'static
{
}

impl<S, ResBody> Served<ResBody> for S where
    S: Wrapped<ResBody, Future: Send + 'static, Error: Send + 'static> + Send + 'static
{
}

/// The service the layer wraps, as the layer's steps call it: the request with its body
/// buffered, answered with a response of any body.
pub(crate) trait Wrapped<ResBody>:
    tower::Service<Request<Body>, Response = Response<ResBody>>
{
}

impl<S, ResBody> Wrapped<ResBody> for S where
    S: tower::Service<Request<Body>, Response = Response<ResBody>>
{
}

async fn handle<S, DB, ReqBody, ResBody>(
    config: Arc<Config<DB>>,
    mut inner: S,
    request: Request<ReqBody>,
) -> Result<Response<Body>, S::Error>
where
    S: Wrapped<ResBody>,
    DB: InboxDatabase,
    ReqBody: RequestBody,
    ResBody: ResponseBody,
{
    let (mut parts, Incoming { info, key, bytes }) =
        match read_request(&config, &mut inner, request).await {
            Ok(read) => read,
            Err(answer) => return answer,
        };
    let opened = match key {
        None => open_keyless(&config, &info)
            .await
            .map(|tx| (Held::Plain(tx), None)),
        Some(key) => open_keyed(&config, &info, &parts.headers, &bytes, key)
            .await
            .map(|(claim, key)| (Held::Claimed(Box::new(claim)), Some(key))),
    };
    let (held, key) = match opened {
        Ok(opened) => opened,
        Err(answer) => return Ok(answer),
    };
    let slot = TxSlot::<DB>::new(held, info.scope.clone(), key.clone());
    parts.extensions.insert(slot.clone());
    let request = Request::from_parts(parts, Body::from(bytes));
    let ran = run(&config, &info, &mut inner, request, slot);
    match &key {
        None => ran.await,
        Some(key) => run_body(&info.scope, key.as_str(), ran).await,
    }
}

/// The pipeline's first steps, for every store: a request whose method the layer does not cover
/// goes to `inner` untouched (its answer is the `Err`); a covered one is read ([`read`]: a bad
/// key or body is the `Err`, answered).
pub(crate) async fn read_request<S, ReqBody, ResBody>(
    config: &Settings,
    inner: &mut S,
    request: Request<ReqBody>,
) -> Result<(http::request::Parts, Incoming), Result<Response<Body>, S::Error>>
where
    S: Wrapped<ResBody>,
    ReqBody: RequestBody,
    ResBody: ResponseBody,
{
    if !config.methods.contains(request.method()) {
        return Err(call(inner, request.map(Body::new))
            .await
            .map(|r| r.map(Body::new)));
    }
    let (parts, body) = request.into_parts();
    match read(config, &parts, body).await {
        Ok(incoming) => Ok((parts, incoming)),
        Err(problem) => Err(Ok(problem)),
    }
}

/// Reads what the layer needs of a request: its route, key, body (up to the limit), scope and
/// name. A bad key or body is answered (400, 413) and counted.
async fn read<ReqBody>(
    config: &Settings,
    parts: &http::request::Parts,
    body: ReqBody,
) -> Result<Incoming, Response<Body>>
where
    ReqBody: RequestBody,
{
    let route_text = parts
        .extensions
        .get::<MatchedPath>()
        .map_or_else(|| parts.uri.path().to_owned(), |m| m.as_str().to_owned());
    let route = Route {
        label: format!("{} {route_text}", parts.method),
    };
    let bad = |problem: Problem| {
        count(&route, "bad_request");
        problem.into_response(&config.problem_base)
    };
    let key = match key::parse(&parts.headers, config.max_key_len, config.accept_unquoted) {
        Ok(Some(key)) => Some(key),
        Ok(None) if config.require_key => return Err(bad(key_problem(KeyProblem::Missing))),
        Ok(None) => None,
        Err(problem) => return Err(bad(key_problem(problem))),
    };
    let bytes = read_body(&parts.headers, body, config.max_body_bytes)
        .await
        .map_err(bad)?;
    let principal = config
        .principal
        .as_ref()
        .and_then(|principal| principal(parts))
        .filter(|p| !p.is_empty());
    let scope = match &principal {
        Some(principal) => format!("http {} {principal}", route.label),
        None => format!("http {}", route.label),
    };
    let target = parts
        .uri
        .path_and_query()
        .map_or_else(|| parts.uri.path().to_owned(), |pq| pq.as_str().to_owned());
    let name = format!("{} {target}", parts.method);
    Ok(Incoming {
        info: RequestInfo { route, scope, name },
        key,
        bytes,
    })
}

/// A request without a key (where it is optional): a plain transaction for the handler,
/// nothing claimed or stored. The database unavailable: a 503 answer.
async fn open_keyless<DB: InboxDatabase>(
    config: &Config<DB>,
    info: &RequestInfo,
) -> Result<ClaimTx<'static, DB::Connection>, Response<Body>> {
    count(&info.route, "no_key");
    let unavailable =
        |error: sqlx::Error| store_unavailable(config, &error).into_response(&config.problem_base);
    let conn = config.pool.acquire().await.map_err(unavailable)?;
    ClaimTx::begin(Hold::Owned(Box::new(conn)))
        .await
        .map_err(unavailable)
}

/// A request with a key: its fingerprint and its claim (no wait). The claim for the handler
/// if the key is claimed, else the answer the key's state gives.
async fn open_keyed<DB: InboxDatabase>(
    config: &Config<DB>,
    info: &RequestInfo,
    headers: &http::HeaderMap,
    bytes: &[u8],
    key: String,
) -> Result<(ClaimedKey<'static, DB::Connection>, IdempotencyKey), Response<Body>> {
    let problem = |p: Problem| p.into_response(&config.problem_base);
    let (fingerprint, key) = keyed(config, info, headers, bytes, key)?;
    let state = match open_claim(config, info, &key, fingerprint).await {
        Ok(state) => state,
        Err(unavailable) => return Err(problem(unavailable)),
    };
    match state {
        ClaimState::Claimed(claim) => Ok((claim, key)),
        ClaimState::Settled(settled) => Err(replay(config, info, &key, settled)),
        ClaimState::Conflict(_) => Err(reused(config, &info.route)),
        ClaimState::InProgress => {
            count(&info.route, "in_flight");
            Err(problem(in_flight(config.retry_after)))
        }
        ClaimState::NotYet { retry_in, .. } => {
            // Keys of HTTP requests are never recorded as failed; a scope shared with a claim
            // session of your own could be.
            count(&info.route, "in_flight");
            Err(problem(in_flight(retry_in.max(config.retry_after))))
        }
    }
}

/// The fingerprint of a request with a key, and the key as the inbox takes it; a body that
/// cannot be fingerprinted or a key the inbox refuses: a 400 answer (counted).
// The answer is a response, as every step's: built once, on the way out.
#[allow(clippy::result_large_err)]
pub(crate) fn keyed(
    config: &Settings,
    info: &RequestInfo,
    headers: &http::HeaderMap,
    bytes: &[u8],
    key: String,
) -> Result<(Fingerprint, IdempotencyKey), Response<Body>> {
    let problem = |p: Problem| p.into_response(&config.problem_base);
    let fingerprint = match fingerprint(headers, &info.name, bytes) {
        Ok(fingerprint) => fingerprint,
        Err(bad) => {
            count(&info.route, "bad_request");
            return Err(problem(bad));
        }
    };
    match IdempotencyKey::new(key, "http request", "Idempotency-Key") {
        Ok(key) => Ok((fingerprint, key)),
        Err(error) => {
            // Blank or NUL keys: refused by the inbox's own rules (the header parser already
            // refuses both; kept for any future relaxation of it).
            count(&info.route, "bad_request");
            Err(problem(Problem::new(
                StatusCode::BAD_REQUEST,
                "idempotency-key-malformed",
                "Idempotency-Key is malformed",
                error.to_string(),
            )))
        }
    }
}

/// The 422 answer (counted): the key is settled or held with another fingerprint.
pub(crate) fn reused(config: &Settings, route: &Route) -> Response<Body> {
    count(route, "mismatch");
    Problem::new(
        StatusCode::UNPROCESSABLE_ENTITY,
        "idempotency-key-reused",
        "Idempotency-Key is already used",
        "this Idempotency-Key was used for a different request (another method, path, \
         query or body); a key must not be reused across different requests: send \
         the original request to get its response, or use a new key",
    )
    .into_response(&config.problem_base)
}

/// Opens the claim of `key` on a pooled connection that goes with it, without waiting. The
/// database unavailable: a 503 problem (counted).
async fn open_claim<DB: InboxDatabase>(
    config: &Config<DB>,
    info: &RequestInfo,
    key: &IdempotencyKey,
    fingerprint: Fingerprint,
) -> Result<ClaimState<'static, DB::Connection>, Problem> {
    let conn = match config.pool.acquire().await {
        Ok(conn) => conn,
        Err(error) => {
            count(&info.route, "failed");
            return Err(store_unavailable(config, &error));
        }
    };
    let session = ClaimSession::new(&info.scope, key, &info.name, fingerprint).wait(Wait::NoWait);
    session.open_owned(conn).await.map_err(|error| {
        count(&info.route, "failed");
        tracing::warn!(scope = %info.scope, key = %key, error = %error, "idempotency claim failed");
        unavailable_problem(
            config,
            "the request could not be checked against its Idempotency-Key; \
             nothing was done: retry with the same key",
        )
    })
}

/// The answer to a request whose key was settled before: its stored response, replayed.
fn replay<DB: InboxDatabase>(
    config: &Config<DB>,
    info: &RequestInfo,
    key: &IdempotencyKey,
    settled: Settled,
) -> Response<Body> {
    let stored = match (settled.status, settled.result) {
        (Status::Processed, Some(result)) => Ok(result),
        (status, _) => Err(format!(
            "the key is settled as `{status}` without a stored response"
        )),
    };
    replay_stored(config, info, key, stored)
}

/// The answer to a request whose key holds a stored response (`Err`: why there is none to
/// replay): the response, replayed byte for byte, or a 500 (counted).
pub(crate) fn replay_stored(
    config: &Settings,
    info: &RequestInfo,
    key: &IdempotencyKey,
    stored: Result<Vec<u8>, String>,
) -> Response<Body> {
    let replay = stored
        .and_then(|result| StoredResponse::decode(&result).map_err(|damaged| damaged.to_string()));
    match replay {
        Ok(stored) => {
            count(&info.route, "replayed");
            replayed(stored)
        }
        Err(reason) => {
            count(&info.route, "failed");
            tracing::error!(scope = %info.scope, key = %key, reason = %reason, "stored response unreadable");
            Problem::new(
                StatusCode::INTERNAL_SERVER_ERROR,
                "stored-response-unreadable",
                "The stored response cannot be replayed",
                reason,
            )
            .into_response(&config.problem_base)
        }
    }
}

/// Runs the handler with the transaction in `slot`, then commits it with the stored response
/// (or rolls it back) and answers.
async fn run<S, DB, ResBody>(
    config: &Config<DB>,
    info: &RequestInfo,
    inner: &mut S,
    request: Request<Body>,
    slot: TxSlot<DB>,
) -> Result<Response<Body>, S::Error>
where
    S: Wrapped<ResBody>,
    DB: InboxDatabase,
    ResBody: ResponseBody,
{
    let route = &info.route;
    let problem = |p: Problem| Ok(p.into_response(&config.problem_base));
    let (head, body) = match respond(config, route, inner, request).await {
        Ok(Ok(response)) => response,
        Ok(Err(failed)) => {
            rollback(slot.take()).await;
            return problem(failed);
        }
        Err(error) => {
            rollback(slot.take()).await;
            return Err(error);
        }
    };
    let Some(held) = slot.take() else {
        // The handler kept the transaction (moved it into a spawned task, say): it can be
        // neither committed nor stored here. Dropping it elsewhere rolls it back.
        return problem(outlived(route));
    };
    if !(config.stores)(head.status) {
        rollback(Some(held)).await;
        count(route, "not_stored");
        return Ok(Response::from_parts(head, Body::from(body)));
    }
    let claimed = matches!(held, Held::Claimed(_));
    match commit_held(config, info, held, &head, &body).await {
        Ok(()) => {
            if claimed {
                // (A request without a key was counted as `no_key` already.)
                count(route, "first");
            }
            Ok(Response::from_parts(head, Body::from(body)))
        }
        Err((operation, error)) => problem(uncommitted(route, operation, &error, config)),
    }
}

/// The 500 answer (counted) when the handler kept the request's transaction beyond its return.
pub(crate) fn outlived(route: &Route) -> Problem {
    count(route, "failed");
    tracing::error!(route = %route.label, "the idempotency transaction outlived the handler");
    Problem::new(
        StatusCode::INTERNAL_SERVER_ERROR,
        "transaction-unavailable",
        "The transaction outlived the handler",
        "the handler kept the request's transaction beyond its return; it is rolled back \
         and nothing was stored",
    )
}

/// Calls the handler and reads its response body whole (up to the limit). A handler that
/// panics, or a body over the limit or failing: counted, and the problem to answer as the inner
/// `Err`; the handler's own error is returned as it is (counted). The caller ends the request's
/// transaction in both cases.
pub(crate) async fn respond<S, ResBody>(
    config: &Settings,
    route: &Route,
    inner: &mut S,
    request: Request<Body>,
) -> Result<Result<(http::response::Parts, Bytes), Problem>, S::Error>
where
    S: Wrapped<ResBody>,
    ResBody: ResponseBody,
{
    let outcome = AssertUnwindSafe(call(inner, request)).catch_unwind().await;
    let response = match outcome {
        Ok(Ok(response)) => response,
        Ok(Err(error)) => {
            count(route, "failed");
            return Err(error);
        }
        Err(_panic) => {
            count(route, "failed");
            tracing::error!(route = %route.label, "handler panicked; rolled back");
            return Ok(Err(Problem::new(
                StatusCode::INTERNAL_SERVER_ERROR,
                "handler-panicked",
                "The handler failed",
                "the handler panicked; nothing was stored, and a retry with the same key runs \
                 it again",
            )));
        }
    };
    let (head, body) = response.into_parts();
    match Limited::new(body, config.max_response_bytes)
        .collect()
        .await
    {
        Ok(collected) => Ok(Ok((head, collected.to_bytes()))),
        Err(error) => {
            count(route, "failed");
            let too_large = error.downcast_ref::<LengthLimitError>().is_some();
            tracing::error!(route = %route.label, too_large, "response body not stored; rolled back");
            Ok(Err(if too_large {
                Problem::new(
                    StatusCode::INTERNAL_SERVER_ERROR,
                    "response-too-large",
                    "The response is too large to store",
                    format!(
                        "the handler's response body is larger than the {} bytes an idempotent \
                         response may have; nothing was stored",
                        config.max_response_bytes
                    ),
                )
            } else {
                Problem::new(
                    StatusCode::INTERNAL_SERVER_ERROR,
                    "handler-panicked",
                    "The handler failed",
                    "the handler's response body failed; nothing was stored",
                )
            }))
        }
    }
}

/// Commits the request's transaction through the protocol's last steps: the response stored
/// with the key (a claimed request), the hooks, verify and `COMMIT`, the after-commit hooks.
/// `Err`: the step that failed (`None`: a hook) and its error, everything rolled back (or, for
/// [`StoreOperation::Commit`], the outcome unknown).
async fn commit_held<DB: InboxDatabase>(
    config: &Config<DB>,
    info: &RequestInfo,
    held: Held<DB>,
    head: &http::response::Parts,
    body: &Bytes,
) -> Result<(), (Option<StoreOperation>, String)> {
    let hooks = config.hooks.runner();
    let hook_failed = |source: BoxError| (None, format!("before-commit hook failed: {source}"));
    match held {
        Held::Claimed(claim) => {
            let stored = StoredResponse::select(
                head.status,
                &head.headers,
                &config.stored_headers,
                body.clone(),
            );
            claim
                .complete_with(Some(&stored.encode()), hooks)
                .await
                .map_err(|incomplete| match incomplete {
                    Incomplete::Store(e) => (Some(e.operation), e.to_string()),
                    Incomplete::Hook(source) => hook_failed(source),
                })
        }
        Held::Plain(mut tx) => {
            // No key, no claim: the hooks see the scope and an empty key.
            let claim = ClaimInfo {
                consumer: &info.scope,
                key: "",
                message_name: &info.name,
                payload: None,
                source: None,
            };
            commit(&mut tx, hooks, &claim, Verify::Nothing)
                .await
                .map_err(|uncommitted| match uncommitted {
                    Uncommitted::Store(operation, e) => (Some(operation), e.to_string()),
                    Uncommitted::Hook(source) => hook_failed(source),
                })
        }
    }
}

/// The answer to a request whose transaction did not commit (counted as failed): the outcome
/// unknown (503) after a failed `COMMIT`, else rolled back (500).
fn uncommitted(
    route: &Route,
    operation: Option<StoreOperation>,
    error: &str,
    config: &Settings,
) -> Problem {
    count(route, "failed");
    if operation == Some(StoreOperation::Commit) {
        return outcome_unknown(route, error, config);
    }
    transaction_failed(route, error)
}

/// The 503 `outcome-unknown` problem: the commit was sent, its answer lost.
pub(crate) fn outcome_unknown(route: &Route, error: &str, config: &Settings) -> Problem {
    tracing::error!(route = %route.label, error = %error, "commit outcome unknown");
    Problem::new(
        StatusCode::SERVICE_UNAVAILABLE,
        "outcome-unknown",
        "The outcome is unknown",
        "the database did not confirm the commit; retry with the same \
         Idempotency-Key to learn whether the request took effect (the retry \
         replays its response if it did, and runs it if it did not)",
    )
    .retry_after(config.retry_after)
}

/// The 500 `transaction-failed` problem: nothing was stored.
pub(crate) fn transaction_failed(route: &Route, error: &str) -> Problem {
    tracing::error!(route = %route.label, error = %error, "transaction failed; rolled back");
    Problem::new(
        StatusCode::INTERNAL_SERVER_ERROR,
        "transaction-failed",
        "The transaction failed",
        "the request's transaction could not be committed (a database error the \
         handler did not return, storing the response failed, or a before-commit hook \
         failed); nothing was stored",
    )
}

/// Ends a transaction the layer does not commit: rolls it back, recording nothing (the key
/// stays free).
async fn rollback<DB: InboxDatabase>(held: Option<Held<DB>>) {
    match held {
        Some(Held::Claimed(claim)) => {
            if let Err(error) = (*claim).abandon().await {
                tracing::warn!(error = %error, "rollback failed (the server rolls back when the connection closes)");
            }
        }
        Some(Held::Plain(mut tx)) => {
            let _ = tx.rollback().await;
        }
        // Kept by the handler beyond its return: rolled back wherever it is dropped.
        None => {}
    }
}

pub(crate) async fn call<S, B>(inner: &mut S, request: Request<B>) -> Result<S::Response, S::Error>
where
    S: tower::Service<Request<B>>,
{
    std::future::poll_fn(|cx| inner.poll_ready(cx)).await?;
    inner.call(request).await
}

/// Reads the body whole, up to `limit` bytes.
async fn read_body<B>(headers: &http::HeaderMap, body: B, limit: usize) -> Result<Bytes, Problem>
where
    B: http_body::Body<Data = Bytes> + Send + 'static,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    let too_large = |size: Option<u64>| {
        let size = size.map_or_else(
            || "more than".to_owned(),
            |s| format!("{s} bytes, more than"),
        );
        Problem::new(
            StatusCode::PAYLOAD_TOO_LARGE,
            "request-body-too-large",
            "The request body is too large",
            format!("the request body is {size} the {limit} bytes this operation accepts"),
        )
    };
    let declared = headers
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    if let Some(size) = declared
        && size > limit as u64
    {
        return Err(too_large(Some(size)));
    }
    match Limited::new(body, limit).collect().await {
        Ok(collected) => Ok(collected.to_bytes()),
        Err(error) if error.downcast_ref::<LengthLimitError>().is_some() => Err(too_large(None)),
        Err(error) => Err(Problem::new(
            StatusCode::BAD_REQUEST,
            "request-body-invalid",
            "The request body could not be read",
            format!("reading the request body failed: {error}"),
        )),
    }
}

/// The request's fingerprint: `name` (method, path and query) and the body, canonical JSON
/// when the body is declared JSON, else its bytes.
fn fingerprint(headers: &http::HeaderMap, name: &str, body: &[u8]) -> Result<Fingerprint, Problem> {
    if !is_json(headers) {
        return Ok(Fingerprint::of_bytes(name, body));
    }
    let invalid = |reason: String| {
        Problem::new(
            StatusCode::BAD_REQUEST,
            "request-body-invalid",
            "The request body is not valid JSON",
            format!("the body is declared JSON (Content-Type) but does not parse: {reason}"),
        )
    };
    // The dispatcher's Unicode rule: UTF-8, and no escape that decodes to an unpaired
    // surrogate (serde_json refuses both too, in less plain words).
    let text = crate::types::json_text::json_text(body).map_err(|error| {
        Problem::new(
            StatusCode::BAD_REQUEST,
            "request-body-invalid",
            "The request body is not valid JSON",
            format!("the body is declared JSON (Content-Type) but is not Unicode text: {error}"),
        )
    })?;
    let value: serde_json::Value =
        serde_json::from_str(text).map_err(|error| invalid(error.to_string()))?;
    Fingerprint::of(name, &value).map_err(|error| invalid(error.to_string()))
}

/// Whether `Content-Type` is `application/json` or a `+json` type (RFC 6839), whatever its
/// parameters and case.
fn is_json(headers: &http::HeaderMap) -> bool {
    let Some(value) = headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
    else {
        return false;
    };
    let essence = value
        .split(';')
        .next()
        .unwrap_or("")
        .trim()
        .to_ascii_lowercase();
    essence == "application/json" || (essence.ends_with("+json") && essence.contains('/'))
}

pub(crate) fn replayed(stored: StoredResponse) -> Response<Body> {
    let mut response = Response::new(Body::from(stored.body));
    *response.status_mut() = stored.status;
    let headers = response.headers_mut();
    for (name, value) in stored.headers {
        headers.append(name, value);
    }
    headers.insert(IDEMPOTENT_REPLAYED, HeaderValue::from_static("true"));
    response
}

pub(crate) fn key_problem(problem: KeyProblem) -> Problem {
    let (slug, title, detail) = problem.describe();
    Problem::new(StatusCode::BAD_REQUEST, slug, title, detail)
}

pub(crate) fn in_flight(retry_after: std::time::Duration) -> Problem {
    Problem::new(
        StatusCode::CONFLICT,
        "idempotency-key-in-use",
        "A request is outstanding for this Idempotency-Key",
        "a request with the same Idempotency-Key is being processed; retry after the \
         Retry-After delay with the same key to get its response",
    )
    .retry_after(retry_after)
}

fn store_unavailable(config: &Settings, error: &sqlx::Error) -> Problem {
    tracing::warn!(error = %error, "idempotency store unavailable");
    unavailable_problem(
        config,
        "the database could not be reached; nothing was done: retry with the same key",
    )
}

/// The 503 `store-unavailable` problem, with `Retry-After`; `detail` says what failed.
pub(crate) fn unavailable_problem(config: &Settings, detail: &'static str) -> Problem {
    Problem::new(
        StatusCode::SERVICE_UNAVAILABLE,
        "store-unavailable",
        "The idempotency store is unavailable",
        detail,
    )
    .retry_after(config.retry_after)
}

pub(crate) fn count(route: &Route, outcome: &'static str) {
    metrics::counter!("inbox_http_requests_total", "route" => route.label.clone(), "outcome" => outcome)
        .increment(1);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn json_media_types() {
        let with = |ct: &'static str| {
            let mut headers = http::HeaderMap::new();
            headers.insert(header::CONTENT_TYPE, HeaderValue::from_static(ct));
            is_json(&headers)
        };
        assert!(with("application/json"));
        assert!(with("Application/JSON; charset=utf-8"));
        assert!(with("application/merge-patch+json"));
        assert!(!with("text/plain"));
        assert!(!with("application/jsonl"));
        assert!(!is_json(&http::HeaderMap::new()));
    }

    #[test]
    fn the_fingerprint_ignores_json_formatting_but_not_the_target() {
        let mut json = http::HeaderMap::new();
        json.insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/json"),
        );
        let a = fingerprint(&json, "POST /p", br#"{"a":1,"b":[1,2]}"#).unwrap();
        let b = fingerprint(&json, "POST /p", b"{ \"b\": [1, 2],\n \"a\": 1 }").unwrap();
        assert_eq!(a, b);
        assert_ne!(
            a,
            fingerprint(&json, "POST /q", br#"{"a":1,"b":[1,2]}"#).unwrap()
        );
        assert_ne!(
            a,
            fingerprint(&json, "POST /p", br#"{"a":1,"b":[2,1]}"#).unwrap()
        );
        assert!(fingerprint(&json, "POST /p", b"{not json").is_err());
        let plain = http::HeaderMap::new();
        assert_ne!(
            fingerprint(&plain, "POST /p", br#"{"a":1}"#).unwrap(),
            fingerprint(&plain, "POST /p", br#"{ "a":1}"#).unwrap()
        );
    }
}
