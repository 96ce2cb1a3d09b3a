//! The lost commit on SQLite: a WAL hook that makes the `COMMIT` of the claim's transaction
//! report `SQLITE_IOERR` ("disk I/O error") although the transaction committed. SQLite calls the
//! WAL hook after a write transaction committed in WAL mode, and an error code it returns "will
//! propagate back up through the SQLite code base to cause the statement that provoked the
//! callback to report an error, though the commit will have still occurred"
//! (<https://sqlite.org/c3ref/wal_hook.html>).

use std::ffi::{c_char, c_int, c_void};

use libsqlite3_sys as ffi;
use sqlx::SqliteConnection;

/// The hook: every commit on the connection reports `SQLITE_IOERR` (the kit installs it for one
/// delivery, then closes the connection).
unsafe extern "C" fn report_an_error(
    _arg: *mut c_void,
    _db: *mut ffi::sqlite3,
    _database: *const c_char,
    _pages: c_int,
) -> c_int {
    ffi::SQLITE_IOERR
}

/// Whether `conn`'s database is in WAL mode (the hook fires only there).
pub(crate) async fn in_wal_mode(conn: &mut SqliteConnection) -> Result<bool, sqlx::Error> {
    let mode: String = sqlx::query_scalar("PRAGMA journal_mode")
        .fetch_one(&mut *conn)
        .await?;
    Ok(mode.eq_ignore_ascii_case("wal"))
}

/// Installs the hook on `conn`. It replaces the connection's WAL auto-checkpoint (itself a WAL
/// hook), so the connection must not be reused: the kit closes it after the delivery.
pub(crate) async fn fail_commits(conn: &mut SqliteConnection) -> Result<(), sqlx::Error> {
    let mut handle = conn.lock_handle().await?;
    let db = handle.as_raw_handle().as_ptr();
    // SAFETY: `db` is the connection's open handle, locked for this thread (no other call on it
    // meanwhile); the hook is a plain function that reads nothing through its argument (null)
    // and stays valid for the life of the program.
    unsafe {
        ffi::sqlite3_wal_hook(db, Some(report_an_error), std::ptr::null_mut());
    }
    Ok(())
}
