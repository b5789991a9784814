//! The allocator's view of each job it steers: its curve (measured or a prior, with
//! the agents' standard errors), its power as the budget mode counts it, its bounds.

use std::collections::{BTreeMap, BTreeSet};

use powerflex_core::allocate::{validate_spec, CapLimits, JobSpec};
use powerflex_core::config::{BudgetMode, Objective};
use powerflex_core::curve::{estimate_population, CapCurve, CurveSource, JobReadings, KnotSigma};
use powerflex_core::flex::{parse_power_flex, Preempt};
use powerflex_core::point::OperatingPoint;
use powerflex_core::workload::chord_loss;
use powerflex_core::Watts;

use crate::drift::{drift, DRIFT_BAND};
use crate::gather::SiteJob;
use crate::{Held, SiteSettings, TierBounds};
use powerflex_proto::status::{Drift, Rejected};

/// One standard deviation of a calibration reading (power or throughput), as a fraction:
/// the paper's repeat-run noise is ~0.5 %; the agent's 5-30 s holds are noisier.
const MEASUREMENT_NOISE: f64 = 0.01;

/// The share of a GPU's highest power limit taken as its static draw: what it draws
/// under a job's load at its lowest clock, where the job's progress may be nil. Below its
/// lowest measured cap a job's throughput is bounded by the chord from this draw (at zero
/// throughput) to its lowest reading, which is a lower bound wherever throughput is
/// concave in power above it (the clock, and with it the speed, rises ever more slowly
/// with power as voltage rises). Set high rather than low: a higher anchor only makes
/// the bound more pessimistic. A quarter holds with room for the GPUs the project models
/// or measured: the H200 profiles' 150 W of 700 W (21 %), and the dev set's V100 and
/// RTX 6000 curves, still running at half speed or more at their 100 W minimum (a third
/// of 300 W, of 260 W).
pub(crate) const STATIC_SHARE: f64 = 0.25;

/// The allocator's view of the jobs it steers: one spec per job with a usable range
/// and curve (measured points where every node of the job measured them, else a prior
/// from its PFI), the jobs whose draw or speed left their curves, and whether the
/// objective is raw tokens/s (every steered job counts tokens). A job the allocator
/// cannot take is refused here, not allowed to cost the others their allocation.
pub(crate) struct Specs {
    pub(crate) specs: Vec<JobSpec>,
    pub(crate) drifted: Vec<Drift>,
    pub(crate) raw_tokens: bool,
    /// The jobs whose curve says nothing the optimiser may trade on: a prior (never
    /// measured on every node) or a curve the job's measurements have left. Each gets its
    /// cap in the equal split.
    pub(crate) in_doubt: BTreeSet<String>,
    /// The jobs whose tier allows them to be held out (never a bound of 0), with what
    /// they count at once held out, as the preemption planner counts them after its
    /// grace: idle draw ([`SUSPENDED_SHARE_OF_DEFAULT`] of their default limits) in
    /// metered mode, their lowest cap on every GPU in hard mode (which trusts no meter), W.
    pub(crate) preemptable_held_w: BTreeMap<String, f64>,
}

/// An idle GPU's draw as a share of its default limit, for a job held out: an idle
/// H100/H200 draws 60-100 W of 700 W (the simulator: 75 W); 15 % is 105 W.
pub const SUSPENDED_SHARE_OF_DEFAULT: f64 = 0.15;

pub(crate) fn job_specs(
    jobs: &BTreeMap<String, SiteJob>,
    settings: &SiteSettings,
    held: &Held,
    rejected: &mut Vec<Rejected>,
) -> Specs {
    // The jobs the allocation can steer, and their measured points (caps every node of
    // the job measured: part of a job's power is no estimate of all of it).
    let mut steerable: Vec<(&String, &SiteJob, powerflex_core::flex::FlexRequest)> = Vec::new();
    let mut readings = Vec::new();
    for (id, job) in jobs {
        let Ok(request) = parse_power_flex(&job.tier, &settings.tiers) else {
            continue;
        };
        if job.gpus == 0 || job.max_cap == f64::MAX || job.max_cap <= 0.0 {
            continue;
        }
        if held.contains_key(id.as_str()) {
            continue;
        }
        if job.min_cap > job.max_cap {
            // Its nodes' GPUs share no limit: one cap everywhere cannot be set.
            for node in &job.nodes {
                rejected.push(Rejected {
                    node: node.clone(),
                    job: Some(id.to_string()),
                    reason: "the job's GPUs on its nodes have no power limit in common".to_string(),
                });
            }
            continue;
        }
        let points = measured_points(job);
        if points.len() >= 2 {
            readings.push(JobReadings {
                points,
                min_cap_w: Watts(job.min_cap),
                cap_grid_w: Vec::new(),
                zero_throughput_w: Watts(STATIC_SHARE * job.max_cap * f64::from(job.gpus)),
                gpus: job.gpus,
            });
        }
        steerable.push((id, job, request));
    }
    let mut measured = estimate_population(&readings, MEASUREMENT_NOISE).into_iter();
    let mut curves = Vec::new();
    for (_, job, _) in &steerable {
        let has_points = measured_points(job).len() >= 2;
        let curve = if has_points {
            measured.next().map(|c| with_measured_sigma(c, job))
        } else {
            None
        }
        .or_else(|| {
            CapCurve::from_pfi_prior(
                Watts(job.max_cap * f64::from(job.gpus)),
                job.throughput.unwrap_or(1.0),
                prior_pfi(job, settings),
                Watts(job.min_cap),
                Watts(job.max_cap),
                Watts(50.0),
            )
            .ok()
        });
        curves.push(curve);
    }
    // Tokens/s add up across jobs; steps/s (or a job with no throughput yet) do not.
    let raw_tokens = settings.objective == Objective::Tokens
        && steerable.iter().zip(&curves).all(|((_, job, _), curve)| {
            curve.is_none() || (job.counts_tokens && job.throughput.is_some())
        });
    let mut specs = Vec::new();
    let mut drifted = Vec::new();
    let mut in_doubt = BTreeSet::new();
    let mut preemptable_held_w = BTreeMap::new();
    for ((id, job, request), curve) in steerable.iter().zip(curves) {
        let Some(curve) = curve else { continue };
        // Drift is judged on what was measured, not on the top knot added below (a job
        // raised to its maximum would read far below that knot's bound and be flagged).
        let curve = match drift(id, job, &curve) {
            Some(d) => {
                drifted.push(d);
                in_doubt.insert((*id).clone());
                // Its measurements left the curve (a new phase, most often): nothing
                // the curve says about its slowdown holds, so its floor comes from what
                // physics guarantees above its current rate, the chord.
                chord_curve(job, &curve).unwrap_or(curve)
            }
            // A new step may be a new phase, which runs on a curve nobody has read: until
            // a window after it answers, its floor is the chord's as after a drift (the
            // agent reports the step at once, so this plan comes before the new phase has
            // run long at its old phase's cap).
            None if job.curve_in_question => {
                in_doubt.insert((*id).clone());
                chord_curve(job, &curve).unwrap_or(curve)
            }
            None => {
                // A curve never read at the GPUs' highest limit knows no uncapped rate:
                // its floor is set against the most that rate may be, and it is not
                // traded on.
                let (curve, unread_top) = with_unread_top(curve, job);
                if unread_top {
                    in_doubt.insert((*id).clone());
                }
                curve
            }
        };
        if curve.source() == powerflex_core::curve::CurveSource::Prior {
            in_doubt.insert((*id).clone());
        }
        let curve = power_as_budgeted(&curve, job, settings.budget_mode);
        let bounded = request.service.max_slowdown().is_some_and(|b| b.0 > 0.0);
        if bounded && settings.tiers.preempt_for(request) != Preempt::Never {
            let held_w = match settings.budget_mode {
                BudgetMode::Metered { .. } => job.default_w * SUSPENDED_SHARE_OF_DEFAULT,
                BudgetMode::Hard => job.min_cap * f64::from(job.gpus),
            };
            preemptable_held_w.insert((*id).clone(), held_w);
        }
        specs.push(JobSpec {
            id: (*id).clone(),
            gpus: job.gpus,
            throughput_weight: if raw_tokens {
                1.0
            } else {
                1.0 / curve.uncapped().throughput.max(1e-9)
            },
            curve,
            max_slowdown: match settings.tier_bounds {
                TierBounds::Honoured => request.service.max_slowdown(),
                TierBounds::Ignored => None,
            },
            limits: CapLimits {
                min_w: Watts(job.min_cap),
                max_w: Watts(job.max_cap),
                step_w: settings.cap_step,
            },
        });
    }
    // One job the allocator cannot take must not cost every other job its allocation.
    specs.retain(|spec| match validate_spec(spec) {
        Ok(()) => true,
        Err(e) => {
            for node in jobs
                .get(&spec.id)
                .map(|j| j.nodes.clone())
                .unwrap_or_default()
            {
                rejected.push(Rejected {
                    node,
                    job: Some(spec.id.clone()),
                    reason: e.to_string(),
                });
            }
            false
        }
    });
    preemptable_held_w.retain(|id, _| specs.iter().any(|s| &s.id == id));
    Specs {
        specs,
        drifted,
        raw_tokens,
        in_doubt,
        preemptable_held_w,
    }
}

/// The least share of the uncapped rate a reading is taken to keep (see
/// [`with_unread_top`]).
const MIN_KEPT_SHARE: f64 = 0.05;

/// `curve` for a job never read at its GPUs' highest limit (its curve was measured only
/// under a cut: a walk or learning after its old windows were set aside) with a knot at
/// that limit running as fast as concavity allows: at most its highest reading scaled by
/// the chord from the GPUs' static draw, `T(c_hi) × (max − s) / (c_hi − s)`. Its tier
/// floor is then set against the most its uncapped rate may be, not against its highest
/// reading (the flat extension), which would put the floor too low by as much as the
/// cut the readings were taken under.
///
/// Returns whether the knot was added. A prior (built up to the limit) is left as is.
fn with_unread_top(curve: CapCurve, job: &SiteJob) -> (CapCurve, bool) {
    let top = curve.uncapped();
    if curve.source() == CurveSource::Prior || top.cap_w.0 >= job.max_cap - 0.5 {
        return (curve, false);
    }
    // A reading at or below the static draw bounds the uncapped rate by nothing: taken
    // as at most twenty times it, which leaves no floor below the maximum for any bound.
    let kept = (1.0 - chord_loss(top.cap_w.0, STATIC_SHARE * job.max_cap, job.max_cap, 0.0))
        .max(MIN_KEPT_SHARE);
    let extended = curve.with_unread_top(
        Watts(job.max_cap),
        Watts(job.max_cap * f64::from(job.gpus)),
        top.throughput / kept,
    );
    let added = extended.knots().len() > curve.knots().len();
    (extended, added)
}

/// The PFI a job without a measured curve is planned on: its own (measured on every
/// node, or the agents' prior), else the site's default; never flatter than the chord
/// from the GPUs' static draw (PFI `1 − STATIC_SHARE`) while the job is being walked:
/// before its first walk, or after a phase change set its old windows aside, nothing
/// measured says its curve is flatter than what physics guarantees (nor while a new step
/// has its curve in question), and a floor on a flatter guess may cut a steep job past its bound (the demo's job 4, its new phase
/// on the site's default PFI of 1.3, ran 38 % slow against a 25 % bound).
fn prior_pfi(job: &SiteJob, settings: &SiteSettings) -> f64 {
    let pfi = job.planning_pfi().unwrap_or(settings.default_pfi).max(0.5);
    if job.calibrating || job.curve_in_question {
        pfi.min(1.0 - STATIC_SHARE)
    } else {
        pfi
    }
}

/// The curve a job is planned on once its measurements have left its measured curve
/// `left`: throughput along the chord from the GPUs' static draw ([`STATIC_SHARE`] of
/// their highest limit, where progress may be nil) to the uncapped point, scaled by the
/// job's current rate. Whatever its new curve is, if it is concave above the static draw
/// it lies on or above this chord, so the tier floor this curve gives
/// (`static + (1 − bound) × (max − static)` per GPU) holds on the job's true curve; the
/// curve it left may put that floor anywhere (in the demo, a phase ten times slower ran
/// 27–32 % slow at its old phase's floor against a 25 % bound). Power stays as `left`
/// measured it, budgeted as a measured curve is (a draw far below it, an idle job
/// between steps, buys no raise).
fn chord_curve(job: &SiteJob, left: &CapCurve) -> Option<CapCurve> {
    // The scale does not move the floor; a job that drifted on power alone, with no
    // rate reported, takes the curve's own.
    let rate = [job.throughput, Some(left.uncapped().throughput)]
        .into_iter()
        .flatten()
        .find(|t| t.is_finite() && *t > 0.0)?;
    let zero_cap_w = STATIC_SHARE * job.max_cap;
    let point = |cap: f64| OperatingPoint {
        cap_w: Watts(cap),
        power_w: left.at(Watts(cap)).power_w,
        throughput: rate * (1.0 - chord_loss(cap, zero_cap_w, job.max_cap, 0.0)).max(0.01),
    };
    let mut knots = Vec::new();
    let mut cap = job.max_cap;
    while cap > job.min_cap + 1e-9 {
        knots.push(point(cap));
        cap -= CHORD_KNOT_STEP_W;
    }
    knots.push(point(job.min_cap));
    CapCurve::with_source(&knots, CurveSource::Estimated, left.relative_uncertainty()).ok()
}

/// The spacing of a chord curve's knots, W: the chord is a straight line, so knots only
/// carry the power `left` measured between them.
const CHORD_KNOT_STEP_W: f64 = 50.0;

/// The caps every node of `job` measured (part of a job's power is no estimate of all of
/// it), with a usable power and throughput: a window that made no progress or read no
/// power says nothing about the curve, and one such reading must not cost the job the
/// rest of its curve (the estimator refuses a set that holds one).
fn measured_points(job: &SiteJob) -> Vec<OperatingPoint> {
    let nodes = job.nodes.len();
    let usable = |x: f64| x.is_finite() && x > 0.0;
    job.points
        .iter()
        .filter(|(_, &(power, throughput, n))| n == nodes && usable(power) && usable(throughput))
        .map(|(&cap, &(power, throughput, _))| OperatingPoint {
            cap_w: Watts(cap as f64),
            power_w: Watts(power),
            throughput,
        })
        .filter(|p| usable(p.cap_w.0))
        .collect()
}

/// The job's curve with its power as the budget mode counts it.
/// - `Hard`: every GPU at its cap, `cap × GPUs`, whatever the job draws.
/// - `Metered`: the curve's power scaled by what the job draws now over what the curve
///   predicts at the cap in force (a job drawing below its curve leaves headroom to
///   others; one drawing above it, after a phase change, is paid for at once), and never
///   above `cap × GPUs`, which no job averages above.
fn power_as_budgeted(curve: &CapCurve, job: &SiteJob, mode: BudgetMode) -> CapCurve {
    let gpus = f64::from(job.gpus);
    match mode {
        BudgetMode::Hard => curve.map_power(|cap, _| Watts(cap.0 * gpus)),
        BudgetMode::Metered { .. } => {
            let predicted_now = job.cap_now_w.map(|c| curve.at(Watts(c)).power_w.0);
            let ratio = match predicted_now {
                Some(p) if job.power_from_every_node && p > 0.0 && job.power_w > 0.0 => {
                    let measured = (job.power_w / p).clamp(0.05, 10.0);
                    // Bad news is believed at once; good news (a job drawing less than its
                    // curve says) only once the cap it was measured at has settled: a draw
                    // sampled just after a cap rose still shows the lower cap.
                    //
                    // A job drawing far less than its measured curve says (idle between
                    // two steps, stalled on input) is not believed at all: its curve no
                    // longer describes it, and scaled by that draw every cap would look
                    // nearly free: the job would be raised while idle, and its next load
                    // come up at the raised cap on top of the watts its idle draw had lent
                    // the others (an overshoot the demo's job 4 shows). It is
                    // budgeted at its curve until its draw is back in the band or it has
                    // been walked again (drift sends it to be, where the job runs at a
                    // cap it was measured at). A prior is only a guess:
                    // there the meter is the better word, and is taken.
                    let far_below = curve.source() != powerflex_core::curve::CurveSource::Prior
                        && measured < 1.0 - DRIFT_BAND;
                    if job.power_steady && !far_below {
                        measured
                    } else {
                        measured.max(1.0)
                    }
                }
                _ => 1.0,
            };
            // A job drawing more than its curve says has a shape the curve no longer
            // knows (it was walked in a lighter phase): one ratio taken at a low cap then
            // predicts too little at the higher ones, and the job is raised, goes over,
            // is cut and raised again. Until it is walked again, budget each cap at least
            // at the measured draw scaled by the cap, the most a cap-bound GPU adds.
            let per_cap_w = match job.cap_now_w {
                Some(c) if ratio > 1.0 && c > 0.0 => job.power_w / c,
                _ => 0.0,
            };
            curve.map_power(|cap, power| {
                Watts((power.0 * ratio).max(per_cap_w * cap.0).min(cap.0 * gpus))
            })
        }
    }
}

/// `curve` with per-knot standard errors from what every node of `job` measured (their
/// variances add, as their powers and throughputs do). Between measured caps the error
/// is interpolated; a knot below the lowest measured cap (extrapolated) gets twice the
/// lowest one's; above the highest, the highest one's. A job whose agents sent no
/// uncertainty (older agents) keeps the curve's relative uncertainty.
fn with_measured_sigma(curve: CapCurve, job: &SiteJob) -> CapCurve {
    let nodes = job.nodes.len();
    let measured: Vec<(f64, KnotSigma)> = job
        .sigma
        .iter()
        .filter(|(_, (_, _, n))| *n == nodes)
        .map(|(&cap, &(vp, vt, _))| {
            (
                cap as f64,
                KnotSigma {
                    power_w: vp.sqrt(),
                    throughput: vt.sqrt(),
                },
            )
        })
        .collect();
    let (Some(&(lo_cap, lo)), Some(&(_, hi))) = (measured.first(), measured.last()) else {
        return curve;
    };
    curve.with_knot_sigma(|cap| {
        let c = cap.0;
        if c < lo_cap - 0.5 {
            return KnotSigma {
                power_w: 2.0 * lo.power_w,
                throughput: 2.0 * lo.throughput,
            };
        }
        let above = measured.partition_point(|(m, _)| *m < c - 0.5);
        match (
            above.checked_sub(1).map(|i| measured[i]),
            measured.get(above),
        ) {
            (_, Some(&(m, s))) if (m - c).abs() <= 0.5 => s,
            (Some((a, sa)), Some(&(b, sb))) => {
                let f = (c - a) / (b - a);
                KnotSigma {
                    power_w: sa.power_w + f * (sb.power_w - sa.power_w),
                    throughput: sa.throughput + f * (sb.throughput - sa.throughput),
                }
            }
            _ => hi,
        }
    })
}
