//! # inbox-runtime
//!
//! Effectively-once message processing for Rust services on PostgreSQL, SQLite and
//! MySQL/MariaDB: the **transactional inbox**.
//!
//! Brokers deliver at least once: after a crash, a lost ack, a rebalance or a producer retry the
//! same message comes again. A handler annotated with [`#[idempotent]`](macro@idempotent) applies
//! its effect exactly once anyway. Its message's idempotency key is *claimed* in the
//! `inbox_messages` table in the **same database transaction** as the handler's own writes:
//!
//! ```text
//! BEGIN
//!   INSERT INTO inbox_messages (consumer, message_key, payload_hash, …) VALUES (…)
//!     ON CONFLICT (consumer, message_key) DO NOTHING RETURNING 1      -- the claim, first
//!   -- no row: the key is taken → compare fingerprints → ROLLBACK → Duplicate or Conflict
//!   <the handler body, on the same transaction>
//! COMMIT                          -- only now may the source ack the delivery
//! ```
//!
//! A redelivery finds the key claimed and becomes a no-op ([`Outcome::Duplicate`]). A handler
//! error rolls back claim and effect together, so the redelivery runs it again. The same key
//! with a *different* payload is a [`Conflict`], never a duplicate.
//!
//! **What this covers**: writes the handler makes through the connection it is given, in the
//! same database as the inbox. **What it does not**: calls to the outside world from the handler
//! (HTTP, e-mail, another database) — they can run again when the transaction rolls back or the
//! commit's answer is lost; give those their own idempotency keys.
//!
//! ## Example
//!
//! ```no_run
//! use inbox_runtime::{idempotent, Message, Outcome};
//!
//! #[derive(Clone, serde::Serialize, serde::Deserialize, Message)]
//! #[message(name = "payments.captured")]
//! struct PaymentCaptured {
//!     #[message(key)]
//!     event_id: uuid::Uuid,
//!     account_id: String,
//!     amount_cents: i64,
//! }
//!
//! /// Credits the captured amount to the account.
//! #[idempotent(consumer = "ledger")]
//! async fn credit(conn: &mut sqlx::PgConnection, msg: PaymentCaptured) -> Result<(), sqlx::Error> {
//!     sqlx::query("UPDATE accounts SET balance = balance + $1 WHERE id = $2")
//!         .bind(msg.amount_cents)
//!         .bind(&msg.account_id)
//!         .execute(conn)
//!         .await?;
//!     Ok(())
//! }
//!
//! # async fn demo(pool: sqlx::PgPool, msg: PaymentCaptured) -> Result<(), Box<dyn std::error::Error>> {
//! inbox_runtime::migrate(&pool).await?;
//! let mut conn = pool.acquire().await?;
//! match credit(&mut conn, msg.clone()).await? {
//!     Outcome::Processed(()) => println!("credited"),
//!     Outcome::Duplicate => println!("already credited"),
//!     _ => {}
//! }
//! // The same message again is a duplicate: the account is credited once.
//! assert!(credit(&mut conn, msg).await?.is_duplicate());
//! # Ok(()) }
//! ```
//!
//! ## How a delivery flows, and where each capability plugs in
//!
//! ```text
//! source ──► worker ──► dispatcher ──► protocol ──► store (PostgreSQL | SQLite | MySQL)
//! HTTP request, relay, custom code ──► ClaimSession ──┘
//! handler ──► Outbox::publish (same transaction) ──► inbox_outbox ──► Relay ──► Sink (broker)
//! ```
//!
//! * A [`source`] yields deliveries ([`Envelope`]: message name, payload bytes, source metadata)
//!   and settles each (ack, requeue, reject) only when told.
//! * The [`Worker`] runs deliveries with bounded concurrency, one at a time per ordering key,
//!   and settles each after its transaction committed ([`settlement_for`]).
//! * The [`Dispatcher`] decodes a payload once, routes it to every consumer registered for its
//!   name (`inventory`, or [`Dispatcher::from_handlers`]), and runs each through the protocol,
//!   alone or in a batch; its [`TransactionHook`]s run inside each claim's transaction (before
//!   `COMMIT`) and after it.
//! * The protocol owns the rules: the claim as the first statement, one decision function for a
//!   key already taken (duplicate, conflict, dead, stale, parked, or take it over), the check
//!   before `COMMIT`, and the failure record after a rollback. `#[idempotent]` handlers,
//!   batches, replays and parked successors are drivers of it; [`ClaimSession`] is its public
//!   face for work that is not a message handler.
//! * The [`outbox`] publishes from inside the handler's transaction: [`outbox::Outbox::publish`]
//!   writes a row with a stable message id, and an [`outbox::Relay`] sends committed rows to a
//!   [`sink::Sink`] (NATS JetStream, or memory) and marks them sent.
//! * A store implements the statements behind small capability traits ([`ClaimStore`],
//!   [`OrderingStore`], [`AdminStore`], [`OutboxStore`]) in its backend's SQL dialect; schema
//!   migrations come per [`Component`].
//!
//! ## Calling a handler on a connection already inside a transaction
//!
//! (A transaction opened through sqlx: `conn.begin()`, `pool.begin()`. One opened by sending
//! `BEGIN` as a statement is invisible to sqlx: the handler would then send its own `BEGIN`, and
//! its `COMMIT` would commit yours. Use sqlx's transactions.)
//!
//! The claim and the body then run in a **savepoint** of the caller's transaction (sqlx's nested
//! `begin`), and [`Outcome::Processed`] means "processed inside your transaction": nothing is
//! durable, and the delivery must not be acked, until *your* transaction commits. If it rolls
//! back, the claim goes with it and a redelivery is processed again.
//!
//! ## Crate features
//! PostgreSQL, SQLite and MySQL/MariaDB support are always compiled in (MySQL/MariaDB: the inbox;
//! the outbox and broker positions not yet). The payload format is JSON (serde).
//! * `cli`: the module `cli`, the operator's command line (stats, dead letters, replay, purge),
//!   to embed in a binary of yours.
//! * `amqp`: `source::amqp`, the RabbitMQ source (lapin).
//! * `nats`: `source::nats`, the NATS JetStream source, and `sink::nats`, the NATS JetStream
//!   sink for the outbox relay (async-nats).
//! * `http`: the module `http`, the HTTP `Idempotency-Key` layer for axum and tower, whose
//!   handlers run on the claim's transaction (axum, tower, http, sfv).
//! * `console`: the module `console`, the operator console in the browser: an axum router to
//!   mount in your service (axum, http, hmac, form_urlencoded).
//!
//! Build these docs with `cargo doc --all-features` to see them all.

#![warn(missing_docs, unreachable_pub, rust_2018_idioms)]

pub mod admin;
mod batch;
pub mod cache;
mod classify;
#[cfg(feature = "cli")]
pub mod cli;
#[cfg(feature = "console")]
pub mod console;
mod dispatcher;
mod envelope;
mod error;
mod fingerprint;
mod handler;
#[cfg(feature = "http")]
pub mod http;
mod key;
mod message;
mod ordering;
pub mod outbox;
mod outcome;
mod policy;
mod protocol;
mod registry;
pub mod sink;
mod slot;
pub mod source;
mod status;
mod step_key;
mod store;
mod worker;

use std::future::Future;
use std::pin::Pin;

pub use classify::{BoxError, Classify, ErrorClass, Permanent, classify_error_chain};
pub use dispatcher::{ConsumerOutcome, Dispatcher, SweepReport};
pub use envelope::{Envelope, SourceMetadata};
pub use error::{
    Conflict, DispatchError, Disposition, Error, HandlerFailure, HookError, RegistryError,
    ReplayError, StoreError, StoreOperation,
};
pub use fingerprint::{Fingerprint, FingerprintError};
pub use key::{IdempotencyKey, KeyError, KeyPart, MAX_KEY_BYTES};
pub use message::Message;
pub use ordering::{GapPolicy, Ordering, ParkPolicy, ParkTimeout, SequencePart};
pub use outcome::Outcome;
pub use policy::RetryPolicy;
pub use protocol::Wait;
pub use protocol::hooks::{ClaimInfo, Fenced, TransactionHook};
pub use protocol::session::{ClaimSession, ClaimState, ClaimedKey, Settled};
pub use registry::{HandlerInfo, Registration, registered_handlers};
pub use slot::ConnectionSlot;
pub use status::{ClaimMode, Status, UnknownStatus};
pub use step_key::{StepKey, step_key};
pub use store::{
    Acquired, POSITIONS_MIGRATIONS_TABLE, PositionKey, PositionRow, PositionStore,
    PositionsDatabase,
};
pub use store::{
    AdminStore, AnyConnection, Backend, ClaimRequest, ClaimResult, ClaimStore, Component,
    ExistingRow, FailureRecord, InboxConnection, InboxDatabase, MIGRATIONS_TABLE, OrderingStore,
    ParkedMessage, Rejection, RejectionReason, StatsRow, StatsStatus, StoredMessage,
    mysql_lock_retries,
};
pub use store::{
    ArrivalRow, ConsoleDatabase, ConsoleStore, ParkedEntry, RejectionEntry, RetryLag, SentRow,
};
pub use store::{
    Lease, NOTIFY_CHANNEL, OUTBOX_MIGRATIONS_TABLE, OutboxAdminStore, OutboxBacklog,
    OutboxDatabase, OutboxEntry, OutboxRecord, OutboxRow, OutboxStatsRow, OutboxStatus,
    OutboxStore, Wakeups,
};

pub use worker::{
    DEFAULT_BATCH_SIZE, StopReason, Worker, WorkerError, WorkerReport, cancel_on_signal,
    settlement_for, shutdown_signal,
};

/// The shutdown token [`Worker::run`] takes (`tokio-util`'s, re-exported so that a worker needs
/// no dependency of its own on `tokio-util`): cancel it to stop the worker gracefully, or get
/// one that SIGINT and SIGTERM cancel from [`cancel_on_signal`].
pub use tokio_util::sync::CancellationToken;

// The macros' own documentation is their page (re-exported inline, with nothing prepended).
#[doc(inline)]
pub use inbox_macros::idempotent;

#[doc(inline)]
pub use inbox_macros::Message;

#[doc(inline)]
pub use inbox_macros::handler;

/// A boxed, `Send` future, as handlers and stores return them.
pub type BoxFuture<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

/// The error [`migrate`] returns: sqlx's migration error.
pub use sqlx::migrate::MigrateError;

/// Creates or upgrades the inbox tables (`inbox_messages`, `inbox_aggregate_state`,
/// `inbox_rejections`) in the database behind `pool` (a `PgPool`, `SqlitePool` or `MySqlPool`): the
/// [`Component::Inbox`] migrations. Idempotent: run it at every start.
///
/// Applied versions are recorded in [`MIGRATIONS_TABLE`], apart from the application's own
/// `_sqlx_migrations`; on PostgreSQL concurrent callers are serialized by an advisory lock.
///
/// # Errors
/// [`MigrateError`] if the database cannot be reached or a statement fails.
pub async fn migrate<DB: InboxDatabase>(pool: &sqlx::Pool<DB>) -> Result<(), MigrateError> {
    migrate_components(pool, &[Component::Inbox]).await
}

/// Creates or upgrades the tables of each of `components` (see [`Component`]), in order, each
/// with its own version record: an application migrates only what it enabled. Idempotent.
///
/// # Errors
/// [`MigrateError`] if the database cannot be reached or a statement fails; the components
/// before it stay migrated.
pub async fn migrate_components<DB: InboxDatabase>(
    pool: &sqlx::Pool<DB>,
    components: &[Component],
) -> Result<(), MigrateError> {
    for component in components {
        store::migrator::<DB>(*component).run(pool).await?;
    }
    Ok(())
}

/// Support for the code `#[idempotent]` and `#[derive(Message)]` generate. Not public API: no
/// semver guarantees; never name it yourself.
#[doc(hidden)]
pub mod __private {
    pub use crate::BoxFuture;
    pub use crate::classify::probe::{Probe, ViaAsRefError, ViaClassify, ViaFallback, ViaStdError};
    pub use crate::handler::run;
    pub use crate::key::{KeyPart, KeySegment, key_from_field, key_from_template};
    pub use crate::ordering::{SequencePart, ordering_from_fields};
    pub use crate::protocol::erased::DynHandler;
    pub use crate::protocol::single::{Delivery, Handler, HandlerResult};
    pub use crate::registry::Registration;
    pub use inventory;
}
