//! The deliveries gathered for batches, by partition: those without declared partitions
//! (**open**: a batch of them may lock anything), those whose partitions no running task holds
//! (**partitioned**, ready), and those waiting for a running task to release one of theirs
//! (**blocked**). Two tasks in flight never hold the same partition, and deliveries that share a
//! partition start in their order of arrival: a delivery also waits while an earlier delivery
//! of one of its partitions waits.

use std::collections::{HashMap, HashSet, VecDeque};

use crate::dispatch::dispatcher::Decoded;
use crate::source::Delivery;
use crate::types::error::DispatchError;

/// A delivery the worker has fetched and not started, with what it learnt of it on arrival.
pub(super) struct Pending {
    pub(super) delivery: Delivery,
    /// The envelope as [`Dispatcher::decode`](crate::Dispatcher) returned it on arrival (to
    /// read its partitions), handed to the dispatch so that it is not decoded again; `None`
    /// if it was not decoded yet.
    pub(super) decoded: Option<Result<Decoded, DispatchError>>,
    /// Its partitions; `None` if undeclared.
    partitions: Option<Vec<String>>,
    /// Its place in the order of arrival.
    seq: u64,
}

impl Pending {
    /// A delivery not decoded yet, with the partitions given (`None`: undeclared).
    pub(super) fn new(
        delivery: Delivery,
        decoded: Option<Result<Decoded, DispatchError>>,
        partitions: Option<Vec<String>>,
    ) -> Self {
        Self {
            delivery,
            decoded,
            partitions,
            seq: 0,
        }
    }
}

/// What a batch may lock, as far as the worker knows.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Kind {
    /// Some delivery of it has no declared partition: it may lock any row.
    Open,
    /// Every delivery of it declares its partitions: it locks only rows of those.
    Partitioned,
}

/// The gathered deliveries (see the module's documentation).
#[derive(Default)]
pub(super) struct Ready {
    open: VecDeque<Pending>,
    partitioned: VecDeque<Pending>,
    /// In order of arrival.
    blocked: VecDeque<Pending>,
    /// How many blocked deliveries have each partition (a later delivery of one of them waits
    /// behind them).
    blocked_partitions: HashMap<String, usize>,
    /// The partitions of the running tasks.
    held: HashSet<String>,
    /// The `seq` of the next delivery to arrive.
    next_seq: u64,
    /// An open batch is due but could not start yet: no partitioned batch may start before it
    /// (else a steady partitioned stream would keep it waiting forever).
    pub(super) open_due: bool,
}

impl Ready {
    /// Adds a delivery that just arrived.
    pub(super) fn push(&mut self, mut pending: Pending) {
        pending.seq = self.next_seq;
        self.next_seq += 1;
        if pending.partitions.is_none() {
            self.open.push_back(pending);
        } else if self.must_wait(&pending) {
            self.block(pending);
        } else {
            self.partitioned.push_back(pending);
        }
    }

    /// Whether `pending` (partitioned) must wait: a running task holds one of its partitions,
    /// or an earlier delivery of one of them waits.
    fn must_wait(&self, pending: &Pending) -> bool {
        pending
            .partitions
            .iter()
            .flatten()
            .any(|p| self.held.contains(p) || self.blocked_partitions.contains_key(p))
    }

    /// Queues `pending` among the blocked ones (after those that arrived before it).
    fn block(&mut self, pending: Pending) {
        for p in pending.partitions.iter().flatten() {
            *self.blocked_partitions.entry(p.clone()).or_default() += 1;
        }
        self.blocked.push_back(pending);
    }

    /// Sorts the partitioned deliveries again into ready and blocked, in order of arrival,
    /// after the held partitions changed.
    fn rescan(&mut self) {
        let mut all: Vec<Pending> = self.partitioned.drain(..).collect();
        all.extend(self.blocked.drain(..));
        all.sort_by_key(|p| p.seq);
        self.blocked_partitions.clear();
        for pending in all {
            if self.must_wait(&pending) {
                self.block(pending);
            } else {
                self.partitioned.push_back(pending);
            }
        }
    }

    /// The deliveries of `kind` ready to start.
    pub(super) fn len(&self, kind: Kind) -> usize {
        match kind {
            Kind::Open => self.open.len(),
            Kind::Partitioned => self.partitioned.len(),
        }
    }

    /// Whether some delivery is ready to start (blocked ones are not).
    pub(super) fn any_ready(&self) -> bool {
        !self.open.is_empty() || !self.partitioned.is_empty()
    }

    /// The kinds with deliveries ready, the one whose first delivery arrived first first.
    pub(super) fn by_age(&self) -> impl Iterator<Item = Kind> {
        let open = self.open.front().map(|p| (p.seq, Kind::Open));
        let partitioned = self.partitioned.front().map(|p| (p.seq, Kind::Partitioned));
        let mut kinds = [open, partitioned];
        kinds.sort_by_key(|k| k.map_or(u64::MAX, |(seq, _)| seq));
        kinds.into_iter().flatten().map(|(_, kind)| kind)
    }

    /// Takes the first `size` ready deliveries of `kind` for a task, with the partitions it
    /// holds from now on (none for an open batch). The ready deliveries that share one of those
    /// partitions now wait for the task to end.
    pub(super) fn take(&mut self, kind: Kind, size: usize) -> (Vec<Pending>, Vec<String>) {
        let queue = match kind {
            Kind::Open => &mut self.open,
            Kind::Partitioned => &mut self.partitioned,
        };
        let n = size.min(queue.len());
        let batch: Vec<Pending> = queue.drain(..n).collect();
        if kind == Kind::Open {
            self.open_due = false;
            return (batch, Vec::new());
        }
        let mut partitions: Vec<String> = Vec::new();
        for p in batch.iter().filter_map(|p| p.partitions.as_ref()).flatten() {
            if self.held.insert(p.clone()) {
                partitions.push(p.clone());
            }
        }
        if !partitions.is_empty() {
            self.rescan();
        }
        (batch, partitions)
    }

    /// A task that held `partitions` ended: the deliveries that waited for them are ready again
    /// (or wait for another partition of theirs, or behind an earlier delivery of one), in their
    /// order.
    pub(super) fn release(&mut self, partitions: &[String]) {
        for p in partitions {
            self.held.remove(p);
        }
        self.rescan();
    }

    /// Every delivery not started (ready, or waiting for a partition), in order of arrival;
    /// nothing is gathered afterwards.
    pub(super) fn take_all(&mut self) -> Vec<Delivery> {
        let mut all: Vec<Pending> = self.open.drain(..).collect();
        all.extend(self.partitioned.drain(..));
        all.extend(self.blocked.drain(..));
        self.blocked_partitions.clear();
        all.sort_by_key(|p| p.seq);
        self.open_due = false;
        all.into_iter().map(|p| p.delivery).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::source::memory::MemorySource;
    use crate::types::envelope::Envelope;

    /// Deliveries of a memory source, one per entry of `partitions`, in order.
    async fn pending(partitions: &[Option<&[&str]>]) -> Vec<Pending> {
        use crate::source::Source;
        let mut source = MemorySource::new("mem");
        let handle = source.handle();
        for _ in partitions {
            handle.push(Envelope::new("m", "{}"));
        }
        let mut out = Vec::new();
        for partitions in partitions {
            let delivery = source.next().await.unwrap().unwrap();
            let partitions = partitions.map(|ps| ps.iter().map(|p| (*p).to_owned()).collect());
            out.push(Pending::new(delivery, None, partitions));
        }
        out
    }

    fn seqs(batch: &[Pending]) -> Vec<u64> {
        batch.iter().map(|p| p.seq).collect()
    }

    #[tokio::test]
    async fn a_partition_is_held_by_one_task_and_keeps_its_order() {
        let mut ready = Ready::default();
        // 0:a 1:b 2:a 3:{b,c} 4:c 5:open 6:d
        let all = pending(&[
            Some(&["a"]),
            Some(&["b"]),
            Some(&["a"]),
            Some(&["b", "c"]),
            Some(&["c"]),
            None,
            Some(&["d"]),
        ])
        .await;
        for p in all {
            ready.push(p);
        }
        assert_eq!(
            (ready.len(Kind::Open), ready.len(Kind::Partitioned)),
            (1, 6)
        );
        let (first, held) = ready.take(Kind::Partitioned, 2);
        assert_eq!(
            (seqs(&first), held.clone()),
            (vec![0, 1], vec!["a".into(), "b".into()])
        );
        // 2 waits for a, 3 for b, and 4 behind 3 (c): only 6 is ready.
        assert_eq!(ready.len(Kind::Partitioned), 1);
        let (second, _) = ready.take(Kind::Partitioned, 10);
        assert_eq!(seqs(&second), [6]);
        // A later arrival of a held partition waits too.
        let mut later = pending(&[Some(&["a"])]).await;
        ready.push(later.remove(0));
        assert_eq!(ready.len(Kind::Partitioned), 0);
        ready.release(&["b".to_owned()]);
        // 3 is ready, and 4 behind it (c is not held): both, in order.
        let (third, held) = ready.take(Kind::Partitioned, 10);
        assert_eq!(
            (seqs(&third), held),
            (vec![3, 4], vec!["b".into(), "c".into()])
        );
        ready.release(&["a".to_owned()]);
        let (fourth, _) = ready.take(Kind::Partitioned, 10);
        assert_eq!(seqs(&fourth), [2, 7]);
        let (open, held) = ready.take(Kind::Open, 10);
        assert_eq!((seqs(&open), held.len()), (vec![5], 0));
        assert!(!ready.any_ready());
    }

    #[tokio::test]
    async fn take_all_returns_every_delivery_in_order() {
        let mut ready = Ready::default();
        for p in pending(&[Some(&["a"]), None, Some(&["a"]), Some(&["b"])]).await {
            ready.push(p);
        }
        let (batch, _) = ready.take(Kind::Partitioned, 1);
        assert_eq!(seqs(&batch), [0]);
        // The memory source's offsets are the push order.
        let rest: Vec<Option<i64>> = ready
            .take_all()
            .iter()
            .map(|d| d.envelope().source.as_ref().and_then(|s| s.offset))
            .collect();
        assert_eq!(rest, [Some(1), Some(2), Some(3)]);
        assert!(!ready.any_ready());
        assert!(ready.blocked_partitions.is_empty());
    }
}
