//! The demo on a broker: `publish` loads a JSON-lines stream into RabbitMQ, NATS JetStream or
//! Kafka (examples feature `kafka`, see `kafka.rs`), `--source` consumes it with an
//! [`inbox_runtime::Worker`].
//!
//! Each line becomes one broker message: its `payload` is the body, its `message` the message
//! name (RabbitMQ: the `type` property; NATS: the `message-name` header). A line that is not a
//! message envelope is published as it is, with no name: the consumer rejects it like the file
//! mode does. RabbitMQ messages are persistent, in a durable queue, published with confirms;
//! JetStream messages are acknowledged by the stream one by one.

use std::path::Path;
use std::time::Duration;

use inbox_runtime::source::Source;
use inbox_runtime::source::amqp::{AmqpConfig, AmqpSource};
use inbox_runtime::source::nats::{NatsConfig, NatsSource};
use inbox_runtime::{Dispatcher, StopReason, Worker, store::PositionsDatabase};
use lapin::options::{BasicPublishOptions, ConfirmSelectOptions, QueueDeclareOptions};
use lapin::types::FieldTable;
use lapin::{BasicProperties, Connection, ConnectionProperties};
use rand_chacha::ChaCha8Rng;
use rand_chacha::rand_core::{Rng as _, SeedableRng as _};
use serde::Deserialize;
use serde_json::value::RawValue;
use tokio_util::sync::CancellationToken;

use crate::feed::Counts;

/// Where the stream lives on each broker.
#[derive(Debug, Clone, clap::Args)]
pub(crate) struct BrokerNames {
    /// RabbitMQ queue (durable; declared by `publish`)
    #[arg(long, default_value = "ledger")]
    pub(crate) queue: String,
    /// JetStream stream (created by `publish`, subjects `<subject>`)
    #[arg(long, default_value = "LEDGER")]
    pub(crate) stream: String,
    /// JetStream subject the messages are published on
    #[arg(long, default_value = "ledger.events")]
    pub(crate) subject: String,
}

/// What `publish` does.
#[derive(Debug, Clone, clap::Args)]
pub(crate) struct PublishArgs {
    /// JSON-lines input file [default: the bundled sample]
    #[arg(value_name = "PATH")]
    pub(crate) input: Option<std::path::PathBuf>,
    /// Broker: amqp://user:password@host:port/vhost, nats://host:port,
    /// kafka://host:port[,host:port…] (examples feature `kafka`) or sqs://QUEUE (examples
    /// feature `sqs`; endpoint, region and credentials from the standard AWS variables)
    #[arg(long, value_name = "URL")]
    pub(crate) to: String,
    #[command(flatten)]
    pub(crate) names: BrokerNames,
    #[cfg(feature = "kafka")]
    #[command(flatten)]
    pub(crate) kafka: crate::kafka::KafkaArgs,
    /// Publish each line once more with this probability (0-100): duplicates from a "producer
    /// retry", on top of those in the file
    #[arg(long, value_name = "PERCENT", default_value_t = 0.0)]
    pub(crate) duplicate: f64,
    /// Seed of the duplicate choice
    #[arg(long, default_value_t = 1)]
    pub(crate) seed: u64,
}

/// How `--source` consumes.
#[derive(Debug, Clone, clap::Args)]
pub(crate) struct ConsumeArgs {
    #[command(flatten)]
    pub(crate) names: BrokerNames,
    /// JetStream durable consumer name, or Kafka consumer group (`kafka://mock`: a new group per
    /// run, named after this one)
    #[arg(long, default_value = "ledger")]
    pub(crate) consumer: String,
    /// Deliveries processed at once (also the prefetch / max ack pending, and the PostgreSQL
    /// pool size)
    #[arg(long, default_value_t = 16)]
    pub(crate) concurrency: u16,
    /// Exit once nothing has arrived for this many seconds
    #[arg(long, value_name = "SECONDS", default_value_t = 3.0, value_parser = seconds)]
    pub(crate) idle_exit: f64,
    /// JetStream: redeliver a delivery neither acked nor nacked after this many seconds (for a
    /// consumer that does not exist yet); SQS: the visibility timeout (renewed while a delivery
    /// is in flight)
    #[arg(long, value_name = "SECONDS", default_value_t = 30.0, value_parser = seconds)]
    pub(crate) ack_wait: f64,
    /// A fast-path dedupe cache in front of the inbox: `memory` (in-process) or
    /// `redis://HOST:PORT/` (shared by every consumer); entries live one hour [default: none]
    #[arg(long, value_name = "memory|redis://…")]
    pub(crate) cache: Option<String>,
    /// Attempts before an event whose handler keeps failing is dead, kept with its payload for
    /// an operator (the inbox's retry policy) [default: 5]; `1`: at the first failure
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u32).range(1..))]
    pub(crate) max_attempts: Option<u32>,
    #[cfg(feature = "kafka")]
    #[command(flatten)]
    pub(crate) kafka: crate::kafka::KafkaArgs,
}

/// A duration in seconds for `--idle-exit` and `--ack-wait`: a finite number from 0 to 43,200
/// (12 hours, SQS's longest visibility timeout); anything else is refused with the reason.
fn seconds(text: &str) -> Result<f64, String> {
    match text.trim().parse::<f64>() {
        Ok(value) if value.is_finite() && (0.0..=43_200.0).contains(&value) => Ok(value),
        Ok(_) => Err(format!(
            "`{text}` is not a number of seconds from 0 to 43200"
        )),
        Err(error) => Err(format!("`{text}` is not a number of seconds: {error}")),
    }
}

/// One line of the input.
#[derive(Deserialize)]
struct Line<'a> {
    message: String,
    #[serde(borrow)]
    payload: &'a RawValue,
}

/// One message to publish: its name (if the line is an envelope) and its body.
type Message = (Option<String>, Vec<u8>);

/// One message to publish: line number (1-based, blank lines not counted), name, body.
pub(crate) type Numbered = (usize, Option<String>, Vec<u8>);

/// The messages to publish.
pub(crate) type Messages = [Numbered];

/// The messages of `input`. Blank lines are skipped.
fn messages(input: &Path) -> Result<Vec<Message>, String> {
    let text = std::fs::read(input).map_err(|e| format!("cannot read {}: {e}", input.display()))?;
    Ok(text
        .split(|&b| b == b'\n')
        .map(<[u8]>::trim_ascii)
        .filter(|line| !line.is_empty())
        .map(|line| match serde_json::from_slice::<Line<'_>>(line) {
            Ok(Line { message, payload }) => (Some(message), payload.get().as_bytes().to_vec()),
            Err(_) => (None, line.to_vec()),
        })
        .collect())
}

/// The messages of `input`, each line once more with probability `duplicate` % (seeded by
/// `seed`), like a retrying producer.
pub(crate) fn lines(input: &Path, duplicate: f64, seed: u64) -> Result<Vec<Numbered>, String> {
    let mut rng = {
        let mut bytes = [0_u8; 32];
        bytes[..8].copy_from_slice(&seed.to_le_bytes());
        ChaCha8Rng::from_seed(bytes)
    };
    let mut out = Vec::new();
    for (number, (name, body)) in messages(input)?.into_iter().enumerate() {
        let copies = if (rng.next_u64() as f64 / u64::MAX as f64) * 100.0 < duplicate {
            2
        } else {
            1
        };
        for _ in 0..copies {
            out.push((number + 1, name.clone(), body.clone()));
        }
    }
    Ok(out)
}

/// The error for a `kafka://` URL in a build without the examples feature `kafka`.
#[cfg(not(feature = "kafka"))]
fn kafka_disabled(url: &str) -> String {
    format!(
        "`{url}`: Kafka needs the examples feature `kafka` (it builds librdkafka with cmake, \
         see scripts/deps.sh): cargo run --example ledger --features kafka -- …"
    )
}

/// The error for an `sqs://` URL in a build without the examples feature `sqs`.
#[cfg(not(feature = "sqs"))]
fn sqs_disabled(url: &str) -> String {
    format!(
        "`{url}`: SQS needs the examples feature `sqs` (the AWS SDK): \
         cargo run --example ledger --features sqs -- …"
    )
}

#[cfg(feature = "sqs")]
async fn publish_sqs(args: &PublishArgs, messages: &Messages) -> Result<(), String> {
    crate::sqs::publish(&args.to, messages).await
}

#[cfg(not(feature = "sqs"))]
async fn publish_sqs(args: &PublishArgs, _: &Messages) -> Result<(), String> {
    Err(sqs_disabled(&args.to))
}

#[cfg(feature = "sqs")]
async fn connect_sqs(url: &str, args: &ConsumeArgs) -> Result<Pending, String> {
    Ok(Pending::Ready(Box::new(
        crate::sqs::connect(url, args).await?,
    )))
}

#[cfg(not(feature = "sqs"))]
async fn connect_sqs(url: &str, _: &ConsumeArgs) -> Result<Pending, String> {
    Err(sqs_disabled(url))
}

#[cfg(feature = "kafka")]
async fn publish_kafka(args: &PublishArgs, messages: &Messages) -> Result<(), String> {
    crate::kafka::publish(&args.to, &args.kafka, messages).await
}

#[cfg(not(feature = "kafka"))]
async fn publish_kafka(args: &PublishArgs, _: &Messages) -> Result<(), String> {
    Err(kafka_disabled(&args.to))
}

#[cfg(feature = "kafka")]
async fn prepare_kafka(url: &str, args: &ConsumeArgs, input: &Path) -> Result<Pending, String> {
    let consumer =
        crate::kafka::Consumer::prepare(url, &args.consumer, &args.kafka, args.concurrency, input)
            .await?;
    Ok(Pending::Kafka(consumer))
}

#[cfg(not(feature = "kafka"))]
async fn prepare_kafka(url: &str, _: &ConsumeArgs, _: &Path) -> Result<Pending, String> {
    Err(kafka_disabled(url))
}

/// Publishes every line of `input` (plus random duplicates) to the broker; returns how many
/// messages were published.
pub(crate) async fn publish(args: &PublishArgs, input: &Path) -> Result<u64, String> {
    let out = lines(input, args.duplicate, args.seed)?;
    if args.to.starts_with("amqp://") || args.to.starts_with("amqps://") {
        publish_amqp(args, &out).await?;
    } else if args.to.starts_with("nats://") || args.to.starts_with("tls://") {
        publish_nats(args, &out).await?;
    } else if args.to.starts_with("kafka://") {
        publish_kafka(args, &out).await?;
    } else if args.to.starts_with("sqs://") {
        publish_sqs(args, &out).await?;
    } else {
        return Err(format!(
            "unsupported broker URL `{}`: expected amqp://…, nats://…, kafka://… or sqs://…",
            args.to
        ));
    }
    Ok(out.len() as u64)
}

async fn publish_amqp(args: &PublishArgs, messages: &Messages) -> Result<(), String> {
    let error = |what: &str| {
        let what = what.to_owned();
        move |e: lapin::Error| format!("RabbitMQ: {what}: {e}")
    };
    let connection = Connection::connect(&args.to, ConnectionProperties::default())
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
            args.names.queue.as_str().into(),
            QueueDeclareOptions::durable(),
            FieldTable::default(),
        )
        .await
        .map_err(error("queue.declare"))?;
    let mut pending = Vec::with_capacity(1024);
    for (index, (line, name, body)) in messages.iter().enumerate() {
        let mut properties = BasicProperties::default()
            .with_delivery_mode(2)
            .with_content_type("application/json".into())
            .with_message_id(format!("line-{line}").into());
        if let Some(name) = name {
            properties = properties.with_type(name.as_str().into());
        }
        let confirm = channel
            .basic_publish(
                "".into(),
                args.names.queue.as_str().into(),
                BasicPublishOptions::default(),
                body,
                properties,
            )
            .await
            .map_err(error("basic.publish"))?;
        pending.push(confirm);
        if pending.len() == 1024 || index + 1 == messages.len() {
            for confirm in pending.drain(..) {
                let confirmation = confirm.await.map_err(error("publisher confirm"))?;
                if !confirmation.is_ack() {
                    return Err("RabbitMQ refused a message (nack)".into());
                }
            }
        }
    }
    channel.close(200, "OK".into()).await.ok();
    connection.close(200, "OK".into()).await.ok();
    Ok(())
}

async fn publish_nats(args: &PublishArgs, messages: &Messages) -> Result<(), String> {
    let client = async_nats::connect(&args.to)
        .await
        .map_err(|e| format!("NATS: cannot connect: {e}"))?;
    let context = async_nats::jetstream::new(client.clone());
    context
        .get_or_create_stream(async_nats::jetstream::stream::Config {
            name: args.names.stream.clone(),
            subjects: vec![args.names.subject.clone()],
            ..Default::default()
        })
        .await
        .map_err(|e| format!("NATS: cannot create stream {}: {e}", args.names.stream))?;
    let mut pending = Vec::with_capacity(1024);
    for (index, (_, name, body)) in messages.iter().enumerate() {
        let mut headers = async_nats::HeaderMap::new();
        if let Some(name) = name {
            headers.insert("message-name", name.as_str());
        }
        let ack = context
            .publish_with_headers(args.names.subject.clone(), headers, body.clone().into())
            .await
            .map_err(|e| format!("NATS: publish: {e}"))?;
        pending.push(ack);
        if pending.len() == 1024 || index + 1 == messages.len() {
            for ack in pending.drain(..) {
                ack.await
                    .map_err(|e| format!("NATS: publish not acknowledged: {e}"))?;
            }
        }
    }
    client
        .flush()
        .await
        .map_err(|e| format!("NATS: flush: {e}"))?;
    Ok(())
}

/// A source to consume: connected, or (Kafka) to connect once the dispatcher is ready.
pub(crate) enum Pending {
    /// A connected source.
    Ready(Box<dyn Source>),
    /// A Kafka consumer: it installs its position hook on the dispatcher as it connects.
    #[cfg(feature = "kafka")]
    Kafka(crate::kafka::Consumer),
}

/// A source for `url`: connected for RabbitMQ and NATS; for Kafka, prepared (with
/// `kafka://mock`, the mock cluster started and `input` published into it).
pub(crate) async fn connect(
    url: &str,
    args: &ConsumeArgs,
    input: &Path,
) -> Result<Pending, String> {
    if url.starts_with("amqp://") || url.starts_with("amqps://") {
        let config = AmqpConfig::new(url, &args.names.queue).prefetch(args.concurrency);
        Ok(Pending::Ready(Box::new(
            AmqpSource::connect(config)
                .await
                .map_err(|e| e.to_string())?,
        )))
    } else if url.starts_with("nats://") || url.starts_with("tls://") {
        let config = NatsConfig::new(url, &args.names.stream, &args.consumer)
            .ack_wait(Duration::from_secs_f64(args.ack_wait))
            .max_ack_pending(i64::from(args.concurrency));
        Ok(Pending::Ready(Box::new(
            NatsSource::connect(config)
                .await
                .map_err(|e| e.to_string())?,
        )))
    } else if url.starts_with("kafka://") {
        prepare_kafka(url, args, input).await
    } else if url.starts_with("sqs://") {
        connect_sqs(url, args).await
    } else {
        Err(format!(
            "unsupported source `{url}`: expected amqp://…, nats://…, kafka://…, sqs://… or \
             file:PATH"
        ))
    }
}

/// Consumes `source` with a worker over `pool` until idle or `shutdown`; the counts of this run
/// and whether it was stopped by a signal.
pub(crate) async fn consume<DB: PositionsDatabase>(
    pool: sqlx::Pool<DB>,
    source: Pending,
    args: &ConsumeArgs,
    shutdown: CancellationToken,
) -> Result<(Counts, bool), String> {
    let dispatcher = Dispatcher::from_registry(pool).map_err(|e| e.to_string())?;
    for handler in dispatcher.handlers() {
        println!("handler: {handler}");
    }
    let dispatcher = crate::with_max_attempts(dispatcher, args.max_attempts);
    let dispatcher = crate::with_cache(dispatcher, args.cache.as_deref()).await?;
    // A Kafka consumer (and its mock cluster) lives until the worker is done.
    #[cfg(feature = "kafka")]
    let mut kafka = None;
    let (source, dispatcher) = match source {
        Pending::Ready(source) => (source, dispatcher),
        #[cfg(feature = "kafka")]
        Pending::Kafka(consumer) => {
            let connected = consumer.connect(dispatcher).await?;
            kafka = Some(consumer);
            connected
        }
    };
    // One message per transaction: the demo's crash and outage tests bound what a kill can leave
    // unacknowledged by `--concurrency` (a batching Worker may hold (concurrency + 1) × 100).
    let worker = Worker::new(dispatcher)
        .concurrency(usize::from(args.concurrency))
        .one_per_transaction()
        .stop_when_idle(Duration::from_secs_f64(args.idle_exit));
    let report = worker
        .run(source, shutdown)
        .await
        .map_err(|e| e.to_string())?;
    #[cfg(feature = "kafka")]
    drop(kafka);
    #[cfg(feature = "sqs")]
    crate::sqs::print_stats();
    println!(
        "deliveries: {} (acked {}, rejected {}, requeued {}, abandoned {}); stopped: {:?}",
        report.deliveries,
        report.acked,
        report.rejected,
        report.requeued,
        report.abandoned,
        report.stop
    );
    // The worker's refused deliveries, counted once the run is over (the worker reports no
    // single rejection to its caller).
    crate::observe::rejected_many(report.invalid);
    let counts = Counts {
        lines: report.deliveries,
        processed: report.processed,
        duplicates: report.duplicates,
        conflicts: report.conflicts,
        rejected: report.invalid,
        dead: report.dead,
        discarded: report.discarded,
        // Failed deliveries were requeued and retried by the worker, not given up.
        failed: 0,
    };
    Ok((counts, report.stop == StopReason::Shutdown))
}
