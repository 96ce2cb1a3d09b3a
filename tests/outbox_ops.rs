//! Operating the transactional outbox, on both backends: the relay's metrics through a real
//! `metrics` recorder, a row that crashes (or hangs) every relay that publishes it and ends dead
//! without taking its batchmates along, lease-owned marks against the operators' retry and
//! discard, the operators' functions (`outbox::admin`) and `outbox`
//! commands of the CLI (`outbox discard` asking on a terminal, through the ledger demo's `ledger
//! admin`), and the shared retention purge. On PostgreSQL: change data capture as Debezium reads
//! it, with the README's publication and connector settings, from a `pgoutput` logical
//! replication slot.

#![allow(missing_docs)]

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use inbox_runtime::outbox::{Outbox, OutboxMessage, Relay, RoundReport, Transport};
use inbox_runtime::sink::{MemorySink, OutgoingMessage, Sink, SinkError};
use inbox_runtime::{BoxFuture, Component, Message};
use metrics_util::debugging::{DebugValue, DebuggingRecorder, Snapshotter};
use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, Serialize, Deserialize, Message)]
#[message(name = "payments.captured")]
pub struct Captured {
    #[message(key)]
    pub event_id: String,
    pub order_id: String,
    pub amount: i64,
    /// Fail after publishing (the handler's transaction rolls back).
    pub fail: bool,
}

#[derive(Debug, Clone, Serialize, Deserialize, Message)]
#[message(name = "orders.paid")]
pub struct OrderPaid {
    #[message(key)]
    pub order_id: String,
    pub amount: i64,
}

const OUTBOX: Outbox = Outbox::new(&["orders", "audit"]);

/// The outbox of a service whose rows Debezium publishes.
const CDC: Outbox = Outbox::new(&["orders"]).transport(Transport::ChangeDataCapture);

/// A fixed time, long ago, for rows whose times the tests show or purge.
const FIXED_SHOWN: &str = "2026-01-02 03:04:05 UTC";

/// A raw message `{"id": ID}` named `orders.paid` to `destination`, with message id `id`.
fn raw(destination: &str, id: &str, aggregate: Option<&str>) -> OutboxMessage {
    let message = OutboxMessage::raw(destination, "orders.paid", format!(r#"{{"id":"{id}"}}"#))
        .message_id(id);
    match aggregate {
        Some(aggregate) => message.aggregate(aggregate),
        None => message,
    }
}

fn report(
    leased: usize,
    published: usize,
    failed: usize,
    dead: usize,
    abandoned: usize,
    timed_out: usize,
) -> RoundReport {
    let mut report = RoundReport::default();
    report.leased = leased;
    report.published = published;
    report.failed = failed;
    report.dead = dead;
    report.abandoned = abandoned;
    report.timed_out = timed_out;
    report
}

fn ids(messages: &[OutgoingMessage]) -> Vec<&str> {
    messages.iter().map(|m| m.message_id.as_str()).collect()
}

/// What a real recorder (`metrics-util`'s `DebuggingRecorder`) saw. Its snapshots drain what
/// they read (counters, histograms and gauges go back to zero): counters and histograms are
/// summed here across snapshots, gauges are those of the last snapshot ([`Recorded::gauges`]
/// takes one). Keys are `name{label=value,…}`, labels sorted.
struct Recorded {
    snapshotter: Snapshotter,
    counters: BTreeMap<String, u64>,
    gauges: BTreeMap<String, f64>,
    histograms: BTreeMap<String, Vec<f64>>,
}

impl Recorded {
    fn new(recorder: &DebuggingRecorder) -> Self {
        Self {
            snapshotter: recorder.snapshotter(),
            counters: BTreeMap::new(),
            gauges: BTreeMap::new(),
            histograms: BTreeMap::new(),
        }
    }

    fn take(&mut self) {
        self.gauges.clear();
        for (key, _, _, value) in self.snapshotter.snapshot().into_vec() {
            let key = key.key();
            let mut labels: Vec<String> = key
                .labels()
                .map(|l| format!("{}={}", l.key(), l.value()))
                .collect();
            labels.sort();
            let name = if labels.is_empty() {
                key.name().to_owned()
            } else {
                format!("{}{{{}}}", key.name(), labels.join(","))
            };
            match value {
                DebugValue::Counter(n) => *self.counters.entry(name).or_default() += n,
                DebugValue::Gauge(v) => {
                    self.gauges.insert(name, v.0);
                }
                DebugValue::Histogram(values) => self
                    .histograms
                    .entry(name)
                    .or_default()
                    .extend(values.into_iter().map(|v| v.0)),
            }
        }
    }

    fn counter(&mut self, name: &str) -> u64 {
        self.take();
        self.counters.get(name).copied().unwrap_or(0)
    }

    /// The gauges set since the last snapshot, by name.
    fn gauges(&mut self) -> BTreeMap<String, f64> {
        self.take();
        self.gauges.clone()
    }

    fn histogram(&mut self, name: &str) -> Vec<f64> {
        self.take();
        self.histograms.get(name).cloned().unwrap_or_default()
    }

    /// Every counter seen, with its total.
    fn counters(&mut self) -> BTreeMap<String, u64> {
        self.take();
        self.counters
            .iter()
            .filter(|(_, n)| **n > 0)
            .map(|(k, n)| (k.clone(), *n))
            .collect()
    }
}

/// A sink that tells the test the message ids of every batch it is handed, and never answers a
/// batch that holds `poison` (the relay publishing it dies or hangs there); it hands every other
/// batch to `inner`.
struct Poisoned {
    poison: &'static str,
    batches: tokio::sync::mpsc::UnboundedSender<Vec<String>>,
    inner: MemorySink,
}

impl Sink for Poisoned {
    fn publish_batch<'a>(
        &'a self,
        messages: &'a [OutgoingMessage],
    ) -> BoxFuture<'a, Vec<Result<(), SinkError>>> {
        Box::pin(async move {
            let batch: Vec<String> = messages.iter().map(|m| m.message_id.clone()).collect();
            let poisoned = batch.iter().any(|id| id == self.poison);
            let _ = self.batches.send(batch);
            if poisoned {
                std::future::pending::<()>().await;
            }
            self.inner.publish_batch(messages).await
        })
    }
}

/// The next batch a [`Poisoned`] sink was handed (waits up to a minute).
async fn next_batch(
    batches: &mut tokio::sync::mpsc::UnboundedReceiver<Vec<String>>,
) -> Vec<String> {
    tokio::time::timeout(Duration::from_secs(60), batches.recv())
        .await
        .expect("a batch within a minute")
        .expect("the sink is alive")
}

inbox_tests::backend_matrix! {
    use std::sync::atomic::{AtomicBool, Ordering};

    use clap::Parser as _;
    use inbox_runtime::ops::admin::{self, Retention};
    use inbox_runtime::ops::cli::{AdminCli, CliError, execute_to};
    use inbox_runtime::outbox::admin as outbox_admin;
    use inbox_runtime::{Outcome, Permanent, store::OutboxStatus};
    use inbox_tests::count;

    /// A fresh database with the inbox and the outbox.
    async fn outbox_fixture() -> (Pool, Guard) {
        let (pool, guard) = fixture().await;
        inbox_runtime::migrate_components(&pool, &[Component::Inbox, Component::Outbox])
            .await
            .unwrap();
        (pool, guard)
    }

    /// `(message_id, status, attempts)` of every outbox row, by id.
    async fn states(pool: &Pool) -> Vec<(String, String, i32)> {
        sqlx::query_as("SELECT message_id, status, attempts FROM inbox_outbox ORDER BY id")
            .fetch_all(pool)
            .await
            .unwrap()
    }

    fn state(rows: &[(&str, &str, i32)]) -> Vec<(String, String, i32)> {
        rows.iter().map(|(id, s, n)| ((*id).to_owned(), (*s).to_owned(), *n)).collect()
    }

    /// Writes `messages` through `outbox` in one transaction of their own.
    async fn enqueue_with(pool: &Pool, outbox: Outbox, messages: Vec<OutboxMessage>) {
        let mut tx = pool.begin().await.unwrap();
        for message in messages {
            outbox.publish(&mut *tx, message).await.unwrap();
        }
        tx.commit().await.unwrap();
    }

    async fn enqueue(pool: &Pool, messages: Vec<OutboxMessage>) {
        enqueue_with(pool, OUTBOX, messages).await;
    }

    /// On PostgreSQL a row is publishable once every transaction older than its own has ended,
    /// on the whole server (other tests' included): waits for that, so that a round sees every
    /// pending row.
    async fn wait_publishable(pool: &Pool) {
        if BACKEND != Backend::Postgres {
            return;
        }
        let waiting = "SELECT COUNT(*) FROM inbox_outbox WHERE status = 'pending' \
             AND txid >= pg_snapshot_xmin(pg_current_snapshot())";
        let deadline = std::time::Instant::now() + Duration::from_secs(60);
        while count(pool, waiting).await > 0 {
            assert!(std::time::Instant::now() < deadline, "rows never became publishable");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// The next round of `relay` that does something (leases or dead-letters rows); waits up to
    /// a minute (leases to run out).
    async fn next_round(relay: &Relay<Db>) -> RoundReport {
        let deadline = std::time::Instant::now() + Duration::from_secs(60);
        loop {
            let round = relay.run_once().await.unwrap();
            if round.leased > 0 || round.abandoned > 0 {
                return round;
            }
            assert!(std::time::Instant::now() < deadline, "no round did anything");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// Sets the times of every outbox row but the `recent-…` ones (written, sent if sent) to the
    /// fixed time.
    async fn age_outbox(pool: &Pool) {
        let sql = match BACKEND {
            Backend::Postgres => "UPDATE inbox_outbox SET \
                 created_at = TIMESTAMPTZ '2026-01-02 03:04:05+00', \
                 sent_at = CASE WHEN sent_at IS NULL THEN NULL \
                   ELSE TIMESTAMPTZ '2026-01-02 03:04:05+00' END \
                 WHERE message_id NOT LIKE 'recent-%'",
            Backend::MySql => "UPDATE inbox_outbox SET created_at = '2026-01-02 03:04:05', \
                 sent_at = CASE WHEN sent_at IS NULL THEN NULL ELSE '2026-01-02 03:04:05' END \
                 WHERE message_id NOT LIKE 'recent-%'",
            _ => "UPDATE inbox_outbox SET created_at = '2026-01-02T03:04:05.000Z', \
                 sent_at = CASE WHEN sent_at IS NULL THEN NULL \
                   ELSE '2026-01-02T03:04:05.000Z' END \
                 WHERE message_id NOT LIKE 'recent-%'",
        };
        sqlx::query(sql).execute(pool).await.unwrap();
    }

    /// Runs `admin`-style arguments through the CLI on `pool`: the result and what it printed.
    async fn admin_cli(pool: &Pool, args: &str) -> (Result<(), CliError>, String) {
        let cli = AdminCli::try_parse_from(std::iter::once("admin").chain(args.split_whitespace()))
            .unwrap();
        let mut out = Vec::new();
        let result = execute_to(&cli.command, pool, &mut out).await;
        (result, String::from_utf8(out).unwrap())
    }

    /// The operators' scenario: `p1` and `d1` dead (the sink refused them for good), `s1` sent,
    /// `p2` and `d2` pending behind them (same aggregates). Returns the sink's refusal switch.
    async fn operators_scenario(pool: &Pool) -> (MemorySink, Arc<AtomicBool>) {
        enqueue(
            pool,
            vec![
                raw("orders", "p1", Some("p")),
                raw("orders", "p2", Some("p")),
                raw("orders", "s1", None),
                raw("audit", "d1", Some("d")).header("origin", "test"),
                raw("audit", "d2", Some("d")),
            ],
        )
        .await;
        let refuse = Arc::new(AtomicBool::new(true));
        let switch = refuse.clone();
        let sink = MemorySink::new().fail_when(move |m| {
            (switch.load(Ordering::SeqCst) && (m.message_id == "p1" || m.message_id == "d1"))
                .then(|| SinkError::permanent(format!("broker refused {}", m.message_id)))
        });
        wait_publishable(pool).await;
        let relay = Relay::new(pool.clone(), sink.clone());
        assert_eq!(next_round(&relay).await, report(3, 1, 0, 2, 0, 0));
        assert_eq!(
            states(pool).await,
            state(&[
                ("p1", "dead", 1),
                ("p2", "pending", 0),
                ("s1", "sent", 1),
                ("d1", "dead", 1),
                ("d2", "pending", 0),
            ])
        );
        (sink, refuse)
    }

    /// Item 1: every outcome of the relay is counted per destination (dead ones with their
    /// reason), the latency from the row's creation to the sink's confirmation is recorded per
    /// message, and the backlog gauges follow the pending rows per destination, back to zero.
    #[tokio::test]
    async fn the_relay_counts_every_outcome_and_gauges_the_backlog() {
        let recorder = DebuggingRecorder::new();
        let mut recorded = Recorded::new(&recorder);
        let _local = metrics::set_default_local_recorder(&recorder);
        let (pool, _guard) = outbox_fixture().await;
        enqueue(
            &pool,
            vec![
                raw("orders", "o1", None),
                raw("orders", "o2", Some("o")),
                raw("audit", "a1", None),
                raw("audit", "a2", Some("z")),
            ],
        )
        .await;
        let sink = MemorySink::new().fail_when(|m| match m.message_id.as_str() {
            "a1" => Some(SinkError::permanent("message too large")),
            "a2" => Some(SinkError::retryable("broker busy")),
            _ => None,
        });
        let relay = Relay::new(pool.clone(), sink.clone())
            .max_attempts(2)
            .backoff(Duration::ZERO, Duration::ZERO);

        // The backlog before any publish: two rows per destination.
        let backlog = relay.backlog().await.unwrap();
        let lines: Vec<(&str, i64)> =
            backlog.iter().map(|b| (b.destination.as_str(), b.pending)).collect();
        assert_eq!(lines, [("audit", 2), ("orders", 2)]);
        assert!(backlog.iter().all(|b| (0.0..600.0).contains(&b.oldest_pending_secs)));
        let gauges = recorded.gauges();
        assert_eq!(gauges.get("inbox_outbox_pending{destination=audit}"), Some(&2.0));
        assert_eq!(gauges.get("inbox_outbox_pending{destination=orders}"), Some(&2.0));
        for destination in ["audit", "orders"] {
            let oldest = gauges[&format!("inbox_outbox_oldest_pending_seconds{{destination={destination}}}")];
            assert!((0.0..600.0).contains(&oldest), "{oldest}");
        }
        // A sentinel in each gauge, to see the relay write them again.
        for destination in ["audit", "orders"] {
            metrics::gauge!("inbox_outbox_pending", "destination" => destination).set(99.0);
            metrics::gauge!("inbox_outbox_oldest_pending_seconds", "destination" => destination)
                .set(99.0);
        }

        // o1 and o2 go, a1 dies at once (permanent), a2 fails; then a2's second attempt: dead.
        wait_publishable(&pool).await;
        assert_eq!(next_round(&relay).await, report(4, 2, 1, 1, 0, 0));
        assert_eq!(next_round(&relay).await, report(1, 0, 0, 1, 0, 0));
        assert_eq!(ids(&sink.published()), ["o1", "o2"]);

        // No backlog left: the destinations gauged before are set back to zero.
        assert_eq!(relay.backlog().await.unwrap(), Vec::new());
        let gauges = recorded.gauges();
        for destination in ["audit", "orders"] {
            for gauge in ["inbox_outbox_pending", "inbox_outbox_oldest_pending_seconds"] {
                let name = format!("{gauge}{{destination={destination}}}");
                assert_eq!(gauges.get(&name), Some(&0.0), "{name}");
            }
        }
        let counters = recorded.counters();
        assert_eq!(
            counters,
            BTreeMap::from([
                ("inbox_outbox_dead_total{destination=audit,reason=exhausted}".to_owned(), 1),
                ("inbox_outbox_dead_total{destination=audit,reason=permanent}".to_owned(), 1),
                ("inbox_outbox_failed_total{destination=audit}".to_owned(), 1),
                ("inbox_outbox_published_total{destination=orders}".to_owned(), 2),
            ])
        );
        let latencies =
            recorded.histogram("inbox_outbox_publish_latency_seconds{destination=orders}");
        assert_eq!(latencies.len(), 2, "one per published message");
        assert!(latencies.iter().all(|s| (0.0..600.0).contains(s)), "{latencies:?}");
        assert!(recorded.histogram("inbox_outbox_publish_latency_seconds{destination=audit}").is_empty());
        assert_eq!(recorded.histogram("inbox_outbox_sink_batch_seconds").len(), 2, "two rounds");
        assert_eq!(recorded.counter("inbox_outbox_relay_errors_total"), 0);
    }

    /// Item 1, a running relay: `run` sets the backlog gauges itself (one snapshot, at the end:
    /// nothing but the relay wrote them) and reports what its rounds did.
    #[tokio::test]
    async fn a_running_relay_sets_the_backlog_gauges() {
        let recorder = DebuggingRecorder::new();
        let mut recorded = Recorded::new(&recorder);
        let _local = metrics::set_default_local_recorder(&recorder);
        let (pool, _guard) = outbox_fixture().await;
        enqueue(&pool, vec![raw("orders", "f1", None), raw("orders", "f2", None)]).await;
        let hour = Duration::from_secs(3600);
        let relay = Relay::new(
            pool.clone(),
            MemorySink::new().fail_when(|_| Some(SinkError::retryable("broker down"))),
        )
        .backoff(hour, hour)
        .poll_interval(Duration::from_millis(20));
        let shutdown = inbox_runtime::CancellationToken::new();
        let running = tokio::spawn(relay.run(shutdown.clone()));
        let deadline = std::time::Instant::now() + Duration::from_secs(60);
        while count(&pool, "SELECT COUNT(*) FROM inbox_outbox WHERE attempts = 1").await < 2 {
            assert!(std::time::Instant::now() < deadline, "the relay never leased the rows");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        shutdown.cancel();
        let report = running.await.unwrap();
        assert_eq!(
            (report.rounds, report.published, report.failed, report.dead, report.errors),
            (1, 0, 2, 0, 0)
        );
        let gauges = recorded.gauges();
        assert_eq!(gauges.get("inbox_outbox_pending{destination=orders}"), Some(&2.0));
        let oldest = gauges["inbox_outbox_oldest_pending_seconds{destination=orders}"];
        assert!((0.0..600.0).contains(&oldest), "{oldest}");
        assert_eq!(recorded.counter("inbox_outbox_failed_total{destination=orders}"), 2);
    }

    /// Item 4: a row whose publish kills the relay every time. Each lease counts an attempt
    /// before the publish; a row whose lease ran out unmarked is leased again alone (fewest
    /// attempts first), so its batchmates go out; after `max_attempts` leases it is dead with
    /// an error that says the relay never finished publishing it. The relays really die: their
    /// tasks are aborted while the sink holds the publish.
    #[tokio::test]
    async fn a_row_that_kills_every_relay_ends_dead_and_its_batchmates_go() {
        let recorder = DebuggingRecorder::new();
        let mut recorded = Recorded::new(&recorder);
        let _local = metrics::set_default_local_recorder(&recorder);
        let (pool, _guard) = outbox_fixture().await;
        enqueue(
            &pool,
            vec![
                raw("orders", "x1", Some("x")),
                raw("orders", "x2", Some("x")),
                raw("orders", "ok1", None),
                raw("orders", "y1", Some("y")),
            ],
        )
        .await;
        let (tx, mut batches) = tokio::sync::mpsc::unbounded_channel();
        let accepted = MemorySink::new();
        let sink = Arc::new(Poisoned { poison: "x1", batches: tx, inner: accepted.clone() });
        // A relay process: a lease of 500 ms, three attempts.
        let start = || {
            let relay = Relay::new(pool.clone(), sink.clone())
                .lease(Duration::from_millis(500))
                .unwrap()
                .poll_interval(Duration::from_millis(20))
                .max_attempts(3);
            tokio::spawn(relay.run(inbox_runtime::CancellationToken::new()))
        };
        let kill = |relay: tokio::task::JoinHandle<_>| async move {
            relay.abort();
            assert!(relay.await.unwrap_err().is_cancelled());
        };

        // Relay 1 leases every publishable row (x2 waits behind x1) and dies publishing them.
        let relay = start();
        assert_eq!(next_batch(&mut batches).await, ["x1", "ok1", "y1"]);
        kill(relay).await;
        // Relay 2: once their leases ran out, the orphans go one at a time, fewest attempts
        // first, then by id: x1 (1 attempt) alone; it dies again.
        let relay = start();
        assert_eq!(next_batch(&mut batches).await, ["x1"]);
        kill(relay).await;
        // Relay 3: ok1 and y1 (1 attempt each) before x1 (2): each alone, both published; then
        // x1 alone again, and the relay dies a third time.
        let relay = start();
        assert_eq!(next_batch(&mut batches).await, ["ok1"]);
        assert_eq!(next_batch(&mut batches).await, ["y1"]);
        assert_eq!(next_batch(&mut batches).await, ["x1"]);
        kill(relay).await;
        assert_eq!(ids(&accepted.published()), ["ok1", "y1"]);

        // Relay 4: x1's third lease runs out; it has used its three attempts: dead, without
        // another publish. x2 stays behind it.
        let relay = Relay::new(pool.clone(), sink.clone()).max_attempts(3);
        assert_eq!(next_round(&relay).await, report(0, 0, 0, 0, 1, 0));
        assert_eq!(relay.run_once().await.unwrap(), report(0, 0, 0, 0, 0, 0));
        assert!(batches.try_recv().is_err(), "no publish after the third");
        assert_eq!(
            states(&pool).await,
            state(&[("x1", "dead", 3), ("x2", "pending", 0), ("ok1", "sent", 2), ("y1", "sent", 2)])
        );
        let error: Option<String> =
            sqlx::query_scalar("SELECT last_error FROM inbox_outbox WHERE message_id = 'x1'")
                .fetch_one(&pool)
                .await
                .unwrap();
        assert_eq!(
            error.as_deref(),
            Some(
                "the relay never finished publishing it: its lease ran out unmarked 3 times \
                 (each relay that leased it crashed, hung or was stopped before the sink answered)"
            )
        );
        assert_eq!(
            recorded.counter("inbox_outbox_dead_total{destination=orders,reason=abandoned}"),
            1
        );
        assert_eq!(recorded.counter("inbox_outbox_published_total{destination=orders}"), 2);
    }

    /// Item 4, the hang: a relay does not wait for a sink longer than the lease. It leaves the
    /// rows unmarked (timed out), leases the orphans again one at a time, publishes the one that
    /// is not poisoned, and dead-letters the poisoned one once its leases are used up.
    #[tokio::test]
    async fn a_sink_that_hangs_costs_one_lease_per_attempt_then_the_row_is_dead() {
        let recorder = DebuggingRecorder::new();
        let mut recorded = Recorded::new(&recorder);
        let _local = metrics::set_default_local_recorder(&recorder);
        let (pool, _guard) = outbox_fixture().await;
        enqueue(&pool, vec![raw("orders", "h1", Some("h")), raw("orders", "g1", None)]).await;
        let (tx, mut batches) = tokio::sync::mpsc::unbounded_channel();
        let accepted = MemorySink::new();
        let relay = Relay::new(
            pool.clone(),
            Poisoned { poison: "h1", batches: tx, inner: accepted.clone() },
        )
        .lease(Duration::from_millis(300))
        .unwrap()
        .max_attempts(2);

        wait_publishable(&pool).await;
        assert_eq!(next_round(&relay).await, report(2, 0, 0, 0, 0, 2));
        assert_eq!(next_batch(&mut batches).await, ["h1", "g1"]);
        assert_eq!(next_round(&relay).await, report(1, 0, 0, 0, 0, 1));
        assert_eq!(next_batch(&mut batches).await, ["h1"]);
        // g1 (1 attempt) goes alone; h1 (2 attempts, its lease run out) goes dead: in one round
        // or two, depending on when h1's lease ran out.
        let mut total = RoundReport::default();
        while total.published + total.abandoned < 2 {
            let round = next_round(&relay).await;
            total.leased += round.leased;
            total.published += round.published;
            total.abandoned += round.abandoned;
            total.timed_out += round.timed_out;
            total.failed += round.failed;
            total.dead += round.dead;
        }
        assert_eq!(total, report(1, 1, 0, 0, 1, 0));
        assert_eq!(next_batch(&mut batches).await, ["g1"]);
        assert!(batches.try_recv().is_err());
        assert_eq!(ids(&accepted.published()), ["g1"]);
        assert_eq!(states(&pool).await, state(&[("h1", "dead", 2), ("g1", "sent", 2)]));
        assert_eq!(recorded.counter("inbox_outbox_timed_out_total{destination=orders}"), 3);
        assert_eq!(
            recorded.counter("inbox_outbox_dead_total{destination=orders,reason=abandoned}"),
            1
        );
    }

    /// Item 2: the operators' functions: installed, stats per destination and status, list with
    /// filters, show with every column, retry of one dead row and of all, discard.
    #[tokio::test]
    async fn operators_list_show_retry_and_discard_outbox_rows() {
        let (pool, _guard) = fixture().await;
        assert!(!outbox_admin::installed(&pool).await.unwrap());
        inbox_runtime::migrate_components(&pool, &[Component::Outbox]).await.unwrap();
        assert!(outbox_admin::installed(&pool).await.unwrap());
        assert_eq!(outbox_admin::stats(&pool).await.unwrap(), Vec::new());
        let (sink, refuse) = operators_scenario(&pool).await;

        let stats: Vec<(String, OutboxStatus, i64)> = outbox_admin::stats(&pool)
            .await
            .unwrap()
            .into_iter()
            .map(|row| {
                assert!(row.oldest.is_some());
                (row.destination, row.status, row.count)
            })
            .collect();
        let line = |d: &str, s, n| (d.to_owned(), s, n);
        assert_eq!(
            stats,
            [
                line("audit", OutboxStatus::Dead, 1),
                line("audit", OutboxStatus::Pending, 1),
                line("orders", OutboxStatus::Dead, 1),
                line("orders", OutboxStatus::Pending, 1),
                line("orders", OutboxStatus::Sent, 1),
            ]
        );

        let listed = |statuses: &'static [OutboxStatus], destination: Option<&'static str>, limit| {
            let pool = pool.clone();
            async move {
                outbox_admin::list(&pool, statuses, destination, limit)
                    .await
                    .unwrap()
                    .into_iter()
                    .map(|row| {
                        assert_eq!(row.payload, None, "listings do not load payloads");
                        assert_eq!(row.payload_size, 9 + row.message_id.len() as i64);
                        row.message_id
                    })
                    .collect::<Vec<_>>()
            }
        };
        assert_eq!(listed(&[OutboxStatus::Dead], None, 50).await, ["p1", "d1"]);
        assert_eq!(
            listed(&[OutboxStatus::Pending, OutboxStatus::Dead], Some("audit"), 50).await,
            ["d1", "d2"]
        );
        assert_eq!(listed(&OutboxStatus::ALL, None, 50).await, ["p1", "p2", "s1", "d1", "d2"]);
        assert_eq!(listed(&OutboxStatus::ALL, None, 2).await, ["p1", "p2"]);
        assert_eq!(listed(&[OutboxStatus::Sent], Some("audit"), 50).await, Vec::<String>::new());
        assert_eq!(listed(&[], None, 50).await, Vec::<String>::new());

        let d1 = outbox_admin::show(&pool, "d1").await.unwrap().unwrap();
        assert_eq!(d1.id, 4);
        assert_eq!(d1.message_id, "d1");
        assert_eq!(d1.destination, "audit");
        assert_eq!(d1.message_name, "orders.paid");
        assert_eq!(d1.payload.as_deref(), Some(&br#"{"id":"d1"}"#[..]));
        assert_eq!(d1.payload_size, 11);
        assert_eq!(d1.headers_json, r#"{"origin":"test"}"#);
        assert_eq!(d1.aggregate_id.as_deref(), Some("d"));
        assert_eq!(d1.status, OutboxStatus::Dead);
        assert_eq!(d1.attempts, 1);
        assert_eq!(d1.last_error.as_deref(), Some("permanent: broker refused d1"));
        assert_eq!((d1.sent_at.as_deref(), d1.leased_until.as_deref()), (None, None));
        assert!(!d1.created_at.is_empty());
        assert_eq!(d1.txid.is_some(), BACKEND == Backend::Postgres);
        assert_eq!(outbox_admin::show(&pool, "nope").await.unwrap(), None);

        // Retry: only dead rows, by message id; the row keeps its last error until sent.
        assert!(!outbox_admin::retry(&pool, "s1").await.unwrap(), "sent");
        assert!(!outbox_admin::retry(&pool, "p2").await.unwrap(), "pending");
        assert!(!outbox_admin::retry(&pool, "nope").await.unwrap());
        refuse.store(false, Ordering::SeqCst);
        assert!(outbox_admin::retry(&pool, "p1").await.unwrap());
        let p1 = outbox_admin::show(&pool, "p1").await.unwrap().unwrap();
        assert_eq!(
            (p1.status, p1.attempts, p1.leased_until, p1.next_attempt_at, p1.last_error),
            (OutboxStatus::Pending, 0, None, None, Some("permanent: broker refused p1".into()))
        );

        // Discard: only dead rows; d2, which waited behind d1, goes out next.
        assert!(!outbox_admin::discard(&pool, "s1").await.unwrap(), "sent");
        assert!(!outbox_admin::discard(&pool, "d2").await.unwrap(), "pending");
        assert!(outbox_admin::discard(&pool, "d1").await.unwrap());
        assert!(!outbox_admin::discard(&pool, "d1").await.unwrap(), "gone");
        assert_eq!(outbox_admin::retry_dead(&pool, None).await.unwrap(), 0);

        wait_publishable(&pool).await;
        let relay = Relay::new(pool.clone(), sink.clone());
        assert_eq!(next_round(&relay).await, report(2, 2, 0, 0, 0, 0));
        assert_eq!(next_round(&relay).await, report(1, 1, 0, 0, 0, 0));
        assert_eq!(ids(&sink.published()), ["s1", "p1", "d2", "p2"]);
        assert_eq!(
            states(&pool).await,
            state(&[("p1", "sent", 1), ("p2", "sent", 1), ("s1", "sent", 1), ("d2", "sent", 1)])
        );
        let p1 = outbox_admin::show(&pool, "p1").await.unwrap().unwrap();
        assert_eq!((p1.last_error, p1.sent_at.is_some()), (None, true));

        // Retry of every dead row, per destination.
        enqueue(&pool, vec![raw("orders", "e1", None), raw("audit", "e2", None)]).await;
        let failing = Relay::new(
            pool.clone(),
            MemorySink::new().fail_when(|_| Some(SinkError::permanent("refused"))),
        );
        wait_publishable(&pool).await;
        assert_eq!(next_round(&failing).await, report(2, 0, 0, 2, 0, 0));
        assert_eq!(outbox_admin::retry_dead(&pool, Some("audit")).await.unwrap(), 1);
        assert_eq!(outbox_admin::retry_dead(&pool, Some("audit")).await.unwrap(), 0);
        assert_eq!(outbox_admin::retry_dead(&pool, None).await.unwrap(), 1);
        assert_eq!(
            count(&pool, "SELECT COUNT(*) FROM inbox_outbox WHERE status = 'pending'").await,
            2
        );
    }

    /// Lease-owned marks and the operators' functions: a row dead-lettered as abandoned keeps
    /// its last lease's token, so that relay's late confirmation still marks it sent (it was
    /// sent); an operator's retry clears the token, so the old lease marks nothing (neither sent
    /// nor failed) and only the new lease's marks count; a discarded row is gone for every mark.
    /// A token that never leased the row marks nothing.
    #[tokio::test]
    async fn marks_need_the_rows_lease_and_operators_retry_and_discard_revoke_it() {
        use inbox_runtime::store::{OutboxFailure, OutboxStore as _};
        let (pool, _guard) = outbox_fixture().await;
        let message = |id: &str| OutboxMessage::raw("orders", "orders.paid", "{}").message_id(id);
        enqueue(&pool, vec![message("x1"), message("x2"), message("x3")]).await;
        wait_publishable(&pool).await;
        let mut conn = pool.acquire().await.unwrap();
        // One lease of 1 ms, then a lease with one attempt allowed: all three are abandoned.
        let old = conn.lease_outbox(10, 1, 1, "abandoned").await.unwrap();
        let ids: Vec<i64> = old.records.iter().map(|r| r.id).collect();
        assert_eq!(ids.len(), 3);
        let deadline = std::time::Instant::now() + Duration::from_secs(60);
        loop {
            let lease = conn.lease_outbox(10, 60_000, 1, "abandoned").await.unwrap();
            assert!(lease.records.is_empty());
            if lease.abandoned.len() == 3 {
                break;
            }
            assert!(lease.abandoned.is_empty(), "{:?}", lease.abandoned);
            assert!(std::time::Instant::now() < deadline, "the 1 ms lease never ran out");
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        assert_eq!(states(&pool).await, state(&[("x1", "dead", 1), ("x2", "dead", 1), ("x3", "dead", 1)]));

        // A token that never leased the rows marks nothing.
        assert_eq!(conn.mark_outbox_sent(&ids, "not-a-lease").await.unwrap(), Vec::<i64>::new());
        // The abandoned x1's last holder confirms it: it was sent.
        assert_eq!(conn.mark_outbox_sent(&ids[..1], &old.token).await.unwrap(), [ids[0]]);
        // x2 is retried, x3 discarded by an operator: the old lease marks neither.
        assert!(outbox_admin::retry(&pool, "x2").await.unwrap());
        assert!(outbox_admin::discard(&pool, "x3").await.unwrap());
        assert_eq!(conn.mark_outbox_sent(&ids[1..], &old.token).await.unwrap(), Vec::<i64>::new());
        for id in &ids[1..] {
            let failed = conn.mark_outbox_failed(OutboxFailure {
                id: *id,
                token: &old.token,
                error: "late",
                permanent: true,
                max_attempts: 1,
                retry_in_ms: 0,
            }).await;
            assert_eq!(failed.unwrap(), None);
        }
        assert_eq!(states(&pool).await, state(&[("x1", "sent", 1), ("x2", "pending", 0)]));

        // The retried x2's new lease: its marks count, the old one's still do not.
        wait_publishable(&pool).await;
        let new = conn.lease_outbox(10, 60_000, 5, "abandoned").await.unwrap();
        assert_eq!(new.records.iter().map(|r| r.id).collect::<Vec<_>>(), [ids[1]]);
        assert_ne!(new.token, old.token);
        assert_eq!(conn.mark_outbox_sent(&ids, &old.token).await.unwrap(), Vec::<i64>::new());
        assert_eq!(conn.mark_outbox_sent(&ids, &new.token).await.unwrap(), [ids[1]]);
        assert_eq!(states(&pool).await, state(&[("x1", "sent", 1), ("x2", "sent", 1)]));
    }

    /// Item 2, the CLI: `stats` with the outbox (nothing about it when it is not migrated),
    /// `outbox list|show|retry|discard`, times in UTC, clear errors for unknown ids and
    /// destinations and for rows that are not dead.
    #[tokio::test]
    async fn the_outbox_commands_of_the_cli() {
        let (pool, _guard) = fixture().await;
        // Not migrated: `stats` leaves the outbox out; `outbox …` says what to do.
        let (result, printed) = admin_cli(&pool, "stats").await;
        result.unwrap();
        assert_eq!(printed, "inbox: empty\n");
        let (result, printed) = admin_cli(&pool, "outbox list").await;
        assert_eq!(printed, "");
        assert_eq!(
            result.unwrap_err().to_string(),
            "the outbox is not migrated in this database (no inbox_outbox table): migrate it \
             with inbox_runtime::migrate_components(&pool, &[Component::Outbox])"
        );

        inbox_runtime::migrate_components(&pool, &[Component::Outbox]).await.unwrap();
        let (result, printed) = admin_cli(&pool, "stats").await;
        result.unwrap();
        assert_eq!(printed, "inbox: empty\n\noutbox: empty\n");
        operators_scenario(&pool).await;
        age_outbox(&pool).await;

        let (result, printed) = admin_cli(&pool, "stats").await;
        result.unwrap();
        let t = FIXED_SHOWN;
        assert_eq!(
            printed,
            format!(
                "inbox: empty\n\noutbox:\n\
                 DESTINATION  PENDING  SENT  DEAD  OLDEST PENDING           OLDEST DEAD\n\
                 audit              1     0     1  {t}  {t}\n\
                 orders             1     1     1  {t}  {t}\n\
                 (all)              2     1     2\n"
            )
        );

        let (result, printed) = admin_cli(&pool, "outbox list").await;
        result.unwrap();
        let refused = "permanent: broker refused";
        assert_eq!(
            printed,
            format!(
                "MESSAGE ID  DESTINATION  MESSAGE      AGGREGATE  STATUS   ATTEMPTS  CREATED                  LAST ERROR\n\
                 p1          orders       orders.paid  p          dead            1  {t}  {refused} p1\n\
                 p2          orders       orders.paid  p          pending         0  {t}  -\n\
                 d1          audit        orders.paid  d          dead            1  {t}  {refused} d1\n\
                 d2          audit        orders.paid  d          pending         0  {t}  -\n"
            )
        );
        let (result, printed) = admin_cli(&pool, "outbox list --status sent").await;
        result.unwrap();
        assert!(printed.starts_with("MESSAGE ID") && printed.contains("\ns1 "), "{printed}");
        assert_eq!(printed.lines().count(), 2);
        let (result, printed) =
            admin_cli(&pool, "outbox list --status dead --destination audit --limit 1").await;
        result.unwrap();
        assert_eq!(printed.lines().nth(1).unwrap().split_whitespace().next(), Some("d1"));
        assert_eq!(printed.lines().count(), 2);
        let (result, printed) = admin_cli(&pool, "outbox list --status sent --destination audit").await;
        result.unwrap();
        assert_eq!(printed, "no sent outbox messages\n");
        let (result, _) = admin_cli(&pool, "outbox list --destination ordres").await;
        assert_eq!(
            result.unwrap_err().to_string(),
            "unknown outbox destination `ordres`; destinations with rows: audit, orders"
        );

        let (result, printed) = admin_cli(&pool, "outbox show d1").await;
        result.unwrap();
        let transaction = if BACKEND == Backend::Postgres {
            let txid: String = sqlx::query_scalar(
                "SELECT CAST(txid AS TEXT) FROM inbox_outbox WHERE message_id = 'd1'",
            )
            .fetch_one(&pool)
            .await
            .unwrap();
            txid
        } else {
            "-".to_owned()
        };
        assert_eq!(
            printed,
            format!(
                "message id:   d1\n\
                 row id:       4\n\
                 destination:  audit\n\
                 message:      orders.paid\n\
                 aggregate:    d\n\
                 status:       dead\n\
                 attempts:     1\n\
                 created:      {t}\n\
                 next attempt: -\n\
                 leased until: -\n\
                 sent:         -\n\
                 transaction:  {transaction}\n\
                 last error:   permanent: broker refused d1\n\
                 headers:\n  \
                   origin: test\n\
                 payload (11 bytes):\n\
                 {{\n  \"id\": \"d1\"\n}}\n"
            )
        );
        let (result, printed) = admin_cli(&pool, "outbox show s1").await;
        result.unwrap();
        assert!(printed.contains(&format!("\nsent:         {t}\n")), "{printed}");
        assert!(printed.contains("\nheaders:      -\n"), "{printed}");

        let error = |args: &'static str| {
            let pool = pool.clone();
            async move {
                let (result, printed) = admin_cli(&pool, args).await;
                assert_eq!(printed, "", "{args}");
                result.unwrap_err().to_string()
            }
        };
        assert_eq!(error("outbox show nope").await, "no outbox message with id `nope`");
        assert_eq!(error("outbox retry nope").await, "no outbox message with id `nope`");
        assert_eq!(error("outbox discard nope").await, "no outbox message with id `nope`");
        assert_eq!(
            error("outbox retry s1").await,
            "outbox message `s1` is sent, not dead: only dead messages can be retried"
        );
        assert_eq!(
            error("outbox discard p2").await,
            "outbox message `p2` is pending, not dead: only dead messages can be discarded"
        );
        assert_eq!(
            error("outbox retry --dead --destination nowhere").await,
            "unknown outbox destination `nowhere`; destinations with rows: audit, orders"
        );

        // Discard (not asked: not a terminal), retry one, retry the rest.
        let (result, printed) = admin_cli(&pool, "outbox discard d1 --yes").await;
        result.unwrap();
        assert_eq!(
            printed,
            "d1: discarded (deleted; it will never be sent); the rows after it of aggregate d \
             go out next\n"
        );
        assert_eq!(error("outbox discard d1").await, "no outbox message with id `d1`");
        let (result, printed) = admin_cli(&pool, "outbox retry p1").await;
        result.unwrap();
        assert_eq!(
            printed,
            "p1: pending again (attempts reset); relays send it with the same message id\n"
        );
        let (result, printed) = admin_cli(&pool, "outbox retry --dead").await;
        result.unwrap();
        assert_eq!(printed, "0 dead outbox messages pending again\n");
        assert_eq!(
            states(&pool).await,
            state(&[("p1", "pending", 0), ("p2", "pending", 0), ("s1", "sent", 1), ("d2", "pending", 0)])
        );

        // Usage errors.
        let parse = |args: &str| {
            AdminCli::try_parse_from(std::iter::once("admin").chain(args.split_whitespace()))
        };
        assert!(parse("outbox retry").is_err(), "nothing to retry");
        assert!(parse("outbox retry p1 --dead").is_err());
        assert!(parse("outbox retry --destination audit").is_err(), "--destination needs --dead");
        assert!(parse("outbox list --status failed").is_err());
        assert!(parse("outbox discard").is_err());
    }

    /// Item 3: the shared purge deletes the outbox's `sent` rows older than the window, exactly,
    /// in batches, and keeps `pending` and `dead` rows whatever their age, and sent rows within
    /// the window; the dry run shows the same per destination; a database without the outbox
    /// purges as before.
    #[tokio::test]
    async fn the_shared_purge_deletes_old_sent_outbox_rows_and_keeps_the_rest() {
        let (pool, _guard) = fixture().await;
        let retention = Retention::new(Duration::from_secs(3600), Duration::from_secs(3600))
            .unwrap()
            .batch_size(2);
        // Without the outbox: nothing about it.
        let report = admin::purge(&pool, &retention, |_| {}).await.unwrap();
        assert_eq!((report.deleted, report.outbox_deleted, report.batches), (0, 0, 1));
        let (result, printed) =
            admin_cli(&pool, "purge --window 1h --redelivery-horizon 1h --yes").await;
        result.unwrap();
        assert_eq!(
            printed,
            "purged 0 inbox rows older than 1h\n1 statement of at most 1000 rows each\n"
        );

        inbox_runtime::migrate_components(&pool, &[Component::Outbox]).await.unwrap();
        enqueue(
            &pool,
            vec![
                raw("orders", "e1", None),
                raw("orders", "e2", None),
                raw("audit", "e3", None),
                raw("orders", "k1", None),
                raw("orders", "w1", None),
            ],
        )
        .await;
        // Written already sent, for change data capture.
        enqueue_with(&pool, CDC, vec![raw("orders", "c1", None)]).await;
        let sink = MemorySink::new().fail_when(|m| match m.message_id.as_str() {
            "k1" => Some(SinkError::permanent("refused")),
            "w1" => Some(SinkError::retryable("down")),
            _ => None,
        });
        let hour = Duration::from_secs(3600);
        let relay = Relay::new(pool.clone(), sink).backoff(hour, hour);
        wait_publishable(&pool).await;
        assert_eq!(next_round(&relay).await, report_of(5, 3, 1, 1));
        age_outbox(&pool).await;
        // A row sent just now: within the window.
        enqueue_with(&pool, CDC, vec![raw("orders", "recent-1", None)]).await;

        let preview = admin::purge_preview(&pool, &retention).await.unwrap();
        let lines: Vec<(String, OutboxStatus, i64, Option<String>)> = preview
            .outbox
            .iter()
            .map(|r| (r.destination.clone(), r.status, r.count, r.oldest.as_deref().map(admin::utc_time)))
            .collect();
        let fixed = Some(FIXED_SHOWN.to_owned());
        assert_eq!(
            lines,
            [
                ("audit".to_owned(), OutboxStatus::Sent, 1, fixed.clone()),
                ("orders".to_owned(), OutboxStatus::Sent, 3, fixed.clone()),
            ]
        );
        assert_eq!(preview.outbox_sent(), 4);
        let (result, printed) =
            admin_cli(&pool, "purge --window 1h --redelivery-horizon 1h --dry-run").await;
        result.unwrap();
        assert!(printed.contains("\nwould purge 4 sent outbox rows sent before "), "{printed}");
        assert!(printed.ends_with(&format!(
            "DESTINATION  ROWS  OLDEST SENT\naudit           1  {FIXED_SHOWN}\n\
             orders          3  {FIXED_SHOWN}\ndry run: nothing deleted\n"
        )), "{printed}");
        assert_eq!(count(&pool, "SELECT COUNT(*) FROM inbox_outbox").await, 7);

        let mut progress = Vec::new();
        let report = admin::purge(&pool, &retention, |n| progress.push(n)).await.unwrap();
        // Inbox: one empty batch; outbox: 2 + 2, then an empty one.
        assert_eq!((report.deleted, report.outbox_deleted, report.batches), (0, 4, 4));
        assert_eq!(progress, [0, 2, 4, 4]);
        assert_eq!(
            states(&pool).await,
            state(&[("k1", "dead", 1), ("w1", "pending", 1), ("recent-1", "sent", 0)])
        );
        // Again: nothing left to purge; the CLI says so.
        let (result, printed) =
            admin_cli(&pool, "purge --window 1h --redelivery-horizon 1h --yes").await;
        result.unwrap();
        assert_eq!(
            printed,
            "purged 0 inbox rows older than 1h\n\
             purged 0 sent outbox rows older than 1h (pending and dead rows kept)\n\
             2 statements of at most 1000 rows each\n"
        );
        assert_eq!(count(&pool, "SELECT COUNT(*) FROM inbox_outbox").await, 3);
    }

    fn report_of(leased: usize, published: usize, failed: usize, dead: usize) -> RoundReport {
        report(leased, published, failed, dead, 0, 0)
    }

    /// Item 5 on both backends: an outbox for change data capture writes rows already sent, in
    /// the handler's transaction, with the same ids; a rollback leaves nothing; no relay leases
    /// them and no gauge counts them.
    #[tokio::test]
    async fn an_outbox_for_change_data_capture_writes_settled_rows() {
        let (pool, _guard) = outbox_fixture().await;
        let mut conn = pool.acquire().await.unwrap();
        let ok = Captured { event_id: "e-1".into(), order_id: "o-1".into(), amount: 5, fail: false };
        let bad = Captured { event_id: "e-2".into(), order_id: "o-2".into(), amount: 7, fail: true };
        assert!(matches!(cdc_captured(&mut conn, ok.clone()).await.unwrap(), Outcome::Processed(())));
        assert!(cdc_captured(&mut conn, bad).await.is_err());
        let key = ok.idempotency_key().unwrap();
        let id = Outbox::message_id_for("cdc", key.as_str(), 0);
        assert_eq!(states(&pool).await, state(&[(id.as_str(), "sent", 0)]));
        assert_eq!(
            count(&pool, "SELECT COUNT(*) FROM inbox_outbox WHERE sent_at IS NOT NULL").await,
            1
        );
        let relay = Relay::new(pool.clone(), MemorySink::new());
        assert_eq!(relay.run_once().await.unwrap(), RoundReport::default());
        assert_eq!(relay.backlog().await.unwrap(), Vec::new());
    }

    #[inbox_runtime::idempotent(consumer = "cdc")]
    async fn cdc_captured(conn: &mut Conn, msg: Captured) -> Result<(), Permanent> {
        sqlx::query(APPLY_EFFECT)
            .bind(&msg.order_id)
            .bind(msg.amount)
            .execute(&mut *conn)
            .await
            .map_err(Permanent::new)?;
        let paid = OrderPaid { order_id: msg.order_id.clone(), amount: msg.amount };
        CDC.publish(
            &mut *conn,
            OutboxMessage::new("orders", &paid)
                .aggregate(&msg.order_id)
                .header("trace-id", format!("t-{}", msg.event_id)),
        )
        .await
        .map_err(Permanent::new)?;
        if msg.fail {
            return Err(Permanent::new("refused after publishing"));
        }
        Ok(())
    }
}

/// Debezium, as it reads the outbox: PostgreSQL's `pgoutput` plugin over the README's
/// publication, decoded here from a logical replication slot.
mod debezium {
    use std::collections::BTreeMap;

    use super::*;
    use inbox_runtime::Outcome;
    use sqlx::{Connection as _, PgConnection, PgPool};

    /// The README's Debezium section: its publication statement and connector properties.
    struct Documented {
        publication: String,
        properties: BTreeMap<String, String>,
    }

    fn documented() -> Documented {
        let readme = include_str!("../README.md");
        let section = readme
            .split("### Debezium")
            .nth(1)
            .expect("README has a Debezium section");
        let block = |fence: &str| -> String {
            let start = section
                .find(fence)
                .unwrap_or_else(|| panic!("{fence} block"))
                + fence.len();
            let end = start + section[start..].find("```").unwrap();
            section[start..end].trim().to_owned()
        };
        let properties = block("```properties")
            .lines()
            .filter(|line| !line.trim().is_empty() && !line.starts_with('#'))
            .map(|line| {
                let (key, value) = line.split_once('=').expect("key=value");
                (key.trim().to_owned(), value.trim().to_owned())
            })
            .collect();
        Documented {
            publication: block("```sql"),
            properties,
        }
    }

    /// One decoded `pgoutput` message (protocol version 1) of interest.
    #[derive(Debug)]
    enum Change {
        /// An INSERT: the relation's name and the new row, column name → text value.
        Insert(String, BTreeMap<String, Option<String>>),
        /// Any other row change (`U`pdate, `D`elete, `T`runcate).
        Other(char),
    }

    /// Reads a pgoutput stream: relations, then row changes (begin, commit, origin and type
    /// messages are skipped).
    fn decode(messages: &[Vec<u8>]) -> Vec<Change> {
        struct Reader<'a>(&'a [u8]);
        impl Reader<'_> {
            fn u8(&mut self) -> u8 {
                let b = self.0[0];
                self.0 = &self.0[1..];
                b
            }
            fn i16(&mut self) -> i16 {
                let v = i16::from_be_bytes([self.0[0], self.0[1]]);
                self.0 = &self.0[2..];
                v
            }
            fn i32(&mut self) -> i32 {
                let v = i32::from_be_bytes(self.0[..4].try_into().unwrap());
                self.0 = &self.0[4..];
                v
            }
            fn string(&mut self) -> String {
                let end = self.0.iter().position(|b| *b == 0).unwrap();
                let s = String::from_utf8(self.0[..end].to_vec()).unwrap();
                self.0 = &self.0[end + 1..];
                s
            }
            fn bytes(&mut self, n: usize) -> Vec<u8> {
                let v = self.0[..n].to_vec();
                self.0 = &self.0[n..];
                v
            }
        }
        let mut relations: BTreeMap<i32, (String, Vec<String>)> = BTreeMap::new();
        let mut changes = Vec::new();
        for message in messages {
            let mut r = Reader(message);
            match r.u8() {
                b'R' => {
                    let id = r.i32();
                    let namespace = r.string();
                    let name = r.string();
                    let _identity = r.u8();
                    let columns = (0..r.i16())
                        .map(|_| {
                            let _flags = r.u8();
                            let name = r.string();
                            let _type = r.i32();
                            let _modifier = r.i32();
                            name
                        })
                        .collect();
                    relations.insert(id, (format!("{namespace}.{name}"), columns));
                }
                b'I' => {
                    let (relation, columns) = relations[&r.i32()].clone();
                    assert_eq!(r.u8(), b'N');
                    let n = r.i16() as usize;
                    assert_eq!(n, columns.len());
                    let row = columns
                        .into_iter()
                        .map(|column| {
                            let value = match r.u8() {
                                b'n' => None,
                                b't' => {
                                    let len = r.i32() as usize;
                                    Some(String::from_utf8(r.bytes(len)).unwrap())
                                }
                                other => panic!("unexpected tuple kind {}", other as char),
                            };
                            (column, value)
                        })
                        .collect();
                    changes.push(Change::Insert(relation, row));
                }
                kind @ (b'U' | b'D' | b'T') => changes.push(Change::Other(kind as char)),
                _ => {}
            }
        }
        changes
    }

    /// Everything the slot decoded since the last call (consumed).
    async fn changes(conn: &mut PgConnection, slot: &str, publication: &str) -> Vec<Change> {
        let messages: Vec<Vec<u8>> = sqlx::query_scalar(
            "SELECT data FROM pg_logical_slot_get_binary_changes($1, NULL, NULL, \
             'proto_version', '1', 'publication_names', $2)",
        )
        .bind(slot)
        .bind(publication)
        .fetch_all(&mut *conn)
        .await
        .unwrap();
        decode(&messages)
    }

    #[inbox_runtime::idempotent(consumer = "cdc-debezium")]
    async fn cdc_captured(
        conn: &mut sqlx::PgConnection,
        msg: Captured,
    ) -> Result<(), inbox_runtime::Permanent> {
        use inbox_runtime::Permanent;
        sqlx::query(inbox_tests::APPLY_EFFECT)
            .bind(&msg.order_id)
            .bind(msg.amount)
            .execute(&mut *conn)
            .await
            .map_err(Permanent::new)?;
        let paid = OrderPaid {
            order_id: msg.order_id.clone(),
            amount: msg.amount,
        };
        CDC.publish(
            &mut *conn,
            OutboxMessage::new("orders", &paid)
                .aggregate(&msg.order_id)
                .header("trace-id", format!("t-{}", msg.event_id)),
        )
        .await
        .map_err(Permanent::new)?;
        if msg.fail {
            return Err(Permanent::new("refused after publishing"));
        }
        Ok(())
    }

    /// Item 5: with the README's publication, a publish committed in a handler's transaction
    /// appears in the decoded change stream once, as an INSERT into `public.inbox_outbox`, with
    /// the columns the README's connector settings map (event id, key, payload, route, extra
    /// headers) holding the message's values; a rolled-back publish never appears; the purge's
    /// deletes (and any update) are not published.
    #[tokio::test]
    async fn debezium_reads_committed_publishes_with_the_documented_mapping() {
        let doc = documented();
        let pool: PgPool = inbox_tests::pg_pool(4).await;
        inbox_runtime::migrate_components(&pool, &[Component::Outbox])
            .await
            .unwrap();
        let level: String = sqlx::query_scalar("SHOW wal_level")
            .fetch_one(&pool)
            .await
            .unwrap();
        assert_eq!(
            level, "logical",
            "scripts/pg.sh starts PostgreSQL with wal_level=logical"
        );

        // The README's publication, word for word; the connector's own settings name it.
        sqlx::raw_sql(sqlx::AssertSqlSafe(doc.publication.clone()))
            .execute(&pool)
            .await
            .unwrap();
        let property = |key: &str| -> String {
            doc.properties
                .get(key)
                .unwrap_or_else(|| panic!("README sets {key}"))
                .clone()
        };
        assert_eq!(property("plugin.name"), "pgoutput");
        assert_eq!(property("table.include.list"), "public.inbox_outbox");
        let publication = property("publication.name");
        assert!(doc.publication.contains(&publication));

        // A temporary slot (dropped with its session), as Debezium's replication connection
        // holds one. Slot names are server-wide: this database's name makes it unique.
        let mut replication = PgConnection::connect_with(&pool.connect_options())
            .await
            .unwrap();
        let database: String = sqlx::query_scalar("SELECT current_database()")
            .fetch_one(&mut replication)
            .await
            .unwrap();
        let slot = format!("debezium_{database}");
        sqlx::query("SELECT pg_create_logical_replication_slot($1, 'pgoutput', true)")
            .bind(&slot)
            .execute(&mut replication)
            .await
            .unwrap();

        // One committed publish (through an #[idempotent] handler), one rolled back.
        let mut conn = pool.acquire().await.unwrap();
        let ok = Captured {
            event_id: "e-1".into(),
            order_id: "order-7".into(),
            amount: 5,
            fail: false,
        };
        let bad = Captured {
            event_id: "e-2".into(),
            order_id: "order-8".into(),
            amount: 7,
            fail: true,
        };
        assert!(matches!(
            cdc_captured(&mut conn, ok.clone()).await.unwrap(),
            Outcome::Processed(())
        ));
        assert!(cdc_captured(&mut conn, bad).await.is_err());
        drop(conn);
        let key = ok.idempotency_key().unwrap();
        let message_id = Outbox::message_id_for("cdc-debezium", key.as_str(), 0);
        let payload = serde_json::to_vec(&OrderPaid {
            order_id: "order-7".into(),
            amount: 5,
        })
        .unwrap();

        let decoded = changes(&mut replication, &slot, &publication).await;
        let [Change::Insert(relation, row)] = &decoded[..] else {
            panic!("exactly one INSERT expected, decoded {decoded:?}")
        };
        assert_eq!(relation, "public.inbox_outbox");
        let column = |name: &str| -> String {
            row.get(name)
                .unwrap_or_else(|| panic!("the stream has column {name}"))
                .clone()
                .unwrap_or_else(|| panic!("{name} is set"))
        };
        // What each documented setting maps.
        let router = |option: &str| property(&format!("transforms.outbox.{option}"));
        assert_eq!(column(&router("table.field.event.id")), message_id);
        assert_eq!(column(&router("table.field.event.key")), "order-7");
        assert_eq!(column(&router("route.by.field")), "orders");
        let bytea = column(&router("table.field.event.payload"));
        assert_eq!(
            bytea,
            format!("\\x{}", hex(&payload)),
            "the payload bytes, as stored"
        );
        let mut placed = BTreeMap::new();
        for placement in router("table.fields.additional.placement").split(',') {
            let parts: Vec<&str> = placement.split(':').collect();
            assert_eq!(parts[1], "header", "{placement}");
            placed.insert(parts[2].to_owned(), column(parts[0]));
        }
        assert_eq!(
            placed,
            BTreeMap::from([
                (
                    "inbox-headers".to_owned(),
                    r#"{"trace-id":"t-e-1"}"#.to_owned()
                ),
                ("message-name".to_owned(), "orders.paid".to_owned()),
            ])
        );
        // The relay's bookkeeping columns the connector leaves out exist (the setting names
        // real columns), and none of the mapped ones is among them.
        let excluded = property("column.exclude.list");
        for name in excluded.split(',') {
            let column_name = name
                .strip_prefix("public.inbox_outbox.")
                .expect("qualified");
            assert!(row.contains_key(column_name), "{column_name}");
        }
        for option in [
            "table.field.event.id",
            "table.field.event.key",
            "table.field.event.payload",
            "route.by.field",
        ] {
            assert!(
                !excluded.contains(&format!(".{}", router(option))),
                "{option}"
            );
        }
        assert_eq!(
            column("status"),
            "sent",
            "written settled: no relay waits for it"
        );

        // The purge deletes it after the window: the publication sends inserts only.
        sqlx::query("UPDATE inbox_outbox SET sent_at = now() - interval '2 hours'")
            .execute(&pool)
            .await
            .unwrap();
        let retention = inbox_runtime::ops::admin::Retention::new(
            Duration::from_secs(3600),
            Duration::from_secs(3600),
        )
        .unwrap();
        let purged = inbox_runtime::ops::admin::purge(&pool, &retention, |_| {})
            .await
            .unwrap();
        assert_eq!(purged.outbox_deleted, 1);
        let kinds: Vec<char> = changes(&mut replication, &slot, &publication)
            .await
            .iter()
            .map(|change| match change {
                Change::Insert(..) => 'I',
                Change::Other(kind) => *kind,
            })
            .collect();
        assert_eq!(
            kinds,
            Vec::<char>::new(),
            "no change published after the insert"
        );
        replication.close().await.unwrap();
    }

    fn hex(bytes: &[u8]) -> String {
        bytes.iter().map(|b| format!("{b:02x}")).collect()
    }
}

/// `outbox discard` asks first on a terminal, as `purge` does: through the ledger demo's
/// `ledger admin` on a pseudo-terminal (util-linux's `script`) and without one.
#[path = "ledger_support.rs"]
mod support;

mod terminal {
    use std::io::Write as _;
    use std::process::{Command, Stdio};

    use super::*;

    const QUESTION: &str = "discard outbox message m-1 (orders.paid to orders, dead after 1 \
        attempt)? it will never be sent, and the rows after it of aggregate a go out next.\r\n\
        discard it? [y/N] ";

    /// Runs `ledger admin --database-url URL ARGS` with `input` on standard input, on a terminal
    /// or through a pipe: the exit code and everything printed.
    fn admin(url: &str, args: &str, input: &str, tty: bool) -> (i32, String) {
        let bin = super::support::ledger_bin().display().to_string();
        let command = format!("{bin} admin --database-url {url} {args}");
        let mut child = if tty {
            Command::new("script")
                .args(["-qec", &command, "/dev/null"])
                .stdin(Stdio::piped())
                .stdout(Stdio::piped())
                .stderr(Stdio::piped())
                .spawn()
                .expect("run util-linux's script")
        } else {
            Command::new("sh")
                .args(["-c", &format!("{command} 2>&1")])
                .stdin(Stdio::piped())
                .stdout(Stdio::piped())
                .spawn()
                .unwrap()
        };
        child
            .stdin
            .take()
            .unwrap()
            .write_all(input.as_bytes())
            .unwrap();
        let output = child.wait_with_output().unwrap();
        (
            output.status.code().unwrap_or(-1),
            String::from_utf8_lossy(&output.stdout).into_owned(),
        )
    }

    /// Removes the private copy of the demo binary.
    struct RemoveCopy;

    impl Drop for RemoveCopy {
        fn drop(&mut self) {
            let _ = std::fs::remove_file(super::support::ledger_bin());
        }
    }

    #[tokio::test]
    async fn a_discard_asks_on_a_terminal() {
        let _remove = RemoveCopy;
        let (pool, file) = inbox_tests::sqlite_pool(1).await;
        inbox_runtime::migrate_components(&pool, &[Component::Outbox])
            .await
            .unwrap();
        let mut tx = pool.begin().await.unwrap();
        for id in ["m-1", "m-2", "m-3"] {
            OUTBOX
                .publish(&mut *tx, raw("orders", id, Some("a")).message_id(id))
                .await
                .unwrap();
        }
        tx.commit().await.unwrap();
        // m-1 refused for good: dead; m-2 and m-3 wait behind it.
        let relay = Relay::new(
            pool.clone(),
            MemorySink::new().fail_when(|_| Some(SinkError::permanent("refused"))),
        );
        assert_eq!(relay.run_once().await.unwrap(), report(1, 0, 0, 1, 0, 0));
        let url = format!("sqlite:{}", file.0.display());
        let rows = || inbox_tests::count(&pool, "SELECT COUNT(*) FROM inbox_outbox");

        // On a terminal: asked; "n" (or nothing) keeps the row.
        for answer in ["n\n", "\n"] {
            let (code, printed) = admin(&url, "outbox discard m-1", answer, true);
            assert_eq!(code, 1, "{printed}");
            assert!(printed.contains(QUESTION), "{printed:?}");
            assert!(
                printed.ends_with("ledger admin: discard cancelled: outbox message `m-1` kept\r\n"),
                "{printed:?}"
            );
            assert_eq!(rows().await, 3);
        }
        // "y" discards it.
        let (code, printed) = admin(&url, "outbox discard m-1", "y\n", true);
        assert_eq!(code, 0, "{printed}");
        assert!(printed.contains(QUESTION), "{printed:?}");
        assert!(
            printed.ends_with(
                "m-1: discarded (deleted; it will never be sent); the rows after it of aggregate \
                 a go out next\r\n"
            ),
            "{printed:?}"
        );
        assert_eq!(rows().await, 2);

        // `--yes` on a terminal, and no terminal at all: no question.
        assert_eq!(relay.run_once().await.unwrap(), report(1, 0, 0, 1, 0, 0));
        let (code, printed) = admin(&url, "outbox discard m-2 --yes", "", true);
        assert_eq!(code, 0, "{printed}");
        assert!(!printed.contains("discard it?"), "{printed:?}");
        assert_eq!(rows().await, 1);
        assert_eq!(relay.run_once().await.unwrap(), report(1, 0, 0, 1, 0, 0));
        let (code, printed) = admin(&url, "outbox discard m-3", "n\n", false);
        assert_eq!(
            (code, printed.as_str()),
            (
                0,
                "m-3: discarded (deleted; it will never be sent); the rows after it of aggregate \
                 a go out next\n"
            )
        );
        assert_eq!(rows().await, 0);
        let (code, printed) = admin(&url, "outbox discard m-3", "", false);
        assert_eq!(
            (code, printed.as_str()),
            (1, "ledger admin: no outbox message with id `m-3`\n")
        );
        pool.close().await;
    }
}
