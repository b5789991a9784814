//! powerflexd on SIMULATED GPUs, measured: `cargo bench -p powerflex --bench agent`.
//!
//! Prints two tables:
//! 1. calibration per tier and profile — levels walked, deepest cap, wall time, the
//!    measured PFI against the profile's own PFI on the caps walked, and the cost of the
//!    walk in seconds of uncapped training (tokens lost ÷ uncapped tokens/s);
//! 2. the agent's resident memory and CPU time while it samples 8 GPUs at 1 Hz for 60 s.
//!
//! Timings are shortened so the run takes about two minutes: warm-up 2 s, settle 2 s, hold
//! 6 s per level, jobs at time scale 20. Cost in uncapped-seconds scales with the hold.

use std::io::{BufRead, BufReader, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use powerflex::site_config::SiteBuilder;
use powerflex_proto::status::CalibrationState;
use powerflex_proto::ControlReply;
use powerflex_sim::profiles::Library;

fn release_dir() -> PathBuf {
    let exe = std::env::current_exe().expect("bench path");
    exe.parent()
        .and_then(Path::parent)
        .expect("target/release")
        .to_path_buf()
}

struct Procs(Vec<Child>);

impl Drop for Procs {
    fn drop(&mut self) {
        for c in &mut self.0 {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

fn send(socket: &Path, line: &str) -> ControlReply {
    let mut s = UnixStream::connect(socket).expect("agent socket");
    s.set_read_timeout(Some(Duration::from_secs(3)))
        .expect("timeout");
    s.write_all(line.as_bytes()).expect("send");
    s.write_all(b"\n").expect("send");
    let mut reply = String::new();
    BufReader::new(s).read_line(&mut reply).expect("reply");
    ControlReply::from_line(&reply).expect("a control reply")
}

fn start_agent(dir: &Path, bin: &Path, interval_ms: u32, gpus: u32, procs: &mut Procs) -> u32 {
    let _ = std::fs::remove_dir_all(dir.join("sim"));
    let _ = std::fs::remove_dir_all(dir.join("state"));
    powerflex_sim::state::Node::init(&dir.join("sim/n1"), "n1", "H200", gpus, true)
        .expect("sim node");
    let config = dir.join("powerflex.toml");
    SiteBuilder::new(100000.0)
        .h200(&[700.0, 600.0, 500.0, 400.0, 300.0, 200.0], 500.0)
        .edit(|raw| raw.controller.lease_ttl_s = Some(3600))
        .agent_paths(
            &format!("{}/%n.sock", dir.display()),
            &format!("{}/state/%n", dir.display()),
            &bin.join("libpowerflex_sim_nvml.so"),
        )
        .calibration_s(2.0, 2.0, 6.0)
        .calibration_budget_pct(0.05)
        .edit(|raw| raw.agent.node_budget_w = Some(1000000.0))
        .write(&config)
        .unwrap_or_else(|e| panic!("{e}"));
    let _ = std::fs::remove_file(dir.join("n1.sock"));
    let child = Command::new(bin.join("powerflexd"))
        .args([
            "--config",
            config.to_str().expect("utf-8"),
            "--node",
            "n1",
            "--sample-interval-ms",
            &interval_ms.to_string(),
        ])
        .env("POWERFLEX_SIM_DIR", dir.join("sim/n1"))
        .stderr(std::fs::File::create(dir.join("agent.log")).expect("agent log"))
        .spawn()
        .expect("powerflexd");
    let pid = child.id();
    procs.0.push(child);
    let deadline = Instant::now() + Duration::from_secs(20);
    while UnixStream::connect(dir.join("n1.sock")).is_err() {
        assert!(
            Instant::now() < deadline,
            "agent did not start:\n{}",
            std::fs::read_to_string(dir.join("agent.log")).unwrap_or_default()
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    pid
}

fn cpu_seconds(pid: u32) -> f64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    let fields: Vec<&str> = stat
        .rsplit(')')
        .next()
        .unwrap_or("")
        .split_whitespace()
        .collect();
    let ticks = |i: usize| {
        fields
            .get(i)
            .and_then(|v| v.parse::<f64>().ok())
            .unwrap_or(0.0)
    };
    // utime and stime are fields 14 and 15 (1-based); after ")" they are 12 and 13 (1-based from state).
    (ticks(11) + ticks(12)) / 100.0
}

fn rss_kib(pid: u32) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .unwrap_or_default()
        .lines()
        .find_map(|l| {
            l.strip_prefix("VmRSS:")
                .and_then(|v| v.trim().trim_end_matches(" kB").trim().parse().ok())
        })
        .unwrap_or(0)
}

fn main() {
    let manifest = Path::new(env!("CARGO_MANIFEST_DIR"));
    let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
    let built = Command::new(cargo)
        .current_dir(manifest)
        .args([
            "build",
            "--release",
            "--quiet",
            "-p",
            "powerflex-agent",
            "-p",
            "powerflex-sim",
            "-p",
            "powerflex-sim-nvml",
            "--bins",
            "--lib",
        ])
        .status()
        .expect("cargo");
    assert!(built.success());
    let bin = release_dir();
    let dir = std::env::temp_dir().join(format!("pf-bench-agent-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("dir");
    let library = Library::builtin().expect("library");

    println!("== calibration on SIMULATED H200s (warm-up 2 s, settle 2 s, 6 s windows, design budget 0.05 % of first-hour tokens; jobs at time scale 20)");
    let mut procs = Procs(Vec::new());
    start_agent(&dir, &bin, 250, 8, &mut procs);
    let jobs = [
        ("11", "flex1", "gpt-oss-20b-moe-ft-8g-seq4096-bs8"),
        ("12", "flex2", "gpt-oss-20b-moe-ft-8g-seq4096-bs8"),
        ("13", "flex3", "gpt-oss-20b-moe-ft-8g-seq4096-bs8"),
        ("14", "flex1", "llama-3.1-70b-dense-pt-8g-compile"),
        ("15", "flex2", "llama-3.1-70b-dense-pt-8g-compile"),
        ("16", "flex3", "llama-3.1-70b-dense-pt-8g-compile"),
        ("17", "flex2", "qwen3-30b-a3b-moe-pt-8g-ep1"),
        ("18", "flex3", "qwen3-30b-a3b-moe-pt-8g-ep1"),
    ];
    let socket = dir.join("n1.sock");
    for (gpu, (job, tier, profile)) in jobs.iter().enumerate() {
        let reply = send(
            &socket,
            &format!("{{\"v\":1,\"op\":\"register\",\"job_id\":\"{job}\",\"step_id\":\"0\",\"uid\":0,\"node\":\"n1\",\"gpus\":[\"{gpu}\"],\"flex\":\"{tier}\"}}"),
        );
        let progress = reply.progress().expect("progress");
        procs.0.push(
            Command::new(bin.join("powerflex-simjob"))
                .args(["--profile", profile, "--time-scale", "20"])
                .env("SLURM_JOB_ID", job)
                .env("SLURM_JOB_GPUS", gpu.to_string())
                .env("POWERFLEX_SIM_DIR", dir.join("sim/n1"))
                .env("POWERFLEX_PROGRESS", progress)
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .spawn()
                .expect("simjob"),
        );
    }
    let deadline = Instant::now() + Duration::from_secs(240);
    let status = loop {
        let s = send(&socket, "{\"v\":1,\"op\":\"status\"}")
            .status()
            .cloned()
            .expect("status");
        let busy = s
            .jobs
            .iter()
            .filter(|j| {
                matches!(
                    j.calibration,
                    CalibrationState::Warmup | CalibrationState::Walking
                )
            })
            .count();
        if busy == 0 || Instant::now() > deadline {
            break s;
        }
        std::thread::sleep(Duration::from_secs(1));
    };
    println!(
        "{:>4} {:<6} {:<36} {:>6} {:>8} {:>7} {:>6} {:>6} {:>16}",
        "job", "tier", "profile", "levels", "deepest", "wall s", "PFI", "true", "cost uncapped-s"
    );
    for j in &status.jobs {
        let id = j.job.as_str();
        let (_, tier, profile) = jobs
            .iter()
            .find(|(i, _, _)| *i == id)
            .copied()
            .unwrap_or(("", "", ""));
        let caps: Vec<f64> = j.points.iter().map(|p| p.cap_w.0).collect();
        let truth = library
            .find(profile)
            .ok()
            .and_then(|p| p.physics.pfi_on(&caps));
        let top = j.points.first().map_or(0.0, |p| p.throughput);
        let cost_s = if top > 0.0 {
            j.calibration_cost / top
        } else {
            0.0
        };
        println!(
            "{:>4} {:<6} {:<36} {:>6} {:>8.0} {:>7.1} {:>6.2} {:>6.2} {:>16.2}",
            id,
            tier,
            profile,
            caps.len(),
            caps.iter().copied().fold(f64::MAX, f64::min),
            j.calibration_s.unwrap_or(f64::NAN),
            j.pfi.unwrap_or(f64::NAN),
            truth.unwrap_or(f64::NAN),
            cost_s
        );
    }
    drop(procs);

    println!(
        "\n== agent footprint: N SIMULATED GPUs sampled at 1 Hz, one managed job registered per GPU, 30 s each"
    );
    println!(
        "{:>6} {:>12} {:>14} {:>10}",
        "GPUs", "RSS MiB", "CPU s / 30 s", "CPU %"
    );
    // The simulated NVML library models at most 64 GPUs per node (more than any real one).
    for gpus in [8u32, 16, 64] {
        let mut procs = Procs(Vec::new());
        let pid = start_agent(&dir, &bin, 1000, gpus, &mut procs);
        for gpu in 0..gpus {
            send(
                &socket,
                &format!("{{\"v\":1,\"op\":\"register\",\"job_id\":\"9{gpu}\",\"step_id\":\"0\",\"uid\":0,\"node\":\"n1\",\"gpus\":[\"{gpu}\"],\"flex\":\"flex2,calibrate=off\"}}"),
            );
        }
        std::thread::sleep(Duration::from_secs(2));
        let (cpu0, t0) = (cpu_seconds(pid), Instant::now());
        std::thread::sleep(Duration::from_secs(30));
        let (cpu1, wall) = (cpu_seconds(pid), t0.elapsed().as_secs_f64());
        println!(
            "{:>6} {:>12.1} {:>14.2} {:>10.2}",
            gpus,
            rss_kib(pid) as f64 / 1024.0,
            cpu1 - cpu0,
            100.0 * (cpu1 - cpu0) / wall
        );
    }
    let _ = std::fs::remove_dir_all(&dir);
}
