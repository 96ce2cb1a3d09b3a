//! For the Lambda tests (tests/lambda.rs on PostgreSQL, tests/lambda_dynamodb.rs on DynamoDB):
//! SQS records as Lambda's event source mapping sends them, and a Lambda runtime API played by an
//! axum server on loopback (`GET /2018-06-01/runtime/invocation/next` answers with an event,
//! `POST …/{request id}/response` or `…/error` carries the function's answer back).
//!
//! `lambda_runtime` reads the runtime API's address from `AWS_LAMBDA_RUNTIME_API` when it
//! starts, so a test binary that starts functions runs those tests one at a time.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use axum::extract::{Path, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode};
use axum::response::IntoResponse;
use axum::routing::{get, post};
use serde_json::{Value, json};
use tokio::sync::{Mutex, mpsc};

/// One invocation for the runtime API to hand out: request id, event, deadline (epoch ms).
pub type Event = (String, Value, u128);

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

/// The runtime API's state: events waiting for a `next`, answers posted back.
#[derive(Clone)]
struct Api {
    events: Arc<Mutex<mpsc::UnboundedReceiver<Event>>>,
    answers: mpsc::UnboundedSender<Answer>,
}

/// What the function posted for one invocation.
#[derive(Debug)]
pub struct Answer {
    /// The invocation's request id.
    pub request_id: String,
    /// `response` or `error`.
    pub kind: String,
    /// The posted body (JSON, or the text as a JSON string).
    pub body: Value,
}

async fn next(State(api): State<Api>) -> impl IntoResponse {
    let mut events = api.events.lock().await;
    let Some((request_id, event, deadline)) = events.recv().await else {
        // No more events: the function waits, as it does between invocations.
        drop(events);
        std::future::pending::<()>().await;
        unreachable!();
    };
    let mut headers = HeaderMap::new();
    headers.insert(
        "lambda-runtime-aws-request-id",
        HeaderValue::from_str(&request_id).unwrap(),
    );
    headers.insert(
        "lambda-runtime-deadline-ms",
        HeaderValue::from_str(&deadline.to_string()).unwrap(),
    );
    headers.insert(
        "lambda-runtime-invoked-function-arn",
        HeaderValue::from_static("arn:aws:lambda:eu-west-1:123456789012:function:credits"),
    );
    headers.insert("content-type", HeaderValue::from_static("application/json"));
    (StatusCode::OK, headers, event.to_string())
}

async fn answer(
    State(api): State<Api>,
    Path((request_id, kind)): Path<(String, String)>,
    body: String,
) -> StatusCode {
    let body = serde_json::from_str(&body).unwrap_or(Value::String(body));
    let _ = api.answers.send(Answer {
        request_id,
        kind,
        body,
    });
    StatusCode::ACCEPTED
}

/// Starts a runtime API on a new loopback port, points `AWS_LAMBDA_RUNTIME_API` (and the other
/// variables `lambda_runtime` requires) at it, and returns where to send its events; the
/// function's answers go to `answers`. A function started after this polls this API.
pub async fn runtime_api(answers: mpsc::UnboundedSender<Answer>) -> mpsc::UnboundedSender<Event> {
    let (events, events_rx) = mpsc::unbounded_channel();
    let api = Api {
        events: Arc::new(Mutex::new(events_rx)),
        answers,
    };
    let app = axum::Router::new()
        .route("/2018-06-01/runtime/invocation/next", get(next))
        .route(
            "/2018-06-01/runtime/invocation/{request_id}/{kind}",
            post(answer),
        )
        .with_state(api);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr: SocketAddr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await });
    // SAFETY: the callers run their functions' tests one at a time, and no other thread of the
    // process reads the environment meanwhile but through std's own lock.
    unsafe {
        std::env::set_var("AWS_LAMBDA_RUNTIME_API", addr.to_string());
        std::env::set_var("AWS_LAMBDA_FUNCTION_NAME", "credits");
        std::env::set_var("AWS_LAMBDA_FUNCTION_MEMORY_SIZE", "128");
        std::env::set_var("AWS_LAMBDA_FUNCTION_VERSION", "$LATEST");
    }
    events
}

/// One invocation with `records` under `request_id`, whose deadline is `left` from now: what the
/// function answered (within 60 s).
pub async fn invoke(
    events: &mpsc::UnboundedSender<Event>,
    answers: &mut mpsc::UnboundedReceiver<Answer>,
    request_id: String,
    records: Vec<Value>,
    left: Duration,
) -> Answer {
    let deadline = (SystemTime::now() + left)
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_millis();
    let event = json!({ "Records": records });
    events.send((request_id.clone(), event, deadline)).unwrap();
    let answer = tokio::time::timeout(Duration::from_secs(60), answers.recv())
        .await
        .expect("the function answers within 60 s")
        .expect("the runtime API is up");
    assert_eq!(answer.request_id, request_id);
    answer
}

/// The ids a partial batch response lists in `batchItemFailures`, in order; panics if the
/// answer is not a response.
pub fn listed(answer: Answer) -> Vec<String> {
    assert_eq!(answer.kind, "response", "{answer:?}");
    answer.body["batchItemFailures"]
        .as_array()
        .unwrap_or_else(|| panic!("a partial batch response: {answer:?}"))
        .iter()
        .map(|failure| failure["itemIdentifier"].as_str().unwrap().to_owned())
        .collect()
}
