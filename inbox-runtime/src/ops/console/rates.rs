//! The console's `/rates` page: per consumer and series, arrivals per hour over the last day,
//! and the outbox's sent rows per destination.

use std::collections::BTreeMap;
use std::fmt::Write as _;

use axum::extract::{Request, State};
use axum::response::Response;
use http::StatusCode;

use super::{Shared, database, escape, get_page, layout};
use crate::Status;
use crate::store::{
    ArrivalRow, ConsoleDatabase, ConsoleStore as _, OutboxAdminStore as _, RejectionReason,
    StatsStatus,
};

/// The hours the rates page shows.
pub(super) const RATE_HOURS: i64 = 24;

/// The series of the rates page: inbox rows by their status now, and rejections by reason.
const SERIES: [StatsStatus; 8] = [
    StatsStatus::Message(Status::Processed),
    StatsStatus::Message(Status::Failed),
    StatsStatus::Message(Status::Dead),
    StatsStatus::Message(Status::Parked),
    StatsStatus::Message(Status::Stale),
    StatsStatus::Message(Status::Discarded),
    StatsStatus::Rejected(RejectionReason::Conflict),
    StatsStatus::Rejected(RejectionReason::Malformed),
];

/// `/rates`: per consumer and series, arrivals per hour over the last day, as inline SVG bars.
pub(super) async fn rates<DB: ConsoleDatabase>(
    State(inner): Shared<DB>,
    request: Request,
) -> Response {
    get_page(&inner, request, &[], async |ctx, _params| {
        // One connection for the page's three reads: the arrivals, whether the outbox is
        // installed, what it sent (asking the pool for a second one while holding it starved a
        // pool of one connection until the pool's acquire timeout).
        let mut conn = inner.conn().await?;
        let (now_hour, rows) = conn.arrivals(RATE_HOURS).await.map_err(database)?;
        let sent_rows = if conn.outbox_installed().await.map_err(database)? {
            Some(conn.outbox_sent(RATE_HOURS).await.map_err(database)?)
        } else {
            None
        };
        drop(conn);
        let first = now_hour - (RATE_HOURS - 1);
        // consumer → series → 24 hourly counts, oldest first.
        let mut table: BTreeMap<Option<String>, BTreeMap<StatsStatus, Vec<i64>>> = BTreeMap::new();
        for ArrivalRow {
            consumer,
            series,
            hour,
            count,
            ..
        } in rows
        {
            let Some(slot) = usize::try_from(hour - first)
                .ok()
                .filter(|&slot| slot < RATE_HOURS as usize)
            else {
                continue;
            };
            table
                .entry(consumer)
                .or_default()
                .entry(series)
                .or_insert_with(|| vec![0; RATE_HOURS as usize])[slot] += count;
        }
        for handler in inner.dispatcher.handlers() {
            table.entry(Some(handler.consumer.to_owned())).or_default();
        }
        let mut body = format!(
            "<h1>Rates, last {RATE_HOURS} hours</h1><p class=\"muted\">Per consumer and hour \
             (UTC, database clock; the last bar is the hour under way): the messages first \
             delivered in that hour, by their status now (<code>inbox_messages.received_at</code>: \
             a message that failed and later succeeded counts as processed in the hour it \
             first came), and the deliveries rejected in that hour, by reason \
             (<code>inbox_rejections</code>; a conflict is the same key with another payload). \
             Duplicates leave no row (a redelivery of a processed key changes nothing): their \
             rate is the <code>inbox_messages_total{{outcome=\"duplicate\"}}</code> metric's, \
             not the tables'.</p>"
        );
        for (consumer, series) in &table {
            let name = consumer.as_deref().unwrap_or("(no consumer)");
            let _ = write!(
                body,
                "<section class=\"rates\" data-consumer=\"{0}\"><h2>{0}</h2><table class=\"rates\">\
                 <thead><tr><th>series</th><th class=\"num\">total</th><th>per hour</th></tr>\
                 </thead><tbody>",
                escape(name)
            );
            let mut all: Vec<StatsStatus> = SERIES.to_vec();
            all.extend(series.keys().filter(|s| !SERIES.contains(s)));
            for kind in all {
                let zero = vec![0; RATE_HOURS as usize];
                let counts = series.get(&kind).unwrap_or(&zero);
                let label = match kind {
                    StatsStatus::Message(status) => status.as_str().to_owned(),
                    StatsStatus::Rejected(reason) => format!("rejected: {}", reason.as_str()),
                };
                let _ = write!(
                    body,
                    "<tr><th>{label}</th><td class=\"num\" data-series=\"{}\">{}</td><td>{}</td></tr>",
                    kind.as_str(),
                    counts.iter().sum::<i64>(),
                    super::chart::bars(counts, first, &label),
                );
            }
            body.push_str("</tbody></table></section>");
        }
        if table.is_empty() {
            body.push_str("<p class=\"muted\">No arrivals and no handler registered.</p>");
        }
        if let Some(rows) = sent_rows {
            sent_section(&mut body, rows, first);
        }
        Ok(layout(&ctx, StatusCode::OK, "Rates", &body))
    })
    .await
}

/// The rates page's outbox section: rows sent per destination and hour, from `first` (hours
/// since the epoch) on.
fn sent_section(body: &mut String, rows: Vec<crate::store::SentRow>, first: i64) {
    let mut sent: BTreeMap<String, Vec<i64>> = BTreeMap::new();
    for (destination, hour, count) in rows {
        if let Some(slot) = usize::try_from(hour - first)
            .ok()
            .filter(|&slot| slot < RATE_HOURS as usize)
        {
            sent.entry(destination)
                .or_insert_with(|| vec![0; RATE_HOURS as usize])[slot] += count;
        }
    }
    body.push_str(
        "<section class=\"rates\" data-outbox=\"sent\"><h2>Outbox: sent per hour</h2>\
         <p class=\"muted\">Rows the relays sent, per destination and hour of \
         <code>sent_at</code> (until the retention purge deletes them).</p>\
         <table class=\"rates\"><thead><tr><th>destination</th><th class=\"num\">total</th>\
         <th>per hour</th></tr></thead><tbody>",
    );
    for (destination, counts) in &sent {
        let d = escape(destination);
        let _ = write!(
            body,
            "<tr><th>{d}</th><td class=\"num\" data-destination=\"{d}\">{}</td><td>{}</td></tr>",
            counts.iter().sum::<i64>(),
            super::chart::bars(counts, first, &format!("{destination} sent")),
        );
    }
    if sent.is_empty() {
        body.push_str(
            "<tr><td colspan=\"3\" class=\"muted\">Nothing sent in these hours.</td></tr>",
        );
    }
    body.push_str("</tbody></table></section>");
}
