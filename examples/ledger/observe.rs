//! What the demo shows of itself: tracing (`RUST_LOG`), metrics (a table at exit, or a
//! Prometheus endpoint), and a progress bar on a terminal.

use std::collections::BTreeMap;
use std::io::IsTerminal as _;
use std::net::SocketAddr;
use std::sync::Mutex;

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use metrics_exporter_prometheus::{PrometheusBuilder, PrometheusHandle};

/// The observability flags, shared by every mode that processes messages.
#[derive(Debug, Clone, clap::Args)]
pub(crate) struct ObserveArgs {
    /// Record the inbox metrics and print a table of them on stderr at exit (outcomes by
    /// consumer, rejected deliveries, claim and handler latencies)
    #[arg(long)]
    pub(crate) metrics: bool,
    /// Serve the inbox metrics in Prometheus' text format at http://ADDR/metrics while running
    /// (e.g. 127.0.0.1:9464)
    #[arg(long, value_name = "ADDR")]
    pub(crate) metrics_listen: Option<SocketAddr>,
}

/// Logs to stderr, filtered by `RUST_LOG` (e.g. `RUST_LOG=inbox_runtime=debug`), else by
/// `default` (`"off"`, `"warn"`, …). Stdout stays the demo's own.
pub(crate) fn init_tracing(default: &str) {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(default));
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_env_filter(filter)
        .with_target(false)
        .init();
}

/// An installed metrics recorder.
pub(crate) struct Metrics {
    handle: PrometheusHandle,
    print: bool,
}

impl Metrics {
    /// Installs the Prometheus recorder if `--metrics` or `--metrics-listen` asks for it (the
    /// listener needs a Tokio runtime).
    pub(crate) fn install(args: &ObserveArgs) -> Result<Option<Metrics>, String> {
        if !args.metrics && args.metrics_listen.is_none() {
            return Ok(None);
        }
        let builder = PrometheusBuilder::new();
        let handle = match args.metrics_listen {
            Some(addr) => {
                let (recorder, exporter) = builder
                    .with_http_listener(addr)
                    .build()
                    .map_err(|e| format!("cannot serve metrics on {addr}: {e}"))?;
                let handle = recorder.handle();
                metrics::set_global_recorder(recorder)
                    .map_err(|e| format!("cannot install the metrics recorder: {e}"))?;
                tokio::spawn(exporter);
                eprintln!("metrics: http://{addr}/metrics");
                handle
            }
            None => builder
                .install_recorder()
                .map_err(|e| format!("cannot install the metrics recorder: {e}"))?,
        };
        metrics::describe_counter!(
            REJECTED,
            "Deliveries refused before any consumer ran (malformed, unknown message, bad key), \
             each kept in inbox_rejections"
        );
        // Registered at 0, so that the endpoint shows it before the first rejection.
        rejected_many(0);
        Ok(Some(Metrics {
            handle,
            print: args.metrics,
        }))
    }

    /// With `--metrics`: prints the table on stderr.
    pub(crate) fn finish(&self) {
        if self.print {
            eprint!("{}", table(&self.handle.render()));
        }
    }
}

/// The demo's own counter of rejected deliveries (malformed lines, unknown message names, bad
/// keys: the summary's `rejected`, each kept in `inbox_rejections`). The runtime counts what
/// reaches a consumer (`inbox_messages_total`, conflicts included), not deliveries refused
/// before any consumer runs.
pub(crate) const REJECTED: &str = "ledger_rejected_total";

/// Counts one rejected delivery in [`REJECTED`] (a no-op without a recorder).
pub(crate) fn rejected() {
    metrics::counter!(REJECTED).increment(1);
}

/// Counts `n` rejected deliveries in [`REJECTED`].
pub(crate) fn rejected_many(n: u64) {
    metrics::counter!(REJECTED).increment(n);
}

/// One sample of the Prometheus text format: name, labels, value.
fn parse_sample(line: &str) -> Option<(&str, BTreeMap<&str, &str>, f64)> {
    if line.starts_with('#') || line.trim().is_empty() {
        return None;
    }
    let (series, value) = line.rsplit_once(' ')?;
    let value: f64 = value.parse().ok()?;
    let (name, labels) = match series.split_once('{') {
        Some((name, rest)) => (name, rest.strip_suffix('}')?),
        None => (series, ""),
    };
    let labels = labels
        .split(',')
        .filter_map(|pair| {
            let (k, v) = pair.split_once('=')?;
            Some((k, v.trim_matches('"')))
        })
        .collect();
    Some((name, labels, value))
}

/// The compact table `--metrics` prints: outcomes by consumer, rejected deliveries, then latency
/// quantiles.
fn table(rendered: &str) -> String {
    const OUTCOMES: [&str; 6] = [
        "processed",
        "duplicate",
        "conflict",
        "dead",
        "failed",
        "discarded",
    ];
    let mut outcomes: BTreeMap<String, BTreeMap<String, f64>> = BTreeMap::new();
    // (metric, consumer) → quantile → seconds
    let mut latencies: BTreeMap<(String, String), BTreeMap<String, f64>> = BTreeMap::new();
    let mut purged = None;
    let mut rejected = 0.0;
    for (name, labels, value) in rendered.lines().filter_map(parse_sample) {
        let consumer = labels.get("consumer").copied().unwrap_or("-").to_owned();
        match name {
            "inbox_messages_total" => {
                let outcome = labels.get("outcome").copied().unwrap_or("?").to_owned();
                *outcomes
                    .entry(consumer)
                    .or_default()
                    .entry(outcome)
                    .or_default() += value;
            }
            "inbox_claim_duration_seconds"
            | "inbox_handler_duration_seconds"
            | "inbox_lag_seconds" => {
                if let Some(quantile) = labels.get("quantile") {
                    latencies
                        .entry((name.to_owned(), consumer))
                        .or_default()
                        .insert((*quantile).to_owned(), value);
                }
            }
            "inbox_purged_total" => purged = Some(value),
            REJECTED => rejected += value,
            _ => {}
        }
    }

    let mut out = String::from("metrics: inbox_messages_total by consumer and outcome\n");
    let mut columns: Vec<String> = OUTCOMES.iter().map(|s| (*s).to_owned()).collect();
    for seen in outcomes.values().flat_map(BTreeMap::keys) {
        if !columns.contains(seen) {
            columns.push(seen.clone());
        }
    }
    let width = |s: &str| s.len().max(9);
    out.push_str(&format!("  {:<10}", "consumer"));
    for column in &columns {
        out.push_str(&format!(" {:>w$}", column, w = width(column)));
    }
    out.push('\n');
    for (consumer, counts) in &outcomes {
        out.push_str(&format!("  {consumer:<10}"));
        for column in &columns {
            let n = counts.get(column).copied().unwrap_or(0.0);
            out.push_str(&format!(" {:>w$}", n, w = width(column)));
        }
        out.push('\n');
    }
    if outcomes.is_empty() {
        out.push_str("  (no messages)\n");
    }
    out.push_str(&format!(
        "metrics: {REJECTED} {rejected} (deliveries refused before any consumer: malformed, \
         unknown message, bad key)\n"
    ));
    if !latencies.is_empty() {
        out.push_str("metrics: latencies in ms (p50 / p99 / max)\n");
        for ((name, consumer), quantiles) in &latencies {
            let ms = |q: &str| {
                quantiles
                    .get(q)
                    .map_or_else(|| "-".to_owned(), |s| format!("{:.3}", s * 1e3))
            };
            let short = name
                .trim_start_matches("inbox_")
                .trim_end_matches("_seconds");
            out.push_str(&format!(
                "  {consumer:<10} {short:<18} {:>9} / {:>9} / {:>9}\n",
                ms("0.5"),
                ms("0.99"),
                ms("1")
            ));
        }
    }
    if let Some(purged) = purged {
        out.push_str(&format!("metrics: inbox_purged_total {purged}\n"));
    }
    out
}

/// The progress bar being drawn, if any, so that messages on stderr do not tear it.
static BAR: Mutex<Option<ProgressBar>> = Mutex::new(None);

/// A progress bar over `len` bytes (a spinner if unknown) on stderr — hidden unless stderr is a
/// terminal, so that piped or redirected output stays clean.
pub(crate) fn progress_bar(len: Option<u64>) -> ProgressBar {
    let target = if std::io::stderr().is_terminal() {
        ProgressDrawTarget::stderr()
    } else {
        ProgressDrawTarget::hidden()
    };
    let bar = ProgressBar::with_draw_target(len, target);
    let template = if len.is_some() {
        "{bar:40} {percent:>3}% {bytes}/{total_bytes} ({bytes_per_sec}, eta {eta})"
    } else {
        "{spinner} {bytes} ({bytes_per_sec})"
    };
    if let Ok(style) = ProgressStyle::with_template(template) {
        bar.set_style(style);
    }
    *BAR.lock().unwrap_or_else(|p| p.into_inner()) = Some(bar.clone());
    bar
}

/// Removes the progress bar.
pub(crate) fn finish_progress() {
    if let Some(bar) = BAR.lock().unwrap_or_else(|p| p.into_inner()).take() {
        bar.finish_and_clear();
    }
}

/// Prints a line on stderr, above the progress bar if one is drawn.
pub(crate) fn note(line: std::fmt::Arguments<'_>) {
    let bar = BAR.lock().unwrap_or_else(|p| p.into_inner()).clone();
    match bar {
        Some(bar) if !bar.is_hidden() => bar.suspend(|| eprintln!("{line}")),
        _ => eprintln!("{line}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn table_of_rendered_metrics() {
        let rendered = "# TYPE inbox_messages_total counter\n\
            inbox_messages_total{consumer=\"ledger\",outcome=\"processed\"} 3\n\
            inbox_messages_total{consumer=\"ledger\",outcome=\"duplicate\"} 2\n\
            inbox_handler_duration_seconds{consumer=\"ledger\",quantile=\"0.5\"} 0.002\n\
            # TYPE ledger_rejected_total counter\n\
            ledger_rejected_total 18\n";
        let text = table(rendered);
        assert!(
            text.contains(
                "metrics: ledger_rejected_total 18 (deliveries refused before any consumer: \
                 malformed, unknown message, bad key)\n"
            ),
            "{text}"
        );
        assert!(
            table("").contains("metrics: ledger_rejected_total 0 ("),
            "the counter is shown when nothing was rejected"
        );
        assert!(
            text.contains("  ledger             3         2         0"),
            "{text}"
        );
        assert!(text.contains("handler_duration"), "{text}");
        assert!(text.contains("2.000"), "{text}");
    }
}
