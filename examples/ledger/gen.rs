//! Deterministic generator of the ledger demo's sample stream.
//!
//! ```text
//! cargo run --example ledger-gen -- [--seed N] [--out DIR]
//! ```
//!
//! Writes `DIR/payments.jsonl` (default `DIR`: `examples/ledger/data`, next to
//! this file) and `DIR/expected.json`, the ground truth that the `ledger` demo
//! checks its database against.
//!
//! The stream is one JSON object per line,
//! `{"message":"payments.captured","payload":{"event_id":"<uuid>","account_id":"acct-0042","amount_cents":1234}}`,
//! with two message names: `payments.captured` credits the account,
//! `payments.refunded` debits it. Besides first deliveries it holds
//!
//! * redeliveries of earlier events: byte-identical copies, and copies whose
//!   payload fields are reordered, whose whitespace is reformatted, whose
//!   top-level keys are swapped, whose strings use `\u` escapes or whose
//!   event id is in upper case — the same values, so each one must count as a
//!   duplicate;
//! * conflicts: an earlier event id with a different amount, which must not be
//!   applied;
//! * malformed lines of several kinds (invalid JSON, truncated line, missing,
//!   null, empty or non-UUID `event_id`, wrong type for the amount, missing
//!   payload, unknown message name), each of which must be rejected.
//!
//! `expected.json` holds `{"seed":N,"lines":N,"processed":N,"duplicates":N,
//! "conflicts":N,"rejected":N,"balances":{"acct-0000":123,...}}`, where the
//! balances sum the applied events only (the first delivery of each event id
//! wins), and list every account that at least one applied event touched.
//!
//! The output depends on the seed only: the random stream comes from
//! [`rand_chacha::ChaCha8Rng`] (whose output is fixed for a given seed across
//! versions), seeded with the seed's little-endian bytes, and every derived
//! choice (ranges, shuffles, UUIDs) is computed here from its raw `u64`s rather
//! than with a library's distribution code, which may change between releases.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::PathBuf;
use std::process::ExitCode;

use clap::Parser;
use rand_chacha::ChaCha8Rng;
use rand_chacha::rand_core::{Rng as _, SeedableRng as _};
use serde::Serialize;
use uuid::Uuid;

/// Number of distinct accounts (`acct-0000` ..).
const ACCOUNTS: u64 = 300;
/// First deliveries of distinct events (each one is applied).
const NEW_EVENTS: usize = 26_000;
/// Redeliveries of earlier events (each one is a duplicate).
const REDELIVERIES: usize = 3_600;
/// Earlier event ids sent again with a different amount.
const CONFLICTS: usize = 16;
/// Lines of each malformed kind.
const MALFORMED_PER_KIND: usize = 2;

#[derive(Parser, Debug)]
#[command(about = "Writes the ledger demo's deterministic sample stream and its ground truth")]
struct Args {
    /// Seed of the random stream: the same seed gives byte-identical files.
    #[arg(long, default_value_t = 42)]
    seed: u64,
    /// Output directory (created if missing).
    #[arg(long, default_value = concat!(env!("CARGO_MANIFEST_DIR"), "/ledger/data"))]
    out: PathBuf,
}

/// Reproducible random choices built on `ChaCha8Rng::next_u64` alone.
struct Gen(ChaCha8Rng);

impl Gen {
    fn new(seed: u64) -> Self {
        let mut bytes = [0_u8; 32];
        bytes[..8].copy_from_slice(&seed.to_le_bytes());
        Self(ChaCha8Rng::from_seed(bytes))
    }

    /// Uniform in `0..n` (`n > 0`), by rejection so there is no modulo bias.
    fn below(&mut self, n: u64) -> u64 {
        assert!(n > 0);
        let zone = u64::MAX - (u64::MAX % n);
        loop {
            let x = self.0.next_u64();
            if x < zone {
                return x % n;
            }
        }
    }

    /// Uniform in `lo..=hi`.
    fn range(&mut self, lo: u64, hi: u64) -> u64 {
        lo + self.below(hi - lo + 1)
    }

    fn index(&mut self, len: usize) -> usize {
        usize::try_from(self.below(len as u64)).expect("index fits usize")
    }

    /// True with probability `num / den`.
    fn chance(&mut self, num: u64, den: u64) -> bool {
        self.below(den) < num
    }

    fn shuffle<T>(&mut self, items: &mut [T]) {
        for i in (1..items.len()).rev() {
            let j = self.index(i + 1);
            items.swap(i, j);
        }
    }

    fn pick<'a, T>(&mut self, items: &'a [T]) -> &'a T {
        &items[self.index(items.len())]
    }

    fn uuid(&mut self) -> Uuid {
        let mut bytes = [0_u8; 16];
        bytes[..8].copy_from_slice(&self.0.next_u64().to_le_bytes());
        bytes[8..].copy_from_slice(&self.0.next_u64().to_le_bytes());
        uuid::Builder::from_random_bytes(bytes).into_uuid()
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kind {
    Captured,
    Refunded,
}

impl Kind {
    fn name(self) -> &'static str {
        match self {
            Kind::Captured => "payments.captured",
            Kind::Refunded => "payments.refunded",
        }
    }

    fn signed(self, amount: i64) -> i64 {
        match self {
            Kind::Captured => amount,
            Kind::Refunded => -amount,
        }
    }
}

#[derive(Clone, Debug)]
struct Event {
    kind: Kind,
    id: Uuid,
    account: String,
    amount: i64,
}

/// What one line of the stream does.
#[derive(Clone, Copy, Debug)]
enum Action {
    New,
    Redeliver,
    Conflict,
    Malformed(Malformed),
}

#[derive(Clone, Copy, Debug)]
enum Malformed {
    InvalidJson,
    Truncated,
    MissingEventId,
    NullEventId,
    EmptyEventId,
    NotAUuid,
    WrongAmountType,
    MissingPayload,
    UnknownMessage,
}

const MALFORMED_KINDS: [Malformed; 9] = [
    Malformed::InvalidJson,
    Malformed::Truncated,
    Malformed::MissingEventId,
    Malformed::NullEventId,
    Malformed::EmptyEventId,
    Malformed::NotAUuid,
    Malformed::WrongAmountType,
    Malformed::MissingPayload,
    Malformed::UnknownMessage,
];

/// Whitespace and layout of one rendered line.
#[derive(Clone, Copy, Debug, Default)]
struct Layout {
    /// Order of the payload's fields: indexes into `[event_id, account_id, amount_cents]`.
    order: [usize; 3],
    /// `payload` before `message`.
    payload_first: bool,
    /// Escape one character of `account_id` as `\uXXXX`.
    escape_account: Option<usize>,
    /// Write the event id's hex digits in upper case (the same UUID).
    upper_id: bool,
    lead: &'static str,
    open: &'static str,
    colon: &'static str,
    comma: &'static str,
    close: &'static str,
    trail: &'static str,
}

impl Layout {
    fn canonical() -> Self {
        Self {
            order: [0, 1, 2],
            ..Self::default()
        }
    }
}

/// A JSON string literal, with the character at `escape` (if any) written as `\uXXXX`.
fn json_str(s: &str, escape: Option<usize>) -> String {
    let mut out = String::from("\"");
    for (i, c) in s.chars().enumerate() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            c if Some(i) == escape || c.is_control() => {
                write!(out, "\\u{:04x}", u32::from(c)).expect("write to String");
            }
            c => out.push(c),
        }
    }
    out.push('"');
    out
}

/// Renders an object from already-rendered `(key, value)` pairs.
fn object(fields: &[(&str, String)], l: &Layout) -> String {
    let body = fields
        .iter()
        .map(|(k, v)| format!("{}:{}{v}", json_str(k, None), l.colon))
        .collect::<Vec<_>>()
        .join(&format!(",{}", l.comma));
    format!("{{{}{body}{}}}", l.open, l.close)
}

fn envelope(message: &str, payload: String, l: &Layout) -> String {
    let message = ("message", json_str(message, None));
    let payload = ("payload", payload);
    let fields = if l.payload_first {
        [payload, message]
    } else {
        [message, payload]
    };
    format!("{}{}{}", l.lead, object(&fields, l), l.trail)
}

fn render(ev: &Event, l: &Layout) -> String {
    let id = if l.upper_id {
        ev.id
            .hyphenated()
            .encode_upper(&mut Uuid::encode_buffer())
            .to_owned()
    } else {
        ev.id.to_string()
    };
    let all = [
        ("event_id", json_str(&id, None)),
        ("account_id", json_str(&ev.account, l.escape_account)),
        ("amount_cents", ev.amount.to_string()),
    ];
    let fields: Vec<_> = l.order.iter().map(|&i| all[i].clone()).collect();
    envelope(ev.kind.name(), object(&fields, l), l)
}

/// A layout that differs from the canonical one but encodes the same values.
fn reformatted(g: &mut Gen, ev: &Event) -> Layout {
    const SPACES: [&str; 4] = ["", " ", "  ", "\t"];
    loop {
        let mut l = Layout::canonical();
        if g.chance(1, 2) {
            g.shuffle(&mut l.order);
        }
        l.payload_first = g.chance(1, 4);
        if g.chance(1, 4) {
            l.escape_account = Some(g.index(ev.account.chars().count()));
        }
        l.upper_id = g.chance(1, 8);
        if g.chance(1, 2) {
            l.lead = *g.pick(&SPACES);
            l.open = *g.pick(&SPACES);
            l.colon = *g.pick(&SPACES);
            l.comma = *g.pick(&SPACES);
            l.close = *g.pick(&SPACES);
            l.trail = *g.pick(&SPACES[..3]);
        }
        if render(ev, &l) != render(ev, &Layout::canonical()) {
            return l;
        }
    }
}

fn malformed_line(g: &mut Gen, kind: Malformed, nth: usize, ev: &Event) -> String {
    let c = Layout::canonical();
    let id = json_str(&ev.id.to_string(), None);
    let account = json_str(&ev.account, None);
    let amount = ev.amount.to_string();
    let payload = |event_id: Option<&str>, amount: &str| {
        let mut fields = Vec::new();
        if let Some(event_id) = event_id {
            fields.push(("event_id", event_id.to_owned()));
        }
        fields.push(("account_id", account.clone()));
        fields.push(("amount_cents", amount.to_owned()));
        object(&fields, &c)
    };
    match kind {
        Malformed::InvalidJson => {
            let line = render(ev, &c);
            if nth.is_multiple_of(2) {
                // A trailing comma inside the payload.
                line.replacen(&format!("{amount}}}"), &format!("{amount},}}"), 1)
            } else {
                // Single-quoted strings.
                line.replace('"', "'")
            }
        }
        Malformed::Truncated => {
            let line = render(ev, &c);
            let cut = g.range(line.len() as u64 / 3, line.len() as u64 - 2);
            line[..usize::try_from(cut).expect("fits usize")].to_owned()
        }
        Malformed::MissingEventId => envelope(ev.kind.name(), payload(None, &amount), &c),
        Malformed::NullEventId => envelope(ev.kind.name(), payload(Some("null"), &amount), &c),
        Malformed::EmptyEventId => envelope(ev.kind.name(), payload(Some("\"\""), &amount), &c),
        Malformed::NotAUuid => {
            let bogus = json_str(&format!("evt-{}", g.range(1, 99_999)), None);
            envelope(ev.kind.name(), payload(Some(&bogus), &amount), &c)
        }
        Malformed::WrongAmountType => {
            let wrong = if nth.is_multiple_of(2) {
                json_str(&amount, None)
            } else {
                format!("{amount}.5")
            };
            envelope(ev.kind.name(), payload(Some(&id), &wrong), &c)
        }
        Malformed::MissingPayload => object(&[("message", json_str(ev.kind.name(), None))], &c),
        Malformed::UnknownMessage => {
            let name = ["payments.chargeback", "payments.captured.v2"][nth % 2];
            envelope(name, payload(Some(&id), &amount), &c)
        }
    }
}

#[derive(Serialize)]
struct Expected {
    seed: u64,
    lines: usize,
    processed: u64,
    duplicates: u64,
    conflicts: u64,
    rejected: u64,
    balances: BTreeMap<String, i64>,
}

struct Output {
    lines: Vec<String>,
    expected: Expected,
}

/// Every action of a stream, shuffled by `g`, a new event first (redeliveries and conflicts
/// need an earlier one).
fn shuffled_actions(g: &mut Gen) -> Vec<Action> {
    let mut actions = Vec::new();
    actions.extend(std::iter::repeat_n(Action::New, NEW_EVENTS));
    actions.extend(std::iter::repeat_n(Action::Redeliver, REDELIVERIES));
    actions.extend(std::iter::repeat_n(Action::Conflict, CONFLICTS));
    for kind in MALFORMED_KINDS {
        actions.extend(std::iter::repeat_n(
            Action::Malformed(kind),
            MALFORMED_PER_KIND,
        ));
    }
    g.shuffle(&mut actions);
    // Redeliveries and conflicts need an earlier event: start with a new one.
    let first_new = actions
        .iter()
        .position(|a| matches!(a, Action::New))
        .expect("there are new events");
    actions.swap(0, first_new);
    actions
}

/// A new well-formed event: mostly captures, some refunds, on one of the accounts.
fn new_event(g: &mut Gen) -> Event {
    let kind = if g.chance(4, 5) {
        Kind::Captured
    } else {
        Kind::Refunded
    };
    let amount = match kind {
        Kind::Captured => g.range(100, 99_999),
        Kind::Refunded => g.range(100, 25_000),
    };
    Event {
        kind,
        id: g.uuid(),
        account: format!("acct-{:04}", g.below(ACCOUNTS)),
        amount: i64::try_from(amount).expect("small amount"),
    }
}

fn generate(seed: u64) -> Output {
    let mut g = Gen::new(seed);

    let actions = shuffled_actions(&mut g);
    let mut emitted: Vec<Event> = Vec::with_capacity(NEW_EVENTS);
    let mut conflicted = std::collections::HashSet::new();
    let mut malformed_seen = BTreeMap::<usize, usize>::new();
    let mut lines = Vec::with_capacity(actions.len());
    let mut expected = Expected {
        seed,
        lines: 0,
        processed: 0,
        duplicates: 0,
        conflicts: 0,
        rejected: 0,
        balances: BTreeMap::new(),
    };

    for action in actions {
        match action {
            Action::New => {
                let ev = new_event(&mut g);
                lines.push(render(&ev, &Layout::canonical()));
                *expected.balances.entry(ev.account.clone()).or_default() +=
                    ev.kind.signed(ev.amount);
                expected.processed += 1;
                emitted.push(ev);
            }
            Action::Redeliver => {
                // Most redeliveries follow their original closely; some come much later.
                let ev = if g.chance(7, 10) {
                    let recent = emitted.len().min(200);
                    &emitted[emitted.len() - 1 - g.index(recent)]
                } else {
                    g.pick(&emitted)
                };
                let layout = if g.chance(1, 2) {
                    Layout::canonical()
                } else {
                    reformatted(&mut g, ev)
                };
                lines.push(render(ev, &layout));
                expected.duplicates += 1;
            }
            Action::Conflict => {
                let mut ev = loop {
                    let i = g.index(emitted.len());
                    if conflicted.insert(i) {
                        break emitted[i].clone();
                    }
                };
                let delta = i64::try_from(g.range(1, 500)).expect("small delta");
                ev.amount = if ev.amount > delta && g.chance(1, 2) {
                    ev.amount - delta
                } else {
                    ev.amount + delta
                };
                lines.push(render(&ev, &Layout::canonical()));
                expected.conflicts += 1;
            }
            Action::Malformed(kind) => {
                let nth = malformed_seen.entry(kind as usize).or_default();
                // A fresh event that is never delivered well-formed.
                let ev = new_event(&mut g);
                lines.push(malformed_line(&mut g, kind, *nth, &ev));
                *nth += 1;
                expected.rejected += 1;
            }
        }
    }
    expected.lines = lines.len();
    Output { lines, expected }
}

/// The two files' contents for `seed`: `(payments.jsonl, expected.json)`.
fn files(seed: u64) -> (String, String, Expected) {
    let Output { lines, expected } = generate(seed);
    let mut jsonl = lines.join("\n");
    jsonl.push('\n');
    let mut json = serde_json::to_string_pretty(&expected).expect("serializable");
    json.push('\n');
    (jsonl, json, expected)
}

fn main() -> ExitCode {
    let args = Args::parse();
    let (jsonl, json, expected) = files(args.seed);
    let write = || -> std::io::Result<()> {
        std::fs::create_dir_all(&args.out)?;
        std::fs::write(args.out.join("payments.jsonl"), jsonl)?;
        std::fs::write(args.out.join("expected.json"), json)?;
        Ok(())
    };
    if let Err(err) = write() {
        eprintln!("ledger-gen: cannot write to {}: {err}", args.out.display());
        return ExitCode::from(2);
    }
    println!(
        "wrote {} lines to {}: processed={} duplicates={} conflicts={} rejected={} accounts={}",
        expected.lines,
        args.out.display(),
        expected.processed,
        expected.duplicates,
        expected.conflicts,
        expected.rejected,
        expected.balances.len()
    );
    ExitCode::SUCCESS
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The committed sample is exactly what the default seed generates.
    #[test]
    fn committed_sample_is_reproducible() {
        let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/ledger/data");
        let (jsonl, json, _) = files(42);
        let committed = std::fs::read_to_string(format!("{dir}/expected.json")).unwrap();
        assert!(
            json == committed,
            "expected.json differs from `ledger-gen --seed 42`"
        );
        let committed = std::fs::read_to_string(format!("{dir}/payments.jsonl")).unwrap();
        assert!(
            jsonl == committed,
            "payments.jsonl differs from `ledger-gen --seed 42`"
        );
    }

    #[test]
    fn counts_add_up() {
        let Output { lines, expected } = generate(7);
        assert_eq!(lines.len(), expected.lines);
        assert_eq!(expected.processed, NEW_EVENTS as u64);
        assert_eq!(expected.duplicates, REDELIVERIES as u64);
        assert_eq!(expected.conflicts, CONFLICTS as u64);
        assert_eq!(
            expected.rejected,
            (MALFORMED_KINDS.len() * MALFORMED_PER_KIND) as u64
        );
        assert_eq!(expected.balances.len(), ACCOUNTS as usize);
        assert!(lines.iter().all(|l| !l.contains('\n')));
    }
}
