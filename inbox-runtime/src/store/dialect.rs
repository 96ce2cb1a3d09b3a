//! What every SQL backend says about itself, whatever the component: its name, its migrations,
//! and what its driver's errors mean (a passing fault, one that can never succeed, a lost race
//! between concurrent transactions, a lock error worth retrying at once).
//!
//! One [`Dialect`] impl per backend folder; the capability-specific dialects (the inbox's
//! [`InboxDialect`](super::inbox::InboxDialect), …) build on it. Code outside `store/` asks
//! [`database_error_kind`] and [`Contention`], which go through every shipped backend's answer
//! (the table in `store/mod.rs`), so that it never names a backend.

use std::error::Error as StdError;

use sqlx::error::DatabaseError;

use super::sql::Sql;
use super::{Backend, Component};

/// A backend's schema migrations per component, each `(version, description, SQL)` in version
/// order (see [`Dialect::migrations`]).
pub(crate) struct Migrations {
    /// The inbox's tables (`migrations/inbox/`).
    pub(crate) inbox: &'static [(i64, &'static str, &'static str)],
    /// The outbox's (`migrations/outbox/`).
    pub(crate) outbox: &'static [(i64, &'static str, &'static str)],
    /// The source positions' (`migrations/positions/`).
    pub(crate) positions: &'static [(i64, &'static str, &'static str)],
}

/// A backend: the sqlx database it is, what its errors mean, and its schema migrations.
pub(crate) trait Dialect: Sql {
    /// The backend's name.
    const BACKEND: Backend;

    /// The driver's database error (what `sqlx::Error::Database` holds for this backend).
    type DatabaseError: DatabaseError;

    /// The schema migrations of each component: `(version, description, SQL)` in version order.
    const MIGRATIONS: Migrations;

    /// The schema migrations of `component` (from [`MIGRATIONS`](Self::MIGRATIONS)).
    fn migrations(component: Component) -> &'static [(i64, &'static str, &'static str)] {
        match component {
            Component::Inbox => Self::MIGRATIONS.inbox,
            Component::Outbox => Self::MIGRATIONS.outbox,
            Component::Positions => Self::MIGRATIONS.positions,
        }
    }

    /// What `error`'s code says about retrying the failed work, if anything.
    fn error_kind(error: &Self::DatabaseError) -> Option<ErrorKind> {
        let _ = error;
        None
    }

    /// The lost race between concurrent transactions `error` reports, if it is one.
    fn contention(error: &Self::DatabaseError) -> Option<Contention> {
        let _ = error;
        None
    }

    /// Whether [`Dialect::lock_error`] ever answers: the store's operations then run in the
    /// retry loop of [`retry`](super::retry) (otherwise straight, with nothing around them).
    const LOCK_RETRIES: bool = false;

    /// `Some(label)` if the store retries a statement that failed with `error` by itself (see
    /// [`retry`](super::retry)): a lock error that ended only the statement or the transaction
    /// the store opened for it. The label names the error in the log and the metric
    /// `inbox_store_lock_retries_total`.
    fn lock_error(error: &Self::DatabaseError) -> Option<&'static str> {
        let _ = error;
        None
    }
}

/// What a database error's code says about retrying the failed work.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum ErrorKind {
    /// A passing fault (a lost race, a lost connection, a server shutting down): retry at once.
    Transient,
    /// The same statement fails the same way every time.
    Permanent,
}

/// A database failure that concurrent transactions cause one another: the transaction lost a
/// deadlock, a serialization conflict or a lock wait.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Contention {
    /// PostgreSQL `40P01`, MySQL 1213.
    Deadlock,
    /// PostgreSQL `40001`.
    Serialization,
    /// PostgreSQL `55P03` (`lock_timeout`), MySQL 1205 (`innodb_lock_wait_timeout`).
    LockTimeout,
}

/// One backend's answers about errors, as plain functions (the table in `store/mod.rs`).
#[derive(Clone, Copy)]
pub(crate) struct ErrorHooks {
    kind: fn(&dyn DatabaseError) -> Option<Option<ErrorKind>>,
    contention: fn(&dyn DatabaseError) -> Option<Option<Contention>>,
    in_chain: fn(&(dyn StdError + 'static)) -> Option<Option<Contention>>,
}

impl ErrorHooks {
    /// `D`'s answers; each is `None` for an error that is not `D`'s driver's.
    pub(crate) const fn of<D: Dialect>() -> Self {
        Self {
            kind: |error| {
                error
                    .try_downcast_ref::<D::DatabaseError>()
                    .map(D::error_kind)
            },
            contention: |error| {
                error
                    .try_downcast_ref::<D::DatabaseError>()
                    .map(D::contention)
            },
            in_chain: |error| error.downcast_ref::<D::DatabaseError>().map(D::contention),
        }
    }
}

/// What the code of `error` (any shipped backend's) says about retrying the failed work.
pub(crate) fn database_error_kind(error: &dyn DatabaseError) -> Option<ErrorKind> {
    super::ERROR_HOOKS
        .iter()
        .find_map(|hooks| (hooks.kind)(error))
        .flatten()
}

impl Contention {
    /// The label of the `inbox_batch_contention_total` metric.
    pub(crate) fn as_str(self) -> &'static str {
        match self {
            Contention::Deadlock => "deadlock",
            Contention::Serialization => "serialization",
            Contention::LockTimeout => "lock_timeout",
        }
    }

    /// The contention `error` is, if it is one.
    pub(crate) fn of_sqlx(error: &sqlx::Error) -> Option<Contention> {
        match error {
            sqlx::Error::Database(db) => super::ERROR_HOOKS
                .iter()
                .find_map(|hooks| (hooks.contention)(&**db))
                .flatten(),
            _ => None,
        }
    }

    /// The contention anywhere in `error`'s `source()` chain (a `sqlx::Error`, or the database
    /// error itself behind a transparent wrapper), if any.
    pub(crate) fn in_chain(error: &(dyn StdError + 'static)) -> Option<Contention> {
        let mut next = Some(error);
        while let Some(error) = next {
            if let Some(error) = error.downcast_ref::<sqlx::Error>() {
                return Self::of_sqlx(error);
            }
            if let Some(found) = super::ERROR_HOOKS
                .iter()
                .find_map(|hooks| (hooks.in_chain)(error))
            {
                return found;
            }
            next = error.source();
        }
        None
    }
}

/// `D`'s driver error inside `error`, if it is one.
pub(crate) fn database_error<D: Dialect>(error: &sqlx::Error) -> Option<&D::DatabaseError> {
    match error {
        sqlx::Error::Database(db) => db.try_downcast_ref::<D::DatabaseError>(),
        _ => None,
    }
}

/// The contention `error` is on `D`, if it is one.
pub(crate) fn contention<D: Dialect>(error: &sqlx::Error) -> Option<Contention> {
    database_error::<D>(error).and_then(D::contention)
}

/// A component's schema migrations, `(version, description, SQL)`, from the files in the
/// invoking backend folder's `migrations/<component>/`:
/// `migrations! { "inbox": 1 "inbox" "0001_inbox.sql", … }`.
macro_rules! migrations {
    ($component:literal: $($version:literal $description:literal $file:literal),+ $(,)?) => {
        &[$((
            $version,
            $description,
            include_str!(concat!("migrations/", $component, "/", $file)),
        )),+]
    };
}
pub(crate) use migrations;
