//! The operator console in the browser: server-rendered pages over the inbox, to mount in your
//! own service. Behind the cargo feature `console`.
//!
//! [`Console::new`] takes your [`Dispatcher`] (so that a replay finds the handlers your binary
//! registered, as the CLI's `dead replay` does) and [`Console::build`] returns an
//! [`axum::Router`] to [`nest`](axum::Router::nest) under a prefix of your choice; every link
//! and form of the pages carries that prefix.
//!
//! # Pages
//!
//! | path | what it shows |
//! |---|---|
//! | `/` | per consumer, the rows per status (processed, failed, dead, parked, stale, discarded), the rejected deliveries, the oldest failed, dead and parked messages with their age, and the failed messages whose retry is due but not yet redelivered, with how long the oldest has been due: how far retries and the ordering backlog lag ([`admin::stats`], read from the `inbox_messages_console` index: exact counts, no table scan) |
//! | `/messages?consumer=&status=&limit=` | failed and dead (or parked) messages, oldest first, at most `limit` (1 to [`MAX_LIMIT`], default [`DEFAULT_LIMIT`]) |
//! | `/message?consumer=&key=` | one message: status, attempts, last error, source metadata, the payload (pretty-printed when it is JSON) |
//! | `/replay?consumer=&key=` | a confirmation page; its form `POST`s to `/replay`, which runs [`Dispatcher::replay`] |
//! | `/discard?consumer=&key=` | a confirmation page; its form `POST`s to `/discard`, which runs [`Dispatcher::discard`] |
//! | `/replay-all?consumer=&status=&limit=` | bulk replay of what the list with the same filter shows, confirmed; its form carries the confirmed messages, and the `POST` replays exactly those (one no longer failed or dead is skipped and said so), not whatever the filter selects by then |
//! | `/rejections?consumer=&reason=&limit=` | rejected deliveries (conflicts, malformed payloads, unknown names, bad keys, too large) counted per consumer and reason, and the newest `limit` of them (of that consumer and reason, if given) |
//! | `/rejection?id=` | one rejected delivery: reason, detail, key, and its payload bytes as a hex dump (the first 64 KiB) and as text when they are UTF-8 |
//! | `/parked?consumer=&limit=` | parked messages (out of order, waiting for a predecessor) per aggregate: the last applied sequence, the one it waits for, the missing sequences (gaps) and the parked ones |
//! | `/outbox?status=&destination=&limit=` | the transactional outbox's rows per destination and status with the oldest pending and dead, and its pending and dead rows (`status=pending` or `dead`: one of them); when the outbox is not installed, a page that says so |
//! | `/rates` | per consumer, the last 24 hours in hourly bars (inline SVG): messages first delivered per hour by their status now, rejections per hour by reason (duplicates leave no row: they are a metric's); with the outbox installed, rows sent per destination and hour |
//!
//! Keys travel in query strings and form fields (percent-encoded), never in paths. Every value
//! shown is HTML-escaped. Bad input (an unknown consumer or parameter, a `limit` out of range, an
//! empty key or one with a NUL character, a wrong method) gets a `4xx` page that says what was
//! wrong, and changes nothing.
//!
//! Every page, error pages included, has the navigation and the stylesheet (served at
//! `/style.css` under the prefix, to anyone: it is needed by the `401` page too).
//!
//! # Connections
//!
//! Each request reads through one connection of the dispatcher's pool, and an action gives it
//! back before [`Dispatcher::replay`] or [`Dispatcher::discard`] take their own: no request
//! holds a connection while it asks the pool for another. A pool of one connection (the usual
//! on SQLite) serves the console; requests beyond the pool's size wait for a connection in turn
//! (sqlx's pool is fair), each up to the pool's acquire timeout (then `503`).
//!
//! # Authorization
//!
//! The console refuses to be built without a decision about who may use it:
//! [`Console::authorize`] installs a hook that sees each request's [`Parts`] and returns the
//! operator's name, or a [`Refusal`] (`401` or `403`); [`Console::behind_own_auth`] says that
//! the router is mounted behind authentication of your own (a tower layer, a proxy), and every
//! request is then served as the operator [`OWN_AUTH_OPERATOR`]. [`Console::build`] without one
//! of the two is [`ConsoleError::NoAuthorization`]. Every action (replay, discard) is logged with
//! `tracing` at `INFO`, target `inbox_runtime::ops::console`, with the operator's name, the
//! consumer, the key and how it ended.
//!
//! # CSRF
//!
//! Every `POST` carries a token in a hidden form field: its issue time and the HMAC-SHA256 of
//! the operator's name and that time under a secret of the console (random per [`Console`], or
//! [`Console::csrf_secret`] to share one between replicas), compared in constant time. A token
//! older than [`Console::form_lifetime`] (default [`DEFAULT_FORM_LIFETIME`], 1 hour) is refused
//! with `403` and a page that says the form expired and to reload it. A `POST` whose token is
//! missing or wrong,
//! or whose `Origin` is not this host, or whose `Sec-Fetch-Site` is other than `same-origin`,
//! is refused with `403` before anything is read or changed. Pages are sent with
//! `X-Frame-Options: DENY` and a `Content-Security-Policy` without scripts, so that a
//! confirmation button cannot be framed.
//!
//! ```no_run
//! use inbox_runtime::Dispatcher;
//! use inbox_runtime::ops::console::{Console, Refusal};
//!
//! # async fn run(pool: sqlx::PgPool) -> Result<(), Box<dyn std::error::Error>> {
//! let dispatcher = Dispatcher::from_registry(pool)?;
//! let console = Console::new(dispatcher)
//!     .authorize(|parts| {
//!         match parts.headers.get("authorization").and_then(|v| v.to_str().ok()) {
//!             Some("Bearer s3cret") => Ok("alice".to_owned()),
//!             Some(_) => Err(Refusal::forbidden("unknown token")),
//!             None => Err(Refusal::unauthenticated("Bearer")),
//!         }
//!     })
//!     .build()?;
//! let app: axum::Router = axum::Router::new().nest("/ops", console);
//! # let _ = app;
//! # Ok(())
//! # }
//! ```

use std::collections::BTreeSet;
use std::fmt::{self, Write as _};
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

mod chart;
mod csrf;
mod outbox;
mod parked;
mod rates;
mod rejections;

use csrf::{csrf_field, form, random_secret};

use axum::Router;
use axum::body::Body;
use axum::extract::{NestedPath, Request, State};
use axum::response::Response;
use axum::routing::get;
use http::request::Parts;
use http::{Extensions, HeaderValue, StatusCode, header};
use sqlx::pool::PoolConnection;

use crate::debug::some_fields;
use crate::ops::admin;
use crate::setters::setters;
use crate::store::{
    AdminStore as _, ConsoleDatabase, ConsoleStore as _, RejectionReason, RetryLag, StatsRow,
    StatsStatus, StoredMessage,
};
use crate::{ConsumerOutcome, Dispatcher, Error, Outcome, Status, types::MAX_KEY_BYTES};

/// The largest `limit` the list and the bulk replay accept.
pub const MAX_LIMIT: u32 = 1000;

/// The `limit` of the list when none is given.
pub const DEFAULT_LIMIT: u32 = 100;

/// The operator's name of every request when the console is [behind your own
/// auth](Console::behind_own_auth): `behind-own-auth`.
pub const OWN_AUTH_OPERATOR: &str = "behind-own-auth";

/// How long a confirmation page's form stays valid unless [`Console::form_lifetime`] says
/// otherwise: 1 hour.
pub const DEFAULT_FORM_LIFETIME: Duration = Duration::from_secs(3600);

/// The largest form body a `POST` may send: 64 KiB.
const MAX_FORM_BYTES: usize = 64 * 1024;

/// The stylesheet, embedded.
const STYLE: &str = include_str!("console.css");

/// Why the [authorization hook](Console::authorize) turned a request away.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum Refusal {
    /// Who is asking is not known: `401 Unauthorized`, with this `WWW-Authenticate` challenge
    /// (e.g. `Bearer`, or `Basic realm="inbox"` for the browser's own login prompt).
    Unauthenticated {
        /// The `WWW-Authenticate` header's value.
        challenge: String,
    },
    /// Who is asking is known and may not use the console: `403 Forbidden`, with this reason
    /// on the page.
    Forbidden {
        /// Shown to the operator.
        reason: String,
    },
}

impl Refusal {
    /// [`Refusal::Unauthenticated`] with this `WWW-Authenticate` challenge.
    pub fn unauthenticated(challenge: impl Into<String>) -> Self {
        Refusal::Unauthenticated {
            challenge: challenge.into(),
        }
    }

    /// [`Refusal::Forbidden`] with this reason.
    pub fn forbidden(reason: impl Into<String>) -> Self {
        Refusal::Forbidden {
            reason: reason.into(),
        }
    }
}

/// Why [`Console::build`] refused to build the router.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ConsoleError {
    /// Neither [`Console::authorize`] nor [`Console::behind_own_auth`] was called.
    #[error(
        "the operator console needs an authorization decision: give it a hook with \
         `Console::authorize`, or call `Console::behind_own_auth` if the router is mounted \
         behind authentication of your own"
    )]
    NoAuthorization,
    /// Both [`Console::authorize`] and [`Console::behind_own_auth`] were called: which one
    /// decides is ambiguous.
    #[error(
        "the operator console was given an authorization hook and told it is behind your own \
         auth: choose one"
    )]
    BothAuthorizations,
}

/// The authorization hook's type: the request's head in, the operator's name or a refusal out.
type Hook = dyn Fn(&Parts) -> Result<String, Refusal> + Send + Sync;

/// The builder of the operator console's router. See the [module](self) documentation.
pub struct Console<DB: ConsoleDatabase> {
    dispatcher: Arc<Dispatcher<DB>>,
    hook: Option<Arc<Hook>>,
    own_auth: bool,
    secret: Option<[u8; 32]>,
    lifetime: Duration,
}

impl<DB: ConsoleDatabase> fmt::Debug for Console<DB> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        some_fields(
            f,
            "Console",
            &[("hook", &self.hook.is_some()), ("own_auth", &self.own_auth)],
        )
    }
}

impl<DB: ConsoleDatabase> Console<DB> {
    /// A console over `dispatcher`'s pool, replaying with its handlers (a `Dispatcher`, or an
    /// `Arc` of the one your worker runs with, so that replays share its dedupe cache).
    pub fn new(dispatcher: impl Into<Arc<Dispatcher<DB>>>) -> Self {
        Self {
            dispatcher: dispatcher.into(),
            hook: None,
            own_auth: false,
            secret: None,
            lifetime: DEFAULT_FORM_LIFETIME,
        }
    }

    /// Decides, per request, who the operator is: `Ok(name)` serves the request as `name`
    /// (logged with every action), `Err(refusal)` answers `401` or `403` (see [`Refusal`]).
    /// Called for every page and action, before anything is read.
    pub fn authorize<F>(mut self, hook: F) -> Self
    where
        F: Fn(&Parts) -> Result<String, Refusal> + Send + Sync + 'static,
    {
        self.hook = Some(Arc::new(hook));
        self
    }

    /// Acknowledges that the router is mounted behind authentication of your own (a tower
    /// layer on it, a reverse proxy): every request is served, as the operator
    /// [`OWN_AUTH_OPERATOR`]. CSRF protection stays on.
    pub fn behind_own_auth(mut self) -> Self {
        self.own_auth = true;
        self
    }

    setters! {
        /// The secret the CSRF tokens are keyed with, instead of a random one per console: give
        /// replicas behind one load balancer the same secret (keep it out of the page and the
        /// logs).
        pub fn csrf_secret(secret: [u8; 32]) {
            self.secret = Some(secret);
        }

        /// How long a confirmation page's form stays valid (its CSRF token carries its issue
        /// time): [`DEFAULT_FORM_LIFETIME`] (1 hour) unless given. A `POST` with an older token
        /// is refused with `403` and a page that says it expired and to reload; nothing changes.
        /// [`Duration::ZERO`] expires every form (useful in tests only).
        pub fn form_lifetime(lifetime: Duration) {
            self.lifetime = lifetime;
        }
    }

    /// The router: mount it with [`Router::nest`] (or [`Router::merge`] at the root). Its
    /// state type `S` is whatever your router's is.
    ///
    /// # Errors
    /// [`ConsoleError::NoAuthorization`] if neither [`authorize`](Self::authorize) nor
    /// [`behind_own_auth`](Self::behind_own_auth) was called,
    /// [`ConsoleError::BothAuthorizations`] if both were.
    pub fn build<S>(self) -> Result<Router<S>, ConsoleError>
    where
        S: Clone + Send + Sync + 'static,
    {
        let auth = match (self.hook, self.own_auth) {
            (Some(hook), false) => Auth::Hook(hook),
            (None, true) => Auth::OwnAuth,
            (None, false) => return Err(ConsoleError::NoAuthorization),
            (Some(_), true) => return Err(ConsoleError::BothAuthorizations),
        };
        let secret = self.secret.unwrap_or_else(random_secret);
        // Requests are served on tasks of the server's, outside any scope: each runs in its
        // dispatcher's table prefix (which its replays and discards use), else in the one of
        // the scope the console is built in.
        let prefix = self
            .dispatcher
            .prefix
            .clone()
            .or_else(crate::store::TablePrefix::current);
        let inner = Arc::new(Inner {
            dispatcher: self.dispatcher,
            auth,
            secret,
            lifetime: self.lifetime,
        });
        Ok(Router::new()
            .route("/", get(overview::<DB>))
            .route("/messages", get(messages::<DB>))
            .route("/message", get(message::<DB>))
            .route("/replay", get(confirm_replay::<DB>).post(replay::<DB>))
            .route("/discard", get(confirm_discard::<DB>).post(discard::<DB>))
            .route(
                "/replay-all",
                get(confirm_replay_all::<DB>).post(replay_all::<DB>),
            )
            .route("/rejections", get(rejections::<DB>))
            .route("/rejection", get(rejections::rejection::<DB>))
            .route("/parked", get(parked::parked::<DB>))
            .route("/outbox", get(outbox::outbox::<DB>))
            .route("/rates", get(rates::rates::<DB>))
            .route("/style.css", get(style))
            .fallback(not_found)
            .method_not_allowed_fallback(wrong_method)
            .layer(axum::middleware::from_fn(
                move |request: axum::extract::Request, next: axum::middleware::Next| {
                    let prefix = prefix.clone();
                    async move { crate::store::within(prefix.as_ref(), next.run(request)).await }
                },
            ))
            .with_state(inner))
    }
}

enum Auth {
    Hook(Arc<Hook>),
    OwnAuth,
}

struct Inner<DB: ConsoleDatabase> {
    dispatcher: Arc<Dispatcher<DB>>,
    auth: Auth,
    secret: [u8; 32],
    lifetime: Duration,
}

/// Who asks, and where the console is mounted.
struct Ctx {
    operator: String,
    /// The prefix the router is nested under (`/ops`), or empty.
    base: String,
}

impl Ctx {
    /// The path of `page` (`/messages`) under the prefix.
    fn link(&self, page: &str) -> String {
        link(&self.base, page)
    }
}

/// The path of `page` (`/messages`) under the prefix `base` (`/ops`, or empty).
fn link(base: &str, page: &str) -> String {
    if page == "/" && !base.is_empty() {
        return base.to_owned();
    }
    format!("{base}{page}")
}

type Shared<DB> = State<Arc<Inner<DB>>>;

/// The one pool connection a request reads through (see [`Inner::conn`]).
type Conn<DB> = PoolConnection<DB>;

/// The prefix the router is nested under (`/ops`), or empty, from a request's extensions.
fn base_of(extensions: &Extensions) -> String {
    extensions
        .get::<NestedPath>()
        .map(|path| path.as_str().trim_end_matches('/').to_owned())
        .unwrap_or_default()
}

impl<DB: ConsoleDatabase> Inner<DB> {
    /// The operator, or the refusal's page.
    fn begin(&self, parts: &Parts) -> Result<Ctx, ErrorPage> {
        let base = base_of(&parts.extensions);
        let operator = match &self.auth {
            Auth::OwnAuth => OWN_AUTH_OPERATOR.to_owned(),
            Auth::Hook(hook) => match hook(parts) {
                Ok(operator) => operator,
                Err(Refusal::Unauthenticated { challenge }) => {
                    let mut problem = bare(
                        StatusCode::UNAUTHORIZED,
                        "Not signed in",
                        "This console needs you to authenticate.",
                    );
                    problem.challenge = HeaderValue::from_str(&challenge).ok();
                    return Err(problem);
                }
                Err(Refusal::Forbidden { reason }) => {
                    return Err(bare(
                        StatusCode::FORBIDDEN,
                        "Forbidden",
                        &format!("You may not use this console: {reason}"),
                    ));
                }
            },
        };
        Ok(Ctx { operator, base })
    }

    /// The request's connection, from the dispatcher's pool. A page reads through this one
    /// connection only, and an action gives it back before [`Dispatcher::replay`] or
    /// [`Dispatcher::discard`] take one of their own: no request holds a connection while it
    /// asks the pool for another. So a pool of one connection (the usual on SQLite) serves the
    /// console, and requests beyond the pool's size wait for a connection in turn (sqlx's pool
    /// is fair: first come, first served) rather than each holding one and waiting for a
    /// second until the pool's acquire timeout.
    async fn conn(&self) -> Result<Conn<DB>, ErrorPage> {
        self.dispatcher.pool().acquire().await.map_err(database)
    }

    /// The consumers that exist: those of the dispatcher's handlers and those with rows (read
    /// through `conn` unless `rows` are given).
    async fn consumers(
        &self,
        conn: &mut Conn<DB>,
        rows: Option<&[StatsRow]>,
    ) -> Result<BTreeSet<String>, ErrorPage> {
        let mut known: BTreeSet<String> = self
            .dispatcher
            .handlers()
            .into_iter()
            .map(|handler| handler.consumer.to_owned())
            .collect();
        let fetched;
        let rows = match rows {
            Some(rows) => rows,
            None => {
                fetched = conn.stats().await.map_err(database)?;
                &fetched
            }
        };
        known.extend(rows.iter().filter_map(|row| row.consumer.clone()));
        Ok(known)
    }

    /// `consumer` if it exists, else a 400 naming the known ones. Reads the statistics only
    /// when no handler of the dispatcher serves it.
    async fn check_consumer(&self, conn: &mut Conn<DB>, consumer: &str) -> Result<(), ErrorPage> {
        if self
            .dispatcher
            .handlers()
            .iter()
            .any(|handler| handler.consumer == consumer)
        {
            return Ok(());
        }
        let known = self.consumers(conn, None).await?;
        if known.contains(consumer) {
            return Ok(());
        }
        let list: Vec<&str> = known.iter().map(String::as_str).collect();
        Err(bad_request(&format!(
            "Unknown consumer “{consumer}”. Known consumers: {}.",
            if list.is_empty() {
                "none".to_owned()
            } else {
                list.join(", ")
            }
        )))
    }
}

// ----- Parameters -----

/// Query or form parameters, each at most once, only those a page expects.
struct Params(Vec<(String, String)>);

impl Params {
    /// Parses `text` (`a=1&b=2`), refusing names not in `allowed` and repeated names.
    fn parse(text: &[u8], allowed: &[&str]) -> Result<Self, ErrorPage> {
        let mut seen = Vec::<(String, String)>::new();
        for (name, value) in form_urlencoded::parse(text) {
            if !allowed.contains(&name.as_ref()) {
                return Err(bad_request(&format!(
                    "Unknown parameter “{name}”. Expected: {}.",
                    allowed.join(", ")
                )));
            }
            if seen.iter().any(|(other, _)| *other == name) {
                return Err(bad_request(&format!(
                    "Parameter “{name}” is given more than once."
                )));
            }
            seen.push((name.into_owned(), value.into_owned()));
        }
        Ok(Self(seen))
    }

    fn query(parts: &Parts, allowed: &[&str]) -> Result<Self, ErrorPage> {
        Self::parse(parts.uri.query().unwrap_or("").as_bytes(), allowed)
    }

    fn get(&self, name: &str) -> Option<&str> {
        self.0
            .iter()
            .find(|(other, _)| other == name)
            .map(|(_, value)| value.as_str())
    }

    /// A parameter that must be there and not be empty.
    fn required(&self, name: &str) -> Result<&str, ErrorPage> {
        match self.get(name) {
            Some(value) if !value.is_empty() => Ok(value),
            _ => Err(bad_request(&format!("Parameter “{name}” is required."))),
        }
    }

    /// `consumer`, checked to exist (through `conn`).
    async fn consumer<DB: ConsoleDatabase>(
        &self,
        inner: &Inner<DB>,
        conn: &mut Conn<DB>,
        required: bool,
    ) -> Result<Option<String>, ErrorPage> {
        let consumer = match self.get("consumer") {
            None | Some("") if !required => return Ok(None),
            _ => self.required("consumer")?,
        };
        if consumer.contains('\0') {
            return Err(bad_request("The consumer contains a NUL character."));
        }
        inner.check_consumer(conn, consumer).await?;
        Ok(Some(consumer.to_owned()))
    }

    /// A listing's filter: [`limit`](Self::limit), then the optional
    /// [`consumer`](Self::consumer).
    async fn listing<DB: ConsoleDatabase>(
        &self,
        inner: &Inner<DB>,
        conn: &mut Conn<DB>,
    ) -> Result<(u32, Option<String>), ErrorPage> {
        let limit = self.limit()?;
        Ok((limit, self.consumer(inner, conn, false).await?))
    }

    /// `key`: not empty, no NUL, at most [`MAX_KEY_BYTES`].
    fn key(&self) -> Result<String, ErrorPage> {
        let key = self.required("key")?;
        if key.contains('\0') {
            return Err(bad_request(
                "The key contains a NUL character: no message has such a key.",
            ));
        }
        if key.len() > MAX_KEY_BYTES {
            return Err(bad_request(&format!(
                "The key is {} bytes long; keys are at most {MAX_KEY_BYTES} bytes.",
                key.len()
            )));
        }
        Ok(key.to_owned())
    }

    /// `limit`: 1 to [`MAX_LIMIT`], default [`DEFAULT_LIMIT`].
    fn limit(&self) -> Result<u32, ErrorPage> {
        match self.get("limit") {
            None | Some("") => Ok(DEFAULT_LIMIT),
            Some(text) => match text.parse::<u32>() {
                Ok(limit) if (1..=MAX_LIMIT).contains(&limit) => Ok(limit),
                _ => Err(bad_request(&format!(
                    "Limit “{text}” is out of range: give a whole number from 1 to {MAX_LIMIT}."
                ))),
            },
        }
    }

    /// `status`: `failed`, `dead` or `parked`; absent: failed and dead.
    fn statuses(&self) -> Result<(&'static [Status], &'static str), ErrorPage> {
        match self.get("status") {
            None | Some("") => Ok((&[Status::Failed, Status::Dead], "")),
            Some("failed") => Ok((&[Status::Failed], "failed")),
            Some("dead") => Ok((&[Status::Dead], "dead")),
            Some("parked") => Ok((&[Status::Parked], "parked")),
            Some(other) => Err(bad_request(&format!(
                "Status “{other}” is not one the list shows: give failed, dead or parked \
                 (or nothing, for failed and dead)."
            ))),
        }
    }
}

// ----- Pages -----

async fn overview<DB: ConsoleDatabase>(State(inner): Shared<DB>, request: Request) -> Response {
    get_page(&inner, request, &[], async |ctx, _params| {
        let mut conn = inner.conn().await?;
        let rows = conn.stats().await.map_err(database)?;
        let consumers = inner.consumers(&mut conn, Some(&rows)).await?;
        let due = conn.retries_due().await.map_err(database)?;
        drop(conn);
        let now = now_secs();
        let mut body = String::from(
            "<h1>Overview</h1><table class=\"overview\"><thead><tr><th>consumer</th>",
        );
        for status in Status::ALL {
            let _ = write!(body, "<th class=\"num\">{status}</th>");
        }
        body.push_str(
            "<th class=\"num\">rejected</th><th>oldest failed</th><th>retries due</th>\
             <th>oldest dead</th><th>oldest parked</th></tr></thead><tbody>",
        );
        for consumer in &consumers {
            overview_row(&mut body, &ctx, consumer, &rows, &due, now);
        }
        if consumers.is_empty() {
            body.push_str("<tr><td colspan=\"12\" class=\"muted\">The inbox is empty and no handler is registered.</td></tr>");
        }
        body.push_str("</tbody></table>");
        overview_notes(&mut body, &ctx, &rows);
        Ok(layout(&ctx, StatusCode::OK, "Overview", &body))
    })
    .await
}

/// One consumer's row of the overview: its count per status (linked to its messages where
/// they keep their payload), its rejections, its oldest ages and its retries due.
fn overview_row(
    body: &mut String,
    ctx: &Ctx,
    consumer: &str,
    rows: &[StatsRow],
    due: &[RetryLag],
    now: i64,
) {
    let mine = || {
        rows.iter()
            .filter(move |row| row.consumer.as_deref() == Some(consumer))
    };
    let oldest = |status: Status| {
        mine()
            .find(|row| row.status == StatsStatus::Message(status))
            .and_then(|row| row.oldest.as_deref())
            .map_or_else(|| "—".to_owned(), |oldest| age(oldest, now))
    };
    let rejected: i64 = mine()
        .filter(|row| matches!(row.status, StatsStatus::Rejected(_)))
        .map(|row| row.count)
        .sum();
    let c = escape(consumer);
    let _ = write!(
        body,
        "<tr><th><a href=\"{}\">{c}</a></th>",
        escape(&format!(
            "{}?consumer={}",
            ctx.link("/messages"),
            encode(consumer)
        ))
    );
    for status in Status::ALL {
        let n: i64 = mine()
            .filter(|row| row.status == StatsStatus::Message(status))
            .map(|row| row.count)
            .sum();
        status_cell(body, ctx, consumer, status, n);
    }
    let _ = write!(
        body,
        "<td class=\"num\" data-consumer=\"{c}\" data-status=\"rejected\">{rejected}</td>\
         <td data-consumer=\"{c}\" data-oldest=\"failed\">{}</td>\
         <td data-consumer=\"{c}\" data-lag=\"retries\">{}</td>\
         <td data-consumer=\"{c}\" data-oldest=\"dead\">{}</td>\
         <td data-consumer=\"{c}\" data-oldest=\"parked\">{}</td></tr>",
        escape(&oldest(Status::Failed)),
        escape(
            &due.iter().find(|lag| lag.consumer == consumer).map_or_else(
                || "—".to_owned(),
                |lag| format!("{}, oldest due {}", lag.due, age(&lag.oldest_due, now))
            )
        ),
        escape(&oldest(Status::Dead)),
        escape(&oldest(Status::Parked)),
    );
}

/// The overview cell of `consumer`'s `n` messages in `status`: linked to their list when there
/// are some and their status keeps the payload.
fn status_cell(body: &mut String, ctx: &Ctx, consumer: &str, status: Status, n: i64) {
    let cell = if n > 0 && status.keeps_payload() {
        format!(
            "<a href=\"{}\">{n}</a>",
            escape(&format!(
                "{}?consumer={}&status={status}",
                ctx.link("/messages"),
                encode(consumer)
            ))
        )
    } else {
        n.to_string()
    };
    let _ = write!(
        body,
        "<td class=\"num\" data-consumer=\"{}\" data-status=\"{status}\">{cell}</td>",
        escape(consumer)
    );
}

/// The notes under the overview: rejections that name no consumer, and what the ages mean.
fn overview_notes(body: &mut String, ctx: &Ctx, rows: &[StatsRow]) {
    let unnamed: i64 = rows
        .iter()
        .filter(|row| row.consumer.is_none())
        .map(|row| row.count)
        .sum();
    if unnamed > 0 {
        let _ = write!(
            body,
            "<p class=\"notice\">{unnamed} rejected {} no consumer (malformed payloads \
                 and unknown message names): see <a href=\"{}\">rejections</a>.</p>",
            if unnamed == 1 {
                "delivery names"
            } else {
                "deliveries name"
            },
            escape(&ctx.link("/rejections"))
        );
    }
    let _ = write!(
        body,
        "<p class=\"muted\">Ages are measured from the first delivery of the oldest \
             message in that status; retries due are failed messages whose next attempt time has \
             passed and that no redelivery has claimed yet (with how long the oldest has been \
             due: how far retries lag); the \
             oldest parked one how long an aggregate has waited for a missing sequence \
             (see <a href=\"{}\">parked</a>). Counts are exact, read from the \
             <code>inbox_messages_console</code> index.</p>",
        escape(&ctx.link("/parked"))
    );
}

async fn messages<DB: ConsoleDatabase>(State(inner): Shared<DB>, request: Request) -> Response {
    get_page(
        &inner,
        request,
        &["consumer", "status", "limit"],
        async |ctx, params| {
            let mut conn = inner.conn().await?;
            let Filter {
                consumer,
                status,
                limit,
                rows,
            } = Filter::read(&inner, &mut conn, &params, false).await?;
            let known = inner.consumers(&mut conn, None).await?;
            drop(conn);
            let mut body = String::from("<h1>Failed and dead messages</h1>");
            let _ = write!(
                body,
                "<form class=\"filter\" method=\"get\" action=\"{}\">\
             <label>consumer<select name=\"consumer\"><option value=\"\">all</option>",
                escape(&ctx.link("/messages"))
            );
            for name in &known {
                let selected = if consumer.as_deref() == Some(name.as_str()) {
                    " selected"
                } else {
                    ""
                };
                let _ = write!(
                    body,
                    "<option value=\"{0}\"{selected}>{0}</option>",
                    escape(name)
                );
            }
            body.push_str("</select></label><label>status<select name=\"status\">");
            for (value, label) in [
                ("", "failed and dead"),
                ("failed", "failed"),
                ("dead", "dead"),
                ("parked", "parked"),
            ] {
                let selected = if value == status { " selected" } else { "" };
                let _ = write!(body, "<option value=\"{value}\"{selected}>{label}</option>");
            }
            let _ = write!(
                body,
                "</select></label><label>limit<input name=\"limit\" type=\"number\" min=\"1\" \
             max=\"{MAX_LIMIT}\" value=\"{limit}\"></label><button>Show</button></form>"
            );
            let _ = write!(
                body,
                "<form class=\"filter\" method=\"get\" action=\"{}\">\
             <label>consumer<input name=\"consumer\" required value=\"{}\"></label>\
             <label>key<input name=\"key\" required></label><button>Find by key</button></form>",
                escape(&ctx.link("/message")),
                escape(consumer.as_deref().unwrap_or(""))
            );
            let filter = filter_query(consumer.as_deref(), status, limit);
            let _ = write!(body, "<p>{}.</p>", shown(rows.len(), limit));
            if !rows.is_empty() && status != "parked" {
                let _ = write!(
                    body,
                    "<div class=\"actions\"><a href=\"{}\">Replay these {}…</a></div>",
                    escape(&format!("{}?{filter}", ctx.link("/replay-all"))),
                    rows.len()
                );
            }
            body.push_str(
                "<table class=\"messages\"><thead><tr><th>consumer</th><th>key</th><th>message</th>\
             <th>status</th><th class=\"num\">attempts</th><th>received</th><th>last error</th>\
             </tr></thead><tbody>",
            );
            for row in &rows {
                let _ = write!(
                    body,
                    "<tr><td>{}</td><td class=\"key\"><a href=\"{}\">{}</a></td><td>{}</td>\
                 <td class=\"status-{status}\">{status}</td><td class=\"num\">{}</td><td>{}</td>\
                 <td class=\"error\">{}</td></tr>",
                    escape(&row.consumer),
                    escape(&message_link(&ctx, "/message", row)),
                    escape(&row.message_key),
                    escape(&row.message_name),
                    row.attempts,
                    escape(&admin::utc_time(&row.received_at)),
                    escape(&cut(row.last_error.as_deref().unwrap_or(""), 200)),
                    status = row.status,
                );
            }
            body.push_str("</tbody></table>");
            Ok(layout(&ctx, StatusCode::OK, "Messages", &body))
        },
    )
    .await
}

async fn message<DB: ConsoleDatabase>(State(inner): Shared<DB>, request: Request) -> Response {
    get_page(&inner, request, &["consumer", "key"], async |ctx, params| {
        let row = target(&inner, &params).await?;
        let mut body = String::from("<h1>Message</h1>");
        describe_row(&mut body, &row, true);
        if matches!(row.status, Status::Failed | Status::Dead) {
            let _ = write!(
                body,
                "<div class=\"actions\"><a href=\"{}\" data-action=\"replay\">Replay…</a><a href=\"{}\" data-action=\"discard\">Discard…</a></div>",
                escape(&message_link(&ctx, "/replay", &row)),
                escape(&message_link(&ctx, "/discard", &row)),
            );
        }
        Ok(layout(&ctx, StatusCode::OK, "Message", &body))
    })
    .await
}

async fn confirm_replay<DB: ConsoleDatabase>(
    State(inner): Shared<DB>,
    request: Request,
) -> Response {
    confirm(&inner, request, Action::Replay).await
}

async fn confirm_discard<DB: ConsoleDatabase>(
    State(inner): Shared<DB>,
    request: Request,
) -> Response {
    confirm(&inner, request, Action::Discard).await
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Action {
    Replay,
    Discard,
}

impl Action {
    fn verb(self) -> &'static str {
        match self {
            Action::Replay => "replay",
            Action::Discard => "discard",
        }
    }
}

/// The confirmation page of one action on one message.
async fn confirm<DB: ConsoleDatabase>(
    inner: &Inner<DB>,
    request: Request,
    action: Action,
) -> Response {
    get_page(inner, request, &["consumer", "key"], async |ctx, params| {
        let row = target(inner, &params).await?;
        actionable(&row, action)?;
        let verb = action.verb();
        let mut body = format!("<h1>Confirm: {verb} this message?</h1>");
        body.push_str(match action {
            Action::Replay => {
                "<p class=\"notice\">Replaying runs the registered handler once on the stored \
                 payload, through the same claim: if it succeeds, the message becomes processed.</p>"
            }
            Action::Discard => {
                "<p class=\"notice bad\">Discarding drops the payload for good: the message will \
                 never run, and its redeliveries stay blocked.</p>"
            }
        });
        describe_row(&mut body, &row, false);
        let _ = write!(
            body,
            "<form method=\"post\" action=\"{}\"><input type=\"hidden\" name=\"consumer\" \
             value=\"{}\"><input type=\"hidden\" name=\"key\" value=\"{}\">{}\
             <div class=\"actions\"><button data-action=\"{verb}\"{}>Yes, {verb}</button><a href=\"{}\">Cancel</a></div></form>",
            escape(&ctx.link(&format!("/{verb}"))),
            escape(&row.consumer),
            escape(&row.message_key),
            csrf_field(inner, &ctx),
            if action == Action::Discard {
                " class=\"danger\""
            } else {
                ""
            },
            escape(&message_link(&ctx, "/message", &row)),
        );
        Ok(layout(&ctx, StatusCode::OK, "Confirm", &body))
    })
    .await
}

async fn replay<DB: ConsoleDatabase>(State(inner): Shared<DB>, request: Request) -> Response {
    act(&inner, request, Action::Replay).await
}

async fn discard<DB: ConsoleDatabase>(State(inner): Shared<DB>, request: Request) -> Response {
    act(&inner, request, Action::Discard).await
}

/// A confirmed action on one message.
async fn act<DB: ConsoleDatabase>(inner: &Inner<DB>, request: Request, action: Action) -> Response {
    post_page(inner, request, MAX_FORM_BYTES, &["consumer", "key", "csrf"], async |ctx, params| {
        // The connection `target` reads through is back in the pool before the action takes
        // its own.
        let row = target(inner, &params).await?;
        actionable(&row, action)?;
        let (consumer, key) = (row.consumer.clone(), row.message_key.clone());
        let (status, text) = match action {
            Action::Replay => match inner.dispatcher.replay(&consumer, &key).await {
                Ok(outcome) => {
                    let (text, ok) = describe(&outcome);
                    (if ok { "ok" } else { "bad" }, text)
                }
                Err(error) => ("bad", error.to_string()),
            },
            Action::Discard => match inner.dispatcher.discard(&consumer, &key).await {
                Ok(true) => ("ok", "discarded".to_owned()),
                Ok(false) => (
                    "bad",
                    "not discarded: the message is no longer failed or dead".to_owned(),
                ),
                Err(error) => ("bad", format!("database error: {error}")),
            },
        };
        tracing::info!(
            target: "inbox_runtime::ops::console",
            operator = ?ctx.operator,
            action = action.verb(),
            consumer = ?consumer,
            key = ?key,
            result = %text,
            "console: {}",
            action.verb()
        );
        let verb = action.verb();
        let mut body = format!(
            "<h1>{}</h1><p class=\"notice {status}\" data-result=\"{status}\">{}/{}: {}</p>",
            if action == Action::Replay {
                "Replay"
            } else {
                "Discard"
            },
            escape(&consumer),
            escape(&key),
            escape(&text)
        );
        if let Ok(Some(after)) = admin::show(inner.dispatcher.pool(), &consumer, &key).await {
            describe_row(&mut body, &after, false);
        }
        let _ = write!(
            body,
            "<p><a href=\"{}\">Back to the message</a> · <a href=\"{}\">Failed and dead messages</a></p>",
            escape(&message_link(&ctx, "/message", &row)),
            escape(&ctx.link("/messages")),
        );
        let code = if status == "ok" {
            StatusCode::OK
        } else {
            StatusCode::CONFLICT
        };
        Ok(layout(&ctx, code, &format!("{verb} done"), &body))
    })
    .await
}

async fn confirm_replay_all<DB: ConsoleDatabase>(
    State(inner): Shared<DB>,
    request: Request,
) -> Response {
    get_page(
        &inner,
        request,
        &["consumer", "status", "limit"],
        async |ctx, params| {
            let Filter {
                consumer,
                status,
                limit,
                rows,
            } = Filter::read(&inner, &mut inner.conn().await?, &params, true).await?;
            let mut body = format!(
                "<h1>Confirm: replay {} messages?</h1><p class=\"notice\">Each of the {} {} \
             messages{} below (oldest first, at most {limit}) is replayed once with its \
             registered handler: exactly these, also if others fail meanwhile (one that is \
             no longer failed or dead by then is skipped).</p><ul>",
                rows.len(),
                rows.len(),
                if status.is_empty() {
                    "failed and dead"
                } else {
                    status
                },
                consumer
                    .as_deref()
                    .map(|c| format!(" of consumer {}", escape(c)))
                    .unwrap_or_default(),
            );
            for row in &rows {
                let _ = write!(
                    body,
                    "<li>{}/<span class=\"key\">{}</span> ({})</li>",
                    escape(&row.consumer),
                    escape(&row.message_key),
                    row.status
                );
            }
            let items: Vec<String> = rows
                .iter()
                .map(|row| {
                    format!(
                        "{}.{}",
                        hex::encode(&row.consumer),
                        hex::encode(&row.message_key)
                    )
                })
                .collect();
            let _ = write!(
                body,
                "</ul><form method=\"post\" action=\"{}\"><input type=\"hidden\" name=\"items\" \
             value=\"{}\">{}<div class=\"actions\">\
             <button>Yes, replay them</button><a href=\"{}\">Cancel</a></div></form>",
                escape(&ctx.link("/replay-all")),
                items.join(","),
                csrf_field(&inner, &ctx),
                escape(&format!(
                    "{}?{}",
                    ctx.link("/messages"),
                    filter_query(consumer.as_deref(), status, limit)
                )),
            );
            Ok(layout(&ctx, StatusCode::OK, "Confirm", &body))
        },
    )
    .await
}

/// The largest form body of a bulk replay: the confirmed messages travel in it, hex-encoded
/// (at most [`MAX_LIMIT`] consumers of 255 bytes and keys of [`MAX_KEY_BYTES`]): 2 MiB.
const MAX_BULK_FORM_BYTES: usize = 2 * 1024 * 1024;

/// The `items` of a bulk replay's form: `hex(consumer).hex(key)`, comma-separated, each
/// consumer known and each key valid, at most [`MAX_LIMIT`].
async fn bulk_items<DB: ConsoleDatabase>(
    inner: &Inner<DB>,
    conn: &mut Conn<DB>,
    params: &Params,
) -> Result<Vec<(String, String)>, ErrorPage> {
    let text = params.required("items")?;
    let mut items = Vec::new();
    for item in text.split(',') {
        let decode = |part: &str| {
            hex::decode(part)
                .ok()
                .and_then(|bytes| String::from_utf8(bytes).ok())
                .filter(|text| !text.is_empty() && !text.contains('\0'))
        };
        let Some((consumer, key)) = item
            .split_once('.')
            .and_then(|(consumer, key)| Some((decode(consumer)?, decode(key)?)))
        else {
            return Err(bad_request(
                "The confirmed messages (“items”) are not as the confirmation page sent them: \
                 open it again.",
            ));
        };
        if key.len() > MAX_KEY_BYTES {
            return Err(bad_request(&format!(
                "A key is {} bytes long; keys are at most {MAX_KEY_BYTES} bytes.",
                key.len()
            )));
        }
        items.push((consumer, key));
    }
    if items.len() > MAX_LIMIT as usize {
        return Err(bad_request(&format!(
            "{} messages to replay: at most {MAX_LIMIT} at once.",
            items.len()
        )));
    }
    let consumers: BTreeSet<&str> = items.iter().map(|(c, _)| c.as_str()).collect();
    for consumer in consumers {
        inner.check_consumer(conn, consumer).await?;
    }
    Ok(items)
}

async fn replay_all<DB: ConsoleDatabase>(State(inner): Shared<DB>, request: Request) -> Response {
    post_page(
        &inner,
        request,
        MAX_BULK_FORM_BYTES,
        &["items", "csrf"],
        async |ctx, params| {
            let items = bulk_items(&inner, &mut inner.conn().await?, &params).await?;
            let mut table = String::new();
            let (mut succeeded, mut failed) = (0_u32, 0_u32);
            for (consumer, key) in &items {
                // Its own connection, back in the pool before the replay takes one.
                let current = inner
                    .conn()
                    .await?
                    .fetch_message(consumer, key)
                    .await
                    .map_err(database)?;
                let (text, ok) = match current {
                    None => ("skipped: no such message any more".to_owned(), false),
                    Some(row) if !matches!(row.status, Status::Failed | Status::Dead) => (
                        format!("skipped: it is {} now, nothing to replay", row.status),
                        false,
                    ),
                    Some(_) => match inner.dispatcher.replay(consumer, key).await {
                        Ok(outcome) => describe(&outcome),
                        Err(error) => (error.to_string(), false),
                    },
                };
                if ok {
                    succeeded += 1;
                } else {
                    failed += 1;
                }
                tracing::info!(
                    target: "inbox_runtime::ops::console",
                    operator = ?ctx.operator,
                    action = "replay",
                    consumer = ?consumer,
                    key = ?key,
                    result = %text,
                    "console: replay (bulk)"
                );
                let _ = write!(
                    table,
                    "<tr><td>{}</td><td class=\"key\"><a href=\"{}\">{}</a></td><td>{}</td></tr>",
                    escape(consumer),
                    escape(&format!(
                        "{}?consumer={}&key={}",
                        ctx.link("/message"),
                        encode(consumer),
                        encode(key)
                    )),
                    escape(key),
                    escape(&text)
                );
            }
            let body = format!(
                "<h1>Bulk replay</h1><p class=\"notice {}\" data-result=\"bulk\">Replayed {}: \
             {succeeded} succeeded, {failed} did not.</p><table><thead><tr><th>consumer</th>\
             <th>key</th><th>result</th></tr></thead><tbody>{table}</tbody></table>",
                if failed == 0 { "ok" } else { "bad" },
                items.len()
            );
            Ok(layout(&ctx, StatusCode::OK, "Bulk replay", &body))
        },
    )
    .await
}

/// The list's filter (`consumer`, `status`, `limit`) and the rows it selects: what the list
/// shows and what a bulk replay offers.
struct Filter {
    consumer: Option<String>,
    /// `failed`, `dead`, `parked`, or empty for failed and dead.
    status: &'static str,
    limit: u32,
    rows: Vec<StoredMessage>,
}

impl Filter {
    /// Reads the filter from `params` (for a bulk replay: not parked) and lists its rows.
    async fn read<DB: ConsoleDatabase>(
        inner: &Inner<DB>,
        conn: &mut Conn<DB>,
        params: &Params,
        bulk: bool,
    ) -> Result<Self, ErrorPage> {
        let (statuses, status) = if bulk {
            bulk_statuses(params)?
        } else {
            params.statuses()?
        };
        let (limit, consumer) = params.listing(inner, conn).await?;
        let rows = conn
            .list_messages(consumer.as_deref(), statuses, i64::from(limit))
            .await
            .map_err(database)?;
        Ok(Self {
            consumer,
            status,
            limit,
            rows,
        })
    }
}

async fn rejections<DB: ConsoleDatabase>(State(inner): Shared<DB>, request: Request) -> Response {
    get_page(
        &inner,
        request,
        &["consumer", "reason", "limit"],
        async |ctx, params| {
            let mut conn = inner.conn().await?;
            let rows = conn.stats().await.map_err(database)?;
            let now = now_secs();
            let mut body = String::from(
                "<h1>Rejected deliveries</h1><p class=\"muted\">Deliveries the dispatcher refused \
             and recorded in <code>inbox_rejections</code>: the same key with another payload \
             (conflict), payloads that do not decode (malformed), names no handler serves \
             (unknown_message), bad keys (invalid_key), payloads over the limit (too_large).</p>\
             <table class=\"rejections\"><thead><tr><th>consumer</th><th>reason</th>\
             <th class=\"num\">count</th><th>oldest</th></tr></thead><tbody>",
            );
            let mut any = false;
            for row in &rows {
                let StatsStatus::Rejected(reason) = row.status else {
                    continue;
                };
                any = true;
                let consumer = row.consumer.as_deref().unwrap_or("(none)");
                let _ = write!(
                    body,
                    "<tr><td>{c}</td><td>{r}</td><td class=\"num\" data-consumer=\"{c}\" \
                 data-reason=\"{r}\">{}</td><td>{}</td></tr>",
                    row.count,
                    escape(
                        &row.oldest
                            .as_deref()
                            .map_or_else(|| "—".to_owned(), |oldest| age(oldest, now))
                    ),
                    c = escape(consumer),
                    r = reason_str(reason),
                );
            }
            if !any {
                body.push_str(
                    "<tr><td colspan=\"4\" class=\"muted\">No rejected deliveries.</td></tr>",
                );
            }
            body.push_str("</tbody></table>");
            rejections::rejection_list(&inner, &mut conn, &ctx, &params, &mut body).await?;
            Ok(layout(&ctx, StatusCode::OK, "Rejections", &body))
        },
    )
    .await
}

async fn style() -> Response {
    let mut response = Response::new(Body::from(STYLE));
    response.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("text/css; charset=utf-8"),
    );
    response
}

/// A page of the console with a trailing slash (`/ops/messages/`) is redirected to itself
/// without it (relatively, so under any prefix); anything else is a 404.
async fn not_found(request: Request) -> Response {
    let path = request.uri().path();
    let segment = path
        .strip_suffix('/')
        .and_then(|path| path.rsplit('/').next())
        .filter(|segment| !segment.is_empty() && !segment.contains(['.', '\\']));
    if let Some(segment) = segment {
        let location = match request.uri().query() {
            Some(query) => format!("../{segment}?{query}"),
            None => format!("../{segment}"),
        };
        if let Ok(location) = HeaderValue::from_str(&location) {
            let mut response = Response::new(Body::empty());
            *response.status_mut() = StatusCode::PERMANENT_REDIRECT;
            response.headers_mut().insert(header::LOCATION, location);
            return response;
        }
    }
    bare(
        StatusCode::NOT_FOUND,
        "Not found",
        "The console has no such page.",
    )
    .response(&base_of(request.extensions()))
}

async fn wrong_method(request: Request) -> Response {
    let method = request.method().clone();
    bare(
        StatusCode::METHOD_NOT_ALLOWED,
        "Method not allowed",
        &format!(
            "This page does not take {method}: pages are read with GET, and actions are \
             sent with POST from their confirmation page."
        ),
    )
    .response(&base_of(request.extensions()))
}

// ----- Helpers -----

/// Serves a page that reads: authorizes the request (`Inner::begin`), parses its query string
/// allowing only the parameters `allowed` (others are refused with 400), then runs `page` with
/// the request's context and parameters; an [`ErrorPage`] from any step becomes its response.
async fn get_page<DB: ConsoleDatabase>(
    inner: &Inner<DB>,
    request: Request,
    allowed: &[&str],
    page: impl AsyncFnOnce(Ctx, Params) -> Result<Response, ErrorPage>,
) -> Response {
    let (parts, _) = request.into_parts();
    run(&parts, async {
        let ctx = inner.begin(&parts)?;
        let params = Params::query(&parts, allowed)?;
        page(ctx, params).await
    })
    .await
}

/// Serves an action posted by a form: authorizes the request, reads and checks its
/// `application/x-www-form-urlencoded` body (at most `max_bytes` bytes, only the fields
/// `allowed`, a valid CSRF token: [`form`]), then runs `page`; an [`ErrorPage`] from any step
/// becomes its response.
async fn post_page<DB: ConsoleDatabase>(
    inner: &Inner<DB>,
    request: Request,
    max_bytes: usize,
    allowed: &[&str],
    page: impl AsyncFnOnce(Ctx, Params) -> Result<Response, ErrorPage>,
) -> Response {
    let (parts, body) = request.into_parts();
    run(&parts, async {
        let ctx = inner.begin(&parts)?;
        let params = form(inner, &ctx, &parts, body, max_bytes, allowed).await?;
        page(ctx, params).await
    })
    .await
}

/// Runs a page of the request `parts`, turning its early refusal into its response.
async fn run(parts: &Parts, page: impl Future<Output = Result<Response, ErrorPage>>) -> Response {
    page.await
        .unwrap_or_else(|problem| problem.response(&base_of(&parts.extensions)))
}

/// Why a request was not served: its status, a title and a message for the page, and the
/// `WWW-Authenticate` challenge of a 401.
struct ErrorPage {
    status: StatusCode,
    title: &'static str,
    message: String,
    challenge: Option<HeaderValue>,
}

impl ErrorPage {
    /// The page that says so, styled as the others (`base`: the router's prefix, or empty),
    /// without an operator's name (a refused request has none).
    fn response(self, base: &str) -> Response {
        let body = format!(
            "<h1>{}</h1>{}",
            escape(self.title),
            paragraph(&self.message)
        );
        let mut response = document(base, None, self.status, self.title, &body);
        if let Some(challenge) = self.challenge {
            response
                .headers_mut()
                .insert(header::WWW_AUTHENTICATE, challenge);
        }
        response
    }
}

fn reason_str(reason: RejectionReason) -> &'static str {
    reason.as_str()
}

/// The filter of the list and the bulk replay, for a bulk replay: failed and dead only.
fn bulk_statuses(params: &Params) -> Result<(&'static [Status], &'static str), ErrorPage> {
    let (statuses, status) = params.statuses()?;
    if status == "parked" {
        return Err(bad_request(
            "Parked messages wait for their predecessor and are not replayed by hand: \
             give failed or dead.",
        ));
    }
    Ok((statuses, status))
}

/// The message `consumer` and `key` of `params` name (the consumer checked to exist, the key
/// valid), or a 404; read through one connection, back in the pool on return.
async fn target<DB: ConsoleDatabase>(
    inner: &Inner<DB>,
    params: &Params,
) -> Result<StoredMessage, ErrorPage> {
    let mut conn = inner.conn().await?;
    let consumer = params
        .consumer(inner, &mut conn, true)
        .await?
        .unwrap_or_default();
    let key = params.key()?;
    conn.fetch_message(&consumer, &key)
        .await
        .map_err(database)?
        .ok_or_else(|| {
            bare(
                StatusCode::NOT_FOUND,
                "No such message",
                &format!("Consumer “{consumer}” has no message with key “{key}”."),
            )
        })
}

/// A 409 unless `row` is failed or dead.
fn actionable(row: &StoredMessage, action: Action) -> Result<(), ErrorPage> {
    if matches!(row.status, Status::Failed | Status::Dead) {
        return Ok(());
    }
    Err(bare(
        StatusCode::CONFLICT,
        "Nothing to do",
        &format!(
            "The message is {}: only failed and dead messages can be {}ed. Nothing was changed.",
            row.status,
            if action == Action::Replay {
                "replay"
            } else {
                "discard"
            }
        ),
    ))
}

/// How one replay ended, and whether it succeeded (processed, or processed meanwhile).
fn describe(outcome: &ConsumerOutcome) -> (String, bool) {
    match &outcome.result {
        Ok(Outcome::Processed(())) => ("processed".into(), true),
        Ok(Outcome::Duplicate) => ("duplicate (processed meanwhile)".into(), true),
        Ok(other) => (other.kind().into(), false),
        Err(Error::Handler(failure)) => (format!("failed again: {failure}"), false),
        Err(error) => (error.to_string(), false),
    }
}

/// The definition list of one row (the payload with `payload`).
fn describe_row(body: &mut String, row: &StoredMessage, payload: bool) {
    let opt = |value: Option<&str>| value.map_or_else(|| "—".to_owned(), admin::utc_time);
    let _ = write!(
        body,
        "<dl><dt>consumer</dt><dd data-field=\"consumer\">{}</dd>\
         <dt>key</dt><dd class=\"key\" data-field=\"key\">{}</dd>\
         <dt>message</dt><dd>{}</dd>\
         <dt>status</dt><dd class=\"status-{status}\" data-field=\"status\">{status}</dd>\
         <dt>attempts</dt><dd data-field=\"attempts\">{}</dd>\
         <dt>received</dt><dd>{}</dd><dt>processed</dt><dd>{}</dd>\
         <dt>next attempt</dt><dd>{}</dd><dt>source</dt><dd>{}</dd>",
        escape(&row.consumer),
        escape(&row.message_key),
        escape(&row.message_name),
        row.attempts,
        escape(&admin::utc_time(&row.received_at)),
        escape(&opt(row.processed_at.as_deref())),
        // Only a failed message is retried; a dead one keeps the time its last failure set.
        escape(&opt(row
            .next_attempt_at
            .as_deref()
            .filter(|_| row.status == Status::Failed))),
        escape(row.source.as_deref().unwrap_or("—")),
        status = row.status,
    );
    if let Some(aggregate) = &row.aggregate_id {
        let _ = write!(
            body,
            "<dt>aggregate</dt><dd>{} #{}</dd>",
            escape(aggregate),
            row.sequence
                .map_or_else(|| "—".to_owned(), |s| s.to_string())
        );
    }
    let _ = write!(
        body,
        "<dt>payload hash</dt><dd class=\"key\">{}</dd></dl>",
        escape(&row.payload_hash)
    );
    if let Some(error) = &row.last_error {
        let _ = write!(
            body,
            "<h2>Last error</h2><pre data-field=\"last_error\">{}</pre>",
            escape(error)
        );
    }
    if payload {
        match &row.payload {
            Some(bytes) => {
                let (text, note) = pretty(bytes);
                let _ = write!(
                    body,
                    "<h2>Payload{note}</h2><pre data-field=\"payload\">{}</pre>",
                    escape(&text)
                );
            }
            None => body.push_str("<h2>Payload</h2><p class=\"muted\">Not kept.</p>"),
        }
    }
}

/// The payload pretty-printed when it is JSON, else as text (invalid UTF-8 replaced), with a
/// note for the heading.
fn pretty(bytes: &[u8]) -> (String, &'static str) {
    match serde_json::from_slice::<serde_json::Value>(bytes) {
        Ok(value) => (
            serde_json::to_string_pretty(&value)
                .unwrap_or_else(|_| String::from_utf8_lossy(bytes).into_owned()),
            " (JSON)",
        ),
        Err(_) => (
            String::from_utf8_lossy(bytes).into_owned(),
            " (not JSON: shown as text)",
        ),
    }
}

/// The link to `page` of one message (`?consumer=…&key=…`, percent-encoded).
fn message_link(ctx: &Ctx, page: &str, row: &StoredMessage) -> String {
    format!(
        "{}?consumer={}&key={}",
        ctx.link(page),
        encode(&row.consumer),
        encode(&row.message_key)
    )
}

/// The list's filter as a query string.
fn filter_query(consumer: Option<&str>, status: &str, limit: u32) -> String {
    let mut query = form_urlencoded::Serializer::new(String::new());
    if let Some(consumer) = consumer {
        query.append_pair("consumer", consumer);
    }
    if !status.is_empty() {
        query.append_pair("status", status);
    }
    query.append_pair("limit", &limit.to_string());
    query.finish()
}

/// `value` percent-encoded for a query string.
fn encode(value: &str) -> String {
    form_urlencoded::byte_serialize(value.as_bytes()).collect()
}

/// `5 shown`, with `(the limit: there may be more)` when `n` is the limit.
fn shown(n: usize, limit: u32) -> String {
    if n as u64 == u64::from(limit) {
        format!("{n} shown (the limit: there may be more)")
    } else {
        format!("{n} shown")
    }
}

/// `text` cut to `max` characters, with an ellipsis when cut.
fn cut(text: &str, max: usize) -> String {
    match text.char_indices().nth(max) {
        Some((at, _)) => format!("{}…", &text[..at]),
        None => text.to_owned(),
    }
}

fn now_secs() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| i64::try_from(d.as_secs()).unwrap_or(i64::MAX))
}

/// A database time with its age: `2026-05-21 10:04:31 UTC (3h 2m 5s ago)`.
fn age(time: &str, now: i64) -> String {
    match admin::parse_time(time) {
        Some(at) => {
            let ago = u64::try_from(now.saturating_sub(at)).unwrap_or(0);
            format!(
                "{} ({} ago)",
                admin::utc_time(time),
                admin::format_skew(std::time::Duration::from_secs(ago))
            )
        }
        None => admin::utc_time(time),
    }
}

/// `text` escaped for HTML text and double- or single-quoted attribute values: `&`, `<`, `>`,
/// `"` and `'` as character references, and NUL as U+FFFD (which HTML parsers put there
/// anyway).
pub(crate) fn escape(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for c in text.chars() {
        match c {
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '"' => out.push_str("&quot;"),
            '\'' => out.push_str("&#39;"),
            '\0' => out.push('\u{FFFD}'),
            c => out.push(c),
        }
    }
    out
}

fn paragraph(text: &str) -> String {
    format!("<p class=\"notice bad\" data-error>{}</p>", escape(text))
}

/// A page around `body`, with the navigation and the operator's name.
fn layout(ctx: &Ctx, status: StatusCode, title: &str, body: &str) -> Response {
    document(&ctx.base, Some(&ctx.operator), status, title, body)
}

/// A page of the console under the prefix `base`: the stylesheet, the navigation, the
/// operator's name if known, and `body`. Every page, error pages included, is one.
fn document(
    base: &str,
    operator: Option<&str>,
    status: StatusCode,
    title: &str,
    body: &str,
) -> Response {
    let html = format!(
        "<!doctype html><html lang=\"en\"><head><meta charset=\"utf-8\">\
         <meta name=\"viewport\" content=\"width=device-width, initial-scale=1\">\
         <title>{} · inbox console</title><link rel=\"stylesheet\" href=\"{}\"></head><body>\
         <header><span class=\"brand\">inbox console</span><nav><a href=\"{}\">Overview</a>\
         <a href=\"{}\">Failed and dead</a><a href=\"{}\">Rejections</a>\
         <a href=\"{}\">Parked</a><a href=\"{}\">Outbox</a><a href=\"{}\">Rates</a></nav>\
         {}</header><main>{body}</main></body></html>",
        escape(title),
        escape(&link(base, "/style.css")),
        escape(&link(base, "/")),
        escape(&link(base, "/messages")),
        escape(&link(base, "/rejections")),
        escape(&link(base, "/parked")),
        escape(&link(base, "/outbox")),
        escape(&link(base, "/rates")),
        operator.map_or_else(String::new, |operator| format!(
            "<span class=\"operator\">{}</span>",
            escape(operator)
        )),
    );
    html_response(status, html)
}

fn bare(status: StatusCode, title: &'static str, message: &str) -> ErrorPage {
    ErrorPage {
        status,
        title,
        message: message.to_owned(),
        challenge: None,
    }
}

fn bad_request(message: &str) -> ErrorPage {
    bare(StatusCode::BAD_REQUEST, "Bad request", message)
}

fn database(error: sqlx::Error) -> ErrorPage {
    tracing::error!(target: "inbox_runtime::ops::console", %error, "console: database error");
    bare(
        StatusCode::SERVICE_UNAVAILABLE,
        "Database error",
        &format!("The inbox's database failed: {error}"),
    )
}

fn html_response(status: StatusCode, html: String) -> Response {
    let mut response = Response::new(Body::from(html));
    *response.status_mut() = status;
    let headers = response.headers_mut();
    headers.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("text/html; charset=utf-8"),
    );
    headers.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
    headers.insert(header::X_FRAME_OPTIONS, HeaderValue::from_static("DENY"));
    headers.insert(
        header::X_CONTENT_TYPE_OPTIONS,
        HeaderValue::from_static("nosniff"),
    );
    headers.insert(
        header::CONTENT_SECURITY_POLICY,
        HeaderValue::from_static(
            "default-src 'none'; style-src 'self'; form-action 'self'; frame-ancestors 'none'; \
             base-uri 'none'",
        ),
    );
    response
}

#[cfg(test)]
mod tests {
    use super::{cut, escape};

    #[test]
    fn escapes_every_special_character() {
        assert_eq!(
            escape("<script>alert(\"x\" + 'y')</script> & \0 ü"),
            "&lt;script&gt;alert(&quot;x&quot; + &#39;y&#39;)&lt;/script&gt; &amp; \u{FFFD} ü"
        );
        assert_eq!(escape("plain"), "plain");
    }

    #[test]
    fn cuts_on_characters() {
        assert_eq!(cut("äöü", 2), "äö…");
        assert_eq!(cut("äöü", 3), "äöü");
    }
}
