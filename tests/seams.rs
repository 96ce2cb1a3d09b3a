//! The protocol's seams on both backends: before- and after-commit hooks on the single and
//! batch paths; parked successors released only through a dispatcher's own handlers; every
//! status counted by `admin::stats` and listed by `admin::list`.

#![allow(missing_docs)]

use inbox_runtime::{Classify, Envelope, ErrorClass, Message};
use serde::{Deserialize, Serialize};

/// A note: its handler fails when asked to, retryably or permanently.
#[derive(Debug, Clone, Serialize, Deserialize, Message)]
#[message(name = "seam.note")]
pub struct Note {
    #[message(key)]
    pub id: String,
    /// `""`, `"retry"` or `"permanent"`.
    pub fail: String,
}

/// A step of an order, ordered by its sequence.
#[derive(Debug, Clone, Serialize, Deserialize, Message)]
#[message(name = "seam.step")]
pub struct Step {
    #[message(key)]
    pub id: String,
    #[message(aggregate)]
    pub order: String,
    #[message(sequence)]
    pub seq: i64,
}

/// Another message of the same aggregates and consumer.
#[derive(Debug, Clone, Serialize, Deserialize, Message)]
#[message(name = "seam.shipped")]
pub struct Shipped {
    #[message(key)]
    pub id: String,
    #[message(aggregate)]
    pub order: String,
    #[message(sequence)]
    pub seq: i64,
}

#[derive(Debug, thiserror::Error)]
pub enum NoteError {
    #[error("asked to fail")]
    Retry,
    #[error("asked to fail for good")]
    Permanent,
    #[error(transparent)]
    Db(#[from] sqlx::Error),
}

impl Classify for NoteError {
    fn class(&self) -> ErrorClass {
        match self {
            NoteError::Retry => ErrorClass::Retryable,
            NoteError::Permanent => ErrorClass::Permanent,
            NoteError::Db(error) => error.class(),
        }
    }
}

pub fn note(id: &str, fail: &str) -> Envelope {
    let msg = Note {
        id: id.into(),
        fail: fail.into(),
    };
    Envelope::new(Note::NAME, serde_json::to_vec(&msg).unwrap())
}

pub fn step(order: &str, seq: i64, id: &str) -> Envelope {
    let msg = Step {
        id: id.into(),
        order: order.into(),
        seq,
    };
    Envelope::new(Step::NAME, serde_json::to_vec(&msg).unwrap())
}

inbox_tests::backend_matrix! {
    use std::sync::atomic::{AtomicUsize, Ordering::SeqCst};

    use inbox_runtime::{
        BoxError, BoxFuture, ClaimInfo, Dispatcher, Disposition, Error, Outcome, Status,
        TransactionHook, handler, store::StatsStatus, ops::admin,
    };

    #[inbox_runtime::idempotent(consumer = "notes")]
    async fn write_note(conn: &mut Conn, msg: Note) -> Result<(), NoteError> {
        sqlx::query(APPLY_EFFECT)
            .bind(format!("note:{}", msg.id))
            .bind(1_i64)
            .execute(&mut *conn)
            .await?;
        match msg.fail.as_str() {
            "retry" => Err(NoteError::Retry),
            "permanent" => Err(NoteError::Permanent),
            _ => Ok(()),
        }
    }

    #[inbox_runtime::idempotent(consumer = "steps", gaps = "park")]
    async fn apply_step(conn: &mut Conn, msg: Step) -> Result<(), sqlx::Error> {
        sqlx::query(APPLY_EFFECT)
            .bind(format!("step:{}:{}", msg.order, msg.seq))
            .bind(1_i64)
            .execute(conn)
            .await?;
        Ok(())
    }

    #[inbox_runtime::idempotent(consumer = "steps", gaps = "park")]
    async fn ship(conn: &mut Conn, msg: Shipped) -> Result<(), sqlx::Error> {
        sqlx::query(APPLY_EFFECT)
            .bind(format!("shipped:{}:{}", msg.order, msg.seq))
            .bind(1_i64)
            .execute(conn)
            .await?;
        Ok(())
    }

    /// Writes an audit effect in the claim's transaction (failing for keys that start
    /// with `hook-fails`), and counts after-commit calls.
    struct Audit {
        committed: &'static AtomicUsize,
    }

    impl TransactionHook<Db> for Audit {
        fn before_commit<'c>(
            &'c self,
            conn: &'c mut Conn,
            claim: &'c ClaimInfo<'c>,
        ) -> BoxFuture<'c, Result<(), BoxError>> {
            Box::pin(async move {
                if claim.key.starts_with("hook-fails") {
                    return Err(format!("audit refused {}", claim.key).into());
                }
                assert!(claim.payload.is_some(), "the dispatcher passes the payload");
                sqlx::query(APPLY_EFFECT)
                    .bind(format!("audit:{}:{}", claim.consumer, claim.key))
                    .bind(1_i64)
                    .execute(conn)
                    .await?;
                Ok(())
            })
        }

        fn after_commit(&self, _claim: &ClaimInfo<'_>) {
            self.committed.fetch_add(1, SeqCst);
        }
    }

    async fn effect(pool: &Pool, key: &str) -> Option<i64> {
        inbox_tests::effect(pool, key).await.map(|(applied, _)| applied)
    }

    fn kind(result: &Result<Outcome<()>, Error<BoxError>>) -> &'static str {
        match result {
            Ok(outcome) => outcome.kind(),
            Err(error) => error.kind(),
        }
    }

    #[tokio::test]
    async fn hooks_commit_with_the_effect_on_the_single_path() {
        static COMMITTED: AtomicUsize = AtomicUsize::new(0);
        let (pool, _guard) = fixture().await;
        let dispatcher = Dispatcher::from_handlers(pool.clone(), [handler!(write_note)])
            .unwrap()
            .with_hook(Audit { committed: &COMMITTED });

        let first = dispatcher.dispatch(&note("n1", "")).await.unwrap();
        assert_eq!(kind(&first[0].result), "processed");
        assert_eq!(effect(&pool, "note:n1").await, Some(1));
        assert_eq!(effect(&pool, "audit:notes:n1").await, Some(1));
        assert_eq!(COMMITTED.load(SeqCst), 1);

        // A duplicate processes nothing: no hook.
        let again = dispatcher.dispatch(&note("n1", "")).await.unwrap();
        assert_eq!(kind(&again[0].result), "duplicate");
        assert_eq!(effect(&pool, "audit:notes:n1").await, Some(1));
        assert_eq!(COMMITTED.load(SeqCst), 1);

        // A failing handler: no hook either.
        let failed = dispatcher.dispatch(&note("n2", "retry")).await.unwrap();
        assert_eq!(kind(&failed[0].result), "handler");
        assert_eq!(effect(&pool, "audit:notes:n2").await, None);
        assert_eq!(COMMITTED.load(SeqCst), 1);

        // A failing hook rolls back the handler's write and records the attempt.
        let hooked = dispatcher.dispatch(&note("hook-fails-1", "")).await.unwrap();
        match &hooked[0].result {
            Err(Error::Hook(error)) => {
                assert_eq!(error.consumer, "notes");
                assert_eq!(error.key.as_str(), "hook-fails-1");
                assert!(matches!(error.disposition, Disposition::Retry { .. }));
                assert_eq!(error.source.to_string(), "audit refused hook-fails-1");
            }
            other => panic!("expected a hook error, got {other:?}"),
        }
        assert_eq!(effect(&pool, "note:hook-fails-1").await, None);
        let row = admin::show(&pool, "notes", "hook-fails-1").await.unwrap().unwrap();
        assert_eq!((row.status, row.attempts), (Status::Failed, 1));
        assert_eq!(
            row.last_error.as_deref(),
            Some("retryable error: before-commit hook failed: audit refused hook-fails-1")
        );
        assert_eq!(COMMITTED.load(SeqCst), 1);
    }

    #[tokio::test]
    async fn hooks_commit_with_the_effect_on_the_batch_path() {
        static COMMITTED: AtomicUsize = AtomicUsize::new(0);
        let (pool, _guard) = fixture().await;
        let dispatcher = Dispatcher::from_handlers(pool.clone(), [handler!(write_note)])
            .unwrap()
            .with_hook(Audit { committed: &COMMITTED });

        let batch = [note("b1", ""), note("hook-fails-2", ""), note("b2", ""), note("b3", "retry")];
        let results = dispatcher.dispatch_batch(&batch).await;
        let kinds: Vec<&str> = results
            .iter()
            .map(|r| kind(&r.as_ref().unwrap()[0].result))
            .collect();
        assert_eq!(kinds, ["processed", "hook", "processed", "handler"]);
        assert_eq!(effect(&pool, "note:b1").await, Some(1));
        assert_eq!(effect(&pool, "note:b2").await, Some(1));
        assert_eq!(effect(&pool, "note:b3").await, None);
        assert_eq!(effect(&pool, "note:hook-fails-2").await, None);
        assert_eq!(effect(&pool, "audit:notes:b1").await, Some(1));
        assert_eq!(effect(&pool, "audit:notes:b2").await, Some(1));
        assert_eq!(effect(&pool, "audit:notes:b3").await, None);
        // After commit, once per processed message.
        assert_eq!(COMMITTED.load(SeqCst), 2);
        let row = admin::show(&pool, "notes", "hook-fails-2").await.unwrap().unwrap();
        assert_eq!((row.status, row.attempts), (Status::Failed, 1));
    }

    #[tokio::test]
    async fn parked_successors_run_only_through_the_dispatchers_own_handlers() {
        // `ship` parked a successor; a dispatcher that does not list `ship` leaves it
        // parked when the gap fills, although `ship` is registered in the program.
        let (pool, _guard) = fixture().await;
        let mut conn = pool.acquire().await.unwrap();
        let shipped = Shipped { id: "o1/2".into(), order: "o1".into(), seq: 2 };
        assert_eq!(ship(&mut conn, shipped.clone()).await.unwrap(), Outcome::Parked);
        drop(conn);
        let steps_only = Dispatcher::from_handlers(pool.clone(), [handler!(apply_step)]).unwrap();
        let placed = steps_only.dispatch(&step("o1", 1, "o1/1")).await.unwrap();
        assert_eq!(kind(&placed[0].result), "processed");
        assert_eq!(effect(&pool, "step:o1:1").await, Some(1));
        assert_eq!(effect(&pool, "shipped:o1:2").await, None);
        let row = admin::show(&pool, "steps", "o1/2").await.unwrap().unwrap();
        assert_eq!(row.status, Status::Parked);

        // The same story with both handlers listed: the successor runs.
        let mut conn = pool.acquire().await.unwrap();
        let shipped = Shipped { id: "o2/2".into(), order: "o2".into(), seq: 2 };
        assert_eq!(ship(&mut conn, shipped).await.unwrap(), Outcome::Parked);
        drop(conn);
        let both = Dispatcher::from_handlers(pool.clone(), [handler!(apply_step), handler!(ship)])
            .unwrap();
        let placed = both.dispatch(&step("o2", 1, "o2/1")).await.unwrap();
        assert_eq!(kind(&placed[0].result), "processed");
        assert_eq!(effect(&pool, "shipped:o2:2").await, Some(1));
        let row = admin::show(&pool, "steps", "o2/2").await.unwrap().unwrap();
        assert_eq!(row.status, Status::Processed);
    }

    #[tokio::test]
    async fn stats_count_and_list_returns_every_status() {
        let (pool, _guard) = fixture().await;
        let dispatcher = Dispatcher::from_handlers(
            pool.clone(),
            [handler!(write_note), handler!(apply_step)],
        )
        .unwrap();
        let kinds = |results: Vec<inbox_runtime::ConsumerOutcome>| -> Vec<&'static str> {
            results.iter().map(|o| kind(&o.result)).collect()
        };
        let run = |e: Envelope| {
            let dispatcher = &dispatcher;
            async move { kinds(dispatcher.dispatch(&e).await.unwrap()) }
        };
        assert_eq!(run(note("processed", "")).await, ["processed"]);
        assert_eq!(run(note("failed", "retry")).await, ["handler"]);
        assert_eq!(run(note("dead", "permanent")).await, ["handler"]);
        assert_eq!(run(note("discarded", "retry")).await, ["handler"]);
        assert!(admin::discard(&pool, "notes", "discarded").await.unwrap());
        assert_eq!(run(step("o1", 1, "o1/1")).await, ["processed"]);
        assert_eq!(run(step("o1", 1, "o1/1-again")).await, ["stale"]);
        assert_eq!(run(step("o2", 2, "o2/2")).await, ["parked"]);

        let stats = admin::stats(&pool).await.unwrap();
        let count = |consumer: &str, status: Status| {
            stats
                .iter()
                .find(|s| {
                    s.consumer.as_deref() == Some(consumer)
                        && s.status == StatsStatus::Message(status)
                })
                .map_or(0, |s| s.count)
        };
        assert_eq!(count("notes", Status::Processed), 1);
        assert_eq!(count("notes", Status::Failed), 1);
        assert_eq!(count("notes", Status::Dead), 1);
        assert_eq!(count("notes", Status::Discarded), 1);
        assert_eq!(count("steps", Status::Processed), 1);
        assert_eq!(count("steps", Status::Stale), 1);
        assert_eq!(count("steps", Status::Parked), 1);

        let rows = admin::list(&pool, None, &Status::ALL, 100).await.unwrap();
        let mut listed: Vec<(String, Status)> =
            rows.into_iter().map(|r| (r.message_key, r.status)).collect();
        listed.sort();
        assert_eq!(
            listed,
            [
                ("dead".to_owned(), Status::Dead),
                ("discarded".to_owned(), Status::Discarded),
                ("failed".to_owned(), Status::Failed),
                ("o1/1".to_owned(), Status::Processed),
                ("o1/1-again".to_owned(), Status::Stale),
                ("o2/2".to_owned(), Status::Parked),
                ("processed".to_owned(), Status::Processed),
            ]
        );
        // Any subset, of one consumer.
        let stale = admin::list(&pool, Some("steps"), &[Status::Stale, Status::Parked], 100)
            .await
            .unwrap();
        assert_eq!(stale.len(), 2);
        assert!(admin::list(&pool, None, &[], 100).await.unwrap().is_empty());
    }
}
