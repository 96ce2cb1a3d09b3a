//! Batch claims on both backends: the same outcomes and effects as one message per
//! transaction, with duplicates inside a batch, a failing message in the middle, conflicts.

#![allow(missing_docs)]

use inbox_runtime::{Classify, ErrorClass, Message};
use inbox_tests::envelope;
use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, Serialize, Deserialize, Message)]
#[message(name = "test.transfer")]
pub struct Transfer {
    #[message(key)]
    pub id: String,
    pub account: String,
    pub amount: i64,
}

#[derive(Debug, thiserror::Error)]
pub enum TransferError {
    #[error("account {0} is frozen")]
    Frozen(String),
    #[error(transparent)]
    Db(#[from] sqlx::Error),
}

impl Classify for TransferError {
    fn class(&self) -> ErrorClass {
        match self {
            TransferError::Frozen(_) => ErrorClass::Permanent,
            TransferError::Db(error) => error.class(),
        }
    }
}

/// A message whose handler counts its calls.
#[derive(Debug, Clone, Serialize, Deserialize, Message)]
#[message(name = "test.counted")]
pub struct Counted {
    #[message(key)]
    pub id: String,
    pub account: String,
    pub amount: i64,
}

pub fn transfer(id: &str, account: &str, amount: i64) -> inbox_runtime::Envelope {
    envelope(&Transfer {
        id: id.into(),
        account: account.into(),
        amount,
    })
}

inbox_tests::backend_matrix! {
    connections(postgres = 4, sqlite = 2);

    use inbox_runtime::{Dispatcher, Envelope, Outcome};

    #[inbox_runtime::idempotent(consumer = "bank")]
    async fn apply_transfer(conn: &mut Conn, msg: Transfer) -> Result<(), TransferError> {
        sqlx::query(APPLY_EFFECT)
            .bind(&msg.account)
            .bind(msg.amount)
            .execute(&mut *conn)
            .await?;
        // The write above is undone with the savepoint when the account is frozen.
        if msg.account == "frozen" {
            return Err(TransferError::Frozen(msg.account));
        }
        Ok(())
    }

    /// Calls of `count_calls`, to see how often the batch ran each handler.
    static CALLS: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

    #[inbox_runtime::idempotent(consumer = "counter")]
    async fn count_calls(conn: &mut Conn, msg: Counted) -> Result<(), TransferError> {
        CALLS.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        sqlx::query(APPLY_EFFECT)
            .bind(format!("counted:{}", msg.account))
            .bind(msg.amount)
            .execute(&mut *conn)
            .await?;
        if msg.account == "frozen" {
            return Err(TransferError::Frozen(msg.account));
        }
        Ok(())
    }

    fn counted(id: &str, account: &str) -> Envelope {
        envelope(&Counted { id: id.into(), account: account.into(), amount: 1 })
    }

    /// On PostgreSQL a batch runs optimistically (each handler once, no savepoints); when
    /// one handler fails, that run is rolled back and the batch runs again with
    /// savepoints: the handlers before the failure are called twice (their effects still
    /// apply once), the failing one once.
    #[tokio::test]
    async fn a_batch_runs_each_handler_once_unless_one_fails() {
        use std::sync::atomic::Ordering::SeqCst;
        let (pool, _guard) = fixture().await;
        let dispatcher = Dispatcher::from_registry(pool.clone()).unwrap();
        let ok: Vec<Envelope> = (0..5).map(|i| counted(&format!("ok{i}"), "a")).collect();
        let results = kinds(dispatcher.dispatch_batch(&ok).await);
        assert_eq!(results, vec![Ok(vec!["processed"]); 5]);
        assert_eq!(CALLS.load(SeqCst), 5);

        let mixed = [
            counted("m0", "b"),
            counted("m1", "b"),
            counted("m2", "frozen"),
            counted("m3", "b"),
            counted("m4", "b"),
        ];
        let results = kinds(dispatcher.dispatch_batch(&mixed).await);
        assert_eq!(
            results,
            vec![
                Ok(vec!["processed"]),
                Ok(vec!["processed"]),
                Ok(vec!["dead-lettered"]),
                Ok(vec!["processed"]),
                Ok(vec!["processed"]),
            ]
        );
        // PostgreSQL: 3 calls in the optimistic run (up to the failure), then 4 in the
        // isolated one (the failure is recorded, not called again). SQLite always
        // isolates (a handler there can end the transaction): 5 calls.
        let expected = if BACKEND == Backend::Postgres { 5 + 3 + 4 } else { 5 + 5 };
        assert_eq!(CALLS.load(SeqCst), expected);
        let effects: Vec<(String, i64, i64)> = sqlx::query_as(
            sql("SELECT effect_key, applied, total FROM effects WHERE effect_key LIKE 'counted:%' ORDER BY effect_key"),
        )
        .fetch_all(&pool)
        .await
        .unwrap();
        assert_eq!(effects, [("counted:a".to_owned(), 5, 5), ("counted:b".to_owned(), 4, 4)]);
    }

    /// A stored fingerprint that is not a SHA-256 digest (a damaged row) is a clear
    /// database error on both paths, and it holds back nothing else of the batch.
    #[tokio::test]
    async fn a_damaged_stored_fingerprint_is_an_error_on_both_paths() {
        let (pool, _guard) = fixture().await;
        let dispatcher = Dispatcher::from_registry(pool.clone()).unwrap();
        dispatcher.dispatch(&transfer("d1", "a", 1)).await.unwrap();
        sqlx::query(sql("UPDATE inbox_messages SET payload_hash = 'damaged' WHERE message_key = 'd1'"))
            .execute(&pool)
            .await
            .unwrap();
        let single = dispatcher.dispatch(&transfer("d1", "a", 1)).await.unwrap();
        let Err(inbox_runtime::Error::Database(error)) = &single[0].result else {
            panic!("{:?}", single[0].result)
        };
        assert_eq!(error.operation, "claim");
        assert!(error.to_string().contains("\"damaged\" is not a SHA-256 hex digest"), "{error}");
        let batch = kinds(dispatcher.dispatch_batch(&[transfer("d1", "a", 1), transfer("d2", "a", 2)]).await);
        assert_eq!(batch, vec![Ok(vec!["database"]), Ok(vec!["processed"])]);
        assert_eq!(
            balances(&pool).await.into_iter().filter(|(k, ..)| k == "a").collect::<Vec<_>>(),
            [("a".to_owned(), 2, 3)]
        );
    }

    type Kinds = Vec<Result<Vec<&'static str>, String>>;

    fn kinds(results: Vec<Result<Vec<inbox_runtime::ConsumerOutcome>, inbox_runtime::DispatchError>>) -> Kinds {
        results
            .into_iter()
            .map(|r| match r {
                Ok(outcomes) => Ok(outcomes
                    .into_iter()
                    .map(|o| match o.result {
                        Ok(outcome) => outcome.kind(),
                        Err(inbox_runtime::Error::Handler(f)) if f.disposition == inbox_runtime::Disposition::Dead => "dead-lettered",
                        Err(error) => error.kind(),
                    })
                    .collect()),
                Err(error) => Err(error.to_string().split(':').next().unwrap().to_owned()),
            })
            .collect()
    }

    async fn balances(pool: &Pool) -> Vec<(String, i64, i64)> {
        sqlx::query_as(sql("SELECT effect_key, applied, total FROM effects ORDER BY effect_key"))
            .fetch_all(pool)
            .await
            .unwrap()
    }

    #[tokio::test]
    async fn a_batch_with_duplicates_a_failure_and_a_conflict() {
        let (pool, _guard) = fixture().await;
        let dispatcher = Dispatcher::from_registry(pool.clone()).unwrap();
        // Processed before the batch: t0 (its redelivery is a duplicate, a changed one a
        // conflict).
        dispatcher.dispatch(&transfer("t0", "a", 1)).await.unwrap();
        let reordered = Envelope::new(Transfer::NAME, br#"{ "amount": 5, "account": "b", "id": "t2" }"#.to_vec());
        let batch = [
            transfer("t1", "a", 10),
            transfer("t2", "b", 5),
            transfer("t3", "frozen", 7),
            reordered,
            transfer("t1", "a", 10),
            transfer("t0", "a", 1),
            transfer("t0", "a", 2),
            Envelope::new(Transfer::NAME, b"{oops".to_vec()),
            transfer("t4", "b", 3),
        ];
        let results = kinds(dispatcher.dispatch_batch(&batch).await);
        assert_eq!(
            results,
            vec![
                Ok(vec!["processed"]),
                Ok(vec!["processed"]),
                Ok(vec!["dead-lettered"]),
                Ok(vec!["duplicate"]),
                Ok(vec!["duplicate"]),
                Ok(vec!["duplicate"]),
                Ok(vec!["conflict"]),
                Err("malformed payload for message `test.transfer` at line 1, column 2".to_owned()),
                Ok(vec!["processed"]),
            ]
        );
        assert_eq!(
            balances(&pool).await,
            [("a".to_owned(), 2, 11), ("b".to_owned(), 2, 8)]
        );
        // One claim statement took them all (the database clock is read once per
        // statement): they were not processed one transaction each.
        let claims: i64 = sqlx::query_scalar(
            sql("SELECT COUNT(DISTINCT received_at) FROM inbox_messages WHERE message_key IN ('t1', 't2', 't3', 't4')"),
        )
        .fetch_one(&pool)
        .await
        .unwrap();
        assert_eq!(claims, 1);
        let dead = inbox_runtime::ops::admin::show(&pool, "bank", "t3").await.unwrap().unwrap();
        assert_eq!((dead.status.as_str(), dead.attempts), ("dead", 1));
        assert!(dead.payload.is_some());
        let conflicts: i64 = sqlx::query_scalar(sql("SELECT COUNT(*) FROM inbox_rejections WHERE reason = 'conflict'"))
            .fetch_one(&pool)
            .await
            .unwrap();
        assert_eq!(conflicts, 1);
        // The whole batch again: all settled.
        let again = kinds(dispatcher.dispatch_batch(&batch).await);
        assert_eq!(again[0], Ok(vec!["duplicate"]));
        assert_eq!(again[2], Ok(vec!["dead"]));
        assert_eq!(again[6], Ok(vec!["conflict"]));
        assert_eq!(balances(&pool).await, [("a".to_owned(), 2, 11), ("b".to_owned(), 2, 8)]);
    }

    #[tokio::test]
    async fn batches_and_single_messages_agree_on_a_random_stream() {
        use rand::seq::SliceRandom;
        use rand::{Rng, SeedableRng};
        let (pool, _guard) = fixture().await;
        let dispatcher = Dispatcher::from_registry(pool.clone()).unwrap();
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(11);
        let mut stream = Vec::new();
        for i in 0..300 {
            let account = ["x", "y", "z", "frozen"][rng.random_range(0..4)];
            stream.push((format!("s{i}"), account, rng.random_range(1..100_i64)));
        }
        for _ in 0..150 {
            let pick = stream[rng.random_range(0..300)].clone();
            stream.push(pick);
        }
        stream.shuffle(&mut rng);
        // Expected from the model: each id once; frozen ones never applied.
        let mut seen = std::collections::HashSet::new();
        let mut expected = std::collections::BTreeMap::<String, (i64, i64)>::new();
        for (id, account, amount) in &stream {
            if seen.insert(id.clone()) && *account != "frozen" {
                let e = expected.entry(account.to_string()).or_default();
                e.0 += 1;
                e.1 += amount;
            }
        }
        let envelopes: Vec<Envelope> = stream.iter().map(|(id, account, amount)| transfer(id, account, *amount)).collect();
        let mut batched = Vec::new();
        for chunk in envelopes.chunks(37) {
            batched.extend(kinds(dispatcher.dispatch_batch(chunk).await));
        }
        let expected: Vec<(String, i64, i64)> = expected.into_iter().map(|(k, (n, t))| (k, n, t)).collect();
        assert_eq!(balances(&pool).await, expected);
        let processed = batched.iter().filter(|k| **k == Ok(vec!["processed"])).count();
        let dead = batched.iter().filter(|k| **k == Ok(vec!["dead-lettered"])).count();
        assert_eq!(processed + dead, 300);
        assert_eq!(batched.len() - processed - dead, 150);
        // Every redelivery is a duplicate or (of a dead one) dead.
        assert!(batched.iter().all(|k| [Ok(vec!["processed"]), Ok(vec!["dead-lettered"]), Ok(vec!["duplicate"]), Ok(vec!["dead"])].contains(k)));
        let _ = Outcome::<()>::Duplicate;
    }
}
