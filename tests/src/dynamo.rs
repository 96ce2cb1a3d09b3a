//! DynamoDB support for the tests against moto (`DYNAMODB_ENDPOINT`, the serial moto server of
//! scripts/sqs.sh): the endpoint, and a table keyed by a string `id` for handlers' effects.

use inbox_runtime::dynamodb::sdk::Client;
use inbox_runtime::dynamodb::sdk::types::{
    AttributeDefinition, BillingMode, KeySchemaElement, KeyType, ScalarAttributeType,
};

/// `DYNAMODB_ENDPOINT`; panics with how to start moto if unset.
pub fn endpoint() -> String {
    std::env::var("DYNAMODB_ENDPOINT").unwrap_or_else(|_| {
        panic!(
            "DYNAMODB_ENDPOINT is not set: start the serial moto server with \
             `eval \"$(scripts/sqs.sh start)\"` (scripts/test.sh does)"
        )
    })
}

/// Creates table `name` (on-demand) with the string partition key `id`.
pub async fn create_id_table(client: &Client, name: &str) {
    let attribute = AttributeDefinition::builder()
        .attribute_name("id")
        .attribute_type(ScalarAttributeType::S)
        .build()
        .unwrap();
    let key = KeySchemaElement::builder()
        .attribute_name("id")
        .key_type(KeyType::Hash)
        .build()
        .unwrap();
    client
        .create_table()
        .table_name(name)
        .billing_mode(BillingMode::PayPerRequest)
        .attribute_definitions(attribute)
        .key_schema(key)
        .send()
        .await
        .unwrap_or_else(|error| panic!("creating table {name}: {error:?}"));
}

/// The number attribute `attribute` of the item whose string `id` is `id` in `table` (a strongly
/// consistent read); `None` if there is no such item. Panics if the attribute is missing or not a
/// number.
pub async fn number(client: &Client, table: &str, id: &str, attribute: &str) -> Option<i64> {
    use inbox_runtime::dynamodb::sdk::types::AttributeValue;
    let item = client
        .get_item()
        .table_name(table)
        .key("id", AttributeValue::S(id.to_owned()))
        .consistent_read(true)
        .send()
        .await
        .unwrap_or_else(|error| panic!("reading {id} of {table}: {error:?}"))
        .item?;
    match item.get(attribute) {
        Some(AttributeValue::N(n)) => Some(n.parse().expect("a number attribute")),
        other => panic!("{attribute} of {id} in {table}: {other:?}"),
    }
}

/// The name of a table with a string `id` key shared by the tests of one binary (their handlers
/// name it through `cell`), created on first use with [`create_id_table`].
pub async fn shared_id_table<'a>(
    cell: &'a tokio::sync::OnceCell<String>,
    client: &Client,
    prefix: &str,
) -> &'a str {
    cell.get_or_init(|| async {
        let name = crate::unique_name(prefix);
        create_id_table(client, &name).await;
        name
    })
    .await
}

/// A fresh inbox table (a unique name) on `client`, with every retry due at once, ready.
pub async fn fresh_inbox(client: Client) -> inbox_runtime::dynamodb::DynamoInbox {
    use std::time::Duration;
    let inbox = inbox_runtime::dynamodb::DynamoInbox::new(client, crate::unique_name("inbox"))
        .retry_policy(
            inbox_runtime::RetryPolicy::default().retry_delays(Duration::ZERO, Duration::ZERO),
        );
    inbox.ensure_table().await.expect("inbox table");
    inbox
}

/// A fresh inbox table ([`fresh_inbox`]) on a client of [`endpoint`], and the binary's shared
/// table of effects (`cell`, named after `prefix`, [`shared_id_table`]).
pub async fn setup_with_table(
    cell: &tokio::sync::OnceCell<String>,
    prefix: &str,
) -> inbox_runtime::dynamodb::DynamoInbox {
    let client = inbox_runtime::dynamodb::client(Some(&endpoint())).await;
    shared_id_table(cell, &client, prefix).await;
    fresh_inbox(client).await
}

/// The stored status of `consumer`'s `key` (through the admin's `show`); `None` if none.
pub async fn status(
    inbox: &inbox_runtime::dynamodb::DynamoInbox,
    consumer: &str,
    key: &str,
) -> Option<inbox_runtime::types::Status> {
    inbox
        .admin()
        .show(consumer, key)
        .await
        .unwrap()
        .map(|row| row.status)
}

/// The list attribute `history` (strings) of item `id` of `table`, comma-joined (a consistent
/// read); `None` if there is no item. Panics on another shape.
pub async fn history(
    inbox: &inbox_runtime::dynamodb::DynamoInbox,
    table: &str,
    id: &str,
) -> Option<String> {
    use inbox_runtime::dynamodb::sdk::types::AttributeValue;
    let item = inbox
        .client()
        .get_item()
        .table_name(table)
        .key("id", AttributeValue::S(id.to_owned()))
        .consistent_read(true)
        .send()
        .await
        .unwrap()
        .item?;
    match item.get("history") {
        Some(AttributeValue::L(kinds)) => Some(
            kinds
                .iter()
                .map(|kind| kind.as_s().unwrap().as_str())
                .collect::<Vec<_>>()
                .join(","),
        ),
        other => panic!("history of {id}: {other:?}"),
    }
}

/// Handlers' errors in the DynamoDB tests: `Boom` retryable, `Fatal` permanent, `Build` an SDK
/// builder's error (retryable).
#[derive(Debug)]
pub enum TestError {
    /// Retryable.
    Boom,
    /// Permanent.
    Fatal,
    /// An SDK builder's error.
    Build(String),
}

impl std::fmt::Display for TestError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            TestError::Boom => f.write_str("boom"),
            TestError::Fatal => f.write_str("fatal"),
            TestError::Build(error) => write!(f, "build: {error}"),
        }
    }
}

impl std::error::Error for TestError {}

impl inbox_runtime::Classify for TestError {
    fn class(&self) -> inbox_runtime::ErrorClass {
        match self {
            TestError::Fatal => inbox_runtime::ErrorClass::Permanent,
            _ => inbox_runtime::ErrorClass::Retryable,
        }
    }
}

/// `DynamoAdmin::stats` of `inbox` as `(consumer, status text, count)` rows, in its order.
pub async fn stats_rows(
    inbox: &inbox_runtime::dynamodb::DynamoInbox,
) -> Vec<(Option<String>, String, i64)> {
    inbox
        .admin()
        .stats()
        .await
        .unwrap()
        .into_iter()
        .map(|row| (row.consumer, row.status.as_str().to_owned(), row.count))
        .collect()
}
