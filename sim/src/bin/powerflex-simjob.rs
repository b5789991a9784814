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
//! `--phases idle:60,PROFILE:600` runs the job in phases of simulated seconds, one after
//! the other, and ends after the last: `idle` holds the GPUs at idle power with no
//! progress (setup, data loading), a profile name trains with that profile. The GPUs'
//! workload is switched in the simulated state at each boundary, so NVML's power and
//! clocks follow, as they would when a real job changes what it runs.
//!
//! Steps are paced against elapsed simulated time, not slept one after the other: after a
//! stall (a starved process on a loaded machine) the steps the caps allowed in the
//! meantime complete at once, so the reported rate is the caps' rate, not the scheduler's.
//!
//! `--time-scale X` runs X simulated seconds per real second: the demo's hour of training
//! takes minutes. Throughput in its output is per simulated second.
//!
//! Exit codes: 0 finished (or stopped by SIGTERM/SIGINT); 1 could not start (no GPUs, no
//! simulated node, unknown profile, GPUs held by another job); 2 usage error.

use powerflex_daemon::clock::unix_ms;
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
#[command(group(clap::ArgGroup::new("length").args(["duration", "steps", "phases"])))]
#[command(group(clap::ArgGroup::new("work").args(["profile", "phases"]).required(true)))]
struct Cli {
    /// Workload profile from the library (`powerflex-sim profiles` lists them).
    #[arg(long, value_parser = builtin_profile)]
    profile: Option<Profile>,
    /// Phases, `LOAD:SECONDS,...` in simulated seconds; LOAD is `idle` or a profile. The
    /// job ends after the last phase.
    #[arg(long, value_name = "PHASES", value_parser = phase_list)]
    phases: Option<Phases>,
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
    /// Report this many times the tokens the job makes: a lying job, for the attack tests
    /// (inflated tokens must buy no watts).
    #[arg(long, default_value = "1", value_name = "X", value_parser = positive_factor)]
    report_scale: f64,
}

/// `--gpus`, parsed (a newtype: clap would read a bare `Vec` as a repeated flag).
#[derive(Debug, Clone)]
struct GpuList(Vec<GpuRef>);

fn gpu_list(text: &str) -> Result<GpuList, String> {
    parse_gpu_list(text).map(GpuList).map_err(|e| e.to_string())
}

/// What a phase runs on the job's GPUs.
#[derive(Debug, Clone)]
enum Load {
    /// GPUs held, nothing running: idle power, no steps.
    Idle,
    Train(Box<Profile>),
}

#[derive(Debug, Clone)]
struct Phase {
    load: Load,
    /// Simulated seconds.
    length_s: f64,
}

/// `--phases`, parsed (a newtype, as for `--gpus`).
#[derive(Debug, Clone)]
struct Phases(Vec<Phase>);

const PHASES_ACCEPTED: &str =
    "a comma list of LOAD:SECONDS, LOAD `idle` or a profile name, SECONDS a positive number of simulated seconds, e.g. idle:60,qwen3-30b-a3b-moe-ft-8g:600";

fn phase_list(text: &str) -> Result<Phases, String> {
    let library = Library::builtin().map_err(|e| e.to_string())?;
    let phases = text
        .split(',')
        .map(|item| {
            let bad = |why: String| {
                format!(
                    "phase \"{}\" is not accepted ({why}); accepted: {PHASES_ACCEPTED}",
                    item.escape_default()
                )
            };
            let (load, length) = item
                .trim()
                .rsplit_once(':')
                .ok_or_else(|| bad("no `:SECONDS`".into()))?;
            let length_s = match length.trim().parse::<f64>() {
                Ok(v) if v.is_finite() && v > 0.0 => v,
                _ => return Err(bad(format!("length \"{}\"", length.escape_default()))),
            };
            let load = match load.trim() {
                "idle" => Load::Idle,
                name => Load::Train(Box::new(
                    library
                        .find(name)
                        .cloned()
                        .map_err(|e| bad(e.to_string()))?,
                )),
            };
            Ok(Phase { load, length_s })
        })
        .collect::<Result<Vec<_>, _>>()?;
    if !phases.iter().any(|p| matches!(p.load, Load::Train(_))) {
        return Err(format!(
            "\"{}\" has no training phase; accepted: {PHASES_ACCEPTED}",
            text.escape_default()
        ));
    }
    Ok(Phases(phases))
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

fn positive_factor(text: &str) -> Result<f64, String> {
    positive(text, "a positive factor, e.g. 1000")
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

/// The job's phases: `--phases`, or one training phase with no end.
fn phases_of(cli: &Cli) -> Result<Vec<Phase>, String> {
    match (&cli.phases, &cli.profile) {
        (Some(Phases(phases)), _) => Ok(phases.clone()),
        (None, Some(profile)) => Ok(vec![Phase {
            load: Load::Train(Box::new(profile.clone())),
            length_s: f64::INFINITY,
        }]),
        (None, None) => Err("no work: pass --profile or --phases".into()),
    }
}

/// The workload a phase puts on the GPUs. An idle phase is claimed with the physics of the
/// job's first training profile (unused while idle: only the claim and the idle draw count).
fn workload_of(load: &Load, first_profile: &Profile, job_id: &str, node: &Node) -> Workload {
    let (profile, idle) = match load {
        Load::Idle => (first_profile, true),
        Load::Train(p) => (p.as_ref(), false),
    };
    Workload {
        job_id: job_id.to_string(),
        pid: std::process::id(),
        profile: if idle {
            "idle".into()
        } else {
            profile.name.clone()
        },
        physics: profile.physics,
        table: profile.table.clone(),
        memory_used_bytes: (node.model().memory_bytes as f64 * profile.memory_used_fraction) as u64,
        idle,
    }
}

fn run(cli: Cli) -> Result<(), String> {
    let phases = phases_of(&cli)?;
    let first_profile = phases
        .iter()
        .find_map(|p| match &p.load {
            Load::Train(profile) => Some(profile.as_ref().clone()),
            Load::Idle => None,
        })
        .ok_or("no training phase")?;
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
    node.claim(
        &gpus,
        &workload_of(&phases[0].load, &first_profile, &job_id, &node),
    )
    .map_err(|e| e.to_string())?;
    let _claim = Claim { node: &node };

    let out: Box<dyn Write> = match &cli.csv {
        Some(path) => Box::new(
            std::fs::File::create(path)
                .map_err(|e| format!("cannot write {}: {e}", path.display()))?,
        ),
        None => Box::new(std::io::stdout()),
    };
    let plan = phases
        .iter()
        .map(|p| {
            let name = match &p.load {
                Load::Idle => "idle",
                Load::Train(profile) => profile.name.as_str(),
            };
            if p.length_s.is_finite() {
                format!("{name}:{}", p.length_s)
            } else {
                name.to_string()
            }
        })
        .collect::<Vec<_>>()
        .join(",");
    let comment = format!(
        "powerflex-simjob: SIMULATED training job {job_id}, profile {plan} on {} simulated {} GPU(s) {:?} of node {}, time scale {}",
        gpus.len(),
        node.model().key,
        gpus,
        node.info().node,
        cli.time_scale
    );
    let mut log = StepLogWriter::new(out, &comment).map_err(|e| e.to_string())?;

    let mut reporter = Reporter::from_env();
    let (mut step, mut tokens) = (0u64, 0u64);
    // Two clocks in simulated seconds since the start: `now_s` is the wall clock scaled;
    // `done_s` is how far the job's work has been accounted (steps completed, idle time
    // passed). Steps complete whenever `done_s` can advance by a whole step without
    // passing `now_s`, so a stalled process catches up instead of losing the time.
    let start = Instant::now();
    let sim_now_s = || start.elapsed().as_secs_f64() * cli.time_scale;
    let (mut phase_i, mut phase_start_s, mut done_s) = (0usize, 0.0f64, 0.0f64);
    let finished = |step: u64, done_s: f64| {
        cli.steps.is_some_and(|n| step >= n) || cli.duration.is_some_and(|d| done_s >= d)
    };
    'job: while !stopped() && !finished(step, done_s) {
        let phase = &phases[phase_i];
        let phase_end_s = phase_start_s + phase.length_s;
        let now_s = sim_now_s();
        let horizon_s = now_s.min(phase_end_s);
        let mut next_s = phase_end_s;
        match &phase.load {
            Load::Idle => done_s = horizon_s,
            Load::Train(profile) => {
                // Caps now; the slowest GPU sets the pace of the whole step.
                let mut slowest = 1.0f64;
                let (mut cap_min, mut cap_max) = (f64::MAX, 0.0f64);
                for &g in &gpus {
                    let gpu = node.gpu(g).map_err(|e| e.to_string())?;
                    let cap_w = f64::from(gpu.power_limit_mw) / 1000.0;
                    cap_min = cap_min.min(cap_w);
                    cap_max = cap_max.max(cap_w);
                    let at_cap = match &profile.table {
                        Some(table) => table.at_cap(Watts(cap_w), &profile.physics),
                        None => profile.physics.at_cap(Watts(cap_w)),
                    };
                    slowest = slowest.min(at_cap.relative_throughput);
                }
                let step_sim = cli.step_s / slowest.max(1e-3);
                let tokens_per_step = profile.tokens_per_s_per_gpu * gpus.len() as f64 * cli.step_s;
                let mut progressed = false;
                while done_s + step_sim <= horizon_s {
                    done_s += step_sim;
                    step += 1;
                    tokens += tokens_per_step.round() as u64;
                    progressed = true;
                    // A log that cannot be written (full disk, closed pipe) must not stop
                    // training, as a real job's logging would not.
                    let _ = log.step(&StepRow {
                        simulated: true,
                        step,
                        tokens,
                        elapsed_s: (done_s * 1000.0).round() / 1000.0,
                        tokens_per_s: (tokens_per_step / step_sim * 10.0).round() / 10.0,
                        cap_min_w: cap_min.round() as u32,
                        cap_max_w: cap_max.round() as u32,
                        unix_ms: unix_ms(),
                    });
                    if finished(step, done_s) || stopped() {
                        break;
                    }
                }
                if progressed {
                    reporter.send(&ProgressReport {
                        v: VERSION,
                        job_id: job_id.clone(),
                        tokens: (tokens as f64 * cli.report_scale) as u64,
                        steps: step,
                    });
                }
                next_s = next_s.min(done_s + step_sim);
            }
        }
        if now_s >= phase_end_s {
            // A step cut by the phase's end is lost, as a real job's would be.
            phase_i += 1;
            if phase_i == phases.len() {
                break 'job;
            }
            phase_start_s = phase_end_s;
            done_s = phase_end_s;
            node.claim(
                &gpus,
                &workload_of(&phases[phase_i].load, &first_profile, &job_id, &node),
            )
            .map_err(|e| e.to_string())?;
            continue;
        }
        // Wake at the next step's end or the phase's end, at most 50 ms from now so a
        // stop signal is seen promptly.
        let wait = Duration::from_secs_f64(((next_s - sim_now_s()) / cli.time_scale).max(0.0));
        std::thread::sleep(wait.min(Duration::from_millis(50)));
    }
    let signal = stop_signal.load(Ordering::SeqCst);
    if signal != 0 {
        eprintln!("powerflex-simjob: SIMULATED job {job_id} stopped by signal {signal} after {step} steps; GPUs released");
    }
    Ok(())
}
