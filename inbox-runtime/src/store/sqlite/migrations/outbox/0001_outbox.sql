-- inbox-runtime: the transactional outbox (SQLite). Timestamps are UTC ISO-8601 text
-- ('%Y-%m-%dT%H:%M:%fZ') from the database clock. AUTOINCREMENT: ids are never reused, so id
-- order stays the order rows were written (SQLite has one writer at a time).
CREATE TABLE IF NOT EXISTS inbox_outbox (
    id              INTEGER PRIMARY KEY AUTOINCREMENT,
    message_id      TEXT    NOT NULL UNIQUE,
    destination     TEXT    NOT NULL,
    message_name    TEXT    NOT NULL,
    payload         BLOB    NOT NULL,
    headers         TEXT    NOT NULL DEFAULT '{}',
    aggregate_id    TEXT,
    created_at      TEXT    NOT NULL DEFAULT (strftime('%Y-%m-%dT%H:%M:%fZ', 'now')),
    status          TEXT    NOT NULL DEFAULT 'pending'
                    CHECK (status IN ('pending', 'sent', 'dead')),
    attempts        INTEGER NOT NULL DEFAULT 0,
    next_attempt_at TEXT,
    leased_until    TEXT,
    last_error      TEXT,
    sent_at         TEXT
);

CREATE INDEX IF NOT EXISTS inbox_outbox_pending ON inbox_outbox (id) WHERE status = 'pending';
CREATE INDEX IF NOT EXISTS inbox_outbox_aggregate
    ON inbox_outbox (aggregate_id, id) WHERE status <> 'sent';
CREATE INDEX IF NOT EXISTS inbox_outbox_sent_at ON inbox_outbox (sent_at) WHERE status = 'sent';
