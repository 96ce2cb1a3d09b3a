//! The console's rejection pages: the list of recent rejected deliveries (below the counts of
//! `/rejections`) and `/rejection?id=`, one rejected delivery with its payload bytes.

use std::fmt::Write as _;

use axum::extract::{Request, State};
use axum::response::Response;
use http::StatusCode;

use super::{
    Conn, ErrorPage, Inner, Params, Shared, bad_request, bare, database, escape, get_page, layout,
};
use crate::store::{ConsoleDatabase, ConsoleStore as _, RejectionEntry, RejectionReason};

/// The bytes of a rejection's payload shown in the hex dump: 64 KiB.
const MAX_DUMP_BYTES: usize = 64 * 1024;

impl Params {
    /// `reason`: a rejection reason, or absent.
    fn reason(&self) -> Result<Option<RejectionReason>, ErrorPage> {
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
    conn: &mut Conn<DB>,
    ctx: &super::Ctx,
    params: &Params,
    body: &mut String,
) -> Result<(), ErrorPage> {
    let reason = params.reason()?;
    let (limit, consumer) = params.listing(inner, conn).await?;
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
            escape(&crate::ops::admin::utc_time(&row.received_at)),
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
    get_page(&inner, request, &["id"], async |ctx, params| {
        let text = params.required("id")?;
        let id = match text.parse::<i64>() {
            Ok(id) if id > 0 => id,
            _ => {
                return Err(bad_request(&format!(
                    "Id “{text}” is not a rejection's id: give a whole number from 1."
                )));
            }
        };
        let row = inner
            .conn()
            .await?
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
            escape(&crate::ops::admin::utc_time(&row.received_at)),
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

#[cfg(test)]
mod tests {
    use super::hex_dump;

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
