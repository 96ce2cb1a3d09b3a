//! The batch driver: one transaction claims and processes many deliveries — one multi-row claim
//! statement for all of them, then the machine's steps per key (decide, body, hooks), one
//! verify and one commit. What the batch does not settle runs alone afterwards, on the single
//! path (the caller's business: see [`BatchResult::Alone`]).
//!
//! The batch first runs **optimistically** (PostgreSQL): every body directly in the batch
//! transaction; any failure rolls it back and the batch runs again with a **savepoint** per
//! handler, so that a failure is recorded and the others commit. A batch that loses to
//! concurrent transactions (**contention**) runs again alone once (behind the Worker's gate),
//! then leaves its messages to the single path. See
//! [`Dispatcher::dispatch_batch`](crate::Dispatcher::dispatch_batch) for the whole contract.

use std::sync::Arc;
use std::time::Duration;

use tracing::Instrument as _;

use sqlx::Pool;

use super::Decision;
use super::erased::{AnyMessage, BodyError, DynHandler};
use super::failure::{Attempt, Subject, conflict_rejection};
use super::hooks::{ClaimInfo, Fenced, HookRunner};
use super::machine::{Found, after_commit, before_commit, run_body};
use super::tx::{ClaimTx, Hold, Verify};
use crate::store::{ClaimRequest, ClaimResult, ClaimStore as _, InboxConnection, InboxDatabase};
use crate::types::classify::{BoxError, Contention, ErrorClass};
use crate::types::envelope::SourceMetadata;
use crate::types::error::{
    Conflict, Disposition, Error, HandlerFailure, HookError, StoreOperation,
};
use crate::types::fingerprint::Fingerprint;
use crate::types::key::IdempotencyKey;
use crate::types::outcome::Outcome;
use crate::types::policy::RetryPolicy;
use crate::types::slot::{ConnectionSlot, connection_lost};
use crate::types::status::ClaimMode;

/// How the [`Worker`](crate::Worker) asks for one batch to run.
#[derive(Debug, Clone, Default)]
pub(crate) struct BatchOptions {
    /// PostgreSQL: the batch transaction's `lock_timeout` (`SET LOCAL`), so that a batch that
    /// waits on a lock longer than this (another batch in flight holds it, perhaps waiting for
    /// this one in turn) gives up at once instead of after the server's `deadlock_timeout`,
    /// and its messages run alone. `None`: the server's setting.
    pub(crate) lock_timeout: Option<Duration>,
    /// The Worker's batch gate: held shared while the batch runs, exclusively when a batch
    /// that lost to concurrent transactions runs again. `None`: such a batch's messages run
    /// one by one at once.
    pub(crate) gate: Option<Arc<tokio::sync::RwLock<()>>>,
    /// Claim and run the items in the order given (the Worker's partitioned batches: the
    /// order of arrival, which no concurrent batch can contradict, since none shares a
    /// partition with it) instead of in the fixed order of their keys that keeps concurrent
    /// batches that may share keys from deadlocking on their claims.
    pub(crate) keep_order: bool,
}

/// What happened to one batch, beside its results.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct BatchStats {
    /// The batch transaction lost to concurrent transactions (a deadlock, a serialization
    /// failure, a lock wait that timed out) and its messages ran alone.
    pub(crate) contention: Option<Contention>,
}

/// One consumer's delivery of a message, as the batch claims and runs it.
pub(crate) struct BatchItem<'a> {
    /// The consumer's handler.
    pub(crate) handler: &'static dyn DynHandler,
    /// The decoded message.
    pub(crate) msg: &'a AnyMessage,
    /// Its idempotency key for this consumer.
    pub(crate) key: &'a IdempotencyKey,
    /// Its fingerprint.
    pub(crate) fingerprint: &'a Fingerprint,
    /// The payload as delivered (kept with a failure or a conflict).
    pub(crate) payload: &'a [u8],
    /// Where it came from.
    pub(crate) source: Option<&'a SourceMetadata>,
    /// The delivery's headers, where its W3C Trace Context is read (feature `otel`), if any.
    pub(crate) headers: Option<&'a std::collections::BTreeMap<String, String>>,
}

/// What the batch did for one item.
pub(crate) enum BatchResult {
    /// Settled by the batch transaction (after it committed).
    Done(Result<Outcome<()>, Error<BoxError>>),
    /// Not settled: to run alone, on the single path (a key found `failed` meanwhile, a
    /// transient failure, or every item if the batch transaction itself failed).
    Alone,
}

/// What a batch runs with: the pool its connection comes from, the retry policy for failures,
/// the hooks.
pub(crate) struct BatchEnv<'a, DB: InboxDatabase> {
    pub(crate) pool: &'a Pool<DB>,
    pub(crate) policy: &'a RetryPolicy,
    pub(crate) hooks: Option<&'a dyn HookRunner>,
}

/// Runs `items` (unique keys, none ordered) in one batch transaction on the connection of
/// `slot`; returns one result per item, in order. Items the batch does not settle, and all of
/// them if its transaction fails, are [`BatchResult::Alone`].
pub(crate) async fn run<DB: InboxDatabase>(
    slot: &mut ConnectionSlot<DB>,
    env: &BatchEnv<'_, DB>,
    items: &[BatchItem<'_>],
    options: &BatchOptions,
) -> (Vec<BatchResult>, BatchStats) {
    let mut results: Vec<BatchResult> = items.iter().map(|_| BatchResult::Alone).collect();
    let mut stats = BatchStats::default();
    if items.is_empty() {
        return (results, stats);
    }
    // A fixed order of claims across concurrent batches keeps them from deadlocking (unless
    // the caller knows that no concurrent batch shares a key with this one).
    let mut order: Vec<usize> = (0..items.len()).collect();
    if !options.keep_order {
        order.sort_by_key(|&at| (items[at].handler.consumer(), items[at].key.as_str()));
    }
    let items: Vec<&BatchItem<'_>> = order.iter().map(|&at| &items[at]).collect();
    let hashes: Vec<String> = items.iter().map(|it| it.fingerprint.to_hex()).collect();
    let requests: Vec<ClaimRequest<'_>> = items
        .iter()
        .zip(&hashes)
        .map(|(it, hash)| ClaimRequest {
            consumer: it.handler.consumer(),
            message_key: it.key.as_str(),
            message_name: it.handler.message_name(),
            payload_hash: hash,
            source: it.source,
            mode: ClaimMode::Deliver,
        })
        .collect();
    let batch = Batch {
        env,
        items: &items,
        requests: &requests,
    };
    // One transaction for deliveries of many traces: linked to each, a child of none (a span has
    // one parent; see `crate::trace`).
    let span = tracing::info_span!("inbox.batch", messages = items.len());
    for item in &items {
        crate::trace::link_headers(&span, item.headers);
    }
    let run = batch
        .run_gated(slot, options, &mut stats)
        .instrument(span)
        .await;
    match run {
        Ok(BatchRun::Done(done)) => {
            for (&at, result) in order.iter().zip(done) {
                results[at] = result;
            }
        }
        Ok(BatchRun::Isolate(_)) => unreachable!("an isolated batch run never asks for isolation"),
        // Rolled back; every message of it runs alone.
        Ok(BatchRun::Contended(_)) => {}
        Err(error) if Contention::of_sqlx(&error).is_some() => {}
        Err(error) => {
            if connection_lost(&error) || transaction_gone(&error) {
                slot.discard();
            }
            tracing::warn!(%error, size = items.len(), "batch transaction failed; processing its messages one by one");
        }
    }
    (results, stats)
}

/// How the batch transaction isolates its handlers from each other.
enum Isolation {
    /// No savepoints: any failure rolls the whole run back.
    Optimistic,
    /// A savepoint per handler; the failure the optimistic run got, at its batch index, is
    /// recorded instead of calling that handler again.
    Savepoints(Option<(usize, BodyError)>),
}

/// What one run of the batch transaction came to.
enum BatchRun {
    /// Committed; one result per batched message.
    Done(Vec<BatchResult>),
    /// The optimistic run was rolled back: a handler failed (returning this failure, at this
    /// batch index, or leaving the transaction aborted); run again with savepoints.
    Isolate(Option<(usize, BodyError)>),
    /// Rolled back after losing to concurrent transactions: every message runs alone.
    Contended(Contention),
}

impl BatchRun {
    /// The contention a run (or its error) lost to, if any.
    fn contention(run: &Result<BatchRun, sqlx::Error>) -> Option<Contention> {
        match run {
            Ok(BatchRun::Contended(contention)) => Some(*contention),
            Err(error) => Contention::of_sqlx(error),
            Ok(_) => None,
        }
    }
}

/// What one item's step in the batch transaction came to.
enum Step {
    /// Settled (for now: the transaction still has to commit); `true` if its handler ran and
    /// its after-commit callbacks are due.
    Settled(BatchResult, bool),
    /// The run ends here: rolled back.
    Stop(BatchRun),
}

/// One batch, in claim order, with what its runs share.
struct Batch<'b, DB: InboxDatabase> {
    env: &'b BatchEnv<'b, DB>,
    items: &'b [&'b BatchItem<'b>],
    /// Each item's claim, its fingerprint in hex among it.
    requests: &'b [ClaimRequest<'b>],
}

impl<DB: InboxDatabase> Batch<'_, DB> {
    /// The `n`th message, as a failure or conflict records it.
    fn subject(&self, n: usize) -> Subject<'_> {
        Subject::of_claim(&self.requests[n], self.items[n].payload, None)
    }

    /// The `n`th message, as hooks see it.
    fn info(&self, n: usize) -> ClaimInfo<'_> {
        self.subject(n).info()
    }

    /// The batch's runs until one settles it: optimistic (PostgreSQL), then with savepoints if
    /// a handler failed; once more alone (holding the gate exclusively) if it lost to
    /// concurrent transactions.
    async fn run_gated(
        &self,
        slot: &mut ConnectionSlot<DB>,
        options: &BatchOptions,
        stats: &mut BatchStats,
    ) -> Result<BatchRun, sqlx::Error> {
        // Batches of one Worker share its gate: each runs holding it shared; one that lost to
        // concurrent transactions runs again holding it exclusively (no other batch of the
        // Worker beside it, none waiting for its locks), without a lock timeout.
        let mut shared = match &options.gate {
            Some(gate) => Some(Arc::clone(gate).read_owned().await),
            None => None,
        };
        let mut exclusive = None;
        loop {
            let lock_timeout = options.lock_timeout.filter(|_| exclusive.is_none());
            let run = self.run_isolating(slot, lock_timeout).await;
            // A batch transaction that lost to concurrent transactions: run again alone
            // (once, when a gate is given), else its messages run one by one.
            let Some(contention) = BatchRun::contention(&run) else {
                return run;
            };
            stats.contention.get_or_insert(contention);
            metrics::counter!("inbox_batch_contention_total", "error" => contention.as_str())
                .increment(1);
            if exclusive.is_none()
                && let Some(gate) = shared
                    .take()
                    .map(|guard| Arc::clone(tokio::sync::OwnedRwLockReadGuard::rwlock(&guard)))
            {
                tracing::debug!(
                    error = contention.as_str(),
                    size = self.items.len(),
                    "batch lost to concurrent transactions; running it again alone"
                );
                exclusive = Some(gate.write_owned().await);
                continue;
            }
            tracing::debug!(
                error = contention.as_str(),
                size = self.items.len(),
                "batch lost to concurrent transactions; running its messages one by one"
            );
            return run;
        }
    }

    /// One run: optimistic first where a handler cannot end the transaction under the batch's
    /// feet, then with savepoints if it asked for them.
    async fn run_isolating(
        &self,
        slot: &mut ConnectionSlot<DB>,
        lock_timeout: Option<Duration>,
    ) -> Result<BatchRun, sqlx::Error> {
        // Optimistic only where a handler cannot end the transaction under the batch's feet: on
        // PostgreSQL an error leaves it aborted (later statements fail, COMMIT is checked
        // first), whereas on SQLite an `OR ROLLBACK` conflict or a trigger's `RAISE(ROLLBACK)`
        // ends it and the statements after it would autocommit. SQLite savepoints cost no
        // round trip.
        let run = if DB::Connection::OPTIMISTIC_BATCHES {
            self.run_once(slot, Isolation::Optimistic, lock_timeout)
                .await?
        } else {
            BatchRun::Isolate(None)
        };
        let BatchRun::Isolate(failed) = run else {
            return Ok(run);
        };
        tracing::debug!(
            size = self.items.len(),
            "running the batch with a savepoint per handler"
        );
        self.run_once(slot, Isolation::Savepoints(failed), lock_timeout)
            .await
    }

    /// The batch transaction, optimistic (handlers run directly in it) or with a savepoint per
    /// handler. An `Err` means nothing of it is known to be committed; [`BatchRun::Isolate`]
    /// that the optimistic run was rolled back because a handler failed (with its failure, if
    /// it returned one: the isolated run records it instead of calling the handler again, so
    /// that each delivery's handler runs once per attempt, as on the single path).
    async fn run_once(
        &self,
        slot: &mut ConnectionSlot<DB>,
        isolation: Isolation,
        lock_timeout: Option<Duration>,
    ) -> Result<BatchRun, sqlx::Error> {
        let (isolate, mut carried) = match isolation {
            Isolation::Optimistic => (false, None),
            Isolation::Savepoints(failed) => (true, failed),
        };
        let conn: &mut DB::Connection = slot.get_for_claim(self.env.pool).await?;
        let mut tx = ClaimTx::begin(Hold::Kept(conn)).await?;
        set_lock_timeout(&mut tx, lock_timeout).await?;
        let (claimed, mut existing) = self.claim(&mut tx).await?;
        let mut results = Vec::with_capacity(self.items.len());
        // The batch positions whose handler ran, for the after-commit callbacks.
        let mut processed = Vec::new();
        for (n, attempts) in claimed.iter().enumerate() {
            let step = match attempts {
                None => Step::Settled(
                    self.settle_found(&mut tx, n, existing[n].take()).await?,
                    false,
                ),
                Some(_) if !isolate => self.run_optimistic(&mut tx, n).await?,
                Some(attempts) => {
                    let failed = carried
                        .take_if(|(at, _)| *at == n)
                        .map(|(_, failure)| failure);
                    self.run_isolated(&mut tx, n, *attempts, failed).await?
                }
            };
            match step {
                Step::Settled(result, ran) => {
                    results.push(result);
                    if ran {
                        processed.push(n);
                    }
                }
                Step::Stop(run) => return Ok(run),
            }
        }
        if !self.commit(&mut tx, &claimed, isolate).await? {
            return Ok(BatchRun::Isolate(None));
        }
        for n in processed {
            after_commit(self.env.hooks, &self.info(n));
        }
        Ok(BatchRun::Done(results))
    }

    /// The claim statement for every item, then the stored rows of the keys it did not take:
    /// per item, the attempts of its claim, or the row found.
    async fn claim(
        &self,
        tx: &mut ClaimTx<'_, DB::Connection>,
    ) -> Result<(Vec<Option<u32>>, Vec<Option<ClaimResult>>), sqlx::Error> {
        let claimed = tx.conn().claim_batch(self.requests).await?;
        let taken: Vec<(&str, &str)> = self
            .requests
            .iter()
            .zip(&claimed)
            .filter(|(_, claimed)| claimed.is_none())
            .map(|(r, _)| (r.consumer, r.message_key))
            .collect();
        // The stored rows of the keys not claimed, by their request's position.
        let mut existing: Vec<Option<ClaimResult>> = self.requests.iter().map(|_| None).collect();
        let index = crate::store::request_index(self.requests);
        for (consumer, key, found) in tx.conn().existing_batch(&taken).await? {
            if let Some(&at) = index.get(&(consumer.as_str(), key.as_str())) {
                existing[at] = Some(found);
            }
        }
        Ok((claimed, existing))
    }

    /// A key the batch did not claim: decided, a conflict kept in the batch transaction. A key
    /// freed or taken over since, or a stored fingerprint that does not parse (reported by the
    /// single path), runs alone.
    async fn settle_found(
        &self,
        tx: &mut ClaimTx<'_, DB::Connection>,
        n: usize,
        found: Option<ClaimResult>,
    ) -> Result<BatchResult, sqlx::Error> {
        let it = self.items[n];
        let decision = found
            .and_then(|row| Found::of(row, it.fingerprint, ClaimMode::Deliver))
            .and_then(|found| found.decision.ok());
        Ok(match decision {
            Some(Decision::Settled(outcome)) => BatchResult::Done(Ok(outcome)),
            Some(Decision::Conflict { stored }) => {
                let conflict = Conflict {
                    consumer: it.handler.consumer().to_owned(),
                    message_name: it.handler.message_name().to_owned(),
                    key: it.key.clone(),
                    stored,
                    received: *it.fingerprint,
                };
                let detail = conflict.to_string();
                let subject = self.subject(n);
                tx.conn()
                    .record_rejection(&conflict_rejection(&subject, &detail))
                    .await?;
                BatchResult::Done(Err(Error::Conflict(conflict)))
            }
            Some(Decision::Claimable) | None => BatchResult::Alone,
        })
    }

    /// The `n`th body directly in the batch transaction, then its hooks: any failure rolls the
    /// whole run back.
    async fn run_optimistic(
        &self,
        tx: &mut ClaimTx<'_, DB::Connection>,
        n: usize,
    ) -> Result<Step, sqlx::Error> {
        let it = self.items[n];
        let body = run_body(
            it.handler.consumer(),
            it.key.as_str(),
            it.handler.call_body(tx.conn().as_any(), it.msg),
        )
        .await;
        if let Err(failure) = body {
            tx.rollback().await?;
            // A batch that lost to concurrent transactions (a deadlock above all) is not run
            // again against the same competitors: every message runs alone.
            if let Some(contention) = Contention::in_chain(&*failure.error) {
                return Ok(Step::Stop(BatchRun::Contended(contention)));
            }
            return Ok(Step::Stop(BatchRun::Isolate(Some((n, failure)))));
        }
        if before_commit(tx, self.env.hooks, &self.info(n))
            .await
            .is_err()
        {
            // The isolated run finds it again and records it.
            tx.rollback().await?;
            return Ok(Step::Stop(BatchRun::Isolate(None)));
        }
        Ok(Step::Settled(
            BatchResult::Done(Ok(Outcome::Processed(()))),
            true,
        ))
    }

    /// The `n`th handler isolated by a savepoint, then its hooks; or the failure it already
    /// returned in the optimistic run (its writes were rolled back with that run).
    async fn run_isolated(
        &self,
        tx: &mut ClaimTx<'_, DB::Connection>,
        n: usize,
        attempts: u32,
        failed: Option<BodyError>,
    ) -> Result<Step, sqlx::Error> {
        let it = self.items[n];
        let mut savepoint = tx.savepoint().await?;
        let body = match failed {
            Some(failure) => Err(failure),
            None => {
                run_body(
                    it.handler.consumer(),
                    it.key.as_str(),
                    it.handler.call_body(savepoint.conn().as_any(), it.msg),
                )
                .await
            }
        };
        let failure = match body {
            Ok(()) => match before_commit(&mut savepoint, self.env.hooks, &self.info(n)).await {
                Ok(()) => {
                    // No separate check here, unlike the single path: a body that swallowed a
                    // database error left the transaction aborted, and RELEASE SAVEPOINT then
                    // fails; the batch fails as a whole and every message of it takes the
                    // single path, which checks, records and reports it.
                    savepoint
                        .finish(Verify::Nothing)
                        .await
                        .map_err(|(_, e)| e)?;
                    return Ok(Step::Settled(
                        BatchResult::Done(Ok(Outcome::Processed(()))),
                        true,
                    ));
                }
                Err(source) => {
                    savepoint.rollback().await?;
                    drop(savepoint);
                    let result = self.hook_failed(tx, n, attempts, source).await?;
                    return Ok(Step::Settled(result, false));
                }
            },
            Err(failure) => failure,
        };
        if let Some(contention) = Contention::in_chain(&*failure.error) {
            // Lost to concurrent transactions: the batch keeps its other locks, so it is not
            // finished against the same competitors; every message runs alone. A MySQL
            // deadlock rolled the whole transaction back: the savepoint is gone, and the
            // rollback of the savepoint fails (ignored).
            let _ = savepoint.rollback().await;
            drop(savepoint);
            if let Err(error) = tx.rollback().await
                && connection_lost(&error)
            {
                return Err(error);
            }
            return Ok(Step::Stop(BatchRun::Contended(contention)));
        }
        savepoint.rollback().await?;
        drop(savepoint);
        let result = self.handler_failed(tx, n, attempts, failure).await?;
        Ok(Step::Settled(result, false))
    }

    /// A before-commit hook failed for the `n`th handler (its savepoint rolled back): the
    /// attempt is recorded in the batch transaction — or, for a fenced delivery (a zombie's),
    /// the claim is given back and nothing recorded (the partition's new owner processes the
    /// key).
    async fn hook_failed(
        &self,
        tx: &mut ClaimTx<'_, DB::Connection>,
        n: usize,
        attempts: u32,
        source: BoxError,
    ) -> Result<BatchResult, sqlx::Error> {
        let it = self.items[n];
        let disposition = if Fenced::is_in(&*source) {
            self.unclaim(tx, n).await?;
            Disposition::NotRecorded
        } else {
            let text = format!("before-commit hook failed: {source}");
            self.record(tx, n, ErrorClass::Retryable, &text, attempts)
                .await?
                .0
        };
        Ok(BatchResult::Done(Err(Error::Hook(HookError {
            consumer: it.handler.consumer().to_owned(),
            key: it.key.clone(),
            disposition,
            source,
        }))))
    }

    /// The `n`th handler failed (its savepoint rolled back): a transient failure gives the
    /// claim back and runs alone (retried in-process on the single path after the batch
    /// commits, as `dispatch` would: no attempt counted); any other is recorded in the batch
    /// transaction.
    async fn handler_failed(
        &self,
        tx: &mut ClaimTx<'_, DB::Connection>,
        n: usize,
        attempts: u32,
        failure: BodyError,
    ) -> Result<BatchResult, sqlx::Error> {
        if failure.class == ErrorClass::Transient {
            self.unclaim(tx, n).await?;
            return Ok(BatchResult::Alone);
        }
        let (disposition, attempts) = self
            .record(tx, n, failure.class, &failure.text, attempts)
            .await?;
        Ok(BatchResult::Done(Err(Error::Handler(HandlerFailure {
            error: failure.error,
            class: failure.class,
            attempts,
            disposition,
        }))))
    }

    /// Undoes the batch's claim of the `n`th key (after its savepoint was rolled back).
    async fn unclaim(
        &self,
        tx: &mut ClaimTx<'_, DB::Connection>,
        n: usize,
    ) -> Result<(), sqlx::Error> {
        let it = self.items[n];
        tx.conn()
            .unclaim(it.handler.consumer(), it.key.as_str(), it.payload)
            .await
    }

    /// Records the failed attempt of the `n`th key in the batch transaction (after its
    /// savepoint was rolled back): what was recorded, and the attempts so far.
    async fn record(
        &self,
        tx: &mut ClaimTx<'_, DB::Connection>,
        n: usize,
        class: ErrorClass,
        text: &str,
        attempts: u32,
    ) -> Result<(Disposition, u32), sqlx::Error> {
        let max_attempts = self.items[n].handler.max_attempts();
        Attempt::new(self.env.policy, max_attempts, class, text, attempts)
            .record_in_transaction(tx.conn(), &self.subject(n), attempts)
            .await
    }

    /// Verify and COMMIT. An optimistic run checks once for the whole batch, on its first
    /// claimed key: a handler that swallowed a database error and returned `Ok` left the
    /// transaction aborted (PostgreSQL), and COMMIT would silently roll it back. Returns `false`
    /// if that check failed (rolled back: the isolated run then finds which handler it was).
    async fn commit(
        &self,
        tx: &mut ClaimTx<'_, DB::Connection>,
        claimed: &[Option<u32>],
        isolate: bool,
    ) -> Result<bool, sqlx::Error> {
        let first_claimed = self
            .requests
            .iter()
            .zip(claimed)
            .find_map(|(request, attempts)| attempts.map(|_| request))
            .filter(|_| !isolate);
        let verify = match first_claimed {
            Some(request) => Verify::Claim {
                consumer: request.consumer,
                key: request.message_key,
            },
            None => Verify::Nothing,
        };
        match tx.finish(verify).await {
            Ok(()) => Ok(true),
            Err((StoreOperation::Verify, _)) => Ok(false),
            Err((_, error)) => Err(error),
        }
    }
}

/// Whether `error` says that the server's transaction is not the one the connection counts
/// (PostgreSQL's `25P01`, no transaction, or `3B001`, no such savepoint: a handler ended the
/// batch's transaction with a `ROLLBACK` or `COMMIT` of its own, and a savepoint's `RELEASE`
/// then failed). The rollbacks queued for the transaction would fail the connection's next
/// statement: it is closed instead, as a lost one.
fn transaction_gone(error: &sqlx::Error) -> bool {
    matches!(error, sqlx::Error::Database(db)
        if matches!(db.code().as_deref(), Some("25P01" | "3B001")))
}

/// PostgreSQL: the batch transaction's `lock_timeout` (`SET LOCAL`), if one is asked for.
async fn set_lock_timeout<C: InboxConnection>(
    tx: &mut ClaimTx<'_, C>,
    timeout: Option<Duration>,
) -> Result<(), sqlx::Error> {
    if let Some(timeout) = timeout {
        tx.conn().set_lock_timeout(timeout).await?;
    }
    Ok(())
}
