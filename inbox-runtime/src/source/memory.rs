//! An in-memory source, for tests and embedding: push envelopes, see how each was settled.
//!
//! ```
//! # #[tokio::main(flavor = "current_thread")] async fn main() {
//! use inbox_runtime::Envelope;
//! use inbox_runtime::source::{Settlement, Source};
//! use inbox_runtime::source::memory::MemorySource;
//!
//! let mut source = MemorySource::new("test");
//! let handle = source.handle();
//! let id = handle.push(Envelope::new("payments.captured", b"{}".to_vec()));
//! handle.close();
//!
//! let delivery = source.next().await.unwrap().unwrap();
//! delivery.ack().await.unwrap();
//! assert_eq!(handle.settlements(), [(id, Settlement::Ack)]);
//! assert!(source.next().await.unwrap().is_none()); // closed, drained, all settled
//! # }
//! ```

use std::collections::VecDeque;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use tokio::sync::Notify;

use crate::BoxFuture;
use crate::source::{Delivery, Settle, Settlement, Source, SourceError};
use crate::types::envelope::{Envelope, SourceMetadata};
use crate::types::limit::PayloadLimit;

/// One queued message.
#[derive(Debug, Clone)]
struct Queued {
    id: u64,
    envelope: Envelope,
    ordering_key: Option<String>,
    /// Deliveries so far.
    deliveries: u64,
}

#[derive(Debug, Default)]
struct State {
    queue: VecDeque<Queued>,
    next_id: u64,
    /// Delivered, not yet settled (including requeues waiting for their delay).
    outstanding: usize,
    closed: bool,
    settlements: Vec<(u64, Settlement)>,
    abandoned: Vec<u64>,
    deliveries: u64,
}

#[derive(Debug, Default)]
struct Shared {
    state: Mutex<State>,
    changed: Notify,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, State> {
        self.state
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    fn requeue(&self, queued: Queued) {
        let mut state = self.lock();
        state.outstanding -= 1;
        state.queue.push_back(queued);
        drop(state);
        self.changed.notify_waiters();
    }
}

/// An in-memory queue of envelopes behaving like a broker queue with manual acks: a requeued or
/// abandoned delivery comes again (marked redelivered, with its delivery count), a rejected or
/// acked one does not. Every settlement is recorded for inspection through a [`MemoryHandle`].
///
/// [`Source::next`] returns `Ok(None)` once the source is [closed](MemoryHandle::close), its queue
/// is empty and no delivery is outstanding.
#[derive(Debug)]
pub struct MemorySource {
    name: String,
    shared: Arc<Shared>,
    limit: PayloadLimit,
}

/// Pushes into a [`MemorySource`] and inspects it; cheap to clone, usable from any task.
#[derive(Debug, Clone)]
pub struct MemoryHandle {
    shared: Arc<Shared>,
}

impl MemorySource {
    /// An empty, open source named `name` (the `source` of the envelopes' [`SourceMetadata`]).
    pub fn new(name: impl Into<String>) -> Self {
        Self {
            name: name.into(),
            shared: Arc::default(),
            limit: PayloadLimit::DEFAULT,
        }
    }

    /// A handle to push envelopes and inspect settlements.
    pub fn handle(&self) -> MemoryHandle {
        MemoryHandle {
            shared: Arc::clone(&self.shared),
        }
    }
}

impl MemoryHandle {
    fn push_queued(&self, envelope: Envelope, ordering_key: Option<String>) -> u64 {
        let mut state = self.shared.lock();
        assert!(!state.closed, "push into a closed MemorySource");
        let id = state.next_id;
        state.next_id += 1;
        state.queue.push_back(Queued {
            id,
            envelope,
            ordering_key,
            deliveries: 0,
        });
        drop(state);
        self.shared.changed.notify_waiters();
        id
    }

    /// Queues `envelope`; returns its id (0, 1, 2, … in push order), which is also the
    /// [`SourceMetadata::offset`] of its deliveries.
    ///
    /// # Panics
    /// If the source is closed.
    pub fn push(&self, envelope: Envelope) -> u64 {
        self.push_queued(envelope, None)
    }

    /// Queues `envelope` with an ordering key (see [`Delivery::with_ordering_key`]).
    ///
    /// # Panics
    /// If the source is closed.
    pub fn push_keyed(&self, envelope: Envelope, ordering_key: impl Into<String>) -> u64 {
        self.push_queued(envelope, Some(ordering_key.into()))
    }

    /// No more pushes: the source ends once drained and every delivery is settled.
    pub fn close(&self) {
        self.shared.lock().closed = true;
        self.shared.changed.notify_waiters();
    }

    /// Every settlement so far, in the order they happened: (message id, settlement).
    pub fn settlements(&self) -> Vec<(u64, Settlement)> {
        self.shared.lock().settlements.clone()
    }

    /// The ids of the deliveries dropped unsettled so far (each was queued again).
    pub fn abandoned(&self) -> Vec<u64> {
        self.shared.lock().abandoned.clone()
    }

    /// Messages waiting to be delivered (including requeued ones whose delay has passed).
    pub fn queued(&self) -> usize {
        self.shared.lock().queue.len()
    }

    /// Deliveries handed out and not yet settled.
    pub fn outstanding(&self) -> usize {
        self.shared.lock().outstanding
    }

    /// Deliveries handed out so far, redeliveries included.
    pub fn deliveries(&self) -> u64 {
        self.shared.lock().deliveries
    }
}

struct MemorySettler {
    shared: Arc<Shared>,
    queued: Option<Queued>,
}

impl Settle for MemorySettler {
    fn settle(
        mut self: Box<Self>,
        settlement: Settlement,
    ) -> BoxFuture<'static, Result<(), SourceError>> {
        let queued = self.queued.take().expect("settled once");
        let shared = Arc::clone(&self.shared);
        Box::pin(async move {
            shared.lock().settlements.push((queued.id, settlement));
            match settlement {
                Settlement::Ack | Settlement::Reject => {
                    shared.lock().outstanding -= 1;
                    shared.changed.notify_waiters();
                }
                Settlement::Requeue { delay } => match delay {
                    Some(delay) if delay > Duration::ZERO => {
                        // Stays outstanding while the delay runs, so that the source does not end.
                        crate::store::spawn(async move {
                            tokio::time::sleep(delay).await;
                            shared.requeue(queued);
                        });
                    }
                    _ => shared.requeue(queued),
                },
            }
            Ok(())
        })
    }

    fn abandon(mut self: Box<Self>) {
        if let Some(queued) = self.queued.take() {
            self.shared.lock().abandoned.push(queued.id);
            self.shared.requeue(queued);
        }
    }
}

impl Source for MemorySource {
    fn name(&self) -> &str {
        &self.name
    }

    /// Envelopes are pushed whole (they are the caller's memory already); one over `limit` is
    /// cut to its first `limit` bytes when it is handed out, before any copy.
    fn set_payload_limit(&mut self, limit: PayloadLimit) {
        self.limit = limit;
    }

    fn next(&mut self) -> BoxFuture<'_, Result<Option<Delivery>, SourceError>> {
        Box::pin(async move {
            loop {
                // Register interest before looking, so that no wake-up is missed.
                let changed = self.shared.changed.notified();
                {
                    let mut state = self.shared.lock();
                    if let Some(mut queued) = state.queue.pop_front() {
                        queued.deliveries += 1;
                        state.outstanding += 1;
                        state.deliveries += 1;
                        drop(state);
                        // Cut in the queue too: a redelivery is the same cut copy.
                        queued.envelope.limit_to(self.limit);
                        let metadata = SourceMetadata::new(&self.name)
                            .offset(i64::try_from(queued.id).unwrap_or(i64::MAX))
                            .redelivered(queued.deliveries > 1)
                            .delivery_count(queued.deliveries);
                        let envelope = queued.envelope.clone().with_source(metadata);
                        let ordering_key = queued.ordering_key.clone();
                        let mut delivery = Delivery::new(
                            envelope,
                            MemorySettler {
                                shared: Arc::clone(&self.shared),
                                queued: Some(queued),
                            },
                        );
                        if let Some(key) = ordering_key {
                            delivery = delivery.with_ordering_key(key);
                        }
                        return Ok(Some(delivery));
                    }
                    if state.closed && state.outstanding == 0 {
                        return Ok(None);
                    }
                }
                changed.await;
            }
        })
    }
}
