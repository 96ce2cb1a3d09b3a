//! The demo on Kafka (examples feature `kafka`): `publish --to kafka://BROKERS` produces the
//! stream to a topic, `--source kafka://BROKERS` consumes it as a member of a consumer group
//! through [`inbox_runtime::source::kafka::KafkaSource`], the group's positions kept in the
//! demo's database in the same transaction as each effect. `kafka://mock` runs librdkafka's mock
//! cluster in this process: the demo creates the topic there, publishes the input into it, and
//! consumes it.
//!
//! Each line becomes one record: its `payload` is the value, its `message` the `message-name`
//! header, `message-id` = `line-N`, and the record key is the payload's `event_id` (a UUID in its
//! lower-case hyphenated form, else as written): every copy and every conflicting variant of an
//! event lands in one partition, in the order of the file, so the first one written is the one
//! applied, as with the other sources. A line that is not an envelope is produced as it is,
//! without name or key.

use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use inbox_runtime::source::kafka::{KafkaConfig, KafkaSource};
use inbox_runtime::source::{Delivery, Source, SourceError};
use inbox_runtime::{BoxFuture, Component, Dispatcher, store::PositionsDatabase};
use rdkafka::ClientConfig;
use rdkafka::message::{Header, OwnedHeaders};
use rdkafka::mocking::MockCluster;
use rdkafka::producer::{DefaultProducerContext, FutureProducer, FutureRecord};

use crate::broker::Messages;

/// The URL scheme of Kafka brokers.
pub(crate) const SCHEME: &str = "kafka://";

/// How long a consumer waits for its first partitions before it gives up.
const ASSIGN_TIMEOUT: Duration = Duration::from_secs(60);

/// The Kafka options of `publish` and `--source`.
#[derive(Debug, Clone, clap::Args)]
pub(crate) struct KafkaArgs {
    /// Kafka: the topic of the stream (kafka://mock creates it; on a real cluster it must exist
    /// or be created on first use)
    #[arg(long, default_value = "ledger")]
    pub(crate) topic: String,
    /// Kafka: the partitions of the topic kafka://mock creates
    #[arg(long, default_value_t = 4, value_parser = clap::value_parser!(i32).range(1..=1024))]
    pub(crate) partitions: i32,
    /// Kafka: a librdkafka client property NAME=VALUE (repeatable), e.g.
    /// `session.timeout.ms=6000`, `security.protocol=SASL_SSL`
    #[arg(long = "kafka-property", value_name = "NAME=VALUE", value_parser = property)]
    pub(crate) properties: Vec<(String, String)>,
    /// Kafka: append `PARTITION OFFSET` of every record handed to the worker to FILE, one line
    /// each, written at once (a record delivered again, after a crash or a retry, appears twice)
    #[arg(long, value_name = "FILE")]
    pub(crate) delivery_log: Option<PathBuf>,
}

fn property(text: &str) -> Result<(String, String), String> {
    match text.split_once('=') {
        Some((name, value)) if !name.trim().is_empty() => {
            Ok((name.trim().to_owned(), value.to_owned()))
        }
        _ => Err(format!("expected NAME=VALUE, got `{text}`")),
    }
}

/// The brokers of a `kafka://` URL: `host:port[,host:port…]`, or `mock`.
fn brokers(url: &str) -> Result<&str, String> {
    let brokers = url
        .strip_prefix(SCHEME)
        .unwrap_or(url)
        .trim_end_matches('/');
    if brokers.is_empty() {
        return Err(format!(
            "no brokers in `{url}`: expected kafka://HOST:PORT[,HOST:PORT…] or kafka://mock"
        ));
    }
    Ok(brokers)
}

/// The record key of a message body: its `event_id`, normalized if it is a UUID.
fn record_key(body: &[u8]) -> Option<String> {
    let value: serde_json::Value = serde_json::from_slice(body).ok()?;
    let id = value.get("event_id")?.as_str()?;
    Some(match uuid::Uuid::parse_str(id) {
        Ok(uuid) => uuid.hyphenated().to_string(),
        Err(_) => id.to_owned(),
    })
}

/// Produces `messages` to the topic with an idempotent producer, awaiting every delivery report.
async fn produce(brokers: &str, args: &KafkaArgs, messages: &Messages) -> Result<(), String> {
    let mut config = ClientConfig::new();
    config
        .set("bootstrap.servers", brokers)
        .set("message.timeout.ms", "30000")
        .set("linger.ms", "5");
    for (name, value) in &args.properties {
        config.set(name, value);
    }
    config.set("enable.idempotence", "true");
    let producer: FutureProducer = config
        .create()
        .map_err(|e| format!("Kafka: cannot create a producer: {e}"))?;
    let mut pending = Vec::with_capacity(1024);
    for (index, (line, name, body)) in messages.iter().enumerate() {
        let id = format!("line-{line}");
        let mut headers = OwnedHeaders::new_with_capacity(2).insert(Header {
            key: "message-id",
            value: Some(id.as_str()),
        });
        if let Some(name) = name {
            headers = headers.insert(Header {
                key: "message-name",
                value: Some(name.as_str()),
            });
        }
        let key = name.as_ref().and_then(|_| record_key(body));
        let mut record: FutureRecord<'_, str, [u8]> = FutureRecord::to(&args.topic)
            .payload(body.as_slice())
            .headers(headers);
        if let Some(key) = &key {
            record = record.key(key.as_str());
        }
        let delivery = producer
            .send_result(record)
            .map_err(|(e, _)| format!("Kafka: cannot produce line {line}: {e}"))?;
        pending.push((*line, delivery));
        if pending.len() == 1024 || index + 1 == messages.len() {
            for (line, delivery) in pending.drain(..) {
                match delivery.await {
                    Ok(Ok(_)) => {}
                    Ok(Err((e, _))) => {
                        return Err(format!("Kafka: line {line} not delivered: {e}"));
                    }
                    Err(_) => return Err(format!("Kafka: line {line}: producer gone")),
                }
            }
        }
    }
    Ok(())
}

/// `ledger publish --to kafka://BROKERS`.
pub(crate) async fn publish(
    url: &str,
    args: &KafkaArgs,
    messages: &Messages,
) -> Result<(), String> {
    let brokers = brokers(url)?;
    if brokers == "mock" {
        return Err(
            "kafka://mock lives inside one process: `ledger --source kafka://mock` starts it, \
             publishes the input into it and consumes it"
                .into(),
        );
    }
    produce(brokers, args, messages).await
}

/// A Kafka consumer to connect once the dispatcher is ready (the source installs its position
/// hook on it); with `kafka://mock`, the mock cluster, which must outlive the consumer.
pub(crate) struct Consumer {
    brokers: String,
    group: String,
    args: KafkaArgs,
    concurrency: u16,
    /// librdkafka's mock cluster, running in this process while it lives.
    _mock: Option<MockCluster<'static, DefaultProducerContext>>,
}

impl Consumer {
    /// Parses `url`; for `kafka://mock`, starts the mock cluster, creates the topic and publishes
    /// `input` into it.
    pub(crate) async fn prepare(
        url: &str,
        group: &str,
        args: &KafkaArgs,
        concurrency: u16,
        input: &Path,
    ) -> Result<Self, String> {
        let brokers = brokers(url)?;
        let (brokers, mock) = if brokers == "mock" {
            let cluster = MockCluster::new(1)
                .map_err(|e| format!("Kafka: cannot start the mock cluster: {e}"))?;
            cluster
                .create_topic(&args.topic, args.partitions, 1)
                .map_err(|e| format!("Kafka: cannot create topic {}: {e}", args.topic))?;
            let brokers = cluster.bootstrap_servers();
            let started = Instant::now();
            let messages = crate::broker::lines(input, 0.0, 1)?;
            produce(&brokers, args, &messages).await?;
            println!(
                "kafka: mock cluster at {brokers}: published {} records from {} to topic {} \
                 ({} partitions) in {:.2} s",
                messages.len(),
                input.display(),
                args.topic,
                args.partitions,
                started.elapsed().as_secs_f64()
            );
            (brokers, Some(cluster))
        } else {
            (brokers.to_owned(), None)
        };
        // A new mock cluster is a new topic: the positions a group kept in this database from an
        // earlier run would point at other records. Each mock run joins a group of its own.
        let group = if mock.is_some() {
            format!("{group}-mock-{}", uuid::Uuid::now_v7())
        } else {
            group.to_owned()
        };
        Ok(Self {
            brokers,
            group,
            args: args.clone(),
            concurrency,
            _mock: mock,
        })
    }

    /// Migrates the positions table, joins the group with `dispatcher` (returned with the
    /// source's position hook), and waits until the group gave this consumer its partitions.
    pub(crate) async fn connect<DB: PositionsDatabase>(
        &self,
        dispatcher: Dispatcher<DB>,
    ) -> Result<(Box<dyn Source>, Dispatcher<DB>), String> {
        inbox_runtime::migrate_components(dispatcher.pool(), &[Component::Positions])
            .await
            .map_err(|e| format!("cannot create the positions table: {e}"))?;
        let mut config = KafkaConfig::new(&self.brokers, &self.group, [&self.args.topic])
            .max_buffered(usize::from(self.concurrency).max(64));
        for (name, value) in &self.args.properties {
            config = config.property(name, value);
        }
        let (source, dispatcher) = KafkaSource::connect(config, dispatcher)
            .await
            .map_err(|e| e.to_string())?;
        // Before the worker starts (its idle time runs from then), wait for the partitions: a
        // group's first rebalance takes seconds.
        let handle = source.assignment_handle();
        let started = Instant::now();
        let assignment = loop {
            let assignment = handle.assignment();
            if !assignment.is_empty() {
                break assignment;
            }
            if started.elapsed() > ASSIGN_TIMEOUT {
                return Err(format!(
                    "Kafka: no partition of {} assigned to this consumer of group {} within {} s",
                    self.args.topic,
                    self.group,
                    ASSIGN_TIMEOUT.as_secs()
                ));
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        };
        println!(
            "kafka: group {} assigned partitions {} of topic {} after {:.2} s",
            self.group,
            assignment
                .iter()
                .map(|(_, partition, epoch)| format!("{partition} (epoch {epoch})"))
                .collect::<Vec<_>>()
                .join(", "),
            self.args.topic,
            started.elapsed().as_secs_f64()
        );
        let source: Box<dyn Source> = match &self.args.delivery_log {
            None => Box::new(source),
            Some(path) => {
                let file = std::fs::OpenOptions::new()
                    .create(true)
                    .append(true)
                    .open(path)
                    .map_err(|e| format!("cannot open {}: {e}", path.display()))?;
                Box::new(Logged {
                    inner: source,
                    file,
                })
            }
        };
        Ok((source, dispatcher))
    }
}

/// A source that appends the partition and offset of each delivery to a file.
struct Logged<S> {
    inner: S,
    file: std::fs::File,
}

impl<S: Source> Source for Logged<S> {
    fn name(&self) -> &str {
        self.inner.name()
    }

    fn next(&mut self) -> BoxFuture<'_, Result<Option<Delivery>, SourceError>> {
        Box::pin(async move {
            let delivery = self.inner.next().await?;
            if let Some(metadata) = delivery.as_ref().and_then(|d| d.envelope().source.as_ref()) {
                // One write per line: a line is whole even if the process is killed.
                let line = format!(
                    "{} {}\n",
                    metadata.partition.as_deref().unwrap_or("-"),
                    metadata.offset.unwrap_or(-1)
                );
                self.file.write_all(line.as_bytes()).map_err(|e| {
                    SourceError::new(self.inner.name(), "write the delivery log", e)
                })?;
            }
            Ok(delivery)
        })
    }

    fn close(&mut self) -> BoxFuture<'_, Result<(), SourceError>> {
        self.inner.close()
    }
}
