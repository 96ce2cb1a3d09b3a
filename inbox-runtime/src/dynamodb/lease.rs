//! The key's item for the HTTP `Idempotency-Key` layer on DynamoDB
//! ([`crate::http::DynamoIdempotencyLayer`]): an in-progress lease taken before the handler
//! runs, and the stored response committed with the handler's actions on the condition that the
//! lease is still this request's.
//!
//! The lease item is the inbox item of the key (the same table and `pk`) with status
//! `in_progress`, the request's fingerprint, `lease_owner` (a random token, 32 hex digits) and
//! `lease_until` (epoch milliseconds). The commit replaces it with the `processed` item (the
//! response in `result`, binary), so a request that lost its lease (it ran past `lease_until`
//! and another request took the key over) commits nothing.

use std::collections::HashMap;
use std::convert::Infallible;
use std::time::Duration;

use aws_sdk_dynamodb::primitives::Blob;
use aws_sdk_dynamodb::types::{
    AttributeValue, Put, ReturnValuesOnConditionCheckFailure, TransactWriteItem,
};

use super::{
    Claim, ConditionFailed, Ctx, DynamoError, DynamoInbox, DynamoTx, Layout,
    MAX_PARTITION_KEY_BYTES, Now, Submitted, TTL_ATTRIBUTE, check_sizes, duration_ms, n, number_of,
    partition_key, s, size, text_of,
};
use crate::types::fingerprint::Fingerprint;
use crate::types::key::IdempotencyKey;

/// The status of a key whose request is running (its lease).
const IN_PROGRESS: &str = super::LEASED_STATUS;

/// The errors of these calls: the store's own (no handler error type).
pub(crate) type LeaseError = DynamoError<Infallible>;

/// One request's identity: what its key item says of it.
#[derive(Clone, Copy)]
pub(crate) struct KeyRequest<'a> {
    /// The scope (`http <METHOD> <route> [principal]`): the inbox consumer.
    pub(crate) scope: &'a str,
    /// The method and target, `POST /orders?draft=1`: the item's `message_name`.
    pub(crate) name: &'a str,
    pub(crate) key: &'a IdempotencyKey,
    pub(crate) fingerprint: Fingerprint,
}

/// A lease this request holds on its key.
#[derive(Debug, Clone)]
pub(crate) struct Lease {
    pk: String,
    owner: String,
    received_at: i64,
}

/// The key's item as another request left it.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum KeyState {
    /// Processed with this fingerprint: the stored response (the `result` attribute's bytes).
    Stored(Vec<u8>),
    /// Processed, or leased, with another fingerprint.
    Mismatch,
    /// Leased by a running request with this fingerprint, for this long yet.
    InFlight(Duration),
    /// Settled without a stored response (a claim session's `failed`, `dead` or `discarded`
    /// item under the same scope), or an item this layer cannot read: why.
    Unreadable(String),
}

/// What taking the lease found.
#[derive(Debug)]
pub(crate) enum Leased {
    /// The lease is this request's: run the handler.
    Acquired(Lease),
    /// Another request's item holds the key.
    Held(KeyState),
}

/// What the commit found.
#[derive(Debug)]
pub(crate) enum Committed {
    /// The handler's actions, the key and its response are written.
    Done,
    /// The lease was no longer this request's (it expired and another request took the key):
    /// nothing written; the key's item as it is now.
    LeaseLost(KeyState),
    /// A condition of the handler's actions failed: nothing written (the lease is still held).
    Condition(ConditionFailed),
    /// The key's item with the response would be `bytes` bytes, above DynamoDB's item limit
    /// (`max`, 409,600): nothing sent.
    ResponseTooLarge { bytes: usize, max: usize },
}

impl KeyRequest<'_> {
    fn ctx<'a>(&'a self, pk: &'a str) -> Ctx<'a> {
        Ctx {
            consumer: self.scope,
            message_name: self.name,
            key: self.key,
            fingerprint: self.fingerprint,
            pk,
            guard: None,
        }
    }

    #[allow(clippy::result_large_err)] // `DynamoError`, as `DynamoInbox::decide`'s.
    fn pk(&self) -> Result<String, LeaseError> {
        let pk = partition_key(self.scope, self.key);
        if pk.len() > MAX_PARTITION_KEY_BYTES {
            return Err(DynamoError::PartitionKeyTooLong {
                consumer: self.scope.to_owned(),
                key: self.key.clone(),
                bytes: pk.len(),
                max: MAX_PARTITION_KEY_BYTES,
            });
        }
        Ok(pk)
    }
}

impl DynamoInbox {
    /// Takes the lease of the request's key for `lease` (one conditional `PutItem`): on a new
    /// key, an expired item, or an in-progress item whose lease has ended. Else the item that
    /// holds the key, as the failed condition returned it (or, where the service does not
    /// return it, a consistent `GetItem`).
    pub(crate) async fn lease(
        &self,
        request: &KeyRequest<'_>,
        lease: Duration,
    ) -> Result<Leased, LeaseError> {
        let pk = request.pk()?;
        let ctx = request.ctx(&pk);
        let now = Now::read();
        let owner = uuid::Uuid::new_v4().simple().to_string();
        let until = now.ms.saturating_add(duration_ms(lease));
        let attributes = HashMap::from([
            ("status".to_owned(), s(IN_PROGRESS)),
            ("lease_owner".to_owned(), s(&owner)),
            ("lease_until".to_owned(), n(until)),
            // An abandoned lease leaves with the retention window, as a processed key does, but
            // never before it ends: an expired item is free to the next request's condition.
            (
                TTL_ATTRIBUTE.to_owned(),
                n(self
                    .expires_at(now)
                    .max(until.div_euclid(1000).saturating_add(1))),
            ),
        ]);
        let put = self.inbox_put(&ctx, Claim::New, now, attributes)?;
        self.count_call();
        let sent = self
            .client
            .put_item()
            .table_name(&self.table)
            .set_item(Some(put.item().clone()))
            .condition_expression(
                "attribute_not_exists(pk) OR #expires <= :now \
                 OR (#status = :leased AND lease_until <= :now_ms)",
            )
            .expression_attribute_names("#expires", TTL_ATTRIBUTE)
            .expression_attribute_names("#status", "status")
            .expression_attribute_values(":now", n(now.secs()))
            .expression_attribute_values(":leased", s(IN_PROGRESS))
            .expression_attribute_values(":now_ms", n(now.ms))
            .return_values_on_condition_check_failure(ReturnValuesOnConditionCheckFailure::AllOld)
            .send()
            .await;
        match sent {
            Ok(_) => Ok(Leased::Acquired(Lease {
                pk,
                owner,
                received_at: now.ms,
            })),
            Err(error) => match error.as_service_error() {
                Some(e) if e.is_conditional_check_failed_exception() => {
                    let returned = match e {
                        aws_sdk_dynamodb::operation::put_item::PutItemError::ConditionalCheckFailedException(c) => c.item().cloned(),
                        _ => None,
                    };
                    let item = match returned {
                        Some(item) => Some(item),
                        None => self.read(&ctx).await?,
                    };
                    Ok(Leased::Held(key_state(request, item.as_ref(), Now::read())))
                }
                _ => Err(ctx.dynamo("PutItem", error.into())),
            },
        }
    }

    /// A fresh transaction for the handler of a leased request (attempt 1).
    pub(crate) fn leased_tx(request: &KeyRequest<'_>) -> DynamoTx {
        DynamoTx {
            consumer: request.scope.to_owned(),
            key: request.key.clone(),
            attempt: 1,
            items: Vec::new(),
            outbox: super::outbox::Published::default(),
        }
    }

    /// Commits the handler's actions of `tx` with the key's `processed` item holding `result`
    /// (the stored response) in one `TransactWriteItems`, on the condition that `lease` is
    /// still this request's. Sizes are checked before the call: the key's item above 400 KB is
    /// [`DynamoError::TooLarge`] naming "the claim's inbox item".
    pub(crate) async fn commit_leased(
        &self,
        request: &KeyRequest<'_>,
        lease: &Lease,
        tx: DynamoTx,
        result: &[u8],
    ) -> Result<Committed, LeaseError> {
        let ctx = request.ctx(&lease.pk);
        if tx.items.len() > super::MAX_HANDLER_ITEMS {
            return Err(DynamoError::TooManyItems {
                items: tx.items.len(),
                max: super::MAX_HANDLER_ITEMS,
            });
        }
        let now = Now::read();
        let attributes = HashMap::from([
            ("status".to_owned(), s("processed")),
            ("processed_at".to_owned(), n(now.ms)),
            (TTL_ATTRIBUTE.to_owned(), n(self.expires_at(now))),
            ("result".to_owned(), AttributeValue::B(Blob::new(result))),
        ]);
        let mut item = self
            .inbox_put(&ctx, Claim::New, now, attributes)?
            .item()
            .clone();
        item.insert("received_at".to_owned(), n(lease.received_at));
        let bytes = size::item_size(&item);
        if bytes > size::MAX_ITEM_BYTES {
            return Ok(Committed::ResponseTooLarge {
                bytes,
                max: size::MAX_ITEM_BYTES,
            });
        }
        let put = Put::builder()
            .table_name(&self.table)
            .set_item(Some(item))
            .condition_expression("#status = :leased AND lease_owner = :owner")
            .expression_attribute_names("#status", "status")
            .expression_attribute_values(":leased", s(IN_PROGRESS))
            .expression_attribute_values(":owner", s(&lease.owner))
            .return_values_on_condition_check_failure(ReturnValuesOnConditionCheckFailure::AllOld)
            .build()
            .map_err(|e| ctx.dynamo("TransactWriteItems", e.into()))?;
        let mut items = Vec::with_capacity(tx.items.len() + 1);
        items.push(TransactWriteItem::builder().put(put).build());
        items.extend(tx.items);
        check_sizes(&items, 0)?;
        // One token per lease and resend: the SDK's retries of a send whose answer was lost are
        // not applied twice, and another request's commit never shares a token with this one.
        let token = |resend: usize| {
            let mut token = lease.owner.clone();
            if resend > 0 {
                token.push_str(&format!("-{resend}"));
            }
            token
        };
        match self
            .transact(&ctx, &items, Layout::default(), token, &mut 0)
            .await?
        {
            Submitted::Committed => Ok(Committed::Done),
            Submitted::ConditionFailed(failed) => Ok(Committed::Condition(failed)),
            // No sequence guard in a request's transaction.
            Submitted::ClaimFailed(current) | Submitted::GuardFailed(current) => {
                let item = match current {
                    Some(item) => Some(item),
                    None => self.read(&ctx).await?,
                };
                Ok(Committed::LeaseLost(key_state(
                    request,
                    item.as_ref(),
                    Now::read(),
                )))
            }
        }
    }

    /// Gives the lease up (a conditional `DeleteItem`, only while it is still this request's):
    /// the key is free again at once. A failure is logged, not returned: the lease then ends at
    /// its `lease_until`.
    pub(crate) async fn release(&self, request: &KeyRequest<'_>, lease: &Lease) {
        let delete = self
            .by_key()
            .delete_item(&lease.pk)
            .condition_expression("#status = :leased AND lease_owner = :owner")
            .expression_attribute_names("#status", "status")
            .expression_attribute_values(":leased", s(IN_PROGRESS))
            .expression_attribute_values(":owner", s(&lease.owner));
        if let Err(error) = self.delete_unless_changed(delete).await {
            tracing::warn!(
                scope = request.scope,
                key = request.key.as_str(),
                error = %super::Chain(&error),
                "the idempotency lease could not be released; it ends at its lease_until"
            );
        }
    }
}

/// A lease a running request holds and has not settled yet (committed, released, or found lost):
/// dropped unsettled — the request's future dropped mid-handler, the client gone (hyper drops
/// it) — it is released in a task of its own, so the key is free again at once (as the SQL
/// layer's dropped transaction rolls back) instead of held until `lease_until`. Outside a
/// tokio runtime it is left to end there.
pub(crate) struct Unsettled<'a> {
    inbox: &'a DynamoInbox,
    request: KeyRequest<'a>,
    lease: Lease,
    armed: bool,
}

impl<'a> Unsettled<'a> {
    pub(crate) fn new(inbox: &'a DynamoInbox, request: KeyRequest<'a>, lease: Lease) -> Self {
        Self {
            inbox,
            request,
            lease,
            armed: true,
        }
    }

    pub(crate) fn lease(&self) -> &Lease {
        &self.lease
    }

    /// Nothing to release: committed, or no longer this request's.
    pub(crate) fn settle(mut self) {
        self.armed = false;
    }

    /// Releases the lease now ([`DynamoInbox::release`]).
    pub(crate) async fn release(mut self) {
        self.armed = false;
        self.inbox.release(&self.request, &self.lease).await;
    }
}

impl Drop for Unsettled<'_> {
    fn drop(&mut self) {
        if !self.armed {
            return;
        }
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return;
        };
        let inbox = self.inbox.clone();
        let (scope, name) = (self.request.scope.to_owned(), self.request.name.to_owned());
        let (key, fingerprint) = (self.request.key.clone(), self.request.fingerprint);
        let lease = self.lease.clone();
        runtime.spawn(async move {
            let request = KeyRequest {
                scope: &scope,
                name: &name,
                key: &key,
                fingerprint,
            };
            inbox.release(&request, &lease).await;
        });
    }
}

/// What the key's `item` (read at `now`) answers to `request`, whose lease it refused.
fn key_state(
    request: &KeyRequest<'_>,
    item: Option<&HashMap<String, AttributeValue>>,
    now: Now,
) -> KeyState {
    let text = |name: &str| item.and_then(|item| text_of(item, name));
    let number = |name: &str| item.and_then(|item| number_of(item, name));
    let Some(item) = item else {
        // Deleted between the refused lease and the read (a lease released, TTL): free now.
        return KeyState::InFlight(Duration::ZERO);
    };
    if number(TTL_ATTRIBUTE).is_some_and(|expires| expires <= now.secs()) {
        return KeyState::InFlight(Duration::ZERO);
    }
    match text("payload_hash").and_then(Fingerprint::from_hex) {
        Some(stored) if stored != request.fingerprint => return KeyState::Mismatch,
        Some(_) => {}
        None => return KeyState::Unreadable("`payload_hash` is missing or malformed".to_owned()),
    }
    match text("status") {
        Some("processed") => match item.get("result") {
            Some(AttributeValue::B(result)) => KeyState::Stored(result.as_ref().to_vec()),
            _ => KeyState::Unreadable("the key is processed without a stored response".to_owned()),
        },
        Some(IN_PROGRESS) => {
            let left = number("lease_until").map_or(0, |until| until.saturating_sub(now.ms));
            KeyState::InFlight(Duration::from_millis(u64::try_from(left).unwrap_or(0)))
        }
        Some(other) => KeyState::Unreadable(format!(
            "the key is settled as `{other}` without a stored response"
        )),
        None => KeyState::Unreadable("`status` is missing".to_owned()),
    }
}
