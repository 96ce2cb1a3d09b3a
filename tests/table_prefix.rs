//! The runtime's tables under a table prefix of the user's choice (`TablePrefix`), on SQLite
//! (a file), MySQL/MariaDB (`MYSQL_URL`) and PostgreSQL (`DATABASE_URL`): two services with
//! their own prefixes in one database — already migrated without a prefix, a third service —
//! each deduplicating on its own: the same consumer and idempotency key are processed once per
//! prefix, and a redelivery is a duplicate within it; dead letters, the admin listing and stats,
//! the console and the outbox relay of one prefix see nothing of the other's; a worker, a relay,
//! the console and the `Idempotency-Key` layer built in a scope keep its prefix on tasks spawned
//! outside it; migrations create prefixed tables, indexes and version tables (SQLite's index
//! names are per database: migrating twice in one file would fail on them otherwise). A hostile
//! prefix is refused before anything reaches a server.

#![allow(missing_docs)]

use inbox_runtime::Message;
use inbox_runtime::store::TablePrefix;
use inbox_runtime::store::TablePrefixError;
use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, Serialize, Deserialize, Message)]
#[message(name = "test.prefix_payment")]
pub struct Payment {
    #[message(key)]
    pub id: String,
    pub amount: i64,
}

#[derive(Debug, Clone, Serialize, Deserialize, Message)]
#[message(name = "test.prefix_job")]
pub struct Job {
    #[message(key)]
    pub id: String,
}

#[derive(Debug, Clone, Serialize, Deserialize, Message)]
#[message(name = "test.prefix_order")]
pub struct Order {
    #[message(key)]
    pub id: String,
}

#[derive(Debug, thiserror::Error)]
pub enum JobError {
    #[error("the job fails")]
    Fails,
    #[error(transparent)]
    Database(#[from] sqlx::Error),
    #[error(transparent)]
    Outbox(#[from] inbox_runtime::outbox::OutboxError),
}

impl inbox_runtime::Classify for JobError {
    fn class(&self) -> inbox_runtime::ErrorClass {
        inbox_runtime::ErrorClass::Retryable
    }
}

/// The effect key of `id` in the current scope's prefix (`billing_:pay-1`, or `:pay-1`
/// unprefixed): the handlers see the scope they run in.
fn scoped_key(id: &str) -> String {
    let prefix = TablePrefix::current().map(|p| p.as_str().to_owned());
    format!("{}:{id}", prefix.unwrap_or_default())
}

const OUTBOX: inbox_runtime::Outbox = inbox_runtime::Outbox::new(&["orders"]);

macro_rules! prefix_tests {
    ($name:ident, $db:ty) => {
        mod $name {
            use super::*;
            use inbox_runtime::ops::admin;
            use inbox_runtime::sink::MemorySink;
            use inbox_runtime::{Component, Dispatcher, Relay, Status};
            use inbox_tests::TestBackend;
            use tower::ServiceExt as _;

            type Db = $db;
            type Conn = <Db as sqlx::Database>::Connection;
            type Pool = sqlx::Pool<Db>;
            const APPLY_EFFECT: &str = <Db as TestBackend>::APPLY_EFFECT;

            #[inbox_runtime::idempotent(consumer = "ledger")]
            async fn credit(conn: &mut Conn, msg: Payment) -> Result<(), sqlx::Error> {
                sqlx::query(APPLY_EFFECT)
                    .bind(scoped_key(&msg.id))
                    .bind(msg.amount)
                    .execute(&mut *conn)
                    .await?;
                Ok(())
            }

            /// Always fails: dead at its first attempt.
            #[inbox_runtime::idempotent(consumer = "jobs", max_attempts = 1)]
            async fn poison(_conn: &mut Conn, _msg: Job) -> Result<(), JobError> {
                Err(JobError::Fails)
            }

            /// Publishes one outbox row per order, its message id the order's id.
            #[inbox_runtime::idempotent(consumer = "orders")]
            async fn on_order(conn: &mut Conn, msg: Order) -> Result<(), JobError> {
                let message = inbox_runtime::outbox::OutboxMessage::raw(
                    "orders",
                    "orders.placed",
                    format!(r#"{{"id":"{}"}}"#, msg.id),
                )
                .message_id(scoped_key(&msg.id));
                OUTBOX.publish(&mut *conn, message).await?;
                Ok(())
            }

            /// `POST /pay/{id}`: the effect of `id`, amount 5, on the request's transaction.
            async fn pay(
                axum::extract::Path(id): axum::extract::Path<String>,
                mut tx: inbox_runtime::http::IdempotencyTx<Db>,
            ) -> axum::http::StatusCode {
                sqlx::query(APPLY_EFFECT)
                    .bind(scoped_key(&id))
                    .bind(5_i64)
                    .execute(tx.connection())
                    .await
                    .unwrap();
                axum::http::StatusCode::CREATED
            }

            async fn count(pool: &Pool, table: &str) -> i64 {
                sqlx::query_scalar(sqlx::AssertSqlSafe(format!("SELECT COUNT(*) FROM {table}")))
                    .fetch_one(pool)
                    .await
                    .unwrap()
            }

            /// The dead letters the admin API lists in the current scope: `(consumer, key)`.
            async fn dead(pool: &Pool) -> Vec<(String, String)> {
                admin::list(pool, None, &[Status::Dead], 10)
                    .await
                    .unwrap()
                    .into_iter()
                    .map(|m| (m.consumer, m.message_key))
                    .collect()
            }

            /// The message ids one relay round of the current scope publishes.
            async fn relay_round(pool: &Pool) -> Vec<String> {
                let sink = MemorySink::new();
                let relay = Relay::new(pool.clone(), sink.clone());
                let report = relay.run_once().await.unwrap();
                assert_eq!(report.failed + report.dead, 0);
                let mut ids: Vec<String> =
                    sink.published().into_iter().map(|m| m.message_id).collect();
                ids.sort();
                ids
            }

            /// The longest prefix (30 bytes) migrates every component: its longest name (MySQL's
            /// index `…inbox_outbox_aggregates_written_at`) is MySQL's limit, 64 bytes.
            #[tokio::test]
            async fn the_longest_prefix_migrates() {
                let (pool, _guard) = <Db as TestBackend>::fixture(2).await;
                let prefix = TablePrefix::new(&"p".repeat(TablePrefix::MAX_BYTES)).unwrap();
                let components = [Component::Inbox, Component::Outbox, Component::Positions];
                prefix
                    .scope(inbox_runtime::migrate_components(&pool, &components))
                    .await
                    .unwrap();
                for table in ["inbox_outbox", "inbox_positions"] {
                    assert_eq!(count(&pool, &prefix.table(table)).await, 0, "{table}");
                }
                let mut conn = pool.acquire().await.unwrap();
                let payment = Payment {
                    id: "pay-long".into(),
                    amount: 1,
                };
                let outcome = prefix.scope(credit(&mut conn, payment)).await.unwrap();
                assert_eq!(outcome.kind(), "processed");
                assert_eq!(count(&pool, &prefix.table("inbox_messages")).await, 1);
            }

            /// A claim opened in a scope finishes on that prefix's tables wherever it is
            /// completed or failed: here on a task spawned outside the scope, as
            /// `ClaimSession::open_owned`'s own example does. The unprefixed service's inbox in
            /// the same database gets nothing.
            #[tokio::test]
            async fn a_claim_finishes_in_the_scope_it_was_opened_in() {
                use inbox_runtime::{ClaimSession, ClaimState, ErrorClass, Fingerprint};
                use inbox_runtime::{Disposition, IdempotencyKey};
                let (pool, _guard) = <Db as TestBackend>::fixture(4).await;
                let billing = TablePrefix::new("billing_").unwrap();
                inbox_runtime::migrate_components(&pool, &[Component::Inbox])
                    .await
                    .unwrap();
                billing
                    .scope(inbox_runtime::migrate_components(&pool, &[Component::Inbox]))
                    .await
                    .unwrap();
                let fingerprint = Fingerprint::of("exports", &serde_json::json!({"job": 7}))
                    .unwrap();
                let open = |id: &'static str| {
                    let pool = pool.clone();
                    billing.scope(async move {
                        let key = IdempotencyKey::new(id, "exports", "job id").unwrap();
                        let session = ClaimSession::new("exports", &key, "exports", fingerprint);
                        match session
                            .open_owned(pool.acquire().await.unwrap())
                            .await
                            .unwrap()
                        {
                            ClaimState::Claimed(claim) => claim,
                            other => panic!("{id}: expected a claim, got {other:?}"),
                        }
                    })
                };

                // Completed on a task of its own, outside any scope.
                let mut claim = open("export-7").await;
                tokio::spawn(async move {
                    sqlx::query(APPLY_EFFECT)
                        .bind("billing_:export-7")
                        .bind(7_i64)
                        .execute(claim.connection())
                        .await
                        .unwrap();
                    claim.complete(None).await.unwrap();
                })
                .await
                .unwrap();
                assert_eq!(
                    <Db as TestBackend>::effect(&pool, "billing_:export-7").await,
                    Some((1, 7))
                );
                // Failed (dead at once) and abandoned there too.
                let claim = open("export-8").await;
                let disposition = tokio::spawn(async move {
                    claim.fail(ErrorClass::Permanent, "refused", b"{}").await
                })
                .await
                .unwrap();
                assert!(matches!(disposition, Disposition::Dead), "{disposition:?}");
                let claim = open("export-9").await;
                tokio::spawn(async move { claim.abandon().await.unwrap() })
                    .await
                    .unwrap();

                let statuses = |prefix: Option<&TablePrefix>| {
                    let pool = pool.clone();
                    let prefix = prefix.cloned();
                    async move {
                        let rows = match prefix {
                            Some(prefix) => prefix.scope(admin::stats(&pool)).await,
                            None => admin::stats(&pool).await,
                        };
                        let mut rows: Vec<(Option<String>, String, i64)> = rows
                            .unwrap()
                            .into_iter()
                            .map(|row| (row.consumer, row.status.as_str().to_owned(), row.count))
                            .collect();
                        rows.sort();
                        rows
                    }
                };
                assert_eq!(
                    statuses(Some(&billing)).await,
                    [
                        (Some("exports".to_owned()), "dead".to_owned(), 1),
                        (Some("exports".to_owned()), "processed".to_owned(), 1)
                    ]
                );
                assert_eq!(statuses(None).await, []);
                assert_eq!(count(&pool, "inbox_messages").await, 0);
                assert_eq!(count(&pool, "billing_inbox_messages").await, 2);
            }

            /// `cli::execute_with` runs every command in the prefix of the dispatcher it is
            /// given (built in a scope), as the dispatcher's own operations do: the listing, the
            /// show and the discard all on `billing_`'s tables, none on the unprefixed
            /// service's.
            #[tokio::test]
            async fn the_cli_with_a_dispatcher_keeps_its_prefix() {
                use clap::Parser as _;
                use inbox_runtime::ops::cli::{AdminCli, execute_with};
                let (pool, _guard) = <Db as TestBackend>::fixture(4).await;
                let billing = TablePrefix::new("billing_").unwrap();
                let components = [Component::Inbox, Component::Outbox];
                inbox_runtime::migrate_components(&pool, &components)
                    .await
                    .unwrap();
                billing
                    .scope(inbox_runtime::migrate_components(&pool, &components))
                    .await
                    .unwrap();
                let jobs = |id: &str| inbox_tests::envelope(&Job { id: id.into() });
                // The unprefixed service's dead letter, and the billing one's.
                let unprefixed = Dispatcher::from_registry(pool.clone()).unwrap();
                let dispatched = unprefixed.dispatch(&jobs("poison-u")).await.unwrap();
                assert_eq!(inbox_tests::outcome_kinds(&dispatched), [Err("handler")]);
                let dispatcher = billing
                    .scope(async { Dispatcher::from_registry(pool.clone()).unwrap() })
                    .await;
                let dispatched = dispatcher.dispatch(&jobs("poison-b")).await.unwrap();
                assert_eq!(inbox_tests::outcome_kinds(&dispatched), [Err("handler")]);

                let run = |args: &'static str| {
                    let dispatcher = &dispatcher;
                    async move {
                        let cli = AdminCli::try_parse_from(
                            std::iter::once("admin").chain(args.split_whitespace()),
                        )
                        .unwrap();
                        let mut out = Vec::new();
                        let result = execute_with(&cli.command, dispatcher, &mut out).await;
                        (result.map_err(|e| e.to_string()), String::from_utf8(out).unwrap())
                    }
                };
                let (listed, list) = run("dead list").await;
                assert_eq!(listed, Ok(()));
                assert!(list.contains("poison-b"), "{list}");
                assert!(!list.contains("poison-u"), "{list}");
                let (shown, show) = run("dead show jobs poison-b").await;
                assert_eq!(shown, Ok(()), "{show}");
                let (shown, _) = run("dead show jobs poison-u").await;
                assert!(shown.is_err(), "{shown:?}");
                let (discarded, _) = run("dead discard jobs poison-b").await;
                assert_eq!(discarded, Ok(()));
                assert_eq!(
                    billing.scope(dead(&pool)).await,
                    Vec::<(String, String)>::new()
                );
                assert_eq!(dead(&pool).await, [("jobs".to_owned(), "poison-u".to_owned())]);
            }

            /// A console serves its dispatcher's prefix, whatever scope it is built in: the
            /// messages it lists are the ones its replay and discard buttons act on (the
            /// dispatcher's).
            #[tokio::test]
            async fn a_console_serves_its_dispatchers_prefix() {
                let (pool, _guard) = <Db as TestBackend>::fixture(4).await;
                let billing = TablePrefix::new("billing_").unwrap();
                let shipping = TablePrefix::new("shipping_").unwrap();
                for prefix in [&billing, &shipping] {
                    prefix
                        .scope(inbox_runtime::migrate_components(&pool, &[Component::Inbox]))
                        .await
                        .unwrap();
                }
                let jobs = |id: &str| inbox_tests::envelope(&Job { id: id.into() });
                let dispatcher = std::sync::Arc::new(
                    billing
                        .scope(async { Dispatcher::from_registry(pool.clone()).unwrap() })
                        .await,
                );
                let dispatched = dispatcher.dispatch(&jobs("poison-b")).await.unwrap();
                assert_eq!(inbox_tests::outcome_kinds(&dispatched), [Err("handler")]);
                let dispatched = shipping
                    .scope(
                        Dispatcher::from_registry(pool.clone())
                            .unwrap()
                            .dispatch(&jobs("poison-s")),
                    )
                    .await
                    .unwrap();
                assert_eq!(inbox_tests::outcome_kinds(&dispatched), [Err("handler")]);
                let console: axum::Router = shipping
                    .scope(async {
                        inbox_runtime::ops::console::Console::new(std::sync::Arc::clone(
                            &dispatcher,
                        ))
                        .behind_own_auth()
                        .build()
                        .unwrap()
                    })
                    .await;
                let request = axum::http::Request::builder()
                    .uri("/messages?status=dead&limit=10")
                    .body(axum::body::Body::empty())
                    .unwrap();
                let html = tokio::spawn(console.oneshot(request))
                    .await
                    .unwrap()
                    .unwrap();
                assert_eq!(html.status(), 200);
                let html = axum::body::to_bytes(html.into_body(), usize::MAX)
                    .await
                    .unwrap();
                let html = String::from_utf8(html.to_vec()).unwrap();
                assert!(html.contains("poison-b"), "{html}");
                assert!(!html.contains("poison-s"), "{html}");
            }

            /// A worker built in a scope keeps its prefix on a task spawned outside it, its
            /// dispatcher built outside any scope: pay-1 processed on `billing_`'s tables, none
            /// on the unprefixed ones.
            #[tokio::test]
            async fn a_worker_built_in_a_scope_keeps_its_prefix() {
                let (pool, _guard) = <Db as TestBackend>::fixture(4).await;
                let billing = TablePrefix::new("billing_").unwrap();
                inbox_runtime::migrate_components(&pool, &[Component::Inbox])
                    .await
                    .unwrap();
                billing
                    .scope(inbox_runtime::migrate_components(&pool, &[Component::Inbox]))
                    .await
                    .unwrap();
                let dispatcher = Dispatcher::from_registry(pool.clone()).unwrap();
                let worker = billing
                    .scope(async { inbox_runtime::Worker::new(dispatcher) })
                    .await;
                let source = inbox_runtime::source::memory::MemorySource::new("memory");
                let handle = source.handle();
                handle.push(inbox_tests::envelope(&Payment {
                    id: "pay-1".into(),
                    amount: 3,
                }));
                handle.close();
                let report = tokio::spawn(async move {
                    worker
                        .run(source, inbox_runtime::CancellationToken::new())
                        .await
                        .unwrap()
                })
                .await
                .unwrap();
                assert_eq!((report.acked, report.processed), (1, 1), "{report:?}");
                assert_eq!(
                    <Db as TestBackend>::effect(&pool, "billing_:pay-1").await,
                    Some((1, 3))
                );
                assert_eq!(count(&pool, "billing_inbox_messages").await, 1);
                assert_eq!(count(&pool, "inbox_messages").await, 0);
            }

            #[tokio::test]
            async fn two_prefixes_share_one_database() {
                // Migrated without a prefix too: a third service of the same database.
                let (pool, _guard) = <Db as TestBackend>::fixture(4).await;
                inbox_runtime::migrate_components(&pool, &[Component::Outbox])
                    .await
                    .unwrap();
                let billing = TablePrefix::new("billing_").unwrap();
                let shipping = TablePrefix::new("shipping_").unwrap();
                for prefix in [&billing, &shipping] {
                    let components = [Component::Inbox, Component::Outbox, Component::Positions];
                    prefix
                        .scope(inbox_runtime::migrate_components(&pool, &components))
                        .await
                        .unwrap();
                    // Again: idempotent, on the prefix's own history.
                    prefix
                        .scope(inbox_runtime::migrate_components(&pool, &components))
                        .await
                        .unwrap();
                }

                // The same consumer and key: processed once per prefix, then duplicates.
                let payment = Payment {
                    id: "pay-1".into(),
                    amount: 250,
                };
                let mut outcomes = Vec::new();
                for prefix in [&billing, &shipping, &billing, &shipping] {
                    let outcome = prefix
                        .scope(async {
                            let mut conn = pool.acquire().await.unwrap();
                            credit(&mut conn, payment.clone()).await.unwrap()
                        })
                        .await;
                    outcomes.push(outcome.kind());
                }
                let mut conn = pool.acquire().await.unwrap();
                outcomes.push(credit(&mut conn, payment.clone()).await.unwrap().kind());
                drop(conn);
                assert_eq!(
                    outcomes,
                    [
                        "processed",
                        "processed",
                        "duplicate",
                        "duplicate",
                        "processed"
                    ]
                );
                for key in ["billing_:pay-1", "shipping_:pay-1", ":pay-1"] {
                    assert_eq!(
                        <Db as TestBackend>::effect(&pool, key).await,
                        Some((1, 250)),
                        "{key}"
                    );
                }
                assert_eq!(<Db as TestBackend>::effects(&pool).await.len(), 3);
                for table in [
                    "billing_inbox_messages",
                    "shipping_inbox_messages",
                    "inbox_messages",
                ] {
                    assert_eq!(count(&pool, table).await, 1, "{table}");
                }

                // Dead letters: each prefix's admin listing shows its own only.
                let jobs = |id: &str| inbox_tests::envelope(&Job { id: id.into() });
                let billing_dispatcher =
                    std::sync::Arc::new(Dispatcher::from_registry(pool.clone()).unwrap());
                let dispatched = billing
                    .scope(billing_dispatcher.dispatch(&jobs("poison-b")))
                    .await
                    .unwrap();
                assert_eq!(inbox_tests::outcome_kinds(&dispatched), [Err("handler")]);
                let dispatcher = Dispatcher::from_registry(pool.clone()).unwrap();
                let dispatched = shipping
                    .scope(dispatcher.dispatch(&jobs("poison-s")))
                    .await
                    .unwrap();
                assert_eq!(inbox_tests::outcome_kinds(&dispatched), [Err("handler")]);
                // A redelivery within the prefix finds the dead letter.
                let dispatched = shipping
                    .scope(dispatcher.dispatch(&jobs("poison-s")))
                    .await
                    .unwrap();
                assert_eq!(inbox_tests::outcome_kinds(&dispatched), [Ok("dead")]);
                assert_eq!(
                    billing.scope(dead(&pool)).await,
                    [("jobs".to_owned(), "poison-b".to_owned())]
                );
                assert_eq!(
                    shipping.scope(dead(&pool)).await,
                    [("jobs".to_owned(), "poison-s".to_owned())]
                );
                assert_eq!(dead(&pool).await, []);
                let stats = shipping.scope(admin::stats(&pool)).await.unwrap();
                let mut stats: Vec<(Option<String>, i64)> = stats
                    .into_iter()
                    .map(|row| (row.consumer, row.count))
                    .collect();
                stats.sort();
                assert_eq!(
                    stats,
                    [(Some("jobs".to_owned()), 1), (Some("ledger".to_owned()), 1)]
                );

                // The console built in a scope serves that prefix's rows, whatever task
                // serves the request.
                let console: axum::Router = billing
                    .scope(async {
                        inbox_runtime::ops::console::Console::new(std::sync::Arc::clone(
                            &billing_dispatcher,
                        ))
                        .behind_own_auth()
                        .build()
                        .unwrap()
                    })
                    .await;
                let request = axum::http::Request::builder()
                    .uri("/messages?status=dead&limit=10")
                    .body(axum::body::Body::empty())
                    .unwrap();
                let html = tokio::spawn(console.oneshot(request))
                    .await
                    .unwrap()
                    .unwrap();
                assert_eq!(html.status(), 200);
                let html = axum::body::to_bytes(html.into_body(), usize::MAX)
                    .await
                    .unwrap();
                let html = String::from_utf8(html.to_vec()).unwrap();
                assert!(html.contains("poison-b"), "{html}");
                assert!(!html.contains("poison-s"), "{html}");

                // The outbox: each prefix's relay publishes its own rows, once.
                for (prefix, id) in [(&billing, "o-1"), (&shipping, "o-1"), (&shipping, "o-2")] {
                    let order = inbox_tests::envelope(&Order { id: id.into() });
                    let dispatched = prefix.scope(dispatcher.dispatch(&order)).await.unwrap();
                    assert_eq!(inbox_tests::outcome_kinds(&dispatched), [Ok("processed")]);
                }
                assert_eq!(count(&pool, "inbox_outbox").await, 0);
                assert_eq!(relay_round(&pool).await, Vec::<String>::new());
                assert_eq!(billing.scope(relay_round(&pool)).await, ["billing_:o-1"]);
                assert_eq!(
                    shipping.scope(relay_round(&pool)).await,
                    ["shipping_:o-1", "shipping_:o-2"]
                );
                assert_eq!(
                    billing.scope(relay_round(&pool)).await,
                    Vec::<String>::new()
                );
                assert_eq!(count(&pool, "billing_inbox_outbox").await, 1);
                assert_eq!(count(&pool, "shipping_inbox_outbox").await, 2);

                // A dispatcher, a worker and a relay built in a scope keep its prefix on tasks
                // spawned outside it: a worker of `billing_` delivers pay-1 (a duplicate there)
                // and pay-2, the relay of `shipping_` publishes o-3 of `shipping_` only.
                let (worker, relay, sink) = billing
                    .scope(async {
                        let worker = inbox_runtime::Worker::new(
                            Dispatcher::from_registry(pool.clone()).unwrap(),
                        );
                        let sink = MemorySink::new();
                        let relay =
                            shipping.scope(async { Relay::new(pool.clone(), sink.clone()) });
                        (worker, relay.await, sink)
                    })
                    .await;
                let source = inbox_runtime::source::memory::MemorySource::new("memory");
                let handle = source.handle();
                for (id, amount) in [("pay-1", 250), ("pay-2", 7)] {
                    handle.push(inbox_tests::envelope(&Payment {
                        id: id.into(),
                        amount,
                    }));
                }
                handle.close();
                let report = tokio::spawn(async move {
                    worker
                        .run(source, inbox_runtime::CancellationToken::new())
                        .await
                        .unwrap()
                })
                .await
                .unwrap();
                assert_eq!(
                    (
                        report.acked,
                        report.processed,
                        report.duplicates,
                        report.failed
                    ),
                    (2, 1, 1, 0),
                    "{report:?}"
                );
                assert_eq!(
                    <Db as TestBackend>::effect(&pool, "billing_:pay-2").await,
                    Some((1, 7))
                );
                assert_eq!(
                    <Db as TestBackend>::effect(&pool, "billing_:pay-1").await,
                    Some((1, 250))
                );
                assert_eq!(count(&pool, "billing_inbox_messages").await, 4);
                assert_eq!(count(&pool, "shipping_inbox_messages").await, 4);
                let order = inbox_tests::envelope(&Order { id: "o-3".into() });
                let dispatched = shipping.scope(dispatcher.dispatch(&order)).await.unwrap();
                assert_eq!(inbox_tests::outcome_kinds(&dispatched), [Ok("processed")]);
                // On PostgreSQL a row is published once no transaction older than its own is
                // running (the outbox's commit-order horizon, over the whole server): another
                // test's transaction can hold o-3 back for a moment, so the spawned task runs
                // rounds (at most for 30 s) until one publishes, and the totals are checked.
                let round = tokio::spawn(async move {
                    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
                    let (mut leased, mut published) = (0, 0);
                    loop {
                        let round = relay.run_once().await.unwrap();
                        leased += round.leased;
                        published += round.published;
                        if published > 0 || std::time::Instant::now() >= deadline {
                            break (leased, published);
                        }
                        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
                    }
                })
                .await
                .unwrap();
                assert_eq!(round, (1, 1));
                let published: Vec<String> =
                    sink.published().into_iter().map(|m| m.message_id).collect();
                assert_eq!(published, ["shipping_:o-3"]);

                // The Idempotency-Key layer built in a scope claims its keys there, whatever task
                // serves the request: the same key twice runs the handler once.
                let app: axum::Router = billing
                    .scope(async {
                        axum::Router::new()
                            .route("/pay/{id}", axum::routing::post(pay))
                            .route_layer(inbox_runtime::http::IdempotencyLayer::new(pool.clone()))
                    })
                    .await;
                let mut statuses = Vec::new();
                for _ in 0..2 {
                    let request = axum::http::Request::builder()
                        .method("POST")
                        .uri("/pay/h-1")
                        .header("idempotency-key", "\"h-1\"")
                        .body(axum::body::Body::empty())
                        .unwrap();
                    let response = tokio::spawn(app.clone().oneshot(request))
                        .await
                        .unwrap()
                        .unwrap();
                    statuses.push(response.status().as_u16());
                }
                assert_eq!(statuses, [201, 201]);
                assert_eq!(
                    <Db as TestBackend>::effect(&pool, "billing_:h-1").await,
                    Some((1, 5))
                );
                assert_eq!(count(&pool, "billing_inbox_messages").await, 5);
                assert_eq!(count(&pool, "inbox_messages").await, 1);

                // Each prefix's migration history is complete, in its own table.
                for prefix in ["billing_", "shipping_", ""] {
                    let inbox = count(&pool, &format!("{prefix}_inbox_migrations")).await;
                    let outbox = count(&pool, &format!("{prefix}_inbox_outbox_migrations")).await;
                    assert_eq!((inbox, outbox), <Db as Versions>::VERSIONS, "{prefix:?}");
                }
            }
        }
    };
}

/// How many inbox and outbox migrations each backend has.
trait Versions {
    const VERSIONS: (i64, i64);
}

impl Versions for sqlx::Postgres {
    const VERSIONS: (i64, i64) = (6, 4);
}

impl Versions for sqlx::Sqlite {
    const VERSIONS: (i64, i64) = (5, 4);
}

impl Versions for sqlx::MySql {
    const VERSIONS: (i64, i64) = (2, 4);
}

prefix_tests!(postgres, sqlx::Postgres);
prefix_tests!(sqlite, sqlx::Sqlite);
prefix_tests!(mysql, sqlx::MySql);

/// SQLite's index names are per database: each prefix's migration made its own, as many as
/// the unprefixed migration.
#[tokio::test]
async fn sqlite_indexes_carry_the_prefix() {
    let (pool, _guard) = inbox_tests::sqlite_pool(1).await;
    let billing = TablePrefix::new("billing_").unwrap();
    billing.scope(inbox_runtime::migrate(&pool)).await.unwrap();
    let names = |pattern: &'static str| {
        let pool = pool.clone();
        async move {
            sqlx::query_scalar::<_, String>(
                "SELECT name FROM sqlite_master WHERE type = 'index' AND name LIKE ?1 \
                 AND name NOT LIKE 'sqlite_autoindex%' ORDER BY name",
            )
            .bind(pattern)
            .fetch_all(&pool)
            .await
            .unwrap()
        }
    };
    let unprefixed = names("inbox%").await;
    let prefixed = names("billing%").await;
    assert!(!unprefixed.is_empty());
    assert_eq!(
        prefixed,
        unprefixed
            .iter()
            .map(|name| format!("billing_{name}"))
            .collect::<Vec<_>>()
    );
}

#[test]
fn hostile_prefixes_are_refused() {
    for (prefix, expected) in [
        ("", TablePrefixError::Empty),
        (
            "billing_; DROP TABLE effects",
            TablePrefixError::Character { found: ';', at: 8 },
        ),
        (
            "bill`ing",
            TablePrefixError::Character { found: '`', at: 4 },
        ),
        (
            "bill ing",
            TablePrefixError::Character { found: ' ', at: 4 },
        ),
        (
            "bill\0ing",
            TablePrefixError::Character { found: '\0', at: 4 },
        ),
        (
            "Billing_",
            TablePrefixError::Character { found: 'B', at: 0 },
        ),
        ("9lives_", TablePrefixError::Character { found: '9', at: 0 }),
        ("inbox_billing_", TablePrefixError::Reserved),
        ("_inbox_", TablePrefixError::Reserved),
    ] {
        assert_eq!(
            TablePrefix::new(prefix),
            Err(expected.clone()),
            "{prefix:?}"
        );
    }
    assert_eq!(
        TablePrefix::new(&"p".repeat(31)),
        Err(TablePrefixError::TooLong { bytes: 31 })
    );
    assert_eq!(
        TablePrefix::new(&"p".repeat(30)).unwrap().as_str().len(),
        30
    );
    assert_eq!(
        TablePrefix::new(&"p".repeat(31)).unwrap_err().to_string(),
        "table prefix is 31 bytes long; at most 30 bytes, so that the longest table or index \
         name (34 bytes without it) stays within MySQL's 64-byte identifier limit"
    );
    assert_eq!(
        TablePrefix::new("inbox_billing_").unwrap_err().to_string(),
        "table prefix starts with 'inbox_' or '_inbox_', as the runtime's own table names do"
    );
}
