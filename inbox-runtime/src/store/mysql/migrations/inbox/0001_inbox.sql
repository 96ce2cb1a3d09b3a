-- inbox-runtime: the transactional inbox (MySQL 8.0.16 or newer, MariaDB 10.6 or newer; InnoDB).
-- Relies on: InnoDB with the DYNAMIC row format (index keys up to 3072 bytes), enforced CHECK
-- constraints (MySQL 8.0.16, MariaDB 10.2), expression defaults (MySQL 8.0.13, MariaDB 10.2),
-- STORED generated columns, DATETIME(6). Timestamps are UTC from the database clock
-- (UTC_TIMESTAMP(6)). Keys and consumers are VARBINARY: they compare byte for byte (no
-- collation, no trailing-space padding), and a key holds MAX_KEY_BYTES (512) bytes.
-- One row per (consumer, message_key), whatever its status: a processed key blocks every
-- redelivery; a failed one is claimed again by its own retry.
CREATE TABLE IF NOT EXISTS inbox_messages (
    consumer         VARBINARY(255) NOT NULL,
    message_key      VARBINARY(512) NOT NULL,
    message_name     VARCHAR(512)   NOT NULL,
    payload_hash     VARCHAR(64)    NOT NULL,
    status           VARCHAR(16)    NOT NULL DEFAULT 'processed',
    attempts         INT            NOT NULL DEFAULT 1,
    last_error       TEXT,
    received_at      DATETIME(6)    NOT NULL DEFAULT (UTC_TIMESTAMP(6)),
    processed_at     DATETIME(6),
    next_attempt_at  DATETIME(6),
    payload          LONGBLOB,
    source           VARCHAR(512),
    source_partition VARCHAR(512),
    source_offset    BIGINT,
    aggregate_id     VARBINARY(512),
    sequence         BIGINT,
    result           LONGBLOB,
    -- The claim's token: set to a fresh value by the claim that inserts or takes over the row,
    -- and read back under the row lock to learn whether this transaction claimed it.
    claim_token      BINARY(16),
    -- Retention: rows age from when they were settled, or else from their first delivery.
    settled_at       DATETIME(6) AS (COALESCE(processed_at, received_at)) STORED,
    PRIMARY KEY (consumer, message_key),
    CONSTRAINT inbox_messages_status_check
        CHECK (status IN ('processed', 'failed', 'dead', 'parked', 'stale', 'discarded'))
) ENGINE = InnoDB ROW_FORMAT = DYNAMIC DEFAULT CHARSET = utf8mb4 COLLATE = utf8mb4_bin;

CREATE INDEX inbox_messages_status_age ON inbox_messages (status, settled_at);

CREATE INDEX inbox_messages_retry ON inbox_messages (consumer, status, next_attempt_at);

-- Ordering: the parked (and failed) successors of an aggregate, by sequence.
CREATE INDEX inbox_messages_aggregate ON inbox_messages (consumer, aggregate_id, sequence);

CREATE TABLE IF NOT EXISTS inbox_aggregate_state (
    consumer      VARBINARY(255) NOT NULL,
    aggregate_id  VARBINARY(512) NOT NULL,
    last_sequence BIGINT         NOT NULL,
    PRIMARY KEY (consumer, aggregate_id)
) ENGINE = InnoDB ROW_FORMAT = DYNAMIC DEFAULT CHARSET = utf8mb4 COLLATE = utf8mb4_bin;

-- Deliveries that can never be applied, kept so that nothing is lost: conflicts (same key,
-- different payload), malformed payloads, unknown message names, bad keys, payloads over the
-- size limit (kept cut to the limit, with their real size in payload_size).
CREATE TABLE IF NOT EXISTS inbox_rejections (
    id               BIGINT       NOT NULL AUTO_INCREMENT PRIMARY KEY,
    consumer         VARCHAR(255),
    message_key      TEXT,
    message_name     TEXT         NOT NULL,
    reason           VARCHAR(32)  NOT NULL,
    detail           TEXT         NOT NULL,
    payload_hash     VARCHAR(64),
    payload          LONGBLOB     NOT NULL,
    received_at      DATETIME(6)  NOT NULL DEFAULT (UTC_TIMESTAMP(6)),
    source           VARCHAR(512),
    source_partition VARCHAR(512),
    source_offset    BIGINT,
    payload_size     BIGINT,
    CONSTRAINT inbox_rejections_reason_check
        CHECK (reason IN ('conflict', 'malformed', 'unknown_message', 'invalid_key', 'too_large'))
) ENGINE = InnoDB DEFAULT CHARSET = utf8mb4 COLLATE = utf8mb4_bin;

CREATE INDEX inbox_rejections_consumer ON inbox_rejections (consumer, reason);

CREATE INDEX inbox_rejections_age ON inbox_rejections (received_at);
