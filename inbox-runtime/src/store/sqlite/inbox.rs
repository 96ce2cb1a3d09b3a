//! The SQLite inbox: its statements and hooks (see
//! [`InboxDialect`]). Every process stamps rows with its own
//! clock, so the retention purge measures its window from the earlier of this process's clock
//! and the newest time written.

use sqlx::Sqlite;

use crate::store::inbox::{BatchClaim, ClaimShape, InboxDialect, Stmt, Write, standard};

/// Milliseconds until a `failed` row's next attempt is due, `NULL` if it is (or it is not
/// `failed`). Both times are stored to the millisecond, so the difference is a whole number of
/// milliseconds, at least 1 (the row's time lies after now); `julianday`'s double carries it
/// to within ~50 µs, so it is rounded to the nearest millisecond (truncating and adding 1, as
/// before, could read 1 ms more than the delay that was recorded).
macro_rules! retry_in_ms {
    () => {
        "CASE WHEN status = 'failed' \
           AND next_attempt_at > strftime('%Y-%m-%dT%H:%M:%fZ', 'now') \
         THEN CAST(ROUND((julianday(next_attempt_at) - julianday('now')) * 86400000.0) \
           AS INTEGER) \
         END"
    };
}

/// `processed_at` of a key taken over by the batch claim: the value its row would have had.
const TAKEOVER_PROCESSED_AT: &str = "excluded.processed_at";

/// The batch claim's takeover condition: a `failed` row that is due.
const BATCH_TAKEOVER: &str = "inbox_messages.status = 'failed' \
   AND (inbox_messages.next_attempt_at IS NULL \
     OR inbox_messages.next_attempt_at <= strftime('%Y-%m-%dT%H:%M:%fZ', 'now'))";

/// This process's clock, in the form SQLite rows are stamped with (it sorts as text).
macro_rules! now {
    () => {
        "strftime('%Y-%m-%dT%H:%M:%fZ', 'now')"
    };
}

/// The newest time any process wrote into the inbox tables: the latest settled time (or
/// first delivery) of each status, one seek each on `inbox_messages_status_age`, and the
/// received time of the latest rejection. NULL when both tables are empty.
macro_rules! newest {
    () => {
        "(SELECT max(t) FROM ( \
           SELECT max(COALESCE(processed_at, received_at)) AS t FROM inbox_messages \
             WHERE status = 'processed' \
           UNION ALL SELECT max(COALESCE(processed_at, received_at)) FROM inbox_messages \
             WHERE status = 'discarded' \
           UNION ALL SELECT max(COALESCE(processed_at, received_at)) FROM inbox_messages \
             WHERE status = 'stale' \
           UNION ALL SELECT max(COALESCE(processed_at, received_at)) FROM inbox_messages \
             WHERE status = 'failed' \
           UNION ALL SELECT max(COALESCE(processed_at, received_at)) FROM inbox_messages \
             WHERE status = 'dead' \
           UNION ALL SELECT max(COALESCE(processed_at, received_at)) FROM inbox_messages \
             WHERE status = 'parked' \
           UNION ALL SELECT received_at FROM \
             (SELECT received_at FROM inbox_rejections ORDER BY id DESC LIMIT 1)))"
    };
}

/// The purge's cutoff for a window of `$secs` seconds. On SQLite every process stamps rows
/// with its own clock, so the window is measured back from the *earlier* of this process's
/// clock and the newest time written into the inbox: a purging process whose clock is ahead
/// cannot reach rows that a process with a correct clock wrote within the window.
macro_rules! cutoff {
    ($secs:literal) => {
        concat!(
            "strftime('%Y-%m-%dT%H:%M:%fZ', min(",
            now!(),
            ", COALESCE(",
            newest!(),
            ", ",
            now!(),
            ")), printf('-%.3f seconds', ",
            $secs,
            "))"
        )
    };
}

impl InboxDialect for Sqlite {
    /// Takes the write lock up front: a deferred transaction that reads and then writes can
    /// fail with `SQLITE_BUSY` instead of waiting out the busy timeout. (Nested: a savepoint
    /// inside the caller's transaction.)
    const BEGIN: Option<&'static str> = Some("BEGIN IMMEDIATE");

    /// A handler cannot be trusted not to end the batch's transaction: an `OR ROLLBACK`
    /// conflict or a trigger's `RAISE(ROLLBACK)` ends it, and the statements after it would
    /// autocommit. SQLite savepoints cost no round trip.
    const OPTIMISTIC_BATCHES: bool = false;

    /// Every claim waits on the database's one write lock, whatever its key.
    const LOCAL_CLAIM_REGISTRY: bool = true;

    /// The claim: SQLite serializes writers and the transaction is opened with
    /// `BEGIN IMMEDIATE`, so nothing can commit the key between the statement and the read
    /// that follows it when it returns no row.
    const CLAIM: ClaimShape = ClaimShape::Returning(Stmt {
        sql: concat!(
            "INSERT INTO inbox_messages \
               (consumer, message_key, message_name, payload_hash, status, attempts, received_at, \
                processed_at, source, source_partition, source_offset) \
             VALUES ($1, $2, $3, $4, 'processed', 1, ",
            now!(),
            ", ",
            now!(),
            ", $5, $6, $7)",
            standard::claim_takeover!(
                now: [now!()],
                due: [
                    "inbox_messages.next_attempt_at IS NULL \
                     OR inbox_messages.next_attempt_at <= ",
                    now!()
                ]
            ),
            " RETURNING 'claimed', NULL, attempts, NULL"
        ),
        binds: standard::CLAIM,
    });

    const EXISTING: Stmt = standard::existing!(retry_in_ms: [retry_in_ms!()]);

    const EXISTING_BATCH: &'static str = standard::existing_batch!(retry_in_ms: [retry_in_ms!()]);

    /// A failed statement does not abort a SQLite transaction, and one that rolls it back makes
    /// `COMMIT` fail: nothing to verify.
    const VERIFY_CLAIM: Option<Stmt> = None;

    const RECORD_FAILURE: Write = standard::record_failure!(
        now: [now!()],
        next_attempt: ["strftime('%Y-%m-%dT%H:%M:%fZ', 'now', printf('%+.3f seconds', $8 / 1000.0))"]
    );

    /// The database clock, as the batch claim writes it.
    const BATCH_NOW: &'static str = now!();

    /// `processed_at` of a key claimed fresh by the batch claim: the clock.
    const BATCH_CLAIMED_PROCESSED_AT: &'static str = now!();

    const BATCH: BatchClaim = BatchClaim::Returning {
        takeover_processed_at: TAKEOVER_PROCESSED_AT,
        takeover: BATCH_TAKEOVER,
    };

    const FAIL_CLAIMED: Write = standard::fail_claimed!(
        next_attempt: ["strftime('%Y-%m-%dT%H:%M:%fZ', 'now', printf('%+.3f seconds', $6 / 1000.0))"]
    );

    const DISCARD: Stmt = standard::discard!(now: [now!()]);

    /// One bounded batch of rows settled before the cutoff.
    const PURGE: Stmt = standard::purge!(cutoff: [cutoff!("$4")], lock: "");

    /// One bounded batch of rejections received before the cutoff, oldest first.
    const PURGE_REJECTIONS: Stmt = standard::purge_rejections!(cutoff: [cutoff!("$1")], lock: "");

    /// This process's clock, the cutoff for a window of `$1` seconds, the newest time written
    /// into the inbox, and how many seconds that lies ahead of this process's clock.
    const PURGE_CLOCK: Stmt = Stmt {
        sql: concat!(
            "SELECT ",
            now!(),
            ", ",
            cutoff!("$1"),
            ", n.newest, (julianday(n.newest) - julianday('now')) * 86400.0 FROM (SELECT ",
            newest!(),
            " AS newest) AS n"
        ),
        binds: standard::WINDOW,
    };

    const PURGE_PREVIEW: Stmt = standard::purge_preview!(cutoff: [cutoff!("$6")], oldest: ["", ""]);

    const EXPIRED_PARKED: Stmt = standard::expired_parked!(
        window_start: ["strftime('%Y-%m-%dT%H:%M:%fZ', 'now', printf('-%.3f seconds', $1))"]
    );
}
