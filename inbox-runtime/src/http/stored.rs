//! The stored form of a response: what the claim keeps as its result, and replays.
//!
//! ```text
//! "IKR1"                                  magic and format version
//! status                                  u16, big-endian
//! header count                            u16, big-endian
//! per header: name length (u16), name, value length (u32), value
//! body                                    the rest, byte for byte
//! ```

use bytes::Bytes;
use http::{HeaderMap, HeaderName, HeaderValue, StatusCode};

const MAGIC: &[u8; 4] = b"IKR1";

/// A response as stored with its idempotency key: status, the selected headers, the body.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct StoredResponse {
    pub(crate) status: StatusCode,
    pub(crate) headers: Vec<(HeaderName, HeaderValue)>,
    pub(crate) body: Bytes,
}

/// A stored result that is not a response of this format (a damaged row, or a result some other
/// claim session stored under the same scope).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("the stored response is damaged: {0}")]
pub(crate) struct Damaged(pub(crate) &'static str);

impl StoredResponse {
    /// The headers of `all` named in `selected`, in `all`'s order (every value of a repeated
    /// header).
    pub(crate) fn select(
        status: StatusCode,
        all: &HeaderMap,
        selected: &[HeaderName],
        body: Bytes,
    ) -> Self {
        let headers = all
            .iter()
            .filter(|(name, _)| selected.contains(name))
            .map(|(name, value)| (name.clone(), value.clone()))
            .collect();
        Self {
            status,
            headers,
            body,
        }
    }

    pub(crate) fn encode(&self) -> Vec<u8> {
        let header_bytes: usize = self
            .headers
            .iter()
            .map(|(n, v)| 6 + n.as_str().len() + v.len())
            .sum();
        let mut out = Vec::with_capacity(8 + header_bytes + self.body.len());
        out.extend_from_slice(MAGIC);
        out.extend_from_slice(&self.status.as_u16().to_be_bytes());
        // At most 100 header fields reach a server (hyper's limit), far below u16::MAX; names
        // are short tokens and values far below 4 GiB.
        out.extend_from_slice(&(self.headers.len() as u16).to_be_bytes());
        for (name, value) in &self.headers {
            out.extend_from_slice(&(name.as_str().len() as u16).to_be_bytes());
            out.extend_from_slice(name.as_str().as_bytes());
            out.extend_from_slice(&(value.len() as u32).to_be_bytes());
            out.extend_from_slice(value.as_bytes());
        }
        out.extend_from_slice(&self.body);
        out
    }

    pub(crate) fn decode(stored: &[u8]) -> Result<Self, Damaged> {
        let mut reader = Reader(stored);
        if reader.take(4)? != MAGIC {
            return Err(Damaged("unknown format"));
        }
        let status = StatusCode::from_u16(reader.u16()?).map_err(|_| Damaged("bad status"))?;
        let count = reader.u16()?;
        let mut headers = Vec::with_capacity(usize::from(count));
        for _ in 0..count {
            let len = usize::from(reader.u16()?);
            let name = HeaderName::from_bytes(reader.take(len)?)
                .map_err(|_| Damaged("bad header name"))?;
            let len = reader.u32()? as usize;
            let value = HeaderValue::from_bytes(reader.take(len)?)
                .map_err(|_| Damaged("bad header value"))?;
            headers.push((name, value));
        }
        Ok(Self {
            status,
            headers,
            body: Bytes::copy_from_slice(reader.0),
        })
    }
}

struct Reader<'a>(&'a [u8]);

impl<'a> Reader<'a> {
    fn take(&mut self, len: usize) -> Result<&'a [u8], Damaged> {
        if self.0.len() < len {
            return Err(Damaged("truncated"));
        }
        let (head, rest) = self.0.split_at(len);
        self.0 = rest;
        Ok(head)
    }

    fn u16(&mut self) -> Result<u16, Damaged> {
        let bytes = self.take(2)?;
        Ok(u16::from_be_bytes([bytes[0], bytes[1]]))
    }

    fn u32(&mut self) -> Result<u32, Damaged> {
        let bytes = self.take(4)?;
        Ok(u32::from_be_bytes([bytes[0], bytes[1], bytes[2], bytes[3]]))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trips_status_headers_and_body_byte_for_byte() {
        let mut all = HeaderMap::new();
        all.insert("content-type", HeaderValue::from_static("application/json"));
        all.append("link", HeaderValue::from_static("</a>; rel=a"));
        all.append("link", HeaderValue::from_static("</b>; rel=b"));
        all.insert("set-cookie", HeaderValue::from_static("secret=1"));
        let body = Bytes::from_static(b"{\"id\":1}\n\x00\xff");
        let selected = [http::header::CONTENT_TYPE, http::header::LINK];
        let stored = StoredResponse::select(StatusCode::CREATED, &all, &selected, body.clone());
        assert_eq!(stored.headers.len(), 3, "both links, no cookie");
        let decoded = StoredResponse::decode(&stored.encode()).unwrap();
        assert_eq!(decoded, stored);
        assert_eq!(decoded.body, body);
    }

    #[test]
    fn damaged_results_are_reported() {
        let damaged: [(&[u8], &str); 4] = [
            (b"{\"status\":201}", "unknown format"),
            (b"IKR1\x00", "truncated"),
            (b"IKR1\x03\xe8\x00\x00", "bad status"),
            (b"IKR1\x00\xc8\x00\x01\x00\x09", "truncated"),
        ];
        for (bytes, reason) in damaged {
            assert_eq!(
                StoredResponse::decode(bytes),
                Err(Damaged(reason)),
                "{bytes:?}"
            );
        }
    }
}
