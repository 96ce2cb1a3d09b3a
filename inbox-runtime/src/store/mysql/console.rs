//! The console's reads on MySQL/MariaDB: the [`ConsoleDialect`] (`?` parameters; binary keys
//! converted to text; times formatted as UTC text with microseconds).

use sqlx::MySql;

use crate::store::console::ConsoleDialect;

impl ConsoleDialect for MySql {
    const LIST_REJECTIONS: &'static str = "SELECT id, consumer, message_key, message_name, \
         reason, detail, payload_hash, DATE_FORMAT(received_at, '%Y-%m-%d %H:%i:%s.%f'), source, \
         CAST(LENGTH(payload) AS SIGNED), payload_size FROM inbox_rejections \
         WHERE (? IS NULL OR consumer = ?) AND (? IS NULL OR reason = ?) \
         ORDER BY id DESC LIMIT ?";
    const FETCH_REJECTION: &'static str = "SELECT id, consumer, message_key, message_name, \
         reason, detail, payload_hash, DATE_FORMAT(received_at, '%Y-%m-%d %H:%i:%s.%f'), source, \
         CAST(LENGTH(payload) AS SIGNED), payload_size, payload FROM inbox_rejections \
         WHERE id = ?";
    const LIST_PARKED: &'static str = "SELECT CONVERT(m.consumer USING utf8mb4), \
         CONVERT(m.aggregate_id USING utf8mb4), \
         m.sequence, CONVERT(m.message_key USING utf8mb4), \
         DATE_FORMAT(m.received_at, '%Y-%m-%d %H:%i:%s.%f'), COALESCE(s.last_sequence, 0) \
         FROM inbox_messages m LEFT JOIN inbox_aggregate_state s \
           ON s.consumer = m.consumer AND s.aggregate_id = m.aggregate_id \
         WHERE m.status = 'parked' AND m.aggregate_id IS NOT NULL AND m.sequence IS NOT NULL \
           AND (? IS NULL OR m.consumer = ?) \
         ORDER BY m.consumer, m.aggregate_id, m.sequence LIMIT ?";
    const NOW_HOUR: &'static str = "SELECT CAST(TIMESTAMPDIFF(SECOND, '1970-01-01 00:00:00', \
         UTC_TIMESTAMP()) DIV 3600 AS SIGNED)";
    const ARRIVALS: &'static str = "SELECT CONVERT(consumer USING utf8mb4), status, \
         CAST(TIMESTAMPDIFF(SECOND, '1970-01-01 00:00:00', received_at) DIV 3600 AS SIGNED) AS h, \
         COUNT(*) FROM inbox_messages \
         WHERE status IN ('processed', 'failed', 'dead', 'parked', 'stale', 'discarded') \
           AND received_at >= UTC_TIMESTAMP(6) - INTERVAL ? HOUR \
         GROUP BY 1, 2, 3 \
         UNION ALL \
         SELECT consumer, CONCAT('rejected:', reason), \
           CAST(TIMESTAMPDIFF(SECOND, '1970-01-01 00:00:00', received_at) DIV 3600 AS SIGNED), \
           COUNT(*) FROM inbox_rejections WHERE received_at >= UTC_TIMESTAMP(6) - INTERVAL ? HOUR \
         GROUP BY 1, 2, 3";
    const RETRIES_DUE: &'static str = "SELECT CONVERT(consumer USING utf8mb4), COUNT(*), \
         DATE_FORMAT(MIN(next_attempt_at), '%Y-%m-%d %H:%i:%s.%f') \
         FROM inbox_messages WHERE status = 'failed' AND next_attempt_at <= UTC_TIMESTAMP(6) \
         GROUP BY consumer";
    const OUTBOX_SENT: &'static str = "SELECT destination, \
         CAST(TIMESTAMPDIFF(SECOND, '1970-01-01 00:00:00', sent_at) DIV 3600 AS SIGNED), \
         COUNT(*) FROM inbox_outbox \
         WHERE status = 'sent' AND sent_at >= UTC_TIMESTAMP(6) - INTERVAL ? HOUR GROUP BY 1, 2";
}
