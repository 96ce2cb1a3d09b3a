//! The console's reads on SQLite: the [`ConsoleDialect`] (times are UTC text).

use sqlx::Sqlite;

use crate::store::console::{ConsoleDialect, list_parked, list_rejections};

impl ConsoleDialect for Sqlite {
    const LIST_REJECTIONS: &'static str = list_rejections!("");
    const LIST_PARKED: &'static str = list_parked!("");
    const NOW_HOUR: &'static str = "SELECT CAST(strftime('%s', 'now') AS INTEGER) / 3600";
    const ARRIVALS: &'static str = "SELECT consumer, status, \
         CAST(strftime('%s', received_at) AS INTEGER) / 3600, \
         COUNT(*) FROM inbox_messages \
         WHERE status IN ('processed', 'failed', 'dead', 'parked', 'stale', 'discarded') \
           AND received_at >= strftime('%Y-%m-%dT%H:%M:%fZ', 'now', '-' || $1 || ' hours') \
         GROUP BY 1, 2, 3 \
         UNION ALL \
         SELECT consumer, 'rejected:' || reason, \
           CAST(strftime('%s', received_at) AS INTEGER) / 3600, COUNT(*) \
         FROM inbox_rejections \
         WHERE received_at >= strftime('%Y-%m-%dT%H:%M:%fZ', 'now', '-' || $2 || ' hours') \
         GROUP BY 1, 2, 3";
    const RETRIES_DUE: &'static str = "SELECT consumer, COUNT(*), \
         CAST(MIN(next_attempt_at) AS TEXT) \
         FROM inbox_messages WHERE status = 'failed' \
           AND next_attempt_at <= strftime('%Y-%m-%dT%H:%M:%fZ', 'now') \
         GROUP BY consumer";
    const OUTBOX_SENT: &'static str = "SELECT destination, \
         CAST(strftime('%s', sent_at) AS INTEGER) / 3600, COUNT(*) \
         FROM inbox_outbox WHERE status = 'sent' \
           AND sent_at >= strftime('%Y-%m-%dT%H:%M:%fZ', 'now', '-' || $1 || ' hours') \
         GROUP BY 1, 2";
}
