//! `powerflex-simjob` as Slurm would run it: a real process on a simulated node.

use std::io::{BufRead, BufReader};
use std::os::unix::net::UnixListener;
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use powerflex_daemon::os::{kill, Signal};
use powerflex_proto::ProgressReport;
use powerflex_sim::state::Node;

fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("pf-simjob-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("scratch");
    dir
}

fn simjob() -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_powerflex-simjob"));
    c.env_remove("SLURM_JOB_GPUS")
        .env_remove("CUDA_VISIBLE_DEVICES")
        .env_remove("POWERFLEX_PROGRESS")
        .env_remove("SLURM_JOB_ID");
    c
}

fn csv_rows(stdout: &str) -> Vec<Vec<String>> {
    stdout
        .lines()
        .filter(|l| l.starts_with("true,"))
        .map(|l| l.split(',').map(str::to_string).collect())
        .collect()
}

#[test]
fn runs_paced_by_caps_and_releases_its_gpus() {
    let dir = scratch("paced").join("n1");
    let node = Node::init(&dir, "n1", "H200", 4, true).expect("node");
    let run = |limit_mw: u32| {
        for g in [1, 2] {
            node.set_power_limit(g, limit_mw, 0).expect("set");
        }
        let out = simjob()
            .args([
                "--profile",
                "llama-3.1-70b-dense-pt-8g-compile",
                "--steps",
                "3",
                "--time-scale",
                "200",
            ])
            .env("POWERFLEX_SIM_DIR", &dir)
            .env("SLURM_JOB_GPUS", "1,2")
            .env("SLURM_JOB_ID", "4242")
            .output()
            .expect("run");
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout).into_owned()
    };
    let uncapped = run(700_000);
    assert!(
        uncapped.starts_with("# powerflex-simjob: SIMULATED training job 4242"),
        "{uncapped}"
    );
    let rows = csv_rows(&uncapped);
    assert_eq!(rows.len(), 3);
    assert_eq!(rows[2][1], "3", "step");
    assert_eq!(
        rows[2][2],
        (942 * 2 * 3).to_string(),
        "tokens: 942 tok/s/GPU x 2 GPUs x 3 steps"
    );
    // Steps are stamped with wall-clock time, in order and now-ish.
    let stamps: Vec<u128> = rows
        .iter()
        .map(|r| r[7].parse().expect("unix_ms"))
        .collect();
    let now_ms = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .expect("clock")
        .as_millis();
    assert!(stamps.windows(2).all(|w| w[0] <= w[1]), "{stamps:?}");
    assert!(
        now_ms - stamps[2] < 60_000 && stamps[2] <= now_ms,
        "{stamps:?}"
    );
    let tps_uncapped: f64 = rows[0][4].parse().expect("tokens/s");
    assert!((tps_uncapped - 1884.0).abs() < 1.0);
    for g in 0..4 {
        assert!(
            node.gpu(g).expect("gpu").running().is_none(),
            "GPU {g} released"
        );
    }
    let capped = run(300_000);
    let tps_capped: f64 = csv_rows(&capped)[0][4].parse().expect("tokens/s");
    let library = powerflex_sim::profiles::Library::builtin().expect("library");
    let physics = library
        .find("llama-3.1-70b-dense-pt-8g-compile")
        .expect("profile")
        .physics;
    let expected = physics
        .at_cap(powerflex_core::Watts(300.0))
        .relative_throughput;
    assert!(
        (tps_capped / tps_uncapped - expected).abs() < 0.01,
        "{tps_capped}/{tps_uncapped} vs {expected}"
    );
    assert_eq!(csv_rows(&capped)[0][5], "300", "cap column");
}

#[test]
fn sigterm_stops_the_job_and_frees_the_gpus() {
    let dir = scratch("sigterm").join("n1");
    let node = Node::init(&dir, "n1", "H200", 2, true).expect("node");
    let uuid = node.gpu(1).expect("gpu").uuid;
    let child = simjob()
        .args(["--profile", "synthetic-memory-bound"])
        .env("POWERFLEX_SIM_DIR", &dir)
        .env("CUDA_VISIBLE_DEVICES", &uuid)
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn");
    let deadline = Instant::now() + Duration::from_secs(10);
    while node.gpu(1).expect("gpu").running().is_none() {
        assert!(Instant::now() < deadline, "the job never claimed its GPU");
        std::thread::sleep(Duration::from_millis(20));
    }
    assert!(
        node.gpu(0).expect("gpu").running().is_none(),
        "only the GPU it was given"
    );
    let (_, reading) = node.reading(1).expect("reading");
    assert!(reading.busy && reading.power_mw > 400_000, "{reading:?}");
    // The child we spawned, by its PID.
    kill(child.id(), Signal::TERM).expect("kill");
    let out = child.wait_with_output().expect("wait");
    assert!(out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("stopped by signal 15"));
    assert!(
        node.gpu(1).expect("gpu").workload.is_none(),
        "claim removed on SIGTERM"
    );
}

#[test]
fn reports_progress_to_a_listening_agent() {
    let root = scratch("progress");
    let dir = root.join("n1");
    Node::init(&dir, "n1", "H200", 1, true).expect("node");
    let socket = root.join("agent.sock");
    let listener = UnixListener::bind(&socket).expect("bind");
    let out = simjob()
        .args([
            "--profile",
            "synthetic-compute-bound",
            "--steps",
            "4",
            "--time-scale",
            "100",
            "--job-id",
            "99",
        ])
        .env("POWERFLEX_SIM_DIR", &dir)
        .env("SLURM_JOB_GPUS", "0")
        .env("POWERFLEX_PROGRESS", &socket)
        .output()
        .expect("run");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let (stream, _) = listener.accept().expect("the job connected");
    let reports: Vec<ProgressReport> = BufReader::new(stream)
        .lines()
        .map(|l| ProgressReport::from_line(&l.expect("line")).expect("valid report"))
        .collect();
    // One report per catch-up, not per step: a job stalled on a loaded machine finishes
    // the steps it owes at once and reports them together (seen in a clean-clone run: 3
    // reports for 4 steps). The last one carries the whole job.
    assert!((1..=4).contains(&reports.len()), "{reports:?}");
    let last = reports.last().expect("a report");
    assert_eq!(last.steps, 4);
    assert_eq!(last.job_id, "99");
    assert_eq!(last.tokens, 4 * 4000);
    assert!(
        reports.windows(2).all(|w| w[1].tokens > w[0].tokens),
        "cumulative"
    );
}

#[test]
fn no_agent_is_no_error() {
    let root = scratch("no-agent");
    let dir = root.join("n1");
    Node::init(&dir, "n1", "H200", 1, true).expect("node");
    let out = simjob()
        .args([
            "--profile",
            "synthetic-compute-bound",
            "--steps",
            "2",
            "--time-scale",
            "100",
        ])
        .env("POWERFLEX_SIM_DIR", &dir)
        .env("SLURM_JOB_GPUS", "0")
        .env("POWERFLEX_PROGRESS", root.join("nobody-listens.sock"))
        .output()
        .expect("run");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(csv_rows(&String::from_utf8_lossy(&out.stdout)).len(), 2);
}

#[test]
fn refuses_to_start_with_a_clear_message() {
    let root = scratch("refuse");
    let dir = root.join("n1");
    Node::init(&dir, "n1", "H200", 2, true).expect("node");
    /// Arguments, environment, and what stderr must say.
    type Case<'a> = (Vec<&'a str>, Vec<(&'a str, &'a str)>, &'a str);
    let cases: Vec<Case> = vec![
        (
            vec!["--profile", "synthetic-compute-bound"],
            vec![],
            "no GPUs",
        ),
        (
            vec!["--profile", "synthetic-compute-bound"],
            vec![("SLURM_JOB_GPUS", "7")],
            "GPU index 7 does not exist",
        ),
        (
            vec!["--profile", "synthetic-compute-bound"],
            vec![("SLURM_JOB_GPUS", "zero")],
            "neither an index nor",
        ),
    ];
    for (args, env, message) in cases {
        let mut cmd = simjob();
        cmd.args(&args).env("POWERFLEX_SIM_DIR", &dir);
        for (k, v) in env {
            cmd.env(k, v);
        }
        let out = cmd.output().expect("run");
        // Bad values on the command line exit 2 (the test below); these are refusals of
        // well-formed input.
        assert_eq!(out.status.code(), Some(1), "{args:?}");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(stderr.contains(message), "{args:?}: {stderr}");
    }
    let out = simjob()
        .args(["--profile", "synthetic-compute-bound"])
        .env_remove("POWERFLEX_SIM_DIR")
        .env("SLURM_JOB_GPUS", "0")
        .output()
        .expect("run");
    assert!(String::from_utf8_lossy(&out.stderr).contains("POWERFLEX_SIM_DIR is not set"));
}

/// Every value is parsed by clap: a malformed one exits 2, names the flag and what is
/// accepted, and no GPU is claimed (there is no node to claim from).
#[test]
fn malformed_values_exit_2_naming_what_is_accepted() {
    for (args, flag, accepted) in [
        (vec!["--profile", "nope"], "--profile", "the library has: "),
        (
            vec!["--profile", "synthetic-memory-bound", "--time-scale", "0"],
            "--time-scale",
            "accepted: a positive number",
        ),
        (
            vec!["--profile", "synthetic-memory-bound", "--step-s", "inf"],
            "--step-s",
            "accepted: a positive number",
        ),
        (
            vec!["--profile", "synthetic-memory-bound", "--duration", "NaN"],
            "--duration",
            "accepted: a positive number",
        ),
        (
            vec!["--profile", "synthetic-memory-bound", "--gpus", "x,,y"],
            "--gpus",
            "neither an index nor a GPU-/MIG- UUID",
        ),
        (
            vec!["--phases", "idle:60,synthetic-memory-bound"],
            "--phases",
            "accepted: a comma list of LOAD:SECONDS",
        ),
        (
            vec!["--phases", "idle:60,synthetic-memory-bound:-5"],
            "--phases",
            "accepted: a comma list of LOAD:SECONDS",
        ),
        (
            vec!["--phases", "idle:60,nope:5"],
            "--phases",
            "the library has: ",
        ),
        (
            vec!["--phases", "idle:60"],
            "--phases",
            "has no training phase",
        ),
    ] {
        let out = simjob()
            .args(&args)
            .env_remove("POWERFLEX_SIM_DIR")
            .output()
            .expect("run simjob");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {stderr}");
        assert!(
            stderr.contains("invalid value") && stderr.contains(flag) && stderr.contains(accepted),
            "{args:?}: {stderr}"
        );
        assert!(!stderr.contains("panicked"), "{args:?}: {stderr}");
    }
}

/// The GPUs' draw and the job's progress follow its phases: idle (claimed, idle power, no
/// steps), then a training profile at its power, and the job ends after the last phase.
#[test]
fn phases_switch_the_gpu_workload_at_each_boundary() {
    let dir = scratch("phases").join("n1");
    let node = Node::init(&dir, "n1", "H200", 2, true).expect("node");
    // 10 s scale: idle for 3 simulated s (0.3 s), then train for 20 (2 s).
    let child = simjob()
        .args([
            "--phases",
            "idle:3,synthetic-memory-bound:20",
            "--time-scale",
            "10",
        ])
        .env("POWERFLEX_SIM_DIR", &dir)
        .env("SLURM_JOB_GPUS", "0,1")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn");
    let deadline = Instant::now() + Duration::from_secs(10);
    while node.gpu(0).expect("gpu").running().is_none() {
        assert!(Instant::now() < deadline, "the job never claimed its GPUs");
        std::thread::sleep(Duration::from_millis(5));
    }
    let (_, idle) = node.reading(0).expect("reading");
    assert!(
        !idle.busy && idle.power_mw <= 76_000 && idle.job_id.is_some(),
        "idle phase: claimed at idle power {idle:?}"
    );
    let deadline = Instant::now() + Duration::from_secs(10);
    let loaded = loop {
        let (_, r) = node.reading(1).expect("reading");
        if r.busy {
            break r;
        }
        assert!(Instant::now() < deadline, "the training phase never began");
        std::thread::sleep(Duration::from_millis(20));
    };
    assert!(
        loaded.power_mw > 400_000,
        "training phase draws: {loaded:?}"
    );
    let out = child.wait_with_output().expect("wait");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let rows = csv_rows(&String::from_utf8_lossy(&out.stdout));
    // Uncapped steps of 1 simulated s from 3 s to 23 s: the first ends at 4 s.
    assert!((19..=20).contains(&rows.len()), "{} steps", rows.len());
    let first_end_s: f64 = rows[0][3].parse().expect("elapsed_s");
    assert!(
        (first_end_s - 4.0).abs() < 1e-6,
        "first step ends at {first_end_s}"
    );
    assert!(
        node.gpu(0).expect("gpu").workload.is_none(),
        "released at the end"
    );
}

/// A process stopped for a while (a starved job) catches up: its steps follow the
/// simulated time that passed, so the job's rate is what the caps allow.
#[test]
fn a_stalled_job_catches_up_with_simulated_time() {
    let dir = scratch("stall").join("n1");
    let _node = Node::init(&dir, "n1", "H200", 1, true).expect("node");
    let child = simjob()
        .args([
            "--profile",
            "synthetic-memory-bound",
            "--duration",
            "40",
            "--time-scale",
            "10",
        ])
        .env("POWERFLEX_SIM_DIR", &dir)
        .env("SLURM_JOB_GPUS", "0")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn");
    std::thread::sleep(Duration::from_millis(500));
    // Our own child, by its PID: stopped for 1.5 s = 15 simulated seconds.
    kill(child.id(), Signal::STOP).expect("SIGSTOP");
    std::thread::sleep(Duration::from_millis(1500));
    kill(child.id(), Signal::CONT).expect("SIGCONT");
    let out = child.wait_with_output().expect("wait");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let rows = csv_rows(&String::from_utf8_lossy(&out.stdout));
    // Uncapped 1 s steps for 40 simulated s: 40 steps, stall or not.
    assert_eq!(rows.len(), 40, "steps after a stall");
    let last_s: f64 = rows[39][3].parse().expect("elapsed_s");
    assert!((last_s - 40.0).abs() < 1e-6, "{last_s}");
}
