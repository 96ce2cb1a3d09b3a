//! The outbox on MySQL/MariaDB: the [`OutboxDialect`] (`?` parameters, bound in order of
//! appearance; statements with lists of ids built at run time with one `?` per id: primary-key
//! lookups, so they lock the rows they name and nothing else), with the outbox component's
//! migrations.
//!
//! InnoDB has neither a transaction horizon nor one writer. AUTO_INCREMENT ids
//! are allocated at insert and transactions commit out of id order, so the rule is per
//! aggregate, and rests on the writers:
//! 1. *Writers of one aggregate take turns.* The enqueue
//!    ([`OutboxStore::enqueue_outbox`](crate::store::OutboxStore::enqueue_outbox)) first upserts
//!    the aggregate's row in `inbox_outbox_aggregates` (`INSERT … ON DUPLICATE KEY UPDATE`, keyed
//!    by the SHA-256 of the aggregate id), which locks it until the writing transaction ends,
//!    and only then inserts the outbox row (allocating its id). A second writer of the
//!    aggregate waits on the lock row until the first commits or rolls back, and allocates its
//!    ids after that. So whenever a row of an aggregate exists (committed or not), every
//!    lower-id row of the aggregate is final: committed, or rolled back and gone; and an
//!    aggregate's ids follow the order its writers took the lock. (Outside a transaction the
//!    two statements run in one of the store's own. "Outside" is asked of the server when
//!    sqlx counts no transaction: one begun with a raw `BEGIN` is the caller's too, and a
//!    `BEGIN` of the store's would commit it implicitly.) Rows without an aggregate take no lock
//!    row and promise no order among themselves: each is eligible once it is committed.
//! 2. *The relay decides from one snapshot, then locks by primary key.* The lease runs in a
//!    transaction of its own: consistent (non-locking) reads pick the candidates: `pending`,
//!    due, not under a running lease, and without an earlier `pending` or `dead` row of the
//!    aggregate, all as of one snapshot (REPEATABLE READ: the transaction's, taken at its
//!    first read; READ COMMITTED: each statement's). A candidate visible in the snapshot was
//!    committed before it, so by 1. every earlier row of its aggregate is in the snapshot in
//!    a final state: the per-aggregate check cannot miss a row still being written. Then
//!    `SELECT … WHERE id IN (…) … FOR UPDATE SKIP LOCKED` locks the candidates that are still
//!    leasable at their latest committed version (a row another relay is leasing or marking is
//!    skipped, one it leased meanwhile fails the re-check), and an `UPDATE … WHERE id IN (…)`
//!    leases them. Rows are chosen by status, never by an "id > last seen" cursor, so a row
//!    committed late is found by the next lease.
//!
//! Locks, under REPEATABLE READ (InnoDB's default) and READ COMMITTED alike: the writer's
//! upsert takes an exclusive lock on the aggregate's lock-row record (a new row: an
//! insert-intention lock on its gap, then the record; an existing one: the duplicate check's
//! exclusive next-key lock, gap locks included even in READ COMMITTED), held until the writer
//! ends; the outbox insert takes insert-intention locks and the new row's record lock (and a
//! shared lock on the existing entry when the message id is a duplicate). The relay's
//! consistent reads take no locks; its `FOR UPDATE SKIP LOCKED`, `UPDATE`s, marks, retries
//! and discards look rows up by primary key or by message id (a unique index): record locks
//! on the rows they name (REPEATABLE READ adds a gap lock only where a named row no longer
//! exists). The purges delete `sent` rows through the `(status, sent_at)` index: next-key
//! locks on that range under REPEATABLE READ (so a change-data-capture insert, written `sent`,
//! may wait for a purge, or a purge for it), record locks under READ COMMITTED. Apart from
//! that, no relay statement waits for a writer nor a writer for a relay: writers lock only
//! their own new rows and the lock rows, which relays never touch, and relays lock only rows
//! they read as committed. SERIALIZABLE (where plain reads lock) is not supported.
//!
//! A deadlock (1213) or lock wait timeout (1205) in a statement the store runs on its own
//! (every [`OutboxStore`](crate::store::OutboxStore) and
//! [`OutboxAdminStore`](crate::store::OutboxAdminStore) method, and the enqueue outside a
//! transaction) is retried internally, as the inbox's are, and counted in
//! [`mysql_lock_retries`](crate::store::mysql_lock_retries). In the caller's transaction the
//! enqueue returns them (transient: see [`crate::Classify`]); a transaction that publishes to
//! several aggregates takes their lock rows in the order it publishes, so two that publish to the
//! same aggregates in opposite orders can deadlock (and are retried as a whole by the protocol). A
//! duplicate message id fails only the insert (MySQL rolls back the statement, not the
//! transaction): the enqueue answers `Ok(false)`. The retention purges
//! ([`OutboxStore::purge_outbox_sent`](crate::store::OutboxStore::purge_outbox_sent),
//! [`OutboxAdminStore::purge_outbox_before`](crate::store::OutboxAdminStore::purge_outbox_before))
//! also delete the lock rows of aggregates not written to since their cutoff (skipping those a
//! writer holds): a lock row only makes concurrent writers take turns, and the next writer of the
//! aggregate creates it again (writers queued behind the purge's delete re-create it one at a time:
//! `tests/mysql_outbox.rs`).
//!
//! Limits: an aggregate's writers run one at a time for as long as each transaction lasts;
//! the order rests on one primary's locks and `AUTO_INCREMENT` (not Galera or other
//! multi-primary setups); a row must fit the server's `max_allowed_packet` (a larger one fails
//! the publish with 1153, never truncated); leases and retry delays are capped at 100 years
//! (`DATE_ADD` past the year 9999 fails or answers NULL, which would read as "not leased").

use sqlx::{MySql, MySqlConnection, QueryBuilder};

use super::error_number;
use crate::store::outbox::{
    self, Cutoff, Leased, Leasing, OutboxDialect, ids, leased_columns, record,
};
use crate::store::sql::{self, Arg, Done, Run, Scope, Scoped, Sql, Stmt, text};

/// The outbox component's migrations on MySQL/MariaDB.
pub(super) const MIGRATIONS: &[(i64, &str, &str)] = &outbox::migrations([
    include_str!("migrations/outbox/0001_outbox.sql"),
    include_str!("migrations/outbox/0002_outbox_leases.sql"),
    include_str!("migrations/outbox/0003_outbox_lease_tokens.sql"),
    include_str!("migrations/outbox/0004_outbox_trace_context.sql"),
]);

/// MySQL's error number of a duplicate key (`ER_DUP_ENTRY`): here, a message id already stored.
const ER_DUP_ENTRY: u16 = 1062;

/// The longest interval added to the clock, in microseconds: 100 years. A `DATETIME` ends with
/// the year 9999; past it `DATE_ADD` fails ("datetime field overflow", strict mode) or answers
/// NULL, which a lease would read as "not leased" (another relay takes the row at once) and a
/// retry delay as "due now".
const MAX_INTERVAL_US: i64 = 100 * 366 * 86_400 * 1_000_000;

/// A row's age in milliseconds on the database clock.
macro_rules! age {
    () => {
        "TIMESTAMPDIFF(MICROSECOND, created_at, UTC_TIMESTAMP(6)) DIV 1000"
    };
}

/// Whether a row may be leased (alias `o`), as of the reading statement's snapshot:
/// pending, due, not under a running lease (an orphan with attempts left may be: `?`, the
/// maximum attempts), without an earlier pending or dead row of its aggregate.
macro_rules! leasable {
    () => {
        "o.status = 'pending' \
         AND (o.next_attempt_at IS NULL OR o.next_attempt_at <= UTC_TIMESTAMP(6)) \
         AND (o.leased_until IS NULL \
              OR (o.leased_until <= UTC_TIMESTAMP(6) AND o.attempts < ?)) \
         AND (o.aggregate_hash IS NULL OR NOT EXISTS ( \
               SELECT 1 FROM inbox_outbox e \
               WHERE e.aggregate_hash = o.aggregate_hash AND e.id < o.id \
                 AND e.status IN ('pending', 'dead')))"
    };
}

/// Orphans out of attempts (a consistent read). Binds: the maximum attempts.
const ABANDONED: &str = "SELECT id FROM inbox_outbox \
   WHERE status = 'pending' AND leased_until <= UTC_TIMESTAMP(6) AND attempts >= ? \
   ORDER BY id";

/// Orphans that may be leased, fewest attempts first (a consistent read). Binds: the maximum
/// attempts, the limit.
const ORPHANS: &str = concat!(
    "SELECT o.id FROM inbox_outbox o WHERE o.leased_until IS NOT NULL AND ",
    leasable!(),
    " ORDER BY o.attempts, o.id LIMIT ?"
);

/// Rows never leased (or settled since) that may be leased, in id order (a consistent read).
/// Binds: the maximum attempts, the limit.
const FRESH: &str = concat!(
    "SELECT o.id FROM inbox_outbox o WHERE o.leased_until IS NULL AND ",
    leasable!(),
    " ORDER BY o.id LIMIT ?"
);

/// Locks the abandoned orphans among the ids, skipping rows another transaction holds. Binds
/// (after the ids): the maximum attempts.
const LOCK_ABANDONED: &str = "SELECT id FROM inbox_outbox WHERE id IN ({list}) \
   AND status = 'pending' AND leased_until <= UTC_TIMESTAMP(6) AND attempts >= {} \
   ORDER BY id FOR UPDATE SKIP LOCKED";

/// Dead-letters the locked orphans. Binds: the error, then the ids.
const ABANDON: &str = "UPDATE inbox_outbox SET status = 'dead', last_error = {}, \
   leased_until = NULL, next_attempt_at = NULL WHERE id IN ({list})";

/// Locks the candidates among the ids that are still leasable (their own state, re-read at
/// its latest committed version), skipping rows another transaction holds, in `$order`. Binds
/// (after the ids): the maximum attempts, the limit.
macro_rules! lock_leasable {
    ($order:literal) => {
        concat!(
            "SELECT id FROM inbox_outbox WHERE id IN ({list}) AND status = 'pending' \
             AND (next_attempt_at IS NULL OR next_attempt_at <= UTC_TIMESTAMP(6)) \
             AND (leased_until IS NULL OR (leased_until <= UTC_TIMESTAMP(6) AND attempts < {})) \
             ORDER BY ",
            $order,
            " LIMIT {} FOR UPDATE SKIP LOCKED"
        )
    };
}

/// [`lock_leasable`] for the one orphan leased alone.
const LOCK_ORPHAN: &str = lock_leasable!("attempts, id");

/// [`lock_leasable`] for fresh rows.
const LOCK_FRESH: &str = lock_leasable!("id");

/// Leases the locked rows. Binds: the lease in microseconds, the lease's token, then the ids.
const LEASE: &str = "UPDATE inbox_outbox SET attempts = attempts + 1, \
   leased_until = DATE_ADD(UTC_TIMESTAMP(6), INTERVAL {} MICROSECOND), lease_token = {} \
   WHERE id IN ({list})";

/// The [`leased_columns`] of rows by id.
const LEASED: &str = concat!(
    "SELECT ",
    leased_columns!("", age!()),
    " FROM inbox_outbox WHERE id IN ({list}) ORDER BY id"
);

/// Lock rows of aggregates not written since the cutoff (a window in seconds), at most `?` of
/// them, skipping those a writer holds.
const STALE_AGGREGATES: &str = concat!(
    "SELECT aggregate_hash FROM inbox_outbox_aggregates WHERE written_at < ",
    window_start!(),
    " ORDER BY written_at LIMIT ? FOR UPDATE SKIP LOCKED"
);

/// [`STALE_AGGREGATES`] with the cutoff as a time (text).
const STALE_AGGREGATES_BEFORE: &str = "SELECT aggregate_hash \
   FROM inbox_outbox_aggregates WHERE written_at < CAST(? AS DATETIME(6)) \
   ORDER BY written_at LIMIT ? FOR UPDATE SKIP LOCKED";

/// Deletes the lock rows picked.
const FORGET_AGGREGATES: &str =
    "DELETE FROM inbox_outbox_aggregates WHERE aggregate_hash IN ({list})";

/// The columns of an [`OutboxEntry`](crate::store::outbox::OutboxEntry), with `$payload` (or
/// `NULL`).
macro_rules! entry_columns_mysql {
    ($payload:literal) => {
        concat!(
            "id, message_id, destination, message_name, ",
            $payload,
            ", CAST(LENGTH(payload) AS SIGNED), headers, aggregate_id, CAST(NULL AS CHAR), ",
            text_time!("created_at"),
            ", status, attempts, ",
            text_time!("next_attempt_at"),
            ", ",
            text_time!("leased_until"),
            ", last_error, ",
            text_time!("sent_at")
        )
    };
}

/// Every write runs in autocommit or a transaction of its own, and is retried on a deadlock
/// (1213) or lock wait timeout (1205) like the inbox's statements (counted in
/// [`mysql_lock_retries`](crate::store::mysql_lock_retries)); the enqueue runs in the caller's
/// transaction if there is one, and returns them (transient: see [`crate::Classify`]).
impl OutboxDialect for MySql {
    /// Binds: message id, destination, name, payload, headers, aggregate, sent twice, then the
    /// trace context.
    const ENQUEUE: Stmt = Stmt::binding(
        "INSERT INTO inbox_outbox \
         (message_id, destination, message_name, payload, headers, aggregate_id, status, \
          sent_at, trace_context) \
       VALUES (?, ?, ?, ?, ?, ?, IF(?, 'sent', 'pending'), IF(?, UTC_TIMESTAMP(6), NULL), ?)",
        &[0, 1, 2, 3, 4, 5, 7, 7, 8],
    );

    /// Upserted (and so locked until the writing transaction ends) before the row is inserted.
    const LOCK_AGGREGATE: Option<Stmt> = Some(Stmt::new(
        "INSERT INTO inbox_outbox_aggregates (aggregate_hash) \
         VALUES (UNHEX(SHA2(?, 256))) \
       ON DUPLICATE KEY UPDATE rows_written = rows_written + 1, \
         written_at = UTC_TIMESTAMP(6)",
    ));

    /// Locks the rows among the ids that the lease may still mark sent: they carry its token
    /// and are `pending` or `dead`.
    const MARK_SENT: &'static str = "SELECT id FROM inbox_outbox WHERE id IN ({list}) \
       AND lease_token = {} AND status IN ('pending', 'dead') ORDER BY id FOR UPDATE";

    const MARK_SENT_LOCKED: Option<&'static str> = Some(
        "UPDATE inbox_outbox SET status = 'sent', \
         sent_at = UTC_TIMESTAMP(6), leased_until = NULL, next_attempt_at = NULL, \
         last_error = NULL WHERE id IN ({list})",
    );

    const MARK_FAILED: Stmt = Stmt::new(
        "UPDATE inbox_outbox SET \
         status = IF(? OR attempts >= ?, 'dead', 'pending'), \
         last_error = ?, leased_until = NULL, lease_token = NULL, \
         next_attempt_at = DATE_ADD(UTC_TIMESTAMP(6), INTERVAL ? MICROSECOND) \
       WHERE id = ? AND lease_token = ? AND status = 'pending'",
    );

    const MARK_FAILED_READ: Option<Stmt> = Some(Stmt::binding(
        "SELECT status FROM inbox_outbox WHERE id = ?",
        &[4],
    ));

    const PURGE: Stmt = Stmt::new(concat!(
        "DELETE FROM inbox_outbox WHERE status = 'sent' AND sent_at < ",
        window_start!(),
        " ORDER BY sent_at LIMIT ?"
    ));

    const BACKLOG: Stmt = Stmt::new(
        "SELECT destination, COUNT(*), \
         COALESCE(TIMESTAMPDIFF(MICROSECOND, MIN(created_at), UTC_TIMESTAMP(6)) / 1e6, 0e0) \
       FROM inbox_outbox WHERE status = 'pending' GROUP BY destination ORDER BY destination",
    );

    const INSTALLED: Stmt = Stmt::new(
        "SELECT COUNT(*) FROM information_schema.tables \
       WHERE table_schema = DATABASE() AND table_name = 'inbox_outbox'",
    );

    const STATS: Stmt = Stmt::new(concat!(
        "SELECT destination, status, COUNT(*), ",
        text_time!("MIN(created_at)"),
        " FROM inbox_outbox GROUP BY destination, status ORDER BY destination, status"
    ));

    /// Binds: three statuses, the destination twice, the limit.
    const LIST: Stmt = Stmt::binding(
        concat!(
            "SELECT ",
            entry_columns_mysql!("NULL"),
            " FROM inbox_outbox WHERE status IN (?, ?, ?) \
               AND (? IS NULL OR destination = ?) ORDER BY id LIMIT ?"
        ),
        &[0, 1, 2, 3, 3, 4],
    );

    const FETCH: Stmt = Stmt::new(concat!(
        "SELECT ",
        entry_columns_mysql!("payload"),
        " FROM inbox_outbox WHERE message_id_hash = UNHEX(SHA2(?, 256))"
    ));

    /// Binds: the message id twice, the destination twice.
    const RETRY: Stmt = Stmt::binding(
        "UPDATE inbox_outbox SET status = 'pending', attempts = 0, \
         leased_until = NULL, lease_token = NULL, next_attempt_at = NULL \
       WHERE status = 'dead' AND (? IS NULL OR message_id_hash = UNHEX(SHA2(?, 256))) \
         AND (? IS NULL OR destination = ?)",
        &[0, 0, 1, 1],
    );

    const DISCARD: Stmt = Stmt::new(
        "DELETE FROM inbox_outbox \
       WHERE message_id_hash = UNHEX(SHA2(?, 256)) AND status = 'dead'",
    );

    const PURGE_BEFORE: Stmt = Stmt::new(
        "DELETE FROM inbox_outbox \
       WHERE status = 'sent' AND sent_at < CAST(? AS DATETIME(6)) ORDER BY sent_at LIMIT ?",
    );

    const PURGE_PREVIEW: Stmt = Stmt::new(concat!(
        "SELECT destination, 'sent', COUNT(*), ",
        text_time!("MIN(sent_at)"),
        " FROM inbox_outbox WHERE status = 'sent' AND sent_at < CAST(? AS DATETIME(6)) \
         GROUP BY destination ORDER BY destination"
    ));

    /// Microseconds, at most [`MAX_INTERVAL_US`] (100 years), at least 0.
    fn delay_arg(ms: i64) -> Arg<'static> {
        Arg::I64(Some(ms.saturating_mul(1000).clamp(0, MAX_INTERVAL_US)))
    }

    /// One `?` per id.
    fn push_ids(builder: &mut QueryBuilder<Self>, ids: &[i64]) {
        let mut list = builder.separated(", ");
        for id in ids {
            list.push_bind(*id);
        }
    }

    /// No `ON CONFLICT … DO NOTHING`: a duplicate message id fails only the insert (MySQL rolls
    /// back the statement, not the transaction), and is the `false` answer.
    fn insert<'c>(conn: &'c mut MySqlConnection, params: &'c [Arg<'c>]) -> Done<'c, bool> {
        Box::pin(async move {
            match Self::ENQUEUE.run(conn, params, Self::execute).await {
                Ok(_) => Ok(true),
                Err(error) if error_number(&error) == Some(ER_DUP_ENTRY) => Ok(false),
                Err(error) => Err(error),
            }
        })
    }

    /// Eligibility is read from one consistent snapshot, then the chosen rows are locked by
    /// primary key with `SKIP LOCKED` and their own state re-checked at its latest committed
    /// version (see the module docs).
    fn lease_rows<'c>(conn: &'c mut MySqlConnection, lease: &'c Leasing<'c>) -> Done<'c, Leased> {
        Box::pin(lease_rows(conn, lease))
    }

    /// Deletes, in a transaction of its own, at most `batch` lock rows of aggregates not
    /// written since the cutoff: `inbox_outbox_aggregates` would otherwise keep a row for every
    /// aggregate ever published. Safe at any time: a lock row only makes concurrent writers of
    /// its aggregate take turns, and the next writer creates it again (rows a writer holds are
    /// skipped).
    fn forget_aggregates<'c>(
        conn: &'c mut MySqlConnection,
        cutoff: Cutoff<'c>,
        batch: i64,
    ) -> Done<'c, ()> {
        Box::pin(async move {
            let args = (cutoff, batch);
            let scope = (Scope::Transaction, "forget_aggregates");
            Self::scoped(Run::new(conn, scope, &args, forget_step)).await
        })
    }
}

/// The lease's statements (see [`OutboxDialect::lease_rows`]).
async fn lease_rows(
    conn: &mut MySqlConnection,
    lease: &Leasing<'_>,
) -> Result<Leased, sqlx::Error> {
    let max_attempts = MySql::attempts_arg(lease.max_attempts);
    // Orphans out of attempts go dead.
    let candidates =
        ids::<MySql>(&MySql::fetch_all(conn, text(ABANDONED), &[max_attempts]).await?)?;
    let abandoned = lock_ids(conn, LOCK_ABANDONED, &candidates, &[max_attempts]).await?;
    if !abandoned.is_empty() {
        let error = [lease.abandoned_error.into()];
        let mut update =
            sql::assemble::<MySql>(ABANDON, |b| MySql::push_ids(b, &abandoned), &error);
        MySql::execute_built(conn, &mut update).await?;
    }
    // One orphan alone, else fresh rows.
    let pick = [max_attempts, lease.limit.into()];
    let orphans = ids::<MySql>(&MySql::fetch_all(conn, text(ORPHANS), &pick).await?)?;
    let mut leased = lock_ids(conn, LOCK_ORPHAN, &orphans, &[max_attempts, 1_i64.into()]).await?;
    if leased.is_empty() {
        let fresh = ids::<MySql>(&MySql::fetch_all(conn, text(FRESH), &pick).await?)?;
        leased = lock_ids(conn, LOCK_FRESH, &fresh, &pick).await?;
    }
    if !leased.is_empty() {
        let args = [MySql::delay_arg(lease.lease_ms), lease.token.into()];
        let mut update = sql::assemble::<MySql>(LEASE, |b| MySql::push_ids(b, &leased), &args);
        MySql::execute_built(conn, &mut update).await?;
    }
    Ok((
        records(conn, &leased).await?,
        records(conn, &abandoned).await?,
    ))
}

/// Locks the rows among `candidates` that `template` (`{list}` the candidates, then `args`)
/// still selects, skipping rows another transaction holds: their ids.
async fn lock_ids(
    conn: &mut MySqlConnection,
    template: &str,
    candidates: &[i64],
    args: &[Arg<'_>],
) -> Result<Vec<i64>, sqlx::Error> {
    if candidates.is_empty() {
        return Ok(Vec::new());
    }
    let mut lock = sql::assemble::<MySql>(template, |b| MySql::push_ids(b, candidates), args);
    ids::<MySql>(&MySql::fetch_all_built(conn, &mut lock).await?)
}

/// The rows with these ids, as leased records, in id order.
async fn records(
    conn: &mut MySqlConnection,
    ids: &[i64],
) -> Result<Vec<crate::store::outbox::OutboxRecord>, sqlx::Error> {
    if ids.is_empty() {
        return Ok(Vec::new());
    }
    let mut read = sql::assemble::<MySql>(LEASED, |b| MySql::push_ids(b, ids), &[]);
    let rows = MySql::fetch_all_built(conn, &mut read).await?;
    rows.iter().map(|row| record::<MySql>(row, 0)).collect()
}

/// Deletes the lock rows of aggregates not written since the cutoff, at most `batch`.
fn forget_step<'t>(
    conn: &'t mut MySqlConnection,
    &(cutoff, batch): &'t (Cutoff<'_>, i64),
) -> Done<'t, ()> {
    Box::pin(async move {
        let (pick, cutoff) = match cutoff {
            Cutoff::Window(secs) => (STALE_AGGREGATES, Arg::F64(Some(secs))),
            Cutoff::Before(time) => (STALE_AGGREGATES_BEFORE, Arg::from(time)),
        };
        let stale = MySql::fetch_all(conn, text(pick), &[cutoff, batch.into()]).await?;
        let hashes = stale
            .iter()
            .map(|row| MySql::required(row, 0, MySql::bytes))
            .collect::<Result<Vec<_>, _>>()?;
        if !hashes.is_empty() {
            let push_hashes = |builder: &mut QueryBuilder<MySql>| {
                let mut list = builder.separated(", ");
                for hash in &hashes {
                    list.push_bind(hash.clone());
                }
            };
            let mut delete = sql::assemble::<MySql>(FORGET_AGGREGATES, push_hashes, &[]);
            MySql::execute_built(conn, &mut delete).await?;
        }
        Ok(())
    })
}
