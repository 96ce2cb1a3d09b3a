//! Feeding a JSON-lines stream through the dispatcher, one line after the other.

use inbox_runtime::{
    ConsumerOutcome, DispatchError, Dispatcher, Envelope, Error, Outcome, SourceMetadata,
    store::{ClaimStore as _, InboxDatabase, Rejection, RejectionReason},
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
    /// Not applied because a handler or the database failed (a retryable error: recorded
    /// `failed` in the inbox with its payload), or its rejection could not be kept: reported on
    /// stderr, and the stream goes on with the next line.
    pub(crate) failed: u64,
}

/// One line of the stream: `{"message": NAME, "payload": {…}}`. The payload is kept as raw
/// bytes: decoding it into the message type is the dispatcher's job.
#[derive(Deserialize)]
pub(crate) struct Line<'a> {
    pub(crate) message: String,
    #[serde(borrow)]
    pub(crate) payload: &'a RawValue,
}

/// Why feeding stopped before the end of the stream: the input could not be read.
#[derive(Debug)]
pub(crate) struct ReadError {
    line: u64,
    error: std::io::Error,
}

impl std::fmt::Display for ReadError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "cannot read line {}: {}", self.line, self.error)
    }
}

fn trim_newline(mut line: &[u8]) -> &[u8] {
    while let [rest @ .., b'\n' | b'\r'] = line {
        line = rest;
    }
    line
}

/// A line that is not a message: counted, reported on stderr.
pub(crate) fn reject(counts: &mut Counts, line: u64, reason: &dyn std::fmt::Display) {
    counts.rejected += 1;
    crate::observe::rejected();
    crate::observe::note(format_args!("line {line}: rejected: {reason}"));
}

/// A line that was not applied because something failed: counted, reported, and the stream
/// goes on (the line's event is `failed` in the inbox, for a later run or a replay).
pub(crate) fn fail(counts: &mut Counts, line: u64, consumer: &str, error: &dyn std::fmt::Display) {
    counts.failed += 1;
    crate::observe::note(format_args!(
        "line {line}: failed: consumer `{consumer}`: {error}"
    ));
}

/// Keeps a line that is not a message envelope in `inbox_rejections` as `malformed`, bytes as
/// read, with the parse error as its reason.
async fn keep_non_envelope<DB: InboxDatabase>(
    dispatcher: &Dispatcher<DB>,
    line: &[u8],
    detail: &str,
    metadata: &SourceMetadata,
) -> Result<(), sqlx::Error> {
    let mut conn = dispatcher.pool().acquire().await?;
    let rejection = Rejection {
        consumer: None,
        message_key: None,
        message_name: "",
        reason: RejectionReason::Malformed,
        detail,
        payload_hash: None,
        payload: line,
        payload_size: None,
        source: Some(metadata),
    };
    conn.record_rejection(&rejection).await
}

/// The non-blank lines of a JSON-lines stream, numbered from 1 (blank lines count in the
/// numbering), without their line ends.
pub(crate) struct Lines<R> {
    input: R,
    buf: Vec<u8>,
    number: u64,
}

impl<R: AsyncBufRead + Unpin> Lines<R> {
    pub(crate) fn new(input: R) -> Self {
        Self {
            input,
            buf: Vec::with_capacity(256),
            number: 0,
        }
    }

    /// The next non-blank line and its number; `None` at the end of the stream.
    pub(crate) async fn next(&mut self) -> Result<Option<(u64, &[u8])>, ReadError> {
        loop {
            self.buf.clear();
            let read = self.input.read_until(b'\n', &mut self.buf).await;
            self.number += 1;
            match read {
                Ok(0) => return Ok(None),
                Ok(_) => {}
                Err(error) => {
                    return Err(ReadError {
                        line: self.number,
                        error,
                    });
                }
            }
            if !trim_newline(&self.buf).iter().all(u8::is_ascii_whitespace) {
                return Ok(Some((self.number, trim_newline(&self.buf))));
            }
        }
    }
}

/// Dispatches every line of `input` in order, counting the outcomes. Rejections, conflicts and
/// failures are reported on stderr with their line numbers; a failed line does not stop the
/// stream. Blank lines are skipped. `source` names the input in the inbox rows (with the line
/// number as offset).
pub(crate) async fn feed<DB: InboxDatabase>(
    dispatcher: &Dispatcher<DB>,
    input: impl AsyncBufRead + Unpin,
    source: &str,
) -> Result<Counts, ReadError> {
    let mut counts = Counts::default();
    let mut lines = Lines::new(input);
    while let Some((number, line)) = lines.next().await? {
        counts.lines += 1;
        feed_line(dispatcher, line, number, source, &mut counts).await;
    }
    Ok(counts)
}

/// Dispatches the non-blank line `number` of the stream `source`, counting its outcomes (or its
/// rejection, or its failure) in `counts`.
async fn feed_line<DB: InboxDatabase>(
    dispatcher: &Dispatcher<DB>,
    line: &[u8],
    number: u64,
    source: &str,
    counts: &mut Counts,
) {
    let metadata = SourceMetadata::new(source).offset(i64::try_from(number).unwrap_or(i64::MAX));
    let envelope = match serde_json::from_slice::<Line<'_>>(line) {
        Ok(Line { message, payload }) => Envelope::new(message, payload.get()),
        Err(parse) => {
            // Not an envelope: kept, bytes as read, with the parse error as its reason.
            let detail = format!("not a message envelope: {parse}");
            match keep_non_envelope(dispatcher, line, &detail, &metadata).await {
                Ok(()) => reject(counts, number, &detail),
                Err(db) => fail(
                    counts,
                    number,
                    "-",
                    &format_args!("cannot keep the rejected line: {db}"),
                ),
            }
            return;
        }
    };
    let envelope = envelope.with_source(metadata);
    let outcomes = match dispatcher.dispatch(&envelope).await {
        Ok(outcomes) => outcomes,
        Err(error) => {
            // Kept in `inbox_rejections` with its payload (see `ledger admin stats`).
            if let Err(db) = dispatcher.record_rejection(&envelope, &error).await {
                fail(
                    counts,
                    number,
                    "-",
                    &format_args!("cannot keep the rejected line ({error}): {db}"),
                );
                return;
            }
            match error {
                // serde_json's message already ends with the position: don't repeat it.
                DispatchError::Decode {
                    message_name,
                    source,
                    ..
                } => reject(
                    counts,
                    number,
                    &format_args!("payload is not a valid `{message_name}`: {source}"),
                ),
                error => reject(counts, number, &error),
            }
            return;
        }
    };
    for outcome in outcomes {
        count_outcome(counts, number, outcome);
    }
}

/// Counts one consumer's outcome for line `number`, reporting the ones that were not applied.
fn count_outcome(counts: &mut Counts, number: u64, outcome: ConsumerOutcome) {
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
        Err(Error::Key(error)) => reject(counts, number, &error),
        // A handler that failed (recorded `failed`), the database: this line is not
        // applied; the next ones may well be.
        Err(error) => fail(counts, number, outcome.consumer, &error),
        // A newer outcome this demo does not know.
        #[allow(unreachable_patterns)]
        Ok(other) => fail(
            counts,
            number,
            outcome.consumer,
            &format_args!("unexpected outcome `{}`", other.kind()),
        ),
    }
}
