//! The controller's Prometheus metrics: rendered by the core after each allocation from
//! the shared [`powerflex_daemon::prom::catalog`] (so a name carries one label set in
//! both daemons, and label values are escaped), served by
//! [`powerflex_daemon::http::MetricsServer`].

use powerflex_core::Watts;
use powerflex_daemon::prom::{catalog, TextWriter};

use crate::preempt::Preempted;
use crate::site::Decision;

/// What the metrics show of one allocation.
#[derive(Debug)]
pub struct MetricsInput<'a> {
    pub decision: &'a Decision,
    pub base: Watts,
    /// The budget in force.
    pub budget: Watts,
    /// What the allocation was made for (see [`crate::ramp`]).
    pub allocated: Watts,
    pub draw_w: f64,
    /// Node → live.
    pub nodes: Vec<(&'a str, bool)>,
    /// Per node, the job reports refused since start (Slurm does not place the job there).
    pub refused: Vec<(&'a str, u64)>,
    pub event_active: bool,
    /// Jobs held out of a deep cut.
    pub preempted: &'a std::collections::BTreeMap<String, Preempted>,
}

fn flag(on: bool) -> f64 {
    if on {
        1.0
    } else {
        0.0
    }
}

/// Renders the metrics text (Prometheus exposition format 0.0.4).
pub fn render(m: &MetricsInput<'_>) -> String {
    let mut w = TextWriter::new();
    w.family(&catalog::BUDGET_WATTS, [([], m.budget.0)])
        .family(&catalog::ALLOCATED_BUDGET_WATTS, [([], m.allocated.0)])
        .family(&catalog::BASE_BUDGET_WATTS, [([], m.base.0)])
        .family(&catalog::DRAW_WATTS, [([], m.draw_w)])
        .family(&catalog::EVENT_ACTIVE, [([], flag(m.event_active))])
        .family(
            &catalog::NODE_LIVE,
            m.nodes.iter().map(|(node, live)| ([*node], flag(*live))),
        )
        .family(
            &catalog::NODE_REPORTS_REFUSED,
            m.refused.iter().map(|(node, n)| ([*node], *n as f64)),
        )
        .family(
            &catalog::JOB_PREEMPTED,
            m.preempted
                .iter()
                .map(|(job, p)| ([job.as_str(), p.how.name()], 1.0)),
        )
        .family(
            &catalog::REPORTS_REJECTED,
            [([], m.decision.rejected.len() as f64)],
        );
    if let Some(a) = &m.decision.allocation {
        w.family(
            &catalog::JOB_GRANTED_CAP_WATTS,
            a.jobs.iter().map(|j| ([j.id.as_str()], j.cap_w.0)),
        )
        .family(
            &catalog::JOB_DRIFTED,
            a.jobs.iter().map(|j| {
                let drifted = m.decision.drifted.iter().any(|d| d.job == j.id);
                ([j.id.as_str()], flag(drifted))
            }),
        )
        .family(
            &catalog::FLOORS_BROKEN,
            [([], a.broken_floors().count() as f64)],
        )
        .family(&catalog::OVER_BUDGET_WATTS, [([], a.over_budget_w.0)]);
    }
    w.finish()
}

#[cfg(test)]
mod tests {
    use super::*;
    use powerflex_core::allocate::{Allocation, FloorStatus, JobAllocation, Policy};
    use powerflex_proto::status::Objective;

    #[test]
    fn renders_the_catalog_names_with_escaped_labels() {
        let job = |id: &str, cap_w: f64| JobAllocation {
            id: id.into(),
            cap_w: Watts(cap_w),
            power_w: Watts(cap_w * 4.0),
            throughput: 1.0,
            slowdown: 0.0,
            max_slowdown: None,
            floor: FloorStatus::None,
        };
        let decision = Decision {
            leases: Default::default(),
            budget_w: 3200.0,
            reserved_w: 0.0,
            allocation: Some(Allocation {
                policy: Policy::Optimal,
                budget_w: Watts(3200.0),
                jobs: vec![job("77", 450.0), job("x\"}\nevil", 300.0)],
                total_power_w: Watts(3000.0),
                objective: 2.0,
                over_budget_w: Watts(0.0),
            }),
            rejected: vec![],
            drifted: vec![],
            start_cap_w: 300.0,
            objective: Objective::TokensPerS,
        };
        let text = render(&MetricsInput {
            decision: &decision,
            base: Watts(4000.0),
            budget: Watts(3200.0),
            allocated: Watts(3100.0),
            draw_w: 2950.5,
            nodes: vec![("n1", true), ("n\\2", false)],
            refused: vec![("n1", 0), ("n\\2", 3)],
            event_active: true,
            preempted: &[(
                "78".to_string(),
                Preempted {
                    how: powerflex_core::flex::Preempt::Suspend,
                    since_ms: 1,
                },
            )]
            .into_iter()
            .collect(),
        });
        for line in [
            "powerflex_budget_watts 3200",
            "powerflex_allocated_budget_watts 3100",
            "powerflex_base_budget_watts 4000",
            "powerflex_draw_watts 2950.5",
            "powerflex_event_active 1",
            "powerflex_node_live{node=\"n1\"} 1",
            "powerflex_node_live{node=\"n\\\\2\"} 0",
            "powerflex_node_reports_refused_total{node=\"n\\\\2\"} 3",
            "powerflex_job_granted_cap_watts{job=\"77\"} 450",
            "powerflex_job_granted_cap_watts{job=\"x\\\"}\\nevil\"} 300",
            "powerflex_floors_broken 0",
            "powerflex_job_preempted{job=\"78\",how=\"suspend\"} 1",
            "powerflex_over_budget_watts 0",
        ] {
            assert!(text.lines().any(|l| l == line), "{line} missing in\n{text}");
        }
        // Every sample line belongs to a family the catalog declares (a hostile job id
        // stays inside its own line).
        let names: Vec<&str> = catalog::all().iter().map(|(n, _, _)| *n).collect();
        for line in text.lines().filter(|l| !l.starts_with('#')) {
            let name = line.split(['{', ' ']).next().unwrap_or("");
            assert!(names.contains(&name), "{line}");
        }
    }
}
