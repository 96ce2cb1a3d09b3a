//! The HTTP `Idempotency-Key` layer on the DynamoDB store (`DynamoIdempotencyLayer`, features
//! `http` and `dynamodb`) against moto's DynamoDB on loopback (`DYNAMODB_ENDPOINT`, the serial
//! moto server of scripts/sqs.sh), driving a real axum `Router` in process
//! (`tower::ServiceExt::oneshot`): a first request takes effect once and its response replays
//! byte for byte; another body is a 422; a concurrent duplicate is a 409 while the first runs;
//! statuses stored and not stored; a handler's failed condition; bad keys; a response too large
//! for an item; a lease taken over after it ended does not apply twice (nor when the duplicate
//! fails); a refused transaction; 99 actions and no more; a retention window shorter than the
//! lease; a request dropped mid-handler; a commit whose answer was lost (an SDK interceptor);
//! the admin's view of an HTTP key. The handlers' effect is a counter item in a DynamoDB table
//! of each test's own.

#![allow(missing_docs)]

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use axum::Router;
use axum::body::Body;
use axum::extract::{Path, State};
use axum::http::{Request, Response, StatusCode};
use axum::routing::post;
use inbox_runtime::dynamodb::sdk::Client;
use inbox_runtime::dynamodb::sdk::config::interceptors::{
    BeforeDeserializationInterceptorContextMut, BeforeSerializationInterceptorContextRef,
};
use inbox_runtime::dynamodb::sdk::config::{ConfigBag, Intercept, RuntimeComponents};
use inbox_runtime::dynamodb::sdk::error::BoxError;
use inbox_runtime::dynamodb::sdk::operation::transact_write_items::TransactWriteItemsInput;
use inbox_runtime::dynamodb::sdk::types::{AttributeValue, ConditionCheck, Update};
use inbox_runtime::dynamodb::{self, DynamoInbox};
use inbox_runtime::http::{DynamoIdempotencyLayer, DynamoIdempotencyTx};
use inbox_tests::dynamo::{create_id_table, endpoint};
use tokio::sync::Notify;
use tower::ServiceExt as _;

/// What the handlers share with the test.
#[derive(Clone)]
struct App {
    counters: String,
    /// `/slow` signals this when its first call has added its write…
    entered: Arc<Notify>,
    /// …and waits for this before it answers.
    release: Arc<Notify>,
    /// Whether `/slow` has been called (only its first call waits).
    slow_called: Arc<AtomicBool>,
}

impl App {
    /// `ADD n :1` on the counter item `id` (the request's effect).
    fn increment(&self, tx: &mut DynamoIdempotencyTx, id: &str) {
        let update = Update::builder()
            .table_name(&self.counters)
            .key("id", AttributeValue::S(id.to_owned()))
            .update_expression("ADD n :one")
            .expression_attribute_values(":one", AttributeValue::N("1".into()))
            .build()
            .unwrap();
        tx.update(update);
    }
}

async fn order(
    State(app): State<App>,
    mut tx: DynamoIdempotencyTx,
    body: String,
) -> Response<Body> {
    app.increment(&mut tx, &body);
    created(&body)
}

fn created(body: &str) -> Response<Body> {
    Response::builder()
        .status(StatusCode::CREATED)
        .header("content-type", "application/json")
        .header("location", format!("/orders/{body}"))
        .header("set-cookie", "session=first")
        .body(Body::from(format!(
            "{{\"order\":\"{body}\",\"nonce\":\"{}\"}}",
            uuid::Uuid::new_v4()
        )))
        .unwrap()
}

async fn slow(State(app): State<App>, mut tx: DynamoIdempotencyTx, body: String) -> Response<Body> {
    app.increment(&mut tx, &body);
    if !app.slow_called.swap(true, Ordering::SeqCst) {
        app.entered.notify_one();
        app.release.notified().await;
    }
    created(&body)
}

/// Writes; its first call then waits (as `/slow`) and answers 201, the later ones answer 500.
async fn flaky(
    State(app): State<App>,
    mut tx: DynamoIdempotencyTx,
    body: String,
) -> Response<Body> {
    app.increment(&mut tx, &body);
    if app.slow_called.swap(true, Ordering::SeqCst) {
        return Response::builder()
            .status(StatusCode::INTERNAL_SERVER_ERROR)
            .body(Body::from("later calls fail"))
            .unwrap();
    }
    app.entered.notify_one();
    app.release.notified().await;
    created(&body)
}

/// Writes, then answers with the status of the path.
async fn status(
    State(app): State<App>,
    Path(code): Path<u16>,
    mut tx: DynamoIdempotencyTx,
    body: String,
) -> Response<Body> {
    app.increment(&mut tx, &body);
    Response::builder()
        .status(code)
        .body(Body::from(format!("status {code}")))
        .unwrap()
}

/// Writes, and checks that the item `guard` exists (it never does): the condition fails.
async fn guarded(
    State(app): State<App>,
    mut tx: DynamoIdempotencyTx,
    body: String,
) -> Response<Body> {
    app.increment(&mut tx, &body);
    let check = ConditionCheck::builder()
        .table_name(&app.counters)
        .key("id", AttributeValue::S("guard".into()))
        .condition_expression("attribute_exists(id)")
        .build()
        .unwrap();
    tx.condition_check(check);
    created(&body)
}

/// Writes, then panics.
async fn panics(
    State(app): State<App>,
    mut tx: DynamoIdempotencyTx,
    body: String,
) -> Response<Body> {
    app.increment(&mut tx, &body);
    panic!("the handler fails after its write");
}

/// Writes, and answers 201 with a body of 450,000 bytes: above DynamoDB's item limit.
async fn big(State(app): State<App>, mut tx: DynamoIdempotencyTx, body: String) -> Response<Body> {
    app.increment(&mut tx, &body);
    Response::builder()
        .status(StatusCode::CREATED)
        .body(Body::from(vec![b'x'; 450_000]))
        .unwrap()
}

/// Adds two actions on one counter item: DynamoDB refuses the transaction
/// (`ValidationException`), whatever is retried.
async fn twice(
    State(app): State<App>,
    mut tx: DynamoIdempotencyTx,
    body: String,
) -> Response<Body> {
    app.increment(&mut tx, &body);
    app.increment(&mut tx, &body);
    created(&body)
}

/// Adds `count` actions, one per counter item `<body>-<i>`.
async fn many(
    State(app): State<App>,
    Path(count): Path<usize>,
    mut tx: DynamoIdempotencyTx,
    body: String,
) -> Response<Body> {
    for i in 0..count {
        app.increment(&mut tx, &format!("{body}-{i}"));
    }
    created(&body)
}

struct Setup {
    client: Client,
    inbox: DynamoInbox,
    app: App,
    router: Router,
}

async fn setup(configure: impl FnOnce(DynamoIdempotencyLayer) -> DynamoIdempotencyLayer) -> Setup {
    setup_with(Duration::from_secs(86_400), configure).await
}

async fn setup_with(
    retention: Duration,
    configure: impl FnOnce(DynamoIdempotencyLayer) -> DynamoIdempotencyLayer,
) -> Setup {
    setup_on(
        dynamodb::client(Some(&endpoint())).await,
        retention,
        configure,
    )
    .await
}

async fn setup_on(
    client: Client,
    retention: Duration,
    configure: impl FnOnce(DynamoIdempotencyLayer) -> DynamoIdempotencyLayer,
) -> Setup {
    let id = uuid::Uuid::now_v7().simple().to_string();
    let inbox = DynamoInbox::new(client.clone(), format!("http-inbox-{id}")).retention(retention);
    inbox.ensure_table().await.unwrap();
    let counters = format!("http-counters-{id}");
    create_id_table(&client, &counters).await;
    let app = App {
        counters,
        entered: Arc::new(Notify::new()),
        release: Arc::new(Notify::new()),
        slow_called: Arc::new(AtomicBool::new(false)),
    };
    let router = Router::new()
        .route("/orders", post(order))
        .route("/slow", post(slow))
        .route("/status/{code}", post(status))
        .route("/guarded", post(guarded))
        .route("/big", post(big))
        .route("/panic", post(panics))
        .route("/twice", post(twice))
        .route("/flaky", post(flaky))
        .route("/many/{count}", post(many))
        .route_layer(configure(DynamoIdempotencyLayer::new(inbox.clone())))
        .with_state(app.clone());
    Setup {
        client,
        inbox,
        app,
        router,
    }
}

impl Setup {
    async fn send(
        &self,
        path: &str,
        key: Option<&str>,
        body: &str,
    ) -> (StatusCode, axum::http::HeaderMap, Vec<u8>) {
        let mut request = Request::post(path);
        if let Some(key) = key {
            request = request.header("idempotency-key", key);
        }
        let request = request.body(Body::from(body.to_owned())).unwrap();
        let response = self.router.clone().oneshot(request).await.unwrap();
        let (parts, body) = response.into_parts();
        let bytes = axum::body::to_bytes(body, usize::MAX).await.unwrap();
        (parts.status, parts.headers, bytes.to_vec())
    }

    /// The counter item `id`'s `n` (0 if absent), read consistently.
    async fn counter(&self, id: &str) -> i64 {
        let item = self
            .client
            .get_item()
            .table_name(&self.app.counters)
            .key("id", AttributeValue::S(id.to_owned()))
            .consistent_read(true)
            .send()
            .await
            .unwrap()
            .item;
        match item.as_ref().and_then(|item| item.get("n")) {
            Some(AttributeValue::N(n)) => n.parse().unwrap(),
            _ => 0,
        }
    }

    /// How many items the inbox table holds.
    async fn keys(&self) -> i32 {
        self.client
            .scan()
            .table_name(self.inbox.table())
            .consistent_read(true)
            .send()
            .await
            .unwrap()
            .count()
    }

    /// Sends the request twice (the second finds the key free again: the same answer, not a
    /// 409); both answers are the problem `slug` with `status`. Returns the last body.
    async fn problem_twice(
        &self,
        path: &str,
        key: &str,
        body: &str,
        status: StatusCode,
        slug: &str,
    ) -> Vec<u8> {
        let mut last = Vec::new();
        for _ in 0..2 {
            let (got, headers, answer) = self.send(path, Some(key), body).await;
            assert_eq!(got, status, "{path}");
            assert!(headers.get("retry-after").is_none());
            assert_eq!(problem_type(&answer), slug);
            last = answer;
        }
        last
    }

    /// Sends the request in a task of its own, and returns once its handler waits (`/slow`'s
    /// or `/flaky`'s first call): the task answers after `app.release`.
    async fn running(
        self: &Arc<Self>,
        path: &'static str,
        key: &'static str,
        body: &'static str,
    ) -> tokio::task::JoinHandle<(StatusCode, axum::http::HeaderMap, Vec<u8>)> {
        let s = Arc::clone(self);
        let task = tokio::spawn(async move { s.send(path, Some(key), body).await });
        self.app.entered.notified().await;
        task
    }

    fn calls(&self) -> u64 {
        self.inbox.stats().calls
    }
}

fn problem_type(body: &[u8]) -> String {
    let value: serde_json::Value = serde_json::from_slice(body).unwrap();
    let url = value["type"].as_str().unwrap();
    url.rsplit_once("#problems-").unwrap().1.to_owned()
}

#[tokio::test]
async fn a_request_takes_effect_once_and_replays_byte_for_byte() {
    let s = setup(|layer| layer).await;
    let (status, headers, first) = s.send("/orders", Some("\"k1\""), "a").await;
    assert_eq!(status, StatusCode::CREATED);
    assert_eq!(headers.get("set-cookie").unwrap(), "session=first");
    assert!(headers.get("idempotent-replayed").is_none());
    assert_eq!(s.counter("a").await, 1);
    assert_eq!(
        s.calls(),
        2,
        "a new key: PutItem (lease), TransactWriteItems"
    );

    let (status, headers, again) = s.send("/orders", Some("\"k1\""), "a").await;
    assert_eq!(status, StatusCode::CREATED);
    assert_eq!(
        again, first,
        "the stored body, byte for byte (its nonce too)"
    );
    assert_eq!(headers.get("idempotent-replayed").unwrap(), "true");
    assert_eq!(headers.get("content-type").unwrap(), "application/json");
    assert_eq!(headers.get("location").unwrap(), "/orders/a");
    assert!(headers.get("set-cookie").is_none(), "never stored");
    assert_eq!(s.counter("a").await, 1);
    assert_eq!(
        s.calls(),
        3,
        "a replay: the refused PutItem returns the item"
    );

    let (status, _, body) = s.send("/orders", Some("\"k1\""), "b").await;
    assert_eq!(status, StatusCode::UNPROCESSABLE_ENTITY);
    assert_eq!(problem_type(&body), "idempotency-key-reused");
    assert_eq!((s.counter("a").await, s.counter("b").await), (1, 0));
    assert_eq!(s.calls(), 4, "a 422: one call");
    assert_eq!(s.keys().await, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_concurrent_duplicate_gets_409_while_the_first_runs() {
    let s = Arc::new(setup(|layer| layer.retry_after(Duration::from_secs(3))).await);
    let first = s.running("/slow", "\"k\"", "c").await;
    let calls = s.calls();
    let (status, headers, body) = s.send("/slow", Some("\"k\""), "c").await;
    assert_eq!(
        s.calls() - calls,
        1,
        "a 409: one call (the refused PutItem)"
    );
    assert_eq!(status, StatusCode::CONFLICT);
    assert_eq!(headers.get("retry-after").unwrap(), "3");
    assert_eq!(problem_type(&body), "idempotency-key-in-use");
    // Another body under the held key: 422.
    let (status, _, _) = s.send("/slow", Some("\"k\""), "d").await;
    assert_eq!(status, StatusCode::UNPROCESSABLE_ENTITY);
    assert_eq!(
        s.counter("c").await,
        0,
        "nothing committed while the first runs"
    );

    s.app.release.notify_one();
    let (status, _, first_body) = first.await.unwrap();
    assert_eq!(status, StatusCode::CREATED);
    assert_eq!(s.counter("c").await, 1);
    let (status, headers, body) = s.send("/slow", Some("\"k\""), "c").await;
    assert_eq!(status, StatusCode::CREATED);
    assert_eq!(headers.get("idempotent-replayed").unwrap(), "true");
    assert_eq!(body, first_body);
    assert_eq!(s.counter("c").await, 1);
    let stats = s.inbox.admin().stats().await.unwrap();
    let rows: Vec<_> = stats
        .iter()
        .map(|row| (row.consumer.as_deref(), row.status.as_str(), row.count))
        .collect();
    assert_eq!(rows, [(Some("http POST /slow"), "processed", 1)]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lease_taken_over_after_it_ended_does_not_apply_twice() {
    // Every lease ends at once: the duplicate takes the key over while the first still runs.
    let s = Arc::new(setup(|layer| layer.lease(Duration::ZERO)).await);
    let first = s.running("/slow", "\"t\"", "e").await;
    let (status, headers, second_body) = s.send("/slow", Some("\"t\""), "e").await;
    assert_eq!(
        status,
        StatusCode::CREATED,
        "took the ended lease over and ran"
    );
    assert!(headers.get("idempotent-replayed").is_none());
    assert_eq!(s.counter("e").await, 1);

    s.app.release.notify_one();
    let (status, headers, first_body) = first.await.unwrap();
    assert_eq!(status, StatusCode::CREATED);
    assert_eq!(
        headers.get("idempotent-replayed").unwrap(),
        "true",
        "its lease lost: it answers with the winner's stored response"
    );
    assert_eq!(first_body, second_body);
    assert_eq!(s.counter("e").await, 1, "applied once");
}

#[tokio::test]
async fn stored_statuses_commit_and_others_write_nothing_and_free_the_key() {
    let s = setup(|layer| layer).await;
    // 500: not stored, the write not committed, the key free (not a 409) for the retry.
    for run in 1..=2 {
        let (status, headers, body) = s.send("/status/500", Some("\"s\""), "f").await;
        assert_eq!(
            s.calls(),
            run * 2,
            "not stored: PutItem (lease), DeleteItem (release)"
        );
        assert_eq!(status, StatusCode::INTERNAL_SERVER_ERROR);
        assert_eq!(body, b"status 500");
        assert!(headers.get("idempotent-replayed").is_none());
    }
    assert_eq!(s.counter("f").await, 0);
    assert_eq!(s.keys().await, 0, "the leases were released");
    // 429: not stored either.
    let (status, _, _) = s.send("/status/429", Some("\"s429\""), "f").await;
    assert_eq!(status, StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(s.counter("f").await, 0);
    // 404: stored (a final answer), and its write commits with it.
    let (status, _, first) = s.send("/status/404", Some("\"n\""), "g").await;
    assert_eq!(status, StatusCode::NOT_FOUND);
    assert_eq!(s.counter("g").await, 1);
    let (status, headers, again) = s.send("/status/404", Some("\"n\""), "g").await;
    assert_eq!(status, StatusCode::NOT_FOUND);
    assert_eq!(headers.get("idempotent-replayed").unwrap(), "true");
    assert_eq!(again, first);
    assert_eq!(s.counter("g").await, 1);
}

#[tokio::test]
async fn a_failed_condition_of_the_handler_writes_nothing() {
    let s = setup(|layer| layer).await;
    let body = s
        .problem_twice(
            "/guarded",
            "\"g\"",
            "h",
            StatusCode::CONFLICT,
            "condition-failed",
        )
        .await;
    let detail = serde_json::from_slice::<serde_json::Value>(&body).unwrap()["detail"]
        .as_str()
        .unwrap()
        .to_owned();
    assert!(detail.contains("action 1 (ConditionCheck"), "{detail}");
    assert_eq!(
        s.calls(),
        6,
        "a failed condition: PutItem, TransactWriteItems, DeleteItem; sent twice"
    );
    assert_eq!(s.counter("h").await, 0);
    assert_eq!(s.keys().await, 0);
}

#[tokio::test]
async fn bad_keys_are_refused_before_any_call() {
    let s = setup(|layer| layer).await;
    let long = format!("\"{}\"", "k".repeat(256));
    for (key, slug) in [
        (None, "idempotency-key-missing"),
        (Some("\"\""), "idempotency-key-malformed"),
        (Some("\"   \""), "idempotency-key-malformed"),
        (Some("unquoted"), "idempotency-key-malformed"),
        (Some("\"clé\""), "idempotency-key-malformed"),
        (Some(long.as_str()), "idempotency-key-too-long"),
    ] {
        let (status, headers, body) = s.send("/orders", key, "i").await;
        assert_eq!(status, StatusCode::BAD_REQUEST, "{key:?}");
        assert_eq!(
            headers.get("content-type").unwrap(),
            "application/problem+json"
        );
        assert_eq!(problem_type(&body), slug, "{key:?}");
    }
    assert_eq!(s.calls(), 0);
    assert_eq!(s.counter("i").await, 0);
    assert_eq!(s.keys().await, 0);
}

#[tokio::test]
async fn a_response_too_large_to_store_commits_nothing() {
    let s = setup(|layer| layer).await;
    s.problem_twice(
        "/big",
        "\"b\"",
        "j",
        StatusCode::INTERNAL_SERVER_ERROR,
        "response-too-large",
    )
    .await;
    assert_eq!(s.counter("j").await, 0);
    assert_eq!(
        s.keys().await,
        0,
        "the lease released: a retry runs again, no 409"
    );
}

#[tokio::test]
async fn an_optional_key_absent_runs_under_a_key_of_its_own() {
    let s = setup(|layer| layer.require_key(false)).await;
    for _ in 0..2 {
        let (status, headers, _) = s.send("/orders", None, "l").await;
        assert_eq!(status, StatusCode::CREATED);
        assert!(headers.get("idempotent-replayed").is_none());
    }
    assert_eq!(s.counter("l").await, 2, "no key: each request takes effect");
}

#[tokio::test]
async fn a_panicking_handler_writes_nothing_and_frees_the_key() {
    let s = setup(|layer| layer).await;
    s.problem_twice(
        "/panic",
        "\"p\"",
        "m",
        StatusCode::INTERNAL_SERVER_ERROR,
        "handler-panicked",
    )
    .await;
    assert_eq!(s.counter("m").await, 0);
    assert_eq!(s.keys().await, 0);
}

#[tokio::test]
async fn an_expired_key_counts_as_absent() {
    // A retention window of 0: every stored response expires at once (DynamoDB's TTL deletes
    // it later; the layer does not wait for that).
    let s = setup_with(Duration::ZERO, |layer| layer).await;
    for run in 1..=2 {
        let (status, headers, _) = s.send("/orders", Some("\"x\""), "o").await;
        assert_eq!(status, StatusCode::CREATED);
        assert!(headers.get("idempotent-replayed").is_none());
        assert_eq!(s.counter("o").await, run);
    }
    assert_eq!(s.keys().await, 1, "the expired item replaced in place");
}

#[tokio::test]
async fn a_transaction_dynamodb_refuses_is_a_500_not_an_unknown_outcome() {
    // Two actions on one item: DynamoDB refuses the request (`ValidationException`) before it
    // applies anything. That is no lost answer: the documented 500 `transaction-failed`, no
    // Retry-After (a retry is refused again), the lease released.
    let s = setup(|layer| layer).await;
    s.problem_twice(
        "/twice",
        "\"v\"",
        "q",
        StatusCode::INTERNAL_SERVER_ERROR,
        "transaction-failed",
    )
    .await;
    assert_eq!(s.counter("q").await, 0);
    assert_eq!(s.keys().await, 0, "the lease released");
    assert_eq!(
        s.calls(),
        6,
        "refused: PutItem, TransactWriteItems, DeleteItem; sent twice"
    );
}

#[tokio::test]
async fn a_handler_may_add_99_actions_and_no_more() {
    let s = setup(|layer| layer).await;
    let (status, _, _) = s.send("/many/99", Some("\"m99\""), "r").await;
    assert_eq!(status, StatusCode::CREATED);
    assert_eq!((s.counter("r-0").await, s.counter("r-98").await), (1, 1));
    s.problem_twice(
        "/many/100",
        "\"m100\"",
        "u",
        StatusCode::INTERNAL_SERVER_ERROR,
        "transaction-failed",
    )
    .await;
    assert_eq!((s.counter("u-0").await, s.counter("u-99").await), (0, 0));
    assert_eq!(s.keys().await, 1, "the 100 actions' lease released");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_retention_window_shorter_than_the_lease_keeps_the_lease() {
    // The lease (30 s) outlives the retention window (0 s): a concurrent duplicate still gets
    // its 409 while the first runs, and does not take the key over.
    let s = Arc::new(setup_with(Duration::ZERO, |layer| layer).await);
    let first = s.running("/slow", "\"w\"", "w").await;
    let (status, headers, body) = s.send("/slow", Some("\"w\""), "w").await;
    assert_eq!(
        status,
        StatusCode::CONFLICT,
        "{}",
        String::from_utf8_lossy(&body)
    );
    assert_eq!(headers.get("retry-after").unwrap(), "1");
    assert_eq!(s.counter("w").await, 0);
    s.app.release.notify_one();
    let (status, headers, _) = first.await.unwrap();
    assert_eq!(status, StatusCode::CREATED);
    assert!(headers.get("idempotent-replayed").is_none());
    assert_eq!(s.counter("w").await, 1);
}

#[tokio::test]
async fn the_admin_shows_an_http_key_with_its_stored_response() {
    // As the SQL admin's `show` (`StoredMessage::result`): the key's stored response.
    let s = setup(|layer| layer).await;
    let (status, _, body) = s.send("/orders", Some("\"r1\""), "y").await;
    assert_eq!(status, StatusCode::CREATED);
    let shown = s
        .inbox
        .admin()
        .show("http POST /orders", "r1")
        .await
        .unwrap()
        .unwrap();
    assert_eq!(shown.status.as_str(), "processed");
    let result = shown.result.expect("the stored response");
    assert!(result.starts_with(b"IKR1"));
    assert!(result.ends_with(&body), "the stored body at the end");
    let listed = s
        .inbox
        .admin()
        .list(None, &[inbox_runtime::Status::Processed], 10)
        .await
        .unwrap();
    assert_eq!(listed.len(), 1);
    assert_eq!(listed[0].result.as_deref(), Some(&result[..]));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_dropped_mid_handler_frees_its_key() {
    // The client goes away while the handler runs: hyper drops the service's future. Nothing
    // commits, and the key is free again (as the SQL layer's dropped transaction rolls back),
    // not held until the lease (30 s) ends.
    let s = Arc::new(setup(|layer| layer).await);
    let dropped = s.running("/slow", "\"d\"", "z").await;
    assert_eq!(s.keys().await, 1, "the lease");
    dropped.abort();
    assert!(dropped.await.unwrap_err().is_cancelled());
    // The release runs in a task of its own: wait for it (the bound only ends a failing run).
    let mut rounds = 0;
    while s.keys().await != 0 {
        rounds += 1;
        assert!(rounds < 500, "the dropped request's lease was not released");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(s.counter("z").await, 0);
    let (status, headers, _) = s.send("/slow", Some("\"d\""), "z").await;
    assert_eq!(status, StatusCode::CREATED, "the key is free: no 409");
    assert!(headers.get("idempotent-replayed").is_none());
    assert_eq!(s.counter("z").await, 1);
}

/// Loses the answer of the next `TransactWriteItems` that DynamoDB applied, once armed: the
/// client sees an error after the commit took effect.
#[derive(Debug, Clone, Default)]
struct LoseCommitAnswer {
    armed: Arc<AtomicBool>,
    /// A `TransactWriteItems` is on its way while armed.
    sending: Arc<AtomicBool>,
    /// Turn its answer into a 500 (which the SDK retries) instead of an error it does not.
    as_500: Arc<AtomicBool>,
}

impl LoseCommitAnswer {
    /// A client on moto with this interceptor.
    async fn client(&self) -> Client {
        let client = dynamodb::client(Some(&endpoint())).await;
        Client::from_conf(
            client
                .config()
                .to_builder()
                .interceptor(self.clone())
                .build(),
        )
    }
}

impl Intercept for LoseCommitAnswer {
    fn name(&self) -> &'static str {
        "LoseCommitAnswer"
    }

    fn read_before_execution(
        &self,
        context: &BeforeSerializationInterceptorContextRef<'_>,
        _: &mut ConfigBag,
    ) -> Result<(), BoxError> {
        if context
            .input()
            .downcast_ref::<TransactWriteItemsInput>()
            .is_some()
            && self.armed.swap(false, Ordering::SeqCst)
        {
            self.sending.store(true, Ordering::SeqCst);
        }
        Ok(())
    }

    fn modify_before_deserialization(
        &self,
        context: &mut BeforeDeserializationInterceptorContextMut<'_>,
        _: &RuntimeComponents,
        _: &mut ConfigBag,
    ) -> Result<(), BoxError> {
        if context.response().status().is_success() && self.sending.swap(false, Ordering::SeqCst) {
            if self.as_500.load(Ordering::SeqCst) {
                // An answer the SDK retries (under the same client request token).
                *context.response_mut().status_mut() = 500u16.try_into()?;
                return Ok(());
            }
            return Err("the answer was lost on the way back".into());
        }
        Ok(())
    }
}

#[tokio::test]
async fn a_commit_whose_answer_was_lost_is_503_then_replayed_not_run_again() {
    let lose = LoseCommitAnswer::default();
    let client = lose.client().await;
    let s = setup_on(client, Duration::from_secs(86_400), |layer| {
        layer.retry_after(Duration::from_secs(2))
    })
    .await;
    lose.armed.store(true, Ordering::SeqCst);
    let (status, headers, body) = s.send("/orders", Some("\"lost\""), "lost").await;
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(headers.get("retry-after").unwrap(), "2");
    assert_eq!(problem_type(&body), "outcome-unknown");
    assert!(!lose.sending.load(Ordering::SeqCst), "the answer was lost");
    assert_eq!(s.counter("lost").await, 1, "it committed");
    assert_eq!(
        s.calls(),
        3,
        "PutItem, TransactWriteItems, DeleteItem (refused: the key is processed)"
    );
    let (status, headers, _) = s.send("/orders", Some("\"lost\""), "lost").await;
    assert_eq!(
        status,
        StatusCode::CREATED,
        "the retry learns it took effect"
    );
    assert_eq!(headers.get("idempotent-replayed").unwrap(), "true");
    assert_eq!(s.counter("lost").await, 1, "applied once");
    assert_eq!(s.keys().await, 1);
}

#[tokio::test]
async fn a_commit_resent_by_the_sdk_after_a_lost_answer_applies_once() {
    // The SDK resends a commit whose answer was a 500 (it had applied) under the same client
    // request token: DynamoDB answers the resend without applying it again (moto, which keeps
    // no tokens, cancels it on the lease's condition: the request answers with the stored
    // response). Either way: the handler's response, applied once.
    let lose = LoseCommitAnswer::default();
    lose.as_500.store(true, Ordering::SeqCst);
    let client = lose.client().await;
    let s = setup_on(client, Duration::from_secs(86_400), |layer| layer).await;
    lose.armed.store(true, Ordering::SeqCst);
    let (status, _, first) = s.send("/orders", Some("\"resent\""), "resent").await;
    assert!(!lose.sending.load(Ordering::SeqCst), "the answer was lost");
    assert_eq!(status, StatusCode::CREATED);
    assert_eq!(s.counter("resent").await, 1);
    let (status, headers, again) = s.send("/orders", Some("\"resent\""), "resent").await;
    assert_eq!(status, StatusCode::CREATED);
    assert_eq!(headers.get("idempotent-replayed").unwrap(), "true");
    assert_eq!(again, first, "the first answer was the stored response");
    assert_eq!(s.counter("resent").await, 1, "applied once");
}

#[tokio::test]
async fn a_scope_and_key_too_long_for_a_partition_key_are_refused_before_any_call() {
    // A principal of 2,100 bytes: the scope and key make a partition key above DynamoDB's
    // 2048 bytes. The documented 500 `transaction-failed`, nothing called or written.
    let s = setup(|layer| layer.principal(|_| Some("é".repeat(1_050)))).await;
    s.problem_twice(
        "/orders",
        "\"long\"",
        "pk",
        StatusCode::INTERNAL_SERVER_ERROR,
        "transaction-failed",
    )
    .await;
    assert_eq!(s.calls(), 0);
    assert_eq!(s.counter("pk").await, 0);
    assert_eq!(s.keys().await, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lease_taken_over_and_released_by_a_failing_duplicate_commits_nothing() {
    // Every lease ends at once: the duplicate takes the key over, fails (500, not stored) and
    // releases it; the first, still running, then finds no lease of its own: nothing commits,
    // and it answers 409 (a retry runs again).
    let s = Arc::new(setup(|layer| layer.lease(Duration::ZERO)).await);
    let first = s.running("/flaky", "\"f\"", "fl").await;
    let (status, _, body) = s.send("/flaky", Some("\"f\""), "fl").await;
    assert_eq!(status, StatusCode::INTERNAL_SERVER_ERROR);
    assert_eq!(body, b"later calls fail");
    assert_eq!(s.keys().await, 0, "the duplicate released the key");
    s.app.release.notify_one();
    let (status, headers, body) = first.await.unwrap();
    assert_eq!(status, StatusCode::CONFLICT);
    assert!(headers.get("retry-after").is_some());
    assert_eq!(problem_type(&body), "idempotency-key-in-use");
    assert_eq!(s.counter("fl").await, 0, "nothing committed");
    assert_eq!(s.keys().await, 0);
}
