//! The runtime's tables in a PostgreSQL schema of the user's choice ([`PgSchema`]).

use std::fmt;

use sqlx::PgPool;
use sqlx::postgres::PgConnectOptions;

/// A PostgreSQL schema for the runtime's tables (`inbox_messages`, `inbox_rejections`,
/// `inbox_outbox`, `inbox_positions` and their migration histories), so that services sharing
/// one database keep theirs apart, each deduplicating on its own.
///
/// How: the runtime's statements name their tables unqualified, so they resolve through the
/// session's `search_path` (PostgreSQL, "Schema Search Path", section 5.9.3 of the manual).
/// [`connect_options`](Self::connect_options) sets the `search_path` of every connection of a
/// pool to this schema **alone**: the runtime's tables are created in and read from this
/// schema, and so are your handlers' unqualified names; name a table of another schema
/// qualified (`public.accounts`). Nothing falls back to `public`: a schema that does not exist
/// makes [`migrate`](crate::migrate) fail (SQLSTATE `3F000`, "no schema has been selected to
/// create in") and every delivery fail (`42P01`, the table does not exist) instead of running
/// on another service's tables, and a component not migrated into the schema (the outbox, say)
/// is missing, not borrowed from `public`. [`create`](Self::create) creates the schema; run it
/// before [`migrate`](crate::migrate).
///
/// The name is checked when the value is built and can be nothing else: 1 to 63 bytes
/// (PostgreSQL's identifier limit), ASCII letters, digits and `_`, not starting with a digit,
/// not starting with `pg_` (reserved for system schemas). It is double-quoted wherever it is
/// written into SQL or the `search_path`, so its case is kept (`Billing` and `billing` are
/// two schemas).
///
/// What stays shared between schemas of one database: the outbox's `LISTEN`/`NOTIFY` channel
/// (a relay may be woken by another schema's commit: it then finds nothing due and waits
/// again) and the advisory lock of migrations (two services migrate one after the other).
///
/// ```no_run
/// # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
/// use inbox_runtime::PgSchema;
/// use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
///
/// let schema = PgSchema::new("billing")?;
/// let options: PgConnectOptions = "postgres://billing@db/shop".parse()?;
/// let pool = PgPoolOptions::new().connect_with(schema.connect_options(options)).await?;
/// schema.create(&pool).await?;
/// inbox_runtime::migrate(&pool).await?; // billing.inbox_messages, …
/// # Ok(()) }
/// ```
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct PgSchema {
    name: String,
}

/// Why a schema name was refused by [`PgSchema::new`].
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum PgSchemaError {
    /// The name is empty.
    Empty,
    /// The name is longer than PostgreSQL's 63-byte identifier limit (`bytes` long).
    TooLong {
        /// The name's length, in bytes.
        bytes: usize,
    },
    /// The name holds a character other than an ASCII letter, digit or `_`, or starts with a
    /// digit.
    Character {
        /// The first character refused.
        found: char,
        /// Its byte offset in the name.
        at: usize,
    },
    /// The name starts with `pg_`, which PostgreSQL reserves for system schemas.
    Reserved,
}

impl fmt::Display for PgSchemaError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Empty => f.write_str("schema name is empty"),
            Self::TooLong { bytes } => write!(
                f,
                "schema name is {bytes} bytes long; PostgreSQL identifiers have at most {} bytes",
                PgSchema::MAX_BYTES
            ),
            Self::Character { found, at } => write!(
                f,
                "schema name holds {found:?} at byte {at}; only ASCII letters, digits and '_' \
                 are allowed, and not a digit first"
            ),
            Self::Reserved => f.write_str(
                "schema name starts with 'pg_', which PostgreSQL reserves for system schemas",
            ),
        }
    }
}

impl std::error::Error for PgSchemaError {}

impl PgSchema {
    /// The longest name: 63 bytes (PostgreSQL's `NAMEDATALEN` - 1).
    pub const MAX_BYTES: usize = 63;

    /// The schema `name`.
    ///
    /// # Errors
    /// [`PgSchemaError`] if `name` is empty, longer than [`MAX_BYTES`](Self::MAX_BYTES), holds
    /// anything but ASCII letters, digits and `_` (or starts with a digit), or starts with
    /// `pg_` (any case).
    pub fn new(name: &str) -> Result<Self, PgSchemaError> {
        if name.is_empty() {
            return Err(PgSchemaError::Empty);
        }
        if let Some((at, found)) = name.char_indices().find(|&(at, c)| {
            !(c.is_ascii_alphanumeric() || c == '_') || (at == 0 && c.is_ascii_digit())
        }) {
            return Err(PgSchemaError::Character { found, at });
        }
        if name.len() > Self::MAX_BYTES {
            return Err(PgSchemaError::TooLong { bytes: name.len() });
        }
        if name.get(..3).is_some_and(|p| p.eq_ignore_ascii_case("pg_")) {
            return Err(PgSchemaError::Reserved);
        }
        Ok(Self {
            name: name.to_owned(),
        })
    }

    /// The schema's name, as given.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The name double-quoted, as SQL and `search_path` take it (the name holds no quote).
    fn quoted(&self) -> String {
        format!("\"{}\"", self.name)
    }

    /// `options` with the session's `search_path` set to this schema alone (a connection
    /// startup parameter: every connection of a pool built with them has it, from its first
    /// statement on; `pg_catalog` is searched first, as always). Overrides a `search_path` set
    /// in `options` before.
    pub fn connect_options(&self, options: PgConnectOptions) -> PgConnectOptions {
        options.options([("search_path", self.quoted())])
    }

    /// `CREATE SCHEMA IF NOT EXISTS` this schema, in its own statement on `pool`.
    ///
    /// # Errors
    /// The database's error: the role may not create schemas (`42501`), the connection failed.
    pub async fn create(&self, pool: &PgPool) -> Result<(), sqlx::Error> {
        let sql = format!("CREATE SCHEMA IF NOT EXISTS {}", self.quoted());
        // The name is checked (letters, digits, `_`) and quoted: no user text reaches SQL
        // otherwise.
        sqlx::raw_sql(sqlx::AssertSqlSafe(sql))
            .execute(pool)
            .await?;
        Ok(())
    }
}

impl fmt::Display for PgSchema {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.name)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The refusal of `found` at byte `at`.
    fn character(found: char, at: usize) -> PgSchemaError {
        PgSchemaError::Character { found, at }
    }

    #[test]
    fn names_are_checked() {
        assert_eq!(PgSchema::new("billing").unwrap().name(), "billing");
        assert_eq!(
            PgSchema::new("Billing_2").unwrap().quoted(),
            "\"Billing_2\""
        );
        let too_long = "a".repeat(64);
        for (name, error) in [
            ("", PgSchemaError::Empty),
            ("billing; DROP TABLE accounts", character(';', 7)),
            ("bill\"ing", character('"', 4)),
            ("1billing", character('1', 0)),
            ("bïlling", character('ï', 1)),
            (&too_long, PgSchemaError::TooLong { bytes: 64 }),
            ("PG_catalog", PgSchemaError::Reserved),
        ] {
            assert_eq!(PgSchema::new(name), Err(error), "{name}");
        }
        assert!(PgSchema::new(&"a".repeat(63)).is_ok());
    }
}
