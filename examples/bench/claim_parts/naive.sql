\set k random(1, 9000000000000000000)
\set acct random(1, 1000)
BEGIN;
INSERT INTO naive (consumer, message_key) VALUES ('peers', (:k)::text) ON CONFLICT DO NOTHING;
UPDATE accounts SET balance = balance + 1 WHERE id = :acct;
COMMIT;
