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
