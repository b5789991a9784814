//! Offline evaluation of allocation policies: the paper's §6 experiment, on a site's own
//! measured curves, with one change that matters — every policy is scored on the *true*
//! curve at the cap it chose, so a policy that believes a job saves more power than it
//! really does shows up as a budget violation, not as a win.
//!
//! For each of `workloads` workloads, `jobs_per_workload` jobs are drawn with replacement
//! from the file; the budget is `(1 − cut) · Σ P_max`; each job's true curve is its
//! measured points, linearly interpolated in the cap. Policies:
//! - `equal`: every job's power cut by the same fraction (true curves);
//! - `pfi_proportional`: cut ∝ (P_max / T_max) · PFI, PFI from the full true curve;
//! - `optimal_calibrated`: each job is observed only at the measured caps nearest the
//!   calibration grid's fractions of its maximum cap, plus its uncapped point, with
//!   multiplicative gaussian noise on power and throughput; its curve is estimated from
//!   those observations (with the population shrinkage of [`estimate_population`]), and
//!   the optimal policy allocates on the estimates;
//! - `oracle`: the optimal policy on the true curves.
//!
//! A workload whose true power exceeds the budget by more than 0.5 % is a budget
//! violation for that policy. A workload whose budget is below the power of every job at
//! its lowest measured cap is infeasible: it is counted and left out of the means.

use serde::Serialize;

use crate::allocate::{allocate, hedged_budget, CapLimits, JobSpec, Policy};
use crate::curve::{estimate_population, CapCurve, JobReadings, OperatingPoint};
use crate::curves_csv::JobCurveRecord;
use crate::rng::SplitMix64;
use crate::units::Watts;

/// Standard deviations of summed-power error that `optimal_calibrated` keeps in hand.
/// Measured on the paper-derived synthetic curves and on an independently generated
/// family: 1.5 keeps every workload within the violation tolerance at noise up to 3 %
/// while giving up about one point of the gap at 1 % noise.
pub const HEDGE_Z: f64 = 1.5;

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
    /// Calibration caps as fractions of each job's maximum cap, in (0, 1].
    pub calibration_grid: Vec<f64>,
    /// One standard deviation of multiplicative observation noise, e.g. 0.01.
    pub noise: f64,
    /// Score raw throughput (tokens/s) instead of per-job normalised T / T_max.
    pub raw: bool,
    /// Cap granularity, W per GPU.
    pub cap_step_w: f64,
}

impl Default for EvaluateParams {
    fn default() -> Self {
        EvaluateParams {
            cut: 0.3,
            jobs_per_workload: 100,
            workloads: 500,
            seed: 1,
            calibration_grid: vec![1.0, 0.8, 0.6, 0.4],
            noise: 0.01,
            raw: false,
            cap_step_w: 1.0,
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

/// Share of the equal→oracle gap a policy recovers: (policy − equal) / (oracle − equal).
/// `None` when the oracle gains nothing over equal.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct GapRecovered {
    pub pfi_proportional: Option<f64>,
    pub optimal_calibrated: Option<f64>,
}

/// The experiment's result. JSON keys are part of the CLI's interface.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct EvaluateReport {
    pub cut: f64,
    pub workloads: usize,
    pub jobs_per_workload: usize,
    pub seed: u64,
    pub noise: f64,
    /// "normalised" (Σ T/T_max per workload) or "raw" (Σ tokens/s per workload).
    pub throughput: &'static str,
    /// Mean total throughput per feasible workload.
    pub equal: f64,
    pub pfi_proportional: f64,
    pub optimal_calibrated: f64,
    pub oracle: f64,
    pub gap_recovered: GapRecovered,
    pub budget_violations: PerPolicy<usize>,
    /// Mean Σ true power / budget per feasible workload.
    pub power_over_budget: PerPolicy<f64>,
    pub infeasible_workloads: usize,
}

/// A job as the experiment sees it.
#[derive(Debug)]
struct TrueJob {
    name: String,
    gpus: u32,
    curve: CapCurve,
    limits: CapLimits,
    caps: Vec<f64>,
}

fn prepare_jobs(records: &[JobCurveRecord], step: f64) -> Result<Vec<TrueJob>, EvaluateError> {
    records
        .iter()
        .map(|r| {
            let curve = CapCurve::from_points(&r.points).map_err(|e| EvaluateError::BadJob {
                job: r.job.clone(),
                message: e.to_string(),
            })?;
            let caps: Vec<f64> = curve.knots().iter().map(|k| k.cap_w.0).collect();
            let limits = CapLimits {
                min_w: curve.lowest().cap_w,
                max_w: curve.uncapped().cap_w,
                step_w: Watts(step),
            };
            Ok(TrueJob {
                name: r.job.clone(),
                gpus: r.gpus.unwrap_or(1),
                curve,
                limits,
                caps,
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
    let grid_ok = !params.calibration_grid.is_empty()
        && params
            .calibration_grid
            .iter()
            .all(|f| f.is_finite() && *f > 0.0 && *f <= 1.0);
    if !grid_ok {
        return Err(EvaluateError::BadGrid(format!(
            "{:?}",
            params.calibration_grid
        )));
    }
    if !(params.noise.is_finite() && (0.0..0.5).contains(&params.noise)) {
        return Err(EvaluateError::BadNoise(params.noise));
    }
    if !(params.cap_step_w.is_finite() && params.cap_step_w > 0.0) {
        return Err(EvaluateError::BadStep(params.cap_step_w));
    }
    Ok(())
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
    let mut sums = PerPolicy {
        equal: 0.0,
        pfi_proportional: 0.0,
        optimal_calibrated: 0.0,
        oracle: 0.0,
    };
    let mut power_ratio = sums;
    let mut violations = PerPolicy {
        equal: 0,
        pfi_proportional: 0,
        optimal_calibrated: 0,
        oracle: 0,
    };
    let mut feasible = 0usize;
    let mut infeasible = 0usize;
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
        // Observations are drawn for every workload, feasible or not, so the random
        // stream (and so every later workload) does not depend on feasibility.
        let observations: Vec<JobReadings> = picks
            .iter()
            .map(|j| JobReadings {
                points: observe(j, params, &mut rng),
                min_cap_w: j.limits.min_w,
                cap_grid_w: j.caps.iter().map(|&c| Watts(c)).collect(),
            })
            .collect();
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
        let estimated = estimate_population(&observations, params.noise);
        let calibrated_specs: Vec<JobSpec> = picks
            .iter()
            .zip(estimated)
            .map(|(j, curve)| spec(j, curve, params.raw))
            .collect();
        let budget_w = Watts(budget);
        let planned_w = hedged_budget(budget_w, &calibrated_specs, params.noise, HEDGE_Z);
        let run = |specs: &[JobSpec], policy: Policy, budget_w: Watts| -> Vec<f64> {
            allocate(specs, budget_w, policy)
                .map(|a| a.jobs.iter().map(|j| j.cap_w.0).collect())
                .unwrap_or_else(|_| picks.iter().map(|j| j.curve.uncapped().cap_w.0).collect())
        };
        let caps = PerPolicy {
            equal: run(&true_specs, Policy::Equal, budget_w),
            pfi_proportional: run(&true_specs, Policy::PfiProportional, budget_w),
            optimal_calibrated: run(&calibrated_specs, Policy::Optimal, planned_w),
            oracle: run(&true_specs, Policy::Optimal, budget_w),
        };
        let score = |caps: &[f64], sum: &mut f64, ratio: &mut f64, violated: &mut usize| {
            let (mut power, mut value) = (0.0, 0.0);
            for (job, &cap) in picks.iter().zip(caps) {
                let at = job.curve.at(Watts(cap));
                power += at.power_w.0;
                value += if params.raw {
                    at.throughput
                } else {
                    at.throughput / job.curve.uncapped().throughput
                };
            }
            *sum += value;
            *ratio += power / budget;
            if power > budget * (1.0 + VIOLATION_TOLERANCE) {
                *violated += 1;
            }
        };
        score(
            &caps.equal,
            &mut sums.equal,
            &mut power_ratio.equal,
            &mut violations.equal,
        );
        score(
            &caps.pfi_proportional,
            &mut sums.pfi_proportional,
            &mut power_ratio.pfi_proportional,
            &mut violations.pfi_proportional,
        );
        score(
            &caps.optimal_calibrated,
            &mut sums.optimal_calibrated,
            &mut power_ratio.optimal_calibrated,
            &mut violations.optimal_calibrated,
        );
        score(
            &caps.oracle,
            &mut sums.oracle,
            &mut power_ratio.oracle,
            &mut violations.oracle,
        );
        progress(w + 1, params.workloads);
    }
    let n = feasible.max(1) as f64;
    let mean = |x: f64| x / n;
    let (equal, pfi, cal, oracle) = (
        mean(sums.equal),
        mean(sums.pfi_proportional),
        mean(sums.optimal_calibrated),
        mean(sums.oracle),
    );
    let gap = oracle - equal;
    let recovered = |v: f64| {
        if feasible > 0 && gap.abs() > 1e-12 * oracle.abs().max(1.0) {
            Some((v - equal) / gap)
        } else {
            None
        }
    };
    Ok(EvaluateReport {
        cut: params.cut,
        workloads: params.workloads,
        jobs_per_workload: params.jobs_per_workload,
        seed: params.seed,
        noise: params.noise,
        throughput: if params.raw { "raw" } else { "normalised" },
        equal,
        pfi_proportional: pfi,
        optimal_calibrated: cal,
        oracle,
        gap_recovered: GapRecovered {
            pfi_proportional: recovered(pfi),
            optimal_calibrated: recovered(cal),
        },
        budget_violations: violations,
        power_over_budget: PerPolicy {
            equal: mean(power_ratio.equal),
            pfi_proportional: mean(power_ratio.pfi_proportional),
            optimal_calibrated: mean(power_ratio.optimal_calibrated),
            oracle: mean(power_ratio.oracle),
        },
        infeasible_workloads: infeasible,
    })
}

fn observe(job: &TrueJob, params: &EvaluateParams, rng: &mut SplitMix64) -> Vec<OperatingPoint> {
    calibration_caps(&job.caps, &params.calibration_grid)
        .into_iter()
        .map(|c| {
            let truth = job.curve.at(Watts(c));
            OperatingPoint {
                cap_w: Watts(c),
                power_w: truth.power_w * (1.0 + params.noise * rng.normal()).max(0.01),
                throughput: truth.throughput * (1.0 + params.noise * rng.normal()).max(0.01),
            }
        })
        .collect()
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
                calibration_grid: vec![1.5],
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
                cap_step_w: 0.0,
                ..Default::default()
            }),
            EvaluateError::BadStep(0.0)
        );
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
