//! Restarts: fail-static caps, saved jobs and unacknowledged final shares.

use super::*;

/// Fail-static: a restart during a cut below the fail-safe must not write the fail-safe
/// over the lower caps the previous run left, and a stop leaves every GPU at its limit.
#[test]
fn a_restart_raises_no_running_job_s_cap_until_a_current_lease_and_a_stop_keeps_them() {
    let mut a = Agent::with_defaults(
        settings(None),
        (0..4).map(gpu).collect(),
        &BTreeMap::new(),
        0.0,
    );
    // The previous run left GPUs 0 and 1 (job 7's) at 300 W, GPU 2 at 400 W with no
    // job left on it, GPU 3 at its default.
    for (g, cap) in [(0, 300.0), (1, 300.0), (2, 400.0), (3, 700.0)] {
        a.sampled(0.0, g, sample_at(cap));
    }
    a.register(
        0.0,
        "7",
        "0",
        0,
        "n1",
        &["0".into(), "1".into()],
        "flex2,calibrate=off",
    )
    .expect("restored");
    // Past the lease TTL with no lease: the fail-safe (500 W) would raise job 7.
    let set = caps(&a.tick(40.0));
    assert!(
        !set.iter().any(|&(g, _)| g < 2),
        "job 7 kept at 300 W: {set:?}"
    );
    assert!(
        set.contains(&(2, 700.0)),
        "a GPU of no job goes back to default: {set:?}"
    );
    // The previous run's lease, expired or not, from the state file: still no raise.
    a.set_lease(
        41.0,
        BTreeMap::from([("7".to_string(), Watts(600.0))]),
        0.0,
        None,
    );
    assert!(!caps(&a.tick(42.0)).iter().any(|&(g, _)| g < 2));
    a.restore_saved_lease(
        42.0,
        BTreeMap::from([("7".to_string(), Watts(600.0))]),
        20.0,
        None,
    );
    assert!(
        !caps(&a.tick(42.5)).iter().any(|&(g, _)| g < 2),
        "a saved lease is not current"
    );
    // A stop now writes nothing: every GPU keeps the limit in force.
    let stop = caps(&a.stop_actions(false));
    assert_eq!(stop, vec![]);
    assert_eq!(
        caps(&a.stop_actions(true)).len(),
        4,
        "--release-on-exit: all"
    );
    // A current lease decides: job 7 may rise.
    a.set_lease(
        43.0,
        BTreeMap::from([("7".to_string(), Watts(600.0))]),
        30.0,
        None,
    );
    let set = caps(&a.tick(44.0));
    assert!(
        set.contains(&(0, 600.0)) && set.contains(&(1, 600.0)),
        "{set:?}"
    );
}

/// A GPU whose limit could not be read at start (a transient NVML error): a managed
/// job on it gets no more than the fail-safe until a current lease; a GPU of no job
/// is not written until it is read.
#[test]
fn a_gpu_unread_at_start_is_held_to_the_failsafe_or_left_alone() {
    let mut a = Agent::with_defaults(
        settings(None),
        (0..4).map(gpu).collect(),
        &BTreeMap::new(),
        0.0,
    );
    let transient = |g| GpuError {
        index: g,
        class: ErrorClass::Transient,
        message: "timeout".into(),
    };
    for g in 0..4 {
        a.sampled(0.0, g, Err(transient(g)));
    }
    a.register(0.0, "7", "0", 0, "n1", &["0".into()], "flex2,calibrate=off")
        .expect("registered");
    let set = caps(&a.tick(1.0));
    assert_eq!(
        set,
        vec![(0, 500.0)],
        "job 7's GPU at the fail-safe, the idle ones untouched"
    );
}

/// A restart restores from what the previous run saved: a job whose step daemons
/// still run (by id and cluster) is managed again, with its tier and steps; one that
/// ended while the agent was down, or whose id now belongs to another cluster's job,
/// gets its final share and leaves its GPUs to go back to their defaults.
#[test]
fn a_restart_manages_the_saved_jobs_that_still_run_and_closes_the_others() {
    let mut before = agent(None);
    let conf = |c: &str| Some(format!("/etc/{c}/slurm.conf"));
    for (job, gpu, cluster) in [("1", "0", "a"), ("2", "1", "a"), ("3", "2", "b")] {
        before
            .register(
                0.0,
                job,
                "0",
                1000,
                "n1",
                &[gpu.into()],
                "flex2,calibrate=off",
            )
            .expect("registered");
        before.set_job_cluster(job, conf(cluster), 0.0);
    }
    let saved = before.saved_state();
    assert_eq!(saved.jobs.len(), 3);
    let mut after = agent(None);
    // Job 1 runs on; job 2 is gone; job 3's id now names a job of cluster "a".
    let live = BTreeSet::from([("1".to_string(), conf("a")), ("3".to_string(), conf("a"))]);
    after.restore_saved_jobs(5.0, 5.0, saved.jobs, &live, &BTreeSet::new());
    assert_eq!(after.jobs.keys().collect::<Vec<_>>(), ["1"]);
    assert_eq!(after.jobs["1"].cluster, Some(conf("a")));
    assert_eq!(after.jobs["1"].request.to_string(), "flex2,calibrate=off");
    let closed: BTreeSet<&str> = after
        .unacked
        .iter()
        .map(|u| u.share.job_id.as_str())
        .collect();
    assert_eq!(closed, BTreeSet::from(["2", "3"]));
    assert!(after.unacked.iter().all(|u| u.share.ended));
    // Their GPUs (1 and 2) belong to no job: the first tick leaves them at their
    // defaults (read back at 700 W here, so nothing to write).
    assert!(after.gpus[1].job.is_none() && after.gpus[2].job.is_none());
    let written = caps(&after.tick(6.0));
    assert!(
        !written.iter().any(|(g, _)| *g == 1 || *g == 2),
        "{written:?}"
    );
}

/// Review defect 5: final shares are kept until acknowledged (bounded in count and
/// age), and a job that ended while the agent was down gets one at the next start.
#[test]
fn unacknowledged_final_shares_are_bounded_and_a_job_ended_while_down_gets_one() {
    let mut a = agent(None);
    let mut b = agent(None);
    b.register(1000.0, "1", "0", 1, "n1", &["0".into()], "flex2")
        .expect("job");
    let base = b.share(&b.jobs["1"], true);
    for i in 0..(MAX_ENDED_KEPT + 3) {
        let mut s = base.clone();
        s.from_unix_ms = i as u64;
        a.keep_final(1001.0, s);
    }
    assert_eq!(a.unacked.len(), MAX_ENDED_KEPT, "the oldest dropped beyond");
    assert_eq!(a.unacked[0].share.from_unix_ms, 3);
    let day_s = (UNACKED_FINAL_MAX_AGE_MS / 1000) as f64;
    a.tick(1001.0 + day_s - 1.0);
    assert_eq!(a.unacked.len(), MAX_ENDED_KEPT, "within a day: kept");
    let actions = a.tick(1001.0 + day_s);
    assert!(a.unacked.is_empty(), "a day unacknowledged: dropped");
    assert!(
        actions.contains(&Action::Persist),
        "and the state saved without them"
    );

    // The previous run's job 7 held GPUs 0 and 1; the agent was down when it ended.
    let mut before = agent(None);
    before
        .register(
            1000.0,
            "7",
            "0",
            1000,
            "n1",
            &["0".into(), "1".into()],
            "flex2",
        )
        .expect("7");
    before.sampled(1001.0, 0, reading(700.0, 600.0, 1_000_000, false));
    before.sampled(1001.0, 1, reading(700.0, 600.0, 2_000_000, false));
    let usage = before.jobs["7"].usage.clone();
    // Restarted 100 s later: the counters ran on. GPU 1 now runs another job's
    // processes: its span is closed at its last persisted reading.
    let mut a = agent(None);
    a.sampled(1101.0, 0, reading(700.0, 100.0, 1_500_000, false));
    a.sampled(1101.0, 1, reading(700.0, 600.0, 9_000_000, false));
    let busy = BTreeSet::from([a.gpus[1].identity.uuid.clone()]);
    let share = a.ended_while_down(1101.0, "7", 1000, "flex2", &[], None, usage, &busy);
    assert!(share.ended);
    assert_eq!(share.energy_mj, 500_000, "GPU 0's advance; none of GPU 1's");
    assert_eq!(share.to_unix_ms, 1_101_000);
    assert_eq!(
        share.bound_pct,
        Some(25.0),
        "the tier's bound from its flex"
    );
    assert_eq!(a.unacked_finals(), vec![share.clone()]);
    assert_eq!(a.take_records(), vec![share]);
}

/// A start that cannot read the host's step daemons (a transient /proc error) keeps
/// every job the previous run saved, caps and all: treated as "no job runs", it would
/// release their GPUs to the default limit while they train. A later tick that reads
/// the table ends the jobs that are gone.
#[test]
fn a_start_that_cannot_read_the_step_daemons_keeps_the_saved_jobs() {
    let mut before = agent(None);
    before
        .register(
            0.0,
            "7",
            "0",
            1000,
            "n1",
            &["0".into()],
            "flex2,calibrate=off",
        )
        .expect("registered");
    before.set_job_cluster("7", Some("/etc/slurm/slurm.conf".into()), 0.0);
    let saved = before.saved_state();
    let start = |jobs_on_host: Option<BTreeSet<crate::JobKey>>| {
        let mut a = Agent::new(settings(None), (0..2).map(gpu).collect(), 250, UnixMs(0));
        a.step(
            UnixMs(0),
            vec![AgentInput::Start(Box::new(StartFacts {
                saved: Some(saved.clone()),
                samples: vec![(0, sample_at(300.0)), (1, sample_at(700.0))],
                jobs_on_host,
                ..StartFacts::default()
            }))],
        );
        a
    };
    let mut unread = start(None);
    assert_eq!(unread.jobs.keys().collect::<Vec<_>>(), ["7"]);
    assert_eq!(unread.gpus[0].job.as_deref(), Some("7"));
    assert!(
        unread.unacked.is_empty(),
        "no final share for a job that runs"
    );
    // The table read at last, without job 7, past the grace: it is ended, not held.
    let grace = unread.settings.job_end_grace_s;
    assert_eq!(unread.jobs_alive(grace + 1.0, &BTreeSet::new()), ["7"]);
    // Read and empty: the job ended while the agent was down.
    let read = start(Some(BTreeSet::new()));
    assert!(read.jobs.is_empty());
    assert_eq!(read.unacked.len(), 1);
}
