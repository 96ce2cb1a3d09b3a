//! The measured paths: the business effect alone, and the same effect through a real
//! `#[idempotent]` handler (called directly, or through `Dispatcher::dispatch`), on PostgreSQL and
//! SQLite, with and without one transactional-outbox publish; and the schema they run on.

use std::sync::Arc;

use inbox_runtime::outbox::{Outbox, OutboxError, OutboxMessage};
use inbox_runtime::{
    ConnectionSlot, Dispatcher, Envelope, Fingerprint, Outcome, SourceMetadata, idempotent,
};
use serde::{Deserialize, Serialize};
use sqlx::pool::PoolConnection;
use sqlx::{
    Acquire as _, Connection as _, PgConnection, PgPool, Postgres, Sqlite, SqliteConnection,
    SqlitePool,
};
use uuid::Uuid;

use crate::measure::{BoxError, BoxFuture, Op, Rng};

/// The consumer (inbox scope) of the benchmark's handlers.
pub(crate) const CONSUMER: &str = "bench";
/// The routing name of [`Credit`].
pub(crate) const MESSAGE: &str = "bench.credit";
/// Accounts the effect spreads over (like pgbench's `random(1, 100000)`).
pub(crate) const ACCOUNTS: u64 = 100_000;

/// The business effect: add an amount to an account's balance (a ledger upsert). The same text
/// runs in the bare effect, in the handlers, and in pgbench's scripts.
pub(crate) const UPSERT_PG: &str = "INSERT INTO bench_accounts (id, balance_cents) VALUES ($1, $2) \
     ON CONFLICT (id) DO UPDATE SET balance_cents = bench_accounts.balance_cents + excluded.balance_cents";

/// [`UPSERT_PG`] in SQLite's placeholder syntax.
const UPSERT_SQLITE: &str = "INSERT INTO bench_accounts (id, balance_cents) VALUES (?1, ?2) \
     ON CONFLICT (id) DO UPDATE SET balance_cents = bench_accounts.balance_cents + excluded.balance_cents";

const CREATE_ACCOUNTS: &str = "CREATE TABLE IF NOT EXISTS bench_accounts (id TEXT PRIMARY KEY, balance_cents BIGINT NOT NULL)";

/// A payment to credit: the benchmark's message.
#[derive(Debug, Clone, Serialize, Deserialize, inbox_runtime::Message)]
#[message(name = "bench.credit")]
pub(crate) struct Credit {
    /// The producer's event id: the idempotency key.
    #[message(key)]
    pub(crate) event_id: Uuid,
    pub(crate) account_id: String,
    pub(crate) amount_cents: i64,
}

/// Credits the amount (PostgreSQL).
#[idempotent(consumer = "bench")]
pub(crate) async fn credit_pg(conn: &mut PgConnection, msg: Credit) -> Result<(), sqlx::Error> {
    sqlx::query(UPSERT_PG)
        .bind(&msg.account_id)
        .bind(msg.amount_cents)
        .execute(conn)
        .await?;
    Ok(())
}

/// Credits the amount (SQLite).
#[idempotent(consumer = "bench")]
pub(crate) async fn credit_sqlite(
    conn: &mut SqliteConnection,
    msg: Credit,
) -> Result<(), sqlx::Error> {
    sqlx::query(UPSERT_SQLITE)
        .bind(&msg.account_id)
        .bind(msg.amount_cents)
        .execute(conn)
        .await?;
    Ok(())
}

/// The same payment as [`Credit`], for the handlers that also publish through the outbox: a
/// message of its own, so that the registry's dispatcher still finds one consumer per message.
#[derive(Debug, Clone, Serialize, Deserialize, inbox_runtime::Message)]
#[message(name = "bench.credit.outbox")]
pub(crate) struct OutboxCredit {
    /// The producer's event id: the idempotency key.
    #[message(key)]
    pub(crate) event_id: Uuid,
    pub(crate) account_id: String,
    pub(crate) amount_cents: i64,
}

impl From<Credit> for OutboxCredit {
    fn from(msg: Credit) -> Self {
        OutboxCredit {
            event_id: msg.event_id,
            account_id: msg.account_id,
            amount_cents: msg.amount_cents,
        }
    }
}

/// The event the outbox handlers publish (about 90 bytes of JSON), its aggregate the account.
#[derive(Debug, Clone, Serialize, Deserialize, inbox_runtime::Message)]
#[message(name = "bench.credited")]
pub(crate) struct Credited {
    #[message(key)]
    pub(crate) event_id: Uuid,
    pub(crate) account_id: String,
    pub(crate) amount_cents: i64,
}

/// The outbox destination of [`Credited`]: an AMQP queue on the default exchange, a NATS subject.
pub(crate) const EVENTS: &str = "bench.events";

/// The handlers' outbox, notifying relays at commit (the default).
pub(crate) const OUTBOX: Outbox = Outbox::new(&[EVENTS]);

/// The same outbox without the `NOTIFY` (`Outbox::notify(false)`).
pub(crate) const OUTBOX_QUIET: Outbox = Outbox::new(&[EVENTS]).notify(false);

/// The outbox message a credit publishes.
fn credited(msg: &OutboxCredit) -> OutboxMessage {
    let event = Credited {
        event_id: msg.event_id,
        account_id: msg.account_id.clone(),
        amount_cents: msg.amount_cents,
    };
    OutboxMessage::new(EVENTS, &event).aggregate(&msg.account_id)
}

/// Credits the amount and publishes [`Credited`] through [`OUTBOX`], in the handler's
/// transaction (PostgreSQL).
#[idempotent(consumer = "bench")]
pub(crate) async fn credit_outbox_pg(
    conn: &mut PgConnection,
    msg: OutboxCredit,
) -> Result<(), OutboxError> {
    sqlx::query(UPSERT_PG)
        .bind(&msg.account_id)
        .bind(msg.amount_cents)
        .execute(&mut *conn)
        .await?;
    OUTBOX.publish(conn, credited(&msg)).await?;
    Ok(())
}

/// [`credit_outbox_pg`] through [`OUTBOX_QUIET`] (no `NOTIFY`).
#[idempotent(consumer = "bench_quiet")]
pub(crate) async fn credit_outbox_quiet_pg(
    conn: &mut PgConnection,
    msg: OutboxCredit,
) -> Result<(), OutboxError> {
    sqlx::query(UPSERT_PG)
        .bind(&msg.account_id)
        .bind(msg.amount_cents)
        .execute(&mut *conn)
        .await?;
    OUTBOX_QUIET.publish(conn, credited(&msg)).await?;
    Ok(())
}

/// [`credit_outbox_pg`] for SQLite (no notifications there).
#[idempotent(consumer = "bench")]
pub(crate) async fn credit_outbox_sqlite(
    conn: &mut SqliteConnection,
    msg: OutboxCredit,
) -> Result<(), OutboxError> {
    sqlx::query(UPSERT_SQLITE)
        .bind(&msg.account_id)
        .bind(msg.amount_cents)
        .execute(&mut *conn)
        .await?;
    OUTBOX.publish(conn, credited(&msg)).await?;
    Ok(())
}

/// Creates the inbox tables and `bench_accounts` with [`ACCOUNTS`] rows at 0.
pub(crate) async fn setup_pg(pool: &PgPool) -> Result<(), BoxError> {
    inbox_runtime::migrate(pool).await?;
    sqlx::query(CREATE_ACCOUNTS).execute(pool).await?;
    sqlx::query(
        "INSERT INTO bench_accounts (id, balance_cents) \
         SELECT g::text, 0 FROM generate_series(1, $1) g ON CONFLICT DO NOTHING",
    )
    .bind(ACCOUNTS as i64)
    .execute(pool)
    .await?;
    sqlx::query("VACUUM ANALYZE bench_accounts")
        .execute(pool)
        .await?;
    Ok(())
}

/// [`setup_pg`] for SQLite.
pub(crate) async fn setup_sqlite(pool: &SqlitePool) -> Result<(), BoxError> {
    inbox_runtime::migrate(pool).await?;
    sqlx::query(CREATE_ACCOUNTS).execute(pool).await?;
    sqlx::query(
        "WITH RECURSIVE g(n) AS (SELECT 1 UNION ALL SELECT n + 1 FROM g WHERE n < ?1) \
         INSERT INTO bench_accounts (id, balance_cents) SELECT CAST(n AS TEXT), 0 FROM g \
         WHERE true ON CONFLICT DO NOTHING",
    )
    .bind(ACCOUNTS as i64)
    .execute(pool)
    .await?;
    Ok(())
}

/// How message keys are made.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum KeyKind {
    /// Random (UUIDv4).
    Random,
    /// Time-ordered (UUIDv7).
    TimeOrdered,
}

impl KeyKind {
    pub(crate) fn label(self) -> &'static str {
        match self {
            KeyKind::Random => "UUIDv4 (random)",
            KeyKind::TimeOrdered => "UUIDv7 (time-ordered)",
        }
    }
}

/// A stream of messages: new ones (each with a fresh key), or redeliveries cycling over a set
/// of already processed messages.
pub(crate) enum Stream {
    Fresh {
        rng: Rng,
        keys: KeyKind,
        /// (worker, workers): this worker's accounts are those ≡ worker (mod workers), as a
        /// partitioned consumer's would be; concurrent transactions never share an account.
        partition: (u64, u64),
    },
    Redelivered {
        set: Arc<DupSet>,
        next: usize,
        step: usize,
    },
}

/// Messages already in the inbox, with their payloads as delivered.
pub(crate) struct DupSet {
    pub(crate) messages: Vec<(Credit, Vec<u8>)>,
}

impl DupSet {
    /// `n` messages; their keys still have to be put in the inbox (see [`DupSet::rows`]).
    pub(crate) fn new(n: usize, seed: u64) -> DupSet {
        let mut rng = Rng::new(seed);
        let messages = (0..n)
            .map(|_| {
                let msg = fresh(&mut rng, KeyKind::Random);
                let payload = serde_json::to_vec(&msg).expect("serializable");
                (msg, payload)
            })
            .collect();
        DupSet { messages }
    }

    /// (key, payload fingerprint) of every message, as the inbox stores them.
    pub(crate) fn rows(&self) -> Result<(Vec<String>, Vec<String>), BoxError> {
        let mut keys = Vec::with_capacity(self.messages.len());
        let mut hashes = Vec::with_capacity(self.messages.len());
        for (msg, _) in &self.messages {
            keys.push(msg.event_id.to_string());
            hashes.push(Fingerprint::of(MESSAGE, msg)?.to_hex());
        }
        Ok((keys, hashes))
    }
}

/// A new message.
pub(crate) fn fresh(rng: &mut Rng, keys: KeyKind) -> Credit {
    Credit {
        event_id: match keys {
            KeyKind::Random => rng.uuid_v4(),
            KeyKind::TimeOrdered => Uuid::now_v7(),
        },
        account_id: rng.range(ACCOUNTS).to_string(),
        amount_cents: rng.range(1000) as i64,
    }
}

impl Stream {
    /// New messages for worker `worker` of `workers` (see [`Stream::Fresh`]).
    pub(crate) fn fresh(seed: u64, keys: KeyKind, worker: usize, workers: usize) -> Stream {
        let workers = workers.max(1) as u64;
        Stream::Fresh {
            rng: Rng::new(seed),
            keys,
            partition: (worker as u64 % workers, workers),
        }
    }

    /// Worker `worker` of `workers` over `set`.
    pub(crate) fn redelivered(set: Arc<DupSet>, worker: usize, workers: usize) -> Stream {
        Stream::Redelivered {
            set,
            next: worker,
            step: workers.max(1),
        }
    }

    pub(crate) fn is_redelivery(&self) -> bool {
        matches!(self, Stream::Redelivered { .. })
    }

    /// The next message and, for redeliveries, its payload as first delivered.
    pub(crate) fn next(&mut self) -> (Credit, Option<Vec<u8>>) {
        match self {
            Stream::Fresh {
                rng,
                keys,
                partition: (worker, workers),
            } => {
                let mut msg = fresh(rng, *keys);
                let slot = rng.range(ACCOUNTS / *workers) - 1;
                msg.account_id = (slot * *workers + *worker + 1).to_string();
                (msg, None)
            }
            Stream::Redelivered { set, next, step } => {
                let (msg, payload) = &set.messages[*next % set.messages.len()];
                *next += *step;
                (msg.clone(), Some(payload.clone()))
            }
        }
    }
}

/// A connection of either backend, held by one task for the whole run.
pub(crate) enum Conn {
    Pg(PoolConnection<Postgres>),
    Lite(PoolConnection<Sqlite>),
}

/// A dispatcher of either backend.
#[derive(Clone)]
pub(crate) enum Disp {
    Pg(Arc<Dispatcher<Postgres>>),
    Lite(Arc<Dispatcher<Sqlite>>),
}

/// What one task runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Path {
    /// The effect alone, one statement in autocommit: its own (implicit) transaction.
    Bare,
    /// The effect alone inside `BEGIN` … `COMMIT` (sqlx's `begin()`/`commit()`).
    BareTx,
    /// The `#[idempotent]` function called on the task's connection.
    Direct,
    /// The same with one outbox publish in its transaction (`credit_outbox_*`).
    DirectOutbox,
    /// [`Path::DirectOutbox`] without the `NOTIFY` (PostgreSQL; SQLite has none).
    DirectOutboxQuiet,
}

/// One task's loop body on a held connection.
pub(crate) struct ConnOp {
    pub(crate) conn: Conn,
    pub(crate) path: Path,
    pub(crate) stream: Stream,
}

/// One task's loop body through a shared dispatcher: a pooled connection per message
/// (`Dispatcher::dispatch`), or one held across messages (`Dispatcher::dispatch_on`, as the
/// `Worker` does).
pub(crate) struct DispatchOp {
    dispatcher: Disp,
    stream: Stream,
    /// Mark every envelope as a redelivery (as a broker does on a requeued message).
    redelivered: bool,
    /// Dispatch on the task's held connection.
    hold: bool,
    pg_slot: ConnectionSlot<Postgres>,
    lite_slot: ConnectionSlot<Sqlite>,
}

impl DispatchOp {
    pub(crate) fn new(dispatcher: Disp, stream: Stream, redelivered: bool, hold: bool) -> Self {
        Self {
            dispatcher,
            stream,
            redelivered,
            hold,
            pg_slot: ConnectionSlot::new(),
            lite_slot: ConnectionSlot::new(),
        }
    }
}

pub(crate) fn check<E: std::fmt::Debug>(
    result: Result<Outcome<()>, E>,
    redelivery: bool,
) -> Result<u64, BoxError> {
    match (result, redelivery) {
        (Ok(Outcome::Processed(())), false) | (Ok(Outcome::Duplicate), true) => Ok(1),
        (other, _) => Err(format!("unexpected result: {other:?}").into()),
    }
}

impl Op for ConnOp {
    fn call(&mut self) -> BoxFuture<'_, Result<u64, BoxError>> {
        Box::pin(async move {
            let redelivery = self.stream.is_redelivery();
            let (msg, _) = self.stream.next();
            match (&mut self.conn, self.path) {
                (Conn::Pg(conn), Path::Bare) => {
                    effect_pg(conn, &msg).await?;
                }
                (Conn::Pg(conn), Path::BareTx) => {
                    let mut tx = conn.begin().await?;
                    effect_pg(&mut tx, &msg).await?;
                    tx.commit().await?;
                }
                (Conn::Pg(conn), Path::Direct) => {
                    return check(credit_pg(conn, msg).await, redelivery);
                }
                (Conn::Pg(conn), Path::DirectOutbox) => {
                    return check(credit_outbox_pg(conn, msg.into()).await, redelivery);
                }
                (Conn::Pg(conn), Path::DirectOutboxQuiet) => {
                    return check(credit_outbox_quiet_pg(conn, msg.into()).await, redelivery);
                }
                (Conn::Lite(conn), Path::Bare) => {
                    effect_sqlite(conn, &msg).await?;
                }
                (Conn::Lite(conn), Path::BareTx) => {
                    // As the handler's wrapper does: take the write lock up front.
                    let conn: &mut SqliteConnection = conn;
                    let mut tx = conn.begin_with("BEGIN IMMEDIATE").await?;
                    effect_sqlite(&mut tx, &msg).await?;
                    tx.commit().await?;
                }
                (Conn::Lite(conn), Path::Direct) => {
                    return check(credit_sqlite(conn, msg).await, redelivery);
                }
                (Conn::Lite(conn), Path::DirectOutbox | Path::DirectOutboxQuiet) => {
                    return check(credit_outbox_sqlite(conn, msg.into()).await, redelivery);
                }
            }
            Ok(1)
        })
    }
}

async fn effect_pg(conn: &mut PgConnection, msg: &Credit) -> Result<(), sqlx::Error> {
    sqlx::query(UPSERT_PG)
        .bind(&msg.account_id)
        .bind(msg.amount_cents)
        .execute(conn)
        .await?;
    Ok(())
}

async fn effect_sqlite(conn: &mut SqliteConnection, msg: &Credit) -> Result<(), sqlx::Error> {
    sqlx::query(UPSERT_SQLITE)
        .bind(&msg.account_id)
        .bind(msg.amount_cents)
        .execute(conn)
        .await?;
    Ok(())
}

impl Op for DispatchOp {
    fn call(&mut self) -> BoxFuture<'_, Result<u64, BoxError>> {
        Box::pin(async move {
            let redelivery = self.stream.is_redelivery();
            let (msg, payload) = self.stream.next();
            // A broker hands over bytes: serializing here stands for the producer's side.
            let payload = match payload {
                Some(payload) => payload,
                None => serde_json::to_vec(&msg)?,
            };
            let mut envelope = Envelope::new(MESSAGE, payload);
            if self.redelivered {
                envelope = envelope.with_source(SourceMetadata::new("bench").redelivered(true));
            }
            let mut outcomes = match (&self.dispatcher, self.hold) {
                (Disp::Pg(d), true) => d.dispatch_on(&mut self.pg_slot, &envelope).await?,
                (Disp::Pg(d), false) => d.dispatch(&envelope).await?,
                (Disp::Lite(d), true) => d.dispatch_on(&mut self.lite_slot, &envelope).await?,
                (Disp::Lite(d), false) => d.dispatch(&envelope).await?,
            };
            if outcomes.len() != 1 {
                return Err(format!("{} consumer outcomes, expected 1", outcomes.len()).into());
            }
            check(outcomes.remove(0).result, redelivery)
        })
    }
}

/// Puts the keys of `set` in the inbox as processed, with their fingerprints: what a first
/// delivery of each left behind.
pub(crate) async fn insert_processed_pg(pool: &PgPool, set: &DupSet) -> Result<(), BoxError> {
    let (keys, hashes) = set.rows()?;
    for (keys, hashes) in keys.chunks(10_000).zip(hashes.chunks(10_000)) {
        sqlx::query(
            "INSERT INTO inbox_messages (consumer, message_key, message_name, payload_hash, \
               status, attempts, received_at, processed_at) \
             SELECT $1, k, $2, decode(h, 'hex'), 'processed', 1, now(), now() \
             FROM UNNEST($3::text[], $4::text[]) AS t(k, h) \
             ON CONFLICT DO NOTHING",
        )
        .bind(CONSUMER)
        .bind(MESSAGE)
        .bind(keys)
        .bind(hashes)
        .execute(pool)
        .await?;
    }
    Ok(())
}

/// [`insert_processed_pg`] for SQLite (one transaction).
pub(crate) async fn insert_processed_sqlite(
    pool: &SqlitePool,
    set: &DupSet,
) -> Result<(), BoxError> {
    let (keys, hashes) = set.rows()?;
    let mut tx = pool.begin().await?;
    for (key, hash) in keys.iter().zip(&hashes) {
        sqlx::query(
            "INSERT INTO inbox_messages (consumer, message_key, message_name, payload_hash, \
               status, attempts, received_at, processed_at) \
             VALUES (?1, ?2, ?3, ?4, 'processed', 1, strftime('%Y-%m-%dT%H:%M:%fZ', 'now'), \
               strftime('%Y-%m-%dT%H:%M:%fZ', 'now')) ON CONFLICT DO NOTHING",
        )
        .bind(CONSUMER)
        .bind(key)
        .bind(MESSAGE)
        .bind(hash)
        .execute(&mut *tx)
        .await?;
    }
    tx.commit().await?;
    Ok(())
}
