//! The handler's side: the claim's transaction, handed over in the request's extensions.

use std::ops::{Deref, DerefMut};
use std::sync::{Arc, Mutex};

use axum::extract::FromRequestParts;
use axum::response::{IntoResponse, Response};
use http::StatusCode;
use http::request::Parts;

use crate::debug::some_fields;
use crate::protocol::session::ClaimedKey;
use crate::protocol::tx::ClaimTx;
use crate::store::InboxDatabase;
use crate::types::key::IdempotencyKey;
use crate::types::step_key::StepKey;

use super::problem::Problem;

/// The transaction a request runs in: the claim of its idempotency key, or (a request without
/// a key where the key is optional) a plain transaction.
pub(crate) enum Held<DB: InboxDatabase> {
    Claimed(Box<ClaimedKey<'static, DB::Connection>>),
    Plain(ClaimTx<'static, DB::Connection>),
}

impl<DB: InboxDatabase> Held<DB> {
    fn connection(&mut self) -> &mut DB::Connection {
        match self {
            Held::Claimed(claim) => claim.connection(),
            Held::Plain(tx) => tx.conn(),
        }
    }

    fn connection_ref(&self) -> &DB::Connection {
        match self {
            Held::Claimed(claim) => claim.connection_ref(),
            Held::Plain(tx) => tx.conn_ref(),
        }
    }
}

/// Where the layer puts the request's transaction (`T`: the SQL stores' [`Held`], DynamoDB's
/// `DynamoTx`) for the handler, and takes it back from after the handler returned: a request
/// extension shared by both.
pub(crate) struct Slot<T>(Arc<SlotInner<T>>);

/// The SQL stores' slot.
pub(crate) type TxSlot<DB> = Slot<Held<DB>>;

pub(crate) struct SlotInner<T> {
    held: Mutex<Option<T>>,
    scope: String,
    key: Option<IdempotencyKey>,
}

impl<T> Clone for Slot<T> {
    fn clone(&self) -> Self {
        Self(Arc::clone(&self.0))
    }
}

impl<T: Send + 'static> Slot<T> {
    pub(crate) fn new(held: T, scope: String, key: Option<IdempotencyKey>) -> Self {
        Self(Arc::new(SlotInner {
            held: Mutex::new(Some(held)),
            scope,
            key,
        }))
    }

    /// The transaction, if it is in the slot (not taken by a live extractor).
    pub(crate) fn take(&self) -> Option<T> {
        self.0.held.lock().unwrap_or_else(|e| e.into_inner()).take()
    }

    fn put(&self, held: T) {
        *self.0.held.lock().unwrap_or_else(|e| e.into_inner()) = Some(held);
    }

    pub(crate) fn scope(&self) -> &str {
        &self.0.scope
    }

    pub(crate) fn key(&self) -> Option<&IdempotencyKey> {
        self.0.key.as_ref()
    }
}

/// A transaction taken from its [`Slot`] by an extractor, given back when dropped.
pub(crate) struct Taken<T: Send + 'static> {
    held: Option<T>,
    pub(crate) slot: Slot<T>,
}

impl<T: Send + 'static> Taken<T> {
    /// Takes the transaction of the request's slot.
    pub(crate) fn from_parts(parts: &Parts) -> Result<Self, MissingTransaction> {
        let slot = parts
            .extensions
            .get::<Slot<T>>()
            .cloned()
            .ok_or(MissingTransaction::NotBehindLayer)?;
        let held = slot.take().ok_or(MissingTransaction::AlreadyTaken)?;
        Ok(Self {
            held: Some(held),
            slot,
        })
    }

    pub(crate) fn get(&self) -> &T {
        self.held
            .as_ref()
            .expect("an extractor holds its transaction until dropped")
    }

    pub(crate) fn get_mut(&mut self) -> &mut T {
        self.held
            .as_mut()
            .expect("an extractor holds its transaction until dropped")
    }

    /// The idempotency key of step `step` of this request ([`StepKey::new`]`(scope, key,
    /// step)`); `None` without a key.
    pub(crate) fn step_key(&self, step: &str) -> Option<StepKey> {
        self.slot
            .key()
            .map(|key| StepKey::new(self.slot.scope(), key.as_str(), step))
    }
}

/// Gives the transaction back to the layer.
impl<T: Send + 'static> Drop for Taken<T> {
    fn drop(&mut self) {
        if let Some(held) = self.held.take() {
            self.slot.put(held);
        }
    }
}

/// The accessors every store's extractor shares (`key`, `scope`, `step_key`), written once:
/// expanded in the `impl` of an extractor whose field `taken` is a [`Taken`].
macro_rules! extractor_accessors {
    () => {
        /// The request's idempotency key (the `Idempotency-Key` as the client sent it, unquoted),
        /// or `None` for a request without one (where the key is optional).
        pub fn key(&self) -> Option<&$crate::types::key::IdempotencyKey> {
            self.taken.slot.key()
        }

        /// The scope the key is claimed in: `http <METHOD> <route>`, then a space and the
        /// principal if there is one.
        pub fn scope(&self) -> &str {
            self.taken.slot.scope()
        }

        /// The idempotency key of step `step` of this request, for a call to another service: the
        /// same for every retry of the request with its `Idempotency-Key`
        /// ([`StepKey::new`](crate::types::step_key::StepKey::new)`(scope, key, step)`); `None`
        /// without a key.
        pub fn step_key(&self, step: &str) -> Option<$crate::types::step_key::StepKey> {
            self.taken.step_key(step)
        }
    };
}
#[cfg(feature = "dynamodb")]
pub(crate) use extractor_accessors;

/// The request's database transaction, for a handler behind
/// [`IdempotencyLayer`](super::IdempotencyLayer): an axum extractor.
///
/// Run your writes on it (`&mut *tx` is a `&mut PgConnection` / `&mut SqliteConnection`). The
/// layer commits them **together with the stored response** after the handler returned — the
/// claim of the `Idempotency-Key`, the handler's writes and the response commit in one
/// transaction, or none of them does:
///
/// * the handler returns a response whose status the layer stores (2xx, 3xx, 4xx but 408, 409,
///   425 and 429, by default): `COMMIT` — writes, key and response;
/// * any other status (5xx, 409, 429…), a handler error turned into such a status, a panic, a
///   response body larger than the limit: `ROLLBACK` — no write, and the key stays free, so a
///   retry with the same key runs the handler again.
///
/// Do not commit or roll back yourself (there is no method for it), and do not keep the
/// transaction beyond the handler (a spawned task holding it makes the request fail with 500
/// and roll back). Nested transactions (`sqlx::Connection::begin` on it) are savepoints.
///
/// Without a key (only where [`IdempotencyLayer::require_key`](super::IdempotencyLayer::require_key)
/// is `false`), the handler gets a plain transaction with the same commit rule; nothing is
/// stored. On a route or method the layer does not cover, extracting it fails with a 500
/// problem response ([`MissingTransaction`]).
///
/// ```no_run
/// use axum::{Json, Router, http::StatusCode, routing::post};
/// use inbox_runtime::http::{IdempotencyLayer, IdempotencyTx};
/// use sqlx::Sqlite;
///
/// #[derive(serde::Deserialize)]
/// struct NewPayment { account: String, amount_cents: i64 }
///
/// async fn create(
///     mut tx: IdempotencyTx<Sqlite>,
///     Json(payment): Json<NewPayment>,
/// ) -> Result<(StatusCode, Json<serde_json::Value>), StatusCode> {
///     let id = uuid::Uuid::now_v7().to_string();
///     sqlx::query("INSERT INTO payments (id, account, amount_cents) VALUES ($1, $2, $3)")
///         .bind(&id)
///         .bind(&payment.account)
///         .bind(payment.amount_cents)
///         .execute(&mut *tx)
///         .await
///         .map_err(|_| StatusCode::INTERNAL_SERVER_ERROR)?; // 500: rolled back, not stored
///     Ok((StatusCode::CREATED, Json(serde_json::json!({ "id": id }))))
/// }
///
/// # async fn demo(pool: sqlx::SqlitePool) {
/// let app: Router = Router::new()
///     .route("/payments", post(create))
///     .route_layer(IdempotencyLayer::new(pool));
/// # }
/// ```
pub struct IdempotencyTx<DB: InboxDatabase> {
    taken: Taken<Held<DB>>,
}

impl<DB: InboxDatabase> IdempotencyTx<DB> {
    /// The connection, inside the request's transaction (also reachable as `&mut *tx`).
    pub fn connection(&mut self) -> &mut DB::Connection {
        self.taken.get_mut().connection()
    }

    extractor_accessors!();
}

impl<DB: InboxDatabase> Deref for IdempotencyTx<DB> {
    type Target = DB::Connection;

    fn deref(&self) -> &Self::Target {
        self.taken.get().connection_ref()
    }
}

impl<DB: InboxDatabase> DerefMut for IdempotencyTx<DB> {
    fn deref_mut(&mut self) -> &mut Self::Target {
        self.connection()
    }
}

impl<DB: InboxDatabase> std::fmt::Debug for IdempotencyTx<DB> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        some_fields(
            f,
            "IdempotencyTx",
            &[("scope", &self.scope()), ("key", &self.key())],
        )
    }
}

/// Why [`IdempotencyTx`] could not be extracted: the request is not behind the layer (another
/// route, a method the layer does not cover), or the handler extracted it twice. Answered with
/// a `500` problem response: it is a bug in the application, not in the request.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum MissingTransaction {
    /// No transaction of this database in the request: the route or the method is not covered
    /// by an `IdempotencyLayer` of that database.
    #[error(
        "no idempotency transaction for this request: the route or method is not behind an IdempotencyLayer of this database"
    )]
    NotBehindLayer,
    /// The handler already took the transaction (two `IdempotencyTx` arguments).
    #[error("the idempotency transaction was already taken by another extractor of this request")]
    AlreadyTaken,
}

impl IntoResponse for MissingTransaction {
    fn into_response(self) -> Response {
        Problem::new(
            StatusCode::INTERNAL_SERVER_ERROR,
            "transaction-unavailable",
            "Idempotency transaction unavailable",
            self.to_string(),
        )
        .into_response(super::DEFAULT_PROBLEM_BASE)
    }
}

impl<S, DB> FromRequestParts<S> for IdempotencyTx<DB>
where
    S: Send + Sync,
    DB: InboxDatabase,
{
    type Rejection = MissingTransaction;

    async fn from_request_parts(parts: &mut Parts, _state: &S) -> Result<Self, Self::Rejection> {
        Taken::from_parts(parts).map(|taken| Self { taken })
    }
}
