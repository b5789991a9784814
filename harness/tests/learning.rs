//! Port of `tests/learning.rs` (learning in operation) to the site harness: a job with a
//! real measured shape (a table profile from the Zeus dev set, scaled to H200) is
//! calibrated by the design, then held through two grid events. Each event's steady hold
//! (and the agent's probes one cap step below the grant) become measurement windows of
//! the job's curve; the controller's report shows the curve after calibration and after
//! each event — more points and windows, and a smaller uncertainty where the events held
//! the job. The site is the Slurm test's: one node of 4 GPUs, a 3000 W budget, a 10 s
//! lease, a one-second allocation period, agents sampling every 250 ms, calibration
//! windows of 1 s warm-up, 1 s settle and 2 s hold within 0.2 % of first-hour tokens.

// The tests print what they measured, as the Slurm tests do.
#![allow(clippy::disallowed_macros)]

use powerflex_proto::admin::AdminOp;
use powerflex_proto::event::Cut;
use powerflex_proto::status::{CalibrationState, CurvePoint, SiteJobStatus, SnapshotAfter};
use powerflex_site_harness::site::test_bed_site;
use powerflex_site_harness::site::{JobSpec, Site, SiteOptions};

/// Real shape: BERT fine-tuning on RTX6000, measured by Zeus (NSDI'23) in 25 W steps.
const PROFILE: &str = "real-rtx6000-squad-bert-base-uncased-bs16-adamw";
const BUDGET_W: f64 = 3000.0;
/// An event's target: about four fifths of the job's uncapped draw.
const EVENT_TARGET_W: f64 = 2000.0;
const JOB: &str = "1";
const DEFAULT_CAP_W: f64 = 700.0;

/// The controller's report on the job (`powerflexctl report --job`: the job's entry of
/// the status).
fn report(site: &Site) -> Option<SiteJobStatus> {
    site.controller_status()?
        .jobs
        .into_iter()
        .find(|j| j.job == JOB)
}

/// Holds an event for `hold_s` and runs until the controller snapshotted the job's curve
/// after it (`after` = "event <id>").
fn event(site: &mut Site, id: u64, hold_s: u64) {
    let reply = site
        .admin(AdminOp::EventAdd {
            cut: Cut::Target {
                budget_w: EVENT_TARGET_W,
            },
            start_ms: site.now_ms(),
            duration_ms: hold_s * 1000,
            ramp_ms: 2_000,
            domain: None,
        })
        .expect("reply");
    assert!(reply.is_ok(), "{reply:?}");
    assert_eq!(reply.event_id(), Some(id), "{reply:?}");
    assert!(
        site.run_until(30_000, |s| report(s)
            .and_then(|r| r.cap_w)
            .is_some_and(|c| c < 690.0)),
        "the event's cap on the job: {:?}",
        report(site).map(|r| r.cap_w)
    );
    let after = SnapshotAfter::Event(id);
    assert!(
        site.run_until((hold_s + 60) * 1000, |s| report(s)
            .is_some_and(|r| r.curve_history.iter().any(|c| c.after == after))),
        "the curve snapshot after event {id}: {:?}",
        report(site).map(|r| r.curve_history)
    );
}

fn at(points: &[CurvePoint], cap_w: f64) -> Option<CurvePoint> {
    points
        .iter()
        .copied()
        .find(|p| (p.cap_w - cap_w).abs() < 0.5)
}

/// Ports tests/learning.rs::a_real_shaped_jobs_curve_improves_over_two_events
#[test]
fn a_real_shaped_jobs_curve_improves_over_two_events() {
    let mut site = Site::new(SiteOptions {
        nodes: 1,
        gpus_per_node: 4,
        site: test_bed_site(BUDGET_W, 10),
        sample_interval_ms: 250,
        ..SiteOptions::new(23, BUDGET_W)
    })
    .expect("site");
    site.submit(JobSpec::training(JOB, "flex3", 0, 4, PROFILE))
        .expect("job");
    let started = site.now_ms();
    let done = |s: &Site| {
        s.agent_status(0).is_some_and(|a| {
            a.jobs
                .iter()
                .any(|j| j.job == JOB && j.calibration == CalibrationState::Done)
        })
    };
    assert!(site.run_until(180_000, done), "the job calibrated");
    let calibrated = site
        .agent_status(0)
        .expect("agent")
        .jobs
        .into_iter()
        .find(|j| j.job == JOB)
        .expect("job");
    println!(
        "calibrated in {:.0} s: {} points, cost {:?} % of first-hour tokens",
        (site.now_ms() - started) as f64 / 1000.0,
        calibrated.curve.len(),
        calibrated.calibration_cost_pct
    );
    let cost = calibrated.calibration_cost_pct.expect("cost priced");
    assert!(
        cost > 0.0 && cost <= 0.2 + 0.05,
        "the walk's cost {cost} % stays within the site's 0.2 % budget (its reserve covers noise)"
    );
    assert!(
        site.run_until(30_000, |s| report(s).is_some_and(|r| r
            .curve_history
            .first()
            .is_some_and(|c| c.after == SnapshotAfter::Calibrated))),
        "the calibrated snapshot"
    );

    event(&mut site, 1, 45);
    event(&mut site, 2, 45);
    // The report as `powerflexctl report` asks for it: the admin socket's status.
    let status = site
        .admin(AdminOp::Status)
        .and_then(|reply| reply.status().cloned())
        .expect("status");
    let r = status
        .jobs
        .into_iter()
        .find(|j| j.job == JOB)
        .expect("report");
    let h = &r.curve_history;
    for s in h {
        println!(
            "after {:<10} points {:>2} windows {:>3} mean ± {:.2} %  {:?}",
            s.after.to_string(),
            s.points.len(),
            s.windows(),
            100.0 * s.mean_relative_sigma(),
            s.points
                .iter()
                .map(|p| (p.cap_w, p.windows, p.throughput_sigma))
                .collect::<Vec<_>>()
        );
    }
    let names: Vec<SnapshotAfter> = h.iter().map(|s| s.after).collect();
    assert_eq!(
        names,
        [
            SnapshotAfter::Calibrated,
            SnapshotAfter::Event(1),
            SnapshotAfter::Event(2)
        ],
        "{h:?}"
    );
    let (cal, e1, e2) = (&h[0], &h[1], &h[2]);
    // Points grow: the event's grant (not a calibration cap) and its probes join.
    assert!(
        e1.points.len() > cal.points.len(),
        "points {} -> {}",
        cal.points.len(),
        e1.points.len()
    );
    // The event's grant: the new cap read most (probes below it get a few windows).
    let grant = e1
        .points
        .iter()
        .filter(|p| at(&cal.points, p.cap_w).is_none())
        .max_by_key(|p| p.windows)
        .map(|p| p.cap_w)
        .expect("a new point");
    assert!(grant < 700.0, "the event held the job at {grant} W");
    assert!(
        e1.points
            .iter()
            .any(|p| p.cap_w < grant && at(&cal.points, p.cap_w).is_none()),
        "a probe below the grant {grant} W: {:?}",
        e1.points
    );
    // Windows grow over each event.
    assert!(e1.windows() > cal.windows() && e2.windows() > e1.windows());
    // The second event held the job at the same cap: its windows shrink the uncertainty.
    let (p1, p2) = (
        at(&e1.points, grant).expect("point"),
        at(&e2.points, grant).expect("point"),
    );
    assert!(p2.windows > p1.windows, "{p1:?} -> {p2:?}");
    assert!(
        p2.throughput_sigma < p1.throughput_sigma,
        "uncertainty at {grant} W: {p1:?} -> {p2:?}"
    );
    // How `powerflexctl report --job` draws these snapshots as a table ("curve over
    // events") is the renderer's own unit test (controller/src/render.rs): the harness
    // links no I/O crate, not even for its tests.
    // The job ends clean: its GPUs back at their default, the agent and the controller
    // done with it.
    site.end_job(JOB, false);
    assert!(
        site.run_until(30_000, |s| s.caps_w().iter().all(|&c| c == DEFAULT_CAP_W)
            && s.agent_status(0).is_some_and(|a| a.jobs.is_empty())
            && report(s).is_none()),
        "the job ended clean: caps {:?}",
        site.caps_w()
    );
}
