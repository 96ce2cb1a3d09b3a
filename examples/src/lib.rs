//! Runnable examples of the `inbox` crates; this library is empty.
//!
//! * `cargo run --example ledger -- [PATH|-]`: the ledger demo. It feeds a
//!   stream of payment events, with redeliveries, conflicts and malformed
//!   lines, through `#[idempotent]` handlers on SQLite or PostgreSQL and
//!   checks the resulting balances against the ground truth.
//! * `cargo run --example ledger-gen -- [--seed N] [--out DIR]`: regenerates
//!   the ledger demo's deterministic sample data in `examples/ledger/data`.
