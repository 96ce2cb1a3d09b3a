//! The DynamoDB inbox's admin (`inbox_runtime::dynamodb::DynamoAdmin`) and the command line on
//! it (`inbox_runtime::ops::cli::dynamodb`), against the serial moto DynamoDB on loopback
//! (`DYNAMODB_ENDPOINT`, started by scripts/sqs.sh; see tests/dynamodb.rs): exact statistics
//! after a known mix, list order and limit, payloads as stored, discard (then redeliveries are
//! `Discarded`, nothing applied), a discard racing a takeover, the dead-letter index added to a
//! table without it, the DynamoDB calls each operation makes, and the CLI's output lines.
//!
//! Each test has tables of its own (a fresh name). Messages of one test are processed one after
//! the other, and their keys sort in that order, so that the expected order holds even when
//! two are received in the same millisecond (ties sort by consumer, then key, as on SQL).

use inbox_tests::dynamo::endpoint;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use clap::Parser as _;
use inbox_runtime::dynamodb::sdk::types::{
    AttributeDefinition, AttributeValue, BillingMode, KeySchemaElement, KeyType,
    ScalarAttributeType, Update,
};
use inbox_runtime::dynamodb::{
    self, AdminError, DEAD_LETTER_INDEX, DynamoAdmin, DynamoError, DynamoInbox, DynamoTx,
};
use inbox_runtime::ops::admin::utc_time;
use inbox_runtime::ops::cli::{self, AdminCli, CliError};
use inbox_runtime::store::{StatsRow, StatsStatus, StoredMessage};
use inbox_runtime::{Disposition, Fingerprint, Message, Outcome, RetryPolicy, Status};

#[derive(Clone, Debug, serde::Serialize, serde::Deserialize, Message)]
#[message(name = "accounts.credited")]
struct Credit {
    #[message(key)]
    id: String,
    account: String,
    amount: i64,
}

fn credit(id: &str, amount: i64) -> Credit {
    Credit {
        id: id.to_owned(),
        account: "acct-1".to_owned(),
        amount,
    }
}

/// `Boom` is retryable (the key is recorded `failed`), `Fatal` permanent (`dead` at once).
use inbox_tests::dynamo::TestError;

fn suffix() -> String {
    uuid::Uuid::new_v4().simple().to_string()
}

/// Creates a table with partition key `name` (string) and nothing else.
async fn plain_table(client: &dynamodb::sdk::Client, table: &str, key: &str) {
    client
        .create_table()
        .table_name(table)
        .billing_mode(BillingMode::PayPerRequest)
        .attribute_definitions(
            AttributeDefinition::builder()
                .attribute_name(key)
                .attribute_type(ScalarAttributeType::S)
                .build()
                .unwrap(),
        )
        .key_schema(
            KeySchemaElement::builder()
                .attribute_name(key)
                .key_type(KeyType::Hash)
                .build()
                .unwrap(),
        )
        .send()
        .await
        .expect("create table");
}

/// A fresh inbox table (retry delays of zero: a failed key is due at once) and a counters
/// table.
async fn setup() -> (DynamoInbox, String) {
    let client = dynamodb::client(Some(&endpoint())).await;
    let suffix = suffix();
    let inbox = DynamoInbox::new(client.clone(), format!("inbox_{suffix}"))
        .retry_policy(RetryPolicy::default().retry_delays(Duration::ZERO, Duration::ZERO));
    inbox.ensure_table().await.expect("inbox table");
    let counters = format!("counters_{suffix}");
    plain_table(&client, &counters, "id").await;
    (inbox, counters)
}

/// The effect: `ADD n :amount` on the counter item `acct-1`.
fn add_counter(tx: &mut DynamoTx, table: &str, amount: i64) -> Result<(), TestError> {
    tx.update(
        Update::builder()
            .table_name(table)
            .key("id", AttributeValue::S("acct-1".to_owned()))
            .update_expression("ADD n :amount")
            .expression_attribute_values(":amount", AttributeValue::N(amount.to_string()))
            .build()
            .map_err(|e| TestError::Build(e.to_string()))?,
    );
    Ok(())
}

async fn counter(inbox: &DynamoInbox, table: &str) -> Option<i64> {
    let item = inbox
        .client()
        .get_item()
        .table_name(table)
        .key("id", AttributeValue::S("acct-1".to_owned()))
        .consistent_read(true)
        .send()
        .await
        .unwrap()
        .item?;
    match item.get("n") {
        Some(AttributeValue::N(n)) => Some(n.parse().unwrap()),
        other => panic!("counter: {other:?}"),
    }
}

/// Delivers `msg` to `consumer`: the handler adds the counter effect, then returns `error` if
/// given. `runs` counts handler runs.
async fn deliver(
    inbox: &DynamoInbox,
    counters: &str,
    consumer: &str,
    msg: &Credit,
    error: Option<fn() -> TestError>,
    runs: &AtomicUsize,
) -> Result<Outcome<()>, DynamoError<TestError>> {
    inbox
        .process(consumer, msg, |mut tx| async move {
            runs.fetch_add(1, Ordering::SeqCst);
            add_counter(&mut tx, counters, msg.amount)?;
            match error {
                Some(error) => Err(error()),
                None => Ok((tx, ())),
            }
        })
        .await
}

/// Processes `key` for `consumer`: `Ok` processed, `Some(Boom)` failed, `Some(Fatal)` dead.
async fn settle(
    inbox: &DynamoInbox,
    counters: &str,
    consumer: &str,
    key: &str,
    error: Option<fn() -> TestError>,
) {
    let runs = AtomicUsize::new(0);
    let result = deliver(inbox, counters, consumer, &credit(key, 1), error, &runs).await;
    match (error, result) {
        (None, Ok(Outcome::Processed(()))) => {}
        (Some(_), Err(DynamoError::Handler(failure))) => {
            assert!(matches!(
                failure.disposition,
                Disposition::Retry { .. } | Disposition::Dead
            ));
        }
        (_, other) => panic!("{consumer}/{key}: {other:?}"),
    }
}

fn boom() -> TestError {
    TestError::Boom
}

fn fatal() -> TestError {
    TestError::Fatal
}

/// The mix of the statistics tests: `ledger` has `a1`..`a3` processed, `m1` failed, `m2` and
/// `m3` dead; `orders` has `o1` dead, processed in this order.
async fn known_mix(inbox: &DynamoInbox, counters: &str) {
    for key in ["a1", "a2", "a3"] {
        settle(inbox, counters, "ledger", key, None).await;
    }
    settle(inbox, counters, "ledger", "m1", Some(boom)).await;
    settle(inbox, counters, "ledger", "m2", Some(fatal)).await;
    settle(inbox, counters, "ledger", "m3", Some(fatal)).await;
    settle(inbox, counters, "orders", "o1", Some(fatal)).await;
}

fn keys(rows: &[StoredMessage]) -> Vec<(&str, &str, Status)> {
    rows.iter()
        .map(|row| (row.consumer.as_str(), row.message_key.as_str(), row.status))
        .collect()
}

fn counts(rows: &[StatsRow]) -> Vec<(&str, StatsStatus, i64)> {
    rows.iter()
        .map(|row| (row.consumer.as_deref().unwrap(), row.status, row.count))
        .collect()
}

async fn shown(admin: &DynamoAdmin, consumer: &str, key: &str) -> StoredMessage {
    admin
        .show(consumer, key)
        .await
        .unwrap()
        .unwrap_or_else(|| panic!("{consumer}/{key} is not stored"))
}

#[tokio::test]
async fn stats_list_and_show_after_a_known_mix() {
    let (inbox, counters) = setup().await;
    known_mix(&inbox, &counters).await;
    let admin = inbox.admin();

    // Stats: one Scan (the table is far below a 1 MB page).
    let rows = admin.stats().await.unwrap();
    assert_eq!(admin.calls(), 1);
    use StatsStatus::Message;
    assert_eq!(
        counts(&rows),
        [
            ("ledger", Message(Status::Dead), 2),
            ("ledger", Message(Status::Failed), 1),
            ("ledger", Message(Status::Processed), 3),
            ("orders", Message(Status::Dead), 1),
        ]
    );
    // The oldest of each group is its first one's `received_at`.
    let oldest: Vec<&str> = rows.iter().map(|r| r.oldest.as_deref().unwrap()).collect();
    let first = [
        ("ledger", "m2"),
        ("ledger", "m1"),
        ("ledger", "a1"),
        ("orders", "o1"),
    ];
    for (oldest, (consumer, key)) in oldest.iter().zip(first) {
        assert_eq!(*oldest, shown(&admin, consumer, key).await.received_at);
    }
    assert_eq!(admin.calls(), 5);

    // Failed and dead of one consumer, oldest first: one Query of the index.
    let both = [Status::Failed, Status::Dead];
    let listed = admin.list(Some("ledger"), &both, 50).await.unwrap();
    assert_eq!(admin.calls(), 6);
    assert_eq!(
        keys(&listed),
        [
            ("ledger", "m1", Status::Failed),
            ("ledger", "m2", Status::Dead),
            ("ledger", "m3", Status::Dead),
        ]
    );
    let m1 = &listed[0];
    assert_eq!(
        (
            m1.message_name.as_str(),
            m1.attempts,
            m1.last_error.as_deref()
        ),
        ("accounts.credited", 1, Some("boom"))
    );
    assert_eq!(m1.payload, None, "the list leaves payloads out");
    assert!(m1.next_attempt_at.is_some());
    assert_eq!(
        m1.payload_hash,
        Fingerprint::of(Credit::NAME, &credit("m1", 1))
            .unwrap()
            .to_hex()
    );

    // At most `limit`: pages of `limit + 1`, a second one only when the last two share their
    // millisecond.
    let before = admin.calls();
    let two = admin.list(Some("ledger"), &both, 2).await.unwrap();
    assert_eq!(keys(&two), keys(&listed[..2]));
    let one = admin.list(Some("ledger"), &both, 1).await.unwrap();
    assert_eq!(keys(&one), keys(&listed[..1]));
    assert!(
        (2..=5).contains(&(admin.calls() - before)),
        "{}",
        admin.calls()
    );

    // One status: the filter applies after the index read.
    let dead = admin
        .list(Some("ledger"), &[Status::Dead], 50)
        .await
        .unwrap();
    assert_eq!(keys(&dead), keys(&listed[1..]));
    let failed = admin
        .list(Some("ledger"), &[Status::Failed], 50)
        .await
        .unwrap();
    assert_eq!(keys(&failed), keys(&listed[..1]));

    // Every consumer: one Scan of the index (the failed and dead items alone).
    let before = admin.calls();
    let all = admin.list(None, &[Status::Dead], 50).await.unwrap();
    assert_eq!(admin.calls() - before, 1);
    assert_eq!(
        keys(&all),
        [
            ("ledger", "m2", Status::Dead),
            ("ledger", "m3", Status::Dead),
            ("orders", "o1", Status::Dead),
        ]
    );
    let all = admin.list(None, &both, 3).await.unwrap();
    assert_eq!(keys(&all), keys(&listed));

    // Processed ones when asked: a Scan of the table.
    let before = admin.calls();
    let processed = admin
        .list(Some("ledger"), &[Status::Processed], 2)
        .await
        .unwrap();
    assert_eq!(admin.calls() - before, 1);
    assert_eq!(
        keys(&processed),
        [
            ("ledger", "a1", Status::Processed),
            ("ledger", "a2", Status::Processed),
        ]
    );
    let everything = admin.list(None, &Status::ALL, 50).await.unwrap();
    assert_eq!(everything.len(), 7);
    assert!(admin.list(None, &[], 50).await.unwrap().is_empty());
    assert!(
        admin
            .list(Some("nobody"), &both, 50)
            .await
            .unwrap()
            .is_empty()
    );

    // Show: the payload as stored, byte for byte.
    let before = admin.calls();
    let m2 = shown(&admin, "ledger", "m2").await;
    assert_eq!(admin.calls() - before, 1);
    assert_eq!(m2.status, Status::Dead);
    assert_eq!(m2.attempts, 1);
    assert_eq!(m2.last_error.as_deref(), Some("fatal"));
    assert_eq!(m2.message_name, "accounts.credited");
    assert_eq!(
        m2.payload.as_deref(),
        Some(serde_json::to_vec(&credit("m2", 1)).unwrap().as_slice())
    );
    assert_eq!(
        (m2.processed_at.as_deref(), m2.next_attempt_at.as_deref()),
        (None, None)
    );
    let a1 = shown(&admin, "ledger", "a1").await;
    assert_eq!(
        (a1.status, a1.payload.as_deref()),
        (Status::Processed, None)
    );
    assert!(a1.processed_at.is_some());
    assert_eq!(admin.show("ledger", "absent").await.unwrap(), None);
    assert_eq!(admin.show("orders", "m2").await.unwrap(), None);
    // A key too long for any partition key is absent, not a DynamoDB error.
    assert_eq!(admin.show("ledger", &"k".repeat(3000)).await.unwrap(), None);
}

#[tokio::test]
async fn a_raw_payload_is_shown_as_it_was_given() {
    let (inbox, _) = setup().await;
    let key = inbox_runtime::IdempotencyKey::new("raw-1", "raw", "id").unwrap();
    let payload = b"\x00\xffnot json\n".to_vec();
    let error = inbox
        .process_raw(
            "ledger",
            "raw.bytes",
            &key,
            Fingerprint::of_bytes("raw.bytes", &payload),
            &payload,
            |_tx| async { Err::<(DynamoTx, ()), _>(TestError::Fatal) },
        )
        .await
        .unwrap_err();
    assert!(matches!(error, DynamoError::Handler(_)));
    let row = shown(&inbox.admin(), "ledger", "raw-1").await;
    assert_eq!(row.message_name, "raw.bytes");
    assert_eq!(row.payload, Some(payload));
    assert_eq!(row.status, Status::Dead);
}

#[tokio::test]
async fn a_discarded_key_blocks_redeliveries() {
    let (inbox, counters) = setup().await;
    let admin = inbox.admin();
    settle(&inbox, &counters, "ledger", "d1", Some(fatal)).await;
    settle(&inbox, &counters, "ledger", "f1", Some(boom)).await;
    settle(&inbox, &counters, "ledger", "p1", None).await;
    assert_eq!(counter(&inbox, &counters).await, Some(1));

    // One UpdateItem each.
    assert!(admin.discard("ledger", "d1").await.unwrap());
    assert!(admin.discard("ledger", "f1").await.unwrap());
    assert_eq!(admin.calls(), 2);
    // Already discarded, processed, absent, another consumer's: nothing matched.
    for (consumer, key) in [
        ("ledger", "d1"),
        ("ledger", "p1"),
        ("ledger", "absent"),
        ("orders", "f1"),
    ] {
        assert!(
            !admin.discard(consumer, key).await.unwrap(),
            "{consumer}/{key}"
        );
    }

    let d1 = shown(&admin, "ledger", "d1").await;
    assert_eq!(d1.status, Status::Discarded);
    assert_eq!(d1.payload, None, "the payload is dropped");
    assert_eq!(d1.next_attempt_at, None);
    assert_eq!(d1.last_error.as_deref(), Some("fatal"), "kept, as on SQL");
    assert!(d1.processed_at.is_some());
    let f1 = shown(&admin, "ledger", "f1").await;
    assert_eq!(
        (f1.status, f1.payload.as_deref()),
        (Status::Discarded, None)
    );
    assert_eq!(f1.next_attempt_at, None);
    // The retention window runs from the discard: DynamoDB's TTL removes the item then.
    let item = inbox
        .client()
        .get_item()
        .table_name(inbox.table())
        .key(
            "pk",
            AttributeValue::S(dynamodb::partition_key(
                "ledger",
                &inbox_runtime::IdempotencyKey::new("d1", "m", "f").unwrap(),
            )),
        )
        .consistent_read(true)
        .send()
        .await
        .unwrap()
        .item
        .unwrap();
    let number = |name: &str| match item.get(name) {
        Some(AttributeValue::N(n)) => n.parse::<i64>().unwrap(),
        other => panic!("{name}: {other:?}"),
    };
    assert_eq!(
        number("expires_at"),
        number("processed_at") / 1000 + 7 * 86_400
    );
    assert!(!item.contains_key(dynamodb::DEAD_LETTER_ATTRIBUTE));

    // Out of the dead letters, counted as discarded.
    let both = [Status::Failed, Status::Dead];
    assert!(
        admin
            .list(Some("ledger"), &both, 50)
            .await
            .unwrap()
            .is_empty()
    );
    assert!(admin.list(None, &both, 50).await.unwrap().is_empty());
    let rows = admin.stats().await.unwrap();
    assert_eq!(
        counts(&rows),
        [
            ("ledger", StatsStatus::Message(Status::Discarded), 2),
            ("ledger", StatsStatus::Message(Status::Processed), 1),
        ]
    );

    // Redeliveries: `Discarded`, the handler not run, nothing applied.
    let runs = AtomicUsize::new(0);
    for key in ["d1", "f1"] {
        let outcome = deliver(&inbox, &counters, "ledger", &credit(key, 1), None, &runs)
            .await
            .unwrap();
        assert_eq!(outcome, Outcome::Discarded, "{key}");
    }
    assert_eq!(runs.load(Ordering::SeqCst), 0);
    assert_eq!(counter(&inbox, &counters).await, Some(1));
    // Another payload under a discarded key: a conflict, as on the SQL stores.
    let error = deliver(&inbox, &counters, "ledger", &credit("d1", 2), None, &runs)
        .await
        .unwrap_err();
    let DynamoError::Conflict(conflict) = error else {
        panic!("expected a conflict, got {error:?}");
    };
    assert_eq!(
        conflict.stored,
        Fingerprint::of(Credit::NAME, &credit("d1", 1)).unwrap()
    );
    assert_eq!(runs.load(Ordering::SeqCst), 0);
    assert_eq!(counter(&inbox, &counters).await, Some(1));
}

#[tokio::test]
async fn a_discard_racing_a_takeover_never_loses_either() {
    let (inbox, counters) = setup().await;
    let admin = inbox.admin();
    settle(&inbox, &counters, "ledger", "r1", Some(boom)).await;
    settle(&inbox, &counters, "ledger", "r2", Some(boom)).await;
    settle(&inbox, &counters, "ledger", "r3", Some(boom)).await;

    // The discard commits while a redelivery's handler runs (after its read): the delivery's
    // claim finds the item changed, its transaction is cancelled with its effect, and it
    // reports `Discarded`.
    let runs = AtomicUsize::new(0);
    let msg = credit("r1", 1);
    let outcome = inbox
        .process("ledger", &msg, |mut tx| {
            let (admin, counters, runs) = (&admin, &counters, &runs);
            async move {
                runs.fetch_add(1, Ordering::SeqCst);
                assert!(admin.discard("ledger", "r1").await.unwrap());
                add_counter(&mut tx, counters, 1)?;
                Ok::<_, TestError>((tx, ()))
            }
        })
        .await
        .unwrap();
    assert_eq!(outcome, Outcome::Discarded);
    assert_eq!(runs.load(Ordering::SeqCst), 1);
    assert_eq!(counter(&inbox, &counters).await, None, "nothing applied");
    assert_eq!(
        shown(&admin, "ledger", "r1").await.status,
        Status::Discarded
    );

    // The delivery commits first: the discard finds the key processed and changes nothing.
    let outcome = deliver(&inbox, &counters, "ledger", &credit("r2", 1), None, &runs)
        .await
        .unwrap();
    assert!(outcome.is_processed());
    assert!(!admin.discard("ledger", "r2").await.unwrap());
    let r2 = shown(&admin, "ledger", "r2").await;
    assert_eq!((r2.status, r2.attempts), (Status::Processed, 2));
    assert_eq!(counter(&inbox, &counters).await, Some(1));

    // The discard commits while a redelivery's handler fails: the failure's record finds the
    // item changed and is not recorded; the key stays discarded (its payload is not brought
    // back, its attempts not counted).
    let error = inbox
        .process("ledger", &credit("r3", 1), |_tx| {
            let admin = &admin;
            async move {
                assert!(admin.discard("ledger", "r3").await.unwrap());
                Err::<(DynamoTx, ()), _>(TestError::Boom)
            }
        })
        .await
        .unwrap_err();
    let DynamoError::Handler(failure) = error else {
        panic!("expected the handler's failure, got {error:?}");
    };
    assert_eq!(failure.disposition, Disposition::NotRecorded);
    let r3 = shown(&admin, "ledger", "r3").await;
    assert_eq!(
        (r3.status, r3.attempts, r3.payload),
        (Status::Discarded, 1, None)
    );
    assert_eq!(counter(&inbox, &counters).await, Some(1));
}

#[tokio::test]
async fn ensure_table_adds_the_dead_letter_index_to_a_table_without_it() {
    let client = dynamodb::client(Some(&endpoint())).await;
    let table = format!("inbox_{}", suffix());
    plain_table(&client, &table, "pk").await;
    let inbox = DynamoInbox::new(client.clone(), &table);
    let counters = format!("counters_{}", suffix());
    plain_table(&client, &counters, "id").await;
    settle(&inbox, &counters, "ledger", "old-1", Some(fatal)).await;

    // Without the index, the listing is DynamoDB's refusal, named.
    let admin = inbox.admin();
    let error = admin
        .list(Some("ledger"), &[Status::Dead], 50)
        .await
        .unwrap_err();
    assert!(
        matches!(
            &error,
            AdminError::Dynamo {
                operation: "Query",
                ..
            }
        ),
        "{error:?}"
    );
    assert!(
        error
            .to_string()
            .starts_with(&format!("DynamoDB Query on table `{table}` failed: "))
    );

    inbox.ensure_table().await.unwrap();
    let described = client
        .describe_table()
        .table_name(&table)
        .send()
        .await
        .unwrap();
    let indexes: Vec<_> = described
        .table()
        .unwrap()
        .global_secondary_indexes()
        .iter()
        .map(|index| {
            (
                index.index_name().unwrap(),
                index.index_status().unwrap().as_str(),
            )
        })
        .collect();
    assert_eq!(indexes, [(DEAD_LETTER_INDEX, "ACTIVE")]);
    // The item recorded before the index has its attribute: it is listed now.
    let listed = admin
        .list(Some("ledger"), &[Status::Dead], 50)
        .await
        .unwrap();
    assert_eq!(keys(&listed), [("ledger", "old-1", Status::Dead)]);
    // Idempotent.
    inbox.ensure_table().await.unwrap();
}

/// Runs `args` (after the program name) on `inbox`: its output, or its error's text.
async fn cli_run(inbox: &DynamoInbox, args: &[&str]) -> Result<String, String> {
    let command = AdminCli::try_parse_from(std::iter::once("admin").chain(args.iter().copied()))
        .unwrap()
        .command;
    let mut out = Vec::new();
    match cli::dynamodb::execute_to(&command, inbox, &mut out).await {
        Ok(()) => Ok(String::from_utf8(out).unwrap()),
        Err(error) => Err(error.to_string()),
    }
}

#[tokio::test]
async fn the_command_line_on_dynamodb() {
    let (inbox, counters) = setup().await;
    let admin = inbox.admin();
    assert_eq!(cli_run(&inbox, &["stats"]).await.unwrap(), "inbox: empty\n");
    for key in ["a1", "a2", "a3"] {
        settle(&inbox, &counters, "ledger", key, None).await;
    }
    settle(&inbox, &counters, "ledger", "m1", Some(boom)).await;
    settle(&inbox, &counters, "ledger", "m2", Some(fatal)).await;
    settle(&inbox, &counters, "ledger", "m3", Some(fatal)).await;
    let time = |row: &StoredMessage| utc_time(&row.received_at);
    let m1 = shown(&admin, "ledger", "m1").await;
    let m2 = shown(&admin, "ledger", "m2").await;
    let m3 = shown(&admin, "ledger", "m3").await;

    assert_eq!(
        cli_run(&inbox, &["stats"]).await.unwrap(),
        format!(
            "CONSUMER  PROCESSED  FAILED  DEAD  PARKED  STALE  DISCARDED  CONFLICTS SEEN  OLDEST FAILED            OLDEST DEAD\n\
             ledger            3       1     2       0      0          0               0  {}  {}\n",
            time(&m1),
            time(&m2)
        )
    );
    assert_eq!(
        cli_run(&inbox, &["dead", "list"]).await.unwrap(),
        format!(
            "CONSUMER  KEY  MESSAGE            STATUS  ATTEMPTS  RECEIVED                 LAST ERROR\n\
             ledger    m1   accounts.credited  failed         1  {}  boom\n\
             ledger    m2   accounts.credited  dead           1  {}  fatal\n\
             ledger    m3   accounts.credited  dead           1  {}  fatal\n",
            time(&m1),
            time(&m2),
            time(&m3)
        )
    );
    assert_eq!(
        cli_run(
            &inbox,
            &[
                "dead",
                "list",
                "--consumer",
                "ledger",
                "--status",
                "dead",
                "--limit",
                "1"
            ]
        )
        .await
        .unwrap(),
        format!(
            "CONSUMER  KEY  MESSAGE            STATUS  ATTEMPTS  RECEIVED                 LAST ERROR\n\
             ledger    m2   accounts.credited  dead           1  {}  fatal\n",
            time(&m2)
        )
    );
    assert_eq!(
        cli_run(&inbox, &["dead", "show", "ledger", "m2"])
            .await
            .unwrap(),
        format!(
            "consumer:     ledger\n\
             key:          m2\n\
             message:      accounts.credited\n\
             status:       dead\n\
             attempts:     1\n\
             received:     {}\n\
             processed:    -\n\
             next attempt: -\n\
             source:       -\n\
             fingerprint:  {}\n\
             last error:   fatal\n\
             payload:\n\
             {{\n  \"account\": \"acct-1\",\n  \"amount\": 1,\n  \"id\": \"m2\"\n}}\n",
            time(&m2),
            m2.payload_hash
        )
    );
    assert_eq!(
        cli_run(&inbox, &["dead", "discard", "ledger", "m2"])
            .await
            .unwrap(),
        "ledger/m2: discarded (its key keeps blocking redeliveries for a retention window, then TTL deletes it)\n"
    );
    assert_eq!(
        cli_run(&inbox, &["stats"]).await.unwrap(),
        format!(
            "CONSUMER  PROCESSED  FAILED  DEAD  PARKED  STALE  DISCARDED  CONFLICTS SEEN  OLDEST FAILED            OLDEST DEAD\n\
             ledger            3       1     1       0      0          1               0  {}  {}\n",
            time(&m1),
            time(&m3)
        )
    );

    // Errors, as on SQL: a message that is not there, an unknown consumer (named with the
    // known ones), and the commands DynamoDB does not have.
    let errors = [
        (
            vec!["dead", "discard", "ledger", "a1"],
            "consumer `ledger` has no failed or dead message with key `a1`",
        ),
        (
            vec!["dead", "discard", "ledger", "m2"],
            "consumer `ledger` has no failed or dead message with key `m2`",
        ),
        (
            vec!["dead", "show", "ledger", "zz"],
            "consumer `ledger` has no stored message with key `zz`",
        ),
        (
            vec!["dead", "show", "nobody", "m1"],
            "unknown consumer `nobody`; known consumers: ledger",
        ),
        (
            vec!["dead", "list", "--consumer", "nobody"],
            "unknown consumer `nobody`; known consumers: ledger",
        ),
        (
            vec!["purge", "--window", "7d", "--redelivery-horizon", "1d"],
            "`purge` is not available on DynamoDB: DynamoDB's TTL on `expires_at` deletes \
             processed and discarded items once their retention window has passed (set it with \
             DynamoInbox::retention)",
        ),
        (
            // This program links no DynamoDB handlers (tests/dynamodb_handlers.rs replays).
            vec!["dead", "replay", "ledger", "m1"],
            "no #[idempotent] handlers for dynamodb are registered (0 for other backends); a crate \
             whose handlers nothing \
             references is not linked: add `use that_crate as _;`, or list the handlers with \
             `DynamoDispatcher::from_handlers(inbox, [handler!(path::to::function)])`",
        ),
        (
            vec!["outbox", "list"],
            "`outbox` is not available on DynamoDB: the command line does not cover the DynamoDB \
             outbox (DynamoOutbox, DynamoRelay) yet",
        ),
    ];
    for (args, error) in errors {
        assert_eq!(cli_run(&inbox, &args).await.unwrap_err(), error, "{args:?}");
    }
    // A consumer with no failed or dead messages left: an empty list, not an error.
    settle(&inbox, &counters, "orders", "o1", None).await;
    assert_eq!(
        cli_run(&inbox, &["dead", "list", "--consumer", "orders"])
            .await
            .unwrap(),
        "no failed or dead messages\n"
    );
    assert_eq!(
        cli_run(&inbox, &["migrate"]).await.unwrap(),
        format!(
            "inbox table ready (dynamodb: {}, with its dead-letter index and TTL)\n",
            inbox.table()
        )
    );

    // The store URL.
    let from_url = DynamoInbox::from_url(&format!("dynamodb://{}", inbox.table()))
        .await
        .unwrap();
    assert_eq!(from_url.table(), inbox.table());
    let refused = DynamoInbox::from_url("dynamo://inbox").await.unwrap_err();
    assert_eq!(
        CliError::from(refused).to_string(),
        "`dynamo://inbox` is not a DynamoDB store URL (dynamodb://TABLE): it does not start \
         with dynamodb://"
    );
}

/// Replays `stored` with the counter effect of its decoded payload; `runs` counts handler runs.
async fn replay(
    inbox: &DynamoInbox,
    counters: &str,
    stored: &StoredMessage,
    error: Option<fn() -> TestError>,
    runs: &AtomicUsize,
) -> Result<Outcome<()>, DynamoError<TestError>> {
    inbox
        .replay_stored(stored, |mut tx| async move {
            runs.fetch_add(1, Ordering::SeqCst);
            let msg: Credit = serde_json::from_slice(stored.payload.as_deref().unwrap())
                .map_err(|e| TestError::Build(e.to_string()))?;
            assert_eq!(msg.id, stored.message_key);
            add_counter(&mut tx, counters, msg.amount)?;
            match error {
                Some(error) => Err(error()),
                None => Ok((tx, ())),
            }
        })
        .await
}

#[tokio::test]
async fn a_raw_replay_takes_a_dead_letter_over_once() {
    let (inbox, counters) = setup().await;
    let admin = inbox.admin();
    let runs = AtomicUsize::new(0);
    let d1 = credit("d1", 7);
    let failed = deliver(&inbox, &counters, "ledger", &d1, Some(fatal), &runs).await;
    assert!(matches!(failed, Err(DynamoError::Handler(_))));
    assert_eq!(counter(&inbox, &counters).await, None);
    // A redelivery of a dead letter does not run it.
    let outcome = deliver(&inbox, &counters, "ledger", &d1, None, &runs).await;
    assert_eq!(outcome.unwrap(), Outcome::Dead);
    assert_eq!(runs.load(Ordering::SeqCst), 1);

    // The replay does: one read, one transaction.
    let stored = shown(&admin, "ledger", "d1").await;
    let calls = inbox.stats().calls;
    let outcome = replay(&inbox, &counters, &stored, None, &runs)
        .await
        .unwrap();
    assert_eq!(outcome, Outcome::Processed(()));
    assert_eq!(inbox.stats().calls - calls, 2);
    assert_eq!(runs.load(Ordering::SeqCst), 2);
    assert_eq!(counter(&inbox, &counters).await, Some(7));
    let now = shown(&admin, "ledger", "d1").await;
    assert_eq!(
        (now.status, now.attempts, now.payload.as_deref()),
        (Status::Processed, 2, None)
    );
    assert_eq!(
        now.received_at, stored.received_at,
        "kept from the first delivery"
    );
    assert!(
        admin
            .list(None, &[Status::Dead], 50)
            .await
            .unwrap()
            .is_empty()
    );

    // The same replay again (its stored copy is stale): a duplicate, nothing run or applied.
    let outcome = replay(&inbox, &counters, &stored, None, &runs)
        .await
        .unwrap();
    assert_eq!(outcome, Outcome::Duplicate);
    assert_eq!(runs.load(Ordering::SeqCst), 2);
    assert_eq!(counter(&inbox, &counters).await, Some(7));
    // A redelivery too.
    let outcome = deliver(&inbox, &counters, "ledger", &d1, None, &runs).await;
    assert_eq!(outcome.unwrap(), Outcome::Duplicate);
    // A message read processed or discarded: no call.
    let calls = inbox.stats().calls;
    assert_eq!(
        replay(&inbox, &counters, &now, None, &runs).await.unwrap(),
        Outcome::Duplicate
    );
    assert_eq!(inbox.stats().calls, calls);

    // A replay that fails again is recorded as a delivery's failure: dead again (permanent),
    // attempts counted, payload kept; nothing applied.
    settle(&inbox, &counters, "ledger", "d2", Some(fatal)).await;
    let stored = shown(&admin, "ledger", "d2").await;
    let error = replay(&inbox, &counters, &stored, Some(fatal), &runs)
        .await
        .unwrap_err();
    let DynamoError::Handler(failure) = error else {
        panic!("expected the handler's failure, got {error:?}");
    };
    assert_eq!(
        (failure.attempts, failure.disposition),
        (2, Disposition::Dead)
    );
    let d2 = shown(&admin, "ledger", "d2").await;
    assert_eq!((d2.status, d2.attempts), (Status::Dead, 2));
    assert_eq!(d2.payload, stored.payload);
    assert_eq!(counter(&inbox, &counters).await, Some(7));
    // Discarded after it was read: the replay's claim finds it so, and runs nothing.
    assert!(admin.discard("ledger", "d2").await.unwrap());
    let outcome = replay(&inbox, &counters, &d2, None, &runs).await.unwrap();
    assert_eq!(outcome, Outcome::Discarded);
    assert_eq!(counter(&inbox, &counters).await, Some(7));

    // A failed key whose next attempt is an hour away: a delivery waits, a replay runs now.
    let patient = DynamoInbox::new(inbox.client().clone(), inbox.table()).retry_policy(
        RetryPolicy::default().retry_delays(Duration::from_secs(3600), Duration::from_secs(3600)),
    );
    let f1 = credit("f1", 3);
    let failed = deliver(&patient, &counters, "ledger", &f1, Some(boom), &runs).await;
    assert!(matches!(failed, Err(DynamoError::Handler(_))));
    let outcome = deliver(&patient, &counters, "ledger", &f1, None, &runs)
        .await
        .unwrap();
    assert!(matches!(outcome, Outcome::NotYet { .. }), "{outcome:?}");
    let stored = shown(&admin, "ledger", "f1").await;
    assert_eq!(stored.status, Status::Failed);
    let outcome = replay(&patient, &counters, &stored, None, &runs)
        .await
        .unwrap();
    assert_eq!(outcome, Outcome::Processed(()));
    assert_eq!(counter(&inbox, &counters).await, Some(10));
}

/// The design's measure: listing dead letters through the sparse index reads the dead letters
/// alone, a `Scan` of the table (what `stats` needs, and what a listing without the index
/// would cost) reads every item. 30 processed keys, 2 dead of `ledger`, 1 dead of `orders`.
#[tokio::test]
async fn the_index_reads_the_dead_letters_alone() {
    let (inbox, counters) = setup().await;
    for index in 0..30 {
        settle(&inbox, &counters, "ledger", &format!("p{index:02}"), None).await;
    }
    settle(&inbox, &counters, "ledger", "x1", Some(fatal)).await;
    settle(&inbox, &counters, "ledger", "x2", Some(fatal)).await;
    settle(&inbox, &counters, "orders", "x3", Some(fatal)).await;
    let admin = inbox.admin();
    let dead = [Status::Dead];
    let measure = |before: (u64, u64)| (admin.calls() - before.0, admin.items_read() - before.1);
    let now = || (admin.calls(), admin.items_read());

    // One consumer: one Query, its 2 dead letters read (the page asks for limit + 1 = 3).
    let before = now();
    let listed = admin.list(Some("ledger"), &dead, 50).await.unwrap();
    assert_eq!(listed.len(), 2);
    assert_eq!(measure(before), (1, 2));
    // Every consumer: one Scan of the index, the 3 dead letters read.
    let before = now();
    assert_eq!(admin.list(None, &dead, 50).await.unwrap().len(), 3);
    assert_eq!(measure(before), (1, 3));
    // With a limit, the Query stops at limit + 1 items read.
    let before = now();
    assert_eq!(admin.list(Some("ledger"), &dead, 1).await.unwrap().len(), 1);
    let (calls, read) = measure(before);
    assert!(
        (calls, read) == (1, 2) || (calls, read) == (2, 2),
        "{calls} calls, {read} read"
    );
    // A filtered Scan of the table (listing processed keys; what a listing of dead letters
    // without the index would be): every item read, 33.
    let before = now();
    assert_eq!(
        admin
            .list(Some("ledger"), &[Status::Dead, Status::Processed], 50)
            .await
            .unwrap()
            .len(),
        32
    );
    assert_eq!(measure(before), (1, 33));
    // Stats: a Scan of the table, every item read.
    let before = now();
    let rows = admin.stats().await.unwrap();
    assert_eq!(
        counts(&rows),
        [
            ("ledger", StatsStatus::Message(Status::Dead), 2),
            ("ledger", StatsStatus::Message(Status::Processed), 30),
            ("orders", StatsStatus::Message(Status::Dead), 1),
        ]
    );
    assert_eq!(measure(before), (1, 33));
    // Show: one GetItem, one item.
    let before = now();
    admin.show("ledger", "x1").await.unwrap().unwrap();
    assert_eq!(measure(before), (1, 1));
}

/// A row from `list` has no payload (the index does not project it). Given to `replay_stored`,
/// a dead row is refused (`DynamoError::Malformed`, nothing run, no call), not answered
/// `Duplicate` as if the message had been processed: the dead letter stays dead, its effect
/// unapplied, and the operator is told to `show` it. (Before: `Ok(Outcome::Duplicate)`.)
#[tokio::test]
async fn a_listed_row_without_its_payload_is_not_replayed_as_a_duplicate() {
    let (inbox, counters) = setup().await;
    let admin = inbox.admin();
    settle(&inbox, &counters, "ledger", "l1", Some(fatal)).await;
    // Strongly consistent: the row as `show` reads it, its payload taken out as `list` does.
    let mut listed = shown(&admin, "ledger", "l1").await;
    assert_eq!(listed.status, Status::Dead);
    listed.payload = None;
    let runs = AtomicUsize::new(0);
    let calls = inbox.stats().calls;
    let result = inbox
        .replay_stored(&listed, |tx| {
            runs.fetch_add(1, Ordering::SeqCst);
            async move { Ok::<_, TestError>((tx, ())) }
        })
        .await;
    match result {
        Err(DynamoError::Malformed {
            consumer,
            key,
            reason,
        }) => {
            assert_eq!((consumer.as_str(), key.as_str()), ("ledger", "l1"));
            assert_eq!(
                reason,
                "the stored message (dead) has no payload: `list` leaves payloads out, \
                 replay what `show` reads"
            );
        }
        other => panic!("expected Malformed, got {other:?}"),
    }
    assert_eq!(runs.load(Ordering::SeqCst), 0);
    assert_eq!(inbox.stats().calls, calls);
    let still = shown(&admin, "ledger", "l1").await;
    assert_eq!((still.status, still.attempts), (Status::Dead, 1));
    assert_eq!(counter(&inbox, &counters).await, None);
}

/// The consumer `""`: DynamoDB refuses an empty string as a secondary index key
/// (`dead_letter_consumer`), so a failure of it could never be recorded (moto refuses it too:
/// before, `Disposition::NotRecorded` on every delivery, never counted toward `max_attempts`,
/// never dead-lettered, redelivered forever). It is refused up front, as `#[idempotent]`
/// refuses `consumer = ""` at compile time: nothing run, no call, no item.
#[tokio::test]
async fn an_empty_consumer_is_refused_before_any_call() {
    let (inbox, counters) = setup().await;
    let runs = AtomicUsize::new(0);
    let calls = inbox.stats().calls;
    let result = deliver(&inbox, &counters, "", &credit("e1", 1), Some(fatal), &runs).await;
    assert!(
        matches!(result, Err(DynamoError::EmptyConsumer)),
        "{result:?}"
    );
    let result = deliver(&inbox, &counters, "", &credit("e1", 1), None, &runs).await;
    assert!(
        matches!(result, Err(DynamoError::EmptyConsumer)),
        "{result:?}"
    );
    assert_eq!(runs.load(Ordering::SeqCst), 0);
    assert_eq!(inbox.stats().calls, calls);
    assert_eq!(counter(&inbox, &counters).await, None);
    assert!(inbox.admin().stats().await.unwrap().is_empty());
}
