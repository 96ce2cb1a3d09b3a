//! The ground truth (`expected.json`, written by `ledger-gen`) and the comparison with it.

use std::collections::BTreeMap;
use std::path::Path;

use serde::Deserialize;

use crate::feed::Counts;

/// What a stream should do to a fresh database. Other fields of the file are ignored.
#[derive(Debug, Deserialize)]
pub(crate) struct Expected {
    pub(crate) processed: u64,
    pub(crate) duplicates: u64,
    pub(crate) conflicts: u64,
    pub(crate) rejected: u64,
    /// Every account touched by an applied event, with the sum of its applied events.
    pub(crate) balances: BTreeMap<String, i64>,
}

impl Expected {
    pub(crate) fn load(path: &Path) -> Result<Self, String> {
        let text = std::fs::read_to_string(path)
            .map_err(|e| format!("cannot read {}: {e}", path.display()))?;
        serde_json::from_str(&text).map_err(|e| format!("cannot parse {}: {e}", path.display()))
    }

    /// The differences between these counts and `counts` (meaningful for a fresh database
    /// only: on a second run everything is a duplicate).
    pub(crate) fn count_mismatches(&self, counts: &Counts) -> Vec<String> {
        [
            ("processed", self.processed, counts.processed),
            ("duplicates", self.duplicates, counts.duplicates),
            ("conflicts", self.conflicts, counts.conflicts),
            ("rejected", self.rejected, counts.rejected),
        ]
        .into_iter()
        .filter(|(_, expected, found)| expected != found)
        .map(|(name, expected, found)| format!("{name}: expected {expected}, found {found}"))
        .collect()
    }

    /// The accounts whose balance differs, is missing or should not exist, one line each.
    pub(crate) fn balance_mismatches(&self, found: &BTreeMap<String, i64>) -> Vec<String> {
        let mut mismatches = Vec::new();
        for (account, &expected) in &self.balances {
            match found.get(account) {
                Some(&balance) if balance == expected => {}
                Some(&balance) => mismatches.push(format!(
                    "{account}: expected {expected}, found {balance} (off by {})",
                    balance - expected
                )),
                None => {
                    mismatches.push(format!("{account}: expected {expected}, found no account"))
                }
            }
        }
        for (account, balance) in found {
            if !self.balances.contains_key(account) {
                mismatches.push(format!("{account}: expected no account, found {balance}"));
            }
        }
        mismatches
    }
}
