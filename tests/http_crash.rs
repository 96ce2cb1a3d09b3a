//! The payments API (`cargo run --example payments`, the `Idempotency-Key` layer on embedded
//! SQLite) SIGKILLed at random moments while clients send payments, each retrying its request
//! with its key until it gets an answer that is not a 409 (or a lost connection): every payment
//! exists exactly once, the balances are the sums, and every client got the same response body
//! for its key as a replay gives now.

#![allow(missing_docs)]

#[path = "ledger_support.rs"]
mod support;

use std::collections::{BTreeMap, HashMap};
use std::io::{BufRead as _, BufReader};
use std::path::Path;
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, RwLock};
use std::time::{Duration, Instant};

use rand::Rng as _;
use support::ChildGuard;

/// How many times the server is killed.
const KILLS: usize = 12;
/// Concurrent clients; each sends payments one after another until the kills are over.
const CLIENTS: usize = 6;

/// The API process and its address.
struct Api {
    child: ChildGuard,
    base: String,
}

/// Starts the API on `db` on 127.0.0.1, an ephemeral port; waits (up to 2 minutes) for the line
/// that names its address.
fn start(db: &Path, log: &Path) -> Api {
    let mut child = ChildGuard::new(
        Command::new(support::payments_bin())
            .args(["serve", "--listen", "127.0.0.1:0", "--db"])
            .arg(db)
            .stdout(Stdio::piped())
            .stderr(
                std::fs::OpenOptions::new()
                    .create(true)
                    .append(true)
                    .open(log)
                    .unwrap(),
            )
            .spawn()
            .expect("start the payments example"),
    );
    let stdout = child.stdout.take().unwrap();
    let (sender, receiver) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let mut lines = BufReader::new(stdout).lines();
        let first = lines.next();
        let _ = sender.send(first);
        // Keep reading (the server prints nothing more; this keeps the pipe open).
        for _ in lines {}
    });
    let line = receiver
        .recv_timeout(Duration::from_secs(120))
        .expect("the API starts within 2 minutes")
        .expect("the API prints its address")
        .unwrap();
    let base = line
        .split_whitespace()
        .find(|word| word.starts_with("http://"))
        .unwrap_or_else(|| panic!("no address in {line:?}"))
        .to_owned();
    Api { child, base }
}

/// One client's answers: key → (payment id, the body it got).
type Answers = BTreeMap<String, (String, Vec<u8>)>;

/// Sends payments `c<client>-p<n>` one after another until `stop`, each retried with its key
/// until an answer that is not a 409 or a 503 arrives (lost connections and refused connects
/// are retried too). Returns what it got, and counts retries.
async fn client(
    client: usize,
    base: Arc<RwLock<String>>,
    stop: Arc<AtomicBool>,
    retries: Arc<AtomicUsize>,
) -> (Answers, BTreeMap<String, i64>) {
    let http = reqwest::Client::builder()
        .timeout(Duration::from_secs(60))
        .build()
        .unwrap();
    let mut answers = Answers::new();
    let mut amounts = BTreeMap::new();
    let mut n = 0;
    while !stop.load(Ordering::SeqCst) {
        n += 1;
        let key = format!("c{client}-p{n}");
        let account = format!("acc-{}", client % 3);
        let amount = 100 + n;
        let body =
            serde_json::json!({"account": account, "amount_cents": amount, "reference": key})
                .to_string();
        let deadline = Instant::now() + Duration::from_secs(300);
        let answer = loop {
            assert!(Instant::now() < deadline, "{key}: no answer in 5 minutes");
            // A hold of 0–40 ms inside the transaction: kills land mid-transaction too.
            let hold = rand::rng().random_range(0..40);
            let url = format!("{}/payments", base.read().unwrap());
            let sent = http
                .post(url)
                .header("idempotency-key", format!("\"{key}\""))
                .header("content-type", "application/json")
                .header("demo-hold-ms", hold.to_string())
                .body(body.clone())
                .send()
                .await;
            let response = match sent {
                Ok(response) => response,
                Err(_) => {
                    retries.fetch_add(1, Ordering::Relaxed);
                    tokio::time::sleep(Duration::from_millis(20)).await;
                    continue;
                }
            };
            let status = response.status().as_u16();
            let Ok(bytes) = response.bytes().await else {
                retries.fetch_add(1, Ordering::Relaxed);
                continue;
            };
            match status {
                201 => break bytes.to_vec(),
                409 | 503 => {
                    retries.fetch_add(1, Ordering::Relaxed);
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
                other => panic!(
                    "{key}: unexpected {other}: {}",
                    String::from_utf8_lossy(&bytes)
                ),
            }
        };
        let json: serde_json::Value = serde_json::from_slice(&answer).unwrap();
        assert_eq!(json["reference"], key.as_str());
        answers.insert(
            key.clone(),
            (json["id"].as_str().unwrap().to_owned(), answer),
        );
        amounts.insert(key, amount);
    }
    (answers, amounts)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn every_payment_once_through_sigkills() {
    let dir = support::scratch_dir().join(support::unique("payments_crash"));
    std::fs::create_dir_all(&dir).unwrap();
    let db = dir.join("payments.db");
    let log = dir.join("api.log");
    let mut api = start(&db, &log);
    let base = Arc::new(RwLock::new(api.base.clone()));
    let stop = Arc::new(AtomicBool::new(false));
    let retries = Arc::new(AtomicUsize::new(0));
    let clients: Vec<_> = (0..CLIENTS)
        .map(|c| tokio::spawn(client(c, base.clone(), stop.clone(), retries.clone())))
        .collect();

    // Kill the API at random moments, restarting it each time (on a new ephemeral port).
    for _ in 0..KILLS {
        let after = rand::rng().random_range(100..600);
        tokio::time::sleep(Duration::from_millis(after)).await;
        api.child.kill().expect("SIGKILL the API");
        api.child.wait().unwrap();
        api = tokio::task::spawn_blocking({
            let (db, log) = (db.clone(), log.clone());
            move || start(&db, &log)
        })
        .await
        .unwrap();
        *base.write().unwrap() = api.base.clone();
    }
    stop.store(true, Ordering::SeqCst);
    let mut answers = Answers::new();
    let mut amounts = BTreeMap::new();
    for client in clients {
        let (a, m) = tokio::time::timeout(Duration::from_secs(600), client)
            .await
            .expect("the clients finish")
            .unwrap();
        answers.extend(a);
        amounts.extend(m);
    }

    // What the API holds: every payment exactly once, with the id its client was given.
    let http = reqwest::Client::new();
    let payments: Vec<serde_json::Value> = serde_json::from_slice(
        &http
            .get(format!("{}/payments", api.base))
            .send()
            .await
            .unwrap()
            .bytes()
            .await
            .unwrap(),
    )
    .unwrap();
    let mut by_reference: HashMap<String, Vec<String>> = HashMap::new();
    for payment in &payments {
        by_reference
            .entry(payment["reference"].as_str().unwrap().to_owned())
            .or_default()
            .push(payment["id"].as_str().unwrap().to_owned());
    }
    assert_eq!(
        payments.len(),
        answers.len(),
        "one payment per key, no more"
    );
    for (key, (id, _)) in &answers {
        assert_eq!(by_reference.get(key), Some(&vec![id.clone()]), "{key}");
    }
    // The balances are the sums of the payments.
    for account in 0..3 {
        let expected: i64 = amounts
            .iter()
            .filter(|(key, _)| {
                let client: usize = key[1..key.find('-').unwrap()].parse().unwrap();
                client % 3 == account
            })
            .map(|(_, amount)| amount)
            .sum();
        let balance: serde_json::Value = serde_json::from_slice(
            &http
                .get(format!("{}/accounts/acc-{account}", api.base))
                .send()
                .await
                .unwrap()
                .bytes()
                .await
                .unwrap(),
        )
        .unwrap();
        assert_eq!(balance["balance_cents"], expected, "acc-{account}");
    }
    // Every client got the very body a replay gives now.
    for (key, (_, body)) in &answers {
        let amount = amounts[key];
        let client: usize = key[1..key.find('-').unwrap()].parse().unwrap();
        let response = http
            .post(format!("{}/payments", api.base))
            .header("idempotency-key", format!("\"{key}\""))
            .header("content-type", "application/json")
            .body(
                serde_json::json!({
                    "account": format!("acc-{}", client % 3),
                    "amount_cents": amount,
                    "reference": key,
                })
                .to_string(),
            )
            .send()
            .await
            .unwrap();
        assert_eq!(response.status(), 201);
        assert_eq!(response.headers()["idempotent-replayed"], "true", "{key}");
        assert_eq!(&response.bytes().await.unwrap()[..], &body[..], "{key}");
    }
    eprintln!(
        "{KILLS} kills: {} payments by {CLIENTS} clients, each exactly once; {} retries",
        answers.len(),
        retries.load(Ordering::Relaxed)
    );
    assert!(answers.len() >= CLIENTS);
}
