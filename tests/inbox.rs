//! The claim-then-act core on both backends: outcomes, effects, conflicts, bad input.
//!
//! Every test runs twice, once per backend, through `inbox_tests::backend_matrix!`: handlers for
//! `&mut PgConnection` and for `&mut SqliteConnection` are registered side by side, and each
//! dispatcher only routes to its own backend's.

#![allow(missing_docs)]

use inbox_runtime::{Message, Outcome};
use inbox_tests::{count, effect, outcome_kinds};
use serde::{Deserialize, Serialize};

/// The main test message: one effect per key.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, Message)]
#[message(name = "test.note")]
pub struct Note {
    #[message(key)]
    pub id: String,
    pub amount: i64,
    pub memo: String,
}

/// The same shape as `Note` under another name: same key and fields must still conflict.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, Message)]
#[message(name = "test.note-copy")]
pub struct NoteCopy {
    #[message(key)]
    pub id: String,
    pub amount: i64,
    pub memo: String,
}

/// A message whose key may be null.
#[derive(Debug, Clone, Serialize, Deserialize, Message)]
#[message(name = "test.maybe")]
pub struct Maybe {
    #[message(key)]
    pub id: Option<String>,
    pub amount: i64,
}

/// A business (composite) key from a template.
#[derive(Debug, Clone, Serialize, Deserialize, Message)]
#[message(name = "test.line", key = "order:{order_id}:line:{line}")]
pub struct OrderLine {
    pub order_id: String,
    pub line: u32,
    pub amount: i64,
}

/// A handler error type of the test's own, to check it comes back intact.
#[derive(Debug, thiserror::Error)]
pub enum TestError {
    #[error("rejected by the handler: {0}")]
    Rejected(String),
    #[error(transparent)]
    Db(#[from] sqlx::Error),
}

fn note(id: &str, amount: i64) -> Note {
    Note {
        id: id.to_owned(),
        amount,
        memo: "m".to_owned(),
    }
}

inbox_tests::backend_matrix! {
    connections(postgres = 16, sqlite = 8);

    use inbox_runtime::{DispatchError, Dispatcher, Envelope, Error, KeyError};
    use sqlx::Connection as _;

    /// Applies `amount` to the effect row of the note's key.
    #[inbox_runtime::idempotent(consumer = "effects")]
    async fn apply_note(conn: &mut Conn, msg: Note) -> Result<i64, TestError> {
        if msg.memo == "reject" {
            return Err(TestError::Rejected(msg.id));
        }
        sqlx::query(APPLY_EFFECT)
            .bind(format!("note:{}", msg.id))
            .bind(msg.amount)
            .execute(&mut *conn)
            .await?;
        Ok(msg.amount)
    }

    /// A second consumer of the same message, with its own inbox scope.
    #[inbox_runtime::idempotent(consumer = "audit")]
    async fn audit_note(conn: &mut Conn, msg: Note) -> Result<(), sqlx::Error> {
        sqlx::query(APPLY_EFFECT)
            .bind(format!("audit:{}", msg.id))
            .bind(1_i64)
            .execute(conn)
            .await?;
        Ok(())
    }

    /// Keyed by the attribute's `key`, overriding the derive's.
    #[inbox_runtime::idempotent(consumer = "by-memo", key = "memo")]
    async fn by_memo(conn: &mut Conn, msg: Note) -> Result<(), sqlx::Error> {
        sqlx::query(APPLY_EFFECT)
            .bind(format!("memo:{}", msg.memo))
            .bind(msg.amount)
            .execute(conn)
            .await?;
        Ok(())
    }

    #[inbox_runtime::idempotent(consumer = "effects")]
    async fn apply_note_copy(conn: &mut Conn, msg: NoteCopy) -> Result<(), sqlx::Error> {
        sqlx::query(APPLY_EFFECT)
            .bind(format!("note:{}", msg.id))
            .bind(msg.amount)
            .execute(conn)
            .await?;
        Ok(())
    }

    #[tokio::test]
    async fn another_message_name_under_the_same_key_is_a_conflict() {
        let (pool, _guard) = fixture().await;
        let mut conn = pool.acquire().await.unwrap();
        assert!(apply_note(&mut conn, note("n", 4)).await.unwrap().is_processed());
        let copy = NoteCopy { id: "n".into(), amount: 4, memo: "m".into() };
        assert_eq!(apply_note_copy(&mut conn, copy).await.unwrap_err().kind(), "conflict");
        assert_eq!(effect(&pool, "note:n").await, Some((1, 4)));
    }

    #[inbox_runtime::idempotent(consumer = "effects")]
    async fn apply_maybe(conn: &mut Conn, msg: Maybe) -> Result<(), sqlx::Error> {
        sqlx::query(APPLY_EFFECT)
            .bind(format!("maybe:{}", msg.id.unwrap_or_default()))
            .bind(msg.amount)
            .execute(conn)
            .await?;
        Ok(())
    }

    #[inbox_runtime::idempotent(consumer = "effects")]
    async fn apply_line(conn: &mut Conn, msg: OrderLine) -> Result<(), sqlx::Error> {
        sqlx::query(APPLY_EFFECT)
            .bind(format!("line:{}:{}", msg.order_id, msg.line))
            .bind(msg.amount)
            .execute(conn)
            .await?;
        Ok(())
    }

    #[tokio::test]
    async fn processed_once_then_duplicate() {
        let (pool, _guard) = fixture().await;
        let mut conn = pool.acquire().await.unwrap();
        let first = apply_note(&mut conn, note("a", 5)).await.unwrap();
        assert_eq!(first, Outcome::Processed(5));
        for _ in 0..3 {
            let again = apply_note(&mut conn, note("a", 5)).await.unwrap();
            assert_eq!(again, Outcome::Duplicate);
        }
        assert_eq!(effect(&pool, "note:a").await, Some((1, 5)));
        assert_eq!(count(&pool, "SELECT COUNT(*) FROM inbox_messages").await, 1);
        let (status, attempts, name): (String, i64, String) = sqlx::query_as(
            sql("SELECT status, CAST(attempts AS BIGINT), message_name FROM inbox_messages \
             WHERE consumer = 'effects' AND message_key = 'a'"),
        )
        .fetch_one(&pool)
        .await
        .unwrap();
        assert_eq!((status.as_str(), attempts, name.as_str()), ("processed", 1, "test.note"));
    }

    #[tokio::test]
    async fn handler_error_rolls_back_claim_and_effect_and_keeps_its_type() {
        let (pool, _guard) = fixture().await;
        let mut conn = pool.acquire().await.unwrap();
        let mut rejected = note("r", 7);
        rejected.memo = "reject".into();
        let error = apply_note(&mut conn, rejected.clone()).await.unwrap_err();
        assert!(matches!(error.into_handler_error(), Some(TestError::Rejected(id)) if id == "r"));
        // Claim and effect were rolled back; the attempt was recorded on its own.
        assert_eq!(effect(&pool, "note:r").await, None);
        let status = "SELECT COUNT(*) FROM inbox_messages WHERE status = 'failed' AND payload IS NOT NULL";
        assert_eq!(count(&pool, status).await, 1);
        // The failed key does not block its own retry: once due, the handler runs again.
        assert_eq!(inbox_tests::make_due(&pool).await, 1);
        let error = apply_note(&mut conn, rejected).await.unwrap_err();
        assert_eq!(error.as_handler_failure().map(|f| f.attempts), Some(2));
        // Another payload under that key is a conflict, not a retry.
        assert_eq!(apply_note(&mut conn, note("r", 7)).await.unwrap_err().kind(), "conflict");
        assert_eq!(effect(&pool, "note:r").await, None);
    }

    #[tokio::test]
    async fn conflict_after_processing_is_reported_with_both_fingerprints() {
        let (pool, _guard) = fixture().await;
        let mut conn = pool.acquire().await.unwrap();
        assert!(apply_note(&mut conn, note("c", 10)).await.unwrap().is_processed());
        let error = apply_note(&mut conn, note("c", 11)).await.unwrap_err();
        let Error::Conflict(conflict) = error else { panic!("expected a conflict, got {error:?}") };
        assert_eq!(conflict.consumer, "effects");
        assert_eq!(conflict.message_name, "test.note");
        assert_eq!(conflict.key.as_str(), "c");
        assert_eq!(conflict.stored, inbox_runtime::Fingerprint::of("test.note", &note("c", 10)).unwrap());
        assert_eq!(conflict.received, inbox_runtime::Fingerprint::of("test.note", &note("c", 11)).unwrap());
        assert_ne!(conflict.stored, conflict.received);
        assert_eq!(effect(&pool, "note:c").await, Some((1, 10)));
        // The original payload is still a plain duplicate afterwards.
        assert_eq!(apply_note(&mut conn, note("c", 10)).await.unwrap(), Outcome::Duplicate);
    }

    #[tokio::test]
    async fn conflict_through_the_dispatcher_and_reformatted_payloads_are_duplicates() {
        let (pool, _guard) = fixture().await;
        let dispatcher = Dispatcher::from_registry(pool.clone()).unwrap();
        let outcomes = |result: Result<Vec<inbox_runtime::ConsumerOutcome>, DispatchError>| {
            result
                .unwrap()
                .into_iter()
                .map(|o| (o.consumer, o.result.map_err(|e| e.kind())))
                .collect::<Vec<_>>()
        };
        let original = br#"{"id":"d","amount":3,"memo":"x"}"#;
        let reordered = b"{ \"memo\" : \"x\",\n  \"amount\": 3,\t\"id\": \"d\" }";
        let conflicting = br#"{"memo":"x","amount":4,"id":"d"}"#;
        let first = outcomes(dispatcher.dispatch(&Envelope::new("test.note", original.to_vec())).await);
        assert_eq!(
            first,
            vec![
                ("audit", Ok(Outcome::Processed(()))),
                ("by-memo", Ok(Outcome::Processed(()))),
                ("effects", Ok(Outcome::Processed(()))),
            ]
        );
        for payload in [&original[..], &reordered[..]] {
            let again = outcomes(dispatcher.dispatch(&Envelope::new("test.note", payload.to_vec())).await);
            assert_eq!(
                again,
                vec![
                    ("audit", Ok(Outcome::Duplicate)),
                    ("by-memo", Ok(Outcome::Duplicate)),
                    ("effects", Ok(Outcome::Duplicate)),
                ]
            );
        }
        let conflict = outcomes(dispatcher.dispatch(&Envelope::new("test.note", conflicting.to_vec())).await);
        assert_eq!(
            conflict,
            vec![("audit", Err("conflict")), ("by-memo", Err("conflict")), ("effects", Err("conflict"))]
        );
        assert_eq!(effect(&pool, "note:d").await, Some((1, 3)));
        assert_eq!(effect(&pool, "audit:d").await, Some((1, 1)));
        assert_eq!(effect(&pool, "memo:x").await, Some((1, 3)));
        assert_eq!(count(&pool, "SELECT COUNT(*) FROM inbox_messages").await, 3);
        // The attribute's `key = "memo"` overrides the derive's key for `by-memo` only.
        assert_eq!(
            count(&pool, "SELECT COUNT(*) FROM inbox_messages WHERE consumer = 'by-memo' AND message_key = 'x'").await,
            1
        );
    }

    #[tokio::test]
    async fn deliveries_marked_as_redelivered_take_the_fast_path_with_the_same_outcomes() {
        let (pool, _guard) = fixture().await;
        let dispatcher = Dispatcher::from_registry(pool.clone()).unwrap();
        let redelivered = |payload: &[u8]| {
            Envelope::new("test.note", payload.to_vec())
                .with_source(inbox_runtime::SourceMetadata::new("queue").redelivered(true))
        };
        // Marked as redelivered but never seen: processed as usual.
        let first = dispatcher.dispatch(&redelivered(br#"{"id":"f","amount":2,"memo":"q"}"#)).await.unwrap();
        assert_eq!(outcome_kinds(&first), [Ok("processed"); 3]);
        let again = dispatcher.dispatch(&redelivered(br#"{"memo":"q","id":"f","amount":2}"#)).await.unwrap();
        assert_eq!(outcome_kinds(&again), [Ok("duplicate"); 3]);
        let changed = dispatcher.dispatch(&redelivered(br#"{"id":"f","amount":3,"memo":"q"}"#)).await.unwrap();
        assert_eq!(outcome_kinds(&changed), [Err("conflict"); 3]);
        assert_eq!(effect(&pool, "note:f").await, Some((1, 2)));
        let source: Option<String> = sqlx::query_scalar(sql("SELECT source FROM inbox_messages WHERE consumer = 'effects' AND message_key = 'f'"))
            .fetch_one(&pool)
            .await
            .unwrap();
        assert_eq!(source.as_deref(), Some("queue"));
    }

    #[tokio::test]
    async fn conflict_inside_a_callers_transaction_and_savepoint_semantics() {
        let (pool, _guard) = fixture().await;
        let mut conn = pool.acquire().await.unwrap();
        {
            let mut outer = conn.begin().await.unwrap();
            assert!(apply_note(&mut outer, note("s", 1)).await.unwrap().is_processed());
            assert_eq!(apply_note(&mut outer, note("s", 1)).await.unwrap(), Outcome::Duplicate);
            assert_eq!(apply_note(&mut outer, note("s", 2)).await.unwrap_err().kind(), "conflict");
            // The caller rolls back: claim and effect go with it.
            outer.rollback().await.unwrap();
        }
        assert_eq!(effect(&pool, "note:s").await, None);
        assert_eq!(count(&pool, "SELECT COUNT(*) FROM inbox_messages").await, 0);
        {
            let mut outer = conn.begin().await.unwrap();
            assert!(apply_note(&mut outer, note("s", 2)).await.unwrap().is_processed());
            outer.commit().await.unwrap();
        }
        assert_eq!(effect(&pool, "note:s").await, Some((1, 2)));
    }

    #[tokio::test]
    async fn composite_template_keys() {
        let (pool, _guard) = fixture().await;
        let mut conn = pool.acquire().await.unwrap();
        let line = |order: &str, line: u32| OrderLine { order_id: order.into(), line, amount: 2 };
        assert!(apply_line(&mut conn, line("o1", 1)).await.unwrap().is_processed());
        assert!(apply_line(&mut conn, line("o1", 2)).await.unwrap().is_processed());
        assert!(apply_line(&mut conn, line("o1", 1)).await.unwrap().is_duplicate());
        let keys: Vec<String> = sqlx::query_scalar(
            sql("SELECT message_key FROM inbox_messages WHERE message_name = 'test.line' ORDER BY message_key"),
        )
        .fetch_all(&pool)
        .await
        .unwrap();
        assert_eq!(keys, ["order:o1:line:1", "order:o1:line:2"]);
        let error = apply_line(&mut conn, line("", 3)).await.unwrap_err();
        assert!(matches!(error, Error::Key(KeyError::Empty { message: "test.line", field: "order_id" })), "{error:?}");
    }

    #[tokio::test]
    async fn keys_compare_byte_exactly() {
        let (pool, _guard) = fixture().await;
        let mut conn = pool.acquire().await.unwrap();
        for id in ["k", "K", "k ", "\u{e9}", "e\u{301}"] {
            assert!(apply_note(&mut conn, note(id, 1)).await.unwrap().is_processed(), "{id:?}");
        }
        assert_eq!(count(&pool, "SELECT COUNT(*) FROM inbox_messages").await, 5);
    }

    #[tokio::test]
    async fn bad_input_is_a_distinct_error_and_writes_nothing() {
        let (pool, _guard) = fixture().await;
        let dispatcher = Dispatcher::from_registry(pool.clone()).unwrap();
        let dispatch = |name: &str, payload: &[u8]| {
            let envelope = Envelope::new(name, payload.to_vec());
            let dispatcher = &dispatcher;
            async move { dispatcher.dispatch(&envelope).await }
        };

        let unknown = dispatch("test.nope", br#"{"id":"a"}"#).await.unwrap_err();
        assert!(matches!(&unknown, DispatchError::UnknownMessage { message_name } if message_name == "test.nope"));

        // No name at all (a source could not read one, or not an envelope): refused, and
        // kept as malformed with its bytes when the caller records it.
        let nameless = Envelope::new("", b"not even json".to_vec());
        let error = dispatcher.dispatch(&nameless).await.unwrap_err();
        assert!(matches!(error, DispatchError::NoMessageName), "{error:?}");
        dispatcher.record_rejection(&nameless, &error).await.unwrap();
        let kept: (String, String, Vec<u8>) = sqlx::query_as(
            sql("SELECT reason, detail, payload FROM inbox_rejections"),
        )
        .fetch_one(&pool)
        .await
        .unwrap();
        assert_eq!(
            kept,
            (
                "malformed".to_owned(),
                "the delivery carries no message name (not a message envelope?)".to_owned(),
                b"not even json".to_vec()
            )
        );
        sqlx::query(sql("DELETE FROM inbox_rejections")).execute(&pool).await.unwrap();

        let malformed = dispatch("test.note", b"{\"id\":\"a\",\n\"amount\": oops}").await.unwrap_err();
        let DispatchError::Decode { message_name, line, column, .. } = &malformed else { panic!("{malformed:?}") };
        assert_eq!((message_name.as_str(), *line, *column), ("test.note", 2, 11));

        let missing = dispatch("test.note", br#"{"amount":1,"memo":"m"}"#).await.unwrap_err();
        assert!(matches!(&missing, DispatchError::Decode { .. }), "{missing:?}");
        assert!(missing.to_string().contains("missing field `id`"), "{missing}");

        let wrong_type = dispatch("test.note", br#"{"id":"a","amount":"1","memo":"m"}"#).await.unwrap_err();
        assert!(matches!(&wrong_type, DispatchError::Decode { line: 1, .. }), "{wrong_type:?}");

        let null = dispatch("test.maybe", br#"{"id":null,"amount":1}"#).await.unwrap_err();
        assert!(
            matches!(&null, DispatchError::Key { consumer: "effects", source: KeyError::Null { message: "test.maybe", field: "id" } }),
            "{null:?}"
        );
        let absent = dispatch("test.maybe", br#"{"amount":1}"#).await.unwrap_err();
        assert!(matches!(&absent, DispatchError::Key { source: KeyError::Null { .. }, .. }), "{absent:?}");

        let empty = dispatch("test.note", br#"{"id":"","amount":1,"memo":"m"}"#).await.unwrap_err();
        // Every consumer's key is read before any runs: `by-memo` has a key, `effects` not.
        assert!(
            matches!(&empty, DispatchError::Key { source: KeyError::Empty { message: "test.note", field: "id" }, .. }),
            "{empty:?}"
        );

        let long = format!(r#"{{"id":"{}","amount":1,"memo":"m"}}"#, "x".repeat(513));
        let too_long = dispatch("test.note", long.as_bytes()).await.unwrap_err();
        assert!(
            matches!(&too_long, DispatchError::Key { source: KeyError::TooLong { len: 513, max: 512, .. }, .. }),
            "{too_long:?}"
        );

        let nul = dispatch("test.note", br#"{"id":"a\u0000b","amount":1,"memo":"m"}"#).await.unwrap_err();
        assert!(matches!(&nul, DispatchError::Key { source: KeyError::Invalid { .. }, .. }), "{nul:?}");

        // Direct calls reject bad keys the same way, before touching the database.
        let mut conn = pool.acquire().await.unwrap();
        let error = apply_maybe(&mut conn, Maybe { id: None, amount: 1 }).await.unwrap_err();
        assert!(matches!(error, Error::Key(KeyError::Null { .. })), "{error:?}");

        assert_eq!(count(&pool, "SELECT COUNT(*) FROM inbox_messages").await, 0);
        assert_eq!(count(&pool, "SELECT COUNT(*) FROM effects").await, 0);
        // Exactly 512 bytes is accepted.
        let max = format!(r#"{{"id":"{}","amount":1,"memo":"m"}}"#, "y".repeat(512));
        let ok = dispatch("test.note", max.as_bytes()).await.unwrap();
        assert!(ok.iter().all(|o| matches!(o.result, Ok(Outcome::Processed(())))));
    }

    #[tokio::test]
    async fn registry_lists_this_backends_handlers() {
        let (pool, _guard) = fixture().await;
        let dispatcher = Dispatcher::from_registry(pool).unwrap();
        let listed: Vec<(&str, &str)> = dispatcher
            .handlers()
            .iter()
            .map(|h| (h.message_name, h.consumer))
            .collect();
        assert_eq!(
            listed,
            vec![
                ("test.line", "effects"),
                ("test.maybe", "effects"),
                ("test.note", "audit"),
                ("test.note", "by-memo"),
                ("test.note", "effects"),
                ("test.note-copy", "effects"),
            ]
        );
        assert!(dispatcher.handlers().iter().all(|h| h.function.contains(&format!("::{BACKEND}::"))));
    }

    #[tokio::test]
    async fn concurrent_redeliveries_apply_once() {
        let (pool, _guard) = fixture().await;
        let dispatcher = std::sync::Arc::new(Dispatcher::from_registry(pool.clone()).unwrap());
        let deliveries = shuffled_deliveries(200, 3);
        let queue = std::sync::Arc::new(std::sync::Mutex::new(deliveries));
        let mut tasks = Vec::new();
        for _ in 0..8 {
            let queue = queue.clone();
            let dispatcher = dispatcher.clone();
            tasks.push(tokio::spawn(async move {
                let (mut processed, mut duplicates) = (0, 0);
                loop {
                    let Some(envelope) = queue.lock().unwrap().pop() else { break };
                    for outcome in dispatcher.dispatch(&envelope).await.unwrap() {
                        match outcome.result.unwrap() {
                            Outcome::Processed(()) => processed += 1,
                            Outcome::Duplicate => duplicates += 1,
                            other => panic!("unexpected {other:?}"),
                        }
                    }
                }
                (processed, duplicates)
            }));
        }
        let (mut processed, mut duplicates) = (0, 0);
        for task in tasks {
            let (p, d) = task.await.unwrap();
            processed += p;
            duplicates += d;
        }
        assert_eq!((processed, duplicates), (200, 400));
        assert_eq!(count(&pool, "SELECT COUNT(*) FROM effects").await, 200);
        assert_eq!(count(&pool, "SELECT CAST(SUM(applied) AS BIGINT) FROM effects").await, 200);
        assert_eq!(count(&pool, "SELECT CAST(SUM(total) AS BIGINT) FROM effects").await, (0..200).sum::<i64>());
    }
}

/// `count` distinct single-consumer messages (`test.line`), each delivered `times` times, in a
/// seeded random order.
pub fn shuffled_deliveries(count: u32, times: usize) -> Vec<inbox_runtime::Envelope> {
    use rand::SeedableRng;
    use rand::seq::SliceRandom;
    let mut deliveries = Vec::new();
    for line in 0..count {
        let payload = serde_json::to_vec(&OrderLine {
            order_id: "o".into(),
            line,
            amount: i64::from(line),
        })
        .unwrap();
        for _ in 0..times {
            deliveries.push(inbox_runtime::Envelope::new(
                OrderLine::NAME,
                payload.clone(),
            ));
        }
    }
    deliveries.shuffle(&mut rand_chacha::ChaCha8Rng::seed_from_u64(7));
    deliveries
}
