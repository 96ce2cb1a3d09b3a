//! A database that goes away, on the ledger demo: while it consumes the bundled sample through a
//! `Worker` over the file source on PostgreSQL, its connections are terminated
//! (`pg_terminate_backend`) five times and the PostgreSQL server itself is restarted once
//! (`scripts/pg.sh restart`). The demo must carry on by itself — no restart, no intervention —
//! and end with exact balances, every well-formed event applied exactly once, none lost.
//!
//! **Alone in its test binary on purpose**: restarting the server cuts every connection to it,
//! so no other test may run at the same time. Cargo runs test binaries one after the other and
//! only the tests of one binary in parallel; keep this the only test here. `scripts/test.sh`,
//! which runs some test binaries beside the rest, runs this one alone (its `ALONE_TESTS`). It
//! needs the server
//! that `scripts/pg.sh start` runs (`scripts/test.sh` does), with the same `INBOX_PG_DIR` and
//! `INBOX_PG_PORT`.
//!
//! A restart may be slow on a loaded machine (`scripts/pg.sh restart` waits for it as long as it
//! takes): the disruptions after it keep their spacing from the moment the server is back.

#![allow(missing_docs)]

#[path = "ledger_support.rs"]
mod support;

#[path = "ledger_checks.rs"]
mod checks;

use std::path::PathBuf;
use std::process::Command;
use std::str::FromStr as _;
use std::time::{Duration, Instant};

use checks::{assert_exact, pg_state};
use sqlx::Connection as _;
use sqlx::postgres::PgConnectOptions;
use support::{fresh_database, log_file, root, sample, spawn_ledger, summary, tail};

/// What happens to the database, at these times after the demo starts consuming.
#[derive(Debug, Clone, Copy)]
enum Disruption {
    /// `pg_terminate_backend` on every connection to the demo's database.
    Terminate,
    /// `scripts/pg.sh restart`: fast shutdown (connections cut), start again.
    Restart,
}

const PLAN: [(u64, Disruption); 6] = [
    (700, Disruption::Terminate),
    (1_500, Disruption::Terminate),
    (2_300, Disruption::Terminate),
    (3_500, Disruption::Restart),
    (5_500, Disruption::Terminate),
    (6_500, Disruption::Terminate),
];

/// Terminates every other connection to `database`; how many there were.
async fn terminate_connections(server_url: &str, database: &str) -> i64 {
    let options = PgConnectOptions::from_str(server_url).unwrap();
    let mut admin = sqlx::PgConnection::connect_with(&options).await.unwrap();
    let terminated: i64 = sqlx::query_scalar(
        "SELECT COUNT(*) FROM (SELECT pg_terminate_backend(pid) FROM pg_stat_activity \
         WHERE datname = $1 AND pid <> pg_backend_pid()) AS t",
    )
    .bind(database)
    .fetch_one(&mut admin)
    .await
    .unwrap();
    admin.close().await.ok();
    terminated
}

fn restart_server() -> Duration {
    let started = Instant::now();
    let output = Command::new(root().join("scripts/pg.sh"))
        .arg("restart")
        .output()
        .expect("run scripts/pg.sh restart");
    assert!(
        output.status.success(),
        "scripts/pg.sh restart failed (is DATABASE_URL the server of scripts/pg.sh start, with the \
         same INBOX_PG_DIR?): {}",
        String::from_utf8_lossy(&output.stderr)
    );
    started.elapsed()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connections_terminated_and_server_restarted_mid_stream() {
    let started = Instant::now();
    let server_url = inbox_tests::database_url();
    let database = support::unique("inbox_outage");
    // Synchronous commits (no `synchronous_commit=off`): the server is restarted under the demo.
    let url = fresh_database(&database)
        .await
        .split('?')
        .next()
        .unwrap()
        .to_owned();
    let offset = support::scratch_dir().join(format!("{database}.offset"));
    let _ = std::fs::remove_file(&offset);
    let log = log_file("outage");
    let source = format!("file:{}", sample().display());
    let offset_arg = offset.display().to_string();
    let args = [
        "--source",
        source.as_str(),
        "--offset-file",
        offset_arg.as_str(),
        "--concurrency",
        "8",
        // Longer than any restart, even when nothing can be fetched meanwhile (the file source
        // ends the run once every line is settled: this only bounds a run that is stuck).
        "--idle-exit",
        "600",
    ];

    let mut child = spawn_ledger(&args, &url, &log);
    {
        let log = log.clone();
        tokio::task::spawn_blocking(move || support::wait_for_handlers(&log))
            .await
            .unwrap();
    }
    let consuming = Instant::now();
    let mut report = Vec::new();
    // How much later than planned the disruptions come: the time a slow restart took beyond
    // the plan's next step. The demo cannot progress while the server is down.
    let mut shift = Duration::ZERO;
    // How long the demo may take to reconnect: longer right after a slow restart, when its
    // retries have backed off meanwhile.
    let mut reconnect = Duration::from_secs(10);
    for (at, disruption) in PLAN {
        tokio::time::sleep_until((consuming + shift + Duration::from_millis(at)).into()).await;
        assert!(
            child.try_wait().unwrap().is_none(),
            "the demo exited before the {disruption:?} at {at} ms: the stream is too short for \
             the plan\n{}",
            tail(&log)
        );
        match disruption {
            Disruption::Terminate => {
                // Right after a disruption the demo may hold no connection for a while (its
                // deliveries wait for their retry or requeue delay): wait until it reconnected.
                let deadline = Instant::now() + reconnect;
                let n = loop {
                    let n = terminate_connections(&server_url, &database).await;
                    if n > 0 || Instant::now() > deadline {
                        break n;
                    }
                    tokio::time::sleep(Duration::from_millis(50)).await;
                };
                assert!(
                    n > 0,
                    "at {at} ms the demo had no connection to terminate for {reconnect:?}: it \
                     did not reconnect\n{}",
                    tail(&log)
                );
                reconnect = Duration::from_secs(10);
                let late = (consuming + shift).elapsed().as_millis() as u64 - at;
                report.push(format!("{at} ms (+{late} ms): terminated {n} connections"));
            }
            Disruption::Restart => {
                let took = tokio::task::spawn_blocking(restart_server).await.unwrap();
                report.push(format!("{at} ms: server restarted in {took:?}"));
                shift += took.saturating_sub(Duration::from_secs(1));
                reconnect = Duration::from_secs(10).max(took * 2);
            }
        }
    }

    let (status, stdout) = {
        let log: PathBuf = log.clone();
        tokio::task::spawn_blocking(move || {
            support::wait_ledger(child, &log, Duration::from_secs(180))
        })
        .await
        .unwrap()
    };
    eprintln!("{}", report.join("\n"));
    assert!(
        status.success(),
        "the demo failed: {status}\n{}",
        tail(&log)
    );
    let deliveries = stdout
        .lines()
        .find(|line| line.starts_with("deliveries: "))
        .unwrap_or_default();
    eprintln!("{deliveries}");
    assert_eq!(summary(&stdout)["balances"], "ok", "{}", tail(&log));
    assert_exact(&pg_state(&url).await);
    let _ = std::fs::remove_file(&offset);
    eprintln!("outage test: {:.1} s", started.elapsed().as_secs_f64());
}
