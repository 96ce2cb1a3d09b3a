#![allow(unused)]

use inbox_runtime::{handler, idempotent, Dispatcher, Message, dispatch::Registration};
use serde::{Deserialize, Serialize};

#[derive(Clone, Serialize, Deserialize, Message)]
struct Msg {
    #[message(key)]
    id: u64,
}

mod handlers {
    use super::Msg;

    #[inbox_runtime::idempotent(consumer = "a")]
    pub(crate) async fn a(conn: &mut sqlx::PgConnection, msg: Msg) -> Result<(), sqlx::Error> {
        Ok(())
    }
}

#[idempotent(consumer = "b")]
async fn r#b(conn: &mut sqlx::PgConnection, msg: Msg) -> Result<(), sqlx::Error> {
    Ok(())
}

fn listed() -> [Registration; 4] {
    [
        handler!(handlers::a),
        handler!(crate::handlers::a),
        handler!(self::handlers::a),
        handler!(r#b),
    ]
}

fn dispatcher(pool: sqlx::PgPool) -> Dispatcher<sqlx::Postgres> {
    Dispatcher::from_handlers(pool, listed()).unwrap()
}

fn main() {}
