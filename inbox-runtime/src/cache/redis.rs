//! The shared dedupe cache on Redis (feature `redis`), on the `redis` crate's
//! [`ConnectionManager`] (one multiplexed connection, reconnected in the background after a
//! failure).
//!
//! Each entry is one string key, `<prefix><consumer length>:<consumer>:<idempotency key>`
//! (`<prefix><table prefix>/<consumer length>:…` under a [`TablePrefix`](crate::store::TablePrefix)),
//! holding `<status> <fingerprint hex>` ([`CacheEntry::to_text`]) with an expiry of the cache's
//! time to live (`PX`, milliseconds). A delivery's fill is `SET … NX PX` (it never overwrites a
//! newer state); an operator's is a plain `SET … PX` after a `DEL`. A batch's lookups are one
//! `MGET`. Every command is bounded by the cache's operation timeout (default 50 ms): a slow or
//! unreachable Redis is a miss, and processing goes on against the database.

use std::time::Duration;

use redis::aio::ConnectionManager;

use super::{CacheEntry, CacheError, DedupeCache, Fill, cache_key};
use crate::BoxFuture;
use crate::setters::setters;

/// A dedupe cache shared by every worker through Redis (see the [module docs](self)).
///
/// ```no_run
/// # async fn demo() -> Result<(), inbox_runtime::cache::CacheError> {
/// use std::time::Duration;
/// use inbox_runtime::cache::redis::RedisCache;
///
/// let cache = RedisCache::connect("redis://127.0.0.1:6379/", Duration::from_secs(3600)).await?;
/// # Ok(()) }
/// ```
#[derive(Clone)]
pub struct RedisCache {
    connection: ConnectionManager,
    prefix: String,
    ttl: Duration,
    timeout: Duration,
}

impl std::fmt::Debug for RedisCache {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RedisCache")
            .field("prefix", &self.prefix)
            .field("ttl", &self.ttl)
            .field("timeout", &self.timeout)
            .finish()
    }
}

impl RedisCache {
    /// The default operation timeout: 50 ms. A lookup that takes longer is a miss (the
    /// database answers in a few milliseconds).
    pub const DEFAULT_TIMEOUT: Duration = Duration::from_millis(50);

    /// The default key prefix: `inbox:`.
    pub const DEFAULT_PREFIX: &'static str = "inbox:";

    /// Connects to the Redis server at `url` (`redis://[user:password@]host[:port][/db]`, or
    /// `rediss://` for TLS if the `redis` crate is built with it), with entries kept `ttl`
    /// (whole milliseconds; at least 1 ms) after their fill.
    ///
    /// # Errors
    /// [`CacheError`] if the URL does not parse or the server cannot be reached within 5 s.
    pub async fn connect(url: &str, ttl: Duration) -> Result<Self, CacheError> {
        let client = redis::Client::open(url).map_err(|e| CacheError::new("redis", e))?;
        let connect = ConnectionManager::new(client);
        let connection = tokio::time::timeout(Duration::from_secs(5), connect)
            .await
            .map_err(|_| CacheError::new("redis", format!("no answer from {url} within 5 s")))?
            .map_err(|e| CacheError::new("redis", e))?;
        Ok(Self {
            connection,
            prefix: Self::DEFAULT_PREFIX.to_owned(),
            ttl,
            timeout: Self::DEFAULT_TIMEOUT,
        })
    }

    setters! {
        /// Sets the prefix of every key this cache writes (default
        /// [`DEFAULT_PREFIX`](Self::DEFAULT_PREFIX)): several inboxes (databases) sharing one Redis
        /// need one prefix each.
        pub fn prefix(prefix: impl Into<String>) {
            self.prefix = prefix.into();
        }

        /// Sets how long one command may take before it counts as failed (default
        /// [`DEFAULT_TIMEOUT`](Self::DEFAULT_TIMEOUT)).
        pub fn timeout(timeout: Duration);
    }

    fn key(&self, consumer: &str, key: &str) -> String {
        let mut full = self.prefix.clone();
        full.push_str(&cache_key(consumer, key));
        full
    }

    fn ttl_ms(&self) -> u64 {
        u64::try_from(self.ttl.as_millis())
            .unwrap_or(u64::MAX)
            .max(1)
    }

    async fn run<T: redis::FromRedisValue>(&self, command: redis::Cmd) -> Result<T, CacheError> {
        let mut connection = self.connection.clone();
        match tokio::time::timeout(self.timeout, command.query_async(&mut connection)).await {
            Ok(result) => result.map_err(|e| CacheError::new("redis", e)),
            Err(_) => Err(CacheError::new(
                "redis",
                format!("no answer within {:?}", self.timeout),
            )),
        }
    }
}

impl DedupeCache for RedisCache {
    fn name(&self) -> &'static str {
        "redis"
    }

    fn ttl(&self) -> Duration {
        self.ttl
    }

    fn get<'a>(
        &'a self,
        consumer: &'a str,
        key: &'a str,
    ) -> BoxFuture<'a, Result<Option<CacheEntry>, CacheError>> {
        Box::pin(async move {
            let mut command = redis::cmd("GET");
            command.arg(self.key(consumer, key));
            let value: Option<String> = self.run(command).await?;
            Ok(value.as_deref().and_then(CacheEntry::from_text))
        })
    }

    fn get_many<'a>(
        &'a self,
        keys: &'a [(&'a str, &'a str)],
    ) -> BoxFuture<'a, Result<Vec<Option<CacheEntry>>, CacheError>> {
        Box::pin(async move {
            if keys.is_empty() {
                return Ok(Vec::new());
            }
            let mut command = redis::cmd("MGET");
            for (consumer, key) in keys {
                command.arg(self.key(consumer, key));
            }
            let values: Vec<Option<String>> = self.run(command).await?;
            Ok(values
                .iter()
                .map(|value| value.as_deref().and_then(CacheEntry::from_text))
                .collect())
        })
    }

    fn fill<'a>(
        &'a self,
        consumer: &'a str,
        key: &'a str,
        entry: CacheEntry,
        mode: Fill,
    ) -> BoxFuture<'a, Result<(), CacheError>> {
        Box::pin(async move {
            let mut command = redis::cmd("SET");
            command
                .arg(self.key(consumer, key))
                .arg(entry.to_text())
                .arg("PX")
                .arg(self.ttl_ms());
            if mode == Fill::IfAbsent {
                command.arg("NX");
            }
            // `SET … NX` answers nil when the key exists: not an error.
            let _: Option<String> = self.run(command).await?;
            Ok(())
        })
    }

    fn invalidate<'a>(
        &'a self,
        consumer: &'a str,
        key: &'a str,
    ) -> BoxFuture<'a, Result<(), CacheError>> {
        Box::pin(async move {
            let mut command = redis::cmd("DEL");
            command.arg(self.key(consumer, key));
            let _: i64 = self.run(command).await?;
            Ok(())
        })
    }
}
