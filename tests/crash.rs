//! Crash safety, proven on the ledger demo: it consumes the bundled sample through a `Worker`
//! over the file source (which resumes after its last acked line), is killed with SIGKILL at 24
//! random (seeded) moments and restarted each time, then runs to the end. Afterwards every
//! balance is exact, every well-formed event is applied exactly once (one `processed` inbox row
//! each, no other rows), and none is lost. On SQLite and on PostgreSQL.

#![allow(missing_docs)]

#[path = "ledger_support.rs"]
mod support;

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use rand::{Rng as _, SeedableRng as _};
use sqlx::Connection as _;
use support::{
    expected, fresh_database, log_file, run_ledger, sample, spawn_ledger, summary, tail,
    wait_for_handlers,
};

/// SIGKILLs per test (the issue asks for at least 20).
const KILLS: usize = 24;

/// The event ids (inbox key form) of the sample's well-formed events: a known message name, a
/// UUID `event_id`, a string account and an integer amount. Redeliveries and conflicts repeat
/// ids; malformed lines carry ids that are never delivered well-formed.
fn well_formed_event_ids() -> BTreeSet<String> {
    let text = std::fs::read_to_string(sample()).unwrap();
    text.lines()
        .filter_map(|line| serde_json::from_str::<serde_json::Value>(line).ok())
        .filter(|line| {
            matches!(
                line["message"].as_str(),
                Some("payments.captured" | "payments.refunded")
            )
        })
        .filter(|line| line["payload"]["account_id"].is_string())
        .filter(|line| line["payload"]["amount_cents"].is_i64())
        .filter_map(|line| {
            let id = line["payload"]["event_id"].as_str()?;
            Some(uuid::Uuid::parse_str(id).ok()?.hyphenated().to_string())
        })
        .collect()
}

/// What the database holds at the end.
#[derive(Debug)]
struct State {
    balances: BTreeMap<String, i64>,
    /// `ledger` inbox rows by status.
    statuses: BTreeMap<String, i64>,
    /// Keys of the `processed` rows of `ledger`.
    processed: BTreeSet<String>,
}

const BALANCES: &str = "SELECT id, balance_cents FROM accounts ORDER BY id";
const STATUSES: &str =
    "SELECT status, COUNT(*) FROM inbox_messages WHERE consumer = 'ledger' GROUP BY status";
const PROCESSED: &str =
    "SELECT message_key FROM inbox_messages WHERE consumer = 'ledger' AND status = 'processed'";

async fn pg_state(url: &str) -> State {
    let mut conn = sqlx::PgConnection::connect(url).await.unwrap();
    let balances: Vec<(String, i64)> = sqlx::query_as(BALANCES).fetch_all(&mut conn).await.unwrap();
    let statuses: Vec<(String, i64)> = sqlx::query_as(STATUSES).fetch_all(&mut conn).await.unwrap();
    let processed: Vec<String> = sqlx::query_scalar(PROCESSED)
        .fetch_all(&mut conn)
        .await
        .unwrap();
    conn.close().await.ok();
    State {
        balances: balances.into_iter().collect(),
        statuses: statuses.into_iter().collect(),
        processed: processed.into_iter().collect(),
    }
}

async fn sqlite_state(url: &str) -> State {
    let mut conn = sqlx::SqliteConnection::connect(url).await.unwrap();
    let balances: Vec<(String, i64)> = sqlx::query_as(BALANCES).fetch_all(&mut conn).await.unwrap();
    let statuses: Vec<(String, i64)> = sqlx::query_as(STATUSES).fetch_all(&mut conn).await.unwrap();
    let processed: Vec<String> = sqlx::query_scalar(PROCESSED)
        .fetch_all(&mut conn)
        .await
        .unwrap();
    conn.close().await.ok();
    State {
        balances: balances.into_iter().collect(),
        statuses: statuses.into_iter().collect(),
        processed: processed.into_iter().collect(),
    }
}

/// Balances exact; exactly the well-formed events applied, each once; nothing failed or dead.
fn assert_exact(state: &State) {
    let expected = expected();
    let valid = well_formed_event_ids();
    assert_eq!(
        valid.len() as u64,
        expected.processed,
        "the sample's well-formed events are its expected processed count"
    );
    let mismatched: Vec<_> = expected
        .balances
        .iter()
        .filter(|(account, balance)| state.balances.get(*account) != Some(*balance))
        .map(|(account, balance)| (account, *balance, state.balances.get(account)))
        .collect();
    assert!(
        mismatched.is_empty() && state.balances.len() == expected.balances.len(),
        "balances off (account, expected, found): {mismatched:?}"
    );
    assert_eq!(
        state.statuses,
        BTreeMap::from([("processed".to_owned(), expected.processed as i64)]),
        "one processed inbox row per event, nothing else"
    );
    let lost: Vec<_> = valid.difference(&state.processed).take(5).collect();
    let extra: Vec<_> = state.processed.difference(&valid).take(5).collect();
    assert!(
        lost.is_empty() && extra.is_empty(),
        "lost (not applied): {lost:?}; applied but not well-formed: {extra:?}"
    );
}

/// The line the demo resumed after, from its `resuming after line N` output.
fn resumed_after(log: &Path) -> u64 {
    let out = std::fs::read_to_string(log.with_extension("out")).unwrap();
    out.lines()
        .find_map(|line| line.strip_prefix("resuming after line "))
        .and_then(|rest| rest.split_whitespace().next())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("no `resuming after line` in\n{out}"))
}

/// Runs the demo over the sample with the file source, SIGKILLs it `KILLS` times at random
/// moments 50-600 ms after it started consuming, then lets it finish. Returns the lines each run
/// resumed after, and the last run's stdout.
fn kill_and_recover(database_url: &str, dir: &Path, seed: u64) -> (Vec<u64>, String) {
    let log = log_file(&format!("crash_{seed}"));
    let offset = dir.join("payments.offset");
    let source = format!("file:{}", sample().display());
    let offset_arg = offset.display().to_string();
    let args = [
        "--source",
        source.as_str(),
        "--offset-file",
        offset_arg.as_str(),
        "--concurrency",
        "8",
    ];
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
    let mut resumed = Vec::new();
    for kill in 0..KILLS {
        let mut child = spawn_ledger(&args, database_url, &log);
        wait_for_handlers(&log);
        let delay = Duration::from_millis(rng.random_range(50..600));
        std::thread::sleep(delay);
        assert!(
            child.try_wait().unwrap().is_none(),
            "kill {kill}: the demo exited before its SIGKILL at {delay:?}\n{}",
            tail(&log)
        );
        child.kill().unwrap(); // SIGKILL
        let status = child.wait().unwrap();
        assert_eq!(
            std::os::unix::process::ExitStatusExt::signal(&status),
            Some(9),
            "kill {kill}"
        );
        resumed.push(resumed_after(&log));
    }
    let stdout = run_ledger(&args, database_url, &log);
    resumed.push(resumed_after(&log));
    (resumed, stdout)
}

fn check_run(resumed: &[u64], stdout: &str) {
    assert!(
        resumed.windows(2).all(|w| w[0] <= w[1]),
        "the acked position never goes back: {resumed:?}"
    );
    assert!(
        *resumed.last().unwrap() > 0,
        "the killed runs made progress that was kept: {resumed:?}"
    );
    let summary = summary(stdout);
    assert_eq!(summary["balances"], "ok", "{stdout}");
    eprintln!("resumed after lines {resumed:?}");
}

/// A directory of its own in the temp directory, removed on drop.
struct TempDir(PathBuf);

impl TempDir {
    fn new(name: &str) -> Self {
        let path = std::env::temp_dir().join(support::unique(name));
        let _ = std::fs::remove_dir_all(&path);
        std::fs::create_dir_all(&path).unwrap();
        Self(path)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigkill_24_times_on_sqlite() {
    let started = Instant::now();
    let dir = TempDir::new("inbox_crash_sqlite");
    let url = format!("sqlite:{}", dir.0.join("ledger.db").display());
    let (resumed, stdout) = {
        let (url, path) = (url.clone(), dir.0.clone());
        tokio::task::spawn_blocking(move || kill_and_recover(&url, &path, 20_260_001))
            .await
            .unwrap()
    };
    check_run(&resumed, &stdout);
    assert_exact(&sqlite_state(&url).await);
    eprintln!("sqlite: {:.1} s", started.elapsed().as_secs_f64());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigkill_24_times_on_postgres() {
    let started = Instant::now();
    let dir = TempDir::new("inbox_crash_pg");
    let url = fresh_database(&support::unique("inbox_crash")).await;
    let (resumed, stdout) = {
        let (url, path) = (url.clone(), dir.0.clone());
        tokio::task::spawn_blocking(move || kill_and_recover(&url, &path, 20_260_002))
            .await
            .unwrap()
    };
    check_run(&resumed, &stdout);
    assert_exact(&pg_state(&url).await);
    eprintln!("postgres: {:.1} s", started.elapsed().as_secs_f64());
}
