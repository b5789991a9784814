//! Leases, their epochs, their expiry and the fail-safe.

use super::*;
use powerflex_proto::point::from_array;

/// Fencing: an agent keeps the highest controller epoch it accepted a
/// lease from, refuses a lease from a lower one (typed, for the link to tell that
/// controller) without touching a cap, and keeps refusing it after a restart.
#[test]
fn a_lease_from_a_lower_epoch_is_refused_and_a_restart_keeps_refusing_it() {
    let mut a = started_with(None);
    let out = a.step(UnixMs(1_000), vec![lease_of_epoch(450.0, 3)]);
    assert_eq!(out.replies, vec![(0, Reply::Lease(Ok(())))]);
    let written: Vec<(u32, f64)> = out.cap_writes.iter().map(|w| (w.gpu, w.cap.0)).collect();
    assert_eq!(written, vec![(0, 450.0), (1, 450.0)]);
    for w in &out.cap_writes {
        a.cap_written(0.0, w.gpu, w.cap, None);
    }
    // The old leader, still running, sends a higher cap: refused, nothing written.
    let out = a.step(UnixMs(2_000), vec![lease_of_epoch(700.0, 2)]);
    assert_eq!(
        out.replies,
        vec![(
            0,
            Reply::Lease(Err(LeaseRefused::StaleEpoch {
                lease_epoch: 2,
                accepted_epoch: 3
            }))
        )]
    );
    assert!(out.cap_writes.is_empty(), "{:?}", out.cap_writes);
    assert_eq!(
        a.lease.as_ref().map(|l| l.caps.get("7").copied()),
        Some(Some(Watts(450.0)))
    );
    assert_eq!(a.snapshot(2.0).leases_refused_epoch, 1);
    // The same epoch goes on steering; a later one takes over.
    let out = a.step(
        UnixMs(3_000),
        vec![lease_of_epoch(440.0, 3), lease_of_epoch(430.0, 5)],
    );
    assert_eq!(
        out.replies,
        vec![(0, Reply::Lease(Ok(()))), (1, Reply::Lease(Ok(())))]
    );
    let saved = out.persist.expect("the new epoch is saved");
    assert_eq!(saved.controller_epoch, 5);
    assert_eq!(a.snapshot(3.0).controller_epoch, 5);
    // A restart from the saved state still refuses epoch 3.
    let mut b = started_with(Some(saved));
    let out = b.step(UnixMs(4_000), vec![lease_of_epoch(700.0, 3)]);
    assert!(matches!(
        out.replies.as_slice(),
        [(
            0,
            Reply::Lease(Err(LeaseRefused::StaleEpoch {
                accepted_epoch: 5,
                ..
            }))
        )]
    ));
    assert!(out.cap_writes.is_empty());
    // A single controller's agent (epoch 0 throughout) saves no epoch at all.
    let mut c = started_with(None);
    let out = c.step(UnixMs(1_000), vec![lease_of_epoch(450.0, 0)]);
    assert_eq!(out.replies, vec![(0, Reply::Lease(Ok(())))]);
    let text = serde_json::to_string(&out.persist.expect("saved")).expect("json");
    assert!(!text.contains("controller_epoch"), "{text}");
}

/// A lease message is applied whole, at once: its caps come back as writes (the
/// controller waits for this node's decreases), the event flag and the jobs that may
/// be probed are taken, and it is counted.
#[test]
fn a_lease_message_is_applied_at_once() {
    let mut a = agent(None);
    a.register(
        0.0,
        "7",
        "0",
        0,
        "n1",
        &["0".into(), "1".into()],
        "flex2,calibrate=off",
    )
    .expect("registered");
    let written = caps(&a.tick(1.0));
    for (g, c) in written {
        a.cap_written(0.0, g, Watts(c), None);
    }
    let actions = a.apply_lease(
        2.0,
        LeaseMessage {
            caps: BTreeMap::from([("7".to_string(), Watts(450.0))]),
            ttl_s: 30.0,
            start_cap: Some(Watts(500.0)),
            recalibrate: vec!["7".into()],
            learn: vec!["7".into()],
            next_event_in_s: None,
            event_in_force: true,
            epoch: 0,
        },
    );
    assert_eq!(caps(&actions), vec![(0, 450.0), (1, 450.0)]);
    assert!(a.event_in_force);
    assert!(a.learn.contains("7"));
    assert_eq!(a.leases_applied, 1);
    assert_eq!(
        a.lease.as_ref().map(|l| (l.expires_at, l.start_cap)),
        Some((32.0, Some(Watts(500.0))))
    );
}

/// A job the lease does not name yet runs at the lease's start cap or the fail-safe, but
/// never below the cap the chord shows safe for its tier: flex2 (25 %) on 200-700 W
/// GPUs runs at least 575 W, flex3 (50 %) at least 450 W, flex0 uncapped.
#[test]
fn a_job_the_lease_does_not_cover_starts_at_a_cap_its_tier_holds() {
    let mut a = agent(None);
    a.set_lease(1.0, BTreeMap::new(), 3600.0, Some(Watts(300.0)));
    for (gpu, tier, cap) in [
        ("0", "flex3", 450.0),
        ("1", "flex2", 575.0),
        ("2", "flex1", 650.0),
        ("3", "flex0", 700.0),
    ] {
        let id = format!("job-{gpu}");
        a.register(
            2.0,
            &id,
            "0",
            0,
            "n1",
            &[gpu.into()],
            &format!("{tier},calibrate=off"),
        )
        .expect("registered");
        let granted = a.granted_cap(3.0, &a.jobs[&id]).expect("managed");
        assert_eq!(granted, Watts(cap), "{tier}");
        let slowdown_bound = (700.0 - cap) / (700.0 - 200.0);
        let tier_bound = a.jobs[&id].calibration.bound.expect("bounded");
        assert!(slowdown_bound <= tier_bound + 1e-12, "{tier}");
    }
    // A start cap above the tier's safe cap is kept.
    a.set_lease(4.0, BTreeMap::new(), 3600.0, Some(Watts(480.0)));
    assert_eq!(a.granted_cap(5.0, &a.jobs["job-0"]), Some(Watts(480.0)));
    // The controller away (the lease run out): the fail-safe is the site's word on
    // power and stands, for a job named or not.
    assert_eq!(
        a.granted_cap(3700.0, &a.jobs["job-1"]),
        Some(Watts(480.0)),
        "the start cap, held to the fail-safe"
    );
    let mut b = agent(None);
    b.register(0.0, "9", "0", 0, "n1", &["0".into()], "flex2,calibrate=off")
        .expect("registered");
    b.set_lease(
        1.0,
        BTreeMap::from([("9".to_string(), Watts(600.0))]),
        10.0,
        None,
    );
    assert_eq!(b.granted_cap(20.0, &b.jobs["9"]), Some(Watts(500.0)));
}

#[test]
fn a_job_the_lease_does_not_cover_runs_at_the_failsafe_cap() {
    let mut a = agent(None);
    a.register(0.0, "7", "0", 0, "n1", &["0".into()], "flex2,calibrate=off")
        .expect("registered");
    a.set_lease(
        1.0,
        BTreeMap::from([("7".to_string(), Watts(600.0))]),
        3600.0,
        None,
    );
    assert_eq!(caps(&a.tick(2.0)), vec![(0, 600.0)]);
    a.cap_written(0.0, 0, Watts(600.0), None);
    // Job 8 starts after the lease (the controller is away): not uncapped.
    a.register(3.0, "8", "0", 0, "n1", &["1".into()], "flex3,calibrate=off")
        .expect("registered");
    assert_eq!(caps(&a.tick(4.0)), vec![(1, 500.0)]);
}

#[test]
fn lease_expiry_brings_the_failsafe_cap() {
    let mut a = agent(None);
    a.register(0.0, "7", "0", 0, "n1", &["2".into()], "flex3,calibrate=off")
        .expect("registered");
    assert_eq!(
        caps(&a.tick(10.0)),
        vec![(2, 500.0)],
        "no cap granted yet: the fail-safe cap, not the GPU's maximum"
    );
    assert!(
        !a.failsafe_active(10.0),
        "the link itself is not yet overdue"
    );
    a.cap_written(0.0, 2, Watts(500.0), None);
    assert!(
        caps(&a.tick(31.0)).is_empty(),
        "no lease within the TTL: still fail-safe"
    );
    assert!(a.failsafe_active(31.0));
    a.cap_written(0.0, 2, Watts(500.0), None);
    a.set_lease(
        40.0,
        BTreeMap::from([("7".to_string(), Watts(600.0))]),
        3600.0,
        None,
    );
    assert_eq!(caps(&a.tick(41.0)), vec![(2, 600.0)]);
    a.cap_written(0.0, 2, Watts(600.0), None);
    assert_eq!(
        caps(&a.tick(71.0)),
        vec![(2, 500.0)],
        "lease over: fail-safe again"
    );
}

/// Two jobs cut below the fail-safe must not go back up to it when the controller
/// dies: the site would go over its budget.
#[test]
fn the_failsafe_never_raises_a_cap() {
    let mut a = agent(None);
    a.register(0.0, "7", "0", 0, "n1", &["0".into()], "flex3,calibrate=off")
        .expect("registered");
    a.set_lease(
        1.0,
        BTreeMap::from([("7".to_string(), Watts(250.0))]),
        30.0,
        None,
    );
    assert_eq!(caps(&a.tick(2.0)), vec![(0, 250.0)]);
    a.cap_written(0.0, 0, Watts(250.0), None);
    assert!(
        caps(&a.tick(40.0)).is_empty(),
        "lease over: stays at 250 W, below the 500 W fail-safe"
    );
    assert!(a.failsafe_active(40.0));
    // A grant above the fail-safe still falls to it.
    a.set_lease(
        41.0,
        BTreeMap::from([("7".to_string(), Watts(650.0))]),
        30.0,
        None,
    );
    assert_eq!(caps(&a.tick(42.0)), vec![(0, 650.0)]);
    a.cap_written(0.0, 0, Watts(650.0), None);
    assert_eq!(caps(&a.tick(80.0)), vec![(0, 500.0)]);
}

/// A job starting during a cut starts at the lease's start cap, or at its tier's safe
/// cap when that is higher (flex3 on 200-700 W GPUs: 450 W) while the controller is
/// there.
#[test]
fn a_job_starting_during_a_cut_starts_at_the_leases_start_cap() {
    let mut a = agent(None);
    a.set_lease(0.0, BTreeMap::new(), 30.0, Some(Watts(300.0)));
    a.register(1.0, "8", "0", 0, "n1", &["1".into()], "flex3,calibrate=off")
        .expect("registered");
    assert_eq!(caps(&a.tick(2.0)), vec![(1, 450.0)]);
    a.cap_written(0.0, 1, Watts(450.0), None);
    assert_eq!(
        caps(&a.tick(40.0)),
        vec![(1, 300.0)],
        "the lease lapsed: the controller is away, and the start cap stands"
    );
    a.cap_written(0.0, 1, Watts(300.0), None);
    // A start cap above the fail-safe is held to it.
    a.set_lease(41.0, BTreeMap::new(), 30.0, Some(Watts(650.0)));
    assert_eq!(caps(&a.tick(42.0)), vec![(1, 500.0)]);
    // Nonsense in a lease is ignored, never applied.
    a.set_lease(
        43.0,
        BTreeMap::from([("8".to_string(), Watts(f64::NAN))]),
        30.0,
        Some(Watts(-1.0)),
    );
    a.cap_written(0.0, 1, Watts(500.0), None);
    assert!(caps(&a.tick(44.0)).is_empty());
}

/// A job whose measurements left its curve during a cut is not left on that curve until
/// the cut ends: its old windows are set aside at once, its walk starts within the rate
/// limit (here at once: its curve came from a previous run), and the walk goes below the
/// grant only as far as the chord shows its bound held against uncapped.
#[test]
fn a_repeated_walk_asked_during_a_cut_is_never_refused() {
    let mut a = agent(None);
    a.register(1.0, "7", "0", 0, "n1", &["0".into(), "1".into()], "flex2")
        .expect("registered");
    // Walked before (as after a restart): its calibration is done.
    a.jobs
        .get_mut("7")
        .expect("job")
        .calibration
        .restore(&[[700.0, 1300.0, 1000.0], [500.0, 1000.0, 900.0]].map(from_array));
    a.jobs.get_mut("7").expect("job").restored_pfi = Some(1.2);
    a.set_lease(
        2.0,
        BTreeMap::from([("7".to_string(), Watts(450.0))]),
        30.0,
        None,
    );
    assert_eq!(
        a.recalibrate(3.0, &["7".to_string()]),
        [("7".to_string(), 3.0)],
        "during a cut, at once"
    );
    let job = &a.jobs["7"];
    assert!(job.calibration.remeasuring());
    assert!(
        job.curve().is_empty(),
        "the old phase's curve is not planned on"
    );
    assert_eq!(job.restored_pfi, None);
    assert!(
        a.recalibrate(4.0, &["7".to_string()]).is_empty(),
        "asked again while walking: nothing new"
    );
    let view = a.snapshot(5.0);
    let seen = view.jobs.iter().find(|j| j.job == "7").expect("job");
    assert!(seen.calibrating && seen.points.is_empty() && seen.pfi.is_none());
}

/// The lease's `walk_to_w`, as the edge hands it over before the lease: a finished curve
/// above the event's cap is extended down to it (never below the GPUs' lowest cap); a
/// job the agent does not know is ignored.
#[test]
fn an_event_needing_lower_caps_extends_the_named_jobs_walks() {
    let mut a = agent(None);
    a.register(1.0, "7", "0", 0, "n1", &["0".into()], "flex3")
        .expect("registered");
    a.jobs
        .get_mut("7")
        .expect("job")
        .calibration
        .restore(&[[700.0, 650.0, 1000.0], [600.0, 580.0, 950.0]].map(from_array));
    let out = a.step(
        UnixMs(2_000),
        vec![AgentInput::PrePosition(BTreeMap::from([
            ("7".to_string(), Watts(100.0)),
            ("unknown".to_string(), Watts(300.0)),
        ]))],
    );
    assert!(out.snapshot.is_some(), "status shows the walk");
    let cal = &a.jobs["7"].calibration;
    assert_eq!(cal.reach, Some(Watts(200.0)), "the GPUs' lowest cap");
    assert!(
        cal.is_active() && cal.best_curve().is_some(),
        "{:?}",
        cal.phase
    );
}

/// A new step of a job with a curve puts the curve in question at once (the status and
/// the report-at-once counter say so); the same step registering again, a step of a job
/// still walking, and an unmanaged job's step do not.
#[test]
fn a_new_step_of_a_walked_job_puts_its_curve_in_question_at_once() {
    let mut a = agent(None);
    a.register(1.0, "7", "batch", 0, "n1", &["0".into()], "flex2")
        .expect("registered");
    a.register(1.5, "7", "0", 0, "n1", &["0".into()], "flex2")
        .expect("registered");
    assert_eq!(
        a.curve_questions, 0,
        "a job being walked has no curve to doubt"
    );
    a.jobs
        .get_mut("7")
        .expect("job")
        .calibration
        .restore(&[[700.0, 650.0, 1000.0], [500.0, 500.0, 900.0]].map(from_array));
    a.register(2.0, "7", "0", 0, "n1", &["0".into()], "flex2")
        .expect("registered again");
    assert_eq!(a.curve_questions, 0, "the same step again is no new step");
    a.register(3.0, "7", "1", 0, "n1", &["0".into()], "flex2")
        .expect("registered");
    assert_eq!(a.curve_questions, 1);
    let view = a.snapshot(3.5);
    assert_eq!(view.curve_questions, 1);
    let seen = view.jobs.iter().find(|j| j.job == "7").expect("job");
    assert!(seen.curve_in_question && !seen.calibrating);
    assert!(!seen.points.is_empty(), "its curve is kept meanwhile");
    // Another step while in question counts once.
    a.register(4.0, "7", "2", 0, "n1", &["0".into()], "flex2")
        .expect("registered");
    assert_eq!(a.curve_questions, 1);
    // An unmanaged job has no curve to doubt.
    a.register(5.0, "8", "0", 0, "n1", &["1".into()], "none")
        .expect("registered");
    a.register(6.0, "8", "1", 0, "n1", &["1".into()], "none")
        .expect("registered");
    assert_eq!(a.curve_questions, 1);
}
