\set k random(1, 9000000000000000000)
\set acct random(1, 1000)
BEGIN;
INSERT INTO inbox_messages (consumer, message_key, message_name, payload_hash, status, attempts, received_at, source, source_partition, source_offset) VALUES ('peers', (:k)::text, 'peers.credit' || left(set_config('inbox.key', (:k)::text, false), 0) || left(set_config('inbox.consumer', 'peers', false), 0), '\xb4c1316c4c9628da76a11a371fe50aaffb8217420e33b254bd80d4744b918806'::bytea, 'processed', 1, now(), NULL, NULL, NULL) ON CONFLICT (consumer, message_key) DO UPDATE SET status = 'processed', attempts = inbox_messages.attempts + 1, processed_at = now(), next_attempt_at = NULL, payload = NULL WHERE inbox_messages.payload_hash = excluded.payload_hash AND ((inbox_messages.status = 'failed' AND ('deliver' <> 'deliver' OR (inbox_messages.next_attempt_at IS NULL OR inbox_messages.next_attempt_at <= now()))) OR (inbox_messages.status = 'dead' AND 'deliver' = 'replay') OR (inbox_messages.status = 'parked' AND 'deliver' IN ('resume', 'release'))) RETURNING attempts, set_config('inbox.claim', '1', true);
UPDATE accounts SET balance = balance + 1 WHERE id = :acct;
COMMIT;
