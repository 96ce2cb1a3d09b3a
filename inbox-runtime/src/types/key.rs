//! Idempotency keys: extraction from message fields, validation, limits.

use std::borrow::Cow;
use std::fmt;
use std::sync::Arc;

/// The longest idempotency key accepted, in bytes of UTF-8.
///
/// Keys are stored verbatim in the inbox primary key and compared byte for byte. A longer key is
/// rejected with [`KeyError::TooLong`]; it is never truncated (two long keys sharing a prefix
/// would then collide) and never hashed silently.
pub const MAX_KEY_BYTES: usize = 512;

/// A validated idempotency key: not empty, not only whitespace, at most [`MAX_KEY_BYTES`] bytes,
/// no NUL byte.
///
/// The key names the *intent* of a message (a producer's event id, a command id, a business key
/// such as `payment:42`), never a delivery (a broker offset or delivery tag changes on every
/// redelivery and would defeat deduplication). Keys compare byte-exactly: no case folding, no
/// Unicode normalisation, no trimming (`" a"` and `"a"` are two keys). A key made only of
/// whitespace is refused like an empty one: it is what a blank field looks like, never a
/// producer's id.
#[derive(Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct IdempotencyKey(String);

impl IdempotencyKey {
    /// Validates `value` as the key of `message`, read from `field` (used in errors only).
    ///
    /// # Errors
    /// [`KeyError::Empty`] for `""`, [`KeyError::Blank`] for a key of whitespace only (as
    /// [`char::is_whitespace`] says: spaces, tabs, line breaks, no-break and other Unicode
    /// spaces), [`KeyError::TooLong`] above [`MAX_KEY_BYTES`] bytes, [`KeyError::Invalid`] if it
    /// contains a NUL byte (PostgreSQL `text` cannot store one).
    pub fn new(
        value: impl Into<String>,
        message: &'static str,
        field: &'static str,
    ) -> Result<Self, KeyError> {
        let value = value.into();
        if value.is_empty() {
            return Err(KeyError::Empty { message, field });
        }
        if value.chars().all(char::is_whitespace) {
            return Err(KeyError::Blank { message, field });
        }
        if value.len() > MAX_KEY_BYTES {
            return Err(KeyError::TooLong {
                message,
                field,
                len: value.len(),
                max: MAX_KEY_BYTES,
            });
        }
        if value.contains('\0') {
            return Err(KeyError::Invalid {
                message,
                field,
                reason: "contains a NUL byte",
            });
        }
        Ok(Self(value))
    }

    /// The key as stored in the inbox.
    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// Consumes the key, returning its text.
    pub fn into_string(self) -> String {
        self.0
    }
}

impl fmt::Debug for IdempotencyKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(&self.0, f)
    }
}

impl fmt::Display for IdempotencyKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl AsRef<str> for IdempotencyKey {
    fn as_ref(&self) -> &str {
        &self.0
    }
}

/// Why a message has no usable idempotency key. Nothing is written when this is returned.
///
/// `message` is the message's routing name ([`crate::Message::NAME`]); `field` is the field (or
/// the key template) the key was read from.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum KeyError {
    /// The key field (or a field named in the key template) is null: its [`KeyPart`] says so,
    /// as `None` of an `Option` field does (a `null` or missing member decodes to `None`).
    ///
    /// A key field of a type that is *not* an `Option` cannot be null here: a payload whose
    /// key member is missing or `null` does not decode as the message at all, and the
    /// dispatcher refuses it as a malformed payload
    /// ([`DispatchError::Decode`](crate::DispatchError::Decode), serde's `missing field` or
    /// `invalid type: null` in its text), before any key is read.
    #[error("message `{message}`: idempotency key field `{field}` is null")]
    Null {
        /// Routing name of the message.
        message: &'static str,
        /// Field or template the key comes from.
        field: &'static str,
    },
    /// The key (or one field of a key template) is the empty string.
    #[error("message `{message}`: idempotency key field `{field}` is empty")]
    Empty {
        /// Routing name of the message.
        message: &'static str,
        /// Field or template the key comes from.
        field: &'static str,
    },
    /// The key (or one field of a key template) is made of whitespace only (spaces, tabs, line
    /// breaks, Unicode spaces): refused like an empty key.
    #[error("message `{message}`: idempotency key field `{field}` is blank (whitespace only)")]
    Blank {
        /// Routing name of the message.
        message: &'static str,
        /// Field or template the key comes from.
        field: &'static str,
    },
    /// The key is longer than [`MAX_KEY_BYTES`].
    #[error(
        "message `{message}`: idempotency key from `{field}` is {len} bytes, more than the {max} an inbox key may hold"
    )]
    TooLong {
        /// Routing name of the message.
        message: &'static str,
        /// Field or template the key comes from.
        field: &'static str,
        /// Length of the rejected key, in bytes.
        len: usize,
        /// The limit, [`MAX_KEY_BYTES`].
        max: usize,
    },
    /// The key has a value no inbox can store.
    #[error("message `{message}`: idempotency key from `{field}` is invalid: {reason}")]
    Invalid {
        /// Routing name of the message.
        message: &'static str,
        /// Field or template the key comes from.
        field: &'static str,
        /// What is wrong with it.
        reason: &'static str,
    },
}

/// A value that can be (part of) an idempotency key.
///
/// Implemented for strings, integers, `char`, `bool`, [`uuid::Uuid`], and through `&T`, `Box<T>`,
/// `Arc<T>` and `Option<T>` (where `None` is a null key, an error). Implement it for your own
/// id newtypes; return `None` for a value that stands for "no key".
pub trait KeyPart {
    /// The key text of this value, or `None` if the value is null.
    fn key_part(&self) -> Option<Cow<'_, str>>;
}

impl KeyPart for str {
    fn key_part(&self) -> Option<Cow<'_, str>> {
        Some(Cow::Borrowed(self))
    }
}

impl KeyPart for String {
    fn key_part(&self) -> Option<Cow<'_, str>> {
        Some(Cow::Borrowed(self))
    }
}

impl KeyPart for Cow<'_, str> {
    fn key_part(&self) -> Option<Cow<'_, str>> {
        Some(Cow::Borrowed(self))
    }
}

impl<T: KeyPart + ?Sized> KeyPart for &T {
    fn key_part(&self) -> Option<Cow<'_, str>> {
        (**self).key_part()
    }
}

impl<T: KeyPart + ?Sized> KeyPart for Box<T> {
    fn key_part(&self) -> Option<Cow<'_, str>> {
        (**self).key_part()
    }
}

impl<T: KeyPart + ?Sized> KeyPart for Arc<T> {
    fn key_part(&self) -> Option<Cow<'_, str>> {
        (**self).key_part()
    }
}

impl<T: KeyPart> KeyPart for Option<T> {
    fn key_part(&self) -> Option<Cow<'_, str>> {
        self.as_ref().and_then(KeyPart::key_part)
    }
}

impl KeyPart for uuid::Uuid {
    fn key_part(&self) -> Option<Cow<'_, str>> {
        // Hyphenated lower case, the canonical RFC 9562 text form.
        Some(Cow::Owned(self.hyphenated().to_string()))
    }
}

macro_rules! display_key_part {
    ($($ty:ty),*) => {$(
        impl KeyPart for $ty {
            fn key_part(&self) -> Option<Cow<'_, str>> {
                Some(Cow::Owned(self.to_string()))
            }
        }
    )*};
}
display_key_part!(
    i8, i16, i32, i64, i128, isize, u8, u16, u32, u64, u128, usize, char, bool
);

/// One piece of a key template such as `"payment:{payment_id}"`.
#[derive(Clone, Copy)]
pub enum KeySegment<'a> {
    /// Literal text copied into the key.
    Lit(&'static str),
    /// A field's value: `(field name, value)`.
    Field(&'static str, &'a dyn KeyPart),
}

/// The key of `message` read from one field. Used by the derive and by `#[idempotent(key = ..)]`.
pub fn key_from_field(
    value: &dyn KeyPart,
    message: &'static str,
    field: &'static str,
) -> Result<IdempotencyKey, KeyError> {
    match value.key_part() {
        None => Err(KeyError::Null { message, field }),
        Some(text) => IdempotencyKey::new(text.into_owned(), message, field),
    }
}

/// The key of `message` built from a template: every field must be non-null, non-empty and not
/// only whitespace (a composite key with an empty or blank part would be shared by unrelated
/// messages).
///
/// Field values are escaped so that the key stays unambiguous: in each value, `%` and the first
/// character of the literal text that follows the field are written as `%XX` (the UTF-8 bytes in
/// upper-case hex, as in RFC 3986 percent-encoding), so the key splits back into its parts in
/// one way only. With `"{left}:{right}"`, `("a:b", "c")` gives `a%3Ab:c` and `("a", "b:c")`
/// gives `a:b:c`. Values without such characters are unchanged.
pub fn key_from_template(
    message: &'static str,
    template: &'static str,
    segments: &[KeySegment<'_>],
) -> Result<IdempotencyKey, KeyError> {
    let mut key = String::new();
    for (index, segment) in segments.iter().enumerate() {
        let separator = match segments.get(index + 1) {
            Some(KeySegment::Lit(text)) => text.chars().next(),
            _ => None,
        };
        let literal = |ch: char| ch == '%' || Some(ch) == separator;
        match *segment {
            KeySegment::Lit(text) => key.push_str(text),
            KeySegment::Field(field, value) => match value.key_part() {
                None => return Err(KeyError::Null { message, field }),
                Some(text) if text.is_empty() => return Err(KeyError::Empty { message, field }),
                Some(text) if text.chars().all(char::is_whitespace) => {
                    return Err(KeyError::Blank { message, field });
                }
                Some(text) => {
                    for ch in text.chars() {
                        if literal(ch) {
                            let mut bytes = [0_u8; 4];
                            for byte in ch.encode_utf8(&mut bytes).bytes() {
                                key.push_str(&format!("%{byte:02X}"));
                            }
                        } else {
                            key.push(ch);
                        }
                    }
                }
            },
        }
        if key.len() > MAX_KEY_BYTES {
            return Err(KeyError::TooLong {
                message,
                field: template,
                len: key.len(),
                max: MAX_KEY_BYTES,
            });
        }
    }
    IdempotencyKey::new(key, message, template)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The key of message `m` by the template `pay:{region}:{id}`.
    fn pay_region_id(region: &str, id: i64) -> Result<IdempotencyKey, KeyError> {
        key_from_template(
            "m",
            "pay:{region}:{id}",
            &[
                KeySegment::Lit("pay:"),
                KeySegment::Field("region", &region),
                KeySegment::Lit(":"),
                KeySegment::Field("id", &id),
            ],
        )
    }

    #[test]
    fn field_keys_are_validated() {
        assert_eq!(key_from_field(&"abc", "m", "f").unwrap().as_str(), "abc");
        assert_eq!(
            key_from_field(&None::<String>, "m", "f"),
            Err(KeyError::Null {
                message: "m",
                field: "f"
            })
        );
        assert_eq!(
            key_from_field(&"", "m", "f"),
            Err(KeyError::Empty {
                message: "m",
                field: "f"
            })
        );
        let long = "x".repeat(MAX_KEY_BYTES + 1);
        assert_eq!(
            key_from_field(&long, "m", "f"),
            Err(KeyError::TooLong {
                message: "m",
                field: "f",
                len: 513,
                max: 512
            })
        );
        assert!(key_from_field(&"x".repeat(MAX_KEY_BYTES), "m", "f").is_ok());
        assert!(matches!(
            key_from_field(&"a\0b", "m", "f"),
            Err(KeyError::Invalid { .. })
        ));
        assert_eq!(key_from_field(&42_u64, "m", "f").unwrap().as_str(), "42");
    }

    #[test]
    fn whitespace_only_keys_are_blank() {
        let error = KeyError::Blank {
            message: "m",
            field: "f",
        };
        let blank = Err(error.clone());
        for value in [
            " ", "   ", "\t", "\n", " \r\n ", "\u{a0}", "\u{2003}", "\u{3000}",
        ] {
            assert_eq!(key_from_field(&value, "m", "f"), blank, "{value:?}");
            assert_eq!(IdempotencyKey::new(value, "m", "f"), blank, "{value:?}");
        }
        assert_eq!(
            error.to_string(),
            "message `m`: idempotency key field `f` is blank (whitespace only)"
        );
        // Whitespace around other characters is part of the key, kept as it is.
        assert_eq!(key_from_field(&" a ", "m", "f").unwrap().as_str(), " a ");
        // A zero-width space is not whitespace (`char::is_whitespace`): a key, if a strange one.
        assert_eq!(
            key_from_field(&"\u{200b}", "m", "f").unwrap().as_str(),
            "\u{200b}"
        );
        // The empty key keeps its own error.
        assert_eq!(
            key_from_field(&"", "m", "f"),
            Err(KeyError::Empty {
                message: "m",
                field: "f"
            })
        );
    }

    #[test]
    fn template_keys_refuse_blank_parts() {
        let region = String::from(" ");
        let id = 7_i64;
        assert_eq!(
            pay_region_id(&region, id),
            Err(KeyError::Blank {
                message: "m",
                field: "region"
            })
        );
        // A template of one field: the whole key would be blank.
        let tab = String::from("\t");
        assert_eq!(
            key_from_template("m", "{id}", &[KeySegment::Field("id", &tab)]),
            Err(KeyError::Blank {
                message: "m",
                field: "id"
            })
        );
        // Literal text alone never makes a blank key (templates need a field), but a part with
        // whitespace around text is kept as it is.
        let padded = String::from(" eu ");
        assert_eq!(
            key_from_template(
                "m",
                "pay:{region}",
                &[
                    KeySegment::Lit("pay:"),
                    KeySegment::Field("region", &padded)
                ]
            )
            .unwrap()
            .as_str(),
            "pay: eu "
        );
    }

    #[test]
    fn template_keys_join_parts_and_reject_empty_parts() {
        let id = 7_i64;
        let region = String::from("eu");
        let key = pay_region_id(&region, id).unwrap();
        assert_eq!(key.as_str(), "pay:eu:7");
        let two = |left: &str, right: &str| {
            key_from_template(
                "m",
                "{left}:{right}",
                &[
                    KeySegment::Field("left", &left.to_owned()),
                    KeySegment::Lit(":"),
                    KeySegment::Field("right", &right.to_owned()),
                ],
            )
            .unwrap()
            .into_string()
        };
        assert_eq!(two("a:b", "c"), "a%3Ab:c");
        assert_eq!(two("a", "b:c"), "a:b:c");
        assert_eq!(two("50%", "x"), "50%25:x");
        let empty = String::new();
        assert_eq!(
            key_from_template(
                "m",
                "pay:{region}",
                &[KeySegment::Lit("pay:"), KeySegment::Field("region", &empty)]
            ),
            Err(KeyError::Empty {
                message: "m",
                field: "region"
            })
        );
    }
}
