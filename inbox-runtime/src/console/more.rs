//! The console's pages over rejections, parked messages, the outbox and arrival rates.

use std::collections::BTreeMap;
use std::fmt::Write as _;

use axum::extract::{Request, State};
use axum::response::Response;
use http::StatusCode;

use super::{
    Inner, Params, Problem, Shared, age, bad_request, bare, database, encode, escape, layout,
    now_secs, run,
};
use crate::outbox::admin as outbox_admin;
use crate::store::{
    ArrivalRow, ConsoleDatabase, ConsoleStore as _, ParkedEntry, RejectionEntry, RejectionReason,
    StatsStatus,
};
use crate::{OutboxStatus, Status};

/// The hours the rates page shows.
pub(super) const RATE_HOURS: i64 = 24;

/// The bytes of a rejection's payload shown in the hex dump: 64 KiB.
const MAX_DUMP_BYTES: usize = 64 * 1024;

impl Params {
    /// `reason`: a rejection reason, or absent.
    fn reason(&self) -> Result<Option<RejectionReason>, Problem> {
        match self.get("reason") {
            None | Some("") => Ok(None),
            Some(text) => text.parse().map(Some).map_err(|_| {
                bad_request(&format!(
                    "Reason “{text}” is not a rejection reason: give conflict, malformed, \
                     unknown_message, invalid_key or too_large."
                ))
            }),
        }
    }
}

/// Recent rejected deliveries, newest first, linked to their detail (below the counts of
/// `/rejections`).
pub(super) async fn rejection_list<DB: ConsoleDatabase>(
    inner: &Inner<DB>,
    ctx: &super::Ctx,
    params: &Params,
    body: &mut String,
) -> Result<(), Problem> {
    let reason = params.reason()?;
    let limit = params.limit()?;
    let consumer = params.consumer(inner, false).await?;
    let mut conn = inner.dispatcher.pool().acquire().await.map_err(database)?;
    let rows = conn
        .list_rejections(consumer.as_deref(), reason, i64::from(limit))
        .await
        .map_err(database)?;
    let _ = write!(
        body,
        "<h2>Recent rejections</h2><p data-count=\"rejections\">{} (newest first).</p>\
         <table class=\"rejection-list\"><thead><tr><th>id</th><th>consumer</th><th>reason</th>\
         <th>key</th><th>message</th><th>received</th><th class=\"num\">bytes</th></tr></thead>\
         <tbody>",
        super::shown(rows.len(), limit),
    );
    for row in &rows {
        let _ = write!(
            body,
            "<tr data-rejection=\"{id}\"><td><a href=\"{}\">{id}</a></td><td>{}</td><td>{}</td>\
             <td class=\"key\">{}</td><td>{}</td><td>{}</td><td class=\"num\">{}</td></tr>",
            escape(&format!("{}?id={}", ctx.link("/rejection"), row.id)),
            escape(row.consumer.as_deref().unwrap_or("(none)")),
            row.reason.as_str(),
            escape(row.message_key.as_deref().unwrap_or("—")),
            escape(&row.message_name),
            escape(&crate::admin::utc_time(&row.received_at)),
            sizes(row),
            id = row.id,
        );
    }
    body.push_str("</tbody></table>");
    Ok(())
}

/// `kept` or `kept of real` bytes.
fn sizes(row: &RejectionEntry) -> String {
    match row.payload_size {
        Some(real) => format!("{} of {real}", row.kept_bytes),
        None => row.kept_bytes.to_string(),
    }
}

/// `/rejection?id=`: one rejected delivery with its payload bytes.
pub(super) async fn rejection<DB: ConsoleDatabase>(
    State(inner): Shared<DB>,
    request: Request,
) -> Response {
    let (parts, _) = request.into_parts();
    run(async {
        let ctx = inner.begin(&parts)?;
        let params = Params::query(&parts, &["id"])?;
        let text = params.required("id")?;
        let id = match text.parse::<i64>() {
            Ok(id) if id > 0 => id,
            _ => {
                return Err(bad_request(&format!(
                    "Id “{text}” is not a rejection's id: give a whole number from 1."
                )));
            }
        };
        let mut conn = inner.dispatcher.pool().acquire().await.map_err(database)?;
        let row = conn
            .fetch_rejection(id)
            .await
            .map_err(database)?
            .ok_or_else(|| {
                bare(
                    StatusCode::NOT_FOUND,
                    "No such rejection",
                    &format!("No rejected delivery has id {id}."),
                )
            })?;
        let payload = row.payload.as_deref().unwrap_or_default();
        let mut body = format!(
            "<h1>Rejected delivery {id}</h1><dl>\
             <dt>consumer</dt><dd data-field=\"consumer\">{}</dd>\
             <dt>reason</dt><dd data-field=\"reason\">{}</dd>\
             <dt>key</dt><dd class=\"key\" data-field=\"key\">{}</dd>\
             <dt>message</dt><dd data-field=\"message\">{}</dd>\
             <dt>received</dt><dd>{}</dd><dt>source</dt><dd>{}</dd>\
             <dt>payload hash</dt><dd class=\"key\">{}</dd>\
             <dt>bytes</dt><dd data-field=\"bytes\">{}</dd></dl>\
             <h2>Detail</h2><pre data-field=\"detail\">{}</pre>",
            escape(row.consumer.as_deref().unwrap_or("(none)")),
            row.reason.as_str(),
            escape(row.message_key.as_deref().unwrap_or("—")),
            escape(&row.message_name),
            escape(&crate::admin::utc_time(&row.received_at)),
            escape(row.source.as_deref().unwrap_or("—")),
            escape(row.payload_hash.as_deref().unwrap_or("—")),
            sizes(&row),
            escape(&row.detail),
        );
        if row.payload_size.is_some() {
            body.push_str(
                "<p class=\"notice\">The payload was over the size limit: only its first bytes \
                 are kept.</p>",
            );
        }
        match std::str::from_utf8(payload) {
            Ok(text) => {
                let _ = write!(
                    body,
                    "<h2>Payload as text (UTF-8)</h2><pre data-field=\"payload-text\">{}</pre>",
                    escape(text)
                );
            }
            Err(error) => {
                let _ = write!(
                    body,
                    "<h2>Payload as text</h2><p class=\"muted\" data-field=\"payload-text\">Not \
                     UTF-8 (invalid at byte {}): see the bytes.</p>",
                    error.valid_up_to()
                );
            }
        }
        let _ = write!(
            body,
            "<h2>Payload bytes</h2><pre class=\"hex\" data-field=\"payload-hex\">{}</pre>",
            escape(&hex_dump(payload, MAX_DUMP_BYTES))
        );
        let _ = write!(
            body,
            "<p><a href=\"{}\">Back to the rejections</a></p>",
            escape(&ctx.link("/rejections"))
        );
        Ok(layout(&ctx, StatusCode::OK, "Rejection", &body))
    })
    .await
}

/// A hex dump: per line of 16 bytes, the offset, the bytes in hex, and the printable ASCII
/// (others as `.`), at most `max` bytes (a note says how many more there are).
pub(super) fn hex_dump(bytes: &[u8], max: usize) -> String {
    let mut out = String::new();
    for (line, chunk) in bytes[..bytes.len().min(max)].chunks(16).enumerate() {
        let _ = write!(out, "{:08x}  ", line * 16);
        for i in 0..16 {
            match chunk.get(i) {
                Some(byte) => {
                    let _ = write!(out, "{byte:02x} ");
                }
                None => out.push_str("   "),
            }
            if i == 7 {
                out.push(' ');
            }
        }
        out.push(' ');
        for &byte in chunk {
            out.push(if byte.is_ascii_graphic() || byte == b' ' {
                char::from(byte)
            } else {
                '.'
            });
        }
        out.push('\n');
    }
    if bytes.len() > max {
        let _ = writeln!(out, "… {} more bytes not shown", bytes.len() - max);
    }
    if bytes.is_empty() {
        out.push_str("(no bytes)");
    }
    out
}

/// One aggregate with parked messages: its consumer, id, last applied sequence and the
/// parked messages' sequences and keys.
pub(super) struct Aggregate {
    pub(super) consumer: String,
    pub(super) aggregate_id: String,
    pub(super) last_sequence: i64,
    pub(super) parked: Vec<(i64, String, String)>,
}

impl Aggregate {
    /// The sequence the aggregate waits for.
    pub(super) fn expected(&self) -> i64 {
        self.last_sequence.saturating_add(1)
    }

    /// The missing sequences between the expected one and the last parked one, as inclusive
    /// ranges.
    pub(super) fn gaps(&self) -> Vec<(i64, i64)> {
        let mut gaps = Vec::new();
        let mut next = self.expected();
        for &(sequence, _, _) in &self.parked {
            if sequence > next {
                gaps.push((next, sequence - 1));
            }
            next = next.max(sequence.saturating_add(1));
        }
        gaps
    }
}

/// Parked rows grouped per aggregate, in their order.
pub(super) fn aggregates(rows: Vec<ParkedEntry>) -> Vec<Aggregate> {
    let mut out: Vec<Aggregate> = Vec::new();
    for row in rows {
        match out.last_mut() {
            Some(last)
                if last.consumer == row.consumer && last.aggregate_id == row.aggregate_id =>
            {
                last.parked
                    .push((row.sequence, row.message_key, row.received_at));
            }
            _ => out.push(Aggregate {
                consumer: row.consumer,
                aggregate_id: row.aggregate_id,
                last_sequence: row.last_sequence,
                parked: vec![(row.sequence, row.message_key, row.received_at)],
            }),
        }
    }
    out
}

/// `2–5, 7`.
pub(super) fn ranges(gaps: &[(i64, i64)]) -> String {
    if gaps.is_empty() {
        return "none".to_owned();
    }
    gaps.iter()
        .map(|&(from, to)| {
            if from == to {
                from.to_string()
            } else {
                format!("{from}–{to}")
            }
        })
        .collect::<Vec<_>>()
        .join(", ")
}

/// `/parked?consumer=&limit=`: parked messages per aggregate, with the expected sequence and
/// the gaps.
pub(super) async fn parked<DB: ConsoleDatabase>(
    State(inner): Shared<DB>,
    request: Request,
) -> Response {
    let (parts, _) = request.into_parts();
    run(async {
        let ctx = inner.begin(&parts)?;
        let params = Params::query(&parts, &["consumer", "limit"])?;
        let limit = params.limit()?;
        let consumer = params.consumer(&inner, false).await?;
        let mut conn = inner.dispatcher.pool().acquire().await.map_err(database)?;
        let rows = conn
            .list_parked(consumer.as_deref(), i64::from(limit))
            .await
            .map_err(database)?;
        let shown = rows.len();
        let groups = aggregates(rows);
        let now = now_secs();
        let mut body = format!(
            "<h1>Parked messages per aggregate</h1><p class=\"muted\">A message that arrives \
             before its predecessor waits, parked, until the missing sequences have been \
             applied. Per aggregate: the sequence it waits for (one after the last applied), \
             the parked sequences, and the sequences still missing between them.</p>\
             <p>{shown} parked message{} shown{}, in {} aggregate{}.</p>",
            if shown == 1 { "" } else { "s" },
            if shown as u64 == u64::from(limit) {
                " (the limit: there may be more, and the last aggregate may have more)"
            } else {
                ""
            },
            groups.len(),
            if groups.len() == 1 { "" } else { "s" },
        );
        body.push_str(
            "<table class=\"parked\"><thead><tr><th>consumer</th><th>aggregate</th>\
             <th class=\"num\">last applied</th><th class=\"num\">waits for</th>\
             <th>missing</th><th>parked</th><th>oldest parked</th></tr></thead><tbody>",
        );
        for group in &groups {
            let c = escape(&group.consumer);
            let a = escape(&group.aggregate_id);
            let mut parked = String::new();
            for (sequence, key, _) in &group.parked {
                let _ = write!(
                    parked,
                    "<a href=\"{}\" title=\"{}\">#{sequence}</a> ",
                    escape(&format!(
                        "{}?consumer={}&key={}",
                        ctx.link("/message"),
                        encode(&group.consumer),
                        encode(key)
                    )),
                    escape(key)
                );
            }
            let oldest = group
                .parked
                .iter()
                .map(|(_, _, at)| at.as_str())
                .min()
                .map_or_else(|| "—".to_owned(), |at| age(at, now));
            let _ = write!(
                body,
                "<tr data-consumer=\"{c}\" data-aggregate=\"{a}\"><td>{c}</td>\
                 <td class=\"key\">{a}</td><td class=\"num\" data-field=\"last\">{}</td>\
                 <td class=\"num\" data-field=\"expected\">{}</td>\
                 <td data-field=\"gaps\">{}</td><td data-field=\"parked\">{}</td><td>{}</td></tr>",
                group.last_sequence,
                group.expected(),
                ranges(&group.gaps()),
                parked.trim_end(),
                escape(&oldest),
            );
        }
        if groups.is_empty() {
            body.push_str("<tr><td colspan=\"7\" class=\"muted\">No parked messages.</td></tr>");
        }
        body.push_str("</tbody></table>");
        Ok(layout(&ctx, StatusCode::OK, "Parked", &body))
    })
    .await
}

/// `/outbox?status=&destination=&limit=`: the outbox's rows per destination and status, and
/// its pending and dead rows; says so when the outbox is not installed.
pub(super) async fn outbox<DB: ConsoleDatabase>(
    State(inner): Shared<DB>,
    request: Request,
) -> Response {
    let (parts, _) = request.into_parts();
    run(async {
        let ctx = inner.begin(&parts)?;
        let params = Params::query(&parts, &["status", "destination", "limit"])?;
        let statuses: &[OutboxStatus] = match params.get("status") {
            None | Some("") => &[OutboxStatus::Pending, OutboxStatus::Dead],
            Some("pending") => &[OutboxStatus::Pending],
            Some("dead") => &[OutboxStatus::Dead],
            Some(other) => {
                return Err(bad_request(&format!(
                    "Status “{other}” is not one the outbox list shows: give pending or dead \
                     (or nothing, for both)."
                )));
            }
        };
        let limit = params.limit()?;
        let destination = params.get("destination").filter(|d| !d.is_empty());
        if destination.is_some_and(|d| d.contains('\0')) {
            return Err(bad_request("The destination contains a NUL character."));
        }
        let pool = inner.dispatcher.pool();
        if !outbox_admin::installed(pool).await.map_err(database)? {
            let body = "<h1>Outbox</h1><p class=\"notice\" data-outbox=\"absent\">The outbox is \
                        not installed in this database (its tables were not migrated: \
                        <code>Component::Outbox</code>).</p>";
            return Ok(layout(&ctx, StatusCode::OK, "Outbox", body));
        }
        let stats = outbox_admin::stats(pool).await.map_err(database)?;
        if let Some(destination) = destination
            && !stats.iter().any(|row| row.destination == destination)
        {
            return Err(bad_request(&format!(
                "Unknown destination “{destination}”: the outbox has no rows for it."
            )));
        }
        let rows = outbox_admin::list(pool, statuses, destination, limit)
            .await
            .map_err(database)?;
        let now = now_secs();
        let mut body =
            String::from("<h1>Outbox</h1><table class=\"outbox\"><thead><tr><th>destination</th>");
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
        let _ = write!(
            body,
            "</tbody></table><h2>{} rows</h2><p data-count=\"outbox\">{} (oldest first).</p>\
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
        for row in &rows {
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
                escape(&crate::admin::utc_time(&row.created_at)),
                escape(&super::cut(row.last_error.as_deref().unwrap_or(""), 200)),
            );
        }
        body.push_str("</tbody></table>");
        Ok(layout(&ctx, StatusCode::OK, "Outbox", &body))
    })
    .await
}

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
    let (parts, _) = request.into_parts();
    run(async {
        let ctx = inner.begin(&parts)?;
        Params::query(&parts, &[])?;
        let mut conn = inner.dispatcher.pool().acquire().await.map_err(database)?;
        let (now_hour, rows) = conn.arrivals(RATE_HOURS).await.map_err(database)?;
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
        if outbox_admin::installed(inner.dispatcher.pool())
            .await
            .map_err(database)?
        {
            let rows = conn.outbox_sent(RATE_HOURS).await.map_err(database)?;
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
        Ok(layout(&ctx, StatusCode::OK, "Rates", &body))
    })
    .await
}

#[cfg(test)]
mod tests {
    use super::{Aggregate, hex_dump, ranges};

    #[test]
    fn gaps_between_the_expected_and_the_parked_sequences() {
        let group = |last: i64, parked: &[i64]| Aggregate {
            consumer: "c".into(),
            aggregate_id: "a".into(),
            last_sequence: last,
            parked: parked
                .iter()
                .map(|&s| (s, String::new(), String::new()))
                .collect(),
        };
        assert_eq!(group(1, &[3, 4, 7]).gaps(), vec![(2, 2), (5, 6)]);
        assert_eq!(ranges(&group(1, &[3, 4, 7]).gaps()), "2, 5–6");
        assert_eq!(group(0, &[2]).expected(), 1);
        assert_eq!(ranges(&group(4, &[5, 6]).gaps()), "none");
    }

    #[test]
    fn dumps_bytes_in_hex_with_ascii() {
        assert_eq!(
            hex_dump(b"ab\x00\xff", 100),
            "00000000  61 62 00 ff                                       ab..\n"
        );
        assert_eq!(
            hex_dump(b"abc", 2),
            "00000000  61 62                                             ab\n… 1 more bytes not shown\n"
        );
        assert_eq!(hex_dump(b"", 2), "(no bytes)");
    }
}
