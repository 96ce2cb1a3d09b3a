//! `ledger console`: the runtime's operator console ([`inbox_runtime::ops::console`]) in the
//! browser, over the demo's database, replaying with the demo's own registered handlers.
//!
//! Who may use it: `--token TOKEN` (or `LEDGER_CONSOLE_TOKEN`) asks the browser for a sign-in
//! (HTTP Basic: any user name, the token as the password; the user name is the operator's name
//! in the logs), or takes `Authorization: Bearer TOKEN` (operator `bearer`);
//! `--insecure-no-auth` serves everyone, for a console behind an authenticating proxy of your
//! own. One of the two is required.

use std::net::SocketAddr;

use axum::response::Redirect;
use axum::routing::get;
use base64::Engine as _;
use inbox_runtime::ops::console::{Console, Refusal};
use inbox_runtime::{Dispatcher, store::ConsoleDatabase};
use sqlx::Pool;

use crate::db::Db;

/// `ledger console` arguments.
#[derive(clap::Args, Debug)]
#[command(group(
    clap::ArgGroup::new("auth").required(true).args(["token", "insecure_no_auth"])
))]
pub(crate) struct ConsoleArgs {
    /// Address to serve the console on (at /console)
    #[arg(long, value_name = "ADDR", default_value = "127.0.0.1:8080")]
    listen: SocketAddr,
    /// Database: postgres://…, mysql://…, mariadb://… or sqlite:… [default: sqlite file ./ledger.db]
    #[arg(long, env = "DATABASE_URL", value_name = "URL", hide_env_values = true)]
    database_url: Option<String>,
    /// The password operators sign in with (HTTP Basic, any user name), or a bearer token
    #[arg(
        long,
        env = "LEDGER_CONSOLE_TOKEN",
        value_name = "TOKEN",
        hide_env_values = true
    )]
    token: Option<String>,
    /// Serve without authentication: only behind an authenticating proxy of your own
    #[arg(long)]
    insecure_no_auth: bool,
}

/// Serves the console until SIGINT. Logs go to stderr, filtered by `RUST_LOG` (default: the
/// console's actions, who did them, and warnings).
pub(crate) async fn run(args: ConsoleArgs) -> Result<(), String> {
    if args.token.as_deref() == Some("") {
        return Err("--token is empty".to_owned());
    }
    let filter = tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| {
        tracing_subscriber::EnvFilter::new("warn,inbox_runtime::ops::console=info")
    });
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .try_init();
    let (db, description) = Db::connect_with(args.database_url.as_deref(), 4)
        .await
        .map_err(|e| e.to_string())?;
    let result = match &db {
        Db::Postgres(pool) => serve(pool.clone(), &args, &description).await,
        Db::Sqlite(pool) => serve(pool.clone(), &args, &description).await,
        Db::MySql(pool) => serve(pool.clone(), &args, &description).await,
    };
    db.close().await;
    result
}

async fn serve<DB: ConsoleDatabase>(
    pool: Pool<DB>,
    args: &ConsoleArgs,
    description: &str,
) -> Result<(), String> {
    let dispatcher = Dispatcher::from_registry(pool).map_err(|e| e.to_string())?;
    let console = Console::new(dispatcher);
    let console = match args.token.clone() {
        Some(token) => console.authorize(move |parts| authorize(&token, parts)),
        None => console.behind_own_auth(),
    };
    let console = console.build().map_err(|e| e.to_string())?;
    let app = axum::Router::new()
        .nest("/console", console)
        .route("/", get(|| async { Redirect::to("/console") }));
    let listener = tokio::net::TcpListener::bind(args.listen)
        .await
        .map_err(|e| format!("cannot listen on {}: {e}", args.listen))?;
    eprintln!(
        "ledger console: http://{}/console on {description} ({})",
        listener.local_addr().map_err(|e| e.to_string())?,
        if args.token.is_some() {
            "sign in with any user name and the token as the password"
        } else {
            "NO AUTHENTICATION: keep it behind your own"
        }
    );
    axum::serve(listener, app)
        .with_graceful_shutdown(async {
            let _ = tokio::signal::ctrl_c().await;
        })
        .await
        .map_err(|e| e.to_string())
}

/// The operator of a request carrying `token`: Basic (user name, token) or Bearer.
fn authorize(token: &str, parts: &axum::http::request::Parts) -> Result<String, Refusal> {
    let challenge =
        || Refusal::unauthenticated("Basic realm=\"ledger console\", charset=\"UTF-8\"");
    let Some(value) = parts
        .headers
        .get(axum::http::header::AUTHORIZATION)
        .and_then(|value| value.to_str().ok())
    else {
        return Err(challenge());
    };
    if let Some(bearer) = value.strip_prefix("Bearer ") {
        return if same(bearer.as_bytes(), token.as_bytes()) {
            Ok("bearer".to_owned())
        } else {
            Err(challenge())
        };
    }
    let decoded = value
        .strip_prefix("Basic ")
        .and_then(|basic| base64::engine::general_purpose::STANDARD.decode(basic).ok())
        .and_then(|bytes| String::from_utf8(bytes).ok());
    match decoded.as_deref().and_then(|text| text.split_once(':')) {
        Some((user, password)) if same(password.as_bytes(), token.as_bytes()) => {
            Ok(if user.is_empty() { "operator" } else { user }.to_owned())
        }
        _ => Err(challenge()),
    }
}

/// `a == b` in time that depends on the lengths only (`subtle`'s constant-time comparison).
fn same(a: &[u8], b: &[u8]) -> bool {
    use subtle::ConstantTimeEq as _;
    a.ct_eq(b).into()
}

#[cfg(test)]
mod tests {
    use super::authorize;
    use inbox_runtime::ops::console::Refusal;

    fn parts(authorization: Option<&str>) -> axum::http::request::Parts {
        let mut request = axum::http::Request::builder();
        if let Some(value) = authorization {
            request = request.header("authorization", value);
        }
        request.body(()).unwrap().into_parts().0
    }

    #[test]
    fn basic_and_bearer_with_the_token_only() {
        // "alice:s3cret" and "alice:wrong".
        assert_eq!(
            authorize("s3cret", &parts(Some("Basic YWxpY2U6czNjcmV0"))),
            Ok("alice".to_owned())
        );
        assert_eq!(
            authorize("s3cret", &parts(Some("Bearer s3cret"))),
            Ok("bearer".to_owned())
        );
        for refused in [
            None,
            Some("Basic YWxpY2U6d3Jvbmc="),
            Some("Bearer nope"),
            Some("x"),
        ] {
            assert!(matches!(
                authorize("s3cret", &parts(refused)),
                Err(Refusal::Unauthenticated { .. })
            ));
        }
    }
}
