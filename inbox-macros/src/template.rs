//! The key template language of `#[message(key = "...")]`.
//!
//! A template is literal text with `{field}` placeholders; `{{` and `}}` stand for literal braces.
//! This module only splits the text; checking that placeholders name real fields is the job of
//! [`crate::message`], which knows the struct.

use std::fmt;

/// One piece of a parsed template.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Piece {
    /// Literal text, with `{{`/`}}` escapes already resolved. Never empty.
    Lit(String),
    /// The text between `{` and `}`: a field name, not yet checked.
    Field(String),
}

/// Why a template could not be split.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum TemplateError {
    /// A `{` with no matching `}`.
    Unclosed,
    /// A `}` that closes nothing (and is not part of `}}`).
    UnmatchedClose,
    /// A `{}` placeholder.
    EmptyPlaceholder,
    /// A `{` inside a placeholder, as in `{a{b}`.
    NestedOpen(String),
    /// Two placeholders with no literal text between them, as in `{a}{b}`: the key would be
    /// ambiguous (`("ab", "c")` and `("a", "bc")` give the same key).
    Adjacent(String, String),
}

impl fmt::Display for TemplateError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Unclosed => {
                f.write_str("unclosed `{` in key template; write `{{` for a literal brace")
            }
            Self::UnmatchedClose => {
                f.write_str("unmatched `}` in key template; write `}}` for a literal brace")
            }
            Self::EmptyPlaceholder => f.write_str(
                "empty placeholder `{}` in key template; name a field, as in `{order_id}`",
            ),
            Self::Adjacent(first, second) => write!(
                f,
                "placeholders `{{{first}}}` and `{{{second}}}` need literal text between them \
                 (as in `{{{first}}}:{{{second}}}`): without it the key is ambiguous",
            ),
            Self::NestedOpen(inner) => write!(
                f,
                "`{{` inside the placeholder `{{{inner}` in key template; \
                 write `{{{{` outside placeholders for a literal brace",
            ),
        }
    }
}

/// Splits `template` into literal text and placeholders.
pub(crate) fn parse(template: &str) -> Result<Vec<Piece>, TemplateError> {
    let mut pieces = Vec::new();
    let mut lit = String::new();
    let mut chars = template.chars().peekable();
    while let Some(c) = chars.next() {
        match c {
            '{' if chars.peek() == Some(&'{') => {
                chars.next();
                lit.push('{');
            }
            '}' if chars.peek() == Some(&'}') => {
                chars.next();
                lit.push('}');
            }
            '}' => return Err(TemplateError::UnmatchedClose),
            '{' => {
                let mut name = String::new();
                loop {
                    match chars.next() {
                        None => return Err(TemplateError::Unclosed),
                        Some('}') => break,
                        Some('{') => return Err(TemplateError::NestedOpen(name)),
                        Some(c) => name.push(c),
                    }
                }
                if name.is_empty() {
                    return Err(TemplateError::EmptyPlaceholder);
                }
                if !lit.is_empty() {
                    pieces.push(Piece::Lit(std::mem::take(&mut lit)));
                } else if let Some(Piece::Field(previous)) = pieces.last() {
                    return Err(TemplateError::Adjacent(previous.clone(), name));
                }
                pieces.push(Piece::Field(name));
            }
            c => lit.push(c),
        }
    }
    if !lit.is_empty() {
        pieces.push(Piece::Lit(lit));
    }
    Ok(pieces)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lit(s: &str) -> Piece {
        Piece::Lit(s.to_owned())
    }

    fn field(s: &str) -> Piece {
        Piece::Field(s.to_owned())
    }

    #[test]
    fn splits_literals_and_fields() {
        assert_eq!(
            parse("payment:{payment_id}:{seq}").unwrap(),
            [lit("payment:"), field("payment_id"), lit(":"), field("seq")]
        );
        assert_eq!(
            parse("{a}/{b}").unwrap(),
            [field("a"), lit("/"), field("b")]
        );
        assert_eq!(parse("{a}-").unwrap(), [field("a"), lit("-")]);
        assert_eq!(parse("plain").unwrap(), [lit("plain")]);
        assert_eq!(parse("").unwrap(), []);
    }

    #[test]
    fn resolves_escapes() {
        assert_eq!(
            parse("{{literal}}:{id}").unwrap(),
            [lit("{literal}:"), field("id")]
        );
        assert_eq!(
            parse("{{{id}}}").unwrap(),
            [lit("{"), field("id"), lit("}")]
        );
        assert_eq!(parse("{{}}").unwrap(), [lit("{}")]);
    }

    #[test]
    fn keeps_placeholder_text_verbatim() {
        assert_eq!(parse("{ id }").unwrap(), [field(" id ")]);
        assert_eq!(parse("{id:?}").unwrap(), [field("id:?")]);
        assert_eq!(parse("{r#type}").unwrap(), [field("r#type")]);
    }

    #[test]
    fn rejects_malformed_templates() {
        assert_eq!(parse("a{id"), Err(TemplateError::Unclosed));
        assert_eq!(parse("{"), Err(TemplateError::Unclosed));
        assert_eq!(parse("a}b"), Err(TemplateError::UnmatchedClose));
        assert_eq!(parse("{id}}"), Err(TemplateError::UnmatchedClose));
        assert_eq!(parse("x{}"), Err(TemplateError::EmptyPlaceholder));
        assert_eq!(parse("{a{b}"), Err(TemplateError::NestedOpen("a".into())));
        assert_eq!(
            parse("k:{a}{b}"),
            Err(TemplateError::Adjacent("a".into(), "b".into()))
        );
        assert_eq!(
            TemplateError::Adjacent("a".into(), "b".into()).to_string(),
            "placeholders `{a}` and `{b}` need literal text between them (as in `{a}:{b}`): \
             without it the key is ambiguous"
        );
    }

    #[test]
    fn error_messages_show_braces() {
        assert_eq!(
            TemplateError::NestedOpen("a".into()).to_string(),
            "`{` inside the placeholder `{a` in key template; \
             write `{{` outside placeholders for a literal brace"
        );
        assert_eq!(
            TemplateError::Unclosed.to_string(),
            "unclosed `{` in key template; write `{{` for a literal brace"
        );
    }
}
