//! NATS JetStream as a sink, on [async-nats](https://docs.rs/async-nats). Cargo feature `nats`.
//!
//! Each message is published to the subject named by its destination, with headers:
//! `Nats-Msg-Id` = the message id (JetStream drops a re-publish within the stream's duplicate
//! window, `duplicate_window`, default 2 min: keep it longer than the relay's lease), the name
//! header (default `message-name`, what [`NatsConfig`](crate::source::nats::NatsConfig) reads
//! the message name from), and the publisher's headers. A batch is sent pipelined, then every
//! JetStream ack is awaited: a message is `Ok` once its stream stored it (or reported it a
//! duplicate). A header NATS cannot carry (a name that is not printable ASCII without `:`, such
//! as one with a space or an `Ü`; a value with CR or LF) fails its message for good, alone.
//!
//! ```no_run
//! # async fn demo(pool: sqlx::PgPool) -> Result<(), Box<dyn std::error::Error>> {
//! use inbox_runtime::outbox::Relay;
//! use inbox_runtime::sink::nats::NatsSink;
//!
//! let sink = NatsSink::connect("nats://127.0.0.1:4222").await?;
//! let report = Relay::new(pool, sink).run(tokio_util::sync::CancellationToken::new()).await;
//! # Ok(()) }
//! ```

use async_nats::jetstream;

use super::{OutgoingMessage, PublishFuture, Sink, SinkError};

/// Publishes to NATS JetStream. Build with [`NatsSink::connect`] or [`NatsSink::new`].
#[derive(Debug, Clone)]
pub struct NatsSink {
    context: jetstream::Context,
    name_header: String,
}

impl NatsSink {
    /// Connects to the server at `url` (`nats://host:port`).
    ///
    /// # Errors
    /// The connection error.
    pub async fn connect(url: &str) -> Result<Self, async_nats::ConnectError> {
        Ok(Self::new(jetstream::new(async_nats::connect(url).await?)))
    }

    /// A sink on an existing JetStream context.
    pub fn new(context: jetstream::Context) -> Self {
        Self {
            context,
            name_header: "message-name".into(),
        }
    }

    /// The header that carries the message name (default `message-name`, as the NATS source
    /// reads it).
    pub fn name_header(mut self, header: impl Into<String>) -> Self {
        self.name_header = header.into();
        self
    }

    /// The message's NATS headers: the publisher's, then the name header and `Nats-Msg-Id`.
    ///
    /// # Errors
    /// A permanent [`SinkError`] for a header NATS cannot carry (async-nats would panic on it):
    /// a name that is not printable ASCII without `:` (no space), or a value with CR or LF.
    fn headers(&self, message: &OutgoingMessage) -> Result<async_nats::HeaderMap, SinkError> {
        let mut headers = async_nats::HeaderMap::new();
        let own = [
            (self.name_header.as_str(), message.message_name.as_str()),
            ("Nats-Msg-Id", message.message_id.as_str()),
        ];
        let all = message
            .headers
            .iter()
            .map(|(name, value)| (name.as_str(), value.as_str()))
            .chain(own);
        for (text, value) in all {
            let name: async_nats::HeaderName = text.parse().map_err(|_| {
                SinkError::permanent(format!(
                    "NATS cannot carry the header name {text:?}: only printable ASCII without ':'"
                ))
            })?;
            let value: async_nats::HeaderValue = value.parse().map_err(|_| {
                SinkError::permanent(format!(
                    "NATS cannot carry the header {text:?}: its value has CR or LF"
                ))
            })?;
            headers.insert(name, value);
        }
        Ok(headers)
    }
}

impl Sink for NatsSink {
    fn publish_batch<'a>(&'a self, messages: &'a [OutgoingMessage]) -> PublishFuture<'a> {
        Box::pin(async move {
            // Send all, then await the acks: one round trip for the batch.
            let mut pending = Vec::with_capacity(messages.len());
            for message in messages {
                let sent = match self.headers(message) {
                    Ok(headers) => Ok(self
                        .context
                        .publish_with_headers(
                            message.destination.clone(),
                            headers,
                            message.payload.clone().into(),
                        )
                        .await),
                    Err(refused) => Err(refused),
                };
                pending.push(sent);
            }
            let mut results = Vec::with_capacity(messages.len());
            for sent in pending {
                results.push(match sent {
                    Ok(Ok(ack)) => match ack.await {
                        Ok(_) => Ok(()),
                        Err(error) => Err(SinkError::retryable(error)),
                    },
                    Ok(Err(error)) => Err(SinkError::retryable(error)),
                    Err(refused) => Err(refused),
                });
            }
            results
        })
    }
}
