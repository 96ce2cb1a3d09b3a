//! Operating the outbox: statistics per destination and status, listing and inspecting rows,
//! retrying dead ones, discarding them. The retention purge of `sent` rows is part of the
//! shared [`crate::ops::admin::purge`]; the `inbox_runtime::ops::cli` entry point wraps all of them
//! (`stats`, `outbox list|show|retry|discard`, `purge`).
//!
//! Rows are named by their **message id** (the stable id the relay sends, what a broker's or a
//! consumer's logs show). Every function fails with the database's "no such table" error when
//! the outbox component is not migrated; [`installed`] tells first.
//!
//! ```no_run
//! # async fn demo(pool: sqlx::PgPool) -> Result<(), sqlx::Error> {
//! use inbox_runtime::store::OutboxStatus;
//! use inbox_runtime::outbox::admin;
//!
//! if admin::installed(&pool).await? {
//!     for row in admin::list(&pool, &[OutboxStatus::Dead], Some("orders"), 50).await? {
//!         println!("{} {:?}", row.message_id, row.last_error);
//!     }
//!     admin::retry_dead(&pool, Some("orders")).await?;
//! }
//! # Ok(()) }
//! ```

use sqlx::Pool;

use crate::store::{OutboxAdminStore as _, OutboxDatabase};

pub use crate::store::{OutboxEntry, OutboxStatsRow, OutboxStatus};

/// Whether the outbox table exists in the database behind `pool` (its
/// [`Component::Outbox`](crate::Component::Outbox) migrations ran).
///
/// # Errors
/// The database's error.
pub async fn installed<DB: OutboxDatabase>(pool: &Pool<DB>) -> Result<bool, sqlx::Error> {
    let mut conn = pool.acquire().await?;
    conn.outbox_installed().await
}

/// Per destination and status (`pending`, `sent`, `dead`; those with rows): how many rows and
/// the oldest `created_at` (database text form: [`crate::ops::admin::utc_time`] shows it in UTC),
/// by destination, then status.
///
/// # Errors
/// The database's error (a missing table when the outbox is not migrated).
pub async fn stats<DB: OutboxDatabase>(
    pool: &Pool<DB>,
) -> Result<Vec<OutboxStatsRow>, sqlx::Error> {
    let mut conn = pool.acquire().await?;
    conn.outbox_stats().await
}

/// Rows whose status is one of `statuses` (an empty slice lists nothing; at most the three
/// statuses), of `destination` or all, oldest first (by id, the publication order), at most
/// `limit`. Their payloads are not loaded ([`OutboxEntry::payload`] is `None`; [`show`] loads
/// one).
///
/// # Errors
/// The database's error (a missing table when the outbox is not migrated).
pub async fn list<DB: OutboxDatabase>(
    pool: &Pool<DB>,
    statuses: &[OutboxStatus],
    destination: Option<&str>,
    limit: u32,
) -> Result<Vec<OutboxEntry>, sqlx::Error> {
    let mut conn = pool.acquire().await?;
    conn.list_outbox(statuses, destination, i64::from(limit))
        .await
}

/// The row with `message_id`, every column and the payload, or `None`.
///
/// # Errors
/// The database's error (a missing table when the outbox is not migrated).
pub async fn show<DB: OutboxDatabase>(
    pool: &Pool<DB>,
    message_id: &str,
) -> Result<Option<OutboxEntry>, sqlx::Error> {
    let mut conn = pool.acquire().await?;
    conn.fetch_outbox(message_id).await
}

/// Sends the `dead` row with `message_id` again: it becomes `pending` with its attempts reset to
/// 0 and its lease and retry time cleared (its last error stays until it is sent), and relays
/// publish it with the **same** message id, in its aggregate's order (the rows after it wait for
/// it again). On PostgreSQL, listening relays are notified. Returns `false` if no dead row has
/// this message id (none at all, or one that is `pending` or `sent`: see [`show`]).
///
/// # Errors
/// The database's error (a missing table when the outbox is not migrated).
pub async fn retry<DB: OutboxDatabase>(
    pool: &Pool<DB>,
    message_id: &str,
) -> Result<bool, sqlx::Error> {
    let mut conn = pool.acquire().await?;
    Ok(conn.retry_outbox(Some(message_id), None).await? > 0)
}

/// [`retry`] for every `dead` row (of `destination`, if given). Returns how many.
///
/// # Errors
/// The database's error (a missing table when the outbox is not migrated).
pub async fn retry_dead<DB: OutboxDatabase>(
    pool: &Pool<DB>,
    destination: Option<&str>,
) -> Result<u64, sqlx::Error> {
    let mut conn = pool.acquire().await?;
    conn.retry_outbox(None, destination).await
}

/// Deletes the `dead` row with `message_id`: the message is never sent, and the rows after it of
/// its aggregate, which waited behind it, go out next. Returns `false` if no dead row has this
/// message id (a `pending` row may still be out with a relay, and a `sent` one is the retention
/// purge's).
///
/// # Errors
/// The database's error (a missing table when the outbox is not migrated).
pub async fn discard<DB: OutboxDatabase>(
    pool: &Pool<DB>,
    message_id: &str,
) -> Result<bool, sqlx::Error> {
    let mut conn = pool.acquire().await?;
    conn.discard_outbox(message_id).await
}
