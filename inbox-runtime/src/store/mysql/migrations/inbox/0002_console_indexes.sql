-- inbox-runtime: indexes for the operator console and `admin::stats`, so that the counts per
-- status and consumer and the oldest first delivery of each (the overview), and the hourly
-- arrivals per consumer and status (the rates), are read from a covering index instead of the
-- whole table: status first, so that the small statuses (failed, dead, parked) are range scans
-- of their own. InnoDB builds them online (concurrent writes go on).
CREATE INDEX inbox_messages_console ON inbox_messages (status, consumer, received_at);

CREATE INDEX inbox_rejections_console ON inbox_rejections (consumer, reason, received_at);
