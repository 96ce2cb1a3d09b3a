-- inbox-runtime: lease-owned marks (see the PostgreSQL migration): the token of the row's lease.
ALTER TABLE inbox_outbox ADD COLUMN lease_token TEXT;
