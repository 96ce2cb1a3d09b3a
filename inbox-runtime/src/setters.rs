//! The builder setters of the crate's configuration types, written once.

/// Builder setters that take `self` by value, set one field and return `self`.
///
/// Each entry is a doc comment (and any other attributes) and a signature without `mut self`
/// and return type, then either `;` (the field named like the setter takes the argument as
/// given) or a block of one assignment to a field of `self`, or to a field of what a method of
/// `self` without arguments returns (`self.config_mut().methods = …`):
///
/// ```ignore
/// setters! {
///     /// Sets [`ack_wait`](Self::ack_wait).
///     pub fn ack_wait(ack_wait: Duration);
///
///     /// Sets [`max_buffered`](Self::max_buffered) (at least 1).
///     pub fn max_buffered(records: usize) {
///         self.max_buffered = records.max(1);
///     }
/// }
/// ```
///
/// The second expands to `pub fn max_buffered(mut self, records: usize) -> Self {
/// self.max_buffered = records.max(1); self }`.
macro_rules! setters {
    () => {};
    (
        $(#[$attr:meta])*
        $vis:vis fn $name:ident($arg:ident: $ty:ty);
        $($rest:tt)*
    ) => {
        $crate::setters::setters! {
            $(#[$attr])*
            $vis fn $name($arg: $ty) {
                self.$name = $arg;
            }
            $($rest)*
        }
    };
    (
        $(#[$attr:meta])*
        $vis:vis fn $name:ident($arg:ident: $ty:ty) {
            self.$field:ident$(().$inner:ident)? = $value:expr;
        }
        $($rest:tt)*
    ) => {
        $(#[$attr])*
        $vis fn $name(mut self, $arg: $ty) -> Self {
            self.$field$(().$inner)? = $value;
            self
        }
        $crate::setters::setters!($($rest)*);
    };
}
pub(crate) use setters;
