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
//! ## Consuming from a source
//!
//! A [`Worker`] takes deliveries from a [`source`] (here the in-memory one; RabbitMQ, NATS
//! JetStream, Kafka, Amazon SQS and files behind their features), runs each through the
//! [`Dispatcher`] (every consumer registered for its message name) and settles it with the
//! source only after its transaction committed:
//!
//! ```no_run
//! # use inbox_runtime::{idempotent, Message};
//! # #[derive(Clone, serde::Serialize, serde::Deserialize, Message)]
//! # #[message(name = "payments.captured")]
//! # struct PaymentCaptured { #[message(key)] event_id: uuid::Uuid, amount_cents: i64 }
//! # #[idempotent(consumer = "ledger")]
//! # async fn credit(conn: &mut sqlx::PgConnection, msg: PaymentCaptured) -> Result<(), sqlx::Error> { Ok(()) }
//! use inbox_runtime::source::memory::MemorySource;
//! use inbox_runtime::{CancellationToken, Dispatcher, Envelope, Worker};
//!
//! # async fn consume(pool: sqlx::PgPool, event: PaymentCaptured) -> Result<(), Box<dyn std::error::Error>> {
//! inbox_runtime::migrate(&pool).await?;
//! let source = MemorySource::new("payments");
//! let queue = source.handle();
//! let payload = serde_json::to_vec(&event)?; // an envelope carries JSON bytes
//! queue.push(Envelope::new(PaymentCaptured::NAME, payload.clone()));
//! queue.push(Envelope::new(PaymentCaptured::NAME, payload)); // a redelivery
//! queue.close();
//!
//! let worker = Worker::new(Dispatcher::from_registry(pool)?).concurrency(4);
//! // A service passes `inbox_runtime::cancel_on_signal()?` (SIGINT, SIGTERM) instead.
//! let report = worker.run(source, CancellationToken::new()).await?;
//! assert_eq!((report.processed, report.duplicates, report.acked), (1, 1, 2));
//! # Ok(()) }
//! ```
//!
//! ## Publishing with the outbox
//!
//! A handler publishes by writing a row in its own transaction ([`Outbox::publish`]); a
//! [`Relay`] sends the committed rows to a [`sink`] and marks them sent. Every (re-)publish
//! carries the same message id, for the consuming inbox or the broker's duplicate window:
//!
//! ```no_run
//! use inbox_runtime::outbox::OutboxMessage;
//! use inbox_runtime::sink::MemorySink; // or sink::{amqp, kafka, nats, sqs} behind features
//! use inbox_runtime::{CancellationToken, Component, Message, Outbox, Relay, idempotent};
//!
//! /// The destinations this service publishes to.
//! const OUTBOX: Outbox = Outbox::new(&["orders.events"]);
//!
//! #[derive(Clone, serde::Serialize, serde::Deserialize, Message)]
//! #[message(name = "orders.paid")]
//! struct OrderPaid {
//!     #[message(key)]
//!     order_id: String,
//! }
//!
//! /// Marks the order paid and publishes `orders.paid`: both commit, or neither.
//! #[idempotent(consumer = "orders")]
//! async fn pay(conn: &mut sqlx::PgConnection, msg: OrderPaid) -> Result<(), sqlx::Error> {
//!     sqlx::query("UPDATE orders SET paid = true WHERE id = $1")
//!         .bind(&msg.order_id)
//!         .execute(&mut *conn)
//!         .await?;
//!     OUTBOX.publish(conn, OutboxMessage::new("orders.events", &msg)).await?;
//!     Ok(())
//! }
//!
//! # async fn relay(pool: sqlx::PgPool, shutdown: CancellationToken) -> Result<(), Box<dyn std::error::Error>> {
//! inbox_runtime::migrate_components(&pool, &[Component::Inbox, Component::Outbox]).await?;
//! let report = Relay::new(pool, MemorySink::new()).run(shutdown).await;
//! # let _ = report; Ok(()) }
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
//!   and settles each after its transaction committed ([`worker::settlement_for`]).
//! * The [`Dispatcher`] decodes a payload once, routes it to every consumer registered for its
//!   name (`inventory`, or [`Dispatcher::from_handlers`]), and runs each through the protocol,
//!   alone or in a batch; its [`TransactionHook`]s run inside each claim's transaction (before
//!   `COMMIT`) and after it.
//! * The [`protocol`] owns the rules: the claim as the first statement, one decision function
//!   for a key already taken (duplicate, conflict, dead, stale, parked, or take it over), the
//!   check before `COMMIT`, and the failure record after a rollback. `#[idempotent]` handlers,
//!   batches, replays and parked successors are drivers of it; [`ClaimSession`] is its public
//!   face for work that is not a message handler.
//! * The [`outbox`] publishes from inside the handler's transaction: [`Outbox::publish`] writes
//!   a row with a stable message id, and a [`Relay`] sends committed rows to a [`sink::Sink`]
//!   (RabbitMQ, NATS JetStream, Kafka, Amazon SQS, or memory) and marks them sent.
//! * A [`store`] implements the statements behind small capability traits
//!   ([`store::ClaimStore`], [`store::OrderingStore`], [`store::AdminStore`],
//!   [`store::OutboxStore`], [`store::PositionStore`]) in its backend's SQL dialect, one folder
//!   per backend (PostgreSQL, SQLite, MySQL/MariaDB); schema migrations come per [`Component`].
//!
//! ## Where things are
//!
//! The crate root holds what a service names: the macros, [`Message`], [`Outcome`],
//! [`Dispatcher`], [`Worker`], [`ClaimSession`], [`Outbox`] and [`Relay`], the errors, and
//! [`migrate`]. Everything else is in the module of its layer:
//!
//! | Module | What it holds |
//! |---|---|
//! | [`types`] | the types every layer uses: keys, fingerprints, statuses, ordering, limits, errors |
//! | [`dispatch`] | the [`Dispatcher`], the handler registry, sweep reports |
//! | [`protocol`] | the [`ClaimSession`] and [`TransactionHook`]s |
//! | [`store`] | what a backend implements: the capability traits, their row types, migrations |
//! | [`worker`] | the [`Worker`], its report, settlement and shutdown signals |
//! | [`source`], [`sink`] | the [`source::Source`] and [`sink::Sink`] traits, one module per broker |
//! | [`outbox`] | [`Outbox`], [`Relay`], the outbox's admin API |
//! | [`cache`] | the dedupe caches (in-process; Redis behind `redis`) |
//! | `http` | the `Idempotency-Key` layer (feature `http`) |
//! | [`trace`] | W3C Trace Context propagation (feature `otel`): which span continues which |
//! | [`ops`] | the admin API ([`ops::admin`]), the command line (`cli`), the console (`console`) |
//! | `testing` | the test kit for your handlers (feature `testing`) |
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
//! PostgreSQL, SQLite and MySQL/MariaDB are always compiled in, each with the inbox, the outbox
//! and broker positions; so are the memory and file sources, the memory sink, the [`Worker`],
//! the in-process dedupe cache and the [`ops::admin`] API. The payload format is JSON (serde).
//! Every feature is off by default:
//! * `amqp`: `source::amqp`, the RabbitMQ source, and `sink::amqp`, the RabbitMQ sink with
//!   publisher confirms (lapin).
//! * `nats`: `source::nats`, the NATS JetStream source, and `sink::nats`, the NATS JetStream
//!   sink (async-nats).
//! * `kafka`: `source::kafka`, the Kafka source (a consumer group whose positions live in the
//!   database, fenced against zombies), and `sink::kafka`, an idempotent producer (rdkafka;
//!   builds librdkafka from source: cmake, a C toolchain, zlib and OpenSSL headers).
//! * `sqs`: `source::sqs`, the Amazon SQS source (standard and FIFO queues: delete after
//!   commit, visibility heartbeats), and `sink::sqs`, the SQS sink (the official aws-sdk-sqs,
//!   rustls with ring).
//! * `dynamodb`: `dynamodb`, Amazon DynamoDB as the inbox's store: the claim and the handler's
//!   DynamoDB writes in one `TransactWriteItems` (the official aws-sdk-dynamodb, rustls with
//!   ring): `dynamodb::DynamoInbox::process`, `#[idempotent]` handlers taking
//!   `&mut dynamodb::DynamoTx`, `dynamodb::DynamoDispatcher` (dispatch by message name,
//!   replay), and `dynamodb::DynamoWorker`, which runs it from any [`Source`](source::Source)
//!   as the [`Worker`] runs a [`Dispatcher`].
//! * `lambda`: `source::lambda::LambdaSqs`, AWS Lambda's SQS batches (an SQS event source
//!   mapping) run through a [`Worker`] and answered with the partial batch response
//!   (`batchItemFailures`): retryable failures listed, duplicates, conflicts and dead letters
//!   deleted, FIFO groups kept in order (lambda_runtime, aws_lambda_events); with `dynamodb`
//!   too, `source::lambda::DynamoLambdaSqs` runs them through a `dynamodb::DynamoDispatcher`.
//! * `redis`: `cache::redis::RedisCache`, a dedupe cache shared by every worker (redis).
//! * `http`: the module `http`, the HTTP `Idempotency-Key` layer for axum and tower, whose
//!   handlers run on the claim's transaction (axum, tower, http, sfv).
//! * `cli`: `ops::cli`, the operator's command line (stats, dead letters, replay, the outbox,
//!   purge), to embed in a binary of yours (clap, indicatif).
//! * `console`: `ops::console`, the operator console in the browser: an axum router to mount in
//!   your service (axum, http, hmac, form_urlencoded).
//! * `testing`: `testing`, a test kit for your handlers, for your own `#[tokio::test]`s: one
//!   handler and one message through the deliveries a broker and a database produce (twice, a
//!   commit whose answer is lost, a rolled-back first attempt, a conflicting payload), each
//!   state compared with what one delivery left (tokio's TCP, for its lost-commit proxy;
//!   sqlx's `libsqlite3-sys`, for its WAL hook on SQLite).
//! * `otel`: W3C Trace Context propagation, see [`trace`]: the current span's `traceparent` and
//!   `tracestate` stored with each outbox row, sent in every sink's headers, and continued by
//!   the handler's span of every delivery and of the HTTP layer (opentelemetry,
//!   tracing-opentelemetry). Without it the row's column stays `NULL`.
//!
//! Build these docs with `cargo doc --all-features` to see them all.

#![warn(missing_docs, unreachable_pub, rust_2018_idioms)]

pub mod cache;
mod debug;
pub mod dispatch;
#[cfg(feature = "dynamodb")]
pub mod dynamodb;
#[cfg(feature = "http")]
pub mod http;
pub mod ops;
pub mod outbox;
mod partition;
pub mod protocol;
mod setters;
pub mod sink;
pub mod source;
pub mod store;
#[cfg(feature = "testing")]
pub mod testing;
pub mod trace;
pub mod types;
pub mod worker;

use std::future::Future;
use std::pin::Pin;

// The user-facing surface: what a service that consumes, publishes or serves HTTP names. Every
// other public item lives in its module (`types`, `dispatch`, `protocol`, `store`, `worker`,
// `outbox`, `source`, `sink`, `cache`, `http`, `ops`).
pub use crate::types::{
    BoxError, Classify, Conflict, ConnectionSlot, DispatchError, Disposition, Envelope, Error,
    ErrorClass, Fingerprint, GapPolicy, HandlerFailure, HookError, IdempotencyKey, KeyError,
    Message, Outcome, Permanent, RegistryError, ReplayError, RetryPolicy, SourceMetadata, Status,
    StoreError,
};
pub use dispatch::{ConsumerOutcome, Dispatcher};
pub use outbox::{Outbox, Relay};
pub use protocol::{ClaimInfo, ClaimSession, ClaimState, TransactionHook, Wait};
pub use store::{Component, PgSchema};
pub use worker::{StopReason, Worker, WorkerError, WorkerReport, cancel_on_signal};

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
/// Applied versions are recorded in [`store::MIGRATIONS_TABLE`], apart from the application's own
/// `_sqlx_migrations`; on PostgreSQL concurrent callers are serialized by an advisory lock.
///
/// # Errors
/// [`MigrateError`] if the database cannot be reached or a statement fails.
pub async fn migrate<DB: store::InboxDatabase>(pool: &sqlx::Pool<DB>) -> Result<(), MigrateError> {
    migrate_components(pool, &[Component::Inbox]).await
}

/// Creates or upgrades the tables of each of `components` (see [`Component`]), in order, each
/// with its own version record: an application migrates only what it enabled. Idempotent.
///
/// # Errors
/// [`MigrateError`] if the database cannot be reached or a statement fails; the components
/// before it stay migrated.
pub async fn migrate_components<DB: store::InboxDatabase>(
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
/// The items `#[idempotent]` generates for a handler taking `&mut DynamoTx`: as they are with
/// the `dynamodb` feature; without it, an error at the handler's first parameter, which the macro
/// spans this call at.
#[cfg(feature = "dynamodb")]
#[doc(hidden)]
#[macro_export]
macro_rules! __inbox_dynamodb_items {
    ($($items:tt)*) => { $($items)* };
}

/// See the `dynamodb` form.
#[cfg(not(feature = "dynamodb"))]
#[doc(hidden)]
#[macro_export]
macro_rules! __inbox_dynamodb_items {
    ($($items:tt)*) => {
        ::core::compile_error! {
            "this handler takes `&mut DynamoTx`, a DynamoDB handler: enable inbox-runtime's \
             `dynamodb` feature (`inbox-runtime = { version = \"...\", features = [\"dynamodb\"] }`)"
        }
    };
}

/// What `#[idempotent]` emits next to its errors for a rejected DynamoDB handler: as it is with
/// the `dynamodb` feature; nothing without it (the errors are reported already).
#[cfg(feature = "dynamodb")]
#[doc(hidden)]
#[macro_export]
macro_rules! __inbox_dynamodb_fallback {
    ($($items:tt)*) => { $($items)* };
}

/// See the `dynamodb` form.
#[cfg(not(feature = "dynamodb"))]
#[doc(hidden)]
#[macro_export]
macro_rules! __inbox_dynamodb_fallback {
    ($($items:tt)*) => {};
}

#[doc(hidden)]
pub mod __private {
    pub use crate::__inbox_dynamodb_fallback as dynamodb_fallback;
    pub use crate::__inbox_dynamodb_items as dynamodb_items;
    pub use crate::BoxFuture;
    pub use crate::dispatch::direct::run;
    pub use crate::dispatch::registry::Registration;
    #[cfg(feature = "dynamodb")]
    pub use crate::dynamodb::handler::{DynDynamoHandler, DynamoHandler, run as run_dynamo};
    pub use crate::partition::partitions_from;
    pub use crate::protocol::erased::DynHandler;
    pub use crate::protocol::single::{Handler, HandlerResult, HandlerSpec};
    pub use crate::types::classify::probe::{
        Probe, ViaAsRefError, ViaClassify, ViaFallback, ViaStdError,
    };
    pub use crate::types::key::{KeyPart, KeySegment, key_from_field, key_from_template};
    pub use crate::types::ordering::{Ordering, SequencePart, ordering_from_fields};
    pub use inventory;
    // The bounds of the placeholder `impl Message` of a rejected `#[derive(Message)]`.
    pub use serde::{Serialize, de::DeserializeOwned};
}
