//! Registrations, ends, GPU claims and adoption.

use super::*;

#[test]
fn registration_resolves_gpus_and_validates() {
    let mut a = agent(None);
    let uuid = a.gpus[3].identity.uuid.clone();
    let r = a
        .register(0.0, "7", "0", 1000, "n1", &["1".into(), uuid], "flex2")
        .expect("registered");
    assert_eq!(r.tier, "flex2");
    assert_eq!(r.progress.as_deref(), Some("/run/powerflex/n1.progress"));
    assert_eq!(a.jobs["7"].gpus, vec![1, 3]);
    assert_eq!(a.gpus[3].job.as_deref(), Some("7"));
    assert!(a
        .register(0.0, "8", "0", 0, "n2", &["0".into()], "flex2")
        .expect_err("wrong node")
        .to_string()
        .contains("serves node n1"));
    assert!(a
        .register(0.0, "8", "0", 0, "n1", &["9".into()], "flex2")
        .expect_err("no gpu")
        .to_string()
        .contains("no GPU 9"));
    assert!(a
        .register(0.0, "8", "0", 0, "n1", &["0".into()], "gold")
        .expect_err("tier")
        .to_string()
        .contains("unknown tier"));
    let none = a
        .register(0.0, "9", "0", 0, "n1", &["0".into()], "")
        .expect("default service");
    assert_eq!((none.tier.as_str(), none.progress), ("none", None));
}

/// The step the edge drives: a registration from a step daemon is capped before its
/// answer, and the status waits for the caps' results. Another job's processes already
/// on a GPU it names (a stray process, a debugger) do not take the GPU from it: Slurm
/// gave the GPU to this job, so it is registered, the GPU capped as the job is, and
/// the other job's use is foreign use, counted once and shown.
#[test]
fn a_registration_through_the_step_is_capped_then_answered_even_beside_another_job_s_process() {
    let mut a = agent(None);
    let register = |job: &str, gpu: &str| ControlOp::Register {
        job_id: job.into(),
        step_id: "0".into(),
        uid: 1000,
        node: "n1".into(),
        gpus: vec![gpu.into()],
        flex: "flex2,calibrate=off".into(),
    };
    let op = register("7", "0");
    let reads = a.control_reads(&op, true);
    assert_eq!(
        (reads.gpu_users.clone(), reads.samples.clone()),
        (vec![0], vec![0])
    );
    assert!(!reads.process_table, "no other job holds GPU 0");
    let facts = ControlFacts {
        stepd_cluster: Some(None),
        samples: vec![(0, sample_at(700.0))],
        gpu_users: BTreeMap::from([(0, BTreeSet::from([("9".to_string(), None)]))]),
        ..ControlFacts::default()
    };
    let out = a.step(UnixMs(1_000), vec![AgentInput::Control { op, facts }]);
    assert!(
        matches!(out.replies.as_slice(), [(0, Reply::Control(r))] if r.is_ok()),
        "registered: {:?}",
        out.replies
    );
    assert_eq!(
        out.cap_writes,
        vec![CapWrite {
            gpu: 0,
            cap: Watts(500.0)
        }],
        "capped as the job is (the fail-safe until a grant)"
    );
    assert_eq!(a.gpus[0].job.as_deref(), Some("7"));
    assert_eq!(a.gpu_foreign_use, 1);
    // The next process scan sees the same use: no second onset.
    assert!(a
        .check_gpu_use(1.5, &listing(&[(0, &["9", "7"])]))
        .is_empty());
    assert_eq!(a.gpu_foreign_use, 1);
    let status = a.snapshot(1.5);
    assert!(status.gpus[0].foreign_use);
    assert_eq!(status.gpus[0].foreign_jobs, ["9"]);
    a.step(
        UnixMs(1_600),
        vec![AgentInput::CapWrites(vec![CapWriteResult {
            gpu: 0,
            cap: Watts(500.0),
            outcome: Ok(Some(Watts(700.0))),
        }])],
    );

    let facts = ControlFacts {
        stepd_cluster: Some(None),
        samples: vec![(1, sample_at(700.0))],
        ..ControlFacts::default()
    };
    let out = a.step(
        UnixMs(2_000),
        vec![AgentInput::Control {
            op: register("8", "1"),
            facts,
        }],
    );
    assert!(matches!(out.replies.as_slice(), [(0, Reply::Control(r))] if r.is_ok()));
    assert_eq!(
        out.cap_writes,
        vec![CapWrite {
            gpu: 1,
            cap: Watts(500.0)
        }]
    );
    assert!(out.persist.is_some(), "saved before the answer");
    assert!(out.snapshot.is_none(), "published once the caps are in");
    let out = a.step(
        UnixMs(2_010),
        vec![AgentInput::CapWrites(vec![CapWriteResult {
            gpu: 1,
            cap: Watts(500.0),
            outcome: Ok(Some(Watts(700.0))),
        }])],
    );
    let status = out.snapshot.expect("published");
    assert_eq!(status.gpus[1].cap_w, Some(500.0));
    assert_eq!(status.jobs[0].job, "7");
}

/// A job whose epilog never reaches the agent must not stay registered, capped and
/// paid for, forever.
#[test]
fn a_job_whose_step_daemons_are_gone_is_ended_after_the_grace() {
    let mut a = agent(None);
    a.register(0.0, "7", "0", 0, "n1", &["0".into()], "flex3,calibrate=off")
        .expect("registered");
    a.register(0.0, "8", "0", 0, "n1", &["1".into()], "flex3,calibrate=off")
        .expect("registered");
    a.set_job_cluster("7", None, 0.0);
    a.set_job_cluster("8", None, 0.0);
    let key = |id: &str| (id.to_string(), None);
    let both = BTreeSet::from([
        key("7"),
        key("8"),
        ("7".to_string(), Some("/other/slurm.conf".to_string())),
    ]);
    assert!(a.jobs_alive(1.0, &both).is_empty());
    // Job 7 of another cluster on the same host keeps nothing alive here.
    let only_8 = BTreeSet::from([
        key("8"),
        ("7".to_string(), Some("/other/slurm.conf".to_string())),
    ]);
    assert!(a.jobs_alive(20.0, &only_8).is_empty(), "within the grace");
    assert_eq!(a.jobs_alive(31.0, &only_8), vec!["7".to_string()]);
    assert!(!a.jobs.contains_key("7"));
    assert!(
        a.gpus[0].job.is_none(),
        "its GPU is free and goes back to its default"
    );
    // A job registered by something other than a step daemon (its cluster unknown)
    // is left to its end message.
    a.register(
        40.0,
        "9",
        "0",
        0,
        "n1",
        &["2".into()],
        "flex3,calibrate=off",
    )
    .expect("registered");
    assert!(a.jobs_alive(500.0, &only_8).is_empty());
    assert!(a.jobs.contains_key("9"));
    // A job registered by its step daemon is seen alive then: one that ends before
    // the next scan of the host's processes (found on the local cluster: a job
    // cancelled a second after it started) is still ended after the grace.
    a.register(
        600.0,
        "10",
        "0",
        0,
        "n1",
        &["3".into()],
        "flex3,calibrate=off",
    )
    .expect("registered");
    a.set_job_cluster("10", None, 600.0);
    assert!(a.jobs_alive(620.0, &only_8).is_empty(), "within the grace");
    assert_eq!(a.jobs_alive(631.0, &only_8), vec!["10".to_string()]);
}

/// Without `PrologFlags=Contain`, or with the end-of-job notice lost, the next job on a
/// GPU must not be refused as "belongs to running job A" (it would run unmanaged).
#[test]
fn a_gpu_of_a_job_whose_step_daemons_are_gone_goes_to_the_next_job_at_once() {
    let mut a = agent(None);
    a.register(0.0, "7", "0", 0, "n1", &["0".into(), "1".into()], "flex2")
        .expect("registered");
    a.set_job_cluster("7", None, 0.0);
    // Only a GPU another job holds sends a registration to read the process table.
    assert!(a.gpus_held_by_others("8", &["1".into()]));
    assert!(!a.gpus_held_by_others("8", &["2".into()]));
    assert!(!a.gpus_held_by_others("7", &["0".into(), "1".into()]));
    // Job 7's step daemons still run: nothing handed over, the claim refused.
    let both = BTreeSet::from([("7".to_string(), None), ("8".to_string(), None)]);
    assert!(a
        .hand_over_from_ended_jobs(0.0, "8", &["1".into()], &both)
        .is_empty());
    assert!(a
        .register(1.0, "8", "0", 0, "n1", &["1".into()], "flex3")
        .is_err());
    // Job 7 gone from the host (its end lost): job 8 takes GPU 1 at once.
    let only_8 = BTreeSet::from([("8".to_string(), None)]);
    assert_eq!(
        a.hand_over_from_ended_jobs(0.0, "8", &["1".into()], &only_8),
        ["7"]
    );
    a.register(2.0, "8", "0", 0, "n1", &["1".into()], "flex3")
        .expect("the GPU is job 8's now");
    assert!(!a.jobs.contains_key("7"));
    assert_eq!(a.gpus[1].job.as_deref(), Some("8"));
    assert_eq!(a.gpus[0].job, None, "job 7's other GPU is released too");
    // A holder registered by something other than a step daemon is left alone.
    a.register(3.0, "9", "0", 0, "n1", &["2".into()], "flex2")
        .expect("registered");
    assert!(a
        .hand_over_from_ended_jobs(0.0, "10", &["2".into()], &only_8)
        .is_empty());
}

/// A step Slurm gave no GPUs, with GPU variables the user exported, must not take
/// another job's GPUs.
#[test]
fn a_running_jobs_gpus_cannot_be_claimed_by_another() {
    let mut a = agent(None);
    a.register(0.0, "7", "0", 0, "n1", &["0".into(), "1".into()], "flex0")
        .expect("registered");
    a.set_job_cluster("7", None, 0.0);
    a.jobs_alive(
        1.0,
        &BTreeSet::from([("7".to_string(), None), ("66".to_string(), None)]),
    );
    let refused = a
        .register(2.0, "66", "0", 1000, "n1", &["1".into()], "flex3")
        .expect_err("GPU 1 is job 7's")
        .to_string();
    assert!(refused.contains("belongs to running job 7"), "{refused}");
    assert_eq!(a.gpus[1].job.as_deref(), Some("7"));
    assert!(!a.jobs.contains_key("66"));
    // A job whose end was missed (never seen alive since) still gives way.
    a.register(3.0, "8", "0", 0, "n1", &["2".into()], "flex2")
        .expect("registered");
    a.register(4.0, "9", "0", 0, "n1", &["2".into()], "flex2")
        .expect("8 was never seen running");
    assert_eq!(a.gpus[2].job.as_deref(), Some("9"));
}

/// NVML's listing as the agent reads it: per GPU, the jobs whose processes use it.
fn listing(jobs: &[(u32, &[&str])]) -> GpuProcesses {
    let mut listed = GpuProcesses::default();
    for &(gpu, ids) in jobs {
        let keys: BTreeSet<crate::JobKey> = ids.iter().map(|id| (id.to_string(), None)).collect();
        listed.processes.insert(
            gpu,
            ids.iter()
                .enumerate()
                .map(|(pid, id)| (pid as u32 + 100, Some(id.to_string())))
                .collect(),
        );
        if !keys.is_empty() {
            listed.jobs.insert(gpu, keys);
        }
    }
    listed
}

/// A GPU Slurm gave to a job stays that job's, capped as the job is, when another job's
/// process uses it (a stray process, a debugger, a shared node): the foreign use is
/// counted once per onset, shown in status, and ends when NVML lists it no more.
#[test]
fn another_jobs_process_on_a_jobs_gpu_leaves_it_the_jobs_and_capped() {
    let mut a = agent(Some(Watts(1200.0)));
    a.register(
        0.0,
        "66",
        "0",
        1000,
        "n1",
        &["0".into(), "1".into()],
        "flex3,calibrate=off",
    )
    .expect("registered");
    a.set_job_cluster("66", None, 0.0);
    let before = caps(&a.tick(0.5));
    for &(g, c) in &before {
        a.cap_written(0.0, g, Watts(c), None);
    }
    let cap0 = a.gpus[0].applied.expect("GPU 0 capped");
    assert!(cap0.0 < 700.0, "{before:?}");
    // NVML: GPU 0 runs a process of job 7 (another user's, not registered here), GPU 1
    // a process of 66 itself; then both on GPU 0.
    for (t, on_gpu0) in [(1.0, &["7"][..]), (2.0, &["66", "7"][..])] {
        let onsets = a.check_gpu_use(t, &listing(&[(0, on_gpu0), (1, &["66"])]));
        assert_eq!(
            onsets,
            if t == 1.0 {
                vec![ForeignGpuUse {
                    gpu: 0,
                    holder: "66".into(),
                    used_by: vec!["7".into()],
                }]
            } else {
                vec![]
            },
            "counted once per onset"
        );
        assert_eq!(a.gpus[0].job.as_deref(), Some("66"), "still the job's");
        assert_eq!(a.jobs["66"].gpus, vec![0, 1]);
        assert!(
            caps(&a.tick(t)).is_empty(),
            "the cap in force stays: no write to the default"
        );
    }
    let status = a.snapshot(2.0);
    assert_eq!(status.gpu_foreign_use, 1);
    assert!(status.gpus[0].foreign_use && !status.gpus[1].foreign_use);
    assert_eq!(status.gpus[0].foreign_jobs, ["7"]);
    // Its owner sees that something else uses its GPU, not whose job it is.
    let owners = seen_by(&status, 1000);
    assert!(owners.gpus[0].foreign_use && owners.gpus[0].foreign_jobs.is_empty());
    // A listing NVML could not make is no evidence; one with job 7 gone ends it.
    a.check_gpu_use(3.0, &GpuProcesses::default());
    assert!(a.snapshot(3.0).gpus[0].foreign_use);
    a.check_gpu_use(4.0, &listing(&[(0, &[]), (1, &["66"])]));
    let status = a.snapshot(4.0);
    assert!(!status.gpus[0].foreign_use && status.gpus[0].foreign_jobs.is_empty());
    assert_eq!(status.gpu_foreign_use, 1);
    assert_eq!(
        a.gpus[0].applied,
        Some(cap0),
        "capped as the job is throughout"
    );
}

/// A GPU handed to another job ends the holder's hold: taking the GPU back must not
/// charge the job the counter's advance while another job held it.
#[test]
fn a_stolen_gpu_ends_its_hold_and_a_retake_charges_only_its_own_spans() {
    let mut a = agent(None);
    // Another job given a GPU (the holder's end missed) ends the holder's span.
    a.register(
        1008.0,
        "8",
        "0",
        1000,
        "n1",
        &["2".into(), "3".into()],
        "flex3",
    )
    .expect("8");
    a.sampled(1008.0, 2, reading(700.0, 100.0, 0, false));
    a.sampled(1009.0, 2, reading(700.0, 100.0, 1_000, false));
    a.register(1009.0, "9", "0", 1000, "n1", &["2".into()], "flex3")
        .expect("9 takes GPU 2");
    a.sampled(1010.0, 2, reading(700.0, 100.0, 50_000, false));
    a.register(1011.0, "8", "1", 1000, "n1", &["2".into()], "flex3")
        .expect("8 again");
    a.sampled(1011.0, 2, reading(700.0, 100.0, 60_000, false));
    a.sampled(1012.0, 2, reading(700.0, 100.0, 61_000, false));
    let eight = a.share(&a.jobs["8"], false);
    let gpu2 = eight.gpus.iter().find(|g| g.index == 2).expect("GPU 2");
    assert_eq!(gpu2.energy_mj, 1_000 + 1_000, "not job 9's 49,000 mJ");
}

/// A job whose registration failed, or a process outside Slurm, must not run its GPU
/// at the default, uncapped through a grid event.
#[test]
fn a_gpu_used_by_no_registered_job_is_held_at_the_failsafe_until_its_processes_go() {
    let mut a = agent(Some(Watts(2800.0)));
    let tick = |a: &mut Agent, t: f64| {
        let set = caps(&a.tick(t));
        for &(g, c) in &set {
            a.cap_written(0.0, g, Watts(c), None);
        }
        set
    };
    assert_eq!(tick(&mut a, 0.5), vec![], "idle GPUs stay at their default");
    a.register(0.0, "1", "0", 1000, "n1", &["0".into()], "flex0")
        .expect("job 1");
    tick(&mut a, 0.6);
    // NVML lists job 1's process on its own GPU 0, one in no job on GPU 2 and one of
    // job 1 on GPU 3, which job 1 did not register.
    a.nvml_processes_seen(
        1.0,
        &BTreeMap::from([
            (0, vec![(11, Some("1".to_string()))]),
            (1, vec![]),
            (2, vec![(99, None)]),
            (3, vec![(12, Some("1".to_string()))]),
        ]),
    );
    assert_eq!(
        tick(&mut a, 1.0),
        vec![(2, 500.0), (3, 500.0)],
        "both held at the fail-safe; job 1's own GPU untouched"
    );
    let status = a.snapshot(1.0);
    assert_eq!(
        status
            .gpus
            .iter()
            .map(|g| g.unregistered_use)
            .collect::<Vec<_>>(),
        [false, false, true, true]
    );
    // A stop (`systemctl restart`) leaves both at the fail-safe: only the processes'
    // end, seen by the next agent, gives them back.
    assert_eq!(caps(&a.stop_actions(false)), vec![]);
    // One listed empty is free again; so is one NVML could not list (a listing that
    // keeps failing must not strand the cap).
    a.nvml_processes_seen(
        3.0,
        &BTreeMap::from([(0, vec![]), (1, vec![]), (3, vec![])]),
    );
    assert_eq!(
        tick(&mut a, 3.0),
        vec![(2, 700.0), (3, 700.0)],
        "back to their default"
    );
    assert!(a.gpus.iter().all(|g| g.unregistered_since.is_none()));
    a.nvml_processes_seen(3.5, &BTreeMap::from([(2, vec![(99, None)])]));
    assert_eq!(tick(&mut a, 3.5), vec![(2, 500.0)]);
    // The site that says "default" leaves such GPUs alone (a reload switches it).
    let mut settings = a.settings.clone();
    settings.unregistered_gpu_use = UnregisteredGpuUse::Default;
    a.reload(Ok(settings)).expect("reload");
    assert_eq!(tick(&mut a, 4.0), vec![(2, 700.0)]);
}

#[test]
fn an_adopted_job_takes_the_tier_its_next_registration_carries() {
    let mut a = agent(Some(Watts(2800.0)));
    a.register(0.0, "5", ADOPTED_STEP, 1000, "n1", &["0".into()], "flex3")
        .expect("adopted");
    a.register(1.0, "5", "1", 1000, "n1", &["0".into()], "flex1")
        .expect("next step");
    assert_eq!(a.jobs["5"].request.to_string(), "flex1");
    // Once registered by a step, later registrations do not change the tier.
    a.register(2.0, "5", "2", 1000, "n1", &["0".into()], "flex3")
        .expect("a later step");
    assert_eq!(a.jobs["5"].request.to_string(), "flex1");
}

/// The plugin registers unmanaged steps too. A job whose batch step registered as `none`
/// (a site default of `none`) takes its first managed step's tier, as it did when
/// unmanaged steps did not register; a `none` step in a managed job leaves it managed,
/// and is told the job's tier.
#[test]
fn a_none_batch_step_gives_way_to_the_first_managed_step_and_not_back() {
    let mut a = agent(None);
    let gpus = ["0".to_string(), "1".to_string()];
    let batch = a
        .register(0.0, "8", "batch", 1000, "n1", &gpus, "none")
        .expect("the batch step");
    assert_eq!(
        (batch.tier.as_str(), batch.progress.is_some()),
        ("none", false)
    );
    assert!(!a.jobs["8"].managed());
    let step = a
        .register(1.0, "8", "0", 1000, "n1", &gpus, "flex2")
        .expect("a managed step");
    assert_eq!(step.tier, "flex2");
    assert!(step.progress.is_some());
    assert!(a.jobs["8"].managed());
    let opted_out = a
        .register(2.0, "8", "1", 1000, "n1", &gpus, "none")
        .expect("a none step");
    assert_eq!(opted_out.tier, "flex2", "told the job's tier");
    assert!(a.jobs["8"].managed(), "the job stays managed");
}
