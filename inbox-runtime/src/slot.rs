//! A pooled connection held across deliveries, so that the pool's own round trips are paid once
//! per connection instead of once per message.

use std::fmt;
use std::time::{Duration, Instant};

use sqlx::pool::PoolConnection;
use sqlx::{Database, Pool};

/// One pooled connection, held across deliveries by one caller at a time: the argument of
/// [`Dispatcher::dispatch_on`](crate::Dispatcher::dispatch_on) and
/// [`Dispatcher::dispatch_batch_on`](crate::Dispatcher::dispatch_batch_on).
///
/// Why: sqlx's pool pings a connection when it hands it out (unless `test_before_acquire` is
/// off) and **always** when it is given back: two round trips to the database per acquire.
/// [`Dispatcher::dispatch`](crate::Dispatcher::dispatch) acquires once per envelope; a
/// consumer loop that dispatches on a slot pays them once per [`MAX_HOLD`](Self::MAX_HOLD) (5 minutes) instead.
/// The [`Worker`](crate::Worker) keeps one slot per concurrency slot.
///
/// The slot starts empty and acquires from the dispatcher's pool on first use. A connection
/// found broken (I/O or protocol error) is closed and replaced on the next use; one held longer
/// than [`MAX_HOLD`](Self::MAX_HOLD) goes back to the pool. Dropping the slot (or [`release`](Self::release))
/// gives the connection back to the pool.
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
    held: Option<(PoolConnection<DB>, Instant)>,
}

impl<DB: Database> ConnectionSlot<DB> {
    /// How long a slot keeps one connection before handing it back to the pool and taking
    /// another (so that the pool's `max_lifetime` still applies): 5 minutes.
    pub const MAX_HOLD: Duration = Duration::from_secs(300);

    /// An empty slot: it acquires a connection on first use.
    pub fn new() -> Self {
        Self { held: None }
    }

    /// Whether the slot holds a connection now.
    pub fn is_held(&self) -> bool {
        self.held.is_some()
    }

    /// Gives the held connection (if any) back to the pool.
    pub fn release(&mut self) {
        self.held = None;
    }

    /// The held connection, acquiring one from `pool` if the slot is empty or its connection
    /// was held for longer than [`MAX_HOLD`](Self::MAX_HOLD).
    pub(crate) async fn get(
        &mut self,
        pool: &Pool<DB>,
    ) -> Result<&mut PoolConnection<DB>, sqlx::Error> {
        if self
            .held
            .as_ref()
            .is_some_and(|(_, since)| since.elapsed() >= Self::MAX_HOLD)
        {
            self.held = None;
        }
        if self.held.is_none() {
            self.held = Some((pool.acquire().await?, Instant::now()));
        }
        let (conn, _) = self.held.as_mut().expect("acquired above");
        Ok(conn)
    }

    /// Closes the held connection instead of returning it to the pool: it was found broken.
    pub(crate) fn discard(&mut self) {
        if let Some((mut conn, _)) = self.held.take() {
            // The pool opens a replacement when one is needed; this one is not reused.
            conn.close_on_drop();
            drop(conn);
        }
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
            .finish()
    }
}
