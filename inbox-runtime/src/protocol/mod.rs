//! The claim protocol: the rules that make a delivery effectively once, written once.
//!
//! ```text
//! source ──► worker ──► dispatcher ──► protocol ──► store (PostgreSQL | SQLite)
//! ```
//!
//! Every way in — a single delivery, a batch, a replay, a parked successor, a claim session
//! opened by hand (an HTTP request) — goes through the same steps:
//!
//! 1. **claim** the key as the transaction's first statement ([`begin_claim`] for one key, the
//!    store's batch claim for many);
//! 2. if the key was not free, **decide** what the stored row means for this delivery
//!    ([`decide`]: duplicate, conflict, dead, stale, parked, or a row to take over);
//! 3. run the **body** on the claim's transaction (a handler, or the caller's own writes);
//! 4. run the **before-commit hooks** ([`hooks`]), then **verify** the transaction is still
//!    usable and **commit** ([`finish`]);
//! 5. on failure, roll back and **record** the attempt in its own short statement
//!    ([`failure`]): `failed` with a next attempt time, or `dead`;
//! 6. after the commit, the **after-commit callbacks** (cache fills, relay wake-ups).
//!
//! [`single`] drives one delivery through them, the dispatcher's batch driver many at once;
//! [`session`] exposes steps 1–5 to code that is not a `#[idempotent]` handler.

pub(crate) mod erased;
pub(crate) mod failure;
pub(crate) mod hooks;
pub(crate) mod park;
pub(crate) mod session;
pub(crate) mod single;

use std::ops::DerefMut;

use sqlx_core::transaction::TransactionManager as _;

use crate::error::StoreOperation;
use crate::fingerprint::Fingerprint;
use crate::outcome::Outcome;
use crate::status::{ClaimMode, Status};
use crate::store::{ClaimRequest, ClaimResult, InboxConnection};

/// What a stored row means for a delivery whose claim did not take it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Decision {
    /// The key is settled: report this outcome, run nothing.
    Settled(Outcome<()>),
    /// The same key with a different payload: report a conflict, run nothing.
    Conflict {
        /// The fingerprint stored with the key.
        stored: Fingerprint,
    },
    /// A row the claim would take over (a `failed` key, say) that changed under it: claim
    /// again.
    Claimable,
}

/// A stored fingerprint that is not a SHA-256 hex digest (a damaged row).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct DamagedFingerprint(pub(crate) String);

impl DamagedFingerprint {
    /// The error reported for it, as the driver's decode error.
    pub(crate) fn into_sqlx(self) -> sqlx::Error {
        sqlx::Error::Decode(
            format!(
                "stored payload_hash {:?} is not a SHA-256 hex digest",
                self.0
            )
            .into(),
        )
    }
}

/// The protocol's decision function: what a stored row in `status` with fingerprint
/// `stored_hash` (and, if `failed`, `retry_in` until its next attempt is due) means for a
/// delivery of fingerprint `received` claimed in `mode`.
///
/// A different fingerprint is a conflict whatever the status; the same fingerprint on a row the
/// mode takes over now is claimable; a `failed` row not due yet is "not yet"; anything else is
/// settled.
pub(crate) fn decide(
    status: Status,
    stored_hash: &str,
    received: &Fingerprint,
    mode: ClaimMode,
    retry_in: Option<std::time::Duration>,
) -> Result<Decision, DamagedFingerprint> {
    let stored =
        Fingerprint::from_hex(stored_hash).ok_or_else(|| DamagedFingerprint(stored_hash.into()))?;
    if stored != *received {
        return Ok(Decision::Conflict { stored });
    }
    if mode.takes_over_now(status, retry_in) {
        return Ok(Decision::Claimable);
    }
    if let (Status::Failed, Some(retry_in)) = (status, retry_in) {
        // A delivery before the failed key's next attempt is due: not run, not counted.
        return Ok(Decision::Settled(Outcome::NotYet { retry_in }));
    }
    Ok(Decision::Settled(match status {
        Status::Dead => Outcome::Dead,
        Status::Discarded => Outcome::Discarded,
        Status::Parked => Outcome::Parked,
        Status::Stale => Outcome::Stale,
        // `failed` is always taken over; the rest is a processed key.
        Status::Processed | Status::Failed => Outcome::Duplicate,
    }))
}

/// How long a claim waits for another transaction that holds the same key uncommitted.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum Wait {
    /// Wait until the other transaction ends, then report what it left (the default, and what
    /// message deliveries do: the outcome is then always known).
    #[default]
    Block,
    /// Do not wait: report [`ClaimState::InProgress`](crate::ClaimState::InProgress) at once.
    /// On PostgreSQL the claim gives up after [`Wait::NO_WAIT_GRACE`] (10 ms) of waiting for
    /// the key's lock, on SQLite when a claim session of this process holds the key; in both
    /// cases the key's committed row is then read once, and settles the claim if it can (a
    /// repeat of a completed request is a replay, not "in progress", even while other repeats
    /// read the same row). SQLite serializes writers, so a claim held by *another process* is
    /// waited for, up to the connection's busy timeout. For HTTP requests: a duplicate request
    /// while the first one still runs gets "in progress" (409) instead of a blocked worker.
    NoWait,
}

impl Wait {
    /// How long a [`Wait::NoWait`] claim on PostgreSQL waits for the key's lock before it
    /// reports "in progress": 10 ms (`lock_timeout`), to ride out a concurrent commit.
    pub const NO_WAIT_GRACE: std::time::Duration = std::time::Duration::from_millis(10);
}

/// The connection a claim's transaction runs on: borrowed from the caller (every driver), or
/// owned by the claim ([`ClaimSession::open_owned`](crate::ClaimSession::open_owned): a pooled
/// connection that travels with the claimed key, as the HTTP layer's does).
pub(crate) enum Hold<'c, C: InboxConnection> {
    /// The caller's connection.
    Borrowed(&'c mut C),
    /// A connection the claim owns (a `PoolConnection`, say), dropped with it.
    Owned(Box<dyn DerefMut<Target = C> + Send + 'c>),
}

impl<C: InboxConnection> Hold<'_, C> {
    fn conn(&mut self) -> &mut C {
        match self {
            Hold::Borrowed(conn) => conn,
            Hold::Owned(conn) => conn,
        }
    }

    fn conn_ref(&self) -> &C {
        match self {
            Hold::Borrowed(conn) => conn,
            Hold::Owned(conn) => conn,
        }
    }
}

/// The transaction of one claim, on a borrowed (or owned, see [`Hold`]) connection: `BEGIN` (a
/// savepoint if the connection is already inside a transaction) to `COMMIT` or `ROLLBACK`,
/// rolled back if dropped open (as sqlx's own transactions are). Unlike a `sqlx::Transaction`,
/// it gives the connection back after the rollback, for the failure record that follows it.
pub(crate) struct ClaimTx<'c, C: InboxConnection> {
    conn: Hold<'c, C>,
    open: bool,
}

impl<'c, C: InboxConnection> ClaimTx<'c, C> {
    /// `BEGIN` on `conn`.
    pub(crate) async fn begin(mut conn: Hold<'c, C>) -> Result<Self, sqlx::Error> {
        let statement = conn.conn().begin_statement();
        <C::Database as sqlx::Database>::TransactionManager::begin(conn.conn(), statement).await?;
        Ok(Self { conn, open: true })
    }

    /// The transaction's connection.
    pub(crate) fn conn(&mut self) -> &mut C {
        self.conn.conn()
    }

    /// The transaction's connection, shared.
    #[cfg_attr(not(feature = "http"), allow(dead_code))]
    pub(crate) fn conn_ref(&self) -> &C {
        self.conn.conn_ref()
    }

    /// `COMMIT`. On an error the outcome is unknown and the transaction is rolled back when
    /// this is dropped.
    pub(crate) async fn commit(&mut self) -> Result<(), sqlx::Error> {
        <C::Database as sqlx::Database>::TransactionManager::commit(self.conn.conn()).await?;
        self.open = false;
        Ok(())
    }

    /// `ROLLBACK`; the connection stays usable through [`ClaimTx::conn`].
    pub(crate) async fn rollback(&mut self) -> Result<(), sqlx::Error> {
        self.open = false;
        <C::Database as sqlx::Database>::TransactionManager::rollback(self.conn.conn()).await
    }
}

impl<C: InboxConnection> Drop for ClaimTx<'_, C> {
    fn drop(&mut self) {
        if self.open {
            <C::Database as sqlx::Database>::TransactionManager::start_rollback(self.conn.conn());
        }
    }
}

/// The first steps of every single claim: `BEGIN`, the claim statement, and, when the key is
/// not free, `ROLLBACK`.
pub(crate) enum Begun {
    /// The key is held by the open transaction; `attempts` counts this one.
    Claimed { attempts: u32 },
    /// The key is taken; the transaction was rolled back.
    Existing {
        status: Status,
        payload_hash: String,
        attempts: u32,
        retry_in: Option<std::time::Duration>,
    },
    /// Another transaction holds the key uncommitted ([`Wait::NoWait`] only); rolled back.
    InProgress,
}

/// `BEGIN` and the claim (see [`Begun`]). On an error the transaction is rolled back and the
/// failing step named.
pub(crate) async fn begin_claim<'c, C: InboxConnection>(
    conn: Hold<'c, C>,
    request: &ClaimRequest<'_>,
    wait: Wait,
) -> Result<(ClaimTx<'c, C>, Begun), (StoreOperation, sqlx::Error)> {
    let mut tx = ClaimTx::begin(conn)
        .await
        .map_err(|e| (StoreOperation::Begin, e))?;
    let claimed = match wait {
        Wait::Block => tx.conn().claim(request).await.map(Some),
        Wait::NoWait => tx.conn().claim_no_wait(request).await,
    };
    match claimed {
        Ok(Some(ClaimResult::Claimed { attempts })) => Ok((tx, Begun::Claimed { attempts })),
        Ok(Some(ClaimResult::Existing {
            status,
            payload_hash,
            attempts,
            retry_in,
        })) => {
            tx.rollback()
                .await
                .map_err(|e| (StoreOperation::Rollback, e))?;
            let begun = Begun::Existing {
                status,
                payload_hash,
                attempts,
                retry_in,
            };
            Ok((tx, begun))
        }
        Ok(None) => {
            let _ = tx.rollback().await;
            Ok((tx, Begun::InProgress))
        }
        Err(error) => {
            // Nothing of ours is written. Roll back explicitly (a rollback on drop is deferred
            // and reports nothing); the claim's error is the one to report.
            let _ = tx.rollback().await;
            Err((StoreOperation::Claim, error))
        }
    }
}

/// The last step of every successful claim: checks that the transaction holding the claim of
/// `key` is still usable, then commits. A handler that swallowed a database error and returned
/// `Ok` leaves a PostgreSQL transaction aborted, and `COMMIT` would then roll back without an
/// error: the check makes such a message fail ([`StoreOperation::Verify`]) instead of being
/// reported processed.
pub(crate) async fn finish<C: InboxConnection>(
    tx: &mut ClaimTx<'_, C>,
    consumer: &str,
    key: &str,
) -> Result<(), (StoreOperation, sqlx::Error)> {
    if let Err(error) = verify(tx.conn(), consumer, key).await {
        let _ = tx.rollback().await;
        return Err((StoreOperation::Verify, error));
    }
    tx.commit().await.map_err(|e| (StoreOperation::Commit, e))
}

/// The check of [`finish`] alone, on the transaction's connection (batches run it once for
/// the whole transaction).
pub(crate) async fn verify<C: InboxConnection>(
    conn: &mut C,
    consumer: &str,
    key: &str,
) -> Result<(), sqlx::Error> {
    conn.verify_claim(consumer, key).await
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fp(byte: u8) -> Fingerprint {
        Fingerprint::from_hex(&hex_of(byte)).unwrap()
    }

    fn hex_of(byte: u8) -> String {
        format!("{byte:02x}").repeat(32)
    }

    #[test]
    fn a_different_fingerprint_is_a_conflict_whatever_the_status() {
        for status in Status::ALL {
            for mode in [
                ClaimMode::Deliver,
                ClaimMode::Replay,
                ClaimMode::Resume,
                ClaimMode::Release,
            ] {
                assert_eq!(
                    decide(status, &hex_of(1), &fp(2), mode, None),
                    Ok(Decision::Conflict { stored: fp(1) }),
                    "{status} {mode:?}"
                );
            }
        }
    }

    #[test]
    fn the_same_fingerprint_settles_or_is_taken_over_by_mode() {
        let d = |status, mode| decide(status, &hex_of(7), &fp(7), mode, None).unwrap();
        use ClaimMode::*;
        use Outcome::*;
        assert_eq!(d(Status::Processed, Deliver), Decision::Settled(Duplicate));
        assert_eq!(d(Status::Processed, Replay), Decision::Settled(Duplicate));
        assert_eq!(d(Status::Failed, Deliver), Decision::Claimable);
        assert_eq!(d(Status::Failed, Resume), Decision::Claimable);
        assert_eq!(d(Status::Dead, Deliver), Decision::Settled(Dead));
        assert_eq!(d(Status::Dead, Replay), Decision::Claimable);
        assert_eq!(d(Status::Parked, Deliver), Decision::Settled(Parked));
        assert_eq!(d(Status::Parked, Resume), Decision::Claimable);
        assert_eq!(d(Status::Parked, Release), Decision::Claimable);
        assert_eq!(d(Status::Stale, Deliver), Decision::Settled(Stale));
        assert_eq!(d(Status::Discarded, Replay), Decision::Settled(Discarded));
    }

    #[test]
    fn a_failed_key_not_due_waits_for_deliveries_only() {
        let later = Some(std::time::Duration::from_millis(1500));
        let d = |status, mode| decide(status, &hex_of(7), &fp(7), mode, later).unwrap();
        assert_eq!(
            d(Status::Failed, ClaimMode::Deliver),
            Decision::Settled(Outcome::NotYet {
                retry_in: std::time::Duration::from_millis(1500)
            })
        );
        assert_eq!(d(Status::Failed, ClaimMode::Replay), Decision::Claimable);
        assert_eq!(d(Status::Failed, ClaimMode::Resume), Decision::Claimable);
        // Another payload is still a conflict, due or not.
        assert!(matches!(
            decide(
                Status::Failed,
                &hex_of(1),
                &fp(2),
                ClaimMode::Deliver,
                later
            ),
            Ok(Decision::Conflict { .. })
        ));
    }

    #[test]
    fn a_damaged_stored_fingerprint_is_reported() {
        assert_eq!(
            decide(Status::Processed, "zz", &fp(1), ClaimMode::Deliver, None),
            Err(DamagedFingerprint("zz".into()))
        );
    }
}
