-- inbox-runtime: the transactional inbox (PostgreSQL).
-- One row per (consumer, message_key), whatever its status: a processed key blocks every
-- redelivery; a failed one is claimed again by its own retry.
CREATE TABLE IF NOT EXISTS inbox_messages (
    consumer         TEXT        NOT NULL,
    message_key      TEXT COLLATE "C" NOT NULL,
    message_name     TEXT        NOT NULL,
    payload_hash     TEXT        NOT NULL,
    status           TEXT        NOT NULL DEFAULT 'processed'
                     CHECK (status IN ('processed', 'failed', 'dead', 'parked', 'stale', 'discarded')),
    attempts         INTEGER     NOT NULL DEFAULT 1,
    last_error       TEXT,
    received_at      TIMESTAMPTZ NOT NULL DEFAULT now(),
    processed_at     TIMESTAMPTZ,
    next_attempt_at  TIMESTAMPTZ,
    payload          BYTEA,
    source           TEXT,
    source_partition TEXT,
    source_offset    BIGINT,
    aggregate_id     TEXT,
    sequence         BIGINT,
    PRIMARY KEY (consumer, message_key)
);

-- Retention: rows age from when they were settled (processed, discarded, stale), or else
-- from their first delivery.
CREATE INDEX IF NOT EXISTS inbox_messages_status_age
    ON inbox_messages (status, (COALESCE(processed_at, received_at)));

CREATE TABLE IF NOT EXISTS inbox_aggregate_state (
    consumer      TEXT   NOT NULL,
    aggregate_id  TEXT COLLATE "C" NOT NULL,
    last_sequence BIGINT NOT NULL,
    PRIMARY KEY (consumer, aggregate_id)
);
