//! The fast-path dedupe cache: a hint in front of the inbox that answers obvious duplicates
//! without a database round trip, and can never cause a lost or doubled effect.
//!
//! Seed 004's fifth technique ("a Redis `SET NX` with a TTL can drop obvious duplicates cheaply
//! before hitting the database — treat it as an optimization, not the guarantee"), with the
//! rules that the bugs of other stacks taught (Powertools caching "in progress" records so that
//! later deliveries were skipped, caching results before validating the payload, losing the
//! stored fingerprint on completion, a slow owner overwriting a newer record):
//!
//! * **Filled only after commit, only with final states**: [`Status::Processed`],
//!   [`Status::Dead`] and [`Status::Discarded`], each with the fingerprint stored in the inbox.
//!   Nothing else is ever cached: not a claim in progress, not a `failed` key (its retry must
//!   run), not a `parked` one, and never the absence of a key.
//! * **A hit is answered as the database would**: the same fingerprint → [`Outcome::Duplicate`]
//!   (or `Dead`, `Discarded`), without touching the database; another fingerprint → a
//!   [`Conflict`](crate::Conflict), recorded in `inbox_rejections` as on the database path.
//! * **A miss, an error or a timeout falls through** to the claim: the database stays the
//!   authority. Cache errors are counted and logged, never returned to the caller.
//! * **Deliveries fill "if absent"** (Redis `SET NX`), so a slow worker's late fill never
//!   overwrites a newer state; operators' changes (replay, discard) invalidate the key first and
//!   then fill with what they committed.
//! * **The TTL is never longer than the inbox's retention window**
//!   ([`Dispatcher::with_cache`](crate::Dispatcher::with_cache) refuses it otherwise): an entry
//!   never outlives by more than its TTL the row it stands for.
//!
//! Why a stale entry cannot double or lose an effect: a final state changes only by an
//! operator (a dead key replayed to `processed`, a dead key discarded), and for a delivery every
//! final state means the same thing — do not run, ack. An entry that still says `dead` after a
//! replay in another process answers `Dead` instead of `Duplicate`: the delivery is acked
//! either way, and the replay applied the effect once. What a cache must never do — say "free"
//! — it cannot say.
//!
//! The in-process [`MemoryCache`] (on `moka`) serves one process; `RedisCache` (feature
//! `redis`) is shared by every worker, so that a redelivery storm that moves between
//! processes still hits. Both implement [`DedupeCache`]; so can yours.
//!
//! Metrics: `inbox_cache_total{cache, consumer, result}` (counter; `result` is `hit`,
//! `conflict`, `miss`, `error`, `fill`, `fill_error`, `invalidate`, `invalidate_error`).
//!
//! [`Outcome::Duplicate`]: crate::Outcome::Duplicate

#[cfg(feature = "redis")]
pub mod redis;

use std::sync::Arc;
use std::time::Duration;

use crate::BoxFuture;
use crate::types::classify::BoxError;
use crate::types::fingerprint::Fingerprint;
use crate::types::status::Status;

/// What the cache keeps for one (consumer, idempotency key): a final state and the fingerprint
/// stored with it in the inbox.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CacheEntry {
    /// The key's final state: [`Status::Processed`], [`Status::Dead`] or
    /// [`Status::Discarded`] (see [`CacheEntry::new`]).
    pub status: Status,
    /// The payload fingerprint stored in the inbox for the key.
    pub fingerprint: Fingerprint,
}

impl CacheEntry {
    /// An entry for a key in `status` with `fingerprint`; `None` unless the status is final
    /// for deliveries (`processed`, `dead`, `discarded`): other states are never cached.
    pub fn new(status: Status, fingerprint: Fingerprint) -> Option<Self> {
        matches!(status, Status::Processed | Status::Dead | Status::Discarded).then_some(Self {
            status,
            fingerprint,
        })
    }

    /// The entry's text form, as `RedisCache` (feature `redis`) stores it:
    /// `<status> <fingerprint hex>`.
    pub fn to_text(&self) -> String {
        format!("{} {}", self.status.as_str(), self.fingerprint.to_hex())
    }

    /// Parses [`to_text`](Self::to_text)'s form; `None` for anything else (a damaged or foreign
    /// value, which the cache then treats as a miss).
    pub fn from_text(text: &str) -> Option<Self> {
        let (status, hex) = text.split_once(' ')?;
        let status: Status = status.parse().ok()?;
        Self::new(status, Fingerprint::from_hex(hex)?)
    }
}

/// A cache operation that failed (a Redis error, a timeout). The dispatcher counts and logs it
/// and goes on with the database.
#[derive(Debug, thiserror::Error)]
#[error("dedupe cache `{cache}`: {source}")]
pub struct CacheError {
    /// The cache's [`DedupeCache::name`].
    pub cache: &'static str,
    /// What failed.
    #[source]
    pub source: BoxError,
}

impl CacheError {
    /// A failure of cache `cache`.
    pub fn new(cache: &'static str, source: impl Into<BoxError>) -> Self {
        Self {
            cache,
            source: source.into(),
        }
    }
}

/// A cache whose time to live the dispatcher refuses: zero, or longer than the inbox's retention
/// window (an entry could then say "processed" for a key the inbox no longer holds, for longer
/// than the window promises).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "the dedupe cache's time to live ({ttl:?}) must be more than zero and at most the inbox's \
     retention window ({window:?})"
)]
pub struct CacheTtlError {
    /// The cache's time to live.
    pub ttl: Duration,
    /// The retention window it was checked against.
    pub window: Duration,
}

/// How a fill treats an entry already cached for the key.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Fill {
    /// Keep an existing entry (a delivery's fill: a late fill never overwrites a newer state).
    IfAbsent,
    /// Replace it (an operator's change, after invalidating: replay, discard).
    Replace,
}

/// A dedupe cache: (consumer, idempotency key) → [`CacheEntry`], with a time to live.
///
/// Implementations must be safe to call concurrently, bound their own latency (a slow cache is
/// a miss), and keep an entry at most [`ttl`](Self::ttl) after its fill.
pub trait DedupeCache: Send + Sync + 'static {
    /// A short name for metrics and logs (`memory`, `redis`).
    fn name(&self) -> &'static str;

    /// How long an entry lives after its fill.
    fn ttl(&self) -> Duration;

    /// The entry of `key` for `consumer`, if cached.
    ///
    /// # Errors
    /// [`CacheError`] if the cache could not answer (treated as a miss).
    fn get<'a>(
        &'a self,
        consumer: &'a str,
        key: &'a str,
    ) -> BoxFuture<'a, Result<Option<CacheEntry>, CacheError>>;

    /// The entries of many keys at once, in order (a batch's lookups in one round trip where
    /// the cache can). The default calls [`get`](Self::get) for each.
    ///
    /// # Errors
    /// [`CacheError`] if the cache could not answer (all treated as misses).
    fn get_many<'a>(
        &'a self,
        keys: &'a [(&'a str, &'a str)],
    ) -> BoxFuture<'a, Result<Vec<Option<CacheEntry>>, CacheError>> {
        Box::pin(async move {
            let mut entries = Vec::with_capacity(keys.len());
            for (consumer, key) in keys {
                entries.push(self.get(consumer, key).await?);
            }
            Ok(entries)
        })
    }

    /// Caches `entry` for `key` of `consumer`, for [`ttl`](Self::ttl).
    ///
    /// # Errors
    /// [`CacheError`] if the cache could not store it (logged; nothing else happens).
    fn fill<'a>(
        &'a self,
        consumer: &'a str,
        key: &'a str,
        entry: CacheEntry,
        mode: Fill,
    ) -> BoxFuture<'a, Result<(), CacheError>>;

    /// Forgets `key` of `consumer`.
    ///
    /// # Errors
    /// [`CacheError`] if the cache could not remove it.
    fn invalidate<'a>(
        &'a self,
        consumer: &'a str,
        key: &'a str,
    ) -> BoxFuture<'a, Result<(), CacheError>>;
}

impl<C: DedupeCache + ?Sized> DedupeCache for Arc<C> {
    fn name(&self) -> &'static str {
        (**self).name()
    }
    fn ttl(&self) -> Duration {
        (**self).ttl()
    }
    fn get<'a>(
        &'a self,
        consumer: &'a str,
        key: &'a str,
    ) -> BoxFuture<'a, Result<Option<CacheEntry>, CacheError>> {
        (**self).get(consumer, key)
    }
    fn get_many<'a>(
        &'a self,
        keys: &'a [(&'a str, &'a str)],
    ) -> BoxFuture<'a, Result<Vec<Option<CacheEntry>>, CacheError>> {
        (**self).get_many(keys)
    }
    fn fill<'a>(
        &'a self,
        consumer: &'a str,
        key: &'a str,
        entry: CacheEntry,
        mode: Fill,
    ) -> BoxFuture<'a, Result<(), CacheError>> {
        (**self).fill(consumer, key, entry, mode)
    }
    fn invalidate<'a>(
        &'a self,
        consumer: &'a str,
        key: &'a str,
    ) -> BoxFuture<'a, Result<(), CacheError>> {
        (**self).invalidate(consumer, key)
    }
}

/// The cache key of (consumer, key): `<consumer length>:<consumer>:<key>`, unambiguous whatever
/// either contains; under a [`TablePrefix`](crate::store::TablePrefix) in scope,
/// `<table prefix>/<consumer length>:<consumer>:<key>` (a prefix holds no `/` and does not start
/// with a digit), so that services sharing a cache under different prefixes never answer for
/// each other.
pub(crate) fn cache_key(consumer: &str, key: &str) -> String {
    match crate::store::TablePrefix::current() {
        Some(prefix) => format!("{prefix}/{}:{consumer}:{key}", consumer.len()),
        None => format!("{}:{consumer}:{key}", consumer.len()),
    }
}

/// An in-process dedupe cache on `moka`: bounded to a number of entries (least recently used
/// ones go first), each kept for a time to live.
///
/// ```
/// use std::time::Duration;
/// use inbox_runtime::cache::MemoryCache;
///
/// let cache = MemoryCache::new(100_000, Duration::from_secs(600));
/// ```
#[derive(Clone)]
pub struct MemoryCache {
    entries: moka::sync::Cache<String, CacheEntry>,
    ttl: Duration,
}

impl std::fmt::Debug for MemoryCache {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MemoryCache")
            .field("entries", &self.entries.entry_count())
            .field("ttl", &self.ttl)
            .finish()
    }
}

impl MemoryCache {
    /// A cache of at most `max_entries` entries (each about 150 bytes plus its key), each kept
    /// `ttl` after its fill.
    pub fn new(max_entries: u64, ttl: Duration) -> Self {
        Self {
            entries: moka::sync::Cache::builder()
                .max_capacity(max_entries)
                .time_to_live(ttl)
                .build(),
            ttl,
        }
    }

    /// Forgets every entry (what a cache flush or restart does: the database catches what the
    /// cache no longer knows).
    pub fn clear(&self) {
        self.entries.invalidate_all();
    }

    /// The number of entries now (approximate: moka applies writes lazily).
    pub fn len(&self) -> u64 {
        self.entries.run_pending_tasks();
        self.entries.entry_count()
    }

    /// `true` if [`len`](Self::len) is 0.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

impl DedupeCache for MemoryCache {
    fn name(&self) -> &'static str {
        "memory"
    }

    fn ttl(&self) -> Duration {
        self.ttl
    }

    fn get<'a>(
        &'a self,
        consumer: &'a str,
        key: &'a str,
    ) -> BoxFuture<'a, Result<Option<CacheEntry>, CacheError>> {
        let entry = self.entries.get(&cache_key(consumer, key));
        Box::pin(std::future::ready(Ok(entry)))
    }

    fn fill<'a>(
        &'a self,
        consumer: &'a str,
        key: &'a str,
        entry: CacheEntry,
        mode: Fill,
    ) -> BoxFuture<'a, Result<(), CacheError>> {
        let key = cache_key(consumer, key);
        match mode {
            Fill::IfAbsent => {
                self.entries.entry(key).or_insert(entry);
            }
            Fill::Replace => self.entries.insert(key, entry),
        }
        Box::pin(std::future::ready(Ok(())))
    }

    fn invalidate<'a>(
        &'a self,
        consumer: &'a str,
        key: &'a str,
    ) -> BoxFuture<'a, Result<(), CacheError>> {
        self.entries.invalidate(&cache_key(consumer, key));
        Box::pin(std::future::ready(Ok(())))
    }
}

/// The dispatcher's cache, with the metrics and logs every use shares.
#[derive(Clone)]
pub(crate) struct CacheLayer {
    cache: Arc<dyn DedupeCache>,
}

impl CacheLayer {
    pub(crate) fn new(cache: Arc<dyn DedupeCache>) -> Self {
        Self { cache }
    }

    fn count(&self, consumer: &str, result: &'static str) {
        metrics::counter!(
            "inbox_cache_total",
            "cache" => self.cache.name(),
            "consumer" => consumer.to_owned(),
            "result" => result
        )
        .increment(1);
    }

    /// The entry of one key; `None` on a miss or an error (counted, logged).
    pub(crate) async fn get(&self, consumer: &str, key: &str) -> Option<CacheEntry> {
        match self.cache.get(consumer, key).await {
            Ok(Some(entry)) => Some(entry),
            Ok(None) => {
                self.count(consumer, "miss");
                None
            }
            Err(error) => {
                self.count(consumer, "error");
                tracing::warn!(%error, consumer, key, "dedupe cache lookup failed; asking the database");
                None
            }
        }
    }

    /// The entries of many keys; all `None` on an error (counted, logged).
    pub(crate) async fn get_many(&self, keys: &[(&str, &str)]) -> Vec<Option<CacheEntry>> {
        match self.cache.get_many(keys).await {
            Ok(entries) if entries.len() == keys.len() => {
                for ((consumer, _), entry) in keys.iter().zip(&entries) {
                    if entry.is_none() {
                        self.count(consumer, "miss");
                    }
                }
                entries
            }
            Ok(_) => {
                tracing::warn!(
                    cache = self.cache.name(),
                    "dedupe cache answered a batch lookup with the wrong number of entries"
                );
                vec![None; keys.len()]
            }
            Err(error) => {
                for (consumer, _) in keys {
                    self.count(consumer, "error");
                }
                tracing::warn!(%error, keys = keys.len(), "dedupe cache lookup failed; asking the database");
                vec![None; keys.len()]
            }
        }
    }

    /// Counts a hit (`conflict`: a hit with another fingerprint).
    pub(crate) fn hit(&self, consumer: &str, conflict: bool) {
        self.count(consumer, if conflict { "conflict" } else { "hit" });
    }

    /// Fills `key` with a committed final state (does nothing for other states).
    pub(crate) async fn fill(
        &self,
        consumer: &str,
        key: &str,
        status: Status,
        fingerprint: Fingerprint,
        mode: Fill,
    ) {
        let Some(entry) = CacheEntry::new(status, fingerprint) else {
            return;
        };
        match self.cache.fill(consumer, key, entry, mode).await {
            Ok(()) => self.count(consumer, "fill"),
            Err(error) => {
                self.count(consumer, "fill_error");
                tracing::warn!(%error, consumer, key, "dedupe cache fill failed");
            }
        }
    }

    /// Forgets `key`; `false` (counted, logged) if the cache could not.
    pub(crate) async fn invalidate(&self, consumer: &str, key: &str) -> bool {
        match self.cache.invalidate(consumer, key).await {
            Ok(()) => {
                self.count(consumer, "invalidate");
                true
            }
            Err(error) => {
                self.count(consumer, "invalidate_error");
                tracing::warn!(%error, consumer, key, "dedupe cache invalidation failed");
                false
            }
        }
    }
}
