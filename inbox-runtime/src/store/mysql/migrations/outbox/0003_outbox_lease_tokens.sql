-- inbox-runtime: lease-owned marks (see the PostgreSQL migration): the token of the row's lease
-- (a UUID in text form). Nullable and last: an instant ADD COLUMN (MySQL 8.0.12, MariaDB 10.3).
ALTER TABLE inbox_outbox ADD COLUMN lease_token VARCHAR(64) NULL;
