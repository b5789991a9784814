//! The walk: warm-up until the job is steady, then the calibration design's caps, one
//! window at a time, until the design stops (or an announced event, or a grant below
//! the walk, ends it); a drifted job walked again.

use powerflex_core::calibration_design::DesignWalk;
use powerflex_core::point::OperatingPoint;
use powerflex_core::Watts;

use super::{
    implausible, Calibration, Phase, ProgressLog, Window, BOUND_JUDGE_AFTER_S, BOUND_JUDGE_SPAN_S,
    BOUND_JUDGE_Z, LEVEL_PRECISION, MAX_UNJUDGED_WINDOWS, MAX_WINDOWS_PER_CAP, MIN_TOP_WINDOWS,
    NO_SIGNAL_WAITING,
};

/// Windows whose rates must agree for warm-up to end, and the report gaps the window
/// length is taken from.
const STEADY_WINDOWS: usize = 5;
const STEADY_GAPS: usize = 20;

/// How far a grant must rise above the level a walk's top holds, a fraction of that
/// level, for the top to start again at the new grant ([`Calibration::held_above_level`]).
const GRANT_RISE_RESTARTS_TOP: f64 = 0.05;

impl Calibration {
    /// Advances the walk. `job_power` is the job's summed GPU power now, when known.
    /// Returns the window this tick read, if it read one.
    pub fn tick(
        &mut self,
        now: f64,
        log: &ProgressLog,
        job_power: Option<Watts>,
    ) -> Option<Window> {
        match self.phase.clone() {
            Phase::Warmup => {
                let Some(first) = log.first_time() else {
                    if now - self.registered_at >= self.settings.no_signal_s {
                        self.phase = Phase::NoSignal;
                        self.waiting = Some(NO_SIGNAL_WAITING.into());
                    } else {
                        self.waiting = Some("no progress report yet".into());
                    }
                    return None;
                };
                if now - first < self.settings.warmup_s {
                    self.waiting = Some(format!(
                        "warming up: {:.0} s of reports, {:.0} s needed",
                        now - first,
                        self.settings.warmup_s
                    ));
                    return None;
                }
                // Windows long enough for three reports of the job's own cadence: a job
                // whose steps take longer than a third of a second never had three
                // reports in a 1 s window, and waited here forever.
                let window_s = log
                    .median_gap(STEADY_GAPS)
                    .map_or(1.0, |gap| (3.0 * gap).max(1.0));
                let rates = log.window_rates(now, window_s, STEADY_WINDOWS);
                if rates.len() < STEADY_WINDOWS {
                    self.waiting = Some(format!(
                        "waiting for steady progress: a rate in {} of the last {STEADY_WINDOWS} windows of {window_s:.1} s (each needs three reports)",
                        rates.len()
                    ));
                    return None;
                }
                let mean = rates.iter().sum::<f64>() / rates.len() as f64;
                let sd = (rates.iter().map(|r| (r - mean).powi(2)).sum::<f64>()
                    / rates.len() as f64)
                    .sqrt();
                if mean > 0.0 && sd / mean < self.settings.steady_cv {
                    self.waiting = None;
                    self.started_at = Some(now);
                    self.start_design(now, None);
                } else {
                    self.waiting = Some(format!(
                        "waiting for steady progress: the rate varies {:.1} % over the last {STEADY_WINDOWS} windows of {window_s:.1} s (steady below {:.1} %)",
                        if mean > 0.0 { 100.0 * sd / mean } else { f64::INFINITY },
                        100.0 * self.settings.steady_cv
                    ));
                }
                None
            }
            Phase::Walking {
                cap,
                since,
                window_from,
            } => {
                if now >= window_from {
                    if let Some(p) = job_power {
                        self.power_sum += p.0;
                        self.power_samples += 1;
                    }
                }
                if now < window_from + self.settings.hold_s {
                    self.leave_level_past_bound(now, cap, since, log, job_power);
                    return None;
                }
                let Some((rate, noise)) = log.rate(window_from, now) else {
                    // No reports in the window: the job paused; hold longer.
                    if now - since > 10.0 * (self.settings.settle_s + self.settings.hold_s) {
                        self.finish(now);
                    }
                    return None;
                };
                let power = if self.power_samples > 0 {
                    Watts(self.power_sum / f64::from(self.power_samples))
                } else {
                    Watts(0.0)
                };
                let sm_clock_mhz = (self.clock_samples > 0)
                    .then(|| self.clock_sum / f64::from(self.clock_samples));
                let Some(design) = self.design.as_mut() else {
                    self.finish(now);
                    return None;
                };
                design.record(OperatingPoint {
                    cap_w: cap,
                    power_w: power,
                    throughput: rate,
                });
                self.top_throughput = design.top_throughput();
                // Tokens lost against uncapped since the last booking (the settle
                // time of a new cap included).
                if self.top_throughput > 0.0 {
                    self.cost +=
                        (self.top_throughput - rate).max(0.0) * (now - self.booked_to.max(since));
                }
                self.booked_to = now;
                let window = Window {
                    cap,
                    power,
                    throughput: rate,
                    relative_noise: noise,
                    sm_clock_mhz,
                    learned: false,
                };
                self.push_window(window);
                if self.precise(cap) {
                    if let Some(design) = self
                        .design
                        .as_mut()
                        .filter(|d| d.current().is_some_and(|c| (c.0 - cap.0).abs() < 0.5))
                    {
                        design.enough_here();
                    }
                }
                self.follow_design(now);
                Some(window)
            }
            Phase::NoSignal => {
                if log.first_time().is_some() {
                    self.phase = Phase::Warmup;
                    self.waiting = Some("warming up: the first progress report came".into());
                }
                None
            }
            Phase::Done => {
                if self.rewalk_due.is_some_and(|due| now >= due) {
                    self.start_rewalk(now);
                }
                None
            }
            Phase::Skipped(_) => None,
        }
    }

    /// A level whose rate, read from [`BOUND_JUDGE_AFTER_S`] after its cap was written,
    /// already shows the job slowed past the tier's bound plus the allowance (by
    /// [`BOUND_JUDGE_Z`] standard errors) is left at once, not held for its settle and
    /// its window: the design is told the loss and moves on (up to its top-up, or to the
    /// end). The reading is not kept as a window of the curve: it mixes the higher cap
    /// before it, so it reads the job faster than it is at this cap.
    fn leave_level_past_bound(
        &mut self,
        now: f64,
        cap: Watts,
        since: f64,
        log: &ProgressLog,
        job_power: Option<Watts>,
    ) {
        let Some(max_loss) = self.design_params().max_loss else {
            return;
        };
        let from = since + BOUND_JUDGE_AFTER_S;
        if now - from < BOUND_JUDGE_SPAN_S {
            return;
        }
        let Some(design) = self.design.as_mut() else {
            return;
        };
        let top = design.top_throughput();
        if top <= 0.0 {
            return;
        }
        let Some((rate, noise)) = log.rate(from, now) else {
            return;
        };
        let loss = 1.0 - rate * (1.0 + BOUND_JUDGE_Z * noise) / top;
        if loss <= max_loss {
            return;
        }
        tracing::info!(
            cap_w = cap.0,
            loss = 1.0 - rate / top,
            max_loss,
            held_s = now - since,
            "calibration level past the tier's bound: left at once"
        );
        design.record(OperatingPoint {
            cap_w: cap,
            power_w: job_power.unwrap_or(Watts(0.0)),
            throughput: rate,
        });
        self.cost += (top - rate).max(0.0) * (now - self.booked_to.max(since));
        self.booked_to = now;
        self.follow_design(now);
    }

    /// Whether the job is planned on the telemetry prior: it has not reported progress
    /// yet. (A walk whose reports slowed more than the clock is planned as the clock
    /// allows, not on the prior: see [`super::clock_bounded`].)
    pub fn on_telemetry_prior(&self) -> bool {
        self.phase == Phase::NoSignal
    }

    /// Starts a design over the site's grid (only caps at or below `ceiling`, when the
    /// budget holds the job there).
    pub(super) fn start_design(&mut self, now: f64, ceiling: Option<Watts>) {
        let mut grid: Vec<Watts> = self
            .settings
            .grid
            .iter()
            .copied()
            .filter(|c| ceiling.is_none_or(|top| c.0 <= top.0 + 0.5))
            .collect();
        // A walk under a grant starts at the grant itself. Started at the next level of
        // the grid below it, its top would be a cut no bound proved (the demo's job 4,
        // granted 570 W in a new, steeper phase, held 500 W for 18 s and ran 15-20
        // points past its bound), and every level below would be judged against it.
        if let Some(top) = ceiling.filter(|t| t.0 >= self.settings.min_cap.0) {
            if grid.first().is_none_or(|g| g.0 < top.0 - 0.5) {
                grid.insert(0, top);
            }
        }
        let mut params = self.design_params();
        if let (Some(max_loss), Some(top), Some(&first)) =
            (params.max_loss, grid.first(), self.settings.grid.first())
        {
            params.max_loss = Some(loss_below_ceiling(
                max_loss,
                top.0,
                first.0,
                self.settings.min_cap.0,
            ));
        }
        self.design = DesignWalk::new(&grid, &params).ok();
        if let (Some(design), Some(reach)) = (self.design.as_mut(), self.reach) {
            design.reach_down_to(reach);
        }
        if let (Some(design), Some(deadline)) =
            (self.design.as_mut(), self.deadline.filter(|d| *d > now))
        {
            design.finish_within(deadline - now - self.settings.hold_s);
        }
        self.booked_to = now;
        self.follow_design(now);
    }

    /// An announced grid event starts at `deadline` (agent seconds): the walk under way,
    /// or the one still to start, is compressed to end a window before it, so that the
    /// job's curve is measured before the cut (pre-positioning; see
    /// `DesignWalk::finish_within`). When the compressed design moves on from the level
    /// held, the window under way is dropped, so no reading is labelled with a cap other
    /// than the one it was taken at.
    pub fn finish_by(&mut self, now: f64, deadline: f64) {
        self.deadline = Some(deadline);
        let Some(design) = self.design.as_mut() else {
            return;
        };
        design.finish_within(deadline - now - self.settings.hold_s);
        if let Phase::Walking { cap, .. } = self.phase {
            if design.current().is_none_or(|c| (c.0 - cap.0).abs() >= 0.5) {
                self.follow_design(now);
            }
        }
    }

    /// An announced event's plan needs the job at `cap` per GPU (pre-positioning): a walk
    /// under way or still to start reaches down to it (within the tier's bound and the
    /// token budget, as every walk), and a finished curve whose lowest level is above it
    /// is extended: a walk from its top, whose readings there are already in, down
    /// through the grid's caps below its lowest level to `cap`. The curve stays planned on
    /// meanwhile. A job walking again after a drift, or probing, is left as it is.
    pub fn reach_down_to(&mut self, now: f64, cap: Watts) {
        if !(cap.0.is_finite() && cap.0 > 0.0) {
            return;
        }
        self.reach = Some(cap);
        if let Some(design) = self.design.as_mut() {
            design.reach_down_to(cap);
            return;
        }
        if self.phase != Phase::Done
            || self.extending
            || self.rewalk_due.is_some()
            || self.probe.is_some()
        {
            return;
        }
        let levels = self.levels();
        let (Some(top), Some(lowest)) = (levels.first(), levels.last()) else {
            return;
        };
        let grid: Vec<Watts> = std::iter::once(top.cap)
            .chain(
                self.settings
                    .grid
                    .iter()
                    .copied()
                    .filter(|c| c.0 < lowest.cap.0 - 0.5),
            )
            .collect();
        if grid.len() < 2 || lowest.cap.0 <= cap.0 + 0.5 {
            return;
        }
        let Ok(mut design) = DesignWalk::new(&grid, &self.design_params()) else {
            return;
        };
        // Its steps are proved from the lowest level already read, not from the top.
        if top.throughput > 0.0 {
            design.chord_from(lowest.cap, 1.0 - lowest.throughput / top.throughput);
        }
        design.reach_down_to(cap);
        if let Some(deadline) = self.deadline.filter(|d| *d > now) {
            design.finish_within(deadline - now - self.settings.hold_s);
        }
        // The top windows are in: the design starts below them.
        for w in self
            .windows
            .iter()
            .filter(|w| (w.cap.0 - top.cap.0).abs() < 0.5)
        {
            if design
                .current()
                .is_none_or(|c| (c.0 - top.cap.0).abs() >= 0.5)
            {
                break;
            }
            design.record(OperatingPoint {
                cap_w: w.cap,
                power_w: w.power,
                throughput: w.throughput,
            });
        }
        tracing::info!(
            lowest_w = lowest.cap.0,
            reach_w = cap.0,
            "an announced event needs caps below the curve: extending the walk"
        );
        self.design = Some(design);
        self.extending = true;
        self.booked_to = now;
        self.follow_design(now);
    }

    /// Whether this walk's windows at `cap` give its rate within [`LEVEL_PRECISION`]
    /// (see there): at the design's top at least [`MIN_TOP_WINDOWS`] windows, elsewhere
    /// one.
    fn precise(&self, cap: Watts) -> bool {
        let Some(top) = self.design.as_ref().map(DesignWalk::top_cap) else {
            return false;
        };
        let at = |c: Watts| -> Vec<&Window> {
            self.windows
                .iter()
                .filter(|w| !w.learned && (w.cap.0 - c.0).abs() < 0.5)
                .collect()
        };
        let tops = at(top);
        let spread = if tops.len() >= 2 {
            let n = tops.len() as f64;
            let mean = tops.iter().map(|w| w.throughput).sum::<f64>() / n;
            let var = tops
                .iter()
                .map(|w| (w.throughput - mean).powi(2))
                .sum::<f64>()
                / (n - 1.0);
            if mean > 0.0 {
                var.sqrt() / mean
            } else {
                f64::INFINITY
            }
        } else {
            f64::INFINITY
        };
        let here = at(cap);
        let n = here.len();
        let least = if (cap.0 - top.0).abs() < 0.5 {
            MIN_TOP_WINDOWS
        } else {
            1
        };
        if n < least {
            return false;
        }
        let own = here
            .iter()
            .map(|w| w.relative_noise.powi(2))
            .sum::<f64>()
            .sqrt()
            / n as f64;
        own.max(spread / (n as f64).sqrt()) <= LEVEL_PRECISION
    }

    /// Holds the cap the design wants next, or ends the walk. A top-up level whose rate
    /// is already known within [`LEVEL_PRECISION`] is passed over before its settle.
    fn follow_design(&mut self, now: f64) {
        while self
            .design
            .as_ref()
            .filter(|d| d.topping_up())
            .and_then(DesignWalk::current)
            .is_some_and(|cap| self.precise(cap))
        {
            if let Some(design) = self.design.as_mut() {
                design.enough_here();
            }
        }
        let next = self.design.as_ref().and_then(DesignWalk::current);
        match (next, &self.phase) {
            (None, _) => self.finish(now),
            (Some(cap), Phase::Walking { cap: held, .. }) if (cap.0 - held.0).abs() < 0.5 => {
                let since = match self.phase {
                    Phase::Walking { since, .. } => since,
                    _ => now,
                };
                self.phase = Phase::Walking {
                    cap,
                    since,
                    window_from: now,
                };
                self.reset_window();
            }
            (Some(cap), _) => {
                self.phase = Phase::Walking {
                    cap,
                    since: now,
                    window_from: now + self.settings.settle_s,
                };
                self.reset_window();
            }
        }
    }

    fn reset_window(&mut self) {
        self.power_sum = 0.0;
        self.power_samples = 0;
        self.clock_sum = 0.0;
        self.clock_samples = 0;
    }

    /// Adds a window, dropping the oldest at its cap beyond [`MAX_WINDOWS_PER_CAP`], and
    /// hands it to the bound's judgement (see [`Calibration::take_judged`]): at once when
    /// its set has an uncapped rate, else when the set's first top window is read (then
    /// every window waiting is judged against it).
    pub(super) fn push_window(&mut self, window: Window) {
        self.windows.push(window);
        match self.judged_window(&window) {
            Some(judged) => {
                self.judged.push(judged);
                for waiting in std::mem::take(&mut self.unjudged) {
                    if let Some(judged) = self.judged_window(&waiting) {
                        self.judged.push(judged);
                    }
                }
            }
            None => {
                self.unjudged.push(window);
                if self.unjudged.len() > MAX_UNJUDGED_WINDOWS {
                    self.unjudged.remove(0);
                }
            }
        }
        let same = |w: &Window| (w.cap.0 - window.cap.0).abs() < 0.5;
        if self.windows.iter().filter(|w| same(w)).count() > MAX_WINDOWS_PER_CAP {
            if let Some(i) = self.windows.iter().position(same) {
                self.windows.remove(i);
            }
        }
    }

    /// The budget holds the job's GPUs at `granted`, below the cap the walk holds: that
    /// cap cannot be measured now. The design goes on below the grant (a job capped from
    /// the start is walked from its granted cap down, instead of waiting forever for a
    /// level the budget does not allow); the window under way is dropped, so no reading
    /// is labelled with a cap other than the one it was taken at. Under the top windows,
    /// the design starts again from the grant. With the grant below every cap left, the
    /// walk ends with what it has measured.
    pub fn held_below_level(&mut self, now: f64, granted: Watts) {
        let Phase::Walking { cap, .. } = self.phase else {
            return;
        };
        if granted.0 >= cap.0 - 0.5 {
            return;
        }
        let in_top = self
            .design
            .as_ref()
            .is_some_and(|d| d.top_throughput() <= 0.0);
        self.phase = Phase::Warmup;
        if in_top {
            self.start_design(now, Some(granted));
        } else if let Some(design) = self.design.as_mut() {
            design.hold_at_most(granted);
            self.follow_design(now);
        } else {
            self.finish(now);
        }
    }

    /// The budget now grants the job `granted`, above the level the walk holds. A walk
    /// still reading its top started at an earlier grant (a walk under a grant starts at
    /// the grant): it starts again at the new one (or at the grid's top), since its top
    /// is what every level below is judged against, and a grant raised for the job's
    /// bound (a job walked with no curve is planned on the chord) must not be held off
    /// by a top taken under a lower one. Past its top the walk goes on as designed.
    pub fn held_above_level(&mut self, now: f64, granted: Watts) {
        let Phase::Walking { cap, .. } = self.phase else {
            return;
        };
        let below_grid_top = self
            .settings
            .grid
            .first()
            .is_some_and(|top| cap.0 < top.0 - 0.5);
        let in_top = self
            .design
            .as_ref()
            .is_some_and(|d| d.top_throughput() <= 0.0);
        // A grant that moves by a step or two (the allocation's rounding, a ramp's last
        // watts) does not restart the top: only a rise of GRANT_RISE_RESTARTS_TOP.
        let risen = granted.0 > cap.0 * (1.0 + GRANT_RISE_RESTARTS_TOP);
        if !risen || !below_grid_top || !in_top {
            return;
        }
        self.phase = Phase::Warmup;
        self.start_design(now, Some(granted));
    }

    /// The controller found the job's measurements outside its curve's band (a new phase,
    /// a drift): its windows so far are set aside at once (kept in `previous`, never
    /// planned on nor averaged with the new ones), and a walk is due when the last one
    /// finished at least `settings.rewalk_after_s` ago (each walk costs the job tokens):
    /// now, or at that time. Never refused: a repeat of the request while one is due
    /// changes nothing. A job not done walking (its walk under way, or never to be
    /// walked) has no curve to leave. Returns when the walk is due, if it was asked now.
    pub fn rewalk(&mut self, now: f64) -> Option<f64> {
        if self.phase != Phase::Done || self.rewalk_due.is_some() {
            return None;
        }
        let due = self
            .finished_at
            .map_or(now, |t| now.max(t + self.settings.rewalk_after_s));
        self.previous = std::mem::take(&mut self.windows);
        // Windows of the old phase still waiting for its uncapped rate never get it.
        self.unjudged.clear();
        self.curve_question = None;
        self.stretch = None;
        self.probe = None;
        self.rewalk_due = Some(due);
        if due <= now {
            self.start_rewalk(now);
        }
        Some(due)
    }

    /// Starts the walk a drift asked for (see [`Calibration::rewalk`]).
    fn start_rewalk(&mut self, now: f64) {
        self.rewalk_due = None;
        self.rewalks += 1;
        self.implausible = None;
        self.registered_at = now;
        self.started_at = None;
        self.finished_at = None;
        self.design = None;
        self.stretch = None;
        self.probe = None;
        self.phase = Phase::Warmup;
    }

    fn finish(&mut self, now: f64) {
        self.finished_at = Some(now);
        self.extending = false;
        let held_below_top = self
            .design
            .as_ref()
            .zip(self.settings.grid.first())
            .is_some_and(|(d, top)| d.top_cap().0 < top.0 - 0.5);
        self.design = None;
        let levels = self.levels();
        self.phase = if levels.len() < 2 && held_below_top && self.bound.is_some() {
            // The budget held the job too low for a walk the bound allows below it (see
            // `loss_below_ceiling`): it is tried again after the rate limit, when the
            // grant may be higher, and planned meanwhile on what learning reads.
            self.rewalk_due = Some(now + self.settings.rewalk_after_s);
            tracing::info!(
                levels = levels.len(),
                retry_in_s = self.settings.rewalk_after_s,
                "calibration walk held too low to measure a curve: tried again later"
            );
            Phase::Done
        } else if levels.len() < 2 {
            Phase::Skipped("too few levels measured".into())
        } else {
            // The job's own reports say it slowed more than its GPUs did (noise on a flat
            // curve, or words): its curve is planned as the clocks allow
            // ([`super::clock_bounded`]), never dropped for a prior, and the flag says
            // why.
            self.implausible = implausible(&self.reported_levels())
                .map(|why| format!("{why}: planned as the SM clock allows"));
            Phase::Done
        };
    }
}

/// The most loss a walk topped at `top_w` (below the GPU's uncapped setting
/// `uncapped_w`, where the budget holds the job) may read against its top, for the job
/// to lose at most `max_loss` against uncapped.
///
/// Such a walk reads each level's rate against the rate at `top_w`, which is itself
/// below uncapped by an amount it cannot measure. The chord under the concave curve
/// (see `powerflex_core::workload::chord_safe_cap_w`), anchored at `lowest_w` (the
/// GPU's lowest cap, `CalibrationSettings::min_cap`, where throughput is certainly at
/// least 0), bounds it:
/// `T(top)/T(uncapped) ≥ (top − lowest)/(uncapped − lowest)`, so a level losing `ℓ`
/// against the top loses at most `1 − (1 − ℓ)·r` against uncapped. Where even the top
/// may be past the bound, no level below it is allowed (0).
pub(super) fn loss_below_ceiling(max_loss: f64, top_w: f64, uncapped_w: f64, lowest_w: f64) -> f64 {
    if top_w >= uncapped_w - 0.5 || uncapped_w <= lowest_w {
        return max_loss;
    }
    // The chord is not trusted for bounds this tight (real curves' noise).
    if max_loss < powerflex_core::workload::CHORD_MIN_BOUND {
        return 0.0;
    }
    let ratio = ((top_w - lowest_w) / (uncapped_w - lowest_w)).clamp(0.0, 1.0);
    if ratio <= 0.0 {
        return 0.0;
    }
    (1.0 - (1.0 - max_loss) / ratio).clamp(0.0, max_loss)
}
