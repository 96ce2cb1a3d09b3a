//! The console's `/outbox` page: the outbox's rows per destination and status, and its
//! pending and dead rows.

use std::fmt::Write as _;

use axum::extract::{Request, State};
use axum::response::Response;
use http::StatusCode;

use super::{
    ErrorPage, Params, Shared, age, bad_request, database, escape, get_page, layout, now_secs,
};
use crate::store::OutboxStatus;
use crate::store::{ConsoleDatabase, OutboxAdminStore as _, OutboxEntry, OutboxStatsRow};

impl Params {
    /// `status` of the outbox list: `pending` or `dead`; absent: both.
    fn outbox_statuses(&self) -> Result<&'static [OutboxStatus], ErrorPage> {
        match self.get("status") {
            None | Some("") => Ok(&[OutboxStatus::Pending, OutboxStatus::Dead]),
            Some("pending") => Ok(&[OutboxStatus::Pending]),
            Some("dead") => Ok(&[OutboxStatus::Dead]),
            Some(other) => Err(bad_request(&format!(
                "Status “{other}” is not one the outbox list shows: give pending or dead \
                 (or nothing, for both)."
            ))),
        }
    }
}

/// `/outbox?status=&destination=&limit=`: the outbox's rows per destination and status, and
/// its pending and dead rows; says so when the outbox is not installed.
pub(super) async fn outbox<DB: ConsoleDatabase>(
    State(inner): Shared<DB>,
    request: Request,
) -> Response {
    get_page(&inner, request, &["status", "destination", "limit"], async |ctx, params| {
        let statuses = params.outbox_statuses()?;
        let limit = params.limit()?;
        let destination = params.get("destination").filter(|d| !d.is_empty());
        if destination.is_some_and(|d| d.contains('\0')) {
            return Err(bad_request("The destination contains a NUL character."));
        }
        let mut conn = inner.conn().await?;
        if !conn.outbox_installed().await.map_err(database)? {
            let body = "<h1>Outbox</h1><p class=\"notice\" data-outbox=\"absent\">The outbox is \
                        not installed in this database (its tables were not migrated: \
                        <code>Component::Outbox</code>).</p>";
            return Ok(layout(&ctx, StatusCode::OK, "Outbox", body));
        }
        let stats = conn.outbox_stats().await.map_err(database)?;
        if let Some(destination) = destination
            && !stats.iter().any(|row| row.destination == destination)
        {
            return Err(bad_request(&format!(
                "Unknown destination “{destination}”: the outbox has no rows for it."
            )));
        }
        let rows = conn
            .list_outbox(statuses, destination, i64::from(limit))
            .await
            .map_err(database)?;
        drop(conn);
        let mut body = String::from("<h1>Outbox</h1>");
        outbox_counts(&mut body, &stats, now_secs());
        outbox_rows(&mut body, statuses, &rows, limit);
        Ok(layout(&ctx, StatusCode::OK, "Outbox", &body))
    })
    .await
}

/// The outbox page's counts: per destination, the rows in each status and the age of the
/// oldest pending and dead ones.
fn outbox_counts(body: &mut String, stats: &[OutboxStatsRow], now: i64) {
    body.push_str("<table class=\"outbox\"><thead><tr><th>destination</th>");
    for status in OutboxStatus::ALL {
        let _ = write!(body, "<th class=\"num\">{}</th>", status.as_str());
    }
    body.push_str("<th>oldest pending</th><th>oldest dead</th></tr></thead><tbody>");
    let destinations: std::collections::BTreeSet<&str> =
        stats.iter().map(|row| row.destination.as_str()).collect();
    for name in &destinations {
        let d = escape(name);
        let _ = write!(body, "<tr><th>{d}</th>");
        let find = |status: OutboxStatus| {
            stats
                .iter()
                .find(|row| row.destination == *name && row.status == status)
        };
        for status in OutboxStatus::ALL {
            let _ = write!(
                body,
                "<td class=\"num\" data-destination=\"{d}\" data-status=\"{}\">{}</td>",
                status.as_str(),
                find(status).map_or(0, |row| row.count)
            );
        }
        for status in [OutboxStatus::Pending, OutboxStatus::Dead] {
            let oldest = find(status)
                .and_then(|row| row.oldest.as_deref())
                .map_or_else(|| "—".to_owned(), |at| age(at, now));
            let _ = write!(body, "<td>{}</td>", escape(&oldest));
        }
        body.push_str("</tr>");
    }
    if destinations.is_empty() {
        body.push_str("<tr><td colspan=\"6\" class=\"muted\">The outbox is empty.</td></tr>");
    }
    body.push_str("</tbody></table>");
}

/// The outbox page's list of `rows` (in `statuses`, at most `limit`).
fn outbox_rows(body: &mut String, statuses: &[OutboxStatus], rows: &[OutboxEntry], limit: u32) {
    let _ = write!(
        body,
        "<h2>{} rows</h2><p data-count=\"outbox\">{} (oldest first).</p>\
         <table class=\"outbox-rows\"><thead><tr><th>id</th><th>message id</th>\
         <th>destination</th><th>message</th><th>status</th><th class=\"num\">attempts</th>\
         <th>created</th><th>last error</th></tr></thead><tbody>",
        statuses
            .iter()
            .map(|s| s.as_str())
            .collect::<Vec<_>>()
            .join(" and "),
        super::shown(rows.len(), limit),
    );
    for row in rows {
        let _ = write!(
            body,
            "<tr data-outbox-id=\"{}\"><td class=\"num\">{}</td><td class=\"key\">{}</td>\
             <td>{}</td><td>{}</td><td>{}</td><td class=\"num\">{}</td><td>{}</td>\
             <td class=\"error\">{}</td></tr>",
            row.id,
            row.id,
            escape(&row.message_id),
            escape(&row.destination),
            escape(&row.message_name),
            row.status.as_str(),
            row.attempts,
            escape(&crate::ops::admin::utc_time(&row.created_at)),
            escape(&super::cut(row.last_error.as_deref().unwrap_or(""), 200)),
        );
    }
    body.push_str("</tbody></table>");
}
