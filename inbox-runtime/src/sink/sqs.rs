//! Amazon SQS as a sink, on the official [aws-sdk-sqs](https://docs.rs/aws-sdk-sqs). Cargo
//! feature `sqs`.
//!
//! Each message is sent to the queue named by its destination (a queue name, resolved once with
//! `GetQueueUrl`, or a queue URL) with `SendMessageBatch`, up to 10 messages and 256 KiB (bodies,
//! attribute names, types and values: SQS's limit) per call; a batch SQS still refuses as too
//! long is sent one message per call, and a message over 256 KiB fails for good, alone. Each
//! attempt times out after 8 s ([`SqsSink::send_timeout`]), the whole call after 17 s: under
//! the relay's default 30 s lease. The body is the payload (UTF-8: SQS bodies are text; anything
//! else is a permanent error); message attributes (String): the name attribute (default
//! `message-name`, what [`SqsConfig`](crate::source::sqs::SqsConfig) reads the message name
//! from) and the publisher's headers. A message SQS would refuse for its text or attributes
//! (more than 10 attributes, a name outside SQS's rules, an empty value, a character SQS does not
//! allow in message text) fails for good, alone, before the call: SQS refuses a whole
//! `SendMessageBatch` for one such entry, which would hold the rest of the batch back.
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

use super::{OutgoingMessage, PublishFuture, Sink, SinkError};
use crate::setters::setters;
use crate::source::sqs::{AwsSettings, call_timeouts, client, resolve_queue};

/// At most this many messages in one `SendMessageBatch` (SQS's limit).
const MAX_BATCH: usize = 10;
/// At most this many bytes in one message and in one `SendMessageBatch` (SQS's limit, 256 KiB:
/// bodies, attribute names, types and values).
const MAX_BYTES: usize = 256 * 1024;
/// Each send attempt's timeout (the SDK retries up to 3 attempts within
/// [`call_timeouts`]' operation timeout, 2 × this + 1 s): well under the relay's lease (30 s by
/// default), so that a stalled call fails before another relay may take the rows.
const SEND_ATTEMPT_TIMEOUT: Duration = Duration::from_secs(8);

/// Publishes to SQS queues. Build with [`SqsSink::connect`] or [`SqsSink::new`].
#[derive(Debug)]
pub struct SqsSink {
    client: Client,
    name_attribute: String,
    attempt_timeout: Duration,
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
            attempt_timeout: SEND_ATTEMPT_TIMEOUT,
            urls: Mutex::new(HashMap::new()),
        }
    }

    setters! {
        /// The message attribute that carries the message name (default `message-name`, as the SQS
        /// source reads it).
        pub fn name_attribute(attribute: impl Into<String>) {
            self.name_attribute = attribute.into();
        }

        /// The timeout of one `SendMessageBatch` attempt (default 8 s; the whole call, retries
        /// included, times out after 2 × this + 1 s). Keep the whole call under the relay's lease.
        pub fn send_timeout(attempt: Duration) {
            self.attempt_timeout = attempt.max(Duration::from_millis(100));
        }
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
        // Within the sends' timeouts too: the relay's lease covers this lookup.
        let (url, _) = resolve_queue(&self.client, destination, Some(self.attempt_timeout))
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
        check_attributes(message, &self.name_attribute, body)?;
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
        // Chunks of up to 10 entries and `MAX_BYTES` in all; a message over `MAX_BYTES` alone
        // fails for good (SQS would refuse it, and the whole batch with it).
        let mut chunks: Vec<Vec<SendMessageBatchRequestEntry>> = Vec::new();
        let mut chunk_bytes = 0;
        for (i, message) in messages.iter().enumerate() {
            let entry = match self.entry(i, message, fifo) {
                Ok(entry) => entry,
                Err(error) => {
                    results[i] = Some(Err(error));
                    continue;
                }
            };
            let bytes = entry_size(&entry);
            if bytes > MAX_BYTES {
                results[i] = Some(Err(SinkError::permanent(format!(
                    "SQS message too large: {bytes} bytes (body and attributes), at most \
                     {MAX_BYTES}"
                ))));
                continue;
            }
            match chunks.last_mut() {
                Some(chunk) if chunk.len() < MAX_BATCH && chunk_bytes + bytes <= MAX_BYTES => {
                    chunk_bytes += bytes;
                    chunk.push(entry);
                }
                _ => {
                    chunk_bytes = bytes;
                    chunks.push(vec![entry]);
                }
            }
        }
        for chunk in chunks {
            if let Err(too_long) = self.send_chunk(&url, chunk, &mut results).await {
                // SQS counts the request differently than we do: one message per call.
                tracing::warn!(
                    destination,
                    entries = too_long.len(),
                    "SQS refused the batch as too long; sending its messages one by one"
                );
                for entry in too_long {
                    let id = entry.id.clone();
                    if self
                        .send_chunk(&url, vec![entry], &mut results)
                        .await
                        .is_err()
                        && let Some(slot) =
                            id.parse::<usize>().ok().and_then(|i| results.get_mut(i))
                    {
                        *slot = Some(Err(SinkError::permanent(
                            "SQS refused the message as too long (BatchRequestTooLong)",
                        )));
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

    /// Sends one `SendMessageBatch` call and fills in the results of its entries (by id). A call
    /// refused as too long (`BatchRequestTooLong`) gives its entries back, results unset.
    async fn send_chunk(
        &self,
        url: &str,
        entries: Vec<SendMessageBatchRequestEntry>,
        results: &mut [Option<Result<(), SinkError>>],
    ) -> Result<(), Vec<SendMessageBatchRequestEntry>> {
        let ids: Vec<String> = entries.iter().map(|entry| entry.id.clone()).collect();
        let sent = self
            .client
            .send_message_batch()
            .queue_url(url)
            .set_entries(Some(entries.clone()))
            .customize()
            .config_override(call_timeouts(self.attempt_timeout))
            .send()
            .await;
        let mut set = |id: &str, result: Result<(), SinkError>| {
            if let Some(slot) = id.parse::<usize>().ok().and_then(|i| results.get_mut(i)) {
                *slot = Some(result);
            }
        };
        match sent {
            Ok(output) => {
                for ok in output.successful {
                    set(&ok.id, Ok(()));
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
                    set(&failed.id, Err(error));
                }
            }
            Err(error)
                if error
                    .as_service_error()
                    .is_some_and(|e| e.is_batch_request_too_long()) =>
            {
                return Err(entries);
            }
            Err(error) => {
                let text = DisplayErrorContext(error).to_string();
                for id in &ids {
                    set(id, Err(SinkError::retryable(text.clone())));
                }
            }
        }
        Ok(())
    }
}

/// At most this many message attributes per message (SQS's limit).
const MAX_ATTRIBUTES: usize = 10;
/// At most this many characters in an attribute's name (SQS's limit).
const MAX_ATTRIBUTE_NAME: usize = 256;

/// Checks a message against what SQS refuses in a message's text and attributes, so that such a
/// message fails for good, alone, before the call: SQS refuses a `SendMessageBatch` whole
/// (`InvalidParameterValue`, `InvalidMessageContents`) when one entry breaks these rules, which
/// would hold the other messages of its batch back with it. The rules (AWS's *Amazon SQS message
/// attributes* and `SendMessage` reference):
/// * at most [`MAX_ATTRIBUTES`] (10) attributes: the name attribute and each header;
/// * an attribute name is 1–256 characters of `A–Z a–z 0–9 _ - .`, does not start or end with
///   `.`, has no `..`, and does not start with `AWS.` or `Amazon.` (any case);
/// * a `String` attribute's value is not empty;
/// * the body and every value hold only the characters SQS allows in message text: `#x9`,
///   `#xA`, `#xD`, `#x20`–`#xD7FF`, `#xE000`–`#xFFFD`, `#x10000`–`#x10FFFF`.
///
/// # Errors
/// A permanent [`SinkError`] naming the rule and the attribute.
fn check_attributes(
    message: &OutgoingMessage,
    name_attribute: &str,
    body: &str,
) -> Result<(), SinkError> {
    let headers = message
        .headers
        .iter()
        .filter(|(name, _)| name.as_str() != name_attribute);
    let count = 1 + headers.clone().count();
    if count > MAX_ATTRIBUTES {
        return Err(SinkError::permanent(format!(
            "SQS allows {MAX_ATTRIBUTES} message attributes; this message has {count} (the \
             name attribute `{name_attribute}` and {} headers)",
            count - 1
        )));
    }
    if let Some(at) = body.chars().position(|c| !sqs_text_char(c)) {
        return Err(SinkError::permanent(format!(
            "SQS refuses the message body: character {at} is not one SQS allows in message text"
        )));
    }
    let attributes = std::iter::once((name_attribute, message.message_name.as_str()))
        .chain(headers.map(|(name, value)| (name.as_str(), value.as_str())));
    for (name, value) in attributes {
        if let Some(rule) = attribute_name_rule(name) {
            return Err(SinkError::permanent(format!(
                "SQS refuses the message attribute name {name:?}: {rule}"
            )));
        }
        if value.is_empty() {
            return Err(SinkError::permanent(format!(
                "SQS refuses the message attribute {name:?}: an empty value"
            )));
        }
        if let Some(at) = value.chars().position(|c| !sqs_text_char(c)) {
            return Err(SinkError::permanent(format!(
                "SQS refuses the message attribute {name:?}: character {at} of its value is \
                 not one SQS allows in message text"
            )));
        }
    }
    Ok(())
}

/// The rule an attribute name breaks (see [`check_attributes`]), if any.
fn attribute_name_rule(name: &str) -> Option<&'static str> {
    let lower = name.to_ascii_lowercase();
    if name.is_empty() || name.chars().count() > MAX_ATTRIBUTE_NAME {
        Some("1 to 256 characters")
    } else if !name
        .chars()
        .all(|c| c.is_ascii_alphanumeric() || matches!(c, '_' | '-' | '.'))
    {
        Some("only A-Z, a-z, 0-9, '_', '-' and '.'")
    } else if name.starts_with('.') || name.ends_with('.') || name.contains("..") {
        Some("no '.' first or last, and no '..'")
    } else if lower.starts_with("aws.") || lower.starts_with("amazon.") {
        Some("the prefixes 'AWS.' and 'Amazon.' are reserved")
    } else {
        None
    }
}

/// Whether SQS allows `c` in message text (the body, a `String` attribute's value).
fn sqs_text_char(c: char) -> bool {
    matches!(c, '\t' | '\n' | '\r' | '\u{20}'..='\u{D7FF}' | '\u{E000}'..='\u{FFFD}' | '\u{10000}'..)
}

/// The size SQS counts for a message: its body, and each attribute's name, type and value.
fn entry_size(entry: &SendMessageBatchRequestEntry) -> usize {
    entry.message_body.len()
        + entry.message_attributes.as_ref().map_or(0, |attributes| {
            attributes
                .iter()
                .map(|(name, value)| {
                    name.len()
                        + value.data_type.len()
                        + value.string_value.as_deref().map_or(0, str::len)
                        + value.binary_value.as_ref().map_or(0, |b| b.as_ref().len())
                })
                .sum()
        })
}

impl Sink for SqsSink {
    fn publish_batch<'a>(&'a self, messages: &'a [OutgoingMessage]) -> PublishFuture<'a> {
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
