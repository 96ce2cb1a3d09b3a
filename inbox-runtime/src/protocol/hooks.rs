//! Hooks in the claim's transaction: code that must commit with the effect (an outbox enqueue,
//! a Kafka position update) runs on the claim's connection before `COMMIT`; code that must only
//! see committed state (a cache fill, a relay wake-up) runs after it.

use std::sync::Arc;

use crate::BoxFuture;
use crate::store::{AnyConnection, InboxConnection, InboxDatabase};
use crate::types::classify::BoxError;
use crate::types::envelope::SourceMetadata;

/// The claim a hook runs for: one consumer's processing of one message (or, on the HTTP layer,
/// one request).
#[derive(Debug, Clone, Copy)]
#[non_exhaustive]
pub struct ClaimInfo<'a> {
    /// The consumer (inbox scope; for an HTTP request, `http <METHOD> <route>` and the
    /// principal, if any).
    pub consumer: &'a str,
    /// The idempotency key (empty for an HTTP request without one, where the HTTP layer's key
    /// is optional).
    pub key: &'a str,
    /// The message's routing name (for an HTTP request, its method and target:
    /// `POST /orders?draft=1`).
    pub message_name: &'a str,
    /// The payload as delivered (JSON bytes), when the message came through the dispatcher;
    /// `None` for a handler called directly, and for HTTP requests.
    pub payload: Option<&'a [u8]>,
    /// Where the delivery came from, if the source said.
    pub source: Option<&'a SourceMetadata>,
}

/// The error a [`TransactionHook::before_commit`] returns when the claim's transaction must not
/// commit because the delivery no longer belongs to this consumer: its source partition was
/// assigned to another consumer since it was fetched (this one is a **zombie**), as a fenced
/// position write
/// ([`PositionStore::advance_position`](crate::store::PositionStore::advance_position)) found.
///
/// Unlike any other hook error, nothing is recorded for it: the transaction (claim, handler
/// writes, hook writes) rolls back, the attempt does not count, and the key stays as it was
/// (free, or `failed` as before) for the partition's new owner, which delivers the record again.
/// The consumer's result is [`Error::Hook`](crate::Error::Hook) with
/// [`Disposition::NotRecorded`](crate::Disposition::NotRecorded) and this error as its source
/// ([`HookError::is_fenced`](crate::HookError::is_fenced)); the [`Worker`](crate::Worker)
/// drops such a delivery unsettled (not acked, not dead-lettered, not requeued) and counts it in
/// [`WorkerReport::fenced`](crate::WorkerReport::fenced).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "fenced: {source_name} partition {partition} is now owned by another consumer (this one held epoch {epoch}); rolled back"
)]
#[non_exhaustive]
pub struct Fenced {
    /// The source the delivery came from (a topic).
    pub source_name: String,
    /// The partition.
    pub partition: String,
    /// The epoch this consumer held when it fetched the delivery.
    pub epoch: i64,
}

impl Fenced {
    /// A fenced delivery of `source_name`'s `partition`, fetched under `epoch`.
    pub fn new(source_name: impl Into<String>, partition: impl Into<String>, epoch: i64) -> Self {
        Self {
            source_name: source_name.into(),
            partition: partition.into(),
            epoch,
        }
    }

    /// Whether `error` is (or wraps, anywhere in its source chain) a [`Fenced`].
    pub fn is_in(error: &(dyn std::error::Error + 'static)) -> bool {
        let mut next = Some(error);
        while let Some(error) = next {
            if error.is::<Fenced>() {
                return true;
            }
            next = error.source();
        }
        false
    }
}

/// Code that runs inside the claim's transaction, after the handler body and before `COMMIT`,
/// and after the commit. Configure it on a [`Dispatcher`](crate::Dispatcher) with
/// [`with_hook`](crate::Dispatcher::with_hook); it runs for every message the dispatcher
/// processes (single deliveries, batches, replays and parked successors alike), once per
/// consumer whose handler ran and returned `Ok`. The HTTP layer takes the same hooks
/// (`IdempotencyLayer::with_hook`, feature `http`), for each request whose response it stores.
///
/// * [`before_commit`](Self::before_commit) writes on the claim's connection: its writes commit
///   or roll back with the claim and the handler's. An error rolls the whole transaction back;
///   the attempt is recorded as failed (retryable) and reported as
///   [`Error::Hook`](crate::Error::Hook) — except a [`Fenced`] error, for which nothing is
///   recorded.
/// * [`after_commit`](Self::after_commit) runs after the transaction committed, never before:
///   nothing is announced that could still roll back. It must not fail or block (spawn what
///   takes time).
///
/// Duplicates, conflicts, stale and parked messages run no hook: nothing is processed for them.
///
/// ```no_run
/// use inbox_runtime::{BoxError, BoxFuture, ClaimInfo, Dispatcher, TransactionHook};
///
/// /// Records every processed message in an audit table, in the same transaction.
/// struct Audit;
///
/// impl TransactionHook<sqlx::Postgres> for Audit {
///     fn before_commit<'c>(
///         &'c self,
///         conn: &'c mut sqlx::PgConnection,
///         claim: &'c ClaimInfo<'c>,
///     ) -> BoxFuture<'c, Result<(), BoxError>> {
///         Box::pin(async move {
///             sqlx::query("INSERT INTO audit (consumer, message_key) VALUES ($1, $2)")
///                 .bind(claim.consumer)
///                 .bind(claim.key)
///                 .execute(conn)
///                 .await?;
///             Ok(())
///         })
///     }
/// }
///
/// # fn demo(pool: sqlx::PgPool) -> Result<(), inbox_runtime::RegistryError> {
/// let dispatcher = Dispatcher::from_registry(pool)?.with_hook(Audit);
/// # Ok(()) }
/// ```
pub trait TransactionHook<DB: InboxDatabase>: Send + Sync + 'static {
    /// Runs on the claim's transaction after the handler body returned `Ok`, before `COMMIT`.
    /// The default does nothing.
    ///
    /// # Errors
    /// Any error: the transaction rolls back and the attempt is recorded as failed.
    fn before_commit<'c>(
        &'c self,
        conn: &'c mut DB::Connection,
        claim: &'c ClaimInfo<'c>,
    ) -> BoxFuture<'c, Result<(), BoxError>> {
        let _ = (conn, claim);
        Box::pin(async { Ok(()) })
    }

    /// Runs after the claim's transaction committed. The default does nothing.
    fn after_commit(&self, claim: &ClaimInfo<'_>) {
        let _ = claim;
    }
}

/// A dispatcher's hooks, in the order they were added, with the backend erased for the
/// protocol's drivers.
pub(crate) struct Hooks<DB: InboxDatabase> {
    list: Vec<Arc<dyn TransactionHook<DB>>>,
}

impl<DB: InboxDatabase> Clone for Hooks<DB> {
    fn clone(&self) -> Self {
        Self {
            list: self.list.clone(),
        }
    }
}

impl<DB: InboxDatabase> Default for Hooks<DB> {
    fn default() -> Self {
        Self { list: Vec::new() }
    }
}

impl<DB: InboxDatabase> Hooks<DB> {
    pub(crate) fn push(&mut self, hook: Arc<dyn TransactionHook<DB>>) {
        self.list.push(hook);
    }

    /// The hooks as the protocol's drivers run them: `None` when there are none (nothing to
    /// call).
    pub(crate) fn runner(&self) -> Option<&dyn HookRunner> {
        if self.list.is_empty() {
            None
        } else {
            Some(self)
        }
    }
}

/// Hooks as the protocol's drivers run them, whatever the backend.
pub(crate) trait HookRunner: Send + Sync {
    /// Every hook's `before_commit`, in order; the first error stops them.
    fn before_commit<'c>(
        &'c self,
        conn: AnyConnection<'c>,
        claim: &'c ClaimInfo<'c>,
    ) -> BoxFuture<'c, Result<(), BoxError>>;

    /// Every hook's `after_commit`, in order.
    fn after_commit(&self, claim: &ClaimInfo<'_>);
}

impl<DB: InboxDatabase> HookRunner for Hooks<DB> {
    fn before_commit<'c>(
        &'c self,
        conn: AnyConnection<'c>,
        claim: &'c ClaimInfo<'c>,
    ) -> BoxFuture<'c, Result<(), BoxError>> {
        Box::pin(async move {
            let conn = <DB::Connection as InboxConnection>::from_any(conn)
                .ok_or("a hook got a connection of another backend")?;
            for hook in &self.list {
                hook.before_commit(conn, claim).await?;
            }
            Ok(())
        })
    }

    fn after_commit(&self, claim: &ClaimInfo<'_>) {
        for hook in &self.list {
            hook.after_commit(claim);
        }
    }
}
