//! # The ledger demo: effectively-once processing of a payments stream
//!
//! ```text
//! cargo run --example ledger                         # the bundled sample, checked
//! cargo run --example ledger -- events.jsonl         # another JSON-lines file, unchecked
//! cargo run --example ledger -- - < events.jsonl     # standard input
//! cargo run --example ledger -- events.jsonl --expected truth.json
//! DATABASE_URL=postgres://user@host/db cargo run --example ledger
//! cargo run --example ledger --features dynamodb -- --store dynamodb://ledger   # AWS_* variables
//!
//! # On a broker: load the sample into it, then consume it (see "Brokers" below)
//! cargo run --example ledger -- publish --to amqp://127.0.0.1:5672/%2f
//! cargo run --example ledger -- --source amqp://127.0.0.1:5672/%2f
//! cargo run --example ledger -- publish --to nats://127.0.0.1:4222
//! cargo run --example ledger -- --source nats://127.0.0.1:4222
//! cargo run --example ledger --features kafka -- publish --to kafka://127.0.0.1:9092
//! cargo run --example ledger --features kafka -- --source kafka://127.0.0.1:9092
//! cargo run --example ledger --features kafka -- --source kafka://mock   # all in this process
//! cargo run --example ledger --features sqs -- publish --to sqs://ledger.fifo   # AWS_* variables
//! cargo run --example ledger --features sqs -- --source sqs://ledger.fifo
//!
//! # The same stream through a worker over a file that resumes at its last acked line
//! cargo run --example ledger -- --source file:examples/ledger/data/payments.jsonl --offset-file /tmp/ledger.offset
//!
//! # Operating it: the inbox's admin CLI (inbox_runtime::ops::cli) on the demo's database
//! cargo run --example ledger -- admin stats
//! cargo run --example ledger -- admin dead list
//! cargo run --example ledger -- admin dead replay --all
//!
//! # The operator console in the browser (inbox_runtime::ops::console) on the demo's database
//! cargo run --example ledger -- console --listen 127.0.0.1:8080 --token s3cret
//!
//! # Metrics table on stderr at exit (or --metrics-listen 127.0.0.1:9464), logs by RUST_LOG
//! RUST_LOG=inbox_runtime=debug cargo run --example ledger -- --metrics
//! ```
//!
//! Each input line is one delivery,
//! `{"message":"payments.captured","payload":{"event_id":"<uuid>","account_id":"acct-0042","amount_cents":1234}}`
//! (`payments.refunded` debits instead of crediting). Every line goes through an
//! [`inbox_runtime::Dispatcher`] to an `#[idempotent(consumer = "ledger")]` handler that adds the
//! amount to the account's balance, in the same transaction as the claim of the event id in the
//! inbox. So:
//!
//! * a redelivered event — byte-identical, or with its fields reordered or its whitespace
//!   changed — is a **duplicate**: the handler does not run again;
//! * an event id seen before with a *different* payload is a **conflict**: not applied;
//! * a line that is not a message (bad JSON, unknown message name, payload that does not decode,
//!   missing or empty event id) is **rejected**, reported on stderr with its line number (and
//!   kept in `inbox_rejections` with its bytes and the reason, the parse error included);
//! * an event for an account id that is not `acct-<digits>` is **dead**: the handler refuses it
//!   with a permanent error, and the inbox keeps it as `dead` with its payload for an operator
//!   (`ledger admin dead list`). The summary line then ends with `dead=N` (and, for
//!   redeliveries of keys an operator discarded with `ledger admin dead discard`, `discarded=N`).
//!   An event whose handler or database keeps failing is dead too after `--max-attempts`
//!   attempts (default 5; `--max-attempts 1`: at its first failure, for an operator to replay
//!   once the cause is fixed).
//!
//! The bundled sample (`examples/ledger/data/payments.jsonl`, ~30,000 lines over 300 accounts,
//! written by `cargo run --example ledger-gen`) holds thousands of redeliveries, 16 conflicts and
//! 18 malformed lines; `expected.json` beside it is its ground truth.
//!
//! **Database**: `--database-url` or `DATABASE_URL` (`postgres://…`, `mysql://…`/`mariadb://…` or `sqlite:…`), else the
//! SQLite file `ledger.db` in the current directory (created if missing, WAL mode). The demo
//! runs the inbox migrations and creates its `accounts` table itself. Run it twice on the same
//! database: the second run applies nothing (`processed=0`) and the balances are unchanged.
//!
//! **DynamoDB** (examples feature `dynamodb`): `--store dynamodb://TABLE` (`--store` is another
//! name of `--database-url`) keeps the inbox in the DynamoDB table `TABLE` and the accounts in
//! `TABLE-accounts`, both created if absent; endpoint, region and credentials from the standard
//! AWS variables (`AWS_ENDPOINT_URL` for moto or DynamoDB Local). Each line's claim and balance
//! `Update` commit in one `TransactWriteItems` (see `dynamo.rs`); the lines printed, the counts and
//! the balances are those of a SQL database, plus a `dynamodb: N calls` line. File mode only:
//! what the SQL run has and this one has not yet (rejected lines kept, `ledger admin`,
//! `ledger console`, `--source`, `--cache`) is printed as `not on dynamodb yet: …`, and refused
//! with an error where it is asked for.
//!
//! **Check**: with the default input, the balances in the database are compared with the
//! sample's `expected.json`; with another input, only if `--expected FILE` is given (a file of
//! the same form), else the summary says `balances=unchecked`. If the database had no accounts
//! before the run, the four counts are compared with the file as well (on a later run they
//! differ by design: everything is a duplicate).
//!
//! The last line of stdout is
//! `summary: processed=N duplicates=N conflicts=N rejected=N balances=ok|MISMATCH|unchecked`,
//! followed by ` dead=N` and ` failed=N` when there are some. A line whose handler or database
//! fails (a retryable error: its event is recorded `failed` in the inbox) is reported on stderr
//! and the stream goes on; the run then ends with exit status 2, after the summary.
//! Exit status: 0 when the check passed or there was none, 1 on a mismatch (the differences
//! are listed on stderr), 2 on bad usage, unreadable input, a database that cannot be used, or
//! any failed line.
//!
//! ## Brokers
//!
//! `ledger publish [PATH] --to URL` loads a JSON-lines stream (default: the sample) into
//! RabbitMQ (`amqp://…`: the durable queue `--queue`, default `ledger`, persistent messages with
//! publisher confirms; the message name in the `type` property, `message_id` = `line-N`) or
//! NATS JetStream (`nats://…`: the stream `--stream`, default `LEDGER`, created on subject
//! `--subject`, default `ledger.events`; the message name in the `message-name` header). A line
//! that is not a message envelope is published as it is, with no name. Kafka (`kafka://HOST:PORT[,…]`,
//! examples feature `kafka`): the topic `--topic` (default `ledger`; it must exist, or the
//! cluster creates it on first use), an idempotent producer; the message name in the
//! `message-name` header, `message-id` = `line-N`, the record key = the payload's `event_id`, so
//! that every copy and variant of an event is in one partition, in file order. `--duplicate P` publishes
//! each line a second time with probability P % (seeded by `--seed`), like a retrying producer.
//!
//! `ledger --source URL` consumes the queue (or the JetStream durable consumer `--consumer`,
//! default `ledger`) with an [`inbox_runtime::Worker`]: `--concurrency` deliveries at once
//! (default 16; also the prefetch; the PostgreSQL pool gets one more), each acked only after its
//! transaction committed, conflicts and malformed messages rejected (logged on stderr),
//! failures requeued. It exits once nothing has arrived for `--idle-exit` seconds (default 3),
//! and prints the same summary line, counting this run's deliveries; the balances are checked
//! against `--expected` (default: the sample's `expected.json`; `--no-check`: none), the counts
//! never (a run may see part of the stream, or redeliveries). On SIGINT or SIGTERM it stops
//! fetching, finishes the deliveries under way, and exits 0 with `balances=unchecked`; killed
//! outright, it loses nothing: the broker redelivers what was not acked, and the inbox turns
//! what had committed into duplicates.
//!
//! `--source kafka://HOST:PORT[,…]` consumes the topic as a member of the consumer group
//! `--consumer` (default `ledger`) through [`inbox_runtime::source::kafka::KafkaSource`]: the
//! group's positions live in the demo's database (`inbox_positions`), written in the same
//! transaction as each effect and fenced against a consumer that lost its partition; one record
//! of a partition at a time, partitions in parallel up to `--concurrency`. It waits for its
//! first partitions before it starts (a group's first rebalance takes seconds), and prints them.
//! `--kafka-property NAME=VALUE` sets librdkafka properties (`session.timeout.ms`, `sasl.*`, …),
//! `--delivery-log FILE` appends the partition and offset of every record handed to the worker.
//! `--source kafka://mock` starts librdkafka's mock cluster in the demo's process, creates the
//! topic with `--partitions` (default 4) partitions, publishes the input (default: the sample)
//! into it, consumes it and checks the balances: Kafka end to end with nothing installed. Without
//! the `kafka` feature, a `kafka://` URL is refused with an error naming the feature (the default
//! build needs nothing but cargo).
//!
//! `publish --to sqs://QUEUE` and `--source sqs://QUEUE` (examples feature `sqs`) use Amazon SQS
//! (or a compatible server such as moto): endpoint, region and credentials from the standard AWS
//! variables (`AWS_ENDPOINT_URL`, `AWS_REGION`, `AWS_ACCESS_KEY_ID`, `AWS_SECRET_ACCESS_KEY`) and
//! profiles; the queue is created if missing (`.fifo`: a FIFO queue, the payload's `account_id`
//! as message group, `line-N` as deduplication id). The message name is the `message-name`
//! attribute; `--ack-wait` is the visibility timeout, renewed while a delivery is in flight;
//! each message is deleted after its transaction committed (in batches), and the run prints its
//! SQS calls (`sqs: …`).
//!
//! `--source file:PATH` consumes a JSON-lines file the same way, with
//! [`inbox_runtime::source::file::FileSource`]: it keeps the acked prefix of the file in the
//! offset file (`--offset-file`, default `PATH.offset`) and resumes after it when started
//! again; it exits when every line is settled.
//!
//! ## Operating it
//!
//! `ledger admin …` is [`inbox_runtime::ops::cli`] on the demo's database (`--database-url` or
//! `DATABASE_URL` after `admin`, else `./ledger.db`): `migrate`, `stats`,
//! `dead list|show|replay|discard`, `purge --window 7d --redelivery-horizon 3d`.
//!
//! `ledger console --listen ADDR` serves [`inbox_runtime::ops::console`] on the same database at
//! `http://ADDR/console` (default `127.0.0.1:8080`): the overview, failed and dead messages,
//! replay and discard (with the demo's handlers), rejections. `--token TOKEN` (or
//! `LEDGER_CONSOLE_TOKEN`) is the password the browser asks for (any user name: it names the
//! operator in the logs) or a bearer token; `--insecure-no-auth` serves without authentication,
//! for a console behind a proxy that authenticates. One of the two is required.
//!
//! ## Observability
//!
//! Logs go to stderr, filtered by `RUST_LOG` (default: off in file mode, `warn` with
//! `--source`). `--metrics` records the runtime's metrics, and the demo's own
//! `ledger_rejected_total` (the summary's `rejected`), and prints a table of them on stderr at
//! exit; `--metrics-listen ADDR` serves them at `http://ADDR/metrics` while running. On a
//! terminal a progress bar shows how far the input is read; piped or redirected, stderr gets
//! none.

mod broker;
mod check;
mod console;
mod db;
#[cfg(feature = "dynamodb")]
mod dynamo;
mod feed;
mod handlers;
#[cfg(feature = "kafka")]
mod kafka;
mod messages;
mod observe;
#[cfg(feature = "sqs")]
mod sqs;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::{Duration, Instant};

use clap::Parser;
use inbox_runtime::source::file::FileSource;
use inbox_runtime::{Dispatcher, store::InboxDatabase};
use tokio::io::{AsyncBufRead, BufReader};

use crate::check::Expected;
use crate::db::Db;
use crate::feed::{Counts, feed};

/// The bundled sample stream.
const SAMPLE: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/ledger/data/payments.jsonl");
/// The bundled sample's ground truth.
const SAMPLE_EXPECTED: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/ledger/data/expected.json");

#[derive(Parser, Debug)]
#[command(
    name = "ledger",
    about = "Feeds a payments stream through #[idempotent] handlers and checks the balances",
    args_conflicts_with_subcommands = true
)]
struct Args {
    #[command(subcommand)]
    command: Option<Command>,
    /// Consume from a broker instead of a file: amqp://… (RabbitMQ), nats://… (JetStream),
    /// kafka://HOST:PORT[,…] or kafka://mock (Kafka, examples feature `kafka`), sqs://QUEUE
    /// (Amazon SQS, examples feature `sqs`), or file:PATH
    #[arg(long, value_name = "URL")]
    source: Option<String>,
    /// Do not check the balances
    #[arg(long)]
    no_check: bool,
    #[command(flatten)]
    consume: broker::ConsumeArgs,
    /// JSON-lines input file, or `-` for standard input [default: the bundled sample]
    #[arg(value_name = "PATH|-")]
    input: Option<PathBuf>,
    /// Ground truth to check the balances against [default: the sample's expected.json when
    /// reading the sample, else no check]
    #[arg(long, value_name = "FILE")]
    expected: Option<PathBuf>,
    /// Database: postgres://…, mysql://…, mariadb://… or sqlite:…, or the DynamoDB store
    /// dynamodb://TABLE (examples feature `dynamodb`; file mode only) [default: sqlite file
    /// ./ledger.db]
    #[arg(
        long,
        visible_alias = "store",
        env = "DATABASE_URL",
        value_name = "URL",
        hide_env_values = true
    )]
    database_url: Option<String>,
    /// With --source file:PATH: the file keeping the acked position [default: PATH.offset]
    #[arg(long, value_name = "FILE")]
    offset_file: Option<PathBuf>,
    #[command(flatten)]
    observe: observe::ObserveArgs,
}

#[derive(clap::Subcommand, Debug)]
enum Command {
    /// Loads a JSON-lines stream into RabbitMQ, NATS JetStream, Kafka or SQS
    Publish(broker::PublishArgs),
    /// Inspects and repairs the inbox: stats, dead letters, replay, purge
    Admin(AdminArgs),
    /// Serves the operator console in the browser on the demo's database
    Console(console::ConsoleArgs),
}

/// `ledger admin`: the runtime's admin CLI on the demo's database.
#[derive(clap::Args, Debug)]
struct AdminArgs {
    /// Database: postgres://…, mysql://…, mariadb://… or sqlite:… [default: sqlite file ./ledger.db]
    #[arg(long, env = "DATABASE_URL", value_name = "URL", hide_env_values = true)]
    database_url: Option<String>,
    #[command(subcommand)]
    command: inbox_runtime::ops::cli::AdminCommand,
}

/// Whether the check passed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Verdict {
    Ok,
    Mismatch,
    Unchecked,
}

type Input = Box<dyn AsyncBufRead + Unpin + Send>;

/// Puts the dedupe cache `spec` names (`memory`, `redis://…`, or none) in front of
/// `dispatcher`'s inbox, with entries kept one hour (within the demo's seven-day retention).
pub(crate) async fn with_cache<DB: InboxDatabase>(
    dispatcher: Dispatcher<DB>,
    spec: Option<&str>,
) -> Result<Dispatcher<DB>, String> {
    const TTL: Duration = Duration::from_secs(3600);
    let retention = inbox_runtime::ops::admin::Retention::new(
        Duration::from_secs(7 * 86_400),
        Duration::from_secs(3600),
    )
    .map_err(|e| e.to_string())?;
    let dispatcher = match spec {
        None => return Ok(dispatcher),
        Some("memory") => dispatcher.with_cache(
            inbox_runtime::cache::MemoryCache::new(1_000_000, TTL),
            &retention,
        ),
        Some(url) if url.starts_with("redis://") || url.starts_with("rediss://") => {
            // One prefix per database: two inboxes sharing one Redis must not see each other's
            // keys (a key processed in one is not processed in the other).
            use std::hash::{Hash as _, Hasher as _};
            let mut hasher = std::collections::hash_map::DefaultHasher::new();
            format!("{:?}", dispatcher.pool().connect_options()).hash(&mut hasher);
            let cache = inbox_runtime::cache::redis::RedisCache::connect(url, TTL)
                .await
                .map_err(|e| e.to_string())?
                .prefix(format!("ledger:{:016x}:", hasher.finish()));
            dispatcher.with_cache(cache, &retention)
        }
        Some(other) => {
            return Err(format!(
                "unsupported cache `{other}`: expected memory or redis://HOST:PORT/"
            ));
        }
    }
    .map_err(|e| e.to_string())?;
    println!("cache: {}", spec.unwrap_or_default());
    Ok(dispatcher)
}

/// `dispatcher` with the retry policy's `max_attempts` set (`--max-attempts`), if given.
pub(crate) fn with_max_attempts<DB: InboxDatabase>(
    dispatcher: Dispatcher<DB>,
    max_attempts: Option<u32>,
) -> Dispatcher<DB> {
    match max_attempts {
        Some(attempts) => {
            let policy = dispatcher.retry_policy().clone().max_attempts(attempts);
            dispatcher.with_retry_policy(policy)
        }
        None => dispatcher,
    }
}

/// Feeds `input` through a dispatcher over `db`'s pool (with the dedupe cache `cache` names, and
/// `max_attempts` in its retry policy if given).
async fn process(
    db: &Db,
    input: Input,
    source: &str,
    cache: Option<&str>,
    max_attempts: Option<u32>,
) -> Result<Counts, String> {
    async fn with<DB: InboxDatabase>(
        pool: sqlx::Pool<DB>,
        input: Input,
        source: &str,
        cache: Option<&str>,
        max_attempts: Option<u32>,
    ) -> Result<Counts, String> {
        let dispatcher = Dispatcher::from_registry(pool).map_err(|e| e.to_string())?;
        for handler in dispatcher.handlers() {
            println!("handler: {handler}");
        }
        let dispatcher = with_max_attempts(dispatcher, max_attempts);
        let dispatcher = with_cache(dispatcher, cache).await?;
        feed(&dispatcher, input, source)
            .await
            .map_err(|e| e.to_string())
    }
    match db {
        Db::Postgres(pool) => with(pool.clone(), input, source, cache, max_attempts).await,
        Db::Sqlite(pool) => with(pool.clone(), input, source, cache, max_attempts).await,
        Db::MySql(pool) => with(pool.clone(), input, source, cache, max_attempts).await,
    }
}

async fn run(args: Args) -> Result<Verdict, String> {
    observe::init_tracing("off");
    let metrics = observe::Metrics::install(&args.observe)?;
    let (input, expected_path) = match args.input {
        None => (PathBuf::from(SAMPLE), Some(PathBuf::from(SAMPLE_EXPECTED))),
        Some(input) => (input, None),
    };
    let expected_path = args.expected.or(expected_path).filter(|_| !args.no_check);
    let expected = expected_path.as_deref().map(Expected::load).transpose()?;

    // A progress bar over the bytes read (shown on a terminal only).
    let (reader, source): (Input, String) = if input.as_os_str() == "-" {
        let bar = observe::progress_bar(None);
        (
            Box::new(BufReader::new(bar.wrap_async_read(tokio::io::stdin()))),
            "stdin".into(),
        )
    } else {
        let file = tokio::fs::File::open(&input)
            .await
            .map_err(|e| format!("cannot open {}: {e}", input.display()))?;
        let len = file.metadata().await.ok().map(|m| m.len());
        let bar = observe::progress_bar(len);
        (
            Box::new(BufReader::with_capacity(1 << 16, bar.wrap_async_read(file))),
            input.display().to_string(),
        )
    };

    if let Some(url) = args
        .database_url
        .as_deref()
        .filter(|url| url.starts_with("dynamodb://"))
    {
        let expected = expected.as_ref().zip(expected_path.as_deref());
        return run_dynamodb(url, &args.consume, reader, &source, expected, metrics).await;
    }

    let (db, description) = Db::connect(args.database_url.as_deref())
        .await
        .map_err(|e| e.to_string())?;
    println!("database: {description}");
    println!("input: {source}");
    db.setup().await.map_err(|e| e.to_string())?;
    let fresh = db.balances().await.map_err(|e| e.to_string())?.is_empty();

    let started = Instant::now();
    let counts = process(
        &db,
        reader,
        &source,
        args.consume.cache.as_deref(),
        args.consume.max_attempts,
    )
    .await;
    observe::finish_progress();
    let elapsed = started.elapsed();
    let counts = match counts {
        Ok(counts) => counts,
        Err(error) => {
            db.close().await;
            return Err(error);
        }
    };
    println!(
        "read {} lines in {:.2} s ({:.0} lines/s)",
        counts.lines,
        elapsed.as_secs_f64(),
        counts.lines as f64 / elapsed.as_secs_f64().max(1e-9)
    );

    let balances = db.balances().await.map_err(|e| e.to_string());
    db.close().await;
    let balances = balances?;
    if let Some(metrics) = &metrics {
        metrics.finish();
    }

    let verdict = check_and_summarize(
        expected.as_ref().zip(expected_path.as_deref()),
        &balances,
        &counts,
        fresh,
    );
    if counts.failed > 0 {
        // After the summary: every other line was processed; these were not.
        return Err(format!(
            "{} line{} failed (handler or database error, reported above); their events are \
             `failed` in the inbox, for a later run or `ledger admin dead replay`",
            counts.failed,
            if counts.failed == 1 { "" } else { "s" }
        ));
    }
    Ok(verdict)
}

/// `ledger --store dynamodb://TABLE [PATH|-]`: the file mode on the DynamoDB store (see
/// `dynamo.rs`), with the same lines as on a SQL database, and what it does not do (yet).
#[cfg(feature = "dynamodb")]
async fn run_dynamodb(
    url: &str,
    consume: &broker::ConsumeArgs,
    reader: Input,
    source: &str,
    expected: Option<(&Expected, &Path)>,
    metrics: Option<observe::Metrics>,
) -> Result<Verdict, String> {
    if let Some(cache) = &consume.cache {
        return Err(format!(
            "--cache {cache}: the dedupe cache is not available on the DynamoDB store yet \
             (a duplicate costs one GetItem there)"
        ));
    }
    let (store, description) = dynamo::DynamoStore::connect(url, consume.max_attempts).await?;
    println!("database: {description}");
    println!("input: {source}");
    for note in dynamo::NOT_YET {
        println!("not on dynamodb yet: {note}");
    }
    store.setup().await?;
    let fresh = store.balances().await?.is_empty();
    for handler in store.handlers() {
        println!("handler: {handler}");
    }
    let started = Instant::now();
    let counts = store.feed(reader).await.map_err(|e| e.to_string());
    observe::finish_progress();
    let elapsed = started.elapsed();
    let counts = counts?;
    println!(
        "read {} lines in {:.2} s ({:.0} lines/s)",
        counts.lines,
        elapsed.as_secs_f64(),
        counts.lines as f64 / elapsed.as_secs_f64().max(1e-9)
    );
    let stats = store.stats();
    println!(
        "dynamodb: {} calls ({:.2} per line), {} transient retries",
        stats.calls,
        stats.calls as f64 / (counts.lines.max(1)) as f64,
        stats.transient_retries
    );
    let balances = store.balances().await?;
    if let Some(metrics) = &metrics {
        metrics.finish();
    }
    let verdict = check_and_summarize(expected, &balances, &counts, fresh);
    if counts.failed > 0 {
        return Err(format!(
            "{} line{} failed (handler or DynamoDB error, reported above); their events are \
             `failed` in the inbox table, for a later run",
            counts.failed,
            if counts.failed == 1 { "" } else { "s" }
        ));
    }
    Ok(verdict)
}

/// `dynamodb://…` in a build without the examples feature `dynamodb`: refused, naming it.
#[cfg(not(feature = "dynamodb"))]
async fn run_dynamodb(
    url: &str,
    _: &broker::ConsumeArgs,
    _: Input,
    _: &str,
    _: Option<(&Expected, &Path)>,
    _: Option<observe::Metrics>,
) -> Result<Verdict, String> {
    Err(format!(
        "`{url}`: DynamoDB needs the examples feature `dynamodb` (the AWS SDK): \
         cargo run --example ledger --features dynamodb -- --store {url}"
    ))
}

/// Compares the balances (and, on a fresh database, the counts) with the ground truth, reports
/// the differences on stderr, and prints the summary line.
fn check_and_summarize(
    expected: Option<(&Expected, &Path)>,
    balances: &BTreeMap<String, i64>,
    counts: &Counts,
    fresh: bool,
) -> Verdict {
    let verdict = match expected {
        Some((expected, path)) => {
            let mut mismatches = expected.balance_mismatches(balances);
            if fresh {
                mismatches.extend(expected.count_mismatches(counts));
            }
            if mismatches.is_empty() {
                println!(
                    "check: {} account balances match {}{}",
                    balances.len(),
                    path.display(),
                    if fresh {
                        ", and so do the counts (fresh database)"
                    } else {
                        ""
                    }
                );
                Verdict::Ok
            } else {
                eprintln!(
                    "{} mismatches against {}:",
                    mismatches.len(),
                    path.display()
                );
                for mismatch in &mismatches {
                    eprintln!("  {mismatch}");
                }
                Verdict::Mismatch
            }
        }
        None => Verdict::Unchecked,
    };

    println!(
        "summary: processed={} duplicates={} conflicts={} rejected={} balances={}{}",
        counts.processed,
        counts.duplicates,
        counts.conflicts,
        counts.rejected,
        match verdict {
            Verdict::Ok => "ok",
            Verdict::Mismatch => "MISMATCH",
            Verdict::Unchecked => "unchecked",
        },
        // Only when there are some: the summary of a stream without them is unchanged.
        [
            ("dead", counts.dead),
            ("discarded", counts.discarded),
            ("failed", counts.failed),
        ]
        .into_iter()
        .filter(|(_, n)| *n > 0)
        .map(|(name, n)| format!(" {name}={n}"))
        .collect::<String>()
    );
    verdict
}

/// `ledger publish`.
async fn run_publish(args: broker::PublishArgs) -> Result<Verdict, String> {
    let input = args.input.clone().unwrap_or_else(|| PathBuf::from(SAMPLE));
    let started = Instant::now();
    let published = broker::publish(&args, &input).await?;
    println!(
        "published {published} messages from {} to {} in {:.2} s",
        input.display(),
        args.to,
        started.elapsed().as_secs_f64()
    );
    Ok(Verdict::Unchecked)
}

/// `ledger --source URL`: consume a broker with a worker, then check the balances.
async fn run_broker(args: Args, url: String) -> Result<Verdict, String> {
    // Before anything else, so that a signal during start-up is not lost.
    let shutdown = inbox_runtime::cancel_on_signal().map_err(|e| e.to_string())?;
    observe::init_tracing("warn");
    let metrics = observe::Metrics::install(&args.observe)?;
    let expected_path = if args.no_check {
        None
    } else {
        Some(
            args.expected
                .unwrap_or_else(|| PathBuf::from(SAMPLE_EXPECTED)),
        )
    };
    let expected = expected_path.as_deref().map(Expected::load).transpose()?;

    // One connection per concurrency slot (the worker keeps them across deliveries), plus one
    // for everything else.
    let pool_size = u32::from(args.consume.concurrency) + 1;
    let (db, description) = Db::connect_with(args.database_url.as_deref(), pool_size)
        .await
        .map_err(|e| e.to_string())?;
    println!("database: {description}");
    println!("source: {url}");
    db.setup().await.map_err(|e| e.to_string())?;
    let connected = match url.strip_prefix("file:") {
        Some(path) => {
            let opened = match &args.offset_file {
                Some(offset) => FileSource::open_with_offset_file(path, offset).await,
                None => FileSource::open(path).await,
            };
            opened
                .map(|source| {
                    println!(
                        "resuming after line {} (offset file {})",
                        source.start_position().line,
                        source.offset_path().display()
                    );
                    broker::Pending::Ready(Box::new(source))
                })
                .map_err(|e| e.to_string())
        }
        None => {
            let input = args.input.as_deref().unwrap_or(Path::new(SAMPLE));
            broker::connect(&url, &args.consume, input).await
        }
    };
    let source = match connected {
        Ok(source) => source,
        Err(error) => {
            db.close().await;
            return Err(error);
        }
    };

    let started = Instant::now();
    let consumed = match &db {
        Db::Postgres(pool) => broker::consume(pool.clone(), source, &args.consume, shutdown).await,
        Db::Sqlite(pool) => broker::consume(pool.clone(), source, &args.consume, shutdown).await,
        Db::MySql(pool) => broker::consume(pool.clone(), source, &args.consume, shutdown).await,
    };
    let elapsed = started.elapsed();
    let (counts, signalled) = match consumed {
        Ok(consumed) => consumed,
        Err(error) => {
            db.close().await;
            return Err(error);
        }
    };
    println!(
        "consumed {} deliveries in {:.2} s ({:.0} deliveries/s)",
        counts.lines,
        elapsed.as_secs_f64(),
        counts.lines as f64 / elapsed.as_secs_f64().max(1e-9)
    );
    let balances = db.balances().await.map_err(|e| e.to_string());
    db.close().await;
    let balances = balances?;
    if let Some(metrics) = &metrics {
        metrics.finish();
    }
    if signalled {
        println!("stopped by a signal: balances not checked");
    }
    let expected = expected
        .as_ref()
        .zip(expected_path.as_deref())
        .filter(|_| !signalled);
    Ok(check_and_summarize(expected, &balances, &counts, false))
}

/// `ledger admin …`: exit status 0, 1 if the command failed, 2 if the database is unusable.
async fn run_admin(args: AdminArgs) -> ExitCode {
    let db = match Db::connect(args.database_url.as_deref()).await {
        Ok((db, _)) => db,
        Err(error) => {
            eprintln!("ledger admin: {error}");
            return ExitCode::from(2);
        }
    };
    let result = match &db {
        Db::Postgres(pool) => inbox_runtime::ops::cli::execute(&args.command, pool).await,
        Db::Sqlite(pool) => inbox_runtime::ops::cli::execute(&args.command, pool).await,
        Db::MySql(pool) => inbox_runtime::ops::cli::execute(&args.command, pool).await,
    };
    db.close().await;
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("ledger admin: {error}");
            ExitCode::from(1)
        }
    }
}

#[tokio::main]
async fn main() -> ExitCode {
    let mut args = Args::parse();
    let result = match (args.command.take(), args.source.take()) {
        (Some(Command::Admin(admin)), _) => return run_admin(admin).await,
        (Some(Command::Console(args)), _) => {
            return match console::run(args).await {
                Ok(()) => ExitCode::SUCCESS,
                Err(error) => {
                    eprintln!("ledger console: {error}");
                    ExitCode::from(2)
                }
            };
        }
        (Some(Command::Publish(publish)), _) => run_publish(publish).await,
        (None, Some(url)) => run_broker(args, url).await,
        (None, None) => run(args).await,
    };
    match result {
        Ok(Verdict::Ok | Verdict::Unchecked) => ExitCode::SUCCESS,
        Ok(Verdict::Mismatch) => ExitCode::from(1),
        Err(error) => {
            eprintln!("ledger: {error}");
            ExitCode::from(2)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A SQLite database file of its own, removed on drop.
    struct TempDb(PathBuf);

    impl TempDb {
        fn new(name: &str) -> Self {
            let nanos = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .unwrap()
                .as_nanos();
            Self(std::env::temp_dir().join(format!(
                "inbox-ledger-{name}-{}-{nanos}.db",
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

    fn input(text: &str) -> Input {
        Box::new(std::io::Cursor::new(text.as_bytes().to_vec()))
    }

    const A: &str = "00000000-0000-4000-8000-00000000000a";

    /// Every kind of line once, then the same stream again.
    #[tokio::test]
    async fn small_stream_twice() {
        let stream = [
                format!(
                    r#"{{"message":"payments.captured","payload":{{"event_id":"{A}","account_id":"acct-1","amount_cents":500}}}}"#
                ),
                r#"{"message":"payments.refunded","payload":{"event_id":"00000000-0000-4000-8000-00000000000b","account_id":"acct-1","amount_cents":200}}"#.into(),
                // The same event as the first line, reordered, spaced, escaped, upper-case id.
                format!(
                    r#" {{ "payload": {{ "amount_cents": 500, "account_id": "acct\u002d1", "event_id": "{}" }}, "message": "payments.captured" }} "#,
                    A.to_uppercase()
                ),
                String::new(),
                // A conflict: same id, other amount.
                format!(
                    r#"{{"message":"payments.captured","payload":{{"event_id":"{A}","account_id":"acct-1","amount_cents":501}}}}"#
                ),
                r#"{"message":"payments.captured","payload":{"event_id":"","account_id":"acct-1","amount_cents":1}}"#.into(),
                r#"{"message":"payments.captured","payload":{"account_id":"acct-1","amount_cents":1}}"#.into(),
                r#"{"message":"payments.voided","payload":{"event_id":"00000000-0000-4000-8000-00000000000c","account_id":"acct-1","amount_cents":1}}"#.into(),
                r#"{"message":"payments.captured","payload":{"event_id":"00000000-0000-4000-8000-00000000000d","#.into(),
            ]
            .join("\n");
        let tmp = TempDb::new("small");
        let (db, _) = Db::connect(Some(&tmp.url())).await.unwrap();
        db.setup().await.unwrap();

        let first = process(&db, input(&stream), "test", None, None)
            .await
            .unwrap();
        let expected = Counts {
            lines: 8,
            processed: 2,
            duplicates: 1,
            conflicts: 1,
            rejected: 4,
            dead: 0,
            discarded: 0,
            failed: 0,
        };
        assert_eq!(first, expected);
        let balances = db.balances().await.unwrap();
        assert_eq!(
            balances.into_iter().collect::<Vec<_>>(),
            [("acct-1".to_owned(), 300)]
        );

        let second = process(&db, input(&stream), "test", None, None)
            .await
            .unwrap();
        assert_eq!(
            second,
            Counts {
                processed: 0,
                duplicates: 3,
                ..expected
            }
        );
        assert_eq!(db.balances().await.unwrap()["acct-1"], 300);
        db.close().await;
    }

    /// A line whose handler fails (here: a CHECK constraint the test adds to the accounts
    /// table, a retryable database error) is counted as failed and recorded `failed` in the
    /// inbox, and the lines after it are processed; a line that is not an envelope is kept in
    /// `inbox_rejections` with its parse error.
    #[tokio::test]
    async fn a_failed_line_does_not_stop_the_stream() {
        const B: &str = "00000000-0000-4000-8000-00000000000b";
        let stream = [
            format!(
                r#"{{"message":"payments.captured","payload":{{"event_id":"{A}","account_id":"acct-1","amount_cents":500}}}}"#
            ),
            format!(
                r#"{{"message":"payments.captured","payload":{{"event_id":"{B}","account_id":"acct-13","amount_cents":100}}}}"#
            ),
            r#"{"message":"payments.captured","payload":{"event_id":"00000000-0000-4000-8000-00000000000c","account_id":"acct-2","amount_cents":200}}"#.into(),
            "not json".to_owned(),
        ]
        .join("\n");
        let tmp = TempDb::new("failed");
        let (db, _) = Db::connect(Some(&tmp.url())).await.unwrap();
        let Db::Sqlite(pool) = &db else {
            unreachable!()
        };
        sqlx::query(
            "CREATE TABLE accounts (id TEXT PRIMARY KEY, balance_cents BIGINT NOT NULL \
             CHECK (id <> 'acct-13'))",
        )
        .execute(pool)
        .await
        .unwrap();
        db.setup().await.unwrap();

        let counts = process(&db, input(&stream), "test", None, None)
            .await
            .unwrap();
        assert_eq!(
            counts,
            Counts {
                lines: 4,
                processed: 2,
                duplicates: 0,
                conflicts: 0,
                rejected: 1,
                dead: 0,
                discarded: 0,
                failed: 1,
            }
        );
        let balances = db.balances().await.unwrap();
        assert_eq!(
            balances.into_iter().collect::<Vec<_>>(),
            [("acct-1".to_owned(), 500), ("acct-2".to_owned(), 200)]
        );
        let row: (String, i64) = sqlx::query_as(
            "SELECT status, attempts FROM inbox_messages WHERE consumer = 'ledger' AND message_key = ?",
        )
        .bind(B)
        .fetch_one(pool)
        .await
        .unwrap();
        assert_eq!(row, ("failed".to_owned(), 1));
        let rejection: (String, String, String, Vec<u8>, i64) = sqlx::query_as(
            "SELECT message_name, reason, detail, payload, source_offset FROM inbox_rejections",
        )
        .fetch_one(pool)
        .await
        .unwrap();
        assert_eq!(
            rejection,
            (
                String::new(),
                "malformed".to_owned(),
                "not a message envelope: expected ident at line 1 column 2".to_owned(),
                b"not json".to_vec(),
                4
            )
        );
        db.close().await;
    }

    /// Events for unknown accounts are dead-lettered; `ledger admin` lists, shows, replays,
    /// discards them, and refuses a purge window below the redelivery horizon.
    #[tokio::test]
    async fn admin_on_dead_letters() {
        use clap::Parser as _;
        use inbox_runtime::ops::cli::{AdminCli, CliError, execute_to};

        const K1: &str = "7b0e4c1a-93d2-4f0e-8a51-0c6f2d9e4a11";
        const K2: &str = "c2a9f7d4-15be-4b8c-9e3f-7d1a6b0c5e22";
        let unknown = std::fs::read_to_string(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/ledger/data/unknown-accounts.jsonl"
        ))
        .unwrap();
        let stream = format!(
            r#"{{"message":"payments.captured","payload":{{"event_id":"{A}","account_id":"acct-1","amount_cents":500}}}}"#
        ) + "\n"
            + &unknown;
        let tmp = TempDb::new("admin");
        let (db, _) = Db::connect(Some(&tmp.url())).await.unwrap();
        db.setup().await.unwrap();
        let counts = process(&db, input(&stream), "test", None, None)
            .await
            .unwrap();
        assert_eq!((counts.processed, counts.dead), (1, 3));
        let Db::Sqlite(pool) = &db else {
            unreachable!()
        };
        let admin = |args: &str| {
            let cli =
                AdminCli::try_parse_from(std::iter::once("admin").chain(args.split_whitespace()))
                    .unwrap();
            async move {
                let mut out = Vec::new();
                let result = execute_to(&cli.command, pool, &mut out).await;
                (result, String::from_utf8(out).unwrap())
            }
        };

        let (result, stats) = admin("stats").await;
        result.unwrap();
        let row = stats.lines().find(|l| l.starts_with("ledger ")).unwrap();
        let cells: Vec<&str> = row.split_whitespace().collect();
        // consumer, processed, failed, dead, parked, discarded, conflicts seen
        assert_eq!(
            cells[..7],
            ["ledger", "1", "0", "2", "0", "0", "0"],
            "{stats}"
        );

        let (result, list) = admin("dead list").await;
        result.unwrap();
        assert_eq!(list.lines().count(), 3, "{list}");
        assert!(list.contains(K1) && list.contains(K2), "{list}");
        assert!(
            list.contains("`acct-unknown` is not a ledger account"),
            "{list}"
        );

        let (result, shown) = admin(&format!("dead show ledger {K1}")).await;
        result.unwrap();
        assert!(shown.contains("status:       dead"), "{shown}");
        assert!(
            shown.contains("  \"account_id\": \"acct-unknown\","),
            "{shown}"
        );

        // Still an unknown account: the replay runs the handler once more and fails again.
        let (result, replayed) = admin("dead replay --all --consumer ledger").await;
        assert!(
            matches!(
                result,
                Err(CliError::ReplayFailed {
                    failed: 2,
                    total: 2
                })
            ),
            "{result:?}"
        );
        assert!(replayed.contains("attempt 2, dead-lettered"), "{replayed}");

        let (result, _) = admin(&format!("dead discard ledger {K2}")).await;
        result.unwrap();
        let (result, list) = admin("dead list --status dead").await;
        result.unwrap();
        assert!(list.contains(K1) && !list.contains(K2), "{list}");
        // Redelivered: K1 (two lines) is still dead, K2 is discarded, and counted as such.
        let again = process(&db, input(&unknown), "test", None, None)
            .await
            .unwrap();
        assert_eq!(
            (again.processed, again.dead, again.discarded),
            (0, 2, 1),
            "{again:?}"
        );
        // A consumer that does not exist is refused, naming the ones that do.
        let (result, replayed) = admin("dead replay --all --consumer nobody").await;
        assert_eq!(
            result.unwrap_err().to_string(),
            "unknown consumer `nobody`; known consumers: ledger"
        );
        assert_eq!(replayed, "");

        let (result, _) = admin("purge --window 1d --redelivery-horizon 3d").await;
        let error = result.unwrap_err();
        assert!(matches!(error, CliError::Retention(_)), "{error:?}");
        assert!(
            error
                .to_string()
                .contains("retention window of 1d is shorter than the redelivery horizon of 3d"),
            "{error}"
        );
        let (result, purged) =
            admin("purge --window 7d --redelivery-horizon 3d --include-rejections").await;
        result.unwrap();
        assert_eq!(
            purged,
            "purged 0 inbox rows older than 7d\n\
             purged 0 rejected deliveries older than 7d\n\
             2 statements of at most 1000 rows each\n"
        );

        assert_eq!(db.balances().await.unwrap()["acct-1"], 500);
        db.close().await;
    }

    /// Feeds the bundled sample twice into `db` and checks both runs against `expected.json`.
    async fn sample_twice(db: &Db) {
        let expected = Expected::load(SAMPLE_EXPECTED.as_ref()).unwrap();
        let sample = || async {
            let file = tokio::fs::File::open(SAMPLE).await.unwrap();
            Box::new(BufReader::new(file)) as Input
        };
        db.setup().await.unwrap();
        assert!(db.balances().await.unwrap().is_empty());

        let first = process(db, sample().await, "sample", None, None)
            .await
            .unwrap();
        assert_eq!(expected.count_mismatches(&first), Vec::<String>::new());
        let balances = db.balances().await.unwrap();
        assert_eq!(expected.balance_mismatches(&balances), Vec::<String>::new());

        let second = process(db, sample().await, "sample", None, None)
            .await
            .unwrap();
        assert_eq!(
            second,
            Counts {
                processed: 0,
                duplicates: first.processed + first.duplicates,
                ..first
            }
        );
        assert_eq!(db.balances().await.unwrap(), balances);
    }

    /// The whole sample on SQLite, twice: the demo's own acceptance check.
    #[tokio::test]
    async fn sample_on_sqlite() {
        let tmp = TempDb::new("sample");
        let (db, _) = Db::connect(Some(&tmp.url())).await.unwrap();
        sample_twice(&db).await;
        db.close().await;
    }

    /// The whole sample on PostgreSQL, twice, if `DATABASE_URL` names one (`scripts/test.sh`),
    /// in a schema of its own that is dropped afterwards.
    #[tokio::test]
    async fn sample_on_postgres() {
        let url = match std::env::var("DATABASE_URL") {
            Ok(url) if url.starts_with("postgres://") || url.starts_with("postgresql://") => url,
            _ => {
                eprintln!("sample_on_postgres: skipped, DATABASE_URL names no PostgreSQL");
                return;
            }
        };
        let schema = format!("ledger_test_{}", std::process::id());
        let admin = sqlx::PgPool::connect(&url).await.unwrap();
        sqlx::query(sqlx::AssertSqlSafe(format!(
            "DROP SCHEMA IF EXISTS {schema} CASCADE"
        )))
        .execute(&admin)
        .await
        .unwrap();
        sqlx::query(sqlx::AssertSqlSafe(format!("CREATE SCHEMA {schema}")))
            .execute(&admin)
            .await
            .unwrap();
        // The test needs no durability: spare PostgreSQL a WAL flush per transaction.
        let separator = if url.contains('?') { '&' } else { '?' };
        let test_url = format!(
            "{url}{separator}options[search_path]={schema}&options[synchronous_commit]=off"
        );
        let (db, _) = Db::connect(Some(&test_url)).await.unwrap();
        sample_twice(&db).await;
        db.close().await;
        sqlx::query(sqlx::AssertSqlSafe(format!("DROP SCHEMA {schema} CASCADE")))
            .execute(&admin)
            .await
            .unwrap();
        admin.close().await;
    }
}
