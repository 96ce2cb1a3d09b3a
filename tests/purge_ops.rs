//! Operating the inbox, on both backends: a purge with a floor (a redelivery horizon below an
//! hour refused), `purge --dry-run` (what would go, per consumer and status; nothing deleted),
//! admin commands that refuse an unknown consumer, and times shown with their zone.

#![allow(missing_docs)]

use inbox_runtime::{Message, Permanent};
use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, Serialize, Deserialize, Message)]
#[message(name = "ops.note")]
pub struct OpsNote {
    #[message(key)]
    pub id: String,
    pub amount: i64,
    /// The handler refuses it for good (dead at once).
    pub refuse: bool,
}

/// A fixed time, long ago, for rows whose times the tests show.
const FIXED_POSTGRES: &str = "2026-01-02 03:04:05+00";
const FIXED_SQLITE: &str = "2026-01-02T03:04:05.000Z";
const FIXED_MYSQL: &str = "2026-01-02 03:04:05.000000";
const FIXED_SHOWN: &str = "2026-01-02 03:04:05 UTC";

/// Sets the times of the `old-%` rows (first delivery, and settling if settled) to the fixed
/// time.
const AGE_POSTGRES: &str = "UPDATE inbox_messages SET received_at = '2026-01-02 03:04:05+00', \
     processed_at = CASE WHEN processed_at IS NULL THEN NULL \
     ELSE TIMESTAMPTZ '2026-01-02 03:04:05+00' END \
     WHERE message_key LIKE 'old-%'";
const AGE_SQLITE: &str = "UPDATE inbox_messages SET received_at = '2026-01-02T03:04:05.000Z', \
     processed_at = CASE WHEN processed_at IS NULL THEN NULL ELSE '2026-01-02T03:04:05.000Z' END \
     WHERE message_key LIKE 'old-%'";
const AGE_REJECTIONS_POSTGRES: &str = "UPDATE inbox_rejections \
     SET received_at = '2026-01-02 03:04:05+00' WHERE message_name LIKE 'old.%'";
const AGE_REJECTIONS_SQLITE: &str = "UPDATE inbox_rejections \
     SET received_at = '2026-01-02T03:04:05.000Z' WHERE message_name LIKE 'old.%'";
const AGE_MYSQL: &str = "UPDATE inbox_messages SET received_at = '2026-01-02 03:04:05', \
     processed_at = CASE WHEN processed_at IS NULL THEN NULL ELSE '2026-01-02 03:04:05' END \
     WHERE message_key LIKE 'old-%'";
const AGE_REJECTIONS_MYSQL: &str = "UPDATE inbox_rejections \
     SET received_at = '2026-01-02 03:04:05' WHERE message_name LIKE 'old.%'";

/// The database clock a day ago, as the database writes it.
const A_DAY_AGO_POSTGRES: &str = "SELECT CAST(now() - interval '1 day' AS TEXT)";
const A_DAY_AGO_SQLITE: &str = "SELECT strftime('%Y-%m-%dT%H:%M:%fZ', 'now', '-1 day')";
const A_DAY_AGO_MYSQL: &str =
    "SELECT DATE_FORMAT(UTC_TIMESTAMP(6) - INTERVAL 1 DAY, '%Y-%m-%d %H:%i:%s.%f')";

inbox_tests::backend_matrix! {
    connections(postgres = 4, sqlite = 4);

    use std::time::Duration;

    use clap::Parser as _;
    use inbox_runtime::ops::admin::{self, Retention, RetentionError};
    use inbox_runtime::ops::cli::{AdminCli, CliError, execute_to};
    use inbox_runtime::{Dispatcher, Envelope, Outcome, store::AdminStore as _};

    #[inbox_runtime::idempotent(consumer = "ops")]
    async fn ops_note(conn: &mut Conn, msg: OpsNote) -> Result<(), Permanent> {
        sqlx::query(APPLY_EFFECT)
            .bind(format!("ops:{}", msg.id))
            .bind(msg.amount)
            .execute(&mut *conn)
            .await
            .map_err(Permanent::new)?;
        if msg.refuse {
            return Err(Permanent::new(format!("note `{}` refused", msg.id)));
        }
        Ok(())
    }

    fn note(id: &str, refuse: bool) -> Envelope {
        inbox_tests::envelope(&OpsNote {
            id: id.into(),
            amount: 1,
            refuse,
        })
    }

    async fn send(dispatcher: &Dispatcher<Db>, id: &str, refuse: bool) -> &'static str {
        let outcomes = dispatcher.dispatch(&note(id, refuse)).await.unwrap();
        let kinds = inbox_tests::outcome_kinds(&outcomes);
        match kinds[..] {
            [Ok(kind) | Err(kind)] => kind,
            _ => panic!("{kinds:?}"),
        }
    }

    /// Runs `ledger admin`-style arguments through the CLI on `pool`: the result and what it
    /// printed.
    async fn admin_cli(pool: &Pool, args: &str) -> (Result<(), CliError>, String) {
        let cli = AdminCli::try_parse_from(std::iter::once("admin").chain(args.split_whitespace()))
            .unwrap();
        let mut out = Vec::new();
        let result = execute_to(&cli.command, pool, &mut out).await;
        (result, String::from_utf8(out).unwrap())
    }

    async fn counts(pool: &Pool) -> (i64, i64) {
        (
            inbox_tests::count(pool, "SELECT COUNT(*) FROM inbox_messages").await,
            inbox_tests::count(pool, "SELECT COUNT(*) FROM inbox_rejections").await,
        )
    }

    async fn age(pool: &Pool) {
        let (messages, rejections) = match BACKEND {
            Backend::Postgres => (AGE_POSTGRES, AGE_REJECTIONS_POSTGRES),
            Backend::MySql => (AGE_MYSQL, AGE_REJECTIONS_MYSQL),
            _ => (AGE_SQLITE, AGE_REJECTIONS_SQLITE),
        };
        sqlx::query(messages).execute(pool).await.unwrap();
        sqlx::query(rejections).execute(pool).await.unwrap();
    }

    async fn a_day_ago(pool: &Pool) -> String {
        let sql = match BACKEND {
            Backend::Postgres => A_DAY_AGO_POSTGRES,
            Backend::MySql => A_DAY_AGO_MYSQL,
            _ => A_DAY_AGO_SQLITE,
        };
        let text: String = sqlx::query_scalar(sql).fetch_one(pool).await.unwrap();
        admin::utc_time(&text)
    }

    const HORIZON_TEXT: &str = "every broker can deliver a message again at least that long \
        after the first delivery (ack deadlines and visibility timeouts that lapse, consumer \
        restarts and rebalances, producer retries), so a purge this short would forget keys \
        that can still come again";

    /// Item 5: a zero (or sub-hour) redelivery horizon is refused, with the reason, by
    /// `Retention::new` and so by `purge`, which then deletes nothing.
    #[tokio::test]
    async fn a_horizon_below_an_hour_is_refused() {
        let (pool, _guard) = fixture().await;
        let dispatcher = Dispatcher::from_registry(pool.clone()).unwrap();
        assert_eq!(send(&dispatcher, "old-1", false).await, "processed");
        assert_eq!(send(&dispatcher, "new-1", false).await, "processed");
        age(&pool).await;

        let hour = Duration::from_secs(3600);
        assert_eq!(admin::MIN_REDELIVERY_HORIZON, hour);
        let zero = Retention::new(Duration::ZERO, Duration::ZERO).unwrap_err();
        assert_eq!(
            zero,
            RetentionError::HorizonBelowMinimum {
                horizon: Duration::ZERO,
                minimum: hour
            }
        );
        assert_eq!(
            zero.to_string(),
            format!("redelivery horizon of 0s is below the minimum of 1h: {HORIZON_TEXT}")
        );
        // A window long enough does not make a short horizon acceptable.
        let short = Retention::new(Duration::from_secs(86_400), Duration::from_secs(3599));
        assert_eq!(
            short.unwrap_err().to_string(),
            format!("redelivery horizon of 3599s is below the minimum of 1h: {HORIZON_TEXT}")
        );
        // The horizon is checked first; then the window against it.
        assert_eq!(
            Retention::new(Duration::from_secs(1800), hour).unwrap_err(),
            RetentionError::WindowBelowHorizon {
                window: Duration::from_secs(1800),
                horizon: hour
            }
        );
        assert_eq!(
            Retention::new(Duration::from_secs(1800), hour)
                .unwrap_err()
                .to_string(),
            "retention window of 30m is shorter than the redelivery horizon of 1h: \
             redeliveries after the window would be processed again"
        );
        assert_eq!(Retention::new(hour, hour).unwrap().window(), hour);

        for args in [
            "purge --window 0s --redelivery-horizon 0s",
            "purge --window 0s --redelivery-horizon 0s --yes",
            "purge --window 0s --redelivery-horizon 0s --dry-run",
        ] {
            let (result, printed) = admin_cli(&pool, args).await;
            let error = result.unwrap_err();
            assert!(
                matches!(
                    error,
                    CliError::Retention(RetentionError::HorizonBelowMinimum { .. })
                ),
                "{error:?}"
            );
            assert_eq!(
                error.to_string(),
                format!("redelivery horizon of 0s is below the minimum of 1h: {HORIZON_TEXT}")
            );
            assert_eq!(printed, "");
        }
        let (result, _) = admin_cli(&pool, "purge --window 10m --redelivery-horizon 5m").await;
        assert_eq!(
            result.unwrap_err().to_string(),
            format!("redelivery horizon of 5m is below the minimum of 1h: {HORIZON_TEXT}")
        );
        // Nothing was deleted, and the keys still block their redeliveries.
        assert_eq!(counts(&pool).await, (2, 0));
        assert_eq!(send(&dispatcher, "old-1", false).await, "duplicate");
        assert_eq!(send(&dispatcher, "new-1", false).await, "duplicate");
        assert_eq!(inbox_tests::effect(&pool, "ops:old-1").await, Some((1, 1)));
    }

    /// Item 5: `purge --dry-run` prints what would go per consumer and status (and rejection
    /// reason) and deletes nothing; the same purge without it deletes exactly that.
    #[tokio::test]
    async fn a_dry_run_prints_what_would_go_and_deletes_nothing() {
        let (pool, _guard) = fixture().await;
        let dispatcher = Dispatcher::from_registry(pool.clone()).unwrap();
        let lower = a_day_ago(&pool).await;
        assert_eq!(send(&dispatcher, "old-1", false).await, "processed");
        assert_eq!(send(&dispatcher, "old-2", false).await, "processed");
        assert_eq!(send(&dispatcher, "old-3", true).await, "handler");
        assert!(admin::discard(&pool, "ops", "old-3").await.unwrap());
        assert_eq!(send(&dispatcher, "old-4", true).await, "handler");
        assert_eq!(send(&dispatcher, "new-1", false).await, "processed");
        for name in ["old.nope", "new.nope"] {
            let unknown = Envelope::new(name, b"{}".to_vec());
            let error = dispatcher.dispatch(&unknown).await.unwrap_err();
            dispatcher.record_rejection(&unknown, &error).await.unwrap();
        }
        age(&pool).await;
        assert_eq!(counts(&pool).await, (5, 2));

        let (result, printed) = admin_cli(
            &pool,
            "purge --window 1d --redelivery-horizon 1d --include-rejections --dry-run",
        )
        .await;
        result.unwrap();
        let upper = a_day_ago(&pool).await;
        let first = printed.lines().next().unwrap();
        let cutoff = first
            .strip_prefix("would purge 3 inbox rows settled before ")
            .and_then(|rest| rest.strip_suffix(" (window 1d)"))
            .unwrap_or_else(|| panic!("{printed}"));
        // The cutoff is the database clock a day ago, to the second, in UTC.
        assert!(lower.as_str() <= cutoff && cutoff <= upper.as_str(), "{lower} {cutoff} {upper}");
        assert_eq!(
            printed,
            format!(
                "would purge 3 inbox rows settled before {cutoff} (window 1d)\n\
                 would purge 1 rejected deliveries received before {cutoff}\n\
                 CONSUMER  STATUS                    ROWS  OLDEST\n\
                 -         rejected:unknown_message     1  {FIXED_SHOWN}\n\
                 ops       discarded                    1  {FIXED_SHOWN}\n\
                 ops       processed                    2  {FIXED_SHOWN}\n\
                 dry run: nothing deleted\n"
            )
        );
        assert_eq!(counts(&pool).await, (5, 2), "a dry run deletes nothing");

        let (result, printed) = admin_cli(
            &pool,
            "purge --window 1d --redelivery-horizon 1d --include-failed-and-dead --dry-run",
        )
        .await;
        result.unwrap();
        let cutoff = printed
            .lines()
            .next()
            .and_then(|line| line.strip_prefix("would purge 4 inbox rows settled before "))
            .and_then(|rest| rest.strip_suffix(" (window 1d), failed and dead included"))
            .unwrap_or_else(|| panic!("{printed}"));
        assert_eq!(
            printed,
            format!(
                "would purge 4 inbox rows settled before {cutoff} (window 1d), failed and dead \
                 included\n\
                 CONSUMER  STATUS     ROWS  OLDEST\n\
                 ops       dead          1  {FIXED_SHOWN}\n\
                 ops       discarded     1  {FIXED_SHOWN}\n\
                 ops       processed     2  {FIXED_SHOWN}\n\
                 dry run: nothing deleted\n"
            )
        );
        assert_eq!(counts(&pool).await, (5, 2), "a dry run deletes nothing");

        // Nothing old enough: the table is left out.
        let (result, printed) =
            admin_cli(&pool, "purge --window 36500d --redelivery-horizon 1d --dry-run").await;
        result.unwrap();
        let (head, tail) = printed.split_once('\n').unwrap();
        assert!(head.starts_with("would purge 0 inbox rows settled before "), "{printed}");
        assert_eq!(tail, "dry run: nothing deleted\n");

        // The admin function behind it.
        let retention = Retention::new(Duration::from_secs(86_400), Duration::from_secs(86_400))
            .unwrap()
            .include_rejections(true);
        let preview = admin::purge_preview(&pool, &retention).await.unwrap();
        assert_eq!((preview.messages(), preview.rejections()), (3, 1));
        let rows: Vec<(Option<&str>, &str, i64)> = preview
            .rows
            .iter()
            .map(|row| (row.consumer.as_deref(), row.status.as_str(), row.count))
            .collect();
        assert_eq!(
            rows,
            [
                (None, "rejected:unknown_message", 1),
                (Some("ops"), "discarded", 1),
                (Some("ops"), "processed", 2),
            ]
        );
        assert_eq!(counts(&pool).await, (5, 2));

        // The purge itself deletes what the dry run showed.
        let (result, printed) = admin_cli(
            &pool,
            "purge --window 1d --redelivery-horizon 1d --include-rejections",
        )
        .await;
        result.unwrap();
        assert_eq!(
            printed,
            "purged 3 inbox rows older than 1d\n\
             purged 1 rejected deliveries older than 1d\n\
             2 statements of at most 1000 rows each\n"
        );
        assert_eq!(counts(&pool).await, (2, 1));
        let mut keys: Vec<String> = sqlx::query_scalar(sql("SELECT message_key FROM inbox_messages"))
            .fetch_all(&pool)
            .await
            .unwrap();
        keys.sort();
        assert_eq!(keys, ["new-1", "old-4"]);
    }

    /// On PostgreSQL one clock stamps every row: the purge compares with nothing else. On SQLite
    /// the newest write is read (see `sqlite_clock.rs` for skewed clocks).
    #[tokio::test]
    async fn the_purge_clock_of_each_backend() {
        let (pool, _guard) = fixture().await;
        let dispatcher = Dispatcher::from_registry(pool.clone()).unwrap();
        let mut conn = pool.acquire().await.unwrap();
        let empty = conn.purge_clock(60.0).await.unwrap();
        assert_eq!((empty.newest, empty.newest_ahead_secs), (None, None));
        assert_eq!(send(&dispatcher, "new-1", false).await, "processed");
        let clock = conn.purge_clock(60.0).await.unwrap();
        let stored = admin::show(&pool, "ops", "new-1").await.unwrap().unwrap();
        if BACKEND != Backend::Sqlite {
            // One clock, the server's, stamps every row.
            assert_eq!((&clock.newest, clock.newest_ahead_secs), (&None, None));
        } else {
            assert_eq!(clock.newest, stored.processed_at);
            let ahead = clock.newest_ahead_secs.unwrap();
            assert!((-5.0..=0.0).contains(&ahead), "{ahead}");
        }
        assert!(clock.cutoff < clock.now, "{clock:?}");
    }

    /// `dead replay` prints each replay's outcome, and with `--all` the ones not processed and
    /// the totals (the loop DynamoDB's command line shares): a processed key is a duplicate, a
    /// note the handler still refuses fails again and stays dead, nothing applies twice.
    #[tokio::test]
    async fn dead_replay_prints_each_outcome_and_the_totals() {
        let (pool, _guard) = fixture().await;
        let dispatcher = Dispatcher::from_registry(pool.clone()).unwrap();
        assert_eq!(send(&dispatcher, "r-ok", false).await, "processed");
        assert_eq!(send(&dispatcher, "r-bad", true).await, "handler");

        let (result, printed) = admin_cli(&pool, "dead replay ops r-ok").await;
        result.unwrap();
        assert_eq!(printed, "ops/r-ok: duplicate (processed meanwhile)\n");
        let (result, printed) = admin_cli(&pool, "dead replay ops r-bad").await;
        assert_eq!(result.unwrap_err().to_string(), "1 of 1 replays did not succeed");
        assert_eq!(
            printed,
            "ops/r-bad: handler failed (permanent error, attempt 2, dead-lettered): \
             note `r-bad` refused\n"
        );
        let (result, printed) = admin_cli(&pool, "dead replay --all --consumer ops").await;
        assert_eq!(result.unwrap_err().to_string(), "1 of 1 replays did not succeed");
        assert_eq!(
            printed,
            "ops/r-bad: handler failed (permanent error, attempt 3, dead-lettered): \
             note `r-bad` refused\nreplayed 1: 0 processed, 0 duplicates, 1 not processed\n"
        );
        assert_eq!(inbox_tests::effect(&pool, "ops:r-ok").await, Some((1, 1)));
        assert_eq!(
            admin::show(&pool, "ops", "r-bad").await.unwrap().unwrap().status.as_str(),
            "dead"
        );
    }

    /// Item 7: every command that names a consumer refuses one that has neither rows nor a
    /// registered handler, naming those that exist; nothing is printed, nothing changes.
    #[tokio::test]
    async fn commands_refuse_an_unknown_consumer() {
        let (pool, _guard) = fixture().await;
        let dispatcher = Dispatcher::from_registry(pool.clone()).unwrap();
        assert_eq!(send(&dispatcher, "old-dead", true).await, "handler");
        // A consumer with rows but no handler any more.
        sqlx::query(
            sql("INSERT INTO inbox_messages (consumer, message_key, message_name, payload_hash, \
             status, attempts, payload) VALUES ('retired', 'r-1', 'ops.note', 'x', 'dead', 1, $1)"),
        )
        .bind(&b"{}"[..])
        .execute(&pool)
        .await
        .unwrap();

        for args in [
            "dead list --consumer nobody",
            "dead show nobody old-dead",
            "dead discard nobody old-dead",
            "dead replay nobody old-dead",
            "dead replay --all --consumer nobody",
        ] {
            let (result, printed) = admin_cli(&pool, args).await;
            let error = result.unwrap_err();
            assert_eq!(
                error.to_string(),
                "unknown consumer `nobody`; known consumers: ops, retired",
                "{args}"
            );
            assert!(
                matches!(&error, CliError::UnknownConsumer { consumer, known }
                    if consumer == "nobody" && known == &["ops", "retired"]),
                "{error:?}"
            );
            assert_eq!(printed, "", "{args}");
        }
        assert_eq!(
            admin::show(&pool, "ops", "old-dead").await.unwrap().unwrap().status.as_str(),
            "dead"
        );

        // Known through its rows alone, or through its handler alone.
        let (result, printed) = admin_cli(&pool, "dead list --consumer retired").await;
        result.unwrap();
        assert!(printed.contains("retired   r-1"), "{printed}");
        let (result, printed) = admin_cli(&pool, "dead show ops missing").await;
        assert_eq!(
            result.unwrap_err().to_string(),
            "consumer `ops` has no stored message with key `missing`"
        );
        assert_eq!(printed, "");

        let none = CliError::UnknownConsumer {
            consumer: "nobody".into(),
            known: Vec::new(),
        };
        assert_eq!(
            none.to_string(),
            "unknown consumer `nobody`; no consumer is known (the inbox has no rows and no \
             handler is registered)"
        );
    }

    /// Item 7: `stats`, `dead list` and `dead show` show times in UTC with their zone.
    #[tokio::test]
    async fn times_carry_their_zone() {
        let (pool, _guard) = fixture().await;
        let dispatcher = Dispatcher::from_registry(pool.clone()).unwrap();
        assert_eq!(send(&dispatcher, "old-dead", true).await, "handler");
        age(&pool).await;
        let fixed = match BACKEND {
            Backend::Postgres => FIXED_POSTGRES,
            Backend::MySql => FIXED_MYSQL,
            _ => FIXED_SQLITE,
        };
        let stored = admin::show(&pool, "ops", "old-dead").await.unwrap().unwrap();
        assert_eq!(admin::utc_time(&stored.received_at), FIXED_SHOWN);
        assert_eq!(
            admin::utc_time(fixed),
            FIXED_SHOWN,
            "the database's own text form"
        );

        let (result, printed) = admin_cli(&pool, "dead list").await;
        result.unwrap();
        assert_eq!(
            printed,
            format!(
                "CONSUMER  KEY       MESSAGE   STATUS  ATTEMPTS  RECEIVED                 LAST ERROR\n\
                 ops       old-dead  ops.note  dead           1  {FIXED_SHOWN}  {}\n",
                stored.last_error.as_deref().unwrap()
            )
        );

        let (result, printed) = admin_cli(&pool, "stats").await;
        result.unwrap();
        assert_eq!(
            printed,
            format!(
                "CONSUMER  PROCESSED  FAILED  DEAD  PARKED  STALE  DISCARDED  CONFLICTS SEEN  \
                 OLDEST FAILED  OLDEST DEAD\n\
                 ops               0       0     1       0      0          0               0  \
                 -              {FIXED_SHOWN}\n"
            )
        );

        let (result, printed) = admin_cli(&pool, "dead show ops old-dead").await;
        result.unwrap();
        assert!(
            printed.contains(&format!("\nreceived:     {FIXED_SHOWN}\nprocessed:    -\n")),
            "{printed}"
        );

        // Discarded: its settling time is shown the same way; a redelivery is `discarded`.
        assert!(admin::discard(&pool, "ops", "old-dead").await.unwrap());
        let (result, printed) = admin_cli(&pool, "dead show ops old-dead").await;
        result.unwrap();
        let processed = printed
            .lines()
            .find_map(|line| line.strip_prefix("processed:    "))
            .unwrap();
        assert!(
            processed.len() == FIXED_SHOWN.len() && processed.ends_with(" UTC"),
            "{printed}"
        );
        let outcomes = dispatcher.dispatch(&note("old-dead", true)).await.unwrap();
        assert_eq!(outcomes[0].result.as_ref().unwrap(), &Outcome::Discarded);
    }
}

/// PostgreSQL in a session whose time zone is not UTC: the CLI still shows UTC.
mod postgres_time_zone {
    use std::str::FromStr as _;

    use clap::Parser as _;
    use inbox_runtime::ops::cli::{AdminCli, execute_to};
    use sqlx::postgres::{PgConnectOptions, PgPoolOptions};

    use super::FIXED_SHOWN;

    #[tokio::test]
    async fn times_are_shown_in_utc_whatever_the_session_zone() {
        let pool = inbox_tests::pg_pool(2).await;
        let options = PgConnectOptions::from_str(&inbox_tests::database_url())
            .unwrap()
            .database(pool.connect_options().get_database().unwrap());
        let kolkata = PgPoolOptions::new()
            .max_connections(1)
            .after_connect(|conn, _| {
                Box::pin(async move {
                    sqlx::query("SET TIME ZONE 'Asia/Kolkata'")
                        .execute(conn)
                        .await?;
                    Ok(())
                })
            })
            .connect_with(options)
            .await
            .unwrap();
        sqlx::query(
            "INSERT INTO inbox_messages (consumer, message_key, message_name, payload_hash, \
             status, attempts, received_at) \
             VALUES ('tz', 'k', 'ops.note', 'x', 'dead', 1, '2026-01-02 03:04:05+00')",
        )
        .execute(&kolkata)
        .await
        .unwrap();
        let text: String =
            sqlx::query_scalar("SELECT CAST(received_at AS TEXT) FROM inbox_messages")
                .fetch_one(&kolkata)
                .await
                .unwrap();
        assert_eq!(text, "2026-01-02 08:34:05+05:30");
        let cli = AdminCli::try_parse_from(["admin", "dead", "list"]).unwrap();
        let mut out = Vec::new();
        execute_to(&cli.command, &kolkata, &mut out).await.unwrap();
        let out = String::from_utf8(out).unwrap();
        assert!(
            out.contains(&format!("dead           1  {FIXED_SHOWN}  -")),
            "{out}"
        );
    }
}

/// The confirmation, through the ledger demo's `ledger admin purge` on a terminal (a pty from
/// util-linux's `script`) and without one.
#[path = "ledger_support.rs"]
mod support;

mod terminal {
    use std::io::Write as _;
    use std::process::{Command, Stdio};

    /// Rows settled three hours ago: older than a 2 h window, younger than a day; and one
    /// settled now (on SQLite the window is measured back from the newest write, too).
    const RECENT: &str = "INSERT INTO inbox_messages (consumer, message_key, message_name, \
         payload_hash, status, attempts, received_at, processed_at) VALUES \
         ('ledger', 'k-now', 'payments.captured', 'x', 'processed', 1, \
          strftime('%Y-%m-%dT%H:%M:%fZ', 'now'), strftime('%Y-%m-%dT%H:%M:%fZ', 'now')), \
         ('ledger', 'k-1', 'payments.captured', 'x', 'processed', 1, \
          strftime('%Y-%m-%dT%H:%M:%fZ', 'now', '-3 hours'), \
          strftime('%Y-%m-%dT%H:%M:%fZ', 'now', '-3 hours')), \
         ('ledger', 'k-2', 'payments.captured', 'x', 'processed', 1, \
          strftime('%Y-%m-%dT%H:%M:%fZ', 'now', '-3 hours'), \
          strftime('%Y-%m-%dT%H:%M:%fZ', 'now', '-3 hours'))";

    const QUESTION: &str = "this purge would delete 2 inbox rows settled less than a day ago \
        (window 2h): a redelivery of one of their keys would be processed again.\r\n\
        delete them? [y/N] ";

    /// Runs `ledger admin --database-url URL ARGS` with `input` on standard input: through
    /// `script` (a terminal) or a pipe. Exit code and everything printed (on a terminal, the
    /// input typed ahead is echoed too).
    fn admin(url: &str, args: &str, input: &str, tty: bool) -> (i32, String) {
        let bin = super::support::ledger_bin().display().to_string();
        let command = format!("{bin} admin --database-url {url} {args}");
        let mut child = if tty {
            Command::new("script")
                .args(["-qec", &command, "/dev/null"])
                .stdin(Stdio::piped())
                .stdout(Stdio::piped())
                .stderr(Stdio::piped())
                .spawn()
                .expect("run util-linux's script")
        } else {
            Command::new("sh")
                .args(["-c", &format!("{command} 2>&1")])
                .stdin(Stdio::piped())
                .stdout(Stdio::piped())
                .spawn()
                .unwrap()
        };
        child
            .stdin
            .take()
            .unwrap()
            .write_all(input.as_bytes())
            .unwrap();
        let output = child.wait_with_output().unwrap();
        (
            output.status.code().unwrap_or(-1),
            String::from_utf8_lossy(&output.stdout).into_owned(),
        )
    }

    /// Removes the private copy of the demo binary (this test is its only user here).
    struct RemoveCopy;

    impl Drop for RemoveCopy {
        fn drop(&mut self) {
            let _ = std::fs::remove_file(super::support::ledger_bin());
        }
    }

    #[tokio::test]
    async fn a_purge_of_young_rows_asks_on_a_terminal() {
        let _remove = RemoveCopy;
        let (pool, file) = inbox_tests::sqlite_pool(1).await;
        sqlx::query(RECENT).execute(&pool).await.unwrap();
        let url = format!("sqlite:{}", file.0.display());
        let rows = || inbox_tests::count(&pool, "SELECT COUNT(*) FROM inbox_messages");
        let purge = "purge --window 2h --redelivery-horizon 1h";

        // On a terminal: asked; "n" (or nothing) cancels, and nothing is deleted.
        for answer in ["n\n", "\n"] {
            let (code, printed) = admin(&url, purge, answer, true);
            assert_eq!(code, 1, "{printed}");
            assert!(printed.contains(QUESTION), "{printed:?}");
            assert!(
                printed.ends_with("ledger admin: purge cancelled: nothing deleted\r\n"),
                "{printed:?}"
            );
            assert_eq!(rows().await, 3);
        }
        // A window of a day or more: nothing young to delete, no question.
        // (On a terminal, the purge's spinner may draw on standard error before the result.)
        let (code, printed) = admin(&url, "purge --window 1d --redelivery-horizon 1h", "", true);
        assert_eq!(code, 0, "{printed}");
        assert!(!printed.contains("delete them?"), "{printed:?}");
        assert!(
            printed.ends_with(
                "purged 0 inbox rows older than 1d\r\n1 statement of at most 1000 rows each\r\n"
            ),
            "{printed:?}"
        );
        // A dry run never asks.
        let (code, printed) = admin(&url, &format!("{purge} --dry-run"), "", true);
        assert_eq!(code, 0, "{printed}");
        assert!(
            printed.ends_with("dry run: nothing deleted\r\n"),
            "{printed:?}"
        );
        assert_eq!(rows().await, 3);

        // Not a terminal: no question, the purge runs as asked.
        let (code, printed) = admin(&url, purge, "n\n", false);
        assert_eq!(
            (code, printed.as_str()),
            (
                0,
                "purged 2 inbox rows older than 2h\n1 statement of at most 1000 rows each\n"
            )
        );
        assert_eq!(rows().await, 1);

        // On a terminal: "y" confirms; `--yes` does not ask.
        sqlx::query("DELETE FROM inbox_messages")
            .execute(&pool)
            .await
            .unwrap();
        sqlx::query(RECENT).execute(&pool).await.unwrap();
        let (code, printed) = admin(&url, purge, "y\n", true);
        assert_eq!(code, 0, "{printed}");
        assert!(printed.contains(QUESTION), "{printed:?}");
        assert!(
            printed.ends_with(
                "purged 2 inbox rows older than 2h\r\n1 statement of at most 1000 rows each\r\n"
            ),
            "{printed:?}"
        );
        assert_eq!(rows().await, 1);
        sqlx::query("DELETE FROM inbox_messages")
            .execute(&pool)
            .await
            .unwrap();
        sqlx::query(RECENT).execute(&pool).await.unwrap();
        let (code, printed) = admin(&url, &format!("{purge} --yes"), "", true);
        assert_eq!(code, 0, "{printed}");
        assert!(!printed.contains("delete them?"), "{printed:?}");
        assert!(
            printed.ends_with(
                "purged 2 inbox rows older than 2h\r\n1 statement of at most 1000 rows each\r\n"
            ),
            "{printed:?}"
        );
        assert_eq!(rows().await, 1);
        pool.close().await;
    }
}
