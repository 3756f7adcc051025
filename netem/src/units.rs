//! Parsing and printing of human-friendly quantities: rates (`100mbit`),
//! durations (`2.5ms`), percentages (`0.1%`) and sizes (`1.5MB`, `64KiB`).
//!
//! Every parser is a small pure function that either returns an exact value
//! or a [`NetemError::InvalidValue`] that says what would have been accepted.
//! Units are case-insensitive. Rates are in *bits* per second with SI
//! prefixes (as `tc` writes them); sizes are in *bytes*, SI (`KB`, `MB`,
//! `GB`) or binary (`KiB`, `MiB`, `GiB`).

use std::time::Duration;

use crate::error::NetemError;

fn invalid(what: &'static str, input: &str, reason: impl Into<String>) -> NetemError {
    NetemError::InvalidValue {
        what,
        input: input.to_owned(),
        reason: reason.into(),
    }
}

/// Splits `"2.5ms"` into `(2.5, "ms")`; the number must be finite and >= 0.
fn split_number<'a>(what: &'static str, input: &'a str) -> Result<(f64, &'a str), NetemError> {
    let s = input.trim();
    let end = s
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(s.len());
    let (num, unit) = s.split_at(end);
    if num.is_empty() {
        return Err(invalid(what, input, "expected a number first"));
    }
    let value: f64 = num
        .parse()
        .map_err(|_| invalid(what, input, format!("{num:?} is not a number")))?;
    if !value.is_finite() {
        return Err(invalid(what, input, "the number is not finite"));
    }
    Ok((value, unit.trim()))
}

fn to_integer(what: &'static str, input: &str, value: f64) -> Result<u64, NetemError> {
    let rounded = value.round();
    if rounded >= 18_446_744_073_709_551_615.0 {
        return Err(invalid(what, input, "too large"));
    }
    Ok(rounded as u64)
}

/// Parses a rate in bits per second: `100mbit`, `1gbit`, `250kbit`, `2.5mbit`,
/// `9600bit` (also `bps`/`kbps`/... are *rejected*, because `tc` reads
/// `mbps` as megabytes per second and the ambiguity has bitten people).
///
/// # Errors
/// [`NetemError::InvalidValue`] for an unknown unit, a missing unit or a zero rate.
pub fn parse_rate(input: &str) -> Result<u64, NetemError> {
    const WHAT: &str = "rate";
    let (value, unit) = split_number(WHAT, input)?;
    let multiplier = match unit.to_ascii_lowercase().as_str() {
        "bit" | "bit/s" => 1.0,
        "kbit" | "kbit/s" => 1e3,
        "mbit" | "mbit/s" => 1e6,
        "gbit" | "gbit/s" => 1e9,
        "tbit" | "tbit/s" => 1e12,
        "" => {
            return Err(invalid(
                WHAT,
                input,
                "missing unit; write e.g. 100mbit, 1gbit or 250kbit (bits per second)",
            ));
        }
        u if u.ends_with("bps") => {
            return Err(invalid(
                WHAT,
                input,
                "ambiguous unit (tc reads mbps as megabytes/s); write bits per second: kbit, mbit, gbit",
            ));
        }
        _ => {
            return Err(invalid(
                WHAT,
                input,
                "unknown unit; use bit, kbit, mbit, gbit (bits per second)",
            ));
        }
    };
    let bps = to_integer(WHAT, input, value * multiplier)?;
    if bps == 0 {
        return Err(invalid(WHAT, input, "a rate must be positive"));
    }
    Ok(bps)
}

/// Parses a duration: `25ms`, `2.5ms`, `100us` (or `µs`), `1s`, `500ns`, or
/// a bare `0`. Resolution is one nanosecond (rounded to nearest).
///
/// # Errors
/// [`NetemError::InvalidValue`] for an unknown or missing unit.
pub fn parse_duration(input: &str) -> Result<Duration, NetemError> {
    const WHAT: &str = "duration";
    let (value, unit) = split_number(WHAT, input)?;
    let ns_per_unit = match unit.to_ascii_lowercase().as_str() {
        "ns" => 1.0,
        "us" | "µs" | "μs" => 1e3,
        "ms" => 1e6,
        "s" | "sec" => 1e9,
        "" if value == 0.0 => 0.0,
        "" => {
            return Err(invalid(
                WHAT,
                input,
                "missing unit; write e.g. 25ms, 2.5ms, 100us or 1s",
            ));
        }
        _ => return Err(invalid(WHAT, input, "unknown unit; use ns, us, ms or s")),
    };
    Ok(Duration::from_nanos(to_integer(
        WHAT,
        input,
        value * ns_per_unit,
    )?))
}

/// Parses a percentage into a probability: `0.1%` → `0.001`, `100%` → `1.0`,
/// and a bare `0` → `0.0`. The `%` is required otherwise, so that `1` is
/// never silently read as 1 % or 100 %.
///
/// # Errors
/// [`NetemError::InvalidValue`] without `%` or above 100 %.
pub fn parse_percent(input: &str) -> Result<f64, NetemError> {
    const WHAT: &str = "percentage";
    let (value, unit) = split_number(WHAT, input)?;
    match unit {
        "%" => {}
        "" if value == 0.0 => return Ok(0.0),
        _ => {
            return Err(invalid(
                WHAT,
                input,
                "write a percentage such as 0.1% or 2%",
            ));
        }
    }
    if value > 100.0 {
        return Err(invalid(WHAT, input, "must be at most 100%"));
    }
    Ok(value / 100.0)
}

/// Parses a size in bytes: `1500`, `1500B`, `64KB`/`1.5MB`/`1GB` (powers of
/// 1000) or `64KiB`/`4MiB`/`1GiB` (powers of 1024). `k`, `m`, `g` alone are
/// read as the SI byte units.
///
/// # Errors
/// [`NetemError::InvalidValue`] for an unknown unit or a value that does not fit.
pub fn parse_size(input: &str) -> Result<usize, NetemError> {
    const WHAT: &str = "size";
    let (value, unit) = split_number(WHAT, input)?;
    let multiplier = match unit.to_ascii_lowercase().as_str() {
        "" | "b" => 1.0,
        "k" | "kb" => 1e3,
        "m" | "mb" => 1e6,
        "g" | "gb" => 1e9,
        "kib" => 1024.0,
        "mib" => 1024.0 * 1024.0,
        "gib" => 1024.0 * 1024.0 * 1024.0,
        _ => {
            return Err(invalid(
                WHAT,
                input,
                "unknown unit; use B, KB, MB, GB (x1000) or KiB, MiB, GiB (x1024)",
            ));
        }
    };
    let bytes = to_integer(WHAT, input, value * multiplier)?;
    usize::try_from(bytes).map_err(|_| invalid(WHAT, input, "too large for this machine"))
}

/// Formats a rate the way [`parse_rate`] reads it, e.g. `100mbit`, `2.5mbit`.
pub fn format_rate(bps: u64) -> String {
    let (value, unit) = if bps >= 1_000_000_000 {
        (bps as f64 / 1e9, "gbit")
    } else if bps >= 1_000_000 {
        (bps as f64 / 1e6, "mbit")
    } else if bps >= 1_000 {
        (bps as f64 / 1e3, "kbit")
    } else {
        (bps as f64, "bit")
    };
    format!("{}{unit}", trim_float(value))
}

/// Formats a duration compactly, e.g. `25ms`, `2.5ms`, `150us`, `0`.
pub fn format_duration(d: Duration) -> String {
    let ns = d.as_nanos();
    if ns == 0 {
        "0".to_owned()
    } else if ns >= 1_000_000_000 {
        format!("{}s", trim_float(ns as f64 / 1e9))
    } else if ns >= 1_000_000 {
        format!("{}ms", trim_float(ns as f64 / 1e6))
    } else if ns >= 1_000 {
        format!("{}us", trim_float(ns as f64 / 1e3))
    } else {
        format!("{ns}ns")
    }
}

/// Formats a byte count with SI units, e.g. `1.5MB`, `1500B`.
pub fn format_size(bytes: u64) -> String {
    if bytes >= 1_000_000_000 {
        format!("{}GB", trim_float(bytes as f64 / 1e9))
    } else if bytes >= 1_000_000 {
        format!("{}MB", trim_float(bytes as f64 / 1e6))
    } else if bytes >= 1_000 {
        format!("{}KB", trim_float(bytes as f64 / 1e3))
    } else {
        format!("{bytes}B")
    }
}

/// Up to three decimals, without trailing zeros.
fn trim_float(v: f64) -> String {
    let s = format!("{v:.3}");
    s.trim_end_matches('0').trim_end_matches('.').to_owned()
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    #[test]
    fn rates() {
        assert_eq!(parse_rate("100mbit").unwrap(), 100_000_000);
        assert_eq!(parse_rate("1gbit").unwrap(), 1_000_000_000);
        assert_eq!(parse_rate("250kbit").unwrap(), 250_000);
        assert_eq!(parse_rate("2.5mbit").unwrap(), 2_500_000);
        assert_eq!(parse_rate("9600bit").unwrap(), 9_600);
        assert_eq!(parse_rate(" 100Mbit ").unwrap(), 100_000_000);
        assert_eq!(parse_rate("1Gbit/s").unwrap(), 1_000_000_000);
        for bad in [
            "", "mbit", "100", "100mbps", "100MBps", "100mb", "0mbit", "-1mbit", "1e3mbit", "x",
        ] {
            assert!(parse_rate(bad).is_err(), "{bad:?} should be rejected");
        }
        let err = parse_rate("100mbps").unwrap_err().to_string();
        assert!(err.contains("ambiguous"), "{err}");
    }

    #[test]
    fn durations() {
        assert_eq!(parse_duration("25ms").unwrap(), Duration::from_millis(25));
        assert_eq!(
            parse_duration("2.5ms").unwrap(),
            Duration::from_micros(2500)
        );
        assert_eq!(parse_duration("100us").unwrap(), Duration::from_micros(100));
        assert_eq!(parse_duration("100µs").unwrap(), Duration::from_micros(100));
        assert_eq!(parse_duration("1s").unwrap(), Duration::from_secs(1));
        assert_eq!(parse_duration("0.5s").unwrap(), Duration::from_millis(500));
        assert_eq!(parse_duration("750ns").unwrap(), Duration::from_nanos(750));
        assert_eq!(parse_duration("0").unwrap(), Duration::ZERO);
        assert_eq!(parse_duration("0ms").unwrap(), Duration::ZERO);
        for bad in ["", "25", "25 minutes", "ms", "1.2.3ms", "-5ms"] {
            assert!(parse_duration(bad).is_err(), "{bad:?} should be rejected");
        }
    }

    #[test]
    fn percentages() {
        assert_eq!(parse_percent("0.1%").unwrap(), 0.001);
        assert_eq!(parse_percent("2%").unwrap(), 0.02);
        assert_eq!(parse_percent("100%").unwrap(), 1.0);
        assert_eq!(parse_percent("0").unwrap(), 0.0);
        assert_eq!(parse_percent("0%").unwrap(), 0.0);
        for bad in ["", "1", "0.5", "101%", "%", "5 percent"] {
            assert!(parse_percent(bad).is_err(), "{bad:?} should be rejected");
        }
    }

    #[test]
    fn sizes() {
        assert_eq!(parse_size("1.5MB").unwrap(), 1_500_000);
        assert_eq!(parse_size("64KiB").unwrap(), 65_536);
        assert_eq!(parse_size("64kib").unwrap(), 65_536);
        assert_eq!(parse_size("1500").unwrap(), 1_500);
        assert_eq!(parse_size("1500B").unwrap(), 1_500);
        assert_eq!(parse_size("4MiB").unwrap(), 4 * 1024 * 1024);
        assert_eq!(parse_size("1GB").unwrap(), 1_000_000_000);
        assert_eq!(parse_size("2k").unwrap(), 2_000);
        assert_eq!(parse_size("0").unwrap(), 0);
        for bad in ["", "MB", "1.5 parsecs", "1.5Mbit", "-1KB"] {
            assert!(parse_size(bad).is_err(), "{bad:?} should be rejected");
        }
    }

    #[test]
    fn formatting_round_trips() {
        for bps in [250_000, 2_500_000, 100_000_000, 1_000_000_000, 9_600] {
            assert_eq!(parse_rate(&format_rate(bps)).unwrap(), bps);
        }
        for d in [
            Duration::ZERO,
            Duration::from_nanos(750),
            Duration::from_micros(150),
            Duration::from_micros(2500),
            Duration::from_millis(25),
            Duration::from_secs(2),
        ] {
            assert_eq!(parse_duration(&format_duration(d)).unwrap(), d);
        }
        for b in [0u64, 1500, 64_000, 1_500_000, 2_000_000_000] {
            assert_eq!(parse_size(&format_size(b)).unwrap() as u64, b);
        }
        assert_eq!(format_rate(100_000_000), "100mbit");
        assert_eq!(format_duration(Duration::from_micros(2500)), "2.5ms");
        assert_eq!(format_size(1_500_000), "1.5MB");
    }
}
