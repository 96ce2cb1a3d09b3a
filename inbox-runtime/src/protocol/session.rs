//! The public claim session: the claim protocol without a macro, for code that is not a
//! message handler (an HTTP request with an `Idempotency-Key`, a relay, a custom consumer).

use std::collections::HashMap;
use std::sync::{LazyLock, Mutex};

use super::failure::{Attempt, Subject, aborted_transaction_text};
use super::hooks::{ClaimInfo, HookRunner};
use super::machine::{Claimed, Opened, Uncommitted, commit, open, peek};
use super::tx::{ClaimTx, Hold, Verify};
use super::{Decision, Wait};
use crate::debug::some_fields;
use crate::setters::setters;
use crate::store::{ClaimRequest, InboxConnection};
use crate::types::classify::ErrorClass;
use crate::types::envelope::SourceMetadata;
use crate::types::error::{Conflict, Disposition, StoreError, StoreOperation};
use crate::types::fingerprint::Fingerprint;
use crate::types::key::IdempotencyKey;
use crate::types::outcome::Outcome;
use crate::types::policy::RetryPolicy;
use crate::types::status::{ClaimMode, Status};

/// A claim to open: an idempotency key in a scope, with the fingerprint of what is being done
/// under it. The same protocol `#[idempotent]` handlers run on, without the macro.
///
/// * `scope` is the inbox scope (a consumer name for messages; for HTTP, say, the principal and
///   route): keys are unique per scope. Any runtime string.
/// * `name` names what is claimed (a message name, `POST /orders`); it is stored with the key.
/// * `fingerprint` identifies the payload: the same key with another fingerprint is a
///   [`ClaimState::Conflict`]. [`Fingerprint::of`] computes one over canonical JSON.
///
/// [`open`](Self::open) claims the key as the first statement of a new transaction on the
/// connection and returns a [`ClaimState`]: the key is yours ([`ClaimedKey`]: run your writes
/// on its connection, then [`complete`](ClaimedKey::complete) or [`fail`](ClaimedKey::fail)),
/// or it was settled before ([`Settled`], with the result stored then), or it conflicts, or
/// (with [`Wait::NoWait`]) another transaction holds it right now.
///
/// ```no_run
/// use inbox_runtime::{ClaimSession, ClaimState, Fingerprint, IdempotencyKey, Wait};
///
/// # async fn demo(pool: sqlx::PgPool) -> Result<(), Box<dyn std::error::Error>> {
/// let key = IdempotencyKey::new("order-42-charge", "POST /charges", "Idempotency-Key")?;
/// let body = serde_json::json!({"order": 42, "amount_cents": 1500});
/// let fingerprint = Fingerprint::of("POST /charges", &body)?;
/// let mut conn = pool.acquire().await?;
/// let session = ClaimSession::new("tenant-7", &key, "POST /charges", fingerprint).wait(Wait::NoWait);
/// match session.open(&mut *conn).await? {
///     ClaimState::Claimed(mut claim) => {
///         sqlx::query("INSERT INTO charges (order_id, amount_cents) VALUES (42, 1500)")
///             .execute(claim.connection())
///             .await?;
///         claim.complete(Some(br#"{"status":201}"#)).await?; // commits writes, claim and result
///     }
///     ClaimState::Settled(settled) => println!("done before: {:?}", settled.result),
///     ClaimState::Conflict(conflict) => println!("same key, other request: {conflict}"),
///     ClaimState::InProgress => println!("still running elsewhere: try again later"),
///     _ => {}
/// }
/// # Ok(()) }
/// ```
#[derive(Debug, Clone)]
pub struct ClaimSession<'a> {
    scope: &'a str,
    key: &'a IdempotencyKey,
    name: &'a str,
    fingerprint: Fingerprint,
    wait: Wait,
    policy: Option<&'a RetryPolicy>,
    source: Option<&'a SourceMetadata>,
}

/// What [`ClaimSession::open`] found.
#[derive(Debug)]
#[non_exhaustive]
#[must_use = "a claimed key must be completed or failed, or its transaction rolls back"]
pub enum ClaimState<'c, C: InboxConnection> {
    /// The key is claimed by an open transaction on the connection: run your writes on
    /// [`ClaimedKey::connection`], then complete or fail it.
    Claimed(ClaimedKey<'c, C>),
    /// The key was settled before with the same fingerprint: nothing to do again. Carries the
    /// stored status and result.
    Settled(Settled),
    /// The key was claimed before with a *different* fingerprint. Nothing ran, nothing was
    /// written.
    Conflict(Conflict),
    /// Another transaction holds the key uncommitted right now ([`Wait::NoWait`] only): its
    /// outcome is not known yet. Nothing was written.
    InProgress,
    /// The key's last attempt failed ([`ClaimedKey::fail`]) and its next attempt is not due
    /// yet: try again after `retry_in`. Nothing was written.
    NotYet {
        /// How long until the next attempt is due (database clock).
        retry_in: std::time::Duration,
        /// Attempts so far.
        attempts: u32,
    },
}

/// A key settled by an earlier claim.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct Settled {
    /// Its state: `processed` for a completed claim; `dead`, `discarded`, `stale` or `parked`
    /// for message keys settled otherwise.
    pub status: Status,
    /// The fingerprint stored with it (equal to the session's).
    pub fingerprint: Fingerprint,
    /// Attempts that ran for it.
    pub attempts: u32,
    /// The result stored by [`ClaimedKey::complete`], if any (read only for `processed` keys).
    pub result: Option<Vec<u8>>,
}

impl<'a> ClaimSession<'a> {
    /// A claim of `key` in `scope` for `name` with `fingerprint`; waits for a concurrent holder
    /// of the key ([`Wait::Block`]) and uses the default [`RetryPolicy`] for failures.
    pub fn new(
        scope: &'a str,
        key: &'a IdempotencyKey,
        name: &'a str,
        fingerprint: Fingerprint,
    ) -> Self {
        Self {
            scope,
            key,
            name,
            fingerprint,
            wait: Wait::Block,
            policy: None,
            source: None,
        }
    }

    setters! {
        /// Whether to wait for a concurrent holder of the key (see [`Wait`]).
        pub fn wait(wait: Wait);

        /// The retry policy for [`ClaimedKey::fail`]: attempts before `dead`, delays between them.
        pub fn retry_policy(policy: &'a RetryPolicy) {
            self.policy = Some(policy);
        }

        /// Where the work came from, stored with the key.
        pub fn source(source: &'a SourceMetadata) {
            self.source = Some(source);
        }
    }

    /// Opens the claim on `conn`: `BEGIN` (a savepoint if `conn` is already inside a
    /// transaction opened through sqlx, `conn.begin()` / `pool.begin()`), then the claim
    /// statement. A `failed` key with the same fingerprint is claimed again (its retry) once its
    /// next attempt is due.
    ///
    /// Do not open a session on a connection where you sent `BEGIN` yourself as a statement:
    /// sqlx does not see such a transaction, so the session would send its own `BEGIN`
    /// (PostgreSQL only warns) and its `COMMIT` would commit yours; SQLite refuses it
    /// ([`StoreOperation::Begin`]). The same holds for `#[idempotent]` functions called directly.
    ///
    /// # Errors
    /// [`StoreError`] if the database fails ([`StoreOperation::Begin`],
    /// [`StoreOperation::Claim`] or [`StoreOperation::Rollback`]); nothing was written.
    pub async fn open<'c, C: InboxConnection>(
        &self,
        conn: &'c mut C,
    ) -> Result<ClaimState<'c, C>, StoreError> {
        self.open_with(Hold::Borrowed(conn)).await
    }

    /// [`open`](Self::open) on a connection the claim takes ownership of — a pooled connection
    /// (`pool.acquire().await?`), or any owned handle that derefs to one — so that a
    /// [`ClaimedKey`] is `'static`: it can be moved into another task, or into a request's
    /// extensions (what the HTTP layer does). The connection goes with the claim state: dropped
    /// (a pooled one back to its pool) when the [`ClaimedKey`] or the state is dropped, after
    /// its transaction ended.
    ///
    /// ```no_run
    /// use inbox_runtime::{ClaimSession, ClaimState, Fingerprint, IdempotencyKey};
    ///
    /// # async fn demo(pool: sqlx::SqlitePool) -> Result<(), Box<dyn std::error::Error>> {
    /// let key = IdempotencyKey::new("export-7", "exports", "job id")?;
    /// let fingerprint = Fingerprint::of("exports", &serde_json::json!({"job": 7}))?;
    /// let session = ClaimSession::new("exports", &key, "exports", fingerprint);
    /// if let ClaimState::Claimed(mut claim) = session.open_owned(pool.acquire().await?).await? {
    ///     // A `ClaimedKey<'static, SqliteConnection>`: it may outlive this scope.
    ///     tokio::spawn(async move {
    ///         sqlx::query("INSERT INTO exports (job) VALUES (7)")
    ///             .execute(claim.connection())
    ///             .await?;
    ///         claim.complete(None).await?;
    ///         Ok::<_, Box<dyn std::error::Error + Send + Sync>>(())
    ///     });
    /// }
    /// # Ok(()) }
    /// ```
    ///
    /// # Errors
    /// As [`open`](Self::open).
    pub async fn open_owned<C, H>(&self, conn: H) -> Result<ClaimState<'static, C>, StoreError>
    where
        C: InboxConnection,
        H: std::ops::DerefMut<Target = C> + Send + 'static,
    {
        self.open_with(Hold::Owned(Box::new(conn))).await
    }

    async fn open_with<'c, C: InboxConnection>(
        &self,
        mut conn: Hold<'c, C>,
    ) -> Result<ClaimState<'c, C>, StoreError> {
        let Some(in_flight) = InFlight::enter(
            C::LOCAL_CLAIM_REGISTRY,
            self.scope,
            self.key.as_str(),
            self.wait,
        ) else {
            return self.seen_while_held(conn.conn()).await;
        };
        let payload_hash = self.fingerprint.to_hex();
        let request = ClaimRequest {
            consumer: self.scope,
            message_key: self.key.as_str(),
            message_name: self.name,
            payload_hash: &payload_hash,
            source: self.source,
            mode: ClaimMode::Deliver,
        };
        let opened = open(conn, &request, self.wait, &self.fingerprint)
            .await
            .map_err(|error| self.store_error(error))?;
        match opened {
            Opened::Claimed(Claimed { tx, attempts }) => Ok(ClaimState::Claimed(ClaimedKey {
                tx,
                scope: self.scope.to_owned(),
                key: self.key.clone(),
                name: self.name.to_owned(),
                payload_hash,
                attempts,
                policy: self.policy.cloned().unwrap_or_default(),
                prefix: crate::store::TablePrefix::current(),
                _in_flight: in_flight,
            })),
            // The key's row is locked (PostgreSQL, no wait): by the request that claims it (then
            // no committed row settles it), or by another session that only reads it.
            Opened::InProgress(mut tx) => self.seen_while_held(tx.conn()).await,
            Opened::Found(mut tx, found) => {
                let decision = found.decision.map_err(|damaged| {
                    self.store_error((StoreOperation::Claim, damaged.into_sqlx()))
                })?;
                match decision {
                    Decision::Conflict { stored } => {
                        Ok(ClaimState::Conflict(self.conflict(stored)))
                    }
                    Decision::Settled(Outcome::NotYet { retry_in }) => Ok(ClaimState::NotYet {
                        retry_in,
                        attempts: found.attempts,
                    }),
                    Decision::Settled(_) => {
                        self.settled(tx.conn(), found.status, found.attempts).await
                    }
                    // The claim statement takes such rows itself, retrying when they change
                    // under it; one seen here changed again: report it as still in progress.
                    Decision::Claimable => Ok(ClaimState::InProgress),
                }
            }
        }
    }

    /// What a [`Wait::NoWait`] session reports when another session holds the key (SQLite: a
    /// claim session of this process; PostgreSQL: the row's lock): the committed row if it
    /// settles the request — a replay read while
    /// another replay of the same key reads too, or a conflict — else "in progress". One read
    /// outside any transaction; nothing is written.
    async fn seen_while_held<'c, C: InboxConnection>(
        &self,
        conn: &mut C,
    ) -> Result<ClaimState<'c, C>, StoreError> {
        let found = peek(
            conn,
            self.scope,
            self.key.as_str(),
            &self.fingerprint,
            ClaimMode::Deliver,
        )
        .await
        .map_err(|e| self.store_error((StoreOperation::Claim, e)))?;
        let Some(found) = found else {
            return Ok(ClaimState::InProgress);
        };
        match found.decision {
            Ok(Decision::Conflict { stored }) => Ok(ClaimState::Conflict(self.conflict(stored))),
            Ok(Decision::Settled(outcome)) if !matches!(outcome, Outcome::NotYet { .. }) => {
                self.settled(conn, found.status, found.attempts).await
            }
            // A failed key (its holder is retrying it now), or a damaged row the claim reports.
            _ => Ok(ClaimState::InProgress),
        }
    }

    /// The key, settled as `status` after `attempts`, with its stored result (read on `conn`
    /// for a `processed` key).
    async fn settled<'c, C: InboxConnection>(
        &self,
        conn: &mut C,
        status: Status,
        attempts: u32,
    ) -> Result<ClaimState<'c, C>, StoreError> {
        let result = if status == Status::Processed {
            conn.fetch_result(self.scope, self.key.as_str())
                .await
                .map_err(|e| self.store_error((StoreOperation::Claim, e)))?
        } else {
            None
        };
        Ok(ClaimState::Settled(Settled {
            status,
            fingerprint: self.fingerprint,
            attempts,
            result,
        }))
    }

    /// The conflict of this session's fingerprint with the `stored` one.
    fn conflict(&self, stored: Fingerprint) -> Conflict {
        Conflict {
            consumer: self.scope.to_owned(),
            message_name: self.name.to_owned(),
            key: self.key.clone(),
            stored,
            received: self.fingerprint,
        }
    }

    fn store_error(&self, (operation, source): (StoreOperation, sqlx::Error)) -> StoreError {
        StoreError {
            consumer: self.scope.to_owned(),
            key: self.key.clone(),
            operation,
            source,
        }
    }
}

/// A key claimed by an open transaction: run your writes on [`connection`](Self::connection),
/// then [`complete`](Self::complete) (commit) or [`fail`](Self::fail) (roll back and record the
/// attempt). Dropped without either, the transaction rolls back and the key stays free.
///
/// Opened inside a [`TablePrefix::scope`](crate::store::TablePrefix::scope), its own statements
/// (complete, fail, abandon) run on that prefix's tables wherever they are awaited, a task
/// spawned outside the scope included; the runtime calls you make yourself on its connection
/// (an [`Outbox`](crate::Outbox) publish) take the scope they are awaited in.
pub struct ClaimedKey<'c, C: InboxConnection> {
    tx: ClaimTx<'c, C>,
    scope: String,
    key: IdempotencyKey,
    name: String,
    payload_hash: String,
    attempts: u32,
    policy: RetryPolicy,
    /// The table prefix of the scope it was opened in: its later statements run there too,
    /// wherever it is completed or failed (a task of its own, a request's extensions).
    prefix: Option<crate::store::TablePrefix>,
    _in_flight: InFlight,
}

impl<C: InboxConnection> std::fmt::Debug for ClaimedKey<'_, C> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        some_fields(
            f,
            "ClaimedKey",
            &[
                ("scope", &self.scope),
                ("key", &self.key),
                ("attempts", &self.attempts),
            ],
        )
    }
}

impl<C: InboxConnection> ClaimedKey<'_, C> {
    /// The connection, inside the claim's transaction: your writes on it commit or roll back
    /// with the claim.
    pub fn connection(&mut self) -> &mut C {
        self.tx.conn()
    }

    /// The connection, shared (for `Deref` impls of types that hold a claim).
    #[cfg_attr(not(feature = "http"), allow(dead_code))]
    pub(crate) fn connection_ref(&self) -> &C {
        self.tx.conn_ref()
    }

    /// Attempts for this key so far, this one included (1 for a first claim).
    pub fn attempts(&self) -> u32 {
        self.attempts
    }

    /// Stores `result` with the key (if given; later claims of the key get it back in
    /// [`Settled::result`]), checks the transaction is still usable, and commits: the key is
    /// `processed`.
    ///
    /// # Errors
    /// [`StoreError`] with [`StoreOperation::Complete`] (storing the result failed; rolled
    /// back), [`StoreOperation::Verify`] (the transaction was aborted by an error you did not
    /// return; rolled back, and the attempt recorded as failed) or [`StoreOperation::Commit`]
    /// (the outcome is unknown: claim the key again to find out).
    pub async fn complete(self, result: Option<&[u8]>) -> Result<(), StoreError> {
        self.complete_with(result, None)
            .await
            .map_err(|incomplete| match incomplete {
                Incomplete::Store(error) => error,
                Incomplete::Hook(_) => unreachable!("no hook ran"),
            })
    }

    /// [`complete`](Self::complete) with `hooks` run before the commit (on the claim's
    /// transaction, after the result is stored) and after it. A hook's error rolls everything
    /// back and records nothing: the key stays as it was.
    pub(crate) async fn complete_with(
        self,
        result: Option<&[u8]>,
        hooks: Option<&dyn HookRunner>,
    ) -> Result<(), Incomplete> {
        let prefix = self.prefix.clone();
        crate::store::within(prefix.as_ref(), self.complete_in_scope(result, hooks)).await
    }

    /// [`complete_with`](Self::complete_with), in the table prefix the claim was opened in.
    async fn complete_in_scope(
        mut self,
        result: Option<&[u8]>,
        hooks: Option<&dyn HookRunner>,
    ) -> Result<(), Incomplete> {
        if let Some(result) = result {
            let stored = self
                .tx
                .conn()
                .store_result(&self.scope, self.key.as_str(), result)
                .await;
            if let Err(error) = stored {
                let _ = self.tx.rollback().await;
                return Err(Incomplete::Store(
                    self.store_error((StoreOperation::Complete, error)),
                ));
            }
        }
        let info = ClaimInfo {
            consumer: &self.scope,
            key: self.key.as_str(),
            message_name: &self.name,
            payload: None,
            source: None,
        };
        let verify = Verify::Claim {
            consumer: &self.scope,
            key: self.key.as_str(),
        };
        let committed = commit(&mut self.tx, hooks, &info, verify).await;
        match committed {
            Ok(()) => Ok(()),
            Err(Uncommitted::Hook(source)) => Err(Incomplete::Hook(source)),
            Err(Uncommitted::Store(StoreOperation::Verify, error)) => {
                let text = aborted_transaction_text(&error);
                self.record(ErrorClass::Retryable, &text, 0, &[]).await;
                Err(Incomplete::Store(
                    self.store_error((StoreOperation::Verify, error)),
                ))
            }
            Err(Uncommitted::Store(operation, error)) => {
                Err(Incomplete::Store(self.store_error((operation, error))))
            }
        }
    }

    /// Rolls back every write of the transaction, claim included, then records the failed
    /// attempt in its own statement: `failed` with a next attempt time (the key is claimed
    /// again by its next session), or `dead` when `class` is [`ErrorClass::Permanent`] or the
    /// policy's `max_attempts` is reached. `error` is the text kept as `last_error`; `payload`
    /// the bytes kept for a replay (may be empty).
    ///
    /// Returns what was recorded: [`Disposition::Retry`], [`Disposition::Dead`], or
    /// [`Disposition::NotRecorded`] if the database failed too (logged).
    pub async fn fail(mut self, class: ErrorClass, error: &str, payload: &[u8]) -> Disposition {
        let prefix = self.prefix.clone();
        crate::store::within(prefix.as_ref(), async {
            let _ = self.tx.rollback().await;
            let attempts = self.attempts;
            self.record(class, error, attempts, payload).await
        })
        .await
    }

    /// Rolls back, recording nothing: the key stays as it was (free, or `failed`).
    ///
    /// # Errors
    /// [`StoreError`] with [`StoreOperation::Rollback`] if the rollback failed (the server
    /// rolls back when the connection closes).
    pub async fn abandon(mut self) -> Result<(), StoreError> {
        let prefix = self.prefix.clone();
        crate::store::within(prefix.as_ref(), async {
            self.tx
                .rollback()
                .await
                .map_err(|e| self.store_error((StoreOperation::Rollback, e)))
        })
        .await
    }

    async fn record(
        &mut self,
        class: ErrorClass,
        text: &str,
        attempts: u32,
        payload: &[u8],
    ) -> Disposition {
        let subject = Subject {
            consumer: &self.scope,
            key: self.key.as_str(),
            message_name: &self.name,
            payload_hash: &self.payload_hash,
            payload,
            source: None,
            ordering: None,
        };
        Attempt::new(&self.policy, None, class, text, attempts)
            .record_after_rollback(self.tx.conn(), &subject, attempts)
            .await
            .0
    }

    fn store_error(&self, (operation, source): (StoreOperation, sqlx::Error)) -> StoreError {
        StoreError {
            consumer: self.scope.clone(),
            key: self.key.clone(),
            operation,
            source,
        }
    }
}

/// Why [`ClaimedKey::complete_with`] did not commit.
#[derive(Debug)]
pub(crate) enum Incomplete {
    /// A store operation failed (see [`ClaimedKey::complete`]).
    Store(StoreError),
    /// A before-commit hook failed: rolled back, nothing recorded.
    #[cfg_attr(not(feature = "http"), allow(dead_code))]
    Hook(crate::types::classify::BoxError),
}

/// The keys held by claim sessions of this process on SQLite, with how many sessions hold or
/// wait for each, so that a [`Wait::NoWait`] session can answer "in progress" without waiting
/// for SQLite's write lock (which any writer holds, whatever its key). Keyed by scope and key
/// only: two SQLite databases in one process that claim the same scope and key at the same
/// moment see each other's claims as in progress.
static IN_FLIGHT: LazyLock<Mutex<HashMap<(String, String), usize>>> =
    LazyLock::new(|| Mutex::new(HashMap::new()));

/// A session's place in [`IN_FLIGHT`] (SQLite only), given up when the session ends.
struct InFlight(Option<(String, String)>);

impl InFlight {
    /// Enters the key; `None` if `wait` is [`Wait::NoWait`] and another session holds it.
    fn enter(registry: bool, scope: &str, key: &str, wait: Wait) -> Option<Self> {
        if !registry {
            return Some(Self(None));
        }
        let entry = (scope.to_owned(), key.to_owned());
        let mut held = IN_FLIGHT.lock().unwrap_or_else(|e| e.into_inner());
        let count = held.entry(entry.clone()).or_insert(0);
        if *count > 0 && wait == Wait::NoWait {
            return None;
        }
        *count += 1;
        Some(Self(Some(entry)))
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        if let Some(entry) = self.0.take() {
            let mut held = IN_FLIGHT.lock().unwrap_or_else(|e| e.into_inner());
            if let Some(count) = held.get_mut(&entry) {
                *count -= 1;
                if *count == 0 {
                    held.remove(&entry);
                }
            }
        }
    }
}
