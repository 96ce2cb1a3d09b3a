//! Inline SVG charts for the console's pages: drawn on the server, no script, no external file
//! (the console's `Content-Security-Policy` allows neither).

use std::fmt::Write as _;

use super::escape;

/// Width of one bar's slot, in SVG user units.
const SLOT: usize = 6;
/// Height of the chart, in SVG user units.
const HEIGHT: i64 = 24;

/// A bar chart of `counts` (one bar per hour, oldest first; `first_hour` is the first bar's
/// hour since the epoch), scaled to its largest count, with a `<title>` per bar (the hour in
/// UTC and its count) and an accessible label.
pub(super) fn bars(counts: &[i64], first_hour: i64, label: &str) -> String {
    let max = counts.iter().copied().max().unwrap_or(0).max(1);
    let width = counts.len() * SLOT;
    let mut svg = format!(
        "<svg class=\"bars\" role=\"img\" aria-label=\"{} per hour\" width=\"{width}\" \
         height=\"{HEIGHT}\" viewBox=\"0 0 {width} {HEIGHT}\" xmlns=\"http://www.w3.org/2000/svg\">",
        escape(label)
    );
    for (i, &count) in counts.iter().enumerate() {
        // A non-zero count gets at least one unit, so that it shows.
        let height = if count == 0 {
            0
        } else {
            (count * HEIGHT / max).max(1)
        };
        let hour = first_hour + i as i64;
        let _ = write!(
            svg,
            "<rect x=\"{}\" y=\"{}\" width=\"{}\" height=\"{height}\" data-hour=\"{hour}\" \
             data-count=\"{count}\"><title>{}:00 UTC: {count}</title></rect>",
            i * SLOT,
            HEIGHT - height,
            SLOT - 1,
            hour_text(hour),
        );
    }
    svg.push_str("</svg>");
    svg
}

/// `2026-05-21 10` for an hour since the epoch.
fn hour_text(hour: i64) -> String {
    let secs = hour.saturating_mul(3600);
    let days = secs.div_euclid(86_400);
    let (y, m, d) = civil(days);
    format!("{y:04}-{m:02}-{d:02} {:02}", secs.rem_euclid(86_400) / 3600)
}

/// The proleptic Gregorian date of a day since 1970-01-01 (Howard Hinnant's `civil_from_days`).
fn civil(days: i64) -> (i64, u32, u32) {
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let m = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    let y = yoe + era * 400 + i64::from(m <= 2);
    (y, m, d)
}

#[cfg(test)]
mod tests {
    use super::{bars, hour_text};

    #[test]
    fn hours_in_utc() {
        assert_eq!(hour_text(0), "1970-01-01 00");
        // 2026-05-21 10:00 UTC is 1779357600 s.
        assert_eq!(hour_text(1_779_357_600 / 3600), "2026-05-21 10");
    }

    #[test]
    fn bars_scale_to_the_largest_count() {
        let svg = bars(&[0, 1, 4], 0, "processed");
        assert!(svg.contains("data-count=\"4\""), "{svg}");
        assert!(
            svg.contains("y=\"0\" width=\"5\" height=\"24\" data-hour=\"2\""),
            "{svg}"
        );
        assert!(
            svg.contains("y=\"18\" width=\"5\" height=\"6\" data-hour=\"1\""),
            "{svg}"
        );
        assert!(svg.contains("height=\"0\" data-hour=\"0\""), "{svg}");
        assert!(
            svg.contains("<title>1970-01-01 01:00 UTC: 1</title>"),
            "{svg}"
        );
    }
}
