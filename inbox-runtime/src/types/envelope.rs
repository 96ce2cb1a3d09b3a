//! Envelopes: what a source hands the dispatcher.

use std::collections::{BTreeMap, HashMap};

use crate::setters::setters;
use crate::types::error::DispatchError;
use crate::types::json_text::{NotText, json_text};
use crate::types::limit::PayloadLimit;

/// One delivery as the dispatcher sees it: the message's routing name, its payload bytes (JSON),
/// and where it came from.
///
/// ```
/// use inbox_runtime::{Envelope, SourceMetadata};
///
/// let envelope = Envelope::new("payments.captured", br#"{"event_id":"e-1"}"#.to_vec())
///     .with_source(SourceMetadata::new("payments-queue").partition("0").offset(42));
/// assert_eq!(envelope.message_name, "payments.captured");
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct Envelope {
    /// Routing name, matched against [`crate::Message::NAME`] of the registered handlers.
    pub message_name: String,
    /// The payload: UTF-8 JSON of the message; only its first bytes if its source
    /// [cut](Envelope::cut) it at its limit.
    pub payload: Vec<u8>,
    /// Where the delivery came from, if known; recorded with the claim.
    pub source: Option<SourceMetadata>,
    /// The delivery's text headers as the broker carried them (AMQP headers table, NATS
    /// headers), name → value; empty if the source has none. Informational: routing uses
    /// [`Envelope::message_name`] only.
    pub headers: BTreeMap<String, String>,
    /// The payload's real size, in bytes, if the source cut it (see [`Envelope::cut`]).
    cut_from: Option<usize>,
}

impl Envelope {
    /// An envelope for `message_name` carrying `payload` (JSON bytes), with no source metadata.
    pub fn new(message_name: impl Into<String>, payload: impl Into<Vec<u8>>) -> Self {
        Self {
            message_name: message_name.into(),
            payload: payload.into(),
            source: None,
            headers: BTreeMap::new(),
            cut_from: None,
        }
    }

    /// An envelope whose payload its source cut: `kept` holds the first bytes of a payload of
    /// `size` bytes that was over the source's [`PayloadLimit`] (a source reads no further than
    /// its limit, so that an oversized delivery costs no more memory than the limit). The
    /// dispatcher refuses it, whatever its own limit, with
    /// [`DispatchError::TooLarge`](crate::DispatchError::TooLarge), and keeps it in
    /// `inbox_rejections` as `too_large`: `kept` (cut to the dispatcher's limit) and `size`.
    ///
    /// If `size` is not larger than `kept` the payload is whole: the envelope is
    /// [`Envelope::new`]'s.
    ///
    /// ```
    /// use inbox_runtime::Envelope;
    ///
    /// let envelope = Envelope::cut("payments.captured", br#"{"event_id":"#.to_vec(), 5_000_000);
    /// assert!(envelope.is_cut());
    /// assert_eq!(envelope.payload_size(), 5_000_000);
    /// assert_eq!(envelope.payload.len(), 12);
    /// ```
    pub fn cut(message_name: impl Into<String>, kept: impl Into<Vec<u8>>, size: usize) -> Self {
        let mut envelope = Self::new(message_name, kept);
        envelope.cut_from = (size > envelope.payload.len()).then_some(size);
        envelope
    }

    /// An envelope of the first bytes of `payload` that `limit` allows: all of them (one copy)
    /// if it is within the limit, else the first `limit` bytes of it, [cut](Self::cut).
    #[cfg_attr(not(feature = "nats"), allow(dead_code))]
    pub(crate) fn within(
        message_name: impl Into<String>,
        payload: &[u8],
        limit: PayloadLimit,
    ) -> Self {
        let kept = payload.len().min(limit.bytes());
        Self::cut(message_name, &payload[..kept], payload.len())
    }

    /// Cuts the payload in place if it is over `limit` (its memory given back), keeping its
    /// real size.
    pub(crate) fn limit_to(&mut self, limit: PayloadLimit) {
        if self.payload.len() > limit.bytes() {
            let size = self.payload_size();
            self.payload.truncate(limit.bytes());
            self.payload.shrink_to_fit();
            self.cut_from = Some(size);
        }
    }

    /// The payload's size, in bytes: its real size if its source [cut](Self::cut) it, else
    /// the length of [`payload`](Self::payload).
    pub fn payload_size(&self) -> usize {
        self.cut_from
            .filter(|&size| size > self.payload.len())
            .unwrap_or(self.payload.len())
    }

    /// Whether the source [cut](Self::cut) the payload: [`payload`](Self::payload) holds only
    /// its first bytes (checked against its length now, so a payload replaced since by one at
    /// least as long as the recorded size counts as whole).
    pub fn is_cut(&self) -> bool {
        self.payload_size() > self.payload.len()
    }

    /// Adds a header (replacing one of the same name).
    pub fn with_header(mut self, name: impl Into<String>, value: impl Into<String>) -> Self {
        self.headers.insert(name.into(), value.into());
        self
    }

    /// Attaches source metadata (recorded in the inbox row with the claim).
    pub fn with_source(mut self, source: SourceMetadata) -> Self {
        self.source = Some(source);
        self
    }
}

/// Where a delivery came from: the broker's own coordinates. Recorded for operators; never part
/// of the idempotency key (a redelivery has other coordinates but the same intent).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
#[non_exhaustive]
pub struct SourceMetadata {
    /// The source: a queue, topic, stream or file name.
    pub source: String,
    /// The partition (Kafka partition, stream shard), if the source has one.
    pub partition: Option<String>,
    /// The offset (Kafka offset, stream sequence, delivery tag, line number), if any.
    pub offset: Option<i64>,
    /// Whether the source marks this delivery as a redelivery.
    pub redelivered: bool,
    /// The producer's message id as the broker carried it (AMQP `message_id` property, NATS
    /// `Nats-Msg-Id` header), if any. Informational: the idempotency key comes from the
    /// message itself.
    pub message_id: Option<String>,
    /// How many times the broker has delivered this message, this delivery included (JetStream's
    /// delivery count, RabbitMQ's `x-delivery-count` on quorum queues), if the source knows.
    pub delivery_count: Option<u64>,
    /// When the message was produced (the producer's or broker's wall clock: AMQP's `timestamp`
    /// property, JetStream's stream time, a field of the file line), if the source knows. The
    /// dispatcher records `now − published_at` as the histogram `inbox_lag_seconds{consumer}`
    /// (in seconds; 0 if the time lies in the future, i.e. clock skew).
    pub published_at: Option<std::time::SystemTime>,
    /// The broker's record key as it carried it (Kafka's record key, raw bytes), if any.
    /// Informational, like [`message_id`](Self::message_id): the idempotency key comes from the
    /// message itself.
    pub record_key: Option<Vec<u8>>,
    /// The fencing epoch under which the source held [`partition`](Self::partition) when it
    /// fetched this delivery (Kafka: the epoch of the consumer group's position row, see
    /// [`PositionStore`](crate::store::PositionStore)), if the source fences. A before-commit hook
    /// writes the position with it, so that a consumer that lost the partition since cannot
    /// commit.
    pub epoch: Option<i64>,
    /// The broker's deduplication id as it carried it (SQS FIFO's `MessageDeduplicationId`),
    /// if any. Informational, like [`message_id`](Self::message_id).
    pub deduplication_id: Option<String>,
    /// The broker's sequence number as a decimal string, if it has one that does not fit an
    /// [`offset`](Self::offset) (SQS FIFO's `SequenceNumber`: up to 128 bits, kept as the
    /// broker's text, without loss).
    pub sequence_number: Option<String>,
}

impl SourceMetadata {
    /// Metadata for a delivery from `source`.
    pub fn new(source: impl Into<String>) -> Self {
        Self {
            source: source.into(),
            ..Self::default()
        }
    }

    setters! {
        /// Sets the partition.
        pub fn partition(partition: impl Into<String>) {
            self.partition = Some(partition.into());
        }

        /// Sets the offset.
        pub fn offset(offset: i64) {
            self.offset = Some(offset);
        }

        /// Marks the delivery as a redelivery (as the source reports it).
        pub fn redelivered(redelivered: bool);

        /// Sets the producer's message id.
        pub fn message_id(message_id: impl Into<String>) {
            self.message_id = Some(message_id.into());
        }

        /// Sets the delivery count (1 for a first delivery).
        pub fn delivery_count(delivery_count: u64) {
            self.delivery_count = Some(delivery_count);
        }

        /// Sets the broker's record key.
        pub fn record_key(key: impl Into<Vec<u8>>) {
            self.record_key = Some(key.into());
        }

        /// Sets the fencing epoch (see [`SourceMetadata::epoch`]).
        pub fn epoch(epoch: i64) {
            self.epoch = Some(epoch);
        }

        /// Sets the broker's deduplication id (see [`SourceMetadata::deduplication_id`]).
        pub fn deduplication_id(id: impl Into<String>) {
            self.deduplication_id = Some(id.into());
        }

        /// Sets the broker's sequence number, a decimal string (see
        /// [`SourceMetadata::sequence_number`]).
        pub fn sequence_number(sequence_number: impl Into<String>) {
            self.sequence_number = Some(sequence_number.into());
        }

        /// Sets when the message was produced (see [`SourceMetadata::published_at`]).
        pub fn published_at(published_at: std::time::SystemTime) {
            self.published_at = Some(published_at);
        }
    }
}

impl Envelope {
    /// A dispatcher's checks before the payload is decoded, in order (the SQL [`Dispatcher`]'s
    /// and the DynamoDB one's): its size against `limit`, its name, its handlers in `routes`,
    /// its text (one Unicode rule for the whole payload: serde skips the members a message type
    /// does not declare without decoding them, so every byte and escape is checked here, with no
    /// copy). Returns the handlers of its name and the payload as text.
    ///
    /// [`Dispatcher`]: crate::Dispatcher
    pub(crate) fn admit<'r, H>(
        &self,
        limit: PayloadLimit,
        routes: &'r HashMap<&'static str, Vec<H>>,
    ) -> Result<(&'r [H], &str), DispatchError> {
        // A payload its source cut is never whole, whatever the limit: too large first (a
        // source may not have read its name); a whole one once it has a name.
        let size = self.payload_size();
        let limit = limit.bytes();
        if self.is_cut() || (size > limit && !self.message_name.is_empty()) {
            return Err(DispatchError::TooLarge {
                message_name: self.message_name.clone(),
                size,
                limit: if size > limit {
                    limit
                } else {
                    self.payload.len()
                },
            });
        }
        if self.message_name.is_empty() {
            return Err(DispatchError::NoMessageName);
        }
        let handlers = routes.get(self.message_name.as_str()).ok_or_else(|| {
            DispatchError::UnknownMessage {
                message_name: self.message_name.clone(),
            }
        })?;
        let text = json_text(&self.payload).map_err(|error| {
            let message_name = self.message_name.clone();
            let (line, column) = (error.line, error.column);
            match error.kind {
                NotText::NotUtf8 => DispatchError::NotUtf8 {
                    message_name,
                    line,
                    column,
                },
                NotText::UnpairedSurrogate(escape) => DispatchError::UnpairedSurrogate {
                    message_name,
                    line,
                    column,
                    escape,
                },
            }
        })?;
        Ok((handlers, text))
    }
}
