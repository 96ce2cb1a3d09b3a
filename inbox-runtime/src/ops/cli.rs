//! The operator's command line: `migrate`, `stats`, `dead list|show|replay|discard`,
//! `outbox list|show|retry|discard`, `purge`.
//!
//! Behind the cargo feature `cli`. It is a library entry point, not a binary of its own: replaying
//! a dead message runs its registered `#[idempotent]` handler, so the CLI must run inside *your*
//! program, where the handlers are linked in. Either hand it the arguments:
//!
//! ```no_run
//! # async fn demo(pool: sqlx::PgPool) -> std::process::ExitCode {
//! // `myservice admin dead list --consumer ledger`
//! let args = std::env::args_os().skip(1); // "admin", "dead", "list", …
//! inbox_runtime::ops::cli::run(&pool, args).await
//! # }
//! ```
//!
//! or embed [`AdminCommand`] as a clap subcommand of your own parser and call [`execute`]:
//!
//! ```no_run
//! use clap::Parser;
//!
//! #[derive(Parser)]
//! enum Cli {
//!     /// Runs the service
//!     Serve,
//!     /// Inspects and repairs the inbox
//!     #[command(subcommand)]
//!     Admin(inbox_runtime::ops::cli::AdminCommand),
//! }
//!
//! # async fn demo(pool: sqlx::PgPool) -> Result<(), inbox_runtime::ops::cli::CliError> {
//! match Cli::parse() {
//!     Cli::Serve => { /* … */ }
//!     Cli::Admin(command) => inbox_runtime::ops::cli::execute(&command, &pool).await?,
//! }
//! # Ok(()) }
//! ```
//!
//! Results go to standard output (tables aligned for reading; `dead show` prints the payload as
//! pretty JSON; times in UTC, to the second: `2026-11-29 15:04:14 UTC`). Long operations
//! (`dead replay --all`, `purge`) show a progress bar on standard error when it is a terminal,
//! and nothing when it is not (piped, redirected, in CI).
//!
//! A command that names a consumer (`dead list --consumer`, `dead show`, `dead replay`,
//! `dead discard`) refuses one that neither has rows in the inbox nor a registered handler
//! ([`CliError::UnknownConsumer`], listing the consumers that exist), so that a typo is not
//! answered with "nothing found". `purge` refuses a redelivery horizon below
//! [`admin::MIN_REDELIVERY_HORIZON`] and a window below the horizon, shows what it would delete
//! with `--dry-run`, and asks before deleting rows settled less than a day ago when standard
//! input is a terminal (`--yes` does not ask).
//!
//! The outbox commands (`outbox …`, and the outbox part of `stats` and `purge`) work on a
//! database where the outbox component is migrated ([`crate::Component::Outbox`]): `stats` and
//! `purge` leave the outbox out when it is not, and `outbox …` refuses with
//! [`CliError::OutboxNotInstalled`]. Outbox rows are named by their message id; `outbox retry`
//! and `outbox discard` take `dead` rows only, and `outbox discard` asks first when standard
//! input is a terminal (`--yes` does not ask). `outbox list --destination` and `outbox retry
//! --dead --destination` refuse a destination the outbox has no rows for.
//!
//! On the DynamoDB inbox (features `cli` and `dynamodb`), `ops::cli::dynamodb` runs the same
//! commands with the same output on a `dynamodb::DynamoInbox`, store URL `dynamodb://TABLE`.

use std::ffi::OsString;
use std::io::{self, IsTerminal as _, Write};
use std::process::ExitCode;
use std::time::Duration;

use clap::{Args, Parser, Subcommand, ValueEnum};
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use sqlx::Pool;

use crate::dispatch::dispatcher::Dispatcher;
use crate::dispatch::registry::registered_handlers;
use crate::ops::admin::{
    self, PurgeError, PurgePreview, PurgeReport, Retention, RetentionError, utc_time,
};
use crate::outbox::admin as outbox_admin;
use crate::store::{InboxDatabase, OutboxDatabase, OutboxEntry, OutboxStatsRow, OutboxStatus};
use crate::store::{RejectionReason, StatsStatus};
use crate::store::{StatsRow, StoredMessage};
use crate::types::error::RegistryError;
use crate::types::error::ReplayError;
use crate::types::outcome::Outcome;
use crate::types::status::Status;

#[cfg(feature = "dynamodb")]
pub mod dynamodb;

/// A parser for the admin commands alone, as [`run`] uses it: the first argument is the program
/// name (clap's convention), the rest is an [`AdminCommand`].
#[derive(Debug, Clone, Parser)]
#[command(
    name = "admin",
    about = "Inspects and repairs the inbox and the outbox: statistics, dead letters, replay, \
             retention purge"
)]
pub struct AdminCli {
    /// The command.
    #[command(subcommand)]
    pub command: AdminCommand,
}

/// The admin commands, as a clap subcommand to embed in a parser of your own.
#[derive(Debug, Clone, Subcommand)]
#[non_exhaustive]
pub enum AdminCommand {
    /// Creates or upgrades the inbox tables
    Migrate,
    /// Counts per consumer and status, oldest failed and dead, rejected deliveries by reason;
    /// the outbox's counts per destination and status
    Stats,
    /// Failed and dead messages: list, show, replay, discard
    #[command(subcommand)]
    Dead(DeadCommand),
    /// The transactional outbox's rows: list, show, retry dead ones, discard dead ones
    #[command(subcommand)]
    Outbox(OutboxCommand),
    /// Deletes processed (and discarded, stale) rows, and the outbox's sent rows, older than the
    /// retention window, in batches (`--dry-run`: shows what it would delete)
    Purge(PurgeArgs),
}

/// `outbox …`: the transactional outbox's rows, named by message id.
#[derive(Debug, Clone, Subcommand)]
#[non_exhaustive]
pub enum OutboxCommand {
    /// Lists outbox rows, oldest first (default: pending and dead ones)
    List(OutboxListArgs),
    /// Shows one row: every column, its headers, last error and payload
    Show(OutboxRef),
    /// Sends a dead row again (pending, attempts reset, same message id), or every dead row
    /// with --dead
    Retry(OutboxRetryArgs),
    /// Deletes a dead row: it is never sent, and the rows after it of its aggregate go out
    Discard(OutboxDiscardArgs),
}

/// An outbox row status, as `outbox list --status` takes it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum OutboxStatusArg {
    /// `pending`: waiting for a relay (or out with one, or failed and waiting for a retry).
    Pending,
    /// `sent`: confirmed by the sink (kept until the retention purge).
    Sent,
    /// `dead`: failed permanently or too often; blocks the rows after it of its aggregate.
    Dead,
}

impl OutboxStatusArg {
    fn statuses(status: Option<OutboxStatusArg>) -> &'static [OutboxStatus] {
        match status {
            None => &[OutboxStatus::Pending, OutboxStatus::Dead],
            Some(OutboxStatusArg::Pending) => &[OutboxStatus::Pending],
            Some(OutboxStatusArg::Sent) => &[OutboxStatus::Sent],
            Some(OutboxStatusArg::Dead) => &[OutboxStatus::Dead],
        }
    }
}

/// `outbox list` arguments.
#[derive(Debug, Clone, Args)]
pub struct OutboxListArgs {
    /// Only rows in this status [default: pending and dead]
    #[arg(long, value_enum)]
    pub status: Option<OutboxStatusArg>,
    /// Only rows to this destination
    #[arg(long)]
    pub destination: Option<String>,
    /// At most this many
    #[arg(long, default_value_t = 50)]
    pub limit: u32,
}

/// One outbox row: its message id.
#[derive(Debug, Clone, Args)]
pub struct OutboxRef {
    /// The message id (as `outbox list` shows it)
    pub message_id: String,
}

/// `outbox retry` arguments: `MESSAGE_ID`, or `--dead [--destination D]`.
#[derive(Debug, Clone, Args)]
pub struct OutboxRetryArgs {
    /// The dead row's message id
    #[arg(required_unless_present = "dead", conflicts_with = "dead")]
    pub message_id: Option<String>,
    /// Retry every dead row (of --destination, if given)
    #[arg(long)]
    pub dead: bool,
    /// With --dead: only rows to this destination
    #[arg(long, requires = "dead")]
    pub destination: Option<String>,
}

/// `outbox discard` arguments.
#[derive(Debug, Clone, Args)]
pub struct OutboxDiscardArgs {
    /// The dead row's message id
    pub message_id: String,
    /// Do not ask before discarding (asked only when standard input is a terminal)
    #[arg(long, short = 'y')]
    pub yes: bool,
}

/// `dead …`: failed and dead messages.
#[derive(Debug, Clone, Subcommand)]
#[non_exhaustive]
pub enum DeadCommand {
    /// Lists failed and dead messages, oldest first
    List(ListArgs),
    /// Shows one message with its last error and its payload
    Show(MessageRef),
    /// Runs a failed or dead message (or all of them) once more, through the same claim
    Replay(ReplayArgs),
    /// Marks a failed or dead message discarded: it never runs, and its key keeps blocking
    /// redeliveries
    Discard(MessageRef),
}

/// Which messages `dead list` and `dead replay --all` take.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum DeadStatus {
    /// `failed`: waiting for a redelivery (attempts left).
    Failed,
    /// `dead`: dead-lettered (permanent error, or attempts used up).
    Dead,
}

impl DeadStatus {
    fn statuses(status: Option<DeadStatus>) -> &'static [Status] {
        match status {
            None => &[Status::Failed, Status::Dead],
            Some(DeadStatus::Failed) => &[Status::Failed],
            Some(DeadStatus::Dead) => &[Status::Dead],
        }
    }
}

/// `dead list` arguments.
#[derive(Debug, Clone, Args)]
pub struct ListArgs {
    /// Only this consumer's messages
    #[arg(long)]
    pub consumer: Option<String>,
    /// Only `failed` or only `dead` messages [default: both]
    #[arg(long, value_enum)]
    pub status: Option<DeadStatus>,
    /// At most this many
    #[arg(long, default_value_t = 50)]
    pub limit: u32,
}

/// One message: its consumer and idempotency key.
#[derive(Debug, Clone, Args)]
pub struct MessageRef {
    /// The consumer
    pub consumer: String,
    /// The message's idempotency key
    pub key: String,
}

impl MessageRef {
    /// [`CliError::NotFound`] for this message (`what`: what was looked for).
    fn not_found(&self, what: &'static str) -> CliError {
        CliError::NotFound {
            consumer: self.consumer.clone(),
            key: self.key.clone(),
            what,
        }
    }
}

/// `dead replay` arguments: `CONSUMER KEY`, or `--all [--consumer C] [--status S]`.
#[derive(Debug, Clone, Args)]
pub struct ReplayArgs {
    /// The consumer
    #[arg(required_unless_present = "all", conflicts_with = "all")]
    pub consumer: Option<String>,
    /// The message's idempotency key
    #[arg(required_unless_present = "all", conflicts_with = "all")]
    pub key: Option<String>,
    /// Replay every failed and dead message (of `--consumer`, if given), oldest first
    #[arg(long)]
    pub all: bool,
    /// With --all: only this consumer's messages
    #[arg(
        long = "consumer",
        id = "only_consumer",
        requires = "all",
        value_name = "CONSUMER"
    )]
    pub only_consumer: Option<String>,
    /// With --all: only `failed` or only `dead` messages [default: both]
    #[arg(long, value_enum, requires = "all")]
    pub status: Option<DeadStatus>,
}

/// `purge` arguments. Durations in humantime's form: `7d`, `36h`, `1h 30m`, `90s`.
#[derive(Debug, Clone, Args)]
pub struct PurgeArgs {
    /// Keep processed rows this long: the deduplication guarantee
    #[arg(long, value_parser = parse_duration)]
    pub window: Duration,
    /// The broker's redelivery horizon (at least 1h); a window shorter than it is refused
    #[arg(long, value_parser = parse_duration)]
    pub redelivery_horizon: Duration,
    /// Show what would be deleted, per consumer and status, and delete nothing
    #[arg(long)]
    pub dry_run: bool,
    /// Do not ask before deleting rows settled less than a day ago (asked only when standard
    /// input is a terminal)
    #[arg(long, short = 'y')]
    pub yes: bool,
    /// Also delete failed and dead rows older than the window (with their payloads)
    #[arg(long)]
    pub include_failed_and_dead: bool,
    /// Also delete rejected deliveries (inbox_rejections) received longer ago than the window
    #[arg(long)]
    pub include_rejections: bool,
    /// Rows deleted per statement (one short transaction each; at least 1)
    #[arg(long, default_value_t = 1000, value_parser = clap::value_parser!(u32).range(1..))]
    pub batch_size: u32,
}

fn parse_duration(text: &str) -> Result<Duration, String> {
    humantime::parse_duration(text).map_err(|e| format!("{e} (examples: 7d, 36h, 1h 30m, 90s)"))
}

/// Why an admin command failed. [`run`] prints it after `error: ` and exits with status 1.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum CliError {
    /// The database failed.
    #[error("database: {0}")]
    Database(#[from] sqlx::Error),
    /// The inbox migrations failed.
    #[error("migrations: {0}")]
    Migrate(#[from] sqlx::migrate::MigrateError),
    /// The handler registry cannot build a dispatcher (needed to replay).
    #[error(transparent)]
    Registry(#[from] RegistryError),
    /// A single replay could not run.
    #[error(transparent)]
    Replay(#[from] ReplayError),
    /// The retention is refused: a redelivery horizon below the minimum, or a window shorter
    /// than the horizon.
    #[error(transparent)]
    Retention(#[from] RetentionError),
    /// The purge refused to run (clocks: [`PurgeError::ClockSkew`]) or failed.
    #[error(transparent)]
    Purge(#[from] PurgeError),
    /// The purge was not confirmed at the terminal.
    #[error("purge cancelled: nothing deleted")]
    Cancelled,
    /// The command names a consumer that has no rows in the inbox (messages or rejections) and
    /// no registered handler: a typo, most likely.
    #[error(
        "unknown consumer `{consumer}`; {}",
        known_list(
            known,
            "no consumer is known (the inbox has no rows and no handler is registered)",
            "known consumers"
        )
    )]
    UnknownConsumer {
        /// The consumer named.
        consumer: String,
        /// The consumers that exist: those with rows, and those with registered handlers
        /// (sorted).
        known: Vec<String>,
    },
    /// No failed or dead message with this consumer and key (`show`, `discard`).
    #[error("consumer `{consumer}` has no {what} message with key `{key}`")]
    NotFound {
        /// The consumer.
        consumer: String,
        /// The key.
        key: String,
        /// What was looked for: `"stored"` or `"failed or dead"`.
        what: &'static str,
    },
    /// An `outbox …` command on a database where the outbox component is not migrated.
    #[error(
        "the outbox is not migrated in this database (no inbox_outbox table): migrate it with \
         inbox_runtime::migrate_components(&pool, &[Component::Outbox])"
    )]
    OutboxNotInstalled,
    /// No outbox row has this message id.
    #[error("no outbox message with id `{message_id}`")]
    OutboxNotFound {
        /// The message id.
        message_id: String,
    },
    /// `outbox retry` or `outbox discard` of a row that is not `dead`.
    #[error(
        "outbox message `{message_id}` is {status}, not dead: only dead messages can be {what}"
    )]
    OutboxNotDead {
        /// The message id.
        message_id: String,
        /// Its status.
        status: OutboxStatus,
        /// `"retried"` or `"discarded"`.
        what: &'static str,
    },
    /// A destination the outbox has no rows for (`outbox list --destination`, `outbox retry
    /// --dead --destination`): a typo, most likely.
    #[error(
        "unknown outbox destination `{destination}`; {}",
        known_list(known, "the outbox has no rows", "destinations with rows")
    )]
    UnknownDestination {
        /// The destination named.
        destination: String,
        /// The destinations that have rows (sorted).
        known: Vec<String>,
    },
    /// `outbox discard` was not confirmed at the terminal.
    #[error("discard cancelled: outbox message `{message_id}` kept")]
    DiscardCancelled {
        /// The message id.
        message_id: String,
    },
    /// Some replays did not end processed (or duplicate): they failed again, or could not run.
    #[error("{failed} of {total} replays did not succeed")]
    ReplayFailed {
        /// Replays that did not succeed.
        failed: u64,
        /// Replays attempted.
        total: u64,
    },
    /// Writing the output failed.
    #[error("output: {0}")]
    Io(#[from] io::Error),
    /// A DynamoDB call of the admin failed, or an inbox item is malformed, or the store URL is
    /// not `dynamodb://TABLE` ([`dynamodb`]).
    #[cfg(feature = "dynamodb")]
    #[error(transparent)]
    Dynamo(#[from] crate::dynamodb::AdminError),
    /// `migrate` on DynamoDB: [`crate::dynamodb::DynamoInbox::ensure_table`] failed.
    #[cfg(feature = "dynamodb")]
    #[error(transparent)]
    DynamoTable(#[from] crate::dynamodb::TableError),
    /// A command the store does not have ([`dynamodb`]: `outbox …`, `purge`).
    #[cfg(feature = "dynamodb")]
    #[error("`{command}` is not available on DynamoDB: {why}")]
    Unsupported {
        /// The command.
        command: &'static str,
        /// Why, and what to do instead.
        why: &'static str,
    },
}

/// `none` if `known` is empty, else `label: ` and the known names, comma-separated.
fn known_list(known: &[String], none: &str, label: &str) -> String {
    if known.is_empty() {
        none.to_owned()
    } else {
        format!("{label}: {}", known.join(", "))
    }
}

/// Parses `args` (the program name first, as in `std::env::args_os()`) as an [`AdminCli`] and
/// runs the command on `pool`, printing results on standard output and errors on standard error.
///
/// Exit status: 0 on success, 1 if the command failed ([`CliError`]), 2 on bad usage (clap's
/// message is printed; `--help` exits 0).
pub async fn run<DB, I, T>(pool: &Pool<DB>, args: I) -> ExitCode
where
    DB: OutboxDatabase,
    I: IntoIterator<Item = T>,
    T: Into<OsString> + Clone,
{
    parse_and_run(args, |command| async move { execute(&command, pool).await }).await
}

/// Parses `args` as an [`AdminCli`] and runs its command with `execute`: the exit status and
/// printing of [`run`] (clap's message and status 2 on bad usage, `error: …` and status 1 on a
/// [`CliError`]), for every store's command line.
pub(crate) async fn parse_and_run<I, T, F>(
    args: I,
    execute: impl FnOnce(AdminCommand) -> F,
) -> ExitCode
where
    I: IntoIterator<Item = T>,
    T: Into<OsString> + Clone,
    F: Future<Output = Result<(), CliError>>,
{
    let cli = match AdminCli::try_parse_from(args) {
        Ok(cli) => cli,
        Err(error) => {
            let code = if error.use_stderr() { 2 } else { 0 };
            let _ = error.print();
            return ExitCode::from(code);
        }
    };
    match execute(cli.command).await {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("error: {error}");
            ExitCode::from(1)
        }
    }
}

/// Runs `command` on `pool`, printing on standard output. `dead replay` builds a
/// [`Dispatcher::from_registry`] over `pool` (use [`execute_with`] to replay with a dispatcher
/// of yours, e.g. with another retry policy). A `purge` that would delete rows settled less than
/// a day ago, and an `outbox discard`, ask first on standard error when standard input is a
/// terminal (not with `--yes`).
///
/// # Errors
/// [`CliError`]: the database's error, an unknown consumer or message, a refused retention or
/// purge, a purge or discard not confirmed ([`CliError::Cancelled`],
/// [`CliError::DiscardCancelled`]), replays that did not succeed; for the outbox commands, an
/// outbox not migrated, an unknown message id or destination, a row that is not dead.
pub async fn execute<DB: OutboxDatabase>(
    command: &AdminCommand,
    pool: &Pool<DB>,
) -> Result<(), CliError> {
    let stdout = io::stdout();
    let mut out = stdout.lock();
    execute_on(command, Target::Pool(pool), &mut out, Ask::Terminal).await
}

/// Runs `command` with `dispatcher` (its pool for everything, its handlers and retry policy for
/// `dead replay`, its handlers' consumers as known ones, its [dedupe cache](crate::cache) for
/// `dead replay` and `dead discard`, which invalidate the keys they change), writing the results
/// to `out`. Asks before a purge or a discard as [`execute`] does. A dispatcher built inside a
/// [`TablePrefix::scope`](crate::store::TablePrefix::scope) runs every command on that prefix's
/// tables, wherever this is awaited; [`execute`], [`execute_to`] and [`run`] use the prefix of
/// the scope they are awaited in.
///
/// # Errors
/// As [`execute`].
pub async fn execute_with<DB: OutboxDatabase>(
    command: &AdminCommand,
    dispatcher: &Dispatcher<DB>,
    out: &mut dyn Write,
) -> Result<(), CliError> {
    // Every command in the dispatcher's table prefix (the scope it was built in), if any, as
    // its own replays and discards run: the listing and the replay on the same tables.
    crate::store::within(
        dispatcher.prefix.as_ref(),
        execute_on(command, Target::Dispatcher(dispatcher), out, Ask::Terminal),
    )
    .await
}

/// Runs `command` on `pool`, writing the results to `out` (for tests and for embedding). Never
/// asks before a purge or a discard: the caller decides (see [`admin::purge_preview`],
/// [`crate::outbox::admin::show`]).
///
/// # Errors
/// As [`execute`], but never [`CliError::Cancelled`] nor [`CliError::DiscardCancelled`].
pub async fn execute_to<DB: OutboxDatabase>(
    command: &AdminCommand,
    pool: &Pool<DB>,
    out: &mut dyn Write,
) -> Result<(), CliError> {
    execute_on(command, Target::Pool(pool), out, Ask::Never).await
}

/// Whether a purge of young rows, or an outbox discard, asks for confirmation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Ask {
    /// When standard input is a terminal (and `--yes` is not given).
    Terminal,
    /// Never.
    Never,
}

enum Target<'a, DB: OutboxDatabase> {
    Pool(&'a Pool<DB>),
    Dispatcher(&'a Dispatcher<DB>),
}

impl<DB: OutboxDatabase> Target<'_, DB> {
    fn pool(&self) -> &Pool<DB> {
        match self {
            Target::Pool(pool) => pool,
            Target::Dispatcher(dispatcher) => dispatcher.pool(),
        }
    }

    /// The consumers of the handlers at hand: the dispatcher's, or the registered ones of
    /// this backend.
    fn handler_consumers(&self) -> Vec<&'static str> {
        match self {
            Target::Pool(_) => registered_handlers()
                .into_iter()
                .filter(|handler| handler.backend == DB::BACKEND)
                .map(|handler| handler.consumer)
                .collect(),
            Target::Dispatcher(dispatcher) => dispatcher
                .handlers()
                .into_iter()
                .map(|handler| handler.consumer)
                .collect(),
        }
    }

    /// [`CliError::UnknownConsumer`] unless `consumer` has a handler at hand or rows in the
    /// inbox (messages or rejections). Reads the statistics only when no handler serves it.
    async fn check_consumer(&self, consumer: &str) -> Result<(), CliError> {
        let handlers = self.handler_consumers();
        if handlers.contains(&consumer) {
            return Ok(());
        }
        let rows = admin::stats(self.pool()).await?;
        consumer_in_stats(consumer, &handlers, rows)
    }
}

/// `Ok` if `consumer` has rows in the inbox statistics `rows`, else
/// [`CliError::UnknownConsumer`] with the known consumers: those of `handlers` (the handlers at
/// hand) and of `rows`, sorted, each once. The check of both stores (SQL and DynamoDB).
pub(crate) fn consumer_in_stats(
    consumer: &str,
    handlers: &[&str],
    rows: Vec<StatsRow>,
) -> Result<(), CliError> {
    if rows
        .iter()
        .any(|row| row.consumer.as_deref() == Some(consumer))
    {
        return Ok(());
    }
    let mut known: Vec<String> = handlers
        .iter()
        .map(|handler| (*handler).to_owned())
        .chain(rows.into_iter().filter_map(|row| row.consumer))
        .collect();
    known.sort_unstable();
    known.dedup();
    Err(CliError::UnknownConsumer {
        consumer: consumer.to_owned(),
        known,
    })
}

/// Runs `command` on `target`: checks the consumer it names, then runs its step.
async fn execute_on<DB: OutboxDatabase>(
    command: &AdminCommand,
    target: Target<'_, DB>,
    out: &mut dyn Write,
    ask: Ask,
) -> Result<(), CliError> {
    if let Some(consumer) = named_consumer(command) {
        target.check_consumer(consumer).await?;
    }
    let pool = target.pool();
    match command {
        AdminCommand::Migrate => {
            crate::migrate(pool).await?;
            writeln!(out, "inbox migrations applied ({})", DB::BACKEND)?;
            Ok(())
        }
        AdminCommand::Stats => stats(pool, out).await,
        AdminCommand::Outbox(command) => outbox(command, pool, out, ask).await,
        AdminCommand::Dead(command) => dead(command, &target, out).await,
        AdminCommand::Purge(args) => purge(args, pool, out, ask).await,
    }
}

/// The consumer `command` names, if any (it must exist: see [`Target::check_consumer`]).
fn named_consumer(command: &AdminCommand) -> Option<&str> {
    match command {
        AdminCommand::Dead(DeadCommand::List(args)) => args.consumer.as_deref(),
        AdminCommand::Dead(DeadCommand::Show(message) | DeadCommand::Discard(message)) => {
            Some(message.consumer.as_str())
        }
        AdminCommand::Dead(DeadCommand::Replay(args)) => {
            args.consumer.as_deref().or(args.only_consumer.as_deref())
        }
        AdminCommand::Migrate
        | AdminCommand::Stats
        | AdminCommand::Outbox(_)
        | AdminCommand::Purge(_) => None,
    }
}

/// `stats`: the inbox's, then the outbox's if it is migrated.
async fn stats<DB: OutboxDatabase>(pool: &Pool<DB>, out: &mut dyn Write) -> Result<(), CliError> {
    let rows = admin::stats(pool).await?;
    write_stats(out, &rows)?;
    if outbox_admin::installed(pool).await? {
        let rows = outbox_admin::stats(pool).await?;
        writeln!(out)?;
        write_outbox_stats(out, &rows)?;
    }
    Ok(())
}

/// Runs a `dead …` command.
async fn dead<DB: OutboxDatabase>(
    command: &DeadCommand,
    target: &Target<'_, DB>,
    out: &mut dyn Write,
) -> Result<(), CliError> {
    let pool = target.pool();
    match command {
        DeadCommand::List(args) => {
            let rows = admin::list(
                pool,
                args.consumer.as_deref(),
                DeadStatus::statuses(args.status),
                args.limit,
            )
            .await?;
            write_list(out, &rows)?;
        }
        DeadCommand::Show(message) => {
            let row = admin::show(pool, &message.consumer, &message.key)
                .await?
                .ok_or_else(|| message.not_found("stored"))?;
            write_show(out, &row)?;
        }
        DeadCommand::Discard(message) => discard(target, message, out).await?,
        DeadCommand::Replay(args) => {
            let owned;
            let dispatcher = match target {
                Target::Dispatcher(dispatcher) => dispatcher,
                Target::Pool(pool) => {
                    owned = Dispatcher::from_registry((*pool).clone())?;
                    &owned
                }
            };
            replay(dispatcher, args, out).await?;
        }
    }
    Ok(())
}

/// `dead discard`.
async fn discard<DB: OutboxDatabase>(
    target: &Target<'_, DB>,
    message: &MessageRef,
    out: &mut dyn Write,
) -> Result<(), CliError> {
    // With a dispatcher, through it: its dedupe cache forgets the key too.
    let discarded = match target {
        Target::Dispatcher(dispatcher) => {
            dispatcher.discard(&message.consumer, &message.key).await?
        }
        Target::Pool(pool) => admin::discard(pool, &message.consumer, &message.key).await?,
    };
    if !discarded {
        return Err(message.not_found("failed or dead"));
    }
    writeln!(
        out,
        "{}/{}: discarded (its key keeps blocking redeliveries until the retention purge)",
        message.consumer, message.key
    )?;
    Ok(())
}

/// `purge`: a preview with `--dry-run`; otherwise asks first if it would delete young rows
/// (see [`confirm`]), deletes, and says what went.
async fn purge<DB: OutboxDatabase>(
    args: &PurgeArgs,
    pool: &Pool<DB>,
    out: &mut dyn Write,
    ask: Ask,
) -> Result<(), CliError> {
    let retention = Retention::new(args.window, args.redelivery_horizon)?
        .batch_size(args.batch_size)
        .include_failed_and_dead(args.include_failed_and_dead)
        .include_rejections(args.include_rejections);
    if args.dry_run {
        let preview = admin::purge_preview(pool, &retention).await?;
        let with_outbox = outbox_admin::installed(pool).await?;
        return write_preview(out, args, &preview, with_outbox).map_err(CliError::from);
    }
    if ask == Ask::Terminal && !args.yes && io::stdin().is_terminal() {
        let young = settled_within_a_day(pool, &retention).await?;
        if young > 0
            && !confirm(
                young,
                args.window,
                &mut io::stdin().lock(),
                &mut io::stderr(),
            )?
        {
            return Err(CliError::Cancelled);
        }
    }
    let bar = progress_bar(None, "{spinner} purging: {pos} rows deleted ({elapsed})");
    let report = admin::purge(pool, &retention, |deleted| bar.set_position(deleted)).await;
    bar.finish_and_clear();
    let report = report?;
    let with_outbox = outbox_admin::installed(pool).await?;
    write_purged(out, args, &retention, &report, with_outbox)?;
    Ok(())
}

/// What a `purge` deleted.
fn write_purged(
    out: &mut dyn Write,
    args: &PurgeArgs,
    retention: &Retention,
    report: &PurgeReport,
    with_outbox: bool,
) -> io::Result<()> {
    let window = admin::format_duration(args.window);
    writeln!(
        out,
        "purged {} inbox rows older than {window}{}",
        report.deleted,
        if args.include_failed_and_dead {
            " (failed and dead included)"
        } else {
            ""
        }
    )?;
    if args.include_rejections {
        writeln!(
            out,
            "purged {} rejected deliveries older than {window}",
            report.rejections_deleted,
        )?;
    }
    if with_outbox {
        writeln!(
            out,
            "purged {} sent outbox rows older than {window} (pending and dead rows kept)",
            report.outbox_deleted,
        )?;
    }
    writeln!(
        out,
        "{} statement{} of at most {} rows each",
        report.batches,
        if report.batches == 1 { "" } else { "s" },
        retention.get_batch_size()
    )
}

/// Runs an `outbox …` command.
async fn outbox<DB: OutboxDatabase>(
    command: &OutboxCommand,
    pool: &Pool<DB>,
    out: &mut dyn Write,
    ask: Ask,
) -> Result<(), CliError> {
    if !outbox_admin::installed(pool).await? {
        return Err(CliError::OutboxNotInstalled);
    }
    match command {
        OutboxCommand::List(args) => {
            if let Some(destination) = &args.destination {
                check_destination(pool, destination).await?;
            }
            let statuses = OutboxStatusArg::statuses(args.status);
            let rows =
                outbox_admin::list(pool, statuses, args.destination.as_deref(), args.limit).await?;
            write_outbox_list(out, &rows, statuses)?;
        }
        OutboxCommand::Show(row) => {
            let entry = outbox_admin::show(pool, &row.message_id)
                .await?
                .ok_or_else(|| CliError::OutboxNotFound {
                    message_id: row.message_id.clone(),
                })?;
            write_outbox_show(out, &entry)?;
        }
        OutboxCommand::Retry(args) => outbox_retry(args, pool, out).await?,
        OutboxCommand::Discard(args) => outbox_discard(args, pool, out, ask).await?,
    }
    Ok(())
}

/// `outbox retry`: one dead row by its message id, or every dead row (of a destination).
async fn outbox_retry<DB: OutboxDatabase>(
    args: &OutboxRetryArgs,
    pool: &Pool<DB>,
    out: &mut dyn Write,
) -> Result<(), CliError> {
    match &args.message_id {
        Some(message_id) => {
            if !outbox_admin::retry(pool, message_id).await? {
                return Err(not_dead(pool, message_id, "retried").await);
            }
            writeln!(
                out,
                "{message_id}: pending again (attempts reset); relays send it with the same \
                     message id"
            )?;
        }
        None => {
            if let Some(destination) = &args.destination {
                check_destination(pool, destination).await?;
            }
            let retried = outbox_admin::retry_dead(pool, args.destination.as_deref()).await?;
            writeln!(
                out,
                "{retried} dead outbox message{} pending again{}",
                if retried == 1 { "" } else { "s" },
                args.destination
                    .as_deref()
                    .map(|d| format!(" (destination {d})"))
                    .unwrap_or_default()
            )?;
        }
    }
    Ok(())
}

/// `outbox discard`: deletes one dead row, after asking (see [`confirm_discard`]).
async fn outbox_discard<DB: OutboxDatabase>(
    args: &OutboxDiscardArgs,
    pool: &Pool<DB>,
    out: &mut dyn Write,
    ask: Ask,
) -> Result<(), CliError> {
    let entry = outbox_admin::show(pool, &args.message_id)
        .await?
        .ok_or_else(|| CliError::OutboxNotFound {
            message_id: args.message_id.clone(),
        })?;
    if entry.status != OutboxStatus::Dead {
        return Err(CliError::OutboxNotDead {
            message_id: entry.message_id,
            status: entry.status,
            what: "discarded",
        });
    }
    if ask == Ask::Terminal
        && !args.yes
        && io::stdin().is_terminal()
        && !confirm_discard(&entry, &mut io::stdin().lock(), &mut io::stderr())?
    {
        return Err(CliError::DiscardCancelled {
            message_id: entry.message_id,
        });
    }
    if !outbox_admin::discard(pool, &args.message_id).await? {
        return Err(not_dead(pool, &args.message_id, "discarded").await);
    }
    writeln!(
        out,
        "{}: discarded (deleted; it will never be sent){}",
        args.message_id,
        entry
            .aggregate_id
            .as_deref()
            .map(|a| format!("; the rows after it of aggregate {a} go out next"))
            .unwrap_or_default()
    )?;

    Ok(())
}

/// Why a retry or discard of `message_id` changed nothing: no such row, or not dead.
async fn not_dead<DB: OutboxDatabase>(
    pool: &Pool<DB>,
    message_id: &str,
    what: &'static str,
) -> CliError {
    match outbox_admin::show(pool, message_id).await {
        Ok(Some(entry)) => CliError::OutboxNotDead {
            message_id: message_id.to_owned(),
            status: entry.status,
            what,
        },
        Ok(None) => CliError::OutboxNotFound {
            message_id: message_id.to_owned(),
        },
        Err(error) => CliError::Database(error),
    }
}

/// [`CliError::UnknownDestination`] unless the outbox has rows for `destination`.
async fn check_destination<DB: OutboxDatabase>(
    pool: &Pool<DB>,
    destination: &str,
) -> Result<(), CliError> {
    let rows = outbox_admin::stats(pool).await?;
    if rows.iter().any(|row| row.destination == destination) {
        return Ok(());
    }
    let mut known: Vec<String> = rows.into_iter().map(|row| row.destination).collect();
    known.dedup();
    Err(CliError::UnknownDestination {
        destination: destination.to_owned(),
        known,
    })
}

/// Asks on `prompt` whether to discard the dead row `entry`, and reads the answer from `input`:
/// `y` or `yes` (any case) confirms; anything else, or nothing, does not.
fn confirm_discard(
    entry: &OutboxEntry,
    input: &mut dyn io::BufRead,
    prompt: &mut dyn Write,
) -> io::Result<bool> {
    write!(
        prompt,
        "discard outbox message {} ({} to {}, dead after {} attempt{})? it will never be sent{}.\n\
         discard it? [y/N] ",
        entry.message_id,
        entry.message_name,
        entry.destination,
        entry.attempts,
        if entry.attempts == 1 { "" } else { "s" },
        entry
            .aggregate_id
            .as_deref()
            .map(|a| format!(", and the rows after it of aggregate {a} go out next"))
            .unwrap_or_default()
    )?;
    answered_yes(input, prompt)
}

/// Reads the answer to the question just written on `prompt` from `input`: `y` or `yes` (any
/// case) confirms; anything else, or nothing, does not.
fn answered_yes(input: &mut dyn io::BufRead, prompt: &mut dyn Write) -> io::Result<bool> {
    prompt.flush()?;
    let mut answer = String::new();
    input.read_line(&mut answer)?;
    Ok(matches!(
        answer.trim().to_ascii_lowercase().as_str(),
        "y" | "yes"
    ))
}

/// One day: a purge that would delete rows settled more recently asks first.
const DAY: Duration = Duration::from_secs(86_400);

/// How many inbox rows a purge with `retention` would delete that were settled less than a day
/// ago (none when the window is a day or more).
async fn settled_within_a_day<DB: OutboxDatabase>(
    pool: &Pool<DB>,
    retention: &Retention,
) -> Result<u64, CliError> {
    if retention.window() >= DAY {
        return Ok(0);
    }
    let all = admin::purge_preview(pool, retention).await?.messages();
    // The window is under a day and covers the horizon, so a day does too.
    let a_day = Retention::new(DAY, retention.redelivery_horizon())?
        .include_failed_and_dead(retention.get_include_failed_and_dead())
        .include_rejections(retention.get_include_rejections());
    let older = admin::purge_preview(pool, &a_day).await?.messages();
    Ok(all.saturating_sub(older))
}

/// Asks on `prompt` whether to delete `young` rows settled less than a day ago, and reads the
/// answer from `input`: `y` or `yes` (any case) confirms; anything else, or nothing, does not.
fn confirm(
    young: u64,
    window: Duration,
    input: &mut dyn io::BufRead,
    prompt: &mut dyn Write,
) -> io::Result<bool> {
    write!(
        prompt,
        "this purge would delete {young} inbox row{} settled less than a day ago (window {}): \
         a redelivery of one of their keys would be processed again.\ndelete them? [y/N] ",
        if young == 1 { "" } else { "s" },
        admin::format_duration(window)
    )?;
    answered_yes(input, prompt)
}

/// `purge --dry-run`: what would go, per consumer and status (and outbox destination), and that
/// nothing went.
fn write_preview(
    out: &mut dyn Write,
    args: &PurgeArgs,
    preview: &PurgePreview,
    with_outbox: bool,
) -> io::Result<()> {
    let window = admin::format_duration(args.window);
    let cutoff = utc_time(&preview.cutoff);
    writeln!(
        out,
        "would purge {} inbox rows settled before {cutoff} (window {window}){}",
        preview.messages(),
        if args.include_failed_and_dead {
            ", failed and dead included"
        } else {
            ""
        }
    )?;
    if args.include_rejections {
        writeln!(
            out,
            "would purge {} rejected deliveries received before {cutoff}",
            preview.rejections()
        )?;
    }
    if !preview.rows.is_empty() {
        let mut table = Table::new(&[
            ("CONSUMER", false),
            ("STATUS", false),
            ("ROWS", true),
            ("OLDEST", false),
        ]);
        for row in &preview.rows {
            table.row(vec![
                or_dash(&row.consumer),
                row.status.to_string(),
                row.count.to_string(),
                time_or_dash(row.oldest.as_deref()),
            ]);
        }
        table.write(out)?;
    }
    if with_outbox {
        writeln!(
            out,
            "would purge {} sent outbox rows sent before {cutoff} (pending and dead rows kept)",
            preview.outbox_sent()
        )?;
        if !preview.outbox.is_empty() {
            let mut table = Table::new(&[
                ("DESTINATION", false),
                ("ROWS", true),
                ("OLDEST SENT", false),
            ]);
            for row in &preview.outbox {
                table.row(vec![
                    row.destination.clone(),
                    row.count.to_string(),
                    time_or_dash(row.oldest.as_deref()),
                ]);
            }
            table.write(out)?;
        }
    }
    writeln!(out, "dry run: nothing deleted")
}

/// A progress bar on standard error, hidden unless standard error is a terminal. `len`: the
/// total, if known (else a spinner).
fn progress_bar(len: Option<u64>, template: &str) -> ProgressBar {
    let target = if io::stderr().is_terminal() {
        ProgressDrawTarget::stderr()
    } else {
        ProgressDrawTarget::hidden()
    };
    let bar = ProgressBar::with_draw_target(len, target);
    // The style first: a ticking bar draws at once, and would draw indicatif's default style.
    if let Ok(style) = ProgressStyle::with_template(template) {
        bar.set_style(style);
    }
    if len.is_none() {
        bar.enable_steady_tick(Duration::from_millis(120));
    }
    bar
}

/// How one replay ended.
pub(crate) enum Replayed {
    /// The handler ran and its effect committed.
    Processed,
    /// The key was processed meanwhile: nothing ran.
    Duplicate,
    /// It did not end processed (it failed again, is not due, was discarded …): why, as text.
    NotProcessed(String),
}

impl Replayed {
    /// A replay's outcome, or its error's text: the SQL store's [`Error`](crate::Error) or the
    /// DynamoDB one's `DynamoError`, which both display a handler failure as the failure itself.
    pub(crate) fn of(result: Result<Outcome<()>, impl std::fmt::Display>) -> Self {
        match result {
            Ok(Outcome::Processed(())) => Self::Processed,
            Ok(Outcome::Duplicate) => Self::Duplicate,
            Ok(other) => Self::NotProcessed(other.kind().into()),
            Err(error) => Self::NotProcessed(error.to_string()),
        }
    }
}

/// What `dead replay` needs of a store: one replay through the registered handler, and the
/// failed and dead messages to replay with `--all`.
pub(crate) trait Replayer {
    /// Replays `consumer`'s message `key` once.
    async fn replay_one(&self, consumer: &str, key: &str) -> Result<Replayed, CliError>;
    /// The messages of `statuses` (of `consumer`, if given), oldest first.
    async fn failed_and_dead(
        &self,
        consumer: Option<&str>,
        statuses: &[Status],
    ) -> Result<Vec<StoredMessage>, CliError>;
}

impl<DB: InboxDatabase> Replayer for Dispatcher<DB> {
    async fn replay_one(&self, consumer: &str, key: &str) -> Result<Replayed, CliError> {
        Ok(Replayed::of(self.replay(consumer, key).await?.result))
    }

    async fn failed_and_dead(
        &self,
        consumer: Option<&str>,
        statuses: &[Status],
    ) -> Result<Vec<StoredMessage>, CliError> {
        Ok(admin::list(self.pool(), consumer, statuses, u32::MAX).await?)
    }
}

/// `dead replay`: one message (its outcome printed), or with `--all` every failed and dead one
/// (a progress bar, the ones not processed printed, then the totals).
///
/// # Errors
/// The store's error for a single replay that could not run; [`CliError::ReplayFailed`] if
/// any replay did not end processed or duplicate.
pub(crate) async fn replay(
    store: &impl Replayer,
    args: &ReplayArgs,
    out: &mut dyn Write,
) -> Result<(), CliError> {
    if !args.all {
        let (Some(consumer), Some(key)) = (&args.consumer, &args.key) else {
            unreachable!("clap requires CONSUMER and KEY without --all")
        };
        let text = match store.replay_one(consumer, key).await? {
            Replayed::Processed => "processed".to_owned(),
            Replayed::Duplicate => "duplicate (processed meanwhile)".to_owned(),
            Replayed::NotProcessed(why) => {
                writeln!(out, "{consumer}/{key}: {why}")?;
                return Err(CliError::ReplayFailed {
                    failed: 1,
                    total: 1,
                });
            }
        };
        writeln!(out, "{consumer}/{key}: {text}")?;
        return Ok(());
    }

    let rows = store
        .failed_and_dead(
            args.only_consumer.as_deref(),
            DeadStatus::statuses(args.status),
        )
        .await?;
    let total = rows.len() as u64;
    let bar = progress_bar(
        Some(total),
        "replaying {bar:40} {pos}/{len} ({per_sec}, eta {eta})",
    );
    let (mut processed, mut duplicates, mut failed) = (0_u64, 0_u64, 0_u64);
    for row in &rows {
        let line = match store.replay_one(&row.consumer, &row.message_key).await {
            Ok(Replayed::Processed) => {
                processed += 1;
                None
            }
            Ok(Replayed::Duplicate) => {
                duplicates += 1;
                None
            }
            Ok(Replayed::NotProcessed(text)) => Some(text),
            Err(error) => Some(error.to_string()),
        };
        if let Some(text) = line {
            failed += 1;
            bar.suspend(|| writeln!(out, "{}/{}: {text}", row.consumer, row.message_key))?;
        }
        bar.inc(1);
    }
    bar.finish_and_clear();
    writeln!(
        out,
        "replayed {total}: {processed} processed, {duplicates} duplicates, {failed} not processed"
    )?;
    if failed > 0 {
        return Err(CliError::ReplayFailed { failed, total });
    }
    Ok(())
}

/// Left- or right-aligned columns, two spaces apart.
struct Table {
    header: Vec<&'static str>,
    right: Vec<bool>,
    rows: Vec<Vec<String>>,
}

impl Table {
    fn new(columns: &[(&'static str, bool)]) -> Self {
        Self {
            header: columns.iter().map(|(name, _)| *name).collect(),
            right: columns.iter().map(|(_, right)| *right).collect(),
            rows: Vec::new(),
        }
    }

    fn row(&mut self, cells: Vec<String>) {
        self.rows.push(cells);
    }

    fn write(&self, out: &mut dyn Write) -> io::Result<()> {
        let mut widths: Vec<usize> = self.header.iter().map(|h| h.chars().count()).collect();
        for row in &self.rows {
            for (width, cell) in widths.iter_mut().zip(row) {
                *width = (*width).max(cell.chars().count());
            }
        }
        let line = |cells: &mut dyn Iterator<Item = &str>| {
            let mut text = String::new();
            for (index, cell) in cells.enumerate() {
                if index > 0 {
                    text.push_str("  ");
                }
                let pad = widths[index].saturating_sub(cell.chars().count());
                if self.right[index] {
                    text.extend(std::iter::repeat_n(' ', pad));
                    text.push_str(cell);
                } else {
                    text.push_str(cell);
                    text.extend(std::iter::repeat_n(' ', pad));
                }
            }
            text.trim_end().to_owned()
        };
        writeln!(out, "{}", line(&mut self.header.iter().copied()))?;
        for row in &self.rows {
            writeln!(out, "{}", line(&mut row.iter().map(String::as_str)))?;
        }
        Ok(())
    }
}

/// `stats` of the inbox: per consumer, the rows in each status, the conflicts seen and the
/// oldest failed and dead ones; then the rejected deliveries kept.
fn write_stats(out: &mut dyn Write, rows: &[StatsRow]) -> io::Result<()> {
    write_inbox_stats(out, rows)?;
    write_rejected(out, rows)
}

/// The inbox table of `stats` (or `inbox: empty`).
fn write_inbox_stats(out: &mut dyn Write, rows: &[StatsRow]) -> io::Result<()> {
    let mut consumers: Vec<&str> = rows
        .iter()
        .filter(|row| matches!(row.status, StatsStatus::Message(_)))
        .filter_map(|row| row.consumer.as_deref())
        .collect();
    consumers.sort_unstable();
    consumers.dedup();
    if consumers.is_empty() {
        return writeln!(out, "inbox: empty");
    }
    let find = |consumer: &str, status: StatsStatus| {
        rows.iter()
            .find(|row| row.consumer.as_deref() == Some(consumer) && row.status == status)
    };
    let mut inbox = Table::new(&[
        ("CONSUMER", false),
        ("PROCESSED", true),
        ("FAILED", true),
        ("DEAD", true),
        ("PARKED", true),
        ("STALE", true),
        ("DISCARDED", true),
        ("CONFLICTS SEEN", true),
        ("OLDEST FAILED", false),
        ("OLDEST DEAD", false),
    ]);
    // Every status, in the table's column order, then the conflicts.
    let columns: Vec<StatsStatus> = Status::ALL
        .into_iter()
        .map(StatsStatus::Message)
        .chain([StatsStatus::Rejected(RejectionReason::Conflict)])
        .collect();
    let mut totals = Totals::new(consumers.len(), columns.len());
    for consumer in &consumers {
        let mut cells = totals.row(
            consumer,
            columns
                .iter()
                .map(|status| find(consumer, *status).map_or(0, |row| row.count)),
        );
        for status in [Status::Failed, Status::Dead] {
            cells.push(time_or_dash(
                find(consumer, StatsStatus::Message(status)).and_then(|row| row.oldest.as_deref()),
            ));
        }
        inbox.row(cells);
    }
    totals.finish(&mut inbox);
    inbox.write(out)
}

/// The rejected deliveries of `stats`, per consumer and reason (nothing if there are none).
fn write_rejected(out: &mut dyn Write, rows: &[StatsRow]) -> io::Result<()> {
    let rejected: Vec<(&StatsRow, RejectionReason)> = rows
        .iter()
        .filter_map(|row| match row.status {
            StatsStatus::Rejected(reason) => Some((row, reason)),
            StatsStatus::Message(_) => None,
        })
        .collect();
    if rejected.is_empty() {
        return Ok(());
    }
    writeln!(out)?;
    writeln!(out, "rejected deliveries, kept with their payloads:")?;
    let mut table = Table::new(&[
        ("CONSUMER", false),
        ("REASON", false),
        ("COUNT", true),
        ("OLDEST", false),
    ]);
    for (row, reason) in rejected {
        let reason = match reason {
            RejectionReason::Conflict => "conflict (same key, other payload)",
            RejectionReason::Malformed => "malformed payload",
            RejectionReason::UnknownMessage => "unknown message name",
            RejectionReason::InvalidKey => "invalid key",
            RejectionReason::TooLarge => "payload over the size limit",
        };
        table.row(vec![
            or_dash(&row.consumer),
            reason.into(),
            row.count.to_string(),
            time_or_dash(row.oldest.as_deref()),
        ]);
    }
    table.write(out)
}

/// The count columns of a `stats` table, summed into an `(all)` row when there are several rows.
struct Totals {
    rows: usize,
    sums: Vec<i64>,
}

impl Totals {
    /// For `rows` rows of `columns` counts each.
    fn new(rows: usize, columns: usize) -> Self {
        Self {
            rows,
            sums: vec![0; columns],
        }
    }

    /// The cells of one row: `name`, then `counts` (added to the sums).
    fn row(&mut self, name: &str, counts: impl Iterator<Item = i64>) -> Vec<String> {
        let mut cells = vec![name.to_owned()];
        for (sum, n) in self.sums.iter_mut().zip(counts) {
            *sum += n;
            cells.push(n.to_string());
        }
        cells
    }

    /// Adds the `(all)` row to `table` if there are several rows.
    fn finish(self, table: &mut Table) {
        if self.rows > 1 {
            let mut cells = vec!["(all)".to_owned()];
            cells.extend(self.sums.iter().map(i64::to_string));
            table.row(cells);
        }
    }
}

/// `value`, or `-` if there is none.
fn or_dash(value: &Option<String>) -> String {
    value.clone().unwrap_or_else(|| "-".into())
}

/// `value` as a UTC time (see [`utc_time`]), or `-` if there is none.
fn time_or_dash(value: Option<&str>) -> String {
    value.map_or_else(|| "-".into(), utc_time)
}

/// One `name: value` line per field, the values aligned.
fn write_fields(out: &mut dyn Write, fields: &[(&str, String)]) -> io::Result<()> {
    for (name, value) in fields {
        writeln!(out, "{:<13} {value}", format!("{name}:"))?;
    }
    Ok(())
}

/// `bytes` as pretty JSON, or as text if they are not JSON.
fn pretty_json(bytes: &[u8]) -> String {
    serde_json::from_slice::<serde_json::Value>(bytes)
        .ok()
        .and_then(|value| serde_json::to_string_pretty(&value).ok())
        .unwrap_or_else(|| String::from_utf8_lossy(bytes).into_owned())
}

/// The first line of `text`, at most `max` characters (an ellipsis marks a cut).
fn first_line(text: &str, max: usize) -> String {
    let line = text.lines().next().unwrap_or("");
    if line.chars().count() > max || line.len() < text.trim_end().len() {
        let mut cut: String = line.chars().take(max.saturating_sub(1)).collect();
        cut.push('…');
        cut
    } else {
        line.to_owned()
    }
}

fn write_list(out: &mut dyn Write, rows: &[StoredMessage]) -> io::Result<()> {
    if rows.is_empty() {
        return writeln!(out, "no failed or dead messages");
    }
    let mut table = Table::new(&[
        ("CONSUMER", false),
        ("KEY", false),
        ("MESSAGE", false),
        ("STATUS", false),
        ("ATTEMPTS", true),
        ("RECEIVED", false),
        ("LAST ERROR", false),
    ]);
    for row in rows {
        table.row(vec![
            row.consumer.clone(),
            row.message_key.clone(),
            row.message_name.clone(),
            row.status.to_string(),
            row.attempts.to_string(),
            utc_time(&row.received_at),
            first_line(row.last_error.as_deref().unwrap_or("-"), 72),
        ]);
    }
    table.write(out)
}

fn write_show(out: &mut dyn Write, row: &StoredMessage) -> io::Result<()> {
    let fields = [
        ("consumer", row.consumer.clone()),
        ("key", row.message_key.clone()),
        ("message", row.message_name.clone()),
        ("status", row.status.to_string()),
        ("attempts", row.attempts.to_string()),
        ("received", utc_time(&row.received_at)),
        ("processed", time_or_dash(row.processed_at.as_deref())),
        // Only a failed message is retried; a dead one waits for an operator.
        (
            "next attempt",
            if row.status == Status::Failed {
                time_or_dash(row.next_attempt_at.as_deref())
            } else {
                "-".into()
            },
        ),
        ("source", or_dash(&row.source)),
        ("fingerprint", row.payload_hash.clone()),
        ("last error", or_dash(&row.last_error)),
    ];
    write_fields(out, &fields)?;
    match &row.payload {
        None => writeln!(
            out,
            "payload:      - (not kept for {} messages)",
            row.status
        ),
        Some(bytes) => {
            writeln!(out, "payload:")?;
            writeln!(out, "{}", pretty_json(bytes))
        }
    }
}

/// The outbox part of `stats`: per destination, the rows in each status and the oldest pending
/// and dead ones.
fn write_outbox_stats(out: &mut dyn Write, rows: &[OutboxStatsRow]) -> io::Result<()> {
    if rows.is_empty() {
        return writeln!(out, "outbox: empty");
    }
    writeln!(out, "outbox:")?;
    let mut destinations: Vec<&str> = rows.iter().map(|row| row.destination.as_str()).collect();
    destinations.dedup();
    let find = |destination: &str, status: OutboxStatus| {
        rows.iter()
            .find(|row| row.destination == destination && row.status == status)
    };
    let mut table = Table::new(&[
        ("DESTINATION", false),
        ("PENDING", true),
        ("SENT", true),
        ("DEAD", true),
        ("OLDEST PENDING", false),
        ("OLDEST DEAD", false),
    ]);
    let statuses = [
        OutboxStatus::Pending,
        OutboxStatus::Sent,
        OutboxStatus::Dead,
    ];
    let mut totals = Totals::new(destinations.len(), statuses.len());
    for destination in &destinations {
        let mut cells = totals.row(
            destination,
            statuses
                .iter()
                .map(|status| find(destination, *status).map_or(0, |row| row.count)),
        );
        for status in [OutboxStatus::Pending, OutboxStatus::Dead] {
            cells.push(time_or_dash(
                find(destination, status).and_then(|row| row.oldest.as_deref()),
            ));
        }
        table.row(cells);
    }
    totals.finish(&mut table);
    table.write(out)
}

/// `outbox list`.
fn write_outbox_list(
    out: &mut dyn Write,
    rows: &[OutboxEntry],
    statuses: &[OutboxStatus],
) -> io::Result<()> {
    if rows.is_empty() {
        let names: Vec<&str> = statuses.iter().map(|s| s.as_str()).collect();
        return writeln!(out, "no {} outbox messages", names.join(" or "));
    }
    let mut table = Table::new(&[
        ("MESSAGE ID", false),
        ("DESTINATION", false),
        ("MESSAGE", false),
        ("AGGREGATE", false),
        ("STATUS", false),
        ("ATTEMPTS", true),
        ("CREATED", false),
        ("LAST ERROR", false),
    ]);
    for row in rows {
        table.row(vec![
            row.message_id.clone(),
            row.destination.clone(),
            row.message_name.clone(),
            or_dash(&row.aggregate_id),
            row.status.to_string(),
            row.attempts.to_string(),
            utc_time(&row.created_at),
            first_line(row.last_error.as_deref().unwrap_or("-"), 72),
        ]);
    }
    table.write(out)
}

/// `outbox show`: every column, the headers one per line, the payload as pretty JSON.
fn write_outbox_show(out: &mut dyn Write, row: &OutboxEntry) -> io::Result<()> {
    let fields = [
        ("message id", row.message_id.clone()),
        ("row id", row.id.to_string()),
        ("destination", row.destination.clone()),
        ("message", row.message_name.clone()),
        ("aggregate", or_dash(&row.aggregate_id)),
        ("status", row.status.to_string()),
        ("attempts", row.attempts.to_string()),
        ("created", utc_time(&row.created_at)),
        // Only a pending row waits for a retry or a lease; a dead one waits for an operator.
        (
            "next attempt",
            if row.status == OutboxStatus::Pending {
                time_or_dash(row.next_attempt_at.as_deref())
            } else {
                "-".into()
            },
        ),
        (
            "leased until",
            if row.status == OutboxStatus::Pending {
                time_or_dash(row.leased_until.as_deref())
            } else {
                "-".into()
            },
        ),
        ("sent", time_or_dash(row.sent_at.as_deref())),
        ("transaction", or_dash(&row.txid)),
        ("last error", or_dash(&row.last_error)),
    ];
    write_fields(out, &fields)?;
    match serde_json::from_str::<std::collections::BTreeMap<String, String>>(&row.headers_json) {
        Ok(headers) if headers.is_empty() => writeln!(out, "headers:      -")?,
        Ok(headers) => {
            writeln!(out, "headers:")?;
            for (name, value) in headers {
                writeln!(out, "  {name}: {value}")?;
            }
        }
        Err(_) => writeln!(
            out,
            "headers:      {} (not a JSON object of strings)",
            row.headers_json
        )?,
    }
    match &row.payload {
        None => writeln!(
            out,
            "payload:      - ({} bytes, not loaded)",
            row.payload_size
        ),
        Some(bytes) => {
            writeln!(out, "payload ({} bytes):", bytes.len())?;
            writeln!(out, "{}", pretty_json(bytes))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_purge_of_young_rows_asks() {
        let ask = |answer: &str| {
            let mut prompt = Vec::new();
            let yes = confirm(
                3,
                Duration::from_secs(7200),
                &mut answer.as_bytes(),
                &mut prompt,
            )
            .unwrap();
            (yes, String::from_utf8(prompt).unwrap())
        };
        let question = "this purge would delete 3 inbox rows settled less than a day ago \
                        (window 2h): a redelivery of one of their keys would be processed \
                        again.\ndelete them? [y/N] ";
        assert_eq!(ask("y\n"), (true, question.to_owned()));
        assert_eq!(ask(" YES \n"), (true, question.to_owned()));
        assert_eq!(ask("n\n"), (false, question.to_owned()));
        assert_eq!(ask("\n"), (false, question.to_owned()));
        assert_eq!(ask(""), (false, question.to_owned()), "end of input");
        assert_eq!(ask("yep\n"), (false, question.to_owned()));
    }

    #[test]
    fn a_discard_asks() {
        let entry = OutboxEntry {
            id: 7,
            message_id: "m-1".into(),
            destination: "orders".into(),
            message_name: "orders.paid".into(),
            payload: None,
            payload_size: 2,
            headers_json: "{}".into(),
            aggregate_id: Some("order-1".into()),
            txid: None,
            created_at: "2026-01-02T03:04:05.000Z".into(),
            status: OutboxStatus::Dead,
            attempts: 3,
            next_attempt_at: None,
            leased_until: None,
            last_error: Some("permanent: refused".into()),
            sent_at: None,
        };
        let ask = |entry: &OutboxEntry, answer: &str| {
            let mut prompt = Vec::new();
            let yes = confirm_discard(entry, &mut answer.as_bytes(), &mut prompt).unwrap();
            (yes, String::from_utf8(prompt).unwrap())
        };
        let question = "discard outbox message m-1 (orders.paid to orders, dead after 3 \
                        attempts)? it will never be sent, and the rows after it of aggregate \
                        order-1 go out next.\ndiscard it? [y/N] ";
        assert_eq!(ask(&entry, "y\n"), (true, question.to_owned()));
        assert_eq!(ask(&entry, "Yes\n"), (true, question.to_owned()));
        assert_eq!(ask(&entry, "n\n"), (false, question.to_owned()));
        assert_eq!(
            ask(&entry, ""),
            (false, question.to_owned()),
            "end of input"
        );
        let mut alone = entry.clone();
        alone.aggregate_id = None;
        alone.attempts = 1;
        assert_eq!(
            ask(&alone, "\n").1,
            "discard outbox message m-1 (orders.paid to orders, dead after 1 attempt)? it will \
             never be sent.\ndiscard it? [y/N] "
        );
    }

    #[test]
    fn outbox_arguments_parse() {
        let parse = |args: &[&str]| AdminCli::try_parse_from(args.iter().copied());
        let cli = parse(&[
            "admin",
            "outbox",
            "list",
            "--status",
            "sent",
            "--destination",
            "orders",
        ])
        .unwrap();
        let AdminCommand::Outbox(OutboxCommand::List(list)) = cli.command else {
            panic!("outbox list")
        };
        assert_eq!(
            (list.status, list.destination.as_deref(), list.limit),
            (Some(OutboxStatusArg::Sent), Some("orders"), 50)
        );
        assert_eq!(
            OutboxStatusArg::statuses(None),
            [OutboxStatus::Pending, OutboxStatus::Dead]
        );
        assert!(parse(&["admin", "outbox", "show", "m-1"]).is_ok());
        assert!(parse(&["admin", "outbox", "show"]).is_err());
        assert!(parse(&["admin", "outbox", "retry", "m-1"]).is_ok());
        assert!(
            parse(&[
                "admin",
                "outbox",
                "retry",
                "--dead",
                "--destination",
                "orders"
            ])
            .is_ok()
        );
        assert!(
            parse(&["admin", "outbox", "retry"]).is_err(),
            "nothing to retry"
        );
        assert!(parse(&["admin", "outbox", "retry", "m-1", "--dead"]).is_err());
        assert!(parse(&["admin", "outbox", "retry", "--destination", "orders"]).is_err());
        assert!(parse(&["admin", "outbox", "discard", "m-1", "-y"]).is_ok());
        assert!(parse(&["admin", "outbox", "discard"]).is_err());
        assert!(parse(&["admin", "outbox", "list", "--status", "failed"]).is_err());
    }

    #[test]
    fn tables_align() {
        let mut table = Table::new(&[("NAME", false), ("COUNT", true)]);
        table.row(vec!["ledger".into(), "26000".into()]);
        table.row(vec!["audit".into(), "7".into()]);
        let mut out = Vec::new();
        table.write(&mut out).unwrap();
        assert_eq!(
            String::from_utf8(out).unwrap(),
            "NAME    COUNT\nledger  26000\naudit       7\n"
        );
    }

    #[test]
    fn arguments_parse() {
        let parse = |args: &[&str]| AdminCli::try_parse_from(args.iter().copied());
        let cli = parse(&[
            "admin",
            "purge",
            "--window",
            "7d",
            "--redelivery-horizon",
            "3d",
        ])
        .unwrap();
        let AdminCommand::Purge(purge) = cli.command else {
            panic!("purge")
        };
        assert_eq!(purge.window, Duration::from_secs(7 * 86_400));
        assert_eq!(purge.redelivery_horizon, Duration::from_secs(3 * 86_400));
        assert!(
            parse(&[
                "admin",
                "purge",
                "--window",
                "7 fortnights",
                "--redelivery-horizon",
                "1d"
            ])
            .is_err()
        );

        assert!(parse(&["admin", "dead", "replay", "ledger", "k-1"]).is_ok());
        assert!(parse(&["admin", "dead", "replay", "--all", "--consumer", "ledger"]).is_ok());
        assert!(
            parse(&["admin", "dead", "replay", "ledger"]).is_err(),
            "KEY missing"
        );
        assert!(
            parse(&["admin", "dead", "replay"]).is_err(),
            "nothing to replay"
        );
        assert!(parse(&["admin", "dead", "replay", "ledger", "k", "--all"]).is_err());
        assert!(
            parse(&["admin", "dead", "replay", "--consumer", "ledger"]).is_err(),
            "--consumer needs --all"
        );
        assert!(parse(&["admin", "dead", "list", "--status", "dead", "--limit", "5"]).is_ok());
        assert!(parse(&["admin", "dead", "list", "--status", "processed"]).is_err());
    }

    #[test]
    fn error_lines_are_cut() {
        assert_eq!(first_line("short", 10), "short");
        assert_eq!(first_line("one\ntwo", 10), "one…");
        assert_eq!(first_line("abcdefghijkl", 5), "abcd…");
    }
}
