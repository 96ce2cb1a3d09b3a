-- inbox-runtime: the transactional outbox (PostgreSQL 13 or newer, for xid8).
-- A row is written in the transaction of the effect that publishes it; the relay publishes it
-- once every transaction older than its own (txid) has ended, and marks it sent.
CREATE TABLE IF NOT EXISTS inbox_outbox (
    id              BIGINT      GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    message_id      TEXT        NOT NULL UNIQUE,
    destination     TEXT        NOT NULL,
    message_name    TEXT        NOT NULL,
    payload         BYTEA       NOT NULL,
    headers         TEXT        NOT NULL DEFAULT '{}',
    aggregate_id    TEXT,
    txid            XID8        NOT NULL DEFAULT pg_current_xact_id(),
    created_at      TIMESTAMPTZ NOT NULL DEFAULT now(),
    status          TEXT        NOT NULL DEFAULT 'pending'
                    CHECK (status IN ('pending', 'sent', 'dead')),
    attempts        INTEGER     NOT NULL DEFAULT 0,
    next_attempt_at TIMESTAMPTZ,
    leased_until    TIMESTAMPTZ,
    last_error      TEXT,
    sent_at         TIMESTAMPTZ
);

-- The relay's scan: pending rows in id order.
CREATE INDEX IF NOT EXISTS inbox_outbox_pending ON inbox_outbox (id) WHERE status = 'pending';
-- The per-aggregate guard: an earlier unsent row of the same aggregate.
CREATE INDEX IF NOT EXISTS inbox_outbox_aggregate
    ON inbox_outbox (aggregate_id, id) WHERE status <> 'sent';
-- Retention: sent rows by age.
CREATE INDEX IF NOT EXISTS inbox_outbox_sent_at ON inbox_outbox (sent_at) WHERE status = 'sent';
