//! The transactional outbox: publish messages from inside the handler's transaction, and a
//! [`Relay`] that sends them to a [`Sink`](crate::sink::Sink) after the commit.
//!
//! ```text
//! handler ──► Outbox::publish (same transaction) ──► inbox_outbox ──► Relay ──► Sink (broker)
//! ```
//!
//! * **Enqueue**: [`Outbox::publish`] writes a row in the caller's transaction. Nothing is sent
//!   before that transaction commits, and a rollback leaves nothing (no dual write).
//! * **Stable message ids**: inside an `#[idempotent]` handler, a message's id is derived from
//!   the handler's consumer, the message's idempotency key and the position of the publish in
//!   the handler's run ([`Outbox::message_id_for`]), so a run that is rolled back and run again
//!   writes the same ids. The relay sends the stored id with every (re-)publish, so the broker's
//!   duplicate window or the consuming inbox drops a re-publish.
//! * **Relay**: [`Relay`] leases committed rows (never skipping one that committed late),
//!   publishes them, and marks them sent (only while it still holds their lease); rows of one
//!   aggregate go out one at a time (in which order: below); a failing row is retried with
//!   backoff and then dead-lettered, blocking only its own aggregate; many relays can run at
//!   once; a row whose publish kills (or hangs) every relay is dead-lettered after its attempts
//!   instead of looping.
//! * **Change data capture**: with [`Transport::ChangeDataCapture`] rows are written already
//!   settled, for Debezium's outbox event router to read from the WAL instead of a relay.
//! * **Operating it**: [`admin`] (statistics, list, show, retry, discard), the CLI's `outbox`
//!   commands, and the shared retention purge ([`crate::ops::admin::purge`]) for `sent` rows.
//!
//! Enable the table with [`migrate_components`](crate::migrate_components)`(&pool,
//! &[Component::Inbox, Component::Outbox])` ([`Component::Outbox`](crate::Component::Outbox);
//! PostgreSQL 13 or newer, for `xid8`).
//!
//! ## No skips, and in what order
//!
//! A relay that remembers "the last id published" and reads `id > last` loses a row whose
//! transaction took its id first and committed last. The [`Relay`] keeps no cursor: every round
//! selects `pending` rows by status, so a row is found by the first round after its commit,
//! whatever its id.
//!
//! On **PostgreSQL** a row is also held back until every transaction older than its own has
//! ended: its `txid` (`pg_current_xact_id()` of the writing transaction) must be below
//! `pg_snapshot_xmin(pg_current_snapshot())`, the oldest transaction still running. Why this is
//! sound: every transaction with an id below that horizon has ended, so rows with a `txid` below
//! it are final (committed and visible to the round, or rolled back and never visible); any row
//! that becomes visible later belongs to a transaction at or above the horizon. The rows a round
//! may publish are therefore a prefix, in (txid, id) order, of every row that will ever commit,
//! and the prefix only grows. The price: a long-running *writing* transaction anywhere on the
//! server (the horizon is server-wide) holds publication back until it ends; read-only
//! transactions do not.
//!
//! On **SQLite** one connection writes at a time: a row's id is allocated inside its writing
//! transaction, which holds the write lock until it commits, so rows commit in id order and a
//! reader sees a prefix of the ids.
//!
//! Within an **aggregate** ([`OutboxMessage::aggregate`]), rows are published one at a time: a
//! row waits while an earlier-created row of its aggregate (a lower id) that the relay can see
//! is `pending` or `dead`. A row the relay cannot see yet (its transaction is still open) holds
//! nothing back. So, per aggregate:
//!
//! * a row is published only after its transaction commits, and never ahead of an
//!   earlier-created row of its aggregate that had committed by then;
//! * they are published in **creation order** (the order of the [`Outbox::publish`] calls,
//!   which is id order) when the aggregate's writers are serialized, each writing its rows only
//!   after the previous writer of the aggregate has ended: then a row is never visible before an
//!   earlier one of its aggregate.
//!
//! Who serializes the writers, per backend:
//!
//! * **SQLite**: the database (one writer at a time): always creation order.
//! * **MySQL/MariaDB**: the publish itself. It first locks the aggregate's row in
//!   `inbox_outbox_aggregates`, held until the transaction ends, so a second writer of the aggregate waits
//!   at its publish: always creation order, at the price of one writer of an aggregate at a time
//!   from its first publish to its commit.
//! * **PostgreSQL**: your writers. Lock the aggregate before publishing: its row
//!   (`SELECT … FOR UPDATE`, or the `UPDATE` of its state, as a handler that changes the
//!   aggregate does anyway), or an advisory lock keyed by it
//!   (`SELECT pg_advisory_xact_lock(hashtextextended($1, 0))` with the aggregate id). Writers
//!   that do not get commit order or creation order, as the horizon above decides. Say T1 creates row 1 of an
//!   aggregate, then T2 creates row 2 and commits while T1 is still open: if T2 took its
//!   transaction id first (in an `#[idempotent]` handler the claim, the transaction's first
//!   statement, takes it), row 2 is published at once and row 1 after T1 commits (commit
//!   order); if T1 took its id first, row 2 waits for T1 to end and then behind row 1
//!   (creation order, although row 2 committed first).
//!
//! ## Where message ids come from
//!
//! The protocol sets the current claim (consumer, idempotency key) in a task-local around each
//! run of an `#[idempotent]` handler's body, single or batched; [`Outbox::publish`] counts the
//! publishes of the run. Code outside a handler body gets a UUIDv7 unless it sets its own id:
//! a task the handler spawns (task-locals are not inherited), a
//! [`TransactionHook`](crate::TransactionHook), a [`ClaimSession`](crate::ClaimSession) (wrap its
//! work in [`scoped`] to derive ids). A publish on a connection outside any transaction commits
//! at once.
//!
//! ```no_run
//! use inbox_runtime::outbox::{Outbox, OutboxMessage};
//! use inbox_runtime::{idempotent, Message};
//!
//! #[derive(Clone, serde::Serialize, serde::Deserialize, Message)]
//! #[message(name = "payments.captured")]
//! struct PaymentCaptured { #[message(key)] event_id: String, order_id: String }
//!
//! #[derive(Clone, serde::Serialize, serde::Deserialize, Message)]
//! #[message(name = "orders.paid")]
//! struct OrderPaid { #[message(key)] order_id: String }
//!
//! /// The destinations this service publishes to.
//! const OUTBOX: Outbox = Outbox::new(&["orders"]);
//!
//! #[idempotent(consumer = "orders")]
//! async fn on_captured(conn: &mut sqlx::PgConnection, msg: PaymentCaptured) -> Result<(), sqlx::Error> {
//!     sqlx::query("UPDATE orders SET paid = true WHERE id = $1")
//!         .bind(&msg.order_id).execute(&mut *conn).await?;
//!     // Same transaction: the event is sent if and only if the update commits.
//!     OUTBOX
//!         .publish(conn, OutboxMessage::new("orders", &OrderPaid { order_id: msg.order_id })
//!             .aggregate("order-1"))
//!         .await?;
//!     Ok(())
//! }
//! ```

pub mod admin;
pub(crate) mod relay;

use std::collections::BTreeMap;

use sha2::{Digest as _, Sha256};

use crate::protocol::context;
use crate::setters::setters;
use crate::store::{OutboxRow, OutboxStore};
use crate::types::classify::{Classify, ErrorClass};
use crate::types::message::Message;

pub use relay::{
    MAX_BACKOFF, MAX_LEASE, MIN_LEASE, Relay, RelayConfigError, RelayReport, RoundReport,
};

/// How an [`Outbox`]'s rows reach the broker.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Transport {
    /// A [`Relay`] leases `pending` rows, publishes them to its sink and marks them `sent`
    /// (the default).
    Relay,
    /// Change data capture reads the rows from the database's log (on PostgreSQL, Debezium's
    /// outbox event router over logical decoding: see the README's "Debezium" section). Rows
    /// are written already `sent` (`sent_at` = their creation), so that no relay leases them
    /// and no backlog gauge counts them while they wait for a relay that never runs; the
    /// table only ever sees inserts (what the event router expects) until the retention
    /// purge ([`crate::ops::admin::purge`]) deletes them, deletes the event router ignores. The
    /// commit is the publish: Debezium emits exactly the committed rows, in commit order, and
    /// a rolled-back publish never reaches the log's decoded stream.
    ChangeDataCapture,
}

/// The longest message id [`Outbox::publish`] accepts, in bytes (an AMQP `message-id` is a short
/// string of at most 255 bytes).
pub const MAX_MESSAGE_ID_BYTES: usize = 255;

/// Where messages are published from: the destinations a service may publish to, and whether
/// to notify relays.
///
/// A `const` so that handlers can name it: `const OUTBOX: Outbox = Outbox::new(&["orders"]);`.
/// A destination is what the relay's [`Sink`](crate::sink::Sink) sends to (a NATS subject, an
/// AMQP exchange); a publish to a destination not in the list is refused, so that a typo fails
/// the handler instead of stranding rows no sink reads.
#[derive(Debug, Clone, Copy)]
pub struct Outbox {
    destinations: &'static [&'static str],
    notify: bool,
    transport: Transport,
}

impl Outbox {
    /// An outbox that publishes to `destinations` (each non-empty), notifying relays.
    pub const fn new(destinations: &'static [&'static str]) -> Self {
        Self {
            destinations,
            notify: true,
            transport: Transport::Relay,
        }
    }

    /// How rows reach the broker: a [`Relay`] (the default) or change data capture
    /// ([`Transport::ChangeDataCapture`]: rows written already `sent`, no notification). Pick one
    /// per table: a relay running beside a CDC connector would publish nothing (the rows are
    /// `sent`), while a CDC connector reading rows a relay also publishes would send each twice.
    pub const fn transport(mut self, transport: Transport) -> Self {
        self.transport = transport;
        self
    }

    /// Whether [`publish`](Self::publish) queues a PostgreSQL `NOTIFY inbox_outbox` in the
    /// caller's transaction so that listening relays wake at once (default `true`; no effect on
    /// SQLite). The notification is sent at commit and dropped on rollback; it is a hint only:
    /// relays poll anyway ([`Relay::poll_interval`]). Its cost: PostgreSQL serializes the
    /// commits of notifying transactions on one lock. Turn it off under high write rates and
    /// rely on the poll interval for latency.
    pub const fn notify(mut self, notify: bool) -> Self {
        self.notify = notify;
        self
    }

    /// The destinations this outbox accepts.
    pub fn destinations(&self) -> &'static [&'static str] {
        self.destinations
    }

    /// Writes `message` into the outbox on `conn`, inside whatever transaction `conn` is in (an
    /// `#[idempotent]` handler's, or one of yours), and returns its message id.
    ///
    /// The message id is, first found: the one set with [`OutboxMessage::message_id`]; inside a
    /// handler body run by this crate (or [`scoped`]), [`Outbox::message_id_for`] of the
    /// handler's consumer, its message's idempotency key and the number of messages published
    /// before in this run (0, 1, …), so that a run rolled back and run again publishes the same
    /// ids as long as it publishes in the same order; otherwise a fresh UUIDv7 (stable from
    /// then on: the relay re-publishes the stored id).
    ///
    /// # Trace context
    /// With the feature `otel`, the current span's W3C Trace Context (`traceparent`,
    /// `tracestate`) is stored with the row, and the relay continues it and sends it in the
    /// message's headers (see [`crate::trace`]). Without the feature, or without a valid current
    /// span, the column stays `NULL`.
    ///
    /// # Order
    /// The row becomes publishable when the transaction commits. Rows of one aggregate
    /// ([`OutboxMessage::aggregate`]) are published one at a time, never one ahead of an
    /// earlier-created row of the aggregate that had committed by then; in the order of their
    /// `publish` calls (creation order) when the aggregate's writers are serialized:
    /// always on SQLite and MySQL/MariaDB (there this call waits while another open transaction
    /// has published to the aggregate), on PostgreSQL only if the writers lock the aggregate
    /// before publishing (its row `FOR UPDATE`, or
    /// `pg_advisory_xact_lock(hashtextextended(aggregate_id, 0))`). See the
    /// [module docs](crate::outbox#no-skips-and-in-what-order).
    ///
    /// # Errors
    /// Nothing is written on error; return it from the handler so that its transaction rolls
    /// back (an error written half into a transaction would otherwise commit the effect without
    /// its message).
    /// * [`OutboxError::EmptyDestination`], [`OutboxError::UnknownDestination`],
    ///   [`OutboxError::EmptyMessageName`], [`OutboxError::Serialize`],
    ///   [`OutboxError::InvalidMessageId`], [`OutboxError::InvalidHeader`],
    ///   [`OutboxError::InvalidAggregate`]: bad input (permanent, see [`Classify`]);
    /// * [`OutboxError::DuplicateMessageId`]: a row with this message id exists (the
    ///   transaction stays usable);
    /// * [`OutboxError::Database`]: the insert failed.
    pub async fn publish<C: OutboxStore + ?Sized>(
        &self,
        conn: &mut C,
        message: OutboxMessage,
    ) -> Result<String, OutboxError> {
        let message = self.validate(message)?;
        let destination = message.destination.as_str();
        let message_id = match message.message_id {
            Some(id) => id,
            None => match context::next_position() {
                Some((consumer, key, index)) => Self::message_id_for(&consumer, &key, index),
                None => uuid::Uuid::now_v7().to_string(),
            },
        };
        let headers_json = serde_json::to_string(&message.headers).expect("strings serialize");
        let trace_context = crate::trace::current_json();
        let row = OutboxRow::new(
            &message_id,
            destination,
            &message.message_name,
            &message.payload,
            &headers_json,
            message.aggregate_id.as_deref(),
        )
        .settled(self.settled())
        .traced(trace_context.as_deref());
        let written = conn
            .enqueue_outbox(&row, self.notify && self.transport == Transport::Relay)
            .await?;
        if !written {
            return Err(OutboxError::DuplicateMessageId { message_id });
        }
        Ok(message_id)
    }

    /// [`publish`](Self::publish)'s checks of `message`, shared by every store that publishes
    /// (the SQL stores' [`publish`](Self::publish) and DynamoDB's
    /// [`DynamoTx::publish`](crate::dynamodb::DynamoTx::publish) when built with it): the error
    /// deferred while building it, then the destination, the message name, the headers, the
    /// aggregate and the message id set by the caller. Returns the message with nothing
    /// deferred.
    ///
    /// # Errors
    /// [`OutboxError::EmptyDestination`], [`OutboxError::UnknownDestination`],
    /// [`OutboxError::EmptyMessageName`], [`OutboxError::Serialize`],
    /// [`OutboxError::InvalidMessageId`], [`OutboxError::InvalidHeader`],
    /// [`OutboxError::InvalidAggregate`].
    pub(crate) fn validate(
        &self,
        mut message: OutboxMessage,
    ) -> Result<OutboxMessage, OutboxError> {
        if let Some(error) = message.deferred.take() {
            return Err(error);
        }
        let destination = message.destination.as_str();
        if destination.is_empty() {
            return Err(OutboxError::EmptyDestination);
        }
        if !self.destinations.contains(&destination) {
            return Err(OutboxError::UnknownDestination {
                destination: destination.to_owned(),
                known: self.destinations.iter().map(|d| (*d).to_owned()).collect(),
            });
        }
        if message.message_name.is_empty() {
            return Err(OutboxError::EmptyMessageName {
                destination: destination.to_owned(),
            });
        }
        for name in message.headers.keys() {
            if name.is_empty() || name.chars().any(|c| c.is_control() || c == ':') {
                return Err(OutboxError::InvalidHeader {
                    name: name.clone(),
                    reason: "a header name must be non-empty, without ':' or control characters",
                });
            }
        }
        if let Some(aggregate) = &message.aggregate_id
            && aggregate.is_empty()
        {
            return Err(OutboxError::InvalidAggregate {
                reason: "the aggregate id is empty".into(),
            });
        }
        if let Some(id) = &message.message_id {
            validate_message_id(id)?;
        }
        Ok(message)
    }

    /// Whether rows are written already settled, for change data capture
    /// ([`Transport::ChangeDataCapture`]).
    pub(crate) fn settled(&self) -> bool {
        self.transport == Transport::ChangeDataCapture
    }

    /// The message id of the `index`-th message (from 0) published by the run of `consumer`'s
    /// handler for the idempotency key `key`: a UUID (version 8) made of the first 16 bytes of
    /// the SHA-256 of the three, each length-prefixed. The same inputs give the same id in every
    /// process and version of this crate.
    ///
    /// ```
    /// use inbox_runtime::outbox::Outbox;
    /// let id = Outbox::message_id_for("orders", "payment:42", 0);
    /// assert_eq!(id, Outbox::message_id_for("orders", "payment:42", 0));
    /// assert_ne!(id, Outbox::message_id_for("orders", "payment:42", 1));
    /// assert_eq!(id.len(), 36);
    /// ```
    pub fn message_id_for(consumer: &str, key: &str, index: u32) -> String {
        let mut hash = Sha256::new();
        hash.update(b"inbox-outbox-v1\0");
        for part in [consumer.as_bytes(), key.as_bytes()] {
            hash.update((part.len() as u64).to_be_bytes());
            hash.update(part);
        }
        hash.update(index.to_be_bytes());
        let digest = hash.finalize();
        let mut bytes = [0u8; 16];
        bytes.copy_from_slice(&digest[..16]);
        uuid::Builder::from_custom_bytes(bytes)
            .into_uuid()
            .to_string()
    }
}

/// Runs `body` as the handler run of `(consumer, key)` for [`Outbox::publish`]'s message ids:
/// what `#[idempotent]` handlers get on their own. For code that claims through a
/// [`ClaimSession`](crate::ClaimSession) and publishes in the claimed transaction: wrap each
/// run of the work in it, so that a run retried after a rollback publishes the same ids.
pub async fn scoped<F: std::future::Future>(consumer: &str, key: &str, body: F) -> F::Output {
    context::scope(consumer, key, body).await
}

fn validate_message_id(id: &str) -> Result<(), OutboxError> {
    let reason = if id.is_empty() {
        "it is empty"
    } else if id.len() > MAX_MESSAGE_ID_BYTES {
        "it is longer than 255 bytes"
    } else if id.chars().any(char::is_control) {
        "it contains control characters"
    } else {
        return Ok(());
    };
    Err(OutboxError::InvalidMessageId {
        message_id: id.chars().take(64).collect(),
        length: id.len(),
        reason,
    })
}

/// One message to publish through the [`Outbox`]: destination, routing name, payload, headers,
/// aggregate and (optionally) its own message id.
///
/// Problems found while building it (a payload that does not serialize, an invalid aggregate)
/// are reported by [`Outbox::publish`], so that a handler has one place to handle them.
#[derive(Debug)]
pub struct OutboxMessage {
    pub(crate) destination: String,
    pub(crate) message_name: String,
    pub(crate) payload: Vec<u8>,
    pub(crate) headers: BTreeMap<String, String>,
    pub(crate) aggregate_id: Option<String>,
    pub(crate) message_id: Option<String>,
    deferred: Option<OutboxError>,
}

impl OutboxMessage {
    /// `message` as JSON, named [`Message::NAME`], to `destination`. Its aggregate is the
    /// message's own (`#[message(aggregate)]`), if it has one.
    pub fn new<M: Message>(destination: impl Into<String>, message: &M) -> Self {
        let mut out = Self::raw(destination, M::NAME, Vec::new());
        match serde_json::to_vec(message) {
            Ok(payload) => out.payload = payload,
            Err(source) => {
                out.deferred = Some(OutboxError::Serialize {
                    message_name: M::NAME.to_owned(),
                    source,
                })
            }
        }
        match message.ordering() {
            Ok(ordering) => out.aggregate_id = ordering.map(|o| o.aggregate_id),
            Err(error) => {
                out.deferred.get_or_insert(OutboxError::InvalidAggregate {
                    reason: error.to_string(),
                });
            }
        }
        out
    }

    /// Raw `payload` bytes named `message_name`, to `destination` (this crate's sources expect
    /// UTF-8 JSON).
    pub fn raw(
        destination: impl Into<String>,
        message_name: impl Into<String>,
        payload: impl Into<Vec<u8>>,
    ) -> Self {
        Self {
            destination: destination.into(),
            message_name: message_name.into(),
            payload: payload.into(),
            headers: BTreeMap::new(),
            aggregate_id: None,
            message_id: None,
            deferred: None,
        }
    }

    /// Adds a header (replacing one of the same name). Sinks add their own (the message name,
    /// the message id) and those win over a header of the same name.
    pub fn header(mut self, name: impl Into<String>, value: impl Into<String>) -> Self {
        self.headers.insert(name.into(), value.into());
        self
    }

    setters! {
        /// Sets the aggregate: the relay publishes the rows of one aggregate one at a time, never
        /// one ahead of an earlier-written row that had committed by then (in the order they were
        /// written when the aggregate's writers are serialized: see [`Outbox::publish`]), and a
        /// dead row blocks the rows after it.
        pub fn aggregate(aggregate_id: impl Into<String>) {
            self.aggregate_id = Some(aggregate_id.into());
        }

        /// Sets the message id (non-empty, at most [`MAX_MESSAGE_ID_BYTES`], no control
        /// characters) instead of the derived one. Choose one that is the same on every run of the
        /// work that publishes it, or the consumer cannot deduplicate.
        pub fn message_id(message_id: impl Into<String>) {
            self.message_id = Some(message_id.into());
        }
    }
}

/// Why [`Outbox::publish`] wrote nothing.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum OutboxError {
    /// The destination is the empty string.
    #[error("outbox destination is empty")]
    EmptyDestination,
    /// The destination is not one of the [`Outbox`]'s.
    #[error(
        "unknown outbox destination {destination:?} ({})",
        if known.is_empty() {
            "this outbox has no destinations: list them in Outbox::new".to_owned()
        } else {
            format!("known: {}", known.join(", "))
        }
    )]
    UnknownDestination {
        /// The destination asked for.
        destination: String,
        /// The outbox's destinations.
        known: Vec<String>,
    },
    /// The message name is the empty string.
    #[error("outbox message to {destination:?} has an empty message name")]
    EmptyMessageName {
        /// The destination.
        destination: String,
    },
    /// The message did not serialize to JSON.
    #[error("outbox message {message_name:?} does not serialize: {source}")]
    Serialize {
        /// The message's name.
        message_name: String,
        /// serde_json's error.
        source: serde_json::Error,
    },
    /// The message id set by the caller is empty, too long or has control characters.
    #[error("invalid outbox message id {message_id:?} ({length} bytes): {reason}")]
    InvalidMessageId {
        /// The id (its first 64 characters).
        message_id: String,
        /// Its length in bytes.
        length: usize,
        /// What is wrong with it.
        reason: &'static str,
    },
    /// A header name is empty or has `:` or control characters.
    #[error("invalid outbox header {name:?}: {reason}")]
    InvalidHeader {
        /// The header name.
        name: String,
        /// What is wrong with it.
        reason: &'static str,
    },
    /// The aggregate id is empty (or the message's own ordering is invalid).
    #[error("invalid outbox aggregate: {reason}")]
    InvalidAggregate {
        /// What is wrong with it.
        reason: String,
    },
    /// A row with this message id is in the outbox already (nothing written; the transaction
    /// stays usable). On DynamoDB (`inbox_runtime::dynamodb::DynamoTx::publish`): this run of
    /// the delivery published the message id already (an item stored before fails the
    /// transaction as a condition instead, at submit).
    #[error("outbox message id {message_id:?} was published before")]
    DuplicateMessageId {
        /// The message id.
        message_id: String,
    },
    /// The transaction has no room for the message's write: a DynamoDB transaction
    /// (`inbox_runtime::dynamodb::DynamoTx::publish`) that holds `actions` actions already, the
    /// most it takes besides the claim (`max`, 99). Nothing was added.
    #[error(
        "the DynamoDB transaction holds {actions} actions already, at most {max} besides the \
         claim: no room for the outbox message"
    )]
    TransactionFull {
        /// Actions in the transaction already.
        actions: usize,
        /// The most it takes besides the claim.
        max: usize,
    },
    /// The insert failed.
    #[error("outbox insert failed: {0}")]
    Database(#[from] sqlx::Error),
}

impl Classify for OutboxError {
    /// Bad input is [`ErrorClass::Permanent`] (another attempt writes the same bad row); a
    /// database error is classified as `sqlx::Error`s are; a duplicate id is retryable.
    fn class(&self) -> ErrorClass {
        match self {
            OutboxError::Database(error) => error.class(),
            OutboxError::DuplicateMessageId { .. } => ErrorClass::Retryable,
            _ => ErrorClass::Permanent,
        }
    }
}

/// For handlers whose error type is `sqlx::Error`: a database error as it is, anything else as
/// `sqlx::Error::Encode` (a retryable handler error; use an error type of your own with
/// [`Classify`] to make bad input permanent).
impl From<OutboxError> for sqlx::Error {
    fn from(error: OutboxError) -> Self {
        match error {
            OutboxError::Database(error) => error,
            other => sqlx::Error::Encode(Box::new(other)),
        }
    }
}

/// Deletes `sent` rows sent more than `older_than` ago, in batches of `batch` rows (short
/// transactions), until none is left. Returns how many went. Keep `older_than` longer than the
/// consumers' deduplication horizon if you want to inspect what was sent.
///
/// # Errors
/// The database error of a batch; the batches before it stay deleted.
pub async fn purge_sent<DB: crate::store::OutboxDatabase>(
    pool: &sqlx::Pool<DB>,
    older_than: std::time::Duration,
    batch: u32,
) -> Result<u64, sqlx::Error> {
    let batch = i64::from(batch.max(1));
    let mut conn = pool.acquire().await?;
    let mut total = 0;
    loop {
        let deleted = conn
            .purge_outbox_sent(older_than.as_secs_f64(), batch)
            .await?;
        total += deleted;
        if deleted < batch as u64 {
            return Ok(total);
        }
    }
}
