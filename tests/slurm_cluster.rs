//! The Slurm test harness itself (`powerflex::slurm`): a real three-node cluster with
//! gres GPUs runs a job on every node, and its daemons are gone after it stops — also
//! when the test that owns it panics while a job runs.

use std::panic::{self, AssertUnwindSafe};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use powerflex::needs::{can_run, Need};
use powerflex::slurm::{pid_alive, Cluster, ClusterOptions};

#[test]
fn three_gpu_nodes_run_a_job_and_stop_cleanly() {
    if !can_run(&[Need::Root, Need::Slurm]) {
        return;
    }
    let mut cluster = Cluster::start(
        "slurm-cluster-smoke",
        ClusterOptions {
            extra_node_env: vec![("POWERFLEX_SIM_DIR".into(), "/nonexistent/sim/%n".into())],
            ..ClusterOptions::default()
        },
    );
    let idle: Vec<(String, String)> = ["n1", "n2", "n3"]
        .iter()
        .map(|n| (n.to_string(), "idle".to_string()))
        .collect();
    assert_eq!(cluster.node_states(), idle);

    // Each slurmd got the per-node environment, with `%n` filled in.
    let pids = cluster.daemon_pids();
    assert_eq!(pids.len(), 4, "{pids:?}");
    for (which, pid) in &pids {
        assert!(pid_alive(*pid), "{which} (pid {pid}) is not running");
        if which != "slurmctld" {
            let environ = std::fs::read(format!("/proc/{pid}/environ")).expect("environ");
            let want = format!("POWERFLEX_SIM_DIR=/nonexistent/sim/{which}");
            assert!(
                environ.split(|b| *b == 0).any(|v| v == want.as_bytes()),
                "{which} lacks {want}"
            );
        }
    }

    let out = cluster.dir().join("job.out");
    let out_arg = out.display().to_string();
    let job = cluster
        .sbatch(
            &[
                "-N3",
                "--gres=gpu:2",
                "-o",
                &out_arg,
                "--wrap",
                "srun bash -c 'echo $SLURMD_NODENAME $SLURM_JOB_GPUS $CUDA_VISIBLE_DEVICES'",
            ],
            None,
        )
        .expect("sbatch accepts the job");
    let state = cluster.wait_job_done(job, Duration::from_secs(60));
    let text = std::fs::read_to_string(&out).unwrap_or_default();
    assert_eq!(
        state,
        "COMPLETED",
        "{}\noutput:\n{text}\n{}",
        cluster.job_info(job),
        cluster.logs_tail()
    );

    let mut lines: Vec<&str> = text.lines().collect();
    lines.sort_unstable();
    assert_eq!(lines.len(), 3, "one line per node expected:\n{text}");
    for (line, node) in lines.iter().zip(["n1", "n2", "n3"]) {
        let fields: Vec<&str> = line.split_whitespace().collect();
        assert_eq!(fields.len(), 3, "node, job GPUs, visible GPUs: {line:?}");
        assert_eq!(fields[0], node, "{text}");
        for list in &fields[1..] {
            let gpus: Vec<u32> = list
                .split(',')
                .map(|g| g.parse().expect("a GPU index"))
                .collect();
            assert_eq!(gpus.len(), 2, "two GPUs per node: {line:?}");
            assert!(
                gpus.iter().all(|g| *g < 4),
                "GPU index out of range: {line:?}"
            );
        }
    }
    cluster.assert_no_node_drained();

    cluster.stop();
    for (which, pid) in &pids {
        assert!(
            !pid_alive(*pid),
            "{which} (pid {pid}) still runs after stop"
        );
    }
    // Gone, not merely signalled: no process of the cluster (a daemon's helper, a step
    // daemon, a job task) outlives `stop`.
    assert_eq!(cluster.processes_left(), Vec::<u32>::new());
}

#[test]
fn a_panicking_test_still_stops_its_daemons() {
    if !can_run(&[Need::Root, Need::Slurm]) {
        return;
    }
    let pids = Mutex::new(Vec::new());
    let result = panic::catch_unwind(AssertUnwindSafe(|| {
        let cluster = Cluster::start(
            "slurm-cluster-panic",
            ClusterOptions {
                nodes: 1,
                gpus_per_node: 1,
                ..ClusterOptions::default()
            },
        );
        *pids.lock().expect("lock") = cluster.daemon_pids();
        let job = cluster
            .sbatch(&[], Some("#!/bin/sh\nsrun sleep 4321\n"))
            .expect("sbatch accepts the job");
        let deadline = Instant::now() + Duration::from_secs(30);
        while !(cluster.job_state(job).as_deref() == Some("RUNNING") && sleeping()) {
            assert!(Instant::now() < deadline, "{}", cluster.job_info(job));
            std::thread::sleep(Duration::from_millis(100));
        }
        panic!("the test fails while a job runs");
    }));
    let message = result.expect_err("the closure panics");
    assert_eq!(
        message.downcast_ref::<&str>(),
        Some(&"the test fails while a job runs"),
        "the cluster or the job failed instead"
    );
    let pids = pids.into_inner().expect("lock");
    assert_eq!(pids.len(), 2, "{pids:?}");
    for (which, pid) in &pids {
        assert!(!pid_alive(*pid), "{which} (pid {pid}) outlived the panic");
    }
    assert!(!sleeping(), "the job's task outlived the cluster");
}

/// Whether the task of the job in `a_panicking_test_still_stops_its_daemons` runs.
fn sleeping() -> bool {
    std::fs::read_dir("/proc")
        .expect("/proc")
        .flatten()
        .filter_map(|entry| entry.file_name().to_str()?.parse::<u32>().ok())
        .filter(|pid| pid_alive(*pid))
        .any(|pid| {
            // srun puts the full path in argv[0].
            std::fs::read(format!("/proc/{pid}/cmdline"))
                .is_ok_and(|c| c.ends_with(b"sleep\x004321\0"))
        })
}
