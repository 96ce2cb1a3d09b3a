//! # A payments HTTP API with `Idempotency-Key`, and a consumer that calls it
//!
//! ```text
//! cargo run --example payments                      # the API on 127.0.0.1:3000
//! cargo run --example payments -- --listen 127.0.0.1:8080 --db /tmp/payments.db
//! cargo run --example payments -- consume           # a billing consumer calling the API
//! ```
//!
//! **The API** (`serve`, the default) keeps payments and account balances in an embedded SQLite
//! file (`payments.db`). `POST /payments` with an `Idempotency-Key` writes a payment and credits
//! the account's balance in **one transaction — the same one that claims the key and stores the
//! response** (`inbox_runtime::http`): a retried request is answered with the stored response
//! and credits nothing; the same key with another body is a 422; a retry while the first request
//! still runs is a 409 with `Retry-After`. `GET /payments` and `GET /accounts/{id}` read back.
//! A request header `Demo-Hold-Ms: 5000` makes the handler wait that long before answering
//! (inside its transaction), to show the 409.
//!
//! **The consumer** (`consume`) processes `order.placed` events with an `#[idempotent]` handler
//! (its own inbox, in `billing.db`). For each order it calls `POST /payments` with the key
//! `StepKey::current("charge")`, derived from the consumer, the event's key and the step name:
//! the same on every run for that event. To show why that matters, the first run of every third
//! order fails *after* the API call (its transaction rolls back, as after a crash), and every
//! event is delivered twice. The summary shows each order charged exactly once: the failed
//! run's retry reached the API with the same key and got the stored payment back; the
//! redelivery was a duplicate in the consumer's inbox and made no call at all.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::OnceLock;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use axum::extract::{Path, State};
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use clap::Parser;
use inbox_runtime::http::{IdempotencyLayer, IdempotencyTx};
use inbox_runtime::{Message, Outcome, idempotent, types::StepKey};
use serde::{Deserialize, Serialize};
use sqlx::sqlite::{SqliteConnectOptions, SqliteJournalMode, SqlitePoolOptions};
use sqlx::{Sqlite, SqliteConnection, SqlitePool};

#[derive(Parser, Debug)]
#[command(
    about = "A payments API with Idempotency-Key (inbox_runtime::http), and a consumer calling it"
)]
struct Args {
    #[command(subcommand)]
    command: Option<Command>,
    #[command(flatten)]
    serve: ServeArgs,
}

#[derive(clap::Subcommand, Debug)]
enum Command {
    /// Serve the payments API (the default).
    Serve(ServeArgs),
    /// Process order events with a billing consumer that calls the API.
    Consume(ConsumeArgs),
    /// Measure `POST /payments` with and without the idempotency layer, side by side.
    Bench(BenchArgs),
}

#[derive(clap::Args, Debug)]
struct BenchArgs {
    /// Requests per variant and round.
    #[arg(long, default_value_t = 4000)]
    requests: usize,
    /// Concurrent clients.
    #[arg(long, default_value_t = 16)]
    concurrency: usize,
    /// Rounds (each runs every variant once, in turn).
    #[arg(long, default_value_t = 2)]
    rounds: usize,
}

#[derive(clap::Args, Debug)]
struct ServeArgs {
    /// Address to listen on.
    #[arg(long, default_value = "127.0.0.1:3000")]
    listen: SocketAddr,
    /// The API's SQLite file (created if missing).
    #[arg(long, value_name = "FILE", default_value = "payments.db")]
    db: PathBuf,
}

#[derive(clap::Args, Debug)]
struct ConsumeArgs {
    /// The payments API.
    #[arg(long, default_value = "http://127.0.0.1:3000")]
    api: String,
    /// How many orders to process.
    #[arg(long, default_value_t = 6)]
    orders: u32,
    /// The consumer's SQLite file (its inbox; created if missing).
    #[arg(long, value_name = "FILE", default_value = "billing.db")]
    db: PathBuf,
    /// A name for this run's orders (order keys are `<run>-order-<n>`); the default is new on
    /// every run.
    #[arg(long)]
    run: Option<String>,
}

// ---------------------------------------------------------------------------------------------
// The API

const API_SCHEMA: &str = "
CREATE TABLE IF NOT EXISTS payments (
    id           TEXT PRIMARY KEY,
    account      TEXT NOT NULL,
    amount_cents INTEGER NOT NULL,
    reference    TEXT,
    created_at   TEXT NOT NULL DEFAULT (strftime('%Y-%m-%dT%H:%M:%fZ', 'now'))
);
CREATE TABLE IF NOT EXISTS balances (
    account       TEXT PRIMARY KEY,
    balance_cents INTEGER NOT NULL
);";

/// The body of `POST /payments`.
#[derive(Debug, Deserialize)]
struct NewPayment {
    account: String,
    amount_cents: i64,
    #[serde(default)]
    reference: Option<String>,
}

/// A payment as the API returns it.
#[derive(Debug, Serialize, Deserialize)]
struct Payment {
    id: String,
    account: String,
    amount_cents: i64,
    reference: Option<String>,
}

/// `POST /payments`: the payment and the balance credit, on the claim's transaction.
async fn create_payment(
    headers: HeaderMap,
    mut tx: IdempotencyTx<Sqlite>,
    Json(new): Json<NewPayment>,
) -> Response {
    if new.amount_cents <= 0 || new.account.trim().is_empty() {
        // A 422 of the handler's own: stored like any 4xx, and replayed to a retry.
        return (
            StatusCode::UNPROCESSABLE_ENTITY,
            Json(
                serde_json::json!({"error": "an account and a positive amount_cents are required"}),
            ),
        )
            .into_response();
    }
    if let Some(hold) = headers
        .get("demo-hold-ms")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok())
    {
        // Inside the transaction: the key stays claimed meanwhile (a retry now gets a 409).
        tokio::time::sleep(Duration::from_millis(hold.min(60_000))).await;
    }
    let payment = Payment {
        id: uuid::Uuid::now_v7().to_string(),
        account: new.account,
        amount_cents: new.amount_cents,
        reference: new.reference,
    };
    let written = async {
        sqlx::query("INSERT INTO payments (id, account, amount_cents, reference) VALUES ($1, $2, $3, $4)")
            .bind(&payment.id)
            .bind(&payment.account)
            .bind(payment.amount_cents)
            .bind(&payment.reference)
            .execute(&mut *tx)
            .await?;
        sqlx::query(
            "INSERT INTO balances (account, balance_cents) VALUES ($1, $2) \
             ON CONFLICT (account) DO UPDATE SET balance_cents = balances.balance_cents + excluded.balance_cents",
        )
        .bind(&payment.account)
        .bind(payment.amount_cents)
        .execute(&mut *tx)
        .await
    }
    .await;
    match written {
        // Stored with the key and committed with the writes when this returns.
        Ok(_) => (
            StatusCode::CREATED,
            [(header::LOCATION, format!("/payments/{}", payment.id))],
            Json(payment),
        )
            .into_response(),
        // A 500 is not stored: the writes roll back, the key stays free for a retry.
        Err(error) => (StatusCode::INTERNAL_SERVER_ERROR, error.to_string()).into_response(),
    }
}

/// `GET /payments`: every payment, oldest first.
async fn list_payments(State(pool): State<SqlitePool>) -> Result<Json<Vec<Payment>>, StatusCode> {
    let rows: Vec<(String, String, i64, Option<String>)> = sqlx::query_as(
        "SELECT id, account, amount_cents, reference FROM payments ORDER BY created_at, id",
    )
    .fetch_all(&pool)
    .await
    .map_err(|_| StatusCode::INTERNAL_SERVER_ERROR)?;
    Ok(Json(
        rows.into_iter()
            .map(|(id, account, amount_cents, reference)| Payment {
                id,
                account,
                amount_cents,
                reference,
            })
            .collect(),
    ))
}

/// `GET /accounts/{id}`: an account's balance.
async fn account(
    State(pool): State<SqlitePool>,
    Path(id): Path<String>,
) -> Result<Json<serde_json::Value>, StatusCode> {
    let balance: Option<i64> =
        sqlx::query_scalar("SELECT balance_cents FROM balances WHERE account = $1")
            .bind(&id)
            .fetch_optional(&pool)
            .await
            .map_err(|_| StatusCode::INTERNAL_SERVER_ERROR)?;
    Ok(Json(
        serde_json::json!({"account": id, "balance_cents": balance.unwrap_or(0)}),
    ))
}

async fn open_sqlite(path: &std::path::Path) -> Result<SqlitePool, sqlx::Error> {
    SqlitePoolOptions::new()
        .max_connections(8)
        .connect_with(
            SqliteConnectOptions::new()
                .filename(path)
                .create_if_missing(true)
                .journal_mode(SqliteJournalMode::Wal)
                .busy_timeout(Duration::from_secs(30)),
        )
        .await
}

/// The API's router on `pool` (migrated): `POST /payments` behind the idempotency layer.
fn api(pool: SqlitePool) -> Router {
    let idempotency = IdempotencyLayer::new(pool.clone())
        // Keys must be sf-strings (`"…"`); the demo also takes bare ones, as curl users type them.
        .accept_unquoted_keys(true);
    Router::new()
        .route(
            "/payments",
            post(create_payment)
                .route_layer(idempotency)
                .get(list_payments),
        )
        .route("/accounts/{id}", get(account))
        .with_state(pool)
}

async fn serve(args: ServeArgs) -> Result<(), Box<dyn std::error::Error>> {
    let pool = open_sqlite(&args.db).await?;
    inbox_runtime::migrate(&pool).await?;
    sqlx::raw_sql(API_SCHEMA).execute(&pool).await?;
    let listener = tokio::net::TcpListener::bind(args.listen).await?;
    println!(
        "payments API on http://{} (SQLite: {}); POST /payments with an Idempotency-Key. Ctrl-C stops it.",
        listener.local_addr()?,
        args.db.display()
    );
    axum::serve(listener, api(pool))
        .with_graceful_shutdown(async {
            let _ = tokio::signal::ctrl_c().await;
        })
        .await?;
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// The consumer

/// An order was placed: charge its amount to the customer's account.
#[derive(Debug, Clone, Serialize, Deserialize, Message)]
#[message(name = "order.placed")]
struct OrderPlaced {
    #[message(key)]
    order_id: String,
    account: String,
    amount_cents: i64,
}

/// What the billing consumer needs besides its connection: the API and the simulated failures.
struct Billing {
    http: reqwest::Client,
    api: String,
    /// API calls made (for the summary).
    calls: AtomicUsize,
    /// Orders whose first run fails after the API call.
    fail_once: std::sync::Mutex<std::collections::HashSet<String>>,
}

static BILLING: OnceLock<Billing> = OnceLock::new();

#[derive(Debug, thiserror::Error)]
enum ChargeError {
    #[error("the payments API failed: {0}")]
    Api(String),
    #[error("the process failed after charging (simulated crash before COMMIT)")]
    Crashed,
    #[error(transparent)]
    Database(#[from] sqlx::Error),
}

/// Charges the order through the payments API, then records the payment id. The API call is
/// outside this transaction: if the transaction rolls back after it, the order runs again and
/// calls again — with the same `StepKey`, so the API answers with the first payment.
#[idempotent(consumer = "billing")]
async fn charge(conn: &mut SqliteConnection, msg: OrderPlaced) -> Result<String, ChargeError> {
    let billing = BILLING.get().expect("set before processing");
    let key = StepKey::current("charge").expect("inside an #[idempotent] handler");
    billing.calls.fetch_add(1, Ordering::SeqCst);
    let response = billing
        .http
        .post(format!("{}/payments", billing.api))
        .header("idempotency-key", format!("\"{key}\""))
        .header("content-type", "application/json")
        .body(
            serde_json::json!({
                "account": msg.account,
                "amount_cents": msg.amount_cents,
                "reference": msg.order_id,
            })
            .to_string(),
        )
        .send()
        .await
        .map_err(|e| ChargeError::Api(e.to_string()))?;
    let status = response.status();
    let replayed = response.headers().contains_key("idempotent-replayed");
    let body = response
        .text()
        .await
        .map_err(|e| ChargeError::Api(e.to_string()))?;
    if status != reqwest::StatusCode::CREATED {
        return Err(ChargeError::Api(format!("{status}: {body}")));
    }
    let payment: Payment =
        serde_json::from_str(&body).map_err(|e| ChargeError::Api(e.to_string()))?;
    println!(
        "  {} → POST /payments, Idempotency-Key \"{key}\": {status}{} payment {}",
        msg.order_id,
        if replayed { " (replayed)" } else { "" },
        payment.id
    );
    if billing.fail_once.lock().unwrap().remove(&msg.order_id) {
        return Err(ChargeError::Crashed);
    }
    sqlx::query("INSERT INTO charges (order_id, payment_id) VALUES ($1, $2)")
        .bind(&msg.order_id)
        .bind(&payment.id)
        .execute(&mut *conn)
        .await?;
    Ok(payment.id)
}

async fn consume(args: ConsumeArgs) -> Result<(), Box<dyn std::error::Error>> {
    let pool = open_sqlite(&args.db).await?;
    inbox_runtime::migrate(&pool).await?;
    sqlx::raw_sql(
        "CREATE TABLE IF NOT EXISTS charges (order_id TEXT PRIMARY KEY, payment_id TEXT NOT NULL)",
    )
    .execute(&pool)
    .await?;
    let run = args
        .run
        .unwrap_or_else(|| uuid::Uuid::now_v7().simple().to_string()[20..].to_owned());
    let orders: Vec<OrderPlaced> = (1..=args.orders)
        .map(|n| OrderPlaced {
            order_id: format!("{run}-order-{n}"),
            account: format!("acc-{}", n % 3 + 1),
            amount_cents: i64::from(n) * 100,
        })
        .collect();
    let _ = BILLING.set(Billing {
        http: reqwest::Client::new(),
        api: args.api.trim_end_matches('/').to_owned(),
        calls: AtomicUsize::new(0),
        fail_once: std::sync::Mutex::new(
            orders
                .iter()
                .step_by(3)
                .map(|o| o.order_id.clone())
                .collect(),
        ),
    });
    let billing = BILLING.get().expect("just set");
    println!(
        "billing consumer: {} orders (run {run}), each delivered twice, against {}",
        orders.len(),
        billing.api
    );

    let mut conn = pool.acquire().await?;
    let (processed, duplicates, retried) = deliver_twice(&mut conn, &orders).await;

    // What the API holds for this run: one payment per order.
    let payments: Vec<Payment> = billing
        .http
        .get(format!("{}/payments", billing.api))
        .send()
        .await?
        .json()
        .await?;
    let mine = payments
        .iter()
        .filter(|p| {
            p.reference
                .as_deref()
                .is_some_and(|r| r.starts_with(&format!("{run}-")))
        })
        .count();
    println!(
        "{} orders: {processed} processed, {duplicates} duplicate deliveries, {retried} failed runs retried; \
         {} API calls made; the API holds {mine} payments for them",
        orders.len(),
        billing.calls.load(Ordering::SeqCst),
    );
    let recorded: i64 = sqlx::query_scalar("SELECT COUNT(*) FROM charges WHERE order_id LIKE $1")
        .bind(format!("{run}-%"))
        .fetch_one(&pool)
        .await?;
    if mine != orders.len() || recorded != i64::from(args.orders) {
        return Err(format!(
            "expected {} payments and charges, the API holds {mine} payments, the consumer {recorded} charges",
            orders.len()
        )
        .into());
    }
    println!("each order was charged exactly once");
    Ok(())
}

/// Delivers every order twice (at least once: a lost ack, say) to `charge`, retrying a failed
/// run at once: how many runs were processed, duplicates, and failed (then retried).
async fn deliver_twice(
    conn: &mut sqlx::SqliteConnection,
    orders: &[OrderPlaced],
) -> (u32, u32, u32) {
    let (mut processed, mut duplicates, mut retried) = (0, 0, 0);
    for order in orders {
        // At least once: the broker delivers every event twice (a lost ack, say).
        for _delivery in 0..2 {
            // A failed run is retried at once here (a worker would retry with backoff).
            loop {
                match charge(&mut *conn, order.clone()).await {
                    Ok(Outcome::Processed(_)) => processed += 1,
                    Ok(Outcome::Duplicate) => {
                        println!(
                            "  {} → duplicate delivery: already charged, no call",
                            order.order_id
                        );
                        duplicates += 1;
                    }
                    Ok(Outcome::NotYet { retry_in }) => {
                        // The failed run is recorded with its next attempt time; a worker would
                        // see the redelivery then. Wait for it.
                        tokio::time::sleep(retry_in).await;
                        continue;
                    }
                    Ok(other) => println!("  {} → {other:?}", order.order_id),
                    Err(error) => {
                        println!("  {} → failed: {error}; rolled back", order.order_id);
                        retried += 1;
                        continue;
                    }
                }
                break;
            }
        }
    }
    (processed, duplicates, retried)
}

// ---------------------------------------------------------------------------------------------
// The benchmark

/// `POST /payments` without the layer: the same writes in a plain transaction of the pool.
async fn create_payment_plain(
    State(pool): State<SqlitePool>,
    Json(new): Json<NewPayment>,
) -> Response {
    let payment = Payment {
        id: uuid::Uuid::now_v7().to_string(),
        account: new.account,
        amount_cents: new.amount_cents,
        reference: new.reference,
    };
    let written = async {
        let mut tx = pool.begin().await?;
        sqlx::query("INSERT INTO payments (id, account, amount_cents, reference) VALUES ($1, $2, $3, $4)")
            .bind(&payment.id)
            .bind(&payment.account)
            .bind(payment.amount_cents)
            .bind(&payment.reference)
            .execute(&mut *tx)
            .await?;
        sqlx::query(
            "INSERT INTO balances (account, balance_cents) VALUES ($1, $2) \
             ON CONFLICT (account) DO UPDATE SET balance_cents = balances.balance_cents + excluded.balance_cents",
        )
        .bind(&payment.account)
        .bind(payment.amount_cents)
        .execute(&mut *tx)
        .await?;
        tx.commit().await
    }
    .await;
    match written {
        Ok(()) => (
            StatusCode::CREATED,
            [(header::LOCATION, format!("/payments/{}", payment.id))],
            Json(payment),
        )
            .into_response(),
        Err(error) => (StatusCode::INTERNAL_SERVER_ERROR, error.to_string()).into_response(),
    }
}

/// One measured variant: requests/s and latency percentiles (µs).
struct Measured {
    name: &'static str,
    requests: usize,
    elapsed: Duration,
    latency: hdrhistogram::Histogram<u64>,
}

/// Serves `router` on 127.0.0.1, an ephemeral port; returns its base URL.
async fn serve_on_ephemeral(router: Router) -> Result<String, Box<dyn std::error::Error>> {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let base = format!("http://{}", listener.local_addr()?);
    tokio::spawn(async move { axum::serve(listener, router).await });
    Ok(base)
}

/// `requests` POSTs from `concurrency` clients; `key(n)` gives request n's key (or none); with
/// `same_body`, every request has the body of request 0 (replays of one key must).
async fn load(
    name: &'static str,
    url: &str,
    requests: usize,
    concurrency: usize,
    same_body: bool,
    key: impl Fn(usize) -> Option<String> + Send + Sync + 'static,
) -> Result<Measured, Box<dyn std::error::Error>> {
    let http = reqwest::Client::new();
    let next = std::sync::Arc::new(AtomicUsize::new(0));
    let key = std::sync::Arc::new(key);
    let started = std::time::Instant::now();
    let mut workers = Vec::new();
    for _ in 0..concurrency {
        let (http, next, key, url) = (http.clone(), next.clone(), key.clone(), url.to_owned());
        workers.push(tokio::spawn(async move {
            let mut latency =
                hdrhistogram::Histogram::<u64>::new(3).expect("3 significant figures");
            loop {
                let n = next.fetch_add(1, Ordering::Relaxed);
                if n >= requests {
                    return Ok::<_, String>(latency);
                }
                let b = if same_body { 0 } else { n };
                let mut request = http
                    .post(&url)
                    .header("content-type", "application/json")
                    .body(format!(
                        r#"{{"account":"acc-{}","amount_cents":{}}}"#,
                        b % 50,
                        100 + b % 7
                    ));
                if let Some(key) = key(n) {
                    request = request.header("idempotency-key", format!("\"{key}\""));
                }
                let sent = std::time::Instant::now();
                let response = request.send().await.map_err(|e| e.to_string())?;
                let status = response.status();
                response.bytes().await.map_err(|e| e.to_string())?;
                if status != reqwest::StatusCode::CREATED {
                    return Err(format!("{name}: unexpected {status}"));
                }
                latency
                    .record(sent.elapsed().as_micros() as u64)
                    .map_err(|e| e.to_string())?;
            }
        }));
    }
    let mut latency = hdrhistogram::Histogram::<u64>::new(3).expect("3 significant figures");
    for worker in workers {
        latency.add(worker.await??)?;
    }
    Ok(Measured {
        name,
        requests,
        elapsed: started.elapsed(),
        latency,
    })
}

async fn bench(args: BenchArgs) -> Result<(), Box<dyn std::error::Error>> {
    let dir = tempfile::tempdir()?;
    let mut bases = Vec::new();
    for variant in ["plain", "layer"] {
        let pool = open_sqlite(&dir.path().join(format!("{variant}.db"))).await?;
        inbox_runtime::migrate(&pool).await?;
        sqlx::raw_sql(API_SCHEMA).execute(&pool).await?;
        let router = if variant == "plain" {
            Router::new()
                .route("/payments", post(create_payment_plain))
                .with_state(pool)
        } else {
            api(pool)
        };
        bases.push(serve_on_ephemeral(router).await?);
    }
    let (plain, layer) = (
        format!("{}/payments", bases[0]),
        format!("{}/payments", bases[1]),
    );
    println!(
        "POST /payments on SQLite (WAL), {} requests per variant and round, {} clients, {} rounds, \
         client and servers in this process",
        args.requests, args.concurrency, args.rounds
    );
    // Warm-up: connections, caches, the replayed key.
    load("warm-up", &plain, 200, args.concurrency, false, |_| None).await?;
    load("warm-up", &layer, 200, args.concurrency, false, |n| {
        Some(format!("warm-{n}"))
    })
    .await?;
    load("warm-up", &layer, 1, 1, true, |_| Some("replayed".into())).await?;
    let mut totals: Vec<Measured> = Vec::new();
    for round in 0..args.rounds {
        let runs = [
            load(
                "without the layer",
                &plain,
                args.requests,
                args.concurrency,
                false,
                |_| None,
            )
            .await?,
            load(
                "with the layer, first requests",
                &layer,
                args.requests,
                args.concurrency,
                false,
                move |n| Some(format!("r{round}-{n}")),
            )
            .await?,
            load(
                "with the layer, replays",
                &layer,
                args.requests,
                args.concurrency,
                true,
                |_| Some("replayed".into()),
            )
            .await?,
        ];
        for run in runs {
            match totals.iter_mut().find(|t| t.name == run.name) {
                Some(total) => {
                    total.requests += run.requests;
                    total.elapsed += run.elapsed;
                    total.latency.add(&run.latency)?;
                }
                None => totals.push(run),
            }
        }
    }
    let base_rate = totals[0].requests as f64 / totals[0].elapsed.as_secs_f64();
    println!("| variant | requests/s | ratio | p50 ms | p99 ms |");
    println!("|---|---:|---:|---:|---:|");
    for total in &totals {
        let rate = total.requests as f64 / total.elapsed.as_secs_f64();
        println!(
            "| {} | {rate:.0} | {:.2} | {:.2} | {:.2} |",
            total.name,
            rate / base_rate,
            total.latency.value_at_quantile(0.5) as f64 / 1000.0,
            total.latency.value_at_quantile(0.99) as f64 / 1000.0,
        );
    }
    Ok(())
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args = Args::parse();
    match args.command {
        None => serve(args.serve).await,
        Some(Command::Serve(serve_args)) => serve(serve_args).await,
        Some(Command::Consume(consume_args)) => consume(consume_args).await,
        Some(Command::Bench(bench_args)) => bench(bench_args).await,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The walk-through of the README against the API on an ephemeral port: first, replay,
    /// mismatch, in flight; then the consumer against it.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn the_walk_through_and_the_consumer() {
        let dir = tempfile::tempdir().unwrap();
        let pool = open_sqlite(&dir.path().join("payments.db")).await.unwrap();
        inbox_runtime::migrate(&pool).await.unwrap();
        sqlx::raw_sql(API_SCHEMA).execute(&pool).await.unwrap();
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let base = format!("http://{}", listener.local_addr().unwrap());
        let server = tokio::spawn(async move { axum::serve(listener, api(pool)).await });
        let client = reqwest::Client::new();
        let post = |key: &str, body: &str| {
            client
                .post(format!("{base}/payments"))
                .header("idempotency-key", key)
                .header("content-type", "application/json")
                .body(body.to_owned())
        };
        let body = r#"{"account":"acc-1","amount_cents":500}"#;

        let first = post("\"pay-1\"", body).send().await.unwrap();
        assert_eq!(first.status(), 201);
        let first = first.text().await.unwrap();
        let replay = post("pay-1", body).send().await.unwrap(); // bare keys accepted here
        assert_eq!(replay.status(), 201);
        assert_eq!(replay.headers()["idempotent-replayed"], "true");
        assert_eq!(replay.text().await.unwrap(), first);
        let mismatch = post("\"pay-1\"", r#"{"account":"acc-1","amount_cents":900}"#)
            .send()
            .await
            .unwrap();
        assert_eq!(mismatch.status(), 422);

        // Two requests with one key, both asking the handler to hold 3 s: whichever claims the
        // key first holds it, the other gets a 409 at once. (Should the machine be so slow that
        // one finished before the other arrived, the second is a replay: try a new key.)
        let mut saw_in_flight = false;
        let mut held_payments = 0;
        for attempt in 0..5 {
            held_payments += 1;
            let key = format!("\"pay-held-{attempt}\"");
            let held = |key: String| post(&key, body).header("demo-hold-ms", "3000").send();
            let (a, b) = tokio::join!(held(key.clone()), held(key));
            let (a, b) = (a.unwrap(), b.unwrap());
            let mut statuses = [a.status().as_u16(), b.status().as_u16()];
            statuses.sort_unstable();
            if statuses == [201, 409] {
                let in_flight = if a.status() == 409 { a } else { b };
                assert_eq!(in_flight.headers()["retry-after"], "1");
                saw_in_flight = true;
                break;
            }
            assert_eq!(statuses, [201, 201], "a replay, when not in flight");
        }
        assert!(saw_in_flight);

        let balance: serde_json::Value = client
            .get(format!("{base}/accounts/acc-1"))
            .send()
            .await
            .unwrap()
            .json()
            .await
            .unwrap();
        // pay-1 once (neither its replay nor the mismatch credited), and each held key once.
        assert_eq!(balance["balance_cents"], 500 * (1 + held_payments));

        consume(ConsumeArgs {
            api: base.clone(),
            orders: 6,
            db: dir.path().join("billing.db"),
            run: Some("test".into()),
        })
        .await
        .unwrap();
        let billing = BILLING.get().unwrap();
        // 6 orders, 2 of them failed once after the call: 8 calls, 6 payments (checked by
        // `consume`), and the redeliveries made none.
        assert_eq!(billing.calls.load(Ordering::SeqCst), 8);
        server.abort();
    }
}
