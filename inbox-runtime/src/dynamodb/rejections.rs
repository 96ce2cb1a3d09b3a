//! Refused deliveries and conflicts kept in the inbox table, as the SQL stores keep them in
//! `inbox_rejections`: a delivery the [`DynamoDispatcher`] refuses (an unknown or missing
//! message name, a malformed payload, a bad key, a payload over the limit) is written as an
//! item of its own by [`DynamoDispatcher::record_rejection`], payload included, so that the
//! [`DynamoWorker`](super::DynamoWorker) acks it without losing it; the claim keeps a
//! conflict's payload (same key, another payload) the same way before it returns
//! [`DynamoError::Conflict`]. A payload that would take the item past DynamoDB's 400 KB limit
//! is kept cut to fit ([`Kept::Cut`], with its real size in `payload_size`).
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
//! | `payload_hash` | S | a conflict's payload fingerprint (hex SHA-256) |
//! | `payload` | B | the payload as delivered, cut to the dispatcher's limit and to fit the item; absent when empty |
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

/// How [`DynamoInbox::record_rejection`] kept a rejection.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Kept {
    /// With its payload as given.
    Whole,
    /// With the first `bytes` bytes of its payload only (attribute `payload_size`: the real
    /// size): the whole would pass DynamoDB's 400 KB item limit.
    Cut {
        /// The payload bytes kept.
        bytes: usize,
    },
}

impl Kept {
    /// Whether the delivery refused with `error` may now be acked (deleted) without losing
    /// anything: kept whole, or cut where its payload was over the dispatcher's limit anyway
    /// ([`DispatchError::TooLarge`]: cut before it was kept, as the SQL stores keep it). A
    /// delivery kept cut otherwise lost bytes: leave it to the broker's dead-lettering too.
    pub fn loses_nothing(self, error: &DispatchError) -> bool {
        self == Kept::Whole || matches!(error, DispatchError::TooLarge { .. })
    }
}

/// What an item keeps below DynamoDB's item limit for what [`size::item_size`] cannot count
/// exactly (numbers are estimated): bytes.
const ITEM_MARGIN: usize = 1024;

impl DynamoInbox {
    /// Keeps `rejection` as an item of the inbox table (one `PutItem`; see the
    /// [module's docs](super::rejections) for its attributes), expiring with the retention
    /// window counted from now. A payload that would take the item past DynamoDB's 400 KB item
    /// limit is kept cut to fit (its first bytes, with its real size: [`Kept::Cut`]), to three
    /// quarters of the room the item's other attributes leave (about 300 KB), so that stores
    /// that count a binary by its base64 text (DynamoDB Local, moto) take it too.
    ///
    /// # Errors
    /// [`AdminError::ItemTooLarge`] if the item would pass the limit without any payload (a
    /// detail or names of hundreds of KB), or DynamoDB refused it for its size
    /// (`ValidationException`); nothing written. [`AdminError::Dynamo`] (operation
    /// `PutItem`) if the call failed (nothing written, or, if the answer was lost, the
    /// rejection kept once: then a redelivery keeps it a second time, which loses nothing).
    pub async fn record_rejection(&self, rejection: &Rejection<'_>) -> Result<Kept, AdminError> {
        let now = Now::read();
        let mut item = rejection_item(rejection, now, self.expires_at(now));
        let limit = size::MAX_ITEM_BYTES - ITEM_MARGIN;
        let mut kept = Kept::Whole;
        let bytes = size::item_size(&item);
        if bytes > limit {
            let payload = item.remove("payload");
            item.remove("payload_size");
            // The real size stays as it was given when the payload was cut already.
            let size = rejection
                .payload_size
                .unwrap_or_else(|| i64::try_from(rejection.payload.len()).unwrap_or(i64::MAX));
            item.insert("payload_size".to_owned(), n(size));
            let base = size::item_size(&item) + "payload".len();
            // Three quarters of the room: DynamoDB counts a binary by its bytes, but DynamoDB
            // Local and moto by its base64 text (4 characters per 3 bytes).
            let room = limit.checked_sub(base).map(|room| room / 4 * 3);
            let Some(room) = room.filter(|_| payload.is_some()) else {
                return Err(AdminError::ItemTooLarge {
                    table: self.table().to_owned(),
                    bytes,
                    max: size::MAX_ITEM_BYTES,
                });
            };
            let cut = &rejection.payload[..room.min(rejection.payload.len())];
            if !cut.is_empty() {
                item.insert("payload".to_owned(), AttributeValue::B(cut.to_vec().into()));
            }
            kept = Kept::Cut { bytes: cut.len() };
        }
        self.count_call();
        self.client
            .put_item()
            .table_name(self.table())
            .set_item(Some(item))
            .send()
            .await
            .map_err(|e| {
                // Refused for its size (by a store that counts otherwise): never storable.
                let service = e.as_service_error();
                if service.and_then(|s| s.meta().code()) == Some("ValidationException")
                    && service
                        .and_then(|s| s.meta().message())
                        .is_some_and(|m| m.contains("size"))
                {
                    AdminError::ItemTooLarge {
                        table: self.table().to_owned(),
                        bytes,
                        max: size::MAX_ITEM_BYTES,
                    }
                } else {
                    AdminError::Dynamo {
                        table: self.table().to_owned(),
                        operation: "PutItem",
                        source: Chain(&e).to_string().into(),
                    }
                }
            })?;
        Ok(kept)
    }
}

impl DynamoInbox {
    /// Keeps a conflicting delivery (same key, another payload) as a rejection, payload
    /// included (cut to fit DynamoDB's item limit if it must be: a warning says so), as the
    /// SQL stores keep theirs.
    ///
    /// # Errors
    /// [`DynamoError::Dynamo`] (operation `PutItem`) if DynamoDB failed, or the item would pass
    /// its limit without any payload: nothing was kept, and
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
            Ok(Kept::Whole) => Ok(()),
            Ok(Kept::Cut { bytes }) => {
                tracing::warn!(
                    consumer = ctx.consumer,
                    key = ctx.key.as_str(),
                    kept = bytes,
                    size = payload.len(),
                    "the conflicting delivery is kept cut to DynamoDB's item size limit"
                );
                Ok(())
            }
            Err(error) => Err(ctx.dynamo("PutItem", error.into())),
        }
    }
}

impl DynamoDispatcher {
    /// Keeps an envelope this dispatcher refused ([`DispatchError`]) in the inbox table, payload
    /// included (cut to [`max_payload_bytes`](Self::max_payload_bytes), with its real size, and
    /// to DynamoDB's item limit: [`Kept::Cut`]), so that a source can settle it without losing
    /// it: [`DynamoInbox::record_rejection`]. Ack it if [`Kept::loses_nothing`] says so, else
    /// leave it to the broker's dead-lettering too.
    ///
    /// # Errors
    /// As [`DynamoInbox::record_rejection`]; on any error, do not ack the delivery.
    pub async fn record_rejection(
        &self,
        envelope: &Envelope,
        error: &DispatchError,
    ) -> Result<Kept, AdminError> {
        let detail = error.to_string();
        let rejection = Rejection::of_refused(envelope, error, &detail, self.max_payload_bytes());
        let kept = self.inbox().record_rejection(&rejection).await?;
        // As on the SQL stores: refusals, not conflicts (`inbox_dynamodb_deliveries_total`
        // counts those, outcome `conflict`).
        metrics::counter!("inbox_rejections_total", "reason" => rejection.reason.as_str())
            .increment(1);
        Ok(kept)
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_a_cut_of_a_payload_within_the_limit_loses_bytes() {
        let malformed = DispatchError::NoMessageName;
        let too_large = DispatchError::TooLarge {
            message_name: "m".to_owned(),
            size: 2_000_000,
            limit: 1_048_576,
        };
        assert!(Kept::Whole.loses_nothing(&malformed));
        assert!(Kept::Whole.loses_nothing(&too_large));
        assert!(Kept::Cut { bytes: 300_000 }.loses_nothing(&too_large));
        assert!(!Kept::Cut { bytes: 300_000 }.loses_nothing(&malformed));
    }
}
