//! CSRF protection of the console's actions: tokens that carry their issue time and expire,
//! and the cross-site checks of a `POST` (`Sec-Fetch-Site`, `Origin`).

use axum::body::Body;
use hmac::{Hmac, Mac};
use http::request::Parts;
use http::{StatusCode, header};
use sha2::Sha256;

use super::{Ctx, ErrorPage, Inner, Params, admin, bare, now_secs};
use crate::store::ConsoleDatabase;

/// 32 random bytes: two version-4 UUIDs' random bits (from the operating system's generator).
pub(super) fn random_secret() -> [u8; 32] {
    let mut secret = [0; 32];
    secret[..16].copy_from_slice(uuid::Uuid::new_v4().as_bytes());
    secret[16..].copy_from_slice(uuid::Uuid::new_v4().as_bytes());
    secret
}

/// How a form's CSRF token checked out.
enum TokenCheck {
    Fresh,
    /// Missing, malformed, or not this operator's under this secret.
    Wrong,
    /// This operator's, and older than the lifetime.
    Expired,
}

/// How far in the future a token may have been issued (by a replica whose clock is ahead):
/// 5 minutes.
const CLOCK_SLACK_SECS: i64 = 300;

/// The request's form body, parsed as [`Params`], after the CSRF checks.
pub(super) async fn form<DB: ConsoleDatabase>(
    inner: &Inner<DB>,
    ctx: &Ctx,
    parts: &Parts,
    body: Body,
    max_bytes: usize,
    allowed: &[&str],
) -> Result<Params, ErrorPage> {
    if let Some(why) = cross_site(parts) {
        tracing::warn!(
            target: "inbox_runtime::ops::console",
            operator = ?ctx.operator,
            why,
            "console: cross-site POST refused"
        );
        return Err(bare(
            StatusCode::FORBIDDEN,
            "Cross-site request refused",
            &format!("This action was sent from another site and is refused ({why})."),
        ));
    }
    let bytes = axum::body::to_bytes(body, max_bytes).await.map_err(|_| {
        bare(
            StatusCode::PAYLOAD_TOO_LARGE,
            "Form too large",
            &format!("This form of the console is at most {max_bytes} bytes."),
        )
    })?;
    // The token first: a forged request learns nothing about the other fields.
    let token = form_urlencoded::parse(&bytes)
        .find(|(name, _)| name == "csrf")
        .map(|(_, value)| value.into_owned());
    let (title, text) = match inner.check_token(&ctx.operator, token.as_deref()) {
        TokenCheck::Fresh => return Params::parse(&bytes, allowed),
        TokenCheck::Wrong => {
            tracing::warn!(
                target: "inbox_runtime::ops::console",
                operator = ?ctx.operator,
                "console: POST without a valid CSRF token refused"
            );
            (
                "Invalid form token",
                String::from(
                    "This action's form token (CSRF) is missing or wrong: open the page again \
                     and confirm from there.",
                ),
            )
        }
        TokenCheck::Expired => {
            tracing::info!(
                target: "inbox_runtime::ops::console",
                operator = ?ctx.operator,
                "console: POST with an expired CSRF token refused"
            );
            (
                "Page expired",
                format!(
                    "This page expired: its form token is valid for {} and is older. Nothing \
                     was changed. Reload the page and confirm again.",
                    admin::format_skew(inner.lifetime)
                ),
            )
        }
    };
    Err(bare(StatusCode::FORBIDDEN, title, &text))
}

/// Why a `POST` looks cross-site, if it does: a `Sec-Fetch-Site` other than `same-origin` (or
/// `none`, typed by the user); without that header (older browsers), an `Origin` that is not
/// this request's host. A browser's `Sec-Fetch-Site` is decided: `Origin` is not compared then,
/// since a reverse proxy may rewrite `Host` (nginx's default `proxy_set_header Host
/// $proxy_host`), which would refuse every same-origin form behind it.
fn cross_site(parts: &Parts) -> Option<String> {
    if let Some(site) = parts.headers.get("sec-fetch-site") {
        let site = site.to_str().unwrap_or("?");
        return (site != "same-origin" && site != "none")
            .then(|| format!("Sec-Fetch-Site: {site}"));
    }
    let origin = parts.headers.get(header::ORIGIN)?;
    let origin = origin.to_str().unwrap_or("?");
    let host = parts
        .headers
        .get(header::HOST)
        .and_then(|host| host.to_str().ok())
        .or_else(|| parts.uri.authority().map(|a| a.as_str()));
    let same = host.is_some_and(|host| {
        origin
            .strip_prefix("https://")
            .or_else(|| origin.strip_prefix("http://"))
            .is_some_and(|rest| rest.eq_ignore_ascii_case(host))
    });
    (!same).then(|| format!("Origin: {origin}"))
}

/// The hidden CSRF field of `ctx`'s operator.
pub(super) fn csrf_field<DB: ConsoleDatabase>(inner: &Inner<DB>, ctx: &Ctx) -> String {
    format!(
        "<input type=\"hidden\" name=\"csrf\" value=\"{}\">",
        inner.token(&ctx.operator)
    )
}

impl<DB: ConsoleDatabase> Inner<DB> {
    /// The CSRF token of `operator`, issued now: `<issued>.<mac>`, the issue time in seconds
    /// since the epoch and the hex HMAC-SHA256 of the operator's name and that time under the
    /// console's secret.
    pub(super) fn token(&self, operator: &str) -> String {
        let issued = now_secs();
        format!(
            "{issued}.{}",
            hex::encode(self.mac(operator, issued).finalize().into_bytes())
        )
    }

    fn mac(&self, operator: &str, issued: i64) -> Hmac<Sha256> {
        let mut mac = <Hmac<Sha256> as Mac>::new_from_slice(&self.secret)
            .expect("HMAC takes keys of any length");
        mac.update(operator.as_bytes());
        mac.update(b"\0");
        mac.update(issued.to_string().as_bytes());
        mac
    }

    /// Whether `token` is `operator`'s (the MAC compared in constant time) and still fresh.
    fn check_token(&self, operator: &str, token: Option<&str>) -> TokenCheck {
        let Some((issued, mac)) = token.and_then(|token| token.split_once('.')) else {
            return TokenCheck::Wrong;
        };
        let (Ok(issued), Ok(bytes)) = (issued.parse::<i64>(), hex::decode(mac)) else {
            return TokenCheck::Wrong;
        };
        if self.mac(operator, issued).verify_slice(&bytes).is_err() {
            return TokenCheck::Wrong;
        }
        let age = now_secs().saturating_sub(issued);
        // A replica whose clock runs ahead may have issued it a little in the future.
        if age < -CLOCK_SLACK_SECS
            || age >= i64::try_from(self.lifetime.as_secs()).unwrap_or(i64::MAX)
        {
            return TokenCheck::Expired;
        }
        TokenCheck::Fresh
    }
}
