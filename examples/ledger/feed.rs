//! Feeding a JSON-lines stream through the dispatcher, one line after the other.

use inbox_runtime::{
    DispatchError, Dispatcher, Envelope, Error, InboxDatabase, Outcome, SourceMetadata,
};
use serde::Deserialize;
use serde_json::value::RawValue;
use tokio::io::{AsyncBufRead, AsyncBufReadExt as _};

/// What happened to the lines of one stream.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Counts {
    /// Non-blank lines read.
    pub(crate) lines: u64,
    /// Applied now (`Outcome::Processed`).
    pub(crate) processed: u64,
    /// Already applied with the same payload (`Outcome::Duplicate`).
    pub(crate) duplicates: u64,
    /// Already applied with a different payload (`Error::Conflict`): not applied.
    pub(crate) conflicts: u64,
    /// Not a message: malformed line, unknown message name, undecodable payload, bad key.
    pub(crate) rejected: u64,
    /// Refused by the handler for good (a permanent error, e.g. an unknown account), or already
    /// dead-lettered: kept in the inbox as `dead` with its payload, not applied. (Through a
    /// broker, the Worker's report counts discarded keys here too.)
    pub(crate) dead: u64,
    /// Redeliveries of a key an operator discarded (`ledger admin dead discard`): not applied.
    pub(crate) discarded: u64,
}

/// One line of the stream: `{"message": NAME, "payload": {…}}`. The payload is kept as raw
/// bytes: decoding it into the message type is the dispatcher's job.
#[derive(Deserialize)]
struct Line<'a> {
    message: String,
    #[serde(borrow)]
    payload: &'a RawValue,
}

/// Why feeding stopped before the end of the stream.
#[derive(Debug)]
pub(crate) enum FeedError {
    /// The input could not be read.
    Read { line: u64, error: std::io::Error },
    /// A handler or the database failed, or the runtime gave an outcome this demo does not
    /// know: the message was not applied, so going on would make the balances meaningless.
    Failed {
        line: u64,
        consumer: &'static str,
        error: String,
    },
}

impl std::fmt::Display for FeedError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            FeedError::Read { line, error } => write!(f, "cannot read line {line}: {error}"),
            FeedError::Failed {
                line,
                consumer,
                error,
            } => write!(f, "line {line}: consumer `{consumer}` failed: {error}"),
        }
    }
}

fn trim_newline(mut line: &[u8]) -> &[u8] {
    while let [rest @ .., b'\n' | b'\r'] = line {
        line = rest;
    }
    line
}

fn reject(counts: &mut Counts, line: u64, reason: &dyn std::fmt::Display) {
    counts.rejected += 1;
    crate::observe::note(format_args!("line {line}: rejected: {reason}"));
}

/// Dispatches every line of `input` in order, counting the outcomes. Rejections and conflicts
/// are reported on stderr with their line numbers. Blank lines are skipped. `source` names the
/// input in the inbox rows (with the line number as offset).
pub(crate) async fn feed<DB: InboxDatabase>(
    dispatcher: &Dispatcher<DB>,
    mut input: impl AsyncBufRead + Unpin,
    source: &str,
) -> Result<Counts, FeedError> {
    let mut counts = Counts::default();
    let mut buf = Vec::with_capacity(256);
    let mut number = 0_u64;
    loop {
        buf.clear();
        let read = input.read_until(b'\n', &mut buf).await;
        number += 1;
        match read {
            Ok(0) => break,
            Ok(_) => {}
            Err(error) => {
                return Err(FeedError::Read {
                    line: number,
                    error,
                });
            }
        }
        let line = trim_newline(&buf);
        if line.iter().all(u8::is_ascii_whitespace) {
            continue;
        }
        counts.lines += 1;

        let metadata =
            SourceMetadata::new(source).offset(i64::try_from(number).unwrap_or(i64::MAX));
        // A line that is not an envelope goes on with no message name: the dispatcher refuses
        // it (`NoMessageName`) and it is kept, bytes as read, like any other rejected line.
        let (envelope, not_an_envelope) = match serde_json::from_slice::<Line<'_>>(line) {
            Ok(Line { message, payload }) => (Envelope::new(message, payload.get()), None),
            Err(error) => (Envelope::new("", line), Some(error)),
        };
        let envelope = envelope.with_source(metadata);
        let outcomes = match dispatcher.dispatch(&envelope).await {
            Ok(outcomes) => outcomes,
            Err(error) => {
                // Kept in `inbox_rejections` with its payload (see `ledger admin stats`).
                if let Err(db) = dispatcher.record_rejection(&envelope, &error).await {
                    return Err(FeedError::Failed {
                        line: number,
                        consumer: "-",
                        error: format!("cannot record the rejected delivery: {db}"),
                    });
                }
                if let Some(parse) = not_an_envelope {
                    reject(
                        &mut counts,
                        number,
                        &format_args!("not a message envelope: {parse}"),
                    );
                    continue;
                }
                match error {
                    // serde_json's message already ends with the position: don't repeat it.
                    DispatchError::Decode {
                        message_name,
                        source,
                        ..
                    } => reject(
                        &mut counts,
                        number,
                        &format_args!("payload is not a valid `{message_name}`: {source}"),
                    ),
                    error => reject(&mut counts, number, &error),
                }
                continue;
            }
        };
        for outcome in outcomes {
            match outcome.result {
                Ok(Outcome::Processed(())) => counts.processed += 1,
                Ok(Outcome::Duplicate) => counts.duplicates += 1,
                Err(Error::Conflict(conflict)) => {
                    counts.conflicts += 1;
                    crate::observe::note(format_args!(
                        "line {number}: conflict: `{}` was applied with another payload \
                         (fingerprint {:.12}…, now {:.12}…): not applied",
                        conflict.key,
                        conflict.stored.to_hex(),
                        conflict.received.to_hex(),
                    ));
                }
                Err(Error::Handler(failure)) if failure.disposition.is_settled() => {
                    counts.dead += 1;
                    crate::observe::note(format_args!(
                        "line {number}: dead: consumer `{}`: {failure}",
                        outcome.consumer
                    ));
                }
                Ok(Outcome::Dead) => {
                    counts.dead += 1;
                    crate::observe::note(format_args!(
                        "line {number}: already dead-lettered for consumer `{}`: not applied",
                        outcome.consumer
                    ));
                }
                Ok(Outcome::Discarded) => {
                    counts.discarded += 1;
                    crate::observe::note(format_args!(
                        "line {number}: discarded by an operator for consumer `{}`: not applied",
                        outcome.consumer
                    ));
                }
                Err(Error::Key(error)) => reject(&mut counts, number, &error),
                Err(error) => {
                    return Err(FeedError::Failed {
                        line: number,
                        consumer: outcome.consumer,
                        error: error.to_string(),
                    });
                }
                // A newer outcome this demo does not know.
                #[allow(unreachable_patterns)]
                Ok(other) => {
                    return Err(FeedError::Failed {
                        line: number,
                        consumer: outcome.consumer,
                        error: format!("unexpected outcome `{}`", other.kind()),
                    });
                }
            }
        }
    }
    Ok(counts)
}
