//! The console's `/parked` page: parked messages per aggregate, with the sequence each
//! aggregate waits for and the gaps.

use std::fmt::Write as _;

use axum::extract::{Request, State};
use axum::response::Response;
use http::StatusCode;

use super::{Shared, age, database, encode, escape, get_page, layout, now_secs};
use crate::store::{ConsoleDatabase, ConsoleStore as _, ParkedEntry};

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
    get_page(
        &inner,
        request,
        &["consumer", "limit"],
        async |ctx, params| {
            let limit = params.limit()?;
            let mut conn = inner.conn().await?;
            let consumer = params.consumer(&inner, &mut conn, false).await?;
            let rows = conn
                .list_parked(consumer.as_deref(), i64::from(limit))
                .await
                .map_err(database)?;
            drop(conn);
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
                body.push_str(
                    "<tr><td colspan=\"7\" class=\"muted\">No parked messages.</td></tr>",
                );
            }
            body.push_str("</tbody></table>");
            Ok(layout(&ctx, StatusCode::OK, "Parked", &body))
        },
    )
    .await
}

#[cfg(test)]
mod tests {
    use super::{Aggregate, ranges};

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
}
