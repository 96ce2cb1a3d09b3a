#![allow(unused)]

use inbox_runtime::handler;

async fn plain(conn: &mut sqlx::PgConnection) -> Result<(), sqlx::Error> {
    Ok(())
}

fn main() {
    let registration = handler!(plain);
}
