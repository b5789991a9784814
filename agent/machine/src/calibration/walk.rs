//! The walk: warm-up until the job is steady, then the calibration design's caps, one
//! window at a time, until the design stops (or an announced event, or a grant below
//! the walk, ends it); a drifted job walked again.

use powerflex_core::calibration_design::DesignWalk;
use powerflex_core::point::OperatingPoint;
use powerflex_core::Watts;

use super::{
    implausible, Calibration, Phase, ProgressLog, Window, MAX_REWALKS, MAX_WINDOWS_PER_CAP,
    NO_SIGNAL_WAITING,
};

/// Windows whose rates must agree for warm-up to end, and the report gaps the window
/// length is taken from.
const STEADY_WINDOWS: usize = 5;
const STEADY_GAPS: usize = 20;

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
            Phase::Done | Phase::Skipped(_) => None,
        }
    }

    /// Whether the job is planned on the telemetry prior: it has not reported progress
    /// yet, or its walk's curve was not believed ([`implausible`]).
    pub fn on_telemetry_prior(&self) -> bool {
        match self.phase {
            Phase::NoSignal => true,
            Phase::Skipped(_) => self.implausible.is_some(),
            _ => false,
        }
    }

    /// Starts a design over the site's grid (only caps at or below `ceiling`, when the
    /// budget holds the job there).
    pub(super) fn start_design(&mut self, now: f64, ceiling: Option<Watts>) {
        let grid: Vec<Watts> = self
            .settings
            .grid
            .iter()
            .copied()
            .filter(|c| ceiling.is_none_or(|top| c.0 <= top.0 + 0.5))
            .collect();
        self.design = DesignWalk::new(&grid, &self.design_params()).ok();
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

    /// Holds the cap the design wants next, or ends the walk.
    fn follow_design(&mut self, now: f64) {
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

    /// Adds a window, dropping the oldest at its cap beyond [`MAX_WINDOWS_PER_CAP`].
    pub(super) fn push_window(&mut self, window: Window) {
        self.windows.push(window);
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

    /// The controller found the job's measurements outside its curve's band: walk it
    /// again, when the last walk finished at least `settings.rewalk_after_s` ago and fewer
    /// than [`MAX_REWALKS`] walks were repeated (each costs the job tokens). The finished
    /// curve stays in use until the new walk ends; the windows behind it are dropped
    /// then, since the job has changed. Returns whether a walk started.
    pub fn rewalk(&mut self, now: f64) -> bool {
        let rested = self
            .finished_at
            .is_none_or(|t| now - t >= self.settings.rewalk_after_s);
        if self.phase != Phase::Done || !rested || self.rewalks >= MAX_REWALKS {
            return false;
        }
        self.previous = std::mem::take(&mut self.windows);
        self.rewalks += 1;
        self.registered_at = now;
        self.started_at = None;
        self.finished_at = None;
        self.design = None;
        self.stretch = None;
        self.probe = None;
        self.phase = Phase::Warmup;
        true
    }

    fn finish(&mut self, now: f64) {
        self.finished_at = Some(now);
        self.design = None;
        let levels = self.levels();
        self.phase = if levels.len() < 2 {
            Phase::Skipped("too few levels measured".into())
        } else if let Some(why) = implausible(&levels) {
            // The job's own reports say it slowed more than its GPUs did: its curve is
            // words, not a measurement. Plan on the telemetry prior, and say why.
            self.implausible = Some(why.clone());
            Phase::Skipped(format!("{why}; planned on the telemetry prior"))
        } else {
            Phase::Done
        };
    }
}
