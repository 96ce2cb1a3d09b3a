//! What an `#[idempotent]` function calls: one delivery through the claim protocol, then the
//! parked successors it made applicable.

use crate::error::Error;
use crate::fingerprint::Fingerprint;
use crate::message::Message;
use crate::ordering::GapPolicy;
use crate::outcome::Outcome;
use crate::policy::RetryPolicy;
use crate::protocol::park::apply_parked_successors;
use crate::protocol::single::{Delivery, Handler, run_delivery};
use crate::registry::GlobalRoutes;
use crate::status::ClaimMode;
use crate::store::InboxConnection;

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
    let delivery = Delivery {
        key: &key,
        fingerprint: &fingerprint,
        source: None,
        payload: None,
        policy: &policy,
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
