//! SQS records as Lambda's event source mapping sends them, for the Lambda tests
//! (tests/lambda.rs on PostgreSQL, tests/lambda_dynamodb.rs on DynamoDB).

use serde_json::{Value, json};

/// An SQS record as Lambda's event source mapping sends it: `ApproximateReceiveCount` 1, the
/// message name (if any) in the String attribute `message-name`, and on a FIFO queue (`group`)
/// its `MessageGroupId`, `MessageDeduplicationId` (the message id) and `SequenceNumber`.
pub fn record(
    message_id: &str,
    arn: &str,
    body: Option<String>,
    name: Option<&str>,
    group: Option<&str>,
) -> Value {
    let mut attributes = json!({
        "ApproximateReceiveCount": "1",
        "SentTimestamp": "1764806400000",
        "SenderId": "AIDAEXAMPLE",
        "ApproximateFirstReceiveTimestamp": "1764806400100",
    });
    if let Some(group) = group {
        attributes["MessageGroupId"] = json!(group);
        attributes["MessageDeduplicationId"] = json!(message_id);
        attributes["SequenceNumber"] = json!("18849496460467696128");
    }
    let mut message_attributes = json!({});
    if let Some(name) = name {
        message_attributes["message-name"] = json!({
            "stringValue": name,
            "stringListValues": [],
            "binaryListValues": [],
            "dataType": "String",
        });
    }
    json!({
        "messageId": message_id,
        "receiptHandle": format!("AQEB-{message_id}"),
        "body": body,
        "attributes": attributes,
        "messageAttributes": message_attributes,
        "md5OfBody": "0",
        "eventSource": "aws:sqs",
        "eventSourceARN": arn,
        "awsRegion": "eu-west-1",
    })
}
