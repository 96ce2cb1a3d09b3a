//! Compile-time tests of `#[derive(Message)]` and `#[idempotent]`: every error the macros emit
//! (`ui/fail`, with the expected compiler output next to each case) and a few uses that must
//! compile (`ui/pass`). Regenerate the expected output with `TRYBUILD=overwrite`.

#[test]
fn ui() {
    let t = trybuild::TestCases::new();
    t.pass("ui/pass/*.rs");
    t.compile_fail("ui/fail/*.rs");
}
