//! Cuts deeper than caps: which jobs to suspend or requeue, and when to give them back.
//! Pure; the controller's step calls [`plan`] in place of [`powerflex_decide::decide`] and
//! hands the [`Action`]s to a thread that runs `scontrol`.
//!
//! Caps stop at the GPUs' minimum (200 W on an H200) and at each tier's floor. When a grid
//! event asks for less than that, the allocation alone reports floors broken and the site
//! stays over. Jobs that allow it (`--power-flex=flex3,preempt=suspend|requeue`, or the
//! site's `[tiers.preempt]` default for their tier) are then held out:
//!
//! - **Which**: lowest tier first (the order tiers give way in), within a tier the job
//!   drawing most first; a job with a bound of 0 (flex0) never. Greedy until the
//!   allocation holds every floor within the budget, then any job the later ones made
//!   unnecessary is given back: only as many as the budget needs.
//! - **How they count**: a suspended job keeps its GPUs, which fall to idle draw; until
//!   its agent has had time to report that, it counts at an estimate of idle draw
//!   ([`SUSPENDED_SHARE_OF_DEFAULT`] of its GPUs' default limit), then at what it draws
//!   (at most its lowest cap, which its lease holds it to). A requeued job draws nothing.
//! - **When back**: every allocation tries to resume the held jobs, highest tier first,
//!   each only if the allocation still holds every floor with it back at a budget
//!   [`RESUME_MARGIN`] lower (so measurement noise does not suspend and resume the same
//!   job in turn). Requeued jobs are released once no cut is in force or ahead: their
//!   draw is unknown until they run again.

use std::borrow::Cow;
use std::collections::{BTreeMap, BTreeSet};

use serde::{Deserialize, Serialize};

use powerflex_core::flex::{give_way_order, parse_power_flex, Preempt};
use powerflex_core::units::SlowdownFraction;
use powerflex_core::Watts;

use powerflex_decide::{
    decide_steady, Decision, Held, NodeView, SiteSettings, SUSPENDED_SHARE_OF_DEFAULT,
};

/// How long a suspended job counts at the estimate before its reported draw is believed,
/// ms: `scontrol suspend` stops it within a second and the agent reports within one
/// sample; a few seconds covers a busy host.
pub const STOP_GRACE_MS: u64 = 5_000;

/// A held job comes back only if every floor still holds at this much less budget.
pub const RESUME_MARGIN: f64 = 0.02;

/// A job the controller holds out of the allocation.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Preempted {
    /// `suspend` or `requeue`.
    pub how: Preempt,
    /// When it was held, Unix ms.
    pub since_ms: u64,
}

/// What to ask Slurm to do.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Action {
    /// `scontrol suspend`: stopped, its GPUs kept.
    Suspend { job: String },
    /// `scontrol resume`.
    Resume { job: String },
    /// `scontrol requeuehold`: back to the queue, held there until released.
    Requeue { job: String },
    /// `scontrol release`: the requeued job may start again.
    Release { job: String },
}

impl Action {
    /// The `scontrol` arguments.
    pub fn scontrol_args(&self) -> [&str; 2] {
        match self {
            Action::Suspend { job } => ["suspend", job],
            Action::Resume { job } => ["resume", job],
            Action::Requeue { job } => ["requeuehold", job],
            Action::Release { job } => ["release", job],
        }
    }

    pub fn job(&self) -> &str {
        self.scontrol_args()[1]
    }
}

/// The allocation and who is held out of it.
#[derive(Debug, Clone, PartialEq)]
pub struct Plan {
    pub decision: Decision,
    pub held: BTreeMap<String, Preempted>,
    pub actions: Vec<Action>,
}

/// A managed job as the planner sees it, across its nodes.
#[derive(Debug, Clone)]
struct Candidate {
    id: String,
    bound: SlowdownFraction,
    preempt: Preempt,
    power_w: f64,
    /// Estimated draw once suspended, W.
    idle_w: f64,
    /// The nodes it runs on (for the power domains it draws through).
    nodes: Vec<String>,
}

fn candidates(nodes: &[NodeView], settings: &SiteSettings) -> BTreeMap<String, Candidate> {
    let mut out: BTreeMap<String, Candidate> = BTreeMap::new();
    for node in nodes.iter().filter(|n| n.live) {
        let default_w = node.gpus.iter().map(|g| g.default_w).fold(0.0, f64::max);
        for report in &node.jobs {
            let Ok(request) = parse_power_flex(&report.tier, &settings.tiers) else {
                continue;
            };
            let Some(bound) = request.service.max_slowdown() else {
                continue;
            };
            let c = out.entry(report.job_id.clone()).or_insert(Candidate {
                id: report.job_id.clone(),
                bound,
                preempt: settings.tiers.preempt_for(&request),
                power_w: 0.0,
                idle_w: 0.0,
                nodes: Vec::new(),
            });
            c.nodes.push(node.node.clone());
            c.power_w += report.power_w.unwrap_or(0.0).max(0.0);
            c.idle_w += f64::from(report.gpus) * default_w * SUSPENDED_SHARE_OF_DEFAULT;
        }
    }
    out
}

/// Whether `d` leaves the site short: some floor broken, or over the budget with every
/// job at its lowest cap.
pub fn short(d: &Decision) -> bool {
    d.allocation.as_ref().is_some_and(|a| {
        a.over_budget_w.0 > 0.0
            || a.broken_floors().next().is_some()
            // A domain over its limit with its jobs at their lowest caps: jobs whose
            // floor is their lowest cap break no bound, yet the breaker is over.
            || a.domains.iter().any(|d| d.lowest_over_w.0 > 0.0)
    })
}

/// Whether holding `c` out can help where `d` is short. Where some power domain binds
/// (its jobs' floors do not fit its limit), a job drawing through one such domain helps
/// it; a job elsewhere helps only where the site itself is short beyond those domains
/// (over its budget at the lowest caps, or a job outside every binding domain over its
/// bound). Without binding domains, any job.
fn helps(
    d: &Decision,
    settings: &SiteSettings,
    jobs: &BTreeMap<String, Candidate>,
    c: &Candidate,
) -> bool {
    let (Some(domains), Some(a)) = (&settings.domains, &d.allocation) else {
        return true;
    };
    let binding: Vec<usize> = a
        .domains
        .iter()
        .enumerate()
        .filter(|(_, used)| used.binds() || used.lowest_over_w.0 > 0.0)
        .map(|(i, _)| i)
        .collect();
    let behind_binding = |nodes: &[String]| {
        nodes.iter().any(|node| {
            domains
                .tree
                .path_of_node(node)
                .iter()
                .any(|d| binding.contains(d))
        })
    };
    if binding.is_empty() || behind_binding(&c.nodes) {
        return true;
    }
    a.over_budget_w.0 > 0.0
        || a.broken_floors().any(|j| {
            jobs.get(&j.id)
                .is_none_or(|other| !behind_binding(&other.nodes))
        })
}

/// What each held job counts at (see [`Held`]), and each job someone else suspended
/// (`suspended`, from Slurm's record; see [`Outlook::suspended`]): what it draws, at most
/// its lowest cap per GPU, where it is leased (in `hard` mode, that cap: see [`Held`]).
/// In metered mode a resume by whoever suspended it brings its load back at that cap
/// before a report says so: the draw may pass the budget by the difference for a report
/// and an allocation period, as for any job whose load returns (the metered margin's
/// business). Counted at its lowest cap, the watts between that and its idle draw would
/// be held for nothing while it stays stopped, and where the budget is tight a running
/// job's floor would give way for them. A job allowed no slowdown, or one no
/// live node reports, is left to the allocation (a flex0 job is never capped, suspended
/// or not).
fn counted(
    held: &BTreeMap<String, Preempted>,
    suspended: &BTreeSet<String>,
    jobs: &BTreeMap<String, Candidate>,
    now_ms: u64,
) -> Held {
    let others = suspended
        .iter()
        .filter(|id| !held.contains_key(*id))
        .filter_map(|id| {
            jobs.get(id).filter(|c| c.bound.0 > 0.0)?;
            Some((id.clone(), None))
        });
    held.iter()
        .map(|(id, p)| {
            // Just stopped (suspended, or requeued and being ended by Slurm): its GPUs at
            // idle draw. Later, what it draws (a requeued job no node reports counts
            // nothing: its idle GPUs are in its node's draw).
            let count = match jobs.get(id) {
                Some(c) if now_ms.saturating_sub(p.since_ms) < STOP_GRACE_MS => Some(c.idle_w),
                _ => None,
            };
            (id.clone(), count)
        })
        .chain(others)
        .collect()
}

/// What the planner knows beyond the nodes' views.
#[derive(Clone, Copy)]
pub struct Outlook<'a> {
    /// Whether any event cuts the budget now or within the look-ahead (requeued jobs
    /// wait for none).
    pub cut_ahead: bool,
    /// Whether Slurm still holds a job (running, suspended or pending, not ended), from
    /// its own record; `None` without Slurm's record (`job_placement = "reports"`).
    pub in_slurm: Option<&'a dyn Fn(&str) -> bool>,
    /// The jobs Slurm's record shows suspended that the controller did not suspend (an
    /// admin's `scontrol suspend`, Slurm's own gang scheduling). Their GPUs idle: each
    /// with a bound above zero counts at what it draws, at most its lowest cap per GPU,
    /// and is leased at that cap (see [`Held`]) instead of holding its grant's watts from
    /// the running jobs; it is never picked to give way. Once Slurm shows it running again
    /// it is allocated as any job: until then (up to `controller.slurm_poll_s` and an
    /// allocation period) a resumed job runs at its lowest cap.
    pub suspended: &'a BTreeSet<String>,
}

/// No job suspended by anyone else.
static NONE_SUSPENDED: BTreeSet<String> = BTreeSet::new();

impl std::fmt::Debug for Outlook<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Outlook")
            .field("cut_ahead", &self.cut_ahead)
            .field("in_slurm", &self.in_slurm.map(|_| "Slurm's record"))
            .field("suspended", &self.suspended)
            .finish()
    }
}

impl Outlook<'_> {
    /// No Slurm record to consult.
    pub fn cut(cut_ahead: bool) -> Outlook<'static> {
        Outlook {
            cut_ahead,
            in_slurm: None,
            suspended: &NONE_SUSPENDED,
        }
    }
}

/// Allocates `budget` with as few jobs held out as every floor needs. `held` is who is
/// held now; `in_force` the caps of the last allocation, which stay while they are as
/// good (see [`decide_steady`]).
///
/// A held job stays held until it is given back (and the resume or release sent) or
/// Slurm says it ended: a node silent or slow to report it for one allocation does not
/// drop it, or the job would stay suspended with no resume ever sent. Without Slurm's
/// record, a suspended job no live node reports counts as ended once it has had time to
/// be reported.
pub fn plan(
    nodes: &[NodeView],
    budget: Watts,
    settings: &SiteSettings,
    held: &BTreeMap<String, Preempted>,
    outlook: Outlook,
    in_force: &BTreeMap<String, f64>,
    now_ms: u64,
) -> Plan {
    let cut_ahead = outlook.cut_ahead;
    let jobs = candidates(nodes, settings);
    let mut now_held = held.clone();
    now_held.retain(|id, p| match outlook.in_slurm {
        Some(in_slurm) => in_slurm(id),
        None => {
            p.how == Preempt::Requeue
                || jobs.contains_key(id)
                || now_ms.saturating_sub(p.since_ms) < STOP_GRACE_MS
        }
    });
    // A job given back is allocated on its curve, not on the idle draw it reported while
    // suspended (in metered mode that draw would scale its curve down and buy it a cap
    // it would overshoot at once).
    let decide_with =
        |now_held: &BTreeMap<String, Preempted>, budget: Watts, settings: &SiteSettings| {
            let resumed = |id: &str| held.contains_key(id) && !now_held.contains_key(id);
            // Most decisions give nothing back: the nodes are then read as they are, not
            // copied (a copy of every report is a tenth of a step at 80,000 jobs).
            let views: Cow<[NodeView]> = if held.keys().any(|id| resumed(id)) {
                Cow::Owned(
                    nodes
                        .iter()
                        .map(|n| {
                            let mut n = n.clone();
                            for j in n.jobs.iter_mut().filter(|j| resumed(&j.job_id)) {
                                j.power_w = None;
                                j.power_cap_steady_s = Some(0.0);
                            }
                            n
                        })
                        .collect(),
                )
            } else {
                Cow::Borrowed(nodes)
            };
            decide_steady(
                &views,
                budget,
                settings,
                &counted(now_held, outlook.suspended, &jobs, now_ms),
                in_force,
            )
        };
    let decide = |now_held: &BTreeMap<String, Preempted>, budget: Watts| {
        decide_with(now_held, budget, settings)
    };
    // A give-back is checked with the site's budget and every domain's limit
    // RESUME_MARGIN lower, so noise does not suspend and resume the same job in turn.
    let with_margin = SiteSettings {
        domains: settings.domains.clone().map(|mut d| {
            for limit in &mut d.limits_w {
                *limit *= 1.0 - RESUME_MARGIN;
            }
            d
        }),
        ..settings.clone()
    };
    let mut decision = decide(&now_held, budget);
    if short(&decision) {
        // Lowest tier first; within a tier, the job drawing most frees most.
        let mut order: Vec<&Candidate> = jobs
            .values()
            .filter(|c| c.preempt != Preempt::Never && c.bound.0 > 0.0)
            .filter(|c| !now_held.contains_key(&c.id))
            .filter(|c| !outlook.suspended.contains(&c.id))
            .collect();
        order.sort_by(|a, b| {
            give_way_order(a.bound, b.bound)
                .then(b.power_w.total_cmp(&a.power_w))
                .then(a.id.cmp(&b.id))
        });
        let mut added: Vec<String> = Vec::new();
        // In that order, the next job whose holding can help where the site is short now
        // (a binding domain's, when one binds: preemption stays inside it).
        while let Some(c) = order
            .iter()
            .find(|c| !now_held.contains_key(&c.id) && helps(&decision, settings, &jobs, c))
        {
            now_held.insert(
                c.id.clone(),
                Preempted {
                    how: c.preempt,
                    since_ms: now_ms,
                },
            );
            added.push(c.id.clone());
            decision = decide(&now_held, budget);
            if !short(&decision) {
                break;
            }
        }
        // Give back any the later, larger ones made unnecessary.
        if !short(&decision) {
            for id in added.iter().rev().skip(1) {
                let Some(p) = now_held.remove(id) else {
                    continue;
                };
                let without = decide(&now_held, budget);
                if short(&without) {
                    now_held.insert(id.clone(), p);
                } else {
                    decision = without;
                }
            }
        }
    } else {
        // Give back, highest tier first (the reverse of giving way), what fits.
        let mut back: Vec<(String, Preempted)> = now_held
            .iter()
            .filter(|(_, p)| p.how == Preempt::Suspend)
            .filter(|(id, _)| jobs.contains_key(*id))
            .map(|(id, p)| (id.clone(), p.clone()))
            .collect();
        back.sort_by(|(a, pa), (b, pb)| {
            let bound = |id: &String| jobs.get(id).map_or(SlowdownFraction(1.0), |c| c.bound);
            give_way_order(bound(b), bound(a))
                .then(pb.since_ms.cmp(&pa.since_ms))
                .then(a.cmp(b))
        });
        for (id, p) in back {
            now_held.remove(&id);
            let fits = !short(&decide_with(
                &now_held,
                Watts(budget.0 * (1.0 - RESUME_MARGIN)),
                &with_margin,
            ));
            if fits {
                decision = decide(&now_held, budget);
            } else {
                now_held.insert(id, p);
            }
        }
        if !cut_ahead {
            now_held.retain(|_, p| p.how != Preempt::Requeue);
        }
        if now_held.len() != held.len() {
            decision = decide(&now_held, budget);
        }
    }
    let mut actions = Vec::new();
    for (id, p) in &now_held {
        if !held.contains_key(id) {
            actions.push(match p.how {
                Preempt::Requeue => Action::Requeue { job: id.clone() },
                _ => Action::Suspend { job: id.clone() },
            });
        }
    }
    for (id, p) in held {
        if !now_held.contains_key(id) && (jobs.contains_key(id) || p.how == Preempt::Requeue) {
            actions.push(match p.how {
                Preempt::Requeue => Action::Release { job: id.clone() },
                _ => Action::Resume { job: id.clone() },
            });
        }
    }
    Plan {
        decision,
        held: now_held,
        actions,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use powerflex_core::allocate::Policy;
    use powerflex_core::config::{BudgetMode, Objective};
    use powerflex_core::flex::TierTable;
    use powerflex_proto::report::{GpuInfo, JobReport};
    use powerflex_proto::usage::ThroughputUnit;

    const T0: u64 = 1_800_000_000_000;

    fn settings() -> SiteSettings {
        let mut tiers = TierTable::default_table();
        tiers.set_preempt("flex2", Preempt::Requeue);
        SiteSettings {
            tiers,
            policy: Policy::Optimal,
            cap_step: Watts(10.0),
            failsafe_cap: Watts(500.0),
            default_pfi: 1.3,
            budget_mode: BudgetMode::Metered { margin: 0.0 },
            objective: Objective::RelativeSpeed,
            tier_bounds: powerflex_decide::TierBounds::Honoured,
            domains: None,
        }
    }

    /// A 4-GPU job at `cap_w` drawing `per_gpu_w` per GPU, with a measured curve.
    fn job(id: &str, tier: &str, cap_w: f64, per_gpu_w: f64) -> JobReport {
        JobReport {
            job_id: id.into(),
            tier: tier.into(),
            gpus: 4,
            cap_w: Some(cap_w),
            power_w: Some(per_gpu_w * 4.0),
            throughput: Some(1000.0),
            throughput_unit: Some(ThroughputUnit::Tokens),
            pfi: Some(1.3),
            pfi_source: None,
            points: [700.0, 500.0, 300.0, 200.0]
                .iter()
                .map(|&c| [c, c * 4.0, 1000.0 * (1.0 - (1.0 - c / 700.0) / 2.0)])
                .map(powerflex_proto::point::from_array)
                .collect(),
            gpu_uuids: Vec::new(),
            power_cap_w: Some(cap_w),
            power_cap_steady_s: Some(10.0),
            calibrating: false,
            curve_in_question: false,
            curve: Vec::new(),
            calibration_cost_pct: None,
            owner_uid: None,
            usage: None,
        }
    }

    fn node(name: &str, jobs: Vec<JobReport>) -> NodeView {
        NodeView {
            node: name.into(),
            gpus: (0..4)
                .map(|i| GpuInfo {
                    uuid: format!("{name}-{i}"),
                    name: "NVIDIA H200".into(),
                    min_w: 200.0,
                    max_w: 700.0,
                    default_w: 700.0,
                })
                .collect(),
            power_w: jobs.iter().filter_map(|j| j.power_w).sum(),
            jobs,
            live: true,
        }
    }

    /// flex0, flex1, flex3 (suspend allowed by the job), flex3 (not allowed), one node each.
    fn site() -> Vec<NodeView> {
        vec![
            node("n1", vec![job("10", "flex0", 700.0, 700.0)]),
            node("n2", vec![job("11", "flex1", 700.0, 700.0)]),
            node("n3", vec![job("13", "flex3,preempt=suspend", 700.0, 700.0)]),
            node("n4", vec![job("14", "flex3", 700.0, 700.0)]),
        ]
    }

    fn ids(held: &BTreeMap<String, Preempted>) -> Vec<&str> {
        held.keys().map(String::as_str).collect()
    }

    #[test]
    fn caps_alone_when_they_reach() {
        let p = plan(
            &site(),
            Watts(8000.0),
            &settings(),
            &BTreeMap::new(),
            Outlook::cut(true),
            &BTreeMap::new(),
            T0,
        );
        assert!(p.held.is_empty() && p.actions.is_empty());
        assert!(!short(&p.decision));
    }

    /// A job an admin suspended (`scontrol suspend`; Slurm's record says so, the
    /// controller did not) idles on its GPUs: it counts at what its node reports it
    /// drawing, at most its lowest cap per GPU, and is leased there, so its grant's watts
    /// go to the running jobs instead of being held for a job that draws nothing. It is
    /// never picked to give way, nor resumed by the controller.
    #[test]
    fn a_job_suspended_by_an_admin_counts_at_its_idle_draw() {
        let mut nodes = site();
        // Job 14 suspended: its GPUs idle at 75 W each, its lease still 700 W.
        nodes[3] = node("n4", vec![job("14", "flex3", 700.0, 75.0)]);
        let suspended: BTreeSet<String> = ["14".to_string()].into();
        let in_slurm = |_: &str| true;
        let outlook = |suspended| Outlook {
            cut_ahead: true,
            in_slurm: Some(&in_slurm),
            suspended,
        };
        let held = BTreeMap::new();
        let plan_at = |budget_w: f64, suspended| {
            plan(
                &nodes,
                Watts(budget_w),
                &settings(),
                &held,
                outlook(suspended),
                &BTreeMap::new(),
                T0,
            )
        };
        let with = plan_at(8000.0, &suspended);
        let without = plan_at(8000.0, &NONE_SUSPENDED);
        assert!(
            with.held.is_empty() && with.actions.is_empty(),
            "{:?}",
            with.actions
        );
        assert_eq!(with.decision.leases["n4"].get("14"), Some(&200.0));
        let allocation = with.decision.allocation.as_ref().expect("allocation");
        assert!(
            allocation.jobs.iter().all(|j| j.id != "14"),
            "held out of the allocation: {allocation:?}"
        );
        // Counted at its 300 W draw, not at its 2,800 W grant: the others get the rest.
        let cap = |p: &Plan, id: &str| {
            p.decision
                .leases
                .values()
                .find_map(|l| l.get(id).copied())
                .expect("leased")
        };
        assert!(
            cap(&with, "13") > cap(&without, "13"),
            "{} vs {}",
            cap(&with, "13"),
            cap(&without, "13")
        );
        // A flex0 job an admin suspended is never capped: left to the allocation.
        let flex0: BTreeSet<String> = ["10".to_string()].into();
        let p = plan_at(8000.0, &flex0);
        assert_eq!(p.decision.leases["n1"].get("10"), Some(&700.0));
        // Even when the budget is short, the controller does not pick it to give way.
        let short_plan = plan_at(5000.0, &suspended);
        assert!(
            short_plan.actions.iter().all(|a| a.job() != "14"),
            "{:?}",
            short_plan.actions
        );
    }

    /// Floors: flex0 2800 W, flex1 at its 10 % bound 2240 W (560 W per GPU), flex3 at the
    /// 200 W minimum 800 W each: 6640 W. At 6400 W one flex3 job must stop, the one that
    /// allows it; suspended, it counts at 4 x 105 W until its agent reports.
    #[test]
    fn one_suspension_when_one_is_needed_and_never_flex0() {
        let settings = settings();
        let p = plan(
            &site(),
            Watts(6400.0),
            &settings,
            &BTreeMap::new(),
            Outlook::cut(true),
            &BTreeMap::new(),
            T0,
        );
        assert_eq!(ids(&p.held), ["13"], "{:?}", p.decision.allocation);
        assert_eq!(p.actions, [Action::Suspend { job: "13".into() }]);
        assert!(!short(&p.decision), "{:?}", p.decision.allocation);
        assert_eq!(
            p.decision.leases["n3"].get("13"),
            Some(&200.0),
            "held at its lowest cap"
        );
        assert_eq!(
            p.decision.leases["n1"].get("10"),
            Some(&700.0),
            "flex0 untouched"
        );
        // Deeper than anything can reach: still only the job that allows it, and flex0
        // is never held.
        let p = plan(
            &site(),
            Watts(3000.0),
            &settings,
            &BTreeMap::new(),
            Outlook::cut(true),
            &BTreeMap::new(),
            T0,
        );
        assert_eq!(ids(&p.held), ["13"]);
        assert!(short(&p.decision));
    }

    /// The test site's settings with racks (name, nodes as a hostlist, limit in force W)
    /// at the top of its domain tree.
    fn with_racks(racks: &[(&str, &str, f64)]) -> SiteSettings {
        use powerflex_core::domains::{DomainTree, RawDomain};
        let raw: Vec<RawDomain> = racks
            .iter()
            .map(|&(name, nodes, _)| RawDomain {
                name: name.into(),
                parent: None,
                gpu_limit_w: 100_000.0,
                nodes: Some(nodes.into()),
            })
            .collect();
        let tree = DomainTree::build(&raw).expect("valid");
        let mut domains = powerflex_decide::SiteDomains::configured(&tree).expect("domains");
        for (limit, &(_, _, in_force)) in domains.limits_w.iter_mut().zip(racks) {
            *limit = in_force;
        }
        SiteSettings {
            domains: Some(domains),
            ..settings()
        }
    }

    /// Two racks, each with a flex1 job and a flex3 job that allows suspension; rack B's
    /// flex3 job draws more, so a site-wide cut would hold it first. Rack A's breaker
    /// alone cannot pay its floors: only rack A's flex3 job is held, and rack B is not
    /// touched.
    #[test]
    fn a_domain_short_of_its_floors_preempts_inside_it_only() {
        // Rack A: flex1 at its bound 2240 W + flex3 at 800 W = 3040 W of floors; 2900 W.
        let settings = with_racks(&[("rack-a", "n1,n2", 2900.0), ("rack-b", "n3,n4", 100_000.0)]);
        let nodes = vec![
            node("n1", vec![job("21", "flex1", 700.0, 700.0)]),
            node("n2", vec![job("23", "flex3,preempt=suspend", 700.0, 600.0)]),
            node("n3", vec![job("31", "flex1", 700.0, 700.0)]),
            node("n4", vec![job("33", "flex3,preempt=suspend", 700.0, 700.0)]),
        ];
        let p = plan(
            &nodes,
            Watts(100_000.0),
            &settings,
            &BTreeMap::new(),
            Outlook::cut(true),
            &BTreeMap::new(),
            T0,
        );
        assert_eq!(ids(&p.held), ["23"], "{:?}", p.decision.allocation);
        assert!(!short(&p.decision), "{:?}", p.decision.allocation);
        assert_eq!(p.decision.leases["n3"].get("31"), Some(&700.0));
        assert_eq!(p.decision.leases["n4"].get("33"), Some(&700.0));
    }

    /// A rack over its limit even with its jobs at their lowest caps, where no job's
    /// bound is broken (flex3 jobs whose floor is their lowest cap): still short, and the
    /// rack's job that allows it is held out.
    #[test]
    fn a_domain_over_its_limit_at_the_lowest_caps_is_short_though_no_bound_breaks() {
        // Two flex3 jobs at their lowest caps: 2 × 4 × 200 W = 1600 W; the rack gets 1000 W.
        let settings = with_racks(&[("rack-a", "n1,n2", 1000.0)]);
        let nodes = vec![
            node("n1", vec![job("41", "flex3", 700.0, 700.0)]),
            node("n2", vec![job("43", "flex3,preempt=suspend", 700.0, 700.0)]),
        ];
        let p = plan(
            &nodes,
            Watts(100_000.0),
            &settings,
            &BTreeMap::new(),
            Outlook::cut(true),
            &BTreeMap::new(),
            T0,
        );
        assert_eq!(ids(&p.held), ["43"], "{:?}", p.decision.allocation);
    }

    #[test]
    fn the_suspended_job_counts_at_its_draw_after_the_grace_and_comes_back_when_it_fits() {
        let settings = settings();
        let first = plan(
            &site(),
            Watts(6400.0),
            &settings,
            &BTreeMap::new(),
            Outlook::cut(true),
            &BTreeMap::new(),
            T0,
        );
        // Suspended: its agent reports it at idle draw, at its lowest cap.
        let mut nodes = site();
        nodes[2] = node("n3", vec![job("13", "flex3,preempt=suspend", 200.0, 75.0)]);
        let t = T0 + STOP_GRACE_MS + 1;
        let held = plan(
            &nodes,
            Watts(6400.0),
            &settings,
            &first.held,
            Outlook::cut(true),
            &BTreeMap::new(),
            t,
        );
        assert_eq!(ids(&held.held), ["13"], "still needed");
        assert!(held.actions.is_empty());
        assert!(!short(&held.decision));
        // The event ends: it resumes.
        let back = plan(
            &nodes,
            Watts(11_200.0),
            &settings,
            &held.held,
            Outlook::cut(false),
            &BTreeMap::new(),
            t + 1000,
        );
        assert!(back.held.is_empty());
        assert_eq!(back.actions, [Action::Resume { job: "13".into() }]);
        // A budget where it fits only without the margin (6640 W of 6700 W): it stays held.
        let edge = plan(
            &nodes,
            Watts(6700.0),
            &settings,
            &held.held,
            Outlook::cut(true),
            &BTreeMap::new(),
            t + 1000,
        );
        assert_eq!(ids(&edge.held), ["13"], "{:?}", edge.decision.allocation);
    }

    #[test]
    fn lowest_tier_first_and_only_as_many_as_needed() {
        let settings = settings();
        let nodes = vec![
            node("n1", vec![job("20", "flex2", 700.0, 700.0)]), // requeue: the site's flex2 default
            node("n2", vec![job("21", "flex3,preempt=suspend", 700.0, 700.0)]),
            node("n3", vec![job("22", "flex3,preempt=suspend", 700.0, 700.0)]),
            node("n4", vec![job("23", "flex0", 700.0, 700.0)]),
        ];
        // Floors: flex2 1400 W (350 W per GPU), flex3 800 W each, flex0 2800 W: 5800 W.
        let p = plan(
            &nodes,
            Watts(5500.0),
            &settings,
            &BTreeMap::new(),
            Outlook::cut(true),
            &BTreeMap::new(),
            T0,
        );
        assert_eq!(p.held.len(), 1, "{:?}", p.held);
        assert!(
            ["21", "22"].contains(&ids(&p.held)[0]),
            "a flex3 job before the flex2 one"
        );
        // Much deeper: both flex3 jobs, then the flex2 one, requeued.
        let p = plan(
            &nodes,
            Watts(3200.0),
            &settings,
            &BTreeMap::new(),
            Outlook::cut(true),
            &BTreeMap::new(),
            T0,
        );
        assert_eq!(ids(&p.held), ["20", "21", "22"]);
        assert!(p.actions.contains(&Action::Requeue { job: "20".into() }));
        // Requeued jobs are released only once no cut is in force or ahead.
        let mut gone = nodes.clone();
        gone[0] = node("n1", vec![]);
        let later = plan(
            &gone,
            Watts(11_200.0),
            &settings,
            &p.held,
            Outlook::cut(true),
            &BTreeMap::new(),
            T0 + 60_000,
        );
        assert!(later.held.contains_key("20"));
        let over = plan(
            &gone,
            Watts(11_200.0),
            &settings,
            &later.held,
            Outlook::cut(false),
            &BTreeMap::new(),
            T0 + 70_000,
        );
        assert!(over.held.is_empty(), "{:?}", over.held);
        assert!(over.actions.contains(&Action::Release { job: "20".into() }));
    }

    #[test]
    fn a_suspended_job_that_ended_is_forgotten() {
        let settings = settings();
        let first = plan(
            &site(),
            Watts(6000.0),
            &settings,
            &BTreeMap::new(),
            Outlook::cut(true),
            &BTreeMap::new(),
            T0,
        );
        let mut nodes = site();
        nodes[2] = node("n3", vec![]);
        let p = plan(
            &nodes,
            Watts(6000.0),
            &settings,
            &first.held,
            Outlook::cut(true),
            &BTreeMap::new(),
            T0 + STOP_GRACE_MS,
        );
        assert!(p.held.is_empty());
        assert!(p.actions.is_empty(), "nothing to resume: {:?}", p.actions);
    }

    /// A held job stays held while its node is silent or slow to report it for an
    /// allocation: dropped from the held set then, it would never be resumed.
    #[test]
    fn with_slurm_s_record_a_held_job_stays_held_through_a_silent_node_and_is_resumed() {
        let settings = settings();
        let first = plan(
            &site(),
            Watts(6400.0),
            &settings,
            &BTreeMap::new(),
            Outlook::cut(true),
            &BTreeMap::new(),
            T0,
        );
        assert_eq!(ids(&first.held), ["13"]);
        let alive = |_: &str| true;
        let slurm = |cut_ahead| Outlook {
            cut_ahead,
            in_slurm: Some(&alive),
            suspended: &NONE_SUSPENDED,
        };
        // n3 silent for several allocations, the cut over meanwhile.
        let mut nodes = site();
        nodes[2].live = false;
        let mut held = first.held.clone();
        for k in 1..=3 {
            let p = plan(
                &nodes,
                Watts(11_200.0),
                &settings,
                &held,
                slurm(false),
                &BTreeMap::new(),
                T0 + k * STOP_GRACE_MS,
            );
            assert_eq!(ids(&p.held), ["13"], "still held while n3 is silent");
            assert!(p.actions.is_empty(), "{:?}", p.actions);
            held = p.held;
        }
        // n3 back (the job suspended, at idle draw): resumed.
        nodes[2] = node("n3", vec![job("13", "flex3,preempt=suspend", 200.0, 75.0)]);
        let p = plan(
            &nodes,
            Watts(11_200.0),
            &settings,
            &held,
            slurm(false),
            &BTreeMap::new(),
            T0 + 5 * STOP_GRACE_MS,
        );
        assert!(p.held.is_empty());
        assert_eq!(p.actions, [Action::Resume { job: "13".into() }]);
        // Slurm says it ended (cancelled while suspended; its node no longer reports it):
        // forgotten, nothing sent.
        let ended = |_: &str| false;
        nodes[2] = node("n3", vec![]);
        let p = plan(
            &nodes,
            Watts(6400.0),
            &settings,
            &held,
            Outlook {
                cut_ahead: true,
                in_slurm: Some(&ended),
                suspended: &NONE_SUSPENDED,
            },
            &BTreeMap::new(),
            T0 + 5 * STOP_GRACE_MS,
        );
        assert!(p.held.is_empty(), "{:?}", p.held);
        assert!(p.actions.is_empty(), "{:?}", p.actions);
    }
}
