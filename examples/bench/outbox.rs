//! The transactional outbox (issue 12): a relay draining a pre-filled backlog into a real broker
//! (RabbitMQ through `AmqpSink`, NATS JetStream through `NatsSink`), and that broker's own
//! publish rate through the same sink, with the same messages, batches and confirms, without
//! the database. The publish-cost rows (a handler with and without one `Outbox::publish`) run
//! through the common machinery in `main.rs`.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use hdrhistogram::Histogram;
use inbox_runtime::outbox::Relay;
use inbox_runtime::sink::amqp::{AmqpSink, AmqpSinkConfig};
use inbox_runtime::sink::nats::NatsSink;
use inbox_runtime::sink::{OutgoingMessage, Sink, SinkError};
use sqlx::PgPool;
use tokio::sync::Barrier;

use crate::measure::{BoxError, BoxFuture, CpuDelta, CpuProbe, histogram};
use crate::paths::EVENTS;

/// The JetStream stream that stores [`EVENTS`].
const STREAM: &str = "BENCH_OUTBOX";

/// Rows per aggregate at most in the backlog: a lease takes one row per aggregate, so a round
/// of 100 needs 100 aggregates with a row due; 4 relays, 400.
const ROWS_PER_AGGREGATE: u64 = 5;

/// A broker the relay publishes to.
#[derive(Debug, Clone)]
pub(crate) enum Broker {
    /// RabbitMQ at this URL: the durable queue [`EVENTS`] on the default exchange, persistent
    /// messages, publisher confirms (`AmqpSink`).
    Amqp(String),
    /// NATS at this URL: the JetStream stream [`STREAM`] (file storage) on the subject
    /// [`EVENTS`], every publish acked by the stream (`NatsSink`).
    Nats(String),
}

impl Broker {
    /// The brokers of this run: `AMQP_URL` and `NATS_URL` (as `scripts/brokers.sh` prints).
    pub(crate) fn from_env() -> Vec<Broker> {
        let var = |name| {
            std::env::var(name)
                .ok()
                .filter(|url: &String| !url.is_empty())
        };
        let mut brokers = Vec::new();
        if let Some(url) = var("AMQP_URL") {
            brokers.push(Broker::Amqp(url));
        }
        if let Some(url) = var("NATS_URL") {
            brokers.push(Broker::Nats(url));
        }
        brokers
    }

    pub(crate) fn label(&self) -> &'static str {
        match self {
            Broker::Amqp(_) => "RabbitMQ (AmqpSink, publisher confirms)",
            Broker::Nats(_) => "NATS JetStream (NatsSink, stream acks)",
        }
    }

    /// Empties the destination: the queue or stream is deleted and made again.
    async fn reset(&self) -> Result<(), BoxError> {
        match self {
            Broker::Amqp(url) => {
                let connection =
                    lapin::Connection::connect(url, lapin::ConnectionProperties::default()).await?;
                let channel = connection.create_channel().await?;
                channel
                    .queue_delete(EVENTS.into(), Default::default())
                    .await?;
                channel
                    .queue_declare(
                        EVENTS.into(),
                        lapin::options::QueueDeclareOptions::durable(),
                        lapin::types::FieldTable::default(),
                    )
                    .await?;
                connection.close(200, "OK".into()).await?;
            }
            Broker::Nats(url) => {
                let context = async_nats::jetstream::new(async_nats::connect(url.as_str()).await?);
                let _ = context.delete_stream(STREAM).await;
                context
                    .create_stream(async_nats::jetstream::stream::Config {
                        name: STREAM.into(),
                        subjects: vec![EVENTS.into()],
                        duplicate_window: Duration::from_secs(120),
                        ..Default::default()
                    })
                    .await?;
            }
        }
        Ok(())
    }

    /// Messages the destination holds.
    async fn stored(&self) -> Result<u64, BoxError> {
        Ok(match self {
            Broker::Amqp(url) => {
                let connection =
                    lapin::Connection::connect(url, lapin::ConnectionProperties::default()).await?;
                let channel = connection.create_channel().await?;
                let queue = channel
                    .queue_declare(
                        EVENTS.into(),
                        lapin::options::QueueDeclareOptions {
                            passive: true,
                            ..Default::default()
                        },
                        lapin::types::FieldTable::default(),
                    )
                    .await?;
                connection.close(200, "OK".into()).await?;
                u64::from(queue.message_count())
            }
            Broker::Nats(url) => {
                let context = async_nats::jetstream::new(async_nats::connect(url.as_str()).await?);
                let mut stream = context.get_stream(STREAM).await?;
                stream.info().await?.state.messages
            }
        })
    }

    /// A sink on a connection of its own (as each relay has its own).
    async fn sink(&self) -> Result<Arc<dyn Sink>, BoxError> {
        let sink: Arc<dyn Sink> = match self {
            Broker::Amqp(url) => {
                Arc::new(AmqpSink::connect(AmqpSinkConfig::new(url.as_str())).await?)
            }
            Broker::Nats(url) => Arc::new(NatsSink::connect(url).await?),
        };
        Ok(sink)
    }
}

/// A sink that times each `publish_batch` of the sink it wraps (per message: the batch's time,
/// recorded once for each message in it) and keeps the first message it sees.
#[derive(Clone)]
struct Timed {
    inner: Arc<dyn Sink>,
    hist: Arc<Mutex<Histogram<u64>>>,
    first: Arc<Mutex<Option<OutgoingMessage>>>,
}

impl Timed {
    fn new(inner: Arc<dyn Sink>) -> Timed {
        Timed {
            inner,
            hist: Arc::new(Mutex::new(histogram())),
            first: Arc::new(Mutex::new(None)),
        }
    }

    fn hist(&self) -> Histogram<u64> {
        self.hist.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    fn first(&self) -> Option<OutgoingMessage> {
        self.first.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }
}

impl Sink for Timed {
    fn publish_batch<'a>(
        &'a self,
        messages: &'a [OutgoingMessage],
    ) -> BoxFuture<'a, Vec<Result<(), SinkError>>> {
        Box::pin(async move {
            let started = Instant::now();
            let results = self.inner.publish_batch(messages).await;
            let us = started.elapsed().as_micros().max(1) as u64;
            if !messages.is_empty() {
                self.hist
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .saturating_record_n(us, messages.len() as u64);
                let mut first = self.first.lock().unwrap_or_else(|e| e.into_inner());
                if first.is_none() {
                    *first = Some(messages[0].clone());
                }
            }
            results
        })
    }
}

/// What one run (relays, or raw publishers) measured.
pub(crate) struct Run {
    /// Messages published and confirmed.
    pub(crate) rows: u64,
    pub(crate) elapsed: Duration,
    /// Per row: from the relay's lease statement to its mark committed (relays only).
    pub(crate) round: Option<Histogram<u64>>,
    /// Per row: its `Sink::publish_batch` call, from the call to the last confirm.
    pub(crate) sink: Histogram<u64>,
    /// Relay rounds that leased rows (relays), or batches (raw).
    pub(crate) batches: u64,
    pub(crate) cpu: CpuDelta,
    /// A published message (the relay's), for the raw run.
    pub(crate) sample: Option<OutgoingMessage>,
}

impl Run {
    pub(crate) fn rate(&self) -> f64 {
        self.rows as f64 / self.elapsed.as_secs_f64().max(1e-9)
    }
}

/// A timed task of a run: its latencies, how many rounds or batches it did, and when it ended.
type Timing = Result<(Histogram<u64>, u64, Instant), BoxError>;

/// Opens `go` to the tasks waiting on it and joins them: their histograms merged, their counts
/// summed, the time from the opening to the last task's end, and the machine's CPU meanwhile; the
/// first task's error if any failed (after every task ended).
async fn start_and_join(
    go: &Barrier,
    tasks: Vec<tokio::task::JoinHandle<Timing>>,
    cpu: &CpuProbe,
) -> Result<(Histogram<u64>, u64, Duration, CpuDelta), BoxError> {
    go.wait().await;
    let start = Instant::now();
    let before = cpu.snapshot();
    let mut merged = histogram();
    let mut count = 0;
    let mut end = start;
    let mut first_error = None;
    for task in tasks {
        match task.await? {
            Ok((hist, n, done)) => {
                merged.add(&hist).expect("same bounds");
                count += n;
                end = end.max(done);
            }
            Err(error) => {
                first_error.get_or_insert(error);
            }
        }
    }
    let cpu = cpu.snapshot().since(&before);
    match first_error {
        Some(error) => Err(error),
        None => Ok((merged, count, end - start, cpu)),
    }
}

/// Empties the outbox and writes `rows` pending rows to [`EVENTS`] in one transaction, as
/// `Outbox::publish` writes them (JSON payloads of `Credited`'s shape, about 90 bytes; message
/// id a UUID; no headers), spread over `rows / 5` aggregates (at least 1,000) in turn, so that
/// consecutive ids belong to different aggregates. Then `ANALYZE` and a `CHECKPOINT`.
pub(crate) async fn fill(pool: &PgPool, rows: u64) -> Result<Duration, BoxError> {
    sqlx::query("TRUNCATE inbox_outbox").execute(pool).await?;
    let aggregates = (rows / ROWS_PER_AGGREGATE).max(1_000) as i64;
    let started = Instant::now();
    sqlx::query(
        "INSERT INTO inbox_outbox (message_id, destination, message_name, payload, headers, \
           aggregate_id) \
         SELECT gen_random_uuid()::text, $1, 'bench.credited', \
           convert_to(format('{\"event_id\":\"%s\",\"account_id\":\"%s\",\"amount_cents\":%s}', \
             gen_random_uuid(), g % $3 + 1, g % 1000), 'UTF8'), \
           '{}', (g % $3 + 1)::text \
         FROM generate_series(0, $2 - 1) g ORDER BY g",
    )
    .bind(EVENTS)
    .bind(rows as i64)
    .bind(aggregates)
    .execute(pool)
    .await?;
    let took = started.elapsed();
    sqlx::query("ANALYZE inbox_outbox").execute(pool).await?;
    let _ = sqlx::query("CHECKPOINT").execute(pool).await;
    Ok(took)
}

/// `relays` relays (each its own pool of one connection and its own sink connection, default
/// settings: batches of 100) drain the outbox, `rows` rows, into `broker`: rounds
/// (`Relay::run_once`) back to back, as `Relay::run` does while there is work, until every row
/// is published. Fails if a publish fails, if nothing is published for 60 s, or if the broker
/// or the table disagree with `rows` afterwards.
pub(crate) async fn relay(
    opts: &sqlx::postgres::PgConnectOptions,
    admin: &PgPool,
    cpu: &CpuProbe,
    broker: &Broker,
    relays: usize,
    rows: u64,
) -> Result<Run, BoxError> {
    broker.reset().await?;
    let published = Arc::new(AtomicU64::new(0));
    let go = Arc::new(Barrier::new(relays + 1));
    let mut sinks = Vec::with_capacity(relays);
    let mut tasks = Vec::with_capacity(relays);
    for _ in 0..relays {
        let pool = sqlx::postgres::PgPoolOptions::new()
            .max_connections(1)
            .min_connections(1)
            .acquire_timeout(Duration::from_secs(60))
            .connect_with(opts.clone())
            .await?;
        let sink = Timed::new(broker.sink().await?);
        sinks.push(sink.clone());
        let relay = Relay::new(pool.clone(), sink);
        let (published, go) = (published.clone(), go.clone());
        tasks.push(tokio::spawn(async move {
            go.wait().await;
            let mut round = histogram();
            let mut rounds = 0_u64;
            let mut progress_at = Instant::now();
            let outcome: Result<(), BoxError> = async {
                while published.load(Ordering::Relaxed) < rows {
                    let started = Instant::now();
                    let report = relay.run_once().await?;
                    if report.failed + report.dead + report.timed_out + report.abandoned > 0 {
                        return Err(format!("relay round: {report:?}").into());
                    }
                    if report.published > 0 {
                        let us = started.elapsed().as_micros().max(1) as u64;
                        round.saturating_record_n(us, report.published as u64);
                        rounds += 1;
                        published.fetch_add(report.published as u64, Ordering::Relaxed);
                        progress_at = Instant::now();
                    } else if progress_at.elapsed() > Duration::from_secs(60) {
                        return Err("no row published for 60 s".into());
                    } else {
                        // Every row left is leased by another relay or waits for its
                        // aggregate's previous row.
                        tokio::time::sleep(Duration::from_millis(1)).await;
                    }
                }
                Ok(())
            }
            .await;
            drop(relay);
            pool.close().await;
            outcome.map(|()| (round, rounds, Instant::now()))
        }));
    }
    let (round, batches, elapsed, cpu) = start_and_join(&go, tasks, cpu).await?;
    let mut sink = histogram();
    for s in &sinks {
        sink.add(s.hist()).expect("same bounds");
    }
    let sample = sinks.iter().find_map(Timed::first);
    drop(sinks);
    let (sent,): (i64,) = sqlx::query_as("SELECT count(*) FROM inbox_outbox WHERE status = 'sent'")
        .fetch_one(admin)
        .await?;
    let stored = broker.stored().await?;
    if sent as u64 != rows || stored != rows {
        return Err(format!(
            "{rows} rows: {sent} marked sent, {stored} stored by {}",
            broker.label()
        )
        .into());
    }
    Ok(Run {
        rows,
        elapsed,
        round: Some(round),
        sink,
        batches,
        cpu,
        sample,
    })
}

/// The broker's own rate through the same sink: `publishers` sinks (a connection each) publish
/// `rows` copies of `sample` (each with a fresh message id, so that JetStream stores each) in
/// batches of `batch`, taken in turn from a shared list, no database. Fails if a publish fails
/// or the broker does not hold `rows` messages afterwards.
pub(crate) async fn raw(
    cpu: &CpuProbe,
    broker: &Broker,
    publishers: usize,
    rows: u64,
    batch: usize,
    sample: &OutgoingMessage,
) -> Result<Run, BoxError> {
    broker.reset().await?;
    let mut messages = Vec::with_capacity(rows as usize);
    for _ in 0..rows {
        let mut message = sample.clone();
        message.message_id = uuid::Uuid::new_v4().to_string();
        messages.push(message);
    }
    let batches: Arc<Vec<Vec<OutgoingMessage>>> = Arc::new(
        messages
            .chunks(batch.max(1))
            .map(<[OutgoingMessage]>::to_vec)
            .collect(),
    );
    drop(messages);
    let next = Arc::new(AtomicU64::new(0));
    let go = Arc::new(Barrier::new(publishers + 1));
    let mut tasks = Vec::with_capacity(publishers);
    for _ in 0..publishers {
        let sink = Timed::new(broker.sink().await?);
        let (batches, next, go) = (batches.clone(), next.clone(), go.clone());
        tasks.push(tokio::spawn(async move {
            go.wait().await;
            let mut count = 0_u64;
            loop {
                let index = next.fetch_add(1, Ordering::Relaxed) as usize;
                let Some(batch) = batches.get(index) else {
                    break;
                };
                for result in sink.publish_batch(batch).await {
                    result.map_err(|e| -> BoxError { Box::new(e) })?;
                }
                count += 1;
            }
            Ok::<_, BoxError>((sink.hist(), count, Instant::now()))
        }));
    }
    let (sink, count, elapsed, cpu) = start_and_join(&go, tasks, cpu).await?;
    let stored = broker.stored().await?;
    if stored != rows {
        return Err(format!("{rows} published: {stored} stored by {}", broker.label()).into());
    }
    Ok(Run {
        rows,
        elapsed,
        round: None,
        sink,
        batches: count,
        cpu,
        sample: None,
    })
}
