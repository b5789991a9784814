//! `powerflex-simjob`: a SIMULATED training job, a stand-in for real training inside Slurm
//! jobs.
//!
//! It claims the GPUs Slurm gave it (`SLURM_JOB_GPUS` / `CUDA_VISIBLE_DEVICES`, indices or
//! UUIDs) on its node's simulated GPUs (`POWERFLEX_SIM_DIR`, `%n` = node name), marks them
//! busy with a workload profile, and runs steps paced by the current power limits: each
//! step takes `--step-s` simulated seconds at full speed, longer under a cap, and the
//! slowest GPU sets the pace (synchronous data-parallel training). It prints one CSV line
//! per step (cumulative tokens, simulated seconds, tokens per simulated second, the caps,
//! and the wall-clock end of the step in Unix ms), reports progress to the node agent when `POWERFLEX_PROGRESS` names a socket
//! (no agent, no error), and releases its GPUs on exit, SIGTERM and SIGINT.
//!
//! `--time-scale X` runs X simulated seconds per real second: the demo's hour of training
//! takes minutes. Throughput in its output is per simulated second.
//!
//! Exit codes: 0 finished (or stopped by SIGTERM/SIGINT); 1 could not start (no GPUs, no
//! simulated node, unknown profile, GPUs held by another job); 2 usage error.

use std::io::Write;
use std::os::unix::net::UnixStream;
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use clap::Parser;
use powerflex_core::gpus::{job_gpus_from_env, parse_gpu_list, GpuRef};
use powerflex_core::Watts;
use powerflex_daemon::signals::stop_signal_cell;
use powerflex_proto::{ProgressReport, PROGRESS_ENV, VERSION};
use powerflex_sim::profiles::{Library, Profile};
use powerflex_sim::state::{dir_from_env, Node, Workload};
use powerflex_sim::steplog::{StepLogWriter, StepRow};

#[derive(Debug, Parser)]
#[command(
    name = "powerflex-simjob",
    version,
    about = "A SIMULATED training job on simulated GPUs, paced by their power caps"
)]
#[command(group(clap::ArgGroup::new("length").args(["duration", "steps"])))]
struct Cli {
    /// Workload profile from the library (`powerflex-sim profiles` lists them).
    #[arg(long, value_parser = builtin_profile)]
    profile: Profile,
    /// Stop after this many simulated seconds.
    #[arg(long, value_name = "S", value_parser = positive_s)]
    duration: Option<f64>,
    /// Stop after this many steps [default: run until SIGTERM].
    #[arg(long, value_name = "N")]
    steps: Option<u64>,
    /// Simulated seconds per real second.
    #[arg(long, default_value = "1", value_name = "X", value_parser = positive_scale)]
    time_scale: f64,
    /// Simulated seconds one step takes uncapped.
    #[arg(long, default_value = "1", value_name = "S", value_parser = positive_s)]
    step_s: f64,
    /// Node state directory [default: $POWERFLEX_SIM_DIR, %n = $SLURMD_NODENAME].
    #[arg(long, value_name = "DIR")]
    sim_dir: Option<PathBuf>,
    /// GPUs to use, indices or UUIDs [default: $SLURM_JOB_GPUS, else $CUDA_VISIBLE_DEVICES].
    #[arg(long, value_name = "LIST", value_parser = gpu_list)]
    gpus: Option<GpuList>,
    /// Job id [default: $SLURM_JOB_ID, else local-PID].
    #[arg(long, value_name = "ID")]
    job_id: Option<String>,
    /// Write the per-step CSV here instead of stdout.
    #[arg(long, value_name = "FILE")]
    csv: Option<PathBuf>,
}

/// `--gpus`, parsed (a newtype: clap would read a bare `Vec` as a repeated flag).
#[derive(Debug, Clone)]
struct GpuList(Vec<GpuRef>);

fn gpu_list(text: &str) -> Result<GpuList, String> {
    parse_gpu_list(text).map(GpuList).map_err(|e| e.to_string())
}

/// A profile of the built-in library; an unknown name lists the known ones.
fn builtin_profile(name: &str) -> Result<Profile, String> {
    let library = Library::builtin().map_err(|e| e.to_string())?;
    library.find(name).cloned().map_err(|e| e.to_string())
}

fn positive(text: &str, accepted: &str) -> Result<f64, String> {
    match text.trim().parse::<f64>() {
        Ok(v) if v.is_finite() && v > 0.0 => Ok(v),
        _ => Err(format!(
            "\"{}\" is not accepted; accepted: {accepted}",
            text.escape_default()
        )),
    }
}

fn positive_s(text: &str) -> Result<f64, String> {
    positive(
        text,
        "a positive number of simulated seconds, e.g. 1 or 0.5",
    )
}

fn positive_scale(text: &str) -> Result<f64, String> {
    positive(
        text,
        "a positive number of simulated seconds per real second, e.g. 20",
    )
}

/// Releases the job's GPUs however `main` ends.
struct Claim<'a> {
    node: &'a Node,
}

impl Drop for Claim<'_> {
    fn drop(&mut self) {
        if let Err(e) = self.node.release(std::process::id()) {
            eprintln!("powerflex-simjob: could not release the simulated GPUs: {e}");
        }
    }
}

/// Wall-clock time of a step's end, ms since the Unix epoch: lines up the steps of a
/// job's ranks on different nodes with each other and with events outside the job.
fn unix_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

/// Best-effort progress reporting: never blocks the job for long, never fails it.
struct Reporter {
    path: Option<PathBuf>,
    stream: Option<UnixStream>,
    next_attempt: Instant,
}

impl Reporter {
    fn from_env() -> Reporter {
        Reporter {
            path: std::env::var_os(PROGRESS_ENV)
                .filter(|v| !v.is_empty())
                .map(PathBuf::from),
            stream: None,
            next_attempt: Instant::now(),
        }
    }

    fn send(&mut self, report: &ProgressReport) {
        let Some(path) = &self.path else { return };
        if self.stream.is_none() && Instant::now() >= self.next_attempt {
            match UnixStream::connect(path) {
                Ok(s) => {
                    let _ = s.set_write_timeout(Some(Duration::from_millis(100)));
                    self.stream = Some(s);
                }
                Err(_) => self.next_attempt = Instant::now() + Duration::from_secs(5),
            }
        }
        if let Some(stream) = &mut self.stream {
            if stream.write_all(report.to_line().as_bytes()).is_err() {
                self.stream = None;
                self.next_attempt = Instant::now() + Duration::from_secs(5);
            }
        }
    }
}

fn resolve_gpus(node: &Node, refs: &[GpuRef]) -> Result<Vec<u32>, String> {
    refs.iter()
        .map(|r| match r {
            GpuRef::Index(i) if *i < node.gpu_count() => Ok(*i),
            GpuRef::Index(i) => Err(format!(
                "GPU index {i} does not exist; the node has {}",
                node.gpu_count()
            )),
            GpuRef::Uuid(u) => node.index_of_uuid(u).map_err(|e| e.to_string()),
        })
        .collect()
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    match run(cli) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("powerflex-simjob: error: {e}");
            ExitCode::from(1)
        }
    }
}

fn run(cli: Cli) -> Result<(), String> {
    let profile = &cli.profile;
    let dir = match &cli.sim_dir {
        Some(d) => d.clone(),
        None => dir_from_env().map_err(|e| e.to_string())?,
    };
    let node = Node::open(&dir).map_err(|e| e.to_string())?;
    let refs = match &cli.gpus {
        Some(GpuList(list)) => list.clone(),
        None => job_gpus_from_env(|name| std::env::var(name).ok()).map_err(|e| e.to_string())?,
    };
    if refs.is_empty() {
        return Err("no GPUs: this job was given none (set SLURM_STEP_GPUS, SLURM_JOB_GPUS or CUDA_VISIBLE_DEVICES, or pass --gpus)".into());
    }
    let gpus = resolve_gpus(&node, &refs)?;
    let job_id = cli
        .job_id
        .clone()
        .or_else(|| std::env::var("SLURM_JOB_ID").ok())
        .unwrap_or_else(|| format!("local-{}", std::process::id()));

    // SIGTERM/SIGINT end the job after the step in progress, with its GPUs released.
    let stop_signal = stop_signal_cell().map_err(|e| e.to_string())?;
    let stopped = || stop_signal.load(Ordering::SeqCst) != 0;
    let workload = Workload {
        job_id: job_id.clone(),
        pid: std::process::id(),
        profile: profile.name.clone(),
        physics: profile.physics,
        table: profile.table.clone(),
        memory_used_bytes: (node.model().memory_bytes as f64 * profile.memory_used_fraction) as u64,
    };
    node.claim(&gpus, &workload).map_err(|e| e.to_string())?;
    let _claim = Claim { node: &node };

    let out: Box<dyn Write> = match &cli.csv {
        Some(path) => Box::new(
            std::fs::File::create(path)
                .map_err(|e| format!("cannot write {}: {e}", path.display()))?,
        ),
        None => Box::new(std::io::stdout()),
    };
    let tokens_per_step = profile.tokens_per_s_per_gpu * gpus.len() as f64 * cli.step_s;
    let comment = format!(
        "powerflex-simjob: SIMULATED training job {job_id}, profile {} on {} simulated {} GPU(s) {:?} of node {}, time scale {}",
        profile.name,
        gpus.len(),
        node.model().key,
        gpus,
        node.info().node,
        cli.time_scale
    );
    let mut log = StepLogWriter::new(out, &comment).map_err(|e| e.to_string())?;

    let mut reporter = Reporter::from_env();
    let (mut step, mut tokens, mut elapsed_sim) = (0u64, 0u64, 0.0f64);
    let mut step_end = Instant::now();
    loop {
        if stopped()
            || cli.steps.is_some_and(|n| step >= n)
            || cli.duration.is_some_and(|d| elapsed_sim >= d)
        {
            break;
        }
        // Caps now; the slowest GPU sets the pace of the whole step.
        let mut slowest = 1.0f64;
        let (mut cap_min, mut cap_max) = (f64::MAX, 0.0f64);
        for &g in &gpus {
            let gpu = node.gpu(g).map_err(|e| e.to_string())?;
            let cap_w = f64::from(gpu.power_limit_mw) / 1000.0;
            cap_min = cap_min.min(cap_w);
            cap_max = cap_max.max(cap_w);
            slowest = slowest.min(profile.physics.at_cap(Watts(cap_w)).relative_throughput);
        }
        let step_sim = cli.step_s / slowest.max(1e-3);
        // Steps end on a schedule, not "sleep after the last one": the time spent on
        // bookkeeping and the scheduler's lateness do not accumulate, so the job's rate
        // is the physics' rate even on a loaded machine.
        let step_real = Duration::from_secs_f64(step_sim / cli.time_scale);
        step_end = step_end.max(Instant::now() - step_real) + step_real;
        while Instant::now() < step_end {
            if stopped() {
                break;
            }
            // saturating: the deadline may pass between the check above and this line.
            std::thread::sleep(
                step_end
                    .saturating_duration_since(Instant::now())
                    .min(Duration::from_millis(50)),
            );
        }
        if stopped() {
            break; // an interrupted step did not complete
        }
        step += 1;
        tokens += tokens_per_step.round() as u64;
        elapsed_sim += step_sim;
        // A log that cannot be written (full disk, closed pipe) must not stop training,
        // as a real job's logging would not: the progress report still goes out.
        let _ = log.step(&StepRow {
            simulated: true,
            step,
            tokens,
            elapsed_s: (elapsed_sim * 1000.0).round() / 1000.0,
            tokens_per_s: (tokens_per_step / step_sim * 10.0).round() / 10.0,
            cap_min_w: cap_min.round() as u32,
            cap_max_w: cap_max.round() as u32,
            unix_ms: unix_ms(),
        });
        reporter.send(&ProgressReport {
            v: VERSION,
            job_id: job_id.clone(),
            tokens,
            steps: step,
        });
    }
    let signal = stop_signal.load(Ordering::SeqCst);
    if signal != 0 {
        eprintln!("powerflex-simjob: SIMULATED job {job_id} stopped by signal {signal} after {step} steps; GPUs released");
    }
    Ok(())
}
