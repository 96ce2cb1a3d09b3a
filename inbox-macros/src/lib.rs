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
//! ```no_run
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
//! in one compile, each at the token it is about. After a mistake they still emit what the rest
//! of the code relies on (the function with the signature `#[idempotent]` gives it, an
//! `impl Message` for a type that is not generic), so that its uses get no errors of their own.

mod args;
mod attr;
mod ctxt;
mod expand;
mod message;
mod template;

use proc_macro::TokenStream;
use syn::DeriveInput;

/// Derives `inbox_runtime::Message` for a struct with named fields: its routing name, its
/// idempotency key and, optionally, its ordering.
///
/// ```no_run
/// # use inbox_runtime::Message;
/// # use serde::{Deserialize, Serialize};
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
/// * **a key field**, `#[message(key)]`: its type must implement `inbox_runtime::types::KeyPart`
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
/// * The **aggregate** field's type must implement `inbox_runtime::types::KeyPart`, like a key
///   field; a `None` or empty value is a `KeyError` at run time.
/// * The **sequence** field's type must implement `inbox_runtime::types::SequencePart`: the integer
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
    derive_message_impl(input.into()).into()
}

/// Makes an `async fn` an effectively-once handler of one message type.
///
/// ```no_run
/// # use inbox_runtime::{idempotent, Message, Outcome};
/// # #[derive(Clone, serde::Serialize, serde::Deserialize, Message)]
/// # struct PaymentCaptured {
/// #     event_id: uuid::Uuid,
/// #     #[message(key)]
/// #     delivery_id: String,
/// # }
/// #[idempotent(consumer = "ledger", key = "event_id")]
/// pub async fn credit(conn: &mut sqlx::PgConnection, msg: PaymentCaptured) -> Result<(), sqlx::Error> {
///     /* writes through `conn` */
///     Ok(())
/// }
///
/// # async fn demo(pool: sqlx::PgPool, msg: PaymentCaptured) -> Result<(), Box<dyn std::error::Error>> {
/// # let mut conn = pool.acquire().await?;
/// // The function now returns Result<Outcome<()>, inbox_runtime::Error<sqlx::Error>>:
/// match credit(&mut conn, msg).await? {
///     Outcome::Processed(()) => {}  // ran, and committed with the claim of the key
///     Outcome::Duplicate => {}      // already processed: nothing ran
///     _ => {}
/// }
/// # Ok(()) }
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
/// parameters: the connection, `&mut sqlx::PgConnection`, `&mut sqlx::SqliteConnection` or
/// `&mut sqlx::MySqlConnection` (or the transaction `&mut DynamoTx`, see
/// [On DynamoDB](#on-dynamodb)), then the message, by value. It returns a `Result<T, E>`, possibly through an alias such as
/// `anyhow::Result<T>`; `E` must be an error that converts into `inbox_runtime::BoxError`.
///
/// The function keeps its name, visibility, documentation and attributes, and becomes a wrapper
/// returning `Result<Outcome<T>, inbox_runtime::Error<E>>`. The original body moves into a
/// nested function; `#[allow]`, `#[warn]`, `#[deny]` and `#[forbid]` are copied onto it, and
/// `#[expect]` moved to it, so that lint attributes still reach the body. A `#[cfg]` under
/// `#[idempotent]` applies to everything generated.
///
/// # On DynamoDB
///
/// With inbox-runtime's `dynamodb` feature, a handler whose first parameter is `&mut DynamoTx`
/// (any path ending in `DynamoTx`: `inbox_runtime::dynamodb::DynamoTx`, or the type imported)
/// adds its DynamoDB actions to the transaction, and the runtime submits them with the claim as
/// one `TransactWriteItems`. The function becomes
/// `fn(inbox: &DynamoInbox, msg: M) -> Result<Outcome<T>, inbox_runtime::dynamodb::DynamoError<E>>`,
/// and registers for `inbox_runtime::dynamodb::DynamoDispatcher` (not for the SQL `Dispatcher`).
/// `consumer`, `key`, `max_attempts`, the error's class and per-aggregate ordering (`aggregate`,
/// `sequence`, `gaps = "park"`: positions and parked messages in the inbox table, see
/// `inbox_runtime::dynamodb`'s module `ordering`) work as on SQL. Such a handler without the
/// `dynamodb` feature is a compile error (the error names it, at the first parameter). The
/// example is compiled in `inbox_runtime::dynamodb`'s documentation (this crate's doc tests
/// build inbox-runtime without the feature).
///
/// ```ignore
/// use inbox_runtime::dynamodb::DynamoTx;
///
/// #[idempotent(consumer = "ledger")]
/// async fn credit(tx: &mut DynamoTx, msg: PaymentCaptured) -> Result<(), inbox_runtime::Permanent> {
///     /* tx.update(...) */
///     Ok(())
/// }
/// // credit(&inbox, msg).await: Result<Outcome<()>, DynamoError<Permanent>>
/// ```
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
/// ```no_run
/// # use inbox_runtime::{idempotent, Message};
/// # #[derive(Clone, serde::Serialize, serde::Deserialize, Message)]
/// # #[message(key = "{order_id}:{seq}")]
/// # struct OrderEvent {
/// #     #[message(aggregate)]
/// #     order_id: String,
/// #     #[message(sequence)]
/// #     seq: u64,
/// # }
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
    idempotent_impl(args.into(), item.into()).into()
}

/// The registration of one `#[idempotent]` function, named by its path:
/// `handler!(crate::ledger::credit)` is an `inbox_runtime::dispatch::Registration`, for
/// `Dispatcher::from_handlers(pool, [handler!(credit), handler!(refund)])`: the explicit
/// alternative to the `inventory` registry (which cannot see handlers in a crate that nothing
/// references, since such a crate is not linked).
///
/// The path is the function's, as you would call it from here; the function must be visible
/// here and annotated with `#[idempotent]`.
///
/// ```no_run
/// # mod ledger {
/// #     use inbox_runtime::{idempotent, Message};
/// #     #[derive(Clone, serde::Serialize, serde::Deserialize, Message)]
/// #     pub struct Payment {
/// #         #[message(key)]
/// #         pub event_id: uuid::Uuid,
/// #     }
/// #     #[idempotent(consumer = "ledger")]
/// #     pub async fn credit(conn: &mut sqlx::PgConnection, msg: Payment) -> Result<(), sqlx::Error> {
/// #         Ok(())
/// #     }
/// #     #[idempotent(consumer = "ledger-refunds")]
/// #     pub async fn refund(conn: &mut sqlx::PgConnection, msg: Payment) -> Result<(), sqlx::Error> {
/// #         Ok(())
/// #     }
/// # }
/// # use inbox_runtime::Dispatcher;
/// # fn demo(pool: sqlx::PgPool) -> Result<(), Box<dyn std::error::Error>> {
/// let dispatcher = Dispatcher::from_handlers(pool, [
///     inbox_runtime::handler!(ledger::credit),
///     inbox_runtime::handler!(ledger::refund),
/// ])?;
/// # Ok(()) }
/// ```
///
/// # Errors (at compile time)
/// Anything but a path without generic arguments is refused at the offending token. A path to a
/// function without `#[idempotent]` fails to resolve `__inbox_registration_<name>` at its last
/// segment.
#[proc_macro]
pub fn handler(input: TokenStream) -> TokenStream {
    handler_impl(input.into()).into()
}

// The macros on `proc_macro2` tokens, which unit tests can call (`proc_macro` tokens exist only
// inside a macro invocation): parse and check everything ([`attr`], [`message`]), then generate
// ([`expand`]).

/// [`derive@Message`]: on error, the errors and, for a type that is not generic, a placeholder
/// `impl Message`, so that the uses of the message do not fail too.
fn derive_message_impl(input: proc_macro2::TokenStream) -> proc_macro2::TokenStream {
    let input = match syn::parse2::<DeriveInput>(input) {
        Ok(input) => input,
        Err(e) => return e.to_compile_error(),
    };
    match message::parse(&input) {
        Ok(def) => expand::message(&def),
        Err(e) => {
            let fallback = message::fallback(&input).map(expand::message_fallback);
            ctxt::error_output(&e, fallback.unwrap_or_default())
        }
    }
}

/// [`macro@idempotent`]: on error, the errors and the function with the signature it would have
/// had, so that its callers do not fail too; the item unchanged if that signature is too broken
/// to expand.
fn idempotent_impl(
    args: proc_macro2::TokenStream,
    item: proc_macro2::TokenStream,
) -> proc_macro2::TokenStream {
    match attr::parse(args, item.clone()) {
        Ok(handler) => expand::handler(&handler),
        Err(e) => {
            let fallback = attr::fallback(item.clone()).map(|f| expand::fallback(&f));
            ctxt::error_output(&e, fallback.unwrap_or(item))
        }
    }
}

/// [`macro@handler`]: on error, the errors alone.
fn handler_impl(input: proc_macro2::TokenStream) -> proc_macro2::TokenStream {
    match attr::parse_handler_path(input) {
        Ok(path) => expand::registration(path),
        Err(e) => e.to_compile_error(),
    }
}

/// The macros' output as a whole; the parsers' own checks are tested in their modules.
#[cfg(test)]
mod tests {
    use super::*;
    use proc_macro2::TokenStream;
    use quote::quote;

    fn item() -> TokenStream {
        quote!(
            async fn h(c: &mut C, m: M) -> Result<(), E> {
                Ok(())
            }
        )
    }

    #[test]
    fn idempotent_generates_valid_rust() {
        let output = idempotent_impl(
            quote!(consumer = "ledger", key = "event_id"),
            quote! {
                #[cfg(feature = "pg")]
                #[expect(clippy::needless_return)]
                pub(crate) async fn credit(conn: &mut PgConnection, msg: Msg) -> Result<u8, E> {
                    return Ok(1);
                }
            },
        );
        let file: syn::File = syn::parse2(output.clone()).unwrap_or_else(|e| panic!("{e}"));
        // struct, impl HandlerSpec, impl Handler, registration const, submit!, the use of the
        // wrapper, the wrapper: each under the `cfg`.
        assert_eq!(file.items.len(), 7);
        let text = output.to_string();
        assert!(text.contains("struct __inbox_handler_credit"), "{text}");
        assert!(
            text.contains("pub (crate) const __inbox_registration_credit"),
            "{text}"
        );
        assert_eq!(
            text.matches("# [cfg (feature = \"pg\")]").count(),
            7,
            "{text}"
        );
        // `#[expect]` moves to the body: once, not on the wrapper.
        assert_eq!(text.matches("expect").count(), 1, "{text}");
        assert!(
            text.contains("async fn __inbox_body (conn : & mut PgConnection , msg : Msg)"),
            "{text}"
        );
    }

    #[test]
    fn idempotent_generates_ordering_and_gaps() {
        let text = idempotent_impl(
            quote!(
                consumer = "c",
                aggregate = "order_id",
                sequence = "type",
                gaps = "park"
            ),
            item(),
        )
        .to_string();
        assert!(
            text.contains(
                "const GAPS : :: inbox_runtime :: GapPolicy = :: inbox_runtime :: GapPolicy :: \
                 Park ;"
            ),
            "{text}"
        );
        assert!(text.contains("fn ordering (msg : & M ,)"), "{text}");
        assert!(
            text.contains("let inbox_aggregate_msg = msg ; let inbox_sequence_msg = msg ;"),
            "{text}"
        );
        assert!(
            text.contains(
                ":: inbox_runtime :: __private :: ordering_from_fields (< M as :: \
                 inbox_runtime :: Message > :: NAME , \"order_id\" , & inbox_aggregate_msg . order_id , \
                 \"type\" , & inbox_sequence_msg . r#type ,)"
            ),
            "{text}"
        );
        let text = idempotent_impl(quote!(consumer = "c", gaps = "apply"), item()).to_string();
        assert!(!text.contains("GAPS"), "{text}");
        assert!(!text.contains("ordering"), "{text}");
    }

    #[test]
    fn idempotent_errors_keep_the_item() {
        let output = idempotent_impl(
            quote!(),
            quote!(
                async fn kept() {}
            ),
        );
        let text = output.to_string();
        assert!(text.contains("compile_error"), "{text}");
        assert!(text.contains("async fn kept () { }"), "{text}");
    }

    #[test]
    fn idempotent_errors_keep_the_expanded_signature() {
        let output = idempotent_impl(
            quote!(consumer = "c", gaps = "wait"),
            quote! {
                /// Docs.
                #[cfg(feature = "pg")]
                #[expect(clippy::needless_return)]
                pub fn credit<'c>(conn: &'c mut PgConnection, Msg { id }: Msg) -> Result<u8, E> {
                    return Ok(id);
                }
            },
        );
        let file: syn::File = syn::parse2(output.clone()).unwrap_or_else(|e| panic!("{e}"));
        // Three errors (the gap policy, not `async`, generic), the use of the function, the
        // function.
        assert_eq!(file.items.len(), 5, "{output}");
        let text = output.to_string();
        assert_eq!(text.matches("compile_error").count(), 3, "{text}");
        assert!(
            text.contains(
                "pub async fn credit < 'c > (_ : & 'c mut PgConnection , _ : Msg) -> :: core :: \
                 result :: Result < :: inbox_runtime :: Outcome < < Result < u8 , E > as :: \
                 inbox_runtime :: __private :: HandlerResult > :: Ok > , :: inbox_runtime :: \
                 Error < < Result < u8 , E > as :: inbox_runtime :: __private :: HandlerResult > \
                 :: Err > , >"
            ),
            "{text}"
        );
        // The body, checked as written but `async`, with `#[expect]` moved to it.
        assert!(
            text.contains(
                "# [expect (clippy :: needless_return)] async fn __inbox_body < 'c > (conn : & \
                 'c mut PgConnection , Msg { id } : Msg) -> Result < u8 , E > { return Ok (id) ; }"
            ),
            "{text}"
        );
        assert_eq!(text.matches("# [expect").count(), 1, "{text}");
        assert_eq!(
            text.matches("# [cfg (feature = \"pg\")]").count(),
            2,
            "{text}"
        );
        assert!(
            text.contains("const _ : () = { let _ = credit ; } ;"),
            "{text}"
        );
        assert!(!text.contains("__inbox_handler"), "{text}");
    }

    #[test]
    fn idempotent_fallback_keeps_generics_and_parameters() {
        let text = idempotent_impl(
            quote!(consumer = "c"),
            quote!(
                async unsafe fn h<M: Message>(c: &C, m: &M, extra: u8) -> anyhow::Result<()>
                where
                    M: Clone,
                {
                    Ok(())
                }
            ),
        )
        .to_string();
        assert!(
            text.contains("async fn h < M : Message > (_ : & C , _ : & M , _ : u8) ->"),
            "{text}"
        );
        assert!(
            text.contains("async unsafe fn __inbox_body < M : Message > (c : & C , m : & M"),
            "{text}"
        );
        assert_eq!(text.matches("where M : Clone").count(), 2, "{text}");
        // A function with a type parameter cannot be named alone, even an `impl Trait` one.
        assert!(!text.contains("let _ = h"), "{text}");
        let text = idempotent_impl(
            quote!(consumer = "c"),
            quote!(
                async fn o(c: &mut C, m: impl M) -> Result<(), E> {
                    Ok(())
                }
            ),
        )
        .to_string();
        assert!(
            text.contains("async fn o (_ : & mut C , _ : impl M)"),
            "{text}"
        );
        assert!(!text.contains("let _ = o"), "{text}");
    }

    #[test]
    fn idempotent_fallback_needs_an_expandable_signature() {
        for item in [
            quote!(
                async fn none(c: &mut C, m: M) {}
            ),
            quote!(
                async fn unit(c: &mut C, m: M) -> () {}
            ),
            quote!(
                async fn opaque(c: &mut C, m: M) -> impl Sized {}
            ),
            quote!(
                async fn method(&self, c: &mut C, m: M) -> Result<(), E> {
                    Ok(())
                }
            ),
            quote!(
                struct NotAFunction;
            ),
        ] {
            let text = idempotent_impl(quote!(consumer = "c"), item.clone()).to_string();
            assert!(text.ends_with(&item.to_string()), "{text}");
            assert!(!text.contains("__inbox_body"), "{text}");
        }
    }

    #[test]
    fn message_errors_keep_a_placeholder_impl() {
        let output = derive_message_impl(quote! {
            #[message(topic = "t")]
            struct r#Placed { #[message(key)] id: u64 }
        });
        let file: syn::File = syn::parse2(output.clone()).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(file.items.len(), 2, "{output}");
        let text = output.to_string();
        assert!(
            text.contains(
                "impl :: inbox_runtime :: Message for r#Placed where for < '__inbox > r#Placed : \
                 :: inbox_runtime :: __private :: Serialize"
            ),
            "{text}"
        );
        assert!(text.contains("const NAME : & 'static :: core :: primitive :: str = \"Placed\""));
        // No placeholder for a generic type.
        let output = derive_message_impl(quote! {
            struct S<T> { #[message(key)] id: T }
        });
        assert!(!output.to_string().contains("impl"), "{output}");
    }

    #[test]
    fn message_generates_ordering() {
        let output = derive_message_impl(quote! {
            struct S {
                #[message(key)] id: u64,
                #[message(aggregate)] r#type: String,
                #[message(sequence)] seq: Option<u32>,
            }
        });
        let item: syn::ItemImpl = syn::parse2(output.clone()).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(item.items.len(), 3);
        let text = output.to_string();
        assert!(
            text.contains(
                ":: inbox_runtime :: __private :: ordering_from_fields (< Self as :: \
                 inbox_runtime :: Message > :: NAME , \"type\" , __inbox_key_part :: < String \
                 > (& self . r#type) , \"seq\" , __inbox_sequence_part :: < Option < u32 > > \
                 (& self . seq) ,)"
            ),
            "{text}"
        );
        assert!(
            text.contains(
                "fn __inbox_sequence_part < T : :: inbox_runtime :: __private :: SequencePart >"
            ),
            "{text}"
        );
        // Without markers, the trait's default applies.
        let output = derive_message_impl(quote! {
            struct S { #[message(key)] id: u64 }
        });
        assert!(!output.to_string().contains("ordering"), "{output}");
    }

    #[test]
    fn message_generates_valid_rust() {
        let output = derive_message_impl(quote! {
            #[message(key = "a:{a}:{b}")]
            struct S { a: u8, b: String }
        });
        let item: syn::ItemImpl = syn::parse2(output.clone()).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(item.items.len(), 2);
        let text = output.to_string();
        assert!(text.contains("key_from_template"), "{text}");
        assert!(
            text.contains("__inbox_key_part :: < u8 > (& self . a)"),
            "{text}"
        );
    }

    #[test]
    fn handler_names_the_registration() {
        let text = handler_impl(quote!(crate::ledger::r#credit)).to_string();
        assert_eq!(text, "crate :: ledger :: __inbox_registration_credit");
        for input in [quote!(), quote!(credit()), quote!(ledger::credit::<u8>)] {
            let text = handler_impl(input).to_string();
            assert!(text.contains("compile_error"), "{text}");
        }
    }
}
