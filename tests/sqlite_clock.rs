//! SQLite's clocks (issue 11, item 4). On SQLite "the database clock" is each process's own
//! clock: SQLite's `'now'` comes from its VFS, which asks the operating system. These tests give
//! one pool a clock shifted by hours — a VFS that is the default one with `xCurrentTimeInt64`
//! moved, registered under its own name and opened through `SqliteConnectOptions::vfs` — so that
//! the purging "process" and the writing one disagree exactly as two processes with skewed clocks
//! would, on one database file.
//!
//! * A purger whose clock is **ahead** must not delete a row that a correct-clock writer
//!   processed a moment ago (the naive cutoff, its `now` minus the window, lies after that row).
//! * A purger whose clock is **behind** (another writer is ahead of it) refuses to purge.
//! * A skew within the 5 s tolerance purges normally.

#![allow(missing_docs)]

use std::ffi::{CString, c_int};
use std::sync::Mutex;
use std::sync::atomic::{AtomicPtr, Ordering};
use std::time::Duration;

use inbox_runtime::ops::admin::{self, PurgeError, Retention, utc_time};
use inbox_runtime::ops::cli::{AdminCli, CliError, execute_to};
use inbox_runtime::{Dispatcher, Message, Outcome, store::AdminStore as _};
use inbox_tests::{APPLY_EFFECT, effect, envelope, sqlite_pool};
use libsqlite3_sys as ffi;
use serde::{Deserialize, Serialize};
use sqlx::SqlitePool;
use sqlx::sqlite::{SqliteConnectOptions, SqliteJournalMode, SqlitePoolOptions};

#[derive(Debug, Clone, Serialize, Deserialize, Message)]
#[message(name = "clock.note")]
pub struct ClockNote {
    #[message(key)]
    pub id: String,
    pub amount: i64,
}

#[inbox_runtime::idempotent(consumer = "clock")]
async fn clock_note(conn: &mut sqlx::SqliteConnection, msg: ClockNote) -> Result<(), sqlx::Error> {
    sqlx::query(APPLY_EFFECT)
        .bind(format!("clock:{}", msg.id))
        .bind(msg.amount)
        .execute(&mut *conn)
        .await?;
    Ok(())
}

/// The default VFS with its clock moved by `offset_ms`. `base` first: SQLite hands the
/// callbacks a pointer to it, which is then a pointer to the whole.
#[repr(C)]
struct SkewedVfs {
    base: ffi::sqlite3_vfs,
    offset_ms: i64,
}

/// The default VFS, whose clock the skewed ones shift.
static DEFAULT_VFS: AtomicPtr<ffi::sqlite3_vfs> = AtomicPtr::new(std::ptr::null_mut());

unsafe extern "C" fn skewed_time_int64(
    vfs: *mut ffi::sqlite3_vfs,
    out: *mut ffi::sqlite3_int64,
) -> c_int {
    // SAFETY: `vfs` is the `base` of a leaked `SkewedVfs` (registered below); the default VFS
    // lives as long as the process and has a version-2 clock.
    unsafe {
        let default = DEFAULT_VFS.load(Ordering::Acquire);
        let rc = ((*default).xCurrentTimeInt64.expect("a version-2 VFS"))(default, out);
        *out += (*vfs.cast::<SkewedVfs>()).offset_ms;
        rc
    }
}

unsafe extern "C" fn skewed_time(vfs: *mut ffi::sqlite3_vfs, out: *mut f64) -> c_int {
    let mut millis: ffi::sqlite3_int64 = 0;
    // SAFETY: as above; `out` is SQLite's.
    unsafe {
        let rc = skewed_time_int64(vfs, &mut millis);
        *out = millis as f64 / 86_400_000.0;
        rc
    }
}

/// Registers (once) a VFS named `name`: the default one with its clock moved by `offset`
/// milliseconds.
fn skewed_vfs(name: &'static str, offset_ms: i64) -> &'static str {
    static REGISTERED: Mutex<Vec<&str>> = Mutex::new(Vec::new());
    let mut registered = REGISTERED.lock().unwrap();
    if registered.contains(&name) {
        return name;
    }
    // SAFETY: SQLite's documented VFS registration; the copy and its name are leaked, so they
    // outlive every connection that uses them.
    unsafe {
        let default = ffi::sqlite3_vfs_find(std::ptr::null());
        assert!(!default.is_null() && (*default).iVersion >= 2);
        DEFAULT_VFS.store(default, Ordering::Release);
        let mut base = *default;
        base.zName = CString::new(name).unwrap().into_raw();
        base.pNext = std::ptr::null_mut();
        base.xCurrentTimeInt64 = Some(skewed_time_int64);
        base.xCurrentTime = Some(skewed_time);
        let vfs = Box::leak(Box::new(SkewedVfs { base, offset_ms }));
        assert_eq!(ffi::sqlite3_vfs_register(&mut vfs.base, 0), ffi::SQLITE_OK);
    }
    registered.push(name);
    name
}

/// A pool on the database file at `path` whose clock is `vfs`'s.
async fn pool_with_clock(path: &std::path::Path, vfs: &'static str) -> SqlitePool {
    let options = SqliteConnectOptions::new()
        .filename(path)
        .vfs(vfs)
        .journal_mode(SqliteJournalMode::Wal)
        .busy_timeout(Duration::from_secs(30));
    SqlitePoolOptions::new()
        .max_connections(2)
        .connect_with(options)
        .await
        .expect("open the database with a skewed clock")
}

/// Makes the `old-%` rows three hours older.
const AGE: &str = "UPDATE inbox_messages \
     SET received_at = strftime('%Y-%m-%dT%H:%M:%fZ', received_at, '-3 hours'), \
     processed_at = strftime('%Y-%m-%dT%H:%M:%fZ', processed_at, '-3 hours') \
     WHERE message_key LIKE 'old-%'";

const HOUR: Duration = Duration::from_secs(3600);

async fn send(dispatcher: &Dispatcher<sqlx::Sqlite>, id: &str) -> Outcome<()> {
    let note = ClockNote {
        id: id.into(),
        amount: 1,
    };
    let mut outcomes = dispatcher.dispatch(&envelope(&note)).await.unwrap();
    outcomes.remove(0).result.unwrap()
}

async fn keys(pool: &SqlitePool) -> Vec<String> {
    sqlx::query_scalar("SELECT message_key FROM inbox_messages ORDER BY message_key")
        .fetch_all(pool)
        .await
        .unwrap()
}

/// Rows the naive cutoff (the pool's own `now` minus an hour) would take.
async fn naively_older_than_an_hour(pool: &SqlitePool) -> i64 {
    sqlx::query_scalar(
        "SELECT COUNT(*) FROM inbox_messages WHERE COALESCE(processed_at, received_at) \
         < strftime('%Y-%m-%dT%H:%M:%fZ', 'now', '-3600 seconds')",
    )
    .fetch_one(pool)
    .await
    .unwrap()
}

async fn admin_cli(pool: &SqlitePool, args: &str) -> (Result<(), CliError>, String) {
    use clap::Parser as _;
    let cli =
        AdminCli::try_parse_from(std::iter::once("admin").chain(args.split_whitespace())).unwrap();
    let mut out = Vec::new();
    let result = execute_to(&cli.command, pool, &mut out).await;
    (result, String::from_utf8(out).unwrap())
}

/// A purge run from a process whose clock is two hours ahead, with a one-hour window: the rows
/// processed three hours ago go; the row a correct-clock process processed a moment ago stays,
/// although the purger's own `now` minus the window lies after it — and its redelivery is a
/// duplicate, applied once.
#[tokio::test]
async fn a_purger_whose_clock_is_ahead_keeps_what_another_process_just_wrote() {
    let (writer, file) = sqlite_pool(2).await;
    let dispatcher = Dispatcher::from_registry(writer.clone()).unwrap();
    for id in ["old-1", "old-2"] {
        assert_eq!(send(&dispatcher, id).await, Outcome::Processed(()));
    }
    sqlx::query(AGE).execute(&writer).await.unwrap();
    assert_eq!(send(&dispatcher, "fresh").await, Outcome::Processed(()));
    let fresh = admin::show(&writer, "clock", "fresh")
        .await
        .unwrap()
        .unwrap();

    let purger = pool_with_clock(&file.0, skewed_vfs("inbox-ahead-2h", 2 * 3_600_000)).await;
    // The purger's clock really is two hours ahead, and a cutoff taken from it alone would
    // reach the fresh row.
    let mut conn = purger.acquire().await.unwrap();
    let clock = conn.purge_clock(3600.0).await.unwrap();
    drop(conn);
    let ahead = -clock.newest_ahead_secs.unwrap();
    assert!((7199.9..=7205.0).contains(&ahead), "{clock:?}");
    assert_eq!(clock.newest.as_ref(), fresh.processed_at.as_ref());
    assert_eq!(naively_older_than_an_hour(&writer).await, 2);
    assert_eq!(naively_older_than_an_hour(&purger).await, 3);
    // Its cutoff is the newest write minus the window: before the fresh row.
    assert!(
        clock.cutoff < *fresh.processed_at.as_ref().unwrap(),
        "{clock:?}"
    );

    let retention = Retention::new(HOUR, HOUR).unwrap();
    let preview = admin::purge_preview(&purger, &retention).await.unwrap();
    assert_eq!(preview.messages(), 2);
    let report = admin::purge(&purger, &retention, |_| {}).await.unwrap();
    assert_eq!(report.deleted, 2);
    assert_eq!(keys(&writer).await, ["fresh"]);

    // The redelivery of the fresh key (its ack was lost) is a duplicate: applied once.
    assert_eq!(send(&dispatcher, "fresh").await, Outcome::Duplicate);
    assert_eq!(effect(&writer, "clock:fresh").await, Some((1, 1)));

    // The same through the CLI: nothing more to delete.
    let (result, printed) = admin_cli(&purger, "purge --window 1h --redelivery-horizon 1h").await;
    result.unwrap();
    assert_eq!(
        printed,
        "purged 0 inbox rows older than 1h\n1 statement of at most 1000 rows each\n"
    );
    assert_eq!(keys(&writer).await, ["fresh"]);
    purger.close().await;
}

/// A purge run from a process whose clock is two hours behind the newest write (another
/// writer's clock is ahead of it) refuses to run, saying why; nothing is deleted, and the dry
/// run and the CLI refuse the same way.
#[tokio::test]
async fn a_purger_whose_clock_is_behind_refuses() {
    let (writer, file) = sqlite_pool(2).await;
    let dispatcher = Dispatcher::from_registry(writer.clone()).unwrap();
    assert_eq!(send(&dispatcher, "old-1").await, Outcome::Processed(()));
    sqlx::query(AGE).execute(&writer).await.unwrap();
    assert_eq!(send(&dispatcher, "fresh").await, Outcome::Processed(()));
    let fresh = admin::show(&writer, "clock", "fresh")
        .await
        .unwrap()
        .unwrap();

    let purger = pool_with_clock(&file.0, skewed_vfs("inbox-behind-2h", -2 * 3_600_000)).await;
    let retention = Retention::new(HOUR, HOUR).unwrap();
    let error = admin::purge(&purger, &retention, |_| {}).await.unwrap_err();
    let PurgeError::ClockSkew { now, newest, ahead } = &error else {
        panic!("{error:?}")
    };
    assert_eq!(Some(newest), fresh.processed_at.as_ref());
    assert_eq!(*ahead, Duration::from_secs(7200));
    assert!(utc_time(now) < utc_time(newest), "{error}");
    let text = format!(
        "refusing to purge: the newest time in the inbox, {}, is 2h ahead of this process's \
         clock, {} (tolerance 5s): on SQLite every process stamps rows with its own clock, and \
         another process writing this database has a clock ahead of this one, so the rows' ages \
         cannot be trusted; fix the clocks, then purge again",
        utc_time(newest),
        utc_time(now)
    );
    assert_eq!(error.to_string(), text);
    assert_eq!(keys(&writer).await, ["fresh", "old-1"]);

    assert!(matches!(
        admin::purge_preview(&purger, &retention).await,
        Err(PurgeError::ClockSkew { .. })
    ));
    for args in [
        "purge --window 1h --redelivery-horizon 1h",
        "purge --window 1h --redelivery-horizon 1h --dry-run",
    ] {
        let (result, printed) = admin_cli(&purger, args).await;
        let error = result.unwrap_err();
        assert!(
            matches!(error, CliError::Purge(PurgeError::ClockSkew { .. })),
            "{error:?}"
        );
        assert!(
            error
                .to_string()
                .starts_with("refusing to purge: the newest time in the inbox, "),
            "{error}"
        );
        assert_eq!(printed, "");
    }
    assert_eq!(keys(&writer).await, ["fresh", "old-1"]);

    // The writer's own purge (its clock agrees with the rows) goes ahead.
    let report = admin::purge(&writer, &retention, |_| {}).await.unwrap();
    assert_eq!(report.deleted, 1);
    assert_eq!(keys(&writer).await, ["fresh"]);
    purger.close().await;
}

/// A purger three seconds behind the newest write is within the 5 s tolerance: it purges.
#[tokio::test]
async fn a_skew_within_the_tolerance_purges() {
    assert_eq!(admin::CLOCK_TOLERANCE, Duration::from_secs(5));
    let (writer, file) = sqlite_pool(2).await;
    let dispatcher = Dispatcher::from_registry(writer.clone()).unwrap();
    assert_eq!(send(&dispatcher, "old-1").await, Outcome::Processed(()));
    sqlx::query(AGE).execute(&writer).await.unwrap();
    assert_eq!(send(&dispatcher, "fresh").await, Outcome::Processed(()));

    let purger = pool_with_clock(&file.0, skewed_vfs("inbox-behind-3s", -3000)).await;
    let retention = Retention::new(HOUR, HOUR).unwrap();
    let report = admin::purge(&purger, &retention, |_| {}).await.unwrap();
    assert_eq!(report.deleted, 1);
    assert_eq!(keys(&writer).await, ["fresh"]);
    purger.close().await;
}
