//! Parked messages and replays: stored messages run again through the same claim, and the
//! parked successors of an applied message released in order.

use super::erased::{DynHandler, decode_stored};
use super::hooks::HookRunner;
use super::single::AttemptPlan;
use super::tx::Owner;
use crate::store::{AnyConnection, InboxConnection, StoredMessage};
use crate::types::classify::BoxError;
use crate::types::error::{Error, ReplayError};
use crate::types::ordering::Ordering;
use crate::types::outcome::Outcome;
use crate::types::policy::RetryPolicy;
use crate::types::status::ClaimMode;

/// Which handler runs a stored message of a consumer: the dispatcher's own routes, or (for a
/// handler called directly) every handler linked into the program.
pub(crate) trait Routes: Sync {
    /// The handler of `consumer` for `message_name`, if there is one.
    fn route(&self, consumer: &str, message_name: &str) -> Option<&'static dyn DynHandler>;
}

/// Runs a stored (failed, dead or parked) message through its handler in `mode`.
pub(crate) async fn run_stored(
    handler: &'static dyn DynHandler,
    conn: AnyConnection<'_>,
    stored: &StoredMessage,
    mode: ClaimMode,
    policy: &RetryPolicy,
    hooks: Option<&dyn HookRunner>,
) -> Result<Result<Outcome<()>, Error<BoxError>>, ReplayError> {
    let payload = stored
        .payload
        .as_deref()
        .ok_or_else(|| ReplayError::NoPayload {
            consumer: stored.consumer.clone(),
            key: stored.message_key.clone(),
            status: stored.status.to_string(),
        })?;
    let decoded = decode_stored(handler, &stored.message_key, payload)?;
    let delivery = AttemptPlan {
        key: &decoded.key,
        fingerprint: &decoded.fingerprint,
        source: None,
        headers: None,
        payload: Some(payload),
        policy,
        // Replays and parked successors are rare: they end their transactions on the
        // connection at once, wherever it comes from.
        owner: Owner::Caller,
        mode,
        ordering: decoded.ordering.as_ref(),
        hooks,
    };
    Ok(handler.invoke(conn, &*decoded.msg, &delivery).await)
}

/// After `ordering` was applied: applies, in order, each parked successor of its aggregate
/// (sequence + 1, + 2, …), each in its own transaction, until one is missing or does not apply.
/// Problems are logged, not returned: the message that triggered this was processed.
pub(crate) async fn apply_parked_successors<C: InboxConnection>(
    conn: &mut C,
    routes: &dyn Routes,
    consumer: &str,
    ordering: &Ordering,
    policy: &RetryPolicy,
    hooks: Option<&dyn HookRunner>,
) {
    let mut sequence = ordering.sequence;
    loop {
        let next = async {
            let Some(parked) = conn
                .find_parked(consumer, &ordering.aggregate_id, sequence + 1)
                .await?
            else {
                return Ok(None);
            };
            let stored = conn.fetch_message(consumer, &parked.message_key).await?;
            Ok::<_, sqlx::Error>(stored.map(|stored| (parked, stored)))
        }
        .await;
        let (parked, stored) = match next {
            Ok(Some(found)) => found,
            Ok(None) => return,
            Err(error) => {
                tracing::warn!(%error, consumer, "cannot look up parked successors");
                return;
            }
        };
        let Some(handler) = routes.route(consumer, &parked.message_name) else {
            tracing::warn!(
                consumer,
                message = parked.message_name,
                "parked message has no registered handler"
            );
            return;
        };
        match run_stored(
            handler,
            conn.as_any(),
            &stored,
            ClaimMode::Resume,
            policy,
            hooks,
        )
        .await
        {
            Ok(Ok(Outcome::Processed(()))) => sequence += 1,
            Ok(other) => {
                tracing::info!(
                    consumer,
                    key = parked.message_key,
                    outcome = ?other.map(|o| o.kind()).map_err(|e| e.kind()),
                    "parked successor not applied"
                );
                return;
            }
            Err(error) => {
                tracing::warn!(%error, consumer, key = parked.message_key, "parked successor cannot run");
                return;
            }
        }
    }
}
