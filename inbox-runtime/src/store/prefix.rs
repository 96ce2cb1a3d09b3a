//! The runtime's tables under a table prefix of the user's choice ([`TablePrefix`]): services
//! that share one MySQL/MariaDB or SQLite database keep their inboxes, outboxes and positions
//! apart.
//!
//! How: every statement the stores run goes through `store/sql.rs`, and there, inside a
//! [`TablePrefix::scope`], each of the runtime's own names in the statement's text (the words
//! that start with `inbox_` or `_inbox_`: tables, indexes, constraints) is rewritten to carry the
//! prefix, on word boundaries. The migrations run through the same rewrite, and record their
//! versions in prefixed tables too.

use std::fmt;
use std::future::Future;
use std::sync::Arc;

use sqlx::{AssertSqlSafe, SqlSafeStr as _, SqlStr};

tokio::task_local! {
    /// The prefix of the scope the current task runs in.
    static PREFIX: TablePrefix;
}

/// The longest name, in bytes, the runtime gives a table, an index or a constraint on MySQL or
/// SQLite (`inbox_outbox_aggregates_written_at`, an index); a unit test checks it against every
/// migration.
const LONGEST_NAME: usize = 34;

/// MySQL's and MariaDB's limit on a table's, an index's or a constraint's name, in bytes
/// ("Identifier Length Limits", MySQL Reference Manual 11.2.1). SQLite has none; the same
/// limit holds there, so that a prefix works on both.
const IDENTIFIER_LIMIT: usize = 64;

/// A prefix for the runtime's tables (`inbox_messages`, `inbox_aggregate_state`,
/// `inbox_rejections`, `inbox_outbox`, `inbox_outbox_aggregates`, `inbox_positions`), their
/// indexes and constraints and their migration histories (`_inbox_migrations`, …), so that
/// services sharing one MySQL/MariaDB or SQLite database keep theirs apart, each
/// deduplicating on its own: with `billing_`, the inbox is `billing_inbox_messages`, its
/// versions are recorded in `billing__inbox_migrations`.
///
/// **Scope.** A prefix applies to whatever runs inside [`scope`](Self::scope): every statement of
/// the runtime awaited there ([`migrate`](crate::migrate), an `#[idempotent]` handler called
/// directly, a [`Dispatcher`](crate::Dispatcher), a [`Worker`](crate::Worker), a
/// [`Relay`](crate::Relay), [`Outbox`](crate::Outbox) publishes, a
/// [`ClaimSession`](crate::ClaimSession), the admin API and CLI, the console) runs on the prefixed
/// tables. A [`Dispatcher`](crate::Dispatcher) (and the [`Worker`](crate::Worker) over it), a
/// [`Relay`](crate::Relay), a console (`ops::console`, feature `console`) and an
/// `http::IdempotencyLayer` (feature `http`) built inside a scope keep its prefix wherever they
/// later run (a task of their own, the HTTP server's request tasks, the Kafka consumer's thread; a
/// console serves its dispatcher's prefix if it has one, so that what it lists is what its buttons
/// replay), and the runtime's own background tasks started inside a scope keep it too (the
/// parked-message sweep, the retention purger). A [`ClaimedKey`](crate::protocol::ClaimedKey)
/// opened inside a scope completes, fails and abandons on that prefix's tables wherever that is
/// awaited (the runtime calls you make yourself on its connection, an [`Outbox`](crate::Outbox)
/// publish, take the scope they are awaited in), and `ops::cli::execute_with` (feature `cli`) runs
/// every command in its dispatcher's prefix. A task that you spawn yourself (`tokio::spawn`) around
/// a direct call, a [`ClaimSession`](crate::ClaimSession) or the admin API starts outside any
/// scope: run its future inside [`scope`](Self::scope) too, or it uses the unprefixed tables. Wrap
/// a service's whole `main` future once, and nothing else needs to know. The dedupe caches' keys
/// carry the prefix too, so that services sharing one Redis cache never answer for each other.
///
/// Why a scope and not an argument: the store's statements run on a plain connection
/// (`&mut MySqlConnection`), which carries no user data, and a handler called directly has
/// no pool or dispatcher to carry one; a scope reaches them all without changing any
/// signature. Your handlers' own SQL is yours: the prefix never touches it.
///
/// **PostgreSQL** keeps a service's tables in a schema of its own instead: see
/// [`PgSchema`](crate::PgSchema). On MySQL/MariaDB a database per service (the connection
/// URL's database) is the analogue, with your business tables in it too; a prefix keeps one
/// database for all.
///
/// The prefix is checked when the value is built and can be nothing else: 1 to
/// [`MAX_BYTES`](Self::MAX_BYTES) bytes, ASCII lowercase letters, digits and `_`, not starting
/// with a digit, and not starting with `inbox_` or `_inbox_` (the runtime's own names). Lowercase
/// only: MySQL on Windows and macOS (`lower_case_table_names`) folds table names, so `Billing_`
/// and `billing_` would be one service's tables there and two on Linux.
///
/// ```no_run
/// # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
/// use inbox_runtime::store::TablePrefix;
///
/// let prefix = TablePrefix::new("billing_")?;
/// let pool = sqlx::MySqlPool::connect("mysql://billing@db/shop").await?;
/// prefix
///     .scope(async {
///         inbox_runtime::migrate(&pool).await?; // billing_inbox_messages, …
///         // … build the dispatcher, the worker, the relay here and run them
///         Ok::<_, Box<dyn std::error::Error>>(())
///     })
///     .await?;
/// # Ok(()) }
/// ```
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct TablePrefix {
    prefix: Arc<str>,
}

/// Why a prefix was refused by [`TablePrefix::new`].
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum TablePrefixError {
    /// The prefix is empty.
    Empty,
    /// The prefix is longer than [`TablePrefix::MAX_BYTES`] (`bytes` long): the longest name
    /// it would give would pass MySQL's 64-byte identifier limit.
    TooLong {
        /// The prefix's length, in bytes.
        bytes: usize,
    },
    /// The prefix holds a character other than an ASCII lowercase letter, digit or `_`, or
    /// starts with a digit.
    Character {
        /// The first character refused.
        found: char,
        /// Its byte offset in the prefix.
        at: usize,
    },
    /// The prefix starts with `inbox_` or `_inbox_`, as the runtime's own names do.
    Reserved,
}

impl fmt::Display for TablePrefixError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Empty => f.write_str("table prefix is empty"),
            Self::TooLong { bytes } => write!(
                f,
                "table prefix is {bytes} bytes long; at most {} bytes, so that the longest \
                 table or index name ({LONGEST_NAME} bytes without it) stays within MySQL's \
                 {IDENTIFIER_LIMIT}-byte identifier limit",
                TablePrefix::MAX_BYTES
            ),
            Self::Character { found, at } => write!(
                f,
                "table prefix holds {found:?} at byte {at}; only ASCII lowercase letters, \
                 digits and '_' are allowed, and not a digit first"
            ),
            Self::Reserved => f.write_str(
                "table prefix starts with 'inbox_' or '_inbox_', as the runtime's own table \
                 names do",
            ),
        }
    }
}

impl std::error::Error for TablePrefixError {}

impl TablePrefix {
    /// The longest prefix: 30 bytes (MySQL's 64-byte identifier limit less the runtime's
    /// longest name, 34 bytes).
    pub const MAX_BYTES: usize = IDENTIFIER_LIMIT - LONGEST_NAME;

    /// The prefix `prefix` (used as given: `billing_` gives `billing_inbox_messages`,
    /// `billing` gives `billinginbox_messages`).
    ///
    /// # Errors
    /// [`TablePrefixError`] if `prefix` is empty, holds anything but ASCII lowercase letters,
    /// digits and `_` (or starts with a digit), is longer than [`MAX_BYTES`](Self::MAX_BYTES),
    /// or starts with `inbox_` or `_inbox_`.
    pub fn new(prefix: &str) -> Result<Self, TablePrefixError> {
        if prefix.is_empty() {
            return Err(TablePrefixError::Empty);
        }
        if let Some((at, found)) = prefix.char_indices().find(|&(at, c)| {
            !(c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_')
                || (at == 0 && c.is_ascii_digit())
        }) {
            return Err(TablePrefixError::Character { found, at });
        }
        if prefix.len() > Self::MAX_BYTES {
            return Err(TablePrefixError::TooLong {
                bytes: prefix.len(),
            });
        }
        if is_runtime_name(prefix) {
            return Err(TablePrefixError::Reserved);
        }
        Ok(Self {
            prefix: prefix.into(),
        })
    }

    /// The prefix, as given.
    pub fn as_str(&self) -> &str {
        &self.prefix
    }

    /// The name of the runtime's table (or index) `name` under this prefix:
    /// `billing_` and `inbox_messages` give `billing_inbox_messages`.
    pub fn table(&self, name: &str) -> String {
        format!("{}{name}", self.prefix)
    }

    /// `future`, with every statement the runtime runs while it is polled on the tables of this
    /// prefix (see the [type's documentation](Self)). Scopes nest: the innermost applies.
    pub fn scope<F: Future>(&self, future: F) -> impl Future<Output = F::Output> {
        PREFIX.scope(self.clone(), future)
    }

    /// The prefix of the scope the current task runs in, if any.
    pub fn current() -> Option<TablePrefix> {
        PREFIX.try_with(Clone::clone).ok()
    }

    /// `sql` with each of the runtime's names carrying this prefix.
    pub(crate) fn rewrite(&self, sql: &str) -> String {
        let bytes = sql.as_bytes();
        let mut out = String::with_capacity(sql.len() + 4 * self.prefix.len());
        let mut last = 0;
        let mut at = 0;
        while at < bytes.len() {
            if !is_word(bytes[at]) {
                at += 1;
                continue;
            }
            let start = at;
            while at < bytes.len() && is_word(bytes[at]) {
                at += 1;
            }
            // A MySQL user variable (`@inbox_claim_token`) is the session's, not a table.
            let variable = start > 0 && bytes[start - 1] == b'@';
            if !variable && is_runtime_name(&sql[start..at]) {
                out.push_str(&sql[last..start]);
                out.push_str(&self.prefix);
                last = start;
            }
        }
        out.push_str(&sql[last..]);
        out
    }
}

impl fmt::Display for TablePrefix {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.prefix)
    }
}

/// Whether `byte` is part of an unquoted identifier.
fn is_word(byte: u8) -> bool {
    byte.is_ascii_alphanumeric() || byte == b'_'
}

/// Whether `word` is (or starts like) one of the runtime's own names.
fn is_runtime_name(word: &str) -> bool {
    word.starts_with("inbox_") || word.starts_with("_inbox_")
}

/// `sql`, rewritten for the prefix of the current scope if there is one (else as it is).
pub(crate) fn prefixed(sql: SqlStr) -> SqlStr {
    match PREFIX.try_with(|prefix| prefix.rewrite(sql.as_str())) {
        // The text is the dialect's (checked SQL) with checked prefixes added before names.
        Ok(rewritten) => AssertSqlSafe(rewritten).into_sql_str(),
        Err(_) => sql,
    }
}

/// Whether a prefix is in scope (the statement must then go through [`prefixed`]).
pub(crate) fn in_scope() -> bool {
    PREFIX.try_with(|_| ()).is_ok()
}

/// A migration's version table under the current scope's prefix.
pub(crate) fn version_table(table: &'static str) -> std::borrow::Cow<'static, str> {
    match TablePrefix::current() {
        Some(prefix) => prefix.table(table).into(),
        None => table.into(),
    }
}

/// `future` in `prefix`'s scope, or as it is if `None`: for work the runtime carries to a thread
/// of its own (the Kafka source's rebalance callbacks).
pub(crate) async fn within<F: Future>(prefix: Option<&TablePrefix>, future: F) -> F::Output {
    match prefix {
        Some(prefix) => PREFIX.scope(prefix.clone(), future).await,
        None => future.await,
    }
}

/// `tokio::spawn` of `future`, in the current scope's prefix if there is one: for the
/// runtime's own background tasks.
pub(crate) fn spawn<F>(future: F) -> tokio::task::JoinHandle<F::Output>
where
    F: Future + Send + 'static,
    F::Output: Send + 'static,
{
    match TablePrefix::current() {
        Some(prefix) => tokio::spawn(PREFIX.scope(prefix, future)),
        None => tokio::spawn(future),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The refusal of `found` at byte `at`.
    fn character(found: char, at: usize) -> TablePrefixError {
        TablePrefixError::Character { found, at }
    }

    #[test]
    fn prefixes_are_checked() {
        assert_eq!(TablePrefix::new("billing_").unwrap().as_str(), "billing_");
        let too_long = "a".repeat(31);
        for (prefix, error) in [
            ("", TablePrefixError::Empty),
            ("billing; DROP TABLE accounts", character(';', 7)),
            ("Billing_", character('B', 0)),
            ("bill`ing", character('`', 4)),
            ("2billing", character('2', 0)),
            ("bïlling", character('ï', 1)),
            (&too_long, TablePrefixError::TooLong { bytes: 31 }),
            ("inbox_a", TablePrefixError::Reserved),
            ("_inbox_", TablePrefixError::Reserved),
        ] {
            assert_eq!(TablePrefix::new(prefix), Err(error), "{prefix}");
        }
        assert!(TablePrefix::new(&"a".repeat(30)).is_ok());
        assert_eq!(
            TablePrefix::new("Billing_").unwrap_err().to_string(),
            "table prefix holds 'B' at byte 0; only ASCII lowercase letters, digits and '_' are \
             allowed, and not a digit first"
        );
    }

    #[test]
    fn names_are_rewritten_on_word_boundaries() {
        let prefix = TablePrefix::new("billing_").unwrap();
        assert_eq!(
            prefix.rewrite(
                "UPDATE inbox_messages SET x = 1 WHERE claim_token <=> @inbox_claim_token \
                 AND EXISTS (SELECT 1 FROM inbox_outbox_aggregates a) -- myinbox_messages"
            ),
            "UPDATE billing_inbox_messages SET x = 1 WHERE claim_token <=> @inbox_claim_token \
             AND EXISTS (SELECT 1 FROM billing_inbox_outbox_aggregates a) -- myinbox_messages"
        );
        assert_eq!(
            prefix.rewrite("CREATE INDEX inbox_rejections_new ON inbox_rejections (x)"),
            "CREATE INDEX billing_inbox_rejections_new ON billing_inbox_rejections (x)"
        );
        assert_eq!(
            prefix.table("_inbox_migrations"),
            "billing__inbox_migrations"
        );
    }

    /// The dedupe caches' keys carry the prefix in scope: services sharing a cache under two
    /// prefixes never answer for each other.
    #[tokio::test]
    async fn cache_keys_carry_the_prefix() {
        let billing = TablePrefix::new("billing_").unwrap();
        assert_eq!(crate::cache::cache_key("ledger", "k:1"), "6:ledger:k:1");
        assert_eq!(
            billing
                .scope(async { crate::cache::cache_key("ledger", "k:1") })
                .await,
            "billing_/6:ledger:k:1"
        );
    }

    /// Every name the migrations create fits [`LONGEST_NAME`], and the longest
    /// is that long.
    #[test]
    fn the_longest_name_is_known() {
        use crate::store::Component;
        use crate::store::dialect::Dialect;
        let mut longest = 0;
        for component in [Component::Inbox, Component::Outbox, Component::Positions] {
            let sql = <sqlx::MySql as Dialect>::migrations(component)
                .iter()
                .chain(<sqlx::Sqlite as Dialect>::migrations(component))
                .chain(<sqlx::Postgres as Dialect>::migrations(component));
            for (_, _, sql) in sql {
                for word in sql.split(|c: char| !(c.is_ascii_alphanumeric() || c == '_')) {
                    if is_runtime_name(word) {
                        longest = longest.max(word.len());
                    }
                }
            }
            longest = longest.max(component.version_table().len());
        }
        assert_eq!(longest, LONGEST_NAME);
    }
}
