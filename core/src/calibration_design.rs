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
//! Pure: the measurement is a closure (the agent's window, or the evaluation's noisy
//! draw from a true curve), so the same design runs offline and in the node agent.

use crate::curve::OperatingPoint;
use crate::units::Watts;

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
/// `cap` for one window and returns what was read.
pub fn run_design(
    grid: &[Watts],
    params: &DesignParams,
    measure: &mut dyn FnMut(Watts) -> OperatingPoint,
) -> Result<DesignOutcome, DesignError> {
    params.validate()?;
    let (&top, rest) = grid.split_first().ok_or(DesignError::EmptyGrid)?;
    let mut readings = Vec::new();
    for _ in 0..params.top_windows {
        readings.push(measure(top));
    }
    let mean = |xs: &[OperatingPoint]| {
        let n = xs.len().max(1) as f64;
        (
            xs.iter().map(|p| p.power_w.0).sum::<f64>() / n,
            xs.iter().map(|p| p.throughput).sum::<f64>() / n,
        )
    };
    let (p_top, t_top) = mean(&readings);
    let mut levels = vec![Level {
        cap_w: top,
        windows: params.top_windows,
        seconds: params.top_windows as f64 * params.window_s,
    }];
    // In T_max-seconds. The design prices its spending with its own noisy readings; it
    // keeps COST_RESERVE of the budget back so that the true cost stays inside it.
    let budget_s = (1.0 - COST_RESERVE) * params.budget_fraction * FIRST_HOUR_S;
    let depth = (params.depth_factor * params.expected_cut).min(0.95);
    let stop_power = (1.0 - depth) * p_top;
    let mut spent = 0.0;
    // (cap, loss) of the levels read so far, the top one first.
    let mut seen: Vec<(f64, f64)> = vec![(top.0, 0.0)];
    let caps = levels_to_visit(rest, top, depth, params.max_levels);
    for (i, &cap) in caps.iter().enumerate() {
        // The caps still to visit, down to the one the depth is predicted to reach, each
        // with its predicted loss; plan windows for all of them, spend on this one.
        let deepest = caps[i..]
            .iter()
            .position(|c| c.0 <= (1.0 - depth) * top.0)
            .map_or(caps.len(), |j| i + j + 1);
        let planned: Vec<f64> = caps[i..deepest]
            .iter()
            .map(|c| predicted_loss(&seen, c.0, top.0))
            .collect();
        let unit: Vec<f64> = planned.iter().map(|l| l.max(MIN_LOSS)).collect();
        let settle_cost: f64 = planned.iter().map(|l| l * params.settle_s).sum();
        let remaining = budget_s - spent;
        let sqrt_sum: f64 = unit.iter().map(|u| u.sqrt()).sum();
        let k = (remaining - settle_cost).max(0.0) / (params.window_s * sqrt_sum);
        let target = ((k / unit[0].sqrt()).floor() as usize).clamp(1, params.max_windows_per_cap);
        // This cap must still fit: settle plus one window at the predicted loss (the
        // budget's reserve covers a prediction that falls short).
        if planned[0] * (params.settle_s + params.window_s) > remaining {
            break;
        }
        // Windows one at a time: each is paid for at the loss measured so far here, and
        // the level ends early when the next window would overspend.
        let start = readings.len();
        let mut windows = 0;
        let (mut p, mut loss) = (p_top, planned[0]);
        while windows < target {
            let next_cost = loss * (params.settle_s + (windows + 1) as f64 * params.window_s);
            if windows > 0 && spent + next_cost > budget_s {
                break;
            }
            readings.push(measure(cap));
            windows += 1;
            let (mp, mt) = mean(&readings[start..]);
            p = mp;
            loss = (1.0 - mt / t_top).max(0.0);
        }
        let seconds = params.settle_s + windows as f64 * params.window_s;
        spent += loss * seconds;
        levels.push(Level {
            cap_w: cap,
            windows,
            seconds,
        });
        seen.push((cap.0, loss));
        if p <= stop_power {
            break;
        }
    }
    // Top-up: what the walk left of the budget buys more windows where they are
    // cheapest — the shallow levels, where most decisions land and where differences
    // between caps are small next to the noise. Each revisit pays a settle again.
    // A level's loss is a difference of two noisy means; the top-up spends the last of
    // the budget, so it prices each level two standard errors above its reading.
    let spread = relative_spread(&readings);
    let mut order: Vec<usize> = (1..levels.len()).collect();
    order.sort_by(|&a, &b| seen[a].1.total_cmp(&seen[b].1));
    for i in order {
        let n = levels[i].windows.max(1) as f64;
        let margin = 2.0 * spread * (1.0 / n + 1.0 / params.top_windows as f64).sqrt();
        let (cap, loss) = (levels[i].cap_w, seen[i].1.max(MIN_LOSS) + margin);
        let room = params.max_windows_per_cap.saturating_sub(levels[i].windows);
        let affordable = ((budget_s - spent) / loss - params.settle_s) / params.window_s;
        let extra = room.min(affordable.max(0.0).floor() as usize);
        if extra == 0 {
            continue;
        }
        for _ in 0..extra {
            readings.push(measure(cap));
        }
        let seconds = params.settle_s + extra as f64 * params.window_s;
        spent += loss * seconds;
        levels[i].windows += extra;
        levels[i].seconds += seconds;
    }
    Ok(DesignOutcome {
        readings,
        levels,
        estimated_cost_fraction: spent / FIRST_HOUR_S,
    })
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
}
