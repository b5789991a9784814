//! The typed views the admin socket answers with: the status snapshot, and an allocation
//! decision as the wire shows it. Pure.

use std::collections::BTreeMap;

use powerflex_core::Watts;
use powerflex_proto::status::{
    CtldStatus, CurveSnapshot, DecisionView, DomainStatus, NodeStatus, PreemptedView, SiteJobStatus,
};

use super::session::Session;
use super::state::CtldState;
use crate::schedule::{active_event, effective_budget};
use powerflex_decide::Decision;

/// The controller's status at `now_ms`.
pub fn build(
    state: &CtldState,
    base_budget: Watts,
    sessions: &BTreeMap<String, Session>,
    last: Option<&Decision>,
    config_error: Option<&str>,
    curve_history: &BTreeMap<String, Vec<CurveSnapshot>>,
    now_ms: u64,
) -> CtldStatus {
    let base = state.budget_w.unwrap_or(base_budget);
    // The site's own events; a domain's cut its domain (see [`domains`]).
    let site_events = crate::schedule::of_domain(&state.events, None);
    let budget = effective_budget(base, &site_events, now_ms);
    let draw = live_draw_w(sessions);
    let allocation = last.and_then(|d| d.allocation.as_ref());
    let granted = |job: &str| allocation.and_then(|a| a.jobs.iter().find(|j| j.id == job));
    let mut jobs: BTreeMap<String, SiteJobStatus> = BTreeMap::new();
    for s in sessions.values() {
        for j in &s.view.jobs {
            let entry = jobs
                .entry(j.job_id.clone())
                .or_insert_with(|| SiteJobStatus {
                    job: j.job_id.clone(),
                    tier: j.tier.clone(),
                    nodes: Vec::new(),
                    gpus: 0,
                    pfi: j.pfi,
                    pfi_source: j.pfi_source,
                    cap_w: granted(&j.job_id).map(|g| g.cap_w.0),
                    floor: granted(&j.job_id).map(|g| g.floor),
                    throughput: j.throughput,
                    uncapped_throughput: j.points.first().map(|p| p.throughput),
                    power_w: 0.0,
                    points: BTreeMap::new(),
                    curve: BTreeMap::new(),
                    curve_history: curve_history.get(&j.job_id).cloned().unwrap_or_default(),
                    calibration_cost_pct: None,
                    drift: last
                        .and_then(|d| d.drifted.iter().find(|x| x.job == j.job_id))
                        .cloned(),
                    owner_uid: j.owner_uid,
                    below_measured_w: None,
                    energy_j: None,
                    capped_pct: None,
                });
            // Every node running the job must name the same owner (see
            // [`super::owners::agreed`]): else nobody but root sees it.
            if entry.owner_uid != j.owner_uid {
                entry.owner_uid = None;
            }
            entry.nodes.push(s.view.node.clone());
            entry.gpus += j.gpus;
            entry.power_w += j.power_w.unwrap_or(0.0);
            entry.points.insert(s.view.node.clone(), j.points.clone());
            if !j.curve.is_empty() {
                entry.curve.insert(s.view.node.clone(), j.curve.clone());
            }
            entry.calibration_cost_pct = entry.calibration_cost_pct.or(j.calibration_cost_pct);
            if let Some(u) = &j.usage {
                entry.energy_j = Some(entry.energy_j.unwrap_or(0.0) + u.energy_mj as f64 / 1000.0);
                if u.observed_s > 0.0 {
                    let pct = 100.0 * u.capped_s / u.observed_s;
                    entry.capped_pct = Some(entry.capped_pct.map_or(pct, |p| p.max(pct)));
                }
            }
        }
    }
    for job in jobs.values_mut() {
        job.below_measured_w = below_measured_w(job);
    }
    CtldStatus {
        base_budget_w: base.0,
        budget_w: budget.0,
        allocated_budget_w: last.map(|d| d.budget_w),
        preempted: state
            .preempted
            .iter()
            .map(|(job, p)| PreemptedView {
                job: job.clone(),
                how: p.how,
                since_ms: p.since_ms,
            })
            .collect(),
        draw_w: draw,
        headroom_w: budget.0 - draw,
        active_event: active_event(base, &site_events, now_ms).cloned(),
        events: state.events.clone(),
        over_budget_w: allocation.map(|a| a.over_budget_w.0),
        shed_reach: last.and_then(|d| d.shed_reach),
        nodes: sessions
            .values()
            .map(|s| NodeStatus {
                node: s.view.node.clone(),
                gpus: s.view.gpus.len() as u32,
                live: s.draw_known(),
                power_w: s.view.power_w,
                jobs: s.view.jobs.len() as u32,
                seen_ms_ago: now_ms.saturating_sub(s.last_seen_ms),
                refused_reports: s.refused_reports,
                refused_gpus: s.refused_gpus,
                domain: None,
                unmanaged_reserve_w: None,
            })
            .collect(),
        jobs: jobs.into_values().collect(),
        config_error: config_error.map(str::to_string),
        jobs_of_uid: None,
        slurm: None,
        accounting_db: None,
        domains: Vec::new(),
        leadership: None,
        refused_by: Default::default(),
        unmanaged_reserve_w: None,
    }
}

/// Each power domain of `site` at `now_ms`: its budget in force (its base, from
/// `base_of`, less its events' deepest cut), what its live nodes draw, and what the last
/// allocation planned through it.
pub fn domains(
    site: &powerflex_decide::SiteDomains,
    state: &CtldState,
    sessions: &BTreeMap<String, Session>,
    last: Option<&Decision>,
    base_of: impl Fn(&str) -> Watts,
    now_ms: u64,
) -> Vec<DomainStatus> {
    let tree = &site.tree;
    let n = tree.domains().len();
    let (mut draw, mut nodes, mut live) = (vec![0.0; n], vec![0u32; n], vec![0u32; n]);
    for s in sessions.values() {
        for d in tree.path_of_node(&s.view.node) {
            nodes[d] += 1;
            if s.draw_known() {
                live[d] += 1;
                draw[d] += s.view.power_w;
            }
        }
    }
    let used = last
        .and_then(|d| d.allocation.as_ref())
        .map(|a| a.domains.as_slice())
        .unwrap_or_default();
    tree.preorder()
        .into_iter()
        .map(|d| {
            let domain = &tree.domains()[d];
            let base = base_of(&domain.name);
            let events = crate::schedule::of_domain(&state.events, Some(&domain.name));
            let budget = effective_budget(base, &events, now_ms).0;
            // The allocation lists the domains in the tree's order.
            let planned = used.get(d).filter(|u| u.name == domain.name);
            DomainStatus {
                name: domain.name.clone(),
                parent: domain.parent.map(|p| tree.domains()[p].name.clone()),
                depth: tree.depth(d) as u32,
                limit_w: domain.gpu_limit.0,
                budget_w: budget,
                draw_w: draw[d],
                headroom_w: budget - draw[d],
                nodes: nodes[d],
                live_nodes: live[d],
                planned_w: planned.map(|u| u.power_w.0),
                floors_over_w: planned.map(|u| u.floors_over_w.0),
                event: active_event(base, &events, now_ms).map(|e| e.id),
                unmanaged_reserve_w: None,
            }
        })
        .collect()
}

/// Summed draw of the nodes that reported within their lease (since their hello), W.
pub fn live_draw_w(sessions: &BTreeMap<String, Session>) -> f64 {
    sessions
        .values()
        .filter(|s| s.draw_known())
        .map(|s| s.view.power_w)
        .sum()
}

/// An allocation decision as the admin protocol shows it.
pub fn decision_view(d: &Decision) -> DecisionView {
    DecisionView {
        leases: d.leases.clone(),
        budget_w: d.budget_w,
        reserved_w: d.reserved_w,
        allocation: d.allocation.clone(),
        rejected: d.rejected.clone(),
        drifted: d.drifted.clone(),
        start_cap_w: d.start_cap_w,
        objective: d.objective,
    }
}

/// The job's lowest measured cap, when its granted cap lies below it (by more than
/// rounding): the caps every node of the job measured are its measured territory.
fn below_measured_w(job: &SiteJobStatus) -> Option<f64> {
    let cap = job.cap_w?;
    let lowest = job
        .points
        .values()
        .map(|points| {
            points
                .iter()
                .map(|p| p.cap_w.0)
                .fold(f64::INFINITY, f64::min)
        })
        .fold(f64::NEG_INFINITY, f64::max);
    (lowest.is_finite() && cap < lowest - 0.5).then_some(lowest)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn job(cap_w: Option<f64>, points: &[(&str, &[f64])]) -> SiteJobStatus {
        SiteJobStatus {
            job: "7".into(),
            tier: "flex3".into(),
            nodes: points.iter().map(|(n, _)| n.to_string()).collect(),
            gpus: 8,
            pfi: None,
            pfi_source: None,
            cap_w,
            floor: None,
            throughput: None,
            uncapped_throughput: None,
            power_w: 0.0,
            points: points
                .iter()
                .map(|(n, caps)| {
                    (
                        n.to_string(),
                        caps.iter()
                            .map(|&c| [c, 4.0 * c, 1.0])
                            .map(powerflex_proto::point::from_array)
                            .collect(),
                    )
                })
                .collect(),
            curve: BTreeMap::new(),
            curve_history: Vec::new(),
            calibration_cost_pct: None,
            drift: None,
            owner_uid: None,
            below_measured_w: None,
            energy_j: None,
            capped_pct: None,
        }
    }

    #[test]
    fn a_cap_below_what_every_node_measured_is_on_the_guess() {
        // n2 walked only down to 600 W: the job's measured territory ends there.
        let walked = [
            ("n1", &[700.0, 500.0, 300.0][..]),
            ("n2", &[700.0, 600.0][..]),
        ];
        assert_eq!(below_measured_w(&job(Some(330.0), &walked)), Some(600.0));
        assert_eq!(below_measured_w(&job(Some(600.0), &walked)), None);
        assert_eq!(below_measured_w(&job(None, &walked)), None, "no grant yet");
        assert_eq!(
            below_measured_w(&job(Some(330.0), &[])),
            None,
            "no points: a prior"
        );
    }
}
