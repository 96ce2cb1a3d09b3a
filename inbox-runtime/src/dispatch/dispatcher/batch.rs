//! The dispatcher's batch entry points: envelopes prepared, asked of the dedupe cache, the rest
//! run by the protocol's batch driver ([`crate::protocol::batch`]) in one transaction, and what
//! it did not settle run alone on the single path.

use std::borrow::Borrow;
use std::collections::HashSet;

use super::{ConsumerOutcome, Decoded, Dispatcher, Prepared, PreparedItem};
use crate::protocol::batch::{self, BatchEnv, BatchItem, BatchOptions, BatchResult, BatchStats};
use crate::protocol::single::observe;
use crate::store::InboxDatabase;
use crate::types::classify::BoxError;
use crate::types::error::{DispatchError, Error};
use crate::types::outcome::Outcome;
use crate::types::slot::ConnectionSlot;

/// Where one consumer's result comes from.
enum Resolution {
    /// Settled by the batch transaction (after it committed).
    Done(Result<Outcome<()>, Error<BoxError>>),
    /// Run through the single path after the batch: ordered messages, keys repeated within the
    /// batch, keys found `failed` meanwhile, transient failures, or everything if the batch
    /// transaction itself failed.
    Single,
    /// As [`Resolution::Single`], after a dedupe cache miss (the single path does not ask again).
    SingleMissed,
    /// Answered by the dedupe cache, without the database.
    Cached(Result<Outcome<()>, Error<BoxError>>),
}

/// A cache's answer for one consumer item: `Some(Some(result))` answered, `Some(None)` a miss
/// (or another fingerprint: the database decides), `None` not asked (no cache).
type CacheAnswer = Option<Option<Result<Outcome<()>, Error<BoxError>>>>;

impl<DB: InboxDatabase> Dispatcher<DB> {
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
        crate::store::within(self.prefix.as_ref(), async {
            self.dispatch_batch_on(&mut ConnectionSlot::new(), envelopes)
                .await
        })
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
        crate::store::within(self.prefix.as_ref(), async {
            self.dispatch_batch_with(slot, envelopes, Vec::new(), BatchOptions::default())
                .await
                .0
        })
        .await
    }

    /// [`dispatch_batch_on`](Self::dispatch_batch_on) with the Worker's options, and what
    /// happened to the batch. `decoded` holds, for the first envelopes, what
    /// [`decode`](Self::decode) already returned for each (`None`, or past its end: decoded
    /// here).
    pub(crate) async fn dispatch_batch_with<E: Borrow<crate::Envelope>>(
        &self,
        slot: &mut ConnectionSlot<DB>,
        envelopes: &[E],
        decoded: Vec<Option<Result<Decoded, DispatchError>>>,
        options: BatchOptions,
    ) -> (Vec<Result<Vec<ConsumerOutcome>, DispatchError>>, BatchStats) {
        let mut decoded = decoded.into_iter();
        let prepared: Vec<Result<Prepared<'_>, DispatchError>> = envelopes
            .iter()
            .map(|e| self.prepare_from(e.borrow(), decoded.next().flatten()))
            .collect();
        let (mut settles, batched) = self.plan_batch(&prepared).await;
        let items: Vec<BatchItem<'_>> = batched
            .iter()
            .map(|&(e, i)| {
                let p = prepared[e]
                    .as_ref()
                    .expect("only prepared envelopes are batched");
                let item = &p.items[i];
                let (_, msg, fingerprint) = &p.decoded[item.message];
                BatchItem {
                    handler: item.handler,
                    msg: &**msg,
                    key: &item.key,
                    fingerprint,
                    payload: &p.envelope.payload,
                    source: p.envelope.source.as_ref(),
                    headers: Some(&p.envelope.headers),
                }
            })
            .collect();
        let env = BatchEnv {
            pool: &self.pool,
            policy: &self.policy,
            hooks: self.hook_runner(),
        };
        let mut slot = slot.guard();
        let (results, stats) = batch::run(&mut slot, &env, &items, &options).await;
        drop(items);
        for (&(e, i), result) in batched.iter().zip(results) {
            if let BatchResult::Done(result) = result {
                settles[e][i] = Resolution::Done(result);
            }
        }
        let mut results = Vec::with_capacity(prepared.len());
        for (p, env_settles) in prepared.into_iter().zip(settles) {
            results.push(match p {
                Ok(p) => Ok(self.settle_envelope(&mut slot, &p, env_settles).await),
                Err(error) => Err(error),
            });
        }
        slot.done();
        (results, stats)
    }

    /// Where each consumer item of the prepared envelopes is settled (asking the dedupe cache
    /// first), and the `(envelope, item)` positions the batch transaction takes: the first of
    /// each key, unless ordered.
    async fn plan_batch(
        &self,
        prepared: &[Result<Prepared<'_>, DispatchError>],
    ) -> (Vec<Vec<Resolution>>, Vec<(usize, usize)>) {
        let mut batched: Vec<(usize, usize)> = Vec::new();
        let mut seen = HashSet::new();
        let mut settles: Vec<Vec<Resolution>> = Vec::with_capacity(prepared.len());
        let mut cached = self.cached_batch(prepared).await.into_iter();
        for (e, p) in prepared.iter().enumerate() {
            let mut env_settles = Vec::new();
            if let Ok(p) = p {
                for (i, item) in p.items.iter().enumerate() {
                    let settle = match cached.next().flatten() {
                        Some(Some(result)) => Resolution::Cached(result),
                        Some(None) => Resolution::SingleMissed,
                        None => Resolution::Single,
                    };
                    if !matches!(settle, Resolution::Cached(_)) {
                        let unique = seen.insert((item.handler.consumer(), item.key.as_str()));
                        if unique && item.ordering.is_none() {
                            batched.push((e, i));
                        }
                    }
                    env_settles.push(settle);
                }
            }
            settles.push(env_settles);
        }
        (settles, batched)
    }

    /// One envelope's results: what the batch or the cache settled (counted, and cached when
    /// final), the rest run on the single path.
    async fn settle_envelope(
        &self,
        slot: &mut ConnectionSlot<DB>,
        p: &Prepared<'_>,
        settles: Vec<Resolution>,
    ) -> Vec<ConsumerOutcome> {
        let mut outcomes = Vec::with_capacity(p.items.len());
        for (item, settled) in p.items.iter().zip(settles) {
            outcomes.push(match settled {
                Resolution::Done(result) => {
                    observe(item.handler.consumer(), &result);
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
                Resolution::Cached(result) => {
                    observe(item.handler.consumer(), &result);
                    ConsumerOutcome::of(item.handler, result)
                }
                Resolution::Single => self.run_item(slot, p, item).await,
                Resolution::SingleMissed => self.run_item_looked_up(slot, p, item, false).await,
            });
        }
        outcomes
    }

    /// The dedupe cache's answers for every consumer item of the prepared envelopes, in order.
    /// One lookup round trip for the whole batch.
    async fn cached_batch(
        &self,
        prepared: &[Result<Prepared<'_>, DispatchError>],
    ) -> Vec<CacheAnswer> {
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
                super::answer(cache, item.handler, entry, fingerprint)
            })));
        }
        answers
    }
}
