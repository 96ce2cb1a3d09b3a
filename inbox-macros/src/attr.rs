//! `#[idempotent(...)]`: argument parsing and validation of the handler's signature; and the
//! path given to `handler!`, which names such a handler.
//!
//! Everything is checked before anything is generated, and every problem found is reported at
//! once, each at the token it is about.

use crate::args::{self, MetaList};
use crate::ctxt::{Errors, Setting};
use proc_macro2::{Ident, Span, TokenStream};
use quote::{ToTokens, quote, quote_spanned};
use syn::parse::{ParseStream, Parser};
use syn::spanned::Spanned;
use syn::{
    FnArg, Item, ItemFn, LitStr, Pat, PatType, Path, ReturnType, Signature, Type, TypeReference,
};

/// The arguments every handler needs, as an example for error messages.
const USAGE: &str = "#[idempotent(consumer = \"ledger\")]";

/// The parameters of a handler, for error messages.
const PARAMS: &str = "the connection and then the message, as in \
                      `(conn: &mut sqlx::PgConnection, msg: OrderPlaced)`";

/// Arguments accepted by `#[idempotent]`, for the "unknown argument" error.
const ARGUMENTS: &str = "`consumer`, `key`, `aggregate`, `sequence`, `gaps`, `max_attempts`";

/// A fully checked `#[idempotent]` handler, ready for [`crate::expand::handler`].
pub(crate) struct Handler {
    /// `consumer = "..."`.
    pub(crate) consumer: LitStr,
    /// `key = "field"`, if the message's own key is overridden.
    pub(crate) key: Option<FieldArg>,
    /// `aggregate = "field", sequence = "field"`, if the message's own ordering is overridden.
    pub(crate) ordering: Option<OrderingArgs>,
    /// `gaps = "..."`, if given.
    pub(crate) gaps: Option<GapPolicy>,
    /// `max_attempts = N`, if the dispatcher's default is overridden.
    pub(crate) max_attempts: Option<syn::LitInt>,
    /// The user's function, untouched.
    pub(crate) func: ItemFn,
    /// `T` of the first parameter's `&mut T`.
    pub(crate) connection: Type,
    /// Whether `T` is `DynamoTx` (a type path ending in `DynamoTx`): a DynamoDB handler.
    pub(crate) dynamo: bool,
    /// The type of the second parameter.
    pub(crate) message: Type,
    /// The return type as written.
    pub(crate) output: Type,
    /// Names for the two parameters of the generated outer function.
    pub(crate) conn_arg: Ident,
    /// See `conn_arg`.
    pub(crate) msg_arg: Ident,
}

/// The field named by `key = "..."`, `aggregate = "..."` or `sequence = "..."`.
pub(crate) struct FieldArg {
    /// The field, spanned at the string literal (so "no field" errors point there).
    pub(crate) member: Ident,
    /// The field's name without `r#`, for run-time errors.
    pub(crate) name: String,
}

/// `aggregate = "...", sequence = "..."`.
pub(crate) struct OrderingArgs {
    /// The field holding the aggregate id.
    pub(crate) aggregate: FieldArg,
    /// The field holding the sequence number.
    pub(crate) sequence: FieldArg,
}

/// `gaps = "apply"` or `gaps = "park"`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum GapPolicy {
    /// Apply any newer sequence, skipping the gap (the runtime's default).
    Apply,
    /// Park messages that arrive before their predecessor.
    Park,
}

/// Parses and checks `#[idempotent(args)] item`.
pub(crate) fn parse(args: TokenStream, item: TokenStream) -> syn::Result<Handler> {
    let mut errors = Errors::default();
    let args = parse_args(args, &mut errors);
    let func = match syn::parse2::<Item>(item) {
        Ok(Item::Fn(func)) => Some(func),
        Ok(other) => {
            errors.spanned(
                item_keyword(&other),
                "`#[idempotent]` can only be applied to an `async fn`",
            );
            None
        }
        Err(e) => {
            errors.push(e);
            None
        }
    };
    let sig = func.as_ref().map(|f| check_signature(&f.sig, &mut errors));
    errors.finish()?;
    // No error means every part was found.
    let (
        Some(Args {
            consumer,
            key,
            ordering,
            gaps,
            max_attempts,
            ..
        }),
        Some(func),
        Some(Some(sig)),
    ) = (args, func, sig)
    else {
        unreachable!("a missing part is always reported as an error")
    };
    Ok(Handler {
        consumer,
        key,
        ordering,
        gaps,
        max_attempts,
        func,
        dynamo: is_dynamo_tx(&sig.connection),
        connection: sig.connection,
        message: sig.message,
        output: sig.output,
        conn_arg: sig.conn_arg,
        msg_arg: sig.msg_arg,
    })
}

/// A function `#[idempotent]` rejected, whose signature can still be expanded: see
/// [`crate::expand::fallback`].
pub(crate) struct Fallback {
    /// The user's function, untouched.
    pub(crate) func: ItemFn,
    /// Its return type as written, which may be a `Result`.
    pub(crate) output: Type,
    /// Whether its first parameter is `&mut DynamoTx`: the DynamoDB form's signature.
    pub(crate) dynamo: bool,
}

/// The rejected `item`, if the handler's signature can be expanded anyway: a function, not a
/// method, that returns something which may be a `Result`. Its other mistakes (qualifiers,
/// generics, parameters) do not matter: the expanded signature keeps the parameters as written
/// (all but a C-variadic `...`, which only a foreign function can have).
///
/// `None` when the signature is too broken to expand: the item is then emitted unchanged.
pub(crate) fn fallback(item: TokenStream) -> Option<Fallback> {
    let func = syn::parse2::<ItemFn>(item).ok()?;
    let sig = &func.sig;
    if sig
        .inputs
        .iter()
        .any(|input| matches!(input, FnArg::Receiver(_)))
    {
        return None;
    }
    let output = output_type(sig).ok()?.clone();
    let dynamo = match sig.inputs.first() {
        Some(FnArg::Typed(first)) => match peel(&first.ty) {
            Type::Reference(TypeReference {
                mutability: Some(_),
                elem,
                ..
            }) => is_dynamo_tx(elem),
            _ => false,
        },
        _ => false,
    };
    Some(Fallback {
        func,
        output,
        dynamo,
    })
}

/// The checked arguments of `#[idempotent]`.
struct Args {
    consumer: LitStr,
    key: Option<FieldArg>,
    ordering: Option<OrderingArgs>,
    gaps: Option<GapPolicy>,
    max_attempts: Option<syn::LitInt>,
}

/// Whether the connection type `T` of `&mut T` is a path ending in `DynamoTx` (without
/// generic arguments): `inbox_runtime::dynamodb::DynamoTx` or the type imported.
pub(crate) fn is_dynamo_tx(connection: &Type) -> bool {
    match peel(connection) {
        Type::Path(path) if path.qself.is_none() => path
            .path
            .segments
            .last()
            .is_some_and(|last| last.ident == "DynamoTx" && last.arguments.is_none()),
        _ => false,
    }
}

/// Parses `consumer = "...", key = "...", aggregate = "...", sequence = "...", gaps = "...",
/// max_attempts = N`.
fn parse_args(args: TokenStream, errors: &mut Errors) -> Option<Args> {
    let parser = |input: ParseStream<'_>| args::parse_meta_list(input, "consumer = \"ledger\"");
    let metas = match parser.parse2(args) {
        Ok(metas) => metas,
        Err(e) => {
            errors.push(e);
            return None;
        }
    };
    let parsed = parse_metas(&metas, errors);
    Some(Args {
        consumer: parsed.consumer?,
        key: parsed.key,
        ordering: parsed.ordering,
        gaps: parsed.gaps,
        max_attempts: parsed.max_attempts,
    })
}

/// The arguments that were given and valid.
struct Parsed {
    consumer: Option<LitStr>,
    key: Option<FieldArg>,
    ordering: Option<OrderingArgs>,
    gaps: Option<GapPolicy>,
    max_attempts: Option<syn::LitInt>,
}

fn parse_metas(metas: &MetaList, errors: &mut Errors) -> Parsed {
    let mut consumer = Setting::new("consumer");
    let mut key = Setting::new("key");
    let mut aggregate = Setting::new("aggregate");
    let mut sequence = Setting::new("sequence");
    let mut gaps = Setting::new("gaps");
    let mut max_attempts = Setting::new("max_attempts");
    // The `aggregate` and `sequence` names, for "one without the other" errors.
    let (mut aggregate_path, mut sequence_path) = (None, None);
    for meta in metas {
        let path = meta.path();
        if path.is_ident("consumer") {
            let lit = args::string_value(meta, errors, "\"ledger\"")
                .filter(|lit| args::check_stored_name(lit, "`consumer`", errors));
            consumer.set(errors, path, lit);
        } else if path.is_ident("key") {
            let field = args::string_value(meta, errors, "\"event_id\"")
                .and_then(|lit| field_arg("key", &lit, errors));
            key.set(errors, path, field);
        } else if path.is_ident("aggregate") {
            let field = args::string_value(meta, errors, "\"order_id\"")
                .and_then(|lit| Some((field_arg("aggregate", &lit, errors)?, lit)));
            aggregate_path.get_or_insert(path);
            aggregate.set(errors, path, field);
        } else if path.is_ident("sequence") {
            let field = args::string_value(meta, errors, "\"seq\"")
                .and_then(|lit| Some((field_arg("sequence", &lit, errors)?, lit)));
            sequence_path.get_or_insert(path);
            sequence.set(errors, path, field);
        } else if path.is_ident("gaps") {
            let policy = args::string_value(meta, errors, "\"park\"")
                .and_then(|lit| gap_policy(&lit, errors));
            gaps.set(errors, path, policy);
        } else if path.is_ident("max_attempts") {
            let value = args::positive_int_value(meta, errors, "5");
            max_attempts.set(errors, path, value);
        } else {
            errors.spanned(
                path,
                format_args!(
                    "unknown argument `{}`, expected one of: {ARGUMENTS}",
                    args::path_name(path)
                ),
            );
        }
    }
    if !consumer.is_given() {
        errors.at(
            Span::call_site(),
            format_args!(
                "missing argument `consumer`: every handler needs a consumer name, as in `{USAGE}`"
            ),
        );
    }
    match (aggregate_path, sequence_path) {
        (Some(path), None) => errors.spanned(
            path,
            "`aggregate` needs `sequence` too: name the field holding the message's sequence \
             number, as in `aggregate = \"order_id\", sequence = \"seq\"`",
        ),
        (None, Some(path)) => errors.spanned(
            path,
            "`sequence` needs `aggregate` too: name the field holding the message's aggregate \
             id, as in `aggregate = \"order_id\", sequence = \"seq\"`",
        ),
        _ => {}
    }
    let ordering = ordering_args(aggregate.get(), sequence.get(), errors);
    Parsed {
        consumer: consumer.get(),
        key: key.get(),
        ordering,
        gaps: gaps.get(),
        max_attempts: max_attempts.get(),
    }
}

/// `aggregate` and `sequence` as a pair, if both were given, valid, and name different fields.
fn ordering_args(
    aggregate: Option<(FieldArg, LitStr)>,
    sequence: Option<(FieldArg, LitStr)>,
    errors: &mut Errors,
) -> Option<OrderingArgs> {
    match (aggregate, sequence) {
        (Some((aggregate, _)), Some((sequence, lit))) if aggregate.name == sequence.name => {
            errors.spanned(
                lit,
                format_args!(
                    "`sequence` names the same field as `aggregate`, `{}`: the aggregate field \
                 says which entity the message is about, the sequence field where the \
                 message stands among that entity's messages",
                    sequence.name
                ),
            );
            None
        }
        (Some((aggregate, _)), Some((sequence, _))) => Some(OrderingArgs {
            aggregate,
            sequence,
        }),
        _ => None,
    }
}

/// The field named by the string of the argument `arg` (`key`, `aggregate`, `sequence`).
fn field_arg(arg: &str, lit: &LitStr, errors: &mut Errors) -> Option<FieldArg> {
    let value = lit.value();
    let Some(member) = args::field_ident(&value, lit.span()) else {
        errors.spanned(
            lit,
            format_args!(
                "`{arg}` must be the name of a field of the message, and {value:?} is not a \
                 valid field name"
            ),
        );
        return None;
    };
    let name = args::unraw(&member);
    Some(FieldArg { member, name })
}

/// The policy named by the `gaps` argument's string.
fn gap_policy(lit: &LitStr, errors: &mut Errors) -> Option<GapPolicy> {
    match lit.value().as_str() {
        "apply" => Some(GapPolicy::Apply),
        "park" => Some(GapPolicy::Park),
        other => {
            errors.spanned(
                lit,
                format_args!(
                    "unknown gap policy {other:?}, expected `\"apply\"` (apply any newer \
                     sequence, skipping the gap) or `\"park\"` (hold messages that arrive \
                     before their predecessor until it has been applied)"
                ),
            );
            None
        }
    }
}

/// The parts of a valid handler signature.
struct Sig {
    connection: Type,
    message: Type,
    output: Type,
    conn_arg: Ident,
    msg_arg: Ident,
}

/// Checks the handler's signature, reporting every problem; `Some` only if there was none.
fn check_signature(sig: &Signature, errors: &mut Errors) -> Option<Sig> {
    let before = errors.len();
    check_qualifiers(sig, errors);
    let params = check_params(sig, errors);
    let output = check_output(sig, errors);
    if errors.len() > before {
        return None;
    }
    let (connection, message, conn, msg) = params?;
    Some(Sig {
        connection,
        message,
        output: output?,
        conn_arg: param_name(conn, "__inbox_conn"),
        msg_arg: param_name(msg, "__inbox_msg"),
    })
}

/// Everything about the function but its parameters and return type.
fn check_qualifiers(sig: &Signature, errors: &mut Errors) {
    if let Some(token) = &sig.constness {
        errors.spanned(token, "`#[idempotent]` handlers cannot be `const fn`");
    }
    if sig.asyncness.is_none() {
        errors.spanned(sig.fn_token, "`#[idempotent]` handlers must be `async fn`");
    }
    if let Some(token) = &sig.unsafety {
        errors.spanned(token, "`#[idempotent]` handlers cannot be `unsafe fn`");
    }
    if let Some(abi) = &sig.abi {
        errors.spanned(abi, "`#[idempotent]` handlers cannot have an `extern` ABI");
    }
    if !sig.generics.params.is_empty() {
        errors.spanned(
            &sig.generics,
            "`#[idempotent]` handlers cannot be generic: the connection and message types must \
             be concrete",
        );
    }
    if let Some(where_clause) = &sig.generics.where_clause {
        errors.spanned(
            where_clause,
            "`#[idempotent]` handlers cannot have a `where` clause",
        );
    }
    if let Some(variadic) = &sig.variadic {
        errors.spanned(variadic, "`#[idempotent]` handlers cannot be variadic");
    }
}

/// The connection type, the message type and both parameters.
fn check_params<'a>(
    sig: &'a Signature,
    errors: &mut Errors,
) -> Option<(Type, Type, &'a PatType, &'a PatType)> {
    let mut typed = Vec::new();
    for input in &sig.inputs {
        match input {
            FnArg::Receiver(receiver) => errors.spanned(
                receiver.self_token,
                "`#[idempotent]` handlers must be free functions, not methods: remove `self` \
                 and move the handler out of the `impl` block",
            ),
            FnArg::Typed(pat_type) => typed.push(pat_type),
        }
    }
    let (conn, msg) = match typed.as_slice() {
        [conn, msg] => (*conn, *msg),
        _ if typed.len() < sig.inputs.len() => return None, // `self`: already reported.
        [_, _, extra @ ..] => {
            errors.spanned(
                quote!(#(#extra)*),
                format_args!(
                    "`#[idempotent]` handlers take exactly two parameters, {PARAMS}; found {}",
                    typed.len()
                ),
            );
            return None;
        }
        _ => {
            errors.at(
                sig.paren_token.span.join(),
                format_args!(
                    "`#[idempotent]` handlers take exactly two parameters, {PARAMS}; found {}",
                    if typed.is_empty() { "none" } else { "one" }
                ),
            );
            return None;
        }
    };
    if !is_mut_ref(&conn.ty) && is_mut_ref(&msg.ty) {
        errors.at(
            sig.paren_token.span.join(),
            format_args!(
                "the parameters are the wrong way round: `#[idempotent]` handlers take {PARAMS}"
            ),
        );
        return None;
    }
    let connection = connection_type(&conn.ty, errors);
    let message = message_type(&msg.ty, errors);
    Some((connection?, message?, conn, msg))
}

/// The return type, which must be some `Result`.
fn check_output(sig: &Signature, errors: &mut Errors) -> Option<Type> {
    const NOT_A_RESULT: &str =
        "`#[idempotent]` handlers must return a `Result`, as in `-> Result<(), sqlx::Error>`";
    match output_type(sig) {
        Ok(ty) => Some(ty.clone()),
        Err(OutputProblem::Missing) => {
            // From `fn` to `)`: where the return type is missing.
            let mut signature = sig.fn_token.to_token_stream();
            signature.extend(quote_spanned!(sig.paren_token.span.close()=> ()));
            errors.spanned(signature, NOT_A_RESULT);
            None
        }
        Err(OutputProblem::ImplTrait(ty)) => {
            errors.spanned(
                ty,
                "`impl Trait` return types are not supported: return a `Result<T, E>`",
            );
            None
        }
        Err(OutputProblem::NotAResult(ty)) => {
            errors.spanned(ty, NOT_A_RESULT);
            None
        }
    }
}

/// Why a return type cannot be a handler's.
enum OutputProblem<'a> {
    /// No `->` at all.
    Missing,
    /// `-> impl Trait`.
    ImplTrait(&'a Type),
    /// `-> ()`, a tuple, or `-> !`: surely not a `Result`.
    NotAResult(&'a Type),
}

/// The return type as written, if it can be a `Result` (a type alias can: whether it is one is
/// left to the compiler, through `HandlerResult`).
fn output_type(sig: &Signature) -> Result<&Type, OutputProblem<'_>> {
    match &sig.output {
        ReturnType::Default => Err(OutputProblem::Missing),
        ReturnType::Type(_, ty) => match peel(ty) {
            Type::ImplTrait(_) => Err(OutputProblem::ImplTrait(ty)),
            Type::Never(_) | Type::Tuple(_) => Err(OutputProblem::NotAResult(ty)),
            _ => Ok(ty),
        },
    }
}

/// `T` of `&mut T`; anything else is reported.
fn connection_type(ty: &Type, errors: &mut Errors) -> Option<Type> {
    match peel(ty) {
        Type::Reference(TypeReference {
            mutability: Some(_),
            elem,
            ..
        }) => {
            if let Type::ImplTrait(_) = peel(elem) {
                errors.spanned(
                    elem,
                    "`impl Trait` is not supported here: name the connection type, as in \
                     `&mut sqlx::PgConnection`",
                );
                return None;
            }
            Some((**elem).clone())
        }
        _ => {
            errors.spanned(
                ty,
                "the first parameter must be the database connection, borrowed mutably: \
                 `&mut sqlx::PgConnection` or `&mut sqlx::SqliteConnection` (or, on DynamoDB, \
                 the transaction: `&mut inbox_runtime::dynamodb::DynamoTx`)",
            );
            None
        }
    }
}

/// The message type, which must be taken by value.
fn message_type(ty: &Type, errors: &mut Errors) -> Option<Type> {
    match peel(ty) {
        Type::Reference(reference) => {
            errors.spanned(
                ty,
                format_args!(
                    "the second parameter must take the message by value, as in `msg: {}`",
                    reference.elem.to_token_stream()
                ),
            );
            None
        }
        Type::ImplTrait(_) => {
            errors.spanned(
                ty,
                "`impl Trait` is not supported here: name the message type",
            );
            None
        }
        _ => Some(ty.clone()),
    }
}

/// Looks through invisible groups (types passed through `macro_rules!`) and parentheses.
fn peel(mut ty: &Type) -> &Type {
    loop {
        match ty {
            Type::Group(group) => ty = &group.elem,
            Type::Paren(paren) => ty = &paren.elem,
            _ => return ty,
        }
    }
}

/// The parameter's own name when it is a plain binding (`conn`, `mut conn`), else `fallback`.
///
/// The name gets the macro's span: the wrapper's use of `_msg` is generated code, which lints
/// such as `clippy::used_underscore_binding` must not blame on the user.
fn param_name(param: &PatType, fallback: &str) -> Ident {
    let mut ident = match &*param.pat {
        Pat::Ident(pat) if pat.by_ref.is_none() && pat.subpat.is_none() => pat.ident.clone(),
        _ => Ident::new(fallback, Span::call_site()),
    };
    ident.set_span(Span::call_site());
    ident
}

/// Whether `ty` is `&mut T`.
fn is_mut_ref(ty: &Type) -> bool {
    matches!(
        peel(ty),
        Type::Reference(TypeReference {
            mutability: Some(_),
            ..
        })
    )
}

/// The token to blame when `#[idempotent]` is put on something that is not a function.
fn item_keyword(item: &Item) -> TokenStream {
    match item {
        Item::Struct(i) => i.struct_token.to_token_stream(),
        Item::Enum(i) => i.enum_token.to_token_stream(),
        Item::Union(i) => i.union_token.to_token_stream(),
        Item::Impl(i) => i.impl_token.to_token_stream(),
        Item::Trait(i) => i.trait_token.to_token_stream(),
        Item::Mod(i) => i.mod_token.to_token_stream(),
        Item::Static(i) => i.static_token.to_token_stream(),
        Item::Const(i) => i.const_token.to_token_stream(),
        Item::Type(i) => i.type_token.to_token_stream(),
        Item::Use(i) => i.use_token.to_token_stream(),
        other => {
            let span = other.span();
            quote_spanned!(span=> item)
        }
    }
}

/// Parses and checks the input of `handler!`: the path of a function, without generic arguments.
pub(crate) fn parse_handler_path(input: TokenStream) -> syn::Result<Path> {
    let path: Path = match syn::parse2(input.clone()) {
        Ok(path) => path,
        Err(_) => {
            let message = "expected the path of an `#[idempotent]` function, such as \
                           `handler!(crate::ledger::credit)`";
            return Err(if input.is_empty() {
                syn::Error::new(Span::call_site(), message)
            } else {
                syn::Error::new_spanned(&input, message)
            });
        }
    };
    let last = path.segments.last().expect("a parsed path has a segment");
    if !last.arguments.is_none() {
        return Err(syn::Error::new_spanned(
            &last.arguments,
            "a handler has no generic arguments: name the function alone",
        ));
    }
    Ok(path)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn errors_of(args: TokenStream, item: TokenStream) -> Vec<String> {
        match parse(args, item) {
            Ok(_) => Vec::new(),
            Err(e) => e.into_iter().map(|e| e.to_string()).collect(),
        }
    }

    #[test]
    fn parses_a_handler() {
        let handler = parse(
            quote!(consumer = "ledger", key = "r#type"),
            quote! {
                /// Docs.
                pub async fn credit(mut conn: &mut sqlx::PgConnection, Msg { id }: Msg)
                    -> anyhow::Result<()> { Ok(()) }
            },
        )
        .unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(handler.consumer.value(), "ledger");
        let key = handler.key.unwrap();
        assert_eq!(key.member, "r#type");
        assert_eq!(key.name, "type");
        assert_eq!(
            handler.connection.to_token_stream().to_string(),
            "sqlx :: PgConnection"
        );
        assert_eq!(handler.message.to_token_stream().to_string(), "Msg");
        assert_eq!(
            handler.output.to_token_stream().to_string(),
            "anyhow :: Result < () >"
        );
        assert_eq!(handler.conn_arg, "conn");
        assert_eq!(handler.msg_arg, "__inbox_msg");
    }

    #[test]
    fn reports_every_problem_at_once() {
        let errors = errors_of(
            quote!(consumer = "ledger", consumer = "x", foo = 1),
            quote!(
                fn handler<T>(conn: &PgConnection) {}
            ),
        );
        assert_eq!(
            errors,
            [
                "`consumer` set multiple times",
                "unknown argument `foo`, expected one of: `consumer`, `key`, `aggregate`, \
                 `sequence`, `gaps`, `max_attempts`",
                "`#[idempotent]` handlers must be `async fn`",
                "`#[idempotent]` handlers cannot be generic: the connection and message types \
                 must be concrete",
                "`#[idempotent]` handlers take exactly two parameters, the connection and then \
                 the message, as in `(conn: &mut sqlx::PgConnection, msg: OrderPlaced)`; found one",
                "`#[idempotent]` handlers must return a `Result`, as in \
                 `-> Result<(), sqlx::Error>`",
            ]
        );
    }

    #[test]
    fn a_bad_consumer_is_not_also_missing() {
        let item = quote!(
            async fn h(c: &mut C, m: M) -> Result<(), E> {
                Ok(())
            }
        );
        assert_eq!(
            errors_of(quote!(consumer = ""), item.clone()),
            ["`consumer` must not be empty"]
        );
        assert_eq!(
            errors_of(quote!(consumer = 1), item.clone()),
            ["`consumer` must be a string literal, as in `consumer = \"ledger\"`"]
        );
        assert_eq!(
            errors_of(quote!(), item),
            [
                "missing argument `consumer`: every handler needs a consumer name, as in \
                 `#[idempotent(consumer = \"ledger\")]`"
            ]
        );
    }

    fn item() -> TokenStream {
        quote!(
            async fn h(c: &mut C, m: M) -> Result<(), E> {
                Ok(())
            }
        )
    }

    #[test]
    fn a_dynamo_tx_makes_a_dynamodb_handler() {
        for connection in [
            quote!(DynamoTx),
            quote!(inbox_runtime::dynamodb::DynamoTx),
            quote!(::inbox_runtime::dynamodb::DynamoTx),
        ] {
            let handler = parse(
                quote!(consumer = "ledger", key = "id", max_attempts = 3),
                quote!(async fn h(tx: &mut #connection, m: M) -> Result<(), E> { Ok(()) }),
            )
            .unwrap_or_else(|e| panic!("{e}"));
            assert!(handler.dynamo, "{connection}");
        }
        for connection in [
            quote!(sqlx::PgConnection),
            quote!(DynamoTx<T>),
            quote!(dynamo::DynamoTxn),
        ] {
            let handler = parse(
                quote!(consumer = "ledger"),
                quote!(async fn h(tx: &mut #connection, m: M) -> Result<(), E> { Ok(()) }),
            )
            .unwrap_or_else(|e| panic!("{e}"));
            assert!(!handler.dynamo, "{connection}");
        }
    }

    #[test]
    fn dynamodb_handlers_take_ordering_arguments() {
        let item = quote!(
            async fn h(tx: &mut DynamoTx, m: M) -> Result<(), E> {
                Ok(())
            }
        );
        let handler = parse(
            quote!(
                consumer = "c",
                sequence = "seq",
                aggregate = "id",
                gaps = "park"
            ),
            item.clone(),
        )
        .unwrap_or_else(|e| panic!("{e}"));
        assert!(handler.dynamo);
        assert_eq!(handler.gaps, Some(GapPolicy::Park));
        assert!(handler.ordering.is_some());
        assert!(errors_of(quote!(consumer = "c", gaps = "apply"), item).is_empty());
    }

    #[test]
    fn parses_ordering_arguments() {
        let handler = parse(
            quote!(
                consumer = "c",
                aggregate = "r#type",
                sequence = "seq",
                gaps = "park"
            ),
            item(),
        )
        .unwrap_or_else(|e| panic!("{e}"));
        let ordering = handler.ordering.unwrap();
        assert_eq!(ordering.aggregate.member, "r#type");
        assert_eq!(ordering.aggregate.name, "type");
        assert_eq!(ordering.sequence.member, "seq");
        assert_eq!(ordering.sequence.name, "seq");
        assert_eq!(handler.gaps, Some(GapPolicy::Park));
        assert!(handler.key.is_none());

        let handler = parse(quote!(consumer = "c", gaps = "apply"), item()).unwrap();
        assert!(handler.ordering.is_none());
        assert_eq!(handler.gaps, Some(GapPolicy::Apply));

        let handler = parse(quote!(consumer = "c"), item()).unwrap();
        assert!(handler.ordering.is_none());
        assert_eq!(handler.gaps, None);
    }

    #[test]
    fn ordering_arguments_come_in_pairs() {
        assert_eq!(
            errors_of(quote!(consumer = "c", aggregate = "order_id"), item()),
            [
                "`aggregate` needs `sequence` too: name the field holding the message's \
                 sequence number, as in `aggregate = \"order_id\", sequence = \"seq\"`"
            ]
        );
        assert_eq!(
            errors_of(quote!(sequence = "seq", consumer = "c"), item()),
            [
                "`sequence` needs `aggregate` too: name the field holding the message's \
                 aggregate id, as in `aggregate = \"order_id\", sequence = \"seq\"`"
            ]
        );
        // An invalid partner is reported once, not also as missing.
        assert_eq!(
            errors_of(
                quote!(consumer = "c", aggregate = "order_id", sequence = 1),
                item()
            ),
            ["`sequence` must be a string literal, as in `sequence = \"seq\"`"]
        );
        assert_eq!(
            errors_of(
                quote!(consumer = "c", aggregate = "a b", sequence = "seq"),
                item()
            ),
            [
                "`aggregate` must be the name of a field of the message, and \"a b\" is not a \
                 valid field name"
            ]
        );
        assert_eq!(
            errors_of(quote!(consumer = "c", aggregate, sequence = "seq"), item()),
            ["expected `aggregate = \"order_id\"`"]
        );
    }

    #[test]
    fn ordering_argument_mistakes() {
        assert_eq!(
            errors_of(
                quote!(
                    consumer = "c",
                    aggregate = "id",
                    sequence = "r#id",
                    gaps = "wait",
                ),
                item()
            ),
            [
                "unknown gap policy \"wait\", expected `\"apply\"` (apply any newer sequence, \
                 skipping the gap) or `\"park\"` (hold messages that arrive before their \
                 predecessor until it has been applied)",
                "`sequence` names the same field as `aggregate`, `id`: the aggregate field says \
                 which entity the message is about, the sequence field where the message stands \
                 among that entity's messages",
            ]
        );
        assert_eq!(
            errors_of(
                quote!(consumer = "c", aggregate = "id", sequence = "{seq}"),
                item()
            ),
            [
                "`sequence` must be the name of a field of the message, and \"{seq}\" is not a \
                 valid field name"
            ]
        );
        // Repeats are reported, in argument order.
        let errors = errors_of(
            quote!(
                consumer = "c",
                aggregate = "a",
                sequence = "s",
                aggregate = "a",
                gaps = "park",
                gaps = "park",
                sequence = "s",
            ),
            item(),
        );
        assert_eq!(
            errors,
            [
                "`aggregate` set multiple times",
                "`gaps` set multiple times",
                "`sequence` set multiple times",
            ]
        );
        assert_eq!(
            errors_of(quote!(consumer = "c", gaps = park), item()),
            ["`gaps` must be a string literal, as in `gaps = \"park\"`"]
        );
        assert_eq!(
            errors_of(quote!(consumer = "c", gaps = "Park"), item()).len(),
            1
        );
    }
}
