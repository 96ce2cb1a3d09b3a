//! `#[derive(Message)]`: parsing of the struct and of its `#[message(...)]` attributes.

use crate::args;
use crate::ctxt::{Errors, Setting};
use crate::template::{self, Piece};
use proc_macro2::{Ident, Span};
use syn::parse::ParseStream;
use syn::{Attribute, Data, DeriveInput, Field, Fields, LitStr, Meta, Type};

/// Arguments accepted on the struct, for the "unknown argument" error.
const STRUCT_ARGUMENTS: &str = "`name`, `key`";

/// A fully checked message type, ready for [`crate::expand::message`].
pub(crate) struct MessageDef {
    /// The type.
    pub(crate) ident: Ident,
    /// The routing name: `#[message(name = "...")]` or the type's name.
    pub(crate) name: LitStr,
    /// Where the idempotency key comes from.
    pub(crate) key: Key,
}

/// Where a message's idempotency key comes from.
pub(crate) enum Key {
    /// `#[message(key)]` on this field.
    Field(KeyPart),
    /// `#[message(key = "...")]` on the struct.
    Template {
        /// The template as written.
        template: LitStr,
        /// Literal text and fields, in order.
        segments: Vec<Segment>,
    },
}

/// A field used in a key.
pub(crate) struct KeyPart {
    /// The field.
    pub(crate) member: Ident,
    /// Its name without `r#`, for run-time errors.
    pub(crate) name: String,
    /// Its type: errors about it (not a `KeyPart`) point there.
    pub(crate) ty: Box<Type>,
}

/// A piece of a checked key template.
pub(crate) enum Segment {
    /// Literal text.
    Lit(String),
    /// A field's value.
    Field(KeyPart),
}

/// Parses and checks the input of `#[derive(Message)]`.
pub(crate) fn parse(input: &DeriveInput) -> syn::Result<MessageDef> {
    let mut errors = Errors::default();

    if !input.generics.params.is_empty() {
        errors.spanned(
            &input.generics,
            "`#[derive(Message)]` does not support generic types: a message is a concrete, \
             named type",
        );
    }
    if let Some(where_clause) = &input.generics.where_clause {
        errors.spanned(
            where_clause,
            "`#[derive(Message)]` does not support `where` clauses",
        );
    }

    let attrs = parse_struct_attrs(&input.attrs, &mut errors);

    let fields = match &input.data {
        Data::Struct(data) => match &data.fields {
            Fields::Named(fields) => Some(fields.named.iter().collect::<Vec<_>>()),
            Fields::Unnamed(fields) => {
                errors.spanned(
                    fields,
                    "`#[derive(Message)]` does not support tuple structs: name the fields, so \
                     that one of them can be the idempotency key",
                );
                None
            }
            Fields::Unit => {
                errors.spanned(
                    &input.ident,
                    "`#[derive(Message)]` does not support unit structs: a message needs a field \
                     to take its idempotency key from",
                );
                None
            }
        },
        Data::Enum(data) => {
            errors.spanned(
                data.enum_token,
                "`#[derive(Message)]` supports only structs with named fields, not enums",
            );
            None
        }
        Data::Union(data) => {
            errors.spanned(
                data.union_token,
                "`#[derive(Message)]` supports only structs with named fields, not unions",
            );
            None
        }
    };

    let mut key = None;
    if let Some(fields) = &fields {
        let field_key = parse_field_attrs(fields, attrs.template.as_ref(), &mut errors);
        if let Some(template) = &attrs.template {
            key = check_template(&input.ident, template, fields, &mut errors);
        } else if let Some(field) = field_key.field {
            key = Some(Key::Field(field));
        } else if !attrs.key_given && !field_key.attempted {
            errors.spanned(
                &input.ident,
                format_args!(
                    "`{}` has no idempotency key: mark the field that identifies the message \
                     with `#[message(key)]`, or build the key from several fields with \
                     `#[message(key = \"prefix:{{field}}\")]` on the struct",
                    input.ident
                ),
            );
        }
    }

    errors.finish()?;
    let name = attrs
        .name
        .unwrap_or_else(|| LitStr::new(&args::unraw(&input.ident), input.ident.span()));
    Ok(MessageDef {
        ident: input.ident.clone(),
        name,
        key: key.expect("no key without an error"),
    })
}

/// The struct-level `#[message(...)]` arguments.
struct StructAttrs {
    name: Option<LitStr>,
    template: Option<LitStr>,
    /// `key` was given on the struct, maybe with an invalid value (so a missing key is not
    /// worth another error).
    key_given: bool,
}

fn parse_struct_attrs(attrs: &[Attribute], errors: &mut Errors) -> StructAttrs {
    let mut name = Setting::new("name");
    let mut key = Setting::new("key");
    let parsed = message_attrs(attrs, "name = \"orders.placed\"", errors);
    for meta in &parsed.metas {
        let path = meta.path();
        if path.is_ident("name") {
            let lit = args::string_value(meta, errors, "\"orders.placed\"")
                .filter(|lit| args::check_stored_name(lit, "the message `name`", errors));
            name.set(errors, path, lit);
        } else if path.is_ident("key") {
            let lit = match meta {
                Meta::Path(_) => {
                    errors.spanned(
                        meta,
                        "on the struct, `key` takes a template, as in \
                         `#[message(key = \"order:{order_id}\")]`; to use one field as the key, \
                         put `#[message(key)]` on that field",
                    );
                    None
                }
                _ => args::string_value(meta, errors, "\"order:{order_id}\""),
            };
            key.set(errors, path, lit);
        } else {
            errors.spanned(
                path,
                format_args!(
                    "unknown argument `{}`, expected one of: {STRUCT_ARGUMENTS}",
                    args::path_name(path)
                ),
            );
        }
    }
    // A malformed attribute may have been meant to give the key.
    let key_given = key.is_given() || parsed.malformed;
    StructAttrs {
        name: name.get(),
        template: key.get(),
        key_given,
    }
}

/// Checks the `#[message(...)]` attributes of the fields.
fn parse_field_attrs(
    fields: &[&Field],
    template: Option<&LitStr>,
    errors: &mut Errors,
) -> FieldKey {
    let mut found = FieldKey {
        field: None,
        attempted: false,
    };
    for field in fields {
        let mut marked = Setting::new("key");
        let parsed = message_attrs(&field.attrs, "key", errors);
        found.attempted |= parsed.malformed;
        for meta in &parsed.metas {
            let path = meta.path();
            if !path.is_ident("key") {
                errors.spanned(
                    path,
                    format_args!(
                        "unknown field argument `{}`, expected `key`",
                        args::path_name(path)
                    ),
                );
                continue;
            }
            found.attempted = true;
            match meta {
                Meta::Path(_) => marked.set(errors, path, Some(path.clone())),
                _ => {
                    errors.spanned(
                        meta,
                        "`#[message(key)]` on a field takes no value; to build the key from \
                         several fields, put `#[message(key = \"...\")]` on the struct",
                    );
                    marked.set(errors, path, None);
                }
            }
        }
        let Some(path) = marked.get() else { continue };
        let member = field.ident.clone().expect("named fields have names");
        if template.is_some() {
            errors.spanned(
                &path,
                "the struct already takes its key from a template (`#[message(key = \"...\")]`); \
                 use either a key field or a key template, not both",
            );
        } else if let Some(first) = &found.field {
            errors.spanned(
                &path,
                format_args!(
                    "only one field can be `#[message(key)]`, and `{}` already is; to build the \
                     key from several fields, put a template on the struct, as in \
                     `#[message(key = \"{{{}}}:{{{}}}\")]`",
                    first.name,
                    first.name,
                    args::unraw(&member),
                ),
            );
        } else {
            found.field = Some(KeyPart {
                name: args::unraw(&member),
                member,
                ty: Box::new(field.ty.clone()),
            });
        }
    }
    found
}

/// The field marked `#[message(key)]`.
struct FieldKey {
    /// The first field so marked.
    field: Option<KeyPart>,
    /// Whether some field tried to be the key, even invalidly (so a missing key is not worth
    /// another error).
    attempted: bool,
}

/// Checks a key template against the struct's fields.
fn check_template(
    ident: &Ident,
    template: &LitStr,
    fields: &[&Field],
    errors: &mut Errors,
) -> Option<Key> {
    let text = template.value();
    if text.is_empty() {
        errors.spanned(
            template,
            "the key template is empty; name at least one field, as in `\"order:{order_id}\"`",
        );
        return None;
    }
    let pieces = match template::parse(&text) {
        Ok(pieces) => pieces,
        Err(e) => {
            errors.spanned(template, e);
            return None;
        }
    };
    let before = errors.len();
    let mut segments = Vec::with_capacity(pieces.len());
    for piece in pieces {
        match piece {
            Piece::Lit(lit) => segments.push(Segment::Lit(lit)),
            Piece::Field(name) => match find_field(fields, &name) {
                Some(field) => {
                    let member = field.ident.clone().expect("named fields have names");
                    segments.push(Segment::Field(KeyPart {
                        name: args::unraw(&member),
                        member: with_span(&member, template.span()),
                        ty: Box::new(field.ty.clone()),
                    }));
                }
                None if args::field_ident(&name, Span::call_site()).is_none() => errors.spanned(
                    template,
                    format_args!(
                        "invalid placeholder `{{{name}}}` in key template: placeholders are field \
                         names, with no format specifiers or spaces"
                    ),
                ),
                None => errors.spanned(
                    template,
                    format_args!(
                        "the key template uses `{{{name}}}`, but `{ident}` has no field `{name}`; \
                         its fields are {}",
                        field_list(fields)
                    ),
                ),
            },
        }
    }
    if errors.len() > before {
        return None;
    }
    if !segments.iter().any(|s| matches!(s, Segment::Field(_))) {
        errors.spanned(
            template,
            format_args!(
                "the key template {text:?} has no `{{field}}` placeholder, so every `{ident}` \
                 would have the same key and all but the first would be dropped as duplicates"
            ),
        );
        return None;
    }
    Some(Key::Template {
        template: template.clone(),
        segments,
    })
}

/// The field called `name` (`type` and `r#type` both find the field `r#type`).
fn find_field<'a>(fields: &[&'a Field], name: &str) -> Option<&'a Field> {
    let wanted = args::field_ident(name, Span::call_site())?;
    let wanted = args::unraw(&wanted);
    fields.iter().copied().find(|field| {
        field
            .ident
            .as_ref()
            .is_some_and(|i| args::unraw(i) == wanted)
    })
}

fn field_list(fields: &[&Field]) -> String {
    if fields.is_empty() {
        return "none".to_owned();
    }
    let names: Vec<String> = fields
        .iter()
        .filter_map(|f| f.ident.as_ref())
        .map(|i| format!("`{}`", args::unraw(i)))
        .collect();
    names.join(", ")
}

/// `ident` with another span (keeping `r#`).
fn with_span(ident: &Ident, span: Span) -> Ident {
    let mut ident = ident.clone();
    ident.set_span(span);
    ident
}

/// The arguments of every `#[message(...)]` attribute in `attrs`; malformed attributes are
/// reported and skipped. `example` is an argument shown in syntax errors.
fn message_attrs(attrs: &[Attribute], example: &str, errors: &mut Errors) -> MessageAttrs {
    let mut parsed = MessageAttrs {
        metas: Vec::new(),
        malformed: false,
    };
    for attr in attrs.iter().filter(|attr| attr.path().is_ident("message")) {
        let list = attr.meta.require_list().and_then(|list| {
            list.parse_args_with(|input: ParseStream<'_>| args::parse_meta_list(input, example))
        });
        match list {
            Ok(list) => parsed.metas.extend(list),
            Err(e) => {
                errors.push(e);
                parsed.malformed = true;
            }
        }
    }
    parsed
}

/// What [`message_attrs`] found.
struct MessageAttrs {
    /// The arguments of the well-formed attributes.
    metas: Vec<Meta>,
    /// Whether some attribute could not be parsed (and so might have held a key).
    malformed: bool,
}

/// The whole derive: parse, check, generate.
pub(crate) fn derive(input: proc_macro2::TokenStream) -> proc_macro2::TokenStream {
    let input = match syn::parse2::<DeriveInput>(input) {
        Ok(input) => input,
        Err(e) => return e.to_compile_error(),
    };
    match parse(&input) {
        Ok(def) => crate::expand::message(&def),
        Err(e) => e.to_compile_error(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use quote::quote;

    fn parse_tokens(tokens: proc_macro2::TokenStream) -> syn::Result<MessageDef> {
        parse(&syn::parse2(tokens).unwrap())
    }

    fn errors_of(tokens: proc_macro2::TokenStream) -> Vec<String> {
        match parse_tokens(tokens) {
            Ok(_) => Vec::new(),
            Err(e) => e.into_iter().map(|e| e.to_string()).collect(),
        }
    }

    #[test]
    fn field_key_and_default_name() {
        let def = parse_tokens(quote! {
            struct r#Placed { a: u8, #[message(key)] r#ref: u64 }
        })
        .unwrap();
        assert_eq!(def.name.value(), "Placed");
        let Key::Field(part) = def.key else {
            panic!("not a field key")
        };
        assert_eq!(part.member, "r#ref");
        assert_eq!(part.name, "ref");
    }

    #[test]
    fn template_key_segments() {
        let def = parse_tokens(quote! {
            #[message(name = "orders.placed", key = "{{o}}:{region}-{id}")]
            struct Placed { id: u64, region: String }
        })
        .unwrap();
        assert_eq!(def.name.value(), "orders.placed");
        let Key::Template { template, segments } = def.key else {
            panic!("not a template")
        };
        assert_eq!(template.value(), "{{o}}:{region}-{id}");
        let rendered: Vec<String> = segments
            .iter()
            .map(|s| match s {
                Segment::Lit(text) => format!("lit {text}"),
                Segment::Field(part) => format!("field {}", part.name),
            })
            .collect();
        assert_eq!(rendered, ["lit {o}:", "field region", "lit -", "field id"]);
    }

    #[test]
    fn reports_every_problem_at_once() {
        let errors = errors_of(quote! {
            #[message(name = "", topic = "t")]
            struct Many<T> { #[message(key, key)] id: T }
        });
        assert_eq!(
            errors,
            [
                "`#[derive(Message)]` does not support generic types: a message is a concrete, \
                 named type",
                "the message `name` must not be empty",
                "unknown argument `topic`, expected one of: `name`, `key`",
                "`key` set multiple times",
            ]
        );
    }

    #[test]
    fn no_key_is_reported_once() {
        assert_eq!(
            errors_of(quote!(
                struct S {
                    id: u64,
                }
            ))
            .len(),
            1
        );
        // An invalid attempt at a key is not also a missing key.
        assert_eq!(
            errors_of(quote!(
                struct S {
                    #[message(key = "x")]
                    id: u64,
                }
            ))
            .len(),
            1
        );
        assert_eq!(
            errors_of(quote!(
                #[message(key)]
                struct S {
                    id: u64,
                }
            ))
            .len(),
            1
        );
        assert_eq!(
            errors_of(quote!(
                #[message(key = )]
                struct S {
                    id: u64,
                }
            ))
            .len(),
            1
        );
    }

    #[test]
    fn generated_code_is_valid_rust() {
        let output = derive(quote! {
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
}
