#![allow(unused)]

use inbox_runtime::{idempotent, Message};
use serde::{Deserialize, Serialize};
use sqlx::PgConnection;

#[derive(Clone, Serialize, Deserialize, Message)]
struct Msg {
    #[message(key)]
    id: u64,
}

struct Handlers;

impl Handlers {
    #[idempotent(consumer = "a")]
    async fn by_ref(&self, conn: &mut PgConnection, msg: Msg) -> Result<(), sqlx::Error> {
        Ok(())
    }

    #[idempotent(consumer = "b")]
    async fn by_value(self, conn: &mut PgConnection) -> Result<(), sqlx::Error> {
        Ok(())
    }
}
fn main() {}
