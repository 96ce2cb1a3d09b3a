//! The Kafka source against librdkafka's mock cluster (in process: no Kafka server can be
//! installed here), with PostgreSQL (`DATABASE_URL`) and SQLite: positions in the database,
//! exactly-once effects, per-partition order, zombies fenced, rebalances, bad input.
//!
//! Each test starts a mock cluster of its own; the tests of this file run one at a time (they
//! share the machine's two cores with the consumers they start).

#![allow(missing_docs)]

use std::collections::BTreeMap;
use std::future::Future;
use std::sync::{Arc, Mutex as StdMutex};
use std::time::{Duration, Instant};

use inbox_runtime::source::kafka::{KafkaConfig, KafkaSource};
use inbox_runtime::{CancellationToken, Component, Dispatcher, Worker, WorkerReport};
use rdkafka::ClientConfig;
use rdkafka::message::{Header, OwnedHeaders};
use rdkafka::mocking::MockCluster;
use rdkafka::producer::{FutureProducer, FutureRecord};

/// A row of `inbox_rejections`: reason, message name, source, partition, offset.
type RejectionRow = (String, String, Option<String>, Option<String>, Option<i64>);

/// One test at a time.
static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// The message of these tests: an amount for one effect, with its partition and its sequence in
/// that partition (to check the order of application).
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize, inbox_runtime::Message)]
#[message(name = "kafka.credit")]
struct Credit {
    #[message(key)]
    id: String,
    amount: i64,
    part: i32,
    seq: i64,
}

/// Handlers wait here when the test holds a gate for their key (the zombie test).
struct Gate {
    id: String,
    entered: Arc<tokio::sync::Notify>,
    release: Arc<tokio::sync::Semaphore>,
}

static GATE: StdMutex<Option<Gate>> = StdMutex::new(None);

async fn gate(id: &str) {
    let held = GATE
        .lock()
        .unwrap()
        .as_ref()
        .filter(|gate| gate.id == id)
        .map(|gate| (gate.entered.clone(), gate.release.clone()));
    if let Some((entered, release)) = held {
        entered.notify_one();
        // Closed when the test releases it: every waiter (and later caller) goes on.
        let _ = release.acquire().await;
    }
}

/// Holds the handler of `id` when it starts, until [`release`].
fn hold(id: &str) -> (Arc<tokio::sync::Notify>, Arc<tokio::sync::Semaphore>) {
    let entered = Arc::new(tokio::sync::Notify::new());
    let release = Arc::new(tokio::sync::Semaphore::new(0));
    *GATE.lock().unwrap() = Some(Gate {
        id: id.to_owned(),
        entered: entered.clone(),
        release: release.clone(),
    });
    (entered, release)
}

fn mock(brokers: i32) -> MockCluster<'static, rdkafka::producer::DefaultProducerContext> {
    MockCluster::new(brokers).expect("start librdkafka's mock cluster")
}

fn producer(bootstrap: &str) -> FutureProducer {
    ClientConfig::new()
        .set("bootstrap.servers", bootstrap)
        .set("enable.idempotence", "true")
        .create()
        .expect("create a producer")
}

/// Produces one record and waits for its delivery report.
async fn produce(
    producer: &FutureProducer,
    topic: &str,
    partition: i32,
    name: Option<&str>,
    key: Option<&str>,
    payload: Option<&[u8]>,
) -> i64 {
    let mut headers = OwnedHeaders::new();
    if let Some(name) = name {
        headers = headers.insert(Header {
            key: "message-name",
            value: Some(name),
        });
    }
    let mut record: FutureRecord<'_, str, [u8]> = FutureRecord::to(topic)
        .partition(partition)
        .headers(headers);
    if let Some(key) = key {
        record = record.key(key);
    }
    if let Some(payload) = payload {
        record = record.payload(payload);
    }
    let delivered = producer
        .send(record, Duration::from_secs(30))
        .await
        .map_err(|(error, _)| error)
        .expect("produce");
    delivered.offset
}

fn credit(id: &str, amount: i64, part: i32, seq: i64) -> Vec<u8> {
    serde_json::to_vec(&Credit {
        id: id.to_owned(),
        amount,
        part,
        seq,
    })
    .unwrap()
}

/// Consumer settings for a mock cluster on a loaded machine: short sessions, quick commits.
fn config(bootstrap: &str, group: &str, topic: &str) -> KafkaConfig {
    KafkaConfig::new(bootstrap, group, [topic])
        .commit_interval(Duration::from_millis(200))
        .revoke_wait(Duration::from_secs(5))
        .property("session.timeout.ms", "6000")
        .property("heartbeat.interval.ms", "300")
        .property("max.poll.interval.ms", "20000")
        .property("topic.metadata.refresh.interval.ms", "1000")
}

/// Waits until `check` returns true, polling every 50 ms, up to `deadline`; panics with `what`.
async fn wait_until<F, Fut>(what: &str, deadline: Duration, mut check: F)
where
    F: FnMut() -> Fut,
    Fut: Future<Output = bool>,
{
    let until = Instant::now() + deadline;
    while !check().await {
        assert!(Instant::now() < until, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// A worker over `source` in a task, stopped by its token.
struct Running {
    stop: CancellationToken,
    task: tokio::task::JoinHandle<WorkerReport>,
}

impl Running {
    async fn stop(self) -> WorkerReport {
        self.stop.cancel();
        tokio::time::timeout(Duration::from_secs(120), self.task)
            .await
            .expect("the worker stops")
            .expect("the worker task")
    }
}

inbox_tests::backend_matrix! {
    connections(postgres = 16, sqlite = 4);

    use inbox_runtime::{PositionRow, PositionStore as _};
    use inbox_tests::{effects, inbox_row};

    #[inbox_runtime::idempotent(consumer = "kafka-credits")]
    async fn apply_credit(conn: &mut Conn, msg: Credit) -> Result<(), sqlx::Error> {
        gate(&msg.id).await;
        sqlx::query(APPLY_EFFECT)
            .bind(&msg.id)
            .bind(msg.amount)
            .execute(&mut *conn)
            .await?;
        sqlx::query(sql("INSERT INTO kafka_seen (part, seq) VALUES ($1, $2)"))
            .bind(msg.part)
            .bind(msg.seq)
            .execute(&mut *conn)
            .await?;
        Ok(())
    }

    async fn setup() -> (Pool, Guard) {
        let (pool, guard) = fixture().await;
        inbox_runtime::migrate_components(&pool, &[Component::Positions])
            .await
            .unwrap();
        let seen = match BACKEND {
            Backend::Postgres => "CREATE TABLE kafka_seen (id BIGSERIAL PRIMARY KEY, part INT NOT NULL, seq BIGINT NOT NULL)",
            Backend::MySql => "CREATE TABLE kafka_seen (id BIGINT AUTO_INCREMENT PRIMARY KEY, part INT NOT NULL, seq BIGINT NOT NULL)",
            _ => "CREATE TABLE kafka_seen (id INTEGER PRIMARY KEY AUTOINCREMENT, part INT NOT NULL, seq BIGINT NOT NULL)",
        };
        sqlx::raw_sql(seen).execute(&pool).await.unwrap();
        (pool, guard)
    }

    fn dispatcher(pool: &Pool) -> Dispatcher<Db> {
        Dispatcher::from_handlers(pool.clone(), [inbox_runtime::handler!(apply_credit)])
            .unwrap()
            .with_max_payload_bytes(4096)
    }

    async fn start(pool: &Pool, config: KafkaConfig, concurrency: usize) -> (Running, inbox_runtime::source::kafka::AssignmentHandle) {
        // The source's and the worker's logs, shown with a failing test's output.
        let _ = tracing_subscriber::fmt()
            .with_env_filter(std::env::var("RUST_LOG").unwrap_or_else(|_| "inbox_runtime=info".into()))
            .with_test_writer()
            .try_init();
        let (source, dispatcher) = KafkaSource::connect(config, dispatcher(pool)).await.unwrap();
        let handle = source.assignment_handle();
        let stop = CancellationToken::new();
        let worker = Worker::new(dispatcher)
            .concurrency(concurrency)
            .requeue_delay(Duration::from_millis(100))
            .drain_timeout(Duration::from_secs(60));
        let token = stop.clone();
        let task = tokio::spawn(async move { worker.run(source, token).await.expect("the worker runs") });
        (Running { stop, task }, handle)
    }

    async fn positions(pool: &Pool, group: &str) -> Vec<PositionRow> {
        let mut conn = pool.acquire().await.unwrap();
        (*conn).fetch_positions(group).await.unwrap()
    }

    /// `(part, seq)` in the order the effects were applied.
    async fn seen(pool: &Pool) -> Vec<(i32, i64)> {
        sqlx::query_as::<_, (i32, i64)>("SELECT part, seq FROM kafka_seen ORDER BY id")
            .fetch_all(pool)
            .await
            .unwrap()
    }

    async fn effect_count(pool: &Pool) -> usize {
        effects(pool).await.len()
    }

    /// Every partition's sequences were applied in order, each once.
    fn assert_partition_order(seen: &[(i32, i64)], partitions: i32, per_partition: i64) {
        let mut by_part: BTreeMap<i32, Vec<i64>> = BTreeMap::new();
        for &(part, seq) in seen {
            by_part.entry(part).or_default().push(seq);
        }
        for part in 0..partitions {
            let expected: Vec<i64> = (0..per_partition).collect();
            assert_eq!(by_part.get(&part), Some(&expected), "partition {part} applied in offset order, once each");
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn records_apply_once_in_partition_order_with_positions_in_the_database() {
        let _serial = SERIAL.lock().await;
        let (pool, _guard) = setup().await;
        let cluster = mock(3);
        let bootstrap = cluster.bootstrap_servers();
        cluster.create_topic("credits", 3, 1).unwrap();
        let producer = producer(&bootstrap);
        let mut expected_total = 0;
        for seq in 0..20_i64 {
            for part in 0..3 {
                let id = format!("c-{part}-{seq}");
                let amount = 1 + seq * 10 + i64::from(part);
                expected_total += amount;
                produce(&producer, "credits", part, Some("kafka.credit"), Some(&id), Some(&credit(&id, amount, part, seq))).await;
            }
        }

        let (running, handle) = start(&pool, config(&bootstrap, "g-basic", "credits"), 8).await;
        wait_until("60 effects", Duration::from_secs(120), || async { effect_count(&pool).await == 60 }).await;
        assert_eq!(
            handle.assignment().iter().map(|(t, p, e)| (t.as_str(), *p, *e)).collect::<Vec<_>>(),
            [("credits", 0, 1), ("credits", 1, 1), ("credits", 2, 1)],
            "the first assignment of each partition holds epoch 1"
        );
        let report = running.stop().await;
        assert_eq!((report.processed, report.duplicates, report.acked, report.fenced), (60, 0, 60, 0));

        let all = effects(&pool).await;
        assert!(all.values().all(|&(applied, _)| applied == 1), "each effect applied once");
        assert_eq!(all.values().map(|&(_, total)| total).sum::<i64>(), expected_total);
        assert_partition_order(&seen(&pool).await, 3, 20);
        // The database holds each partition's next offset.
        let stored: Vec<(String, i32, Option<i64>, i64)> = positions(&pool, "g-basic")
            .await
            .into_iter()
            .map(|row| (row.topic, row.partition, row.next_offset, row.epoch))
            .collect();
        assert_eq!(
            stored,
            (0..3).map(|p| ("credits".to_owned(), p, Some(20), 1)).collect::<Vec<_>>()
        );
        // The inbox rows record where each message came from.
        let (source, partition, offset): (String, String, i64) = sqlx::query_as(
            "SELECT source, source_partition, source_offset FROM inbox_messages WHERE message_key = 'c-2-7'",
        )
        .fetch_one(&pool)
        .await
        .unwrap();
        assert_eq!((source.as_str(), partition.as_str(), offset), ("credits", "2", 7));

        // A second consumer of the group starts at the stored positions: nothing again.
        let extra = format!("c-1-{}", 20);
        produce(&producer, "credits", 1, Some("kafka.credit"), Some(&extra), Some(&credit(&extra, 5, 1, 20))).await;
        let (running, _) = start(&pool, config(&bootstrap, "g-basic", "credits"), 8).await;
        wait_until("the 61st effect", Duration::from_secs(120), || async { effect_count(&pool).await == 61 }).await;
        let report = running.stop().await;
        assert_eq!((report.deliveries, report.processed, report.duplicates), (1, 1, 0), "resumed at the stored positions");
        let stored: Vec<(i32, Option<i64>, i64)> = positions(&pool, "g-basic")
            .await
            .into_iter()
            .map(|row| (row.partition, row.next_offset, row.epoch))
            .collect();
        assert_eq!(stored, [(0, Some(20), 2), (1, Some(21), 2), (2, Some(20), 2)]);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn bad_records_are_kept_as_rejections_and_the_partition_moves_on() {
        let _serial = SERIAL.lock().await;
        let (pool, _guard) = setup().await;
        let cluster = mock(1);
        let bootstrap = cluster.bootstrap_servers();
        cluster.create_topic("bad", 1, 1).unwrap();
        let producer = producer(&bootstrap);
        let oversized = credit(&"x".repeat(5000), 1, 0, 0);
        let good = credit("good", 7, 0, 0);
        // No name, unknown name, malformed payload, tombstone, oversized, then a good one.
        produce(&producer, "bad", 0, None, None, Some(&good)).await;
        produce(&producer, "bad", 0, Some("no.such.message"), None, Some(&good)).await;
        produce(&producer, "bad", 0, Some("kafka.credit"), None, Some(b"{not json")).await;
        produce(&producer, "bad", 0, Some("kafka.credit"), Some("k"), None).await;
        produce(&producer, "bad", 0, Some("kafka.credit"), None, Some(&oversized)).await;
        produce(&producer, "bad", 0, Some("kafka.credit"), None, Some(&good)).await;

        let (running, _) = start(&pool, config(&bootstrap, "g-bad", "bad"), 4).await;
        wait_until("the good record", Duration::from_secs(120), || async { effect_count(&pool).await == 1 }).await;
        wait_until("the position past all six", Duration::from_secs(60), || async {
            positions(&pool, "g-bad").await.first().and_then(|row| row.next_offset) == Some(6)
        })
        .await;
        let report = running.stop().await;
        assert_eq!((report.invalid, report.processed, report.acked, report.rejected), (5, 1, 6, 0));
        let rejections: Vec<RejectionRow> = sqlx::query_as(
            "SELECT reason, message_name, source, source_partition, source_offset \
             FROM inbox_rejections ORDER BY source_offset",
        )
        .fetch_all(&pool)
        .await
        .unwrap();
        let bad = |reason: &str, name: &str, offset: i64| {
            (reason.to_owned(), name.to_owned(), Some("bad".to_owned()), Some("0".to_owned()), Some(offset))
        };
        assert_eq!(
            rejections,
            [
                bad("malformed", "", 0),
                bad("unknown_message", "no.such.message", 1),
                bad("malformed", "kafka.credit", 2),
                bad("malformed", "kafka.credit", 3),
                bad("too_large", "kafka.credit", 4),
            ]
        );
        assert_eq!(inbox_tests::effect::<Db>(&pool, "good").await, Some((1, 7)));
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn a_zombie_is_fenced_and_its_effect_rolls_back() {
        let _serial = SERIAL.lock().await;
        let (pool, _guard) = setup().await;
        let cluster = mock(1);
        let bootstrap = cluster.bootstrap_servers();
        cluster.create_topic("zombie", 1, 1).unwrap();
        let producer = producer(&bootstrap);
        for seq in 0..3_i64 {
            let id = format!("z-{seq}");
            produce(&producer, "zombie", 0, Some("kafka.credit"), None, Some(&credit(&id, 10 + seq, 0, seq))).await;
        }
        let (entered, release) = hold("z-0");

        // A takes the partition and stops inside the handler of z-0, its claim open.
        let config_a = config(&bootstrap, "g-zombie", "zombie").revoke_wait(Duration::from_secs(120));
        let (a, a_handle) = start(&pool, config_a, 4).await;
        tokio::time::timeout(Duration::from_secs(120), entered.notified()).await.expect("A runs z-0");
        assert_eq!(a_handle.assignment(), [("zombie".to_owned(), 0, 1)]);

        // The group coordinator forgets A (its heartbeat answered UNKNOWN_MEMBER_ID): A's
        // assignment is lost while its handler still runs. B joins and takes the partition.
        cluster.request_errors(
            rdkafka::types::RDKafkaApiKey::Heartbeat,
            &[rdkafka::types::RDKafkaRespErr::RD_KAFKA_RESP_ERR_UNKNOWN_MEMBER_ID; 3],
        );
        let (b, b_handle) = start(&pool, config(&bootstrap, "g-zombie", "zombie"), 4).await;
        // PostgreSQL and MySQL lock rows: B's assignment does not wait for A.
        if BACKEND != Backend::Sqlite {
            wait_until("B holds the partition at epoch 2", Duration::from_secs(120), || async {
                b_handle.assignment() == [("zombie".to_owned(), 0, 2)]
            })
            .await;
            assert_eq!(positions(&pool, "g-zombie").await[0].epoch, 2);
            // B's claim of z-0 waits for A's open transaction; z-1 and z-2 wait behind z-0.
            assert_eq!(effect_count(&pool).await, 0);
        }
        // SQLite has one writer: B's assignment (its epoch increment) waits for A's open
        // transaction, so A either commits first (and B starts after z-0) or, if B got in
        // first, is fenced. Either way z-0 applies once.

        // A resumes: its position write carries epoch 1, the row is at 2: A's transaction
        // rolls back, nothing of it stays, and B applies z-0 (and the rest) once.
        release.close();
        wait_until("B applies all three", Duration::from_secs(120), || async { effect_count(&pool).await == 3 }).await;
        let b_report = b.stop().await;
        let a_report = a.stop().await;
        if BACKEND != Backend::Sqlite {
            assert_eq!((a_report.fenced, a_report.processed, a_report.acked), (1, 0, 0), "A's z-0 was fenced, not acked");
            assert_eq!((b_report.processed, b_report.fenced), (3, 0));
        } else {
            // A committed z-0 before B could take the partition (and may have taken it back
            // after), or was fenced: three effects between them, each once.
            assert!(a_report.fenced <= 1, "{a_report:?}");
            assert_eq!(a_report.processed + b_report.processed, 3, "{a_report:?} {b_report:?}");
        }
        let all = effects(&pool).await;
        assert_eq!(
            all,
            BTreeMap::from([
                ("z-0".to_owned(), (1, 10)),
                ("z-1".to_owned(), (1, 11)),
                ("z-2".to_owned(), (1, 12)),
            ])
        );
        // Nothing recorded for A's attempt: B's was the first and only.
        assert_eq!(inbox_row::<Db>(&pool, "kafka-credits", "z-0").await, Some(("processed".to_owned(), 1)));
        assert_eq!(seen(&pool).await, [(0, 0), (0, 1), (0, 2)]);
        assert_eq!(positions(&pool, "g-zombie").await[0].next_offset, Some(3));
        *GATE.lock().unwrap() = None;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn rebalances_commit_errors_and_a_broker_outage_keep_effects_exact() {
        let _serial = SERIAL.lock().await;
        let (pool, _guard) = setup().await;
        let cluster = mock(3);
        let bootstrap = cluster.bootstrap_servers();
        cluster.create_topic("moving", 6, 1).unwrap();
        // Known leaders (broker 2 leads partitions 1 and 4) and the group's coordinator on broker
        // 1: the outage below stops exactly two partitions, and the others can be checked to go on.
        for part in 0..6 {
            cluster.partition_leader("moving", part, Some(part % 3 + 1)).unwrap();
        }
        let group = "g-moving";
        cluster.coordinator(rdkafka::mocking::MockCoordinator::Group(group.into()), 1).unwrap();
        let on_broker_2 = |part: i32| part % 3 + 1 == 2;
        let producer = producer(&bootstrap);
        let per_partition = 60_i64;
        let mut expected_total = 0;
        let mut produce_round = async |from: i64, to: i64, parts: &[i32]| {
            for seq in from..to {
                for &part in parts {
                    let id = format!("m-{part}-{seq}");
                    let amount = 100 + seq * 7 + i64::from(part);
                    expected_total += amount;
                    produce(&producer, "moving", part, Some("kafka.credit"), Some(&id), Some(&credit(&id, amount, part, seq))).await;
                }
            }
        };
        let all_parts: Vec<i32> = (0..6).collect();
        let (up_parts, down_parts): (Vec<i32>, Vec<i32>) = all_parts.iter().partition(|&&part| !on_broker_2(part));
        let (c1, _) = start(&pool, config(&bootstrap, group, "moving"), 6).await;
        let (c2, h2) = start(&pool, config(&bootstrap, group, "moving"), 6).await;
        produce_round(0, 20, &all_parts).await;
        wait_until("a third of the effects", Duration::from_secs(180), || async { effect_count(&pool).await >= 60 }).await;

        // A third consumer joins mid-stream; the coordinator refuses offset commits meanwhile.
        cluster.request_errors(
            rdkafka::types::RDKafkaApiKey::OffsetCommit,
            &[rdkafka::types::RDKafkaRespErr::RD_KAFKA_RESP_ERR_REBALANCE_IN_PROGRESS; 8],
        );
        let (c3, h3) = start(&pool, config(&bootstrap, group, "moving"), 6).await;
        produce_round(20, 40, &all_parts).await;
        wait_until("two thirds of the effects", Duration::from_secs(180), || async { effect_count(&pool).await >= 200 }).await;

        // A broker goes down: the partitions it leads stop, the others go on (ten new records each,
        // produced and applied during the outage). It comes back; then the first consumer leaves.
        cluster.broker_down(2).unwrap();
        produce_round(40, 50, &up_parts).await;
        wait_until("the other partitions' records while broker 2 is down", Duration::from_secs(180), || async {
            let seen = seen(&pool).await;
            up_parts.iter().all(|&part| seen.iter().filter(|&&(p, _)| p == part).count() == 50)
        })
        .await;
        cluster.broker_up(2).unwrap();
        let c1_report = c1.stop().await;
        produce_round(40, 50, &down_parts).await;
        produce_round(50, per_partition, &all_parts).await;
        let until = Instant::now() + Duration::from_secs(300);
        while effect_count(&pool).await < 360 {
            if Instant::now() > until {
                let per_part: BTreeMap<i32, usize> = seen(&pool).await.into_iter().fold(BTreeMap::new(), |mut m, (p, _)| {
                    *m.entry(p).or_default() += 1;
                    m
                });
                panic!(
                    "timed out waiting for every effect: applied per partition {per_part:?}; positions {:?}; assignments c2 {:?} c3 {:?}",
                    positions(&pool, group).await,
                    h2.assignment(),
                    h3.assignment()
                );
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        let c2_report = c2.stop().await;
        let c3_report = c3.stop().await;

        let all = effects(&pool).await;
        assert_eq!(all.len(), 360);
        assert!(all.values().all(|&(applied, _)| applied == 1), "each effect applied once");
        assert_eq!(all.values().map(|&(_, total)| total).sum::<i64>(), expected_total);
        assert_partition_order(&seen(&pool).await, 6, per_partition);
        let processed = c1_report.processed + c2_report.processed + c3_report.processed;
        assert_eq!(processed, 360, "every record processed once over the three consumers");
        let stored: Vec<(i32, Option<i64>)> = positions(&pool, group)
            .await
            .into_iter()
            .map(|row| (row.partition, row.next_offset))
            .collect();
        assert_eq!(stored, (0..6).map(|p| (p, Some(per_partition))).collect::<Vec<_>>());
        let redelivered: u64 = [&c1_report, &c2_report, &c3_report].iter().map(|r| r.duplicates).sum();
        println!("rebalance test: {redelivered} duplicates after handovers; reports {c1_report:?} {c2_report:?} {c3_report:?}");
    }
}
