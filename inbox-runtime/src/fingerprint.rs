//! Payload fingerprints: SHA-256 over the message name and the canonical JSON form of a message
//! (RFC 8785, with integers written exactly).

use std::fmt;

use serde::Serialize;
use sha2::{Digest, Sha256};

/// The fingerprint of a message: SHA-256 over its routing name, a newline, and the canonical
/// JSON form of its payload.
///
/// The name is part of it so that two message types of the same shape (a capture and a refund
/// with the same fields) under one key are a conflict, not a duplicate.
///
/// The canonical form is the JSON Canonicalization Scheme (RFC 8785) applied to the *decoded*
/// message re-serialized with serde: object members sorted by their UTF-16 code units, no
/// insignificant whitespace, strings and non-integer numbers in RFC 8785's normal form — with one
/// deliberate difference: integers are written exactly, in decimal, rather than through an IEEE
/// double (RFC 8785 targets I-JSON, where integers above 2^53 do not exist; amounts in minor
/// units and 64-bit ids do, and two of them must never share a fingerprint). So the same event
/// redelivered with its fields reordered, its whitespace changed or its numbers spelled another
/// way (`1` for `1.0`, `1e2` for `100`) has the same fingerprint, while any change of a value
/// changes it. Fields the message type does not declare are not part of the message and do not
/// count.
///
/// Stored in the inbox as 64 lower-case hex digits; shown the same way.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct Fingerprint([u8; 32]);

impl Fingerprint {
    /// Computes the fingerprint of `message` under the routing name `name` (what the inbox
    /// stores is `Fingerprint::of(M::NAME, &msg)`).
    ///
    /// # Errors
    /// [`FingerprintError`] if the message cannot be serialized to JSON (for example a map with
    /// non-string keys, or a `Serialize` impl that fails).
    pub fn of<M: Serialize + ?Sized>(name: &str, message: &M) -> Result<Self, FingerprintError> {
        let value = serde_json::to_value(message).map_err(FingerprintError)?;
        let mut canonical = Vec::with_capacity(256);
        write_canonical(&value, &mut canonical).map_err(FingerprintError)?;
        let mut hasher = Sha256::new();
        hasher.update(name.as_bytes());
        hasher.update(b"\n");
        hasher.update(&canonical);
        Ok(Self(hasher.finalize().into()))
    }

    /// Parses the 64-hex-digit form stored in the inbox.
    pub fn from_hex(hex_text: &str) -> Option<Self> {
        let mut bytes = [0_u8; 32];
        hex::decode_to_slice(hex_text, &mut bytes).ok()?;
        Some(Self(bytes))
    }

    /// The 64 lower-case hex digits of the digest.
    pub fn to_hex(&self) -> String {
        hex::encode(self.0)
    }

    /// The raw 32-byte SHA-256 digest.
    pub fn as_bytes(&self) -> &[u8; 32] {
        &self.0
    }
}

/// Writes `value` in canonical form (see [`Fingerprint`]).
fn write_canonical(value: &serde_json::Value, out: &mut Vec<u8>) -> Result<(), serde_json::Error> {
    use serde_json::Value;
    match value {
        Value::Null => out.extend_from_slice(b"null"),
        Value::Bool(true) => out.extend_from_slice(b"true"),
        Value::Bool(false) => out.extend_from_slice(b"false"),
        Value::Number(number) => {
            if let Some(int) = number.as_i64() {
                out.extend_from_slice(int.to_string().as_bytes());
            } else if let Some(int) = number.as_u64() {
                out.extend_from_slice(int.to_string().as_bytes());
            } else {
                // A float: RFC 8785's (ECMAScript's) shortest round-trip form.
                let float = number.as_f64().unwrap_or(f64::NAN);
                serde_jcs::to_writer(&mut *out, &float)?;
            }
        }
        Value::String(text) => serde_jcs::to_writer(&mut *out, text)?,
        Value::Array(items) => {
            out.push(b'[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push(b',');
                }
                write_canonical(item, out)?;
            }
            out.push(b']');
        }
        Value::Object(members) => {
            let mut members: Vec<(&String, &Value)> = members.iter().collect();
            members.sort_by(|(a, _), (b, _)| a.encode_utf16().cmp(b.encode_utf16()));
            out.push(b'{');
            for (i, (name, member)) in members.into_iter().enumerate() {
                if i > 0 {
                    out.push(b',');
                }
                serde_jcs::to_writer(&mut *out, name)?;
                out.push(b':');
                write_canonical(member, out)?;
            }
            out.push(b'}');
        }
    }
    Ok(())
}

impl fmt::Display for Fingerprint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.to_hex())
    }
}

impl fmt::Debug for Fingerprint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Fingerprint({})", self.to_hex())
    }
}

/// A message could not be serialized to its canonical JSON form.
#[derive(Debug, thiserror::Error)]
#[error("cannot compute the payload fingerprint: {0}")]
pub struct FingerprintError(#[source] serde_json::Error);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn field_order_and_whitespace_do_not_change_the_fingerprint() {
        let a: serde_json::Value =
            serde_json::from_str(r#"{"b": 1, "a": {"y": [1,2], "x": "s"}}"#).unwrap();
        let b: serde_json::Value =
            serde_json::from_str("{\"a\":{\"x\":\"s\",\n \"y\":[1, 2]},\"b\":1}").unwrap();
        assert_eq!(
            Fingerprint::of("m", &a).unwrap(),
            Fingerprint::of("m", &b).unwrap()
        );
        let c: serde_json::Value =
            serde_json::from_str(r#"{"a": {"x": "s", "y": [1,2]}, "b": 2}"#).unwrap();
        assert_ne!(
            Fingerprint::of("m", &a).unwrap(),
            Fingerprint::of("m", &c).unwrap()
        );
    }

    #[test]
    fn integers_are_exact_and_floats_canonical() {
        let canonical = |json: &str| {
            let value: serde_json::Value = serde_json::from_str(json).unwrap();
            let mut out = Vec::new();
            write_canonical(&value, &mut out).unwrap();
            String::from_utf8(out).unwrap()
        };
        assert_eq!(canonical("9007199254740993"), "9007199254740993");
        assert_eq!(canonical("18446744073709551615"), "18446744073709551615");
        assert_eq!(canonical("-9223372036854775808"), "-9223372036854775808");
        assert_eq!(canonical("1.0"), "1");
        assert_eq!(canonical("1e2"), "100");
        assert_eq!(canonical("0.1"), "0.1");
        assert_eq!(
            canonical(r#"{"b":[1,"\u00e9"],"a":null,"\u20ac":true,"\ud83d\ude00":false}"#),
            "{\"a\":null,\"b\":[1,\"é\"],\"€\":true,\"\u{1f600}\":false}"
                .replace("\\u{1f600}", "\u{1f600}")
        );
        assert_ne!(
            Fingerprint::of("m", &9_007_199_254_740_993_i64).unwrap(),
            Fingerprint::of("m", &9_007_199_254_740_992_i64).unwrap()
        );
    }

    #[test]
    fn the_message_name_is_part_of_the_fingerprint() {
        let payload = serde_json::json!({"id": 1});
        assert_ne!(
            Fingerprint::of("payments.captured", &payload).unwrap(),
            Fingerprint::of("payments.refunded", &payload).unwrap()
        );
    }

    #[test]
    fn hex_round_trips() {
        let fp = Fingerprint::of("m", &"x").unwrap();
        assert_eq!(fp.to_hex().len(), 64);
        assert_eq!(Fingerprint::from_hex(&fp.to_hex()), Some(fp));
        assert_eq!(Fingerprint::from_hex("zz"), None);
    }
}
