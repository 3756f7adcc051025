//! Two pieces of Python a chat template can call, re-done exactly: `json.dumps` (for the
//! `tojson` filter) and `time.strftime` (for `strftime_now`). Pure functions.

use serde_json::Value;

/// `json.dumps`'s layout settings.
#[derive(Debug, Clone)]
pub(crate) struct Style {
    pub(crate) indent: Option<usize>,
    /// Between items (`", "` by default, `","` with an indent).
    pub(crate) item: String,
    /// Between a key and its value.
    pub(crate) key: String,
    pub(crate) sort_keys: bool,
}

fn newline(style: &Style, depth: usize, out: &mut String) {
    if let Some(n) = style.indent {
        out.push('\n');
        out.push_str(&" ".repeat(n * depth));
    }
}

/// Appends `v` as `json.dumps(v, ensure_ascii=False, …)` writes it.
pub(crate) fn dump(v: &Value, style: &Style, depth: usize, out: &mut String) {
    match v {
        Value::Array(items) if !items.is_empty() => {
            out.push('[');
            for (i, x) in items.iter().enumerate() {
                if i > 0 {
                    out.push_str(&style.item);
                }
                newline(style, depth + 1, out);
                dump(x, style, depth + 1, out);
            }
            newline(style, depth, out);
            out.push(']');
        }
        Value::Object(map) if !map.is_empty() => {
            let mut entries: Vec<(&String, &Value)> = map.iter().collect();
            if style.sort_keys {
                entries.sort_by(|a, b| a.0.cmp(b.0));
            }
            out.push('{');
            for (i, (k, x)) in entries.into_iter().enumerate() {
                if i > 0 {
                    out.push_str(&style.item);
                }
                newline(style, depth + 1, out);
                out.push_str(&Value::String(k.clone()).to_string());
                out.push_str(&style.key);
                dump(x, style, depth + 1, out);
            }
            newline(style, depth, out);
            out.push('}');
        }
        Value::Number(n) if n.is_f64() => {
            // Python prints floats with repr(): 1.0, 1e-05, inf is not JSON anyway.
            let f = n.as_f64().unwrap_or(0.0);
            out.push_str(&python_float(f));
        }
        other => out.push_str(&other.to_string()),
    }
}

/// Python's `repr(float)`: shortest round-trip digits, `.0` on integral values, exponent
/// form outside 1e-4 ≤ |x| < 1e16.
fn python_float(f: f64) -> String {
    if f == 0.0 {
        return if f.is_sign_negative() { "-0.0" } else { "0.0" }.to_owned();
    }
    let a = f.abs();
    if (1e-4..1e16).contains(&a) {
        let s = format!("{f}");
        if s.contains('.') { s } else { format!("{s}.0") }
    } else {
        // `{:e}` gives 1e-5 / 1.5e20; Python writes 1e-05 / 1.5e+20.
        let s = format!("{f:e}");
        match s.split_once('e') {
            Some((m, e)) => {
                let (sign, digits) = match e.strip_prefix('-') {
                    Some(d) => ('-', d),
                    None => ('+', e),
                };
                format!("{m}e{sign}{digits:0>2}")
            }
            None => s,
        }
    }
}

const MONTHS: [&str; 12] = [
    "January",
    "February",
    "March",
    "April",
    "May",
    "June",
    "July",
    "August",
    "September",
    "October",
    "November",
    "December",
];
const DAYS: [&str; 7] = [
    "Thursday",
    "Friday",
    "Saturday",
    "Sunday",
    "Monday",
    "Tuesday",
    "Wednesday",
];

/// The civil (proleptic Gregorian) date of a day count since 1970-01-01.
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

/// `time.strftime(format)` at `secs` since the epoch, UTC.
pub(crate) fn strftime(format: &str, secs: u64) -> Result<String, String> {
    let days = (secs / 86_400) as i64;
    let rem = secs % 86_400;
    let (y, m, d) = civil(days);
    let (hh, mm, ss) = (rem / 3600, rem / 60 % 60, rem % 60);
    let month = MONTHS[(m - 1) as usize];
    let weekday = DAYS[days.rem_euclid(7) as usize];
    let yday = days - {
        let mut jan1 = days;
        while civil(jan1 - 1).0 == y {
            jan1 -= 1;
        }
        jan1
    } + 1;
    let mut out = String::new();
    let mut chars = format.chars();
    while let Some(c) = chars.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        match chars.next() {
            Some('Y') => out.push_str(&y.to_string()),
            Some('y') => out.push_str(&format!("{:02}", y.rem_euclid(100))),
            Some('m') => out.push_str(&format!("{m:02}")),
            Some('d') => out.push_str(&format!("{d:02}")),
            Some('e') => out.push_str(&format!("{d:>2}")),
            Some('H') => out.push_str(&format!("{hh:02}")),
            Some('M') => out.push_str(&format!("{mm:02}")),
            Some('S') => out.push_str(&format!("{ss:02}")),
            Some('p') => out.push_str(if hh < 12 { "AM" } else { "PM" }),
            Some('j') => out.push_str(&format!("{yday:03}")),
            Some('B') => out.push_str(month),
            Some('b') => out.push_str(&month[..3]),
            Some('A') => out.push_str(weekday),
            Some('a') => out.push_str(&weekday[..3]),
            Some('%') => out.push('%'),
            Some(other) => return Err(format!("directive %{other} is not supported")),
            None => return Err("a format ending in %".to_owned()),
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn dumps(v: &Value, indent: Option<usize>) -> String {
        let style = Style {
            indent,
            item: if indent.is_some() { "," } else { ", " }.to_owned(),
            key: ": ".to_owned(),
            sort_keys: false,
        };
        let mut s = String::new();
        dump(v, &style, 0, &mut s);
        s
    }

    #[test]
    fn dumps_like_python() {
        // Keys come in serde_json's (sorted) order: json.dumps(v, ensure_ascii=False) of a
        // dict built in that order.
        let v = serde_json::json!({"a": {}, "b": [1, 2.5, "é\"<"], "c": null, "d": 1e-5});
        assert_eq!(
            dumps(&v, None),
            r#"{"a": {}, "b": [1, 2.5, "é\"<"], "c": null, "d": 1e-05}"#
        );
        assert_eq!(
            dumps(&serde_json::json!({"x": [1]}), Some(2)),
            "{\n  \"x\": [\n    1\n  ]\n}"
        );
        assert_eq!(python_float(3.0), "3.0");
        assert_eq!(python_float(1.5e20), "1.5e+20");
    }

    #[test]
    fn strftime_matches_c() {
        // 2024-02-29 13:05:09 UTC, a Thursday.
        let t = 1_709_211_909;
        assert_eq!(
            strftime("%d %b %Y %H:%M:%S %A %j %%", t).expect("format"),
            "29 Feb 2024 13:05:09 Thursday 060 %"
        );
        assert!(strftime("%Q", t).is_err());
    }
}
