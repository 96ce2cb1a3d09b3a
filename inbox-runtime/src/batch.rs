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
    /// PostgreSQL: the batch transaction's `lock_timeout` (`SET LOCAL`), so that a batch that
    /// waits on a lock longer than this (another batch in flight holds it, perhaps waiting for
    /// this one in turn) gives up at once instead of after the server's `deadlock_timeout`,
    /// and its messages run alone. `None`: the server's setting.
    pub(crate) lock_timeout: Option<Duration>,
    /// The Worker's batch gate: held shared while the batch runs, exclusively when a batch
    /// that lost to concurrent transactions runs again. `None`: such a batch's messages run
    /// one by one at once.
    pub(crate) gate: Option<Arc<tokio::sync::RwLock<()>>>,
}

/// What happened to one batch, beside its results.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct BatchStats {
    /// The batch transaction lost to concurrent transactions (a deadlock, a serialization
    /// failure, a lock wait that timed out) and its messages ran alone.
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
    /// runs once more *alone* — after the Worker's other batches in flight have ended, with
    /// none started beside it — and only if it loses again (to transactions outside the
    /// Worker) do its messages run one by one. The handlers that ran before the failure run
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
            // Batches of one Worker share its gate: each runs holding it shared; one that lost to
            // concurrent transactions runs again holding it exclusively (no other batch of the
            // Worker beside it, none waiting for its locks), without a lock timeout.
            let mut shared = match &options.gate {
                Some(gate) => Some(Arc::clone(gate).read_owned().await),
                None => None,
            };
            let mut exclusive = None;
            let run = loop {
                let lock_timeout = options.lock_timeout.filter(|_| exclusive.is_none());
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
                        lock_timeout,
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
                            lock_timeout,
                        )
                        .await;
                }
                // A batch transaction that lost to concurrent transactions: run again alone
                // (once, when a gate is given), else its messages run one by one.
                let contention = match &run {
                    Ok(BatchRun::Contended(contention)) => Some(*contention),
                    Err(error) => Contention::of_sqlx(error),
                    Ok(_) => None,
                };
                let Some(contention) = contention else {
                    break run;
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
                        size = batch.len(),
                        "batch lost to concurrent transactions; running it again alone"
                    );
                    exclusive = Some(gate.write_owned().await);
                    continue;
                }
                tracing::debug!(
                    error = contention.as_str(),
                    size = batch.len(),
                    "batch lost to concurrent transactions; running its messages one by one"
                );
                break run;
            };
            drop((shared, exclusive));
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
        lock_timeout: Option<Duration>,
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
        if let Some(timeout) = lock_timeout
            && let Some(pg) =
                sqlx::PgConnection::from_any(DB::Connection::in_transaction(&mut tx).as_any())
        {
            let millis = timeout.as_millis().clamp(1, i32::MAX as u128).to_string();
            sqlx::query("SELECT set_config('lock_timeout', $1, true)")
                .bind(format!("{millis}ms"))
                .execute(&mut *pg)
                .await?;
        }
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
