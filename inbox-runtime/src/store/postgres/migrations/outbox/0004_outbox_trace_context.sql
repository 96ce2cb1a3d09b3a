-- inbox-runtime: W3C Trace Context propagation (feature `otel`). The publishing span's context,
-- a JSON object of the W3C headers ({"traceparent": "00-…", "tracestate": "…"}), which the
-- relay continues and sends in the message's headers. NULL without the feature, or when the
-- publish ran outside a traced span.
ALTER TABLE inbox_outbox ADD COLUMN IF NOT EXISTS trace_context TEXT;
