//! The HTTP `Idempotency-Key` layer against a real axum server on loopback (127.0.0.1, an
//! ephemeral port) and a real HTTP client (reqwest), on PostgreSQL and SQLite: 50 concurrent
//! requests with one key take effect once; the same key with another body is a 422; another
//! principal's key is another key; bad keys and bodies are refused with their documented status
//! and write nothing; a handler error or panic stores nothing and a retry runs again; stored
//! responses go with the inbox's retention purge; transaction hooks commit with the request, with
//! a key or without.

#![allow(missing_docs)]

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use reqwest::header::{HeaderMap, HeaderValue};
use serde::Deserialize;

/// The request body of `POST /pay`.
#[derive(Debug, Clone, Deserialize, serde::Serialize)]
struct Pay {
    account: String,
    amount: i64,
    /// Wait for the test's gate before answering (holds the claim open).
    #[serde(default)]
    gate: bool,
    /// `"500"`: answer 500 after writing; `"panic"`: panic after writing; `"409"`: answer 409
    /// after writing.
    #[serde(default)]
    fail: Option<String>,
}

/// An order the billing consumer charges through the HTTP API (its `#[idempotent]` handler's
/// external call).
#[derive(Debug, Clone, Deserialize, serde::Serialize, inbox_runtime::Message)]
#[message(name = "orders.placed")]
struct OrderPlaced {
    #[message(key)]
    order_id: String,
    amount: i64,
}

/// Why the billing handler failed.
#[derive(Debug, thiserror::Error)]
enum BillError {
    #[error("the API call failed: {0}")]
    Call(#[from] reqwest::Error),
    #[error("the API answered {0}")]
    Status(u16),
    #[error("failed after the API call (as a crash before COMMIT would)")]
    AfterCall,
    #[error(transparent)]
    Database(#[from] sqlx::Error),
}

/// What the handlers share with the test: how often each ran, and the gate.
#[derive(Clone)]
struct AppState {
    runs: Arc<AtomicUsize>,
    gate: tokio::sync::watch::Receiver<bool>,
}

/// A response as the client saw it.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Seen {
    status: u16,
    replayed: bool,
    content_type: String,
    body: Vec<u8>,
}

impl Seen {
    fn json(&self) -> serde_json::Value {
        serde_json::from_slice(&self.body).expect("a JSON body")
    }
}

async fn send(request: reqwest::RequestBuilder) -> Seen {
    let response = request.send().await.expect("the server answers");
    let status = response.status().as_u16();
    let replayed = response
        .headers()
        .get("idempotent-replayed")
        .is_some_and(|v| v == "true");
    let content_type = response
        .headers()
        .get("content-type")
        .map(|v| v.to_str().unwrap().to_owned())
        .unwrap_or_default();
    let body = response.bytes().await.expect("a body").to_vec();
    Seen {
        status,
        replayed,
        content_type,
        body,
    }
}

/// `Idempotency-Key: "<key>"`, as an sf-string.
fn quoted(key: &str) -> HeaderValue {
    HeaderValue::from_str(&format!("\"{key}\"")).unwrap()
}

fn pay_body(account: &str, amount: i64) -> String {
    serde_json::json!({"account": account, "amount": amount}).to_string()
}

/// Asserts a problem response: status, `application/problem+json`, and the `type` slug.
fn assert_problem(seen: &Seen, status: u16, slug: &str) {
    assert_eq!(seen.status, status, "{seen:?}");
    assert_eq!(seen.content_type, "application/problem+json", "{seen:?}");
    let problem = seen.json();
    assert!(
        problem["type"].as_str().unwrap().ends_with(slug),
        "{problem}"
    );
    assert_eq!(problem["status"], status);
    assert!(!problem["title"].as_str().unwrap().is_empty());
    assert!(!problem["detail"].as_str().unwrap().is_empty());
    assert!(!seen.replayed);
}

inbox_tests::backend_matrix! {
    connections(postgres = 8, sqlite = 4);

    use std::time::Duration;

    use axum::extract::State;
    use axum::http::{StatusCode, header};
    use axum::response::IntoResponse;
    use axum::routing::{get, post};
    use axum::{Json, Router};
    use futures_util::StreamExt as _;
    use inbox_runtime::types::StepKey;
    use inbox_runtime::ops::admin::{self, Retention};
    use inbox_runtime::http::{IdempotencyLayer, IdempotencyTx};
    use inbox_tests::{count, effect, effects};

    /// `POST /pay`: applies the effect (account, amount) on the request's transaction, then
    /// answers 201 with a fresh random id (so a replay is recognisable by its bytes), a
    /// `Location` and a `Set-Cookie`; or fails as the body asks.
    async fn pay(
        State(state): State<AppState>,
        mut tx: IdempotencyTx<Db>,
        Json(body): Json<Pay>,
    ) -> axum::response::Response {
        state.runs.fetch_add(1, Ordering::SeqCst);
        sqlx::query(APPLY_EFFECT)
            .bind(&body.account)
            .bind(body.amount)
            .execute(&mut *tx)
            .await
            .expect("the effect");
        if body.gate {
            let mut gate = state.gate.clone();
            gate.wait_for(|open| *open).await.expect("the gate");
        }
        match body.fail.as_deref() {
            Some("500") => return (StatusCode::INTERNAL_SERVER_ERROR, "payment provider down").into_response(),
            Some("409") => return (StatusCode::CONFLICT, "try later").into_response(),
            Some("panic") => panic!("the handler panics after its write"),
            _ => {}
        }
        let id = uuid::Uuid::new_v4().to_string();
        let step = StepKey::current("charge").map(|k| k.to_string());
        assert_eq!(step, tx.step_key("charge").map(|k| k.to_string()));
        (
            StatusCode::CREATED,
            [
                (header::LOCATION, format!("/pay/{id}")),
                (header::SET_COOKIE, "session=abc".to_owned()),
            ],
            Json(serde_json::json!({
                "id": id,
                "account": body.account,
                "amount": body.amount,
                "scope": tx.scope(),
                "step": step,
            })),
        )
            .into_response()
    }

    /// `GET /pay`: not covered by the layer (GET is not one of its methods).
    async fn list(State(state): State<AppState>) -> String {
        format!("runs={}", state.runs.load(Ordering::SeqCst))
    }

    struct Server {
        base: String,
        client: reqwest::Client,
        runs: Arc<AtomicUsize>,
        open_gate: tokio::sync::watch::Sender<bool>,
        task: tokio::task::JoinHandle<()>,
    }

    impl Drop for Server {
        fn drop(&mut self) {
            self.task.abort();
        }
    }

    impl Server {
        fn post(&self, key: Option<HeaderValue>, user: Option<&str>, body: String) -> reqwest::RequestBuilder {
            let mut headers = HeaderMap::new();
            headers.insert("content-type", HeaderValue::from_static("application/json"));
            if let Some(key) = key {
                headers.insert("idempotency-key", key);
            }
            if let Some(user) = user {
                headers.insert("x-user", HeaderValue::from_str(user).unwrap());
            }
            self.client.post(format!("{}/pay", self.base)).headers(headers).body(body)
        }

        fn runs(&self) -> usize {
            self.runs.load(Ordering::SeqCst)
        }
    }

    /// The app behind `layer` (configured by `configure`), served on 127.0.0.1 port 0.
    async fn serve(pool: &Pool, configure: impl FnOnce(IdempotencyLayer<Db>) -> IdempotencyLayer<Db>) -> Server {
        let (open_gate, gate) = tokio::sync::watch::channel(false);
        let runs = Arc::new(AtomicUsize::new(0));
        let layer = configure(
            IdempotencyLayer::new(pool.clone())
                .principal(|parts| {
                    parts
                        .headers
                        .get("x-user")
                        .and_then(|v| v.to_str().ok())
                        .map(str::to_owned)
                }),
        );
        let app = Router::new()
            .route("/pay", post(pay).get(list))
            .route_layer(layer)
            .with_state(AppState { runs: runs.clone(), gate });
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr: SocketAddr = listener.local_addr().unwrap();
        let task = tokio::spawn(async move {
            axum::serve(listener, app).await.unwrap();
        });
        Server {
            base: format!("http://{addr}"),
            client: reqwest::Client::new(),
            runs,
            open_gate,
            task,
        }
    }

    /// Where the billing handler sends its charges, whether its next run fails after the call,
    /// and the step keys it sent.
    static API: std::sync::OnceLock<String> = std::sync::OnceLock::new();
    static FAIL_AFTER_CALL: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);
    static SENT: std::sync::Mutex<Vec<(String, u16, bool)>> = std::sync::Mutex::new(Vec::new());

    /// Charges the order through `POST /pay` with the step key of this run, then records it.
    #[inbox_runtime::idempotent(consumer = "billing")]
    async fn bill(conn: &mut Conn, msg: OrderPlaced) -> Result<Vec<u8>, BillError> {
        let key = StepKey::current("charge").expect("inside a handler").to_string();
        let response = reqwest::Client::new()
            .post(format!("{}/pay", API.get().unwrap()))
            .header("idempotency-key", format!("\"{key}\""))
            .header("content-type", "application/json")
            .body(pay_body(&msg.order_id, msg.amount))
            .send()
            .await?;
        let status = response.status().as_u16();
        let replayed = response.headers().contains_key("idempotent-replayed");
        SENT.lock().unwrap().push((key, status, replayed));
        let body = response.bytes().await?.to_vec();
        if status != 201 {
            return Err(BillError::Status(status));
        }
        if FAIL_AFTER_CALL.swap(false, Ordering::SeqCst) {
            return Err(BillError::AfterCall);
        }
        sqlx::query(APPLY_EFFECT)
            .bind(format!("billed:{}", msg.order_id))
            .bind(msg.amount)
            .execute(&mut *conn)
            .await?;
        Ok(body)
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_step_key_makes_a_handlers_external_call_take_effect_once() {
        // The API and the consumer have databases of their own (on SQLite, one database would
        // make the API wait for the consumer's write lock, held across the call).
        let (api_pool, _api_guard) = fixture().await;
        let (pool, _guard) = fixture().await;
        let server = serve(&api_pool, |layer| layer).await;
        API.set(server.base.clone()).unwrap();
        let order = OrderPlaced { order_id: "order-7".into(), amount: 1500 };
        let expected_key = StepKey::new("billing", "order-7", "charge").to_string();
        let mut conn = pool.acquire().await.unwrap();

        // The first run calls the API (a payment is made), then fails: its transaction rolls
        // back, and the message is delivered again.
        FAIL_AFTER_CALL.store(true, Ordering::SeqCst);
        let failed = bill(&mut conn, order.clone()).await;
        assert!(matches!(failed, Err(inbox_runtime::Error::Handler(_))), "{failed:?}");
        assert_eq!(effect(&api_pool, "order-7").await, Some((1, 1500)));
        assert_eq!(effect(&pool, "billed:order-7").await, None);

        // The redelivery (once the failed key is due) calls again with the same key: the API
        // replays its payment.
        assert_eq!(inbox_tests::make_due(&pool).await, 1);
        let processed = bill(&mut conn, order.clone()).await.unwrap();
        let inbox_runtime::Outcome::Processed(body) = processed else {
            panic!("expected processed, got {processed:?}");
        };
        let body: serde_json::Value = serde_json::from_slice(&body).unwrap();
        assert_eq!(body["scope"], "http POST /pay");
        assert_eq!(effect(&api_pool, "order-7").await, Some((1, 1500)));
        assert_eq!(effect(&pool, "billed:order-7").await, Some((1, 1500)));

        // Another redelivery is a duplicate in the consumer's inbox: no call at all.
        assert!(bill(&mut conn, order).await.unwrap().is_duplicate());
        assert_eq!(
            *SENT.lock().unwrap(),
            vec![(expected_key.clone(), 201, false), (expected_key, 201, true)]
        );
        assert_eq!(server.runs(), 1);
    }

    async fn inbox_rows(pool: &Pool) -> i64 {
        count(pool, "SELECT COUNT(*) FROM inbox_messages").await
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn fifty_concurrent_requests_with_one_key_take_effect_once() {
        let (pool, _guard) = fixture().await;
        let server = serve(&pool, |layer| layer).await;
        let body = serde_json::json!({"account": "acc-50", "amount": 700, "gate": true}).to_string();

        // 50 requests with one key and one body at once. The first to claim the key waits in
        // its handler at the gate, holding the claim open; the gate opens when the first other
        // answer has arrived (which can then only be a 409).
        let mut pending = futures_util::stream::FuturesUnordered::new();
        for _ in 0..50 {
            pending.push(send(server.post(Some(quoted("one-key")), Some("alice"), body.clone())));
        }
        let mut seen = Vec::new();
        while let Some(answer) = pending.next().await {
            if seen.is_empty() {
                assert_problem(&answer, 409, "idempotency-key-in-use");
                server.open_gate.send(true).unwrap();
            }
            seen.push(answer);
        }
        assert_eq!(seen.len(), 50);

        // The effect exactly once; the handler ran once.
        assert_eq!(effect(&pool, "acc-50").await, Some((1, 700)));
        assert_eq!(server.runs(), 1);

        // Exactly one original; every other answer is that original replayed byte for byte,
        // or a 409 with Retry-After.
        let originals: Vec<&Seen> = seen.iter().filter(|s| s.status == 201 && !s.replayed).collect();
        assert_eq!(originals.len(), 1, "{seen:?}");
        let original = originals[0].clone();
        let mut replays = 0;
        let mut in_flight = 0;
        for answer in &seen {
            match answer.status {
                201 if answer.replayed => {
                    assert_eq!(answer.body, original.body);
                    assert_eq!(answer.content_type, "application/json");
                    replays += 1;
                }
                201 => {}
                409 => {
                    assert_problem(answer, 409, "idempotency-key-in-use");
                    in_flight += 1;
                }
                other => panic!("unexpected status {other}: {answer:?}"),
            }
        }
        assert_eq!(1 + replays + in_flight, 50);
        assert!(in_flight >= 1);
        eprintln!("{BACKEND}: 1 original, {replays} replays, {in_flight} in flight");

        // Afterwards the same request is a replay, with the stored headers (Location, not
        // Set-Cookie) and the step key derived from the request's scope and key.
        let response = server
            .post(Some(quoted("one-key")), Some("alice"), body.clone())
            .send()
            .await
            .unwrap();
        assert_eq!(response.status(), 201);
        assert_eq!(response.headers()["idempotent-replayed"], "true");
        assert!(response.headers().get("location").is_some());
        assert!(response.headers().get("set-cookie").is_none());
        let replay = response.bytes().await.unwrap();
        assert_eq!(&replay[..], &original.body[..]);
        let json = original.json();
        assert_eq!(json["scope"], "http POST /pay alice");
        assert_eq!(
            json["step"],
            StepKey::new("http POST /pay alice", "one-key", "charge").to_string()
        );
        assert_eq!(server.runs(), 1);
        assert_eq!(inbox_rows(&pool).await, 1);

        // Once settled, concurrent repeats are all replays: none is told "in progress".
        let mut pending = futures_util::stream::FuturesUnordered::new();
        for _ in 0..20 {
            pending.push(send(server.post(Some(quoted("one-key")), Some("alice"), body.clone())));
        }
        while let Some(answer) = pending.next().await {
            assert_eq!((answer.status, answer.replayed), (201, true), "{answer:?}");
            assert_eq!(answer.body, original.body);
        }
        assert_eq!(server.runs(), 1);
    }

    #[tokio::test]
    async fn another_body_is_a_mismatch_and_another_principal_another_key() {
        let (pool, _guard) = fixture().await;
        let server = serve(&pool, |layer| layer).await;

        let first = send(server.post(Some(quoted("k-1")), Some("alice"), pay_body("acc-1", 100))).await;
        assert_eq!((first.status, first.replayed), (201, false));

        // The same JSON in another member order and spacing: the same request, replayed.
        let reordered = "{ \"amount\": 100,\n  \"account\": \"acc-1\" }".to_owned();
        let again = send(server.post(Some(quoted("k-1")), Some("alice"), reordered)).await;
        assert_eq!((again.status, again.replayed), (201, true));
        assert_eq!(again.body, first.body);

        // The same key with another body: 422, and nothing runs.
        let other = send(server.post(Some(quoted("k-1")), Some("alice"), pay_body("acc-1", 999))).await;
        assert_problem(&other, 422, "idempotency-key-reused");
        assert_eq!(effect(&pool, "acc-1").await, Some((1, 100)));

        // The same key and body from another principal (and from no principal): other keys.
        let bob = send(server.post(Some(quoted("k-1")), Some("bob"), pay_body("acc-1", 100))).await;
        assert_eq!((bob.status, bob.replayed), (201, false));
        assert_ne!(bob.body, first.body);
        let anonymous = send(server.post(Some(quoted("k-1")), None, pay_body("acc-1", 100))).await;
        assert_eq!((anonymous.status, anonymous.replayed), (201, false));
        assert_eq!(anonymous.json()["scope"], "http POST /pay");
        assert_eq!(effect(&pool, "acc-1").await, Some((3, 300)));
        assert_eq!(server.runs(), 3);

        // Each is replayed to its own principal.
        let bob_again = send(server.post(Some(quoted("k-1")), Some("bob"), pay_body("acc-1", 100))).await;
        assert_eq!((bob_again.status, bob_again.replayed, &bob_again.body), (201, true, &bob.body));
        assert_eq!(inbox_rows(&pool).await, 3);

        // A method the layer does not cover passes through, key or not.
        let listed = server
            .client
            .get(format!("{}/pay", server.base))
            .header("idempotency-key", "not even an sf-string")
            .send()
            .await
            .unwrap();
        assert_eq!(listed.status(), 200);
        assert_eq!(listed.text().await.unwrap(), "runs=3");
    }

    #[tokio::test]
    async fn bad_keys_and_bodies_are_refused_and_write_nothing() {
        let (pool, _guard) = fixture().await;
        let server = serve(&pool, |layer| layer).await;
        let body = || pay_body("acc-bad", 5);

        let missing = send(server.post(None, Some("alice"), body())).await;
        assert_problem(&missing, 400, "idempotency-key-missing");

        let empty = send(server.post(Some(quoted("")), Some("alice"), body())).await;
        assert_problem(&empty, 400, "idempotency-key-malformed");

        let blank = send(server.post(Some(quoted("   ")), Some("alice"), body())).await;
        assert_problem(&blank, 400, "idempotency-key-malformed");

        let long = send(server.post(Some(quoted(&"k".repeat(10 * 1024))), Some("alice"), body())).await;
        assert_problem(&long, 400, "idempotency-key-too-long");
        assert!(long.json()["detail"].as_str().unwrap().contains("10240"));

        let non_ascii = HeaderValue::from_bytes("\"café-1\"".as_bytes()).unwrap();
        let non_ascii = send(server.post(Some(non_ascii), Some("alice"), body())).await;
        assert_problem(&non_ascii, 400, "idempotency-key-malformed");

        for invalid in [
            "bare-token",          // a token, not a string (unquoted)
            "\"unterminated",      // no closing quote
            "\"a\", \"b\"",        // a list, not an item
            "42",                  // an integer
            "\"bad \\x escape\"",  // only \" and \\ may be escaped
            "?1",                  // a boolean
        ] {
            let seen = send(server.post(Some(HeaderValue::from_static(invalid)), Some("alice"), body())).await;
            assert_problem(&seen, 400, "idempotency-key-malformed");
        }

        // Two Idempotency-Key fields.
        let mut twice = server.post(None, Some("alice"), body()).build().unwrap();
        twice.headers_mut().append("idempotency-key", quoted("a"));
        twice.headers_mut().append("idempotency-key", quoted("a"));
        let twice = send(reqwest::RequestBuilder::from_parts(server.client.clone(), twice)).await;
        assert_problem(&twice, 400, "idempotency-key-malformed");

        // A 50 MB body: refused from its Content-Length, before it is read.
        let huge = vec![b' '; 50 * 1024 * 1024];
        let huge = send(server.post(Some(quoted("huge")), Some("alice"), String::from_utf8(huge).unwrap())).await;
        assert_problem(&huge, 413, "request-body-too-large");

        // A body declared JSON that is not JSON.
        let not_json = send(server.post(Some(quoted("not-json")), Some("alice"), "account=acc&amount=5".into())).await;
        assert_problem(&not_json, 400, "request-body-invalid");

        // A body declared JSON that is not Unicode text: an unpaired surrogate, even in a member
        // the handler never reads.
        let text = r#"{"account":"acc-bad","amount":5,"note":"\udc00"}"#;
        let surrogate = send(server.post(Some(quoted("surrogate")), Some("alice"), text.into())).await;
        assert_problem(&surrogate, 400, "request-body-invalid");
        assert_eq!(
            surrogate.json()["detail"],
            "the body is declared JSON (Content-Type) but is not Unicode text: line 1, column 41: \
             invalid Unicode: the escape `\\udc00` is an unpaired surrogate"
        );

        // Nothing ran, nothing was written.
        assert_eq!(server.runs(), 0);
        assert!(effects(&pool).await.is_empty());
        assert_eq!(inbox_rows(&pool).await, 0);

        // The same keys, well formed, now work.
        let ok = send(server.post(Some(quoted("not-json")), Some("alice"), body())).await;
        assert_eq!(ok.status, 201);
        assert_eq!(effect(&pool, "acc-bad").await, Some((1, 5)));
    }

    #[tokio::test]
    async fn a_handler_error_stores_nothing_and_a_retry_runs_again() {
        let (pool, _guard) = fixture().await;
        let server = serve(&pool, |layer| layer).await;
        let failing = |fail: &str| {
            serde_json::json!({"account": "acc-f", "amount": 10, "fail": fail}).to_string()
        };

        // A 500 after the handler's write: rolled back, not stored; the retry runs again.
        for attempt in 1..=2 {
            let seen = send(server.post(Some(quoted("f-500")), None, failing("500"))).await;
            assert_eq!((seen.status, seen.replayed), (500, false));
            assert_eq!(seen.body, b"payment provider down");
            assert_eq!(server.runs(), attempt);
        }
        // A 409 from the handler itself: not stored either.
        let seen = send(server.post(Some(quoted("f-409")), None, failing("409"))).await;
        assert_eq!((seen.status, seen.body.as_slice()), (409, &b"try later"[..]));
        // A panic after the write: 500 problem, rolled back.
        let seen = send(server.post(Some(quoted("f-panic")), None, failing("panic"))).await;
        assert_problem(&seen, 500, "handler-panicked");
        assert_eq!(server.runs(), 4);
        assert_eq!(effect(&pool, "acc-f").await, None);
        assert_eq!(inbox_rows(&pool).await, 0);

        // The keys are free: the next request with each runs and is stored.
        for key in ["f-500", "f-409", "f-panic"] {
            let seen = send(server.post(Some(quoted(key)), None, pay_body("acc-f", 10))).await;
            assert_eq!((seen.status, seen.replayed), (201, false), "{key}");
        }
        assert_eq!(effect(&pool, "acc-f").await, Some((3, 30)));
        assert_eq!(inbox_rows(&pool).await, 3);
        // The connection pool is intact after the panic: every connection came back usable.
        for _ in 0..CONNECTIONS * 2 {
            let seen = send(server.post(Some(quoted("f-500")), None, pay_body("acc-f", 10))).await;
            assert_eq!((seen.status, seen.replayed), (201, true));
        }
    }

    #[tokio::test]
    async fn optional_keys_run_in_a_plain_transaction() {
        let (pool, _guard) = fixture().await;
        let server = serve(&pool, |layer| layer.require_key(false)).await;

        let ok = send(server.post(None, None, pay_body("acc-o", 1))).await;
        assert_eq!((ok.status, ok.replayed), (201, false));
        assert_eq!(ok.json()["step"], serde_json::Value::Null);
        let failed = send(server.post(
            None,
            None,
            serde_json::json!({"account": "acc-o", "amount": 1, "fail": "500"}).to_string(),
        ))
        .await;
        assert_eq!(failed.status, 500);
        // The success committed, the failure rolled back; no key was stored for either.
        assert_eq!(effect(&pool, "acc-o").await, Some((1, 1)));
        assert_eq!(inbox_rows(&pool).await, 0);
        // A key, where optional, is still honoured.
        let keyed = send(server.post(Some(quoted("o-1")), None, pay_body("acc-o", 1))).await;
        let again = send(server.post(Some(quoted("o-1")), None, pay_body("acc-o", 1))).await;
        assert_eq!((again.status, again.replayed, &again.body), (201, true, &keyed.body));
        assert_eq!(effect(&pool, "acc-o").await, Some((2, 2)));
    }

    /// A hook that applies the effect `hook:<scope>:<key>` on the request's transaction (the
    /// key empty without one), or fails when told to, and counts its after-commit calls.
    struct Audit {
        fail: Arc<std::sync::atomic::AtomicBool>,
        after: Arc<AtomicUsize>,
    }

    impl inbox_runtime::TransactionHook<Db> for Audit {
        fn before_commit<'c>(
            &'c self,
            conn: &'c mut Conn,
            claim: &'c inbox_runtime::ClaimInfo<'c>,
        ) -> inbox_runtime::BoxFuture<'c, Result<(), inbox_runtime::BoxError>> {
            Box::pin(async move {
                if self.fail.load(Ordering::SeqCst) {
                    return Err("the audit hook fails".into());
                }
                assert_eq!(claim.message_name, "POST /pay");
                sqlx::query(APPLY_EFFECT)
                    .bind(format!("hook:{}:{}", claim.consumer, claim.key))
                    .bind(1_i64)
                    .execute(&mut *conn)
                    .await?;
                Ok(())
            })
        }

        fn after_commit(&self, _claim: &inbox_runtime::ClaimInfo<'_>) {
            self.after.fetch_add(1, Ordering::SeqCst);
        }
    }

    #[tokio::test]
    async fn hooks_commit_with_the_request_with_or_without_a_key() {
        let (pool, _guard) = fixture().await;
        let fail = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let after = Arc::new(AtomicUsize::new(0));
        let audit = Audit { fail: fail.clone(), after: after.clone() };
        let server = serve(&pool, |layer| layer.require_key(false).with_hook(audit)).await;
        let hooked = |key: &str| format!("hook:http POST /pay:{key}");

        // A claimed request: the hook's write commits with the handler's, the key and the
        // response; its replay runs no hook.
        let first = send(server.post(Some(quoted("h-1")), None, pay_body("acc-h", 5))).await;
        assert_eq!((first.status, first.replayed), (201, false));
        let again = send(server.post(Some(quoted("h-1")), None, pay_body("acc-h", 5))).await;
        assert_eq!((again.status, again.replayed, &again.body), (201, true, &first.body));
        assert_eq!(effect(&pool, &hooked("h-1")).await, Some((1, 1)));
        // A request without a key: the hook runs in its plain transaction, with an empty key.
        let plain = send(server.post(None, None, pay_body("acc-h", 5))).await;
        assert_eq!(plain.status, 201);
        assert_eq!(effect(&pool, &hooked("")).await, Some((1, 1)));
        // A response the layer does not store runs no hook: rolled back.
        let not_stored = send(server.post(
            Some(quoted("h-2")),
            None,
            serde_json::json!({"account": "acc-h", "amount": 5, "fail": "500"}).to_string(),
        ))
        .await;
        assert_eq!(not_stored.status, 500);
        assert_eq!(effect(&pool, &hooked("h-2")).await, None);
        assert_eq!(effect(&pool, "acc-h").await, Some((2, 10)));
        assert_eq!(after.load(Ordering::SeqCst), 2);

        // A failing hook rolls everything back (500), with a key or without; the key stays free.
        fail.store(true, Ordering::SeqCst);
        let failed = send(server.post(Some(quoted("h-3")), None, pay_body("acc-h", 5))).await;
        assert_problem(&failed, 500, "transaction-failed");
        let failed_plain = send(server.post(None, None, pay_body("acc-h", 5))).await;
        assert_problem(&failed_plain, 500, "transaction-failed");
        assert_eq!(effect(&pool, "acc-h").await, Some((2, 10)));
        assert_eq!(after.load(Ordering::SeqCst), 2);
        fail.store(false, Ordering::SeqCst);
        let retried = send(server.post(Some(quoted("h-3")), None, pay_body("acc-h", 5))).await;
        assert_eq!((retried.status, retried.replayed), (201, false));
        assert_eq!(effect(&pool, &hooked("h-3")).await, Some((1, 1)));
        assert_eq!(effect(&pool, "acc-h").await, Some((3, 15)));
        assert_eq!(after.load(Ordering::SeqCst), 3);
        // Keys h-1 and h-3 stored; the handler ran for every request but the replay.
        assert_eq!(inbox_rows(&pool).await, 2);
        assert_eq!(server.runs(), 6);
    }

    #[tokio::test]
    async fn stored_responses_go_with_the_retention_purge() {
        let (pool, _guard) = fixture().await;
        let server = serve(&pool, |layer| layer).await;

        let first = send(server.post(Some(quoted("r-1")), Some("alice"), pay_body("acc-r", 7))).await;
        assert_eq!(first.status, 201);
        let row = admin::show(&pool, "http POST /pay alice", "r-1").await.unwrap().unwrap();
        assert_eq!(row.status, inbox_runtime::Status::Processed);
        assert_eq!(row.message_name, "POST /pay");

        // Settled three days ago; a purge with a two-day window takes it, and keeps a fresh one.
        let age = if BACKEND == Backend::Postgres {
            "UPDATE inbox_messages SET processed_at = now() - interval '3 days', \
             received_at = now() - interval '3 days' WHERE message_key = 'r-1'"
        } else if BACKEND == Backend::MySql {
            "UPDATE inbox_messages SET processed_at = UTC_TIMESTAMP(6) - INTERVAL 3 DAY, \
             received_at = UTC_TIMESTAMP(6) - INTERVAL 3 DAY WHERE message_key = 'r-1'"
        } else {
            "UPDATE inbox_messages SET \
             processed_at = strftime('%Y-%m-%dT%H:%M:%fZ', 'now', '-3 days'), \
             received_at = strftime('%Y-%m-%dT%H:%M:%fZ', 'now', '-3 days') \
             WHERE message_key = 'r-1'"
        };
        sqlx::query(age).execute(&pool).await.unwrap();
        let fresh = send(server.post(Some(quoted("r-2")), Some("alice"), pay_body("acc-r", 7))).await;
        assert_eq!(fresh.status, 201);
        let retention = Retention::new(Duration::from_secs(2 * 86_400), Duration::from_secs(3600)).unwrap();
        let report = admin::purge(&pool, &retention, |_| {}).await.unwrap();
        assert_eq!(report.deleted, 1);
        assert_eq!(inbox_rows(&pool).await, 1);
        let kept = send(server.post(Some(quoted("r-2")), Some("alice"), pay_body("acc-r", 7))).await;
        assert_eq!((kept.status, kept.replayed, &kept.body), (201, true, &fresh.body));

        // After the window, the key is new again: the handler runs.
        let again = send(server.post(Some(quoted("r-1")), Some("alice"), pay_body("acc-r", 7))).await;
        assert_eq!((again.status, again.replayed), (201, false));
        assert_ne!(again.body, first.body);
        assert_eq!(effect(&pool, "acc-r").await, Some((3, 21)));
    }
}
