//! RabbitMQ (AMQP 0-9-1) as a sink, on [lapin](https://docs.rs/lapin). Cargo feature `amqp`.
//!
//! ```no_run
//! # async fn demo(pool: sqlx::PgPool) -> Result<(), Box<dyn std::error::Error>> {
//! use inbox_runtime::outbox::Relay;
//! use inbox_runtime::sink::amqp::{AmqpSink, AmqpSinkConfig};
//!
//! let config = AmqpSinkConfig::new("amqp://guest:guest@127.0.0.1:5672/%2f")
//!     .route("orders.events", "orders", "orders.paid") // destination → exchange, routing key
//!     .declare(true); // durable queues for destinations on the default exchange
//! let sink = AmqpSink::connect(config).await?;
//! let report = Relay::new(pool, sink).run(tokio_util::sync::CancellationToken::new()).await;
//! # Ok(()) }
//! ```
//!
//! **Where a message goes**: a destination with a [`route`](AmqpSinkConfig::route) is published
//! to that exchange with that routing key; any other destination to the **default exchange**
//! (`""`) with the destination as routing key, which RabbitMQ delivers to the queue of that name.
//! With [`declare`](AmqpSinkConfig::declare), the sink declares that queue (durable, no
//! arguments) before its first publish on each connection; routes to named exchanges are never
//! declared (exchanges and bindings are the topology's business).
//!
//! **What each message carries**, so that [`AmqpSource`](crate::source::amqp::AmqpSource) reads
//! back the same [`Envelope`](crate::Envelope) and
//! [`SourceMetadata::message_id`](crate::SourceMetadata::message_id):
//!
//! | AMQP | from |
//! | --- | --- |
//! | `message_id` property | [`OutgoingMessage::message_id`] (at most 255 bytes) |
//! | header [`name_header`](AmqpSinkConfig::name_header) (default `message-name`, what the source reads first) | [`OutgoingMessage::message_name`]; it wins over a publisher's header of the same name |
//! | `type` property | the message name too, when it fits (255 bytes), for consumers that read it there |
//! | headers table (long strings) | [`OutgoingMessage::headers`] |
//! | `delivery_mode` 2 (persistent), `content_type` ([`content_type`](AmqpSinkConfig::content_type), default `application/json`), `timestamp` (seconds, the publish time) | — |
//! | body | [`OutgoingMessage::payload`] |
//!
//! **Confirms**: the channel is in confirm mode and every message is published `mandatory`. A
//! batch is sent pipelined, then every confirm is awaited (at most
//! [`confirm_timeout`](AmqpSinkConfig::confirm_timeout) for the batch): a message is `Ok` only
//! once RabbitMQ acked it without returning it — for a persistent message to a durable queue,
//! once it is written to disk (RabbitMQ's publisher-confirm semantics).
//!
//! **Errors**, each an [`AmqpSinkError`] inside the [`SinkError`]:
//! * **retryable** (the relay retries the row with backoff, then dead-letters it after its
//!   maximum attempts): the broker unreachable or the login refused, a connection or channel
//!   error (a broker restart, a publish to an exchange that does not exist: RabbitMQ closes the
//!   channel), a `basic.nack` (RabbitMQ could not store the message), a message returned as
//!   unroutable (no queue bound to the routing key *yet*: topology deployed after the service is a
//!   common, passing state), no confirm within the timeout. A message whose confirm was lost may
//!   have been stored: its re-publish carries the same `message_id` for the consumer's inbox to
//!   deduplicate.
//! * **permanent** (the row goes `dead` at once): what AMQP cannot carry — a message id, header
//!   name, exchange or routing key longer than 255 bytes (AMQP short strings), or a payload larger
//!   than [`max_message_bytes`](AmqpSinkConfig::max_message_bytes).
//!
//! **Reconnects**: after a connection or channel error, or a confirm timeout, the sink drops its
//! connection; the next batch connects again (and declares its queues again). Nothing is retried
//! inside the sink: the relay owns retries and their backoff.
//!
//! One connection with one channel per sink; a batch holds the channel until its confirms are in.
//! Give each relay its own sink to publish in parallel.

use std::collections::{BTreeMap, HashSet};
use std::time::{Duration, SystemTime};

use lapin::options::{BasicPublishOptions, ConfirmSelectOptions, QueueDeclareOptions};
use lapin::types::{AMQPValue, FieldTable, LongString, ShortString};
use lapin::{BasicProperties, Channel, Confirmation, Connection, ConnectionProperties};

use super::{OutgoingMessage, PublishFuture, Sink, SinkError};
use crate::debug::some_fields;
use crate::setters::setters;

/// An exchange and a routing key: where [`AmqpSink`] publishes one destination's messages.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct AmqpRoute {
    /// The exchange (`""`: the default exchange, which routes to the queue named by the routing
    /// key).
    pub exchange: String,
    /// The routing key.
    pub routing_key: String,
}

/// How [`AmqpSink`] connects and publishes. Build with [`AmqpSinkConfig::new`] and the setters.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct AmqpSinkConfig {
    /// The broker: `amqp://user:password@host:port/vhost` (vhost URL-encoded: `%2f` is `/`);
    /// `amqps://` for TLS.
    pub url: String,
    /// Destination → exchange and routing key. A destination not listed goes to the default
    /// exchange with the destination as routing key (the queue of that name).
    pub routes: BTreeMap<String, AmqpRoute>,
    /// Declare (durable, no arguments) the queue of each destination published to the default
    /// exchange, once per connection, before publishing to it. Default `false`.
    pub declare: bool,
    /// The header carrying the message name. Default `Some("message-name")`, what
    /// [`AmqpConfig`](crate::source::amqp::AmqpConfig) reads it from; `None`: the name goes in the
    /// `type` property only (then at most 255 bytes).
    pub name_header: Option<String>,
    /// The `content_type` property. Default `Some("application/json")`.
    pub content_type: Option<String>,
    /// How long a batch's confirms may take, from its first publish. Default 30 s.
    pub confirm_timeout: Duration,
    /// The largest payload published, in bytes; a larger one is a permanent error. Default
    /// 16 MiB (16,777,216 bytes), RabbitMQ 4's default `max_message_size`.
    pub max_message_bytes: usize,
}

impl AmqpSinkConfig {
    /// Publish to the broker at `url`, with the defaults listed on the fields.
    pub fn new(url: impl Into<String>) -> Self {
        Self {
            url: url.into(),
            routes: BTreeMap::new(),
            declare: false,
            name_header: Some("message-name".into()),
            content_type: Some("application/json".into()),
            confirm_timeout: Duration::from_secs(30),
            max_message_bytes: 16 * 1024 * 1024,
        }
    }

    /// Sends `destination`'s messages to `exchange` with `routing_key` (see
    /// [`routes`](Self::routes)).
    pub fn route(
        mut self,
        destination: impl Into<String>,
        exchange: impl Into<String>,
        routing_key: impl Into<String>,
    ) -> Self {
        self.routes.insert(
            destination.into(),
            AmqpRoute {
                exchange: exchange.into(),
                routing_key: routing_key.into(),
            },
        );
        self
    }

    setters! {
        /// Sets [`declare`](Self::declare).
        pub fn declare(yes: bool);

        /// Sets [`name_header`](Self::name_header).
        pub fn name_header(header: Option<String>);

        /// Sets [`content_type`](Self::content_type).
        pub fn content_type(content_type: Option<String>);

        /// Sets [`confirm_timeout`](Self::confirm_timeout).
        pub fn confirm_timeout(timeout: Duration);

        /// Sets [`max_message_bytes`](Self::max_message_bytes).
        pub fn max_message_bytes(bytes: usize);
    }

    /// Where `destination`'s messages go.
    pub fn route_of(&self, destination: &str) -> AmqpRoute {
        self.routes
            .get(destination)
            .cloned()
            .unwrap_or_else(|| AmqpRoute {
                exchange: String::new(),
                routing_key: destination.to_owned(),
            })
    }
}

/// Why [`AmqpSink`] did not publish a message: the error inside its [`SinkError`] (see the
/// [module documentation](self) for which are permanent).
#[derive(Debug, Clone, thiserror::Error)]
#[non_exhaustive]
pub enum AmqpSinkError {
    /// Connecting, opening the channel or turning on confirms failed (retryable).
    #[error("cannot connect to RabbitMQ: {0}")]
    Connect(#[source] Box<lapin::Error>),
    /// Declaring the destination's queue failed (retryable).
    #[error("cannot declare queue {queue:?}: {error}")]
    Declare {
        /// The queue.
        queue: String,
        /// lapin's error.
        #[source]
        error: Box<lapin::Error>,
    },
    /// The publish or its confirm failed on the connection or channel (retryable; the sink
    /// reconnects for the next batch).
    #[error("publish to exchange {exchange:?} with routing key {routing_key:?} failed: {error}")]
    Publish {
        /// The exchange.
        exchange: String,
        /// The routing key.
        routing_key: String,
        /// lapin's error.
        #[source]
        error: Box<lapin::Error>,
    },
    /// RabbitMQ answered `basic.nack`: it could not store the message (retryable).
    #[error(
        "RabbitMQ refused the message (basic.nack) on exchange {exchange:?}, routing key {routing_key:?}"
    )]
    Nacked {
        /// The exchange.
        exchange: String,
        /// The routing key.
        routing_key: String,
    },
    /// RabbitMQ returned the message: no queue is bound to its routing key (retryable: the queue
    /// may be declared later).
    #[error(
        "unroutable: RabbitMQ returned the message ({reply_code} {reply_text}): no queue bound to \
         exchange {exchange:?} with routing key {routing_key:?}"
    )]
    Unroutable {
        /// The exchange.
        exchange: String,
        /// The routing key.
        routing_key: String,
        /// The AMQP reply code (312 `NO_ROUTE`).
        reply_code: u16,
        /// The broker's reply text.
        reply_text: String,
    },
    /// Not sent: an earlier publish of the same batch failed on the channel (retryable).
    #[error("not sent: the channel failed earlier in this batch")]
    NotSent,
    /// No confirm came within the confirm timeout (retryable; the message may have been stored,
    /// and the sink reconnects).
    #[error("no publisher confirm within {timeout:?}")]
    ConfirmTimeout {
        /// The timeout.
        timeout: Duration,
    },
    /// A value that must be an AMQP short string is longer than 255 bytes (permanent).
    #[error("the {what} is {length} bytes; AMQP allows at most 255")]
    TooLong {
        /// What: `message id`, `header name "…"`, `exchange`, `routing key`, `message name`.
        what: String,
        /// Its length in bytes.
        length: usize,
    },
    /// The payload is larger than the configured maximum (permanent).
    #[error("the payload is {length} bytes, more than the maximum of {max} bytes")]
    TooLarge {
        /// The payload's length in bytes.
        length: usize,
        /// [`AmqpSinkConfig::max_message_bytes`].
        max: usize,
    },
}

/// The connection, its confirm-mode channel, and the queues declared on it.
struct Link {
    connection: Connection,
    channel: Channel,
    declared: HashSet<String>,
}

impl Link {
    fn usable(&self) -> bool {
        self.connection.status().connected() && self.channel.status().connected()
    }

    async fn close(self) {
        if self.channel.status().connected() {
            let _ = self.channel.close(200, "OK".into()).await;
        }
        if self.connection.status().connected() {
            let _ = self.connection.close(200, "OK".into()).await;
        }
    }
}

/// Publishes outbox messages to RabbitMQ with publisher confirms. See the
/// [module documentation](self).
pub struct AmqpSink {
    config: AmqpSinkConfig,
    link: tokio::sync::Mutex<Option<Link>>,
}

impl std::fmt::Debug for AmqpSink {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        some_fields(
            f,
            "AmqpSink",
            &[
                ("routes", &self.config.routes),
                ("declare", &self.config.declare),
            ],
        )
    }
}

/// One message ready to send, or why it cannot be.
struct Prepared<'a> {
    route: AmqpRoute,
    properties: BasicProperties,
    payload: &'a [u8],
}

fn short(what: impl FnOnce() -> String, value: &str) -> Result<ShortString, AmqpSinkError> {
    ShortString::try_new(value).map_err(|_| AmqpSinkError::TooLong {
        what: what(),
        length: value.len(),
    })
}

impl AmqpSink {
    /// Connects to the broker (so that a wrong URL or login fails at start, not at the first
    /// publish). Later connections are opened as needed, see the [module documentation](self).
    ///
    /// # Errors
    /// [`AmqpSinkError::Connect`] if the broker cannot be reached, refuses the login, or refuses
    /// confirm mode.
    pub async fn connect(config: AmqpSinkConfig) -> Result<Self, AmqpSinkError> {
        let link = Self::open(&config).await?;
        Ok(Self {
            config,
            link: tokio::sync::Mutex::new(Some(link)),
        })
    }

    /// The configuration.
    pub fn config(&self) -> &AmqpSinkConfig {
        &self.config
    }

    async fn open(config: &AmqpSinkConfig) -> Result<Link, AmqpSinkError> {
        let connection = Connection::connect(
            &config.url,
            ConnectionProperties::default().with_connection_name("inbox-runtime relay".into()),
        )
        .await
        .map_err(|e| AmqpSinkError::Connect(Box::new(e)))?;
        let channel = match connection.create_channel().await {
            Ok(channel) => channel,
            Err(error) => {
                let _ = connection.close(200, "OK".into()).await;
                return Err(AmqpSinkError::Connect(Box::new(error)));
            }
        };
        if let Err(error) = channel
            .confirm_select(ConfirmSelectOptions::default())
            .await
        {
            let _ = connection.close(200, "OK".into()).await;
            return Err(AmqpSinkError::Connect(Box::new(error)));
        }
        Ok(Link {
            connection,
            channel,
            declared: HashSet::new(),
        })
    }

    /// The AMQP form of `message`, or the permanent reason it has none.
    fn prepare<'a>(
        &self,
        message: &'a OutgoingMessage,
        timestamp: u64,
    ) -> Result<Prepared<'a>, AmqpSinkError> {
        if message.payload.len() > self.config.max_message_bytes {
            return Err(AmqpSinkError::TooLarge {
                length: message.payload.len(),
                max: self.config.max_message_bytes,
            });
        }
        let route = self.config.route_of(&message.destination);
        short(|| "exchange".into(), &route.exchange)?;
        short(|| "routing key".into(), &route.routing_key)?;
        let mut headers = FieldTable::default();
        for (name, value) in &message.headers {
            headers.insert(
                short(|| format!("header name {name:?}"), name)?,
                AMQPValue::LongString(LongString::from(value.as_str())),
            );
        }
        if let Some(header) = &self.config.name_header {
            headers.insert(
                short(|| format!("header name {header:?}"), header)?,
                AMQPValue::LongString(LongString::from(message.message_name.as_str())),
            );
        }
        let mut properties = BasicProperties::default()
            .with_message_id(short(|| "message id".into(), &message.message_id)?)
            .with_delivery_mode(2)
            .with_timestamp(timestamp)
            .with_headers(headers);
        match ShortString::try_new(message.message_name.as_str()) {
            Ok(kind) => properties = properties.with_type(kind),
            Err(_) if self.config.name_header.is_some() => {}
            Err(_) => {
                return Err(AmqpSinkError::TooLong {
                    what: "message name".into(),
                    length: message.message_name.len(),
                });
            }
        }
        if let Some(content_type) = &self.config.content_type {
            properties =
                properties.with_content_type(short(|| "content type".into(), content_type)?);
        }
        Ok(Prepared {
            route,
            properties,
            payload: &message.payload,
        })
    }

    /// Publishes the prepared messages on `link`; one result per entry of `prepared` (`None`:
    /// not prepared, skipped). Returns whether the link is still usable.
    async fn send(
        &self,
        link: &mut Link,
        prepared: &[Option<Prepared<'_>>],
        results: &mut [Option<Result<(), SinkError>>],
    ) -> bool {
        let mut healthy = true;
        // A timeout no clock can add (`Duration::MAX`): a year, which is "without end" here.
        let now = tokio::time::Instant::now();
        let deadline = now
            .checked_add(self.config.confirm_timeout)
            .unwrap_or_else(|| now + Duration::from_secs(365 * 86_400));
        let mut confirms = Vec::with_capacity(prepared.len());
        for (index, entry) in prepared.iter().enumerate() {
            let Some(message) = entry else { continue };
            if !healthy {
                results[index] = Some(Err(SinkError::retryable(AmqpSinkError::NotSent)));
                continue;
            }
            if let Err(error) = self.declare(link, &message.route).await {
                results[index] = Some(Err(error));
                healthy = link.usable();
                continue;
            }
            match publish(link, message).await {
                Ok(confirm) => confirms.push((index, confirm)),
                Err(error) => {
                    healthy = false;
                    results[index] = Some(Err(error));
                }
            }
        }
        for (index, confirm) in confirms {
            let route = &prepared[index].as_ref().expect("published").route;
            let confirmed = tokio::time::timeout_at(deadline, confirm).await;
            let (result, usable) = self.confirmed(route, confirmed);
            healthy &= usable;
            results[index] = Some(result);
        }
        healthy && link.usable()
    }

    /// Declares the queue of `route` (durable) on `link` the first time it is used, when the
    /// sink declares queues and the route publishes through the default exchange.
    async fn declare(&self, link: &mut Link, route: &AmqpRoute) -> Result<(), SinkError> {
        if !self.config.declare
            || !route.exchange.is_empty()
            || link.declared.contains(&route.routing_key)
        {
            return Ok(());
        }
        let declared = link
            .channel
            .queue_declare(
                route.routing_key.as_str().into(),
                QueueDeclareOptions::durable(),
                FieldTable::default(),
            )
            .await;
        match declared {
            Ok(_) => {
                link.declared.insert(route.routing_key.clone());
                Ok(())
            }
            Err(error) => Err(SinkError::retryable(AmqpSinkError::Declare {
                queue: route.routing_key.clone(),
                error: Box::new(error),
            })),
        }
    }

    /// The result of one message from its publisher confirm (`confirmed`: the broker's answer,
    /// or the confirm timeout passed), and whether the link is still usable after it.
    fn confirmed(
        &self,
        route: &AmqpRoute,
        confirmed: Result<Result<Confirmation, lapin::Error>, tokio::time::error::Elapsed>,
    ) -> (Result<(), SinkError>, bool) {
        let result = match confirmed {
            Ok(Ok(Confirmation::Ack(None) | Confirmation::NotRequested)) => Ok(()),
            Ok(Ok(Confirmation::Ack(Some(returned)))) => {
                Err(SinkError::retryable(AmqpSinkError::Unroutable {
                    exchange: route.exchange.clone(),
                    routing_key: route.routing_key.clone(),
                    reply_code: returned.reply_code,
                    reply_text: returned.reply_text.as_str().to_owned(),
                }))
            }
            Ok(Ok(Confirmation::Nack(_))) => Err(SinkError::retryable(AmqpSinkError::Nacked {
                exchange: route.exchange.clone(),
                routing_key: route.routing_key.clone(),
            })),
            Ok(Err(error)) => {
                return (
                    Err(SinkError::retryable(publish_error(route, error))),
                    false,
                );
            }
            Err(_) => {
                return (
                    Err(SinkError::retryable(AmqpSinkError::ConfirmTimeout {
                        timeout: self.config.confirm_timeout,
                    })),
                    false,
                );
            }
        };
        (result, true)
    }
}

/// Publishes one prepared message on `link` (mandatory): its publisher confirm, to await.
async fn publish(
    link: &Link,
    message: &Prepared<'_>,
) -> Result<lapin::PublisherConfirm, SinkError> {
    let route = &message.route;
    link.channel
        .basic_publish(
            route.exchange.as_str().into(),
            route.routing_key.as_str().into(),
            BasicPublishOptions {
                mandatory: true,
                immediate: false,
            },
            message.payload,
            message.properties.clone(),
        )
        .await
        .map_err(|error| SinkError::retryable(publish_error(route, error)))
}

/// A publish to `route` that failed with `error`.
fn publish_error(route: &AmqpRoute, error: lapin::Error) -> AmqpSinkError {
    AmqpSinkError::Publish {
        exchange: route.exchange.clone(),
        routing_key: route.routing_key.clone(),
        error: Box::new(error),
    }
}

impl Sink for AmqpSink {
    fn publish_batch<'a>(&'a self, messages: &'a [OutgoingMessage]) -> PublishFuture<'a> {
        Box::pin(async move {
            let timestamp = SystemTime::now()
                .duration_since(SystemTime::UNIX_EPOCH)
                .map_or(0, |d| d.as_secs());
            let mut results: Vec<Option<Result<(), SinkError>>> =
                (0..messages.len()).map(|_| None).collect();
            let prepared: Vec<Option<Prepared<'_>>> = messages
                .iter()
                .zip(results.iter_mut())
                .map(|(message, result)| match self.prepare(message, timestamp) {
                    Ok(prepared) => Some(prepared),
                    Err(error) => {
                        *result = Some(Err(SinkError::permanent(error)));
                        None
                    }
                })
                .collect();
            if prepared.iter().any(Option::is_some) {
                let mut guard = self.link.lock().await;
                if let Some(stale) = guard.take_if(|link| !link.usable()) {
                    stale.close().await;
                }
                let link = match guard.as_mut() {
                    Some(link) => Ok(link),
                    None => match Self::open(&self.config).await {
                        Ok(link) => Ok(guard.insert(link)),
                        Err(error) => Err(error),
                    },
                };
                match link {
                    Ok(link) => {
                        if !self.send(link, &prepared, &mut results).await
                            && let Some(broken) = guard.take()
                        {
                            tracing::warn!(
                                "AMQP sink: connection or channel lost; reconnecting for the next batch"
                            );
                            broken.close().await;
                        }
                    }
                    Err(error) => {
                        for (entry, result) in prepared.iter().zip(results.iter_mut()) {
                            if entry.is_some() {
                                *result = Some(Err(SinkError::retryable(error.clone())));
                            }
                        }
                    }
                }
            }
            results
                .into_iter()
                .map(|result| result.expect("every message has a result"))
                .collect()
        })
    }
}
