//! The MySQL/MariaDB inbox: its statements and hooks (see
//! [`InboxDialect`]); how its claim works on InnoDB is told
//! in [the backend's documentation](super).

use sqlx::{MySql, MySqlConnection};

use crate::BoxFuture;
use crate::store::inbox::Param::*;
use crate::store::inbox::{
    BatchClaim, ClaimShape, InboxDialect, Stmt, Write, claim, no_wait_outcome, standard,
};
use crate::store::{ClaimRequest, ClaimResult};

/// The database clock.
macro_rules! now {
    () => {
        "UTC_TIMESTAMP(6)"
    };
}

/// Milliseconds until a `failed` row's next attempt is due, `NULL` if it is (or it is not
/// `failed`). Rounded up, so that a due time in the future never reads as 0.
macro_rules! retry_in_ms {
    () => {
        "CASE WHEN status = 'failed' AND next_attempt_at > UTC_TIMESTAMP(6) \
         THEN CAST(CEIL(TIMESTAMPDIFF(MICROSECOND, UTC_TIMESTAMP(6), next_attempt_at) / 1000) \
         AS SIGNED) END"
    };
}

/// The columns of a [`StoredMessage`](crate::store::StoredMessage).
macro_rules! message_columns {
    () => {
        concat!(
            "CONVERT(consumer USING utf8mb4), CONVERT(message_key USING utf8mb4), message_name, \
             status, attempts, last_error, payload_hash, payload, ",
            text_time!("received_at"),
            ", ",
            text_time!("processed_at"),
            ", ",
            text_time!("next_attempt_at"),
            ", source, CONVERT(aggregate_id USING utf8mb4), sequence, result"
        )
    };
}

/// The rows a batch claimed, among its keys: the token and `AND (consumer, message_key)
/// IN (…)` follow.
const BATCH_CLAIMED: &str = "SELECT CONVERT(consumer USING utf8mb4), \
     CONVERT(message_key USING utf8mb4), attempts FROM inbox_messages \
     WHERE claim_token = ";

/// Marks the claim held by this transaction, for `VERIFY_CLAIM`. Binds: token.
const REMEMBER_CLAIM: &str = "SET @inbox_claim_token = ?";

/// A key's statements: the consumer, the key.
const KEY: &[crate::store::inbox::Param] = &[Consumer, Key];

impl InboxDialect for MySql {
    /// The claim's upsert (see the module's documentation). Binds: consumer, key, name, hash,
    /// source, partition, offset, token; then hash, mode, mode, mode, token (the takeover);
    /// then the token five times.
    /// The claim's locking read. Binds: token, consumer, key.
    const CLAIM: ClaimShape = ClaimShape::Stamped {
        upsert: Stmt {
            sql: concat!(
                "INSERT INTO inbox_messages \
                (consumer, message_key, message_name, payload_hash, status, attempts, received_at, \
                 processed_at, source, source_partition, source_offset, claim_token) \
              VALUES (?, ?, ?, ?, 'processed', 1, ",
                now!(),
                ", ",
                now!(),
                ", ?, ?, ?, ?) \
              ON DUPLICATE KEY UPDATE \
                claim_token = IF(payload_hash = ? AND ( \
                    (status = 'failed' AND (? <> 'deliver' OR next_attempt_at IS NULL \
             OR next_attempt_at <= UTC_TIMESTAMP(6))) \
                    OR (status = 'dead' AND ? = 'replay') \
                    OR (status = 'parked' AND ? IN ('resume', 'release'))), ?, claim_token), \
                status = IF(claim_token <=> ?, 'processed', status), \
                attempts = IF(claim_token <=> ?, attempts + 1, attempts), \
                processed_at = IF(claim_token <=> ?, UTC_TIMESTAMP(6), processed_at), \
                next_attempt_at = IF(claim_token <=> ?, NULL, next_attempt_at), \
                payload = IF(claim_token <=> ?, NULL, payload)"
            ),
            binds: &[
                Consumer, Key, Name, Hash, Source, Partition, Offset, Token, Hash, Mode, Mode,
                Mode, Token, Token, Token, Token, Token, Token,
            ],
        },
        read: Stmt {
            sql: concat!(
                "SELECT status, payload_hash, attempts, CAST(claim_token <=> ? AS SIGNED), ",
                retry_in_ms!(),
                " FROM inbox_messages WHERE consumer = ? AND message_key = ? FOR UPDATE"
            ),
            binds: &[Token, Consumer, Key],
        },
        remember: Stmt {
            sql: REMEMBER_CLAIM,
            binds: &[Token],
        },
    };

    /// A row's status, fingerprint, attempts, and the milliseconds until a `failed` row is due.
    const EXISTING: Stmt = Stmt {
        sql: concat!(
            "SELECT status, payload_hash, attempts, ",
            retry_in_ms!(),
            " FROM inbox_messages WHERE consumer = ? AND message_key = ?"
        ),
        binds: KEY,
    };

    /// `EXISTING` for many keys; `(consumer, message_key) IN (…)` follows.
    const EXISTING_BATCH: &'static str = concat!(
        "SELECT CONVERT(consumer USING utf8mb4), CONVERT(message_key USING utf8mb4), status, \
              payload_hash, attempts, ",
        retry_in_ms!(),
        " FROM inbox_messages WHERE (consumer, message_key) IN "
    );

    /// Finds the claim only while the transaction that made it is alive: InnoDB rolls a
    /// transaction back on a deadlock, and later statements then run in autocommit, so a
    /// handler that swallowed the error would otherwise "commit" without the claim.
    const VERIFY_CLAIM: Option<Stmt> = Some(Stmt {
        sql: "SELECT 1 FROM inbox_messages \
              WHERE consumer = ? AND message_key = ? AND claim_token <=> @inbox_claim_token",
        binds: KEY,
    });

    const CLAIM_GONE: &'static str =
        "the claim is gone from the handler's transaction (rolled back by InnoDB?)";

    /// A failed attempt: a first failure inserts the row; a later one (same payload, still
    /// `failed`, `dead` or `parked`) counts another attempt. Binds: consumer, key, name, hash,
    /// permanent, max_attempts, last_error, delay (µs), payload, source, partition, offset,
    /// aggregate, sequence, token; then hash, token; token, permanent, max_attempts; token;
    /// token, last_error; token, delay (µs); token, payload.
    /// The row a statement of ours stamped with `token`. Binds: token, consumer, key.
    const RECORD_FAILURE: Write = Write::Stamped {
        write: Stmt {
            sql: "INSERT INTO inbox_messages \
              (consumer, message_key, message_name, payload_hash, status, attempts, last_error, \
               next_attempt_at, payload, received_at, source, source_partition, source_offset, \
               aggregate_id, sequence, claim_token) \
            VALUES (?, ?, ?, ?, IF(? OR ? <= 1, 'dead', 'failed'), 1, ?, \
               DATE_ADD(UTC_TIMESTAMP(6), INTERVAL ? MICROSECOND), ?, UTC_TIMESTAMP(6), ?, ?, ?, \
               ?, ?, ?) \
            ON DUPLICATE KEY UPDATE \
              claim_token = IF(payload_hash = ? AND status IN ('failed', 'dead', 'parked'), ?, \
                claim_token), \
              status = IF(claim_token <=> ?, IF(? OR attempts + 1 >= ?, 'dead', 'failed'), status), \
              attempts = IF(claim_token <=> ?, attempts + 1, attempts), \
              last_error = IF(claim_token <=> ?, ?, last_error), \
              next_attempt_at = IF(claim_token <=> ?, \
                DATE_ADD(UTC_TIMESTAMP(6), INTERVAL ? MICROSECOND), next_attempt_at), \
              payload = IF(claim_token <=> ?, ?, payload)",
            binds: &[
                Consumer, Key, Name, Hash, Permanent, MaxTries, LastError, DelayUs, Payload,
                Source, Partition, Offset, Aggregate, Sequence, Token, Hash, Token, Token,
                Permanent, MaxTries, Token, Token, LastError, Token, DelayUs, Token, Payload,
            ],
        },
        read: Stmt {
            sql: "SELECT status, attempts, CAST(claim_token <=> ? AS SIGNED) \
              FROM inbox_messages WHERE consumer = ? AND message_key = ?",
            binds: &[Token, Consumer, Key],
        },
    };

    const RECORD_REJECTION: Stmt = Stmt {
        sql: "INSERT INTO inbox_rejections \
              (consumer, message_key, message_name, reason, detail, payload_hash, payload, \
               source, source_partition, source_offset, payload_size, received_at) \
              VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, UTC_TIMESTAMP(6))",
        binds: standard::RECORD_REJECTION.binds,
    };

    /// The batch claim's `INSERT`, before its `VALUES`: each row carries the batch's token.
    const BATCH_INSERT: &'static str = "INSERT INTO inbox_messages (consumer, message_key, message_name, \
              payload_hash, status, attempts, received_at, processed_at, source, source_partition, \
              source_offset, claim_token) ";

    const BATCH_NOW: &'static str = now!();

    const BATCH_CLAIMED_PROCESSED_AT: &'static str = now!();

    /// The batch claim's `ON DUPLICATE KEY UPDATE`: takes over a `failed` row with the same
    /// fingerprint that is due. Binds: the token six times. `VALUES(payload_hash)` is each
    /// row's own fingerprint (deprecated since MySQL 8.0.20, still supported by MySQL 8 and 9;
    /// MariaDB has no row alias syntax, so it is the form both accept).
    const BATCH: BatchClaim = BatchClaim::Stamped {
        update: Stmt {
            sql: " ON DUPLICATE KEY UPDATE \
              claim_token = IF(payload_hash = VALUES(payload_hash) AND status = 'failed' \
                AND (next_attempt_at IS NULL OR next_attempt_at <= UTC_TIMESTAMP(6)), ?, claim_token), \
              status = IF(claim_token <=> ?, 'processed', status), \
              attempts = IF(claim_token <=> ?, attempts + 1, attempts), \
              processed_at = IF(claim_token <=> ?, UTC_TIMESTAMP(6), processed_at), \
              next_attempt_at = IF(claim_token <=> ?, NULL, next_attempt_at), \
              payload = IF(claim_token <=> ?, NULL, payload)",
            binds: &[Token, Token, Token, Token, Token, Token],
        },
        read: BATCH_CLAIMED,
        remember: Stmt {
            sql: REMEMBER_CLAIM,
            binds: &[Token],
        },
    };

    /// A key claimed fresh in this transaction has `attempts = 1`.
    const UNCLAIM_FRESH: Stmt = Stmt {
        sql: "DELETE FROM inbox_messages \
              WHERE consumer = ? AND message_key = ? AND status = 'processed' AND attempts = 1",
        binds: KEY,
    };

    /// A `failed` key taken over in this transaction counted one more attempt and dropped its
    /// payload. Binds: payload, consumer, key.
    const UNCLAIM_TAKEN_OVER: Stmt = Stmt {
        sql: "UPDATE inbox_messages \
              SET status = 'failed', attempts = attempts - 1, processed_at = NULL, payload = ? \
              WHERE consumer = ? AND message_key = ? AND status = 'processed' AND attempts > 1",
        binds: &[Payload, Consumer, Key],
    };

    /// Turns a row claimed in this (batch) transaction into a failed attempt, after the
    /// handler's savepoint was rolled back; `attempts` already counts this attempt. Binds:
    /// permanent, max_attempts, last_error, delay (µs), payload, consumer, key.
    const FAIL_CLAIMED: Write = Write::ReadBack {
        write: Stmt {
            sql: "UPDATE inbox_messages SET \
              status = IF(? OR attempts >= ?, 'dead', 'failed'), last_error = ?, \
              next_attempt_at = DATE_ADD(UTC_TIMESTAMP(6), INTERVAL ? MICROSECOND), payload = ?, \
              processed_at = NULL \
            WHERE consumer = ? AND message_key = ?",
            binds: &[
                Permanent, MaxTries, LastError, DelayUs, Payload, Consumer, Key,
            ],
        },
        read: Stmt {
            sql: "SELECT status, attempts FROM inbox_messages WHERE consumer = ? AND message_key = ?",
            binds: KEY,
        },
    };

    const STORE_RESULT: Stmt = Stmt {
        sql: "UPDATE inbox_messages SET result = ? WHERE consumer = ? AND message_key = ?",
        binds: &[ResultBytes, Consumer, Key],
    };

    const FETCH_RESULT: Stmt = Stmt {
        sql: "SELECT result FROM inbox_messages WHERE consumer = ? AND message_key = ?",
        binds: KEY,
    };

    const MESSAGE_COLUMNS: &'static str = message_columns!();

    const FETCH: Stmt = Stmt {
        sql: concat!(
            "SELECT ",
            message_columns!(),
            " FROM inbox_messages WHERE consumer = ? AND message_key = ?"
        ),
        binds: KEY,
    };

    const DISCARD: Stmt = Stmt {
        sql: "UPDATE inbox_messages \
              SET status = 'discarded', payload = NULL, next_attempt_at = NULL, \
              processed_at = UTC_TIMESTAMP(6) \
              WHERE consumer = ? AND message_key = ? AND status IN ('failed', 'dead')",
        binds: KEY,
    };

    const STATS: &'static str = concat!(
        "SELECT CONVERT(consumer USING utf8mb4) AS c, status AS s, COUNT(*), ",
        text_time!("MIN(received_at)"),
        " FROM inbox_messages GROUP BY status, consumer \
              UNION ALL \
              SELECT consumer, CONCAT('rejected:', reason), COUNT(*), ",
        text_time!("MIN(received_at)"),
        " FROM inbox_rejections GROUP BY consumer, reason \
              ORDER BY 1, 2"
    );

    /// One bounded batch of rows settled before the window, oldest first (on
    /// `inbox_messages_status_age`).
    const PURGE: Stmt = Stmt {
        sql: concat!(
            "DELETE FROM inbox_messages WHERE status IN (?, ?, ?) AND settled_at < ",
            window_start!(),
            " ORDER BY settled_at LIMIT ?"
        ),
        binds: standard::PURGE,
    };

    /// One bounded batch of rejections received before the window, oldest first.
    const PURGE_REJECTIONS: Stmt = Stmt {
        sql: concat!(
            "DELETE FROM inbox_rejections WHERE received_at < ",
            window_start!(),
            " ORDER BY id LIMIT ?"
        ),
        binds: standard::WINDOW_LIMIT,
    };

    /// The purge's clock: one clock, the server's, stamps every row.
    const PURGE_CLOCK: Stmt = Stmt {
        sql: concat!(
            "SELECT ",
            text_time!("UTC_TIMESTAMP(6)"),
            ", DATE_FORMAT(",
            window_start!(),
            ", '%Y-%m-%d %H:%i:%s.%f'), NULL, NULL"
        ),
        binds: standard::WINDOW,
    };

    /// What `PURGE` (with up to five statuses) and, when asked, `PURGE_REJECTIONS` would
    /// delete. Binds: five statuses, window, rejections, window.
    const PURGE_PREVIEW: Stmt = Stmt {
        sql: concat!(
            "SELECT CONVERT(consumer USING utf8mb4), status, COUNT(*), ",
            text_time!("MIN(settled_at)"),
            " FROM inbox_messages WHERE status IN (?, ?, ?, ?, ?) AND settled_at < ",
            window_start!(),
            " GROUP BY consumer, status \
              UNION ALL \
              SELECT consumer, CONCAT('rejected:', reason), COUNT(*), ",
            text_time!("MIN(received_at)"),
            " FROM inbox_rejections WHERE ? AND received_at < ",
            window_start!(),
            " GROUP BY consumer, reason ORDER BY 1, 2"
        ),
        binds: &[
            Status1, Status2, Status3, Status4, Status5, Window, Rejections, Window,
        ],
    };

    /// Creates the aggregate's state row at 0, or locks the existing one (the duplicate check
    /// takes an exclusive lock). Binds: consumer, aggregate.
    const LOCK_AGGREGATE: Write = Write::ReadBack {
        write: Stmt {
            sql: "INSERT INTO inbox_aggregate_state \
              (consumer, aggregate_id, last_sequence) VALUES (?, ?, 0) \
              ON DUPLICATE KEY UPDATE last_sequence = last_sequence",
            binds: &[Consumer, Aggregate],
        },
        read: Stmt {
            sql: "SELECT last_sequence FROM inbox_aggregate_state \
              WHERE consumer = ? AND aggregate_id = ? FOR UPDATE",
            binds: &[Consumer, Aggregate],
        },
    };

    const ADVANCE_AGGREGATE: Stmt = Stmt {
        sql: "UPDATE inbox_aggregate_state \
              SET last_sequence = ? WHERE consumer = ? AND aggregate_id = ?",
        binds: &[Sequence, Consumer, Aggregate],
    };

    /// A parked row is not settled: it loses the `processed_at` its claim gave it. Binds:
    /// status, aggregate, sequence, payload, status, consumer, key.
    const MARK_MESSAGE: Stmt = Stmt {
        sql: "UPDATE inbox_messages \
              SET status = ?, aggregate_id = ?, sequence = ?, payload = ?, \
              processed_at = IF(? = 'parked', NULL, processed_at) \
              WHERE consumer = ? AND message_key = ?",
        binds: &[
            NewStatus, Aggregate, Sequence, Payload, NewStatus, Consumer, Key,
        ],
    };

    const FIND_PARKED: Stmt = Stmt {
        sql: "SELECT CONVERT(consumer USING utf8mb4), \
              CONVERT(message_key USING utf8mb4), message_name, CONVERT(aggregate_id USING utf8mb4), \
              sequence FROM inbox_messages \
              WHERE consumer = ? AND aggregate_id = ? AND sequence = ? \
              AND status IN ('parked', 'failed') LIMIT 1",
        binds: &[Consumer, Aggregate, Sequence],
    };

    const EXPIRED_PARKED: Stmt = Stmt {
        sql: concat!(
            "SELECT CONVERT(consumer USING utf8mb4), CONVERT(message_key USING utf8mb4), \
              message_name, CONVERT(aggregate_id USING utf8mb4), sequence FROM inbox_messages \
              WHERE status = 'parked' AND received_at < ",
            window_start!(),
            " ORDER BY consumer, aggregate_id, sequence LIMIT ?"
        ),
        binds: standard::WINDOW_LIMIT,
    };

    /// Binds: reason, consumer, key.
    const DEAD_LETTER_PARKED: Stmt = Stmt {
        sql: "UPDATE inbox_messages \
              SET status = 'dead', last_error = ? \
              WHERE consumer = ? AND message_key = ? AND status = 'parked'",
        binds: &[Reason, Consumer, Key],
    };

    /// The claim with `innodb_lock_wait_timeout` at its minimum (1 second on MySQL; MariaDB
    /// takes 0, no wait at all, but 1 works on both) for the claim's statements; a lock wait
    /// timeout (1205) means another transaction holds the key. The session's setting is
    /// restored whatever the claim's outcome.
    fn claim_no_wait<'c>(
        conn: &'c mut MySqlConnection,
        request: &'c ClaimRequest<'c>,
    ) -> BoxFuture<'c, Result<Option<ClaimResult>, sqlx::Error>> {
        Box::pin(async move {
            let previous: i64 =
                sqlx::query_scalar("SELECT CAST(@@SESSION.innodb_lock_wait_timeout AS SIGNED)")
                    .fetch_one(&mut *conn)
                    .await?;
            sqlx::raw_sql("SET SESSION innodb_lock_wait_timeout = 1")
                .execute(&mut *conn)
                .await?;
            let found = claim::<MySql>(conn, request, true).await;
            sqlx::query("SET SESSION innodb_lock_wait_timeout = ?")
                .bind(previous)
                .execute(&mut *conn)
                .await?;
            no_wait_outcome::<MySql>(found)
        })
    }
}
