//! What a calibration gives, in the forms the agent reports and saves (levels, points,
//! the curve and its PFI, what it cost), and a previous run's points taken back.

use powerflex_core::calibration_design::FIRST_HOUR_S;
use powerflex_core::curve::{estimate_from_windows, CapCurve};
use powerflex_core::point::OperatingPoint;
use powerflex_core::Watts;

use std::borrow::Cow;

use super::{clock_bounded, Calibration, Level, Phase, Window, RESTORED_NOISE};

impl Calibration {
    /// The windows to plan on: the job's current phase's only. The windows of a phase
    /// the job has left (`previous`, set aside when its measurements left its curve) are
    /// never averaged with the new ones nor planned on: a job that changed phase has no
    /// curve until the windows read since make one.
    fn best_windows(&self) -> &[Window] {
        &self.windows
    }

    /// The points to plan on, one per cap (see `best_windows`), highest cap first, read
    /// as the GPUs' clocks allow ([`clock_bounded`]).
    pub fn best_levels(&self) -> Vec<Level> {
        pool(&as_the_clock_allows(self.best_windows()))
    }

    /// The levels of this walk (and what operation has added), highest cap first, read
    /// as the GPUs' clocks allow ([`clock_bounded`]).
    pub fn levels(&self) -> Vec<Level> {
        pool(&as_the_clock_allows(&self.windows))
    }

    /// The levels as the job reported them, before the clocks' reading: what
    /// [`super::implausible`] judges.
    pub fn reported_levels(&self) -> Vec<Level> {
        pool(&self.windows)
    }

    /// The measured points (per-GPU cap, summed power, throughput): the curve's knots.
    pub fn points(&self) -> Vec<OperatingPoint> {
        self.levels()
            .iter()
            .map(|l| OperatingPoint {
                cap_w: l.cap,
                power_w: l.power,
                throughput: l.throughput,
            })
            .collect()
    }

    /// PFI of the measured points (Eq. 1), once done.
    pub fn pfi(&self) -> Option<f64> {
        (self.phase == Phase::Done || self.extending)
            .then(|| self.curve().and_then(|c| c.pfi()))
            .flatten()
    }

    /// The estimated curve with per-point uncertainty, once done: the estimator
    /// `powerflexctl evaluate` uses ([`estimate_from_windows`]) over every window.
    pub fn curve(&self) -> Option<CapCurve> {
        if self.phase != Phase::Done && !self.extending {
            return None;
        }
        curve_of(&as_the_clock_allows(&self.windows))
    }

    /// The curve to plan on and report: the current phase's, once a walk has ended
    /// (none while the first walk is under way, nor while a repeated one is: see
    /// `best_windows`).
    pub fn best_curve(&self) -> Option<CapCurve> {
        self.curve()
    }

    /// Seconds from the start of the walk to its end.
    pub fn duration_s(&self) -> Option<f64> {
        Some(self.finished_at? - self.started_at?)
    }

    /// The cost as a fraction of the job's first-hour tokens (uncapped throughput ×
    /// 3600 s), once the uncapped throughput is known.
    pub fn cost_fraction(&self) -> Option<f64> {
        (self.top_throughput > 0.0).then(|| self.cost / (FIRST_HOUR_S * self.top_throughput))
    }

    /// Takes the curve measured by a previous run of the agent (points of per-GPU cap W,
    /// job power W, throughput): a restarted agent does not walk the job again, and the
    /// curve is not replaced by a new walk's first point. Fewer than two valid points
    /// change nothing. Each point counts as one window (their windows were not saved).
    pub fn restore(&mut self, points: &[OperatingPoint]) {
        let windows: Vec<Window> = points
            .iter()
            .filter(|p| {
                [p.cap_w.0, p.power_w.0, p.throughput]
                    .iter()
                    .all(|x| x.is_finite() && *x > 0.0)
            })
            .map(|p| Window {
                cap: p.cap_w,
                power: p.power_w,
                throughput: p.throughput,
                relative_noise: RESTORED_NOISE,
                sm_clock_mhz: None,
                learned: false,
            })
            .collect();
        if windows.len() >= 2 {
            self.top_throughput = windows
                .iter()
                .max_by(|a, b| a.cap.0.total_cmp(&b.cap.0))
                .map_or(0.0, |w| w.throughput);
            self.windows = windows;
            self.phase = Phase::Done;
        }
    }
}

/// `windows` read as the clocks allow ([`clock_bounded`]).
fn as_the_clock_allows(windows: &[Window]) -> Cow<'_, [Window]> {
    clock_bounded(windows).map_or(Cow::Borrowed(windows), Cow::Owned)
}

/// The curve of `windows` by [`estimate_from_windows`], the windows' own spread as the
/// prior noise of one window (at least 0.2 %).
fn curve_of(windows: &[Window]) -> Option<CapCurve> {
    if windows.is_empty() {
        return None;
    }
    let prior =
        (windows.iter().map(|w| w.relative_noise).sum::<f64>() / windows.len() as f64).max(0.002);
    let readings: Vec<OperatingPoint> = windows
        .iter()
        .map(|w| OperatingPoint {
            cap_w: w.cap,
            power_w: w.power,
            throughput: w.throughput,
        })
        .collect();
    let curve = estimate_from_windows(&readings, prior).ok()?;
    (curve.knots().len() >= 2).then_some(curve)
}

/// Windows pooled per cap, highest cap first.
fn pool(windows: &[Window]) -> Vec<Level> {
    let mut levels: Vec<Level> = Vec::new();
    let mut caps: Vec<f64> = windows.iter().map(|w| w.cap.0).collect();
    caps.sort_by(|a, b| b.total_cmp(a));
    caps.dedup_by(|a, b| (*a - *b).abs() < 0.5);
    for cap in caps {
        let at: Vec<&Window> = windows
            .iter()
            .filter(|w| (w.cap.0 - cap).abs() < 0.5)
            .collect();
        let n = at.len() as f64;
        let mean = |f: &dyn Fn(&Window) -> f64| at.iter().map(|w| f(w)).sum::<f64>() / n;
        let clocks: Vec<f64> = at.iter().filter_map(|w| w.sm_clock_mhz).collect();
        levels.push(Level {
            cap: Watts(cap),
            power: Watts(mean(&|w| w.power.0)),
            throughput: mean(&|w| w.throughput),
            relative_noise: mean(&|w| w.relative_noise) / n.sqrt(),
            sm_clock_mhz: (!clocks.is_empty())
                .then(|| clocks.iter().sum::<f64>() / clocks.len() as f64),
            windows: at.len(),
        });
    }
    levels
}
