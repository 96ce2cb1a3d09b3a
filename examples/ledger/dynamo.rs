//! The ledger on Amazon DynamoDB (examples feature `dynamodb`): `--store dynamodb://TABLE`.
//!
//! The inbox is [`DynamoInbox`] on the table `TABLE`; the accounts are the items
//! `{"id": S, "balance_cents": N}` of the table `TABLE-accounts`. Both are created if absent
//! (on-demand billing). Each line is decoded by its message name into [`PaymentCaptured`] or
//! [`PaymentRefunded`] and run with [`DynamoInbox::process`] for the consumer `ledger`: the
//! handler ([`credit_dynamodb`], [`debit_dynamodb`]) adds the `Update` of the account's balance
//! to the delivery's [`DynamoTx`](inbox_runtime::dynamodb::DynamoTx), and the claim of the event
//! id and that update commit in one `TransactWriteItems`. So a crash between them is impossible,
//! a redelivery is a duplicate (one `GetItem`), and the same event id with another payload is a
//! conflict, as on the SQL databases; the counts and balances of a stream are the same.
//!
//! Endpoint, region and credentials come from the standard AWS configuration
//! ([`inbox_runtime::dynamodb::client`]): `AWS_ENDPOINT_URL` (or `AWS_ENDPOINT_URL_DYNAMODB`)
//! for a local server such as moto or DynamoDB Local.
//!
//! What the SQL run has and this one has not (yet), said on stdout at every run and refused
//! with an error where it is a command: rejected lines are reported on stderr but not kept (the
//! store could keep them, `DynamoInbox::record_rejection`; this demo does not yet); `ledger admin` and `ledger console` (the admin API
//! and the console run on the SQL stores; dead and failed items stay in the inbox table with
//! their payloads); `--source` (the `Worker` and the Kafka positions run on the SQL stores);
//! `--cache`.

use std::collections::BTreeMap;

use inbox_runtime::dynamodb::sdk::client::Waiters as _;
use inbox_runtime::dynamodb::sdk::types::{
    AttributeDefinition, AttributeValue, BillingMode, KeySchemaElement, KeyType,
    ScalarAttributeType,
};
use inbox_runtime::dynamodb::{self, DynamoError, DynamoInbox, DynamoStats};
use inbox_runtime::{Message, Outcome};
use serde::de::DeserializeOwned;
use tokio::io::AsyncBufRead;

use crate::feed::{Counts, Line, Lines, ReadError, fail, reject};
use crate::handlers::{LedgerError, credit_dynamodb, debit_dynamodb};
use crate::messages::{PaymentCaptured, PaymentRefunded};

/// The URL scheme of a DynamoDB store.
pub(crate) const SCHEME: &str = "dynamodb://";

/// The consumer (inbox scope) of the ledger's handlers, as on the SQL databases.
const CONSUMER: &str = "ledger";

/// The suffix of the accounts table's name.
const ACCOUNTS_SUFFIX: &str = "-accounts";

/// What the DynamoDB run does not do that the SQL run does, printed at every run.
pub(crate) const NOT_YET: &[&str] = &[
    "rejected lines are reported on stderr but not kept (the demo's DynamoDB run does not keep them yet)",
    "`ledger admin`, `ledger console`, --source and --cache need a SQL database \
     (dead and failed items stay in the inbox table with their payloads)",
];

/// The ledger's DynamoDB tables: the inbox and the accounts.
pub(crate) struct DynamoStore {
    inbox: DynamoInbox,
    accounts: String,
}

/// Checks a table name by DynamoDB's rules: 3 to 255 of `A-Z a-z 0-9 _ - .`.
fn check_table_name(name: &str) -> Result<(), String> {
    let valid = (3..=255).contains(&name.len())
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'-' | b'.'));
    if valid {
        Ok(())
    } else {
        Err(format!(
            "`{name}` is not a DynamoDB table name: 3 to 255 characters of A-Z, a-z, 0-9, `_`, \
             `-` and `.`"
        ))
    }
}

/// The table names of `dynamodb://TABLE`: the inbox `TABLE` and the accounts `TABLE-accounts`.
pub(crate) fn tables(url: &str) -> Result<(String, String), String> {
    let name = url
        .strip_prefix(SCHEME)
        .ok_or_else(|| format!("`{url}` is not a {SCHEME}TABLE URL"))?;
    check_table_name(name).map_err(|e| format!("`{url}`: {e}"))?;
    let accounts = format!("{name}{ACCOUNTS_SUFFIX}");
    check_table_name(&accounts).map_err(|e| format!("`{url}`: {e}"))?;
    Ok((name.to_owned(), accounts))
}

/// Where the client sends its calls, for the description line (the SDK resolves the same
/// variables).
fn endpoint() -> String {
    ["AWS_ENDPOINT_URL_DYNAMODB", "AWS_ENDPOINT_URL"]
        .into_iter()
        .find_map(|name| {
            let value = std::env::var(name).ok().filter(|v| !v.is_empty())?;
            Some(format!("{value} ({name})"))
        })
        .unwrap_or_else(|| "AWS".to_owned())
}

impl DynamoStore {
    /// The store `url` names (`dynamodb://TABLE`), with `max_attempts` in the inbox's retry
    /// policy if given; and its description.
    pub(crate) async fn connect(
        url: &str,
        max_attempts: Option<u32>,
    ) -> Result<(Self, String), String> {
        let (table, accounts) = tables(url)?;
        let client = dynamodb::client(None).await;
        let region = client
            .config()
            .region()
            .map_or_else(|| "none".to_owned(), |r| r.to_string());
        let mut inbox = DynamoInbox::new(client, table.clone());
        if let Some(attempts) = max_attempts {
            let policy = inbox_runtime::RetryPolicy::default().max_attempts(attempts);
            inbox = inbox.retry_policy(policy);
        }
        let description = format!(
            "dynamodb tables {table} (inbox), {accounts} (accounts) at {}, region {region}",
            endpoint()
        );
        Ok((Self { inbox, accounts }, description))
    }

    /// Creates the inbox table and the accounts table if they are absent (each waits until it
    /// is `ACTIVE`).
    pub(crate) async fn setup(&self) -> Result<(), String> {
        self.inbox.ensure_table().await.map_err(|e| e.to_string())?;
        let client = self.inbox.client();
        let error = |operation: &str, e: &dyn std::fmt::Display| {
            format!(
                "DynamoDB {operation} on the accounts table `{}` failed: {e}",
                self.accounts
            )
        };
        let attribute = AttributeDefinition::builder()
            .attribute_name("id")
            .attribute_type(ScalarAttributeType::S)
            .build()
            .map_err(|e| error("CreateTable", &e))?;
        let key = KeySchemaElement::builder()
            .attribute_name("id")
            .key_type(KeyType::Hash)
            .build()
            .map_err(|e| error("CreateTable", &e))?;
        let created = client
            .create_table()
            .table_name(&self.accounts)
            .billing_mode(BillingMode::PayPerRequest)
            .attribute_definitions(attribute)
            .key_schema(key)
            .send()
            .await;
        if let Err(e) = created {
            let exists = e
                .as_service_error()
                .is_some_and(|e| e.is_resource_in_use_exception());
            if !exists {
                return Err(error(
                    "CreateTable",
                    &inbox_runtime::dynamodb::sdk::error::DisplayErrorContext(e),
                ));
            }
        }
        client
            .wait_until_table_exists()
            .table_name(&self.accounts)
            .wait(std::time::Duration::from_secs(120))
            .await
            .map_err(|e| {
                error(
                    "DescribeTable",
                    &inbox_runtime::dynamodb::sdk::error::DisplayErrorContext(e),
                )
            })?;
        Ok(())
    }

    /// Every account's balance: a strongly consistent `Scan` of the accounts table.
    pub(crate) async fn balances(&self) -> Result<BTreeMap<String, i64>, String> {
        let mut pages = self
            .inbox
            .client()
            .scan()
            .table_name(&self.accounts)
            .consistent_read(true)
            .into_paginator()
            .items()
            .send();
        let mut balances = BTreeMap::new();
        while let Some(item) = pages.next().await {
            let item = item.map_err(|e| {
                format!(
                    "cannot read the balances (Scan of `{}`): {}",
                    self.accounts,
                    inbox_runtime::dynamodb::sdk::error::DisplayErrorContext(e)
                )
            })?;
            let id = match item.get("id") {
                Some(AttributeValue::S(id)) => id.clone(),
                other => {
                    return Err(format!(
                        "an item of `{}` has no string `id`: {other:?}",
                        self.accounts
                    ));
                }
            };
            let balance = match item.get("balance_cents") {
                Some(AttributeValue::N(n)) => n.parse::<i64>().map_err(|e| {
                    format!("account `{id}`: balance_cents `{n}` is not an i64: {e}")
                })?,
                other => {
                    return Err(format!(
                        "account `{id}` has no number `balance_cents`: {other:?}"
                    ));
                }
            };
            balances.insert(id, balance);
        }
        Ok(balances)
    }

    /// The DynamoDB calls of the inbox so far.
    pub(crate) fn stats(&self) -> DynamoStats {
        self.inbox.stats()
    }

    /// The handlers, in the form the SQL run prints them.
    pub(crate) fn handlers(&self) -> [String; 2] {
        [
            format!(
                "{CONSUMER} <- {} (ledger::handlers::credit_dynamodb, dynamodb)",
                PaymentCaptured::NAME
            ),
            format!(
                "{CONSUMER} <- {} (ledger::handlers::debit_dynamodb, dynamodb)",
                PaymentRefunded::NAME
            ),
        ]
    }

    /// Runs every line of `input` in order, counting the outcomes as the SQL run does.
    /// Rejections, conflicts, dead letters and failures are reported on stderr with their line
    /// numbers; a failed line does not stop the stream.
    pub(crate) async fn feed(&self, input: impl AsyncBufRead + Unpin) -> Result<Counts, ReadError> {
        let mut counts = Counts::default();
        let mut lines = Lines::new(input);
        while let Some((number, line)) = lines.next().await? {
            counts.lines += 1;
            self.feed_line(line, number, &mut counts).await;
        }
        Ok(counts)
    }

    /// Decodes line `number` by its message name and runs it; counts what happened.
    async fn feed_line(&self, line: &[u8], number: u64, counts: &mut Counts) {
        let Line { message, payload } = match serde_json::from_slice::<Line<'_>>(line) {
            Ok(envelope) => envelope,
            Err(parse) => {
                return reject(
                    counts,
                    number,
                    &format_args!("not a message envelope: {parse}"),
                );
            }
        };
        let payload = payload.get();
        match message.as_str() {
            PaymentCaptured::NAME => match decode::<PaymentCaptured>(payload) {
                Ok(msg) => {
                    let result = self
                        .inbox
                        .process(CONSUMER, &msg, |mut tx| async {
                            credit_dynamodb(&mut tx, &self.accounts, &msg)?;
                            Ok((tx, ()))
                        })
                        .await;
                    count(counts, number, result);
                }
                Err(error) => reject(counts, number, &error),
            },
            PaymentRefunded::NAME => match decode::<PaymentRefunded>(payload) {
                Ok(msg) => {
                    let result = self
                        .inbox
                        .process(CONSUMER, &msg, |mut tx| async {
                            debit_dynamodb(&mut tx, &self.accounts, &msg)?;
                            Ok((tx, ()))
                        })
                        .await;
                    count(counts, number, result);
                }
                Err(error) => reject(counts, number, &error),
            },
            other => reject(
                counts,
                number,
                &format_args!("no handler for message `{other}`"),
            ),
        }
    }
}

/// The payload as an `M`, or why it is not one.
fn decode<M: Message + DeserializeOwned>(payload: &str) -> Result<M, String> {
    serde_json::from_str(payload).map_err(|e| format!("payload is not a valid `{}`: {e}", M::NAME))
}

/// Counts one delivery's result for line `number`, reporting the ones that were not applied.
fn count(counts: &mut Counts, number: u64, result: Result<Outcome<()>, DynamoError<LedgerError>>) {
    match result {
        Ok(Outcome::Processed(())) => counts.processed += 1,
        Ok(Outcome::Duplicate) => counts.duplicates += 1,
        Err(DynamoError::Conflict(conflict)) => {
            counts.conflicts += 1;
            crate::observe::note(format_args!(
                "line {number}: conflict: `{}` was applied with another payload \
                 (fingerprint {:.12}…, now {:.12}…): not applied",
                conflict.key,
                conflict.stored.to_hex(),
                conflict.received.to_hex(),
            ));
        }
        Err(DynamoError::Handler(failure)) if failure.disposition.is_settled() => {
            counts.dead += 1;
            crate::observe::note(format_args!(
                "line {number}: dead: consumer `{CONSUMER}`: {failure}"
            ));
        }
        Ok(Outcome::Dead) => {
            counts.dead += 1;
            crate::observe::note(format_args!(
                "line {number}: already dead-lettered for consumer `{CONSUMER}`: not applied"
            ));
        }
        Ok(Outcome::Discarded) => {
            counts.discarded += 1;
            crate::observe::note(format_args!(
                "line {number}: discarded by an operator for consumer `{CONSUMER}`: not applied"
            ));
        }
        Err(DynamoError::Key(error)) => reject(counts, number, &error),
        // A handler that failed (recorded `failed`), DynamoDB: this line is not applied; the
        // next ones may well be.
        Err(error) => fail(counts, number, CONSUMER, &error),
        // Not due yet (a failed attempt's delay), or a newer outcome this demo does not know.
        Ok(other) => fail(
            counts,
            number,
            CONSUMER,
            &format_args!("not applied: outcome `{}`", other.kind()),
        ),
    }
}
