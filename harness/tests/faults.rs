//! The rows of the fault matrix whose subject is logic, on the site harness (the rest
//! run on Slurm, `tests/faults.rs`): the controller gone past the lease, a
//! wall-clock jump on one node, a controller restarted mid-event on its saved state. One
//! 2-node × 4-GPU flex3 job under a budget that caps it, as there.

// The tests print what they measured, as the Slurm tests do.
#![allow(clippy::disallowed_macros)]

use powerflex_proto::admin::AdminOp;
use powerflex_proto::event::Cut;
use powerflex_site_harness::site::test_bed_site;
use powerflex_site_harness::site::{Fault, JobSpec, JobState, Restart, Site, SiteOptions, Stop};

const BUDGET_W: f64 = 3000.0;
const PROFILE: &str = "qwen3-30b-a3b-moe-ft-8g";
const FAILSAFE_CAP_W: f64 = 300.0;
const DEFAULT_CAP_W: f64 = 700.0;
const METER_TOLERANCE: f64 = 0.01;

fn site(base_w: f64, lease_ttl_s: u64) -> Site {
    Site::new(SiteOptions {
        site: test_bed_site(base_w, lease_ttl_s),
        ..SiteOptions::new(17, base_w)
    })
    .expect("site")
}

/// The rows' job: flex3, no walk, 4 GPUs on each of the two nodes.
fn start_job(site: &mut Site) {
    site.submit(JobSpec {
        nodes: vec![0, 1],
        ..JobSpec::training("1", "flex3,calibrate=off", 0, 4, PROFILE)
    })
    .expect("submit");
}

/// Every GPU at a cap the controller granted, and the draw within `budget_w`.
fn allocated_within(s: &Site, budget_w: f64) -> bool {
    let Some(status) = s.controller_status() else {
        return false;
    };
    let granted: Vec<f64> = status.jobs.iter().filter_map(|j| j.cap_w).collect();
    !granted.is_empty()
        && granted.len() == status.jobs.len()
        && s.caps_w()
            .iter()
            .all(|c| *c < DEFAULT_CAP_W && granted.iter().any(|g| (g - c).abs() < 0.5))
        && s.draw_w() <= budget_w * 1.01
}

/// The controller gone past the lease: the draw stays within the budget, every GPU falls
/// to the fail-safe cap and no job is killed; the restarted controller leases fresh caps
/// and keeps the budget set.
#[test]
fn with_the_controller_gone_past_the_lease_every_job_falls_to_the_failsafe_cap() {
    let mut site = site(5600.0, 5);
    start_job(&mut site);
    let reply = site
        .admin(AdminOp::BudgetSet {
            budget_w: BUDGET_W,
            domain: None,
        })
        .expect("reply");
    assert!(reply.is_ok());
    assert!(site.run_until(30_000, |s| allocated_within(s, BUDGET_W)));
    site.inject(Fault::ControllerStop).expect("stop");
    let watch = site.watch_for(6_000, METER_TOLERANCE);
    assert!(
        watch.over_s == 0.0 && watch.highest_budget_w == BUDGET_W,
        "controller gone: {watch}"
    );
    assert!(
        site.run_until(10_000, |s| s.caps_w().iter().all(|&c| c == FAILSAFE_CAP_W)),
        "every GPU at the fail-safe cap: {:?}",
        site.caps_w()
    );
    assert_eq!(
        site.job_state("1"),
        Some(JobState::Running),
        "powerflex kills no job"
    );
    site.inject(Fault::ControllerStart {
        state: Restart::WithState,
    })
    .expect("start");
    assert!(
        site.run_until(30_000, |s| s.caps_w().iter().all(|&c| c > FAILSAFE_CAP_W)),
        "caps from a fresh lease"
    );
    let back = site.watch_for(3_000, METER_TOLERANCE);
    assert!(
        back.over_s == 0.0 && back.highest_budget_w == BUDGET_W,
        "controller back: {back}"
    );
    assert_eq!(
        site.controller_status().map(|s| s.budget_w),
        Some(BUDGET_W),
        "the restarted controller kept the budget set"
    );
    assert!(
        site.ends_clean(60_000),
        "the jobs end clean: every GPU back at its default, no agent holding a job"
    );
}

/// A wall-clock jump on one node: its stale messages are refused both ways, it falls to
/// its fail-safe and its job runs on, the draw within the budget; with its clock back it
/// is live again.
#[test]
fn a_wall_clock_jump_on_one_node_keeps_the_budget_and_recovers() {
    let mut site = site(BUDGET_W, 5);
    start_job(&mut site);
    assert!(site.run_until(30_000, |s| allocated_within(s, BUDGET_W)));
    let live = |s: &Site, node: &str| {
        s.controller_status()
            .and_then(|st| st.nodes.iter().find(|n| n.node == node).map(|n| n.live))
    };
    for jump_ms in [600_000i64, -600_000] {
        let refused_before = site.refused_for_skew();
        site.inject(Fault::ClockJump {
            node: 0,
            by_ms: jump_ms,
        })
        .expect("jump");
        // n1's messages look stale (or from the future) to the controller, and its
        // leases to n1: n1 falls silent, then to its fail-safe cap; the budget holds.
        let watch = site.watch_for(8_000, METER_TOLERANCE);
        assert!(watch.over_s == 0.0, "clock {jump_ms} ms: {watch}");
        assert_eq!(
            live(&site, "n1"),
            Some(false),
            "n1's stale messages are refused"
        );
        let refused = site.refused_for_skew();
        assert!(
            refused.0 > refused_before.0 && refused.1 > refused_before.1,
            "refused both ways: {refused:?}"
        );
        assert_eq!(site.failsafe(0), Some(true), "n1 at its fail-safe");
        assert_eq!(
            site.job_state("1"),
            Some(JobState::Running),
            "powerflex kills no job"
        );
        site.inject(Fault::ClockJump {
            node: 0,
            by_ms: -jump_ms,
        })
        .expect("jump back");
        assert!(
            site.run_until(30_000, |s| live(s, "n1") == Some(true)
                && s.caps_w().iter().all(|&c| c < DEFAULT_CAP_W)),
            "n1 live again after its clock is back"
        );
        let back = site.watch_for(2_000, METER_TOLERANCE);
        assert!(back.over_s == 0.0, "clock back: {back}");
    }
    assert!(
        site.ends_clean(60_000),
        "the jobs end clean: every GPU back at its default, no agent holding a job"
    );
}

/// The part of the Slurm test
/// `tests/faults.rs::a_corrupt_controller_state_mid_event_falls_back_on_the_previous_copy`
/// that is logic: a controller restarted mid-event on the state it saved resumes the
/// event and holds its budget (the file's fallback on its previous copy is
/// `ctld::state`'s own unit test, and the corrupt file stays on Slurm).
#[test]
fn a_controller_restarted_mid_event_on_its_saved_state_resumes_the_event() {
    let mut site = site(5000.0, 10);
    start_job(&mut site);
    let reply = site
        .admin(AdminOp::EventAdd {
            cut: Cut::Target { budget_w: BUDGET_W },
            start_ms: site.now_ms(),
            duration_ms: 600_000,
            ramp_ms: 0,
            domain: None,
        })
        .expect("reply");
    assert!(reply.is_ok());
    let reply = site
        .admin(AdminOp::BudgetSet {
            budget_w: 5200.0,
            domain: None,
        })
        .expect("reply");
    assert!(reply.is_ok());
    assert!(site.run_until(30_000, |s| allocated_within(s, BUDGET_W)));
    site.inject(Fault::ControllerStop).expect("stop");
    site.run_for(2_000);
    site.inject(Fault::ControllerStart {
        state: Restart::WithState,
    })
    .expect("start");
    let status = site.controller_status().expect("status");
    assert_eq!(
        status.active_event.as_ref().map(|e| e.id),
        Some(1),
        "the event known again"
    );
    assert!(status.budget_w <= BUDGET_W + 1e-6, "{}", status.budget_w);
    let watch = site.watch_for(4_000, METER_TOLERANCE);
    assert!(
        watch.over_s == 0.0,
        "after the restart on the saved state: {watch}"
    );
    assert_eq!(site.job_state("1"), Some(JobState::Running));
    assert!(
        site.ends_clean(60_000),
        "the jobs end clean: every GPU back at its default, no agent holding a job"
    );
}

/// A controller restarted with its state lost holds its first allocation for a lease:
/// every node's old lease runs out (each at its fail-safe cap) before new ones go out,
/// and the budget holds throughout.
#[test]
fn a_controller_restarted_with_its_state_lost_allocates_only_after_every_old_lease() {
    let mut site = site(BUDGET_W, 5);
    start_job(&mut site);
    assert!(site.run_until(30_000, |s| allocated_within(s, BUDGET_W)));
    site.inject(Fault::ControllerStop).expect("stop");
    site.inject(Fault::ControllerStart {
        state: Restart::StateLost,
    })
    .expect("start");
    let restarted = site.now_ms();
    let watch = site.watch_for(4_000, METER_TOLERANCE);
    assert!(watch.over_s == 0.0, "{watch}");
    assert_eq!(site.allocations(), 0, "nothing allocated within the lease");
    assert!(
        site.run_until(10_000, |s| s.allocations() > 0),
        "allocating after the hold"
    );
    assert!(
        site.now_ms() >= restarted + 5_000,
        "not before a whole lease"
    );
    let watch = site.watch_for(5_000, METER_TOLERANCE);
    assert!(watch.over_s == 0.0, "{watch}");
    assert!(
        site.ends_clean(60_000),
        "the jobs end clean: every GPU back at its default, no agent holding a job"
    );
}

/// A controller restarted with its state lost beside a node whose agent is down: the
/// restarted controller never heard from that node, whose unmanaged job draws at its
/// GPUs' defaults. Slurm lists its 4 GPUs, so it is UNMANAGED, reserved at 4 × 700 W
/// (the site's largest model), and the managed job on the other two nodes is capped to
/// what the budget leaves after that reserve: the draw holds the budget throughout.
#[test]
fn a_node_never_heard_from_after_a_state_loss_is_reserved_and_the_budget_holds() {
    const BUDGET: f64 = 6000.0;
    const RESERVE_W: f64 = 4.0 * DEFAULT_CAP_W;
    let mut site = Site::new(SiteOptions {
        nodes: 3,
        site: test_bed_site(BUDGET, 5),
        ..SiteOptions::new(23, BUDGET)
    })
    .expect("site");
    start_job(&mut site);
    // Node 2 runs a job powerflex does not steer (tier `none`): at the GPUs' defaults.
    site.submit(JobSpec::training("2", "none", 2, 4, PROFILE))
        .expect("submit");
    assert!(site.run_until(30_000, |s| s
        .controller_status()
        .is_some_and(|st| st.jobs.iter().any(|j| j.cap_w.is_some()))));
    site.inject(Fault::AgentStop {
        node: 2,
        how: Stop::Killed,
    })
    .expect("stop the agent");
    site.inject(Fault::ControllerStop).expect("stop");
    site.inject(Fault::ControllerStart {
        state: Restart::StateLost,
    })
    .expect("start");
    assert!(
        site.run_until(15_000, |s| s.allocations() > 0),
        "allocating after the hold"
    );
    let status = site.controller_status().expect("status");
    let unheard = status
        .nodes
        .iter()
        .find(|n| n.node == site.node_name(2))
        .expect("node 2 listed");
    assert_eq!(
        (unheard.live, unheard.unmanaged_reserve_w),
        (false, Some(RESERVE_W)),
        "{unheard:?}"
    );
    assert_eq!(status.unmanaged_reserve_w, Some(RESERVE_W));
    let watch = site.watch_for(20_000, METER_TOLERANCE);
    let node2_w: f64 = site.node_caps_w(2).iter().sum();
    let caps = site.job_caps_w("1");
    println!("unheard node's limits {node2_w} W; job 1 at {caps:?} W per GPU; {watch}");
    assert!(watch.over_s == 0.0, "{watch}");
    assert!(
        caps.iter().all(|c| c * 8.0 <= BUDGET - RESERVE_W + 0.5),
        "the managed job gets what the reserve leaves: {caps:?}"
    );
}
