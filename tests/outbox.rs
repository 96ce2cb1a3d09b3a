//! The transactional outbox: publish in the handler's transaction (committed with the effect,
//! gone with a rollback, the same message ids when a handler runs again, bad input refused), and
//! the relay (per-aggregate order, poison isolation, a crash between publish and mark, the
//! retention purge, lease-owned marks: two relays and a paused one) on every backend; on
//! PostgreSQL the late-commit (no skip) rule, the per-aggregate order of writers that do and do
//! not serialize on the aggregate, and two relays at once; the NATS JetStream sink end to end.

#![allow(missing_docs)]

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use inbox_runtime::outbox::{Outbox, OutboxError, OutboxMessage, Relay, RoundReport};
use inbox_runtime::sink::{MemorySink, OutgoingMessage, Sink, SinkError};
use inbox_runtime::{BoxFuture, Classify, Component, ErrorClass, Message};
use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, Serialize, Deserialize, Message)]
#[message(name = "payments.captured")]
pub struct Captured {
    #[message(key)]
    pub event_id: String,
    pub order_id: String,
    pub amount: i64,
    /// Fail the first run after publishing (then succeed).
    pub fail_once: bool,
}

#[derive(Debug, Clone, Serialize, Deserialize, Message)]
#[message(name = "orders.paid")]
pub struct OrderPaid {
    #[message(key)]
    pub order_id: String,
    pub amount: i64,
}

/// A message whose serialization fails.
#[derive(Debug, Clone, Serialize, Deserialize, Message)]
#[message(name = "test.unserializable")]
pub struct Unserializable {
    #[message(key)]
    pub id: String,
    #[serde(serialize_with = "refuse")]
    pub value: i64,
}

fn refuse<S: serde::Serializer>(_: &i64, _: S) -> Result<S::Ok, S::Error> {
    Err(serde::ser::Error::custom("refused to serialize"))
}

/// A delivery that publishes one bad message (`case` names which).
#[derive(Debug, Clone, Serialize, Deserialize, Message)]
#[message(name = "test.bad")]
pub struct BadCase {
    #[message(key)]
    pub id: String,
    pub case: String,
}

const OUTBOX: Outbox = Outbox::new(&["orders", "audit"]);

#[derive(Debug, thiserror::Error)]
pub enum HandlerError {
    #[error("injected failure after publishing")]
    Injected,
    #[error(transparent)]
    Outbox(#[from] OutboxError),
    #[error(transparent)]
    Db(#[from] sqlx::Error),
}

impl Classify for HandlerError {
    fn class(&self) -> ErrorClass {
        match self {
            HandlerError::Injected => ErrorClass::Retryable,
            HandlerError::Outbox(error) => error.class(),
            HandlerError::Db(error) => error.class(),
        }
    }
}

/// Per event id: the message ids each run of the handler published, in order.
static RUNS: Mutex<Option<HashMap<String, Vec<Vec<String>>>>> = Mutex::new(None);

fn record_run(event_id: &str, ids: Vec<String>) -> usize {
    let mut runs = RUNS.lock().unwrap();
    let runs = runs
        .get_or_insert_with(HashMap::new)
        .entry(event_id.into())
        .or_default();
    runs.push(ids);
    runs.len()
}

fn runs(event_id: &str) -> Vec<Vec<String>> {
    RUNS.lock()
        .unwrap()
        .as_ref()
        .and_then(|runs| runs.get(event_id).cloned())
        .unwrap_or_default()
}

fn raw(id: &str, aggregate: Option<&str>) -> OutboxMessage {
    let message =
        OutboxMessage::raw("orders", "orders.paid", format!(r#"{{"id":"{id}"}}"#)).message_id(id);
    match aggregate {
        Some(aggregate) => message.aggregate(aggregate),
        None => message,
    }
}

fn ids(messages: &[OutgoingMessage]) -> Vec<&str> {
    messages.iter().map(|m| m.message_id.as_str()).collect()
}

fn round(leased: usize, published: usize, failed: usize, dead: usize) -> RoundReport {
    let mut report = RoundReport::default();
    report.leased = leased;
    report.published = published;
    report.failed = failed;
    report.dead = dead;
    report
}

/// A sink that hands messages to `inner`, then never answers: the relay "dies" between the
/// publish and the mark when its round is dropped.
struct CrashAfterPublish(MemorySink);

impl Sink for CrashAfterPublish {
    fn publish_batch<'a>(
        &'a self,
        messages: &'a [OutgoingMessage],
    ) -> BoxFuture<'a, Vec<Result<(), SinkError>>> {
        Box::pin(async move {
            let _ = self.0.publish_batch(messages).await;
            std::future::pending().await
        })
    }
}

/// Every confirmation the sinks of a lease test gave, in order: `(relay, message id)`.
type Confirmations = Arc<Mutex<Vec<(&'static str, String)>>>;

/// How a [`GatedSink`] holds a batch before answering.
enum Gate {
    /// Answers at once: accepts everything.
    Open,
    /// Blocks its thread until the test sends the verdict (`true`: accept): the relay is paused
    /// between leasing and marking, as a stopped process or a long pause would be. Needs a
    /// multi-threaded runtime (`block_in_place`).
    Pause(Mutex<std::sync::mpsc::Receiver<bool>>),
    /// Waits (asynchronously) until the test sends the verdict: the relay holds its lease.
    Wait(tokio::sync::Mutex<tokio::sync::mpsc::UnboundedReceiver<bool>>),
}

/// A sink for the lease tests: tells the test which messages (with their attempt) it was given,
/// holds them at its gate, then accepts or refuses them all, logging each confirmation.
struct GatedSink {
    relay: &'static str,
    gate: Gate,
    given: tokio::sync::mpsc::UnboundedSender<Vec<(String, u32)>>,
    confirmations: Confirmations,
}

impl GatedSink {
    /// A sink for `relay` with `gate`, and the receiver of what it is given.
    fn new(
        relay: &'static str,
        gate: Gate,
        confirmations: &Confirmations,
    ) -> (
        Self,
        tokio::sync::mpsc::UnboundedReceiver<Vec<(String, u32)>>,
    ) {
        let (given, receiver) = tokio::sync::mpsc::unbounded_channel();
        let sink = Self {
            relay,
            gate,
            given,
            confirmations: confirmations.clone(),
        };
        (sink, receiver)
    }
}

impl Sink for GatedSink {
    fn publish_batch<'a>(
        &'a self,
        messages: &'a [OutgoingMessage],
    ) -> BoxFuture<'a, Vec<Result<(), SinkError>>> {
        Box::pin(async move {
            let batch = messages
                .iter()
                .map(|m| (m.message_id.clone(), m.attempt))
                .collect();
            let _ = self.given.send(batch);
            let accept = match &self.gate {
                Gate::Open => true,
                Gate::Pause(verdict) => {
                    tokio::task::block_in_place(|| verdict.lock().unwrap().recv().unwrap_or(false))
                }
                Gate::Wait(verdict) => verdict.lock().await.recv().await.unwrap_or(false),
            };
            messages
                .iter()
                .map(|m| {
                    if accept {
                        self.confirmations
                            .lock()
                            .unwrap()
                            .push((self.relay, m.message_id.clone()));
                        Ok(())
                    } else {
                        Err(SinkError::retryable("broker unreachable"))
                    }
                })
                .collect()
        })
    }
}

inbox_tests::backend_matrix! {
    use inbox_runtime::{Disposition, Error, Outcome};
    use inbox_tests::{count, effect, inbox_row, make_due};

    /// A fresh database with the inbox and the outbox.
    async fn outbox_fixture() -> (Pool, Guard) {
        let (pool, guard) = fixture().await;
        inbox_runtime::migrate_components(&pool, &[Component::Inbox, Component::Outbox])
            .await
            .unwrap();
        (pool, guard)
    }

    /// `(message_id, destination, status, attempts, aggregate)` of every outbox row, by id.
    async fn rows(pool: &Pool) -> Vec<(String, String, String, i32, Option<String>)> {
        sqlx::query_as(
            "SELECT message_id, destination, status, attempts, aggregate_id \
             FROM inbox_outbox ORDER BY id",
        )
        .fetch_all(pool)
        .await
        .unwrap()
    }

    /// Writes `messages` in one transaction of their own.
    async fn enqueue(pool: &Pool, messages: Vec<OutboxMessage>) {
        let mut tx = pool.begin().await.unwrap();
        for message in messages {
            OUTBOX.publish(&mut *tx, message).await.unwrap();
        }
        tx.commit().await.unwrap();
    }

    /// The next round that finds work (on PostgreSQL, rows wait for every older transaction on
    /// the server to end: other tests' included).
    async fn busy_round(relay: &Relay<Db>, pool: &Pool) -> RoundReport {
        let deadline = std::time::Instant::now() + Duration::from_secs(20);
        // On PostgreSQL a row is eligible once every transaction older than it has ended, on
        // the whole server (other tests' transactions included): wait for all of them, so that
        // the round sees every pending row, not a prefix.
        if BACKEND == Backend::Postgres {
            let waiting = "SELECT COUNT(*) FROM inbox_outbox WHERE status = 'pending' \
                 AND txid >= pg_snapshot_xmin(pg_current_snapshot())";
            while inbox_tests::count(pool, waiting).await > 0
                && std::time::Instant::now() < deadline
            {
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }
        loop {
            let report = relay.run_once().await.unwrap();
            if report.leased > 0 || std::time::Instant::now() > deadline {
                return report;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    #[inbox_runtime::idempotent(consumer = "orders")]
    async fn on_captured(conn: &mut Conn, msg: Captured) -> Result<(), HandlerError> {
        sqlx::query(APPLY_EFFECT)
            .bind(&msg.order_id)
            .bind(msg.amount)
            .execute(&mut *conn)
            .await?;
        let paid = OrderPaid { order_id: msg.order_id.clone(), amount: msg.amount };
        let first = OUTBOX
            .publish(&mut *conn, OutboxMessage::new("orders", &paid).aggregate(&msg.order_id))
            .await?;
        let second = OUTBOX
            .publish(&mut *conn, OutboxMessage::new("audit", &paid).header("origin", "test"))
            .await?;
        let run = record_run(&msg.event_id, vec![first, second]);
        if msg.fail_once && run == 1 {
            return Err(HandlerError::Injected);
        }
        Ok(())
    }

    #[inbox_runtime::idempotent(consumer = "bad")]
    async fn publish_bad(conn: &mut Conn, msg: BadCase) -> Result<(), OutboxError> {
        sqlx::query(APPLY_EFFECT).bind(&msg.id).bind(1_i64).execute(&mut *conn).await?;
        let paid = OrderPaid { order_id: msg.id.clone(), amount: 1 };
        let message = match msg.case.as_str() {
            "unknown destination" => OutboxMessage::new("nowhere", &paid),
            "empty destination" => OutboxMessage::new("", &paid),
            "empty id" => OutboxMessage::new("orders", &paid).message_id(""),
            "long id" => OutboxMessage::new("orders", &paid).message_id("x".repeat(256)),
            "unserializable" => {
                OutboxMessage::new("orders", &Unserializable { id: msg.id.clone(), value: 1 })
            }
            "empty header name" => OutboxMessage::new("orders", &paid).header("", "x"),
            "header name with a colon" => OutboxMessage::new("orders", &paid).header("a:b", "x"),
            "header name with a newline" => {
                OutboxMessage::new("orders", &paid).header("a\nb", "x")
            }
            "control id" => OutboxMessage::new("orders", &paid).message_id("id\u{7}"),
            "empty message name" => OutboxMessage::raw("orders", "", "{}"),
            "empty aggregate" => OutboxMessage::new("orders", &paid).aggregate(""),
            "no destinations" => {
                Outbox::new(&[])
                    .publish(&mut *conn, OutboxMessage::new("orders", &paid))
                    .await?;
                unreachable!("an outbox without destinations refuses every publish")
            }
            "good then bad" => {
                OUTBOX.publish(&mut *conn, OutboxMessage::new("orders", &paid)).await?;
                OutboxMessage::new("audit", &paid).header("", "x")
            }
            "duplicate id" => {
                OUTBOX
                    .publish(&mut *conn, OutboxMessage::new("orders", &paid).message_id("dup"))
                    .await?;
                OutboxMessage::new("orders", &paid).message_id("dup")
            }
            other => panic!("unknown case {other}"),
        };
        OUTBOX.publish(&mut *conn, message).await?;
        Ok(())
    }

    #[tokio::test]
    async fn the_outbox_is_its_own_component() {
        let (pool, _guard) = fixture().await;
        let tables = "SELECT COUNT(*) FROM sqlite_master WHERE name = 'inbox_outbox'";
        let pg_tables = "SELECT COUNT(*) FROM pg_tables WHERE tablename = 'inbox_outbox'";
        let my_tables = "SELECT COUNT(*) FROM information_schema.tables \
             WHERE table_schema = DATABASE() AND table_name = 'inbox_outbox'";
        let query = match BACKEND {
            Backend::Postgres => pg_tables,
            Backend::MySql => my_tables,
            _ => tables,
        };
        // The fixture ran the plain `migrate`: no outbox.
        assert_eq!(count(&pool, query).await, 0);
        inbox_runtime::migrate_components(&pool, &[Component::Inbox, Component::Outbox])
            .await
            .unwrap();
        assert_eq!(count(&pool, query).await, 1);
        assert_eq!(
            count(&pool, "SELECT COUNT(*) FROM _inbox_outbox_migrations").await,
            4
        );
        // Idempotent.
        inbox_runtime::migrate_components(&pool, &[Component::Outbox]).await.unwrap();
        assert_eq!(
            count(&pool, "SELECT COUNT(*) FROM _inbox_outbox_migrations").await,
            4
        );
    }

    #[tokio::test]
    async fn publish_commits_with_the_effect_and_a_rerun_publishes_the_same_ids() {
        let (pool, _guard) = outbox_fixture().await;
        let event = format!("evt-{BACKEND}-1");
        let msg = Captured {
            event_id: event.clone(),
            order_id: "order-1".into(),
            amount: 250,
            fail_once: true,
        };
        let mut conn = pool.acquire().await.unwrap();

        // First run: publishes twice, then fails: nothing of it commits.
        match on_captured(&mut conn, msg.clone()).await {
            Err(Error::Handler(failure)) => {
                assert!(matches!(failure.error, HandlerError::Injected));
                assert!(matches!(failure.disposition, Disposition::Retry { .. }));
            }
            other => panic!("expected the injected failure, got {other:?}"),
        }
        assert_eq!(effect(&pool, "order-1").await, None);
        assert_eq!(count(&pool, "SELECT COUNT(*) FROM inbox_outbox").await, 0);

        // The redelivery runs it again: the effect and both messages commit, with the ids the
        // failed run had.
        assert_eq!(make_due(&pool).await, 1);
        assert!(matches!(
            on_captured(&mut conn, msg.clone()).await.unwrap(),
            Outcome::Processed(())
        ));
        assert_eq!(effect(&pool, "order-1").await, Some((1, 250)));
        let key = msg.idempotency_key().unwrap();
        let expected = vec![
            Outbox::message_id_for("orders", key.as_str(), 0),
            Outbox::message_id_for("orders", key.as_str(), 1),
        ];
        assert_eq!(runs(&event), vec![expected.clone(), expected.clone()]);
        assert_eq!(
            rows(&pool).await,
            vec![
                (expected[0].clone(), "orders".into(), "pending".into(), 0, Some("order-1".into())),
                (expected[1].clone(), "audit".into(), "pending".into(), 0, None),
            ]
        );

        // A duplicate delivery runs nothing and publishes nothing.
        assert!(on_captured(&mut conn, msg).await.unwrap().is_duplicate());
        assert_eq!(count(&pool, "SELECT COUNT(*) FROM inbox_outbox").await, 2);

        // The relay sends both, with their ids, names, payloads and headers.
        let sink = MemorySink::new();
        let relay = Relay::new(pool.clone(), sink.clone());
        assert_eq!(busy_round(&relay, &pool).await, round(2, 2, 0, 0));
        let sent = sink.published();
        assert_eq!(ids(&sent), [expected[0].as_str(), expected[1].as_str()]);
        assert_eq!(sent[0].message_name, "orders.paid");
        assert_eq!(sent[0].destination, "orders");
        assert_eq!(sent[0].payload, br#"{"order_id":"order-1","amount":250}"#);
        assert_eq!(sent[0].aggregate_id.as_deref(), Some("order-1"));
        assert_eq!(sent[0].attempt, 1);
        assert_eq!(sent[1].headers.get("origin").map(String::as_str), Some("test"));
        assert_eq!(
            count(&pool, "SELECT COUNT(*) FROM inbox_outbox WHERE status = 'sent'").await,
            2
        );
    }

    #[tokio::test]
    async fn bad_input_is_refused_at_publish_and_nothing_commits() {
        let (pool, _guard) = outbox_fixture().await;
        let mut conn = pool.acquire().await.unwrap();
        let long = "x".repeat(64);
        for (case, text) in [
            (
                "unknown destination",
                r#"unknown outbox destination "nowhere" (known: orders, audit)"#.to_owned(),
            ),
            ("empty destination", "outbox destination is empty".to_owned()),
            (
                "empty id",
                r#"invalid outbox message id "" (0 bytes): it is empty"#.to_owned(),
            ),
            (
                "long id",
                format!(
                    r#"invalid outbox message id "{long}" (256 bytes): it is longer than 255 bytes"#
                ),
            ),
            (
                "unserializable",
                r#"outbox message "test.unserializable" does not serialize: refused to serialize"#
                    .to_owned(),
            ),
            (
                "empty header name",
                r#"invalid outbox header "": a header name must be non-empty, without ':' or control characters"#
                    .to_owned(),
            ),
            (
                "header name with a colon",
                r#"invalid outbox header "a:b": a header name must be non-empty, without ':' or control characters"#
                    .to_owned(),
            ),
            (
                "header name with a newline",
                r#"invalid outbox header "a\nb": a header name must be non-empty, without ':' or control characters"#
                    .to_owned(),
            ),
            (
                "control id",
                r#"invalid outbox message id "id\u{7}" (3 bytes): it contains control characters"#
                    .to_owned(),
            ),
            (
                "empty message name",
                r#"outbox message to "orders" has an empty message name"#.to_owned(),
            ),
            (
                "empty aggregate",
                "invalid outbox aggregate: the aggregate id is empty".to_owned(),
            ),
            (
                "no destinations",
                r#"unknown outbox destination "orders" (this outbox has no destinations: list them in Outbox::new)"#
                    .to_owned(),
            ),
            (
                "good then bad",
                r#"invalid outbox header "": a header name must be non-empty, without ':' or control characters"#
                    .to_owned(),
            ),
            (
                "duplicate id",
                r#"outbox message id "dup" was published before"#.to_owned(),
            ),
        ] {
            let msg = BadCase { id: format!("bad-{}", case.replace(' ', "-")), case: case.into() };
            match publish_bad(&mut conn, msg.clone()).await {
                Err(Error::Handler(failure)) => {
                    assert_eq!(failure.error.to_string(), text, "{case}");
                    let expected = if case == "duplicate id" { "failed" } else { "dead" };
                    assert_eq!(
                        inbox_row(&pool, "bad", &msg.id).await,
                        Some((expected.to_owned(), 1)),
                        "{case}"
                    );
                }
                other => panic!("{case}: expected the outbox error, got {other:?}"),
            }
            assert_eq!(effect(&pool, &msg.id).await, None, "{case}: no effect");
        }
        // Nothing of any handler committed: no outbox row (not even the good message published
        // before the bad one), no effect; each key settled by its failure alone.
        assert_eq!(count(&pool, "SELECT COUNT(*) FROM inbox_outbox").await, 0);
        assert_eq!(count(&pool, "SELECT COUNT(*) FROM effects").await, 0);
        assert_eq!(
            count(&pool, "SELECT COUNT(*) FROM inbox_messages WHERE status = 'processed'").await,
            0
        );
    }

    #[tokio::test]
    async fn rows_of_one_aggregate_go_out_one_at_a_time_in_order() {
        let (pool, _guard) = outbox_fixture().await;
        enqueue(&pool, vec![raw("a1", Some("a")), raw("b1", Some("b")), raw("a2", Some("a"))])
            .await;
        enqueue(&pool, vec![raw("n1", None), raw("a3", Some("a"))]).await;
        let fail_a1 = Arc::new(Mutex::new(true));
        let flag = fail_a1.clone();
        let sink = MemorySink::new().fail_when(move |m| {
            let mut first = flag.lock().unwrap();
            (m.message_id == "a1" && std::mem::take(&mut *first))
                .then(|| SinkError::retryable("broker busy"))
        });
        let relay = Relay::new(pool.clone(), sink.clone()).backoff(Duration::ZERO, Duration::ZERO);

        // a1 fails; a2 and a3 wait for it; b1 and n1 go.
        assert_eq!(busy_round(&relay, &pool).await, round(3, 2, 1, 0));
        assert_eq!(ids(&sink.published()), ["b1", "n1"]);
        assert_eq!(relay.run_once().await.unwrap(), round(1, 1, 0, 0));
        assert_eq!(relay.run_once().await.unwrap(), round(1, 1, 0, 0));
        assert_eq!(relay.run_once().await.unwrap(), round(1, 1, 0, 0));
        assert_eq!(relay.run_once().await.unwrap(), round(0, 0, 0, 0));
        assert_eq!(ids(&sink.published()), ["b1", "n1", "a1", "a2", "a3"]);
        let attempts: Vec<(String, i32)> =
            rows(&pool).await.into_iter().map(|r| (r.0, r.3)).collect();
        assert_eq!(
            attempts,
            [("a1", 2), ("b1", 1), ("a2", 1), ("n1", 1), ("a3", 1)]
                .map(|(id, n)| (id.to_owned(), n))
        );
    }

    #[tokio::test]
    async fn a_poison_row_dies_with_its_error_and_blocks_only_its_aggregate() {
        let (pool, _guard) = outbox_fixture().await;
        enqueue(
            &pool,
            vec![
                raw("p1", Some("p")),
                raw("q1", Some("q")),
                raw("p2", Some("p")),
                raw("q2", Some("q")),
                raw("r1", Some("r")),
            ],
        )
        .await;
        let sink = MemorySink::new().fail_when(|m| match m.message_id.as_str() {
            "p1" => Some(SinkError::retryable("broker refused p1")),
            "r1" => Some(SinkError::permanent("message too large")),
            _ => None,
        });
        let relay = Relay::new(pool.clone(), sink.clone())
            .max_attempts(3)
            .backoff(Duration::ZERO, Duration::ZERO);

        // p1 fails, r1 dies at once (permanent), q1 goes.
        assert_eq!(busy_round(&relay, &pool).await, round(3, 1, 1, 1));
        // p1 fails again, q2 goes.
        assert_eq!(relay.run_once().await.unwrap(), round(2, 1, 1, 0));
        // p1's third attempt: dead.
        assert_eq!(relay.run_once().await.unwrap(), round(1, 0, 0, 1));
        // p2 stays behind its dead predecessor.
        assert_eq!(relay.run_once().await.unwrap(), round(0, 0, 0, 0));
        assert_eq!(ids(&sink.published()), ["q1", "q2"]);
        let state: Vec<(String, String, i32)> =
            rows(&pool).await.into_iter().map(|r| (r.0, r.2, r.3)).collect();
        assert_eq!(
            state,
            [
                ("p1", "dead", 3),
                ("q1", "sent", 1),
                ("p2", "pending", 0),
                ("q2", "sent", 1),
                ("r1", "dead", 1),
            ]
            .map(|(id, status, n)| (id.to_owned(), status.to_owned(), n))
        );
        let errors: Vec<(String, Option<String>)> = sqlx::query_as(
            "SELECT message_id, last_error FROM inbox_outbox WHERE status = 'dead' ORDER BY id",
        )
        .fetch_all(&pool)
        .await
        .unwrap();
        assert_eq!(
            errors,
            vec![
                ("p1".to_owned(), Some("retryable: broker refused p1".to_owned())),
                ("r1".to_owned(), Some("permanent: message too large".to_owned())),
            ]
        );
    }

    #[tokio::test]
    async fn a_crash_between_publish_and_mark_republishes_the_same_ids() {
        let (pool, _guard) = outbox_fixture().await;
        enqueue(&pool, vec![raw("c1", Some("c")), raw("d1", None)]).await;
        let before = MemorySink::new();
        let crashing = Relay::new(pool.clone(), CrashAfterPublish(before.clone()))
            .lease(Duration::from_millis(500))
            .unwrap();
        // Wait for the rows to be publishable, then let the relay publish and "die".
        let deadline = std::time::Instant::now() + Duration::from_secs(20);
        while before.published().is_empty() && std::time::Instant::now() < deadline {
            let round = tokio::time::timeout(Duration::from_millis(300), crashing.run_once()).await;
            assert!(round.is_err() || round.unwrap().unwrap().leased == 0);
        }
        assert_eq!(ids(&before.published()), ["c1", "d1"]);
        assert_eq!(
            count(&pool, "SELECT COUNT(*) FROM inbox_outbox WHERE status = 'pending'").await,
            2
        );

        // While the lease runs, another relay leaves the rows alone.
        let after = MemorySink::new();
        let relay = Relay::new(pool.clone(), after.clone());
        assert_eq!(relay.run_once().await.unwrap(), round(0, 0, 0, 0));
        // After it, the rows go again, with the same message ids; each alone (an orphan of a
        // crashed relay is leased by itself, so that a row that crashes relays takes no other
        // row down with it), the one with fewer attempts first, then by id.
        tokio::time::sleep(Duration::from_millis(600)).await;
        assert_eq!(relay.run_once().await.unwrap(), round(1, 1, 0, 0));
        assert_eq!(relay.run_once().await.unwrap(), round(1, 1, 0, 0));
        assert_eq!(relay.run_once().await.unwrap(), round(0, 0, 0, 0));
        let again = after.published();
        assert_eq!(ids(&again), ["c1", "d1"]);
        assert_eq!(again[0].attempt, 2);
        assert_eq!(again[0].payload, before.published()[0].payload);
        assert_eq!(
            count(&pool, "SELECT COUNT(*) FROM inbox_outbox WHERE status = 'sent'").await,
            2
        );
    }

    #[tokio::test]
    async fn purge_deletes_only_sent_rows_older_than_the_window() {
        let (pool, _guard) = outbox_fixture().await;
        enqueue(&pool, vec![raw("s1", None), raw("s2", None), raw("s3", Some("x"))]).await;
        let sink = MemorySink::new().fail_when(|m| {
            (m.message_id == "s3").then(|| SinkError::retryable("down"))
        });
        let minute = Duration::from_secs(60);
        let relay = Relay::new(pool.clone(), sink).backoff(minute, minute);
        assert_eq!(busy_round(&relay, &pool).await, round(3, 2, 1, 0));
        // Within the window: nothing goes.
        assert_eq!(
            inbox_runtime::outbox::purge_sent(&pool, Duration::from_secs(3600), 1).await.unwrap(),
            0
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
        // Past it: the sent rows go, in batches of one; the pending one stays.
        assert_eq!(
            inbox_runtime::outbox::purge_sent(&pool, Duration::from_millis(10), 1).await.unwrap(),
            2
        );
        let left: Vec<String> = rows(&pool).await.into_iter().map(|r| r.0).collect();
        assert_eq!(left, ["s3"]);
    }

    /// Runs `relay`'s rounds (spawned) until one leases a row, and returns that round's report.
    fn spawn_until_leased(relay: Relay<Db>) -> tokio::task::JoinHandle<RoundReport> {
        tokio::spawn(async move {
            let deadline = std::time::Instant::now() + Duration::from_secs(30);
            loop {
                let report = relay.run_once().await.unwrap();
                if report.leased > 0 {
                    return report;
                }
                assert!(std::time::Instant::now() < deadline, "no row became leasable");
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        })
    }

    /// What the sink tells the test it was given, waited for at most 60 s.
    async fn given(
        receiver: &mut tokio::sync::mpsc::UnboundedReceiver<Vec<(String, u32)>>,
    ) -> Vec<(String, u32)> {
        tokio::time::timeout(Duration::from_secs(60), receiver.recv())
            .await
            .expect("the relay reached its sink")
            .expect("the sink is alive")
    }

    /// Two relays and a paused one, on rows `a1`, `a2` of one aggregate. Relay A leases `a1`
    /// and is paused inside its publish until its lease has run out; relay B leases `a1` again
    /// (an orphan, attempt 2) and holds it. A then wakes with its sink's verdict (`accepted`)
    /// and marks `a1`: it must change nothing (B holds the row), so relay C finds nothing to
    /// lease (`a1` is B's, `a2` waits behind it) until B has marked `a1` sent.
    async fn a_paused_relay_cannot_mark_a_row_another_relay_holds(accepted: bool) {
        let (pool, _guard) = outbox_fixture().await;
        enqueue(&pool, vec![raw("a1", Some("a")), raw("a2", Some("a"))]).await;
        let confirmations = Confirmations::default();
        let (pause_a, resume_a) = std::sync::mpsc::channel();
        let (sink_a, mut given_a) =
            GatedSink::new("A", Gate::Pause(Mutex::new(resume_a)), &confirmations);
        let (release_b, gate_b) = tokio::sync::mpsc::unbounded_channel();
        let (sink_b, mut given_b) =
            GatedSink::new("B", Gate::Wait(tokio::sync::Mutex::new(gate_b)), &confirmations);
        let (sink_c, _given_c) = GatedSink::new("C", Gate::Open, &confirmations);
        let lease = Duration::from_millis(400);
        let relay_a = Relay::new(pool.clone(), sink_a)
            .lease(lease)
            .expect("a lease within the relay's bounds")
            .backoff(Duration::ZERO, Duration::ZERO);
        let relay_b = Relay::new(pool.clone(), sink_b)
            .lease(Duration::from_secs(60))
            .expect("a lease within the relay's bounds");
        let relay_c = Relay::new(pool.clone(), sink_c).backoff(Duration::ZERO, Duration::ZERO);

        // A leases a1 (a2 waits behind it) and pauses in its publish.
        let round_a = spawn_until_leased(relay_a);
        assert_eq!(given(&mut given_a).await, [("a1".to_owned(), 1)]);
        // A's lease runs out; B leases a1 again and holds it.
        tokio::time::sleep(lease * 2).await;
        let round_b = spawn_until_leased(relay_b);
        assert_eq!(given(&mut given_b).await, [("a1".to_owned(), 2)]);

        // A wakes and marks a1 with its sink's verdict: nothing changes, A publishes nothing
        // and fails nothing.
        pause_a.send(accepted).unwrap();
        let report_a = round_a.await.unwrap();
        // a1 is still B's: C leases nothing (neither a1 again, nor a2 before a1 is sent).
        assert_eq!(relay_c.run_once().await.unwrap(), round(0, 0, 0, 0), "C's round");
        assert_eq!(
            rows(&pool).await.into_iter().map(|r| (r.0, r.2, r.3)).collect::<Vec<_>>(),
            [("a1", "pending", 2), ("a2", "pending", 0)]
                .map(|(id, status, n)| (id.to_owned(), status.to_owned(), n))
        );
        assert_eq!(
            (report_a.leased, report_a.published, report_a.failed, report_a.dead),
            (1, 0, 0, 0),
            "A's mark of a row B holds"
        );
        // A's mark is reported as a lost lease.
        assert_eq!(report_a.lease_lost, 1);

        // B's publish is confirmed and marked; then a2 goes.
        release_b.send(true).unwrap();
        assert_eq!(round_b.await.unwrap(), round(1, 1, 0, 0));
        assert_eq!(relay_c.run_once().await.unwrap(), round(1, 1, 0, 0));
        assert_eq!(relay_c.run_once().await.unwrap(), round(0, 0, 0, 0));
        let mut expected = vec![("B", "a1".to_owned()), ("C", "a2".to_owned())];
        if accepted {
            expected.insert(0, ("A", "a1".to_owned()));
        }
        assert_eq!(*confirmations.lock().unwrap(), expected);
        assert_eq!(
            rows(&pool).await.into_iter().map(|r| (r.0, r.2, r.3)).collect::<Vec<_>>(),
            [("a1", "sent", 2), ("a2", "sent", 1)]
                .map(|(id, status, n)| (id.to_owned(), status.to_owned(), n))
        );
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_paused_relay_whose_publish_succeeded_cannot_mark_a_row_another_relay_holds() {
        a_paused_relay_cannot_mark_a_row_another_relay_holds(true).await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_paused_relay_whose_publish_failed_cannot_release_a_row_another_relay_holds() {
        a_paused_relay_cannot_mark_a_row_another_relay_holds(false).await;
    }
}

mod postgres_only {
    use std::collections::BTreeMap;

    use super::*;
    use sqlx::PgPool;

    async fn outbox_pool(connections: u32) -> PgPool {
        let pool = inbox_tests::pg_pool(connections).await;
        inbox_runtime::migrate_components(&pool, &[Component::Inbox, Component::Outbox])
            .await
            .unwrap();
        pool
    }

    /// `relay`'s first round that leases anything (at most 30 s of rounds: on PostgreSQL a row
    /// waits for every older transaction on the server, other tests' included).
    async fn first_round_with_rows(relay: &Relay<sqlx::Postgres>) -> RoundReport {
        let deadline = std::time::Instant::now() + Duration::from_secs(30);
        loop {
            let report = relay.run_once().await.unwrap();
            if report.leased > 0 {
                return report;
            }
            assert!(
                std::time::Instant::now() < deadline,
                "no round leased a row"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// Runs `relay`'s rounds until `sink` holds `n` messages (at most 30 s: on PostgreSQL a row
    /// waits for every older transaction on the server, other tests' included), and returns
    /// their message ids in publication order.
    async fn published_ids(
        relay: &Relay<sqlx::Postgres>,
        sink: &MemorySink,
        n: usize,
    ) -> Vec<String> {
        let deadline = std::time::Instant::now() + Duration::from_secs(30);
        while sink.published().len() < n {
            assert!(
                std::time::Instant::now() < deadline,
                "{:?}",
                ids(&sink.published())
            );
            if relay.run_once().await.unwrap().leased == 0 {
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }
        ids(&sink.published())
            .into_iter()
            .map(str::to_owned)
            .collect()
    }

    /// The per-aggregate order of two unserialized writers (the README's "Per-aggregate order"):
    /// T2 takes its transaction id first (as an inbox claim, the first statement of a handler's
    /// transaction, does), T1 then creates `first` of aggregate `order-1`, T2 creates `second`
    /// of it and commits while T1 is still open. `second` is published at once, before `first`
    /// exists for any reader: rows of one aggregate go out in commit order, not creation order.
    #[tokio::test]
    async fn unserialized_writers_of_one_aggregate_publish_in_commit_order() {
        let pool = outbox_pool(4).await;
        let sink = MemorySink::new();
        let relay = Relay::new(pool.clone(), sink.clone());
        let mut t2 = pool.begin().await.unwrap();
        sqlx::query("SELECT pg_current_xact_id()")
            .execute(&mut *t2)
            .await
            .unwrap();
        let mut t1 = pool.begin().await.unwrap();
        OUTBOX
            .publish(&mut *t1, raw("first", Some("order-1")))
            .await
            .unwrap();
        OUTBOX
            .publish(&mut *t2, raw("second", Some("order-1")))
            .await
            .unwrap();
        t2.commit().await.unwrap();
        assert_eq!(
            published_ids(&relay, &sink, 1).await,
            ["second"],
            "while T1 is open"
        );
        t1.commit().await.unwrap();
        assert_eq!(published_ids(&relay, &sink, 2).await, ["second", "first"]);
        let order: Vec<(i64, String)> =
            sqlx::query_as("SELECT id, message_id FROM inbox_outbox ORDER BY id")
                .fetch_all(&pool)
                .await
                .unwrap();
        assert_eq!(
            order.iter().map(|r| r.1.as_str()).collect::<Vec<_>>(),
            ["first", "second"],
            "creation (id) order"
        );
    }

    /// The same two writers, but T1 took its transaction id first: T2's `second`, committed
    /// first, waits until T1 has ended (PostgreSQL's horizon), then behind `first` (an earlier
    /// row of its aggregate): creation order, although the commits were not.
    #[tokio::test]
    async fn a_row_of_a_younger_transaction_waits_for_the_older_writer_of_its_aggregate() {
        let pool = outbox_pool(4).await;
        let sink = MemorySink::new();
        let relay = Relay::new(pool.clone(), sink.clone());
        let mut t1 = pool.begin().await.unwrap();
        OUTBOX
            .publish(&mut *t1, raw("first", Some("order-1")))
            .await
            .unwrap();
        let mut t2 = pool.begin().await.unwrap();
        OUTBOX
            .publish(&mut *t2, raw("second", Some("order-1")))
            .await
            .unwrap();
        t2.commit().await.unwrap();
        assert_eq!(
            relay.run_once().await.unwrap(),
            round(0, 0, 0, 0),
            "while T1 is open"
        );
        t1.commit().await.unwrap();
        assert_eq!(published_ids(&relay, &sink, 2).await, ["first", "second"]);
    }

    /// Writers that serialize on the aggregate (`lock`: the statement that takes the
    /// aggregate's lock, bound with the aggregate id) get creation order, even when the later
    /// writer took its transaction id first: T2 waits for T1's lock, so it creates `second`
    /// after `first` is committed, and the relay sees `first` whenever it sees `second`.
    async fn serialized_writers_publish_in_creation_order(lock: &'static str) {
        let pool = outbox_pool(4).await;
        sqlx::query("CREATE TABLE orders (id TEXT PRIMARY KEY)")
            .execute(&pool)
            .await
            .unwrap();
        sqlx::query("INSERT INTO orders VALUES ('order-1')")
            .execute(&pool)
            .await
            .unwrap();
        let sink = MemorySink::new();
        let relay = Relay::new(pool.clone(), sink.clone());
        let mut t2 = pool.begin().await.unwrap();
        sqlx::query("SELECT pg_current_xact_id()")
            .execute(&mut *t2)
            .await
            .unwrap();
        let t2_pid: i32 = sqlx::query_scalar("SELECT pg_backend_pid()")
            .fetch_one(&mut *t2)
            .await
            .unwrap();
        let mut t1 = pool.begin().await.unwrap();
        sqlx::query(lock)
            .bind("order-1")
            .execute(&mut *t1)
            .await
            .unwrap();
        OUTBOX
            .publish(&mut *t1, raw("first", Some("order-1")))
            .await
            .unwrap();
        let writer = tokio::spawn(async move {
            sqlx::query(lock)
                .bind("order-1")
                .execute(&mut *t2)
                .await
                .unwrap();
            OUTBOX
                .publish(&mut *t2, raw("second", Some("order-1")))
                .await
                .unwrap();
            t2.commit().await.unwrap();
        });
        // T2 waits for T1's lock on the aggregate.
        let waiting = "SELECT COUNT(*) FROM pg_locks WHERE pid = $1 AND NOT granted";
        let deadline = std::time::Instant::now() + Duration::from_secs(30);
        while sqlx::query_scalar::<_, i64>(waiting)
            .bind(t2_pid)
            .fetch_one(&pool)
            .await
            .unwrap()
            == 0
        {
            assert!(
                std::time::Instant::now() < deadline,
                "T2 never waited for T1's lock"
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        assert_eq!(
            relay.run_once().await.unwrap(),
            round(0, 0, 0, 0),
            "while T1 is open"
        );
        t1.commit().await.unwrap();
        writer.await.unwrap();
        assert_eq!(published_ids(&relay, &sink, 2).await, ["first", "second"]);
    }

    #[tokio::test]
    async fn writers_that_lock_the_aggregates_row_publish_in_creation_order() {
        serialized_writers_publish_in_creation_order(
            "SELECT id FROM orders WHERE id = $1 FOR UPDATE",
        )
        .await;
    }

    #[tokio::test]
    async fn writers_that_take_an_advisory_lock_on_the_aggregate_publish_in_creation_order() {
        serialized_writers_publish_in_creation_order(
            "SELECT pg_advisory_xact_lock(hashtextextended($1, 0))",
        )
        .await;
    }

    #[tokio::test]
    async fn a_lower_id_committed_after_a_higher_one_is_published_not_skipped() {
        let pool = outbox_pool(4).await;
        let sink = MemorySink::new();
        let relay = Relay::new(pool.clone(), sink.clone());

        // Transaction 1 writes first (lower id) and stays open; transaction 2 writes after it
        // (higher id) and commits.
        let mut late = pool.begin().await.unwrap();
        OUTBOX.publish(&mut *late, raw("late", None)).await.unwrap();
        let mut early = pool.begin().await.unwrap();
        OUTBOX
            .publish(&mut *early, raw("early", None))
            .await
            .unwrap();
        early.commit().await.unwrap();
        let order: Vec<(i64, String)> =
            sqlx::query_as("SELECT id, message_id FROM inbox_outbox ORDER BY id")
                .fetch_all(&pool)
                .await
                .unwrap();
        assert_eq!(order.len(), 1, "only the committed row is visible");
        assert_eq!(order[0].1, "early");

        // A round now publishes nothing: an older transaction (the late one) is still running,
        // so the committed row is not yet known to be first.
        assert_eq!(relay.run_once().await.unwrap(), round(0, 0, 0, 0));
        late.commit().await.unwrap();

        // Both go, in id order; nothing was skipped.
        let deadline = std::time::Instant::now() + Duration::from_secs(20);
        while sink.published().len() < 2 && std::time::Instant::now() < deadline {
            relay.run_once().await.unwrap();
        }
        assert_eq!(ids(&sink.published()), ["late", "early"]);
        let ids_in_table: Vec<(i64, String)> =
            sqlx::query_as("SELECT id, message_id FROM inbox_outbox ORDER BY id")
                .fetch_all(&pool)
                .await
                .unwrap();
        assert_eq!(
            ids_in_table
                .iter()
                .map(|r| r.1.as_str())
                .collect::<Vec<_>>(),
            ["late", "early"],
            "the late row has the lower id"
        );
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn two_relays_publish_every_row_exactly_once_in_aggregate_order() {
        let pool = outbox_pool(8).await;
        let mut tx = pool.begin().await.unwrap();
        for i in 0..200 {
            let aggregate = (i % 3 != 0).then(|| format!("agg-{}", i % 20));
            OUTBOX
                .publish(&mut *tx, raw(&format!("m{i:03}"), aggregate.as_deref()))
                .await
                .unwrap();
        }
        tx.commit().await.unwrap();

        let sink = MemorySink::new();
        let shutdown = tokio_util::sync::CancellationToken::new();
        let relays: Vec<_> = (0..2)
            .map(|_| {
                let relay = Relay::new(pool.clone(), sink.clone())
                    .batch_size(7)
                    .poll_interval(Duration::from_millis(20));
                tokio::spawn(relay.run(shutdown.clone()))
            })
            .collect();
        let deadline = std::time::Instant::now() + Duration::from_secs(60);
        loop {
            let pending: i64 =
                sqlx::query_scalar("SELECT COUNT(*) FROM inbox_outbox WHERE status <> 'sent'")
                    .fetch_one(&pool)
                    .await
                    .unwrap();
            if pending == 0 || std::time::Instant::now() > deadline {
                break;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        shutdown.cancel();
        let mut published = 0;
        for relay in relays {
            let report = relay.await.unwrap();
            assert_eq!((report.failed, report.dead, report.errors), (0, 0, 0));
            published += report.published;
        }
        assert_eq!(published, 200);

        let sent = sink.published();
        let mut per_id: BTreeMap<&str, u32> = BTreeMap::new();
        for message in &sent {
            *per_id.entry(message.message_id.as_str()).or_default() += 1;
        }
        assert_eq!(per_id.len(), 200);
        assert!(
            per_id.values().all(|n| *n == 1),
            "a message published twice"
        );
        // Each aggregate's messages went out in id order.
        let mut per_aggregate: BTreeMap<&str, Vec<&str>> = BTreeMap::new();
        for message in &sent {
            if let Some(aggregate) = &message.aggregate_id {
                per_aggregate
                    .entry(aggregate)
                    .or_default()
                    .push(&message.message_id);
            }
        }
        assert_eq!(per_aggregate.len(), 20);
        for (aggregate, order) in per_aggregate {
            let mut sorted = order.clone();
            sorted.sort();
            assert_eq!(order, sorted, "{aggregate}");
        }
    }

    /// Headers NATS cannot carry (async-nats asserts on them: a name with a space, non-ASCII or
    /// `:`; a value with CR or LF) fail their message for good, alone; the relay does not panic
    /// and the good message beside them is published.
    #[tokio::test]
    async fn the_nats_sink_refuses_headers_nats_cannot_carry_per_message() {
        use async_nats::jetstream::{self, stream};
        use inbox_runtime::sink::nats::NatsSink;

        const NATS_OUTBOX: Outbox = Outbox::new(&["inbox-nats-headers.orders"]);
        let url = std::env::var("NATS_URL").expect("NATS_URL (scripts/brokers.sh) is set");
        let context = jetstream::new(async_nats::connect(&url).await.unwrap());
        let stream_name = "INBOX_NATS_HEADERS";
        let _ = context.delete_stream(stream_name).await;
        context
            .create_stream(stream::Config {
                name: stream_name.into(),
                subjects: vec!["inbox-nats-headers.>".into()],
                ..Default::default()
            })
            .await
            .unwrap();
        let pool = outbox_pool(4).await;
        let mut tx = pool.begin().await.unwrap();
        let headers = [
            ("good", "trace-id", "t-1"),
            ("space", "trace id", "t"),
            ("umlaut", "Übertrag", "t"),
            ("newline", "trace-id", "a\r\nInjected: yes"),
        ];
        for (id, name, value) in headers {
            let paid = OrderPaid {
                order_id: id.into(),
                amount: 100,
            };
            NATS_OUTBOX
                .publish(
                    &mut *tx,
                    OutboxMessage::new("inbox-nats-headers.orders", &paid)
                        .message_id(id)
                        .header(name, value),
                )
                .await
                .unwrap();
        }
        tx.commit().await.unwrap();

        let relay = Relay::new(pool.clone(), NatsSink::new(context.clone()));
        assert_eq!(first_round_with_rows(&relay).await, round(4, 1, 0, 3));
        let mut stream = context.get_stream(stream_name).await.unwrap();
        assert_eq!(stream.info().await.unwrap().state.messages, 1);
        let dead: Vec<(String, String)> = sqlx::query_as(
            "SELECT message_id, last_error FROM inbox_outbox WHERE status = 'dead' \
             ORDER BY message_id",
        )
        .fetch_all(&pool)
        .await
        .unwrap();
        let expected = [
            (
                "newline",
                "permanent: NATS cannot carry the header \"trace-id\": its value has CR or LF",
            ),
            (
                "space",
                "permanent: NATS cannot carry the header name \"trace id\": only printable ASCII without ':'",
            ),
            (
                "umlaut",
                "permanent: NATS cannot carry the header name \"Übertrag\": only printable ASCII without ':'",
            ),
        ];
        let expected: Vec<(String, String)> = expected
            .iter()
            .map(|(a, b)| (a.to_string(), b.to_string()))
            .collect();
        assert_eq!(dead, expected);
    }

    #[tokio::test]
    async fn the_nats_sink_sets_the_message_id_and_jetstream_drops_republishes() {
        use async_nats::jetstream::{self, stream};
        use inbox_runtime::sink::nats::NatsSink;
        use inbox_runtime::source::Source as _;
        use inbox_runtime::source::nats::{NatsConfig, NatsSource};

        const NATS_OUTBOX: Outbox = Outbox::new(&["inbox-outbox-test.orders"]);
        let url = std::env::var("NATS_URL").expect("NATS_URL (scripts/brokers.sh) is set");
        let context = jetstream::new(async_nats::connect(&url).await.unwrap());
        let stream_name = "INBOX_OUTBOX_TEST";
        let _ = context.delete_stream(stream_name).await;
        context
            .create_stream(stream::Config {
                name: stream_name.into(),
                subjects: vec!["inbox-outbox-test.>".into()],
                duplicate_window: Duration::from_secs(120),
                ..Default::default()
            })
            .await
            .unwrap();

        let pool = outbox_pool(4).await;
        let mut tx = pool.begin().await.unwrap();
        let mut expected = Vec::new();
        for i in 1..=3 {
            let paid = OrderPaid {
                order_id: format!("order-{i}"),
                amount: i * 100,
            };
            let id = NATS_OUTBOX
                .publish(
                    &mut *tx,
                    OutboxMessage::new("inbox-outbox-test.orders", &paid)
                        .header("trace-id", format!("t-{i}")),
                )
                .await
                .unwrap();
            expected.push((id, serde_json::to_vec(&paid).unwrap()));
        }
        tx.commit().await.unwrap();

        let relay = Relay::new(pool.clone(), NatsSink::new(context.clone()));
        let deadline = std::time::Instant::now() + Duration::from_secs(20);
        let mut published = 0;
        while published < 3 && std::time::Instant::now() < deadline {
            published += relay.run_once().await.unwrap().published;
        }
        assert_eq!(published, 3);
        // As after a crash before the mark: the rows go again; JetStream drops them.
        sqlx::query("UPDATE inbox_outbox SET status = 'pending'")
            .execute(&pool)
            .await
            .unwrap();
        assert_eq!(first_round_with_rows(&relay).await, round(3, 3, 0, 0));
        let mut stream = context.get_stream(stream_name).await.unwrap();
        let info = stream.info().await.unwrap();
        assert_eq!(
            info.state.messages, 3,
            "re-publishes dropped by Nats-Msg-Id"
        );

        // Read back through the NATS source: the same envelope.
        let config = NatsConfig::new(url, stream_name, "reader");
        let mut source = NatsSource::connect(config).await.unwrap();
        for (id, payload) in &expected {
            let delivery = tokio::time::timeout(Duration::from_secs(10), source.next())
                .await
                .unwrap()
                .unwrap()
                .unwrap();
            let envelope = delivery.envelope().clone();
            assert_eq!(envelope.message_name, "orders.paid");
            assert_eq!(&envelope.payload, payload);
            assert_eq!(
                envelope.source.as_ref().unwrap().message_id.as_deref(),
                Some(id.as_str())
            );
            assert!(
                envelope
                    .headers
                    .get("trace-id")
                    .is_some_and(|t| t.starts_with("t-"))
            );
            delivery.ack().await.unwrap();
        }
        let _ = context.delete_stream(stream_name).await;
    }
}
