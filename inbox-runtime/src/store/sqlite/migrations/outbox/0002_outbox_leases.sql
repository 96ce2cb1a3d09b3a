-- inbox-runtime: the outbox's leased rows (see the PostgreSQL migration): orphans are looked up
-- among the rows out with relays only.
CREATE INDEX IF NOT EXISTS inbox_outbox_leased
    ON inbox_outbox (leased_until) WHERE status = 'pending' AND leased_until IS NOT NULL;
