//! The operator console (feature `console`), its router driven in process on both backends:
//! the overview's counts equal `admin::stats`, a dead message replayed from the page is applied
//! once, one discarded, requests the hook refuses get 401/403, forged actions are refused, bad
//! input gets a 4xx that says why and changes nothing, and keys and payloads are HTML-escaped.

#![allow(missing_docs)]

use std::sync::Mutex;

use axum::body::Body;
use axum::http::{Request, StatusCode};
use inbox_runtime::{Classify, ErrorClass, Message};
use serde::{Deserialize, Serialize};
use tower::ServiceExt as _;

#[derive(Debug, Clone, Serialize, Deserialize, Message)]
#[message(name = "console.task")]
pub struct Task {
    #[message(key)]
    pub id: String,
    pub amount: i64,
    pub note: String,
}

/// Task ids (`backend:id`) whose handler fails, and how (`true`: permanently).
static BROKEN: Mutex<Vec<(String, bool)>> = Mutex::new(Vec::new());

fn break_task(id: &str, permanent: bool) {
    BROKEN.lock().unwrap().push((id.to_owned(), permanent));
}

fn fix_task(id: &str) {
    BROKEN.lock().unwrap().retain(|(other, _)| other != id);
}

fn broken(id: &str) -> Option<bool> {
    BROKEN
        .lock()
        .unwrap()
        .iter()
        .find(|(other, _)| other == id)
        .map(|(_, permanent)| *permanent)
}

#[derive(Debug, thiserror::Error)]
pub enum TaskError {
    #[error("task {0} is broken for good")]
    Broken(String),
    #[error("task {0} hit a flaky dependency")]
    Flaky(String),
    #[error(transparent)]
    Db(#[from] sqlx::Error),
}

impl Classify for TaskError {
    fn class(&self) -> ErrorClass {
        match self {
            TaskError::Broken(_) => ErrorClass::Permanent,
            TaskError::Flaky(_) => ErrorClass::Retryable,
            TaskError::Db(error) => error.class(),
        }
    }
}

/// The HTML-injection key: quotes, angle brackets, an ampersand, unicode.
const EVIL: &str = "evil-<b>\"x'&</b>-✓";

/// The text of the first `data-…` cell whose attributes start with `marker`, tags removed.
fn cell(html: &str, marker: &str) -> String {
    let at = html
        .find(marker)
        .unwrap_or_else(|| panic!("no cell {marker} in {html}"));
    let rest = &html[at + marker.len()..];
    let rest = &rest[rest.find('>').unwrap() + 1..];
    let end = rest.find("</td>").unwrap();
    let mut text = String::new();
    let mut in_tag = false;
    for c in rest[..end].chars() {
        match c {
            '<' => in_tag = true,
            '>' => in_tag = false,
            c if !in_tag => text.push(c),
            _ => {}
        }
    }
    text
}

/// `text`'s bytes in lowercase hex.
fn hex_of(text: &str) -> String {
    text.bytes().map(|byte| format!("{byte:02x}")).collect()
}

/// The CSRF token of a confirmation page.
fn csrf(html: &str) -> String {
    let marker = "name=\"csrf\" value=\"";
    let at = html
        .find(marker)
        .unwrap_or_else(|| panic!("no CSRF field in {html}"));
    let rest = &html[at + marker.len()..];
    rest[..rest.find('"').unwrap()].to_owned()
}

/// A form body as a browser sends it (`application/x-www-form-urlencoded`).
fn form(pairs: &[(&str, &str)]) -> String {
    pairs
        .iter()
        .map(|(name, value)| format!("{}={}", percent(name), percent(value)))
        .collect::<Vec<_>>()
        .join("&")
}

/// Percent-encodes everything but unreserved characters.
fn percent(text: &str) -> String {
    let mut out = String::new();
    for byte in text.bytes() {
        if byte.is_ascii_alphanumeric() || b"-_.~".contains(&byte) {
            out.push(byte as char);
        } else {
            out.push_str(&format!("%{byte:02X}"));
        }
    }
    out
}

/// One request to `app`: the status and the body as text.
async fn call(
    app: &axum::Router,
    method: &str,
    uri: &str,
    headers: &[(&str, &str)],
    body: Option<String>,
) -> (StatusCode, String, axum::http::HeaderMap) {
    let mut request = Request::builder().method(method).uri(uri);
    for (name, value) in headers {
        request = request.header(*name, *value);
    }
    let request = match body {
        Some(body) => request
            .header("content-type", "application/x-www-form-urlencoded")
            .body(Body::from(body)),
        None => request.body(Body::empty()),
    }
    .unwrap();
    let response = app.clone().oneshot(request).await.unwrap();
    let status = response.status();
    let headers = response.headers().clone();
    let bytes = axum::body::to_bytes(response.into_body(), usize::MAX)
        .await
        .unwrap();
    (status, String::from_utf8(bytes.to_vec()).unwrap(), headers)
}

/// Header (or form field) names and values.
type Headers<'a> = Vec<(&'a str, &'a str)>;

/// What a `tracing` subscriber writes, kept for the test to read.
#[derive(Clone, Default)]
struct Logs(std::sync::Arc<Mutex<Vec<u8>>>);

impl std::io::Write for Logs {
    fn write(&mut self, bytes: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(bytes);
        Ok(bytes.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

static LOGS: std::sync::OnceLock<Logs> = std::sync::OnceLock::new();

impl Logs {
    /// The process's subscriber's output: the console's events, from every test (a global
    /// subscriber, installed once; per-thread ones miss events when tests run in parallel).
    fn global() -> &'static Logs {
        LOGS.get_or_init(|| {
            use tracing_subscriber::util::SubscriberInitExt as _;
            let logs = Logs::default();
            let writer = logs.clone();
            tracing_subscriber::fmt()
                .with_writer(move || writer.clone())
                .with_ansi(false)
                .with_env_filter("inbox_runtime::ops::console=info")
                .finish()
                .try_init()
                .expect("no other global subscriber");
            logs
        })
    }

    fn text(&self) -> String {
        String::from_utf8(self.0.lock().unwrap().clone()).unwrap()
    }
}

const ALICE: (&str, &str) = ("authorization", "Bearer alice-token");
const MALLORY: (&str, &str) = ("authorization", "Bearer mallory-token");

// The pool `ledger console` opens (examples/ledger/db.rs): 4 connections on PostgreSQL and
// MariaDB, 1 on SQLite (the demo's, and a SQLite application's usual, single writer).
inbox_tests::backend_matrix! {
    connections(postgres = 4, sqlite = 1, mysql = 4);

    use std::sync::Arc;

    use inbox_runtime::ops::admin;
    use inbox_runtime::ops::console::{Console, ConsoleError, Refusal};
    use inbox_runtime::{Dispatcher, Status, store::StatsStatus};
    use inbox_tests::effect;

    #[inbox_runtime::idempotent(consumer = "console")]
    async fn apply(conn: &mut Conn, msg: Task) -> Result<(), TaskError> {
        match broken(&format!("{BACKEND}:{}", msg.id)) {
            Some(true) => return Err(TaskError::Broken(msg.id)),
            Some(false) => return Err(TaskError::Flaky(msg.id)),
            None => {}
        }
        sqlx::query(APPLY_EFFECT)
            .bind(format!("task:{}", msg.id))
            .bind(msg.amount)
            .execute(&mut *conn)
            .await?;
        Ok(())
    }

    fn id(tag: &str, name: &str) -> String {
        format!("{tag}-{name}")
    }

    /// Seeds: `{tag}-ok` processed, `{tag}-dead-1` and `{tag}-dead-2` dead, `{tag}-flaky`
    /// failed, [`EVIL`] dead with a `<script>` note, and one conflict on `{tag}-ok`.
    async fn seed(dispatcher: &Dispatcher<Db>, tag: &str) {
        let send = |id: String, amount: i64, note: &str| {
            inbox_tests::envelope(&Task {
                id,
                amount,
                note: note.to_owned(),
            })
        };
        for name in ["dead-1", "dead-2"] {
            break_task(&format!("{BACKEND}:{}", id(tag, name)), true);
        }
        break_task(&format!("{BACKEND}:{}", id(tag, "flaky")), false);
        break_task(&format!("{BACKEND}:{EVIL}"), true);
        for (name, amount) in [("ok", 1), ("dead-1", 10), ("dead-2", 20), ("flaky", 30)] {
            dispatcher.dispatch(&send(id(tag, name), amount, "plain")).await.unwrap();
        }
        dispatcher
            .dispatch(&send(EVIL.to_owned(), 5, "<script>alert('owned')</script>"))
            .await
            .unwrap();
        // The same key with another payload: a conflict, recorded as a rejection.
        let _ = dispatcher.dispatch(&send(id(tag, "ok"), 2, "plain")).await;
    }

    async fn fixture_app() -> (Pool, Guard, Arc<Dispatcher<Db>>, axum::Router) {
        let (pool, guard) = fixture().await;
        let (dispatcher, app) = console_over(&pool);
        (pool, guard, dispatcher, app)
    }

    /// A dispatcher over `pool` and the console over it, nested at `/ops`, alice's token
    /// accepted, mallory's refused.
    fn console_over(pool: &Pool) -> (Arc<Dispatcher<Db>>, axum::Router) {
        let dispatcher = Arc::new(Dispatcher::from_registry(pool.clone()).unwrap());
        let console = Console::new(dispatcher.clone())
            .authorize(|parts| {
                match parts.headers.get("authorization").and_then(|v| v.to_str().ok()) {
                    Some("Bearer alice-token") => Ok("alice".to_owned()),
                    Some("Bearer mallory-token") => {
                        Err(Refusal::forbidden("mallory is not an operator"))
                    }
                    _ => Err(Refusal::unauthenticated("Bearer")),
                }
            })
            .build()
            .unwrap();
        let app = axum::Router::new().nest("/ops", console);
        (dispatcher, app)
    }

    fn key_query(tag: &str, name: &str) -> String {
        format!("consumer=console&key={}", percent(&id(tag, name)))
    }

    async fn status_of(pool: &Pool, key: &str) -> Status {
        admin::show(pool, "console", key).await.unwrap().unwrap().status
    }

    #[tokio::test]
    async fn building_needs_an_authorization_decision() {
        let (pool, _guard) = fixture().await;
        let dispatcher = Arc::new(Dispatcher::from_registry(pool.clone()).unwrap());
        assert_eq!(
            Console::new(dispatcher.clone()).build::<()>().unwrap_err(),
            ConsoleError::NoAuthorization
        );
        assert_eq!(
            Console::new(dispatcher.clone())
                .authorize(|_| Ok("x".to_owned()))
                .behind_own_auth()
                .build::<()>()
                .unwrap_err(),
            ConsoleError::BothAuthorizations
        );
        // Behind the user's own auth, mounted at the root: links have no prefix.
        let app: axum::Router = Console::new(dispatcher).behind_own_auth().build().unwrap();
        let (status, html, headers) = call(&app, "GET", "/", &[], None).await;
        assert_eq!(status, StatusCode::OK, "{html}");
        assert!(html.contains("behind-own-auth"), "{html}");
        assert!(html.contains("href=\"/messages\""), "{html}");
        assert_eq!(headers["x-frame-options"], "DENY");
        let (status, css, headers) = call(&app, "GET", "/style.css", &[], None).await;
        assert_eq!(status, StatusCode::OK);
        assert!(css.contains("body"));
        assert_eq!(headers["content-type"], "text/css; charset=utf-8");
    }

    #[tokio::test]
    async fn the_overview_counts_equal_admin_stats() {
        let (pool, _guard, dispatcher, app) = fixture_app().await;
        seed(&dispatcher, "ov").await;
        let (status, html, _) = call(&app, "GET", "/ops", &[ALICE], None).await;
        assert_eq!(status, StatusCode::OK, "{html}");
        assert!(html.contains("href=\"/ops/messages\""), "prefix-aware links: {html}");
        let stats = admin::stats(&pool).await.unwrap();
        let stat = |status: StatsStatus| {
            stats
                .iter()
                .filter(|row| row.consumer.as_deref() == Some("console") && row.status == status)
                .map(|row| row.count)
                .sum::<i64>()
        };
        for status in Status::ALL {
            let shown: i64 = cell(
                &html,
                &format!("data-consumer=\"console\" data-status=\"{status}\""),
            )
            .parse()
            .unwrap();
            assert_eq!(shown, stat(StatsStatus::Message(status)), "{status}");
        }
        // The exact seeded figures.
        let shown = |status: &str| {
            cell(&html, &format!("data-consumer=\"console\" data-status=\"{status}\""))
        };
        assert_eq!(
            [shown("processed"), shown("failed"), shown("dead"), shown("rejected")],
            ["1", "1", "3", "1"]
        );
        let rejected: i64 = stats
            .iter()
            .filter(|row| matches!(row.status, StatsStatus::Rejected(_)))
            .map(|row| row.count)
            .sum();
        assert_eq!(rejected, 1);
        assert!(cell(&html, "data-consumer=\"console\" data-oldest=\"dead\"").contains(" ago)"));
        assert!(cell(&html, "data-consumer=\"console\" data-oldest=\"failed\"").contains("UTC"));
        // The failed one's retry made due (its next attempt at its first delivery): it lags.
        sqlx::query(sql(
            "UPDATE inbox_messages SET next_attempt_at = received_at WHERE message_key = $1",
        ))
        .bind("ov-flaky")
        .execute(&pool)
        .await
        .unwrap();
        let (_, html, _) = call(&app, "GET", "/ops", &[ALICE], None).await;
        let due = cell(&html, "data-consumer=\"console\" data-lag=\"retries\"");
        assert!(due.starts_with("1, oldest due ") && due.ends_with(" ago)"), "{due}");
        // Rejections by reason.
        let (status, html, _) = call(&app, "GET", "/ops/rejections", &[ALICE], None).await;
        assert_eq!(status, StatusCode::OK, "{html}");
        assert_eq!(
            cell(&html, "data-consumer=\"console\" data-reason=\"conflict\""),
            "1"
        );
        // The list: dead ones only, then failed and dead.
        let (status, html, _) = call(
            &app,
            "GET",
            "/ops/messages?consumer=console&status=dead&limit=10",
            &[ALICE],
            None,
        )
        .await;
        assert_eq!(status, StatusCode::OK, "{html}");
        assert!(html.contains("3 shown."), "{html}");
        assert!(html.contains("ov-dead-1") && html.contains("ov-dead-2"), "{html}");
        assert!(!html.contains("ov-flaky"), "{html}");
        let (_, html, _) = call(&app, "GET", "/ops/messages", &[ALICE], None).await;
        assert!(html.contains("4 shown."), "{html}");
        let (_, html, _) = call(&app, "GET", "/ops/messages?limit=2", &[ALICE], None).await;
        assert!(html.contains("2 shown (the limit"), "{html}");
        // One message's detail: attempts, the error, the payload pretty-printed.
        let (status, html, _) = call(
            &app,
            "GET",
            &format!("/ops/message?{}", key_query("ov", "dead-1")),
            &[ALICE],
            None,
        )
        .await;
        assert_eq!(status, StatusCode::OK, "{html}");
        assert_eq!(cell_dd(&html, "attempts"), "1");
        assert_eq!(cell_dd(&html, "status"), "dead");
        assert!(html.contains("task ov-dead-1 is broken for good"), "{html}");
        assert!(html.contains("  &quot;amount&quot;: 10"), "pretty JSON: {html}");
    }

    /// The text of `<dd data-field="…">`.
    fn cell_dd(html: &str, field: &str) -> String {
        let marker = format!("data-field=\"{field}\">");
        let at = html.find(&marker).unwrap_or_else(|| panic!("no {field} in {html}"));
        let rest = &html[at + marker.len()..];
        rest[..rest.find('<').unwrap()].to_owned()
    }

    #[tokio::test]
    async fn a_dead_message_replayed_from_the_page_is_applied_once() {
        let (pool, _guard, dispatcher, app) = fixture_app().await;
        let tag = format!("rp-{BACKEND}");
        let tag = tag.as_str();
        seed(&dispatcher, tag).await;
        let key = id(tag, "dead-1");
        fix_task(&format!("{BACKEND}:{key}"));
        let (status, html, _) = call(
            &app,
            "GET",
            &format!("/ops/replay?{}", key_query(tag, "dead-1")),
            &[ALICE],
            None,
        )
        .await;
        assert_eq!(status, StatusCode::OK, "{html}");
        assert!(html.contains("action=\"/ops/replay\""), "{html}");
        // Only the confirmation changed nothing.
        assert_eq!(status_of(&pool, &key).await, Status::Dead);
        let token = csrf(&html);
        let body = form(&[("consumer", "console"), ("key", &key), ("csrf", &token)]);
        let logs = Logs::global();
        let (status, html, _) = call(&app, "POST", "/ops/replay", &[ALICE], Some(body.clone())).await;
        assert_eq!(status, StatusCode::OK, "{html}");
        assert!(html.contains("data-result=\"ok\""), "{html}");
        // Who did it, logged; names and keys quoted (`Debug`), so that a newline in a key or an
        // operator's name cannot forge a log line.
        let logged = logs.text();
        assert!(
            logged.contains(&format!(
                "console: replay operator=\"alice\" action=\"replay\" consumer=\"console\" \
                 key={key:?} result=processed"
            )),
            "{logged}"
        );
        assert_eq!(status_of(&pool, &key).await, Status::Processed);
        assert_eq!(effect(&pool, &format!("task:{key}")).await, Some((1, 10)));
        // The same form again: nothing to replay, the effect stays once.
        let (status, html, _) = call(&app, "POST", "/ops/replay", &[ALICE], Some(body)).await;
        assert_eq!(status, StatusCode::CONFLICT, "{html}");
        assert!(html.contains("The message is processed"), "{html}");
        assert_eq!(effect(&pool, &format!("task:{key}")).await, Some((1, 10)));

        // A replay that fails again says so, and the message stays dead.
        let key2 = id(tag, "dead-2");
        let body = form(&[("consumer", "console"), ("key", &key2), ("csrf", &token)]);
        let (status, html, _) = call(&app, "POST", "/ops/replay", &[ALICE], Some(body)).await;
        assert_eq!(status, StatusCode::CONFLICT, "{html}");
        assert!(html.contains("failed again"), "{html}");
        assert_eq!(status_of(&pool, &key2).await, Status::Dead);
        assert_eq!(effect(&pool, &format!("task:{key2}")).await, None);

        // Bulk replay with the list's filter: the failed one, once fixed.
        fix_task(&format!("{BACKEND}:{}", id(tag, "flaky")));
        let (status, html, _) = call(
            &app,
            "GET",
            "/ops/replay-all?consumer=console&status=failed&limit=10",
            &[ALICE],
            None,
        )
        .await;
        assert_eq!(status, StatusCode::OK, "{html}");
        assert!(html.contains("replay 1 messages?"), "{html}");
        let confirmed = form(&[("items", &hidden(&html, "items")), ("csrf", &csrf(&html))]);
        // Another message fails after the confirmation: it is not in what was confirmed.
        let late = id(tag, "late");
        break_task(&format!("{BACKEND}:{late}"), false);
        let _ = dispatcher
            .dispatch(&inbox_tests::envelope(&Task { id: late.clone(), amount: 40, note: "x".into() }))
            .await;
        fix_task(&format!("{BACKEND}:{late}"));
        assert_eq!(status_of(&pool, &late).await, Status::Failed);
        let (status, html, _) =
            call(&app, "POST", "/ops/replay-all", &[ALICE], Some(confirmed.clone())).await;
        assert_eq!(status, StatusCode::OK, "{html}");
        assert!(html.contains("Replayed 1: 1 succeeded, 0 did not."), "{html}");
        let flaky = id(tag, "flaky");
        assert_eq!(status_of(&pool, &flaky).await, Status::Processed);
        assert_eq!(effect(&pool, &format!("task:{flaky}")).await, Some((1, 30)));
        assert_eq!(status_of(&pool, &late).await, Status::Failed);
        // The same form again: skipped, said so, applied once.
        let (status, html, _) =
            call(&app, "POST", "/ops/replay-all", &[ALICE], Some(confirmed)).await;
        assert_eq!(status, StatusCode::OK, "{html}");
        assert!(html.contains("Replayed 1: 0 succeeded, 1 did not."), "{html}");
        assert!(html.contains("skipped: it is processed now"), "{html}");
        assert_eq!(effect(&pool, &format!("task:{flaky}")).await, Some((1, 30)));
        // A partial failure: of the dead ones, one still broken, one fixed meanwhile (and the
        // late failed one).
        let (_, html, _) = call(
            &app,
            "GET",
            "/ops/replay-all?consumer=console&limit=10",
            &[ALICE],
            None,
        )
        .await;
        assert!(html.contains("replay 3 messages?"), "{html}");
        let body = form(&[("items", &hidden(&html, "items")), ("csrf", &csrf(&html))]);
        let (status, html, _) = call(&app, "POST", "/ops/replay-all", &[ALICE], Some(body)).await;
        assert_eq!(status, StatusCode::OK, "{html}");
        assert!(html.contains("Replayed 3: 1 succeeded, 2 did not."), "{html}");
        assert!(html.contains("data-result=\"bulk\"") && html.contains("notice bad"), "{html}");
        assert_eq!(status_of(&pool, &late).await, Status::Processed);
        assert_eq!(status_of(&pool, &key2).await, Status::Dead);
        assert_eq!(status_of(&pool, EVIL).await, Status::Dead);
    }

    /// The value of the hidden field `name` of a confirmation page.
    fn hidden(html: &str, name: &str) -> String {
        let marker = format!("name=\"{name}\" value=\"");
        let at = html.find(&marker).unwrap_or_else(|| panic!("no {name} in {html}"));
        let rest = &html[at + marker.len()..];
        rest[..rest.find('"').unwrap()].to_owned()
    }

    #[tokio::test]
    async fn a_dead_message_discarded_from_the_page() {
        let (pool, _guard, dispatcher, app) = fixture_app().await;
        seed(&dispatcher, "ds").await;
        let key = id("ds", "dead-2");
        let (status, html, _) = call(
            &app,
            "GET",
            &format!("/ops/discard?{}", key_query("ds", "dead-2")),
            &[ALICE],
            None,
        )
        .await;
        assert_eq!(status, StatusCode::OK, "{html}");
        let body = form(&[("consumer", "console"), ("key", &key), ("csrf", &csrf(&html))]);
        let (status, html, _) = call(&app, "POST", "/ops/discard", &[ALICE], Some(body)).await;
        assert_eq!(status, StatusCode::OK, "{html}");
        let row = admin::show(&pool, "console", &key).await.unwrap().unwrap();
        assert_eq!((row.status, row.payload), (Status::Discarded, None));
        assert_eq!(effect(&pool, &format!("task:{key}")).await, None);
        // The other dead one is untouched.
        assert_eq!(status_of(&pool, &id("ds", "dead-1")).await, Status::Dead);
    }

    #[tokio::test]
    async fn requests_the_hook_refuses_get_401_or_403() {
        let (pool, _guard, dispatcher, app) = fixture_app().await;
        seed(&dispatcher, "au").await;
        let (status, _, headers) = call(&app, "GET", "/ops", &[], None).await;
        assert_eq!(status, StatusCode::UNAUTHORIZED);
        assert_eq!(headers["www-authenticate"], "Bearer");
        let (status, html, _) = call(&app, "GET", "/ops/messages", &[MALLORY], None).await;
        assert_eq!(status, StatusCode::FORBIDDEN);
        assert!(html.contains("mallory is not an operator"), "{html}");
        assert!(!html.contains("au-dead-1"), "{html}");
        // An action with a valid token of alice's, sent as mallory or anonymously.
        let (_, html, _) = call(
            &app,
            "GET",
            &format!("/ops/replay?{}", key_query("au", "dead-1")),
            &[ALICE],
            None,
        )
        .await;
        let key = id("au", "dead-1");
        fix_task(&format!("{BACKEND}:{key}"));
        let body = form(&[("consumer", "console"), ("key", &key), ("csrf", &csrf(&html))]);
        for headers in [&[MALLORY][..], &[]] {
            let (status, _, _) = call(&app, "POST", "/ops/replay", headers, Some(body.clone())).await;
            assert!(
                matches!(status, StatusCode::UNAUTHORIZED | StatusCode::FORBIDDEN),
                "{status}"
            );
        }
        assert_eq!(status_of(&pool, &key).await, Status::Dead);
        assert_eq!(effect(&pool, &format!("task:{key}")).await, None);
    }

    #[tokio::test]
    async fn forged_actions_are_refused_and_change_nothing() {
        let (pool, _guard, dispatcher, app) = fixture_app().await;
        seed(&dispatcher, "cs").await;
        let key = id("cs", "dead-1");
        fix_task(&format!("{BACKEND}:{key}"));
        // A token minted by another console (another secret) for the same operator.
        let other: axum::Router = Console::new(dispatcher.clone())
            .authorize(|_| Ok("alice".to_owned()))
            .build()
            .unwrap();
        let (_, html, _) = call(
            &other,
            "GET",
            &format!("/replay?{}", key_query("cs", "dead-1")),
            &[],
            None,
        )
        .await;
        let foreign = csrf(&html);
        let (_, html, _) = call(
            &app,
            "GET",
            &format!("/ops/replay?{}", key_query("cs", "dead-1")),
            &[ALICE],
            None,
        )
        .await;
        let token = csrf(&html);
        assert_ne!(token, foreign);
        let with = |token: Option<&str>| {
            let mut pairs = vec![("consumer", "console"), ("key", key.as_str())];
            if let Some(token) = token {
                pairs.push(("csrf", token));
            }
            form(&pairs)
        };
        let cases: Vec<(Headers<'_>, String, &str)> = vec![
            (vec![ALICE], with(None), "form token"),
            (vec![ALICE], with(Some("")), "form token"),
            (vec![ALICE], with(Some(&foreign)), "form token"),
            (vec![ALICE], with(Some("zz-not-hex")), "form token"),
            (vec![ALICE, ("origin", "https://evil.example")], with(Some(&token)), "another site"),
            (vec![ALICE, ("sec-fetch-site", "cross-site")], with(Some(&token)), "another site"),
            (vec![ALICE, ("sec-fetch-site", "same-site")], with(Some(&token)), "another site"),
        ];
        for (headers, body, says) in cases {
            for page in ["/ops/replay", "/ops/discard"] {
                let (status, html, _) = call(&app, "POST", page, &headers, Some(body.clone())).await;
                assert_eq!(status, StatusCode::FORBIDDEN, "{headers:?} {body}: {html}");
                assert!(html.contains(says), "{html}");
            }
        }
        assert_eq!(status_of(&pool, &key).await, Status::Dead);
        assert_eq!(effect(&pool, &format!("task:{key}")).await, None);
        // The same token from this host's own page passes, also behind a reverse proxy that
        // rewrote `Host` (the browser's `Sec-Fetch-Site: same-origin` decides; `Origin` is only
        // compared without it).
        let (status, html, _) = call(
            &app,
            "POST",
            "/ops/replay",
            &[ALICE, ("host", "127.0.0.1:8080"), ("origin", "https://console.test"),
              ("sec-fetch-site", "same-origin")],
            Some(with(Some(&token))),
        )
        .await;
        assert_eq!(status, StatusCode::OK, "{html}");
        assert_eq!(status_of(&pool, &key).await, Status::Processed);
    }

    #[tokio::test]
    async fn bad_input_gets_a_clear_4xx_and_changes_nothing() {
        let (pool, _guard, dispatcher, app) = fixture_app().await;
        seed(&dispatcher, "bi").await;
        let before = admin::stats(&pool).await.unwrap();
        let long = format!("/ops/message?consumer=console&key={}", "k".repeat(513));
        let cases: Vec<(&str, &str, StatusCode, &str)> = vec![
            ("GET", "/ops/messages?limit=0", StatusCode::BAD_REQUEST, "Limit “0” is out of range"),
            ("GET", "/ops/messages?limit=1001", StatusCode::BAD_REQUEST, "from 1 to 1000"),
            ("GET", "/ops/messages?limit=-5", StatusCode::BAD_REQUEST, "Limit “-5” is out of range"),
            ("GET", "/ops/messages?limit=99999999999999999999", StatusCode::BAD_REQUEST, "out of range"),
            ("GET", "/ops/messages?limit=ten", StatusCode::BAD_REQUEST, "Limit “ten”"),
            ("GET", "/ops/messages?consumer=nobody", StatusCode::BAD_REQUEST,
             "Unknown consumer “nobody”. Known consumers: console."),
            ("GET", "/ops/messages?status=processed", StatusCode::BAD_REQUEST, "Status “processed”"),
            ("GET", "/ops/messages?limit=1&limit=2", StatusCode::BAD_REQUEST, "more than once"),
            ("GET", "/ops/messages?sort=key", StatusCode::BAD_REQUEST, "Unknown parameter “sort”"),
            ("GET", "/ops/message?consumer=console", StatusCode::BAD_REQUEST, "“key” is required"),
            ("GET", "/ops/message?key=x", StatusCode::BAD_REQUEST, "“consumer” is required"),
            ("GET", "/ops/message?consumer=console&key=a%00b", StatusCode::BAD_REQUEST, "NUL"),
            ("GET", &long, StatusCode::BAD_REQUEST, "513 bytes long"),
            ("GET", "/ops/message?consumer=console&key=%22it%27s%22%20%E2%9C%93", StatusCode::NOT_FOUND,
             "no message with key “&quot;it&#39;s&quot; ✓”"),
            ("GET", "/ops/replay-all?status=parked", StatusCode::BAD_REQUEST, "Parked messages"),
            ("GET", "/ops/replay?consumer=console&key=bi-ok", StatusCode::CONFLICT, "The message is processed"),
            ("DELETE", "/ops/replay", StatusCode::METHOD_NOT_ALLOWED, "does not take DELETE"),
            ("POST", "/ops/messages", StatusCode::METHOD_NOT_ALLOWED, "does not take POST"),
            ("GET", "/ops/nope", StatusCode::NOT_FOUND, "no such page"),
        ];
        for (method, uri, status, says) in cases {
            let (got, html, _) = call(&app, method, uri, &[ALICE], None).await;
            assert_eq!(got, status, "{method} {uri}: {html}");
            assert!(html.contains(says), "{method} {uri}: {html}");
        }
        // A trailing slash is redirected to the page, relatively (any prefix).
        let (got, _, headers) =
            call(&app, "GET", "/ops/messages/?limit=5", &[ALICE], None).await;
        assert_eq!(got, StatusCode::PERMANENT_REDIRECT);
        assert_eq!(headers["location"], "../messages?limit=5");
        // Forms with a valid token and bad fields.
        let (_, html, _) = call(
            &app,
            "GET",
            &format!("/ops/replay?{}", key_query("bi", "dead-1")),
            &[ALICE],
            None,
        )
        .await;
        let token = csrf(&html);
        let forms: Vec<(Headers<'_>, StatusCode, &str)> = vec![
            (vec![("consumer", "nobody"), ("key", "bi-dead-1")], StatusCode::BAD_REQUEST, "Unknown consumer"),
            (vec![("consumer", "console"), ("key", "bi-dead-1\0")], StatusCode::BAD_REQUEST, "NUL"),
            (vec![("consumer", "console")], StatusCode::BAD_REQUEST, "“key” is required"),
            (vec![("consumer", "console"), ("key", "bi-dead-1"), ("extra", "1")], StatusCode::BAD_REQUEST,
             "Unknown parameter “extra”"),
            (vec![("consumer", "console"), ("key", "no such key ✓")], StatusCode::NOT_FOUND, "No such message"),
            (vec![("consumer", "console"), ("key", "bi-ok")], StatusCode::CONFLICT, "Nothing was changed"),
        ];
        for (mut pairs, status, says) in forms {
            pairs.push(("csrf", &token));
            for page in ["/ops/replay", "/ops/discard"] {
                let (got, html, _) = call(&app, "POST", page, &[ALICE], Some(form(&pairs))).await;
                assert_eq!(got, status, "{page} {pairs:?}: {html}");
                assert!(html.contains(says), "{page} {pairs:?}: {html}");
            }
        }
        let nobody = format!("{}.{}", hex_of("nobody"), hex_of("bi-dead-1"));
        let nul = format!("{}.{}", hex_of("console"), hex_of("bi\0"));
        let many = vec![format!("{}.{}", hex_of("console"), hex_of("bi-dead-1")); 1001].join(",");
        let bulk: Vec<(Headers<'_>, &str)> = vec![
            (vec![("consumer", "console"), ("limit", "5000")], "Unknown parameter “consumer”"),
            (vec![], "“items” is required"),
            (vec![("items", "zz")], "not as the confirmation page sent them"),
            (vec![("items", &nul)], "not as the confirmation page sent them"),
            (vec![("items", &nobody)], "Unknown consumer “nobody”"),
            (vec![("items", &many)], "1001 messages to replay: at most 1000"),
        ];
        for (mut pairs, says) in bulk {
            pairs.push(("csrf", &token));
            let (got, html, _) =
                call(&app, "POST", "/ops/replay-all", &[ALICE], Some(form(&pairs))).await;
            assert_eq!(got, StatusCode::BAD_REQUEST, "{pairs:?}: {html}");
            assert!(html.contains(says), "{pairs:?}: {html}");
        }
        assert_eq!(admin::stats(&pool).await.unwrap(), before);
        assert_eq!(status_of(&pool, &id("bi", "dead-1")).await, Status::Dead);
    }

    #[tokio::test]
    async fn keys_and_payloads_are_html_escaped() {
        let (_pool, _guard, dispatcher, app) = fixture_app().await;
        seed(&dispatcher, "xs").await;
        let (status, html, _) = call(&app, "GET", "/ops/messages?status=dead", &[ALICE], None).await;
        assert_eq!(status, StatusCode::OK, "{html}");
        assert!(html.contains("evil-&lt;b&gt;&quot;x&#39;&amp;&lt;/b&gt;-✓"), "{html}");
        assert!(!html.contains("<b>"), "{html}");
        // The link to it carries the key percent-encoded in the query string.
        assert!(html.contains("key=evil-%3Cb%3E%22x%27%26%3C%2Fb%3E-%E2%9C%93"), "{html}");
        let (status, html, _) = call(
            &app,
            "GET",
            &format!("/ops/message?consumer=console&key={}", percent(EVIL)),
            &[ALICE],
            None,
        )
        .await;
        assert_eq!(status, StatusCode::OK, "{html}");
        assert_eq!(cell_dd(&html, "key"), "evil-&lt;b&gt;&quot;x&#39;&amp;&lt;/b&gt;-✓");
        assert!(html.contains("&lt;script&gt;alert(&#39;owned&#39;)&lt;/script&gt;"), "{html}");
        assert!(!html.contains("<script"), "{html}");
        assert!(!html.contains("<b>"), "{html}");
    }

    /// The rows of `<tr data-…>` lines' cells: the text of `<td data-field="field">` in the
    /// row whose opening tag contains `row`.
    fn row_field(html: &str, row: &str, field: &str) -> String {
        let at = html.find(row).unwrap_or_else(|| panic!("no row {row} in {html}"));
        let rest = &html[at..];
        let rest = &rest[..rest.find("</tr>").unwrap()];
        cell(rest, &format!("data-field=\"{field}\""))
    }

    #[tokio::test]
    async fn rejections_show_their_payload_bytes() {
        let (pool, _guard, dispatcher, app) = fixture_app().await;
        seed(&dispatcher, "rj").await;
        // A delivery no handler serves, with bytes that are not UTF-8 (a NUL, 0xff, markup).
        let raw: &[u8] = b"<b>\x00\xff&'\"";
        let envelope = inbox_runtime::Envelope::new("console.nobody", raw.to_vec());
        let error = dispatcher.dispatch(&envelope).await.unwrap_err();
        dispatcher.record_rejection(&envelope, &error).await.unwrap();
        let (status, html, _) = call(&app, "GET", "/ops/rejections", &[ALICE], None).await;
        assert_eq!(status, StatusCode::OK, "{html}");
        assert!(html.contains("2 shown (newest first)."), "{html}");
        let ids: Vec<i64> = html
            .match_indices("data-rejection=\"")
            .map(|(at, marker)| {
                let rest = &html[at + marker.len()..];
                rest[..rest.find('"').unwrap()].parse().unwrap()
            })
            .collect();
        assert_eq!(ids.len(), 2, "{html}");
        assert!(ids[0] > ids[1], "newest first: {ids:?}");
        // The unknown one: its bytes in hex, and no text (not UTF-8).
        let (status, html, _) =
            call(&app, "GET", &format!("/ops/rejection?id={}", ids[0]), &[ALICE], None).await;
        assert_eq!(status, StatusCode::OK, "{html}");
        assert_eq!(cell_dd(&html, "reason"), "unknown_message");
        assert_eq!(cell_dd(&html, "consumer"), "(none)");
        assert_eq!(cell_dd(&html, "bytes"), "8");
        let hex = {
            let marker = "data-field=\"payload-hex\">";
            let at = html.find(marker).unwrap() + marker.len();
            html[at..at + html[at..].find("</pre>").unwrap()].to_owned()
        };
        assert_eq!(
            hex,
            "00000000  3c 62 3e 00 ff 26 27 22                           &lt;b&gt;..&amp;&#39;&quot;\n"
        );
        assert!(html.contains("Not UTF-8 (invalid at byte 4)"), "{html}");
        assert!(!html.contains("<b>"), "{html}");
        // The conflict: the payload as text, exactly (escaped), and its key.
        let (status, html, _) =
            call(&app, "GET", &format!("/ops/rejection?id={}", ids[1]), &[ALICE], None).await;
        assert_eq!(status, StatusCode::OK, "{html}");
        assert_eq!(cell_dd(&html, "reason"), "conflict");
        assert_eq!(cell_dd(&html, "key"), "rj-ok");
        let payload = serde_json::to_string(&Task {
            id: "rj-ok".into(),
            amount: 2,
            note: "plain".into(),
        })
        .unwrap();
        assert_eq!(cell_dd(&html, "bytes"), payload.len().to_string());
        let text = {
            let marker = "data-field=\"payload-text\">";
            let at = html.find(marker).unwrap() + marker.len();
            html[at..at + html[at..].find("</pre>").unwrap()].to_owned()
        };
        assert_eq!(text, payload.replace('"', "&quot;"));
        // Filters.
        let (status, html, _) =
            call(&app, "GET", "/ops/rejections?reason=conflict&consumer=console", &[ALICE], None)
                .await;
        assert_eq!(status, StatusCode::OK, "{html}");
        assert!(html.contains("1 shown (newest first)."), "{html}");
        assert!(html.contains(&format!("data-rejection=\"{}\"", ids[1])), "{html}");
        // A payload over the size limit: kept cut to it, with its real size.
        let small = Dispatcher::from_registry(pool.clone()).unwrap().with_max_payload_bytes(4).unwrap();
        let envelope = inbox_runtime::Envelope::new("console.task", b"0123456789".to_vec());
        let error = small.dispatch(&envelope).await.unwrap_err();
        small.record_rejection(&envelope, &error).await.unwrap();
        let (_, html, _) =
            call(&app, "GET", "/ops/rejections?reason=too_large", &[ALICE], None).await;
        assert!(html.contains("1 shown (newest first)."), "{html}");
        let marker = "data-rejection=\"";
        let at = html.find(marker).unwrap() + marker.len();
        let id = &html[at..at + html[at..].find('"').unwrap()];
        let (status, html, _) =
            call(&app, "GET", &format!("/ops/rejection?id={id}"), &[ALICE], None).await;
        assert_eq!(status, StatusCode::OK, "{html}");
        assert_eq!(cell_dd(&html, "reason"), "too_large");
        assert_eq!(cell_dd(&html, "bytes"), "4 of 10");
        assert!(html.contains("only its first bytes are kept"), "{html}");
        assert!(html.contains("data-field=\"payload-text\">0123</pre>"), "{html}");
    }

    #[tokio::test]
    async fn parked_messages_per_aggregate_with_their_gaps() {
        let (pool, _guard, dispatcher, app) = fixture_app().await;
        seed(&dispatcher, "pk").await;
        let park = |aggregate: &'static str, sequence: i64| {
            let pool = pool.clone();
            async move {
                sqlx::query(sql(
                    "INSERT INTO inbox_messages (consumer, message_key, message_name, \
                     payload_hash, status, aggregate_id, sequence, payload) \
                     VALUES ('console', $1, 'console.task', 'h', 'parked', $2, $3, $4)",
                ))
                .bind(format!("{aggregate}#{sequence}"))
                .bind(aggregate)
                .bind(sequence)
                .bind(b"{}".to_vec())
                .execute(&pool)
                .await
                .unwrap();
            }
        };
        sqlx::query(sql(
            "INSERT INTO inbox_aggregate_state (consumer, aggregate_id, last_sequence) \
             VALUES ('console', 'order-1', 1)",
        ))
        .execute(&pool)
        .await
        .unwrap();
        for sequence in [7, 3, 4] {
            park("order-1", sequence).await;
        }
        park("order-<\"2\">", 2).await;
        let (status, html, _) = call(&app, "GET", "/ops/parked", &[ALICE], None).await;
        assert_eq!(status, StatusCode::OK, "{html}");
        assert!(html.contains("4 parked messages shown, in 2 aggregates."), "{html}");
        let one = "data-aggregate=\"order-1\"";
        assert_eq!(row_field(&html, one, "last"), "1");
        assert_eq!(row_field(&html, one, "expected"), "2");
        assert_eq!(row_field(&html, one, "gaps"), "2, 5–6");
        assert_eq!(row_field(&html, one, "parked"), "#3 #4 #7");
        let two = "data-aggregate=\"order-&lt;&quot;2&quot;&gt;\"";
        assert_eq!(row_field(&html, two, "last"), "0");
        assert_eq!(row_field(&html, two, "expected"), "1");
        assert_eq!(row_field(&html, two, "gaps"), "1");
        // The overview: how long the oldest has waited.
        let (_, html, _) = call(&app, "GET", "/ops", &[ALICE], None).await;
        assert!(cell(&html, "data-consumer=\"console\" data-oldest=\"parked\"").contains(" ago)"));
        assert_eq!(cell(&html, "data-consumer=\"console\" data-status=\"parked\""), "4");
        // A limit cuts the list (and says so).
        let (_, html, _) = call(&app, "GET", "/ops/parked?consumer=console&limit=2", &[ALICE], None).await;
        assert!(html.contains("2 parked messages shown (the limit"), "{html}");
        assert_eq!(row_field(&html, one, "parked"), "#3 #4");
    }

    #[tokio::test]
    async fn the_outbox_page_counts_and_lists_pending_and_dead_rows() {
        use inbox_runtime::{Component, store::{OutboxRow, OutboxStore as _}};
        use inbox_runtime::outbox::admin as outbox_admin;
        let (pool, _guard, _dispatcher, app) = fixture_app().await;
        let (status, html, _) = call(&app, "GET", "/ops/outbox", &[ALICE], None).await;
        assert_eq!(status, StatusCode::OK, "{html}");
        assert!(html.contains("data-outbox=\"absent\""), "{html}");
        assert!(html.contains("The outbox is not installed"), "{html}");
        inbox_runtime::migrate_components(&pool, &[Component::Inbox, Component::Outbox])
            .await
            .unwrap();
        assert!(outbox_admin::installed(&pool).await.unwrap());
        let mut conn = pool.acquire().await.unwrap();
        for (id, destination, sent) in [
            ("m-1", "orders", false),
            ("m-2", "orders", false),
            ("m-3", "orders", true),
            ("m-<4>", "audit", false),
        ] {
            let row = OutboxRow::new(id, destination, "console.task", b"{}", "{}", None).settled(sent);
            assert!(conn.enqueue_outbox(&row, false).await.unwrap());
        }
        sqlx::query(sql(
            "UPDATE inbox_outbox SET status = 'dead', last_error = '<refused>' \
             WHERE message_id = $1",
        ))
        .bind("m-2")
        .execute(&mut *conn)
        .await
        .unwrap();
        drop(conn);
        let (status, html, _) = call(&app, "GET", "/ops/outbox", &[ALICE], None).await;
        assert_eq!(status, StatusCode::OK, "{html}");
        let count = |destination: &str, status: &str| {
            cell(&html, &format!("data-destination=\"{destination}\" data-status=\"{status}\""))
        };
        assert_eq!(
            [count("orders", "pending"), count("orders", "sent"), count("orders", "dead")],
            ["1", "1", "1"]
        );
        assert_eq!(count("audit", "pending"), "1");
        assert!(html.contains("3 shown (oldest first)."), "{html}");
        assert!(html.contains("m-&lt;4&gt;") && !html.contains("m-<4>"), "{html}");
        assert!(html.contains("&lt;refused&gt;"), "{html}");
        assert!(!html.contains(">m-3<"), "sent rows are not listed: {html}");
        let (_, html, _) =
            call(&app, "GET", "/ops/outbox?status=dead&destination=orders", &[ALICE], None).await;
        assert!(html.contains("1 shown (oldest first)."), "{html}");
        assert!(html.contains(">m-2<"), "{html}");
        let (status, html, _) =
            call(&app, "GET", "/ops/outbox?destination=nowhere", &[ALICE], None).await;
        assert_eq!(status, StatusCode::BAD_REQUEST, "{html}");
        assert!(html.contains("Unknown destination “nowhere”"), "{html}");
        // The rates: the sent row, in this hour.
        let (status, html, _) = call(&app, "GET", "/ops/rates", &[ALICE], None).await;
        assert_eq!(status, StatusCode::OK, "{html}");
        let section = &html[html.find("data-outbox=\"sent\"").expect("outbox section")..];
        assert_eq!(cell(section, "data-destination=\"orders\""), "1");
        assert!(!section.contains("data-destination=\"audit\""), "{section}");
    }

    #[tokio::test]
    async fn rates_per_hour_drawn_from_the_tables() {
        let (_pool, _guard, dispatcher, app) = fixture_app().await;
        seed(&dispatcher, "rt").await;
        let (status, html, headers) = call(&app, "GET", "/ops/rates", &[ALICE], None).await;
        assert_eq!(status, StatusCode::OK, "{html}");
        assert!(!html.contains("<script"), "{html}");
        assert!(headers["content-security-policy"].to_str().unwrap().contains("default-src 'none'"));
        let section = {
            let at = html.find("<section class=\"rates\" data-consumer=\"console\">").unwrap();
            let rest = &html[at..];
            rest[..rest.find("</section>").unwrap()].to_owned()
        };
        let total = |series: &str| cell(&section, &format!("data-series=\"{series}\""));
        assert_eq!(
            [total("processed"), total("failed"), total("dead"), total("parked"), total("rejected:conflict")],
            ["1", "1", "3", "0", "1"]
        );
        // 24 bars per series; this hour's dead bar is the tallest.
        assert_eq!(section.matches("<svg").count(), 8, "{section}");
        assert_eq!(section.matches("<rect").count(), 8 * 24, "{section}");
        assert!(section.contains("height=\"24\" data-hour="), "{section}");
        assert!(section.contains("data-count=\"3\"><title>"), "{section}");
    }

    #[tokio::test]
    async fn expired_shared_and_origin_checked_forms() {
        let (pool, _guard, dispatcher, app) = fixture_app().await;
        seed(&dispatcher, "ex").await;
        let key = id("ex", "dead-1");
        fix_task(&format!("{BACKEND}:{key}"));
        let query = format!("/replay?{}", key_query("ex", "dead-1"));
        let hook = |_: &axum::http::request::Parts| Ok("alice".to_owned());
        // A form older than its lifetime: refused, says so, nothing changed.
        let expiring: axum::Router = Console::new(dispatcher.clone())
            .authorize(hook)
            .form_lifetime(std::time::Duration::ZERO)
            .build()
            .unwrap();
        let (_, html, _) = call(&expiring, "GET", &query, &[], None).await;
        let body = form(&[("consumer", "console"), ("key", &key), ("csrf", &csrf(&html))]);
        let (status, html, _) = call(&expiring, "POST", "/replay", &[], Some(body)).await;
        assert_eq!(status, StatusCode::FORBIDDEN, "{html}");
        assert!(html.contains("This page expired"), "{html}");
        assert!(html.contains("Reload the page and confirm again."), "{html}");
        // A tampered issue time is a wrong token, not an expired one.
        let (_, html, _) = call(&app, "GET", &format!("/ops{query}"), &[ALICE], None).await;
        let token = csrf(&html);
        let (issued, mac) = token.split_once('.').unwrap();
        let tampered = format!("{}.{mac}", issued.parse::<i64>().unwrap() + 1);
        let body = form(&[("consumer", "console"), ("key", &key), ("csrf", &tampered)]);
        let (status, html, _) = call(&app, "POST", "/ops/replay", &[ALICE], Some(body)).await;
        assert_eq!(status, StatusCode::FORBIDDEN, "{html}");
        assert!(html.contains("missing or wrong"), "{html}");
        // A body over 64 KiB: 413, nothing read.
        let huge = form(&[("consumer", "console"), ("key", &"k".repeat(70_000))]);
        let (status, html, _) = call(&app, "POST", "/ops/replay", &[ALICE], Some(huge)).await;
        assert_eq!(status, StatusCode::PAYLOAD_TOO_LARGE, "{html}");
        assert_eq!(status_of(&pool, &key).await, Status::Dead);
        // Two consoles with one secret (replicas) accept each other's forms; Origin alone
        // (no Sec-Fetch-Site) is compared with Host.
        let secret = [7_u8; 32];
        let replica = |dispatcher: Arc<Dispatcher<Db>>| -> axum::Router {
            Console::new(dispatcher).authorize(hook).csrf_secret(secret).build().unwrap()
        };
        let (one, two) = (replica(dispatcher.clone()), replica(dispatcher.clone()));
        let (_, html, _) = call(&one, "GET", &query, &[], None).await;
        let body = form(&[("consumer", "console"), ("key", &key), ("csrf", &csrf(&html))]);
        let (status, html, _) = call(
            &two,
            "POST",
            "/replay",
            &[("host", "console.test"), ("origin", "https://evil.test")],
            Some(body.clone()),
        )
        .await;
        assert_eq!(status, StatusCode::FORBIDDEN, "{html}");
        assert!(html.contains("Origin: https://evil.test"), "{html}");
        assert_eq!(status_of(&pool, &key).await, Status::Dead);
        let (status, html, _) = call(
            &two,
            "POST",
            "/replay",
            &[("host", "console.test"), ("origin", "https://console.test")],
            Some(body),
        )
        .await;
        assert_eq!(status, StatusCode::OK, "{html}");
        assert_eq!(status_of(&pool, &key).await, Status::Processed);
    }

    #[tokio::test]
    async fn bad_input_on_the_new_pages_gets_a_clear_4xx() {
        let (pool, _guard, dispatcher, app) = fixture_app().await;
        seed(&dispatcher, "bn").await;
        let before = admin::stats(&pool).await.unwrap();
        let cases: Vec<(&str, StatusCode, &str)> = vec![
            ("/ops/rejection", StatusCode::BAD_REQUEST, "“id” is required"),
            ("/ops/rejection?id=0", StatusCode::BAD_REQUEST, "Id “0” is not a rejection"),
            ("/ops/rejection?id=-1", StatusCode::BAD_REQUEST, "Id “-1”"),
            ("/ops/rejection?id=%22x%27%00", StatusCode::BAD_REQUEST, "Id “&quot;x&#39;\u{FFFD}”"),
            ("/ops/rejection?id=99999999999999999999", StatusCode::BAD_REQUEST, "is not a rejection"),
            ("/ops/rejection?id=987654321", StatusCode::NOT_FOUND, "No rejected delivery has id 987654321."),
            ("/ops/rejection?id=1&id=2", StatusCode::BAD_REQUEST, "more than once"),
            ("/ops/rejections?reason=%3Cb%3E", StatusCode::BAD_REQUEST, "Reason “&lt;b&gt;” is not a rejection reason"),
            ("/ops/rejections?consumer=nobody", StatusCode::BAD_REQUEST, "Unknown consumer “nobody”"),
            ("/ops/rejections?limit=1001", StatusCode::BAD_REQUEST, "from 1 to 1000"),
            ("/ops/parked?consumer=%E2%9C%93%00", StatusCode::BAD_REQUEST, "NUL"),
            ("/ops/parked?consumer=%22nobody%27", StatusCode::BAD_REQUEST, "Unknown consumer “&quot;nobody&#39;”"),
            ("/ops/parked?limit=0", StatusCode::BAD_REQUEST, "out of range"),
            ("/ops/parked?aggregate=x", StatusCode::BAD_REQUEST, "Unknown parameter “aggregate”"),
            ("/ops/outbox?status=sent", StatusCode::BAD_REQUEST, "Status “sent”"),
            ("/ops/outbox?limit=99999", StatusCode::BAD_REQUEST, "out of range"),
            ("/ops/outbox?destination=a%00b", StatusCode::BAD_REQUEST, "NUL"),
            ("/ops/rates?hours=48", StatusCode::BAD_REQUEST, "Unknown parameter “hours”"),
        ];
        for (uri, status, says) in cases {
            let (got, html, _) = call(&app, "GET", uri, &[ALICE], None).await;
            assert_eq!(got, status, "{uri}: {html}");
            assert!(html.contains(says), "{uri}: {html}");
        }
        for page in ["/ops/rejection", "/ops/parked", "/ops/outbox", "/ops/rates"] {
            let (got, _, _) = call(&app, "POST", page, &[ALICE], None).await;
            assert_eq!(got, StatusCode::METHOD_NOT_ALLOWED, "{page}");
        }
        assert_eq!(admin::stats(&pool).await.unwrap(), before);
    }

    /// An error page's request and what it answers: method, URI, headers, form body, status,
    /// title.
    type ErrorCase<'a> = (&'a str, &'a str, Headers<'a>, Option<String>, StatusCode, &'a str);

    /// Every kind of error page is a page of the console: its stylesheet (under the prefix),
    /// its navigation, the title as `<h1>`, the status; a refused request shows no operator.
    #[tokio::test]
    async fn error_pages_use_the_console_stylesheet() {
        let (pool, _guard, dispatcher, app) = fixture_app().await;
        seed(&dispatcher, "ep").await;
        let styled = |html: &str, status: StatusCode, title: &str, operator: bool, base: &str| {
            assert!(
                html.contains(&format!("<title>{title} · inbox console</title><link rel=\"stylesheet\" href=\"{base}/style.css\">")),
                "{status}: {html}"
            );
            assert!(html.contains(&format!("<a href=\"{base}/rates\">Rates</a></nav>")), "{status}: {html}");
            assert!(html.contains(&format!("<main><h1>{title}</h1><p class=\"notice bad\" data-error>")), "{status}: {html}");
            assert_eq!(html.contains("<span class=\"operator\">"), operator, "{status}: {html}");
        };
        let cases: Vec<ErrorCase<'_>> = vec![
            ("GET", "/ops/messages?limit=0", vec![ALICE], None, StatusCode::BAD_REQUEST, "Bad request"),
            ("GET", "/ops", vec![], None, StatusCode::UNAUTHORIZED, "Not signed in"),
            ("GET", "/ops", vec![MALLORY], None, StatusCode::FORBIDDEN, "Forbidden"),
            ("POST", "/ops/replay", vec![ALICE],
                Some(form(&[("consumer", "console"), ("key", "ep-dead-1"), ("csrf", "0.0")])),
                StatusCode::FORBIDDEN, "Invalid form token"),
            ("GET", "/ops/nope", vec![ALICE], None, StatusCode::NOT_FOUND, "Not found"),
            ("GET", "/ops/message?consumer=console&key=none", vec![ALICE], None, StatusCode::NOT_FOUND, "No such message"),
            ("DELETE", "/ops/messages", vec![ALICE], None, StatusCode::METHOD_NOT_ALLOWED, "Method not allowed"),
            ("GET", "/ops/replay?consumer=console&key=ep-ok", vec![ALICE], None, StatusCode::CONFLICT, "Nothing to do"),
        ];
        for (method, uri, headers, body, status, title) in cases {
            let (got, html, _) = call(&app, method, uri, &headers, body).await;
            assert_eq!(got, status, "{method} {uri}: {html}");
            styled(&html, status, title, false, "/ops");
        }
        // Mounted at the root: the stylesheet at /style.css.
        let root: axum::Router = Console::new(dispatcher.clone()).behind_own_auth().build().unwrap();
        let (got, html, _) = call(&root, "GET", "/nope", &[], None).await;
        assert_eq!(got, StatusCode::NOT_FOUND);
        styled(&html, got, "Not found", false, "");
        // The database gone: 503, the same page; the stylesheet is still served.
        pool.close().await;
        let (got, html, _) = call(&app, "GET", "/ops/rates", &[ALICE], None).await;
        assert_eq!(got, StatusCode::SERVICE_UNAVAILABLE, "{html}");
        styled(&html, got, "Database error", false, "/ops");
        assert!(html.contains("The inbox&#39;s database failed: "), "{html}");
        let (got, _, headers) = call(&app, "GET", "/ops/style.css", &[], None).await;
        assert_eq!(got, StatusCode::OK);
        assert_eq!(headers["content-type"], "text/css; charset=utf-8");
    }

    /// The text of a page's `<h1>`.
    fn h1(html: &str) -> &str {
        let at = html.find("<h1>").unwrap_or_else(|| panic!("no <h1> in {html}")) + 4;
        &html[at..at + html[at..].find("</h1>").unwrap()]
    }

    /// The value of the hidden form field `name` of a confirmation page.
    fn field(html: &str, name: &str) -> String {
        let marker = format!("name=\"{name}\" value=\"");
        let at = html.find(&marker).unwrap_or_else(|| panic!("no field {name} in {html}"));
        let rest = &html[at + marker.len()..];
        rest[..rest.find('"').unwrap()].to_owned()
    }

    /// Every page and action of the console through a pool of `connections`: each answers 200
    /// with its exact figures, one request at a time, then every page `connections + 1` times
    /// at once (more requests than connections: each waits for one in turn, none needs two).
    async fn every_page_through(connections: u32, tag: &str) {
        use inbox_runtime::{Component, store::{OutboxRow, OutboxStore as _}};
        let (pool, _guard) = fixture_with(connections).await;
        inbox_runtime::migrate_components(&pool, &[Component::Inbox, Component::Outbox])
            .await
            .unwrap();
        let (dispatcher, app) = console_over(&pool);
        seed(&dispatcher, tag).await;
        // Aggregate order-1 applied up to 1, its 3 parked; one outbox row sent, one pending.
        sqlx::query(sql(
            "INSERT INTO inbox_aggregate_state (consumer, aggregate_id, last_sequence) \
             VALUES ('console', 'order-1', 1)",
        ))
        .execute(&pool)
        .await
        .unwrap();
        sqlx::query(sql(
            "INSERT INTO inbox_messages (consumer, message_key, message_name, payload_hash, \
             status, aggregate_id, sequence, payload) \
             VALUES ('console', 'order-1#3', 'console.task', 'h', 'parked', 'order-1', 3, $1)",
        ))
        .bind(b"{}".to_vec())
        .execute(&pool)
        .await
        .unwrap();
        {
            let mut conn = pool.acquire().await.unwrap();
            for (id, sent) in [("m-1", true), ("m-2", false)] {
                let row = OutboxRow::new(id, "orders", "console.task", b"{}", "{}", None)
                    .settled(sent);
                assert!(conn.enqueue_outbox(&row, false).await.unwrap());
            }
        }
        let rejection: i64 = sqlx::query_scalar("SELECT id FROM inbox_rejections")
            .fetch_one(&pool)
            .await
            .unwrap();
        let (dead_1, dead_2) = (id(tag, "dead-1"), id(tag, "dead-2"));
        let pages: Vec<(String, String, Vec<String>)> = vec![
            ("/ops".into(), "Overview".into(), vec![
                "data-consumer=\"console\" data-status=\"processed\">1</td>".into(),
                "data-consumer=\"console\" data-status=\"rejected\">1</td>".into(),
            ]),
            ("/ops/messages".into(), "Failed and dead messages".into(), vec!["<p>4 shown.</p>".into()]),
            (format!("/ops/message?{}", key_query(tag, "dead-1")), "Message".into(), vec![
                format!("data-field=\"key\">{dead_1}</dd>"),
                "data-field=\"status\">dead</dd>".into(),
            ]),
            (format!("/ops/replay?{}", key_query(tag, "dead-1")), "Confirm: replay this message?".into(),
                vec![format!("data-field=\"key\">{dead_1}</dd>")]),
            (format!("/ops/discard?{}", key_query(tag, "dead-2")), "Confirm: discard this message?".into(),
                vec![format!("data-field=\"key\">{dead_2}</dd>")]),
            ("/ops/replay-all?status=dead".into(), "Confirm: replay 3 messages?".into(),
                vec![format!("<li>console/<span class=\"key\">{dead_1}</span> (dead)</li>")]),
            ("/ops/rejections".into(), "Rejected deliveries".into(), vec![
                "data-consumer=\"console\" data-reason=\"conflict\">1</td>".into(),
                "data-count=\"rejections\">1 shown (newest first).</p>".into(),
            ]),
            (format!("/ops/rejection?id={rejection}"), format!("Rejected delivery {rejection}"), vec![
                "data-field=\"reason\">conflict</dd>".into(),
                format!("data-field=\"key\">{}</dd>", id(tag, "ok")),
            ]),
            ("/ops/parked".into(), "Parked messages per aggregate".into(), vec![
                "<p>1 parked message shown, in 1 aggregate.</p>".into(),
                "data-field=\"gaps\">2</td>".into(),
            ]),
            ("/ops/outbox".into(), "Outbox".into(), vec![
                "data-destination=\"orders\" data-status=\"pending\">1</td>".into(),
                "data-destination=\"orders\" data-status=\"sent\">1</td>".into(),
                "data-count=\"outbox\">1 shown (oldest first).</p>".into(),
            ]),
            ("/ops/rates".into(), "Rates, last 24 hours".into(), vec![
                "data-series=\"processed\">1</td>".into(),
                "data-series=\"dead\">3</td>".into(),
                "data-series=\"parked\">1</td>".into(),
                "data-destination=\"orders\">1</td>".into(),
            ]),
        ];
        for (uri, title, needles) in &pages {
            let (status, html, _) = call(&app, "GET", uri, &[ALICE], None).await;
            assert_eq!(status, StatusCode::OK, "{uri}: {html}");
            assert_eq!(h1(&html), title, "{uri}");
            for needle in needles {
                assert!(html.contains(needle.as_str()), "{uri}: no {needle} in {html}");
            }
        }
        let (status, css, headers) = call(&app, "GET", "/ops/style.css", &[], None).await;
        assert_eq!(status, StatusCode::OK);
        assert_eq!(headers["content-type"], "text/css; charset=utf-8");
        assert!(css.starts_with("/* The operator console's only stylesheet"), "{css}");
        // All at once, more requests than the pool has connections.
        let times = connections as usize + 1;
        let app_ref = &app;
        let all = futures_util::future::join_all(
            pages
                .iter()
                .flat_map(|page| std::iter::repeat_n(page, times))
                .map(|(uri, title, _)| async move {
                    let (status, html, _) = call(app_ref, "GET", uri, &[ALICE], None).await;
                    (uri, title, status, html)
                }),
        )
        .await;
        assert_eq!(all.len(), pages.len() * times);
        for (uri, title, status, html) in all {
            assert_eq!(status, StatusCode::OK, "{uri} (at once): {html}");
            assert_eq!(h1(&html), title, "{uri} (at once)");
        }
        // The actions: a replay (the cause fixed), a discard, a bulk replay (still broken).
        fix_task(&format!("{BACKEND}:{dead_1}"));
        for (verb, key, result) in [("replay", &dead_1, "processed"), ("discard", &dead_2, "discarded")] {
            let query = format!("consumer=console&key={}", percent(key));
            let (_, html, _) = call(&app, "GET", &format!("/ops/{verb}?{query}"), &[ALICE], None).await;
            let body = form(&[("consumer", "console"), ("key", key), ("csrf", &csrf(&html))]);
            let (status, html, _) = call(&app, "POST", &format!("/ops/{verb}"), &[ALICE], Some(body)).await;
            assert_eq!(status, StatusCode::OK, "{verb}: {html}");
            assert!(
                html.contains(&format!("data-result=\"ok\">console/{key}: {result}</p>")),
                "{verb}: {html}"
            );
            assert_eq!(cell_dd(&html, "status"), result);
        }
        assert_eq!(effect(&pool, &format!("task:{dead_1}")).await, Some((1, 10)));
        let (status, html, _) = call(&app, "GET", "/ops/replay-all?status=dead", &[ALICE], None).await;
        assert_eq!(status, StatusCode::OK, "{html}");
        assert_eq!(h1(&html), "Confirm: replay 1 messages?");
        let body = form(&[("items", &field(&html, "items")), ("csrf", &csrf(&html))]);
        let (status, html, _) = call(&app, "POST", "/ops/replay-all", &[ALICE], Some(body)).await;
        assert_eq!(status, StatusCode::OK, "{html}");
        assert!(html.contains("data-result=\"bulk\">Replayed 1: 0 succeeded, 1 did not.</p>"), "{html}");
        assert_eq!(status_of(&pool, EVIL).await, Status::Dead);
    }

    /// The regression of the rates page on the demo's SQLite (a pool of one connection): it
    /// held its connection while asking the pool for another, and answered 503 after the
    /// pool's 30 s timeout. Every page, on every backend, through one connection.
    #[tokio::test]
    async fn every_page_through_a_pool_of_one_connection() {
        every_page_through(1, "one").await;
    }

    /// Every page through the pool `ledger console` opens (`CONNECTIONS`: 4 on PostgreSQL and
    /// MariaDB, 1 on SQLite).
    #[tokio::test]
    async fn every_page_through_the_demos_pool() {
        every_page_through(CONNECTIONS, "demo").await;
    }
}

/// The console's reads over a large inbox: served by indexes (EXPLAIN), and, on PostgreSQL,
/// timed over a million rows (`--ignored`: the figure is printed, not asserted).
mod large {
    use super::*;

    inbox_tests::backend_matrix! {
        connections(postgres = 4, sqlite = 1, mysql = 4);

        use std::sync::Arc;
        use std::time::Instant;

        use inbox_runtime::ops::console::Console;
        use inbox_runtime::Dispatcher;
        use sqlx::Row as _;

        /// The statistics query of `admin::stats` (and the overview) as each backend plans it: the
        /// lines of its plan, joined.
        async fn plan_of_stats(pool: &Pool) -> String {
            let stats = "SELECT consumer, status, COUNT(*), MIN(received_at) FROM inbox_messages \
                         GROUP BY status, consumer";
            let rejections = "SELECT consumer, reason, COUNT(*), MIN(received_at) \
                              FROM inbox_rejections GROUP BY consumer, reason";
            plan_of(pool, &[stats, rejections]).await
        }

        /// The plans of `queries`, their lines joined (MySQL: `key=… extra=…` per line).
        async fn plan_of(pool: &Pool, queries: &[&str]) -> String {
            let mut conn = pool.acquire().await.unwrap();
            let mut lines = Vec::new();
            for query in queries {
                match BACKEND {
                    Backend::Postgres => {
                        // Tiny test tables are cheaper to read whole: ask whether an index can
                        // serve the query at all.
                        sqlx::query("SET enable_seqscan = off").execute(&mut *conn).await.unwrap();
                        for row in sqlx::query(sqlx::AssertSqlSafe(format!("EXPLAIN {query}")))
                            .fetch_all(&mut *conn)
                            .await
                            .unwrap()
                        {
                            lines.push(row.try_get::<String, _>(0).unwrap());
                        }
                        sqlx::query("RESET enable_seqscan").execute(&mut *conn).await.unwrap();
                    }
                    Backend::Sqlite => {
                        for row in sqlx::query(sqlx::AssertSqlSafe(format!("EXPLAIN QUERY PLAN {query}")))
                            .fetch_all(&mut *conn)
                            .await
                            .unwrap()
                        {
                            lines.push(row.try_get::<String, _>(3).unwrap());
                        }
                    }
                    _ => {
                        for row in sqlx::query(sqlx::AssertSqlSafe(format!("EXPLAIN {query}")))
                            .fetch_all(&mut *conn)
                            .await
                            .unwrap()
                        {
                            let key: Option<String> = row.try_get("key").unwrap();
                            let extra: Option<String> = row.try_get("Extra").unwrap();
                            lines.push(format!("key={key:?} extra={extra:?}"));
                        }
                    }
                }
            }
            lines.join("\n")
        }

        #[tokio::test]
        async fn the_statistics_are_read_from_indexes() {
            let (pool, _guard) = fixture().await;
            let plan = plan_of_stats(&pool).await;
            match BACKEND {
                Backend::Postgres => {
                    assert!(plan.contains("Index Only Scan using inbox_messages_console"), "{plan}");
                    assert!(plan.contains("Index Only Scan using inbox_rejections_console"), "{plan}");
                    assert!(!plan.contains("Seq Scan"), "{plan}");
                }
                Backend::Sqlite => {
                    assert!(plan.contains("USING COVERING INDEX inbox_messages_console"), "{plan}");
                    assert!(plan.contains("USING COVERING INDEX inbox_rejections_console"), "{plan}");
                }
                _ => {
                    assert!(plan.contains("key=Some(\"inbox_messages_console\")"), "{plan}");
                    assert!(plan.contains("key=Some(\"inbox_rejections_console\")"), "{plan}");
                    assert!(plan.contains("Using index"), "{plan}");
                }
            }
        }

        /// The console's other reads, in the shape of their statements (the hour arithmetic
        /// left out, a fixed time for the database clock): the rates' arrivals, the parked
        /// rows, the retries due. None reads `inbox_messages` whole.
        #[tokio::test]
        async fn the_console_reads_use_indexes() {
            let (pool, _guard) = fixture().await;
            let queries = [
                "SELECT consumer, status, COUNT(*) FROM inbox_messages \
                 WHERE status IN ('processed', 'failed', 'dead', 'parked', 'stale', 'discarded') \
                 AND received_at >= '2026-01-01' GROUP BY consumer, status",
                "SELECT consumer, aggregate_id, sequence FROM inbox_messages \
                 WHERE status = 'parked' AND aggregate_id IS NOT NULL AND sequence IS NOT NULL \
                 ORDER BY consumer, aggregate_id, sequence",
                "SELECT consumer, COUNT(*), MIN(next_attempt_at) FROM inbox_messages \
                 WHERE status = 'failed' AND next_attempt_at <= '2026-01-01' GROUP BY consumer",
            ];
            for query in queries {
                let plan = plan_of(&pool, &[query]).await;
                match BACKEND {
                    Backend::Postgres => {
                        assert!(plan.contains("Index"), "{query}: {plan}");
                        assert!(!plan.contains("Seq Scan"), "{query}: {plan}");
                    }
                    Backend::Sqlite => {
                        assert!(plan.contains("USING"), "{query}: {plan}");
                        assert!(!plan.lines().any(|l| l.starts_with("SCAN") && !l.contains("USING")),
                            "{query}: {plan}");
                    }
                    _ => assert!(!plan.contains("key=None"), "{query}: {plan}"),
                }
            }
        }

        /// `cargo test --test console -- --ignored --nocapture overview_over_a_million_rows`: seeds
        /// 1,000,000 rows on PostgreSQL and prints the overview's server time (the router's, in
        /// process: no network).
        #[tokio::test]
        #[ignore = "a measurement: seeds a million rows; run by hand"]
        async fn overview_over_a_million_rows() {
            if BACKEND != Backend::Postgres {
                return;
            }
            let (pool, _guard) = fixture().await;
            let started = Instant::now();
            sqlx::query(
                "INSERT INTO inbox_messages (consumer, message_key, message_name, payload_hash, \
                 status, received_at, processed_at, payload, aggregate_id, sequence) \
                 SELECT 'bench-' || (i % 4), 'key-' || i, 'console.task', 'hash', \
                        CASE i % 1000 WHEN 0 THEN 'failed' WHEN 1 THEN 'dead' WHEN 2 THEN 'parked' \
                        ELSE 'processed' END, \
                        now() - (i % 86400) * interval '1 second', \
                        CASE WHEN i % 1000 > 2 THEN now() - (i % 86400) * interval '1 second' END, \
                        CASE WHEN i % 1000 <= 2 THEN '{\"id\": 1}'::bytea END, \
                    CASE WHEN i % 1000 = 2 THEN 'agg-' || (i % 97) END, \
                    CASE WHEN i % 1000 = 2 THEN i END \
                 FROM generate_series(1, 1000000) AS i",
            )
            .execute(&pool)
            .await
            .unwrap();
            println!("seeded 1,000,000 rows in {:?}", started.elapsed());
            let dispatcher = Arc::new(Dispatcher::from_registry(pool.clone()).unwrap());
            let app: axum::Router = Console::new(dispatcher).behind_own_auth().build().unwrap();
            for (when, vacuum) in [("before VACUUM", false), ("after VACUUM ANALYZE", true)] {
                if vacuum {
                    sqlx::query("VACUUM ANALYZE inbox_messages").execute(&pool).await.unwrap();
                }
                for page in ["/", "/rates", "/parked", "/rejections", "/messages"] {
                    let mut times = Vec::new();
                    for _ in 0..5 {
                        let started = Instant::now();
                        let (status, html, _) = call(&app, "GET", page, &[], None).await;
                        times.push(started.elapsed());
                        assert_eq!(status, StatusCode::OK, "{html}");
                    }
                    println!("{page} {when}: {times:?}");
                }
                let plan: Vec<String> = sqlx::query(
                    "EXPLAIN (ANALYZE, BUFFERS) SELECT consumer, status, COUNT(*), \
                     MIN(received_at) FROM inbox_messages GROUP BY status, consumer",
                )
                .fetch_all(&pool)
                .await
                .unwrap()
                .iter()
                .map(|row| row.try_get::<String, _>(0).unwrap())
                .collect();
                println!("{}", plan.join("\n"));
            }
        }
    }
}
