//! The peers' workload (issue 19, item 6): one seeded list of deliveries, run side by side on one
//! PostgreSQL by pgbench's naive inbox, the psycopg2 reference consumer and the runtime, each
//! run checked for exact effects.
//!
//! The list: `messages` distinct credits (a UUIDv4 event id, one of `accounts` accounts, an
//! amount of 1–100) and `redeliveries` exact copies of earlier ones, each inserted at a seeded
//! random position after its original. Every row runs the whole list once per round on a reset
//! database (both inboxes empty, the accounts recreated at balance 0, a `CHECKPOINT`), and must
//! end with every balance equal to the sum of its account's distinct credits and its inbox
//! holding exactly the distinct keys (the runtime's inbox, for every row writing it: each key
//! `processed` with the fingerprint the runtime computes): a row that does not is reported as
//! FAILED, not as a rate.
//!
//! The effect is the same statement in every row: [`EFFECT`]. The rows:
//!
//! * **pgbench** (`-M prepared`), the naive inbox ([`PGBENCH_SCRIPT`]): `BEGIN`; `INSERT INTO
//!   peer_inbox (consumer, key) … ON CONFLICT DO NOTHING`; the effect only if a row was inserted
//!   (`\aset` and `\if`); `COMMIT`: 4 round trips. Each transaction takes the next delivery of the
//!   list from the table `peer_deliveries(seq, key, account, amount)` inside its `INSERT` (a CTE
//!   on `seq = nextval('peer_seq')`: one primary-key lookup, no extra statement or round trip);
//! * **pgbench, the naive inbox with its retention index** (issue 33): the same script on
//!   `peer_inbox_indexed`, which also has `received_at timestamptz NOT NULL DEFAULT now()` and
//!   `CREATE INDEX … (received_at)`, the index the naive inbox's own retention purge would need
//!   (the fair reference for the runtime's inbox row, whose purge is index-driven too);
//! * **pgbench running the runtime's statements** ([`PGBENCH_RUNTIME_SCRIPT`], the same options,
//!   right after the naive row at each N): what `Dispatcher::dispatch_on` sends for one delivery
//!   — `BEGIN`; the runtime's claim (a copy of `CLAIM` in inbox-runtime/src/store/postgres.rs,
//!   to be kept in step with it); the effect and the verification (`VERIFY_CLAIM`) only if the
//!   claim returned `claimed`; `COMMIT` — or, for a duplicate, `BEGIN`; the claim; `ROLLBACK` —
//!   on the runtime's own migrated `inbox_messages` (consumer `peers`, message name
//!   `bench.peers`, the fingerprint the runtime stores, precomputed into
//!   `peer_deliveries.fingerprint`), taking the next delivery inside the claim as the naive row
//!   does. It splits the gap between ours and the naive row: itself ÷ naive is the protocol's
//!   statements (server side), ours ÷ itself the client (sqlx, the dispatcher, the Worker);
//! * the **psycopg2 reference consumer** (`peers_psycopg2.py`, threads with one connection each,
//!   the same naive statements; skipped, saying why, when `python3` cannot import `psycopg2`);
//! * **ours**: `Dispatcher::dispatch_on` (N tasks, each with a held `ConnectionSlot`), and the
//!   `Worker` over an in-memory source holding the list — one message per transaction, batches
//!   of 100, and `Worker::new`'s defaults with only the concurrency set.
//!
//! Every row takes the deliveries in list order from one shared cursor (pgbench's sequence,
//! psycopg2's counter, an atomic index, the Worker's source), N at a time; N is 1, 4 and 16
//! (`--peers-clients`), the batched and default Worker rows at 4 only.
//!
//! Before the timed rows, `wire.rs` counts the round trips per delivery of each path on the
//! wire (new message, duplicate, redelivered duplicate, batch of 100).

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use inbox_runtime::source::memory::MemorySource;
use inbox_runtime::{
    ConnectionSlot, Dispatcher, Envelope, Fingerprint, Outcome, Worker, WorkerReport,
};
use serde::{Deserialize, Serialize};
use sqlx::{PgConnection, PgPool, Postgres};
use tokio_util::sync::CancellationToken;

use crate::measure::{BoxError, CpuDelta, Rng};
use crate::pgbench::Length;
use crate::{Args, Out, Pg, Profile, median, progress};

/// The consumer (inbox scope) of the section's handler, and of the naive inbox's rows.
pub(crate) const CONSUMER: &str = "peers";
/// The routing name of [`PeerCredit`].
pub(crate) const MESSAGE: &str = "bench.peers";
/// The effect of every row: `$1` the amount, `$2` the account.
pub(crate) const EFFECT: &str = "UPDATE peer_accounts SET balance = balance + $1 WHERE id = $2";
/// The list's seed: every run, every row and every round run the same deliveries.
const SEED: u64 = 0x9EE5_0019_0006;
/// Deliveries per transaction of the batched Worker row.
pub(crate) const BATCH: usize = 100;
/// The batched Worker row's longest wait for a batch to fill.
const BATCH_WAIT: Duration = Duration::from_millis(5);
/// The longest a Rust row may run before it is stopped (and reported as FAILED).
const LIMIT: Duration = Duration::from_secs(900);

/// pgbench's naive inbox: the next delivery of the list (`peer_deliveries`, by
/// `nextval('peer_seq')`) read inside the claim, the effect only if the claim inserted a row.
/// `\aset` assigns nothing when the `INSERT` returns no row (a duplicate), hence the `\set`.
pub(crate) const PGBENCH_SCRIPT: &str = "\\set inserted 0\n\
BEGIN;\n\
WITH d AS (SELECT key, account, amount FROM peer_deliveries WHERE seq = (SELECT nextval('peer_seq'))) \
INSERT INTO peer_inbox (consumer, key) SELECT 'peers', key FROM d ON CONFLICT DO NOTHING \
RETURNING 1 AS inserted, (SELECT account FROM d) AS account, (SELECT amount FROM d) AS amount \\aset\n\
\\if :inserted\n\
UPDATE peer_accounts SET balance = balance + :amount WHERE id = :account;\n\
\\endif\n\
COMMIT;\n";

/// [`PGBENCH_SCRIPT`] on the naive inbox `inbox` (its table named in the `INSERT`).
pub(crate) fn naive_script(inbox: Inbox) -> String {
    PGBENCH_SCRIPT.replace("INTO peer_inbox ", &format!("INTO {} ", inbox.table()))
}

/// pgbench running the runtime's own statements for one delivery, on the runtime's migrated
/// `inbox_messages` (consumer [`CONSUMER`], message name [`MESSAGE`]): what
/// `Dispatcher::dispatch_on` sends for a fresh key — `BEGIN`; the claim; the effect; the
/// verification (`VERIFY_CLAIM`); `COMMIT` — and for a duplicate — `BEGIN`; the claim;
/// `ROLLBACK` (inbox-runtime/src/protocol: `begin_claim` rolls back a key it finds taken).
///
/// The claim is a copy of `CLAIM` in inbox-runtime/src/store/postgres.rs and MUST be kept in
/// step with it: the same `WITH claim AS (INSERT … ON CONFLICT DO UPDATE … WHERE …) SELECT …
/// UNION ALL SELECT …`, its parameters written in: `$1` `'peers'`, `$2` the delivery's key, `$3`
/// `'bench.peers'`, `$4` the delivery's fingerprint (32 bytes, `Fingerprint::of(MESSAGE, msg)`
/// as the Rust rows store it, precomputed into `peer_deliveries.fingerprint`), `$5`–`$7` NULL
/// (no source metadata), `$8` `'deliver'`. Two departures, both needed for pgbench to take the
/// next delivery of the list inside the claim, as the naive row does (no extra round trip): the
/// `INSERT` reads its row from the CTE `d` (`INSERT … SELECT … FROM d` for `VALUES (…)`; the
/// key of the second branch is `(SELECT key FROM d)`), and each branch returns four more
/// columns (`claimed`, and the key, account and amount the effect and the verification use).
/// When the list is exhausted (`d` empty) the claim returns no row, as it does when a
/// concurrent claim of the key commits under it (the runtime then claims again): both roll
/// back. `\aset` assigns nothing when no row is returned, hence the `\set`.
pub(crate) const PGBENCH_RUNTIME_SCRIPT: &str = "\\set claimed 0\n\
BEGIN;\n\
WITH d AS (SELECT key COLLATE \"C\" AS key, fingerprint, account, amount FROM peer_deliveries \
WHERE seq = (SELECT nextval('peer_seq'))), \
claim AS ( \
INSERT INTO inbox_messages \
(consumer, message_key, message_name, payload_hash, status, attempts, received_at, \
source, source_partition, source_offset) \
SELECT 'peers', key, 'bench.peers', fingerprint, 'processed', 1, now(), NULL, NULL, NULL FROM d \
ON CONFLICT (consumer, message_key) DO UPDATE SET \
status = 'processed', attempts = inbox_messages.attempts + 1, processed_at = now(), \
next_attempt_at = NULL, payload = NULL \
WHERE inbox_messages.payload_hash = excluded.payload_hash \
AND ((inbox_messages.status = 'failed' AND ('deliver' <> 'deliver' OR \
(inbox_messages.next_attempt_at IS NULL OR inbox_messages.next_attempt_at <= now()))) \
OR (inbox_messages.status = 'dead' AND 'deliver' = 'replay') \
OR (inbox_messages.status = 'parked' AND 'deliver' IN ('resume', 'release'))) \
RETURNING attempts) \
SELECT 'claimed' AS status, NULL::bytea AS payload_hash, attempts, \
NULL::bigint AS retry_in_ms, 1 AS claimed, d.key, d.account, d.amount FROM claim, d \
UNION ALL \
SELECT status, payload_hash, attempts, \
CASE WHEN status = 'failed' AND next_attempt_at > now() \
THEN CEIL(EXTRACT(EPOCH FROM (next_attempt_at - now())) * 1000)::bigint END, \
0, NULL, NULL, NULL \
FROM inbox_messages \
WHERE consumer = 'peers' AND message_key = (SELECT key FROM d) AND NOT EXISTS (SELECT 1 FROM claim) \\aset\n\
\\if :claimed\n\
UPDATE peer_accounts SET balance = balance + :amount WHERE id = :account;\n\
SELECT 1 FROM inbox_messages WHERE consumer = 'peers' AND message_key = :key;\n\
COMMIT;\n\
\\else\n\
ROLLBACK;\n\
\\endif\n";

/// The hand-written sqlx inbox's claim: the naive `INSERT … ON CONFLICT DO NOTHING` on the
/// naive inbox with its retention index (`$1` the consumer, `$2` the key); one row affected is a
/// new key. The row sends `BEGIN`, this, [`EFFECT`] if it inserted, `COMMIT`: 4 round trips.
pub(crate) const SQLX_CLAIM: &str =
    "INSERT INTO peer_inbox_indexed (consumer, key) VALUES ($1, $2) ON CONFLICT DO NOTHING";

/// The psycopg2 reference consumer, written to a temporary file to run.
const PSYCOPG2_SCRIPT: &str = include_str!("peers_psycopg2.py");

/// One credit of an account: the section's message.
#[derive(Debug, Clone, Serialize, Deserialize, inbox_runtime::Message)]
#[message(name = "bench.peers")]
pub(crate) struct PeerCredit {
    /// The producer's event id: the idempotency key.
    #[message(key)]
    pub(crate) event_id: uuid::Uuid,
    pub(crate) account: i32,
    pub(crate) amount: i64,
}

/// The effect, through the runtime: [`EFFECT`] in the claimed transaction.
#[inbox_runtime::idempotent(consumer = "peers")]
pub(crate) async fn peer_credit(
    conn: &mut PgConnection,
    msg: PeerCredit,
) -> Result<(), sqlx::Error> {
    sqlx::query(EFFECT)
        .bind(msg.amount)
        .bind(msg.account)
        .execute(conn)
        .await?;
    Ok(())
}

/// The sizes of the list.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Sizes {
    /// Distinct messages.
    pub(crate) messages: usize,
    /// Copies of earlier messages among the deliveries.
    pub(crate) redeliveries: usize,
    /// Accounts the credits spread over.
    pub(crate) accounts: i32,
}

impl Sizes {
    /// The profile's sizes (smoke: 200 + 30 over 50 accounts; quick: 5,000 + 750 over 1,000;
    /// otherwise 20,000 + 3,000 over 1,000), with the command line's overrides.
    pub(crate) fn of(p: &Profile, args: &Args) -> Sizes {
        let (messages, redeliveries, accounts) = match p.name {
            "smoke" => (200, 30, 50),
            "quick" => (5_000, 750, 1_000),
            _ => (20_000, 3_000, 1_000),
        };
        Sizes {
            messages: args.peers_messages.unwrap_or(messages).max(1),
            redeliveries: args.peers_redeliveries.unwrap_or(redeliveries),
            accounts: args
                .peers_accounts
                .unwrap_or(accounts)
                .clamp(1, i32::MAX as usize) as i32,
        }
    }
}

/// The seeded list: deliveries in order, and the balance each account must end with.
pub(crate) struct Workload {
    pub(crate) deliveries: Vec<PeerCredit>,
    /// By account (index `account - 1`): the sum of its distinct credits.
    pub(crate) expected: Vec<i64>,
    pub(crate) messages: usize,
    pub(crate) redeliveries: usize,
}

impl Workload {
    pub(crate) fn new(seed: u64, sizes: Sizes) -> Self {
        let mut rng = Rng::new(seed);
        let mut expected = vec![0_i64; sizes.accounts as usize];
        let mut list: Vec<PeerCredit> = (0..sizes.messages)
            .map(|_| {
                let account = rng.range(sizes.accounts as u64) as i32;
                let amount = rng.range(100) as i64;
                expected[(account - 1) as usize] += amount;
                PeerCredit {
                    event_id: rng.uuid_v4(),
                    account,
                    amount,
                }
            })
            .collect();
        // Each redelivery is a copy of a delivery before its position.
        for _ in 0..sizes.redeliveries {
            let at = rng.range(list.len() as u64) as usize;
            let original = list[rng.next_u64() as usize % at].clone();
            list.insert(at, original);
        }
        Self {
            deliveries: list,
            expected,
            messages: sizes.messages,
            redeliveries: sizes.redeliveries,
        }
    }

    /// `n` distinct messages over `accounts` accounts, then the same `n` again in the same order
    /// (every one a duplicate): the list of the round-trip counts (`wire.rs`).
    pub(crate) fn repeated(seed: u64, n: usize, accounts: i32) -> Self {
        let first = Self::new(
            seed,
            Sizes {
                messages: n,
                redeliveries: 0,
                accounts,
            },
        );
        let mut deliveries = first.deliveries.clone();
        deliveries.extend(first.deliveries);
        Self {
            deliveries,
            expected: first.expected,
            messages: n,
            redeliveries: n,
        }
    }

    /// The deliveries as the runtime gets them (JSON payloads, no source metadata).
    pub(crate) fn envelopes(&self) -> Result<Vec<Envelope>, BoxError> {
        self.deliveries
            .iter()
            .map(|m| Ok(Envelope::new(MESSAGE, serde_json::to_vec(m)?)))
            .collect()
    }
}

/// One row of the section.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) enum Row {
    /// pgbench's naive inbox with this many clients.
    Pgbench(usize),
    /// pgbench's naive inbox with a retention index on its arrival time, with this many clients.
    PgbenchIndexed(usize),
    /// pgbench running the runtime's statements ([`PGBENCH_RUNTIME_SCRIPT`]) with this many
    /// clients.
    PgbenchRuntime(usize),
    /// The psycopg2 reference consumer with this many threads.
    Psycopg2(usize),
    /// The naive inbox as a Rust user writes it by hand with sqlx ([`SQLX_CLAIM`]), this many
    /// tasks.
    SqlxNaive(usize),
    /// `Dispatcher::dispatch_on` with this many tasks.
    DispatchOn(usize),
    /// The Worker, one message per transaction, at this concurrency.
    Worker(usize),
    /// The Worker, batches of [`BATCH`], at this concurrency.
    WorkerBatch(usize),
    /// `Worker::new`'s defaults with only the concurrency set (and a pool of one more).
    WorkerDefault(usize),
    /// The same with the aggregate declared (each delivery's account:
    /// `contention::declare_aggregate`).
    WorkerDefaultDeclared(usize),
}

/// The client counts of the section by default (`--peers-clients`).
pub(crate) const CLIENTS: [usize; 3] = [1, 4, 16];

/// The rows at `clients`, in the order of the table: at each N pgbench's naive inbox (without
/// and with its retention index), pgbench with the runtime's statements, psycopg2,
/// `dispatch_on` and the Worker one message per transaction; at 4 also the batched and the
/// default Worker.
pub(crate) fn rows(clients: &[usize]) -> Vec<Row> {
    let mut rows = Vec::new();
    for &n in clients {
        rows.extend([
            Row::Pgbench(n),
            Row::PgbenchIndexed(n),
            Row::PgbenchRuntime(n),
            Row::Psycopg2(n),
            Row::SqlxNaive(n),
            Row::DispatchOn(n),
            Row::Worker(n),
        ]);
        if n == 4 {
            rows.extend([
                Row::WorkerBatch(4),
                Row::WorkerDefault(4),
                Row::WorkerDefaultDeclared(4),
            ]);
        }
    }
    rows
}

impl Row {
    pub(crate) fn label(self) -> &'static str {
        match self {
            Row::Pgbench(_) => {
                "pgbench: naive inbox (BEGIN; INSERT … ON CONFLICT DO NOTHING; UPDATE if inserted; COMMIT)"
            }
            Row::PgbenchIndexed(_) => {
                "pgbench: naive inbox with a retention index (the same on an inbox with received_at and CREATE INDEX … (received_at))"
            }
            Row::PgbenchRuntime(_) => {
                "pgbench: the runtime's statements (BEGIN; claim; UPDATE; verify; COMMIT, or BEGIN; claim; ROLLBACK)"
            }
            Row::Psycopg2(_) => "psycopg2 reference consumer (the same naive statements)",
            Row::SqlxNaive(_) => {
                "hand-written sqlx inbox (the same naive statements, with the retention index)"
            }
            Row::DispatchOn(_) => "ours: Dispatcher::dispatch_on, 1 message per transaction",
            Row::Worker(_) => "ours: Worker, 1 message per transaction (one_per_transaction())",
            Row::WorkerBatch(_) => "ours: Worker::batch(100, 5 ms)",
            Row::WorkerDefault(_) => "ours: Worker with default settings (as printed above)",
            Row::WorkerDefaultDeclared(_) => {
                "ours: Worker with default settings, the aggregate (account) declared"
            }
        }
    }

    pub(crate) fn workers(self) -> usize {
        match self {
            Row::Pgbench(n)
            | Row::PgbenchIndexed(n)
            | Row::PgbenchRuntime(n)
            | Row::Psycopg2(n)
            | Row::SqlxNaive(n)
            | Row::DispatchOn(n)
            | Row::Worker(n)
            | Row::WorkerBatch(n)
            | Row::WorkerDefault(n)
            | Row::WorkerDefaultDeclared(n) => n,
        }
    }

    /// The inbox the row writes.
    fn inbox(self) -> Inbox {
        match self {
            Row::Pgbench(_) | Row::Psycopg2(_) => Inbox::Naive,
            Row::PgbenchIndexed(_) | Row::SqlxNaive(_) => Inbox::NaiveIndexed,
            _ => Inbox::Runtime,
        }
    }
}

/// The inboxes of the section.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Inbox {
    /// `peer_inbox (consumer, key)`, its primary key only.
    Naive,
    /// `peer_inbox_indexed (consumer, key, received_at)` with an index on `received_at`.
    NaiveIndexed,
    /// The runtime's `inbox_messages`.
    Runtime,
}

impl Inbox {
    /// The table.
    fn table(self) -> &'static str {
        match self {
            Inbox::Naive => "peer_inbox",
            Inbox::NaiveIndexed => "peer_inbox_indexed",
            Inbox::Runtime => "inbox_messages",
        }
    }
}

/// One run of one row: its figures and what it got wrong.
struct Run {
    seconds: f64,
    cpu: CpuDelta,
    /// CPU of the client: this process (ours) or the waited child (pgbench, python3).
    client_cpu: f64,
    wal_bytes: Option<f64>,
    failure: Option<String>,
}

/// A row over its rounds.
#[derive(Default)]
struct Acc {
    rates: Vec<f64>,
    deliveries: u64,
    client_cpu: f64,
    server_cpu: Option<f64>,
    wal_bytes: Option<f64>,
    failures: Vec<String>,
    runs: usize,
}

impl Acc {
    fn add(&mut self, deliveries: usize, run: Run) {
        self.runs += 1;
        if let Some(failure) = run.failure {
            self.failures.push(failure);
            return;
        }
        self.rates.push(deliveries as f64 / run.seconds.max(1e-9));
        self.deliveries += deliveries as u64;
        self.client_cpu += run.client_cpu;
        self.server_cpu = match (self.rates.len(), self.server_cpu, run.cpu.server) {
            (1, _, x) => x,
            (_, Some(a), Some(b)) => Some(a + b),
            _ => None,
        };
        self.wal_bytes = match (self.rates.len(), self.wal_bytes, run.wal_bytes) {
            (1, _, x) => x,
            (_, Some(a), Some(b)) => Some(a + b),
            _ => None,
        };
    }

    /// The median rate, if every run was exact.
    fn rate(&self) -> Option<f64> {
        (self.failures.is_empty() && !self.rates.is_empty()).then(|| median(&self.rates))
    }

    fn wal_per_delivery(&self) -> Option<f64> {
        self.failures.is_empty().then_some(())?;
        Some(self.wal_bytes? / self.deliveries.max(1) as f64)
    }

    fn per_delivery_us(&self, seconds: f64) -> String {
        if self.deliveries == 0 {
            return "—".into();
        }
        format!("{:.0}", seconds * 1e6 / self.deliveries as f64)
    }
}

/// Creates the section's tables (dropped first) and loads the list into `peer_deliveries`.
pub(crate) async fn setup(admin: &PgPool, workload: &Workload) -> Result<(), BoxError> {
    for statement in [
        "DROP TABLE IF EXISTS peer_deliveries, peer_inbox, peer_inbox_indexed, peer_accounts",
        "DROP SEQUENCE IF EXISTS peer_seq",
        "CREATE TABLE peer_deliveries (seq bigint PRIMARY KEY, key text NOT NULL, \
           account int NOT NULL, amount bigint NOT NULL, fingerprint bytea NOT NULL)",
        "CREATE TABLE peer_inbox (consumer text NOT NULL, key text NOT NULL, \
           PRIMARY KEY (consumer, key))",
        // The naive inbox with what its retention purge needs: the arrival time, indexed.
        "CREATE TABLE peer_inbox_indexed (consumer text NOT NULL, key text NOT NULL, \
           received_at timestamptz NOT NULL DEFAULT now(), PRIMARY KEY (consumer, key))",
        "CREATE INDEX peer_inbox_indexed_received_at ON peer_inbox_indexed (received_at)",
        "CREATE TABLE peer_accounts (id int PRIMARY KEY, balance bigint NOT NULL DEFAULT 0)",
        "CREATE SEQUENCE peer_seq",
    ] {
        sqlx::query(statement).execute(admin).await?;
    }
    let n = workload.deliveries.len();
    let seq: Vec<i64> = (1..=n as i64).collect();
    let keys: Vec<String> = workload
        .deliveries
        .iter()
        .map(|m| m.event_id.to_string())
        .collect();
    let accounts: Vec<i32> = workload.deliveries.iter().map(|m| m.account).collect();
    let amounts: Vec<i64> = workload.deliveries.iter().map(|m| m.amount).collect();
    // What the runtime stores as the delivery's `payload_hash`, for the pgbench row that runs
    // its statements.
    let fingerprints = workload
        .deliveries
        .iter()
        .map(|m| Ok(Fingerprint::of(MESSAGE, m)?.as_bytes().to_vec()))
        .collect::<Result<Vec<Vec<u8>>, BoxError>>()?;
    sqlx::query(
        "INSERT INTO peer_deliveries (seq, key, account, amount, fingerprint) \
         SELECT * FROM UNNEST($1::bigint[], $2::text[], $3::int[], $4::bigint[], $5::bytea[])",
    )
    .bind(seq)
    .bind(keys)
    .bind(accounts)
    .bind(amounts)
    .bind(fingerprints)
    .execute(admin)
    .await?;
    sqlx::query("VACUUM ANALYZE peer_deliveries")
        .execute(admin)
        .await?;
    Ok(())
}

/// Both inboxes empty, the accounts recreated at balance 0, the sequence at the list's start;
/// then (unless `checkpoint` is false) a `CHECKPOINT`, so that every row starts alike.
pub(crate) async fn reset(admin: &PgPool, accounts: i32, checkpoint: bool) -> Result<(), BoxError> {
    crate::scale::truncate(admin).await?;
    sqlx::query("TRUNCATE peer_inbox, peer_inbox_indexed, peer_accounts")
        .execute(admin)
        .await?;
    sqlx::query("INSERT INTO peer_accounts (id) SELECT generate_series(1, $1)")
        .bind(accounts)
        .execute(admin)
        .await?;
    sqlx::query("SELECT setval('peer_seq', 1, false)")
        .execute(admin)
        .await?;
    sqlx::query("VACUUM ANALYZE peer_accounts, peer_inbox, peer_inbox_indexed")
        .execute(admin)
        .await?;
    if checkpoint {
        sqlx::query("CHECKPOINT").execute(admin).await?;
    }
    Ok(())
}

/// The exact-effect check: every balance (and their sum) as the distinct credits say, and
/// `inbox` holding exactly the distinct keys. `Err` says what is wrong.
pub(crate) async fn check(
    admin: &PgPool,
    workload: &Workload,
    inbox: Inbox,
) -> Result<(), BoxError> {
    let balances: Vec<(i32, i64)> =
        sqlx::query_as("SELECT id, balance FROM peer_accounts ORDER BY id")
            .fetch_all(admin)
            .await?;
    let mut problems = Vec::new();
    let want_sum: i64 = workload.expected.iter().sum();
    let got_sum: i64 = balances.iter().map(|(_, b)| b).sum();
    if got_sum != want_sum {
        problems.push(format!("sum of balances {got_sum}, expected {want_sum}"));
    }
    let wrong = balances
        .iter()
        .filter(|(id, balance)| workload.expected.get((*id - 1) as usize) != Some(balance))
        .count();
    if wrong > 0 || balances.len() != workload.expected.len() {
        problems.push(format!(
            "{wrong} of {} balances wrong ({} accounts)",
            workload.expected.len(),
            balances.len()
        ));
    }
    // Rows in the inbox, and how many of them are keys of the list (primary keys: distinct);
    // in the runtime's inbox, `processed` under the section's message name with the key's
    // fingerprint (what the pgbench row running the runtime's statements must store alike).
    let query = match inbox {
        Inbox::Naive | Inbox::NaiveIndexed => format!(
            "SELECT (SELECT count(*) FROM {table}), \
                    (SELECT count(*) FROM {table} WHERE consumer = 'peers' \
                       AND key IN (SELECT key FROM peer_deliveries))",
            table = inbox.table()
        ),
        Inbox::Runtime => "SELECT (SELECT count(*) FROM inbox_messages), \
                (SELECT count(*) FROM inbox_messages m WHERE consumer = 'peers' \
                   AND status = 'processed' AND message_name = 'bench.peers' \
                   AND EXISTS (SELECT 1 FROM peer_deliveries d WHERE d.key = m.message_key::text \
                     AND d.fingerprint = m.payload_hash))"
            .to_owned(),
    };
    let (rows, keys): (i64, i64) = sqlx::query_as(sqlx::AssertSqlSafe(query))
        .fetch_one(admin)
        .await?;
    let want = workload.messages as i64;
    if rows != want || keys != want {
        problems.push(format!(
            "the inbox holds {rows} rows, {keys} of them keys of the list; expected exactly the \
             {want} distinct keys"
        ));
    }
    if problems.is_empty() {
        Ok(())
    } else {
        Err(problems.join("; ").into())
    }
}

/// Whether `python3` can import `psycopg2`: `Err` says why not.
pub(crate) fn psycopg2_available() -> Result<(), String> {
    let output = std::process::Command::new("python3")
        .args(["-c", "import psycopg2"])
        .output()
        .map_err(|e| format!("python3 not runnable: {e}"))?;
    if output.status.success() {
        return Ok(());
    }
    let stderr = String::from_utf8_lossy(&output.stderr);
    Err(format!(
        "python3 cannot import psycopg2 ({}); `pip install psycopg2-binary` (scripts/bench.sh \
         does when the section runs)",
        stderr.lines().last().unwrap_or("no message").trim()
    ))
}

/// The connection environment of python3's libpq: the server, or `target` (the proxy).
fn libpq_env(
    pg: &Pg,
    password: Option<&str>,
    target: Option<(String, u16)>,
) -> Vec<(&'static str, String)> {
    let (host, port) =
        target.unwrap_or_else(|| (pg.opts.get_host().to_owned(), pg.opts.get_port()));
    let mut env = vec![
        ("PGHOST", host),
        ("PGPORT", port.to_string()),
        ("PGUSER", pg.opts.get_username().to_owned()),
        (
            "PGDATABASE",
            pg.opts.get_database().unwrap_or_default().to_owned(),
        ),
        ("PGSSLMODE", "disable".into()),
        ("PGGSSENCMODE", "disable".into()),
    ];
    if let Some(password) = password {
        env.push(("PGPASSWORD", password.to_owned()));
    }
    env
}

/// What a run reports before its check: seconds, CPU, and a failure of its own if any.
pub(crate) struct Ran {
    seconds: f64,
    cpu: CpuDelta,
    client_cpu: f64,
    pub(crate) failure: Option<String>,
}

/// pgbench's `script` ([`naive_script`] or [`PGBENCH_RUNTIME_SCRIPT`]) over the whole list:
/// `clients` clients, enough transactions each for the list (the last few find no delivery left
/// and do nothing).
async fn run_pgbench(
    pg: &Pg,
    workload: &Workload,
    script: &str,
    clients: usize,
) -> Result<Ran, BoxError> {
    let bench = pg.pgbench.as_ref().ok_or("pgbench not found")?;
    let per_client = workload.deliveries.len().div_ceil(clients) as u64;
    let run = bench
        .run_text(
            script,
            &[],
            clients,
            Length::Transactions(per_client),
            None,
            &pg.cpu,
        )
        .await?;
    let s = run.sample;
    Ok(Ran {
        seconds: s.elapsed.as_secs_f64(),
        cpu: s.cpu,
        client_cpu: s.cpu.children,
        failure: s.first_error,
    })
}

/// The psycopg2 reference consumer over the whole list with `workers` threads, connecting to
/// the server or to `target` (the proxy).
pub(crate) async fn run_psycopg2(
    pg: &Pg,
    password: Option<&str>,
    workload: &Workload,
    workers: usize,
    target: Option<(String, u16)>,
) -> Result<Ran, BoxError> {
    #[derive(Deserialize)]
    struct Report {
        deliveries: usize,
        inserted: usize,
        duplicates: usize,
        seconds: f64,
    }
    let script = std::env::temp_dir().join(format!(
        "inbox-bench-peers-{}-psycopg2.py",
        std::process::id()
    ));
    std::fs::write(&script, PSYCOPG2_SCRIPT)?;
    let mut cmd = std::process::Command::new("python3");
    cmd.arg(&script)
        .args(["--workers", &workers.to_string(), "--consumer", CONSUMER])
        .envs(libpq_env(pg, password, target));
    let before = pg.cpu.snapshot();
    let output = tokio::task::spawn_blocking(move || cmd.output()).await??;
    let cpu = pg.cpu.snapshot().since(&before);
    let _ = std::fs::remove_file(&script);
    if !output.status.success() {
        return Err(format!(
            "peers_psycopg2.py failed ({}): {}",
            output.status,
            String::from_utf8_lossy(&output.stderr).trim()
        )
        .into());
    }
    let report: Report = serde_json::from_slice(&output.stdout)?;
    let failure = (report.deliveries != workload.deliveries.len()
        || report.inserted != workload.messages
        || report.duplicates != workload.redeliveries)
        .then(|| {
            format!(
                "{} deliveries: {} inserted, {} duplicates; expected {} and {}",
                report.deliveries,
                report.inserted,
                report.duplicates,
                workload.messages,
                workload.redeliveries
            )
        });
    Ok(Ran {
        seconds: report.seconds,
        cpu,
        client_cpu: cpu.children,
        failure,
    })
}

/// The shared cursor of a row's client tasks: the list's next index, and the start line they
/// all wait at once set up (so that the clock starts when every client is ready).
#[derive(Clone)]
struct Cursor {
    next: Arc<AtomicUsize>,
    start: Arc<tokio::sync::Barrier>,
}

impl Cursor {
    /// Waits until every client (and the clock) is ready.
    async fn started(&self) {
        self.start.wait().await;
    }

    /// The next index of the list to run (past its end when the list is done).
    fn take(&self) -> usize {
        self.next.fetch_add(1, Ordering::Relaxed)
    }
}

/// Runs `workers` client tasks (`client`, given the shared [`Cursor`]; each returns how many
/// new messages it applied and how many duplicates it saw) from a common start to the last
/// one's end, and checks their counts against the list. The CPU is measured over that span.
async fn run_clients<F, Fut>(
    pg: &Pg,
    workload: &Workload,
    workers: usize,
    client: F,
) -> Result<Ran, BoxError>
where
    F: Fn(Cursor) -> Fut,
    Fut: std::future::Future<Output = Result<(usize, usize), BoxError>> + Send + 'static,
{
    let cursor = Cursor {
        next: Arc::new(AtomicUsize::new(0)),
        start: Arc::new(tokio::sync::Barrier::new(workers + 1)),
    };
    let tasks: Vec<_> = (0..workers)
        .map(|_| tokio::spawn(client(cursor.clone())))
        .collect();
    cursor.started().await;
    let before = pg.cpu.snapshot();
    let started = Instant::now();
    let (mut new, mut duplicates, mut failure) = (0, 0, None);
    for task in tasks {
        match task.await? {
            Ok((n, d)) => {
                new += n;
                duplicates += d;
            }
            Err(error) => {
                failure.get_or_insert(error.to_string());
            }
        }
    }
    let seconds = started.elapsed().as_secs_f64();
    let cpu = pg.cpu.snapshot().since(&before);
    if failure.is_none() && (new != workload.messages || duplicates != workload.redeliveries) {
        failure = Some(format!(
            "{new} applied, {duplicates} duplicates; expected {} and {}",
            workload.messages, workload.redeliveries
        ));
    }
    Ok(Ran {
        seconds,
        cpu,
        client_cpu: cpu.client,
        failure,
    })
}

/// The naive inbox as a Rust user writes it by hand with sqlx over the whole list: `workers`
/// tasks, each holding one connection of a pool of `workers`, taking the next delivery of the
/// list; per delivery `begin()`, [`SQLX_CLAIM`], [`EFFECT`] if it inserted, `commit()`.
async fn run_sqlx_naive(pg: &Pg, workload: &Workload, workers: usize) -> Result<Ran, BoxError> {
    let pool = crate::pg_pool(&pg.opts, workers).await?;
    // (key, amount, account) of each delivery, as a consumer has them after decoding.
    let list: Arc<Vec<(String, i64, i32)>> = Arc::new(
        workload
            .deliveries
            .iter()
            .map(|m| (m.event_id.to_string(), m.amount, m.account))
            .collect(),
    );
    let ran = run_clients(pg, workload, workers, |cursor| {
        let (pool, list) = (pool.clone(), list.clone());
        async move {
            let mut conn = pool.acquire().await?;
            let (mut inserted, mut duplicates) = (0_usize, 0_usize);
            cursor.started().await;
            while let Some((key, amount, account)) = list.get(cursor.take()) {
                let mut tx = sqlx::Connection::begin(&mut *conn).await?;
                let new = sqlx::query(SQLX_CLAIM)
                    .bind(CONSUMER)
                    .bind(key.as_str())
                    .execute(&mut *tx)
                    .await?
                    .rows_affected()
                    == 1;
                if new {
                    sqlx::query(EFFECT)
                        .bind(amount)
                        .bind(account)
                        .execute(&mut *tx)
                        .await?;
                    inserted += 1;
                } else {
                    duplicates += 1;
                }
                tx.commit().await?;
            }
            Ok((inserted, duplicates))
        }
    })
    .await;
    pool.close().await;
    ran
}

/// `Dispatcher::dispatch_on` over the whole list: `workers` tasks, each with its own
/// `ConnectionSlot` on a pool of `workers` connections, taking the next delivery of the list.
async fn run_dispatch_on(
    pg: &Pg,
    workload: &Workload,
    envelopes: &Arc<Vec<Envelope>>,
    workers: usize,
) -> Result<Ran, BoxError> {
    let pool = crate::pg_pool(&pg.opts, workers).await?;
    let dispatcher = Arc::new(Dispatcher::from_registry(pool.clone())?);
    let ran = run_clients(pg, workload, workers, |cursor| {
        let (dispatcher, envelopes) = (dispatcher.clone(), envelopes.clone());
        async move {
            let mut slot = ConnectionSlot::new();
            let (mut processed, mut duplicates) = (0_usize, 0_usize);
            cursor.started().await;
            loop {
                let i = cursor.take();
                let Some(envelope) = envelopes.get(i) else {
                    break;
                };
                for outcome in dispatcher.dispatch_on(&mut slot, envelope).await? {
                    match outcome.result {
                        Ok(Outcome::Processed(())) => processed += 1,
                        Ok(Outcome::Duplicate) => duplicates += 1,
                        other => return Err(format!("delivery {i}: {other:?}").into()),
                    }
                }
            }
            Ok((processed, duplicates))
        }
    })
    .await;
    pool.close().await;
    ran
}

/// The Worker's settings after `configure`, as its `Debug` shows them (the dispatcher left out).
fn worker_settings(worker: &Worker<Postgres>) -> String {
    let debug = format!("{worker:?}");
    let Some(start) = debug.find("dispatcher: ") else {
        return debug;
    };
    // The dispatcher's value ends at the first `,` or `}` outside brackets and quotes.
    let mut depth = 0_i32;
    let mut quoted = false;
    let mut end = debug.len();
    let mut chars = debug[start..].char_indices();
    while let Some((i, c)) = chars.next() {
        match c {
            '\\' if quoted => {
                chars.next();
            }
            '"' => quoted = !quoted,
            '(' | '[' | '{' if !quoted => depth += 1,
            ')' | ']' | '}' if !quoted && depth > 0 => depth -= 1,
            ',' | '}' if !quoted && depth == 0 => {
                end = start + i;
                break;
            }
            _ => {}
        }
    }
    let rest = debug[end..].trim_start_matches(',').trim();
    let inner = rest.trim_end_matches('}').trim();
    inner.to_owned()
}

/// The Worker over the whole list (an in-memory source holding it, closed): built by
/// `configure` from `Worker::new` on a pool of `connections`.
async fn run_worker(
    pg: &Pg,
    workload: &Workload,
    envelopes: &[Envelope],
    connections: usize,
    configure: impl FnOnce(Worker<Postgres>) -> Worker<Postgres>,
) -> Result<(Ran, String), BoxError> {
    let pool = crate::pg_pool(&pg.opts, connections).await?;
    let worker = configure(Worker::new(Dispatcher::from_registry(pool.clone())?));
    let settings = worker_settings(&worker);
    let source = MemorySource::new("peers");
    let handle = source.handle();
    for envelope in envelopes {
        handle.push(envelope.clone());
    }
    handle.close();
    let shutdown = CancellationToken::new();
    let stop = shutdown.clone();
    let timer = tokio::spawn(async move {
        tokio::time::sleep(LIMIT).await;
        stop.cancel();
    });
    let before = pg.cpu.snapshot();
    let started = Instant::now();
    let result = worker.run(source, shutdown).await;
    let seconds = started.elapsed().as_secs_f64();
    let cpu = pg.cpu.snapshot().since(&before);
    timer.abort();
    pool.close().await;
    let failure = match result {
        Err(error) => Some(error.to_string()),
        Ok(report) => worker_failure(&report, workload),
    };
    Ok((
        Ran {
            seconds,
            cpu,
            client_cpu: cpu.client,
            failure,
        },
        settings,
    ))
}

/// What a Worker report says went wrong, if anything.
fn worker_failure(report: &WorkerReport, workload: &Workload) -> Option<String> {
    let deliveries = workload.deliveries.len() as u64;
    let ok = report.stop == inbox_runtime::StopReason::SourceExhausted
        && report.deliveries == deliveries
        && report.acked == deliveries
        && report.processed == workload.messages as u64
        && report.duplicates == workload.redeliveries as u64;
    (!ok).then(|| {
        format!(
            "stop {:?}: {} deliveries, {} acked, {} processed, {} duplicates, {} failed, {} \
             requeued, {} abandoned; expected {} deliveries, {} processed, {} duplicates",
            report.stop,
            report.deliveries,
            report.acked,
            report.processed,
            report.duplicates,
            report.failed,
            report.requeued,
            report.abandoned,
            deliveries,
            workload.messages,
            workload.redeliveries
        )
    })
}

/// Runs `row` once on a reset database and checks its effects.
async fn run_row(
    pg: &Pg,
    p: &Profile,
    password: Option<&str>,
    workload: &Workload,
    envelopes: &Arc<Vec<Envelope>>,
    row: Row,
    defaults: &mut Option<String>,
) -> Result<Run, BoxError> {
    reset(&pg.admin, workload.expected.len() as i32, p.name != "smoke").await?;
    tokio::time::sleep(p.settle).await;
    let before = crate::wal(pg).await;
    let n = row.workers();
    let ran = match row {
        Row::Pgbench(_) | Row::PgbenchIndexed(_) => {
            run_pgbench(pg, workload, &naive_script(row.inbox()), n).await
        }
        Row::PgbenchRuntime(_) => run_pgbench(pg, workload, PGBENCH_RUNTIME_SCRIPT, n).await,
        Row::Psycopg2(_) => run_psycopg2(pg, password, workload, n, None).await,
        Row::SqlxNaive(_) => run_sqlx_naive(pg, workload, n).await,
        Row::DispatchOn(_) => run_dispatch_on(pg, workload, envelopes, n).await,
        Row::Worker(_) => run_worker(pg, workload, envelopes, n + 1, |w| {
            w.concurrency(n).one_per_transaction()
        })
        .await
        .map(|(ran, _)| ran),
        Row::WorkerBatch(_) => run_worker(pg, workload, envelopes, n + 1, |w| {
            w.concurrency(n).batch(BATCH, BATCH_WAIT)
        })
        .await
        .map(|(ran, _)| ran),
        Row::WorkerDefault(_) => {
            // Nothing but the concurrency set (and a pool of one connection more).
            run_worker(pg, workload, envelopes, n + 1, |w| w.concurrency(n))
                .await
                .map(|(ran, settings)| {
                    defaults.get_or_insert(settings);
                    ran
                })
        }
        Row::WorkerDefaultDeclared(_) => {
            // Skipped (never run) where the declaration is not possible: see `skipped`.
            match crate::contention::declare_aggregate(|m: &PeerCredit| m.account) {
                Ok(declare) => run_worker(pg, workload, envelopes, n + 1, |w| {
                    declare(w.concurrency(n))
                })
                .await
                .map(|(ran, _)| ran),
                Err(why) => Err(why.into()),
            }
        }
    };
    // Closed backends report their WAL statistics as they exit.
    tokio::time::sleep(p.settle).await;
    let after = crate::wal(pg).await;
    let ran = match ran {
        Ok(ran) => ran,
        Err(error) => Ran {
            seconds: 0.0,
            cpu: CpuDelta::default(),
            client_cpu: 0.0,
            failure: Some(error.to_string()),
        },
    };
    let failure = match ran.failure {
        Some(failure) => Some(failure),
        None => check(&pg.admin, workload, row.inbox())
            .await
            .err()
            .map(|e| e.to_string()),
    };
    Ok(Run {
        seconds: ran.seconds,
        cpu: ran.cpu,
        client_cpu: ran.client_cpu,
        wal_bytes: before.zip(after).map(|(b, a)| a.since(&b).bytes),
        failure,
    })
}

fn ratio_of(a: Option<f64>, b: Option<f64>) -> Option<f64> {
    match (a, b) {
        (Some(a), Some(b)) if a > 0.0 && b > 0.0 => Some(a / b),
        _ => None,
    }
}

fn times(x: Option<f64>) -> String {
    x.map_or("—".into(), |x| format!("{x:.2}×"))
}

/// The section: the round trips on the wire (`wire.rs`), then every row over the rounds (order
/// rotated each round), the tables, the ratios.
pub(crate) async fn section(
    out: &mut Out,
    pg: &Pg,
    p: &Profile,
    args: &Args,
) -> Result<(), BoxError> {
    let sizes = Sizes::of(p, args);
    let password = args.database_url.as_deref().and_then(crate::url_password);
    let python = psycopg2_available();
    let wire = crate::wire::measure(pg, p, sizes, password.as_deref(), &python).await?;
    let workload = Workload::new(SEED, sizes);
    let envelopes = Arc::new(workload.envelopes()?);
    setup(&pg.admin, &workload).await?;
    let clients = args
        .peers_clients
        .clone()
        .unwrap_or_else(|| CLIENTS.to_vec());
    let rows = rows(&clients);
    let skipped = |row: Row| -> Option<String> {
        match row {
            Row::Pgbench(_) | Row::PgbenchIndexed(_) | Row::PgbenchRuntime(_)
                if pg.pgbench.is_none() =>
            {
                Some("pgbench not found".into())
            }
            Row::Psycopg2(_) => python.clone().err(),
            Row::WorkerDefaultDeclared(_) => {
                crate::contention::declare_aggregate(|m: &PeerCredit| m.account).err()
            }
            _ => None,
        }
    };
    let (acc, defaults) = measure(
        pg,
        p,
        password.as_deref(),
        &workload,
        &envelopes,
        &rows,
        &skipped,
    )
    .await?;
    // Truncated: the next section starts from empty inboxes.
    reset(&pg.admin, sizes.accounts, false).await?;

    describe(out, &workload, sizes, p, defaults.as_deref());
    crate::wire::write(out, &wire);
    out.table(&TABLE_HEADER, &table_rows(&acc, &rows, &skipped));
    write_ratios(out, &acc, &clients, &crate::wire::summary(&wire));
    Ok(())
}

/// The header of the section's main table (`compare.rs` finds its columns by these names).
pub(crate) const TABLE_HEADER: [&str; 12] = [
    "path",
    "N",
    "deliveries/s",
    "× naive",
    "× naive + index",
    "client CPU µs/delivery",
    "server CPU µs/delivery",
    "WAL bytes/delivery",
    "WAL × naive",
    "WAL × naive + index",
    "effects",
    "rounds min–max deliveries/s",
];

/// Runs every row (not skipped) over the profile's rounds, the order rotated each round: what
/// each row measured, and the default Worker's settings as run.
async fn measure(
    pg: &Pg,
    p: &Profile,
    password: Option<&str>,
    workload: &Workload,
    envelopes: &Arc<Vec<Envelope>>,
    rows: &[Row],
    skipped: &dyn Fn(Row) -> Option<String>,
) -> Result<(HashMap<Row, Acc>, Option<String>), BoxError> {
    let mut acc: HashMap<Row, Acc> = HashMap::new();
    let mut defaults = None;
    for round in 0..p.rounds {
        let mut order = rows.to_vec();
        order.rotate_left(round % rows.len().max(1));
        for row in order {
            if skipped(row).is_some() {
                continue;
            }
            progress(format!(
                "peers, round {}/{}: {} at {}",
                round + 1,
                p.rounds,
                row.label(),
                row.workers()
            ));
            let run = run_row(pg, p, password, workload, envelopes, row, &mut defaults).await?;
            if let Some(failure) = &run.failure {
                progress(format!("peers: {} FAILED: {failure}", row.label()));
            }
            acc.entry(row)
                .or_default()
                .add(workload.deliveries.len(), run);
        }
    }
    Ok((acc, defaults))
}

/// The table's rows: per row, its rate, CPU and WAL per delivery against pgbench's naive inbox
/// (without and with its retention index), whether its effects were exact, and the spread over
/// the rounds.
fn table_rows(
    acc: &HashMap<Row, Acc>,
    rows: &[Row],
    skipped: &dyn Fn(Row) -> Option<String>,
) -> Vec<Vec<String>> {
    let rate = |row: Row| acc.get(&row).and_then(Acc::rate);
    let wal = |row: Row| acc.get(&row).and_then(Acc::wal_per_delivery);
    let mut table = Vec::new();
    for &row in rows {
        let naive = Row::Pgbench(row.workers());
        let indexed = Row::PgbenchIndexed(row.workers());
        let mut cells = vec![row.label().to_owned(), row.workers().to_string()];
        if let Some(reason) = skipped(row) {
            cells.push(format!("skipped: {reason}"));
            cells.resize(TABLE_HEADER.len(), "—".into());
            table.push(cells);
            continue;
        }
        let Some(a) = acc.get(&row) else { continue };
        let min = a.rates.iter().copied().fold(f64::INFINITY, f64::min);
        let max = a.rates.iter().copied().fold(0.0, f64::max);
        cells.extend([
            a.rate().map_or("**FAILED**".into(), |r| format!("{r:.0}")),
            times(ratio_of(rate(row), rate(naive))),
            times(ratio_of(rate(row), rate(indexed))),
            a.per_delivery_us(a.client_cpu),
            a.server_cpu
                .map_or("—".into(), |server| a.per_delivery_us(server)),
            wal(row).map_or("—".into(), |w| format!("{w:.0}")),
            times(ratio_of(wal(row), wal(naive))),
            times(ratio_of(wal(row), wal(indexed))),
            if a.failures.is_empty() {
                format!("exact ({} of {} runs)", a.runs, a.runs)
            } else {
                format!(
                    "**FAILED** in {} of {} runs: {}",
                    a.failures.len(),
                    a.runs,
                    a.failures[0]
                )
            },
            if a.rates.len() >= 2 {
                format!("{min:.0}–{max:.0}")
            } else {
                "—".into()
            },
        ]);
        table.push(cells);
    }

    table
}

/// What the section measures and how (above its table).
fn describe(out: &mut Out, workload: &Workload, sizes: Sizes, p: &Profile, defaults: Option<&str>) {
    out.line(
        "## The peers' workload (PostgreSQL): ours against pgbench's naive inbox and psycopg2",
    );
    out.line("");
    out.line(format!(
        "One seeded list of {} deliveries: {} distinct messages plus {} redeliveries of earlier \
         ones at seeded random positions, each crediting an amount to one of {} accounts with \
         `{EFFECT}`. Every row runs the whole list in each of {} round(s) (order rotated), on a \
         reset database (the inboxes empty, the accounts recreated at 0, `CHECKPOINT`), taking \
         the deliveries in list order from one shared cursor, N at a time. Rate: median \
         deliveries/s (whole list ÷ wall time from the first delivery to the last); `× naive`: ÷ \
         pgbench's naive inbox at the same N; `× naive + index`: ÷ the same on the naive inbox \
         with its retention index (`received_at`, indexed). CPU per delivery: the client (pgbench, python3 or \
         this process) and the PostgreSQL cluster, over all rounds. WAL: `pg_stat_wal.wal_bytes` \
         delta (cluster-wide, autovacuum included) ÷ deliveries. Effects: after each run, every \
         balance and their sum equal the distinct credits', and the row's inbox holds exactly \
         the distinct keys (`peer_inbox` for pgbench and psycopg2, `peer_inbox_indexed` for \
         pgbench with the index, the runtime's inbox for ours); \
         a row wrong in any run is reported as failed, saying what was wrong, \
         instead of a rate.",
        workload.deliveries.len(),
        workload.messages,
        workload.redeliveries,
        sizes.accounts,
        p.rounds,
    ));
    out.line("");
    out.line(
        "pgbench (`-M prepared`, `-j min(N, CPUs)`) reads the next delivery from \
         `peer_deliveries(seq, key, account, amount)` inside its INSERT (a CTE on \
         `seq = nextval('peer_seq')`: a primary-key lookup, no extra statement); its script:",
    );
    out.line("");
    for line in PGBENCH_SCRIPT.lines() {
        out.line(format!("    {line}"));
    }
    out.line("");
    out.line(
        "The naive inbox with its retention index runs the same script on `peer_inbox_indexed \
         (consumer text, key text, received_at timestamptz NOT NULL DEFAULT now(), PRIMARY KEY \
         (consumer, key))` with `CREATE INDEX … ON peer_inbox_indexed (received_at)`: what the \
         naive inbox needs to purge its old keys by a range scan, as the runtime's does.",
    );
    out.line("");
    out.line(
        "pgbench with the runtime's statements runs, with the same options, what \
         `dispatch_on` sends for one delivery (a fresh key: BEGIN; the claim; the effect; the \
         verification; COMMIT — a duplicate: BEGIN; the claim; ROLLBACK) on the runtime's \
         migrated `inbox_messages` (consumer `peers`, message name `bench.peers`, the \
         fingerprint the runtime computes, precomputed into `peer_deliveries.fingerprint`), the \
         claim a copy of the runtime's (inbox-runtime/src/store/postgres.rs, `CLAIM`) reading \
         the next delivery from `peer_deliveries` as the naive script does. Against the naive \
         row it measures the protocol's statements (the server's side); ours against it, the \
         client (sqlx, the dispatcher, the Worker). Its script:",
    );
    out.line("");
    for line in PGBENCH_RUNTIME_SCRIPT.lines() {
        out.line(format!("    {line}"));
    }
    out.line("");
    out.line(format!(
        "The hand-written sqlx inbox: what a Rust user writes without the runtime, N tasks each \
         holding one connection of a pool of N; per delivery `begin()`, `{SQLX_CLAIM}`, the \
         effect if one row was inserted, `commit()` (4 round trips, sqlx's extended protocol \
         with its statement cache). Against pgbench on the same table it measures sqlx's client \
         against libpq's; ours against it, what the runtime costs over the same client library."
    ));
    out.line("");
    out.line(format!(
        "psycopg2: examples/bench/peers_psycopg2.py, N threads with one connection each (libpq's \
         simple protocol, psycopg2's implicit BEGIN: 4 round trips per new message). Ours: \
         `Dispatcher::dispatch_on` with N tasks each holding a `ConnectionSlot` (pool of N); the \
         Worker over an in-memory source holding the list (pool of N + 1): `concurrency(N)` with \
         `one_per_transaction()`, `concurrency(4)` with `batch({BATCH}, 5 \
         ms)`, and `Worker::new` with nothing but `concurrency(4)`, whose settings at run time \
         were: {}; the same with the aggregate declared (each delivery's account, what its \
         effect locks: partitioned batches, `contention::declare_aggregate`).",
        defaults.unwrap_or("(not run)")
    ));
    out.line("");
}

/// A ratio against its target: `{v}× (target {text}: met)`, or not met, or not measured.
fn target(value: Option<f64>, ok: bool, text: &str) -> String {
    match value {
        Some(v) if ok => format!("{v:.2}× (target {text}: met)"),
        Some(v) => format!("{v:.2}× (target {text}: **not met**)"),
        None => format!("— (target {text}: not measured)"),
    }
}

/// The ratios against the targets (issue 33, "Must show"), under the table: the round trips
/// (`round_trips`, from `wire.rs`), throughput against the naive inbox at each N, the gap split
/// into protocol and client, the default Worker against psycopg2, WAL against the naive inbox
/// with its retention index (and without).
fn write_ratios(out: &mut Out, acc: &HashMap<Row, Acc>, clients: &[usize], round_trips: &[String]) {
    let rate = |row: Row| acc.get(&row).and_then(Acc::rate);
    let wal = |row: Row| acc.get(&row).and_then(Acc::wal_per_delivery);
    let at_least =
        |v: Option<f64>, min: f64, text: &str| target(v, v.is_some_and(|v| v >= min), text);
    let at_most =
        |v: Option<f64>, max: f64, text: &str| target(v, v.is_some_and(|v| v <= max), text);
    let mut lines = round_trips.to_vec();
    for &n in clients {
        let (naive, indexed) = (rate(Row::Pgbench(n)), rate(Row::PgbenchIndexed(n)));
        for (row, name) in [
            (Row::DispatchOn(n), "dispatch_on"),
            (Row::Worker(n), "Worker (1 message per transaction)"),
        ] {
            lines.push(format!(
                "- {n}: {name} ÷ pgbench naive = {}; ÷ pgbench naive with its retention index = {}",
                at_least(ratio_of(rate(row), naive), 1.0, "≥ 1.00"),
                times(ratio_of(rate(row), indexed)),
            ));
        }
        let by_hand = rate(Row::SqlxNaive(n));
        lines.push(format!(
            "- {n}: against the hand-written sqlx inbox (the same client library, the naive \
             statements on the naive inbox with its retention index): dispatch_on ÷ it = {}, \
             Worker 1/tx ÷ it = {}; it ÷ pgbench naive with its index = {} (sqlx's client \
             against libpq's, the same statements)",
            times(ratio_of(rate(Row::DispatchOn(n)), by_hand)),
            times(ratio_of(rate(Row::Worker(n)), by_hand)),
            times(ratio_of(by_hand, indexed)),
        ));
        lines.push(format!(
            "- {n}: Worker ÷ dispatch_on = {}; protocol: pgbench with the runtime's statements ÷ \
             naive pgbench = {} (÷ naive with its index = {}); client: dispatch_on ÷ pgbench with \
             the runtime's statements = {}, Worker 1/tx ÷ the same = {}",
            times(ratio_of(rate(Row::Worker(n)), rate(Row::DispatchOn(n)))),
            times(ratio_of(rate(Row::PgbenchRuntime(n)), naive)),
            times(ratio_of(rate(Row::PgbenchRuntime(n)), indexed)),
            times(ratio_of(
                rate(Row::DispatchOn(n)),
                rate(Row::PgbenchRuntime(n))
            )),
            times(ratio_of(rate(Row::Worker(n)), rate(Row::PgbenchRuntime(n)))),
        ));
    }
    lines.push(format!(
        "- 4: Worker with default settings, the aggregate declared ÷ psycopg2 = {}; undeclared \
         ÷ psycopg2 = {}; Worker::batch(100) ÷ psycopg2 = {}",
        at_least(
            ratio_of(rate(Row::WorkerDefaultDeclared(4)), rate(Row::Psycopg2(4))),
            3.0,
            "≥ 3"
        ),
        times(ratio_of(
            rate(Row::WorkerDefault(4)),
            rate(Row::Psycopg2(4))
        )),
        times(ratio_of(rate(Row::WorkerBatch(4)), rate(Row::Psycopg2(4)))),
    ));
    // The WAL targets are the runtime's rows': not the naive clients', nor pgbench's copy.
    for row in rows(clients)
        .into_iter()
        .filter(|r| r.inbox() == Inbox::Runtime && !matches!(r, Row::PgbenchRuntime(_)))
    {
        let n = row.workers();
        lines.push(format!(
            "- WAL bytes per delivery, {} at {n} ÷ pgbench naive with its retention index = {}; \
             ÷ pgbench naive = {}",
            row.label(),
            at_most(
                ratio_of(wal(row), wal(Row::PgbenchIndexed(n))),
                1.15,
                "≤ 1.15"
            ),
            times(ratio_of(wal(row), wal(Row::Pgbench(n)))),
        ));
    }
    for &n in clients {
        lines.push(format!(
            "- WAL bytes per delivery at {n}: pgbench naive with its retention index ÷ without = \
             {} (the index's share); psycopg2 ÷ pgbench naive = {} (the same statements: about \
             1); pgbench with the runtime's statements ÷ pgbench naive with its index = {} (the \
             protocol's share)",
            times(ratio_of(wal(Row::PgbenchIndexed(n)), wal(Row::Pgbench(n)))),
            times(ratio_of(wal(Row::Psycopg2(n)), wal(Row::Pgbench(n)))),
            times(ratio_of(
                wal(Row::PgbenchRuntime(n)),
                wal(Row::PgbenchIndexed(n))
            ))
        ));
    }
    out.line("Ratios (issue 33, \"Must show\"; medians of this run):");
    out.line("");
    for line in lines {
        out.line(line);
    }
    out.line("");
}
