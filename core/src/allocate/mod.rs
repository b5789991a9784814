//! Allocation: a facility budget and a set of jobs in, one per-GPU cap per job out.

use std::fmt;

mod room;

pub use room::{DomainLimit, DomainUse};
use room::{Room, SITE};

/// A named allocation policy. Names are the ones sites write in `powerflex.toml` and pass
/// to `powerflexctl --policy`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Policy {
    /// Maximise Σ tokens/s on the estimated curves under the budget and tier floors.
    Optimal,
    /// The paper's baseline: each job's cut in proportion to its uncapped power.
    Equal,
    /// The paper's Eq. 2: each job's cut in proportion to (P_max / T_max) · PFI.
    PfiProportional,
}

impl Policy {
    /// Every accepted name, in the order help texts list them.
    pub const NAMES: [&'static str; 3] = ["optimal", "equal", "pfi-proportional"];

    /// Looks a policy up by its config/CLI name.
    pub fn from_name(name: &str) -> Option<Policy> {
        match name {
            "optimal" => Some(Policy::Optimal),
            "equal" => Some(Policy::Equal),
            "pfi-proportional" => Some(Policy::PfiProportional),
            _ => None,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Policy::Optimal => "optimal",
            Policy::Equal => "equal",
            Policy::PfiProportional => "pfi-proportional",
        }
    }
}

impl fmt::Display for Policy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

use std::cmp::Ordering;
use std::collections::BinaryHeap;

use serde::{Deserialize, Serialize};

use crate::curve::CapCurve;
use crate::point::OperatingPoint;
use crate::units::{SlowdownFraction, Watts};

/// The per-GPU caps a job's GPUs accept: NVML's constraints and the site's granularity.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct CapLimits {
    /// Lowest cap, W per GPU.
    pub min_w: Watts,
    /// Highest cap (the uncapped setting), W per GPU.
    pub max_w: Watts,
    /// Granularity: caps are `min_w + k·step_w`, plus `max_w` itself, W.
    pub step_w: Watts,
}

impl CapLimits {
    fn validate(&self, job: &str) -> Result<(), AllocationError> {
        let ok = self.min_w.0.is_finite()
            && self.max_w.0.is_finite()
            && self.step_w.0.is_finite()
            && self.min_w.0 > 0.0
            && self.min_w.0 <= self.max_w.0
            && self.step_w.0 > 0.0;
        if ok {
            Ok(())
        } else {
            Err(AllocationError::BadLimits {
                job: job.to_string(),
                min_w: self.min_w.0,
                max_w: self.max_w.0,
                step_w: self.step_w.0,
            })
        }
    }

    /// The highest grid cap ≤ `cap` (at least `min_w`).
    pub fn snap_down(&self, cap: f64) -> f64 {
        if cap >= self.max_w.0 {
            return self.max_w.0;
        }
        if cap <= self.min_w.0 {
            return self.min_w.0;
        }
        let k = ((cap - self.min_w.0) / self.step_w.0 + 1e-9).floor();
        (self.min_w.0 + k * self.step_w.0).min(self.max_w.0)
    }

    /// The lowest grid cap ≥ `cap` (at most `max_w`).
    pub fn snap_up(&self, cap: f64) -> f64 {
        if cap <= self.min_w.0 {
            return self.min_w.0;
        }
        let k = ((cap - self.min_w.0) / self.step_w.0 - 1e-9).ceil();
        (self.min_w.0 + k * self.step_w.0).min(self.max_w.0)
    }

    /// Number of grid caps strictly above `cap` up to and including `upper`, and the i-th
    /// of them (1-based) — used to binary-search caps between two grid points.
    fn nth_above(&self, cap: f64, i: usize) -> f64 {
        let k = ((cap - self.min_w.0) / self.step_w.0 + 1e-9).floor() + i as f64;
        (self.min_w.0 + k * self.step_w.0).min(self.max_w.0)
    }

    fn count_between(&self, from: f64, to: f64) -> usize {
        if to <= from {
            return 0;
        }
        let k_from = ((from - self.min_w.0) / self.step_w.0 + 1e-9).floor();
        let k_to = ((to - self.min_w.0) / self.step_w.0 + 1e-9).floor();
        let mut n = (k_to - k_from).max(0.0) as usize;
        // `max_w` off the step grid is one more cap.
        if to >= self.max_w.0 && self.snap_down_strict(self.max_w.0) < self.max_w.0 {
            n += 1;
        }
        n
    }

    fn snap_down_strict(&self, cap: f64) -> f64 {
        let k = ((cap - self.min_w.0) / self.step_w.0 + 1e-9).floor();
        self.min_w.0 + k * self.step_w.0
    }
}

/// One job as the allocator sees it.
#[derive(Debug, Clone, PartialEq)]
pub struct JobSpec {
    /// Slurm job id (or any unique name).
    pub id: String,
    /// GPUs the job runs on (all get the same cap).
    pub gpus: u32,
    /// The job's curve: per-GPU cap → summed power, throughput.
    pub curve: CapCurve,
    /// The tier's bound; `None` = no floor (any slowdown acceptable).
    pub max_slowdown: Option<SlowdownFraction>,
    /// The caps its GPUs accept.
    pub limits: CapLimits,
    /// Objective weight of one unit of this job's throughput: 1 to maximise raw tokens/s,
    /// `1 / T_max` to maximise the sum of normalised throughputs.
    pub throughput_weight: f64,
}

/// What an allocation maximised: the site's config asks for an [`crate::config::Objective`],
/// and a decision says which one it could honour (tokens fall back to relative speed
/// while any managed job reports only steps).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum Maximised {
    /// The site's total tokens/s: every managed job reports tokens.
    #[serde(rename = "tokens/s")]
    TokensPerS,
    /// The sum of each job's throughput over its uncapped throughput (some jobs report
    /// only steps, which do not add up across jobs).
    #[serde(rename = "relative-speed")]
    RelativeSpeed,
}

impl Maximised {
    pub fn name(self) -> &'static str {
        match self {
            Maximised::TokensPerS => "tokens/s",
            Maximised::RelativeSpeed => "relative-speed",
        }
    }
}

/// Whether a job's tier bound held (on the wire too: `what-if` and `status` carry it).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(tag = "state", rename_all = "kebab-case")]
pub enum FloorStatus {
    /// The job has no bound.
    None,
    /// Slowdown within the bound.
    Held,
    /// The budget could not meet the bound: slowdown exceeds it by `excess` (a fraction
    /// of uncapped throughput).
    Broken { excess: f64 },
}

impl FloorStatus {
    pub fn is_broken(&self) -> bool {
        matches!(self, FloorStatus::Broken { .. })
    }
}

/// The decision for one job.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct JobAllocation {
    pub id: String,
    /// Per-GPU cap, W.
    pub cap_w: Watts,
    /// Summed power expected at that cap on the job's curve, W.
    pub power_w: Watts,
    /// Throughput expected at that cap.
    pub throughput: f64,
    /// `1 − throughput / uncapped throughput`.
    pub slowdown: f64,
    pub max_slowdown: Option<SlowdownFraction>,
    pub floor: FloorStatus,
}

/// The result of one allocation (on the wire too: the answer to `what-if`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Allocation {
    pub policy: Policy,
    pub budget_w: Watts,
    /// One entry per input job, in input order.
    pub jobs: Vec<JobAllocation>,
    /// Σ expected power, W. Never above the budget unless `over_budget_w > 0`.
    pub total_power_w: Watts,
    /// Σ throughput_weight · throughput.
    pub objective: f64,
    /// By how much the budget is short even with every job at its lowest cap (0 when the
    /// budget is feasible). The allocation then holds every job at its lowest cap.
    pub over_budget_w: Watts,
    /// What the caps put through each power domain, in the order the domains were given
    /// (none without domains).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub domains: Vec<DomainUse>,
}

impl Allocation {
    /// Jobs whose bound the budget could not meet.
    pub fn broken_floors(&self) -> impl Iterator<Item = &JobAllocation> {
        self.jobs
            .iter()
            .filter(|j| matches!(j.floor, FloorStatus::Broken { .. }))
    }
}

/// Why an allocation could not be computed.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum AllocationError {
    #[error("budget must be a finite, non-negative number of watts (got {budget_w})")]
    BadBudget { budget_w: f64 },
    #[error("job {job}: cap limits min {min_w} W, max {max_w} W, step {step_w} W are invalid (need 0 < min ≤ max and step > 0)")]
    BadLimits {
        job: String,
        min_w: f64,
        max_w: f64,
        step_w: f64,
    },
    #[error("job {job}: needs at least one GPU")]
    NoGpus { job: String },
    #[error("job {job}: throughput weight must be finite and > 0 (got {weight})")]
    BadWeight { job: String, weight: f64 },
    #[error("job {job}: slowdown bound {bound} is outside 0–100 %")]
    BadBound { job: String, bound: f64 },
    #[error("{caps} caps for {jobs} jobs; one cap per job is needed")]
    CapsPerJob { jobs: usize, caps: usize },
    #[error("power domain {domain}: {why}")]
    BadDomain { domain: String, why: String },
}

/// The budget to plan with when job power comes from noisy estimates: `budget` less `z`
/// standard deviations of the error in the jobs' summed power, each job's reading having
/// relative standard deviation `power_noise`. Errors of different jobs are independent,
/// so the margin shrinks as 1/√(jobs): 100 jobs at 1 % noise and z = 3 keep 0.3 %.
/// The optimiser also leans toward jobs whose noise flatters their savings; the margin
/// covers that too.
pub fn hedged_budget(budget: Watts, jobs: &[JobSpec], power_noise: f64, z: f64) -> Watts {
    let total: f64 = jobs.iter().map(|j| j.curve.uncapped().power_w.0).sum();
    let usable = |x: f64| x.is_finite() && x > 0.0;
    if !(usable(total) && usable(power_noise) && usable(z)) {
        return budget;
    }
    let spread = jobs
        .iter()
        .map(|j| (j.curve.uncapped().power_w.0 * power_noise).powi(2))
        .sum::<f64>()
        .sqrt();
    let margin = (z * spread / total).min(0.5);
    budget * (1.0 - margin)
}

/// How much the allocator distrusts estimated curves: see [`allocate_cautious`].
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Caution {
    /// Standard deviations of the summed-power error kept in hand below the budget.
    pub power_z: f64,
    /// Standard deviations by which the optimal caps' expected gain over the equal split
    /// must exceed its own uncertainty before the allocator leaves the equal split.
    pub gain_z: f64,
}

impl Default for Caution {
    fn default() -> Self {
        // Chosen on the V100 half of the dev set, checked on the RTX6000 half: zero
        // violations at 1-5 % noise there; 1.5 and 2 gave up 2-15 points of the gap.
        Caution {
            power_z: 1.0,
            gain_z: 1.0,
        }
    }
}

/// An allocation made on uncertain curves, with the numbers behind the choice.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct CautiousAllocation {
    pub allocation: Allocation,
    /// The budget planned with: the budget less `power_z` standard deviations of the
    /// summed-power error at the chosen caps, W.
    pub planned_budget_w: Watts,
    /// Expected Σ weighted throughput of the optimal caps minus that of the equal split.
    pub expected_gain: f64,
    /// One standard deviation of that expected gain.
    pub gain_sigma: f64,
    /// Whether the equal split was kept because the gain did not clear its uncertainty.
    pub kept_equal: bool,
}

/// Allocates on estimated curves that carry per-point uncertainty ([`CapCurve::sigma_at`]),
/// never trusting them further than their measurements go.
///
/// The rule (stated in the README):
/// 1. **Budget**: each job's power is planned at its estimate plus `power_z / 2` of its
///    standard errors (the optimiser favours jobs whose noise flatters their savings, a
///    bias that grows with the jobs it picks among), and the whole plan keeps
///    `power_z · σ(Σ power)` below the budget at the caps chosen (errors of different
///    jobs are independent, so that margin grows as √jobs).
/// 2. **Lean to equal**: compute the optimal caps and the equal split (both on the
///    estimates, both under the planned budget). The optimal caps' expected gain `G`
///    over the equal split is a difference of estimates whose standard deviation
///    `σ_G = √Σⱼ wⱼ²(σTⱼ(c_opt)² + σTⱼ(c_eq)²)` (jobs whose two caps coincide add
///    nothing). Optimal is taken only when `G > gain_z · σ_G`; otherwise the equal split,
///    which is what the site would do knowing nothing. With precise curves σ_G → 0 and
///    this is the optimal policy; with curves no better than noise it is the equal split.
///
/// A job whose curve has no per-point uncertainty contributes its
/// `relative_uncertainty` × its uncapped value instead.
pub fn allocate_cautious(
    jobs: &[JobSpec],
    budget: Watts,
    caution: Caution,
) -> Result<CautiousAllocation, AllocationError> {
    allocate_cautious_within(jobs, budget, &[], caution)
}

/// [`allocate_cautious`] under power domains' limits too (see [`allocate_within`]): each
/// domain keeps `power_z` standard deviations of its own jobs' summed-power error in hand,
/// as the site does of all of them.
pub fn allocate_cautious_within(
    jobs: &[JobSpec],
    budget: Watts,
    domains: &[DomainLimit],
    caution: Caution,
) -> Result<CautiousAllocation, AllocationError> {
    allocate_cautious_doubting(jobs, budget, domains, caution, &[])
}

/// [`allocate_cautious_within`], with the jobs whose curves are in doubt (`in_doubt[i]`
/// for `jobs[i]`; missing entries are `false`): a curve that is a prior, or that the job's
/// measurements have left, says nothing the optimiser may trade on, so such a job gets
/// exactly its cap in the equal split (which respects its floor). The other jobs trade
/// power only where they were measured, or back toward it (see [`allocate_within`]).
///
/// On the curves' lower bounds ([`CapCurve::throughput_bound_at`]) the result's objective
/// is never below the equal split's under the same limits: the equal split is one of the
/// candidates, and wins ties.
pub fn allocate_cautious_doubting(
    jobs: &[JobSpec],
    budget: Watts,
    domains: &[DomainLimit],
    caution: Caution,
    in_doubt: &[bool],
) -> Result<CautiousAllocation, AllocationError> {
    let usable = |z: f64| if z.is_finite() && z > 0.0 { z } else { 0.0 };
    let (power_z, gain_z) = (usable(caution.power_z), usable(caution.gain_z));
    // Each job planned at its power plus `power_z / 2` standard errors (the optimiser's
    // selection bias grows with the number of jobs it chooses among, not with √jobs).
    let planned_jobs: Vec<JobSpec> = jobs
        .iter()
        .map(|j| JobSpec {
            curve: j.curve.with_power_margin(power_z / 2.0),
            ..j.clone()
        })
        .collect();
    let jobs = planned_jobs.as_slice();
    let first = decide(jobs, budget, domains, Policy::Optimal, in_doubt)?;
    // Without a power margin (the controller's metered loop corrects each job's power
    // every period instead) the plan is the first decision: no second optimisation.
    let planned_domains: Vec<DomainLimit>;
    let (planned, decided) = if power_z > 0.0 {
        // Each constraint's margin: power_z standard deviations of its members' summed
        // power at the first decision's caps (a member's error scaled by its share).
        let room = Room::new(jobs.len(), budget, domains)?;
        let variance: Vec<f64> = jobs
            .iter()
            .zip(&first.caps)
            .map(|(j, &cap)| point_sigma(j, Watts(cap)).0.powi(2))
            .collect();
        let margins: Vec<f64> = (0..room.constraints())
            .map(|c| {
                let var: f64 = room
                    .members(c)
                    .iter()
                    .map(|&(i, share)| share * share * variance[i])
                    .sum();
                power_z * var.sqrt()
            })
            .collect();
        let planned_room = room.with_margins(|c| margins[c]);
        let planned = Watts(planned_room.limit(SITE));
        planned_domains = domains
            .iter()
            .enumerate()
            .map(|(k, d)| DomainLimit {
                limit: Watts(planned_room.limit(k + 1)),
                ..d.clone()
            })
            .collect();
        let decided = decide(jobs, planned, &planned_domains, Policy::Optimal, in_doubt)?;
        (planned, decided)
    } else {
        (budget, first)
    };
    let optimal = decided.allocation(&decided.caps, Policy::Optimal);
    // The equal split the optimal policy weighed, under the same planned limits: what
    // allocating with `Policy::Equal` on them gives.
    let equal_caps = decided.equal.as_deref().unwrap_or_default();
    let equal = decided.allocation(equal_caps, Policy::Equal);
    let expected_gain = optimal.objective - equal.objective;
    let gain_sigma = difference_sigma(jobs, &optimal, &equal);
    let kept_equal = expected_gain <= gain_z * gain_sigma;
    Ok(CautiousAllocation {
        allocation: if kept_equal { equal } else { optimal },
        planned_budget_w: planned,
        expected_gain,
        gain_sigma,
        kept_equal,
    })
}

/// One standard error of a job's (power W, throughput) at `cap` on its curve: the
/// curve's per-point uncertainty, or its `relative_uncertainty` × its uncapped values.
fn point_sigma(job: &JobSpec, cap: Watts) -> (f64, f64) {
    job.curve.sigma_at(cap).map_or_else(
        || {
            let u = job.curve.relative_uncertainty();
            let top = job.curve.uncapped();
            (u * top.power_w.0, u * top.throughput)
        },
        |s| (s.power_w, s.throughput),
    )
}

/// One standard deviation of `a.objective − b.objective` (two allocations of the same
/// `jobs`, in order): `√Σⱼ wⱼ²(σTⱼ(c_a)² + σTⱼ(c_b)²)` over the jobs whose caps differ.
/// A difference smaller than this is what the curves' noise alone would show.
pub fn difference_sigma(jobs: &[JobSpec], a: &Allocation, b: &Allocation) -> f64 {
    jobs.iter()
        .zip(a.jobs.iter().zip(&b.jobs))
        .filter(|(_, (x, y))| x.cap_w != y.cap_w)
        .map(|(j, (x, y))| {
            let w2 = j.throughput_weight.powi(2);
            w2 * (point_sigma(j, x.cap_w).1.powi(2) + point_sigma(j, y.cap_w).1.powi(2))
        })
        .sum::<f64>()
        .sqrt()
}

/// A job prepared for allocation: its cap range and the floor its tier sets.
#[derive(Debug)]
struct Prepared<'a> {
    spec: &'a JobSpec,
    /// Lowest cap worth using: the limits' minimum, or the curve's lowest known cap.
    lo: f64,
    /// Highest cap: the limits' maximum.
    hi: f64,
    /// Lowest cap at which the tier bound holds on the curve.
    floor: f64,
    t_top: f64,
}

impl Prepared<'_> {
    /// The job's power at `cap` and the throughput it is known to reach there at least:
    /// floors are promises, and the choice among caps is weighed on what each job will
    /// surely deliver, so a curve smoothed or extended above its readings cannot buy a job
    /// a cut its measurements do not support.
    fn at(&self, cap: f64) -> OperatingPoint {
        self.spec.curve.at_lower_bound(Watts(cap))
    }
    fn power(&self, cap: f64) -> f64 {
        self.at(cap).power_w.0
    }
    fn value(&self, cap: f64) -> f64 {
        self.at(cap).throughput * self.spec.throughput_weight
    }
}

/// Allocates `budget` (Σ of the jobs' GPU power, W) across `jobs` with `policy`.
///
/// Every policy first settles the floors: each job's cap may not go below the lowest cap
/// at which its tier bound holds. When the budget cannot pay for every floor, tiers give
/// way in order of their bound, largest first (flex3, then flex2, flex1; flex0 last): the
/// tiers before the last one needed drop to their lowest caps (jobs without a bound
/// too), the last one needed exceeds its bound by the smallest excess that fits, the
/// same for all its jobs, and the tiers after it keep their floors. Above
/// the floors the policy decides:
/// - `Equal` cuts every job's power by the same fraction of its uncapped power;
/// - `PfiProportional` cuts in proportion to (P_max / T_max) · PFI (the paper's Eq. 2),
///   with T_max in the objective's unit (weight × throughput);
/// - `Optimal` maximises Σ weight · throughput on the curves (greedy over the upper
///   concave hull of each curve, then a fill on the real curve), and returns the better
///   of that and the other two policies, so it is never worse than the equal split on
///   the curves it is given. The greedy and the PFI cut move a job only within its
///   readings: one the equal split puts below its lowest read cap keeps its equal-split
///   cap (see `trading_range`), so where floors push jobs below their readings the PFI
///   cut weighed here may differ from `PfiProportional`'s own.
///
/// Every policy works on each curve's power and its throughput lower bound
/// ([`CapCurve::throughput_bound_at`]).
///
/// Deterministic: the same input gives the same output.
pub fn allocate(
    jobs: &[JobSpec],
    budget: Watts,
    policy: Policy,
) -> Result<Allocation, AllocationError> {
    allocate_within(jobs, budget, &[], policy)
}

/// [`allocate`] under power domains' limits too: the caps put at most `limit` W through
/// each domain (its members' power, each by its share) as well as at most `budget`
/// through the site. Every rule runs bottom-up over the domains, smallest first and the
/// site last: floors give way inside the domain that cannot pay them (the allocation's
/// [`DomainUse::floors_over_w`] says which binds, by how much), the equal and PFI cuts
/// go as deep in a domain as it needs, and the greedy's steps respect every limit on a
/// job's path, which keeps it optimal on the concave hulls when the domains nest (a
/// laminar family: a tree of domains whose jobs each run inside one leaf).
pub fn allocate_within(
    jobs: &[JobSpec],
    budget: Watts,
    domains: &[DomainLimit],
    policy: Policy,
) -> Result<Allocation, AllocationError> {
    let decided = decide(jobs, budget, domains, policy, &[])?;
    Ok(decided.allocation(&decided.caps, policy))
}

/// One decision: the jobs prepared, their ranges once floors are settled, the caps the
/// policy chose, and (for `Optimal`) the equal split it weighed them against, so the
/// cautious rule compares with that split instead of computing it again.
struct Decision<'a> {
    room: Room<'a>,
    prepared: Vec<Prepared<'a>>,
    bounds: Bounds,
    caps: Vec<f64>,
    equal: Option<Vec<f64>>,
}

impl Decision<'_> {
    fn allocation(&self, caps: &[f64], policy: Policy) -> Allocation {
        build_allocation(
            &self.prepared,
            caps,
            &self.room,
            policy,
            &self.bounds.over_w,
        )
    }
}

fn decide<'a>(
    jobs: &'a [JobSpec],
    budget: Watts,
    domains: &'a [DomainLimit],
    policy: Policy,
    in_doubt: &[bool],
) -> Result<Decision<'a>, AllocationError> {
    check_budget(budget)?;
    let room = Room::new(jobs.len(), budget, domains)?;
    // Measured territory first: caps below a curve's lowest reading are extrapolated, and
    // are used only when the budget cannot pay every floor without them — a tier's
    // promise outranks the preference for measured caps.
    let mut prepared = jobs
        .iter()
        .map(|j| prepare(j, false))
        .collect::<Result<Vec<_>, _>>()?;
    let mut bounds = settle_floors(&prepared, &room);
    if !bounds.floors_paid
        && jobs
            .iter()
            .any(|j| j.curve.lowest_read_cap() > j.curve.lowest().cap_w)
    {
        prepared = jobs
            .iter()
            .map(|j| prepare(j, true))
            .collect::<Result<Vec<_>, _>>()?;
        bounds = settle_floors(&prepared, &room);
    }
    let (caps, equal) = match policy {
        Policy::Equal => (equal_caps(&prepared, &bounds.range, &room), None),
        Policy::PfiProportional => (pfi_proportional_caps(&prepared, &bounds.range, &room), None),
        Policy::Optimal => {
            // Equal first: the greedy must beat it by more than rounding to be chosen,
            // so curves that give it nothing to exploit (identical ones, say) keep
            // the even cut, the robust choice when the curves may be wrong.
            let candidates = optimal_candidates(&prepared, &bounds.range, &room, in_doubt);
            let mut best: Option<(f64, &Vec<f64>)> = None;
            for caps in &candidates {
                let value: f64 = prepared.iter().zip(caps).map(|(p, &c)| p.value(c)).sum();
                if best
                    .as_ref()
                    .is_none_or(|(v, _)| value > *v + 1e-9 * v.abs())
                {
                    best = Some((value, caps));
                }
            }
            let best = best.map(|(_, caps)| caps.clone()).unwrap_or_default();
            let [equal, _, _] = candidates;
            (best, Some(equal))
        }
    };
    Ok(Decision {
        room,
        prepared,
        bounds,
        caps,
        equal,
    })
}

/// From this many jobs on, the optimal policy's three candidates are computed on three
/// threads: at 100,000 jobs in 112 domains each takes about 150 ms, and a site that size
/// must reallocate within half a second. Below it a thread costs more than it saves.
const PARALLEL_FROM_JOBS: usize = 4_096;

/// A rule that turns settled ranges into caps.
type Candidate = fn(&[Prepared<'_>], &[(f64, f64)], &Room<'_>) -> Vec<f64>;

/// The equal split, then the PFI-proportional cut and the greedy on the hulls within
/// [`trading_range`] of it, in that order. Each is deterministic and reads only what it
/// is given, so computing the last two side by side gives what computing them in turn
/// gives.
fn optimal_candidates(
    prepared: &[Prepared<'_>],
    settled: &[(f64, f64)],
    room: &Room<'_>,
    in_doubt: &[bool],
) -> [Vec<f64>; 3] {
    let equal = equal_caps(prepared, settled, room);
    let trading = trading_range(prepared, settled, &equal, in_doubt);
    let range = trading.as_slice();
    let side_by_side = prepared.len() >= PARALLEL_FROM_JOBS
        && std::thread::available_parallelism().is_ok_and(|n| n.get() >= 2);
    if !side_by_side {
        return [
            equal,
            pfi_proportional_caps(prepared, range, room),
            greedy_caps(prepared, range, room),
        ];
    }
    std::thread::scope(|scope| {
        // A thread the OS refuses is no error: that candidate is computed here instead.
        let spawn = |work: Candidate| {
            std::thread::Builder::new()
                .name("powerflex-allocate".into())
                .spawn_scoped(scope, move || work(prepared, range, room))
                .map_err(|_| work)
        };
        let greedy = spawn(greedy_caps);
        let pfi = spawn(pfi_proportional_caps);
        let finish = |candidate: Result<std::thread::ScopedJoinHandle<'_, Vec<f64>>, Candidate>| {
            match candidate {
                // A panic on the candidate's thread is the allocator's own: raised here.
                Ok(handle) => handle
                    .join()
                    .unwrap_or_else(|panic| std::panic::resume_unwind(panic)),
                Err(work) => work(prepared, range, room),
            }
        };
        [equal, finish(pfi), finish(greedy)]
    })
}

/// Where the optimiser may move each job once the equal split `equal` is known: a job in
/// doubt, or one the equal split put below its lowest read cap, stays at its equal-split
/// cap; any other moves between its lowest read cap (or its floor, if higher) and its
/// settled top. Below a job's readings lies only the curve's bound, which says how little
/// the job may deliver there, not what trading power with it would buy: valued on it, a
/// job cut below its readings looks cheap to raise and dear to cut, and the optimiser
/// would take watts from jobs it knows to buy back speed the job may well have had. Every
/// range holds its equal-split cap, so the equal split stays feasible within them.
fn trading_range(
    prepared: &[Prepared<'_>],
    settled: &[(f64, f64)],
    equal: &[f64],
    in_doubt: &[bool],
) -> Vec<(f64, f64)> {
    prepared
        .iter()
        .zip(settled.iter().zip(equal))
        .enumerate()
        .map(|(i, (job, (&(lower, upper), &eq)))| {
            if in_doubt.get(i).copied().unwrap_or(false) {
                return (eq, eq);
            }
            let limits = &job.spec.limits;
            let read = limits
                .snap_up(limits.min_w.0.max(job.spec.curve.lowest_read_cap().0))
                .min(job.hi);
            if eq < read - 1e-9 {
                return (eq, eq);
            }
            (lower.max(read).min(upper), upper)
        })
        .collect()
}

/// The allocation `caps_w` (one per job, in order) would be on the jobs' curves: power,
/// throughput, slowdown and floor per job, as [`allocate`] reports its own. Each cap is
/// held to the job's limits. For judging caps already in force against a new decision.
pub fn allocation_at(
    jobs: &[JobSpec],
    caps_w: &[Watts],
    budget: Watts,
    policy: Policy,
) -> Result<Allocation, AllocationError> {
    allocation_at_within(jobs, caps_w, budget, &[], policy)
}

/// [`allocation_at`], with what the caps put through each of `domains`.
pub fn allocation_at_within(
    jobs: &[JobSpec],
    caps_w: &[Watts],
    budget: Watts,
    domains: &[DomainLimit],
    policy: Policy,
) -> Result<Allocation, AllocationError> {
    check_budget(budget)?;
    let room = Room::new(jobs.len(), budget, domains)?;
    let prepared = jobs
        .iter()
        .map(|j| prepare(j, true))
        .collect::<Result<Vec<_>, _>>()?;
    let caps: Vec<f64> = prepared
        .iter()
        .zip(caps_w)
        .map(|(p, c)| {
            let limits = &p.spec.limits;
            c.0.clamp(limits.min_w.0, limits.max_w.0)
        })
        .collect();
    if caps.len() != prepared.len() {
        return Err(AllocationError::CapsPerJob {
            jobs: prepared.len(),
            caps: caps_w.len(),
        });
    }
    Ok(build_allocation(&prepared, &caps, &room, policy, &[]))
}

/// A budget is a finite, non-negative number of watts.
fn check_budget(budget: Watts) -> Result<(), AllocationError> {
    if !budget.0.is_finite() || budget.0 < 0.0 {
        return Err(AllocationError::BadBudget { budget_w: budget.0 });
    }
    Ok(())
}

/// Checks one job's spec as [`allocate`] will: its limits, GPUs, weight and bound. A
/// caller with many jobs can leave out the ones that fail, so one bad job does not cost
/// every other job its allocation.
pub fn validate_spec(spec: &JobSpec) -> Result<(), AllocationError> {
    spec.limits.validate(&spec.id)?;
    if spec.gpus == 0 {
        return Err(AllocationError::NoGpus {
            job: spec.id.clone(),
        });
    }
    if !(spec.throughput_weight.is_finite() && spec.throughput_weight > 0.0) {
        return Err(AllocationError::BadWeight {
            job: spec.id.clone(),
            weight: spec.throughput_weight,
        });
    }
    if let Some(b) = spec.max_slowdown {
        if !(b.0.is_finite() && (0.0..=1.0).contains(&b.0)) {
            return Err(AllocationError::BadBound {
                job: spec.id.clone(),
                bound: b.0,
            });
        }
    }
    Ok(())
}

/// The job's tier floor as the allocator sets it when the budget leaves it nothing more:
/// the lowest cap of its limits' grid at which its slowdown stays within its bound on
/// the curve it is planned on (its measured lower bound, extended below its readings),
/// and the power its curve counts there. A job with no bound: its lowest cap.
pub fn floor_point(spec: &JobSpec) -> Result<OperatingPoint, AllocationError> {
    let job = prepare(spec, true)?;
    Ok(OperatingPoint {
        cap_w: Watts(job.floor),
        ..job.at(job.floor)
    })
}

fn prepare(spec: &JobSpec, extrapolated: bool) -> Result<Prepared<'_>, AllocationError> {
    validate_spec(spec)?;
    let limits = &spec.limits;
    let hi = limits.max_w.0;
    let lowest_known = if extrapolated {
        spec.curve.lowest().cap_w.0
    } else {
        spec.curve.lowest_read_cap().0
    };
    let lo = limits.snap_up(limits.min_w.0.max(lowest_known)).min(hi);
    let t_top = spec.curve.at(Watts(hi)).throughput;
    let mut prepared = Prepared {
        spec,
        lo,
        hi,
        floor: lo,
        t_top,
    };
    prepared.floor = floor_cap(&prepared);
    Ok(prepared)
}

/// Lowest grid cap at which the job's throughput stays within its bound (and above which
/// it stays within it too).
fn floor_cap(job: &Prepared<'_>) -> f64 {
    match job.spec.max_slowdown {
        None => job.lo,
        Some(bound) => floor_cap_for(job, bound.0),
    }
}

/// Lowest grid cap at which the job's slowdown stays within `bound` (a fraction).
fn floor_cap_for(job: &Prepared<'_>, bound: f64) -> f64 {
    if bound <= 0.0 {
        return job.hi;
    }
    if bound >= 1.0 {
        return job.lo;
    }
    let needed = (1.0 - bound) * job.t_top;
    // Walk down from the top through the knots inside [lo, hi].
    let mut caps: Vec<f64> = job
        .spec
        .curve
        .knots()
        .iter()
        .map(|k| k.cap_w.0)
        .filter(|&c| c > job.lo && c < job.hi)
        .collect();
    caps.push(job.lo);
    caps.sort_by(|a, b| b.total_cmp(a));
    let mut above = job.hi;
    let mut t_above = job.at(above).throughput;
    for c in caps {
        let t = job.at(c).throughput;
        if t < needed {
            // The crossing lies in (c, above]: linear on this piece.
            let crossing = if t_above > t {
                c + (needed - t) / (t_above - t) * (above - c)
            } else {
                above
            };
            return job.spec.limits.snap_up(crossing).clamp(job.lo, job.hi);
        }
        above = c;
        t_above = t;
    }
    job.lo
}

/// The cap range each job may move in once floors are settled.
#[derive(Debug)]
struct Bounds {
    range: Vec<(f64, f64)>,
    /// Per constraint: by how much its members' floors exceeded its limit, and by how
    /// much it is short even with them at their lowest caps, W (the site's second is the
    /// allocation's `over_budget_w`).
    over_w: Vec<Over>,
    /// Whether every constraint pays every floor.
    floors_paid: bool,
}

/// By how much one constraint's members' floors exceeded its limit, and by how much it
/// is short with them at their lowest caps, W (0 and 0 when the floors fit).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
struct Over {
    floors_w: f64,
    lowest_w: f64,
}

/// How one constraint settled its members' floors.
#[derive(Debug, PartialEq)]
enum Settled {
    /// Every floor fits.
    Paid,
    /// Tiers gave way, in order, until the rest fit; the floors were over by this, W.
    GaveWay { floors_over_w: f64 },
    /// Short even with every member at its lowest cap.
    Short(Over),
}

/// Each job's range above its floor, settled constraint by constraint, bottom-up: a
/// domain that cannot pay its jobs' floors makes them give way (see [`give_way`]), and a
/// larger domain, or the site, starts from what its smaller ones already settled.
fn settle_floors(jobs: &[Prepared<'_>], room: &Room<'_>) -> Bounds {
    let mut range: Vec<(f64, f64)> = jobs.iter().map(|j| (j.floor, j.hi)).collect();
    let mut over_w = vec![Over::default(); room.constraints()];
    let mut floors_paid = true;
    for &c in room.bottom_up() {
        match give_way(jobs, &room.members(c), &mut range, room.limit(c)) {
            Settled::Paid => {}
            Settled::GaveWay { floors_over_w } => {
                floors_paid = false;
                over_w[c].floors_w = floors_over_w;
            }
            Settled::Short(over) => {
                floors_paid = false;
                over_w[c] = over;
            }
        }
    }
    Bounds {
        range,
        over_w,
        floors_paid,
    }
}

/// Makes `members` (job, share of its power) fit `budget` by their floors. When the
/// floors (each job's current lower cap) cost more, tiers give way in order of their
/// bound, largest first, as far as they must: the tiers before the last one needed drop
/// to their lowest caps (jobs without a bound too), the last one needed exceeds its bound
/// by the smallest excess that fits, the same for all its jobs, and the tiers after it
/// keep their floors. A cap already lowered by a smaller domain stays as low.
fn give_way(
    jobs: &[Prepared<'_>],
    members: &[(usize, f64)],
    range: &mut [(f64, f64)],
    budget: f64,
) -> Settled {
    let floor_power: f64 = members
        .iter()
        .map(|&(i, s)| s * jobs[i].power(range[i].0))
        .sum();
    if floor_power <= budget {
        return Settled::Paid;
    }
    let bound_of = |i: usize| jobs[i].spec.max_slowdown.map(|b| b.0);
    // Give-way order: largest bound first. Jobs without a bound already sit at `lo`.
    let mut bounds: Vec<f64> = members.iter().filter_map(|&(i, _)| bound_of(i)).collect();
    bounds.sort_by(|a, b| b.total_cmp(a));
    bounds.dedup();
    let mut lower_power = floor_power;
    for (rank, &giving) in bounds.iter().enumerate() {
        for &(i, s) in members
            .iter()
            .filter(|&&(i, _)| bound_of(i) == Some(giving))
        {
            lower_power -= s * (jobs[i].power(range[i].0) - jobs[i].power(jobs[i].lo));
        }
        if lower_power <= budget {
            // This tier gives way, but only as far as it must: every job of it exceeds
            // its bound by the same smallest excess that fits the budget, so the breach
            // is shared evenly instead of a few jobs being driven to their lowest cap.
            let already_gave: &[f64] = &bounds[..rank];
            let others: f64 = members
                .iter()
                .map(|&(i, s)| match bound_of(i) {
                    Some(b) if b == giving => 0.0,
                    Some(b) if !already_gave.contains(&b) => s * jobs[i].power(range[i].0),
                    _ => s * jobs[i].power(jobs[i].lo),
                })
                .sum();
            let giving_jobs: Vec<(usize, f64)> = members
                .iter()
                .copied()
                .filter(|&(i, _)| bound_of(i) == Some(giving))
                .collect();
            let lowered = |i: usize, excess: f64, range: &[(f64, f64)]| {
                floor_cap_for(&jobs[i], giving + excess).min(range[i].0)
            };
            let power_at = |excess: f64| -> f64 {
                giving_jobs
                    .iter()
                    .map(|&(i, s)| s * jobs[i].power(lowered(i, excess, range)))
                    .sum::<f64>()
            };
            let (mut fits, mut short) = (1.0 - giving, 0.0);
            for _ in 0..50 {
                let mid = 0.5 * (fits + short);
                if others + power_at(mid) <= budget {
                    fits = mid;
                } else {
                    short = mid;
                }
            }
            for &(i, _) in members {
                range[i] = match bound_of(i) {
                    None => (jobs[i].lo, jobs[i].lo),
                    Some(b) if b == giving => (lowered(i, fits, range), range[i].1),
                    Some(b) if already_gave.contains(&b) => (jobs[i].lo, jobs[i].lo),
                    Some(_) => range[i],
                };
            }
            return Settled::GaveWay {
                floors_over_w: floor_power - budget,
            };
        }
    }
    for &(i, _) in members {
        range[i] = (jobs[i].lo, jobs[i].lo);
    }
    Settled::Short(Over {
        floors_w: floor_power - budget,
        lowest_w: lower_power - budget,
    })
}

/// Highest grid cap in `[lower, upper]` whose power is at most `target` (or `lower`).
fn cap_for_power(job: &Prepared<'_>, lower: f64, upper: f64, target: f64) -> f64 {
    // A target computed as a fraction of a sum lands a rounding error off the power of
    // the cap it was meant for; a micro-watt of slack keeps that cap.
    let target = target + POWER_SLACK_W;
    if job.power(upper) <= target {
        return upper;
    }
    let n = job.spec.limits.count_between(lower, upper);
    // Binary search the largest i in 0..=n with power(nth_above(lower, i)) <= target.
    let (mut ok, mut bad) = (0usize, n);
    while bad - ok > 1 {
        let mid = (ok + bad) / 2;
        let cap = job.spec.limits.nth_above(lower, mid).min(upper);
        if job.power(cap) <= target {
            ok = mid;
        } else {
            bad = mid;
        }
    }
    if ok == 0 {
        lower
    } else {
        job.spec.limits.nth_above(lower, ok).min(upper)
    }
}

/// Float slack when comparing power with a target, W per job (a micro-watt).
const POWER_SLACK_W: f64 = 1e-6;

/// `x` limited to the range between `a` and `b`, whichever is larger: a measured curve
/// may draw more at a lower cap (noise), and that must not panic or invert the range.
fn clamp_between(x: f64, a: f64, b: f64) -> f64 {
    x.max(a.min(b)).min(a.max(b))
}

/// Bisection for the largest `x` in [0, x_max] with `spent(x) <= budget`, where `spent`
/// falls as `x` rises (x is a cut: a fraction or a multiplier).
fn bisect_cut(x_max: f64, budget: f64, spent: impl Fn(f64) -> f64) -> f64 {
    if spent(0.0) <= budget {
        return 0.0;
    }
    let (mut lo, mut hi) = (0.0, x_max);
    // To a part in 10^12 of the range (about 40 halvings, not 64): the targets are then
    // within micro-watts, and each halving costs a pass over every job.
    let close_enough = x_max * 1e-12;
    for _ in 0..64 {
        if hi - lo <= close_enough {
            break;
        }
        let mid = 0.5 * (lo + hi);
        if spent(mid) <= budget {
            hi = mid;
        } else {
            lo = mid;
        }
    }
    hi
}

/// Caps from a cut level `x` per job: job `i` is cut to the power
/// `P_top,i − x · slope_i`, held within its range (the equal cut: slope `P_top,i` and `x`
/// a fraction; the PFI rule: slope `(P_max / T_max) · PFI` and `x` a multiplier).
/// Bottom-up, each constraint finds the least level its members need (a member already
/// cut deeper by a smaller domain stays there), so a tight rack is cut as deep as it needs
/// and the rest of the site no deeper than its own limits ask; the targets are then
/// snapped to the cap grid and what that leaves is spent ([`fill_leftover`]).
fn level_caps(
    jobs: &[Prepared<'_>],
    range: &[(f64, f64)],
    room: &Room<'_>,
    x_max: f64,
    slopes: &[f64],
) -> Vec<f64> {
    // Each job's powers at its top and at its range's ends, once: the bisections below
    // evaluate the targets thousands of times, and a curve lookup each time was most of
    // an allocation's cost.
    let bounds: Vec<(f64, f64, f64)> = jobs
        .iter()
        .zip(range)
        .map(|(j, &(lower, upper))| (j.power(j.hi), j.power(lower), j.power(upper)))
        .collect();
    let target = |i: usize, x: f64| {
        let (top, lower, upper) = bounds[i];
        clamp_between(top - x * slopes[i], lower, upper)
    };
    let mut level = vec![0.0f64; jobs.len()];
    for &c in room.bottom_up() {
        let members = room.members(c);
        let x = bisect_cut(x_max, room.limit(c), |x| {
            members
                .iter()
                .map(|&(i, s)| s * target(i, x.max(level[i])))
                .sum()
        });
        for &(i, _) in &members {
            level[i] = level[i].max(x);
        }
    }
    let targets: Vec<f64> = (0..jobs.len()).map(|i| target(i, level[i])).collect();
    let mut caps = caps_for_targets(jobs, range, &targets);
    fill_leftover(jobs, range, &mut caps, &targets, room);
    caps
}

fn equal_caps(jobs: &[Prepared<'_>], range: &[(f64, f64)], room: &Room<'_>) -> Vec<f64> {
    let slopes: Vec<f64> = jobs.iter().map(|j| j.power(j.hi)).collect();
    level_caps(jobs, range, room, 1.0, &slopes)
}

fn pfi_proportional_caps(jobs: &[Prepared<'_>], range: &[(f64, f64)], room: &Room<'_>) -> Vec<f64> {
    let weights: Vec<f64> = jobs
        .iter()
        .map(|j| {
            let top = j.at(j.hi);
            let pfi = j
                .spec
                .curve
                .pfi()
                .filter(|p| p.is_finite() && *p > 0.0)
                .unwrap_or(1.0);
            // T_max in the objective's unit: with per-job normalised throughput
            // (weight 1/T_max) every T_max is 1, as in the paper's simulation.
            let t_max = (top.throughput * j.spec.throughput_weight).max(f64::MIN_POSITIVE);
            (top.power_w.0 / t_max) * pfi
        })
        .collect();
    let lambda_max = jobs
        .iter()
        .zip(&weights)
        .map(|(j, &w)| j.power(j.hi) / w.max(f64::MIN_POSITIVE))
        .fold(0.0, f64::max);
    level_caps(jobs, range, room, lambda_max, &weights)
}

/// Spends what snapping to the cap grid left of the budget: each job's cap is the highest
/// grid cap under its power target, so on a coarse grid (25 W, 100 W) the jobs together
/// fall well short of the budget. One grid step at a time, the job furthest below its
/// target goes up while the budget allows — the rule's own intent, on the caps that exist.
fn fill_leftover(
    jobs: &[Prepared<'_>],
    range: &[(f64, f64)],
    caps: &mut [f64],
    targets: &[f64],
    room: &Room<'_>,
) {
    let mut used = room.used(|i| jobs[i].power(caps[i]));
    let shortfall = |i: usize, cap: f64| targets[i] - jobs[i].power(cap);
    // Each round raises, by one grid step, the job furthest below its target whose raise
    // still fits. A job's shortfall changes only when it is raised, and what is used only
    // grows (a curve's power never falls as its cap rises), so a raise that does not fit
    // now never will: it leaves the queue for good. One heap operation per raise, where
    // sorting every job for each raise made a core step at 2,000 jobs take 1.7 s.
    let mut queue: BinaryHeap<Ranked> = (0..jobs.len())
        .filter(|&i| caps[i] < range[i].1)
        .map(|i| Ranked {
            value: shortfall(i, caps[i]),
            job: i,
        })
        .collect();
    // Raises that did not fit; back in the queue only if what is used ever falls (a
    // curve whose power dips as its cap rises), as they might fit then.
    let mut parked: Vec<usize> = Vec::new();
    while let Some(Ranked { job: i, .. }) = queue.pop() {
        let next = jobs[i].spec.limits.nth_above(caps[i], 1).min(range[i].1);
        if next <= caps[i] {
            continue;
        }
        let extra = jobs[i].power(next) - jobs[i].power(caps[i]);
        // Written as the fit it refuses, so a power that is no number never fits.
        let fits = extra <= room.headroom(i, &used) + POWER_SLACK_W;
        if !fits {
            parked.push(i);
            continue;
        }
        caps[i] = next;
        room.add(i, extra, &mut used);
        if extra < 0.0 {
            queue.extend(parked.drain(..).map(|j| Ranked {
                value: shortfall(j, caps[j]),
                job: j,
            }));
        }
        if caps[i] < range[i].1 {
            queue.push(Ranked {
                value: shortfall(i, caps[i]),
                job: i,
            });
        }
    }
}

fn caps_for_targets(jobs: &[Prepared<'_>], range: &[(f64, f64)], targets: &[f64]) -> Vec<f64> {
    jobs.iter()
        .zip(range)
        .zip(targets)
        .map(|((j, &(lower, upper)), &t)| cap_for_power(j, lower, upper, t))
        .collect()
}

/// A job in a max-queue: the greedy's hull segments by slope, [`fill_leftover`]'s jobs
/// by shortfall. The largest value first; ties to the lower job index, so the result is
/// deterministic.
#[derive(Debug, PartialEq)]
struct Ranked {
    value: f64,
    job: usize,
}

impl Eq for Ranked {}

impl Ord for Ranked {
    fn cmp(&self, other: &Self) -> Ordering {
        self.value
            .total_cmp(&other.value)
            .then_with(|| other.job.cmp(&self.job))
    }
}

impl PartialOrd for Ranked {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}

/// Upper concave hull of a job's candidate caps in (power, value), starting at `lower`.
/// Returns caps of the hull vertices in increasing power, each worth moving to.
fn hull(job: &Prepared<'_>, lower: f64, upper: f64) -> Vec<(f64, f64, f64)> {
    let limits = &job.spec.limits;
    let mut caps: Vec<f64> = vec![lower, upper];
    for k in job.spec.curve.knots() {
        let c = k.cap_w.0;
        if c > lower && c < upper {
            caps.push(limits.snap_down(c).max(lower));
            caps.push(limits.snap_up(c).min(upper));
        }
    }
    caps.sort_by(f64::total_cmp);
    caps.dedup();
    let start = (lower, job.power(lower), job.value(lower));
    let mut hull: Vec<(f64, f64, f64)> = vec![start];
    for &c in caps.iter().skip_while(|&&c| c <= lower) {
        let p = job.power(c);
        let v = job.value(c);
        if p < start.1 || v <= hull.last().map_or(start.2, |h| h.2) {
            continue; // no gain, or below the start's power (noise in a raw curve)
        }
        let last_power = hull.last().map_or(start.1, |h| h.1);
        if p <= last_power && hull.len() > 1 {
            // Same power, more value: a free improvement replaces the last vertex.
            hull.pop();
        }
        while hull.len() >= 2 {
            let (a, b) = (hull[hull.len() - 2], hull[hull.len() - 1]);
            // Drop b if it lies on or below the chord from a to the new point.
            let cross = (b.1 - a.1) * (v - a.2) - (b.2 - a.2) * (p - a.1);
            if cross >= 0.0 {
                hull.pop();
            } else {
                break;
            }
        }
        hull.push((c, p, v));
    }
    hull
}

fn greedy_caps(jobs: &[Prepared<'_>], range: &[(f64, f64)], room: &Room<'_>) -> Vec<f64> {
    let mut caps: Vec<f64> = range.iter().map(|&(lower, _)| lower).collect();
    let mut used = room.used(|i| jobs[i].power(caps[i]));
    let hulls: Vec<Vec<(f64, f64, f64)>> = jobs
        .iter()
        .zip(range)
        .map(|(j, &(lower, upper))| hull(j, lower, upper))
        .collect();
    let mut position = vec![0usize; jobs.len()];
    let mut queue = BinaryHeap::with_capacity(jobs.len());
    let slope = |h: &[(f64, f64, f64)], i: usize| -> Option<f64> {
        let (a, b) = (h.get(i)?, h.get(i + 1)?);
        let dp = b.1 - a.1;
        Some(if dp <= 0.0 {
            f64::INFINITY
        } else {
            (b.2 - a.2) / dp
        })
    };
    for (job, h) in hulls.iter().enumerate() {
        if let Some(s) = slope(h, 0) {
            queue.push(Ranked { value: s, job });
        }
    }
    while let Some(Ranked { job, .. }) = queue.pop() {
        let h = &hulls[job];
        let i = position[job];
        let (from, to) = (h[i], h[i + 1]);
        let cost = to.1 - from.1;
        // What every limit on the job's path still allows it: the site's and its
        // domains', each by the job's share in it.
        let remaining = room.headroom(job, &used);
        if cost <= remaining {
            room.add(job, cost, &mut used);
            caps[job] = to.0;
            position[job] = i + 1;
            if let Some(s) = slope(h, i + 1) {
                queue.push(Ranked { value: s, job });
            }
        } else {
            // Move as far toward `to` as the remaining room allows, on the real curve.
            let j = &jobs[job];
            let cap = cap_for_power(j, from.0, to.0, from.1 + remaining);
            if j.value(cap) > from.2 {
                room.add(job, j.power(cap) - from.1, &mut used);
                caps[job] = cap;
            }
        }
    }
    caps
}

fn build_allocation(
    jobs: &[Prepared<'_>],
    caps: &[f64],
    room: &Room<'_>,
    policy: Policy,
    over_w: &[Over],
) -> Allocation {
    let mut total_power = 0.0;
    let mut objective = 0.0;
    let allocations = jobs
        .iter()
        .zip(caps)
        .map(|(j, &cap)| {
            let point = j.at(cap);
            total_power += point.power_w.0;
            objective += point.throughput * j.spec.throughput_weight;
            let slowdown = if j.t_top > 0.0 {
                (1.0 - point.throughput / j.t_top).max(0.0)
            } else {
                0.0
            };
            let floor = match j.spec.max_slowdown {
                None => FloorStatus::None,
                Some(b) if slowdown <= b.0 + 1e-9 => FloorStatus::Held,
                Some(b) => FloorStatus::Broken {
                    excess: slowdown - b.0,
                },
            };
            JobAllocation {
                id: j.spec.id.clone(),
                cap_w: Watts(cap),
                power_w: point.power_w,
                throughput: point.throughput,
                slowdown,
                max_slowdown: j.spec.max_slowdown,
                floor,
            }
        })
        .collect();
    Allocation {
        policy,
        budget_w: Watts(room.limit(SITE)),
        jobs: allocations,
        total_power_w: Watts(total_power),
        objective,
        over_budget_w: Watts(over_w.get(SITE).map_or(0.0, |o| o.lowest_w)),
        domains: room.uses(|i| jobs[i].power(caps[i]), over_w),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A job of `gpus` GPUs drawing ~cap each, with the given PFI (prior-shaped curve).
    fn job(id: &str, gpus: u32, pfi: f64, bound: Option<f64>) -> JobSpec {
        JobSpec {
            id: id.to_string(),
            gpus,
            curve: CapCurve::from_pfi_prior(
                Watts(700.0 * f64::from(gpus)),
                1000.0,
                pfi,
                Watts(200.0),
                Watts(700.0),
                Watts(100.0),
            )
            .expect("prior"),
            max_slowdown: bound.map(SlowdownFraction),
            limits: CapLimits {
                min_w: Watts(200.0),
                max_w: Watts(700.0),
                step_w: Watts(10.0),
            },
            throughput_weight: 1.0,
        }
    }

    /// The rule [`fill_leftover`] keeps, as it was first written: sort every job by its
    /// shortfall for each raise, raise the first whose step fits.
    fn fill_leftover_by_sorting(
        jobs: &[Prepared<'_>],
        range: &[(f64, f64)],
        caps: &mut [f64],
        targets: &[f64],
        budget: f64,
    ) {
        let mut used: f64 = jobs.iter().zip(caps.iter()).map(|(j, &c)| j.power(c)).sum();
        loop {
            let mut order: Vec<usize> = (0..jobs.len()).filter(|&i| caps[i] < range[i].1).collect();
            let shortfall = |i: usize, caps: &[f64]| targets[i] - jobs[i].power(caps[i]);
            order.sort_by(|&a, &b| {
                shortfall(b, caps)
                    .total_cmp(&shortfall(a, caps))
                    .then(a.cmp(&b))
            });
            let mut raised = false;
            for i in order {
                let next = jobs[i].spec.limits.nth_above(caps[i], 1).min(range[i].1);
                if next <= caps[i] {
                    continue;
                }
                let extra = jobs[i].power(next) - jobs[i].power(caps[i]);
                if used + extra <= budget + POWER_SLACK_W {
                    caps[i] = next;
                    used += extra;
                    raised = true;
                    break;
                }
            }
            if !raised {
                break;
            }
        }
    }

    /// From [`PARALLEL_FROM_JOBS`] on the candidates are computed side by side; they
    /// are the ones computed in turn, and the cautious rule's equal split (taken from the
    /// optimal decision's candidates) is what `Policy::Equal` decides on the same limits.
    #[test]
    fn candidates_side_by_side_are_the_candidates_in_turn() {
        let n = PARALLEL_FROM_JOBS + 7;
        let specs: Vec<JobSpec> = (0..n)
            .map(|k| {
                let bound = match k % 4 {
                    0 => None,
                    1 => Some(0.1),
                    2 => Some(0.25),
                    _ => Some(0.5),
                };
                job(
                    &format!("j{k}"),
                    1 + (k % 8) as u32,
                    1.1 + (k % 37) as f64 * 0.13,
                    bound,
                )
            })
            .collect();
        let top: f64 = specs.iter().map(|j| j.curve.uncapped().power_w.0).sum();
        let halves: Vec<usize> = (0..n).filter(|k| k % 2 == 0).collect();
        let domains = [DomainLimit {
            name: "rack-even".into(),
            limit: Watts(0.5 * top * 0.5),
            members: halves.iter().map(|&k| (k, 1.0)).collect(),
        }];
        let budget = Watts(0.7 * top);
        let room = Room::new(n, budget, &domains).expect("room");
        let prepared: Vec<Prepared<'_>> = specs
            .iter()
            .map(|s| prepare(s, false).expect("prepared"))
            .collect();
        let bounds = settle_floors(&prepared, &room);
        let side_by_side = optimal_candidates(&prepared, &bounds.range, &room, &[]);
        assert_eq!(side_by_side[0], equal_caps(&prepared, &bounds.range, &room));
        assert_eq!(
            side_by_side[1],
            pfi_proportional_caps(&prepared, &bounds.range, &room)
        );
        assert_eq!(
            side_by_side[2],
            greedy_caps(&prepared, &bounds.range, &room)
        );
        // The three differ here, so the comparison above is not of three equal vectors.
        assert_ne!(side_by_side[0], side_by_side[2]);

        let cautious = allocate_cautious_within(
            &specs,
            budget,
            &domains,
            Caution {
                power_z: 0.0,
                gain_z: 1e9,
            },
        )
        .expect("cautious");
        assert!(cautious.kept_equal);
        let equal = allocate_within(&specs, budget, &domains, Policy::Equal).expect("equal");
        assert_eq!(cautious.allocation, equal);
    }

    mod fill_leftover_with_a_queue {
        use super::*;
        use proptest::prelude::*;

        proptest! {
            #![proptest_config(ProptestConfig::with_cases(300))]

            /// One heap operation per raise decides exactly as sorting every job for
            /// each raise did.
            #[test]
            fn decides_as_sorting_every_job_for_each_raise(
                shapes in proptest::collection::vec((1u32..9, 1.05f64..6.0, 0u8..3, 0.0f64..1.0), 1..40),
                budget_share in 0.2f64..1.1,
                step in prop_oneof![Just(10.0f64), Just(25.0), Just(100.0)],
            ) {
                let specs: Vec<JobSpec> = shapes
                    .iter()
                    .enumerate()
                    .map(|(k, &(gpus, pfi, _, _))| JobSpec {
                        limits: CapLimits { min_w: Watts(200.0), max_w: Watts(700.0), step_w: Watts(step) },
                        ..job(&format!("j{k}"), gpus, pfi, None)
                    })
                    .collect();
                let jobs: Vec<Prepared<'_>> =
                    specs.iter().map(|s| prepare(s, false).expect("prepared")).collect();
                let range: Vec<(f64, f64)> = jobs.iter().map(|j| (j.lo, j.hi)).collect();
                let top: f64 = jobs.iter().map(|j| j.power(j.hi)).sum();
                let budget = top * budget_share;
                // Targets anywhere between a job's lowest and highest power; caps start at
                // the grid cap under each (ties among equal shortfalls included).
                let targets: Vec<f64> = jobs
                    .iter()
                    .zip(&shapes)
                    .map(|(j, &(_, _, tie, at))| {
                        let (lo, hi) = (j.power(j.lo), j.power(j.hi));
                        if tie == 0 { lo + (hi - lo) * 0.5 } else { lo + (hi - lo) * at }
                    })
                    .collect();
                let start = caps_for_targets(&jobs, &range, &targets);
                let (mut by_queue, mut by_sorting) = (start.clone(), start);
                let room = Room::new(jobs.len(), Watts(budget), &[]).expect("room");
                fill_leftover(&jobs, &range, &mut by_queue, &targets, &room);
                fill_leftover_by_sorting(&jobs, &range, &mut by_sorting, &targets, budget);
                prop_assert_eq!(by_queue, by_sorting);
            }
        }
    }

    #[test]
    fn allocation_at_scores_given_caps_within_limits_and_wants_one_per_job() {
        let jobs = vec![job("a", 4, 2.0, Some(0.5)), job("b", 4, 1.2, Some(0.0))];
        let at = allocation_at(
            &jobs,
            &[Watts(150.0), Watts(700.0)],
            Watts(4000.0),
            Policy::Optimal,
        )
        .expect("allocation");
        assert_eq!(at.jobs[0].cap_w, Watts(200.0), "held to the job's minimum");
        assert_eq!(at.jobs[1].floor, FloorStatus::Held);
        let by_hand: f64 = at.jobs.iter().map(|j| j.power_w.0).sum();
        assert!((at.total_power_w.0 - by_hand).abs() < 1e-9);
        assert_eq!(
            allocation_at(&jobs, &[Watts(500.0)], Watts(4000.0), Policy::Optimal),
            Err(AllocationError::CapsPerJob { jobs: 2, caps: 1 })
        );
        assert!(matches!(
            allocation_at(&jobs, &[Watts(500.0); 2], Watts(f64::NAN), Policy::Optimal),
            Err(AllocationError::BadBudget { .. })
        ));
    }

    #[test]
    fn ample_budget_leaves_everyone_uncapped() {
        let jobs = [job("a", 8, 1.2, Some(0.25)), job("b", 4, 2.0, None)];
        for policy in [Policy::Optimal, Policy::Equal, Policy::PfiProportional] {
            let a = allocate(&jobs, Watts(100_000.0), policy).expect("allocation");
            assert!(
                a.jobs.iter().all(|j| j.cap_w == Watts(700.0)),
                "{policy}: {a:?}"
            );
        }
    }

    #[test]
    fn flex0_is_never_capped_while_others_can_give() {
        let jobs = [
            job("steady", 8, 1.1, Some(0.0)),
            job("flexible", 8, 2.5, Some(0.5)),
        ];
        // 30 % below the 11.2 kW uncapped draw.
        let a = allocate(&jobs, Watts(7840.0), Policy::Optimal).expect("allocation");
        assert_eq!(a.jobs[0].cap_w, Watts(700.0));
        assert_eq!(a.jobs[0].floor, FloorStatus::Held);
        assert!(a.jobs[1].cap_w.0 < 700.0);
        assert!(a.total_power_w.0 <= 7840.0 + 1e-9);
    }

    #[test]
    fn optimal_cuts_the_job_that_sheds_power_cheaply() {
        let jobs = [job("dense", 8, 1.1, None), job("moe", 8, 2.5, None)];
        let a = allocate(&jobs, Watts(0.8 * 11_200.0), Policy::Optimal).expect("allocation");
        assert!(a.jobs[1].cap_w < a.jobs[0].cap_w, "{a:?}");
        let e = allocate(&jobs, Watts(0.8 * 11_200.0), Policy::Equal).expect("allocation");
        assert!(a.objective > e.objective);
        assert_eq!(
            e.jobs[0].cap_w, e.jobs[1].cap_w,
            "equal cuts the same fraction"
        );
    }

    #[test]
    fn tiers_give_way_largest_bound_first() {
        let jobs = [
            job("f1", 8, 1.5, Some(0.10)),
            job("f2", 8, 1.5, Some(0.25)),
            job("f3", 8, 1.5, Some(0.40)),
        ];
        // On this curve a bound b allows a power cut of 1.5·b; floors on the 10 W grid:
        // flex1 600 W/GPU = 4800 W, flex2 440 W = 3520 W, flex3 280 W = 2240 W; the
        // lowest cap, 200 W, draws 1600 W.
        let floors = 4800.0 + 3520.0 + 2240.0;
        let a = allocate(&jobs, Watts(floors - 300.0), Policy::Optimal).expect("allocation");
        assert_eq!(a.jobs[0].floor, FloorStatus::Held, "{a:?}");
        assert_eq!(a.jobs[1].floor, FloorStatus::Held, "{a:?}");
        assert!(
            matches!(a.jobs[2].floor, FloorStatus::Broken { .. }),
            "{a:?}"
        );
        assert!(a.total_power_w.0 <= floors - 300.0 + 1e-9);
        // Deeper: flex3 at its lowest cap, flex2 shares what is left, flex1 still held.
        let budget = 4800.0 + 1600.0 + 2500.0;
        let b = allocate(&jobs, Watts(budget), Policy::Optimal).expect("allocation");
        assert_eq!(b.jobs[2].cap_w, Watts(200.0), "{b:?}");
        assert!(
            matches!(b.jobs[1].floor, FloorStatus::Broken { .. }),
            "{b:?}"
        );
        assert!(b.jobs[1].cap_w.0 > 200.0);
        assert_eq!(b.jobs[0].floor, FloorStatus::Held);
        assert!(b.total_power_w.0 <= budget + 1e-9);
    }

    #[test]
    fn infeasible_budget_holds_everyone_at_the_lowest_cap_and_says_by_how_much() {
        let jobs = [job("a", 8, 1.5, Some(0.0)), job("b", 8, 1.5, None)];
        let a = allocate(&jobs, Watts(2000.0), Policy::Optimal).expect("allocation");
        assert!(a.jobs.iter().all(|j| j.cap_w == Watts(200.0)));
        assert!(
            (a.over_budget_w.0 - 1200.0).abs() < 1e-9,
            "{:?}",
            a.over_budget_w
        );
        assert_eq!(a.broken_floors().count(), 1);
    }

    #[test]
    fn no_jobs_is_an_empty_allocation() {
        let a = allocate(&[], Watts(1000.0), Policy::Optimal).expect("allocation");
        assert!(a.jobs.is_empty());
        assert_eq!(a.total_power_w, Watts::ZERO);
    }

    #[test]
    fn rejects_bad_input() {
        let good = job("a", 8, 1.5, None);
        assert!(matches!(
            allocate(
                std::slice::from_ref(&good),
                Watts(f64::NAN),
                Policy::Optimal
            ),
            Err(AllocationError::BadBudget { .. })
        ));
        assert!(matches!(
            allocate(std::slice::from_ref(&good), Watts(-1.0), Policy::Optimal),
            Err(AllocationError::BadBudget { .. })
        ));
        let no_gpus = JobSpec {
            gpus: 0,
            ..good.clone()
        };
        assert_eq!(
            allocate(&[no_gpus], Watts(1.0), Policy::Optimal),
            Err(AllocationError::NoGpus { job: "a".into() })
        );
        let bad_limits = JobSpec {
            limits: CapLimits {
                min_w: Watts(700.0),
                max_w: Watts(200.0),
                step_w: Watts(10.0),
            },
            ..good.clone()
        };
        assert_eq!(
            allocate(&[bad_limits], Watts(1.0), Policy::Optimal),
            Err(AllocationError::BadLimits {
                job: "a".into(),
                min_w: 700.0,
                max_w: 200.0,
                step_w: 10.0
            })
        );
        let bad_weight = JobSpec {
            throughput_weight: 0.0,
            ..good.clone()
        };
        assert_eq!(
            allocate(&[bad_weight], Watts(1.0), Policy::Optimal),
            Err(AllocationError::BadWeight {
                job: "a".into(),
                weight: 0.0
            })
        );
        let bad_bound = JobSpec {
            max_slowdown: Some(SlowdownFraction(1.5)),
            ..good
        };
        assert_eq!(
            allocate(&[bad_bound], Watts(1.0), Policy::Optimal),
            Err(AllocationError::BadBound {
                job: "a".into(),
                bound: 1.5
            })
        );
    }

    #[test]
    fn grid_snapping() {
        let limits = CapLimits {
            min_w: Watts(200.0),
            max_w: Watts(705.0),
            step_w: Watts(10.0),
        };
        assert_eq!(limits.snap_down(456.0), 450.0);
        assert_eq!(limits.snap_up(451.0), 460.0);
        assert_eq!(limits.snap_up(450.0), 450.0);
        assert_eq!(limits.snap_up(702.0), 705.0);
        assert_eq!(limits.snap_down(100.0), 200.0);
        assert_eq!(limits.snap_down(800.0), 705.0);
    }

    #[test]
    fn extrapolated_caps_are_a_last_resort() {
        use crate::curve::{estimate_population, JobReadings};
        let readings: Vec<JobReadings> = (0..3)
            .map(|i| JobReadings {
                points: [400.0, 550.0, 700.0]
                    .iter()
                    .map(|&c| OperatingPoint {
                        cap_w: Watts(c),
                        power_w: Watts(8.0 * c),
                        throughput: 1000.0 * (c / 700.0).powf(0.5 + 0.1 * f64::from(i)),
                    })
                    .collect(),
                min_cap_w: Watts(200.0),
                // 8 GPUs at 200 W: at or above their static draw.
                zero_throughput_w: Watts(1600.0),
                gpus: 8,
                cap_grid_w: Vec::new(),
            })
            .collect();
        let specs: Vec<JobSpec> = estimate_population(&readings, 0.0)
            .into_iter()
            .enumerate()
            .map(|(i, curve)| JobSpec {
                id: format!("j{i}"),
                gpus: 8,
                curve,
                max_slowdown: None,
                limits: CapLimits {
                    min_w: Watts(200.0),
                    max_w: Watts(700.0),
                    step_w: Watts(10.0),
                },
                throughput_weight: 1.0,
            })
            .collect();
        // Reachable above the lowest reading (3 × 400 W × 8 = 9.6 kW): stays above it.
        let a = allocate(&specs, Watts(11_000.0), Policy::Optimal).expect("allocation");
        assert!(a.jobs.iter().all(|j| j.cap_w.0 >= 400.0), "{a:?}");
        // Not reachable: goes below, and meets the budget.
        let b = allocate(&specs, Watts(8_000.0), Policy::Optimal).expect("allocation");
        assert!(b.jobs.iter().any(|j| j.cap_w.0 < 400.0), "{b:?}");
        assert_eq!(b.over_budget_w, Watts::ZERO);
        assert!(b.total_power_w.0 <= 8_000.0 + 1e-9);
    }

    #[test]
    fn unbounded_jobs_go_below_their_readings_before_a_floor_breaks() {
        use crate::curve::{estimate_population, JobReadings};
        let readings = vec![JobReadings {
            points: [400.0, 550.0, 700.0]
                .iter()
                .map(|&c| OperatingPoint {
                    cap_w: Watts(c),
                    power_w: Watts(8.0 * c),
                    throughput: c,
                })
                .collect(),
            min_cap_w: Watts(200.0),
            // 8 GPUs at 200 W: at or above their static draw.
            zero_throughput_w: Watts(1600.0),
            gpus: 8,
            cap_grid_w: Vec::new(),
        }];
        let unbounded = estimate_population(&readings, 0.0).remove(0);
        let limits = CapLimits {
            min_w: Watts(200.0),
            max_w: Watts(700.0),
            step_w: Watts(10.0),
        };
        let jobs = [
            JobSpec {
                id: "u".into(),
                gpus: 8,
                curve: unbounded,
                max_slowdown: None,
                limits,
                throughput_weight: 1.0,
            },
            JobSpec {
                id: "f0".into(),
                gpus: 8,
                curve: CapCurve::from_points(&[
                    OperatingPoint {
                        cap_w: Watts(200.0),
                        power_w: Watts(1600.0),
                        throughput: 50.0,
                    },
                    OperatingPoint {
                        cap_w: Watts(700.0),
                        power_w: Watts(5600.0),
                        throughput: 100.0,
                    },
                ])
                .expect("curve"),
                max_slowdown: Some(SlowdownFraction(0.0)),
                limits,
                throughput_weight: 1.0,
            },
        ];
        let a = allocate(&jobs, Watts(8000.0), Policy::Optimal).expect("allocation");
        assert_eq!(a.jobs[1].cap_w, Watts(700.0), "{a:?}");
        assert_eq!(a.jobs[1].floor, FloorStatus::Held);
        assert!(a.total_power_w.0 <= 8000.0);
    }

    #[test]
    fn noisy_measured_power_neither_panics_nor_overspends() {
        // Power at 600 W read above power at 700 W: the flex1 floor sits where the curve
        // draws more than uncapped.
        let curve = CapCurve::from_points(&[
            OperatingPoint {
                cap_w: Watts(500.0),
                power_w: Watts(4000.0),
                throughput: 80.0,
            },
            OperatingPoint {
                cap_w: Watts(600.0),
                power_w: Watts(4810.0),
                throughput: 85.0,
            },
            OperatingPoint {
                cap_w: Watts(700.0),
                power_w: Watts(4800.0),
                throughput: 100.0,
            },
        ])
        .expect("curve");
        let job = JobSpec {
            id: "a".into(),
            gpus: 8,
            curve,
            max_slowdown: Some(SlowdownFraction(0.10)),
            limits: CapLimits {
                min_w: Watts(500.0),
                max_w: Watts(700.0),
                step_w: Watts(1.0),
            },
            throughput_weight: 1.0,
        };
        for policy in [Policy::Optimal, Policy::Equal, Policy::PfiProportional] {
            let a = allocate(std::slice::from_ref(&job), Watts(4807.0), policy).expect("no panic");
            if a.over_budget_w == Watts::ZERO {
                assert!(a.total_power_w.0 <= 4807.0, "{policy}: {a:?}");
            }
        }
        // A budget a hair under the uncapped draw is not rounded up to it.
        let a = allocate(
            std::slice::from_ref(&job),
            Watts(4800.0 - 1e-6),
            Policy::Optimal,
        )
        .expect("allocation");
        assert!(a.total_power_w.0 <= 4800.0 - 1e-6 + 1e-6);
    }

    #[test]
    fn identical_curves_keep_the_even_cut() {
        let jobs: Vec<JobSpec> = (0..6)
            .map(|i| job(&format!("j{i}"), 8, 1.5, None))
            .collect();
        let a = allocate(&jobs, Watts(0.7 * 6.0 * 5600.0), Policy::Optimal).expect("allocation");
        let first = a.jobs[0].cap_w;
        assert!(
            a.jobs.iter().all(|j| j.cap_w == first),
            "{:?}",
            a.jobs.iter().map(|j| j.cap_w.0).collect::<Vec<_>>()
        );
    }

    #[test]
    fn cautious_allocation_leans_to_equal_as_far_as_the_noise_warrants() {
        use crate::curve::estimate_from_windows;
        // Two kinds of job read through windows; `spread` is each window's relative error.
        let jobs = |spread: f64, windows: usize| -> Vec<JobSpec> {
            (0..8)
                .map(|i| {
                    let pfi = if i % 2 == 0 { 1.1 } else { 2.5 };
                    let truth = job("t", 8, pfi, None).curve;
                    let readings: Vec<OperatingPoint> = truth
                        .knots()
                        .iter()
                        .flat_map(|k| {
                            (0..windows).map(move |w| {
                                let e = if (w + i) % 2 == 0 { spread } else { -spread };
                                OperatingPoint {
                                    cap_w: k.cap_w,
                                    power_w: k.power_w * (1.0 + e),
                                    throughput: k.throughput * (1.0 - e),
                                }
                            })
                        })
                        .collect();
                    JobSpec {
                        id: format!("j{i}"),
                        curve: estimate_from_windows(&readings, spread).expect("curve"),
                        ..job("x", 8, pfi, None)
                    }
                })
                .collect()
        };
        let budget = Watts(0.75 * 8.0 * 5600.0);
        let precise = allocate_cautious(&jobs(0.001, 4), budget, Caution::default()).expect("ok");
        assert!(!precise.kept_equal, "{precise:?}");
        let optimal = allocate(&jobs(0.001, 4), budget, Policy::Optimal).expect("ok");
        assert!(precise.allocation.objective >= 0.99 * optimal.objective);
        let noisy = allocate_cautious(&jobs(0.4, 2), budget, Caution::default()).expect("ok");
        assert!(noisy.kept_equal, "{noisy:?}");
        assert_eq!(noisy.allocation.policy, Policy::Equal);
        for a in [&precise, &noisy] {
            assert!(a.planned_budget_w.0 <= budget.0);
            assert!(a.allocation.total_power_w.0 <= a.planned_budget_w.0 + 1e-6);
        }
    }
}
