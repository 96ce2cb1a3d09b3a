//! Procedural macros of the `inbox` framework: `#[derive(Message)]` and `#[idempotent]`.
//!
//! **Use them through `inbox-runtime`**, which re-exports both
//! (`use inbox_runtime::{Message, idempotent};`). The code they generate names
//! `::inbox_runtime::...` paths, so the crate using them must depend on `inbox-runtime` itself.
//!
//! * [`derive@Message`] implements `inbox_runtime::Message` for a struct: the routing name
//!   (`#[message(name = "...")]`, by default the type's name) and where the idempotency key comes
//!   from, either one field marked `#[message(key)]` or a template on the struct such as
//!   `#[message(key = "payment:{payment_id}:{attempt}")]`.
//! * [`macro@idempotent`] turns an `async fn(conn: &mut Connection, msg: M) -> Result<T, E>`
//!   into an effectively-once handler: the body runs in the same transaction as the claim of
//!   the message's key, so its writes commit at most once per `(consumer, message key)`, and the
//!   function is registered for the `Dispatcher`.
//!
//! ```ignore
//! use inbox_runtime::{idempotent, Message};
//! use serde::{Deserialize, Serialize};
//!
//! #[derive(Clone, Serialize, Deserialize, Message)]
//! #[message(name = "payments.captured")]
//! struct PaymentCaptured {
//!     #[message(key)]
//!     event_id: uuid::Uuid,
//!     account_id: String,
//!     amount_cents: i64,
//! }
//!
//! /// Credits the account once per captured payment.
//! #[idempotent(consumer = "ledger")]
//! pub async fn credit(
//!     conn: &mut sqlx::PgConnection,
//!     msg: PaymentCaptured,
//! ) -> Result<(), sqlx::Error> {
//!     sqlx::query("UPDATE accounts SET balance = balance + $1 WHERE id = $2")
//!         .bind(msg.amount_cents)
//!         .bind(&msg.account_id)
//!         .execute(conn)
//!         .await?;
//!     Ok(())
//! }
//! ```
//!
//! Both macros check their input before generating anything and report every mistake they find
//! in one compile, each at the token it is about.

mod args;
mod attr;
mod ctxt;
mod expand;
mod message;
mod template;

use proc_macro::TokenStream;

/// Derives `inbox_runtime::Message` for a struct with named fields: its routing name and its
/// idempotency key.
///
/// ```ignore
/// #[derive(Clone, Serialize, Deserialize, Message)]
/// #[message(name = "payments.refunded", key = "refund:{payment_id}:{seq}")]
/// struct PaymentRefunded {
///     payment_id: String,
///     seq: u32,
///     amount_cents: i64,
/// }
/// ```
///
/// | attribute | on | meaning |
/// | --- | --- | --- |
/// | `#[message(name = "...")]` | struct | routing name, `Message::NAME`; default: the type's name |
/// | `#[message(key = "...")]` | struct | key template |
/// | `#[message(key)]` | field | this field's value is the key |
///
/// Exactly one key source is required:
///
/// * **a key field**, `#[message(key)]`: its type must implement `inbox_runtime::KeyPart`
///   (strings, integers, `char`, `bool`, `Uuid`, and `&`, `Box`, `Arc`, `Option` of those). A
///   `None` or empty value is a `KeyError` at run time.
/// * **a key template**: each `{field}` is replaced by that field's value (a `KeyPart` too, which
///   must not be null or empty); `{{` and `}}` are literal braces. Every placeholder must name a
///   field, and at least one placeholder is required: a constant key would make every message a
///   duplicate of the first.
///
/// The struct must also be `Serialize + DeserializeOwned + Clone + Send + Sync + 'static`.
/// Generic structs, tuple and unit structs, enums and unions are rejected.
#[proc_macro_derive(Message, attributes(message))]
pub fn derive_message(input: TokenStream) -> TokenStream {
    message::derive(input.into()).into()
}

/// Makes an `async fn` an effectively-once handler of one message type.
///
/// ```ignore
/// #[idempotent(consumer = "ledger", key = "event_id")]
/// pub async fn credit(conn: &mut sqlx::PgConnection, msg: PaymentCaptured) -> Result<(), sqlx::Error> {
///     /* writes through `conn` */
///     Ok(())
/// }
///
/// // The function now returns Result<Outcome<()>, inbox_runtime::Error<sqlx::Error>>:
/// match credit(&mut conn, msg).await? {
///     Outcome::Processed(()) => {}  // ran, and committed with the claim of the key
///     Outcome::Duplicate => {}      // already processed: nothing ran
///     _ => {}
/// }
/// ```
///
/// # Arguments
///
/// * `consumer = "..."` (required): the name under which this handler records the keys it has
///   processed. Two handlers of one message need different consumers; renaming a consumer makes
///   it process every message again.
/// * `key = "field"` (optional): take the key from this field of the message instead of from
///   its `Message::idempotency_key`.
///
/// # The function
///
/// A free `async fn` (not a method, not generic, not `const`/`unsafe`/`extern`) with exactly two
/// parameters: the connection, `&mut sqlx::PgConnection` or `&mut sqlx::SqliteConnection`, then
/// the message, by value. It returns a `Result<T, E>`, possibly through an alias such as
/// `anyhow::Result<T>`; `E` must be an error that converts into `inbox_runtime::BoxError`.
///
/// The function keeps its name, visibility, documentation and attributes, and becomes a wrapper
/// returning `Result<Outcome<T>, inbox_runtime::Error<E>>`. The original body moves into a
/// nested function; `#[allow]`, `#[warn]`, `#[deny]` and `#[forbid]` are copied onto it, and
/// `#[expect]` moved to it, so that lint attributes still reach the body. A `#[cfg]` under
/// `#[idempotent]` applies to everything generated.
///
/// The handler is registered, so a `Dispatcher` built from the registry routes its messages to
/// it; it needs no call site and is not dead code. Alongside the function the macro defines a
/// hidden type `__inbox_handler_<name>` in the same module: do not name it, and do not use the
/// macro inside an `impl` or a trait.
#[proc_macro_attribute]
pub fn idempotent(args: TokenStream, item: TokenStream) -> TokenStream {
    attr::idempotent(args.into(), item.into()).into()
}
