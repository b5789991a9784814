//! The facility budget against the meter, on the site harness: the scenarios of the Slurm
//! tests (`tests/budget.rs`) whose subject is logic, with the same assertions, on
//! the site's clock, the meter sampled every 50 ms of site time. A sample counts as over
//! beyond 1 % of the budget, as the Slurm tests count it (the agents' readings carry the
//! simulator's ±0.5 % noise, and metered mode plans on them); the meter here is the
//! GPUs' noise-free draw.

// The tests print what they measured, as the Slurm tests do.
#![allow(clippy::disallowed_macros)]

use powerflex_proto::admin::AdminOp;
use powerflex_proto::event::Cut;
use powerflex_site_harness::site::test_bed_site;
use powerflex_site_harness::site::{
    DrawWatch, Fault, JobSpec, Phase, Restart, Site, SiteOptions, Stop,
};

const HEAVY: &str = "synthetic-compute-bound";
const LIGHT: &str = "synthetic-memory-bound";
const TRAIN: &str = "qwen3-30b-a3b-moe-ft-8g";
const FAILSAFE_CAP_W: f64 = 300.0;
const DEFAULT_CAP_W: f64 = 700.0;
/// As the Slurm tests count a sample over.
const METER_TOLERANCE: f64 = 0.01;
/// `metered` promises the draw back within the budget in two allocation periods, plus
/// an agent sample (250 ms), s.
const SETTLE_S: f64 = 2.25;

fn site(budget_w: f64, lease_ttl_s: u64) -> Site {
    Site::new(SiteOptions {
        site: test_bed_site(budget_w, lease_ttl_s),
        ..SiteOptions::new(13, budget_w)
    })
    .expect("site")
}

/// Job "a" on n1 running `a_phases` at `a_flex`, and a flex3 job "b" on n2 that takes
/// what the budget leaves; runs until both have a granted cap.
fn two_jobs(site: &mut Site, a_flex: &str, a_phases: Vec<Phase>) {
    site.submit(JobSpec {
        phases: a_phases,
        ..JobSpec::training("a", a_flex, 0, 4, TRAIN)
    })
    .expect("a");
    site.submit(JobSpec::training("b", "flex3,calibrate=off", 1, 4, TRAIN))
        .expect("b");
    let granted = |s: &Site| {
        ["a", "b"].iter().all(|id| {
            s.controller_status()
                .is_some_and(|st| st.jobs.iter().any(|j| j.job == *id && j.cap_w.is_some()))
        })
    };
    assert!(
        site.run_until(30_000, granted),
        "a cap granted to every job"
    );
}

fn running(site: &Site, id: &str) -> bool {
    site.job_state(id) == Some(powerflex_site_harness::site::JobState::Running)
}

/// A job idle for its first minute, then training at full power: no stretch over the
/// budget lasts longer than the settle time, and the budget is used.
#[test]
fn a_job_idle_for_its_first_minute_then_training_at_full_power_keeps_the_budget() {
    let budget_w = 4000.0;
    let mut site = site(budget_w, 10);
    two_jobs(
        &mut site,
        "flex0,calibrate=off",
        vec![
            Phase {
                workload: None,
                length_s: 60.0,
                new_step: false,
            },
            Phase::train(TRAIN),
        ],
    );
    assert!(!site.job_loaded("a"), "the job starts idle");
    // The idle minute and 30 s of training.
    let watch = site.watch_for(90_000, METER_TOLERANCE);
    println!("idle for a minute, then training: {watch}");
    assert!(site.job_loaded("a"), "the job trains after its idle minute");
    assert!(watch.longest_over_s <= SETTLE_S, "{watch}");
    assert!(
        watch.highest_w > 0.9 * budget_w,
        "the budget is used: {watch}"
    );
    let settled = site.watch_for(3_000, METER_TOLERANCE);
    assert!(settled.over_s == 0.0, "training, settled: {settled}");
    assert!(
        site.ends_clean(60_000),
        "the jobs end clean: every GPU back at its default, no agent holding a job"
    );
}

/// A job changing from a light to a heavy profile: no stretch over the budget lasts
/// longer than the settle time (two allocation periods and one agent sample), and once
/// settled the draw stays within it.
#[test]
fn a_phase_change_to_a_heavier_profile_is_back_within_the_budget_in_two_periods() {
    let budget_w = 4000.0;
    let mut site = site(budget_w, 10);
    two_jobs(
        &mut site,
        "flex0,calibrate=off",
        vec![
            Phase {
                workload: Some(LIGHT.into()),
                length_s: 100.0,
                new_step: false,
            },
            Phase::train(HEAVY),
        ],
    );
    let light = site.agent_status(0).expect("agent").gpus[0]
        .power_w
        .expect("read");
    assert_eq!(site.job_workload("a"), Some(LIGHT), "the light phase first");
    assert!(
        site.job_loaded("a") && light < 580.0,
        "the light phase loads its GPUs, below 580 W: {light} W"
    );
    let watch = site.watch_for(130_000, METER_TOLERANCE);
    println!("phase change 560 W -> 690 W per GPU: {watch}");
    assert!(watch.longest_over_s <= SETTLE_S, "{watch}");
    let heavy = site.agent_status(0).expect("agent").gpus[0]
        .power_w
        .expect("read");
    assert_eq!(site.job_workload("a"), Some(HEAVY), "the heavy phase runs");
    assert!(
        heavy > 600.0 || site.node_caps_w(0)[0] < 690.0,
        "the heavy phase draws more, or its cap holds it: {heavy} W"
    );
    let settled = site.watch_for(3_000, METER_TOLERANCE);
    assert!(settled.over_s == 0.0, "heavy phase, settled: {settled}");
    assert!(
        site.ends_clean(60_000),
        "the jobs end clean: every GPU back at its default, no agent holding a job"
    );
}

/// The controller gone past the lease during a cut below the fail-safe: the agents fall
/// to min(fail-safe, last grant), so no cap rises and the cut holds; the restarted
/// controller keeps the budget set, and no job is killed.
#[test]
fn a_controller_outage_past_the_lease_during_a_cut_below_the_failsafe_keeps_the_cut() {
    let lease_ttl_s = 5;
    let mut site = site(5600.0, lease_ttl_s);
    two_jobs(&mut site, "flex3,calibrate=off", vec![Phase::train(TRAIN)]);
    let cut_w = 1900.0;
    let reply = site
        .admin(AdminOp::BudgetSet {
            budget_w: cut_w,
            domain: None,
        })
        .expect("reply");
    assert!(reply.is_ok(), "{reply:?}");
    assert!(
        site.run_until(30_000, |s| s.caps_w().iter().all(|&c| c < FAILSAFE_CAP_W)
            && s.draw_w() <= cut_w * 1.01),
        "every cap below the fail-safe: {:?}",
        site.caps_w()
    );
    let caps_before = site.caps_w();
    site.inject(Fault::ControllerStop).expect("stop");
    let watch = site.watch_for((lease_ttl_s + 8) * 1000, METER_TOLERANCE);
    assert!(
        watch.over_s == 0.0 && watch.highest_budget_w == cut_w,
        "controller gone past its lease, held to the {cut_w} W cut: {watch}"
    );
    for (before, after) in caps_before.iter().zip(site.caps_w()) {
        assert!(after <= *before, "the fail-safe never raises a cap");
    }
    assert_eq!(
        site.failsafe(0),
        Some(true),
        "the agent says its lease ran out"
    );
    assert!(
        running(&site, "a") && running(&site, "b"),
        "powerflex kills no job"
    );
    site.inject(Fault::ControllerStart {
        state: Restart::WithState,
    })
    .expect("start");
    let back = site.watch_for(5_000, METER_TOLERANCE);
    assert!(
        back.over_s == 0.0 && back.highest_budget_w == cut_w,
        "controller back, the {cut_w} W cut still in force: {back}"
    );
    assert_eq!(
        site.controller_status().map(|s| s.budget_w),
        Some(cut_w),
        "the restarted controller kept the budget set"
    );
    assert!(
        site.ends_clean(60_000),
        "the jobs end clean: every GPU back at its default, no agent holding a job"
    );
}

/// The logic of the Slurm test of the same name (`tests/budget.rs`), on the
/// site's clock.
#[test]
fn a_rolling_restart_of_every_agent_during_a_grid_event_keeps_the_draw_within_it() {
    let mut site = site(5600.0, 10);
    two_jobs(&mut site, "flex3,calibrate=off", vec![Phase::train(TRAIN)]);
    let cut_w = 1900.0;
    let reply = site
        .admin(AdminOp::EventAdd {
            cut: Cut::Target { budget_w: cut_w },
            start_ms: site.now_ms(),
            duration_ms: 600_000,
            ramp_ms: 0,
            domain: None,
        })
        .expect("reply");
    assert!(reply.is_ok(), "{reply:?}");
    assert!(
        site.run_until(30_000, |s| s.caps_w().iter().all(|&c| c < FAILSAFE_CAP_W)
            && s.draw_w() <= cut_w * 1.01),
        "every cap below the fail-safe, the draw within the cut"
    );
    let from = site.now_ms();
    let mut highest_caps = site.caps_w();
    for node in 0..2 {
        site.inject(Fault::AgentStop {
            node,
            how: Stop::Clean,
        })
        .expect("stop");
        site.run_for(500);
        site.inject(Fault::AgentStart {
            node,
            state: Restart::WithState,
        })
        .expect("start");
        assert!(
            site.run_until(30_000, |s| s
                .agent_status(node)
                .is_some_and(|a| !a.failsafe
                    && !a.jobs.is_empty()
                    && a.leases_applied > 0)),
            "the restarted agent leased again: {:?}",
            site.agent_status(node)
                .map(|a| (a.failsafe, a.jobs.len(), a.leases_applied))
        );
        for _ in 0..20 {
            site.run_for(50);
            for (h, c) in highest_caps.iter_mut().zip(site.caps_w()) {
                *h = h.max(c);
            }
        }
    }
    let watch = DrawWatch::of(site.samples_since(from), 0.0);
    println!("rolling restart of every agent during a {cut_w} W event: {watch}");
    assert!(watch.samples > 40, "{watch}");
    assert!(watch.over_s == 0.0, "over the event's budget: {watch}");
    assert!(
        highest_caps.iter().all(|&c| c < FAILSAFE_CAP_W),
        "no cap raised to the fail-safe or the default: {highest_caps:?}"
    );
    assert!(
        running(&site, "a") && running(&site, "b"),
        "powerflex kills no job"
    );
    assert!(
        site.ends_clean(60_000),
        "the jobs end clean: every GPU back at its default, no agent holding a job"
    );
}

/// A GPU limit written behind the agent: the agent restores its cap within seconds and
/// counts the mismatch; no stretch over the budget lasts longer than 1 s.
#[test]
fn a_cap_changed_behind_the_agent_is_restored_and_counted() {
    let budget_w = 3000.0;
    let mut site = site(budget_w, 10);
    two_jobs(&mut site, "flex3,calibrate=off", vec![Phase::train(TRAIN)]);
    assert!(
        site.run_until(30_000, |s| s.caps_w().iter().all(|&c| c < DEFAULT_CAP_W)
            && s.draw_w() <= budget_w * 1.01),
        "the jobs capped within the budget"
    );
    let before = site.agent_status(0).expect("agent").cap_mismatches;
    site.inject(Fault::CapBehindAgent {
        node: 0,
        gpu: 1,
        cap_w: 700.0,
    })
    .expect("write behind the agent");
    let from = site.now_ms();
    assert!(
        site.run_until(10_000, |s| s.node_caps_w(0)[1] < 700.0),
        "the limit restored"
    );
    site.run_for(4_000);
    let watch = DrawWatch::of(site.samples_since(from), METER_TOLERANCE);
    assert!(watch.longest_over_s <= 1.0, "{watch}");
    let after = site.agent_status(0).expect("agent").cap_mismatches;
    assert!(after > before, "the mismatch counted: {before} -> {after}");
    assert!(
        site.ends_clean(60_000),
        "the jobs end clean: every GPU back at its default, no agent holding a job"
    );
}

/// The logic of the Slurm test of the same name (`tests/budget.rs`), on the
/// site's clock.
#[test]
fn a_missed_epilog_ends_the_job_by_its_processes_and_returns_its_gpus() {
    let budget_w = 3000.0;
    let mut site = site(budget_w, 10);
    two_jobs(&mut site, "flex3,calibrate=off", vec![Phase::train(TRAIN)]);
    assert!(
        site.run_until(30_000, |s| s
            .node_caps_w(0)
            .iter()
            .all(|&c| c < DEFAULT_CAP_W)),
        "n1's GPUs capped"
    );
    site.end_job("a", true);
    site.run_for(1_000);
    let holds = |s: &Site| {
        s.agent_status(0)
            .is_some_and(|a| a.jobs.iter().any(|j| j.job == "a"))
    };
    assert!(
        holds(&site),
        "no epilog arrived: the agent still holds the job"
    );
    let ended = site.now_ms();
    assert!(
        site.run_until(90_000, |s| !holds(s)
            && s.node_caps_w(0).iter().all(|&c| c == DEFAULT_CAP_W)),
        "the job ended by the process scan, its GPUs back at default"
    );
    println!(
        "missed epilog: ended {:.1} s after the job's end",
        (site.now_ms() - ended) as f64 / 1000.0
    );
    let watch = site.watch_for(3_000, METER_TOLERANCE);
    assert!(watch.over_s == 0.0, "after the missed epilog: {watch}");
    assert!(running(&site, "b"), "powerflex kills no job");
    assert!(
        site.ends_clean(60_000),
        "the jobs end clean: every GPU back at its default, no agent holding a job"
    );
}
