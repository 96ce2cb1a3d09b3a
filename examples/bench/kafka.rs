//! Kafka scale-out (examples feature `kafka`): consumer **processes** in one group over one
//! topic of librdkafka's mock cluster (running in the harness's process), all on one PostgreSQL.
//!
//! The harness produces the records once (`bench.credit`, fresh UUIDv7 keys), then for each
//! process count starts that many copies of itself as consumers (`--kafka-consumer`, hidden),
//! each a `KafkaSource` + `Worker` of its own in a fresh group, with positions in the database.
//! Once the group has spread the partitions evenly over them, the harness says `go` on their
//! standard input and times until every record is processed (`inbox_messages` counted every
//! 50 ms); then says `stop`, and each prints its worker's report, whose `processed` counts must
//! add up to the records (each effect exactly once).

use std::collections::BTreeMap;
use std::io::{BufRead as _, Write as _};
use std::process::Stdio;
use std::str::FromStr as _;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use inbox_runtime::source::kafka::{KafkaConfig, KafkaSource};
use inbox_runtime::{CancellationToken, Component, Dispatcher, Worker};
use rdkafka::ClientConfig;
use rdkafka::message::{Header, OwnedHeaders};
use rdkafka::mocking::MockCluster;
use rdkafka::producer::{FutureProducer, FutureRecord};
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use tokio::io::{AsyncBufReadExt as _, BufReader};

use crate::measure::{BoxError, CpuDelta, CpuProbe, Rng};
use crate::paths::{KeyKind, MESSAGE, fresh};
use crate::scale::truncate;

/// The topic's partitions: 4 per process at the most processes measured.
pub(crate) const PARTITIONS: i32 = 16;
const TOPIC: &str = "bench-credits";

/// Consumer settings for the mock cluster on a loaded machine.
fn consumer_config(brokers: &str, group: &str) -> KafkaConfig {
    KafkaConfig::new(brokers, group, [TOPIC])
        .max_buffered(512)
        .property("session.timeout.ms", "10000")
        .property("heartbeat.interval.ms", "500")
}

/// `bench --kafka-consumer BROKERS`: one consumer process of the section. Prints `assigned N`
/// whenever its partition count changes until `go` arrives on stdin, then runs its worker until
/// `stop` (or the end of stdin), and prints `report deliveries=N processed=N duplicates=N`.
pub(crate) async fn consumer_main(
    brokers: &str,
    url: &str,
    db_name: &str,
    group: &str,
    concurrency: usize,
) -> Result<(), BoxError> {
    let options = PgConnectOptions::from_str(url)?.database(db_name);
    let pool = PgPoolOptions::new()
        .max_connections(concurrency as u32 + 1)
        .acquire_timeout(Duration::from_secs(60))
        .connect_with(options)
        .await?;
    let dispatcher = Dispatcher::from_registry(pool.clone())?;
    let (source, dispatcher) =
        KafkaSource::connect(consumer_config(brokers, group), dispatcher).await?;
    let handle = source.assignment_handle();
    let mut stdin = BufReader::new(tokio::io::stdin()).lines();
    let mut assigned = usize::MAX;
    loop {
        let now = handle.assignment().len();
        if now != assigned {
            assigned = now;
            println!("assigned {now}");
        }
        tokio::select! {
            line = stdin.next_line() => match line?.as_deref() {
                Some("go") => break,
                Some(_) => {}
                None => return Ok(()),
            },
            () = tokio::time::sleep(Duration::from_millis(20)) => {}
        }
    }
    let stop = CancellationToken::new();
    let stopper = {
        let stop = stop.clone();
        tokio::spawn(async move {
            while let Ok(Some(line)) = stdin.next_line().await {
                if line == "stop" {
                    break;
                }
            }
            stop.cancel();
        })
    };
    let report = Worker::new(dispatcher)
        .concurrency(concurrency)
        .run(source, stop)
        .await?;
    stopper.abort();
    println!(
        "report deliveries={} processed={} duplicates={} fenced={}",
        report.deliveries, report.processed, report.duplicates, report.fenced
    );
    pool.close().await;
    Ok(())
}

/// Produces `records` fresh credits to the topic (keyed by event id) and waits for every
/// delivery report.
async fn produce(brokers: &str, records: u64) -> Result<(), BoxError> {
    let producer: FutureProducer = ClientConfig::new()
        .set("bootstrap.servers", brokers)
        .set("enable.idempotence", "true")
        .set("linger.ms", "5")
        .create()?;
    let mut rng = Rng::new(13);
    let mut pending = Vec::with_capacity(4096);
    for n in 0..records {
        let credit = fresh(&mut rng, KeyKind::TimeOrdered);
        let payload = serde_json::to_vec(&credit)?;
        let key = credit.event_id.to_string();
        let headers = OwnedHeaders::new().insert(Header {
            key: "message-name",
            value: Some(MESSAGE),
        });
        let record = FutureRecord::to(TOPIC)
            .key(key.as_str())
            .payload(payload.as_slice())
            .headers(headers);
        pending.push(producer.send_result(record).map_err(|(e, _)| e)?);
        if pending.len() == 4096 || n + 1 == records {
            for delivery in pending.drain(..) {
                delivery
                    .await
                    .map_err(|_| "producer gone")?
                    .map_err(|(e, _)| e)?;
            }
        }
    }
    Ok(())
}

/// One consumer process, as the harness sees it.
struct Child {
    process: std::process::Child,
    stdin: std::process::ChildStdin,
    /// Its last `assigned N`, and its `report …` fields once printed.
    state: Arc<Mutex<(usize, BTreeMap<String, u64>)>>,
    reader: Option<std::thread::JoinHandle<()>>,
}

impl Child {
    fn spawn(
        url: &str,
        db_name: &str,
        brokers: &str,
        group: &str,
        concurrency: usize,
    ) -> Result<Child, BoxError> {
        let mut process = std::process::Command::new(std::env::current_exe()?)
            .args(["--database-url", url, "--db-name", db_name])
            .args(["--kafka-consumer", brokers, "--kafka-group", group])
            .arg(format!("--kafka-concurrency={concurrency}"))
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()?;
        let stdin = process.stdin.take().ok_or("no stdin")?;
        let stdout = process.stdout.take().ok_or("no stdout")?;
        let state = Arc::new(Mutex::new((0, BTreeMap::new())));
        let reader = {
            let state = state.clone();
            std::thread::spawn(move || {
                for line in std::io::BufReader::new(stdout).lines() {
                    let Ok(line) = line else { break };
                    let mut state = state.lock().unwrap_or_else(PoisonError::into_inner);
                    if let Some(n) = line.strip_prefix("assigned ") {
                        state.0 = n.parse().unwrap_or(0);
                    } else if let Some(fields) = line.strip_prefix("report ") {
                        for field in fields.split_whitespace() {
                            if let Some((name, value)) = field.split_once('=') {
                                state.1.insert(name.to_owned(), value.parse().unwrap_or(0));
                            }
                        }
                    }
                }
            })
        };
        Ok(Child {
            process,
            stdin,
            state,
            reader: Some(reader),
        })
    }

    fn assigned(&self) -> usize {
        self.state.lock().unwrap_or_else(PoisonError::into_inner).0
    }

    fn say(&mut self, line: &str) -> Result<(), BoxError> {
        self.stdin.write_all(line.as_bytes())?;
        self.stdin.write_all(b"\n")?;
        Ok(self.stdin.flush()?)
    }

    /// Waits (up to 120 s) for the process to exit 0; its report.
    async fn finish(mut self) -> Result<BTreeMap<String, u64>, BoxError> {
        let deadline = Instant::now() + Duration::from_secs(120);
        let status = loop {
            if let Some(status) = self.process.try_wait()? {
                break status;
            }
            if Instant::now() > deadline {
                let _ = self.process.kill();
                let _ = self.process.wait();
                return Err("kafka: a consumer did not stop within 120 s".into());
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        };
        if let Some(reader) = self.reader.take() {
            let _ = reader.join();
        }
        if !status.success() {
            return Err(format!("kafka: a consumer exited with {status}").into());
        }
        let state = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        Ok(state.1.clone())
    }
}

impl Drop for Child {
    fn drop(&mut self) {
        // Never left running: killed and reaped if it was not waited for.
        if matches!(self.process.try_wait(), Ok(None)) {
            let _ = self.process.kill();
            let _ = self.process.wait();
        }
    }
}

/// One measured run.
pub(crate) struct Run {
    pub(crate) records: u64,
    pub(crate) elapsed: Duration,
    /// Until the group had spread the partitions over the processes.
    pub(crate) join: Duration,
    pub(crate) processed: u64,
    pub(crate) duplicates: u64,
    pub(crate) cpu: CpuDelta,
}

impl Run {
    pub(crate) fn rate(&self) -> f64 {
        self.records as f64 / self.elapsed.as_secs_f64().max(1e-9)
    }
}

/// The mock cluster with the topic filled, for the runs.
pub(crate) struct Cluster {
    _cluster: MockCluster<'static, rdkafka::producer::DefaultProducerContext>,
    brokers: String,
    records: u64,
    /// The server's URL and the harness's database there, for the consumer processes.
    url: String,
    db_name: String,
}

/// Starts the mock cluster, creates the topic and produces `records` records into it; migrates
/// the positions table.
pub(crate) async fn prepare(
    admin: &sqlx::PgPool,
    url: &str,
    db_name: &str,
    records: u64,
) -> Result<Cluster, BoxError> {
    inbox_runtime::migrate_components(admin, &[Component::Positions]).await?;
    let cluster = MockCluster::new(1)?;
    cluster.create_topic(TOPIC, PARTITIONS, 1)?;
    let brokers = cluster.bootstrap_servers();
    produce(&brokers, records).await?;
    Ok(Cluster {
        _cluster: cluster,
        brokers,
        records,
        url: url.to_owned(),
        db_name: db_name.to_owned(),
    })
}

/// Runs `processes` consumer processes of `concurrency` each, in the fresh group `group`, over
/// the whole topic, on an emptied inbox.
pub(crate) async fn run(
    cluster: &Cluster,
    admin: &sqlx::PgPool,
    cpu: &CpuProbe,
    group: &str,
    processes: usize,
    concurrency: usize,
) -> Result<Run, BoxError> {
    truncate(admin).await?;
    let started = Instant::now();
    let mut children = Vec::with_capacity(processes);
    for _ in 0..processes {
        children.push(Child::spawn(
            &cluster.url,
            &cluster.db_name,
            &cluster.brokers,
            group,
            concurrency,
        )?);
    }
    // Wait until the group spread the partitions evenly (cooperative-sticky moves them in two
    // steps as members join).
    let even = PARTITIONS as usize / processes;
    loop {
        let counts: Vec<usize> = children.iter().map(Child::assigned).collect();
        if counts.iter().sum::<usize>() == PARTITIONS as usize && counts.iter().all(|&n| n >= even)
        {
            break;
        }
        if started.elapsed() > Duration::from_secs(120) {
            return Err(format!(
                "kafka: the group did not spread {PARTITIONS} partitions over {processes} \
                 processes in 120 s: {counts:?}"
            )
            .into());
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let join = started.elapsed();
    let before = cpu.snapshot();
    let go = Instant::now();
    for child in &mut children {
        child.say("go")?;
    }
    loop {
        let (done,): (i64,) = sqlx::query_as("SELECT count(*) FROM inbox_messages")
            .fetch_one(admin)
            .await?;
        if done as u64 >= cluster.records {
            break;
        }
        if go.elapsed() > Duration::from_secs(900) {
            return Err(format!("kafka: {done} of {} records in 900 s", cluster.records).into());
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let elapsed = go.elapsed();
    let cpu = cpu.snapshot().since(&before);
    let (mut processed, mut duplicates) = (0, 0);
    for child in &mut children {
        child.say("stop")?;
    }
    for child in children {
        let report = child.finish().await?;
        processed += report.get("processed").copied().unwrap_or(0);
        duplicates += report.get("duplicates").copied().unwrap_or(0);
    }
    Ok(Run {
        records: cluster.records,
        elapsed,
        join,
        processed,
        duplicates,
        cpu,
    })
}
