//! Two builds of the harness side by side in one run (issue 32: "the bench's peers section gives
//! the same ratios within noise, before and after, in one run"): `--compare-bench PATH` runs the
//! peers section of the harness at PATH (another revision's build: `scripts/bench.sh --compare
//! REV` builds it) and of this binary, one round at a time against the same server, alternating
//! which build goes first, and reports both builds' rates and ratios side by side.
//!
//! Each round runs each binary once as a child process with the options this one got (without
//! the comparison's own, `--only` and `--rounds`), plus `--only peers --rounds 1`: each child
//! drops and creates the harness's database, migrates it with its own runtime's migrations, and
//! prints its report. The reports are kept in `target/bench-compare/`; the peers table of each
//! is read back (its header's column names find the rate, WAL and effects columns, so a build
//! whose table has other columns still compares). A ratio is taken within one child's report
//! (the row ÷ pgbench's naive inbox at the same N, measured by the same invocation minutes
//! apart), then the median over the rounds is reported with its spread: drift between
//! invocations cancels out of the ratios, not out of the rates.
//!
//! Only the rows both builds print are compared; the others are listed under the table.

use std::path::{Path, PathBuf};

use crate::measure::BoxError;
use crate::{Args, Out, Profile, median, progress};

/// The options this module handles itself, each taking a value.
const OWN: [&str; 5] = [
    "--compare-bench",
    "--compare-label",
    "--build-label",
    "--only",
    "--rounds",
];

/// The arguments of a child: `argv` (without the program) minus [`OWN`]'s options, plus
/// `--only peers --rounds 1`.
fn child_args(argv: &[String]) -> Vec<String> {
    let mut out = Vec::new();
    let mut skip_value = false;
    for arg in argv {
        if skip_value {
            skip_value = false;
            continue;
        }
        if OWN.contains(&arg.as_str()) {
            skip_value = true;
            continue;
        }
        if OWN.iter().any(|own| arg.starts_with(&format!("{own}="))) {
            continue;
        }
        out.push(arg.clone());
    }
    out.extend(["--only", "peers", "--rounds", "1"].map(String::from));
    out
}

/// One row of a peers table, as printed.
#[derive(Debug, Clone, PartialEq)]
struct Printed {
    label: String,
    n: usize,
    rate: Option<f64>,
    wal: Option<f64>,
    exact: bool,
}

/// The rows of the peers table in `report` (the first table after the section's heading whose
/// header starts `| path | N | deliveries/s |`).
fn parse_peers(report: &str) -> Result<Vec<Printed>, BoxError> {
    let start = report
        .find("## The peers' workload")
        .ok_or("no peers section in the report")?;
    let mut lines = report[start..].lines();
    let cells = |line: &str| -> Vec<String> {
        line.trim()
            .trim_start_matches('|')
            .trim_end_matches('|')
            .split(" | ")
            .map(|c| c.trim().to_owned())
            .collect()
    };
    let header = lines
        .by_ref()
        .find(|l| l.starts_with("| path | N | deliveries/s |"))
        .map(cells)
        .ok_or("no peers table in the report")?;
    let column = |name: &str| header.iter().position(|h| h == name);
    let (rate, wal, effects) = (
        column("deliveries/s").ok_or("no deliveries/s column")?,
        column("WAL bytes/delivery"),
        column("effects").ok_or("no effects column")?,
    );
    let number = |cell: Option<&String>| cell.and_then(|c| c.parse::<f64>().ok());
    let mut rows = Vec::new();
    for line in lines.skip_while(|l| l.starts_with("|---")) {
        if !line.starts_with('|') {
            break;
        }
        let c = cells(line);
        rows.push(Printed {
            label: c[0].clone(),
            n: c.get(1).and_then(|n| n.parse().ok()).unwrap_or(0),
            rate: number(c.get(rate)),
            wal: wal.and_then(|i| number(c.get(i))),
            exact: c.get(effects).is_some_and(|e| e.starts_with("exact")),
        });
    }
    Ok(rows)
}

/// The naive inbox's row label (both builds print it alike).
fn is_naive(label: &str) -> bool {
    label.starts_with("pgbench: naive inbox (BEGIN;")
}

/// One build's rounds: per (label, N), the printed row of each round.
#[derive(Default)]
struct Build {
    rounds: Vec<Vec<Printed>>,
}

impl Build {
    /// (label, N) of every row of the first round, in its order.
    fn keys(&self) -> Vec<(String, usize)> {
        self.rounds
            .first()
            .map(|r| r.iter().map(|p| (p.label.clone(), p.n)).collect())
            .unwrap_or_default()
    }

    /// The row `key` in each round, with that round's naive row at the same N.
    fn each(&self, key: &(String, usize)) -> Vec<(&Printed, Option<&Printed>)> {
        self.rounds
            .iter()
            .filter_map(|round| {
                let row = round.iter().find(|p| (&p.label, p.n) == (&key.0, key.1))?;
                let naive = round.iter().find(|p| p.n == key.1 && is_naive(&p.label));
                Some((row, naive))
            })
            .collect()
    }

    /// Median rate, median ratio to the naive row (with min–max), median WAL per delivery,
    /// and whether every round was exact.
    fn figures(&self, key: &(String, usize)) -> Figures {
        let each = self.each(key);
        let rates: Vec<f64> = each.iter().filter_map(|(r, _)| r.rate).collect();
        let ratios: Vec<f64> = each
            .iter()
            .filter_map(|(r, naive)| Some(r.rate? / naive.as_ref()?.rate?))
            .collect();
        let wal: Vec<f64> = each.iter().filter_map(|(r, _)| r.wal).collect();
        Figures {
            rate: (!rates.is_empty()).then(|| median(&rates)),
            ratio: (!ratios.is_empty()).then(|| {
                let min = ratios.iter().copied().fold(f64::INFINITY, f64::min);
                let max = ratios.iter().copied().fold(0.0, f64::max);
                (median(&ratios), min, max)
            }),
            wal: (!wal.is_empty()).then(|| median(&wal)),
            exact: !each.is_empty() && each.iter().all(|(r, _)| r.exact),
            rounds: each.len(),
        }
    }
}

struct Figures {
    rate: Option<f64>,
    /// Median, min, max.
    ratio: Option<(f64, f64, f64)>,
    wal: Option<f64>,
    exact: bool,
    rounds: usize,
}

/// Runs `program` with `args`, keeps its report in `dir/name`, and returns the report.
async fn child(
    program: &Path,
    args: &[String],
    dir: &Path,
    name: &str,
) -> Result<String, BoxError> {
    let mut cmd = std::process::Command::new(program);
    cmd.args(args)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::inherit());
    let output = tokio::task::spawn_blocking(move || cmd.output()).await??;
    let report = String::from_utf8_lossy(&output.stdout).into_owned();
    std::fs::write(dir.join(name), &report)?;
    if !output.status.success() {
        return Err(format!(
            "{} {} failed ({}); its report: {}",
            program.display(),
            args.join(" "),
            output.status,
            dir.join(name).display()
        )
        .into());
    }
    Ok(report)
}

/// A file name made of `label`: letters, digits, `-`, `_`, `.`.
fn file_name(label: &str) -> String {
    label
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || "-_.".contains(c) {
                c
            } else {
                '_'
            }
        })
        .collect()
}

/// The comparison: the rounds, then the table.
pub(crate) async fn run(args: &Args, other: &Path) -> Result<String, BoxError> {
    let this: PathBuf = std::env::current_exe()?;
    if !other.exists() {
        return Err(format!("--compare-bench {}: no such file", other.display()).into());
    }
    let argv: Vec<String> = std::env::args().skip(1).collect();
    let child_args = child_args(&argv);
    let rounds = Profile::of(args).rounds;
    let dir = crate::workspace_target().join("bench-compare");
    std::fs::create_dir_all(&dir)?;
    let names = [args.compare_label.as_str(), args.build_label.as_str()];
    let programs = [other, this.as_path()];
    let mut builds = [Build::default(), Build::default()];
    for round in 0..rounds {
        let order = if round % 2 == 0 { [0, 1] } else { [1, 0] };
        for b in order {
            progress(format!(
                "compare, round {}/{rounds}: {} ({})",
                round + 1,
                names[b],
                programs[b].display()
            ));
            let report = child(
                programs[b],
                &child_args,
                &dir,
                &format!("{}-round-{}.md", file_name(names[b]), round + 1),
            )
            .await?;
            builds[b].rounds.push(parse_peers(&report)?);
        }
    }
    let mut out = Out::default();
    write(
        &mut out,
        &names,
        &programs,
        &builds,
        rounds,
        &child_args,
        &dir,
    );
    Ok(out.text)
}

/// `arg` with the password of a URL in it (`scheme://user:password@host…`) replaced by `***`,
/// for the report.
fn redacted(arg: &str) -> String {
    let Some(scheme) = arg.find("://").map(|i| i + 3) else {
        return arg.to_owned();
    };
    let rest = &arg[scheme..];
    let Some(at) = rest.find('@') else {
        return arg.to_owned();
    };
    match rest[..at].find(':') {
        Some(colon) => format!("{}{}:***{}", &arg[..scheme], &rest[..colon], &rest[at..]),
        None => arg.to_owned(),
    }
}

/// The compared rows (those both builds print, in this build's order): rates, ratios to the
/// naive inbox, WAL per delivery, effects.
fn table_rows(
    builds: &[Build; 2],
    keys: &[(String, usize)],
    theirs: &[(String, usize)],
    names: &[&str; 2],
) -> Vec<Vec<String>> {
    let [before, after] = names;
    let ratio = |f: &Figures| {
        f.ratio.map_or("—".into(), |(m, lo, hi)| {
            if f.rounds > 1 {
                format!("{m:.2}× ({lo:.2}–{hi:.2})")
            } else {
                format!("{m:.2}×")
            }
        })
    };
    let div = |a: Option<f64>, b: Option<f64>| match (a, b) {
        (Some(a), Some(b)) if b > 0.0 => format!("{:.2}×", a / b),
        _ => "—".into(),
    };
    let mut rows = Vec::new();
    for key in keys.iter().filter(|k| theirs.contains(k)) {
        let (b, a) = (builds[0].figures(key), builds[1].figures(key));
        rows.push(vec![
            key.0.clone(),
            key.1.to_string(),
            b.rate.map_or("—".into(), |r| format!("{r:.0}")),
            a.rate.map_or("—".into(), |r| format!("{r:.0}")),
            div(a.rate, b.rate),
            ratio(&b),
            ratio(&a),
            div(a.ratio.map(|r| r.0), b.ratio.map(|r| r.0)),
            b.wal.map_or("—".into(), |w| format!("{w:.0}")),
            a.wal.map_or("—".into(), |w| format!("{w:.0}")),
            match (b.exact, a.exact) {
                (true, true) => "exact in both".into(),
                (x, y) => format!(
                    "**FAILED** in {}",
                    match (x, y) {
                        (false, false) => "both",
                        (false, true) => before,
                        _ => after,
                    }
                ),
            },
        ]);
    }
    rows
}

fn write(
    out: &mut Out,
    names: &[&str; 2],
    programs: &[&Path; 2],
    builds: &[Build; 2],
    rounds: usize,
    child_args: &[String],
    dir: &Path,
) {
    let [before, after] = names;
    out.line(format!(
        "# The peers section, two builds: {before} and {after}"
    ));
    out.line("");
    out.line(format!(
        "{before}: `{}`; {after}: `{}`. {rounds} round(s) of each, run as `bench {}`, one round \
         of each build after the other, alternating which goes first, against the same server \
         (each report in `{}`). `× naive`: the row ÷ pgbench's naive inbox at the same N in the \
         same report, median over the rounds (min–max); `after ÷ before` of the medians. Effects: \
         exact in every round of that build, or not.",
        programs[0].display(),
        programs[1].display(),
        child_args
            .iter()
            .map(|a| redacted(a))
            .collect::<Vec<_>>()
            .join(" "),
        dir.display(),
    ));
    out.line("");
    let keys = builds[1].keys();
    let theirs = builds[0].keys();
    let rows = table_rows(builds, &keys, &theirs, names);
    let h = |what: &str, name: &str| format!("{name} {what}");
    out.table(
        &[
            "path",
            "N",
            &h("deliveries/s", before),
            &h("deliveries/s", after),
            "after ÷ before",
            &h("× naive", before),
            &h("× naive", after),
            "× naive, after ÷ before",
            &h("WAL bytes/delivery", before),
            &h("WAL bytes/delivery", after),
            "effects",
        ],
        &rows,
    );
    for (name, only) in [
        (
            before,
            theirs
                .iter()
                .filter(|k| !keys.contains(k))
                .collect::<Vec<_>>(),
        ),
        (after, keys.iter().filter(|k| !theirs.contains(k)).collect()),
    ] {
        if !only.is_empty() {
            out.line(format!(
                "Only in {name} (not compared): {}.",
                only.iter()
                    .map(|(l, n)| format!("{l} at {n}"))
                    .collect::<Vec<_>>()
                    .join("; ")
            ));
            out.line("");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn child_args_drop_the_comparisons_own_options() {
        let argv: Vec<String> = [
            "--quick",
            "--compare-bench",
            "/x/bench",
            "--compare-label=02cccb6",
            "--build-label",
            "HEAD",
            "--only",
            "peers",
            "--rounds=3",
            "--database-url",
            "postgres://u@h/db",
        ]
        .map(String::from)
        .to_vec();
        assert_eq!(
            child_args(&argv),
            [
                "--quick",
                "--database-url",
                "postgres://u@h/db",
                "--only",
                "peers",
                "--rounds",
                "1"
            ]
        );
    }

    #[test]
    fn passwords_are_left_out_of_the_report() {
        assert_eq!(
            redacted("postgres://inbox:s3cret@127.0.0.1:5432/db"),
            "postgres://inbox:***@127.0.0.1:5432/db"
        );
        assert_eq!(
            redacted("postgres://postgres@127.0.0.1/db"),
            "postgres://postgres@127.0.0.1/db"
        );
        assert_eq!(redacted("--quick"), "--quick");
    }

    #[test]
    fn the_peers_table_is_read_by_its_column_names() {
        let report = "# report\n\n## The peers' workload (PostgreSQL): x\n\ntext\n\n\
            | path | delivery | deliveries counted |\n|---|---:|---:|\n| a | b | 3 |\n\n\
            | path | N | deliveries/s | × naive | WAL bytes/delivery | effects |\n\
            |---|---:|---:|---:|---:|---:|\n\
            | pgbench: naive inbox (BEGIN; …) | 4 | 5000 | 1.00× | 390 | exact (1 of 1 runs) |\n\
            | ours: x | 4 | **FAILED** | — | — | **FAILED** in 1 of 1 runs: y |\n\
            \nRatios\n";
        assert_eq!(
            parse_peers(report).unwrap(),
            [
                Printed {
                    label: "pgbench: naive inbox (BEGIN; …)".into(),
                    n: 4,
                    rate: Some(5000.0),
                    wal: Some(390.0),
                    exact: true,
                },
                Printed {
                    label: "ours: x".into(),
                    n: 4,
                    rate: None,
                    wal: None,
                    exact: false,
                },
            ]
        );
    }
}
