//! The lost-commit proxy: a TCP relay on loopback between the kit's own pool and the database
//! server that forwards everything until the client sends `COMMIT`, forwards that `COMMIT`,
//! reads the server's whole answer to it (so the commit certainly ran), and then closes both
//! connections without passing the answer on. The client sees its connection end with the
//! `COMMIT` unanswered: the commit's answer is lost, the transaction committed.
//!
//! It reads the client's side of two wire protocols, no more than it needs to find a `COMMIT`:
//! PostgreSQL's (frontend messages: a simple `Query` whose statements include `COMMIT`, as sqlx
//! sends it) and MySQL's (packets: a `COM_QUERY` of `COMMIT` at the start of a command). It cuts
//! once: later connections and later `COMMIT`s pass through untouched. Plain TCP only: the kit
//! connects through it without TLS.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
use tokio::net::{TcpListener, TcpStream};
use tokio::task::JoinHandle;

/// Which wire protocol the proxy reads.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Wire {
    /// PostgreSQL's frontend/backend protocol 3.0.
    Postgres,
    /// MySQL's (and MariaDB's) client/server protocol.
    MySql,
}

/// A running proxy; stopped when dropped.
pub(crate) struct CutProxy {
    addr: SocketAddr,
    cut: Arc<AtomicBool>,
    task: JoinHandle<()>,
}

impl CutProxy {
    /// A proxy on an ephemeral loopback port to `target` (`host`, `port`), speaking `wire`.
    pub(crate) async fn start(target: (String, u16), wire: Wire) -> std::io::Result<Self> {
        let listener = TcpListener::bind(("127.0.0.1", 0)).await?;
        let addr = listener.local_addr()?;
        let armed = Arc::new(AtomicBool::new(true));
        let cut = Arc::new(AtomicBool::new(false));
        let (task_armed, task_cut) = (armed.clone(), cut.clone());
        let task = tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                let target = target.clone();
                let (armed, cut) = (task_armed.clone(), task_cut.clone());
                tokio::spawn(async move {
                    if let Ok(server) = TcpStream::connect((target.0.as_str(), target.1)).await {
                        let _ = relay(client, server, wire, &armed, &cut).await;
                    }
                });
            }
        });
        Ok(Self { addr, cut, task })
    }

    /// The port clients connect to (on 127.0.0.1).
    pub(crate) fn port(&self) -> u16 {
        self.addr.port()
    }

    /// Whether a `COMMIT` was forwarded and its answer withheld.
    pub(crate) fn has_cut(&self) -> bool {
        self.cut.load(Ordering::SeqCst)
    }
}

impl Drop for CutProxy {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// Relays one connection; on the first `COMMIT` (if `armed`), forwards it, reads its answer,
/// sets `cut` and returns, dropping both sockets.
async fn relay(
    mut client: TcpStream,
    mut server: TcpStream,
    wire: Wire,
    armed: &AtomicBool,
    cut: &AtomicBool,
) -> std::io::Result<()> {
    let mut requests = Framing::new(wire, Side::Client);
    let mut from_client = vec![0u8; 16 * 1024];
    let mut from_server = vec![0u8; 16 * 1024];
    loop {
        tokio::select! {
            read = client.read(&mut from_client) => {
                let n = read?;
                if n == 0 {
                    return Ok(());
                }
                let chunk = &from_client[..n];
                if let Some(end) = requests.feed(chunk)
                    && armed.swap(false, Ordering::SeqCst)
                {
                    server.write_all(&chunk[..end]).await?;
                    let mut answers = Framing::new(wire, Side::Server);
                    loop {
                        let n = server.read(&mut from_server).await?;
                        if n == 0 || answers.feed(&from_server[..n]).is_some() {
                            break;
                        }
                    }
                    cut.store(true, Ordering::SeqCst);
                    return Ok(());
                }
                server.write_all(chunk).await?;
            }
            read = server.read(&mut from_server) => {
                let n = read?;
                if n == 0 {
                    return Ok(());
                }
                client.write_all(&from_server[..n]).await?;
            }
        }
    }
}

/// Which direction a [`Framing`] reads.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Side {
    /// Requests: it finds the end of a `COMMIT`.
    Client,
    /// The answer to the `COMMIT`: it finds its end (PostgreSQL's `ReadyForQuery`, MySQL's one
    /// response packet).
    Server,
}

/// Splits a byte stream into the protocol's messages and reports where the one it looks for
/// ends.
struct Framing {
    wire: Wire,
    side: Side,
    /// Bytes of a message not complete yet.
    pending: Vec<u8>,
    /// PostgreSQL's client side: still in the startup phase (untyped messages).
    startup: bool,
}

impl Framing {
    fn new(wire: Wire, side: Side) -> Self {
        Self {
            wire,
            side,
            pending: Vec::new(),
            startup: side == Side::Client,
        }
    }

    /// Takes `chunk`; if a message it looks for ends in it, the offset in `chunk` just after
    /// that message (the first such message).
    fn feed(&mut self, chunk: &[u8]) -> Option<usize> {
        let before = self.pending.len();
        self.pending.extend_from_slice(chunk);
        let mut start = 0;
        let mut found = None;
        while let Some(len) = self.message_len(&self.pending[start..]) {
            let message = &self.pending[start..start + len];
            let wanted = wanted(self.wire, self.side, &mut self.startup, message);
            start += len;
            if wanted && found.is_none() {
                found = Some(start - before);
                break;
            }
        }
        self.pending.drain(..start);
        found
    }

    /// The length of the complete message at the start of `bytes`, if it is complete.
    fn message_len(&self, bytes: &[u8]) -> Option<usize> {
        match self.wire {
            Wire::Postgres if self.startup => {
                let len = u32::from_be_bytes(bytes.get(..4)?.try_into().ok()?) as usize;
                (bytes.len() >= len.max(4)).then_some(len.max(4))
            }
            Wire::Postgres => {
                let len = u32::from_be_bytes(bytes.get(1..5)?.try_into().ok()?) as usize;
                (bytes.len() > len).then_some(len + 1)
            }
            Wire::MySql => {
                let header = bytes.get(..4)?;
                let len = usize::from(header[0])
                    | usize::from(header[1]) << 8
                    | usize::from(header[2]) << 16;
                (bytes.len() >= len + 4).then_some(len + 4)
            }
        }
    }
}

/// Whether `message` (complete) is the one `side` looks for; updates the `startup` phase.
fn wanted(wire: Wire, side: Side, startup: &mut bool, message: &[u8]) -> bool {
    match (wire, side) {
        (Wire::Postgres, Side::Client) if *startup => {
            // SSLRequest and GSSENCRequest are followed by another startup message; any
            // other (StartupMessage) ends the startup phase.
            let code = message
                .get(4..8)
                .map(|c| u32::from_be_bytes([c[0], c[1], c[2], c[3]]));
            if !matches!(code, Some(80_877_103 | 80_877_104)) {
                *startup = false;
            }
            false
        }
        (Wire::Postgres, Side::Client) => {
            message[0] == b'Q' && is_commit(message.get(5..).unwrap_or_default())
        }
        (Wire::Postgres, Side::Server) => message[0] == b'Z',
        (Wire::MySql, Side::Client) => {
            // A command starts with sequence id 0; COM_QUERY is 0x03.
            message[3] == 0 && message.get(4) == Some(&0x03) && is_commit(&message[5..])
        }
        (Wire::MySql, Side::Server) => true,
    }
}

/// Whether the SQL text `sql` (NUL-terminated or not) holds a `COMMIT` statement.
fn is_commit(sql: &[u8]) -> bool {
    let sql = sql.strip_suffix(&[0]).unwrap_or(sql);
    String::from_utf8_lossy(sql)
        .split(';')
        .any(|statement| statement.trim().eq_ignore_ascii_case("COMMIT"))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pg_query(sql: &str) -> Vec<u8> {
        let mut message = vec![b'Q'];
        message.extend_from_slice(&(sql.len() as u32 + 5).to_be_bytes());
        message.extend_from_slice(sql.as_bytes());
        message.push(0);
        message
    }

    fn pg_startup() -> Vec<u8> {
        let mut message = 9u32.to_be_bytes().to_vec();
        message.extend_from_slice(&196_608u32.to_be_bytes());
        message.push(0);
        message
    }

    fn mysql_query(sql: &str, seq: u8) -> Vec<u8> {
        let len = sql.len() + 1;
        let mut packet = vec![len as u8, (len >> 8) as u8, (len >> 16) as u8, seq, 0x03];
        packet.extend_from_slice(sql.as_bytes());
        packet
    }

    #[test]
    fn finds_a_postgres_commit_across_chunks_after_startup() {
        let mut framing = Framing::new(Wire::Postgres, Side::Client);
        let mut stream = pg_startup();
        stream.extend(pg_query("BEGIN"));
        stream.extend(pg_query("SELECT 1; COMMIT; BEGIN"));
        stream.extend(pg_query("SELECT 2"));
        let end = stream.len() - pg_query("SELECT 2").len();
        let (first, second) = stream.split_at(12);
        assert_eq!(framing.feed(first), None);
        assert_eq!(framing.feed(second), Some(end - 12));
    }

    #[test]
    fn a_postgres_query_that_only_mentions_commit_is_not_one() {
        let mut framing = Framing::new(Wire::Postgres, Side::Client);
        let mut stream = pg_startup();
        stream.extend(pg_query("SELECT 'COMMIT'"));
        assert_eq!(framing.feed(&stream), None);
    }

    #[test]
    fn finds_a_mysql_commit_at_the_start_of_a_command_only() {
        let mut framing = Framing::new(Wire::MySql, Side::Client);
        let mut stream = mysql_query("COMMIT", 1); // not a command: a handshake packet
        stream.extend(mysql_query("SELECT 1", 0));
        let end = stream.len() + mysql_query("COMMIT", 0).len();
        stream.extend(mysql_query("COMMIT", 0));
        assert_eq!(framing.feed(&stream), Some(end));
    }
}
