//! Learning in operation, after the walk: steady stretches at one cap cut into windows
//! that join the curve, probes one step below the grant while an event holds the job
//! there, and the SM clock that tells a believable curve from one the clocks
//! contradict.

use powerflex_core::Watts;
use powerflex_decide::DRIFT_BAND;

use super::{
    Calibration, Phase, Probe, ProgressLog, StepAnswer, Stretch, Window, PROBE_AFTER_WINDOWS,
    PROBE_WINDOWS, QUESTION_TIMEOUT_WINDOWS,
};

/// Parts of a window whose rates must agree for it to answer a question: the job
/// progressed through the whole window, steadily.
const STEADY_PARTS: usize = 5;

/// Whether the job's progress over the window of `hold_s` ending at `now` was steady: a
/// rate in each of its [`STEADY_PARTS`] parts (each needs three reports), varying by
/// less than `steady_cv` (the walk's warm-up rule).
fn steady_over(log: &ProgressLog, now: f64, hold_s: f64, steady_cv: f64) -> bool {
    let rates = log.window_rates(now, hold_s / STEADY_PARTS as f64, STEADY_PARTS);
    if rates.len() < STEADY_PARTS {
        return false;
    }
    let n = rates.len() as f64;
    let mean = rates.iter().sum::<f64>() / n;
    if !(mean.is_finite() && mean > 0.0) {
        return false;
    }
    let sd = (rates.iter().map(|r| (r - mean).powi(2)).sum::<f64>() / n).sqrt();
    sd / mean < steady_cv
}

impl Calibration {
    /// The job's mean SM clock at `now`, MHz: kept over each window, to check the job's
    /// reported slowdown against what the cap did to its GPUs.
    pub fn observe_clock(&mut self, now: f64, sm_clock_mhz: f64) {
        if !(sm_clock_mhz.is_finite() && sm_clock_mhz > 0.0) {
            return;
        }
        if let Phase::Walking { window_from, .. } = self.phase {
            if now >= window_from {
                self.clock_sum += sm_clock_mhz;
                self.clock_samples += 1;
            }
        }
        if let Some(s) = self.stretch.as_mut() {
            if now >= s.window_from {
                s.clock_sum += sm_clock_mhz;
                s.clock_samples += 1;
            }
        }
    }

    /// Learning in operation: once the walk is done, every steady stretch at one cap is
    /// cut into windows of `hold_s` that join the job's curve. `held` is the cap the
    /// job's GPUs read back and since when it has held (agent seconds); the first
    /// `settle_s` of a stretch are not read. A window needs the job's reports (three or
    /// more) and its power; one without them is skipped, not guessed.
    ///
    /// While a new step has the curve in question ([`Calibration::question_curve`]), the
    /// first window read after the step answers it instead of joining the curve as is:
    /// see [`StepAnswer`], returned then.
    pub fn observe_operation(
        &mut self,
        now: f64,
        log: &ProgressLog,
        job_power: Option<Watts>,
        held: Option<(Watts, f64)>,
    ) -> Option<StepAnswer> {
        if self.phase != Phase::Done {
            self.stretch = None;
            return None;
        }
        if let Some(q) = self.curve_question {
            let timeout =
                QUESTION_TIMEOUT_WINDOWS * (self.settings.settle_s + self.settings.hold_s);
            if now - q.since > timeout {
                self.curve_question = None;
                self.last_answered = Some(now);
                self.unanswered_in_row = self.unanswered_in_row.saturating_add(1);
                return Some(StepAnswer::Unanswered {
                    open_s: now - q.since,
                });
            }
        }
        let Some((cap, held_since)) = held else {
            self.stretch = None;
            return None;
        };
        let fresh = self
            .stretch
            .as_ref()
            .is_none_or(|s| (s.cap.0 - cap.0).abs() > 0.5);
        if fresh {
            // A stretch starts once both the cap and the job's step have settled.
            let from = held_since.max(
                self.curve_question
                    .map_or(f64::NEG_INFINITY, |q| q.last_step),
            );
            self.stretch = Some(Stretch {
                cap,
                window_from: from + self.settings.settle_s,
                power_sum: 0.0,
                power_samples: 0,
                clock_sum: 0.0,
                clock_samples: 0,
                windows: 0,
            });
        }
        let hold_s = self.settings.hold_s;
        let s = self.stretch.as_mut()?;
        if now < s.window_from {
            return None;
        }
        if let Some(p) = job_power {
            s.power_sum += p.0;
            s.power_samples += 1;
        }
        if now < s.window_from + hold_s {
            return None;
        }
        let window = log
            .rate(s.window_from, now)
            .filter(|_| s.power_samples > 0)
            .map(|(rate, noise)| Window {
                cap,
                power: Watts(s.power_sum / f64::from(s.power_samples)),
                throughput: rate,
                relative_noise: noise,
                sm_clock_mhz: (s.clock_samples > 0)
                    .then(|| s.clock_sum / f64::from(s.clock_samples)),
                learned: true,
            });
        s.window_from = now;
        s.power_sum = 0.0;
        s.power_samples = 0;
        s.clock_sum = 0.0;
        s.clock_samples = 0;
        let w = window?;
        let questioned = self.curve_question.is_some();
        if questioned && !steady_over(log, now, hold_s, self.settings.steady_cv) {
            // A new step still starting (loading, compiling, warming its caches): its
            // rate and draw say nothing of its curve yet. Not an answer, and not a
            // reading to learn from.
            return None;
        }
        s.windows += 1;
        let answer = questioned.then(|| self.answer_question(now, &w));
        self.push_window(w);
        if self.probe.is_some_and(|p| (p.cap.0 - cap.0).abs() < 0.5) {
            self.end_probe(now);
        }
        answer
    }

    /// The first window after a new step (see [`Calibration::question_curve`]) against
    /// the curve at its cap, as the controller judges drift: its rate within
    /// [`DRIFT_BAND`] (or three standard errors of the curve or of the window, whichever
    /// is widest) and, where the cap was read, its draw within [`DRIFT_BAND`]. Below the
    /// lowest cap read the curve is a lower bound on the rate: only a slower window has
    /// left it. A window that left it sets the job's windows aside and asks for a walk
    /// ([`Calibration::rewalk`]); the window itself then starts the new phase's set.
    fn answer_question(&mut self, now: f64, w: &Window) -> StepAnswer {
        self.curve_question = None;
        self.last_answered = Some(now);
        self.unanswered_in_row = 0;
        let Some(curve) = self.curve() else {
            return StepAnswer::SameCurve;
        };
        let predicted = curve.at(w.cap);
        let below_readings = w.cap.0 < curve.lowest_read_cap().0 - 0.5;
        let band = DRIFT_BAND
            .max(3.0 * curve.relative_uncertainty())
            .max(3.0 * w.relative_noise.max(0.0));
        let throughput_ratio = if predicted.throughput > 0.0 {
            w.throughput / predicted.throughput
        } else {
            1.0
        };
        let power_ratio =
            (!below_readings && predicted.power_w.0 > 0.0).then(|| w.power.0 / predicted.power_w.0);
        let rate_left =
            throughput_ratio < 1.0 - band || (!below_readings && throughput_ratio > 1.0 + band);
        let draw_left = power_ratio.is_some_and(|r| (r - 1.0).abs() > DRIFT_BAND);
        if rate_left || draw_left {
            self.rewalk(now);
            StepAnswer::LeftCurve {
                cap: w.cap,
                throughput_ratio,
                power_ratio,
            }
        } else {
            StepAnswer::SameCurve
        }
    }

    /// The loss the job's own reports put at `cap` against uncapped: between two levels
    /// read, their rates interpolated; below the lowest, the chord from the GPU's lowest
    /// cap (where the job may make no progress) to that level, throughput being concave
    /// in the cap above it. The reports as made, not as the clock allows
    /// ([`super::clock_bounded`] may lift them): the job's own bound is judged on what it
    /// says (a multi-GPU job runs at its slowest GPU's pace, which the mean clock may
    /// not show).
    fn reported_loss_at(&self, cap: Watts) -> f64 {
        let levels = self.reported_levels();
        let (Some(top), Some(lowest)) = (levels.first(), levels.last()) else {
            return 1.0;
        };
        if top.throughput <= 0.0 || !top.throughput.is_finite() {
            return 1.0;
        }
        if cap.0 >= top.cap.0 - 0.5 {
            return 0.0;
        }
        let zero = self.settings.min_cap.0;
        let rate = if cap.0 >= lowest.cap.0 - 0.5 {
            // Levels are highest cap first: the pair around `cap`.
            let below = levels
                .iter()
                .position(|l| l.cap.0 <= cap.0 + 0.5)
                .unwrap_or(0);
            let (hi, lo) = (&levels[below.saturating_sub(1)], &levels[below]);
            if hi.cap.0 - lo.cap.0 > 0.5 {
                let f = (cap.0 - lo.cap.0) / (hi.cap.0 - lo.cap.0);
                lo.throughput + f * (hi.throughput - lo.throughput)
            } else {
                lo.throughput
            }
        } else {
            let lowest_loss = 1.0 - lowest.throughput / top.throughput;
            return powerflex_core::workload::chord_loss(cap.0, zero, lowest.cap.0, lowest_loss);
        };
        (1.0 - rate / top.throughput).clamp(0.0, 1.0)
    }

    /// Decides whether to probe now, while the budget holds the job at `granted` below
    /// its uncapped cap (an event's hold): one window `step` below the grant, to learn
    /// the slope of the curve where the allocator decides. Only when the walk is done,
    /// the job has held the grant for [`PROBE_AFTER_WINDOWS`] windows, the probe cap is
    /// at or above `min_cap`, the curve and the job's own reports put it within its tier
    /// bound there (below the lowest level read, on the physics bound: see
    /// `Calibration::reported_loss_at`),
    /// that cap has fewer than [`PROBE_WINDOWS`] windows, and the probes so far cost less
    /// than the design's token budget over the job's life (a fraction of its tokens so
    /// far). Lowering a cap below the grant never costs the budget anything.
    pub fn consider_probe(&mut self, now: f64, granted: Watts, step: Watts, min_cap: Watts) {
        if self.phase != Phase::Done || self.probe.is_some() || step.0 <= 0.0 {
            return;
        }
        let Some(curve) = self.curve() else {
            return;
        };
        let top = curve.uncapped();
        if granted.0 >= top.cap_w.0 - 0.5 || top.throughput <= 0.0 {
            return;
        }
        let settled = self
            .stretch
            .as_ref()
            .is_some_and(|s| (s.cap.0 - granted.0).abs() < 0.5 && s.windows >= PROBE_AFTER_WINDOWS);
        let cap = Watts(granted.0 - step.0);
        if !settled || cap.0 < min_cap.0 - 0.5 {
            return;
        }
        let loss =
            (1.0 - curve.at(cap).throughput / top.throughput).max(self.reported_loss_at(cap));
        if self.bound.is_some_and(|b| loss > b) {
            return;
        }
        let known = self
            .windows
            .iter()
            .filter(|w| (w.cap.0 - cap.0).abs() < 0.5)
            .count();
        let age_s = now - self.started_at.unwrap_or(self.registered_at);
        let allowance = self.settings.budget_fraction * age_s * self.top_throughput;
        if known >= PROBE_WINDOWS || self.probe_cost >= allowance {
            return;
        }
        self.probe = Some(Probe {
            cap,
            granted,
            since: now,
        });
        tracing::debug!(
            cap_w = cap.0,
            granted_w = granted.0,
            "probing one step below the grant"
        );
    }

    /// Ends the probe: its cost is booked at the curve's loss between the grant and the
    /// probe cap over the time held there.
    fn end_probe(&mut self, now: f64) {
        let Some(probe) = self.probe.take() else {
            return;
        };
        if let Some(curve) = self.curve() {
            let lost = (curve.at(probe.granted).throughput - curve.at(probe.cap).throughput)
                .max(0.0)
                * (now - probe.since);
            self.probe_cost += lost;
            self.cost += lost;
        }
    }

    /// A probe whose cap was not held, or that found no window (the job paused, the
    /// grant moved), ends after three windows' time; a grant that moved ends it at once.
    pub fn check_probe(&mut self, now: f64, granted: Option<Watts>) {
        let Some(probe) = self.probe else {
            return;
        };
        let moved = granted.is_none_or(|g| (g.0 - probe.granted.0).abs() > 0.5);
        let stale = now - probe.since > 3.0 * (self.settings.settle_s + self.settings.hold_s);
        if moved || stale {
            self.end_probe(now);
        }
    }
}
