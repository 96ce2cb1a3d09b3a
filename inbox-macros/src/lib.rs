//! Procedural macros of the `inbox` framework: `#[derive(Message)]`, `#[idempotent]` and
//! `handler!`.
//!
//! **Use them through `inbox-runtime`**, which re-exports both
//! (`use inbox_runtime::{Message, idempotent};`). The code they generate names
//! `::inbox_runtime::...` paths, so the crate using them must depend on `inbox-runtime` itself.
//!
//! * [`derive@Message`] implements `inbox_runtime::Message` for a struct: the routing name
//!   (`#[message(name = "...")]`, by default the type's name) and where the idempotency key comes
//!   from, either one field marked `#[message(key)]` or a template on the struct such as
//!   `#[message(key = "payment:{payment_id}:{attempt}")]`; optionally, with fields marked
//!   `#[message(aggregate)]` and `#[message(sequence)]`, its place in its aggregate's history.
//! * [`macro@idempotent`] turns an `async fn(conn: &mut Connection, msg: M) -> Result<T, E>`
//!   into an effectively-once handler: the body runs in the same transaction as the claim of
//!   the message's key, so its writes commit at most once per `(consumer, message key)`, and the
//!   function is registered for the `Dispatcher`. For messages with an aggregate and a
//!   sequence, it also applies them in order per aggregate (see
//!   [ordering](macro@idempotent#ordering)).
//! * [`macro@handler`] names the registration of an `#[idempotent]` function, for a dispatcher
//!   built from an explicit list instead of the `inventory` registry.
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

/// Derives `inbox_runtime::Message` for a struct with named fields: its routing name, its
/// idempotency key and, optionally, its ordering.
///
/// ```ignore
/// #[derive(Clone, Serialize, Deserialize, Message)]
/// #[message(name = "payments.refunded", key = "refund:{payment_id}:{seq}")]
/// struct PaymentRefunded {
///     #[message(aggregate)]
///     payment_id: String,
///     #[message(sequence)]
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
/// | `#[message(aggregate)]` | field | this field's value is the aggregate id (needs `sequence`) |
/// | `#[message(sequence)]` | field | this field's value is the sequence number (needs `aggregate`) |
///
/// Several markers can be on one field, in one attribute or several
/// (`#[message(key, aggregate)]`), except `aggregate` and `sequence` together.
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
/// # Ordering
///
/// Marking one field `#[message(aggregate)]` and one `#[message(sequence)]` implements
/// `Message::ordering`: which aggregate (an order, an account) the message is about, and where
/// it stands in that aggregate's history. Handlers of the message then apply the messages of one
/// aggregate in sequence order; see [ordering](macro@idempotent#ordering) for what that means. The
/// two markers go together, each on at most one field, and not on the same field; they combine
/// with either key source (the key field can also be the aggregate).
///
/// * The **aggregate** field's type must implement `inbox_runtime::KeyPart`, like a key field; a
///   `None` or empty value is a `KeyError` at run time.
/// * The **sequence** field's type must implement `inbox_runtime::SequencePart`: the integer
///   types and `Option` of them (implement it for your own newtypes). Sequences are positive
///   integers starting at 1, one more for each message of the aggregate; `None`, a value below 1
///   or beyond `i64::MAX` is a `KeyError` at run time.
///
/// Without the markers, messages have no ordering (unless a handler names the fields itself with
/// `#[idempotent(aggregate = "...", sequence = "...")]`) and are applied in whatever order they
/// arrive.
///
/// # Requirements
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
/// * `aggregate = "field"`, `sequence = "field"` (optional, both or neither): order the messages
///   by these two fields (see [Ordering](#ordering)) instead of by the message's own
///   `#[message(aggregate)]` / `#[message(sequence)]` fields. The field types must be as for those
///   markers: a `KeyPart` for the aggregate, a `SequencePart` (an integer) for the sequence.
/// * `gaps = "apply"` or `gaps = "park"` (optional, default `"apply"`): what to do with a message
///   that arrives before its predecessor (see [Ordering](#ordering)).
/// * `max_attempts = N` (optional, `N` ≥ 1): how many times a failing message is tried before it
///   is dead-lettered, overriding the dispatcher's retry policy.
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
/// # Ordering
///
/// When the message has an aggregate and a sequence (from its `#[message(aggregate)]` and
/// `#[message(sequence)]` fields, or from this handler's `aggregate` and `sequence` arguments),
/// the handler guards each aggregate's sequence. In the same transaction as the claim of the key,
/// it compares the message's sequence with the last one this consumer applied for the aggregate
/// (concurrent messages of one aggregate are serialized by the database):
///
/// * **not newer** (equal or lower): the message is recorded as consumed and **not applied**:
///   the outcome is `Outcome::Stale`, and the body does not run. A late `OrderPlaced` cannot
///   resurrect an order that was already cancelled.
/// * **the next one**: applied, and it becomes the aggregate's last applied sequence.
/// * **newer, with a gap** (messages in between have not been applied yet): depends on `gaps`:
///   * `gaps = "apply"` (the default): applied at once, skipping the gap; the missing messages,
///     if they come later, are stale. For state that each message overwrites whole.
///   * `gaps = "park"`: held back: the message is stored durably as parked (outcome
///     `Outcome::Parked`; the delivery can be acknowledged) and applied automatically, in order,
///     as soon as its predecessor has been applied, surviving restarts. For state built step by
///     step (placed → paid → shipped). A parked message whose gap stays open too long is
///     dead-lettered or released, as the dispatcher's park policy says.
///
/// Sequences are positive integers starting at 1, one more for each message of the aggregate:
/// the first message of an aggregate is sequence 1, so under `gaps = "park"` a sequence 2 that
/// comes first waits for sequence 1. Each consumer keeps its own position per aggregate.
///
/// ```ignore
/// #[idempotent(consumer = "orders", gaps = "park")]
/// async fn apply(conn: &mut sqlx::PgConnection, msg: OrderEvent) -> Result<(), sqlx::Error> {
///     // runs for sequence 1, 2, 3... of each order, in that order, each once
///     Ok(())
/// }
/// ```
///
/// # Registration
///
/// The handler is registered, so a `Dispatcher` built from the registry routes its messages to
/// it; it needs no call site and is not dead code. Alongside the function the macro defines a
/// hidden type `__inbox_handler_<name>` and a hidden constant `__inbox_registration_<name>`
/// (with the function's visibility) in the same module: do not name them (use
/// [`handler!`](macro@handler)), and do not use the macro inside an `impl` or a trait.
#[proc_macro_attribute]
pub fn idempotent(args: TokenStream, item: TokenStream) -> TokenStream {
    attr::idempotent(args.into(), item.into()).into()
}

/// The registration of one `#[idempotent]` function, named by its path:
/// `handler!(crate::ledger::credit)` is an `inbox_runtime::Registration`, for
/// `Dispatcher::from_handlers(pool, [handler!(credit), handler!(refund)])`: the explicit
/// alternative to the `inventory` registry (which cannot see handlers in a crate that nothing
/// references, since such a crate is not linked).
///
/// The path is the function's, as you would call it from here; the function must be visible
/// here and annotated with `#[idempotent]`.
///
/// ```ignore
/// let dispatcher = Dispatcher::from_handlers(pool, [
///     inbox_runtime::handler!(ledger::credit),
///     inbox_runtime::handler!(ledger::refund),
/// ])?;
/// ```
///
/// # Errors (at compile time)
/// Anything but a path without generic arguments is refused at the offending token. A path to a
/// function without `#[idempotent]` fails to resolve `__inbox_registration_<name>` at its last
/// segment.
#[proc_macro]
pub fn handler(input: TokenStream) -> TokenStream {
    expand::registration(input.into()).into()
}
