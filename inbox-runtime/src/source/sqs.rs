//! Amazon SQS as a source, on the official [aws-sdk-sqs](https://docs.rs/aws-sdk-sqs): long
//! polling, delete after commit, visibility heartbeats, standard and FIFO queues. Cargo feature
//! `sqs`.
//!
//! ```no_run
//! # async fn demo(pool: sqlx::PgPool) -> Result<(), Box<dyn std::error::Error>> {
//! use std::time::Duration;
//! use inbox_runtime::{Dispatcher, Worker};
//! use inbox_runtime::source::sqs::{SqsConfig, SqsSource};
//!
//! // Endpoint, region and credentials from the standard AWS configuration (AWS_REGION,
//! // AWS_ENDPOINT_URL, profiles, instance roles, …), or set on `config.aws`.
//! let config = SqsConfig::new("payments.fifo")
//!     .visibility_timeout(Duration::from_secs(30))
//!     .max_in_flight(32);
//! let source = SqsSource::connect(config).await?;
//! Worker::new(Dispatcher::from_registry(pool)?)
//!     .concurrency(32)
//!     .run_until_signal(source)
//!     .await?;
//! # Ok(()) }
//! ```
//!
//! **Receiving**: one task long-polls the queue (`ReceiveMessage`, up to 10 messages,
//! [`SqsConfig::wait_time`]) while fewer than [`SqsConfig::max_in_flight`] deliveries are
//! received and not yet settled. A receive call is never cancelled half-way (a dropped long poll
//! would hide the messages it received until their visibility timeout): [`Source::next`] only
//! reads what the task received, and [`Source::close`] lets the current poll finish (up to
//! `wait_time`) and makes what it received visible again at once. The client's timeouts are set
//! above `wait_time` (a timeout below it breaks long polling; none at all lets a call hang).
//! A receive that fails for a passing reason (no answer, a timeout, throttling, any HTTP 5xx,
//! `ExpiredToken`/`RequestExpired`) is retried,
//! after the SDK's own retries, with a backoff from 0.2 s doubling up to 30 s; one that cannot
//! pass (no such queue, access denied) fails the source: [`Source::next`] returns a
//! [`SourceError`] with operation `"receive"`.
//!
//! **Message name**: the String message attribute [`SqsConfig::name_attribute`] (default
//! `message-name`, as [`SqsSink`](crate::sink::sqs::SqsSink) writes it). A message without it
//! gets the empty name, which no handler has. The payload is the message body.
//!
//! **Payload limit** ([`Source::set_payload_limit`], the dispatcher's limit under a
//! [`Worker`](crate::Worker); 1 MiB otherwise): the SDK reads each `ReceiveMessage` answer whole
//! (up to 10 messages), so the limit cannot stop it from reading a large body. What bounds that
//! is SQS itself: a message body is at most 1 MiB (256 KiB before August 2025; a queue's
//! `MaximumMessageSize` may lower it), and at most [`SqsConfig::max_in_flight`] messages are
//! held. A body over the limit is cut to its first `limit` bytes as soon as it is handed out
//! (its memory given back, before any other copy), and the worker keeps that cut copy in
//! `inbox_rejections` as `too_large` with its real size.
//!
//! **Metadata**: `source` = the queue name, `message_id` = SQS's `MessageId`, `delivery_count` =
//! `ApproximateReceiveCount`, `redelivered` = that count > 1, `published_at` = `SentTimestamp`;
//! on FIFO queues `partition` = `MessageGroupId`, `deduplication_id` = `MessageDeduplicationId`
//! and `sequence_number` = `SequenceNumber` (a decimal string of up to 128 bits, kept as text).
//! String and Number message attributes are copied into [`Envelope::headers`].
//!
//! **Settling** (each sent without waiting, in batches of up to 10 per call, gathered for up to
//! [`SqsConfig::settle_linger`]; [`Source::close`] flushes them):
//!
//! | settlement | SQS |
//! | --- | --- |
//! | ack | `DeleteMessageBatch` |
//! | reject | [`SqsConfig::reject`]: `DeleteMessageBatch` (default), or left to the queue's redrive policy |
//! | requeue `{ delay }` | `ChangeMessageVisibilityBatch` to `delay` (0 if `None`): received again after it; capped at what is left of SQS's 12 hours from the receive (less 2 s and `settle_linger`), logged when capped |
//! | abandoned (dropped unsettled) | `ChangeMessageVisibilityBatch` to 0: received again at once |
//!
//! A delete whose receipt handle is no longer valid (`ReceiptHandleIsInvalid`: the visibility
//! timeout had passed and another receive got a new handle) is logged, not an error: the
//! transaction committed, so that other delivery is a duplicate in the inbox.
//!
//! **Visibility heartbeat**: while a delivery is received and not settled (queued in the worker
//! or running), about every third of [`SqsConfig::visibility_timeout`] its visibility is set
//! again to that timeout from then on (`ChangeMessageVisibilityBatch`, batched over all
//! deliveries due), so that a handler slower than the visibility timeout is not delivered to
//! another worker meanwhile. Delete and visibility calls have timeouts of their own, far below
//! the heartbeat's period (attempts of a ninth of the visibility timeout, 1 s to 5 s; a whole
//! call with the SDK's retries 2 × that + 1 s), run side by side (a stalled call holds back
//! only its own entries; changes to one message are sent in order), and a failed call or entry
//! is sent once more before it is logged. The
//! heartbeat stops [`SqsConfig::max_processing_time`] after the receive (and before SQS's cap of
//! 12 hours of visibility per receive): a handler still running then lets its message be
//! received again.
//!
//! **Bad input** (no name attribute, an unknown name, a malformed body, a bad key): the worker
//! keeps the delivery in `inbox_rejections`, payload included, and acks it, so it is deleted:
//! a poison message is never received again and again. If it cannot be kept (database down), the
//! worker requeues it after its `requeue_delay` (never deleted unkept), and its next receive tries
//! again. Conflicts are rejected (kept by the dispatcher): deleted by default
//! ([`RejectAction::Delete`]); with [`RejectAction::LeaveToRedrive`] a rejected message is left to
//! become visible again, and the queue's redrive policy moves it to its dead-letter queue after
//! `maxReceiveCount` receives.
//!
//! **Dead letters**: the inbox dead-letters a message whose handler failed for good (its status
//! `dead`, payload kept) and acks it, so it is deleted; a redrive policy only sees messages that
//! kept failing *before* the inbox settled them (requeued by a transient failure, a worker that
//! crashed): set its `maxReceiveCount` above the number of retries you want the inbox to make.
//!
//! **FIFO queues** (a name ending in `.fifo`): `MessageGroupId` is the delivery's ordering key,
//! so the worker runs one message of a group at a time, in order, and groups in parallel. When a
//! delivery of a group is requeued or abandoned, the later deliveries of that group already
//! received are no longer current ([`Settle::is_current`]): the worker drops them before they
//! run, they are made visible again, and SQS delivers the group again in order, starting with
//! the requeued message once its delay has passed. Other groups go on meanwhile.

use std::collections::{BTreeMap, HashMap, HashSet, VecDeque};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, SystemTime};

use aws_sdk_sqs::Client;
use aws_sdk_sqs::error::{DisplayErrorContext, ProvideErrorMetadata, SdkError};
use aws_sdk_sqs::types::{
    BatchResultErrorEntry, ChangeMessageVisibilityBatchRequestEntry,
    DeleteMessageBatchRequestEntry, Message, MessageSystemAttributeName,
};
use tokio::sync::{OwnedSemaphorePermit, Semaphore, mpsc, oneshot};
use tokio::task::{JoinHandle, JoinSet};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use crate::BoxFuture;
use crate::debug::some_fields;
use crate::setters::setters;
use crate::source::{Delivery, Settle, SettleFuture, Settlement, Source, SourceError};
use crate::types::envelope::{Envelope, SourceMetadata};
use crate::types::limit::PayloadLimit;

/// SQS's cap on the visibility of one receive: 12 hours, in seconds.
const MAX_VISIBILITY_SECS: u64 = 12 * 60 * 60;
/// At most this many entries in one batch call (SQS's limit) and messages in one receive.
const MAX_BATCH: usize = 10;

/// Endpoint, region and credentials that override the standard AWS configuration (environment
/// variables such as `AWS_ENDPOINT_URL`, `AWS_REGION`, `AWS_ACCESS_KEY_ID`; profiles; instance
/// and container roles). `None` fields come from there.
#[derive(Clone, Default)]
#[non_exhaustive]
pub struct AwsSettings {
    /// The endpoint, e.g. `http://127.0.0.1:5011` for a local SQS-compatible server.
    pub endpoint_url: Option<String>,
    /// The region, e.g. `eu-west-1`.
    pub region: Option<String>,
    /// Static credentials: access key id and secret access key.
    pub credentials: Option<(String, String)>,
}

impl std::fmt::Debug for AwsSettings {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AwsSettings")
            .field("endpoint_url", &self.endpoint_url)
            .field("region", &self.region)
            .field(
                "credentials",
                &self.credentials.as_ref().map(|(id, _)| (id, "***")),
            )
            .finish()
    }
}

impl AwsSettings {
    setters! {
        /// Sets [`endpoint_url`](Self::endpoint_url).
        pub fn endpoint_url(url: impl Into<String>) {
            self.endpoint_url = Some(url.into());
        }

        /// Sets [`region`](Self::region).
        pub fn region(region: impl Into<String>) {
            self.region = Some(region.into());
        }
    }

    /// Sets static [`credentials`](Self::credentials).
    pub fn credentials(
        mut self,
        access_key_id: impl Into<String>,
        secret_access_key: impl Into<String>,
    ) -> Self {
        self.credentials = Some((access_key_id.into(), secret_access_key.into()));
        self
    }
}

/// An SQS client from the standard AWS configuration with `settings` applied, on hyper and
/// rustls (ring). Every call attempt times out after `longest_call` + 10 s (connect: 5 s); pass
/// at least the long poll's wait time (at most 20 s; a `longest_call` above an hour is lowered
/// to an hour: the SDK's timer arithmetic panics on durations near `Duration::MAX`). The SDK's
/// standard retry policy applies (3 attempts).
pub async fn client(settings: &AwsSettings, longest_call: Duration) -> Client {
    use aws_smithy_http_client::tls::{Provider, rustls_provider::CryptoMode};
    let http = aws_smithy_http_client::Builder::new()
        .tls_provider(Provider::Rustls(CryptoMode::Ring))
        .build_https();
    let attempt = longest_call.min(Duration::from_secs(3600)) + Duration::from_secs(10);
    let timeouts = aws_config::timeout::TimeoutConfig::builder()
        .connect_timeout(Duration::from_secs(5))
        .read_timeout(attempt)
        .operation_attempt_timeout(attempt)
        .operation_timeout(attempt * 3 + Duration::from_secs(5))
        .build();
    let mut loader = aws_config::defaults(aws_config::BehaviorVersion::latest())
        .http_client(http)
        .timeout_config(timeouts);
    if let Some(url) = &settings.endpoint_url {
        loader = loader.endpoint_url(url);
    }
    if let Some(region) = &settings.region {
        loader = loader.region(aws_config::Region::new(region.clone()));
    }
    if let Some((id, secret)) = &settings.credentials {
        loader = loader.credentials_provider(aws_sdk_sqs::config::Credentials::new(
            id,
            secret,
            None,
            None,
            "inbox-runtime",
        ));
    }
    Client::new(&loader.load().await)
}

/// A per-call override of the client's timeouts: `attempt` per attempt (and to read the
/// answer), 2 × `attempt` + 1 s for the whole call with the SDK's retries. For calls that must
/// not wait as long as a long poll (deletes, visibility changes, sends).
pub(crate) fn call_timeouts(attempt: Duration) -> aws_sdk_sqs::config::Builder {
    aws_sdk_sqs::config::Builder::default().timeout_config(
        aws_config::timeout::TimeoutConfig::builder()
            .connect_timeout(attempt.min(Duration::from_secs(5)))
            .read_timeout(attempt)
            .operation_attempt_timeout(attempt)
            .operation_timeout(attempt * 2 + Duration::from_secs(1))
            .build(),
    )
}

/// The attempt timeout of delete and visibility batch calls: a ninth of the visibility timeout,
/// between 1 s and 5 s, so that a whole call (2 × this + 1 s, retries included) ends well
/// before the next heartbeat is due (every third of the visibility timeout).
fn batch_attempt_timeout(visibility_timeout: Duration) -> Duration {
    (visibility_timeout / 9).clamp(Duration::from_secs(1), Duration::from_secs(5))
}

/// The queue's URL and name: `queue` itself if it is a URL (`http://` or `https://`, the name
/// being its last path segment), else the URL `GetQueueUrl` answers for the name (each attempt
/// within `attempt_timeout` if given, see [`call_timeouts`]; else the client's timeouts).
pub(crate) async fn resolve_queue(
    client: &Client,
    queue: &str,
    attempt_timeout: Option<Duration>,
) -> Result<(String, String), SdkError<aws_sdk_sqs::operation::get_queue_url::GetQueueUrlError>> {
    if queue.starts_with("http://") || queue.starts_with("https://") {
        let name = queue
            .trim_end_matches('/')
            .rsplit('/')
            .next()
            .unwrap_or(queue);
        return Ok((queue.to_owned(), name.to_owned()));
    }
    let mut call = client.get_queue_url().queue_name(queue).customize();
    if let Some(attempt) = attempt_timeout {
        call = call.config_override(call_timeouts(attempt));
    }
    let url = call.send().await?.queue_url.unwrap_or_default();
    Ok((url, queue.to_owned()))
}

/// What a [`Settlement::Reject`] does to the message.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum RejectAction {
    /// Delete it: it is never received again. The worker rejects only what is kept in
    /// `inbox_rejections` (what it cannot keep there, the database failing, it requeues).
    #[default]
    Delete,
    /// Leave it: it becomes visible again when its visibility timeout passes, and the queue's
    /// redrive policy moves it to the dead-letter queue after `maxReceiveCount` receives (without
    /// a redrive policy it is received again forever).
    LeaveToRedrive,
}

/// How to consume. Build with [`SqsConfig::new`] and the setters. The setters keep SQS's limits
/// (noted on each field); fields set directly are brought within them when the source connects.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct SqsConfig {
    /// The queue: its name (resolved with `GetQueueUrl`) or its URL. A name ending in `.fifo` is
    /// a FIFO queue.
    pub queue: String,
    /// Endpoint, region and credentials, over the standard AWS configuration.
    pub aws: AwsSettings,
    /// How long one receive call waits for messages (`WaitTimeSeconds`, whole seconds rounded
    /// down, from 1 s to 20 s: 0 would be short polling, a busy loop on an empty queue). Default
    /// 20 s. [`Source::close`] may wait this long for the current poll.
    pub wait_time: Duration,
    /// At most this many deliveries received and not yet settled. Default 64; keep it at least
    /// the worker's concurrency.
    pub max_in_flight: usize,
    /// The visibility timeout requested on receive and renewed by the heartbeat (whole seconds,
    /// at least 1 s). Default 30 s.
    pub visibility_timeout: Duration,
    /// How long after its receive a delivery's visibility is still extended. Default 30 min;
    /// capped at SQS's 12 hours.
    pub max_processing_time: Duration,
    /// The String message attribute carrying the message name. Default `message-name`.
    pub name_attribute: String,
    /// What a reject does. Default [`RejectAction::Delete`].
    pub reject: RejectAction,
    /// How long a delete or visibility change waits for others to share its batch call (up to
    /// 10 entries). Default 100 ms: settling does not wait for the call, so this costs no
    /// throughput; it delays deletes and requeues by at most this long.
    pub settle_linger: Duration,
}

impl SqsConfig {
    /// Consume `queue` (a name or a URL), with the defaults listed on the fields.
    pub fn new(queue: impl Into<String>) -> Self {
        Self {
            queue: queue.into(),
            aws: AwsSettings::default(),
            wait_time: Duration::from_secs(20),
            max_in_flight: 64,
            visibility_timeout: Duration::from_secs(30),
            max_processing_time: Duration::from_secs(30 * 60),
            name_attribute: "message-name".into(),
            reject: RejectAction::Delete,
            settle_linger: Duration::from_millis(100),
        }
    }

    setters! {
        /// Sets [`aws`](Self::aws).
        pub fn aws(aws: AwsSettings);

        /// Sets [`wait_time`](Self::wait_time) (from 1 s to 20 s).
        pub fn wait_time(wait: Duration) {
            self.wait_time = wait.clamp(Duration::from_secs(1), Duration::from_secs(20));
        }
    }

    /// The limits the setters keep, applied again by [`SqsSource::connect`] to fields set
    /// directly.
    fn within_limits(self) -> Self {
        let (wait, in_flight, visibility, processing) = (
            self.wait_time,
            self.max_in_flight,
            self.visibility_timeout,
            self.max_processing_time,
        );
        self.wait_time(wait)
            .max_in_flight(in_flight)
            .visibility_timeout(visibility)
            .max_processing_time(processing)
    }

    setters! {
        /// Sets [`max_in_flight`](Self::max_in_flight) (at least 1).
        pub fn max_in_flight(max: usize) {
            self.max_in_flight = max.max(1);
        }

        /// Sets [`visibility_timeout`](Self::visibility_timeout) (at least 1 s).
        pub fn visibility_timeout(timeout: Duration) {
            self.visibility_timeout = timeout.max(Duration::from_secs(1));
        }

        /// Sets [`max_processing_time`](Self::max_processing_time) (capped at 12 hours).
        pub fn max_processing_time(max: Duration) {
            self.max_processing_time = max.min(Duration::from_secs(MAX_VISIBILITY_SECS));
        }

        /// Sets [`name_attribute`](Self::name_attribute).
        pub fn name_attribute(attribute: impl Into<String>) {
            self.name_attribute = attribute.into();
        }

        /// Sets [`reject`](Self::reject).
        pub fn reject(action: RejectAction);

        /// Sets [`settle_linger`](Self::settle_linger).
        pub fn settle_linger(linger: Duration);
    }
}

/// Counts of the SQS calls a source made, for tests and metrics. Clones share the counts.
#[derive(Debug, Clone, Default)]
pub struct SqsStats(Arc<Counters>);

#[derive(Debug, Default)]
struct Counters {
    receive_calls: AtomicU64,
    received: AtomicU64,
    redelivered: AtomicU64,
    delete_calls: AtomicU64,
    deleted: AtomicU64,
    visibility_calls: AtomicU64,
    visibility_changes: AtomicU64,
    invalid_receipts: AtomicU64,
}

/// A snapshot of [`SqsStats`]: numbers of calls and of entries.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub struct SqsCounts {
    /// `ReceiveMessage` calls (empty long polls included).
    pub receive_calls: u64,
    /// Messages received.
    pub received: u64,
    /// Of those, redeliveries (`ApproximateReceiveCount` > 1).
    pub redelivered: u64,
    /// `DeleteMessageBatch` calls.
    pub delete_calls: u64,
    /// Entries sent in them.
    pub deleted: u64,
    /// `ChangeMessageVisibilityBatch` calls (heartbeats, requeues, releases).
    pub visibility_calls: u64,
    /// Entries sent in them.
    pub visibility_changes: u64,
    /// Entries SQS refused with `ReceiptHandleIsInvalid` (logged only).
    pub invalid_receipts: u64,
}

impl SqsStats {
    /// The counts so far.
    pub fn counts(&self) -> SqsCounts {
        let c = &self.0;
        let load = |n: &AtomicU64| n.load(Ordering::Relaxed);
        SqsCounts {
            receive_calls: load(&c.receive_calls),
            received: load(&c.received),
            redelivered: load(&c.redelivered),
            delete_calls: load(&c.delete_calls),
            deleted: load(&c.deleted),
            visibility_calls: load(&c.visibility_calls),
            visibility_changes: load(&c.visibility_changes),
            invalid_receipts: load(&c.invalid_receipts),
        }
    }
}

/// One entry for a batcher: a receipt handle, and the new visibility (seconds) for a change.
struct Entry {
    receipt_handle: String,
    visibility: i32,
}

enum Command {
    Entry(Entry),
    Flush(oneshot::Sender<()>),
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum BatchKind {
    Delete,
    Visibility,
}

/// A delivery being tracked by the heartbeat.
struct Tracked {
    receipt_handle: String,
    received_at: Instant,
    extended_at: Instant,
}

/// What the source's tasks and settlers share.
struct Shared {
    name: String,
    config: SqsConfig,
    deletes: mpsc::UnboundedSender<Command>,
    visibility: mpsc::UnboundedSender<Command>,
    /// Received and not settled: delivery id → heartbeat state.
    tracked: Mutex<HashMap<u64, Tracked>>,
    /// FIFO group → epoch, bumped when a delivery of the group is requeued or abandoned.
    groups: Mutex<HashMap<String, u64>>,
    next_id: AtomicU64,
    stats: SqsStats,
}

impl Shared {
    fn untrack(&self, id: u64) {
        self.tracked
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .remove(&id);
    }

    fn group_epoch(&self, group: &str) -> u64 {
        let groups = self.groups.lock().unwrap_or_else(PoisonError::into_inner);
        groups.get(group).copied().unwrap_or(0)
    }

    fn bump_group(&self, group: &str) {
        let mut groups = self.groups.lock().unwrap_or_else(PoisonError::into_inner);
        *groups.entry(group.to_owned()).or_insert(0) += 1;
    }

    /// Sends `entry` to the delete or visibility batcher.
    fn send(&self, kind: BatchKind, entry: Entry) -> Result<(), SourceError> {
        let sender = match kind {
            BatchKind::Delete => &self.deletes,
            BatchKind::Visibility => &self.visibility,
        };
        sender.send(Command::Entry(entry)).map_err(|_| {
            SourceError::new(
                &self.name,
                "settle",
                "the source is closed: its batcher stopped",
            )
        })
    }
}

/// Whole seconds in `duration`, rounded up (saturating).
fn ceil_secs(duration: Duration) -> u64 {
    duration
        .as_secs()
        .saturating_add(u64::from(duration.subsec_nanos() > 0))
}

/// What is left of SQS's 12 hours of visibility from the receive at `received_at`, in whole
/// seconds, keeping a margin for the time the change may wait to be sent (`linger`) and 2 s (SQS
/// refuses a change past the 12 hours, and moto the whole batch with it).
fn visibility_left(received_at: Instant, linger: Duration) -> u64 {
    MAX_VISIBILITY_SECS.saturating_sub(
        ceil_secs(received_at.elapsed())
            .saturating_add(ceil_secs(linger))
            .saturating_add(2),
    )
}

/// The visibility (whole seconds) that `wanted` becomes for a message received at `received_at`:
/// rounded up, and within SQS's 12 hours from the receive ([`visibility_left`]).
fn visibility_secs(wanted: Duration, received_at: Instant, linger: Duration) -> i32 {
    let left = visibility_left(received_at, linger);
    i32::try_from(ceil_secs(wanted).min(left)).unwrap_or(i32::MAX)
}

/// An SQS queue consumer. See the [module documentation](self).
pub struct SqsSource {
    shared: Arc<Shared>,
    received: mpsc::UnboundedReceiver<Result<Delivery, SourceError>>,
    stop: CancellationToken,
    receiver: Option<JoinHandle<()>>,
    heartbeat: Option<JoinHandle<()>>,
    limit: PayloadLimit,
}

impl std::fmt::Debug for SqsSource {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        some_fields(
            f,
            "SqsSource",
            &[("name", &self.shared.name), ("config", &self.shared.config)],
        )
    }
}

impl SqsSource {
    /// Builds a client from [`SqsConfig::aws`] and the standard AWS configuration (see
    /// [`client`]), resolves the queue and starts receiving.
    ///
    /// # Errors
    /// A [`SourceError`] with operation `"connect"` if the queue's URL cannot be resolved (no
    /// such queue, no region or credentials, server unreachable).
    pub async fn connect(config: SqsConfig) -> Result<Self, SourceError> {
        let client = client(&config.aws, config.wait_time).await;
        Self::with_client(client, config).await
    }

    /// Like [`connect`](Self::connect) on an existing client (whose timeouts must exceed
    /// [`SqsConfig::wait_time`]).
    ///
    /// # Errors
    /// As [`connect`](Self::connect).
    pub async fn with_client(client: Client, config: SqsConfig) -> Result<Self, SourceError> {
        let config = config.within_limits();
        let (url, name) = resolve_queue(&client, &config.queue, None)
            .await
            .map_err(|e| {
                SourceError::new(&config.queue, "connect", DisplayErrorContext(e).to_string())
            })?;
        let (deletes, delete_rx) = mpsc::unbounded_channel();
        let (visibility, visibility_rx) = mpsc::unbounded_channel();
        let stats = SqsStats::default();
        let shared = Arc::new(Shared {
            name: name.clone(),
            config,
            deletes,
            visibility,
            tracked: Mutex::new(HashMap::new()),
            groups: Mutex::new(HashMap::new()),
            next_id: AtomicU64::new(0),
            stats,
        });
        for (kind, rx) in [
            (BatchKind::Delete, delete_rx),
            (BatchKind::Visibility, visibility_rx),
        ] {
            tokio::spawn(batcher(
                kind,
                client.clone(),
                url.clone(),
                rx,
                shared.config.settle_linger,
                shared.stats.clone(),
                batch_attempt_timeout(shared.config.visibility_timeout),
            ));
        }
        let stop = CancellationToken::new();
        let (tx, received) = mpsc::unbounded_channel();
        let receiver = tokio::spawn(receive_loop(
            client,
            url,
            Arc::clone(&shared),
            tx,
            stop.clone(),
        ));
        let heartbeat = tokio::spawn(heartbeat(Arc::clone(&shared), stop.clone()));
        Ok(Self {
            shared,
            received,
            stop,
            receiver: Some(receiver),
            heartbeat: Some(heartbeat),
            limit: PayloadLimit::DEFAULT,
        })
    }

    /// The configuration it was connected with.
    pub fn config(&self) -> &SqsConfig {
        &self.shared.config
    }

    /// The counts of its SQS calls (clones share them: take one before handing the source to a
    /// worker).
    pub fn stats(&self) -> SqsStats {
        self.shared.stats.clone()
    }
}

/// Long-polls until `stop`, while permits are free; every received message goes to `tx`.
async fn receive_loop(
    client: Client,
    url: String,
    shared: Arc<Shared>,
    tx: mpsc::UnboundedSender<Result<Delivery, SourceError>>,
    stop: CancellationToken,
) {
    let config = &shared.config;
    let permits = Arc::new(Semaphore::new(config.max_in_flight));
    let wait = i32::try_from(config.wait_time.as_secs()).unwrap_or(20);
    let visibility = visibility_secs(config.visibility_timeout, Instant::now(), Duration::ZERO);
    let mut backoff = Duration::from_millis(200);
    loop {
        let first = tokio::select! {
            permit = Arc::clone(&permits).acquire_owned() => match permit {
                Ok(permit) => permit,
                Err(_) => return,
            },
            () = stop.cancelled() => return,
        };
        let mut held = vec![first];
        while held.len() < MAX_BATCH {
            match Arc::clone(&permits).try_acquire_owned() {
                Ok(permit) => held.push(permit),
                Err(_) => break,
            }
        }
        if stop.is_cancelled() {
            return;
        }
        shared.stats.0.receive_calls.fetch_add(1, Ordering::Relaxed);
        // Never cancelled: a long poll dropped half-way would hide what it received.
        let received = client
            .receive_message()
            .queue_url(&url)
            .max_number_of_messages(i32::try_from(held.len()).unwrap_or(1))
            .wait_time_seconds(wait)
            .visibility_timeout(visibility)
            .message_system_attribute_names(MessageSystemAttributeName::All)
            .message_attribute_names("All")
            .send()
            .await;
        match received {
            Ok(output) => {
                backoff = Duration::from_millis(200);
                let received_at = Instant::now();
                for message in output.messages.unwrap_or_default() {
                    shared.stats.0.received.fetch_add(1, Ordering::Relaxed);
                    let permit = held
                        .pop()
                        .expect("SQS returns at most the requested number");
                    let delivery = delivery(&shared, message, received_at, permit);
                    // After close, `next` is no longer read: the delivery is released (dropped
                    // unsettled: visible again at once) when the channel is drained.
                    if let Err(mpsc::error::SendError(unsent)) = tx.send(Ok(delivery)) {
                        drop(unsent);
                    }
                }
            }
            Err(error) if !passing(&error) => {
                // No such queue, access denied, bad request: the source fails (the worker
                // finishes what it has and returns the error).
                let error = DisplayErrorContext(error).to_string();
                let _ = tx.send(Err(SourceError::new(&shared.name, "receive", error)));
                return;
            }
            Err(error) => {
                // Network, timeout or throttling after the SDK's own retries: wait and retry.
                tracing::warn!(
                    source = %shared.name,
                    error = %DisplayErrorContext(&error),
                    retry_in_ms = backoff.as_millis() as u64,
                    "SQS receive failed; retrying"
                );
                tokio::select! {
                    () = tokio::time::sleep(backoff) => {}
                    () = stop.cancelled() => return,
                }
                backoff = (backoff * 2).min(Duration::from_secs(30));
            }
        }
    }
}

/// Whether a failed receive may pass, after the SDK's own retries: no answer (network, timeout,
/// a dispatch failure), throttling, a server error (any HTTP 5xx, whatever its code), or expired
/// credentials or signature (`ExpiredToken`, `RequestExpired`: refreshed credentials or a
/// corrected clock pass).
fn passing<E: ProvideErrorMetadata>(
    error: &SdkError<E, aws_sdk_sqs::config::http::HttpResponse>,
) -> bool {
    match error {
        SdkError::ServiceError(service) => {
            let code = service.err().code().unwrap_or("");
            service.raw().status().is_server_error()
                || code.contains("Throttl")
                || matches!(
                    code,
                    "RequestThrottled"
                        | "OverLimit"
                        | "ServiceUnavailable"
                        | "InternalFailure"
                        | "InternalError"
                        | "KmsThrottled"
                        | "ExpiredToken"
                        | "ExpiredTokenException"
                        | "RequestExpired"
                )
        }
        SdkError::ConstructionFailure(_) => false,
        // Timeouts, dispatch failures (connection refused or reset), unreadable answers.
        _ => true,
    }
}

/// The delivery of one received message.
fn delivery(
    shared: &Arc<Shared>,
    message: Message,
    received_at: Instant,
    permit: OwnedSemaphorePermit,
) -> Delivery {
    let attributes = message.attributes.unwrap_or_default();
    let attribute = |name: MessageSystemAttributeName| attributes.get(&name).cloned();
    let mut headers = BTreeMap::new();
    for (name, value) in message.message_attributes.unwrap_or_default() {
        if let Some(text) = value.string_value {
            headers.insert(name, text);
        }
    }
    let message_name = headers
        .get(&shared.config.name_attribute)
        .cloned()
        .unwrap_or_default();
    let receive_count = attribute(MessageSystemAttributeName::ApproximateReceiveCount)
        .and_then(|count| count.parse::<u64>().ok());
    let group = attribute(MessageSystemAttributeName::MessageGroupId);

    let mut metadata = SourceMetadata::new(&shared.name);
    if let Some(id) = &message.message_id {
        metadata = metadata.message_id(id.clone());
    }
    if let Some(count) = receive_count {
        if count > 1 {
            shared.stats.0.redelivered.fetch_add(1, Ordering::Relaxed);
        }
        metadata = metadata.delivery_count(count).redelivered(count > 1);
    }
    if let Some(sent) =
        attribute(MessageSystemAttributeName::SentTimestamp).and_then(|ms| ms.parse::<u64>().ok())
    {
        metadata = metadata.published_at(SystemTime::UNIX_EPOCH + Duration::from_millis(sent));
    }
    if let Some(group) = &group {
        metadata = metadata.partition(group.clone());
    }
    if let Some(id) = attribute(MessageSystemAttributeName::MessageDeduplicationId) {
        metadata = metadata.deduplication_id(id);
    }
    if let Some(sequence) = attribute(MessageSystemAttributeName::SequenceNumber) {
        metadata = metadata.sequence_number(sequence);
    }

    let receipt_handle = message.receipt_handle.unwrap_or_default();
    let id = shared.next_id.fetch_add(1, Ordering::Relaxed);
    shared
        .tracked
        .lock()
        .unwrap_or_else(PoisonError::into_inner)
        .insert(
            id,
            Tracked {
                receipt_handle: receipt_handle.clone(),
                received_at,
                extended_at: received_at,
            },
        );
    let group = group.map(|group| {
        let epoch = shared.group_epoch(&group);
        (group, epoch)
    });
    let mut envelope =
        Envelope::new(message_name, message.body.unwrap_or_default()).with_source(metadata);
    envelope.headers = headers;
    let ordering_key = group.as_ref().map(|(group, _)| group.clone());
    let delivery = Delivery::new(
        envelope,
        SqsSettler {
            shared: Arc::clone(shared),
            id,
            receipt_handle,
            received_at,
            group,
            _permit: permit,
        },
    );
    match ordering_key {
        Some(key) => delivery.with_ordering_key(key),
        None => delivery,
    }
}

/// Extends the visibility of every tracked delivery due, every third of the visibility timeout,
/// until `stop`; after `stop`, until the source's last delivery is settled.
async fn heartbeat(shared: Arc<Shared>, stop: CancellationToken) {
    let config = &shared.config;
    let every = config.visibility_timeout / 3;
    let mut tick = tokio::time::interval(every.max(Duration::from_millis(100)));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = tick.tick() => {}
            () = stop.cancelled() => return,
        }
        let now = Instant::now();
        {
            // Sent while the lock is held: a release (requeue, abandon) untracks its delivery
            // under this lock before sending its own change, so an extension is never queued
            // after it (the batcher keeps the last change per receipt handle).
            let mut tracked = shared
                .tracked
                .lock()
                .unwrap_or_else(PoisonError::into_inner);
            tracked.retain(|_, t| {
                let age = now.duration_since(t.received_at);
                if age >= config.max_processing_time {
                    tracing::warn!(
                        source = %shared.name,
                        age_s = age.as_secs(),
                        "SQS delivery past its maximum processing time: no longer extended, it \
                         will be received again"
                    );
                    return false;
                }
                if now.duration_since(t.extended_at) + every / 2 >= every {
                    let wanted = config
                        .visibility_timeout
                        .min(config.max_processing_time - age);
                    let _ = shared.send(
                        BatchKind::Visibility,
                        Entry {
                            receipt_handle: t.receipt_handle.clone(),
                            visibility: visibility_secs(
                                wanted,
                                t.received_at,
                                config.settle_linger,
                            ),
                        },
                    );
                    t.extended_at = now;
                }
                true
            });
        }
    }
}

/// At most this many batch calls under way at once per batcher.
const MAX_CALLS: usize = 8;

/// Sends the entries it is given in batch calls of up to 10, gathering each for up to `linger`.
/// A call does not wait for the previous one (one stalled call holds back only its own entries),
/// except that an entry whose receipt handle is in a call under way waits for that call: changes
/// of one message are sent in the order given. Of several entries for one receipt handle not yet
/// sent, the last one given is sent (a requeue after a heartbeat). A flush answers once every
/// entry given before it is sent and its call finished.
async fn batcher(
    kind: BatchKind,
    client: Client,
    url: String,
    mut rx: mpsc::UnboundedReceiver<Command>,
    linger: Duration,
    stats: SqsStats,
    attempt_timeout: Duration,
) {
    let mut queued: VecDeque<Entry> = VecDeque::new();
    let mut busy: HashSet<String> = HashSet::new();
    let mut calls: JoinSet<Vec<String>> = JoinSet::new();
    let mut flushes: Vec<oneshot::Sender<()>> = Vec::new();
    let mut deadline: Option<Instant> = None;
    let mut closed = false;
    loop {
        let due = closed || !flushes.is_empty() || deadline.is_some_and(|d| Instant::now() >= d);
        while calls.len() < MAX_CALLS {
            let sendable = queued
                .iter()
                .filter(|entry| !busy.contains(&entry.receipt_handle))
                .count();
            if sendable == 0 || (sendable < MAX_BATCH && !due) {
                break;
            }
            let mut batch = Vec::with_capacity(MAX_BATCH);
            let mut kept = VecDeque::with_capacity(queued.len());
            for entry in queued.drain(..) {
                if batch.len() < MAX_BATCH && !busy.contains(&entry.receipt_handle) {
                    busy.insert(entry.receipt_handle.clone());
                    batch.push(entry);
                } else {
                    kept.push_back(entry);
                }
            }
            queued = kept;
            let handles = batch.iter().map(|e| e.receipt_handle.clone()).collect();
            let (client, url, stats) = (client.clone(), url.clone(), stats.clone());
            calls.spawn(async move {
                send_batch(kind, &client, &url, batch, &stats, attempt_timeout).await;
                handles
            });
            deadline = None;
        }
        let sendable = queued
            .iter()
            .any(|entry| !busy.contains(&entry.receipt_handle));
        if !sendable {
            deadline = None;
        } else if deadline.is_none() {
            // A linger no clock can add (`Duration::MAX`): sent at the next flush or close.
            deadline = Some(
                Instant::now()
                    .checked_add(linger)
                    .unwrap_or_else(|| Instant::now() + Duration::from_secs(365 * 86_400)),
            );
        }
        if queued.is_empty() && calls.is_empty() {
            for done in flushes.drain(..) {
                let _ = done.send(());
            }
            if closed {
                return;
            }
        }
        tokio::select! {
            command = rx.recv(), if !closed => match command {
                Some(Command::Entry(entry)) => {
                    queued.retain(|e| e.receipt_handle != entry.receipt_handle);
                    queued.push_back(entry);
                }
                Some(Command::Flush(done)) => flushes.push(done),
                None => closed = true,
            },
            Some(finished) = calls.join_next(), if !calls.is_empty() => {
                for handle in finished.unwrap_or_default() {
                    busy.remove(&handle);
                }
            }
            () = sleep_until_some(deadline), if deadline.is_some() && calls.len() < MAX_CALLS => {}
        }
    }
}

async fn sleep_until_some(deadline: Option<Instant>) {
    if let Some(deadline) = deadline {
        tokio::time::sleep_until(deadline).await;
    }
}

/// Sends `batch` in one call (timeouts: [`call_timeouts`] of `attempt_timeout`); entries that
/// failed, or all if the call failed, are sent once more, then logged.
async fn send_batch(
    kind: BatchKind,
    client: &Client,
    url: &str,
    mut batch: Vec<Entry>,
    stats: &SqsStats,
    attempt_timeout: Duration,
) {
    for last in [false, true] {
        let failed = send_once(kind, client, url, &batch, stats, attempt_timeout, last).await;
        if failed.is_empty() {
            return;
        }
        let mut failed = failed.into_iter().collect::<HashSet<_>>();
        batch = batch
            .into_iter()
            .enumerate()
            .filter_map(|(i, entry)| failed.remove(&i).then_some(entry))
            .collect();
    }
}

/// One batch call; the indices of the entries to send again (failed, not for a stale receipt
/// handle). Failures are logged when `last`.
async fn send_once(
    kind: BatchKind,
    client: &Client,
    url: &str,
    batch: &[Entry],
    stats: &SqsStats,
    attempt_timeout: Duration,
    last: bool,
) -> Vec<usize> {
    let counters = &stats.0;
    let timeouts = call_timeouts(attempt_timeout);
    let failed = batch_call(kind, client, url, batch, counters, timeouts).await;
    let call = BatchCall {
        kind,
        url,
        counters,
        last,
    };
    match failed {
        Ok(failed) => failed
            .iter()
            .filter_map(|entry| call.failed_entry(entry))
            .collect(),
        Err(error) => call.failed_call(batch.len(), &error),
    }
}

/// Sends one SQS batch request (`$request`: the client's fluent builder) with `$entries` to
/// `$url` under `$timeouts`: the entries that failed, or why the call did.
macro_rules! send_batch_request {
    ($request:expr, $url:expr, $entries:expr, $timeouts:expr) => {
        $request
            .queue_url($url)
            .set_entries(Some($entries))
            .customize()
            .config_override($timeouts)
            .send()
            .await
            .map(|output| output.failed)
            .map_err(|e| DisplayErrorContext(e).to_string())
    };
}

/// `DeleteMessageBatch` or `ChangeMessageVisibilityBatch` of `batch` (entry ids: their
/// indices), counted in `counters`: the entries that failed, or why the call did.
async fn batch_call(
    kind: BatchKind,
    client: &Client,
    url: &str,
    batch: &[Entry],
    counters: &Counters,
    timeouts: aws_sdk_sqs::config::Builder,
) -> Result<Vec<BatchResultErrorEntry>, String> {
    let (calls, entries) = match kind {
        BatchKind::Delete => (&counters.delete_calls, &counters.deleted),
        BatchKind::Visibility => (&counters.visibility_calls, &counters.visibility_changes),
    };
    calls.fetch_add(1, Ordering::Relaxed);
    entries.fetch_add(batch.len() as u64, Ordering::Relaxed);
    let ids = batch
        .iter()
        .enumerate()
        .map(|(i, entry)| (i.to_string(), entry));
    match kind {
        BatchKind::Delete => {
            let entries = ids.filter_map(|(id, entry)| {
                DeleteMessageBatchRequestEntry::builder()
                    .id(id)
                    .receipt_handle(&entry.receipt_handle)
                    .build()
                    .ok()
            });
            send_batch_request!(
                client.delete_message_batch(),
                url,
                entries.collect(),
                timeouts
            )
        }
        BatchKind::Visibility => {
            let entries = ids.filter_map(|(id, entry)| {
                ChangeMessageVisibilityBatchRequestEntry::builder()
                    .id(id)
                    .receipt_handle(&entry.receipt_handle)
                    .visibility_timeout(entry.visibility)
                    .build()
                    .ok()
            });
            let request = client.change_message_visibility_batch();
            send_batch_request!(request, url, entries.collect(), timeouts)
        }
    }
}

/// One batch call, for what its failures mean.
struct BatchCall<'a> {
    kind: BatchKind,
    url: &'a str,
    counters: &'a Counters,
    /// Whether it was the second (last) try: failures are logged, not sent again.
    last: bool,
}

impl BatchCall<'_> {
    fn operation(&self) -> &'static str {
        match self.kind {
            BatchKind::Delete => "delete",
            BatchKind::Visibility => "change visibility",
        }
    }

    /// The index of a failed `entry` to send again, if any; logged as what its failure means.
    fn failed_entry(&self, entry: &BatchResultErrorEntry) -> Option<usize> {
        let (queue, operation) = (self.url, self.operation());
        let stale = entry.code == "ReceiptHandleIsInvalid" || entry.code == "MessageNotInflight";
        if stale {
            self.counters
                .invalid_receipts
                .fetch_add(1, Ordering::Relaxed);
            if self.kind == BatchKind::Visibility {
                // A heartbeat that crossed the delete of its message, or a message received
                // again meanwhile: nothing to extend.
                tracing::debug!(
                    queue,
                    operation,
                    code = entry.code,
                    "SQS visibility change for a message no longer in flight under this receipt \
                     handle"
                );
            } else {
                // After a commit: the message was received again (its visibility timeout had
                // passed), and that delivery is a duplicate in the inbox.
                tracing::info!(
                    queue,
                    operation,
                    code = entry.code,
                    "SQS receipt handle no longer valid; the message's redelivery will be a \
                     duplicate"
                );
            }
        } else if !self.last
            && let Ok(i) = entry.id.parse::<usize>()
        {
            tracing::info!(
                queue,
                operation,
                code = entry.code,
                message = entry.message.as_deref().unwrap_or(""),
                "SQS batch entry failed; sending it once more"
            );
            return Some(i);
        } else {
            tracing::warn!(
                queue,
                operation,
                code = entry.code,
                message = entry.message.as_deref().unwrap_or(""),
                "SQS batch entry failed (sent twice)"
            );
        }
        None
    }

    /// The whole call failed (`error`): all `entries` indices to send again, or none (logged)
    /// when it was the last try.
    fn failed_call(&self, entries: usize, error: &str) -> Vec<usize> {
        let (queue, operation) = (self.url, self.operation());
        if self.last {
            tracing::warn!(
                queue,
                operation,
                entries,
                %error,
                "SQS batch call failed (sent twice); the messages will be received again"
            );
            return Vec::new();
        }
        tracing::info!(
            queue,
            operation,
            entries,
            %error,
            "SQS batch call failed; sending it once more"
        );
        (0..entries).collect()
    }
}

struct SqsSettler {
    shared: Arc<Shared>,
    id: u64,
    receipt_handle: String,
    received_at: Instant,
    /// The FIFO group and its epoch at the receive.
    group: Option<(String, u64)>,
    _permit: OwnedSemaphorePermit,
}

impl SqsSettler {
    /// Makes the message visible again after `delay`; later deliveries of its group are no
    /// longer current.
    fn release(&self, delay: Duration) -> Result<(), SourceError> {
        self.shared.untrack(self.id);
        if let Some((group, _)) = &self.group {
            self.shared.bump_group(group);
        }
        let linger = self.shared.config.settle_linger;
        let visibility = visibility_secs(delay, self.received_at, linger);
        if ceil_secs(delay) > u64::try_from(visibility).unwrap_or(0) {
            // SQS keeps a message invisible at most 12 hours from its receive.
            tracing::warn!(
                source = %self.shared.name,
                delay_s = delay.as_secs(),
                capped_s = visibility,
                "SQS requeue delay capped at what is left of the 12 hours from the receive"
            );
        }
        self.shared.send(
            BatchKind::Visibility,
            Entry {
                receipt_handle: self.receipt_handle.clone(),
                visibility,
            },
        )
    }
}

impl Settle for SqsSettler {
    fn settle(self: Box<Self>, settlement: Settlement) -> SettleFuture {
        let result = match settlement {
            Settlement::Ack => {
                self.shared.untrack(self.id);
                self.shared.send(
                    BatchKind::Delete,
                    Entry {
                        receipt_handle: self.receipt_handle.clone(),
                        visibility: 0,
                    },
                )
            }
            Settlement::Reject => {
                self.shared.untrack(self.id);
                match self.shared.config.reject {
                    RejectAction::Delete => self.shared.send(
                        BatchKind::Delete,
                        Entry {
                            receipt_handle: self.receipt_handle.clone(),
                            visibility: 0,
                        },
                    ),
                    RejectAction::LeaveToRedrive => Ok(()),
                }
            }
            Settlement::Requeue { delay } => self.release(delay.unwrap_or_default()),
        };
        Box::pin(async move { result })
    }

    fn abandon(self: Box<Self>) {
        let _ = self.release(Duration::ZERO);
    }

    fn is_current(&self) -> bool {
        match &self.group {
            Some((group, epoch)) => self.shared.group_epoch(group) == *epoch,
            None => true,
        }
    }
}

impl Source for SqsSource {
    fn name(&self) -> &str {
        &self.shared.name
    }

    /// See the module documentation's "Payload limit": a body over `limit` is cut as it is
    /// handed out, its memory given back.
    fn set_payload_limit(&mut self, limit: PayloadLimit) {
        self.limit = limit;
    }

    fn next(&mut self) -> BoxFuture<'_, Result<Option<Delivery>, SourceError>> {
        Box::pin(async move {
            match self.received.recv().await {
                Some(Ok(mut delivery)) => {
                    delivery.envelope.limit_to(self.limit);
                    Ok(Some(delivery))
                }
                Some(Err(error)) => Err(error),
                None => Ok(None),
            }
        })
    }

    fn close(&mut self) -> BoxFuture<'_, Result<(), SourceError>> {
        Box::pin(async move {
            self.stop.cancel();
            // Lets the current long poll finish (what it received is released below).
            if let Some(receiver) = self.receiver.take() {
                let _ = receiver.await;
            }
            if let Some(heartbeat) = self.heartbeat.take() {
                let _ = heartbeat.await;
            }
            // Received, never handed out: visible again at once.
            self.received.close();
            while let Some(received) = self.received.recv().await {
                drop(received);
            }
            let mut flushed = Vec::new();
            for sender in [&self.shared.deletes, &self.shared.visibility] {
                let (done, wait) = oneshot::channel();
                if sender.send(Command::Flush(done)).is_ok() {
                    flushed.push(wait);
                }
            }
            for wait in flushed {
                let _ = wait.await;
            }
            Ok(())
        })
    }
}

impl Drop for SqsSource {
    fn drop(&mut self) {
        // The receive and heartbeat tasks end; the batchers end when the last settler is gone
        // (their channels close). A source dropped without `close` may lose queued deletes: the
        // messages are then received again, as duplicates.
        self.stop.cancel();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn visibility_is_rounded_up_and_capped_at_twelve_hours_from_the_receive() {
        let now = Instant::now();
        let zero = Duration::ZERO;
        assert_eq!(visibility_secs(Duration::ZERO, now, zero), 0);
        assert_eq!(visibility_secs(Duration::from_millis(1), now, zero), 1);
        assert_eq!(visibility_secs(Duration::from_millis(2500), now, zero), 3);
        assert_eq!(visibility_secs(Duration::from_secs(30), now, zero), 30);
        // The age rounded up, the linger and 2 s kept as a margin.
        let capped = visibility_secs(
            Duration::from_secs(MAX_VISIBILITY_SECS * 2),
            now,
            Duration::from_millis(100),
        );
        assert!(
            (1..=4).contains(&(i32::try_from(MAX_VISIBILITY_SECS).unwrap() - capped - 2)),
            "{capped}"
        );
        // No overflow on huge delays.
        assert!(visibility_secs(Duration::MAX, now, Duration::MAX) >= 0);
        assert!(visibility_secs(Duration::MAX, now, zero) > 0);
        if let Some(received) = now.checked_sub(Duration::from_secs(MAX_VISIBILITY_SECS - 10)) {
            let left = visibility_secs(Duration::from_secs(60), received, zero);
            assert!((7..=8).contains(&left), "{left}");
        }
    }

    #[test]
    fn config_setters_keep_sqs_limits() {
        let config = SqsConfig::new("q")
            .wait_time(Duration::from_secs(60))
            .visibility_timeout(Duration::ZERO)
            .max_in_flight(0)
            .max_processing_time(Duration::from_secs(MAX_VISIBILITY_SECS * 3));
        assert_eq!(config.wait_time, Duration::from_secs(20));
        assert_eq!(config.visibility_timeout, Duration::from_secs(1));
        assert_eq!(config.max_in_flight, 1);
        assert_eq!(
            config.max_processing_time,
            Duration::from_secs(MAX_VISIBILITY_SECS)
        );
        assert_eq!(config.reject, RejectAction::Delete);
        assert_eq!(
            SqsConfig::new("q")
                .wait_time(Duration::from_millis(500))
                .wait_time,
            Duration::from_secs(1)
        );
        let mut direct = SqsConfig::new("q");
        direct.wait_time = Duration::ZERO;
        direct.max_in_flight = 0;
        let direct = direct.within_limits();
        assert_eq!(
            (direct.wait_time, direct.max_in_flight),
            (Duration::from_secs(1), 1)
        );
    }

    #[test]
    fn credentials_are_not_printed() {
        let settings = AwsSettings::default().credentials("AKIDEXAMPLE", "very-secret");
        let printed = format!("{settings:?}");
        assert!(printed.contains("AKIDEXAMPLE") && !printed.contains("very-secret"));
    }
}
