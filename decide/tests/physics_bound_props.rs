//! The decision on every curve the library holds: the simulator's profiles (the paper's
//! fitted physics, the synthetic ones, the real tables) and every job of the real dev set
//! (Zeus NSDI'23, `data/curves`). Each job is measured as an agent would: from its top
//! cap down to a random lowest cap, every reading off by 1 % noise. The decision is then
//! judged on the TRUE curves:
//! (a) a job the decision says holds its tier is not slowed past the tier's bound by more
//!     than [`SLOWDOWN_TOLERANCE`];
//! (b) the decided caps deliver at least the relative speed, summed over the jobs, of the
//!     tier-aware equal split computed on the true curves, less [`EQUAL_TOLERANCE`] per
//!     job.
//!
//! It prints the worst figures it saw, for the record (`-- --nocapture`).

// A test prints its figures; the library it tests prints nothing.
#![allow(clippy::disallowed_macros)]

use std::collections::BTreeMap;

use powerflex_core::allocate::{
    allocate_within, Allocation, CapLimits, FloorStatus, JobSpec, Policy,
};
use powerflex_core::config::{BudgetMode, Objective};
use powerflex_core::curve::CapCurve;
use powerflex_core::curves_csv::parse_curves;
use powerflex_core::flex::TierTable;
use powerflex_core::point::OperatingPoint;
use powerflex_core::rng::SplitMix64;
use powerflex_core::units::SlowdownFraction;
use powerflex_core::workload::{MeasuredTable, Physics};
use powerflex_core::Watts;
use powerflex_decide::{decide, NodeView, SiteSettings, TierBounds};
use powerflex_proto::report::{GpuInfo, JobReport};
use powerflex_proto::usage::ThroughputUnit;
use serde::Deserialize;

/// One standard deviation of each reading (power and throughput), as a fraction.
const NOISE: f64 = 0.01;
/// How far past its bound a job's true slowdown may be, as a fraction of its uncapped
/// speed: the bound takes one standard error of each reading's ratio to the top reading
/// (1.4 % at 1 % noise) off what was measured; two more cover the noise a reading has in
/// one case in forty, so the check fails only where the bound is wrong, not unlucky.
const SLOWDOWN_TOLERANCE: f64 = 2.0 * NOISE * std::f64::consts::SQRT_2;
/// How much relative speed per job the decision may fall short of the true equal split:
/// its equal split is computed on noisy readings (1 % on power moves each job's share),
/// under floors set a standard error below the readings.
const EQUAL_TOLERANCE: f64 = 0.02;
/// The share of the budget the true floors must leave for the equal split to be judged:
/// the decision sets floors on lower bounds, a grid step or so above the true ones, and
/// where the budget barely pays the true floors those steps make a tier give way.
const FLOOR_SLACK: f64 = 0.05;

/// The library file's profiles, read leniently (only what the truth needs).
#[derive(Deserialize)]
struct Library {
    profile: Vec<Profile>,
}

#[derive(Deserialize)]
struct Profile {
    name: String,
    physics: Physics,
    table: Option<MeasuredTable>,
}

/// A job's true curve, one GPU, with the caps it accepts and the caps it is walked on.
struct Truth {
    name: String,
    curve: CapCurve,
    min_w: f64,
    max_w: f64,
    /// The walk's caps, highest first.
    walk_w: Vec<f64>,
}

fn truths() -> Vec<Truth> {
    let library: Library = toml::from_str(include_str!("../../sim/profiles/library.toml"))
        .expect("the workload library");
    let h200: Vec<f64> = (0..=50).map(|i| 200.0 + 10.0 * f64::from(i)).collect();
    let mut out: Vec<Truth> = library
        .profile
        .iter()
        .map(|p| {
            let points: Vec<OperatingPoint> = match &p.table {
                Some(t) => t.curve(&h200, 1, &p.physics),
                None => p.physics.curve(&h200, 1, 1.0),
            };
            Truth {
                name: p.name.clone(),
                curve: CapCurve::from_points(&points).expect("a true curve"),
                min_w: 200.0,
                max_w: 700.0,
                walk_w: vec![700.0, 600.0, 500.0, 400.0, 300.0, 200.0],
            }
        })
        .collect();
    let dev = parse_curves(include_str!("../../data/curves/zeus_nsdi23_dev.csv"))
        .expect("the dev curves");
    for record in dev {
        if record.points.len() < 3 {
            continue;
        }
        // One GPU's curve (the dev set's jobs run on one).
        let gpus = f64::from(record.gpus.unwrap_or(1));
        let points: Vec<OperatingPoint> = record
            .points
            .iter()
            .map(|p| OperatingPoint {
                power_w: p.power_w * (1.0 / gpus),
                throughput: p.throughput / gpus,
                ..*p
            })
            .collect();
        out.push(Truth {
            name: record.job.clone(),
            curve: CapCurve::from_points(&points).expect("a dev curve"),
            min_w: points[0].cap_w.0,
            max_w: points[points.len() - 1].cap_w.0,
            walk_w: points.iter().rev().map(|p| p.cap_w.0).collect(),
        });
    }
    out
}

/// The job on its own node, walked from its top cap down to `lowest_w`.
fn node(
    id: usize,
    truth: &Truth,
    tier: &str,
    gpus: u32,
    lowest_w: f64,
    rng: &mut SplitMix64,
) -> NodeView {
    let g = f64::from(gpus);
    let mut noisy = |x: f64| x * (1.0 + NOISE * rng.normal());
    let top = truth.curve.at(Watts(truth.max_w));
    let points = truth
        .walk_w
        .iter()
        .filter(|&&c| c >= lowest_w - 1e-9)
        .map(|&c| {
            let p = truth.curve.at(Watts(c));
            powerflex_proto::point::from_array([c, noisy(p.power_w.0 * g), noisy(p.throughput * g)])
        })
        .collect();
    let power = noisy(top.power_w.0 * g);
    let report = JobReport {
        job_id: format!("{id}"),
        tier: tier.into(),
        gpus,
        cap_w: Some(truth.max_w),
        power_w: Some(power),
        throughput: Some(top.throughput * g),
        throughput_unit: Some(ThroughputUnit::Tokens),
        pfi: None,
        pfi_source: None,
        points,
        gpu_uuids: Vec::new(),
        power_cap_w: None,
        power_cap_steady_s: Some(30.0),
        calibrating: false,
        curve_in_question: false,
        curve: Vec::new(),
        calibration_cost_pct: None,
        owner_uid: None,
        usage: None,
    };
    NodeView {
        node: format!("n{id}"),
        gpus: (0..gpus)
            .map(|i| GpuInfo {
                uuid: format!("GPU-{id}-{i}"),
                name: "test".into(),
                min_w: truth.min_w,
                max_w: truth.max_w,
                default_w: truth.max_w,
            })
            .collect(),
        jobs: vec![report],
        power_w: power,
        live: true,
    }
}

fn settings() -> SiteSettings {
    SiteSettings {
        tiers: TierTable::default_table(),
        policy: Policy::Optimal,
        cap_step: Watts(10.0),
        failsafe_cap: Watts(500.0),
        default_pfi: 1.3,
        budget_mode: BudgetMode::Metered { margin: 0.0 },
        objective: Objective::RelativeSpeed,
        tier_bounds: TierBounds::Honoured,
        domains: None,
    }
}

/// The site's default tiers and their bounds.
const TIERS: [(&str, Option<f64>); 4] = [
    ("flex0", Some(0.0)),
    ("flex1", Some(0.10)),
    ("flex2", Some(0.25)),
    ("flex3", Some(0.50)),
];

/// Power the true floors cost, W: each job at the lowest 10 W cap from which its true
/// slowdown stays within its bound.
fn true_floors_w(truths: &[Truth], plan: &[(usize, u32, Option<f64>)]) -> f64 {
    plan.iter()
        .map(|&(k, g, bound)| {
            let truth = &truths[k];
            let top = truth.curve.at(Watts(truth.max_w)).throughput;
            let b = bound.unwrap_or(1.0);
            let mut floor = truth.max_w;
            let mut c = truth.max_w;
            while c >= truth.min_w - 1e-9 {
                if 1.0 - truth.curve.at(Watts(c)).throughput / top > b + 1e-9 {
                    break;
                }
                floor = c;
                c -= 10.0;
            }
            truth.curve.at(Watts(floor)).power_w.0 * f64::from(g)
        })
        .sum()
}

/// The tier-aware equal split of `managed` on the true curves of `plan` (truth, GPUs,
/// bound).
fn true_equal(truths: &[Truth], plan: &[(usize, u32, Option<f64>)], managed: Watts) -> Allocation {
    let specs: Vec<JobSpec> = plan
        .iter()
        .enumerate()
        .map(|(id, &(k, g, bound))| {
            let truth = &truths[k];
            let points: Vec<OperatingPoint> = truth
                .curve
                .knots()
                .iter()
                .map(|p| OperatingPoint {
                    power_w: p.power_w * f64::from(g),
                    throughput: p.throughput * f64::from(g),
                    ..*p
                })
                .collect();
            let curve = CapCurve::from_points(&points).expect("curve");
            JobSpec {
                id: format!("{id}"),
                gpus: g,
                throughput_weight: 1.0 / curve.uncapped().throughput,
                curve,
                max_slowdown: bound.map(SlowdownFraction),
                limits: CapLimits {
                    min_w: Watts(truth.min_w),
                    max_w: Watts(truth.max_w),
                    step_w: Watts(10.0),
                },
            }
        })
        .collect();
    allocate_within(&specs, managed, &[], Policy::Equal).expect("equal")
}

#[test]
fn on_every_library_curve_no_bound_breaks_and_the_equal_split_is_kept() {
    let truths = truths();
    assert!(truths.len() >= 35 + 40, "{} curves", truths.len());
    let mut rng = SplitMix64::new(41);
    let jobs_per_case = 6;
    let cases = 4 * truths.len();
    let (mut worst_excess, mut worst_short) = (f64::NEG_INFINITY, f64::NEG_INFINITY);
    let (mut worst_short_unwalked, mut worst_short_tight) = (f64::NEG_INFINITY, f64::NEG_INFINITY);
    let (mut held, mut compared) = (0usize, 0usize);
    let mut mean_gain = 0.0;
    let mut judged = vec![0usize; truths.len()];
    for case in 0..cases {
        let picks: Vec<usize> = (0..jobs_per_case)
            .map(|j| (case * jobs_per_case + j * 7 + case / truths.len()) % truths.len())
            .collect();
        let plan: Vec<(usize, u32, Option<f64>)> = picks
            .iter()
            .map(|&k| (k, 1 + rng.below(8) as u32, TIERS[rng.below(TIERS.len())].1))
            .collect();
        let top_w: f64 = plan
            .iter()
            .map(|&(k, g, _)| truths[k].curve.at(Watts(truths[k].max_w)).power_w.0 * f64::from(g))
            .sum();
        let budget = Watts(top_w * (0.55 + 0.4 * rng.next_f64()));
        // The node's draw is the jobs' (nothing else on it): all of the budget is theirs.
        let equal = true_equal(&truths, &plan, budget);
        // Every other case, the walks reach the caps the equal split needs (what
        // calibration does before an announced event); the others stop anywhere.
        let covered = case % 2 == 0;
        let mut nodes = Vec::new();
        let mut walked_to = Vec::new();
        for (id, &(k, gpus, bound)) in plan.iter().enumerate() {
            let truth = &truths[k];
            let tier = TIERS
                .iter()
                .find(|t| t.1 == bound)
                .map(|t| t.0)
                .expect("a tier");
            let reach = truth.walk_w.len().saturating_sub(1).max(1);
            let mut stop = (1 + rng.below(reach)).min(truth.walk_w.len() - 1);
            if covered {
                let needed = equal.jobs[id].cap_w.0;
                while stop + 1 < truth.walk_w.len() && truth.walk_w[stop] > needed + 1e-9 {
                    stop += 1;
                }
            }
            let lowest_w = truth.walk_w[stop];
            nodes.push(node(id, truth, tier, gpus, lowest_w, &mut rng));
            walked_to.push(lowest_w);
        }
        let d = decide(&nodes, budget, &settings());
        let allocation = d.allocation.as_ref().expect("an allocation");
        assert_eq!(
            allocation.jobs.len(),
            plan.len(),
            "every job is allocated: {d:?}"
        );
        assert_eq!(d.reserved_w, 0.0);
        let caps: BTreeMap<String, (f64, FloorStatus)> = allocation
            .jobs
            .iter()
            .map(|j| (j.id.clone(), (j.cap_w.0, j.floor)))
            .collect();
        // (a) every bound the decision says holds, holds on the true curve.
        let mut speed = 0.0;
        for (id, &(k, _, bound)) in plan.iter().enumerate() {
            let truth = &truths[k];
            let (cap, floor) = caps[&format!("{id}")];
            let relative = truth.curve.at(Watts(cap)).throughput
                / truth.curve.at(Watts(truth.max_w)).throughput;
            speed += relative;
            judged[k] += 1;
            if let (Some(b), FloorStatus::Held) = (bound, floor) {
                held += 1;
                let excess = (1.0 - relative) - b;
                worst_excess = worst_excess.max(excess);
                assert!(
                    excess <= SLOWDOWN_TOLERANCE,
                    "case {case}: {} ({id}, walked to {} W) at {cap} W is slowed {:.1} % \
                     against its {:.0} % bound; planned {:?}",
                    truth.name,
                    walked_to[id],
                    100.0 * (1.0 - relative),
                    100.0 * b,
                    allocation.jobs[id],
                );
            }
        }
        // (b) at least the equal split on the true curves, under the same budget.
        let short = (equal.objective - speed) / plan.len() as f64;
        let slack = 1.0 - true_floors_w(&truths, &plan) / budget.0;
        if !covered || slack < FLOOR_SLACK {
            if slack < FLOOR_SLACK {
                worst_short_tight = worst_short_tight.max(short);
            } else {
                worst_short_unwalked = worst_short_unwalked.max(short);
            }
            continue;
        }
        compared += 1;
        worst_short = worst_short.max(short);
        mean_gain += -short;
        let detail: Vec<String> = plan
            .iter()
            .enumerate()
            .map(|(id, &(k, g, bound))| {
                let truth = &truths[k];
                let rel = |c: f64| {
                    truth.curve.at(Watts(c)).throughput
                        / truth.curve.at(Watts(truth.max_w)).throughput
                };
                let (cap, floor) = caps[&format!("{id}")];
                let eq = equal.jobs[id].cap_w.0;
                format!(
                    "{} x{g} bound {bound:?} walked to {}: planned {cap} W ({:.3}, {floor:?}), \
                     equal {eq} W ({:.3})",
                    truth.name,
                    walked_to[id],
                    rel(cap),
                    rel(eq)
                )
            })
            .collect();
        assert!(
            short <= EQUAL_TOLERANCE,
            "case {case}: {speed:.3} against the true equal split's {:.3}:\n{}",
            equal.objective,
            detail.join("\n"),
        );
    }
    assert!(judged.iter().all(|&n| n > 0), "every curve judged");
    assert!(held > cases, "{held} bounds judged");
    assert!(
        compared > cases / 8,
        "{compared} cases compared with the equal split"
    );
    eprintln!(
        "{cases} cases over {} curves, {held} held bounds judged: worst true excess over a \
         held bound {:.2} points; against the true equal split, worst shortfall per job \
         {:.4} where the walks covered its caps and the floors left room ({compared} cases, \
         mean gain per job {:+.4}), \
         {:.4} where the walks stopped anywhere, {:.4} where the true floors left less than \
         {:.0} % of the budget",
        truths.len(),
        100.0 * worst_excess,
        worst_short,
        mean_gain / compared.max(1) as f64,
        worst_short_unwalked,
        worst_short_tight,
        100.0 * FLOOR_SLACK
    );
}
