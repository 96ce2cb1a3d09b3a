-- inbox-runtime: indexes for the operator console and `admin::stats`, so that the counts per
-- status and consumer and the oldest first delivery of each (the overview), and the hourly
-- arrivals per consumer and status (the rates), are read from an index (index-only on an
-- all-visible table) instead of the whole table: status first, so that the small statuses
-- (failed, dead, parked) are range scans of their own. Building them takes a lock that holds
-- writes back for as long as the build runs on a large inbox: to avoid that, create them by
-- hand with CREATE INDEX CONCURRENTLY (same names) before upgrading; IF NOT EXISTS then skips.
CREATE INDEX IF NOT EXISTS inbox_messages_console
    ON inbox_messages (status, consumer, received_at);

CREATE INDEX IF NOT EXISTS inbox_rejections_console
    ON inbox_rejections (consumer, reason, received_at);
