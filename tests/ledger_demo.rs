//! The ledger demo's plain file mode, run as a user runs it: the summary lines the README shows
//! for the bundled sample, a failed line that does not stop the stream (`failed=N`, exit
//! status 2), a rejected line kept with its parse error, and the `--metrics` counter of
//! rejected deliveries; brokers and DynamoDB refused, naming the feature, in the default build.
//! On SQLite files in a temporary directory; everything the test writes, the private copy of the
//! demo's executable included, is removed afterwards, also on failure.
//! One test function, so that the copy is removed only once every run is over.

#![allow(missing_docs)]

#[path = "ledger_support.rs"]
mod support;

use std::path::Path;
use std::process::ExitStatus;
use std::time::Duration;

use sqlx::Connection as _;
use support::{ledger_bin, root, spawn_ledger, tail, wait_ledger};

/// Removes the private copy of the demo's executable (see `ledger_bin`) when dropped.
struct RemoveCopy;

impl Drop for RemoveCopy {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(ledger_bin());
    }
}

#[tokio::test]
async fn file_mode() {
    let _copy = RemoveCopy;
    the_sample_twice_prints_the_readme_summaries();
    the_sample_twice_on_mariadb().await;
    a_failed_line_is_counted_and_the_stream_goes_on().await;
    the_dedupe_caches_change_no_summary();
    kafka_without_the_feature_is_refused();
    sqs_without_the_feature_is_refused();
    dynamodb_without_the_feature_is_refused();
    bad_durations_are_refused();
}

/// Runs `ledger ARGS` on the SQLite file `db`; its exit status, stdout and stderr.
fn run(args: &[&str], db: &Path, dir: &Path, name: &str) -> (ExitStatus, String, String) {
    let log = dir.join(format!("{name}.log"));
    let url = format!("sqlite:{}", db.display());
    let child = spawn_ledger(args, &url, &log);
    let (status, stdout) = wait_ledger(child, &log, Duration::from_secs(300));
    let stderr = std::fs::read_to_string(&log).unwrap();
    (status, stdout, stderr)
}

fn last_line(stdout: &str) -> &str {
    stdout.lines().last().unwrap_or_default()
}

/// The sample twice, as the README shows it: the same two summary lines, word for word; and
/// `--metrics` counts the 18 rejected lines.
fn the_sample_twice_prints_the_readme_summaries() {
    const FIRST: &str =
        "summary: processed=26000 duplicates=3600 conflicts=16 rejected=18 balances=ok";
    const SECOND: &str =
        "summary: processed=0 duplicates=29600 conflicts=16 rejected=18 balances=ok";
    let readme = std::fs::read_to_string(root().join("README.md")).unwrap();
    for line in [FIRST, SECOND] {
        assert!(
            readme.lines().any(|l| l == line),
            "README.md shows `{line}`"
        );
    }

    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("ledger.db");
    let (status, stdout, stderr) = run(&["--metrics"], &db, dir.path(), "first");
    assert!(status.success(), "{status}\n{stdout}\n{stderr}");
    assert_eq!(last_line(&stdout), FIRST, "{stdout}");
    assert!(
        stderr.contains(
            "metrics: ledger_rejected_total 18 (deliveries refused before any consumer: \
             malformed, unknown message, bad key)\n"
        ),
        "{stderr}"
    );
    let (status, stdout, stderr) = run(&[], &db, dir.path(), "second");
    assert!(status.success(), "{status}\n{stdout}\n{stderr}");
    assert_eq!(last_line(&stdout), SECOND, "{stdout}");
}

/// The sample twice on the test command's MariaDB (`MYSQL_URL`), once as `mysql://…` and once as
/// `mariadb://…`: the same two summary lines as on SQLite (and PostgreSQL).
async fn the_sample_twice_on_mariadb() {
    const FIRST: &str =
        "summary: processed=26000 duplicates=3600 conflicts=16 rejected=18 balances=ok";
    const SECOND: &str =
        "summary: processed=0 duplicates=29600 conflicts=16 rejected=18 balances=ok";
    let server = inbox_tests::mysql_url();
    let name = format!("ledger_demo_{}", std::process::id());
    let mut admin = sqlx::MySqlConnection::connect(&server).await.unwrap();
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!("CREATE DATABASE {name}")))
        .execute(&mut admin)
        .await
        .unwrap();
    let (base, _) = server.rsplit_once('/').unwrap();
    let mysql = format!("{base}/{name}");
    let mariadb = mysql.replacen("mysql://", "mariadb://", 1);
    let dir = tempfile::tempdir().unwrap();
    for (url, expected, run) in [
        (&mysql, FIRST, "mysql-first"),
        (&mariadb, SECOND, "mariadb-second"),
    ] {
        let log = dir.path().join(format!("{run}.log"));
        let child = spawn_ledger(&[], url, &log);
        let (status, stdout) = wait_ledger(child, &log, Duration::from_secs(600));
        assert!(
            status.success(),
            "{run}: {status}\n{stdout}\n{}",
            tail(&log)
        );
        assert_eq!(last_line(&stdout), expected, "{run}: {stdout}");
    }
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!("DROP DATABASE {name}")))
        .execute(&mut admin)
        .await
        .unwrap();
}

/// `--cache redis://…` (the test command's Redis) and `--cache memory`: the same summary lines
/// as without a cache, the second run answered from the inbox or the cache alike.
fn the_dedupe_caches_change_no_summary() {
    const FIRST: &str =
        "summary: processed=26000 duplicates=3600 conflicts=16 rejected=18 balances=ok";
    const SECOND: &str =
        "summary: processed=0 duplicates=29600 conflicts=16 rejected=18 balances=ok";
    let redis = std::env::var("REDIS_URL").expect("REDIS_URL (run the tests with scripts/test.sh)");
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("ledger.db");
    for (run_name, cache, expected) in [
        ("redis-first", redis.as_str(), FIRST),
        ("redis-second", redis.as_str(), SECOND),
        ("memory", "memory", SECOND),
    ] {
        let (status, stdout, stderr) = run(&["--cache", cache], &db, dir.path(), run_name);
        assert!(status.success(), "{run_name}: {status}\n{stdout}\n{stderr}");
        assert!(
            stdout.contains(&format!("cache: {cache}\n")),
            "{run_name}: {stdout}"
        );
        assert_eq!(last_line(&stdout), expected, "{run_name}: {stdout}");
    }
    let (status, stdout, _) = run(&["--cache", "memcached://x"], &db, dir.path(), "unknown");
    assert_eq!(
        status.code(),
        Some(2),
        "an unknown cache is refused: {stdout}"
    );
}

/// A line whose handler fails does not stop the stream: the later lines are processed, the
/// summary ends with `failed=1`, and the demo exits with status 2 after it. A line that is not
/// an envelope is kept in `inbox_rejections` with its parse error.
async fn a_failed_line_is_counted_and_the_stream_goes_on() {
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("ledger.db");
    // The demo creates its accounts table only if it is missing: this one refuses `acct-13`
    // (a CHECK constraint: a database error, retryable, so the event is recorded `failed`).
    let mut conn = sqlx::SqliteConnection::connect(&format!("sqlite:{}?mode=rwc", db.display()))
        .await
        .unwrap();
    sqlx::query(
        "CREATE TABLE accounts (id TEXT PRIMARY KEY, balance_cents BIGINT NOT NULL \
         CHECK (id <> 'acct-13'))",
    )
    .execute(&mut conn)
    .await
    .unwrap();
    conn.close().await.unwrap();

    let events = dir.path().join("events.jsonl");
    std::fs::write(
        &events,
        "{\"message\":\"payments.captured\",\"payload\":{\"event_id\":\"00000000-0000-4000-8000-00000000000a\",\"account_id\":\"acct-1\",\"amount_cents\":500}}\n\
         {\"message\":\"payments.captured\",\"payload\":{\"event_id\":\"00000000-0000-4000-8000-00000000000b\",\"account_id\":\"acct-13\",\"amount_cents\":100}}\n\
         {\"message\":\"payments.captured\",\"payload\":{\"event_id\":\"00000000-0000-4000-8000-00000000000c\",\"account_id\":\"acct-2\",\"amount_cents\":200}}\n\
         not json\n",
    )
    .unwrap();
    let events = events.display().to_string();
    let (status, stdout, stderr) = run(&["--metrics", &events], &db, dir.path(), "failed");
    let log = dir.path().join("failed.log");
    assert_eq!(status.code(), Some(2), "{}", tail(&log));
    assert_eq!(
        last_line(&stdout),
        "summary: processed=2 duplicates=0 conflicts=0 rejected=1 balances=unchecked failed=1",
        "{stdout}"
    );
    assert!(
        stderr.contains(
            "line 2: failed: consumer `ledger`: handler failed (retryable error, attempt 1, retry in "
        ),
        "{stderr}"
    );
    assert!(
        stderr.contains(
            "line 4: rejected: not a message envelope: expected ident at line 1 column 2\n"
        ),
        "{stderr}"
    );
    assert!(
        stderr.contains("metrics: ledger_rejected_total 1 ("),
        "{stderr}"
    );
    assert!(
        stderr.contains(
            "ledger: 1 line failed (handler or database error, reported above); their events \
             are `failed` in the inbox, for a later run or `ledger admin dead replay`\n"
        ),
        "{stderr}"
    );

    let mut conn = sqlx::SqliteConnection::connect(&format!("sqlite:{}", db.display()))
        .await
        .unwrap();
    let balances: Vec<(String, i64)> =
        sqlx::query_as("SELECT id, balance_cents FROM accounts ORDER BY id")
            .fetch_all(&mut conn)
            .await
            .unwrap();
    assert_eq!(
        balances,
        [("acct-1".to_owned(), 500), ("acct-2".to_owned(), 200)]
    );
    let statuses: Vec<(String, String)> = sqlx::query_as(
        "SELECT message_key, status FROM inbox_messages WHERE consumer = 'ledger' ORDER BY message_key",
    )
    .fetch_all(&mut conn)
    .await
    .unwrap();
    assert_eq!(
        statuses,
        [
            (
                "00000000-0000-4000-8000-00000000000a".to_owned(),
                "processed".to_owned()
            ),
            (
                "00000000-0000-4000-8000-00000000000b".to_owned(),
                "failed".to_owned()
            ),
            (
                "00000000-0000-4000-8000-00000000000c".to_owned(),
                "processed".to_owned()
            ),
        ]
    );
    let detail: String = sqlx::query_scalar("SELECT detail FROM inbox_rejections")
        .fetch_one(&mut conn)
        .await
        .unwrap();
    assert_eq!(
        detail,
        "not a message envelope: expected ident at line 1 column 2"
    );
    conn.close().await.unwrap();
}

/// `--idle-exit` and `--ack-wait` that are not a finite number of seconds from 0 to 12 hours are
/// refused by the argument parser (status 2, the reason), before anything runs.
fn bad_durations_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("ledger.db");
    for (value, says) in [
        ("nan", "`nan` is not a number of seconds from 0 to 43200"),
        ("inf", "`inf` is not a number of seconds from 0 to 43200"),
        ("-1", "`-1` is not a number of seconds from 0 to 43200"),
        (
            "1e300",
            "`1e300` is not a number of seconds from 0 to 43200",
        ),
        (
            "soon",
            "`soon` is not a number of seconds: invalid float literal",
        ),
    ] {
        for flag in ["--idle-exit", "--ack-wait"] {
            let arg = format!("{flag}={value}");
            let args = ["--source", "amqp://127.0.0.1:1/%2f", arg.as_str()];
            let (status, stdout, stderr) = run(&args, &db, dir.path(), "durations");
            assert_eq!(status.code(), Some(2), "{flag} {value}: {stdout}\n{stderr}");
            assert!(stderr.contains(says), "{flag} {value}: {stderr}");
        }
    }
    assert!(!db.exists(), "refused before opening the database");
}

/// The default build has no AWS SDK: an `sqs://` URL, to consume from or to publish to, is
/// refused with status 2 and an error that names the examples feature to build with.
fn sqs_without_the_feature_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("ledger.db");
    for (name, args) in [
        ("sqs-source", &["--source", "sqs://ledger"][..]),
        ("sqs-publish", &["publish", "--to", "sqs://ledger"][..]),
    ] {
        let (status, stdout, stderr) = run(args, &db, dir.path(), name);
        assert_eq!(status.code(), Some(2), "{name}: {stdout}\n{stderr}");
        assert!(
            stderr.contains("ledger: `sqs://ledger`: SQS needs the examples feature `sqs`"),
            "{name}: {stderr}"
        );
    }
}

/// The default build has no DynamoDB client: `--store dynamodb://…` is refused with status 2 and
/// an error that names the examples feature to build with.
fn dynamodb_without_the_feature_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("ledger.db");
    let (status, stdout, stderr) = run(&["--store", "dynamodb://ledger"], &db, dir.path(), "ddb");
    assert_eq!(status.code(), Some(2), "{stdout}\n{stderr}");
    assert!(
        stderr.contains(
            "ledger: `dynamodb://ledger`: DynamoDB needs the examples feature `dynamodb`"
        ),
        "{stderr}"
    );
    assert!(!db.exists(), "no SQLite database made");
}

/// The default build has no Kafka client: a `kafka://` URL, to consume from or to publish to, is
/// refused with status 2 and an error that names the examples feature to build with.
fn kafka_without_the_feature_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("ledger.db");
    for (name, args) in [
        ("kafka-source", &["--source", "kafka://127.0.0.1:1"][..]),
        (
            "kafka-publish",
            &["publish", "--to", "kafka://127.0.0.1:1"][..],
        ),
    ] {
        let (status, stdout, stderr) = run(args, &db, dir.path(), name);
        assert_eq!(status.code(), Some(2), "{name}: {stdout}\n{stderr}");
        assert!(
            stderr.contains(
                "ledger: `kafka://127.0.0.1:1`: Kafka needs the examples feature `kafka`"
            ),
            "{name}: {stderr}"
        );
    }
}
