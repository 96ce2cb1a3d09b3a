-- inbox-runtime: the transactional outbox (MySQL 8.0.16 or newer, MariaDB 10.6 or newer; InnoDB).
-- Relies on: enforced CHECK constraints (MySQL 8.0.16, MariaDB 10.2), expression defaults
-- (MySQL 8.0.13, MariaDB 10.2), STORED generated columns with an index, DATETIME(6), and, in the
-- statements of the store, `FOR UPDATE SKIP LOCKED` (MySQL 8.0.1, MariaDB 10.6). Timestamps are
-- UTC from the database clock (UTC_TIMESTAMP(6)).
-- Message ids and aggregates compare byte for byte: each is indexed and compared through the
-- SHA-256 of its bytes (BINARY(32), a STORED generated column), so no collation, no
-- trailing-space padding and no length limit of an index key applies to them.
-- Texts are LONGTEXT (a TEXT holds only 64 KiB: an aggregate id, a name or a destination longer
-- than that, which PostgreSQL stores, would be refused): a row is bounded only by the server's
-- max_allowed_packet, which every row written or read must fit (payload, headers and the rest:
-- MariaDB's default is 16 MiB, MySQL's 64 MiB).
-- A row is written in the transaction of the effect that publishes it; the relay leases rows by
-- status (never by an id cursor), so a row whose transaction commits late is found, and marks
-- them sent. Per-aggregate order: see inbox_outbox_aggregates below.
CREATE TABLE IF NOT EXISTS inbox_outbox (
    id              BIGINT       NOT NULL AUTO_INCREMENT PRIMARY KEY,
    message_id      VARCHAR(255) NOT NULL,
    message_id_hash BINARY(32)   AS (UNHEX(SHA2(message_id, 256))) STORED,
    destination     LONGTEXT     NOT NULL,
    message_name    LONGTEXT     NOT NULL,
    payload         LONGBLOB     NOT NULL,
    headers         LONGTEXT     NOT NULL,
    aggregate_id    LONGTEXT,
    aggregate_hash  BINARY(32)   AS (UNHEX(SHA2(aggregate_id, 256))) STORED,
    created_at      DATETIME(6)  NOT NULL DEFAULT (UTC_TIMESTAMP(6)),
    status          VARCHAR(16)  NOT NULL DEFAULT 'pending',
    attempts        INT          NOT NULL DEFAULT 0,
    next_attempt_at DATETIME(6),
    leased_until    DATETIME(6),
    last_error      TEXT,
    sent_at         DATETIME(6),
    CONSTRAINT inbox_outbox_status_check CHECK (status IN ('pending', 'sent', 'dead')),
    UNIQUE KEY inbox_outbox_message_id (message_id_hash),
    -- The relay's scan: rows by status, in id order.
    KEY inbox_outbox_pending (status, id),
    -- The per-aggregate guard: an earlier unsent row of the same aggregate.
    KEY inbox_outbox_aggregate (aggregate_hash, status, id),
    -- Retention: sent rows by age.
    KEY inbox_outbox_sent_at (status, sent_at)
) ENGINE = InnoDB ROW_FORMAT = DYNAMIC DEFAULT CHARSET = utf8mb4 COLLATE = utf8mb4_bin;

-- One lock row per aggregate that has published: a transaction that publishes a row of an
-- aggregate first upserts the aggregate's row here (INSERT … ON DUPLICATE KEY UPDATE: an
-- exclusive lock held until it commits or rolls back), and only then inserts the outbox row,
-- whose AUTO_INCREMENT id is allocated by that insert. Writers of one aggregate therefore run
-- one at a time, and each allocates its ids after every earlier writer of the aggregate has
-- ended: a committed row of an aggregate has every lower-id row of it already final (committed
-- or rolled back), which is what lets the relay publish the aggregate's rows in id order
-- without ever seeing a later row before an earlier one commits.
CREATE TABLE IF NOT EXISTS inbox_outbox_aggregates (
    aggregate_hash BINARY(32)  NOT NULL PRIMARY KEY,
    -- How many rows of the aggregate were written (every write updates the row, which is what
    -- takes its lock), and when the last one was.
    rows_written   BIGINT      NOT NULL DEFAULT 1,
    written_at     DATETIME(6) NOT NULL DEFAULT (UTC_TIMESTAMP(6)),
    -- The retention purge forgets lock rows not written to for the window (safe at any time:
    -- the next writer of the aggregate creates its row again).
    KEY inbox_outbox_aggregates_written_at (written_at)
) ENGINE = InnoDB;
