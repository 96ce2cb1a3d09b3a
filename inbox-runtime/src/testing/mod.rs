//! A test kit for your handlers (feature `testing`): runs one `#[idempotent]` handler through
//! the deliveries a broker and a database can produce, and checks that each leaves your state
//! as **one** delivery does.
//!
//! ```no_run
//! use inbox_runtime::testing::Check;
//! use inbox_runtime::{Message, handler, idempotent};
//!
//! #[derive(Clone, serde::Serialize, serde::Deserialize, Message)]
//! #[message(name = "payments.captured")]
//! struct PaymentCaptured {
//!     #[message(key)]
//!     event_id: String,
//!     account_id: String,
//!     amount_cents: i64,
//! }
//!
//! #[idempotent(consumer = "ledger")]
//! async fn credit(conn: &mut sqlx::PgConnection, msg: PaymentCaptured) -> Result<(), sqlx::Error> {
//!     sqlx::query("UPDATE accounts SET balance = balance + $1 WHERE id = $2")
//!         .bind(msg.amount_cents)
//!         .bind(&msg.account_id)
//!         .execute(conn)
//!         .await?;
//!     Ok(())
//! }
//!
//! # async fn test(pool: sqlx::PgPool) -> Result<(), Box<dyn std::error::Error>> {
//! let msg = PaymentCaptured {
//!     event_id: "evt-1".into(),
//!     account_id: "alice".into(),
//!     amount_cents: 250,
//! };
//! let report = Check::new(handler!(credit), &msg)
//!     .run(
//!         &pool,
//!         // Before each scenario: the state the message meets.
//!         async |pool: &sqlx::PgPool| {
//!             sqlx::query("DELETE FROM accounts").execute(pool).await?;
//!             sqlx::query("INSERT INTO accounts (id, balance) VALUES ('alice', 0)")
//!                 .execute(pool)
//!                 .await?;
//!             Ok(())
//!         },
//!         // After each scenario: the state to compare.
//!         async |pool: &sqlx::PgPool| {
//!             sqlx::query_scalar::<_, i64>("SELECT balance FROM accounts WHERE id = 'alice'")
//!                 .fetch_one(pool)
//!                 .await
//!         },
//!     )
//!     .await?;
//! assert_eq!(report.state, 250);
//! # Ok(()) }
//! ```
//!
//! # The scenarios
//!
//! Each runs on a fresh state: before it, the kit deletes the inbox's rows of the handler's
//! consumer (`inbox_messages`, `inbox_aggregate_state`, `inbox_rejections`: run the kit on a
//! test database) and calls your `setup`; after it, it calls your `state` and compares.
//!
//! 1. [`Scenario::Once`]: the message once. Expected `Processed`; its state is the
//!    **reference** every other scenario is compared with.
//! 2. [`Scenario::Twice`]: the message, then the same message again (a producer retry, a
//!    redelivery). Expected `Processed`, then `Duplicate`.
//! 3. [`Scenario::LostCommit`]: the transaction commits but the caller never learns it, then
//!    the message comes again, marked as a redelivery. On **PostgreSQL and MySQL/MariaDB** the
//!    first delivery runs on a connection of the kit's own through a TCP proxy on loopback
//!    that forwards the `COMMIT`, reads the server's answer (so the commit ran), and cuts the
//!    connection instead of passing the answer on (later connections pass through). The
//!    runtime sees its `COMMIT` fail with the connection lost, replaces the connection and
//!    runs the delivery again, and that claim finds the key committed (expected: `Duplicate`;
//!    an error is admitted too, a lost answer's other ending). On **SQLite** (in the process:
//!    no connection to cut), in WAL mode, the first delivery runs on a connection with a WAL
//!    hook (`sqlite3_wal_hook`, called after a transaction committed) that returns
//!    `SQLITE_IOERR`: the `COMMIT` reports "disk I/O error" although the transaction committed
//!    (expected: an error, `database (commit)`; the connection is closed afterwards). Not in
//!    WAL mode (SQLite calls no WAL hook then), the first delivery commits and the kit drops
//!    its answer, as a process that crashed between the commit and the ack would (expected:
//!    `Processed`, reported `processed (answer dropped)`). Then, on every backend, the
//!    redelivery: expected `Duplicate`.
//! 4. [`Scenario::RolledBack`]: the first attempt runs your handler to its end, then fails
//!    before `COMMIT` (a [`TransactionHook`] of the kit returns an
//!    error from `before_commit`, as a failed `COMMIT`, a deadlock or a crash at that point
//!    would), so its transaction rolls back; the message comes again. Expected: a hook error,
//!    then `Processed`.
//! 5. [`Scenario::Conflict`]: the message, then another payload under the same idempotency
//!    key. Expected `Processed`, then a conflict ([`Error::Conflict`]),
//!    with the state left as the single delivery left it. The other payload is yours
//!    ([`Check::conflicting`]) or the kit's: the first leaf of the message's JSON (members by
//!    name, or as written if serde_json's `preserve_order` is on; depth first) whose change (a
//!    number + 1, a `bool` flipped, `"-conflict"` appended to a string) decodes, keeps the key
//!    and changes the fingerprint.
//!
//! The deliveries go through a [`Dispatcher`] with just your handler, which retries nothing in
//! process and lets a failed message be delivered again at once ([`RetryPolicy`]:
//! `transient_retries(0)`, `retry_delays(0, 0)`); a handler's own
//! `#[idempotent(max_attempts = 1)]` still makes its failed first attempt dead (scenario 4 then
//! reports `dead`).
//!
//! # What it catches, and what it cannot
//!
//! It compares states: a handler whose deliveries all leave the same wrong state passes, so
//! assert the reference state yourself too ([`CheckReport::state`]).
//!
//! * **Writes outside the claim's transaction** (a second pool or connection, another
//!   database, an in-process counter, an e-mail): they stay when the claim's transaction rolls
//!   back, and the redelivery makes them again. Scenario 4 diverges. On SQLite a write through
//!   a second connection while the claim's transaction holds the write lock fails (`database is
//!   locked`, after that connection's busy timeout): scenario 1 reports the handler's error.
//! * **A swallowed database error** (the handler catches a failed statement and returns
//!   `Ok`): on PostgreSQL the failed statement aborted the transaction, the runtime's check
//!   before `COMMIT` finds it, and scenario 1 reports a database error (`Verify`). On SQLite
//!   and MySQL/MariaDB a failed statement rolls back only itself (InnoDB rolls back the whole
//!   transaction only on a deadlock or, with `innodb_rollback_on_timeout`, a lock wait
//!   timeout); the rest of the transaction commits, the same on every delivery, and the kit
//!   passes it: only your assertion on the reference state can see the missing write.
//!
//! # Shapes
//!
//! `setup` and `state` are async closures taking the pool: `async |pool: &Pool<DB>| { … }`,
//! returning `Result<(), sqlx::Error>` and `Result<S, sqlx::Error>`, where `S` is any
//! `PartialEq + Debug` value (a number, a tuple, a `Vec` of rows). The kit's future is not
//! `Send` (your closures' futures need not be): await it in your test (`#[tokio::test]`).
//!
//! State outside the database (a counter of sent e-mails in a `static`, say) is yours to reset
//! in `setup`; tests run in parallel threads, so give each test its own.

mod proxy;
mod sqlite;

use std::any::Any;
use std::fmt;
use std::time::Duration;

use sqlx::Pool;

use crate::dispatch::Registration;
use crate::protocol::erased::DynHandler;
use crate::store::InboxDatabase;
use crate::types::classify::BoxError;
use crate::types::envelope::{Envelope, SourceMetadata};
use crate::types::error::{DispatchError, Error, RegistryError};
use crate::types::message::Message;
use crate::types::outcome::Outcome;
use crate::{ClaimInfo, ConnectionSlot, Dispatcher, RetryPolicy, TransactionHook};

use proxy::{CutProxy, Wire};

/// One of the kit's scenarios (see the [module's documentation](self) for what each simulates).
/// [`name`](Self::name) is how reports and errors name it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Scenario {
    /// The message once: the reference state.
    Once,
    /// The message delivered twice.
    Twice,
    /// The transaction committed, its answer lost, the message delivered again.
    LostCommit,
    /// The first attempt rolled back after the handler ran, the message delivered again.
    RolledBack,
    /// The message, then another payload under the same idempotency key.
    Conflict,
}

impl Scenario {
    /// Every scenario, in the order the kit runs them.
    pub const ALL: [Scenario; 5] = [
        Scenario::Once,
        Scenario::Twice,
        Scenario::LostCommit,
        Scenario::RolledBack,
        Scenario::Conflict,
    ];

    /// The scenario's name: `"once"`, `"delivered twice"`, `"commit answer lost"`, `"rolled
    /// back first attempt"` or `"conflicting payload"`.
    pub const fn name(self) -> &'static str {
        match self {
            Scenario::Once => "once",
            Scenario::Twice => "delivered twice",
            Scenario::LostCommit => "commit answer lost",
            Scenario::RolledBack => "rolled back first attempt",
            Scenario::Conflict => "conflicting payload",
        }
    }
}

impl fmt::Display for Scenario {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// What one scenario did: the result of each of its deliveries, in order, as short texts: an
/// outcome's [`kind`](crate::Outcome::kind) (`"processed"`, `"duplicate"`, …), an error's
/// [`kind`](crate::Error::kind) (`"hook"`, `"conflict"`, …) with, for a database error, its
/// operation (`"database (commit)"`); `" (answer dropped)"` is appended to a delivery whose
/// result the kit threw away (scenario 3 on SQLite not in WAL mode).
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct ScenarioRun {
    /// The scenario.
    pub scenario: Scenario,
    /// Each delivery's result.
    pub deliveries: Vec<String>,
}

/// A passed check: the reference state (what the message once left) and what each scenario
/// did, in the order of [`Scenario::ALL`].
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub struct CheckReport<S> {
    /// The state after the single delivery, which every scenario left too.
    pub state: S,
    /// Each scenario's deliveries.
    pub scenarios: Vec<ScenarioRun>,
}

/// Why a check failed: a scenario diverged or saw an outcome it should not, or the kit could
/// not run it. The `Display` text names the scenario and, for a divergence, shows both states
/// with `Debug`.
#[derive(Debug)]
#[non_exhaustive]
pub enum CheckError<S> {
    /// The scenario left another state than the single delivery:
    /// `scenario "<name>" diverged: state <state>, but the single delivery left <reference>`.
    Diverged {
        /// The scenario.
        scenario: Scenario,
        /// The state the single delivery left.
        reference: S,
        /// The state this scenario left.
        state: S,
    },
    /// A delivery's result was not the scenario's expectation:
    /// `scenario "<name>", delivery <n>: expected <expected>, got <got>`.
    Unexpected {
        /// The scenario.
        scenario: Scenario,
        /// The delivery, from 1.
        delivery: usize,
        /// What was expected (`"processed"`, `"duplicate"`, `"an error"`, …).
        expected: &'static str,
        /// What came: an outcome's kind, or the error's full text.
        got: String,
    },
    /// The dispatcher refused the envelope (a key it cannot read, say): nothing ran.
    Dispatch {
        /// The scenario.
        scenario: Scenario,
        /// The refusal.
        source: DispatchError,
    },
    /// The message's name is not the one the handler takes.
    WrongMessage {
        /// The handler (module path and name).
        function: &'static str,
        /// The message name it takes.
        expected: &'static str,
        /// The message name given.
        message_name: &'static str,
    },
    /// The handler takes another backend's connection than the pool's.
    Registry(RegistryError),
    /// The message (or the conflicting one) did not serialize to JSON.
    Encode(serde_json::Error),
    /// No field of the message could be changed into a conflicting payload (one that decodes,
    /// keeps the key and changes the fingerprint): give one with [`Check::conflicting`].
    NoConflictingPayload {
        /// The message name.
        message_name: &'static str,
    },
    /// A step around the deliveries failed: the kit's migration or clean-up, your `setup` or
    /// `state`, the lost-commit proxy (which needs a TCP connection: not a Unix socket) or WAL
    /// hook, or a backend the kit does not know (`Backend::Other`).
    Harness {
        /// The scenario it was running.
        scenario: Scenario,
        /// The step: `"migrate"`, `"clean up"`, `"setup"`, `"state"`, `"proxy"` or `"WAL
        /// hook"`.
        step: &'static str,
        /// What failed.
        source: BoxError,
    },
}

impl<S: fmt::Debug> fmt::Display for CheckError<S> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            CheckError::Diverged {
                scenario,
                reference,
                state,
            } => write!(
                f,
                "scenario \"{scenario}\" diverged: state {state:?}, but the single delivery left {reference:?}"
            ),
            CheckError::Unexpected {
                scenario,
                delivery,
                expected,
                got,
            } => write!(
                f,
                "scenario \"{scenario}\", delivery {delivery}: expected {expected}, got {got}"
            ),
            CheckError::Dispatch { scenario, source } => {
                write!(
                    f,
                    "scenario \"{scenario}\": the envelope was refused: {source}"
                )
            }
            CheckError::WrongMessage {
                function,
                expected,
                message_name,
            } => write!(
                f,
                "{function} takes `{expected}` messages, not `{message_name}`"
            ),
            CheckError::Registry(error) => error.fmt(f),
            CheckError::Encode(error) => write!(f, "the message does not serialize: {error}"),
            CheckError::NoConflictingPayload { message_name } => write!(
                f,
                "no field of `{message_name}` changes into a conflicting payload (same key, \
                 other fingerprint): give one with Check::conflicting"
            ),
            CheckError::Harness {
                scenario,
                step,
                source,
            } => write!(f, "scenario \"{scenario}\": {step} failed: {source}"),
        }
    }
}

impl<S: fmt::Debug> std::error::Error for CheckError<S> {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            CheckError::Dispatch { source, .. } => Some(source),
            CheckError::Registry(error) => Some(error),
            CheckError::Encode(error) => Some(error),
            CheckError::Harness { source, .. } => Some(&**source),
            _ => None,
        }
    }
}

/// A check of one handler with one message: [`new`](Self::new), optionally
/// [`conflicting`](Self::conflicting) or [`without_conflict`](Self::without_conflict), then
/// [`run`](Self::run).
#[derive(Debug, Clone)]
pub struct Check {
    handler: Registration,
    message_name: &'static str,
    payload: Result<Vec<u8>, String>,
    conflicting: Option<Result<Vec<u8>, String>>,
    without_conflict: bool,
}

impl Check {
    /// A check of `handler` (named with [`handler!`](crate::handler!)) with `message`.
    pub fn new<M: Message>(handler: Registration, message: &M) -> Self {
        Self {
            handler,
            message_name: M::NAME,
            payload: serde_json::to_vec(message).map_err(|e| e.to_string()),
            conflicting: None,
            without_conflict: false,
        }
    }

    /// Skips [`Scenario::Conflict`], for a message whose idempotency key is its whole payload
    /// (a content digest, say): no other payload has its key, so no conflict can happen, and
    /// none can be derived ([`CheckError::NoConflictingPayload`] otherwise). The report then
    /// lists the four other scenarios.
    pub fn without_conflict(mut self) -> Self {
        self.without_conflict = true;
        self
    }

    /// Uses `message` as the conflicting payload of [`Scenario::Conflict`] instead of deriving
    /// one. It must have the message's key and another fingerprint (else that scenario reports
    /// what came instead of the conflict).
    pub fn conflicting<M: Message>(mut self, message: &M) -> Self {
        self.conflicting = Some(serde_json::to_vec(message).map_err(|e| e.to_string()));
        self
    }

    /// Runs every scenario, in the order of [`Scenario::ALL`], on `pool` (migrated here with
    /// [`migrate`](crate::migrate)). Before each scenario the kit deletes the inbox rows of the
    /// handler's consumer and awaits `setup(pool)`; after it, `state(pool)`, compared with the
    /// single delivery's. Stops at the first failure.
    ///
    /// # Errors
    /// [`CheckError::Diverged`] if a scenario's state differs; [`CheckError::Unexpected`] if a
    /// delivery's result is not the scenario's (see the module's documentation);
    /// [`CheckError::Dispatch`] if the envelope is refused; [`CheckError::WrongMessage`],
    /// [`CheckError::Registry`], [`CheckError::Encode`] and
    /// [`CheckError::NoConflictingPayload`] before any delivery; [`CheckError::Harness`] if a
    /// step around the deliveries fails.
    pub async fn run<DB, S>(
        &self,
        pool: &Pool<DB>,
        setup: impl AsyncFn(&Pool<DB>) -> Result<(), sqlx::Error>,
        state: impl AsyncFn(&Pool<DB>) -> Result<S, sqlx::Error>,
    ) -> Result<CheckReport<S>, CheckError<S>>
    where
        DB: InboxDatabase,
        S: PartialEq + fmt::Debug,
    {
        let handler = self.handler.handler();
        if handler.message_name() != self.message_name {
            return Err(CheckError::WrongMessage {
                function: handler.function(),
                expected: handler.message_name(),
                message_name: self.message_name,
            });
        }
        let (payload, conflicting) = self.payloads(handler)?;
        let dispatcher = kit_dispatcher(pool.clone(), self.handler, None)?;
        crate::migrate(pool)
            .await
            .map_err(|e| harness(Scenario::Once, "migrate", e))?;

        let name = self.message_name;
        let envelope = Envelope::new(name, payload.clone());
        let redelivery = Envelope::new(name, payload.clone())
            .with_source(SourceMetadata::new("inbox-testing").redelivered(true));
        let other = Envelope::new(name, conflicting);

        let mut runs = Vec::new();
        let mut reference = None;
        for scenario in Scenario::ALL {
            if scenario == Scenario::Conflict && self.without_conflict {
                continue;
            }
            clean_up(pool, handler.consumer())
                .await
                .map_err(|e| harness(scenario, "clean up", e))?;
            setup(pool)
                .await
                .map_err(|e| harness(scenario, "setup", e))?;
            let mut run = Run {
                scenario,
                deliveries: Vec::new(),
            };
            match scenario {
                Scenario::Once => {
                    run.expect(deliver(&dispatcher, &envelope).await, Expect::Processed)?;
                }
                Scenario::Twice => {
                    run.expect(deliver(&dispatcher, &envelope).await, Expect::Processed)?;
                    run.expect(deliver(&dispatcher, &envelope).await, Expect::Duplicate)?;
                }
                Scenario::LostCommit => {
                    lose_commit(&mut run, pool, self.handler, &dispatcher, &envelope).await?;
                    run.expect(deliver(&dispatcher, &redelivery).await, Expect::Duplicate)?;
                }
                Scenario::RolledBack => {
                    let failing = kit_dispatcher(pool.clone(), self.handler, Some(RollBack))?;
                    run.expect(deliver(&failing, &envelope).await, Expect::Hook)?;
                    run.expect(deliver(&dispatcher, &redelivery).await, Expect::Processed)?;
                }
                Scenario::Conflict => {
                    run.expect(deliver(&dispatcher, &envelope).await, Expect::Processed)?;
                    run.expect(deliver(&dispatcher, &other).await, Expect::Conflict)?;
                }
            }
            let now = state(pool)
                .await
                .map_err(|e| harness(scenario, "state", e))?;
            match reference.take() {
                None => reference = Some(now),
                Some(kept) if kept == now => reference = Some(kept),
                Some(kept) => {
                    return Err(CheckError::Diverged {
                        scenario,
                        reference: kept,
                        state: now,
                    });
                }
            }
            runs.push(ScenarioRun {
                scenario,
                deliveries: run.deliveries,
            });
        }
        Ok(CheckReport {
            state: reference.expect("the first scenario sets the reference"),
            scenarios: runs,
        })
    }

    /// The payload to deliver and, unless [`without_conflict`](Self::without_conflict), the
    /// conflicting one (given, or derived from the payload).
    ///
    /// # Errors
    /// [`CheckError::Encode`] if a payload did not serialize;
    /// [`CheckError::NoConflictingPayload`] if none is given and none can be derived.
    fn payloads<S>(&self, handler: &dyn DynHandler) -> Result<(Vec<u8>, Vec<u8>), CheckError<S>> {
        let encode = |payload: &Result<Vec<u8>, String>| {
            payload.clone().map_err(|text| {
                CheckError::Encode(<serde_json::Error as serde::ser::Error>::custom(text))
            })
        };
        let payload = encode(&self.payload)?;
        let conflicting = match &self.conflicting {
            _ if self.without_conflict => Vec::new(),
            Some(conflicting) => encode(conflicting)?,
            None => {
                conflicting_payload(handler, &payload).ok_or(CheckError::NoConflictingPayload {
                    message_name: self.message_name,
                })?
            }
        };
        Ok((payload, conflicting))
    }
}

/// A [`CheckError::Harness`] of `scenario`'s `step`.
fn harness<S>(
    scenario: Scenario,
    step: &'static str,
    source: impl Into<BoxError>,
) -> CheckError<S> {
    CheckError::Harness {
        scenario,
        step,
        source: source.into(),
    }
}

/// One delivery's result, or the dispatcher's refusal.
type Delivered = Result<Result<Outcome<()>, Error<BoxError>>, DispatchError>;

/// Dispatches `envelope` to the dispatcher's one handler.
async fn deliver<DB: InboxDatabase>(dispatcher: &Dispatcher<DB>, envelope: &Envelope) -> Delivered {
    let mut outcomes = dispatcher.dispatch(envelope).await?;
    // A dispatcher of one handler routes the handler's message to exactly it.
    Ok(outcomes.remove(0).result)
}

/// What a delivery of a scenario must come out as.
#[derive(Debug, Clone, Copy)]
enum Expect {
    Processed,
    Duplicate,
    /// A [`TransactionHook`] error: the kit's rollback.
    Hook,
    Conflict,
    /// Any error, or a duplicate: the commit's answer lost, the runtime's reconnect found the
    /// key committed.
    LostAnswer,
}

impl Expect {
    fn text(self) -> &'static str {
        match self {
            Expect::Processed => "processed",
            Expect::Duplicate => "duplicate",
            Expect::Hook => "hook (the kit's rollback)",
            Expect::Conflict => "conflict",
            Expect::LostAnswer => "duplicate or an error (the commit's answer lost)",
        }
    }

    fn admits(self, result: &Result<Outcome<()>, Error<BoxError>>) -> bool {
        matches!(
            (self, result),
            (Expect::Processed, Ok(Outcome::Processed(())))
                | (Expect::Duplicate, Ok(Outcome::Duplicate))
                | (Expect::Hook, Err(Error::Hook(_)))
                | (Expect::Conflict, Err(Error::Conflict(_)))
                | (Expect::LostAnswer, Ok(Outcome::Duplicate) | Err(_))
        )
    }
}

/// The short text of a result in a [`ScenarioRun`].
fn short(result: &Result<Outcome<()>, Error<BoxError>>) -> String {
    match result {
        Ok(outcome) => outcome.kind().to_owned(),
        Err(Error::Database(error)) => format!("database ({})", error.operation.as_str()),
        Err(error) => error.kind().to_owned(),
    }
}

/// The full text of a result in a [`CheckError::Unexpected`].
fn full(result: &Result<Outcome<()>, Error<BoxError>>) -> String {
    match result {
        Ok(outcome) => outcome.kind().to_owned(),
        Err(error) => format!("{} error: {error}", error.kind()),
    }
}

/// A scenario's deliveries so far.
struct Run {
    scenario: Scenario,
    deliveries: Vec<String>,
}

impl Run {
    /// Records `delivered`, checked against `expect`.
    fn expect<S>(&mut self, delivered: Delivered, expect: Expect) -> Result<(), CheckError<S>> {
        let result = delivered.map_err(|source| CheckError::Dispatch {
            scenario: self.scenario,
            source,
        })?;
        self.deliveries.push(short(&result));
        if expect.admits(&result) {
            Ok(())
        } else {
            Err(CheckError::Unexpected {
                scenario: self.scenario,
                delivery: self.deliveries.len(),
                expected: expect.text(),
                got: full(&result),
            })
        }
    }
}

/// A dispatcher of just `handler` on `pool` that retries nothing in process and lets a failed
/// message be delivered again at once, with `hook` if any.
fn kit_dispatcher<DB: InboxDatabase, S>(
    pool: Pool<DB>,
    handler: Registration,
    hook: Option<RollBack>,
) -> Result<Dispatcher<DB>, CheckError<S>> {
    let policy = RetryPolicy::default()
        .transient_retries(0)
        .retry_delays(Duration::ZERO, Duration::ZERO);
    let dispatcher = Dispatcher::from_handlers(pool, [handler])
        .map_err(CheckError::Registry)?
        .with_retry_policy(policy);
    Ok(match hook {
        Some(hook) => dispatcher.with_hook(hook),
        None => dispatcher,
    })
}

/// The hook of [`Scenario::RolledBack`]: fails `before_commit` (after the handler returned
/// `Ok`), so that the attempt's transaction rolls back. Its dispatcher runs the scenario's first
/// delivery only.
struct RollBack;

/// The error [`RollBack`] fails the attempt with.
#[derive(Debug, thiserror::Error)]
#[error(
    "the test kit rolled back this attempt after the handler ran (scenario \"rolled back first attempt\")"
)]
struct KitRollback;

impl<DB: InboxDatabase> TransactionHook<DB> for RollBack {
    fn before_commit<'c>(
        &'c self,
        _conn: &'c mut DB::Connection,
        _claim: &'c ClaimInfo<'c>,
    ) -> crate::BoxFuture<'c, Result<(), BoxError>> {
        Box::pin(async { Err(KitRollback.into()) })
    }
}

/// The first delivery of [`Scenario::LostCommit`] (see the module's documentation).
async fn lose_commit<DB: InboxDatabase, S>(
    run: &mut Run,
    pool: &Pool<DB>,
    handler: Registration,
    dispatcher: &Dispatcher<DB>,
    envelope: &Envelope,
) -> Result<(), CheckError<S>> {
    let scenario = Scenario::LostCommit;
    if let Some(sqlite) = (pool as &dyn Any).downcast_ref::<sqlx::SqlitePool>() {
        let kit = kit_dispatcher(sqlite.clone(), handler, None)?;
        let hooked = lose_sqlite_commit(sqlite, &kit, envelope)
            .await
            .map_err(|e| harness(scenario, "WAL hook", e))?;
        return match hooked {
            Some(delivered) => run.expect(delivered, Expect::LostAnswer),
            None => {
                run.expect(deliver(dispatcher, envelope).await, Expect::Processed)?;
                if let Some(last) = run.deliveries.last_mut() {
                    last.push_str(" (answer dropped)");
                }
                Ok(())
            }
        };
    }
    let (proxy, proxied) = through_proxy(pool)
        .await
        .map_err(|e| harness(scenario, "proxy", e))?;
    let kit = kit_dispatcher(proxied.clone(), handler, None)?;
    let delivered = deliver(&kit, envelope).await;
    drop(kit);
    proxied.close().await;
    if proxy.has_cut() {
        return run.expect(delivered, Expect::LostAnswer);
    }
    let result = delivered.map_err(|source| CheckError::Dispatch { scenario, source })?;
    run.deliveries.push(short(&result));
    Err(CheckError::Unexpected {
        scenario,
        delivery: 1,
        expected: "a COMMIT (to cut its answer)",
        got: full(&result),
    })
}

/// The first delivery of [`Scenario::LostCommit`] on SQLite in WAL mode: on a connection of
/// `pool` whose `COMMIT` reports an error after committing (see `sqlite`), closed afterwards.
/// `None` (nothing delivered) if the database is not in WAL mode.
// A delivery's result is the dispatcher's (`ConsumerOutcome::result`), as large as it is.
#[allow(clippy::result_large_err)]
async fn lose_sqlite_commit(
    pool: &sqlx::SqlitePool,
    dispatcher: &Dispatcher<sqlx::Sqlite>,
    envelope: &Envelope,
) -> Result<Option<Delivered>, sqlx::Error> {
    let mut slot = ConnectionSlot::new();
    let conn = slot.get(pool).await?;
    if !sqlite::in_wal_mode(conn).await? {
        slot.release();
        return Ok(None);
    }
    sqlite::fail_commits(conn).await?;
    let delivered = dispatcher
        .dispatch_on(&mut slot, envelope)
        .await
        .map(|mut outcomes| outcomes.remove(0).result);
    // Closed, never reused: it has the kit's hook, and sqlx still counts the transaction whose
    // COMMIT failed as open.
    slot.discard();
    Ok(Some(delivered))
}

/// A lost-commit proxy to `pool`'s server and a pool of one connection through it (`pool`'s
/// connect options with the proxy's address, without TLS).
async fn through_proxy<DB: InboxDatabase>(
    pool: &Pool<DB>,
) -> Result<(CutProxy, Pool<DB>), BoxError> {
    use sqlx::mysql::{MySqlConnectOptions, MySqlSslMode};
    use sqlx::postgres::{PgConnectOptions, PgSslMode};

    let options = pool.connect_options();
    let any: &dyn Any = &*options;
    let no_socket =
        || BoxError::from("the lost-commit proxy needs a TCP connection, not a Unix socket");
    // The same steps on PostgreSQL's and MySQL's options: two types with these methods and no
    // trait in common.
    macro_rules! proxied {
        ($options:expr, $wire:expr, $no_tls:expr) => {{
            if $options.get_socket().is_some() {
                return Err(no_socket());
            }
            let server = ($options.get_host().to_owned(), $options.get_port());
            let proxy = CutProxy::start(server, $wire).await?;
            let options = $options
                .clone()
                .host("127.0.0.1")
                .port(proxy.port())
                .ssl_mode($no_tls);
            (proxy, Box::new(options) as Box<dyn Any>)
        }};
    }
    let (proxy, options) = if let Some(pg) = any.downcast_ref::<PgConnectOptions>() {
        proxied!(pg, Wire::Postgres, PgSslMode::Disable)
    } else if let Some(my) = any.downcast_ref::<MySqlConnectOptions>() {
        proxied!(my, Wire::MySql, MySqlSslMode::Disabled)
    } else {
        return Err(format!("no lost-commit proxy for the {} backend", DB::BACKEND).into());
    };
    let options = options
        .downcast::<<DB::Connection as sqlx::Connection>::Options>()
        .map_err(|_| BoxError::from("the pool's connect options changed type"))?;
    let proxied = sqlx::pool::PoolOptions::<DB>::new()
        .max_connections(1)
        .connect_lazy_with(*options);
    Ok((proxy, proxied))
}

/// `sql`, on the tables of the [`TablePrefix`](crate::store::TablePrefix) in scope, if any.
fn prefixed(sql: &'static str) -> sqlx::SqlStr {
    crate::store::sql::prefixed_text(sql)
}

/// Deletes the inbox rows of `consumer` (in the table prefix in scope): messages, aggregate
/// positions, rejections.
async fn clean_up<DB: InboxDatabase>(pool: &Pool<DB>, consumer: &str) -> Result<(), BoxError> {
    const QUESTION: [&str; 3] = [
        "DELETE FROM inbox_messages WHERE consumer = ?",
        "DELETE FROM inbox_aggregate_state WHERE consumer = ?",
        "DELETE FROM inbox_rejections WHERE consumer = ?",
    ];
    const DOLLAR: [&str; 3] = [
        "DELETE FROM inbox_messages WHERE consumer = $1",
        "DELETE FROM inbox_aggregate_state WHERE consumer = $1",
        "DELETE FROM inbox_rejections WHERE consumer = $1",
    ];
    let any: &dyn Any = pool;
    if let Some(pool) = any.downcast_ref::<sqlx::PgPool>() {
        delete_rows(pool, DOLLAR, consumer).await?;
    } else if let Some(pool) = any.downcast_ref::<sqlx::SqlitePool>() {
        delete_rows(pool, QUESTION, consumer).await?;
    } else if let Some(pool) = any.downcast_ref::<sqlx::MySqlPool>() {
        delete_rows(pool, QUESTION, consumer).await?;
    } else {
        return Err(format!("the test kit does not know the {} backend", DB::BACKEND).into());
    }
    Ok(())
}

/// Runs each of `statements`, binding `consumer` to its one parameter, on `pool` (in the table
/// prefix in scope).
async fn delete_rows<DB>(
    pool: &Pool<DB>,
    statements: [&'static str; 3],
    consumer: &str,
) -> Result<(), sqlx::Error>
where
    DB: sqlx::Database,
    for<'c> &'c mut DB::Connection: sqlx::Executor<'c, Database = DB>,
    DB::Arguments: sqlx::IntoArguments<DB>,
    for<'a> &'a str: sqlx::Encode<'a, DB> + sqlx::Type<DB>,
{
    for sql in statements {
        sqlx::query(prefixed(sql))
            .bind(consumer)
            .execute(pool)
            .await?;
    }
    Ok(())
}

/// A payload that conflicts with `payload` for `handler`: the first leaf of its JSON (members
/// in key order, arrays in order, depth first) whose change decodes, keeps the key and changes
/// the fingerprint.
fn conflicting_payload(handler: &dyn DynHandler, payload: &[u8]) -> Option<Vec<u8>> {
    let text = std::str::from_utf8(payload).ok()?;
    let original = handler.decode(text).ok()?;
    let key = handler.key(&*original).ok()?;
    let fingerprint = handler.fingerprint(&*original).ok()?;
    let value: serde_json::Value = serde_json::from_str(text).ok()?;
    let mut leaves = Vec::new();
    leaf_pointers(&value, String::new(), &mut leaves);
    leaves.into_iter().find_map(|pointer| {
        let mut changed = value.clone();
        if !change(changed.pointer_mut(&pointer)?) {
            return None;
        }
        let bytes = serde_json::to_vec(&changed).ok()?;
        let decoded = handler.decode(std::str::from_utf8(&bytes).ok()?).ok()?;
        let same_key = handler.key(&*decoded).ok()? == key;
        let other = handler.fingerprint(&*decoded).ok()? != fingerprint;
        (same_key && other).then_some(bytes)
    })
}

/// The JSON pointers of `value`'s leaves, depth first.
fn leaf_pointers(value: &serde_json::Value, at: String, out: &mut Vec<String>) {
    match value {
        serde_json::Value::Object(members) => {
            for (name, member) in members {
                let name = name.replace('~', "~0").replace('/', "~1");
                leaf_pointers(member, format!("{at}/{name}"), out);
            }
        }
        serde_json::Value::Array(items) => {
            for (index, item) in items.iter().enumerate() {
                leaf_pointers(item, format!("{at}/{index}"), out);
            }
        }
        _ => out.push(at),
    }
}

/// Changes a leaf: a number + 1 (- 1 at its maximum), a `bool` flipped, `"-conflict"` appended
/// to a string. `false` for `null`.
fn change(leaf: &mut serde_json::Value) -> bool {
    use serde_json::Value;
    let changed = match leaf {
        Value::Bool(flag) => Value::Bool(!*flag),
        Value::String(text) => Value::String(format!("{text}-conflict")),
        Value::Number(number) => {
            if let Some(n) = number.as_i64() {
                Value::from(n.checked_add(1).unwrap_or(n - 1))
            } else if let Some(n) = number.as_u64() {
                Value::from(n.checked_add(1).unwrap_or(n - 1))
            } else if let Some(n) = number.as_f64() {
                Value::from(n + 1.0)
            } else {
                return false;
            }
        }
        _ => return false,
    };
    *leaf = changed;
    true
}
