//! The ledger demo on DynamoDB (`ledger --store dynamodb://TABLE`, examples feature `dynamodb`)
//! against moto's serial DynamoDB on loopback (`DYNAMODB_ENDPOINT`, started by scripts/sqs.sh),
//! run as a user runs it:
//!
//! * a stream cut from the bundled sample (its first lines, every malformed line, every line of
//!   the events that have a conflicting variant) prints the same lines as the SQLite run of the
//!   same stream — the check line and the summary word for word — and the same balances; a second
//!   run applies nothing (`processed=0`) and changes no balance; its DynamoDB calls are 2 per
//!   applied event, 1 per duplicate and 2 per conflict (the read, the kept rejection);
//! * a SIGKILL drill: the demo is killed 3 times, each once the inbox table holds a known number
//!   of claims, and run again each time over the same stream; the last run goes to the end.
//!   Every account's balance is then the once-applied total and every event id has exactly one
//!   inbox item, `processed`.
//!
//! Not the whole sample: moto's `TransactWriteItems` copies each table it touches (for its
//! rollback), so a transaction costs time in proportion to the inbox table's size, and the
//! sample's 26,000 claims would take hours there. The cut keeps every kind of line.
//!
//! Each test has tables of its own (a fresh name), deleted at the end.

#![allow(missing_docs)]

#[path = "ledger_support.rs"]
mod support;

use inbox_tests::dynamo::endpoint;
use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::process::{Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use inbox_runtime::dynamodb::sdk::types::{AttributeValue, Select};
use inbox_runtime::dynamodb::{self, sdk::Client};
use sqlx::Connection as _;
use support::{ChildGuard, ledger_dynamodb_bin, sample, tail, wait_ledger};

/// The first lines of the sample in the cut stream.
const HEAD_LINES: usize = 100;
/// The first lines of the sample in the drill's stream.
const DRILL_HEAD_LINES: usize = 150;

/// A payment as the demo decodes it (field order as the demo's messages, for the fingerprint).
#[derive(serde::Serialize, serde::Deserialize)]
struct Payment {
    event_id: uuid::Uuid,
    account_id: String,
    amount_cents: i64,
}

/// One line's meaning: not a message, or a payment with its key and fingerprint.
enum Parsed {
    Rejected,
    Payment {
        key: String,
        fingerprint: String,
        account: String,
        signed_cents: i64,
    },
}

fn parse(line: &str) -> Parsed {
    let Ok(value) = serde_json::from_str::<serde_json::Value>(line) else {
        return Parsed::Rejected;
    };
    let name = value["message"].as_str().unwrap_or_default();
    let sign = match name {
        "payments.captured" => 1,
        "payments.refunded" => -1,
        _ => return Parsed::Rejected,
    };
    let Ok(payment) = serde_json::from_value::<Payment>(value["payload"].clone()) else {
        return Parsed::Rejected;
    };
    Parsed::Payment {
        key: payment.event_id.hyphenated().to_string(),
        fingerprint: inbox_runtime::Fingerprint::of(name, &payment)
            .unwrap()
            .to_hex(),
        account: payment.account_id,
        signed_cents: sign * payment.amount_cents,
    }
}

/// The ground truth of a stream, in the form of the demo's `--expected` file.
#[derive(Debug, Default, serde::Serialize)]
struct Truth {
    processed: u64,
    duplicates: u64,
    conflicts: u64,
    rejected: u64,
    balances: BTreeMap<String, i64>,
    /// Not in the file: the event ids applied.
    #[serde(skip)]
    keys: BTreeSet<String>,
}

fn truth(lines: &[String]) -> Truth {
    let mut truth = Truth::default();
    let mut first: BTreeMap<String, String> = BTreeMap::new();
    for line in lines {
        match parse(line) {
            Parsed::Rejected => truth.rejected += 1,
            Parsed::Payment {
                key,
                fingerprint,
                account,
                signed_cents,
            } => match first.get(&key) {
                None => {
                    truth.processed += 1;
                    *truth.balances.entry(account).or_default() += signed_cents;
                    truth.keys.insert(key.clone());
                    first.insert(key, fingerprint);
                }
                Some(stored) if *stored == fingerprint => truth.duplicates += 1,
                Some(_) => truth.conflicts += 1,
            },
        }
    }
    truth
}

/// The sample's first `head` lines, every line that is not a message, and every line of the
/// events that have a conflicting variant, in the sample's order.
fn cut(head: usize) -> Vec<String> {
    let text = std::fs::read_to_string(sample()).unwrap();
    let lines: Vec<&str> = text.lines().filter(|l| !l.trim().is_empty()).collect();
    let mut fingerprints: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for line in &lines {
        if let Parsed::Payment {
            key, fingerprint, ..
        } = parse(line)
        {
            fingerprints.entry(key).or_default().insert(fingerprint);
        }
    }
    lines
        .iter()
        .enumerate()
        .filter(|(index, line)| {
            *index < head
                || match parse(line) {
                    Parsed::Rejected => true,
                    Parsed::Payment { key, .. } => fingerprints[&key].len() > 1,
                }
        })
        .map(|(_, line)| (*line).to_owned())
        .collect()
}

/// A stream and its truth, written to `dir` as `NAME.jsonl` and `NAME.expected.json`.
fn write_stream(dir: &Path, name: &str, lines: &[String]) -> (PathBuf, PathBuf, Truth) {
    let truth = truth(lines);
    let input = dir.join(format!("{name}.jsonl"));
    std::fs::write(&input, lines.join("\n") + "\n").unwrap();
    let expected = dir.join(format!("{name}.expected.json"));
    std::fs::write(&expected, serde_json::to_string_pretty(&truth).unwrap()).unwrap();
    (input, expected, truth)
}

/// Starts the DynamoDB ledger with `args` (stdout to `<log>.out`, stderr to `log`), its
/// endpoint the test server's.
fn spawn(args: &[&str], log: &Path) -> ChildGuard {
    let stderr = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(log)
        .unwrap();
    let stdout = std::fs::File::create(log.with_extension("out")).unwrap();
    let child = Command::new(ledger_dynamodb_bin())
        .args(args)
        .env_remove("DATABASE_URL")
        .env("AWS_ENDPOINT_URL", endpoint())
        .env("AWS_ENDPOINT_URL_DYNAMODB", endpoint())
        .env("RUST_LOG", "warn")
        .stdin(Stdio::null())
        .stdout(stdout)
        .stderr(stderr)
        .spawn()
        .expect("start the ledger");
    ChildGuard::new(child)
}

/// Runs the ledger with `args` (on the database or store `url`) to its end: exit status,
/// stdout.
fn run(args: &[&str], url: &str, log: &Path) -> (ExitStatus, String) {
    let mut all = args.to_vec();
    all.extend(["--store", url]);
    let child = spawn(&all, log);
    wait_ledger(child, log, Duration::from_secs(300))
}

/// The lines both backends print alike: all but the database's description, the timing, the
/// DynamoDB notes and call counts; the handlers with the backend's name taken out.
fn comparable(stdout: &str) -> Vec<String> {
    stdout
        .lines()
        .filter(|l| {
            !["database: ", "read ", "not on dynamodb yet: ", "dynamodb: "]
                .iter()
                .any(|prefix| l.starts_with(prefix))
        })
        .map(|l| {
            l.replace("_sqlite, sqlite)", "_BACKEND")
                .replace("_dynamodb, dynamodb)", "_BACKEND")
        })
        .collect()
}

/// The `dynamodb: N calls …` line's N.
fn calls(stdout: &str) -> u64 {
    stdout
        .lines()
        .find_map(|l| l.strip_prefix("dynamodb: "))
        .and_then(|rest| rest.split_whitespace().next())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("no `dynamodb: N calls` line in\n{stdout}"))
}

fn last_line(stdout: &str) -> &str {
    stdout.lines().last().unwrap_or_default()
}

/// The two tables of `dynamodb://TABLE`, deleted when dropped.
struct Tables {
    client: Client,
    inbox: String,
    accounts: String,
}

impl Tables {
    async fn new(prefix: &str) -> Self {
        let inbox = format!("{prefix}_{}", uuid::Uuid::new_v4().simple());
        Self {
            client: dynamodb::client(Some(&endpoint())).await,
            accounts: format!("{inbox}-accounts"),
            inbox,
        }
    }

    fn url(&self) -> String {
        format!("dynamodb://{}", self.inbox)
    }

    /// Every item of `table` (consistent reads).
    async fn scan(&self, table: &str) -> Vec<std::collections::HashMap<String, AttributeValue>> {
        let mut pages = self
            .client
            .scan()
            .table_name(table)
            .consistent_read(true)
            .into_paginator()
            .items()
            .send();
        let mut items = Vec::new();
        while let Some(item) = pages.next().await {
            items.push(item.unwrap());
        }
        items
    }

    /// Items in the inbox table (a consistent `Scan` with `Select=COUNT`); 0 while the demo has
    /// not created it yet.
    async fn claims(&self) -> u64 {
        let mut count = 0;
        let mut start = None;
        loop {
            let page = self
                .client
                .scan()
                .table_name(&self.inbox)
                .consistent_read(true)
                .select(Select::Count)
                // Claims only: the kept rejections (`rejection#…`) left out.
                .filter_expression("attribute_not_exists(rejection)")
                .set_exclusive_start_key(start)
                .send()
                .await;
            let page = match page {
                Err(e)
                    if e.as_service_error()
                        .is_some_and(|e| e.is_resource_not_found_exception()) =>
                {
                    return 0;
                }
                page => page.unwrap(),
            };
            count += page.count() as u64;
            start = page.last_evaluated_key;
            if start.is_none() {
                return count;
            }
        }
    }

    async fn balances(&self) -> BTreeMap<String, i64> {
        self.scan(&self.accounts)
            .await
            .into_iter()
            .map(|item| {
                let (Some(AttributeValue::S(id)), Some(AttributeValue::N(n))) =
                    (item.get("id"), item.get("balance_cents"))
                else {
                    panic!("account item {item:?}")
                };
                (id.clone(), n.parse().unwrap())
            })
            .collect()
    }

    /// The inbox items' `(message_key, status)` (the kept rejections, `rejection#…`, left out).
    async fn inbox_items(&self) -> Vec<(String, String)> {
        self.scan(&self.inbox)
            .await
            .into_iter()
            .filter(|item| {
                !matches!(item.get("pk"), Some(AttributeValue::S(pk)) if pk.starts_with("rejection#"))
            })
            .map(|item| {
                let (Some(AttributeValue::S(key)), Some(AttributeValue::S(status))) =
                    (item.get("message_key"), item.get("status"))
                else {
                    panic!("inbox item {item:?}")
                };
                (key.clone(), status.clone())
            })
            .collect()
    }
}

impl Drop for Tables {
    fn drop(&mut self) {
        let (client, tables) = (
            self.client.clone(),
            [self.inbox.clone(), self.accounts.clone()],
        );
        // Its own thread and runtime: this may run inside the test's runtime.
        let _ = std::thread::spawn(move || {
            let runtime = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .unwrap();
            runtime.block_on(async {
                for table in tables {
                    let _ = client.delete_table().table_name(table).send().await;
                }
            });
        })
        .join();
    }
}

/// The SQLite balances of the demo's `accounts` table.
async fn sqlite_balances(url: &str) -> BTreeMap<String, i64> {
    let mut conn = sqlx::SqliteConnection::connect(url).await.unwrap();
    let rows: Vec<(String, i64)> = sqlx::query_as("SELECT id, balance_cents FROM accounts")
        .fetch_all(&mut conn)
        .await
        .unwrap();
    conn.close().await.ok();
    rows.into_iter().collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_same_lines_as_sqlite_and_nothing_applied_twice() {
    let started = Instant::now();
    let dir = tempfile::tempdir().unwrap();
    let lines = cut(HEAD_LINES);
    let (input, expected, truth) = write_stream(dir.path(), "cut", &lines);
    // Every kind of line of the sample is in the cut.
    assert_eq!(
        (truth.conflicts, truth.rejected),
        (16, 18),
        "the cut keeps the sample's 16 conflicts and 18 malformed lines"
    );
    let (input, expected) = (input.display().to_string(), expected.display().to_string());
    let args = [input.as_str(), "--expected", expected.as_str()];
    let first_summary = format!(
        "summary: processed={} duplicates={} conflicts=16 rejected=18 balances=ok",
        truth.processed, truth.duplicates
    );
    let second_summary = format!(
        "summary: processed=0 duplicates={} conflicts=16 rejected=18 balances=ok",
        truth.processed + truth.duplicates
    );

    let sqlite = format!("sqlite:{}", dir.path().join("ledger.db").display());
    let tables = Tables::new("ledger_demo").await;
    let dynamo = tables.url();
    let mut outputs = Vec::new();
    for (run_name, url) in [
        ("sqlite-1", &sqlite),
        ("dynamodb-1", &dynamo),
        ("sqlite-2", &sqlite),
        ("dynamodb-2", &dynamo),
    ] {
        let log = dir.path().join(format!("{run_name}.log"));
        let (status, stdout) = run(&args, url, &log);
        assert!(status.success(), "{run_name}: {status}\n{}", tail(&log));
        outputs.push(stdout);
    }
    let [sqlite_1, dynamo_1, sqlite_2, dynamo_2] = &outputs[..] else {
        unreachable!()
    };
    assert_eq!(last_line(sqlite_1), first_summary, "{sqlite_1}");
    assert_eq!(last_line(dynamo_1), first_summary, "{dynamo_1}");
    assert_eq!(last_line(sqlite_2), second_summary, "{sqlite_2}");
    assert_eq!(last_line(dynamo_2), second_summary, "{dynamo_2}");
    assert_eq!(comparable(dynamo_1), comparable(sqlite_1));
    assert_eq!(comparable(dynamo_2), comparable(sqlite_2));
    assert!(
        dynamo_1.contains("\nnot on dynamodb yet: rejected lines are reported on stderr"),
        "{dynamo_1}"
    );
    // A new key: GetItem and TransactWriteItems; a duplicate: GetItem; a conflict: GetItem and
    // the PutItem that keeps it (each time it is delivered).
    assert_eq!(
        calls(dynamo_1),
        2 * truth.processed + truth.duplicates + 2 * truth.conflicts,
        "{dynamo_1}"
    );
    assert_eq!(
        calls(dynamo_2),
        truth.processed + truth.duplicates + 2 * truth.conflicts,
        "{dynamo_2}"
    );

    let balances = tables.balances().await;
    assert_eq!(balances, truth.balances);
    assert_eq!(balances, sqlite_balances(&sqlite).await);
    let items = tables.inbox_items().await;
    assert_eq!(items.len() as u64, truth.processed);
    assert!(items.iter().all(|(_, status)| status == "processed"));
    assert_eq!(
        items
            .into_iter()
            .map(|(key, _)| key)
            .collect::<BTreeSet<_>>(),
        truth.keys
    );

    // What has no DynamoDB equivalent is refused, naming what to use.
    let log = dir.path().join("admin.log");
    let child = spawn(&["admin", "--database-url", &dynamo, "stats"], &log);
    let (status, _) = wait_ledger(child, &log, Duration::from_secs(60));
    let stderr = std::fs::read_to_string(&log).unwrap();
    assert_eq!(status.code(), Some(2), "{stderr}");
    assert!(
        stderr.contains("is a DynamoDB store: this command needs a SQL database"),
        "{stderr}"
    );
    // Bad input: a table name DynamoDB would refuse, a cache the store has not; nothing created.
    for (name, extra, error) in [
        (
            "bad-name",
            vec!["--store", "dynamodb://a/b"],
            "`dynamodb://a/b`: `a/b` is not a DynamoDB table name: 3 to 255 characters",
        ),
        (
            "cache",
            vec!["--store", dynamo.as_str(), "--cache", "memory"],
            "--cache memory: the dedupe cache is not available on the DynamoDB store yet",
        ),
    ] {
        let log = dir.path().join(format!("{name}.log"));
        let mut all = vec![input.as_str()];
        all.extend(extra);
        let (status, stdout) = wait_ledger(spawn(&all, &log), &log, Duration::from_secs(60));
        let stderr = std::fs::read_to_string(&log).unwrap();
        assert_eq!(status.code(), Some(2), "{name}: {stdout}\n{stderr}");
        assert!(stderr.contains(error), "{name}: {stderr}");
    }
    eprintln!("dynamodb ledger: {:.1} s", started.elapsed().as_secs_f64());
}

/// Kills the demo 3 times, each once the inbox table holds at least `at` claims (polled with a
/// consistent count), then runs it to the end.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigkill_drill() {
    const KILL_AT: [u64; 3] = [30, 70, 110];
    let started = Instant::now();
    let dir = tempfile::tempdir().unwrap();
    let lines = cut(DRILL_HEAD_LINES);
    let (input, expected, truth) = write_stream(dir.path(), "drill", &lines);
    assert!(truth.processed > KILL_AT[2] + 20, "{}", truth.processed);
    let tables = Tables::new("ledger_drill").await;
    let url = tables.url();
    let (input, expected) = (input.display().to_string(), expected.display().to_string());
    let args = [
        input.as_str(),
        "--expected",
        expected.as_str(),
        "--store",
        url.as_str(),
    ];
    let log = dir.path().join("drill.log");
    let mut at_kill = Vec::new();
    for (kill, at) in KILL_AT.into_iter().enumerate() {
        let mut child = spawn(&args, &log);
        let deadline = Instant::now() + Duration::from_secs(120);
        while tables.claims().await < at {
            assert!(
                child.try_wait().unwrap().is_none(),
                "kill {kill}: the demo exited before {at} claims\n{}",
                tail(&log)
            );
            assert!(Instant::now() < deadline, "kill {kill}\n{}", tail(&log));
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        child.kill().unwrap(); // SIGKILL
        let status = child.wait().unwrap();
        assert_eq!(
            std::os::unix::process::ExitStatusExt::signal(&status),
            Some(9),
            "kill {kill}"
        );
        let claims = tables.claims().await;
        assert!(
            (at..truth.processed).contains(&claims),
            "kill {kill}: {claims} claims, killed mid-run after {at}"
        );
        at_kill.push(claims);
    }
    let child = spawn(&args, &log);
    let (status, stdout) = wait_ledger(child, &log, Duration::from_secs(300));
    assert!(status.success(), "{status}\n{}", tail(&log));
    // Not a fresh table: the balances are checked, the counts are this run's.
    let before = *at_kill.last().unwrap();
    assert_eq!(
        last_line(&stdout),
        format!(
            "summary: processed={} duplicates={} conflicts=16 rejected=18 balances=ok",
            truth.processed - before,
            truth.duplicates + before
        ),
        "{stdout}"
    );
    assert_eq!(tables.balances().await, truth.balances, "balances");
    let items = tables.inbox_items().await;
    let keys: BTreeSet<String> = items.iter().map(|(key, _)| key.clone()).collect();
    assert_eq!(items.len(), keys.len(), "one inbox item per key");
    assert_eq!(keys, truth.keys, "every event id claimed, none other");
    assert!(
        items.iter().all(|(_, status)| status == "processed"),
        "{items:?}"
    );
    eprintln!(
        "killed at {at_kill:?} claims of {}; {:.1} s",
        truth.processed,
        started.elapsed().as_secs_f64()
    );
}
