//! W3C Trace Context propagation (cargo feature `otel`): one trace from a request or a
//! delivery, through the handler and its outbox rows, across every broker, into the handlers
//! downstream.
//!
//! The context travels as the two headers of the [W3C Trace Context] recommendation,
//! [`TRACEPARENT`] (`00-<trace id: 32 hex>-<parent span id: 16 hex>-<flags: 2 hex>`) and
//! [`TRACESTATE`] (vendor entries, passed on as received). They are written and read by
//! OpenTelemetry's `TraceContextPropagator` (`opentelemetry_sdk::propagation`), never parsed by
//! this crate, on the `tracing` spans through `tracing-opentelemetry`: install its
//! `OpenTelemetryLayer` in your subscriber, or every span's context is empty and nothing is
//! propagated (the feature then costs one look-up per publish and per delivery).
//!
//! | hop | what happens |
//! | --- | --- |
//! | [`Outbox::publish`](crate::outbox::Outbox::publish) | the **current span**'s context is stored with the row, in the nullable column `inbox_outbox.trace_context` (a JSON object `{"traceparent": …, "tracestate": …}`; `NULL` without the feature or without a valid current span) |
//! | the [`Relay`](crate::outbox::Relay) | each row's span `inbox.outbox.publish` is a **child** of the stored context, and its own context is written into the message's headers (replacing any publisher header of the same names) |
//! | every [sink](crate::sink) | the headers as every sink sends headers: AMQP headers table, NATS headers, Kafka record headers, SQS message attributes (String; SQS allows 10 per message, and the context takes one or two of them: `tracestate` is left out when empty) |
//! | every broker [source](crate::source) | the headers come back in [`Envelope::headers`](crate::Envelope::headers) (RabbitMQ, NATS JetStream, Kafka, SQS; the file and memory sources carry whatever headers their envelopes have) |
//! | one delivery | the handler's span `inbox.message` is a **child** of the remote context |
//! | a batch transaction | the span `inbox.batch` (field `messages`) has one **link** per message carrying a context: a span has one parent, and a batch serves deliveries of many traces; a link keeps each trace reachable from the batch without claiming it for one of them. A message that the batch does not settle runs alone afterwards, in its own `inbox.message` span, a child of its own context |
//! | the HTTP layer (module `http`, feature `http`) | the request's span `inbox.http` is a **child** of the request's `traceparent`/`tracestate` headers; the handler runs in it, so its outbox rows carry the same trace |
//!
//! **Bad input**: a missing, malformed or unsupported `traceparent` (a wrong length, a version
//! `ff`, an all-zero trace or span id, non-hex digits) is ignored: the propagator yields no
//! remote context, and the span starts a new trace (or stays a child of the span current where
//! it was created). It never fails a delivery, a publish or a request, and is not logged (a
//! producer's bad header would otherwise log once per delivery). A stored context that is not a
//! JSON object of strings (a row written by hand) is ignored the same way.
//!
//! An outbox read by change data capture ([`Transport::ChangeDataCapture`](crate::outbox::Transport))
//! has no relay: the column is there for the connector to map (Debezium:
//! `table.fields.additional.placement=…,trace_context:header:inbox-trace-context`), and the
//! consumer reads the context from headers named `traceparent`/`tracestate` only.
//!
//! [W3C Trace Context]: https://www.w3.org/TR/trace-context/

/// The W3C Trace Context header carrying the trace id, the parent span id and the trace flags.
pub const TRACEPARENT: &str = "traceparent";

/// The W3C Trace Context header carrying vendor-specific trace state, passed on as received.
pub const TRACESTATE: &str = "tracestate";

#[cfg(feature = "otel")]
pub(crate) use enabled::*;

#[cfg(not(feature = "otel"))]
pub(crate) use disabled::*;

#[cfg(feature = "otel")]
mod enabled {
    use std::collections::BTreeMap;

    use opentelemetry::propagation::{Extractor, Injector, TextMapPropagator};
    use opentelemetry::trace::TraceContextExt;
    use opentelemetry_sdk::propagation::TraceContextPropagator;
    use tracing_opentelemetry::OpenTelemetrySpanExt;

    /// Headers to read a context from, by name.
    struct Headers<'a, F: Fn(&str) -> Option<&'a str>>(F);

    impl<'a, F: Fn(&str) -> Option<&'a str>> Extractor for Headers<'a, F> {
        fn get(&self, key: &str) -> Option<&str> {
            (self.0)(key)
        }

        fn keys(&self) -> Vec<&str> {
            vec![super::TRACEPARENT, super::TRACESTATE]
        }
    }

    /// A map to write a context into; an empty value (a `tracestate` with no entries) is left
    /// out, as the recommendation allows, so that it takes no header (nor an SQS attribute).
    struct Into<'a>(&'a mut BTreeMap<String, String>);

    impl Injector for Into<'_> {
        fn set(&mut self, key: &str, value: String) {
            if !value.is_empty() {
                self.0.insert(key.to_owned(), value);
            }
        }
    }

    /// The remote context in `get`'s headers, if they carry a valid one.
    fn extract<'a>(get: impl Fn(&str) -> Option<&'a str>) -> Option<opentelemetry::Context> {
        let cx = TraceContextPropagator::new().extract(&Headers(get));
        cx.span().span_context().is_valid().then_some(cx)
    }

    /// `span`'s context as W3C headers, if it has a valid one (an OpenTelemetry layer records
    /// it).
    fn inject(span: &tracing::Span) -> Option<BTreeMap<String, String>> {
        let cx = span.context();
        if !cx.span().span_context().is_valid() {
            return None;
        }
        let mut headers = BTreeMap::new();
        TraceContextPropagator::new().inject_context(&cx, &mut Into(&mut headers));
        Some(headers)
    }

    /// The current span's context as stored in `inbox_outbox.trace_context`: a JSON object of
    /// the W3C headers; `None` without a valid current span.
    pub(crate) fn current_json() -> Option<String> {
        inject(&tracing::Span::current())
            .map(|headers| serde_json::to_string(&headers).expect("strings serialize"))
    }

    /// Makes `span` a child of the context stored with an outbox row, if it holds a valid one.
    pub(crate) fn continue_stored(span: &tracing::Span, stored: Option<&str>) {
        let Some(stored) = stored else { return };
        let Ok(headers) = serde_json::from_str::<BTreeMap<String, String>>(stored) else {
            return;
        };
        continue_headers(span, Some(&headers));
    }

    /// Makes `span` a child of the remote context in `headers`, if they carry a valid one.
    pub(crate) fn continue_headers(
        span: &tracing::Span,
        headers: Option<&BTreeMap<String, String>>,
    ) {
        let Some(headers) = headers else { return };
        if let Some(cx) = extract(|name| headers.get(name).map(String::as_str)) {
            let _ = span.set_parent(cx);
        }
    }

    /// Links `span` to the remote context in `headers`, if they carry a valid one.
    pub(crate) fn link_headers(span: &tracing::Span, headers: Option<&BTreeMap<String, String>>) {
        let Some(headers) = headers else { return };
        if let Some(cx) = extract(|name| headers.get(name).map(String::as_str)) {
            span.add_link(cx.span().span_context().clone());
        }
    }

    /// Writes `span`'s context into `headers` (replacing headers of the same names), if it has a
    /// valid one.
    pub(crate) fn inject_headers(span: &tracing::Span, headers: &mut BTreeMap<String, String>) {
        if let Some(context) = inject(span) {
            headers.extend(context);
        }
    }

    /// Makes `span` a child of the remote context in an HTTP request's headers, if they carry a
    /// valid one (a header value that is not visible ASCII counts as missing).
    #[cfg(feature = "http")]
    pub(crate) fn continue_http(span: &tracing::Span, headers: &http::HeaderMap) {
        if let Some(cx) = extract(|name| headers.get(name).and_then(|v| v.to_str().ok())) {
            let _ = span.set_parent(cx);
        }
    }
}

#[cfg(not(feature = "otel"))]
mod disabled {
    use std::collections::BTreeMap;

    /// Without the feature: nothing is stored.
    pub(crate) fn current_json() -> Option<String> {
        None
    }

    /// Without the feature: nothing.
    pub(crate) fn continue_stored(_: &tracing::Span, _: Option<&str>) {}

    /// Without the feature: nothing.
    pub(crate) fn continue_headers(_: &tracing::Span, _: Option<&BTreeMap<String, String>>) {}

    /// Without the feature: nothing.
    pub(crate) fn link_headers(_: &tracing::Span, _: Option<&BTreeMap<String, String>>) {}

    /// Without the feature: nothing.
    pub(crate) fn inject_headers(_: &tracing::Span, _: &mut BTreeMap<String, String>) {}
}
