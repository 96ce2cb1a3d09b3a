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
//! unknown message (and logs it); it counts as settled like any other. A line that is not
//! Unicode text (bytes that are not UTF-8, an escape that decodes to an unpaired surrogate, in
//! its payload, headers or anywhere) is delivered whole under its `message`, if that can be
//! read, so that the dispatcher refuses it by the one Unicode rule (`NotUtf8`,
//! `UnpairedSurrogate`) with the position in the line.
//!
//! **Size.** A line is read no further than the [payload limit](Source::set_payload_limit)
//! (the dispatcher's under a [`Worker`](crate::Worker); 1 MiB otherwise) plus 64 KiB of room for
//! the rest of its envelope (the message name, the headers): a longer line is not read whole.
//! Its first `limit` bytes are kept, the rest is skipped to the next newline (or the end of the
//! file) without being held, and it is delivered [cut](Envelope::cut), with the line's size and
//! the `message` member if it comes before the cut, so that the worker keeps that cut copy in
//! `inbox_rejections` as `too_large` with its real size. A line within that size whose payload is
//! over the limit is refused by the dispatcher as before. The reader runs ahead of the worker by
//! at most 256 lines and about twice that size in bytes, so that memory stays a small multiple of
//! the limit whatever the file holds.
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
use std::io::{self, Seek as _, SeekFrom, Write as _};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering as AtomicOrdering};
use std::sync::{Arc, Mutex, MutexGuard};

use serde::de::{DeserializeSeed, IgnoredAny, MapAccess, Visitor};
use serde::{Deserialize, Serialize};
use serde_json::value::RawValue;
use tokio::sync::{Notify, OwnedSemaphorePermit, Semaphore, mpsc, watch};

use crate::BoxFuture;
use crate::source::{
    Delivery, Settle, SettleFuture, Settlement, Source, SourceError, requeue_after,
};
use crate::types::envelope::{Envelope, SourceMetadata};
use crate::types::limit::PayloadLimit;

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
    /// The line, or its first `limit` bytes if it was cut.
    bytes: Vec<u8>,
    /// Set if the line was too long to read whole.
    cut: Option<Cut>,
    deliveries: u64,
}

/// What is known of a line too long to read whole.
#[derive(Debug, Clone)]
struct Cut {
    /// Its `message` member, if it came before the cut.
    message_name: Option<String>,
    /// Its length, in bytes (its newline excluded).
    size: usize,
}

/// Room a line has beyond the payload limit for the rest of its envelope: the message name,
/// the headers and the JSON around them (64 KiB).
const LINE_ALLOWANCE: usize = 64 * 1024;

/// One line as read: at most `budget + 1` bytes of it kept.
struct ReadLine {
    bytes: Vec<u8>,
    /// Bytes of the file it spans, its newline included.
    consumed: u64,
    /// Whether it ended with a newline (not with the end of the file).
    ended: bool,
    /// Whether it is whitespace only (all of it, also past what was kept).
    blank: bool,
}

/// Reads the next line, keeping at most `budget + 1` bytes of it and skipping the rest to its
/// newline without holding it; `None` at the end of the file.
fn read_line(reader: &mut impl io::BufRead, budget: usize) -> io::Result<Option<ReadLine>> {
    let cap = budget.saturating_add(1);
    let mut read = ReadLine {
        bytes: Vec::new(),
        consumed: 0,
        ended: false,
        blank: true,
    };
    loop {
        let chunk = match reader.fill_buf() {
            Ok(chunk) => chunk,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(e),
        };
        if chunk.is_empty() {
            break;
        }
        let (take, ended) = match chunk.iter().position(|&b| b == b'\n') {
            Some(newline) => (newline + 1, true),
            None => (chunk.len(), false),
        };
        let part = &chunk[..take];
        read.blank &= part.iter().all(u8::is_ascii_whitespace);
        let keep = &part[..take.min(cap - read.bytes.len())];
        if read.bytes.capacity() - read.bytes.len() < keep.len() {
            // Grow by doubling, but never past the cap: no more than the cap is ever held.
            let want = (read.bytes.capacity() * 2)
                .max(read.bytes.len() + keep.len())
                .max(256)
                .min(cap);
            read.bytes.reserve_exact(want - read.bytes.len());
        }
        read.bytes.extend_from_slice(keep);
        read.consumed += take as u64;
        reader.consume(take);
        if ended {
            read.ended = true;
            break;
        }
    }
    Ok((read.consumed > 0).then_some(read))
}

impl Line {
    /// Line `number`, ending at byte `end`; cut to the first `limit` bytes if it is longer than
    /// `budget` bytes.
    fn new(number: u64, end: u64, read: ReadLine, limit: usize, budget: usize) -> Self {
        let length = read.consumed - u64::from(read.ended);
        let mut bytes = read.bytes;
        let cut = (length > budget as u64).then(|| {
            let message_name = message_name_of(&bytes);
            bytes.truncate(limit);
            bytes.shrink_to_fit();
            Cut {
                message_name,
                size: usize::try_from(length).unwrap_or(usize::MAX),
            }
        });
        Self {
            number,
            end,
            bytes,
            cut,
            deliveries: 0,
        }
    }
}

/// The `message` member of a line cut short, if it is a string that comes before the cut.
fn message_name_of(prefix: &[u8]) -> Option<String> {
    /// Reads the members of the line's object in order until `message`.
    struct Name<'a>(&'a mut Option<String>);

    impl<'de> DeserializeSeed<'de> for Name<'_> {
        type Value = ();

        fn deserialize<D: serde::Deserializer<'de>>(self, d: D) -> Result<(), D::Error> {
            d.deserialize_map(self)
        }
    }

    impl<'de> Visitor<'de> for Name<'_> {
        type Value = ();

        fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.write_str("a message envelope")
        }

        fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<(), A::Error> {
            while let Some(member) = map.next_key::<String>()? {
                if member == "message" {
                    *self.0 = Some(map.next_value()?);
                    return Ok(());
                }
                map.next_value::<IgnoredAny>()?;
            }
            Ok(())
        }
    }

    let mut name = None;
    // The cut makes the line end early: the error that follows the name is expected.
    let _ = Name(&mut name).deserialize(&mut serde_json::Deserializer::from_slice(prefix));
    name
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
    lines: mpsc::Receiver<io::Result<(Line, OwnedSemaphorePermit)>>,
    redeliveries: mpsc::UnboundedReceiver<Line>,
    /// The reader, until the first [`Source::next`] starts it (with the limit set by then).
    reader: Option<Reader>,
    reader_done: bool,
    start: FilePosition,
    /// The payload limit, in bytes, shared with the reader.
    limit: Arc<AtomicUsize>,
}

/// The blocking thread that reads lines ahead of the worker: at most 256 lines, and about two
/// of the longest lines it reads whole in bytes.
#[derive(Debug)]
struct Reader {
    file: fs::File,
    start: FilePosition,
    shared: Arc<Shared>,
    tx: mpsc::Sender<io::Result<(Line, OwnedSemaphorePermit)>>,
    limit: Arc<AtomicUsize>,
}

impl Reader {
    fn start(self) {
        let runtime = tokio::runtime::Handle::current();
        tokio::task::spawn_blocking(move || self.run(&runtime));
    }

    fn run(self, runtime: &tokio::runtime::Handle) {
        let limit = self.limit.load(AtomicOrdering::Relaxed);
        let bytes_ahead = 2 * (limit + LINE_ALLOWANCE + 1);
        let ahead = Arc::new(Semaphore::new(bytes_ahead));
        let mut reader = io::BufReader::with_capacity(1 << 16, self.file);
        let mut number = self.start.line;
        let mut at = self.start.byte;
        loop {
            let limit = self.limit.load(AtomicOrdering::Relaxed);
            let budget = limit + LINE_ALLOWANCE;
            let read = match read_line(&mut reader, budget) {
                Ok(Some(read)) => read,
                Ok(None) => break,
                Err(e) => {
                    let _ = self.tx.blocking_send(Err(e));
                    break;
                }
            };
            number += 1;
            at += read.consumed;
            if read.blank {
                self.shared.complete(number, at, false);
                continue;
            }
            let line = Line::new(number, at, read, limit, budget);
            // Room for the line's bytes among those read ahead (given back when handed out).
            let size = u32::try_from(line.bytes.len().clamp(1, bytes_ahead)).unwrap_or(u32::MAX);
            let Ok(permit) = runtime.block_on(Arc::clone(&ahead).acquire_many_owned(size)) else {
                break;
            };
            if self.tx.blocking_send(Ok((line, permit))).is_err() {
                break; // the source is gone
            }
        }
    }
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
        crate::store::spawn(async move {
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

        // The reader: a blocking thread, 256 lines ahead at most, started by the first `next`.
        let (tx, lines) = mpsc::channel(256);
        let limit = Arc::new(AtomicUsize::new(PayloadLimit::DEFAULT.bytes()));
        let reader = Reader {
            file,
            start,
            shared: Arc::clone(&shared),
            tx,
            limit: Arc::clone(&limit),
        };

        Ok(Self {
            shared,
            offset,
            lines,
            redeliveries,
            reader: Some(reader),
            reader_done: false,
            start,
            limit,
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
        let envelope = match &line.cut {
            Some(cut) => {
                tracing::warn!(
                    file = self.shared.name,
                    line = line.number,
                    size = cut.size,
                    "line too long to read whole; delivered cut to the payload limit"
                );
                let name = cut.message_name.clone().unwrap_or_default();
                Envelope::cut(name, line.bytes.clone(), cut.size)
            }
            None => parse(&line.bytes, &self.shared.name, line.number),
        }
        .with_source(metadata);
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
        // Text that is not Unicode (bytes that are not UTF-8, an unpaired surrogate escape)
        // anywhere in the line fails its decoding: the line goes whole under its name, if that
        // can be read, for the dispatcher to refuse by the one Unicode rule, with the position
        // in the line (a surrogate in the payload alone decodes, and is refused in the payload).
        Err(error) if crate::types::json_text::json_text(trimmed).is_err() => {
            tracing::warn!(
                file,
                line = number,
                %error,
                "the line is not Unicode text; delivered whole so that it is rejected"
            );
            Envelope::new(message_name_of(trimmed).unwrap_or_default(), trimmed)
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
    fn settle(mut self: Box<Self>, settlement: Settlement) -> SettleFuture {
        let line = self.line.take().expect("settled once");
        let shared = Arc::clone(&self.shared);
        Box::pin(async move {
            match settlement {
                Settlement::Ack | Settlement::Reject => {
                    shared.complete(line.number, line.end, true);
                }
                Settlement::Requeue { delay } => {
                    requeue_after(delay, move || shared.redeliver(line));
                }
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

    /// Lines are read no further than `limit` plus 64 KiB (see the module documentation's
    /// "Size"). Takes effect for the lines read after it; set it before the first
    /// [`next`](Source::next) (the [`Worker`](crate::Worker) does) for all of them.
    fn set_payload_limit(&mut self, limit: PayloadLimit) {
        self.limit.store(limit.bytes(), AtomicOrdering::Relaxed);
    }

    fn next(&mut self) -> BoxFuture<'_, Result<Option<Delivery>, SourceError>> {
        Box::pin(async move {
            if let Some(reader) = self.reader.take() {
                reader.start();
            }
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
                        Some(Ok((line, _room))) => {
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
