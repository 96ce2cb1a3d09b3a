-- inbox-runtime: broker positions (MySQL 8.0.16 or newer, MariaDB 10.6 or newer; InnoDB). One
-- row per (consumer group, topic, partition): the next offset to consume, written in the same
-- transaction as the effect of the record before it, and the fencing epoch: every assignment of
-- the partition increments it, and a write carrying an older epoch (a consumer that lost the
-- partition: a zombie) changes no row.
-- Relies on: expression defaults (MySQL 8.0.13, MariaDB 10.2), DATETIME(6). Timestamps are UTC
-- from the database clock. Groups and topics are VARBINARY: they compare byte for byte (no
-- collation, no trailing-space padding); each holds at most 512 bytes.
CREATE TABLE IF NOT EXISTS inbox_positions (
    consumer_group VARBINARY(512) NOT NULL,
    topic          VARBINARY(512) NOT NULL,
    partition_id   INT            NOT NULL,
    -- NULL until a record of this assignment history is done: start from the broker's own
    -- committed offset (or its reset policy).
    next_offset    BIGINT,
    epoch          BIGINT         NOT NULL DEFAULT 1,
    -- The consumer that holds the current epoch (client id, host and process id).
    owner          TEXT           NOT NULL,
    assigned_at    DATETIME(6)    NOT NULL DEFAULT (UTC_TIMESTAMP(6)),
    updated_at     DATETIME(6)    NOT NULL DEFAULT (UTC_TIMESTAMP(6)),
    PRIMARY KEY (consumer_group, topic, partition_id)
) ENGINE = InnoDB ROW_FORMAT = DYNAMIC DEFAULT CHARSET = utf8mb4 COLLATE = utf8mb4_bin;
