//! Registry checks at start: two handlers sharing a consumer for one message, and a backend
//! with no handlers at all. (A test binary of its own: its registry must hold exactly these.)

#![allow(missing_docs)]

use inbox_runtime::{Dispatcher, Message, RegistryError, store::Backend};
use serde::{Deserialize, Serialize};
use sqlx::PgConnection;

/// A message two handlers claim under the same consumer.
#[derive(Debug, Clone, Serialize, Deserialize, Message)]
#[message(name = "test.twice")]
pub struct Twice {
    #[message(key)]
    pub id: String,
}

/// One handler.
#[inbox_runtime::idempotent(consumer = "dup")]
pub async fn first(_conn: &mut PgConnection, _msg: Twice) -> Result<(), sqlx::Error> {
    Ok(())
}

/// The other, same consumer, same message: the dispatcher must refuse to start.
#[inbox_runtime::idempotent(consumer = "dup")]
pub async fn second(_conn: &mut PgConnection, _msg: Twice) -> Result<(), sqlx::Error> {
    Ok(())
}

#[tokio::test]
async fn two_handlers_with_one_consumer_for_one_message_are_refused() {
    let pool = sqlx::PgPool::connect_lazy(&inbox_tests::database_url()).unwrap();
    let error = Dispatcher::from_registry(pool).unwrap_err();
    assert_eq!(
        error,
        RegistryError::DuplicateConsumer {
            consumer: "dup",
            message_name: "test.twice",
            first: "registry::first",
            second: "registry::second",
        }
    );
    assert!(
        error
            .to_string()
            .contains("consumer `dup` has two handlers for message `test.twice`")
    );
}

#[tokio::test]
async fn a_backend_without_handlers_is_refused() {
    let pool = sqlx::SqlitePool::connect("sqlite::memory:").await.unwrap();
    let error = Dispatcher::from_registry(pool).unwrap_err();
    assert_eq!(
        error,
        RegistryError::NoHandlers {
            backend: Backend::Sqlite,
            other: 2
        }
    );
    // Handlers exist, for PostgreSQL: the text says what picks a handler's backend.
    assert!(
        error.to_string().starts_with(
            "no #[idempotent] handlers for sqlite are registered (2 for other backends): a \
             handler's first parameter picks its backend (`&mut PgConnection`: postgres, "
        ),
        "{error}"
    );
    let listed: Vec<_> = inbox_runtime::dispatch::registered_handlers()
        .into_iter()
        .map(|h| (h.message_name, h.consumer, h.function, h.backend))
        .collect();
    assert_eq!(
        listed,
        [
            ("test.twice", "dup", "registry::first", Backend::Postgres),
            ("test.twice", "dup", "registry::second", Backend::Postgres),
        ]
    );
    let _ = Twice::NAME;
}
