//! A counting proxy for the PostgreSQL wire protocol: forwards bytes unchanged between a client
//! and the server, and reads the client's side to count round trips and record statements.
//!
//! A **round trip** is a point where the client must wait for the server before it can go on:
//! one `Sync` (the end of an extended-protocol exchange: Parse/Bind/Describe/Execute…) or one
//! simple `Query`. sqlx sends `BEGIN`/`COMMIT`/`ROLLBACK` as simple queries, every statement with
//! arguments as Bind/Execute/Sync (after a first Parse/Describe/Sync, cached per connection),
//! and its pool's liveness `ping` as a lone `Sync`. pgbench's `-M prepared` commands are
//! Bind/Execute/Sync each; a `\startpipeline … \endpipeline` block ends with one `Sync`.
//!
//! Only counting runs go through the proxy; timed runs talk to the server directly.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex, MutexGuard};

use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
use tokio::net::{TcpListener, TcpStream};

/// One parameter value of a Bind message, as sent (`None`: SQL NULL).
pub(crate) type Param = Option<Vec<u8>>;

/// One statement the client ran.
#[derive(Debug, Clone)]
pub(crate) enum Entry {
    /// A simple query (no parameters).
    Query(String),
    /// An extended-protocol execution: the prepared statement's text, its parameter type OIDs
    /// and the bound values.
    Execute {
        sql: String,
        param_types: Vec<u32>,
        params: Vec<Param>,
    },
    /// The end of an extended-protocol exchange.
    Sync,
}

/// Message counts of the client→server stream.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct Counts {
    pub(crate) queries: u64,
    pub(crate) syncs: u64,
    pub(crate) parses: u64,
    pub(crate) executes: u64,
}

impl Counts {
    /// Round trips: every `Sync` and every simple `Query`.
    pub(crate) fn round_trips(&self) -> u64 {
        self.queries + self.syncs
    }

    /// Statements: simple queries and executions.
    pub(crate) fn statements(&self) -> u64 {
        self.queries + self.executes
    }

    pub(crate) fn since(&self, before: &Counts) -> Counts {
        Counts {
            queries: self.queries - before.queries,
            syncs: self.syncs - before.syncs,
            parses: self.parses - before.parses,
            executes: self.executes - before.executes,
        }
    }
}

#[derive(Debug, Default)]
struct State {
    counts: Counts,
    recording: bool,
    log: Vec<Entry>,
}

/// A running proxy. Dropping it stops accepting; open connections keep going until closed.
pub(crate) struct Proxy {
    addr: SocketAddr,
    state: Arc<Mutex<State>>,
    accept: tokio::task::JoinHandle<()>,
}

impl Drop for Proxy {
    fn drop(&mut self) {
        self.accept.abort();
    }
}

const LOG_LIMIT: usize = 200_000;

impl Proxy {
    /// Listens on an ephemeral loopback port and forwards every connection to `upstream`.
    pub(crate) async fn start(upstream: SocketAddr) -> std::io::Result<Proxy> {
        let listener = TcpListener::bind("127.0.0.1:0").await?;
        let addr = listener.local_addr()?;
        let state = Arc::new(Mutex::new(State::default()));
        let shared = state.clone();
        let accept = tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                let state = shared.clone();
                tokio::spawn(async move {
                    if let Ok(server) = TcpStream::connect(upstream).await {
                        let _ = client.set_nodelay(true);
                        let _ = server.set_nodelay(true);
                        forward(client, server, state).await;
                    }
                });
            }
        });
        Ok(Proxy {
            addr,
            state,
            accept,
        })
    }

    /// The address clients connect to.
    pub(crate) fn addr(&self) -> SocketAddr {
        self.addr
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The counts so far (over all connections).
    pub(crate) fn counts(&self) -> Counts {
        self.lock().counts
    }

    /// Starts recording statements (clearing what was recorded before).
    pub(crate) fn record(&self) {
        let mut state = self.lock();
        state.log.clear();
        state.recording = true;
    }

    /// Stops recording and returns what was recorded.
    pub(crate) fn take_log(&self) -> Vec<Entry> {
        let mut state = self.lock();
        state.recording = false;
        std::mem::take(&mut state.log)
    }
}

async fn forward(client: TcpStream, server: TcpStream, state: Arc<Mutex<State>>) {
    let (mut client_read, mut client_write) = client.into_split();
    let (mut server_read, mut server_write) = server.into_split();
    let downstream = tokio::spawn(async move {
        let _ = tokio::io::copy(&mut server_read, &mut client_write).await;
        let _ = client_write.shutdown().await;
    });
    let mut parser = Parser::default();
    let mut buf = vec![0_u8; 64 * 1024];
    loop {
        let n = match client_read.read(&mut buf).await {
            Ok(0) | Err(_) => break,
            Ok(n) => n,
        };
        parser.feed(&buf[..n], &state);
        if server_write.write_all(&buf[..n]).await.is_err() {
            break;
        }
    }
    let _ = server_write.shutdown().await;
    let _ = downstream.await;
}

/// Reads the frontend protocol incrementally.
#[derive(Default)]
struct Parser {
    pending: Vec<u8>,
    started: bool,
    /// Prepared statement name → (text, parameter types).
    statements: HashMap<String, (String, Vec<u32>)>,
}

const PROTOCOL_3_0: u32 = 196_608;

impl Parser {
    fn feed(&mut self, bytes: &[u8], state: &Mutex<State>) {
        self.pending.extend_from_slice(bytes);
        let mut at = 0;
        loop {
            let rest = &self.pending[at..];
            if !self.started {
                // Untyped startup-phase messages: SSLRequest, GSSENCRequest, StartupMessage.
                if rest.len() < 8 {
                    break;
                }
                let len = be32(&rest[0..4]) as usize;
                if rest.len() < len {
                    break;
                }
                if be32(&rest[4..8]) == PROTOCOL_3_0 {
                    self.started = true;
                }
                at += len.max(8);
                continue;
            }
            if rest.len() < 5 {
                break;
            }
            let len = be32(&rest[1..5]) as usize;
            if rest.len() < 1 + len {
                break;
            }
            let kind = rest[0];
            let body = rest[5..1 + len].to_vec();
            at += 1 + len;
            self.message(kind, &body, state);
        }
        self.pending.drain(..at);
    }

    fn message(&mut self, kind: u8, body: &[u8], state: &Mutex<State>) {
        let mut state = state.lock().unwrap_or_else(|e| e.into_inner());
        let recording = state.recording && state.log.len() < LOG_LIMIT;
        match kind {
            b'Q' => {
                state.counts.queries += 1;
                if recording {
                    let mut r = Reader(body);
                    let sql = r.cstr();
                    state.log.push(Entry::Query(sql));
                }
            }
            b'S' => {
                state.counts.syncs += 1;
                if recording {
                    state.log.push(Entry::Sync);
                }
            }
            b'P' => {
                state.counts.parses += 1;
                let mut r = Reader(body);
                let name = r.cstr();
                let sql = r.cstr();
                let n = r.u16();
                let types = (0..n).map(|_| r.u32()).collect();
                self.statements.insert(name, (sql, types));
            }
            b'B' if recording => {
                let mut r = Reader(body);
                let _portal = r.cstr();
                let name = r.cstr();
                let formats = r.u16();
                for _ in 0..formats {
                    r.u16();
                }
                let n = r.u16();
                let params = (0..n)
                    .map(|_| {
                        let len = r.u32() as i32;
                        (len >= 0).then(|| r.take(len as usize).to_vec())
                    })
                    .collect();
                let (sql, param_types) = self.statements.get(&name).cloned().unwrap_or_default();
                state.log.push(Entry::Execute {
                    sql,
                    param_types,
                    params,
                });
            }
            b'E' => state.counts.executes += 1,
            _ => {}
        }
    }
}

fn be32(b: &[u8]) -> u32 {
    u32::from_be_bytes([b[0], b[1], b[2], b[3]])
}

/// A cursor over a message body; reads past the end yield zeros and empty strings.
struct Reader<'a>(&'a [u8]);

impl Reader<'_> {
    fn take(&mut self, n: usize) -> &[u8] {
        let n = n.min(self.0.len());
        let (head, tail) = self.0.split_at(n);
        self.0 = tail;
        head
    }
    fn cstr(&mut self) -> String {
        let end = self.0.iter().position(|&b| b == 0).unwrap_or(self.0.len());
        let text = String::from_utf8_lossy(&self.0[..end]).into_owned();
        self.0 = &self.0[(end + 1).min(self.0.len())..];
        text
    }
    fn u16(&mut self) -> u16 {
        let b = self.take(2);
        if b.len() < 2 {
            0
        } else {
            u16::from_be_bytes([b[0], b[1]])
        }
    }
    fn u32(&mut self) -> u32 {
        let b = self.take(4);
        if b.len() < 4 { 0 } else { be32(b) }
    }
}

/// A one-line description of a recorded sequence, one `[…]` per round trip:
/// `[BEGIN] [WITH claim AS …] [INSERT INTO bench_accounts …] [COMMIT]`; `[sync]` is a lone
/// `Sync` (sqlx's pool ping).
pub(crate) fn describe(entries: &[Entry]) -> String {
    let mut trips = Vec::new();
    let mut group: Vec<String> = Vec::new();
    for entry in entries {
        match entry {
            Entry::Query(sql) => trips.push(format!("[{}]", short(sql))),
            Entry::Execute { sql, .. } => group.push(short(sql)),
            Entry::Sync => {
                if group.is_empty() {
                    trips.push("[sync]".to_owned());
                } else {
                    trips.push(format!("[{}]", group.join("; ")));
                    group.clear();
                }
            }
        }
    }
    trips.join(" ")
}

fn short(sql: &str) -> String {
    let words: Vec<&str> = sql.split_whitespace().take(4).collect();
    let mut text = words.join(" ");
    if sql.split_whitespace().count() > 4 {
        text.push('…');
    }
    text
}
