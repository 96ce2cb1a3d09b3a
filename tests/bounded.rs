//! Bounded reads and the payload limit's invariant, on every backend.
//!
//! * `PayloadLimit` cannot hold an unsafe value (0, above 256 MiB) whichever way it is built, and
//!   the dispatcher's setter refuses one with the constructor's error;
//! * an envelope its source cut (`Envelope::cut`) is refused as too large whatever the
//!   dispatcher's limit, and kept cut with its real size;
//! * the memory source cuts at the limit it is given, the file source reads no further than the
//!   limit plus 64 KiB of a line and skips the rest to the next newline; the worker gives each
//!   source its dispatcher's limit, and every oversized delivery is kept in `inbox_rejections`
//!   as `too_large` with its real size while the deliveries around it are processed.

#![allow(missing_docs)]

use std::io::Write as _;

use inbox_runtime::Message;
use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, Serialize, Deserialize, Message)]
#[message(name = "bounded.blob")]
pub struct Blob {
    #[message(key)]
    pub id: String,
    pub data: String,
}

/// A file line of `bounded.blob` with `size` bytes of data (newline not included).
fn line(id: &str, size: usize) -> String {
    format!(
        r#"{{"message":"bounded.blob","payload":{{"id":"{id}","data":"{}"}}}}"#,
        "x".repeat(size)
    )
}

/// The payload of `id` with `size` bytes of data.
fn blob(id: &str, size: usize) -> String {
    format!(r#"{{"id":"{id}","data":"{}"}}"#, "x".repeat(size))
}

#[test]
fn no_way_around_the_payload_limits_constructor() {
    use inbox_runtime::types::{PayloadLimit, PayloadLimitError};
    let above = PayloadLimit::MAX_BYTES + 1;
    for (bytes, expected) in [
        (0, Err(PayloadLimitError::Zero)),
        (above, Err(PayloadLimitError::AboveMaximum { bytes: above })),
        (1, Ok(1)),
        (PayloadLimit::MAX_BYTES, Ok(PayloadLimit::MAX_BYTES)),
    ] {
        assert_eq!(PayloadLimit::new(bytes).map(PayloadLimit::bytes), expected);
        assert_eq!(PayloadLimit::try_from(bytes).map(usize::from), expected);
        // From configuration: the same check, the same words.
        let parsed = serde_json::from_str::<PayloadLimit>(&bytes.to_string());
        match (&parsed, &expected) {
            (Ok(limit), Ok(bytes)) => assert_eq!(limit.bytes(), *bytes),
            (Err(error), Err(refused)) => assert_eq!(error.to_string(), refused.to_string()),
            _ => panic!("{bytes}: {parsed:?}"),
        }
    }
    assert!(serde_json::from_str::<PayloadLimit>("-1").is_err());
    assert!(serde_json::from_str::<PayloadLimit>("1.5").is_err());
    assert_eq!(PayloadLimit::default(), PayloadLimit::DEFAULT);
    assert_eq!(PayloadLimit::DEFAULT.bytes(), 1 << 20);
}

inbox_tests::backend_matrix! {
    use inbox_runtime::source::file::{FilePosition, FileSource, read_offset_file};
    use inbox_runtime::source::memory::MemorySource;
    use inbox_runtime::source::Source;
    use inbox_runtime::{
        CancellationToken, DispatchError, Dispatcher, Envelope, Worker, handler,
        types::{PayloadLimit, PayloadLimitError},
    };
    use inbox_tests::{effect, effects};

    #[inbox_runtime::idempotent(consumer = "bounded")]
    async fn keep(conn: &mut Conn, msg: Blob) -> Result<(), sqlx::Error> {
        sqlx::query(APPLY_EFFECT)
            .bind(&msg.id)
            .bind(i64::try_from(msg.data.len()).unwrap())
            .execute(conn)
            .await?;
        Ok(())
    }

    fn dispatcher(pool: &Pool) -> Dispatcher<Db> {
        Dispatcher::from_handlers(pool.clone(), [handler!(keep)]).unwrap()
    }

    /// `(reason, message name, kept bytes, real size)` of every rejection, in order.
    async fn rejections(pool: &Pool) -> Vec<(String, String, i64, Option<i64>)> {
        sqlx::query_as(sql(
            "SELECT reason, message_name, CAST(length(payload) AS BIGINT), payload_size \
             FROM inbox_rejections ORDER BY id",
        ))
        .fetch_all(pool)
        .await
        .unwrap()
    }

    fn too_large(name: &str, kept: usize, size: usize) -> (String, String, i64, Option<i64>) {
        (
            "too_large".to_owned(),
            name.to_owned(),
            i64::try_from(kept).unwrap(),
            Some(i64::try_from(size).unwrap()),
        )
    }

    #[tokio::test]
    async fn the_dispatcher_refuses_an_unsafe_limit_with_the_constructors_error() {
        let (pool, _guard) = fixture().await;
        let zero = dispatcher(&pool).with_max_payload_bytes(0).unwrap_err();
        assert_eq!(zero, PayloadLimitError::Zero);
        assert_eq!(zero.to_string(), PayloadLimit::new(0).unwrap_err().to_string());
        let huge = dispatcher(&pool).with_max_payload_bytes(usize::MAX).unwrap_err();
        assert_eq!(huge, PayloadLimitError::AboveMaximum { bytes: usize::MAX });
        assert_eq!(huge.to_string(), PayloadLimit::new(usize::MAX).unwrap_err().to_string());
        let most = dispatcher(&pool).with_max_payload_bytes(256 << 20).unwrap();
        assert_eq!(most.max_payload_bytes(), 268_435_456);
        let one = dispatcher(&pool).with_payload_limit(PayloadLimit::new(1).unwrap());
        assert_eq!((one.max_payload_bytes(), one.payload_limit().bytes()), (1, 1));
        // A limit of one byte refuses every payload as too large, and keeps one byte of it.
        let envelope = Envelope::new(Blob::NAME, blob("one", 1));
        let error = one.dispatch(&envelope).await.unwrap_err();
        assert!(matches!(error, DispatchError::TooLarge { size: 23, limit: 1, .. }), "{error:?}");
        one.record_rejection(&envelope, &error).await.unwrap();
        assert_eq!(rejections(&pool).await, [too_large(Blob::NAME, 1, 23)]);
    }

    #[tokio::test]
    async fn a_cut_envelope_is_too_large_whatever_the_limit() {
        let (pool, _guard) = fixture().await;
        let dispatcher = dispatcher(&pool);
        // What was kept happens to be a whole message: still refused, never decoded.
        let kept = blob("cut", 1);
        let cut = Envelope::cut(Blob::NAME, kept.clone(), 5000);
        assert!(cut.is_cut());
        assert_eq!((cut.payload.len(), cut.payload_size()), (23, 5000));
        let error = dispatcher.dispatch(&cut).await.unwrap_err();
        assert!(matches!(error, DispatchError::TooLarge { size: 5000, limit: 23, .. }), "{error:?}");
        assert_eq!(
            error.to_string(),
            "payload of message `bounded.blob` is 5000 bytes, over the limit of 23 bytes"
        );
        dispatcher.record_rejection(&cut, &error).await.unwrap();
        // Over the dispatcher's limit too: that limit is the one reported.
        let small = self::dispatcher(&pool).with_max_payload_bytes(16).unwrap();
        let error = small.dispatch(&cut).await.unwrap_err();
        assert!(matches!(error, DispatchError::TooLarge { size: 5000, limit: 16, .. }), "{error:?}");
        small.record_rejection(&cut, &error).await.unwrap();
        assert_eq!(
            rejections(&pool).await,
            [too_large(Blob::NAME, 23, 5000), too_large(Blob::NAME, 16, 5000)]
        );
        assert_eq!(effect(&pool, "cut").await, None);

        // A size not above the kept bytes is no cut; nor is a payload replaced by a whole one.
        assert!(!Envelope::cut(Blob::NAME, kept.clone(), 23).is_cut());
        let mut replaced = Envelope::cut(Blob::NAME, b"{".to_vec(), 23);
        replaced.payload = kept.into_bytes();
        assert!(!replaced.is_cut());
        let outcomes = dispatcher.dispatch(&replaced).await.unwrap();
        assert!(outcomes[0].result.is_ok(), "{:?}", outcomes[0].result);
        assert_eq!(effect(&pool, "cut").await, Some((1, 1)));
    }

    #[tokio::test]
    async fn the_memory_source_cuts_at_its_limit_and_the_worker_sets_it() {
        let (pool, _guard) = fixture().await;
        // Driven by hand: cut when handed out, also when handed out again.
        let mut source = MemorySource::new("memory");
        let handle = source.handle();
        handle.push(Envelope::new(Blob::NAME, blob("big", 10_000)));
        source.set_payload_limit(PayloadLimit::new(4096).unwrap());
        for _ in 0..2 {
            let delivery = source.next().await.unwrap().unwrap();
            let envelope = delivery.envelope();
            assert!(envelope.is_cut());
            assert_eq!((envelope.payload.len(), envelope.payload_size()), (4096, 10_022));
            delivery.requeue(None).await.unwrap();
        }

        // Under a worker: its dispatcher's limit.
        let source = MemorySource::new("memory");
        let handle = source.handle();
        handle.push(Envelope::new(Blob::NAME, blob("small", 10)));
        handle.push(Envelope::new(Blob::NAME, blob("big", 10_000)));
        handle.push(Envelope::new(Blob::NAME, blob("after", 20)));
        handle.close();
        let worker = Worker::new(dispatcher(&pool).with_max_payload_bytes(4096).unwrap());
        let report = worker.run(source, CancellationToken::new()).await.unwrap();
        assert_eq!((report.processed, report.invalid, report.acked), (2, 1, 3));
        assert_eq!(rejections(&pool).await, [too_large(Blob::NAME, 4096, 10_022)]);
        assert_eq!(effects(&pool).await.len(), 2);
        assert_eq!(effect(&pool, "after").await, Some((1, 20)));
    }

    #[tokio::test]
    async fn the_file_source_reads_no_further_than_the_limit() {
        let (pool, _guard) = fixture().await;
        let dir = tempfile::tempdir_in(inbox_tests::scratch_dir()).unwrap();
        let path = dir.path().join("lines.jsonl");
        // The limit is 100 bytes; a line may hold 100 + 65,536.
        let budget = 100 + 64 * 1024;
        let cut = line("cut", budget);
        let within = line("within", 1000);
        let unnamed = format!(
            r#"{{"payload":{},"message":"bounded.blob"}}"#,
            blob("unnamed", budget)
        );
        let last = line("last", 3 * budget);
        let lines = [
            line("small", 10),
            cut.clone(),
            within.clone(),
            " ".repeat(3 * budget), // blank, however long
            line("after", 20),
            unnamed.clone(),
            last.clone(), // no newline at the end of the file
        ];
        let mut file = std::fs::File::create(&path).unwrap();
        file.write_all(lines.join("\n").as_bytes()).unwrap();
        drop(file);
        let length = std::fs::metadata(&path).unwrap().len();

        let source = FileSource::open(&path).await.unwrap();
        let offset_path = source.offset_path().to_owned();
        let worker = Worker::new(dispatcher(&pool).with_max_payload_bytes(100).unwrap());
        let report = worker.run(source, CancellationToken::new()).await.unwrap();
        assert_eq!((report.processed, report.invalid, report.acked), (2, 4, 6));
        assert_eq!(
            read_offset_file(&offset_path).unwrap(),
            Some(FilePosition { line: 7, byte: length })
        );
        // The worker runs deliveries side by side: the rows' order is not the lines'.
        let mut found = rejections(&pool).await;
        found.sort();
        let mut expected = [
            // Cut: the line's first 100 bytes, its size, its name (read before the cut).
            too_large(Blob::NAME, 100, cut.len()),
            // Within the line's room: the payload refused by the dispatcher, as before.
            too_large(Blob::NAME, 100, blob("within", 1000).len()),
            // Cut before its name: refused as too large all the same.
            too_large("", 100, unnamed.len()),
            too_large(Blob::NAME, 100, last.len()),
        ];
        expected.sort();
        assert_eq!(found, expected);
        let kept: Vec<(Vec<u8>, Option<i64>)> = sqlx::query_as(sql(
            "SELECT payload, payload_size FROM inbox_rejections ORDER BY id",
        ))
        .fetch_all(&pool)
        .await
        .unwrap();
        let cut_size = Some(i64::try_from(cut.len()).unwrap());
        let kept = kept
            .into_iter()
            .find(|(_, size)| *size == cut_size)
            .map(|(payload, _)| payload);
        assert_eq!(kept.as_deref(), Some(&cut.as_bytes()[..100]));
        assert_eq!(effect(&pool, "small").await, Some((1, 10)));
        assert_eq!(effect(&pool, "after").await, Some((1, 20)));
        assert_eq!(effects(&pool).await.len(), 2);
    }
}

/// A line just within the room is read whole: its payload decides (here: processed).
#[tokio::test]
async fn a_line_at_the_room_is_read_whole() {
    use inbox_runtime::source::Source;
    use inbox_runtime::source::file::FileSource;
    use inbox_runtime::types::PayloadLimit;

    let dir = tempfile::tempdir_in(inbox_tests::scratch_dir()).unwrap();
    let path = dir.path().join("room.jsonl");
    let limit = 1000;
    // Payload at the limit; headers fill the line up to limit + 64 KiB exactly.
    let payload = blob("room", limit - blob("room", 0).len());
    assert_eq!(payload.len(), limit);
    let head = r#"{"message":"bounded.blob","headers":{"pad":""#;
    let tail = format!(r#""}},"payload":{payload}}}"#);
    let pad = limit + 64 * 1024 - head.len() - tail.len();
    let text = format!("{head}{}{tail}\n", "p".repeat(pad));
    assert_eq!(text.len(), limit + 64 * 1024 + 1);
    std::fs::write(&path, &text).unwrap();
    let mut source = FileSource::open(&path).await.unwrap();
    Source::set_payload_limit(&mut source, PayloadLimit::new(limit).unwrap());
    let delivery = source.next().await.unwrap().unwrap();
    assert!(!delivery.envelope().is_cut());
    assert_eq!(delivery.envelope().payload, payload.as_bytes());
    assert_eq!(delivery.envelope().headers["pad"].len(), pad);
    delivery.ack().await.unwrap();

    // One byte longer: cut.
    let path = dir.path().join("over.jsonl");
    std::fs::write(&path, format!("{head}p{}{tail}\n", "p".repeat(pad))).unwrap();
    let mut source = FileSource::open(&path).await.unwrap();
    Source::set_payload_limit(&mut source, PayloadLimit::new(limit).unwrap());
    let delivery = source.next().await.unwrap().unwrap();
    assert!(delivery.envelope().is_cut());
    assert_eq!(delivery.envelope().message_name, Blob::NAME);
    assert_eq!(
        (
            delivery.envelope().payload.len(),
            delivery.envelope().payload_size()
        ),
        (limit, limit + 64 * 1024 + 1)
    );
    delivery.ack().await.unwrap();
}
