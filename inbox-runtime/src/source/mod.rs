//! Sources: where deliveries come from, and how they are settled.
//!
//! A [`Source`] hands out [`Delivery`]s one at a time. Each carries an [`Envelope`] (message
//! name, payload, headers, [`SourceMetadata`](crate::SourceMetadata)) and must be settled exactly once, *after* the
//! inbox transaction of its message has committed (the [`Worker`](crate::Worker) does this):
//!
//! | [`Settlement`] | meaning | RabbitMQ | JetStream | file / memory |
//! | --- | --- | --- | --- | --- |
//! | [`Ack`](Settlement::Ack) | done: committed, a duplicate, or dead-lettered | `basic.ack` | `+ACK` | advance / forget |
//! | [`Reject`](Settlement::Reject) | permanently unprocessable: never deliver again | `basic.nack`, `requeue=false` (dead-lettered if the queue has a DLX) | `+TERM` | advance / forget |
//! | [`Requeue`](Settlement::Requeue) | transient failure: deliver again, after `delay` if given | `basic.nack`, `requeue=true`, after waiting `delay` | `-NAK` with the delay | deliver again after `delay` |
//!
//! A delivery dropped without being settled is **abandoned**: it is not acked, and the source
//! delivers it again by its own rules (RabbitMQ when the channel closes, JetStream after
//! `AckWait`, the memory source at once, the file source on the next run).
//!
//! Sources in this crate: [`memory::MemorySource`] (tests), [`file::FileSource`] (a JSON-lines
//! file that resumes where its acked prefix ends), and behind cargo features
//! `amqp::AmqpSource` (`amqp`, RabbitMQ on lapin), `nats::NatsSource` (`nats`, a JetStream
//! durable pull consumer on async-nats), `kafka::KafkaSource` (`kafka`) and `sqs::SqsSource`
//! (`sqs`, Amazon SQS standard and FIFO queues on aws-sdk-sqs: ack deletes, requeue changes the
//! visibility timeout). With the cargo feature `lambda`, `lambda::LambdaSqs` runs AWS Lambda's SQS
//! batches through a [`Worker`](crate::Worker) and answers each with the partial batch response
//! (with `dynamodb` too, `lambda::DynamoLambdaSqs` through a DynamoDB dispatcher).

use std::fmt;
use std::time::Duration;

use crate::BoxFuture;
use crate::types::classify::BoxError;
use crate::types::envelope::Envelope;
use crate::types::limit::PayloadLimit;

#[cfg(feature = "amqp")]
pub mod amqp;
pub mod file;
#[cfg(feature = "kafka")]
pub mod kafka;
#[cfg(feature = "lambda")]
pub mod lambda;
pub mod memory;
#[cfg(feature = "nats")]
pub mod nats;
#[cfg(feature = "sqs")]
pub mod sqs;

/// How a delivery is settled. See the [module documentation](self) for what each does on each
/// broker.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Settlement {
    /// The message is done with: its effect committed, it was a duplicate, or it was recorded
    /// as dead. The source never delivers it again.
    Ack,
    /// The message can never be processed (unknown name, malformed payload, bad key, a
    /// conflict): nack it without requeue. The broker drops it or dead-letters it (RabbitMQ with
    /// a dead-letter exchange); JetStream terminates it.
    Reject,
    /// Processing failed for a reason that may pass (handler or database error): deliver it
    /// again, after `delay` (a duration; `None` for the broker's default) where the source can
    /// delay a redelivery.
    Requeue {
        /// How long to wait before the redelivery. JetStream and the file and memory sources
        /// delay the redelivery itself; RabbitMQ has no delayed requeue, so its source waits this
        /// long before it sends the nack (holding the delivery, and the worker's slot, meanwhile).
        delay: Option<Duration>,
    },
}

impl Settlement {
    /// The settlement's name as used in logs and metrics: `"ack"`, `"reject"` or `"requeue"`.
    pub fn kind(&self) -> &'static str {
        match self {
            Settlement::Ack => "ack",
            Settlement::Reject => "reject",
            Settlement::Requeue { .. } => "requeue",
        }
    }
}

/// A source (or one of its deliveries) failed.
#[derive(Debug, thiserror::Error)]
#[error("source `{source_name}`: {operation} failed: {error}")]
pub struct SourceError {
    /// The source: queue, stream/consumer or file name.
    pub source_name: String,
    /// What failed: `"connect"`, `"open"`, `"receive"`, `"ack"`, `"reject"`, `"requeue"`,
    /// `"persist position"`, `"close"`, …
    pub operation: &'static str,
    /// The underlying error.
    #[source]
    pub error: BoxError,
}

impl SourceError {
    /// A source error from any error type.
    pub fn new(
        source_name: impl Into<String>,
        operation: &'static str,
        error: impl Into<BoxError>,
    ) -> Self {
        Self {
            source_name: source_name.into(),
            operation,
            error: error.into(),
        }
    }
}

/// Settles one delivery on its source: what a source implements for its deliveries.
///
/// The [`Delivery`] calls exactly one of the two methods, exactly once.
pub trait Settle: Send + 'static {
    /// Settles the delivery. The returned future must not borrow the settler.
    ///
    /// # Errors
    /// A [`SourceError`] if the broker could not be told (connection lost, channel closed). The
    /// message is then not settled and the broker will deliver it again; after an
    /// [`Settlement::Ack`] whose transaction committed, that redelivery is a duplicate.
    fn settle(self: Box<Self>, settlement: Settlement) -> SettleFuture;

    /// The delivery was dropped without being settled. The default does nothing (the broker
    /// redelivers on its own: RabbitMQ when the channel closes, JetStream after `AckWait`).
    fn abandon(self: Box<Self>) {}

    /// Whether the source still wants the delivery processed. `false` once the source gave it
    /// up after handing it out (Kafka: its partition was revoked, or rewound for a retry of an
    /// earlier record): the [`Worker`](crate::Worker) then drops it unsettled before it runs.
    /// The default is always `true`.
    fn is_current(&self) -> bool {
        true
    }
}

/// What [`Settle::settle`] returns: a boxed future that borrows nothing (the same type as
/// `BoxFuture<'static, Result<(), SourceError>>`, which an implementation may write instead).
pub type SettleFuture = BoxFuture<'static, Result<(), SourceError>>;

/// One delivery from a [`Source`]: an envelope and the means to settle it.
///
/// Settle it once, with [`ack`](Self::ack), [`reject`](Self::reject),
/// [`requeue`](Self::requeue) or [`settle`](Self::settle), *after* the inbox transaction has
/// committed. Dropping it unsettled abandons it (see [`Settle::abandon`]).
pub struct Delivery {
    envelope: Envelope,
    ordering_key: Option<String>,
    settler: Option<Box<dyn Settle>>,
}

impl fmt::Debug for Delivery {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Delivery")
            .field("envelope", &self.envelope)
            .field("ordering_key", &self.ordering_key)
            .field("settled", &self.settler.is_none())
            .finish()
    }
}

impl Delivery {
    /// A delivery of `envelope`, settled by `settler`.
    pub fn new(envelope: Envelope, settler: impl Settle) -> Self {
        Self {
            envelope,
            ordering_key: None,
            settler: Some(Box::new(settler)),
        }
    }

    /// Sets the ordering key: the [`Worker`](crate::Worker) processes deliveries with the same
    /// key one at a time, in the order the source handed them out.
    pub fn with_ordering_key(mut self, key: impl Into<String>) -> Self {
        self.ordering_key = Some(key.into());
        self
    }

    /// The envelope to dispatch.
    pub fn envelope(&self) -> &Envelope {
        &self.envelope
    }

    /// The ordering key, if the source provides one.
    pub fn ordering_key(&self) -> Option<&str> {
        self.ordering_key.as_deref()
    }

    /// Whether its source still wants it processed (see [`Settle::is_current`]); `false` for a
    /// settled delivery.
    pub fn is_current(&self) -> bool {
        self.settler
            .as_ref()
            .is_some_and(|settler| settler.is_current())
    }

    /// Settles the delivery.
    ///
    /// # Errors
    /// See [`Settle::settle`].
    pub async fn settle(mut self, settlement: Settlement) -> Result<(), SourceError> {
        match self.settler.take() {
            Some(settler) => settler.settle(settlement).await,
            None => Ok(()),
        }
    }

    /// Acks the delivery: [`Settlement::Ack`].
    ///
    /// # Errors
    /// See [`Settle::settle`].
    pub async fn ack(self) -> Result<(), SourceError> {
        self.settle(Settlement::Ack).await
    }

    /// Nacks the delivery without requeue: [`Settlement::Reject`].
    ///
    /// # Errors
    /// See [`Settle::settle`].
    pub async fn reject(self) -> Result<(), SourceError> {
        self.settle(Settlement::Reject).await
    }

    /// Nacks the delivery with requeue, after `delay` where the source supports it:
    /// [`Settlement::Requeue`].
    ///
    /// # Errors
    /// See [`Settle::settle`].
    pub async fn requeue(self, delay: Option<Duration>) -> Result<(), SourceError> {
        self.settle(Settlement::Requeue { delay }).await
    }
}

impl Drop for Delivery {
    fn drop(&mut self) {
        if let Some(settler) = self.settler.take() {
            settler.abandon();
        }
    }
}

/// Where deliveries come from: a broker consumer, a file, an in-memory queue.
///
/// Implementations hand out deliveries in the order they should be processed; the
/// [`Worker`](crate::Worker) pulls them with [`next`](Self::next) and settles each after its
/// transaction commits. A boxed source is a source (`Box<dyn Source>`).
pub trait Source: Send {
    /// The source's name for logs and errors: a queue, stream/consumer or file name.
    fn name(&self) -> &str;

    /// The next delivery, waiting for one if none is ready.
    ///
    /// `Ok(None)` means that no delivery will ever come again: the file is read to its end and
    /// every line settled, the memory source is closed and drained, the broker cancelled the
    /// consumer. A broker source otherwise waits.
    ///
    /// Must be **cancel safe**: the worker drops this future whenever something else happens
    /// first (a task finished, shutdown), and calls it again later; no delivery may be lost that
    /// way.
    ///
    /// # Errors
    /// A [`SourceError`] if the source failed (connection lost, unreadable file). The worker
    /// then stops fetching, finishes its in-flight work, and returns the error.
    fn next(&mut self) -> BoxFuture<'_, Result<Option<Delivery>, SourceError>>;

    /// Sets the largest payload this source hands out whole: a delivery over `limit` is read
    /// no further than the source can help (see each source's documentation) and handed out
    /// [cut](Envelope::cut) to its first `limit` bytes, with its real size, for the dispatcher
    /// to refuse as too large and keep in `inbox_rejections`. The [`Worker`](crate::Worker)
    /// calls it with its dispatcher's [`payload_limit`](crate::Dispatcher::payload_limit)
    /// before its first [`next`](Self::next); call it yourself if you drive a source without a
    /// worker.
    ///
    /// The sources of this crate start with [`PayloadLimit::DEFAULT`] (1 MiB). The default
    /// implementation does nothing: a source that keeps no limit of its own hands out what it
    /// got, and the dispatcher still refuses a payload over its limit.
    fn set_payload_limit(&mut self, limit: PayloadLimit) {
        let _ = limit;
    }

    /// Called once by the worker after every delivery it fetched was settled or abandoned, before
    /// it returns: flush pending acks, persist positions, close connections (which makes a
    /// broker redeliver the abandoned deliveries at once). The default does nothing.
    ///
    /// # Errors
    /// A [`SourceError`] if flushing or closing failed.
    fn close(&mut self) -> BoxFuture<'_, Result<(), SourceError>> {
        Box::pin(async { Ok(()) })
    }
}

impl<S: Source + ?Sized> Source for Box<S> {
    fn name(&self) -> &str {
        (**self).name()
    }

    fn next(&mut self) -> BoxFuture<'_, Result<Option<Delivery>, SourceError>> {
        (**self).next()
    }

    fn set_payload_limit(&mut self, limit: PayloadLimit) {
        (**self).set_payload_limit(limit);
    }

    fn close(&mut self) -> BoxFuture<'_, Result<(), SourceError>> {
        (**self).close()
    }
}

/// Runs `requeue` at once, or after `delay` on a task of its own where `delay` is over zero:
/// [`Settlement::Requeue`] of the sources that redeliver by themselves (file, memory).
pub(crate) fn requeue_after(delay: Option<Duration>, requeue: impl FnOnce() + Send + 'static) {
    match delay {
        Some(delay) if delay > Duration::ZERO => {
            // In the table prefix's scope, if any: the requeue may run store statements.
            crate::store::spawn(async move {
                tokio::time::sleep(delay).await;
                requeue();
            });
        }
        _ => requeue(),
    }
}

/// The value of the header `name` names among a delivery's `headers`; `None` where no name is
/// configured or the delivery has no such header (AMQP, NATS).
#[cfg(any(feature = "amqp", feature = "nats"))]
pub(crate) fn header_value(
    headers: &std::collections::BTreeMap<String, String>,
    name: Option<&String>,
) -> Option<String> {
    headers.get(name?).cloned()
}
