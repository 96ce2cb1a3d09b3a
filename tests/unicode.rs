//! One Unicode rule: text that is not Unicode is refused wherever it sits in a payload, whether
//! it arrives as bytes that are not UTF-8 or as a JSON escape that decodes to an unpaired
//! surrogate. Every position of the README's table (section "Bad input") with every spelling,
//! through the dispatcher on each backend: refused with `DispatchError::UnpairedSurrogate` and
//! its exact text, kept whole in `inbox_rejections` as `malformed`, nothing applied; the
//! spellings that are text (a pair, an escaped backslash) processed in every position. The
//! README holds each row of both tables as this file renders it.

#![allow(missing_docs)]

use inbox_runtime::Message;
use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, Message)]
#[message(name = "uni.sample")]
pub struct Sample {
    #[message(key)]
    pub id: String,
    pub text: String,
    pub tags: Vec<String>,
    pub meta: serde_json::Value,
}

/// A place in the payload: the README's words, and the payload with `{k}` for the key's
/// unique part and `{s}` for the spelling.
struct Position {
    what: &'static str,
    payload: &'static str,
}

const POSITIONS: &[Position] = &[
    Position {
        what: "the key",
        payload: r#"{"id":"{k}{s}","text":"t","tags":[],"meta":null}"#,
    },
    Position {
        what: "a declared member",
        payload: r#"{"id":"{k}","text":"a{s}","tags":[],"meta":null}"#,
    },
    Position {
        what: "a declared array",
        payload: r#"{"id":"{k}","text":"t","tags":["a","{s}"],"meta":null}"#,
    },
    Position {
        what: "a declared `Value`, nested",
        payload: r#"{"id":"{k}","text":"t","tags":[],"meta":{"a":["{s}"]}}"#,
    },
    Position {
        what: "a member name in a declared `Value`",
        payload: r#"{"id":"{k}","text":"t","tags":[],"meta":{"{s}":1}}"#,
    },
    Position {
        what: "an undeclared member",
        payload: r#"{"id":"{k}","text":"t","tags":[],"meta":null,"note":"{s}"}"#,
    },
    Position {
        what: "an undeclared member's name",
        payload: r#"{"id":"{k}","text":"t","tags":[],"meta":null,"{s}":1}"#,
    },
    Position {
        what: "an undeclared member, nested arrays",
        payload: r#"{"id":"{k}","text":"t","tags":[],"meta":null,"extra":[1,["{s}"]]}"#,
    },
    Position {
        what: "an undeclared member, a nested member name",
        payload: r#"{"id":"{k}","text":"t","tags":[],"meta":null,"extra":{"a":{"{s}":true}}}"#,
    },
    Position {
        what: "an undeclared member, a nested value",
        payload: r#"{"id":"{k}","text":"t","tags":[],"meta":null,"extra":{"a":{"b":"x{s}"}}}"#,
    },
];

/// A spelling of text that is not Unicode: as written, what it is, and the escape the error
/// names (the first one that has no partner).
struct Spelling {
    text: &'static str,
    what: &'static str,
    escape: &'static str,
}

const SPELLINGS: &[Spelling] = &[
    Spelling {
        text: r"\ud800",
        what: "a high surrogate alone, at the end of the string",
        escape: r"\ud800",
    },
    Spelling {
        text: r"\uDFFF",
        what: "a low surrogate alone (upper-case hex)",
        escape: r"\uDFFF",
    },
    Spelling {
        text: r"\uDbFf\u0041",
        what: "a high surrogate, then an escape that is not a low one",
        escape: r"\uDbFf",
    },
    Spelling {
        text: r"\udc00\ud800",
        what: "a pair in the wrong order",
        escape: r"\udc00",
    },
    Spelling {
        text: r"\ud83dx",
        what: "a high surrogate, then a plain character",
        escape: r"\ud83d",
    },
    Spelling {
        text: r"\ud83d\ud83d\ude00",
        what: "two high surrogates, then a low one",
        escape: r"\ud83d",
    },
];

/// Spellings that are text: processed in every position.
const TEXT: &[(&str, &str)] = &[
    (r"\ud83d\ude00", "a pair (😀)"),
    (r"\\ud800", "an escaped backslash, then the letters `ud800`"),
];

fn payload(position: &Position, key: &str, spelling: &str) -> String {
    position
        .payload
        .replace("{k}", key)
        .replace("{s}", spelling)
}

/// The 1-based column of the spelling in a payload of `position` under `key`.
fn column(position: &Position, key: &str) -> usize {
    let text = payload(position, key, "\u{1}");
    text.find('\u{1}').expect("the spelling's place") + 1
}

fn error_text(line: usize, column: usize, escape: &str) -> String {
    format!(
        "malformed payload for message `uni.sample` at line {line}, column {column}: invalid \
         Unicode: the escape `{escape}` is an unpaired surrogate"
    )
}

/// The README's rows: the positions, then the spellings.
fn rendered() -> Vec<String> {
    let positions = POSITIONS.iter().map(|p| {
        format!(
            "| {} | `{}` | {} |",
            p.what,
            payload(p, "k", "…"),
            column(p, "k")
        )
    });
    let spellings = SPELLINGS
        .iter()
        .map(|s| format!("| `{}` | {} | `{}` |", s.text, s.what, s.escape));
    let text = TEXT
        .iter()
        .map(|(text, what)| format!("| `{text}` | {what} | none: text, processed |"));
    positions.chain(spellings).chain(text).collect()
}

#[test]
fn the_readme_shows_every_row() {
    let readme = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../README.md"))
        .expect("read README.md");
    let missing: Vec<String> = rendered()
        .into_iter()
        .filter(|row| !readme.lines().any(|line| line == row))
        .collect();
    assert!(
        missing.is_empty(),
        "README.md lacks these rows of the Unicode tables:\n{}",
        missing.join("\n")
    );
}

/// serde_json alone, as the runtime builds it: what the dispatcher's own check is for. A
/// `String` refuses an unpaired surrogate, in words that do not say so (a lone low surrogate is
/// a "lone leading surrogate"); members a type does not declare are skipped unread.
#[test]
fn serde_json_alone_skips_undeclared_members_unread() {
    let declared =
        serde_json::from_str::<Sample>(r#"{"id":"k","text":"\uDFFF","tags":[],"meta":null}"#);
    assert_eq!(
        declared.unwrap_err().to_string(),
        "lone leading surrogate in hex escape at line 1 column 24"
    );
    let undeclared = serde_json::from_str::<Sample>(
        r#"{"id":"k","text":"t","tags":[],"meta":null,"note":"\ud800","extra":{"\udc00":1}}"#,
    );
    assert_eq!(undeclared.unwrap().text, "t");
}

inbox_tests::backend_matrix! {
    use inbox_runtime::{DispatchError, Dispatcher, Envelope, Outcome, handler};
    use inbox_tests::{effect, effects};

    #[inbox_runtime::idempotent(consumer = "uni")]
    async fn apply(conn: &mut Conn, msg: Sample) -> Result<(), String> {
        if msg.text == "fail" {
            return Err("refused on purpose".to_owned());
        }
        sqlx::query(APPLY_EFFECT)
            .bind(&msg.id)
            .bind(1_i64)
            .execute(conn)
            .await
            .map_err(|e| e.to_string())?;
        Ok(())
    }

    /// `(reason, detail, kept bytes, real size)` of every rejection, in order.
    async fn rejections(pool: &Pool) -> Vec<(String, String, i64, Option<i64>)> {
        sqlx::query_as(sql(
            "SELECT reason, detail, CAST(length(payload) AS BIGINT), payload_size \
             FROM inbox_rejections ORDER BY id",
        ))
        .fetch_all(pool)
        .await
        .unwrap()
    }

    /// Every position with every spelling: refused, with its position and escape, kept whole
    /// as malformed; nothing claimed, nothing applied.
    #[tokio::test]
    async fn every_position_and_spelling_is_refused_and_kept() {
        let (pool, _guard) = fixture().await;
        let dispatcher = Dispatcher::from_handlers(pool.clone(), [handler!(apply)]).unwrap();
        let mut expected = Vec::new();
        for (p, position) in POSITIONS.iter().enumerate() {
            for (s, spelling) in SPELLINGS.iter().enumerate() {
                let key = format!("p{p}s{s}");
                let body = payload(position, &key, spelling.text);
                let envelope = Envelope::new(Sample::NAME, body.clone());
                let error = dispatcher.dispatch(&envelope).await.unwrap_err();
                let column = column(position, &key);
                assert!(
                    matches!(
                        &error,
                        DispatchError::UnpairedSurrogate { line: 1, column: c, escape, .. }
                            if *c == column && escape == spelling.escape
                    ),
                    "{}, {}: {error:?}",
                    position.what,
                    spelling.what
                );
                assert_eq!(error.to_string(), error_text(1, column, spelling.escape), "{body}");
                dispatcher.record_rejection(&envelope, &error).await.unwrap();
                expected.push((
                    "malformed".to_owned(),
                    error_text(1, column, spelling.escape),
                    i64::try_from(body.len()).unwrap(),
                    None,
                ));
            }
        }
        assert_eq!(expected.len(), 60);
        assert_eq!(rejections(&pool).await, expected);
        assert!(effects(&pool).await.is_empty());
        assert_eq!(inbox_tests::count(&pool, "SELECT COUNT(*) FROM inbox_messages").await, 0);
    }

    /// The spellings that are text are processed in every position.
    #[tokio::test]
    async fn text_spellings_are_processed_everywhere() {
        let (pool, _guard) = fixture().await;
        let dispatcher = Dispatcher::from_handlers(pool.clone(), [handler!(apply)]).unwrap();
        for (p, position) in POSITIONS.iter().enumerate() {
            for (t, (text, _)) in TEXT.iter().enumerate() {
                let key = format!("p{p}t{t}");
                let body = payload(position, &key, text);
                let outcomes = dispatcher.dispatch(&Envelope::new(Sample::NAME, body.clone())).await;
                let outcomes = outcomes.unwrap_or_else(|e| panic!("{body}: {e}"));
                assert!(matches!(outcomes[0].result, Ok(Outcome::Processed(()))), "{body}");
                let id = if p == 0 {
                    serde_json::from_str::<Sample>(&body).unwrap().id
                } else {
                    key
                };
                assert_eq!(effect(&pool, &id).await, Some((1, 1)), "{body}");
            }
        }
        assert_eq!(effects(&pool).await.len(), 20);
        assert!(rejections(&pool).await.is_empty());
    }

    /// Bytes that are not UTF-8 and an unpaired surrogate in one payload: whichever comes
    /// first is reported; lines count.
    #[tokio::test]
    async fn the_first_of_bytes_and_escapes_is_reported() {
        let (pool, _guard) = fixture().await;
        let dispatcher = Dispatcher::from_handlers(pool.clone(), [handler!(apply)]).unwrap();
        let head = br#"{"id":"b","text":"t","tags":[],"meta":null,"note":""#;
        let at = head.len() + 1;

        let mut escape_first = head.to_vec();
        escape_first.extend_from_slice(b"\\ud800\xff\"}");
        let error = dispatcher.dispatch(&Envelope::new(Sample::NAME, escape_first)).await.unwrap_err();
        assert_eq!(error.to_string(), error_text(1, at, r"\ud800"));

        let mut bytes_first = head.to_vec();
        bytes_first.extend_from_slice(b"\xff\\ud800\"}");
        let error = dispatcher.dispatch(&Envelope::new(Sample::NAME, bytes_first)).await.unwrap_err();
        assert!(
            matches!(error, DispatchError::NotUtf8 { line: 1, column, .. } if column == at),
            "{error:?}"
        );

        let lines = "{\"id\":\"b\",\n \"text\":\"t\",\n \"tags\":[],\"meta\":null,\n \"x\":\"\\udfff\"}";
        let error = dispatcher.dispatch(&Envelope::new(Sample::NAME, lines)).await.unwrap_err();
        assert_eq!(error.to_string(), error_text(4, 7, r"\udfff"));
        assert!(effects(&pool).await.is_empty());
    }

    /// A stored payload with an unpaired surrogate (stored before the rule held, or damaged):
    /// its replay is refused with the same words; the handler does not run.
    #[tokio::test]
    async fn a_replay_of_a_stored_unpaired_surrogate_is_refused() {
        let (pool, _guard) = fixture().await;
        let dispatcher = Dispatcher::from_handlers(pool.clone(), [handler!(apply)]).unwrap();
        let failing = r#"{"id":"r","text":"fail","tags":[],"meta":null}"#;
        let outcomes = dispatcher.dispatch(&Envelope::new(Sample::NAME, failing)).await.unwrap();
        assert!(outcomes[0].result.is_err());
        let stored = r#"{"id":"r","text":"t","tags":[],"meta":null,"note":"\udc00"}"#;
        sqlx::query(sql("UPDATE inbox_messages SET payload = $1 WHERE message_key = 'r'"))
            .bind(stored.as_bytes().to_vec())
            .execute(&pool)
            .await
            .unwrap();
        let error = dispatcher.replay("uni", "r").await.unwrap_err();
        assert_eq!(
            error.to_string(),
            "stored payload of `uni.sample` does not decode: line 1, column 52: invalid Unicode: \
             the escape `\\udc00` is an unpaired surrogate"
        );
        assert_eq!(effect(&pool, "r").await, None);
        assert_eq!(
            inbox_tests::inbox_row(&pool, "uni", "r").await,
            Some(("failed".to_owned(), 1))
        );
    }
}
