//! Early-step calibration of one job's power–throughput curve: a pure state machine the
//! control loop drives with the time, the job's progress and its GPUs' power.
//!
//! 1. **Warm-up**: wait for progress reports, then for steady state — the job's rate over
//!    the last few one-second windows varies by less than `steady_cv`. (Without reports
//!    for `no_signal_s` the job gets the telemetry prior instead.)
//! 2. **Walk**: hold each cap of the site's grid, from the top: `settle_s` for the job to
//!    feel the new cap, then `hold_s` of measurement. The rate at a level comes from the
//!    job's own reports — counts over time between the first and last report in the
//!    window, with bursts of late-read reports folded back and intervals slower than half
//!    the median dropped (evaluations, checkpoints), which is exact for steady steps,
//!    unbiased by late reports and robust to pauses; power is the mean of the job's
//!    summed GPU power over the window.
//! 3. **Bounded**: before stepping down, the next level's slowdown is predicted from the
//!    last two; the walk stops when the measured or predicted slowdown exceeds the tier's
//!    bound plus `allowance`, and when the grid ends.
//! 4. **Result**: the measured points, their PFI (Eq. 1), a fitted curve, how long it
//!    took and the tokens it cost the job (uncapped rate minus level rate, over each
//!    level's time).

use std::collections::VecDeque;

use powerflex_core::curve::{estimate_curve, CapCurve, OperatingPoint};
use powerflex_core::pfi::pfi;
use powerflex_core::Watts;

/// Knobs of the walk (from the site config's `[agent]` section).
#[derive(Debug, Clone, PartialEq)]
pub struct CalibrationSettings {
    /// Per-GPU caps to visit, descending, the first being the uncapped setting.
    pub grid: Vec<Watts>,
    pub settle_s: f64,
    pub hold_s: f64,
    /// Least time between the first report and the first level.
    pub warmup_s: f64,
    /// Coefficient of variation of 1 s rates below which the job is steady.
    pub steady_cv: f64,
    /// Extra slowdown tolerated during the walk beyond the tier bound.
    pub allowance: f64,
    /// Without a report for this long after registration: use the telemetry prior.
    pub no_signal_s: f64,
}

/// The job's cumulative progress as reported, with the agent's receive times.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct ProgressLog {
    reports: VecDeque<(f64, f64)>,
}

/// Relative noise assumed for points restored from a previous run (their own noise was
/// not saved): the paper's repeat-run noise of ~0.5 %, doubled for the agent's short holds.
const RESTORED_NOISE: f64 = 0.01;

/// How much more a job's reported throughput may fall, as a fraction of uncapped, than its
/// GPUs' SM clock fell at the same cap: a cap slows the SM clock and leaves memory alone,
/// so no job slows by more than its clock (memory-bound jobs slow by less). The margin is
/// for measurement noise and clock averaging.
const CLOCK_SLOWDOWN_MARGIN: f64 = 0.05;

/// Why the levels cannot be a true curve, if they cannot: at some cap the reported
/// throughput fell further below the top level's than the SM clock did (beyond the margin
/// and three standard errors of the two rates).
pub fn implausible(levels: &[Level]) -> Option<String> {
    let top = levels.first()?;
    let top_clock = top.sm_clock_mhz.filter(|c| *c > 0.0)?;
    if top.throughput <= 0.0 {
        return None;
    }
    for level in &levels[1..] {
        let Some(clock) = level.sm_clock_mhz.filter(|c| *c > 0.0) else {
            continue;
        };
        let speed = level.throughput / top.throughput;
        let clock_ratio = clock / top_clock;
        let noise = 3.0 * (level.relative_noise.powi(2) + top.relative_noise.powi(2)).sqrt();
        if speed < clock_ratio - CLOCK_SLOWDOWN_MARGIN - noise {
            return Some(format!(
                "reported progress at {:.0} W fell to {:.0} % of the top level's while the SM clock stayed at {:.0} %",
                level.cap.0,
                100.0 * speed,
                100.0 * clock_ratio
            ));
        }
    }
    None
}

/// Least time between the end of a walk and a repeated one, s.
pub const MIN_REWALK_INTERVAL_S: f64 = 600.0;
/// Most repeated walks per job.
pub const MAX_REWALKS: u32 = 3;

/// Reports kept per job: enough for any window the walk looks at.
const MAX_REPORTS: usize = 20_000;

impl ProgressLog {
    /// Records a cumulative count (tokens, or steps for jobs that count only steps) at `t`.
    /// Counts that go backwards (a restarted job) restart the log.
    pub fn record(&mut self, t: f64, count: f64) {
        if let Some(&(_, last)) = self.reports.back() {
            if count < last {
                self.reports.clear();
            }
        }
        self.reports.push_back((t, count));
        if self.reports.len() > MAX_REPORTS {
            self.reports.pop_front();
        }
    }

    pub fn is_empty(&self) -> bool {
        self.reports.is_empty()
    }

    pub fn first_time(&self) -> Option<f64> {
        self.reports.front().map(|r| r.0)
    }

    pub fn last(&self) -> Option<(f64, f64)> {
        self.reports.back().copied()
    }

    /// Robust rate over `[from, to]` (see the module docs) and its relative standard error.
    ///
    /// The rate is pooled (counts over time), so a report that arrives late only moves
    /// time from one interval to the next and biases nothing. Two things are taken out:
    /// - reports that arrive in a burst (the agent was descheduled and read a queue of
    ///   them at once) are folded into the interval before them, where their counts were
    ///   earned;
    /// - pauses: intervals slower than half the median rate (evaluations, checkpoints).
    ///   Dropping only the slow side of ordinary jitter would bias the rate upward, so
    ///   the threshold is far below what a late report produces.
    pub fn rate(&self, from: f64, to: f64) -> Option<(f64, f64)> {
        let inside: Vec<(f64, f64)> = self
            .reports
            .iter()
            .copied()
            .filter(|r| r.0 >= from && r.0 <= to)
            .collect();
        if inside.len() < 3 {
            return None;
        }
        let mut gaps: Vec<f64> = inside
            .windows(2)
            .map(|w| w[1].0 - w[0].0)
            .filter(|dt| *dt > 0.0)
            .collect();
        if gaps.is_empty() {
            return None;
        }
        gaps.sort_by(f64::total_cmp);
        let burst_s = 0.25 * gaps[gaps.len() / 2];
        let mut intervals: Vec<(f64, f64)> = Vec::with_capacity(inside.len());
        let mut anchor = inside[0];
        for &report in &inside[1..] {
            let dt = report.0 - anchor.0;
            if dt > burst_s {
                intervals.push((dt, report.1 - anchor.1));
                anchor = report;
            } else if let Some(last) = intervals.last_mut() {
                // A burst: its counts belong to the interval that ended at the anchor.
                last.1 += report.1 - anchor.1;
                anchor.1 = report.1;
            }
        }
        if intervals.is_empty() {
            return None;
        }
        let mut rates: Vec<f64> = intervals.iter().map(|(dt, dc)| dc / dt).collect();
        rates.sort_by(f64::total_cmp);
        let median = rates[rates.len() / 2];
        let kept: Vec<&(f64, f64)> = intervals
            .iter()
            .filter(|(dt, dc)| dc / dt >= 0.5 * median)
            .collect();
        let time: f64 = kept.iter().map(|(dt, _)| dt).sum();
        let count: f64 = kept.iter().map(|(_, dc)| dc).sum();
        if time <= 0.0 || count <= 0.0 {
            return None;
        }
        // The kept intervals laid end to end (pauses cut out) give points of (count,
        // time). Counts are exact and arrival times carry the jitter, so time is
        // regressed on count: every report's timing contributes, where the pooled
        // count / time would rest on the first and last report alone. With fewer than
        // three intervals the pooled rate is all there is.
        if kept.len() < 3 {
            return Some((count / time, 1.0 / (kept.len() as f64).sqrt()));
        }
        let mut points = Vec::with_capacity(kept.len() + 1);
        let (mut c, mut t) = (0.0, 0.0);
        points.push((c, t));
        for (dt, dc) in &kept {
            c += dc;
            t += dt;
            points.push((c, t));
        }
        let n = points.len() as f64;
        let mean_c = points.iter().map(|p| p.0).sum::<f64>() / n;
        let mean_t = points.iter().map(|p| p.1).sum::<f64>() / n;
        let scc: f64 = points.iter().map(|p| (p.0 - mean_c).powi(2)).sum();
        let sct: f64 = points.iter().map(|p| (p.0 - mean_c) * (p.1 - mean_t)).sum();
        if scc <= 0.0 || sct <= 0.0 {
            return Some((count / time, 1.0));
        }
        let seconds_per_count = sct / scc;
        let residual: f64 = points
            .iter()
            .map(|p| (p.1 - mean_t - seconds_per_count * (p.0 - mean_c)).powi(2))
            .sum();
        let slope_se = (residual / (n - 2.0) / scc).sqrt();
        Some((1.0 / seconds_per_count, slope_se / seconds_per_count))
    }

    /// Rates over consecutive `window_s` windows ending at `now` (oldest first).
    pub fn window_rates(&self, now: f64, window_s: f64, count: usize) -> Vec<f64> {
        (0..count)
            .rev()
            .filter_map(|k| {
                let end = now - k as f64 * window_s;
                self.rate(end - window_s, end).map(|r| r.0)
            })
            .collect()
    }
}

/// Where the walk is.
#[derive(Debug, Clone, PartialEq)]
pub enum Phase {
    /// Waiting for reports and steady state.
    Warmup,
    /// Holding grid level `level` since `since` (agent seconds).
    Level { level: usize, since: f64 },
    /// Finished: the curve is measured.
    Done,
    /// Not calibrated, and why (calibrate=off, flex0, no progress signal).
    Skipped(String),
}

/// One measured level.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Level {
    pub cap: Watts,
    pub power: Watts,
    pub throughput: f64,
    pub relative_noise: f64,
    /// Mean SM clock over the level's measurement, MHz, where the GPUs gave it.
    pub sm_clock_mhz: Option<f64>,
}

/// The calibration of one job.
#[derive(Debug, Clone, PartialEq)]
pub struct Calibration {
    pub settings: CalibrationSettings,
    /// The tier's bound (fraction); `None` = no bound.
    pub bound: Option<f64>,
    pub phase: Phase,
    pub levels: Vec<Level>,
    pub registered_at: f64,
    pub started_at: Option<f64>,
    pub finished_at: Option<f64>,
    /// Tokens (or steps) the walk cost the job against running uncapped (every walk).
    pub cost: f64,
    /// The curve of the walk before the one under way, reported until the new one ends.
    pub previous: Vec<Level>,
    /// Walks started again because the job's measurements left its curve.
    pub rewalks: u32,
    /// Why the job's reported curve was not believed, when it was not (flagged to the
    /// admin in status and reports).
    pub implausible: Option<String>,
    power_sum: f64,
    power_samples: u32,
    clock_sum: f64,
    clock_samples: u32,
}

impl Calibration {
    /// A calibration for a job registered at `now`. `enabled = false` (calibrate=off)
    /// and a bound of 0 (flex0: never capped, so a walk could only hurt) skip the walk.
    pub fn new(
        settings: CalibrationSettings,
        bound: Option<f64>,
        enabled: bool,
        now: f64,
    ) -> Calibration {
        let phase = if !enabled {
            Phase::Skipped("calibrate=off".into())
        } else if bound == Some(0.0) {
            Phase::Skipped("flex0 jobs are never capped".into())
        } else if settings.grid.len() < 2 {
            Phase::Skipped("the calibration grid has fewer than two caps".into())
        } else {
            Phase::Warmup
        };
        Calibration {
            settings,
            bound,
            phase,
            levels: Vec::new(),
            registered_at: now,
            started_at: None,
            finished_at: None,
            cost: 0.0,
            previous: Vec::new(),
            rewalks: 0,
            implausible: None,
            power_sum: 0.0,
            power_samples: 0,
            clock_sum: 0.0,
            clock_samples: 0,
        }
    }

    /// The cap the walk wants on the job's GPUs now, if any.
    pub fn cap(&self) -> Option<Watts> {
        match self.phase {
            Phase::Level { level, .. } => self.settings.grid.get(level).copied(),
            _ => None,
        }
    }

    pub fn is_active(&self) -> bool {
        matches!(self.phase, Phase::Warmup | Phase::Level { .. })
    }

    /// Advances the walk. `job_power` is the job's summed GPU power now, when known.
    pub fn tick(&mut self, now: f64, log: &ProgressLog, job_power: Option<Watts>) {
        match self.phase.clone() {
            Phase::Warmup => {
                let Some(first) = log.first_time() else {
                    if now - self.registered_at >= self.settings.no_signal_s {
                        self.phase = Phase::Skipped("no progress reports: telemetry prior".into());
                    }
                    return;
                };
                if now - first < self.settings.warmup_s {
                    return;
                }
                let rates = log.window_rates(now, 1.0, 5);
                if rates.len() < 5 {
                    return;
                }
                let mean = rates.iter().sum::<f64>() / rates.len() as f64;
                let sd = (rates.iter().map(|r| (r - mean).powi(2)).sum::<f64>()
                    / rates.len() as f64)
                    .sqrt();
                if mean > 0.0 && sd / mean < self.settings.steady_cv {
                    self.started_at = Some(now);
                    self.enter(0, now);
                }
            }
            Phase::Level { level, since } => {
                let measure_from = since + self.settings.settle_s;
                let measure_to = measure_from + self.settings.hold_s;
                if now >= measure_from {
                    if let Some(p) = job_power {
                        self.power_sum += p.0;
                        self.power_samples += 1;
                    }
                }
                if now < measure_to {
                    return;
                }
                let Some((rate, noise)) = log.rate(measure_from, now) else {
                    // No reports in the window: the job paused; hold longer.
                    if now - since > 10.0 * (self.settings.settle_s + self.settings.hold_s) {
                        self.finish(now);
                    }
                    return;
                };
                let power = if self.power_samples > 0 {
                    Watts(self.power_sum / f64::from(self.power_samples))
                } else {
                    Watts(0.0)
                };
                let cap = self.settings.grid[level];
                let sm_clock_mhz = (self.clock_samples > 0)
                    .then(|| self.clock_sum / f64::from(self.clock_samples));
                self.levels.push(Level {
                    cap,
                    power,
                    throughput: rate,
                    relative_noise: noise,
                    sm_clock_mhz,
                });
                let top = self.levels[0].throughput;
                let slowdown = |t: f64| if top > 0.0 { 1.0 - t / top } else { 0.0 };
                if level > 0 {
                    self.cost += (top - rate).max(0.0) * (now - since);
                }
                let limit = self.bound.unwrap_or(1.0) + self.settings.allowance;
                let measured = slowdown(rate);
                let next = level + 1;
                let predicted = match (self.levels.len() >= 2, self.settings.grid.get(next)) {
                    (true, Some(next_cap)) => {
                        let (a, b) = (
                            self.levels[self.levels.len() - 2],
                            self.levels[self.levels.len() - 1],
                        );
                        let per_watt =
                            (a.throughput - b.throughput) / (a.cap.0 - b.cap.0).max(1e-9);
                        slowdown(b.throughput - per_watt * (b.cap.0 - next_cap.0))
                    }
                    _ => measured,
                };
                if next >= self.settings.grid.len() || measured > limit || predicted > limit {
                    self.finish(now);
                } else {
                    self.enter(next, now);
                }
            }
            Phase::Done | Phase::Skipped(_) => {}
        }
    }

    /// The budget holds the job's GPUs at `granted`, below the level being measured: that
    /// level cannot be measured now. The walk moves on to the highest grid level at or
    /// below the grant and goes down from there (a job capped from the start is walked
    /// from its granted cap down, instead of waiting forever for a level the budget does
    /// not allow); its settle and hold start afresh, so no point is recorded at a cap
    /// other than the one it is labelled with. With the grant below every level left,
    /// the walk ends with what it has measured.
    pub fn held_below_level(&mut self, now: f64, granted: Watts) {
        let Phase::Level { level, .. } = self.phase else {
            return;
        };
        let next = self
            .settings
            .grid
            .iter()
            .enumerate()
            .skip(level + 1)
            .find(|(_, cap)| cap.0 <= granted.0 + 0.5)
            .map(|(i, _)| i);
        match next {
            Some(i) => self.enter(i, now),
            None => self.finish(now),
        }
    }

    /// The controller found the job's measurements outside its curve's band: walk it
    /// again, when the last walk finished at least [`MIN_REWALK_INTERVAL_S`] ago and fewer
    /// than [`MAX_REWALKS`] walks were repeated (each costs the job tokens). The finished
    /// curve stays in use until the new walk ends. Returns whether a walk started.
    pub fn rewalk(&mut self, now: f64) -> bool {
        let rested = self
            .finished_at
            .is_none_or(|t| now - t >= MIN_REWALK_INTERVAL_S);
        if self.phase != Phase::Done || !rested || self.rewalks >= MAX_REWALKS {
            return false;
        }
        self.previous = std::mem::take(&mut self.levels);
        self.rewalks += 1;
        self.registered_at = now;
        self.started_at = None;
        self.finished_at = None;
        self.phase = Phase::Warmup;
        true
    }

    /// The points to plan on: this walk's once done, else the previous walk's while a
    /// repeated walk is under way, else what this walk has measured so far.
    pub fn best_levels(&self) -> &[Level] {
        if self.phase != Phase::Done && !self.previous.is_empty() {
            &self.previous
        } else {
            &self.levels
        }
    }

    /// Takes the curve measured by a previous run of the agent (points of per-GPU cap W,
    /// job power W, throughput): a restarted agent does not walk the job again, and the
    /// curve is not replaced by a new walk's first point. Fewer than two valid points
    /// change nothing.
    pub fn restore(&mut self, points: &[[f64; 3]]) {
        let levels: Vec<Level> = points
            .iter()
            .filter(|p| p.iter().all(|x| x.is_finite() && *x > 0.0))
            .map(|p| Level {
                cap: Watts(p[0]),
                power: Watts(p[1]),
                throughput: p[2],
                relative_noise: RESTORED_NOISE,
                sm_clock_mhz: None,
            })
            .collect();
        if levels.len() >= 2 {
            self.levels = levels;
            self.phase = Phase::Done;
        }
    }

    fn enter(&mut self, level: usize, now: f64) {
        self.phase = Phase::Level { level, since: now };
        self.power_sum = 0.0;
        self.power_samples = 0;
        self.clock_sum = 0.0;
        self.clock_samples = 0;
    }

    /// The job's mean SM clock at `now`, MHz: kept over each level's measurement window,
    /// to check the job's reported slowdown against what the cap did to its GPUs.
    pub fn observe_clock(&mut self, now: f64, sm_clock_mhz: f64) {
        if let Phase::Level { since, .. } = self.phase {
            if now >= since + self.settings.settle_s
                && sm_clock_mhz.is_finite()
                && sm_clock_mhz > 0.0
            {
                self.clock_sum += sm_clock_mhz;
                self.clock_samples += 1;
            }
        }
    }

    fn finish(&mut self, now: f64) {
        self.finished_at = Some(now);
        self.phase = if self.levels.len() < 2 {
            Phase::Skipped("too few levels measured".into())
        } else if let Some(why) = implausible(&self.levels) {
            // The job's own reports say it slowed more than its GPUs did: its curve is
            // words, not a measurement. Plan on the telemetry prior, and say why.
            self.implausible = Some(why.clone());
            Phase::Skipped(format!("{why}; planned on the telemetry prior"))
        } else {
            Phase::Done
        };
    }

    /// The measured points (per-GPU cap, summed power, throughput).
    pub fn points(&self) -> Vec<OperatingPoint> {
        self.levels
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
        (self.phase == Phase::Done)
            .then(|| pfi(&self.points()))
            .flatten()
    }

    /// The fitted curve, once done.
    pub fn curve(&self) -> Option<CapCurve> {
        if self.phase != Phase::Done {
            return None;
        }
        let noise = self
            .levels
            .iter()
            .map(|l| l.relative_noise)
            .fold(0.0, f64::max)
            .max(0.002);
        estimate_curve(&self.points(), noise).ok()
    }

    /// Seconds from the start of the walk to its end.
    pub fn duration_s(&self) -> Option<f64> {
        Some(self.finished_at? - self.started_at?)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn settings() -> CalibrationSettings {
        CalibrationSettings {
            grid: [700.0, 600.0, 500.0, 400.0, 300.0, 200.0]
                .map(Watts)
                .to_vec(),
            settle_s: 2.0,
            hold_s: 5.0,
            warmup_s: 3.0,
            steady_cv: 0.05,
            allowance: 0.05,
            no_signal_s: 30.0,
        }
    }

    /// Relative throughput of a fake job at a cap: loses (1 - cap/700)/2 (PFI 2).
    fn speed(cap: f64) -> f64 {
        1.0 - (1.0 - cap / 700.0) / 2.0
    }

    /// Drives a calibration with a fake clock: the job reports every 0.1 s at the rate
    /// its current cap allows; power follows the cap.
    fn run(bound: Option<f64>) -> Calibration {
        let mut cal = Calibration::new(settings(), bound, true, 0.0);
        let mut log = ProgressLog::default();
        let (mut t, mut count) = (0.0f64, 0.0f64);
        let mut next_tick = 1.0;
        while t < 400.0 && cal.is_active() {
            let cap = cal.cap().map_or(700.0, |c| c.0);
            t += 0.1;
            count += 1000.0 * speed(cap) * 0.1;
            log.record(t, count);
            if t >= next_tick {
                cal.tick(t, &log, Some(Watts(8.0 * cap * 0.985)));
                next_tick += 1.0;
            }
        }
        cal
    }

    #[test]
    fn walks_the_grid_and_measures_the_pfi() {
        let cal = run(Some(0.50));
        assert_eq!(cal.phase, Phase::Done);
        assert_eq!(
            cal.levels.len(),
            6,
            "flex3 + 5 % allows the whole grid here"
        );
        let pfi = cal.pfi().expect("pfi");
        assert!((pfi - 2.0).abs() < 0.02, "pfi {pfi}");
        assert!(cal.cost > 0.0);
        assert!(cal.duration_s().expect("duration") > 6.0 * 7.0 - 1.0);
        assert!(cal.curve().is_some());
    }

    #[test]
    fn a_tight_bound_stops_the_walk_early() {
        // flex1: 10 % + 5 % allowance; slowdown reaches 7.1 % at 600 W... 21 % at 400 W.
        let cal = run(Some(0.10));
        assert_eq!(cal.phase, Phase::Done);
        let deepest = cal.levels.last().expect("levels").cap.0;
        assert!(deepest >= 500.0, "walked down to {deepest} W");
        for l in &cal.levels {
            assert!(1.0 - l.throughput / cal.levels[0].throughput <= 0.15 + 0.01);
        }
    }

    #[test]
    fn skips_when_asked_or_pointless_and_falls_back_without_a_signal() {
        assert!(matches!(
            Calibration::new(settings(), Some(0.25), false, 0.0).phase,
            Phase::Skipped(_)
        ));
        assert!(matches!(
            Calibration::new(settings(), Some(0.0), true, 0.0).phase,
            Phase::Skipped(_)
        ));
        let mut cal = Calibration::new(settings(), Some(0.25), true, 0.0);
        cal.tick(31.0, &ProgressLog::default(), None);
        assert_eq!(
            cal.phase,
            Phase::Skipped("no progress reports: telemetry prior".into())
        );
    }

    #[test]
    fn rate_ignores_pauses() {
        let mut log = ProgressLog::default();
        let mut count = 0.0;
        for i in 1..=100 {
            let t = f64::from(i) * 0.1;
            // A 2 s checkpoint pause in the middle.
            if !(4.0..6.0).contains(&t) {
                count += 100.0;
            }
            log.record(t, count);
        }
        let (rate, _) = log.rate(0.0, 10.0).expect("rate");
        assert!((rate - 1000.0).abs() < 1.0, "{rate}");
    }

    /// Steps every 0.25 s of 100 tokens (400 tokens/s); `late(k)` is how late step k's
    /// report reaches the agent, s.
    fn steady_log(late: impl Fn(u32) -> f64) -> ProgressLog {
        let mut log = ProgressLog::default();
        for k in 1..=40 {
            log.record(f64::from(k) * 0.25 + late(k), f64::from(k) * 100.0);
        }
        log
    }

    #[test]
    fn late_reports_do_not_bias_the_rate() {
        // Every third report 100 ms late (a loaded machine): its interval reads 28 %
        // slow and the next one 67 % fast; the pooled rate is exact.
        let log = steady_log(|k| if k % 3 == 0 { 0.1 } else { 0.0 });
        let (rate, _) = log.rate(0.0, 11.0).expect("rate");
        assert!((rate - 400.0).abs() < 0.5, "{rate}");
    }

    #[test]
    fn jittered_arrivals_are_averaged_not_left_to_the_window_ends() {
        // Steps every 50 ms (a job at time scale 20), each report 0–40 ms late at random,
        // and the window's last report the latest: the first-to-last rate would be 0.8 %
        // low, more than a 600 W level's whole slowdown on a flat curve.
        let mut seed = 12345u64;
        let mut log = ProgressLog::default();
        for k in 0..=100u32 {
            seed = seed
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            let late = if k == 100 {
                0.04
            } else {
                (seed >> 11) as f64 / (1u64 << 53) as f64 * 0.04
            };
            log.record(f64::from(k) * 0.05 + late, f64::from(k) * 100.0);
        }
        let (rate, noise) = log.rate(0.0, 6.0).expect("rate");
        assert!((rate - 2000.0).abs() / 2000.0 < 0.0025, "{rate}");
        assert!(noise > 0.0 && noise < 0.005, "{noise}");
    }

    #[test]
    fn a_burst_of_reports_read_at_once_counts_where_it_was_earned() {
        // The agent is descheduled from 4.1 s to 6.0 s and reads the queued reports of
        // steps 17..=24 at 6.0 s (each 1 µs apart).
        let log = steady_log(|k| {
            if (17..=24).contains(&k) {
                6.0 + f64::from(k) * 1e-6 - f64::from(k) * 0.25
            } else {
                0.0
            }
        });
        let (rate, _) = log.rate(0.0, 11.0).expect("rate");
        assert!((rate - 400.0).abs() / 400.0 < 0.01, "{rate}");
    }

    #[test]
    fn a_job_that_stalls_and_catches_up_is_measured_at_its_rate() {
        // The job itself is descheduled from 3.0 s to 4.6 s, then completes the steps it
        // owes and reports once.
        let mut log = ProgressLog::default();
        for k in 1..=40u32 {
            let t = f64::from(k) * 0.25;
            if (3.0..4.6).contains(&t) {
                continue;
            }
            log.record(t, f64::from(k) * 100.0);
        }
        let (rate, _) = log.rate(0.0, 11.0).expect("rate");
        assert!((rate - 400.0).abs() / 400.0 < 0.01, "{rate}");
    }

    #[test]
    fn a_level_held_below_its_cap_moves_to_the_grant_and_starts_afresh() {
        let mut cal = Calibration::new(settings(), Some(0.5), true, 0.0);
        cal.enter(0, 10.0);
        cal.held_below_level(25.0, Watts(600.0));
        assert_eq!(
            cal.phase,
            Phase::Level {
                level: 1,
                since: 25.0
            }
        );
    }

    /// Issue 13: a job capped from the start restarted its walk at level 0 for as long as
    /// the cap held, so it was never measured.
    #[test]
    fn a_job_capped_from_the_start_is_walked_from_its_grant_down() {
        let mut cal = Calibration::new(settings(), Some(0.5), true, 0.0);
        let mut log = ProgressLog::default();
        let granted = 450.0;
        let (mut t, mut count) = (0.0f64, 0.0f64);
        let mut next_tick = 1.0;
        while t < 400.0 && cal.is_active() {
            let cap = cal.cap().map_or(granted, |c| c.0.min(granted));
            t += 0.1;
            count += 1000.0 * speed(cap) * 0.1;
            log.record(t, count);
            if t >= next_tick {
                if cal.cap().is_some_and(|level| granted < level.0 - 0.5) {
                    cal.held_below_level(t, Watts(granted));
                }
                cal.tick(t, &log, Some(Watts(8.0 * cap)));
                next_tick += 1.0;
            }
        }
        assert_eq!(cal.phase, Phase::Done, "{:?}", cal.levels);
        assert_eq!(
            cal.levels[0].cap,
            Watts(400.0),
            "the first level at or below the grant"
        );
        assert!(cal.levels.iter().all(|l| l.cap.0 <= granted));
        assert!(cal.levels.len() >= 2);
    }

    #[test]
    fn a_grant_below_every_level_left_ends_the_walk() {
        let mut cal = Calibration::new(settings(), Some(0.5), true, 0.0);
        cal.enter(0, 10.0);
        cal.held_below_level(11.0, Watts(150.0));
        assert!(!cal.is_active());
        assert!(
            matches!(cal.phase, Phase::Skipped(_)),
            "nothing measured: {:?}",
            cal.phase
        );
    }

    #[test]
    fn a_restored_curve_is_kept_not_walked_again() {
        let mut cal = Calibration::new(settings(), Some(0.5), true, 0.0);
        cal.restore(&[
            [700.0, 5600.0, 1000.0],
            [500.0, 4000.0, 850.0],
            [300.0, 2400.0, 700.0],
        ]);
        assert_eq!(cal.phase, Phase::Done);
        assert!(cal.curve().is_some());
        assert!(cal.pfi().is_some());
        let mut one = Calibration::new(settings(), Some(0.5), true, 0.0);
        one.restore(&[[700.0, 5600.0, 1000.0], [f64::NAN, 1.0, 1.0]]);
        assert_eq!(one.phase, Phase::Warmup, "one valid point is no curve");
    }

    #[test]
    fn a_drifted_job_is_walked_again_at_a_bounded_rate_and_keeps_its_curve_meanwhile() {
        let mut cal = run(Some(0.5));
        assert_eq!(cal.phase, Phase::Done);
        let done_at = cal.finished_at.expect("finished");
        let levels = cal.levels.clone();
        assert!(!cal.rewalk(done_at + 10.0), "too soon after the last walk");
        assert!(cal.rewalk(done_at + MIN_REWALK_INTERVAL_S));
        assert_eq!(cal.phase, Phase::Warmup);
        assert_eq!(
            cal.best_levels(),
            levels.as_slice(),
            "the old curve while walking"
        );
        assert!(
            !cal.rewalk(done_at + 2.0 * MIN_REWALK_INTERVAL_S),
            "only a finished walk is repeated"
        );
        cal.rewalks = MAX_REWALKS;
        cal.phase = Phase::Done;
        cal.finished_at = Some(0.0);
        assert!(!cal.rewalk(1e9), "at most MAX_REWALKS repeats");
    }

    /// Issue 14: a job's reported curve decides its floor; a job that reports a steep
    /// drop under caps buys a high floor. Its GPUs' clocks say how much a cap can slow it.
    #[test]
    fn a_reported_slowdown_steeper_than_the_clock_is_not_believed() {
        let level = |cap: f64, throughput: f64, clock: f64| Level {
            cap: Watts(cap),
            power: Watts(cap * 4.0),
            throughput,
            relative_noise: 0.005,
            sm_clock_mhz: Some(clock),
        };
        // Honest: throughput falls less than the clock (a memory-bound job).
        let honest = [
            level(700.0, 1000.0, 1980.0),
            level(500.0, 930.0, 1600.0),
            level(300.0, 800.0, 1200.0),
        ];
        assert_eq!(implausible(&honest), None);
        // Compute-bound: throughput falls with the clock, within the margin.
        let compute = [level(700.0, 1000.0, 1980.0), level(500.0, 800.0, 1600.0)];
        assert_eq!(implausible(&compute), None);
        // Words: a 50 % drop while the clock fell 19 %.
        let inflated = [level(700.0, 1000.0, 1980.0), level(500.0, 500.0, 1600.0)];
        let why = implausible(&inflated).expect("implausible");
        assert!(why.contains("500 W"), "{why}");
        // Without clocks nothing can be said.
        let blind = [
            Level {
                sm_clock_mhz: None,
                ..level(700.0, 1000.0, 0.0)
            },
            level(500.0, 500.0, 1600.0),
        ];
        assert_eq!(implausible(&blind), None);
    }

    #[test]
    fn an_implausible_walk_ends_on_the_prior_and_is_flagged() {
        let mut cal = Calibration::new(settings(), Some(0.5), true, 0.0);
        let mut log = ProgressLog::default();
        let (mut t, mut count) = (0.0f64, 0.0f64);
        let mut next_tick = 1.0;
        while t < 400.0 && cal.is_active() {
            let cap = cal.cap().map_or(700.0, |c| c.0);
            t += 0.1;
            // The job claims to lose 2 % of its speed per 10 W of cap.
            count += 1000.0 * (1.0 - (700.0 - cap) / 500.0).max(0.05) * 0.1;
            log.record(t, count);
            if t >= next_tick {
                // A memory-bound GPU: the clock loses a third of what the cap takes.
                cal.observe_clock(t, 1980.0 * (1.0 - (700.0 - cap) / 700.0 / 3.0));
                cal.tick(t, &log, Some(Watts(4.0 * cap)));
                next_tick += 1.0;
            }
        }
        assert!(
            matches!(&cal.phase, Phase::Skipped(why) if why.contains("telemetry prior")),
            "{:?}",
            cal.phase
        );
        assert!(cal.implausible.is_some());
        assert!(cal.curve().is_none() && cal.pfi().is_none());
    }
}
