-- inbox-runtime: W3C Trace Context propagation (see the PostgreSQL migration): the publishing
-- span's context as a JSON object of the W3C headers; NULL without the feature `otel`. TEXT:
-- `tracestate` may hold up to 32 entries of 256 characters. Nullable and last: an instant ADD
-- COLUMN (MySQL 8.0.12, MariaDB 10.3).
ALTER TABLE inbox_outbox ADD COLUMN trace_context TEXT NULL;
