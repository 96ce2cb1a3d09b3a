-- inbox-runtime: W3C Trace Context propagation (see the PostgreSQL migration): the publishing
-- span's context as a JSON object of the W3C headers; NULL without the feature `otel`.
ALTER TABLE inbox_outbox ADD COLUMN trace_context TEXT;
