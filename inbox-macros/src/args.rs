//! Helpers shared by the argument parsers of both macros.

use crate::ctxt::Errors;
use proc_macro2::{Ident, Span};
use syn::ext::IdentExt;
use syn::parse::ParseStream;
use syn::punctuated::Punctuated;
use syn::{Expr, ExprLit, Lit, LitStr, Meta, MetaNameValue, Path, Token};

/// A comma-separated list of `name = value` / `name` / `name(...)` arguments.
pub(crate) type MetaList = Punctuated<Meta, Token![,]>;

/// Parses the tokens between the parentheses of an attribute into a [`MetaList`].
///
/// Like `Punctuated::<Meta, Token![,]>::parse_terminated`, with errors that say what an argument
/// looks like; `example` is one, such as `consumer = "ledger"`.
pub(crate) fn parse_meta_list(input: ParseStream<'_>, example: &str) -> syn::Result<MetaList> {
    let mut list = MetaList::new();
    while !input.is_empty() {
        if input.peek(Lit) {
            let lit: Lit = input.parse()?;
            return Err(syn::Error::new(
                lit.span(),
                format_args!("expected an argument name, as in `{example}`"),
            ));
        }
        let meta = if peek_name_value(input) {
            let path: Path = input.parse()?;
            let eq_token: Token![=] = input.parse()?;
            if input.is_empty() || input.peek(Token![,]) {
                return Err(syn::Error::new(
                    eq_token.span,
                    format_args!("expected a value after `{} =`", path_name(&path)),
                ));
            }
            Meta::NameValue(MetaNameValue {
                path,
                eq_token,
                value: input.parse()?,
            })
        } else {
            input.parse::<Meta>()?
        };
        list.push_value(meta);
        if input.is_empty() {
            break;
        }
        if !input.peek(Token![,]) {
            let name = path_name(list.last().expect("just pushed").path());
            let message = match list.last() {
                Some(Meta::Path(_)) => format!("expected `=` or `,` after `{name}`"),
                _ => format!("expected `,` after the `{name}` argument"),
            };
            return Err(input.error(message));
        }
        list.push_punct(input.parse()?);
    }
    Ok(list)
}

/// Whether the input starts with `path =`.
fn peek_name_value(input: ParseStream<'_>) -> bool {
    let fork = input.fork();
    fork.parse::<Path>().is_ok() && fork.peek(Token![=])
}

/// `a::b` for a path, as the user spelled it (for error messages).
pub(crate) fn path_name(path: &Path) -> String {
    let mut name = String::new();
    if path.leading_colon.is_some() {
        name.push_str("::");
    }
    for (i, segment) in path.segments.iter().enumerate() {
        if i > 0 {
            name.push_str("::");
        }
        name.push_str(&segment.ident.to_string());
    }
    name
}

/// The string literal of a `name = "..."` argument; anything else is reported and gives `None`.
///
/// `example` is a sample value shown in the error, like `"ledger"`.
pub(crate) fn string_value(meta: &Meta, errors: &mut Errors, example: &str) -> Option<LitStr> {
    let name = path_name(meta.path());
    match meta {
        Meta::NameValue(nv) => match peel_expr(&nv.value) {
            Expr::Lit(ExprLit {
                lit: Lit::Str(lit), ..
            }) => Some(lit.clone()),
            other => {
                errors.spanned(
                    other,
                    format_args!("`{name}` must be a string literal, as in `{name} = {example}`"),
                );
                None
            }
        },
        Meta::Path(_) | Meta::List(_) => {
            errors.spanned(meta, format_args!("expected `{name} = {example}`"));
            None
        }
    }
}

/// The positive integer of a `name = N` argument (`1..=u32::MAX`); anything else is reported and
/// gives `None`.
pub(crate) fn positive_int_value(
    meta: &Meta,
    errors: &mut Errors,
    example: &str,
) -> Option<syn::LitInt> {
    let name = path_name(meta.path());
    let lit = match meta {
        Meta::NameValue(nv) => match peel_expr(&nv.value) {
            Expr::Lit(ExprLit {
                lit: Lit::Int(lit), ..
            }) => lit.clone(),
            other => {
                errors.spanned(
                    other,
                    format_args!("`{name}` must be an integer literal, as in `{name} = {example}`"),
                );
                return None;
            }
        },
        Meta::Path(_) | Meta::List(_) => {
            errors.spanned(meta, format_args!("expected `{name} = {example}`"));
            return None;
        }
    };
    match lit.base10_parse::<u32>() {
        Ok(0) | Err(_) => {
            errors.spanned(
                &lit,
                format_args!("`{name}` must be between 1 and {}", u32::MAX),
            );
            None
        }
        Ok(_) => Some(lit),
    }
}

/// Looks through invisible groups: a `$value:literal` of a `macro_rules!` macro arrives wrapped
/// in one.
fn peel_expr(mut expr: &Expr) -> &Expr {
    while let Expr::Group(group) = expr {
        expr = &group.expr;
    }
    expr
}

/// Checks a name that ends up stored in the inbox table or compared at run time (a consumer name,
/// a message name): it must be non-empty, without surrounding whitespace or control characters.
///
/// `what` names the argument in the error, e.g. `` `consumer` ``.
pub(crate) fn check_stored_name(lit: &LitStr, what: &str, errors: &mut Errors) -> bool {
    let value = lit.value();
    let problem = if value.is_empty() {
        "must not be empty"
    } else if value.trim() != value {
        "must not start or end with whitespace"
    } else if value.chars().any(char::is_control) {
        "must not contain control characters"
    } else {
        return true;
    };
    errors.spanned(lit, format_args!("{what} {problem}"));
    false
}

/// Keywords that cannot name a field even as raw identifiers (`r#self` is not a thing).
const NOT_RAW: &[&str] = &["self", "Self", "super", "crate", "_"];

/// The identifier of the field called `name`, spanned at `span`, or `None` if `name` cannot be a
/// field name. Both `type` and `r#type` give the raw identifier `r#type`.
pub(crate) fn field_ident(name: &str, span: Span) -> Option<Ident> {
    let bare = name.strip_prefix("r#").unwrap_or(name);
    if NOT_RAW.contains(&bare) {
        return None;
    }
    // Round-trip through the lexer: rejects surrounding whitespace, several tokens, numbers...
    let parsed = syn::parse_str::<Ident>(bare)
        .or_else(|_| syn::parse::Parser::parse_str(Ident::parse_any, bare))
        .ok()?;
    if parsed != bare {
        return None;
    }
    // A keyword (`type`) only parses through `parse_any`; it names the field `r#type`.
    if syn::parse_str::<Ident>(bare).is_ok() {
        Some(Ident::new(bare, span))
    } else {
        Some(Ident::new_raw(bare, span))
    }
}

/// The name of a field as the user and the runtime see it: `type` for `r#type`.
pub(crate) fn unraw(ident: &Ident) -> String {
    ident.unraw().to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn field_idents() {
        let span = Span::call_site();
        assert_eq!(field_ident("event_id", span).unwrap(), "event_id");
        assert_eq!(field_ident("_private", span).unwrap(), "_private");
        assert_eq!(field_ident("café", span).unwrap(), "café");
        assert_eq!(field_ident("type", span).unwrap(), "r#type");
        assert_eq!(field_ident("r#type", span).unwrap(), "r#type");
        assert_eq!(field_ident("r#id", span).unwrap(), "id");
        for bad in [
            "", " id", "id ", "a b", "a.b", "0", "1abc", "self", "Self", "crate", "super", "_",
            "r#", "r#self", "a-b", "{id}", "id:?", "\"id\"",
        ] {
            assert!(field_ident(bad, span).is_none(), "{bad:?} accepted");
        }
    }

    #[test]
    fn stored_names() {
        let check = |s: &str| {
            let mut errors = Errors::default();
            let ok = check_stored_name(&LitStr::new(s, Span::call_site()), "`x`", &mut errors);
            assert_eq!(ok, errors.is_empty());
            errors.finish().err().map(|e| e.to_string())
        };
        assert_eq!(check("ledger"), None);
        assert_eq!(check("payments.captured v2"), None);
        assert_eq!(check("").unwrap(), "`x` must not be empty");
        assert_eq!(
            check(" ledger").unwrap(),
            "`x` must not start or end with whitespace"
        );
        assert_eq!(
            check("a\0b").unwrap(),
            "`x` must not contain control characters"
        );
    }
}
