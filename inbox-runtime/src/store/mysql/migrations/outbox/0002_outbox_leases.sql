-- inbox-runtime: the outbox's leased rows (see the PostgreSQL migration): orphans (pending rows
-- whose lease ran out unmarked) are looked up among the rows out with relays. MySQL has no
-- partial indexes: the index covers every row, by status first.
CREATE INDEX inbox_outbox_leased ON inbox_outbox (status, leased_until);
