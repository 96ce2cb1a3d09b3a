-- inbox-runtime: broker positions (SQLite). One row per (consumer group, topic, partition):
-- the next offset to consume, written in the same transaction as the effect of the record
-- before it, and the fencing epoch: every assignment of the partition increments it, and a
-- write carrying an older epoch (a consumer that lost the partition: a zombie) changes no row.
-- Timestamps are UTC ISO-8601 text from the database clock.
CREATE TABLE IF NOT EXISTS inbox_positions (
    consumer_group TEXT    NOT NULL,
    topic          TEXT    NOT NULL,
    partition_id   INTEGER NOT NULL,
    -- NULL until a record of this assignment history is done: start from the broker's own
    -- committed offset (or its reset policy).
    next_offset    INTEGER,
    epoch          INTEGER NOT NULL DEFAULT 1,
    -- The consumer that holds the current epoch (client id, host and process id).
    owner          TEXT    NOT NULL,
    assigned_at    TEXT    NOT NULL DEFAULT (strftime('%Y-%m-%dT%H:%M:%fZ', 'now')),
    updated_at     TEXT    NOT NULL DEFAULT (strftime('%Y-%m-%dT%H:%M:%fZ', 'now')),
    PRIMARY KEY (consumer_group, topic, partition_id)
);
