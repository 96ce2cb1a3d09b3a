//! pgbench with custom scripts: the same statements as the Rust paths, driven by PostgreSQL's
//! own C client with `-M prepared` — the server's own limit at a given concurrency.
//!
//! The claim statement is not copied from the runtime: the harness records the statement the
//! runtime actually sends (through the counting proxy) and turns its parameters into pgbench
//! variables, so that pgbench runs exactly the runtime's SQL.

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

use hdrhistogram::Histogram;

use crate::measure::{BoxError, CpuProbe, Sample, histogram};
use crate::paths::{ACCOUNTS, CONSUMER, MESSAGE, UPSERT_PG};

/// A fingerprint for the minimal claim's rows (never compared).
const HASH: &str = "1111111111111111111111111111111111111111111111111111111111111111";
use crate::proxy::Entry;

/// Where pgbench is and how it reaches the server.
#[derive(Debug, Clone)]
pub(crate) struct Pgbench {
    pub(crate) program: PathBuf,
    pub(crate) host: String,
    pub(crate) port: u16,
    pub(crate) user: String,
    pub(crate) password: Option<String>,
    pub(crate) database: String,
    /// Where scripts and latency logs go.
    pub(crate) dir: PathBuf,
}

/// How long pgbench runs.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Length {
    /// `-T secs`.
    Time(u64),
    /// `-t n` (per client).
    Transactions(u64),
}

/// Finds pgbench: `explicit`, else the newest `/usr/lib/postgresql/*/bin/pgbench`, else `PATH`.
pub(crate) fn locate(explicit: Option<&Path>) -> Option<PathBuf> {
    if let Some(path) = explicit {
        return path.exists().then(|| path.to_owned());
    }
    let mut found: Vec<PathBuf> = std::fs::read_dir("/usr/lib/postgresql")
        .into_iter()
        .flatten()
        .flatten()
        .map(|entry| entry.path().join("bin/pgbench"))
        .filter(|path| path.exists())
        .collect();
    found.sort_by_key(|path| {
        path.components()
            .nth(4)
            .and_then(|c| c.as_os_str().to_str()?.parse::<u32>().ok())
            .unwrap_or(0)
    });
    if let Some(path) = found.pop() {
        return Some(path);
    }
    std::env::var_os("PATH").and_then(|paths| {
        std::env::split_paths(&paths)
            .map(|dir| dir.join("pgbench"))
            .find(|path| path.exists())
    })
}

/// Statements recorded on the wire, as pgbench commands: `$n` replaced by `:key` (the message
/// key: a fresh random number per transaction), `:acct` and `:amount` (the effect's account and
/// amount, random like the Rust paths'), `NULL::type` for NULL arguments, and `:sN_pM` variables
/// (defined with `-D`) for the constant ones (consumer, message name, fingerprint, mode).
#[derive(Debug, Clone, Default)]
pub(crate) struct Recorded {
    /// One pgbench command per statement, in order.
    pub(crate) commands: Vec<String>,
    /// The statements as the runtime sent them.
    pub(crate) originals: Vec<String>,
    pub(crate) defines: Vec<(String, String)>,
    /// The index of the first statement bound to the message key (the claim), if any.
    pub(crate) claim: Option<usize>,
}

/// What the recorded message was: its key, account and amount.
pub(crate) struct Known<'a> {
    pub(crate) key: &'a str,
    pub(crate) account: &'a str,
    pub(crate) amount: i64,
}

fn type_name(oid: u32) -> Option<&'static str> {
    Some(match oid {
        16 => "bool",
        17 => "bytea",
        20 => "int8",
        21 => "int2",
        23 => "int4",
        25 => "text",
        1043 => "varchar",
        1184 => "timestamptz",
        _ => return None,
    })
}

/// Turns a recorded sequence (one message) into pgbench commands; `prefix` names its variables.
pub(crate) fn from_recording(
    entries: &[Entry],
    known: &Known<'_>,
    prefix: &str,
) -> Result<Recorded, BoxError> {
    let mut recorded = Recorded::default();
    for entry in entries {
        let (sql, types, params) = match entry {
            Entry::Query(sql) => {
                recorded.originals.push(sql.clone());
                recorded.commands.push(substitute(sql, &[])?);
                continue;
            }
            Entry::Execute {
                sql,
                param_types,
                params,
            } => (sql, param_types, params),
            Entry::Sync => continue,
        };
        let index = recorded.commands.len();
        let mut replacement = Vec::with_capacity(params.len());
        for (i, param) in params.iter().enumerate() {
            let n = i + 1;
            let oid = types.get(i).copied().unwrap_or(0);
            let value = match param {
                None => {
                    let ty = type_name(oid).unwrap_or("text");
                    replacement.push(format!("NULL::{ty}"));
                    continue;
                }
                Some(bytes) => bytes,
            };
            let text = match oid {
                16 => (value.first() == Some(&1)).to_string(),
                20 if value.len() == 8 => {
                    i64::from_be_bytes(value[..8].try_into().expect("8 bytes")).to_string()
                }
                23 if value.len() == 4 => {
                    i32::from_be_bytes(value[..4].try_into().expect("4 bytes")).to_string()
                }
                25 | 1043 | 0 => String::from_utf8(value.clone())?,
                // bytea (the fingerprint): its text form, `\x` and hex digits.
                17 => value.iter().fold("\\x".to_owned(), |mut text, byte| {
                    text.push_str(&format!("{byte:02x}"));
                    text
                }),
                _ => {
                    return Err(format!(
                        "recorded parameter ${n} of `{sql}` has type oid {oid}, unknown to the \
                         harness: teach pgbench::from_recording about it"
                    )
                    .into());
                }
            };
            let variable = if text == known.key {
                recorded.claim.get_or_insert(index);
                ":key".to_owned()
            } else if text == known.account {
                ":acct".to_owned()
            } else if oid == 20 && text == known.amount.to_string() {
                ":amount".to_owned()
            } else {
                let name = format!("{prefix}{index}_p{n}");
                recorded.defines.push((name.clone(), text));
                format!(":{name}")
            };
            replacement.push(variable);
        }
        recorded.originals.push(sql.clone());
        recorded.commands.push(substitute(sql, &replacement)?);
    }
    Ok(recorded)
}

impl Recorded {
    /// The claim command.
    pub(crate) fn claim_command(&self) -> Option<&str> {
        self.claim.map(|i| self.commands[i].as_str())
    }
}

/// Replaces `$1`, `$2`, … in `sql` (outside quotes) by `with[0]`, `with[1]`, …
fn substitute(sql: &str, with: &[String]) -> Result<String, BoxError> {
    let mut out = String::with_capacity(sql.len() + 64);
    let mut chars = sql.chars().peekable();
    let mut quoted = false;
    while let Some(c) = chars.next() {
        if c == '\'' {
            quoted = !quoted;
        }
        if c == '$' && !quoted && chars.peek().is_some_and(char::is_ascii_digit) {
            let mut digits = String::new();
            while let Some(d) = chars.peek().copied().filter(char::is_ascii_digit) {
                digits.push(d);
                chars.next();
            }
            let n: usize = digits.parse()?;
            let value = with
                .get(n.wrapping_sub(1))
                .ok_or_else(|| format!("statement uses ${n}, bound with {}", with.len()))?;
            out.push_str(value);
        } else {
            out.push(c);
        }
    }
    // pgbench ends a command at `;` and reads it from one line.
    Ok(out.split_whitespace().collect::<Vec<_>>().join(" "))
}

/// The effect as a pgbench command.
fn effect() -> String {
    substitute(UPSERT_PG, &[":acct".to_owned(), ":amount".to_owned()]).expect("two parameters")
}

const VARS: &str = "\\set key random(1, 9000000000000000000)\n";

fn effect_vars() -> String {
    format!("\\set acct random(1, {ACCOUNTS})\n\\set amount random(1, 1000)\n")
}

/// The statements pgbench runs besides the effect, recorded from the runtime.
#[derive(Debug, Clone, Default)]
pub(crate) struct Recordings {
    /// One message through `#[idempotent]` (its first statement bound to the key is the claim).
    pub(crate) inbox: Option<Recorded>,
    /// One duplicate through `#[idempotent]`.
    pub(crate) duplicate: Option<Recorded>,
}

/// The pgbench scripts the harness runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) enum Script {
    /// The effect alone, autocommit: 1 round trip.
    Bare,
    /// `BEGIN; effect; COMMIT`: 3 round trips.
    BareTx,
    /// Exactly the statements the runtime sent for one message, one round trip each.
    Runtime,
    /// `BEGIN; claim; effect; COMMIT`: 4 round trips (the claim as the runtime sends it).
    Inbox,
    /// `BEGIN; INSERT … ON CONFLICT DO NOTHING; effect; COMMIT`: the smallest claim there is
    /// (4 round trips), to price the runtime's claim statement against it.
    MinimalClaim,
    /// `BEGIN` and the claim in one pipeline, then effect, `COMMIT`: 3 round trips.
    InboxBeginPipelined,
    /// The whole transaction in one pipeline: 1 round trip (no decision between claim and
    /// effect: an upper bound for a server-side claim-and-apply).
    InboxOneTrip,
    /// Exactly the statements the runtime sent for one duplicate, keys '1'…`keys`.
    Duplicate { keys: u64 },
}

impl Script {
    pub(crate) fn label(self) -> &'static str {
        match self {
            Script::Bare => "pgbench: effect alone (autocommit)",
            Script::BareTx => "pgbench: BEGIN; effect; COMMIT",
            Script::Runtime => "pgbench: the runtime's statements (as recorded)",
            Script::Inbox => "pgbench: BEGIN; claim; effect; COMMIT",
            Script::MinimalClaim => {
                "pgbench: BEGIN; INSERT … ON CONFLICT DO NOTHING; effect; COMMIT"
            }
            Script::InboxBeginPipelined => "pgbench: [BEGIN; claim]; effect; COMMIT",
            Script::InboxOneTrip => "pgbench: [BEGIN; claim; effect; COMMIT]",
            Script::Duplicate { .. } => "pgbench: the runtime's duplicate (as recorded)",
        }
    }

    /// The `-D` definitions the script needs.
    fn defines(self, rec: &Recordings) -> Vec<(String, String)> {
        match self {
            Script::Bare | Script::BareTx | Script::MinimalClaim => Vec::new(),
            Script::Duplicate { .. } => rec
                .duplicate
                .as_ref()
                .map(|r| r.defines.clone())
                .unwrap_or_default(),
            _ => rec
                .inbox
                .as_ref()
                .map(|r| r.defines.clone())
                .unwrap_or_default(),
        }
    }

    /// The script text.
    pub(crate) fn text(self, rec: &Recordings) -> Result<String, BoxError> {
        let effect = effect();
        let inbox = || rec.inbox.as_ref().ok_or("no recorded statements");
        let claim = || -> Result<String, BoxError> {
            Ok(inbox()?
                .claim_command()
                .ok_or("no recorded claim statement")?
                .to_owned())
        };
        let lines = |commands: &[String]| {
            commands
                .iter()
                .map(|c| format!("{c};\n"))
                .collect::<String>()
        };
        Ok(match self {
            Script::Bare => format!("{}{effect};\n", effect_vars()),
            Script::BareTx => format!("{}BEGIN;\n{effect};\nCOMMIT;\n", effect_vars()),
            Script::Runtime => format!("{VARS}{}{}", effect_vars(), lines(&inbox()?.commands)),
            Script::Inbox => format!(
                "{VARS}{}BEGIN;\n{};\n{effect};\nCOMMIT;\n",
                effect_vars(),
                claim()?
            ),
            Script::MinimalClaim => format!(
                "{VARS}{}BEGIN;\nINSERT INTO inbox_messages (consumer, message_key, message_name, \
                 payload_hash) VALUES ('{CONSUMER}', :key, '{MESSAGE}', decode('{HASH}', 'hex')) \
                 ON CONFLICT DO NOTHING RETURNING attempts;\n{effect};\nCOMMIT;\n",
                effect_vars()
            ),
            Script::InboxBeginPipelined => format!(
                "{VARS}{}\\startpipeline\nBEGIN;\n{};\n\\endpipeline\n{effect};\nCOMMIT;\n",
                effect_vars(),
                claim()?
            ),
            Script::InboxOneTrip => format!(
                "{VARS}{}\\startpipeline\nBEGIN;\n{};\n{effect};\nCOMMIT;\n\\endpipeline\n",
                effect_vars(),
                claim()?
            ),
            Script::Duplicate { keys } => format!(
                "\\set key random(1, {keys})\n{}",
                lines(
                    &rec.duplicate
                        .as_ref()
                        .ok_or("no recorded duplicate")?
                        .commands
                )
            ),
        })
    }
}

/// Round trips of one transaction of a script: each command outside a pipeline, and each
/// pipeline.
pub(crate) fn round_trips_of(script: &str) -> usize {
    let mut trips = 0;
    let mut in_pipeline = false;
    for line in script.lines().map(str::trim).filter(|l| !l.is_empty()) {
        match line {
            "\\startpipeline" => in_pipeline = true,
            "\\endpipeline" => {
                in_pipeline = false;
                trips += 1;
            }
            meta if meta.starts_with('\\') => {}
            _ if !in_pipeline => trips += 1,
            _ => {}
        }
    }
    trips
}

/// What one pgbench run measured.
#[derive(Debug)]
pub(crate) struct Run {
    pub(crate) sample: Sample,
}

impl Pgbench {
    /// Runs `script` with `clients` clients against `host:port` (the server, or the proxy).
    pub(crate) async fn run(
        &self,
        script: Script,
        rec: &Recordings,
        clients: usize,
        length: Length,
        target: Option<(String, u16)>,
        cpu: &CpuProbe,
    ) -> Result<Run, BoxError> {
        let text = script.text(rec)?;
        let defines = script.defines(rec);
        self.run_text(&text, &defines, clients, length, target, cpu)
            .await
    }

    /// Runs the script `text` (with `-D name=value` for each of `defines`) with `clients`
    /// clients against `host:port` (the server, or the proxy).
    pub(crate) async fn run_text(
        &self,
        text: &str,
        defines: &[(String, String)],
        clients: usize,
        length: Length,
        target: Option<(String, u16)>,
        cpu: &CpuProbe,
    ) -> Result<Run, BoxError> {
        let tag = format!("pgbench-{}", next_tag());
        let script_path = self.dir.join(format!("{tag}.sql"));
        std::fs::write(&script_path, text)?;
        let log_prefix = self.dir.join(format!("{tag}.log"));
        let (host, port) = target.unwrap_or_else(|| (self.host.clone(), self.port));
        let threads = clients.min(std::thread::available_parallelism().map_or(2, |n| n.get()));
        let mut cmd = std::process::Command::new(&self.program);
        cmd.arg("-n")
            .args(["-M", "prepared"])
            .args(["-h", &host, "-p", &port.to_string(), "-U", &self.user])
            .args(["-c", &clients.to_string(), "-j", &threads.to_string()])
            .arg("-f")
            .arg(&script_path)
            .arg("-l")
            .arg(format!("--log-prefix={}", log_prefix.display()));
        match length {
            Length::Time(secs) => cmd.args(["-T", &secs.max(1).to_string()]),
            Length::Transactions(n) => cmd.args(["-t", &n.max(1).to_string()]),
        };
        for (name, value) in defines {
            cmd.arg("-D").arg(format!("{name}={value}"));
        }
        cmd.arg(&self.database);
        if let Some(password) = &self.password {
            cmd.env("PGPASSWORD", password);
        }
        cmd.env("PGSSLMODE", "disable")
            .env("PGGSSENCMODE", "disable");
        cmd.stdout(Stdio::piped()).stderr(Stdio::piped());
        let before = cpu.snapshot();
        let output = tokio::task::spawn_blocking(move || cmd.output()).await??;
        let delta = cpu.snapshot().since(&before);
        let stdout = String::from_utf8_lossy(&output.stdout).into_owned();
        let stderr = String::from_utf8_lossy(&output.stderr).into_owned();
        if !output.status.success() {
            return Err(format!(
                "pgbench failed ({}): {}\n{}",
                output.status,
                stderr.trim(),
                stdout.trim()
            )
            .into());
        }
        let field = |prefix: &str| {
            stdout
                .lines()
                .find_map(|l| l.trim().strip_prefix(prefix))
                .map(str::trim)
        };
        let processed: u64 = field("number of transactions actually processed:")
            .and_then(|v| v.split('/').next())
            .and_then(|v| v.trim().parse().ok())
            .ok_or_else(|| format!("pgbench printed no transaction count:\n{stdout}"))?;
        let failed: u64 = field("number of failed transactions:")
            .and_then(|v| v.split_whitespace().next())
            .and_then(|v| v.parse().ok())
            .unwrap_or(0);
        let tps: f64 = field("tps =")
            .and_then(|v| v.split_whitespace().next())
            .and_then(|v| v.parse().ok())
            .ok_or_else(|| format!("pgbench printed no tps:\n{stdout}"))?;
        let hist = read_logs(&self.dir, &format!("{tag}.log"))?;
        let _ = std::fs::remove_file(&script_path);
        // pgbench's tps excludes connection time: express the window that way.
        let elapsed = Duration::from_secs_f64(processed as f64 / tps.max(1e-9));
        Ok(Run {
            sample: Sample {
                msgs: processed,
                msgs_total: processed,
                elapsed,
                hist,
                errors: failed,
                first_error: (failed > 0).then(|| format!("{failed} failed transactions")),
                cpu: delta,
            },
        })
    }
}

fn next_tag() -> u32 {
    use std::sync::atomic::{AtomicU32, Ordering};
    static NEXT: AtomicU32 = AtomicU32::new(1);
    NEXT.fetch_add(1, Ordering::Relaxed)
}

/// Per-transaction latencies from pgbench's `-l` logs (`client tx latency_us script epoch us`),
/// then deletes the logs.
fn read_logs(dir: &Path, prefix: &str) -> Result<Histogram<u64>, BoxError> {
    let mut hist = histogram();
    for entry in std::fs::read_dir(dir)?.flatten() {
        let name = entry.file_name();
        if !name.to_string_lossy().starts_with(prefix) {
            continue;
        }
        let text = std::fs::read_to_string(entry.path())?;
        for line in text.lines() {
            if let Some(us) = line
                .split_whitespace()
                .nth(2)
                .and_then(|v| v.parse::<u64>().ok())
            {
                hist.saturating_record(us.max(1));
            }
        }
        let _ = std::fs::remove_file(entry.path());
    }
    Ok(hist)
}
