//! Kafka as a source, on [rdkafka](https://docs.rs/rdkafka) (librdkafka): a consumer group whose
//! offsets live **in the database**, written in the same transaction as each record's effect and
//! fenced against zombies. Cargo feature `kafka`.
//!
//! ```no_run
//! # async fn demo(pool: sqlx::PgPool) -> Result<(), Box<dyn std::error::Error>> {
//! use inbox_runtime::{Component, Dispatcher, Worker};
//! use inbox_runtime::source::kafka::{KafkaConfig, KafkaSource};
//!
//! inbox_runtime::migrate_components(&pool, &[Component::Inbox, Component::Positions]).await?;
//! let config = KafkaConfig::new("kafka-1:9092,kafka-2:9092", "ledger", ["payments"]);
//! // The source installs its position hook on the dispatcher: use the one it gives back.
//! let (source, dispatcher) = KafkaSource::connect(config, Dispatcher::from_registry(pool)?).await?;
//! Worker::new(dispatcher).concurrency(16).run_until_signal(source).await?;
//! # Ok(()) }
//! ```
//!
//! ## The database is the offset authority
//!
//! Positions are kept in `inbox_positions` ([`Component::Positions`](crate::Component::Positions),
//! see [`PositionStore`](crate::store::PositionStore)): `(group, topic, partition) → next offset`,
//! with a fencing **epoch**. As the seeds of this pattern prescribe: commit the business
//! transaction and the offset in the same database transaction, then commit the Kafka offset
//! separately.
//!
//! * **Assignment**: in the rebalance callback, *before* `assign`/`incremental_assign`, the source
//!   takes each new partition in the database (its epoch incremented, the stored next offset read
//!   in one statement) and sets that offset on the assignment itself. Consumption starts there;
//!   there is no seek afterwards. A partition without a stored offset starts at the group's
//!   committed offset in Kafka, else at `auto.offset.reset` (default here: `earliest`).
//! * **A previous owner still in its transaction**: taking a partition waits for a transaction
//!   that wrote its position and has not ended (a zombie's slow handler, a stall before
//!   `COMMIT`). The callback never waits long for it, nor does the poll loop, so that the
//!   consumer keeps polling (waiting longer than `max.poll.interval.ms` would get it kicked out
//!   of the group, and the group would rebalance again and again). Each attempt waits at most
//!   50 ms for the row's lock
//!   ([`PositionStore::try_acquire_position`](crate::store::PositionStore::try_acquire_position):
//!   PostgreSQL `lock_timeout`, SQLite's busy timeout, MySQL/MariaDB `FOR UPDATE NOWAIT`), and the
//!   callback spends at most 500 ms on them. A partition not taken is assigned **paused**, nothing
//!   of it is handed out ([`AssignmentHandle::waiting`] lists it), and the poll loop tries again
//!   every 200 ms; once the previous owner's transaction has ended (committed: the stored offset
//!   includes its record; rolled back: it does not), the partition is taken, sought to its stored
//!   offset and resumed, within about 350 ms. Database errors are retried the same way, for up to
//!   [`assign_timeout`](KafkaConfig::assign_timeout). The source's own position writes from the
//!   poll loop (flushes, revocations) wait at most 50 ms too, and are left to a later write when
//!   the row is locked.
//! * **Processing**: the source's [`TransactionHook`] runs in each record's claim transaction,
//!   after the handler: it writes the partition's next offset *if the epoch is still the one the
//!   record was fetched under* (a compare-and-set). A consumer that lost the partition since (a
//!   zombie: paused, partitioned away, its session expired) updates no row; its hook returns
//!   [`Fenced`], its transaction rolls back (claim and effect included), nothing
//!   is recorded, and the [`Worker`](crate::Worker) drops the delivery unsettled
//!   ([`WorkerReport::fenced`](crate::WorkerReport::fenced)). The new owner, which started from
//!   the position the zombie could not move, processes the record once.
//! * **Kafka's commit is advisory** (for lag tooling): every
//!   [`commit_interval`](KafkaConfig::commit_interval), and when partitions are revoked, the
//!   source commits the positions of the partitions it still holds, from the thread that also
//!   runs the rebalance callback (so never for a partition already handed over).
//! * **Revocation**: deliveries of revoked partitions that have not started are dropped; running
//!   ones get up to [`revoke_wait`](KafkaConfig::revoke_wait) to finish and commit (the
//!   rebalance waits for them); then the partition's position is written and it is handed over.
//!   One still running after that is fenced at its commit.
//!
//! ## How each outcome moves the position
//!
//! The position is the partition's **low watermark**: the lowest offset not done yet (in flight,
//! buffered, or waiting for a retry), else the offset after the last record fetched. It never
//! passes a record that is not done, so after a crash or a rebalance nothing is skipped; records
//! above it that were done are delivered again and are duplicates in the inbox.
//!
//! | outcome | settlement | position |
//! | --- | --- | --- |
//! | processed (one consumer of the message) | ack | written **in the effect's transaction** (fenced) |
//! | processed (several consumers) | ack | fenced in each consumer's transaction; moved past the record by the next write |
//! | duplicate, dead (now or before), discarded, stale, parked | ack | done: moved past by the next write (the record's state is already in the inbox) |
//! | bad input: no name, unknown name, malformed payload, tombstone, oversized, bad key | kept in `inbox_rejections` (topic, partition, offset), ack | done, as above: a poison record never stalls its partition |
//! | conflict | reject (kept in `inbox_rejections` by the dispatcher) | done, as above |
//! | handler failure to retry, "not yet", database error | requeue | **not** done: the record is delivered again after the delay, before any later record of its partition (or of its key); the partition waits. The retry policy's attempts end in `dead`, so it never waits forever |
//! | fenced (zombie) | none (dropped) | untouched: rolled back |
//!
//! "The next write" is the next record's transaction, or the source's own fenced write every
//! [`commit_interval`](KafkaConfig::commit_interval), at revocation and at close.
//!
//! ## Order, concurrency, backpressure
//!
//! With [`KafkaOrdering::Partition`] (the default) a partition has at most one record in flight:
//! its records are processed one at a time, in offset order; partitions run in parallel up to
//! the worker's concurrency. With [`KafkaOrdering::RecordKey`], records of one partition with
//! different keys run in parallel, records with the same key (or no key) in offset order. Each
//! partition buffers at most [`max_buffered`](KafkaConfig::max_buffered) records; a fuller one is
//! paused at the broker and resumed when half drained.
//!
//! ## Envelope
//!
//! **Message name**, first found of: the header named by
//! [`name_header`](KafkaConfig::name_header) (default `message-name`, what this crate's sinks
//! write; a value that is not UTF-8 is read with U+FFFD for its invalid bytes, so that no
//! handler knows the name and the record is kept in `inbox_rejections` as an unknown message);
//! the name configured for the topic ([`KafkaConfig::topic_name`]), for records without the
//! header. Otherwise the empty name, which the worker rejects (kept in `inbox_rejections`).
//!
//! **Metadata**: `source` = the topic, `partition`, `offset`, `record_key`, `published_at` = the
//! record's timestamp, `message_id` = the `message-id` header, `epoch` = the position epoch.
//! Headers whose value is UTF-8 are copied into [`Envelope::headers`] (others are skipped, with
//! a debug log). A tombstone (null value) has an empty payload, which no message decodes.
//!
//! **Payload limit** (the dispatcher's, from [`KafkaSource::connect`];
//! [`Source::set_payload_limit`] changes it): librdkafka fetches whole record batches into its
//! own buffers, so the limit cannot stop it from reading a large record. What bounds that is
//! the broker's `message.max.bytes` (about 1 MB by default; a topic's `max.message.bytes`) and
//! the client's `fetch.message.max.bytes`, `fetch.max.bytes` and
//! `queued.max.messages.kbytes` (set them with [`KafkaConfig::property`]). Of a value over the
//! limit only the first `limit` bytes are copied out of librdkafka's buffer into the
//! partition's buffer, and the worker keeps that cut copy in `inbox_rejections` as `too_large`
//! with its real size.

use std::collections::{BTreeMap, HashMap, HashSet, VecDeque};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering as AtomicOrdering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant, SystemTime};

use rdkafka::ClientConfig;
use rdkafka::client::ClientContext;
use rdkafka::consumer::{
    BaseConsumer, CommitMode, Consumer as _, ConsumerContext, RebalanceProtocol,
};
use rdkafka::error::KafkaResult;
use rdkafka::message::{Headers as _, Message as _};
use rdkafka::topic_partition_list::{Offset, TopicPartitionList};
use rdkafka::types::RDKafkaRespErr;
use sqlx::Pool;

use crate::BoxFuture;
use crate::debug::some_fields;
use crate::dispatch::dispatcher::Dispatcher;
use crate::protocol::hooks::{ClaimInfo, Fenced, TransactionHook};
use crate::setters::setters;
use crate::source::{Delivery, Settle, SettleFuture, Settlement, Source, SourceError};
use crate::store::{Acquired, PositionKey, PositionStore as _, PositionsDatabase};
use crate::types::classify::BoxError;
use crate::types::envelope::{Envelope, SourceMetadata};
use crate::types::limit::PayloadLimit;

/// How long one attempt at a position's row waits for a transaction that holds it (the previous
/// owner's, not committed yet), in a rebalance callback or the poll loop.
const LOCK_WAIT: Duration = Duration::from_millis(50);
/// How often a partition waiting for its position is tried again.
const RETRY_INTERVAL: Duration = Duration::from_millis(200);
/// How long one rebalance callback, or one pass of the poll loop, may spend on the positions of
/// partitions waiting for them; the others are tried at the next pass.
const TAKEOVER_BUDGET: Duration = Duration::from_millis(500);
/// How long one attempt at the database may take (a connection from the pool, the statements): a
/// database that does not answer holds the poll loop no longer.
const ATTEMPT_LIMIT: Duration = Duration::from_secs(2);
/// How long a seek of a partition that waited for its position may take.
const SEEK_TIMEOUT: Duration = Duration::from_secs(1);

/// Which records of a partition may run at the same time.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum KafkaOrdering {
    /// One record of a partition at a time, in offset order (the default): Kafka's own order.
    #[default]
    Partition,
    /// Records of a partition with different record keys in parallel; records with the same key
    /// (records without a key count as one key) one at a time, in offset order.
    RecordKey,
}

/// How to connect and consume. Build with [`KafkaConfig::new`] and the setters.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct KafkaConfig {
    /// The bootstrap brokers: `host:port[,host:port…]` (librdkafka's `bootstrap.servers`).
    pub brokers: String,
    /// The consumer group (`group.id`); also the group of the positions in the database.
    pub group: String,
    /// The topics to consume (subscribed as a group).
    pub topics: Vec<String>,
    /// Header carrying the message name. Default `Some("message-name")`.
    pub name_header: Option<String>,
    /// Message name per topic, for records without the header. Default: none.
    pub topic_names: BTreeMap<String, String>,
    /// Which records may run at the same time. Default [`KafkaOrdering::Partition`].
    pub ordering: KafkaOrdering,
    /// Records buffered per partition before it is paused at the broker. Default 256.
    pub max_buffered: usize,
    /// How often the source writes the positions of records done without a transaction of
    /// their own (duplicates, rejections) and commits Kafka's advisory offsets. Default 1 s.
    pub commit_interval: Duration,
    /// On revocation, how long running deliveries of the revoked partitions may take to finish
    /// before the partitions are handed over (the rebalance waits that long at most). Default
    /// 10 s; keep it under `max.poll.interval.ms`.
    pub revoke_wait: Duration,
    /// On an assignment, how long the source keeps trying to read a partition's position while
    /// the database fails (errors, no answer within 2 s) before it gives up (and fails: the
    /// worker stops). Default 30 s. A position locked by the previous owner's open transaction
    /// is no failure: the partition waits for it, however long (see the module documentation).
    pub assign_timeout: Duration,
    /// Further librdkafka consumer properties (`security.protocol`, `sasl.*`, `ssl.*`,
    /// `session.timeout.ms`, `auto.offset.reset`, `client.id`, …), applied over this source's
    /// defaults: `enable.auto.commit=false`, `enable.auto.offset.store=false`,
    /// `auto.offset.reset=earliest`, `partition.assignment.strategy=cooperative-sticky`.
    pub properties: BTreeMap<String, String>,
}

impl KafkaConfig {
    /// Consume `topics` as consumer group `group` from the cluster at `brokers`, with the
    /// defaults listed on the fields.
    pub fn new(
        brokers: impl Into<String>,
        group: impl Into<String>,
        topics: impl IntoIterator<Item = impl Into<String>>,
    ) -> Self {
        Self {
            brokers: brokers.into(),
            group: group.into(),
            topics: topics.into_iter().map(Into::into).collect(),
            name_header: Some("message-name".into()),
            topic_names: BTreeMap::new(),
            ordering: KafkaOrdering::Partition,
            max_buffered: 256,
            commit_interval: Duration::from_secs(1),
            revoke_wait: Duration::from_secs(10),
            assign_timeout: Duration::from_secs(30),
            properties: BTreeMap::new(),
        }
    }

    /// Sets [`name_header`](Self::name_header) (`None`: ignore headers).
    pub fn name_header(mut self, header: Option<String>) -> Self {
        self.name_header = header;
        self
    }

    /// Names the messages of `topic` that carry no name header `message_name`.
    pub fn topic_name(mut self, topic: impl Into<String>, message_name: impl Into<String>) -> Self {
        self.topic_names.insert(topic.into(), message_name.into());
        self
    }

    setters! {
        /// Sets [`ordering`](Self::ordering).
        pub fn ordering(ordering: KafkaOrdering);

        /// Sets [`max_buffered`](Self::max_buffered) (at least 1).
        pub fn max_buffered(records: usize) {
            self.max_buffered = records.max(1);
        }

        /// Sets [`commit_interval`](Self::commit_interval).
        pub fn commit_interval(interval: Duration);

        /// Sets [`revoke_wait`](Self::revoke_wait).
        pub fn revoke_wait(wait: Duration);

        /// Sets [`assign_timeout`](Self::assign_timeout).
        pub fn assign_timeout(timeout: Duration);
    }

    /// Sets a librdkafka consumer property (see [`properties`](Self::properties)).
    pub fn property(mut self, name: impl Into<String>, value: impl Into<String>) -> Self {
        self.properties.insert(name.into(), value.into());
        self
    }

    fn client_config(&self) -> ClientConfig {
        let mut config = ClientConfig::new();
        config
            .set("bootstrap.servers", &self.brokers)
            .set("group.id", &self.group)
            .set("enable.auto.commit", "false")
            .set("enable.auto.offset.store", "false")
            .set("enable.partition.eof", "false")
            .set("auto.offset.reset", "earliest")
            .set("partition.assignment.strategy", "cooperative-sticky");
        for (name, value) in &self.properties {
            config.set(name, value);
        }
        config
    }
}

/// A fetched record, as the source keeps it until it is done.
#[derive(Debug, Clone)]
struct Record {
    topic: Arc<str>,
    partition: i32,
    offset: i64,
    key: Option<Vec<u8>>,
    /// The value, cut to the payload limit.
    payload: Option<Vec<u8>>,
    /// The value's real size, in bytes.
    payload_size: usize,
    timestamp_ms: Option<i64>,
    headers: Vec<(String, Option<Vec<u8>>)>,
    /// Not to be handed out before (a retry's delay).
    not_before: Option<Instant>,
}

/// One assigned partition.
#[derive(Debug)]
struct Part {
    epoch: i64,
    /// Fetched, not handed out (or handed back for a retry), in offset order.
    buffer: VecDeque<Record>,
    /// Handed out, not settled: offset → record key.
    in_flight: BTreeMap<i64, Option<Vec<u8>>>,
    /// The offset after the last record fetched, once known.
    fetched_next: Option<i64>,
    /// The lowest offset given up without being done (dropped at revocation, or a fenced
    /// delivery): the position never passes it.
    given_up: Option<i64>,
    /// The last position written (by a hook or a flush) or found at assignment.
    written: Option<i64>,
    /// The last offset committed to Kafka.
    committed: Option<i64>,
    paused: bool,
    /// Being revoked: nothing more is handed out.
    revoking: bool,
    /// A fenced write found the partition owned by another consumer.
    fenced: bool,
}

impl Part {
    fn new(epoch: i64, next_offset: Option<i64>) -> Self {
        Self {
            epoch,
            buffer: VecDeque::new(),
            in_flight: BTreeMap::new(),
            fetched_next: next_offset,
            given_up: None,
            written: next_offset,
            committed: None,
            paused: false,
            revoking: false,
            fenced: false,
        }
    }

    /// The low watermark, counting `done` as done too.
    fn watermark(&self, done: Option<i64>) -> Option<i64> {
        let in_flight = self.in_flight.keys().copied().find(|&o| Some(o) != done);
        let buffered = self.buffer.iter().map(|r| r.offset).min();
        [in_flight, buffered, self.fetched_next, self.given_up]
            .into_iter()
            .flatten()
            .min()
    }

    /// Gives up `offset` without it being done: the position stays at or below it.
    fn give_up(&mut self, offset: i64) {
        self.given_up = Some(self.given_up.map_or(offset, |o| o.min(offset)));
    }

    /// Whether records are handed out from it.
    fn live(&self) -> bool {
        !self.revoking && !self.fenced
    }
}

type PartKey = (Arc<str>, i32);

/// A partition the group assigned whose position is not taken yet: its row is locked by the
/// previous owner's open transaction, or the database failed. Paused at the broker, no record of
/// it handed out; the poll loop tries again every [`RETRY_INTERVAL`] and starts it once taken.
#[derive(Debug)]
struct Waiting {
    /// When the group assigned it.
    since: Instant,
    /// Not tried again before.
    next_attempt: Instant,
    /// Since when the attempts fail (errors, not a lock): the source fails after
    /// `assign_timeout` of them.
    failing_since: Option<Instant>,
    /// The delay before the next attempt after an error (doubled each time, up to 2 s).
    delay: Duration,
    /// Taken, not started at the broker yet (its seek failed: tried again).
    acquired: Option<Acquired>,
    /// When the log last said that it waits.
    logged: Option<Instant>,
}

impl Waiting {
    fn new(now: Instant) -> Self {
        Self {
            since: now,
            next_attempt: now,
            failing_since: None,
            delay: Duration::from_millis(100),
            acquired: None,
            logged: None,
        }
    }
}

#[derive(Default)]
struct State {
    parts: HashMap<PartKey, Part>,
    /// Round-robin cursor over partitions.
    turn: usize,
    /// A failure the worker is told at its next fetch.
    failure: Option<SourceError>,
    /// The rebalance callbacks served so far.
    rebalances: RebalanceCounts,
    /// Assigned by the group, waiting for their positions (see [`Waiting`]).
    waiting: HashMap<PartKey, Waiting>,
}

/// The rebalances a [`KafkaSource`] went through, by kind: the consumer group's rebalance
/// callbacks it served ([`AssignmentHandle::rebalances`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct RebalanceCounts {
    /// Assignments: rebalances that gave this consumer its new partitions (with the default
    /// cooperative protocol, also those that gave it none).
    pub assigned: u64,
    /// The partitions these assignments gave, in all.
    pub partitions_assigned: u64,
    /// Orderly revocations: partitions handed over to other members.
    pub revoked: u64,
    /// Losses: partitions taken away without a handover (the session expired,
    /// `max.poll.interval.ms` passed between two polls, the coordinator forgot the member).
    pub lost: u64,
}

/// What [`Shared::take`] found: a record with its epoch, or when one may be ready.
type Taken = (Option<(Record, i64)>, Option<Instant>);

/// What the poll thread, the source, its settlers and its hook share.
struct Shared {
    name: String,
    group: String,
    owner: String,
    topics: HashSet<String>,
    name_header: Option<String>,
    topic_names: BTreeMap<String, String>,
    ordering: KafkaOrdering,
    max_buffered: usize,
    revoke_wait: Duration,
    assign_timeout: Duration,
    /// Per message name, how many consumers the dispatcher runs (one: the position moves in the
    /// effect's transaction).
    consumers: HashMap<String, usize>,
    state: Mutex<State>,
    /// Something may be ready for `next`.
    wake: tokio::sync::Notify,
    stop: AtomicBool,
    /// The payload limit, in bytes: a record's value is copied no further.
    payload_limit: AtomicUsize,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, State> {
        self.state
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    fn fail(&self, operation: &'static str, error: impl Into<BoxError>) {
        let error = SourceError::new(&self.name, operation, error);
        tracing::error!(source = %self.name, %error, "Kafka source failed");
        self.lock().failure.get_or_insert(error);
        self.wake.notify_one();
    }

    /// An attempt found `key`'s position locked by another transaction: tried again after
    /// [`RETRY_INTERVAL`].
    fn still_locked(&self, key: &PartKey) {
        let mut state = self.lock();
        let Some(waiting) = state.waiting.get_mut(key) else {
            return;
        };
        let now = Instant::now();
        waiting.next_attempt = now + RETRY_INTERVAL;
        waiting.failing_since = None;
        waiting.delay = Duration::from_millis(100);
        let (topic, partition) = (&*key.0, key.1);
        match waiting.logged {
            None => {
                tracing::info!(source = %self.name, topic, partition, "partition assigned; its position is locked by another transaction (the previous owner's, not ended yet): started once it ends");
            }
            Some(at) if now.duration_since(at) >= Duration::from_secs(10) => {
                tracing::warn!(source = %self.name, topic, partition, waited_s = waiting.since.elapsed().as_secs(), "partition still waits for the previous owner's transaction to end");
            }
            Some(_) => return,
        }
        waiting.logged = Some(now);
    }

    /// An attempt at `key`'s position (or its seek) failed: tried again after a growing delay;
    /// the source fails once the attempts have failed for `assign_timeout`.
    fn attempt_failed(&self, key: &PartKey, operation: &'static str, error: BoxError) {
        let now = Instant::now();
        let failing_for = {
            let mut state = self.lock();
            let Some(waiting) = state.waiting.get_mut(key) else {
                return;
            };
            waiting.next_attempt = now + waiting.delay;
            waiting.delay = (waiting.delay * 2).min(Duration::from_secs(2));
            now.duration_since(*waiting.failing_since.get_or_insert(now))
        };
        let (topic, partition) = (&*key.0, key.1);
        if failing_for >= self.assign_timeout {
            self.fail(operation, error);
        } else {
            tracing::warn!(source = %self.name, topic, partition, %error, operation, "cannot take the partition; retrying");
        }
    }

    /// The next record to hand out, marked in flight, with its partition's epoch; and, if none,
    /// when one may be ready.
    fn take(&self) -> Result<Taken, SourceError> {
        let mut guard = self.lock();
        let state = &mut *guard;
        if let Some(error) = state.failure.take() {
            return Err(error);
        }
        let now = Instant::now();
        let mut keys: Vec<&PartKey> = state.parts.keys().collect();
        keys.sort();
        let count = keys.len();
        let mut wake_at: Option<Instant> = None;
        let mut found: Option<(PartKey, usize)> = None;
        for step in 0..count {
            let key = keys[(state.turn + step) % count];
            let part = &state.parts[key];
            if !part.live() {
                continue;
            }
            let mut busy: HashSet<Option<&[u8]>> =
                part.in_flight.values().map(|key| key.as_deref()).collect();
            for (index, record) in part.buffer.iter().enumerate() {
                let record_key = match self.ordering {
                    KafkaOrdering::Partition => None,
                    KafkaOrdering::RecordKey => record.key.as_deref(),
                };
                if busy.contains(&record_key) {
                    if self.ordering == KafkaOrdering::Partition {
                        break;
                    }
                    continue;
                }
                match record.not_before {
                    Some(at) if at > now => {
                        wake_at = Some(wake_at.map_or(at, |w| w.min(at)));
                        // Later records of its key (its partition) wait for it.
                        busy.insert(record_key);
                        if self.ordering == KafkaOrdering::Partition {
                            break;
                        }
                    }
                    _ => {
                        found = Some((key.clone(), index));
                        break;
                    }
                }
            }
            if found.is_some() {
                state.turn = (state.turn + step + 1) % count.max(1);
                break;
            }
        }
        let Some((key, index)) = found else {
            return Ok((None, wake_at));
        };
        let part = state.parts.get_mut(&key).expect("found above");
        let mut record = part.buffer.remove(index).expect("found above");
        record.not_before = None;
        part.in_flight.insert(record.offset, record.key.clone());
        Ok((Some((record, part.epoch)), None))
    }

    fn envelope(&self, record: &Record, epoch: i64) -> Envelope {
        let mut headers = BTreeMap::new();
        for (name, value) in &record.headers {
            match value.as_deref().map(std::str::from_utf8) {
                Some(Ok(text)) => {
                    headers.insert(name.clone(), text.to_owned());
                }
                Some(Err(_)) => {
                    tracing::debug!(header = name.as_str(), "header value not UTF-8; skipped")
                }
                None => {}
            }
        }
        // A name header that is there but not UTF-8 still names the record (U+FFFD for the
        // bytes that are not, as the AMQP source reads it): never the topic's name, which is for
        // records without the header.
        let message_name = self
            .name_header
            .as_ref()
            .and_then(|header| {
                record
                    .headers
                    .iter()
                    .rev()
                    .find(|(name, value)| name == header && value.is_some())
            })
            .and_then(|(_, value)| value.as_deref())
            .map(|value| String::from_utf8_lossy(value).into_owned())
            .or_else(|| self.topic_names.get(&*record.topic).cloned())
            .unwrap_or_default();
        let mut metadata = SourceMetadata::new(&*record.topic)
            .partition(record.partition.to_string())
            .offset(record.offset)
            .epoch(epoch);
        if let Some(key) = &record.key {
            metadata = metadata.record_key(key.clone());
        }
        if let Some(id) = headers.get("message-id") {
            metadata = metadata.message_id(id.clone());
        }
        if let Some(ms) = record.timestamp_ms.and_then(|ms| u64::try_from(ms).ok()) {
            metadata = metadata.published_at(SystemTime::UNIX_EPOCH + Duration::from_millis(ms));
        }
        let payload = record.payload.clone().unwrap_or_default();
        let mut envelope =
            Envelope::cut(message_name, payload, record.payload_size).with_source(metadata);
        envelope.headers = headers;
        envelope
    }
}

/// Reads and writes positions in the source's database, whatever its backend: one attempt each,
/// waiting at most [`LOCK_WAIT`] for the row's lock (`Ok(None)`: still locked), within
/// [`ATTEMPT_LIMIT`] in all.
trait Positions: Send + Sync {
    fn try_acquire<'a>(
        &'a self,
        key: PositionKey<'a>,
        owner: &'a str,
    ) -> BoxFuture<'a, Result<Option<Acquired>, sqlx::Error>>;

    fn try_advance<'a>(
        &'a self,
        key: PositionKey<'a>,
        epoch: i64,
        next_offset: i64,
    ) -> BoxFuture<'a, Result<Option<bool>, sqlx::Error>>;
}

/// The positions in `.0`, under the table prefix `.1` (if any).
struct PoolPositions<DB: PositionsDatabase>(Pool<DB>, Option<crate::store::TablePrefix>);

/// Runs `$op` (a future on `$conn`, a connection of the pool `$pool`) within [`ATTEMPT_LIMIT`],
/// the wait for the connection included. A connection whose statements ran out of time is closed,
/// not given back to the pool (its state is unknown).
macro_rules! within_limit {
    ($pool:expr, |$conn:ident| $op:expr) => {{
        let deadline = tokio::time::Instant::now() + ATTEMPT_LIMIT;
        let mut pooled = tokio::time::timeout_at(deadline, $pool.acquire())
            .await
            .map_err(|_| sqlx::Error::PoolTimedOut)??;
        let attempt = {
            let $conn = &mut *pooled;
            tokio::time::timeout_at(deadline, $op).await
        };
        match attempt {
            Ok(done) => done,
            Err(_) => {
                drop(pooled.detach());
                Err(sqlx::Error::Io(std::io::Error::new(
                    std::io::ErrorKind::TimedOut,
                    format!("the database did not answer within {ATTEMPT_LIMIT:?}"),
                )))
            }
        }
    }};
}

impl<DB: PositionsDatabase> Positions for PoolPositions<DB> {
    fn try_acquire<'a>(
        &'a self,
        key: PositionKey<'a>,
        owner: &'a str,
    ) -> BoxFuture<'a, Result<Option<Acquired>, sqlx::Error>> {
        Box::pin(async move {
            crate::store::within(self.1.as_ref(), async move {
                within_limit!(self.0, |conn| conn
                    .try_acquire_position(&key, owner, LOCK_WAIT))
            })
            .await
        })
    }

    fn try_advance<'a>(
        &'a self,
        key: PositionKey<'a>,
        epoch: i64,
        next_offset: i64,
    ) -> BoxFuture<'a, Result<Option<bool>, sqlx::Error>> {
        Box::pin(async move {
            crate::store::within(self.1.as_ref(), async move {
                within_limit!(self.0, |conn| conn.try_advance_position(
                    &key,
                    epoch,
                    next_offset,
                    LOCK_WAIT
                ))
            })
            .await
        })
    }
}

/// The consumer's context: the rebalance callback.
struct Context {
    shared: Arc<Shared>,
    positions: Arc<dyn Positions>,
    runtime: tokio::runtime::Handle,
}

impl ClientContext for Context {}

impl ConsumerContext for Context {
    fn rebalance(
        &self,
        consumer: &BaseConsumer<Self>,
        err: RDKafkaRespErr,
        tpl: &mut TopicPartitionList,
    ) {
        let cooperative = matches!(
            consumer.rebalance_protocol(),
            RebalanceProtocol::Cooperative
        );
        match err {
            RDKafkaRespErr::RD_KAFKA_RESP_ERR__ASSIGN_PARTITIONS => {
                {
                    let counts = &mut self.shared.lock().rebalances;
                    counts.assigned += 1;
                    counts.partitions_assigned += tpl.count() as u64;
                }
                let waiting = self.assign(tpl);
                metrics::counter!("inbox_kafka_rebalances_total", "kind" => "assign").increment(1);
                let assigned = if cooperative {
                    consumer.incremental_assign(tpl)
                } else {
                    consumer.assign(tpl)
                };
                if let Err(error) = assigned {
                    self.shared.fail("assign", error);
                } else if waiting.count() > 0 {
                    self.pause_waiting(consumer, &waiting);
                }
            }
            _ => {
                let lost = err != RDKafkaRespErr::RD_KAFKA_RESP_ERR__REVOKE_PARTITIONS
                    || consumer.assignment_lost();
                metrics::counter!("inbox_kafka_rebalances_total", "kind" => if lost { "lost" } else { "revoke" }).increment(1);
                {
                    let mut state = self.shared.lock();
                    let counts = &mut state.rebalances;
                    *if lost {
                        &mut counts.lost
                    } else {
                        &mut counts.revoked
                    } += 1;
                }
                self.revoke(consumer, tpl, lost);
                let unassigned = if cooperative {
                    consumer.incremental_unassign(tpl)
                } else {
                    consumer.unassign()
                };
                if let Err(error) = unassigned {
                    tracing::warn!(source = %self.shared.name, %error, "unassign failed");
                }
            }
        }
    }

    fn commit_callback(&self, result: KafkaResult<()>, offsets: &TopicPartitionList) {
        if let Err(error) = result {
            // Advisory only: the database holds the positions.
            tracing::debug!(source = %self.shared.name, %error, partitions = offsets.count(), "advisory offset commit failed");
        }
    }
}

impl Context {
    /// Takes each partition of `tpl` in the database, one bounded attempt each within
    /// [`TAKEOVER_BUDGET`], and sets its stored position on `tpl`. Returns the partitions not
    /// taken (locked by the previous owner's open transaction, or the database failed, or out of
    /// time): they wait, paused, for the poll loop to take them ([`Poller::take_over`]).
    fn assign(&self, tpl: &mut TopicPartitionList) -> TopicPartitionList {
        let partitions: Vec<(String, i32)> = tpl
            .elements()
            .iter()
            .map(|e| (e.topic().to_owned(), e.partition()))
            .collect();
        let shared = &self.shared;
        let now = Instant::now();
        let until = now + TAKEOVER_BUDGET;
        let mut trying = true;
        let mut waiting = TopicPartitionList::new();
        for (topic, partition) in partitions {
            let key: PartKey = (Arc::from(topic.as_str()), partition);
            let attempt =
                (trying && Instant::now() < until).then(|| self.try_acquire(&topic, partition));
            if let Some(Ok(Some(acquired))) = attempt {
                if let Some(next) = acquired.next_offset {
                    // Consumption starts exactly here: set on the assignment, never sought later.
                    if let Err(error) =
                        tpl.set_partition_offset(&topic, partition, Offset::Offset(next))
                    {
                        tracing::error!(%error, "cannot set the offset on the assignment");
                    }
                }
                tracing::info!(source = %shared.name, topic, partition, epoch = acquired.epoch, next_offset = acquired.next_offset, "partition assigned");
                shared
                    .lock()
                    .parts
                    .insert(key, Part::new(acquired.epoch, acquired.next_offset));
                continue;
            }
            shared.lock().waiting.insert(key.clone(), Waiting::new(now));
            match attempt {
                Some(Ok(_)) => shared.still_locked(&key),
                Some(Err(error)) => {
                    // The database fails: the others are tried from the poll loop.
                    trying = false;
                    shared.attempt_failed(&key, "read positions", error.into());
                }
                None => {}
            }
            waiting.add_partition(&topic, partition);
        }
        shared.wake.notify_one();
        waiting
    }

    /// Pauses the partitions that wait for their positions. Nothing is fetched for them until
    /// they start; and no record of theirs reaches the poll loop, so that a partition without a
    /// stored position resumes where its assignment put it (the group's committed offset, else
    /// `auto.offset.reset`). One that cannot be paused fails the source.
    fn pause_waiting(&self, consumer: &BaseConsumer<Self>, waiting: &TopicPartitionList) {
        let paused = consumer.pause(waiting).and_then(|()| {
            match waiting.elements().iter().find_map(|e| e.error().err()) {
                Some(error) => Err(error),
                None => Ok(()),
            }
        });
        if let Err(error) = paused {
            self.shared.fail("pause", error);
        }
    }

    /// One bounded attempt at taking `topic`'s `partition` for this consumer: `Ok(None)` if its
    /// row stayed locked for [`LOCK_WAIT`].
    fn try_acquire(&self, topic: &str, partition: i32) -> Result<Option<Acquired>, sqlx::Error> {
        let key = PositionKey::new(&self.shared.group, topic, partition);
        self.runtime
            .block_on(self.positions.try_acquire(key, &self.shared.owner))
    }

    /// Gives up the partitions of `tpl`: drops what has not started, waits for what runs, writes
    /// the final positions and commits them to Kafka (unless `lost`).
    fn revoke(&self, consumer: &BaseConsumer<Self>, tpl: &TopicPartitionList, lost: bool) {
        let shared = &self.shared;
        let keys: Vec<PartKey> = tpl
            .elements()
            .iter()
            .map(|e| (Arc::from(e.topic()), e.partition()))
            .collect();
        {
            let mut state = shared.lock();
            for key in &keys {
                // Not started: nothing of it was handed out or written.
                state.waiting.remove(key);
                if let Some(part) = state.parts.get_mut(key) {
                    part.revoking = true;
                    if let Some(first) = part.buffer.front().map(|r| r.offset) {
                        part.give_up(first);
                    }
                    part.buffer.clear();
                }
            }
        }
        let deadline = later(Instant::now(), shared.revoke_wait);
        loop {
            let running: usize = {
                let state = shared.lock();
                keys.iter()
                    .filter_map(|key| state.parts.get(key))
                    .map(|part| part.in_flight.len())
                    .sum()
            };
            if running == 0 || Instant::now() >= deadline {
                if running > 0 {
                    tracing::warn!(source = %shared.name, running, "revoked partitions still have running deliveries; they will be fenced");
                }
                break;
            }
            std::thread::sleep(Duration::from_millis(5));
        }
        let removed: Vec<(PartKey, Part)> = {
            let mut state = shared.lock();
            keys.iter()
                .filter_map(|key| state.parts.remove(key).map(|part| (key.clone(), part)))
                .collect()
        };
        if lost {
            tracing::warn!(source = %shared.name, partitions = removed.len(), "partitions lost (another consumer may own them already)");
            return;
        }
        let mut commit = TopicPartitionList::new();
        for ((topic, partition), part) in &removed {
            let Some(next) = part.watermark(None) else {
                continue;
            };
            if !part.fenced && part.written.is_none_or(|w| w < next) {
                let key = PositionKey::new(&shared.group, topic, *partition);
                match self
                    .runtime
                    .block_on(self.positions.try_advance(key, part.epoch, next))
                {
                    Ok(Some(true)) => {}
                    Ok(Some(false)) => {
                        tracing::warn!(source = %shared.name, topic = &**topic, partition, "position fenced at revocation")
                    }
                    Ok(None) => {
                        // Held by a transaction of this consumer still running: the next owner
                        // waits for it, then starts at the position last committed.
                        tracing::warn!(source = %shared.name, topic = &**topic, partition, "position locked at revocation; not written")
                    }
                    Err(error) => {
                        tracing::warn!(source = %shared.name, %error, "cannot write the position at revocation")
                    }
                }
            }
            let _ = commit.add_partition_offset(topic, *partition, Offset::Offset(next));
        }
        if commit.count() > 0
            && let Err(error) = consumer.commit(&commit, CommitMode::Async)
        {
            tracing::debug!(source = %shared.name, %error, "advisory offset commit at revocation failed");
        }
        tracing::info!(source = %shared.name, partitions = removed.len(), "partitions revoked");
    }
}

/// The position hook the source installs on its dispatcher (see the module documentation).
struct KafkaFence {
    shared: Arc<Shared>,
    /// The positions' table prefix (the rebalance callbacks' too).
    prefix: Option<crate::store::TablePrefix>,
}

impl<DB: PositionsDatabase> TransactionHook<DB> for KafkaFence {
    fn before_commit<'c>(
        &'c self,
        conn: &'c mut DB::Connection,
        claim: &'c ClaimInfo<'c>,
    ) -> BoxFuture<'c, Result<(), BoxError>> {
        Box::pin(async move {
            let shared = &self.shared;
            let Some(source) = claim.source else {
                return Ok(());
            };
            let (Some(epoch), Some(partition_text), Some(offset)) =
                (source.epoch, source.partition.as_deref(), source.offset)
            else {
                return Ok(());
            };
            if !shared.topics.contains(&source.source) {
                return Ok(());
            }
            let Ok(partition) = partition_text.parse::<i32>() else {
                return Ok(());
            };
            let fenced = || Fenced::new(source.source.clone(), partition_text, epoch);
            let sole = shared.consumers.get(claim.message_name).copied() == Some(1);
            let next = {
                let state = shared.lock();
                match state
                    .parts
                    .get(&(Arc::from(source.source.as_str()), partition))
                {
                    Some(part) if part.epoch == epoch && !part.fenced => {
                        // With one consumer, this transaction finishes the record: the position
                        // moves past it. With several, only once all are done (a later write).
                        part.watermark(sole.then_some(offset)).unwrap_or(offset)
                    }
                    _ => return Err(fenced().into()),
                }
            };
            let key = PositionKey::new(&shared.group, &source.source, partition);
            let advanced = crate::store::within(self.prefix.as_ref(), async {
                conn.advance_position(&key, epoch, next).await
            })
            .await?;
            if advanced {
                let mut state = shared.lock();
                if let Some(part) = state
                    .parts
                    .get_mut(&(Arc::from(source.source.as_str()), partition))
                    && part.epoch == epoch
                {
                    part.written = Some(part.written.map_or(next, |w| w.max(next)));
                }
                Ok(())
            } else {
                metrics::counter!("inbox_kafka_fenced_total").increment(1);
                let mut state = shared.lock();
                if let Some(part) = state
                    .parts
                    .get_mut(&(Arc::from(source.source.as_str()), partition))
                    && part.epoch == epoch
                {
                    part.fenced = true;
                }
                Err(fenced().into())
            }
        })
    }
}

/// Settles one record: done (ack, reject), back for a retry (requeue, abandon).
struct KafkaSettler {
    shared: Arc<Shared>,
    record: Record,
    epoch: i64,
}

impl KafkaSettler {
    /// Takes the record out of flight if its partition is still held under its epoch; with
    /// `retry_at`, hands it back for a retry at that time.
    fn finish(&self, retry_at: Option<Instant>) {
        let mut state = self.shared.lock();
        let key = (self.record.topic.clone(), self.record.partition);
        if let Some(part) = state.parts.get_mut(&key)
            && part.epoch == self.epoch
            && part.in_flight.remove(&self.record.offset).is_some()
            && let Some(at) = retry_at
        {
            if part.live() {
                let mut record = self.record.clone();
                record.not_before = Some(at);
                let index = part.buffer.partition_point(|r| r.offset < record.offset);
                part.buffer.insert(index, record);
            } else {
                // Not done, and not delivered again by this consumer: the partition's next
                // owner starts at or before it.
                part.give_up(self.record.offset);
            }
        }
        drop(state);
        self.shared.wake.notify_one();
    }
}

impl Settle for KafkaSettler {
    fn settle(self: Box<Self>, settlement: Settlement) -> SettleFuture {
        let retry_at = match settlement {
            Settlement::Ack | Settlement::Reject => None,
            Settlement::Requeue { delay } => Some(later(Instant::now(), delay.unwrap_or_default())),
        };
        self.finish(retry_at);
        Box::pin(async { Ok(()) })
    }

    fn abandon(self: Box<Self>) {
        // Dropped unsettled (a panicking handler, the drain timeout, a fenced or revoked
        // delivery): delivered again after a second if the partition is still held.
        self.finish(Some(Instant::now() + Duration::from_secs(1)));
    }

    fn is_current(&self) -> bool {
        let state = self.shared.lock();
        state
            .parts
            .get(&(self.record.topic.clone(), self.record.partition))
            .is_some_and(|part| {
                part.epoch == self.epoch
                    && part.live()
                    && part.in_flight.contains_key(&self.record.offset)
            })
    }
}

/// A Kafka consumer-group member whose positions live in the database. See the [module
/// documentation](self).
pub struct KafkaSource {
    shared: Arc<Shared>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl std::fmt::Debug for KafkaSource {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        some_fields(
            f,
            "KafkaSource",
            &[("name", &self.shared.name), ("group", &self.shared.group)],
        )
    }
}

impl KafkaSource {
    /// Creates the consumer, subscribes to the topics, checks that the cluster answers, and
    /// installs the source's position hook on `dispatcher`, which it returns: run the
    /// [`Worker`](crate::Worker) with that dispatcher. The positions live in the dispatcher's
    /// database: migrate [`Component::Positions`](crate::Component::Positions) first. Needs a
    /// multi-threaded Tokio runtime (the consumer's thread reads positions through it). Under a
    /// [`TablePrefix`](crate::store::TablePrefix), the positions (read and written on the
    /// consumer's thread and by the hook) are in the dispatcher's prefix, else in the prefix of
    /// the scope `connect` is awaited in, wherever the worker then runs.
    ///
    /// # Errors
    /// A [`SourceError`] with operation `"connect"` if the configuration is refused (an unknown
    /// property, no topic) or the cluster does not answer within 10 s, `"subscribe"` if the
    /// subscription fails.
    pub async fn connect<DB: PositionsDatabase>(
        config: KafkaConfig,
        dispatcher: Dispatcher<DB>,
    ) -> Result<(Self, Dispatcher<DB>), SourceError> {
        let name = format!("{}/{}", config.group, config.topics.join(","));
        if config.topics.is_empty() {
            return Err(SourceError::new(&name, "connect", "no topic to consume"));
        }
        let mut consumers: HashMap<String, usize> = HashMap::new();
        for handler in dispatcher.handlers() {
            *consumers
                .entry(handler.message_name.to_owned())
                .or_default() += 1;
        }
        let client_id = config
            .properties
            .get("client.id")
            .cloned()
            .unwrap_or_else(|| "rdkafka".to_owned());
        let host = std::env::var("HOSTNAME").unwrap_or_default();
        let shared = Arc::new(Shared {
            name: name.clone(),
            group: config.group.clone(),
            owner: format!("{client_id}@{host}/{}", std::process::id()),
            topics: config.topics.iter().cloned().collect(),
            name_header: config.name_header.clone(),
            topic_names: config.topic_names.clone(),
            ordering: config.ordering,
            max_buffered: config.max_buffered,
            revoke_wait: config.revoke_wait,
            assign_timeout: config.assign_timeout,
            consumers,
            state: Mutex::new(State::default()),
            wake: tokio::sync::Notify::new(),
            stop: AtomicBool::new(false),
            payload_limit: AtomicUsize::new(dispatcher.max_payload_bytes()),
        });
        // The positions' table prefix: the dispatcher's (the scope it was built in), else the
        // scope's the source is connected in. The rebalance callbacks (on the consumer's
        // thread, outside any scope) and the position hook (in the claim's transaction) both
        // use it, so that an epoch taken is the epoch checked.
        let prefix = dispatcher
            .prefix
            .clone()
            .or_else(crate::store::TablePrefix::current);
        let context = Context {
            shared: Arc::clone(&shared),
            positions: Arc::new(PoolPositions(dispatcher.pool().clone(), prefix.clone())),
            runtime: tokio::runtime::Handle::current(),
        };
        let consumer: BaseConsumer<Context> = config
            .client_config()
            .create_with_context(context)
            .map_err(|e| SourceError::new(&name, "connect", e))?;
        let consumer = tokio::task::spawn_blocking(move || {
            consumer
                .fetch_metadata(None, Duration::from_secs(10))
                .map(|_| consumer)
        })
        .await
        .map_err(|e| SourceError::new(&name, "connect", e))?
        .map_err(|e| SourceError::new(&name, "connect", e))?;
        let topics: Vec<&str> = config.topics.iter().map(String::as_str).collect();
        consumer
            .subscribe(&topics)
            .map_err(|e| SourceError::new(&name, "subscribe", e))?;
        let poller = Poller {
            shared: Arc::clone(&shared),
            consumer,
            commit_interval: config.commit_interval,
        };
        let thread = std::thread::Builder::new()
            .name("inbox-kafka".into())
            .spawn(move || poller.run())
            .map_err(|e| SourceError::new(&name, "connect", e))?;
        let dispatcher = dispatcher.with_hook(KafkaFence {
            shared: Arc::clone(&shared),
            prefix,
        });
        Ok((
            Self {
                shared,
                thread: Some(thread),
            },
            dispatcher,
        ))
    }

    /// The partitions this consumer holds now, as `(topic, partition, epoch)`, sorted.
    pub fn assignment(&self) -> Vec<(String, i32, i64)> {
        assignment_of(&self.shared)
    }

    /// A cheap handle that reads this source's assignment from anywhere (tests, health checks),
    /// also while a worker runs the source.
    pub fn assignment_handle(&self) -> AssignmentHandle {
        AssignmentHandle {
            shared: Arc::clone(&self.shared),
        }
    }
}

/// `at + after`, or a year after `at` if no clock can add `after` (a revocation wait or a
/// requeue delay of `Duration::MAX`: "without end").
fn later(at: Instant, after: Duration) -> Instant {
    at.checked_add(after)
        .unwrap_or_else(|| at + Duration::from_secs(365 * 86_400))
}

fn assignment_of(shared: &Shared) -> Vec<(String, i32, i64)> {
    let mut all: Vec<(String, i32, i64)> = shared
        .lock()
        .parts
        .iter()
        .filter(|(_, part)| part.live())
        .map(|((topic, partition), part)| (topic.to_string(), *partition, part.epoch))
        .collect();
    all.sort();
    all
}

/// Reads a [`KafkaSource`]'s assignment ([`KafkaSource::assignment_handle`]).
#[derive(Clone)]
pub struct AssignmentHandle {
    shared: Arc<Shared>,
}

impl std::fmt::Debug for AssignmentHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AssignmentHandle")
            .field("source", &self.shared.name)
            .finish()
    }
}

impl AssignmentHandle {
    /// The partitions the source holds now, as `(topic, partition, epoch)`, sorted.
    pub fn assignment(&self) -> Vec<(String, i32, i64)> {
        assignment_of(&self.shared)
    }

    /// The rebalances the source went through since it connected.
    pub fn rebalances(&self) -> RebalanceCounts {
        self.shared.lock().rebalances
    }

    /// The partitions the group assigned to the source that wait for their positions, as
    /// `(topic, partition)`, sorted: their rows are locked by the previous owners' open
    /// transactions (or the database fails). Not consumed until they are taken; not in
    /// [`assignment`](Self::assignment) until then.
    pub fn waiting(&self) -> Vec<(String, i32)> {
        let mut all: Vec<(String, i32)> = self
            .shared
            .lock()
            .waiting
            .keys()
            .map(|(topic, partition)| (topic.to_string(), *partition))
            .collect();
        all.sort();
        all
    }
}

impl Drop for KafkaSource {
    fn drop(&mut self) {
        // Not closed (the worker closes it): the thread still leaves the group.
        self.shared.stop.store(true, AtomicOrdering::SeqCst);
    }
}

impl Source for KafkaSource {
    fn name(&self) -> &str {
        &self.shared.name
    }

    /// See the module documentation's "Payload limit": of a value over `limit` only the first
    /// `limit` bytes are copied out of librdkafka's buffer. [`KafkaSource::connect`] starts
    /// with its dispatcher's limit.
    fn set_payload_limit(&mut self, limit: PayloadLimit) {
        self.shared
            .payload_limit
            .store(limit.bytes(), AtomicOrdering::Relaxed);
    }

    fn next(&mut self) -> BoxFuture<'_, Result<Option<Delivery>, SourceError>> {
        Box::pin(async move {
            loop {
                let notified = self.shared.wake.notified();
                let (record, wake_at) = self.shared.take()?;
                if let Some((record, epoch)) = record {
                    let envelope = self.shared.envelope(&record, epoch);
                    let ordering_key = match (self.shared.ordering, &record.key) {
                        (KafkaOrdering::RecordKey, Some(key)) => {
                            format!("{}/{}/{}", record.topic, record.partition, hex::encode(key))
                        }
                        _ => format!("{}/{}", record.topic, record.partition),
                    };
                    let settler = KafkaSettler {
                        shared: Arc::clone(&self.shared),
                        record,
                        epoch,
                    };
                    return Ok(Some(
                        Delivery::new(envelope, settler).with_ordering_key(ordering_key),
                    ));
                }
                let wait = wake_at.map_or(Duration::from_secs(1), |at| {
                    at.saturating_duration_since(Instant::now())
                });
                let _ = tokio::time::timeout(wait, notified).await;
            }
        })
    }

    fn close(&mut self) -> BoxFuture<'_, Result<(), SourceError>> {
        Box::pin(async move {
            self.shared.stop.store(true, AtomicOrdering::SeqCst);
            if let Some(thread) = self.thread.take() {
                tokio::task::spawn_blocking(move || thread.join())
                    .await
                    .map_err(|e| SourceError::new(&self.shared.name, "close", e))?
                    .map_err(|_| {
                        SourceError::new(&self.shared.name, "close", "the consumer thread panicked")
                    })?;
            }
            Ok(())
        })
    }
}

/// The consumer's thread: polls, buffers, pauses and resumes, flushes positions, commits.
struct Poller {
    shared: Arc<Shared>,
    consumer: BaseConsumer<Context>,
    commit_interval: Duration,
}

impl Poller {
    fn run(self) {
        let mut last_commit = Instant::now();
        while !self.shared.stop.load(AtomicOrdering::SeqCst) {
            match self.consumer.poll(Duration::from_millis(100)) {
                Some(Ok(message)) => self.buffer(&message),
                Some(Err(error)) => {
                    tracing::warn!(source = %self.shared.name, %error, "Kafka consumer error (librdkafka retries)");
                }
                None => {}
            }
            self.flow();
            self.take_over();
            if last_commit.elapsed() >= self.commit_interval {
                self.commit();
                last_commit = Instant::now();
            }
        }
        // Closing: write the final positions, then leave the group (dropping the consumer
        // serves the last revocation, on this thread).
        self.commit();
        drop(self.consumer);
        tracing::info!(source = %self.shared.name, "Kafka consumer closed");
    }

    fn buffer(&self, message: &rdkafka::message::BorrowedMessage<'_>) {
        let mut state = self.shared.lock();
        let Some(((topic, _), part)) = state.parts.iter_mut().find(|((topic, partition), _)| {
            **topic == *message.topic() && *partition == message.partition()
        }) else {
            return; // a partition no longer held
        };
        let topic = topic.clone();
        if !part.live()
            || part
                .fetched_next
                .is_some_and(|next| message.offset() < next)
        {
            return;
        }
        let limit = self.shared.payload_limit.load(AtomicOrdering::Relaxed);
        let headers = message
            .headers()
            .map(|headers| {
                headers
                    .iter()
                    .map(|h| (h.key.to_owned(), h.value.map(<[u8]>::to_vec)))
                    .collect()
            })
            .unwrap_or_default();
        part.fetched_next = Some(message.offset() + 1);
        part.buffer.push_back(Record {
            topic,
            partition: message.partition(),
            offset: message.offset(),
            key: message.key().map(<[u8]>::to_vec),
            payload: message
                .payload()
                .map(|value| value[..value.len().min(limit)].to_vec()),
            payload_size: message.payload_len(),
            timestamp_ms: message.timestamp().to_millis(),
            headers,
            not_before: None,
        });
        drop(state);
        self.shared.wake.notify_one();
    }

    /// Pauses full partitions, resumes half-drained ones.
    fn flow(&self) {
        let mut pause = TopicPartitionList::new();
        let mut resume = TopicPartitionList::new();
        {
            let mut state = self.shared.lock();
            for ((topic, partition), part) in state.parts.iter_mut() {
                let buffered = part.buffer.len();
                if !part.paused && buffered >= self.shared.max_buffered {
                    part.paused = true;
                    pause.add_partition(topic, *partition);
                } else if part.paused && buffered <= self.shared.max_buffered / 2 {
                    part.paused = false;
                    resume.add_partition(topic, *partition);
                }
            }
        }
        if pause.count() > 0
            && let Err(error) = self.consumer.pause(&pause)
        {
            tracing::warn!(source = %self.shared.name, %error, "cannot pause partitions");
        }
        if resume.count() > 0
            && let Err(error) = self.consumer.resume(&resume)
        {
            tracing::warn!(source = %self.shared.name, %error, "cannot resume partitions");
        }
    }

    /// Tries again to take the positions of the partitions waiting for them (those due, within
    /// [`TAKEOVER_BUDGET`]), and starts those taken. Never waits longer than [`LOCK_WAIT`] on a
    /// row: the poll loop keeps its cadence while a previous owner's transaction stays open.
    fn take_over(&self) {
        let now = Instant::now();
        let mut due: Vec<(PartKey, Option<Acquired>)> = self
            .shared
            .lock()
            .waiting
            .iter()
            .filter(|(_, waiting)| waiting.next_attempt <= now)
            .map(|(key, waiting)| (key.clone(), waiting.acquired))
            .collect();
        due.sort_by(|a, b| a.0.cmp(&b.0));
        let until = now + TAKEOVER_BUDGET;
        for (key, acquired) in due {
            if Instant::now() >= until {
                break;
            }
            let acquired = match acquired {
                Some(acquired) => acquired,
                None => match self.consumer.context().try_acquire(&key.0, key.1) {
                    Ok(Some(acquired)) => acquired,
                    Ok(None) => {
                        self.shared.still_locked(&key);
                        continue;
                    }
                    Err(error) => {
                        // The others at their next attempts: the database fails.
                        self.shared
                            .attempt_failed(&key, "read positions", error.into());
                        break;
                    }
                },
            };
            self.start(&key, acquired);
        }
    }

    /// Starts a partition whose position was taken after it waited: a seek to the stored offset
    /// (which also drops whatever was fetched before it), then the partition is resumed. Without
    /// a stored offset it resumes where its assignment put it.
    fn start(&self, key: &PartKey, acquired: Acquired) {
        let (topic, partition) = (&*key.0, key.1);
        if let Some(next) = acquired.next_offset
            && let Err(error) =
                self.consumer
                    .seek(topic, partition, Offset::Offset(next), SEEK_TIMEOUT)
        {
            // Taken: only the seek is tried again.
            if let Some(waiting) = self.shared.lock().waiting.get_mut(key) {
                waiting.acquired = Some(acquired);
            }
            self.shared.attempt_failed(key, "seek", error.into());
            return;
        }
        let waited = {
            let mut state = self.shared.lock();
            let Some(waiting) = state.waiting.remove(key) else {
                return; // revoked meanwhile
            };
            state
                .parts
                .insert(key.clone(), Part::new(acquired.epoch, acquired.next_offset));
            waiting.since.elapsed()
        };
        let mut resume = TopicPartitionList::new();
        resume.add_partition(topic, partition);
        if let Err(error) = self.consumer.resume(&resume) {
            // Resumed by `flow` at its next pass.
            tracing::warn!(source = %self.shared.name, %error, topic, partition, "cannot resume the partition (retried)");
            if let Some(part) = self.shared.lock().parts.get_mut(key) {
                part.paused = true;
            }
        }
        tracing::info!(source = %self.shared.name, topic, partition, epoch = acquired.epoch, next_offset = acquired.next_offset, waited_ms = waited.as_millis() as u64, "partition assigned, after its previous owner's transaction ended");
        self.shared.wake.notify_one();
    }

    /// Writes the positions that moved without a transaction of their own, then commits every
    /// held partition's position to Kafka (advisory).
    fn commit(&self) {
        let mut flush: Vec<(PartKey, i64, i64)> = Vec::new();
        let mut commit = TopicPartitionList::new();
        {
            let state = self.shared.lock();
            for ((topic, partition), part) in &state.parts {
                if !part.live() {
                    continue;
                }
                let Some(next) = part.watermark(None) else {
                    continue;
                };
                if part.written.is_none_or(|w| w < next) {
                    flush.push(((topic.clone(), *partition), part.epoch, next));
                }
                if part.committed.is_none_or(|c| c < next) {
                    let _ = commit.add_partition_offset(topic, *partition, Offset::Offset(next));
                }
            }
        }
        let positions = &self.consumer.context().positions;
        let runtime = &self.consumer.context().runtime;
        for ((topic, partition), epoch, next) in flush {
            let key = PositionKey::new(&self.shared.group, &topic, partition);
            let written = match runtime.block_on(positions.try_advance(key, epoch, next)) {
                Ok(written) => written,
                Err(error) => {
                    // The others at the next commit too: the database fails.
                    tracing::warn!(source = %self.shared.name, %error, "cannot write the position (retried later)");
                    break;
                }
            };
            let mut state = self.shared.lock();
            let Some(part) = state.parts.get_mut(&(topic.clone(), partition)) else {
                continue;
            };
            if part.epoch != epoch {
                continue;
            }
            match written {
                Some(true) => part.written = Some(part.written.map_or(next, |w| w.max(next))),
                Some(false) => {
                    tracing::warn!(source = %self.shared.name, topic = &*topic, partition, "position fenced: another consumer owns the partition");
                    part.fenced = true;
                }
                None => {
                    // Held by a transaction of this consumer, which writes it anyway.
                    tracing::debug!(source = %self.shared.name, topic = &*topic, partition, "position locked; written later");
                }
            }
        }
        if commit.count() == 0 {
            return;
        }
        match self.consumer.commit(&commit, CommitMode::Async) {
            Ok(()) => {
                let mut state = self.shared.lock();
                for element in commit.elements() {
                    if let (Some(part), Offset::Offset(next)) = (
                        state
                            .parts
                            .get_mut(&(Arc::from(element.topic()), element.partition())),
                        element.offset(),
                    ) {
                        part.committed = Some(next);
                    }
                }
            }
            Err(error) => {
                tracing::debug!(source = %self.shared.name, %error, "advisory offset commit failed")
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record(offset: i64) -> Record {
        Record {
            topic: Arc::from("t"),
            partition: 0,
            offset,
            key: None,
            payload: None,
            payload_size: 0,
            timestamp_ms: None,
            headers: Vec::new(),
            not_before: None,
        }
    }

    #[test]
    fn the_watermark_is_the_lowest_offset_not_done() {
        let mut part = Part::new(1, Some(10));
        assert_eq!(
            part.watermark(None),
            Some(10),
            "nothing fetched: the stored position"
        );
        for offset in 10..15 {
            part.buffer.push_back(record(offset));
        }
        part.fetched_next = Some(15);
        assert_eq!(part.watermark(None), Some(10));
        // 10 and 11 in flight: done with 10 (its transaction), 11 still holds it back.
        part.buffer.pop_front();
        part.buffer.pop_front();
        part.in_flight.insert(10, None);
        part.in_flight.insert(11, None);
        assert_eq!(part.watermark(Some(10)), Some(11));
        part.in_flight.remove(&10);
        part.in_flight.remove(&11);
        assert_eq!(part.watermark(None), Some(12), "the buffer holds it back");
        part.buffer.clear();
        assert_eq!(part.watermark(None), Some(15), "all fetched records done");
    }

    #[test]
    fn records_given_up_hold_the_position_back() {
        // Revocation drops the buffer and deliveries that have not run: none of them may be
        // passed by the position the next owner starts from.
        let mut part = Part::new(3, Some(20));
        for offset in 20..26 {
            part.buffer.push_back(record(offset));
        }
        part.fetched_next = Some(26);
        let first = part.buffer.front().map(|r| r.offset).unwrap();
        part.give_up(first);
        part.buffer.clear();
        assert_eq!(part.watermark(None), Some(20));
        part.give_up(23);
        assert_eq!(part.watermark(None), Some(20), "the lowest given up counts");
    }
}
