//! Compile-time tests of `#[derive(Message)]` and `#[idempotent]`: every error the macros emit
//! (`ui/fail`, with the expected compiler output next to each case) and a few uses that must
//! compile (`ui/pass`). Regenerate the expected output with `TRYBUILD=overwrite`.
//!
//! A package of its own: trybuild builds the cases against this package's dependencies, from
//! scratch in a target directory of its own (`target/tests/trybuild`), so they are only what the
//! cases use.

use std::sync::Once;

/// The build trybuild runs (its cargo inherits this process's environment): no debug info — the
/// cases are compiled for their diagnostics, or run once — so that a fresh build of their
/// dependencies costs less time and disk.
fn configure() {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        // SAFETY: called first by each test of this binary, before any of them starts a thread
        // or a process; the test harness reads no environment variable meanwhile.
        unsafe { std::env::set_var("CARGO_PROFILE_DEV_DEBUG", "false") };
    });
}

/// The uses that must compile (built and run one by one).
#[test]
fn pass() {
    configure();
    trybuild::TestCases::new().pass("ui/pass/*.rs");
}

/// The errors. A run of trybuild without pass cases checks them all in one `cargo check
/// --keep-going` (with pass cases it builds each on its own): hence a test of their own.
#[test]
fn compile_fail() {
    configure();
    trybuild::TestCases::new().compile_fail("ui/fail/*.rs");
}
