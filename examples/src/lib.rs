//! Runnable examples of the `inbox` crates; this library is empty.
//!
//! * `cargo run --example ledger -- [PATH|-]`: the ledger demo. It feeds a
//!   stream of payment events, with redeliveries, conflicts and malformed
//!   lines, through `#[idempotent]` handlers on SQLite or PostgreSQL and
//!   checks the resulting balances against the ground truth.
//! * `cargo run --example ledger-gen -- [--seed N] [--out DIR]`: regenerates
//!   the ledger demo's deterministic sample data in `examples/ledger/data`.
//! * `cargo run --example pipeline`: two services joined by the transactional
//!   outbox (orders consumes `payments.captured` and publishes `orders.paid`,
//!   a relay sends it, shipping consumes it), checked end to end; in one process
//!   or as separate processes on RabbitMQ or NATS.
