//! Whether a job's bound held: the one judgement every record, line, report and the demo
//! print.
//!
//! A tier promises that the job is never made more than its bound slower than it runs
//! uncapped. The judge is the job's own measurement, not a model: each measurement window
//! (a steady stretch at one cap) compares its measured rate with the uncapped rate of the
//! same phase of the job (the windows at the top cap of the same window set), so a job
//! that became slower by itself (a new phase) is not read as slowed by its cap. A window
//! past the bound counts its whole length as time past it, and the deepest such window is
//! the record's depth.
//!
//! A window's rate is noisy: it is past the bound only when its slowdown exceeds the bound
//! by more than [`BOUND_TOLERANCE_PCT`] and by more than [`NOISE_SIGMAS`] standard errors
//! of the ratio, so a window at the bound is not flagged by its own noise, and a window
//! measured precisely is held to the bound within one point.

use serde::{Deserialize, Serialize};

/// Percent points a window may read past the bound and still be within the bound: the
/// least noise a window's rate carries.
pub const BOUND_TOLERANCE_PCT: f64 = 1.0;

/// Standard errors of a window's slowdown that are its noise, not a broken bound.
pub const NOISE_SIGMAS: f64 = 2.0;

/// One measurement window, as the bound judges it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct WindowRate {
    /// How long the window measured, s.
    pub seconds: f64,
    /// Its measured rate (tokens or steps per second).
    pub rate: f64,
    /// The same phase's uncapped rate, in the same unit.
    pub uncapped_rate: f64,
    /// Standard error of the ratio `rate / uncapped_rate`, relative.
    pub relative_noise: f64,
    /// Percent points the window may read past the bound by design: the calibration
    /// allowance while the job is walked, 0 otherwise.
    pub slack_pct: f64,
}

impl WindowRate {
    /// The window's slowdown against the same phase uncapped, percent (0 when faster);
    /// none when either rate is not a positive number.
    pub fn slowdown_pct(&self) -> Option<f64> {
        let ok = |x: f64| x.is_finite() && x > 0.0;
        (ok(self.rate) && ok(self.uncapped_rate))
            .then(|| 100.0 * (1.0 - self.rate / self.uncapped_rate).max(0.0))
    }

    /// How far past `bound_pct` the window is, percent points; none when within it (or
    /// not judgeable).
    pub fn past_pct(&self, bound_pct: f64) -> Option<f64> {
        let slowdown = self.slowdown_pct()?;
        let noise = if self.relative_noise.is_finite() {
            NOISE_SIGMAS * 100.0 * self.relative_noise.max(0.0)
        } else {
            0.0
        };
        let slack = self.slack_pct.max(0.0);
        let past = slowdown - bound_pct;
        (past > slack + BOUND_TOLERANCE_PCT.max(noise)).then_some(past)
    }
}

/// A job's bound, judged window by window: how long was judged, how long the job spent
/// past its bound and how deep it went. Stored in records (every field defaults, so
/// records written before it read as not judged).
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct BoundJudgement {
    /// Seconds of windows judged.
    #[serde(default)]
    pub judged_s: f64,
    /// Seconds of windows past the bound.
    #[serde(default)]
    pub past_s: f64,
    /// The worst window's slowdown past the bound, percent points; none when none was.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub depth_pct: Option<f64>,
}

impl BoundJudgement {
    /// Judges one window against `bound_pct` (percent slower than uncapped).
    pub fn judge(&mut self, window: WindowRate, bound_pct: f64) {
        if window.slowdown_pct().is_none() || !(window.seconds.is_finite() && window.seconds > 0.0)
        {
            return;
        }
        self.judged_s += window.seconds;
        if let Some(past) = window.past_pct(bound_pct) {
            self.past_s += window.seconds;
            self.depth_pct = Some(self.depth_pct.map_or(past, |d| d.max(past)));
        }
    }

    /// Whether the bound held: none before a window was judged.
    pub fn held(&self) -> Option<bool> {
        (self.judged_s > 0.0).then_some(self.past_s <= 0.0)
    }

    /// Two judgements of the same job on different nodes, which measure the same time:
    /// the longer judged and past time, and the deeper depth, not their sums.
    pub fn merge(&self, other: &BoundJudgement) -> BoundJudgement {
        BoundJudgement {
            judged_s: self.judged_s.max(other.judged_s),
            past_s: self.past_s.max(other.past_s),
            depth_pct: match (self.depth_pct, other.depth_pct) {
                (Some(a), Some(b)) => Some(a.max(b)),
                (a, b) => a.or(b),
            },
        }
    }

    /// "held", or "NOT held (12.3 points past it at worst, for 40 s)", for people.
    pub fn verdict_text(&self) -> Option<String> {
        match self.held()? {
            true => Some("held".into()),
            false => Some(format!(
                "NOT held ({:.1} points past it at worst, for {:.0} s)",
                self.depth_pct.unwrap_or(0.0),
                self.past_s
            )),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn w(rate: f64, noise: f64, slack: f64) -> WindowRate {
        WindowRate {
            seconds: 10.0,
            rate,
            uncapped_rate: 100.0,
            relative_noise: noise,
            slack_pct: slack,
        }
    }

    #[test]
    fn a_window_past_the_bound_costs_its_length_and_sets_the_depth() {
        let mut j = BoundJudgement::default();
        assert_eq!(j.held(), None, "nothing judged, no verdict");
        j.judge(w(80.0, 0.0, 0.0), 25.0);
        assert_eq!(j.held(), Some(true));
        j.judge(w(70.0, 0.0, 0.0), 25.0);
        j.judge(w(60.0, 0.0, 0.0), 25.0);
        assert_eq!(j.held(), Some(false));
        assert_eq!(j.judged_s, 30.0);
        assert_eq!(j.past_s, 20.0);
        assert!((j.depth_pct.expect("depth") - 15.0).abs() < 1e-9);
        assert_eq!(
            j.verdict_text().expect("verdict"),
            "NOT held (15.0 points past it at worst, for 20 s)"
        );
    }

    #[test]
    fn noise_and_the_walks_allowance_are_the_only_slack() {
        // 25.5 % slow: within the one-point tolerance.
        assert_eq!(w(74.5, 0.0, 0.0).past_pct(25.0), None);
        // 27 % slow: past it when measured precisely, within it at 2 % noise (4 points).
        let past = w(73.0, 0.0, 0.0).past_pct(25.0).expect("past");
        assert!((past - 2.0).abs() < 1e-9, "{past}");
        assert_eq!(w(73.0, 0.02, 0.0).past_pct(25.0), None);
        // A walk may read 5 points past the bound, not more.
        assert_eq!(w(71.0, 0.0, 5.0).past_pct(25.0), None);
        assert!(w(68.0, 0.0, 5.0).past_pct(25.0).is_some());
    }

    #[test]
    fn a_window_without_a_rate_is_not_judged_and_faster_is_no_slowdown() {
        let mut j = BoundJudgement::default();
        j.judge(w(0.0, 0.0, 0.0), 10.0);
        j.judge(w(f64::NAN, 0.0, 0.0), 10.0);
        assert_eq!(j.held(), None);
        assert_eq!(w(120.0, 0.0, 0.0).slowdown_pct(), Some(0.0));
    }

    #[test]
    fn nodes_of_one_job_merge_to_the_worst_not_the_sum() {
        let a = BoundJudgement {
            judged_s: 100.0,
            past_s: 10.0,
            depth_pct: Some(3.0),
        };
        let b = BoundJudgement {
            judged_s: 90.0,
            past_s: 20.0,
            depth_pct: None,
        };
        let m = a.merge(&b);
        assert_eq!(
            (m.judged_s, m.past_s, m.depth_pct),
            (100.0, 20.0, Some(3.0))
        );
    }

    #[test]
    fn records_without_the_judgement_read_as_not_judged() {
        let j: BoundJudgement = serde_json::from_str("{}").expect("parses");
        assert_eq!(j.held(), None);
    }
}
