//! Ordering keys: deliveries with the same [ordering key](Delivery::ordering_key) run one at a
//! time, in the order the source handed them out. Shared by the SQL [`Worker`](super::Worker)
//! and the DynamoDB worker.

use std::collections::{HashMap, HashSet, VecDeque};

use crate::source::Delivery;

/// The ordering keys of deliveries running or waiting, and the deliveries waiting for an earlier
/// one of their key.
#[derive(Debug, Default)]
pub(crate) struct KeyQueues {
    /// Deliveries waiting for an earlier one of their ordering key.
    waiting: HashMap<String, VecDeque<Delivery>>,
    /// The ordering keys of deliveries running or waiting.
    busy: HashSet<String>,
}

impl KeyQueues {
    /// Admits `delivery`: `Some` to start it now (its key, if any, is busy from now until
    /// [`ended`](Self::ended)), `None` if it waits behind a running (or waiting) one of its key.
    pub(crate) fn admit(&mut self, delivery: Delivery) -> Option<Delivery> {
        let Some(key) = delivery.ordering_key() else {
            return Some(delivery);
        };
        if self.busy.contains(key) {
            self.waiting
                .entry(key.to_owned())
                .or_default()
                .push_back(delivery);
            return None;
        }
        self.busy.insert(key.to_owned());
        Some(delivery)
    }

    /// The running delivery of `key` ended: the next one of the key to start (if `start`; the key
    /// stays busy), or none; the key is free once none waits.
    pub(crate) fn ended(&mut self, key: &str, start: bool) -> Option<Delivery> {
        let queue = self.waiting.get_mut(key);
        match queue {
            Some(queue) if !queue.is_empty() => start.then(|| queue.pop_front()).flatten(),
            _ => {
                self.waiting.remove(key);
                self.busy.remove(key);
                None
            }
        }
    }

    /// Takes every waiting delivery (shutdown: they go back to the source unstarted); their keys
    /// stay busy until their running deliveries end.
    pub(crate) fn drain(&mut self) -> impl Iterator<Item = Delivery> + '_ {
        self.waiting.drain().flat_map(|(_, queue)| queue)
    }
}
