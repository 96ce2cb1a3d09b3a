//! What the broker tests share: the ledger and pipeline demo binaries, fresh PostgreSQL databases,
//! the sample's ground truth, child processes that are killed at random moments, RabbitMQ's
//! control tool.
//!
//! Nothing is left behind: every demo process is a [`ChildGuard`] (killed and reaped when it
//! drops, also while a failed test unwinds), and the demo's copy, its logs and offsets live in
//! [`inbox_tests::scratch_dir`], removed when the test process exits.

#![allow(dead_code, unreachable_pub)]

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::process::{Command, ExitStatus, Stdio};
use std::str::FromStr as _;
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use sqlx::Connection as _;
use sqlx::postgres::PgConnectOptions;

pub use inbox_tests::{ChildGuard, scratch_dir};

/// The workspace root.
pub fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .unwrap()
        .to_owned()
}

/// The bundled sample stream.
pub fn sample() -> PathBuf {
    root().join("examples/ledger/data/payments.jsonl")
}

/// The `ledger` example, built once per test binary (a no-op when `cargo test --workspace
/// --all-targets` built it already) and copied to the [`scratch_dir`].
pub fn ledger_bin() -> &'static Path {
    static BIN: OnceLock<PathBuf> = OnceLock::new();
    BIN.get_or_init(|| build_example("ledger"))
}

/// The `ledger` example with the examples feature `kafka` (its Kafka source and publisher), built
/// and copied as [`ledger_bin`] is, as `ledger-kafka`.
pub fn ledger_kafka_bin() -> &'static Path {
    static BIN: OnceLock<PathBuf> = OnceLock::new();
    BIN.get_or_init(|| {
        build_example_with(
            "ledger",
            &["--features", "inbox-examples/kafka"],
            "ledger-kafka",
        )
    })
}

/// The `ledger` example with the examples feature `sqs` (its SQS source and publisher), built
/// and copied as [`ledger_bin`] is, as `ledger-sqs`.
pub fn ledger_sqs_bin() -> &'static Path {
    static BIN: OnceLock<PathBuf> = OnceLock::new();
    BIN.get_or_init(|| {
        build_example_with(
            "ledger",
            &["--features", "inbox-examples/sqs"],
            "ledger-sqs",
        )
    })
}

/// The `ledger` example with the examples feature `dynamodb` (its `--store dynamodb://TABLE`),
/// built and copied as [`ledger_bin`] is, as `ledger-dynamodb`.
pub fn ledger_dynamodb_bin() -> &'static Path {
    static BIN: OnceLock<PathBuf> = OnceLock::new();
    BIN.get_or_init(|| {
        build_example_with(
            "ledger",
            &["--features", "inbox-examples/dynamodb"],
            "ledger-dynamodb",
        )
    })
}

/// The `pipeline` example, built and copied as [`ledger_bin`] is.
pub fn pipeline_bin() -> &'static Path {
    static BIN: OnceLock<PathBuf> = OnceLock::new();
    BIN.get_or_init(|| build_example("pipeline"))
}

/// The `payments` example (the HTTP API with `Idempotency-Key`), as [`ledger_bin`].
pub fn payments_bin() -> &'static Path {
    static BIN: OnceLock<PathBuf> = OnceLock::new();
    BIN.get_or_init(|| build_example("payments"))
}

/// Builds the example `name` and copies it to the [`scratch_dir`]; its path there.
fn build_example(name: &str) -> PathBuf {
    build_example_with(name, &[], name)
}

/// Builds the example `name` with the cargo arguments `extra` (features) and copies it to the
/// [`scratch_dir`] as `copy_name`; its path there.
///
/// When `INBOX_TEST_EXAMPLES_DIR` names a directory holding `copy_name` (scripts/test.sh builds
/// the demos once, before the tests, and puts them there), that file is copied and cargo is not
/// run: the tests never wait for the build directory's lock (held meanwhile by the lints CI runs
/// beside the tests). A directory without `copy_name` falls back to building it.
fn build_example_with(name: &str, extra: &[&str], copy_name: &str) -> PathBuf {
    let copy = scratch_dir().join(copy_name);
    if let Some(dir) = std::env::var_os("INBOX_TEST_EXAMPLES_DIR") {
        let prebuilt = Path::new(&dir).join(copy_name);
        if prebuilt.is_file() {
            // Still a copy of this process's own: some tests delete theirs when done.
            std::fs::copy(&prebuilt, &copy)
                .unwrap_or_else(|e| panic!("copy the prebuilt {copy_name}: {e}"));
            return copy;
        }
    }
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let mut command = Command::new(cargo);
    // Not the variables cargo set for this test: build scripts that watch one of them (ring
    // watches CARGO_MANIFEST_DIR) would run again and rebuild half the dependency tree.
    for (variable, _) in std::env::vars_os() {
        let variable = variable.to_string_lossy();
        if variable.starts_with("CARGO_PKG_")
            || [
                "CARGO_MANIFEST_DIR",
                "CARGO_MANIFEST_PATH",
                "CARGO_CRATE_NAME",
                "CARGO_BIN_NAME",
                "CARGO_PRIMARY_PACKAGE",
                "CARGO_TARGET_TMPDIR",
                "CARGO_RUSTC_CURRENT_DIR",
                "OUT_DIR",
            ]
            .contains(&&*variable)
        {
            command.env_remove(&*variable);
        }
    }
    let output = command
        .current_dir(root())
        // `--workspace`: the same feature resolution as `cargo test --workspace`, so that
        // after scripts/test.sh's build this is a no-op rather than a rebuild.
        .args([
            "build",
            "--workspace",
            "--example",
            name,
            "--message-format=json-render-diagnostics",
        ])
        .args(extra)
        .stderr(Stdio::inherit())
        .output()
        .expect("run cargo build");
    assert!(
        output.status.success(),
        "cargo build --example {name} failed"
    );
    let stdout = String::from_utf8(output.stdout).unwrap();
    let built = stdout
        .lines()
        .filter_map(|line| serde_json::from_str::<serde_json::Value>(line).ok())
        .filter(|message| message["target"]["name"] == name)
        .find_map(|message| message["executable"].as_str().map(PathBuf::from))
        .unwrap_or_else(|| panic!("cargo reported the {name} executable"));
    // A private copy: the target directory may be shared with other checkouts, whose builds
    // of the same example would replace it under the running tests.
    std::fs::copy(&built, &copy).unwrap_or_else(|e| panic!("copy the {name} executable: {e}"));
    copy
}

/// `scripts/brokers.sh rabbitmqctl ARGS` against the test node; panics unless it succeeds.
/// Returns its stdout.
pub fn rabbitmqctl(args: &[&str]) -> String {
    let mut command = Command::new(root().join("scripts/brokers.sh"));
    // The node of the broker the tests use: brokers.sh names it by INBOX_AMQP_PORT; without
    // that variable, by AMQP_URL's port (never a default that may be another checkout's node).
    if std::env::var_os("INBOX_AMQP_PORT").is_none() {
        let url = env("AMQP_URL");
        let port = url
            .rsplit_once(':')
            .and_then(|(_, rest)| rest.split('/').next())
            .filter(|port| port.parse::<u16>().is_ok())
            .unwrap_or_else(|| panic!("no port in AMQP_URL {url}"));
        command.env("INBOX_AMQP_PORT", port);
    }
    let output = command.arg("rabbitmqctl").args(args).output().unwrap();
    assert!(
        output.status.success(),
        "rabbitmqctl {args:?}: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    String::from_utf8(output.stdout).unwrap()
}

/// Restarts RabbitMQ's application on the test node (`rabbitmqctl stop_app`, `start_app`,
/// `await_startup`): every client connection is cut, durable queues and persistent messages are
/// kept, and the port is closed until it is back. Returns how long it was down.
pub fn restart_rabbitmq() -> Duration {
    let started = Instant::now();
    rabbitmqctl(&["-q", "stop_app"]);
    rabbitmqctl(&["-q", "start_app"]);
    rabbitmqctl(&["-q", "await_startup", "--timeout", "120"]);
    started.elapsed()
}

/// An environment variable that `scripts/test.sh` sets; panics with how to get it.
pub fn env(name: &str) -> String {
    std::env::var(name).unwrap_or_else(|_| {
        panic!("{name} is not set: run the tests with scripts/test.sh, which starts the brokers")
    })
}

/// A unique name for this process and purpose.
pub fn unique(prefix: &str) -> String {
    format!("{prefix}_{}", std::process::id())
}

/// A fresh PostgreSQL database named `name`; returns its URL (without durability of commits:
/// the tests kill consumers, not the database server).
pub async fn fresh_database(name: &str) -> String {
    let url = inbox_tests::database_url();
    let options = PgConnectOptions::from_str(&url).unwrap();
    let mut admin = sqlx::PgConnection::connect_with(&options).await.unwrap();
    for statement in [
        format!("DROP DATABASE IF EXISTS {name} WITH (FORCE)"),
        format!("CREATE DATABASE {name}"),
    ] {
        sqlx::raw_sql(sqlx::AssertSqlSafe(statement))
            .execute(&mut admin)
            .await
            .unwrap();
    }
    admin.close().await.ok();
    let base = url.rsplit_once('/').unwrap().0;
    format!("{base}/{name}?options[synchronous_commit]=off")
}

/// The sample's ground truth (`expected.json`).
#[derive(Debug, serde::Deserialize)]
pub struct Expected {
    pub lines: u64,
    pub processed: u64,
    pub duplicates: u64,
    pub conflicts: u64,
    pub rejected: u64,
    pub balances: BTreeMap<String, i64>,
}

pub fn expected() -> Expected {
    let text = std::fs::read_to_string(root().join("examples/ledger/data/expected.json")).unwrap();
    serde_json::from_str(&text).unwrap()
}

/// The event id (inbox key form) of every line of the sample that has one, by line number
/// (1-based, blank lines not counted).
pub fn sample_event_ids() -> BTreeMap<u64, String> {
    let text = std::fs::read_to_string(sample()).unwrap();
    text.lines()
        .filter(|line| !line.trim().is_empty())
        .enumerate()
        .filter_map(|(index, line)| {
            let value: serde_json::Value = serde_json::from_str(line).ok()?;
            let id = uuid::Uuid::parse_str(value["payload"]["event_id"].as_str()?).ok()?;
            Some((index as u64 + 1, id.hyphenated().to_string()))
        })
        .collect()
}

/// What the database holds after a run.
#[derive(Debug)]
pub struct DbState {
    pub balances: BTreeMap<String, i64>,
    /// Keys of the `ledger` consumer's inbox rows with status `processed`.
    pub processed_keys: BTreeSet<String>,
    /// The stored fingerprint (hex) of each processed key: which variant of the event applied.
    pub processed_fingerprints: BTreeMap<String, String>,
    /// Inbox rows of the `ledger` consumer, any status.
    pub inbox_rows: u64,
}

pub async fn db_state(url: &str) -> DbState {
    let mut conn = sqlx::PgConnection::connect(url).await.unwrap();
    let balances: Vec<(String, i64)> =
        sqlx::query_as("SELECT id, balance_cents FROM accounts ORDER BY id")
            .fetch_all(&mut conn)
            .await
            .unwrap();
    let processed: Vec<(String, String)> = sqlx::query_as(
        "SELECT message_key, encode(payload_hash, 'hex') FROM inbox_messages \
         WHERE consumer = 'ledger' AND status = 'processed'",
    )
    .fetch_all(&mut conn)
    .await
    .unwrap();
    let rows: i64 =
        sqlx::query_scalar("SELECT count(*) FROM inbox_messages WHERE consumer = 'ledger'")
            .fetch_one(&mut conn)
            .await
            .unwrap();
    conn.close().await.ok();
    DbState {
        balances: balances.into_iter().collect(),
        processed_keys: processed.iter().map(|(key, _)| key.clone()).collect(),
        processed_fingerprints: processed.into_iter().collect(),
        inbox_rows: rows as u64,
    }
}

/// One applicable line of the sample: its event id (inbox key form), the fingerprint the inbox
/// stores when this variant is applied, its account and signed amount.
struct Variant {
    key: String,
    fingerprint: String,
    account: String,
    signed_cents: i64,
}

/// Every line of the sample that decodes as a ledger message, in stream order (redeliveries,
/// reformatted copies and conflicting variants included).
fn sample_variants() -> Vec<Variant> {
    #[derive(serde::Serialize, serde::Deserialize)]
    struct Payment {
        event_id: uuid::Uuid,
        account_id: String,
        amount_cents: i64,
    }
    let text = std::fs::read_to_string(sample()).unwrap();
    text.lines()
        .filter_map(|line| {
            let value: serde_json::Value = serde_json::from_str(line).ok()?;
            let name = value["message"].as_str()?;
            let sign = match name {
                "payments.captured" => 1,
                "payments.refunded" => -1,
                _ => return None,
            };
            let payment: Payment = serde_json::from_value(value["payload"].clone()).ok()?;
            let fingerprint = inbox_runtime::Fingerprint::of(name, &payment).ok()?;
            Some(Variant {
                key: payment.event_id.hyphenated().to_string(),
                fingerprint: fingerprint.to_hex(),
                account: payment.account_id,
                signed_cents: sign * payment.amount_cents,
            })
        })
        .collect()
}

/// Balances exact, every valid event applied exactly once (one processed inbox row each).
///
/// The balances are checked against the variants the inbox applied: when a conflicting variant
/// of an event (same event id, another amount) races its original — a redelivery after a
/// SIGKILL can bring the original back after the variant — either may be the one applied,
/// and the other must then be refused as a conflict. So each processed key's stored fingerprint
/// names the variant that was applied; the balances must be the sum of exactly those variants,
/// each once. When every event's first variant won (no race), they are also `expected.json`'s.
pub fn assert_ledger_exact(state: &DbState) {
    let expected = expected();
    assert_eq!(
        state.processed_keys.len() as u64,
        expected.processed,
        "processed events"
    );
    assert_eq!(state.inbox_rows, expected.processed, "inbox rows");
    let valid: BTreeSet<String> = sample_event_ids().into_values().collect();
    assert!(
        state.processed_keys.is_subset(&valid),
        "only the sample's events are applied"
    );

    let mut applied: BTreeMap<String, i64> = BTreeMap::new();
    let mut first_seen: BTreeSet<&str> = BTreeSet::new();
    let mut matched: BTreeSet<&str> = BTreeSet::new();
    let mut later_variant_won = 0;
    let variants = sample_variants();
    for variant in &variants {
        let first = first_seen.insert(variant.key.as_str());
        let Some(stored) = state.processed_fingerprints.get(&variant.key) else {
            continue;
        };
        if *stored != variant.fingerprint || !matched.insert(variant.key.as_str()) {
            continue; // another variant applied, or this one counted already
        }
        if !first {
            later_variant_won += 1;
        }
        *applied.entry(variant.account.clone()).or_default() += variant.signed_cents;
    }
    assert_eq!(
        matched.len(),
        state.processed_keys.len(),
        "every processed key's stored fingerprint is one of the sample's variants of that event"
    );
    let balances: BTreeMap<String, i64> = state
        .balances
        .iter()
        .filter(|(_, cents)| **cents != 0)
        .map(|(account, cents)| (account.clone(), *cents))
        .collect();
    applied.retain(|_, cents| *cents != 0);
    assert_eq!(
        balances, applied,
        "balances = the applied variants, each once"
    );
    if later_variant_won == 0 {
        assert_eq!(state.balances, expected.balances, "balances");
    } else {
        eprintln!(
            "ledger: {later_variant_won} conflicting variant(s) won the race with their original"
        );
    }
}

/// Runs `ledger ARGS` to completion; panics unless it exits 0. Returns its stdout.
pub fn run_ledger(args: &[&str], database_url: &str, log: &Path) -> String {
    run_program(ledger_bin(), args, database_url, log)
}

/// [`run_ledger`] with the program `bin` (a build of the ledger).
pub fn run_program(bin: &Path, args: &[&str], database_url: &str, log: &Path) -> String {
    let child = spawn_program(bin, args, database_url, log);
    let (status, stdout) = wait_ledger(child, log, Duration::from_secs(120));
    assert!(status.success(), "ledger {args:?}: {status}\n{}", tail(log));
    stdout
}

/// Starts `ledger ARGS` with stdout to `<log>.out` and stderr to `log`; killed when dropped.
pub fn spawn_ledger(args: &[&str], database_url: &str, log: &Path) -> ChildGuard {
    spawn_program(ledger_bin(), args, database_url, log)
}

/// [`spawn_ledger`] with the program `bin` (a build of the ledger).
pub fn spawn_program(bin: &Path, args: &[&str], database_url: &str, log: &Path) -> ChildGuard {
    let stderr = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(log)
        .unwrap();
    let stdout = std::fs::File::create(log.with_extension("out")).unwrap();
    let child = Command::new(bin)
        .args(args)
        .env("DATABASE_URL", database_url)
        .env("RUST_LOG", "warn")
        .stdin(Stdio::null())
        .stdout(stdout)
        .stderr(stderr)
        .spawn()
        .expect("start the ledger");
    ChildGuard::new(child)
}

/// Waits for `child` (at most `timeout`, then kills it — SIGKILL, whatever signal it was sent
/// before — and panics); its exit status and stdout.
pub fn wait_ledger(mut child: ChildGuard, log: &Path, timeout: Duration) -> (ExitStatus, String) {
    let deadline = Instant::now() + timeout;
    loop {
        if let Some(status) = child.try_wait().unwrap() {
            let stdout = std::fs::read_to_string(log.with_extension("out")).unwrap();
            return (status, stdout);
        }
        if Instant::now() > deadline {
            drop(child); // SIGKILL, and reaped
            panic!("ledger did not exit within {timeout:?}\n{}", tail(log));
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// The last lines of a log file, for failure messages.
pub fn tail(log: &Path) -> String {
    let text = std::fs::read_to_string(log).unwrap_or_default();
    let out = std::fs::read_to_string(log.with_extension("out")).unwrap_or_default();
    let last = |t: &str| {
        t.lines()
            .rev()
            .take(15)
            .collect::<Vec<_>>()
            .into_iter()
            .rev()
            .collect::<Vec<_>>()
            .join("\n")
    };
    format!(
        "--- stdout ---\n{}\n--- stderr ---\n{}",
        last(&out),
        last(&text)
    )
}

/// The summary line's fields.
pub fn summary(stdout: &str) -> BTreeMap<String, String> {
    let line = stdout
        .lines()
        .rev()
        .find(|line| line.starts_with("summary: "))
        .unwrap_or_else(|| panic!("no summary line in\n{stdout}"));
    line["summary: ".len()..]
        .split_whitespace()
        .filter_map(|field| field.split_once('='))
        .map(|(k, v)| (k.to_owned(), v.to_owned()))
        .collect()
}

/// Sends SIGTERM to `child`.
pub fn sigterm(child: &std::process::Child) {
    let status = Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status()
        .unwrap();
    assert!(status.success());
}

/// Starts the consumer, SIGKILLs it a random 100-800 ms (seeded) after it started consuming, `kills` times, each time
/// checking it was still running; then runs it to completion. Returns the last run's stdout.
pub fn kill_and_restart(
    args: &[&str],
    database_url: &str,
    log: &Path,
    kills: usize,
    seed: u64,
) -> String {
    use rand::{Rng as _, SeedableRng as _};
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
    for kill in 0..kills {
        let mut child = spawn_ledger(args, database_url, log);
        wait_for_handlers(log);
        let delay = Duration::from_millis(rng.random_range(100..800));
        std::thread::sleep(delay);
        assert!(
            child.try_wait().unwrap().is_none(),
            "kill {kill}: the consumer exited before its SIGKILL at {delay:?}\n{}",
            tail(log)
        );
        child.kill().unwrap(); // SIGKILL
        let status = child.wait().unwrap();
        assert_eq!(
            std::os::unix::process::ExitStatusExt::signal(&status),
            Some(9),
            "kill {kill}"
        );
    }
    run_ledger(args, database_url, log)
}

/// A log file in the [`scratch_dir`] for this test.
pub fn log_file(name: &str) -> PathBuf {
    let path = scratch_dir().join(format!("{}.log", unique(name)));
    let _ = std::fs::remove_file(&path);
    path
}

/// Waits until the consumer has printed its handlers (it is about to consume).
pub fn wait_for_handlers(log: &Path) {
    let deadline = Instant::now() + Duration::from_secs(30);
    while !std::fs::read_to_string(log.with_extension("out"))
        .unwrap_or_default()
        .contains("handler:")
    {
        assert!(
            Instant::now() < deadline,
            "the consumer did not start\n{}",
            tail(log)
        );
        std::thread::sleep(Duration::from_millis(10));
    }
}
