//! What an `#[idempotent]` function calls: one delivery through the claim protocol, then the
//! parked successors it made applicable.

use crate::dispatch::registry::GlobalRoutes;
use crate::protocol::park::apply_parked_successors;
use crate::protocol::single::{AttemptPlan, Handler, run_delivery};
use crate::protocol::tx::Owner;
use crate::store::InboxConnection;
use crate::types::error::Error;
use crate::types::fingerprint::Fingerprint;
use crate::types::message::Message;
use crate::types::ordering::GapPolicy;
use crate::types::outcome::Outcome;
use crate::types::policy::RetryPolicy;
use crate::types::status::ClaimMode;

/// Runs `H` on `msg` over `conn` with the default [`RetryPolicy`]: what the rewritten function
/// calls. Parked successors are run by the handlers registered in the program (a direct call
/// has no dispatcher of its own to route them).
#[doc(hidden)]
pub async fn run<H: Handler>(
    conn: &mut H::Connection,
    msg: H::Message,
) -> Result<Outcome<H::Output>, Error<H::Error>> {
    let key = H::key(&msg)?;
    let ordering = H::ordering(&msg)?;
    let fingerprint = Fingerprint::of(<H::Message as Message>::NAME, &msg)?;
    let policy = RetryPolicy::default();
    let delivery = AttemptPlan {
        key: &key,
        fingerprint: &fingerprint,
        source: None,
        headers: None,
        payload: None,
        policy: &policy,
        owner: Owner::Caller,
        mode: ClaimMode::Deliver,
        ordering: ordering.as_ref(),
        hooks: None,
    };
    let result = run_delivery::<H>(conn, &msg, &delivery).await;
    // After a duplicate too: it releases successors left parked by a run that stopped between
    // its commit and their release (see `Dispatcher::run_item`).
    if let (Ok(Outcome::Processed(_) | Outcome::Duplicate), Some(ordering)) = (&result, &ordering)
        && H::GAPS == GapPolicy::Park
    {
        let routes = GlobalRoutes(<H::Connection as InboxConnection>::BACKEND);
        apply_parked_successors(conn, &routes, H::CONSUMER, ordering, &policy, None).await;
    }
    result
}
