//! One Unicode rule for JSON payloads: the text must be Unicode, whether it arrives as raw bytes
//! or as escapes. Raw bytes must be UTF-8; a `\uXXXX` escape must not decode to an unpaired
//! surrogate (`\ud800`–`\udfff` outside a high-low pair), which no Unicode text can hold.
//!
//! serde_json refuses both where it decodes a string into a Rust `String`, but skips the
//! members a message type does not declare (and `RawValue`s) without decoding them; so the
//! rule is checked here, once, over the whole payload, wherever the text sits: key, declared
//! and undeclared members, member names, nested arrays and objects.

/// Why a payload is not Unicode text, and where: 1-based line and column (in bytes).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct TextError {
    pub(crate) line: usize,
    pub(crate) column: usize,
    pub(crate) kind: NotText,
}

/// What is wrong with the text.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum NotText {
    /// Bytes that are not UTF-8 start at the position.
    NotUtf8,
    /// An escape that decodes to an unpaired surrogate starts at the position: its six
    /// characters as written (`\ud800`, `\uDFFF`, …).
    UnpairedSurrogate(String),
}

impl std::fmt::Display for TextError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "line {}, column {}: ", self.line, self.column)?;
        match &self.kind {
            NotText::NotUtf8 => f.write_str("invalid UTF-8"),
            NotText::UnpairedSurrogate(escape) => {
                write!(
                    f,
                    "invalid Unicode: the escape `{escape}` is an unpaired surrogate"
                )
            }
        }
    }
}

/// `bytes` as text, if it is UTF-8 and no JSON escape in it decodes to an unpaired surrogate.
///
/// Escapes are found by their backslash: in JSON a backslash can only start an escape inside a
/// string (anywhere else the payload is not JSON, which its decoding reports), and an escaped
/// backslash (`\\`) is skipped whole, so `"\\ud800"` (a backslash, then the letters `ud800`)
/// is text.
pub(crate) fn json_text(bytes: &[u8]) -> Result<&str, TextError> {
    // Whichever comes first is reported: an escape in the valid prefix, or the invalid bytes.
    let (valid, not_utf8) = match std::str::from_utf8(bytes) {
        Ok(_) => (bytes.len(), false),
        Err(error) => (error.valid_up_to(), true),
    };
    let prefix = &bytes[..valid];
    if let Some((start, escape)) = unpaired_surrogate(prefix) {
        let (line, column) = position(&prefix[..start]);
        return Err(TextError {
            line,
            column,
            kind: NotText::UnpairedSurrogate(escape),
        });
    }
    if not_utf8 {
        let (line, column) = position(prefix);
        return Err(TextError {
            line,
            column,
            kind: NotText::NotUtf8,
        });
    }
    Ok(std::str::from_utf8(prefix).expect("checked above"))
}

/// The byte offset and text of the first escape in `bytes` that decodes to an unpaired
/// surrogate.
fn unpaired_surrogate(bytes: &[u8]) -> Option<(usize, String)> {
    let mut at = 0;
    while let Some(found) = bytes
        .get(at..)
        .and_then(|rest| rest.iter().position(|&b| b == b'\\'))
    {
        let start = at + found;
        at = start + 2; // the backslash and the escaped character
        if bytes.get(start + 1) != Some(&b'u') {
            continue;
        }
        let Some(unit) = hex4(bytes, start + 2) else {
            continue; // not an escape: the decoder reports it
        };
        at = start + 6;
        let paired = match unit {
            0xD800..=0xDBFF => {
                let low = (bytes.get(start + 6..start + 8) == Some(b"\\u"))
                    .then(|| hex4(bytes, start + 8))
                    .flatten();
                if low.is_some_and(|low| (0xDC00..=0xDFFF).contains(&low)) {
                    at = start + 12;
                    true
                } else {
                    false
                }
            }
            0xDC00..=0xDFFF => false,
            _ => true,
        };
        if !paired {
            // Six ASCII characters: a backslash, `u` and four hex digits.
            let escape = bytes[start..start + 6]
                .iter()
                .map(|&b| char::from(b))
                .collect();
            return Some((start, escape));
        }
    }
    None
}

/// The four hex digits at `at`, as a number.
fn hex4(bytes: &[u8], at: usize) -> Option<u16> {
    let digits = bytes.get(at..at + 4)?;
    digits.iter().try_fold(0_u16, |value, &digit| {
        let nibble = char::from(digit).to_digit(16)?;
        Some(value << 4 | u16::try_from(nibble).ok()?)
    })
}

/// The 1-based line and column (in bytes) just after `before`.
pub(crate) fn position(before: &[u8]) -> (usize, usize) {
    let line = 1 + before.iter().filter(|&&b| b == b'\n').count();
    let column = 1 + before.iter().rev().take_while(|&&b| b != b'\n').count();
    (line, column)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn surrogate(text: &str) -> Option<(usize, usize, String)> {
        match json_text(text.as_bytes()) {
            Ok(_) => None,
            Err(TextError {
                line,
                column,
                kind: NotText::UnpairedSurrogate(escape),
            }) => Some((line, column, escape)),
            Err(other) => panic!("{other}"),
        }
    }

    #[test]
    fn unpaired_surrogates_are_found_wherever_they_are() {
        let at = |column: usize, escape: &str| Some((1, column, escape.to_owned()));
        assert_eq!(surrogate(r#"{"a":"\ud800"}"#), at(7, r"\ud800"));
        assert_eq!(surrogate(r#"{"a":"\uDFFF"}"#), at(7, r"\uDFFF"));
        assert_eq!(surrogate(r#"{"a":"x\uDbFf\u0041"}"#), at(8, r"\uDbFf"));
        assert_eq!(surrogate(r#"{"a":"\udc00\ud800"}"#), at(7, r"\udc00"));
        assert_eq!(surrogate(r#"{"a":"\ud83d\ud83d\ude00"}"#), at(7, r"\ud83d"));
        assert_eq!(surrogate(r#"{"a":"\ud800"#), at(7, r"\ud800"));
        assert_eq!(surrogate(r#"{"\ud800":1}"#), at(3, r"\ud800"));
        assert_eq!(surrogate(r#"[1,["\\\udfff"]]"#), at(8, r"\udfff"));
        assert_eq!(
            surrogate("{\n  \"a\": [\n    \"ok\", \"\\uD800!\"]}"),
            Some((3, 12, r"\uD800".to_owned()))
        );
        // Text: pairs, other escapes, an escaped backslash before `u`, a bad hex escape (the
        // decoder's to report), a backslash at the very end.
        assert_eq!(surrogate(r#"{"a":"\ud83d\ude00 \uD83D\uDE00"}"#), None);
        assert_eq!(surrogate(r#"{"a":"\u00e9\n\"\/\\"}"#), None);
        assert_eq!(surrogate(r#"{"a":"\\ud800"}"#), None);
        assert_eq!(surrogate(r#"{"a":"\\\\ud800"}"#), None);
        assert_eq!(surrogate(r#"{"a":"\uZZZZ"}"#), None);
        assert_eq!(surrogate(r#"{"a":"\u12"}"#), None);
        assert_eq!(surrogate("\\"), None);
    }

    #[test]
    fn the_first_of_bytes_and_escapes_is_reported() {
        let error = json_text(b"{\"a\":\"\xff\\ud800\"}").unwrap_err();
        assert_eq!((error.line, error.column), (1, 7));
        assert_eq!(error.kind, NotText::NotUtf8);
        let error = json_text(b"{\"a\":\"\\ud800\xff\"}").unwrap_err();
        assert_eq!((error.line, error.column), (1, 7));
        assert_eq!(error.kind, NotText::UnpairedSurrogate(r"\ud800".to_owned()));
        // An escape cut by the invalid bytes: the bytes are reported.
        let error = json_text(b"{\"a\":\"\\ud8\xff\"}").unwrap_err();
        assert_eq!((error.line, error.column), (1, 11));
        assert_eq!(error.kind, NotText::NotUtf8);
        assert_eq!(error.to_string(), "line 1, column 11: invalid UTF-8");
        let error = json_text(br#"{"a":"\ud800"}"#).unwrap_err();
        assert_eq!(
            error.to_string(),
            r"line 1, column 7: invalid Unicode: the escape `\ud800` is an unpaired surrogate"
        );
    }
}
