//! The claim's transaction: the one place where a transaction of the protocol begins, is
//! verified, commits and rolls back. Every driver goes through it — single deliveries, batches
//! (and the savepoint of each of their handlers), claim sessions, HTTP requests with or without
//! an idempotency key — so a change to how a transaction ends (a verify, `COMMIT` and the next
//! `BEGIN` in one round trip, say) is made here once.
//!
//! **Round trips.** A claim's transaction that is to commit ends in one round trip where the
//! backend can ([`InboxConnection::verify_commit_begin`]: PostgreSQL) and the runtime owns the
//! connection ([`Hold::Kept`], [`Hold::Owned`]): the verify, `COMMIT` and the next `BEGIN` in
//! one simple query. The next transaction is left empty (no snapshot, no transaction id, no
//! lock). On a connection a [`ConnectionSlot`](crate::ConnectionSlot) keeps ([`Hold::Kept`]) it
//! is the slot's *spare* transaction: the next delivery's claim on the slot runs in it, with no
//! `BEGIN` of its own (so a new message costs the claim, the handler's statements and this one
//! round trip), and the slot rolls it back before anything else uses the connection (see
//! [`ConnectionSlot`](crate::ConnectionSlot)). On an owned connection its `ROLLBACK` is queued:
//! it goes out in the same write as the connection's next statement (or the pool's check when
//! the connection goes back to its pool). Either way sqlx's transaction depth stays truthful
//! and no round trip is added. On the caller's own connection ([`Hold::Borrowed`]), in a savepoint, and on
//! the other backends, the verify and `COMMIT` are two round trips, and nothing is left open.

use std::ops::DerefMut;

use sqlx_core::transaction::TransactionManager as _;

use crate::store::InboxConnection;
use crate::types::error::StoreOperation;

/// The connection a claim's transaction runs on: borrowed from the caller (every driver), or
/// owned by the claim ([`ClaimSession::open_owned`](crate::ClaimSession::open_owned): a pooled
/// connection that travels with the claimed key, as the HTTP layer's does).
pub(crate) enum Hold<'c, C: InboxConnection> {
    /// The caller's own connection: a transaction's end leaves nothing open on it.
    Borrowed(&'c mut C),
    /// A connection the runtime keeps for its next statements or gives back to its pool (a
    /// [`ConnectionSlot`](crate::ConnectionSlot)'s): its transaction may end in one round trip
    /// (see the module's documentation).
    Kept(&'c mut C),
    /// A connection the claim owns (a `PoolConnection`, say), dropped with it (as
    /// [`Hold::Kept`]).
    Owned(Box<dyn DerefMut<Target = C> + Send + 'c>),
}

/// Whose connection a delivery runs on, which decides how its transaction may end (see the
/// module's documentation).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Owner {
    /// The caller's own connection ([`Hold::Borrowed`]).
    Caller,
    /// A connection the runtime keeps or gives back to its pool ([`Hold::Kept`]).
    Runtime,
}

/// Ends the spare transaction a [`ConnectionSlot`](crate::ConnectionSlot) keeps open on a
/// connection the runtime owns (see the module's documentation), before a statement that must
/// run outside any transaction: its `ROLLBACK` is queued, sent with that statement.
pub(crate) fn end_spare<C: InboxConnection>(conn: &mut C, owner: Owner) {
    if owner == Owner::Runtime
        && C::CHAINED_TRANSACTIONS
        && <C::Database as sqlx::Database>::TransactionManager::get_transaction_depth(conn) == 1
    {
        <C::Database as sqlx::Database>::TransactionManager::start_rollback(conn);
    }
}

impl<'c, C: InboxConnection> Hold<'c, C> {
    /// `conn`, held as its `owner` requires.
    pub(crate) fn of(conn: &'c mut C, owner: Owner) -> Self {
        match owner {
            Owner::Caller => Hold::Borrowed(conn),
            Owner::Runtime => Hold::Kept(conn),
        }
    }
}

impl<C: InboxConnection> Hold<'_, C> {
    /// The connection.
    pub(crate) fn conn(&mut self) -> &mut C {
        match self {
            Hold::Borrowed(conn) | Hold::Kept(conn) => conn,
            Hold::Owned(conn) => conn,
        }
    }

    fn conn_ref(&self) -> &C {
        match self {
            Hold::Borrowed(conn) | Hold::Kept(conn) => conn,
            Hold::Owned(conn) => conn,
        }
    }
}

/// What [`ClaimTx::finish`] checks before `COMMIT`.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Verify<'a> {
    /// That the transaction holding the claim of `key` by `consumer` is still usable. A handler
    /// that swallowed a database error and returned `Ok` leaves a PostgreSQL transaction
    /// aborted, and `COMMIT` would then roll back without an error: the check makes such a
    /// message fail ([`StoreOperation::Verify`]) instead of being reported processed.
    Claim {
        /// The consumer (scope) of the claim.
        consumer: &'a str,
        /// Its idempotency key.
        key: &'a str,
    },
    /// Nothing: a savepoint (an aborted one fails its `RELEASE`), a claim settled without its
    /// body (stale, parked), a transaction without a claim (an HTTP request without a key).
    Nothing,
}

/// The transaction of one claim (or of a batch of claims, or one savepoint of a batch), on a
/// borrowed (or owned, see [`Hold`]) connection: `BEGIN` (a savepoint if the connection is
/// already inside a transaction) to `COMMIT` or `ROLLBACK`, rolled back if dropped open (as
/// sqlx's own transactions are). Unlike a `sqlx::Transaction`, it gives the connection back
/// after the rollback, for the failure record that follows it.
pub(crate) struct ClaimTx<'c, C: InboxConnection> {
    conn: Hold<'c, C>,
    open: bool,
}

impl<'c, C: InboxConnection> ClaimTx<'c, C> {
    /// `BEGIN` on `conn` (the backend's own statement: `BEGIN IMMEDIATE` on SQLite), or a
    /// savepoint if `conn` is inside a transaction already.
    pub(crate) async fn begin(mut conn: Hold<'c, C>) -> Result<Self, sqlx::Error> {
        if let Hold::Kept(kept) = &conn
            && C::CHAINED_TRANSACTIONS
            && <C::Database as sqlx::Database>::TransactionManager::get_transaction_depth(kept) == 1
        {
            // The spare transaction the previous delivery's `COMMIT` began (see the module's
            // documentation): this claim runs in it, no `BEGIN` sent.
            return Ok(Self { conn, open: true });
        }
        let statement = conn.conn().begin_statement();
        <C::Database as sqlx::Database>::TransactionManager::begin(conn.conn(), statement).await?;
        Ok(Self { conn, open: true })
    }

    /// A savepoint inside this transaction (a batch isolates each handler in one), ended by its
    /// own [`finish`](Self::finish) (`RELEASE`) or [`rollback`](Self::rollback) (`ROLLBACK TO`).
    pub(crate) async fn savepoint(&mut self) -> Result<ClaimTx<'_, C>, sqlx::Error> {
        ClaimTx::begin(Hold::Borrowed(self.conn())).await
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

    /// The last step of every transaction that is to commit: the check `verify` asks for, then
    /// `COMMIT` (both in one round trip where they can be: see the module's documentation). A
    /// failed check rolls the transaction back ([`StoreOperation::Verify`]); a failed `COMMIT`
    /// ([`StoreOperation::Commit`]) leaves the outcome unknown, and the transaction is rolled
    /// back when this is dropped.
    pub(crate) async fn finish(
        &mut self,
        verify: Verify<'_>,
    ) -> Result<(), (StoreOperation, sqlx::Error)> {
        if let Verify::Claim { consumer, key } = verify {
            if let Some(ended) = self.finish_chained().await {
                return ended;
            }
            if let Err(error) = self.conn().verify_claim(consumer, key).await {
                let _ = self.rollback().await;
                return Err((StoreOperation::Verify, error));
            }
        }
        <C::Database as sqlx::Database>::TransactionManager::commit(self.conn.conn())
            .await
            .map_err(|e| (StoreOperation::Commit, e))?;
        self.open = false;
        Ok(())
    }

    /// Verify, `COMMIT` and `BEGIN` in one round trip, then the empty transaction's `ROLLBACK`
    /// queued on the connection; `None` if this transaction cannot end so (the caller's own
    /// connection, a savepoint, a backend without it).
    async fn finish_chained(&mut self) -> Option<Result<(), (StoreOperation, sqlx::Error)>> {
        if matches!(self.conn, Hold::Borrowed(_))
            || <C::Database as sqlx::Database>::TransactionManager::get_transaction_depth(
                self.conn.conn_ref(),
            ) != 1
        {
            return None;
        }
        let ended = self.conn().verify_commit_begin()?.await;
        match ended {
            Ok(()) => {
                // Committed. The empty transaction begun with it is the slot's spare one on a
                // kept connection (the next claim runs in it; the slot ends it before anything
                // else does); on an owned one, it ends with the connection's next statement.
                if !matches!(self.conn, Hold::Kept(_)) {
                    <C::Database as sqlx::Database>::TransactionManager::start_rollback(
                        self.conn(),
                    );
                }
                self.open = false;
                Some(Ok(()))
            }
            Err((StoreOperation::Verify, error)) => {
                let _ = self.rollback().await;
                Some(Err((StoreOperation::Verify, error)))
            }
            // The COMMIT failed: as in `finish`, rolled back when this is dropped.
            Err(failed) => Some(Err(failed)),
        }
    }

    /// `ROLLBACK` of a claim that found its key taken and runs nothing more on the connection:
    /// on a kept connection that can, `ROLLBACK` and `BEGIN` in one round trip, the new
    /// transaction the slot's spare one (see the module's documentation); else
    /// [`rollback`](Self::rollback).
    pub(crate) async fn rollback_to_spare(&mut self) -> Result<(), sqlx::Error> {
        if !matches!(self.conn, Hold::Kept(_))
            || <C::Database as sqlx::Database>::TransactionManager::get_transaction_depth(
                self.conn.conn_ref(),
            ) != 1
        {
            return self.rollback().await;
        }
        let Some(ended) = self.conn().rollback_begin() else {
            return self.rollback().await;
        };
        // Failed: the transaction is rolled back (queued) when this is dropped.
        ended.await?;
        self.open = false;
        Ok(())
    }

    /// `ROLLBACK`; the connection stays usable through [`ClaimTx::conn`]. As with sqlx's own
    /// transactions, a rollback that fails leaves the transaction open, to be rolled back
    /// (queued on the connection) when this is dropped.
    pub(crate) async fn rollback(&mut self) -> Result<(), sqlx::Error> {
        <C::Database as sqlx::Database>::TransactionManager::rollback(self.conn.conn()).await?;
        self.open = false;
        Ok(())
    }
}

impl<C: InboxConnection> Drop for ClaimTx<'_, C> {
    fn drop(&mut self) {
        if self.open {
            <C::Database as sqlx::Database>::TransactionManager::start_rollback(self.conn.conn());
        }
    }
}
