//! Checks of the ledger demo's database after a disturbed run, shared by `crash.rs` and
//! `outage.rs` (included with `#[path]`): balances exact, every well-formed event of the sample
//! applied exactly once, none lost.

#![allow(dead_code, unreachable_pub)]

use std::collections::{BTreeMap, BTreeSet};

use sqlx::Connection as _;

use crate::support::{expected, sample};

/// The event ids (inbox key form) of the sample's well-formed events: a known message name, a
/// UUID `event_id`, a string account and an integer amount. Redeliveries and conflicts repeat
/// ids; malformed lines carry ids that are never delivered well-formed.
pub fn well_formed_event_ids() -> BTreeSet<String> {
    let text = std::fs::read_to_string(sample()).unwrap();
    text.lines()
        .filter_map(|line| serde_json::from_str::<serde_json::Value>(line).ok())
        .filter(|line| {
            matches!(
                line["message"].as_str(),
                Some("payments.captured" | "payments.refunded")
            )
        })
        .filter(|line| line["payload"]["account_id"].is_string())
        .filter(|line| line["payload"]["amount_cents"].is_i64())
        .filter_map(|line| {
            let id = line["payload"]["event_id"].as_str()?;
            Some(uuid::Uuid::parse_str(id).ok()?.hyphenated().to_string())
        })
        .collect()
}

/// What the database holds at the end.
#[derive(Debug)]
pub struct State {
    pub balances: BTreeMap<String, i64>,
    /// `ledger` inbox rows by status.
    pub statuses: BTreeMap<String, i64>,
    /// Keys of the `processed` rows of `ledger`.
    pub processed: BTreeSet<String>,
}

const BALANCES: &str = "SELECT id, balance_cents FROM accounts ORDER BY id";
const STATUSES: &str =
    "SELECT status, COUNT(*) FROM inbox_messages WHERE consumer = 'ledger' GROUP BY status";
const PROCESSED: &str =
    "SELECT message_key FROM inbox_messages WHERE consumer = 'ledger' AND status = 'processed'";

pub async fn pg_state(url: &str) -> State {
    let mut conn = sqlx::PgConnection::connect(url).await.unwrap();
    let balances: Vec<(String, i64)> = sqlx::query_as(BALANCES).fetch_all(&mut conn).await.unwrap();
    let statuses: Vec<(String, i64)> = sqlx::query_as(STATUSES).fetch_all(&mut conn).await.unwrap();
    let processed: Vec<String> = sqlx::query_scalar(PROCESSED)
        .fetch_all(&mut conn)
        .await
        .unwrap();
    conn.close().await.ok();
    State {
        balances: balances.into_iter().collect(),
        statuses: statuses.into_iter().collect(),
        processed: processed.into_iter().collect(),
    }
}

pub async fn sqlite_state(url: &str) -> State {
    let mut conn = sqlx::SqliteConnection::connect(url).await.unwrap();
    let balances: Vec<(String, i64)> = sqlx::query_as(BALANCES).fetch_all(&mut conn).await.unwrap();
    let statuses: Vec<(String, i64)> = sqlx::query_as(STATUSES).fetch_all(&mut conn).await.unwrap();
    let processed: Vec<String> = sqlx::query_scalar(PROCESSED)
        .fetch_all(&mut conn)
        .await
        .unwrap();
    conn.close().await.ok();
    State {
        balances: balances.into_iter().collect(),
        statuses: statuses.into_iter().collect(),
        processed: processed.into_iter().collect(),
    }
}

/// Balances exact; exactly the well-formed events applied, each once; nothing failed or dead.
pub fn assert_exact(state: &State) {
    let expected = expected();
    let valid = well_formed_event_ids();
    assert_eq!(
        valid.len() as u64,
        expected.processed,
        "the sample's well-formed events are its expected processed count"
    );
    let mismatched: Vec<_> = expected
        .balances
        .iter()
        .filter(|(account, balance)| state.balances.get(*account) != Some(*balance))
        .map(|(account, balance)| (account, *balance, state.balances.get(account)))
        .collect();
    assert!(
        mismatched.is_empty() && state.balances.len() == expected.balances.len(),
        "balances off (account, expected, found): {mismatched:?}"
    );
    assert_eq!(
        state.statuses,
        BTreeMap::from([("processed".to_owned(), expected.processed as i64)]),
        "one processed inbox row per event, nothing else"
    );
    let lost: Vec<_> = valid.difference(&state.processed).take(5).collect();
    let extra: Vec<_> = state.processed.difference(&valid).take(5).collect();
    assert!(
        lost.is_empty() && extra.is_empty(),
        "lost (not applied): {lost:?}; applied but not well-formed: {extra:?}"
    );
}
