//! The controller's Prometheus metrics: the core says what one allocation shows
//! ([`MetricsSnapshot`], the machine's), this renders it from the shared
//! [`powerflex_daemon::prom::catalog`] (so a name carries one label set in both daemons,
//! and label values are escaped), and [`powerflex_daemon::http::MetricsServer`] serves it.

use powerflex_daemon::prom::{catalog, TextWriter};

pub use powerflex_controller_machine::controller::metrics::{
    EnergyTotals, MetricsSnapshot, TierEnergy, MAX_LABEL_VALUES, OTHER_LABEL,
};

fn flag(on: bool) -> f64 {
    if on {
        1.0
    } else {
        0.0
    }
}

/// Renders the metrics text (Prometheus exposition format 0.0.4).
pub fn render(m: &MetricsSnapshot) -> String {
    let mut w = TextWriter::new();
    w.family(&catalog::BUDGET_WATTS, [([], m.budget.0)])
        .family(&catalog::ALLOCATED_BUDGET_WATTS, [([], m.allocated.0)])
        .family(&catalog::BASE_BUDGET_WATTS, [([], m.base.0)])
        .family(&catalog::DRAW_WATTS, [([], m.draw_w)])
        .family(&catalog::EVENT_ACTIVE, [([], flag(m.event_active))])
        .family(
            &catalog::DOMAIN_BUDGET_WATTS,
            m.domains.iter().map(|d| ([d.name.as_str()], d.budget_w)),
        )
        .family(
            &catalog::DOMAIN_DRAW_WATTS,
            m.domains.iter().map(|d| ([d.name.as_str()], d.draw_w)),
        )
        .family(
            &catalog::DOMAIN_HEADROOM_WATTS,
            m.domains.iter().map(|d| ([d.name.as_str()], d.headroom_w)),
        )
        .family(
            &catalog::DOMAIN_BINDS,
            m.domains.iter().map(|d| {
                (
                    [d.name.as_str()],
                    flag(d.floors_over_w.is_some_and(|w| w > 0.0)),
                )
            }),
        )
        .family(
            &catalog::NODE_LIVE,
            m.nodes
                .iter()
                .map(|(node, live)| ([node.as_str()], flag(*live))),
        )
        .family(&catalog::UNMANAGED_NODES, [([], m.unmanaged_nodes as f64)])
        .family(
            &catalog::UNMANAGED_RESERVE_WATTS,
            [([], m.unmanaged_reserve_w)],
        )
        .family(
            &catalog::NODE_REPORTS_REFUSED,
            m.refused
                .iter()
                .map(|(node, n)| ([node.as_str()], *n as f64)),
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
        )
        .family(
            &catalog::JOB_RECORDS,
            m.energy
                .by_tier
                .iter()
                .map(|(tier, t)| ([tier.as_str()], t.records as f64)),
        )
        .family(
            &catalog::TIER_ENERGY_JOULES,
            m.energy
                .by_tier
                .iter()
                .map(|(tier, t)| ([tier.as_str()], t.energy_j)),
        )
        .family(
            &catalog::TIER_ENERGY_SAVED_ESTIMATE_JOULES,
            m.energy
                .by_tier
                .iter()
                .map(|(tier, t)| ([tier.as_str()], t.saved_estimate_j)),
        )
        .family(
            &catalog::ACCOUNT_ENERGY_JOULES,
            m.energy
                .by_account
                .iter()
                .map(|(account, j)| ([account.as_str()], *j)),
        );
    if let Some(db) = &m.accounting_db {
        w.family(&catalog::ACCOUNTING_DB_UP, [([], flag(db.connected))])
            .family(&catalog::ACCOUNTING_DB_PENDING, [([], db.pending as f64)]);
    }
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
    if let Some(reach) = &m.decision.shed_reach {
        w.family(
            &catalog::SHED_REACH_WATTS,
            [
                (["caps"], reach.caps_w),
                (["preemption"], reach.with_preemption_w),
            ],
        );
    }
    w.finish()
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeMap;
    use std::sync::Arc;

    use powerflex_controller_machine::preempt::Preempted;
    use powerflex_core::allocate::Maximised as Objective;
    use powerflex_core::allocate::{Allocation, FloorStatus, JobAllocation, Policy};
    use powerflex_core::Watts;
    use powerflex_decide::Decision;
    use powerflex_proto::status::AccountingDbView;
    use powerflex_proto::usage::JobEnergyRecord;

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
                domains: Vec::new(),
            }),
            rejected: vec![],
            drifted: vec![],
            start_cap_w: 300.0,
            objective: Objective::TokensPerS,
            shed_reach: Some(powerflex_proto::status::ShedReach {
                caps_w: 2500.0,
                with_preemption_w: 1800.5,
                preemptable_jobs: 1,
            }),
        };
        let text = render(&MetricsSnapshot {
            decision: Arc::new(decision),
            base: Watts(4000.0),
            budget: Watts(3200.0),
            allocated: Watts(3100.0),
            draw_w: 2950.5,
            nodes: vec![("n1".into(), true), ("n\\2".into(), false)],
            refused: vec![("n1".into(), 0), ("n\\2".into(), 3)],
            event_active: true,
            preempted: [(
                "78".to_string(),
                Preempted {
                    how: powerflex_core::flex::Preempt::Suspend,
                    since_ms: 1,
                },
            )]
            .into_iter()
            .collect(),
            energy: EnergyTotals::default(),
            accounting_db: None,
            domains: vec![powerflex_proto::status::DomainStatus {
                name: "rack-a".into(),
                parent: Some("feed-a".into()),
                depth: 1,
                limit_w: 40_000.0,
                budget_w: 30_000.0,
                draw_w: 31_000.0,
                headroom_w: -1000.0,
                nodes: 4,
                live_nodes: 4,
                planned_w: Some(29_000.0),
                floors_over_w: Some(500.0),
                event: Some(3),
                unmanaged_reserve_w: None,
            }],
            unmanaged_nodes: 2,
            unmanaged_reserve_w: 5600.0,
        });
        for line in [
            "powerflex_budget_watts 3200",
            "powerflex_allocated_budget_watts 3100",
            "powerflex_base_budget_watts 4000",
            "powerflex_draw_watts 2950.5",
            "powerflex_event_active 1",
            "powerflex_domain_budget_watts{domain=\"rack-a\"} 30000",
            "powerflex_domain_draw_watts{domain=\"rack-a\"} 31000",
            "powerflex_domain_headroom_watts{domain=\"rack-a\"} -1000",
            "powerflex_domain_binds{domain=\"rack-a\"} 1",
            "powerflex_node_live{node=\"n1\"} 1",
            "powerflex_node_live{node=\"n\\\\2\"} 0",
            "powerflex_node_reports_refused_total{node=\"n\\\\2\"} 3",
            "powerflex_job_granted_cap_watts{job=\"77\"} 450",
            "powerflex_job_granted_cap_watts{job=\"x\\\"}\\nevil\"} 300",
            "powerflex_floors_broken 0",
            "powerflex_job_preempted{job=\"78\",how=\"suspend\"} 1",
            "powerflex_over_budget_watts 0",
            "powerflex_shed_reach_watts{by=\"caps\"} 2500",
            "powerflex_shed_reach_watts{by=\"preemption\"} 1800.5",
            "powerflex_unmanaged_nodes 2",
            "powerflex_unmanaged_reserve_watts 5600",
        ] {
            assert!(text.lines().any(|l| l == line), "{line} missing in\n{text}");
        }
        // Every sample line belongs to a family the catalog declares (a hostile job id
        // stays inside its own line).
        // ... and one the catalog says the controller exports (the metrics reference
        // groups the families by exporter).
        let names: Vec<&str> = catalog::all()
            .iter()
            .filter(|f| f.exporter == catalog::Exporter::Controller)
            .map(|f| f.name)
            .collect();
        for line in text.lines().filter(|l| !l.starts_with('#')) {
            let name = line.split(['{', ' ']).next().unwrap_or("");
            assert!(names.contains(&name), "{line}");
        }
    }

    fn record(tier: &str, account: Option<&str>, energy_j: f64) -> JobEnergyRecord {
        let mut r = JobEnergyRecord::from_shares(
            vec![powerflex_proto::usage::NodeUsage {
                job_id: "1".into(),
                node: "n1".into(),
                uid: 1000,
                tier: tier.into(),
                gpus: vec![],
                energy_mj: (energy_j * 1000.0) as u64,
                energy_source: powerflex_proto::usage::EnergySource::Counter,
                from_unix_ms: 0,
                to_unix_ms: 1_000,
                peak_power_w: 0.0,
                observed_s: 1.0,
                capped_s: 0.0,
                event_s: 0.0,
                power_throttled_s: 0.0,
                throttle_known_s: 0.0,
                caps: vec![],
                slowdown_pct: None,
                bound_pct: None,
                bound_held: None,
                bound_judgement: None,
                saved_estimate_j: Some(energy_j / 10.0),
                work: None,
                work_unit: None,
                pfi: None,
                ended: true,
                simulated: true,
            }],
            vec![],
            1_000,
        )
        .expect("record");
        r.account = account.map(str::to_string);
        r
    }

    #[test]
    fn energy_per_tier_and_account_is_counted_bounded_and_names_no_user() {
        let mut totals = EnergyTotals::default();
        totals.add(&record("flex2", Some("physics"), 1_000.0));
        totals.add(&record("flex2", Some("physics"), 500.0));
        totals.add(&record("flex0", None, 250.0));
        // A site with more accounts than labels: the rest are summed as "other".
        for i in 0..100 {
            totals.add(&record("flex1", Some(&format!("acct{i:03}")), 1.0));
        }
        assert_eq!(totals.by_tier["flex2"].records, 2);
        assert_eq!(totals.by_tier["flex2"].energy_j, 1_500.0);
        assert_eq!(totals.by_tier["flex2"].saved_estimate_j, 150.0);
        assert!(totals.by_account.len() <= MAX_LABEL_VALUES);
        assert!(totals.by_account.contains_key("acct000"));
        assert!(!totals.by_account.contains_key("acct099"), "past the bound");
        let summed: f64 = totals.by_account.values().sum();
        assert_eq!(summed, 1_500.0 + 250.0 + 100.0, "nothing lost to the bound");
        assert!(
            totals.by_account[OTHER_LABEL] >= 250.0,
            "no account and overflow"
        );
        let decision = Decision {
            leases: Default::default(),
            budget_w: 1.0,
            reserved_w: 0.0,
            allocation: None,
            rejected: vec![],
            drifted: vec![],
            start_cap_w: 300.0,
            objective: Objective::TokensPerS,
            shed_reach: None,
        };
        let db = AccountingDbView {
            connected: false,
            schema_version: Some(1),
            pending: 3,
            written: 0,
            dropped: 0,
            error: Some("down".into()),
            since_unix_ms: 0,
        };
        let text = render(&MetricsSnapshot {
            decision: Arc::new(decision),
            base: Watts(1.0),
            budget: Watts(1.0),
            allocated: Watts(1.0),
            draw_w: 0.0,
            nodes: vec![],
            refused: vec![],
            event_active: false,
            preempted: BTreeMap::new(),
            energy: totals.clone(),
            accounting_db: Some(db),
            domains: Vec::new(),
            unmanaged_nodes: 0,
            unmanaged_reserve_w: 0.0,
        });
        for line in [
            "powerflex_job_energy_joules_total{tier=\"flex2\"} 1500",
            "powerflex_job_records_total{tier=\"flex1\"} 100",
            "powerflex_job_energy_saved_estimate_joules_total{tier=\"flex0\"} 25",
            "powerflex_account_energy_joules_total{account=\"physics\"} 1500",
            "powerflex_accounting_db_up 0",
            "powerflex_accounting_db_pending_records 3",
        ] {
            assert!(text.lines().any(|l| l == line), "{line} missing in\n{text}");
        }
        // A run's later revision restates it: not counted again.
        let mut again = record("flex2", Some("physics"), 1_000.0);
        again.revision = 2;
        totals.add(&again);
        assert_eq!(totals.by_tier["flex2"].records, 2);
        assert_eq!(totals.by_account["physics"], 1_500.0);
        assert!(!text.contains("uid") && !text.contains("user"), "{text}");
    }
}
