//! `#[derive(Message)]`: parsing of the struct and of its `#[message(...)]` attributes.

use crate::args;
use crate::ctxt::{Errors, Setting};
use crate::template::{self, Piece};
use proc_macro2::{Ident, Span};
use syn::parse::ParseStream;
use syn::{Attribute, Data, DeriveInput, Field, Fields, LitStr, Meta, Path, Type};

/// Arguments accepted on the struct, for the "unknown argument" error.
const STRUCT_ARGUMENTS: &str = "`name`, `key`";

/// Markers accepted on a field, for the "unknown field argument" error.
const FIELD_ARGUMENTS: &str = "`key`, `aggregate`, `sequence`, `partition`";

/// A fully checked message type, ready for [`crate::expand::message`].
pub(crate) struct MessageDef {
    /// The type.
    pub(crate) ident: Ident,
    /// The routing name: `#[message(name = "...")]` or the type's name.
    pub(crate) name: LitStr,
    /// Where the idempotency key comes from.
    pub(crate) key: Key,
    /// The fields marked `#[message(aggregate)]` and `#[message(sequence)]`, if any.
    pub(crate) ordering: Option<OrderingFields>,
    /// The fields marked `#[message(partition)]`, in field order (none: the message declares
    /// no partitions of its own).
    pub(crate) partitions: Vec<FieldRef>,
}

/// The fields a message's ordering is read from.
pub(crate) struct OrderingFields {
    /// The field marked `#[message(aggregate)]`: which aggregate the message belongs to.
    pub(crate) aggregate: FieldRef,
    /// The field marked `#[message(sequence)]`: the message's position among the aggregate's.
    pub(crate) sequence: FieldRef,
}

/// Where a message's idempotency key comes from.
pub(crate) enum Key {
    /// `#[message(key)]` on this field.
    Field(FieldRef),
    /// `#[message(key = "...")]` on the struct.
    Template {
        /// The template as written.
        template: LitStr,
        /// Literal text and fields, in order.
        segments: Vec<Segment>,
    },
}

/// A field used in a key or in the ordering.
pub(crate) struct FieldRef {
    /// The field.
    pub(crate) member: Ident,
    /// Its name without `r#`, for run-time errors.
    pub(crate) name: String,
    /// Its type: errors about it (not a `KeyPart`, not a `SequencePart`) point there.
    pub(crate) ty: Box<Type>,
}

/// A piece of a checked key template.
pub(crate) enum Segment {
    /// Literal text.
    Lit(String),
    /// A field's value.
    Field(FieldRef),
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

    let fields = named_fields(input, &mut errors);

    let mut key = None;
    let mut ordering = None;
    let mut partitions = Vec::new();
    if let Some(fields) = &fields {
        let mut markers = parse_field_attrs(fields, attrs.template.as_ref(), &mut errors);
        for &marker in &attrs.misplaced {
            // Already reported: not also missing.
            markers.get(marker).attempted = true;
        }
        if let Some(template) = &attrs.template {
            key = check_template(&input.ident, template, fields, &mut errors);
        } else if let Some((_, field)) = markers.key.field.take() {
            key = Some(Key::Field(field));
        } else if !attrs.key_given && !markers.key.attempted {
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
        ordering = markers.ordering(&mut errors);
        partitions = std::mem::take(&mut markers.partitions);
    }

    errors.finish()?;
    let name = attrs
        .name
        .unwrap_or_else(|| LitStr::new(&args::unraw(&input.ident), input.ident.span()));
    Ok(MessageDef {
        ident: input.ident.clone(),
        name,
        key: key.expect("no key without an error"),
        ordering,
        partitions,
    })
}

/// The fields of a struct with named fields; anything else is reported.
fn named_fields<'a>(input: &'a DeriveInput, errors: &mut Errors) -> Option<Vec<&'a Field>> {
    match &input.data {
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
    }
}

/// The type `#[derive(Message)]` still implements `Message` for when it rejected the input (see
/// [`crate::expand::message_fallback`]): any type but a generic one, whose impl would need bounds
/// the derive cannot know.
pub(crate) fn fallback(input: &DeriveInput) -> Option<&Ident> {
    let generic = !input.generics.params.is_empty() || input.generics.where_clause.is_some();
    (!generic).then_some(&input.ident)
}

/// The struct-level `#[message(...)]` arguments.
struct StructAttrs {
    name: Option<LitStr>,
    template: Option<LitStr>,
    /// `key` was given on the struct, maybe with an invalid value (so a missing key is not
    /// worth another error).
    key_given: bool,
    /// Field markers (`aggregate`, `sequence`, `partition`) wrongly given on the struct: already
    /// reported.
    misplaced: Vec<Marker>,
}

fn parse_struct_attrs(attrs: &[Attribute], errors: &mut Errors) -> StructAttrs {
    let mut name = Setting::new("name");
    let mut key = Setting::new("key");
    let mut misplaced = Vec::new();
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
        } else if let Some(marker) = Marker::FIELD_ONLY
            .into_iter()
            .find(|m| path.is_ident(m.name()))
        {
            misplaced.push(marker);
            errors.spanned(
                path,
                format_args!(
                    "`{0}` is a field marker: put `#[message({0})]` on the field that holds the \
                     message's {1}",
                    marker.name(),
                    marker.what(),
                ),
            );
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
        misplaced,
    }
}

/// Checks the `#[message(...)]` markers of the fields: `key`, `aggregate`, `sequence`,
/// `partition`.
fn parse_field_attrs(
    fields: &[&Field],
    template: Option<&LitStr>,
    errors: &mut Errors,
) -> FieldMarkers {
    let mut found = FieldMarkers::default();
    for field in fields {
        let marks = field_marks(field, errors, &mut found);
        let member = field.ident.clone().expect("named fields have names");
        let field_ref = || FieldRef {
            name: args::unraw(&member),
            member: member.clone(),
            ty: Box::new(field.ty.clone()),
        };
        if let Some(path) = marks.key {
            if template.is_some() {
                errors.spanned(
                    &path,
                    "the struct already takes its key from a template \
                     (`#[message(key = \"...\")]`); use either a key field or a key template, \
                     not both",
                );
            } else if let Some((_, first)) = &found.key.field {
                errors.spanned(
                    &path,
                    format_args!(
                        "only one field can be `#[message(key)]`, and `{}` already is; to build \
                         the key from several fields, put a template on the struct, as in \
                         `#[message(key = \"{{{}}}:{{{}}}\")]`",
                        first.name,
                        first.name,
                        args::unraw(&member),
                    ),
                );
            } else {
                found.key.field = Some((path, field_ref()));
            }
        }
        if marks.partition.is_some() {
            found.partitions.push(field_ref());
        }
        for (marker, path) in [
            (Marker::Aggregate, marks.aggregate),
            (Marker::Sequence, marks.sequence),
        ] {
            let Some(path) = path else { continue };
            let slot = found.get(marker);
            if let Some((_, first)) = &slot.field {
                errors.spanned(
                    &path,
                    format_args!(
                        "only one field can be `#[message({})]`, and `{}` already is: {}",
                        marker.name(),
                        first.name,
                        match marker {
                            Marker::Aggregate => "a message belongs to one aggregate",
                            _ => "a message has one position in its aggregate's sequence",
                        },
                    ),
                );
            } else {
                slot.field = Some((path, field_ref()));
            }
        }
    }
    found
}

/// The markers of one field, each `Some` if given once and without a value.
struct FieldMarks {
    key: Option<Path>,
    aggregate: Option<Path>,
    sequence: Option<Path>,
    partition: Option<Path>,
}

/// Parses the `#[message(...)]` attributes of one field, reporting what is wrong in them, and
/// records in `found` which markers were attempted.
fn field_marks(field: &Field, errors: &mut Errors, found: &mut FieldMarkers) -> FieldMarks {
    let mut key = Setting::new("key");
    let mut aggregate = Setting::new("aggregate");
    let mut sequence = Setting::new("sequence");
    let mut partition = Setting::new("partition");
    let parsed = message_attrs(&field.attrs, "key", errors);
    if parsed.malformed {
        // It may have been meant to be any marker: none is worth a "missing" error.
        for marker in Marker::ALL {
            found.get(marker).attempted = true;
        }
    }
    for meta in &parsed.metas {
        let path = meta.path();
        let Some(marker) = Marker::ALL.into_iter().find(|m| path.is_ident(m.name())) else {
            errors.spanned(
                path,
                format_args!(
                    "unknown field argument `{}`, expected one of: {FIELD_ARGUMENTS}",
                    args::path_name(path)
                ),
            );
            continue;
        };
        found.get(marker).attempted = true;
        let (setting, other) = match marker {
            Marker::Key => (&mut key, None),
            Marker::Aggregate => (&mut aggregate, Some(&sequence)),
            Marker::Sequence => (&mut sequence, Some(&aggregate)),
            Marker::Partition => (&mut partition, None),
        };
        if !matches!(meta, Meta::Path(_)) {
            errors.spanned(meta, marker.takes_no_value());
            setting.set(errors, path, None);
        } else if other.is_some_and(Setting::is_given) {
            errors.spanned(
                path,
                "a field cannot be both `#[message(aggregate)]` and `#[message(sequence)]`: the \
                 aggregate field says which entity the message is about, the sequence field \
                 where the message stands among that entity's messages",
            );
            setting.set(errors, path, None);
        } else {
            setting.set(errors, path, Some(path.clone()));
        }
    }
    FieldMarks {
        key: key.get(),
        aggregate: aggregate.get(),
        sequence: sequence.get(),
        partition: partition.get(),
    }
}

/// A field-level marker.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Marker {
    /// `#[message(key)]`.
    Key,
    /// `#[message(aggregate)]`.
    Aggregate,
    /// `#[message(sequence)]`.
    Sequence,
    /// `#[message(partition)]`.
    Partition,
}

impl Marker {
    const ALL: [Self; 4] = [Self::Key, Self::Aggregate, Self::Sequence, Self::Partition];
    /// The markers that exist only on fields (`key` on the struct takes a template).
    const FIELD_ONLY: [Self; 3] = [Self::Aggregate, Self::Sequence, Self::Partition];

    fn name(self) -> &'static str {
        match self {
            Self::Key => "key",
            Self::Aggregate => "aggregate",
            Self::Sequence => "sequence",
            Self::Partition => "partition",
        }
    }

    /// What the marked field holds.
    fn what(self) -> &'static str {
        match self {
            Self::Key => "idempotency key",
            Self::Aggregate => "aggregate id",
            Self::Sequence => "sequence number",
            Self::Partition => "partition (an aggregate id its handlers lock)",
        }
    }

    /// The error for `#[message(marker = ...)]` or `#[message(marker(...))]` on a field.
    fn takes_no_value(self) -> &'static str {
        match self {
            Self::Key => {
                "`#[message(key)]` on a field takes no value; to build the key from several \
                 fields, put `#[message(key = \"...\")]` on the struct"
            }
            Self::Aggregate => {
                "`#[message(aggregate)]` takes no value: it marks the field it is on as the \
                 message's aggregate id"
            }
            Self::Sequence => {
                "`#[message(sequence)]` takes no value: it marks the field it is on as the \
                 message's sequence number"
            }
            Self::Partition => {
                "`#[message(partition)]` takes no value: it marks the field it is on as a \
                 partition of the message (an aggregate id its handlers lock); mark several \
                 fields for several partitions"
            }
        }
    }
}

/// What the markers of all fields designate.
#[derive(Default)]
struct FieldMarkers {
    key: Marked,
    aggregate: Marked,
    sequence: Marked,
    partition: Marked,
    /// The fields marked `#[message(partition)]` (any number), in field order.
    partitions: Vec<FieldRef>,
}

impl FieldMarkers {
    fn get(&mut self, marker: Marker) -> &mut Marked {
        match marker {
            Marker::Key => &mut self.key,
            Marker::Aggregate => &mut self.aggregate,
            Marker::Sequence => &mut self.sequence,
            Marker::Partition => &mut self.partition,
        }
    }

    /// The ordering fields, if both are marked; one without the other is reported (unless the
    /// other was attempted, invalidly: that is already an error).
    fn ordering(&mut self, errors: &mut Errors) -> Option<OrderingFields> {
        match (self.aggregate.field.take(), self.sequence.field.take()) {
            (Some((_, aggregate)), Some((_, sequence))) => Some(OrderingFields {
                aggregate,
                sequence,
            }),
            (Some((path, _)), None) if !self.sequence.attempted => {
                errors.spanned(
                    path,
                    "`#[message(aggregate)]` needs a `#[message(sequence)]` field too: messages \
                     are ordered by their sequence numbers within their aggregate",
                );
                None
            }
            (None, Some((path, _))) if !self.aggregate.attempted => {
                errors.spanned(
                    path,
                    "`#[message(sequence)]` needs an `#[message(aggregate)]` field too: sequence \
                     numbers are compared between the messages of one aggregate",
                );
                None
            }
            _ => None,
        }
    }
}

/// The field designated by one marker.
#[derive(Default)]
struct Marked {
    /// The first field so marked, with the marker (errors about it point there).
    field: Option<(Path, FieldRef)>,
    /// Whether some field tried to carry the marker, even invalidly (so a missing marker is not
    /// worth another error).
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
                    segments.push(Segment::Field(FieldRef {
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
    fn ordering_markers() {
        let def = parse_tokens(quote! {
            struct Shipped {
                #[message(key, aggregate)]
                r#ref: String,
                #[message(sequence)]
                seq: Option<u32>,
            }
        })
        .unwrap_or_else(|e| panic!("{e}"));
        let ordering = def.ordering.unwrap();
        assert_eq!(ordering.aggregate.member, "r#ref");
        assert_eq!(ordering.aggregate.name, "ref");
        assert_eq!(ordering.sequence.name, "seq");
        assert!(matches!(def.key, Key::Field(ref part) if part.name == "ref"));

        // With a key template, and with the markers in separate attributes.
        let def = parse_tokens(quote! {
            #[message(key = "{order_id}:{seq}")]
            struct Paid {
                #[message(aggregate)]
                #[doc = "x"]
                order_id: u64,
                #[message(sequence)]
                seq: i64,
            }
        })
        .unwrap_or_else(|e| panic!("{e}"));
        assert!(def.ordering.is_some());

        let def = parse_tokens(quote! {
            struct Plain { #[message(key)] id: u64 }
        })
        .unwrap();
        assert!(def.ordering.is_none());
    }

    #[test]
    fn partition_markers() {
        let def = parse_tokens(quote! {
            struct Transfer {
                #[message(key)]
                id: String,
                #[message(partition)]
                r#from: String,
                amount: i64,
                #[message(partition)]
                to: Option<String>,
            }
        })
        .unwrap_or_else(|e| panic!("{e}"));
        let names: Vec<&str> = def.partitions.iter().map(|p| p.name.as_str()).collect();
        assert_eq!(names, ["from", "to"]);
        assert_eq!(def.partitions[0].member, "r#from");

        // On the key field, or on the aggregate, too; in one attribute with them.
        let def = parse_tokens(quote! {
            struct Shipped {
                #[message(key, partition)] id: String,
                #[message(aggregate, partition)] order: u64,
                #[message(sequence)] seq: u64,
            }
        })
        .unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(def.partitions.len(), 2);
        assert!(def.ordering.is_some());

        let def = parse_tokens(quote! {
            struct Plain { #[message(key)] id: u64 }
        })
        .unwrap();
        assert!(def.partitions.is_empty());
    }

    #[test]
    fn partition_marker_mistakes() {
        assert_eq!(
            errors_of(quote! {
                struct S { #[message(key)] id: u64, #[message(partition = "x")] account: u64 }
            }),
            [
                "`#[message(partition)]` takes no value: it marks the field it is on as a \
                 partition of the message (an aggregate id its handlers lock); mark several \
                 fields for several partitions"
            ]
        );
        assert_eq!(
            errors_of(quote! {
                #[message(partition)]
                struct S { #[message(key)] id: u64 }
            }),
            [
                "`partition` is a field marker: put `#[message(partition)]` on the field that \
                 holds the message's partition (an aggregate id its handlers lock)"
            ]
        );
        assert_eq!(
            errors_of(quote! {
                struct S { #[message(key, partition, partition)] id: u64 }
            }),
            ["`partition` set multiple times"]
        );
    }

    #[test]
    fn ordering_marker_mistakes() {
        assert_eq!(
            errors_of(quote! {
                struct S { #[message(key, aggregate)] id: u64 }
            }),
            [
                "`#[message(aggregate)]` needs a `#[message(sequence)]` field too: messages are \
                 ordered by their sequence numbers within their aggregate"
            ]
        );
        assert_eq!(
            errors_of(quote! {
                struct S { #[message(key)] id: u64, #[message(sequence)] seq: u64 }
            }),
            [
                "`#[message(sequence)]` needs an `#[message(aggregate)]` field too: sequence \
                 numbers are compared between the messages of one aggregate"
            ]
        );
        assert_eq!(
            errors_of(quote! {
                struct S {
                    #[message(key, aggregate, aggregate)] id: u64,
                    #[message(aggregate)] other: u64,
                    #[message(sequence)] seq: u64,
                    #[message(sequence)] seq2: u64,
                }
            }),
            [
                "`aggregate` set multiple times",
                "only one field can be `#[message(aggregate)]`, and `id` already is: a message \
                 belongs to one aggregate",
                "only one field can be `#[message(sequence)]`, and `seq` already is: a message \
                 has one position in its aggregate's sequence",
            ]
        );
        // Both on one field: one error, at the second marker, and not also "missing".
        let both = "a field cannot be both `#[message(aggregate)]` and `#[message(sequence)]`: \
                    the aggregate field says which entity the message is about, the sequence \
                    field where the message stands among that entity's messages";
        assert_eq!(
            errors_of(quote! {
                struct S { #[message(key)] id: u64, #[message(sequence, aggregate)] seq: u64 }
            }),
            [both]
        );
        assert_eq!(
            errors_of(quote! {
                struct S {
                    #[message(key)] id: u64,
                    #[message(aggregate)]
                    #[message(sequence)]
                    seq: u64,
                }
            }),
            [both]
        );
        // A marker with a value is reported once, not also as missing.
        assert_eq!(
            errors_of(quote! {
                struct S { #[message(key, aggregate)] id: u64, #[message(sequence = 1)] seq: u64 }
            }),
            [
                "`#[message(sequence)]` takes no value: it marks the field it is on as the \
                 message's sequence number"
            ]
        );
        // On the struct: pointed to the field, and not also missing.
        assert_eq!(
            errors_of(quote! {
                #[message(aggregate = "id")]
                struct S { #[message(key)] id: u64, #[message(sequence)] seq: u64 }
            }),
            [
                "`aggregate` is a field marker: put `#[message(aggregate)]` on the field that \
                 holds the message's aggregate id"
            ]
        );
        assert_eq!(
            errors_of(quote! {
                struct S { #[message(key, ordered)] id: u64 }
            }),
            [
                "unknown field argument `ordered`, expected one of: `key`, `aggregate`, \
                 `sequence`, `partition`"
            ]
        );
    }
}
