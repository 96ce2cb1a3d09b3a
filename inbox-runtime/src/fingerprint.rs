//! Payload fingerprints: SHA-256 over the RFC 8785 canonical JSON form of a message.

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
/// message re-serialized with serde: object members sorted, no insignificant whitespace, numbers
/// and strings in one normal form. So the same event redelivered with its fields reordered or its
/// whitespace changed has the same fingerprint, while any change of a value changes it. Fields
/// the message type does not declare are not part of the message and do not count.
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
        let canonical = serde_jcs::to_vec(message).map_err(FingerprintError)?;
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
