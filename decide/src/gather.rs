//! The nodes' reports validated and gathered per job across nodes, and what the
//! allocation must leave for everything it does not steer on each node.

use std::collections::BTreeMap;

use powerflex_core::config::BudgetMode;
use powerflex_core::flex::parse_power_flex;
use powerflex_proto::report::{
    validate_gpus, validate_report_totals, GpuInfo, JobReport, MAX_GPUS_PER_NODE, MAX_GPU_POWER_W,
};
use powerflex_proto::status::PfiSource;
use powerflex_proto::usage::ThroughputUnit;

use crate::{NodeView, SiteSettings};
use powerflex_proto::status::Rejected;

/// A job gathered across nodes.
#[derive(Debug, Default)]
pub(crate) struct SiteJob {
    pub(crate) tier: String,
    pub(crate) gpus: u32,
    pub(crate) nodes: Vec<String>,
    /// The job's GPUs on each of `nodes`, in order: its power through a domain is the
    /// share of its GPUs behind it.
    pub(crate) node_gpus: Vec<u32>,
    pub(crate) power_w: f64,
    /// The first PFI a node measured for the job.
    pub(crate) pfi: Option<f64>,
    /// The first prior PFI a node planned the job on (one that has not walked it).
    pub(crate) prior_pfi: Option<f64>,
    /// Some node of the job plans it on a prior: the job was not walked there.
    pub(crate) unwalked_node: bool,
    /// Summed over the nodes that report it.
    pub(crate) throughput: Option<f64>,
    /// Whether every node that reports progress counts tokens.
    pub(crate) counts_tokens: bool,
    /// cap → (summed power, summed throughput, nodes that measured it).
    pub(crate) points: BTreeMap<u64, (f64, f64, usize)>,
    /// cap → (summed variance of power W², of throughput, nodes that said): the
    /// agents' standard errors of the same points (their windows' spread).
    pub(crate) sigma: BTreeMap<u64, (f64, f64, usize)>,
    pub(crate) min_cap: f64,
    pub(crate) max_cap: f64,
    /// Per-GPU cap in force on the job's GPUs as the agents read it back (the highest
    /// across its nodes), W; `None` when a node did not say.
    pub(crate) cap_now_w: Option<f64>,
    /// Whether every node of the job reported its power (the metered correction needs
    /// the whole job's draw).
    pub(crate) power_from_every_node: bool,
    /// The default limits of the job's GPUs, summed: the most they draw uncapped, W.
    pub(crate) default_w: f64,
    /// Whether on every node the cap had held long enough for the draw to show it.
    pub(crate) power_steady: bool,
    /// The shortest time the cap had held on any of the job's nodes, s.
    pub(crate) cap_steady_s: f64,
    /// Whether an agent is walking the job's calibration now.
    pub(crate) calibrating: bool,
    /// Whether a new step put the job's curve in question on any of its nodes.
    pub(crate) curve_in_question: bool,
}

impl SiteJob {
    /// The PFI the job is planned on without measured points: a measured one only when
    /// every node of the job measured it. A node that did not walk sets the pace of the
    /// ones that did (a two-node job whose second node never walked reads a PFI of 6.24
    /// against a true 3.12 on the first), so, as with the points, part of a
    /// job's walk is no measure of all of it: the nodes' prior then.
    pub(crate) fn planning_pfi(&self) -> Option<f64> {
        if self.unwalked_node {
            self.prior_pfi
        } else {
            self.pfi
        }
    }
}

/// How long a cap must have held before the draw sampled under it is taken as the job's
/// draw at that cap, s: NVML's power reading averages over about a second, and the draw
/// settles within a few hundred milliseconds of a cap change.
const STEADY_AFTER_CAP_CHANGE_S: f64 = 1.0;

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

/// The name each GPU of an [`unheard_node_view`] carries, so it is never taken for a
/// GPU a node announced.
pub const UNHEARD_GPU_NAME: &str = "(never heard from)";

/// A node the site names (Slurm's node list, a power domain's hostlist) whose agent
/// has never spoken to this controller, as a silent node of `gpus` GPUs at `max_gpu_w`
/// each (the largest `max_cap_w` of the site's GPU models): nothing steers it, its GPUs
/// may sit at any default limit the site's models allow, so the allocation pays for it
/// at that worst case, in the site's budget and in every domain on its path, until its
/// agent says hello and the node is paid for at what it announces and reports.
pub fn unheard_node_view(node: &str, gpus: u32, max_gpu_w: f64) -> NodeView {
    let w = if max_gpu_w.is_finite() {
        max_gpu_w.clamp(0.0, MAX_GPU_POWER_W)
    } else {
        MAX_GPU_POWER_W
    };
    NodeView {
        node: node.to_string(),
        gpus: (0..gpus.min(MAX_GPUS_PER_NODE as u32))
            .map(|i| GpuInfo {
                uuid: format!("unheard-{node}-{i}"),
                name: UNHEARD_GPU_NAME.to_string(),
                min_w: w,
                max_w: w,
                default_w: w,
            })
            .collect(),
        jobs: Vec::new(),
        power_w: 0.0,
        live: false,
    }
}

/// The power range of a job's GPUs on one node, W, and the most one GPU of the node
/// draws by default (for a job that does not name its GPUs).
struct NodeLimits {
    min_cap: f64,
    max_cap: f64,
    default_w: f64,
}

/// One node's report of a managed job, merged into the job as gathered across its nodes.
/// Returns what the job may draw at most on this node (at its GPUs' defaults) and what
/// it is taken to draw now, W.
fn merge_report(
    jobs: &mut BTreeMap<String, SiteJob>,
    node: &NodeView,
    report: &JobReport,
    limits: NodeLimits,
) -> (f64, f64) {
    let first_node = !jobs.contains_key(&report.job_id);
    let job = jobs
        .entry(report.job_id.clone())
        .or_insert_with(|| SiteJob {
            tier: report.tier.clone(),
            min_cap: 0.0,
            max_cap: f64::MAX,
            counts_tokens: true,
            power_from_every_node: true,
            ..SiteJob::default()
        });
    // The cap the draw was measured at: the one read back with it, else the last
    // written. Nodes that disagree leave no single cap to compare with.
    let measured_at = report.power_cap_w.or(report.cap_w);
    job.cap_now_w = match (first_node, job.cap_now_w, measured_at) {
        (true, _, now) => now,
        (false, Some(a), Some(b)) if (a - b).abs() <= 0.5 => Some(a),
        (false, _, _) => None,
    };
    let steady = report
        .power_cap_steady_s
        .is_some_and(|s| s >= STEADY_AFTER_CAP_CHANGE_S);
    job.power_steady = if first_node {
        steady
    } else {
        job.power_steady && steady
    };
    let held_s = report.power_cap_steady_s.unwrap_or(0.0);
    job.cap_steady_s = if first_node {
        held_s
    } else {
        job.cap_steady_s.min(held_s)
    };
    job.calibrating |= report.calibrating;
    job.curve_in_question |= report.curve_in_question;
    job.power_from_every_node &= report.power_w.is_some();
    let job_default_w = if report.gpu_uuids.is_empty() {
        f64::from(report.gpus) * limits.default_w
    } else {
        node.gpus
            .iter()
            .filter(|g| report.gpu_uuids.contains(&g.uuid))
            .map(|g| g.default_w)
            .sum()
    };
    job.default_w += job_default_w;
    job.gpus = job.gpus.saturating_add(report.gpus);
    job.nodes.push(node.node.clone());
    job.node_gpus.push(report.gpus);
    let power = report
        .power_w
        .unwrap_or(limits.max_cap * f64::from(report.gpus));
    job.power_w += power;
    // A node on a prior has not walked the job; an agent from before `pfi_source`
    // (none) is taken at its word, as it always was.
    if report.pfi_source == Some(PfiSource::Prior) {
        job.unwalked_node = true;
        job.prior_pfi = job.prior_pfi.or(report.pfi);
    } else {
        job.pfi = job.pfi.or(report.pfi);
    }
    if let Some(t) = report.throughput.filter(|t| t.is_finite() && *t > 0.0) {
        job.throughput = Some(job.throughput.unwrap_or(0.0) + t);
        job.counts_tokens &= report.throughput_unit == Some(ThroughputUnit::Tokens);
    }
    job.min_cap = job.min_cap.max(limits.min_cap);
    job.max_cap = job.max_cap.min(limits.max_cap);
    for p in &report.curve {
        let ok = |x: f64| x.is_finite() && x >= 0.0;
        if !(ok(p.power_sigma_w) && ok(p.throughput_sigma)) {
            continue;
        }
        let entry = job
            .sigma
            .entry(p.cap_w.round() as u64)
            .or_insert((0.0, 0.0, 0));
        entry.0 += p.power_sigma_w.powi(2);
        entry.1 += p.throughput_sigma.powi(2);
        entry.2 += 1;
    }
    for p in &report.points {
        let entry = job
            .points
            .entry(p.cap_w.0.round() as u64)
            .or_insert((0.0, 0.0, 0));
        entry.0 += p.power_w.0;
        entry.1 += p.throughput;
        entry.2 += 1;
    }
    (job_default_w, power)
}

/// What the nodes' reports say, gathered per job across nodes: the jobs the allocation
/// may steer, the power it must leave for everything else (silent nodes, idle GPUs,
/// unmanaged jobs), and the reports it refused.
pub(crate) struct Gathered {
    pub(crate) jobs: BTreeMap<String, SiteJob>,
    pub(crate) reserved: f64,
    /// `reserved`, node by node (for the power domains the nodes are in).
    pub(crate) reserved_at: BTreeMap<String, f64>,
    pub(crate) rejected: Vec<Rejected>,
}

pub(crate) fn gather_jobs(nodes: &[NodeView], settings: &SiteSettings) -> Gathered {
    let mut jobs: BTreeMap<String, SiteJob> = BTreeMap::new();
    let mut reserved_at: BTreeMap<String, f64> = BTreeMap::new();
    let mut rejected: Vec<Rejected> = Vec::new();
    for node in nodes {
        if !node.live {
            *reserved_at.entry(node.node.clone()).or_default() += silent_node_reserve_w(&node.gpus);
            continue;
        }
        if let Err(e) = validate_gpus(&node.gpus)
            .and_then(|()| validate_report_totals(&node.jobs, node.power_w, &node.gpus))
        {
            // Nothing the node says can be believed: pay for it as for a silent node
            // (the GPUs' limits are unknown too, so at the most a GPU may draw).
            *reserved_at.entry(node.node.clone()).or_default() +=
                node.gpus.len().min(MAX_GPUS_PER_NODE) as f64
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
        // What the node's managed jobs may draw at most, W, and the most one GPU of the
        // node does (for a job that does not name its GPUs).
        let mut node_managed_default_w = 0.0;
        let node_default_w = node.gpus.iter().map(|g| g.default_w).fold(0.0, f64::max);
        for report in &node.jobs {
            let tier = &report.tier;
            let managed = parse_power_flex(tier, &settings.tiers)
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
            let (default_w, power_w) = merge_report(
                &mut jobs,
                node,
                report,
                NodeLimits {
                    min_cap,
                    max_cap,
                    default_w: node_default_w,
                },
            );
            node_managed_default_w += default_w;
            node_managed += power_w;
        }
        *reserved_at.entry(node.node.clone()).or_default() += match settings.budget_mode {
            // Idle GPUs, unmanaged jobs and GPUs the agent cannot steer: at their default
            // limit, whatever they draw now.
            BudgetMode::Hard => {
                (silent_node_reserve_w(&node.gpus) - node_managed_default_w).max(0.0)
            }
            BudgetMode::Metered { .. } => (node.power_w - node_managed).max(0.0),
        };
    }
    Gathered {
        jobs,
        reserved: reserved_at.values().sum(),
        reserved_at,
        rejected,
    }
}
