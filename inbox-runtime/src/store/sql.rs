//! The sqlx glue every SQL backend shares, written once: run a statement with backend-neutral
//! parameters ([`Arg`]) and read typed columns, on any sqlx database whose types cover them.
//!
//! Generic store code is written against [`Sql`] (with a backend's dialect trait on top), so
//! the Rust around each statement exists once; a backend supplies only its SQL text and its
//! behavioural differences. [`Sql`] is implemented by one blanket impl for every
//! `sqlx::Database` that satisfies the bounds below (PostgreSQL, SQLite, MySQL/MariaDB).

use sqlx::{
    Database, Decode, Encode, Execute as _, Executor, QueryBuilder, Row as _, SqlSafeStr, SqlStr,
    Type,
};

use super::prefix::{in_scope, prefixed};
use crate::BoxFuture;

/// One bound parameter, backend-neutral. `None` binds SQL `NULL` of the variant's type.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) enum Arg<'a> {
    /// Text (`TEXT`, `VARCHAR`).
    Text(Option<&'a str>),
    /// Bytes (`BYTEA`, `BLOB`).
    Bytes(Option<&'a [u8]>),
    /// A 32-bit integer (`INTEGER`, `INT`).
    I32(Option<i32>),
    /// A 64-bit integer (`BIGINT`).
    I64(Option<i64>),
    /// A double (`DOUBLE PRECISION`, `REAL`, `DOUBLE`).
    F64(Option<f64>),
    /// A boolean.
    Bool(Option<bool>),
}

/// `From` a value, and from an `Option` of it (`None`: `NULL`), for each variant.
macro_rules! arg_from {
    ($($ty:ty => $variant:ident),* $(,)?) => {$(
        impl<'a> From<$ty> for Arg<'a> {
            fn from(value: $ty) -> Self {
                Arg::$variant(Some(value))
            }
        }

        impl<'a> From<Option<$ty>> for Arg<'a> {
            fn from(value: Option<$ty>) -> Self {
                Arg::$variant(value)
            }
        }
    )*};
}

arg_from!(&'a str => Text, &'a [u8] => Bytes, i32 => I32, i64 => I64, f64 => F64, bool => Bool);

/// A statement's text: a `&'static str` from a dialect, or SQL assembled at run time from such
/// pieces (never from a key or payload: those are always bound).
pub(crate) fn text(sql: impl SqlSafeStr) -> SqlStr {
    sql.into_sql_str()
}

/// What generic store code needs of a sqlx database. One blanket impl covers every database
/// whose types encode and decode the [`Arg`] variants and the column types read here.
pub(crate) trait Sql: Database {
    /// Runs `sql` with `args`; the first row, if any.
    fn fetch_optional<'c>(
        conn: &'c mut Self::Connection,
        sql: SqlStr,
        args: &'c [Arg<'c>],
    ) -> BoxFuture<'c, Result<Option<Self::Row>, sqlx::Error>>;

    /// Runs `sql` with `args`; exactly one row (else `RowNotFound`).
    fn fetch_one<'c>(
        conn: &'c mut Self::Connection,
        sql: SqlStr,
        args: &'c [Arg<'c>],
    ) -> BoxFuture<'c, Result<Self::Row, sqlx::Error>>;

    /// Runs `sql` with `args`; every row.
    fn fetch_all<'c>(
        conn: &'c mut Self::Connection,
        sql: SqlStr,
        args: &'c [Arg<'c>],
    ) -> BoxFuture<'c, Result<Vec<Self::Row>, sqlx::Error>>;

    /// Runs `sql` with `args`; the rows it affected.
    fn execute<'c>(
        conn: &'c mut Self::Connection,
        sql: SqlStr,
        args: &'c [Arg<'c>],
    ) -> BoxFuture<'c, Result<u64, sqlx::Error>>;

    /// Binds `arg` in a statement being assembled (its placeholder in the dialect's style).
    fn push_arg(builder: &mut QueryBuilder<Self>, arg: Arg<'_>);

    /// Runs an assembled statement; every row.
    fn fetch_all_built<'c>(
        conn: &'c mut Self::Connection,
        builder: &'c mut QueryBuilder<Self>,
    ) -> BoxFuture<'c, Result<Vec<Self::Row>, sqlx::Error>>;

    /// Runs an assembled statement; the rows it affected.
    fn execute_built<'c>(
        conn: &'c mut Self::Connection,
        builder: &'c mut QueryBuilder<Self>,
    ) -> BoxFuture<'c, Result<u64, sqlx::Error>>;

    /// Runs `sql` through the simple query protocol (no parameters, never prepared): for
    /// statements such as `ROLLBACK` or `SET …` that a server may not prepare. The rows it
    /// affected.
    fn execute_raw<'c>(
        conn: &'c mut Self::Connection,
        sql: SqlStr,
    ) -> BoxFuture<'c, Result<u64, sqlx::Error>>;

    /// Column `index` as text, lent to `read` without a copy (`None` for `NULL`).
    fn str_with<R>(
        row: &Self::Row,
        index: usize,
        read: impl FnOnce(Option<&str>) -> R,
    ) -> Result<R, sqlx::Error>;

    /// Column `index` as text (`None` for `NULL`).
    fn text(row: &Self::Row, index: usize) -> Result<Option<String>, sqlx::Error>;
    /// Column `index` as bytes.
    fn bytes(row: &Self::Row, index: usize) -> Result<Option<Vec<u8>>, sqlx::Error>;
    /// Column `index` as a 32-bit integer.
    fn i32(row: &Self::Row, index: usize) -> Result<Option<i32>, sqlx::Error>;
    /// Column `index` as a 64-bit integer.
    fn i64(row: &Self::Row, index: usize) -> Result<Option<i64>, sqlx::Error>;
    /// Column `index` as a double.
    fn f64(row: &Self::Row, index: usize) -> Result<Option<f64>, sqlx::Error>;
    /// Column `index` as a boolean.
    fn bool(row: &Self::Row, index: usize) -> Result<Option<bool>, sqlx::Error>;

    /// Column `index`, which must not be `NULL`, as text.
    fn text_required(row: &Self::Row, index: usize) -> Result<String, sqlx::Error> {
        Self::text(row, index)?.ok_or_else(|| null_column(index))
    }

    /// Column `index`, which must not be `NULL`, as a 64-bit integer.
    fn i64_required(row: &Self::Row, index: usize) -> Result<i64, sqlx::Error> {
        Self::i64(row, index)?.ok_or_else(|| null_column(index))
    }

    /// Column `index`, which must not be `NULL`, read by `read` (one of the typed reads).
    fn required<T>(
        row: &Self::Row,
        index: usize,
        read: fn(&Self::Row, usize) -> Result<Option<T>, sqlx::Error>,
    ) -> Result<T, sqlx::Error> {
        read(row, index)?.ok_or_else(|| null_column(index))
    }
}

/// The error for a `NULL` where a statement guarantees a value.
fn null_column(index: usize) -> sqlx::Error {
    sqlx::Error::ColumnDecode {
        index: index.to_string(),
        source: "unexpected NULL".into(),
    }
}

/// `sql`, rewritten for the table prefix in scope (see [`prefixed`]).
pub(crate) fn prefixed_text(sql: &'static str) -> SqlStr {
    prefixed(text(sql))
}

/// An assembled statement's text, rewritten for the table prefix in scope (see
/// [`prefixed`]), and its bound arguments.
fn take_built<DB>(builder: &mut QueryBuilder<DB>) -> Result<(SqlStr, DB::Arguments), sqlx::Error>
where
    DB: Database,
    DB::Arguments: sqlx::IntoArguments<DB>,
{
    let mut query = builder.build();
    let args = query.take_arguments().map_err(sqlx::Error::Encode)?;
    Ok((prefixed(query.sql()), args.unwrap_or_default()))
}

/// The query of `sql` with `args` bound in order.
fn query<'q, DB>(sql: SqlStr, args: &[Arg<'_>]) -> sqlx::query::Query<'q, DB, DB::Arguments>
where
    DB: Database,
    for<'a> Option<&'a str>: Encode<'a, DB> + Type<DB>,
    for<'a> Option<&'a [u8]>: Encode<'a, DB> + Type<DB>,
    for<'a> Option<i32>: Encode<'a, DB> + Type<DB>,
    for<'a> Option<i64>: Encode<'a, DB> + Type<DB>,
    for<'a> Option<f64>: Encode<'a, DB> + Type<DB>,
    for<'a> Option<bool>: Encode<'a, DB> + Type<DB>,
{
    let mut query = sqlx::query::<DB>(sql);
    for arg in args {
        query = match *arg {
            Arg::Text(v) => query.bind(v),
            Arg::Bytes(v) => query.bind(v),
            Arg::I32(v) => query.bind(v),
            Arg::I64(v) => query.bind(v),
            Arg::F64(v) => query.bind(v),
            Arg::Bool(v) => query.bind(v),
        };
    }
    query
}

impl<DB> Sql for DB
where
    DB: Database,
    for<'c> &'c mut DB::Connection: Executor<'c, Database = DB>,
    DB::Arguments: sqlx::IntoArguments<DB>,
    DB::QueryResult: RowsAffected,
    for<'a> Option<&'a str>: Encode<'a, DB> + Type<DB>,
    for<'a> Option<&'a [u8]>: Encode<'a, DB> + Type<DB>,
    for<'a> Option<i32>: Encode<'a, DB> + Type<DB>,
    for<'a> Option<i64>: Encode<'a, DB> + Type<DB>,
    for<'a> Option<f64>: Encode<'a, DB> + Type<DB>,
    for<'a> Option<bool>: Encode<'a, DB> + Type<DB>,
    for<'r> Option<String>: Decode<'r, DB> + Type<DB>,
    for<'r> Option<&'r str>: Decode<'r, DB> + Type<DB>,
    for<'r> Option<Vec<u8>>: Decode<'r, DB> + Type<DB>,
    for<'r> Option<i32>: Decode<'r, DB>,
    for<'r> Option<i64>: Decode<'r, DB>,
    for<'r> Option<f64>: Decode<'r, DB>,
    for<'r> Option<bool>: Decode<'r, DB>,
    usize: sqlx::ColumnIndex<DB::Row>,
{
    fn fetch_optional<'c>(
        conn: &'c mut Self::Connection,
        sql: SqlStr,
        args: &'c [Arg<'c>],
    ) -> BoxFuture<'c, Result<Option<Self::Row>, sqlx::Error>> {
        Box::pin(query::<DB>(prefixed(sql), args).fetch_optional(conn))
    }

    fn fetch_one<'c>(
        conn: &'c mut Self::Connection,
        sql: SqlStr,
        args: &'c [Arg<'c>],
    ) -> BoxFuture<'c, Result<Self::Row, sqlx::Error>> {
        Box::pin(query::<DB>(prefixed(sql), args).fetch_one(conn))
    }

    fn fetch_all<'c>(
        conn: &'c mut Self::Connection,
        sql: SqlStr,
        args: &'c [Arg<'c>],
    ) -> BoxFuture<'c, Result<Vec<Self::Row>, sqlx::Error>> {
        Box::pin(query::<DB>(prefixed(sql), args).fetch_all(conn))
    }

    fn execute<'c>(
        conn: &'c mut Self::Connection,
        sql: SqlStr,
        args: &'c [Arg<'c>],
    ) -> BoxFuture<'c, Result<u64, sqlx::Error>> {
        Box::pin(async move {
            let done = query::<DB>(prefixed(sql), args).execute(conn).await?;
            Ok(done.rows_affected())
        })
    }

    fn push_arg(builder: &mut QueryBuilder<Self>, arg: Arg<'_>) {
        match arg {
            Arg::Text(v) => builder.push_bind(v),
            Arg::Bytes(v) => builder.push_bind(v),
            Arg::I32(v) => builder.push_bind(v),
            Arg::I64(v) => builder.push_bind(v),
            Arg::F64(v) => builder.push_bind(v),
            Arg::Bool(v) => builder.push_bind(v),
        };
    }

    fn fetch_all_built<'c>(
        conn: &'c mut Self::Connection,
        builder: &'c mut QueryBuilder<Self>,
    ) -> BoxFuture<'c, Result<Vec<Self::Row>, sqlx::Error>> {
        Box::pin(async move {
            if !in_scope() {
                return builder.build().fetch_all(conn).await;
            }
            let (sql, args) = take_built(builder)?;
            sqlx::query_with::<DB, _>(sql, args).fetch_all(conn).await
        })
    }

    fn execute_built<'c>(
        conn: &'c mut Self::Connection,
        builder: &'c mut QueryBuilder<Self>,
    ) -> BoxFuture<'c, Result<u64, sqlx::Error>> {
        Box::pin(async move {
            let done = if in_scope() {
                let (sql, args) = take_built(builder)?;
                sqlx::query_with::<DB, _>(sql, args).execute(conn).await?
            } else {
                builder.build().execute(conn).await?
            };
            Ok(done.rows_affected())
        })
    }

    fn execute_raw<'c>(
        conn: &'c mut Self::Connection,
        sql: SqlStr,
    ) -> BoxFuture<'c, Result<u64, sqlx::Error>> {
        Box::pin(async move {
            let done = sqlx::raw_sql(prefixed(sql)).execute(conn).await?;
            Ok(done.rows_affected())
        })
    }

    fn str_with<R>(
        row: &Self::Row,
        index: usize,
        read: impl FnOnce(Option<&str>) -> R,
    ) -> Result<R, sqlx::Error> {
        let text: Option<&str> = row.try_get(index)?;
        Ok(read(text))
    }

    fn text(row: &Self::Row, index: usize) -> Result<Option<String>, sqlx::Error> {
        row.try_get(index)
    }

    fn bytes(row: &Self::Row, index: usize) -> Result<Option<Vec<u8>>, sqlx::Error> {
        row.try_get(index)
    }

    fn i32(row: &Self::Row, index: usize) -> Result<Option<i32>, sqlx::Error> {
        row.try_get(index)
    }

    fn i64(row: &Self::Row, index: usize) -> Result<Option<i64>, sqlx::Error> {
        row.try_get(index)
    }

    fn f64(row: &Self::Row, index: usize) -> Result<Option<f64>, sqlx::Error> {
        row.try_get(index)
    }

    fn bool(row: &Self::Row, index: usize) -> Result<Option<bool>, sqlx::Error> {
        row.try_get(index)
    }
}

/// A dialect's statement for one operation: its text, and which of the operation's parameters
/// it binds, in order. The operation lists its parameters once (the same on every backend); a
/// `$N` dialect binds them in the order its text numbers them, a `?` dialect binds a value its
/// text uses twice twice.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Stmt {
    /// The statement's text.
    pub(crate) sql: &'static str,
    /// The indexes of the parameters bound, in order; `None`: every parameter, in order.
    binds: Option<&'static [usize]>,
}

impl Stmt {
    /// `sql`, binding every parameter of the operation in order.
    pub(crate) const fn new(sql: &'static str) -> Self {
        Self { sql, binds: None }
    }

    /// `sql`, binding the parameters at `binds`, in that order.
    pub(crate) const fn binding(sql: &'static str, binds: &'static [usize]) -> Self {
        Self {
            sql,
            binds: Some(binds),
        }
    }

    /// The arguments this statement binds, taken from the operation's `params`.
    pub(crate) fn args<'a>(&self, params: &[Arg<'a>]) -> Vec<Arg<'a>> {
        match self.binds {
            None => params.to_vec(),
            Some(binds) => binds.iter().map(|&index| params[index]).collect(),
        }
    }
}

/// A method of [`Sql`] that runs a statement: [`Sql::fetch_optional`], [`Sql::fetch_one`],
/// [`Sql::fetch_all`] or [`Sql::execute`].
pub(crate) type Method<C, T> =
    for<'c> fn(&'c mut C, SqlStr, &'c [Arg<'c>]) -> BoxFuture<'c, Result<T, sqlx::Error>>;

impl Stmt {
    /// Runs this statement on `conn` by `method`, with the arguments it takes from `params`.
    pub(crate) async fn run<C, T>(
        self,
        conn: &mut C,
        params: &[Arg<'_>],
        method: Method<C, T>,
    ) -> Result<T, sqlx::Error> {
        let args = self.args(params);
        method(conn, text(self.sql), &args).await
    }
}

/// Runs `stmt` on `conn` with the arguments it takes from `params`; every row, read by `read`.
pub(crate) async fn read_all<DB: Sql, R>(
    conn: &mut DB::Connection,
    stmt: Stmt,
    params: &[Arg<'_>],
    read: fn(&DB::Row) -> Result<R, sqlx::Error>,
) -> Result<Vec<R>, sqlx::Error> {
    let rows = stmt.run(conn, params, DB::fetch_all).await?;
    rows.iter().map(read).collect()
}

/// A write whose changed row the caller reads: `write` returns it itself (`RETURNING`) when
/// `read_back` is `None`; otherwise (a dialect without `RETURNING`) `write` runs, and if it
/// changed a row, `read_back` reads it in the same transaction. `None`: no row changed.
pub(crate) async fn write_returning<DB: Sql>(
    conn: &mut DB::Connection,
    write: Stmt,
    read_back: Option<Stmt>,
    params: &[Arg<'_>],
) -> Result<Option<DB::Row>, sqlx::Error> {
    match read_back {
        None => write.run(conn, params, DB::fetch_optional).await,
        Some(read) => {
            if write.run(conn, params, DB::execute).await? == 0 {
                return Ok(None);
            }
            read.run(conn, params, DB::fetch_optional).await
        }
    }
}

/// A statement with a list in it, assembled at run time: `template`'s text, with `{list}`
/// replaced by what `list` pushes (the list's placeholders, in the dialect's form) and each
/// `{}` by the placeholder of the next of `args`, in order.
pub(crate) fn assemble<DB: Sql>(
    template: &str,
    list: impl FnOnce(&mut QueryBuilder<DB>),
    args: &[Arg<'_>],
) -> QueryBuilder<DB> {
    let mut builder = QueryBuilder::new("");
    let mut list = Some(list);
    let mut args = args.iter();
    let mut rest = template;
    while let Some(start) = rest.find('{') {
        builder.push(&rest[..start]);
        rest = &rest[start..];
        if let Some(after) = rest.strip_prefix("{list}") {
            if let Some(push) = list.take() {
                push(&mut builder);
            }
            rest = after;
        } else if let Some(after) = rest.strip_prefix("{}") {
            if let Some(arg) = args.next() {
                DB::push_arg(&mut builder, *arg);
            }
            rest = after;
        } else {
            builder.push("{");
            rest = &rest[1..];
        }
    }
    builder.push(rest);
    builder
}

/// The code of a database error (PostgreSQL's SQLSTATE, SQLite's result code, MySQL's
/// SQLSTATE), if `error` is one.
pub(crate) fn error_code(error: &sqlx::Error) -> Option<String> {
    match error {
        sqlx::Error::Database(db) => db.code().map(|code| code.into_owned()),
        _ => None,
    }
}

/// How statements the store runs for one operation relate to transactions ([`Scoped`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Scope {
    /// One write of the store's own, called outside any transaction.
    Statement,
    /// Statements in a transaction of the store's own (a savepoint inside one sqlx counts).
    Transaction,
    /// In the caller's transaction if it is in one (also one sqlx does not count: a raw
    /// `BEGIN`); otherwise as [`Scope::Statement`].
    JoinElseStatement,
    /// In the caller's transaction if it is in one (also a raw `BEGIN`); otherwise as
    /// [`Scope::Transaction`].
    JoinElseTransaction,
    /// In a transaction the server has open that sqlx does not count (a raw `BEGIN`);
    /// otherwise as [`Scope::Transaction`] (so a savepoint inside one sqlx counts).
    RawElseTransaction,
}

/// One step of a store operation: its statements on a connection, given the operation's
/// arguments (a plain `fn`, so that it can run again on a retry).
pub(crate) type Step<C, A, T> =
    for<'t> fn(&'t mut C, &'t A) -> BoxFuture<'t, Result<T, sqlx::Error>>;

/// What a step gives, in time.
pub(crate) type Done<'c, T> = BoxFuture<'c, Result<T, sqlx::Error>>;

/// A [`Step`] with what it runs on: a connection of `DB`, the operation's arguments, and (for
/// [`Scoped::scoped`]) the operation's [`Scope`] and name (for logs and metrics).
pub(crate) struct Run<'c, DB: Database, A, T> {
    /// The connection.
    pub(crate) conn: &'c mut DB::Connection,
    /// The operation's arguments.
    pub(crate) args: &'c A,
    /// The step.
    pub(crate) step: Step<DB::Connection, A, T>,
    /// How its statements relate to transactions.
    pub(crate) scope: Scope,
    /// The operation's name.
    pub(crate) operation: &'static str,
}

impl<'c, DB: Database, A, T> Run<'c, DB, A, T> {
    /// `step` on `conn` with `args`, for the operation `operation` in `scope`.
    pub(crate) fn new(
        conn: &'c mut DB::Connection,
        (scope, operation): (Scope, &'static str),
        args: &'c A,
        step: Step<DB::Connection, A, T>,
    ) -> Self {
        Self {
            conn,
            args,
            step,
            scope,
            operation,
        }
    }
}

/// Runs `step` on `conn` with `args` (moved into the future) for `operation` in `scope`
/// (see [`Scoped`]).
pub(crate) fn scoped<'c, DB, A, T>(
    conn: &'c mut DB::Connection,
    operation: (Scope, &'static str),
    args: A,
    step: Step<DB::Connection, A, T>,
) -> Done<'c, T>
where
    DB: Scoped,
    A: Send + Sync + 'c,
    T: Send + 'c,
{
    Box::pin(async move { DB::scoped(Run::new(conn, operation, &args, step)).await })
}

/// How a backend runs the statements of a store operation in a [`Scope`]: its transactions,
/// and its retries of transient lock errors (MySQL/MariaDB).
pub(crate) trait Scoped: Sql {
    /// Runs `run`'s step in its scope.
    fn scoped<'c, A: Sync, T: Send + 'c>(run: Run<'c, Self, A, T>) -> Done<'c, T>;
}

/// A driver's `QueryResult`: how many rows a statement affected (each sqlx driver has the
/// method, but no trait of sqlx's names it).
pub(crate) trait RowsAffected {
    /// The rows the statement affected.
    fn rows_affected(&self) -> u64;
}

impl RowsAffected for sqlx::postgres::PgQueryResult {
    fn rows_affected(&self) -> u64 {
        self.rows_affected()
    }
}

impl RowsAffected for sqlx::sqlite::SqliteQueryResult {
    fn rows_affected(&self) -> u64 {
        self.rows_affected()
    }
}

impl RowsAffected for sqlx::mysql::MySqlQueryResult {
    fn rows_affected(&self) -> u64 {
        self.rows_affected()
    }
}

/// How many arguments `sql` takes: its `?` marks, or its highest `$N`.
#[cfg(test)]
pub(crate) fn placeholders(sql: &str) -> usize {
    let numbered = sql
        .split('$')
        .skip(1)
        .filter_map(|rest| {
            let digits: String = rest.chars().take_while(char::is_ascii_digit).collect();
            digits.parse::<usize>().ok()
        })
        .max();
    numbered.unwrap_or_else(|| sql.matches('?').count())
}

/// Runs the generic check `$check::<D>()` for every dialect: PostgreSQL, SQLite, MySQL.
#[cfg(test)]
macro_rules! for_every_dialect {
    ($check:ident) => {
        $check::<sqlx::Postgres>();
        $check::<sqlx::Sqlite>();
        $check::<sqlx::MySql>();
    };
}
#[cfg(test)]
pub(crate) use for_every_dialect;

/// Checks that `stmt`, of an operation with `params` parameters, binds as many arguments as
/// its text takes, each one of the operation's.
#[cfg(test)]
pub(crate) fn check_binds(name: &str, stmt: Stmt, params: usize) {
    let args = stmt.args(&vec![Arg::I64(Some(0)); params]);
    assert_eq!(args.len(), placeholders(stmt.sql), "{name}: {}", stmt.sql);
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Both placeholder styles are counted.
    #[test]
    fn placeholders_are_counted_in_either_style() {
        assert_eq!(placeholders("SELECT $1, $3, $2, $3"), 3);
        assert_eq!(placeholders("SELECT ?, ? FROM t WHERE a = ?"), 3);
        assert_eq!(placeholders("SELECT 1"), 0);
    }

    /// A bind plan takes the operation's parameters in its own order, repeats included.
    #[test]
    fn a_bind_plan_picks_and_repeats_parameters() {
        let params = [Arg::from("a"), Arg::from(1_i64), Arg::from(true)];
        let stmt = Stmt::binding("x", &[1, 1, 0]);
        assert_eq!(
            stmt.args(&params),
            vec![Arg::from(1_i64), Arg::from(1_i64), Arg::from("a")]
        );
        assert_eq!(Stmt::new("x").args(&params), params.to_vec());
    }

    /// A template's list and arguments land where its text puts them, in the dialect's form.
    #[test]
    fn a_template_is_assembled_in_order() {
        let push = |b: &mut QueryBuilder<sqlx::Postgres>| {
            b.push_bind(1_i64);
        };
        let built = assemble::<sqlx::Postgres>(
            "a {} IN ({list}) AND {}",
            push,
            &[Arg::from("x"), Arg::from(2_i64)],
        );
        assert_eq!(built.sql().as_str(), "a $1 IN ($2) AND $3");
        let push = |b: &mut QueryBuilder<sqlx::MySql>| {
            let mut list = b.separated(", ");
            list.push_bind(1_i64);
            list.push_bind(2_i64);
        };
        let built = assemble::<sqlx::MySql>("IN ({list}) AND t = {}", push, &[Arg::from("x")]);
        assert_eq!(built.sql().as_str(), "IN (?, ?) AND t = ?");
    }

    /// Every backend the runtime ships is covered by the blanket impl.
    #[test]
    fn every_shipped_backend_is_sql() {
        fn is_sql<DB: Sql>() {}
        is_sql::<sqlx::Postgres>();
        is_sql::<sqlx::Sqlite>();
        is_sql::<sqlx::MySql>();
    }

    /// A generic statement runs on SQLite (in memory) through the glue alone.
    #[tokio::test]
    async fn a_generic_statement_runs_with_its_arguments() {
        use sqlx::Connection as _;
        async fn roundtrip<DB: Sql>(conn: &mut DB::Connection) -> Result<(), sqlx::Error> {
            let created = DB::execute(
                conn,
                text("CREATE TABLE t (name TEXT, n BIGINT, data BLOB)"),
                &[],
            )
            .await?;
            assert_eq!(created, 0);
            let args = [Arg::from("a"), Arg::from(7_i64), Arg::from(&b"xy"[..])];
            let inserted =
                DB::execute(conn, text("INSERT INTO t VALUES ($1, $2, $3)"), &args).await?;
            assert_eq!(inserted, 1);
            let row = DB::fetch_one(conn, text("SELECT name, n, data FROM t"), &[]).await?;
            assert_eq!(DB::text_required(&row, 0)?, "a");
            assert_eq!(DB::i64_required(&row, 1)?, 7);
            assert_eq!(DB::bytes(&row, 2)?, Some(b"xy".to_vec()));
            let none = DB::fetch_optional(
                conn,
                text("SELECT name FROM t WHERE name = $1"),
                &[Arg::Text(Some("b"))],
            )
            .await?;
            assert!(none.is_none());
            Ok(())
        }
        let mut conn = sqlx::SqliteConnection::connect("sqlite::memory:")
            .await
            .unwrap();
        roundtrip::<sqlx::Sqlite>(&mut conn).await.unwrap();
    }
}
