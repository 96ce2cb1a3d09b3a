#![allow(unused)]

use inbox_runtime::{idempotent, Message};
use serde::{Deserialize, Serialize};
use sqlx::PgConnection;

#[derive(Clone, Serialize, Deserialize, Message)]
struct Msg {
    #[message(key)]
    id: u64,
}

#[idempotent(consumer = "a")]
async fn generic<M: Message>(conn: &mut PgConnection, msg: M) -> Result<(), sqlx::Error> {
    Ok(())
}

#[idempotent(consumer = "b")]
async fn lifetime<'c>(conn: &'c mut PgConnection, msg: Msg) -> Result<(), sqlx::Error> {
    Ok(())
}

#[idempotent(consumer = "c")]
async fn where_clause(conn: &mut PgConnection, msg: Msg) -> Result<(), sqlx::Error>
where
    Msg: Clone,
{
    Ok(())
}
fn main() {}
