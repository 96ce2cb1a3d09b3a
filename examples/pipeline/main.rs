//! # The pipeline demo: two services, effectively once end to end
//!
//! ```text
//! cargo run --example pipeline                                  # everything in one process
//! cargo run --example pipeline -- --database postgres://user@host/db --broker amqp://127.0.0.1:5672/%2f
//! cargo run --example pipeline -- --broker nats://127.0.0.1:4222
//!
//! # Each service as a process of its own (on a real broker), then the check
//! cargo run --example pipeline -- produce  --broker amqp://…   # the upstream payments
//! cargo run --example pipeline -- orders   --broker amqp://… --database postgres://…
//! cargo run --example pipeline -- relay    --broker amqp://… --database postgres://…
//! cargo run --example pipeline -- shipping --broker amqp://… --database postgres://…
//! cargo run --example pipeline -- check    --database postgres://…
//! ```
//!
//! ```text
//! payments.captured ──► orders ──► outbox ──► relay ──► orders.paid ──► shipping
//!   (upstream,          (inbox +    (same        (publishes    (broker)        (inbox +
//!    redeliveries)       order row)  transaction)  committed rows)               shipments)
//! ```
//!
//! * **orders** consumes `payments.captured` (a generated stream with redeliveries, the same for
//!   a seed) with an `#[idempotent(consumer = "orders")]` handler: it adds the payment to the
//!   order's row, counts the customer's paid events, and publishes `orders.paid` through the
//!   transactional outbox — in the same transaction as the inbox claim. A redelivered payment
//!   is a duplicate: nothing applied, nothing published.
//! * **relay** publishes the committed outbox rows to the broker and marks them sent; a row is
//!   published again after a crash with the same message id.
//! * **shipping** consumes `orders.paid` with its own inbox (`consumer = "shipping"`, key: the
//!   payment id) and keeps a shipment row per order and a total per customer. Each `orders.paid`
//!   carries its customer (the aggregate) and the customer's sequence; with `gaps = "park"` an
//!   event that arrives before its predecessor waits for it, so that a customer's events apply
//!   in order.
//!
//! **Brokers**: `--broker amqp://…` (RabbitMQ: durable queues `pipeline.payments` and
//! `pipeline.orders`, persistent messages, publisher confirms), `--broker nats://…` (JetStream:
//! streams `PIPELINE_PAYMENTS` and `PIPELINE_ORDERS`, durable consumers `orders` and
//! `shipping`), or none: in-memory queues in this process stand in for the broker.
//!
//! **Database**: `--database` or `DATABASE_URL` (`postgres://…` or `sqlite:…`), else the SQLite
//! file `pipeline.db` in the current directory. Both services keep their tables there (with
//! their own inbox consumers); the demo creates them. The broker's queues belong with the
//! database: on a fresh database the one-process run empties them first (JetStream would
//! otherwise drop this run's messages as re-publishes of an earlier run's).
//!
//! **The check**: at the end the database is compared with the stream's ground truth: every
//! order paid and shipped with exactly its payments (none missing, none doubled), every
//! customer's events counted once, applied in sequence (`out_of_order` = 0) and totalled
//! exactly, every outbox row sent (none pending or dead), one processed inbox row per payment
//! for each consumer. The differences go to stderr. The last line of stdout is
//!
//! ```text
//! summary: payments=N orders_applied=N orders_duplicates=N relayed=N shipping_applied=N shipping_duplicates=N effects=ok|MISMATCH
//! ```
//!
//! counting this run: deliveries of `payments.captured`, payments applied and duplicates seen by
//! orders, outbox rows published, payments applied and duplicates seen by shipping. A second run
//! on the same database applies nothing new (`orders_applied=0 relayed=0 shipping_applied=0`)
//! and the check still holds. Exit status: 0 when the check passed, 1 on a mismatch, 2 on bad
//! usage or an unusable database or broker.
//!
//! **Services as processes** (for the crash test, or to watch them): `produce` publishes the
//! stream to the broker; `orders`, `relay` and `shipping` each run one service until SIGINT or
//! SIGTERM (or `--idle-exit`), reconnecting to the broker when it goes away, and print their
//! counts when they stop; `check` prints the summary line from the database (its counts are
//! then totals over every run). `--trace-deliveries` prints a line per delivery
//! (`delivery: <source> id=<message id> redelivered=<bool>`). Give every command the same
//! `--payments` and `--seed`.

mod broker;
mod check;
mod db;
mod handlers;
mod messages;
mod stream;

use std::process::ExitCode;
use std::sync::Arc;
use std::time::{Duration, Instant};

use clap::Parser;
use inbox_runtime::outbox::{Relay, RelayReport};
use inbox_runtime::sink::Sink;
use inbox_runtime::source::Source;
use inbox_runtime::source::memory::MemorySource;
use inbox_runtime::{
    CancellationToken, Dispatcher, Envelope, Message as _, StopReason, Worker, WorkerReport,
    store::OutboxDatabase,
};

use crate::broker::{Broker, ConsumeOptions, PAYMENTS_QUEUE, StandIn, Traced};
use crate::db::{Db, Progress};
use crate::handlers::ORDERS_DESTINATION;
use crate::messages::PaymentCaptured;
use crate::stream::Stream;

#[derive(Parser, Debug)]
#[command(
    name = "pipeline",
    about = "Two services joined by a transactional outbox and a broker: payments.captured → \
             orders → outbox → relay → orders.paid → shipping, checked end to end"
)]
struct Args {
    #[command(subcommand)]
    command: Option<Command>,
    #[command(flatten)]
    common: Common,
}

/// What every mode shares.
#[derive(clap::Args, Debug, Clone)]
struct Common {
    /// Database: postgres://… or sqlite:… [default: sqlite file ./pipeline.db]
    #[arg(
        long,
        env = "DATABASE_URL",
        value_name = "URL",
        hide_env_values = true,
        global = true
    )]
    database: Option<String>,
    /// Broker between the services: amqp://… (RabbitMQ) or nats://… (NATS JetStream)
    /// [default: in-memory queues in this process]
    #[arg(long, value_name = "URL", global = true)]
    broker: Option<String>,
    /// Distinct captured payments in the generated upstream stream
    #[arg(long, default_value_t = 2000, global = true)]
    payments: usize,
    /// Seed of the generated stream
    #[arg(long, default_value_t = 7, global = true)]
    seed: u64,
    /// Deliveries each consumer processes at once [default: 8 on PostgreSQL, 2 on SQLite]
    #[arg(long, global = true)]
    concurrency: Option<u16>,
    /// NATS: redeliver a delivery neither acked nor nacked after this many seconds (consumers
    /// created by this run)
    #[arg(
        long,
        value_name = "SECONDS",
        default_value_t = 5.0,
        global = true,
        value_parser = seconds
    )]
    ack_wait: f64,
}

#[derive(clap::Subcommand, Debug)]
enum Command {
    /// Publishes the generated payments.captured stream to the broker
    Produce,
    /// Runs the orders service until SIGINT or SIGTERM
    Orders(ServiceArgs),
    /// Runs the outbox relay until SIGINT or SIGTERM
    Relay(RelayArgs),
    /// Runs the shipping service until SIGINT or SIGTERM
    Shipping(ServiceArgs),
    /// Checks every effect in the database against the generated stream; prints the summary
    Check,
}

#[derive(clap::Args, Debug)]
struct ServiceArgs {
    /// Stop once nothing has arrived for this many seconds
    #[arg(long, value_name = "SECONDS", value_parser = seconds)]
    idle_exit: Option<f64>,
    /// Print a line per delivery: `delivery: <source> id=<message id> redelivered=<bool>`
    #[arg(long)]
    trace_deliveries: bool,
}

#[derive(clap::Args, Debug, Clone, Copy)]
struct RelayArgs {
    /// Stop once no outbox row has been pending for this many seconds
    #[arg(long, value_name = "SECONDS", value_parser = seconds)]
    idle_exit: Option<f64>,
    #[command(flatten)]
    tuning: RelayTuning,
}

#[derive(clap::Args, Debug, Clone, Copy)]
struct RelayTuning {
    /// How long a leased row stays with a relay before another may publish it again, in seconds
    #[arg(long, value_name = "SECONDS", default_value_t = 10.0)]
    lease: f64,
    /// Rows per relay round
    #[arg(long, default_value_t = 100)]
    batch: u32,
}

impl Default for RelayTuning {
    fn default() -> Self {
        Self {
            lease: 10.0,
            batch: 100,
        }
    }
}

/// A number of seconds from 0 to 12 hours, as the ledger demo takes them: the runtime's
/// durations cannot hold infinite, negative or astronomical seconds.
fn seconds(text: &str) -> Result<f64, String> {
    match text.trim().parse::<f64>() {
        Ok(value) if value.is_finite() && (0.0..=43_200.0).contains(&value) => Ok(value),
        Ok(_) => Err(format!(
            "`{text}` is not a number of seconds from 0 to 43200"
        )),
        Err(error) => Err(format!("`{text}` is not a number of seconds: {error}")),
    }
}

/// Whether the check passed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Verdict {
    Ok,
    Mismatch,
    /// A service that stopped: nothing to check.
    Unchecked,
}

/// The defaults that depend on the backend.
fn concurrency(common: &Common) -> u16 {
    let sqlite = common
        .database
        .as_deref()
        .is_none_or(|url| url.starts_with("sqlite:"));
    common
        .concurrency
        .unwrap_or(if sqlite { 2 } else { 8 })
        .max(1)
}

fn consume_options(common: &Common) -> ConsumeOptions {
    ConsumeOptions {
        concurrency: concurrency(common),
        ack_wait: Duration::from_secs_f64(common.ack_wait.max(0.1)),
    }
}

/// The demo's relay: `tuning`, a poll every 200 ms, and retries from 200 ms doubling to 5 s,
/// 50 attempts (about 4 minutes: a relay should outlast a broker restart). A lease that is not
/// a number of seconds, or that the relay refuses (outside 100 ms..=1 h), is an error.
fn relay<DB: OutboxDatabase>(
    pool: sqlx::Pool<DB>,
    sink: Arc<dyn Sink>,
    tuning: RelayTuning,
) -> Result<Relay<DB>, String> {
    let lease = Duration::try_from_secs_f64(tuning.lease)
        .map_err(|e| format!("--lease {}: {e}", tuning.lease))?;
    Ok(Relay::new(pool, sink)
        .batch_size(tuning.batch)
        .lease(lease)
        .map_err(|e| e.to_string())?
        .poll_interval(Duration::from_millis(200))
        .backoff(Duration::from_millis(200), Duration::from_secs(5))
        .max_attempts(50))
}

/// What the three services of one run did.
#[derive(Debug, Default)]
struct Reports {
    orders: WorkerReport,
    relay: RelayReport,
    shipping: WorkerReport,
}

/// Polls `db` every 50 ms until `done(progress)`, `shutdown`, or nothing moved for `stall`.
async fn wait_until(
    db: &Db,
    done: impl Fn(&Progress) -> bool,
    stall: Duration,
    shutdown: &CancellationToken,
) -> Result<(), String> {
    let mut last = db.progress().await?;
    let mut moved = Instant::now();
    while !done(&last) && !shutdown.is_cancelled() && moved.elapsed() < stall {
        tokio::time::sleep(Duration::from_millis(50)).await;
        let now = db.progress().await?;
        if now != last {
            moved = Instant::now();
            last = now;
        }
    }
    Ok(())
}

/// The sources and the sink of one in-process run.
struct Wiring {
    payments: Box<dyn Source>,
    orders: Box<dyn Source>,
    sink: Arc<dyn Sink>,
    /// Stop orders once idle this long (a broker's queue never "ends").
    idle: Option<Duration>,
}

/// Runs the three services in this process until each is done: orders when its source is
/// drained, the relay when nothing is pending, shipping when it has claimed every sent row (or
/// when nothing moved for a while: the check then says what is missing).
async fn run_services<DB: OutboxDatabase>(
    pool: sqlx::Pool<DB>,
    db: &Db,
    wiring: Wiring,
    concurrency: u16,
    shutdown: CancellationToken,
) -> Result<Reports, String> {
    let dispatcher = || Dispatcher::from_registry(pool.clone()).map_err(|e| e.to_string());
    let mut orders = Worker::new(dispatcher()?).concurrency(usize::from(concurrency));
    if let Some(idle) = wiring.idle {
        orders = orders.stop_when_idle(idle);
    }
    let shipping = Worker::new(dispatcher()?).concurrency(usize::from(concurrency));
    let relay = relay(pool.clone(), wiring.sink, RelayTuning::default())?;
    let (relay_stop, shipping_stop) = (shutdown.child_token(), shutdown.child_token());

    let orders = {
        let shutdown = shutdown.clone();
        tokio::spawn(async move { orders.run(wiring.payments, shutdown).await })
    };
    let relay = tokio::spawn(relay.run(relay_stop.clone()));
    let shipping = {
        let stop = shipping_stop.clone();
        tokio::spawn(async move { shipping.run(wiring.orders, stop).await })
    };
    let joined = |e: tokio::task::JoinError| format!("a service task failed: {e}");

    let orders = orders.await.map_err(joined)?.map_err(|e| e.to_string());
    // Whatever orders did, let the relay and shipping finish what was committed.
    wait_until(db, |p| p.pending == 0, Duration::from_secs(30), &shutdown).await?;
    relay_stop.cancel();
    let relay = relay.await.map_err(joined)?;
    wait_until(
        db,
        |p| p.shipping_claims >= p.sent,
        Duration::from_secs(10),
        &shutdown,
    )
    .await?;
    shipping_stop.cancel();
    let shipping = shipping.await.map_err(joined)?.map_err(|e| e.to_string())?;
    Ok(Reports {
        orders: orders?,
        relay,
        shipping,
    })
}

/// The three services' counts, one line each.
fn print_reports(reports: &Reports) {
    for (name, report) in [("orders", &reports.orders), ("shipping", &reports.shipping)] {
        println!(
            "{name}: deliveries={} processed={} duplicates={} parked={} failed={}",
            report.deliveries, report.processed, report.duplicates, report.parked, report.failed
        );
    }
    let relay = &reports.relay;
    println!(
        "relay: rounds={} published={} failed={} dead={}",
        relay.rounds, relay.published, relay.failed, relay.dead
    );
}

/// Compares the database with the stream, lists the differences on stderr, and prints the
/// check line; the verdict.
async fn check(db: &Db, stream: &Stream) -> Result<Verdict, String> {
    let state = db.state().await?;
    let mismatches = check::mismatches(stream, &state);
    if mismatches.is_empty() {
        println!(
            "check: {} orders, {} customers, {} payments ({} cents): every effect once, in order",
            stream.orders.len(),
            stream.customers.len(),
            stream.payments,
            stream.total_cents()
        );
        Ok(Verdict::Ok)
    } else {
        for line in mismatches.iter().take(20) {
            eprintln!("mismatch: {line}");
        }
        if mismatches.len() > 20 {
            eprintln!("mismatch: … and {} more", mismatches.len() - 20);
        }
        println!("check: {} mismatches (listed on stderr)", mismatches.len());
        Ok(Verdict::Mismatch)
    }
}

fn effects(verdict: Verdict) -> &'static str {
    if verdict == Verdict::Ok {
        "ok"
    } else {
        "MISMATCH"
    }
}

/// What one in-process run did: the summary line's counts and the check's verdict.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Summary {
    /// Deliveries of `payments.captured` to orders.
    payments: u64,
    /// Payments orders applied (its rows' payment counts, after − before).
    orders_applied: i64,
    /// Deliveries orders found to be duplicates.
    orders_duplicates: u64,
    /// Outbox rows sent (after − before).
    relayed: i64,
    /// Payments shipping applied (its rows' payment counts, after − before).
    shipping_applied: i64,
    /// Deliveries shipping found to be duplicates.
    shipping_duplicates: u64,
    verdict: Verdict,
}

impl std::fmt::Display for Summary {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "summary: payments={} orders_applied={} orders_duplicates={} relayed={} \
             shipping_applied={} shipping_duplicates={} effects={}",
            self.payments,
            self.orders_applied,
            self.orders_duplicates,
            self.relayed,
            self.shipping_applied,
            self.shipping_duplicates,
            effects(self.verdict)
        )
    }
}

/// `pipeline` without a subcommand: everything in this process.
async fn run_all(common: &Common, shutdown: CancellationToken) -> Result<Summary, String> {
    let broker = Broker::parse(common.broker.as_deref())?;
    let stream = Stream::generate(common.payments, common.seed);
    let concurrency = concurrency(common);
    // Two workers keeping a connection per slot, the relay (and its listener), the progress.
    let connections = 2 * (u32::from(concurrency) + 1) + 4;
    let (db, description) =
        Db::connect(common.database.as_deref(), connections, "pipeline").await?;
    println!("database: {description}");
    println!("broker: {}", broker.describe());
    let result = async {
        db.setup().await?;
        let before = db.progress().await?;
        let started = Instant::now();
        let wiring = match &broker {
            Broker::InProcess => {
                let payments = MemorySource::new(PAYMENTS_QUEUE);
                let upstream = payments.handle();
                for payment in &stream.deliveries {
                    let payload = serde_json::to_vec(payment).expect("a payment serializes");
                    upstream.push(Envelope::new(PaymentCaptured::NAME, payload));
                }
                upstream.close();
                let orders = MemorySource::new(ORDERS_DESTINATION);
                let sink = Arc::new(StandIn(orders.handle()));
                Wiring {
                    payments: Box::new(payments),
                    orders: Box::new(orders),
                    sink,
                    idle: None,
                }
            }
            broker => {
                if before == Progress::default() {
                    broker.reset().await?;
                    println!("fresh database: emptied the broker's pipeline queues");
                }
                let produced = broker.produce(&stream.deliveries).await?;
                println!("produced {produced} payments.captured");
                let options = consume_options(common);
                Wiring {
                    payments: broker.payments_source(options).await?,
                    orders: broker.orders_source(options).await?,
                    sink: broker.sink().await?,
                    idle: Some(Duration::from_secs(2)),
                }
            }
        };
        let reports = match &db {
            Db::Postgres(pool) => {
                run_services(pool.clone(), &db, wiring, concurrency, shutdown.clone()).await?
            }
            Db::Sqlite(pool) => {
                run_services(pool.clone(), &db, wiring, concurrency, shutdown.clone()).await?
            }
        };
        let elapsed = started.elapsed();
        print_reports(&reports);
        let after = db.progress().await?;
        println!(
            "ran in {:.2} s ({:.0} payments/s end to end)",
            elapsed.as_secs_f64(),
            reports.orders.deliveries as f64 / elapsed.as_secs_f64().max(1e-9)
        );
        let summary = Summary {
            payments: reports.orders.deliveries,
            orders_applied: after.orders_applied - before.orders_applied,
            orders_duplicates: reports.orders.duplicates,
            relayed: after.sent - before.sent,
            shipping_applied: after.shipped - before.shipped,
            shipping_duplicates: reports.shipping.duplicates,
            verdict: check(&db, &stream).await?,
        };
        println!("{summary}");
        Ok(summary)
    }
    .await;
    db.close().await;
    result
}

/// Which service a process runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Service {
    Orders,
    Shipping,
}

impl Service {
    fn name(self) -> &'static str {
        match self {
            Service::Orders => "orders",
            Service::Shipping => "shipping",
        }
    }
}

/// A broker the services can run on as processes of their own.
fn real_broker(common: &Common) -> Result<Broker, String> {
    match Broker::parse(common.broker.as_deref())? {
        Broker::InProcess => Err(
            "the services run as processes of their own only on a real broker: \
             --broker amqp://… or nats://…"
                .into(),
        ),
        broker => Ok(broker),
    }
}

/// Sums `report` into `total`.
fn add(total: &mut WorkerReport, report: &WorkerReport) {
    total.deliveries += report.deliveries;
    total.processed += report.processed;
    total.duplicates += report.duplicates;
    total.parked += report.parked;
    total.stale += report.stale;
    total.failed += report.failed;
    total.dead += report.dead;
    total.invalid += report.invalid;
    total.conflicts += report.conflicts;
}

/// `pipeline orders|shipping`: one consumer, reconnecting whenever its source fails, until a
/// signal (or idle).
async fn run_service(
    common: &Common,
    service: Service,
    args: &ServiceArgs,
    shutdown: CancellationToken,
) -> Result<Verdict, String> {
    let broker = real_broker(common)?;
    let concurrency = concurrency(common);
    let role = format!("pipeline {}", service.name());
    let (db, description) = Db::connect(
        common.database.as_deref(),
        u32::from(concurrency) + 2,
        &role,
    )
    .await?;
    println!("database: {description}");
    println!("broker: {}", broker.describe());
    let result = async {
        db.setup().await?;
        let total = match &db {
            Db::Postgres(pool) => {
                serve(pool.clone(), &broker, common, service, args, &shutdown).await?
            }
            Db::Sqlite(pool) => {
                serve(pool.clone(), &broker, common, service, args, &shutdown).await?
            }
        };
        println!(
            "{}: stopped; deliveries={} processed={} duplicates={} parked={} failed={}",
            service.name(),
            total.deliveries,
            total.processed,
            total.duplicates,
            total.parked,
            total.failed
        );
        Ok(Verdict::Unchecked)
    }
    .await;
    db.close().await;
    result
}

async fn serve<DB: OutboxDatabase>(
    pool: sqlx::Pool<DB>,
    broker: &Broker,
    common: &Common,
    service: Service,
    args: &ServiceArgs,
    shutdown: &CancellationToken,
) -> Result<WorkerReport, String> {
    let dispatcher = Dispatcher::from_registry(pool).map_err(|e| e.to_string())?;
    let options = consume_options(common);
    let mut worker = Worker::new(dispatcher).concurrency(usize::from(options.concurrency));
    if let Some(idle) = args.idle_exit {
        worker = worker.stop_when_idle(Duration::from_secs_f64(idle.max(0.0)));
    }
    let name = service.name();
    let mut total = WorkerReport::default();
    while !shutdown.is_cancelled() {
        let connected = match service {
            Service::Orders => broker.payments_source(options).await,
            Service::Shipping => broker.orders_source(options).await,
        };
        let source = match connected {
            Ok(source) if args.trace_deliveries => Box::new(Traced(source)) as Box<dyn Source>,
            Ok(source) => source,
            Err(error) => {
                eprintln!("{name}: cannot consume ({error}); retrying in 1 s");
                tokio::select! {
                    () = shutdown.cancelled() => {}
                    () = tokio::time::sleep(Duration::from_secs(1)) => {}
                }
                continue;
            }
        };
        println!("{name}: consuming {}", source.name());
        match worker.run(source, shutdown.clone()).await {
            Ok(report) => {
                add(&mut total, &report);
                match report.stop {
                    StopReason::Idle | StopReason::Shutdown => break,
                    // A broker consumer ends when the broker cancels it: consume again.
                    _ => eprintln!("{name}: the broker ended the consumer; reconnecting"),
                }
            }
            Err(error) => {
                add(&mut total, &error.report);
                eprintln!("{name}: {error}; reconnecting");
                tokio::select! {
                    () = shutdown.cancelled() => {}
                    () = tokio::time::sleep(Duration::from_millis(500)) => {}
                }
            }
        }
    }
    Ok(total)
}

/// `pipeline relay`: the relay, until a signal (or idle).
async fn run_relay(
    common: &Common,
    args: RelayArgs,
    shutdown: CancellationToken,
) -> Result<Verdict, String> {
    let broker = real_broker(common)?;
    let (db, description) = Db::connect(common.database.as_deref(), 4, "pipeline relay").await?;
    println!("database: {description}");
    println!("broker: {}", broker.describe());
    let result = async {
        db.setup().await?;
        let sink = loop {
            match broker.sink().await {
                Ok(sink) => break sink,
                Err(error) => eprintln!("relay: cannot publish ({error}); retrying in 1 s"),
            }
            tokio::select! {
                () = shutdown.cancelled() => return Ok(Verdict::Unchecked),
                () = tokio::time::sleep(Duration::from_secs(1)) => {}
            }
        };
        let stop = shutdown.child_token();
        if let Some(idle) = args.idle_exit {
            let (db, stop) = (db.clone(), stop.clone());
            let idle = Duration::from_secs_f64(idle.max(0.0));
            tokio::spawn(async move {
                let mut quiet_since = Instant::now();
                while !stop.is_cancelled() {
                    match db.progress().await {
                        Ok(progress) if progress.pending == 0 => {
                            if quiet_since.elapsed() >= idle {
                                stop.cancel();
                            }
                        }
                        _ => quiet_since = Instant::now(),
                    }
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
            });
        }
        println!("relay: publishing to {ORDERS_DESTINATION}");
        let report = match &db {
            Db::Postgres(pool) => relay(pool.clone(), sink, args.tuning)?.run(stop).await,
            Db::Sqlite(pool) => relay(pool.clone(), sink, args.tuning)?.run(stop).await,
        };
        println!(
            "relay: stopped; rounds={} published={} failed={} dead={} errors={}",
            report.rounds, report.published, report.failed, report.dead, report.errors
        );
        Ok(Verdict::Unchecked)
    }
    .await;
    db.close().await;
    result
}

/// `pipeline produce`.
async fn run_produce(common: &Common) -> Result<Verdict, String> {
    let broker = real_broker(common)?;
    let stream = Stream::generate(common.payments, common.seed);
    let started = Instant::now();
    let produced = broker.produce(&stream.deliveries).await?;
    println!(
        "produced {produced} payments.captured ({} distinct) to {} in {:.2} s",
        stream.payments,
        broker.describe(),
        started.elapsed().as_secs_f64()
    );
    Ok(Verdict::Unchecked)
}

/// `pipeline check`: the summary of the database as it is (totals over every run).
async fn run_check(common: &Common) -> Result<Verdict, String> {
    let stream = Stream::generate(common.payments, common.seed);
    let (db, description) = Db::connect(common.database.as_deref(), 2, "pipeline check").await?;
    println!("database: {description}");
    let result = async {
        db.setup().await?;
        let progress = db.progress().await?;
        let verdict = check(&db, &stream).await?;
        println!(
            "summary: payments={} orders_applied={} relayed={} shipping_applied={} effects={}",
            stream.payments,
            progress.orders_applied,
            progress.sent,
            progress.shipped,
            effects(verdict)
        );
        Ok(verdict)
    }
    .await;
    db.close().await;
    result
}

/// Logs to stderr, filtered by `RUST_LOG`, else warnings and errors.
fn init_tracing() {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn"));
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_env_filter(filter)
        .with_target(false)
        .init();
}

#[tokio::main]
async fn main() -> ExitCode {
    let args = Args::parse();
    // Before anything else, so that a signal during start-up is not lost.
    let shutdown = match inbox_runtime::cancel_on_signal() {
        Ok(token) => token,
        Err(error) => {
            eprintln!("pipeline: cannot handle signals: {error}");
            return ExitCode::from(2);
        }
    };
    init_tracing();
    let common = &args.common;
    let result = match args.command {
        None => run_all(common, shutdown)
            .await
            .map(|summary| summary.verdict),
        Some(Command::Produce) => run_produce(common).await,
        Some(Command::Orders(service)) => {
            run_service(common, Service::Orders, &service, shutdown).await
        }
        Some(Command::Shipping(service)) => {
            run_service(common, Service::Shipping, &service, shutdown).await
        }
        Some(Command::Relay(relay)) => run_relay(common, relay, shutdown).await,
        Some(Command::Check) => run_check(common).await,
    };
    match result {
        Ok(Verdict::Ok | Verdict::Unchecked) => ExitCode::SUCCESS,
        Ok(Verdict::Mismatch) => ExitCode::from(1),
        Err(error) => {
            eprintln!("pipeline: {error}");
            ExitCode::from(2)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A database file in the temp directory, removed on drop.
    struct TempDb(std::path::PathBuf);

    impl TempDb {
        fn new(name: &str) -> Self {
            let nanos = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .unwrap()
                .as_nanos();
            Self(std::env::temp_dir().join(format!(
                "inbox-pipeline-{name}-{}-{nanos}.db",
                std::process::id()
            )))
        }

        fn url(&self) -> String {
            format!("sqlite:{}", self.0.display())
        }
    }

    impl Drop for TempDb {
        fn drop(&mut self) {
            for suffix in ["", "-wal", "-shm"] {
                let mut path = self.0.clone().into_os_string();
                path.push(suffix);
                let _ = std::fs::remove_file(path);
            }
        }
    }

    /// Seconds the runtime cannot hold (`Duration::from_secs_f64` panicked on them after the
    /// services had connected) are refused by the parser, with the ledger demo's bounds.
    #[test]
    fn seconds_out_of_range_are_refused_by_the_parser() {
        for args in [
            &["pipeline", "--ack-wait", "1e300"][..],
            &["pipeline", "--ack-wait=-1"],
            &["pipeline", "orders", "--idle-exit", "inf"],
            &["pipeline", "shipping", "--idle-exit", "1e30"],
            &["pipeline", "relay", "--idle-exit", "NaN"],
        ] {
            let error = Args::try_parse_from(args).unwrap_err();
            assert_eq!(
                error.kind(),
                clap::error::ErrorKind::ValueValidation,
                "{args:?}"
            );
            assert!(
                error
                    .to_string()
                    .contains("is not a number of seconds from 0 to 43200"),
                "{error}"
            );
        }
        let args =
            Args::try_parse_from(["pipeline", "--ack-wait", "0.5", "relay", "--idle-exit", "2"])
                .unwrap();
        assert_eq!(args.common.ack_wait, 0.5);
        assert!(
            matches!(args.command, Some(Command::Relay(relay)) if relay.idle_exit == Some(2.0))
        );
    }

    fn common(database: String, payments: usize) -> Common {
        Common {
            database: Some(database),
            broker: None,
            payments,
            seed: 11,
            concurrency: None,
            ack_wait: 5.0,
        }
    }

    /// Two runs on one database: the first applies every payment once downstream, the second
    /// nothing; both checks pass. Then the check catches a doubled shipment, one applied out of
    /// sequence and an outbox row that was never sent.
    async fn twice_then_tampered(database: String) {
        let common = common(database, 300);
        let deliveries = Stream::generate(300, 11).deliveries.len() as u64;
        let first = run_all(&common, CancellationToken::new()).await.unwrap();
        assert_eq!(
            first,
            Summary {
                payments: deliveries,
                orders_applied: 300,
                orders_duplicates: deliveries - 300,
                relayed: 300,
                shipping_applied: 300,
                shipping_duplicates: 0,
                verdict: Verdict::Ok,
            }
        );
        let second = run_all(&common, CancellationToken::new()).await.unwrap();
        assert_eq!(
            second,
            Summary {
                payments: deliveries,
                orders_applied: 0,
                orders_duplicates: deliveries,
                relayed: 0,
                shipping_applied: 0,
                shipping_duplicates: 0,
                verdict: Verdict::Ok,
            }
        );

        let stream = Stream::generate(300, 11);
        let (db, _) = Db::connect(common.database.as_deref(), 2, "pipeline test")
            .await
            .unwrap();
        let tamper = [
            "UPDATE pipeline_shipments SET payments = payments + 1 \
             WHERE order_id = (SELECT MIN(order_id) FROM pipeline_shipments)",
            "UPDATE pipeline_customer_totals SET out_of_order = 1 \
             WHERE customer_id = (SELECT MIN(customer_id) FROM pipeline_customer_totals)",
            "UPDATE inbox_outbox SET status = 'pending' WHERE id = (SELECT MIN(id) FROM inbox_outbox)",
        ];
        for statement in tamper {
            match &db {
                Db::Postgres(pool) => sqlx::query(statement).execute(pool).await.map(drop),
                Db::Sqlite(pool) => sqlx::query(statement).execute(pool).await.map(drop),
            }
            .unwrap();
        }
        let state = db.state().await.unwrap();
        let mismatches = check::mismatches(&stream, &state);
        let first_order = stream.orders.keys().next().unwrap();
        let first_customer = stream.customers.keys().next().unwrap();
        let order = &stream.orders[first_order];
        assert_eq!(
            mismatches,
            [
                format!(
                    "shipping: order {first_order} has ({}, {}, {}) (customer, payments, cents), \
                     expected ({}, {}, {})",
                    order.customer_id,
                    order.payments + 1,
                    order.paid_cents,
                    order.customer_id,
                    order.payments,
                    order.paid_cents
                ),
                format!("shipping: customer {first_customer} had 1 events applied out of sequence"),
                "outbox: 300 rows (pending=1 sent=299), expected 300 sent".to_owned(),
            ]
        );
        assert_eq!(check(&db, &stream).await.unwrap(), Verdict::Mismatch);
        db.close().await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn twice_on_sqlite() {
        let db = TempDb::new("twice");
        twice_then_tampered(db.url()).await;
    }

    /// On PostgreSQL, if `DATABASE_URL` names one (`scripts/test.sh`), in a database of its own.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn twice_on_postgres() {
        let url = match std::env::var("DATABASE_URL") {
            Ok(url) if url.starts_with("postgres://") || url.starts_with("postgresql://") => url,
            _ => {
                eprintln!("twice_on_postgres: skipped, DATABASE_URL names no PostgreSQL");
                return;
            }
        };
        let name = format!("pipeline_test_{}", std::process::id());
        let admin = sqlx::PgPool::connect(&url).await.unwrap();
        for statement in [
            format!("DROP DATABASE IF EXISTS {name} WITH (FORCE)"),
            format!("CREATE DATABASE {name}"),
        ] {
            sqlx::query(sqlx::AssertSqlSafe(statement))
                .execute(&admin)
                .await
                .unwrap();
        }
        let base = url.split('?').next().unwrap().rsplit_once('/').unwrap().0;
        twice_then_tampered(format!("{base}/{name}")).await;
        sqlx::query(sqlx::AssertSqlSafe(format!(
            "DROP DATABASE {name} WITH (FORCE)"
        )))
        .execute(&admin)
        .await
        .unwrap();
        admin.close().await;
    }
}
