-- inbox-runtime: deliveries that can never be applied, kept so that nothing is lost:
-- conflicts (same key, different payload), malformed payloads, unknown message names, bad keys.
CREATE TABLE IF NOT EXISTS inbox_rejections (
    id            BIGSERIAL   PRIMARY KEY,
    consumer      TEXT,
    message_key   TEXT COLLATE "C",
    message_name  TEXT        NOT NULL,
    reason        TEXT        NOT NULL
                  CHECK (reason IN ('conflict', 'malformed', 'unknown_message', 'invalid_key')),
    detail        TEXT        NOT NULL,
    payload_hash  TEXT,
    payload       BYTEA       NOT NULL,
    received_at   TIMESTAMPTZ NOT NULL DEFAULT now(),
    source           TEXT,
    source_partition TEXT,
    source_offset    BIGINT
);

CREATE INDEX IF NOT EXISTS inbox_rejections_consumer ON inbox_rejections (consumer, reason);

CREATE INDEX IF NOT EXISTS inbox_messages_retry
    ON inbox_messages (consumer, next_attempt_at) WHERE status = 'failed';

-- Ordering: the parked (and failed) successors of an aggregate, by sequence.
CREATE INDEX IF NOT EXISTS inbox_messages_aggregate
    ON inbox_messages (consumer, aggregate_id, sequence) WHERE aggregate_id IS NOT NULL;
