//! Admin requests: budgets, events, domains, reloads, what-if, accounting and who reads what.

use super::*;

/// A two-node job's shares become one record, owned by Slurm's uid, and
/// read back by its owner only; while it runs its AdminComment keeps the site's text.
#[test]
fn a_job_s_nodes_shares_make_one_record_its_owner_reads() {
    const ALICE: u32 = 1001;
    const BOB: u32 = 1002;
    let mut core = Controller::new(
        CtldSettings {
            job_placement: JobPlacement::Slurm,
            ..options()
        },
        Loaded::default(),
        UnixMs(T0),
    );
    let Input::Placement(mut placed) = slurm_placed(&[("101", &["n1", "n2"], ALICE)]) else {
        unreachable!()
    };
    if let Ok(p) = placed.as_mut() {
        if let Some(j) = p.jobs.get_mut("101") {
            j.admin_comment = "project=X".into();
        }
    }
    let running = |node: &str, mj: u64| {
        let mut j = job("101", None);
        j.owner_uid = Some(ALICE);
        j.usage = Some(usage("101", node, mj, false));
        j
    };
    let out = core.step_saved(
        UnixMs(T0),
        vec![
            Input::Placement(placed),
            hello("n1"),
            hello("n2"),
            report("n1", vec![running("n1", 3_600_000)]),
            report("n2", vec![running("n2", 3_600_000)]),
            // n3 was never believed for job 101: its word is ignored.
            hello("n3"),
        ],
    );
    let (_, text) = out
        .annotations
        .iter()
        .find(|(j, _)| j == "101")
        .expect("annotated");
    assert!(
        text.starts_with("project=X | powerflex;tier=flex2;"),
        "{text}"
    );
    assert!(text.ends_with(";energy_kwh_so_far=0.0020"), "{text}");
    let ended = |node: &str, mj: u64| Input::Report {
        node: node.into(),
        jobs: vec![],
        power_w: 0.0,
        ended: vec![usage("101", node, mj, true)],
        observe_only: false,
    };
    let out = core.step_saved(
        UnixMs(T0 + 11_000),
        vec![ended("n1", 4_000_000), ended("n3", 1 << 40)],
    );
    assert!(out.job_records.is_empty(), "n2's final share is awaited");
    assert!(
        out.final_acks.is_empty(),
        "nothing acknowledged before the record"
    );
    let out = core.step_saved(UnixMs(T0 + 12_000), vec![ended("n2", 3_000_000)]);
    assert_eq!(out.job_records.len(), 1);
    let r = &out.job_records[0];
    assert_eq!((r.energy_j, r.uid, r.nodes.len()), (7_000.0, ALICE, 2));
    assert_eq!(r.account.as_deref(), Some("physics"), "Slurm's account");
    // Re-sent finals write nothing more.
    assert_eq!(
        r.run_start_unix_ms,
        Some(T0 - 60_000),
        "Slurm's start of the run"
    );
    // Both nodes' final shares are acknowledged with the record, n3's never.
    let acked: Vec<&String> = out.final_acks.keys().collect();
    assert_eq!(acked, ["n1", "n2"]);
    // Re-sent finals write nothing more, and are acknowledged again.
    let out = core.step_saved(UnixMs(T0 + 13_000), vec![ended("n1", 4_000_000)]);
    assert!(out.job_records.is_empty());
    assert_eq!(out.final_acks.get("n1").map(Vec::len), Some(1));
    // A malformed list of final shares (too many) is refused whole, and counted.
    let flood = Input::Report {
        node: "n1".into(),
        jobs: vec![],
        power_w: 0.0,
        ended: vec![usage("101", "n1", 1, true); 17],
        observe_only: false,
    };
    let out = core.step_saved(UnixMs(T0 + 13_500), vec![flood]);
    assert!(out.final_acks.is_empty() && out.job_records.is_empty());
    assert_eq!(core.sessions["n1"].refused_reports, 1);
    let ask = |uid| {
        admin(
            AdminOp::Accounting {
                since_ms: None,
                until_ms: None,
                uid: None,
                tier: None,
                job: None,
                account: None,
                after: None,
            },
            uid,
        )
    };
    let out = core.step_saved(UnixMs(T0 + 14_000), vec![ask(ALICE), ask(BOB), ask(0)]);
    let counts: Vec<usize> = out
        .replies
        .iter()
        .map(|(_, r)| r.records().map_or(usize::MAX, <[_]>::len))
        .collect();
    assert_eq!(
        counts,
        vec![1, 0, 1],
        "alice's own, none of bob's, root all"
    );
}

#[test]
fn an_admin_forgets_a_silent_node_but_not_a_live_one() {
    let mut core = running();
    let forget = |node: &str| AdminOp::ForgetNode { node: node.into() };
    let out = core.step_saved(UnixMs(T0 + 10), vec![admin(forget("n1"), 0)]);
    assert_eq!(reply(&out).refusal(), Some(Refusal::NodeLive), "{out:?}");
    let out = core.step_saved(UnixMs(T0 + 10), vec![admin(forget("n9"), 0)]);
    assert_eq!(reply(&out).refusal(), Some(Refusal::NoSuchNode));
    let later = T0 + (TTL_S * 1000.0) as u64 + 1_000;
    let out = core.step_saved(UnixMs(later), vec![admin(forget("n1"), 1000)]);
    assert!(!reply(&out).is_ok(), "root only");
    let out = core.step_saved(
        UnixMs(later),
        vec![report("n2", vec![job("102", None)]), admin(forget("n1"), 0)],
    );
    assert!(reply(&out).is_ok(), "{out:?}");
    assert!(!out.persist.expect("saved").nodes.contains_key("n1"));
    let nodes: Vec<String> = core
        .status(UnixMs(later))
        .nodes
        .into_iter()
        .map(|n| n.node)
        .collect();
    assert_eq!(nodes, ["n2"]);
}

#[test]
fn only_root_changes_the_budget_or_events_and_anyone_reads() {
    let mut core = running();
    for op in [
        AdminOp::BudgetSet {
            budget_w: 5000.0,
            domain: None,
        },
        AdminOp::EventAdd {
            cut: Cut::Reduce { fraction: 0.3 },
            start_ms: T0,
            duration_ms: 60_000,
            ramp_ms: 0,
            domain: None,
        },
        AdminOp::EventCancel { id: 1 },
    ] {
        let out = core.step_saved(UnixMs(T0 + 1), vec![admin(op.clone(), 1000)]);
        let r = reply(&out);
        assert!(!r.is_ok(), "{op:?}");
        assert_eq!(
            r.error_message(),
            Some("only root may change the budget or grid events")
        );
        assert_eq!(out.persist, None, "a refused change saves nothing");
    }
    assert_eq!(core.state().budget_w, None);
    assert!(core.state().events.is_empty());
    let out = core.step_saved(UnixMs(T0 + 2), vec![admin(AdminOp::Status, 1000)]);
    assert!(reply(&out).is_ok() && reply(&out).status().is_some());

    let out = core.step_saved(UnixMs(T0 + 3), vec![budget_set(5000.0, None)]);
    assert!(reply(&out).is_ok());
    assert_eq!(
        out.persist.as_ref().and_then(|s| s.budget_w),
        Some(Watts(5000.0))
    );
    assert!(out.metrics.is_some(), "a change is allocated at once");
    assert_eq!(core.status(UnixMs(T0 + 3)).budget_w, 5000.0);
    let out = core.step_saved(UnixMs(T0 + 4), vec![budget_set(-1.0, None)]);
    assert!(reply(&out)
        .error_message()
        .is_some_and(|e| e.contains("positive")));
}

#[test]
fn events_are_numbered_validated_and_cancelled() {
    let mut core = running();
    let add = |duration_ms, ramp_ms| AdminOp::EventAdd {
        cut: Cut::Reduce { fraction: 0.3 },
        start_ms: T0,
        duration_ms,
        ramp_ms,
        domain: None,
    };
    let out = core.step_saved(UnixMs(T0 + 1), vec![admin(add(0, 0), 0)]);
    assert!(reply(&out)
        .error_message()
        .is_some_and(|e| e.contains("twice its ramp")));
    let out = core.step_saved(UnixMs(T0 + 1), vec![admin(add(60_000, 30_001), 0)]);
    assert!(!reply(&out).is_ok());
    assert_eq!(reply(&out).refusal(), Some(Refusal::EventOutOfRange));
    // What a VTN might serve, passed on by the VEN: refused, typed, never held.
    for cut in [
        Cut::Reduce { fraction: 7.0 },
        Cut::Reduce { fraction: -0.5 },
        Cut::Target { budget_w: -1.0 },
        Cut::Target {
            budget_w: f64::INFINITY,
        },
    ] {
        let op = AdminOp::EventAdd {
            cut,
            start_ms: T0,
            duration_ms: 60_000,
            ramp_ms: 0,
            domain: None,
        };
        let out = core.step_saved(UnixMs(T0 + 1), vec![admin(op, 0)]);
        assert_eq!(
            reply(&out).refusal(),
            Some(Refusal::EventOutOfRange),
            "{cut:?}"
        );
    }
    let out = core.step_saved(UnixMs(T0 + 1), vec![admin(add(u64::MAX, 0), 0)]);
    assert_eq!(reply(&out).refusal(), Some(Refusal::EventOutOfRange));
    assert!(core.state().events.is_empty());
    let out = core.step_saved(
        UnixMs(T0 + 1),
        vec![admin(add(60_000, 0), 0), admin(add(60_000, 0), 0)],
    );
    let ids: Vec<Option<u64>> = out.replies.iter().map(|(_, r)| r.event_id()).collect();
    assert_eq!(ids, [Some(1), Some(2)]);
    assert_eq!(out.persist.as_ref().map(|s| s.events.len()), Some(2));
    assert_eq!(
        core.status(UnixMs(T0 + 1)).budget_w,
        7000.0,
        "30 % off at once"
    );
    let out = core.step_saved(
        UnixMs(T0 + 2),
        vec![admin(AdminOp::EventCancel { id: 7 }, 0)],
    );
    assert_eq!(reply(&out).error_message(), Some("no event 7"));
    assert_eq!(reply(&out).refusal(), Some(Refusal::NoSuchEvent));
    let out = core.step_saved(
        UnixMs(T0 + 2),
        vec![admin(AdminOp::EventCancel { id: 1 }, 0)],
    );
    assert!(reply(&out).is_ok());
    assert_eq!(
        core.state().events.iter().map(|e| e.id).collect::<Vec<_>>(),
        [2]
    );
    // Bounded: once MAX_PENDING_EVENTS are held, the next is refused (typed), and
    // accepted again when one ends.
    let most = powerflex_proto::event::MAX_PENDING_EVENTS;
    let inputs: Vec<Input> = (1..most).map(|_| admin(add(60_000, 0), 0)).collect();
    let out = core.step_saved(UnixMs(T0 + 3), inputs);
    assert!(out.replies.iter().all(|(_, r)| r.is_ok()));
    let out = core.step_saved(UnixMs(T0 + 3), vec![admin(add(120_000, 0), 0)]);
    assert_eq!(reply(&out).refusal(), Some(Refusal::TooManyEvents));
    assert!(reply(&out)
        .error_message()
        .is_some_and(|e| e.contains("256")));
    assert_eq!(core.state().events.len(), most);
    let out = core.step_saved(UnixMs(T0 + 60_001), vec![admin(add(120_000, 0), 0)]);
    assert!(reply(&out).is_ok(), "{:?}", reply(&out).error_message());
}

/// A reload that lowers a domain's limit below the budget an admin set for it
/// earlier (the breaker was smaller than configured) puts the new limit in force: the
/// old budget never holds caps above the breaker.
#[test]
fn a_reload_below_a_domain_s_budget_puts_the_new_limit_in_force() {
    let mut core = racks();
    core.step_saved(UnixMs(T0 + 10_000), vec![Input::Tick]);
    let out = core.step_saved(
        UnixMs(T0 + 11_000),
        vec![budget_set(9_000.0, Some("rack-b"))],
    );
    assert!(reply(&out).is_ok());
    let lowered = with_racks(2_000.0);
    core.step_saved(
        UnixMs(T0 + 12_000),
        vec![Input::Reload(Box::new(Ok(lowered)))],
    );
    core.step_saved(
        UnixMs(T0 + 20_000),
        vec![
            report("n1", vec![job("101", None)]),
            report("n2", vec![job("102", None)]),
            Input::Tick,
        ],
    );
    let status = core.status(UnixMs(T0 + 20_000));
    let rack_b = status
        .domains
        .iter()
        .find(|d| d.name == "rack-b")
        .expect("rack-b");
    assert_eq!(rack_b.budget_w, 2_000.0, "{rack_b:?}");
    let cap = status
        .jobs
        .iter()
        .find(|j| j.job == "102")
        .and_then(|j| j.cap_w)
        .expect("job 102 capped");
    assert!(cap * 4.0 <= 2_000.0 + 1e-6, "job 102 at {cap} W × 4 GPUs");
    // The admin's budget is kept (a limit raised again brings it back).
    assert_eq!(
        core.state.domain_budgets_w.get("rack-b"),
        Some(&Watts(9_000.0))
    );
}

/// `facility.max_ramp_w_per_s` holds a domain's rise when its event ends, as it
/// holds the site's.
#[test]
fn a_domain_s_rise_after_its_event_is_held_to_the_ramp_rate() {
    let mut core = racks();
    core.options.max_ramp_w_per_s = Some(20.0);
    let at_cap = |id: &str, cap_w: f64| JobReport {
        cap_w: Some(cap_w),
        power_w: Some(cap_w * 4.0),
        ..job(id, None)
    };
    let granted = |core: &Controller, now: u64, job: &str| {
        core.status(UnixMs(now))
            .jobs
            .iter()
            .find(|j| j.job == job)
            .and_then(|j| j.cap_w)
            .unwrap_or_else(|| panic!("{job} granted at {}", now - T0))
    };
    core.step_saved(UnixMs(T0 + 10_000), vec![Input::Tick]);
    let out = core.step_saved(
        UnixMs(T0 + 15_000),
        vec![admin(
            AdminOp::EventAdd {
                cut: Cut::Target { budget_w: 1200.0 },
                start_ms: T0 + 15_000,
                duration_ms: 20_000,
                ramp_ms: 0,
                domain: Some("rack-a".into()),
            },
            0,
        )],
    );
    assert!(reply(&out).is_ok());
    let cut = granted(&core, T0 + 15_000, "101");
    assert!(cut * 4.0 <= 1200.0 + 1e-6);
    core.step_saved(
        UnixMs(T0 + 25_000),
        vec![
            report("n1", vec![at_cap("101", cut)]),
            report("n2", vec![at_cap("102", 700.0)]),
            Input::Tick,
        ],
    );
    // The caps the last allocation sent, confirmed; then 500 ms after the event's end:
    // at most 20 W/s more than the last allocation's.
    let cut = granted(&core, T0 + 25_000, "101");
    assert!(cut * 4.0 <= 1200.0 + 1e-6);
    core.step_saved(
        UnixMs(T0 + 35_500),
        vec![
            report("n1", vec![at_cap("101", cut)]),
            report("n2", vec![at_cap("102", 700.0)]),
            Input::Tick,
        ],
    );
    let after = granted(&core, T0 + 35_500, "101");
    assert!(
        after * 4.0 <= 1200.0 + 20.0 * 10.5 + 1e-6,
        "rack-a rose to {} W",
        after * 4.0
    );
    assert_eq!(
        granted(&core, T0 + 35_500, "102"),
        700.0,
        "rack-b untouched"
    );
}

#[test]
fn a_domain_event_cuts_its_own_nodes_and_nobody_else() {
    let mut core = racks();
    core.step_saved(UnixMs(T0 + 10_000), vec![Input::Tick]);
    let add = |domain: &str| AdminOp::EventAdd {
        cut: Cut::Target { budget_w: 1200.0 },
        start_ms: T0 + 20_000,
        duration_ms: 600_000,
        ramp_ms: 0,
        domain: Some(domain.into()),
    };
    // A domain the config does not declare is refused, naming those it does.
    let out = core.step_saved(UnixMs(T0 + 15_000), vec![admin(add("rack-z"), 0)]);
    let refused = reply(&out);
    assert_eq!(refused.refusal(), Some(Refusal::NoSuchDomain));
    let why = refused.error_message().unwrap_or_default();
    assert!(
        why.contains("rack-z") && why.contains("feed-a, rack-a, rack-b"),
        "{why}"
    );
    let out = core.step_saved(UnixMs(T0 + 15_001), vec![admin(add("rack-a"), 0)]);
    assert!(reply(&out).is_ok());
    let out = core.step_saved(UnixMs(T0 + 20_000), vec![Input::Tick]);
    let n1 = out.leases["n1"].clone();
    assert!(n1.caps["101"] * 4.0 <= 1200.0 + 1e-6, "rack-a cut: {n1:?}");
    assert!(n1.event_in_force);
    // A job starting on n1 starts at rack-a's share per GPU (1.2 kW over 8 GPUs).
    assert!(n1.start_cap_w <= 150.0 + 1e-9, "{n1:?}");
    if let Some(n2) = out.leases.get("n2") {
        assert_eq!(n2.caps["102"], 700.0, "rack-b untouched: {n2:?}");
        assert!(n2.start_cap_w > 150.0, "{n2:?}");
        assert!(!n2.event_in_force, "rack-b's node is outside the event");
    }
    let status = core.status(UnixMs(T0 + 20_000));
    assert_eq!(
        status.budget_w, 10_000.0,
        "the site's budget is not the rack's"
    );
    assert!(status.active_event.is_none());
    let names: Vec<&str> = status.domains.iter().map(|d| d.name.as_str()).collect();
    assert_eq!(names, ["feed-a", "rack-a", "rack-b"]);
    let rack_a = &status.domains[1];
    assert_eq!(rack_a.budget_w, 1200.0);
    assert_eq!(rack_a.event, Some(1));
    assert_eq!((rack_a.nodes, rack_a.live_nodes, rack_a.depth), (1, 1, 1));
    assert!(
        rack_a.planned_w.is_some_and(|w| w <= 1200.0 + 1e-6),
        "{rack_a:?}"
    );
    let rack_b = &status.domains[2];
    assert_eq!((rack_b.budget_w, rack_b.event), (10_000.0, None));
    assert_eq!(rack_b.parent.as_deref(), Some("feed-a"));
    // An admin's budget for rack-b cuts rack-b, and survives a restart (state).
    let out = core.step_saved(
        UnixMs(T0 + 21_000),
        vec![budget_set(2000.0, Some("rack-b"))],
    );
    assert!(reply(&out).is_ok());
    assert_eq!(
        out.persist
            .as_ref()
            .map(|s| s.domain_budgets_w.get("rack-b").copied()),
        Some(Some(Watts(2000.0)))
    );
    // The nodes report again (within their lease, at the caps they were sent) and the
    // next period allocates.
    let at_cap = |id: &str, cap_w: f64| JobReport {
        cap_w: Some(cap_w),
        power_w: Some(cap_w * 4.0),
        ..job(id, None)
    };
    let rack_a_cap = n1.caps["101"];
    core.step_saved(
        UnixMs(T0 + 30_000),
        vec![
            report("n1", vec![at_cap("101", rack_a_cap)]),
            report("n2", vec![at_cap("102", 700.0)]),
            Input::Tick,
        ],
    );
    let granted = |core: &Controller, job: &str| {
        core.status(UnixMs(T0 + 30_000))
            .jobs
            .iter()
            .find(|j| j.job == job)
            .and_then(|j| j.cap_w)
            .expect("granted")
    };
    assert!(granted(&core, "102") * 4.0 <= 2000.0 + 1e-6);
    assert!(granted(&core, "101") * 4.0 <= 1200.0 + 1e-6);
    let out = core.step_saved(
        UnixMs(T0 + 31_000),
        vec![budget_set(2000.0, Some("nowhere"))],
    );
    assert_eq!(reply(&out).refusal(), Some(Refusal::NoSuchDomain));
    // Never above the breaker's limit.
    let out = core.step_saved(
        UnixMs(T0 + 32_000),
        vec![budget_set(20_000.0, Some("rack-b"))],
    );
    let above = reply(&out);
    assert!(!above.is_ok());
    assert!(
        above
            .error_message()
            .is_some_and(|e| e.contains("at most 10.0 kW")),
        "{above:?}"
    );
}

/// Pre-positioning: every lease names the start of the next announced event, so that
/// walks end before it; none once it has started, or with none.
#[test]
fn leases_announce_the_next_event_s_start() {
    let mut core = running();
    let out = core.step_saved(UnixMs(T0 + 10_000), vec![Input::Tick]);
    assert!(out.leases.values().all(|l| l.next_event_in_s.is_none()));
    let add = |start_ms| AdminOp::EventAdd {
        cut: Cut::Reduce { fraction: 0.3 },
        start_ms,
        duration_ms: 600_000,
        ramp_ms: 0,
        domain: None,
    };
    let out = core.step_saved(
        UnixMs(T0 + 20_000),
        vec![
            admin(add(T0 + 920_000), 0),
            admin(add(T0 + 320_000), 0),
            Input::Tick,
        ],
    );
    assert!(!out.leases.is_empty());
    for lease in out.leases.values() {
        assert_eq!(lease.next_event_in_s, Some(300.0), "the nearer one");
    }
    let out = core.step_saved(UnixMs(T0 + 330_000), vec![Input::Tick]);
    for lease in out.leases.values() {
        assert_eq!(lease.next_event_in_s, Some(590.0), "the first has started");
    }
}

/// Pre-positioning: while an event is announced, each lease names the lowest cap the
/// event's plan needs for each of the node's jobs (below the caps in force: the event
/// cuts), for the deepest announced event; none once it has started, nor for a job the
/// lease does not carry.
#[test]
fn leases_name_the_caps_an_announced_event_needs() {
    let mut core = running();
    let out = core.step_saved(UnixMs(T0 + 10_000), vec![Input::Tick]);
    assert!(out.leases.values().all(|l| l.walk_to_w.is_empty()));
    let add = |fraction, start_ms| AdminOp::EventAdd {
        cut: Cut::Reduce { fraction },
        start_ms,
        duration_ms: 600_000,
        ramp_ms: 0,
        domain: None,
    };
    let out = core.step_saved(
        UnixMs(T0 + 20_000),
        vec![
            admin(add(0.3, T0 + 320_000), 0),
            admin(add(0.6, T0 + 920_000), 0),
            Input::Tick,
        ],
    );
    assert!(!out.leases.is_empty());
    let mut named = 0;
    for lease in out.leases.values() {
        assert_eq!(
            lease.walk_to_w.keys().collect::<Vec<_>>(),
            lease.caps.keys().collect::<Vec<_>>(),
            "every job of the node, no other"
        );
        for (job, need) in &lease.walk_to_w {
            let now = lease.caps[job];
            assert!(*need < now - 0.5, "job {job}: needs {need} W, at {now} W");
            assert!(*need >= 200.0 - 1e-9);
            named += 1;
        }
    }
    assert_eq!(named, 2);
    let deepest: Vec<f64> = out
        .leases
        .values()
        .flat_map(|l| l.walk_to_w.values().copied())
        .collect();
    // Once both have started, nothing is announced.
    let out = core.step_saved(UnixMs(T0 + 930_000), vec![Input::Tick]);
    assert!(out.leases.values().all(|l| l.walk_to_w.is_empty()));
    // The 60 % cut's plan goes deeper than the 30 % cut's would.
    let mut shallow = running();
    let out = shallow.step_saved(
        UnixMs(T0 + 20_000),
        vec![admin(add(0.3, T0 + 320_000), 0), Input::Tick],
    );
    let shallower: Vec<f64> = out
        .leases
        .values()
        .flat_map(|l| l.walk_to_w.values().copied())
        .collect();
    assert_eq!(shallower.len(), deepest.len());
    for (deep, shallow) in deepest.iter().zip(&shallower) {
        assert!(deep < shallow, "{deep} W vs {shallow} W");
    }
}

#[test]
fn an_event_that_ended_is_dropped_and_saved() {
    let mut core = running();
    let out = core.step_saved(
        UnixMs(T0 + 1),
        vec![admin(
            AdminOp::EventAdd {
                cut: Cut::Target { budget_w: 6000.0 },
                start_ms: T0,
                duration_ms: 10_000,
                ramp_ms: 0,
                domain: None,
            },
            0,
        )],
    );
    assert!(reply(&out).is_ok());
    assert_eq!(
        core.status(UnixMs(T0 + 5000)).active_event.map(|e| e.id),
        Some(1)
    );
    let out = core.step_saved(UnixMs(T0 + 9_999), vec![Input::Tick]);
    assert_eq!(out.persist, None);
    let out = core.step_saved(UnixMs(T0 + 10_000), vec![Input::Tick]);
    assert_eq!(out.persist.map(|s| s.events), Some(Vec::new()));
    assert!(core.status(UnixMs(T0 + 10_000)).events.is_empty());
    assert_eq!(core.status(UnixMs(T0 + 10_000)).budget_w, 10_000.0);
}

#[test]
fn a_reload_changes_the_budget_at_once_and_not_what_needs_a_restart() {
    let mut core = running();
    let mut new = options();
    new.base_budget = Watts(8000.0);
    new.lease_ttl_s = 60.0;
    new.period = Duration::from_secs(1);
    new.job_placement = JobPlacement::Slurm;
    let out = core.step_saved(UnixMs(T0 + 1), vec![Input::Reload(Box::new(Ok(new)))]);
    assert!(out.metrics.is_some(), "reallocated at once");
    assert_eq!(out.lease_ttl_s, 60.0);
    assert_eq!(core.status(UnixMs(T0 + 1)).base_budget_w, 8000.0);
    assert_eq!(core.settings().period, options().period);
    assert_eq!(core.settings().job_placement, options().job_placement);
    // A budget set by an admin still overrides the site config's.
    core.step_saved(UnixMs(T0 + 2), vec![budget_set(9000.0, None)]);
    let mut again = options();
    again.base_budget = Watts(7000.0);
    core.step_saved(UnixMs(T0 + 3), vec![Input::Reload(Box::new(Ok(again)))]);
    assert_eq!(core.status(UnixMs(T0 + 3)).budget_w, 9000.0);
}

#[test]
fn a_refused_reload_keeps_the_config_and_is_reported_until_a_valid_one() {
    let mut core = running();
    let out = core.step_saved(
        UnixMs(T0 + 1),
        vec![Input::Reload(Box::new(Err(MachineError::Config(
            "powerflex.toml: bad key".into(),
        ))))],
    );
    assert!(
        out.metrics.is_none(),
        "nothing changed, nothing to reallocate"
    );
    let status = core.status(UnixMs(T0 + 1));
    assert_eq!(
        status.config_error.as_deref(),
        Some("powerflex.toml: bad key")
    );
    assert_eq!(status.base_budget_w, 10_000.0);
    let error_for = |core: &mut Controller, uid| {
        let out = core.step_saved(UnixMs(T0 + 2), vec![admin(AdminOp::Status, uid)]);
        reply(&out).status().and_then(|s| s.config_error.clone())
    };
    assert_eq!(
        error_for(&mut core, 0).as_deref(),
        Some("powerflex.toml: bad key")
    );
    // Anyone learns that a reload was refused; only root reads the config's words.
    assert_eq!(
        error_for(&mut core, 1000).as_deref(),
        Some(owners::CONFIG_ERROR_FOR_USERS)
    );
    core.step_saved(UnixMs(T0 + 3), vec![Input::Reload(Box::new(Ok(options())))]);
    assert_eq!(core.status(UnixMs(T0 + 3)).config_error, None);
}

#[test]
fn what_if_is_read_only() {
    let mut core = running();
    let before_state = core.state().clone();
    let before_status = core.status(UnixMs(T0 + 1));
    let out = core.step_saved(
        UnixMs(T0 + 1),
        vec![admin(
            AdminOp::WhatIf {
                policy: Some(Policy::Equal),
                budget_w: Some(3000.0),
                ignore_tiers: false,
            },
            0,
        )],
    );
    let d = reply(&out).what_if().expect("decision");
    assert_eq!(d.budget_w, 3000.0);
    assert_eq!(d.allocation.as_ref().map(|a| a.policy), Some(Policy::Equal));
    assert!(out.persist.is_none() && out.leases.is_empty() && out.metrics.is_none());
    assert_eq!(core.state(), &before_state);
    assert_eq!(core.status(UnixMs(T0 + 1)), before_status);
    assert_eq!(allocations(&core), 1);
    // Every job's curve and cap: root's only, refused before it is computed.
    let out = core.step_saved(
        UnixMs(T0 + 3),
        vec![admin(
            AdminOp::WhatIf {
                policy: Some(Policy::Equal),
                budget_w: None,
                ignore_tiers: false,
            },
            1000,
        )],
    );
    assert!(reply(&out).what_if().is_none());
    let e = reply(&out)
        .error_message()
        .map(str::to_string)
        .expect("refused");
    assert!(e.contains("root only"), "{e}");
}

/// Need-to-know: the owners the agents report decide what a non-root admin
/// caller reads — in the status, the history (served from the board with the owners
/// the step publishes), and after the job has left.
#[test]
fn a_user_reads_only_their_own_jobs_and_root_reads_all() {
    const ALICE: u32 = 1001;
    const BOB: u32 = 1002;
    let owned = |id: &str, uid: Option<u32>| {
        let mut j = job(id, None);
        j.owner_uid = uid;
        j
    };
    let board = HistoryBoard::new();
    let mut core = fresh();
    step_published(
        &mut core,
        &board,
        T0,
        vec![
            hello("n1"),
            report(
                "n1",
                vec![owned("101", Some(ALICE)), owned("102", Some(BOB))],
            ),
            hello("n2"),
            // An agent from before owners were reported.
            report("n2", vec![owned("103", None)]),
        ],
    );
    let jobs_for = |core: &mut Controller, t: u64, uid: u32| -> Vec<String> {
        let out = core.step_saved(UnixMs(t), vec![admin(AdminOp::Status, uid)]);
        let status = reply(&out).status().cloned().expect("status");
        assert_eq!(status.jobs_of_uid, (uid != 0).then_some(uid));
        assert_eq!(status.nodes.len(), 2, "every caller sees the nodes");
        status.jobs.into_iter().map(|j| j.job).collect()
    };
    assert_eq!(jobs_for(&mut core, T0 + 1, 0), ["101", "102", "103"]);
    assert_eq!(jobs_for(&mut core, T0 + 1, ALICE), ["101"]);
    assert_eq!(jobs_for(&mut core, T0 + 1, BOB), ["102"]);
    assert!(jobs_for(&mut core, T0 + 1, 1003).is_empty());
    let caps_for = |uid: u32| -> Vec<String> {
        let history = board
            .answer(None, None, uid)
            .history()
            .expect("history")
            .to_vec();
        let mut jobs: Vec<String> = history
            .into_iter()
            .flat_map(|s| s.caps.into_keys())
            .collect();
        jobs.sort();
        jobs.dedup();
        jobs
    };
    assert_eq!(caps_for(ALICE), ["101"]);
    assert_eq!(caps_for(0), ["101", "102", "103"]);
    // Alice's job ends: it leaves the status, and she still reads its caps in the
    // history; bob still cannot.
    step_published(
        &mut core,
        &board,
        T0 + 10_000,
        vec![report("n1", vec![owned("102", Some(BOB))]), Input::Tick],
    );
    assert!(jobs_for(&mut core, T0 + 10_001, ALICE).is_empty());
    assert_eq!(caps_for(ALICE), ["101"]);
    assert_eq!(caps_for(BOB), ["102"]);
    // Two nodes naming different owners for one job: nobody's but root's.
    step_published(
        &mut core,
        &board,
        T0 + 20_000,
        vec![
            report("n1", vec![owned("104", Some(ALICE))]),
            report("n2", vec![owned("104", Some(BOB))]),
            Input::Tick,
        ],
    );
    assert!(jobs_for(&mut core, T0 + 20_001, ALICE).is_empty());
    assert!(jobs_for(&mut core, T0 + 20_001, BOB).is_empty());
    assert_eq!(jobs_for(&mut core, T0 + 20_001, 0), ["104"]);
    assert_eq!(caps_for(ALICE), ["101"]);
    assert_eq!(caps_for(BOB), ["102"]);
    assert_eq!(caps_for(0), ["101", "102", "103", "104"]);
}
