//! Grid events and the facility budget they leave, as pure functions of time.
//!
//! An event either reduces the budget by a fraction (`--reduce 30%`) or sets it to a target
//! (`--target 600kW`), from `start` for `duration`. With a ramp, the cut grows in steps of
//! [`RAMP_STEP_MS`] over the ramp after the start and shrinks the same way before the end
//! (the stepped budget, [`SteppedRamp::depth`]). Overlapping events: the deepest cut at each
//! instant wins. Times are Unix milliseconds; the controller passes its clock in.

use powerflex_core::Watts;

// The event types are the admin protocol's: `powerflexctl` sends them, the controller
// keeps them and `status` shows them. What they do to the budget is decided here.
use powerflex_proto::event::{Cut, Event};

/// How long each step of an event's ramp holds, ms: the budget in force moves in steps
/// of this length during a ramp (see [`SteppedRamp::depth`]).
pub const RAMP_STEP_MS: u64 = 1000;

/// What an event's ramp does to the budget at each instant: the controller's rule, which
/// the grid, the site and a meter can all check against.
pub trait SteppedRamp {
    /// How much of the cut applies at `now_ms`, 0 to 1.
    fn depth(&self, now_ms: u64) -> f64;
    /// The times in `(from_ms, to_ms]` at which the depth may change.
    fn changes_in(&self, from_ms: u64, to_ms: u64) -> Vec<u64>;
    /// Watts the event removes from `base_w` at `now_ms`.
    fn cut_w(&self, base_w: f64, now_ms: u64) -> f64;
}

impl SteppedRamp for Event {
    /// How much of the cut applies at `now_ms` (0 to 1): the stepped ramp. The cut grows
    /// in steps of [`RAMP_STEP_MS`] after the start (the first step one step after it)
    /// and shrinks the same way before the end (the last step ends at the end), so the
    /// budget in force is a staircase the grid, the controller and a meter can all check
    /// against, never above the linear ramp during the ramp-down.
    fn depth(&self, now_ms: u64) -> f64 {
        if now_ms < self.start_ms || now_ms >= self.end_ms() {
            return 0.0;
        }
        if self.ramp_ms == 0 {
            return 1.0;
        }
        let ramp = self.ramp_ms as f64;
        let steps_in = (now_ms - self.start_ms) / RAMP_STEP_MS;
        let steps_out = (self.end_ms() - now_ms).div_ceil(RAMP_STEP_MS);
        let depth_in = (steps_in.saturating_mul(RAMP_STEP_MS)) as f64 / ramp;
        let depth_out = (steps_out.saturating_mul(RAMP_STEP_MS)) as f64 / ramp;
        depth_in.min(depth_out).min(1.0)
    }

    /// The times in `(from_ms, to_ms]` at which this event's depth may change: the
    /// start, each step of the ramps and the end. Between two of them the budget it leaves
    /// is constant, so the lowest budget over a window is found at these and `from_ms`.
    fn changes_in(&self, from_ms: u64, to_ms: u64) -> Vec<u64> {
        let mut out = Vec::new();
        let steps = self.ramp_ms.div_ceil(RAMP_STEP_MS);
        let mut push = |t: u64| {
            if t > from_ms && t <= to_ms {
                out.push(t);
            }
        };
        push(self.start_ms);
        push(self.end_ms());
        if steps == 0 {
            return out;
        }
        // Only the steps inside the window: a ramp may be hours of 1 s steps.
        let lo = from_ms.saturating_sub(self.start_ms) / RAMP_STEP_MS;
        let hi = (to_ms.saturating_sub(self.start_ms) / RAMP_STEP_MS).min(steps);
        for k in lo..=hi {
            push(self.start_ms.saturating_add(k * RAMP_STEP_MS));
        }
        let lo = self.end_ms().saturating_sub(to_ms) / RAMP_STEP_MS;
        let hi = (self.end_ms().saturating_sub(from_ms) / RAMP_STEP_MS + 1).min(steps);
        for k in lo..=hi {
            push(self.end_ms().saturating_sub(k * RAMP_STEP_MS));
        }
        out
    }

    /// Watts this event removes from `base_w` at `now_ms`.
    fn cut_w(&self, base_w: f64, now_ms: u64) -> f64 {
        let full = match self.cut {
            Cut::Reduce { fraction } => base_w * fraction.clamp(0.0, 1.0),
            Cut::Target { budget_w } => (base_w - budget_w).max(0.0),
        };
        full * self.depth(now_ms)
    }
}

/// The events that cut `domain`'s budget (the site's: `None`), in order.
pub fn of_domain(events: &[Event], domain: Option<&str>) -> Vec<Event> {
    events
        .iter()
        .filter(|e| e.domain.as_deref() == domain)
        .cloned()
        .collect()
}

/// The budget at `now`: `base` less the deepest cut of any event in force.
pub fn effective_budget(base: Watts, events: &[Event], now: u64) -> Watts {
    let cut = events
        .iter()
        .map(|e| e.cut_w(base.0, now))
        .fold(0.0, f64::max);
    Watts((base.0 - cut).max(0.0))
}

/// The lowest budget in force at any instant of `[from_ms, to_ms]`: what caps set at
/// `from_ms` must already meet so that no step of a ramp in that window finds the site
/// above it. Exact: the stepped budget only changes at the events' steps.
pub fn lowest_budget(base: Watts, events: &[Event], from_ms: u64, to_ms: u64) -> Watts {
    events
        .iter()
        .flat_map(|e| e.changes_in(from_ms, to_ms))
        .chain(std::iter::once(from_ms))
        .map(|t| effective_budget(base, events, t))
        .fold(effective_budget(base, events, from_ms), |a, b| {
            if b.0 < a.0 {
                b
            } else {
                a
            }
        })
}

/// The event in force with the deepest cut at `now`, if any.
pub fn active_event(base: Watts, events: &[Event], now: u64) -> Option<&Event> {
    events
        .iter()
        .filter(|e| e.cut_w(base.0, now) > 0.0)
        .max_by(|a, b| a.cut_w(base.0, now).total_cmp(&b.cut_w(base.0, now)))
}

/// The longest event, ramp or start offset accepted: a year, well beyond any grid event.
pub const MAX_DURATION_MS: u64 = 365 * 86_400_000;

/// What `--duration`, `--ramp` and `--start +DURATION` accept, for error messages.
const DURATION_FORMS: &str =
    "a length with units, e.g. 90s, 5m, 3h, 1h30m, 1d or PT3H (at most 365 days)";

/// Why a time, duration or cut did not parse.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ScheduleError {
    #[error("bad duration \"{text}\": {reason}; accepted: {DURATION_FORMS}")]
    Duration { text: String, reason: String },
    #[error("an event's duration must be longer than 0 (got \"{0}\"); accepted: {DURATION_FORMS}")]
    ZeroDuration(String),
    #[error("bad start \"{text}\": {reason}; accepted: now, +DURATION (e.g. +10m), or an RFC 3339 time with an offset (e.g. 2026-12-01T17:00:00Z, 2026-12-01T18:00:00+01:00)")]
    Start { text: String, reason: String },
    #[error("bad reduction \"{0}\"; accepted: a share above 0 and at most all of it, as a percentage (e.g. 30%) or a fraction (e.g. 0.3)")]
    Reduce(String),
    #[error("bad reduction: {0}")]
    Share(powerflex_core::units::ShareParseError),
}

/// Shows user text safely in a message: control characters escaped, long text cut.
fn printable(text: &str) -> String {
    let mut out: String = text
        .chars()
        .take(40)
        .flat_map(char::escape_default)
        .collect();
    if text.chars().count() > 40 {
        out.push('…');
    }
    out
}

/// Parses a length of time (`90s`, `5m`, `3h`, `1h30m`, `1d`, ISO 8601 `PT3H`) into
/// milliseconds, 0 allowed (a ramp may be 0). Days are 24 h: grid events are scheduled in
/// UTC, where there are no daylight-saving days.
pub fn parse_duration_ms(text: &str) -> Result<u64, ScheduleError> {
    let bad = |reason: String| ScheduleError::Duration {
        text: printable(text),
        reason,
    };
    let span: jiff::Span = text
        .trim()
        .parse()
        .map_err(|e: jiff::Error| bad(e.to_string()))?;
    let duration = span
        .to_duration(jiff::SpanRelativeTo::days_are_24_hours())
        .map_err(|_| bad("months and years have no fixed length".into()))?;
    if duration.is_negative() {
        return Err(bad("it is negative".into()));
    }
    let ms = u64::try_from(duration.as_millis()).unwrap_or(u64::MAX);
    if ms > MAX_DURATION_MS {
        return Err(bad("it is longer than 365 days".into()));
    }
    Ok(ms)
}

/// Parses an event's `--duration`: as [`parse_duration_ms`], but an event of length 0
/// would be scheduled and do nothing, so it is refused.
pub fn parse_event_duration_ms(text: &str) -> Result<u64, ScheduleError> {
    match parse_duration_ms(text)? {
        0 => Err(ScheduleError::ZeroDuration(printable(text))),
        ms => Ok(ms),
    }
}

/// Parses `30%` or `0.3` (the same share, as every command reads one: see
/// [`powerflex_core::units::parse_share`]) into a fraction in (0, 1]. A bare `30` is
/// refused: it reads as 30 % to some and as 0.3 % to others.
pub fn parse_reduce(text: &str) -> Result<f64, ScheduleError> {
    match powerflex_core::units::parse_share(text) {
        Ok(f) if f > 0.0 && f <= 1.0 => Ok(f),
        Ok(_) => Err(ScheduleError::Reduce(printable(text))),
        Err(e) => Err(ScheduleError::Share(e)),
    }
}

/// When an event starts, as written on the command line. `now` and `+DURATION` are
/// relative, so parsing (in clap, before anything runs) is separate from resolving
/// against the clock.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Start {
    Now,
    /// This many milliseconds after now.
    After {
        ms: u64,
    },
    /// At this Unix time, milliseconds.
    At {
        unix_ms: u64,
    },
}

impl Start {
    /// The Unix time in milliseconds this start means when the clock reads `now_ms`.
    pub fn resolve(self, now_ms: u64) -> u64 {
        match self {
            Start::Now => now_ms,
            Start::After { ms } => now_ms.saturating_add(ms),
            Start::At { unix_ms } => unix_ms,
        }
    }
}

/// Parses `now`, `+10m` or an RFC 3339 time with an offset (`2026-12-01T17:00:00Z`,
/// `2026-12-01T18:00:00+01:00`, fractional seconds allowed). jiff validates the calendar
/// (no 31st of February) and the offset (at most ±25:59).
pub fn parse_start(text: &str) -> Result<Start, ScheduleError> {
    let t = text.trim();
    let bad = |reason: String| ScheduleError::Start {
        text: printable(text),
        reason,
    };
    if t == "now" {
        return Ok(Start::Now);
    }
    if let Some(rest) = t.strip_prefix('+') {
        return match parse_duration_ms(rest) {
            Ok(ms) => Ok(Start::After { ms }),
            Err(ScheduleError::Duration { reason, .. }) => Err(bad(reason)),
            Err(other) => Err(bad(other.to_string())),
        };
    }
    let at: jiff::Timestamp = t.parse().map_err(|e: jiff::Error| bad(e.to_string()))?;
    let unix_ms =
        u64::try_from(at.as_millisecond()).map_err(|_| bad("it is before 1970".into()))?;
    Ok(Start::At { unix_ms })
}

/// [`parse_start`] resolved against `now_ms`.
pub fn parse_start_ms(text: &str, now_ms: u64) -> Result<u64, ScheduleError> {
    parse_start(text).map(|s| s.resolve(now_ms))
}

/// `YYYY-MM-DD hh:mm:ss UTC` for a Unix time in milliseconds (what `event list` and the
/// plot print); times beyond jiff's range (year 9999) print as the raw number.
pub fn utc_text(unix_ms: u64) -> String {
    i64::try_from(unix_ms)
        .ok()
        .and_then(|ms| jiff::Timestamp::from_millisecond(ms).ok())
        .map_or_else(
            || format!("{unix_ms} ms after 1970"),
            |t| t.strftime("%Y-%m-%d %H:%M:%S UTC").to_string(),
        )
}

/// A length of time for people: `3h 5m`, `90s` is `1m 30s`.
pub fn duration_text(ms: u64) -> String {
    let d = jiff::SignedDuration::from_millis(i64::try_from(ms).unwrap_or(i64::MAX));
    format!("{d:#}")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_event_ramps_in_and_out() {
        let e = Event {
            id: 1,
            cut: Cut::Reduce { fraction: 0.5 },
            start_ms: 1000,
            duration_ms: 10_000,
            ramp_ms: 2000,
            domain: None,
        };
        assert_eq!(e.cut_w(1000.0, 999), 0.0);
        assert_eq!(e.cut_w(1000.0, 2000), 250.0);
        assert_eq!(e.cut_w(1000.0, 5000), 500.0);
        assert_eq!(e.cut_w(1000.0, 10_000), 250.0);
        assert!(e.pending(10_999) && !e.pending(11_000));
        // Stepped: the first step one step after the start, held for a whole step, the
        // last one ending at the end.
        assert_eq!(e.cut_w(1000.0, 1000), 0.0);
        assert_eq!(e.cut_w(1000.0, 1999), 0.0);
        assert_eq!(e.cut_w(1000.0, 2999), 250.0);
        assert_eq!(e.cut_w(1000.0, 3000), 500.0);
        assert_eq!(e.cut_w(1000.0, 8999), 500.0);
        assert_eq!(e.cut_w(1000.0, 9000), 500.0);
        assert_eq!(
            e.cut_w(1000.0, 9999),
            500.0,
            "the cut lifts one step late, not early"
        );
        assert_eq!(e.cut_w(1000.0, 10_999), 250.0);
        assert_eq!(e.cut_w(1000.0, 11_000), 0.0);
        let mut changes = e.changes_in(0, 20_000);
        changes.sort_unstable();
        changes.dedup();
        assert_eq!(changes, [1000, 2000, 3000, 9000, 10_000, 11_000]);
        assert_eq!(e.changes_in(2000, 9500), [3000, 9000]);
        // Between two changes the cut is constant.
        for w in changes.windows(2) {
            let (a, b) = (w[0], w[1]);
            assert!(
                (a..b).all(|t| e.cut_w(1000.0, t) == e.cut_w(1000.0, a)),
                "{a}..{b}"
            );
        }
        let target = Event {
            cut: Cut::Target { budget_w: 1200.0 },
            ramp_ms: 0,
            domain: None,
            ..e
        };
        assert_eq!(
            target.cut_w(1000.0, 5000),
            0.0,
            "a target above the base cuts nothing"
        );
    }

    const H: u64 = 3_600_000;

    fn event(id: u64, cut: Cut, start: u64, duration: u64, ramp: u64) -> Event {
        Event {
            id,
            cut,
            start_ms: start,
            duration_ms: duration,
            ramp_ms: ramp,
            domain: None,
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
    fn the_lowest_budget_ahead_is_the_next_steps() {
        let base = Watts(10_000.0);
        // 30 % over a 10 s ramp from t = 100 s, for 60 s: 300 W per 1 s step.
        let e = event(1, Cut::Reduce { fraction: 0.3 }, 100_000, 60_000, 10_000);
        let events = std::slice::from_ref(&e);
        let low = |from: u64, to: u64| lowest_budget(base, events, from, to).0;
        assert_eq!(low(0, 99_999), 10_000.0, "nothing ahead");
        assert_eq!(
            low(98_000, 101_000),
            9_700.0,
            "the first step, 1 s after the start"
        );
        assert_eq!(low(100_500, 103_500), 9_100.0, "three steps ahead");
        assert_eq!(low(100_000, 200_000), 7_000.0, "the whole cut");
        assert_eq!(low(148_000, 150_900), 7_000.0, "the ramp back is not early");
        assert_eq!(low(165_000, 168_000), 10_000.0, "over");
        // Brute force over a fine grid agrees everywhere.
        for from in (90_000..175_000).step_by(250) {
            for len in [0, 999, 1_000, 3_000, 12_000] {
                let brute = (from..=from + len)
                    .step_by(50)
                    .chain(std::iter::once(from + len))
                    .map(|t| effective_budget(base, events, t).0)
                    .fold(f64::MAX, f64::min);
                assert_eq!(low(from, from + len), brute, "{from} +{len}");
            }
        }
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
        assert_eq!(parse_duration_ms("90s"), Ok(90_000));
        assert_eq!(parse_duration_ms("1h30m"), Ok(H + H / 2));
        assert_eq!(parse_duration_ms("1d"), Ok(24 * H));
        assert_eq!(parse_duration_ms("PT3H"), Ok(3 * H));
        assert_eq!(parse_duration_ms("0s"), Ok(0), "a ramp may be 0");
        assert_eq!(parse_reduce("30%"), Ok(0.3));
        assert_eq!(
            parse_reduce("0.3"),
            Ok(0.3),
            "a fraction means what 30% does"
        );
        assert!(
            parse_reduce("0%").is_err()
                && parse_reduce("150%").is_err()
                && parse_reduce("lots").is_err()
        );
        // A bare 30 read as 0.3 % would shed almost nothing; as 30 % it is a guess.
        let bare = parse_reduce("30").expect_err("ambiguous").to_string();
        assert!(bare.contains("30%") && bare.contains("0.3"), "{bare}");
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
            parse_start_ms("2026-12-01T12:00:00-05:00", 0),
            Ok(1_796_144_400_000)
        );
        assert_eq!(
            parse_start_ms("2026-12-01T17:00:00.250Z", 0),
            Ok(1_796_144_400_250)
        );
        assert_eq!(
            parse_start_ms("2028-02-29T00:00:00Z", 0),
            Ok(1_835_395_200_000),
            "a leap day"
        );
    }

    /// Inputs a hand-written parser accepted or panicked on: each must be refused with
    /// an error.
    #[test]
    fn refuses_impossible_times_and_durations() {
        for bad in [
            "tomorrow",
            "2026-13-01T00:00:00Z",
            "2026-12-01T17:00:00",
            "+soon",
            "+-5m",
            "2026-02-31T00:00:00Z",
            "2027-02-29T00:00:00Z",
            "2026-+1-01T00:00:00Z",
            "2026-12-01T17:00:00+99:00",
            "2026-12-01T17:00:00+\u{661}\u{662}:00",
            "2026-12-01T17:00:00+01:\u{e9}",
            "2026-12-01T17:00:00\u{e9}",
            "1969-12-31T23:59:59Z",
            "",
        ] {
            assert!(
                matches!(parse_start(bad), Err(ScheduleError::Start { .. })),
                "{bad:?}: {:?}",
                parse_start(bad)
            );
        }
        for bad in [
            "3 fortnights",
            "90",
            "-5m",
            "1y",
            "2mo",
            "366d",
            "",
            "5m\u{e9}",
        ] {
            assert!(
                matches!(parse_duration_ms(bad), Err(ScheduleError::Duration { .. })),
                "{bad:?}: {:?}",
                parse_duration_ms(bad)
            );
        }
        assert_eq!(
            parse_event_duration_ms("0s"),
            Err(ScheduleError::ZeroDuration("0s".into()))
        );
        assert_eq!(parse_event_duration_ms("3h"), Ok(3 * H));
    }

    #[test]
    fn errors_name_the_input_and_what_is_accepted() {
        let e = parse_start("2026-02-31T00:00:00Z")
            .expect_err("the 31st of February")
            .to_string();
        assert!(
            e.starts_with("bad start \"2026-02-31T00:00:00Z\": ")
                && e.contains("day")
                && e.ends_with("accepted: now, +DURATION (e.g. +10m), or an RFC 3339 time with an offset (e.g. 2026-12-01T17:00:00Z, 2026-12-01T18:00:00+01:00)"),
            "{e}"
        );
        let e = parse_duration_ms("3 fortnights")
            .expect_err("bad")
            .to_string();
        assert!(
            e.starts_with("bad duration \"3 fortnights\": ") && e.contains("accepted: a length"),
            "{e}"
        );
        let e = parse_start("x\n".repeat(30).as_str())
            .expect_err("bad")
            .to_string();
        assert!(!e.contains('\n') && e.contains('…'), "{e}");
    }

    #[test]
    fn prints_times_and_durations() {
        assert_eq!(utc_text(1_796_144_400_250), "2026-12-01 17:00:00 UTC");
        assert_eq!(utc_text(0), "1970-01-01 00:00:00 UTC");
        assert_eq!(utc_text(1_835_395_200_000), "2028-02-29 00:00:00 UTC");
        assert_eq!(utc_text(u64::MAX), format!("{} ms after 1970", u64::MAX));
        assert_eq!(duration_text(3 * H + 300_000), "3h 5m");
        assert_eq!(duration_text(0), "0s");
        for ms in [0, 1_000, 90_000, 3 * H, 1_796_144_400_000] {
            assert_eq!(
                parse_start_ms(&utc_text(ms).replace(" UTC", "Z").replacen(' ', "T", 1), 0),
                Ok(ms)
            );
        }
    }

    /// The fuzz target's properties on its seed corpus (fuzz/seeds/event_time), so they
    /// hold in every `cargo test`, not only when someone fuzzes.
    #[test]
    // The test reads its seed files; the machine itself never reads one.
    #[allow(clippy::disallowed_methods)]
    fn the_fuzz_seeds_print_and_parse_back() {
        let dir =
            std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fuzz/seeds/event_time");
        let mut seen = (0, 0, 0);
        for entry in std::fs::read_dir(&dir).expect("fuzz/seeds/event_time") {
            let path = entry.expect("seed").path();
            let text = std::fs::read_to_string(&path).expect("seed text");
            match parse_start(&text) {
                Ok(Start::At { unix_ms }) => {
                    seen.0 += 1;
                    let printed = utc_text(unix_ms).replace(" UTC", "Z").replacen(' ', "T", 1);
                    assert_eq!(
                        parse_start(&printed),
                        Ok(Start::At {
                            unix_ms: unix_ms - unix_ms % 1000
                        }),
                        "{path:?}"
                    );
                }
                Ok(_) => {}
                Err(_) => seen.1 += 1,
            }
            if let Ok(ms) = parse_duration_ms(&text) {
                seen.2 += 1;
                assert_eq!(parse_duration_ms(&duration_text(ms)), Ok(ms), "{path:?}");
                assert_eq!(parse_event_duration_ms(&text).is_ok(), ms > 0, "{path:?}");
            }
        }
        assert!(
            seen.0 >= 10 && seen.1 >= 10 && seen.2 >= 8,
            "the seeds reach accepted times, refused starts and durations: {seen:?}"
        );
    }
}
