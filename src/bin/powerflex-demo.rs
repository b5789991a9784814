//! `powerflex-demo`: the README's first command. A local Slurm cluster — slurmctld and
//! three `slurmd -N` nodes with 8 SIMULATED H200s each — runs the real SPANK plugin, an
//! agent per node and the controller. Six simulated training jobs with different tiers
//! and workloads (dense pretraining, MoE fine-tuning; single- and multi-node) calibrate,
//! then a 30 % grid event ramps in, holds and ends. The demo prints each job's measured
//! against its true PFI, its caps and tokens/s before and during the event, and the
//! cluster's tokens/s against the equal-weight split of the same budget on the same
//! curves; it writes a plot, stops everything it started by PID, and checks that every
//! simulated GPU is back at its default cap.
//!
//! Run as root after `cargo build --release` (scripts/demo.sh does both). Exit codes: 0
//! the event was met and every promise held; 1 something failed or a promise broke (the
//! output says which); 2 usage error.

use std::io::{BufRead, BufReader, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitCode};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use clap::Parser;
use serde_json::{json, Value};

use powerflex_core::Watts;
use powerflex_daemon::os::{kill, Signal};
use powerflex_proto::{ControlOp, ControlRequest, VERSION};
use powerflex_sim::profiles::Library;
use powerflex_sim::state::Node;
use powerflex_testbed::site::SiteBuilder;
use powerflex_testbed::slurm::{Cluster, ClusterOptions};
use powerflex_testbed::{profile_dir, repo_root, run, write_site_key, Children};

const NODES: u32 = 3;
const GPUS_PER_NODE: u32 = 8;
const DEFAULT_CAP_W: f64 = 700.0;
/// The site's calibration grid, W per GPU (also where flex0's true PFI is computed).
const CALIBRATION_CAPS_W: [f64; 5] = [700.0, 600.0, 500.0, 400.0, 300.0];
/// Draw samples may exceed the budget by this share (NVML-level power noise is ±0.5 %).
const DRAW_TOLERANCE: f64 = 0.01;
/// Measured slowdowns may exceed a tier's bound by this much (throughput noise).
const SLOWDOWN_TOLERANCE: f64 = 0.03;

#[derive(Debug, Parser)]
#[command(
    name = "powerflex-demo",
    version,
    about = "powerflex end to end on a local Slurm cluster with SIMULATED GPUs: calibration, a grid event, the result against equal-weight"
)]
struct Cli {
    /// The grid event's cut, as a share of the cluster's measured draw before it.
    #[arg(long, default_value = "0.3", value_name = "FRACTION", value_parser = cut_share)]
    cut: f64,
    /// How long the budget takes to step down at the start, and back up at the end, s.
    #[arg(long, default_value = "10", value_name = "S", value_parser = ramp_s)]
    ramp_s: f64,
    /// How long the event holds at its full cut, s.
    #[arg(long, default_value = "60", value_name = "S", value_parser = hold_s)]
    hold_s: f64,
    /// Simulated seconds per real second for the training jobs.
    #[arg(long, default_value = "20", value_name = "X", value_parser = time_scale)]
    time_scale: f64,
    /// Where the plot, the jobs' step logs, the daemons' logs and the summary go
    /// [default: REPO/target/powerflex-demo].
    #[arg(long, value_name = "DIR")]
    out: Option<PathBuf>,
}

/// One job of the mix: what is submitted.
#[derive(Debug, Clone, Copy)]
struct Spec {
    tier: &'static str,
    /// The tier's bound on slowdown (the site's default tier table).
    bound: f64,
    nodes: u32,
    gpus_per_node: u32,
    profile: &'static str,
    kind: &'static str,
}

/// The jobs: every tier, dense and MoE, single- and multi-node, 24 GPUs in all. A 30 %
/// cut is within reach of every tier's bound here (the loose tiers hold the flexible
/// share), so the demo shows the promise kept rather than the give-way order.
const MIX: [Spec; 6] = [
    Spec {
        tier: "flex0",
        bound: 0.0,
        nodes: 1,
        gpus_per_node: 2,
        profile: "llama-3.1-70b-dense-pt-8g-compile",
        kind: "dense pretraining",
    },
    Spec {
        tier: "flex1",
        bound: 0.1,
        nodes: 1,
        gpus_per_node: 4,
        profile: "gpt-oss-20b-moe-ft-8g-seq4096-bs8",
        kind: "MoE fine-tuning",
    },
    Spec {
        tier: "flex3",
        bound: 0.5,
        nodes: 2,
        gpus_per_node: 4,
        profile: "qwen3-30b-a3b-moe-ft-16g",
        kind: "MoE fine-tuning",
    },
    Spec {
        tier: "flex2",
        bound: 0.25,
        nodes: 2,
        gpus_per_node: 2,
        profile: "llama-3.1-70b-dense-pt-16g",
        kind: "dense pretraining",
    },
    Spec {
        tier: "flex3",
        bound: 0.5,
        nodes: 1,
        gpus_per_node: 4,
        profile: "qwen3-32b-dense-pt-8g-compile",
        kind: "dense pretraining",
    },
    Spec {
        tier: "flex1",
        bound: 0.1,
        nodes: 1,
        gpus_per_node: 2,
        profile: "gemma-4-26b-a4b-moe-ft-8g",
        kind: "MoE fine-tuning",
    },
];

/// A submitted job.
#[derive(Debug)]
struct Job {
    spec: Spec,
    id: u32,
}

/// One step of a simulated job's CSV: wall-clock end (Unix ms), cumulative tokens, the
/// lowest cap on its GPUs during the step (W).
#[derive(Debug, Clone, Copy)]
struct Step {
    unix_ms: u64,
    tokens: u64,
    cap_w: f64,
}

/// Prints progress lines stamped with the time since the demo started.
#[derive(Debug)]
struct Progress {
    start: Instant,
}

impl Progress {
    fn say(&self, message: impl AsRef<str>) {
        let s = self.start.elapsed().as_secs();
        println!("[{:>2}:{:02}] {}", s / 60, s % 60, message.as_ref());
        let _ = std::io::stdout().flush();
    }
}

/// A number in a range, or a message naming the range (clap exits 2 with it).
fn ranged(text: &str, ok: impl Fn(f64) -> bool, accepted: &str) -> Result<f64, String> {
    match text.trim().parse::<f64>() {
        Ok(v) if v.is_finite() && ok(v) => Ok(v),
        _ => Err(format!("accepted: {accepted}")),
    }
}

fn cut_share(text: &str) -> Result<f64, String> {
    ranged(
        text,
        |v| v > 0.0 && v < 0.9,
        "a share of the draw between 0 and 0.9, e.g. 0.3",
    )
}

fn ramp_s(text: &str) -> Result<f64, String> {
    ranged(text, |v| v >= 1.0, "at least 1 second")
}

fn hold_s(text: &str) -> Result<f64, String> {
    ranged(
        text,
        |v| v >= 15.0,
        "at least 15 seconds (the measurement window)",
    )
}

fn time_scale(text: &str) -> Result<f64, String> {
    ranged(
        text,
        |v| v >= 1.0,
        "at least 1 simulated second per real second",
    )
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    match run_demo(&cli) {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::from(1),
        Err(e) => {
            eprintln!("powerflex-demo: {e}");
            ExitCode::from(1)
        }
    }
}

fn unix_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

/// The demo starts slurmd and sets GPU power limits: root only. `/proc/self` belongs to
/// the process's effective uid.
fn check_root() -> Result<(), String> {
    use std::os::unix::fs::MetadataExt;
    let uid = std::fs::metadata("/proc/self")
        .map_err(|e| format!("cannot read /proc/self: {e}"))?
        .uid();
    if uid != 0 {
        return Err(format!(
            "must run as root (uid {uid} now): it starts slurmctld/slurmd and sets (simulated) GPU power limits"
        ));
    }
    Ok(())
}

/// The built artifacts the demo runs, from the profile it was built in.
fn artifact(name: &str) -> Result<PathBuf, String> {
    let path = profile_dir().join(name);
    if path.is_file() {
        Ok(path)
    } else {
        Err(format!(
            "{} is missing: build the workspace first (`cargo build --release`; scripts/demo.sh does)",
            path.display()
        ))
    }
}

/// `powerflexctl ARGS --format json --socket SOCKET`, parsed.
fn ctl_json(ctl: &Path, socket: &Path, args: &[&str]) -> Result<Value, String> {
    let socket = socket.to_string_lossy();
    let mut all = args.to_vec();
    all.extend(["--format", "json", "--socket", &socket]);
    let out = run(ctl, &all);
    if out.code != Some(0) {
        return Err(format!(
            "powerflexctl {}: {}",
            args.join(" "),
            out.stderr.trim()
        ));
    }
    serde_json::from_str(&out.stdout)
        .map_err(|e| format!("powerflexctl {}: not JSON ({e})", args.join(" ")))
}

/// The agent's own snapshot (its control socket's `status`).
fn agent_status(socket: &Path) -> Result<Value, String> {
    let mut stream =
        UnixStream::connect(socket).map_err(|e| format!("agent {}: {e}", socket.display()))?;
    stream
        .set_read_timeout(Some(Duration::from_secs(5)))
        .map_err(|e| e.to_string())?;
    let request = ControlRequest {
        v: VERSION,
        op: ControlOp::Status,
    };
    let mut line = serde_json::to_string(&request).map_err(|e| e.to_string())?;
    line.push('\n');
    stream
        .write_all(line.as_bytes())
        .map_err(|e| format!("agent {}: {e}", socket.display()))?;
    let mut reply = String::new();
    BufReader::new(stream)
        .read_line(&mut reply)
        .map_err(|e| format!("agent {}: {e}", socket.display()))?;
    let reply: Value = serde_json::from_str(&reply)
        .map_err(|e| format!("agent {}: not JSON ({e})", socket.display()))?;
    Ok(reply["status"].clone())
}

fn job_view(jobs: &Value, id: u32) -> Option<&Value> {
    jobs.as_array()?
        .iter()
        .find(|j| j["job"].as_str() == Some(id.to_string().as_str()))
}

fn draw_w(sims: &[Node]) -> Result<f64, String> {
    let mut sum = 0.0;
    for node in sims {
        for g in 0..GPUS_PER_NODE {
            let (_, reading) = node.reading(g).map_err(|e| e.to_string())?;
            sum += f64::from(reading.power_mw) / 1000.0;
        }
    }
    Ok(sum)
}

fn caps_w(sims: &[Node]) -> Result<Vec<f64>, String> {
    let mut caps = Vec::new();
    for node in sims {
        for g in 0..GPUS_PER_NODE {
            caps.push(f64::from(node.gpu(g).map_err(|e| e.to_string())?.power_limit_mw) / 1000.0);
        }
    }
    Ok(caps)
}

/// Polls `check` once a second until it yields a value, printing `status()` every
/// `every` seconds; fails naming `what` after `timeout`.
fn wait_for<T>(
    progress: &Progress,
    what: &str,
    timeout: Duration,
    every: Duration,
    mut check: impl FnMut() -> Result<Option<T>, String>,
    mut status: impl FnMut() -> String,
) -> Result<T, String> {
    let start = Instant::now();
    let mut last_said = Instant::now();
    loop {
        if let Some(v) = check()? {
            return Ok(v);
        }
        if start.elapsed() > timeout {
            return Err(format!(
                "timed out after {:.0} s waiting for {what}: {}",
                timeout.as_secs_f64(),
                status()
            ));
        }
        if last_said.elapsed() >= every {
            progress.say(status());
            last_said = Instant::now();
        }
        std::thread::sleep(Duration::from_secs(1));
    }
}

/// The steps a simulated job's rank logged (`powerflex_sim::steplog`); a log not yet
/// written or not readable counts as no steps, as before.
fn read_steps(path: &Path) -> Vec<Step> {
    let Ok(text) = std::fs::read_to_string(path) else {
        return Vec::new();
    };
    powerflex_sim::steplog::read_steps(&text)
        .unwrap_or_default()
        .into_iter()
        .map(|s| Step {
            tokens: s.tokens,
            cap_w: f64::from(s.cap_min_w),
            unix_ms: s.unix_ms,
        })
        .collect()
}

/// The job's step logs, one per node it runs on.
fn step_logs(jobs_dir: &Path, id: u32) -> Vec<PathBuf> {
    let prefix = format!("{id}-");
    let mut logs: Vec<PathBuf> = std::fs::read_dir(jobs_dir)
        .into_iter()
        .flatten()
        .flatten()
        .map(|e| e.path())
        .filter(|p| {
            p.file_name()
                .and_then(|n| n.to_str())
                .is_some_and(|n| n.starts_with(&prefix) && n.ends_with(".csv"))
        })
        .collect();
    logs.sort();
    logs
}

/// Tokens per SIMULATED second the whole job (all its nodes) made between two wall-clock
/// instants, and the lowest and highest cap its GPUs had meanwhile.
fn window(
    jobs_dir: &Path,
    id: u32,
    from_ms: u64,
    to_ms: u64,
    time_scale: f64,
) -> Option<(f64, f64, f64)> {
    let mut tokens = 0u64;
    let (mut lo, mut hi) = (f64::MAX, 0.0f64);
    let logs = step_logs(jobs_dir, id);
    if logs.is_empty() {
        return None;
    }
    for log in logs {
        let steps = read_steps(&log);
        let at = |t: u64| {
            steps
                .iter()
                .take_while(|s| s.unix_ms <= t)
                .last()
                .map_or(0, |s| s.tokens)
        };
        tokens += at(to_ms).saturating_sub(at(from_ms));
        for s in steps
            .iter()
            .filter(|s| s.unix_ms > from_ms && s.unix_ms <= to_ms)
        {
            lo = lo.min(s.cap_w);
            hi = hi.max(s.cap_w);
        }
    }
    let simulated_s = (to_ms.saturating_sub(from_ms)) as f64 / 1000.0 * time_scale;
    (lo <= hi && simulated_s > 0.0).then(|| (tokens as f64 / simulated_s, lo, hi))
}

fn caps_text(lo: f64, hi: f64) -> String {
    if (hi - lo).abs() < 0.5 {
        format!("{lo:.0} W")
    } else {
        format!("{lo:.0}–{hi:.0} W")
    }
}

/// Left-aligned first column, right-aligned rest.
fn table(header: &[&str], rows: &[Vec<String>]) -> String {
    let mut widths: Vec<usize> = header.iter().map(|h| h.chars().count()).collect();
    for row in rows {
        for (i, cell) in row.iter().enumerate() {
            widths[i] = widths[i].max(cell.chars().count());
        }
    }
    let line = |cells: Vec<String>| {
        let mut out = String::new();
        for (i, cell) in cells.iter().enumerate() {
            let pad = widths[i] - cell.chars().count();
            if i <= 2 {
                out.push_str(cell);
                out.push_str(&" ".repeat(pad));
            } else {
                out.push_str(&" ".repeat(pad));
                out.push_str(cell);
            }
            out.push_str("  ");
        }
        out.trim_end().to_string() + "\n"
    };
    let mut out = line(header.iter().map(|h| h.to_string()).collect());
    for row in rows {
        out.push_str(&line(row.clone()));
    }
    out
}

/// Sends SIGTERM by PID (the agents restore their GPUs on it), then SIGKILL after 10 s.
fn terminate(child: &mut Child) {
    let _ = kill(child.id(), Signal::TERM);
    let deadline = Instant::now() + Duration::from_secs(10);
    while Instant::now() < deadline {
        if let Ok(Some(_)) = child.try_wait() {
            return;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    let _ = child.kill();
    let _ = child.wait();
}

fn run_demo(cli: &Cli) -> Result<bool, String> {
    check_root()?;
    let ctld_bin = artifact("powerflex-ctld")?;
    let agent_bin = artifact("powerflexd")?;
    let ctl = artifact("powerflexctl")?;
    let simjob = artifact("powerflex-simjob")?;
    let plugin = artifact("libpower_flex.so")?;
    let nvml = artifact("libpowerflex_sim_nvml.so")?;
    let library = Library::builtin().map_err(|e| e.to_string())?;
    let progress = Progress {
        start: Instant::now(),
    };

    let out = cli
        .out
        .clone()
        .unwrap_or_else(|| repo_root().join("target").join("powerflex-demo"));
    let _ = std::fs::remove_dir_all(&out);
    let jobs_dir = out.join("jobs");
    std::fs::create_dir_all(&jobs_dir).map_err(|e| format!("{}: {e}", out.display()))?;
    let out = out
        .canonicalize()
        .map_err(|e| format!("{}: {e}", out.display()))?;
    let jobs_dir = out.join("jobs");
    // Sockets and simulator state: a short path (a Unix socket path has at most 107 bytes).
    let run_dir = std::env::temp_dir().join(format!("powerflex-demo-{}", std::process::id()));
    std::fs::create_dir_all(run_dir.join("agent")).map_err(|e| e.to_string())?;
    let key = run_dir.join("site.key");
    write_site_key(&key, "powerflex demo site key, loopback only\n");
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map_err(|e| format!("no free loopback port: {e}"))?
        .port();
    let site = out.join("powerflex.toml");
    let budget_w = f64::from(NODES * GPUS_PER_NODE) * DEFAULT_CAP_W;
    SiteBuilder::new(budget_w)
        .header(
            "powerflex demo site (written by powerflex-demo): 3 nodes x 8 SIMULATED H200.\n\
             Calibration is shortened for the demo (site defaults: settle 10 s, hold 30 s).\n\
             The demo's jobs are the site's own simulated jobs, so it trusts their token\n\
             counts and maximises total tokens/s (the default objective is relative speed).",
        )
        // Its results are judged in total tokens/s against equal-weight: the allocation
        // must maximise the same thing.
        .edit(|raw| raw.facility.objective = Some("tokens".to_string()))
        .h200(&CALIBRATION_CAPS_W, 500.0)
        .controller(([127, 0, 0, 1], port).into(), 10, 1)
        .key_file(&key)
        .controller_paths(&run_dir.join("ctld.sock"), &run_dir.join("ctld"))
        .agent_paths(
            &format!("{}/agent/%n.sock", run_dir.display()),
            &format!("{}/state/%n", run_dir.display()),
            &nvml,
        )
        .calibration_s(2.0, 2.0, 5.0)
        .write(&site)
        .map_err(|e| e.to_string())?;

    println!("powerflex demo — every GPU here is SIMULATED (libpowerflex_sim_nvml.so behind the real NVML API); the training jobs are simulated too.");
    println!("results, logs and the plot go to {}\n", out.display());
    progress.say(format!(
        "[1/7] starting a local Slurm cluster: slurmctld + {NODES} slurmd, {GPUS_PER_NODE} simulated H200 each (gres), the power_flex.so SPANK plugin"
    ));
    let mut cluster = Cluster::start(
        "demo",
        ClusterOptions {
            nodes: NODES,
            gpus_per_node: GPUS_PER_NODE,
            cpus_per_node: 8,
            plugstack: Some(format!(
                "optional {} site={} socket={}/agent/%n.sock timeout_ms=500\n",
                plugin.display(),
                site.display(),
                run_dir.display()
            )),
            ..ClusterOptions::default()
        },
    );
    let nodes = cluster.node_names().to_vec();

    progress.say("[2/7] starting powerflex-ctld and one powerflexd per node");
    let mut daemons = Children(Vec::new());
    let log =
        |name: &str| std::fs::File::create(out.join(name)).map_err(|e| format!("{name}: {e}"));
    let mut ctld = Command::new(&ctld_bin);
    ctld.args(["--config", &site.to_string_lossy()])
        .stderr(log("ctld.log")?)
        .envs(cluster.env()); // so its AdminComment annotations reach this cluster
    daemons
        .0
        .push(ctld.spawn().map_err(|e| format!("powerflex-ctld: {e}"))?);
    let mut sims = Vec::new();
    for node in &nodes {
        let sim = Node::init(
            &run_dir.join("sim").join(node),
            node,
            "H200",
            GPUS_PER_NODE,
            true,
        )
        .map_err(|e| format!("simulated node {node}: {e}"))?;
        let agent = Command::new(&agent_bin)
            .args(["--config", &site.to_string_lossy(), "--node", node])
            .args(["--sample-interval-ms", "500"])
            .env("POWERFLEX_SIM_DIR", sim.dir())
            .stderr(log(&format!("agent-{node}.log"))?)
            .spawn()
            .map_err(|e| format!("powerflexd: {e}"))?;
        daemons.0.push(agent);
        sims.push(sim);
    }
    let socket = run_dir.join("ctld.sock");
    wait_for(
        &progress,
        "the controller and every agent to connect",
        Duration::from_secs(30),
        Duration::from_secs(5),
        || {
            let Ok(listed) = ctl_json(&ctl, &socket, &["nodes"]) else {
                return Ok(None);
            };
            let live = listed
                .as_array()
                .map_or(0, |n| n.iter().filter(|n| n["live"] == true).count());
            Ok((live == nodes.len()).then_some(()))
        },
        || "waiting for the agents to reach the controller".into(),
    )?;

    progress.say(
        "[3/7] submitting training jobs (powerflex-simjob, SIMULATED) with sbatch --power-flex",
    );
    let refused = cluster.sbatch(&["--power-flex=flex7", "--wrap", "true"], None);
    match refused {
        Err(message) => progress.say(format!(
            "      sbatch --power-flex=flex7 is refused at submission: {}",
            message.lines().next().unwrap_or("").trim()
        )),
        Ok(id) => {
            return Err(format!(
                "job {id} with --power-flex=flex7 was accepted; the plugin should refuse it"
            ))
        }
    }
    let duration_sim_s = cli.time_scale * 900.0; // longer than the demo; scancel ends them
    let mut jobs = Vec::new();
    for spec in MIX {
        let wrap = format!(
            "srun bash -c 'POWERFLEX_SIM_DIR={run}/sim/$SLURMD_NODENAME exec {simjob} --profile {p} \
             --duration {duration_sim_s} --time-scale {scale} --csv {jobs}/$SLURM_JOB_ID-$SLURMD_NODENAME.csv'",
            run = run_dir.display(),
            simjob = simjob.display(),
            p = spec.profile,
            scale = cli.time_scale,
            jobs = jobs_dir.display()
        );
        let id = cluster
            .sbatch(
                &[
                    &format!("-N{}", spec.nodes),
                    &format!("--gres=gpu:{}", spec.gpus_per_node),
                    &format!("--power-flex={}", spec.tier),
                    &format!("--job-name={}", spec.profile),
                    "--output",
                    &out.join("jobs").join("slurm-%j.out").to_string_lossy(),
                    "--wrap",
                    &wrap,
                ],
                None,
            )
            .map_err(|e| format!("sbatch {} ({}): {e}", spec.profile, spec.tier))?;
        progress.say(format!(
            "      job {id}: --power-flex={} {} ({}), {} node(s) x {} GPU(s)",
            spec.tier, spec.profile, spec.kind, spec.nodes, spec.gpus_per_node
        ));
        jobs.push(Job { spec, id });
    }
    wait_for(
        &progress,
        "every job to run",
        Duration::from_secs(60),
        Duration::from_secs(10),
        || {
            Ok(jobs
                .iter()
                .all(|j| cluster.job_state(j.id).as_deref() == Some("RUNNING"))
                .then_some(()))
        },
        || {
            jobs.iter()
                .map(|j| format!("{} {}", j.id, cluster.job_state(j.id).unwrap_or_default()))
                .collect::<Vec<_>>()
                .join(", ")
        },
    )?;

    let calibration_started = Instant::now();
    progress.say("[4/7] calibrating: each capped job walks its tier's caps (700 W down) while it trains; flex0 is never capped");
    let agent_socket = |node: &str| run_dir.join("agent").join(format!("{node}.sock"));
    let calibration_state = || -> String {
        let mut parts = Vec::new();
        for node in &nodes {
            if let Ok(status) = agent_status(&agent_socket(node)) {
                for j in status["jobs"].as_array().into_iter().flatten() {
                    let level = j["calibration_level_w"]
                        .as_f64()
                        .map_or(String::new(), |l| format!(" at {l:.0} W"));
                    parts.push(format!(
                        "{}@{node} {}{level}",
                        j["job"].as_str().unwrap_or("?"),
                        j["calibration"].as_str().unwrap_or("?")
                    ));
                }
            }
        }
        format!(
            "calibrating ({:.0} s, usually ~45 s): {}",
            calibration_started.elapsed().as_secs_f64(),
            parts.join(", ")
        )
    };
    wait_for(
        &progress,
        "every capped job's measured curve at the controller",
        Duration::from_secs(240),
        Duration::from_secs(10),
        || {
            let Ok(listed) = ctl_json(&ctl, &socket, &["jobs"]) else {
                return Ok(None);
            };
            let done = jobs.iter().all(|j| {
                job_view(&listed, j.id).is_some_and(|v| {
                    (j.spec.tier == "flex0" || v["pfi_source"] == "measured")
                        && v["throughput"].as_f64().is_some()
                })
            });
            Ok(done.then_some(()))
        },
        calibration_state,
    )?;
    let calibration_wall_s = calibration_started.elapsed().as_secs_f64();
    progress.say(format!(
        "      every curve measured in {calibration_wall_s:.0} s; waiting for the caps to return to {DEFAULT_CAP_W:.0} W"
    ));
    wait_for(
        &progress,
        "every GPU back at its default cap after calibration",
        Duration::from_secs(60),
        Duration::from_secs(10),
        || {
            Ok(caps_w(&sims)?
                .iter()
                .all(|&c| c >= DEFAULT_CAP_W)
                .then_some(()))
        },
        || "some GPUs are still capped".into(),
    )?;
    // Calibration figures, from each job's first node (all its nodes walk together).
    let mut calibration: Vec<(u32, Value)> = Vec::new();
    for node in &nodes {
        let status = agent_status(&agent_socket(node))?;
        for j in status["jobs"].as_array().into_iter().flatten() {
            let id: u32 = j["job"].as_str().and_then(|s| s.parse().ok()).unwrap_or(0);
            if !calibration.iter().any(|(seen, _)| *seen == id) {
                calibration.push((id, j.clone()));
            }
        }
    }

    progress.say("[5/7] steady state before the event: measuring every job's tokens/s for 10 s");
    std::thread::sleep(Duration::from_secs(2));
    let before_from = unix_ms();
    let mut before_draw = Vec::new();
    for _ in 0..10 {
        before_draw.push(draw_w(&sims)?);
        std::thread::sleep(Duration::from_secs(1));
    }
    let before_to = unix_ms();
    let draw_before = before_draw.iter().sum::<f64>() / before_draw.len() as f64;
    let target_w = (draw_before * (1.0 - cli.cut)).floor();
    let jobs_before = ctl_json(&ctl, &socket, &["jobs"])?;

    let duration_s = cli.ramp_s * 2.0 + cli.hold_s;
    progress.say(format!(
        "[6/7] grid event: {:.0} % below the draw of {} -> budget {}, ramp {:.0} s, hold {:.0} s, ramp back {:.0} s",
        cli.cut * 100.0,
        Watts(draw_before),
        Watts(target_w),
        cli.ramp_s,
        cli.hold_s,
        cli.ramp_s
    ));
    let event_start = Instant::now();
    let event_start_ms = unix_ms();
    let add = run(
        &ctl,
        &[
            "event",
            "add",
            "--target",
            &format!("{target_w}W"),
            "--start",
            "now",
            "--duration",
            &format!("{duration_s}s"),
            "--ramp",
            &format!("{}s", cli.ramp_s),
            "--socket",
            &socket.to_string_lossy(),
        ],
    );
    if add.code != Some(0) {
        return Err(format!("powerflexctl event add: {}", add.stderr.trim()));
    }
    // The caps need a few seconds after the ramp to reach every GPU and the draw to follow.
    let settle_s = 5.0;
    let during_from_s = cli.ramp_s + settle_s;
    let during_to_s = cli.ramp_s + cli.hold_s - 1.0;
    let mut draw_samples: Vec<(f64, f64, f64)> = Vec::new(); // (t, draw, budget)
    let mut whatif: Option<(Value, Value)> = None;
    let mut last_said = Instant::now() - Duration::from_secs(60);
    while event_start.elapsed().as_secs_f64() < during_to_s {
        let t = event_start.elapsed().as_secs_f64();
        let draw = draw_w(&sims)?;
        let status = ctl_json(&ctl, &socket, &["status"]).unwrap_or(Value::Null);
        let budget = status["budget_w"].as_f64().unwrap_or(f64::NAN);
        if t >= during_from_s - 1.0 {
            draw_samples.push((t, draw, target_w));
        }
        if whatif.is_none() && t >= during_from_s + (during_to_s - during_from_s) / 2.0 {
            // The alternatives, on the controller's own curves and views, at this moment.
            whatif = Some((
                ctl_json(&ctl, &socket, &["whatif", "--policy", "equal"])?,
                ctl_json(&ctl, &socket, &["whatif", "--policy", "optimal"])?,
            ));
        }
        if last_said.elapsed() >= Duration::from_secs(10) {
            let phase = if t < cli.ramp_s {
                "ramping down"
            } else {
                "holding"
            };
            progress.say(format!(
                "      event {phase}: budget {}, draw {} (SIMULATED GPUs), {:.0} s of the event left",
                Watts(budget),
                Watts(draw),
                (duration_s - t).max(0.0)
            ));
            last_said = Instant::now();
        }
        std::thread::sleep(Duration::from_secs(1));
    }
    let during_from = event_start_ms + (during_from_s * 1000.0) as u64;
    let during_to = event_start_ms + (during_to_s * 1000.0) as u64;
    let jobs_during = ctl_json(&ctl, &socket, &["jobs"])?;
    progress.say("      ramping back up");
    wait_for(
        &progress,
        "the event to end and the caps to return",
        Duration::from_secs_f64(duration_s + 60.0),
        Duration::from_secs(10),
        || {
            let status = ctl_json(&ctl, &socket, &["status"])?;
            let over = status["active_event"].is_null()
                && event_start.elapsed().as_secs_f64() >= duration_s;
            Ok((over && caps_w(&sims)?.iter().all(|&c| c >= DEFAULT_CAP_W)).then_some(()))
        },
        || {
            format!(
                "event ending: {:.0} s left, draw {}",
                (duration_s - event_start.elapsed().as_secs_f64()).max(0.0),
                draw_w(&sims)
                    .map(Watts)
                    .map_or("?".into(), |w| w.to_string())
            )
        },
    )?;
    let plot = out.join("powerflex-demo.svg");
    let plotted = run(
        &ctl,
        &[
            "plot",
            "--out",
            &plot.to_string_lossy(),
            "--title",
            "powerflex demo (SIMULATED GPUs): budget, draw and per-job caps through a grid event",
            "--socket",
            &socket.to_string_lossy(),
        ],
    );
    if plotted.code != Some(0) {
        return Err(format!("powerflexctl plot: {}", plotted.stderr.trim()));
    }

    progress.say("[7/7] stopping: scancel every job, then the agents and the controller (SIGTERM, by PID), then Slurm");
    for job in &jobs {
        cluster.run("scancel", &[&job.id.to_string()]);
    }
    for job in &jobs {
        cluster.wait_job_done(job.id, Duration::from_secs(60));
    }
    let restored_by_agents = wait_for(
        &progress,
        "the agents to restore every GPU's default cap",
        Duration::from_secs(30),
        Duration::from_secs(10),
        || {
            Ok(caps_w(&sims)?
                .iter()
                .all(|&c| c == DEFAULT_CAP_W)
                .then_some(true))
        },
        || "waiting for the epilogs".into(),
    )
    .unwrap_or(false);
    for child in daemons.0.iter_mut().rev() {
        terminate(child);
    }
    cluster.stop();
    let caps_after = caps_w(&sims)?;
    let all_default = caps_after.iter().all(|&c| c == DEFAULT_CAP_W);

    // ---- results ----
    let (equal, optimal) = whatif.ok_or("the event ended before the what-if snapshot")?;
    let equal_cap = |id: u32| -> Option<f64> {
        equal["allocation"]["jobs"]
            .as_array()?
            .iter()
            .find(|j| j["id"].as_str() == Some(id.to_string().as_str()))?["cap_w"]
            .as_f64()
    };
    let optimal_cap = |id: u32| -> Option<f64> {
        optimal["allocation"]["jobs"]
            .as_array()?
            .iter()
            .find(|j| j["id"].as_str() == Some(id.to_string().as_str()))?["cap_w"]
            .as_f64()
    };
    let mut rows = Vec::new();
    let mut summary_jobs = Vec::new();
    let (mut total_before, mut total_during) = (0.0, 0.0);
    let (mut total_equal, mut total_optimal_true) = (0.0, 0.0);
    let mut promises_held = true;
    for job in &jobs {
        let profile = library.find(job.spec.profile).map_err(|e| e.to_string())?;
        let physics = profile.physics;
        let id = job.id;
        let (before, b_lo, b_hi) = window(&jobs_dir, id, before_from, before_to, cli.time_scale)
            .ok_or(format!("job {id}: no steps logged before the event"))?;
        let (during, d_lo, d_hi) = window(&jobs_dir, id, during_from, during_to, cli.time_scale)
            .ok_or(format!("job {id}: no steps logged during the event"))?;
        let slowdown = 1.0 - during / before;
        let view = job_view(&jobs_before, id).cloned().unwrap_or(Value::Null);
        let walked: Vec<f64> = view["points"]
            .as_object()
            .and_then(|m| m.values().next())
            .and_then(|p| p.as_array())
            .map(|p| p.iter().filter_map(|x| x[0].as_f64()).collect())
            .unwrap_or_default();
        let measured_pfi = (view["pfi_source"] == "measured")
            .then(|| view["pfi"].as_f64())
            .flatten();
        let true_grid: &[f64] = if walked.len() >= 2 {
            &walked
        } else {
            &CALIBRATION_CAPS_W
        };
        let true_pfi = physics.pfi_on(true_grid);
        let rel = |cap: f64| physics.at_cap(Watts(cap)).relative_throughput;
        // Jobs the allocation does not steer (flex0) run the same under either policy.
        let (eq_tps, opt_tps) = match (equal_cap(id), optimal_cap(id)) {
            (Some(e), Some(o)) => (before * rel(e), before * rel(o)),
            _ => (during, during),
        };
        let eq_slowdown = 1.0 - eq_tps / before;
        total_before += before;
        total_during += during;
        total_equal += eq_tps;
        total_optimal_true += opt_tps;
        let within = slowdown <= job.spec.bound + SLOWDOWN_TOLERANCE
            && (job.spec.tier != "flex0" || d_lo >= DEFAULT_CAP_W);
        promises_held &= within;
        let cal = calibration
            .iter()
            .find(|(seen, _)| *seen == id)
            .map(|(_, c)| c.clone())
            .unwrap_or(Value::Null);
        let top = walked
            .first()
            .and_then(|_| view["points"].as_object()?.values().next()?[0][2].as_f64());
        let cost_uncapped_s = match (cal["calibration_cost"].as_f64(), top) {
            (Some(cost), Some(top)) if top > 0.0 => Some(cost / top * cli.time_scale),
            _ => None,
        };
        rows.push(vec![
            id.to_string(),
            job.spec.tier.to_string(),
            job.spec.profile.to_string(),
            format!("{}x{}", job.spec.nodes, job.spec.gpus_per_node),
            true_pfi.map_or("-".into(), |p| format!("{p:.2}")),
            measured_pfi.map_or("not walked".into(), |p| format!("{p:.2}")),
            caps_text(b_lo, b_hi),
            caps_text(d_lo, d_hi),
            format!("{before:.0}"),
            format!("{during:.0}"),
            format!("{:.1} %", slowdown * 100.0),
            format!(
                "{:.0} %{}",
                job.spec.bound * 100.0,
                if within { "" } else { " BROKEN" }
            ),
            equal_cap(id).map_or("700 W".into(), |c| format!("{c:.0} W")),
            format!(
                "{:.1} %{}",
                eq_slowdown * 100.0,
                if eq_slowdown > job.spec.bound + 1e-9 {
                    " (over bound)"
                } else {
                    ""
                }
            ),
        ]);
        summary_jobs.push(json!({
            "job": id, "tier": job.spec.tier, "profile": job.spec.profile,
            "nodes": job.spec.nodes, "gpus_per_node": job.spec.gpus_per_node,
            "bound": job.spec.bound, "pfi_true": true_pfi, "pfi_measured": measured_pfi,
            "caps_walked_w": walked, "cap_before_w": [b_lo, b_hi], "cap_during_w": [d_lo, d_hi],
            "tokens_per_s_before": before, "tokens_per_s_during": during, "slowdown": slowdown,
            "within_bound": within, "equal_cap_w": equal_cap(id), "equal_slowdown": eq_slowdown,
            "calibration_s": cal["calibration_s"], "calibration_cost_uncapped_s": cost_uncapped_s,
        }));
    }
    let during_samples: Vec<&(f64, f64, f64)> = draw_samples
        .iter()
        .filter(|s| s.0 >= during_from_s)
        .collect();
    let max_draw = during_samples.iter().map(|s| s.1).fold(0.0, f64::max);
    let mean_draw =
        during_samples.iter().map(|s| s.1).sum::<f64>() / during_samples.len().max(1) as f64;
    let draw_ok = max_draw <= target_w * (1.0 + DRAW_TOLERANCE);

    println!("\n== per job (tokens/s per SIMULATED second, summed over the job's nodes; slowdown = 1 - during/before)");
    print!(
        "{}",
        table(
            &[
                "job",
                "tier",
                "profile",
                "nodes x GPUs",
                "PFI true",
                "PFI measured",
                "cap before",
                "cap during",
                "tok/s before",
                "tok/s during",
                "slowdown",
                "bound",
                "equal-weight cap",
                "slowdown under equal",
            ],
            &rows
        )
    );
    println!("\n== calibration (measured while the jobs trained; cost = tokens lost vs running uncapped, in seconds of uncapped training, simulated time)");
    let cal_rows: Vec<Vec<String>> = summary_jobs
        .iter()
        .map(|j| {
            vec![
                j["job"].to_string(),
                j["tier"].as_str().unwrap_or("").to_string(),
                j["profile"].as_str().unwrap_or("").to_string(),
                j["caps_walked_w"]
                    .as_array()
                    .filter(|c| c.len() >= 2)
                    .map_or("not walked (flex0)".into(), |c| {
                        format!(
                            "{}→{} W",
                            c.first().and_then(Value::as_f64).unwrap_or(0.0),
                            c.last().and_then(Value::as_f64).unwrap_or(0.0)
                        )
                    }),
                j["calibration_s"]
                    .as_f64()
                    .map_or("-".into(), |s| format!("{s:.0} s")),
                j["calibration_cost_uncapped_s"]
                    .as_f64()
                    .map_or("-".into(), |s| format!("{s:.0} s")),
            ]
        })
        .collect();
    print!(
        "{}",
        table(
            &["job", "tier", "profile", "caps walked", "wall time", "cost"],
            &cal_rows
        )
    );
    let kept = |x: f64| x / total_before * 100.0;
    println!(
        "\n== cluster: {} SIMULATED H200 on {NODES} nodes",
        NODES * GPUS_PER_NODE
    );
    println!("  facility budget                 {}", Watts(budget_w));
    println!("  draw before the event           {}", Watts(draw_before));
    println!(
        "  grid event budget               {} ({:.0} % below the draw before)",
        Watts(target_w),
        cli.cut * 100.0
    );
    println!(
        "  draw during the event           mean {}, highest {} over {} one-second samples after the ramp: {}",
        Watts(mean_draw),
        Watts(max_draw),
        during_samples.len(),
        if draw_ok { "within the budget" } else { "OVER THE BUDGET" }
    );
    println!("  tokens/s before                 {total_before:.0}");
    println!(
        "  tokens/s during, powerflex      {total_during:.0} ({:.1} % kept; measured by the jobs)",
        kept(total_during)
    );
    println!(
        "  tokens/s during, equal-weight   {total_equal:.0} ({:.1} % kept; `powerflexctl whatif --policy equal` on the same curves and budget, scored on the profiles' true curves)",
        kept(total_equal)
    );
    println!(
        "  powerflex on the same footing   {total_optimal_true:.0} ({:.1} % kept; its own caps scored the same way)",
        kept(total_optimal_true)
    );
    println!(
        "  powerflex keeps                 {:+.0} tokens/s ({:+.1} %) more than equal-weight",
        total_optimal_true - total_equal,
        (total_optimal_true / total_equal - 1.0) * 100.0
    );
    println!("  calibration                     every curve measured {calibration_wall_s:.0} s after the jobs started");
    println!(
        "\nplot (budget and draw over time, per-job caps): {}",
        plot.display()
    );
    println!(
        "every simulated GPU at its default cap ({DEFAULT_CAP_W:.0} W) after the jobs ended: {}; after shutdown: {}",
        if restored_by_agents { "yes" } else { "NO" },
        if all_default { "yes" } else { "NO" }
    );
    let summary = json!({
        "simulated": true,
        "jobs": summary_jobs,
        "cluster": {
            "gpus": NODES * GPUS_PER_NODE, "nodes": NODES, "budget_w": budget_w,
            "draw_before_w": draw_before, "event_budget_w": target_w, "cut": cli.cut,
            "draw_during_mean_w": mean_draw, "draw_during_max_w": max_draw,
            "draw_samples": during_samples.len(),
            "tokens_per_s_before": total_before, "tokens_per_s_during": total_during,
            "tokens_per_s_equal": total_equal, "tokens_per_s_optimal_true": total_optimal_true,
            "calibration_wall_s": calibration_wall_s,
            "caps_restored_at_job_end": restored_by_agents, "caps_default_after_shutdown": all_default,
        },
        "whatif": { "equal": equal, "optimal": optimal },
        "controller_jobs_during": jobs_during,
    });
    let summary_path = out.join("summary.json");
    std::fs::write(
        &summary_path,
        serde_json::to_string_pretty(&summary).map_err(|e| e.to_string())?,
    )
    .map_err(|e| format!("{}: {e}", summary_path.display()))?;
    println!("summary (JSON): {}", summary_path.display());
    let _ = std::fs::remove_dir_all(&run_dir);
    let ok = promises_held && draw_ok && restored_by_agents && all_default;
    if ok {
        println!("\nevery tier's promise held, the draw stayed within the event's budget, and every GPU is back at its default cap.");
    } else {
        println!(
            "\nFAILED: see the lines marked BROKEN, OVER or NO above; the daemons' logs are in {}",
            out.display()
        );
    }
    Ok(ok)
}
