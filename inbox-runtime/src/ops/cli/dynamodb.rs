//! The command line on the DynamoDB inbox (features `cli` and `dynamodb`): the same
//! [`AdminCommand`]s and the same output as on the SQL stores, on a [`DynamoInbox`] (store URL
//! `dynamodb://TABLE`: [`run_url`], [`DynamoInbox::from_url`]).
//!
//! ```no_run
//! # async fn demo() -> std::process::ExitCode {
//! // `myservice admin stats`, with the inbox on DynamoDB table `inbox`
//! // (endpoint and region from AWS_ENDPOINT_URL / AWS_REGION, as `dynamodb::client(None)`).
//! let args = std::env::args_os().skip(1); // "admin", "stats"
//! inbox_runtime::ops::cli::dynamodb::run_url("dynamodb://inbox", args).await
//! # }
//! ```
//!
//! | command | on DynamoDB |
//! |---|---|
//! | `migrate` | [`DynamoInbox::ensure_table`]: the table, its dead-letter index, TTL |
//! | `stats` | [`DynamoAdmin::stats`] (a `Scan` of the table), the kept rejections included ([`crate::dynamodb::rejections`]); no outbox part (the DynamoDB outbox has no admin yet) |
//! | `dead list` | [`DynamoAdmin::list`] (the dead-letter index) |
//! | `dead show` | [`DynamoAdmin::show`] |
//! | `dead discard` | [`DynamoAdmin::discard`] |
//! | `dead replay` | [`DynamoDispatcher::replay`] through the program's registered `#[idempotent]` DynamoDB handlers ([`DynamoDispatcher::from_registry`]: run the command line from the program that links them); `--all` lists with [`DynamoAdmin::list`] |
//! | `outbox …`, `purge` | refused: [`CliError::Unsupported`] (the DynamoDB outbox has no commands yet; DynamoDB's TTL is the purge) |
//!
//! A command that names a consumer and finds nothing (`dead list --consumer` with no rows,
//! `dead show`, `dead discard`) then reads the statistics to tell an unknown consumer
//! ([`CliError::UnknownConsumer`]) from a known one without that message
//! ([`CliError::NotFound`]): the same errors as on SQL, and the `Scan` only when needed.

use std::ffi::OsString;
use std::io::{self, Write};
use std::process::ExitCode;

use super::{AdminCommand, CliError, DeadCommand, DeadStatus, MessageRef, Replayed, Replayer};
use crate::dynamodb::{DynamoAdmin, DynamoDispatcher, DynamoInbox};
use crate::store::StoredMessage;
use crate::types::status::Status;

/// Parses `args` (the program name first, as in `std::env::args_os()`) as an [`AdminCli`](super::AdminCli) and
/// runs the command on `inbox`, printing results on standard output and errors on standard
/// error, as [`super::run`] does on a pool.
///
/// Exit status: 0 on success, 1 if the command failed ([`CliError`]), 2 on bad usage (clap's
/// message is printed; `--help` exits 0).
pub async fn run<I, T>(inbox: &DynamoInbox, args: I) -> ExitCode
where
    I: IntoIterator<Item = T>,
    T: Into<OsString> + Clone,
{
    super::parse_and_run(
        args,
        |command| async move { execute(&command, inbox).await },
    )
    .await
}

/// [`run`] on the inbox of the store URL `dynamodb://TABLE` ([`DynamoInbox::from_url`]: the
/// standard AWS configuration). A URL that is not one prints `error: …` and exits 1.
pub async fn run_url<I, T>(url: &str, args: I) -> ExitCode
where
    I: IntoIterator<Item = T>,
    T: Into<OsString> + Clone,
{
    match DynamoInbox::from_url(url).await {
        Ok(inbox) => run(&inbox, args).await,
        Err(error) => {
            eprintln!("error: {}", CliError::from(error));
            ExitCode::from(1)
        }
    }
}

/// Runs `command` on `inbox`, printing on standard output.
///
/// # Errors
/// [`CliError::Dynamo`] (a DynamoDB call failed, or an item is malformed),
/// [`CliError::DynamoTable`] (`migrate`), [`CliError::UnknownConsumer`],
/// [`CliError::NotFound`], [`CliError::Unsupported`] (`outbox …`, `purge`),
/// [`CliError::Registry`] (`dead replay` in a program with no DynamoDB handlers),
/// [`CliError::Replay`] (a single replay could not run), [`CliError::ReplayFailed`],
/// [`CliError::Io`].
pub async fn execute(command: &AdminCommand, inbox: &DynamoInbox) -> Result<(), CliError> {
    let stdout = io::stdout();
    let mut out = stdout.lock();
    execute_to(command, inbox, &mut out).await
}

/// Runs `command` on `inbox`, writing the results to `out` (for tests and for embedding).
///
/// # Errors
/// As [`execute`].
pub async fn execute_to(
    command: &AdminCommand,
    inbox: &DynamoInbox,
    out: &mut dyn Write,
) -> Result<(), CliError> {
    let admin = inbox.admin();
    match command {
        AdminCommand::Migrate => {
            inbox.ensure_table().await?;
            writeln!(
                out,
                "inbox table ready (dynamodb: {}, with its dead-letter index and TTL)",
                inbox.table()
            )?;
        }
        AdminCommand::Stats => super::write_stats(out, &admin.stats().await?)?,
        AdminCommand::Dead(DeadCommand::List(args)) => {
            let rows = admin
                .list(
                    args.consumer.as_deref(),
                    DeadStatus::statuses(args.status),
                    args.limit,
                )
                .await?;
            if rows.is_empty()
                && let Some(consumer) = &args.consumer
            {
                check_consumer(&admin, consumer).await?;
            }
            super::write_list(out, &rows)?;
        }
        AdminCommand::Dead(DeadCommand::Show(message)) => {
            match admin.show(&message.consumer, &message.key).await? {
                Some(row) => super::write_show(out, &row)?,
                None => return Err(not_found(&admin, message, "stored").await),
            }
        }
        AdminCommand::Dead(DeadCommand::Discard(message)) => {
            if !admin.discard(&message.consumer, &message.key).await? {
                return Err(not_found(&admin, message, "failed or dead").await);
            }
            writeln!(
                out,
                "{}/{}: discarded (its key keeps blocking redeliveries for a retention window, then TTL deletes it)",
                message.consumer, message.key
            )?;
        }
        AdminCommand::Dead(DeadCommand::Replay(args)) => {
            let dispatcher = DynamoDispatcher::from_registry(inbox.clone())?;
            super::replay(&dispatcher, args, out).await?;
        }
        AdminCommand::Outbox(_) => {
            return Err(CliError::Unsupported {
                command: "outbox",
                why: "the command line does not cover the DynamoDB outbox (DynamoOutbox, DynamoRelay) yet",
            });
        }
        AdminCommand::Purge(_) => {
            return Err(CliError::Unsupported {
                command: "purge",
                why: "DynamoDB's TTL on `expires_at` deletes processed and discarded items once \
                      their retention window has passed (set it with DynamoInbox::retention)",
            });
        }
    }
    Ok(())
}

/// [`CliError::UnknownConsumer`] unless `consumer` has items in the inbox (reads the
/// statistics: a `Scan`).
async fn check_consumer(admin: &DynamoAdmin, consumer: &str) -> Result<(), CliError> {
    super::consumer_in_stats(consumer, &[], admin.stats().await?)
}

/// The error for a message not found: [`CliError::UnknownConsumer`] if its consumer has no
/// items at all, else [`CliError::NotFound`] (`what`: what was looked for).
async fn not_found(admin: &DynamoAdmin, message: &MessageRef, what: &'static str) -> CliError {
    match check_consumer(admin, &message.consumer).await {
        Ok(()) => message.not_found(what),
        Err(error) => error,
    }
}

impl Replayer for DynamoDispatcher {
    async fn replay_one(&self, consumer: &str, key: &str) -> Result<Replayed, CliError> {
        Ok(Replayed::of(self.replay(consumer, key).await?.result))
    }

    async fn failed_and_dead(
        &self,
        consumer: Option<&str>,
        statuses: &[Status],
    ) -> Result<Vec<StoredMessage>, CliError> {
        Ok(self
            .inbox()
            .admin()
            .list(consumer, statuses, u32::MAX)
            .await?)
    }
}
