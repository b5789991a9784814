//! Calibration of one job's power–throughput curve, and its refinement in operation: a
//! pure state machine the control loop drives with the time, the job's progress and its
//! GPUs' power.
//!
//! 1. **Warm-up**: wait for progress reports, then for steady state — the job's rate over
//!    the last five windows (1 s, or three of the job's report intervals when it reports
//!    less often) varies by less than `steady_cv`. (Without reports for `no_signal_s` the
//!    job is planned on the telemetry prior until its first report comes, which starts
//!    the warm-up.) What it still waits for is kept in
//!    [`Calibration::waiting`], for status and the agent's log.
//! 2. **Walk**: the calibration design of `powerflex_core::calibration_design` — the
//!    same one `powerflexctl evaluate` scores — decides which caps of the site's grid to
//!    visit, how many windows of `hold_s` to read at each and when to stop: at the depth
//!    the site's `expected_cut_pct` can push a job to, when its token budget (2 % of the
//!    job's first-hour tokens by default) is spent, or before a cap where the measured
//!    or predicted slowdown exceeds the tier's bound plus `allowance`. A new cap gets
//!    `settle_s` before its first window. The rate in a window comes from the job's own
//!    reports ([`ProgressLog::rate`]); power is the mean of the job's summed GPU power.
//! 3. **Result**: every window is a reading; the curve is the offline estimator
//!    (`estimate_from_windows`: monotone, no forced concavity, a standard error per
//!    point), its PFI (Eq. 1), how long the walk took and the tokens it cost the job
//!    (uncapped rate minus the window's rate, over the window and its settle time),
//!    also as a fraction of first-hour tokens. A curve the GPUs' clocks contradict
//!    ([`implausible`]) is read as the clocks allow ([`clock_bounded`]) and flagged.
//! 4. **Learning in operation**: after the walk, every steady stretch at one cap (after
//!    `settle_s`, with reports) is cut into windows that join the curve, so each event's
//!    hold refines the points the allocator decides on. While an event holds a job below
//!    its uncapped cap, a **probe** may hold it one step lower for one window (never
//!    above its grant, so never costing the budget; within its tier bound on the curve;
//!    priced against the same token budget), so the curve's slope below the grant is
//!    learned too: re-reading only the caps a job is given teaches the allocator nothing
//!    new about where to move it.
//!
//! The types are here; the walk (1–3) is in `walk`, learning in operation (4) in
//! `operation`, the progress log in `progress`, and the curve, points and cost in the
//! forms the agent reports and saves in `results`.

use powerflex_core::calibration_design::{DesignParams, DesignWalk};
use powerflex_core::promise::WindowRate;
use powerflex_core::Watts;

mod operation;
mod progress;
mod results;
mod walk;

pub use progress::{ProgressLog, Recorded};

/// Knobs of the walk (from the site config's `[agent]` section).
#[derive(Debug, Clone, PartialEq)]
pub struct CalibrationSettings {
    /// Per-GPU caps the design may visit, descending, the first being the uncapped
    /// setting: the site's `calibration_caps_w` when set, else every cap step of the GPU.
    pub grid: Vec<Watts>,
    /// The GPU's lowest cap, W: where a job may make no progress at all, the anchor of
    /// the chord that bounds its throughput below the levels read (the grid's lowest cap
    /// may be above it when the site lists its calibration caps).
    pub min_cap: Watts,
    /// Time a job gets to feel a new cap before it is measured, s.
    pub settle_s: f64,
    /// One measurement window, s.
    pub hold_s: f64,
    /// Most token cost of the walk, a fraction of the job's first-hour tokens.
    pub budget_fraction: f64,
    /// The deepest site-wide cut the site expects (`facility.expected_cut_pct`), fraction.
    pub expected_cut: f64,
    /// Least time between the first report and the first level.
    pub warmup_s: f64,
    /// Coefficient of variation of 1 s rates below which the job is steady.
    pub steady_cv: f64,
    /// Extra slowdown tolerated during the walk beyond the tier bound.
    pub allowance: f64,
    /// Without a report for this long after registration: use the telemetry prior.
    pub no_signal_s: f64,
    /// Least time from a walk's end to walking the job again, s
    /// (`agent.calibration_rewalk_after_s`).
    pub rewalk_after_s: f64,
}

/// What status says of a job in [`Phase::NoSignal`].
pub const NO_SIGNAL_WAITING: &str =
    "no progress report yet: planned on the telemetry prior until the job's first report starts the calibration";

/// Relative noise assumed for points restored from a previous run (their own noise was
/// not saved): the paper's repeat-run noise of ~0.5 %, doubled for the agent's short holds.
const RESTORED_NOISE: f64 = 0.01;

/// How much more a job's reported throughput may fall, as a fraction of uncapped, than its
/// GPUs' SM clock fell at the same cap: a cap slows the SM clock and leaves memory alone,
/// so no job slows by more than its clock (memory-bound jobs slow by less). The margin is
/// for measurement noise and clock averaging.
const CLOCK_SLOWDOWN_MARGIN: f64 = 0.05;

/// How close to the top level's SM clock a window's clock may be for its cap to count as
/// not binding (a fraction): a cap the GPUs run under at full clock does not slow the
/// job, whatever its reports say, so every such window reads the same operating point.
/// Tight: a cap that binds a little (the clock 1 % down) slows an inelastic job by about
/// as much, and a walk that reads only such levels (a flex1 job's) must keep that loss;
/// at 1 % the e2e test's PFI-5 job read as flat (PFI 2e13).
const CLOCK_UNBOUND_TOLERANCE: f64 = 0.002;

/// The windows as the physics allows them to be read (see [`implausible`]): a cap does
/// not slow a job by more than it slows the GPUs' SM clock, so
/// - windows whose clock stayed at the top level's (within `CLOCK_UNBOUND_TOLERANCE` (0.2 %))
///   were not slowed by their cap: each cap's such windows are moved together so that
///   their mean is the mean of all of them (their spread kept: real curves
///   that run below every cap are flat with a few percent of noise, which read alone
///   would make a flat job look steep, as the Zeus ShuffleNet runs do);
/// - a window whose clock fell reads at least that rate times its clock's share of the
///   top's, less `CLOCK_SLOWDOWN_MARGIN` (5 %): a steeper reported loss is noise or words.
///
/// A report can then neither buy a floor its GPUs do not justify (a job claiming to slow
/// more than its clock) nor cost the job its curve: what it measured is planned on, read
/// as the clock allows. Windows without clocks, or a walk whose top level has none, are
/// left as read. `None` when nothing changes.
pub fn clock_bounded(windows: &[Window]) -> Option<Vec<Window>> {
    let top_cap = windows
        .iter()
        .map(|w| w.cap.0)
        .fold(f64::NEG_INFINITY, f64::max);
    let top_clocks: Vec<f64> = windows
        .iter()
        .filter(|w| (w.cap.0 - top_cap).abs() < 0.5)
        .filter_map(|w| w.sm_clock_mhz.filter(|c| c.is_finite() && *c > 0.0))
        .collect();
    if top_clocks.is_empty() {
        return None;
    }
    let top_clock = top_clocks.iter().sum::<f64>() / top_clocks.len() as f64;
    let share = |w: &Window| {
        w.sm_clock_mhz
            .filter(|c| c.is_finite() && *c > 0.0)
            .map(|c| c / top_clock)
    };
    let unbound = |w: &Window| share(w).is_some_and(|s| s >= 1.0 - CLOCK_UNBOUND_TOLERANCE);
    // The unbound windows per cap: (cap, summed rate, windows). Their common rate is the
    // mean of all of them; each cap's are moved together onto it, so their spread (what
    // the curve's uncertainty is read from) survives.
    let mut at_cap: Vec<(f64, f64, usize)> = Vec::new();
    for w in windows
        .iter()
        .filter(|w| unbound(w) && w.throughput.is_finite() && w.throughput > 0.0)
    {
        match at_cap
            .iter_mut()
            .find(|(c, _, _)| (c - w.cap.0).abs() < 0.5)
        {
            Some(e) => (e.1, e.2) = (e.1 + w.throughput, e.2 + 1),
            None => at_cap.push((w.cap.0, w.throughput, 1)),
        }
    }
    let (sum, n) = at_cap
        .iter()
        .fold((0.0, 0usize), |(s, n), &(_, sum, k)| (s + sum, n + k));
    if n == 0 {
        return None;
    }
    let rate = sum / n as f64;
    let cap_mean = |cap: f64| {
        at_cap
            .iter()
            .find(|(c, _, _)| (c - cap).abs() < 0.5)
            .map_or(rate, |&(_, sum, n)| sum / n as f64)
    };
    let mut changed = false;
    let read: Vec<Window> = windows
        .iter()
        .map(|w| {
            let throughput = match share(w) {
                _ if !(w.throughput.is_finite() && w.throughput > 0.0) => w.throughput,
                Some(s) if s >= 1.0 - CLOCK_UNBOUND_TOLERANCE => {
                    (w.throughput + rate - cap_mean(w.cap.0)).max(f64::MIN_POSITIVE)
                }
                Some(s) => w
                    .throughput
                    .max(rate * (s.min(1.0) - CLOCK_SLOWDOWN_MARGIN).max(0.0)),
                None => w.throughput,
            };
            changed |= throughput != w.throughput;
            Window { throughput, ..*w }
        })
        .collect();
    changed.then_some(read)
}

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

/// Least time between the end of a walk and a repeated one, s: the site default of
/// `agent.calibration_rewalk_after_s`. It is the only limit on repeated walks: a job whose
/// measurements leave its curve again and again is walked again at most this often, and
/// never refused for good (a job planned on a curve it has left is planned on nothing).
pub const DEFAULT_REWALK_AFTER_S: f64 = 600.0;

/// The relative standard error at which a level's rate is known well enough for the walk
/// to move on: half the ~0.5 % a job's rate varies between repeated runs (the paper's
/// repeat-run noise), so no level is read longer than what repeats could confirm. A
/// level's error is the larger of its windows' own (each window's rate fit) and the
/// job's window-to-window spread at its uncapped level over the square root of its
/// windows, so a job whose rate wanders between windows is read for more of them.
/// The walk's token budget and its windows per level still bound it from above:
/// reading every level for as many windows as the budget affords took the site's
/// default walk close to an hour on jobs cheap to cap.
pub const LEVEL_PRECISION: f64 = 0.0025;
/// Uncapped windows read before the top level may be judged precise: every other level
/// is judged against it, and its spread is the job's window-to-window noise.
pub const MIN_TOP_WINDOWS: usize = 3;

/// How soon after a walk's cap is written its rate is first judged against the tier's
/// bound, s: the cap takes effect within a sample period or two. A rate read from then on
/// still holds some of the higher cap before it, so it can only understate the loss: a
/// loss past the bound read then is past it.
pub const BOUND_JUDGE_AFTER_S: f64 = 1.0;
/// Least span of reports a rate is judged on before the window ends, s.
pub const BOUND_JUDGE_SPAN_S: f64 = 2.0;
/// Standard errors of that rate the loss must exceed the bound by: a walk leaves a level
/// on evidence, not on one noisy report.
pub const BOUND_JUDGE_Z: f64 = 2.0;

/// Where the walk is.
#[derive(Debug, Clone, PartialEq)]
pub enum Phase {
    /// Waiting for reports and steady state.
    Warmup,
    /// The design holds the job at `cap` since `since` (agent seconds); the window under
    /// way started at `window_from` (after the settle time, for a new cap).
    Walking {
        cap: Watts,
        since: f64,
        window_from: f64,
    },
    /// Finished: the curve is measured (and refined by learning in operation).
    Done,
    /// No progress report came within `no_signal_s` of registration: the job is planned
    /// on the telemetry prior meanwhile, and its first report starts the warm-up. Not an
    /// end: a real job may load its model and data for many minutes before its first
    /// step, and a loaded node may start a job's process late; neither may leave the
    /// job on the prior for good.
    NoSignal,
    /// Not calibrated, and why (calibrate=off, flex0, too few levels, a curve the clocks
    /// contradict).
    Skipped(String),
}

/// One measurement window: a steady stretch of `hold_s` at one cap.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Window {
    pub cap: Watts,
    /// Mean of the job's summed GPU power over the window.
    pub power: Watts,
    pub throughput: f64,
    /// Standard error of the window's rate, relative (from its reports' spread).
    pub relative_noise: f64,
    /// Mean SM clock over the window, MHz, where the GPUs gave it.
    pub sm_clock_mhz: Option<f64>,
    /// Read by learning in operation (not by the calibration walk).
    pub learned: bool,
}

/// The windows at one cap, pooled.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Level {
    pub cap: Watts,
    pub power: Watts,
    pub throughput: f64,
    pub relative_noise: f64,
    /// Mean SM clock over the level's windows, MHz, where the GPUs gave it.
    pub sm_clock_mhz: Option<f64>,
    /// Windows behind it.
    pub windows: usize,
}

/// Most windows kept per cap: the newest, so a long job's curve follows the job and its
/// memory stays bounded.
pub const MAX_WINDOWS_PER_CAP: usize = 48;

/// Windows at the grant between two probes, and windows a probe cap needs before it is
/// known well enough to stop probing it.
pub const PROBE_AFTER_WINDOWS: usize = 2;
pub const PROBE_WINDOWS: usize = 4;

/// A steady stretch at one cap being cut into windows (learning in operation).
#[derive(Debug, Clone, PartialEq)]
struct Stretch {
    cap: Watts,
    window_from: f64,
    power_sum: f64,
    power_samples: u32,
    clock_sum: f64,
    clock_samples: u32,
    /// Windows this stretch has produced.
    windows: usize,
}

/// A probe under way: the job held at `cap`, one step below its grant, since `since`.
#[derive(Debug, Clone, Copy, PartialEq)]
struct Probe {
    cap: Watts,
    granted: Watts,
    since: f64,
}

/// The calibration of one job.
#[derive(Debug, Clone, PartialEq)]
pub struct Calibration {
    pub settings: CalibrationSettings,
    /// The tier's bound (fraction); `None` = no bound.
    pub bound: Option<f64>,
    pub phase: Phase,
    /// Every window read, walk and operation, at most [`MAX_WINDOWS_PER_CAP`] per cap.
    pub windows: Vec<Window>,
    pub registered_at: f64,
    pub started_at: Option<f64>,
    pub finished_at: Option<f64>,
    /// Tokens (or steps) the walks cost the job against running uncapped (every walk),
    /// and probes since.
    pub cost: f64,
    /// Uncapped throughput the cost is priced against (the walk's top windows).
    pub top_throughput: f64,
    /// The curve of the walk before the one under way, reported until the new one ends.
    pub previous: Vec<Window>,
    /// Walks started again because the job's measurements left its curve.
    pub rewalks: u32,
    /// A walk asked for again (the job's measurements left its curve), to start at this
    /// time (agent seconds): the rate limit's earliest. The job's old windows were set
    /// aside when it was asked; until the walk ends the job is planned on the windows
    /// read since, never on its old phase's.
    pub rewalk_due: Option<f64>,
    /// Why the job's reported curve was not believed, when it was not (flagged to the
    /// admin in status and reports).
    pub implausible: Option<String>,
    design: Option<DesignWalk>,
    power_sum: f64,
    power_samples: u32,
    clock_sum: f64,
    clock_samples: u32,
    /// Token cost already booked up to this time (the walk books per window).
    booked_to: f64,
    stretch: Option<Stretch>,
    probe: Option<Probe>,
    /// Tokens the probes cost (part of `cost`).
    pub probe_cost: f64,
    /// In warm-up: what it waits for (status shows it; the agent logs it now and then).
    pub waiting: Option<String>,
    /// When the next announced grid event starts (agent seconds): a walk is compressed
    /// to end before it ([`Calibration::finish_by`]).
    deadline: Option<f64>,
    /// The lowest per-GPU cap an announced event's plan needs for the job: its walk
    /// reaches down to it ([`Calibration::reach_down_to`]).
    pub reach: Option<Watts>,
    /// A finished curve is being extended down to `reach`: the curve stays planned on
    /// while the walk reads the levels below it.
    extending: bool,
    /// Windows read since the agent last took them, as the bound judges them.
    judged: Vec<WindowRate>,
    /// Windows read before their window set had an uncapped rate to judge them against
    /// (a walk started under a grant, a new phase read under a cut): judged when the
    /// set's first top window is read, at most [`MAX_UNJUDGED_WINDOWS`], the newest.
    unjudged: Vec<Window>,
    /// A step of the job started after its curve was measured: a new step may be a new
    /// phase, so the curve is in question until a steady window read after it answers, or
    /// [`QUESTION_TIMEOUT_WINDOWS`] windows' time passes (see
    /// [`Calibration::question_curve`]). The controller plans the job meanwhile on what
    /// physics guarantees, not on the curve.
    pub curve_question: Option<CurveQuestion>,
    /// When the last question was answered or timed out (agent seconds). A step within
    /// `rewalk_after_s` of it is not questioned again (see [`Calibration::question_curve`]).
    last_answered: Option<f64>,
    /// Questions in a row that timed out unanswered: each doubles how long new steps go
    /// unquestioned after it (see [`Calibration::question_hold_off_s`]).
    unanswered_in_row: u32,
}

/// After a question timed out unanswered, new steps go unquestioned for at least this
/// many timeouts, doubled for each further one in a row (up to eight times that): a job
/// whose steps never run steadily for a window spends at most a fifth of its time in
/// question, then less and less.
pub const UNANSWERED_HOLD_OFF_TIMEOUTS: f64 = 4.0;

/// A curve in question since a new step (see [`Calibration::question_curve`]).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct CurveQuestion {
    /// When the first step since the curve was last confirmed started (agent seconds): the
    /// timeout runs from here, so steps that come faster than a window cannot keep the
    /// question open for ever.
    pub since: f64,
    /// When the latest step started: no window that answers begins before it.
    pub last_step: f64,
}

/// How long a curve stays in question without an answer, in windows of settle and hold:
/// a new step that never runs steadily at one cap for a window (it reports no progress,
/// its steps come faster than a window, its cap keeps moving) leaves the question to the
/// controller's drift check, which judges the job's draw and rate at its cap in force.
pub const QUESTION_TIMEOUT_WINDOWS: f64 = 6.0;

/// Most windows kept waiting for their set's uncapped rate (a day of 5 s windows is far
/// more than any cut holds a job below its top without a top window read).
pub const MAX_UNJUDGED_WINDOWS: usize = 256;

/// What the first window after a new step said of the job's curve
/// ([`Calibration::question_curve`]).
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum StepAnswer {
    /// The window ran as the curve says at its cap: the curve still holds.
    SameCurve,
    /// The window left the curve's band (its rate or its draw): a new phase. Its windows
    /// so far were set aside and it is walked again (see [`Calibration::rewalk`]).
    LeftCurve {
        cap: Watts,
        throughput_ratio: f64,
        power_ratio: Option<f64>,
    },
    /// No steady window came within [`QUESTION_TIMEOUT_WINDOWS`] windows' time: the
    /// question is dropped, and the controller's drift check judges the job again.
    Unanswered { open_s: f64 },
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
            windows: Vec::new(),
            registered_at: now,
            started_at: None,
            finished_at: None,
            cost: 0.0,
            top_throughput: 0.0,
            previous: Vec::new(),
            rewalks: 0,
            rewalk_due: None,
            implausible: None,
            design: None,
            power_sum: 0.0,
            power_samples: 0,
            clock_sum: 0.0,
            clock_samples: 0,
            booked_to: now,
            stretch: None,
            probe: None,
            probe_cost: 0.0,
            waiting: None,
            deadline: None,
            reach: None,
            extending: false,
            judged: Vec::new(),
            unjudged: Vec::new(),
            curve_question: None,
            last_answered: None,
            unanswered_in_row: 0,
        }
    }

    /// The windows read since the last call, each beside the same phase's uncapped rate,
    /// for the job's bound ([`powerflex_core::promise`]); the agent keeps the judgement in
    /// the job's accounting, which outlives the windows kept here.
    pub fn take_judged(&mut self) -> Vec<WindowRate> {
        std::mem::take(&mut self.judged)
    }

    /// `window` beside its phase's uncapped rate: the mean of this window set's windows
    /// at the grid's top cap (a re-walk starts a new set, so the top is of the same
    /// phase). None before the top is measured. A walk's window may read the calibration
    /// allowance past the bound; a window in operation (a probe included) may not.
    fn judged_window(&self, window: &Window) -> Option<WindowRate> {
        let top = self.settings.grid.first()?;
        let tops: Vec<&Window> = self
            .windows
            .iter()
            .filter(|w| (w.cap.0 - top.0).abs() < 0.5 && w.throughput > 0.0)
            .collect();
        if tops.is_empty() {
            return None;
        }
        let n = tops.len() as f64;
        let uncapped_rate = tops.iter().map(|w| w.throughput).sum::<f64>() / n;
        // The top's mean has its windows' noise over sqrt(n); the ratio carries both.
        let top_noise_sq = tops.iter().map(|w| w.relative_noise.powi(2)).sum::<f64>() / (n * n);
        Some(WindowRate {
            seconds: self.settings.hold_s,
            rate: window.throughput,
            uncapped_rate,
            relative_noise: (window.relative_noise.powi(2) + top_noise_sq).sqrt(),
            slack_pct: if window.learned {
                0.0
            } else {
                100.0 * self.settings.allowance
            },
        })
    }

    /// The design's knobs for this job: the site's, with the job's tier bound (plus the
    /// calibration allowance) as the most loss the walk may read or predict.
    pub fn design_params(&self) -> DesignParams {
        DesignParams {
            window_s: self.settings.hold_s,
            settle_s: self.settings.settle_s,
            budget_fraction: self.settings.budget_fraction,
            expected_cut: self.settings.expected_cut,
            max_loss: self
                .bound
                .map(|b| (b + self.settings.allowance).clamp(0.0, 1.0)),
            // The GPU's lowest cap: the walk steps only where the chord from there
            // shows its bound held, never into a knee its last levels cannot see.
            zero_progress_cap_w: Some(self.settings.min_cap.0),
            ..DesignParams::default()
        }
    }

    /// The cap the walk (or a probe) wants on the job's GPUs now, if any.
    pub fn cap(&self) -> Option<Watts> {
        match self.phase {
            Phase::Walking { cap, .. } => Some(cap),
            Phase::Done => self.probe.map(|p| p.cap),
            _ => None,
        }
    }

    pub fn is_active(&self) -> bool {
        matches!(self.phase, Phase::Warmup | Phase::Walking { .. })
    }

    /// Whether the job's curve is being measured anew: walked, or its measurements left
    /// its curve and the walk asked for is still to start. Its report says so, so that
    /// its draw and speed are not judged against a curve it no longer has.
    pub fn remeasuring(&self) -> bool {
        self.is_active() || self.rewalk_due.is_some()
    }

    /// Whether a probe holds the job below its grant now.
    pub fn probing(&self) -> bool {
        self.probe.is_some()
    }

    /// A step of the job started at `now`. A job with a measured curve (its walk done)
    /// may have started a new phase with it (a fine-tuning after a pre-training, an
    /// evaluation): until a steady window read after the step answers, its curve is in
    /// question and the job is reported so. A stretch of learning under way is cut at the
    /// step, so no window mixes the two. A step while the question is open moves only the
    /// start of the next window, not the timeout. A job still being walked, or with no
    /// curve, has nothing to question.
    ///
    /// A step within `rewalk_after_s` of the last answer (or timeout) is not questioned:
    /// a job is planned on what physics guarantees while in question, which for a tight
    /// tier is more than its measured floor, and a user who launched a stream of short
    /// steps would otherwise keep it there, on the other jobs' watts. A real new phase
    /// that soon is the controller's drift check's to find (its draw or its rate off the
    /// curve), as between steps.
    pub fn question_curve(&mut self, now: f64) {
        if self.phase != Phase::Done || self.rewalk_due.is_some() || self.windows.is_empty() {
            return;
        }
        let asked_lately = self
            .last_answered
            .is_some_and(|at| now < at + self.question_hold_off_s());
        if asked_lately && self.curve_question.is_none() {
            return;
        }
        let since = self.curve_question.map_or(now, |q| q.since);
        self.curve_question = Some(CurveQuestion {
            since,
            last_step: now,
        });
        self.stretch = None;
        self.probe = None;
    }

    /// How long after the last answer (or timeout) a new step is not questioned, s:
    /// `rewalk_after_s` after an answer; after questions that timed out, at least
    /// [`UNANSWERED_HOLD_OFF_TIMEOUTS`] timeouts, doubled for each further one in a row.
    pub fn question_hold_off_s(&self) -> f64 {
        if self.unanswered_in_row == 0 {
            return self.settings.rewalk_after_s;
        }
        let timeout = QUESTION_TIMEOUT_WINDOWS * (self.settings.settle_s + self.settings.hold_s);
        let doublings = self.unanswered_in_row.min(4) - 1;
        let backoff = UNANSWERED_HOLD_OFF_TIMEOUTS * timeout * f64::from(1u32 << doublings);
        self.settings.rewalk_after_s.max(backoff)
    }

    /// Whether a new step has put the job's curve in question and no window has answered.
    pub fn curve_in_question(&self) -> bool {
        self.curve_question.is_some()
    }
}

#[cfg(test)]
mod tests;
