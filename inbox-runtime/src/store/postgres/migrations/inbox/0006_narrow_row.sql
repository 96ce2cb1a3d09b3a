-- inbox-runtime: a narrower inbox row (issue 19). Every delivery writes one row and an entry in
-- each of its indexes, so every byte of them is written, replicated and indexed:
-- * the fingerprint is kept as its 32 raw bytes (BYTEA) instead of 64 hex digits as text; a
--   stored value that is not a 64-lower-case-hex-digit digest (never written by the runtime)
--   keeps its text's bytes, and reads back as that text;
-- * one index serves both the retention purge (a range per status on the age of a row:
--   settled, else first delivered) and the console's overview and rates (counts per status and
--   consumer and the oldest first delivery, read index-only from the included columns), where
--   `inbox_messages_status_age` and `inbox_messages_console` were two: one index entry per
--   delivery fewer.
-- Converting the fingerprints rewrites the table and rebuilds its indexes, holding writes back
-- while it runs (see CHANGELOG.md for the time per million rows). The old indexes are dropped
-- first so that the rewrite does not rebuild them.
DROP INDEX IF EXISTS inbox_messages_status_age;
DROP INDEX IF EXISTS inbox_messages_console;

ALTER TABLE inbox_messages ALTER COLUMN payload_hash TYPE BYTEA USING
    CASE WHEN payload_hash ~ '^[0-9a-f]{64}$' THEN decode(payload_hash, 'hex')
         ELSE convert_to(payload_hash, 'UTF8') END;

CREATE INDEX IF NOT EXISTS inbox_messages_console
    ON inbox_messages (status, (COALESCE(processed_at, received_at)))
    INCLUDE (consumer, received_at);
