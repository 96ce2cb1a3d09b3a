//! Transactions that end before the protocol's `COMMIT`, on PostgreSQL: an error the handler
//! swallowed (the transaction is aborted), a raw `ROLLBACK` or `COMMIT` of the handler's own
//! (with or without a `BEGIN` after it), a deferred constraint failing at `COMMIT`, a
//! serialization failure at `COMMIT`. Each on the three ways a delivery runs: a direct call on
//! the caller's connection (verify, then `COMMIT`), `dispatch_on` on a connection slot (verify,
//! `COMMIT` and `BEGIN` in one round trip) and a batch (`dispatch_batch_on`). For each: the
//! outcome is a failure with the right [`StoreOperation`], nothing is reported processed that
//! did not commit (exact effects and inbox rows), and the connection is usable afterwards.
//! Then the round trips a delivery takes, counted on the wire by a proxy; last, a raw
//! `ROLLBACK` or `COMMIT` on every backend (SQLite and MySQL/MariaDB too), on a direct call and
//! on `dispatch_on`. A swallowed error, a deferred constraint and a serialization failure at
//! `COMMIT` are PostgreSQL's cases: there a failed statement aborts the transaction, and the
//! others' constraints are not deferred (MySQL) or their transactions not serializable
//! snapshots (SQLite).

#![allow(missing_docs)]

use std::sync::atomic::{AtomicBool, AtomicU8, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use inbox_runtime::types::StoreOperation;
use inbox_runtime::{
    ConnectionSlot, ConsumerOutcome, Dispatcher, Error, Message, Outcome, RetryPolicy,
};
use inbox_tests::{APPLY_EFFECT, effect, effects, envelope, inbox_row};
use serde::{Deserialize, Serialize};
use sqlx::{Connection as _, PgPool};

/// A message whose handler applies its effect, then ends its transaction as `how` says.
#[derive(Debug, Clone, Serialize, Deserialize, Message)]
#[message(name = "test.early")]
pub struct Early {
    #[message(key)]
    pub id: String,
    pub how: String,
}

/// The second connection a serialization failure needs (a rival transaction), set by the one
/// test that uses it.
static RIVAL: Mutex<Option<PgPool>> = Mutex::new(None);

/// Whether the rival has run once already (the retry after it then commits).
static RIVAL_RAN: AtomicBool = AtomicBool::new(false);

#[inbox_runtime::idempotent(consumer = "early")]
async fn end_early(conn: &mut sqlx::PgConnection, msg: Early) -> Result<(), sqlx::Error> {
    sqlx::query(APPLY_EFFECT)
        .bind(&msg.id)
        .bind(1_i64)
        .execute(&mut *conn)
        .await?;
    match msg.how.as_str() {
        "ok" => {}
        "swallow" => {
            // The error is not returned: the transaction is left aborted.
            let failed = sqlx::query("SELECT 1 / 0").execute(&mut *conn).await;
            assert!(failed.is_err());
        }
        "rollback" | "rollback_begin" | "commit" | "commit_begin" => {
            let sql = match msg.how.as_str() {
                "rollback" => "ROLLBACK",
                "rollback_begin" => "ROLLBACK; BEGIN",
                "commit" => "COMMIT",
                _ => "COMMIT; BEGIN",
            };
            sqlx::raw_sql(sql).execute(&mut *conn).await?;
        }
        "deferred" => {
            // A child without its parent: the deferred foreign key fails at COMMIT.
            sqlx::query("INSERT INTO children (id, parent) VALUES ($1, 'missing')")
                .bind(&msg.id)
                .execute(&mut *conn)
                .await?;
        }
        "serialization" => write_skew(conn, &msg.id).await?,
        other => panic!("unknown way {other}"),
    }
    Ok(())
}

/// Reads `a`, writes `b`; the first time, a rival serializable transaction reads `b`, writes
/// `a` and commits meanwhile: this transaction then fails at its COMMIT (SQLSTATE 40001).
async fn write_skew(conn: &mut sqlx::PgConnection, id: &str) -> Result<(), sqlx::Error> {
    sqlx::query("SELECT count(*) FROM skew WHERE k = 'a'")
        .execute(&mut *conn)
        .await?;
    sqlx::query("INSERT INTO skew (k, id) VALUES ('b', $1)")
        .bind(id)
        .execute(&mut *conn)
        .await?;
    if !RIVAL_RAN.swap(true, Ordering::SeqCst) {
        let rival = RIVAL
            .lock()
            .unwrap()
            .clone()
            .expect("the rival pool is set");
        let mut tx = rival.begin().await?;
        sqlx::query("SELECT count(*) FROM skew WHERE k = 'b'")
            .execute(&mut *tx)
            .await?;
        sqlx::query("INSERT INTO skew (k, id) VALUES ('a', 'rival')")
            .execute(&mut *tx)
            .await?;
        tx.commit().await?;
    }
    Ok(())
}

/// A fresh database with the tables the ways need.
async fn fixture() -> PgPool {
    let pool = inbox_tests::pg_pool(4).await;
    sqlx::raw_sql(
        "CREATE TABLE parents (id TEXT PRIMARY KEY); \
         CREATE TABLE children (id TEXT PRIMARY KEY, \
           parent TEXT NOT NULL REFERENCES parents (id) DEFERRABLE INITIALLY DEFERRED); \
         CREATE TABLE skew (k TEXT NOT NULL, id TEXT NOT NULL)",
    )
    .execute(&pool)
    .await
    .unwrap();
    pool
}

fn early(id: &str, how: &str) -> Early {
    Early {
        id: id.into(),
        how: how.into(),
    }
}

/// The operation of a failed outcome's database error (`None`: not a database error).
fn operation<T, E>(result: &Result<Outcome<T>, Error<E>>) -> Option<StoreOperation> {
    match result {
        Err(Error::Database(error)) => Some(error.operation),
        _ => None,
    }
}

fn only(outcomes: Vec<ConsumerOutcome>) -> ConsumerOutcome {
    assert_eq!(outcomes.len(), 1);
    outcomes.into_iter().next().unwrap()
}

/// Sessions of the test database that sit inside a transaction (seen from another
/// connection).
async fn open_transactions(pool: &PgPool) -> i64 {
    sqlx::query_scalar(
        "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() \
         AND pid <> pg_backend_pid() AND state LIKE 'idle in transaction%'",
    )
    .fetch_one(pool)
    .await
    .unwrap()
}

/// What a way leaves, on each path: the operation that fails, the effect and the inbox row
/// left for its key.
struct Expected {
    /// `None`: processed.
    operation: Option<StoreOperation>,
    effect: Option<(i64, i64)>,
    row: Option<(&'static str, i32)>,
}

/// The direct call on the caller's connection: the failure, the effect and row left, then the
/// connection at once outside any transaction and usable (a next message commits).
async fn direct(pool: &PgPool, how: &str, expected: &Expected) {
    let mut conn = pool.acquire().await.unwrap();
    let id = format!("direct-{how}");
    let result = end_early(&mut conn, early(&id, how)).await;
    assert_eq!(operation(&result), expected.operation, "{result:?}");
    assert_eq!(effect(pool, &id).await, expected.effect);
    assert_eq!(
        inbox_row(pool, "early", &id).await,
        expected.row.map(|(s, a)| (s.to_owned(), a))
    );
    // Nothing left open on the caller's connection, and it works.
    assert_eq!(open_transactions(pool).await, 0);
    let after = format!("direct-{how}-after");
    let next = end_early(&mut conn, early(&after, "ok")).await;
    assert!(matches!(next, Ok(Outcome::Processed(()))), "{next:?}");
    assert_eq!(effect(pool, &after).await, Some((1, 1)));
    assert_eq!(open_transactions(pool).await, 0);
    // The connection's own transactions are real ones (not savepoints of a leftover).
    let mut tx = conn.begin().await.unwrap();
    sqlx::query(APPLY_EFFECT)
        .bind(format!("direct-{how}-own"))
        .bind(1_i64)
        .execute(&mut *tx)
        .await
        .unwrap();
    tx.commit().await.unwrap();
    assert_eq!(
        effect(pool, &format!("direct-{how}-own")).await,
        Some((1, 1))
    );
}

/// `dispatch_on` on a slot: the same, and the slot's next delivery commits.
async fn single(dispatcher: &Dispatcher<sqlx::Postgres>, how: &str, expected: &Expected) {
    let pool = dispatcher.pool();
    let mut slot = ConnectionSlot::new();
    let warm = format!("single-{how}-before");
    let first = only(
        dispatcher
            .dispatch_on(&mut slot, &envelope(&early(&warm, "ok")))
            .await
            .unwrap(),
    );
    assert!(matches!(first.result, Ok(Outcome::Processed(()))));
    let id = format!("single-{how}");
    let outcome = only(
        dispatcher
            .dispatch_on(&mut slot, &envelope(&early(&id, how)))
            .await
            .unwrap(),
    );
    assert_eq!(
        operation(&outcome.result),
        expected.operation,
        "{:?}",
        outcome.result
    );
    assert_eq!(effect(pool, &id).await, expected.effect);
    assert_eq!(
        inbox_row(pool, "early", &id).await,
        expected.row.map(|(s, a)| (s.to_owned(), a))
    );
    // The slot's connection works, and what it commits is seen by others.
    let after = format!("single-{how}-after");
    let next = only(
        dispatcher
            .dispatch_on(&mut slot, &envelope(&early(&after, "ok")))
            .await
            .unwrap(),
    );
    assert!(matches!(next.result, Ok(Outcome::Processed(()))));
    assert_eq!(effect(pool, &warm).await, Some((1, 1)));
    assert_eq!(effect(pool, &after).await, Some((1, 1)));
    assert_eq!(
        inbox_row(pool, "early", &after).await,
        Some(("processed".to_owned(), 1))
    );
}

/// A batch of three, the way last: the two others are processed once.
async fn batch(dispatcher: &Dispatcher<sqlx::Postgres>, how: &str, expected: &Expected) {
    let pool = dispatcher.pool();
    let mut slot = ConnectionSlot::new();
    // The way last, in the batch's order and in its claims' (by key): a handler that ends the
    // batch's transaction itself must be the last one to run in it (see the test's notes).
    let ids = [
        format!("batch-{how}-1"),
        format!("batch-{how}-2"),
        format!("batch-{how}-3"),
    ];
    let envelopes = [
        envelope(&early(&ids[0], "ok")),
        envelope(&early(&ids[1], "ok")),
        envelope(&early(&ids[2], how)),
    ];
    let results = dispatcher.dispatch_batch_on(&mut slot, &envelopes).await;
    let outcomes: Vec<ConsumerOutcome> = results
        .into_iter()
        .map(|result| only(result.unwrap()))
        .collect();
    assert!(matches!(outcomes[0].result, Ok(Outcome::Processed(()))));
    assert!(
        matches!(outcomes[1].result, Ok(Outcome::Processed(()))),
        "{:?}",
        outcomes[1].result
    );
    match expected.operation {
        Some(operation_) => assert_eq!(
            operation(&outcomes[2].result),
            Some(operation_),
            "{:?}",
            outcomes[2].result
        ),
        None => assert!(
            matches!(outcomes[2].result, Ok(Outcome::Processed(()))),
            "{:?}",
            outcomes[2].result
        ),
    }
    assert_eq!(effect(pool, &ids[0]).await, Some((1, 1)));
    assert_eq!(effect(pool, &ids[1]).await, Some((1, 1)));
    assert_eq!(effect(pool, &ids[2]).await, expected.effect);
    assert_eq!(
        inbox_row(pool, "early", &ids[2]).await,
        expected.row.map(|(s, a)| (s.to_owned(), a))
    );
    for id in [&ids[0], &ids[1]] {
        assert_eq!(
            inbox_row(pool, "early", id).await,
            Some(("processed".to_owned(), 1))
        );
    }
    // The slot's connection works: a next batch commits.
    let after = format!("batch-{how}-after");
    let next = dispatcher
        .dispatch_batch_on(&mut slot, &[envelope(&early(&after, "ok"))])
        .await;
    assert!(matches!(
        only(next.into_iter().next().unwrap().unwrap()).result,
        Ok(Outcome::Processed(()))
    ));
    assert_eq!(effect(pool, &after).await, Some((1, 1)));
}

/// Every path for one way, in a database of its own. Transient failures are not retried in
/// process (the dispatcher's policy), so that the failure itself is seen.
async fn every_path(how: &str, expected: Expected) {
    let pool = fixture().await;
    let dispatcher = Dispatcher::from_registry(pool.clone())
        .unwrap()
        .with_retry_policy(RetryPolicy::default().transient_retries(0));
    direct(&pool, how, &expected).await;
    single(&dispatcher, how, &expected).await;
    batch(&dispatcher, how, &expected).await;
}

/// The handler swallowed an error: the verify fails (25P02), nothing commits, the attempt is
/// recorded as failed.
#[tokio::test]
async fn an_error_the_handler_swallowed() {
    every_path(
        "swallow",
        Expected {
            operation: Some(StoreOperation::Verify),
            effect: None,
            row: Some(("failed", 1)),
        },
    )
    .await;
}

/// The handler rolled back itself: its effect and the claim are gone, the verify fails.
#[tokio::test]
async fn a_raw_rollback() {
    for how in ["rollback", "rollback_begin"] {
        every_path(
            how,
            Expected {
                operation: Some(StoreOperation::Verify),
                effect: None,
                row: Some(("failed", 1)),
            },
        )
        .await;
    }
}

/// The handler committed itself: its effect and the claim did commit, so the key stays
/// processed, but the delivery is not reported processed: the protocol's own COMMIT is never
/// reached (the verify fails). In a batch, the handler's COMMIT committed every claim of the
/// batch and the effects before it: the batch's verify fails, and its run again finds every
/// key processed (duplicates), each effect applied once.
#[tokio::test]
async fn a_raw_commit() {
    for how in ["commit", "commit_begin"] {
        let pool = fixture().await;
        let dispatcher = Dispatcher::from_registry(pool.clone())
            .unwrap()
            .with_retry_policy(RetryPolicy::default().transient_retries(0));
        let expected = Expected {
            operation: Some(StoreOperation::Verify),
            effect: Some((1, 1)),
            row: Some(("processed", 1)),
        };
        direct(&pool, how, &expected).await;
        single(&dispatcher, how, &expected).await;

        let mut slot = ConnectionSlot::new();
        let ids = [1, 2, 3].map(|n| format!("batch-{how}-{n}"));
        let envelopes = [
            envelope(&early(&ids[0], "ok")),
            envelope(&early(&ids[1], "ok")),
            envelope(&early(&ids[2], how)),
        ];
        let results = dispatcher.dispatch_batch_on(&mut slot, &envelopes).await;
        for result in results {
            let outcome = only(result.unwrap());
            assert!(
                matches!(outcome.result, Ok(Outcome::Duplicate)),
                "{:?}",
                outcome.result
            );
        }
        for id in &ids {
            assert_eq!(effect(&pool, id).await, Some((1, 1)));
            assert_eq!(
                inbox_row(&pool, "early", id).await,
                Some(("processed".to_owned(), 1))
            );
        }
        let after = format!("batch-{how}-after");
        let next = dispatcher
            .dispatch_batch_on(&mut slot, &[envelope(&early(&after, "ok"))])
            .await;
        assert!(matches!(
            only(next.into_iter().next().unwrap().unwrap()).result,
            Ok(Outcome::Processed(()))
        ));
        assert_eq!(effect(&pool, &after).await, Some((1, 1)));
    }
}

/// A deferred constraint fails at COMMIT: the commit's error, nothing committed.
#[tokio::test]
async fn a_deferred_constraint_failing_at_commit() {
    every_path(
        "deferred",
        Expected {
            operation: Some(StoreOperation::Commit),
            effect: None,
            row: None,
        },
    )
    .await;
}

/// A serializable transaction that fails at COMMIT (write skew with a rival that committed
/// first): the commit's error, nothing committed. The direct call retries the transient
/// failure in process (the default policy): its retry commits, once.
#[tokio::test]
async fn a_serialization_failure_at_commit() {
    let pool = fixture().await;
    let options = (*pool.connect_options()).clone();
    let serializable = sqlx::postgres::PgPoolOptions::new()
        .max_connections(2)
        .after_connect(|conn, _| {
            Box::pin(async move {
                sqlx::raw_sql("SET default_transaction_isolation = 'serializable'")
                    .execute(conn)
                    .await
                    .map(drop)
            })
        })
        .connect_with(options.clone())
        .await
        .unwrap();
    *RIVAL.lock().unwrap() = Some(serializable.clone());
    let expected = Expected {
        operation: Some(StoreOperation::Commit),
        effect: None,
        row: None,
    };
    let dispatcher = Dispatcher::from_registry(serializable.clone())
        .unwrap()
        .with_retry_policy(RetryPolicy::default().transient_retries(0));
    RIVAL_RAN.store(false, Ordering::SeqCst);
    single(&dispatcher, "serialization", &expected).await;
    // A batch that fails at COMMIT runs its messages one by one: the rival ran once already,
    // so each of them commits, once.
    RIVAL_RAN.store(false, Ordering::SeqCst);
    let processed = Expected {
        operation: None,
        effect: Some((1, 1)),
        row: Some(("processed", 1)),
    };
    batch(&dispatcher, "serialization", &processed).await;

    RIVAL_RAN.store(false, Ordering::SeqCst);
    let mut conn = serializable.acquire().await.unwrap();
    let result = end_early(&mut conn, early("direct-serialization", "serialization")).await;
    assert!(matches!(result, Ok(Outcome::Processed(()))), "{result:?}");
    assert_eq!(effect(&pool, "direct-serialization").await, Some((1, 1)));
    assert_eq!(
        inbox_row(&pool, "early", "direct-serialization").await,
        Some(("processed".to_owned(), 1))
    );
    // Every committed transaction wrote its `b` (the rolled-back ones did not).
    let skew: Vec<(String, String)> = sqlx::query_as("SELECT k, id FROM skew ORDER BY k, id")
        .fetch_all(&pool)
        .await
        .unwrap();
    assert_eq!(
        skew,
        [
            ("a", "rival"),
            ("a", "rival"),
            ("a", "rival"),
            ("b", "batch-serialization-3"),
            ("b", "direct-serialization"),
        ]
        .map(|(k, id)| (k.to_owned(), id.to_owned()))
    );
    assert_eq!(effects(&pool).await.len(), 7);
}

/// A TCP proxy in front of PostgreSQL that counts the client's turns: a turn starts when the
/// client sends after the server last spoke (a request it waits on). Each turn is one round
/// trip.
struct Proxy {
    addr: std::net::SocketAddr,
    turns: Arc<AtomicU64>,
}

impl Proxy {
    async fn start(upstream: String) -> Self {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let turns = Arc::new(AtomicU64::new(0));
        let counter = turns.clone();
        tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                let server = tokio::net::TcpStream::connect(&upstream).await.unwrap();
                tokio::spawn(relay(client, server, counter.clone()));
            }
        });
        Self { addr, turns }
    }

    fn turns(&self) -> u64 {
        self.turns.load(Ordering::SeqCst)
    }
}

/// Copies both ways, counting the client's turns.
async fn relay(
    client: tokio::net::TcpStream,
    server: tokio::net::TcpStream,
    turns: Arc<AtomicU64>,
) {
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
    const CLIENT: u8 = 1;
    const SERVER: u8 = 2;
    let last = Arc::new(AtomicU8::new(SERVER));
    let (mut client_read, mut client_write) = client.into_split();
    let (mut server_read, mut server_write) = server.into_split();
    let up_last = last.clone();
    let up = async move {
        let mut buf = vec![0u8; 65536];
        loop {
            let n = client_read.read(&mut buf).await.unwrap_or(0);
            if n == 0 {
                let _ = server_write.shutdown().await;
                return;
            }
            if up_last.swap(CLIENT, Ordering::SeqCst) == SERVER {
                turns.fetch_add(1, Ordering::SeqCst);
            }
            if server_write.write_all(&buf[..n]).await.is_err() {
                return;
            }
        }
    };
    let down = async move {
        let mut buf = vec![0u8; 65536];
        loop {
            let n = server_read.read(&mut buf).await.unwrap_or(0);
            if n == 0 {
                let _ = client_write.shutdown().await;
                return;
            }
            last.store(SERVER, Ordering::SeqCst);
            if client_write.write_all(&buf[..n]).await.is_err() {
                return;
            }
        }
    };
    tokio::join!(up, down);
}

/// Round trips per delivery on a held connection, counted on the wire, for a one-statement
/// handler (and per batch of three). In steady state a new message takes 3: the claim (in the
/// slot's spare transaction, no `BEGIN` of its own), the handler's statement, then verify,
/// `COMMIT` and the next `BEGIN` in one; a duplicate takes 2: the claim, then `ROLLBACK` and
/// the next `BEGIN` in one. The direct call on the caller's connection takes 5 for a new
/// message (`BEGIN`, verify and `COMMIT` apart, nothing left open).
#[tokio::test]
async fn round_trips_per_delivery() {
    let pool = fixture().await;
    let options = (*pool.connect_options()).clone();
    let url = inbox_tests::database_url();
    let upstream = url
        .split('@')
        .nth(1)
        .and_then(|rest| rest.split('/').next())
        .expect("DATABASE_URL has a host:port")
        .to_owned();
    let proxy = Proxy::start(upstream).await;
    let proxied = sqlx::postgres::PgPoolOptions::new()
        .max_connections(1)
        .test_before_acquire(false)
        .connect_with(
            options
                .host(&proxy.addr.ip().to_string())
                .port(proxy.addr.port()),
        )
        .await
        .unwrap();
    let dispatcher = Dispatcher::from_registry(proxied.clone()).unwrap();
    let mut slot = ConnectionSlot::new();
    // Warm up: the connection, and the statements prepared once per connection.
    for id in ["warm-1", "warm-2"] {
        let out = dispatcher
            .dispatch_on(&mut slot, &envelope(&early(id, "ok")))
            .await
            .unwrap();
        assert!(matches!(only(out).result, Ok(Outcome::Processed(()))));
    }
    let mut trips = Vec::new();
    for (id, kind) in [
        ("new-1", "processed"),
        ("new-2", "processed"),
        ("new-1", "duplicate"),
        ("new-3", "processed"),
        ("new-2", "duplicate"),
    ] {
        let before = proxy.turns();
        let out = only(
            dispatcher
                .dispatch_on(&mut slot, &envelope(&early(id, "ok")))
                .await
                .unwrap(),
        );
        assert_eq!(out.result.as_ref().map(Outcome::kind).ok(), Some(kind));
        trips.push((kind, proxy.turns() - before));
    }
    assert_eq!(
        trips,
        [
            ("processed", 3),
            ("processed", 3),
            ("duplicate", 2),
            ("processed", 3),
            ("duplicate", 2),
        ]
    );
    assert_eq!(effects(&pool).await.len(), 5);

    // A batch of three new messages after the warm-up's batch of duplicates (which ended with
    // a plain COMMIT, no spare transaction left): BEGIN, the batch claim, the three
    // statements, then the check, COMMIT and the next BEGIN in one: 6. The same three again,
    // in the spare transaction that left: the batch claim (nothing claimed), the read of the
    // rows found, COMMIT (nothing to check): 3.
    // Warmed up first: each statement is prepared once per connection (the batch claim once
    // per batch size), a round trip more the first time.
    let warm: Vec<_> = ["bw-1", "bw-2", "bw-3"]
        .map(|id| envelope(&early(id, "ok")))
        .into();
    for _ in 0..2 {
        for result in dispatcher.dispatch_batch_on(&mut slot, &warm).await {
            assert!(result.is_ok());
        }
    }
    let batch: Vec<_> = ["b-1", "b-2", "b-3"]
        .map(|id| envelope(&early(id, "ok")))
        .into();
    for (kind, expected) in [("processed", 6), ("duplicate", 3)] {
        let before = proxy.turns();
        let results = dispatcher.dispatch_batch_on(&mut slot, &batch).await;
        let trips = proxy.turns() - before;
        for result in results {
            let out = only(result.unwrap());
            assert_eq!(out.result.as_ref().map(Outcome::kind).ok(), Some(kind));
        }
        assert_eq!(trips, expected, "a batch of three, {kind}");
    }
    assert_eq!(effects(&pool).await.len(), 11);

    // The caller's own connection: 5 for a new message, and nothing left open after it.
    slot.release();
    let mut conn = proxied.acquire().await.unwrap();
    let _ = end_early(&mut conn, early("direct-warm", "ok"))
        .await
        .unwrap();
    let before = proxy.turns();
    let result = end_early(&mut conn, early("direct-new", "ok")).await;
    assert!(matches!(result, Ok(Outcome::Processed(()))));
    assert_eq!(proxy.turns() - before, 5);
    assert_eq!(open_transactions(&pool).await, 0);
}

/// The message of the backend matrix below (a name of its own: the PostgreSQL-only handler
/// above keeps `test.early` to itself).
#[derive(Debug, Clone, Serialize, Deserialize, Message)]
#[message(name = "test.early_any")]
pub struct EarlyAny {
    #[message(key)]
    pub id: String,
    pub how: String,
}

// A raw `ROLLBACK` or `COMMIT` of the handler's own, on every backend, on a direct call and on
// `dispatch_on`.
inbox_tests::backend_matrix! {
    connections(postgres = 4, sqlite = 2, mysql = 4);

    #[inbox_runtime::idempotent(consumer = "early_any")]
    async fn end_early_any(conn: &mut Conn, msg: EarlyAny) -> Result<(), sqlx::Error> {
        sqlx::query(APPLY_EFFECT)
            .bind(&msg.id)
            .bind(1_i64)
            .execute(&mut *conn)
            .await?;
        match msg.how.as_str() {
            "ok" => {}
            "rollback" | "commit" => {
                let sql = if msg.how == "rollback" { "ROLLBACK" } else { "COMMIT" };
                sqlx::raw_sql(sql).execute(&mut *conn).await?;
            }
            other => panic!("unknown way {other}"),
        }
        Ok(())
    }

    fn any(id: &str, how: &str) -> EarlyAny {
        EarlyAny {
            id: id.into(),
            how: how.into(),
        }
    }

    fn failed_operation<T: std::fmt::Debug, E: std::fmt::Debug>(
        result: &Result<Outcome<T>, Error<E>>,
    ) -> Option<StoreOperation> {
        match result {
            Err(Error::Database(error)) => Some(error.operation),
            _ => None,
        }
    }

    /// What a raw `how` leaves on this backend, on the direct call and on `dispatch_on`: the
    /// failed operation of each (`None`: reported processed) and whether the effect and the
    /// claim committed (a `processed` row) or nothing did (no row, or a `failed` one).
    fn expected(how: &str) -> ([Option<StoreOperation>; 2], bool, Option<&'static str>) {
        use StoreOperation::{Commit, Verify};
        match (BACKEND, how) {
            // The claim's mark is gone: the check fails, COMMIT is never reached.
            (Backend::Postgres, "rollback") => ([Some(Verify), Some(Verify)], false, Some("failed")),
            (Backend::Postgres, _) => ([Some(Verify), Some(Verify)], true, Some("processed")),
            // No check on SQLite: the protocol's COMMIT finds no transaction; nothing recorded.
            (Backend::Sqlite, "rollback") => ([Some(Commit), Some(Commit)], false, None),
            (Backend::Sqlite, _) => ([Some(Commit), Some(Commit)], true, Some("processed")),
            // MySQL's check reads the row the claim stamped: gone after a ROLLBACK, and the
            // check fails (the connection is fine: the failure is recorded on it).
            (Backend::MySql, "rollback") => ([Some(Verify), Some(Verify)], false, Some("failed")),
            // After a handler's own COMMIT the stamped row is committed and the check finds it:
            // reported processed, truthfully (the effect committed, once).
            (_, _) => ([None, None], true, Some("processed")),
        }
    }

    #[tokio::test]
    async fn a_raw_rollback_or_commit_is_never_processed_without_its_commit() {
        let (pool, _guard) = fixture().await;
        let dispatcher = inbox_runtime::Dispatcher::from_registry(pool.clone()).unwrap();
        let mut slot = inbox_runtime::ConnectionSlot::new();
        for how in ["rollback", "commit"] {
            let (operations, committed, row) = expected(how);
            let mut conn = pool.acquire().await.unwrap();
            let direct_id = format!("direct-{how}");
            let direct = end_early_any(&mut conn, any(&direct_id, how)).await;
            assert_eq!(failed_operation(&direct), operations[0], "{direct:?}");
            if operations[0].is_none() {
                assert!(matches!(direct, Ok(Outcome::Processed(()))), "{direct:?}");
            }
            // The connection works afterwards.
            let after = format!("{direct_id}-after");
            let next = end_early_any(&mut conn, any(&after, "ok")).await;
            assert!(matches!(next, Ok(Outcome::Processed(()))), "{next:?}");
            drop(conn);

            let single_id = format!("single-{how}");
            let single = dispatcher
                .dispatch_on(&mut slot, &inbox_tests::envelope(&any(&single_id, how)))
                .await
                .unwrap();
            let single = &single[0].result;
            assert_eq!(failed_operation(single), operations[1], "{single:?}");
            if operations[1].is_none() {
                assert!(matches!(single, Ok(Outcome::Processed(()))), "{single:?}")
            }
            let single_after = format!("{single_id}-after");
            let next = dispatcher
                .dispatch_on(&mut slot, &inbox_tests::envelope(&any(&single_after, "ok")))
                .await
                .unwrap();
            assert!(matches!(next[0].result, Ok(Outcome::Processed(()))), "{:?}", next[0].result);

            for id in [&direct_id, &single_id] {
                let applied = committed.then_some((1, 1));
                assert_eq!(inbox_tests::effect(&pool, id).await, applied, "{id}");
                assert_eq!(
                    inbox_tests::inbox_row(&pool, "early_any", id)
                        .await
                        .map(|(status, _)| status),
                    row.map(str::to_owned),
                    "{id}"
                );
            }
            for id in [&after, &single_after] {
                assert_eq!(inbox_tests::effect(&pool, id).await, Some((1, 1)), "{id}");
            }
        }
    }
}

/// The slot's spare transaction (the one the chained `COMMIT` of `dispatch_on` leaves open for
/// the next claim) is invisible: a conflict found by a claim in it is kept in
/// `inbox_rejections` at once (seen from another connection), and stays there when the slot
/// gives its connection back (a record written inside the spare transaction would be rolled
/// back then); once given back, no transaction is left open.
#[tokio::test]
async fn the_spare_transaction_is_invisible() {
    let pool = fixture().await;
    let dispatcher = Dispatcher::from_registry(pool.clone()).unwrap();
    let mut slot = ConnectionSlot::new();
    let first = only(
        dispatcher
            .dispatch_on(&mut slot, &envelope(&early("spare-1", "ok")))
            .await
            .unwrap(),
    );
    assert!(matches!(first.result, Ok(Outcome::Processed(()))));
    // The spare transaction: begun, nothing run in it.
    assert_eq!(open_transactions(&pool).await, 1);
    // The same key with another payload: the claim runs in the spare transaction and finds
    // the key processed with another payload.
    let conflicting = only(
        dispatcher
            .dispatch_on(&mut slot, &envelope(&early("spare-1", "commit")))
            .await
            .unwrap(),
    );
    assert!(
        matches!(conflicting.result, Err(Error::Conflict(_))),
        "{conflicting:?}"
    );
    let conflicts = || async {
        sqlx::query_scalar::<_, i64>(
            "SELECT count(*) FROM inbox_rejections WHERE reason = 'conflict' AND message_key = 'spare-1'",
        )
        .fetch_one(&pool)
        .await
        .unwrap()
    };
    assert_eq!(conflicts().await, 1);
    slot.release();
    // The pool's check of the returned connection sends the spare transaction's ROLLBACK.
    for _ in 0..200 {
        if open_transactions(&pool).await == 0 {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(10)).await;
    }
    assert_eq!(open_transactions(&pool).await, 0);
    assert_eq!(conflicts().await, 1);
    assert_eq!(
        effects(&pool).await,
        [("spare-1".to_owned(), (1, 1))].into_iter().collect()
    );
}

#[derive(Debug, Clone, Serialize, Deserialize, Message)]
#[message(name = "test.clock")]
pub struct Clock {
    #[message(key)]
    pub id: String,
}

/// Keeps how far the transaction's `now()` lags behind the wall clock when the handler runs.
#[inbox_runtime::idempotent(consumer = "clock")]
async fn read_clock(conn: &mut sqlx::PgConnection, msg: Clock) -> Result<(), sqlx::Error> {
    sqlx::query(
        "INSERT INTO clock_lag (id, lag_ms) \
         VALUES ($1, EXTRACT(EPOCH FROM clock_timestamp() - now()) * 1000)",
    )
    .bind(&msg.id)
    .execute(&mut *conn)
    .await?;
    Ok(())
}

/// A spare transaction's `now()` is the time of the previous delivery's `COMMIT; BEGIN` (found
/// by review: it was used for up to `IDLE_CHECK`, 1 s, so a handler checking a deadline with
/// `now()` accepted what had expired up to 1 s before). Now it is used within
/// `ConnectionSlot::SPARE_WINDOW` (50 ms) only: here the slot waits 400 ms between two
/// deliveries, and the second handler's `now()` lags its wall clock by less than the wait (its
/// own `BEGIN`, its claim and its statement only).
#[tokio::test]
async fn the_handlers_now_is_this_deliverys() {
    let pool = fixture().await;
    sqlx::raw_sql("CREATE TABLE clock_lag (id TEXT PRIMARY KEY, lag_ms FLOAT8 NOT NULL)")
        .execute(&pool)
        .await
        .unwrap();
    let dispatcher = Dispatcher::from_registry(pool.clone()).unwrap();
    let mut slot = ConnectionSlot::new();
    for id in ["clock-1", "clock-2"] {
        let outcome = only(
            dispatcher
                .dispatch_on(&mut slot, &envelope(&Clock { id: id.into() }))
                .await
                .unwrap(),
        );
        assert!(matches!(outcome.result, Ok(Outcome::Processed(()))));
        tokio::time::sleep(std::time::Duration::from_millis(400)).await;
    }
    let lag: f64 = sqlx::query_scalar("SELECT lag_ms FROM clock_lag WHERE id = 'clock-2'")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert!(
        lag < 250.0,
        "the handler's now() lags its wall clock by {lag:.0} ms"
    );
}
