\set k random(1, 9000000000000000000)
\set acct random(1, 1000)
BEGIN;
INSERT INTO inbox_messages (consumer, message_key, message_name, payload_hash, status, attempts, received_at) VALUES ('peers', (:k)::text, 'peers.credit', '\xb4c1316c4c9628da76a11a371fe50aaffb8217420e33b254bd80d4744b918806'::bytea, 'processed', 1, now()) ON CONFLICT DO NOTHING;
UPDATE accounts SET balance = balance + 1 WHERE id = :acct;
COMMIT;
