//! NATS JetStream as a source, on [async-nats](https://docs.rs/async-nats): a durable pull
//! consumer with explicit acks and `AckWait` redelivery. Cargo feature `nats`.
//!
//! ```no_run
//! # async fn demo(pool: sqlx::PgPool) -> Result<(), Box<dyn std::error::Error>> {
//! use std::time::Duration;
//! use inbox_runtime::{Dispatcher, Worker};
//! use inbox_runtime::source::nats::{NatsConfig, NatsSource};
//!
//! let config = NatsConfig::new("nats://127.0.0.1:4222", "PAYMENTS", "ledger")
//!     .ack_wait(Duration::from_secs(30))
//!     .max_ack_pending(32);
//! let source = NatsSource::connect(config).await?;
//! Worker::new(Dispatcher::from_registry(pool)?)
//!     .concurrency(32)
//!     .run_until_signal(source)
//!     .await?;
//! # Ok(()) }
//! ```
//!
//! The stream must exist. The durable consumer is created with the configured settings if it
//! does not exist yet; an existing one is used as it is (its settings are not changed).
//! Several processes with the same durable name share its messages (a work queue).
//!
//! **Message name**, first found of: the header named by [`NatsConfig::name_header`] (default
//! `message-name`); the subject with [`NatsConfig::subject_prefix`] stripped, if set and the
//! subject starts with it. Otherwise the empty name, which no handler has: the worker rejects
//! the delivery.
//!
//! **Metadata**: `source` = `<stream>/<consumer>`, `offset` = the stream sequence (stable across
//! redeliveries), `delivery_count` = JetStream's delivery count, `redelivered` = count > 1,
//! `message_id` = the `Nats-Msg-Id` header. Headers (first value of each) are copied into
//! [`Envelope::headers`].
//!
//! **Payload limit** ([`Source::set_payload_limit`], the dispatcher's limit under a
//! [`Worker`](crate::Worker); 1 MiB otherwise): async-nats hands a message over whole, so the
//! limit cannot stop it from reading a large one. What bounds that is the server: it refuses to
//! accept a message over its `max_payload` (1 MB by default, at most 64 MB), and the client
//! buffers one pull batch (up to 200 messages) ahead of the worker. Of a payload over the limit
//! only the first `limit` bytes are copied out of the client's buffer (which is then dropped),
//! and the worker keeps that cut copy in `inbox_rejections` as `too_large` with its real size.
//!
//! **Settling**: ack → `+ACK`; reject → `+TERM` (no redelivery); requeue → `-NAK` with the
//! requeue delay (JetStream redelivers after it). A delivery neither acked nor nacked is
//! redelivered once `AckWait` has passed since it was delivered. Acks are sent without waiting
//! for the server's confirmation; [`Source::close`] flushes them.

use std::time::Duration;

use async_nats::jetstream::consumer::pull::{self, MessagesErrorKind};
use async_nats::jetstream::consumer::{AckPolicy, DeliverPolicy};
use async_nats::jetstream::{self, AckKind};
use futures_util::StreamExt as _;

use crate::BoxFuture;
use crate::debug::some_fields;
use crate::setters::setters;
use crate::source::{
    Delivery, Settle, SettleFuture, Settlement, Source, SourceError, header_value,
};
use crate::types::envelope::{Envelope, SourceMetadata};
use crate::types::limit::PayloadLimit;

/// How to connect and consume. Build with [`NatsConfig::new`] and the setters.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct NatsConfig {
    /// The server: `nats://host:port` (`tls://` for TLS).
    pub url: String,
    /// The JetStream stream to consume; it must exist.
    pub stream: String,
    /// The durable consumer's name (created if missing).
    pub consumer: String,
    /// For a new consumer: only subjects matching this filter (empty: all of the stream's).
    pub filter_subject: String,
    /// For a new consumer: how long after a delivery JetStream redelivers it if it was neither
    /// acked nor nacked. Default 30 s. Longer than the slowest handler.
    pub ack_wait: Duration,
    /// For a new consumer: at most this many delivered, unacked messages (over all processes
    /// sharing the consumer). Default 64; keep it at least the worker's concurrency.
    pub max_ack_pending: i64,
    /// For a new consumer: deliveries after which JetStream stops redelivering a message
    /// (`-1`: no limit). Default `-1`.
    pub max_deliver: i64,
    /// Header carrying the message name. Default `Some("message-name")`.
    pub name_header: Option<String>,
    /// If set, a subject starting with this prefix names the message by its remainder
    /// (prefix `payments.` and subject `payments.captured` → `captured`; prefix `""` → the whole
    /// subject), when the header does not. Default `None`.
    pub subject_prefix: Option<String>,
    /// Header whose value is the delivery's ordering key. Default `None`.
    pub ordering_key_header: Option<String>,
}

impl NatsConfig {
    /// Consume `stream` through the durable consumer `consumer` on the server at `url`, with the
    /// defaults listed on the fields.
    pub fn new(
        url: impl Into<String>,
        stream: impl Into<String>,
        consumer: impl Into<String>,
    ) -> Self {
        Self {
            url: url.into(),
            stream: stream.into(),
            consumer: consumer.into(),
            filter_subject: String::new(),
            ack_wait: Duration::from_secs(30),
            max_ack_pending: 64,
            max_deliver: -1,
            name_header: Some("message-name".into()),
            subject_prefix: None,
            ordering_key_header: None,
        }
    }

    setters! {
        /// Sets [`filter_subject`](Self::filter_subject).
        pub fn filter_subject(filter: impl Into<String>) {
            self.filter_subject = filter.into();
        }

        /// Sets [`ack_wait`](Self::ack_wait).
        pub fn ack_wait(ack_wait: Duration);

        /// Sets [`max_ack_pending`](Self::max_ack_pending).
        pub fn max_ack_pending(max: i64);

        /// Sets [`max_deliver`](Self::max_deliver).
        pub fn max_deliver(max: i64);

        /// Sets [`name_header`](Self::name_header) (`None`: ignore headers).
        pub fn name_header(header: Option<String>);

        /// Sets [`subject_prefix`](Self::subject_prefix).
        pub fn subject_prefix(prefix: impl Into<String>) {
            self.subject_prefix = Some(prefix.into());
        }

        /// Sets [`ordering_key_header`](Self::ordering_key_header).
        pub fn ordering_key_header(header: impl Into<String>) {
            self.ordering_key_header = Some(header.into());
        }
    }
}

/// A JetStream durable pull consumer. See the [module documentation](self).
pub struct NatsSource {
    config: NatsConfig,
    name: String,
    client: async_nats::Client,
    messages: pull::Stream,
    limit: PayloadLimit,
}

impl std::fmt::Debug for NatsSource {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        some_fields(f, "NatsSource", &[("config", &self.config)])
    }
}

impl NatsSource {
    /// Connects, finds the stream, gets or creates the durable consumer and starts pulling.
    ///
    /// # Errors
    /// A [`SourceError`] with operation `"connect"` if the server cannot be reached,
    /// `"consume"` if the stream does not exist or the consumer cannot be created or pulled.
    pub async fn connect(config: NatsConfig) -> Result<Self, SourceError> {
        let name = format!("{}/{}", config.stream, config.consumer);
        let client = async_nats::connect(&config.url)
            .await
            .map_err(|e| SourceError::new(&name, "connect", e))?;
        let consume_error = |e: async_nats::Error| SourceError::new(&name, "consume", e);
        let context = jetstream::new(client.clone());
        let stream = context
            .get_stream(&config.stream)
            .await
            .map_err(|e| consume_error(e.into()))?;
        let consumer = stream
            .get_or_create_consumer(
                &config.consumer,
                pull::Config {
                    durable_name: Some(config.consumer.clone()),
                    deliver_policy: DeliverPolicy::All,
                    ack_policy: AckPolicy::Explicit,
                    ack_wait: config.ack_wait,
                    max_ack_pending: config.max_ack_pending,
                    max_deliver: config.max_deliver,
                    filter_subject: config.filter_subject.clone(),
                    ..pull::Config::default()
                },
            )
            .await
            .map_err(|e| consume_error(e.into()))?;
        let messages = consumer
            .messages()
            .await
            .map_err(|e| consume_error(e.into()))?;
        Ok(Self {
            config,
            name,
            client,
            messages,
            limit: PayloadLimit::DEFAULT,
        })
    }

    /// The configuration it was connected with.
    pub fn config(&self) -> &NatsConfig {
        &self.config
    }

    fn delivery(&self, message: jetstream::Message) -> Delivery {
        let mut headers = std::collections::BTreeMap::new();
        if let Some(map) = &message.headers {
            for (name, values) in map.iter() {
                if let Some(value) = values.first() {
                    headers.insert(name.to_string(), value.as_str().to_owned());
                }
            }
        }
        let message_name = header_value(&headers, self.config.name_header.as_ref())
            .or_else(|| {
                let prefix = self.config.subject_prefix.as_deref()?;
                message
                    .subject
                    .as_str()
                    .strip_prefix(prefix)
                    .map(str::to_owned)
            })
            .unwrap_or_default();
        let ordering_key = header_value(&headers, self.config.ordering_key_header.as_ref());

        let mut metadata = SourceMetadata::new(&self.name);
        if let Ok(info) = message.info() {
            let delivered = u64::try_from(info.delivered).unwrap_or(0);
            metadata = metadata
                .offset(i64::try_from(info.stream_sequence).unwrap_or(i64::MAX))
                .delivery_count(delivered)
                .redelivered(delivered > 1);
        }
        if let Some(id) = headers.get("Nats-Msg-Id") {
            metadata = metadata.message_id(id.clone());
        }
        let (message, acker) = message.split();
        let mut envelope =
            Envelope::within(message_name, &message.payload, self.limit).with_source(metadata);
        envelope.headers = headers;
        let mut delivery = Delivery::new(
            envelope,
            NatsSettler {
                name: self.name.clone(),
                acker,
            },
        );
        if let Some(key) = ordering_key {
            delivery = delivery.with_ordering_key(key);
        }
        delivery
    }
}

struct NatsSettler {
    name: String,
    acker: jetstream::message::Acker,
}

impl Settle for NatsSettler {
    fn settle(self: Box<Self>, settlement: Settlement) -> SettleFuture {
        Box::pin(async move {
            let kind = match settlement {
                Settlement::Ack => AckKind::Ack,
                Settlement::Reject => AckKind::Term,
                Settlement::Requeue { delay } => AckKind::Nak(delay),
            };
            self.acker
                .ack_with(kind)
                .await
                .map_err(|e| SourceError::new(self.name, settlement.kind(), e))
        })
    }
}

impl Source for NatsSource {
    fn name(&self) -> &str {
        &self.name
    }

    /// See the module documentation's "Payload limit": only the first `limit` bytes of a
    /// larger payload are copied out of the client's buffer.
    fn set_payload_limit(&mut self, limit: PayloadLimit) {
        self.limit = limit;
    }

    fn next(&mut self) -> BoxFuture<'_, Result<Option<Delivery>, SourceError>> {
        Box::pin(async move {
            loop {
                match self.messages.next().await {
                    Some(Ok(message)) => return Ok(Some(self.delivery(message))),
                    Some(Err(e)) if e.kind() == MessagesErrorKind::MissingHeartbeat => {
                        // The pull request's heartbeat was late (a slow network or a busy
                        // server); the stream re-issues its pull request by itself.
                        tracing::warn!(source = %self.name, error = %e, "JetStream heartbeat missed");
                    }
                    Some(Err(e)) => return Err(SourceError::new(&self.name, "receive", e)),
                    None => return Ok(None),
                }
            }
        })
    }

    fn close(&mut self) -> BoxFuture<'_, Result<(), SourceError>> {
        Box::pin(async move {
            // Acks are published without waiting: make sure they have left before returning.
            self.client
                .flush()
                .await
                .map_err(|e| SourceError::new(&self.name, "close", e))
        })
    }
}
