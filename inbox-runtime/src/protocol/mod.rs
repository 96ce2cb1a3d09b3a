//! The claim protocol: the rules that make a delivery effectively once, written once.
//!
//! ```text
//! source ──► worker ──► dispatcher ──► protocol ──► store (PostgreSQL | SQLite | MySQL)
//! HTTP request ──► idempotency layer ──► protocol (claim session, no wait)
//! ```
//!
//! Every way in — a single delivery, a batch, a replay, a parked successor, a claim session
//! opened by hand, an HTTP request with or without an idempotency key — goes through the same
//! steps of one state machine (`machine`):
//!
//! 1. **claim** the key as the transaction's first statement (`machine::open` for one key,
//!    the store's batch claim for many), in a transaction begun by `tx::ClaimTx`;
//! 2. if the key was not free, **decide** what the stored row means for this delivery
//!    (`decide`: duplicate, conflict, dead, stale, parked, or a row to take over);
//! 3. run the **body** on the claim's transaction (a handler, or the caller's own writes), with
//!    the claim as the claim context (`context`, `machine::run_body`);
//! 4. run the **before-commit hooks** (`hooks`), then **verify** the transaction is still
//!    usable and **commit** (`tx::ClaimTx::finish`: `BEGIN`, verify, `COMMIT` and `ROLLBACK`
//!    are written there only);
//! 5. on failure, roll back and **record** the attempt (`failure`): `failed` with a next
//!    attempt time, or `dead`;
//! 6. after the commit, the **after-commit callbacks** (cache fills, relay wake-ups).
//!
//! Drivers: `single` (one delivery, its retries and its failure record), `batch` (many
//! deliveries in one transaction), `park` (replays and parked successors), `session` (steps
//! 1–6 for code that is not a `#[idempotent]` handler: the HTTP layer, a relay, your own).
//! The protocol depends on the store and the core types only: modules above it (the dispatcher,
//! the outbox, the HTTP layer) read what they need from it (`context` for the claim context).
//!
//! Public here: the [`ClaimSession`] (steps 1–6 for your own code: [`ClaimState`],
//! [`ClaimedKey`], [`Settled`], [`Wait`]) and the [`TransactionHook`]s a dispatcher runs in
//! each claim's transaction ([`ClaimInfo`], [`Fenced`]). The steps themselves are internal.

pub(crate) mod batch;
pub(crate) mod context;
pub(crate) mod erased;
pub(crate) mod failure;
pub(crate) mod hooks;
pub(crate) mod machine;
pub(crate) mod park;
pub(crate) mod session;
pub(crate) mod single;
pub(crate) mod tx;

pub use hooks::{ClaimInfo, Fenced, TransactionHook};
pub use session::{ClaimSession, ClaimState, ClaimedKey, Settled};

use crate::types::fingerprint::Fingerprint;
use crate::types::outcome::Outcome;
use crate::types::status::{ClaimMode, Status};

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
    /// Do not wait: report [`ClaimState::InProgress`] at once.
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
