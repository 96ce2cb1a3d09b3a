//! The demo on Amazon SQS (examples feature `sqs`): `publish --to sqs://QUEUE` sends the stream
//! to a queue, `--source sqs://QUEUE` consumes it through
//! [`inbox_runtime::source::sqs::SqsSource`] (delete after commit, visibility heartbeats). Both
//! create the queue if it is missing (a name ending in `.fifo` makes a FIFO queue). Endpoint,
//! region and credentials come from the standard AWS configuration: `AWS_ENDPOINT_URL` (e.g. a
//! local moto server, `scripts/sqs.sh`), `AWS_REGION`, `AWS_ACCESS_KEY_ID`,
//! `AWS_SECRET_ACCESS_KEY`, profiles, roles.
//!
//! Each line becomes one message: its `payload` is the body, its `message` the `message-name`
//! attribute. On a FIFO queue the payload's `account_id` is the message group (one account's
//! events in order; `ledger` for a line without one) and `line-N` the deduplication id. A line
//! that is not an envelope is sent as it is, without name. `--ack-wait` is the visibility
//! timeout.

use std::sync::OnceLock;
use std::time::Duration;

use aws_sdk_sqs::Client;
use aws_sdk_sqs::types::{MessageAttributeValue, QueueAttributeName, SendMessageBatchRequestEntry};
use inbox_runtime::source::sqs::{AwsSettings, SqsConfig, SqsSource, SqsStats};

use crate::broker::{ConsumeArgs, Messages};

/// The URL scheme of SQS queues.
pub(crate) const SCHEME: &str = "sqs://";

/// The queue's name in an `sqs://QUEUE` URL.
fn queue_name(url: &str) -> Result<&str, String> {
    let name = url
        .strip_prefix(SCHEME)
        .unwrap_or(url)
        .trim_end_matches('/');
    if name.is_empty() || name.contains('/') {
        return Err(format!(
            "no queue in `{url}`: expected sqs://QUEUE (e.g. sqs://ledger.fifo)"
        ));
    }
    Ok(name)
}

/// The queue's URL, created first if missing (FIFO for a `.fifo` name).
async fn ensure_queue(client: &Client, name: &str) -> Result<String, String> {
    let mut create = client.create_queue().queue_name(name);
    if name.ends_with(".fifo") {
        create = create.attributes(QueueAttributeName::FifoQueue, "true");
    }
    match create.send().await {
        Ok(created) => Ok(created.queue_url.unwrap_or_default()),
        // Exists with other attributes: use it as it is.
        Err(create_error) => client
            .get_queue_url()
            .queue_name(name)
            .send()
            .await
            .map(|found| found.queue_url.unwrap_or_default())
            .map_err(|_| {
                format!(
                    "SQS: cannot create queue {name}: {}",
                    aws_sdk_sqs::error::DisplayErrorContext(create_error)
                )
            }),
    }
}

/// `ledger publish --to sqs://QUEUE`: `SendMessageBatch`, 10 messages a call.
pub(crate) async fn publish(to: &str, messages: &Messages) -> Result<(), String> {
    let name = queue_name(to)?;
    let client = inbox_runtime::source::sqs::client(&AwsSettings::default(), Duration::ZERO).await;
    let url = ensure_queue(&client, name).await?;
    let fifo = name.ends_with(".fifo");
    for chunk in messages.chunks(10) {
        let mut entries = Vec::with_capacity(chunk.len());
        for (i, (line, message_name, body)) in chunk.iter().enumerate() {
            let body = String::from_utf8_lossy(body).into_owned();
            let mut entry = SendMessageBatchRequestEntry::builder().id(i.to_string());
            if let Some(message_name) = message_name {
                let value = MessageAttributeValue::builder()
                    .data_type("String")
                    .string_value(message_name)
                    .build()
                    .map_err(|e| e.to_string())?;
                entry = entry.message_attributes("message-name", value);
            }
            if fifo {
                let group = serde_json::from_str::<serde_json::Value>(&body)
                    .ok()
                    .and_then(|v| v.get("account_id")?.as_str().map(str::to_owned))
                    .filter(|g| !g.is_empty() && g.len() <= 128)
                    .unwrap_or_else(|| "ledger".into());
                entry = entry
                    .message_group_id(group)
                    .message_deduplication_id(format!("line-{line}"));
            }
            entries.push(
                entry
                    .message_body(body)
                    .build()
                    .map_err(|e| e.to_string())?,
            );
        }
        let sent = client
            .send_message_batch()
            .queue_url(&url)
            .set_entries(Some(entries))
            .send()
            .await
            .map_err(|e| format!("SQS: send: {}", aws_sdk_sqs::error::DisplayErrorContext(e)))?;
        if let Some(failed) = sent.failed.first() {
            return Err(format!(
                "SQS refused a message: {} {}",
                failed.code,
                failed.message.as_deref().unwrap_or("")
            ));
        }
    }
    Ok(())
}

/// The source's call counts, printed after the run.
static STATS: OnceLock<SqsStats> = OnceLock::new();

/// `ledger --source sqs://QUEUE`: the source, the queue created if missing. Its long polls wait
/// half of `--idle-exit` (1 to 20 s); `--ack-wait` is the visibility timeout, `--concurrency`
/// the deliveries in flight.
pub(crate) async fn connect(url: &str, args: &ConsumeArgs) -> Result<SqsSource, String> {
    let name = queue_name(url)?;
    let wait = Duration::from_secs_f64((args.idle_exit / 2.0).clamp(1.0, 20.0));
    let client = inbox_runtime::source::sqs::client(&AwsSettings::default(), wait).await;
    let queue_url = ensure_queue(&client, name).await?;
    let config = SqsConfig::new(queue_url)
        .wait_time(wait)
        .visibility_timeout(Duration::from_secs_f64(args.ack_wait.max(1.0)))
        .max_in_flight(usize::from(args.concurrency));
    let source = SqsSource::with_client(client, config)
        .await
        .map_err(|e| e.to_string())?;
    let _ = STATS.set(source.stats());
    Ok(source)
}

/// Prints the SQS calls of this run, if it consumed SQS.
pub(crate) fn print_stats() {
    if let Some(stats) = STATS.get() {
        let c = stats.counts();
        println!(
            "sqs: {} receive calls ({} messages, {} redelivered), {} delete calls ({} deletes), {} visibility \
             calls ({} changes), {} stale receipt handles",
            c.receive_calls,
            c.received,
            c.redelivered,
            c.delete_calls,
            c.deleted,
            c.visibility_calls,
            c.visibility_changes,
            c.invalid_receipts
        );
    }
}
