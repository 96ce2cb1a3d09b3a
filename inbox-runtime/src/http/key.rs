//! The `Idempotency-Key` request header: an RFC 9651 Item whose bare item is a String.

use std::borrow::Cow;

use http::HeaderMap;
use sfv::visitor::{Ignored, ParameterVisitor, parameter_visitor_with};
use sfv::{BareItemFromInput, StringRef};

/// The header's name, as the draft registers it (field names are case-insensitive).
pub(crate) const IDEMPOTENCY_KEY: &str = "idempotency-key";

/// Why a request's `Idempotency-Key` was refused (every case is a 400).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum KeyProblem {
    /// No header, and the key is required.
    Missing,
    /// More than one `Idempotency-Key` field line.
    Repeated,
    /// Not an sf-string (a token, a number, non-ASCII bytes, a missing quote…): the parser's
    /// text.
    Malformed(String),
    /// `""`, or whitespace only.
    Empty,
    /// Longer than the limit (characters; all are ASCII, so bytes too).
    TooLong { len: usize, max: usize },
}

impl KeyProblem {
    /// The problem's type slug, title and detail.
    pub(crate) fn describe(&self) -> (&'static str, &'static str, String) {
        match self {
            KeyProblem::Missing => (
                "idempotency-key-missing",
                "Idempotency-Key is missing",
                "this operation requires an Idempotency-Key header: a unique string (a UUID, \
                 say) sent as an sf-string, e.g. Idempotency-Key: \"8e03978e-40d5-43e8-bc93-6894a57f9324\", \
                 and the same key again on every retry of the request"
                    .into(),
            ),
            KeyProblem::Repeated => (
                "idempotency-key-malformed",
                "Idempotency-Key is malformed",
                "the request has more than one Idempotency-Key field; send exactly one".into(),
            ),
            KeyProblem::Malformed(reason) => (
                "idempotency-key-malformed",
                "Idempotency-Key is malformed",
                format!(
                    "the Idempotency-Key must be a structured-field string (RFC 9651, section \
                     3.3.3): printable ASCII in double quotes, e.g. \"8e03978e-40d5-43e8-bc93-6894a57f9324\" \
                     ({reason})"
                ),
            ),
            KeyProblem::Empty => (
                "idempotency-key-malformed",
                "Idempotency-Key is empty",
                "the Idempotency-Key is empty or whitespace only; send a unique string".into(),
            ),
            KeyProblem::TooLong { len, max } => (
                "idempotency-key-too-long",
                "Idempotency-Key is too long",
                format!("the Idempotency-Key is {len} characters long; at most {max} are accepted"),
            ),
        }
    }
}

/// The key of `headers`, `None` if there is no `Idempotency-Key` field.
///
/// `unquoted`: also accept a value that is not an sf-string but consists of visible ASCII only
/// (`%x21-7E`, no spaces), taken verbatim — what clients written for Stripe-style APIs send.
pub(crate) fn parse(
    headers: &HeaderMap,
    max_chars: usize,
    unquoted: bool,
) -> Result<Option<String>, KeyProblem> {
    let mut values = headers.get_all(IDEMPOTENCY_KEY).iter();
    let Some(value) = values.next() else {
        return Ok(None);
    };
    if values.next().is_some() {
        return Err(KeyProblem::Repeated);
    }
    let bytes = value.as_bytes();
    let key = match sfv::Parser::new(bytes).parse_item_with_visitor(as_string) {
        Ok(key) => key.as_str().to_owned(),
        Err(error) => {
            let trimmed = value.as_bytes().trim_ascii();
            if unquoted
                && !trimmed.is_empty()
                && trimmed.first() != Some(&b'"')
                && trimmed.iter().all(|b| (0x21..=0x7e).contains(b))
            {
                // Visible ASCII only: valid UTF-8.
                String::from_utf8_lossy(trimmed).into_owned()
            } else {
                return Err(KeyProblem::Malformed(error.to_string()));
            }
        }
    };
    if key.trim().is_empty() {
        return Err(KeyProblem::Empty);
    }
    if key.len() > max_chars {
        return Err(KeyProblem::TooLong {
            len: key.len(),
            max: max_chars,
        });
    }
    Ok(Some(key))
}

/// An item visitor that accepts a String (ignoring parameters, as RFC 9651 lets a recipient
/// ignore unknown ones) and refuses every other bare item.
fn as_string<'de>(
    bare_item: BareItemFromInput<'de>,
) -> Result<impl ParameterVisitor<'de, Out = Cow<'de, StringRef>>, NotAString> {
    match bare_item {
        BareItemFromInput::String(text) => Ok(parameter_visitor_with(Ignored, move |_| Ok(text))),
        BareItemFromInput::Token(_) => Err(NotAString("a token, not a quoted string")),
        BareItemFromInput::Integer(_) | BareItemFromInput::Decimal(_) => {
            Err(NotAString("a number, not a quoted string"))
        }
        _ => Err(NotAString("not a quoted string")),
    }
}

#[derive(Debug, thiserror::Error)]
#[error("{0}")]
struct NotAString(&'static str);

#[cfg(test)]
mod tests {
    use super::*;
    use http::HeaderValue;

    fn key(raw: &[u8]) -> Result<Option<String>, KeyProblem> {
        let mut headers = HeaderMap::new();
        headers.insert(IDEMPOTENCY_KEY, HeaderValue::from_bytes(raw).unwrap());
        parse(&headers, 255, false)
    }

    #[test]
    fn sf_strings_are_keys() {
        assert_eq!(key(br#""abc""#), Ok(Some("abc".into())));
        assert_eq!(key(br#"  "a b""#), Ok(Some("a b".into())));
        assert_eq!(key(br#""q\"uote\\d""#), Ok(Some(r#"q"uote\d"#.into())));
        assert_eq!(key(br#""abc";v=1"#), Ok(Some("abc".into())));
        assert_eq!(parse(&HeaderMap::new(), 255, false), Ok(None));
    }

    #[test]
    fn everything_else_is_refused() {
        for raw in [
            &b"abc"[..],
            b"42",
            b"\"unterminated",
            b"\"caf\xc3\xa9\"",
            b"\"tab\there\"",
            b"\"a\" \"b\"",
            b"\"a\", \"b\"",
            b":YWJj:",
            b"?1",
        ] {
            assert!(
                matches!(key(raw), Err(KeyProblem::Malformed(_))),
                "{:?}: {:?}",
                String::from_utf8_lossy(raw),
                key(raw)
            );
        }
        assert_eq!(key(br#""""#), Err(KeyProblem::Empty));
        assert_eq!(key(br#""   ""#), Err(KeyProblem::Empty));
        let long = format!("\"{}\"", "k".repeat(256));
        assert_eq!(
            key(long.as_bytes()),
            Err(KeyProblem::TooLong { len: 256, max: 255 })
        );
        let mut headers = HeaderMap::new();
        headers.append(IDEMPOTENCY_KEY, HeaderValue::from_static("\"a\""));
        headers.append(IDEMPOTENCY_KEY, HeaderValue::from_static("\"a\""));
        assert_eq!(parse(&headers, 255, false), Err(KeyProblem::Repeated));
    }

    #[test]
    fn unquoted_keys_when_allowed() {
        let mut headers = HeaderMap::new();
        headers.insert(
            IDEMPOTENCY_KEY,
            HeaderValue::from_static("KG5LxwFBepaKHyUD"),
        );
        assert_eq!(
            parse(&headers, 255, true),
            Ok(Some("KG5LxwFBepaKHyUD".into()))
        );
        assert!(matches!(
            parse(&headers, 255, false),
            Err(KeyProblem::Malformed(_))
        ));
        // Quoted keys are still parsed as sf-strings; broken quoting is not taken verbatim.
        headers.insert(IDEMPOTENCY_KEY, HeaderValue::from_static("\"abc"));
        assert!(matches!(
            parse(&headers, 255, true),
            Err(KeyProblem::Malformed(_))
        ));
        headers.insert(
            IDEMPOTENCY_KEY,
            HeaderValue::from_bytes(b"caf\xc3\xa9").unwrap(),
        );
        assert!(matches!(
            parse(&headers, 255, true),
            Err(KeyProblem::Malformed(_))
        ));
    }
}
