//! Envelopes: what a source hands the dispatcher.

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
    /// The payload: UTF-8 JSON of the message.
    pub payload: Vec<u8>,
    /// Where the delivery came from, if known; recorded with the claim.
    pub source: Option<SourceMetadata>,
}

impl Envelope {
    /// An envelope for `message_name` carrying `payload` (JSON bytes), with no source metadata.
    pub fn new(message_name: impl Into<String>, payload: impl Into<Vec<u8>>) -> Self {
        Self {
            message_name: message_name.into(),
            payload: payload.into(),
            source: None,
        }
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
}

impl SourceMetadata {
    /// Metadata for a delivery from `source`.
    pub fn new(source: impl Into<String>) -> Self {
        Self {
            source: source.into(),
            ..Self::default()
        }
    }

    /// Sets the partition.
    pub fn partition(mut self, partition: impl Into<String>) -> Self {
        self.partition = Some(partition.into());
        self
    }

    /// Sets the offset.
    pub fn offset(mut self, offset: i64) -> Self {
        self.offset = Some(offset);
        self
    }

    /// Marks the delivery as a redelivery (as the source reports it).
    pub fn redelivered(mut self, redelivered: bool) -> Self {
        self.redelivered = redelivered;
        self
    }
}
