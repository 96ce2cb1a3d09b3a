//! Messages, handlers and the claim-then-act wrapper every `#[idempotent]` function runs in.

use serde::Serialize;
use serde::de::DeserializeOwned;

use crate::BoxFuture;
use crate::envelope::SourceMetadata;
use crate::error::{Conflict, Error, StoreError};
use crate::fingerprint::Fingerprint;
use crate::key::{IdempotencyKey, KeyError};
use crate::outcome::Outcome;
use crate::store::{ClaimRequest, ClaimResult, InboxConnection};

/// A message type: its routing name and its idempotency key. Derive it with
/// [`#[derive(Message)]`](macro@crate::Message).
///
/// The payload is JSON (serde); `Clone` lets the dispatcher decode a payload once and hand each
/// consumer its own copy.
pub trait Message: Serialize + DeserializeOwned + Clone + Send + Sync + 'static {
    /// The routing name, matched against [`crate::Envelope::message_name`].
    const NAME: &'static str;

    /// The idempotency key of this message.
    ///
    /// # Errors
    /// A [`KeyError`] if the key is null, empty, too long or invalid.
    fn idempotency_key(&self) -> Result<IdempotencyKey, KeyError>;
}

/// The `Ok` and `Err` types of a handler's declared return type (any alias of `Result`).
#[doc(hidden)]
pub trait HandlerResult {
    type Ok;
    type Err;
}

impl<T, E> HandlerResult for Result<T, E> {
    type Ok = T;
    type Err = E;
}

/// One `#[idempotent]` function, as the macro describes it to the runtime.
#[doc(hidden)]
pub trait Handler: Send + Sync + 'static {
    /// The connection type of the handler's first parameter; decides the backend.
    type Connection: InboxConnection;
    /// The message type of the second parameter.
    type Message: Message;
    /// The handler's `Ok` type.
    type Output: Send + 'static;
    /// The handler's `Err` type.
    type Error: Send + 'static;
    /// The consumer name: the inbox scope of this handler.
    const CONSUMER: &'static str;
    /// Module path and name of the function, for diagnostics.
    const FUNCTION: &'static str;

    /// The idempotency key of `msg` for this handler.
    fn key(msg: &Self::Message) -> Result<IdempotencyKey, KeyError>;

    /// The original function body, run on the inbox transaction.
    fn call<'c>(
        conn: &'c mut Self::Connection,
        msg: Self::Message,
    ) -> BoxFuture<'c, Result<Self::Output, Self::Error>>;
}

/// Runs `H` on `msg` over `conn`: key, fingerprint, then [`run_claimed`]. What the rewritten
/// function calls.
#[doc(hidden)]
pub async fn run<H: Handler>(
    conn: &mut H::Connection,
    msg: H::Message,
) -> Result<Outcome<H::Output>, Error<H::Error>> {
    let key = H::key(&msg)?;
    let fingerprint = Fingerprint::of(&msg)?;
    run_claimed::<H>(conn, msg, &key, &fingerprint, None).await
}

/// The transaction: BEGIN, claim, body, COMMIT — or ROLLBACK on a duplicate, a conflict or a
/// handler error.
pub(crate) async fn run_claimed<H: Handler>(
    conn: &mut H::Connection,
    msg: H::Message,
    key: &IdempotencyKey,
    fingerprint: &Fingerprint,
    source: Option<&SourceMetadata>,
) -> Result<Outcome<H::Output>, Error<H::Error>> {
    let store_error = |operation: &'static str| {
        move |source: sqlx::Error| StoreError {
            consumer: H::CONSUMER,
            key: key.clone(),
            operation,
            source,
        }
    };
    let payload_hash = fingerprint.to_hex();
    let request = ClaimRequest {
        consumer: H::CONSUMER,
        message_key: key.as_str(),
        message_name: <H::Message as Message>::NAME,
        payload_hash: &payload_hash,
        source,
    };

    let mut tx = conn.begin_inbox().await.map_err(store_error("begin"))?;
    let claimed = H::Connection::in_transaction(&mut tx).claim(&request).await;
    let existing = match claimed {
        Ok(ClaimResult::Claimed) => None,
        Ok(ClaimResult::Existing { payload_hash, .. }) => Some(payload_hash),
        Err(source) => {
            // The claim failed: nothing of ours is written. Roll back explicitly (a rollback on
            // drop is deferred and reports nothing); the claim's error is the one to report.
            let _ = tx.rollback().await;
            return Err(store_error("claim")(source).into());
        }
    };
    if let Some(stored_hash) = existing {
        tx.rollback().await.map_err(store_error("rollback"))?;
        if stored_hash == payload_hash {
            return Ok(Outcome::Duplicate);
        }
        let stored = Fingerprint::from_hex(&stored_hash).ok_or_else(|| {
            store_error("claim")(sqlx::Error::Decode(
                format!("stored payload_hash {stored_hash:?} is not a SHA-256 hex digest").into(),
            ))
        })?;
        return Err(Conflict {
            consumer: H::CONSUMER,
            message_name: <H::Message as Message>::NAME,
            key: key.clone(),
            stored,
            received: *fingerprint,
        }
        .into());
    }

    match H::call(H::Connection::in_transaction(&mut tx), msg).await {
        Ok(value) => {
            tx.commit().await.map_err(store_error("commit"))?;
            Ok(Outcome::Processed(value))
        }
        Err(error) => {
            // The handler's error is what the caller needs; a failing rollback means the
            // connection is gone, and the server rolls the transaction back with it.
            let _ = tx.rollback().await;
            Err(Error::Handler(error))
        }
    }
}
