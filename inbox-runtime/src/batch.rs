//! Batch claims: one transaction claims and processes a batch of deliveries.

use std::borrow::Borrow;
use std::collections::HashSet;
use std::sync::Arc;
use std::time::Duration;

use sqlx::Connection as _;

use crate::classify::{BoxError, Contention, ErrorClass};
use crate::dispatcher::{ConsumerOutcome, Dispatcher, Prepared, PreparedItem};
use crate::error::{Conflict, DispatchError, Error, HandlerFailure, HookError};
use crate::outcome::Outcome;
use crate::protocol::erased::BodyError;
use crate::protocol::failure::{Attempt, Subject, conflict_rejection};
use crate::protocol::hooks::ClaimInfo;
use crate::protocol::{Decision, decide, verify};
use crate::slot::ConnectionSlot;
use crate::status::ClaimMode;
use crate::store::{ClaimRequest, ClaimResult, ClaimStore as _, InboxConnection, InboxDatabase};

/// How the [`Worker`](crate::Worker) asks for one batch to run.
#[derive(Debug, Clone, Default)]
pub(crate) struct BatchOptions {
    /// PostgreSQL: the `lock_timeout` of the batch's handlers (`set_config(…, true)`), when
    /// another batch may run its handlers beside them, so that a batch that waits on a lock
    /// longer than this (another batch holds it, perhaps waiting for this one in turn) gives
    /// up at once instead of after the server's `deadlock_timeout`. `None`: the server's
    /// setting.
    pub(crate) lock_timeout: Option<Duration>,
    /// The Worker's effect gate: the batch runs its handlers (between its claim and its
    /// commit) holding one of its permits, and a batch that lost to concurrent transactions
    /// runs once more through it, with one batch's handlers at a time. `None`: no limit, and
    /// such a batch's messages run one by one at once.
    pub(crate) effects: Option<Arc<EffectGate>>,
}

/// Clean batches before one more batch may run its handlers beside the others, until a batch
/// first lost to concurrent transactions: a Worker starts with one batch's handlers at a time
/// and ramps up.
const RAMP_BATCHES: usize = 4;
/// Clean batches whose handlers run one batch at a time after the first contention, before one
/// more batch may run its handlers beside them; four times as many after every further
/// contention (up to [`CALM_BATCHES_MAX`]).
const CALM_BATCHES: usize = 64;
/// The most clean batches [`CALM_BATCHES`] grows to.
const CALM_BATCHES_MAX: usize = 4096;

/// How many of a Worker's batches may run their **handlers** at once. A batch claims its keys
/// and commits outside the gate, so the claims and commits (a multi-row insert, a WAL flush)
/// of the batches in flight overlap whatever the limit; only the handler phases, which take
/// the effects' row locks in an order the runtime cannot sort, are limited.
///
/// With a limit of 1 the batches in flight cannot deadlock each other: the one running its
/// handlers waits at most for the commits of those that ran theirs before it (which wait for
/// no lock of it), and the claims take the inbox rows in one sorted order.
///
/// The limit adapts: 1 at first, up by one after every [`RAMP_BATCHES`] clean batches (up to
/// the most given), back to 1 as soon as a batch loses to concurrent transactions, then up by
/// one after [`CALM_BATCHES`] clean batches (four times as many after every further loss, up
/// to [`CALM_BATCHES_MAX`]). Only batches that entered the gate under the current limit count.
///
/// A semaphore whose size changes: lowering it takes back the free permits at once and the
/// others as their batches leave the gate.
#[derive(Debug)]
pub(crate) struct EffectGate {
    permits: Arc<tokio::sync::Semaphore>,
    /// The most the limit grows to.
    most: usize,
    state: std::sync::Mutex<GateState>,
}

#[derive(Debug)]
struct GateState {
    limit: usize,
    /// Permits still to take back (held by batches when the limit was lowered).
    owed: usize,
    /// Batches running their handlers now.
    running: usize,
    /// Changes of the limit so far: a batch's entry is counted under the limit it entered at.
    epoch: u64,
    /// Clean batches under the current limit.
    calm: usize,
    /// Clean batches needed before the limit goes up by one.
    calm_needed: usize,
}

impl EffectGate {
    /// A gate that lets one batch run its handlers at a time at first, and up to `most` (at
    /// least 1) while batches stay clean.
    pub(crate) fn new(most: usize) -> Self {
        Self {
            permits: Arc::new(tokio::sync::Semaphore::new(1)),
            most: most.max(1),
            state: std::sync::Mutex::new(GateState {
                limit: 1,
                owed: 0,
                running: 0,
                epoch: 0,
                calm: 0,
                calm_needed: RAMP_BATCHES,
            }),
        }
    }

    fn state(&self) -> std::sync::MutexGuard<'_, GateState> {
        self.state
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// The batches that may run their handlers at once now.
    pub(crate) fn limit(&self) -> usize {
        self.state().limit
    }

    /// Waits for a turn to run handlers (first come, first served); the turn ends when the
    /// returned permit is dropped.
    pub(crate) async fn enter(self: &Arc<Self>) -> EffectPermit {
        let permit = Arc::clone(&self.permits)
            .acquire_owned()
            .await
            .expect("the effect gate's semaphore is never closed");
        let mut state = self.state();
        state.running += 1;
        EffectPermit {
            gate: Arc::clone(self),
            permit: Some(permit),
            epoch: state.epoch,
            shared: state.running > 1,
        }
    }

    /// A batch that entered at `epoch` (`None`: it lost before its turn) lost to concurrent
    /// transactions: one batch's handlers at a time from now on, for longer after every
    /// further loss. A loss under an earlier limit was already answered.
    pub(crate) fn lost(&self, epoch: Option<u64>) {
        let mut state = self.state();
        if epoch.is_some_and(|epoch| epoch != state.epoch) {
            return;
        }
        if state.limit > 1 {
            tracing::info!(
                was = state.limit,
                calm_batches = state.calm_needed,
                "a batch lost to concurrent transactions; running one batch's handlers at a time for a while"
            );
        }
        state.calm_needed = if state.limit > 1 || state.calm_needed < CALM_BATCHES {
            (state.calm_needed * 4).clamp(CALM_BATCHES, CALM_BATCHES_MAX)
        } else {
            state.calm_needed
        };
        self.set_limit(&mut state, 1);
    }

    /// A batch that entered at `epoch` committed without losing: after enough of them under
    /// the current limit, one more batch may run its handlers beside the others.
    pub(crate) fn clean(&self, epoch: u64) {
        let mut state = self.state();
        if epoch != state.epoch || state.limit >= self.most {
            return;
        }
        state.calm += 1;
        if state.calm >= state.calm_needed {
            let limit = state.limit + 1;
            self.set_limit(&mut state, limit);
        }
    }

    /// Sets the limit (a new epoch, no clean batch counted yet): raising it adds permits (or
    /// cancels permits still owed), lowering it takes back free permits and owes the rest.
    fn set_limit(&self, state: &mut GateState, limit: usize) {
        if limit > state.limit {
            let up = limit - state.limit;
            let repaid = up.min(state.owed);
            state.owed -= repaid;
            self.permits.add_permits(up - repaid);
        } else {
            let down = state.limit - limit;
            let taken = self.permits.forget_permits(down);
            state.owed += down - taken;
        }
        state.limit = limit;
        state.epoch += 1;
        state.calm = 0;
    }
}

/// A batch's turn to run its handlers (see [`EffectGate`]); ends when dropped.
#[derive(Debug)]
pub(crate) struct EffectPermit {
    gate: Arc<EffectGate>,
    permit: Option<tokio::sync::OwnedSemaphorePermit>,
    /// The gate's epoch when the turn began.
    epoch: u64,
    /// Whether other batches were running their handlers when this one's turn began: of two
    /// batches whose handlers wait for each other's locks, the later one gives up (see
    /// [`BatchOptions::lock_timeout`]), the earlier one waits.
    shared: bool,
}

impl Drop for EffectPermit {
    fn drop(&mut self) {
        let mut state = self.gate.state();
        state.running -= 1;
        if state.owed > 0 {
            // The limit was lowered while this batch ran its handlers: this permit is taken back.
            state.owed -= 1;
            if let Some(permit) = self.permit.take() {
                permit.forget();
            }
        }
    }
}

/// How one run of the batch transaction runs its handlers: through the Worker's effect gate
/// (if any), with a lock timeout when another batch's handlers run beside them.
struct Gated<'a> {
    /// The handlers' lock timeout (PostgreSQL), set only if another batch was running its
    /// handlers when this run's turn began.
    lock_timeout: Option<Duration>,
    /// The Worker's effect gate.
    gate: Option<&'a Arc<EffectGate>>,
    /// The gate's epoch when the run's turn began (`None`: no gate, or the run ended before).
    entered: Option<u64>,
}

/// What happened to one batch, beside its results.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct BatchStats {
    /// The batch transaction lost to concurrent transactions (a deadlock, a serialization
    /// failure, a lock wait that timed out), and ran again or its messages ran alone.
    pub(crate) contention: Option<Contention>,
}

/// Where one consumer's result comes from.
enum Settle {
    /// Settled by the batch transaction (after it committed).
    Done(Result<Outcome<()>, Error<BoxError>>),
    /// Run through the single path after the batch: ordered messages, keys repeated within the
    /// batch, keys found `failed` meanwhile, transient failures, or everything if the batch
    /// transaction itself failed.
    Single,
    /// As [`Settle::Single`], after a dedupe cache miss (the single path does not ask again).
    SingleMissed,
    /// Answered by the dedupe cache, without the database.
    Cached(Result<Outcome<()>, Error<BoxError>>),
}

impl<DB> Dispatcher<DB>
where
    DB: InboxDatabase,
    DB::Connection: InboxConnection,
{
    /// Processes a batch of deliveries (as a broker poll returns them) in **one** transaction:
    /// one multi-row claim statement for all of them, then each handler, one commit. Ack the
    /// deliveries after this returns.
    ///
    /// Returns one result per envelope, in order, exactly as [`Dispatcher::dispatch`] would:
    /// the same outcomes and errors, the same guarantees. Failed attempts are recorded in the
    /// batch transaction (`failed` with a next attempt time, or `dead`); conflicts are kept in
    /// `inbox_rejections`.
    ///
    /// **How one failure is kept from undoing the others.** On PostgreSQL the batch first runs
    /// optimistically: every handler directly in the batch transaction, then one check that the
    /// transaction is not aborted, then `COMMIT` — one round trip per handler body. If a handler
    /// returns an error, or left the transaction aborted, that transaction is rolled back and the
    /// batch runs again with each handler isolated by a savepoint (`SAVEPOINT`, body, `RELEASE`
    /// or `ROLLBACK TO`), so that the failure is recorded and the others commit. The failing
    /// handler is not called again (its error is recorded as it was returned); the handlers
    /// before it are (their database writes from the first run were rolled back; effects outside
    /// the database happen twice, as on any retry). If that second run fails as a whole too (a
    /// handler left the transaction aborted), every message takes the one-message path below,
    /// where each handler runs once more — the one that failed first included. On SQLite, where a statement can end the
    /// transaction (`INSERT OR ROLLBACK`, a trigger's `RAISE(ROLLBACK)`) and savepoints cost no
    /// round trip, batches always run with savepoints.
    ///
    /// **Contention.** A batch whose transaction loses to concurrent transactions — a deadlock
    /// (PostgreSQL `40P01`, MySQL 1213), a serialization failure (`40001`) or a lock wait that
    /// timed out (`55P03`, MySQL 1205), from the claim, a handler body or `COMMIT` — or in
    /// which a handler fails with such an error, is rolled back and **not** run
    /// again as the same batch against the same competitors (that would take the same locks in
    /// the same order): called here, each of its messages runs alone on the one-message path,
    /// whose transactions each hold one message's locks and commit at once, so the batch makes
    /// progress whatever the others do. Through the [`Worker`](crate::Worker), the batch first
    /// runs once more with no other batch's handlers beside its own (the Worker's gate goes
    /// back to one batch's handlers at a time, see [`Worker::batch`](crate::Worker::batch)),
    /// and only if it loses again (to transactions outside the Worker) do its messages run one
    /// by one. The handlers that ran before the failure run
    /// once more (their writes were rolled back with the batch: a handler re-runs its
    /// neighbours' transaction, not their effects). Each lost run is counted in the
    /// `inbox_batch_contention_total` counter (label `error`: `deadlock`, `serialization`,
    /// `lock_timeout`), each such batch in
    /// [`WorkerReport::contention_fallbacks`](crate::WorkerReport).
    ///
    /// Some deliveries take the one-message-per-transaction path after the batch commits:
    /// messages with per-aggregate ordering (their aggregate lock must not be held across the
    /// batch), a key that appears twice in the batch (the later ones), a key found `failed`
    /// (retried with its own claim), and transient failures (retried in-process). If the batch
    /// transaction fails as a whole (lost connection, failed commit), every delivery of it takes
    /// that path: the claims make that safe whatever had been committed.
    ///
    /// Acquires one pooled connection per call; see [`dispatch_batch_on`](Self::dispatch_batch_on)
    /// to hold one across batches.
    pub async fn dispatch_batch(
        &self,
        envelopes: &[crate::Envelope],
    ) -> Vec<Result<Vec<ConsumerOutcome>, DispatchError>> {
        self.dispatch_batch_on(&mut ConnectionSlot::new(), envelopes)
            .await
    }

    /// [`dispatch_batch`](Self::dispatch_batch) on the connection held by `slot` (see
    /// [`ConnectionSlot`]): the same results, without the pool's round trips per batch.
    ///
    /// `envelopes` may be envelopes or references to them (`&[&Envelope]`, so that a consumer
    /// holding its deliveries need not copy their payloads).
    pub async fn dispatch_batch_on<E: Borrow<crate::Envelope>>(
        &self,
        slot: &mut ConnectionSlot<DB>,
        envelopes: &[E],
    ) -> Vec<Result<Vec<ConsumerOutcome>, DispatchError>> {
        self.dispatch_batch_with(slot, envelopes, BatchOptions::default())
            .await
            .0
    }

    /// [`dispatch_batch_on`](Self::dispatch_batch_on) with the Worker's options, and what
    /// happened to the batch.
    pub(crate) async fn dispatch_batch_with<E: Borrow<crate::Envelope>>(
        &self,
        slot: &mut ConnectionSlot<DB>,
        envelopes: &[E],
        options: BatchOptions,
    ) -> (Vec<Result<Vec<ConsumerOutcome>, DispatchError>>, BatchStats) {
        let mut stats = BatchStats::default();
        let prepared: Vec<Result<Prepared<'_>, DispatchError>> =
            envelopes.iter().map(|e| self.prepare(e.borrow())).collect();
        // (envelope, item) pairs that the batch transaction takes.
        let mut batch: Vec<(usize, usize)> = Vec::new();
        let mut seen = HashSet::new();
        let mut settles: Vec<Vec<Settle>> = Vec::with_capacity(prepared.len());
        let cached = self.cached_batch(&prepared).await;
        let mut cached = cached.into_iter();
        for (e, p) in prepared.iter().enumerate() {
            let mut env_settles = Vec::new();
            if let Ok(p) = p {
                for (i, item) in p.items.iter().enumerate() {
                    let settle = match cached.next().flatten() {
                        Some(Some(result)) => Settle::Cached(result),
                        Some(None) => Settle::SingleMissed,
                        None => Settle::Single,
                    };
                    if matches!(settle, Settle::Cached(_)) {
                        env_settles.push(settle);
                        continue;
                    }
                    let unique = seen.insert((item.handler.consumer(), item.key.as_str()));
                    if unique && item.ordering.is_none() {
                        batch.push((e, i));
                    }
                    env_settles.push(settle);
                }
            }
            settles.push(env_settles);
        }

        // A fixed order of claims across concurrent batches keeps them from deadlocking.
        batch.sort_by(|a, b| {
            let key = |&(e, i): &(usize, usize)| {
                let item = &prepared[e].as_ref().expect("batched").items[i];
                (item.handler.consumer(), item.key.as_str())
            };
            key(a).cmp(&key(b))
        });
        let mut slot = slot.guard();
        if !batch.is_empty() {
            // Whether this is the run again after a loss to concurrent transactions.
            let mut again = false;
            let run = loop {
                // The effect gate's epoch at this run's turn to run its handlers.
                let mut gated = Gated {
                    lock_timeout: options.lock_timeout.filter(|_| !again),
                    gate: options.effects.as_ref(),
                    entered: None,
                };
                // Optimistic only where a handler cannot end the transaction under the batch's
                // feet: on PostgreSQL an error leaves it aborted (later statements fail, COMMIT
                // is checked first), whereas on SQLite an `OR ROLLBACK` conflict or a trigger's
                // `RAISE(ROLLBACK)` ends it and the statements after it would autocommit. SQLite
                // savepoints cost no round trip.
                let mut run = if DB::BACKEND == crate::Backend::Postgres {
                    self.run_batch(
                        &mut slot,
                        &prepared,
                        &batch,
                        Isolation::Optimistic,
                        &mut gated,
                    )
                    .await
                } else {
                    Ok(BatchRun::Isolate(None))
                };
                if let Ok(BatchRun::Isolate(failed)) = run {
                    tracing::debug!(
                        size = batch.len(),
                        "running the batch with a savepoint per handler"
                    );
                    run = self
                        .run_batch(
                            &mut slot,
                            &prepared,
                            &batch,
                            Isolation::Savepoints(failed),
                            &mut gated,
                        )
                        .await;
                }
                // A batch transaction that lost to concurrent transactions: run again (once,
                // through the Worker's effect gate, now at one batch's handlers at a time), else
                // its messages run one by one.
                let contention = match &run {
                    Ok(BatchRun::Contended(contention)) => Some(*contention),
                    Err(error) => Contention::of_sqlx(error),
                    Ok(_) => None,
                };
                let Some(contention) = contention else {
                    if let (Some(gate), Some(epoch), Ok(BatchRun::Done(_))) =
                        (&options.effects, gated.entered, &run)
                    {
                        gate.clean(epoch);
                    }
                    break run;
                };
                stats.contention.get_or_insert(contention);
                if let Some(gate) = &options.effects {
                    gate.lost(gated.entered);
                }
                metrics::counter!("inbox_batch_contention_total", "error" => contention.as_str())
                    .increment(1);
                if !again && options.effects.is_some() {
                    tracing::debug!(
                        error = contention.as_str(),
                        size = batch.len(),
                        "batch lost to concurrent transactions; running it again, one batch's handlers at a time"
                    );
                    again = true;
                    continue;
                }
                tracing::debug!(
                    error = contention.as_str(),
                    size = batch.len(),
                    "batch lost to concurrent transactions; running its messages one by one"
                );
                break run;
            };
            let contention = match &run {
                Ok(BatchRun::Contended(contention)) => Some(*contention),
                Err(error) => Contention::of_sqlx(error),
                Ok(_) => None,
            };
            match run {
                Ok(BatchRun::Done(results)) => {
                    for ((e, i), result) in batch.iter().zip(results) {
                        settles[*e][*i] = result;
                    }
                }
                Ok(BatchRun::Isolate(_)) => {
                    unreachable!("an isolated batch run never asks for isolation")
                }
                // Rolled back; every message of it takes the single path (still `Single`).
                Ok(BatchRun::Contended(_)) => {}
                Err(_) if contention.is_some() => {
                    // Rolled back; every message of it takes the single path.
                }
                Err(error) => {
                    if crate::slot::connection_lost(&error) {
                        slot.discard();
                    }
                    tracing::warn!(%error, size = batch.len(), "batch transaction failed; processing its messages one by one");
                }
            }
        }

        let mut results = Vec::with_capacity(prepared.len());
        for (p, env_settles) in prepared.into_iter().zip(settles) {
            let p = match p {
                Ok(p) => p,
                Err(error) => {
                    results.push(Err(error));
                    continue;
                }
            };
            let mut outcomes = Vec::with_capacity(p.items.len());
            for (item, settled) in p.items.iter().zip(env_settles) {
                outcomes.push(match settled {
                    Settle::Done(result) => {
                        crate::protocol::single::observe(item.handler.consumer(), &result);
                        let fingerprint = &p.decoded[item.message].2;
                        self.fill_cache(
                            item.handler.consumer(),
                            item.key.as_str(),
                            fingerprint,
                            &result,
                            crate::cache::Fill::IfAbsent,
                        )
                        .await;
                        ConsumerOutcome::of(item.handler, result)
                    }
                    Settle::Cached(result) => {
                        crate::protocol::single::observe(item.handler.consumer(), &result);
                        ConsumerOutcome::of(item.handler, result)
                    }
                    Settle::Single => self.run_item(&mut slot, &p, item).await,
                    Settle::SingleMissed => {
                        self.run_item_looked_up(&mut slot, &p, item, false).await
                    }
                });
            }
            results.push(Ok(outcomes));
        }
        slot.done();
        (results, stats)
    }

    /// The dedupe cache's answers for every consumer item of the prepared envelopes, in order:
    /// `Some(Some(result))` answered, `Some(None)` a miss (or another fingerprint: the database
    /// decides), `None` not asked (no cache). One lookup round trip for the whole batch.
    async fn cached_batch(
        &self,
        prepared: &[Result<Prepared<'_>, DispatchError>],
    ) -> Vec<Option<Option<Result<Outcome<()>, Error<BoxError>>>>> {
        let mut items: Vec<(&Prepared<'_>, &PreparedItem)> = Vec::new();
        for p in prepared.iter().flatten() {
            items.extend(p.items.iter().map(|item| (p, item)));
        }
        let Some(cache) = &self.cache else {
            return items.iter().map(|_| None).collect();
        };
        let keys: Vec<(&str, &str)> = items
            .iter()
            .map(|(_, item)| (item.handler.consumer(), item.key.as_str()))
            .collect();
        let entries = cache.get_many(&keys).await;
        let mut answers = Vec::with_capacity(items.len());
        for ((p, item), entry) in items.into_iter().zip(entries) {
            let fingerprint = &p.decoded[item.message].2;
            answers.push(Some(entry.and_then(|entry| {
                crate::dispatcher::answer(cache, item.handler, entry, fingerprint)
            })));
        }
        answers
    }

    /// The batch transaction, optimistic (handlers run directly in it) or with a savepoint per
    /// handler. An `Err` means nothing of it is known to be committed; [`BatchRun::Isolate`]
    /// that the optimistic run was rolled back because a handler failed (with its failure, if
    /// it returned one: the isolated run records it instead of calling the handler again, so
    /// that each delivery's handler runs once per attempt, as on the single path).
    async fn run_batch(
        &self,
        slot: &mut ConnectionSlot<DB>,
        prepared: &[Result<Prepared<'_>, DispatchError>],
        batch: &[(usize, usize)],
        isolation: Isolation,
        gated: &mut Gated<'_>,
    ) -> Result<BatchRun, sqlx::Error> {
        let (isolate, mut carried) = match isolation {
            Isolation::Optimistic => (false, None),
            Isolation::Savepoints(failed) => (true, failed),
        };
        let item = |&(e, i): &(usize, usize)| -> (&Prepared<'_>, &PreparedItem) {
            let p = prepared[e]
                .as_ref()
                .expect("only prepared envelopes are batched");
            (p, &p.items[i])
        };
        let hashes: Vec<String> = batch
            .iter()
            .map(|at| {
                let (p, it) = item(at);
                p.decoded[it.message].2.to_hex()
            })
            .collect();
        let requests: Vec<ClaimRequest<'_>> = batch
            .iter()
            .zip(&hashes)
            .map(|(at, hash)| {
                let (p, it) = item(at);
                ClaimRequest {
                    consumer: it.handler.consumer(),
                    message_key: it.key.as_str(),
                    message_name: it.handler.message_name(),
                    payload_hash: hash,
                    source: p.envelope.source.as_ref(),
                    mode: ClaimMode::Deliver,
                }
            })
            .collect();
        // The batch's `n`th message, at `at`, as a failure or conflict records it.
        let subject = |n: usize, at: &(usize, usize)| -> Subject<'_> {
            let (p, it) = item(at);
            Subject {
                consumer: it.handler.consumer(),
                key: it.key.as_str(),
                message_name: it.handler.message_name(),
                payload_hash: &hashes[n],
                payload: &p.envelope.payload,
                source: p.envelope.source.as_ref(),
                ordering: None,
            }
        };
        let info = |at: &(usize, usize)| -> ClaimInfo<'_> {
            let (p, it) = item(at);
            ClaimInfo {
                consumer: it.handler.consumer(),
                key: it.key.as_str(),
                message_name: it.handler.message_name(),
                payload: Some(&p.envelope.payload),
                source: p.envelope.source.as_ref(),
            }
        };
        let hooks = self.hook_runner();

        let conn = slot.get(&self.pool).await?;
        let mut tx = conn.begin_inbox().await?;
        let claimed = DB::Connection::in_transaction(&mut tx)
            .claim_batch(&requests)
            .await?;
        let taken: Vec<(&str, &str)> = requests
            .iter()
            .zip(&claimed)
            .filter(|(_, claimed)| claimed.is_none())
            .map(|(r, _)| (r.consumer, r.message_key))
            .collect();
        // The stored rows of the keys not claimed, by their request's position.
        let mut existing: Vec<Option<ClaimResult>> = requests.iter().map(|_| None).collect();
        let index = crate::store::request_index(&requests);
        for (consumer, key, found) in DB::Connection::in_transaction(&mut tx)
            .existing_batch(&taken)
            .await?
        {
            if let Some(&at) = index.get(&(consumer.as_str(), key.as_str())) {
                existing[at] = Some(found);
            }
        }

        // The handlers run in the Worker's effect gate (see `EffectGate`); the claim above and
        // the check and commit below do not.
        let turn = match gated.gate {
            Some(gate) => Some(gate.enter().await),
            None => None,
        };
        gated.entered = turn.as_ref().map(|turn| turn.epoch);
        // The lock timeout bounds the handlers' lock waits only when another batch may run its
        // handlers beside this one's (a claim waits for a key's earlier claim to commit, which
        // may be a batch waiting for its turn).
        if let Some(timeout) = gated
            .lock_timeout
            .filter(|_| turn.as_ref().is_none_or(|turn| turn.shared))
            && let Some(pg) =
                sqlx::PgConnection::from_any(DB::Connection::in_transaction(&mut tx).as_any())
        {
            let millis = timeout.as_millis().clamp(1, i32::MAX as u128).to_string();
            sqlx::query("SELECT set_config('lock_timeout', $1, true)")
                .bind(format!("{millis}ms"))
                .execute(&mut *pg)
                .await?;
        }
        let mut settles = Vec::with_capacity(batch.len());
        // The batch positions whose handler ran and committed, for the after-commit hooks.
        let mut processed = Vec::new();
        for (n, ((at, claimed), found)) in batch.iter().zip(&claimed).zip(&existing).enumerate() {
            let (p, it) = item(at);
            let (_, msg, fingerprint) = &p.decoded[it.message];
            let Some(attempts) = *claimed else {
                let decision = match found {
                    Some(ClaimResult::Existing {
                        status,
                        payload_hash,
                        retry_in,
                        ..
                    }) => decide(
                        *status,
                        payload_hash,
                        fingerprint,
                        ClaimMode::Deliver,
                        *retry_in,
                    )
                    .ok(),
                    _ => None,
                };
                // A key freed or taken over since, or a stored fingerprint that does not parse
                // (reported by the single path), takes the single path.
                settles.push(match decision {
                    Some(Decision::Settled(outcome)) => Settle::Done(Ok(outcome)),
                    Some(Decision::Conflict { stored }) => {
                        let conflict = Conflict {
                            consumer: it.handler.consumer().to_owned(),
                            message_name: it.handler.message_name().to_owned(),
                            key: it.key.clone(),
                            stored,
                            received: *fingerprint,
                        };
                        let detail = conflict.to_string();
                        let subject = subject(n, at);
                        DB::Connection::in_transaction(&mut tx)
                            .record_rejection(&conflict_rejection(&subject, &detail))
                            .await?;
                        Settle::Done(Err(Error::Conflict(conflict)))
                    }
                    Some(Decision::Claimable) | None => Settle::Single,
                });
                continue;
            };

            let index = settles.len();
            if !isolate {
                let body = it
                    .handler
                    .call_body(DB::Connection::in_transaction(&mut tx).as_any(), &**msg)
                    .await;
                if let Err(failure) = body {
                    tx.rollback().await?;
                    // A batch that lost to concurrent transactions (a deadlock above all) is
                    // not run again against the same competitors: every message runs alone.
                    if let Some(contention) = Contention::in_chain(&*failure.error) {
                        return Ok(BatchRun::Contended(contention));
                    }
                    return Ok(BatchRun::Isolate(Some((index, failure))));
                }
                if let Some(hooks) = hooks {
                    let info = info(at);
                    let hooked = hooks
                        .before_commit(DB::Connection::in_transaction(&mut tx).as_any(), &info)
                        .await;
                    if hooked.is_err() {
                        // The isolated run finds it again and records it.
                        tx.rollback().await?;
                        return Ok(BatchRun::Isolate(None));
                    }
                }
                settles.push(Settle::Done(Ok(Outcome::Processed(()))));
                processed.push(at);
                continue;
            }

            // The handler, isolated by a savepoint; or the failure it already returned in the
            // optimistic run (its writes were rolled back with that run).
            let mut savepoint = DB::Connection::in_transaction(&mut tx).begin().await?;
            let body = match carried.take_if(|(at, _)| *at == index) {
                Some((_, failure)) => Err(failure),
                None => {
                    it.handler
                        .call_body(
                            DB::Connection::in_transaction(&mut savepoint).as_any(),
                            &**msg,
                        )
                        .await
                }
            };
            let hooked = match (&body, hooks) {
                (Ok(()), Some(hooks)) => {
                    let info = info(at);
                    hooks
                        .before_commit(
                            DB::Connection::in_transaction(&mut savepoint).as_any(),
                            &info,
                        )
                        .await
                }
                _ => Ok(()),
            };
            match (body, hooked) {
                (Ok(()), Ok(())) => {
                    // No separate check here, unlike the single path: a body that swallowed a
                    // database error left the transaction aborted, and RELEASE SAVEPOINT then
                    // fails; the batch fails as a whole and every message of it takes the
                    // single path, which checks, records and reports it.
                    savepoint.commit().await?;
                    settles.push(Settle::Done(Ok(Outcome::Processed(()))));
                    processed.push(at);
                }
                (Ok(()), Err(source)) if crate::Fenced::is_in(&*source) => {
                    // A zombie's delivery: the claim is given back and nothing recorded (the
                    // partition's new owner processes the key).
                    savepoint.rollback().await?;
                    DB::Connection::in_transaction(&mut tx)
                        .unclaim(it.handler.consumer(), it.key.as_str(), &p.envelope.payload)
                        .await?;
                    settles.push(Settle::Done(Err(Error::Hook(HookError {
                        consumer: it.handler.consumer().to_owned(),
                        key: it.key.clone(),
                        disposition: crate::Disposition::NotRecorded,
                        source,
                    }))));
                }
                (Ok(()), Err(source)) => {
                    savepoint.rollback().await?;
                    let text = format!("before-commit hook failed: {source}");
                    let max_attempts = it.handler.max_attempts();
                    let (disposition, _) = Attempt::new(
                        &self.policy,
                        max_attempts,
                        ErrorClass::Retryable,
                        &text,
                        attempts,
                    )
                    .record_in_transaction(
                        DB::Connection::in_transaction(&mut tx),
                        &subject(n, at),
                        attempts,
                    )
                    .await?;
                    settles.push(Settle::Done(Err(Error::Hook(HookError {
                        consumer: it.handler.consumer().to_owned(),
                        key: it.key.clone(),
                        disposition,
                        source,
                    }))));
                }
                (Err(failure), _) if Contention::in_chain(&*failure.error).is_some() => {
                    // Lost to concurrent transactions: the batch keeps its other locks, so
                    // it is not finished against the same competitors; every message runs
                    // alone.
                    let contention = Contention::in_chain(&*failure.error).expect("checked");
                    // A MySQL deadlock rolled the whole transaction back: the savepoint is
                    // gone, and the rollback of the savepoint fails (ignored).
                    let _ = savepoint.rollback().await;
                    if let Err(error) = tx.rollback().await
                        && crate::slot::connection_lost(&error)
                    {
                        return Err(error);
                    }
                    return Ok(BatchRun::Contended(contention));
                }
                (Err(failure), _) if failure.class == ErrorClass::Transient => {
                    // Retried in-process on the single path after the batch commits, as
                    // `dispatch` would: the claim is given back, no attempt is counted.
                    savepoint.rollback().await?;
                    DB::Connection::in_transaction(&mut tx)
                        .unclaim(it.handler.consumer(), it.key.as_str(), &p.envelope.payload)
                        .await?;
                    settles.push(Settle::Single);
                }
                (Err(failure), _) => {
                    savepoint.rollback().await?;
                    let max_attempts = it.handler.max_attempts();
                    let (disposition, attempts) = Attempt::new(
                        &self.policy,
                        max_attempts,
                        failure.class,
                        &failure.text,
                        attempts,
                    )
                    .record_in_transaction(
                        DB::Connection::in_transaction(&mut tx),
                        &subject(n, at),
                        attempts,
                    )
                    .await?;
                    settles.push(Settle::Done(Err(Error::Handler(HandlerFailure {
                        error: failure.error,
                        class: failure.class,
                        attempts,
                        disposition,
                    }))));
                }
            }
        }
        drop(turn);
        if !isolate {
            // A handler that swallowed a database error and returned `Ok` left the transaction
            // aborted (PostgreSQL), and COMMIT would silently roll it back: check once for the
            // batch. The isolated run then finds which handler it was.
            let first_claimed = batch
                .iter()
                .zip(&claimed)
                .find_map(|(at, attempts)| attempts.map(|_| item(at).1));
            if let Some(it) = first_claimed {
                let verified = verify(
                    DB::Connection::in_transaction(&mut tx),
                    it.handler.consumer(),
                    it.key.as_str(),
                )
                .await;
                if verified.is_err() {
                    let _ = tx.rollback().await;
                    return Ok(BatchRun::Isolate(None));
                }
            }
        }
        tx.commit().await?;
        if let Some(hooks) = hooks {
            for at in processed {
                hooks.after_commit(&info(at));
            }
        }
        Ok(BatchRun::Done(settles))
    }
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
    Done(Vec<Settle>),
    /// The optimistic run was rolled back: a handler failed (returning this failure, at this
    /// batch index, or leaving the transaction aborted); run again with savepoints.
    Isolate(Option<(usize, BodyError)>),
    /// Rolled back after losing to concurrent transactions: every message runs alone.
    Contended(Contention),
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use futures_util::FutureExt as _;

    use super::{CALM_BATCHES, EffectGate, RAMP_BATCHES};

    /// `n` clean batches that entered at `epoch`.
    fn clean(gate: &EffectGate, epoch: u64, n: usize) {
        for _ in 0..n {
            gate.clean(epoch);
        }
    }

    #[test]
    fn the_limit_ramps_up_by_one_per_run_of_clean_batches_up_to_the_most() {
        let gate = EffectGate::new(3);
        assert_eq!(gate.limit(), 1);
        clean(&gate, 0, RAMP_BATCHES - 1);
        assert_eq!(gate.limit(), 1);
        clean(&gate, 0, 1);
        assert_eq!(gate.limit(), 2);
        // Batches that entered under the previous limit no longer count.
        clean(&gate, 0, RAMP_BATCHES);
        assert_eq!(gate.limit(), 2);
        clean(&gate, 1, RAMP_BATCHES);
        assert_eq!(gate.limit(), 3);
        clean(&gate, 2, 10 * RAMP_BATCHES);
        assert_eq!(gate.limit(), 3);
    }

    #[test]
    fn a_loss_goes_back_to_one_and_waits_longer_after_each_further_loss() {
        let gate = EffectGate::new(4);
        clean(&gate, 0, RAMP_BATCHES);
        assert_eq!(gate.limit(), 2);
        gate.lost(Some(1));
        assert_eq!(gate.limit(), 1);
        // A second loss of the same burst (entered under the old limit) is answered already.
        gate.lost(Some(1));
        assert_eq!(gate.state().calm_needed, CALM_BATCHES);
        clean(&gate, 2, CALM_BATCHES - 1);
        assert_eq!(gate.limit(), 1);
        clean(&gate, 2, 1);
        assert_eq!(gate.limit(), 2);
        gate.lost(Some(3));
        assert_eq!(
            (gate.limit(), gate.state().calm_needed),
            (1, 4 * CALM_BATCHES)
        );
        // A loss before the batch's turn (None) counts under the current limit.
        gate.lost(None);
        assert_eq!(gate.state().calm_needed, 4 * CALM_BATCHES);
    }

    #[test]
    fn a_lowered_limit_takes_back_the_turns_held_as_they_end() {
        let gate = Arc::new(EffectGate::new(2));
        clean(&gate, 0, RAMP_BATCHES);
        let first = gate.enter().now_or_never().expect("a free turn");
        let second = gate.enter().now_or_never().expect("a second free turn");
        assert_eq!((first.shared, second.shared), (false, true));
        assert!(gate.enter().now_or_never().is_none(), "two turns at most");
        gate.lost(Some(first.epoch));
        assert_eq!(gate.limit(), 1);
        drop(first);
        // The first turn to end was taken back: the second still holds the only one.
        assert!(gate.enter().now_or_never().is_none(), "one turn at most");
        drop(second);
        let third = gate
            .enter()
            .now_or_never()
            .expect("the one turn, free again");
        assert!(!third.shared);
        assert!(
            gate.enter().now_or_never().is_none(),
            "still one turn at most"
        );
        drop(third);
        // Raised again: a second turn beside the first.
        clean(&gate, 2, CALM_BATCHES);
        assert_eq!(gate.limit(), 2);
        let a = gate.enter().now_or_never().expect("a turn");
        let b = gate.enter().now_or_never().expect("a second turn");
        assert_eq!((a.shared, b.shared), (false, true));
    }

    #[test]
    fn raising_the_limit_cancels_turns_still_owed() {
        let gate = Arc::new(EffectGate::new(3));
        clean(&gate, 0, RAMP_BATCHES);
        clean(&gate, 1, RAMP_BATCHES);
        assert_eq!(gate.limit(), 3);
        let held: Vec<_> = (0..3)
            .map(|_| gate.enter().now_or_never().expect("a turn"))
            .collect();
        gate.lost(Some(2));
        assert_eq!(gate.state().owed, 2);
        let mut state = gate.state();
        gate.set_limit(&mut state, 2);
        assert_eq!(state.owed, 1);
        drop(state);
        drop(held);
        // Two turns, not one and not three.
        let a = gate.enter().now_or_never();
        let b = gate.enter().now_or_never();
        let c = gate.enter().now_or_never();
        assert_eq!((a.is_some(), b.is_some(), c.is_some()), (true, true, false));
    }
}
