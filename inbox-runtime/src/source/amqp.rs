//! RabbitMQ (AMQP 0-9-1) as a source, on [lapin](https://docs.rs/lapin): a consumer on one
//! queue with manual acks and a prefetch limit. Cargo feature `amqp`.
//!
//! ```no_run
//! # async fn demo(pool: sqlx::PgPool) -> Result<(), Box<dyn std::error::Error>> {
//! use inbox_runtime::{Dispatcher, Worker};
//! use inbox_runtime::source::amqp::{AmqpConfig, AmqpSource};
//!
//! let config = AmqpConfig::new("amqp://guest:guest@127.0.0.1:5672/%2f", "payments")
//!     .prefetch(32)
//!     .route("payments.captured.v1", "payments.captured"); // routing key → message name
//! let source = AmqpSource::connect(config).await?;
//! Worker::new(Dispatcher::from_registry(pool)?)
//!     .concurrency(32)
//!     .run_until_signal(source)
//!     .await?;
//! # Ok(()) }
//! ```
//!
//! **Message name**, first found of: the header named by [`AmqpConfig::name_header`] (default
//! `message-name`); the AMQP `type` property; the routing key's entry in
//! [`AmqpConfig::route`]; the routing key itself if [`AmqpConfig::routing_key_as_name`]. A
//! delivery with none of these gets the empty name, which no handler has: the worker rejects it.
//!
//! **Metadata**: `source` = the queue, `offset` = the delivery tag (per channel, not stable
//! across redeliveries), `redelivered` = the broker's redelivered flag, `message_id` = the AMQP
//! `message_id` property, `delivery_count` = the `x-delivery-count` header where RabbitMQ sets it
//! (quorum queues; it counts earlier deliveries, so 1 is added). Text, integer and boolean
//! headers are copied into [`Envelope::headers`].
//!
//! **Payload limit** ([`Source::set_payload_limit`], the dispatcher's limit under a
//! [`Worker`](crate::Worker); 1 MiB otherwise): lapin hands a message over whole (it assembles
//! the body frames itself), so the limit cannot stop it from reading a large one. What bounds
//! that is the broker: RabbitMQ refuses to accept a message over its `max_message_size`
//! (16 MiB by default since RabbitMQ 4.0, 128 MiB in 3.8 to 3.13, at most 512 MiB), and the
//! channel holds at most [`prefetch`](AmqpConfig::prefetch) unacked messages. Set
//! `max_message_size` to what your consumers accept. A body over the limit is cut to its first
//! `limit` bytes as soon as it is handed out (its memory given back, before any other copy), and
//! the worker keeps that cut copy in `inbox_rejections` as `too_large` with its real size.
//!
//! **Settling**: ack → `basic.ack`; reject → `basic.nack` with `requeue=false` (the queue's
//! dead-letter exchange gets it, if it has one); requeue → `basic.nack` with `requeue=true`,
//! sent after the requeue delay (RabbitMQ has no delayed requeue). Unsettled deliveries go back
//! to the queue when the channel closes ([`Source::close`], or the process ending).

use std::collections::BTreeMap;

use futures_util::StreamExt as _;
use lapin::options::{BasicAckOptions, BasicConsumeOptions, BasicNackOptions, BasicQosOptions};
use lapin::types::{AMQPValue, FieldTable};
use lapin::{Channel, Connection, ConnectionProperties, Consumer};

use crate::BoxFuture;
use crate::setters::setters;
use crate::source::{
    Delivery, Settle, SettleFuture, Settlement, Source, SourceError, header_value,
};
use crate::types::envelope::{Envelope, SourceMetadata};
use crate::types::limit::PayloadLimit;

/// How to connect and consume. Build with [`AmqpConfig::new`] and the setters.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct AmqpConfig {
    /// The broker: `amqp://user:password@host:port/vhost` (vhost URL-encoded: `%2f` is `/`);
    /// `amqps://` for TLS.
    pub url: String,
    /// The queue to consume. It must exist (declare it in your topology, or see
    /// [`AmqpConfig::declare`]).
    pub queue: String,
    /// At most this many unacked deliveries on the channel (`basic.qos`); 0 means no limit.
    /// Default 64. Keep it at least the worker's concurrency.
    pub prefetch: u16,
    /// The consumer tag; empty lets the broker choose. Default empty.
    pub consumer_tag: String,
    /// Header carrying the message name. Default `Some("message-name")`.
    pub name_header: Option<String>,
    /// Routing key → message name, used when neither the header nor the `type` property names
    /// the message.
    pub routes: BTreeMap<String, String>,
    /// Use the routing key itself as the message name when nothing else names it. Default
    /// `false`.
    pub routing_key_as_name: bool,
    /// Header whose value is the delivery's ordering key (see
    /// [`Delivery::with_ordering_key`]). Default `None`: no per-key ordering.
    pub ordering_key_header: Option<String>,
    /// Declare the queue (durable, no arguments) if it does not exist. Default `false`.
    pub declare: bool,
}

impl AmqpConfig {
    /// Consume `queue` on the broker at `url`, with the defaults listed on the fields.
    pub fn new(url: impl Into<String>, queue: impl Into<String>) -> Self {
        Self {
            url: url.into(),
            queue: queue.into(),
            prefetch: 64,
            consumer_tag: String::new(),
            name_header: Some("message-name".into()),
            routes: BTreeMap::new(),
            routing_key_as_name: false,
            ordering_key_header: None,
            declare: false,
        }
    }

    setters! {
        /// Sets [`prefetch`](Self::prefetch).
        pub fn prefetch(prefetch: u16);

        /// Sets [`consumer_tag`](Self::consumer_tag).
        pub fn consumer_tag(tag: impl Into<String>) {
            self.consumer_tag = tag.into();
        }

        /// Sets [`name_header`](Self::name_header) (`None`: ignore headers).
        pub fn name_header(header: Option<String>);
    }

    /// Adds a routing key → message name mapping to [`routes`](Self::routes).
    pub fn route(
        mut self,
        routing_key: impl Into<String>,
        message_name: impl Into<String>,
    ) -> Self {
        self.routes.insert(routing_key.into(), message_name.into());
        self
    }

    setters! {
        /// Sets [`routing_key_as_name`](Self::routing_key_as_name).
        pub fn routing_key_as_name(yes: bool);

        /// Sets [`ordering_key_header`](Self::ordering_key_header).
        pub fn ordering_key_header(header: impl Into<String>) {
            self.ordering_key_header = Some(header.into());
        }

        /// Sets [`declare`](Self::declare).
        pub fn declare(yes: bool);
    }
}

/// A RabbitMQ queue consumer with manual acks. See the [module documentation](self).
#[derive(Debug)]
pub struct AmqpSource {
    config: AmqpConfig,
    connection: Connection,
    channel: Channel,
    consumer: Consumer,
    limit: PayloadLimit,
}

impl AmqpSource {
    /// Connects, sets the prefetch limit, (declares the queue if asked) and starts consuming.
    ///
    /// # Errors
    /// A [`SourceError`] with operation `"connect"` if the broker cannot be reached or refuses
    /// the login, `"consume"` if the queue does not exist or cannot be consumed.
    pub async fn connect(config: AmqpConfig) -> Result<Self, SourceError> {
        let name = config.queue.clone();
        let connection = Connection::connect(
            &config.url,
            ConnectionProperties::default().with_connection_name("inbox-runtime".into()),
        )
        .await
        .map_err(|e| SourceError::new(&name, "connect", e))?;
        let consume_error = |e| SourceError::new(&name, "consume", e);
        let channel = connection.create_channel().await.map_err(consume_error)?;
        channel
            .basic_qos(config.prefetch, BasicQosOptions::default())
            .await
            .map_err(consume_error)?;
        if config.declare {
            channel
                .queue_declare(
                    config.queue.as_str().into(),
                    lapin::options::QueueDeclareOptions::durable(),
                    FieldTable::default(),
                )
                .await
                .map_err(consume_error)?;
        }
        let consumer = channel
            .basic_consume(
                config.queue.as_str().into(),
                config.consumer_tag.as_str().into(),
                BasicConsumeOptions::default(),
                FieldTable::default(),
            )
            .await
            .map_err(consume_error)?;
        Ok(Self {
            config,
            connection,
            channel,
            consumer,
            limit: PayloadLimit::DEFAULT,
        })
    }

    /// The configuration it was connected with.
    pub fn config(&self) -> &AmqpConfig {
        &self.config
    }

    fn delivery(&self, delivery: lapin::message::Delivery) -> Delivery {
        let properties = &delivery.properties;
        let mut headers = BTreeMap::new();
        let mut delivery_count = None;
        if let Some(table) = properties.headers() {
            for (name, value) in table.inner() {
                if name.as_str() == "x-delivery-count" {
                    delivery_count = integer(value).map(|n| n.saturating_add(1));
                }
                if let Some(text) = text(value) {
                    headers.insert(name.as_str().to_owned(), text);
                }
            }
        }
        let message_name = header_value(&headers, self.config.name_header.as_ref())
            .or_else(|| {
                properties
                    .kind()
                    .as_ref()
                    .map(|kind| kind.as_str().to_owned())
            })
            .or_else(|| {
                self.config
                    .routes
                    .get(delivery.routing_key.as_str())
                    .cloned()
            })
            .or_else(|| {
                self.config
                    .routing_key_as_name
                    .then(|| delivery.routing_key.as_str().to_owned())
            })
            .unwrap_or_default();
        let ordering_key = header_value(&headers, self.config.ordering_key_header.as_ref());

        let mut metadata = SourceMetadata::new(&self.config.queue)
            .offset(i64::try_from(delivery.delivery_tag).unwrap_or(i64::MAX))
            .redelivered(delivery.redelivered);
        if let Some(id) = properties.message_id() {
            metadata = metadata.message_id(id.as_str());
        }
        if let Some(count) = delivery_count {
            metadata = metadata.delivery_count(count);
        }
        let mut envelope = Envelope::new(message_name, delivery.data).with_source(metadata);
        envelope.limit_to(self.limit);
        envelope.headers = headers;
        let mut delivery = Delivery::new(
            envelope,
            AmqpSettler {
                queue: self.config.queue.clone(),
                acker: delivery.acker,
            },
        );
        if let Some(key) = ordering_key {
            delivery = delivery.with_ordering_key(key);
        }
        delivery
    }
}

fn integer(value: &AMQPValue) -> Option<u64> {
    match value {
        AMQPValue::ShortShortUInt(n) => Some(u64::from(*n)),
        AMQPValue::ShortUInt(n) => Some(u64::from(*n)),
        AMQPValue::LongUInt(n) => Some(u64::from(*n)),
        AMQPValue::ShortShortInt(n) => u64::try_from(*n).ok(),
        AMQPValue::ShortInt(n) => u64::try_from(*n).ok(),
        AMQPValue::LongInt(n) => u64::try_from(*n).ok(),
        AMQPValue::LongLongInt(n) => u64::try_from(*n).ok(),
        _ => None,
    }
}

fn text(value: &AMQPValue) -> Option<String> {
    match value {
        AMQPValue::LongString(s) => Some(String::from_utf8_lossy(s.as_bytes()).into_owned()),
        AMQPValue::ShortString(s) => Some(s.as_str().to_owned()),
        AMQPValue::Boolean(b) => Some(b.to_string()),
        other => integer(other).map(|n| n.to_string()),
    }
}

struct AmqpSettler {
    queue: String,
    acker: lapin::Acker,
}

impl Settle for AmqpSettler {
    fn settle(self: Box<Self>, settlement: Settlement) -> SettleFuture {
        Box::pin(async move {
            let operation = settlement.kind();
            let sent = match settlement {
                Settlement::Ack => self.acker.ack(BasicAckOptions::default()).await,
                Settlement::Reject => {
                    self.acker
                        .nack(BasicNackOptions {
                            multiple: false,
                            requeue: false,
                        })
                        .await
                }
                Settlement::Requeue { delay } => {
                    if let Some(delay) = delay {
                        tokio::time::sleep(delay).await;
                    }
                    self.acker
                        .nack(BasicNackOptions {
                            multiple: false,
                            requeue: true,
                        })
                        .await
                }
            };
            match sent {
                Ok(true) => Ok(()),
                Ok(false) => Err(SourceError::new(
                    self.queue,
                    operation,
                    "the channel is closed (or the delivery was settled already); \
                     the broker will deliver the message again",
                )),
                Err(e) => Err(SourceError::new(self.queue, operation, e)),
            }
        })
    }
}

impl Source for AmqpSource {
    fn name(&self) -> &str {
        &self.config.queue
    }

    /// See the module documentation's "Payload limit": a body over `limit` is cut as it is
    /// handed out, its memory given back.
    fn set_payload_limit(&mut self, limit: PayloadLimit) {
        self.limit = limit;
    }

    fn next(&mut self) -> BoxFuture<'_, Result<Option<Delivery>, SourceError>> {
        Box::pin(async move {
            match self.consumer.next().await {
                Some(Ok(delivery)) => Ok(Some(self.delivery(delivery))),
                Some(Err(e)) => Err(SourceError::new(&self.config.queue, "receive", e)),
                None => Ok(None),
            }
        })
    }

    fn close(&mut self) -> BoxFuture<'_, Result<(), SourceError>> {
        Box::pin(async move {
            let close_error = |e| SourceError::new(&self.config.queue, "close", e);
            if self.channel.status().connected() {
                self.channel
                    .close(200, "OK".into())
                    .await
                    .map_err(close_error)?;
            }
            if self.connection.status().connected() {
                self.connection
                    .close(200, "OK".into())
                    .await
                    .map_err(close_error)?;
            }
            Ok(())
        })
    }
}
