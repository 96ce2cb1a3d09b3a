//! Code generation for both macros, from the checked models of [`crate::attr`] and
//! [`crate::message`].
//!
//! Generated code names only `::inbox_runtime::...` paths (and `::core`/`::std`), so it works
//! wherever the user depends on `inbox-runtime`, under any import names.

use crate::attr::{FieldArg, GapPolicy, Handler, OrderingArgs};
use crate::message::{FieldRef, Key, MessageDef, OrderingFields, Segment};
use proc_macro2::{Ident, Span, TokenStream};
use quote::{format_ident, quote, quote_spanned};
use syn::Attribute;
use syn::ext::IdentExt;
use syn::spanned::Spanned;

/// `impl ::inbox_runtime::Message for ...`.
pub(crate) fn message(def: &MessageDef) -> TokenStream {
    let MessageDef {
        ident,
        name,
        key,
        ordering,
    } = def;
    let key_part_fn = key_part_fn();
    let ordering = ordering.as_ref().map(message_ordering);
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
            ::core::option::Option<::inbox_runtime::Ordering>,
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
        fn __inbox_key_part<T: ::inbox_runtime::KeyPart>(
            value: &T,
        ) -> &dyn ::inbox_runtime::KeyPart {
            value
        }
    }
}

/// The items generated for an `#[idempotent]` handler.
pub(crate) fn handler(handler: &Handler) -> TokenStream {
    let Handler {
        consumer,
        key,
        ordering,
        gaps,
        max_attempts,
        func,
        connection,
        message,
        output,
        conn_arg,
        msg_arg,
    } = handler;
    let sig = &func.sig;
    let ident = &sig.ident;
    let vis = &func.vis;
    let block = &func.block;
    let inputs = &sig.inputs;
    let asyncness = &sig.asyncness;
    let private = quote!(::inbox_runtime::__private);

    let handler_ty = format_ident!(
        "__inbox_handler_{}",
        ident.unraw(),
        span = Span::call_site()
    );
    let function = ident.unraw().to_string();
    let registration_const = registration_ident(ident, Span::call_site());

    // `#[cfg]` applies to everything generated; lint levels also to the body, which lives in
    // its own function; `#[expect]` only to the body (the outer function cannot trigger it).
    let cfgs: Vec<_> = func.attrs.iter().filter(|a| is_cfg(a)).collect();
    let body_attrs = func
        .attrs
        .iter()
        .filter(|a| is_lint_level(a) || is_expect(a));
    let outer_attrs = func.attrs.iter().filter(|a| !is_expect(a));

    // Errors about the return type (not a `Result`) point at the return type.
    let output_span = output.span();
    let ok = quote_spanned!(output_span=> <#output as #private::HandlerResult>::Ok);
    let err = quote_spanned!(output_span=> <#output as #private::HandlerResult>::Err);
    // The handler's error must convert into a `BoxError` to be registered: blame the return type.
    let registered = {
        let mut handler_ty = handler_ty.clone();
        handler_ty.set_span(output_span);
        quote_spanned!(output_span=> &#handler_ty)
    };

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

    let ordering = ordering
        .as_ref()
        .map(|ordering| handler_ordering(ordering, message));

    let gaps = match gaps {
        Some(GapPolicy::Park) => Some(quote! {
            const GAPS: ::inbox_runtime::GapPolicy = ::inbox_runtime::GapPolicy::Park;
        }),
        // `Apply` is the trait's default.
        Some(GapPolicy::Apply) | None => None,
    };

    let max_attempts = max_attempts.as_ref().map(|n| {
        quote! {
            const MAX_ATTEMPTS: ::core::option::Option<::core::primitive::u32> =
                ::core::option::Option::Some(#n);
        }
    });

    // Spanned at the return type, like `ok`/`err`: a non-`Result` is blamed there.
    let classify = quote_spanned! {output_span=>
        fn classify(error: &#err) -> ::inbox_runtime::ErrorClass {
            #[allow(unused_imports)]
            use #private::{ViaAsRefError as _, ViaClassify as _, ViaFallback as _, ViaStdError as _};
            (&&&#private::Probe(error)).inbox_class()
        }
    };

    let (conn_ty, msg_ty) = match (sig.inputs.first(), sig.inputs.last()) {
        (Some(syn::FnArg::Typed(conn)), Some(syn::FnArg::Typed(msg))) => (&conn.ty, &msg.ty),
        _ => unreachable!("checked by attr::parse"),
    };

    quote! {
        #(#cfgs)*
        #[doc(hidden)]
        #[allow(non_camel_case_types)]
        struct #handler_ty;

        #(#cfgs)*
        impl #private::Handler for #handler_ty {
            type Connection = #connection;
            type Message = #message;
            type Output = #ok;
            type Error = #err;
            const CONSUMER: &'static ::core::primitive::str = #consumer;
            const FUNCTION: &'static ::core::primitive::str =
                ::core::concat!(::core::module_path!(), "::", #function);

            #max_attempts

            #gaps

            #classify

            fn key(
                msg: &#message,
            ) -> ::core::result::Result<::inbox_runtime::IdempotencyKey, ::inbox_runtime::KeyError>
            {
                #key_body
            }

            #ordering

            fn call<'c>(
                conn: &'c mut #connection,
                msg: #message,
            ) -> #private::BoxFuture<'c, #output> {
                #(#body_attrs)*
                async fn __inbox_body(#inputs) -> #output #block
                ::std::boxed::Box::pin(__inbox_body(conn, msg))
            }
        }

        /// The registration of the handler, for `inbox_runtime::handler!`.
        #(#cfgs)*
        #[doc(hidden)]
        #[allow(non_upper_case_globals, unreachable_pub)]
        #vis const #registration_const: #private::Registration =
            #private::Registration::new(#registered);

        #(#cfgs)*
        #private::inventory::submit! {
            #registration_const
        }

        // Registered, the wrapper needs no caller: this use keeps it from being dead code.
        #(#cfgs)*
        const _: () = {
            let _ = #ident;
        };

        #(#outer_attrs)*
        #vis #asyncness fn #ident(
            #conn_arg: #conn_ty,
            #msg_arg: #msg_ty,
        ) -> ::core::result::Result<
            ::inbox_runtime::Outcome<#ok>,
            ::inbox_runtime::Error<#err>,
        > {
            #private::run::<#handler_ty>(#conn_arg, #msg_arg).await
        }
    }
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

/// `fn ordering(msg)` of `impl Handler`, for `#[idempotent(aggregate = "...", sequence = "...")]`:
/// overrides the message's own ordering.
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
            ::core::option::Option<::inbox_runtime::Ordering>,
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
