//! The runtime's tables in a PostgreSQL schema of the user's choice (`PgSchema`): two services
//! with their own schemas in one database, each deduplicating on its own — the same consumer
//! name and idempotency key are processed once in each schema, and a redelivery is a duplicate
//! in each — while the database's `public` schema (migrated too) keeps no row of either. A
//! hostile schema name is refused before anything reaches the server.

#![allow(missing_docs)]

use inbox_runtime::store::PgSchemaError;
use inbox_runtime::{Message, PgSchema};
use serde::{Deserialize, Serialize};
use sqlx::PgPool;
use sqlx::postgres::PgPoolOptions;

#[derive(Debug, Clone, Serialize, Deserialize, Message)]
#[message(name = "test.schema_payment")]
pub struct Payment {
    #[message(key)]
    pub id: String,
    pub amount: i64,
}

#[inbox_runtime::idempotent(consumer = "ledger")]
async fn credit(conn: &mut sqlx::PgConnection, msg: Payment) -> Result<(), sqlx::Error> {
    sqlx::query(inbox_tests::APPLY_EFFECT)
        .bind(&msg.id)
        .bind(msg.amount)
        .execute(&mut *conn)
        .await?;
    Ok(())
}

/// A pool on `base`'s database whose connections use `schema`, with the schema created, the
/// runtime migrated into it and the test `effects` table in it.
async fn service(base: &PgPool, schema: &PgSchema) -> PgPool {
    let options = (*base.connect_options()).clone();
    let pool = PgPoolOptions::new()
        .max_connections(2)
        .connect_with(schema.connect_options(options))
        .await
        .unwrap();
    schema.create(&pool).await.unwrap();
    inbox_runtime::migrate(&pool).await.unwrap();
    sqlx::raw_sql(inbox_tests::EFFECTS_TABLE)
        .execute(&pool)
        .await
        .unwrap();
    pool
}

/// `(applied, total)` of `key` in `schema`'s effects table, read through `pool` (any schema).
async fn effect(pool: &PgPool, schema: &str, key: &str) -> Option<(i64, i64)> {
    sqlx::query_as(sqlx::AssertSqlSafe(format!(
        "SELECT applied, total FROM \"{schema}\".effects WHERE effect_key = $1"
    )))
    .bind(key)
    .fetch_optional(pool)
    .await
    .unwrap()
}

/// The inbox rows of `schema`: `(consumer, key, status)`.
async fn inbox_rows(pool: &PgPool, schema: &str) -> Vec<(String, String, String)> {
    sqlx::query_as(sqlx::AssertSqlSafe(format!(
        "SELECT consumer, message_key, status::text FROM \"{schema}\".inbox_messages \
         ORDER BY consumer, message_key"
    )))
    .fetch_all(pool)
    .await
    .unwrap()
}

#[tokio::test]
async fn two_services_in_two_schemas_deduplicate_on_their_own() {
    // A fresh database, migrated in `public` too: the schemas' pools must not use its tables.
    let base = inbox_tests::pg_pool(2).await;
    let billing = PgSchema::new("billing").unwrap();
    let shipping = PgSchema::new("Shipping_2").unwrap();
    let billing_pool = service(&base, &billing).await;
    let shipping_pool = service(&base, &shipping).await;

    let payment = Payment {
        id: "pay-1".into(),
        amount: 250,
    };
    let mut outcomes = Vec::new();
    for pool in [&billing_pool, &shipping_pool, &billing_pool, &shipping_pool] {
        let mut conn = pool.acquire().await.unwrap();
        let outcome = credit(&mut conn, payment.clone()).await.unwrap();
        outcomes.push(outcome.kind());
    }
    assert_eq!(
        outcomes,
        ["processed", "processed", "duplicate", "duplicate"]
    );

    for schema in ["billing", "Shipping_2"] {
        assert_eq!(
            effect(&base, schema, "pay-1").await,
            Some((1, 250)),
            "{schema}"
        );
        assert_eq!(
            inbox_rows(&base, schema).await,
            [(
                "ledger".to_owned(),
                "pay-1".to_owned(),
                "processed".to_owned()
            )],
            "{schema}"
        );
    }
    assert_eq!(effect(&base, "public", "pay-1").await, None);
    assert_eq!(inbox_rows(&base, "public").await, []);

    // Each schema has its own migration history, complete.
    for schema in ["billing", "Shipping_2", "public"] {
        let versions: i64 = sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
            "SELECT count(*) FROM \"{schema}\"._inbox_migrations WHERE success"
        )))
        .fetch_one(&base)
        .await
        .unwrap();
        assert_eq!(versions, 6, "{schema}");
    }
    // The outbox in a schema: installed there, not in the schema-less pool's `public`.
    inbox_runtime::migrate_components(&billing_pool, &[inbox_runtime::Component::Outbox])
        .await
        .unwrap();
    let installed: Vec<(String,)> = sqlx::query_as(
        "SELECT schemaname::text FROM pg_tables WHERE tablename = 'inbox_outbox' ORDER BY 1",
    )
    .fetch_all(&base)
    .await
    .unwrap();
    assert_eq!(installed, [("billing".to_owned(),)]);
}

#[test]
fn hostile_schema_names_are_refused() {
    for (name, expected) in [
        ("", PgSchemaError::Empty),
        (
            "billing; DROP TABLE effects",
            PgSchemaError::Character { found: ';', at: 7 },
        ),
        (
            "billing\",public,\"x",
            PgSchemaError::Character { found: '"', at: 7 },
        ),
        ("bill ing", PgSchemaError::Character { found: ' ', at: 4 }),
        ("bill\0ing", PgSchemaError::Character { found: '\0', at: 4 }),
        ("pg_temp", PgSchemaError::Reserved),
    ] {
        assert_eq!(PgSchema::new(name), Err(expected.clone()), "{name:?}");
    }
    let long = "s".repeat(64);
    assert_eq!(
        PgSchema::new(&long),
        Err(PgSchemaError::TooLong { bytes: 64 })
    );
    assert_eq!(
        PgSchema::new("billing; DROP TABLE effects")
            .unwrap_err()
            .to_string(),
        "schema name holds ';' at byte 7; only ASCII letters, digits and '_' are allowed, \
         and not a digit first"
    );
}

/// A `PgSchema` whose schema was never created (`create` not called, or a typo in the name of
/// one created by hand). Found by review when the `search_path` was `"<schema>",public`:
/// PostgreSQL skips a schema that does not exist, so the service's migration and its rows
/// silently landed in (or used) `public`, the tables of another service of the same database.
/// Now the path holds the schema alone: `migrate` and the delivery fail with the server's
/// reason, and `public` keeps no row of this service.
#[tokio::test]
async fn a_schema_never_created_does_not_fall_back_to_public() {
    let base = inbox_tests::pg_pool(2).await;
    let orders = PgSchema::new("orders").unwrap();
    let options = (*base.connect_options()).clone();
    let pool = PgPoolOptions::new()
        .max_connections(2)
        .connect_with(orders.connect_options(options))
        .await
        .unwrap();
    // No `orders.create(&pool)`.
    let migrated = inbox_runtime::migrate(&pool).await;
    let mut conn = pool.acquire().await.unwrap();
    let outcome = credit(
        &mut conn,
        Payment {
            id: "ord-1".into(),
            amount: 5,
        },
    )
    .await
    .map(|outcome| outcome.kind());
    drop(conn);
    assert_eq!(
        inbox_rows(&base, "public").await,
        [],
        "migrate: {migrated:?}, delivery: {outcome:?}"
    );
    // Both refused, with the server's word for why.
    let migrate_error = migrated.unwrap_err().to_string();
    assert!(
        migrate_error.contains("no schema has been selected to create in"),
        "{migrate_error}"
    );
    let delivery_error = outcome.unwrap_err().to_string();
    assert!(
        delivery_error.contains("relation \"inbox_messages\" does not exist"),
        "{delivery_error}"
    );
}

/// Review: a service in its own schema, without the outbox, purges the outbox of the service
/// that uses `public`. The purge asks whether the outbox is installed with
/// `to_regclass('inbox_outbox')`, which resolved through the `search_path` `"<schema>",public`
/// and finds `public.inbox_outbox`; its `DELETE FROM inbox_outbox` then deletes there.
/// Expected: the schema's purge touches no row of `public`.
#[tokio::test]
async fn a_schema_without_the_outbox_does_not_purge_the_public_outbox() {
    let base = inbox_tests::pg_pool(2).await;
    inbox_runtime::migrate_components(&base, &[inbox_runtime::Component::Outbox])
        .await
        .unwrap();
    sqlx::query(
        "INSERT INTO public.inbox_outbox (message_id, destination, message_name, payload, \
         status, sent_at) VALUES ('public-1', 'orders', 'test.sent', '\\x00', 'sent', \
         now() - interval '30 days')",
    )
    .execute(&base)
    .await
    .unwrap();
    let billing = PgSchema::new("billing").unwrap();
    let billing_pool = service(&base, &billing).await;
    let retention: inbox_runtime::ops::admin::Retention =
        serde_json::from_str(r#"{"window": "7d", "redelivery_horizon": "3d"}"#).unwrap();
    let preview = inbox_runtime::ops::admin::purge_preview(&billing_pool, &retention)
        .await
        .unwrap();
    let report = inbox_runtime::ops::admin::purge(&billing_pool, &retention, |_| {})
        .await
        .unwrap();
    let left: i64 = sqlx::query_scalar("SELECT count(*) FROM public.inbox_outbox")
        .fetch_one(&base)
        .await
        .unwrap();
    assert_eq!(
        (preview.outbox.len(), report.outbox_deleted, left),
        (0, 0, 1),
        "the billing service's purge saw and deleted the public service's outbox"
    );
}
