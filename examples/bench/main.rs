//! # bench: what the inbox costs, against the database's own limit
//!
//! ```text
//! scripts/bench.sh                       # starts a throwaway PostgreSQL, runs the default set
//! scripts/bench.sh --quick               # about a minute
//! scripts/bench.sh --full                # full sizes: 10 M-row inbox, long memory run (~20 min)
//! cargo run --release -p inbox-examples --example bench -- --database-url postgres://… [--quick|--full]
//! ```
//!
//! Measures, on PostgreSQL (and SQLite where it means something), messages per second and
//! p50/p99 latency of:
//!
//! * the **bare effect** — a ledger upsert of an account balance, in its own transaction, no
//!   inbox: the baseline (`× bare`);
//! * **one message per transaction** through a real `#[idempotent]` handler, called directly on
//!   a held pooled connection, through `Dispatcher::dispatch` (a pooled connection per message)
//!   and through `Dispatcher::dispatch_on` (a held `ConnectionSlot`, as the `Worker` does);
//! * **batch claims** of 10/100/1000 (`Dispatcher::dispatch_batch_on`, called from `batch_op`);
//! * a stream of **100 % duplicates**;
//! * each at **1, 4 and 16 workers** (tasks, each with its own connection);
//! * **pgbench** (`-M prepared`) running the same statements at the same concurrency, in the
//!   same run, interleaved with the Rust paths: the server's own limit (`× pgbench`); pgbench
//!   runs exactly the statements the runtime sends, recorded on the wire (`pgbench.rs`);
//! * the **cost of scale**: claim latency and throughput with the inbox pre-filled with 0, 1 M
//!   (and 10 M with `--full`) rows of time-ordered (UUIDv7) or random (UUIDv4) keys; a worker's
//!   memory over a long run; retention purge throughput;
//! * the **transactional outbox** (`outbox.rs`): the same handler with and without one
//!   `Outbox::publish` (rates and round trips side by side), and 1 and 4 relays draining a
//!   pre-filled backlog into RabbitMQ (`AMQP_URL`) and NATS JetStream (`NATS_URL`) against the
//!   broker's own publish rate through the same sink in the same run.
//! * **Kafka scale-out** (`--only kafka`, examples feature `kafka`; `scripts/bench.sh --only
//!   kafka` adds it): 1, 2 and 4 consumer processes in one group over a 16-partition topic of
//!   librdkafka's mock cluster, on one PostgreSQL (`kafka.rs`).
//! * **Amazon DynamoDB** (`--only dynamodb`, only when named; examples feature `dynamodb`;
//!   `scripts/bench.sh --only dynamodb` adds it and starts a throwaway moto): deliveries per
//!   second and DynamoDB calls per delivery of new keys and duplicates, and a storm of 16 tasks ×
//!   3 deliveries of 500 keys (`dynamodb.rs`).
//! * **Contention** (`--only contention`, only when named): `Worker` batches of 100 over 1,000 hot
//!   accounts, 4 batches in flight vs 1, deadlocks and contention fallbacks (`contention.rs`).
//! * **The peers' workload** (`--only peers`, and in `--smoke`): one seeded list of deliveries
//!   with redeliveries, run by pgbench's naive inbox, pgbench running the runtime's own
//!   statements, the psycopg2 reference consumer, `dispatch_on` and the `Worker` (one per
//!   transaction, batched, defaults), each run checked for exact effects, with WAL bytes per
//!   delivery (`peers.rs`).
//!
//! Round trips per message are counted on the wire (a counting proxy between client and server,
//! see `proxy.rs`), as are the statements each path sends. The harness works in its own
//! database (`--db-name`, default `inbox_bench`, dropped and created at start) so that tests
//! running on the same server are not disturbed. Durability stays on: the server's
//! `synchronous_commit` and `fsync` are reported, never changed; SQLite runs in WAL mode with
//! `synchronous=FULL`.
//!
//! Output: a Markdown report on stdout (progress on stderr). `BENCHMARKS.md` explains the
//! method and the figures.

mod compare;
mod contention;
#[cfg(feature = "dynamodb")]
mod dynamodb;
#[cfg(feature = "kafka")]
mod kafka;
mod measure;
mod mysql;
mod outbox;
mod paths;
mod peers;
mod pgbench;
mod proxy;
mod scale;
mod wire;
mod worker;

use std::collections::HashMap;
use std::path::PathBuf;
use std::process::ExitCode;
use std::str::FromStr as _;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use clap::{Parser, ValueEnum};
use hdrhistogram::Histogram;
use inbox_runtime::{Dispatcher, Fingerprint};
use sqlx::postgres::{PgConnectOptions, PgPoolOptions, PgSslMode};
use sqlx::sqlite::{SqliteConnectOptions, SqliteJournalMode, SqlitePoolOptions, SqliteSynchronous};
use sqlx::{Connection as _, PgConnection, PgPool, SqlitePool};

use measure::{BoxError, CLAIM_TIMING, CpuDelta, CpuProbe, Op, Sample, histogram, run_ops};
use paths::{Conn, ConnOp, Disp, DispatchOp, DupSet, KeyKind, Path, Stream};
use pgbench::{Known, Length, Pgbench, Recordings, Script};

/// The benchmark harness of the inbox (see the module documentation, and BENCHMARKS.md).
#[derive(Parser, Debug, Clone)]
#[command(name = "bench", version, about)]
struct Args {
    /// PostgreSQL server to measure (`postgres://user@host:port/db`); the harness works in its own
    /// database there (see --db-name). Without it, only SQLite is measured.
    #[arg(long, env = "DATABASE_URL")]
    database_url: Option<String>,
    /// MySQL/MariaDB server of the `mysql` section (`mysql://user:password@host:port/db`); the
    /// harness works in its own database there (see --db-name). Without it, that section is
    /// skipped.
    #[arg(long, env = "MYSQL_URL")]
    mysql_url: Option<String>,
    /// DynamoDB endpoint of the `dynamodb` section (`http://127.0.0.1:5012`: moto, DynamoDB
    /// Local); region and credentials from the standard AWS variables. Without it, that section
    /// is skipped.
    #[arg(long, env = "DYNAMODB_ENDPOINT")]
    dynamodb_endpoint: Option<String>,
    /// The database the harness drops, creates and works in.
    #[arg(long, default_value = "inbox_bench")]
    db_name: String,
    /// Drop the harness's database at the end.
    #[arg(long)]
    drop_db: bool,
    /// A couple of minutes: 1 s per measurement, one round, 100 k-row prefill.
    #[arg(long, conflicts_with = "full")]
    quick: bool,
    /// Full sizes: 5 s per measurement, five rounds, 10 M-row prefill, 5-minute memory run.
    #[arg(long)]
    full: bool,
    /// Smallest possible run that still prints every row (for the smoke test).
    #[arg(long)]
    smoke: bool,
    /// Seconds per measurement (overrides the profile).
    #[arg(long)]
    duration: Option<f64>,
    /// Rounds: each row is measured this many times, interleaved with the others; the median
    /// rate is reported.
    #[arg(long)]
    rounds: Option<usize>,
    /// Worker counts (comma-separated).
    #[arg(long, value_delimiter = ',')]
    workers: Option<Vec<usize>>,
    /// Inbox prefill sizes for the scale section (comma-separated rows).
    #[arg(long, value_delimiter = ',')]
    prefill: Option<Vec<u64>>,
    /// Seconds of the worker memory run.
    #[arg(long)]
    memory_secs: Option<f64>,
    /// Rows the purge deletes.
    #[arg(long)]
    purge_rows: Option<u64>,
    /// Pending rows the outbox relays drain (and the raw publishers send), per run.
    #[arg(long)]
    outbox_rows: Option<u64>,
    /// Sections to run (comma-separated); default all.
    #[arg(long, value_delimiter = ',', value_enum)]
    only: Option<Vec<Section>>,
    /// Skip SQLite.
    #[arg(long)]
    no_sqlite: bool,
    /// The pgbench program (default: newest /usr/lib/postgresql/*/bin/pgbench, else PATH).
    #[arg(long)]
    pgbench: Option<PathBuf>,
    /// Tokio worker threads of the harness's runtime; 0 runs everything on one thread
    /// (`current_thread` runtime). Default: one per CPU.
    #[arg(long)]
    runtime_threads: Option<usize>,
    /// Kafka section: consumer process counts (comma-separated) [default: 1,2,4]
    #[arg(long, value_delimiter = ',')]
    kafka_processes: Option<Vec<usize>>,
    /// Kafka section: deliveries in flight per consumer process
    #[arg(long, default_value_t = 4)]
    kafka_concurrency: usize,
    /// Peers section: distinct messages in the list [default: 20000; --quick 5000]
    #[arg(long)]
    peers_messages: Option<usize>,
    /// Peers section: redeliveries of earlier messages in the list [default: 3000; --quick 750]
    #[arg(long)]
    peers_redeliveries: Option<usize>,
    /// Peers section: accounts the credits spread over [default: 1000]
    #[arg(long)]
    peers_accounts: Option<usize>,
    /// Peers section: client counts N of its rows (comma-separated) [default: 1,4,16]; the
    /// batched and default Worker rows run at 4 only
    #[arg(long, value_delimiter = ',')]
    peers_clients: Option<Vec<usize>>,
    /// Contention section: also run the Worker with the aggregate declared (each delivery's
    /// account, what its effect locks: partitioned batches, issue 33), 4 and 1 batches in
    /// flight, beside the undeclared rows. Reported as skipped, saying why, on a build whose
    /// Worker cannot be told the aggregate (`contention::declare_aggregate`)
    #[arg(long)]
    contention_aggregate: bool,
    /// Compare two builds: run the peers section of this binary and of the harness binary at
    /// this path (another revision's build, see `scripts/bench.sh --compare REV`), one round at
    /// a time, alternating which goes first, and report both builds' rates and ratios side by
    /// side. Every other option is passed to both binaries (so both must know it); `--rounds`
    /// counts the rounds of each build.
    #[arg(long)]
    compare_bench: Option<PathBuf>,
    /// With `--compare-bench`: the other build's name in the report (e.g. its commit)
    #[arg(long, default_value = "before")]
    compare_label: String,
    /// With `--compare-bench`: this build's name in the report
    #[arg(long, default_value = "this build")]
    build_label: String,
    /// Internal: run as one consumer process of the Kafka section, on these bootstrap servers
    #[arg(long, hide = true)]
    kafka_consumer: Option<String>,
    /// Internal: the consumer group of `--kafka-consumer`
    #[arg(long, hide = true, default_value = "bench")]
    kafka_group: String,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum Section {
    /// Round trips and statements per path, counted on the wire.
    Rt,
    /// One message per transaction vs the bare effect vs pgbench, at each worker count.
    Main,
    /// 100 % duplicates.
    Dup,
    /// Batch claims.
    Batch,
    /// In-process client CPU of the runtime's per-message work (no database).
    Cpu,
    /// SQLite.
    Sqlite,
    /// Pre-filled inbox: claim latency and throughput.
    Scale,
    /// Worker memory over a long run.
    Memory,
    /// Retention purge throughput.
    Purge,
    /// 100 % duplicates with the dedupe cache off, in process and on Redis (`REDIS_URL`).
    Cache,
    /// The transactional outbox: a handler with and without one `Outbox::publish`; relays
    /// draining a backlog into RabbitMQ (`AMQP_URL`) and NATS JetStream (`NATS_URL`) against
    /// the broker's own publish rate.
    Outbox,
    /// Kafka scale-out: 1, 2, 4 consumer processes in one group (examples feature `kafka`).
    Kafka,
    /// MySQL/MariaDB (`MYSQL_URL`): the bare effect, one message per transaction, batches of 100.
    Mysql,
    /// Concurrent batches whose effects lock the same rows in different orders: several
    /// batches in flight vs one (only when named: `--only contention`).
    Contention,
    /// The Worker (one per transaction, and default batching) against `dispatch_on` at the same
    /// concurrency (only when named: `--only worker`; `worker.rs`).
    Worker,
    /// Amazon DynamoDB (`--dynamodb-endpoint`): new keys, duplicates and a storm, with DynamoDB
    /// calls per delivery (only when named: `--only dynamodb`; examples feature `dynamodb`).
    Dynamodb,
    /// The peers' workload: one seeded list of deliveries through pgbench's naive inbox,
    /// pgbench running the runtime's statements, the psycopg2 reference consumer and ours, with
    /// exact-effect checks (when named: `--only peers`, and in `--smoke`'s default set).
    Peers,
}

/// Sizes and durations of one run.
#[derive(Debug, Clone)]
struct Profile {
    name: &'static str,
    duration: Duration,
    warmup: Duration,
    rounds: usize,
    workers: Vec<usize>,
    sqlite_workers: Vec<usize>,
    prefill: Vec<u64>,
    memory: Duration,
    purge_rows: u64,
    dup_keys: usize,
    /// Messages per path when counting round trips.
    rt_messages: u64,
    /// Pause after each measurement, for closed backends to report their WAL statistics.
    settle: Duration,
    /// Worker counts of the batch section.
    batch_workers: Vec<usize>,
    pgbench: Length,
    /// Pending outbox rows per relay run.
    outbox_rows: u64,
    /// Relay counts of the outbox section.
    relays: Vec<usize>,
}

impl Profile {
    fn of(args: &Args) -> Profile {
        let mut p = if args.smoke {
            Profile {
                name: "smoke",
                duration: Duration::from_millis(100),
                warmup: Duration::from_millis(20),
                rounds: 1,
                workers: vec![1, 4],
                sqlite_workers: vec![1, 4],
                prefill: vec![0, 1_000],
                memory: Duration::from_millis(500),
                purge_rows: 2_000,
                dup_keys: 500,
                rt_messages: 10,
                settle: Duration::from_millis(10),
                batch_workers: vec![1],
                pgbench: Length::Transactions(10),
                outbox_rows: 200,
                relays: vec![1, 4],
            }
        } else if args.quick {
            Profile {
                name: "quick",
                duration: Duration::from_secs(1),
                warmup: Duration::from_millis(300),
                rounds: 1,
                workers: vec![1, 4, 16],
                sqlite_workers: vec![1, 4],
                prefill: vec![0, 100_000],
                memory: Duration::from_secs(10),
                purge_rows: 50_000,
                dup_keys: 5_000,
                rt_messages: 100,
                settle: Duration::from_millis(150),
                batch_workers: vec![1, 4, 16],
                pgbench: Length::Time(1),
                outbox_rows: 20_000,
                relays: vec![1, 4],
            }
        } else if args.full {
            Profile {
                name: "full",
                duration: Duration::from_secs(5),
                warmup: Duration::from_secs(1),
                rounds: 5,
                workers: vec![1, 4, 16],
                sqlite_workers: vec![1, 4],
                prefill: vec![0, 1_000_000, 10_000_000],
                memory: Duration::from_secs(300),
                purge_rows: 1_000_000,
                dup_keys: 20_000,
                rt_messages: 200,
                settle: Duration::from_millis(150),
                batch_workers: vec![1, 4, 16],
                pgbench: Length::Time(5),
                outbox_rows: 200_000,
                relays: vec![1, 4],
            }
        } else {
            Profile {
                name: "default",
                duration: Duration::from_secs(1),
                warmup: Duration::from_millis(250),
                rounds: 3,
                workers: vec![1, 4, 16],
                sqlite_workers: vec![1, 4],
                prefill: vec![0, 1_000_000],
                memory: Duration::from_secs(30),
                purge_rows: 200_000,
                dup_keys: 20_000,
                rt_messages: 200,
                settle: Duration::from_millis(150),
                batch_workers: vec![1, 4, 16],
                pgbench: Length::Time(1),
                outbox_rows: 50_000,
                relays: vec![1, 4],
            }
        };
        if let Some(secs) = args.duration {
            p.duration = Duration::from_secs_f64(secs);
            if !args.smoke {
                p.pgbench = Length::Time(secs.ceil().max(1.0) as u64);
            }
        }
        if let Some(rounds) = args.rounds {
            p.rounds = rounds.max(1);
        }
        if let Some(workers) = &args.workers {
            p.workers = workers.iter().map(|&w| w.max(1)).collect();
            p.batch_workers = p.workers.clone();
        }
        if let Some(prefill) = &args.prefill {
            p.prefill = prefill.clone();
        }
        p.prefill.sort_unstable();
        p.prefill.dedup();
        if let Some(secs) = args.memory_secs {
            p.memory = Duration::from_secs_f64(secs);
        }
        if let Some(rows) = args.purge_rows {
            p.purge_rows = rows;
        }
        if let Some(rows) = args.outbox_rows {
            p.outbox_rows = rows.max(1);
        }
        p
    }
}

fn main() -> ExitCode {
    let args = Args::parse();
    let runtime = match args.runtime_threads {
        Some(0) => tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build(),
        Some(threads) => tokio::runtime::Builder::new_multi_thread()
            .worker_threads(threads)
            .enable_all()
            .build(),
        None => tokio::runtime::Builder::new_multi_thread()
            .enable_all()
            .build(),
    }
    .expect("tokio runtime");
    if let Some(brokers) = &args.kafka_consumer {
        return match runtime.block_on(kafka_consumer(&args, brokers)) {
            Ok(()) => ExitCode::SUCCESS,
            Err(error) => {
                eprintln!("bench consumer: {error}");
                ExitCode::from(2)
            }
        };
    }
    match runtime.block_on(run(&args)) {
        Ok(_) => ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("bench: {error}");
            ExitCode::from(2)
        }
    }
}

/// The report: printed as it grows, and kept (for the smoke test).
#[derive(Default)]
struct Out {
    text: String,
}

impl Out {
    fn line(&mut self, line: impl AsRef<str>) {
        println!("{}", line.as_ref());
        self.text.push_str(line.as_ref());
        self.text.push('\n');
    }

    fn table(&mut self, header: &[&str], rows: &[Vec<String>]) {
        self.line(format!("| {} |", header.join(" | ")));
        self.line(format!(
            "|{}",
            header
                .iter()
                .enumerate()
                .map(|(i, _)| if i == 0 { "---|" } else { "---:|" })
                .collect::<String>()
        ));
        for row in rows {
            self.line(format!("| {} |", row.join(" | ")));
        }
        self.line("");
    }
}

fn progress(what: impl AsRef<str>) {
    eprintln!("bench: {}", what.as_ref());
}

/// Everything about the PostgreSQL under test.
struct Pg {
    opts: PgConnectOptions,
    admin: PgPool,
    cpu: CpuProbe,
    pgbench: Option<Pgbench>,
    /// The runtime's statements, recorded on the wire, for pgbench.
    rec: Recordings,
    /// Fingerprint of the recorded duplicate (pgbench's duplicate keys are stored with it).
    dup_hash: Option<String>,
    /// Round trips per message, by row.
    rt: HashMap<Kind, f64>,
    /// Median rate, by (row, workers), of the main section (for the duplicates' ratios).
    rates: HashMap<(Kind, usize), f64>,
}

/// One row of the main, duplicate and batch tables.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
enum Kind {
    Bare,
    BareTx,
    Direct,
    /// `#[idempotent]` called directly, with one outbox publish in its transaction.
    DirectOutbox,
    /// [`Kind::DirectOutbox`] with `Outbox::notify(false)`.
    DirectOutboxQuiet,
    Dispatch,
    DispatchOn,
    DupDirect,
    DupDispatch,
    DupRedelivered,
    /// Duplicates through `dispatch_on` with a dedupe cache filled beforehand.
    DupCached(CacheKind),
    Batch(usize),
    Pgb(Script),
}

/// The dedupe caches the `cache` section compares.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
enum CacheKind {
    /// `MemoryCache`, in process.
    Memory,
    /// `RedisCache` on `REDIS_URL`.
    Redis,
}

/// The Redis server of the `cache` section (`REDIS_URL`), if any.
fn redis_url() -> Option<String> {
    std::env::var("REDIS_URL")
        .ok()
        .filter(|url| !url.is_empty())
}

/// The cache kinds measurable in this run: in process always, Redis with `REDIS_URL`.
fn cache_kinds() -> Vec<Kind> {
    let mut kinds = vec![Kind::DupCached(CacheKind::Memory)];
    if redis_url().is_some() {
        kinds.push(Kind::DupCached(CacheKind::Redis));
    }
    kinds
}

impl Kind {
    fn label(self) -> String {
        match self {
            Kind::Bare => "bare effect (autocommit) — baseline".into(),
            Kind::BareTx => "bare effect in BEGIN … COMMIT".into(),
            Kind::Direct => "#[idempotent] called directly".into(),
            Kind::DirectOutbox => {
                "#[idempotent] called directly + one Outbox::publish (NOTIFY on, the default)"
                    .into()
            }
            Kind::DirectOutboxQuiet => {
                "#[idempotent] called directly + one Outbox::publish, notify(false)".into()
            }
            Kind::Dispatch => "Dispatcher::dispatch (a pooled connection per message)".into(),
            Kind::DispatchOn => "Dispatcher::dispatch_on (held connection, as the Worker)".into(),
            Kind::DupDirect => "duplicate, #[idempotent] called directly".into(),
            Kind::DupDispatch => "duplicate, Dispatcher::dispatch_on (held connection)".into(),
            Kind::DupRedelivered => {
                "duplicate marked redelivered, Dispatcher::dispatch_on (held connection)".into()
            }
            Kind::DupCached(CacheKind::Memory) => {
                "duplicate, Dispatcher::dispatch_on, in-process cache (MemoryCache)".into()
            }
            Kind::DupCached(CacheKind::Redis) => {
                "duplicate, Dispatcher::dispatch_on, Redis cache (RedisCache)".into()
            }
            Kind::Batch(n) => format!("Dispatcher::dispatch_batch_on, {n} per transaction"),
            Kind::Pgb(script) => script.label().into(),
        }
    }
}

const MAIN_KINDS: [Kind; 12] = [
    Kind::Bare,
    Kind::BareTx,
    Kind::Direct,
    Kind::Dispatch,
    Kind::DispatchOn,
    Kind::Pgb(Script::Bare),
    Kind::Pgb(Script::BareTx),
    Kind::Pgb(Script::Runtime),
    Kind::Pgb(Script::Inbox),
    Kind::Pgb(Script::MinimalClaim),
    Kind::Pgb(Script::InboxBeginPipelined),
    Kind::Pgb(Script::InboxOneTrip),
];

/// pgbench's duplicate keys: '1' … this, stored with the recorded duplicate's fingerprint.
const PGBENCH_DUP_KEYS: u64 = 10_000;

const DUP_KINDS: [Kind; 4] = [
    Kind::DupDirect,
    Kind::DupDispatch,
    Kind::DupRedelivered,
    Kind::Pgb(Script::Duplicate {
        keys: PGBENCH_DUP_KEYS,
    }),
];

const BATCH_SIZES: [usize; 3] = [10, 100, 1000];

/// Seeds for message streams: never the same twice in a process (fresh keys stay fresh).
fn seed() -> u64 {
    static NEXT: AtomicU64 = AtomicU64::new(1);
    NEXT.fetch_add(1, Ordering::Relaxed)
        .wrapping_mul(0x2545_F491_4F6C_DD1D)
}

/// Accumulated measurements of one row over its rounds.
#[derive(Debug, Clone)]
struct Acc {
    rates: Vec<f64>,
    hist: Histogram<u64>,
    claim: Histogram<u64>,
    msgs: u64,
    msgs_total: u64,
    errors: u64,
    first_error: Option<String>,
    cpu: CpuDelta,
    wal: Option<Wal>,
}

/// pg_stat_wal counters (PostgreSQL 14+).
#[derive(Debug, Clone, Copy, Default)]
struct Wal {
    syncs: f64,
    bytes: f64,
    fpi: f64,
    /// Deadlocks detected in the harness's database (pg_stat_database).
    deadlocks: f64,
}

impl Wal {
    fn since(&self, before: &Wal) -> Wal {
        Wal {
            syncs: self.syncs - before.syncs,
            bytes: self.bytes - before.bytes,
            fpi: self.fpi - before.fpi,
            deadlocks: self.deadlocks - before.deadlocks,
        }
    }
}

impl Default for Acc {
    fn default() -> Self {
        Acc {
            rates: Vec::new(),
            hist: histogram(),
            claim: histogram(),
            msgs: 0,
            msgs_total: 0,
            errors: 0,
            first_error: None,
            cpu: CpuDelta::default(),
            wal: Some(Wal::default()),
        }
    }
}

/// One measurement with the counters that surround it.
struct Measured {
    sample: Sample,
    wal: Option<Wal>,
    claim: Option<Histogram<u64>>,
}

impl Acc {
    fn add(&mut self, m: Measured) {
        let s = m.sample;
        self.rates.push(s.rate());
        self.hist.add(&s.hist).expect("same bounds");
        if let Some(claim) = &m.claim {
            self.claim.add(claim).expect("same bounds");
        }
        self.msgs += s.msgs;
        self.msgs_total += s.msgs_total;
        self.errors += s.errors;
        if self.first_error.is_none() {
            self.first_error = s.first_error;
        }
        self.cpu.client += s.cpu.client;
        self.cpu.children += s.cpu.children;
        self.cpu.server = match (self.cpu.server, s.cpu.server) {
            (None, x) if self.rates.len() == 1 => x,
            (Some(a), Some(b)) => Some(a + b),
            _ => None,
        };
        self.cpu.machine += s.cpu.machine;
        self.cpu.wall += s.cpu.wall;
        self.wal = match (self.wal, m.wal) {
            (Some(a), Some(b)) => Some(Wal {
                syncs: a.syncs + b.syncs,
                bytes: a.bytes + b.bytes,
                fpi: a.fpi + b.fpi,
                deadlocks: a.deadlocks + b.deadlocks,
            }),
            _ => None,
        };
    }

    fn rate(&self) -> f64 {
        median(&self.rates)
    }

    /// The spread of the rounds' rates, `min–max`.
    fn spread(&self) -> String {
        let min = self.rates.iter().copied().fold(f64::INFINITY, f64::min);
        let max = self.rates.iter().copied().fold(0.0, f64::max);
        if self.rates.len() < 2 {
            return "—".into();
        }
        format!("{min:.0}–{max:.0}")
    }

    /// A WAL counter per message (warm-up included: the counters cover it).
    fn wal_per_msg(&self, f: impl Fn(&Wal) -> f64, scale: f64, digits: usize) -> String {
        match self.wal {
            Some(wal) if self.msgs_total > 0 => {
                format!("{:.digits$}", f(&wal) / scale / self.msgs_total as f64)
            }
            _ => "—".into(),
        }
    }

    fn per_msg_us(&self, seconds: f64) -> String {
        if self.msgs == 0 {
            return "—".into();
        }
        format!("{:.0}", seconds * 1e6 / self.msgs as f64)
    }
}

fn median(values: &[f64]) -> f64 {
    if values.is_empty() {
        return 0.0;
    }
    let mut v = values.to_vec();
    v.sort_by(f64::total_cmp);
    let n = v.len();
    if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    }
}

fn ms(hist: &Histogram<u64>, q: f64) -> String {
    if hist.is_empty() {
        return "—".into();
    }
    format!("{:.2}", hist.value_at_quantile(q) as f64 / 1000.0)
}

fn ratio(a: f64, b: Option<f64>) -> String {
    match b {
        Some(b) if b > 0.0 && a > 0.0 => format!("{:.2}×", a / b),
        _ => "—".into(),
    }
}

fn opt(x: Option<f64>, digits: usize) -> String {
    x.map_or("—".into(), |x| format!("{x:.digits$}"))
}

async fn run(args: &Args) -> Result<String, BoxError> {
    if let Some(other) = &args.compare_bench {
        return compare::run(args, other).await;
    }
    measure::install_recorder();
    let p = Profile::of(args);
    let wanted = |s: Section| args.only.as_ref().is_none_or(|only| only.contains(&s));
    let mut out = Out::default();
    out.line(format!(
        "# inbox benchmark report ({} profile: {:.1} s per measurement after {:.1} s warm-up, \
         {} round(s), median rate)",
        p.name,
        p.duration.as_secs_f64(),
        p.warmup.as_secs_f64(),
        p.rounds
    ));
    out.line("");
    machine(&mut out);
    if cfg!(debug_assertions) {
        out.line("**Warning: debug build — run with `--release` for meaningful numbers.**");
        out.line("");
    }

    let mut pg = match &args.database_url {
        Some(url) if url.starts_with("postgres") => {
            Some(connect_pg(url, &args.db_name, args.pgbench.as_deref()).await?)
        }
        Some(url) => return Err(format!("not a PostgreSQL URL: {url}").into()),
        None => {
            out.line("PostgreSQL: no --database-url / DATABASE_URL given; PostgreSQL skipped.");
            out.line("");
            None
        }
    };
    if let Some(pg) = &pg {
        server(&mut out, pg).await?;
    }

    let dups = Arc::new(DupSet::new(p.dup_keys, seed()));
    if let Some(pg) = &mut pg {
        // The round trips come first: they record the claim statement pgbench runs.
        if wanted(Section::Rt)
            || wanted(Section::Main)
            || wanted(Section::Dup)
            || wanted(Section::Cache)
        {
            round_trips(&mut out, pg, &p, &dups).await?;
        }
        if wanted(Section::Main) {
            main_section(&mut out, pg, &p).await?;
        }
        if wanted(Section::Dup) {
            dup_section(&mut out, pg, &p, &dups).await?;
        }
        if wanted(Section::Batch) {
            batch_section(&mut out, pg, &p).await?;
        }
        if wanted(Section::Cache) {
            cache_section(&mut out, pg, &p, &dups).await?;
        }
    }
    if wanted(Section::Cpu) {
        cpu_section(&mut out, &p);
    }
    if wanted(Section::Sqlite) && !args.no_sqlite {
        sqlite_section(&mut out, &p, &dups).await?;
    }
    if wanted(Section::Mysql) {
        mysql_section(&mut out, &p, args).await?;
    }
    if args
        .only
        .as_ref()
        .is_some_and(|only| only.contains(&Section::Dynamodb))
    {
        dynamodb_section(&mut out, &p, args).await?;
    }
    if let Some(pg) = &mut pg {
        later_pg_sections(&mut out, pg, &p, args, &wanted).await?;
    }
    if let Some(pg) = pg {
        close_pg(pg, args).await?;
    }
    Ok(out.text)
}

/// The PostgreSQL sections after the SQLite and MySQL ones, then the targets.
async fn later_pg_sections(
    out: &mut Out,
    pg: &mut Pg,
    p: &Profile,
    args: &Args,
    wanted: &dyn Fn(Section) -> bool,
) -> Result<(), BoxError> {
    if wanted(Section::Scale) {
        scale_section(out, pg, p).await?;
    }
    if wanted(Section::Memory) {
        memory_section(out, pg, p).await?;
    }
    if wanted(Section::Purge) {
        purge_section(out, pg, p).await?;
    }
    if wanted(Section::Outbox) {
        outbox_section(out, pg, p).await?;
    }
    if wanted(Section::Kafka) {
        kafka_section(out, pg, p, args).await?;
    }
    if args
        .only
        .as_ref()
        .is_some_and(|only| only.contains(&Section::Contention))
    {
        contention_section(out, pg, p, args).await?;
    }
    if args
        .only
        .as_ref()
        .is_some_and(|only| only.contains(&Section::Worker))
    {
        worker::section(out, &pg.admin, &pg.opts, p.name, p.rounds.max(3)).await?;
    }
    if args
        .only
        .as_ref()
        .map_or(args.smoke, |only| only.contains(&Section::Peers))
    {
        peers::section(out, pg, p, args).await?;
    }
    targets(out, pg, p);
    Ok(())
}

/// Closes the PostgreSQL pool, removes pgbench's files, drops the database if asked.
async fn close_pg(pg: Pg, args: &Args) -> Result<(), BoxError> {
    pg.admin.close().await;
    if let Some(bench) = &pg.pgbench {
        let _ = std::fs::remove_dir_all(&bench.dir);
    }
    if args.drop_db {
        drop_database(
            args.database_url.as_deref().unwrap_or_default(),
            &args.db_name,
        )
        .await?;
    }
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// Environment.

fn machine(out: &mut Out) {
    let read = |path: &str| std::fs::read_to_string(path).unwrap_or_default();
    let cpuinfo = read("/proc/cpuinfo");
    let model = cpuinfo
        .lines()
        .find_map(|l| l.strip_prefix("model name"))
        .map(|l| l.trim_start_matches([' ', '\t', ':']).to_owned())
        .unwrap_or_else(|| "unknown".into());
    let mem_gib = read("/proc/meminfo")
        .lines()
        .find_map(|l| l.strip_prefix("MemTotal:"))
        .and_then(|v| v.split_whitespace().next()?.parse::<f64>().ok())
        .map_or("?".into(), |kib| format!("{:.0}", kib / 1024.0 / 1024.0));
    let nproc = std::thread::available_parallelism().map_or(0, |n| n.get());
    out.line(format!(
        "Machine: {nproc} CPUs ({model}), {mem_gib} GiB RAM, Linux {}, load average at start {}",
        read("/proc/sys/kernel/osrelease").trim(),
        read("/proc/loadavg")
            .split_whitespace()
            .take(3)
            .collect::<Vec<_>>()
            .join(" ")
    ));
    out.line("");
}

async fn server(out: &mut Out, pg: &Pg) -> Result<(), BoxError> {
    let (version,): (String,) = sqlx::query_as("SELECT version()")
        .fetch_one(&pg.admin)
        .await?;
    let settings: Vec<(String, String)> = sqlx::query_as(
        "SELECT name, setting || coalesce(' ' || unit, '') FROM pg_settings WHERE name IN \
         ('fsync', 'synchronous_commit', 'wal_sync_method', 'full_page_writes', \
          'shared_buffers', 'max_wal_size', 'checkpoint_timeout', 'wal_level', \
          'commit_delay', 'max_connections', 'autovacuum') ORDER BY name",
    )
    .fetch_all(&pg.admin)
    .await?;
    out.line(format!("PostgreSQL: {version}"));
    out.line(format!(
        "Settings: {}",
        settings
            .iter()
            .map(|(n, v)| format!("{n}={v}"))
            .collect::<Vec<_>>()
            .join(", ")
    ));
    out.line(format!(
        "Server CPU accounting: {}",
        match pg.cpu.postmaster {
            Some(pid) => format!("postmaster pid {pid} and its children (/proc)"),
            None => "unavailable (server not local or not readable)".into(),
        }
    ));
    match &pg.pgbench {
        Some(b) => {
            let version = std::process::Command::new(&b.program)
                .arg("--version")
                .output()
                .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_owned())
                .unwrap_or_default();
            out.line(format!("pgbench: {} ({version})", b.program.display()));
        }
        None => out.line("pgbench: not found — pgbench rows are skipped"),
    }
    // One round trip on this machine: sqlx's ping is a lone Sync.
    let mut conn = PgConnection::connect_with(&pg.opts).await?;
    let mut hist = histogram();
    for i in 0..2_000 {
        let t = Instant::now();
        conn.ping().await?;
        if i >= 200 {
            hist.saturating_record(t.elapsed().as_micros().max(1) as u64);
        }
    }
    conn.close().await?;
    out.line(format!(
        "One round trip to the server (sqlx ping, a lone Sync): p50 {} µs, p99 {} µs",
        hist.value_at_quantile(0.5),
        hist.value_at_quantile(0.99)
    ));
    out.line("");
    Ok(())
}

async fn connect_pg(
    url: &str,
    db_name: &str,
    pgbench: Option<&std::path::Path>,
) -> Result<Pg, BoxError> {
    if db_name.is_empty()
        || !db_name
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_')
    {
        return Err(format!("--db-name must be [a-z0-9_]+, got {db_name:?}").into());
    }
    progress(format!("creating database {db_name}"));
    let base = PgConnectOptions::from_str(url)?;
    let mut conn = PgConnection::connect_with(&base).await?;
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "DROP DATABASE IF EXISTS {db_name} WITH (FORCE)"
    )))
    .execute(&mut conn)
    .await?;
    sqlx::query(sqlx::AssertSqlSafe(format!("CREATE DATABASE {db_name}")))
        .execute(&mut conn)
        .await?;
    conn.close().await?;
    let opts = base.clone().database(db_name);
    let admin = PgPoolOptions::new()
        .max_connections(2)
        .connect_with(opts.clone())
        .await?;
    paths::setup_pg(&admin).await?;

    // The postmaster's pid, if the server runs here and its data directory is readable.
    let (data_dir,): (String,) = sqlx::query_as("SELECT current_setting('data_directory')")
        .fetch_one(&admin)
        .await
        .unwrap_or_default();
    let postmaster = std::fs::read_to_string(format!("{data_dir}/postmaster.pid"))
        .ok()
        .and_then(|t| t.lines().next()?.trim().parse::<u32>().ok())
        .filter(|pid| std::path::Path::new(&format!("/proc/{pid}")).exists());

    let dir = std::env::temp_dir().join(format!("inbox-bench-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    let pgbench = pgbench::locate(pgbench).map(|program| Pgbench {
        program,
        host: base.get_host().to_owned(),
        port: base.get_port(),
        user: base.get_username().to_owned(),
        password: url_password(url),
        database: db_name.to_owned(),
        dir,
    });
    Ok(Pg {
        opts,
        admin,
        cpu: CpuProbe { postmaster },
        pgbench,
        rec: Recordings::default(),
        dup_hash: None,
        rt: HashMap::new(),
        rates: HashMap::new(),
    })
}

/// The password of a `postgres://user:password@…` URL, for pgbench's `PGPASSWORD`.
fn url_password(url: &str) -> Option<String> {
    let rest = url.split_once("://")?.1;
    let userinfo = rest.split_once('@')?.0;
    userinfo.split_once(':').map(|(_, p)| p.to_owned())
}

async fn drop_database(url: &str, db_name: &str) -> Result<(), BoxError> {
    let mut conn = PgConnection::connect_with(&PgConnectOptions::from_str(url)?).await?;
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "DROP DATABASE IF EXISTS {db_name} WITH (FORCE)"
    )))
    .execute(&mut conn)
    .await?;
    conn.close().await?;
    Ok(())
}

/// WAL fsyncs, bytes and full-page images so far (pg_stat_wal, PostgreSQL 14+).
async fn wal(pg: &Pg) -> Option<Wal> {
    sqlx::query_as::<_, (f64, f64, f64, f64)>(
        "SELECT wal_sync::float8, wal_bytes::float8, wal_fpi::float8, \
           (SELECT deadlocks::float8 FROM pg_stat_database WHERE datname = current_database()) \
         FROM pg_stat_wal",
    )
    .fetch_one(&pg.admin)
    .await
    .ok()
    .map(|(syncs, bytes, fpi, deadlocks)| Wal {
        syncs,
        bytes,
        fpi,
        deadlocks,
    })
}

// ---------------------------------------------------------------------------------------------
// Building and running the Rust paths.

/// A pool of `n` connections, opened up front, with sqlx's defaults otherwise.
/// The workspace's `target/` directory (where the harness keeps its recordings and reports),
/// wherever the harness runs from.
fn workspace_target() -> PathBuf {
    let examples = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
    examples.parent().unwrap_or(examples).join("target")
}

async fn pg_pool(opts: &PgConnectOptions, n: usize) -> Result<PgPool, BoxError> {
    Ok(PgPoolOptions::new()
        .max_connections(n as u32)
        .min_connections(n as u32)
        .acquire_timeout(Duration::from_secs(60))
        .connect_with(opts.clone())
        .await?)
}

/// `workers` ops of row `kind` on `opts`, and the pool they use.
async fn pg_ops(
    opts: &PgConnectOptions,
    kind: Kind,
    workers: usize,
    dups: Option<&Arc<DupSet>>,
    keys: KeyKind,
) -> Result<(PgPool, Vec<Box<dyn Op>>), BoxError> {
    let stream = |worker: usize| -> Result<Stream, BoxError> {
        Ok(match kind {
            Kind::DupDirect | Kind::DupDispatch | Kind::DupRedelivered | Kind::DupCached(_) => {
                Stream::redelivered(dups.ok_or("no duplicate set")?.clone(), worker, workers)
            }
            _ => Stream::fresh(seed(), keys, worker, workers),
        })
    };
    let mut ops: Vec<Box<dyn Op>> = Vec::with_capacity(workers);
    match kind {
        Kind::Bare
        | Kind::BareTx
        | Kind::Direct
        | Kind::DirectOutbox
        | Kind::DirectOutboxQuiet
        | Kind::DupDirect => {
            let pool = pg_pool(opts, workers).await?;
            for worker in 0..workers {
                let path = match kind {
                    Kind::Bare => Path::Bare,
                    Kind::BareTx => Path::BareTx,
                    Kind::DirectOutbox => Path::DirectOutbox,
                    Kind::DirectOutboxQuiet => Path::DirectOutboxQuiet,
                    _ => Path::Direct,
                };
                ops.push(Box::new(ConnOp {
                    conn: Conn::Pg(pool.acquire().await?),
                    path,
                    stream: stream(worker)?,
                }));
            }
            Ok((pool, ops))
        }
        Kind::Dispatch
        | Kind::DispatchOn
        | Kind::DupDispatch
        | Kind::DupRedelivered
        | Kind::DupCached(_)
        | Kind::Batch(_) => {
            let pool = pg_pool(opts, workers).await?;
            let mut dispatcher = Dispatcher::from_registry(pool.clone())?;
            if let Kind::DupCached(cache) = kind {
                dispatcher =
                    with_filled_cache(dispatcher, cache, dups.ok_or("no duplicate set")?).await?;
            }
            let dispatcher = Arc::new(dispatcher);
            for worker in 0..workers {
                if let Kind::Batch(size) = kind {
                    ops.push(
                        batch_op(dispatcher.clone(), size, stream(worker)?)
                            .ok_or("no batch-claim API")?,
                    );
                    continue;
                }
                ops.push(Box::new(DispatchOp::new(
                    Disp::Pg(dispatcher.clone()),
                    stream(worker)?,
                    kind == Kind::DupRedelivered,
                    kind != Kind::Dispatch,
                )));
            }
            Ok((pool, ops))
        }
        Kind::Pgb(_) => Err("pgbench rows have no Rust ops".into()),
    }
}

// =============================================================================================
// BATCH CLAIMS (issue 6, item 1): `Dispatcher::dispatch_batch_on`, the runtime's batch-claim API.
//
// Each `call()` takes `size` fresh messages and runs them through `dispatch_batch_on` in ONE
// transaction (one multi-row claim, the handlers, one check, one commit), checks
// that every outcome is `Processed`, and returns `size`: the runner counts messages, so msgs/s
// compares directly with one message per transaction; latency is per batch. If the API changes,
// this is the one place to adapt (return `None` to print the rows as pending).
// =============================================================================================
fn batch_op(
    dispatcher: Arc<Dispatcher<sqlx::Postgres>>,
    size: usize,
    stream: Stream,
) -> Option<Box<dyn Op>> {
    struct BatchOp {
        dispatcher: Arc<Dispatcher<sqlx::Postgres>>,
        slot: inbox_runtime::ConnectionSlot<sqlx::Postgres>,
        size: usize,
        stream: Stream,
    }
    impl Op for BatchOp {
        fn call(&mut self) -> measure::BoxFuture<'_, Result<u64, BoxError>> {
            Box::pin(async move {
                let mut envelopes = Vec::with_capacity(self.size);
                for _ in 0..self.size {
                    let (msg, _) = self.stream.next();
                    envelopes.push(inbox_runtime::Envelope::new(
                        paths::MESSAGE,
                        serde_json::to_vec(&msg)?,
                    ));
                }
                let results = self
                    .dispatcher
                    .dispatch_batch_on(&mut self.slot, &envelopes)
                    .await;
                if results.len() != self.size {
                    return Err(
                        format!("{} results for {} envelopes", results.len(), self.size).into(),
                    );
                }
                for result in results {
                    let mut outcomes = result?;
                    if outcomes.len() != 1 {
                        return Err(format!("{} consumer outcomes", outcomes.len()).into());
                    }
                    paths::check(outcomes.remove(0).result, false)?;
                }
                Ok(self.size as u64)
            })
        }
    }
    Some(Box::new(BatchOp {
        dispatcher,
        slot: inbox_runtime::ConnectionSlot::new(),
        size,
        stream,
    }))
}

/// Measures one row once: its ops (or pgbench), with WAL counters around and, for handlers, the
/// runtime's claim timing.
async fn measure_pg(
    pg: &Pg,
    kind: Kind,
    workers: usize,
    p: &Profile,
    dups: Option<&Arc<DupSet>>,
    keys: KeyKind,
) -> Result<Measured, BoxError> {
    let before = wal(pg).await;
    let (sample, claim) = match kind {
        Kind::Pgb(script) => {
            let bench = pg.pgbench.as_ref().ok_or("pgbench not found")?;
            let run = bench
                .run(script, &pg.rec, workers, p.pgbench, None, &pg.cpu)
                .await?;
            (run.sample, None)
        }
        _ => {
            let (pool, ops) = pg_ops(&pg.opts, kind, workers, dups, keys).await?;
            let sample =
                run_ops(ops, p.warmup, p.duration, &pg.cpu, &|| CLAIM_TIMING.reset()).await;
            let claim = CLAIM_TIMING.snapshot();
            pool.close().await;
            (sample, Some(claim))
        }
    };
    // Closed backends have flushed their statistics; give them a moment to exit.
    tokio::time::sleep(p.settle).await;
    let after = wal(pg).await;
    let wal = match (before, after) {
        (Some(b), Some(a)) => Some(a.since(&b)),
        _ => None,
    };
    Ok(Measured { sample, wal, claim })
}

/// Runs `kinds` at `workers` for `p.rounds` rounds, rotating their order each round.
async fn rounds(
    pg: &Pg,
    kinds: &[Kind],
    workers: usize,
    p: &Profile,
    dups: Option<&Arc<DupSet>>,
) -> Result<HashMap<Kind, Acc>, BoxError> {
    let mut acc: HashMap<Kind, Acc> = HashMap::new();
    for round in 0..p.rounds {
        let mut order = kinds.to_vec();
        order.rotate_left(round % kinds.len().max(1));
        for kind in order {
            if matches!(kind, Kind::Pgb(_)) && pg.pgbench.is_none() {
                continue;
            }
            progress(format!(
                "{} workers, round {}/{}: {}",
                workers,
                round + 1,
                p.rounds,
                kind.label()
            ));
            let m = measure_pg(pg, kind, workers, p, dups, KeyKind::Random).await?;
            acc.entry(kind).or_default().add(m);
        }
    }
    Ok(acc)
}

const HEADER: [&str; 14] = [
    "path",
    "workers",
    "msgs/s",
    "p50 ms",
    "p99 ms",
    "× bare",
    "× pgbench",
    "round trips/msg",
    "client CPU µs/msg",
    "server CPU µs/msg",
    "CPU busy (cores)",
    "WAL fsyncs/msg",
    "WAL KiB/msg",
    "rounds min–max msgs/s",
];

/// A table row; `bare` and `reference` are the rates the ratios divide by.
fn row(
    pg: &Pg,
    kind: Kind,
    workers: usize,
    acc: &Acc,
    bare: Option<f64>,
    reference: Option<f64>,
) -> Vec<String> {
    let client = if matches!(kind, Kind::Pgb(_)) {
        acc.cpu.children
    } else {
        acc.cpu.client
    };
    let mut label = kind.label();
    if acc.errors > 0 {
        label.push_str(&format!(
            " (**{} errors**: {})",
            acc.errors,
            acc.first_error.as_deref().unwrap_or("?")
        ));
    }
    if let Some(wal) = acc.wal.filter(|w| w.deadlocks > 0.0) {
        label.push_str(&format!(" ({:.0} deadlocks)", wal.deadlocks));
    }
    vec![
        label,
        workers.to_string(),
        format!("{:.0}", acc.rate()),
        ms(&acc.hist, 0.5),
        ms(&acc.hist, 0.99),
        ratio(acc.rate(), bare),
        ratio(acc.rate(), reference),
        opt(pg.rt.get(&kind).copied(), 2),
        acc.per_msg_us(client),
        acc.cpu
            .server
            .map_or("—".into(), |server| acc.per_msg_us(server)),
        if acc.cpu.wall > 0.0 {
            format!("{:.2}", acc.cpu.machine / acc.cpu.wall)
        } else {
            "—".into()
        },
        acc.wal_per_msg(|w| w.syncs, 1.0, 2),
        acc.wal_per_msg(|w| w.bytes, 1024.0, 2),
        acc.spread(),
    ]
}

// ---------------------------------------------------------------------------------------------
// Sections.

/// Round trips and statements per message of every path, counted through the proxy; records
/// the runtime's statements for pgbench.
async fn round_trips(
    out: &mut Out,
    pg: &mut Pg,
    p: &Profile,
    dups: &Arc<DupSet>,
) -> Result<(), BoxError> {
    progress("counting round trips");
    scale::truncate(&pg.admin).await?;
    paths::insert_processed_pg(&pg.admin, dups).await?;
    let (proxy, popts) = start_proxy(pg).await?;

    record_statements(pg, &proxy, &popts).await?;
    prefill_pgbench_dups(pg).await?;

    let n = p.rt_messages;
    let mut rows = Vec::new();
    let mut kinds = vec![
        Kind::Bare,
        Kind::BareTx,
        Kind::Direct,
        Kind::Dispatch,
        Kind::DispatchOn,
        Kind::DupDirect,
        Kind::DupDispatch,
        Kind::DupRedelivered,
    ];
    kinds.extend(cache_kinds());
    if batch_op_available(pg).await {
        kinds.extend([Kind::Batch(10), Kind::Batch(100)]);
    }
    for kind in kinds {
        rows.push(count_round_trips(pg, &proxy, &popts, kind, n, Some(dups)).await?);
    }
    pgbench_round_trips(pg, &proxy, n, &mut rows).await?;
    write_round_trips(out, pg, n, &rows);
    Ok(())
}

/// Records what the runtime sends for one message, and for its redelivery, with values we
/// know (an account and an amount no constant of the runtime's is likely to equal).
async fn record_statements(
    pg: &mut Pg,
    proxy: &proxy::Proxy,
    popts: &PgConnectOptions,
) -> Result<(), BoxError> {
    let pool = pg_pool(popts, 1).await?;
    let mut conn = pool.acquire().await?;
    let mut rng = measure::Rng::new(seed());
    for _ in 0..3 {
        let _ = paths::credit_pg(&mut conn, paths::fresh(&mut rng, KeyKind::Random)).await?;
    }
    let mut msg = paths::fresh(&mut rng, KeyKind::Random);
    msg.account_id = "77777".into();
    msg.amount_cents = 987_654;
    let key = msg.event_id.to_string();
    let known = Known {
        key: &key,
        account: &msg.account_id,
        amount: msg.amount_cents,
    };
    proxy.record();
    let outcome = paths::credit_pg(&mut conn, msg.clone()).await?;
    let log = proxy.take_log();
    if !outcome.is_processed() {
        return Err(format!("recording: unexpected outcome {outcome:?}").into());
    }
    let inbox = pgbench::from_recording(&log, &known, "s")?;
    if inbox.claim.is_none() {
        return Err("no statement bound to the message key was seen on the wire".into());
    }
    proxy.record();
    let outcome = paths::credit_pg(&mut conn, msg.clone()).await?;
    let log = proxy.take_log();
    if !outcome.is_duplicate() {
        return Err(format!("recording a duplicate: unexpected outcome {outcome:?}").into());
    }
    pg.rec = Recordings {
        inbox: Some(inbox),
        duplicate: Some(pgbench::from_recording(&log, &known, "d")?),
    };
    pg.dup_hash = Some(Fingerprint::of(paths::MESSAGE, &msg)?.to_hex());
    drop(conn);
    pool.close().await;
    Ok(())
}

/// pgbench's scripts through the proxy (when pgbench is there): their round trips per message,
/// added to `rows` (and to `pg.rt`).
async fn pgbench_round_trips(
    pg: &mut Pg,
    proxy: &proxy::Proxy,
    n: u64,
    rows: &mut Vec<Vec<String>>,
) -> Result<(), BoxError> {
    let Some(bench) = pg.pgbench.clone() else {
        return Ok(());
    };
    let scripts = [
        Script::Bare,
        Script::BareTx,
        Script::Runtime,
        Script::Inbox,
        Script::MinimalClaim,
        Script::InboxBeginPipelined,
        Script::InboxOneTrip,
        Script::Duplicate {
            keys: PGBENCH_DUP_KEYS,
        },
    ];
    for script in scripts {
        let before = proxy.counts();
        bench
            .run(
                script,
                &pg.rec,
                1,
                Length::Transactions(n),
                Some(("127.0.0.1".into(), proxy.addr().port())),
                &pg.cpu,
            )
            .await?;
        tokio::time::sleep(Duration::from_millis(50)).await;
        let counts = proxy.counts().since(&before);
        let per = |x: u64| x as f64 / n as f64;
        pg.rt.insert(Kind::Pgb(script), per(counts.round_trips()));
        rows.push(vec![
            script.label().into(),
            format!("{:.2}", per(counts.round_trips())),
            format!("{:.2}", per(counts.statements())),
            format!("{:.2}", per(counts.parses)),
            format!(
                "(script: {} round trips)",
                pgbench::round_trips_of(&script.text(&pg.rec)?)
            ),
        ]);
    }
    Ok(())
}

/// The round-trip table (`rows`, `n` messages per path), then the statements recorded.
fn write_round_trips(out: &mut Out, pg: &Pg, n: u64, rows: &[Vec<String>]) {
    out.line("## Round trips per message (PostgreSQL, counted on the wire)");
    out.line("");
    out.line(format!(
        "Each path ran {n} messages on one warm connection through a counting proxy; a round \
         trip is a `Sync` or a simple `Query` from the client. The sequence is one message, one \
         `[…]` per round trip (`[sync]`: sqlx's pool ping). pgbench's counts include its \
         one-time `Parse`s."
    ));
    out.line("");
    out.table(
        &[
            "path",
            "round trips/msg",
            "statements/msg",
            "parses/msg",
            "sequence",
        ],
        rows,
    );
    for (what, rec) in [
        ("one message", &pg.rec.inbox),
        ("one duplicate", &pg.rec.duplicate),
    ] {
        let Some(rec) = rec else { continue };
        out.line(format!(
            "Statements the runtime sent for {what} (pgbench runs them with {}):",
            if rec.defines.is_empty() {
                "no definitions".to_owned()
            } else {
                rec.defines
                    .iter()
                    .map(|(k, v)| format!("`-D {k}={v}`"))
                    .collect::<Vec<_>>()
                    .join(" ")
            }
        ));
        out.line("");
        for original in &rec.originals {
            out.line(format!("    {original};"));
        }
        out.line("");
    }
}

/// A counting proxy in front of the server, and connection options that go through it.
async fn start_proxy(pg: &Pg) -> Result<(proxy::Proxy, PgConnectOptions), BoxError> {
    let upstream = tokio::net::lookup_host((pg.opts.get_host(), pg.opts.get_port()))
        .await?
        .next()
        .ok_or("cannot resolve the server's address")?;
    let proxy = proxy::Proxy::start(upstream).await?;
    let popts = pg
        .opts
        .clone()
        .host("127.0.0.1")
        .port(proxy.addr().port())
        .ssl_mode(PgSslMode::Disable);
    Ok((proxy, popts))
}

/// Runs `n` messages of row `kind` on one warm connection through `proxy` (`popts` points at
/// it), records its round trips per message in `pg.rt`, and returns the round-trip table's row:
/// label, round trips, statements and parses per message, the sequence of one message.
async fn count_round_trips(
    pg: &mut Pg,
    proxy: &proxy::Proxy,
    popts: &PgConnectOptions,
    kind: Kind,
    n: u64,
    dups: Option<&Arc<DupSet>>,
) -> Result<Vec<String>, BoxError> {
    let (pool, mut ops) = pg_ops(popts, kind, 1, dups, KeyKind::Random).await?;
    let op = &mut ops[0];
    let mut warm = 0;
    while warm < n.min(20) {
        warm += op.call().await?;
    }
    tokio::time::sleep(Duration::from_millis(50)).await;
    let before = proxy.counts();
    let mut msgs = 0;
    while msgs < n {
        msgs += op.call().await?;
    }
    // Pooled connections are pinged when returned, in a spawned task.
    tokio::time::sleep(Duration::from_millis(100)).await;
    let counts = proxy.counts().since(&before);
    proxy.record();
    op.call().await?;
    tokio::time::sleep(Duration::from_millis(50)).await;
    let mut sequence = proxy::describe(&proxy.take_log());
    if sequence.chars().count() > 400 {
        sequence = sequence.chars().take(400).collect::<String>() + " …";
    }
    drop(ops);
    pool.close().await;
    let per = |x: u64| x as f64 / msgs as f64;
    pg.rt.insert(kind, per(counts.round_trips()));
    Ok(vec![
        kind.label(),
        format!("{:.2}", per(counts.round_trips())),
        format!("{:.2}", per(counts.statements())),
        format!("{:.2}", per(counts.parses)),
        sequence,
    ])
}

/// Keys '1' … [`PGBENCH_DUP_KEYS`] as processed, with the recorded duplicate's fingerprint:
/// what pgbench's duplicate script claims.
async fn prefill_pgbench_dups(pg: &Pg) -> Result<(), BoxError> {
    let Some(hash) = &pg.dup_hash else {
        return Ok(());
    };
    sqlx::query(
        "INSERT INTO inbox_messages (consumer, message_key, message_name, payload_hash, \
           status, attempts, received_at, processed_at) \
         SELECT $1, g::text, $2, decode($3, 'hex'), 'processed', 1, now(), now() \
         FROM generate_series(1, $4::bigint) g ON CONFLICT DO NOTHING",
    )
    .bind(paths::CONSUMER)
    .bind(paths::MESSAGE)
    .bind(hash)
    .bind(PGBENCH_DUP_KEYS as i64)
    .execute(&pg.admin)
    .await?;
    Ok(())
}

async fn main_section(out: &mut Out, pg: &mut Pg, p: &Profile) -> Result<(), BoxError> {
    let mut rows = Vec::new();
    for &workers in &p.workers {
        scale::truncate(&pg.admin).await?;
        scale::settle(&pg.admin).await;
        let acc = rounds(pg, &MAIN_KINDS, workers, p, None).await?;
        let rate = |k: Kind| acc.get(&k).map(Acc::rate);
        let bare = rate(Kind::Bare);
        let reference = rate(Kind::Pgb(Script::Runtime));
        for kind in MAIN_KINDS {
            if let Some(a) = acc.get(&kind) {
                pg.rates.insert((kind, workers), a.rate());
                rows.push(row(pg, kind, workers, a, bare, reference));
            }
        }
    }
    out.line("## One message per transaction (PostgreSQL)");
    out.line("");
    out.line(
        "`× bare`: rate ÷ the bare effect (one upsert in autocommit) at the same worker count. \
         `× pgbench`: rate ÷ pgbench (`-M prepared`) running exactly the statements the runtime \
         sent for one message (recorded on the wire, see above) at the same concurrency. `[…]` \
         in a pgbench script is one pipeline: one round trip. CPU per message is CPU time ÷ \
         messages in the window; `CPU busy` counts every process on the machine, other tenants \
         included.",
    );
    out.line("");
    out.table(&HEADER, &rows);
    Ok(())
}

async fn dup_section(
    out: &mut Out,
    pg: &mut Pg,
    p: &Profile,
    dups: &Arc<DupSet>,
) -> Result<(), BoxError> {
    scale::truncate(&pg.admin).await?;
    paths::insert_processed_pg(&pg.admin, dups).await?;
    prefill_pgbench_dups(pg).await?;
    scale::settle(&pg.admin).await;
    let mut rows = Vec::new();
    for &workers in &p.workers {
        let acc = rounds(pg, &DUP_KINDS, workers, p, Some(dups)).await?;
        let bare = pg.rates.get(&(Kind::Bare, workers)).copied();
        let reference = acc
            .get(&Kind::Pgb(Script::Duplicate {
                keys: PGBENCH_DUP_KEYS,
            }))
            .map(Acc::rate);
        for kind in DUP_KINDS {
            if let Some(a) = acc.get(&kind) {
                rows.push(row(pg, kind, workers, a, bare, reference));
            }
        }
    }
    out.line("## A stream of 100 % duplicates (PostgreSQL)");
    out.line("");
    out.line(format!(
        "Every delivery's key is already processed with the same payload ({} keys cycled; \
         pgbench claims keys '1'…'{PGBENCH_DUP_KEYS}' stored with the recorded fingerprint). \
         `× bare`: ÷ the bare effect of the main table; `× pgbench`: ÷ pgbench's \
         `BEGIN; claim; ROLLBACK`.",
        dups.messages.len()
    ));
    out.line("");
    out.table(&HEADER, &rows);
    Ok(())
}

/// `dispatcher` with a dedupe cache of `kind` (entries kept an hour), filled by one pass over
/// the duplicate set (every key processed already: each pass fills its entry).
async fn with_filled_cache(
    dispatcher: Dispatcher<sqlx::Postgres>,
    kind: CacheKind,
    dups: &Arc<DupSet>,
) -> Result<Dispatcher<sqlx::Postgres>, BoxError> {
    use inbox_runtime::cache::{MemoryCache, redis::RedisCache};
    let ttl = Duration::from_secs(3600);
    let retention = inbox_runtime::ops::admin::Retention::new(
        Duration::from_secs(86_400),
        Duration::from_secs(3600),
    )?;
    let dispatcher = match kind {
        CacheKind::Memory => dispatcher.with_cache(MemoryCache::new(1_000_000, ttl), &retention)?,
        CacheKind::Redis => {
            let url = redis_url().ok_or("REDIS_URL is not set")?;
            let cache = RedisCache::connect(&url, ttl)
                .await?
                .prefix(format!("bench:{}:", uuid::Uuid::new_v4()));
            dispatcher.with_cache(cache, &retention)?
        }
    };
    let mut slot = inbox_runtime::ConnectionSlot::new();
    for (_, payload) in &dups.messages {
        let envelope = inbox_runtime::Envelope::new(paths::MESSAGE, payload.clone());
        for outcome in dispatcher.dispatch_on(&mut slot, &envelope).await? {
            paths::check(outcome.result, true)?;
        }
    }
    Ok(dispatcher)
}

/// 100 % duplicates with the dedupe cache off, in process and on Redis, side by side.
async fn cache_section(
    out: &mut Out,
    pg: &mut Pg,
    p: &Profile,
    dups: &Arc<DupSet>,
) -> Result<(), BoxError> {
    scale::truncate(&pg.admin).await?;
    paths::insert_processed_pg(&pg.admin, dups).await?;
    scale::settle(&pg.admin).await;
    let mut kinds = vec![Kind::DupDispatch];
    kinds.extend(cache_kinds());
    let mut rows = Vec::new();
    for &workers in &p.workers {
        let acc = rounds(pg, &kinds, workers, p, Some(dups)).await?;
        let bare = pg.rates.get(&(Kind::Bare, workers)).copied();
        let off = acc.get(&Kind::DupDispatch).map(Acc::rate);
        for kind in &kinds {
            if let Some(a) = acc.get(kind) {
                rows.push(row(pg, *kind, workers, a, bare, off));
            }
        }
    }
    let mut header = HEADER;
    header[6] = "× cache off";
    out.line("## Dedupe cache: a stream of 100 % duplicates (PostgreSQL)");
    out.line("");
    out.line(format!(
        "Every delivery's key is already processed with the same payload ({} keys cycled), and \
         the cache holds every key (filled by one pass before measuring). `× cache off`: ÷ the \
         same stream through `Dispatcher::dispatch_on` without a cache. Round trips are \
         counted on the wire to PostgreSQL (Redis's own are not in them). {}",
        dups.messages.len(),
        if redis_url().is_some() {
            "Redis: `REDIS_URL`, on this machine."
        } else {
            "Redis rows: not measured (no `REDIS_URL`)."
        }
    ));
    out.line("");
    out.table(&header, &rows);
    Ok(())
}

async fn batch_section(out: &mut Out, pg: &mut Pg, p: &Profile) -> Result<(), BoxError> {
    let available = batch_op_available(pg).await;
    let mut rows = Vec::new();
    let mut kinds = vec![Kind::DispatchOn];
    kinds.extend(BATCH_SIZES.map(Kind::Batch));
    for &workers in &p.batch_workers {
        if !available {
            for size in BATCH_SIZES {
                let mut cells = vec![Kind::Batch(size).label(), workers.to_string()];
                cells.push("pending: no batch-claim API in the runtime".into());
                cells.resize(HEADER.len(), "—".into());
                rows.push(cells);
            }
            continue;
        }
        scale::truncate(&pg.admin).await?;
        let acc = rounds(pg, &kinds, workers, p, None).await?;
        let bare = pg.rates.get(&(Kind::Bare, workers)).copied();
        let single = acc.get(&Kind::DispatchOn).map(Acc::rate);
        for kind in &kinds {
            if let Some(a) = acc.get(kind) {
                pg.rates.insert((*kind, workers), a.rate());
                rows.push(row(pg, *kind, workers, a, bare, single));
            }
        }
    }
    let mut header = HEADER;
    header[6] = "× dispatch (1 msg/tx)";
    out.line("## Batch claims (PostgreSQL, `Dispatcher::dispatch_batch_on`)");
    out.line("");
    out.line(
        "One transaction per batch: one multi-row claim, the handlers (no savepoints while none \
         fails), one check, one commit; measured side by side with `Dispatcher::dispatch_on` \
         (one message per transaction on a held connection, as the Worker runs it). Latency is \
         per batch. `batch_op` in examples/bench/main.rs is \
         the one place that calls the API. Target: batches of 100 at ≥ 10× one message per \
         transaction.",
    );
    out.line("");
    out.table(&header, &rows);
    Ok(())
}

async fn batch_op_available(pg: &Pg) -> bool {
    match Dispatcher::from_registry(pg.admin.clone()) {
        Ok(d) => batch_op(Arc::new(d), 1, Stream::fresh(seed(), KeyKind::Random, 0, 1)).is_some(),
        Err(_) => false,
    }
}

/// The runtime's per-message work that needs no database, timed in a loop.
fn cpu_section(out: &mut Out, p: &Profile) {
    use inbox_runtime::Message as _;
    use std::hint::black_box;
    let n: u32 = if p.name == "smoke" { 2_000 } else { 200_000 };
    let mut rng = measure::Rng::new(seed());
    let msg = paths::fresh(&mut rng, KeyKind::Random);
    let payload = serde_json::to_vec(&msg).expect("serializable");
    let time = |f: &mut dyn FnMut()| {
        for _ in 0..n / 10 {
            f();
        }
        let started = Instant::now();
        for _ in 0..n {
            f();
        }
        started.elapsed().as_nanos() as f64 / f64::from(n) / 1000.0
    };
    let rows = vec![
        vec![
            "payload fingerprint: `Fingerprint::of` (RFC 8785 canonical JSON + SHA-256)".into(),
            format!(
                "{:.2}",
                time(&mut || {
                    black_box(Fingerprint::of(paths::MESSAGE, black_box(&msg)).ok());
                })
            ),
            "every delivery (direct and dispatched)".into(),
        ],
        vec![
            "idempotency key: `Message::idempotency_key`".into(),
            format!(
                "{:.2}",
                time(&mut || {
                    black_box(black_box(&msg).idempotency_key().ok());
                })
            ),
            "every delivery".into(),
        ],
        vec![
            "payload decode: `serde_json::from_slice`".into(),
            format!(
                "{:.2}",
                time(&mut || {
                    black_box(serde_json::from_slice::<paths::Credit>(black_box(&payload)).ok());
                })
            ),
            "dispatch only".into(),
        ],
        vec![
            "payload encode: `serde_json::to_vec` (the harness's producer side)".into(),
            format!(
                "{:.2}",
                time(&mut || {
                    black_box(serde_json::to_vec(black_box(&msg)).ok());
                })
            ),
            "dispatch rows of this harness".into(),
        ],
    ];
    out.line("## Client CPU of the per-message work without the database");
    out.line("");
    out.line(format!(
        "{n} iterations each, one thread, on a {}-byte payload; compare with the client CPU \
         µs/msg of the tables above.",
        payload.len()
    ));
    out.line("");
    out.table(&["work", "µs per message", "paid by"], &rows);
}

/// A fresh SQLite file for a section (WAL, synchronous=FULL) in its own temporary directory, set
/// up with the bench's tables: the directory (remove it when done), the options to open more
/// pools with, and a one-connection pool for more set-up.
async fn sqlite_bench_db(
    section: &str,
) -> Result<(PathBuf, SqliteConnectOptions, SqlitePool), BoxError> {
    let dir = std::env::temp_dir().join(format!("inbox-bench-{section}-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    let opts = SqliteConnectOptions::new()
        .filename(dir.join("bench.db"))
        .create_if_missing(true)
        .journal_mode(SqliteJournalMode::Wal)
        .synchronous(SqliteSynchronous::Full)
        .busy_timeout(Duration::from_secs(60));
    let setup = SqlitePoolOptions::new()
        .max_connections(1)
        .connect_with(opts.clone())
        .await?;
    paths::setup_sqlite(&setup).await?;
    Ok((dir, opts, setup))
}

/// `p.rounds` rounds of every kind at `workers` on SQLite, the kinds' order rotated each round
/// (a fresh pool per measurement); `what` prefixes the progress lines.
async fn sqlite_rounds(
    opts: &SqliteConnectOptions,
    kinds: &[Kind],
    workers: usize,
    p: &Profile,
    dups: &Arc<DupSet>,
    cpu: &CpuProbe,
    what: &str,
) -> Result<HashMap<Kind, Acc>, BoxError> {
    let mut acc: HashMap<Kind, Acc> = HashMap::new();
    for round in 0..p.rounds {
        let mut order = kinds.to_vec();
        order.rotate_left(round % kinds.len());
        for kind in order {
            progress(format!(
                "{what}, {workers} workers, round {}: {}",
                round + 1,
                kind.label()
            ));
            let pool = SqlitePoolOptions::new()
                .max_connections(workers as u32)
                .min_connections(workers as u32)
                .acquire_timeout(Duration::from_secs(60))
                .connect_with(opts.clone())
                .await?;
            let ops = sqlite_ops(&pool, kind, workers, dups).await?;
            let sample = run_ops(ops, p.warmup, p.duration, cpu, &|| {}).await;
            pool.close().await;
            acc.entry(kind).or_default().add(Measured {
                sample,
                wal: None,
                claim: None,
            });
        }
    }
    Ok(acc)
}

/// A table row's label, with the errors of its runs (if any) and the first one.
fn with_errors(mut label: String, a: &Acc) -> String {
    if a.errors > 0 {
        label.push_str(&format!(
            " (**{} errors**: {})",
            a.errors,
            a.first_error.as_deref().unwrap_or("?")
        ));
    }
    label
}

async fn sqlite_section(out: &mut Out, p: &Profile, dups: &Arc<DupSet>) -> Result<(), BoxError> {
    let (dir, opts, setup) = sqlite_bench_db("sqlite").await?;
    paths::insert_processed_sqlite(&setup, dups).await?;
    let (version,): (String,) = sqlx::query_as("SELECT sqlite_version()")
        .fetch_one(&setup)
        .await?;
    setup.close().await;

    let kinds = [
        Kind::Bare,
        Kind::BareTx,
        Kind::Direct,
        Kind::Dispatch,
        Kind::DupDirect,
        Kind::DupDispatch,
    ];
    let cpu = CpuProbe::default();
    let mut rows = Vec::new();
    for &workers in &p.sqlite_workers {
        let acc = sqlite_rounds(&opts, &kinds, workers, p, dups, &cpu, "SQLite").await?;
        let bare = acc.get(&Kind::Bare).map(Acc::rate);
        let direct = acc.get(&Kind::Direct).map(Acc::rate);
        for kind in kinds {
            let Some(a) = acc.get(&kind) else { continue };
            rows.push(vec![
                with_errors(kind.label(), a),
                workers.to_string(),
                format!("{:.0}", a.rate()),
                ms(&a.hist, 0.5),
                ms(&a.hist, 0.99),
                ratio(a.rate(), bare),
                ratio(a.rate(), direct),
                a.per_msg_us(a.cpu.client),
                if a.cpu.wall > 0.0 {
                    format!("{:.2}", a.cpu.machine / a.cpu.wall)
                } else {
                    "—".into()
                },
            ]);
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
    out.line(format!(
        "## SQLite {version} (WAL, synchronous=FULL, one file, in-process)"
    ));
    out.line("");
    out.line(
        "No network round trips: each statement is a call into the SQLite worker thread of \
         sqlx. Writers are serialized by the database lock (`BEGIN IMMEDIATE`), so more workers \
         only queue. `× direct`: ÷ `#[idempotent]` called directly at the same worker count.",
    );
    out.line("");
    out.table(
        &[
            "path",
            "workers",
            "msgs/s",
            "p50 ms",
            "p99 ms",
            "× bare",
            "× direct",
            "client CPU µs/msg (incl. SQLite)",
            "CPU busy (cores)",
        ],
        &rows,
    );
    Ok(())
}

async fn sqlite_ops(
    pool: &SqlitePool,
    kind: Kind,
    workers: usize,
    dups: &Arc<DupSet>,
) -> Result<Vec<Box<dyn Op>>, BoxError> {
    let stream = |worker: usize| match kind {
        Kind::DupDirect | Kind::DupDispatch => Stream::redelivered(dups.clone(), worker, workers),
        _ => Stream::fresh(seed(), KeyKind::Random, worker, workers),
    };
    let mut ops: Vec<Box<dyn Op>> = Vec::with_capacity(workers);
    match kind {
        Kind::Dispatch | Kind::DupDispatch => {
            let dispatcher = Arc::new(Dispatcher::from_registry(pool.clone())?);
            for worker in 0..workers {
                ops.push(Box::new(DispatchOp::new(
                    Disp::Lite(dispatcher.clone()),
                    stream(worker),
                    false,
                    kind != Kind::Dispatch,
                )));
            }
        }
        _ => {
            for worker in 0..workers {
                let path = match kind {
                    Kind::Bare => Path::Bare,
                    Kind::BareTx => Path::BareTx,
                    Kind::DirectOutbox | Kind::DirectOutboxQuiet => Path::DirectOutbox,
                    _ => Path::Direct,
                };
                ops.push(Box::new(ConnOp {
                    conn: Conn::Lite(pool.acquire().await?),
                    path,
                    stream: stream(worker),
                }));
            }
        }
    }
    Ok(ops)
}

async fn scale_section(out: &mut Out, pg: &mut Pg, p: &Profile) -> Result<(), BoxError> {
    let max_workers = p.workers.iter().copied().max().unwrap_or(1);
    let mut worker_counts = vec![1];
    if max_workers > 1 {
        worker_counts.push(max_workers);
    }
    let mut rows = Vec::new();
    for keys in [KeyKind::TimeOrdered, KeyKind::Random] {
        let mut empty_claim: HashMap<usize, f64> = HashMap::new();
        for &target in &p.prefill {
            // A fresh fill per size: rows measured before must not sit among the filled keys.
            scale::truncate(&pg.admin).await?;
            let mut fill_note = "—".to_owned();
            if target > 0 {
                progress(format!(
                    "filling the inbox with {target} rows ({})",
                    keys.label()
                ));
                let started = Instant::now();
                scale::fill(&pg.admin, keys, 0, target).await?;
                let secs = started.elapsed().as_secs_f64();
                fill_note = format!("{secs:.1} s ({:.0} rows/s)", target as f64 / secs.max(1e-9));
            }
            scale::settle(&pg.admin).await;
            let (heap, index) = scale::sizes(&pg.admin).await?;
            for &workers in &worker_counts {
                progress(format!(
                    "scale: {target} rows, {}, {workers} workers",
                    keys.label()
                ));
                let mut acc = Acc::default();
                for _ in 0..p.rounds {
                    acc.add(measure_pg(pg, Kind::Direct, workers, p, None, keys).await?);
                }
                let claim_p50 = acc.claim.value_at_quantile(0.5) as f64;
                empty_claim.entry(workers).or_insert(claim_p50);
                rows.push(vec![
                    keys.label().into(),
                    target.to_string(),
                    workers.to_string(),
                    format!("{:.0}", acc.rate()),
                    ms(&acc.hist, 0.5),
                    ms(&acc.hist, 0.99),
                    ms(&acc.claim, 0.5),
                    ms(&acc.claim, 0.99),
                    ratio(claim_p50, empty_claim.get(&workers).copied()),
                    acc.wal_per_msg(|w| w.bytes, 1024.0, 2),
                    acc.wal_per_msg(|w| w.fpi, 1.0, 2),
                    fill_note.clone(),
                    format!("{heap} / {index}"),
                ]);
            }
        }
    }
    out.line("## Scale: a pre-filled inbox (PostgreSQL, `#[idempotent]` called directly)");
    out.line("");
    out.line(
        "The inbox is filled with `INSERT … SELECT generate_series` (processed rows of the same \
         consumer); then fresh messages with keys of the same kind run through the handler. \
         `claim` is the runtime's own `inbox_claim_duration_seconds` (BEGIN + claim statement); \
         `× empty` compares its p50 with the empty inbox at the same worker count (target at \
         10 M rows: ≤ 1.3×). Each size is measured right after the fill and a `CHECKPOINT`: \
         the first change of each index page after a checkpoint writes a full-page image to the \
         WAL, which random keys pay on every page and time-ordered keys on the last one only.",
    );
    out.line("");
    out.table(
        &[
            "keys",
            "inbox rows",
            "workers",
            "msgs/s",
            "p50 ms",
            "p99 ms",
            "claim p50 ms",
            "claim p99 ms",
            "claim p50 × empty",
            "WAL KiB/msg",
            "full-page images/msg",
            "fill time",
            "heap / indexes",
        ],
        &rows,
    );
    Ok(())
}

async fn memory_section(out: &mut Out, pg: &mut Pg, p: &Profile) -> Result<(), BoxError> {
    const WORKERS: usize = 4;
    const BATCH: usize = 100;
    let mut rows = Vec::new();
    for batch in [None, Some(BATCH)] {
        scale::truncate(&pg.admin).await?;
        progress(format!(
            "memory: a Worker for {:.0} s{}",
            p.memory.as_secs_f64(),
            batch.map_or(String::new(), |size| format!(", batches of {size}"))
        ));
        let pool = pg_pool(&pg.opts, WORKERS + 1).await?;
        let run = scale::memory(pool.clone(), WORKERS, batch, p.memory).await?;
        pool.close().await;
        let (warm, peak, end) = run.rss();
        let slope = run.slope_per_100k();
        let flat = end <= warm + (warm / 20).max(2048);
        rows.push(vec![
            match batch {
                None => format!("{:.0} s, concurrency {WORKERS}", run.elapsed.as_secs_f64()),
                Some(size) => format!(
                    "{:.0} s, `batch({size}, 5 ms)`, concurrency 1 (one batch running, the next gathering)",
                    run.elapsed.as_secs_f64(),
                ),
            },
            run.settled.to_string(),
            format!("{:.0}", run.settled as f64 / run.elapsed.as_secs_f64()),
            format!("{} / {} / {}", run.processed, run.duplicates, run.failed),
            format!("{:.1}", warm as f64 / 1024.0),
            format!("{:.1}", peak as f64 / 1024.0),
            format!("{:.1}", end as f64 / 1024.0),
            format!("{slope:.1}"),
            if flat { "yes" } else { "**no**" }.into(),
        ]);
    }
    out.line("## Worker memory over a long run (PostgreSQL)");
    out.line("");
    out.line(format!(
        "`inbox_runtime::Worker` over an endless generated stream (UUIDv7 keys, 10 % redeliveries \
         of recent messages), a pool of {WORKERS} + 1 connections: one delivery per transaction \
         at concurrency {WORKERS}, then `Worker::batch({BATCH}, 5 ms)`. RSS of this process \
         from /proc/self/status every 250 ms; `warm` is after the first fifth of the run."
    ));
    out.line("");
    out.table(
        &[
            "run",
            "messages settled",
            "msgs/s",
            "processed / duplicates / failed",
            "RSS warm MiB",
            "RSS peak MiB",
            "RSS end MiB",
            "slope KiB per 100k msgs",
            "flat",
        ],
        &rows,
    );
    Ok(())
}

async fn purge_section(out: &mut Out, pg: &mut Pg, p: &Profile) -> Result<(), BoxError> {
    let mut rows = Vec::new();
    let recent = p.purge_rows / 10;
    for batch in [1_000_u32, 10_000] {
        progress(format!(
            "purge: {} old rows, batches of {batch}",
            p.purge_rows
        ));
        let run = scale::purge(&pg.admin, p.purge_rows, recent, batch).await?;
        let secs = run.elapsed.as_secs_f64();
        rows.push(vec![
            batch.to_string(),
            run.report.deleted.to_string(),
            run.report.batches.to_string(),
            format!("{secs:.2}"),
            format!("{:.0}", run.report.deleted as f64 / secs.max(1e-9)),
            format!(
                "{:.1} / {:.1}",
                run.first_batches.as_secs_f64() * 1e3,
                run.last_batches.as_secs_f64() * 1e3
            ),
            format!("{} (expected {recent})", run.kept),
        ]);
    }
    scale::truncate(&pg.admin).await?;
    out.line("## Retention purge (PostgreSQL, `inbox_runtime::ops::admin::purge`)");
    out.line("");
    out.line(format!(
        "{} processed rows received 30 days ago and {recent} received a day ago; a 7-day \
         window; one short statement per batch (`DELETE … WHERE (consumer, message_key) IN \
         (SELECT … LIMIT n FOR UPDATE SKIP LOCKED)`).",
        p.purge_rows
    ));
    out.line("");
    out.table(
        &[
            "batch size",
            "rows deleted",
            "batches",
            "seconds",
            "rows/s",
            "ms per batch: first / last tenth",
            "rows kept",
        ],
        &rows,
    );
    Ok(())
}

/// MySQL/MariaDB (issue 16): the bare effect, one message per transaction and batches of 100,
/// side by side in interleaved rounds at each worker count, the effects checked exact after
/// every measurement (see `mysql.rs`).
/// Amazon DynamoDB (see `dynamodb.rs`), or why it is not measured.
async fn dynamodb_section(out: &mut Out, p: &Profile, args: &Args) -> Result<(), BoxError> {
    let endpoint = args.dynamodb_endpoint.as_deref().filter(|e| !e.is_empty());
    #[cfg(feature = "dynamodb")]
    if let Some(endpoint) = endpoint {
        return dynamodb::section(out, p.name, endpoint).await;
    }
    let _ = p;
    out.line("## Amazon DynamoDB");
    out.line("");
    out.line(if cfg!(feature = "dynamodb") || endpoint.is_some() {
        "Not measured: no `--dynamodb-endpoint` / `DYNAMODB_ENDPOINT` given \
         (`scripts/bench.sh --only dynamodb` starts a throwaway moto)."
    } else {
        "Not measured: the harness was built without the examples feature `dynamodb` \
         (`scripts/bench.sh --only dynamodb` builds it with the feature)."
    });
    out.line("");
    Ok(())
}

async fn mysql_section(out: &mut Out, p: &Profile, args: &Args) -> Result<(), BoxError> {
    let Some(url) = args.mysql_url.as_deref().filter(|u| !u.is_empty()) else {
        out.line("## MySQL/MariaDB");
        out.line("");
        out.line(
            "Not measured: no `--mysql-url` / `MYSQL_URL` given (`scripts/bench.sh --only mysql` \
             starts a throwaway MariaDB).",
        );
        out.line("");
        return Ok(());
    };
    progress(format!("mysql: creating database {}", args.db_name));
    let my = mysql::connect(url, &args.db_name).await?;
    let (version, settings) = mysql::describe(&my).await?;
    let mut rows = Vec::new();
    for &workers in &p.workers {
        let mut acc: HashMap<mysql::Path, Acc> = HashMap::new();
        let mut mismatches: HashMap<mysql::Path, Vec<String>> = HashMap::new();
        for round in 0..p.rounds {
            let mut order = mysql::PATHS.to_vec();
            order.rotate_left(round % mysql::PATHS.len());
            for path in order {
                progress(format!(
                    "mysql, {workers} workers, round {}/{}: {}",
                    round + 1,
                    p.rounds,
                    path.label()
                ));
                let m = mysql::measure(&my, path, workers, p.warmup, p.duration, &seed).await?;
                if let Err(e) = m.exact {
                    mismatches.entry(path).or_default().push(e);
                }
                acc.entry(path).or_default().add(Measured {
                    sample: m.sample,
                    wal: None,
                    claim: None,
                });
                tokio::time::sleep(p.settle).await;
            }
        }
        let bare = acc.get(&mysql::Path::Bare).map(Acc::rate);
        let single = acc.get(&mysql::Path::DispatchOn).map(Acc::rate);
        for path in mysql::PATHS {
            let Some(a) = acc.get(&path) else { continue };
            rows.push(vec![
                with_errors(path.label(), a),
                workers.to_string(),
                format!("{:.0}", a.rate()),
                ms(&a.hist, 0.5),
                ms(&a.hist, 0.99),
                ratio(a.rate(), bare),
                ratio(a.rate(), single),
                a.per_msg_us(a.cpu.client),
                a.cpu.server.map_or("—".into(), |s| a.per_msg_us(s)),
                if a.cpu.wall > 0.0 {
                    format!("{:.2}", a.cpu.machine / a.cpu.wall)
                } else {
                    "—".into()
                },
                match mismatches.get(&path) {
                    None => "exact".into(),
                    Some(e) => format!("**MISMATCH** ({} of {}: {})", e.len(), p.rounds, e[0]),
                },
                a.spread(),
            ]);
        }
    }
    my.admin.close().await;
    if args.drop_db {
        mysql::drop_database(url, &args.db_name).await?;
    }
    out.line(format!("## MySQL/MariaDB: {version}"));
    out.line("");
    out.line(format!("Settings: {settings}"));
    out.line("");
    out.line(
        "The same effect (`INSERT … ON DUPLICATE KEY UPDATE balance_cents = balance_cents + \
         VALUES(balance_cents)` over 100,000 accounts, InnoDB) and the same handler \
         (`#[idempotent(consumer = \"bench\")]` on a `MySqlConnection`), each worker with its \
         own connection and its own share of the accounts. `× bare`: rate ÷ the bare effect \
         (autocommit) at the same worker count; `× dispatch_on`: ÷ `Dispatcher::dispatch_on` \
         (one message per transaction, as the Worker runs it); rows measured side by side in \
         interleaved rounds, median rate. Latency is per operation (message, or batch). Server \
         CPU: the server process's threads (/proc), when it runs here. `effects`: after every \
         measurement the balances grew by exactly the amounts the paths reported credited and \
         the inbox by exactly one row per message (`exact`).",
    );
    out.line("");
    out.table(
        &[
            "path",
            "workers",
            "msgs/s",
            "p50 ms",
            "p99 ms",
            "× bare",
            "× dispatch_on",
            "client CPU µs/msg",
            "server CPU µs/msg",
            "CPU busy (cores)",
            "effects",
            "rounds min–max msgs/s",
        ],
        &rows,
    );
    Ok(())
}

/// The rows of the outbox section's publish-cost tables.
const OUTBOX_KINDS: [Kind; 3] = [Kind::Direct, Kind::DirectOutbox, Kind::DirectOutboxQuiet];

/// The transactional outbox: what one publish costs a handler (PostgreSQL, SQLite), and how fast
/// relays drain a backlog into each broker of the run against that broker's own publish rate.
async fn outbox_section(out: &mut Out, pg: &mut Pg, p: &Profile) -> Result<(), BoxError> {
    inbox_runtime::migrate_components(&pg.admin, &[inbox_runtime::Component::Outbox]).await?;
    outbox_publish_cost(out, pg, p).await?;
    outbox_sqlite(out, p).await?;
    outbox_relays(out, pg, p).await
}

/// Empties the outbox between runs.
const OUTBOX_CLEAR: &str = "TRUNCATE inbox_outbox";

/// The outbox publish's cost on PostgreSQL: round trips, then the handler with and without it.
async fn outbox_publish_cost(out: &mut Out, pg: &mut Pg, p: &Profile) -> Result<(), BoxError> {
    let clear = OUTBOX_CLEAR;
    progress("outbox: counting round trips");
    scale::truncate(&pg.admin).await?;
    sqlx::query(clear).execute(&pg.admin).await?;
    let (proxy, popts) = start_proxy(pg).await?;
    let mut rt_rows = Vec::new();
    for kind in OUTBOX_KINDS {
        rt_rows.push(count_round_trips(pg, &proxy, &popts, kind, p.rt_messages, None).await?);
    }
    drop(proxy);

    let mut rows = Vec::new();
    for &workers in &p.workers {
        scale::truncate(&pg.admin).await?;
        sqlx::query(clear).execute(&pg.admin).await?;
        scale::settle(&pg.admin).await;
        let acc = rounds(pg, &OUTBOX_KINDS, workers, p, None).await?;
        let bare = pg.rates.get(&(Kind::Bare, workers)).copied();
        let without = acc.get(&Kind::Direct).map(Acc::rate);
        for kind in OUTBOX_KINDS {
            if let Some(a) = acc.get(&kind) {
                rows.push(row(pg, kind, workers, a, bare, without));
            }
        }
    }
    sqlx::query(clear).execute(&pg.admin).await?;
    out.line("## Outbox: the cost of one publish inside a handler (PostgreSQL)");
    out.line("");
    out.line(format!(
        "The same `#[idempotent]` handler (one upsert of the account) without and with one \
         `Outbox::publish` of a ~90-byte event (aggregate: the account) in its transaction, \
         called directly on a held connection. Round trips counted on the wire as above \
         ({} messages per path):",
        p.rt_messages
    ));
    out.line("");
    out.table(
        &[
            "path",
            "round trips/msg",
            "statements/msg",
            "parses/msg",
            "sequence",
        ],
        &rt_rows,
    );
    out.line(
        "`× without publish`: rate ÷ the handler without the publish at the same worker count, \
         measured side by side (rounds interleaved). `× bare`: ÷ the main table's bare effect \
         (— when that section did not run).",
    );
    out.line("");
    let mut header = HEADER;
    header[6] = "× without publish";
    out.table(&header, &rows);
    Ok(())
}

/// Relays draining the outbox into each broker configured, against the broker's raw rate.
async fn outbox_relays(out: &mut Out, pg: &mut Pg, p: &Profile) -> Result<(), BoxError> {
    let clear = OUTBOX_CLEAR;
    let brokers = outbox::Broker::from_env();
    let mut rows = Vec::new();
    for broker in &brokers {
        for &relays in &p.relays {
            progress(format!(
                "outbox: {relays} relay(s) draining {} rows into {}",
                p.outbox_rows,
                broker.label()
            ));
            let fill = outbox::fill(&pg.admin, p.outbox_rows).await?;
            progress(format!("outbox: filled in {:.1} s", fill.as_secs_f64()));
            let relay =
                outbox::relay(&pg.opts, &pg.admin, &pg.cpu, broker, relays, p.outbox_rows).await?;
            let sample = relay
                .sample
                .clone()
                .ok_or("the relay published no message")?;
            progress(format!(
                "outbox: {relays} raw publisher(s), {} messages into {}",
                p.outbox_rows,
                broker.label()
            ));
            let raw = outbox::raw(&pg.cpu, broker, relays, p.outbox_rows, 100, &sample).await?;
            sqlx::query(clear).execute(&pg.admin).await?;
            for (what, run, reference) in [
                (format!("{relays} relay(s)"), &relay, Some(raw.rate())),
                (
                    format!("raw: {relays} publisher(s), no database"),
                    &raw,
                    None,
                ),
            ] {
                rows.push(relay_row(broker, what, run, reference));
            }
        }
    }
    out.line("## Outbox: relay throughput against the broker's own publish rate");
    out.line("");
    out.line(format!(
        "Each run starts from {rows} pending rows (one transaction, ~90-byte JSON payloads, \
         {agg} aggregates in turn, then `ANALYZE` and `CHECKPOINT`) and an empty destination \
         (`{EVENTS}`: a durable RabbitMQ queue with persistent messages; a file-backed \
         JetStream stream). `relay(s)`: that many `Relay`s with the default settings (batches \
         of 100), each with its own database connection and its own sink connection, running \
         rounds (`Relay::run_once`: lease, publish, mark) back to back until every row is sent; \
         rows/s over the whole drain. `raw`: the broker's ceiling in the same run — as many \
         tasks, each with its own sink of the same kind, publishing the same number of copies \
         of a message the relay sent (fresh message ids) in batches of 100 through \
         `Sink::publish_batch`, same client, same confirms, no database. `× raw`: relay rate ÷ \
         raw rate at the same concurrency. Latency per row: `round` from the start of the \
         relay's lease statement to its `mark sent` committed (what a row waits once a relay \
         picks it); `publish` the sink call that carried it, first publish to last confirm. \
         CPU per row over the run: this process (relays or publishers), the PostgreSQL \
         cluster, and the rest of the machine (the broker, mostly). After each run the broker \
         holds exactly the rows (checked), and every row is marked sent.",
        rows = p.outbox_rows,
        agg = (p.outbox_rows / 5).max(1_000),
        EVENTS = paths::EVENTS,
    ));
    out.line("");
    if brokers.is_empty() {
        out.line("Relay rows: not measured (neither `AMQP_URL` nor `NATS_URL` is set).");
        out.line("");
    } else {
        out.table(
            &[
                "broker",
                "run",
                "rows",
                "seconds",
                "rows/s",
                "× raw",
                "round p50 ms",
                "round p99 ms",
                "publish p50 ms",
                "publish p99 ms",
                "rows per round",
                "client CPU µs/row",
                "server CPU µs/row",
                "broker and rest CPU µs/row",
                "CPU busy (cores)",
            ],
            &rows,
        );
    }
    Ok(())
}

/// One row of the relay table: `what` ran (`reference`: the raw rate to compare with, if any).
fn relay_row(
    broker: &outbox::Broker,
    what: String,
    run: &outbox::Run,
    reference: Option<f64>,
) -> Vec<String> {
    let per_row = |seconds: f64| format!("{:.0}", seconds * 1e6 / run.rows as f64);
    let rest = run.cpu.machine - run.cpu.client - run.cpu.server.unwrap_or(0.0);
    vec![
        broker.label().into(),
        what,
        run.rows.to_string(),
        format!("{:.2}", run.elapsed.as_secs_f64()),
        format!("{:.0}", run.rate()),
        ratio(run.rate(), reference),
        run.round.as_ref().map_or("—".into(), |h| ms(h, 0.5)),
        run.round.as_ref().map_or("—".into(), |h| ms(h, 0.99)),
        ms(&run.sink, 0.5),
        ms(&run.sink, 0.99),
        format!("{:.1}", run.rows as f64 / run.batches.max(1) as f64),
        per_row(run.cpu.client),
        run.cpu.server.map_or("—".into(), per_row),
        per_row(rest.max(0.0)),
        if run.cpu.wall > 0.0 {
            format!("{:.2}", run.cpu.machine / run.cpu.wall)
        } else {
            "—".into()
        },
    ]
}

/// The outbox publish's cost on SQLite: the handler with and without it, side by side.
async fn outbox_sqlite(out: &mut Out, p: &Profile) -> Result<(), BoxError> {
    let (dir, opts, setup) = sqlite_bench_db("outbox").await?;
    inbox_runtime::migrate_components(&setup, &[inbox_runtime::Component::Outbox]).await?;
    setup.close().await;
    let kinds = [Kind::Direct, Kind::DirectOutbox];
    let dups = Arc::new(DupSet::new(1, seed()));
    let cpu = CpuProbe::default();
    let mut rows = Vec::new();
    for &workers in &p.sqlite_workers {
        let acc = sqlite_rounds(&opts, &kinds, workers, p, &dups, &cpu, "outbox, SQLite").await?;
        let without = acc.get(&Kind::Direct).map(Acc::rate);
        for kind in kinds {
            let Some(a) = acc.get(&kind) else { continue };
            let label = kind.label().replace(" (NOTIFY on, the default)", "");
            rows.push(vec![
                with_errors(label, a),
                workers.to_string(),
                format!("{:.0}", a.rate()),
                ms(&a.hist, 0.5),
                ms(&a.hist, 0.99),
                ratio(a.rate(), without),
                a.per_msg_us(a.cpu.client),
            ]);
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
    out.line("## Outbox: the cost of one publish inside a handler (SQLite)");
    out.line("");
    out.line(
        "The same two handlers on SQLite (WAL, synchronous=FULL; no notifications there): one \
         more statement in the same write transaction, no network round trip.",
    );
    out.line("");
    out.table(
        &[
            "path",
            "workers",
            "msgs/s",
            "p50 ms",
            "p99 ms",
            "× without publish",
            "client CPU µs/msg (incl. SQLite)",
        ],
        &rows,
    );
    Ok(())
}

/// Concurrent batches over hot rows: several batches in flight vs one, side by side per round
/// (and, with `--contention-aggregate`, the same with the aggregate declared).
async fn contention_section(
    out: &mut Out,
    pg: &mut Pg,
    p: &Profile,
    args: &Args,
) -> Result<(), BoxError> {
    use contention::{ACCOUNTS, DELIVERIES, REDELIVERIES};
    let (deliveries, redeliveries, limit) = match p.name {
        "smoke" => (2_000, 200, Duration::from_secs(30)),
        _ => (DELIVERIES, REDELIVERIES, Duration::from_secs(60)),
    };
    let rounds = p.rounds.max(3);
    contention::setup(&pg.admin).await?;
    let workload = contention::Workload::new(0xC0_17E4_7104, deliveries, redeliveries, ACCOUNTS);
    let declare = contention::declare_aggregate(|m: &contention::Contended| m.account);
    let mut rows: Vec<contention::Row> = [(4, false), (1, false)]
        .into_iter()
        .chain(
            args.contention_aggregate
                .then_some([(4, true), (1, true)])
                .into_iter()
                .flatten(),
        )
        .map(|(batches, declared)| contention::Row::new(batches, declared))
        .collect();
    for round in 0..rounds {
        for row in &mut rows {
            let configure = match (row.declared, &declare) {
                (false, _) => None,
                (true, Ok(declare)) => Some(declare),
                (true, Err(_)) => continue,
            };
            progress(format!(
                "contention: round {}/{rounds}, {} batch(es) in flight{}",
                round + 1,
                row.batches,
                if row.declared {
                    ", aggregate declared"
                } else {
                    ""
                }
            ));
            let batches = row.batches;
            let run = contention::run(&pg.admin, &pg.opts, &workload, 16, limit, |w| {
                let w = contention::configure(w, batches);
                match configure {
                    Some(declare) => declare(w),
                    None => w,
                }
            })
            .await?;
            if run.finished {
                row.rates.push(deliveries as f64 / run.seconds);
            } else {
                row.unfinished.push(format!(
                    "{} of {} keys after {:.0} s",
                    run.applied,
                    deliveries - redeliveries,
                    run.seconds
                ));
            }
            row.deadlocks.push(run.deadlocks);
            row.fallbacks.push(contention::fallbacks(&run.report));
            row.exact &= run.exact;
        }
    }
    let skipped = declare.as_ref().err();
    write_contention(
        out,
        &rows,
        skipped.map(String::as_str),
        (deliveries, redeliveries),
        rounds,
        limit,
    );
    Ok(())
}

/// The contention section's table, and the declared rows' target (issue 33).
fn write_contention(
    out: &mut Out,
    rows: &[contention::Row],
    skipped: Option<&str>,
    (deliveries, redeliveries): (usize, usize),
    rounds: usize,
    limit: Duration,
) {
    use contention::{ACCOUNTS, BATCH};
    let rate = |row: &contention::Row| (!row.rates.is_empty()).then(|| median(&row.rates));
    let one = |declared: bool| {
        rows.iter()
            .find(|r| r.batches == 1 && r.declared == declared)
            .and_then(rate)
    };
    let table: Vec<Vec<String>> = rows
        .iter()
        .map(|row| {
            let declared = if row.declared { "yes" } else { "no" }.to_owned();
            if let (true, Some(why)) = (row.declared, skipped) {
                let mut cells = vec![row.batches.to_string(), declared, format!("skipped: {why}")];
                cells.resize(8, "—".into());
                return cells;
            }
            let r = rate(row);
            vec![
                row.batches.to_string(),
                declared,
                r.map_or("—".into(), |r| format!("{r:.0}")),
                r.map_or("—".into(), |r| ratio(r, one(row.declared))),
                format!("{:?}", row.deadlocks),
                format!("{:?}", row.fallbacks),
                if row.exact { "yes" } else { "no" }.into(),
                if row.unfinished.is_empty() {
                    "—".into()
                } else {
                    row.unfinished.join("; ")
                },
            ]
        })
        .collect();
    out.line("## Contention: concurrent batches over hot rows (PostgreSQL, `Worker::batch`)");
    out.line("");
    out.line(format!(
        "{deliveries} deliveries ({redeliveries} of them redeliveries, seeded) over {ACCOUNTS} \
         accounts; each effect is `UPDATE contention_accounts SET balance = balance + $1 WHERE \
         id = $2`, so a batch locks its accounts in message order and concurrent batches lock \
         shared accounts in different orders. The Worker runs batches of {BATCH} (5 ms max \
         wait) with 4 batches in flight and with 1, side by side in each of {rounds} rounds \
         (fresh inbox, zeroed balances; 16 pooled connections; a run is stopped after {} s). \
         `aggregate declared`: the Worker knows each delivery's account (partitioned batches: \
         no two batches in flight share an account; `--contention-aggregate`). \
         Rate: median deliveries/s of finished runs; `× one`: ÷ one batch in flight with the \
         same declaration; deadlocks: the `pg_stat_database.deadlocks` delta per round; \
         fallbacks: the Worker report's contention fallbacks per round (batches that lost a \
         deadlock, a serialization failure or a lock wait and ran again alone); exact: every \
         balance equals the sum of its distinct events in every finished round.",
        limit.as_secs()
    ));
    out.line("");
    out.table(
        &[
            "batches in flight",
            "aggregate declared",
            "deliveries/s",
            "× one",
            "deadlocks",
            "fallbacks",
            "exact",
            "unfinished",
        ],
        &table,
    );
    if let Some(four) = rows.iter().find(|r| r.batches == 4 && r.declared) {
        let met = rate(four)
            .zip(one(true))
            .map(|(four_rate, one_rate)| four_rate / one_rate);
        let deadlocks: i64 = four.deadlocks.iter().sum();
        out.line(format!(
            "Target (issue 33): with the aggregate declared, 4 batches in flight ≥ 1.8× one, 0 \
             deadlocks: {}",
            match met {
                Some(x) if x >= 1.8 && deadlocks == 0 && four.exact =>
                    format!("{x:.2}×, 0 deadlocks: met"),
                Some(x) => format!("{x:.2}×, {deadlocks} deadlock(s): **not met**"),
                None => "not measured".into(),
            }
        ));
        out.line("");
    }
}

/// `bench --kafka-consumer BROKERS`: one consumer process of the Kafka section.
#[cfg(feature = "kafka")]
async fn kafka_consumer(args: &Args, brokers: &str) -> Result<(), BoxError> {
    let url = args
        .database_url
        .as_deref()
        .ok_or("--kafka-consumer needs --database-url")?;
    kafka::consumer_main(
        brokers,
        url,
        &args.db_name,
        &args.kafka_group,
        args.kafka_concurrency,
    )
    .await
}

/// `bench --kafka-consumer BROKERS` in a build without the examples feature `kafka`.
#[cfg(not(feature = "kafka"))]
async fn kafka_consumer(_: &Args, brokers: &str) -> Result<(), BoxError> {
    Err(format!("--kafka-consumer {brokers}: built without the examples feature `kafka`").into())
}

/// Kafka scale-out: consumer processes in one group (see `kafka.rs`).
#[cfg(not(feature = "kafka"))]
async fn kafka_section(out: &mut Out, _: &mut Pg, _: &Profile, _: &Args) -> Result<(), BoxError> {
    out.line("## Kafka scale-out (PostgreSQL)");
    out.line("");
    out.line(
        "Not measured: the harness was built without the examples feature `kafka` \
         (`scripts/bench.sh --only kafka` builds it with the feature).",
    );
    out.line("");
    Ok(())
}

/// Kafka scale-out: consumer processes in one group (see `kafka.rs`).
#[cfg(feature = "kafka")]
async fn kafka_section(
    out: &mut Out,
    pg: &mut Pg,
    p: &Profile,
    args: &Args,
) -> Result<(), BoxError> {
    let records: u64 = match p.name {
        "smoke" => 400,
        "quick" => 6_000,
        "full" => 60_000,
        _ => 10_000,
    };
    let concurrency = args.kafka_concurrency.max(1);
    let processes = args
        .kafka_processes
        .clone()
        .unwrap_or_else(|| vec![1, 2, 4]);
    let url = args
        .database_url
        .as_deref()
        .ok_or("the Kafka section needs --database-url")?;
    progress(format!(
        "kafka: mock cluster, {records} records into {} partitions",
        kafka::PARTITIONS
    ));
    let cluster = kafka::prepare(&pg.admin, url, &args.db_name, records).await?;
    // The runs: each process count at `concurrency` per process; then one process with as
    // many deliveries in flight as the most processes have together (scale up, not out).
    let mut plan: Vec<(usize, usize)> =
        processes.iter().map(|&n| (n.max(1), concurrency)).collect();
    let widest = processes.iter().copied().max().unwrap_or(1);
    if widest > 1 {
        plan.push((1, concurrency * widest));
    }
    let rates = kafka_rounds(&cluster, pg, p, &plan).await?;
    scale::truncate(&pg.admin).await?;
    let rows = kafka_rows(&rates, &plan, concurrency);
    write_kafka(out, p, records, &rows);
    Ok(())
}

/// Runs of the Kafka section, one `(processes, concurrency)` run per round, in `plan` order:
/// the runs per plan entry.
#[cfg(feature = "kafka")]
async fn kafka_rounds(
    cluster: &kafka::Cluster,
    pg: &Pg,
    p: &Profile,
    plan: &[(usize, usize)],
) -> Result<std::collections::BTreeMap<(usize, usize), Vec<kafka::Run>>, BoxError> {
    let mut rates: std::collections::BTreeMap<(usize, usize), Vec<kafka::Run>> =
        std::collections::BTreeMap::new();
    let mut group = 0;
    for round in 0..p.rounds {
        for &(n, c) in plan {
            group += 1;
            progress(format!(
                "kafka: round {}/{}: {n} process(es) × concurrency {c}",
                round + 1,
                p.rounds
            ));
            let run =
                kafka::run(cluster, &pg.admin, &pg.cpu, &format!("bench-{group}"), n, c).await?;
            if run.processed != run.records {
                return Err(format!(
                    "kafka: {} processed over {n} processes, {} records",
                    run.processed, run.records
                )
                .into());
            }
            rates.entry((n, c)).or_default().push(run);
        }
    }
    Ok(rates)
}

/// The Kafka table's rows: the median run of each plan entry, against one process at
/// `concurrency`.
#[cfg(feature = "kafka")]
fn kafka_rows(
    rates: &std::collections::BTreeMap<(usize, usize), Vec<kafka::Run>>,
    plan: &[(usize, usize)],
    concurrency: usize,
) -> Vec<Vec<String>> {
    let median_run = |runs: &[kafka::Run]| -> usize {
        let mut order: Vec<usize> = (0..runs.len()).collect();
        order.sort_by(|&a, &b| runs[a].rate().total_cmp(&runs[b].rate()));
        order[order.len() / 2]
    };
    let base = rates
        .get(&(1, concurrency))
        .map(|runs| runs[median_run(runs)].rate());
    let mut rows = Vec::new();
    for &(n, c) in plan {
        let Some(runs) = rates.get(&(n, c)) else {
            continue;
        };
        let run = &runs[median_run(runs)];
        let wall = run.cpu.wall.max(1e-9);
        rows.push(vec![
            n.to_string(),
            c.to_string(),
            (n * c).to_string(),
            format!("{}", kafka::PARTITIONS as usize / n),
            run.records.to_string(),
            format!("{:.2}", run.elapsed.as_secs_f64()),
            format!("{:.0}", run.rate()),
            ratio(run.rate(), base),
            format!("{} / {}", run.processed, run.duplicates),
            format!("{:.1}", run.join.as_secs_f64()),
            opt(run.cpu.server.map(|s| s / wall), 2),
            format!("{:.2}", run.cpu.client / wall),
            format!("{:.2}", run.cpu.machine / wall),
        ]);
    }
    rows
}

/// The Kafka section's text and table (`records` per run).
#[cfg(feature = "kafka")]
fn write_kafka(out: &mut Out, p: &Profile, records: u64, rows: &[Vec<String>]) {
    out.line("## Kafka scale-out (PostgreSQL)");
    out.line("");
    out.line(format!(
        "Consumer processes (this harness, `--kafka-consumer`) in one consumer group over a \
         {}-partition topic of librdkafka's mock cluster, which runs in the harness's process; \
         each a `KafkaSource` + `Worker`, positions in the database in each effect's \
         transaction, one PostgreSQL. {records} records (`bench.credit`, UUIDv7 keys) timed \
         from `go` (the group has spread the partitions evenly) to the last one processed, \
         median of {} round(s); `× 1 process` ÷ one process at the same concurrency. CPU \
         columns are cores busy during the window: PostgreSQL, the harness (mock cluster and \
         the row count it polls), the whole machine.",
        kafka::PARTITIONS,
        p.rounds
    ));
    out.line("");
    out.table(
        &[
            "processes",
            "concurrency each",
            "in flight",
            "partitions each",
            "records",
            "seconds",
            "deliveries/s",
            "× 1 process",
            "processed / duplicates",
            "join s",
            "PostgreSQL cores",
            "harness cores",
            "machine cores",
        ],
        rows,
    );
    out.line("");
}

/// The issue's targets against this run's figures.
fn targets(out: &mut Out, pg: &Pg, p: &Profile) {
    let mut lines = Vec::new();
    for &w in &p.workers {
        let get = |k: Kind| pg.rates.get(&(k, w)).copied();
        for (kind, name) in [
            (Kind::Direct, "`#[idempotent]` direct"),
            (Kind::DispatchOn, "`Dispatcher::dispatch_on`"),
        ] {
            if let (Some(rate), Some(bench), Some(bare)) =
                (get(kind), get(Kind::Pgb(Script::Runtime)), get(Kind::Bare))
            {
                let (a, b) = (rate / bench, rate / bare);
                lines.push(format!(
                    "- {w} workers: {name} = {a:.2}× pgbench (target ≥ 0.90: {}), \
                     {b:.2}× bare (target ≥ 0.75: {})",
                    if a >= 0.9 { "met" } else { "**not met**" },
                    if b >= 0.75 { "met" } else { "**not met**" },
                ));
            }
        }
        if let (Some(best), Some(bare)) = (
            pg.rates.get(&(Kind::Pgb(Script::InboxOneTrip), w)).copied(),
            pg.rates.get(&(Kind::Bare, w)).copied(),
        ) {
            lines.push(format!(
                "  - for scale: pgbench's whole claimed transaction in one round trip = {:.2}× bare",
                best / bare
            ));
        }
    }
    for kind in [Kind::DupDirect, Kind::DupDispatch] {
        if let Some(rt) = pg.rt.get(&kind) {
            lines.push(format!(
                "- {}: {rt:.2} round trips (target ≤ 3: {})",
                kind.label(),
                if *rt <= 3.0 + 1e-9 {
                    "met"
                } else {
                    "**not met**"
                }
            ));
        }
    }
    if let Some(rt) = pg.rt.get(&Kind::DupRedelivered) {
        lines.push(format!(
            "- {}: {rt:.2} round trips, one statement (target ≤ 1: {})",
            Kind::DupRedelivered.label(),
            if *rt <= 1.0 + 1e-9 {
                "met"
            } else {
                "**not met**"
            }
        ));
    }
    let mut batch = false;
    for &w in &p.batch_workers {
        let get = |k: Kind| pg.rates.get(&(k, w)).copied();
        if let (Some(b), Some(single)) = (get(Kind::Batch(100)), get(Kind::DispatchOn)) {
            batch = true;
            lines.push(format!(
                "- {w} workers: batches of 100 = {:.2}× `Dispatcher::dispatch_on` (target ≥ 10: {})",
                b / single,
                if b / single >= 10.0 {
                    "met"
                } else {
                    "**not met**"
                }
            ));
        }
    }
    if !batch {
        lines.push("- batches of 100 ≥ 10× one message per transaction: not measured".into());
    }
    out.line("## Targets (issue 6)");
    out.line("");
    for line in lines {
        out.line(line);
    }
    out.line("");
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The harness runs end to end and prints every row: SQLite always, PostgreSQL (with
    /// pgbench) when DATABASE_URL is set, as `scripts/test.sh` does, and the outbox relays
    /// on the brokers of AMQP_URL and NATS_URL when they are set (`scripts/test.sh` sets both).
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn smoke_prints_every_row() {
        let mut argv = vec![
            "bench",
            "--smoke",
            "--db-name",
            "inbox_bench_smoke",
            "--drop-db",
        ];
        let url = std::env::var("DATABASE_URL").ok();
        let mysql_url = std::env::var("MYSQL_URL").ok().filter(|u| !u.is_empty());
        if url.is_none() {
            argv.push(if mysql_url.is_some() {
                "--only=sqlite,mysql"
            } else {
                "--only=sqlite"
            });
        }
        let args = Args::parse_from(argv);
        let text = run(&args).await.expect("the harness runs");
        let mut expected: Vec<String> = vec![
            "## SQLite".into(),
            Kind::Bare.label(),
            Kind::Direct.label(),
            Kind::DupDispatch.label(),
        ];
        if url.is_some() {
            for kind in MAIN_KINDS.iter().chain(&DUP_KINDS) {
                expected.push(kind.label());
            }
            for size in BATCH_SIZES {
                expected.push(Kind::Batch(size).label());
            }
            for heading in [
                "## Round trips",
                "## One message per transaction",
                "## A stream of 100 % duplicates",
                "## Batch claims",
                "## Client CPU",
                "## Scale",
                "UUIDv7 (time-ordered)",
                "UUIDv4 (random)",
                "## Worker memory",
                "## Retention purge",
                "## Outbox: the cost of one publish inside a handler (PostgreSQL)",
                "## Outbox: the cost of one publish inside a handler (SQLite)",
                "## Outbox: relay throughput",
                "## Targets",
            ] {
                expected.push(heading.into());
            }
            for kind in OUTBOX_KINDS {
                expected.push(kind.label());
            }
            // The relay rows, on the brokers `scripts/test.sh` starts.
            for broker in outbox::Broker::from_env() {
                expected.push(broker.label().into());
                for relays in [1, 4] {
                    expected.push(format!("| {relays} relay(s) |"));
                    expected.push(format!("| raw: {relays} publisher(s), no database |"));
                }
            }
        }
        // The peers' workload: every row, with exact effects (psycopg2's may say it is skipped).
        if url.is_some() {
            expected.push("## The peers' workload".into());
            expected.push("### Round trips per delivery on the wire".into());
            for client in wire::CLIENTS {
                expected.push(format!("| {} |", client.label()));
            }
            for row in peers::rows(&peers::CLIENTS) {
                expected.push(format!("| {} | {} |", row.label(), row.workers()));
            }
        }
        // The MySQL/MariaDB rows, on the server `scripts/test.sh` starts (MYSQL_URL).
        if mysql_url.is_some() {
            expected.push("## MySQL/MariaDB: ".into());
            for path in mysql::PATHS {
                expected.push(format!("| {} |", path.label()));
            }
        } else if url.is_some() {
            expected.push("## MySQL/MariaDB".into());
        }
        for label in &expected {
            assert!(
                text.contains(label.as_str()),
                "missing {label:?} in:\n{text}"
            );
        }
        assert!(!text.contains("errors**"), "errors in:\n{text}");
        assert!(!text.contains("MISMATCH"), "effects not exact in:\n{text}");
        assert!(!text.contains("**FAILED**"), "a row failed in:\n{text}");
    }
}
