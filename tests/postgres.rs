//! PostgreSQL-only properties: heavy concurrent redelivery and a connection that dies mid-transaction.

#![allow(missing_docs)]

use std::sync::{Arc, Mutex};

use inbox_runtime::{Dispatcher, Envelope, Error, Message, Outcome, Status};
use inbox_tests::APPLY_EFFECT;
use rand::SeedableRng;
use rand::seq::SliceRandom;
use serde::{Deserialize, Serialize};
use sqlx::PgConnection;

/// A payment: one effect per event id.
#[derive(Debug, Clone, Serialize, Deserialize, Message)]
#[message(name = "test.payment")]
pub struct Payment {
    #[message(key)]
    pub event_id: uuid::Uuid,
    pub account: String,
    pub amount_cents: i64,
}

/// Credits the payment's account.
#[inbox_runtime::idempotent(consumer = "ledger")]
pub async fn credit(conn: &mut PgConnection, msg: Payment) -> Result<(), sqlx::Error> {
    sqlx::query(APPLY_EFFECT)
        .bind(&msg.account)
        .bind(msg.amount_cents)
        .execute(conn)
        .await?;
    Ok(())
}

/// A slow message: its handler reports its backend pid, then sleeps in the database.
#[derive(Debug, Clone, Serialize, Deserialize, Message)]
#[message(name = "test.slow")]
pub struct Slow {
    #[message(key)]
    pub id: String,
    pub variant: u32,
}

/// Per message id: where to report the handler's backend pid and how long to sleep after (once).
static SLOW: Mutex<Vec<(String, tokio::sync::oneshot::Sender<i32>, u64)>> = Mutex::new(Vec::new());

fn expect_slow(id: &str, sleep_ms: u64) -> tokio::sync::oneshot::Receiver<i32> {
    let (tx, rx) = tokio::sync::oneshot::channel();
    SLOW.lock().unwrap().push((id.to_owned(), tx, sleep_ms));
    rx
}

/// Applies an effect; if a test is waiting on this id, reports the backend pid and sleeps.
#[inbox_runtime::idempotent(consumer = "ledger")]
pub async fn slow(conn: &mut PgConnection, msg: Slow) -> Result<(), sqlx::Error> {
    sqlx::query(APPLY_EFFECT)
        .bind(format!("slow:{}", msg.id))
        .bind(1_i64)
        .execute(&mut *conn)
        .await?;
    let pid: i32 = sqlx::query_scalar("SELECT pg_backend_pid()")
        .fetch_one(&mut *conn)
        .await?;
    let waiting = {
        let mut slow = SLOW.lock().unwrap();
        let found = slow.iter().position(|(id, ..)| *id == msg.id);
        found.map(|index| slow.remove(index))
    };
    if let Some((_, tx, sleep_ms)) = waiting {
        let _ = tx.send(pid);
        sqlx::query("SELECT pg_sleep($1)")
            .bind(sleep_ms as f64 / 1000.0)
            .execute(&mut *conn)
            .await?;
    }
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn sixteen_tasks_deliver_500_messages_three_times_each() {
    let pool = inbox_tests::pg_pool(16).await;
    let dispatcher = Arc::new(Dispatcher::from_registry(pool.clone()).unwrap());
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(500);
    let mut deliveries = Vec::new();
    for i in 0..500_i64 {
        let payment = Payment {
            event_id: uuid::Uuid::from_u128(0x1000 + i as u128),
            account: format!("acct-{i:03}"),
            amount_cents: 100 + i,
        };
        let payload = serde_json::to_vec(&payment).unwrap();
        for _ in 0..3 {
            deliveries.push(Envelope::new(Payment::NAME, payload.clone()));
        }
    }
    deliveries.shuffle(&mut rng);
    let queue = Arc::new(Mutex::new(deliveries));

    let mut tasks = Vec::new();
    for _ in 0..16 {
        let queue = queue.clone();
        let dispatcher = dispatcher.clone();
        tasks.push(tokio::spawn(async move {
            let (mut processed, mut duplicates, mut errors) = (0_u32, 0_u32, 0_u32);
            loop {
                let Some(envelope) = queue.lock().unwrap().pop() else {
                    break;
                };
                for outcome in dispatcher.dispatch(&envelope).await.unwrap() {
                    match outcome.result {
                        Ok(Outcome::Processed(())) => processed += 1,
                        Ok(Outcome::Duplicate) => duplicates += 1,
                        Ok(other) => panic!("unexpected outcome {other:?}"),
                        Err(error) => {
                            eprintln!("error: {error}");
                            errors += 1
                        }
                    }
                }
            }
            (processed, duplicates, errors)
        }));
    }
    let mut totals = (0, 0, 0);
    for task in tasks {
        let (p, d, e) = task.await.unwrap();
        totals = (totals.0 + p, totals.1 + d, totals.2 + e);
    }
    assert_eq!(totals, (500, 1000, 0));
    let (rows, applied, total): (i64, i64, i64) =
        sqlx::query_as("SELECT COUNT(*), SUM(applied)::BIGINT, SUM(total)::BIGINT FROM effects")
            .fetch_one(&pool)
            .await
            .unwrap();
    assert_eq!(
        (rows, applied, total),
        (500, 500, (0..500).map(|i| 100 + i).sum::<i64>())
    );
    let inbox_rows: i64 =
        sqlx::query_scalar("SELECT COUNT(*) FROM inbox_messages WHERE consumer = 'ledger'")
            .fetch_one(&pool)
            .await
            .unwrap();
    assert_eq!(inbox_rows, 500);
}

#[tokio::test]
async fn concurrent_conflicting_deliveries_one_applies_the_other_conflicts() {
    // Two transactions claim the same key with different payloads at the same time: the second
    // waits on the first's uncommitted claim, then must report a conflict, not a duplicate.
    let pool = inbox_tests::pg_pool(4).await;
    let rx = expect_slow("race", 500);
    let mut first_conn = pool.acquire().await.unwrap();
    let first = tokio::spawn(async move {
        slow(
            &mut first_conn,
            Slow {
                id: "race".into(),
                variant: 1,
            },
        )
        .await
    });
    let _pid = rx.await.unwrap(); // the first holds its claim now
    let mut second_conn = pool.acquire().await.unwrap();
    let second = slow(
        &mut second_conn,
        Slow {
            id: "race".into(),
            variant: 2,
        },
    )
    .await;
    assert_eq!(first.await.unwrap().unwrap(), Outcome::Processed(()));
    let error = second.unwrap_err();
    assert_eq!(error.kind(), "conflict", "{error:?}");
    // Same payload, racing: a duplicate.
    let rx = expect_slow("race2", 300);
    let mut first_conn = pool.acquire().await.unwrap();
    let first = tokio::spawn(async move {
        slow(
            &mut first_conn,
            Slow {
                id: "race2".into(),
                variant: 1,
            },
        )
        .await
    });
    let _pid = rx.await.unwrap();
    let second = slow(
        &mut second_conn,
        Slow {
            id: "race2".into(),
            variant: 1,
        },
    )
    .await;
    assert_eq!(first.await.unwrap().unwrap(), Outcome::Processed(()));
    assert_eq!(second.unwrap(), Outcome::Duplicate);
    let applied: Vec<(String, i64)> =
        sqlx::query_as("SELECT effect_key, applied FROM effects ORDER BY effect_key")
            .fetch_all(&pool)
            .await
            .unwrap();
    assert_eq!(
        applied,
        [("slow:race".to_owned(), 1), ("slow:race2".to_owned(), 1)]
    );
}

#[tokio::test]
async fn connection_killed_mid_transaction_loses_nothing_and_applies_once() {
    let pool = inbox_tests::pg_pool(4).await;
    let rx = expect_slow("k", 30_000);
    let mut victim = pool.acquire().await.unwrap().detach();
    let running = tokio::spawn(async move {
        slow(
            &mut victim,
            Slow {
                id: "k".into(),
                variant: 1,
            },
        )
        .await
    });
    let pid = rx.await.unwrap();
    let terminated: bool = sqlx::query_scalar("SELECT pg_terminate_backend($1)")
        .bind(pid)
        .fetch_one(&pool)
        .await
        .unwrap();
    assert!(terminated);
    let error = running.await.unwrap().unwrap_err();
    // The handler saw the connection die; in-process retries on the same (dead) connection
    // fail to begin; nothing could be recorded.
    assert!(
        matches!(&error, Error::Database(e) if e.operation == "begin"),
        "{error:?}"
    );
    // Nothing of the attempt survived: no claim, no effect.
    let rows: i64 = sqlx::query_scalar("SELECT COUNT(*) FROM inbox_messages")
        .fetch_one(&pool)
        .await
        .unwrap();
    let effects: i64 = sqlx::query_scalar("SELECT COUNT(*) FROM effects")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!((rows, effects), (0, 0));
    // The redelivery on a fresh connection applies it, exactly once.
    let mut conn = pool.acquire().await.unwrap();
    assert_eq!(
        slow(
            &mut conn,
            Slow {
                id: "k".into(),
                variant: 1
            }
        )
        .await
        .unwrap(),
        Outcome::Processed(())
    );
    assert_eq!(
        slow(
            &mut conn,
            Slow {
                id: "k".into(),
                variant: 1
            }
        )
        .await
        .unwrap(),
        Outcome::Duplicate
    );
    let applied: i64 =
        sqlx::query_scalar("SELECT applied FROM effects WHERE effect_key = 'slow:k'")
            .fetch_one(&pool)
            .await
            .unwrap();
    assert_eq!(applied, 1);
}

/// A handler that swallows a database error and returns `Ok`.
#[inbox_runtime::idempotent(consumer = "careless")]
pub async fn careless(conn: &mut PgConnection, msg: Slow) -> Result<(), sqlx::Error> {
    sqlx::query(APPLY_EFFECT)
        .bind(format!("careless:{}", msg.id))
        .bind(1_i64)
        .execute(&mut *conn)
        .await?;
    // Division by zero: the transaction is now aborted; the error is dropped.
    let _ = sqlx::query("SELECT 1 / 0").execute(&mut *conn).await;
    Ok(())
}

#[tokio::test]
async fn a_handler_that_swallows_a_database_error_is_not_reported_processed() {
    let pool = inbox_tests::pg_pool(2).await;
    let mut conn = pool.acquire().await.unwrap();
    let msg = || Slow {
        id: "c".into(),
        variant: 0,
    };
    let error = careless(&mut conn, msg()).await.unwrap_err();
    assert!(
        matches!(&error, Error::Database(e) if e.operation == "verify"),
        "{error:?}"
    );
    // Nothing of the attempt committed (no effect); the attempt is recorded as failed, so a
    // handler that always does this ends dead instead of being redelivered forever.
    let effects: i64 = sqlx::query_scalar("SELECT COUNT(*) FROM effects")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(effects, 0);
    let row = inbox_runtime::ops::admin::show(&pool, "careless", "c")
        .await
        .unwrap()
        .unwrap();
    assert_eq!((row.status.as_str(), row.attempts), ("failed", 1));
    assert!(row.last_error.unwrap().contains("transaction was aborted"));
    assert_eq!(inbox_tests::make_due(&pool).await, 1);
    assert_eq!(
        careless(&mut conn, msg()).await.unwrap_err().kind(),
        "database"
    );
    let row = inbox_runtime::ops::admin::show(&pool, "careless", "c")
        .await
        .unwrap()
        .unwrap();
    assert_eq!((row.status.as_str(), row.attempts), ("failed", 2));
}

/// `dispatch_on` keeps one connection across envelopes; when the server kills it between two
/// envelopes, the next one runs on a new connection and is applied exactly once.
#[tokio::test]
async fn a_held_connection_is_reused_and_replaced_when_killed() {
    let pool = inbox_tests::pg_pool(4).await;
    let dispatcher = Dispatcher::from_registry(pool.clone()).unwrap();
    let mut slot = inbox_runtime::ConnectionSlot::new();
    assert!(!slot.is_held());
    let payment = |account: &str| {
        let msg = Payment {
            event_id: uuid::Uuid::new_v4(),
            account: account.into(),
            amount_cents: 100,
        };
        Envelope::new(Payment::NAME, serde_json::to_vec(&msg).unwrap())
    };

    let opened = pool.size();
    for _ in 0..3 {
        let outcomes = dispatcher
            .dispatch_on(&mut slot, &payment("held"))
            .await
            .unwrap();
        assert!(matches!(outcomes[0].result, Ok(Outcome::Processed(()))));
        assert!(slot.is_held());
        // The slot keeps one connection out of the pool, the same one each time.
        assert_eq!(
            (pool.size(), pool.num_idle()),
            (opened, opened as usize - 1)
        );
    }

    let killed: Vec<bool> = sqlx::query_scalar(
        "SELECT pg_terminate_backend(pid) FROM pg_stat_activity \
         WHERE datname = current_database() AND pid <> pg_backend_pid() \
         AND backend_type = 'client backend'",
    )
    .fetch_all(&pool)
    .await
    .unwrap();
    // The held connection, and any other idle one of the pool.
    assert_eq!(killed, vec![true; opened as usize - 1]);
    let outcomes = dispatcher
        .dispatch_on(&mut slot, &payment("held"))
        .await
        .unwrap();
    assert!(
        matches!(outcomes[0].result, Ok(Outcome::Processed(()))),
        "{:?}",
        outcomes[0].result
    );
    assert!(slot.is_held());
    let effects: (i64, i64) =
        sqlx::query_as("SELECT applied, total FROM effects WHERE effect_key = 'held'")
            .fetch_one(&pool)
            .await
            .unwrap();
    assert_eq!(effects, (4, 400));
    slot.release();
    assert!(!slot.is_held());
}

/// A claim session whose transaction the caller's own writes left aborted: `complete` does not
/// report it completed (PostgreSQL's COMMIT would roll back silently); the attempt is recorded
/// as failed, and nothing of it is committed.
#[tokio::test]
async fn a_session_completed_on_an_aborted_transaction_is_a_verify_error() {
    use inbox_runtime::{
        ClaimSession, ClaimState, Fingerprint, IdempotencyKey, types::StoreOperation,
    };
    let pool = inbox_tests::pg_pool(2).await;
    let mut conn = pool.acquire().await.unwrap();
    let key = IdempotencyKey::new("k-aborted", "POST /x", "Idempotency-Key").unwrap();
    let fingerprint = Fingerprint::of("POST /x", &serde_json::json!({"a": 1})).unwrap();
    let session = ClaimSession::new("tenant", &key, "POST /x", fingerprint);
    let ClaimState::Claimed(mut claim) = session.open(&mut *conn).await.unwrap() else {
        panic!("a free key is claimed");
    };
    sqlx::query(inbox_tests::APPLY_EFFECT)
        .bind("aborted")
        .bind(1_i64)
        .execute(claim.connection())
        .await
        .unwrap();
    // An error the caller swallows: the transaction is now aborted.
    assert!(
        sqlx::query("SELECT 1 / 0")
            .execute(claim.connection())
            .await
            .is_err()
    );
    let error = claim.complete(Some(b"never")).await.unwrap_err();
    assert_eq!(error.operation, StoreOperation::Complete);
    assert_eq!(inbox_tests::effect(&pool, "aborted").await, None);
    // Nothing stored with the key: it is free again (storing the result failed first).
    assert_eq!(
        inbox_runtime::ops::admin::show(&pool, "tenant", "k-aborted")
            .await
            .unwrap(),
        None
    );

    // Without a result to store, the check before COMMIT catches it and records the attempt.
    let ClaimState::Claimed(mut claim) = session.open(&mut *conn).await.unwrap() else {
        panic!("the key is still free");
    };
    assert!(
        sqlx::query("SELECT 1 / 0")
            .execute(claim.connection())
            .await
            .is_err()
    );
    let error = claim.complete(None).await.unwrap_err();
    assert_eq!(error.operation, StoreOperation::Verify);
    let row = inbox_runtime::ops::admin::show(&pool, "tenant", "k-aborted")
        .await
        .unwrap()
        .unwrap();
    assert_eq!((row.status.as_str(), row.attempts), ("failed", 1));
    assert!(row.last_error.unwrap().contains("transaction was aborted"));
}

/// Migration 0006 (the narrow row) on an inbox written at the previous schema: fingerprints
/// stored as 64 hex digits become their 32 bytes (a damaged one keeps its text), the indexes
/// are replaced, and every row reads back and behaves as before: a duplicate of a processed
/// key, a conflict for another payload, the takeover of a due failed key, a dead key left dead
/// (and a conflict for another payload of it).
#[tokio::test]
async fn migration_0006_converts_rows_written_at_the_previous_schema() {
    use std::borrow::Cow;
    use std::str::FromStr as _;

    use sqlx::migrate::{Migration, MigrationType, Migrator};
    use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
    use sqlx::{Connection as _, SqlSafeStr as _};

    let base = PgConnectOptions::from_str(&inbox_tests::database_url()).unwrap();
    let name = format!("inbox_test_m6_{}", std::process::id());
    let mut admin = PgConnection::connect_with(&base).await.unwrap();
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
        "DROP DATABASE IF EXISTS {name}"
    )))
    .execute(&mut admin)
    .await
    .unwrap();
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!("CREATE DATABASE {name}")))
        .execute(&mut admin)
        .await
        .unwrap();
    let pool = PgPoolOptions::new()
        .max_connections(2)
        .connect_with(base.database(&name))
        .await
        .unwrap();
    // The inbox at schema 5, recorded as the runtime records it.
    let previous: [(i64, &str, &str); 5] = [
        (
            1,
            "inbox",
            include_str!("../inbox-runtime/src/store/postgres/migrations/inbox/0001_inbox.sql"),
        ),
        (
            2,
            "rejections",
            include_str!(
                "../inbox-runtime/src/store/postgres/migrations/inbox/0002_rejections.sql"
            ),
        ),
        (
            3,
            "results",
            include_str!("../inbox-runtime/src/store/postgres/migrations/inbox/0003_results.sql"),
        ),
        (
            4,
            "rejection sizes",
            include_str!(
                "../inbox-runtime/src/store/postgres/migrations/inbox/0004_rejection_sizes.sql"
            ),
        ),
        (
            5,
            "console indexes",
            include_str!(
                "../inbox-runtime/src/store/postgres/migrations/inbox/0005_console_indexes.sql"
            ),
        ),
    ];
    let mut migrator = Migrator::with_migrations(
        previous
            .iter()
            .map(|&(version, description, sql)| {
                Migration::new(
                    version,
                    Cow::Borrowed(description),
                    MigrationType::Simple,
                    sqlx::AssertSqlSafe(sql).into_sql_str(),
                    false,
                )
            })
            .collect(),
    );
    migrator.dangerous_set_table_name(inbox_runtime::store::MIGRATIONS_TABLE);
    migrator.run(&pool).await.unwrap();
    sqlx::raw_sql(inbox_tests::EFFECTS_TABLE)
        .execute(&pool)
        .await
        .unwrap();

    // Rows as the runtime wrote them at schema 5: fingerprints as hex text.
    let payment = |n: u128, amount_cents: i64| Payment {
        event_id: uuid::Uuid::from_u128(n),
        account: "acct".into(),
        amount_cents,
    };
    let hash = |p: &Payment| {
        inbox_runtime::Fingerprint::of(Payment::NAME, p)
            .unwrap()
            .to_hex()
    };
    let rows = [
        (payment(1, 10), "processed", None),
        (
            payment(2, 20),
            "failed",
            Some("now() - interval '1 second'"),
        ),
        (payment(3, 30), "dead", None),
    ];
    for (p, status, next_attempt_at) in &rows {
        sqlx::query(sqlx::AssertSqlSafe(format!(
            "INSERT INTO inbox_messages (consumer, message_key, message_name, payload_hash, \
             status, attempts, processed_at, next_attempt_at, payload) \
             VALUES ('ledger', $1, $2, $3, $4, 1, {}, {}, {})",
            if *status == "processed" {
                "now()"
            } else {
                "NULL"
            },
            next_attempt_at.unwrap_or("NULL"),
            if *status == "processed" {
                "NULL"
            } else {
                "'{}'::bytea"
            },
        )))
        .bind(p.event_id.to_string())
        .bind(Payment::NAME)
        .bind(hash(p))
        .bind(status)
        .execute(&pool)
        .await
        .unwrap();
    }
    sqlx::query(
        "INSERT INTO inbox_messages (consumer, message_key, message_name, payload_hash) \
         VALUES ('ledger', 'damaged', 'test.payment', 'damaged')",
    )
    .execute(&pool)
    .await
    .unwrap();

    inbox_runtime::migrate(&pool).await.unwrap();

    let stored: Vec<(String, String, i32, String)> = sqlx::query_as(
        "SELECT message_key, status, octet_length(payload_hash), \
         CASE WHEN octet_length(payload_hash) = 32 THEN encode(payload_hash, 'hex') \
         ELSE convert_from(payload_hash, 'UTF8') END \
         FROM inbox_messages ORDER BY message_key",
    )
    .fetch_all(&pool)
    .await
    .unwrap();
    let mut expected: Vec<(String, String, i32, String)> = rows
        .iter()
        .map(|(p, status, _)| (p.event_id.to_string(), (*status).to_owned(), 32, hash(p)))
        .collect();
    expected.push(("damaged".into(), "processed".into(), 7, "damaged".into()));
    expected.sort();
    assert_eq!(stored, expected);
    let indexes: Vec<String> = sqlx::query_scalar(
        "SELECT indexname FROM pg_indexes WHERE tablename = 'inbox_messages' ORDER BY indexname",
    )
    .fetch_all(&pool)
    .await
    .unwrap();
    assert_eq!(
        indexes,
        [
            "inbox_messages_aggregate",
            "inbox_messages_console",
            "inbox_messages_pkey",
            "inbox_messages_retry"
        ]
    );

    // The admin's read gives the fingerprint back as hex, the status unchanged.
    let fetched = inbox_runtime::ops::admin::show(&pool, "ledger", &rows[0].0.event_id.to_string())
        .await
        .unwrap()
        .unwrap();
    assert_eq!(
        (fetched.status, fetched.payload_hash),
        (Status::Processed, hash(&rows[0].0))
    );

    let mut conn = pool.acquire().await.unwrap();
    let deliver = |n: u128, amount: i64| payment(n, amount);
    assert_eq!(
        credit(&mut conn, deliver(1, 10)).await.unwrap(),
        Outcome::Duplicate
    );
    assert_eq!(
        credit(&mut conn, deliver(1, 11)).await.unwrap_err().kind(),
        "conflict"
    );
    assert_eq!(
        credit(&mut conn, deliver(2, 20)).await.unwrap(),
        Outcome::Processed(())
    );
    assert_eq!(
        credit(&mut conn, deliver(3, 30)).await.unwrap(),
        Outcome::Dead
    );
    assert_eq!(
        credit(&mut conn, deliver(3, 31)).await.unwrap_err().kind(),
        "conflict"
    );
    assert_eq!(
        credit(&mut conn, deliver(4, 40)).await.unwrap(),
        Outcome::Processed(())
    );
    drop(conn);
    let after: Vec<(String, String, i32)> = sqlx::query_as(
        "SELECT message_key, status, attempts FROM inbox_messages \
         WHERE message_key <> 'damaged' ORDER BY message_key",
    )
    .fetch_all(&pool)
    .await
    .unwrap();
    assert_eq!(
        after,
        [
            (
                uuid::Uuid::from_u128(1).to_string(),
                "processed".to_owned(),
                1
            ),
            (
                uuid::Uuid::from_u128(2).to_string(),
                "processed".to_owned(),
                2
            ),
            (uuid::Uuid::from_u128(3).to_string(), "dead".to_owned(), 1),
            (
                uuid::Uuid::from_u128(4).to_string(),
                "processed".to_owned(),
                1
            ),
        ]
    );
    let applied: Vec<(String, i64, i64)> =
        sqlx::query_as("SELECT effect_key, applied, total FROM effects ORDER BY effect_key")
            .fetch_all(&pool)
            .await
            .unwrap();
    assert_eq!(applied, [("acct".to_owned(), 2, 60)]);
    pool.close().await;
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!("DROP DATABASE {name}")))
        .execute(&mut admin)
        .await
        .unwrap();
}
