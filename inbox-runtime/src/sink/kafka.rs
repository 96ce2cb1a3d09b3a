//! Kafka as a sink, on [rdkafka](https://docs.rs/rdkafka) (librdkafka). Cargo feature `kafka`.
//!
//! Each message is produced to the topic named by its destination with an **idempotent
//! producer** (`enable.idempotence=true`: `acks=all`, retries without duplicates or reordering
//! within a partition, as KIP-98 specifies), and:
//!
//! * the **record key** = the message's aggregate id, if it has one: every message of an
//!   aggregate lands in one partition, in the order the relay sends them (the relay has at most
//!   one row per aggregate out at a time); messages without an aggregate have no key (spread by
//!   librdkafka's partitioner);
//! * the headers: `message-id` = the stable message id (what the
//!   [Kafka source](crate::source::kafka) reads as
//!   [`SourceMetadata::message_id`](crate::SourceMetadata::message_id); a re-publish after a
//!   crash carries the same id, so the consuming inbox sees a duplicate), the name header
//!   (default `message-name`, what the Kafka source reads the message name from), and the
//!   publisher's headers.
//!
//! A batch is produced at once, then every **delivery report** is awaited: a message is `Ok`
//! only once the partition leader and its in-sync replicas have it. Only then does the relay mark
//! it sent.
//!
//! ```no_run
//! # async fn demo(pool: sqlx::PgPool) -> Result<(), Box<dyn std::error::Error>> {
//! use inbox_runtime::outbox::Relay;
//! use inbox_runtime::sink::kafka::KafkaSink;
//!
//! let sink = KafkaSink::new("kafka-1:9092,kafka-2:9092")?;
//! let report = Relay::new(pool, sink).run(tokio_util::sync::CancellationToken::new()).await;
//! # Ok(()) }
//! ```

use std::collections::BTreeMap;
use std::time::Duration;

use rdkafka::ClientConfig;
use rdkafka::error::{KafkaError, RDKafkaErrorCode};
use rdkafka::message::{Header, OwnedHeaders};
use rdkafka::producer::{FutureProducer, FutureRecord};

use super::{OutgoingMessage, PublishFuture, Sink, SinkError};
use crate::debug::some_fields;

/// Publishes to Kafka with an idempotent producer. Build with [`KafkaSink::new`] or
/// [`KafkaSink::with_properties`].
#[derive(Clone)]
pub struct KafkaSink {
    producer: FutureProducer,
    name_header: String,
}

impl std::fmt::Debug for KafkaSink {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        some_fields(f, "KafkaSink", &[("name_header", &self.name_header)])
    }
}

impl KafkaSink {
    /// An idempotent producer for the cluster at `brokers` (`host:port[,host:port…]`), with
    /// `message.timeout.ms` = 30 000 (a delivery report within 30 s, or a retryable error: keep
    /// the relay's lease longer).
    ///
    /// # Errors
    /// The producer could not be created (a property librdkafka refuses).
    pub fn new(brokers: &str) -> Result<Self, KafkaError> {
        Self::with_properties(brokers, &BTreeMap::new())
    }

    /// [`new`](Self::new) with further librdkafka producer properties (`security.protocol`,
    /// `sasl.*`, `ssl.*`, `compression.type`, `linger.ms`, `message.timeout.ms`, …) applied
    /// over the defaults. `enable.idempotence` stays `true` whatever they say.
    ///
    /// # Errors
    /// The producer could not be created (a property librdkafka refuses).
    pub fn with_properties(
        brokers: &str,
        properties: &BTreeMap<String, String>,
    ) -> Result<Self, KafkaError> {
        let mut config = ClientConfig::new();
        config
            .set("bootstrap.servers", brokers)
            .set("message.timeout.ms", "30000");
        for (name, value) in properties {
            config.set(name, value);
        }
        config.set("enable.idempotence", "true");
        Ok(Self {
            producer: config.create()?,
            name_header: "message-name".into(),
        })
    }

    /// The header that carries the message name (default `message-name`, as the Kafka source
    /// reads it).
    pub fn name_header(mut self, header: impl Into<String>) -> Self {
        self.name_header = header.into();
        self
    }

    fn headers(&self, message: &OutgoingMessage) -> OwnedHeaders {
        let mut headers = OwnedHeaders::new_with_capacity(message.headers.len() + 2);
        for (name, value) in &message.headers {
            if name != &self.name_header && name != "message-id" {
                headers = headers.insert(Header {
                    key: name,
                    value: Some(value.as_str()),
                });
            }
        }
        headers
            .insert(Header {
                key: &self.name_header,
                value: Some(message.message_name.as_str()),
            })
            .insert(Header {
                key: "message-id",
                value: Some(message.message_id.as_str()),
            })
    }
}

/// Whether a produce error can never succeed for this message.
fn permanent(error: &KafkaError) -> bool {
    matches!(
        error.rdkafka_error_code(),
        Some(
            RDKafkaErrorCode::MessageSizeTooLarge
                | RDKafkaErrorCode::InvalidMessageSize
                | RDKafkaErrorCode::InvalidMessage
                | RDKafkaErrorCode::InvalidRecord
                | RDKafkaErrorCode::TopicAuthorizationFailed
                | RDKafkaErrorCode::InvalidTopic
                | RDKafkaErrorCode::UnknownTopic
        )
    )
}

impl Sink for KafkaSink {
    fn publish_batch<'a>(&'a self, messages: &'a [OutgoingMessage]) -> PublishFuture<'a> {
        Box::pin(async move {
            // Produce all, then await every delivery report: one round trip for the batch.
            let sends = messages.iter().map(|message| {
                let mut record: FutureRecord<'_, str, [u8]> =
                    FutureRecord::to(&message.destination)
                        .payload(message.payload.as_slice())
                        .headers(self.headers(message));
                if let Some(aggregate) = &message.aggregate_id {
                    record = record.key(aggregate.as_str());
                }
                self.producer.send(record, Duration::from_secs(0))
            });
            futures_util::future::join_all(sends)
                .await
                .into_iter()
                .map(|sent| match sent {
                    Ok(_) => Ok(()),
                    Err((error, _)) if permanent(&error) => Err(SinkError::permanent(error)),
                    Err((error, _)) => Err(SinkError::retryable(error)),
                })
                .collect()
        })
    }
}
