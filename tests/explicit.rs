//! Explicit registration: `Dispatcher::from_handlers` with `handler!(path::to::function)`, the
//! fallback for handlers the `inventory` registry cannot see. (A test binary of its own: its
//! registry must hold exactly these handlers.)

#![allow(missing_docs)]

use inbox_runtime::{
    Dispatcher, Envelope, Message, Outcome, RegistryError, handler, store::Backend,
};
use serde::{Deserialize, Serialize};

/// A charge, taken by two consumers.
#[derive(Debug, Clone, Serialize, Deserialize, Message)]
#[message(name = "test.charge")]
pub struct Charge {
    #[message(key)]
    pub id: String,
    pub amount: i64,
}

mod billing {
    use super::Charge;
    use inbox_tests::APPLY_EFFECT;
    use sqlx::PgConnection;

    /// The handler the test lists.
    #[inbox_runtime::idempotent(consumer = "billing")]
    pub async fn charge(conn: &mut PgConnection, msg: Charge) -> Result<(), sqlx::Error> {
        sqlx::query(APPLY_EFFECT)
            .bind("billing")
            .bind(msg.amount)
            .execute(conn)
            .await?;
        Ok(())
    }

    /// Registered in `inventory` too, but not listed: an explicit dispatcher never runs it.
    #[inbox_runtime::idempotent(consumer = "audit")]
    pub(crate) async fn audit(conn: &mut PgConnection, msg: Charge) -> Result<(), sqlx::Error> {
        sqlx::query(APPLY_EFFECT)
            .bind("audit")
            .bind(msg.amount)
            .execute(conn)
            .await?;
        Ok(())
    }
}

mod lite {
    use super::Charge;

    /// A SQLite handler: listing it for a PostgreSQL pool is refused.
    #[inbox_runtime::idempotent(consumer = "lite")]
    pub async fn on_sqlite(
        _conn: &mut sqlx::SqliteConnection,
        _msg: Charge,
    ) -> Result<(), sqlx::Error> {
        Ok(())
    }
}

fn charge(id: &str, amount: i64) -> Envelope {
    let msg = Charge {
        id: id.into(),
        amount,
    };
    Envelope::new(Charge::NAME, serde_json::to_vec(&msg).unwrap())
}

#[tokio::test]
async fn only_the_listed_handlers_run() {
    let pool = inbox_tests::pg_pool(2).await;
    // Listed twice: the same handler once.
    let explicit = Dispatcher::from_handlers(
        pool.clone(),
        [handler!(billing::charge), handler!(crate::billing::charge)],
    )
    .unwrap();
    let functions: Vec<&str> = explicit.handlers().iter().map(|h| h.function).collect();
    assert_eq!(functions, ["explicit::billing::charge"]);
    let registry = Dispatcher::from_registry(pool.clone()).unwrap();
    let consumers: Vec<&str> = registry.handlers().iter().map(|h| h.consumer).collect();
    assert_eq!(consumers, ["audit", "billing"]);

    for _ in 0..2 {
        let outcomes = explicit.dispatch(&charge("c-1", 250)).await.unwrap();
        assert_eq!(outcomes.len(), 1);
        assert_eq!(outcomes[0].consumer, "billing");
    }
    let effects: Vec<(String, i64, i64)> =
        sqlx::query_as("SELECT effect_key, applied, total FROM effects ORDER BY effect_key")
            .fetch_all(&pool)
            .await
            .unwrap();
    assert_eq!(effects, [("billing".to_owned(), 1, 250)]);
    let outcomes = registry.dispatch(&charge("c-1", 250)).await.unwrap();
    let results: Vec<(&str, bool)> = outcomes
        .iter()
        .map(|o| (o.consumer, matches!(o.result, Ok(Outcome::Processed(())))))
        .collect();
    // The audit consumer sees the charge for the first time; billing already has it.
    assert_eq!(results, [("audit", true), ("billing", false)]);
}

#[tokio::test]
async fn a_registration_knows_its_handler() {
    let info = handler!(billing::audit).info();
    assert_eq!(
        (
            info.consumer,
            info.message_name,
            info.function,
            info.backend
        ),
        (
            "audit",
            "test.charge",
            "explicit::billing::audit",
            Backend::Postgres
        )
    );
}

#[tokio::test]
async fn a_wrong_backend_or_an_empty_list_is_refused() {
    let pool = sqlx::PgPool::connect_lazy(&inbox_tests::database_url()).unwrap();
    let error = Dispatcher::from_handlers(
        pool.clone(),
        [handler!(billing::charge), handler!(lite::on_sqlite)],
    )
    .unwrap_err();
    assert_eq!(
        error,
        RegistryError::WrongBackend {
            function: "explicit::lite::on_sqlite",
            backend: Backend::Sqlite,
            expected: Backend::Postgres,
        }
    );
    assert_eq!(
        error.to_string(),
        "handler `explicit::lite::on_sqlite` takes a sqlite connection, but the dispatcher's pool is postgres"
    );
    let error = Dispatcher::from_handlers(pool, []).unwrap_err();
    assert_eq!(
        error,
        RegistryError::NoHandlersListed {
            backend: Backend::Postgres
        }
    );
}
