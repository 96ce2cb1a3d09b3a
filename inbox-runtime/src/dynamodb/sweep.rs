//! The sweep of parked messages whose gap stays open, and the park policy of a [`DynamoDispatcher`].

use std::collections::BTreeSet;

use aws_sdk_dynamodb::types::{AttributeValue, Delete, TransactWriteItem, Update};

use super::admin::{AdminError, DEAD_LETTER_ATTRIBUTE, DEAD_LETTER_INDEX};
use super::dispatch::DynamoDispatcher;
use super::handler::{DynDynamoHandler, DynamoRoutes, release_successors, run_payload};
use super::ordering::pointer_key;
use super::{Mode, Now, n, s};
use crate::dispatch::SweepReport;
use crate::types::classify::BoxError;
use crate::types::ordering::{Ordering, ParkPolicy, ParkTimeout};
use crate::types::outcome::Outcome;
use crate::types::status::Status;

impl DynamoDispatcher {
    /// Sets what happens to parked messages whose gap stays open (default: dead-lettered after
    /// 1 h), as the SQL [`Dispatcher::with_park_policy`](crate::Dispatcher::with_park_policy);
    /// applied by [`sweep_parked`](Self::sweep_parked).
    pub fn with_park_policy(mut self, policy: ParkPolicy) -> Self {
        self.park = policy;
        self
    }

    /// The park policy in force.
    pub fn park_policy(&self) -> ParkPolicy {
        self.park
    }

    /// Settles the parked messages of this dispatcher's consumers received at least the
    /// [`ParkPolicy::timeout`] ago (by this process's clock), at most 1000 per consumer per
    /// call, oldest first: dead-lettered (payload kept, the reason in `last_error`) or released
    /// (applied despite the gap, the aggregate's position jumping to it; its own parked
    /// successors follow in order), as [`Dispatcher::sweep_parked`](crate::Dispatcher::sweep_parked).
    /// A parked message of a consumer this dispatcher has no handler for is left alone. The
    /// messages are taken in each aggregate's sequence order, and each aggregate's successors
    /// whose gap is closed (a release stopped by a failure or a crash) are first applied in
    /// order, not swept. Calls: a `Query` of the dead-letter index per consumer (one per 1 MB
    /// page), a `GetItem` per message found, per aggregate a `GetItem` of its position and one
    /// of the pointer after it (and a release's calls per successor applied), then one
    /// `TransactWriteItems` to dead-letter a message, or a release's calls (see the
    /// [module's docs](super::ordering)). The index is eventually consistent: a message parked a
    /// moment ago may be swept by the next call.
    ///
    /// # Errors
    /// [`AdminError::Dynamo`] if a `Query`, `GetItem` or the dead letter's
    /// `TransactWriteItems` fails (the messages settled before it stay settled);
    /// [`AdminError::Malformed`] for an item that does not read as an inbox item. A release
    /// whose handler fails is recorded as any attempt is (`failed`, with its pointer kept) and
    /// is not an error here.
    pub async fn sweep_parked(&self) -> Result<SweepReport, AdminError> {
        let inbox = self.inbox();
        let admin = inbox.admin();
        let timeout = self.park.effective_timeout();
        let cutoff = Now::read()
            .ms
            .saturating_sub(i64::try_from(timeout.as_millis()).unwrap_or(i64::MAX));
        let consumers: BTreeSet<&'static str> =
            self.handlers().iter().map(|info| info.consumer).collect();
        let mut report = SweepReport::default();
        for consumer in consumers {
            // The expired parked messages, in each aggregate's sequence order (as the SQL
            // stores' sweep: a later one released first would make the earlier ones stale).
            let mut expired = Vec::new();
            for key in self.expired_parked(consumer, cutoff).await? {
                let Some(stored) = admin.show(consumer, &key).await? else {
                    continue;
                };
                let (Some(aggregate), Some(sequence)) =
                    (stored.aggregate_id.clone(), stored.sequence)
                else {
                    continue;
                };
                if stored.status != Status::Parked {
                    continue;
                }
                expired.push((aggregate, sequence, key, stored));
            }
            expired.sort_by(|a, b| (&a.0, a.1).cmp(&(&b.0, b.1)));
            // Per aggregate, the sequence its messages were applied up to, once read.
            let mut reached: Option<(&str, i64)> = None;
            for (aggregate, sequence, key, stored) in &expired {
                let applied_to = match reached {
                    Some((of, to)) if of == aggregate => to,
                    // First, what a release left behind (stopped by a failure or a crash after
                    // the commit that closed the gap): the successors of the aggregate's
                    // position, applied in order, neither dead-lettered nor released over a
                    // gap that is closed.
                    _ => {
                        let ordering = Ordering {
                            aggregate_id: aggregate.clone(),
                            sequence: 0,
                        };
                        release_successors(inbox, self, consumer, &ordering, true).await
                    }
                };
                reached = Some((aggregate, applied_to));
                // Applied meanwhile, most likely: read again. One still parked (another key
                // at a sequence applied) is settled by the policy (released: stale).
                if *sequence <= applied_to
                    && admin
                        .show(consumer, key)
                        .await?
                        .is_none_or(|now| now.status != Status::Parked)
                {
                    continue;
                }
                match self.park.on_timeout {
                    ParkTimeout::DeadLetter => {
                        let reason = format!(
                            "parked for more than {} s waiting for sequence {} of aggregate `{}`",
                            timeout.as_secs(),
                            sequence - 1,
                            aggregate
                        );
                        if self
                            .dead_letter_parked(consumer, key, aggregate, *sequence, &reason)
                            .await?
                        {
                            report.dead_lettered += 1;
                        }
                    }
                    ParkTimeout::Release => {
                        let (Some(handler), Some(payload)) = (
                            DynamoRoutes::route(self, consumer, &stored.message_name),
                            &stored.payload,
                        ) else {
                            continue;
                        };
                        let result =
                            run_payload(inbox, self, handler, key, payload, Mode::Release).await;
                        if let Ok(Ok(Outcome::Processed(()))) = result {
                            report.released += 1;
                            let ordering = Ordering {
                                aggregate_id: aggregate.clone(),
                                sequence: *sequence,
                            };
                            let to =
                                release_successors(inbox, self, consumer, &ordering, false).await;
                            reached = Some((aggregate, to));
                        }
                    }
                }
            }
        }
        Ok(report)
    }

    /// The keys of `consumer`'s parked items received at or before `cutoff` (epoch
    /// milliseconds), oldest first, at most 1000: `Query`s of the dead-letter index.
    async fn expired_parked(&self, consumer: &str, cutoff: i64) -> Result<Vec<String>, AdminError> {
        let inbox = self.inbox();
        let mut keys = Vec::new();
        let mut start = None;
        loop {
            inbox.count_call();
            let page = inbox
                .client
                .query()
                .table_name(&inbox.table)
                .index_name(DEAD_LETTER_INDEX)
                .key_condition_expression("#consumer = :consumer AND #received <= :cutoff")
                .filter_expression("#status = :parked")
                .expression_attribute_names("#consumer", DEAD_LETTER_ATTRIBUTE)
                .expression_attribute_names("#received", "received_at")
                .expression_attribute_names("#status", "status")
                .expression_attribute_values(":consumer", s(consumer))
                .expression_attribute_values(":cutoff", n(cutoff))
                .expression_attribute_values(":parked", s("parked"))
                .scan_index_forward(true)
                .set_exclusive_start_key(start.take())
                .send()
                .await
                .map_err(|e| AdminError::Dynamo {
                    table: inbox.table.clone(),
                    operation: "Query",
                    source: e.into(),
                })?;
            for item in page.items() {
                if let Some(AttributeValue::S(key)) = item.get("message_key") {
                    keys.push(key.clone());
                }
            }
            match page.last_evaluated_key.filter(|key| !key.is_empty()) {
                Some(key) if keys.len() < 1000 => start = Some(key),
                _ => break,
            }
        }
        keys.truncate(1000);
        Ok(keys)
    }

    /// Turns a parked item dead with `reason` (payload kept) and deletes its pointer, in one
    /// transaction on the condition that it is still parked. `false` if it is not.
    async fn dead_letter_parked(
        &self,
        consumer: &str,
        key: &str,
        aggregate: &str,
        sequence: i64,
        reason: &str,
    ) -> Result<bool, AdminError> {
        let inbox = self.inbox();
        let dynamo = |e: BoxError| AdminError::Dynamo {
            table: inbox.table.clone(),
            operation: "TransactWriteItems",
            source: e,
        };
        let update = Update::builder()
            .table_name(&inbox.table)
            .key("pk", s(format!("{}:{consumer}{key}", consumer.len())))
            .update_expression("SET #status = :dead, #error = :reason")
            .condition_expression("#status = :parked")
            .expression_attribute_names("#status", "status")
            .expression_attribute_names("#error", "last_error")
            .expression_attribute_values(":dead", s("dead"))
            .expression_attribute_values(":parked", s("parked"))
            .expression_attribute_values(
                ":reason",
                s(inbox.policy.bounded_error(reason.to_owned())),
            )
            .build()
            .map_err(|e| dynamo(e.into()))?;
        let delete = Delete::builder()
            .table_name(&inbox.table)
            .key("pk", s(pointer_key(consumer, aggregate, sequence)))
            .build()
            .map_err(|e| dynamo(e.into()))?;
        inbox.count_call();
        let sent = inbox
            .client
            .transact_write_items()
            .transact_items(TransactWriteItem::builder().update(update).build())
            .transact_items(TransactWriteItem::builder().delete(delete).build())
            .send()
            .await;
        match sent {
            Ok(_) => Ok(true),
            Err(e)
                if e.as_service_error()
                    .is_some_and(|e| e.is_transaction_canceled_exception()) =>
            {
                Ok(false)
            }
            Err(e) => Err(dynamo(e.into())),
        }
    }
}

impl DynamoRoutes for DynamoDispatcher {
    fn route(&self, consumer: &str, message_name: &str) -> Option<&'static dyn DynDynamoHandler> {
        DynamoDispatcher::route(self, consumer, message_name)
    }
}
