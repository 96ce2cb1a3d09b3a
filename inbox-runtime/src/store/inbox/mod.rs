//! The inbox store, written once for every SQL backend: [`InboxDialect`] is what a backend
//! states (its statements, with the parameters each binds, and its behavioural hooks), and one
//! blanket impl gives every sqlx connection whose database implements it the capability traits
//! ([`ClaimStore`], [`OrderingStore`], [`AdminStore`], [`InboxConnection`]) and
//! [`InboxDatabase`](super::InboxDatabase).
//!
//! Where backends differ in more than text, the dialect picks one of the shapes written here:
//! a claim that returns what it found ([`ClaimShape::Returning`]: PostgreSQL, SQLite) or one that
//! stamps the row it writes and reads it back ([`ClaimShape::Stamped`]: MySQL, which has no
//! `RETURNING`); likewise for the other writes that report a row ([`Write`]) and for the batch
//! claim ([`BatchClaim`]). Lock-error retries follow [`Dialect::lock_error`].

mod admin;
mod claim;
pub(crate) mod standard;

use std::time::Duration;

use sqlx::{QueryBuilder, SqlStr, Transaction};

use super::dialect::{Contention, Dialect, contention};
use super::sql::{Arg, Sql, text};
use super::{
    AdminStore, ClaimRequest, ClaimResult, ClaimStore, ExistingRow, FailureRecord, InboxConnection,
    MessageMark, OrderingStore, ParkedMessage, PurgeClock, Rejection, StatsRow, StoredMessage,
};
use crate::BoxFuture;
use crate::types::status::Status;

pub(crate) use claim::claim;

/// A value an inbox statement binds, by name. Each statement lists the values it binds in the
/// order of its placeholders: `$1`, `$2`, … each once (PostgreSQL, SQLite), or `?` in order,
/// some values more than once (MySQL).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Param {
    /// The consumer (inbox scope).
    Consumer,
    /// The idempotency key.
    Key,
    /// The message name.
    Name,
    /// The fingerprint (as the dialect stores it: see [`InboxDialect::DIGEST_HASHES`]; a
    /// rejection's is always text).
    Hash,
    /// The delivery's source.
    Source,
    /// Its partition.
    Partition,
    /// Its offset.
    Offset,
    /// The claim mode (`deliver`, `retry`, `replay`, …).
    Mode,
    /// A fresh claim token (16 bytes), for the [stamped](ClaimShape::Stamped) shapes.
    Token,
    /// Whether a failure is permanent.
    Permanent,
    /// The attempts after which a failure is dead.
    MaxTries,
    /// The error text to keep.
    LastError,
    /// The delay before the next attempt, in milliseconds.
    DelayMs,
    /// The same delay in microseconds.
    DelayUs,
    /// The payload to keep.
    Payload,
    /// The aggregate of an ordered message.
    Aggregate,
    /// Its sequence.
    Sequence,
    /// The status a row is set to.
    NewStatus,
    /// The result a claim session stores.
    ResultBytes,
    /// A rejection's reason, or the reason a parked message is dead-lettered.
    Reason,
    /// A rejection's error text.
    Detail,
    /// A cut payload's real size.
    PayloadSize,
    /// A window, in seconds.
    Window,
    /// A row limit.
    Limit,
    /// The first of a list of statuses (`NULL` past its end; likewise the next four).
    Status1,
    /// The second status of a list.
    Status2,
    /// The third status of a list.
    Status3,
    /// The fourth status of a list.
    Status4,
    /// The fifth status of a list.
    Status5,
    /// Whether rejections count.
    Rejections,
}

/// One statement of a dialect: its text and the values it binds, in placeholder order.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Stmt {
    /// The text.
    pub(crate) sql: &'static str,
    /// What each placeholder binds.
    pub(crate) binds: &'static [Param],
}

/// How a backend claims a key.
#[derive(Debug, Clone, Copy)]
pub(crate) enum ClaimShape {
    /// One statement inserts a free key or takes over a claimable row, and returns
    /// `('claimed', NULL, attempts, NULL)`, or else the stored row as
    /// [`InboxDialect::EXISTING`] reads it (or nothing, when its snapshot cannot tell; the row
    /// is then read anew). PostgreSQL, SQLite.
    Returning(Stmt),
    /// No `RETURNING` (MySQL): `upsert` stamps the row it inserts or takes over with a fresh
    /// [`Param::Token`] (and leaves any other row as it was); `read` reads the row with a
    /// locking read: status, fingerprint, attempts, 1 if it carries the token, milliseconds
    /// until a `failed` row is due. A claimed token is then kept with `remember`, for
    /// [`InboxDialect::VERIFY_CLAIM`].
    Stamped {
        /// The upsert.
        upsert: Stmt,
        /// The locking read.
        read: Stmt,
        /// Keeps the token in the session.
        remember: Stmt,
    },
}

/// How a write reports the row it wrote.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Write {
    /// The statement returns it (`RETURNING`).
    Returning(Stmt),
    /// `write` returns nothing; `read` reads the row back.
    ReadBack {
        /// The write.
        write: Stmt,
        /// The read.
        read: Stmt,
    },
    /// In a transaction of its own: `write` stamps the row it writes with a fresh
    /// [`Param::Token`], `read` reads it back with a last column that is 1 if it carries the
    /// token (a row the write left alone is not reported).
    Stamped {
        /// The write.
        write: Stmt,
        /// The read.
        read: Stmt,
    },
}

/// How a backend claims a batch of keys in one statement.
#[derive(Debug, Clone, Copy)]
pub(crate) enum BatchClaim {
    /// [`standard::BATCH_CONFLICT`] with this dialect's parts: `ON CONFLICT … DO UPDATE … WHERE`
    /// takes over claimable rows and `RETURNING` reports each row claimed.
    Returning {
        /// `processed_at` of a taken-over key.
        takeover_processed_at: &'static str,
        /// Which rows are taken over.
        takeover: &'static str,
    },
    /// No `RETURNING` (MySQL): each row carries a fresh [`Param::Token`] (the last value of
    /// each row of the `INSERT`), `update` stamps the rows it takes over with it (each `?` of
    /// its text binds the token); `read` (followed by the token and `AND (consumer,
    /// message_key) IN (…)`) reads the rows claimed; `remember` keeps the token as after a
    /// single claim.
    Stamped {
        /// The upsert's update clause.
        update: Stmt,
        /// The read of the rows claimed: `consumer, message_key, attempts`.
        read: &'static str,
        /// Keeps the token in the session.
        remember: Stmt,
    },
}

/// What a SQL backend states for the inbox: its statements (each with the values it binds) and
/// how the inbox behaves on it. Defaults are the `$N`/`ON CONFLICT`/`RETURNING` dialect of
/// PostgreSQL and SQLite ([`standard`]); the Rust around them is written once, in this module.
pub(crate) trait InboxDialect: Dialect {
    /// The statement that opens a claim's transaction, unless the connection is already in one
    /// (then a savepoint): `None` for the driver's `BEGIN`.
    const BEGIN: Option<&'static str> = None;

    /// See [`InboxConnection::OPTIMISTIC_BATCHES`].
    const OPTIMISTIC_BATCHES: bool = false;

    /// See [`InboxConnection::LOCAL_CLAIM_REGISTRY`].
    const LOCAL_CLAIM_REGISTRY: bool = false;

    /// See [`InboxConnection::CHAINED_TRANSACTIONS`].
    const CHAINED_TRANSACTIONS: bool = false;

    /// Fingerprints are stored as their 32 bytes (PostgreSQL's `BYTEA`) rather than as their
    /// hex text.
    const DIGEST_HASHES: bool = false;

    /// The claim.
    const CLAIM: ClaimShape;

    /// A row's status, fingerprint, attempts, and milliseconds until a `failed` row is due.
    const EXISTING: Stmt;

    /// [`Self::EXISTING`] for many keys, with `consumer, message_key` first; `(consumer,
    /// message_key) IN (…)` follows.
    const EXISTING_BATCH: &'static str;

    /// A read that finds the claim of a key only while the transaction that made it is alive
    /// (see [`ClaimStore::verify_claim`]); `None` where nothing needs checking.
    const VERIFY_CLAIM: Option<Stmt> = None;

    /// The error when [`Self::VERIFY_CLAIM`] finds no claim.
    const CLAIM_GONE: &'static str = "the claim is gone from the handler's transaction";

    /// Appended to the batch claim's `RETURNING` list: a column whose evaluation marks the
    /// transaction as holding its claims, for [`Self::VERIFY_CLAIM`] (PostgreSQL: a
    /// transaction-local setting). Nothing by default.
    const BATCH_CLAIM_MARK: &'static str = "";

    /// A failed attempt, in its own statement: `status, attempts` of the row recorded.
    const RECORD_FAILURE: Write;

    /// A rejected delivery.
    const RECORD_REJECTION: Stmt = standard::RECORD_REJECTION;

    /// The batch claim's `INSERT`, before its `VALUES`.
    const BATCH_INSERT: &'static str = standard::BATCH_INSERT;

    /// The clock, as the batch claim writes `received_at`.
    const BATCH_NOW: &'static str;

    /// `processed_at` of a key the batch claim inserts.
    const BATCH_CLAIMED_PROCESSED_AT: &'static str;

    /// The rest of the batch claim.
    const BATCH: BatchClaim;

    /// Deletes a key claimed fresh in this transaction.
    const UNCLAIM_FRESH: Stmt = standard::UNCLAIM_FRESH;

    /// Gives a `failed` key taken over in this transaction its state back.
    const UNCLAIM_TAKEN_OVER: Stmt = standard::UNCLAIM_TAKEN_OVER;

    /// Turns a row claimed in this transaction into a failed attempt: `status, attempts`.
    const FAIL_CLAIMED: Write;

    /// Stores a claim session's result.
    const STORE_RESULT: Stmt = standard::STORE_RESULT;

    /// Reads a stored result.
    const FETCH_RESULT: Stmt = standard::FETCH_RESULT;

    /// The columns of a [`StoredMessage`] (see [`standard::MESSAGE_COLUMNS`]).
    const MESSAGE_COLUMNS: &'static str = standard::MESSAGE_COLUMNS;

    /// One row, [`Self::MESSAGE_COLUMNS`].
    const FETCH: Stmt = standard::FETCH;

    /// Discards a `failed` or `dead` row.
    const DISCARD: Stmt;

    /// Counts per consumer and status, then rejections per consumer and reason.
    const STATS: &'static str = standard::STATS;

    /// One bounded batch of the retention purge.
    const PURGE: Stmt;

    /// One bounded batch of the rejections' purge.
    const PURGE_REJECTIONS: Stmt;

    /// The purge's clocks (see [`PurgeClock`]).
    const PURGE_CLOCK: Stmt;

    /// What a purge would delete.
    const PURGE_PREVIEW: Stmt;

    /// Locks the aggregate's state row (created at 0): its last applied sequence.
    const LOCK_AGGREGATE: Write = Write::Returning(standard::LOCK_AGGREGATE);

    /// Sets the aggregate's last applied sequence.
    const ADVANCE_AGGREGATE: Stmt = standard::ADVANCE_AGGREGATE;

    /// Sets a claimed row's status, ordering and payload.
    const MARK_MESSAGE: Stmt = standard::MARK_MESSAGE;

    /// The parked (or failed) message of an aggregate with a sequence.
    const FIND_PARKED: Stmt = standard::FIND_PARKED;

    /// Parked messages older than a window.
    const EXPIRED_PARKED: Stmt;

    /// Turns a parked message dead.
    const DEAD_LETTER_PARKED: Stmt = standard::DEAD_LETTER_PARKED;

    /// See [`InboxConnection::set_lock_timeout`]. Nothing by default.
    fn set_lock_timeout(
        conn: &mut Self::Connection,
        timeout: Duration,
    ) -> BoxFuture<'_, Result<(), sqlx::Error>> {
        let _ = (conn, timeout);
        Box::pin(async { Ok(()) })
    }

    /// See [`InboxConnection::verify_commit_begin`]. `None` by default.
    fn verify_commit_begin(
        conn: &mut Self::Connection,
    ) -> Option<BoxFuture<'_, Result<(), (crate::types::StoreOperation, sqlx::Error)>>> {
        let _ = conn;
        None
    }

    /// See [`InboxConnection::rollback_begin`]. `None` by default.
    fn rollback_begin(
        conn: &mut Self::Connection,
    ) -> Option<BoxFuture<'_, Result<(), sqlx::Error>>> {
        let _ = conn;
        None
    }

    /// See [`ClaimStore::claim_no_wait`]. By default the plain claim (for a backend whose
    /// claims never wait on another transaction's key: SQLite, where the protocol checks the
    /// claims of this process first).
    fn claim_no_wait<'c>(
        conn: &'c mut Self::Connection,
        request: &'c ClaimRequest<'c>,
    ) -> BoxFuture<'c, Result<Option<ClaimResult>, sqlx::Error>> {
        Box::pin(async move { claim::<Self>(conn, request, false).await.map(Some) })
    }
}

/// A no-wait claim's answer: `None` if the claim gave up waiting for another transaction's
/// lock on the key ([`Contention::LockTimeout`]).
pub(crate) fn no_wait_outcome<D: Dialect>(
    found: Result<ClaimResult, sqlx::Error>,
) -> Result<Option<ClaimResult>, sqlx::Error> {
    match found {
        Ok(found) => Ok(Some(found)),
        Err(error) if contention::<D>(&error) == Some(Contention::LockTimeout) => Ok(None),
        Err(error) => Err(error),
    }
}

/// The most values one statement binds.
const MAX_BINDS: usize = 32;

/// `stmt`'s parameters, picked from an operation's named values.
struct Bound<'a> {
    args: [Arg<'a>; MAX_BINDS],
    len: usize,
}

impl<'a> Bound<'a> {
    fn new(stmt: &Stmt, values: &[(Param, Arg<'a>)]) -> Result<Self, sqlx::Error> {
        let mut args = [Arg::Bool(None); MAX_BINDS];
        if stmt.binds.len() > MAX_BINDS {
            return Err(sqlx::Error::Protocol(format!(
                "inbox statement binds {} values, at most {MAX_BINDS} are supported",
                stmt.binds.len()
            )));
        }
        for (slot, param) in args.iter_mut().zip(stmt.binds) {
            *slot = values
                .iter()
                .find(|(name, _)| name == param)
                .map(|&(_, arg)| arg)
                .ok_or_else(|| {
                    sqlx::Error::Protocol(format!("inbox statement binds {param:?}, not given"))
                })?;
        }
        Ok(Self {
            args,
            len: stmt.binds.len(),
        })
    }

    fn args(&self) -> &[Arg<'a>] {
        &self.args[..self.len]
    }
}

impl Stmt {
    /// Runs this statement on `conn` by `method` ([`Sql::execute`], [`Sql::fetch_optional`],
    /// [`Sql::fetch_one`] or [`Sql::fetch_all`]), binding what its placeholders name from
    /// `values` (`sqlx::Error::Protocol` if one is not given, or it binds too many).
    async fn run<C, T, M>(
        &self,
        conn: &mut C,
        values: &[(Param, Arg<'_>)],
        method: M,
    ) -> Result<T, sqlx::Error>
    where
        M: for<'c> FnOnce(
            &'c mut C,
            SqlStr,
            &'c [Arg<'c>],
        ) -> BoxFuture<'c, Result<T, sqlx::Error>>,
    {
        let bound = Bound::new(self, values)?;
        method(conn, text(self.sql), bound.args()).await
    }
}

/// Appends `(a, b, …)`: each item a bound value or SQL text, as `QueryBuilder::push_values`
/// writes one row.
fn push_row<D: Sql>(query: &mut QueryBuilder<D>, items: &[Item<'_>]) {
    query.push("(");
    for (n, item) in items.iter().enumerate() {
        if n > 0 {
            query.push(", ");
        }
        match *item {
            Item::Arg(arg) => D::push_arg(query, arg),
            Item::Sql(sql) => {
                query.push(sql);
            }
        }
    }
    query.push(")");
}

/// Appends ` ((a, b), (c, d)) ` for `IN`, as `QueryBuilder::push_tuples` writes it.
fn push_key_tuples<'a, D: Sql>(
    query: &mut QueryBuilder<D>,
    keys: impl Iterator<Item = (&'a str, &'a str)>,
) {
    query.push(" (");
    for (n, (consumer, key)) in keys.enumerate() {
        if n > 0 {
            query.push(", ");
        }
        push_row(query, &[Item::Arg(consumer.into()), Item::Arg(key.into())]);
    }
    query.push(") ");
}

/// Appends `stmt`'s text, binding a value of `values` at each `?` in it (in the order of
/// `stmt.binds`), in the builder's own placeholder style.
fn push_template<D: Sql>(
    query: &mut QueryBuilder<D>,
    stmt: &Stmt,
    values: &[(Param, Arg<'_>)],
) -> Result<(), sqlx::Error> {
    let bound = Bound::new(stmt, values)?;
    let mut parts = stmt.sql.split('?');
    query.push(parts.next().unwrap_or_default());
    for (part, &arg) in parts.zip(bound.args()) {
        D::push_arg(query, arg);
        query.push(part);
    }
    Ok(())
}

/// One item of a row of values.
#[derive(Clone, Copy)]
enum Item<'a> {
    /// A bound value.
    Arg(Arg<'a>),
    /// SQL text.
    Sql(&'static str),
}

/// A fingerprint as a dialect binds it (see [`InboxDialect::DIGEST_HASHES`]).
#[derive(Clone, Copy)]
enum HashParam<'a> {
    /// The 32 bytes of a lower-case hex SHA-256 digest.
    Digest([u8; 32]),
    /// Any other text, as its bytes (never written by the runtime).
    Bytes(&'a [u8]),
    /// The hex text.
    Text(&'a str),
}

impl<'a> HashParam<'a> {
    fn new<D: InboxDialect>(hex_text: &'a str) -> Self {
        if !D::DIGEST_HASHES {
            return HashParam::Text(hex_text);
        }
        match digest(hex_text) {
            Some(digest) => HashParam::Digest(digest),
            None => HashParam::Bytes(hex_text.as_bytes()),
        }
    }

    fn arg(&self) -> Arg<'_> {
        match self {
            HashParam::Digest(digest) => Arg::from(&digest[..]),
            HashParam::Bytes(bytes) => Arg::from(*bytes),
            HashParam::Text(text) => Arg::from(*text),
        }
    }
}

/// The 32 bytes of a 64-lower-case-hex-digit SHA-256 digest; `None` for any other text.
fn digest(hex_text: &str) -> Option<[u8; 32]> {
    let lower_hex = hex_text.len() == 64
        && hex_text
            .bytes()
            .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b));
    let mut digest = [0; 32];
    (lower_hex && hex::decode_to_slice(hex_text, &mut digest).is_ok()).then_some(digest)
}

/// A fingerprint as the PostgreSQL inbox stores it (`payload_hash BYTEA`, migration 0006): the
/// 32 raw bytes of a 64-lower-case-hex-digit SHA-256 digest, or, for any other text (never
/// written by the runtime), that text's UTF-8 bytes, so that it reads back unchanged through
/// [`hash_text`].
#[cfg(test)]
fn hash_bytes(hex_text: &str) -> Vec<u8> {
    match digest(hex_text) {
        Some(digest) => digest.to_vec(),
        None => hex_text.as_bytes().to_vec(),
    }
}

/// A stored fingerprint as text: 32 bytes (PostgreSQL's `BYTEA` digest) as 64 lower-case hex
/// digits; anything else (SQLite's and MySQL's hex text, a damaged value) as its UTF-8 text.
fn hash_text(stored: Vec<u8>) -> String {
    if stored.len() == 32 {
        hex::encode(stored)
    } else {
        String::from_utf8(stored)
            .unwrap_or_else(|e| String::from_utf8_lossy(e.as_bytes()).into_owned())
    }
}

/// A fresh claim token.
fn token() -> [u8; 16] {
    uuid::Uuid::new_v4().into_bytes()
}

/// The error for a `NULL` where a statement guarantees a value.
fn null_column(index: usize) -> sqlx::Error {
    sqlx::Error::ColumnDecode {
        index: index.to_string(),
        source: "unexpected NULL".into(),
    }
}

/// A column that must not be `NULL`.
fn required<T>(value: Option<T>, index: usize) -> Result<T, sqlx::Error> {
    value.ok_or_else(|| null_column(index))
}

/// Column `index` as a [`Status`].
fn status_at<D: Sql>(row: &D::Row, index: usize) -> Result<Status, sqlx::Error> {
    D::str_with(row, index, |text| text.map(str::parse::<Status>))?
        .ok_or_else(|| null_column(index))?
        .map_err(|e| sqlx::Error::ColumnDecode {
            index: index.to_string(),
            source: Box::new(e),
        })
}

/// Column `index` as attempts (an `INTEGER`; a negative count reads as 0).
fn attempts_at<D: Sql>(row: &D::Row, index: usize) -> Result<u32, sqlx::Error> {
    Ok(u32::try_from(required(D::i32(row, index)?, index)?).unwrap_or(0))
}

/// Column `index` as a fingerprint (see [`hash_text`]).
fn hash_at<D: Sql>(row: &D::Row, index: usize) -> Result<String, sqlx::Error> {
    Ok(hash_text(required(D::bytes(row, index)?, index)?))
}

/// A `retry_in_ms` column as a delay (`None`: due, or not `failed`).
fn retry_in(ms: Option<i64>) -> Option<Duration> {
    ms.filter(|&ms| ms > 0)
        .map(|ms| Duration::from_millis(ms.unsigned_abs()))
}

/// The columns `status, payload_hash, attempts, retry_in_ms` from `first` on, as a stored row.
fn existing_at<D: Sql>(row: &D::Row, first: usize) -> Result<ClaimResult, sqlx::Error> {
    Ok(ClaimResult::Existing {
        status: status_at::<D>(row, first)?,
        payload_hash: hash_at::<D>(row, first + 1)?,
        attempts: attempts_at::<D>(row, first + 2)?,
        retry_in: retry_in(D::i64(row, first + 3)?),
    })
}

/// The source metadata of a record, as three values.
fn source_args(source: Option<&crate::types::envelope::SourceMetadata>) -> [(Param, Arg<'_>); 3] {
    let (source, partition, offset) = super::source_parts(source);
    [
        (Param::Source, source.into()),
        (Param::Partition, partition.into()),
        (Param::Offset, offset.into()),
    ]
}

/// A key's values.
fn key_values<'a>(consumer: &'a str, key: &'a str) -> [(Param, Arg<'a>); 2] {
    [(Param::Consumer, consumer.into()), (Param::Key, key.into())]
}

impl<D> super::InboxDatabase for D
where
    D: InboxDialect,
    D::Connection: sqlx::migrate::Migrate + 'static,
{
    const BACKEND: super::Backend = <D as Dialect>::BACKEND;

    fn migrations(component: super::Component) -> &'static [(i64, &'static str, &'static str)] {
        <D as Dialect>::migrations(component)
    }
}

impl<C> InboxConnection for C
where
    C: sqlx::Connection + 'static,
    C::Database: InboxDialect,
{
    const BACKEND: super::Backend = <C::Database as Dialect>::BACKEND;
    const OPTIMISTIC_BATCHES: bool = <C::Database as InboxDialect>::OPTIMISTIC_BATCHES;
    const LOCAL_CLAIM_REGISTRY: bool = <C::Database as InboxDialect>::LOCAL_CLAIM_REGISTRY;
    const CHAINED_TRANSACTIONS: bool = <C::Database as InboxDialect>::CHAINED_TRANSACTIONS;

    fn begin_inbox(
        &mut self,
    ) -> BoxFuture<'_, Result<Transaction<'_, Self::Database>, sqlx::Error>> {
        match self.begin_statement() {
            Some(statement) => Box::pin(self.begin_with(statement)),
            None => Box::pin(self.begin()),
        }
    }

    fn begin_statement(&self) -> Option<sqlx::SqlStr> {
        let statement = <C::Database as InboxDialect>::BEGIN?;
        (!self.is_in_transaction()).then(|| text(statement))
    }

    fn in_transaction<'t>(tx: &'t mut Transaction<'_, Self::Database>) -> &'t mut Self {
        &mut *tx
    }

    fn set_lock_timeout(&mut self, timeout: Duration) -> BoxFuture<'_, Result<(), sqlx::Error>> {
        C::Database::set_lock_timeout(self, timeout)
    }

    fn verify_commit_begin(
        &mut self,
    ) -> Option<BoxFuture<'_, Result<(), (crate::types::StoreOperation, sqlx::Error)>>> {
        C::Database::verify_commit_begin(self)
    }

    fn rollback_begin(&mut self) -> Option<BoxFuture<'_, Result<(), sqlx::Error>>> {
        C::Database::rollback_begin(self)
    }
}

impl<C> ClaimStore for C
where
    C: sqlx::Connection,
    C::Database: InboxDialect,
{
    fn claim<'c>(
        &'c mut self,
        request: &'c ClaimRequest<'c>,
    ) -> BoxFuture<'c, Result<ClaimResult, sqlx::Error>> {
        Box::pin(claim::<C::Database>(self, request, false))
    }

    fn claim_no_wait<'c>(
        &'c mut self,
        request: &'c ClaimRequest<'c>,
    ) -> BoxFuture<'c, Result<Option<ClaimResult>, sqlx::Error>> {
        C::Database::claim_no_wait(self, request)
    }

    fn verify_claim<'c>(
        &'c mut self,
        consumer: &'c str,
        key: &'c str,
    ) -> BoxFuture<'c, Result<(), sqlx::Error>> {
        Box::pin(claim::verify::<C::Database>(self, consumer, key))
    }

    fn existing<'c>(
        &'c mut self,
        consumer: &'c str,
        key: &'c str,
    ) -> BoxFuture<'c, Result<Option<ClaimResult>, sqlx::Error>> {
        Box::pin(claim::existing::<C::Database>(self, consumer, key))
    }

    fn record_failure<'c>(
        &'c mut self,
        record: &'c FailureRecord<'c>,
    ) -> BoxFuture<'c, Result<Option<(Status, u32)>, sqlx::Error>> {
        Box::pin(claim::record_failure::<C::Database>(self, record))
    }

    fn record_rejection<'c>(
        &'c mut self,
        rejection: &'c Rejection<'c>,
    ) -> BoxFuture<'c, Result<(), sqlx::Error>> {
        Box::pin(claim::record_rejection::<C::Database>(self, rejection))
    }

    fn claim_batch<'c>(
        &'c mut self,
        requests: &'c [ClaimRequest<'c>],
    ) -> BoxFuture<'c, Result<Vec<Option<u32>>, sqlx::Error>> {
        Box::pin(claim::claim_batch::<C::Database>(self, requests))
    }

    fn existing_batch<'c>(
        &'c mut self,
        keys: &'c [(&'c str, &'c str)],
    ) -> BoxFuture<'c, Result<Vec<ExistingRow>, sqlx::Error>> {
        Box::pin(claim::existing_batch::<C::Database>(self, keys))
    }

    fn unclaim<'c>(
        &'c mut self,
        consumer: &'c str,
        key: &'c str,
        payload: &'c [u8],
    ) -> BoxFuture<'c, Result<(), sqlx::Error>> {
        Box::pin(claim::unclaim::<C::Database>(self, consumer, key, payload))
    }

    fn fail_claimed<'c>(
        &'c mut self,
        record: &'c FailureRecord<'c>,
    ) -> BoxFuture<'c, Result<Option<(Status, u32)>, sqlx::Error>> {
        Box::pin(claim::fail_claimed::<C::Database>(self, record))
    }

    fn store_result<'c>(
        &'c mut self,
        consumer: &'c str,
        key: &'c str,
        result: &'c [u8],
    ) -> BoxFuture<'c, Result<(), sqlx::Error>> {
        Box::pin(claim::store_result::<C::Database>(
            self, consumer, key, result,
        ))
    }

    fn fetch_result<'c>(
        &'c mut self,
        consumer: &'c str,
        key: &'c str,
    ) -> BoxFuture<'c, Result<Option<Vec<u8>>, sqlx::Error>> {
        Box::pin(claim::fetch_result::<C::Database>(self, consumer, key))
    }
}

impl<C> OrderingStore for C
where
    C: sqlx::Connection,
    C::Database: InboxDialect,
{
    fn lock_aggregate<'c>(
        &'c mut self,
        consumer: &'c str,
        aggregate_id: &'c str,
    ) -> BoxFuture<'c, Result<i64, sqlx::Error>> {
        Box::pin(admin::lock_aggregate::<C::Database>(
            self,
            consumer,
            aggregate_id,
        ))
    }

    fn advance_aggregate<'c>(
        &'c mut self,
        consumer: &'c str,
        aggregate_id: &'c str,
        sequence: i64,
    ) -> BoxFuture<'c, Result<(), sqlx::Error>> {
        Box::pin(admin::advance_aggregate::<C::Database>(
            self,
            consumer,
            aggregate_id,
            sequence,
        ))
    }

    fn mark_message<'c>(
        &'c mut self,
        mark: &'c MessageMark<'c>,
    ) -> BoxFuture<'c, Result<(), sqlx::Error>> {
        Box::pin(admin::mark_message::<C::Database>(self, mark))
    }

    fn find_parked<'c>(
        &'c mut self,
        consumer: &'c str,
        aggregate_id: &'c str,
        sequence: i64,
    ) -> BoxFuture<'c, Result<Option<ParkedMessage>, sqlx::Error>> {
        Box::pin(admin::find_parked::<C::Database>(
            self,
            consumer,
            aggregate_id,
            sequence,
        ))
    }

    fn expired_parked<'c>(
        &'c mut self,
        older_than_secs: f64,
        limit: i64,
    ) -> BoxFuture<'c, Result<Vec<ParkedMessage>, sqlx::Error>> {
        Box::pin(admin::expired_parked::<C::Database>(
            self,
            older_than_secs,
            limit,
        ))
    }

    fn dead_letter_parked<'c>(
        &'c mut self,
        consumer: &'c str,
        key: &'c str,
        reason: &'c str,
    ) -> BoxFuture<'c, Result<bool, sqlx::Error>> {
        Box::pin(admin::dead_letter_parked::<C::Database>(
            self, consumer, key, reason,
        ))
    }
}

impl<C> AdminStore for C
where
    C: sqlx::Connection,
    C::Database: InboxDialect,
{
    fn fetch_message<'c>(
        &'c mut self,
        consumer: &'c str,
        key: &'c str,
    ) -> BoxFuture<'c, Result<Option<StoredMessage>, sqlx::Error>> {
        Box::pin(admin::fetch_message::<C::Database>(self, consumer, key))
    }

    fn list_messages<'c>(
        &'c mut self,
        consumer: Option<&'c str>,
        statuses: &'c [Status],
        limit: i64,
    ) -> BoxFuture<'c, Result<Vec<StoredMessage>, sqlx::Error>> {
        Box::pin(admin::list_messages::<C::Database>(
            self, consumer, statuses, limit,
        ))
    }

    fn discard_message<'c>(
        &'c mut self,
        consumer: &'c str,
        key: &'c str,
    ) -> BoxFuture<'c, Result<bool, sqlx::Error>> {
        Box::pin(admin::discard_message::<C::Database>(self, consumer, key))
    }

    fn stats(&mut self) -> BoxFuture<'_, Result<Vec<StatsRow>, sqlx::Error>> {
        Box::pin(admin::stats::<C::Database>(self))
    }

    fn purge_batch<'c>(
        &'c mut self,
        statuses: &'c [Status],
        older_than_secs: f64,
        batch: i64,
    ) -> BoxFuture<'c, Result<u64, sqlx::Error>> {
        Box::pin(admin::purge_batch::<C::Database>(
            self,
            statuses,
            older_than_secs,
            batch,
        ))
    }

    fn purge_rejections_batch(
        &mut self,
        older_than_secs: f64,
        batch: i64,
    ) -> BoxFuture<'_, Result<u64, sqlx::Error>> {
        Box::pin(admin::purge_rejections_batch::<C::Database>(
            self,
            older_than_secs,
            batch,
        ))
    }

    fn purge_clock(
        &mut self,
        older_than_secs: f64,
    ) -> BoxFuture<'_, Result<PurgeClock, sqlx::Error>> {
        Box::pin(admin::purge_clock::<C::Database>(self, older_than_secs))
    }

    fn purge_preview<'c>(
        &'c mut self,
        statuses: &'c [Status],
        older_than_secs: f64,
        rejections: bool,
    ) -> BoxFuture<'c, Result<Vec<StatsRow>, sqlx::Error>> {
        Box::pin(admin::purge_preview::<C::Database>(
            self,
            statuses,
            older_than_secs,
            rejections,
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::{hash_bytes, hash_text};

    #[test]
    fn a_digest_is_stored_as_its_32_bytes_and_reads_back_as_hex() {
        let digest = "00ff".repeat(16);
        let stored = hash_bytes(&digest);
        assert_eq!(stored, [0x00, 0xff].repeat(16));
        assert_eq!(hash_text(stored), digest);
    }

    #[test]
    fn other_text_is_stored_as_its_bytes_and_reads_back_unchanged() {
        for text in [
            "00FF".repeat(16),               // upper-case hex: not what the runtime writes
            "00ff".repeat(15),               // 60 digits
            format!("{}zz", "0".repeat(62)), // 64 characters, not all hex
            "damaged".to_owned(),
        ] {
            let stored = hash_bytes(&text);
            assert_eq!(stored, text.as_bytes(), "{text}");
            assert_eq!(hash_text(stored), text);
        }
    }
}
