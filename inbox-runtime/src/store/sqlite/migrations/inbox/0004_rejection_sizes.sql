-- inbox-runtime: payloads over the dispatcher's size limit are kept cut to the limit, with
-- their real size (NULL: the payload is kept whole), under the reason `too_large`. SQLite cannot
-- change a CHECK constraint in place: the table is rebuilt, rows and ids kept.
CREATE TABLE inbox_rejections_new (
    id            INTEGER PRIMARY KEY AUTOINCREMENT,
    consumer      TEXT,
    message_key   TEXT COLLATE BINARY,
    message_name  TEXT    NOT NULL,
    reason        TEXT    NOT NULL
                  CHECK (reason IN ('conflict', 'malformed', 'unknown_message', 'invalid_key',
                                    'too_large')),
    detail        TEXT    NOT NULL,
    payload_hash  TEXT,
    payload       BLOB    NOT NULL,
    received_at   TEXT    NOT NULL DEFAULT (strftime('%Y-%m-%dT%H:%M:%fZ', 'now')),
    source           TEXT,
    source_partition TEXT,
    source_offset    INTEGER,
    payload_size     INTEGER
);

INSERT INTO inbox_rejections_new
    (id, consumer, message_key, message_name, reason, detail, payload_hash, payload,
     received_at, source, source_partition, source_offset)
SELECT id, consumer, message_key, message_name, reason, detail, payload_hash, payload,
       received_at, source, source_partition, source_offset
FROM inbox_rejections;

DROP TABLE inbox_rejections;
ALTER TABLE inbox_rejections_new RENAME TO inbox_rejections;
CREATE INDEX IF NOT EXISTS inbox_rejections_consumer ON inbox_rejections (consumer, reason);
