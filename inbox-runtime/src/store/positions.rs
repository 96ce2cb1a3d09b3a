//! Broker positions ([`PositionStore`]) and their three dialects, with the
//! [`Component::Positions`](super::Component::Positions) migrations.
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
//! **MySQL/MariaDB** (no `RETURNING`): the assignment is an `INSERT … ON DUPLICATE KEY UPDATE`
//! (an exclusive lock on the row's primary-key record, waiting for a transaction that wrote the
//! position, under REPEATABLE READ and READ COMMITTED alike) followed by a locking read of the
//! row (`FOR UPDATE`: the latest committed version, whatever the isolation level; it never
//! waits, the row being locked already), both in one transaction (a savepoint inside the
//! caller's). The fenced write is one `UPDATE` by primary key (a record lock). A deadlock (1213)
//! or lock wait timeout (1205) of an assignment made outside a transaction is retried
//! internally and counted in [`mysql_lock_retries`](crate::mysql_lock_retries), and so is one
//! of a fenced write in autocommit; inside the caller's transaction it is returned (transient:
//! see [`crate::Classify`]). Inside: sqlx counts a transaction, or the server reports one (a raw
//! `BEGIN`, which sqlx does not count): there the assignment runs in it (a `BEGIN` of ours would
//! commit it implicitly) and nothing is retried (a deadlock rolled the caller's back).

use sqlx::{
    Connection as _, MySql, MySqlConnection, PgConnection, Postgres, Row as _, Sqlite,
    SqliteConnection,
};

use sqlx_core::transaction::TransactionManager as _;

use super::InboxDatabase;
use super::mysql::retry_lock_errors;
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

    /// Every stored position of `group`, by topic and partition.
    fn fetch_positions<'c>(
        &'c mut self,
        group: &'c str,
    ) -> BoxFuture<'c, Result<Vec<PositionRow>, sqlx::Error>>;
}

/// A database broker positions can live in: its connections implement [`PositionStore`].
/// `sqlx::Postgres`, `sqlx::Sqlite` and `sqlx::MySql`.
pub trait PositionsDatabase: InboxDatabase<Connection: PositionStore> {}

impl PositionsDatabase for Postgres {}
impl PositionsDatabase for Sqlite {}
impl PositionsDatabase for MySql {}

/// The positions component's migrations on PostgreSQL.
pub(super) const POSTGRES_MIGRATIONS: &[(i64, &str, &str)] = &[(
    1,
    "positions",
    include_str!("../../migrations/postgres/positions/0001_positions.sql"),
)];

/// The positions component's migrations on SQLite.
pub(super) const SQLITE_MIGRATIONS: &[(i64, &str, &str)] = &[(
    1,
    "positions",
    include_str!("../../migrations/sqlite/positions/0001_positions.sql"),
)];

/// The positions component's migrations on MySQL/MariaDB.
pub(super) const MYSQL_MIGRATIONS: &[(i64, &str, &str)] = &[(
    1,
    "positions",
    include_str!("../../migrations/mysql/positions/0001_positions.sql"),
)];

const FETCH: &str = "SELECT consumer_group, topic, partition_id, next_offset, epoch, owner \
     FROM inbox_positions WHERE consumer_group = $1 ORDER BY topic, partition_id";

mod postgres {
    pub(super) const ACQUIRE: &str = "INSERT INTO inbox_positions \
         (consumer_group, topic, partition_id, owner) VALUES ($1, $2, $3, $4) \
       ON CONFLICT (consumer_group, topic, partition_id) DO UPDATE \
         SET epoch = inbox_positions.epoch + 1, owner = EXCLUDED.owner, \
             assigned_at = now(), updated_at = now() \
       RETURNING epoch, next_offset";

    pub(super) const ADVANCE: &str = "UPDATE inbox_positions SET \
         next_offset = GREATEST(COALESCE(next_offset, $5), $5), updated_at = now() \
       WHERE consumer_group = $1 AND topic = $2 AND partition_id = $3 AND epoch = $4";
}

mod sqlite {
    pub(super) const ACQUIRE: &str = "INSERT INTO inbox_positions \
         (consumer_group, topic, partition_id, owner) VALUES ($1, $2, $3, $4) \
       ON CONFLICT (consumer_group, topic, partition_id) DO UPDATE \
         SET epoch = inbox_positions.epoch + 1, owner = excluded.owner, \
             assigned_at = strftime('%Y-%m-%dT%H:%M:%fZ', 'now'), \
             updated_at = strftime('%Y-%m-%dT%H:%M:%fZ', 'now') \
       RETURNING epoch, next_offset";

    pub(super) const ADVANCE: &str = "UPDATE inbox_positions SET \
         next_offset = max(COALESCE(next_offset, $5), $5), \
         updated_at = strftime('%Y-%m-%dT%H:%M:%fZ', 'now') \
       WHERE consumer_group = $1 AND topic = $2 AND partition_id = $3 AND epoch = $4";
}

mod mysql {
    /// Binds: group, topic, partition, owner.
    pub(super) const ACQUIRE: &str = "INSERT INTO inbox_positions \
         (consumer_group, topic, partition_id, owner) VALUES (?, ?, ?, ?) \
       ON DUPLICATE KEY UPDATE epoch = epoch + 1, owner = VALUES(owner), \
         assigned_at = UTC_TIMESTAMP(6), updated_at = UTC_TIMESTAMP(6)";

    /// The row [`ACQUIRE`] locked. Binds: group, topic, partition.
    pub(super) const ACQUIRED: &str = "SELECT epoch, next_offset FROM inbox_positions \
       WHERE consumer_group = ? AND topic = ? AND partition_id = ? FOR UPDATE";

    /// Binds: the next offset twice, group, topic, partition, epoch.
    pub(super) const ADVANCE: &str = "UPDATE inbox_positions SET \
         next_offset = GREATEST(COALESCE(next_offset, ?), ?), updated_at = UTC_TIMESTAMP(6) \
       WHERE consumer_group = ? AND topic = ? AND partition_id = ? AND epoch = ?";

    pub(super) const FETCH: &str = "SELECT CONVERT(consumer_group USING utf8mb4), \
         CONVERT(topic USING utf8mb4), partition_id, next_offset, epoch, owner \
       FROM inbox_positions WHERE consumer_group = ? ORDER BY topic, partition_id";
}

/// A [`PositionRow`] from `group, topic, partition, next offset, epoch, owner`.
fn position_row<R>(row: &R) -> Result<PositionRow, sqlx::Error>
where
    R: sqlx::Row,
    for<'r> i64: sqlx::Decode<'r, R::Database> + sqlx::Type<R::Database>,
    for<'r> i32: sqlx::Decode<'r, R::Database> + sqlx::Type<R::Database>,
    for<'r> String: sqlx::Decode<'r, R::Database> + sqlx::Type<R::Database>,
    usize: sqlx::ColumnIndex<R>,
{
    Ok(PositionRow {
        group: row.try_get(0)?,
        topic: row.try_get(1)?,
        partition: row.try_get(2)?,
        next_offset: row.try_get(3)?,
        epoch: row.try_get(4)?,
        owner: row.try_get(5)?,
    })
}

/// [`PositionStore::fetch_positions`] with the dialect's statement `$fetch` (binds: the group).
macro_rules! fetch_positions_method {
    ($fetch:expr) => {
        fn fetch_positions<'c>(
            &'c mut self,
            group: &'c str,
        ) -> BoxFuture<'c, Result<Vec<PositionRow>, sqlx::Error>> {
            Box::pin(async move {
                let rows = sqlx::query($fetch)
                    .bind(group)
                    .fetch_all(&mut *self)
                    .await?;
                rows.iter().map(position_row).collect()
            })
        }
    };
}

macro_rules! impl_position_store {
    ($conn:ty, $dialect:ident) => {
        impl PositionStore for $conn {
            fn acquire_position<'c>(
                &'c mut self,
                key: &'c PositionKey<'c>,
                owner: &'c str,
            ) -> BoxFuture<'c, Result<Acquired, sqlx::Error>> {
                Box::pin(async move {
                    let row = sqlx::query($dialect::ACQUIRE)
                        .bind(key.group)
                        .bind(key.topic)
                        .bind(key.partition)
                        .bind(owner)
                        .fetch_one(&mut *self)
                        .await?;
                    Ok(Acquired {
                        epoch: row.try_get(0)?,
                        next_offset: row.try_get(1)?,
                    })
                })
            }

            fn advance_position<'c>(
                &'c mut self,
                key: &'c PositionKey<'c>,
                epoch: i64,
                next_offset: i64,
            ) -> BoxFuture<'c, Result<bool, sqlx::Error>> {
                Box::pin(async move {
                    let done = sqlx::query($dialect::ADVANCE)
                        .bind(key.group)
                        .bind(key.topic)
                        .bind(key.partition)
                        .bind(epoch)
                        .bind(next_offset)
                        .execute(&mut *self)
                        .await?;
                    Ok(done.rows_affected() == 1)
                })
            }

            fetch_positions_method!(FETCH);
        }
    };
}

impl_position_store!(PgConnection, postgres);
impl_position_store!(SqliteConnection, sqlite);

/// The assignment in a transaction of its own (a savepoint inside the caller's): the upsert,
/// then the locking read of the row it locked.
async fn mysql_acquire_once(
    conn: &mut MySqlConnection,
    key: &PositionKey<'_>,
    owner: &str,
) -> Result<Acquired, sqlx::Error> {
    let mut tx = conn.begin().await?;
    let acquired = mysql_acquire_statements(&mut tx, key, owner).await?;
    tx.commit().await?;
    Ok(acquired)
}

/// The assignment's two statements, in whatever transaction `conn` is in.
async fn mysql_acquire_statements(
    conn: &mut MySqlConnection,
    key: &PositionKey<'_>,
    owner: &str,
) -> Result<Acquired, sqlx::Error> {
    sqlx::query(mysql::ACQUIRE)
        .bind(key.group)
        .bind(key.topic)
        .bind(key.partition)
        .bind(owner)
        .execute(&mut *conn)
        .await?;
    let (epoch, next_offset): (i64, Option<i64>) = sqlx::query_as(mysql::ACQUIRED)
        .bind(key.group)
        .bind(key.topic)
        .bind(key.partition)
        .fetch_one(&mut *conn)
        .await?;
    Ok(Acquired { epoch, next_offset })
}

/// The fenced write, in whatever transaction `conn` is in.
async fn mysql_advance(
    conn: &mut MySqlConnection,
    key: &PositionKey<'_>,
    epoch: i64,
    next_offset: i64,
) -> Result<sqlx::mysql::MySqlQueryResult, sqlx::Error> {
    sqlx::query(mysql::ADVANCE)
        .bind(next_offset)
        .bind(next_offset)
        .bind(key.group)
        .bind(key.topic)
        .bind(key.partition)
        .bind(epoch)
        .execute(&mut *conn)
        .await
}

impl PositionStore for MySqlConnection {
    fn acquire_position<'c>(
        &'c mut self,
        key: &'c PositionKey<'c>,
        owner: &'c str,
    ) -> BoxFuture<'c, Result<Acquired, sqlx::Error>> {
        Box::pin(async move {
            // Inside a transaction sqlx does not count (a raw `BEGIN`), a `BEGIN` of ours would
            // commit the caller's implicitly: the statements run in it, unretried.
            let depth = <MySql as sqlx::Database>::TransactionManager::get_transaction_depth(self);
            if depth == 0 && super::mysql::in_transaction(self).await? {
                return mysql_acquire_statements(self, key, owner).await;
            }
            retry_lock_errors!(
                self,
                "acquire_position",
                mysql_acquire_once(self, key, owner)
            )
        })
    }

    fn advance_position<'c>(
        &'c mut self,
        key: &'c PositionKey<'c>,
        epoch: i64,
        next_offset: i64,
    ) -> BoxFuture<'c, Result<bool, sqlx::Error>> {
        Box::pin(async move {
            // Retried only in autocommit: a deadlock in the caller's transaction (also one
            // sqlx does not count, a raw `BEGIN`) rolled it back, and a retry would write the
            // position alone.
            let done = if super::mysql::in_transaction(self).await? {
                mysql_advance(self, key, epoch, next_offset).await?
            } else {
                retry_lock_errors!(
                    self,
                    "advance_position",
                    mysql_advance(self, key, epoch, next_offset)
                )?
            };
            Ok(done.rows_affected() == 1)
        })
    }

    fetch_positions_method!(mysql::FETCH);
}
