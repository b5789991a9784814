//! Caps written, held and restored: observe mode, degraded GPUs, standalone budgets,
//! limits changed behind the agent's back, reloads.

use super::*;
use powerflex_proto::point::from_array;

#[test]
fn observe_mode_writes_no_limit_and_shows_what_it_would_write() {
    let mut s = settings(None);
    s.enforce = false;
    let mut a = Agent::with_defaults(s, (0..2).map(gpu).collect(), &BTreeMap::new(), 0.0);
    for g in 0..2 {
        a.sampled(0.0, g, reading(700.0, 650.0, 0, false));
    }
    a.register(1.0, "7", "0", 0, "n1", &["0".into()], "flex3")
        .expect("registered");
    a.set_lease(
        1.0,
        BTreeMap::from([("7".to_string(), Watts(450.0))]),
        30.0,
        None,
    );
    assert!(caps(&a.tick(1.0)).is_empty(), "no limit written");
    let snap = a.snapshot(1.0);
    assert!(!snap.enforce);
    // What NVML said, for comparison with NVML's other clients (scripts/gpu-observe.sh).
    assert_eq!(
        (snap.gpus[0].min_w, snap.gpus[0].max_w),
        (Some(200.0), Some(700.0))
    );
    assert_eq!(snap.gpus[0].power_throttled, Some(false));
    assert_eq!(snap.gpus[0].would_cap_w, Some(450.0));
    assert_eq!(snap.gpus[1].would_cap_w, Some(700.0));
    // Lease expiry, the fail-safe and a stop write nothing either.
    assert!(caps(&a.tick(100.0)).is_empty());
    assert!(a.stop_actions(true).is_empty());
    // One reload switches to enforcing.
    let mut on = settings(None);
    on.enforce = true;
    a.reload(Ok(on)).expect("reload");
    a.set_lease(
        101.0,
        BTreeMap::from([("7".to_string(), Watts(450.0))]),
        30.0,
        None,
    );
    assert_eq!(caps(&a.tick(101.0)), vec![(0, 450.0)]);
}

#[test]
fn caps_are_written_once_and_restored_at_job_end() {
    let mut a = agent(None);
    // Nothing to do at the start: every GPU already at its default.
    assert!(caps(&a.tick(1.0)).is_empty());
    a.register(1.0, "7", "0", 0, "n1", &["0".into(), "1".into()], "flex3")
        .expect("registered");
    // Lease arrives: job 7 at 450 W on both GPUs, in one go.
    a.set_lease(
        2.0,
        BTreeMap::from([("7".to_string(), Watts(450.0))]),
        30.0,
        None,
    );
    let first = caps(&a.tick(2.0));
    assert_eq!(first, vec![(0, 450.0), (1, 450.0)]);
    for (g, c) in first {
        a.cap_written(0.0, g, Watts(c), None);
    }
    assert!(caps(&a.tick(3.0)).is_empty(), "written only on change");
    assert!(a.end_job("7", 0.0));
    assert_eq!(caps(&a.tick(4.0)), vec![(0, 700.0), (1, 700.0)]);
    assert!(!a.end_job("7", 0.0), "ending twice is harmless");
}

#[test]
fn degraded_gpus_are_left_alone() {
    let mut a = agent(None);
    a.register(0.0, "7", "0", 0, "n1", &["0".into(), "1".into()], "flex3")
        .expect("registered");
    a.sampled(
        0.0,
        1,
        Err(GpuError {
            index: 1,
            class: ErrorClass::DeviceLost,
            message: "GPU is lost".into(),
        }),
    );
    a.set_lease(
        1.0,
        BTreeMap::from([("7".to_string(), Watts(400.0))]),
        30.0,
        None,
    );
    assert_eq!(caps(&a.tick(1.0)), vec![(0, 400.0)]);
    assert!(a.snapshot(1.0).degraded);
    a.sampled(
        0.0,
        2,
        Err(GpuError {
            index: 2,
            class: ErrorClass::Transient,
            message: "timeout".into(),
        }),
    );
    assert!(
        a.gpus[2].degraded.is_none(),
        "a transient error does not degrade"
    );
    // The lost GPU answers again (a probe): it is managed again, from the limit it
    // reads, and gets the job's cap.
    a.sampled(
        0.0,
        1,
        Ok(GpuSample {
            power: Watts(650.0),
            cap: Watts(700.0),
            ..a.gpus[0].last.expect("a sample of GPU 0")
        }),
    );
    assert!(a.gpus[1].degraded.is_none());
    assert!(caps(&a.tick(2.0)).contains(&(1, 400.0)));
}

#[test]
fn standalone_budget_is_shared_and_unmanaged_jobs_untouched() {
    let mut a = agent(Some(Watts(2000.0)));
    a.register(
        0.0,
        "7",
        "0",
        0,
        "n1",
        &["0".into(), "1".into()],
        "flex3,calibrate=off",
    )
    .expect("managed");
    a.register(0.0, "8", "0", 0, "n1", &["2".into()], "none")
        .expect("unmanaged");
    let decided = caps(&a.tick(1.0));
    // GPUs 2 (unmanaged) and 3 (idle) draw 650 W each: 700 W left for job 7's two GPUs.
    assert!(
        decided.iter().all(|&(g, _)| g == 0 || g == 1),
        "{decided:?}"
    );
    let cap = decided[0].1;
    assert!((200.0..=350.0).contains(&cap), "{decided:?}");
    assert_eq!(decided[0].1, decided[1].1);
}

/// Seen: 1,831 W on a 1,500 W node after a walk from 500 W. A curve walked from a
/// grant down is flat above its top, and the allocation took a cap above the walk
/// for the power measured at its top: a cap rises above the walk only where the
/// budget pays for what the GPUs may then draw.
#[test]
fn a_curve_walked_from_a_grant_down_lets_no_cap_rise_on_a_guess() {
    // GPUs 2 and 3 idle at 650 W each: 1,100 W of 2,400 W left for job 7's two GPUs.
    let mut a = agent(Some(Watts(2400.0)));
    a.register(
        0.0,
        "7",
        "0",
        0,
        "n1",
        &["0".into(), "1".into()],
        "flex3,calibrate=off",
    )
    .expect("managed");
    // Walked from 500 W down: 960 W at 500 W, speed rising to it.
    let walked = [
        [500.0, 960.0, 100.0],
        [400.0, 780.0, 90.0],
        [300.0, 590.0, 75.0],
    ];
    a.jobs
        .get_mut("7")
        .expect("7")
        .calibration
        .restore(&walked.map(from_array));
    let decided = caps(&a.tick(1.0));
    let cap = decided
        .iter()
        .find(|&&(g, _)| g == 0)
        .map(|&(_, c)| c)
        .expect("job 7 capped");
    assert_eq!(decided.iter().filter(|&&(g, _)| g == 1).count(), 1);
    // Above the walk its GPUs may draw up to the cap each: from 960 W at 500 W to
    // 1,400 W at 700 W. 1,100 W pays for no more than ~563 W.
    let bound_w = |c: f64| 960.0 + (c - 500.0) / 200.0 * 440.0;
    assert!(
        cap >= 500.0,
        "the budget pays for the walk's top: {decided:?}"
    );
    assert!(
        bound_w(cap) <= 1100.0,
        "a cap above what the budget pays: {decided:?}"
    );
}

/// A limit changed by `nvidia-smi -pl`, a GPU reset or a second agent is noticed: the
/// agent compares what the GPU reads back, not only its own last write.
#[test]
fn a_limit_changed_behind_the_agents_back_is_found_counted_and_written_again() {
    let mut a = job_7_capped_at_450();
    a.cap_written(0.0, 0, Watts(450.0), None);
    let sample = a.gpus[0].last.expect("a sample of GPU 0");
    let same = a.sampled(
        0.0,
        0,
        Ok(GpuSample {
            cap: Watts(450.0),
            ..sample
        }),
    );
    assert_eq!(same, None);
    let found = a.sampled(
        0.0,
        0,
        Ok(GpuSample {
            cap: Watts(700.0),
            ..sample
        }),
    );
    assert_eq!(
        found,
        Some(CapMismatch {
            gpu: 0,
            expected: Watts(450.0),
            found: Watts(700.0)
        })
    );
    assert_eq!(a.cap_mismatches, 1);
    assert_eq!(a.snapshot(2.0).cap_mismatches, 1);
    assert_eq!(caps(&a.tick(2.0)), vec![(0, 450.0)], "written again");
    a.cap_written(0.0, 0, Watts(450.0), None);
    // An idle GPU reset to another limit goes back to its default too.
    let idle = a.gpus[3].last.expect("a sample of GPU 3");
    assert!(a
        .sampled(
            0.0,
            3,
            Ok(GpuSample {
                cap: Watts(300.0),
                ..idle
            })
        )
        .is_some());
    assert_eq!(caps(&a.tick(3.0)), vec![(3, 700.0)]);
}

/// Seen in a clean-clone run: a new grant was written between the change behind the
/// agent's back and the next sample, so the sample found the agent's own write and
/// the change was never counted.
#[test]
fn a_limit_changed_behind_the_agents_back_is_found_when_a_new_cap_is_written() {
    let mut a = job_7_capped_at_450();
    assert_eq!(
        a.cap_written(0.0, 0, Watts(450.0), Some(Watts(700.0))),
        None,
        "the default, read by the last sample"
    );
    a.set_lease(
        1.5,
        BTreeMap::from([("7".to_string(), Watts(500.0))]),
        30.0,
        None,
    );
    assert_eq!(caps(&a.tick(2.0)), vec![(0, 500.0)]);
    // The limit read just before writing 500 W: somebody set 700 W.
    assert_eq!(
        a.cap_written(0.0, 0, Watts(500.0), Some(Watts(700.0))),
        Some(CapMismatch {
            gpu: 0,
            expected: Watts(450.0),
            found: Watts(700.0)
        })
    );
    assert_eq!(a.cap_mismatches, 1);
    // The write itself is what the next sample must find.
    let sample = a.gpus[0].last.expect("a sample of GPU 0");
    let next = a.sampled(
        3.0,
        0,
        Ok(GpuSample {
            cap: Watts(500.0),
            ..sample
        }),
    );
    assert_eq!(next, None);
    // A limit that could not be read before the write counts nothing.
    assert_eq!(a.cap_written(0.0, 0, Watts(500.0), None), None);
    assert_eq!(a.cap_mismatches, 1);
}

#[test]
fn a_reload_keeps_the_node_and_mode_and_reports_a_refusal() {
    let mut a = agent(None);
    let mut new = a.settings.clone();
    new.failsafe_cap = Watts(250.0);
    new.node = "elsewhere".into();
    assert!(a.reload(Ok(new.clone())).is_ok());
    assert_eq!(a.settings.failsafe_cap, Watts(250.0));
    assert_eq!(
        a.settings.node, "n1",
        "the node is fixed for the agent's life"
    );
    new.node_budget = Some(Watts(1000.0));
    assert!(a.reload(Ok(new)).is_err(), "a mode switch needs a restart");
    assert!(a
        .reload(Err(MachineError::SiteConfig("bad file".into())))
        .is_err());
    assert_eq!(a.snapshot(0.0).config_error.as_deref(), Some("bad file"));
    assert_eq!(
        a.settings.failsafe_cap,
        Watts(250.0),
        "the settings in force stay"
    );
}

/// Another power manager (DPS, power steering, a BMC) that keeps lowering a GPU's limit
/// below the agent's is not fought: once is written back, three times within the window
/// and the agent stops writing that GPU, reports it held elsewhere (outside its job in
/// the controller's report, counted at the limit it reads), and takes it back once the
/// limit rises to the agent's cap. A raised limit is always written back.
#[test]
fn a_gpu_another_manager_keeps_lower_is_left_to_it_until_it_lets_go() {
    let mut a = job_7_capped_at_450();
    a.cap_written(0.0, 0, Watts(450.0), None);
    let sample = a.gpus[0].last.expect("a sample of GPU 0");
    let read = |a: &mut Agent, t: f64, cap: f64| {
        a.sampled(
            t,
            0,
            Ok(GpuSample {
                cap: Watts(cap),
                ..sample
            }),
        )
    };
    // Lowered to 300 W twice: written back each time.
    for t in [10.0, 20.0] {
        assert!(read(&mut a, t, 300.0).is_some());
        assert_eq!(caps(&a.tick(t)), vec![(0, 450.0)], "written back at {t} s");
        a.cap_written(t, 0, Watts(450.0), None);
        assert!(read(&mut a, t + 0.5, 450.0).is_none());
    }
    assert!(!a.snapshot(25.0).gpus[0].owned_elsewhere);
    // The third time within two minutes: left at 300 W, and saved so.
    assert!(read(&mut a, 30.0, 300.0).is_some());
    let acts = a.tick(30.0);
    assert!(caps(&acts).is_empty(), "not fought");
    assert!(acts.contains(&Action::Persist), "{acts:?}");
    let uuid = a.gpus[0].identity.uuid.clone();
    let saved = a.saved_state();
    assert_eq!(saved.owned_elsewhere.get(&uuid), Some(&Watts(300.0)));
    // A restarted agent leaves it alone from its first tick (no fight three times more).
    let mut again = Agent::new(settings(None), (0..4).map(gpu).collect(), 250, UnixMs(0));
    again.step(
        UnixMs(40_000),
        vec![AgentInput::Start(Box::new(StartFacts {
            saved: Some(saved),
            samples: (0..4)
                .map(|g| (g, sample_at(if g == 0 { 300.0 } else { 700.0 })))
                .collect(),
            jobs_on_host: None,
            ..StartFacts::default()
        }))],
    );
    assert!(again.snapshot(40.0).gpus[0].owned_elsewhere);
    again.set_lease(
        41.0,
        BTreeMap::from([("7".to_string(), Watts(450.0))]),
        30.0,
        None,
    );
    assert!(
        caps(&again.tick(41.0)).iter().all(|&(g, _)| g != 0),
        "GPU 0 not written after the restart"
    );
    assert!(caps(&a.tick(60.0)).is_empty(), "still not fought");
    let snap = a.snapshot(60.0);
    assert!(snap.gpus[0].owned_elsewhere);
    assert_eq!(snap.gpus_owned_elsewhere, 1);
    // The controller's report steers none of job 7's GPUs (its one GPU is held
    // elsewhere), and counts GPU 0 at the 300 W it reads, not its draw.
    let report = powerflex_proto::report::NodeReport::of(&snap, 0);
    let job = report.jobs.iter().find(|j| j.job_id == "7").expect("job 7");
    assert_eq!((job.gpus, job.power_w), (0, None), "{job:?}");
    let others_w: f64 = snap.gpus[1..].iter().filter_map(|g| g.power_w).sum();
    assert!(
        (report.power_w - others_w - 300.0).abs() < 1e-6,
        "{report:?}"
    );
    // The other manager lets go (the limit back at its default): taken back, first at
    // the 300 W the controller counted it at (it gave the rest to other jobs), then, two
    // leases on, at the agent's cap.
    assert!(read(&mut a, 90.0, 700.0).is_some(), "a change from 300 W");
    assert_eq!(
        caps(&a.tick(90.0)),
        vec![(0, 300.0)],
        "taken back, at 300 W"
    );
    assert!(!a.snapshot(90.0).gpus[0].owned_elsewhere);
    a.cap_written(90.0, 0, Watts(300.0), None);
    for t in [91.0, 92.0] {
        a.set_lease(
            t,
            BTreeMap::from([("7".to_string(), Watts(450.0))]),
            30.0,
            None,
        );
    }
    assert_eq!(caps(&a.tick(92.0)), vec![(0, 450.0)], "two leases on");
    // Raised behind its back, a GPU is written back however often that happens.
    a.cap_written(92.0, 0, Watts(450.0), None);
    for t in [100.0, 110.0, 120.0, 130.0] {
        assert!(read(&mut a, t, 700.0).is_some());
        assert_eq!(caps(&a.tick(t)), vec![(0, 450.0)], "a raise is never kept");
        a.cap_written(t, 0, Watts(450.0), None);
        read(&mut a, t + 0.5, 450.0);
    }
    assert!(!a.snapshot(130.0).gpus[0].owned_elsewhere);
}
