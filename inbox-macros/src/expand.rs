//! Code generation for both macros, from the checked models of [`crate::attr`] and
//! [`crate::message`].
//!
//! Generated code names only `::inbox_runtime::...` paths (and `::core`/`::std`), so it works
//! wherever the user depends on `inbox-runtime`, under any import names.

use crate::attr::{Fallback, FieldArg, GapPolicy, Handler, OrderingArgs};
use crate::message::{FieldRef, Key, MessageDef, OrderingFields, Segment};
use proc_macro2::{Ident, Span, TokenStream, TokenTree};
use quote::{ToTokens, format_ident, quote, quote_spanned};
use syn::ext::IdentExt;
use syn::spanned::Spanned;
use syn::{Attribute, ItemFn};

/// `impl ::inbox_runtime::Message for ...`.
pub(crate) fn message(def: &MessageDef) -> TokenStream {
    let MessageDef {
        ident,
        name,
        key,
        ordering,
        partitions,
    } = def;
    let key_part_fn = key_part_fn();
    let ordering = ordering.as_ref().map(message_ordering);
    let partitions = message_partitions(partitions);
    let body = match key {
        Key::Field(part) => {
            let value = field_ref(part);
            let field = &part.name;
            quote! {
                ::inbox_runtime::__private::key_from_field(
                    #value,
                    <Self as ::inbox_runtime::Message>::NAME,
                    #field,
                )
            }
        }
        Key::Template { template, segments } => {
            let segments = segments.iter().map(|segment| match segment {
                Segment::Lit(text) => quote! {
                    ::inbox_runtime::__private::KeySegment::Lit(#text)
                },
                Segment::Field(part) => {
                    let value = field_ref(part);
                    let field = &part.name;
                    quote! {
                        ::inbox_runtime::__private::KeySegment::Field(#field, #value)
                    }
                }
            });
            quote! {
                ::inbox_runtime::__private::key_from_template(
                    <Self as ::inbox_runtime::Message>::NAME,
                    #template,
                    &[#(#segments),*],
                )
            }
        }
    };
    quote! {
        #[automatically_derived]
        impl ::inbox_runtime::Message for #ident {
            const NAME: &'static ::core::primitive::str = #name;

            fn idempotency_key(
                &self,
            ) -> ::core::result::Result<::inbox_runtime::IdempotencyKey, ::inbox_runtime::KeyError>
            {
                #key_part_fn
                #body
            }

            #ordering
            #partitions
        }
    }
}

/// What `#[derive(Message)]` emits next to its errors, for a type that is not generic: an
/// `impl Message` whose functions never run, so that the handlers of the message and other uses
/// of `Message` get no errors of their own.
///
/// The impl only holds if the type has the supertraits of `Message` (`Serialize`,
/// `DeserializeOwned`, `Clone`, `Send`, `Sync`, `'static`), as a higher-ranked `where` clause
/// says: for a type without them the impl does not apply (as without it), instead of adding an
/// error for each missing supertrait. `NAME` is the type's name, whatever `name = "..."` said.
pub(crate) fn message_fallback(ident: &Ident) -> TokenStream {
    let private = quote!(::inbox_runtime::__private);
    let name = syn::LitStr::new(&ident.unraw().to_string(), ident.span());
    quote! {
        #[automatically_derived]
        impl ::inbox_runtime::Message for #ident
        where
            for<'__inbox> #ident: #private::Serialize
                + #private::DeserializeOwned
                + ::core::clone::Clone
                + ::core::marker::Send
                + ::core::marker::Sync
                + 'static,
        {
            const NAME: &'static ::core::primitive::str = #name;

            fn idempotency_key(
                &self,
            ) -> ::core::result::Result<::inbox_runtime::IdempotencyKey, ::inbox_runtime::KeyError>
            {
                ::core::unimplemented!()
            }
        }
    }
}

/// `fn ordering(&self)` of `impl Message`, when fields are marked `#[message(aggregate)]` and
/// `#[message(sequence)]`; without them the trait's default (no ordering) applies.
fn message_ordering(ordering: &OrderingFields) -> TokenStream {
    let OrderingFields {
        aggregate,
        sequence,
    } = ordering;
    let key_part_fn = key_part_fn();
    let sequence_part_fn = sequence_part_fn();
    let aggregate_name = &aggregate.name;
    let aggregate_value = field_ref(aggregate);
    let sequence_name = &sequence.name;
    let sequence_value = sequence_ref(sequence);
    quote! {
        fn ordering(
            &self,
        ) -> ::core::result::Result<
            ::core::option::Option<::inbox_runtime::__private::Ordering>,
            ::inbox_runtime::KeyError,
        > {
            #key_part_fn
            #sequence_part_fn
            ::inbox_runtime::__private::ordering_from_fields(
                <Self as ::inbox_runtime::Message>::NAME,
                #aggregate_name,
                #aggregate_value,
                #sequence_name,
                #sequence_value,
            )
        }
    }
}

/// `fn partitions(&self)` of `impl Message`, when fields are marked `#[message(partition)]`;
/// without them the trait's default (no partitions declared) applies.
fn message_partitions(partitions: &[FieldRef]) -> Option<TokenStream> {
    if partitions.is_empty() {
        return None;
    }
    let key_part_fn = key_part_fn();
    let values = partitions.iter().map(field_ref);
    Some(quote! {
        fn partitions(
            &self,
        ) -> ::core::option::Option<::std::vec::Vec<::std::string::String>> {
            #key_part_fn
            ::inbox_runtime::__private::partitions_from(&[#(#values),*])
        }
    })
}

/// `&self.field` as a `&dyn KeyPart`, through the function of [`key_part_fn`] so that a field
/// type that is no `KeyPart` is blamed on the field's type.
fn field_ref(part: &FieldRef) -> TokenStream {
    let member = &part.member;
    let ty = &part.ty;
    let function = quote_spanned!(ty.span()=> __inbox_key_part::<#ty>);
    quote!(#function(&self.#member))
}

/// `&self.field` as a `&dyn SequencePart`, through the function of [`sequence_part_fn`]: like
/// [`field_ref`], a field type that is no `SequencePart` is blamed on the field's type.
fn sequence_ref(part: &FieldRef) -> TokenStream {
    let member = &part.member;
    let ty = &part.ty;
    let function = quote_spanned!(ty.span()=> __inbox_sequence_part::<#ty>);
    quote!(#function(&self.#member))
}

/// The identity function `sequence_ref` calls: `&T` to `&dyn SequencePart`, with the bound on
/// `T`.
fn sequence_part_fn() -> TokenStream {
    quote! {
        #[inline]
        fn __inbox_sequence_part<T: ::inbox_runtime::__private::SequencePart>(
            value: &T,
        ) -> &dyn ::inbox_runtime::__private::SequencePart {
            value
        }
    }
}

/// The identity function `field_ref` calls: `&T` to `&dyn KeyPart`, with the bound on `T`.
fn key_part_fn() -> TokenStream {
    quote! {
        #[inline]
        fn __inbox_key_part<T: ::inbox_runtime::__private::KeyPart>(
            value: &T,
        ) -> &dyn ::inbox_runtime::__private::KeyPart {
            value
        }
    }
}

/// The items generated for an `#[idempotent]` handler, in this order: the hidden handler type and
/// its `impl HandlerSpec` and `impl Handler`, the registration, and the function with its new
/// signature.
pub(crate) fn handler(handler: &Handler) -> TokenStream {
    if handler.dynamo {
        return dynamo_handler(handler);
    }
    let names = Names::of(&handler.func.sig.ident);
    let attrs = FnAttrs::split(&handler.func.attrs);
    let result = ResultTypes::of(&handler.output);
    let handler_type = handler_type(handler, &names, &attrs, &result);
    let registration = registration_items(
        handler,
        &names,
        &attrs,
        &result,
        &quote!(::inbox_runtime::__private::Registration),
    );
    let wrapper = wrapper(handler, &names, &attrs, &result);
    quote! {
        #handler_type
        #registration
        #wrapper
    }
}

/// The names generated next to the function.
struct Names {
    /// `__inbox_handler_<name>`: the hidden type implementing `Handler`.
    handler_ty: Ident,
    /// `__inbox_registration_<name>`: the hidden registration constant, for `handler!`.
    registration: Ident,
    /// The function's name without `r#`, for `Handler::FUNCTION`.
    function: String,
}

impl Names {
    fn of(ident: &Ident) -> Self {
        Self {
            handler_ty: format_ident!(
                "__inbox_handler_{}",
                ident.unraw(),
                span = Span::call_site()
            ),
            registration: registration_ident(ident, Span::call_site()),
            function: ident.unraw().to_string(),
        }
    }
}

/// The function's attributes, by where they go.
///
/// `#[cfg]` applies to everything generated; lint levels also to the body, which lives in its own
/// function; `#[expect]` only to the body (the outer function cannot trigger it).
struct FnAttrs<'a> {
    /// `#[cfg]`: on every item.
    cfgs: Vec<&'a Attribute>,
    /// Lint levels and `#[expect]`: on the nested function holding the body.
    body: Vec<&'a Attribute>,
    /// All but `#[expect]`: on the outer function.
    outer: Vec<&'a Attribute>,
}

impl<'a> FnAttrs<'a> {
    fn split(attrs: &'a [Attribute]) -> Self {
        Self {
            cfgs: attrs.iter().filter(|a| is_cfg(a)).collect(),
            body: attrs
                .iter()
                .filter(|a| is_lint_level(a) || is_expect(a))
                .collect(),
            outer: attrs.iter().filter(|a| !is_expect(a)).collect(),
        }
    }
}

/// `T` and `E` of the handler's `Result<T, E>`, as `HandlerResult` projections spanned at the
/// return type, so that a return type that is no `Result` is blamed there.
struct ResultTypes {
    ok: TokenStream,
    err: TokenStream,
    /// The return type's span.
    span: Span,
}

impl ResultTypes {
    fn of(output: &syn::Type) -> Self {
        let span = output.span();
        let private = quote!(::inbox_runtime::__private);
        Self {
            ok: quote_spanned!(span=> <#output as #private::HandlerResult>::Ok),
            err: quote_spanned!(span=> <#output as #private::HandlerResult>::Err),
            span,
        }
    }

    /// What a DynamoDB handler returns once `#[idempotent]` has rewritten it:
    /// `Result<Outcome<T>, inbox_runtime::dynamodb::DynamoError<E>>`.
    fn dynamo_outcome(&self) -> TokenStream {
        let Self { ok, err, .. } = self;
        quote! {
            ::core::result::Result<
                ::inbox_runtime::Outcome<#ok>,
                ::inbox_runtime::dynamodb::DynamoError<#err>,
            >
        }
    }

    /// What the function returns once `#[idempotent]` has rewritten it:
    /// `Result<Outcome<T>, inbox_runtime::Error<E>>`.
    fn outcome(&self) -> TokenStream {
        let Self { ok, err, .. } = self;
        quote! {
            ::core::result::Result<
                ::inbox_runtime::Outcome<#ok>,
                ::inbox_runtime::Error<#err>,
            >
        }
    }
}

/// The hidden handler type, its `impl HandlerSpec` and its `impl Handler`, which holds the body.
fn handler_type(
    handler: &Handler,
    names: &Names,
    attrs: &FnAttrs<'_>,
    result: &ResultTypes,
) -> TokenStream {
    let private = quote!(::inbox_runtime::__private);
    let handler_ty = &names.handler_ty;
    let connection = &handler.connection;
    let cfgs = &attrs.cfgs;
    let spec = spec_impl(handler, names, attrs, result);
    let call = call_fn(handler, attrs);
    quote! {
        #(#cfgs)*
        #[doc(hidden)]
        #[allow(non_camel_case_types)]
        struct #handler_ty;

        #spec

        #(#cfgs)*
        impl #private::Handler for #handler_ty {
            type Connection = #connection;

            #call
        }
    }
}

/// The `impl HandlerSpec` every handler has, SQL or DynamoDB: its message and result types,
/// consumer, function name and the policies of its attribute.
fn spec_impl(
    handler: &Handler,
    names: &Names,
    attrs: &FnAttrs<'_>,
    result: &ResultTypes,
) -> TokenStream {
    let private = quote!(::inbox_runtime::__private);
    let Names {
        handler_ty,
        function,
        ..
    } = names;
    let Handler {
        consumer, message, ..
    } = handler;
    let cfgs = &attrs.cfgs;
    let ResultTypes { ok, err, .. } = result;
    let policies = policy_items(handler, result);
    quote! {
        #(#cfgs)*
        impl #private::HandlerSpec for #handler_ty {
            type Message = #message;
            type Output = #ok;
            type Error = #err;
            const CONSUMER: &'static ::core::primitive::str = #consumer;
            const FUNCTION: &'static ::core::primitive::str =
                ::core::concat!(::core::module_path!(), "::", #function);

            #policies
        }
    }
}

/// The items both handler traits share, from the attribute: `MAX_ATTEMPTS`, `GAPS`, the
/// error classification, the key and the ordering.
fn policy_items(handler: &Handler, result: &ResultTypes) -> TokenStream {
    let max_attempts = handler.max_attempts.as_ref().map(max_attempts_const);
    let gaps = gaps_const(handler.gaps);
    let classify = classify_fn(result);
    let key = key_fn(handler.key.as_ref(), &handler.message);
    let ordering = handler
        .ordering
        .as_ref()
        .map(|ordering| handler_ordering(ordering, &handler.message));
    quote! {
        #max_attempts

        #gaps

        #classify

        #key

        #ordering
    }
}

/// `const MAX_ATTEMPTS` of `impl HandlerSpec`, for `max_attempts = N`.
fn max_attempts_const(n: &syn::LitInt) -> TokenStream {
    quote! {
        const MAX_ATTEMPTS: ::core::option::Option<::core::primitive::u32> =
            ::core::option::Option::Some(#n);
    }
}

/// `const GAPS` of `impl HandlerSpec`, for `gaps = "park"`; nothing for `"apply"`, the trait's
/// default.
fn gaps_const(gaps: Option<GapPolicy>) -> Option<TokenStream> {
    match gaps {
        Some(GapPolicy::Park) => Some(quote! {
            const GAPS: ::inbox_runtime::GapPolicy = ::inbox_runtime::GapPolicy::Park;
        }),
        Some(GapPolicy::Apply) | None => None,
    }
}

/// `fn classify` of `impl HandlerSpec`: the error's class, through the first of the probes that
/// applies. Spanned at the return type, like [`ResultTypes`]: a non-`Result` is blamed there.
fn classify_fn(result: &ResultTypes) -> TokenStream {
    let private = quote!(::inbox_runtime::__private);
    let err = &result.err;
    quote_spanned! {result.span=>
        fn classify(error: &#err) -> ::inbox_runtime::ErrorClass {
            #[allow(unused_imports)]
            use #private::{ViaAsRefError as _, ViaClassify as _, ViaFallback as _, ViaStdError as _};
            (&&&#private::Probe(error)).inbox_class()
        }
    }
}

/// `fn key` of `impl HandlerSpec`: from the field named by `key = "..."`, else the message's own
/// key.
fn key_fn(key: Option<&FieldArg>, message: &syn::Type) -> TokenStream {
    let private = quote!(::inbox_runtime::__private);
    let key_body = match key {
        Some(field) => {
            let member = &field.member;
            let name = &field.name;
            quote! {
                #private::key_from_field(
                    &msg.#member,
                    <#message as ::inbox_runtime::Message>::NAME,
                    #name,
                )
            }
        }
        None => quote! {
            <#message as ::inbox_runtime::Message>::idempotency_key(msg)
        },
    };
    quote! {
        fn key(
            msg: &#message,
        ) -> ::core::result::Result<::inbox_runtime::IdempotencyKey, ::inbox_runtime::KeyError>
        {
            #key_body
        }
    }
}

/// `fn call` of `impl Handler` and of `impl DynamoHandler`: the user's body, in a nested
/// function with the user's parameters and the body's lint attributes.
fn call_fn(handler: &Handler, attrs: &FnAttrs<'_>) -> TokenStream {
    let Handler {
        func,
        connection,
        message,
        output,
        ..
    } = handler;
    let private = quote!(::inbox_runtime::__private);
    let inputs = &func.sig.inputs;
    let block = &func.block;
    let body_attrs = &attrs.body;
    let body = quote!(async fn __inbox_body(#inputs) -> #output #block);
    quote! {
        fn call<'c>(
            conn: &'c mut #connection,
            msg: #message,
        ) -> #private::BoxFuture<'c, #output> {
            #(#body_attrs)*
            #body
            ::std::boxed::Box::pin(__inbox_body(conn, msg))
        }
    }
}

/// The registration constant (of type `registration`: `__private::Registration` for a SQL
/// handler, `dynamodb::DynamoRegistration` for a DynamoDB one), its submission to the
/// `inventory` registry, and a use of the function that keeps it from being dead code.
fn registration_items(
    handler: &Handler,
    names: &Names,
    attrs: &FnAttrs<'_>,
    result: &ResultTypes,
    registration: &TokenStream,
) -> TokenStream {
    let private = quote!(::inbox_runtime::__private);
    let vis = &handler.func.vis;
    let ident = &handler.func.sig.ident;
    let registration_const = &names.registration;
    let cfgs = &attrs.cfgs;
    // The handler's error must convert into a `BoxError` to be registered: blame the return type.
    let registered = {
        let mut handler_ty = names.handler_ty.clone();
        handler_ty.set_span(result.span);
        quote_spanned!(result.span=> &#handler_ty)
    };
    quote! {
        /// The registration of the handler, for `inbox_runtime::handler!`.
        #(#cfgs)*
        #[doc(hidden)]
        #[allow(non_upper_case_globals, unreachable_pub)]
        #vis const #registration_const: #registration = #registration::new(#registered);

        #(#cfgs)*
        #private::inventory::submit! {
            #registration_const
        }

        // Registered, the wrapper needs no caller: this use keeps it from being dead code.
        #(#cfgs)*
        const _: () = {
            let _ = #ident;
        };
    }
}

/// The function, now a wrapper that runs the handler through the runtime and returns
/// `Result<Outcome<T>, inbox_runtime::Error<E>>`.
fn wrapper(
    handler: &Handler,
    names: &Names,
    attrs: &FnAttrs<'_>,
    result: &ResultTypes,
) -> TokenStream {
    let Handler {
        func,
        conn_arg,
        msg_arg,
        ..
    } = handler;
    let private = quote!(::inbox_runtime::__private);
    let sig = &func.sig;
    let ident = &sig.ident;
    let vis = &func.vis;
    let asyncness = &sig.asyncness;
    let handler_ty = &names.handler_ty;
    let outer_attrs = &attrs.outer;
    let returns = result.outcome();
    let (conn_ty, msg_ty) = match (sig.inputs.first(), sig.inputs.last()) {
        (Some(syn::FnArg::Typed(conn)), Some(syn::FnArg::Typed(msg))) => (&conn.ty, &msg.ty),
        _ => unreachable!("checked by attr::parse"),
    };
    quote! {
        #(#outer_attrs)*
        #vis #asyncness fn #ident(
            #conn_arg: #conn_ty,
            #msg_arg: #msg_ty,
        ) -> #returns {
            #private::run::<#handler_ty>(#conn_arg, #msg_arg).await
        }
    }
}

/// What `#[idempotent]` emits next to its errors when it rejected a function whose signature can
/// still be expanded (see [`crate::attr::fallback`]): the function with the signature it would
/// have had, `async` and returning `Result<Outcome<T>, inbox_runtime::Error<E>>`, so that its
/// callers get no errors of their own; as in `tokio::main`, which keeps its expanded signature on
/// error.
///
/// The parameters are kept as written (as `_`: the outer function does not run), and so are the
/// generics, which they may use. The body is still checked, in a nested function with the
/// signature as written (but `async`, like the body of a handler), so that its own mistakes are
/// reported in the same compile; nothing runs it. Everything else is left out: without the
/// handler type, there is nothing to register.
pub(crate) fn fallback(fallback: &Fallback) -> TokenStream {
    let Fallback {
        func,
        output,
        dynamo,
    } = fallback;
    let attrs = FnAttrs::split(&func.attrs);
    let returns = if *dynamo {
        ResultTypes::of(output).dynamo_outcome()
    } else {
        ResultTypes::of(output).outcome()
    };
    let sig = &func.sig;
    let ident = &sig.ident;
    let vis = &func.vis;
    let generics = &sig.generics;
    let where_clause = &generics.where_clause;
    let params = sig
        .inputs
        .iter()
        .enumerate()
        .filter_map(|(index, input)| match input {
            // The DynamoDB form takes the inbox where the handler takes the transaction.
            syn::FnArg::Typed(param) if index == 0 && *dynamo => {
                let param_attrs = &param.attrs;
                Some(quote!(#(#param_attrs)* _: &::inbox_runtime::dynamodb::DynamoInbox))
            }
            syn::FnArg::Typed(param) => {
                let param_attrs = &param.attrs;
                let ty = &param.ty;
                Some(quote!(#(#param_attrs)* _: #ty))
            }
            syn::FnArg::Receiver(_) => None,
        });
    let body = fallback_body(func, &attrs);
    let (outer_attrs, cfgs) = (&attrs.outer, &attrs.cfgs);
    // As on success, a use keeps the function from being dead code; a function with type or
    // const parameters (`impl Trait` parameters are type parameters too) cannot be named without
    // them, and is left alone.
    let generic = generics.lifetimes().count() < generics.params.len()
        || sig
            .inputs
            .iter()
            .any(|input| mentions_impl(input.to_token_stream()));
    let used = (!generic).then(|| {
        quote! {
            #(#cfgs)*
            const _: () = {
                let _ = #ident;
            };
        }
    });
    let items = quote! {
        #used

        #(#outer_attrs)*
        #vis async fn #ident #generics(#(#params),*) -> #returns #where_clause {
            #body
            ::core::unimplemented!()
        }
    };
    if *dynamo {
        // Without the `dynamodb` feature, nothing: its types do not exist.
        quote!(::inbox_runtime::__private::dynamodb_fallback! { #items })
    } else {
        items
    }
}

/// Whether `tokens` hold the keyword `impl`: in a parameter, an `impl Trait` type.
fn mentions_impl(tokens: TokenStream) -> bool {
    tokens.into_iter().any(|token| match token {
        TokenTree::Ident(ident) => ident == "impl",
        TokenTree::Group(group) => mentions_impl(group.stream()),
        TokenTree::Punct(_) | TokenTree::Literal(_) => false,
    })
}

/// The user's function as the nested `__inbox_body` of [`fallback`]: as written, but `async`
/// (like the body of a handler; and so not `const`), without a C-variadic `...`, with the body's
/// attributes only.
fn fallback_body(func: &ItemFn, attrs: &FnAttrs<'_>) -> ItemFn {
    let mut body = func.clone();
    body.attrs = attrs.body.iter().map(|&attr| attr.clone()).collect();
    body.vis = syn::Visibility::Inherited;
    body.sig.ident = Ident::new("__inbox_body", Span::call_site());
    body.sig.constness = None;
    body.sig.asyncness = Some(<syn::Token![async]>::default());
    // Already reported, and rustc would report it again.
    body.sig.variadic = None;
    body
}
/// `#[cfg]`: applies to every item generated for the handler.
fn is_cfg(attr: &Attribute) -> bool {
    attr.path().is_ident("cfg")
}

/// `#[allow]`, `#[warn]`, `#[deny]`, `#[forbid]`: lint levels that also matter for the body.
fn is_lint_level(attr: &Attribute) -> bool {
    ["allow", "warn", "deny", "forbid"]
        .iter()
        .any(|name| attr.path().is_ident(name))
}

/// `#[expect]`: the lint it expects can only come from the body, so it moves there.
fn is_expect(attr: &Attribute) -> bool {
    attr.path().is_ident("expect")
}

/// `fn ordering(msg)` of `impl HandlerSpec`, for
/// `#[idempotent(aggregate = "...", sequence = "...")]`: overrides the message's own ordering.
///
/// A field that does not exist, or whose type is not a `KeyPart` (aggregate) or a
/// `SequencePart` (sequence), is blamed on the argument's string literal: see [`msg_field`].
fn handler_ordering(ordering: &OrderingArgs, message: &syn::Type) -> TokenStream {
    let OrderingArgs {
        aggregate,
        sequence,
    } = ordering;
    let private = quote!(::inbox_runtime::__private);
    let aggregate_name = &aggregate.name;
    let (aggregate_msg, aggregate_value) = msg_field(aggregate, "inbox_aggregate_msg");
    let sequence_name = &sequence.name;
    let (sequence_msg, sequence_value) = msg_field(sequence, "inbox_sequence_msg");
    quote! {
        fn ordering(
            msg: &#message,
        ) -> ::core::result::Result<
            ::core::option::Option<::inbox_runtime::__private::Ordering>,
            ::inbox_runtime::KeyError,
        > {
            let #aggregate_msg = msg;
            let #sequence_msg = msg;
            #private::ordering_from_fields(
                <#message as ::inbox_runtime::Message>::NAME,
                #aggregate_name,
                #aggregate_value,
                #sequence_name,
                #sequence_value,
            )
        }
    }
}

/// A variable called `name` for the message, and `&name.field`, all spanned at the argument's
/// string literal (the span of `field`), so that the coercion of the field to `&dyn KeyPart` /
/// `&dyn SequencePart` is blamed there.
///
/// Not `&msg.field`: the parameter `msg` has the call-site span, and an expression mixing it with
/// the literal's span is blamed on the whole attribute. Nor `msg` spanned at the literal: passed
/// through a `macro_rules!` macro, the literal has another hygiene context than the parameter, and
/// `msg` would not resolve. The variable, bound to `msg`, has the literal's span at its
/// definition and at its use.
fn msg_field(field: &FieldArg, name: &str) -> (Ident, TokenStream) {
    let member = &field.member;
    let span = member.span();
    let var = Ident::new(name, span);
    let value = quote_spanned!(span=> &#var.#member);
    (var, value)
}

/// The hidden constant `#[idempotent]` defines next to the function `ident`, spanned at `span`.
fn registration_ident(ident: &syn::Ident, span: Span) -> syn::Ident {
    format_ident!("__inbox_registration_{}", ident.unraw(), span = span)
}

/// `handler!(path::to::function)`: the path of the registration constant `#[idempotent]`
/// defined next to the function, from the path [`crate::attr::parse_handler_path`] checked.
pub(crate) fn registration(mut path: syn::Path) -> TokenStream {
    let last = path
        .segments
        .last_mut()
        .expect("checked by attr::parse_handler_path");
    last.ident = registration_ident(&last.ident, last.ident.span());
    quote!(#path)
}

/// The items generated for an `#[idempotent]` handler whose first parameter is `&mut DynamoTx`:
/// the hidden handler type and its `impl HandlerSpec` and `impl DynamoHandler`, the registration
/// (a `DynamoRegistration`, in the DynamoDB handlers' own `inventory` collection), and the function
/// rewritten to `fn(inbox: &DynamoInbox, msg: M) -> Result<Outcome<T>, DynamoError<E>>`.
///
/// All of it passes through `__private::dynamodb_items!`, spanned at the first parameter's type:
/// without inbox-runtime's `dynamodb` feature, that macro is an error there saying so.
fn dynamo_handler(handler: &Handler) -> TokenStream {
    let Handler {
        func,
        connection,
        msg_arg,
        ..
    } = handler;
    let names = Names::of(&func.sig.ident);
    let attrs = FnAttrs::split(&func.attrs);
    let result = ResultTypes::of(&handler.output);
    let private = quote!(::inbox_runtime::__private);
    let dynamodb = quote!(::inbox_runtime::dynamodb);
    let handler_ty = &names.handler_ty;
    let FnAttrs { cfgs, outer, .. } = &attrs;
    let handler_impl = dynamo_handler_impl(handler, &names, &attrs, &result);
    let registration = registration_items(
        handler,
        &names,
        &attrs,
        &result,
        &quote!(#dynamodb::DynamoRegistration),
    );
    let vis = &func.vis;
    let ident = &func.sig.ident;
    let asyncness = &func.sig.asyncness;
    let returns = result.dynamo_outcome();
    let msg_ty = match func.sig.inputs.last() {
        Some(syn::FnArg::Typed(msg)) => &msg.ty,
        _ => unreachable!("checked by attr::parse"),
    };
    // The rewritten function takes the inbox where the handler took the transaction.
    let inbox_arg = if *msg_arg == "inbox" {
        Ident::new("__inbox_inbox", Span::call_site())
    } else {
        Ident::new("inbox", Span::call_site())
    };
    let items = quote! {
        #(#cfgs)*
        #[doc(hidden)]
        #[allow(non_camel_case_types)]
        struct #handler_ty;

        #handler_impl

        #registration

        #(#outer)*
        #vis #asyncness fn #ident(
            #inbox_arg: &#dynamodb::DynamoInbox,
            #msg_arg: #msg_ty,
        ) -> #returns {
            #private::run_dynamo::<#handler_ty>(#inbox_arg, #msg_arg).await
        }
    };
    spanned_by(connection, items)
}

/// The `impl HandlerSpec` and `impl DynamoHandler` of a DynamoDB handler's hidden type: its
/// consumer, function name, policies (`max_attempts`, gaps, error classes), key and ordering,
/// and `call`, which runs the original body on the transaction.
fn dynamo_handler_impl(
    handler: &Handler,
    names: &Names,
    attrs: &FnAttrs<'_>,
    result: &ResultTypes,
) -> TokenStream {
    let private = quote!(::inbox_runtime::__private);
    let handler_ty = &names.handler_ty;
    let cfgs = &attrs.cfgs;
    let spec = spec_impl(handler, names, attrs, result);
    let call = call_fn(handler, attrs);
    quote! {
        #spec

        #(#cfgs)*
        impl #private::DynamoHandler for #handler_ty {
            #call
        }
    }
}

/// `items` passed through `__private::dynamodb_items!`, the call spanning the whole
/// `connection` type (its first token to its last: what rustc blames for an error of the
/// macro), where one span would cover only the type's first token on stable.
fn spanned_by(connection: &syn::Type, items: TokenStream) -> TokenStream {
    let mut tokens = connection.to_token_stream().into_iter();
    let first = tokens.next().map_or_else(Span::call_site, |t| t.span());
    let last = tokens.last().map_or(first, |t| t.span());
    let mut group = proc_macro2::Group::new(proc_macro2::Delimiter::Brace, items);
    group.set_span(last);
    quote_spanned!(first=> ::inbox_runtime::__private::dynamodb_items! #group)
}
