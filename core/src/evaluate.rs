//! Offline evaluation of allocation policies on a site's own measured curves, scored
//! honestly in cap space: every policy chooses caps, and the *true* curve at those caps
//! decides its throughput and its power — so a policy that believes a job saves more
//! power than it really does shows up as a budget violation, not as a win.
//!
//! For each of `workloads` workloads, `jobs_per_workload` jobs are drawn with replacement
//! from the file; the budget is `(1 − cut) · Σ P_max`; each job's true curve is its
//! measured points (caps between measured ones, where the cap grid has them, are read by
//! linear interpolation). The allowed caps are each job's measured range on the cap step
//! (by default the spacing of the measured caps, so only measured caps are chosen).
//!
//! Policies and ceilings:
//! - `equal`: every job's power cut by the same fraction (true curves);
//! - `pfi_proportional`: cut ∝ (P_max / T_max) · PFI, PFI from the full true curve;
//! - `optimal_calibrated`: each job is calibrated by the designed walk of
//!   [`crate::calibration_design`] (or, with `calibration_grid`, once at fixed fractions of
//!   its top cap) — every window a draw from the true curve with multiplicative gaussian
//!   noise `noise` on power and on throughput —, its curve is estimated with
//!   [`estimate_from_windows`] and the caps are chosen by [`allocate_cautious`];
//! - `oracle` — the **attainable** ceiling: the same allocator with every cap measured
//!   and no noise (the true curves);
//! - `power_space_optimum`: the upper bound where each job may take any point of the
//!   upper concave hull of its true (power, throughput) points (time-sharing between
//!   caps); no cap-space policy can beat it.
//!
//! Gap recovered is reported against both ceilings. Calibration cost is priced on the
//! true curves: token-seconds lost while held below the top cap (settle included), as a
//! fraction of the job's first-hour tokens.
//!
//! With `events > 0` the evaluation also runs a sequence of grid events on each workload
//! (the multi-event mode): each event's caps come from the current estimates, and every
//! steady stretch at a cap during the event's hold is a measurement that refines them;
//! each job also spends a few windows one cap step below its assigned cap (always within
//! the budget) and, while the planned margin allows, one step above — the part of the
//! curve the next decision depends on. Gap recovered is reported per event.
//!
//! A workload whose true power exceeds the budget by more than 0.5 % is a budget
//! violation for that policy. A workload whose budget is below the power of every job at
//! its lowest measured cap is infeasible: it is counted and left out of the means.

use serde::Serialize;

use crate::allocate::{allocate, allocate_cautious, CapLimits, Caution, JobSpec, Policy};
use crate::calibration_design::{run_design, DesignError, DesignParams, FIRST_HOUR_S};
use crate::curve::{estimate_from_windows, CapCurve};
use crate::curves_csv::JobCurveRecord;
use crate::point::OperatingPoint;
use crate::rng::SplitMix64;
use crate::units::Watts;

/// Tolerance above the budget before a workload counts as a violation.
pub const VIOLATION_TOLERANCE: f64 = 0.005;

/// The experiment's knobs; see `powerflexctl evaluate --help` for each.
#[derive(Debug, Clone, PartialEq)]
pub struct EvaluateParams {
    /// Fraction of Σ P_max to shed, in (0, 1).
    pub cut: f64,
    pub jobs_per_workload: usize,
    pub workloads: usize,
    pub seed: u64,
    /// Fixed calibration caps as fractions of each job's maximum cap, in (0, 1], one
    /// window each; `None` = the designed calibration (`design`).
    pub calibration_grid: Option<Vec<f64>>,
    /// The designed calibration's knobs.
    pub design: DesignParams,
    /// One standard deviation of multiplicative noise on one window's reading of power
    /// and of throughput, e.g. 0.01.
    pub noise: f64,
    /// Score raw throughput (tokens/s) instead of per-job normalised T / T_max.
    pub raw: bool,
    /// Cap granularity, W per GPU; `None` = the spacing of each job's measured caps.
    pub cap_step_w: Option<f64>,
    /// How far the allocator distrusts the estimates.
    pub caution: Caution,
    /// Grid events to run after calibration (0 = calibration only).
    pub events: usize,
    /// How long each event holds its caps, s.
    pub event_hold_s: f64,
}

impl Default for EvaluateParams {
    fn default() -> Self {
        EvaluateParams {
            cut: 0.3,
            jobs_per_workload: 100,
            workloads: 500,
            seed: 1,
            calibration_grid: None,
            design: DesignParams::default(),
            noise: 0.01,
            raw: false,
            cap_step_w: None,
            caution: Caution::default(),
            events: 0,
            event_hold_s: 3600.0,
        }
    }
}

/// Why an evaluation could not run.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum EvaluateError {
    #[error("--cut must be a fraction strictly between 0 and 1, e.g. 0.3 (got {0})")]
    BadCut(f64),
    #[error("--jobs-per-workload and --workloads must be at least 1")]
    EmptyWorkload,
    #[error(
        "--calibration-grid needs at least one fraction in (0, 1], e.g. 1.0,0.8,0.6,0.4 (got {0})"
    )]
    BadGrid(String),
    #[error("--noise must be a fraction in [0, 0.5), e.g. 0.01 (got {0})")]
    BadNoise(f64),
    #[error("--cap-step-w must be a positive number of watts (got {0})")]
    BadStep(f64),
    #[error("--event-hold-s must be at least one calibration window long (got {hold_s} s, window {window_s} s)")]
    BadHold { hold_s: f64, window_s: f64 },
    #[error("--{name} must be a non-negative number of standard deviations, e.g. 1 (got {value})")]
    BadCaution { name: &'static str, value: f64 },
    #[error(transparent)]
    Design(#[from] DesignError),
    #[error("the curves file has no jobs")]
    NoJobs,
    #[error("job {job}: {message}")]
    BadJob { job: String, message: String },
}

/// Per-policy values, keyed as in the JSON report.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct PerPolicy<T> {
    pub equal: T,
    pub pfi_proportional: T,
    pub optimal_calibrated: T,
    pub oracle: T,
}

/// Share of the gap from equal to a ceiling a policy recovers:
/// (policy − equal) / (ceiling − equal). `None` when the ceiling gains nothing over equal.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct GapRecovered {
    pub pfi_proportional: Option<f64>,
    pub optimal_calibrated: Option<f64>,
}

/// Gap recovered against the power-space optimum (the attainable ceiling included).
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct GapVsPowerSpace {
    pub pfi_proportional: Option<f64>,
    pub optimal_calibrated: Option<f64>,
    pub oracle: Option<f64>,
}

/// What calibration cost the jobs, priced on their true curves.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct CalibrationCost {
    /// Mean token cost per job, fraction of first-hour tokens.
    pub mean_fraction: f64,
    /// Largest token cost of any job, fraction of first-hour tokens.
    pub max_fraction: f64,
    /// The design's budget, fraction of first-hour tokens (`None` with a fixed grid).
    pub budget_fraction: Option<f64>,
    /// Mean capped levels visited per job (the uncapped level not counted).
    pub mean_levels: f64,
    /// Mean calibration time per job, uncapped windows included, s.
    pub mean_seconds: f64,
}

/// One event of the multi-event mode.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct EventRow {
    /// 1 = the first event after calibration.
    pub event: usize,
    /// Mean throughput of `optimal_calibrated` per feasible workload at this event.
    pub optimal_calibrated: f64,
    /// Gap recovered against the attainable ceiling.
    pub gap_recovered: Option<f64>,
    pub budget_violations: usize,
    /// Workloads whose allocation kept the equal split (gain within its uncertainty).
    pub kept_equal: usize,
    /// Tokens the probing windows below the assigned caps cost, fraction of the event's
    /// tokens.
    pub probe_cost_fraction: f64,
}

/// The experiment's result. JSON keys are part of the CLI's interface.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct EvaluateReport {
    pub cut: f64,
    pub workloads: usize,
    pub jobs_per_workload: usize,
    pub seed: u64,
    pub noise: f64,
    /// "designed" or "grid".
    pub calibration: &'static str,
    /// "normalised" (Σ T/T_max per workload) or "raw" (Σ tokens/s per workload).
    pub throughput: &'static str,
    /// Mean total throughput per feasible workload.
    pub equal: f64,
    pub pfi_proportional: f64,
    pub optimal_calibrated: f64,
    /// The attainable ceiling: the allocator on the true curves.
    pub oracle: f64,
    /// The power-space optimum (concave hull of each true curve, time-sharing caps).
    pub power_space_optimum: f64,
    /// Against the attainable ceiling.
    pub gap_recovered: GapRecovered,
    pub gap_recovered_vs_power_space: GapVsPowerSpace,
    pub budget_violations: PerPolicy<usize>,
    /// Mean Σ true power / budget per feasible workload.
    pub power_over_budget: PerPolicy<f64>,
    pub calibration_cost: CalibrationCost,
    /// Feasible workloads where `optimal_calibrated` kept the equal split.
    pub kept_equal_workloads: usize,
    pub infeasible_workloads: usize,
    /// Per event of the multi-event mode (empty without `events`).
    pub events: Vec<EventRow>,
}

/// A job as the experiment sees it.
#[derive(Debug)]
struct TrueJob {
    name: String,
    gpus: u32,
    curve: CapCurve,
    limits: CapLimits,
    /// Allowed caps, highest first.
    grid: Vec<Watts>,
    measured_caps: Vec<f64>,
}

/// The spacing of a job's measured caps: the greatest common divisor (to 0.5 W, at least
/// 1 W) of the gaps between its capped points. The top cap may sit off that grid (an
/// RTX6000 measured every 25 W from 100 W and at its 260 W maximum): [`CapLimits`] always
/// allows its `max_w`.
fn measured_step(caps: &[f64]) -> f64 {
    let gcd = |mut a: f64, mut b: f64| {
        while b > 0.5 {
            let r = a % b;
            a = b;
            b = if r > b - 0.5 { 0.0 } else { r };
        }
        a
    };
    let capped = &caps[..caps.len().saturating_sub(1)];
    let gaps = if capped.len() >= 2 { capped } else { caps };
    gaps.windows(2)
        .map(|w| (w[1] - w[0]).abs())
        .filter(|d| *d > 0.5)
        .fold(
            0.0,
            |g, d| if g == 0.0 { d } else { gcd(g.max(d), g.min(d)) },
        )
        .max(1.0)
}

fn prepare_jobs(
    records: &[JobCurveRecord],
    step: Option<f64>,
) -> Result<Vec<TrueJob>, EvaluateError> {
    records
        .iter()
        .map(|r| {
            let curve = CapCurve::from_points(&r.points).map_err(|e| EvaluateError::BadJob {
                job: r.job.clone(),
                message: e.to_string(),
            })?;
            let caps: Vec<f64> = curve.knots().iter().map(|k| k.cap_w.0).collect();
            let step = step.unwrap_or_else(|| measured_step(&caps));
            let limits = CapLimits {
                min_w: curve.lowest().cap_w,
                max_w: curve.uncapped().cap_w,
                step_w: Watts(step),
            };
            let mut grid = vec![limits.max_w];
            let mut c = limits.snap_down(limits.max_w.0 - 1e-6);
            while c < grid[grid.len() - 1].0 {
                grid.push(Watts(c));
                if c <= limits.min_w.0 {
                    break;
                }
                c = limits.snap_down(c - 1e-6);
            }
            Ok(TrueJob {
                name: r.job.clone(),
                gpus: r.gpus.unwrap_or(1),
                curve,
                limits,
                grid,
                measured_caps: caps,
            })
        })
        .collect()
}

/// The measured caps a calibration at `grid` fractions of the maximum cap would visit:
/// for each fraction the nearest measured cap (ties to the higher cap), plus the top.
pub fn calibration_caps(measured_caps: &[f64], grid: &[f64]) -> Vec<f64> {
    let Some(&top) = measured_caps.iter().max_by(|a, b| a.total_cmp(b)) else {
        return Vec::new();
    };
    let mut chosen = vec![top];
    for &f in grid {
        let target = f * top;
        let nearest = measured_caps.iter().copied().min_by(|a, b| {
            (a - target)
                .abs()
                .total_cmp(&(b - target).abs())
                .then(b.total_cmp(a))
        });
        if let Some(c) = nearest {
            if !chosen.contains(&c) {
                chosen.push(c);
            }
        }
    }
    chosen.sort_by(f64::total_cmp);
    chosen
}

fn validate(params: &EvaluateParams) -> Result<(), EvaluateError> {
    if !(params.cut > 0.0 && params.cut < 1.0) {
        return Err(EvaluateError::BadCut(params.cut));
    }
    if params.jobs_per_workload == 0 || params.workloads == 0 {
        return Err(EvaluateError::EmptyWorkload);
    }
    if let Some(grid) = &params.calibration_grid {
        let grid_ok =
            !grid.is_empty() && grid.iter().all(|f| f.is_finite() && *f > 0.0 && *f <= 1.0);
        if !grid_ok {
            return Err(EvaluateError::BadGrid(format!("{grid:?}")));
        }
    }
    if !(params.noise.is_finite() && (0.0..0.5).contains(&params.noise)) {
        return Err(EvaluateError::BadNoise(params.noise));
    }
    if let Some(step) = params.cap_step_w {
        if !(step.is_finite() && step > 0.0) {
            return Err(EvaluateError::BadStep(step));
        }
    }
    for (name, value) in [
        ("power-z", params.caution.power_z),
        ("gain-z", params.caution.gain_z),
    ] {
        if !(value.is_finite() && value >= 0.0) {
            return Err(EvaluateError::BadCaution { name, value });
        }
    }
    params.design.validate()?;
    if params.events > 0
        && !(params.event_hold_s.is_finite() && params.event_hold_s >= params.design.window_s)
    {
        return Err(EvaluateError::BadHold {
            hold_s: params.event_hold_s,
            window_s: params.design.window_s,
        });
    }
    Ok(())
}

/// One noisy window reading of `job` at `cap`.
fn window(job: &TrueJob, cap: Watts, noise: f64, rng: &mut SplitMix64) -> OperatingPoint {
    let truth = job.curve.at(cap);
    OperatingPoint {
        cap_w: cap,
        power_w: truth.power_w * (1.0 + noise * rng.normal()).max(0.01),
        throughput: truth.throughput * (1.0 + noise * rng.normal()).max(0.01),
    }
}

/// A job's calibration: its window readings and the token cost on its true curve.
struct Calibrated {
    readings: Vec<OperatingPoint>,
    cost_fraction: f64,
    levels: usize,
    seconds: f64,
}

fn calibrate(
    job: &TrueJob,
    params: &EvaluateParams,
    rng: &mut SplitMix64,
) -> Result<Calibrated, EvaluateError> {
    let t_top = job.curve.uncapped().throughput;
    let loss = |cap: Watts| (1.0 - job.curve.at(cap).throughput / t_top).max(0.0);
    let d = &params.design;
    match &params.calibration_grid {
        Some(fractions) => {
            let caps = calibration_caps(&job.measured_caps, fractions);
            let readings: Vec<OperatingPoint> = caps
                .iter()
                .map(|&c| window(job, Watts(c), params.noise, rng))
                .collect();
            let held = d.settle_s + d.window_s;
            let cost: f64 = caps.iter().map(|&c| loss(Watts(c)) * held).sum();
            Ok(Calibrated {
                readings,
                cost_fraction: cost / FIRST_HOUR_S,
                levels: caps.len().saturating_sub(1),
                seconds: held * caps.len() as f64,
            })
        }
        None => {
            let outcome = run_design(&job.grid, d, &mut |cap| window(job, cap, params.noise, rng))?;
            let cost: f64 = outcome
                .levels
                .iter()
                .map(|l| loss(l.cap_w) * l.seconds)
                .sum();
            Ok(Calibrated {
                readings: outcome.readings,
                cost_fraction: cost / FIRST_HOUR_S,
                levels: outcome.levels.len().saturating_sub(1),
                seconds: outcome.levels.iter().map(|l| l.seconds).sum(),
            })
        }
    }
}

/// The power-space optimum of one workload: each job may take any point of the upper
/// concave hull of its true (power, value) points, so cutting power is a fractional
/// knapsack — cut the hull segments that lose the least value per watt first.
fn power_space_optimum(
    jobs: &[&TrueJob],
    values: &dyn Fn(&TrueJob, f64) -> f64,
    budget: f64,
) -> f64 {
    // (slope = value lost per watt, watts) of every hull segment below each job's best point.
    let mut segments: Vec<(f64, f64)> = Vec::new();
    let (mut power, mut value) = (0.0, 0.0);
    for job in jobs {
        let mut pts: Vec<(f64, f64)> = job
            .curve
            .knots()
            .iter()
            .map(|k| (k.power_w.0, values(job, k.throughput)))
            .collect();
        pts.sort_by(|a, b| a.0.total_cmp(&b.0).then(a.1.total_cmp(&b.1)));
        let mut hull: Vec<(f64, f64)> = Vec::new();
        for p in pts {
            while hull.len() >= 2 {
                let (a, b) = (hull[hull.len() - 2], hull[hull.len() - 1]);
                // Drop b when it lies on or below the chord a→p.
                if (b.0 - a.0) * (p.1 - a.1) - (b.1 - a.1) * (p.0 - a.0) >= 0.0 {
                    hull.pop();
                } else {
                    break;
                }
            }
            hull.push(p);
        }
        // Keep the hull up to its highest value: beyond it more power buys nothing.
        let best = hull
            .iter()
            .enumerate()
            .max_by(|a, b| a.1 .1.total_cmp(&b.1 .1).then(b.0.cmp(&a.0)))
            .map_or(0, |(i, _)| i);
        hull.truncate(best + 1);
        let top = hull[hull.len() - 1];
        power += top.0;
        value += top.1;
        for w in hull.windows(2) {
            let (dp, dv) = (w[1].0 - w[0].0, w[1].1 - w[0].1);
            if dp > 0.0 {
                segments.push((dv / dp, dp));
            }
        }
    }
    segments.sort_by(|a, b| a.0.total_cmp(&b.0));
    for (slope, watts) in segments {
        if power <= budget {
            break;
        }
        let cut = watts.min(power - budget);
        power -= cut;
        value -= slope * cut;
    }
    value
}

/// Running sums of one policy's score.
#[derive(Debug, Clone, Copy, Default)]
struct Tally {
    value: f64,
    power_ratio: f64,
    violations: usize,
}

/// Runs the experiment. `progress(done, total)` is called after each workload.
pub fn evaluate(
    records: &[JobCurveRecord],
    params: &EvaluateParams,
    progress: &mut dyn FnMut(usize, usize),
) -> Result<EvaluateReport, EvaluateError> {
    validate(params)?;
    if records.is_empty() {
        return Err(EvaluateError::NoJobs);
    }
    let jobs = prepare_jobs(records, params.cap_step_w)?;
    let mut rng = SplitMix64::new(params.seed);
    let mut equal = Tally::default();
    let mut pfi = Tally::default();
    let mut calibrated = Tally::default();
    let mut oracle = Tally::default();
    let mut space = 0.0;
    let mut events = vec![(Tally::default(), 0usize, 0.0); params.events];
    let (mut cost_sum, mut cost_max, mut levels_sum, mut seconds_sum, mut calibrations) =
        (0.0, 0.0f64, 0.0, 0.0, 0usize);
    let mut kept_equal = 0usize;
    let mut feasible = 0usize;
    let mut infeasible = 0usize;
    let value_of = |job: &TrueJob, throughput: f64| {
        if params.raw {
            throughput
        } else {
            throughput / job.curve.uncapped().throughput
        }
    };
    for w in 0..params.workloads {
        let picks: Vec<&TrueJob> = (0..params.jobs_per_workload)
            .map(|_| &jobs[rng.below(jobs.len())])
            .collect();
        let budget: f64 = (1.0 - params.cut)
            * picks
                .iter()
                .map(|j| j.curve.uncapped().power_w.0)
                .sum::<f64>();
        let floor: f64 = picks.iter().map(|j| j.curve.lowest().power_w.0).sum();
        // Calibration is drawn for every workload, feasible or not, so the random stream
        // (and so every later workload) does not depend on feasibility.
        let mut windows: Vec<Vec<OperatingPoint>> = Vec::with_capacity(picks.len());
        for job in &picks {
            let c = calibrate(job, params, &mut rng)?;
            cost_sum += c.cost_fraction;
            cost_max = cost_max.max(c.cost_fraction);
            levels_sum += c.levels as f64;
            seconds_sum += c.seconds;
            calibrations += 1;
            windows.push(c.readings);
        }
        if floor > budget {
            infeasible += 1;
            progress(w + 1, params.workloads);
            continue;
        }
        feasible += 1;
        let true_specs: Vec<JobSpec> = picks
            .iter()
            .map(|j| spec(j, j.curve.clone(), params.raw))
            .collect();
        let budget_w = Watts(budget);
        let run = |specs: &[JobSpec], policy: Policy| -> Vec<Watts> {
            allocate(specs, budget_w, policy)
                .map(|a| a.jobs.iter().map(|j| j.cap_w).collect())
                .unwrap_or_else(|_| picks.iter().map(|j| j.curve.uncapped().cap_w).collect())
        };
        let judge = |caps: &[Watts]| {
            let (mut power, mut value) = (0.0, 0.0);
            for (job, &cap) in picks.iter().zip(caps) {
                let at = job.curve.at(cap);
                power += at.power_w.0;
                value += value_of(job, at.throughput);
            }
            (power, value)
        };
        let score = |caps: &[Watts], tally: &mut Tally| {
            let (power, value) = judge(caps);
            tally.value += value;
            tally.power_ratio += power / budget;
            if power > budget * (1.0 + VIOLATION_TOLERANCE) {
                tally.violations += 1;
            }
        };
        score(&run(&true_specs, Policy::Equal), &mut equal);
        score(&run(&true_specs, Policy::PfiProportional), &mut pfi);
        // The attainable ceiling: the allocator with every cap measured and no noise —
        // on the raw true curves, and through the same estimator the calibrated policy
        // uses (on non-monotone real curves the monotone fit can decide better); the
        // better of the two on the true curves, within the budget.
        let exact = run(&true_specs, Policy::Optimal);
        let through_estimator: Option<Vec<Watts>> = picks
            .iter()
            .map(|j| {
                estimate_from_windows(j.curve.knots(), 0.0)
                    .ok()
                    .map(|c| spec(j, c, params.raw))
            })
            .collect::<Option<Vec<JobSpec>>>()
            .and_then(|specs| allocate_cautious(&specs, budget_w, params.caution).ok())
            .map(|a| a.allocation.jobs.iter().map(|j| j.cap_w).collect());
        let oracle_caps = match through_estimator {
            Some(other) => {
                let (p, v) = judge(&other);
                if p <= budget * (1.0 + VIOLATION_TOLERANCE) && v > judge(&exact).1 {
                    other
                } else {
                    exact
                }
            }
            None => exact,
        };
        score(&oracle_caps, &mut oracle);
        space += power_space_optimum(&picks, &value_of, budget);
        let decide = |windows: &[Vec<OperatingPoint>]| -> (Vec<Watts>, bool, f64) {
            let specs: Vec<JobSpec> = picks
                .iter()
                .zip(windows)
                .map(|(j, w)| {
                    let curve =
                        estimate_from_windows(w, params.noise).unwrap_or_else(|_| j.curve.clone());
                    spec(j, curve, params.raw)
                })
                .collect();
            match allocate_cautious(&specs, budget_w, params.caution) {
                Ok(a) => (
                    a.allocation.jobs.iter().map(|j| j.cap_w).collect(),
                    a.kept_equal,
                    budget - a.planned_budget_w.0,
                ),
                Err(_) => (
                    picks.iter().map(|j| j.curve.uncapped().cap_w).collect(),
                    true,
                    0.0,
                ),
            }
        };
        let (caps, kept, _) = decide(&windows);
        kept_equal += usize::from(kept);
        score(&caps, &mut calibrated);
        for slot in events.iter_mut() {
            let (caps, kept, margin) = decide(&windows);
            score(&caps, &mut slot.0);
            slot.1 += usize::from(kept);
            slot.2 += learn_during_event(&picks, &caps, margin, params, &mut windows, &mut rng);
        }
        progress(w + 1, params.workloads);
    }
    let n = feasible.max(1) as f64;
    let mean = |x: f64| x / n;
    let (eq, pf, cal, or, sp) = (
        mean(equal.value),
        mean(pfi.value),
        mean(calibrated.value),
        mean(oracle.value),
        mean(space),
    );
    let recovered = |v: f64, ceiling: f64| {
        let gap = ceiling - eq;
        if feasible > 0 && gap.abs() > 1e-12 * ceiling.abs().max(1.0) {
            Some((v - eq) / gap)
        } else {
            None
        }
    };
    let per_calibration = calibrations.max(1) as f64;
    Ok(EvaluateReport {
        cut: params.cut,
        workloads: params.workloads,
        jobs_per_workload: params.jobs_per_workload,
        seed: params.seed,
        noise: params.noise,
        calibration: if params.calibration_grid.is_some() {
            "grid"
        } else {
            "designed"
        },
        throughput: if params.raw { "raw" } else { "normalised" },
        equal: eq,
        pfi_proportional: pf,
        optimal_calibrated: cal,
        oracle: or,
        power_space_optimum: sp,
        gap_recovered: GapRecovered {
            pfi_proportional: recovered(pf, or),
            optimal_calibrated: recovered(cal, or),
        },
        gap_recovered_vs_power_space: GapVsPowerSpace {
            pfi_proportional: recovered(pf, sp),
            optimal_calibrated: recovered(cal, sp),
            oracle: recovered(or, sp),
        },
        budget_violations: PerPolicy {
            equal: equal.violations,
            pfi_proportional: pfi.violations,
            optimal_calibrated: calibrated.violations,
            oracle: oracle.violations,
        },
        power_over_budget: PerPolicy {
            equal: mean(equal.power_ratio),
            pfi_proportional: mean(pfi.power_ratio),
            optimal_calibrated: mean(calibrated.power_ratio),
            oracle: mean(oracle.power_ratio),
        },
        calibration_cost: CalibrationCost {
            mean_fraction: cost_sum / per_calibration,
            max_fraction: cost_max,
            budget_fraction: params
                .calibration_grid
                .is_none()
                .then_some(params.design.budget_fraction),
            mean_levels: levels_sum / per_calibration,
            mean_seconds: seconds_sum / per_calibration,
        },
        kept_equal_workloads: kept_equal,
        infeasible_workloads: infeasible,
        events: events
            .iter()
            .enumerate()
            .map(|(e, (tally, kept, probe))| EventRow {
                event: e + 1,
                optimal_calibrated: mean(tally.value),
                gap_recovered: recovered(mean(tally.value), or),
                budget_violations: tally.violations,
                kept_equal: *kept,
                probe_cost_fraction: mean(*probe),
            })
            .collect(),
    })
}

/// Windows of probing one cap step below (and, within the margin, above) the assigned
/// cap, per job and event.
const PROBE_WINDOWS: usize = 4;

/// What an event's hold teaches: every window at a job's assigned cap is a reading, and
/// each job spends [`PROBE_WINDOWS`] windows one grid step below its cap (lower caps
/// never raise the budget's draw) and, while the planned margin covers the extra power
/// as estimated, one step above — one job at a time, so the margin covers each.
/// Returns the probes' token cost as a fraction of the workload's event tokens.
fn learn_during_event(
    picks: &[&TrueJob],
    caps: &[Watts],
    margin_w: f64,
    params: &EvaluateParams,
    windows: &mut [Vec<OperatingPoint>],
    rng: &mut SplitMix64,
) -> f64 {
    let window_s = params.design.window_s;
    let total = (params.event_hold_s / window_s).floor() as usize;
    let (mut lost, mut tokens) = (0.0, 0.0);
    for ((job, &cap), readings) in picks.iter().zip(caps).zip(windows.iter_mut()) {
        let below = job.grid.iter().copied().find(|c| c.0 < cap.0 - 1e-9);
        let above = job.grid.iter().rev().copied().find(|c| c.0 > cap.0 + 1e-9);
        let mut probes = 0;
        if let Some(b) = below {
            for _ in 0..PROBE_WINDOWS.min(total / 4) {
                readings.push(window(job, b, params.noise, rng));
            }
            probes += PROBE_WINDOWS.min(total / 4);
            let t_cap = job.curve.at(cap).throughput;
            lost += (t_cap - job.curve.at(b).throughput).max(0.0) / job.curve.uncapped().throughput
                * (PROBE_WINDOWS.min(total / 4) as f64 * window_s);
        }
        if let Some(a) = above {
            // The estimate's extra power at the step above, from what was read so far.
            let extra = estimate_from_windows(readings, params.noise)
                .map(|c| c.at(a).power_w.0 - c.at(cap).power_w.0)
                .unwrap_or(f64::INFINITY);
            if extra <= margin_w {
                for _ in 0..PROBE_WINDOWS.min(total / 4) {
                    readings.push(window(job, a, params.noise, rng));
                }
                probes += PROBE_WINDOWS.min(total / 4);
            }
        }
        for _ in probes..total {
            readings.push(window(job, cap, params.noise, rng));
        }
        tokens +=
            params.event_hold_s * job.curve.at(cap).throughput / job.curve.uncapped().throughput;
    }
    if tokens > 0.0 {
        lost / tokens
    } else {
        0.0
    }
}

fn spec(job: &TrueJob, curve: CapCurve, raw: bool) -> JobSpec {
    let weight = if raw {
        1.0
    } else {
        1.0 / curve.uncapped().throughput
    };
    JobSpec {
        id: job.name.clone(),
        gpus: job.gpus,
        curve,
        max_slowdown: None,
        limits: job.limits,
        throughput_weight: weight,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn calibration_caps_pick_nearest_measured() {
        let six = [200.0, 300.0, 400.0, 500.0, 600.0, 700.0];
        assert_eq!(
            calibration_caps(&six, &[1.0, 0.8, 0.6, 0.4]),
            vec![300.0, 400.0, 600.0, 700.0]
        );
        let four = [200.0, 500.0, 600.0, 700.0];
        assert_eq!(
            calibration_caps(&four, &[1.0, 0.8, 0.6, 0.4]),
            vec![200.0, 500.0, 600.0, 700.0]
        );
    }

    fn record(name: &str, pfi: f64) -> JobCurveRecord {
        let curve = CapCurve::from_pfi_prior(
            Watts(5600.0),
            1000.0,
            pfi,
            Watts(200.0),
            Watts(700.0),
            Watts(100.0),
        )
        .expect("prior");
        JobCurveRecord {
            job: name.to_string(),
            gpus: Some(8),
            tier: None,
            dram_copy_product: None,
            points: curve.knots().to_vec(),
            sigma: Vec::new(),
        }
    }

    #[test]
    fn rejects_bad_parameters() {
        let jobs = [record("a", 1.2)];
        let mut quiet = |_: usize, _: usize| {};
        let bad = |p: EvaluateParams| evaluate(&jobs, &p, &mut |_, _| {}).expect_err("rejected");
        assert_eq!(
            bad(EvaluateParams {
                cut: 1.0,
                ..Default::default()
            }),
            EvaluateError::BadCut(1.0)
        );
        assert_eq!(
            bad(EvaluateParams {
                workloads: 0,
                ..Default::default()
            }),
            EvaluateError::EmptyWorkload
        );
        assert!(matches!(
            bad(EvaluateParams {
                calibration_grid: Some(vec![1.5]),
                ..Default::default()
            }),
            EvaluateError::BadGrid(_)
        ));
        assert_eq!(
            bad(EvaluateParams {
                noise: -0.1,
                ..Default::default()
            }),
            EvaluateError::BadNoise(-0.1)
        );
        assert_eq!(
            bad(EvaluateParams {
                cap_step_w: Some(0.0),
                ..Default::default()
            }),
            EvaluateError::BadStep(0.0)
        );
        assert_eq!(
            bad(EvaluateParams {
                caution: Caution {
                    power_z: -1.0,
                    gain_z: 1.0
                },
                ..Default::default()
            }),
            EvaluateError::BadCaution {
                name: "power-z",
                value: -1.0
            }
        );
        assert_eq!(
            bad(EvaluateParams {
                events: 2,
                event_hold_s: 5.0,
                ..Default::default()
            }),
            EvaluateError::BadHold {
                hold_s: 5.0,
                window_s: 30.0
            }
        );
        assert!(matches!(
            bad(EvaluateParams {
                design: DesignParams {
                    budget_fraction: 0.9,
                    ..Default::default()
                },
                ..Default::default()
            }),
            EvaluateError::Design(DesignError::BadBudget(_))
        ));
        assert_eq!(
            evaluate(&[], &EvaluateParams::default(), &mut quiet),
            Err(EvaluateError::NoJobs)
        );
    }

    #[test]
    fn heterogeneous_jobs_open_a_gap_that_calibration_recovers() {
        let jobs = [
            record("dense", 1.1),
            record("mixed", 1.6),
            record("moe", 2.6),
        ];
        let params = EvaluateParams {
            workloads: 30,
            jobs_per_workload: 40,
            ..Default::default()
        };
        let mut calls = 0;
        let report = evaluate(&jobs, &params, &mut |_, _| calls += 1).expect("report");
        assert_eq!(calls, 30, "progress after every workload");
        assert!(report.oracle > report.equal);
        let gap = report
            .gap_recovered
            .optimal_calibrated
            .expect("gap defined");
        assert!(gap > 0.8, "recovered {gap}");
        assert_eq!(report.budget_violations.optimal_calibrated, 0);
        assert_eq!(report.infeasible_workloads, 0);
        assert!(report.power_over_budget.oracle <= 1.0 + 1e-9);
    }

    /// A knee-shaped job: flat to `knee` × 700 W, then throughput falls in proportion to
    /// the cap; power follows the cap. Measured every 25 W from 200 W, as real sets are.
    fn knee(name: &str, knee: f64) -> JobCurveRecord {
        let points = (0..=20)
            .map(|i| {
                let cap = 200.0 + 25.0 * f64::from(i);
                OperatingPoint {
                    cap_w: Watts(cap),
                    power_w: Watts(8.0 * cap.min(650.0)),
                    throughput: 1000.0 * (cap / (knee * 700.0)).min(1.0),
                }
            })
            .collect();
        JobCurveRecord {
            job: name.to_string(),
            gpus: Some(8),
            tier: None,
            dram_copy_product: None,
            points,
            sigma: Vec::new(),
        }
    }

    #[test]
    fn cap_space_scoring_reports_both_ceilings_and_the_calibration_cost() {
        let jobs = [knee("early", 0.45), knee("mid", 0.65), knee("late", 0.9)];
        let params = EvaluateParams {
            workloads: 12,
            jobs_per_workload: 30,
            cut: 0.2,
            ..Default::default()
        };
        let r = evaluate(&jobs, &params, &mut |_, _| {}).expect("report");
        assert!(r.power_space_optimum >= r.oracle - 1e-9, "{r:?}");
        assert!(r.oracle > r.equal, "{r:?}");
        assert!(r.optimal_calibrated >= r.equal, "{r:?}");
        assert_eq!(r.budget_violations.optimal_calibrated, 0);
        let c = r.calibration_cost;
        assert!(c.mean_fraction > 0.0 && c.max_fraction <= 0.02, "{c:?}");
        assert_eq!(c.budget_fraction, Some(0.02));
        assert_eq!(r.calibration, "designed");
    }

    #[test]
    fn events_refine_the_curves_the_decisions_depend_on() {
        let jobs = [knee("early", 0.45), knee("mid", 0.65), knee("late", 0.9)];
        let params = EvaluateParams {
            workloads: 8,
            jobs_per_workload: 30,
            cut: 0.3,
            noise: 0.03,
            events: 4,
            ..Default::default()
        };
        let r = evaluate(&jobs, &params, &mut |_, _| {}).expect("report");
        assert_eq!(r.events.len(), 4);
        let first = r.events[0].gap_recovered.expect("gap");
        let last = r.events[3].gap_recovered.expect("gap");
        assert!(
            (first - r.gap_recovered.optimal_calibrated.expect("gap")).abs() < 1e-12,
            "event 1 decides on the calibration alone"
        );
        assert!(last > first, "{:?}", r.events);
        assert!(
            r.events.iter().all(|e| e.budget_violations == 0),
            "{:?}",
            r.events
        );
    }

    #[test]
    fn measured_step_is_the_spacing_of_the_capped_points() {
        assert_eq!(measured_step(&[100.0, 125.0, 150.0, 260.0]), 25.0);
        assert_eq!(measured_step(&[200.0, 500.0, 600.0, 700.0]), 100.0);
        assert_eq!(measured_step(&[300.0, 700.0]), 400.0);
    }

    #[test]
    fn a_cut_below_every_lowest_cap_is_infeasible_not_a_violation() {
        let jobs = [record("a", 1.5)];
        let params = EvaluateParams {
            cut: 0.9, // 200/700 W is the lowest cap: a 71 % cut at most
            workloads: 5,
            jobs_per_workload: 3,
            ..Default::default()
        };
        let report = evaluate(&jobs, &params, &mut |_, _| {}).expect("report");
        assert_eq!(report.infeasible_workloads, 5);
        assert_eq!(report.gap_recovered.optimal_calibrated, None);
    }
}
