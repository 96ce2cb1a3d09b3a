//! Broker positions ([`PositionStore`]), written once for every backend whose database
//! implements [`PositionsDialect`] (each backend's statements and hooks live in its folder:
//! `postgres/positions.rs`, `sqlite/positions.rs`, `mysql/positions.rs`, with the
//! [`Component::Positions`](super::Component::Positions) migrations beside them).
//!
//! A position is `(consumer group, topic, partition) → next offset`, plus a fencing **epoch**:
//!
//! * on every assignment of the partition, its new owner increments the epoch and reads the next
//!   offset in one statement ([`PositionStore::acquire_position`]);
//! * every write of the next offset ([`PositionStore::advance_position`]) is a compare-and-set on
//!   the epoch the writer acquired: a consumer that lost the partition since (a zombie) changes
//!   no row, learns it, and rolls its transaction back.
//!
//! Both statements take the row's lock: an assignment waits for a transaction that has written
//! the position and not committed yet, and then reads what it committed; a write made after the
//! assignment fails. Positions only move forward.
//!
//! A consumer's poll loop must not wait on that lock for as long as the other transaction stays
//! open (a stalled handler would make the consumer miss `max.poll.interval.ms`): it uses the
//! bounded forms, [`PositionStore::try_acquire_position`] and
//! [`PositionStore::try_advance_position`], which give up after a lock wait of their caller's
//! choosing, having changed nothing, and tries again later.
//!
//! How each backend takes the row's lock and bounds the wait is in its module; MySQL/MariaDB,
//! which has no `RETURNING`, reads the row it upserted in the same transaction.

use std::time::Duration;

use super::InboxDatabase;
use super::sql::{self, Arg, Done, Run, Scope, Scoped, Sql, Step, Stmt};
use crate::BoxFuture;

/// Which position: a consumer group's partition of a topic.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub struct PositionKey<'a> {
    /// The consumer group (Kafka's `group.id`).
    pub group: &'a str,
    /// The topic.
    pub topic: &'a str,
    /// The partition number.
    pub partition: i32,
}

impl<'a> PositionKey<'a> {
    /// The position of `group` on `topic`'s partition `partition`.
    pub fn new(group: &'a str, topic: &'a str, partition: i32) -> Self {
        Self {
            group,
            topic,
            partition,
        }
    }
}

/// What an assignment found ([`PositionStore::acquire_position`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct Acquired {
    /// The epoch the new owner holds (1 for the first assignment ever).
    pub epoch: i64,
    /// The next offset to consume, or `None` if none was ever written (start where the broker
    /// says: its committed offset, or its reset policy).
    pub next_offset: Option<i64>,
}

/// One stored position, as operators and tests read it ([`PositionStore::fetch_positions`]).
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct PositionRow {
    /// The consumer group.
    pub group: String,
    /// The topic.
    pub topic: String,
    /// The partition number.
    pub partition: i32,
    /// The next offset to consume (`None`: none written yet).
    pub next_offset: Option<i64>,
    /// The current fencing epoch.
    pub epoch: i64,
    /// Who holds it: the consumer's owner text (client id, host, process id).
    pub owner: String,
}

/// The positions' statements on one connection. Implemented for `sqlx::PgConnection`,
/// `sqlx::SqliteConnection` and `sqlx::MySqlConnection` (groups and topics of at most 512 bytes
/// there: a longer one is refused by the database with "data too long"); see [`ClaimStore`](super::ClaimStore) for implementing a backend of
/// your own. Each runs in whatever transaction the connection is in (its own when none).
pub trait PositionStore: Send {
    /// Takes the partition for a new owner: creates its row (epoch 1, no offset) or increments
    /// its epoch and records `owner`, and returns the new epoch with the next offset. Waits for
    /// a transaction that holds the row (a write of the previous owner) to end.
    fn acquire_position<'c>(
        &'c mut self,
        key: &'c PositionKey<'c>,
        owner: &'c str,
    ) -> BoxFuture<'c, Result<Acquired, sqlx::Error>>;

    /// The fenced write: sets the next offset to `next_offset` (never lowering it) **if** the
    /// row's epoch is still `epoch`. `Ok(true)` if it was; `Ok(false)` if the partition was
    /// assigned again since (or the row is gone): the caller no longer owns it and must not
    /// commit what it wrote beside this.
    fn advance_position<'c>(
        &'c mut self,
        key: &'c PositionKey<'c>,
        epoch: i64,
        next_offset: i64,
    ) -> BoxFuture<'c, Result<bool, sqlx::Error>>;

    /// [`acquire_position`](Self::acquire_position), waiting at most `lock_wait` for a
    /// transaction that holds the row (a write of the previous owner, not committed yet):
    /// `Ok(None)` if one still held it then, and nothing changed (the epoch is not incremented;
    /// the previous owner's transaction goes on, and may commit). Try again later.
    ///
    /// How the wait is bounded: **PostgreSQL**, `lock_timeout` set to `lock_wait` (at least
    /// 1 ms) for a transaction of its own (a savepoint inside the caller's, after which the
    /// caller's `lock_timeout` is put back); **SQLite**, the connection's busy timeout set to
    /// `lock_wait` for the statement, then put back (on SQLite any open write transaction holds
    /// the lock, not only one that wrote this row); **MySQL/MariaDB** (8.0 / 10.3 or later), a
    /// locking read of the row with `NOWAIT`, tried again every 10 ms until `lock_wait` has
    /// passed, then the assignment in the same transaction (a savepoint inside the caller's; in
    /// a raw `BEGIN` sqlx does not count, in that one). On PostgreSQL, do not call it inside a
    /// raw `BEGIN` (sqlx would not know of it: the `COMMIT` of its own transaction would end
    /// it). A future dropped midway rolls its transaction back on PostgreSQL and MySQL; on
    /// SQLite it may leave the connection's busy timeout at `lock_wait` (close that
    /// connection).
    ///
    /// # Errors
    /// Any database error but the end of the lock wait; on MySQL/MariaDB, a lock wait timeout
    /// (1205) if the refusal ended the caller's transaction (`innodb_rollback_on_timeout`).
    fn try_acquire_position<'c>(
        &'c mut self,
        key: &'c PositionKey<'c>,
        owner: &'c str,
        lock_wait: Duration,
    ) -> BoxFuture<'c, Result<Option<Acquired>, sqlx::Error>>;

    /// [`advance_position`](Self::advance_position), waiting at most `lock_wait` for a
    /// transaction that holds the row, as [`try_acquire_position`](Self::try_acquire_position)
    /// bounds it: `Ok(None)` if one still held it then (nothing written), else `Ok(Some(_))`
    /// with what `advance_position` returns (`false`: fenced).
    ///
    /// # Errors
    /// As [`try_acquire_position`](Self::try_acquire_position).
    fn try_advance_position<'c>(
        &'c mut self,
        key: &'c PositionKey<'c>,
        epoch: i64,
        next_offset: i64,
        lock_wait: Duration,
    ) -> BoxFuture<'c, Result<Option<bool>, sqlx::Error>>;

    /// Every stored position of `group`, by topic and partition.
    fn fetch_positions<'c>(
        &'c mut self,
        group: &'c str,
    ) -> BoxFuture<'c, Result<Vec<PositionRow>, sqlx::Error>>;
}

/// A database broker positions can live in: its connections implement [`PositionStore`].
/// `sqlx::Postgres`, `sqlx::Sqlite` and `sqlx::MySql`.
pub trait PositionsDatabase: InboxDatabase<Connection: PositionStore> {}

impl<DB> PositionsDatabase for DB where DB: PositionsDialect + InboxDatabase {}

/// The positions component's migrations on a backend whose migration of each version is `sql`
/// (in version order): `(version, description, SQL)`.
pub(crate) const fn migrations(sql: [&'static str; 1]) -> [(i64, &'static str, &'static str); 1] {
    let [positions] = sql;
    [(1, "positions", positions)]
}

/// The assignment's upsert on the `$N` dialects (`ON CONFLICT … DO UPDATE … RETURNING`),
/// `$now` the database clock.
macro_rules! acquire_upsert {
    ($now:literal) => {
        concat!(
            "INSERT INTO inbox_positions \
             (consumer_group, topic, partition_id, owner) VALUES ($1, $2, $3, $4) \
           ON CONFLICT (consumer_group, topic, partition_id) DO UPDATE \
             SET epoch = inbox_positions.epoch + 1, owner = EXCLUDED.owner, \
                 assigned_at = ",
            $now,
            ", updated_at = ",
            $now,
            " RETURNING epoch, next_offset"
        )
    };
}
pub(crate) use acquire_upsert;

/// One backend's positions statements and behavioural hooks; [`PositionStore`] is written once
/// on top of them, for every connection of a database that implements this.
///
/// The statements' parameters (see [`Stmt`]): [`ACQUIRE`](Self::ACQUIRE) and
/// [`ACQUIRED`](Self::ACQUIRED): group, topic, partition (`i32`), owner;
/// [`ADVANCE`](Self::ADVANCE): group, topic, partition, epoch, next offset (all `i64` but the
/// partition); [`FETCH`](Self::FETCH): group.
pub(crate) trait PositionsDialect: Scoped {
    /// Creates the row (epoch 1, no offset) or increments its epoch and records the owner,
    /// locking it; returns `epoch, next_offset` unless [`ACQUIRED`](Self::ACQUIRED) reads them.
    const ACQUIRE: Stmt;
    /// On a dialect whose upsert returns no row: the locking read of the row
    /// [`ACQUIRE`](Self::ACQUIRE) wrote (`epoch, next_offset`), in the same transaction.
    const ACQUIRED: Option<Stmt> = None;
    /// The fenced write: the next offset (never lowered) if the epoch is still the writer's.
    const ADVANCE: Stmt;
    /// `group, topic, partition, next_offset, epoch, owner` of every row of a group, by topic
    /// and partition.
    const FETCH: Stmt = Stmt::new(
        "SELECT consumer_group, topic, partition_id, next_offset, epoch, owner \
         FROM inbox_positions WHERE consumer_group = $1 ORDER BY topic, partition_id",
    );

    /// Runs `run`'s step (on its connection, or on a transaction of the hook's) waiting at most
    /// `lock.wait` for a transaction that holds the row of the position `lock.key`: `Ok(None)`
    /// if one still held it then (and the step changed nothing). See
    /// [`PositionStore::try_acquire_position`] for how each backend bounds the wait.
    fn bounded<'c, A: Sync, T: Send + 'c>(run: Run<'c, Self, A, T>, row: Lock<'c>) -> Tried<'c, T>;
}

/// What a bounded step gives, in time: `None` if the lock wait ran out.
pub(crate) type Tried<'c, T> = Done<'c, Option<T>>;

/// A bounded lock wait ([`PositionsDialect::bounded`]): the position whose row is waited for,
/// and for how long at most.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Lock<'c> {
    /// The position.
    pub(crate) key: &'c PositionKey<'c>,
    /// The longest wait.
    pub(crate) wait: Duration,
}

impl<'c> Lock<'c> {
    /// The row of `key`, waited for at most `wait`.
    fn new(key: &'c PositionKey<'c>, wait: Duration) -> Self {
        Self { key, wait }
    }
}

/// Runs `step` on `conn` with `args` (moved into the future), waiting at most `lock.wait` for
/// a transaction that holds the row of `lock.key` ([`PositionsDialect::bounded`]).
fn bounded<'c, D: PositionsDialect, A: Send + Sync + 'c, T: Send + 'c>(
    conn: &'c mut D::Connection,
    lock: Lock<'c>,
    args: A,
    step: Step<D::Connection, A, T>,
) -> Tried<'c, T> {
    Box::pin(async move {
        let run = Run::new(conn, (Scope::Transaction, "bounded"), &args, step);
        D::bounded(run, lock).await
    })
}

/// An assignment's arguments: the position and the new owner.
type AcquireArgs<'a> = (&'a PositionKey<'a>, &'a str);

/// A fenced write's arguments: the position, the writer's epoch, the next offset.
type AdvanceArgs<'a> = (&'a PositionKey<'a>, i64, i64);

/// The parameters of the statements about `key` (see [`PositionsDialect`]): the position,
/// then `rest` (the owner; or the epoch and the next offset).
fn params<'a>(key: &PositionKey<'a>, rest: &[Arg<'a>]) -> Vec<Arg<'a>> {
    let mut params = vec![
        key.group.into(),
        key.topic.into(),
        Arg::I32(Some(key.partition)),
    ];
    params.extend_from_slice(rest);
    params
}

/// The assignment's statements, in whatever transaction `conn` is in.
fn acquire_step<'t, D: PositionsDialect>(
    conn: &'t mut D::Connection,
    (key, owner): &'t AcquireArgs<'_>,
) -> BoxFuture<'t, Result<Acquired, sqlx::Error>> {
    Box::pin(async move {
        let params = params(key, &[(*owner).into()]);
        let row = sql::write_returning::<D>(conn, D::ACQUIRE, D::ACQUIRED, &params)
            .await?
            .ok_or(sqlx::Error::RowNotFound)?;
        Ok(Acquired {
            epoch: D::i64_required(&row, 0)?,
            next_offset: D::i64(&row, 1)?,
        })
    })
}

/// The fenced write, in whatever transaction `conn` is in: whether it was still the owner's.
fn advance_step<'t, D: PositionsDialect>(
    conn: &'t mut D::Connection,
    (key, epoch, next_offset): &'t AdvanceArgs<'_>,
) -> BoxFuture<'t, Result<bool, sqlx::Error>> {
    Box::pin(async move {
        let params = params(key, &[(*epoch).into(), (*next_offset).into()]);
        Ok(D::ADVANCE.run(conn, &params, D::execute).await? == 1)
    })
}

/// A [`PositionRow`] from `group, topic, partition, next offset, epoch, owner`.
fn position_row<D: Sql>(row: &D::Row) -> Result<PositionRow, sqlx::Error> {
    Ok(PositionRow {
        group: D::text_required(row, 0)?,
        topic: D::text_required(row, 1)?,
        partition: D::required(row, 2, D::i32)?,
        next_offset: D::i64(row, 3)?,
        epoch: D::i64_required(row, 4)?,
        owner: D::text_required(row, 5)?,
    })
}

/// Every connection whose database has the positions dialect. An assignment runs in a
/// transaction of its own (a savepoint inside the caller's; in a raw `BEGIN` sqlx does not
/// count, in that one), a fenced write in the caller's transaction or on its own: on MySQL a
/// deadlock or lock wait timeout of one outside the caller's transaction is retried.
impl<C> PositionStore for C
where
    C: sqlx::Connection,
    C::Database: PositionsDialect<Connection = C>,
{
    fn acquire_position<'c>(
        &'c mut self,
        key: &'c PositionKey<'c>,
        owner: &'c str,
    ) -> BoxFuture<'c, Result<Acquired, sqlx::Error>> {
        let scope = (Scope::RawElseTransaction, "acquire_position");
        sql::scoped::<C::Database, _, _>(self, scope, (key, owner), acquire_step::<C::Database>)
    }

    fn advance_position<'c>(
        &'c mut self,
        key: &'c PositionKey<'c>,
        epoch: i64,
        next_offset: i64,
    ) -> BoxFuture<'c, Result<bool, sqlx::Error>> {
        let args = (key, epoch, next_offset);
        let scope = (Scope::JoinElseStatement, "advance_position");
        sql::scoped::<C::Database, _, _>(self, scope, args, advance_step::<C::Database>)
    }

    fn try_acquire_position<'c>(
        &'c mut self,
        key: &'c PositionKey<'c>,
        owner: &'c str,
        lock_wait: Duration,
    ) -> BoxFuture<'c, Result<Option<Acquired>, sqlx::Error>> {
        let step = acquire_step::<C::Database>;
        bounded::<C::Database, _, _>(self, Lock::new(key, lock_wait), (key, owner), step)
    }

    fn try_advance_position<'c>(
        &'c mut self,
        key: &'c PositionKey<'c>,
        epoch: i64,
        next_offset: i64,
        lock_wait: Duration,
    ) -> BoxFuture<'c, Result<Option<bool>, sqlx::Error>> {
        let args = (key, epoch, next_offset);
        let step = advance_step::<C::Database>;
        bounded::<C::Database, _, _>(self, Lock::new(key, lock_wait), args, step)
    }

    fn fetch_positions<'c>(
        &'c mut self,
        group: &'c str,
    ) -> BoxFuture<'c, Result<Vec<PositionRow>, sqlx::Error>> {
        Box::pin(async move {
            let read = position_row::<C::Database>;
            sql::read_all::<C::Database, _>(self, C::Database::FETCH, &[group.into()], read).await
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::sql::{check_binds, for_every_dialect};

    fn every_statement<D: PositionsDialect>() {
        check_binds("ACQUIRE", D::ACQUIRE, 4);
        if let Some(read) = D::ACQUIRED {
            check_binds("ACQUIRED", read, 4);
        }
        check_binds("ADVANCE", D::ADVANCE, 5);
        check_binds("FETCH", D::FETCH, 1);
    }

    /// Every dialect's statements bind as many arguments as their text takes.
    #[test]
    fn every_dialect_binds_what_its_statements_take() {
        for_every_dialect!(every_statement);
    }
}
