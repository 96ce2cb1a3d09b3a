//! The claim state machine: the steps every driver composes, each written once.
//!
//! ```text
//!  open ──► Claimed ──► run_body ──► before_commit ──► finish (verify + COMMIT) ──► after_commit
//!   │          │            │              │                  │
//!   │          └────────────┴──────────────┴── error: ROLLBACK, then the failure recorded
//!   │                                                          (failure.rs)
//!   └──► Found (rolled back, decided) │ InProgress (no wait; rolled back)
//! peek ──► Found (a read outside any transaction, decided)
//! ```
//!
//! * [`open`]: `BEGIN` and the claim statement; a key that is not free is rolled back and
//!   [`decide`]d ([`Opened`]). [`peek`] decides a key's committed row without a transaction.
//! * [`run_body`]: the body, with its claim as the [claim context](super::context).
//! * [`before_commit`] / [`after_commit`]: the [hooks](super::hooks).
//! * [`ClaimTx::finish`]: verify and `COMMIT`, in [`tx`](super::tx) with `BEGIN` and
//!   `ROLLBACK`.
//! * [`commit`]: the last three in order, for one claim.
//!
//! Drivers: [`single`](super::single) (one delivery, with retries and the failure record),
//! [`batch`](super::batch) (one transaction, many claims: the claim statement for all of them,
//! then these steps per key), [`park`](super::park) (replays and parked successors, through the
//! single driver), [`session`](super::session) (the public claim session) and the HTTP layer
//! (over the session, or over [`ClaimTx`] and [`commit`] for a request without a key).

use std::future::Future;
use std::time::Duration;

use super::context;
use super::hooks::{ClaimInfo, HookRunner};
use super::tx::{ClaimTx, Hold, Verify};
use super::{DamagedFingerprint, Decision, Wait, decide};
use crate::store::{ClaimRequest, ClaimResult, InboxConnection};
use crate::types::classify::BoxError;
use crate::types::error::StoreOperation;
use crate::types::fingerprint::Fingerprint;
use crate::types::status::{ClaimMode, Status};

/// What [`open`] found.
pub(crate) enum Opened<'c, C: InboxConnection> {
    /// The key is held by the open transaction.
    Claimed(Claimed<'c, C>),
    /// The key is taken, and decided; the transaction was rolled back (its connection stays
    /// usable for a read).
    Found(ClaimTx<'c, C>, Found),
    /// Another transaction holds the key uncommitted ([`Wait::NoWait`] only); rolled back.
    InProgress(ClaimTx<'c, C>),
}

/// A claimed key: its transaction, open.
pub(crate) struct Claimed<'c, C: InboxConnection> {
    /// The transaction holding the claim: the body runs on its connection.
    pub(crate) tx: ClaimTx<'c, C>,
    /// Attempts for the key so far, this one included.
    pub(crate) attempts: u32,
}

/// A key that was not free, and what its stored row means for the delivery ([`decide`]).
pub(crate) struct Found {
    /// The row's status.
    pub(crate) status: Status,
    /// Attempts that ran for it.
    pub(crate) attempts: u32,
    /// For a `failed` row: how long until its next attempt is due (`None`: due).
    pub(crate) retry_in: Option<Duration>,
    /// The decision; an error if the stored fingerprint is damaged.
    pub(crate) decision: Result<Decision, DamagedFingerprint>,
}

impl Found {
    /// The decision for a stored row in `status` with fingerprint `payload_hash`, seen by a
    /// delivery of `received` claimed in `mode`.
    fn new(
        status: Status,
        payload_hash: &str,
        attempts: u32,
        retry_in: Option<Duration>,
        received: &Fingerprint,
        mode: ClaimMode,
    ) -> Self {
        Self {
            status,
            attempts,
            retry_in,
            decision: decide(status, payload_hash, received, mode, retry_in),
        }
    }

    /// [`Found::new`] for a stored row; `None` if `result` is not one.
    pub(crate) fn of(result: ClaimResult, received: &Fingerprint, mode: ClaimMode) -> Option<Self> {
        match result {
            ClaimResult::Existing {
                status,
                payload_hash,
                attempts,
                retry_in,
            } => Some(Self::new(
                status,
                &payload_hash,
                attempts,
                retry_in,
                received,
                mode,
            )),
            ClaimResult::Claimed { .. } => None,
        }
    }
}

/// Steps 1 and 2: `BEGIN`, the claim statement (the transaction's first) and, for a key that is
/// not free, `ROLLBACK` and the decision. On an error the transaction is rolled back and the
/// failing step named.
pub(crate) async fn open<'c, C: InboxConnection>(
    conn: Hold<'c, C>,
    request: &ClaimRequest<'_>,
    wait: Wait,
    received: &Fingerprint,
) -> Result<Opened<'c, C>, (StoreOperation, sqlx::Error)> {
    let mut tx = ClaimTx::begin(conn)
        .await
        .map_err(|e| (StoreOperation::Begin, e))?;
    let claimed = match wait {
        Wait::Block => tx.conn().claim(request).await.map(Some),
        Wait::NoWait => tx.conn().claim_no_wait(request).await,
    };
    match claimed {
        Ok(Some(ClaimResult::Claimed { attempts })) => {
            Ok(Opened::Claimed(Claimed { tx, attempts }))
        }
        Ok(Some(ClaimResult::Existing {
            status,
            payload_hash,
            attempts,
            retry_in,
        })) => {
            tx.rollback_to_spare()
                .await
                .map_err(|e| (StoreOperation::Rollback, e))?;
            let found = Found::new(
                status,
                &payload_hash,
                attempts,
                retry_in,
                received,
                request.mode,
            );
            Ok(Opened::Found(tx, found))
        }
        Ok(None) => {
            let _ = tx.rollback().await;
            Ok(Opened::InProgress(tx))
        }
        Err(error) => {
            // Nothing of ours is written. Roll back explicitly (a rollback on drop is deferred
            // and reports nothing); the claim's error is the one to report.
            let _ = tx.rollback().await;
            Err((StoreOperation::Claim, error))
        }
    }
}

/// The committed row of `key` in `consumer`, decided for a delivery of `received` in `mode`:
/// one read, outside any transaction (`None`: no row). For deliveries that are most likely
/// duplicates (redeliveries) and for claims that do not wait.
pub(crate) async fn peek<C: InboxConnection>(
    conn: &mut C,
    consumer: &str,
    key: &str,
    received: &Fingerprint,
    mode: ClaimMode,
) -> Result<Option<Found>, sqlx::Error> {
    let existing = conn.existing(consumer, key).await?;
    Ok(existing.and_then(|row| Found::of(row, received, mode)))
}

/// Step 3: runs `body` (on the claim's connection) with `(consumer, key)` as the claim
/// context, so that what it publishes gets stable message ids and its step keys are stable.
pub(crate) async fn run_body<F: Future>(consumer: &str, key: &str, body: F) -> F::Output {
    context::scope(consumer, key, body).await
}

/// Step 4: every before-commit hook, on the transaction's connection. On an error the caller
/// rolls back (how depends on the driver: a batch's savepoint, or the whole transaction).
pub(crate) async fn before_commit<C: InboxConnection>(
    tx: &mut ClaimTx<'_, C>,
    hooks: Option<&dyn HookRunner>,
    info: &ClaimInfo<'_>,
) -> Result<(), BoxError> {
    match hooks {
        Some(hooks) => hooks.before_commit(tx.conn().as_any(), info).await,
        None => Ok(()),
    }
}

/// Step 6: every after-commit callback, once the claim's transaction committed.
pub(crate) fn after_commit(hooks: Option<&dyn HookRunner>, info: &ClaimInfo<'_>) {
    if let Some(hooks) = hooks {
        hooks.after_commit(info);
    }
}

/// Why [`commit`] did not commit.
#[derive(Debug)]
pub(crate) enum Uncommitted {
    /// A before-commit hook failed; the transaction was rolled back.
    Hook(BoxError),
    /// The verify ([`StoreOperation::Verify`]: rolled back) or the `COMMIT`
    /// ([`StoreOperation::Commit`]: the outcome is unknown) failed.
    Store(StoreOperation, sqlx::Error),
}

/// Steps 4 to 6 for one claim whose body succeeded: the before-commit hooks, verify and
/// `COMMIT` ([`ClaimTx::finish`]), the after-commit callbacks.
pub(crate) async fn commit<C: InboxConnection>(
    tx: &mut ClaimTx<'_, C>,
    hooks: Option<&dyn HookRunner>,
    info: &ClaimInfo<'_>,
    verify: Verify<'_>,
) -> Result<(), Uncommitted> {
    if let Err(source) = before_commit(tx, hooks, info).await {
        // The hook's error is what the caller needs; a failing rollback means the connection
        // is gone, and the server rolls back with it.
        let _ = tx.rollback().await;
        return Err(Uncommitted::Hook(source));
    }
    tx.finish(verify)
        .await
        .map_err(|(operation, error)| Uncommitted::Store(operation, error))?;
    after_commit(hooks, info);
    Ok(())
}
