//! A JSON-lines file as a source, resuming where its acked prefix ends.
//!
//! Each non-blank line is one delivery:
//!
//! ```text
//! {"message":"payments.captured","payload":{"event_id":"…","account_id":"acct-0042","amount_cents":1234}}
//! {"message":"payments.refunded","payload":{…},"headers":{"trace-id":"…"}}
//! ```
//!
//! `message` is the routing name, `payload` the message's JSON (passed on byte for byte),
//! `headers` (optional) an object of strings. A line that is not such an object is delivered
//! with the empty message name and the line as its payload, so that the worker rejects it as an
//! unknown message (and logs it); it counts as settled like any other.
//!
//! **Position.** The source keeps the *contiguous settled prefix* of the file: the first `line`
//! lines (ending at byte `byte`) have all been acked or rejected (blank lines count as settled).
//! It persists it in an *offset file* (`<file>.offset` unless told otherwise) as
//! `{"line":N,"byte":B}`, replaced atomically (write a temporary file, fsync, rename, fsync the
//! directory) each time the prefix advances, coalescing updates while a write is under way.
//! [`FileSource::open`] resumes right after it. Lines settled beyond a gap (a line still in
//! flight) are delivered again after a restart; the inbox makes those redeliveries duplicates.
//! A crash can lose the last few advances (they are written asynchronously), never record one
//! that did not happen.

use std::collections::BTreeMap;
use std::fs;
use std::io::{self, BufRead as _, Seek as _, SeekFrom, Write as _};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use serde::{Deserialize, Serialize};
use serde_json::value::RawValue;
use tokio::sync::{Notify, mpsc, watch};

use crate::BoxFuture;
use crate::envelope::{Envelope, SourceMetadata};
use crate::source::{Delivery, Settle, Settlement, Source, SourceError};

/// How far a [`FileSource`] has settled its file: every one of the first `line` lines (1-based
/// numbering; `line = 0` is the start) is settled, and they end at byte offset `byte`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
pub struct FilePosition {
    /// Number of lines settled from the start of the file, blank lines included.
    pub line: u64,
    /// Byte offset just past the last of those lines (its newline included).
    pub byte: u64,
}

/// Reads the position recorded in an offset file; `Ok(None)` if there is no such file.
///
/// # Errors
/// An [`io::Error`] if the file cannot be read or does not hold a position.
pub fn read_offset_file(path: &Path) -> io::Result<Option<FilePosition>> {
    match fs::read(path) {
        Ok(bytes) => serde_json::from_slice(&bytes)
            .map(Some)
            .map_err(|e| io::Error::new(io::ErrorKind::InvalidData, e)),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(e),
    }
}

/// Writes `position` to `path` atomically and durably: temporary file, fsync, rename, fsync of
/// the directory.
fn write_offset_file(path: &Path, position: FilePosition) -> io::Result<()> {
    let mut tmp = path.as_os_str().to_owned();
    tmp.push(".tmp");
    let tmp = PathBuf::from(tmp);
    let mut file = fs::File::create(&tmp)?;
    let mut text = serde_json::to_vec(&position).map_err(io::Error::other)?;
    text.push(b'\n');
    file.write_all(&text)?;
    file.sync_all()?;
    drop(file);
    fs::rename(&tmp, path)?;
    let dir = match path.parent() {
        Some(dir) if !dir.as_os_str().is_empty() => dir,
        _ => Path::new("."),
    };
    fs::File::open(dir)?.sync_all()
}

/// The offset file, and the last position written to it (never written backwards).
#[derive(Debug)]
struct OffsetFile {
    path: PathBuf,
    written: Mutex<FilePosition>,
    error: Mutex<Option<String>>,
}

impl OffsetFile {
    fn write(&self, position: FilePosition) -> io::Result<()> {
        let mut written = self.written.lock().unwrap_or_else(|p| p.into_inner());
        if position <= *written {
            return Ok(());
        }
        write_offset_file(&self.path, position)?;
        *written = position;
        Ok(())
    }
}

/// One line of the file.
#[derive(Debug, Clone)]
struct Line {
    number: u64,
    end: u64,
    bytes: Vec<u8>,
    deliveries: u64,
}

#[derive(Debug, Default)]
struct Progress {
    prefix: FilePosition,
    /// Settled lines beyond the prefix: line number → end byte.
    done: BTreeMap<u64, u64>,
    /// Lines handed out and not finally settled (requeued ones included).
    outstanding: usize,
}

#[derive(Debug)]
struct Shared {
    name: String,
    progress: Mutex<Progress>,
    changed: Notify,
    position: watch::Sender<FilePosition>,
    redeliver: mpsc::UnboundedSender<Line>,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, Progress> {
        self.progress.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Marks a line settled for good, advancing the prefix over every settled line after it.
    fn complete(&self, number: u64, end: u64, outstanding: bool) {
        let mut progress = self.lock();
        if outstanding {
            progress.outstanding -= 1;
        }
        progress.done.insert(number, end);
        let before = progress.prefix;
        loop {
            let next = progress.prefix.line + 1;
            let Some(end) = progress.done.remove(&next) else {
                break;
            };
            progress.prefix.line += 1;
            progress.prefix.byte = end;
        }
        let prefix = progress.prefix;
        drop(progress);
        if prefix != before {
            self.position.send_replace(prefix);
        }
        self.changed.notify_waiters();
    }

    fn redeliver(&self, line: Line) {
        // The receiver lives as long as the source; if the source is gone, so is the need.
        let _ = self.redeliver.send(line);
        self.changed.notify_waiters();
    }
}

/// A JSON-lines file as a [`Source`]. See the [module documentation](self) for the format and
/// the offset file.
///
/// Lines are read by a blocking thread ahead of the worker (at most 256 lines ahead). Requeued
/// and abandoned lines are delivered again in the same run (after the requeue delay);
/// [`Source::next`] returns `Ok(None)` once the file is read to its end and every line is
/// settled. [`Source::close`] writes the final position and reports any failed write.
#[derive(Debug)]
pub struct FileSource {
    shared: Arc<Shared>,
    offset: Arc<OffsetFile>,
    lines: mpsc::Receiver<io::Result<Line>>,
    redeliveries: mpsc::UnboundedReceiver<Line>,
    reader_done: bool,
    start: FilePosition,
}

impl FileSource {
    /// Opens `path`, resuming after the position in `<path>.offset` if that file exists.
    ///
    /// # Errors
    /// A [`SourceError`] (operation `"open"`) if the file or the offset file cannot be read, or
    /// the offset lies beyond the end of the file (the file was replaced or truncated).
    pub async fn open(path: impl AsRef<Path>) -> Result<Self, SourceError> {
        let path = path.as_ref();
        let mut offset = path.as_os_str().to_owned();
        offset.push(".offset");
        Self::open_with_offset_file(path, PathBuf::from(offset)).await
    }

    /// Opens `path`, keeping its position in `offset_path`.
    ///
    /// # Errors
    /// As [`FileSource::open`].
    pub async fn open_with_offset_file(
        path: impl AsRef<Path>,
        offset_path: impl Into<PathBuf>,
    ) -> Result<Self, SourceError> {
        let path = path.as_ref().to_owned();
        let offset_path = offset_path.into();
        let name = path.display().to_string();
        let open_error = |e: io::Error| SourceError::new(name.clone(), "open", e);

        let start = read_offset_file(&offset_path)
            .map_err(|e| {
                open_error(io::Error::new(
                    e.kind(),
                    format!("offset file {}: {e}", offset_path.display()),
                ))
            })?
            .unwrap_or_default();
        let mut file = fs::File::open(&path).map_err(open_error)?;
        let len = file.metadata().map_err(open_error)?.len();
        if start.byte > len {
            return Err(open_error(io::Error::new(
                io::ErrorKind::InvalidData,
                format!(
                    "offset file {} says byte {} (line {}), but the file has {len} bytes: \
                     was it replaced or truncated?",
                    offset_path.display(),
                    start.byte,
                    start.line
                ),
            )));
        }
        file.seek(SeekFrom::Start(start.byte)).map_err(open_error)?;

        let (position, mut position_rx) = watch::channel(start);
        let (redeliver, redeliveries) = mpsc::unbounded_channel();
        let shared = Arc::new(Shared {
            name: name.clone(),
            progress: Mutex::new(Progress {
                prefix: start,
                ..Progress::default()
            }),
            changed: Notify::new(),
            position,
            redeliver,
        });
        let offset = Arc::new(OffsetFile {
            path: offset_path,
            written: Mutex::new(start),
            error: Mutex::new(None),
        });

        // The persister: writes the latest prefix whenever it moved; ends with the source.
        let persister = Arc::clone(&offset);
        tokio::spawn(async move {
            while position_rx.changed().await.is_ok() {
                let position = *position_rx.borrow_and_update();
                let file = Arc::clone(&persister);
                let result = tokio::task::spawn_blocking(move || file.write(position)).await;
                let error = match result {
                    Ok(Ok(())) => continue,
                    Ok(Err(e)) => e.to_string(),
                    Err(e) => e.to_string(),
                };
                tracing::error!(offset_file = %persister.path.display(), %error, "cannot persist the file source's position");
                *persister.error.lock().unwrap_or_else(|p| p.into_inner()) = Some(error);
            }
        });

        // The reader: a blocking thread, 256 lines ahead at most.
        let (tx, lines) = mpsc::channel(256);
        let reader_shared = Arc::clone(&shared);
        tokio::task::spawn_blocking(move || {
            let mut reader = io::BufReader::with_capacity(1 << 16, file);
            let mut number = start.line;
            let mut at = start.byte;
            loop {
                let mut bytes = Vec::with_capacity(256);
                match reader.read_until(b'\n', &mut bytes) {
                    Ok(0) => break,
                    Ok(n) => {
                        number += 1;
                        at += n as u64;
                        if bytes.iter().all(u8::is_ascii_whitespace) {
                            reader_shared.complete(number, at, false);
                            continue;
                        }
                        let line = Line {
                            number,
                            end: at,
                            bytes,
                            deliveries: 0,
                        };
                        if tx.blocking_send(Ok(line)).is_err() {
                            break; // the source is gone
                        }
                    }
                    Err(e) => {
                        let _ = tx.blocking_send(Err(e));
                        break;
                    }
                }
            }
        });

        Ok(Self {
            shared,
            offset,
            lines,
            redeliveries,
            reader_done: false,
            start,
        })
    }

    /// Where this run started: the position read from the offset file (zero without one).
    pub fn start_position(&self) -> FilePosition {
        self.start
    }

    /// The contiguous settled prefix now (possibly not yet written to the offset file).
    pub fn position(&self) -> FilePosition {
        self.shared.lock().prefix
    }

    /// The offset file's path.
    pub fn offset_path(&self) -> &Path {
        &self.offset.path
    }

    fn delivery(&self, mut line: Line) -> Delivery {
        line.deliveries += 1;
        let metadata = SourceMetadata::new(&self.shared.name)
            .offset(i64::try_from(line.number).unwrap_or(i64::MAX))
            .redelivered(line.deliveries > 1)
            .delivery_count(line.deliveries);
        let envelope = parse(&line.bytes, &self.shared.name, line.number).with_source(metadata);
        Delivery::new(
            envelope,
            FileSettler {
                shared: Arc::clone(&self.shared),
                line: Some(line),
            },
        )
    }
}

/// One line of the file, as written.
#[derive(Deserialize)]
struct LineEnvelope<'a> {
    message: String,
    #[serde(borrow)]
    payload: &'a RawValue,
    #[serde(default)]
    headers: BTreeMap<String, String>,
}

fn parse(bytes: &[u8], file: &str, number: u64) -> Envelope {
    let trimmed = bytes.trim_ascii();
    match serde_json::from_slice::<LineEnvelope<'_>>(trimmed) {
        Ok(line) => {
            let mut envelope = Envelope::new(line.message, line.payload.get().as_bytes());
            envelope.headers = line.headers;
            envelope
        }
        Err(error) => {
            tracing::warn!(
                file,
                line = number,
                %error,
                "not a message envelope; delivered with no message name so that it is rejected"
            );
            Envelope::new("", trimmed)
        }
    }
}

struct FileSettler {
    shared: Arc<Shared>,
    line: Option<Line>,
}

impl Settle for FileSettler {
    fn settle(
        mut self: Box<Self>,
        settlement: Settlement,
    ) -> BoxFuture<'static, Result<(), SourceError>> {
        let line = self.line.take().expect("settled once");
        let shared = Arc::clone(&self.shared);
        Box::pin(async move {
            match settlement {
                Settlement::Ack | Settlement::Reject => {
                    shared.complete(line.number, line.end, true);
                }
                Settlement::Requeue { delay } => match delay {
                    Some(delay) if delay > Duration::ZERO => {
                        tokio::spawn(async move {
                            tokio::time::sleep(delay).await;
                            shared.redeliver(line);
                        });
                    }
                    _ => shared.redeliver(line),
                },
            }
            Ok(())
        })
    }

    fn abandon(mut self: Box<Self>) {
        if let Some(line) = self.line.take() {
            self.shared.redeliver(line);
        }
    }
}

impl Source for FileSource {
    fn name(&self) -> &str {
        &self.shared.name
    }

    fn next(&mut self) -> BoxFuture<'_, Result<Option<Delivery>, SourceError>> {
        Box::pin(async move {
            loop {
                let changed = self.shared.changed.notified();
                if let Ok(line) = self.redeliveries.try_recv() {
                    return Ok(Some(self.delivery(line)));
                }
                if self.reader_done {
                    if self.shared.lock().outstanding == 0 {
                        return Ok(None);
                    }
                    tokio::select! {
                        Some(line) = self.redeliveries.recv() => return Ok(Some(self.delivery(line))),
                        () = changed => continue,
                    }
                }
                tokio::select! {
                    biased;
                    Some(line) = self.redeliveries.recv() => return Ok(Some(self.delivery(line))),
                    read = self.lines.recv() => match read {
                        Some(Ok(line)) => {
                            self.shared.lock().outstanding += 1;
                            return Ok(Some(self.delivery(line)));
                        }
                        Some(Err(e)) => {
                            self.reader_done = true;
                            return Err(SourceError::new(self.shared.name.clone(), "receive", e));
                        }
                        None => self.reader_done = true,
                    },
                }
            }
        })
    }

    fn close(&mut self) -> BoxFuture<'_, Result<(), SourceError>> {
        Box::pin(async move {
            let position = self.position();
            let file = Arc::clone(&self.offset);
            let name = self.shared.name.clone();
            tokio::task::spawn_blocking(move || file.write(position))
                .await
                .map_err(|e| SourceError::new(name.clone(), "persist position", e))?
                .map_err(|e| SourceError::new(name.clone(), "persist position", e))?;
            if let Some(error) = self
                .offset
                .error
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .take()
            {
                return Err(SourceError::new(name, "persist position", error));
            }
            Ok(())
        })
    }
}
