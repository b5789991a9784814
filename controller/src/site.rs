//! One facility budget across every node: the controller's allocation step, pure.
//!
//! Agents report their jobs per node; a job that spans nodes is one job here — its GPUs,
//! power and throughput add up across nodes (each node's agent measures the progress its
//! own ranks report; a job that reports only from rank 0 has throughput on one node) —
//! and gets one cap, the same on all its GPUs everywhere (synchronous training runs at the
//! pace of its slowest rank). Power the controller does not steer comes off the budget
//! first: idle GPUs and unmanaged jobs at what they draw, and a node that stopped
//! reporting at its fail-safe cap on every GPU (what it falls to when its lease runs out).
//!
//! Curves come from the same estimator as the offline evaluation
//! ([`estimate_population`]): smoothed, and extended below each job's lowest measured cap
//! to the GPUs' minimum — territory the allocator enters only when the budget cannot pay
//! every tier's floor above it. The objective is the site's total tokens/s when every
//! managed job reports tokens; when some report only steps (units that do not add up),
//! it is the sum of each job's speed relative to uncapped.

use std::collections::BTreeMap;

use serde::Serialize;

use powerflex_core::allocate::{allocate, validate_spec, Allocation, CapLimits, JobSpec, Policy};
use powerflex_core::curve::{estimate_population, CapCurve, JobReadings, OperatingPoint};
use powerflex_core::flex::{parse_power_flex, TierTable};
use powerflex_core::Watts;
use powerflex_proto::link::{
    validate_gpus, validate_report_totals, GpuInfo, JobReport, MAX_GPUS_PER_NODE, MAX_GPU_POWER_W,
};

/// What the controller knows of one node.
#[derive(Debug, Clone, PartialEq)]
pub struct NodeView {
    pub node: String,
    pub gpus: Vec<GpuInfo>,
    pub jobs: Vec<JobReport>,
    /// The node's summed GPU draw in its last report, W.
    pub power_w: f64,
    /// Whether the node reported within its lease (a silent node is at its fail-safe cap).
    pub live: bool,
}

/// Site settings the allocation needs.
#[derive(Debug, Clone)]
pub struct SiteSettings {
    pub tiers: TierTable,
    pub policy: Policy,
    pub cap_step: Watts,
    pub failsafe_cap: Watts,
    /// PFI assumed for a job with neither a measured curve nor a prior.
    pub default_pfi: f64,
}

/// The outcome of one allocation.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Decision {
    /// Per node: job → per-GPU cap, W (what the node's lease says).
    pub leases: BTreeMap<String, BTreeMap<String, f64>>,
    pub budget_w: f64,
    /// Power not steered by the allocation (idle GPUs, unmanaged jobs, silent nodes), W.
    pub reserved_w: f64,
    /// The core allocation over the managed jobs.
    pub allocation: Option<Allocation>,
    /// Reports left out because their values cannot be true.
    pub rejected: Vec<Rejected>,
    /// Per-GPU cap for a managed job that starts before the next allocation names it:
    /// the fail-safe cap, or the budget's even share per GPU of the site when that is
    /// lower (a job that starts during a cut does not start above the cut), W.
    pub start_cap_w: f64,
    /// What the allocation maximised: "tokens/s" (every managed job reports tokens) or
    /// "relative-speed" (the sum of each job's throughput over its uncapped throughput).
    pub objective: &'static str,
}

/// One standard deviation of a calibration reading (power or throughput), as a fraction:
/// the paper's repeat-run noise is ~0.5 %; the agent's 5-30 s holds are noisier.
const MEASUREMENT_NOISE: f64 = 0.01;

/// A job gathered across nodes.
#[derive(Debug, Default)]
struct SiteJob {
    tier: String,
    gpus: u32,
    nodes: Vec<String>,
    power_w: f64,
    pfi: Option<f64>,
    /// Summed over the nodes that report it.
    throughput: Option<f64>,
    /// Whether every node that reports progress counts tokens.
    counts_tokens: bool,
    /// cap → (summed power, summed throughput, nodes that measured it).
    points: BTreeMap<u64, (f64, f64, usize)>,
    min_cap: f64,
    max_cap: f64,
}

/// A report (or a node's whole report) left out of the allocation because its values
/// cannot be true. It hurts only its sender: the job runs at what its node's lease gives
/// a job it does not name, and the rest of the site is allocated as usual.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Rejected {
    pub node: String,
    /// The job, or `None` when the node's report as a whole was refused.
    pub job: Option<String>,
    pub reason: String,
}

/// The per-GPU cap range `(min_w, max_w)` common to `gpus`, or `None` when their ranges
/// do not overlap (two GPU models whose limits have nothing in common).
fn common_range<'a>(gpus: impl Iterator<Item = &'a GpuInfo>) -> Option<(f64, f64)> {
    let (lo, hi) = gpus.fold((0.0f64, f64::MAX), |(lo, hi), g| {
        (lo.max(g.min_w), hi.min(g.max_w))
    });
    (lo > 0.0 && lo <= hi && hi < f64::MAX).then_some((lo, hi))
}

/// What a node that does not report may draw: every GPU at its default limit, since an
/// agent stopped cleanly restores the defaults and one that crashed may have left any
/// cap up to them, W.
pub fn silent_node_reserve_w(gpus: &[GpuInfo]) -> f64 {
    gpus.iter().map(|g| g.default_w.max(g.max_w)).sum()
}

/// The per-GPU cap a job not yet allocated starts at: min(fail-safe, budget / the site's
/// GPUs).
fn start_cap_w(nodes: &[NodeView], budget: Watts, settings: &SiteSettings) -> f64 {
    let gpus: usize = nodes.iter().map(|n| n.gpus.len()).sum();
    if gpus == 0 {
        return settings.failsafe_cap.0;
    }
    settings.failsafe_cap.0.min(budget.0 / gpus as f64).max(0.0)
}

/// Splits `budget` across the managed jobs of every live node.
pub fn decide(nodes: &[NodeView], budget: Watts, settings: &SiteSettings) -> Decision {
    let mut jobs: BTreeMap<String, SiteJob> = BTreeMap::new();
    let mut reserved = 0.0;
    let mut rejected: Vec<Rejected> = Vec::new();
    for node in nodes {
        if !node.live {
            reserved += silent_node_reserve_w(&node.gpus);
            continue;
        }
        if let Err(e) = validate_gpus(&node.gpus)
            .and_then(|()| validate_report_totals(&node.jobs, node.power_w, &node.gpus))
        {
            // Nothing the node says can be believed: pay for it as for a silent node
            // (the GPUs' limits are unknown too, so at the most a GPU may draw).
            reserved += node.gpus.len().min(MAX_GPUS_PER_NODE) as f64
                * node
                    .gpus
                    .iter()
                    .map(|g| g.max_w)
                    .filter(|w| w.is_finite())
                    .fold(0.0f64, f64::max)
                    .clamp(0.0, MAX_GPU_POWER_W);
            rejected.push(Rejected {
                node: node.node.clone(),
                job: None,
                reason: e.to_string(),
            });
            continue;
        }
        let node_range = common_range(node.gpus.iter());
        let mut node_managed = 0.0;
        for report in &node.jobs {
            let managed = parse_power_flex(&report.tier, &settings.tiers)
                .map(|r| r.service.is_managed())
                .unwrap_or(false);
            if !managed {
                continue;
            }
            if let Err(e) = report.validate(&node.gpus) {
                rejected.push(Rejected {
                    node: node.node.clone(),
                    job: Some(report.job_id.clone()),
                    reason: e.to_string(),
                });
                continue;
            }
            // The job's own GPUs decide its range; a node with two GPU models then
            // troubles only a job that spans both.
            let range = if report.gpu_uuids.is_empty() {
                node_range
            } else {
                common_range(
                    node.gpus
                        .iter()
                        .filter(|g| report.gpu_uuids.contains(&g.uuid)),
                )
            };
            let Some((min_cap, max_cap)) = range else {
                rejected.push(Rejected {
                    node: node.node.clone(),
                    job: Some(report.job_id.clone()),
                    reason: "the job's GPUs have no power limit in common (two GPU models)"
                        .to_string(),
                });
                continue;
            };
            let job = jobs
                .entry(report.job_id.clone())
                .or_insert_with(|| SiteJob {
                    tier: report.tier.clone(),
                    min_cap: 0.0,
                    max_cap: f64::MAX,
                    counts_tokens: true,
                    ..SiteJob::default()
                });
            job.gpus = job.gpus.saturating_add(report.gpus);
            job.nodes.push(node.node.clone());
            let power = report.power_w.unwrap_or(max_cap * f64::from(report.gpus));
            job.power_w += power;
            node_managed += power;
            job.pfi = job.pfi.or(report.pfi);
            if let Some(t) = report.throughput.filter(|t| t.is_finite() && *t > 0.0) {
                job.throughput = Some(job.throughput.unwrap_or(0.0) + t);
                job.counts_tokens &= report.throughput_unit.as_deref() == Some("tokens");
            }
            job.min_cap = job.min_cap.max(min_cap);
            job.max_cap = job.max_cap.min(max_cap);
            for p in &report.points {
                let entry = job
                    .points
                    .entry(p[0].round() as u64)
                    .or_insert((0.0, 0.0, 0));
                entry.0 += p[1];
                entry.1 += p[2];
                entry.2 += 1;
            }
        }
        reserved += (node.power_w - node_managed).max(0.0);
    }
    // The jobs the allocation can steer, and their measured points (caps every node of
    // the job measured: part of a job's power is no estimate of all of it).
    let mut steerable: Vec<(&String, &SiteJob, powerflex_core::flex::FlexRequest)> = Vec::new();
    let mut readings = Vec::new();
    for (id, job) in &jobs {
        let Ok(request) = parse_power_flex(&job.tier, &settings.tiers) else {
            continue;
        };
        if job.gpus == 0 || job.max_cap == f64::MAX || job.max_cap <= 0.0 {
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
        let nodes = job.nodes.len();
        let points: Vec<OperatingPoint> = job
            .points
            .iter()
            .filter(|(_, (_, _, n))| *n == nodes)
            .map(|(&cap, &(power, throughput, _))| OperatingPoint {
                cap_w: Watts(cap as f64),
                power_w: Watts(power),
                throughput,
            })
            .collect();
        if points.len() >= 2 {
            readings.push(JobReadings {
                points,
                min_cap_w: Watts(job.min_cap),
                cap_grid_w: Vec::new(),
            });
        }
        steerable.push((id, job, request));
    }
    let mut measured = estimate_population(&readings, MEASUREMENT_NOISE).into_iter();
    let mut curves = Vec::new();
    for (_, job, _) in &steerable {
        let nodes = job.nodes.len();
        let has_points = job.points.values().filter(|(_, _, n)| *n == nodes).count() >= 2;
        let curve = if has_points { measured.next() } else { None }.or_else(|| {
            CapCurve::from_pfi_prior(
                Watts(job.max_cap * f64::from(job.gpus)),
                job.throughput.unwrap_or(1.0),
                job.pfi.unwrap_or(settings.default_pfi).max(0.5),
                Watts(job.min_cap),
                Watts(job.max_cap),
                Watts(50.0),
            )
            .ok()
        });
        curves.push(curve);
    }
    // Tokens/s add up across jobs; steps/s (or a job with no throughput yet) do not.
    let raw_tokens = steerable.iter().zip(&curves).all(|((_, job, _), curve)| {
        curve.is_none() || (job.counts_tokens && job.throughput.is_some())
    });
    let mut specs = Vec::new();
    for ((id, job, request), curve) in steerable.iter().zip(curves) {
        let Some(curve) = curve else { continue };
        specs.push(JobSpec {
            id: (*id).clone(),
            gpus: job.gpus,
            throughput_weight: if raw_tokens {
                1.0
            } else {
                1.0 / curve.uncapped().throughput.max(1e-9)
            },
            curve,
            max_slowdown: request.service.max_slowdown(),
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
    let managed_budget = Watts((budget.0 - reserved).max(0.0));
    let allocation = allocate(&specs, managed_budget, settings.policy).ok();
    let mut leases: BTreeMap<String, BTreeMap<String, f64>> = BTreeMap::new();
    for node in nodes.iter().filter(|n| n.live) {
        leases.entry(node.node.clone()).or_default();
    }
    if let Some(a) = &allocation {
        for decided in &a.jobs {
            for node in jobs
                .get(&decided.id)
                .map(|j| j.nodes.clone())
                .unwrap_or_default()
            {
                leases
                    .entry(node)
                    .or_default()
                    .insert(decided.id.clone(), decided.cap_w.0);
            }
        }
    }
    Decision {
        leases,
        budget_w: budget.0,
        reserved_w: reserved,
        allocation,
        rejected,
        start_cap_w: start_cap_w(nodes, budget, settings),
        objective: if raw_tokens {
            "tokens/s"
        } else {
            "relative-speed"
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use powerflex_core::allocate::FloorStatus;

    fn gpu(i: u32) -> GpuInfo {
        GpuInfo {
            uuid: format!("GPU-{i}"),
            name: "NVIDIA H200".into(),
            min_w: 200.0,
            max_w: 700.0,
            default_w: 700.0,
        }
    }

    fn report(job: &str, tier: &str, gpus: u32, power: f64, points: Vec<[f64; 3]>) -> JobReport {
        JobReport {
            job_id: job.into(),
            tier: tier.into(),
            gpus,
            cap_w: Some(700.0),
            power_w: Some(power),
            throughput: Some(1000.0),
            throughput_unit: Some("tokens".into()),
            pfi: None,
            pfi_source: None,
            points,
            gpu_uuids: Vec::new(),
        }
    }

    fn settings() -> SiteSettings {
        SiteSettings {
            tiers: TierTable::default_table(),
            policy: Policy::Optimal,
            cap_step: Watts(10.0),
            failsafe_cap: Watts(500.0),
            default_pfi: 1.3,
        }
    }

    /// A job's measured points on one node with `g` GPUs: power follows the cap, PFI 2.
    fn points(g: f64) -> Vec<[f64; 3]> {
        [700.0, 500.0, 300.0]
            .iter()
            .map(|&c| [c, c * g, 1000.0 * (1.0 - (1.0 - c / 700.0) / 2.0)])
            .collect()
    }

    #[test]
    fn a_job_across_nodes_gets_one_cap_everywhere_within_the_budget() {
        let nodes = vec![
            NodeView {
                node: "n1".into(),
                gpus: (0..4).map(gpu).collect(),
                jobs: vec![report("7", "flex3", 4, 2800.0, points(4.0))],
                power_w: 2800.0,
                live: true,
            },
            NodeView {
                node: "n2".into(),
                gpus: (0..4).map(gpu).collect(),
                jobs: vec![report("7", "flex3", 4, 2800.0, points(4.0))],
                power_w: 2800.0,
                live: true,
            },
        ];
        let d = decide(&nodes, Watts(4000.0), &settings());
        let c1 = d.leases["n1"]["7"];
        let c2 = d.leases["n2"]["7"];
        assert_eq!(c1, c2, "one cap on all the job's GPUs");
        assert!(c1 * 8.0 <= 4000.0 + 1e-6, "8 GPUs at {c1} W within 4 kW");
        assert_eq!(d.reserved_w, 0.0);
    }

    #[test]
    fn unmanaged_idle_and_silent_power_comes_off_the_budget_first() {
        let nodes = vec![
            NodeView {
                node: "n1".into(),
                gpus: (0..4).map(gpu).collect(),
                jobs: vec![
                    report("7", "flex2", 2, 1400.0, points(2.0)),
                    report("8", "none", 2, 1300.0, vec![]),
                ],
                power_w: 2700.0,
                live: true,
            },
            NodeView {
                node: "n2".into(),
                gpus: (0..4).map(gpu).collect(),
                jobs: vec![report("9", "flex3", 4, 2800.0, points(4.0))],
                power_w: 2800.0,
                live: false,
            },
        ];
        let d = decide(&nodes, Watts(6000.0), &settings());
        // Unmanaged job 8 (1300 W) plus silent n2 at what it may draw: its GPUs' defaults
        // (a stopped agent restores them; a crashed one may have left any cap below).
        assert_eq!(d.reserved_w, 1300.0 + 2800.0);
        assert!(!d.leases.contains_key("n2"), "no lease for a silent node");
        assert!(
            !d.leases["n1"].contains_key("8"),
            "unmanaged jobs get no cap"
        );
        let cap = d.leases["n1"]["7"];
        assert!(cap * 2.0 <= 6000.0 - 4100.0 + 1e-6, "{cap}");
    }

    #[test]
    fn jobs_without_curves_are_allocated_on_a_prior() {
        let nodes = vec![NodeView {
            node: "n1".into(),
            gpus: (0..8).map(gpu).collect(),
            jobs: vec![report("5", "flex3", 8, 5600.0, vec![])],
            power_w: 5600.0,
            live: true,
        }];
        let d = decide(&nodes, Watts(4000.0), &settings());
        let cap = d.leases["n1"]["5"];
        assert!(cap < 700.0 && cap * 8.0 <= 4000.0 + 1e-6, "{cap}");
    }

    #[test]
    fn when_floors_cannot_all_hold_lower_tiers_give_way_first() {
        // One 4-GPU job per tier, all on the same PFI-2 curve measured down to 300 W
        // (their lowest cap). Floors need 2800 (flex0) + 2240 (flex1, cap 560) + 1400
        // (flex2, cap 350) + 1200 (flex3 at 300 W, within its 50 %) = 7640 W; the budget
        // is 6600 W. flex2 gives way to 300 W (1200 W), then flex1 takes what is left
        // (1400 W, cap 350 W) and flex0 keeps 700 W. These GPUs go no lower than 300 W,
        // so nothing is extrapolated.
        let nodes: Vec<NodeView> = ["flex0", "flex1", "flex2", "flex3"]
            .iter()
            .enumerate()
            .map(|(i, tier)| NodeView {
                node: format!("n{i}"),
                gpus: (0..4)
                    .map(|g| GpuInfo {
                        min_w: 300.0,
                        ..gpu(g)
                    })
                    .collect(),
                jobs: vec![report(&format!("{i}"), tier, 4, 2800.0, points(4.0))],
                power_w: 2800.0,
                live: true,
            })
            .collect();
        let d = decide(&nodes, Watts(6600.0), &settings());
        let a = d.allocation.expect("allocation");
        let floor = |id: &str| {
            a.jobs
                .iter()
                .find(|j| j.id == id)
                .map(|j| j.floor)
                .expect("job")
        };
        assert!(
            !matches!(floor("0"), FloorStatus::Broken { .. }),
            "flex0 gives way last: {:?}",
            floor("0")
        );
        assert!(
            matches!(floor("2"), FloorStatus::Broken { .. }),
            "flex2 gives way before flex1"
        );
        assert!(
            !matches!(floor("3"), FloorStatus::Broken { .. }),
            "flex3's 50 % bound holds even at its lowest cap"
        );
        assert_eq!(d.leases["n0"]["0"], 700.0);
        assert_eq!(
            d.leases["n2"]["2"], 300.0,
            "flex2 is taken to its lowest cap first"
        );
        assert!(matches!(floor("1"), FloorStatus::Broken { .. }));
        assert_eq!(
            d.leases["n1"]["1"], 350.0,
            "then flex1 gives up what is still short"
        );
        let granted: f64 = a.jobs.iter().map(|j| j.power_w.0).sum();
        assert!(granted <= 6600.0 + 1e-6, "{granted} W");
    }

    /// A job measured down to 400 W, with a flex1 neighbour whose floor the budget cannot
    /// pay unless someone goes lower.
    fn measured_to_400(tier_of_second: &str, budget_w: f64) -> Decision {
        let to_400 = |g: f64| -> Vec<[f64; 3]> {
            points(g)
                .into_iter()
                .filter(|p| p[0] >= 400.0)
                .chain([
                    [
                        600.0,
                        600.0 * g,
                        1000.0 * (1.0 - (1.0 - 600.0 / 700.0) / 2.0),
                    ],
                    [
                        400.0,
                        400.0 * g,
                        1000.0 * (1.0 - (1.0 - 400.0 / 700.0) / 2.0),
                    ],
                ])
                .collect()
        };
        let nodes = vec![NodeView {
            node: "n1".into(),
            gpus: (0..8).map(gpu).collect(),
            jobs: vec![
                report("1", "flex3", 4, 2800.0, to_400(4.0)),
                report("2", tier_of_second, 4, 2800.0, to_400(4.0)),
            ],
            power_w: 5600.0,
            live: true,
        }];
        decide(&nodes, Watts(budget_w), &settings())
    }

    #[test]
    fn below_the_lowest_measured_cap_only_when_a_floor_needs_it() {
        // Enough budget with both at or above 400 W: nothing goes below the measurements.
        let d = measured_to_400("flex3", 3600.0);
        assert!(
            d.leases["n1"].values().all(|&c| c >= 400.0),
            "{:?}",
            d.leases
        );
        assert_eq!(d.objective, "tokens/s");
        // flex1 needs about 580 W (2320 W) to hold 10 %; at 3400 W the flex3 job must go
        // below its lowest reading (1600 W at 400 W) to pay for it.
        let d = measured_to_400("flex1", 3400.0);
        let a = d.allocation.expect("allocation");
        assert!(a.broken_floors().next().is_none(), "{a:?}");
        assert!(d.leases["n1"]["1"] < 400.0, "{:?}", d.leases);
        assert!(a.total_power_w.0 <= 3400.0 + 1e-6);
    }

    #[test]
    fn throughput_adds_up_across_nodes_and_steps_switch_the_objective() {
        let mut nodes: Vec<NodeView> = ["n1", "n2"]
            .iter()
            .map(|n| NodeView {
                node: (*n).into(),
                gpus: (0..4).map(gpu).collect(),
                jobs: vec![report("7", "flex3", 4, 2800.0, points(4.0))],
                power_w: 2800.0,
                live: true,
            })
            .collect();
        let d = decide(&nodes, Watts(4000.0), &settings());
        let a = d.allocation.expect("allocation");
        // Each node measured 1000 tokens/s uncapped: the job makes 2000.
        let uncapped = a.jobs[0].throughput / (1.0 - a.jobs[0].slowdown);
        assert!((uncapped - 2000.0).abs() < 20.0, "{uncapped}");
        assert_eq!(d.objective, "tokens/s");
        nodes[1].jobs[0].throughput_unit = Some("steps".into());
        assert_eq!(
            decide(&nodes, Watts(4000.0), &settings()).objective,
            "relative-speed"
        );
    }

    fn node(name: &str, gpus: Vec<GpuInfo>, jobs: Vec<JobReport>) -> NodeView {
        let power_w = jobs
            .iter()
            .filter_map(|j| j.power_w)
            .filter(|p| p.is_finite())
            .sum();
        NodeView {
            node: name.into(),
            gpus,
            jobs,
            power_w,
            live: true,
        }
    }

    /// Issue: one bad report cancelled the whole site's allocation (`allocate(..).ok()`),
    /// dropping every managed job to the fail-safe cap.
    #[test]
    fn a_bad_report_hurts_only_its_sender() {
        let mut nan = report("2", "flex2", 4, f64::NAN, points(4.0));
        nan.pfi = Some(1.5);
        let mut negative = report("3", "flex2", 4, -5000.0, points(4.0));
        negative.throughput = Some(1000.0);
        let mut huge = report("4", "flex2", u32::MAX, 2800.0, points(4.0));
        huge.throughput = Some(1e300);
        let nodes = vec![
            node(
                "good",
                (0..4).map(gpu).collect(),
                vec![report("1", "flex3", 4, 2800.0, points(4.0))],
            ),
            node("nan", (0..4).map(gpu).collect(), vec![nan]),
            node("negative", (0..4).map(gpu).collect(), vec![negative]),
            node("huge", (0..4).map(gpu).collect(), vec![huge]),
        ];
        let d = decide(&nodes, Watts(9000.0), &settings());
        let a = d.allocation.as_ref().expect("the good job is allocated");
        assert_eq!(a.jobs.len(), 1, "{a:?}");
        assert_eq!(a.jobs[0].id, "1");
        assert!(d.leases["good"].contains_key("1"));
        let refused: Vec<_> = d.rejected.iter().map(|r| r.node.as_str()).collect();
        assert!(
            refused.contains(&"nan") && refused.contains(&"huge"),
            "{:?}",
            d.rejected
        );
        // A negative node power cannot shrink what is reserved for others.
        assert!(d.reserved_w >= 0.0);
        assert!(refused.contains(&"negative"), "{:?}", d.rejected);
    }

    #[test]
    fn a_node_announcing_a_zero_minimum_is_paid_for_and_the_rest_is_allocated() {
        let mut broken: Vec<GpuInfo> = (0..4).map(gpu).collect();
        broken[0].min_w = 0.0;
        let nodes = vec![
            node(
                "good",
                (0..4).map(gpu).collect(),
                vec![report("1", "flex3", 4, 2800.0, points(4.0))],
            ),
            node(
                "broken",
                broken,
                vec![report("2", "flex3", 4, 2800.0, points(4.0))],
            ),
        ];
        let d = decide(&nodes, Watts(5000.0), &settings());
        let a = d.allocation.as_ref().expect("allocation");
        assert_eq!(
            a.jobs.iter().map(|j| j.id.as_str()).collect::<Vec<_>>(),
            ["1"]
        );
        assert_eq!(
            d.reserved_w,
            4.0 * 700.0,
            "the broken node is paid at its GPUs' most"
        );
        assert!(a.jobs[0].cap_w.0 * 4.0 <= 5000.0 - 2800.0 + 1e-9);
        assert_eq!(d.rejected.len(), 1);
        assert_eq!(d.rejected[0].job, None);
    }

    #[test]
    fn two_gpu_models_on_one_node_are_handled_per_job() {
        let mut gpus: Vec<GpuInfo> = (0..4).map(gpu).collect();
        for g in &mut gpus[2..] {
            g.name = "NVIDIA L4".into();
            g.min_w = 40.0;
            g.max_w = 72.0;
            g.default_w = 72.0;
        }
        let mut big = report("1", "flex3", 2, 1400.0, points(2.0));
        big.gpu_uuids = vec!["GPU-0".into(), "GPU-1".into()];
        let mut small = report("2", "flex3", 2, 140.0, Vec::new());
        small.gpu_uuids = vec!["GPU-2".into(), "GPU-3".into()];
        let d = decide(
            &[node("mixed", gpus, vec![big, small])],
            Watts(1200.0),
            &settings(),
        );
        let a = d.allocation.as_ref().expect("allocation");
        assert_eq!(a.jobs.len(), 2, "{:?}", d.rejected);
        let cap = |id: &str| a.jobs.iter().find(|j| j.id == id).map(|j| j.cap_w.0);
        let big_cap = cap("1").expect("job 1");
        let small_cap = cap("2").expect("job 2");
        assert!((200.0..=700.0).contains(&big_cap), "{big_cap}");
        assert!((40.0..=72.0).contains(&small_cap), "{small_cap}");
    }

    #[test]
    fn a_job_starting_during_a_cut_starts_at_the_cuts_share() {
        let n = node("n", (0..8).map(gpu).collect(), Vec::new());
        assert_eq!(
            decide(std::slice::from_ref(&n), Watts(8.0 * 700.0), &settings()).start_cap_w,
            500.0
        );
        assert_eq!(
            decide(&[n], Watts(8.0 * 250.0), &settings()).start_cap_w,
            250.0
        );
    }

    #[test]
    fn a_silent_node_is_reserved_at_its_defaults_not_the_failsafe() {
        let mut silent = node("quiet", (0..8).map(gpu).collect(), Vec::new());
        silent.live = false;
        let d = decide(&[silent], Watts(9000.0), &settings());
        assert_eq!(d.reserved_w, 8.0 * 700.0);
    }
}
