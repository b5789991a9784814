//! Calibration designed for the decision it feeds: which caps to visit, how many
//! measurement windows to hold at each, and when to stop — priced in the job's tokens.
//!
//! What the allocator needs from a job is its curve over the caps a power cut may push it
//! to; what calibration costs is the throughput the job loses while it is held below its
//! uncapped cap. Those two set the design:
//! - **Uncapped windows are free** (the job runs uncapped anyway), so the top point is
//!   read with many windows: every other point is judged relative to it.
//! - **Walk down from the top, one cap of the grid at a time**, and stop once the job's
//!   power has fallen past the depth the site's expected cuts can reach (`depth_factor` ×
//!   the expected cut: the cheap jobs of a population are cut deeper than the average), at
//!   the end of the grid, or when the next cap cannot be paid for.
//! - **Windows per cap ∝ 1/√(cost of a window there)**: minimising the summed variance
//!   Σ σ²/nᵢ at a fixed token cost Σ nᵢ·cᵢ gives nᵢ ∝ 1/√cᵢ, so shallow caps (cheap, and
//!   where most decisions land) are read more often than deep ones. The cost of a cap
//!   not yet visited is predicted from the readings so far (the loss grows at least as
//!   fast as it did over the last step), and the design re-plans at each cap.
//! - **Cost is accounted** as token-seconds lost, `Σ time · (1 − T(cap)/T_max)`, settle
//!   time included, against the job's first-hour tokens `3600 s · T_max`; the default
//!   budget is 2 %.
//!
//! Pure: [`DesignWalk`] is a state machine fed one window's reading at a time, so the
//! same design runs in the node agent (its own measurement windows, on its clock) and
//! offline ([`run_design`], a closure drawing from a true curve). A tier bound
//! (`max_loss`) and a budget that holds the job below a level
//! ([`DesignWalk::hold_at_most`]) stop or reroute the walk.

use crate::point::OperatingPoint;
use crate::units::Watts;
use crate::workload::{chord_cap_for_loss, chord_loss};

/// The knobs of the design. Defaults are the ones `powerflexctl evaluate` and the agent use.
#[derive(Debug, Clone, PartialEq)]
pub struct DesignParams {
    /// Length of one measurement window, s.
    pub window_s: f64,
    /// Time after a cap change before windows count, s (it costs tokens, reads nothing).
    pub settle_s: f64,
    /// Most token cost the design may spend, as a fraction of the job's first-hour tokens.
    pub budget_fraction: f64,
    /// The deepest site-wide cut the site expects, a fraction of Σ P_max (site config
    /// `facility.expected_cut_pct`).
    pub expected_cut: f64,
    /// The walk goes down until the job's power has fallen by `depth_factor × expected_cut`.
    pub depth_factor: f64,
    /// Windows read at the uncapped cap (free).
    pub top_windows: usize,
    /// At most this many windows at any capped level.
    pub max_windows_per_cap: usize,
    /// At most this many capped levels down to the depth: on a fine grid (H100 in 5 W
    /// steps) every cap would cost a settle and a window; levels are then spread evenly
    /// over the depth and the allocator interpolates between them.
    pub max_levels: usize,
    /// The most loss (1 − T/T_max) the walk may read or predict at a level: the job's
    /// tier bound plus the site's calibration allowance. `None` = no bound (offline).
    pub max_loss: Option<f64>,
    /// With `max_loss`: the cap at or below which the job may make no progress at all
    /// (the GPU's lowest cap), W. A level is then entered only where the chord from it
    /// to the lowest level read shows the loss within `max_loss`: throughput is concave
    /// in the cap above it, so the chord is a lower bound on the throughput there, and
    /// the walk never steps into a knee it cannot see (the extrapolated loss per watt,
    /// the design's own prediction, is a guess that a knee runs past). `None`: the
    /// prediction alone (offline evaluation, which has no bound to keep).
    pub zero_progress_cap_w: Option<f64>,
}

impl Default for DesignParams {
    fn default() -> Self {
        DesignParams {
            window_s: 30.0,
            settle_s: 10.0,
            budget_fraction: 0.02,
            expected_cut: 0.3,
            depth_factor: 2.0,
            top_windows: 8,
            max_windows_per_cap: 12,
            max_levels: 8,
            max_loss: None,
            zero_progress_cap_w: None,
        }
    }
}

/// Why a design cannot run.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum DesignError {
    #[error("calibration window must be a positive number of seconds (got {0})")]
    BadWindow(f64),
    #[error("calibration settle time must be a non-negative number of seconds (got {0})")]
    BadSettle(f64),
    #[error("calibration budget must be a fraction in (0, 0.5] of first-hour tokens, e.g. 0.02 (got {0})")]
    BadBudget(f64),
    #[error("expected cut must be a fraction in (0, 1), e.g. 0.3 (got {0})")]
    BadExpectedCut(f64),
    #[error("calibration depth factor must be at least 1 (got {0})")]
    BadDepth(f64),
    #[error("calibration needs at least one window at the top and per cap")]
    NoWindows,
    #[error("calibration's most loss must be a fraction in [0, 1], e.g. 0.15 (got {0})")]
    BadMaxLoss(f64),
    #[error("calibration needs the job's cap grid, highest cap first")]
    EmptyGrid,
}

impl DesignParams {
    /// Checks every knob; errors name the accepted range.
    pub fn validate(&self) -> Result<(), DesignError> {
        if !(self.window_s.is_finite() && self.window_s > 0.0) {
            return Err(DesignError::BadWindow(self.window_s));
        }
        if !(self.settle_s.is_finite() && self.settle_s >= 0.0) {
            return Err(DesignError::BadSettle(self.settle_s));
        }
        if !(self.budget_fraction.is_finite()
            && self.budget_fraction > 0.0
            && self.budget_fraction <= 0.5)
        {
            return Err(DesignError::BadBudget(self.budget_fraction));
        }
        if !(self.expected_cut.is_finite() && self.expected_cut > 0.0 && self.expected_cut < 1.0) {
            return Err(DesignError::BadExpectedCut(self.expected_cut));
        }
        if !(self.depth_factor.is_finite() && self.depth_factor >= 1.0) {
            return Err(DesignError::BadDepth(self.depth_factor));
        }
        if let Some(m) = self.max_loss {
            if !(m.is_finite() && (0.0..=1.0).contains(&m)) {
                return Err(DesignError::BadMaxLoss(m));
            }
        }
        if self.top_windows == 0 || self.max_windows_per_cap == 0 || self.max_levels == 0 {
            return Err(DesignError::NoWindows);
        }
        Ok(())
    }
}

/// One level the design held.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Level {
    pub cap_w: Watts,
    pub windows: usize,
    /// Time held there, settle included, s.
    pub seconds: f64,
}

/// What a design did: every window's reading, the levels, and what it expected to cost.
#[derive(Debug, Clone, PartialEq)]
pub struct DesignOutcome {
    /// One reading per window, in the order taken.
    pub readings: Vec<OperatingPoint>,
    /// Levels held, the uncapped one first.
    pub levels: Vec<Level>,
    /// Token cost as the design itself estimated it from its readings, fraction of
    /// first-hour tokens (the evaluation also prices it on the true curve).
    pub estimated_cost_fraction: f64,
}

/// First hour of a job, s: the denominator of the cost budget.
pub const FIRST_HOUR_S: f64 = 3600.0;

/// Runs the design over `grid` (a job's allowed caps, highest first: the uncapped cap,
/// then every cap the site's step allows, descending). `measure(cap)` holds the job at
/// `cap` for one window and returns what was read. The offline driver of [`DesignWalk`].
pub fn run_design(
    grid: &[Watts],
    params: &DesignParams,
    measure: &mut dyn FnMut(Watts) -> OperatingPoint,
) -> Result<DesignOutcome, DesignError> {
    let mut walk = DesignWalk::new(grid, params)?;
    while let Some(cap) = walk.current() {
        let reading = measure(cap);
        walk.record(reading);
    }
    Ok(walk.outcome())
}

/// The design as a state machine, one window at a time: [`DesignWalk::current`] says
/// which cap the next window is read at (`None` once the design is done) and
/// [`DesignWalk::record`] takes that window's reading. The node agent drives it with its
/// own measurement windows; [`run_design`] drives it with a closure.
#[derive(Debug, Clone, PartialEq)]
pub struct DesignWalk {
    params: DesignParams,
    top: Watts,
    /// The grid's caps below the top, as given (the levels are picked from them).
    grid_below: Vec<Watts>,
    /// Capped levels to visit, descending.
    caps: Vec<Watts>,
    readings: Vec<OperatingPoint>,
    levels: Vec<Level>,
    /// (cap, loss) of the levels read so far, the top one first.
    seen: Vec<(f64, f64)>,
    p_top: f64,
    t_top: f64,
    /// Token budget in T_max-seconds.
    budget_s: f64,
    depth: f64,
    spent: f64,
    /// No window above this cap any more (the budget holds the job below it).
    ceiling: Option<Watts>,
    /// Walk time left before a deadline (an announced grid event's start), s: the design
    /// is compressed to end by then (see [`DesignWalk::finish_within`]). None: no deadline.
    time_left_s: Option<f64>,
    /// A level read before this design (cap W, loss against the top), where the chord of
    /// [`DesignParams::zero_progress_cap_w`] may start (see [`DesignWalk::chord_from`]).
    read_before: Option<(f64, f64)>,
    stage: Stage,
}

#[derive(Debug, Clone, PartialEq)]
enum Stage {
    /// Reading the uncapped windows.
    Top,
    /// Reading windows at `caps[index]`.
    Level {
        index: usize,
        target: usize,
        windows: usize,
        start: usize,
        power: f64,
        loss: f64,
    },
    /// Re-reading level `levels[order[at]]` for `left` more windows.
    TopUp {
        order: Vec<usize>,
        at: usize,
        left: usize,
        loss: f64,
        spread: f64,
        /// Readings before this level's top-up windows.
        start: usize,
    },
    Done,
}

impl DesignWalk {
    /// A design over `grid` (highest cap first; see [`run_design`]).
    pub fn new(grid: &[Watts], params: &DesignParams) -> Result<DesignWalk, DesignError> {
        params.validate()?;
        let (&top, rest) = grid.split_first().ok_or(DesignError::EmptyGrid)?;
        let depth = (params.depth_factor * params.expected_cut).min(0.95);
        Ok(DesignWalk {
            params: params.clone(),
            top,
            grid_below: rest.to_vec(),
            caps: levels_to_visit(rest, top, depth, params.max_levels),
            readings: Vec::new(),
            levels: Vec::new(),
            seen: vec![(top.0, 0.0)],
            p_top: 0.0,
            t_top: 0.0,
            // The design prices its spending with its own noisy readings; it keeps
            // COST_RESERVE of the budget back so that the true cost stays inside it.
            budget_s: (1.0 - COST_RESERVE) * params.budget_fraction * FIRST_HOUR_S,
            depth,
            spent: 0.0,
            ceiling: None,
            time_left_s: None,
            read_before: None,
            stage: Stage::Top,
        })
    }

    /// The cap the next window is read at; `None` once the design is done.
    pub fn current(&self) -> Option<Watts> {
        match &self.stage {
            Stage::Top => Some(self.top),
            Stage::Level { index, .. } => Some(self.caps[*index]),
            Stage::TopUp { order, at, .. } => Some(self.levels[order[*at]].cap_w),
            Stage::Done => None,
        }
    }

    pub fn is_done(&self) -> bool {
        self.stage == Stage::Done
    }

    /// Every window read so far, in order.
    pub fn readings(&self) -> &[OperatingPoint] {
        &self.readings
    }

    /// The cap of the design's top level: the grid's first (uncapped) cap, or the
    /// ceiling a design started under.
    pub fn top_cap(&self) -> Watts {
        self.top
    }

    /// The uncapped throughput as read (0 before the top windows are in).
    pub fn top_throughput(&self) -> f64 {
        self.t_top
    }

    /// What the design has done so far (all of it once done).
    pub fn outcome(&self) -> DesignOutcome {
        DesignOutcome {
            readings: self.readings.clone(),
            levels: self.levels.clone(),
            estimated_cost_fraction: self.spent / FIRST_HOUR_S,
        }
    }

    /// The walk must end within `seconds` of walk time from now: an announced grid event
    /// starts then, and the allocation wants the job's curve before it. The rest of the
    /// design is compressed to fit, never below one window per level: fewer uncapped
    /// windows (at least one), fewer windows per capped level, no top-up; when even one
    /// window per level does not fit, fewer levels, spread down to the deepest one the
    /// design would reach (the depth the site's cuts may push the job to is what the
    /// event needs). No window starts after the deadline: what is not read by then is
    /// left out. A later call replaces the deadline. A design that fits is unchanged.
    pub fn finish_within(&mut self, seconds: f64) {
        self.time_left_s = Some(if seconds.is_finite() {
            seconds.max(0.0)
        } else {
            0.0
        });
        match &mut self.stage {
            Stage::Top => {
                let no_window = self.time_left_s.unwrap_or(0.0) < self.params.window_s;
                if self.readings.is_empty() && no_window {
                    // Not one uncapped window before the deadline: no curve to make.
                    self.stage = Stage::Done;
                } else if !self.readings.is_empty() && self.readings.len() >= self.top_target() {
                    self.end_top();
                }
            }
            Stage::Level {
                index,
                target,
                windows,
                ..
            } => {
                // This level and the ones still planned below it share what is left
                // (this level's settle is paid).
                let left = self.time_left_s.unwrap_or(0.0);
                let top = self.top.0;
                let n = self.caps[*index..]
                    .iter()
                    .position(|c| c.0 <= (1.0 - self.depth) * top)
                    .map_or(self.caps.len() - *index, |j| j + 1);
                let later_settles = (n - 1) as f64 * self.params.settle_s;
                let each = ((left - later_settles) / (n as f64 * self.params.window_s)).floor();
                let fit_here = (left / self.params.window_s).floor() as usize;
                *target = (*target)
                    .min((each.max(0.0) as usize).max(1))
                    .min(*windows + fit_here);
                if *windows >= *target {
                    self.end_level();
                }
            }
            Stage::TopUp { left, .. } => {
                let fit = (self.time_left_s.unwrap_or(0.0) / self.params.window_s).floor() as usize;
                if fit < *left {
                    *left = fit;
                    if fit == 0 {
                        self.next_top_up();
                    }
                }
            }
            Stage::Done => {}
        }
    }

    /// The level read now is known well enough (the caller judged its windows' standard
    /// error against the precision it needs): the design moves on as if the level's
    /// planned windows were read. The uncapped level needs two windows at least (every
    /// other level is judged against it), a capped level one; a top-up level may be left
    /// before its first window (it was known well enough before the top-up came to it).
    pub fn enough_here(&mut self) {
        match &self.stage {
            Stage::Top if self.readings.len() >= 2 => self.end_top(),
            Stage::Level { windows, .. } if *windows >= 1 => self.end_level(),
            Stage::TopUp { .. } => self.next_top_up(),
            _ => {}
        }
    }

    /// Whether the design is spending what its budget left on more windows at levels
    /// already read (the top-up), rather than reading a level the first time.
    pub fn topping_up(&self) -> bool {
        matches!(self.stage, Stage::TopUp { .. })
    }

    /// The walk must reach down to `cap` (the lowest cap an announced event's plan needs):
    /// its depth grows to it where it did not reach it (never shrinks), and the levels
    /// still to visit are picked again down to it. The tier's bound and the token budget
    /// still stop the walk where they did; a level already read stays read.
    pub fn reach_down_to(&mut self, cap: Watts) {
        if self.top.0 <= 0.0 || !cap.0.is_finite() {
            return;
        }
        let depth = (1.0 - cap.0 / self.top.0).min(0.95);
        if depth <= self.depth {
            return;
        }
        self.depth = depth;
        match self.stage {
            Stage::Top => {
                self.caps =
                    levels_to_visit(&self.grid_below, self.top, depth, self.params.max_levels);
            }
            Stage::Level { index, .. } => {
                let at = self.caps[index];
                let below: Vec<Watts> = self
                    .grid_below
                    .iter()
                    .copied()
                    .filter(|c| c.0 < at.0 - 0.5)
                    .collect();
                let left = self.params.max_levels.saturating_sub(index + 1).max(1);
                let mut tail = levels_to_visit(&below, self.top, depth, left);
                tail.retain(|c| c.0 < at.0 - 0.5);
                self.caps.truncate(index + 1);
                self.caps.extend(tail);
            }
            Stage::TopUp { .. } | Stage::Done => {}
        }
    }

    /// Uncapped windows to read: all of them without a deadline; under one, what leaves
    /// one window and a settle for each capped level still planned (at least one).
    fn top_target(&self) -> usize {
        let Some(left) = self.time_left_s else {
            return self.params.top_windows;
        };
        let top = self.top.0;
        let levels = self
            .caps
            .iter()
            .position(|c| c.0 <= (1.0 - self.depth) * top)
            .map_or(self.caps.len(), |j| j + 1);
        let for_levels = levels as f64 * (self.params.settle_s + self.params.window_s);
        let spare = ((left - for_levels) / self.params.window_s)
            .floor()
            .max(0.0) as usize;
        (self.readings.len() + spare).clamp(1, self.params.top_windows)
    }

    /// The uncapped windows are in: the top point is set and the walk goes down.
    fn end_top(&mut self) {
        let (p, t) = mean(&self.readings);
        self.p_top = p;
        self.t_top = t;
        let windows = self.readings.len();
        self.levels.push(Level {
            cap_w: self.top,
            windows,
            seconds: windows as f64 * self.params.window_s,
        });
        self.enter_level(0);
    }

    /// The budget now holds the job at or below `cap`: no further window above it. A
    /// level above it ends with the windows it has (a partial window is the caller's to
    /// drop) and the walk goes on below it. The top windows cannot be read under a
    /// ceiling below the top; the caller starts a new design from the ceiling instead.
    pub fn hold_at_most(&mut self, cap: Watts) {
        self.ceiling = Some(self.ceiling.map_or(cap, |c| Watts(c.0.min(cap.0))));
        match &self.stage {
            Stage::Level { index, .. } if self.caps[*index].0 > cap.0 + 0.5 => self.end_level(),
            Stage::TopUp { order, at, .. } if self.levels[order[*at]].cap_w.0 > cap.0 + 0.5 => {
                self.next_top_up()
            }
            _ => {}
        }
    }

    /// Whether a cap is allowed under the ceiling.
    fn allowed(&self, cap: Watts) -> bool {
        self.ceiling.is_none_or(|c| cap.0 <= c.0 + 0.5)
    }

    /// Takes the reading of the window at [`DesignWalk::current`].
    pub fn record(&mut self, reading: OperatingPoint) {
        self.readings.push(reading);
        if let Some(left) = &mut self.time_left_s {
            *left -= self.params.window_s;
        }
        match &mut self.stage {
            Stage::Top => {
                if self.readings.len() >= self.top_target() {
                    self.end_top();
                }
            }
            Stage::Level {
                target,
                windows,
                start,
                power,
                loss,
                ..
            } => {
                *windows += 1;
                let (mp, mt) = mean(&self.readings[*start..]);
                *power = mp;
                *loss = if self.t_top > 0.0 {
                    (1.0 - mt / self.t_top).max(0.0)
                } else {
                    0.0
                };
                let next_cost =
                    *loss * (self.params.settle_s + (*windows + 1) as f64 * self.params.window_s);
                let over_bound = self.params.max_loss.is_some_and(|m| *loss > m);
                let out_of_time = self
                    .time_left_s
                    .is_some_and(|left| left < self.params.window_s);
                if *windows >= *target
                    || self.spent + next_cost > self.budget_s
                    || over_bound
                    || out_of_time
                {
                    self.end_level();
                }
            }
            Stage::TopUp { left, .. } => {
                *left -= 1;
                if *left == 0 {
                    self.end_top_up_level();
                    self.next_top_up();
                }
            }
            Stage::Done => {}
        }
    }

    /// Plans and enters capped level `index` (or ends the walk there).
    fn enter_level(&mut self, mut index: usize) {
        while index < self.caps.len() && !self.allowed(self.caps[index]) {
            index += 1;
        }
        if index >= self.caps.len() {
            return self.start_top_up();
        }
        // A step the physics cannot show within the bound is shortened to the lowest cap
        // it can (an intermediate level), or the walk ends where it is.
        if !self.shorten_to_provable(index) {
            return self.start_top_up();
        }
        let top = self.top.0;
        // The caps still to visit, down to the one the depth is predicted to reach, each
        // with its predicted loss; plan windows for all of them, spend on this one.
        let deepest = self.caps[index..]
            .iter()
            .position(|c| c.0 <= (1.0 - self.depth) * top)
            .map_or(self.caps.len(), |j| index + j + 1);
        let planned: Vec<f64> = self.caps[index..deepest]
            .iter()
            .map(|c| predicted_loss(&self.seen, c.0, top))
            .collect();
        let unit: Vec<f64> = planned.iter().map(|l| l.max(MIN_LOSS)).collect();
        let settle_cost: f64 = planned.iter().map(|l| l * self.params.settle_s).sum();
        let remaining = self.budget_s - self.spent;
        let sqrt_sum: f64 = unit.iter().map(|u| u.sqrt()).sum();
        let k = (remaining - settle_cost).max(0.0) / (self.params.window_s * sqrt_sum);
        let target =
            ((k / unit[0].sqrt()).floor() as usize).clamp(1, self.params.max_windows_per_cap);
        // This cap must still fit: settle plus one window at the predicted loss (the
        // budget's reserve covers a prediction that falls short); and a tier's bound
        // must not be predicted to break there.
        let fits = planned[0] * (self.params.settle_s + self.params.window_s) <= remaining;
        let within = self.within_bound(self.caps[index], planned[0]);
        if !(fits && within) {
            return self.start_top_up();
        }
        let (mut target, mut loss) = (target, planned[0]);
        if let Some(left) = self.time_left_s {
            let per_level = self.params.settle_s + self.params.window_s;
            let n = deepest - index;
            if left < per_level {
                return self.start_top_up();
            }
            let each = ((left - n as f64 * self.params.settle_s)
                / (n as f64 * self.params.window_s))
                .floor();
            if each >= 1.0 {
                target = target.min(each as usize);
            } else {
                // Not one window per level: fewer levels, spread evenly down to the
                // deepest planned one.
                let m = ((left / per_level).floor() as usize).clamp(1, n);
                let picked: Vec<Watts> = (1..=m)
                    .map(|k| self.caps[index + (k * n).div_ceil(m) - 1])
                    .collect();
                self.caps.splice(index..deepest, picked);
                target = 1;
                // The first level kept may be deeper than the one priced above, and
                // deeper than the physics shows within the bound: then shortened.
                if !self.shorten_to_provable(index) {
                    return self.start_top_up();
                }
                loss = predicted_loss(&self.seen, self.caps[index].0, top);
                if !self.within_bound(self.caps[index], loss) {
                    return self.start_top_up();
                }
            }
            self.time_left_s = Some(left - self.params.settle_s);
        }
        self.stage = Stage::Level {
            index,
            target,
            windows: 0,
            start: self.readings.len(),
            power: self.p_top,
            loss,
        };
    }

    /// A level read before this design (an earlier walk's lowest, `cap` losing `loss`
    /// against the same top): an extension of a finished walk proves its steps from
    /// there, not from the top, which would shorten its first step back above the
    /// levels already read.
    pub fn chord_from(&mut self, cap: Watts, loss: f64) {
        if cap.0.is_finite() && cap.0 < self.top.0 && loss.is_finite() {
            self.read_before = Some((cap.0, loss.clamp(0.0, 1.0)));
        }
    }

    /// Where the chord of the zero-progress cap starts: the lowest level read (by this
    /// design or before it), else the top.
    fn chord_start(&self) -> (f64, f64) {
        self.seen
            .iter()
            .copied()
            .chain(self.read_before)
            .min_by(|a, b| a.0.total_cmp(&b.0))
            .unwrap_or((self.top.0, 0.0))
    }

    /// The most loss `cap` may cost on the physics alone (see
    /// [`DesignParams::zero_progress_cap_w`]): one minus the chord from the zero-progress
    /// cap to the lowest level read (the top, before any). 0 without that cap.
    fn provable_loss(&self, cap: f64) -> f64 {
        let Some(zero) = self.params.zero_progress_cap_w else {
            return 0.0;
        };
        let (c, l) = self.chord_start();
        chord_loss(cap, zero, c, l)
    }

    /// Whether the walk may read `cap`, predicted to lose `predicted`: with the
    /// zero-progress cap, where the physics shows the loss within `max_loss` (the chord is
    /// a bound; the prediction, whose prior assumes a PFI of 2 everywhere, would stop a
    /// flat job's walk at the first step its prior prices past a flex1 bound); without
    /// it, where the prediction does.
    fn within_bound(&self, cap: Watts, predicted: f64) -> bool {
        match (self.params.max_loss, self.params.zero_progress_cap_w) {
            (None, _) => true,
            (Some(m), Some(_)) => self.provable_loss(cap.0) <= m + PROVABLE_SLACK,
            (Some(m), None) => predicted <= m,
        }
    }

    /// The cap the walk may step to on its way to `cap`: `cap` itself where
    /// [`DesignWalk::provable_loss`] keeps it within `max_loss` (or nothing bounds the
    /// walk), else the lowest whole watt where it does, when that is a step worth a
    /// level (at least [`MIN_PROVABLE_STEP`] of the range below the lowest level read);
    /// `None` when no such step is left.
    fn provable_step(&self, cap: Watts) -> Option<Watts> {
        let (Some(max_loss), Some(zero)) = (self.params.max_loss, self.params.zero_progress_cap_w)
        else {
            return Some(cap);
        };
        if self.provable_loss(cap.0) <= max_loss + PROVABLE_SLACK {
            return Some(cap);
        }
        let (c, l) = self.chord_start();
        if c <= zero || l >= max_loss {
            return None;
        }
        // A whole watt above where the chord reaches `max_loss` keeps the loss within.
        let step = chord_cap_for_loss(max_loss, zero, c, l).ceil();
        (step <= c - MIN_PROVABLE_STEP * (c - zero) && step > cap.0).then_some(Watts(step))
    }

    /// Makes `caps[index]` a step the physics shows within the bound: kept where it is
    /// one, else the shortened step put before it ([`DesignWalk::insert_step`]). False
    /// when no such step is left, or the only one lies above the ceiling (nothing under
    /// the ceiling is provable then): the walk ends.
    fn shorten_to_provable(&mut self, index: usize) -> bool {
        match self.provable_step(self.caps[index]) {
            Some(step) if !self.allowed(step) => false,
            Some(step) if step.0 > self.caps[index].0 + 0.5 => {
                self.insert_step(index, step);
                true
            }
            Some(_) => true,
            None => false,
        }
    }

    /// Puts the shortened step `step` at `caps[index]`, dropping the planned levels just
    /// below it that lie closer to it than a level is worth (they would read the same
    /// rate again at a settle's cost).
    fn insert_step(&mut self, index: usize, step: Watts) {
        let zero = self.params.zero_progress_cap_w.unwrap_or(0.0);
        let close = step.0 - MIN_PROVABLE_STEP * (step.0 - zero).max(0.0);
        while self.caps.get(index).is_some_and(|c| c.0 > close) && index + 1 < self.caps.len() {
            self.caps.remove(index);
        }
        self.caps.insert(index, step);
    }

    /// Closes the level under way and moves on (or ends the walk at the depth).
    fn end_level(&mut self) {
        let Stage::Level {
            index,
            windows,
            power,
            loss,
            ..
        } = self.stage
        else {
            return;
        };
        if windows == 0 {
            return self.enter_level(index + 1);
        }
        let cap = self.caps[index];
        let seconds = self.params.settle_s + windows as f64 * self.params.window_s;
        self.spent += loss * seconds;
        self.levels.push(Level {
            cap_w: cap,
            windows,
            seconds,
        });
        self.seen.push((cap.0, loss));
        let stop_power = (1.0 - self.depth) * self.p_top;
        let over_bound = self.params.max_loss.is_some_and(|m| loss > m);
        if power <= stop_power || over_bound {
            self.start_top_up();
        } else {
            self.enter_level(index + 1);
        }
    }

    /// Top-up: what the walk left of the budget buys more windows where they are
    /// cheapest — the shallow levels, where most decisions land and where differences
    /// between caps are small next to the noise. Each revisit pays a settle again.
    fn start_top_up(&mut self) {
        let mut order: Vec<usize> = (1..self.levels.len()).collect();
        order.sort_by(|&a, &b| self.seen[a].1.total_cmp(&self.seen[b].1));
        self.stage = Stage::TopUp {
            order,
            at: 0,
            left: 0,
            loss: 0.0,
            spread: relative_spread(&self.readings),
            start: self.readings.len(),
        };
        self.plan_top_up();
    }

    /// Plans the top-up level at the current position, skipping levels that buy nothing.
    fn plan_top_up(&mut self) {
        loop {
            let Stage::TopUp {
                order, at, spread, ..
            } = &self.stage
            else {
                return;
            };
            let (at, spread) = (*at, *spread);
            let Some(&i) = order.get(at) else {
                self.stage = Stage::Done;
                return;
            };
            // A level's loss is a difference of two noisy means; the top-up spends the
            // last of the budget, so it prices each level two standard errors above
            // its reading.
            let n = self.levels[i].windows.max(1) as f64;
            let margin = 2.0 * spread * (1.0 / n + 1.0 / self.params.top_windows as f64).sqrt();
            let (cap, loss) = (self.levels[i].cap_w, self.seen[i].1.max(MIN_LOSS) + margin);
            let room = self
                .params
                .max_windows_per_cap
                .saturating_sub(self.levels[i].windows);
            let affordable =
                ((self.budget_s - self.spent) / loss - self.params.settle_s) / self.params.window_s;
            let mut extra = room.min(affordable.max(0.0).floor() as usize);
            if let Some(time) = self.time_left_s {
                // Under a deadline a revisit pays its settle out of the time left too.
                let fit = ((time - self.params.settle_s) / self.params.window_s).floor();
                extra = extra.min(fit.max(0.0) as usize);
            }
            let over_bound = self.params.max_loss.is_some_and(|m| self.seen[i].1 > m);
            let readings = self.readings.len();
            if let Stage::TopUp {
                at: a,
                left,
                loss: l,
                start,
                ..
            } = &mut self.stage
            {
                if extra == 0 || over_bound || !self.ceiling.is_none_or(|c| cap.0 <= c.0 + 0.5) {
                    *a += 1;
                    continue;
                }
                *left = extra;
                *l = loss;
                *start = readings;
            }
            if let Some(time) = &mut self.time_left_s {
                *time -= self.params.settle_s;
            }
            return;
        }
    }

    /// Books the top-up level just read (or cut short).
    fn end_top_up_level(&mut self) {
        let Stage::TopUp {
            ref order,
            at,
            loss,
            start,
            ..
        } = self.stage
        else {
            return;
        };
        let i = order[at];
        let read = self.readings.len() - start;
        if read == 0 {
            return;
        }
        let seconds = self.params.settle_s + read as f64 * self.params.window_s;
        self.spent += loss * seconds;
        self.levels[i].windows += read;
        self.levels[i].seconds += seconds;
    }

    /// Moves to the next top-up level (booking the one under way when it was cut short).
    fn next_top_up(&mut self) {
        if let Stage::TopUp { left, .. } = &self.stage {
            if *left > 0 {
                self.end_top_up_level();
            }
        }
        if let Stage::TopUp { at, left, .. } = &mut self.stage {
            *at += 1;
            *left = 0;
        }
        self.plan_top_up();
    }
}

fn mean(xs: &[OperatingPoint]) -> (f64, f64) {
    let n = xs.len().max(1) as f64;
    (
        xs.iter().map(|p| p.power_w.0).sum::<f64>() / n,
        xs.iter().map(|p| p.throughput).sum::<f64>() / n,
    )
}

/// The capped levels of `grid` (below `top`, descending) the walk will visit: all of
/// them when at most `max_levels` reach the depth (`depth` × `top` below the top cap);
/// otherwise `max_levels` caps spread evenly from the top to the first cap at that depth,
/// then the grid's deeper caps at the same spacing.
fn levels_to_visit(grid: &[Watts], top: Watts, depth: f64, max_levels: usize) -> Vec<Watts> {
    let mut caps: Vec<Watts> = grid.iter().copied().filter(|c| c.0 < top.0).collect();
    caps.sort_by(|a, b| b.0.total_cmp(&a.0));
    caps.dedup();
    let reach = caps
        .iter()
        .position(|c| c.0 <= (1.0 - depth) * top.0)
        .map_or(caps.len(), |i| i + 1);
    if reach <= max_levels {
        return caps;
    }
    // Every `stride`-th cap, ending exactly at the depth's cap.
    let stride = reach as f64 / max_levels as f64;
    let mut picked: Vec<Watts> = (1..=max_levels)
        .map(|k| caps[((k as f64 * stride).round() as usize).clamp(1, reach) - 1])
        .collect();
    let step = stride.round().max(1.0) as usize;
    let mut i = reach - 1 + step;
    while i < caps.len() {
        picked.push(caps[i]);
        i += step;
    }
    picked.dedup();
    picked
}

/// Pooled relative standard deviation of the throughput of windows at the same cap.
fn relative_spread(readings: &[OperatingPoint]) -> f64 {
    let mut caps: Vec<f64> = readings.iter().map(|r| r.cap_w.0).collect();
    caps.sort_by(f64::total_cmp);
    caps.dedup();
    let (mut ss, mut dof) = (0.0, 0.0);
    for c in caps {
        let at: Vec<f64> = readings
            .iter()
            .filter(|r| r.cap_w.0 == c)
            .map(|r| r.throughput)
            .collect();
        if at.len() < 2 {
            continue;
        }
        let mean = at.iter().sum::<f64>() / at.len() as f64;
        ss += at.iter().map(|t| ((t - mean) / mean).powi(2)).sum::<f64>();
        dof += (at.len() - 1) as f64;
    }
    if dof > 0.0 {
        (ss / dof).sqrt()
    } else {
        0.0
    }
}

/// Share of the token budget the design does not plan to spend: its cost estimate rests
/// on readings with a percent or so of noise each, off by up to ~10 % of the total (~15 % at 5 % noise) on
/// the dev curves at 1 % noise.
const COST_RESERVE: f64 = 0.2;

/// Smallest step down a level shortened to what the physics shows within the bound is
/// worth, as a share of the range from the zero-progress cap to the lowest level read:
/// as the loss read nears the bound, the provable steps shrink towards nothing, and a
/// walk of ever-closer levels would spend its budget measuring noise.
const MIN_PROVABLE_STEP: f64 = 0.1;

/// Rounding the chord's loss may carry past the bound at a step set exactly on it.
const PROVABLE_SLACK: f64 = 1e-9;

/// Smallest loss a window is priced at: near the top a window costs almost nothing, and
/// without a floor the 1/√cost rule would spend everything there.
const MIN_LOSS: f64 = 0.01;

/// The loss (1 − T/T_max) expected at `cap` from the levels read so far: the last step's
/// loss per watt continued, never less than the last loss nor than a prior of half the
/// cap's fractional reduction (a job with PFI 2, near the paper's most inelastic).
fn predicted_loss(seen: &[(f64, f64)], cap: f64, top: f64) -> f64 {
    let prior = 0.5 * (1.0 - cap / top).max(0.0);
    match seen {
        [.., (c1, l1), (c2, l2)] => {
            let per_w = if c1 > c2 { (l2 - l1) / (c1 - c2) } else { 0.0 };
            let guess = l2 + per_w.max(0.0) * (c2 - cap).max(0.0);
            // A flat top says nothing about where the knee is: never below the prior.
            guess.max(*l2).max(prior).min(1.0)
        }
        _ => prior,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn grid(top: f64, low: f64, step: f64) -> Vec<Watts> {
        let mut caps = vec![Watts(top)];
        let mut c = top - step;
        while c >= low - 1e-9 {
            caps.push(Watts(c));
            c -= step;
        }
        caps
    }

    /// A job losing throughput linearly below 80 % of its top cap, power = cap.
    fn truth(cap: Watts) -> OperatingPoint {
        let t = (cap.0 / 250.0 / 0.8).min(1.0) * 100.0;
        OperatingPoint {
            cap_w: cap,
            power_w: Watts(cap.0.min(230.0)),
            throughput: t,
        }
    }

    fn cost_on_truth(outcome: &DesignOutcome) -> f64 {
        outcome
            .levels
            .iter()
            .map(|l| (1.0 - truth(l.cap_w).throughput / 100.0) * l.seconds)
            .sum::<f64>()
            / FIRST_HOUR_S
    }

    #[test]
    fn stays_within_the_token_budget_and_reads_shallow_caps_more() {
        let params = DesignParams::default();
        let out = run_design(&grid(250.0, 100.0, 25.0), &params, &mut truth).expect("design");
        let cost = cost_on_truth(&out);
        assert!(cost <= params.budget_fraction + 1e-9, "cost {cost}");
        assert!(
            out.estimated_cost_fraction >= cost - 1e-9,
            "the design never prices below the truth on noise-free readings"
        );
        let windows: Vec<usize> = out.levels.iter().skip(1).map(|l| l.windows).collect();
        let deepest = *windows.last().expect("capped levels");
        assert!(windows[0] > deepest, "cheap levels read more: {windows:?}");
        assert!(out.levels.len() >= 4, "{:?}", out.levels);
    }

    #[test]
    fn stops_at_the_depth_the_expected_cuts_reach() {
        let params = DesignParams {
            expected_cut: 0.1,
            ..Default::default()
        };
        let out = run_design(&grid(250.0, 100.0, 25.0), &params, &mut truth).expect("design");
        // 20 % below 230 W is 184 W: the walk stops at the first cap at or below it.
        let lowest = out.levels.last().expect("levels").cap_w;
        assert_eq!(lowest, Watts(175.0), "{:?}", out.levels);
    }

    /// With a bound and the cap where progress may stop, the walk never reads a level
    /// past the bound on a concave curve, knee included: each step is one the chord from
    /// that cap shows within it (shortened where the grid's next cap is not). Without
    /// the anchor the design steps on its own prediction, and on a coarse grid reads
    /// past the bound first.
    #[test]
    fn a_bounded_walk_reads_no_level_past_its_bound() {
        // A knee at 200 W: full speed above, 60 % at 150 W, 20 % at the 100 W floor.
        let knee = |cap: Watts| OperatingPoint {
            cap_w: cap,
            power_w: Watts(cap.0.min(230.0)),
            throughput: (0.2 + 0.8 * (cap.0 - 100.0) / 100.0).min(1.0) * 100.0,
        };
        let caps = grid(250.0, 100.0, 50.0);
        let loss = |c: Watts| 1.0 - knee(c).throughput / 100.0;
        for max_loss in [0.05, 0.15, 0.3] {
            let bounded = DesignParams {
                expected_cut: 0.4,
                max_loss: Some(max_loss),
                zero_progress_cap_w: Some(100.0),
                ..Default::default()
            };
            let out = run_design(&caps, &bounded, &mut |c| knee(c)).expect("design");
            for r in &out.readings {
                assert!(
                    loss(r.cap_w) <= max_loss + 1e-9,
                    "{max_loss}: read {} W at {:.3}",
                    r.cap_w.0,
                    loss(r.cap_w)
                );
            }
            // Past the flat top, the walk reaches into the knee as far as it can show;
            // at 5 % no step worth a level (a tenth of the range) is provable from the
            // top, and the walk reads the top alone.
            let deepest = out.levels.last().expect("levels").cap_w.0;
            if max_loss >= 0.15 {
                assert!(deepest < 200.0, "{max_loss}: {:?}", out.levels);
            } else {
                assert_eq!(out.levels.len(), 1, "{max_loss}: {:?}", out.levels);
            }
        }
        let guessing = DesignParams {
            expected_cut: 0.4,
            max_loss: Some(0.3),
            ..Default::default()
        };
        let out = run_design(&caps, &guessing, &mut |c| knee(c)).expect("design");
        assert!(
            out.readings.iter().any(|r| loss(r.cap_w) > 0.3),
            "the prediction alone steps past the knee: {:?}",
            out.levels
        );
    }

    /// Reads `walk`'s top windows, each `top`.
    fn read_top(walk: &mut DesignWalk, top: OperatingPoint) {
        while walk.current() == Some(top.cap_w) {
            walk.record(top);
        }
    }

    /// A budget that holds the job below the step the chord can show ends the walk:
    /// the shortened step (501 W here) is above the 450 W grant, and nothing below the
    /// grant is provable: the walk must not wait there, putting the step back at every
    /// tick and reading nothing.
    #[test]
    fn a_provable_step_above_the_ceiling_ends_the_walk() {
        let params = DesignParams {
            max_loss: Some(0.3),
            zero_progress_cap_w: Some(200.0),
            ..Default::default()
        };
        let truth = |cap: Watts| OperatingPoint {
            cap_w: cap,
            power_w: Watts(cap.0),
            throughput: 100.0 * (1.0 - 0.5 * (1.0 - cap.0 / 700.0)),
        };
        let mut walk = DesignWalk::new(&grid(700.0, 200.0, 100.0), &params).expect("design");
        read_top(&mut walk, truth(Watts(700.0)));
        let first = walk.current().expect("a first level");
        assert_eq!(first, Watts(600.0));
        walk.record(truth(first));
        walk.hold_at_most(Watts(450.0));
        for _ in 0..3 {
            // The agent tells the design of the grant at every tick.
            walk.hold_at_most(Watts(450.0));
            assert!(
                walk.current().is_none_or(|c| c.0 <= 450.5),
                "{:?}",
                walk.current()
            );
        }
        assert!(walk.caps.len() <= 5, "{:?}", walk.caps);
    }

    /// An extension of a finished walk proves its steps from the lowest level already
    /// read: with 15 % allowed and 600 W read at 2 % lost, its first step is 547 W, not
    /// the 625 W a chord from the top would shorten it to (above what was read).
    #[test]
    fn an_extension_proves_its_steps_from_the_levels_already_read() {
        let params = DesignParams {
            max_loss: Some(0.15),
            zero_progress_cap_w: Some(200.0),
            ..Default::default()
        };
        let caps = [700.0, 500.0, 400.0].map(Watts);
        let mut from_top = DesignWalk::new(&caps, &params).expect("design");
        let mut extension = DesignWalk::new(&caps, &params).expect("design");
        extension.chord_from(Watts(600.0), 0.02);
        for walk in [&mut from_top, &mut extension] {
            read_top(
                walk,
                OperatingPoint {
                    cap_w: Watts(700.0),
                    power_w: Watts(700.0),
                    throughput: 100.0,
                },
            );
        }
        assert_eq!(from_top.current(), Some(Watts(625.0)));
        assert_eq!(extension.current(), Some(Watts(547.0)));
    }

    /// Pre-positioning: an announced event's plan needs the job at 150 W, deeper than the
    /// site's expected cut takes the walk (175 W); told before the walk or in the middle
    /// of it, the walk reaches it.
    #[test]
    fn a_walk_told_the_cap_an_event_needs_reaches_it() {
        let params = DesignParams {
            expected_cut: 0.1,
            ..Default::default()
        };
        let caps = grid(250.0, 100.0, 25.0);
        for told_after in [0usize, 10] {
            let mut walk = DesignWalk::new(&caps, &params).expect("design");
            let mut read = 0;
            while let Some(cap) = walk.current() {
                if read == told_after {
                    walk.reach_down_to(Watts(150.0));
                }
                walk.record(truth(cap));
                read += 1;
            }
            let lowest = walk
                .outcome()
                .levels
                .iter()
                .map(|l| l.cap_w.0)
                .fold(f64::MAX, f64::min);
            assert!(
                lowest <= 150.0,
                "told after {told_after} windows: {:?}",
                walk.outcome().levels
            );
            assert!(cost_on_truth(&walk.outcome()) <= params.budget_fraction + 1e-9);
        }
        // A shallower need changes nothing.
        let mut walk = DesignWalk::new(&caps, &params).expect("design");
        let before = walk.clone();
        walk.reach_down_to(Watts(240.0));
        assert_eq!(walk, before);
    }

    #[test]
    fn a_tiny_budget_stops_the_walk_early() {
        let params = DesignParams {
            budget_fraction: 0.001,
            ..Default::default()
        };
        let out = run_design(&grid(250.0, 100.0, 25.0), &params, &mut truth).expect("design");
        assert!(cost_on_truth(&out) <= 0.001 + 1e-9);
        assert!(out.levels.len() < 7, "{:?}", out.levels);
    }

    #[test]
    fn a_fine_grid_is_walked_in_even_strides() {
        // H200 in 5 W steps from 700 W to 200 W; depth 60 % reaches 280 W.
        let caps = grid(700.0, 200.0, 5.0);
        let levels = levels_to_visit(&caps[1..], Watts(700.0), 0.6, 8);
        assert_eq!(levels.len(), 8 + 1, "{levels:?}");
        assert_eq!(
            levels[7],
            Watts(280.0),
            "the depth's cap is a level: {levels:?}"
        );
        assert!(levels.windows(2).all(|w| w[0].0 > w[1].0), "{levels:?}");
        // A coarse grid is walked cap by cap.
        let coarse = grid(250.0, 100.0, 25.0);
        assert_eq!(
            levels_to_visit(&coarse[1..], Watts(250.0), 0.6, 8),
            coarse[1..]
        );
    }

    #[test]
    fn rejects_bad_knobs() {
        let bad = |p: DesignParams| run_design(&[Watts(250.0)], &p, &mut truth).expect_err("bad");
        assert_eq!(
            bad(DesignParams {
                budget_fraction: 0.0,
                ..Default::default()
            }),
            DesignError::BadBudget(0.0)
        );
        assert_eq!(
            bad(DesignParams {
                expected_cut: 1.0,
                ..Default::default()
            }),
            DesignError::BadExpectedCut(1.0)
        );
        assert_eq!(
            run_design(&[], &DesignParams::default(), &mut truth),
            Err(DesignError::EmptyGrid)
        );
    }

    #[test]
    fn a_bound_stops_the_walk_before_a_level_predicted_to_break_it() {
        let params = DesignParams {
            max_loss: Some(0.15),
            ..Default::default()
        };
        let out = run_design(&grid(250.0, 100.0, 25.0), &params, &mut truth).expect("design");
        for l in &out.levels {
            let loss = 1.0 - truth(l.cap_w).throughput / 100.0;
            assert!(loss <= 0.15 + 1e-9, "{:?} loses {loss}", l.cap_w);
        }
        assert!(out.levels.len() >= 3, "{:?}", out.levels);
    }

    #[test]
    fn a_ceiling_ends_the_level_above_it_and_the_walk_goes_on_below() {
        let mut walk =
            DesignWalk::new(&grid(250.0, 100.0, 25.0), &DesignParams::default()).expect("walk");
        while walk.current() == Some(Watts(250.0)) {
            walk.record(truth(Watts(250.0)));
        }
        assert_eq!(walk.current(), Some(Watts(225.0)));
        walk.record(truth(Watts(225.0)));
        walk.hold_at_most(Watts(180.0));
        assert_eq!(
            walk.current(),
            Some(Watts(175.0)),
            "225 and 200 are above it"
        );
        while let Some(cap) = walk.current() {
            assert!(cap.0 <= 180.0, "{cap:?} read above the ceiling");
            walk.record(truth(cap));
        }
        let out = walk.outcome();
        assert_eq!(out.levels[1].cap_w, Watts(225.0), "the window read counts");
        assert!(out.levels.iter().skip(2).all(|l| l.cap_w.0 <= 180.0));
    }

    /// A dense job on an H200 (700 W down to 200 W in 10 W steps): throughput falls 0.77×
    /// as fast as the cap below 700 W (PFI ≈ 1.3, the paper's dense median), power = cap.
    fn h200_grid() -> Vec<Watts> {
        grid(700.0, 200.0, 10.0)
    }

    fn dense(cap: Watts) -> OperatingPoint {
        OperatingPoint {
            cap_w: cap,
            power_w: cap,
            throughput: 1000.0 * (1.0 - 0.77 * (1.0 - cap.0 / 700.0)),
        }
    }

    /// Drives a walk on a fake clock: each window is `window_s`, each capped level's
    /// first window follows a settle (the uncapped one does not: the job is uncapped
    /// already). `deadline` is set after `after` windows, `seconds` from then. Returns
    /// the outcome and the walk time from the deadline's setting to the end.
    fn walk_on_clock(
        params: &DesignParams,
        deadline: Option<(usize, f64)>,
    ) -> (DesignOutcome, f64, f64) {
        let mut walk = DesignWalk::new(&h200_grid(), params).expect("walk");
        let (mut t, mut since) = (0.0, 0.0);
        let mut last = Some(Watts(700.0));
        let mut read = 0;
        loop {
            if let Some((after, seconds)) = deadline {
                if read == after {
                    since = t;
                    walk.finish_within(seconds);
                }
            }
            let Some(cap) = walk.current() else { break };
            if last != Some(cap) {
                t += params.settle_s;
                last = Some(cap);
            }
            t += params.window_s;
            walk.record(dense(cap));
            read += 1;
        }
        (walk.outcome(), t, t - since)
    }

    #[test]
    fn a_deadline_that_fits_changes_nothing() {
        let params = DesignParams::default();
        let (free, full_s, _) = walk_on_clock(&params, None);
        let (roomy, _, _) = walk_on_clock(&params, Some((0, full_s + 60.0)));
        assert_eq!(roomy.levels, free.levels);
        assert!(free.levels.len() >= 4, "{:?}", free.levels);
    }

    #[test]
    fn a_tight_deadline_compresses_the_walk_and_keeps_its_depth() {
        let params = DesignParams::default();
        let (free, full_s, _) = walk_on_clock(&params, None);
        let deepest = free.levels.last().expect("levels").cap_w;
        for share in [0.7, 0.5, 0.35] {
            let deadline_s = share * full_s;
            let (out, _, used_s) = walk_on_clock(&params, Some((0, deadline_s)));
            assert!(used_s <= deadline_s + 1e-9, "{used_s} s for {deadline_s} s");
            // Fewer windows cost fewer tokens: the budget reaches at least as deep.
            let reached = out.levels.last().expect("levels").cap_w;
            assert!(
                reached.0 <= deepest.0,
                "the depth is kept at {share}: {:?}",
                out.levels
            );
            assert!(out.levels.iter().all(|l| l.windows >= 1));
            // The time is planned for every level down to the design's depth, which the
            // token budget may stop short of: a curve of a few levels, not a point.
            assert!(out.levels.len() >= 4, "at {share}: {:?}", out.levels);
            assert!(out.readings.len() < free.readings.len());
        }
    }

    #[test]
    fn without_room_for_a_window_per_level_fewer_levels_reach_the_depth() {
        let params = DesignParams::default();
        let (free, _, _) = walk_on_clock(&params, None);
        let deepest = free.levels.last().expect("levels").cap_w;
        // One uncapped window and three capped levels' worth.
        let deadline_s = params.window_s + 3.0 * (params.settle_s + params.window_s);
        let (out, _, used_s) = walk_on_clock(&params, Some((0, deadline_s)));
        assert!(used_s <= deadline_s + 1e-9, "{used_s} s for {deadline_s} s");
        assert_eq!(out.levels[0].windows, 1, "{:?}", out.levels);
        assert_eq!(out.levels.len(), 1 + 3, "{:?}", out.levels);
        assert!(
            out.levels.last().expect("levels").cap_w.0 <= deepest.0,
            "{:?}",
            out.levels
        );
        // Spread over the depth, not the three shallowest.
        assert!(
            out.levels[1].cap_w.0 < free.levels[1].cap_w.0,
            "{:?}",
            out.levels
        );
    }

    #[test]
    fn a_deadline_set_mid_walk_holds_and_no_time_ends_the_walk() {
        let params = DesignParams::default();
        let (free, _, _) = walk_on_clock(&params, None);
        // After the uncapped windows and two at the first level.
        let after = params.top_windows + 2;
        let deadline_s = 4.0 * (params.settle_s + params.window_s);
        let (out, _, used_s) = walk_on_clock(&params, Some((after, deadline_s)));
        assert!(used_s <= deadline_s + 1e-9, "{used_s} s for {deadline_s} s");
        let (reached, deepest) = (
            out.levels.last().expect("levels").cap_w,
            free.levels.last().expect("levels").cap_w,
        );
        assert!(reached.0 <= deepest.0, "{:?}", out.levels);
        let (ended, _, used_s) = walk_on_clock(&params, Some((after, 0.0)));
        assert_eq!(used_s, 0.0, "nothing read after a deadline of now");
        assert_eq!(ended.readings.len(), after);
        assert_eq!(
            ended.levels.len(),
            2,
            "the level under way keeps its windows"
        );
    }

    /// The measured effect of pre-positioning: jobs start every minute over the
    /// hour before an announced event; each warms up for 60 s, then walks. Without the
    /// deadline a job is calibrated by the start only if its whole design fits; with it,
    /// the design is compressed to end by the start. A job counts as calibrated with its
    /// walk done and at least two capped levels read (a curve, not a point).
    #[test]
    fn announced_events_find_more_jobs_calibrated_by_their_start() {
        let params = DesignParams::default();
        let warmup_s = 60.0;
        let (_, full_s, _) = walk_on_clock(&params, None);
        let (mut before, mut after, mut jobs) = (0, 0, 0);
        let mut windows_after = Vec::new();
        for lead_min in 1..=60 {
            let walk_s = f64::from(lead_min) * 60.0 - warmup_s;
            jobs += 1;
            if full_s <= walk_s {
                before += 1;
            }
            let (out, _, used_s) = walk_on_clock(&params, Some((0, walk_s)));
            assert!(used_s <= walk_s + 1e-9);
            if out.levels.len() >= 3 {
                after += 1;
                windows_after.push(out.readings.len());
            }
        }
        eprintln!(
            "design walk {full_s:.0} s: calibrated by the event's start {before}/{jobs} jobs without the deadline, {after}/{jobs} with it (fewest windows {:?})",
            windows_after.iter().min()
        );
        assert!(after > before, "{after} vs {before}");
    }
}
