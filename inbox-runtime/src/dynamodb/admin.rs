//! The operator's side of the DynamoDB inbox: statistics, failed and dead messages (list, show,
//! discard), with the same names, shapes and meaning as the SQL stores' [`crate::ops::admin`]
//! (rows are [`StatsRow`] and [`StoredMessage`], times in the text form
//! `2026-05-21T10:04:31.123Z`), and the store URL `dynamodb://TABLE` of the command line.
//!
//! ## The dead-letter index, and what each operation costs
//!
//! Failed and dead items carry one more attribute, [`DEAD_LETTER_ATTRIBUTE`] (their consumer);
//! processed and discarded items do not. A global secondary index on it,
//! [`DEAD_LETTER_INDEX`] (partition key `dead_letter_consumer`, sort key `received_at`,
//! projecting every attribute but the payload), is therefore *sparse*: it holds the failed and
//! dead items alone, per consumer, oldest first. [`DynamoInbox::ensure_table`] creates it with
//! the table, and adds it to a table that lacks it (`UpdateTable`, then waits until it is
//! `ACTIVE`). Items recorded failed or dead before the index existed lack the attribute and
//! are not listed through it (the table is new with this release: none in the wild).
//!
//! | operation | DynamoDB calls | read units |
//! |---|---|---|
//! | [`DynamoAdmin::list`] of failed/dead, one consumer | `Query` on the index, in pages of `limit + 1` items: 1 (more if items share the last one's millisecond, or with one status asked for: the filter applies after the read) | ½ per 4 KB of the items read, as projected (eventually consistent) |
//! | [`DynamoAdmin::list`] of failed/dead, all consumers | `Scan` of the index: 1 per 1 MB page | ½ per 4 KB of *every* failed and dead item's projection, not of the table |
//! | [`DynamoAdmin::list`] with `processed`/`discarded` | `Scan` of the table with a filter: 1 per 1 MB page | ½ per 4 KB of the **whole table** |
//! | [`DynamoAdmin::stats`] | `Scan` of the table: 1 per 1 MB page | ½ per 4 KB of the **whole table** |
//! | [`DynamoAdmin::show`] | 1 `GetItem` (strongly consistent) | 1 per 4 KB of the item |
//! | [`DynamoAdmin::discard`] | 1 `UpdateItem` (conditional) | 1 write unit per 1 KB of the item |
//!
//! The alternative to the index, a `Scan` of the table filtered on the status, reads the whole
//! table (every processed key of the retention window) to find a handful of dead letters; the
//! index costs one write of the projected item per failure recorded (and one to remove it when
//! the key is processed or discarded), which is rare next to the processed keys. `stats`
//! counts processed keys too, so it has to read them: it scans (run it as an operator does,
//! not in a loop). [`DynamoAdmin::calls`] counts the calls an admin made; tests/dynamodb_admin.rs
//! measures them.
//!
//! The index is eventually consistent (DynamoDB updates a global secondary index
//! asynchronously, typically within a second): a failure recorded just now may be listed a
//! moment later. `show` and `discard` read and write the item itself.
//!
//! ## Differences from the SQL admin
//!
//! * A processed or discarded item whose retention window has passed (`expires_at`) is absent
//!   to the inbox (DynamoDB's TTL deletes it lazily): `stats`, `list` and `show` skip it, as the
//!   SQL stores' retention purge would have deleted it.
//! * Rejected deliveries (conflicts, malformed payloads, …) are items of the inbox table
//!   ([`super::rejections`]): `stats` counts them as `rejected:…` rows (so the command line's
//!   `CONFLICTS SEEN` counts conflicts); there is no listing of them yet (scan the table for
//!   the `rejection` attribute).
//! * Parked items are in the dead-letter index too (the sweep finds them there,
//!   [`super::DynamoDispatcher::sweep_parked`]; the index does not project their
//!   `aggregate_id` and `sequence`); `list` of `parked` or `stale` scans the table.
//!   The aggregates' positions and parked messages' pointers ([`super::ordering`]) are not
//!   inbox items: `stats` and `list` skip them.
//! * Replaying a failed or dead message runs its registered handler:
//!   [`DynamoDispatcher::replay`](super::DynamoDispatcher::replay) (by consumer and key), or
//!   [`DynamoInbox::replay_stored`] with a handler of your own on what [`DynamoAdmin::show`]
//!   reads. The command line's `dead replay` runs the first
//!   ([`crate::ops::cli::dynamodb`]).

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, UNIX_EPOCH};

use aws_sdk_dynamodb::operation::query::builders::QueryFluentBuilder;
use aws_sdk_dynamodb::operation::scan::builders::ScanFluentBuilder;
use aws_sdk_dynamodb::types::{
    AttributeDefinition, AttributeValue, GlobalSecondaryIndex, GlobalSecondaryIndexUpdate,
    IndexStatus, KeySchemaElement, KeyType, Projection, ProjectionType, ScalarAttributeType,
    TableDescription,
};

use super::{
    Chain, DynamoInbox, MAX_PARTITION_KEY_BYTES, Now, TTL_ATTRIBUTE, TableError, attribute,
    key_element, n, s,
};
use crate::store::{RejectionReason, StatsRow, StatsStatus, StoredMessage};
use std::future::Future;

use super::{Delivery, DynamoError, DynamoTx, Mode};
use crate::types::classify::{BoxError, Classify};
use crate::types::fingerprint::Fingerprint;
use crate::types::key::IdempotencyKey;
use crate::types::outcome::Outcome;
use crate::types::status::Status;

/// The attribute the dead-letter index is keyed on: the consumer, set on `failed`, `dead` and
/// `parked` items only (so the index is sparse: processed, stale and discarded items are not
/// in it).
pub const DEAD_LETTER_ATTRIBUTE: &str = "dead_letter_consumer";

/// The global secondary index of failed, dead and parked items: partition key
/// [`DEAD_LETTER_ATTRIBUTE`] (string), sort key `received_at` (number, epoch milliseconds);
/// every attribute but `payload` projected.
pub const DEAD_LETTER_INDEX: &str = "dead_letters";

/// The attributes the dead-letter index projects besides its keys and the table's `pk`: what
/// [`DynamoAdmin::list`] shows (the payload is left out: it can be 400 KB, and `show` reads it).
const PROJECTED: [&str; 9] = [
    "consumer",
    "message_key",
    "message_name",
    "status",
    "attempts",
    "last_error",
    "payload_hash",
    "processed_at",
    "next_attempt_at",
];

/// How long [`DynamoInbox::ensure_table`] waits for a dead-letter index it added to become
/// `ACTIVE`: 10 minutes (DynamoDB backfills it from the table's items first).
pub const INDEX_WAIT: Duration = Duration::from_secs(600);

/// Why an admin operation on the DynamoDB inbox failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum AdminError {
    /// A DynamoDB call failed (the message gives DynamoDB's error code and text); nothing was
    /// changed by this operation (a failed `UpdateItem` of [`DynamoAdmin::discard`] may have
    /// applied: show the key to see).
    #[error("DynamoDB {operation} on table `{table}` failed: {}", Chain(source.as_ref()))]
    Dynamo {
        /// The table.
        table: String,
        /// `Scan`, `Query`, `GetItem`, `UpdateItem`, or `PutItem` (a kept rejection).
        operation: &'static str,
        /// The SDK's error.
        #[source]
        source: BoxError,
    },
    /// An inbox item has an attribute missing or malformed (written by something else, or a
    /// status this store does not write): the operation stopped there.
    #[error("the inbox item `{pk}` of table `{table}` is malformed: {reason}")]
    Malformed {
        /// The table.
        table: String,
        /// The item's partition key.
        pk: String,
        /// What is wrong with it.
        reason: String,
    },
    /// An item to write would pass DynamoDB's item size limit (a kept rejection with its
    /// payload, [`DynamoInbox::record_rejection`]): nothing was written.
    #[error(
        "the item for table `{table}` would be {bytes} bytes, over DynamoDB's {max}-byte item limit"
    )]
    ItemTooLarge {
        /// The table.
        table: String,
        /// The item's size as DynamoDB counts it (attribute names and values), in bytes.
        bytes: usize,
        /// DynamoDB's limit: 409,600 bytes (400 KB).
        max: usize,
    },
    /// A store URL that is not `dynamodb://TABLE` with a table name DynamoDB accepts (3 to 255
    /// characters of `a-z A-Z 0-9 _ - .`).
    #[error("`{url}` is not a DynamoDB store URL (dynamodb://TABLE): {reason}")]
    Url {
        /// The URL given.
        url: String,
        /// What is wrong with it.
        reason: &'static str,
    },
}

/// The operator's side of a [`DynamoInbox`] (see the module's docs): made by
/// [`DynamoInbox::admin`], cheap to clone (the client and the counter are shared).
#[derive(Debug, Clone)]
pub struct DynamoAdmin {
    inbox: DynamoInbox,
    calls: Arc<AtomicU64>,
    items_read: Arc<AtomicU64>,
}

impl DynamoInbox {
    /// The admin operations on this inbox's table: [`DynamoAdmin`].
    pub fn admin(&self) -> DynamoAdmin {
        DynamoAdmin {
            inbox: self.clone(),
            calls: Arc::new(AtomicU64::new(0)),
            items_read: Arc::new(AtomicU64::new(0)),
        }
    }

    /// The inbox of a store URL `dynamodb://TABLE`, on a client from the standard AWS
    /// configuration ([`super::client`]`(None)`: `AWS_ENDPOINT_URL`, `AWS_REGION`, credentials
    /// from the environment, profiles or roles), with the default retention window and retry
    /// policy. No call is made (a table that does not exist fails the first operation).
    ///
    /// # Errors
    /// [`AdminError::Url`] if `url` does not start with `dynamodb://` or the table name is not
    /// one DynamoDB accepts (3 to 255 characters of `a-z A-Z 0-9 _ - .`).
    pub async fn from_url(url: &str) -> Result<DynamoInbox, AdminError> {
        let table = table_of_url(url)?;
        Ok(DynamoInbox::new(super::client(None).await, table))
    }

    /// Adds the dead-letter index to a table that lacks it and waits until it is `ACTIVE`
    /// (polling `DescribeTable` every second, at most [`INDEX_WAIT`]); checks the key schema of
    /// one that exists. `table` is the table's description as [`Self::ensure_table`] read it.
    pub(super) async fn ensure_dead_letter_index(
        &self,
        table: &TableDescription,
    ) -> Result<(), TableError> {
        let error = |operation: &'static str, source: BoxError| TableError {
            table: self.table.clone(),
            operation,
            source,
        };
        if let Some(index) = find_index(table) {
            check_index_keys(index.key_schema()).map_err(|e| error("DescribeTable", e.into()))?;
            if index.index_status() == Some(&IndexStatus::Active) {
                return Ok(());
            }
        } else {
            let [hash, range] = index_attribute_definitions();
            let pk = attribute("pk", ScalarAttributeType::S);
            // The table's own key too: DynamoDB takes the definitions of every key of the table
            // and its indexes (moto replaces the table's definitions with those given).
            let added = self
                .client
                .update_table()
                .table_name(&self.table)
                .attribute_definitions(pk)
                .attribute_definitions(hash)
                .attribute_definitions(range)
                .global_secondary_index_updates(
                    GlobalSecondaryIndexUpdate::builder()
                        .create(
                            aws_sdk_dynamodb::types::CreateGlobalSecondaryIndexAction::builder()
                                .index_name(DEAD_LETTER_INDEX)
                                .set_key_schema(Some(index_key_schema()))
                                .projection(index_projection())
                                .build()
                                .map_err(|e| error("UpdateTable", e.into()))?,
                        )
                        .build(),
                )
                .send()
                .await;
            // Another process may have added it meanwhile: the description below decides.
            if let Err(e) = added {
                tracing::debug!(table = self.table, error = %Chain(&e), "UpdateTable adding the dead-letter index failed; reading the table again");
            }
        }
        let deadline = tokio::time::Instant::now() + INDEX_WAIT;
        loop {
            let described = self
                .client
                .describe_table()
                .table_name(&self.table)
                .send()
                .await
                .map_err(|e| error("DescribeTable", e.into()))?;
            let status = described
                .table()
                .and_then(find_index)
                .map(|index| index.index_status().cloned());
            match status {
                None => {
                    return Err(error(
                        "UpdateTable",
                        format!("the table has no index `{DEAD_LETTER_INDEX}` after adding it")
                            .into(),
                    ));
                }
                Some(Some(IndexStatus::Active)) => return Ok(()),
                Some(other) if tokio::time::Instant::now() >= deadline => {
                    return Err(error(
                        "DescribeTable",
                        format!(
                            "the index `{DEAD_LETTER_INDEX}` is still {other:?} after {}s: run \
                             ensure_table again once DynamoDB has built it",
                            INDEX_WAIT.as_secs()
                        )
                        .into(),
                    ));
                }
                Some(_) => tokio::time::sleep(Duration::from_secs(1)).await,
            }
        }
    }
}

impl DynamoInbox {
    /// Replays one failed or dead message as [`DynamoAdmin::show`] read it: runs `handler`
    /// once more through the same claim as [`process_raw`](Self::process_raw), with the stored
    /// message name, key, fingerprint and payload, except that the claim takes a `dead` item
    /// over too, and a `failed` one before its next attempt is due (as the SQL stores'
    /// replay). The handler decodes `stored.payload` itself: the registry-driven replay (by
    /// message name, through the registered handler) is
    /// [`DynamoDispatcher::replay`](super::DynamoDispatcher::replay).
    ///
    /// The claim's condition is the item as the replay reads it (status, attempts,
    /// fingerprint), so two concurrent replays, or a replay and a redelivery, apply the
    /// message once; a failure is recorded as a delivery's (attempts + 1, `dead` if permanent
    /// or at `max_attempts`).
    ///
    /// # Returns
    /// [`Outcome::Processed`] with the handler's value; for a stored message read `processed`
    /// or `discarded` (they keep no payload), no call: [`Outcome::Duplicate`] or
    /// [`Outcome::Discarded`]; if the item changed since `show`, what the claim finds now
    /// (`Duplicate` if processed meanwhile, `Discarded`, …).
    ///
    /// # Errors
    /// As [`process_raw`](Self::process_raw); also [`DynamoError::Key`] if the stored key is
    /// not a valid idempotency key, and [`DynamoError::Malformed`] if `stored.payload_hash` is
    /// not 64 hex digits, or if a `failed` or `dead` message has no payload (a row of
    /// [`DynamoAdmin::list`], which leaves payloads out: replay what `show` reads): nothing
    /// ran, no call.
    pub async fn replay_stored<T, E, F, Fut>(
        &self,
        stored: &StoredMessage,
        handler: F,
    ) -> Result<Outcome<T>, DynamoError<E>>
    where
        E: Classify + std::fmt::Display,
        F: FnMut(DynamoTx) -> Fut,
        Fut: Future<Output = Result<(DynamoTx, T), E>>,
    {
        let key = IdempotencyKey::new(stored.message_key.clone(), "(stored message)", "key")?;
        let Some(payload) = &stored.payload else {
            return match stored.status {
                Status::Processed => Ok(Outcome::Duplicate),
                Status::Discarded => Ok(Outcome::Discarded),
                // A failed or dead row without its payload is one `list` gave (the index does
                // not project it): not a duplicate, and nothing to run.
                status => Err(DynamoError::Malformed {
                    consumer: stored.consumer.clone(),
                    key,
                    reason: format!(
                        "the stored message ({}) has no payload: `list` leaves payloads out, \
                         replay what `show` reads",
                        status.as_str()
                    ),
                }),
            };
        };
        let fingerprint =
            Fingerprint::from_hex(&stored.payload_hash).ok_or_else(|| DynamoError::Malformed {
                consumer: stored.consumer.clone(),
                key: key.clone(),
                reason: "`payload_hash` is not 64 hex digits".to_owned(),
            })?;
        // An ordered message goes through the sequence guard (`gaps = "apply"`, as
        // `DynamoInbox::process`).
        let ordered = stored.ordering().map(|ordering| super::Ordered {
            ordering,
            gaps: crate::types::ordering::GapPolicy::Apply,
        });
        let delivery = Delivery {
            consumer: &stored.consumer,
            message_name: &stored.message_name,
            key: &key,
            fingerprint,
            payload,
            mode: Mode::Replay,
            ordering: ordered.as_ref(),
        };
        let result = self
            .run(&delivery, |error: &E| error.class(), handler)
            .await;
        tracing::info!(
            consumer = stored.consumer,
            key = stored.message_key,
            message_name = stored.message_name,
            outcome = match &result {
                Ok(outcome) => outcome.kind(),
                Err(_) => "error",
            },
            "DynamoDB inbox replay"
        );
        result
    }
}

/// The table of a `dynamodb://TABLE` URL, checked against DynamoDB's naming rules.
fn table_of_url(url: &str) -> Result<String, AdminError> {
    let refuse = |reason| AdminError::Url {
        url: url.to_owned(),
        reason,
    };
    let table = url
        .strip_prefix("dynamodb://")
        .ok_or_else(|| refuse("it does not start with dynamodb://"))?;
    if !(3..=255).contains(&table.len()) {
        return Err(refuse("a table name is 3 to 255 characters"));
    }
    if !table
        .bytes()
        .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'-' | b'.'))
    {
        return Err(refuse("a table name has only a-z, A-Z, 0-9, _, - and ."));
    }
    Ok(table.to_owned())
}

/// The table's dead-letter index, if it has one.
fn find_index(
    table: &TableDescription,
) -> Option<&aws_sdk_dynamodb::types::GlobalSecondaryIndexDescription> {
    table
        .global_secondary_indexes()
        .iter()
        .find(|index| index.index_name() == Some(DEAD_LETTER_INDEX))
}

/// An index named [`DEAD_LETTER_INDEX`] with other keys is refused: it is not ours.
fn check_index_keys(schema: &[KeySchemaElement]) -> Result<(), String> {
    let keys: Vec<(&str, &KeyType)> = schema
        .iter()
        .map(|k| (k.attribute_name(), k.key_type()))
        .collect();
    if keys
        == [
            (DEAD_LETTER_ATTRIBUTE, &KeyType::Hash),
            ("received_at", &KeyType::Range),
        ]
    {
        Ok(())
    } else {
        Err(format!(
            "the index `{DEAD_LETTER_INDEX}` has the key schema {keys:?}, not \
             `{DEAD_LETTER_ATTRIBUTE}` (hash) and `received_at` (range)"
        ))
    }
}

/// The attribute definitions of the index's keys: the consumer (string), `received_at`
/// (number).
pub(super) fn index_attribute_definitions() -> [AttributeDefinition; 2] {
    [
        attribute(DEAD_LETTER_ATTRIBUTE, ScalarAttributeType::S),
        attribute("received_at", ScalarAttributeType::N),
    ]
}

fn index_key_schema() -> Vec<KeySchemaElement> {
    vec![
        key_element(DEAD_LETTER_ATTRIBUTE, KeyType::Hash),
        key_element("received_at", KeyType::Range),
    ]
}

fn index_projection() -> Projection {
    Projection::builder()
        .projection_type(ProjectionType::Include)
        .set_non_key_attributes(Some(PROJECTED.iter().map(|a| (*a).to_owned()).collect()))
        .build()
}

/// The dead-letter index as `CreateTable` takes it (on-demand billing: no throughput).
pub(super) fn dead_letter_index() -> GlobalSecondaryIndex {
    GlobalSecondaryIndex::builder()
        .index_name(DEAD_LETTER_INDEX)
        .set_key_schema(Some(index_key_schema()))
        .projection(index_projection())
        .build()
        .expect("name, keys and projection are set")
}

/// An item as read.
type Item = HashMap<String, AttributeValue>;

/// The expressions of a read of the dead-letter index: the consumer's key condition's names and
/// values (a `Query`), and the filter on one status (none when both are wanted).
struct Filter {
    expression: Option<String>,
    names: HashMap<String, String>,
    values: Item,
}

impl Filter {
    fn dead_letters(consumer: Option<&str>, statuses: &[&str]) -> Self {
        let mut filter = Self {
            expression: None,
            names: HashMap::new(),
            values: HashMap::new(),
        };
        if let Some(consumer) = consumer {
            filter
                .names
                .insert("#consumer".into(), DEAD_LETTER_ATTRIBUTE.into());
            filter.values.insert(":consumer".into(), s(consumer));
        }
        if !statuses.is_empty() {
            let names: Vec<String> = (0..statuses.len()).map(|i| format!(":status{i}")).collect();
            filter.expression = Some(format!("#status IN ({})", names.join(", ")));
            filter.names.insert("#status".into(), "status".into());
            for (name, status) in names.into_iter().zip(statuses) {
                filter.values.insert(name, s(*status));
            }
        }
        filter
    }

    /// The filter expression, the names and the values; `None` for an empty map (DynamoDB
    /// refuses one).
    #[allow(clippy::type_complexity)]
    fn into_parts(
        self,
    ) -> (
        Option<String>,
        Option<HashMap<String, String>>,
        Option<Item>,
    ) {
        let names = (!self.names.is_empty()).then_some(self.names);
        let values = (!self.values.is_empty()).then_some(self.values);
        (self.expression, names, values)
    }
}

impl DynamoAdmin {
    /// The inbox this admin works on.
    pub fn inbox(&self) -> &DynamoInbox {
        &self.inbox
    }

    /// DynamoDB calls this admin (and its clones) made so far: each `Scan`, `Query`,
    /// `GetItem` and `UpdateItem` page or request once, whatever the SDK's own retries of it.
    pub fn calls(&self) -> u64 {
        self.calls.load(Ordering::Relaxed)
    }

    /// Items DynamoDB read for this admin (and its clones) so far: the `ScannedCount` of each
    /// `Scan` and `Query` page (items evaluated, before any filter: what read units are paid
    /// for), and 1 per `GetItem` that found an item. The measure of what
    /// [`list`](Self::list) and [`stats`](Self::stats) cost as the table grows.
    pub fn items_read(&self) -> u64 {
        self.items_read.load(Ordering::Relaxed)
    }

    fn count_call(&self) {
        self.calls.fetch_add(1, Ordering::Relaxed);
    }

    fn count_read(&self, items: i32) {
        self.items_read
            .fetch_add(u64::try_from(items).unwrap_or(0), Ordering::Relaxed);
    }

    fn table(&self) -> &str {
        &self.inbox.table
    }

    /// A `Scan` of the inbox's table: the SDK's request builder, for the caller to add the rest.
    fn scan(&self) -> ScanFluentBuilder {
        self.inbox.client.scan().table_name(self.table())
    }

    /// A `Query` of the inbox's table, as [`scan`](Self::scan).
    fn query(&self) -> QueryFluentBuilder {
        self.inbox.client.query().table_name(self.table())
    }

    fn dynamo(&self, operation: &'static str, source: BoxError) -> AdminError {
        AdminError::Dynamo {
            table: self.table().to_owned(),
            operation,
            source,
        }
    }

    /// Per consumer and status (`processed`, `failed`, `dead`, `discarded`: those that have
    /// items), how many items and the oldest `received_at`, and per consumer (none: a refusal
    /// that names no consumer) and reason the kept rejections (`rejected:<reason>`,
    /// [`super::rejections`]); ordered by consumer (none first), then status text, as
    /// [`crate::ops::admin::stats`]. Items past their retention window are not counted
    /// (absent to the inbox).
    ///
    /// Cost: a `Scan` of the whole table, eventually consistent (one call per 1 MB page,
    /// ½ read unit per 4 KB read).
    ///
    /// # Errors
    /// [`AdminError::Dynamo`] if a `Scan` fails; [`AdminError::Malformed`] for an item without
    /// a consumer, a status this store does not write, or a `received_at` that is not a number.
    pub async fn stats(&self) -> Result<Vec<StatsRow>, AdminError> {
        let now = Now::read();
        let mut groups: HashMap<(Option<String>, StatsStatus), (i64, i64)> = HashMap::new();
        let scan = self
            .scan()
            .projection_expression("#pk, #consumer, #status, #received, #expires, #rejection")
            .expression_attribute_names("#pk", "pk")
            .expression_attribute_names("#rejection", super::REJECTION_ATTRIBUTE)
            .expression_attribute_names("#consumer", "consumer")
            .expression_attribute_names("#status", "status")
            .expression_attribute_names("#received", "received_at")
            .expression_attribute_names("#expires", TTL_ATTRIBUTE);
        self.scan_each(scan, |read| {
            if read.expired(now)? || read.leased() {
                return Ok(());
            }
            let group = match rejection_reason(read.item) {
                Some(reason) => {
                    let reason = reason.map_err(|reason| read.malformed(reason))?;
                    let consumer = read.optional_text("consumer")?.map(str::to_owned);
                    (consumer, StatsStatus::Rejected(reason))
                }
                None if read.ordering_item() => return Ok(()),
                None => (
                    Some(read.text("consumer")?.to_owned()),
                    StatsStatus::Message(read.status()?),
                ),
            };
            let received = read.number("received_at")?.unwrap_or(0);
            let group = groups.entry(group).or_insert((0, i64::MAX));
            group.0 += 1;
            group.1 = group.1.min(received);
            Ok(())
        })
        .await?;
        let mut rows: Vec<StatsRow> = groups
            .into_iter()
            .map(|((consumer, status), (count, oldest))| StatsRow {
                consumer,
                status,
                count,
                oldest: Some(time_text(oldest)),
            })
            .collect();
        rows.sort_by(|a, b| {
            (a.consumer.as_deref(), a.status.as_str())
                .cmp(&(b.consumer.as_deref(), b.status.as_str()))
        });
        Ok(rows)
    }

    /// Items whose status is one of `statuses`, of `consumer` or of all, oldest first (by
    /// `received_at`, then consumer, then key, as [`crate::ops::admin::list`]), at most
    /// `limit`; without their payloads (see [`show`](Self::show)). An empty `statuses` lists
    /// nothing (no call).
    ///
    /// Cost (see the module's docs): `failed` and `dead` alone are read from the dead-letter
    /// index (a `Query` of the consumer's items, eventually consistent, or a `Scan` of the
    /// index for all consumers); `processed`, `discarded`, `parked` or `stale` asked for
    /// scans the whole table.
    ///
    /// # Errors
    /// [`AdminError::Dynamo`] if a call fails (a table without the index: run
    /// [`DynamoInbox::ensure_table`]); [`AdminError::Malformed`] for an item that does not
    /// read as an inbox item.
    pub async fn list(
        &self,
        consumer: Option<&str>,
        statuses: &[Status],
        limit: u32,
    ) -> Result<Vec<StoredMessage>, AdminError> {
        if statuses.is_empty() || limit == 0 {
            return Ok(Vec::new());
        }
        let limit = usize::try_from(limit).unwrap_or(usize::MAX);
        let indexed = statuses
            .iter()
            .all(|status| matches!(status, Status::Failed | Status::Dead));
        let mut rows = if indexed {
            self.list_dead_letters(consumer, statuses, limit).await?
        } else {
            self.list_by_scan(consumer, statuses).await?
        };
        rows.sort_by(|a, b| {
            (received_ms(a), &a.consumer, &a.message_key).cmp(&(
                received_ms(b),
                &b.consumer,
                &b.message_key,
            ))
        });
        rows.truncate(limit);
        Ok(rows)
    }

    /// The failed and dead items (those of `statuses`) from the dead-letter index: a `Query`
    /// per consumer, read in `received_at` order until `limit` are found and the next is newer
    /// than the last of them (so that ties sort by key as on SQL), or a `Scan` of the index.
    async fn list_dead_letters(
        &self,
        consumer: Option<&str>,
        statuses: &[Status],
        limit: usize,
    ) -> Result<Vec<StoredMessage>, AdminError> {
        // A filter on the statuses asked for (the index holds parked items too).
        let wanted: Vec<&str> = statuses.iter().map(|status| status.as_str()).collect();
        let mut rows = Vec::new();
        let mut start: Option<Item> = None;
        loop {
            let (filter, names, values) = Filter::dead_letters(consumer, &wanted).into_parts();
            self.count_call();
            // A consumer's items by their key in the index; all consumers' by a scan of it.
            let (scanned, items, last_key) = if consumer.is_some() {
                let page = self
                    .query()
                    .index_name(DEAD_LETTER_INDEX)
                    .key_condition_expression("#consumer = :consumer")
                    .set_filter_expression(filter)
                    .set_expression_attribute_names(names)
                    .set_expression_attribute_values(values)
                    .scan_index_forward(true)
                    // One more than asked for: it tells whether the last one kept has
                    // items of the same millisecond after it.
                    .limit(i32::try_from(limit.saturating_add(1)).unwrap_or(i32::MAX))
                    .set_exclusive_start_key(start.take())
                    .send()
                    .await
                    .map_err(|e| self.dynamo("Query", e.into()))?;
                (page.scanned_count, page.items, page.last_evaluated_key)
            } else {
                let page = self
                    .scan()
                    .index_name(DEAD_LETTER_INDEX)
                    .set_filter_expression(filter)
                    .set_expression_attribute_names(names)
                    .set_expression_attribute_values(values)
                    .set_exclusive_start_key(start.take())
                    .send()
                    .await
                    .map_err(|e| self.dynamo("Scan", e.into()))?;
                (page.scanned_count, page.items, page.last_evaluated_key)
            };
            self.count_read(scanned);
            for item in items.unwrap_or_default() {
                let row = Read::new(self.table(), &item).message()?;
                if statuses.contains(&row.status) {
                    rows.push(row);
                }
            }
            let more = last_key.filter(|key| !key.is_empty());
            // A query returns the consumer's items in `received_at` order: once `limit` are
            // found, the rest are newer, but for those received in the same millisecond as
            // the last one kept.
            let enough = consumer.is_some() && rows.len() > limit && {
                let kept = received_ms(&rows[limit - 1]);
                rows.last().is_some_and(|last| received_ms(last) > kept)
            };
            match more {
                Some(key) if !enough => start = Some(key),
                _ => break,
            }
        }
        Ok(rows)
    }

    /// Items of `statuses` (and `consumer`) by a filtered `Scan` of the whole table.
    async fn list_by_scan(
        &self,
        consumer: Option<&str>,
        statuses: &[Status],
    ) -> Result<Vec<StoredMessage>, AdminError> {
        let now = Now::read();
        let mut names = Vec::new();
        let mut scan = self.scan().expression_attribute_names("#status", "status");
        for (index, status) in statuses.iter().enumerate() {
            let name = format!(":s{index}");
            scan = scan.expression_attribute_values(&name, s(status.as_str()));
            names.push(name);
        }
        let mut filter = format!("#status IN ({})", names.join(", "));
        if let Some(consumer) = consumer {
            filter.push_str(" AND #consumer = :consumer");
            scan = scan
                .expression_attribute_names("#consumer", "consumer")
                .expression_attribute_values(":consumer", s(consumer));
        }
        let mut rows = Vec::new();
        self.scan_each(scan.filter_expression(filter), |read| {
            if !read.expired(now)? {
                let mut row = read.message()?;
                row.payload = None;
                rows.push(row);
            }
            Ok(())
        })
        .await?;
        Ok(rows)
    }

    /// Runs `scan` to its end, page by page (the SDK's paginator: one call per 1 MB page),
    /// counting the calls and the items read, and hands each item to `each`.
    ///
    /// # Errors
    /// [`AdminError::Dynamo`] if a `Scan` fails; the first error of `each`.
    async fn scan_each(
        &self,
        scan: ScanFluentBuilder,
        mut each: impl FnMut(Read<'_>) -> Result<(), AdminError>,
    ) -> Result<(), AdminError> {
        let mut pages = scan.into_paginator().send();
        self.count_call();
        while let Some(page) = pages.next().await {
            let page = page.map_err(|e| self.dynamo("Scan", e.into()))?;
            self.count_read(page.scanned_count);
            for item in page.items() {
                each(Read::new(self.table(), item))?;
            }
            if page
                .last_evaluated_key
                .as_ref()
                .is_some_and(|key| !key.is_empty())
            {
                self.count_call();
            }
        }
        Ok(())
    }

    /// One item of `consumer` and `key`, its payload included (failed and dead items keep it:
    /// the JSON the handler got, or the raw payload given to
    /// [`DynamoInbox::process_raw`]), whatever its status; `None` if there is none (or it is a
    /// processed or discarded item past its retention window). What a replay needs:
    /// `message_name` and `payload`. One strongly consistent `GetItem`.
    ///
    /// # Errors
    /// [`AdminError::Dynamo`] if the `GetItem` fails; [`AdminError::Malformed`] for an item
    /// that does not read as an inbox item.
    pub async fn show(
        &self,
        consumer: &str,
        key: &str,
    ) -> Result<Option<StoredMessage>, AdminError> {
        let Some(pk) = admin_partition_key(consumer, key) else {
            return Ok(None);
        };
        self.count_call();
        let answer = self
            .inbox
            .by_key()
            .get_item(&pk)
            .consistent_read(true)
            .send()
            .await
            .map_err(|e| self.dynamo("GetItem", e.into()))?;
        let Some(item) = answer.item else {
            return Ok(None);
        };
        self.count_read(1);
        let read = Read::new(self.table(), &item);
        if read.expired(Now::read())? || read.leased() {
            return Ok(None);
        }
        read.message().map(Some)
    }

    /// Marks a `failed` or `dead` message `discarded`, as [`crate::ops::admin::discard`]: it
    /// will never run, its payload (and next attempt time) is dropped, it leaves the
    /// dead-letter index, and the key keeps blocking redeliveries (they come back as
    /// [`crate::Outcome::Discarded`]; one with another payload is a
    /// [`super::DynamoError::Conflict`]) until the retention window, counted from now, has
    /// passed (`expires_at`: DynamoDB's TTL then deletes it). Returns `false` if no failed or
    /// dead item matched (none, or processed, or discarded already).
    ///
    /// One conditional `UpdateItem` (`status` is `failed` or `dead`): a delivery that takes
    /// the failed key over commits its claim and its handler's writes in one transaction on
    /// the condition that the item is still `failed` with the attempts it read, so either the
    /// delivery commits first (the discard then finds it `processed`: `false`) or the discard
    /// does (the delivery's transaction is cancelled, nothing of it is written, and it reports
    /// `Discarded`): never both.
    ///
    /// # Errors
    /// [`AdminError::Dynamo`] if the `UpdateItem` fails for another reason than its condition
    /// (it may then have applied: [`show`](Self::show) tells).
    pub async fn discard(&self, consumer: &str, key: &str) -> Result<bool, AdminError> {
        let Some(pk) = admin_partition_key(consumer, key) else {
            return Ok(false);
        };
        let now = Now::read();
        self.count_call();
        let updated = self
            .inbox
            .by_key()
            .update_item(&pk)
            .update_expression(
                "SET #status = :discarded, #processed = :now_ms, #expires = :expires \
                 REMOVE #payload, #next, #dead_letter",
            )
            .condition_expression("#status IN (:failed, :dead)")
            .expression_attribute_names("#status", "status")
            .expression_attribute_names("#expires", TTL_ATTRIBUTE)
            .expression_attribute_names("#processed", "processed_at")
            .expression_attribute_names("#payload", "payload")
            .expression_attribute_names("#next", "next_attempt_at")
            .expression_attribute_names("#dead_letter", DEAD_LETTER_ATTRIBUTE)
            .expression_attribute_values(":discarded", s("discarded"))
            .expression_attribute_values(":failed", s("failed"))
            .expression_attribute_values(":dead", s("dead"))
            .expression_attribute_values(":now_ms", n(now.ms))
            .expression_attribute_values(":expires", n(self.inbox.expires_at(now)))
            .send()
            .await;
        match updated {
            Ok(_) => {
                metrics::counter!("inbox_dynamodb_discards_total").increment(1);
                Ok(true)
            }
            Err(e)
                if e.as_service_error()
                    .is_some_and(|e| e.is_conditional_check_failed_exception()) =>
            {
                Ok(false)
            }
            Err(e) => Err(self.dynamo("UpdateItem", e.into())),
        }
    }
}

/// The partition key of an admin's `(consumer, key)` (as [`super::partition_key`]), or `None`
/// if it is longer than DynamoDB takes: no item can have it.
fn admin_partition_key(consumer: &str, key: &str) -> Option<String> {
    let pk = format!("{}:{consumer}{key}", consumer.len());
    (pk.len() <= MAX_PARTITION_KEY_BYTES).then_some(pk)
}

/// Epoch milliseconds as the admin's text form: `2026-05-21T10:04:31.123Z` (what
/// [`crate::ops::admin::utc_time`] reads). Before 1970 counts as 1970.
fn time_text(ms: i64) -> String {
    let ms = u64::try_from(ms).unwrap_or(0);
    humantime::format_rfc3339_millis(UNIX_EPOCH + Duration::from_millis(ms)).to_string()
}

/// A row's `received_at` back in epoch milliseconds, for sorting (the text sorts the same way
/// within the years 1970–9999; this does not depend on it).
fn received_ms(row: &StoredMessage) -> i64 {
    humantime::parse_rfc3339(&row.received_at)
        .ok()
        .and_then(|t| t.duration_since(UNIX_EPOCH).ok())
        .map_or(0, |d| i64::try_from(d.as_millis()).unwrap_or(i64::MAX))
}

/// Reads an item's attributes, with [`AdminError::Malformed`] naming the item.
struct Read<'a> {
    table: &'a str,
    item: &'a Item,
}

impl<'a> Read<'a> {
    fn new(table: &'a str, item: &'a Item) -> Self {
        Self { table, item }
    }

    fn malformed(&self, reason: String) -> AdminError {
        let pk = match self.item.get("pk") {
            Some(AttributeValue::S(pk)) => pk.clone(),
            _ => "(no pk)".to_owned(),
        };
        AdminError::Malformed {
            table: self.table.to_owned(),
            pk,
            reason,
        }
    }

    fn text(&self, name: &str) -> Result<&'a str, AdminError> {
        self.optional_text(name)?
            .ok_or_else(|| self.malformed(format!("`{name}` is missing")))
    }

    fn optional_text(&self, name: &str) -> Result<Option<&'a str>, AdminError> {
        match self.item.get(name) {
            None | Some(AttributeValue::Null(_)) => Ok(None),
            Some(AttributeValue::S(text)) => Ok(Some(text)),
            Some(other) => Err(self.malformed(format!("`{name}` is not a string: {other:?}"))),
        }
    }

    fn number(&self, name: &str) -> Result<Option<i64>, AdminError> {
        match self.item.get(name) {
            None | Some(AttributeValue::Null(_)) => Ok(None),
            Some(AttributeValue::N(text)) => text
                .parse()
                .map(Some)
                .map_err(|_| self.malformed(format!("`{name}` is not an integer: {text}"))),
            Some(other) => Err(self.malformed(format!("`{name}` is not a number: {other:?}"))),
        }
    }

    fn status(&self) -> Result<Status, AdminError> {
        let text = self.text("status")?;
        match text.parse::<Status>() {
            Ok(
                status @ (Status::Processed
                | Status::Failed
                | Status::Dead
                | Status::Discarded
                | Status::Parked
                | Status::Stale),
            ) => Ok(status),
            _ => Err(self.malformed(format!("status `{text}` is not one this store writes"))),
        }
    }

    /// The lease of an HTTP request still running (`crate::http::DynamoIdempotencyLayer`):
    /// nothing settled yet, absent to the admin as an uncommitted claim is on the SQL stores.
    fn leased(&self) -> bool {
        matches!(self.item.get("status"), Some(AttributeValue::S(status)) if status == super::LEASED_STATUS)
    }

    /// An aggregate's position or a parked message's pointer (`super::ordering`), not an inbox
    /// item: its partition key does not start with a digit, as every inbox item's does.
    fn ordering_item(&self) -> bool {
        !matches!(self.item.get("pk"), Some(AttributeValue::S(pk)) if pk.starts_with(|c: char| c.is_ascii_digit()))
    }

    /// A processed or discarded item whose retention window has passed: absent to the inbox.
    fn expired(&self, now: Now) -> Result<bool, AdminError> {
        Ok(self
            .number(TTL_ATTRIBUTE)?
            .is_some_and(|expires| expires <= now.secs()))
    }

    fn message(&self) -> Result<StoredMessage, AdminError> {
        let attempts = self.number("attempts")?.unwrap_or(0);
        let attempts = u32::try_from(attempts)
            .map_err(|_| self.malformed(format!("`attempts` is not a count: {attempts}")))?;
        let payload = match self.item.get("payload") {
            None | Some(AttributeValue::Null(_)) => None,
            Some(AttributeValue::B(bytes)) => Some(bytes.as_ref().to_vec()),
            Some(other) => {
                return Err(self.malformed(format!("`payload` is not binary: {other:?}")));
            }
        };
        // The response an HTTP request stored with its key (`http::DynamoIdempotencyLayer`).
        let result = match self.item.get("result") {
            None | Some(AttributeValue::Null(_)) => None,
            Some(AttributeValue::B(bytes)) => Some(bytes.as_ref().to_vec()),
            Some(other) => {
                return Err(self.malformed(format!("`result` is not binary: {other:?}")));
            }
        };
        let received_at = self
            .number("received_at")?
            .ok_or_else(|| self.malformed("`received_at` is missing".to_owned()))?;
        Ok(StoredMessage {
            consumer: self.text("consumer")?.to_owned(),
            message_key: self.text("message_key")?.to_owned(),
            message_name: self.text("message_name")?.to_owned(),
            status: self.status()?,
            attempts,
            last_error: self.optional_text("last_error")?.map(str::to_owned),
            payload_hash: self.text("payload_hash")?.to_owned(),
            payload,
            received_at: time_text(received_at),
            processed_at: self.number("processed_at")?.map(time_text),
            next_attempt_at: self.number("next_attempt_at")?.map(time_text),
            source: None,
            aggregate_id: self.optional_text("aggregate_id")?.map(str::to_owned),
            sequence: self.number("sequence")?,
            result,
        })
    }
}

/// The reason of a kept rejection's item ([`super::rejections`]), if `item` is one.
///
/// # Errors
/// The reason's text when it is not one this store writes.
fn rejection_reason(item: &Item) -> Option<Result<RejectionReason, String>> {
    let is_rejection = matches!(item.get("pk"), Some(AttributeValue::S(pk)) if pk.starts_with(super::REJECTION_PREFIX));
    if !is_rejection {
        return None;
    }
    Some(match item.get(super::REJECTION_ATTRIBUTE) {
        Some(AttributeValue::S(reason)) => reason.parse(),
        other => Err(format!(
            "`{}` is not a reason: {other:?}",
            super::REJECTION_ATTRIBUTE
        )),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn store_urls() {
        assert_eq!(table_of_url("dynamodb://inbox").unwrap(), "inbox");
        assert_eq!(
            table_of_url("dynamodb://my-app.inbox_1").unwrap(),
            "my-app.inbox_1"
        );
        for (url, reason) in [
            ("postgres://x", "it does not start with dynamodb://"),
            ("dynamodb://ab", "a table name is 3 to 255 characters"),
            (
                "dynamodb://in box",
                "a table name has only a-z, A-Z, 0-9, _, - and .",
            ),
            (
                "dynamodb://inbox/x",
                "a table name has only a-z, A-Z, 0-9, _, - and .",
            ),
        ] {
            match table_of_url(url) {
                Err(AdminError::Url { reason: got, .. }) => assert_eq!(got, reason, "{url}"),
                other => panic!("{url}: {other:?}"),
            }
        }
        assert_eq!(
            table_of_url("dynamodb://ab").unwrap_err().to_string(),
            "`dynamodb://ab` is not a DynamoDB store URL (dynamodb://TABLE): a table name is 3 to 255 characters"
        );
    }

    #[test]
    fn times_in_the_admin_text_form() {
        assert_eq!(time_text(1_779_357_871_123), "2026-05-21T10:04:31.123Z");
        assert_eq!(time_text(-5), "1970-01-01T00:00:00.000Z");
        assert_eq!(
            crate::ops::admin::utc_time(&time_text(1_779_357_871_123)),
            "2026-05-21 10:04:31 UTC"
        );
        let row = |ms| StoredMessage {
            consumer: String::new(),
            message_key: String::new(),
            message_name: String::new(),
            status: Status::Dead,
            attempts: 0,
            last_error: None,
            payload_hash: String::new(),
            payload: None,
            received_at: time_text(ms),
            processed_at: None,
            next_attempt_at: None,
            source: None,
            aggregate_id: None,
            sequence: None,
            result: None,
        };
        assert_eq!(received_ms(&row(1_779_357_871_123)), 1_779_357_871_123);
    }
}
