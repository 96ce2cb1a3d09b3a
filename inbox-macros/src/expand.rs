//! Code generation for both macros, from the checked models of [`crate::attr`] and
//! [`crate::message`].
//!
//! Generated code names only `::inbox_runtime::...` paths (and `::core`/`::std`), so it works
//! wherever the user depends on `inbox-runtime`, under any import names.

use crate::attr::{self, Handler};
use crate::message::{Key, KeyPart, MessageDef, Segment};
use proc_macro2::{Span, TokenStream};
use quote::{format_ident, quote, quote_spanned};
use syn::ext::IdentExt;
use syn::spanned::Spanned;

/// `impl ::inbox_runtime::Message for ...`.
pub(crate) fn message(def: &MessageDef) -> TokenStream {
    let MessageDef { ident, name, key } = def;
    let key_part_fn = key_part_fn();
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
        }
    }
}

/// `&self.field` as a `&dyn KeyPart`, through the function of [`key_part_fn`] so that a field type that is no
/// `KeyPart` is blamed on the field's type.
fn field_ref(part: &KeyPart) -> TokenStream {
    let member = &part.member;
    let ty = &part.ty;
    let function = quote_spanned!(ty.span()=> __inbox_key_part::<#ty>);
    quote!(#function(&self.#member))
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

    // `#[cfg]` applies to everything generated; lint levels also to the body, which lives in
    // its own function; `#[expect]` only to the body (the outer function cannot trigger it).
    let cfgs: Vec<_> = func.attrs.iter().filter(|a| attr::is_cfg(a)).collect();
    let body_attrs = func
        .attrs
        .iter()
        .filter(|a| attr::is_lint_level(a) || attr::is_expect(a));
    let outer_attrs = func.attrs.iter().filter(|a| !attr::is_expect(a));

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

            #classify

            fn key(
                msg: &#message,
            ) -> ::core::result::Result<::inbox_runtime::IdempotencyKey, ::inbox_runtime::KeyError>
            {
                #key_body
            }

            fn call<'c>(
                conn: &'c mut #connection,
                msg: #message,
            ) -> #private::BoxFuture<'c, #output> {
                #(#body_attrs)*
                async fn __inbox_body(#inputs) -> #output #block
                ::std::boxed::Box::pin(__inbox_body(conn, msg))
            }
        }

        #(#cfgs)*
        #private::inventory::submit! {
            #private::Registration::new(#registered)
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
