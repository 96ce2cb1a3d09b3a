//! Which payloads fingerprint the same: every row of the README's table (section "Keys and
//! fingerprints") checked three ways.
//!
//! * `Fingerprint::of` on the two decoded messages (no database);
//! * through the dispatcher, on PostgreSQL and SQLite: the first spelling is processed, the
//!   second, under the same key, is a **duplicate** (same fingerprint), a **conflict**
//!   (different fingerprint), or refused as a **malformed** payload before any key is read;
//! * the README holds each row, word for word, as this file renders it.
//!
//! The message type has one field of each kind the table speaks of; each row changes one
//! member of a base payload (or the whole payload's layout) in its two spellings.

#![allow(missing_docs)]

use inbox_runtime::{Fingerprint, Message};
use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, Message)]
#[message(name = "fp.sample")]
pub struct Sample {
    #[message(key)]
    pub id: String,
    pub int: i64,
    pub float: f64,
    pub value: serde_json::Value,
    pub text: String,
    pub opt: Option<String>,
    #[serde(default)]
    pub count: u32,
    pub list: Vec<i64>,
    pub uuid: uuid::Uuid,
}

/// The same shape under another routing name, for the same consumer.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, Message)]
#[message(name = "fp.renamed")]
pub struct Renamed {
    #[message(key)]
    pub id: String,
    pub int: i64,
    pub float: f64,
    pub value: serde_json::Value,
    pub text: String,
    pub opt: Option<String>,
    #[serde(default)]
    pub count: u32,
    pub list: Vec<i64>,
    pub uuid: uuid::Uuid,
}

/// The base payload's members, in declaration order; `{key}` is replaced by the row's key.
const BASE: &[(&str, &str)] = &[
    ("id", r#""{key}""#),
    ("int", "1"),
    ("float", "1.5"),
    ("value", r#"{"a":1}"#),
    ("text", r#""café""#),
    ("opt", r#""x""#),
    ("count", "3"),
    ("list", "[1,2]"),
    ("uuid", r#""0190c0de-0000-7000-8000-00000000abcd""#),
];

/// A change to the base payload.
#[derive(Debug, Clone, Copy)]
enum Edit {
    /// This member's JSON text.
    Set(&'static str, &'static str),
    /// No such member.
    Remove(&'static str),
    /// One more member, at the end (possibly repeating a name).
    Add(&'static str, &'static str),
    /// The members in reverse order.
    Reverse,
    /// Spaces, tabs and newlines around every token.
    Spaced,
}

use Edit::{Add, Remove, Reverse, Set, Spaced};

/// What the second spelling is, next to the first.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Expect {
    /// Same fingerprint: a second delivery is a duplicate.
    Same,
    /// Another fingerprint: a second delivery under the same key is a conflict.
    Different,
    /// The second spelling does not decode: refused as a malformed payload.
    Malformed,
}

impl Expect {
    fn cell(self) -> &'static str {
        match self {
            Expect::Same => "same: duplicate",
            Expect::Different => "different: **conflict**",
            Expect::Malformed => "second is **malformed**",
        }
    }
}

/// One row: the field it is about, each spelling as the README shows it and as edits of the
/// base payload, and the result.
struct Row {
    what: &'static str,
    shown: (&'static str, &'static str),
    edits: (&'static [Edit], &'static [Edit]),
    expect: Expect,
}

const fn row(
    what: &'static str,
    shown: (&'static str, &'static str),
    edits: (&'static [Edit], &'static [Edit]),
    expect: Expect,
) -> Row {
    Row {
        what,
        shown,
        edits,
        expect,
    }
}

const ROWS: &[Row] = &[
    row(
        "member order",
        (r#"{"id":…,"int":1,…}"#, r#"{…,"int":1,"id":…}"#),
        (&[], &[Reverse]),
        Expect::Same,
    ),
    row(
        "whitespace between tokens",
        (
            r#"{"id":"k","int":1,…}"#,
            "{ \"id\" : \"k\" ,\\n\\t\"int\" : 1 , … }",
        ),
        (&[], &[Spaced]),
        Expect::Same,
    ),
    row(
        "`String`: an escape for a character",
        (r#""café""#, r#""caf\u00e9""#),
        (
            &[Set("text", r#""café""#)],
            &[Set("text", r#""caf\u00e9""#)],
        ),
        Expect::Same,
    ),
    row(
        "`String`: escaped `/`, a surrogate pair",
        (r#""a/b 😀""#, r#""a\/b \ud83d\ude00""#),
        (
            &[Set("text", r#""a/b 😀""#)],
            &[Set("text", r#""a\/b \ud83d\ude00""#)],
        ),
        Expect::Same,
    ),
    row(
        "`String`: composed vs decomposed (no Unicode normalisation)",
        (r#""café""#, r#""cafe\u0301""#),
        (
            &[Set("text", r#""café""#)],
            &[Set("text", r#""cafe\u0301""#)],
        ),
        Expect::Different,
    ),
    row(
        "`i64`: another spelling of 1",
        ("1", "1.0"),
        (&[Set("int", "1")], &[Set("int", "1.0")]),
        Expect::Malformed,
    ),
    row(
        "`i64`: an exponent",
        ("1", "1e0"),
        (&[Set("int", "1")], &[Set("int", "1e0")]),
        Expect::Malformed,
    ),
    row(
        "`i64`: minus zero (JSON parses `-0` as a float)",
        ("0", "-0"),
        (&[Set("int", "0")], &[Set("int", "-0")]),
        Expect::Malformed,
    ),
    row(
        "`i64`: integers are exact, also above 2^53",
        ("9007199254740993", "9007199254740992"),
        (
            &[Set("int", "9007199254740993")],
            &[Set("int", "9007199254740992")],
        ),
        Expect::Different,
    ),
    row(
        "`f64`: an integer spelling",
        ("1", "1.0"),
        (&[Set("float", "1")], &[Set("float", "1.0")]),
        Expect::Same,
    ),
    row(
        "`f64`: an exponent",
        ("1", "1e0"),
        (&[Set("float", "1")], &[Set("float", "1e0")]),
        Expect::Same,
    ),
    row(
        "`f64`: digits beyond a double's precision",
        ("0.1", "0.10000000000000001"),
        (
            &[Set("float", "0.1")],
            &[Set("float", "0.10000000000000001")],
        ),
        Expect::Same,
    ),
    row(
        "`f64`: integers above 2^53 round to the same double",
        ("9007199254740993", "9007199254740992"),
        (
            &[Set("float", "9007199254740993")],
            &[Set("float", "9007199254740992")],
        ),
        Expect::Same,
    ),
    row(
        "`f64`: minus zero",
        ("0", "-0.0"),
        (&[Set("float", "0")], &[Set("float", "-0.0")]),
        Expect::Same,
    ),
    row(
        "`serde_json::Value`: an integer and a float of the same value",
        ("1", "1.0"),
        (&[Set("value", "1")], &[Set("value", "1.0")]),
        Expect::Same,
    ),
    row(
        "`serde_json::Value`: an exponent",
        ("100", "1e2"),
        (&[Set("value", "100")], &[Set("value", "1e2")]),
        Expect::Same,
    ),
    row(
        "`serde_json::Value`: a fraction makes a big integer a double",
        ("9007199254740993", "9007199254740993.0"),
        (
            &[Set("value", "9007199254740993")],
            &[Set("value", "9007199254740993.0")],
        ),
        Expect::Different,
    ),
    row(
        "`serde_json::Value`: integers beyond 64 bits become doubles",
        ("18446744073709551616", "18446744073709551617"),
        (
            &[Set("value", "18446744073709551616")],
            &[Set("value", "18446744073709551617")],
        ),
        Expect::Same,
    ),
    row(
        "`serde_json::Value`: member order inside",
        (r#"{"a":1,"b":2}"#, r#"{"b":2,"a":1}"#),
        (
            &[Set("value", r#"{"a":1,"b":2}"#)],
            &[Set("value", r#"{"b":2,"a":1}"#)],
        ),
        Expect::Same,
    ),
    row(
        "`serde_json::Value`: a repeated member (the last one counts)",
        (r#"{"a":2}"#, r#"{"a":1,"a":2}"#),
        (
            &[Set("value", r#"{"a":2}"#)],
            &[Set("value", r#"{"a":1,"a":2}"#)],
        ),
        Expect::Same,
    ),
    row(
        "`serde_json::Value`: `null` vs missing",
        (r#""value":null"#, "(no member)"),
        (&[Set("value", "null")], &[Remove("value")]),
        Expect::Malformed,
    ),
    row(
        "`Vec<i64>`: element order",
        ("[1,2]", "[2,1]"),
        (&[Set("list", "[1,2]")], &[Set("list", "[2,1]")]),
        Expect::Different,
    ),
    row(
        "`Option<String>`: `null` vs missing",
        (r#""opt":null"#, "(no member)"),
        (&[Set("opt", "null")], &[Remove("opt")]),
        Expect::Same,
    ),
    row(
        "`Option<String>`: a value vs `null`",
        (r#""opt":"x""#, r#""opt":null"#),
        (&[Set("opt", r#""x""#)], &[Set("opt", "null")]),
        Expect::Different,
    ),
    row(
        "`#[serde(default)] u32`: the default vs missing",
        (r#""count":0"#, "(no member)"),
        (&[Set("count", "0")], &[Remove("count")]),
        Expect::Same,
    ),
    row(
        "`uuid::Uuid`: upper case, no hyphens",
        (
            r#""0190c0de-0000-7000-8000-00000000abcd""#,
            r#""0190C0DE00007000800000000000ABCD""#,
        ),
        (
            &[Set("uuid", r#""0190c0de-0000-7000-8000-00000000abcd""#)],
            &[Set("uuid", r#""0190C0DE00007000800000000000ABCD""#)],
        ),
        Expect::Same,
    ),
    row(
        "a member the type does not declare",
        ("(none)", r#""note":"hi""#),
        (&[], &[Add("note", r#""hi""#)]),
        Expect::Same,
    ),
    row(
        "an undeclared member's value",
        (r#""note":1"#, r#""note":2"#),
        (&[Add("note", "1")], &[Add("note", "2")]),
        Expect::Same,
    ),
    row(
        "a declared member twice",
        (r#""int":1"#, r#""int":1,"int":1"#),
        (&[], &[Add("int", "1")]),
        Expect::Malformed,
    ),
    row(
        "any value changed",
        (r#""int":1"#, r#""int":2"#),
        (&[Set("int", "1")], &[Set("int", "2")]),
        Expect::Different,
    ),
];

/// The base payload with `edits`, under `key`.
fn payload(key: &str, edits: &[Edit]) -> String {
    let mut members: Vec<(&str, String)> = BASE
        .iter()
        .map(|(name, value)| (*name, value.replace("{key}", key)))
        .collect();
    let mut spaced = false;
    for edit in edits {
        match *edit {
            Set(name, value) => {
                members
                    .iter_mut()
                    .find(|(n, _)| *n == name)
                    .expect("a base member")
                    .1 = value.to_owned();
            }
            Remove(name) => members.retain(|(n, _)| *n != name),
            Add(name, value) => members.push((name, value.to_owned())),
            Reverse => members.reverse(),
            Spaced => spaced = true,
        }
    }
    let (colon, comma, open, close) = if spaced {
        (" : ", " ,\n\t", "{ ", " }")
    } else {
        (":", ",", "{", "}")
    };
    let body: Vec<String> = members
        .iter()
        .map(|(name, value)| format!("\"{name}\"{colon}{value}"))
        .collect();
    format!("{open}{}{close}", body.join(comma))
}

/// The row as the README's table shows it.
fn rendered(row: &Row) -> String {
    format!(
        "| {} | `{}` | `{}` | {} |",
        row.what,
        row.shown.0,
        row.shown.1,
        row.expect.cell()
    )
}

/// The key of row `index`.
fn key(index: usize) -> String {
    format!("row-{index}")
}

#[test]
fn each_row_through_fingerprint_of() {
    let mut wrong = Vec::new();
    for (index, row) in ROWS.iter().enumerate() {
        let key = key(index);
        let (a, b) = (payload(&key, row.edits.0), payload(&key, row.edits.1));
        let first: Sample = serde_json::from_str(&a).unwrap_or_else(|e| panic!("{a}: {e}"));
        let found = match serde_json::from_str::<Sample>(&b) {
            Err(_) => Expect::Malformed,
            Ok(second) => {
                let fa = Fingerprint::of(Sample::NAME, &first).unwrap();
                let fb = Fingerprint::of(Sample::NAME, &second).unwrap();
                if fa == fb {
                    Expect::Same
                } else {
                    Expect::Different
                }
            }
        };
        if found != row.expect {
            wrong.push(format!(
                "{}: expected {:?}, found {found:?}\n  {a}\n  {b}",
                row.what, row.expect
            ));
        }
    }
    assert!(wrong.is_empty(), "{}", wrong.join("\n"));
}

/// The rows of the table in `text` that it lacks (`prefix` is stripped from each line first).
fn missing_rows(text: &str, prefix: &str) -> Vec<String> {
    ROWS.iter()
        .map(rendered)
        .filter(|line| {
            !text
                .lines()
                .any(|l| l.trim_start().strip_prefix(prefix) == Some(line.as_str()))
        })
        .collect()
}

#[test]
fn the_readme_shows_every_row() {
    let readme = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../README.md"))
        .expect("read README.md");
    let missing = missing_rows(&readme, "");
    assert!(
        missing.is_empty(),
        "README.md lacks these rows of the fingerprint table:\n{}",
        missing.join("\n")
    );
}

#[test]
fn the_fingerprint_docs_show_every_row() {
    let source = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../inbox-runtime/src/types/fingerprint.rs"
    ))
    .expect("read fingerprint.rs");
    let missing = missing_rows(&source, "/// ");
    assert!(
        missing.is_empty(),
        "the docs of `Fingerprint` lack these rows of the table:\n{}",
        missing.join("\n")
    );
}

/// The exact canonical text and fingerprint of the base payload: what the inbox stores for it.
#[test]
fn the_base_payload_canonically() {
    let msg: Sample = serde_json::from_str(&payload("k", &[])).unwrap();
    // Members sorted, no whitespace, the UUID in its hyphenated lower-case form:
    //   {"count":3,"float":1.5,"id":"k","int":1,"list":[1,2],"opt":"x","text":"café",
    //    "uuid":"0190c0de-0000-7000-8000-00000000abcd","value":{"a":1}}
    // and the fingerprint is SHA-256 over `fp.sample`, a newline and that text (computed with
    // `printf 'fp.sample\n%s' '<text>' | sha256sum`, not with this crate).
    assert_eq!(
        Fingerprint::of(Sample::NAME, &msg).unwrap().to_hex(),
        "df0141799a82e75822b5127d65273a6973757d8ce5cc061438c1e089c812515b"
    );
}

inbox_tests::backend_matrix! {
    use inbox_runtime::{DispatchError, Dispatcher, Envelope, Error, Outcome, handler};
    use inbox_tests::effect;

    #[inbox_runtime::idempotent(consumer = "fp")]
    async fn apply_sample(conn: &mut Conn, msg: Sample) -> Result<(), sqlx::Error> {
        sqlx::query(APPLY_EFFECT).bind(&msg.id).bind(1_i64).execute(conn).await?;
        Ok(())
    }

    #[inbox_runtime::idempotent(consumer = "fp")]
    async fn apply_renamed(conn: &mut Conn, msg: Renamed) -> Result<(), sqlx::Error> {
        sqlx::query(APPLY_EFFECT).bind(&msg.id).bind(1_i64).execute(conn).await?;
        Ok(())
    }

    fn dispatcher(pool: Pool) -> Dispatcher<Db> {
        Dispatcher::from_handlers(pool, [handler!(apply_sample), handler!(apply_renamed)])
            .expect("two handlers")
    }

    /// Every row: the first spelling processed, the second a duplicate, a conflict, or malformed.
    #[tokio::test]
    async fn each_row_through_the_dispatcher() {
        let (pool, _guard) = fixture().await;
        let dispatcher = dispatcher(pool.clone());
        let mut wrong = Vec::new();
        for (index, row) in ROWS.iter().enumerate() {
            let key = key(index);
            let (a, b) = (payload(&key, row.edits.0), payload(&key, row.edits.1));
            let first = dispatcher.dispatch(&Envelope::new(Sample::NAME, a.clone())).await;
            let first = first.unwrap_or_else(|e| panic!("{}: {a}: {e}", row.what));
            assert!(
                matches!(first[0].result, Ok(Outcome::Processed(()))),
                "{}: first spelling not processed: {:?}", row.what, first[0].result
            );
            let second = dispatcher.dispatch(&Envelope::new(Sample::NAME, b.clone())).await;
            let found = match &second {
                Err(DispatchError::Decode { .. }) => Expect::Malformed,
                Ok(outcomes) => match &outcomes[0].result {
                    Ok(Outcome::Duplicate) => Expect::Same,
                    Err(Error::Conflict(_)) => Expect::Different,
                    other => panic!("{}: unexpected {other:?}", row.what),
                },
                Err(other) => panic!("{}: unexpected {other}", row.what),
            };
            if found != row.expect {
                wrong.push(format!("{}: expected {:?}, found {found:?}\n  {a}\n  {b}", row.what, row.expect));
            }
            // Applied once, whatever the second spelling was.
            assert_eq!(effect(&pool, &key).await, Some((1, 1)), "{}", row.what);
        }
        assert!(wrong.is_empty(), "{}", wrong.join("\n"));
    }

    /// The routing name is part of the fingerprint: the same payload under another message
    /// name, for the same consumer and key, is a conflict.
    #[tokio::test]
    async fn another_message_name_is_a_conflict() {
        let (pool, _guard) = fixture().await;
        let dispatcher = dispatcher(pool.clone());
        let body = payload("named", &[]);
        let first = dispatcher.dispatch(&Envelope::new(Sample::NAME, body.clone())).await.unwrap();
        assert!(matches!(first[0].result, Ok(Outcome::Processed(()))), "{:?}", first[0].result);
        let second = dispatcher.dispatch(&Envelope::new(Renamed::NAME, body)).await.unwrap();
        let Err(Error::Conflict(conflict)) = &second[0].result else {
            panic!("expected a conflict: {:?}", second[0].result);
        };
        let sample: Sample = serde_json::from_str(&payload("named", &[])).unwrap();
        let renamed: Renamed = serde_json::from_str(&payload("named", &[])).unwrap();
        assert_eq!(conflict.stored, Fingerprint::of(Sample::NAME, &sample).unwrap());
        assert_eq!(conflict.received, Fingerprint::of(Renamed::NAME, &renamed).unwrap());
        assert_eq!(effect(&pool, "named").await, Some((1, 1)));
    }
}

/// A message that refuses undeclared members, as the README suggests.
#[derive(Debug, Clone, Serialize, Deserialize, Message)]
#[message(name = "fp.strict")]
#[serde(deny_unknown_fields)]
pub struct Strict {
    #[message(key)]
    pub id: String,
}

#[test]
fn deny_unknown_fields_makes_undeclared_members_malformed() {
    assert!(serde_json::from_str::<Strict>(r#"{"id":"k"}"#).is_ok());
    let error = serde_json::from_str::<Strict>(r#"{"id":"k","note":1}"#).unwrap_err();
    assert_eq!(
        error.to_string(),
        "unknown field `note`, expected `id` at line 1 column 16"
    );
}
