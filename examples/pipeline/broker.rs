//! The brokers between the services: RabbitMQ, NATS JetStream, or an in-process stand-in.
//!
//! | | RabbitMQ (`amqp://…`) | NATS JetStream (`nats://…`) | stand-in (no URL) |
//! | --- | --- | --- | --- |
//! | `payments.captured` | durable queue `pipeline.payments` | stream `PIPELINE_PAYMENTS`, subject `pipeline.payments`, durable consumer `orders` | an in-memory queue |
//! | `orders.paid` | durable queue `pipeline.orders` (the outbox destination, on the default exchange) | stream `PIPELINE_ORDERS`, subject `pipeline.orders`, durable consumer `shipping` | an in-memory queue |
//! | relay's sink | `AmqpSink` (publisher confirms) | `NatsSink` (`Nats-Msg-Id`) | [`StandIn`] |
//!
//! Each service declares what it uses (queues, streams) at start, so they may start in any order.
//! The shipping consumer processes one customer's events one at a time (ordering key: the
//! `customer-id` header the orders service sets).

use std::sync::Arc;
use std::time::Duration;

use inbox_runtime::BoxFuture;
use inbox_runtime::sink::amqp::{AmqpSink, AmqpSinkConfig};
use inbox_runtime::sink::nats::NatsSink;
use inbox_runtime::sink::{OutgoingMessage, Sink, SinkError};
use inbox_runtime::source::amqp::{AmqpConfig, AmqpSource};
use inbox_runtime::source::memory::MemoryHandle;
use inbox_runtime::source::nats::{NatsConfig, NatsSource};
use inbox_runtime::source::{Delivery, Source, SourceError};
use inbox_runtime::{Envelope, Message as _};
use lapin::options::{BasicPublishOptions, ConfirmSelectOptions, QueueDeclareOptions};
use lapin::types::{AMQPValue, FieldTable};
use lapin::{BasicProperties, Connection, ConnectionProperties};

use crate::handlers::{CUSTOMER_HEADER, ORDERS_DESTINATION};
use crate::messages::PaymentCaptured;

/// The upstream queue (RabbitMQ) and subject (NATS).
pub(crate) const PAYMENTS_QUEUE: &str = "pipeline.payments";
/// The upstream stream (NATS).
pub(crate) const PAYMENTS_STREAM: &str = "PIPELINE_PAYMENTS";
/// The stream of the orders destination (NATS).
pub(crate) const ORDERS_STREAM: &str = "PIPELINE_ORDERS";

/// Which broker connects the services.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Broker {
    /// In-memory queues inside this process.
    InProcess,
    /// RabbitMQ at this URL.
    Amqp(String),
    /// NATS JetStream at this URL.
    Nats(String),
}

/// How the consumers behave on a broker.
#[derive(Debug, Clone, Copy)]
pub(crate) struct ConsumeOptions {
    /// Deliveries in flight (the prefetch / max ack pending).
    pub(crate) concurrency: u16,
    /// NATS: redeliver an unacked delivery after this long (for consumers created now).
    pub(crate) ack_wait: Duration,
}

impl Broker {
    /// The broker of `url` (`None`: the stand-in).
    pub(crate) fn parse(url: Option<&str>) -> Result<Broker, String> {
        match url {
            None => Ok(Broker::InProcess),
            Some(url) if url.starts_with("amqp://") || url.starts_with("amqps://") => {
                Ok(Broker::Amqp(url.to_owned()))
            }
            Some(url) if url.starts_with("nats://") || url.starts_with("tls://") => {
                Ok(Broker::Nats(url.to_owned()))
            }
            Some(url) => Err(format!(
                "unsupported broker URL `{url}`: expected amqp://… or nats://…"
            )),
        }
    }

    /// A description for the output (no credentials).
    pub(crate) fn describe(&self) -> String {
        match self {
            Broker::InProcess => "in-process stand-in (no --broker)".into(),
            Broker::Amqp(url) => format!("RabbitMQ {}", without_credentials(url)),
            Broker::Nats(url) => format!("NATS JetStream {}", without_credentials(url)),
        }
    }

    /// Deletes the demo's queues (RabbitMQ) or streams (NATS) with what they hold, so that a run
    /// on a fresh database starts from empty ones: JetStream would otherwise drop this run's
    /// `orders.paid` as re-publishes of the last run's (same message ids, within its duplicate
    /// window), and its durable consumers would resume after the last run's messages.
    pub(crate) async fn reset(&self) -> Result<(), String> {
        match self {
            Broker::InProcess => Ok(()),
            Broker::Amqp(url) => {
                let error = |e: lapin::Error| format!("RabbitMQ: cannot delete a queue: {e}");
                let connection = Connection::connect(url, ConnectionProperties::default())
                    .await
                    .map_err(error)?;
                let channel = connection.create_channel().await.map_err(error)?;
                for queue in [PAYMENTS_QUEUE, ORDERS_DESTINATION] {
                    channel
                        .queue_delete(queue.into(), Default::default())
                        .await
                        .map_err(error)?;
                }
                connection.close(200, "OK".into()).await.ok();
                Ok(())
            }
            Broker::Nats(url) => {
                let client = async_nats::connect(url)
                    .await
                    .map_err(|e| format!("NATS: cannot connect: {e}"))?;
                let context = async_nats::jetstream::new(client);
                for stream in [PAYMENTS_STREAM, ORDERS_STREAM] {
                    if context.get_stream(stream).await.is_ok() {
                        context
                            .delete_stream(stream)
                            .await
                            .map_err(|e| format!("NATS: cannot delete stream {stream}: {e}"))?;
                    }
                }
                Ok(())
            }
        }
    }

    /// Publishes `deliveries` upstream (RabbitMQ: persistent, confirmed, `message_id` = event
    /// id; NATS: acked by the stream, no `Nats-Msg-Id`, so that its redeliveries reach the
    /// orders service as a producer's retries would). Returns how many were published.
    pub(crate) async fn produce(&self, deliveries: &[PaymentCaptured]) -> Result<u64, String> {
        match self {
            Broker::InProcess => {
                Err("produce needs a broker: --broker amqp://… or nats://…".into())
            }
            Broker::Amqp(url) => produce_amqp(url, deliveries).await,
            Broker::Nats(url) => produce_nats(url, deliveries).await,
        }
        .map(|()| deliveries.len() as u64)
    }

    /// A consumer of `payments.captured` (the orders service's).
    pub(crate) async fn payments_source(
        &self,
        options: ConsumeOptions,
    ) -> Result<Box<dyn Source>, String> {
        self.source(PAYMENTS_QUEUE, PAYMENTS_STREAM, "orders", None, options)
            .await
    }

    /// A consumer of `orders.paid` (the shipping service's), one customer at a time.
    pub(crate) async fn orders_source(
        &self,
        options: ConsumeOptions,
    ) -> Result<Box<dyn Source>, String> {
        self.source(
            ORDERS_DESTINATION,
            ORDERS_STREAM,
            "shipping",
            Some(CUSTOMER_HEADER),
            options,
        )
        .await
    }

    async fn source(
        &self,
        queue: &str,
        stream: &str,
        consumer: &str,
        ordering_key_header: Option<&str>,
        options: ConsumeOptions,
    ) -> Result<Box<dyn Source>, String> {
        match self {
            Broker::InProcess => Err("the stand-in has no consumer of its own".into()),
            Broker::Amqp(url) => {
                let mut config = AmqpConfig::new(url, queue)
                    .prefetch(options.concurrency)
                    .declare(true);
                if let Some(header) = ordering_key_header {
                    config = config.ordering_key_header(header);
                }
                let source = AmqpSource::connect(config)
                    .await
                    .map_err(|e| e.to_string())?;
                Ok(Box::new(source))
            }
            Broker::Nats(url) => {
                ensure_stream(url, stream, queue).await?;
                let mut config = NatsConfig::new(url, stream, consumer)
                    .ack_wait(options.ack_wait)
                    .max_ack_pending(i64::from(options.concurrency));
                if let Some(header) = ordering_key_header {
                    config = config.ordering_key_header(header);
                }
                let source = NatsSource::connect(config)
                    .await
                    .map_err(|e| e.to_string())?;
                Ok(Box::new(source))
            }
        }
    }

    /// The relay's sink for the orders destination (not for the stand-in: see [`StandIn`]).
    pub(crate) async fn sink(&self) -> Result<Arc<dyn Sink>, String> {
        match self {
            Broker::InProcess => Err("the stand-in's sink is made with its queue".into()),
            Broker::Amqp(url) => {
                // The destination is the queue's name: the default mapping, declared here.
                let config = AmqpSinkConfig::new(url).declare(true);
                let sink = AmqpSink::connect(config).await.map_err(|e| e.to_string())?;
                Ok(Arc::new(sink))
            }
            Broker::Nats(url) => {
                ensure_stream(url, ORDERS_STREAM, ORDERS_DESTINATION).await?;
                let sink = NatsSink::connect(url)
                    .await
                    .map_err(|e| format!("NATS: cannot connect: {e}"))?;
                Ok(Arc::new(sink))
            }
        }
    }
}

/// `url` without a password.
fn without_credentials(url: &str) -> String {
    match (url.split_once("://"), url.rfind('@')) {
        (Some((scheme, _)), Some(at)) => format!("{scheme}://…{}", &url[at..]),
        _ => url.to_owned(),
    }
}

/// Creates the JetStream stream `name` on `subject` if it does not exist (a duplicate window of
/// 10 minutes: longer than any relay lease, so that a re-publish is dropped).
async fn ensure_stream(url: &str, name: &str, subject: &str) -> Result<(), String> {
    let client = async_nats::connect(url)
        .await
        .map_err(|e| format!("NATS: cannot connect: {e}"))?;
    let context = async_nats::jetstream::new(client.clone());
    context
        .get_or_create_stream(async_nats::jetstream::stream::Config {
            name: name.to_owned(),
            subjects: vec![subject.to_owned()],
            duplicate_window: Duration::from_secs(600),
            ..Default::default()
        })
        .await
        .map_err(|e| format!("NATS: cannot create stream {name}: {e}"))?;
    Ok(())
}

async fn produce_amqp(url: &str, deliveries: &[PaymentCaptured]) -> Result<(), String> {
    let error = |what: &'static str| move |e: lapin::Error| format!("RabbitMQ: {what}: {e}");
    let connection = Connection::connect(url, ConnectionProperties::default())
        .await
        .map_err(error("cannot connect"))?;
    let channel = connection
        .create_channel()
        .await
        .map_err(error("channel"))?;
    channel
        .confirm_select(ConfirmSelectOptions::default())
        .await
        .map_err(error("confirm.select"))?;
    channel
        .queue_declare(
            PAYMENTS_QUEUE.into(),
            QueueDeclareOptions::durable(),
            FieldTable::default(),
        )
        .await
        .map_err(error("queue.declare"))?;
    for chunk in deliveries.chunks(1000) {
        let mut confirms = Vec::with_capacity(chunk.len());
        for payment in chunk {
            let body = serde_json::to_vec(payment).expect("a payment serializes");
            let mut headers = FieldTable::default();
            headers.insert(
                "message-name".into(),
                AMQPValue::LongString(PaymentCaptured::NAME.into()),
            );
            let properties = BasicProperties::default()
                .with_delivery_mode(2)
                .with_content_type("application/json".into())
                .with_message_id(payment.event_id.to_string().into())
                .with_headers(headers);
            let confirm = channel
                .basic_publish(
                    "".into(),
                    PAYMENTS_QUEUE.into(),
                    BasicPublishOptions::default(),
                    &body,
                    properties,
                )
                .await
                .map_err(error("basic.publish"))?;
            confirms.push(confirm);
        }
        for confirm in confirms {
            if !confirm.await.map_err(error("publisher confirm"))?.is_ack() {
                return Err("RabbitMQ refused a message (nack)".into());
            }
        }
    }
    channel.close(200, "OK".into()).await.ok();
    connection.close(200, "OK".into()).await.ok();
    Ok(())
}

async fn produce_nats(url: &str, deliveries: &[PaymentCaptured]) -> Result<(), String> {
    ensure_stream(url, PAYMENTS_STREAM, PAYMENTS_QUEUE).await?;
    let client = async_nats::connect(url)
        .await
        .map_err(|e| format!("NATS: cannot connect: {e}"))?;
    let context = async_nats::jetstream::new(client.clone());
    for chunk in deliveries.chunks(1000) {
        let mut acks = Vec::with_capacity(chunk.len());
        for payment in chunk {
            let mut headers = async_nats::HeaderMap::new();
            headers.insert("message-name", PaymentCaptured::NAME);
            let body = serde_json::to_vec(payment).expect("a payment serializes");
            let ack = context
                .publish_with_headers(PAYMENTS_QUEUE, headers, body.into())
                .await
                .map_err(|e| format!("NATS: publish: {e}"))?;
            acks.push(ack);
        }
        for ack in acks {
            ack.await
                .map_err(|e| format!("NATS: publish not acknowledged: {e}"))?;
        }
    }
    client
        .flush()
        .await
        .map_err(|e| format!("NATS: flush: {e}"))?;
    Ok(())
}

/// The broker stand-in's sink: puts each message into an in-memory queue (a
/// [`MemorySource`](inbox_runtime::source::memory::MemorySource), which the shipping worker
/// consumes), keyed by its customer.
#[derive(Debug, Clone)]
pub(crate) struct StandIn(pub(crate) MemoryHandle);

impl Sink for StandIn {
    fn publish_batch<'a>(
        &'a self,
        messages: &'a [OutgoingMessage],
    ) -> BoxFuture<'a, Vec<Result<(), SinkError>>> {
        Box::pin(async move {
            messages
                .iter()
                .map(|message| {
                    let mut envelope =
                        Envelope::new(message.message_name.clone(), message.payload.clone());
                    for (name, value) in &message.headers {
                        envelope = envelope.with_header(name.clone(), value.clone());
                    }
                    match message.headers.get(CUSTOMER_HEADER) {
                        Some(customer) => self.0.push_keyed(envelope, customer.clone()),
                        None => self.0.push(envelope),
                    };
                    Ok(())
                })
                .collect()
        })
    }
}

/// A source that prints one line per delivery on stdout before handing it on:
/// `delivery: <source> id=<message id or -> redelivered=<true|false>` (for the crash test, which
/// counts redeliveries and re-publishes from them).
pub(crate) struct Traced(pub(crate) Box<dyn Source>);

impl Source for Traced {
    fn name(&self) -> &str {
        self.0.name()
    }

    fn next(&mut self) -> BoxFuture<'_, Result<Option<Delivery>, SourceError>> {
        Box::pin(async move {
            let delivery = self.0.next().await?;
            if let Some(delivery) = &delivery {
                let envelope = delivery.envelope();
                let meta = envelope.source.as_ref();
                println!(
                    "delivery: {} id={} redelivered={}",
                    self.0.name(),
                    meta.and_then(|m| m.message_id.as_deref()).unwrap_or("-"),
                    meta.is_some_and(|m| m.redelivered)
                );
            }
            Ok(delivery)
        })
    }

    fn close(&mut self) -> BoxFuture<'_, Result<(), SourceError>> {
        self.0.close()
    }
}
