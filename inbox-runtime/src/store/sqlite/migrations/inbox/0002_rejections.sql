-- inbox-runtime: deliveries that can never be applied, kept so that nothing is lost:
-- conflicts (same key, different payload), malformed payloads, unknown message names, bad keys.
CREATE TABLE IF NOT EXISTS inbox_rejections (
    id            INTEGER PRIMARY KEY AUTOINCREMENT,
    consumer      TEXT,
    message_key   TEXT COLLATE BINARY,
    message_name  TEXT    NOT NULL,
    reason        TEXT    NOT NULL
                  CHECK (reason IN ('conflict', 'malformed', 'unknown_message', 'invalid_key')),
    detail        TEXT    NOT NULL,
    payload_hash  TEXT,
    payload       BLOB    NOT NULL,
    received_at   TEXT    NOT NULL DEFAULT (strftime('%Y-%m-%dT%H:%M:%fZ', 'now')),
    source           TEXT,
    source_partition TEXT,
    source_offset    INTEGER
);

CREATE INDEX IF NOT EXISTS inbox_rejections_consumer ON inbox_rejections (consumer, reason);

CREATE INDEX IF NOT EXISTS inbox_messages_retry
    ON inbox_messages (consumer, next_attempt_at) WHERE status = 'failed';

-- Ordering: the parked (and failed) successors of an aggregate, by sequence.
CREATE INDEX IF NOT EXISTS inbox_messages_aggregate
    ON inbox_messages (consumer, aggregate_id, sequence) WHERE aggregate_id IS NOT NULL;
