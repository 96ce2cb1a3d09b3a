//! Adversarial tests: attempts to break the effectively-once promise (double effects, lost
//! messages, wrong outcomes, missed conflicts, batch/single disagreements).
//!
//! Every test says at its top whether it found a bug (`FOUND BUG, FIXED`: the runtime was fixed,
//! the test asserts the correct behaviour) or documents a guarantee that held (`HOLDS`). Most run
//! on both backends through `inbox_tests::backend_matrix!`.

#![allow(missing_docs)]

use std::collections::{BTreeMap, HashSet};
use std::sync::Mutex;

use inbox_runtime::{Classify, ErrorClass, Fingerprint, Message};
use inbox_tests::{count, effect, envelope, inbox_row, outcome_kind, outcome_kinds};
use serde::{Deserialize, Serialize};

/// A message with one number (the effect's amount).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, Message)]
#[message(name = "adv.note")]
pub struct AdvNote {
    #[message(key)]
    pub id: String,
    pub amount: i64,
}

/// A composite key from two free-text fields joined by `:`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, Message)]
#[message(name = "adv.pair", key = "{left}:{right}")]
pub struct AdvPair {
    pub left: String,
    pub right: String,
    pub amount: i64,
}

/// A float-valued message, for number canonicalization.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, Message)]
#[message(name = "adv.measure")]
pub struct AdvMeasure {
    #[message(key)]
    pub id: String,
    pub value: f64,
}

/// A message with an integer-keyed map (JSON object with numeric-string member names).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, Message)]
#[message(name = "adv.map")]
pub struct AdvMap {
    #[message(key)]
    pub id: String,
    pub lines: BTreeMap<u32, i64>,
}

/// Handled by a handler that can be told to fail (see `FAIL_SWITCH`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, Message)]
#[message(name = "adv.flaky")]
pub struct AdvFlaky {
    #[message(key)]
    pub id: String,
    pub amount: i64,
}

/// Handled by a handler that fails transiently once per key (see `TRANSIENT_ONCE`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, Message)]
#[message(name = "adv.blip")]
pub struct AdvBlip {
    #[message(key)]
    pub id: String,
    pub amount: i64,
}

/// Handled by a handler that writes, then swallows a failing statement and returns `Ok`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, Message)]
#[message(name = "adv.swallow")]
pub struct AdvSwallow {
    #[message(key)]
    pub id: String,
    pub amount: i64,
}

/// Handled by a handler that opens (and commits) its own nested transaction.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, Message)]
#[message(name = "adv.nested")]
pub struct AdvNested {
    #[message(key)]
    pub id: String,
    pub amount: i64,
    pub fail: bool,
}

#[derive(Debug, thiserror::Error)]
pub enum AdvError {
    #[error("switched to fail")]
    Switched,
    #[error("a passing fault")]
    Blip,
    #[error("asked to fail")]
    Asked,
    #[error(transparent)]
    Db(#[from] sqlx::Error),
}

impl Classify for AdvError {
    fn class(&self) -> ErrorClass {
        match self {
            AdvError::Blip => ErrorClass::Transient,
            AdvError::Switched | AdvError::Asked => ErrorClass::Retryable,
            AdvError::Db(error) => error.class(),
        }
    }
}

/// `2^53 + 1` and `2^53`: distinct `i64` values that one `f64` cannot tell apart.
const BIG_ODD: i64 = 9_007_199_254_740_993;
const BIG_EVEN: i64 = 9_007_199_254_740_992;

/// FOUND BUG, FIXED (no database): the fingerprint of two different `i64` values above 2^53 is the
/// same, because serde_jcs formats every integer through `f64` (`write_i64` → `value as f64`).
#[test]
fn fingerprint_tells_big_integers_apart() {
    let odd = AdvNote {
        id: "k".into(),
        amount: BIG_ODD,
    };
    let even = AdvNote {
        id: "k".into(),
        amount: BIG_EVEN,
    };
    assert_ne!(
        Fingerprint::of(AdvNote::NAME, &odd).unwrap(),
        Fingerprint::of(AdvNote::NAME, &even).unwrap()
    );
    // i64::MAX and i64::MAX - 1 as well.
    let max = AdvNote {
        id: "k".into(),
        amount: i64::MAX,
    };
    let below = AdvNote {
        id: "k".into(),
        amount: i64::MAX - 1,
    };
    assert_ne!(
        Fingerprint::of(AdvNote::NAME, &max).unwrap(),
        Fingerprint::of(AdvNote::NAME, &below).unwrap()
    );
}

/// HOLDS (no database): numbers that are the same value in different JSON spellings (1, 1.0,
/// 1e0, 10E-1; -0.0 and 0) and string escapes (`\u00e9` vs `é`) fingerprint the same; field order
/// does not matter; an integer-keyed map fingerprints (its member names are strings).
#[test]
fn fingerprint_canonicalizes_number_spellings_and_escapes() {
    let fp = |json: &str| {
        let m: AdvMeasure = serde_json::from_str(json).unwrap();
        Fingerprint::of(AdvMeasure::NAME, &m).unwrap()
    };
    let one = fp(r#"{"id":"m","value":1}"#);
    assert_eq!(fp(r#"{"id":"m","value":1.0}"#), one);
    assert_eq!(fp(r#"{"value":1e0,"id":"m"}"#), one);
    assert_eq!(fp(r#"{"id":"m","value":10E-1}"#), one);
    assert_ne!(fp(r#"{"id":"m","value":1.5}"#), one);
    assert_eq!(
        fp(r#"{"id":"m","value":-0.0}"#),
        fp(r#"{"id":"m","value":0}"#)
    );
    assert_eq!(fp(r#"{"id":"\u006d","value":1}"#), one);
    let map: AdvMap = serde_json::from_str(r#"{"id":"x","lines":{"2":5,"10":7}}"#).unwrap();
    let reordered: AdvMap = serde_json::from_str(r#"{"lines":{"10":7,"2":5},"id":"x"}"#).unwrap();
    assert_eq!(
        Fingerprint::of(AdvMap::NAME, &map).unwrap(),
        Fingerprint::of(AdvMap::NAME, &reordered).unwrap()
    );
}

/// Takes `key` out of the set; `true` if it was there (this call should fail).
fn take_transient(set: &Mutex<Option<HashSet<String>>>, key: &str) -> bool {
    set.lock()
        .unwrap()
        .get_or_insert_with(HashSet::new)
        .remove(key)
}

fn arm_transient(set: &Mutex<Option<HashSet<String>>>, key: &str) {
    set.lock()
        .unwrap()
        .get_or_insert_with(HashSet::new)
        .insert(key.to_owned());
}

inbox_tests::backend_matrix! {
    connections(postgres = 16, sqlite = 8);

    use std::time::Duration;

    use inbox_runtime::ops::admin::{self, Retention};
    use inbox_runtime::{DispatchError, Dispatcher, Envelope, Outcome};
    use sqlx::Connection as _;

    /// Keys whose next call of the transient-once handler fails transiently.
    static TRANSIENT_ONCE: Mutex<Option<HashSet<String>>> = Mutex::new(None);

    #[inbox_runtime::idempotent(consumer = "adv-note")]
    async fn apply_note(conn: &mut Conn, msg: AdvNote) -> Result<(), sqlx::Error> {
        sqlx::query(APPLY_EFFECT)
            .bind(format!("note:{}", msg.id))
            .bind(msg.amount)
            .execute(conn)
            .await?;
        Ok(())
    }

    #[inbox_runtime::idempotent(consumer = "adv-pair")]
    async fn apply_pair(conn: &mut Conn, msg: AdvPair) -> Result<(), sqlx::Error> {
        sqlx::query(APPLY_EFFECT)
            .bind(format!("pair:{}|{}", msg.left, msg.right))
            .bind(msg.amount)
            .execute(conn)
            .await?;
        Ok(())
    }

    #[inbox_runtime::idempotent(consumer = "adv-measure")]
    async fn apply_measure(conn: &mut Conn, msg: AdvMeasure) -> Result<(), sqlx::Error> {
        sqlx::query(APPLY_EFFECT)
            .bind(format!("measure:{}", msg.id))
            .bind(1_i64)
            .execute(conn)
            .await?;
        Ok(())
    }

    /// Fails (retryably) while the effects table has a `switch:<id>` row.
    #[inbox_runtime::idempotent(consumer = "adv-flaky")]
    async fn apply_flaky(conn: &mut Conn, msg: AdvFlaky) -> Result<(), AdvError> {
        let switched: Option<i64> =
            sqlx::query_scalar(sql("SELECT applied FROM effects WHERE effect_key = $1"))
                .bind(format!("switch:{}", msg.id))
                .fetch_optional(&mut *conn)
                .await?;
        if switched.is_some() {
            return Err(AdvError::Switched);
        }
        sqlx::query(APPLY_EFFECT)
            .bind(format!("flaky:{}", msg.id))
            .bind(msg.amount)
            .execute(&mut *conn)
            .await?;
        Ok(())
    }

    /// Fails transiently once per armed key, then succeeds. At most one attempt.
    #[inbox_runtime::idempotent(consumer = "adv-blip", max_attempts = 1)]
    async fn apply_blip(conn: &mut Conn, msg: AdvBlip) -> Result<(), AdvError> {
        if take_transient(&TRANSIENT_ONCE, &msg.id) {
            return Err(AdvError::Blip);
        }
        sqlx::query(APPLY_EFFECT)
            .bind(format!("blip:{}", msg.id))
            .bind(msg.amount)
            .execute(&mut *conn)
            .await?;
        Ok(())
    }

    /// Writes its effect, then runs a statement that fails and ignores its error.
    #[inbox_runtime::idempotent(consumer = "adv-swallow")]
    async fn apply_swallow(conn: &mut Conn, msg: AdvSwallow) -> Result<(), sqlx::Error> {
        sqlx::query(APPLY_EFFECT)
            .bind(format!("swallow:{}", msg.id))
            .bind(msg.amount)
            .execute(&mut *conn)
            .await?;
        // A unique violation, swallowed.
        let swallowed = sqlx::query(
            sql("INSERT INTO effects (effect_key, applied, total) VALUES ($1, 1, 0)"),
        )
        .bind(format!("swallow:{}", msg.id))
        .execute(&mut *conn)
        .await;
        assert!(swallowed.is_err(), "the second insert must fail");
        Ok(())
    }

    /// Opens its own nested transaction for the write and commits it; may then fail.
    #[inbox_runtime::idempotent(consumer = "adv-nested")]
    async fn apply_nested(conn: &mut Conn, msg: AdvNested) -> Result<(), AdvError> {
        let mut inner = conn.begin().await?;
        sqlx::query(APPLY_EFFECT)
            .bind(format!("nested:{}", msg.id))
            .bind(msg.amount)
            .execute(&mut *inner)
            .await?;
        inner.commit().await?;
        if msg.fail {
            return Err(AdvError::Asked);
        }
        Ok(())
    }

    /// FOUND BUG, FIXED: two deliveries with the same key whose amounts differ only beyond f64
    /// precision (2^53 + 1 vs 2^53) must be a conflict; the second is reported
    /// `Duplicate` and silently dropped.
    #[tokio::test]
    async fn big_integer_payload_change_is_a_conflict() {
        let (pool, _guard) = fixture().await;
        let mut conn = pool.acquire().await.unwrap();
        let first = AdvNote { id: "big".into(), amount: BIG_ODD };
        assert_eq!(apply_note(&mut conn, first).await.unwrap(), Outcome::Processed(()));
        let changed = AdvNote { id: "big".into(), amount: BIG_EVEN };
        let second = apply_note(&mut conn, changed).await;
        assert_eq!(second.map_err(|e| e.kind()), Err("conflict"));
        assert_eq!(
            count(&pool, "SELECT COUNT(*) FROM inbox_rejections WHERE reason = 'conflict'").await,
            1
        );
    }

    /// A conflict that cannot be kept in `inbox_rejections` (the table is gone for a moment) is
    /// reported as a database error, not as a conflict: a source settles a conflict by dropping
    /// the delivery, which would lose it stored nowhere. Its redelivery, once the table is back,
    /// is the conflict, kept.
    #[tokio::test]
    async fn a_conflict_that_cannot_be_kept_is_a_database_error() {
        let (pool, _guard) = fixture().await;
        let mut conn = pool.acquire().await.unwrap();
        let first = AdvNote { id: "unkept".into(), amount: 1 };
        assert_eq!(apply_note(&mut conn, first).await.unwrap(), Outcome::Processed(()));
        let changed = || AdvNote { id: "unkept".into(), amount: 2 };

        sqlx::query("ALTER TABLE inbox_rejections RENAME TO inbox_rejections_away")
            .execute(&pool)
            .await
            .unwrap();
        match apply_note(&mut conn, changed()).await {
            Err(inbox_runtime::Error::Database(error)) => {
                assert_eq!(error.operation, inbox_runtime::types::StoreOperation::Rejection);
                assert_eq!(error.consumer, "adv-note");
            }
            other => panic!("expected a database error, got {other:?}"),
        }
        sqlx::query("ALTER TABLE inbox_rejections_away RENAME TO inbox_rejections")
            .execute(&pool)
            .await
            .unwrap();

        let again = apply_note(&mut conn, changed()).await;
        assert_eq!(again.map_err(|e| e.kind()), Err("conflict"));
        assert_eq!(
            count(&pool, "SELECT COUNT(*) FROM inbox_rejections WHERE reason = 'conflict'").await,
            1
        );
    }

    /// FOUND BUG, FIXED (design): a key template joins free-text fields with a literal
    /// separator and no escaping, so `("a:b", "c")` and `("a", "b:c")` get the same key
    /// `a:b:c`. The second, a different message, is rejected as a conflict and never
    /// applied.
    #[tokio::test]
    async fn template_keys_of_different_messages_do_not_collide() {
        let (pool, _guard) = fixture().await;
        let mut conn = pool.acquire().await.unwrap();
        let one = AdvPair { left: "a:b".into(), right: "c".into(), amount: 1 };
        let two = AdvPair { left: "a".into(), right: "b:c".into(), amount: 2 };
        assert_eq!(apply_pair(&mut conn, one).await.unwrap(), Outcome::Processed(()));
        assert_eq!(apply_pair(&mut conn, two).await.unwrap(), Outcome::Processed(()));
        assert_eq!(effect(&pool, "pair:a:b|c").await, Some((1, 1)));
        assert_eq!(effect(&pool, "pair:a|b:c").await, Some((1, 2)));
    }

    /// HOLDS: keys compare byte-exactly: NFC vs NFD, case, trailing space, LIKE
    /// wildcards, quotes, 512-byte multibyte keys that differ only in the last byte.
    #[tokio::test]
    async fn keys_compare_byte_exactly() {
        let (pool, _guard) = fixture().await;
        let mut conn = pool.acquire().await.unwrap();
        let long_a = format!("{}ab", "€".repeat(170));
        let long_b = format!("{}ac", "€".repeat(170));
        assert_eq!(long_a.len(), 512);
        let keys = [
            "\u{e9}", "e\u{301}", "K", "k", "k ", " k", "%", "_", "'", "\\", "k\u{200b}",
            "\u{1F600}", long_a.as_str(), long_b.as_str(),
        ];
        for (i, key) in keys.iter().enumerate() {
            let msg = AdvNote { id: (*key).to_owned(), amount: i as i64 + 1 };
            assert_eq!(apply_note(&mut conn, msg.clone()).await.unwrap(), Outcome::Processed(()), "{key:?}");
            assert_eq!(apply_note(&mut conn, msg).await.unwrap(), Outcome::Duplicate, "{key:?}");
        }
        for (i, key) in keys.iter().enumerate() {
            assert_eq!(effect(&pool, &format!("note:{key}")).await, Some((1, i as i64 + 1)), "{key:?}");
        }
        assert_eq!(count(&pool, "SELECT COUNT(*) FROM inbox_messages WHERE consumer = 'adv-note'").await, keys.len() as i64);
        // 513 bytes: refused, nothing written.
        let too_long = AdvNote { id: format!("{long_a}x"), amount: 1 };
        assert_eq!(apply_note(&mut conn, too_long).await.unwrap_err().kind(), "key");
        assert_eq!(count(&pool, "SELECT COUNT(*) FROM inbox_messages WHERE consumer = 'adv-note'").await, keys.len() as i64);
    }

    /// HOLDS: a payload with a duplicate JSON member is malformed (not silently
    /// last-wins), and nothing is written.
    #[tokio::test]
    async fn duplicate_json_members_are_malformed() {
        let (pool, _guard) = fixture().await;
        let dispatcher = Dispatcher::from_registry(pool.clone()).unwrap();
        let envelope = Envelope::new(
            AdvNote::NAME,
            br#"{"id":"dup","amount":1,"amount":2}"#.to_vec(),
        );
        let error = dispatcher.dispatch(&envelope).await.unwrap_err();
        assert!(matches!(error, DispatchError::Decode { .. }), "{error:?}");
        let dup_key = Envelope::new(AdvNote::NAME, br#"{"id":"a","id":"b","amount":1}"#.to_vec());
        assert!(matches!(dispatcher.dispatch(&dup_key).await.unwrap_err(), DispatchError::Decode { .. }));
        assert_eq!(count(&pool, "SELECT COUNT(*) FROM inbox_messages").await, 0);
    }

    /// HOLDS: the same float in other spellings (1 / 1.0 / 1e0, -0.0 / 0) is a duplicate
    /// through the dispatcher; another value is a conflict.
    #[tokio::test]
    async fn float_spellings_are_duplicates() {
        let (pool, _guard) = fixture().await;
        let dispatcher = Dispatcher::from_registry(pool.clone()).unwrap();
        let kinds = |outcomes: Vec<inbox_runtime::ConsumerOutcome>| outcome_kinds(&outcomes);
        let send = |json: &'static str| Envelope::new(AdvMeasure::NAME, json.as_bytes().to_vec());
        assert_eq!(kinds(dispatcher.dispatch(&send(r#"{"id":"f","value":1}"#)).await.unwrap()), vec![Ok("processed")]);
        assert_eq!(kinds(dispatcher.dispatch(&send(r#"{"id":"f","value":1.0}"#)).await.unwrap()), vec![Ok("duplicate")]);
        assert_eq!(kinds(dispatcher.dispatch(&send(r#"{"value":1e0, "id":"f"}"#)).await.unwrap()), vec![Ok("duplicate")]);
        assert_eq!(kinds(dispatcher.dispatch(&send(r#"{"id":"f","value":1.0000001}"#)).await.unwrap()), vec![Err("conflict")]);
        assert_eq!(kinds(dispatcher.dispatch(&send(r#"{"id":"z","value":-0.0}"#)).await.unwrap()), vec![Ok("processed")]);
        assert_eq!(kinds(dispatcher.dispatch(&send(r#"{"id":"z","value":0}"#)).await.unwrap()), vec![Ok("duplicate")]);
        assert_eq!(effect(&pool, "measure:f").await, Some((1, 1)));
        assert_eq!(effect(&pool, "measure:z").await, Some((1, 1)));
    }

    /// Makes the key's row (its first delivery and, if settled, its settling) two hours older:
    /// retention refuses windows below an hour, so the tests age rows rather than sleep.
    async fn age_by_two_hours(pool: &Pool, key: &str) {
        let sql = match BACKEND {
            Backend::Postgres => {
                "UPDATE inbox_messages SET received_at = received_at - interval '2 hours', \
                 processed_at = processed_at - interval '2 hours' WHERE message_key = $1"
            }
            Backend::MySql => {
                "UPDATE inbox_messages SET received_at = received_at - INTERVAL 2 HOUR, \
                 processed_at = processed_at - INTERVAL 2 HOUR WHERE message_key = ?"
            }
            _ => {
                "UPDATE inbox_messages \
                 SET received_at = strftime('%Y-%m-%dT%H:%M:%fZ', received_at, '-2 hours'), \
                 processed_at = strftime('%Y-%m-%dT%H:%M:%fZ', processed_at, '-2 hours') \
                 WHERE message_key = $1"
            }
        };
        sqlx::query(sql).bind(key).execute(pool).await.unwrap();
    }

    /// FOUND BUG, FIXED: the purge measures age from `received_at` (first delivery), not from
    /// when the key was settled. A message that kept failing for longer than the window
    /// and is then processed is purged at the next purge, right after its processing;
    /// the redelivery that follows (its ack lost) applies it a second time. The trait
    /// doc of `purge_batch` promises `processed_at`.
    #[tokio::test]
    async fn purge_keeps_a_key_processed_inside_the_window() {
        let (pool, _guard) = fixture().await;
        let dispatcher = Dispatcher::from_registry(pool.clone()).unwrap();
        let msg = AdvFlaky { id: "late".into(), amount: 5 };
        sqlx::query(sql("INSERT INTO effects (effect_key, applied, total) VALUES ('switch:late', 0, 0)"))
            .execute(&pool).await.unwrap();
        let failed = dispatcher.dispatch(&envelope(&msg)).await.unwrap();
        assert_eq!(failed[0].result.as_ref().map_err(|e| e.kind()).err(), Some("handler"));
        assert_eq!(inbox_row(&pool, "adv-flaky", "late").await, Some(("failed".into(), 1)));
        // The failure lasts longer than the window (its first delivery made 2 h older); then
        // the message is processed.
        age_by_two_hours(&pool, "late").await;
        sqlx::query(sql("DELETE FROM effects WHERE effect_key = 'switch:late'"))
            .execute(&pool).await.unwrap();
        inbox_tests::make_due(&pool).await;
        let processed = dispatcher.dispatch(&envelope(&msg)).await.unwrap();
        assert_eq!(processed[0].result.as_ref().map_err(|e| e.kind()).ok(), Some(&Outcome::Processed(())));
        // A purge with a 1 h window right after: the key was settled 0 s ago.
        let retention = Retention::new(Duration::from_secs(3600), Duration::from_secs(3600)).unwrap();
        let report = admin::purge(&pool, &retention, |_| {}).await.unwrap();
        // The redelivery (its ack was lost) must be a duplicate.
        let again = dispatcher.dispatch(&envelope(&msg)).await.unwrap();
        let again = outcome_kind(&again[0].result);
        // Today: (1, Ok("processed"), Some((2, 10))) — purged, then applied twice.
        assert_eq!(
            (report.deleted, again, effect(&pool, "flaky:late").await),
            (0, Ok("duplicate"), Some((1, 5)))
        );
    }

    /// HOLDS: a processed key younger than the window survives the purge, an older one
    /// goes, and the failed and dead rows stay unless asked for.
    #[tokio::test]
    async fn purge_respects_the_window_for_fresh_keys() {
        let (pool, _guard) = fixture().await;
        let dispatcher = Dispatcher::from_registry(pool.clone()).unwrap();
        let old = AdvNote { id: "old".into(), amount: 1 };
        assert!(dispatcher.dispatch(&envelope(&old)).await.unwrap()[0].result.as_ref().unwrap().is_processed());
        age_by_two_hours(&pool, "old").await;
        let fresh = AdvNote { id: "fresh".into(), amount: 1 };
        assert!(dispatcher.dispatch(&envelope(&fresh)).await.unwrap()[0].result.as_ref().unwrap().is_processed());
        let retention = Retention::new(Duration::from_secs(3600), Duration::from_secs(3600)).unwrap();
        assert_eq!(admin::purge(&pool, &retention, |_| {}).await.unwrap().deleted, 1);
        assert_eq!(inbox_row(&pool, "adv-note", "old").await, None);
        assert_eq!(inbox_row(&pool, "adv-note", "fresh").await, Some(("processed".into(), 1)));
        assert_eq!(dispatcher.dispatch(&envelope(&fresh)).await.unwrap()[0].result.as_ref().unwrap(), &Outcome::Duplicate);
    }

    /// FOUND BUG, FIXED: batch vs single disagree on a transient failure of a handler with
    /// `max_attempts = 1`. The single path retries the transient fault in-process and
    /// reports `Processed`; the batch path records the transient failure as a counted
    /// attempt with `fail_claimed` (attempts 1 ≥ max 1 → `dead`) and reports the message
    /// dead, never applied.
    #[tokio::test]
    async fn batch_and_single_agree_on_a_transient_failure() {
        let (pool, _guard) = fixture().await;
        let dispatcher = Dispatcher::from_registry(pool.clone()).unwrap();
        arm_transient(&TRANSIENT_ONCE, "single");
        let single = dispatcher.dispatch(&envelope(&AdvBlip { id: "single".into(), amount: 3 })).await.unwrap();
        assert_eq!(single[0].result.as_ref().map_err(|e| e.kind()).ok(), Some(&Outcome::Processed(())));
        assert_eq!(effect(&pool, "blip:single").await, Some((1, 3)));

        arm_transient(&TRANSIENT_ONCE, "batched");
        let batch = dispatcher
            .dispatch_batch(&[
                envelope(&AdvNote { id: "other".into(), amount: 1 }),
                envelope(&AdvBlip { id: "batched".into(), amount: 3 }),
            ])
            .await;
        let result = &batch[1].as_ref().unwrap()[0].result;
        let disposition = result.as_ref().err().and_then(|e| e.as_handler_failure()).map(|f| f.disposition);
        // Today: (Err("handler"), Some(Dead), None, Some(("dead", 1))).
        assert_eq!(
            (
                outcome_kind(result),
                disposition,
                effect(&pool, "blip:batched").await,
                inbox_row(&pool, "adv-blip", "batched").await,
            ),
            (Ok("processed"), None, Some((1, 3)), Some(("processed".into(), 1)))
        );
    }

    /// HOLDS: a handler that writes its effect and then swallows a failing statement's
    /// error. PostgreSQL: the transaction is aborted, so the message must not be reported
    /// processed, nothing is applied, and a later delivery can still apply it. SQLite: a
    /// failed statement does not abort the transaction, so it is processed with its
    /// effect.
    #[tokio::test]
    async fn a_swallowed_database_error_is_not_processed_on_postgres() {
        let (pool, _guard) = fixture().await;
        let mut conn = pool.acquire().await.unwrap();
        let msg = AdvSwallow { id: "s".into(), amount: 4 };
        let result = apply_swallow(&mut conn, msg.clone()).await;
        if BACKEND == Backend::Postgres {
            assert!(result.is_err(), "reported {result:?} from an aborted transaction");
            assert_eq!(effect(&pool, "swallow:s").await, None);
            assert_eq!(count(&pool, "SELECT COUNT(*) FROM inbox_messages WHERE status = 'processed'").await, 0);
        } else {
            assert_eq!(result.unwrap(), Outcome::Processed(()));
            assert_eq!(effect(&pool, "swallow:s").await, Some((1, 4)));
        }
        // Through a batch as well.
        let dispatcher = Dispatcher::from_registry(pool.clone()).unwrap();
        let batch = dispatcher
            .dispatch_batch(&[envelope(&AdvSwallow { id: "b".into(), amount: 2 })])
            .await;
        let result = &batch[0].as_ref().unwrap()[0].result;
        if BACKEND == Backend::Postgres {
            assert!(result.is_err(), "batch reported {result:?} from an aborted savepoint");
            assert_eq!(effect(&pool, "swallow:b").await, None);
        } else {
            assert_eq!(result.as_ref().ok(), Some(&Outcome::Processed(())));
            assert_eq!(effect(&pool, "swallow:b").await, Some((1, 2)));
        }
    }

    /// FOUND BUG, FIXED (PostgreSQL): for the swallowed-error handler, the single path and the
    /// batch path disagree: the single path reports a `database` error and records
    /// nothing (the message is never counted towards `max_attempts`, so a poison message
    /// is redelivered forever), the batch path reports a `handler` failure recorded as
    /// `failed`. Now both report the `database` error, record one failed attempt and apply
    /// nothing. SQLite: the failed statement does not abort the transaction, so both paths
    /// process the message, with the effect of the statement that succeeded.
    #[tokio::test]
    async fn swallowed_error_outcome_is_the_same_in_batch_and_single() {
        let (pool, _guard) = fixture().await;
        let dispatcher = Dispatcher::from_registry(pool.clone()).unwrap();
        let single = dispatcher.dispatch(&envelope(&AdvSwallow { id: "one".into(), amount: 1 })).await.unwrap();
        let batch = dispatcher.dispatch_batch(&[envelope(&AdvSwallow { id: "two".into(), amount: 1 })]).await;
        let single_kind = single[0].result.as_ref().map_err(|e| e.kind()).err();
        let batch_kind = batch[0].as_ref().unwrap()[0].result.as_ref().map_err(|e| e.kind()).err();
        let single_row = inbox_row(&pool, "adv-swallow", "one").await;
        let batch_row = inbox_row(&pool, "adv-swallow", "two").await;
        // Before the fix (PostgreSQL): single (Some("database"), None), batch (Some("handler"),
        // Some(("failed", 1))).
        assert_eq!((single_kind, single_row.clone()), (batch_kind, batch_row.clone()));
        let effects = (effect(&pool, "swallow:one").await, effect(&pool, "swallow:two").await);
        if BACKEND == Backend::Postgres {
            assert_eq!((single_kind, batch_kind), (Some("database"), Some("database")));
            assert_eq!((single_row, batch_row), (Some(("failed".into(), 1)), Some(("failed".into(), 1))));
            assert_eq!(effects, (None, None));
        } else {
            assert_eq!(single[0].result.as_ref().ok(), Some(&Outcome::Processed(())));
            assert_eq!(batch[0].as_ref().unwrap()[0].result.as_ref().ok(), Some(&Outcome::Processed(())));
            assert_eq!((single_row, batch_row), (Some(("processed".into(), 1)), Some(("processed".into(), 1))));
            assert_eq!(effects, (Some((1, 1)), Some((1, 1))));
        }
    }

    /// HOLDS: a handler that opens and commits its own nested transaction only releases
    /// a savepoint: an error after it still rolls its write back, and a success is
    /// applied once.
    #[tokio::test]
    async fn a_nested_begin_in_the_handler_stays_inside_the_claim() {
        let (pool, _guard) = fixture().await;
        let mut conn = pool.acquire().await.unwrap();
        let failing = AdvNested { id: "n".into(), amount: 7, fail: true };
        let error = apply_nested(&mut conn, failing).await.unwrap_err();
        assert_eq!(error.kind(), "handler");
        assert_eq!(effect(&pool, "nested:n").await, None);
        assert_eq!(inbox_row(&pool, "adv-nested", "n").await, Some(("failed".into(), 1)));
        let ok = AdvNested { id: "m".into(), amount: 7, fail: false };
        assert_eq!(apply_nested(&mut conn, ok.clone()).await.unwrap(), Outcome::Processed(()));
        assert_eq!(apply_nested(&mut conn, ok).await.unwrap(), Outcome::Duplicate);
        assert_eq!(effect(&pool, "nested:m").await, Some((1, 7)));
    }

    /// HOLDS: called on a connection already inside the caller's transaction, the
    /// wrapper claims in a savepoint: a duplicate inside the same transaction is a
    /// duplicate and leaves the caller's writes alone; rolling the caller's transaction
    /// back undoes claim and effect, and the message applies again afterwards.
    #[tokio::test]
    async fn inside_a_callers_transaction() {
        let (pool, _guard) = fixture().await;
        let mut conn = pool.acquire().await.unwrap();
        let mut tx = conn.begin().await.unwrap();
        sqlx::query(APPLY_EFFECT).bind("outer").bind(1_i64).execute(&mut *tx).await.unwrap();
        let msg = AdvNote { id: "t".into(), amount: 2 };
        assert_eq!(apply_note(&mut tx, msg.clone()).await.unwrap(), Outcome::Processed(()));
        assert_eq!(apply_note(&mut tx, msg.clone()).await.unwrap(), Outcome::Duplicate);
        let changed = AdvNote { id: "t".into(), amount: 3 };
        assert_eq!(apply_note(&mut tx, changed).await.unwrap_err().kind(), "conflict");
        let outer: i64 = sqlx::query_scalar(sql("SELECT applied FROM effects WHERE effect_key = 'outer'"))
            .fetch_one(&mut *tx).await.unwrap();
        assert_eq!(outer, 1);
        tx.rollback().await.unwrap();
        assert_eq!(effect(&pool, "note:t").await, None);
        assert_eq!(inbox_row(&pool, "adv-note", "t").await, None);
        assert_eq!(apply_note(&mut conn, msg).await.unwrap(), Outcome::Processed(()));
        assert_eq!(effect(&pool, "note:t").await, Some((1, 2)));
    }

    /// HOLDS: a redelivery marked `redelivered` (fast path) of a key with another
    /// payload is a conflict, recorded; of a failed key it runs again.
    #[tokio::test]
    async fn redelivered_fast_path_detects_conflicts_and_retries_failed() {
        let (pool, _guard) = fixture().await;
        let dispatcher = Dispatcher::from_registry(pool.clone()).unwrap();
        let redelivered = |msg: &AdvFlaky| envelope(msg)
            .with_source(inbox_runtime::SourceMetadata::new("q").redelivered(true));
        sqlx::query(sql("INSERT INTO effects (effect_key, applied, total) VALUES ('switch:r', 0, 0)"))
            .execute(&pool).await.unwrap();
        let msg = AdvFlaky { id: "r".into(), amount: 5 };
        assert_eq!(dispatcher.dispatch(&envelope(&msg)).await.unwrap()[0].result.as_ref().map_err(|e| e.kind()).err(), Some("handler"));
        sqlx::query(sql("DELETE FROM effects WHERE effect_key = 'switch:r'")).execute(&pool).await.unwrap();
        inbox_tests::make_due(&pool).await;
        assert_eq!(dispatcher.dispatch(&redelivered(&msg)).await.unwrap()[0].result.as_ref().ok(), Some(&Outcome::Processed(())));
        assert_eq!(dispatcher.dispatch(&redelivered(&msg)).await.unwrap()[0].result.as_ref().ok(), Some(&Outcome::Duplicate));
        let other = AdvFlaky { id: "r".into(), amount: 6 };
        assert_eq!(dispatcher.dispatch(&redelivered(&other)).await.unwrap()[0].result.as_ref().map_err(|e| e.kind()).err(), Some("conflict"));
        assert_eq!(count(&pool, "SELECT COUNT(*) FROM inbox_rejections WHERE reason = 'conflict'").await, 1);
        assert_eq!(effect(&pool, "flaky:r").await, Some((1, 5)));
    }

    /// HOLDS: many concurrent redeliveries and replays of a key that failed once apply
    /// it exactly once (claims of a `failed` row wait on each other).
    #[tokio::test]
    async fn concurrent_retries_and_replays_of_a_failed_key_apply_once() {
        let (pool, _guard) = fixture().await;
        let dispatcher = std::sync::Arc::new(Dispatcher::from_registry(pool.clone()).unwrap());
        sqlx::query(sql("INSERT INTO effects (effect_key, applied, total) VALUES ('switch:c', 0, 0)"))
            .execute(&pool).await.unwrap();
        let msg = AdvFlaky { id: "c".into(), amount: 9 };
        assert!(dispatcher.dispatch(&envelope(&msg)).await.unwrap()[0].result.is_err());
        sqlx::query(sql("DELETE FROM effects WHERE effect_key = 'switch:c'")).execute(&pool).await.unwrap();
        inbox_tests::make_due(&pool).await;
        let mut tasks = Vec::new();
        for i in 0..12 {
            let dispatcher = dispatcher.clone();
            let env = envelope(&msg);
            tasks.push(tokio::spawn(async move {
                let result = if i % 3 == 0 {
                    dispatcher.replay("adv-flaky", "c").await.unwrap().result
                } else if i % 3 == 1 {
                    dispatcher.dispatch_batch(std::slice::from_ref(&env)).await.remove(0).unwrap().remove(0).result
                } else {
                    dispatcher.dispatch(&env).await.unwrap().remove(0).result
                };
                outcome_kind(&result)
            }));
        }
        let mut kinds = Vec::new();
        for task in tasks {
            kinds.push(task.await.unwrap());
        }
        let processed = kinds.iter().filter(|k| **k == Ok("processed")).count();
        let duplicates = kinds.iter().filter(|k| **k == Ok("duplicate")).count();
        assert_eq!((processed, duplicates), (1, 11), "{kinds:?}");
        assert_eq!(effect(&pool, "flaky:c").await, Some((1, 9)));
    }
}
