//! Sinks: where the outbox [`Relay`](crate::outbox::Relay) sends messages. One trait, [`Sink`];
//! [`MemorySink`] for tests and demos; one module per broker, each behind its cargo feature
//! (`amqp`: `amqp::AmqpSink`, RabbitMQ with publisher confirms; `nats`: `nats::NatsSink`;
//! `kafka`: `kafka::KafkaSink`; `sqs`: `sqs::SqsSink`, Amazon SQS with the message id as FIFO
//! deduplication id).
//!
//! Every [`OutgoingMessage`] carries its stable message id; a sink must send it where the
//! broker's duplicate detection and this crate's sources read it (for NATS: the `Nats-Msg-Id`
//! header; for RabbitMQ: the `message_id` property; the sources read either back as
//! [`SourceMetadata::message_id`](crate::SourceMetadata::message_id)), together with the
//! message name and the headers, so that a consumer's [`Envelope`](crate::Envelope) has the
//! same name, payload and headers.

#[cfg(feature = "amqp")]
pub mod amqp;
#[cfg(feature = "kafka")]
pub mod kafka;
#[cfg(feature = "nats")]
pub mod nats;
#[cfg(feature = "sqs")]
pub mod sqs;

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

use crate::BoxFuture;
use crate::debug::some_fields;
use crate::types::classify::BoxError;

/// One message the relay hands a sink.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct OutgoingMessage {
    /// The stable message id: the same on every publish of this row.
    pub message_id: String,
    /// Where to send it (a subject, an exchange), as written by the publisher.
    pub destination: String,
    /// The message's routing name.
    pub message_name: String,
    /// The payload bytes (JSON for messages of this crate).
    pub payload: Vec<u8>,
    /// The publisher's headers, name → value.
    pub headers: BTreeMap<String, String>,
    /// The aggregate, if any.
    pub aggregate_id: Option<String>,
    /// Which attempt to publish this row this is (1 for the first).
    pub attempt: u32,
}

/// A failed publish of one message.
#[derive(Debug, thiserror::Error)]
#[error("{}: {source}", if *.permanent { "permanent" } else { "retryable" })]
pub struct SinkError {
    permanent: bool,
    #[source]
    source: BoxError,
}

impl SinkError {
    /// A failure worth another try later (broker unreachable, no confirm, timeout): the relay
    /// retries the row with backoff and dead-letters it after its maximum attempts.
    pub fn retryable(source: impl Into<BoxError>) -> Self {
        Self {
            permanent: false,
            source: source.into(),
        }
    }

    /// A failure that will never succeed (message too large, destination refused): the row goes
    /// `dead` at once.
    pub fn permanent(source: impl Into<BoxError>) -> Self {
        Self {
            permanent: true,
            source: source.into(),
        }
    }

    /// Whether the failure is permanent.
    pub fn is_permanent(&self) -> bool {
        self.permanent
    }
}

/// A destination for the relay's messages.
///
/// [`publish_batch`](Self::publish_batch) sends `messages` (rows of different aggregates, in id
/// order) and answers one result per message, in the same order: `Ok` once the broker has the
/// message durably (publisher confirm, JetStream ack). The relay marks the `Ok` ones sent and
/// records the errors. A sink may be called again with a message it already published (after a
/// crash before the relay marked it, or after an error on a publish that did land): it must
/// send the same [`OutgoingMessage::message_id`] so that the broker or the consumer deduplicates.
pub trait Sink: Send + Sync + 'static {
    /// Publishes `messages`; one result per message, in order.
    fn publish_batch<'a>(&'a self, messages: &'a [OutgoingMessage]) -> PublishFuture<'a>;
}

/// What [`Sink::publish_batch`] returns: a boxed future of one result per message, in the
/// order of the messages (the same type as `BoxFuture<'a, Vec<Result<(), SinkError>>>`, which
/// an implementation may write instead).
pub type PublishFuture<'a> = BoxFuture<'a, Vec<Result<(), SinkError>>>;

impl<S: Sink + ?Sized> Sink for Arc<S> {
    fn publish_batch<'a>(&'a self, messages: &'a [OutgoingMessage]) -> PublishFuture<'a> {
        (**self).publish_batch(messages)
    }
}

/// What a [`MemorySink`]'s failure rule answers for a message: `None` to accept it.
type FailRule = dyn Fn(&OutgoingMessage) -> Option<SinkError> + Send + Sync;

/// A sink that keeps what it is given, in order, in memory: for tests and demos. Clones share
/// the same messages.
///
/// ```
/// use inbox_runtime::sink::MemorySink;
/// let sink = MemorySink::new();
/// assert!(sink.published().is_empty());
/// ```
#[derive(Clone, Default)]
pub struct MemorySink {
    published: Arc<Mutex<Vec<OutgoingMessage>>>,
    fail: Option<Arc<FailRule>>,
}

impl std::fmt::Debug for MemorySink {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        some_fields(
            f,
            "MemorySink",
            &[("published", &self.published.lock().map(|p| p.len()))],
        )
    }
}

impl MemorySink {
    /// An empty sink that accepts everything.
    pub fn new() -> Self {
        Self::default()
    }

    /// Refuses the messages for which `rule` returns an error (they are not kept).
    pub fn fail_when(
        mut self,
        rule: impl Fn(&OutgoingMessage) -> Option<SinkError> + Send + Sync + 'static,
    ) -> Self {
        self.fail = Some(Arc::new(rule));
        self
    }

    /// Every message accepted so far, in the order it was published (re-publishes included).
    pub fn published(&self) -> Vec<OutgoingMessage> {
        self.published.lock().expect("not poisoned").clone()
    }
}

impl Sink for MemorySink {
    fn publish_batch<'a>(&'a self, messages: &'a [OutgoingMessage]) -> PublishFuture<'a> {
        Box::pin(async move {
            let mut published = self.published.lock().expect("not poisoned");
            messages
                .iter()
                .map(
                    |message| match self.fail.as_ref().and_then(|rule| rule(message)) {
                        Some(error) => Err(error),
                        None => {
                            published.push(message.clone());
                            Ok(())
                        }
                    },
                )
                .collect()
        })
    }
}
