//! One allocation, start to end: the reports gathered, the jobs' curves, what is held
//! and reserved, the split of what is left, and each node's lease.

use std::collections::{BTreeMap, BTreeSet};

use serde::Serialize;

use powerflex_core::allocate::{
    allocate_cautious_doubting, allocate_within, floor_point, Allocation, Caution, DomainLimit,
    JobSpec, Maximised, Policy,
};
use powerflex_core::config::BudgetMode;
use powerflex_core::Watts;

use crate::gather::{gather_jobs, Gathered, SiteJob};
use crate::reserve::{domain_limits, hold_unplaced, unsteered_reserve_w};
use crate::specs::{job_specs, Specs};
use crate::steady::keep_steady;
use crate::{NodeView, SiteSettings};
use powerflex_proto::status::{Drift, Rejected, ShedReach};

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
    /// Jobs whose measurements left their curve's band.
    pub drifted: Vec<Drift>,
    /// Per-GPU cap for a managed job that starts before the next allocation names it:
    /// the fail-safe cap, or the budget's even share per GPU of the site when that is
    /// lower (a job that starts during a cut does not start above the cut), W.
    pub start_cap_w: f64,
    /// What the allocation maximised: "tokens/s" (every managed job reports tokens) or
    /// "relative-speed" (the sum of each job's throughput over its uncapped throughput).
    pub objective: Maximised,
    /// What the site can shed now: the lowest budgets that keep every floor, with every
    /// job at its tier floor, and with the jobs whose tier allows it held out at idle.
    pub shed_reach: Option<ShedReach>,
}

/// The lowest budgets that hold every managed job within its tier's bound: each job at
/// its tier floor as the allocator would set it ([`floor_point`], its power as the
/// budget counts it), plus what the allocation does not steer (`reserved_w`), over the
/// metered margin; and the same with every job whose tier allows preemption counted as
/// the preemption planner counts it once held out (idle draw metered, lowest caps hard).
/// A job whose spec the allocator refuses is left out (it is not steered).
fn shed_reach(
    specs: &[JobSpec],
    preemptable_held_w: &BTreeMap<String, f64>,
    reserved_w: f64,
    settings: &SiteSettings,
) -> ShedReach {
    let usable_share = match settings.budget_mode {
        BudgetMode::Hard => 1.0,
        BudgetMode::Metered { margin } => (1.0 - margin.clamp(0.0, 1.0)).max(1e-9),
    };
    let (mut caps_w, mut preempted_w) = (reserved_w, reserved_w);
    let mut preemptable_jobs = 0;
    for spec in specs {
        let Ok(floor) = floor_point(spec) else {
            continue;
        };
        caps_w += floor.power_w.0;
        match preemptable_held_w.get(&spec.id) {
            Some(&held_w) if held_w < floor.power_w.0 => {
                preempted_w += held_w;
                preemptable_jobs += 1;
            }
            _ => preempted_w += floor.power_w.0,
        }
    }
    ShedReach {
        caps_w: caps_w / usable_share,
        with_preemption_w: preempted_w / usable_share,
        preemptable_jobs,
    }
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

/// Jobs held out of the allocation (suspended or requeued in a cut deeper than caps reach: the
/// controller machine's `preempt`), each with the draw to count it at: `Some(w)` (an estimate,
/// while the job is being stopped), or `None`: what it draws now, at most its lowest cap on every
/// GPU (`hard` mode: that cap on every GPU, trusting no meter). Their leases hold them at their
/// lowest cap, so a job resumed before the next allocation starts there.
pub type Held = BTreeMap<String, Option<f64>>;

/// Splits `budget` across the managed jobs of every live node.
pub fn decide(nodes: &[NodeView], budget: Watts, settings: &SiteSettings) -> Decision {
    decide_holding(nodes, budget, settings, &Held::new())
}

/// [`decide`], with the jobs in `held` left out of the allocation and counted as it says.
pub fn decide_holding(
    nodes: &[NodeView],
    budget: Watts,
    settings: &SiteSettings,
    held: &Held,
) -> Decision {
    decide_steady(nodes, budget, settings, held, &BTreeMap::new())
}

/// The allocation of what the budget leaves after `reserved_w`, by the site's policy,
/// kept steady where a change would buy too little (see [`decide_steady`]).
fn site_allocation(
    specs: &[JobSpec],
    in_doubt: &BTreeSet<String>,
    budget: Watts,
    reserved_w: f64,
    domains: &[DomainLimit],
    settings: &SiteSettings,
    in_force: &BTreeMap<String, f64>,
) -> Option<Allocation> {
    let usable = match settings.budget_mode {
        BudgetMode::Hard => budget.0,
        BudgetMode::Metered { margin } => budget.0 * (1.0 - margin.clamp(0.0, 1.0)),
    };
    let managed_budget = Watts((usable - reserved_w).max(0.0));
    // The optimal policy leans to the equal split as far as the curves' uncertainty
    // warrants: the rule `powerflexctl evaluate` scores (see `allocate_cautious`), with
    // no power margin here, since the metered loop corrects each job's power by its
    // draw every period and the budget's metered margin covers the rest. A job whose
    // curve is in doubt keeps its equal-split cap: the optimiser trades power only
    // between jobs measured where it moves them.
    let doubted: Vec<bool> = specs.iter().map(|s| in_doubt.contains(&s.id)).collect();
    let allocation = match settings.policy {
        Policy::Optimal => allocate_cautious_doubting(
            specs,
            managed_budget,
            domains,
            Caution {
                power_z: 0.0,
                ..Caution::default()
            },
            &doubted,
        )
        // Still the optimal policy when the rule kept the equal split's caps: that is
        // what optimal means on curves this uncertain.
        .map(|c| Allocation {
            policy: Policy::Optimal,
            ..c.allocation
        })
        .ok(),
        policy => allocate_within(specs, managed_budget, domains, policy).ok(),
    };
    allocation.map(|a| keep_steady(a, specs, &doubted, managed_budget, domains, in_force))
}

/// Each live node's lease: every job on it at its decided cap, a held job at its lowest
/// cap, and an empty lease for a node with nothing to steer (it still learns the start
/// cap and that the controller is there).
fn leases_of(
    nodes: &[NodeView],
    jobs: &BTreeMap<String, SiteJob>,
    held: &Held,
    allocation: Option<&Allocation>,
) -> BTreeMap<String, BTreeMap<String, f64>> {
    let mut leases: BTreeMap<String, BTreeMap<String, f64>> = BTreeMap::new();
    for node in nodes.iter().filter(|n| n.live) {
        leases.entry(node.node.clone()).or_default();
    }
    for id in held.keys() {
        if let Some(job) = jobs.get(id) {
            for node in &job.nodes {
                leases
                    .entry(node.clone())
                    .or_default()
                    .insert(id.clone(), job.min_cap);
            }
        }
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
    leases
}

/// [`decide_holding`], steady: when the caps in force (`in_force`, job → per-GPU cap, W) still fit
/// the budget and hold every tier's floor on the current curves, and the new decision would keep no
/// more than [`STEADY_GAIN`](crate::STEADY_GAIN) of the objective over them, or no more than
/// [`STEADY_Z`](crate::STEADY_Z) standard deviations of that difference on the curves' own
/// uncertainty (a gain the noise alone could show), they stay. Any new or ended job, a budget they
/// no longer fit, a floor they break, or a gain worth a change decides afresh.
pub fn decide_steady(
    nodes: &[NodeView],
    budget: Watts,
    settings: &SiteSettings,
    held: &Held,
    in_force: &BTreeMap<String, f64>,
) -> Decision {
    let Gathered {
        jobs,
        mut reserved,
        reserved_at,
        mut rejected,
    } = gather_jobs(nodes, settings);
    let with_unplaced = hold_unplaced(nodes, &jobs, settings, held, &mut rejected);
    let held = with_unplaced.as_ref().unwrap_or(held);
    let Specs {
        specs,
        drifted,
        raw_tokens,
        in_doubt,
        preemptable_held_w,
    } = job_specs(&jobs, settings, held, &mut rejected);
    let reserved_jobs = unsteered_reserve_w(&jobs, &specs, held, settings);
    reserved += reserved_jobs.values().sum::<f64>();
    let domains = settings
        .domains
        .as_ref()
        .map(|d| domain_limits(d, &jobs, &specs, &reserved_at, &reserved_jobs, settings))
        .unwrap_or_default();
    let allocation = site_allocation(
        &specs, &in_doubt, budget, reserved, &domains, settings, in_force,
    );
    let leases = leases_of(nodes, &jobs, held, allocation.as_ref());
    Decision {
        leases,
        budget_w: budget.0,
        reserved_w: reserved,
        allocation,
        rejected,
        drifted,
        start_cap_w: start_cap_w(nodes, budget, settings),
        objective: if raw_tokens {
            Maximised::TokensPerS
        } else {
            Maximised::RelativeSpeed
        },
        shed_reach: Some(shed_reach(&specs, &preemptable_held_w, reserved, settings)),
    }
}
