//! The operator console in a real browser: headless Chromium driven through chromedriver
//! (WebDriver, `fantoccini`), over a database seeded by the ledger demo and served by
//! `ledger console --token` with the demo's own pool (one connection on SQLite, four on
//! PostgreSQL and MariaDB), the way an operator meets it: once on PostgreSQL, once on SQLite,
//! once on MariaDB.
//!
//! * Seed: the demo's file mode over a stream with two good events, a duplicate, a conflict, a
//!   line that is not a message, two events for accounts that do not exist (dead at once: a
//!   permanent error) and one for `acct-13` that the database refuses (a CHECK constraint on the
//!   accounts table, a trigger on SQLite: dead at once with `--max-attempts 1`).
//! * In the browser, signed in with HTTP Basic (`alice` and the token, in the URL): the overview's
//!   counts equal [`admin::stats`] (and the numbers the stream implies); the dead list; the
//!   `acct-13` event, replayed after the refusal is dropped (the cause fixed) → processed, its
//!   credit applied once; a bad-account event discarded; the rejections and the conflict's
//!   detail; the parked messages, the outbox, the rates; the overview again; an error page,
//!   styled as the others.
//! * Over plain HTTP (reqwest): no or wrong credentials → `401` with the Basic challenge; forged
//!   `POST`s (no CSRF token, another operator's token, cross-site) → `403`, nothing changed; a
//!   second replay of the processed event → `409`, applied once still.
//!
//! A PNG screenshot of every page visited goes to
//! `$CARGO_TARGET_DIR/test-artifacts/console/<backend>/` (`target/…` when unset); their paths
//! are printed. The three backends run one after the other (one browser at a time).
//!
//! Needs `DATABASE_URL` and `MYSQL_URL` (scripts/test.sh) and Debian's `chromium` and
//! `chromium-driver` (scripts/deps.sh installs them): without them the test fails and says so.

#![allow(missing_docs)]

#[path = "ledger_support.rs"]
mod support;

use std::collections::BTreeMap;
use std::io::Read as _;
use std::net::{Ipv4Addr, SocketAddr, TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::str::FromStr as _;
use std::time::{Duration, Instant};

use fantoccini::{Client, ClientBuilder, Locator};
use inbox_runtime::ops::admin;
use inbox_runtime::{
    Status,
    store::{StatsRow, StatsStatus},
};
use sqlx::mysql::MySqlPoolOptions;
use sqlx::postgres::PgPoolOptions;
use sqlx::sqlite::{SqliteConnectOptions, SqlitePoolOptions};
use sqlx::{Connection as _, MySqlPool, PgPool, SqlitePool};

use support::{ChildGuard, fresh_database, run_ledger, scratch_dir, tail, unique};

/// The console's token (the password of HTTP Basic, any user name).
const TOKEN: &str = "s3cret-console-token";

/// The seeded events' ids (inbox keys).
const GOOD_1: &str = "00000000-0000-4000-8000-000000000001";
const GOOD_2: &str = "00000000-0000-4000-8000-000000000002";
/// `acct-13`: refused by the database until the test drops the constraint.
const FIXABLE: &str = "00000000-0000-4000-8000-000000000003";
/// `acct-x`: never a ledger account; discarded from the page.
const BAD_ACCOUNT: &str = "00000000-0000-4000-8000-000000000004";
/// `savings` (a refund): never a ledger account; left dead, the target of the forged actions.
const LEFT_DEAD: &str = "00000000-0000-4000-8000-000000000005";

/// The stream the demo is fed: one line per delivery.
fn stream() -> String {
    let line = |message: &str, id: &str, account: &str, cents: i64| {
        format!(
            "{{\"message\":\"{message}\",\"payload\":{{\"event_id\":\"{id}\",\
             \"account_id\":\"{account}\",\"amount_cents\":{cents}}}}}\n"
        )
    };
    [
        line("payments.captured", GOOD_1, "acct-1", 500),
        line("payments.captured", GOOD_2, "acct-2", 200),
        line("payments.captured", FIXABLE, "acct-13", 700),
        line("payments.captured", BAD_ACCOUNT, "acct-x", 100),
        line("payments.refunded", LEFT_DEAD, "savings", 50),
        // A redelivery (a duplicate), a variant of an applied event (a conflict), not a message.
        line("payments.captured", GOOD_1, "acct-1", 500),
        line("payments.captured", GOOD_2, "acct-2", 999),
        "not json\n".to_owned(),
    ]
    .concat()
}

/// A program's path: `/usr/bin/NAME` or the first on `PATH`; panics with how to install it.
fn program(name: &str, package: &str) -> PathBuf {
    let usr = Path::new("/usr/bin").join(name);
    if usr.is_file() {
        return usr;
    }
    std::env::var_os("PATH")
        .iter()
        .flat_map(std::env::split_paths)
        .map(|dir| dir.join(name))
        .find(|path| path.is_file())
        .unwrap_or_else(|| {
            panic!(
                "{name} is not installed: the console's browser tests need Debian's `{package}` \
                 (run the tests with scripts/test.sh, whose scripts/deps.sh installs it, or \
                 `apt-get install chromium chromium-driver`)"
            )
        })
}

/// Where the screenshots of `backend` go: `$CARGO_TARGET_DIR/test-artifacts/console/<backend>/`
/// (relative to the workspace if relative), `target/test-artifacts/console/<backend>/` when
/// unset. Emptied first.
fn artifacts_dir(backend: Backend) -> PathBuf {
    let target = std::env::var_os("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("target"));
    let target = if target.is_absolute() {
        target
    } else {
        support::root().join(target)
    };
    let dir = target.join("test-artifacts/console").join(backend.name());
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// A free port on loopback (the kernel's choice; free again once the probe is closed).
fn free_port() -> u16 {
    TcpListener::bind((Ipv4Addr::LOCALHOST, 0))
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// Polls `ready` every 20 ms until it returns `Some`, at most `timeout`; panics with `what`
/// and `context()` then.
fn wait_until<T>(
    what: &str,
    timeout: Duration,
    mut ready: impl FnMut() -> Option<T>,
    context: impl Fn() -> String,
) -> T {
    let deadline = Instant::now() + timeout;
    loop {
        if let Some(value) = ready() {
            return value;
        }
        assert!(
            Instant::now() < deadline,
            "{what}: not within {timeout:?}\n{}",
            context()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// chromedriver on a free loopback port (killed when dropped), once it accepts connections.
fn start_chromedriver(log: &Path) -> (ChildGuard, String) {
    let driver = program("chromedriver", "chromium-driver");
    let port = free_port();
    let mut child = ChildGuard::new(
        Command::new(driver)
            .arg(format!("--port={port}"))
            .arg(format!("--log-path={}", log.display()))
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("start chromedriver"),
    );
    wait_until(
        "chromedriver accepts connections",
        Duration::from_secs(60),
        || {
            if let Ok(Some(status)) = child.try_wait() {
                panic!("chromedriver exited: {status}\n{}", tail(log));
            }
            TcpStream::connect((Ipv4Addr::LOCALHOST, port)).ok()
        },
        || tail(log),
    );
    (child, format!("http://127.0.0.1:{port}"))
}

/// A WebDriver session of a fresh headless Chromium (its own empty profile in `profile`).
async fn browser(webdriver: &str, profile: &Path) -> Client {
    let chromium = program("chromium", "chromium");
    let mut capabilities = serde_json::Map::new();
    capabilities.insert(
        "goog:chromeOptions".to_owned(),
        serde_json::json!({
            "binary": chromium,
            "args": [
                "--headless",
                "--no-sandbox",
                "--disable-gpu",
                "--disable-dev-shm-usage",
                "--disable-quic",
                "--no-first-run",
                "--disable-background-networking",
                "--disable-component-update",
                "--disable-sync",
                "--window-size=1280,1000",
                format!("--user-data-dir={}", profile.display()),
            ],
        }),
    );
    let connector = hyper_util::client::legacy::connect::HttpConnector::new();
    ClientBuilder::new(connector)
        .capabilities(capabilities)
        .connect(webdriver)
        .await
        .unwrap_or_else(|e| panic!("a Chromium session from chromedriver at {webdriver}: {e}"))
}

/// `ledger console --listen 127.0.0.1:0 --token TOKEN` (killed when dropped) and the address it
/// printed once listening.
fn start_console(database_url: &str, log: &Path) -> (ChildGuard, SocketAddr) {
    let stderr = std::fs::File::create(log).unwrap();
    let mut child = ChildGuard::new(
        Command::new(support::ledger_bin())
            .args(["console", "--listen", "127.0.0.1:0", "--token", TOKEN])
            .env("DATABASE_URL", database_url)
            .env("RUST_LOG", "warn,inbox_runtime::ops::console=info")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(stderr)
            .spawn()
            .expect("start ledger console"),
    );
    let addr = wait_until(
        "ledger console prints its address",
        Duration::from_secs(60),
        || {
            if let Ok(Some(status)) = child.try_wait() {
                panic!("ledger console exited: {status}\n{}", tail(log));
            }
            let mut text = String::new();
            std::fs::File::open(log)
                .ok()?
                .read_to_string(&mut text)
                .ok()?;
            let rest = &text[text.find("ledger console: http://")? + 23..];
            rest[..rest.find("/console")?].parse::<SocketAddr>().ok()
        },
        || tail(log),
    );
    (child, addr)
}

/// Kills, when dropped, the processes whose command line holds this text (the Chromium
/// processes of the test's own profile directory): a backstop for a test that fails before
/// the browser is closed, since killing chromedriver leaves its browser running.
struct Reaper(String);

impl Drop for Reaper {
    fn drop(&mut self) {
        let Ok(entries) = std::fs::read_dir("/proc") else {
            return;
        };
        for entry in entries.flatten() {
            let Ok(pid) = entry.file_name().to_string_lossy().parse::<u32>() else {
                continue;
            };
            let Ok(cmdline) = std::fs::read(entry.path().join("cmdline")) else {
                continue;
            };
            if cmdline
                .split(|byte| *byte == 0)
                .any(|arg| arg == self.0.as_bytes())
            {
                let _ = Command::new("kill")
                    .args(["-KILL", &pid.to_string()])
                    .status();
            }
        }
    }
}

/// Screenshots, numbered in the order taken.
struct Shots {
    dir: PathBuf,
    taken: Vec<PathBuf>,
}

impl Shots {
    async fn take(&mut self, browser: &Client, name: &str) {
        let png = browser.screenshot().await.unwrap();
        assert!(png.starts_with(b"\x89PNG"), "a PNG screenshot");
        let path = self
            .dir
            .join(format!("{:02}-{name}.png", self.taken.len() + 1));
        std::fs::write(&path, png).unwrap();
        println!("screenshot: {}", path.display());
        self.taken.push(path);
    }
}

/// Waits (WebDriver polling, at most 30 s) for an element matching `css` on the current page.
async fn wait_css(browser: &Client, css: &str) -> fantoccini::elements::Element {
    browser
        .wait()
        .at_most(Duration::from_secs(30))
        .for_element(Locator::Css(css))
        .await
        .unwrap_or_else(|e| panic!("no element {css} on the page: {e}"))
}

/// Clicks the element `locator` finds (waited for).
async fn click(browser: &Client, locator: Locator<'_>) {
    browser
        .wait()
        .at_most(Duration::from_secs(30))
        .for_element(locator)
        .await
        .unwrap_or_else(|e| panic!("nothing to click ({locator:?}): {e}"))
        .click()
        .await
        .unwrap();
}

/// From a list of messages: opens the dead message `key`, clicks its `verb` link (replay,
/// discard), confirms on the confirmation page; the result page must say `ledger/KEY: result`
/// and show the status `result`. A screenshot of each of the three pages. Returns the message's
/// last error, as its page showed it.
async fn act_on(
    browser: &Client,
    shots: &mut Shots,
    key: &str,
    verb: &str,
    result: &str,
) -> String {
    click(browser, Locator::LinkText(key)).await;
    wait_css(browser, &format!("a[data-action=\"{verb}\"]")).await;
    assert_eq!(text_of(browser, "dd[data-field=\"key\"]").await, key);
    assert_eq!(text_of(browser, "dd[data-field=\"status\"]").await, "dead");
    let error = text_of(browser, "pre[data-field=\"last_error\"]").await;
    shots.take(browser, &format!("message-before-{verb}")).await;

    click(browser, Locator::Css(&format!("a[data-action=\"{verb}\"]"))).await;
    let confirm = wait_css(browser, &format!("button[data-action=\"{verb}\"]")).await;
    assert_eq!(
        text_of(browser, "h1").await,
        format!("Confirm: {verb} this message?")
    );
    assert_eq!(text_of(browser, "dd[data-field=\"key\"]").await, key);
    shots.take(browser, &format!("{verb}-confirm")).await;

    confirm.click().await.unwrap();
    let shown = wait_css(browser, "p[data-result]").await;
    assert_eq!(
        shown.attr("data-result").await.unwrap().as_deref(),
        Some("ok")
    );
    assert_eq!(
        shown.text().await.unwrap(),
        format!("ledger/{key}: {result}")
    );
    assert_eq!(text_of(browser, "dd[data-field=\"status\"]").await, result);
    shots.take(browser, &format!("{verb}-done")).await;
    error
}

/// The text of the element matching `css` (waited for).
async fn text_of(browser: &Client, css: &str) -> String {
    wait_css(browser, css).await.text().await.unwrap()
}

/// The overview's count cells of `consumer`: status (and `rejected`) → the number shown.
async fn page_counts(browser: &Client, consumer: &str) -> BTreeMap<String, i64> {
    let mut counts = BTreeMap::new();
    let cells = browser
        .find_all(Locator::Css(&format!(
            "table.overview td[data-consumer=\"{consumer}\"][data-status]"
        )))
        .await
        .unwrap();
    for cell in cells {
        let status = cell.attr("data-status").await.unwrap().unwrap();
        let text = cell.text().await.unwrap();
        let n = text
            .trim()
            .parse::<i64>()
            .unwrap_or_else(|_| panic!("count {status} is {text:?}"));
        assert!(counts.insert(status, n).is_none());
    }
    counts
}

/// [`admin::stats`] of `consumer` in the overview's form: every status, and `rejected` (the sum
/// of the rejection reasons).
async fn stats_counts(db: &Database, consumer: &str) -> BTreeMap<String, i64> {
    let rows = db.stats().await;
    let mut counts: BTreeMap<String, i64> = Status::ALL
        .iter()
        .map(|status| (status.as_str().to_owned(), 0))
        .collect();
    counts.insert("rejected".to_owned(), 0);
    for row in rows
        .iter()
        .filter(|row| row.consumer.as_deref() == Some(consumer))
    {
        let name = match row.status {
            StatsStatus::Message(status) => status.as_str(),
            StatsStatus::Rejected(_) => "rejected",
        };
        *counts.get_mut(name).unwrap() += row.count;
    }
    counts
}

/// `expected` as the overview's counts (every status named; the others 0).
fn counts(expected: &[(&str, i64)]) -> BTreeMap<String, i64> {
    let mut counts: BTreeMap<String, i64> = Status::ALL
        .iter()
        .map(|status| (status.as_str().to_owned(), 0))
        .collect();
    counts.insert("rejected".to_owned(), 0);
    for (name, n) in expected {
        *counts.get_mut(*name).unwrap() = *n;
    }
    counts
}

/// The backends the console is served on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Backend {
    Postgres,
    Sqlite,
    MariaDb,
}

impl Backend {
    fn name(self) -> &'static str {
        match self {
            Backend::Postgres => "postgres",
            Backend::Sqlite => "sqlite",
            Backend::MariaDb => "mariadb",
        }
    }

    /// The demo's accounts table, made by hand before the demo makes it, refusing `acct-13`
    /// (a CHECK constraint; SQLite cannot drop one, so a trigger there).
    fn create_accounts(self) -> &'static str {
        match self {
            Backend::Postgres => {
                "CREATE TABLE accounts (id TEXT PRIMARY KEY, balance_cents BIGINT NOT NULL, \
                 CONSTRAINT not_acct_13 CHECK (id <> 'acct-13'))"
            }
            Backend::MariaDb => {
                "CREATE TABLE accounts (id VARCHAR(64) COLLATE utf8mb4_bin PRIMARY KEY, \
                 balance_cents BIGINT NOT NULL, CONSTRAINT not_acct_13 CHECK (id <> 'acct-13'))"
            }
            Backend::Sqlite => {
                "CREATE TABLE accounts (id TEXT PRIMARY KEY, balance_cents BIGINT NOT NULL); \
                 CREATE TRIGGER not_acct_13 BEFORE INSERT ON accounts WHEN NEW.id = 'acct-13' \
                 BEGIN SELECT RAISE(ABORT, 'not_acct_13: acct-13 is refused'); END"
            }
        }
    }

    /// The statement that lifts [`Backend::create_accounts`]'s refusal (the cause fixed).
    fn lift_refusal(self) -> &'static str {
        match self {
            Backend::Postgres | Backend::MariaDb => {
                "ALTER TABLE accounts DROP CONSTRAINT not_acct_13"
            }
            Backend::Sqlite => "DROP TRIGGER not_acct_13",
        }
    }

    /// Every inbox row of the ledger: key, status, attempts, last error, payload (keys are
    /// bytes on MariaDB).
    fn select_inbox(self) -> &'static str {
        match self {
            Backend::MariaDb => {
                "SELECT CONVERT(message_key USING utf8mb4), status, attempts, last_error, payload \
                 FROM inbox_messages WHERE consumer = 'ledger'"
            }
            Backend::Postgres | Backend::Sqlite => {
                "SELECT message_key, status, attempts, last_error, payload \
                 FROM inbox_messages WHERE consumer = 'ledger'"
            }
        }
    }
}

/// A pool of one connection on the test's database, of its backend.
enum Pool {
    Postgres(PgPool),
    Sqlite(SqlitePool),
    MySql(MySqlPool),
}

/// `$body` with `$pool` bound to the pool, whatever its backend.
macro_rules! on_pool {
    ($pool:expr, |$p:ident| $body:expr) => {
        match $pool {
            Pool::Postgres($p) => $body,
            Pool::Sqlite($p) => $body,
            Pool::MySql($p) => $body,
        }
    };
}

/// An inbox row of the ledger: status, attempts, last error, whether the payload is kept.
type InboxRow = (String, i32, Option<String>, bool);

/// An inbox row as [`Backend::select_inbox`] reads it: key, status, attempts, last error,
/// payload.
type StoredRow = (String, String, i32, Option<String>, Option<Vec<u8>>);

/// The test's database: its backend, the URL the demo is given, and the test's own pool on it.
struct Database {
    backend: Backend,
    url: String,
    pool: Pool,
}

impl Database {
    /// A fresh database of `backend` (SQLite: a file in `dir`), with the accounts table that
    /// refuses `acct-13`.
    async fn fresh(backend: Backend, dir: &Path) -> Self {
        let name = unique(&format!("console_browser_{}", backend.name()));
        let url = match backend {
            Backend::Postgres => fresh_database(&name).await,
            Backend::Sqlite => {
                let file = dir.join("ledger.db");
                let _ = std::fs::remove_file(&file);
                format!("sqlite:{}", file.display())
            }
            Backend::MariaDb => {
                let server = inbox_tests::mysql_url();
                let mut admin = sqlx::MySqlConnection::connect(&server).await.unwrap();
                for statement in [
                    format!("DROP DATABASE IF EXISTS {name}"),
                    format!("CREATE DATABASE {name}"),
                ] {
                    sqlx::raw_sql(sqlx::AssertSqlSafe(statement))
                        .execute(&mut admin)
                        .await
                        .unwrap();
                }
                admin.close().await.ok();
                format!("{}/{name}", server.rsplit_once('/').unwrap().0)
            }
        };
        let pool = match backend {
            Backend::Postgres => Pool::Postgres(
                PgPoolOptions::new()
                    .max_connections(1)
                    .connect(&url)
                    .await
                    .unwrap(),
            ),
            Backend::Sqlite => Pool::Sqlite(
                SqlitePoolOptions::new()
                    .max_connections(1)
                    .connect_with(
                        SqliteConnectOptions::from_str(&url)
                            .unwrap()
                            .create_if_missing(true),
                    )
                    .await
                    .unwrap(),
            ),
            Backend::MariaDb => Pool::MySql(
                MySqlPoolOptions::new()
                    .max_connections(1)
                    .connect(&url)
                    .await
                    .unwrap(),
            ),
        };
        let db = Self { backend, url, pool };
        db.execute(backend.create_accounts()).await;
        db
    }

    /// Runs `sql` (one or more statements).
    async fn execute(&self, sql: &'static str) {
        on_pool!(&self.pool, |pool| {
            sqlx::raw_sql(sql).execute(pool).await.unwrap();
        });
    }

    /// [`admin::stats`].
    async fn stats(&self) -> Vec<StatsRow> {
        on_pool!(&self.pool, |pool| admin::stats(pool).await.unwrap())
    }

    /// Every inbox row of the ledger: key → (status, attempts, last error, payload kept).
    async fn inbox(&self) -> BTreeMap<String, InboxRow> {
        let sql = self.backend.select_inbox();
        let rows: Vec<StoredRow> = on_pool!(&self.pool, |pool| sqlx::query_as(sql)
            .fetch_all(pool)
            .await
            .unwrap());
        rows.into_iter()
            .map(|(key, status, attempts, error, payload)| {
                (key, (status, attempts, error, payload.is_some()))
            })
            .collect()
    }

    /// Every account's balance.
    async fn balances(&self) -> BTreeMap<String, i64> {
        let sql = "SELECT id, balance_cents FROM accounts";
        let rows: Vec<(String, i64)> = on_pool!(&self.pool, |pool| sqlx::query_as(sql)
            .fetch_all(pool)
            .await
            .unwrap());
        rows.into_iter().collect()
    }

    /// Closes the pool; drops the database on MariaDB (a database of its own on the shared
    /// server).
    async fn close(&self) {
        on_pool!(&self.pool, |pool| pool.close().await);
        if self.backend == Backend::MariaDb {
            let server = inbox_tests::mysql_url();
            let name = self.url.rsplit_once('/').unwrap().1;
            let mut admin = sqlx::MySqlConnection::connect(&server).await.unwrap();
            sqlx::raw_sql(sqlx::AssertSqlSafe(format!("DROP DATABASE {name}")))
                .execute(&mut admin)
                .await
                .unwrap();
            admin.close().await.ok();
        }
    }
}

fn balances_of(pairs: &[(&str, i64)]) -> BTreeMap<String, i64> {
    pairs.iter().map(|(id, n)| ((*id).to_owned(), *n)).collect()
}

/// A form body of `pairs` (the values are hex or UUIDs: nothing to escape).
fn form(pairs: &[(&str, &str)]) -> String {
    pairs
        .iter()
        .map(|(name, value)| format!("{name}={value}"))
        .collect::<Vec<_>>()
        .join("&")
}

/// One browser at a time: the three backends' runs take turns.
static ONE_BROWSER: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_console_in_chromium_over_the_ledger_demo_on_postgres() {
    in_chromium(Backend::Postgres).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_console_in_chromium_over_the_ledger_demo_on_sqlite() {
    in_chromium(Backend::Sqlite).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_console_in_chromium_over_the_ledger_demo_on_mariadb() {
    in_chromium(Backend::MariaDb).await;
}

/// The whole path on `backend`: seed with the demo, browse, plain HTTP checks, the action log.
async fn in_chromium(backend: Backend) {
    let _turn = ONE_BROWSER.lock().await;
    let started = Instant::now();
    // Fail early, and clearly, without a browser.
    program("chromium", "chromium");
    program("chromedriver", "chromium-driver");
    let dir = scratch_dir().join(format!("console_browser_{}", backend.name()));
    std::fs::create_dir_all(&dir).unwrap();
    let db = std::sync::Arc::new(Database::fresh(backend, &dir).await);
    let url = db.url.clone();

    // ----- Seed the database with the ledger demo -----
    // The accounts table refuses acct-13 (see `Backend::create_accounts`): with
    // --max-attempts 1 the event is dead at once.
    let events = dir.join("events.jsonl");
    std::fs::write(&events, stream()).unwrap();
    let stdout = run_ledger(
        &["--max-attempts", "1", events.to_str().unwrap()],
        &url,
        &dir.join("seed.log"),
    );
    assert_eq!(
        stdout.lines().last(),
        Some("summary: processed=2 duplicates=1 conflicts=1 rejected=1 balances=unchecked dead=3"),
        "{stdout}"
    );
    let seeded = db.inbox().await;
    let statuses: BTreeMap<&str, &str> = seeded
        .iter()
        .map(|(key, row)| (key.as_str(), row.0.as_str()))
        .collect();
    assert_eq!(
        statuses,
        BTreeMap::from([
            (GOOD_1, "processed"),
            (GOOD_2, "processed"),
            (FIXABLE, "dead"),
            (BAD_ACCOUNT, "dead"),
            (LEFT_DEAD, "dead"),
        ])
    );
    assert!(
        seeded.values().all(|row| row.1 == 1),
        "one attempt each: {seeded:?}"
    );
    assert_eq!(
        db.balances().await,
        balances_of(&[("acct-1", 500), ("acct-2", 200)])
    );

    // ----- The console, the browser -----
    let (_console, addr) = start_console(&url, &dir.join("console.log"));
    let base = format!("http://{addr}/console");
    let (_driver, webdriver) = start_chromedriver(&dir.join("chromedriver.log"));
    let profile = tempfile::tempdir().unwrap();
    let _reaper = Reaper(format!("--user-data-dir={}", profile.path().display()));
    let browser = browser(&webdriver, profile.path()).await;
    let shots = Shots {
        dir: artifacts_dir(backend),
        taken: Vec::new(),
    };
    // On a task of its own, so that a failed assertion still closes the browser first.
    let task = tokio::spawn({
        let (browser, db, base) = (browser.clone(), db.clone(), base.clone());
        async move {
            let mut shots = shots;
            let token = browse(&browser, &mut shots, &db, &base).await;
            (shots, token)
        }
    });
    let outcome = task.await;
    let closed = browser.close().await;
    let (shots, token) = match outcome {
        Ok((shots, Ok(token))) => (shots, token),
        Ok((_, Err(error))) => panic!("{error}\n{}", tail(&dir.join("console.log"))),
        Err(error) => {
            eprintln!("console log:\n{}", tail(&dir.join("console.log")));
            std::panic::resume_unwind(error.into_panic())
        }
    };
    closed.unwrap();

    // ----- Plain HTTP: authentication and forged actions -----
    http_checks(&db, &base, &token).await;

    // The console logged both actions with the operator's name.
    let log = std::fs::read_to_string(dir.join("console.log")).unwrap();
    for (action, key, result) in [
        ("replay", FIXABLE, "processed"),
        ("discard", BAD_ACCOUNT, "discarded"),
    ] {
        assert!(
            log.lines().any(|line| line.contains("console: ")
                && line.contains("operator=\"alice\"")
                && line.contains(&format!("action=\"{action}\""))
                && line.contains(key)
                && line.contains(&format!("result={result}"))),
            "the {action} of {key} by alice is logged:\n{log}"
        );
    }
    db.close().await;
    println!(
        "console_browser on {}: {} screenshots in {}, {:.1} s",
        backend.name(),
        shots.taken.len(),
        shots.dir.display(),
        started.elapsed().as_secs_f64()
    );
}

/// The operator's path through the pages; alice's CSRF token, read from a confirmation page. A
/// navigation error is returned rather than a panic, so that the browser is closed.
async fn browse(
    browser: &Client,
    shots: &mut Shots,
    db: &Database,
    base: &str,
) -> Result<String, String> {
    // Signed in with HTTP Basic from the URL: Chromium answers the console's challenge with
    // these credentials and keeps them for the later pages and forms.
    let signed_in = base.replacen("http://", &format!("http://alice:{TOKEN}@"), 1);
    browser.goto(&signed_in).await.map_err(|e| e.to_string())?;
    wait_css(browser, "table.overview").await;
    assert_eq!(browser.title().await.unwrap(), "Overview · inbox console");
    shots.take(browser, "overview").await;

    // The counts on the page are the statistics, and the stream's numbers.
    let shown = page_counts(browser, "ledger").await;
    assert_eq!(shown, stats_counts(db, "ledger").await);
    assert_eq!(
        shown,
        counts(&[("processed", 2), ("dead", 3), ("rejected", 1)])
    );
    let notice = text_of(browser, "p.notice").await;
    assert_eq!(
        notice,
        "1 rejected delivery names no consumer (malformed payloads and unknown message names): see rejections."
    );
    // The stylesheet loaded (the same-origin request carried the credentials too): the header
    // is styled, not the browser's default.
    let header = wait_css(browser, "header").await;
    assert_ne!(
        header.css_value("background-color").await.unwrap(),
        "rgba(0, 0, 0, 0)",
        "the console's stylesheet applies"
    );

    // The dead count links to the dead messages.
    click(
        browser,
        Locator::Css("td[data-consumer=\"ledger\"][data-status=\"dead\"] a"),
    )
    .await;
    wait_css(browser, "table.messages").await;
    shots.take(browser, "messages-dead").await;
    let mut keys = Vec::new();
    for link in browser
        .find_all(Locator::Css("table.messages td.key a"))
        .await
        .unwrap()
    {
        keys.push(link.text().await.unwrap());
    }
    keys.sort();
    assert_eq!(keys, [FIXABLE, BAD_ACCOUNT, LEFT_DEAD]);

    // The cause of acct-13's failure is fixed; the operator opens the message and replays it.
    db.execute(db.backend.lift_refusal()).await;
    let error = act_on(browser, shots, FIXABLE, "replay", "processed").await;
    assert!(error.contains("not_acct_13"), "{error}");
    // In the database: processed, the credit applied once.
    let after = db.inbox().await;
    assert_eq!(
        (after[FIXABLE].0.as_str(), after[FIXABLE].1),
        ("processed", 2)
    );
    assert_eq!(
        db.balances().await,
        balances_of(&[("acct-1", 500), ("acct-2", 200), ("acct-13", 700)])
    );

    // Back to the list; the bad account's event is discarded.
    click(browser, Locator::LinkText("Failed and dead messages")).await;
    wait_css(browser, "table.messages").await;
    let error = act_on(browser, shots, BAD_ACCOUNT, "discard", "discarded").await;
    assert!(
        error.contains("`acct-x` is not a ledger account"),
        "{error}"
    );
    let after = db.inbox().await;
    assert_eq!(after[BAD_ACCOUNT].0, "discarded");
    assert!(
        !after[BAD_ACCOUNT].3,
        "a discarded message's payload is dropped"
    );
    assert_eq!(after[LEFT_DEAD].0, "dead");

    // The rejections: the conflict (ledger) and the line that was not a message (no consumer).
    click(browser, Locator::LinkText("Rejections")).await;
    wait_css(browser, "table.rejections").await;
    shots.take(browser, "rejections").await;
    let mut shown = BTreeMap::new();
    for cell in browser
        .find_all(Locator::Css("table.rejections td[data-reason]"))
        .await
        .unwrap()
    {
        let consumer = cell.attr("data-consumer").await.unwrap().unwrap();
        let reason = cell.attr("data-reason").await.unwrap().unwrap();
        let n: i64 = cell.text().await.unwrap().parse().unwrap();
        shown.insert((consumer, reason), n);
    }
    let stats: BTreeMap<(String, String), i64> = db
        .stats()
        .await
        .into_iter()
        .filter_map(|row| match row.status {
            StatsStatus::Rejected(reason) => Some((
                (
                    row.consumer.unwrap_or_else(|| "(none)".to_owned()),
                    reason.as_str().to_owned(),
                ),
                row.count,
            )),
            StatsStatus::Message(_) => None,
        })
        .collect();
    assert_eq!(shown, stats);
    assert_eq!(
        shown,
        BTreeMap::from([
            (("(none)".to_owned(), "malformed".to_owned()), 1),
            (("ledger".to_owned(), "conflict".to_owned()), 1),
        ])
    );

    more_pages(browser, shots).await;

    // The overview after both actions.
    click(browser, Locator::LinkText("Overview")).await;
    wait_css(browser, "table.overview").await;
    shots.take(browser, "overview-after").await;
    let shown = page_counts(browser, "ledger").await;
    assert_eq!(shown, stats_counts(db, "ledger").await);
    assert_eq!(
        shown,
        counts(&[
            ("processed", 3),
            ("dead", 1),
            ("discarded", 1),
            ("rejected", 1)
        ])
    );

    // The replayed message cannot be replayed again: its confirmation page says so.
    browser
        .goto(&format!("{base}/replay?consumer=ledger&key={FIXABLE}"))
        .await
        .unwrap();
    let h1 = text_of(browser, "h1").await;
    assert_eq!(h1, "Nothing to do");
    assert!(
        browser
            .find_all(Locator::Css("button[data-action]"))
            .await
            .unwrap()
            .is_empty()
    );
    // An error page (409) is a page of the console: its stylesheet applies.
    assert_ne!(
        wait_css(browser, "header")
            .await
            .css_value("background-color")
            .await
            .unwrap(),
        "rgba(0, 0, 0, 0)",
        "the console's stylesheet applies to an error page"
    );
    assert_eq!(
        browser.title().await.unwrap(),
        "Nothing to do · inbox console"
    );
    shots.take(browser, "replay-refused").await;

    // A confirmation page of the message left dead: the CSRF token the forged requests reuse.
    browser
        .goto(&format!("{base}/replay?consumer=ledger&key={LEFT_DEAD}"))
        .await
        .unwrap();
    let token = wait_css(browser, "input[name=\"csrf\"]")
        .await
        .attr("value")
        .await
        .unwrap()
        .unwrap();
    Ok(token)
}

/// From the rejections page: the conflict's detail; then the parked messages, the outbox and
/// the rates, each from the navigation, with the figures the stream and the two actions imply.
async fn more_pages(browser: &Client, shots: &mut Shots) {
    let mut conflict = None;
    for row in browser
        .find_all(Locator::Css("table.rejection-list tr[data-rejection]"))
        .await
        .unwrap()
    {
        if row.text().await.unwrap().contains("conflict") {
            conflict = Some(row.find(Locator::Css("a")).await.unwrap());
        }
    }
    conflict
        .expect("the conflict in the list")
        .click()
        .await
        .unwrap();
    wait_css(browser, "pre[data-field=\"payload-hex\"]").await;
    assert!(
        text_of(browser, "h1")
            .await
            .starts_with("Rejected delivery ")
    );
    assert_eq!(
        text_of(browser, "dd[data-field=\"reason\"]").await,
        "conflict"
    );
    assert_eq!(text_of(browser, "dd[data-field=\"key\"]").await, GOOD_2);
    let text = text_of(browser, "pre[data-field=\"payload-text\"]").await;
    assert!(text.contains("\"amount_cents\":999"), "{text}");
    shots.take(browser, "rejection").await;

    click(browser, Locator::LinkText("Parked")).await;
    wait_css(browser, "table.parked").await;
    assert_eq!(
        text_of(browser, "h1").await,
        "Parked messages per aggregate"
    );
    assert_eq!(
        text_of(browser, "table.parked td.muted").await,
        "No parked messages."
    );
    shots.take(browser, "parked").await;

    // The demo migrates the inbox only: the outbox page says it is not installed.
    click(browser, Locator::LinkText("Outbox")).await;
    let absent = text_of(browser, "p[data-outbox=\"absent\"]").await;
    assert!(
        absent.starts_with("The outbox is not installed"),
        "{absent}"
    );
    shots.take(browser, "outbox").await;

    click(browser, Locator::LinkText("Rates")).await;
    wait_css(browser, "section.rates").await;
    assert_eq!(text_of(browser, "h1").await, "Rates, last 24 hours");
    let mut totals = BTreeMap::new();
    for cell in browser
        .find_all(Locator::Css("section.rates td[data-series]"))
        .await
        .unwrap()
    {
        let n: i64 = cell.text().await.unwrap().parse().unwrap();
        if n > 0 {
            let series = cell.attr("data-series").await.unwrap().unwrap();
            totals.insert(series, n);
        }
    }
    // Both sections' non-zero totals: the ledger's rows by their status now and its
    // conflict; the malformed line, of no consumer.
    assert_eq!(
        totals,
        BTreeMap::from([
            ("processed".to_owned(), 3),
            ("dead".to_owned(), 1),
            ("discarded".to_owned(), 1),
            ("rejected:conflict".to_owned(), 1),
            ("rejected:malformed".to_owned(), 1),
        ])
    );
    assert_eq!(
        browser
            .find_all(Locator::Css("section.rates[data-consumer]"))
            .await
            .unwrap()
            .len(),
        2,
        "the ledger and (no consumer)"
    );
    shots.take(browser, "rates").await;
}

/// `401` without the token, `403` for forged actions, `409` for a second replay; nothing
/// changes.
async fn http_checks(db: &Database, base: &str, token: &str) {
    let http = reqwest::Client::new();
    let before = (db.inbox().await, db.balances().await);

    // No credentials, wrong ones: 401 with the Basic challenge (the browser asks again).
    for (who, request) in [
        ("no credentials", http.get(base)),
        (
            "a wrong password",
            http.get(base).basic_auth("alice", Some("wrong")),
        ),
        ("a wrong bearer token", http.get(base).bearer_auth("wrong")),
        (
            "an action without credentials",
            http.post(format!("{base}/replay"))
                .header("content-type", "application/x-www-form-urlencoded")
                .body(form(&[
                    ("consumer", "ledger"),
                    ("key", LEFT_DEAD),
                    ("csrf", token),
                ])),
        ),
    ] {
        let response = request.send().await.unwrap();
        assert_eq!(response.status(), 401, "{who}");
        assert_eq!(
            response.headers()["www-authenticate"],
            "Basic realm=\"ledger console\", charset=\"UTF-8\"",
            "{who}"
        );
    }
    // The token as a bearer token: served.
    let response = http.get(base).bearer_auth(TOKEN).send().await.unwrap();
    assert_eq!(response.status(), 200);

    // Forged actions of a signed-in operator: refused before anything is read.
    let post = |user: &str, body: String| {
        http.post(format!("{base}/replay"))
            .basic_auth(user, Some(TOKEN))
            .header("content-type", "application/x-www-form-urlencoded")
            .body(body)
    };
    let with_token = form(&[("consumer", "ledger"), ("key", LEFT_DEAD), ("csrf", token)]);
    for (what, request, title) in [
        (
            "no CSRF token",
            post("alice", form(&[("consumer", "ledger"), ("key", LEFT_DEAD)])),
            "Invalid form token",
        ),
        (
            "a wrong CSRF token",
            post(
                "alice",
                form(&[
                    ("consumer", "ledger"),
                    ("key", LEFT_DEAD),
                    ("csrf", &"0".repeat(64)),
                ]),
            ),
            "Invalid form token",
        ),
        (
            "another operator's CSRF token",
            post("mallory", with_token.clone()),
            "Invalid form token",
        ),
        (
            "a cross-site form (Sec-Fetch-Site)",
            post("alice", with_token.clone()).header("sec-fetch-site", "cross-site"),
            "Cross-site request refused",
        ),
        (
            "a cross-site form (Origin)",
            post("alice", with_token.clone()).header("origin", "http://evil.example"),
            "Cross-site request refused",
        ),
    ] {
        let response = request.send().await.unwrap();
        assert_eq!(response.status(), 403, "{what}");
        let page = response.text().await.unwrap();
        assert!(page.contains(title), "{what}: {page}");
    }
    assert_eq!(
        (db.inbox().await, db.balances().await),
        before,
        "nothing changed"
    );

    // With alice's own token, a replay of the processed message: 409, applied once still.
    let response = post(
        "alice",
        form(&[("consumer", "ledger"), ("key", FIXABLE), ("csrf", token)]),
    )
    .send()
    .await
    .unwrap();
    assert_eq!(response.status(), 409);
    let page = response.text().await.unwrap();
    assert!(page.contains("Nothing to do"), "{page}");
    assert_eq!(
        (db.inbox().await, db.balances().await),
        before,
        "nothing changed"
    );
}
