//! Amazon SQS as a sink, on the official [aws-sdk-sqs](https://docs.rs/aws-sdk-sqs). Cargo
//! feature `sqs`.
//!
//! Each message is sent to the queue named by its destination (a queue name, resolved once with
//! `GetQueueUrl`, or a queue URL) with `SendMessageBatch`, up to 10 messages per call. The body
//! is the payload (UTF-8: SQS bodies are text; anything else is a permanent error); message
//! attributes (String): the name attribute (default `message-name`, what
//! [`SqsConfig`](crate::source::sqs::SqsConfig) reads the message name from) and the publisher's
//! headers (SQS allows 10 attributes per message).
//!
//! On a **FIFO queue** (a name ending in `.fifo`) the outbox message id is the
//! `MessageDeduplicationId`, so SQS drops a re-publish of the same row within its 5-minute
//! deduplication window; past it the consuming inbox deduplicates on the message's key. The
//! aggregate id is the `MessageGroupId` (one aggregate's messages in order); a message without
//! one is its own group. Standard queues get neither (they have no deduplication).
//!
//! ```no_run
//! # async fn demo(pool: sqlx::PgPool) -> Result<(), Box<dyn std::error::Error>> {
//! use inbox_runtime::outbox::Relay;
//! use inbox_runtime::sink::sqs::SqsSink;
//! use inbox_runtime::source::sqs::AwsSettings;
//!
//! let sink = SqsSink::connect(&AwsSettings::default()).await;
//! let report = Relay::new(pool, sink).run(tokio_util::sync::CancellationToken::new()).await;
//! # Ok(()) }
//! ```

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::Duration;

use aws_sdk_sqs::Client;
use aws_sdk_sqs::error::DisplayErrorContext;
use aws_sdk_sqs::types::{MessageAttributeValue, SendMessageBatchRequestEntry};

use super::{OutgoingMessage, Sink, SinkError};
use crate::BoxFuture;
use crate::source::sqs::{AwsSettings, client, resolve_queue};

/// At most this many messages in one `SendMessageBatch` (SQS's limit).
const MAX_BATCH: usize = 10;

/// Publishes to SQS queues. Build with [`SqsSink::connect`] or [`SqsSink::new`].
#[derive(Debug)]
pub struct SqsSink {
    client: Client,
    name_attribute: String,
    /// Destination → queue URL.
    urls: Mutex<HashMap<String, String>>,
}

impl SqsSink {
    /// A sink with a client from the standard AWS configuration and `settings` (see
    /// [`client`]).
    pub async fn connect(settings: &AwsSettings) -> Self {
        Self::new(client(settings, Duration::from_secs(20)).await)
    }

    /// A sink on an existing client.
    pub fn new(client: Client) -> Self {
        Self {
            client,
            name_attribute: "message-name".into(),
            urls: Mutex::new(HashMap::new()),
        }
    }

    /// The message attribute that carries the message name (default `message-name`, as the SQS
    /// source reads it).
    pub fn name_attribute(mut self, attribute: impl Into<String>) -> Self {
        self.name_attribute = attribute.into();
        self
    }

    async fn url(&self, destination: &str) -> Result<String, SinkError> {
        if let Some(url) = self
            .urls
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .get(destination)
        {
            return Ok(url.clone());
        }
        let (url, _) = resolve_queue(&self.client, destination)
            .await
            .map_err(|e| {
                let permanent = e
                    .as_service_error()
                    .is_some_and(|e| e.is_queue_does_not_exist());
                let error = format!("queue `{destination}`: {}", DisplayErrorContext(e));
                if permanent {
                    SinkError::permanent(error)
                } else {
                    SinkError::retryable(error)
                }
            })?;
        self.urls
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .insert(destination.to_owned(), url.clone());
        Ok(url)
    }

    fn entry(
        &self,
        id: usize,
        message: &OutgoingMessage,
        fifo: bool,
    ) -> Result<SendMessageBatchRequestEntry, SinkError> {
        let body = std::str::from_utf8(&message.payload).map_err(|e| {
            SinkError::permanent(format!("SQS message bodies are text; payload: {e}"))
        })?;
        let text = |value: &str| {
            MessageAttributeValue::builder()
                .data_type("String")
                .string_value(value)
                .build()
                .map_err(SinkError::permanent)
        };
        let mut entry = SendMessageBatchRequestEntry::builder()
            .id(id.to_string())
            .message_body(body)
            .message_attributes(&self.name_attribute, text(&message.message_name)?);
        for (name, value) in &message.headers {
            if name != &self.name_attribute {
                entry = entry.message_attributes(name, text(value)?);
            }
        }
        if fifo {
            entry = entry
                .message_deduplication_id(&message.message_id)
                .message_group_id(
                    message
                        .aggregate_id
                        .as_deref()
                        .unwrap_or(&message.message_id),
                );
        }
        entry.build().map_err(SinkError::permanent)
    }

    /// Sends `messages` (all for `destination`) in calls of up to 10; one result each.
    async fn send_to(
        &self,
        destination: &str,
        messages: &[&OutgoingMessage],
    ) -> Vec<Result<(), SinkError>> {
        let url = match self.url(destination).await {
            Ok(url) => url,
            Err(error) => {
                let text = error.to_string();
                let permanent = error.is_permanent();
                return messages
                    .iter()
                    .map(|_| {
                        Err(if permanent {
                            SinkError::permanent(text.clone())
                        } else {
                            SinkError::retryable(text.clone())
                        })
                    })
                    .collect();
            }
        };
        let fifo = url.trim_end_matches('/').ends_with(".fifo");
        let mut results: Vec<Option<Result<(), SinkError>>> =
            messages.iter().map(|_| None).collect();
        for (chunk_index, chunk) in messages.chunks(MAX_BATCH).enumerate() {
            let base = chunk_index * MAX_BATCH;
            let mut entries = Vec::with_capacity(chunk.len());
            for (i, message) in chunk.iter().enumerate() {
                match self.entry(base + i, message, fifo) {
                    Ok(entry) => entries.push(entry),
                    Err(error) => results[base + i] = Some(Err(error)),
                }
            }
            if entries.is_empty() {
                continue;
            }
            let sent = self
                .client
                .send_message_batch()
                .queue_url(&url)
                .set_entries(Some(entries))
                .send()
                .await;
            match sent {
                Ok(output) => {
                    for ok in output.successful {
                        if let Some(slot) =
                            ok.id.parse::<usize>().ok().and_then(|i| results.get_mut(i))
                        {
                            *slot = Some(Ok(()));
                        }
                    }
                    for failed in output.failed {
                        let error = format!(
                            "SQS refused the message: {} {}",
                            failed.code,
                            failed.message.as_deref().unwrap_or("")
                        );
                        let error = if failed.sender_fault {
                            SinkError::permanent(error)
                        } else {
                            SinkError::retryable(error)
                        };
                        if let Some(slot) = failed
                            .id
                            .parse::<usize>()
                            .ok()
                            .and_then(|i| results.get_mut(i))
                        {
                            *slot = Some(Err(error));
                        }
                    }
                }
                Err(error) => {
                    let text = DisplayErrorContext(error).to_string();
                    for slot in &mut results[base..base + chunk.len()] {
                        if slot.is_none() {
                            *slot = Some(Err(SinkError::retryable(text.clone())));
                        }
                    }
                }
            }
        }
        results
            .into_iter()
            .map(|result| {
                result.unwrap_or_else(|| Err(SinkError::retryable("SQS answered nothing for it")))
            })
            .collect()
    }
}

impl Sink for SqsSink {
    fn publish_batch<'a>(
        &'a self,
        messages: &'a [OutgoingMessage],
    ) -> BoxFuture<'a, Vec<Result<(), SinkError>>> {
        Box::pin(async move {
            // Grouped by destination, each group in order; results put back in the input order.
            let mut by_destination: Vec<(&str, Vec<usize>)> = Vec::new();
            for (i, message) in messages.iter().enumerate() {
                match by_destination
                    .iter_mut()
                    .find(|(destination, _)| *destination == message.destination)
                {
                    Some((_, indices)) => indices.push(i),
                    None => by_destination.push((&message.destination, vec![i])),
                }
            }
            let mut results: Vec<Option<Result<(), SinkError>>> =
                messages.iter().map(|_| None).collect();
            for (destination, indices) in by_destination {
                let group: Vec<&OutgoingMessage> = indices.iter().map(|&i| &messages[i]).collect();
                for (i, result) in indices
                    .into_iter()
                    .zip(self.send_to(destination, &group).await)
                {
                    results[i] = Some(result);
                }
            }
            results
                .into_iter()
                .map(|result| result.unwrap_or_else(|| Err(SinkError::retryable("not sent"))))
                .collect()
        })
    }
}
