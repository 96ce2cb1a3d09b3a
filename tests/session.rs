//! The public claim session, used directly (no macro, runtime scope strings), on both backends:
//! claim, write, complete with a stored result; the same key again returns that result; another
//! fingerprint is a conflict; a concurrent claim in no-wait mode answers "in progress" while the
//! first transaction is still open; failed and abandoned claims.

#![allow(missing_docs)]

use inbox_runtime::{Fingerprint, IdempotencyKey};

fn key(text: &str) -> IdempotencyKey {
    IdempotencyKey::new(text, "POST /charges", "Idempotency-Key").unwrap()
}

fn fingerprint(body: serde_json::Value) -> Fingerprint {
    Fingerprint::of("POST /charges", &body).unwrap()
}

inbox_tests::backend_matrix! {
    use std::time::{Duration, Instant};

    use inbox_runtime::{
        ClaimSession, ClaimState, Disposition, ErrorClass, RetryPolicy, Status, Wait, ops::admin,
    };
    use inbox_tests::effect;

    #[tokio::test]
    async fn claim_write_complete_then_the_stored_result_then_a_conflict() {
        let (pool, _guard) = fixture().await;
        let scope = format!("tenant-{}", 7);
        let k = key("charge-1");
        let fp = fingerprint(serde_json::json!({"order": 42, "amount": 1500}));
        let session = ClaimSession::new(&scope, &k, "POST /charges", fp);

        let mut conn = pool.acquire().await.unwrap();
        let ClaimState::Claimed(mut claim) = session.open(&mut *conn).await.unwrap() else {
            panic!("a free key is claimed");
        };
        assert_eq!(claim.attempts(), 1);
        sqlx::query(APPLY_EFFECT)
            .bind("charge:42")
            .bind(1500_i64)
            .execute(claim.connection())
            .await
            .unwrap();
        claim.complete(Some(br#"{"status":201}"#)).await.unwrap();
        assert_eq!(effect(&pool, "charge:42").await, Some((1, 1500)));

        // The same key and fingerprint again: settled, with the stored result.
        match session.open(&mut *conn).await.unwrap() {
            ClaimState::Settled(settled) => {
                assert_eq!(settled.status, Status::Processed);
                assert_eq!(settled.fingerprint, fp);
                assert_eq!(settled.attempts, 1);
                assert_eq!(settled.result.as_deref(), Some(&br#"{"status":201}"#[..]));
            }
            other => panic!("expected settled, got {other:?}"),
        }

        // Another body under the same key: a conflict naming both fingerprints.
        let other = fingerprint(serde_json::json!({"order": 42, "amount": 9999}));
        match ClaimSession::new(&scope, &k, "POST /charges", other)
            .open(&mut *conn)
            .await
            .unwrap()
        {
            ClaimState::Conflict(conflict) => {
                assert_eq!(conflict.consumer, "tenant-7");
                assert_eq!(conflict.message_name, "POST /charges");
                assert_eq!(conflict.key.as_str(), "charge-1");
                assert_eq!((conflict.stored, conflict.received), (fp, other));
            }
            other => panic!("expected a conflict, got {other:?}"),
        }

        // Another scope is another inbox: the same key is free there.
        let ClaimState::Claimed(claim) = ClaimSession::new("tenant-8", &k, "POST /charges", fp)
            .open(&mut *conn)
            .await
            .unwrap()
        else {
            panic!("another scope's key is free");
        };
        claim.complete(None).await.unwrap();
        let row = admin::show(&pool, "tenant-8", "charge-1").await.unwrap().unwrap();
        assert_eq!((row.status, row.result), (Status::Processed, None));
        // The effect ran once in all of this.
        assert_eq!(effect(&pool, "charge:42").await, Some((1, 1500)));
    }

    #[tokio::test]
    async fn no_wait_answers_in_progress_while_the_first_claim_is_open() {
        let (pool, _guard) = fixture().await;
        let k = key("charge-2");
        let fp = fingerprint(serde_json::json!({"order": 43}));
        let session = ClaimSession::new("tenant-1", &k, "POST /charges", fp);

        let mut first_conn = pool.acquire().await.unwrap();
        let ClaimState::Claimed(mut first) = session.open(&mut *first_conn).await.unwrap()
        else {
            panic!("a free key is claimed");
        };
        sqlx::query(APPLY_EFFECT)
            .bind("charge:43")
            .bind(1_i64)
            .execute(first.connection())
            .await
            .unwrap();

        // The first transaction stays open: a blocking claim would wait for it forever.
        let mut second_conn = pool.acquire().await.unwrap();
        let started = Instant::now();
        let state = tokio::time::timeout(
            Duration::from_secs(5),
            session.clone().wait(Wait::NoWait).open(&mut *second_conn),
        )
        .await
        .expect("a no-wait claim does not wait for the open claim")
        .unwrap();
        let elapsed = started.elapsed();
        assert!(matches!(state, ClaimState::InProgress), "{state:?}");
        eprintln!("in progress answered in {elapsed:?}");
        drop(state);

        // Once the first commits, the same no-wait claim finds it settled.
        first.complete(Some(b"done")).await.unwrap();
        match session.wait(Wait::NoWait).open(&mut *second_conn).await.unwrap() {
            ClaimState::Settled(settled) => {
                assert_eq!(settled.result.as_deref(), Some(&b"done"[..]));
            }
            other => panic!("expected settled, got {other:?}"),
        }
        assert_eq!(effect(&pool, "charge:43").await, Some((1, 1)));
    }

    #[tokio::test]
    async fn a_failed_claim_rolls_back_is_retried_and_ends_dead() {
        let (pool, _guard) = fixture().await;
        let k = key("charge-3");
        let fp = fingerprint(serde_json::json!({"order": 44}));
        let policy = RetryPolicy::default().max_attempts(2);
        let session =
            ClaimSession::new("tenant-1", &k, "POST /charges", fp).retry_policy(&policy);
        let mut conn = pool.acquire().await.unwrap();

        let ClaimState::Claimed(mut claim) = session.open(&mut *conn).await.unwrap() else {
            panic!("a free key is claimed");
        };
        sqlx::query(APPLY_EFFECT)
            .bind("charge:44")
            .bind(1_i64)
            .execute(claim.connection())
            .await
            .unwrap();
        let disposition = claim
            .fail(ErrorClass::Retryable, "payment provider down", b"{\"order\":44}")
            .await;
        assert!(matches!(disposition, Disposition::Retry { .. }), "{disposition:?}");
        // The write rolled back with the claim; the failure is recorded.
        assert_eq!(effect(&pool, "charge:44").await, None);
        let row = admin::show(&pool, "tenant-1", "charge-3").await.unwrap().unwrap();
        assert_eq!((row.status, row.attempts), (Status::Failed, 1));
        assert_eq!(row.payload.as_deref(), Some(&b"{\"order\":44}"[..]));
        assert_eq!(
            row.last_error.as_deref(),
            Some("retryable error: payment provider down")
        );

        // Before its next attempt is due, the failed key is not claimed: "not yet".
        match session.open(&mut *conn).await.unwrap() {
            ClaimState::NotYet { retry_in, attempts } => {
                assert!(retry_in > Duration::ZERO && retry_in <= Duration::from_secs(2), "{retry_in:?}");
                assert_eq!(attempts, 1);
            }
            other => panic!("expected not yet, got {other:?}"),
        }
        // Once due, the failed key is claimed again by the next session: attempt 2, the last.
        assert_eq!(inbox_tests::make_due(&pool).await, 1);
        let ClaimState::Claimed(claim) = session.open(&mut *conn).await.unwrap() else {
            panic!("a failed key is claimed again");
        };
        assert_eq!(claim.attempts(), 2);
        let disposition = claim.fail(ErrorClass::Retryable, "still down", b"{}").await;
        assert_eq!(disposition, Disposition::Dead);
        match session.open(&mut *conn).await.unwrap() {
            ClaimState::Settled(settled) => {
                assert_eq!((settled.status, settled.attempts), (Status::Dead, 2));
                assert_eq!(settled.result, None);
            }
            other => panic!("expected dead, got {other:?}"),
        }
    }

    #[tokio::test]
    async fn an_abandoned_or_dropped_claim_leaves_the_key_free() {
        let (pool, _guard) = fixture().await;
        let k = key("charge-4");
        let fp = fingerprint(serde_json::json!({"order": 45}));
        let session = ClaimSession::new("tenant-1", &k, "POST /charges", fp);
        let mut conn = pool.acquire().await.unwrap();

        let ClaimState::Claimed(mut claim) = session.open(&mut *conn).await.unwrap() else {
            panic!("a free key is claimed");
        };
        sqlx::query(APPLY_EFFECT)
            .bind("charge:45")
            .bind(1_i64)
            .execute(claim.connection())
            .await
            .unwrap();
        claim.abandon().await.unwrap();
        assert_eq!(effect(&pool, "charge:45").await, None);
        assert_eq!(admin::show(&pool, "tenant-1", "charge-4").await.unwrap(), None);

        // Dropped without an end: rolled back as well, and the connection stays usable.
        let ClaimState::Claimed(claim) = session.open(&mut *conn).await.unwrap() else {
            panic!("the key is still free");
        };
        assert_eq!(claim.attempts(), 1);
        drop(claim);
        let ClaimState::Claimed(claim) = session.open(&mut *conn).await.unwrap() else {
            panic!("the key is still free after a dropped claim");
        };
        claim.complete(None).await.unwrap();
        let row = admin::show(&pool, "tenant-1", "charge-4").await.unwrap().unwrap();
        assert_eq!((row.status, row.attempts), (Status::Processed, 1));
    }
}
