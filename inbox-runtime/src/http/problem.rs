//! Problem details (RFC 9457) for the layer's own answers.

use std::time::Duration;

use axum::body::Body;
use http::{HeaderValue, Response, StatusCode, header};

/// The media type of problem details in JSON (RFC 9457, section 3).
pub(crate) const PROBLEM_JSON: &str = "application/problem+json";

/// One of the layer's answers: `type` (the base URI joined with `slug`), `title`, `status`,
/// `detail`, and an optional `Retry-After` in seconds.
#[derive(Debug, Clone)]
pub(crate) struct Problem {
    pub(crate) status: StatusCode,
    pub(crate) slug: &'static str,
    pub(crate) title: &'static str,
    pub(crate) detail: String,
    pub(crate) retry_after: Option<Duration>,
}

impl Problem {
    pub(crate) fn new(
        status: StatusCode,
        slug: &'static str,
        title: &'static str,
        detail: impl Into<String>,
    ) -> Self {
        Self {
            status,
            slug,
            title,
            detail: detail.into(),
            retry_after: None,
        }
    }

    pub(crate) fn retry_after(mut self, after: Duration) -> Self {
        self.retry_after = Some(after);
        self
    }

    /// The response: `application/problem+json`, never cached (`Cache-Control: no-store`), with
    /// `Retry-After` in whole seconds (rounded up, at least 1) when set.
    pub(crate) fn into_response(self, type_base: &str) -> Response<Body> {
        let body = serde_json::json!({
            "type": format!("{type_base}{}", self.slug),
            "title": self.title,
            "status": self.status.as_u16(),
            "detail": self.detail,
        });
        let mut response = Response::new(Body::from(body.to_string()));
        *response.status_mut() = self.status;
        let headers = response.headers_mut();
        headers.insert(header::CONTENT_TYPE, HeaderValue::from_static(PROBLEM_JSON));
        headers.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
        if let Some(after) = self.retry_after {
            headers.insert(
                header::RETRY_AFTER,
                HeaderValue::from(retry_after_secs(after)),
            );
        }
        response
    }
}

/// `Retry-After` delay-seconds (RFC 9110, section 10.2.3): whole seconds, rounded up, at least 1.
pub(crate) fn retry_after_secs(after: Duration) -> u64 {
    let secs = after
        .as_secs()
        .saturating_add(u64::from(after.subsec_nanos() > 0));
    secs.max(1)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn retry_after_rounds_up_to_whole_seconds() {
        assert_eq!(retry_after_secs(Duration::ZERO), 1);
        assert_eq!(retry_after_secs(Duration::from_millis(10)), 1);
        assert_eq!(retry_after_secs(Duration::from_secs(2)), 2);
        assert_eq!(retry_after_secs(Duration::from_millis(2001)), 3);
    }
}
