-- inbox-runtime: the transactional inbox (SQLite). Timestamps are UTC ISO-8601 text
-- ('%Y-%m-%dT%H:%M:%fZ') from the database clock; keys compare with the BINARY collation.
CREATE TABLE IF NOT EXISTS inbox_messages (
    consumer         TEXT    NOT NULL,
    message_key      TEXT    NOT NULL COLLATE BINARY,
    message_name     TEXT    NOT NULL,
    payload_hash     TEXT    NOT NULL,
    status           TEXT    NOT NULL DEFAULT 'processed'
                     CHECK (status IN ('processed', 'failed', 'dead', 'parked', 'stale', 'discarded')),
    attempts         INTEGER NOT NULL DEFAULT 1,
    last_error       TEXT,
    received_at      TEXT    NOT NULL DEFAULT (strftime('%Y-%m-%dT%H:%M:%fZ', 'now')),
    processed_at     TEXT,
    next_attempt_at  TEXT,
    payload          BLOB,
    source           TEXT,
    source_partition TEXT,
    source_offset    INTEGER,
    aggregate_id     TEXT,
    sequence         INTEGER,
    PRIMARY KEY (consumer, message_key)
) WITHOUT ROWID;

-- Retention: rows age from when they were settled (processed, discarded, stale), or else
-- from their first delivery.
CREATE INDEX IF NOT EXISTS inbox_messages_status_age
    ON inbox_messages (status, (COALESCE(processed_at, received_at)));

CREATE TABLE IF NOT EXISTS inbox_aggregate_state (
    consumer      TEXT    NOT NULL,
    aggregate_id  TEXT    NOT NULL COLLATE BINARY,
    last_sequence INTEGER NOT NULL,
    PRIMARY KEY (consumer, aggregate_id)
) WITHOUT ROWID;
