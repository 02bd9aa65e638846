//! What every subcommand does with its arguments: value parsers for durations and sizes
//! with explicit limits, and the one-line usage error. Any argument ends in a parsed
//! value or in exit status 2 with one line on stderr, never in a panic or an overflow.

use lockstep_core::exit;
use std::time::Duration;

/// Prints `lockstep SUBCOMMAND: MSG` as one line and returns the usage status.
pub fn usage(subcommand: &str, msg: &str) -> i32 {
    eprintln!("lockstep {subcommand}: {msg} (see 'lockstep {subcommand} --help')");
    exit::USAGE
}

/// clap's own error (unknown option, bad number, missing value) as one line: its message
/// and tips, without the usage block that clap repeats from `--help`.
pub fn one_line(e: &clap::Error) -> String {
    let text = e.render().to_string();
    let parts: Vec<&str> = text
        .lines()
        .map(str::trim)
        .take_while(|l| !l.starts_with("Usage:") && !l.starts_with("For more information"))
        .filter(|l| !l.is_empty())
        .map(|l| l.strip_prefix("error: ").unwrap_or(l))
        .collect();
    format!("lockstep: {} (see --help)", parts.join(" "))
}

/// How long to wait for a straggler or a hung run (`run --timeout`, `inject --timeout`):
/// from 1 ms to 1 day.
pub fn timeout() -> impl Fn(&str) -> Result<Duration, String> + Clone {
    duration_in(Duration::from_millis(1), Duration::from_secs(86_400))
}

/// A count within `[min, max]`, for `usize` options (clap's `range` is for u64 and i64).
pub fn usize_in(min: u64, max: u64) -> clap::builder::RangedU64ValueParser<usize> {
    clap::builder::RangedU64ValueParser::new().range(min..=max)
}

/// A duration: seconds as a number (`2.5`) or with units (`500ms`, `2s`, `1m 30s`),
/// accepted only within `[min, max]`.
pub fn duration_in(min: Duration, max: Duration) -> impl Fn(&str) -> Result<Duration, String> + Clone {
    move |s: &str| {
        let s = s.trim();
        let d = match s.parse::<f64>() {
            Ok(secs) => Duration::try_from_secs_f64(secs)
                .map_err(|_| format!("{s:?} is not a number of seconds from 0 to {}", max.as_secs_f64()))?,
            Err(_) => humantime::parse_duration(s).map_err(|e| format!("{s:?}: {e} (examples: 2.5, 500ms, 2s, 1m)"))?,
        };
        if d < min || d > max {
            return Err(format!(
                "{s:?} is outside {} to {}",
                humantime::format_duration(min),
                humantime::format_duration(max)
            ));
        }
        Ok(d)
    }
}

/// A size in bytes: a number with an optional binary unit K, M, G or T (`512K`, `64M`,
/// `1G`; also `KiB`, `MiB`, ...), accepted only within `[min, max]`.
pub fn size_in(min: u64, max: u64) -> impl Fn(&str) -> Result<u64, String> + Clone {
    move |s: &str| {
        let t = s.trim();
        let digits = t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len());
        let (num, unit) = t.split_at(digits);
        let shift = match unit.trim().to_ascii_lowercase().as_str() {
            "" | "b" => 0,
            "k" | "kib" => 10,
            "m" | "mib" => 20,
            "g" | "gib" => 30,
            "t" | "tib" => 40,
            _ => return Err(format!("{s:?}: unknown unit (examples: 512K, 64M, 1G)")),
        };
        let n: u64 = num
            .parse()
            .map_err(|_| format!("{s:?} is not a size (examples: 512K, 64M, 1G)"))?;
        let bytes = n
            .checked_mul(1 << shift)
            .filter(|b| (min..=max).contains(b))
            .ok_or_else(|| format!("{s:?} is outside {min} to {max} bytes"))?;
        Ok(bytes)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations_and_sizes_have_limits_and_never_panic() {
        let d = duration_in(Duration::from_millis(1), Duration::from_secs(3600));
        assert_eq!(d("2.5"), Ok(Duration::from_millis(2500)));
        assert_eq!(d("500ms"), Ok(Duration::from_millis(500)));
        assert_eq!(d("1m 30s"), Ok(Duration::from_secs(90)));
        for bad in [
            "0",
            "-1",
            "1e300",
            "nan",
            "inf",
            "18446744073709551616",
            "99999999999999999999999s",
            "",
            "x",
            "2h",
        ] {
            assert!(d(bad).is_err(), "{bad:?} accepted");
        }
        let z = size_in(64 << 10, 1 << 40);
        assert_eq!(z("64M"), Ok(64 << 20));
        assert_eq!(z("1GiB"), Ok(1 << 30));
        assert_eq!(z("65536"), Ok(65536));
        for bad in [
            "0",
            "-1",
            "1K",
            "99999999999G",
            "18446744073709551616",
            "1e9",
            "1.5G",
            "",
            "12Q",
        ] {
            assert!(z(bad).is_err(), "{bad:?} accepted");
        }
    }
}
