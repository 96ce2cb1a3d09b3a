//! The PostgreSQL inbox: its statements and hooks (see
//! [`InboxDialect`]).

use std::time::Duration;

use futures_util::StreamExt as _;
use sqlx::{Either, PgConnection, Postgres};

use crate::BoxFuture;
use crate::store::inbox::{
    BatchClaim, ClaimShape, InboxDialect, Stmt, Write, claim, no_wait_outcome, standard,
};
use crate::store::{ClaimRequest, ClaimResult};
use crate::types::error::StoreOperation;

/// A `failed` row's next attempt is due (on the database clock).
macro_rules! due {
    () => {
        "(inbox_messages.next_attempt_at IS NULL OR inbox_messages.next_attempt_at <= now())"
    };
}

/// Milliseconds until a `failed` row's next attempt is due, `NULL` if it is (or it is not
/// `failed`).
macro_rules! retry_in_ms {
    () => {
        "CASE WHEN status = 'failed' AND next_attempt_at > now() \
         THEN CEIL(EXTRACT(EPOCH FROM (next_attempt_at - now())) * 1000)::bigint END"
    };
}

/// Sets the claim's mark: `inbox.claim`, a setting local to the transaction (gone with its
/// `COMMIT` or `ROLLBACK`, or a `ROLLBACK TO` a savepoint older than the claim). The claim
/// statements set it in the same statement, for no extra round trip.
macro_rules! set_mark {
    () => {
        "set_config('inbox.claim', '1', true)"
    };
}

/// What the check of the claim's mark says when the mark is gone (the text of its error, as
/// `has_mark!` writes it).
#[cfg(test)]
const MARK_GONE: &str = "inbox: the claim is gone from its transaction: \
     the handler ended it (a COMMIT or ROLLBACK of its own?)";

/// 1 if the transaction holds its claim's mark; else an error (SQLSTATE 22P02, whose message
/// quotes `MARK_GONE`), which stops a multi-statement query before its `COMMIT`. The failing
/// branch depends on the setting, so it is never evaluated while planning.
macro_rules! has_mark {
    () => {
        "CASE WHEN current_setting('inbox.claim', true) = '1' THEN 1 \
         ELSE ('inbox: the claim is gone from its transaction: \
         the handler ended it (a COMMIT or ROLLBACK of its own?)' \
         || coalesce(current_setting('inbox.claim', true), ''))::int END"
    };
}

/// [`InboxConnection::verify_commit_begin`](crate::InboxConnection::verify_commit_begin): one
/// simple query (no user data in it), run in one round trip, stopped by the first statement
/// that fails.
const VERIFY_COMMIT_BEGIN: &str = concat!("SELECT ", has_mark!(), "; COMMIT; BEGIN");

/// [`InboxConnection::rollback_begin`](crate::InboxConnection::rollback_begin): one simple
/// query, one round trip.
const ROLLBACK_BEGIN: &str = "ROLLBACK; BEGIN";

/// No-wait claims: the `lock_timeout` set for the claim (returning the previous one).
const NO_WAIT: &str =
    "SELECT current_setting('lock_timeout') AS previous, set_config('lock_timeout', $1, true)";

/// Sets `lock_timeout` for the rest of the transaction: after a no-wait claim, back to the
/// previous one; for a batch, its lock timeout.
const SET_LOCK_TIMEOUT: &str = "SELECT set_config('lock_timeout', $1, true)";

/// `processed_at` of a key taken over by the batch claim.
const TAKEOVER_PROCESSED_AT: &str = "now()";

/// The batch claim's takeover condition: a `failed` row that is due.
const BATCH_TAKEOVER: &str = concat!("inbox_messages.status = 'failed' AND ", due!());

impl InboxDialect for Postgres {
    const OPTIMISTIC_BATCHES: bool = true;
    const CHAINED_TRANSACTIONS: bool = true;

    const DIGEST_HASHES: bool = true;

    /// The claim, in one round trip. The INSERT is the transaction's first statement and never
    /// raises a unique violation (which would abort a PostgreSQL transaction): a free key is
    /// inserted (`processed_at` left NULL: see `BATCH_CLAIMED_PROCESSED_AT`); a `failed` key
    /// with the same fingerprint (or a `dead` one, on replay) is taken over, its row locked; any
    /// other row is left alone and read back by the second branch. When another transaction
    /// holds an uncommitted claim on the key, the INSERT waits for it. A claimed row sets the
    /// claim's mark (`set_mark!`) for the verify before `COMMIT`.
    const CLAIM: ClaimShape = ClaimShape::Returning(Stmt {
        sql: concat!(
            "WITH claim AS ( \
              INSERT INTO inbox_messages \
                (consumer, message_key, message_name, payload_hash, status, attempts, received_at, \
                 source, source_partition, source_offset) \
              VALUES ($1, $2, $3, $4, 'processed', 1, now(), $5, $6, $7)",
            standard::claim_takeover!(now: ["now()"], due: [due!()]),
            " RETURNING attempts) \
            SELECT 'claimed' AS status, NULL::bytea AS payload_hash, attempts, \
              NULL::bigint AS retry_in_ms FROM claim \
              WHERE ",
            set_mark!(),
            " = '1' \
            UNION ALL \
            SELECT status, payload_hash, attempts, ",
            retry_in_ms!(),
            " FROM inbox_messages \
            WHERE consumer = $1 AND message_key = $2 AND NOT EXISTS (SELECT 1 FROM claim)"
        ),
        binds: standard::CLAIM,
    });

    const EXISTING: Stmt = standard::existing!(retry_in_ms: [retry_in_ms!()]);

    const EXISTING_BATCH: &'static str = standard::existing_batch!(retry_in_ms: [retry_in_ms!()]);

    /// Fails with SQLSTATE 25P02 if the transaction was left aborted, and with 22P02 (the
    /// message quotes `MARK_GONE`) if the transaction is not the one that claimed: the handler
    /// ended it with a `COMMIT` or `ROLLBACK` of its own (the claim's mark, `set_mark!`, is
    /// gone; the mark is the transaction's, so the key's values only name the claim). For a
    /// claim in a savepoint (a connection already inside a transaction) and on the caller's own
    /// connection; otherwise `VERIFY_COMMIT_BEGIN` checks the mark in the round trip of its
    /// `COMMIT`.
    const VERIFY_CLAIM: Option<Stmt> = Some(Stmt {
        sql: concat!(
            "SELECT ",
            has_mark!(),
            " FROM (SELECT $1::text AS consumer, $2::text AS message_key) AS claim"
        ),
        binds: standard::KEY,
    });

    /// The claimed rows mark the transaction (see `set_mark!`).
    const BATCH_CLAIM_MARK: &'static str = concat!(", ", set_mark!());

    const RECORD_FAILURE: Write = standard::record_failure!(
        now: ["now()"],
        next_attempt: ["now() + $8 * interval '1 millisecond'"]
    );

    /// The database clock, as the batch claim writes it.
    const BATCH_NOW: &'static str = "now()";

    /// `processed_at` of a key claimed fresh: not written (NULL), since it would equal
    /// `received_at` (both `now()`); readers take `received_at` for a settled row without one.
    const BATCH_CLAIMED_PROCESSED_AT: &'static str = "NULL";

    const BATCH: BatchClaim = BatchClaim::Returning {
        takeover_processed_at: TAKEOVER_PROCESSED_AT,
        takeover: BATCH_TAKEOVER,
    };

    /// The next attempt is timed from the failure (`clock_timestamp()`), not from the start of
    /// the batch transaction (`now()`), which may have run for longer than the delay.
    const FAIL_CLAIMED: Write = standard::fail_claimed!(
        next_attempt: ["clock_timestamp() + $6 * interval '1 millisecond'"]
    );

    const DISCARD: Stmt = standard::discard!(now: ["now()"]);

    /// Rows locked by a running transaction are skipped, not waited for.
    const PURGE: Stmt = standard::purge!(
        cutoff: ["now() - $4 * interval '1 second'"],
        lock: " FOR UPDATE SKIP LOCKED"
    );

    const PURGE_REJECTIONS: Stmt = standard::purge_rejections!(
        cutoff: ["now() - $1 * interval '1 second'"],
        lock: " FOR UPDATE SKIP LOCKED"
    );

    /// The purge's clock: one clock, the server's, stamps every row, so there is no newest
    /// write to compare with (`NULL`s).
    const PURGE_CLOCK: Stmt = Stmt {
        sql: "SELECT CAST(now() AS TEXT), \
              CAST(now() - $1 * interval '1 second' AS TEXT), CAST(NULL AS TEXT), \
              CAST(NULL AS DOUBLE PRECISION)",
        binds: standard::WINDOW,
    };

    const PURGE_PREVIEW: Stmt = standard::purge_preview!(
        cutoff: ["now() - $6 * interval '1 second'"],
        oldest: ["CAST(", " AS TEXT)"]
    );

    const EXPIRED_PARKED: Stmt =
        standard::expired_parked!(window_start: ["now() - $1 * interval '1 second'"]);

    /// `VERIFY_COMMIT_BEGIN`, its statements' completions counted. An error before the check
    /// completed is a [`StoreOperation::Verify`] failure, nothing committed: an aborted
    /// transaction (`25P02`), one without the claim's mark (ended by the handler: `22P02`,
    /// quoting `MARK_GONE`), a connection lost before. An error after the check and before
    /// `COMMIT` completed is the `COMMIT`'s ([`StoreOperation::Commit`]): a deferred constraint
    /// or a serialization failure (rolled back), a lost connection (unknown). An error after
    /// `COMMIT` completed (the connection terminated before the `BEGIN`, as
    /// `pg_terminate_backend` does once a commit it interrupted is done) is no failure: the
    /// transaction committed, and the connection's next statement finds it gone.
    fn verify_commit_begin(
        conn: &mut PgConnection,
    ) -> Option<BoxFuture<'_, Result<(), (StoreOperation, sqlx::Error)>>> {
        Some(Box::pin(async move {
            let mut completed = 0;
            let mut results = sqlx::raw_sql(VERIFY_COMMIT_BEGIN).fetch_many(conn);
            while let Some(result) = results.next().await {
                match result {
                    Ok(Either::Left(_)) => completed += 1,
                    Ok(Either::Right(_)) => {}
                    Err(error) => {
                        return match completed {
                            0 => Err((StoreOperation::Verify, error)),
                            1 => Err((StoreOperation::Commit, error)),
                            _ => Ok(()),
                        };
                    }
                }
            }
            Ok(())
        }))
    }

    /// `ROLLBACK_BEGIN`.
    fn rollback_begin(conn: &mut PgConnection) -> Option<BoxFuture<'_, Result<(), sqlx::Error>>> {
        Some(Box::pin(async move {
            sqlx::raw_sql(ROLLBACK_BEGIN).execute(conn).await?;
            Ok(())
        }))
    }

    /// `lock_timeout` for the rest of the transaction (`SET LOCAL`), in whole milliseconds.
    fn set_lock_timeout(
        conn: &mut PgConnection,
        timeout: Duration,
    ) -> BoxFuture<'_, Result<(), sqlx::Error>> {
        Box::pin(async move {
            let millis = timeout.as_millis().clamp(1, i32::MAX as u128).to_string();
            sqlx::query(SET_LOCK_TIMEOUT)
                .bind(format!("{millis}ms"))
                .execute(conn)
                .await?;
            Ok(())
        })
    }

    /// The claim with a `lock_timeout` of [`crate::Wait::NO_WAIT_GRACE`]: SQLSTATE 55P03 means
    /// another transaction holds the key (the transaction is then aborted: the caller rolls it
    /// back, so the setting is restored only after a claim that returned).
    fn claim_no_wait<'c>(
        conn: &'c mut PgConnection,
        request: &'c ClaimRequest<'c>,
    ) -> BoxFuture<'c, Result<Option<ClaimResult>, sqlx::Error>> {
        Box::pin(async move {
            let grace = format!("{}ms", crate::Wait::NO_WAIT_GRACE.as_millis());
            let previous: String = sqlx::query_scalar(NO_WAIT)
                .bind(grace)
                .fetch_one(&mut *conn)
                .await?;
            let found = claim::<Postgres>(conn, request, false).await;
            if found.is_ok() {
                sqlx::query(SET_LOCK_TIMEOUT)
                    .bind(previous)
                    .execute(&mut *conn)
                    .await?;
            }
            no_wait_outcome::<Postgres>(found)
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_mark_check_quotes_its_error_text() {
        assert!(VERIFY_COMMIT_BEGIN.contains(MARK_GONE));
        let Some(verify) = <Postgres as InboxDialect>::VERIFY_CLAIM else {
            panic!("PostgreSQL verifies its claims");
        };
        assert!(verify.sql.contains(MARK_GONE));
    }
}
