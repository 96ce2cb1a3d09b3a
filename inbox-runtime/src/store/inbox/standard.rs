//! The inbox statements whose text is the same on every backend with `$N` parameters (each
//! bound once, in order), `ON CONFLICT` and `RETURNING` (PostgreSQL, SQLite): the defaults of
//! [`InboxDialect`](super::InboxDialect). A backend whose SQL differs (MySQL: `?` parameters,
//! no `RETURNING`) states its own.

use super::Param::*;
use super::{Param, Stmt};

pub(crate) const STORE_RESULT: Stmt = Stmt {
    sql: "UPDATE inbox_messages SET result = $3 WHERE consumer = $1 AND message_key = $2",
    binds: &[Consumer, Key, ResultBytes],
};

pub(crate) const FETCH_RESULT: Stmt = Stmt {
    sql: "SELECT result FROM inbox_messages WHERE consumer = $1 AND message_key = $2",
    binds: &[Consumer, Key],
};

pub(crate) const RECORD_REJECTION: Stmt = Stmt {
    sql: "INSERT INTO inbox_rejections \
     (consumer, message_key, message_name, reason, detail, payload_hash, payload, \
      source, source_partition, source_offset, payload_size) \
     VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11)",
    binds: &[
        Consumer,
        Key,
        Name,
        Reason,
        Detail,
        Hash,
        Payload,
        Source,
        Partition,
        Offset,
        PayloadSize,
    ],
};

/// The columns of a [`StoredMessage`](crate::store::StoredMessage), in the order
/// [`stored_message`](super::admin) decodes them.
macro_rules! message_columns {
    () => {
        "consumer, message_key, message_name, status, attempts, last_error, payload_hash, \
         payload, CAST(received_at AS TEXT), \
         CAST(COALESCE(processed_at, CASE WHEN status IN ('processed', 'discarded', 'stale') \
           THEN received_at END) AS TEXT), \
         CAST(next_attempt_at AS TEXT), source, aggregate_id, sequence, result"
    };
}

/// See [`message_columns!`].
pub(crate) const MESSAGE_COLUMNS: &str = message_columns!();

pub(crate) const FETCH: Stmt = Stmt {
    sql: concat!(
        "SELECT ",
        message_columns!(),
        " FROM inbox_messages WHERE consumer = $1 AND message_key = $2"
    ),
    binds: &[Consumer, Key],
};

pub(crate) const STATS: &str = "SELECT consumer, status, COUNT(*), CAST(MIN(received_at) AS TEXT) \
     FROM inbox_messages GROUP BY status, consumer \
     UNION ALL \
     SELECT consumer, 'rejected:' || reason, COUNT(*), CAST(MIN(received_at) AS TEXT) \
     FROM inbox_rejections GROUP BY consumer, reason \
     ORDER BY 1 NULLS FIRST, 2";

/// Locks the aggregate's state row (creating it at sequence 0) and reads its last applied
/// sequence; a concurrent transaction on the same aggregate waits here until this one ends.
pub(crate) const LOCK_AGGREGATE: Stmt = Stmt {
    sql: "INSERT INTO inbox_aggregate_state \
     (consumer, aggregate_id, last_sequence) VALUES ($1, $2, 0) \
     ON CONFLICT (consumer, aggregate_id) DO UPDATE \
     SET last_sequence = inbox_aggregate_state.last_sequence \
     RETURNING last_sequence",
    binds: &[Consumer, Aggregate],
};

/// A key claimed fresh in this transaction has `attempts = 1`.
pub(crate) const UNCLAIM_FRESH: Stmt = Stmt {
    sql: "DELETE FROM inbox_messages \
     WHERE consumer = $1 AND message_key = $2 AND status = 'processed' AND attempts = 1",
    binds: &[Consumer, Key],
};

/// A `failed` key taken over in this transaction counted one more attempt and dropped its payload.
pub(crate) const UNCLAIM_TAKEN_OVER: Stmt = Stmt {
    sql: "UPDATE inbox_messages \
     SET status = 'failed', attempts = attempts - 1, processed_at = NULL, payload = $3 \
     WHERE consumer = $1 AND message_key = $2 AND status = 'processed' AND attempts > 1",
    binds: &[Consumer, Key, Payload],
};

pub(crate) const ADVANCE_AGGREGATE: Stmt = Stmt {
    sql: "UPDATE inbox_aggregate_state SET last_sequence = $3 \
     WHERE consumer = $1 AND aggregate_id = $2",
    binds: &[Consumer, Aggregate, Sequence],
};

/// A parked row is not settled: it loses the `processed_at` its claim gave it (retention ages
/// it from its first delivery, and never purges it).
pub(crate) const MARK_MESSAGE: Stmt = Stmt {
    sql: "UPDATE inbox_messages \
     SET status = $3, aggregate_id = $4, sequence = $5, payload = $6, \
     processed_at = CASE WHEN $3 = 'parked' THEN NULL ELSE processed_at END \
     WHERE consumer = $1 AND message_key = $2",
    binds: &[Consumer, Key, NewStatus, Aggregate, Sequence, Payload],
};

pub(crate) const FIND_PARKED: Stmt = Stmt {
    sql: "SELECT consumer, message_key, message_name, aggregate_id, \
     sequence FROM inbox_messages \
     WHERE consumer = $1 AND aggregate_id = $2 AND sequence = $3 \
     AND status IN ('parked', 'failed') LIMIT 1",
    binds: &[Consumer, Aggregate, Sequence],
};

pub(crate) const DEAD_LETTER_PARKED: Stmt = Stmt {
    sql: "UPDATE inbox_messages \
     SET status = 'dead', last_error = $3 \
     WHERE consumer = $1 AND message_key = $2 AND status = 'parked'",
    binds: &[Consumer, Key, Reason],
};

/// The batch claim's `INSERT`, before its `VALUES`.
pub(crate) const BATCH_INSERT: &str = "INSERT INTO inbox_messages (consumer, message_key, \
     message_name, payload_hash, status, attempts, received_at, processed_at, source, \
     source_partition, source_offset) ";

/// The batch claim's `ON CONFLICT` clause, in three parts: a dialect's `processed_at` of a
/// taken-over key goes between the first two, its takeover condition between the last two.
pub(crate) const BATCH_CONFLICT: [&str; 3] = [
    " ON CONFLICT (consumer, message_key) DO UPDATE SET status = 'processed', \
     attempts = inbox_messages.attempts + 1, processed_at = ",
    ", next_attempt_at = NULL, payload = NULL \
     WHERE inbox_messages.payload_hash = excluded.payload_hash AND ",
    " RETURNING consumer, message_key, attempts",
];

/// A key's statements: `$1` the consumer, `$2` the key.
pub(crate) const KEY: &[Param] = &[Consumer, Key];

/// The claim's parameters.
pub(crate) const CLAIM: &[Param] = &[Consumer, Key, Name, Hash, Source, Partition, Offset, Mode];

/// A failure record's parameters.
pub(crate) const RECORD_FAILURE: &[Param] = &[
    Consumer, Key, Name, Hash, Permanent, MaxTries, LastError, DelayMs, Payload, Source, Partition,
    Offset, Aggregate, Sequence,
];

/// The parameters that turn a claimed row into a failed attempt.
pub(crate) const FAIL_CLAIMED: &[Param] = &[
    Consumer, Key, Permanent, MaxTries, LastError, DelayMs, Payload,
];

/// A purge's parameters: three statuses, the window, the batch size.
pub(crate) const PURGE: &[Param] = &[Status1, Status2, Status3, Window, Limit];

/// A purge preview's parameters: five statuses, the window, whether rejections count.
pub(crate) const PURGE_PREVIEW: &[Param] = &[
    Status1, Status2, Status3, Status4, Status5, Window, Rejections,
];

/// A window in seconds and a row limit.
pub(crate) const WINDOW_LIMIT: &[Param] = &[Window, Limit];

/// A window in seconds.
pub(crate) const WINDOW: &[Param] = &[Window];

// The statements below differ between `$N` dialects only in their clock arithmetic: each is a
// template, filled with a dialect's expressions (string literals, or macro calls that expand to
// them).

/// [`InboxDialect::EXISTING`](super::InboxDialect::EXISTING), around the dialect's
/// `retry_in_ms` expression: milliseconds until a `failed` row is due, `NULL` if it is.
macro_rules! existing {
    (retry_in_ms: [$($retry_in_ms:tt)+]) => {
        $crate::store::inbox::Stmt {
            sql: concat!(
                "SELECT status, payload_hash, attempts, ",
                $($retry_in_ms)+,
                " FROM inbox_messages WHERE consumer = $1 AND message_key = $2"
            ),
            binds: $crate::store::inbox::standard::KEY,
        }
    };
}
pub(crate) use existing;

/// [`existing!`] for many keys; `(consumer, message_key) IN (…)` follows.
macro_rules! existing_batch {
    (retry_in_ms: [$($retry_in_ms:tt)+]) => {
        concat!(
            "SELECT consumer, message_key, status, payload_hash, attempts, ",
            $($retry_in_ms)+,
            " FROM inbox_messages WHERE (consumer, message_key) IN "
        )
    };
}
pub(crate) use existing_batch;

/// The claim's `ON CONFLICT` clause: takes over a row with the same fingerprint that is
/// `failed` and `due` (any `failed` one unless the mode is `deliver`), `dead` on replay, or
/// `parked` on resume or release; `now` stamps `processed_at`.
macro_rules! claim_takeover {
    (now: [$($now:tt)+], due: [$($due:tt)+]) => {
        concat!(
            " ON CONFLICT (consumer, message_key) DO UPDATE SET \
             status = 'processed', attempts = inbox_messages.attempts + 1, processed_at = ",
            $($now)+,
            ", next_attempt_at = NULL, payload = NULL \
             WHERE inbox_messages.payload_hash = excluded.payload_hash \
               AND ((inbox_messages.status = 'failed' AND ($8 <> 'deliver' OR ",
            $($due)+,
            ")) OR (inbox_messages.status = 'dead' AND $8 = 'replay') \
               OR (inbox_messages.status = 'parked' AND $8 IN ('resume', 'release')))"
        )
    };
}
pub(crate) use claim_takeover;

/// A failed attempt in one statement (autocommit): a first failure inserts the row; a later one
/// (of the same payload, still `failed`, `dead` or `parked`) counts another attempt. Dead when
/// permanent or at `max_attempts` ($6). `next_attempt` is the clock plus `$8` milliseconds.
macro_rules! record_failure {
    (now: [$($now:tt)+], next_attempt: [$($next:tt)+]) => {
        $crate::store::inbox::Write::Returning($crate::store::inbox::Stmt {
            sql: concat!(
                "INSERT INTO inbox_messages \
                 (consumer, message_key, message_name, payload_hash, status, attempts, \
                  last_error, next_attempt_at, payload, received_at, source, source_partition, \
                  source_offset, aggregate_id, sequence) \
                 VALUES ($1, $2, $3, $4, CASE WHEN $5 OR $6 <= 1 THEN 'dead' ELSE 'failed' END, \
                  1, $7, ",
                $($next)+,
                ", $9, ",
                $($now)+,
                ", $10, $11, $12, $13, $14) \
                 ON CONFLICT (consumer, message_key) DO UPDATE SET \
                   attempts = inbox_messages.attempts + 1, \
                   status = CASE WHEN $5 OR inbox_messages.attempts + 1 >= $6 THEN 'dead' \
                     ELSE 'failed' END, \
                   last_error = excluded.last_error, next_attempt_at = excluded.next_attempt_at, \
                   payload = excluded.payload \
                 WHERE inbox_messages.payload_hash = excluded.payload_hash \
                   AND inbox_messages.status IN ('failed', 'dead', 'parked') \
                 RETURNING status, attempts"
            ),
            binds: $crate::store::inbox::standard::RECORD_FAILURE,
        })
    };
}
pub(crate) use record_failure;

/// Turns a row claimed in this (batch) transaction into a failed attempt, after the handler's
/// savepoint was rolled back (`attempts` already counts this attempt). `next_attempt` is the
/// clock plus `$6` milliseconds.
macro_rules! fail_claimed {
    (next_attempt: [$($next:tt)+]) => {
        $crate::store::inbox::Write::Returning($crate::store::inbox::Stmt {
            sql: concat!(
                "UPDATE inbox_messages SET \
                 status = CASE WHEN $3 OR attempts >= $4 THEN 'dead' ELSE 'failed' END, \
                 last_error = $5, next_attempt_at = ",
                $($next)+,
                ", payload = $7, processed_at = NULL \
                 WHERE consumer = $1 AND message_key = $2 \
                 RETURNING status, attempts"
            ),
            binds: $crate::store::inbox::standard::FAIL_CLAIMED,
        })
    };
}
pub(crate) use fail_claimed;

/// Discards a `failed` or `dead` row, settled at `now`.
macro_rules! discard {
    (now: [$($now:tt)+]) => {
        $crate::store::inbox::Stmt {
            sql: concat!(
                "UPDATE inbox_messages \
                 SET status = 'discarded', payload = NULL, next_attempt_at = NULL, processed_at = ",
                $($now)+,
                " WHERE consumer = $1 AND message_key = $2 AND status IN ('failed', 'dead')"
            ),
            binds: $crate::store::inbox::standard::KEY,
        }
    };
}
pub(crate) use discard;

/// Parked messages first delivered before `window_start` (the clock minus `$1` seconds), at
/// most `$2`.
macro_rules! expired_parked {
    (window_start: [$($start:tt)+]) => {
        $crate::store::inbox::Stmt {
            sql: concat!(
                "SELECT consumer, message_key, message_name, aggregate_id, sequence \
                 FROM inbox_messages WHERE status = 'parked' AND received_at < ",
                $($start)+,
                " ORDER BY consumer, aggregate_id, sequence LIMIT $2"
            ),
            binds: $crate::store::inbox::standard::WINDOW_LIMIT,
        }
    };
}
pub(crate) use expired_parked;

/// One bounded batch of rows settled before `cutoff` (of `$4` seconds), `lock` appended to the
/// row selection (`FOR UPDATE SKIP LOCKED`, where rows locked by a running transaction are to be
/// skipped).
macro_rules! purge {
    (cutoff: [$($cutoff:tt)+], lock: $lock:literal) => {
        $crate::store::inbox::Stmt {
            sql: concat!(
                "DELETE FROM inbox_messages WHERE (consumer, message_key) IN ( \
                 SELECT consumer, message_key FROM inbox_messages \
                 WHERE status IN ($1, $2, $3) AND COALESCE(processed_at, received_at) < ",
                $($cutoff)+,
                " LIMIT $5",
                $lock,
                ")"
            ),
            binds: $crate::store::inbox::standard::PURGE,
        }
    };
}
pub(crate) use purge;

/// One bounded batch of rejections received before `cutoff` (of `$1` seconds), oldest first.
macro_rules! purge_rejections {
    (cutoff: [$($cutoff:tt)+], lock: $lock:literal) => {
        $crate::store::inbox::Stmt {
            sql: concat!(
                "DELETE FROM inbox_rejections WHERE id IN ( \
                 SELECT id FROM inbox_rejections WHERE received_at < ",
                $($cutoff)+,
                " ORDER BY id LIMIT $2",
                $lock,
                ")"
            ),
            binds: $crate::store::inbox::standard::WINDOW_LIMIT,
        }
    };
}
pub(crate) use purge_rejections;

/// What [`purge!`] (with up to five statuses) and, when `$7`, [`purge_rejections!`] would
/// delete: `cutoff` of `$6` seconds; `oldest` reads the oldest time of a group as text.
macro_rules! purge_preview {
    (cutoff: [$($cutoff:tt)+], oldest: [$open:literal, $close:literal]) => {
        $crate::store::inbox::Stmt {
            sql: concat!(
                "SELECT consumer, status, COUNT(*), ",
                $open,
                "MIN(COALESCE(processed_at, received_at))",
                $close,
                " FROM inbox_messages WHERE status IN ($1, $2, $3, $4, $5) \
                 AND COALESCE(processed_at, received_at) < ",
                $($cutoff)+,
                " GROUP BY consumer, status \
                 UNION ALL \
                 SELECT consumer, 'rejected:' || reason, COUNT(*), ",
                $open,
                "MIN(received_at)",
                $close,
                " FROM inbox_rejections WHERE $7 AND received_at < ",
                $($cutoff)+,
                " GROUP BY consumer, reason ORDER BY 1 NULLS FIRST, 2"
            ),
            binds: $crate::store::inbox::standard::PURGE_PREVIEW,
        }
    };
}
pub(crate) use purge_preview;
