//! Refused deliveries kept in the inbox table, as the SQL stores keep them in
//! `inbox_rejections`: a delivery the [`DynamoDispatcher`] refuses (an unknown or missing
//! message name, a malformed payload, a bad key, a payload over the limit) is written as an
//! item of its own by [`DynamoDispatcher::record_rejection`], payload included, so that the
//! [`DynamoWorker`](super::DynamoWorker) acks it without losing it.
//!
//! ## The item
//!
//! | attribute | type | what |
//! |---|---|---|
//! | `pk` | S | `rejection#` and a random UUID (version 4, hyphenated): one item per refusal |
//! | [`REJECTION_ATTRIBUTE`] (`rejection`) | S | the reason: `conflict`, `malformed`, `unknown_message`, `invalid_key`, `too_large` (as [`RejectionReason::as_str`]) |
//! | `consumer`, `message_key` | S | when the refusal names them (a bad key names its consumer) |
//! | `message_name` | S | the delivery's message name, absent when empty |
//! | `detail` | S | the dispatcher's error, as text |
//! | `payload` | B | the payload as delivered, cut to the dispatcher's limit; absent when empty |
//! | `payload_size` | N | the payload's real size in bytes, only when it was cut |
//! | `received_at` | N | when it was kept: epoch milliseconds |
//! | `source`, `source_partition`, `source_offset`, `message_id` | S, S, N, S | where it came from, when the source said |
//! | `expires_at` | N | the end of the inbox's retention window, epoch seconds: DynamoDB's TTL deletes the item after it |
//!
//! The inbox's readers skip these items (their partition key does not start with a digit, as
//! every inbox item's does); [`DynamoAdmin::stats`](super::DynamoAdmin::stats) counts them as
//! `rejected:<reason>` rows. To read them, scan the table for the attribute, e.g.
//! `aws dynamodb scan --table-name TABLE --filter-expression "attribute_exists(rejection)"`.

use std::collections::HashMap;

use aws_sdk_dynamodb::types::AttributeValue;

use super::admin::AdminError;
use super::{
    Chain, Ctx, DynamoDispatcher, DynamoError, DynamoInbox, Now, REJECTION_ATTRIBUTE,
    REJECTION_PREFIX, n, s, size,
};
use crate::store::{Rejection, RejectionReason};
use crate::types::envelope::Envelope;
use crate::types::error::Conflict;
use crate::types::error::DispatchError;

impl DynamoInbox {
    /// Keeps `rejection` as an item of the inbox table (one `PutItem`; see the
    /// [module's docs](super::rejections) for its attributes), expiring with the retention
    /// window counted from now.
    ///
    /// # Errors
    /// [`AdminError::ItemTooLarge`] if the item, payload included, would pass DynamoDB's 400 KB
    /// item limit (nothing written: leave the delivery to the broker's dead-lettering);
    /// [`AdminError::Dynamo`] (operation `PutItem`) if the call failed (nothing written, or, if
    /// the answer was lost, the rejection kept once: then a redelivery keeps it a second time,
    /// which loses nothing).
    pub async fn record_rejection(&self, rejection: &Rejection<'_>) -> Result<(), AdminError> {
        let now = Now::read();
        let item = rejection_item(rejection, now, self.expires_at(now));
        let bytes = size::item_size(&item);
        if bytes > size::MAX_ITEM_BYTES {
            return Err(AdminError::ItemTooLarge {
                table: self.table().to_owned(),
                bytes,
                max: size::MAX_ITEM_BYTES,
            });
        }
        self.count_call();
        self.client
            .put_item()
            .table_name(self.table())
            .set_item(Some(item))
            .send()
            .await
            .map_err(|e| AdminError::Dynamo {
                table: self.table().to_owned(),
                operation: "PutItem",
                source: Chain(&e).to_string().into(),
            })?;
        metrics::counter!("inbox_rejections_total", "reason" => rejection.reason.as_str())
            .increment(1);
        Ok(())
    }
}

impl DynamoInbox {
    /// Keeps a conflicting delivery (same key, another payload) as a rejection, payload
    /// included, as the SQL stores keep theirs. One whose item would pass DynamoDB's item limit
    /// is not kept (a warning says so); the conflict is reported either way.
    ///
    /// # Errors
    /// [`DynamoError::Dynamo`] (operation `PutItem`) if DynamoDB failed: nothing was kept, and
    /// the caller reports that, not the conflict (which a source settles by dropping the
    /// delivery).
    pub(super) async fn keep_conflict<E>(
        &self,
        ctx: &Ctx<'_>,
        payload: &[u8],
        conflict: &Conflict,
    ) -> Result<(), DynamoError<E>> {
        let detail = conflict.to_string();
        let fingerprint = ctx.fingerprint.to_hex();
        let rejection = Rejection {
            consumer: Some(ctx.consumer),
            message_key: Some(ctx.key.as_str()),
            message_name: ctx.message_name,
            reason: RejectionReason::Conflict,
            detail: &detail,
            payload_hash: Some(&fingerprint),
            payload,
            payload_size: None,
            source: None,
        };
        match self.record_rejection(&rejection).await {
            Ok(()) => Ok(()),
            Err(AdminError::ItemTooLarge { bytes, max, .. }) => {
                tracing::warn!(
                    consumer = ctx.consumer,
                    key = ctx.key.as_str(),
                    bytes,
                    max,
                    "the conflicting delivery is not kept: its item would pass DynamoDB's item size limit"
                );
                Ok(())
            }
            Err(error) => Err(ctx.dynamo("PutItem", error.into())),
        }
    }
}

impl DynamoDispatcher {
    /// Keeps an envelope this dispatcher refused ([`DispatchError`]) in the inbox table, payload
    /// included (cut to [`max_payload_bytes`](Self::max_payload_bytes), with its real size),
    /// so that a source can ack it without losing it: [`DynamoInbox::record_rejection`].
    ///
    /// # Errors
    /// As [`DynamoInbox::record_rejection`]; on any error, do not ack the delivery.
    pub async fn record_rejection(
        &self,
        envelope: &Envelope,
        error: &DispatchError,
    ) -> Result<(), AdminError> {
        let detail = error.to_string();
        let rejection = Rejection::of_refused(envelope, error, &detail, self.max_payload_bytes());
        self.inbox().record_rejection(&rejection).await
    }
}

/// The item that keeps `rejection`, kept at `now` until `expires_at` (epoch seconds).
fn rejection_item(
    rejection: &Rejection<'_>,
    now: Now,
    expires_at: i64,
) -> HashMap<String, AttributeValue> {
    let mut item = HashMap::from([
        (
            "pk".to_owned(),
            s(format!("{REJECTION_PREFIX}{}", uuid::Uuid::new_v4())),
        ),
        (REJECTION_ATTRIBUTE.to_owned(), s(rejection.reason.as_str())),
        ("detail".to_owned(), s(rejection.detail)),
        ("received_at".to_owned(), n(now.ms)),
        (super::TTL_ATTRIBUTE.to_owned(), n(expires_at)),
    ]);
    let mut text = |name: &str, value: Option<&str>| {
        // DynamoDB keeps no empty key attributes; an empty text is left out here too.
        if let Some(value) = value.filter(|v| !v.is_empty()) {
            item.insert(name.to_owned(), s(value));
        }
    };
    text("consumer", rejection.consumer);
    text("message_key", rejection.message_key);
    text("message_name", Some(rejection.message_name));
    text("payload_hash", rejection.payload_hash);
    if let Some(source) = rejection.source {
        text("source", Some(&source.source));
        text("source_partition", source.partition.as_deref());
        text("message_id", source.message_id.as_deref());
        if let Some(offset) = source.offset {
            item.insert("source_offset".to_owned(), n(offset));
        }
    }
    if !rejection.payload.is_empty() {
        item.insert(
            "payload".to_owned(),
            AttributeValue::B(rejection.payload.to_vec().into()),
        );
    }
    if let Some(size) = rejection.payload_size {
        item.insert("payload_size".to_owned(), n(size));
    }
    item
}
