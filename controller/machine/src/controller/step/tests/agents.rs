//! Hellos, reports and silences; Slurm's placement; restarts; leadership and fencing.

use super::*;

/// Root on n2 (n2's link key) may report n1's flex0 job as `flex3,preempt=requeue`
/// with 5 kW GPUs: the controller believes a node only about what Slurm places on it.
#[test]
fn a_node_is_believed_only_about_the_jobs_slurm_places_on_it() {
    let mut core = Controller::new(
        CtldSettings {
            job_placement: JobPlacement::Slurm,
            ..options()
        },
        Loaded::default(),
        UnixMs(T0),
    );
    let mut forged = job("101", None);
    forged.tier = "flex3,preempt=requeue".into();
    forged.owner_uid = Some(0);
    let mut fake_gpus = gpus(8);
    fake_gpus.extend(gpus(292).into_iter().map(|mut g| {
        g.uuid.push_str("-fake");
        g.max_w = 5000.0;
        g.default_w = 5000.0;
        g
    }));
    // Before Slurm answered: nothing believed, and a read asked for.
    let out = core.step(
        UnixMs(T0),
        vec![
            hello("n1"),
            report("n1", vec![job("101", None)]),
            Input::Hello {
                node: "n2".into(),
                gpus: fake_gpus,
            },
            report("n2", vec![forged.clone(), job("102", None)]),
        ],
    );
    assert!(out.refresh_placement);
    assert!(
        out.leases.is_empty(),
        "the first allocation waits for Slurm's first answer: {out:?}"
    );
    assert!(
        core.status(UnixMs(T0)).jobs.is_empty(),
        "no job believed before Slurm answered"
    );
    // Slurm: 101 on n1 (uid 1001), 102 on n2 (uid 1002).
    let out = core.step(
        UnixMs(T0 + 100),
        vec![slurm_placed(&[
            ("101", &["n1"], 1001),
            ("102", &["n2"], 1002),
        ])],
    );
    assert!(
        out.leases.contains_key("n1"),
        "allocated once Slurm answered: {out:?}"
    );
    let status = core.status(UnixMs(T0 + 100));
    let jobs: Vec<(&str, &[String], Option<u32>, &str)> = status
        .jobs
        .iter()
        .map(|j| {
            (
                j.job.as_str(),
                j.nodes.as_slice(),
                j.owner_uid,
                j.tier.as_str(),
            )
        })
        .collect();
    assert_eq!(
        jobs,
        [
            ("101", &["n1".to_string()][..], Some(1001), "flex2"),
            ("102", &["n2".to_string()][..], Some(1002), "flex2"),
        ],
        "n2's word about 101 is not taken; the owners are Slurm's"
    );
    let n2 = status.nodes.iter().find(|n| n.node == "n2").expect("n2");
    assert_eq!(
        (n2.gpus, n2.refused_gpus),
        (8, 292),
        "GPUs bounded by Slurm's gres"
    );
    // n2's lease never names n1's job; nothing is preempted or annotated for it there.
    let out = core.step(
        UnixMs(T0 + 200),
        vec![report("n2", vec![forged, job("102", None)]), Input::Tick],
    );
    if let Some(lease) = out.leases.get("n2") {
        assert!(!lease.caps.contains_key("101"), "{lease:?}");
    }
    let n2 = core
        .status(UnixMs(T0 + 200))
        .nodes
        .into_iter()
        .find(|n| n.node == "n2");
    assert_eq!(
        n2.map(|n| n.refused_reports),
        Some(1),
        "the forged report, read after Slurm answered, counted on its sender"
    );
    assert!(out.preempt.is_empty());
    assert!(out
        .annotations
        .iter()
        .all(|(job, text)| job != "101" || text.contains("tier=flex2")));
    // Slurm away: the last placement stays in force, and status says why.
    core.step(
        UnixMs(T0 + 300),
        vec![Input::Placement(Box::new(Err(MachineError::SlurmRead(
            "squeue: no answer within 5.0 s".into(),
        ))))],
    );
    let status = core.status(UnixMs(T0 + 300));
    assert_eq!(status.jobs.len(), 2);
    let slurm = status.slurm.expect("placement shown");
    assert_eq!(slurm.jobs, 2);
    assert!(slurm.error.is_some_and(|e| e.contains("no answer")));
    // The job ended in Slurm: no longer believed, even while its node still reports it.
    core.step(
        UnixMs(T0 + 400),
        vec![slurm_placed(&[("102", &["n2"], 1002)])],
    );
    let ids: Vec<String> = core
        .status(UnixMs(T0 + 400))
        .jobs
        .into_iter()
        .map(|j| j.job)
        .collect();
    assert_eq!(ids, ["102"]);
}

#[test]
fn after_state_loss_nothing_is_allocated_for_one_lease() {
    let lost = Loaded {
        state: CtldState::default(),
        lost: true,
    };
    let mut core = Controller::new(options(), lost, UnixMs(T0));
    let out = core.step(
        UnixMs(T0),
        vec![hello("n1"), report("n1", vec![job("101", None)])],
    );
    assert!(out.leases.is_empty() && out.metrics.is_none(), "{out:?}");
    let out = core.step(UnixMs(T0 + 29_999), vec![Input::Tick]);
    assert!(out.leases.is_empty());
    assert_eq!(allocations(&core), 0);
    // The agent kept reporting through the hold (silent, it would count as dead).
    let out = core.step(
        UnixMs(T0 + 30_000),
        vec![report("n1", vec![job("101", None)]), Input::Tick],
    );
    assert!(out.leases.contains_key("n1"), "{out:?}");
    assert_eq!(allocations(&core), 1);
}

#[test]
fn after_a_restart_the_known_agents_are_awaited() {
    let mut core = restarted_with(&["n1", "n2"]);
    let out = core.step(
        UnixMs(T0 + 100),
        vec![hello("n1"), report("n1", vec![job("101", None)])],
    );
    assert!(out.leases.is_empty(), "n2's old lease still holds its caps");
    assert_eq!(out.persist, None, "n1's GPUs are as saved");
    let out = core.step(
        UnixMs(T0 + 200),
        vec![hello("n2"), report("n2", vec![job("102", None)])],
    );
    assert_eq!(
        out.leases.keys().collect::<Vec<_>>(),
        ["n1", "n2"],
        "all back: allocated at once"
    );
}

#[test]
fn after_a_restart_a_hello_without_its_report_is_not_enough() {
    let mut core = restarted_with(&["n1", "n2"]);
    // Both reconnect in one batch, but only n2's report came with it: n1's jobs are
    // unknown, and n2's jobs would get n1's watts.
    let out = core.step(
        UnixMs(T0 + 100),
        vec![
            hello("n1"),
            hello("n2"),
            report("n2", vec![job("102", None)]),
        ],
    );
    assert!(out.leases.is_empty(), "{out:?}");
    let out = core.step(UnixMs(T0 + 110), vec![report("n1", vec![job("101", None)])]);
    assert_eq!(out.leases.keys().collect::<Vec<_>>(), ["n1", "n2"]);
    assert!(out.leases["n1"].caps.contains_key("101") && out.leases["n2"].caps.contains_key("102"));
}

#[test]
fn an_agent_that_stays_away_is_counted_at_its_failsafe_cap_after_half_a_lease() {
    let mut core = restarted_with(&["n1", "n2"]);
    let out = core.step(
        UnixMs(T0 + 100),
        vec![hello("n1"), report("n1", vec![job("101", None)])],
    );
    assert!(out.leases.is_empty());
    let out = core.step(UnixMs(T0 + 14_999), vec![Input::Tick]);
    assert!(out.leases.is_empty(), "within the grace");
    let out = core.step(UnixMs(T0 + 15_000), vec![Input::Tick]);
    assert_eq!(out.leases.keys().collect::<Vec<_>>(), ["n1"]);
    let status = core.status(UnixMs(T0 + 15_000));
    let n2 = status.nodes.iter().find(|n| n.node == "n2").expect("n2");
    assert!(!n2.live);
    // n2's 8 GPUs at the 500 W fail-safe cap come off the budget first.
    let out = core.step(
        UnixMs(T0 + 15_001),
        vec![admin(
            AdminOp::WhatIf {
                policy: Some(Policy::Optimal),
                budget_w: None,
                ignore_tiers: false,
            },
            0,
        )],
    );
    let d = reply(&out).what_if().expect("decision");
    assert!(d.reserved_w >= 4000.0, "{d:?}");
}

#[test]
fn a_batch_of_messages_costs_one_allocation() {
    let mut core = fresh();
    let mut inputs = Vec::new();
    for i in 0..200 {
        let node = format!("n{i:03}");
        inputs.push(hello(&node));
        inputs.push(report(&node, vec![job(&format!("{}", 1000 + i), None)]));
    }
    let out = core.step(UnixMs(T0), inputs);
    assert_eq!(allocations(&core), 1);
    assert_eq!(out.leases.len(), 200);
    assert_eq!(out.persist.map(|s| s.nodes.len()), Some(200), "saved once");
}

#[test]
fn only_a_change_in_the_jobs_reallocates_before_the_tick() {
    let mut core = running();
    assert_eq!(allocations(&core), 1);
    let out = core.step(
        UnixMs(T0 + 1000),
        vec![report("n1", vec![job("101", None)])],
    );
    assert!(out.metrics.is_none() && out.leases.is_empty());
    assert_eq!(allocations(&core), 1);
    let out = core.step(
        UnixMs(T0 + 2000),
        vec![report("n1", vec![job("101", None), job("103", None)])],
    );
    assert!(out.leases["n1"].caps.contains_key("103"), "{out:?}");
    core.step(UnixMs(T0 + 10_000), vec![Input::Tick]);
    assert_eq!(allocations(&core), 3);
    // A report from a node that never said hello is dropped.
    let out = core.step(
        UnixMs(T0 + 10_001),
        vec![report("n9", vec![job("109", None)])],
    );
    assert!(out.leases.is_empty());
    assert!(core
        .status(UnixMs(T0 + 10_001))
        .nodes
        .iter()
        .all(|n| n.node != "n9"));
}

#[test]
fn a_silent_node_goes_dead_after_its_lease_and_leases_carry_the_ttl() {
    let mut core = running();
    let out = core.step(
        UnixMs(T0 + 29_999),
        vec![report("n2", vec![job("102", None)]), Input::Tick],
    );
    assert_eq!(out.lease_ttl_s, TTL_S);
    let live = |core: &Controller, now| {
        core.status(UnixMs(now))
            .nodes
            .iter()
            .map(|n| (n.node.clone(), n.live))
            .collect::<Vec<_>>()
    };
    assert_eq!(
        live(&core, T0 + 29_999),
        [("n1".into(), true), ("n2".into(), true)]
    );
    core.step(UnixMs(T0 + 30_000), vec![Input::Tick]);
    assert_eq!(
        live(&core, T0 + 30_000),
        [("n1".into(), false), ("n2".into(), true)]
    );
    let status = core.status(UnixMs(T0 + 30_000));
    assert_eq!(status.draw_w, 2800.0, "only live nodes' draw counts");
    assert_eq!(status.nodes[0].seen_ms_ago, 30_000);
    core.step(
        UnixMs(T0 + 31_000),
        vec![report("n1", vec![job("101", None)]), Input::Tick],
    );
    assert!(core.status(UnixMs(T0 + 31_000)).nodes[0].live);
}

/// Leases carry the state's epoch; a controller that is not active (a
/// standby, one that stepped down) sends no lease and refuses changes, typed, and
/// steers again at once when it is active.
#[test]
fn only_an_active_controller_leases_and_takes_changes() {
    let state = CtldState {
        epoch: 4,
        ..CtldState::default()
    };
    let mut core = Controller::new(options(), Loaded { state, lost: false }, UnixMs(T0));
    let out = core.step(
        UnixMs(T0),
        vec![
            leadership(LeadershipRole::Standby, 4, Some("ctld-b")),
            hello("n1"),
            report("n1", vec![job("101", None)]),
            Input::Tick,
        ],
    );
    assert!(!core.steering());
    assert!(out.leases.is_empty(), "a standby leases nothing: {out:?}");
    let out = core.step(UnixMs(T0 + 1), vec![budget_set(5000.0, None)]);
    let r = reply(&out);
    assert_eq!(r.refusal(), Some(Refusal::NotActive), "{r:?}");
    assert!(
        r.error_message().is_some_and(|e| e.contains("ctld-b")),
        "{r:?}"
    );
    assert_eq!(out.persist, None);
    let out = core.step(UnixMs(T0 + 2), vec![admin(AdminOp::Status, 1000)]);
    let shown = reply(&out).status().and_then(|s| s.leadership.clone());
    assert_eq!(shown.map(|l| l.role), Some(LeadershipRole::Standby));
    // Active: it allocates at once, and every lease carries its epoch.
    let out = core.step(
        UnixMs(T0 + 3),
        vec![leadership(LeadershipRole::Active, 4, None)],
    );
    assert!(core.steering());
    assert_eq!(out.epoch, 4);
    assert!(out.leases.contains_key("n1"), "{out:?}");
    // Stepping down stops it at once, and the edge is told to send the agents on.
    let out = core.step(
        UnixMs(T0 + 4),
        vec![
            leadership(LeadershipRole::SteppedDown, 4, None),
            Input::Tick,
        ],
    );
    assert!(out.stopped_steering && out.leases.is_empty(), "{out:?}");
}

/// An agent's refusal of this controller's epoch fences it for that node: no lease goes to it
/// again, it is sent on (now and when it says hello again), and it is paid for as a silent node.
/// One node's word stops nothing else. A single controller that more than half of the nodes it
/// knows refuse is a stale one: it stops steering entirely (FENCED), so a node without an epoch
/// memory is not steered by it either. A refusal of another epoch fences nothing.
#[test]
fn a_refusal_fences_a_controller_for_that_node_and_most_nodes_fence_a_single_one() {
    let state = CtldState {
        epoch: 2,
        ..CtldState::default()
    };
    let mut core = Controller::new(options(), Loaded { state, lost: false }, UnixMs(T0));
    let out = core.step(
        UnixMs(T0),
        vec![
            hello("n1"),
            report("n1", vec![job("101", None)]),
            hello("n2"),
            report("n2", vec![job("102", None)]),
            hello("n3"),
            report("n3", vec![job("103", None)]),
        ],
    );
    assert_eq!(out.epoch, 2);
    assert_eq!(out.leases.len(), 3, "{out:?}");
    let fenced = |node: &str, lease_epoch, accepted_epoch| Input::Fenced {
        node: node.into(),
        lease_epoch,
        accepted_epoch,
    };
    // A stale refusal of an older lease (or by an agent behind this one) is not one.
    let out = core.step(
        UnixMs(T0 + 1),
        vec![fenced("n1", 1, 2), fenced("n1", 2, 2), Input::Tick],
    );
    assert!(out.send_on.is_empty() && out.leases.contains_key("n1"));
    // n1 follows epoch 3: sent on, leased no more, paid for as silent; n2 and n3 are
    // steered as before.
    let out = core.step(UnixMs(T0 + 2), vec![fenced("n1", 2, 3), Input::Tick]);
    assert!(core.steering() && !out.stopped_steering);
    assert_eq!(out.send_on, ["n1"]);
    assert!(!out.leases.contains_key("n1"), "{out:?}");
    assert!(out.leases.contains_key("n2") && out.leases.contains_key("n3"));
    let status = core.status(UnixMs(T0 + 2));
    assert!(status.leadership.is_none(), "one node of three: {status:?}");
    assert_eq!(status.refused_by.get("n1"), Some(&3));
    let decision = core.last.as_ref().expect("allocated");
    assert!(
        decision
            .allocation
            .as_ref()
            .is_some_and(|a| a.jobs.iter().all(|j| j.id != "101")),
        "n1's job is not steered by this controller"
    );
    // The same refusal again sends nothing new; its hello again sends it on again.
    let out = core.step(UnixMs(T0 + 3), vec![fenced("n1", 2, 3), Input::Tick]);
    assert!(out.send_on.is_empty() && !out.leases.contains_key("n1"));
    let out = core.step(UnixMs(T0 + 4), vec![hello("n1")]);
    assert_eq!(out.send_on, ["n1"]);
    // n2 too: two of the three nodes it knows follow a later controller, so this
    // single controller is a stale one and stops steering every node.
    let out = core.step(UnixMs(T0 + 5), vec![fenced("n2", 2, 4), Input::Tick]);
    assert!(!core.steering());
    assert!(out.stopped_steering && out.leases.is_empty(), "{out:?}");
    let l = core.status(UnixMs(T0 + 5)).leadership.expect("shown");
    assert_eq!((l.role, l.epoch), (LeadershipRole::Fenced, 2));
    assert!(
        l.reason
            .as_deref()
            .is_some_and(|r| r.contains("2 of the 3 nodes") && r.contains("up to 4")),
        "{l:?}"
    );
    // A node without an epoch memory is not steered by it, and no change is taken.
    let out = core.step(
        UnixMs(T0 + 6),
        vec![
            hello("n4"),
            report("n4", vec![job("104", None)]),
            Input::Tick,
        ],
    );
    assert!(out.leases.is_empty(), "{out:?}");
    let out = core.step(UnixMs(T0 + 7), vec![budget_set(9_000.0, None)]);
    assert!(!reply(&out).is_ok());
}

/// Under `[controller.ha]` the leader row, not the agents, says who leads: every
/// node refusing the active controller fences it node by node (the edge asks the
/// database at once), and never stands it by on its own.
/// The nodes a single controller knows include those the
/// domains place (and Slurm's GPU nodes), not only those connected, so one node's
/// forged refusal while it is the only one connected fences that node alone.
#[test]
fn one_node_refusing_first_fences_no_site_whose_domains_place_more() {
    use powerflex_core::domains::{DomainTree, RawDomain};
    let tree = DomainTree::build(&[RawDomain {
        name: "rack-a".into(),
        parent: None,
        gpu_limit_w: 100_000.0,
        nodes: Some("n[1-4]".into()),
    }])
    .expect("valid");
    let mut o = options();
    o.site.domains = powerflex_decide::SiteDomains::configured(&tree);
    let mut core = Controller::new(o, Loaded::default(), UnixMs(T0));
    core.step(
        UnixMs(T0),
        vec![hello("n1"), report("n1", vec![job("101", None)])],
    );
    let out = core.step(
        UnixMs(T0 + 1),
        vec![
            Input::Fenced {
                node: "n1".into(),
                lease_epoch: 0,
                accepted_epoch: 1,
            },
            Input::Tick,
        ],
    );
    assert_eq!(out.send_on, ["n1"]);
    assert!(core.steering(), "1 of the 4 nodes the domains place");
    assert!(core.status(UnixMs(T0 + 1)).leadership.is_none());
    let out = core.step(
        UnixMs(T0 + 2),
        vec![
            hello("n2"),
            report("n2", vec![job("102", None)]),
            Input::Tick,
        ],
    );
    assert!(out.leases.contains_key("n2"), "{out:?}");
}

/// A hello whose GPUs the committed state's check refuses is not
/// kept in the state (the next start would refuse the whole state, events and
/// budgets with it); the node is still paid for, as a silent one.
#[test]
fn a_hello_the_state_check_refuses_is_not_kept() {
    let mut core = Controller::new(options(), Loaded::default(), UnixMs(T0));
    let mut bad = gpus(2);
    bad[1].name = "NVIDIA\u{0}H200".into();
    let out = core.step(
        UnixMs(T0),
        vec![
            hello("n1"),
            report("n1", vec![job("101", None)]),
            Input::Hello {
                node: "n2".into(),
                gpus: bad,
            },
            Input::Tick,
        ],
    );
    assert!(core.state.nodes.contains_key("n1"));
    assert!(
        !core.state.nodes.contains_key("n2"),
        "{:?}",
        core.state.nodes
    );
    let persisted = out.persist.expect("n1 kept");
    let text = serde_json::to_vec(&persisted).expect("encodes");
    assert!(CtldState::from_json(&text, UnixMs(T0)).is_ok());
    let decision = core.last.as_ref().expect("allocated");
    assert!(decision.reserved_w >= 2.0 * 700.0, "{decision:?}");
}

#[test]
fn under_ha_refusals_fence_node_by_node_and_never_stand_the_leader_by() {
    let state = CtldState {
        epoch: 2,
        ..CtldState::default()
    };
    let mut core = Controller::new(options(), Loaded { state, lost: false }, UnixMs(T0));
    core.step(
        UnixMs(T0),
        vec![
            leadership(LeadershipRole::Active, 2, None),
            hello("n1"),
            report("n1", vec![job("101", None)]),
            hello("n2"),
            report("n2", vec![job("102", None)]),
        ],
    );
    let fenced = |node: &str| Input::Fenced {
        node: node.into(),
        lease_epoch: 2,
        accepted_epoch: 3,
    };
    let out = core.step(
        UnixMs(T0 + 1),
        vec![fenced("n1"), fenced("n2"), Input::Tick],
    );
    assert!(core.steering() && !out.stopped_steering);
    assert!(out.leases.is_empty(), "{out:?}");
    let status = core.status(UnixMs(T0 + 1));
    assert_eq!(
        status.leadership.map(|l| l.role),
        Some(LeadershipRole::Active)
    );
    assert_eq!(status.refused_by.len(), 2);
}

/// A node that has said hello but not reported yet has no draw to show: `status` counts
/// it neither as live nor in the site's draw until its first report, after a reconnect
/// too. A VEN reports the draw to the utility only while every node is live, so a
/// controller that has just restarted never has it report 0 W as the site's metered draw.
#[test]
fn a_node_counts_as_live_with_its_draw_only_once_it_has_reported() {
    let mut core = fresh();
    core.step(UnixMs(T0), vec![hello("n1")]);
    let status = core.status(UnixMs(T0 + 10));
    assert_eq!(status.nodes.len(), 1);
    assert!(!status.nodes[0].live, "{:?}", status.nodes);
    assert_eq!(status.draw_w, 0.0);

    core.step(UnixMs(T0 + 20), vec![report("n1", vec![job("101", None)])]);
    let status = core.status(UnixMs(T0 + 30));
    assert!(status.nodes[0].live, "{:?}", status.nodes);
    assert_eq!(status.draw_w, 2800.0);

    // The agent reconnects: what it drew before is not a reading of now.
    core.step(UnixMs(T0 + 40), vec![hello("n1")]);
    let status = core.status(UnixMs(T0 + 50));
    assert!(!status.nodes[0].live, "{:?}", status.nodes);
    assert_eq!(status.draw_w, 0.0);
    core.step(UnixMs(T0 + 60), vec![report("n1", vec![job("101", None)])]);
    assert!(core.status(UnixMs(T0 + 70)).nodes[0].live);
}
