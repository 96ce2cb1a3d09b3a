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
/// units and 64-bit ids do, and two of them must never share a fingerprint).
///
/// # Which payloads fingerprint the same
///
/// What counts is the value the message type decodes, not the bytes that arrived. Two payloads
/// that decode to equal values have the same fingerprint, whatever their member order,
/// whitespace or string escapes; members the type does not declare are dropped by the decode
/// and do not count; numbers count as the field's type reads them. In each row a message is
/// delivered with the first spelling, then again under the same key with the second; the
/// result is what the second delivery gets from the dispatcher (a duplicate when the
/// fingerprints are equal, a conflict when they differ, or a malformed payload refused before
/// any fingerprint is computed). The message type of the rows:
///
/// ```
/// # use serde::{Deserialize, Serialize};
/// #[derive(Clone, Serialize, Deserialize, inbox_runtime::Message)]
/// #[message(name = "fp.sample")]
/// struct Sample {
///     #[message(key)]
///     id: String,
///     int: i64,
///     float: f64,
///     value: serde_json::Value,
///     text: String,
///     opt: Option<String>,
///     #[serde(default)]
///     count: u32,
///     list: Vec<i64>,
///     uuid: uuid::Uuid,
/// }
/// ```
///
/// | what differs | first | second | result |
/// |---|---|---|---|
/// | member order | `{"id":…,"int":1,…}` | `{…,"int":1,"id":…}` | same: duplicate |
/// | whitespace between tokens | `{"id":"k","int":1,…}` | `{ "id" : "k" ,\n\t"int" : 1 , … }` | same: duplicate |
/// | `String`: an escape for a character | `"café"` | `"caf\u00e9"` | same: duplicate |
/// | `String`: escaped `/`, a surrogate pair | `"a/b 😀"` | `"a\/b \ud83d\ude00"` | same: duplicate |
/// | `String`: composed vs decomposed (no Unicode normalisation) | `"café"` | `"cafe\u0301"` | different: **conflict** |
/// | `i64`: another spelling of 1 | `1` | `1.0` | second is **malformed** |
/// | `i64`: an exponent | `1` | `1e0` | second is **malformed** |
/// | `i64`: minus zero (JSON parses `-0` as a float) | `0` | `-0` | second is **malformed** |
/// | `i64`: integers are exact, also above 2^53 | `9007199254740993` | `9007199254740992` | different: **conflict** |
/// | `f64`: an integer spelling | `1` | `1.0` | same: duplicate |
/// | `f64`: an exponent | `1` | `1e0` | same: duplicate |
/// | `f64`: digits beyond a double's precision | `0.1` | `0.10000000000000001` | same: duplicate |
/// | `f64`: integers above 2^53 round to the same double | `9007199254740993` | `9007199254740992` | same: duplicate |
/// | `f64`: minus zero | `0` | `-0.0` | same: duplicate |
/// | `serde_json::Value`: an integer and a float of the same value | `1` | `1.0` | same: duplicate |
/// | `serde_json::Value`: an exponent | `100` | `1e2` | same: duplicate |
/// | `serde_json::Value`: a fraction makes a big integer a double | `9007199254740993` | `9007199254740993.0` | different: **conflict** |
/// | `serde_json::Value`: integers beyond 64 bits become doubles | `18446744073709551616` | `18446744073709551617` | same: duplicate |
/// | `serde_json::Value`: member order inside | `{"a":1,"b":2}` | `{"b":2,"a":1}` | same: duplicate |
/// | `serde_json::Value`: a repeated member (the last one counts) | `{"a":2}` | `{"a":1,"a":2}` | same: duplicate |
/// | `serde_json::Value`: `null` vs missing | `"value":null` | `(no member)` | second is **malformed** |
/// | `Vec<i64>`: element order | `[1,2]` | `[2,1]` | different: **conflict** |
/// | `Option<String>`: `null` vs missing | `"opt":null` | `(no member)` | same: duplicate |
/// | `Option<String>`: a value vs `null` | `"opt":"x"` | `"opt":null` | different: **conflict** |
/// | `#[serde(default)] u32`: the default vs missing | `"count":0` | `(no member)` | same: duplicate |
/// | `uuid::Uuid`: upper case, no hyphens | `"0190c0de-0000-7000-8000-00000000abcd"` | `"0190C0DE00007000800000000000ABCD"` | same: duplicate |
/// | a member the type does not declare | `(none)` | `"note":"hi"` | same: duplicate |
/// | an undeclared member's value | `"note":1` | `"note":2` | same: duplicate |
/// | a declared member twice | `"int":1` | `"int":1,"int":1` | second is **malformed** |
/// | any value changed | `"int":1` | `"int":2` | different: **conflict** |
///
/// The table is checked, row by row, by the workspace's `tests/fingerprints.rs` (through this
/// function and through the dispatcher on PostgreSQL and SQLite). The number rows hold for
/// serde_json as this crate builds it (`float_roundtrip` on: decimal numbers are parsed to the
/// nearest double); a build that enables serde_json's `arbitrary_precision` may differ.
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

    /// The fingerprint of a payload that is not JSON (an HTTP request body of another media
    /// type): SHA-256 over `name`, a newline, a `0xFF` byte, and `bytes` as they are.
    ///
    /// The `0xFF` byte never occurs in UTF-8 text, so no byte payload shares a fingerprint with
    /// a JSON one ([`Fingerprint::of`]) under the same name; two byte payloads share one only if
    /// they are equal byte for byte.
    ///
    /// ```
    /// use inbox_runtime::Fingerprint;
    /// let a = Fingerprint::of_bytes("POST /upload", b"<xml/>");
    /// assert_eq!(a, Fingerprint::of_bytes("POST /upload", b"<xml/>"));
    /// assert_ne!(a, Fingerprint::of_bytes("POST /upload", b"<xml />"));
    /// ```
    pub fn of_bytes(name: &str, bytes: &[u8]) -> Self {
        let mut hasher = Sha256::new();
        hasher.update(name.as_bytes());
        hasher.update(b"\n\xff");
        hasher.update(bytes);
        Self(hasher.finalize().into())
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

impl FingerprintError {
    /// The error of a message that cannot be serialized to JSON.
    #[cfg_attr(not(feature = "dynamodb"), allow(dead_code))]
    pub(crate) fn from_json(error: serde_json::Error) -> Self {
        Self(error)
    }
}

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
    fn byte_payloads_never_share_a_json_fingerprint() {
        let json = serde_json::json!({"a": 1});
        let canonical = br#"{"a":1}"#;
        assert_ne!(
            Fingerprint::of("m", &json).unwrap(),
            Fingerprint::of_bytes("m", canonical)
        );
        assert_ne!(
            Fingerprint::of_bytes("m", b""),
            Fingerprint::of_bytes("n", b"")
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
