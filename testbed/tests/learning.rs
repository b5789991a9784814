//! Learning in operation, closed loop on a local Slurm cluster with SIMULATED GPUs: a job
//! with a real measured shape (a table profile from the Zeus dev set, scaled to H200) is
//! calibrated by the design, then held through two grid events. Each event's steady hold
//! (and the agent's probes one cap step below the grant) become measurement windows of
//! the job's curve; `powerflexctl report` shows the curve after calibration and after
//! each event — more points and windows, and a smaller uncertainty where the events held
//! the job.

use std::time::{Duration, Instant};

use powerflex_proto::status::{CalibrationState, CurvePoint, SiteJobStatus, SnapshotAfter};
use powerflex_testbed::needs::{can_run, Need};
use powerflex_testbed::stack::{Stack, StackOptions};
use powerflex_testbed::wait_until;

/// Real shape: BERT fine-tuning on RTX6000, measured by Zeus (NSDI'23) in 25 W steps.
const PROFILE: &str = "real-rtx6000-squad-bert-base-uncased-bs16-adamw";
const BUDGET_W: f64 = 3000.0;
/// An event's target: about four fifths of the job's uncapped draw.
const EVENT_TARGET_W: f64 = 2000.0;

fn report(stack: &Stack, job: u32) -> Option<SiteJobStatus> {
    stack.ctl_json::<SiteJobStatus>(&["report", "--job", &job.to_string()])
}

/// Holds an event for `hold_s` and waits until the controller snapshotted the job's
/// curve after it (`after` = "event <id>").
fn event(stack: &Stack, job: u32, id: u64, hold_s: u64) {
    stack
        .try_ctl(&[
            "event",
            "add",
            "--target",
            &format!("{EVENT_TARGET_W}W"),
            "--start",
            "now",
            "--duration",
            &format!("{hold_s}s"),
            "--ramp",
            "2s",
        ])
        .unwrap_or_else(|e| panic!("{e}"));
    wait_until(
        "the event's cap on the job",
        Duration::from_secs(30),
        || {
            report(stack, job)
                .and_then(|r| r.cap_w)
                .filter(|c| *c < 690.0)
        },
    );
    let after = SnapshotAfter::Event(id);
    wait_until(
        "the curve snapshot after the event",
        Duration::from_secs(hold_s + 60),
        || {
            report(stack, job)
                .filter(|r| r.curve_history.iter().any(|s| s.after == after))
                .map(|_| ())
        },
    );
}

fn at(points: &[CurvePoint], cap_w: f64) -> Option<CurvePoint> {
    points
        .iter()
        .copied()
        .find(|p| (p.cap_w - cap_w).abs() < 0.5)
}

#[test]
fn a_real_shaped_jobs_curve_improves_over_two_events() {
    if !can_run(&[Need::Root, Need::Slurm]) {
        return;
    }
    let mut stack = Stack::start(
        "learning",
        StackOptions {
            nodes: 1,
            gpus_per_node: 4,
            budget_w: BUDGET_W,
            ..StackOptions::default()
        },
    );
    let job = stack.submit("flex3", 1, 4, PROFILE);
    let started = Instant::now();
    let calibrated = wait_until("the job calibrated", Duration::from_secs(180), || {
        let status = stack.agent_status(0)?;
        let j = status.jobs.into_iter().find(|j| j.job == job.to_string())?;
        (j.calibration == CalibrationState::Done).then_some(j)
    });
    eprintln!(
        "calibrated in {:.0} s: {} points, cost {:?} % of first-hour tokens",
        started.elapsed().as_secs_f64(),
        calibrated.curve.len(),
        calibrated.calibration_cost_pct
    );
    let cost = calibrated.calibration_cost_pct.expect("cost priced");
    assert!(
        cost > 0.0 && cost <= 0.2 + 0.05,
        "the walk's cost {cost} % stays within the site's 0.2 % budget (its reserve covers noise)"
    );
    wait_until("the calibrated snapshot", Duration::from_secs(30), || {
        report(&stack, job).filter(|r| {
            r.curve_history
                .first()
                .is_some_and(|s| s.after == SnapshotAfter::Calibrated)
        })
    });

    event(&stack, job, 1, 45);
    event(&stack, job, 2, 45);
    let r = report(&stack, job).expect("report");
    let h = &r.curve_history;
    for s in h {
        eprintln!(
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
    // The table shows it.
    let text = stack
        .try_ctl(&["report", "--job", &job.to_string()])
        .unwrap_or_else(|e| panic!("{e}"));
    assert!(text.contains("curve over events"), "{text}");
    assert!(text.contains("event 2"), "{text}");
    eprintln!("{text}");
    stack.ends_clean(&[job], Duration::from_secs(30));
    stack.shutdown();
}
