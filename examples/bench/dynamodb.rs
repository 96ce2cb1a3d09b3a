//! The DynamoDB store (`--only dynamodb`, examples feature `dynamodb`): deliveries per second
//! and DynamoDB calls per delivery of [`DynamoInbox::process`] against a DynamoDB endpoint
//! (`--dynamodb-endpoint` / `DYNAMODB_ENDPOINT`; `scripts/bench.sh --only dynamodb` starts a
//! throwaway serial moto), each delivery's effect a counter `Update` in the claim's transaction:
//!
//! * **new keys**: one task, each delivery a key of its own: a `GetItem` and a
//!   `TransactWriteItems`;
//! * **duplicates**: the same keys again: a `GetItem` each, nothing written;
//! * **storm**: 16 tasks take 3 deliveries of each of `keys` keys in a shuffled order (seeded):
//!   every counter must end at exactly 1; transient cancellations resent are counted.
//!
//! Calls come from [`DynamoStats`] (each call once, whatever the SDK's own retries); every run
//! checks its effects (each counter read back). Tables of their own per run, deleted afterwards.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use inbox_runtime::dynamodb::sdk::Client;
use inbox_runtime::dynamodb::sdk::types::{
    AttributeDefinition, AttributeValue, BillingMode, KeySchemaElement, KeyType,
    ScalarAttributeType, Update,
};
use inbox_runtime::dynamodb::{self, DynamoError, DynamoInbox, DynamoStats};
use inbox_runtime::{Message, Outcome, Permanent};
use rand_chacha::rand_core::{Rng as _, SeedableRng as _};

use crate::Out;
use crate::measure::BoxError;

/// A credit of one unit to the counter of `account`.
#[derive(Clone, Debug, serde::Serialize, serde::Deserialize, Message)]
#[message(name = "bench.credited")]
struct Credit {
    #[message(key)]
    id: String,
    account: String,
}

/// The consumer of every delivery.
const CONSUMER: &str = "bench";

/// Tasks of the storm.
const STORM_TASKS: usize = 16;

/// An inbox table and a counters table of their own (fresh names).
struct Tables {
    inbox: DynamoInbox,
    counters: String,
}

impl Tables {
    async fn new(client: &Client, run: &str) -> Result<Self, BoxError> {
        let suffix = uuid::Uuid::new_v4().simple().to_string();
        let inbox = DynamoInbox::new(client.clone(), format!("bench_{run}_{suffix}"));
        inbox.ensure_table().await?;
        let counters = format!("bench_{run}_{suffix}-counters");
        client
            .create_table()
            .table_name(&counters)
            .billing_mode(BillingMode::PayPerRequest)
            .attribute_definitions(
                AttributeDefinition::builder()
                    .attribute_name("id")
                    .attribute_type(ScalarAttributeType::S)
                    .build()?,
            )
            .key_schema(
                KeySchemaElement::builder()
                    .attribute_name("id")
                    .key_type(KeyType::Hash)
                    .build()?,
            )
            .send()
            .await
            .map_err(|e| dynamodb::sdk::error::DisplayErrorContext(e).to_string())?;
        Ok(Self { inbox, counters })
    }

    /// One delivery of `msg`: its effect is `ADD n :one` on the counter of its account.
    async fn deliver(&self, msg: &Credit) -> Result<Outcome<()>, DynamoError<Permanent>> {
        self.inbox
            .process(CONSUMER, msg, |mut tx| async move {
                tx.update(
                    Update::builder()
                        .table_name(&self.counters)
                        .key("id", AttributeValue::S(msg.account.clone()))
                        .update_expression("ADD n :one")
                        .expression_attribute_values(":one", AttributeValue::N("1".into()))
                        .build()
                        .map_err(Permanent::new)?,
                );
                Ok((tx, ()))
            })
            .await
    }

    /// Every counter's value: how many counters there are, and how many are not 1.
    async fn counters(&self) -> Result<(usize, usize), BoxError> {
        let mut pages = self
            .inbox
            .client()
            .scan()
            .table_name(&self.counters)
            .consistent_read(true)
            .into_paginator()
            .items()
            .send();
        let (mut count, mut wrong) = (0, 0);
        while let Some(item) = pages.next().await {
            let item =
                item.map_err(|e| dynamodb::sdk::error::DisplayErrorContext(e).to_string())?;
            count += 1;
            if !matches!(item.get("n"), Some(AttributeValue::N(n)) if n == "1") {
                wrong += 1;
            }
        }
        Ok((count, wrong))
    }

    /// Deletes both tables (errors ignored: the server is throwaway).
    async fn delete(self) {
        let client = self.inbox.client();
        for table in [self.inbox.table(), self.counters.as_str()] {
            let _ = client.delete_table().table_name(table).send().await;
        }
    }
}

/// One row's measurement.
struct Row {
    path: String,
    deliveries: usize,
    elapsed: Duration,
    latencies: Vec<Duration>,
    stats: DynamoStats,
    outcomes: String,
    effects: String,
}

impl Row {
    fn cells(&self) -> Vec<String> {
        let mut sorted = self.latencies.clone();
        sorted.sort();
        let at = |q: f64| {
            sorted
                .get(((sorted.len() as f64 * q).ceil() as usize).saturating_sub(1))
                .map_or("—".into(), |d| format!("{:.2}", d.as_secs_f64() * 1000.0))
        };
        vec![
            self.path.clone(),
            self.deliveries.to_string(),
            format!(
                "{:.0}",
                self.deliveries as f64 / self.elapsed.as_secs_f64().max(1e-9)
            ),
            at(0.5),
            at(0.99),
            format!(
                "{:.2} ({} calls)",
                self.stats.calls as f64 / self.deliveries.max(1) as f64,
                self.stats.calls
            ),
            self.stats.transient_retries.to_string(),
            self.outcomes.clone(),
            self.effects.clone(),
        ]
    }
}

/// The difference of two snapshots of one inbox's counters.
fn since(after: DynamoStats, before: DynamoStats) -> DynamoStats {
    let mut stats = after;
    stats.calls -= before.calls;
    stats.transient_retries -= before.transient_retries;
    stats
}

fn credit(run: &str, k: usize) -> Credit {
    Credit {
        id: format!("{run}-{k}"),
        account: format!("acct-{k}"),
    }
}

/// New keys, then the same keys again, in one task.
async fn sequential(client: &Client, keys: usize) -> Result<[Row; 2], BoxError> {
    let tables = Tables::new(client, "seq").await?;
    let mut rows = Vec::new();
    for (path, expected) in [
        ("new keys (1 task)", "processed"),
        ("duplicates (1 task)", "duplicate"),
    ] {
        crate::progress(format!("dynamodb: {path}, {keys} deliveries"));
        let before = tables.inbox.stats();
        let mut latencies = Vec::with_capacity(keys);
        let started = Instant::now();
        for k in 0..keys {
            let one = Instant::now();
            let outcome = tables.deliver(&credit("seq", k)).await?;
            latencies.push(one.elapsed());
            let kind = outcome.kind();
            if kind != expected {
                return Err(format!("{path}: key {k} was {kind}, expected {expected}").into());
            }
        }
        let elapsed = started.elapsed();
        let stats = since(tables.inbox.stats(), before);
        let (count, wrong) = tables.counters().await?;
        if count != keys || wrong != 0 {
            return Err(format!(
                "{path}: {count} counters, {wrong} not at 1 (expected {keys} at 1)"
            )
            .into());
        }
        rows.push(Row {
            path: path.into(),
            deliveries: keys,
            elapsed,
            latencies,
            stats,
            outcomes: format!("{keys} {expected}"),
            effects: format!("{count} counters at 1"),
        });
    }
    tables.delete().await;
    let [new, dup] = <[Row; 2]>::try_from(rows).map_err(|_| "two rows")?;
    Ok([new, dup])
}

/// 16 tasks, 3 deliveries of each of `keys` keys in a shuffled (seeded) order.
async fn storm(client: &Client, keys: usize) -> Result<Row, BoxError> {
    crate::progress(format!(
        "dynamodb: storm, {STORM_TASKS} tasks × 3 deliveries of {keys} keys"
    ));
    let tables = Arc::new(Tables::new(client, "storm").await?);
    let mut work: Vec<usize> = (0..keys).flat_map(|k| [k, k, k]).collect();
    // Fisher-Yates on ChaCha8's raw output (seeded): the same order on every run.
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(35);
    for i in (1..work.len()).rev() {
        let j = (rng.next_u64() % (i as u64 + 1)) as usize;
        work.swap(i, j);
    }
    let deliveries = work.len();
    let work = Arc::new(Mutex::new(work));
    let started = Instant::now();
    let mut tasks = Vec::new();
    for _ in 0..STORM_TASKS {
        let (tables, work) = (tables.clone(), work.clone());
        tasks.push(tokio::spawn(async move {
            let (mut processed, mut duplicates) = (0_usize, 0_usize);
            let mut latencies = Vec::new();
            loop {
                let Some(k) = work.lock().unwrap_or_else(|p| p.into_inner()).pop() else {
                    break;
                };
                let one = Instant::now();
                match tables.deliver(&credit("storm", k)).await {
                    Ok(Outcome::Processed(())) => processed += 1,
                    Ok(Outcome::Duplicate) => duplicates += 1,
                    Ok(other) => return Err(format!("storm key {k}: {}", other.kind())),
                    Err(error) => return Err(format!("storm key {k}: {error}")),
                }
                latencies.push(one.elapsed());
            }
            Ok::<_, String>((processed, duplicates, latencies))
        }));
    }
    let (mut processed, mut duplicates, mut latencies) = (0, 0, Vec::new());
    for task in tasks {
        let (p, d, l) = task.await??;
        processed += p;
        duplicates += d;
        latencies.extend(l);
    }
    let elapsed = started.elapsed();
    let stats = tables.inbox.stats();
    let (count, wrong) = tables.counters().await?;
    if (processed, duplicates) != (keys, 2 * keys) || count != keys || wrong != 0 {
        return Err(format!(
            "storm: processed={processed} duplicates={duplicates}, {count} counters, {wrong} not \
             at 1 (expected {keys}, {}, {keys} at 1)",
            2 * keys
        )
        .into());
    }
    if let Ok(tables) = Arc::try_unwrap(tables) {
        tables.delete().await;
    }
    Ok(Row {
        path: format!("storm: {STORM_TASKS} tasks × 3 deliveries of {keys} keys"),
        deliveries,
        elapsed,
        latencies,
        stats,
        outcomes: format!("{processed} processed, {duplicates} duplicate"),
        effects: format!("{count} counters at 1"),
    })
}

/// The section: the rows above at the profile's size.
pub(crate) async fn section(out: &mut Out, profile: &str, endpoint: &str) -> Result<(), BoxError> {
    let (keys, storm_keys) = match profile {
        "smoke" => (20, 20),
        "quick" => (200, 200),
        "full" => (1_000, 500),
        _ => (500, 500),
    };
    let client = dynamodb::client(Some(endpoint)).await;
    let [new, dup] = sequential(&client, keys).await?;
    let storm = storm(&client, storm_keys).await?;
    out.line("## Amazon DynamoDB (`DynamoInbox::process`)");
    out.line("");
    out.line(format!(
        "Endpoint {endpoint}. Each delivery's effect is a counter `Update` in the claim's \
         `TransactWriteItems`; every run reads its counters back (`effects`). DynamoDB calls per \
         delivery come from `DynamoStats` (each call once, whatever the SDK's retries): a new key \
         costs 2 (`GetItem`, `TransactWriteItems`), a duplicate 1 (`GetItem`). Against moto, the \
         rates say nothing about AWS: moto answers one request at a time in Python and copies \
         each table a transaction touches (so a transaction slows as the inbox table grows); \
         the calls per delivery are the figure that carries over."
    ));
    out.line("");
    out.table(
        &[
            "path",
            "deliveries",
            "deliveries/s",
            "p50 ms",
            "p99 ms",
            "calls/delivery",
            "transient retries",
            "outcomes",
            "effects",
        ],
        &[new.cells(), dup.cells(), storm.cells()],
    );
    Ok(())
}
