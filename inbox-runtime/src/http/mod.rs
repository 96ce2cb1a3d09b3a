//! The HTTP `Idempotency-Key` header on the inbox's claim: a tower [`Layer`](tower::Layer) for
//! axum (and any tower service), and the [`IdempotencyTx`] extractor that gives the handler the
//! claim's transaction. Feature `http`.
//!
//! Clients double-submit: a user clicks "Pay" twice, a mobile client retries after a timeout, a
//! load balancer retries on another instance. With an `Idempotency-Key` header
//! ([draft-ietf-httpapi-idempotency-key-header-07]) the client names the *intent*; this layer
//! makes every request with the same key (in the same scope) take effect once:
//!
//! ```text
//! request ─► key, fingerprint ─► claim (first statement of a transaction, no wait)
//!   claimed ─► handler runs on the claim's transaction (IdempotencyTx)
//!              ─► response stored with the key ─► COMMIT (writes + key + response)
//!   settled, same request ─► the stored response, byte for byte, Idempotent-Replayed: true
//!   settled, other request ─► 422      held by a running request ─► 409 + Retry-After
//! ```
//!
//! Unlike middlewares that store the response after the handler in a separate write, the
//! handler's writes, the key and the stored response commit **in one transaction**: a crash
//! between the effect and the stored response cannot happen, and a concurrent duplicate finds
//! the key locked and gets a 409 instead of running the handler a second time.
//!
//! ```no_run
//! use axum::{Json, Router, http::StatusCode, routing::post};
//! use inbox_runtime::http::{IdempotencyLayer, IdempotencyTx};
//! use sqlx::Postgres;
//!
//! async fn create_order(
//!     mut tx: IdempotencyTx<Postgres>,
//!     Json(order): Json<serde_json::Value>,
//! ) -> Result<(StatusCode, Json<serde_json::Value>), StatusCode> {
//!     let id: i64 = sqlx::query_scalar("INSERT INTO orders (body) VALUES ($1) RETURNING id")
//!         .bind(&order)
//!         .fetch_one(&mut *tx)
//!         .await
//!         .map_err(|_| StatusCode::INTERNAL_SERVER_ERROR)?;
//!     Ok((StatusCode::CREATED, Json(serde_json::json!({ "id": id }))))
//! }
//!
//! # async fn demo(pool: sqlx::PgPool) -> Result<(), Box<dyn std::error::Error>> {
//! inbox_runtime::migrate(&pool).await?;
//! let idempotency = IdempotencyLayer::new(pool.clone())
//!     // Keys are per user: the same key from another user is another key.
//!     .principal(|parts: &axum::http::request::Parts| {
//!         parts.extensions.get::<UserId>().map(|user| user.0.clone())
//!     });
//! let app: Router = Router::new()
//!     .route("/orders", post(create_order))
//!     .route_layer(idempotency); // after routing: the route template is part of the scope
//! let listener = tokio::net::TcpListener::bind("127.0.0.1:3000").await?;
//! axum::serve(listener, app).await?;
//! # Ok(()) }
//! # #[derive(Clone)] struct UserId(String);
//! ```
//!
//! # What the layer does, request by request
//!
//! Requests whose method is not one of [`IdempotencyLayer::methods`] (default `POST` and
//! `PATCH`) pass through untouched. For the others:
//!
//! 1. **The key.** The `Idempotency-Key` field must be an RFC 9651 Item whose value is a String
//!    (`Idempotency-Key: "8e03978e-40d5-43e8-bc93-6894a57f9324"`: printable ASCII in double
//!    quotes; parameters are ignored), not empty or blank, at most
//!    [`max_key_len`](IdempotencyLayer::max_key_len) characters (255 by default), and sent once.
//!    Otherwise: **400**. [`accept_unquoted_keys`](IdempotencyLayer::accept_unquoted_keys) also
//!    takes Stripe-style bare keys (`Idempotency-Key: KG5LxwFBepaKHyUD`). A missing key is a
//!    **400** when [`require_key`](IdempotencyLayer::require_key) (the default); when optional,
//!    the request runs without a claim, in a plain transaction.
//! 2. **The body** is read whole, up to [`max_body_bytes`](IdempotencyLayer::max_body_bytes)
//!    (1 MiB by default, 256 MiB at most; a larger `Content-Length` is refused before reading):
//!    **413** above it.
//!    The body stops being read at the limit: a client cannot make the layer hold more. A body
//!    declared JSON (`Content-Type: application/json` or `…+json`) that does not parse, or is
//!    not Unicode text (bytes that are not UTF-8, an escape that decodes to an unpaired
//!    surrogate, anywhere in it, as the dispatcher refuses them): **400**.
//! 3. **The scope** the key is claimed in: `http <METHOD> <route>`, plus ` <principal>` when
//!    [`principal`](IdempotencyLayer::principal) gives one. The route is axum's matched route
//!    template (`/payments/{id}`) when the layer runs after routing (`Router::route_layer`, or
//!    `.layer` on a `MethodRouter`), else the request's path. The same key in another scope is
//!    another key.
//! 4. **The fingerprint** of the request: SHA-256 over the method, the path and query, and the
//!    body — a JSON body in its RFC 8785 canonical form (as [`Fingerprint::of`] computes for
//!    messages: member order and whitespace do not count), any other body byte for byte
//!    ([`Fingerprint::of_bytes`]).
//! 5. **The claim**, without waiting ([`Wait::NoWait`](crate::Wait::NoWait)):
//!    * free: the handler runs with the claim's transaction ([`IdempotencyTx`]). Its response
//!      body is read (up to [`max_response_bytes`](IdempotencyLayer::max_response_bytes), 1 MiB).
//!      If [`stores`](IdempotencyLayer::store_statuses) says its status is final (by default
//!      2xx, 3xx and 4xx except 408, 409, 425 and 429), the response — status, the headers of
//!      [`stored_headers`](IdempotencyLayer::stored_headers), body — is stored with the key and
//!      everything commits; the client gets the response as the handler made it. Any other
//!      status rolls everything back (the key stays free: a retry runs the handler again), and
//!      the client gets the response as it is;
//!    * settled with the same fingerprint: the stored response, its body byte for byte, with
//!      `Idempotent-Replayed: true`; the handler does not run;
//!    * settled or held with another fingerprint: **422**;
//!    * held by a request still running: **409** at once, with `Retry-After`
//!      ([`retry_after`](IdempotencyLayer::retry_after), 1 s by default).
//!
//! [`with_hook`](IdempotencyLayer::with_hook) adds [`TransactionHook`]s, as a dispatcher's are
//! for messages: their `before_commit` runs on the request's transaction just before it commits
//! (a claimed request's, after its response is stored; a request without a key's too), their
//! `after_commit` once it committed.
//!
//! A handler that panics, a response body above the limit, or a transaction kept beyond the
//! handler: rolled back, **500**, nothing stored. The database unreachable, or the commit's
//! outcome unknown: **503** with `Retry-After` (retry with the same key: the retry finds out).
//!
//! # Problems
//!
//! The layer's own answers are problem details (RFC 9457), `Content-Type:
//! application/problem+json`, with `type` set to the base URI
//! ([`problem_type_base`](IdempotencyLayer::problem_type_base), by default this page) followed by
//! one of these slugs:
//!
//! | status | `type` slug | when |
//! |---|---|---|
//! | 400 | `idempotency-key-missing` | no `Idempotency-Key` where it is required |
//! | 400 | `idempotency-key-malformed` | not an sf-string, sent twice, empty or blank |
//! | 400 | `idempotency-key-too-long` | longer than `max_key_len` |
//! | 400 | `request-body-invalid` | a JSON-typed body that does not parse or is not Unicode text (bytes that are not UTF-8, an escape that decodes to an unpaired surrogate such as `"\ud800"`), or an unreadable body |
//! | 413 | `request-body-too-large` | a body above `max_body_bytes` |
//! | 409 | `idempotency-key-in-use` | a request with this key is still being processed (`Retry-After`) |
//! | 409 | `condition-failed` | DynamoDB only ([`DynamoIdempotencyLayer`]): a condition of the handler's actions failed at the commit; nothing written |
//! | 422 | `idempotency-key-reused` | this key was used for a different request |
//! | 500 | `handler-panicked`, `response-too-large`, `transaction-unavailable`, `transaction-failed`, `stored-response-unreadable` | the application failed; nothing stored |
//! | 503 | `store-unavailable`, `outcome-unknown` | the database failed (`Retry-After`) |
//!
//! None of them is stored, and none writes anything: a client may correct the request (or, for
//! 409 and 503, wait) and retry with the same key.
//!
//! # On DynamoDB
//!
//! With the feature `dynamodb` too, [`DynamoIdempotencyLayer`] runs this pipeline (the same
//! settings, steps 1 to 4, statuses and problems) on a [`DynamoInbox`](crate::dynamodb::DynamoInbox)'s
//! table: the handler gets the [`DynamoTx`](crate::dynamodb::DynamoTx) through
//! [`DynamoIdempotencyTx`], and its actions, the key's item and the stored response commit in one
//! `TransactWriteItems`. DynamoDB has no locks: a lease on the key, taken before the handler
//! runs, gives concurrent duplicates their 409. Its calls per request, its limits (a stored
//! response in a 400 KB item) and its retention are in [`DynamoIdempotencyLayer`]'s docs.
//!
//! # Retention
//!
//! Keys and stored responses are rows of the inbox table (`inbox_messages`, status
//! `processed`, the response in its `result` column) under their `http …` scopes, so the
//! inbox's retention purge ([`admin::purge`](crate::ops::admin::purge), the `purge` command of the
//! operator's CLI) removes them with every other settled key once they are older than the
//! window; after that, the same key runs the handler again. Publish the window to your clients:
//! the draft asks servers to document their key expiry. `stats` lists each scope like a
//! consumer.
//!
//! # Metrics
//!
//! `inbox_http_requests_total{route, outcome}` (a `metrics` counter; `route` is
//! `<METHOD> <route>`), `outcome` one of: `first` (the handler ran and its response was
//! stored), `replayed`, `mismatch` (422), `in_flight` (409), `not_stored` (the handler ran, its
//! status was not stored: rolled back), `no_key` (an optional key absent: plain transaction),
//! `bad_request` (400 and 413), `failed` (500 and 503).
//!
//! # Tracing
//!
//! With the feature `otel`, every request runs in the span `inbox.http` (fields `method`,
//! `path`), a child of the request's W3C Trace Context headers `traceparent`/`tracestate` if they
//! carry a valid one (a malformed one is ignored: a new trace; the request is served as without
//! it). The handler, and so its outbox rows, continue that trace: see [`crate::trace`].
//!
//! [draft-ietf-httpapi-idempotency-key-header-07]: https://datatracker.ietf.org/doc/draft-ietf-httpapi-idempotency-key-header/07/
//! [`Fingerprint::of`]: crate::Fingerprint::of
//! [`Fingerprint::of_bytes`]: crate::Fingerprint::of_bytes

#[cfg(feature = "dynamodb")]
mod dynamo;
mod extract;
mod key;
mod problem;
mod service;
mod stored;

use std::sync::Arc;
use std::time::Duration;

use http::{HeaderName, Method, StatusCode, header};
use sqlx::Pool;

use crate::protocol::hooks::{Hooks, TransactionHook};
use crate::store::InboxDatabase;

#[cfg(feature = "dynamodb")]
pub use dynamo::{
    DEFAULT_LEASE, DynamoIdempotencyLayer, DynamoIdempotencyService, DynamoIdempotencyTx,
};
pub use extract::{IdempotencyTx, MissingTransaction};
pub use service::IdempotencyService;

/// The response header that marks a replayed response: `Idempotent-Replayed: true`.
pub const IDEMPOTENT_REPLAYED: HeaderName = HeaderName::from_static("idempotent-replayed");

/// The default [`IdempotencyLayer::problem_type_base`]: this module's documentation, whose
/// "Problems" table lists every slug.
pub const DEFAULT_PROBLEM_BASE: &str =
    "https://docs.rs/inbox-runtime/latest/inbox_runtime/http/index.html#problems-";

/// The default [`IdempotencyLayer::max_key_len`]: 255 characters (Stripe's limit, and what most
/// providers accept).
pub const DEFAULT_MAX_KEY_LEN: usize = 255;

/// The default [`IdempotencyLayer::max_body_bytes`] and
/// [`IdempotencyLayer::max_response_bytes`]: 1 MiB.
pub const DEFAULT_MAX_BODY_BYTES: usize = 1 << 20;

/// Which principal a request comes from: the function of [`IdempotencyLayer::principal`].
type PrincipalFn = dyn Fn(&http::request::Parts) -> Option<String> + Send + Sync;

/// Which response statuses are stored: the function of [`IdempotencyLayer::store_statuses`].
type StoreFn = dyn Fn(StatusCode) -> bool + Send + Sync;

/// The `Idempotency-Key` layer: wrap a route (`Router::route_layer`) or a whole router
/// (`Router::layer`) with it. See the [module documentation](self) for what it does with each
/// request; every setting below has a default, so `IdempotencyLayer::new(pool)` is complete.
///
/// The pool must be migrated ([`crate::migrate`]): keys and responses live in the inbox table.
/// Each request that claims a key holds one pooled connection while its handler runs.
pub struct IdempotencyLayer<DB: InboxDatabase> {
    config: Arc<Config<DB>>,
}

/// The settings every store's layer shares: what the request pipeline reads.
#[derive(Clone)]
pub(crate) struct Settings {
    methods: Vec<Method>,
    require_key: bool,
    accept_unquoted: bool,
    max_key_len: usize,
    max_body_bytes: usize,
    max_response_bytes: usize,
    principal: Option<Arc<PrincipalFn>>,
    stores: Arc<StoreFn>,
    stored_headers: Vec<HeaderName>,
    retry_after: Duration,
    problem_base: String,
}

impl Default for Settings {
    fn default() -> Self {
        Self {
            methods: vec![Method::POST, Method::PATCH],
            require_key: true,
            accept_unquoted: false,
            max_key_len: DEFAULT_MAX_KEY_LEN,
            max_body_bytes: DEFAULT_MAX_BODY_BYTES,
            max_response_bytes: DEFAULT_MAX_BODY_BYTES,
            principal: None,
            stores: Arc::new(stored_by_default),
            stored_headers: default_stored_headers(),
            retry_after: Duration::from_secs(1),
            problem_base: DEFAULT_PROBLEM_BASE.to_owned(),
        }
    }
}

impl std::fmt::Debug for Settings {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Settings")
            .field("methods", &self.methods)
            .field("require_key", &self.require_key)
            .field("accept_unquoted_keys", &self.accept_unquoted)
            .field("max_key_len", &self.max_key_len)
            .field("max_body_bytes", &self.max_body_bytes)
            .field("max_response_bytes", &self.max_response_bytes)
            .field("principal", &self.principal.is_some())
            .field("stored_headers", &self.stored_headers)
            .field("retry_after", &self.retry_after)
            .field("problem_type_base", &self.problem_base)
            .finish_non_exhaustive()
    }
}

pub(crate) struct Config<DB: InboxDatabase> {
    settings: Settings,
    pool: Pool<DB>,
    hooks: Hooks<DB>,
    /// The table prefix of the scope the layer was built in: requests run in it.
    pub(crate) prefix: Option<crate::store::TablePrefix>,
}

impl<DB: InboxDatabase> std::ops::Deref for Config<DB> {
    type Target = Settings;

    fn deref(&self) -> &Settings {
        &self.settings
    }
}

impl<DB: InboxDatabase> Clone for IdempotencyLayer<DB> {
    fn clone(&self) -> Self {
        Self {
            config: Arc::clone(&self.config),
        }
    }
}

impl<DB: InboxDatabase> Clone for Config<DB> {
    fn clone(&self) -> Self {
        Self {
            settings: self.settings.clone(),
            pool: self.pool.clone(),
            hooks: self.hooks.clone(),
            prefix: self.prefix.clone(),
        }
    }
}

impl<DB: InboxDatabase> std::fmt::Debug for IdempotencyLayer<DB> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("IdempotencyLayer")
            .field("settings", &self.config.settings)
            .field("hooks", &self.config.hooks.runner().is_some())
            .finish_non_exhaustive()
    }
}

/// The statuses stored by default: 2xx, 3xx, and 4xx except 408 Request Timeout, 409 Conflict,
/// 425 Too Early and 429 Too Many Requests (answers that ask the client to try again). Never
/// 1xx or 5xx.
pub fn stored_by_default(status: StatusCode) -> bool {
    let code = status.as_u16();
    (200..500).contains(&code) && !matches!(code, 408 | 409 | 425 | 429)
}

/// The response headers stored (and replayed) by default: `Content-Type`, `Content-Encoding`,
/// `Content-Language`, `Content-Location`, `Content-Disposition`, `Location`, `Link`, `ETag`,
/// `Last-Modified`, `Cache-Control`, `Expires`, `Vary`. Never `Set-Cookie` (a replay must not
/// hand out a session), nor the framing headers (`Content-Length`, `Transfer-Encoding`,
/// `Connection`), nor `Date`.
pub fn default_stored_headers() -> Vec<HeaderName> {
    vec![
        header::CONTENT_TYPE,
        header::CONTENT_ENCODING,
        header::CONTENT_LANGUAGE,
        header::CONTENT_LOCATION,
        header::CONTENT_DISPOSITION,
        header::LOCATION,
        header::LINK,
        header::ETAG,
        header::LAST_MODIFIED,
        header::CACHE_CONTROL,
        header::EXPIRES,
        header::VARY,
    ]
}

/// The builder setters of the settings every store's layer shares, written once: expanded in
/// each layer's `impl`, which has `fn settings_mut(&mut self) -> &mut Settings`. Three steps:
/// the key ([`key_setters`]), the sizes ([`size_setters`]), the scope and the stored response
/// ([`response_setters`]).
macro_rules! settings_setters {
    () => {
        $crate::http::key_setters!();
        $crate::http::size_setters!();
        $crate::http::response_setters!();
    };
}

/// The setters of which requests are covered and what key they take.
macro_rules! key_setters {
    () => {
        $crate::setters::setters! {
            /// The methods the layer covers (default `POST` and `PATCH`, the methods RFC 9110 does not
            /// make idempotent); requests with other methods pass through untouched.
            pub fn methods(methods: impl IntoIterator<Item = Method>) {
                self.settings_mut().methods = methods.into_iter().collect();
            }

            /// Whether a covered request without `Idempotency-Key` is refused with 400 (`true`, the
            /// default) or runs without a claim, in a plain transaction that commits by the same
            /// status rule and stores nothing (`false`).
            pub fn require_key(required: bool) {
                self.settings_mut().require_key = required;
            }

            /// Also accept keys sent without the quotes of an sf-string (`Idempotency-Key: abc123`, as
            /// clients written for Stripe-style APIs send them): a value that does not parse as an
            /// sf-string is taken verbatim if it is visible ASCII without spaces (`%x21-7E`) and does
            /// not start with `"`. Default `false`: such a key is a 400, as the draft's syntax says.
            pub fn accept_unquoted_keys(accept: bool) {
                self.settings_mut().accept_unquoted = accept;
            }

            /// The longest key accepted, in characters (sf-string characters are ASCII, so also bytes);
            /// longer keys are a 400. Default 255; values above [`MAX_KEY_BYTES`](crate::types::key::MAX_KEY_BYTES) (512, what the inbox
            /// stores) are lowered to it, and 0 is raised to 1.
            pub fn max_key_len(chars: usize) {
                self.settings_mut().max_key_len = chars.clamp(1, $crate::types::key::MAX_KEY_BYTES);
            }

        }
    };
}

/// The setters of the largest request and response bodies.
macro_rules! size_setters {
    () => {
    $crate::setters::setters! {
            /// The largest request body read, in bytes (default 1 MiB; 0: only empty bodies); above it:
            /// 413, before the handler and the claim. The whole body is held in memory to fingerprint
            /// it, so values above [`PayloadLimit::MAX_BYTES`](crate::types::PayloadLimit::MAX_BYTES)
            /// (256 MiB, the largest payload the runtime holds) are lowered to it.
            pub fn max_body_bytes(bytes: usize) {
                self.settings_mut().max_body_bytes = bytes.min(crate::types::PayloadLimit::MAX_BYTES);
            }

            /// The largest response body stored, in bytes (default 1 MiB; 0: only empty bodies, as a
            /// `204`). A handler response above it cannot be replayed, so it is not sent as a success:
            /// the transaction rolls back and the client gets a 500 (`response-too-large`). Values
            /// above [`PayloadLimit::MAX_BYTES`](crate::types::PayloadLimit::MAX_BYTES) (256 MiB) are
            /// lowered to it: the body is held in memory and stored as one database value.
            pub fn max_response_bytes(bytes: usize) {
                self.settings_mut().max_response_bytes = bytes.min(crate::types::PayloadLimit::MAX_BYTES);
            }
        }
    };
}

/// The setters of the key's scope (the principal) and of what is stored and replayed.
macro_rules! response_setters {
    () => {
        /// Who sends the request: keys are unique per principal (and method and route), so two
        /// users who happen to send the same key do not see each other's responses. `principal`
        /// reads the request's head — typically an identity that an authentication layer *before*
        /// this one put into the extensions — and returns `None` for an anonymous request (all
        /// anonymous requests share one scope). The text is stored in the inbox as part of the
        /// scope: return an id, never a credential (see
        /// [`principal_header`](Self::principal_header) for a header that is one).
        pub fn principal(
            mut self,
            principal: impl Fn(&http::request::Parts) -> Option<String> + Send + Sync + 'static,
        ) -> Self {
            self.settings_mut().principal = Some(Arc::new(principal));
            self
        }

        /// The principal is the value of header `name` (an API key, an `Authorization` header),
        /// stored as `sha256:` and the first 32 hex digits of its SHA-256, so the credential itself
        /// never reaches the database. A request without the header is anonymous.
        pub fn principal_header(self, name: HeaderName) -> Self {
            self.principal(move |parts| {
                use sha2::Digest as _;
                parts.headers.get(&name).map(|value| {
                    let digest = sha2::Sha256::digest(value.as_bytes());
                    format!("sha256:{}", hex::encode(&digest[..16]))
                })
            })
        }

        /// Which response statuses are final and stored with the key (their writes commit); any
        /// other status rolls the transaction back and leaves the key free. Default:
        /// [`stored_by_default`](crate::http::stored_by_default). Whatever this says, a status that is never stored cannot become
        /// a replay: choose statuses a client should not retry into a different answer.
        pub fn store_statuses(
            mut self,
            stores: impl Fn(StatusCode) -> bool + Send + Sync + 'static,
        ) -> Self {
            self.settings_mut().stores = Arc::new(stores);
            self
        }

        $crate::setters::setters! {
            /// The response headers stored and replayed (every value of each); default
            /// [`default_stored_headers`](crate::http::default_stored_headers). Headers not in the list are sent with the first response
            /// only.
            pub fn stored_headers(headers: impl IntoIterator<Item = HeaderName>) {
                self.settings_mut().stored_headers = headers.into_iter().collect();
            }

            /// The `Retry-After` of a 409 (a request with the key still running) and of a 503: how long
            /// a client should wait before retrying, sent in whole seconds rounded up (at least 1).
            /// Default 1 s.
            pub fn retry_after(after: Duration) {
                self.settings_mut().retry_after = after;
            }

            /// The prefix of the `type` URI of the layer's problem responses (RFC 9457), followed by
            /// the slug of each problem: point it at your API's documentation. Default
            /// [`DEFAULT_PROBLEM_BASE`](crate::http::DEFAULT_PROBLEM_BASE).
            pub fn problem_type_base(base: impl Into<String>) {
                self.settings_mut().problem_base = base.into();
            }
        }
    };
}
#[cfg(feature = "dynamodb")]
pub(crate) use settings_setters;
pub(crate) use {key_setters, response_setters, size_setters};

impl<DB: InboxDatabase> IdempotencyLayer<DB> {
    /// A layer claiming keys in the inbox of `pool`, with every default: methods `POST` and
    /// `PATCH`, key required, sf-string keys of at most 255 characters, no principal, bodies
    /// and stored responses up to 1 MiB, statuses and headers as [`stored_by_default`] and
    /// [`default_stored_headers`] say, `Retry-After: 1`.
    pub fn new(pool: Pool<DB>) -> Self {
        Self {
            config: Arc::new(Config {
                settings: Settings::default(),
                pool,
                hooks: Hooks::default(),
                prefix: crate::store::TablePrefix::current(),
            }),
        }
    }

    fn config_mut(&mut self) -> &mut Config<DB> {
        Arc::make_mut(&mut self.config)
    }

    fn settings_mut(&mut self) -> &mut Settings {
        &mut self.config_mut().settings
    }

    settings_setters!();

    /// Adds a [`TransactionHook`], as
    /// [`Dispatcher::with_hook`](crate::Dispatcher::with_hook) does for messages: its
    /// `before_commit` runs on the request's transaction after the handler returned a response
    /// the layer stores (after the hooks added before it, and after the response is stored with
    /// the key), its `after_commit` once that transaction committed. Requests without a key
    /// (where it is optional) run the hooks too, in their plain transaction.
    ///
    /// The hook's [`ClaimInfo`](crate::ClaimInfo): `consumer` is the scope (`http <METHOD>
    /// <route>`, then the principal), `key` the `Idempotency-Key` (empty for a request without
    /// one), `message_name` the method and target (`POST /orders?draft=1`); no `payload`, no
    /// `source`. A hook's error rolls everything back (the handler's writes, the key, the
    /// response) and answers **500** (`transaction-failed`); nothing is recorded, so a retry
    /// with the same key runs the handler again. Replays, conflicts, requests in flight and
    /// responses not stored run no hook.
    pub fn with_hook(mut self, hook: impl TransactionHook<DB>) -> Self {
        self.config_mut().hooks.push(Arc::new(hook));
        self
    }
}

impl<S, DB: InboxDatabase> tower::Layer<S> for IdempotencyLayer<DB> {
    type Service = IdempotencyService<S, DB>;

    fn layer(&self, inner: S) -> Self::Service {
        IdempotencyService::new(inner, Arc::clone(&self.config))
    }
}
