-- inbox-runtime: the outbox's leased rows. A relay looks for orphans (pending rows whose lease ran
-- out unmarked: their relay crashed, hung or was stopped) before every lease, and dead-letters
-- those out of attempts; this index keeps that lookup to the rows out with relays, however long
-- the backlog.
CREATE INDEX IF NOT EXISTS inbox_outbox_leased
    ON inbox_outbox (leased_until) WHERE status = 'pending' AND leased_until IS NOT NULL;
