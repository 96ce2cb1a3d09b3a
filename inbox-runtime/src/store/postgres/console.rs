//! The console's reads on PostgreSQL: the [`ConsoleDialect`].

use sqlx::Postgres;

use crate::store::console::{ConsoleDialect, list_parked, list_rejections};

impl ConsoleDialect for Postgres {
    const LIST_REJECTIONS: &'static str = list_rejections!("::TEXT");
    const LIST_PARKED: &'static str = list_parked!("::TEXT");
    const NOW_HOUR: &'static str = "SELECT CAST(FLOOR(EXTRACT(EPOCH FROM now()) / 3600) AS BIGINT)";
    const ARRIVALS: &'static str = "SELECT consumer, status, \
         CAST(FLOOR(EXTRACT(EPOCH FROM received_at) / 3600) AS BIGINT), \
         COUNT(*) FROM inbox_messages \
         WHERE status IN ('processed', 'failed', 'dead', 'parked', 'stale', 'discarded') \
           AND received_at >= now() - $1 * interval '1 hour' \
         GROUP BY 1, 2, 3 \
         UNION ALL \
         SELECT consumer, 'rejected:' || reason, \
           CAST(FLOOR(EXTRACT(EPOCH FROM received_at) / 3600) AS BIGINT), COUNT(*) \
         FROM inbox_rejections WHERE received_at >= now() - $2 * interval '1 hour' \
         GROUP BY 1, 2, 3";
    const RETRIES_DUE: &'static str = "SELECT consumer, COUNT(*), \
         CAST(MIN(next_attempt_at) AS TEXT) \
         FROM inbox_messages WHERE status = 'failed' AND next_attempt_at <= now() \
         GROUP BY consumer";
    const OUTBOX_SENT: &'static str = "SELECT destination, \
         CAST(FLOOR(EXTRACT(EPOCH FROM sent_at) / 3600) AS BIGINT), \
         COUNT(*) FROM inbox_outbox \
         WHERE status = 'sent' AND sent_at >= now() - $1 * interval '1 hour' GROUP BY 1, 2";
}
