//! Workspace-level tests of `inbox`: compile-fail (UI) tests of the macros in `ui.rs` and
//! `ui/`, and tests of the generated code in `macros.rs`. This library is empty on purpose.
