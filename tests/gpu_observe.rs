//! `scripts/gpu-observe.sh`, the read-only run on a real GPU, run end to
//! end here against the SIMULATED NVML library, so CI proves the script works without a
//! GPU: a real `powerflexd` in observe mode, a training loop reporting through the
//! project's Python helper as an unprivileged user, pynvml reading the same library, and
//! the simulated job as the GPU's work. Checked from outside the script: its verdict, the
//! simulated GPUs' limits (from the simulator's own state), the job's record against the
//! simulator's energy log, and that nothing it started is left running. Also: it refuses
//! to start when its config says observe mode is off, and a limit changed behind it
//! during a run fails the run by name (and the agent leaves it as found).

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

use powerflex::needs::{can_run, Need};
use powerflex::users::TestUser;
use powerflex::{cargo_build, profile_dir, repo_root, scratch_dir, wait_until};
use powerflex_proto::usage::NodeUsage;
use powerflex_sim::state::Node;

const NEEDS: [Need; 4] = [
    Need::Root,
    Need::Program("python3"),
    Need::Program("setpriv"),
    Need::PythonModule("pynvml"),
];

fn build() {
    cargo_build(&[
        "-p",
        "powerflex-agent",
        "-p",
        "powerflex-sim",
        "-p",
        "powerflex-sim-nvml",
        "--bins",
        "--lib",
    ]);
}

/// A simulated node of two H200s in a fresh scratch directory.
fn sim_node(name: &str) -> (PathBuf, Node) {
    let dir = scratch_dir(name);
    let node = Node::init(&dir.join("n1"), "n1", "H200", 2, true).expect("simulated node");
    (dir, node)
}

fn limits_mw(node: &Node) -> Vec<u32> {
    (0..node.gpu_count())
        .map(|i| node.gpu(i).expect("gpu").power_limit_mw)
        .collect()
}

/// The script on GPU 1 of `node`, the training loop as `user`, readings copied to
/// `dir/out`.
fn script(dir: &Path, node: &Node, seconds: u32, user: &TestUser) -> Command {
    let mut cmd = Command::new("bash");
    cmd.arg(repo_root().join("scripts/gpu-observe.sh"))
        .args(["--nvml"])
        .arg(profile_dir().join("libpowerflex_sim_nvml.so"))
        .arg("--bin-dir")
        .arg(profile_dir())
        .args(["--seconds", &seconds.to_string(), "--gpu", "1"])
        .args(["--user", &user.name, "--sample-interval-ms", "250"])
        .arg("--out")
        .arg(dir.join("out"))
        .env("POWERFLEX_SIM_DIR", node.dir())
        .env_remove("GPU_OBSERVE_TEST_WRITE_ENFORCE");
    cmd
}

/// Whether `pid` is still a process whose command line names `what`.
fn still_running(pid: u32, what: &str) -> bool {
    std::fs::read(format!("/proc/{pid}/cmdline"))
        .is_ok_and(|c| String::from_utf8_lossy(&c).contains(what))
}

/// The agent's PID from the script's "powerflexd pid N" line.
fn agent_pid(stdout: &str) -> Option<u32> {
    stdout
        .split("powerflexd pid ")
        .nth(1)?
        .split_whitespace()
        .next()?
        .parse()
        .ok()
}

#[test]
fn observes_simulated_gpus_end_to_end_and_changes_no_limit() {
    if !can_run(&NEEDS) {
        return;
    }
    build();
    let user = TestUser::ensure("pf-alice").expect("test user");
    let (dir, node) = sim_node("gpu-observe-pass");
    // GPU 1 (the job's) below its default: an agent that restored or enforced anything
    // would move it.
    node.set_power_limit(1, 650_000, 0).expect("set a limit");
    let before = limits_mw(&node);

    let out = script(&dir, &node, 20, &user)
        .output()
        .expect("run the script");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    let said = format!("{stdout}\n--- stderr\n{stderr}");
    assert_eq!(out.status.code(), Some(0), "{said}");
    for expected in [
        "nvidia-smi: not found",
        "SIMULATED",
        "CPU-only stand-in, NO GPU WORK",
        "ok   record: counter at registration",
        "ok   GPU 1 limit unchanged",
        "gpu-observe: PASS",
    ] {
        assert!(stdout.contains(expected), "no {expected:?} in:\n{said}");
    }
    assert_eq!(limits_mw(&node), before, "no limit changed:\n{said}");

    // The record, against the simulator's own energy log.
    let readings = dir.join("out");
    let record: NodeUsage = serde_json::from_str(
        &std::fs::read_to_string(readings.join("record.json")).expect("record.json"),
    )
    .expect("a NodeUsage record");
    assert!(record.simulated && record.ended, "{record:?}");
    assert_eq!(
        record.uid, user.uid,
        "the job's owner is the user it ran as"
    );
    assert_eq!(record.tier, "flex1,calibrate=off");
    assert!(
        !record.caps.is_empty() && record.caps.iter().all(|c| c.cap_w == 650.0),
        "the job ran only at the limit found: {:?}",
        record.caps
    );
    assert!(
        record.work.is_some_and(|w| w > 0.0),
        "the helper's reports were accepted: {record:?}"
    );
    let gpu = &record.gpus[0];
    assert_eq!(gpu.index, 1);
    let counter_mj = |at_ms| {
        node.energy_at_unix_ms(1, at_ms)
            .expect("the simulator's energy log")
            .expect("logged before the job")
    };
    let truth_mj = counter_mj(record.to_unix_ms) - counter_mj(record.from_unix_ms);
    let charged_mj = record.energy_mj as f64;
    assert!(
        truth_mj > 0.0 && (charged_mj - truth_mj).abs() <= 0.02 * truth_mj,
        "charged {charged_mj} mJ, the simulator's log says {truth_mj} mJ over the same span"
    );

    // The agent saw the simulated job's process on GPU 1, in the job.
    let end: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(readings.join("agent-end.json")).expect("agent-end.json"),
    )
    .expect("json");
    let procs = &end["status"]["gpus"][1]["processes"];
    assert_eq!(
        procs.as_array().map(Vec::len),
        Some(1),
        "one process on GPU 1: {end}"
    );
    assert_eq!(procs[0]["job"], record.job_id.as_str());
    // What an enforcing agent would have written (the budget covers the GPU's maximum).
    assert_eq!(end["status"]["gpus"][1]["would_cap_w"], 700.0);

    // Nothing it started is left: the agent, the job's processes.
    let pid = agent_pid(&stdout).expect("the script names the agent's pid");
    assert!(!still_running(pid, "powerflexd"), "powerflexd {pid} left");
    let job_pids: Vec<u32> = serde_json::from_str(
        &std::fs::read_to_string(readings.join("job-pids.json")).expect("job-pids.json"),
    )
    .expect("pids");
    assert!(
        job_pids.len() >= 2,
        "the training loop and the simulated job"
    );
    for pid in job_pids {
        assert!(
            !still_running(pid, "gpu_observe_train") && !still_running(pid, "simjob"),
            "job process {pid} left"
        );
    }
}

/// The script's own files call no NVML setter and no `nvidia-smi` option that writes:
/// what they run on a real GPU reads only (the agent's side is observe mode, above).
#[test]
fn the_script_itself_calls_no_setter() {
    for file in [
        "scripts/gpu-observe.sh",
        "scripts/gpu_observe.py",
        "scripts/gpu_observe_train.py",
    ] {
        let text = std::fs::read_to_string(repo_root().join(file)).expect(file);
        for setter in [
            "nvmlDeviceSet",
            "nvmlDeviceReset",
            "nvmlDeviceClear",
            "nvidia-smi -",
            "--power-limit",
            "--persistence-mode",
            "--lock-gpu-clocks",
            "--applications-clocks",
        ] {
            assert!(!text.contains(setter), "{file} names {setter:?}");
        }
    }
}

#[test]
fn refuses_before_starting_the_agent_when_observe_mode_is_off() {
    if !can_run(&NEEDS) {
        return;
    }
    build();
    let user = TestUser::ensure("pf-alice").expect("test user");
    let (dir, node) = sim_node("gpu-observe-enforce");
    let before = limits_mw(&node);
    let out = script(&dir, &node, 20, &user)
        .env("GPU_OBSERVE_TEST_WRITE_ENFORCE", "1")
        .output()
        .expect("run the script");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stdout}\n{stderr}");
    assert!(
        stderr.contains("refusing: observe mode is off") && stderr.contains("agent.enforce = true"),
        "{stderr}"
    );
    assert!(
        !stdout.contains("powerflexd pid"),
        "no agent started: {stdout}"
    );
    assert!(
        !dir.join("out/agent-boot.json").exists(),
        "no agent was asked anything"
    );
    assert_eq!(limits_mw(&node), before);
}

#[test]
fn a_limit_changed_behind_the_agent_fails_the_run_and_stays_as_found() {
    if !can_run(&NEEDS) {
        return;
    }
    build();
    let user = TestUser::ensure("pf-alice").expect("test user");
    let (dir, node) = sim_node("gpu-observe-changed");
    let mut child = script(&dir, &node, 8, &user)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start the script");
    // Once the simulated job runs on GPU 1, someone else (an admin's `nvidia-smi -pl`)
    // lowers its limit.
    wait_until(
        "the simulated job on GPU 1",
        Duration::from_secs(60),
        || node.gpu(1).ok()?.workload.map(|_| ()),
    );
    node.set_power_limit(1, 500_000, 0).expect("set a limit");
    let stdout: Vec<String> = BufReader::new(child.stdout.take().expect("stdout"))
        .lines()
        .map_while(Result::ok)
        .collect();
    let stdout = stdout.join("\n");
    let mut stderr = String::new();
    std::io::Read::read_to_string(&mut child.stderr.take().expect("stderr"), &mut stderr)
        .expect("stderr");
    let status = child.wait().expect("wait");
    assert_eq!(status.code(), Some(1), "{stdout}\n--- stderr\n{stderr}");
    assert!(
        stdout.contains("FAIL GPU 1 limit unchanged: POWER LIMIT CHANGED: 500.0 W at "),
        "{stdout}"
    );
    assert!(stdout.contains("gpu-observe: FAIL"), "{stdout}");
    assert_eq!(
        limits_mw(&node),
        vec![700_000, 500_000],
        "observe mode wrote nothing back"
    );
}
