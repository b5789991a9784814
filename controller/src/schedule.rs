//! Grid events and the facility budget they leave, as pure functions of time.
//!
//! An event either reduces the budget by a fraction (`--reduce 30%`) or sets it to a target
//! (`--target 600kW`), from `start` for `duration`. With a ramp, the cut grows linearly over
//! the ramp after the start and shrinks the same way before the end, so caps move in steps
//! of one allocation period instead of all at once. Overlapping events: the deepest cut at
//! each instant wins. Times are Unix milliseconds; the controller passes its clock in.

use powerflex_core::Watts;

// The event types are the admin protocol's: `powerflexctl` sends them, the controller
// keeps them and `status` shows them.
pub use powerflex_proto::admin::{Cut, Event};

/// The budget at `now`: `base` less the deepest cut of any event in force.
pub fn effective_budget(base: Watts, events: &[Event], now: u64) -> Watts {
    let cut = events
        .iter()
        .map(|e| e.cut_w(base.0, now))
        .fold(0.0, f64::max);
    Watts((base.0 - cut).max(0.0))
}

/// The event in force with the deepest cut at `now`, if any.
pub fn active_event(base: Watts, events: &[Event], now: u64) -> Option<&Event> {
    events
        .iter()
        .filter(|e| e.cut_w(base.0, now) > 0.0)
        .max_by(|a, b| a.cut_w(base.0, now).total_cmp(&b.cut_w(base.0, now)))
}

/// Why a time, duration or cut did not parse.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ScheduleError {
    #[error("bad duration \"{0}\"; accepted: a number with s, m, h or d, e.g. 90s, 5m, 3h")]
    Duration(String),
    #[error("bad start \"{0}\"; accepted: now, +DURATION (e.g. +10m), or an RFC 3339 time (e.g. 2026-12-01T17:00:00Z)")]
    Start(String),
    #[error("bad reduction \"{0}\"; accepted: a percentage above 0 and at most 100, e.g. 30%")]
    Reduce(String),
}

/// Parses `90s`, `5m`, `3h`, `1d` (or a bare number of seconds) into milliseconds.
pub fn parse_duration_ms(text: &str) -> Result<u64, ScheduleError> {
    let t = text.trim();
    let bad = || ScheduleError::Duration(text.chars().take(40).collect());
    let split = t.find(|c: char| c.is_ascii_alphabetic()).unwrap_or(t.len());
    let (number, unit) = t.split_at(split);
    let value: f64 = number.trim().parse().map_err(|_| bad())?;
    let scale = match unit {
        "" | "s" => 1_000.0,
        "m" | "min" => 60_000.0,
        "h" => 3_600_000.0,
        "d" => 86_400_000.0,
        _ => return Err(bad()),
    };
    let ms = value * scale;
    if !ms.is_finite() || !(0.0..=365.0 * 86_400_000.0).contains(&ms) {
        return Err(bad());
    }
    Ok(ms.round() as u64)
}

/// Parses `30%` (or `30`) into a fraction in (0, 1].
pub fn parse_reduce(text: &str) -> Result<f64, ScheduleError> {
    let t = text.trim().trim_end_matches('%');
    match t.parse::<f64>() {
        Ok(p) if p.is_finite() && p > 0.0 && p <= 100.0 => Ok(p / 100.0),
        _ => Err(ScheduleError::Reduce(text.chars().take(40).collect())),
    }
}

/// Days since 1970-01-01 of a civil date (Howard Hinnant's algorithm).
fn days_from_civil(y: i64, m: i64, d: i64) -> i64 {
    let y = if m <= 2 { y - 1 } else { y };
    let era = y.div_euclid(400);
    let yoe = y - era * 400;
    let mp = (m + 9) % 12;
    let doy = (153 * mp + 2) / 5 + d - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    era * 146_097 + doe - 719_468
}

/// Parses `now`, `+10m` or an RFC 3339 time (`2026-12-01T17:00:00Z`, `…+01:00`,
/// fractional seconds allowed) into Unix milliseconds, relative to `now_ms`.
pub fn parse_start_ms(text: &str, now_ms: u64) -> Result<u64, ScheduleError> {
    let t = text.trim();
    let bad = || ScheduleError::Start(text.chars().take(40).collect());
    if t == "now" {
        return Ok(now_ms);
    }
    if let Some(rest) = t.strip_prefix('+') {
        return parse_duration_ms(rest)
            .map(|d| now_ms + d)
            .map_err(|_| bad());
    }
    let b = t.as_bytes();
    if b.len() < 20
        || b[4] != b'-'
        || b[7] != b'-'
        || !(b[10] == b'T' || b[10] == b't' || b[10] == b' ')
        || b[13] != b':'
        || b[16] != b':'
    {
        return Err(bad());
    }
    let num =
        |r: std::ops::Range<usize>| t.get(r).and_then(|s| s.parse::<i64>().ok()).ok_or_else(bad);
    let (year, month, day) = (num(0..4)?, num(5..7)?, num(8..10)?);
    let (hour, minute, second) = (num(11..13)?, num(14..16)?, num(17..19)?);
    if !(1..=12).contains(&month)
        || !(1..=31).contains(&day)
        || hour > 23
        || minute > 59
        || second > 60
    {
        return Err(bad());
    }
    let mut rest = &t[19..];
    let mut millis = 0i64;
    if let Some(frac) = rest.strip_prefix('.') {
        let digits: String = frac.chars().take_while(char::is_ascii_digit).collect();
        if digits.is_empty() {
            return Err(bad());
        }
        let ms: String = digits.chars().chain("000".chars()).take(3).collect();
        millis = ms.parse().map_err(|_| bad())?;
        rest = &frac[digits.len()..];
    }
    let offset_min = match rest {
        "Z" | "z" => 0,
        _ if rest.len() == 6
            && (rest.starts_with('+') || rest.starts_with('-'))
            && &rest[3..4] == ":" =>
        {
            let sign = if rest.starts_with('-') { -1 } else { 1 };
            let h: i64 = rest[1..3].parse().map_err(|_| bad())?;
            let m: i64 = rest[4..6].parse().map_err(|_| bad())?;
            sign * (h * 60 + m)
        }
        _ => return Err(bad()),
    };
    let secs = days_from_civil(year, month, day) * 86_400 + hour * 3600 + minute * 60 + second
        - offset_min * 60;
    let ms = secs * 1000 + millis;
    u64::try_from(ms).map_err(|_| bad())
}

#[cfg(test)]
mod tests {
    use super::*;

    const H: u64 = 3_600_000;

    fn event(id: u64, cut: Cut, start: u64, duration: u64, ramp: u64) -> Event {
        Event {
            id,
            cut,
            start_ms: start,
            duration_ms: duration,
            ramp_ms: ramp,
        }
    }

    #[test]
    fn a_ramped_event_steps_down_holds_and_steps_back() {
        let base = Watts(850_000.0);
        let e = event(1, Cut::Reduce { fraction: 0.3 }, 10 * H, 3 * H, H / 12);
        let at = |t: u64| effective_budget(base, std::slice::from_ref(&e), t).0;
        assert_eq!(at(10 * H - 1), 850_000.0, "before");
        assert_eq!(at(10 * H), 850_000.0, "the ramp starts at zero");
        assert!(
            (at(10 * H + H / 24) - 850_000.0 * 0.85).abs() < 1e-6,
            "halfway down the ramp"
        );
        assert!((at(11 * H) - 595_000.0).abs() < 1e-6, "held");
        assert!(
            (at(13 * H - H / 24) - 850_000.0 * 0.85).abs() < 1e-6,
            "halfway back"
        );
        assert_eq!(at(13 * H), 850_000.0, "over");
        assert!(e.pending(12 * H) && !e.pending(13 * H));
    }

    #[test]
    fn the_deepest_cut_wins() {
        let base = Watts(1_000_000.0);
        let events = [
            event(1, Cut::Reduce { fraction: 0.2 }, 0, 10 * H, 0),
            event(
                2,
                Cut::Target {
                    budget_w: 600_000.0,
                },
                2 * H,
                H,
                0,
            ),
            event(
                3,
                Cut::Target {
                    budget_w: 2_000_000.0,
                },
                0,
                10 * H,
                0,
            ),
        ];
        assert_eq!(effective_budget(base, &events, H).0, 800_000.0);
        assert_eq!(effective_budget(base, &events, 2 * H).0, 600_000.0);
        assert_eq!(active_event(base, &events, 2 * H).map(|e| e.id), Some(2));
        assert_eq!(effective_budget(base, &events, 11 * H).0, 1_000_000.0);
        assert!(active_event(base, &events, 11 * H).is_none());
    }

    #[test]
    fn parses_what_admins_type() {
        assert_eq!(parse_duration_ms("3h"), Ok(3 * H));
        assert_eq!(parse_duration_ms("5m"), Ok(300_000));
        assert_eq!(parse_duration_ms("90"), Ok(90_000));
        assert!(matches!(
            parse_duration_ms("3 weeks"),
            Err(ScheduleError::Duration(_))
        ));
        assert!(parse_duration_ms("-5m").is_err());
        assert_eq!(parse_reduce("30%"), Ok(0.3));
        assert!(
            parse_reduce("0%").is_err()
                && parse_reduce("150%").is_err()
                && parse_reduce("lots").is_err()
        );
        assert_eq!(parse_start_ms("now", 5), Ok(5));
        assert_eq!(parse_start_ms("+10m", 5), Ok(600_005));
        assert_eq!(parse_start_ms("1970-01-01T00:00:01Z", 0), Ok(1000));
        assert_eq!(
            parse_start_ms("2026-12-01T17:00:00Z", 0),
            Ok(1_796_144_400_000)
        );
        assert_eq!(
            parse_start_ms("2026-12-01T18:00:00+01:00", 0),
            Ok(1_796_144_400_000)
        );
        assert_eq!(
            parse_start_ms("2026-12-01T17:00:00.250Z", 0),
            Ok(1_796_144_400_250)
        );
        for bad in [
            "tomorrow",
            "2026-13-01T00:00:00Z",
            "2026-12-01T17:00:00",
            "+soon",
            "2026-12-01T17:00:00+0100",
        ] {
            assert!(
                matches!(parse_start_ms(bad, 0), Err(ScheduleError::Start(_))),
                "{bad}"
            );
        }
        assert_eq!(
            parse_start_ms("tomorrow", 0).expect_err("bad").to_string(),
            "bad start \"tomorrow\"; accepted: now, +DURATION (e.g. +10m), or an RFC 3339 time (e.g. 2026-12-01T17:00:00Z)"
        );
    }
}
