//! Timed runs: N tasks, each with its own connection, run one operation in a loop; latency per
//! operation into an HDR histogram, messages per second over the common window; CPU of this
//! process, of the PostgreSQL server and of the machine over the same window.

use std::sync::Arc;
use std::time::{Duration, Instant};

use hdrhistogram::Histogram;
use tokio::sync::Barrier;

pub(crate) type BoxError = Box<dyn std::error::Error + Send + Sync>;
pub(crate) type BoxFuture<'a, T> = std::pin::Pin<Box<dyn Future<Output = T> + Send + 'a>>;

/// One unit of work, run in a loop by one task on its own connection.
pub(crate) trait Op: Send + 'static {
    /// Runs once; returns how many messages it handled.
    fn call(&mut self) -> BoxFuture<'_, Result<u64, BoxError>>;
}

/// A latency histogram in microseconds, 1 µs to 100 s, 3 significant digits.
pub(crate) fn histogram() -> Histogram<u64> {
    Histogram::new_with_bounds(1, 100_000_000, 3).expect("valid bounds")
}

/// What one timed run measured.
#[derive(Debug, Clone)]
pub(crate) struct Sample {
    /// Messages handled in the window.
    pub(crate) msgs: u64,
    /// Messages handled during warm-up and window together (for counters that cover both).
    pub(crate) msgs_total: u64,
    pub(crate) elapsed: Duration,
    /// Latency of one operation (µs).
    pub(crate) hist: Histogram<u64>,
    pub(crate) errors: u64,
    pub(crate) first_error: Option<String>,
    pub(crate) cpu: CpuDelta,
}

impl Sample {
    pub(crate) fn rate(&self) -> f64 {
        self.msgs as f64 / self.elapsed.as_secs_f64().max(1e-9)
    }
}

/// Runs every op in its own task: a warm-up, then a common measured window of `duration`.
pub(crate) async fn run_ops(
    ops: Vec<Box<dyn Op>>,
    warmup: Duration,
    duration: Duration,
    cpu: &CpuProbe,
    on_start: &(dyn Fn() + Sync),
) -> Sample {
    let n = ops.len();
    let warm = Arc::new(Barrier::new(n + 1));
    let go = Arc::new(Barrier::new(n + 1));
    let mut tasks = Vec::with_capacity(n);
    for mut op in ops {
        let (warm, go) = (warm.clone(), go.clone());
        tasks.push(tokio::spawn(async move {
            let mut warm_msgs = 0;
            warm.wait().await;
            let until = Instant::now() + warmup;
            while Instant::now() < until {
                if let Ok(m) = op.call().await {
                    warm_msgs += m;
                }
            }
            go.wait().await;
            let deadline = Instant::now() + duration;
            let mut hist = histogram();
            let (mut msgs, mut errors, mut first_error) = (0, 0, None);
            loop {
                let started = Instant::now();
                if started >= deadline {
                    break;
                }
                match op.call().await {
                    Ok(m) => {
                        msgs += m;
                        let us = started.elapsed().as_micros().max(1) as u64;
                        hist.saturating_record(us);
                    }
                    Err(error) => {
                        errors += 1;
                        first_error.get_or_insert_with(|| error.to_string());
                    }
                }
            }
            (
                warm_msgs,
                msgs,
                hist,
                errors,
                first_error,
                Instant::now(),
                op,
            )
        }));
    }
    warm.wait().await;
    go.wait().await;
    on_start();
    let start = Instant::now();
    let before = cpu.snapshot();
    let mut sample = Sample {
        msgs: 0,
        msgs_total: 0,
        elapsed: Duration::ZERO,
        hist: histogram(),
        errors: 0,
        first_error: None,
        cpu: CpuDelta::default(),
    };
    let mut end = start;
    let mut keep = Vec::with_capacity(n);
    for task in tasks {
        let (warm_msgs, msgs, hist, errors, first_error, done, op) =
            task.await.expect("benchmark task panicked");
        sample.msgs += msgs;
        sample.msgs_total += warm_msgs + msgs;
        sample.hist.add(&hist).expect("same bounds");
        sample.errors += errors;
        if sample.first_error.is_none() {
            sample.first_error = first_error;
        }
        end = end.max(done);
        keep.push(op);
    }
    sample.elapsed = end - start;
    sample.cpu = cpu.snapshot().since(&before);
    // Connections close after the snapshot (so that a closing pool is not measured).
    drop(keep);
    sample
}

// ---------------------------------------------------------------------------------------------
// CPU accounting from /proc: this process, the PostgreSQL cluster, the machine.

/// CPU time used in a window, in seconds.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct CpuDelta {
    /// This process (the Rust client).
    pub(crate) client: f64,
    /// Waited-for children of this process (pgbench).
    pub(crate) children: f64,
    /// The PostgreSQL cluster (postmaster, its live children, and its reaped children), if it
    /// runs on this machine and its postmaster.pid was readable.
    pub(crate) server: Option<f64>,
    /// All CPUs of the machine, busy (not idle, not iowait).
    pub(crate) machine: f64,
    pub(crate) wall: f64,
}

#[derive(Debug, Clone, Copy)]
pub(crate) struct CpuSnapshot {
    client: f64,
    children: f64,
    server: Option<f64>,
    machine_busy: f64,
    at: Instant,
}

impl CpuSnapshot {
    pub(crate) fn since(&self, before: &CpuSnapshot) -> CpuDelta {
        CpuDelta {
            client: self.client - before.client,
            children: self.children - before.children,
            server: match (self.server, before.server) {
                (Some(a), Some(b)) => Some(a - b),
                _ => None,
            },
            machine: self.machine_busy - before.machine_busy,
            wall: (self.at - before.at).as_secs_f64(),
        }
    }
}

/// Where to read CPU times from.
#[derive(Debug, Clone, Default)]
pub(crate) struct CpuProbe {
    /// The postmaster's pid, when the server is local.
    pub(crate) postmaster: Option<u32>,
}

/// Clock ticks per second of /proc's times (USER_HZ: 100 on Linux).
const HZ: f64 = 100.0;

impl CpuProbe {
    pub(crate) fn snapshot(&self) -> CpuSnapshot {
        let own = proc_stat("self");
        let server = self.postmaster.and_then(cluster_cpu);
        CpuSnapshot {
            client: own.map_or(0.0, |s| (s.utime + s.stime) as f64 / HZ),
            children: own.map_or(0.0, |s| (s.cutime + s.cstime) as f64 / HZ),
            server,
            machine_busy: machine_busy(),
            at: Instant::now(),
        }
    }
}

#[derive(Debug, Clone, Copy)]
struct ProcTimes {
    ppid: u32,
    utime: u64,
    stime: u64,
    cutime: u64,
    cstime: u64,
}

fn proc_stat(pid: &str) -> Option<ProcTimes> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The command name is in parentheses and may contain spaces: split after the last ')'.
    let rest = &text[text.rfind(')')? + 2..];
    let fields: Vec<&str> = rest.split_whitespace().collect();
    // rest starts at field 3 (state): ppid is field 4, utime 14, stime 15, cutime 16, cstime 17.
    let field = |n: usize| fields.get(n - 3).and_then(|f| f.parse::<u64>().ok());
    Some(ProcTimes {
        ppid: field(4)? as u32,
        utime: field(14)?,
        stime: field(15)?,
        cutime: field(16)?,
        cstime: field(17)?,
    })
}

/// CPU seconds of a PostgreSQL cluster: the postmaster with its reaped children, plus its live
/// children (backends, WAL writer, checkpointer, autovacuum, …).
fn cluster_cpu(postmaster: u32) -> Option<f64> {
    let master = proc_stat(&postmaster.to_string())?;
    let mut ticks = master.utime + master.stime + master.cutime + master.cstime;
    for entry in std::fs::read_dir("/proc").ok()?.flatten() {
        let name = entry.file_name();
        let Some(pid) = name
            .to_str()
            .filter(|n| n.bytes().all(|b| b.is_ascii_digit()))
        else {
            continue;
        };
        if let Some(child) = proc_stat(pid).filter(|s| s.ppid == postmaster) {
            ticks += child.utime + child.stime;
        }
    }
    Some(ticks as f64 / HZ)
}

/// Busy CPU seconds of the whole machine since boot (all CPUs).
fn machine_busy() -> f64 {
    let Ok(text) = std::fs::read_to_string("/proc/stat") else {
        return 0.0;
    };
    let Some(line) = text.lines().next() else {
        return 0.0;
    };
    let v: Vec<u64> = line
        .split_whitespace()
        .skip(1)
        .filter_map(|f| f.parse().ok())
        .collect();
    // user nice system idle iowait irq softirq steal
    let total: u64 = v.iter().take(8).sum();
    let idle = v.get(3).copied().unwrap_or(0) + v.get(4).copied().unwrap_or(0);
    (total - idle) as f64 / HZ
}

/// Resident set size of this process, KiB.
pub(crate) fn rss_kib() -> Option<u64> {
    let text = std::fs::read_to_string("/proc/self/status").ok()?;
    text.lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next())
        .and_then(|v| v.parse().ok())
}

// ---------------------------------------------------------------------------------------------
// A tiny deterministic RNG (splitmix64): keys, accounts and amounts without syscalls.

#[derive(Debug, Clone)]
pub(crate) struct Rng(u64);

impl Rng {
    pub(crate) fn new(seed: u64) -> Rng {
        Rng(seed ^ 0x9E37_79B9_7F4A_7C15)
    }
    pub(crate) fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    /// Uniform in `1..=n`.
    pub(crate) fn range(&mut self, n: u64) -> u64 {
        1 + self.next_u64() % n
    }
    /// A random (version 4) UUID.
    pub(crate) fn uuid_v4(&mut self) -> uuid::Uuid {
        let bytes = (u128::from(self.next_u64()) << 64 | u128::from(self.next_u64())).to_be_bytes();
        uuid::Builder::from_random_bytes(bytes).into_uuid()
    }
}

// ---------------------------------------------------------------------------------------------
// The runtime's own timings, through the `metrics` facade: `inbox_claim_duration_seconds`
// (BEGIN + claim statement) and `inbox_handler_duration_seconds` (the body).

/// A histogram the runtime records into (µs).
pub(crate) struct Timing(std::sync::Mutex<Histogram<u64>>);

impl Timing {
    fn new() -> Timing {
        Timing(std::sync::Mutex::new(histogram()))
    }
    fn lock(&self) -> std::sync::MutexGuard<'_, Histogram<u64>> {
        self.0.lock().unwrap_or_else(|e| e.into_inner())
    }
    /// Empties it.
    pub(crate) fn reset(&self) {
        self.lock().reset();
    }
    /// A copy of what it holds.
    pub(crate) fn snapshot(&self) -> Histogram<u64> {
        self.lock().clone()
    }
}

impl metrics::HistogramFn for Timing {
    fn record(&self, seconds: f64) {
        let us = (seconds * 1e6).round().max(1.0) as u64;
        self.lock().saturating_record(us);
    }
}

/// The runtime's claim timing (BEGIN + claim statement, as `handler.rs` measures it).
pub(crate) static CLAIM_TIMING: std::sync::LazyLock<Arc<Timing>> =
    std::sync::LazyLock::new(|| Arc::new(Timing::new()));

struct Recorder;

impl metrics::Recorder for Recorder {
    fn describe_counter(
        &self,
        _: metrics::KeyName,
        _: Option<metrics::Unit>,
        _: metrics::SharedString,
    ) {
    }
    fn describe_gauge(
        &self,
        _: metrics::KeyName,
        _: Option<metrics::Unit>,
        _: metrics::SharedString,
    ) {
    }
    fn describe_histogram(
        &self,
        _: metrics::KeyName,
        _: Option<metrics::Unit>,
        _: metrics::SharedString,
    ) {
    }
    fn register_counter(&self, _: &metrics::Key, _: &metrics::Metadata<'_>) -> metrics::Counter {
        metrics::Counter::noop()
    }
    fn register_gauge(&self, _: &metrics::Key, _: &metrics::Metadata<'_>) -> metrics::Gauge {
        metrics::Gauge::noop()
    }
    fn register_histogram(
        &self,
        key: &metrics::Key,
        _: &metrics::Metadata<'_>,
    ) -> metrics::Histogram {
        if key.name() == "inbox_claim_duration_seconds" {
            metrics::Histogram::from_arc(CLAIM_TIMING.clone())
        } else {
            metrics::Histogram::noop()
        }
    }
}

/// Installs the recorder (once per process; later calls do nothing).
pub(crate) fn install_recorder() {
    let _ = metrics::set_global_recorder(Recorder);
}
