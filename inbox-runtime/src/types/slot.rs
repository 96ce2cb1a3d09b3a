//! A pooled connection held across deliveries, so that the pool's own round trips are paid once
//! per connection instead of once per message.

use std::fmt;
use std::ops::{Deref, DerefMut};
use std::time::{Duration, Instant};

use sqlx::pool::PoolConnection;
use sqlx::{Connection as _, Database, Pool};
use sqlx_core::transaction::TransactionManager as _;

/// One pooled connection, held across deliveries by one caller at a time: the argument of
/// [`Dispatcher::dispatch_on`](crate::Dispatcher::dispatch_on),
/// [`Dispatcher::dispatch_batch_on`](crate::Dispatcher::dispatch_batch_on) and
/// [`Dispatcher::record_rejection_on`](crate::Dispatcher::record_rejection_on).
///
/// Why: sqlx's pool pings a connection when it hands it out (unless `test_before_acquire` is
/// off) and **always** when it is given back: two round trips to the database per acquire.
/// [`Dispatcher::dispatch`](crate::Dispatcher::dispatch) acquires once per envelope; a
/// consumer loop that dispatches on a slot pays them only when the slot takes a new connection.
/// The [`Worker`](crate::Worker) keeps one slot per concurrency slot.
///
/// The slot starts empty and acquires from the dispatcher's pool on first use. It behaves like
/// the pool where that matters:
/// * a connection unused for [`IDLE_CHECK`](Self::IDLE_CHECK) (1 s) or more is pinged before it
///   is used again, and replaced if the server closed it meanwhile (for example
///   `idle_session_timeout`);
/// * a connection found lost during a delivery (I/O error, server shutdown or termination) is
///   closed, and the delivery runs once more on a new one (the claim makes that safe);
/// * a connection is handed back to the pool after [`MAX_HOLD`](Self::MAX_HOLD) (5 minutes) or
///   the pool's `max_lifetime`, whichever is shorter, and a new one taken;
/// * a slot used with dispatchers of different pools hands its connection back whenever the
///   pool changes (a slot per dispatcher keeps its connection);
/// * if a dispatch on the slot is cancelled (its future dropped mid-transaction), the connection
///   goes back to the pool at once, which rolls the transaction back and releases its locks;
/// * on PostgreSQL, a delivery's verify, `COMMIT` and the next delivery's `BEGIN` go out in one
///   round trip, and the next claim on the slot runs in that transaction (a *spare*
///   transaction: begun, nothing run in it, so it holds no snapshot, transaction id or lock).
///   The spare transaction is used only by a claim within [`SPARE_WINDOW`](Self::SPARE_WINDOW)
///   (50 ms) of the previous delivery's start: `now()` in that claim's transaction, and in your
///   handler, is the time of the spare transaction's `BEGIN`, so at most 50 ms early (use
///   `clock_timestamp()` where a deadline check needs the instant itself). It is rolled back,
///   in the same write as the next statement, before anything else runs on the connection,
///   before a later claim, before an idle connection's ping, and when the connection goes
///   back to the pool.
///
/// Dropping the slot (or [`release`](Self::release)) gives the connection back to the pool.
/// While a slot holds a connection, the pool has one less to hand out: size the pool for the
/// slots you keep plus anything else that uses it.
///
/// ```no_run
/// # async fn demo(pool: sqlx::PgPool, envelopes: Vec<inbox_runtime::Envelope>) -> Result<(), Box<dyn std::error::Error>> {
/// use inbox_runtime::{ConnectionSlot, Dispatcher};
///
/// let dispatcher = Dispatcher::from_registry(pool)?;
/// let mut slot = ConnectionSlot::new();
/// for envelope in &envelopes {
///     let outcomes = dispatcher.dispatch_on(&mut slot, envelope).await?;
///     // … settle the delivery after this returns …
/// #   let _ = outcomes;
/// }
/// # Ok(()) }
/// ```
pub struct ConnectionSlot<DB: Database> {
    held: Option<Held<DB>>,
}

struct Held<DB: Database> {
    conn: PoolConnection<DB>,
    /// The pool it came from (the address of that pool's shared state: the same for every
    /// clone of one pool, and kept alive by the connection).
    pool: usize,
    /// When the slot took it from the pool.
    since: Instant,
    /// When it was last handed to a caller.
    used: Instant,
}

impl<DB: Database> ConnectionSlot<DB> {
    /// How long a slot keeps one connection at most before handing it back to the pool and
    /// taking another: 5 minutes (or the pool's `max_lifetime`, if shorter).
    pub const MAX_HOLD: Duration = Duration::from_secs(300);

    /// A held connection unused for this long (1 s) is pinged before its next use.
    pub const IDLE_CHECK: Duration = Duration::from_secs(1);

    /// A spare transaction (see the type's documentation) is used by the next claim only if
    /// the slot was last handed out less than this long ago (50 ms): `now()` in that claim's
    /// transaction, and in its handler, is the time of the spare transaction's `BEGIN`, so at
    /// most this much earlier than the claim. An older one is rolled back and the claim sends
    /// its own `BEGIN`.
    pub const SPARE_WINDOW: Duration = Duration::from_millis(50);

    /// An empty slot: it acquires a connection on first use.
    pub fn new() -> Self {
        Self { held: None }
    }

    /// Whether the slot holds a connection now.
    pub fn is_held(&self) -> bool {
        self.held.is_some()
    }

    /// How long the held connection has gone unused, if the slot holds one.
    pub fn idle_for(&self) -> Option<Duration> {
        self.held.as_ref().map(|held| held.used.elapsed())
    }

    /// Gives the held connection (if any) back to the pool.
    pub fn release(&mut self) {
        self.held = None;
    }

    /// The held connection, acquiring one from `pool` if the slot is empty, its connection was
    /// held too long, or it was idle and no longer answers a ping. A spare transaction left
    /// open on it (see the type's documentation) is ended first: its `ROLLBACK` goes out with
    /// the connection's next statement.
    pub(crate) async fn get(
        &mut self,
        pool: &Pool<DB>,
    ) -> Result<&mut PoolConnection<DB>, sqlx::Error> {
        let conn = self.get_for_claim(pool).await?;
        end_spare::<DB>(conn);
        Ok(conn)
    }

    /// [`get`](Self::get) for a delivery whose first statement is its claim's `BEGIN`
    /// ([`ClaimTx::begin`](crate::protocol::tx::ClaimTx::begin) on [`Hold::Kept`]
    /// (crate::protocol::tx::Hold::Kept)): a spare transaction left open by the previous
    /// delivery, begun less than [`SPARE_WINDOW`](Self::SPARE_WINDOW) ago, stays open for that
    /// claim to run in.
    pub(crate) async fn get_for_claim(
        &mut self,
        pool: &Pool<DB>,
    ) -> Result<&mut PoolConnection<DB>, sqlx::Error> {
        let max_hold = pool
            .options()
            .get_max_lifetime()
            .map_or(Self::MAX_HOLD, |lifetime| lifetime.min(Self::MAX_HOLD));
        let pool_id = std::ptr::from_ref(pool.options()) as usize;
        // Held too long, or taken from another pool (a slot used with another dispatcher):
        // give it back and take one from this pool.
        if self
            .held
            .as_ref()
            .is_some_and(|held| held.since.elapsed() >= max_hold || held.pool != pool_id)
        {
            self.held = None;
        }
        if let Some(held) = &mut self.held {
            let unused = held.used.elapsed();
            if unused >= Self::SPARE_WINDOW {
                // Its `now()` would be too early for this claim: its `ROLLBACK` goes out with
                // this claim's `BEGIN` (or with the ping).
                end_spare::<DB>(&mut held.conn);
            }
            if unused >= Self::IDLE_CHECK && held.conn.ping().await.is_err() {
                self.discard();
            }
        }
        let now = Instant::now();
        let held = match self.held.take() {
            Some(held) => held,
            None => Held {
                conn: pool.acquire().await?,
                pool: pool_id,
                since: now,
                used: now,
            },
        };
        let held = self.held.insert(held);
        held.used = now;
        Ok(&mut held.conn)
    }

    /// Closes the held connection instead of returning it to the pool: it was found broken.
    pub(crate) fn discard(&mut self) {
        if let Some(mut held) = self.held.take() {
            // The pool opens a replacement when one is needed; this one is not reused.
            held.conn.close_on_drop();
        }
    }

    /// Discards the held connection if `result` says it was lost; true if so.
    pub(crate) fn discard_if_lost<T>(&mut self, result: &Result<T, sqlx::Error>) -> bool {
        let lost = result.as_ref().is_err_and(connection_lost);
        if lost {
            self.discard();
        }
        lost
    }

    /// The slot, for one operation: if the operation's future is dropped before
    /// [`SlotGuard::done`], the connection goes back to the pool at once (which rolls back
    /// whatever transaction the dropped future left open, instead of holding its locks until
    /// the slot's next use).
    pub(crate) fn guard(&mut self) -> SlotGuard<'_, DB> {
        SlotGuard {
            slot: self,
            done: false,
        }
    }
}

impl<DB: Database> Drop for Held<DB> {
    /// A spare transaction does not go back to the pool: its `ROLLBACK` goes out with the
    /// pool's own check of the returned connection.
    fn drop(&mut self) {
        end_spare::<DB>(&mut self.conn);
    }
}

/// Ends the spare transaction open on `conn`, if any (sqlx's transaction depth above 0 between
/// the operations of a slot): its `ROLLBACK` is queued, sent with the connection's next
/// statement.
fn end_spare<DB: Database>(conn: &mut DB::Connection) {
    if DB::TransactionManager::get_transaction_depth(conn) > 0 {
        DB::TransactionManager::start_rollback(conn);
    }
}

impl<DB: Database> Default for ConnectionSlot<DB> {
    fn default() -> Self {
        Self::new()
    }
}

impl<DB: Database> fmt::Debug for ConnectionSlot<DB> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ConnectionSlot")
            .field("held", &self.is_held())
            .field("idle_for", &self.idle_for())
            .finish()
    }
}

/// A slot in use by one operation; see [`ConnectionSlot::guard`].
pub(crate) struct SlotGuard<'s, DB: Database> {
    slot: &'s mut ConnectionSlot<DB>,
    done: bool,
}

impl<DB: Database> SlotGuard<'_, DB> {
    /// The operation completed: the slot keeps its connection.
    pub(crate) fn done(mut self) {
        self.done = true;
    }
}

impl<DB: Database> Deref for SlotGuard<'_, DB> {
    type Target = ConnectionSlot<DB>;

    fn deref(&self) -> &Self::Target {
        self.slot
    }
}

impl<DB: Database> DerefMut for SlotGuard<'_, DB> {
    fn deref_mut(&mut self) -> &mut Self::Target {
        self.slot
    }
}

impl<DB: Database> Drop for SlotGuard<'_, DB> {
    fn drop(&mut self) {
        if !self.done {
            self.slot.release();
        }
    }
}

/// Whether `error` means the connection is gone: I/O or protocol failure, or the server closed
/// the session (PostgreSQL SQLSTATE class `08`, `57P01`–`57P03` shutdown or termination,
/// `57P05` `idle_session_timeout`, `25P03` `idle_in_transaction_session_timeout`).
pub(crate) fn connection_lost(error: &sqlx::Error) -> bool {
    match error {
        sqlx::Error::Io(_) | sqlx::Error::Protocol(_) | sqlx::Error::WorkerCrashed => true,
        sqlx::Error::Database(db) => db.code().is_some_and(|code| {
            matches!(&*code, "57P01" | "57P02" | "57P03" | "57P05" | "25P03")
                || code.starts_with("08")
        }),
        _ => false,
    }
}
