//! `Debug` for the crate's types that hold clients, connections or tasks, written once.

use std::fmt;

/// Writes `name { field: value, .. }`: the fields worth showing of a type whose other fields
/// are not (clients, connections, tasks), as `debug_struct(name)…finish_non_exhaustive()`.
pub(crate) fn some_fields(
    f: &mut fmt::Formatter<'_>,
    name: &str,
    fields: &[(&str, &dyn fmt::Debug)],
) -> fmt::Result {
    let mut out = f.debug_struct(name);
    for (field, value) in fields {
        out.field(field, value);
    }
    out.finish_non_exhaustive()
}
