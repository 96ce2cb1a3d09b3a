//! Round trips per delivery on the wire (issue 33, item 3): the peers' one-statement handler
//! ([`peers::peer_credit`]: `UPDATE peer_accounts … WHERE id = $2`) through every path, each
//! client on one connection through the counting proxy (`proxy.rs`), in steady state.
//!
//! Each client runs a seeded list in order on a reset database and the proxy records everything
//! it sends; the deliveries are then found in the recording, and the round trips between the
//! start of one delivery and the start of a later one are counted (a round trip: a `Sync` or a
//! simple `Query`, see `proxy.rs`). So the counts are per delivery in steady state: warm
//! connections, prepared statements cached, the first and last deliveries of each pass (a
//! connection's first `BEGIN`, the end of an idle transaction when the run stops) left out.
//!
//! * A **delivery starts** at the first statement after the previous delivery's start that
//!   carries its key (the claim, or the redelivery fast path's `SELECT`: the key is a bound
//!   parameter, or a literal in psycopg2's SQL); pgbench reads its delivery inside its SQL, so
//!   its deliveries start at its `BEGIN`s.
//! * **The passes.** The list holds `n` new messages, then the same `n` again (duplicates: the
//!   claim finds each key processed); the runtime's clients then get the same `n` a third time
//!   marked redelivered (`SourceMetadata::redelivered`: the fast path). Batches run a list of
//!   their own, `batches` × 100 new messages. Counted: the middle of each pass, leaving out a
//!   tenth (at least 2) at each end; for batches, every batch but the first and the last.
//! * **Exact effects** in every row: after each client's run, every balance equals the sum of
//!   its account's distinct credits and the client's inbox holds exactly the distinct keys
//!   (`peers::check`); the runtime's clients also count their outcomes (processed, duplicates).

use std::collections::VecDeque;

use inbox_runtime::source::{Delivery, Settle, Settlement, Source, SourceError};
use inbox_runtime::{ConnectionSlot, Dispatcher, Envelope, Outcome, SourceMetadata, Worker};
use sqlx::Postgres;
use sqlx::postgres::PgConnectOptions;
use tokio_util::sync::CancellationToken;

use crate::measure::{BoxError, BoxFuture};
use crate::peers::{self, Inbox, Sizes, Workload};
use crate::pgbench::Length;
use crate::proxy::{self, Entry, Proxy};
use crate::{Out, Pg, Profile, progress};

/// Deliveries per batch of the batch rows.
const BATCH: usize = 100;
/// The list's seed (not the peers' list: these keys are new to it).
const SEED: u64 = 0x3300_0003_0001;

/// Who sends the statements.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Client {
    /// `Dispatcher::dispatch_on` on a held `ConnectionSlot`.
    DispatchOn,
    /// `Dispatcher::dispatch_batch_on` with [`BATCH`] envelopes per call.
    BatchOn,
    /// The `Worker`, `concurrency(1).one_per_transaction()`.
    Worker,
    /// The `Worker`, `concurrency(1).batch(100, 5 ms)`.
    WorkerBatch,
    /// pgbench's naive inbox ([`peers::PGBENCH_SCRIPT`]), one client.
    PgbenchNaive,
    /// pgbench running the runtime's statements ([`peers::PGBENCH_RUNTIME_SCRIPT`]), one client.
    PgbenchRuntime,
    /// The psycopg2 reference consumer, one thread.
    Psycopg2,
}

impl Client {
    pub(crate) fn label(self) -> &'static str {
        match self {
            Client::DispatchOn => "ours: Dispatcher::dispatch_on",
            Client::BatchOn => "ours: Dispatcher::dispatch_batch_on, 100 per call",
            Client::Worker => "ours: Worker, 1 message per transaction",
            Client::WorkerBatch => "ours: Worker::batch(100, 5 ms)",
            Client::PgbenchNaive => "pgbench: naive inbox",
            Client::PgbenchRuntime => "pgbench: the runtime's statements (peers' copy)",
            Client::Psycopg2 => "psycopg2 reference consumer",
        }
    }

    /// The cases it runs, in list order.
    fn cases(self) -> &'static [Case] {
        match self {
            Client::DispatchOn | Client::Worker => &[Case::New, Case::Duplicate, Case::Redelivered],
            Client::BatchOn | Client::WorkerBatch => &[Case::Batch],
            Client::PgbenchNaive | Client::PgbenchRuntime | Client::Psycopg2 => {
                &[Case::New, Case::Duplicate]
            }
        }
    }

    fn inbox(self) -> Inbox {
        match self {
            Client::PgbenchNaive | Client::Psycopg2 => Inbox::Naive,
            _ => Inbox::Runtime,
        }
    }

    /// Whether issue 33's round-trip targets apply (the runtime's single path).
    fn targeted(self) -> bool {
        matches!(self, Client::DispatchOn | Client::Worker)
    }
}

/// The clients, in the order of the table.
pub(crate) const CLIENTS: [Client; 7] = [
    Client::DispatchOn,
    Client::Worker,
    Client::BatchOn,
    Client::WorkerBatch,
    Client::PgbenchNaive,
    Client::PgbenchRuntime,
    Client::Psycopg2,
];

/// What a delivery was.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Case {
    /// A new key.
    New,
    /// A key already processed, not marked redelivered.
    Duplicate,
    /// A key already processed, marked redelivered by its source.
    Redelivered,
    /// A new key in a batch of [`BATCH`].
    Batch,
}

impl Case {
    fn label(self) -> &'static str {
        match self {
            Case::New => "new message",
            Case::Duplicate => "duplicate",
            Case::Redelivered => "redelivered duplicate",
            Case::Batch => "batch of 100 (new messages)",
        }
    }

    /// Issue 33's most round trips per delivery (one-statement handler), where there is one.
    fn target(self) -> Option<f64> {
        match self {
            Case::New => Some(3.0),
            Case::Duplicate => Some(2.0),
            Case::Redelivered => Some(1.0),
            Case::Batch => None,
        }
    }
}

/// Where deliveries start in a recording.
enum Starts<'a> {
    /// At the first entry after the previous start carrying the key (one key per delivery, in
    /// order).
    Keys(&'a [String]),
    /// At every `BEGIN`.
    Begins,
}

/// Whether `entry` carries `needle`: in a simple query's text, or in a bound parameter (a text
/// parameter, or an array of them).
fn carries(entry: &Entry, needle: &[u8]) -> bool {
    let within = |hay: &[u8]| hay.windows(needle.len()).any(|w| w == needle);
    match entry {
        Entry::Query(sql) => within(sql.as_bytes()),
        Entry::Execute { params, .. } => params.iter().flatten().any(|p| within(p)),
        Entry::Sync => false,
    }
}

fn is_begin(entry: &Entry) -> bool {
    let sql = match entry {
        Entry::Query(sql) | Entry::Execute { sql, .. } => sql,
        Entry::Sync => return false,
    };
    sql.trim_start()
        .get(..5)
        .is_some_and(|s| s.eq_ignore_ascii_case("begin"))
}

/// The index in `log` where each delivery starts.
fn starts(log: &[Entry], how: &Starts<'_>) -> Result<Vec<usize>, BoxError> {
    match how {
        Starts::Begins => Ok((0..log.len()).filter(|&i| is_begin(&log[i])).collect()),
        Starts::Keys(keys) => {
            let mut found = Vec::with_capacity(keys.len());
            let mut from = 0;
            for (n, key) in keys.iter().enumerate() {
                let at = (from..log.len())
                    .find(|&i| carries(&log[i], key.as_bytes()))
                    .ok_or_else(|| {
                        format!("delivery {n} (key {key}) not found on the wire after entry {from}")
                    })?;
                found.push(at);
                from = at + 1;
            }
            Ok(found)
        }
    }
}

fn is_round_trip(entry: &Entry) -> bool {
    matches!(entry, Entry::Query(_) | Entry::Sync)
}

/// Round trips from the start of delivery `from` to the start of delivery `to`, and the
/// sequence of delivery `from` alone (one `[…]` per round trip).
fn window(
    log: &[Entry],
    starts: &[usize],
    from: usize,
    to: usize,
) -> Result<(u64, String), BoxError> {
    let (Some(&a), Some(&b), Some(&next)) =
        (starts.get(from), starts.get(to), starts.get(from + 1))
    else {
        return Err(format!(
            "deliveries {from}..{to} are not all on the wire ({} found)",
            starts.len()
        )
        .into());
    };
    let trips = log[a..b].iter().filter(|e| is_round_trip(e)).count() as u64;
    Ok((trips, sequence(&log[a..next])))
}

/// `entries` described one `[…]` per round trip (`proxy::describe`), a run of the same round
/// trip written once with its count (`[UPDATE …] ×98`).
fn sequence(entries: &[Entry]) -> String {
    let mut trips: Vec<(String, usize)> = Vec::new();
    let mut from = 0;
    for (i, entry) in entries.iter().enumerate() {
        if is_round_trip(entry) || i + 1 == entries.len() {
            let trip = proxy::describe(&entries[from..=i]);
            from = i + 1;
            match trips.last_mut() {
                Some((last, n)) if *last == trip => *n += 1,
                _ => trips.push((trip, 1)),
            }
        }
    }
    trips
        .into_iter()
        .map(|(trip, n)| if n > 1 { format!("{trip} ×{n}") } else { trip })
        .collect::<Vec<_>>()
        .join(" ")
}

/// The deliveries of a pass of `n` left out at each end.
fn margin(n: usize) -> usize {
    (n / 10).max(2)
}

/// One row of the table.
struct WireRow {
    client: Client,
    case: Case,
    counted: usize,
    per_delivery: Option<f64>,
    per_batch: Option<f64>,
    sequence: String,
    effects: Result<(), String>,
}

impl WireRow {
    fn cells(&self) -> Vec<String> {
        let trips = |x: Option<f64>| x.map_or("—".into(), |x| format!("{x:.2}"));
        let target = match (
            self.client.targeted(),
            self.case.target(),
            self.per_delivery,
        ) {
            (true, Some(t), Some(v)) if v <= t + 1e-9 => format!("≤ {t:.0}: met"),
            (true, Some(t), Some(_)) => format!("≤ {t:.0}: **not met**"),
            (true, Some(t), None) => format!("≤ {t:.0}: not measured"),
            _ => "—".into(),
        };
        vec![
            self.client.label().into(),
            self.case.label().into(),
            self.counted.to_string(),
            trips(self.per_delivery),
            trips(self.per_batch),
            target,
            match &self.effects {
                Ok(()) => "exact".into(),
                Err(e) => format!("**FAILED**: {e}"),
            },
            format!("`{}`", self.sequence.replace('`', "'").replace('|', "\\|")),
        ]
    }
}

/// What a client's run left: the recording, and what it got wrong before the database check.
struct Recorded {
    log: Vec<Entry>,
    failure: Option<String>,
}

/// The table's rows, measured: every client over its lists through a proxy.
pub(crate) struct Measured {
    rows: Vec<WireRow>,
    n: usize,
    batches: usize,
}

/// Runs every client (pgbench's and psycopg2's when available) through the proxy.
pub(crate) async fn measure(
    pg: &Pg,
    p: &Profile,
    sizes: Sizes,
    password: Option<&str>,
    psycopg2: &Result<(), String>,
) -> Result<Measured, BoxError> {
    let n = (p.rt_messages as usize).max(8);
    let batches = if p.name == "smoke" { 3 } else { 5 };
    let accounts = sizes.accounts;
    let single = Workload::repeated(SEED, n, accounts);
    let batched = Workload::new(
        SEED + 1,
        Sizes {
            messages: batches * BATCH,
            redeliveries: 0,
            accounts,
        },
    );
    let (proxy, popts) = crate::start_proxy(pg).await?;
    let mut rows = Vec::new();
    for client in CLIENTS {
        let skipped = match client {
            Client::PgbenchNaive | Client::PgbenchRuntime if pg.pgbench.is_none() => {
                Some("pgbench not found".to_owned())
            }
            Client::Psycopg2 => psycopg2.clone().err(),
            _ => None,
        };
        if let Some(reason) = skipped {
            progress(format!("wire: {} skipped: {reason}", client.label()));
            continue;
        }
        let workload = if client.cases() == [Case::Batch] {
            &batched
        } else {
            &single
        };
        progress(format!("wire: {}", client.label()));
        peers::setup(&pg.admin, workload).await?;
        peers::reset(&pg.admin, accounts, false).await?;
        proxy.record();
        let run = run_client(pg, &proxy, &popts, password, client, workload).await;
        let log = proxy.take_log();
        keep(client, &log);
        let recorded = match run {
            Ok(failure) => Recorded { log, failure },
            Err(error) => Recorded {
                log,
                failure: Some(error.to_string()),
            },
        };
        let effects = match &recorded.failure {
            Some(failure) => Err(failure.clone()),
            None => peers::check(&pg.admin, workload, client.inbox())
                .await
                .map_err(|e| e.to_string()),
        };
        rows.extend(count(client, workload, n, &recorded.log, effects));
    }
    drop(proxy);
    Ok(Measured { rows, n, batches })
}

/// The rows of one client's run: each case's window counted in `log`.
fn count(
    client: Client,
    workload: &Workload,
    n: usize,
    log: &[Entry],
    effects: Result<(), String>,
) -> Vec<WireRow> {
    let keys: Vec<String> = workload
        .deliveries
        .iter()
        .map(|m| m.event_id.to_string())
        .collect();
    let mut rows = Vec::new();
    let failed = |case: Case, error: String| WireRow {
        client,
        case,
        counted: 0,
        per_delivery: None,
        per_batch: None,
        sequence: "—".into(),
        // The run's own failure first: it may be why the deliveries are not on the wire.
        effects: Err(match &effects {
            Err(run) => format!("{run}; and {error}"),
            Ok(()) => error,
        }),
    };
    if client.cases() == [Case::Batch] {
        rows.push(count_batches(client, &keys, log, effects.clone()));
        return rows;
    }
    // The list's keys, then the redelivered pass's (the first n again) for the runtime's clients.
    let mut all = keys.clone();
    if client.cases().contains(&Case::Redelivered) {
        all.extend(keys[..n].iter().cloned());
    }
    let how = match client {
        Client::PgbenchNaive | Client::PgbenchRuntime => Starts::Begins,
        _ => Starts::Keys(&all),
    };
    let at = match starts(log, &how) {
        Ok(at) => at,
        Err(e) => {
            return client
                .cases()
                .iter()
                .map(|&case| failed(case, e.to_string()))
                .collect();
        }
    };
    let m = margin(n);
    for (pass, &case) in client.cases().iter().enumerate() {
        let (from, to) = (pass * n + m, (pass + 1) * n - m);
        rows.push(match window(log, &at, from, to) {
            Ok((trips, sequence)) => WireRow {
                client,
                case,
                counted: to - from,
                per_delivery: Some(trips as f64 / (to - from) as f64),
                per_batch: None,
                sequence,
                effects: effects.clone(),
            },
            Err(e) => failed(case, e.to_string()),
        });
    }
    rows
}

/// Where each client's recording is kept (the workspace's `target/bench-wire/`, wherever the
/// harness runs from), one line per message: `Q sql` (a simple query), `X sql ⟨params⟩` (an
/// execution, its text parameters), `S` (a `Sync`).
fn kept() -> std::path::PathBuf {
    crate::workspace_target().join("bench-wire")
}

/// Keeps `log` in [`kept`] for inspection (best effort: a failure to write loses only the copy).
fn keep(client: Client, log: &[Entry]) {
    let name: String = client
        .label()
        .chars()
        .map(|c| if c.is_ascii_alphanumeric() { c } else { '_' })
        .collect();
    let mut text = String::new();
    for entry in log {
        let line = match entry {
            Entry::Query(sql) => {
                format!("Q {}", sql.split_whitespace().collect::<Vec<_>>().join(" "))
            }
            Entry::Execute { sql, params, .. } => format!(
                "X {} ⟨{}⟩",
                sql.split_whitespace().collect::<Vec<_>>().join(" "),
                params
                    .iter()
                    .map(|p| p.as_deref().map_or("NULL".into(), String::from_utf8_lossy))
                    .collect::<Vec<_>>()
                    .join(", ")
            ),
            Entry::Sync => "S".into(),
        };
        text.push_str(&line);
        text.push('\n');
    }
    let dir = kept();
    let written = std::fs::create_dir_all(&dir)
        .and_then(|()| std::fs::write(dir.join(format!("{name}.log")), text));
    if let Err(e) = written {
        progress(format!(
            "wire: could not keep the recording in {}: {e}",
            dir.display()
        ));
    }
}

/// Where `bytes` holds a UUID in text (`8-4-4-4-12` hex digits).
fn uuid_ranges(bytes: &[u8]) -> Vec<std::ops::Range<usize>> {
    const DASHES: [usize; 4] = [8, 13, 18, 23];
    let mut found = Vec::new();
    let mut i = 0;
    while i + 36 <= bytes.len() {
        let w = &bytes[i..i + 36];
        let uuid = w.iter().enumerate().all(|(j, b)| {
            if DASHES.contains(&j) {
                *b == b'-'
            } else {
                b.is_ascii_hexdigit()
            }
        });
        if uuid {
            found.push(i..i + 36);
            i += 36;
        } else {
            i += 1;
        }
    }
    found
}

/// The keys (UUIDs in text) `entry` carries, in a simple query's text or in its bound
/// parameters (a text parameter, or an array of them: a batch claim's).
fn uuids(entry: &Entry) -> Vec<&str> {
    match entry {
        Entry::Query(sql) => uuid_ranges(sql.as_bytes())
            .into_iter()
            .filter_map(|r| sql.get(r))
            .collect(),
        Entry::Execute { params, .. } => params
            .iter()
            .flatten()
            .flat_map(|p| {
                uuid_ranges(p)
                    .into_iter()
                    .filter_map(|r| std::str::from_utf8(&p[r]).ok())
            })
            .collect(),
        Entry::Sync => Vec::new(),
    }
}

/// The batch row: a batch starts at the first entry carrying keys of the list not seen before
/// (its claim carries all of them), so the batches are found as the client formed them
/// (the Worker's need not be aligned on the list's hundreds). Counted: every batch but the
/// first and the last.
fn count_batches(
    client: Client,
    keys: &[String],
    log: &[Entry],
    effects: Result<(), String>,
) -> WireRow {
    let mut unseen: std::collections::HashSet<&str> = keys.iter().map(String::as_str).collect();
    // (entry index, new keys it carries)
    let mut batches: Vec<(usize, usize)> = Vec::new();
    for (i, entry) in log.iter().enumerate() {
        let new = uuids(entry)
            .into_iter()
            .filter(|k| unseen.remove(k))
            .count();
        if new > 0 {
            batches.push((i, new));
        }
    }
    let row = |per_delivery, per_batch, counted, sequence, effects| WireRow {
        client,
        case: Case::Batch,
        counted,
        per_delivery,
        per_batch,
        sequence,
        effects,
    };
    if !unseen.is_empty() || batches.len() < 3 {
        let error = format!(
            "{} of {} keys not found on the wire, {} batch(es) found (at least 3 needed)",
            unseen.len(),
            keys.len(),
            batches.len()
        );
        let error = match effects {
            Err(run) => format!("{run}; and {error}"),
            Ok(()) => error,
        };
        return row(None, None, 0, "—".into(), Err(error));
    }
    let (first, last) = (batches[1].0, batches[batches.len() - 1].0);
    let counted: usize = batches[1..batches.len() - 1].iter().map(|b| b.1).sum();
    let trips = log[first..last].iter().filter(|e| is_round_trip(e)).count() as f64;
    let per_batch = trips / (batches.len() - 2) as f64;
    let sequence = sequence(&log[first..batches[2].0]);
    row(
        Some(trips / counted as f64),
        Some(per_batch),
        counted,
        sequence,
        effects,
    )
}

/// Runs `client` over `workload` through the proxy (`popts`): `Ok(Some(…))` says what its own
/// counts got wrong.
async fn run_client(
    pg: &Pg,
    proxy: &Proxy,
    popts: &PgConnectOptions,
    password: Option<&str>,
    client: Client,
    workload: &Workload,
) -> Result<Option<String>, BoxError> {
    let envelopes = workload.envelopes()?;
    let target = Some(("127.0.0.1".to_owned(), proxy.addr().port()));
    let transactions = workload.deliveries.len() as u64;
    match client {
        Client::DispatchOn => dispatch_on(popts, workload, &envelopes).await,
        Client::BatchOn => batch_on(popts, workload, &envelopes).await,
        Client::Worker | Client::WorkerBatch => worker(popts, workload, &envelopes, client).await,
        Client::PgbenchNaive | Client::PgbenchRuntime => {
            let bench = pg.pgbench.as_ref().ok_or("pgbench not found")?;
            let script = if client == Client::PgbenchNaive {
                peers::PGBENCH_SCRIPT
            } else {
                peers::PGBENCH_RUNTIME_SCRIPT
            };
            let run = bench
                .run_text(
                    script,
                    &[],
                    1,
                    Length::Transactions(transactions),
                    target,
                    &pg.cpu,
                )
                .await?;
            Ok(run.sample.first_error)
        }
        Client::Psycopg2 => {
            let ran = peers::run_psycopg2(pg, password, workload, 1, target).await?;
            Ok(ran.failure)
        }
    }
}

/// The envelopes of the redelivered pass: the first `n` again, marked redelivered.
fn redelivered(envelopes: &[Envelope], n: usize) -> Vec<Envelope> {
    envelopes[..n]
        .iter()
        .map(|e| {
            e.clone()
                .with_source(SourceMetadata::new("wire").redelivered(true))
        })
        .collect()
}

/// What the single path must report: `n` processed, then `n` duplicates twice.
fn expect_single(processed: usize, duplicates: usize, workload: &Workload) -> Option<String> {
    let n = workload.messages;
    (processed != n || duplicates != 2 * n).then(|| {
        format!(
            "{processed} processed, {duplicates} duplicates; expected {n} and {}",
            2 * n
        )
    })
}

async fn dispatch_on(
    popts: &PgConnectOptions,
    workload: &Workload,
    envelopes: &[Envelope],
) -> Result<Option<String>, BoxError> {
    let pool = crate::pg_pool(popts, 1).await?;
    let dispatcher = Dispatcher::<Postgres>::from_registry(pool.clone())?;
    let mut slot = ConnectionSlot::new();
    let again = redelivered(envelopes, workload.messages);
    let (mut processed, mut duplicates) = (0, 0);
    for (i, envelope) in envelopes.iter().chain(&again).enumerate() {
        for outcome in dispatcher.dispatch_on(&mut slot, envelope).await? {
            match outcome.result {
                Ok(Outcome::Processed(())) => processed += 1,
                Ok(Outcome::Duplicate) => duplicates += 1,
                other => return Ok(Some(format!("delivery {i}: {other:?}"))),
            }
        }
    }
    drop(slot);
    pool.close().await;
    Ok(expect_single(processed, duplicates, workload))
}

async fn batch_on(
    popts: &PgConnectOptions,
    workload: &Workload,
    envelopes: &[Envelope],
) -> Result<Option<String>, BoxError> {
    let pool = crate::pg_pool(popts, 1).await?;
    let dispatcher = Dispatcher::<Postgres>::from_registry(pool.clone())?;
    let mut slot = ConnectionSlot::new();
    let mut processed = 0;
    for chunk in envelopes.chunks(BATCH) {
        for (i, result) in dispatcher
            .dispatch_batch_on(&mut slot, chunk)
            .await
            .into_iter()
            .enumerate()
        {
            for outcome in result? {
                match outcome.result {
                    Ok(Outcome::Processed(())) => processed += 1,
                    other => return Ok(Some(format!("batch delivery {i}: {other:?}"))),
                }
            }
        }
    }
    drop(slot);
    pool.close().await;
    Ok((processed != workload.messages)
        .then(|| format!("{processed} processed; expected {}", workload.messages)))
}

async fn worker(
    popts: &PgConnectOptions,
    workload: &Workload,
    envelopes: &[Envelope],
    client: Client,
) -> Result<Option<String>, BoxError> {
    let pool = crate::pg_pool(popts, 2).await?;
    let worker = Worker::new(Dispatcher::<Postgres>::from_registry(pool.clone())?).concurrency(1);
    let (worker, list) = if client == Client::WorkerBatch {
        let worker = worker.batch(BATCH, std::time::Duration::from_millis(5));
        (worker, envelopes.to_vec())
    } else {
        let mut list = envelopes.to_vec();
        list.extend(redelivered(envelopes, workload.messages));
        (worker.one_per_transaction(), list)
    };
    let deliveries = list.len() as u64;
    let report = worker
        .run(ListSource::new(list), CancellationToken::new())
        .await?;
    pool.close().await;
    let (processed, duplicates) = if client == Client::WorkerBatch {
        (workload.messages as u64, 0)
    } else {
        (workload.messages as u64, 2 * workload.messages as u64)
    };
    let ok = report.processed == processed
        && report.duplicates == duplicates
        && report.acked == deliveries
        && report.deliveries == deliveries;
    Ok((!ok).then(|| {
        format!(
            "{} deliveries, {} acked, {} processed, {} duplicates, {} failed; expected {deliveries}, \
             {processed} processed, {duplicates} duplicates",
            report.deliveries, report.acked, report.processed, report.duplicates, report.failed
        )
    }))
}

/// A source handing out a list of envelopes as they are (their source metadata included),
/// every one at once; settling does nothing (the Worker's report counts the acks).
struct ListSource {
    queue: VecDeque<Envelope>,
}

impl ListSource {
    fn new(list: Vec<Envelope>) -> Self {
        Self { queue: list.into() }
    }
}

struct Settled;

impl Settle for Settled {
    fn settle(self: Box<Self>, _: Settlement) -> BoxFuture<'static, Result<(), SourceError>> {
        Box::pin(async { Ok(()) })
    }
}

impl Source for ListSource {
    fn name(&self) -> &str {
        "wire"
    }

    fn next(&mut self) -> BoxFuture<'_, Result<Option<Delivery>, SourceError>> {
        // Taken when polled, not when called: a `next()` future dropped unpolled (the Worker
        // selects over it) loses nothing.
        Box::pin(async move { Ok(self.queue.pop_front().map(|e| Delivery::new(e, Settled))) })
    }
}

/// The table (under the peers' heading).
pub(crate) fn write(out: &mut Out, measured: &Measured) {
    let Measured { rows, n, batches } = measured;
    out.line(format!(
        "### Round trips per delivery on the wire (the peers' one-statement handler, in steady \
         state)\n\n\
         Each client on one connection through the counting proxy (a round trip: a `Sync` or a \
         simple `Query`), over a list of {n} new messages, the same {n} again (duplicates: the \
         claim finds each key processed) and, for the runtime's single path, the same {n} a \
         third time marked redelivered (the fast path); batches: {} new messages, {BATCH} per \
         transaction. Counted: the round trips from the start of one delivery to the start of \
         another, in the middle of each pass ({} left out at each end; for batches, all but the \
         first and last batch), so a connection's first `BEGIN` and the end of an idle \
         transaction are not in the figures. A delivery starts at the first statement carrying \
         its key (pgbench's at its `BEGIN`). `one delivery` is the sequence of the first \
         counted delivery (or batch), one `[…]` per round trip. Targets (issue 33, for a \
         one-statement handler): a new message ≤ 3, a duplicate ≤ 2, a redelivered duplicate \
         ≤ 1. Effects checked exactly after every client's run.",
        batches * BATCH,
        margin(*n),
    ));
    out.line("");
    let cells: Vec<Vec<String>> = rows.iter().map(WireRow::cells).collect();
    out.table(
        &[
            "path",
            "delivery",
            "deliveries counted",
            "round trips/delivery",
            "round trips/batch",
            "target",
            "effects",
            "one delivery (or batch) on the wire",
        ],
        &cells,
    );
}

/// The round trips per delivery measured for `dispatch_on` and the Worker, for the ratios.
pub(crate) fn summary(measured: &Measured) -> Vec<String> {
    measured
        .rows
        .iter()
        .filter(|r| r.client.targeted())
        .map(|r| {
            format!(
                "- round trips on the wire, {} — {}: {}",
                r.client.label(),
                r.case.label(),
                match (r.per_delivery, r.case.target(), &r.effects) {
                    (Some(v), Some(t), Ok(())) if v <= t + 1e-9 =>
                        format!("{v:.2} (target ≤ {t:.0}: met)"),
                    (Some(v), Some(t), Ok(())) => format!("{v:.2} (target ≤ {t:.0}: **not met**)"),
                    (_, Some(t), _) => format!("— (target ≤ {t:.0}: not measured)"),
                    _ => "—".into(),
                }
            )
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    const A: &str = "56be5566-d603-4e14-8a41-84324f17e5ae";
    const B: &str = "670279fb-cd06-4187-9d0a-5a45413a57b8";
    const C: &str = "0c15a506-d403-4bcf-b771-0e74551ea545";
    const D: &str = "13c5c7dc-3525-4545-9632-3175071a41e7";

    fn execute(sql: &str, params: &[&[u8]]) -> Entry {
        Entry::Execute {
            sql: sql.into(),
            param_types: Vec::new(),
            params: params.iter().map(|p| Some(p.to_vec())).collect(),
        }
    }

    #[test]
    fn keys_are_found_in_text_and_in_binary_arrays() {
        assert_eq!(
            uuids(&Entry::Query(format!("INSERT … VALUES ('peers', '{A}')"))),
            [A]
        );
        // A binary text[] of two keys: header, then (length, bytes) per element.
        let mut array = vec![0, 0, 0, 1, 0, 0, 0, 0, 0, 0, 0, 25, 0, 0, 0, 2, 0, 0, 0, 1];
        for key in [B, C] {
            array.extend(36_u32.to_be_bytes());
            array.extend(key.as_bytes());
        }
        assert_eq!(uuids(&execute("claim", &[b"peers", &array])), [B, C]);
        assert!(uuids(&Entry::Sync).is_empty());
        // Not a key: a dash out of place.
        assert!(uuids(&Entry::Query("56be5566d-603-4e14-8a41-84324f17e5ae".into())).is_empty());
    }

    #[test]
    fn a_repeated_round_trip_is_written_once_with_its_count() {
        let log = [
            execute("INSERT INTO inbox_messages x", &[]),
            Entry::Sync,
            execute("UPDATE peer_accounts SET balance", &[]),
            Entry::Sync,
            execute("UPDATE peer_accounts SET balance", &[]),
            Entry::Sync,
            Entry::Query("COMMIT".into()),
        ];
        assert_eq!(
            sequence(&log),
            "[INSERT INTO inbox_messages x] [UPDATE peer_accounts SET balance] ×2 [COMMIT]"
        );
    }

    #[test]
    fn batches_start_at_their_claims_and_the_middle_ones_are_counted() {
        let keys: Vec<String> = [A, B, C, D].map(String::from).to_vec();
        // Four batches as a Worker might form them: 1, 2 and 1 keys; the middle two counted.
        let batch = |claimed: &[&str], effects: usize| {
            let mut entries = vec![
                Entry::Query("BEGIN".into()),
                execute("claim", &[claimed.join(",").as_bytes()]),
                Entry::Sync,
            ];
            for _ in 0..effects {
                entries.extend([execute("UPDATE", &[b"1"]), Entry::Sync]);
            }
            entries.extend([
                execute("verify", &[claimed.join(",").as_bytes()]),
                Entry::Sync,
                Entry::Query("COMMIT".into()),
            ]);
            entries
        };
        let log: Vec<Entry> = [batch(&[A], 1), batch(&[B, C], 2), batch(&[D], 1)]
            .concat()
            .into_iter()
            .chain(batch(&[], 0))
            .collect();
        // Only three batches carry new keys: the middle one (B, C) is counted.
        let row = count_batches(Client::WorkerBatch, &keys, &log, Ok(()));
        assert_eq!(row.counted, 2);
        // BEGIN, claim, 2 effects, verify, COMMIT.
        assert_eq!(row.per_batch, Some(6.0));
        assert_eq!(row.per_delivery, Some(3.0));
        assert_eq!(row.effects, Ok(()));
        // A key never on the wire: a failure saying so, not a figure.
        let mut more = keys.clone();
        more.push("ffffffff-ffff-4fff-8fff-ffffffffffff".into());
        let row = count_batches(Client::WorkerBatch, &more, &log, Ok(()));
        assert_eq!(row.per_delivery, None);
        assert_eq!(
            row.effects,
            Err("1 of 5 keys not found on the wire, 3 batch(es) found (at least 3 needed)".into())
        );
    }
}
