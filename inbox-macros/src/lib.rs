//! Procedural macros of the `inbox` framework. **Use them through `inbox-runtime`**, which
//! re-exports both: `use inbox_runtime::{Message, idempotent};`. The code they generate names
//! `::inbox_runtime::...` paths, so the crate using them must depend on `inbox-runtime` directly.
//!
//! # `#[derive(Message)]`
//!
//! Implements `inbox_runtime::Message` for a struct with named fields: its routing name and how
//! to read its idempotency key. The struct must also implement `Serialize`, `Deserialize`,
//! `Clone`, `Send`, `Sync` and be `'static`.
//!
//! ```ignore
//! use inbox_runtime::Message;
//! use serde::{Deserialize, Serialize};
//!
//! #[derive(Clone, Serialize, Deserialize, Message)]
//! #[message(name = "payments.captured")] // optional; defaults to the type's name
//! struct PaymentCaptured {
//!     #[message(key)] // the producer's event id identifies the message
//!     event_id: uuid::Uuid,
//!     payment_id: String,
//!     amount_cents: i64,
//! }
//! ```
//!
//! The key comes from exactly one of:
//!
//! * **one field**, marked `#[message(key)]`. Its type must implement `inbox_runtime::KeyPart`
//!   (strings, integers, `char`, `bool`, `Uuid`, and `Option`, `&`, `Box`, `Arc` of those;
//!   `None` is a key error at run time);
//! * **a template** on the struct, `#[message(key = "payment:{payment_id}:{attempt}")]`, where
//!   each `{field}` is replaced by that field's value and `{{` / `}}` are literal braces. Every
//!   placeholder must name a field, and a template needs at least one placeholder (a constant
//!   key would make every message a duplicate of the first).
//!
//! | attribute | where | meaning |
//! | --- | --- | --- |
//! | `#[message(name = "...")]` | struct | routing name, `Message::NAME` (default: the type's name) |
//! | `#[message(key = "...")]` | struct | key template |
//! | `#[message(key)]` | field | this field is the key |
//!
//! Generic types, tuple and unit structs, enums and unions are rejected at compile time.
//!
//! # `#[idempotent(consumer = "...", key = "...")]`
//!
//! Turns an `async fn` into an effectively-once handler: the body runs at most once per
//! `(consumer, message key)`, in the caller's transaction, and a redelivered message returns
//! `Outcome::Duplicate` instead of running it again.
//!
//! ```ignore
//! use inbox_runtime::idempotent;
//!
//! /// Credits the account once per captured payment.
//! #[idempotent(consumer = "ledger")]
//! pub async fn credit(
//!     conn: &mut sqlx::PgConnection,
//!     msg: PaymentCaptured,
//! ) -> Result<(), sqlx::Error> {
//!     sqlx::query("UPDATE accounts SET balance = balance + $1 WHERE id = $2")
//!         .bind(msg.amount_cents)
//!         .bind(&msg.payment_id)
//!         .execute(&mut *conn)
//!         .await?;
//!     Ok(())
//! }
//!
//! // Called directly, the handler now returns
//! // Result<Outcome<()>, inbox_runtime::Error<sqlx::Error>>:
//! // let outcome = credit(&mut tx, msg).await?;
//! ```
//!
//! Arguments:
//!
//! * `consumer = "..."` (required): the name under which this handler records what it has
//!   processed. Two handlers of the same message need different consumers; renaming a consumer
//!   makes it process every message again.
//! * `key = "field"` (optional): take the key from this field of the message instead of from
//!   the message's own `Message::idempotency_key`.
//!
//! The function must be a free `async fn`, not generic, with exactly two parameters: the
//! connection as `&mut sqlx::PgConnection` (or `&mut sqlx::SqliteConnection`), then the message
//! by value. It must return `Result<T, E>` (or an alias of it, such as `anyhow::Result<T>`).
//!
//! The function keeps its name, visibility, documentation and attributes, and becomes a wrapper
//! returning `Result<Outcome<T>, inbox_runtime::Error<E>>`. It is also registered, so that a
//! `Dispatcher` built with `Dispatcher::from_registry` routes messages to it. The original body
//! runs inside a nested function, to which `#[allow]`/`#[warn]`/`#[deny]`/`#[forbid]`
//! attributes are copied and `#[expect]` attributes are moved.
//!
//! Alongside the function, the macro defines a hidden type `__inbox_handler_<name>` in the same
//! module; do not name it.

mod args;
mod attr;
mod ctxt;
mod expand;
mod message;
mod template;

use proc_macro::TokenStream;

/// Derives `inbox_runtime::Message`: a routing name and an idempotency key.
///
/// See the [crate documentation](crate#derivemessage) for the `#[message(...)]` attributes.
#[proc_macro_derive(Message, attributes(message))]
pub fn derive_message(input: TokenStream) -> TokenStream {
    message::derive(input.into()).into()
}

/// Makes an `async fn` an effectively-once handler of one message type.
///
/// See the [crate documentation](crate#idempotentconsumer--key--) for its arguments and the
/// shape the function must have.
#[proc_macro_attribute]
pub fn idempotent(args: TokenStream, item: TokenStream) -> TokenStream {
    attr::idempotent(args.into(), item.into()).into()
}
