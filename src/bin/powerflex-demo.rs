//! `powerflex-demo`: the README's first command. A local Slurm cluster — slurmctld and
//! three `slurmd -N` nodes with 8 SIMULATED H200s each — runs the real SPANK plugin, an
//! agent per node and the controller (all started through `powerflex::stack`).
//! Seven simulated training jobs with different tiers and workloads (dense pretraining,
//! MoE fine-tuning, two whose curves are REAL measurements; single- and multi-node)
//! calibrate, then a 30 % grid event ramps in, holds and ends; in the middle of the hold
//! one job changes phase (its light first step ends and a heavier one starts). A second,
//! deeper event then arrives the way a utility sends one: the demo plays the utility at a
//! real OpenADR 3 VTN (LF Energy's openleadr-vtn on PostgreSQL 16, started in the
//! background while the jobs calibrate) and the site's VEN, `powerflex-grid`, brings it to
//! the controller; it is deeper than caps at every tier's floor reach with flex0
//! untouched, so the one job that allows it (flex3, `preempt=suspend`) is suspended for
//! it and resumed after. The demo
//! prints each job's measured against its true PFI, its caps and tokens/s before and
//! during the event, and, at four moments (event 1's budget planned before it on the
//! calibration walks alone, event 1's hold, its budget asked again after it, event 2 in
//! force), what every policy would decide (the paper's equal-weight and
//! PFI-proportional rules with tiers ignored, the equal split within the tiers,
//! powerflex) scored on the profiles' true curves beside the oracle; it plots the metered draw and the caps the GPUs
//! enforced (read back by the agents, calibration walks included), stops everything it
//! started by PID, and checks that every simulated GPU is back at its default cap.
//!
//! The run is a sequence of phases, each a function returning `Result`: [`start`]
//! (cluster and stack up, the VTN starting in the background), [`submit`], [`calibrate`],
//! [`steady_state`], [`event`], [`openadr_event`], [`teardown`], [`report`].
//!
//! Run as root after `cargo build --release` (scripts/demo.sh does both). Exit codes: 0
//! the event was met and every promise held; 1 something failed or a promise broke (the
//! output says which); 2 usage error.

use powerflex_daemon::clock::unix_ms;
use std::collections::BTreeMap;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::{Duration, Instant};

use clap::Parser;
use serde_json::json;

use powerflex::site_config::{edit_site_file, SiteBuilder};
use powerflex::stack::{Stack, StackError, StackOptions};
use powerflex::vtn::{self, event_request, Payload, VenProcess, VtnBed, VtnError};
use powerflex::{profile_dir, repo_root, write_site_key};
use powerflex_controller::plot::Mark;
use powerflex_core::allocate::CapLimits;
use powerflex_core::compare::{self, round_to, Scored, TrueJob};
use powerflex_core::config::{RawGrid, RawOpenAdr, SiteConfig};
use powerflex_core::flex::Preempt;
use powerflex_core::Watts;
use powerflex_proto::event::Cut;
use powerflex_proto::status::{
    AgentJobStatus, CalibrationState, CtldStatus, DecisionView, HistorySample, PfiSource,
    SiteJobStatus,
};
use powerflex_proto::usage::{JobEnergyRecord, J_PER_KWH};
use powerflex_sim::profiles::{Library, Profile};

const NODES: u32 = 3;
const GPUS_PER_NODE: u32 = 8;
const DEFAULT_CAP_W: f64 = 700.0;
/// The site's calibration grid, W per GPU (also where flex0's true PFI is computed).
const CALIBRATION_CAPS_W: [f64; 5] = [700.0, 600.0, 500.0, 400.0, 300.0];
/// Draw samples may exceed the budget by this share (NVML-level power noise is ±0.5 %).
const DRAW_TOLERANCE: f64 = 0.01;
/// Measured slowdowns may exceed a tier's bound by this much (throughput noise).
const SLOWDOWN_TOLERANCE: f64 = 0.03;
/// The controller's allocation period (the stack's site config), s.
const ALLOCATION_PERIOD_S: f64 = 1.0;
/// How often the event phase reads the meter, s: fine enough to see a reallocation's
/// transient, which lasts about one agent sample (500 ms).
const EVENT_SAMPLE_S: f64 = 0.2;
/// The VTN program the demo's utility publishes in and the site follows.
const OPENADR_PROGRAM: &str = "powerflex-demo-dr";
/// How far ahead of its start the OpenADR event is published, s: time for the VEN's poll
/// (1 s), the controller's suspension ahead of the start and the caps to follow.
const OPENADR_LEAD_S: u64 = 8;

#[derive(Debug, Clone, Parser)]
#[command(
    name = "powerflex-demo",
    version,
    about = "powerflex end to end on a local Slurm cluster with SIMULATED GPUs: calibration, a grid event, the result against the paper's baselines"
)]
struct Cli {
    /// The grid event's cut, as a share of the cluster's measured draw before it: 30% or
    /// 0.3 (the same cut).
    #[arg(long, default_value = "30%", value_name = "SHARE", value_parser = cut_share)]
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
    /// How long the second event, the one from the OpenADR VTN, lasts, s.
    #[arg(long, default_value = "20", value_name = "S", value_parser = openadr_s)]
    openadr_s: u64,
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
    /// The profile it calibrates and is judged on.
    profile: &'static str,
    kind: &'static str,
    /// A second, heavier phase the demo switches the job to in the middle of the event
    /// (a second `srun` step of the same job; the first is cancelled).
    then: Option<&'static str>,
    /// Submitted with `preempt=suspend`: the controller may suspend it in a cut deeper
    /// than caps reach.
    suspend: bool,
}

impl Spec {
    /// The `--power-flex` value.
    fn power_flex(&self) -> String {
        if self.suspend {
            format!("{},preempt=suspend", self.tier)
        } else {
            self.tier.to_string()
        }
    }
}

/// The jobs: every tier, dense and MoE, two real measured curves, single- and multi-node,
/// 24 GPUs in all, chosen so the allocator's choice matters: within every loose tier sit
/// jobs of clearly different elasticity (a real speech model that keeps its speed far
/// below its default cap beside a dense model that does not), so the cut's watts can come
/// from where they cost the fewest tokens. A 30 % cut is within reach of every tier's
/// bound; the paper's equal-weight cut, which ignores tiers, breaks some of them. The
/// second event is deeper than every floor: one flex3 job allows suspension.
const MIX: [Spec; 7] = [
    Spec {
        tier: "flex0",
        bound: 0.0,
        nodes: 1,
        gpus_per_node: 2,
        profile: "llama-3.1-70b-dense-pt-8g-compile",
        kind: "dense pretraining",
        then: None,
        suspend: false,
    },
    Spec {
        tier: "flex1",
        bound: 0.1,
        nodes: 1,
        gpus_per_node: 4,
        profile: "gpt-oss-20b-moe-ft-8g-seq4096-bs8",
        kind: "MoE fine-tuning",
        then: None,
        suspend: false,
    },
    Spec {
        tier: "flex3",
        bound: 0.5,
        nodes: 2,
        gpus_per_node: 4,
        profile: "qwen3-30b-a3b-moe-ft-16g",
        kind: "MoE fine-tuning",
        then: None,
        // The lowest tier, and the only job that allows suspension: the OpenADR event's
        // depth is chosen so that it must be suspended.
        suspend: true,
    },
    Spec {
        tier: "flex2",
        bound: 0.25,
        nodes: 2,
        gpus_per_node: 2,
        profile: "gemma-4-26b-a4b-moe-ft-8g",
        kind: "MoE fine-tuning, then dense pretraining",
        then: Some("llama-3.1-70b-dense-pt-16g"),
        suspend: false,
    },
    Spec {
        tier: "flex3",
        bound: 0.5,
        nodes: 1,
        gpus_per_node: 2,
        profile: "qwen3-32b-dense-pt-8g-compile",
        kind: "dense pretraining",
        then: None,
        suspend: false,
    },
    Spec {
        tier: "flex2",
        bound: 0.25,
        nodes: 1,
        gpus_per_node: 2,
        profile: "real-rtx6000-librispeech-deepspeech2-bs8-adamw",
        kind: "real curve (Zeus, DeepSpeech2)",
        then: None,
        suspend: false,
    },
    Spec {
        tier: "flex3",
        bound: 0.5,
        nodes: 1,
        gpus_per_node: 2,
        profile: "real-v100-cifar100-shufflenetv2-bs2048-adam",
        kind: "real curve (Zeus, ShuffleNet)",
        then: None,
        suspend: false,
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

/// Why the demo stopped before its report.
#[derive(Debug, thiserror::Error)]
enum DemoError {
    #[error("{0}")]
    Stack(#[from] StackError),
    #[error("{0}")]
    Failed(String),
}

impl From<String> for DemoError {
    fn from(message: String) -> Self {
        DemoError::Failed(message)
    }
}

impl From<&str> for DemoError {
    fn from(message: &str) -> Self {
        DemoError::Failed(message.to_string())
    }
}

type Result<T> = std::result::Result<T, DemoError>;

/// A number in a range, or a message naming the range (clap exits 2 with it).
fn ranged(
    text: &str,
    ok: impl Fn(f64) -> bool,
    accepted: &str,
) -> std::result::Result<f64, String> {
    match text.trim().parse::<f64>() {
        Ok(v) if v.is_finite() && ok(v) => Ok(v),
        _ => Err(format!("accepted: {accepted}")),
    }
}

/// `--cut`: a share of the draw, as a percentage (`30%`) or a fraction (`0.3`), as every
/// command reads a share.
fn cut_share(text: &str) -> std::result::Result<f64, String> {
    let accepted = "a share of the draw above 0 and below 90 %, as a percentage (e.g. 30%) or a fraction (e.g. 0.3)";
    match powerflex_core::units::parse_share(text) {
        Ok(v) if v > 0.0 && v < 0.9 => Ok(v),
        Ok(v) => Err(format!("{v} is out of range; accepted: {accepted}")),
        Err(e) => Err(e.to_string()),
    }
}

fn ramp_s(text: &str) -> std::result::Result<f64, String> {
    ranged(text, |v| v >= 1.0, "at least 1 second")
}

fn hold_s(text: &str) -> std::result::Result<f64, String> {
    ranged(
        text,
        |v| v >= 15.0,
        "at least 15 seconds (the measurement window)",
    )
}

fn openadr_s(text: &str) -> std::result::Result<u64, String> {
    match text.trim().parse::<u64>() {
        Ok(v) if (10..=3600).contains(&v) => Ok(v),
        _ => Err("accepted: whole seconds from 10 to 3600".into()),
    }
}

fn time_scale(text: &str) -> std::result::Result<f64, String> {
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

/// The demo starts slurmd and sets GPU power limits: root only. `/proc/self` belongs to
/// the process's effective uid.
fn check_root() -> Result<()> {
    use std::os::unix::fs::MetadataExt;
    let uid = std::fs::metadata("/proc/self")
        .map_err(|e| format!("cannot read /proc/self: {e}"))?
        .uid();
    if uid != 0 {
        return Err(format!(
            "must run as root (uid {uid} now): it starts slurmctld/slurmd and sets (simulated) GPU power limits"
        )
        .into());
    }
    Ok(())
}

fn job_view(jobs: &[SiteJobStatus], id: u32) -> Option<&SiteJobStatus> {
    jobs.iter().find(|j| j.job == id.to_string())
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
            if i <= 3 {
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

/// What the demo records as it goes: one sample a second of the budget in force, the
/// metered draw (the simulated GPUs' own power readings) and, per job, the cap its GPUs
/// enforce as the agents read it back through NVML — so the plot's cap panel shows the
/// calibration walks and every change the GPUs actually made, not only the leases.
#[derive(Debug, Default)]
struct Meter {
    samples: Vec<HistorySample>,
    budget_w: f64,
    /// Ask the controller for the budget in force (only an event moves it; each ask is a
    /// `powerflexctl` process, and on this 2-core machine the jobs' measured throughput
    /// feels every extra process).
    ask_budget: bool,
    /// The controller's status from the last sample that asked for it.
    status: Option<CtldStatus>,
}

impl Meter {
    fn sample(&mut self, stack: &Stack) -> Result<f64> {
        let draw_w = stack.try_draw_w()?;
        // The budget as the controller has it now (the event's ramp moves it); the last
        // known one when a call fails.
        if self.ask_budget {
            if let Ok(status) = stack.try_ctl_json::<CtldStatus>(&["status"]) {
                self.budget_w = status.budget_w;
                self.status = Some(status);
            }
        }
        let mut caps: BTreeMap<String, f64> = BTreeMap::new();
        for i in 0..stack.sims.len() {
            // An agent busy past its socket timeout leaves a gap in its jobs' lines.
            let Ok(status) = stack.try_agent_status(i) else {
                continue;
            };
            for job in status.jobs {
                if let Some(cap) = job.power_cap_w.or(job.cap_w) {
                    let entry = caps.entry(job.job).or_insert(cap);
                    *entry = entry.min(cap);
                }
            }
        }
        self.samples.push(HistorySample {
            t_ms: unix_ms(),
            budget_w: self.budget_w,
            draw_w,
            caps,
            simulated: true,
            domains: BTreeMap::new(),
        });
        Ok(draw_w)
    }
}

/// The running demo: the stack, where results go, and what has been recorded so far.
/// The OpenADR test bed (PostgreSQL 16 and the VTN), started in a thread while the jobs
/// calibrate (initdb and the VTN's migrations take tens of seconds on 2 cores) and joined
/// when the OpenADR event needs it. Dropping it waits for a start still under way, so
/// whatever the thread started is stopped by PID however the demo ends.
#[derive(Debug, Default)]
struct VtnStart {
    starting: Option<std::thread::JoinHandle<std::result::Result<VtnBed, VtnError>>>,
    bed: Option<VtnBed>,
    began: Option<Instant>,
}

impl VtnStart {
    fn begin(dir: PathBuf) -> VtnStart {
        VtnStart {
            starting: Some(std::thread::spawn(move || VtnBed::start(&dir))),
            bed: None,
            began: Some(Instant::now()),
        }
    }

    /// The running bed, waiting for its start if need be.
    fn ready(&mut self) -> Result<&VtnBed> {
        if let Some(handle) = self.starting.take() {
            let bed = handle
                .join()
                .map_err(|_| "the thread starting the VTN panicked")?
                .map_err(|e| format!("the OpenADR VTN did not start: {e}"))?;
            self.bed = Some(bed);
        }
        self.bed
            .as_ref()
            .ok_or_else(|| "the OpenADR VTN was not started".into())
    }
}

impl Drop for VtnStart {
    fn drop(&mut self) {
        if let Some(handle) = self.starting.take() {
            let _ = handle.join();
        }
    }
}

/// Field order is drop order: the VEN, then the VTN, then the stack.
#[derive(Debug)]
struct Demo {
    ven: Option<VenProcess>,
    vtn: VtnStart,
    cli: Cli,
    progress: Progress,
    out: PathBuf,
    jobs_dir: PathBuf,
    library: Library,
    stack: Stack,
    meter: Meter,
    /// What the plot marks: the events, the suspension and the resume.
    marks: Vec<Mark>,
}

impl Demo {
    /// Polls `check` once a second (sampling the meter each time) until it yields a
    /// value, printing `status()` every `every`; fails naming `what` after `timeout`.
    fn wait_for<T>(
        &mut self,
        what: &str,
        timeout: Duration,
        every: Duration,
        mut check: impl FnMut(&Stack) -> Result<Option<T>>,
        mut status: impl FnMut(&Stack) -> String,
    ) -> Result<T> {
        let start = Instant::now();
        let mut last_said = Instant::now();
        let mut polls = 0u64;
        loop {
            // Every other poll: a walk's level holds 5 s, so 2 s samples still draw each
            // level, at half the load on the agents and on the machine.
            if polls.is_multiple_of(2) {
                self.meter.sample(&self.stack)?;
            }
            polls += 1;
            if let Some(v) = check(&self.stack)? {
                return Ok(v);
            }
            if start.elapsed() > timeout {
                return Err(format!(
                    "timed out after {:.0} s waiting for {what}: {}",
                    timeout.as_secs_f64(),
                    status(&self.stack)
                )
                .into());
            }
            if last_said.elapsed() >= every {
                self.progress.say(status(&self.stack));
                last_said = Instant::now();
            }
            std::thread::sleep(Duration::from_secs(1));
        }
    }

    fn time_scale(&self) -> f64 {
        self.cli.time_scale
    }
}

/// The demo's site: the stack's, with the demo's calibration grid and timing, and the
/// objective its results are judged on.
fn demo_site(builder: SiteBuilder) -> SiteBuilder {
    builder
        .header(
            "powerflex demo site (written by powerflex-demo): 3 nodes x 8 SIMULATED H200.\n\
             Calibration is shortened for the demo (site defaults: settle 10 s, hold 30 s,\n\
             budget 2 % of first-hour tokens).\n\
             The demo's jobs are the site's own simulated jobs, so it trusts their token\n\
             counts and maximises total tokens/s (the default objective is relative speed).",
        )
        // Its results are judged in total tokens/s against equal-weight: the allocation
        // must maximise the same thing.
        .edit(|raw| raw.facility.objective = Some("tokens".to_string()))
        // The demo's hour is three minutes: the job that changes phase in event 1 is
        // walked again 20 s after its last walk (the site default is 120 s), so its new
        // curve is measured before the OpenADR event rather than planned on the chord
        // through it (a floor the deep event cannot pay without a tier giving way).
        .edit(|raw| raw.agent.calibration_rewalk_after_s = Some(20.0))
        .h200(&CALIBRATION_CAPS_W, 500.0)
        .calibration_s(2.0, 2.0, 5.0)
        .calibration_budget_pct(0.05)
}

/// Phase 1: the cluster and the stack up — slurmctld and the slurmd nodes with the SPANK
/// plugin, the simulated GPUs, the controller and one agent per node, all live.
fn start(cli: &Cli, progress: Progress) -> Result<Demo> {
    check_root()?;
    // Before anything starts: the second event needs the OpenADR test bed and the VEN.
    vtn::available().map_err(|e| format!("the OpenADR test bed: {e}"))?;
    let grid = profile_dir().join("powerflex-grid");
    if !grid.is_file() {
        return Err(StackError::MissingArtifact {
            path: grid.display().to_string(),
        }
        .into());
    }
    let library = Library::builtin().map_err(|e| e.to_string())?;
    let out = cli
        .out
        .clone()
        .unwrap_or_else(|| repo_root().join("target").join("powerflex-demo"));
    let _ = std::fs::remove_dir_all(&out);
    std::fs::create_dir_all(out.join("jobs")).map_err(|e| format!("{}: {e}", out.display()))?;
    let out = out
        .canonicalize()
        .map_err(|e| format!("{}: {e}", out.display()))?;
    let jobs_dir = out.join("jobs");

    println!("powerflex demo — every GPU here is SIMULATED (libpowerflex_sim_nvml.so behind the real NVML API); the training jobs are simulated too.");
    println!("results, logs and the plot go to {}\n", out.display());
    progress.say(format!(
        "[1/8] starting a local Slurm cluster (slurmctld + {NODES} slurmd, {GPUS_PER_NODE} simulated H200 each, the power_flex.so SPANK plugin), powerflex-ctld and one powerflexd per node"
    ));
    let stack = Stack::try_start(
        "demo",
        StackOptions {
            nodes: NODES,
            gpus_per_node: GPUS_PER_NODE,
            budget_w: f64::from(NODES * GPUS_PER_NODE) * DEFAULT_CAP_W,
            lease_ttl_s: 10,
            agent_env: Vec::new(),
            site: Some(demo_site),
            sample_interval_ms: 500,
            // The demo runs what was built (scripts/demo.sh builds it), never cargo.
            build: false,
            log_dir: Some(out.clone()),
            artifacts: powerflex::stack::Artifacts::Workspace,
            slurmstepd: None,
        },
    )?;
    let _ = std::fs::copy(&stack.site, out.join("powerflex.toml"));
    progress.say("      starting an OpenADR 3 VTN (openleadr-vtn on PostgreSQL 16, loopback) in the background for the second event");
    let vtn = VtnStart::begin(stack.base.join("vtn"));
    let meter = Meter {
        budget_w: f64::from(NODES * GPUS_PER_NODE) * DEFAULT_CAP_W,
        ..Meter::default()
    };
    Ok(Demo {
        ven: None,
        vtn,
        cli: cli.clone(),
        progress,
        out,
        jobs_dir,
        library,
        stack,
        meter,
        marks: Vec::new(),
    })
}

/// `srun` of one simulated training step writing its step log as JOB-NODE-STEP.csv.
fn srun_line(demo: &Demo, profile: &str) -> String {
    format!(
        "srun bash -c 'POWERFLEX_SIM_DIR={run}/sim/$SLURMD_NODENAME exec {simjob} --profile {profile} \
         --duration {duration} --time-scale {scale} --csv {jobs}/$SLURM_JOB_ID-$SLURMD_NODENAME-$SLURM_STEP_ID.csv'",
        run = demo.stack.base.display(),
        simjob = demo.stack.simjob.display(),
        // Longer than the demo; the demo ends the step (phase change) or the job.
        duration = demo.cli.time_scale * 900.0,
        scale = demo.cli.time_scale,
        jobs = demo.jobs_dir.display()
    )
}

/// Phase 2: a refused tier, then the mix, submitted with `sbatch --power-flex`, running.
fn submit(demo: &mut Demo) -> Result<Vec<Job>> {
    demo.progress.say(
        "[2/8] submitting training jobs (powerflex-simjob, SIMULATED) with sbatch --power-flex",
    );
    match demo
        .stack
        .cluster
        .sbatch(&["--power-flex=flex7", "--wrap", "true"], None)
    {
        Err(message) => demo.progress.say(format!(
            "      sbatch --power-flex=flex7 is refused at submission: {}",
            message.lines().next().unwrap_or("").trim()
        )),
        Ok(id) => {
            return Err(format!(
                "job {id} with --power-flex=flex7 was accepted; the plugin should refuse it"
            )
            .into())
        }
    }
    let mut jobs = Vec::new();
    for spec in MIX {
        let source = demo
            .library
            .find(spec.profile)
            .map_err(|e| e.to_string())?
            .source
            .clone();
        let mut wrap = srun_line(demo, spec.profile);
        if let Some(then) = spec.then {
            demo.library.find(then).map_err(|e| e.to_string())?;
            // The second step starts when the demo cancels the first.
            wrap = format!("{wrap}; {}", srun_line(demo, then));
        }
        let output = demo.jobs_dir.join("slurm-%j.out");
        let id = demo
            .stack
            .cluster
            .sbatch(
                &[
                    &format!("-N{}", spec.nodes),
                    &format!("--gres=gpu:{}", spec.gpus_per_node),
                    &format!("--power-flex={}", spec.power_flex()),
                    &format!("--job-name={}", spec.profile),
                    "--output",
                    &output.to_string_lossy(),
                    "--wrap",
                    &wrap,
                ],
                None,
            )
            .map_err(|e| format!("sbatch {} ({}): {e}", spec.profile, spec.tier))?;
        let then = spec
            .then
            .map_or(String::new(), |t| format!(", then {t} during the event"));
        demo.progress.say(format!(
            "      job {id}: --power-flex={} {} ({}, {source} curve){then}, {} node(s) x {} GPU(s)",
            spec.power_flex(),
            spec.profile,
            spec.kind,
            spec.nodes,
            spec.gpus_per_node
        ));
        jobs.push(Job { spec, id });
    }
    demo.wait_for(
        "every job to run",
        Duration::from_secs(60),
        Duration::from_secs(10),
        |stack| {
            Ok(jobs
                .iter()
                .all(|j| stack.cluster.job_state(j.id).as_deref() == Some("RUNNING"))
                .then_some(()))
        },
        |stack| {
            jobs.iter()
                .map(|j| {
                    format!(
                        "{} {}",
                        j.id,
                        stack.cluster.job_state(j.id).unwrap_or_default()
                    )
                })
                .collect::<Vec<_>>()
                .join(", ")
        },
    )?;
    Ok(jobs)
}

/// What calibration left: how long it took and each job's walk (from its first node;
/// all the job's nodes walk together).
#[derive(Debug)]
struct Calibration {
    wall_s: f64,
    jobs: Vec<(u32, AgentJobStatus)>,
}

/// Phase 3: every capped job walks its caps while it trains, until the controller has
/// each measured curve and every GPU is back at its default cap.
fn calibrate(demo: &mut Demo, jobs: &[Job]) -> Result<Calibration> {
    let started = Instant::now();
    demo.progress.say("[3/8] calibrating: each capped job walks its tier's caps (700 W down) while it trains; flex0 is never capped");
    let walking = |stack: &Stack| -> String {
        let mut parts = Vec::new();
        for (i, node) in stack.cluster.node_names().iter().enumerate() {
            if let Ok(status) = stack.try_agent_status(i) {
                for j in &status.jobs {
                    let level = j
                        .calibration_level_w
                        .map_or(String::new(), |l| format!(" at {l:.0} W"));
                    parts.push(format!("{}@{node} {}{level}", j.job, j.calibration.name()));
                }
            }
        }
        format!(
            "calibrating ({:.0} s, usually 2-3 min on a 2-core machine): {}",
            started.elapsed().as_secs_f64(),
            parts.join(", ")
        )
    };
    demo.wait_for(
        "every capped job's measured curve at the controller",
        Duration::from_secs(240),
        Duration::from_secs(10),
        |stack| {
            let Ok(listed) = stack.try_ctl_json::<Vec<SiteJobStatus>>(&["jobs"]) else {
                return Ok(None);
            };
            let done = jobs.iter().all(|j| {
                job_view(&listed, j.id).is_some_and(|v| {
                    (j.spec.tier == "flex0" || v.pfi_source == Some(PfiSource::Measured))
                        && v.throughput.is_some()
                })
            });
            Ok(done.then_some(()))
        },
        walking,
    )?;
    let wall_s = started.elapsed().as_secs_f64();
    demo.progress.say(format!(
        "      every curve measured in {wall_s:.0} s; waiting for the caps to return to {DEFAULT_CAP_W:.0} W"
    ));
    demo.wait_for(
        "every GPU back at its default cap after calibration",
        Duration::from_secs(60),
        Duration::from_secs(10),
        |stack| {
            Ok(stack
                .try_caps_w()?
                .iter()
                .all(|&c| c >= DEFAULT_CAP_W)
                .then_some(()))
        },
        |_| "some GPUs are still capped".into(),
    )?;
    let mut walks: Vec<(u32, AgentJobStatus)> = Vec::new();
    for i in 0..demo.stack.sims.len() {
        for j in demo.stack.try_agent_status(i)?.jobs {
            let id: u32 = j.job.parse().unwrap_or(0);
            if !walks.iter().any(|(seen, _)| *seen == id) {
                walks.push((id, j));
            }
        }
    }
    Ok(Calibration {
        wall_s,
        jobs: walks,
    })
}

/// The steady state before the event: when it was measured, the mean draw, the event's
/// budget derived from it, and the controller's view of the jobs.
#[derive(Debug)]
struct Before {
    from_ms: u64,
    to_ms: u64,
    draw_w: f64,
    target_w: f64,
    jobs: Vec<SiteJobStatus>,
    /// Every compared policy asked at the event's budget before it starts: the decision
    /// on the calibration walks alone, the baseline the event's own windows improve on.
    planned: Snapshot,
}

/// Phase 4: 10 s of steady state at the default caps; the event's budget is the cut
/// below the draw measured here.
fn steady_state(demo: &mut Demo) -> Result<Before> {
    demo.progress
        .say("[4/8] steady state before the event: measuring every job's tokens/s for 10 s");
    demo.meter.sample(&demo.stack)?;
    std::thread::sleep(Duration::from_secs(2));
    let from_ms = unix_ms();
    let mut draws = Vec::new();
    for _ in 0..10 {
        draws.push(demo.meter.sample(&demo.stack)?);
        std::thread::sleep(Duration::from_secs(1));
    }
    let to_ms = unix_ms();
    let draw_w = draws.iter().sum::<f64>() / draws.len() as f64;
    let target_w = (draw_w * (1.0 - demo.cli.cut)).floor();
    let planned = Snapshot::take(
        &demo.stack,
        "event 1's budget, planned before it (curves from calibration alone)",
        Some(target_w),
    )?;
    Ok(Before {
        from_ms,
        to_ms,
        draw_w,
        target_w,
        jobs: demo.stack.try_ctl_json(&["jobs"])?,
        planned,
    })
}

/// A job's switch to its second phase, during the event.
#[derive(Debug)]
struct PhaseChange {
    job: u32,
    from: &'static str,
    to: &'static str,
    /// Seconds into the event.
    at_s: f64,
    at_ms: u64,
}

/// What the event phase measured.
#[derive(Debug)]
struct During {
    /// The window tokens/s are measured over (after ramp and settle, to just before the
    /// ramp back), Unix ms.
    from_ms: u64,
    to_ms: u64,
    /// Metered draw every ~200 ms over the whole hold: (s into the event, W).
    draw: Vec<(f64, f64)>,
    /// Seconds into the event the judged window starts.
    from_s: f64,
    /// The event's start and end, Unix ms.
    start_ms: u64,
    end_ms: u64,
    changes: Vec<PhaseChange>,
    /// Every job the controller held out while the event was in force: a cut deeper than
    /// every floor (a phase change can raise a job's floor in the middle of the hold).
    held: Vec<HeldOut>,
    /// Every policy's decision in the middle of the hold, before any phase change.
    snapshot: Snapshot,
    /// After the event: its budget asked again, planned with what the event measured.
    replay: Snapshot,
    jobs: Vec<SiteJobStatus>,
}

/// A job the controller held out (suspended or requeued) during event 1, as its status
/// showed it (read every second).
#[derive(Debug, Clone)]
struct HeldOut {
    job: u32,
    how: Preempt,
    /// Since when the controller has held it out, and the last status that still did,
    /// Unix ms.
    since_ms: u64,
    last_seen_ms: u64,
}

impl HeldOut {
    /// Whether the hold overlaps the window `[from_ms, to_ms]`.
    fn overlaps(&self, from_ms: u64, to_ms: u64) -> bool {
        self.since_ms <= to_ms && self.last_seen_ms >= from_ms
    }
}

/// The policies the demo compares, all asked of the controller (`whatif`, read-only) at
/// one moment, on the curves it holds: (key, what people read, the `whatif` arguments).
const COMPARED: [(&str, &str, &[&str]); 4] = [
    (
        "paper-equal",
        "paper: equal-weight cut (tiers ignored)",
        &["--policy", "equal", "--ignore-tiers"],
    ),
    (
        "paper-pfi",
        "paper: PFI-proportional (tiers ignored)",
        &["--policy", "pfi-proportional", "--ignore-tiers"],
    ),
    (
        "tier-equal",
        "equal split within the tiers",
        &["--policy", "equal"],
    ),
    (
        "powerflex",
        "powerflex (the controller's own rule)",
        &["--policy", "optimal"],
    ),
];

/// Where the mid-hold comparison of event 1 sits among [`Measured::compare_all`]'s:
/// after the plan made before the event.
const EVENT_ONE: usize = 1;

/// Every compared policy's decision at one moment.
#[derive(Debug, Clone)]
struct Snapshot {
    /// What the moment is, for people.
    label: String,
    at_ms: u64,
    /// (key of [`COMPARED`], the controller's decision).
    decisions: Vec<(&'static str, DecisionView)>,
}

impl Snapshot {
    /// Asks the controller what every compared policy decides now, at `budget_w` (the
    /// budget in force when `None`).
    fn take(stack: &Stack, label: &str, budget_w: Option<f64>) -> Result<Snapshot> {
        let at_ms = unix_ms();
        let budget = budget_w.map(|w| format!("{w}W"));
        let mut decisions = Vec::new();
        for (key, _, args) in COMPARED {
            let mut all = vec!["whatif"];
            all.extend_from_slice(args);
            if let Some(b) = &budget {
                all.extend(["--budget", b.as_str()]);
            }
            decisions.push((key, stack.try_ctl_json(&all)?));
        }
        Ok(Snapshot {
            label: label.to_string(),
            at_ms,
            decisions,
        })
    }

    fn decision(&self, key: &str) -> Option<&DecisionView> {
        self.decisions
            .iter()
            .find(|(k, _)| *k == key)
            .map(|(_, d)| d)
    }
}

/// Phase 5: the grid event — added through `powerflexctl event add`, ramped in, held
/// (the meter read every 200 ms; the phase-changing job switched in the middle of the
/// hold), ramped back out until every GPU is at its default cap again.
fn event(demo: &mut Demo, jobs: &[Job], before: &Before) -> Result<During> {
    let cli = demo.cli.clone();
    let duration_s = cli.ramp_s * 2.0 + cli.hold_s;
    demo.progress.say(format!(
        "[5/8] grid event (powerflexctl event add): {:.0} % below the draw of {} -> budget {}, ramp {:.0} s, hold {:.0} s, ramp back {:.0} s",
        cli.cut * 100.0,
        Watts(before.draw_w),
        Watts(before.target_w),
        cli.ramp_s,
        cli.hold_s,
        cli.ramp_s
    ));
    demo.meter.ask_budget = true;
    let event_start = Instant::now();
    let event_start_ms = unix_ms();
    demo.stack.try_ctl(&[
        "event",
        "add",
        "--target",
        &format!("{}W", before.target_w),
        "--start",
        "now",
        "--duration",
        &format!("{duration_s}s"),
        "--ramp",
        &format!("{}s", cli.ramp_s),
    ])?;
    // The caps need a few seconds after the ramp to reach every GPU and the draw to follow.
    let settle_s = 5.0;
    let from_s = cli.ramp_s + settle_s;
    let to_s = cli.ramp_s + cli.hold_s - 1.0;
    let change_at_s = from_s + (to_s - from_s) / 2.0;
    let mut draw = Vec::new();
    let mut snapshot: Option<Snapshot> = None;
    let mut changes = Vec::new();
    let mut held: Vec<HeldOut> = Vec::new();
    let mut last_sample = Instant::now() - Duration::from_secs(60);
    let mut last_said = Instant::now() - Duration::from_secs(60);
    while event_start.elapsed().as_secs_f64() < to_s {
        let t = event_start.elapsed().as_secs_f64();
        if last_sample.elapsed() >= Duration::from_secs(1) {
            demo.meter.sample(&demo.stack)?;
            last_sample = Instant::now();
            note_held_out(demo, &mut held, event_start_ms);
        }
        draw.push((t, demo.stack.try_draw_w()?));
        if snapshot.is_none() && t >= change_at_s {
            // The alternatives, on the controller's own curves and views, at this moment:
            // before any job changes phase, so on the same jobs and true curves as the
            // plan made before the event, with the windows the event has measured since.
            snapshot = Some(Snapshot::take(
                &demo.stack,
                "event 1, mid-hold (calibration and the windows event 1 measured so far)",
                None,
            )?);
            for job in jobs {
                let Some(to) = job.spec.then else { continue };
                // Ending the first step starts the second (the batch script's next srun):
                // the job's real load changes, which the agents see as they would any
                // phase change.
                let step = format!("{}.0", job.id);
                let ended = demo.stack.cluster.run("scancel", &[&step]);
                if !ended.status.success() {
                    return Err(format!(
                        "scancel {step}: {}",
                        String::from_utf8_lossy(&ended.stderr).trim()
                    )
                    .into());
                }
                let at_s = event_start.elapsed().as_secs_f64();
                demo.progress.say(format!(
                    "      job {}: phase change during the event, {} -> {to} (step 0 ended, step 1 starts)",
                    job.id, job.spec.profile
                ));
                changes.push(PhaseChange {
                    job: job.id,
                    from: job.spec.profile,
                    to,
                    at_s,
                    at_ms: unix_ms(),
                });
            }
        }
        if last_said.elapsed() >= Duration::from_secs(10) {
            let phase = if t < cli.ramp_s {
                "ramping down"
            } else {
                "holding"
            };
            demo.progress.say(format!(
                "      event {phase}: budget {}, draw {} (SIMULATED GPUs), {:.0} s of the event left",
                Watts(demo.meter.budget_w),
                Watts(draw.last().map_or(0.0, |d| d.1)),
                (duration_s - t).max(0.0)
            ));
            last_said = Instant::now();
        }
        std::thread::sleep(Duration::from_secs_f64(EVENT_SAMPLE_S));
    }
    let during_jobs: Vec<SiteJobStatus> = demo.stack.try_ctl_json(&["jobs"])?;
    demo.progress.say("      ramping back up");
    demo.wait_for(
        "the event to end and the caps to return",
        Duration::from_secs_f64(duration_s + 60.0),
        Duration::from_secs(10),
        |stack| {
            let status: CtldStatus = stack.try_ctl_json(&["status"])?;
            let over =
                status.active_event.is_none() && event_start.elapsed().as_secs_f64() >= duration_s;
            Ok((over && stack.try_caps_w()?.iter().all(|&c| c >= DEFAULT_CAP_W)).then_some(()))
        },
        |stack| {
            format!(
                "event ending: {:.0} s left, draw {}",
                (duration_s - event_start.elapsed().as_secs_f64()).max(0.0),
                stack
                    .try_draw_w()
                    .map_or("?".into(), |w| Watts(w).to_string())
            )
        },
    )?;
    // The same budget asked again now the event is over: what the controller would decide
    // with the windows the event measured, the footing the next event starts from. A job
    // walked again after its phase change is planned on its old walk until the new one
    // ends, so the question waits for every walk to end (or says it did not).
    demo.progress
        .say("      waiting for every walk to end (a job that changed phase is walked again)");
    let walks_done = demo.wait_for(
        "every job's walk to end after the event",
        Duration::from_secs(180),
        Duration::from_secs(15),
        |stack| {
            for i in 0..stack.sims.len() {
                let status = stack.try_agent_status(i)?;
                if status.jobs.iter().any(|j| {
                    !matches!(
                        j.calibration,
                        CalibrationState::Done | CalibrationState::Skipped
                    )
                }) {
                    return Ok(None);
                }
            }
            Ok(Some(()))
        },
        |_| "a job is still being walked".into(),
    );
    let label = match walks_done {
        Ok(()) => "event 1's budget again, after it (curves learned during event 1, every walk done)",
        Err(_) => "event 1's budget again, after it (curves learned during event 1; a walk still under way)",
    };
    let replay = Snapshot::take(&demo.stack, label, Some(before.target_w))?;
    let end_ms = event_start_ms + (duration_s * 1000.0) as u64;
    demo.marks.push(Mark {
        from_ms: event_start_ms,
        to_ms: Some(end_ms),
        label: format!("event 1 (powerflexctl): {}", Watts(before.target_w)),
    });
    Ok(During {
        start_ms: event_start_ms,
        end_ms,
        from_ms: event_start_ms + (from_s * 1000.0) as u64,
        to_ms: event_start_ms + (to_s * 1000.0) as u64,
        draw,
        from_s,
        changes,
        held,
        snapshot: snapshot.ok_or("the event ended before the what-if snapshot")?,
        replay,
        jobs: during_jobs,
    })
}

/// Records every job the controller's last status (read by the meter) holds out, and says
/// so once per job: the cut went deeper than caps at every floor can hold.
fn note_held_out(demo: &Demo, held: &mut Vec<HeldOut>, event_start_ms: u64) {
    let Some(status) = &demo.meter.status else {
        return;
    };
    let now = unix_ms();
    for p in &status.preempted {
        // Held out before this event (an earlier cut) is not this event's doing.
        let Ok(job) = p.job.parse::<u32>() else {
            continue;
        };
        if p.since_ms < event_start_ms {
            continue;
        }
        match held.iter_mut().find(|h| h.job == job) {
            Some(h) => h.last_seen_ms = now,
            None => {
                demo.progress.say(format!(
                    "      job {job} held out by the controller ({}): caps at every floor no longer meet the budget",
                    p.how
                ));
                held.push(HeldOut {
                    job,
                    how: p.how,
                    since_ms: p.since_ms,
                    last_seen_ms: now,
                });
            }
        }
    }
}

/// What the OpenADR event showed (all on SIMULATED GPUs).
#[derive(Debug)]
struct Openadr {
    /// The VTN's id for the event, and the site's VEN name.
    vtn_event_id: String,
    ven_name: String,
    /// The lowest budget at which caps hold every tier's floor (flex0 at its default),
    /// from the controller's own allocation, W.
    floors_w: f64,
    /// The job that allows suspension, its draw at its floor and its estimated idle
    /// draw once suspended (the controller's estimate), W.
    job: u32,
    job_at_floor_w: f64,
    job_idle_w: f64,
    /// The event's GPU budget (its import capacity limit, in W), start and end (Unix ms).
    target_w: f64,
    published_ms: u64,
    start_ms: u64,
    end_ms: u64,
    /// When the controller had the event (Unix ms), its id there and its budget.
    at_ctld_ms: Option<u64>,
    ctld_event_id: Option<u64>,
    ctld_target_w: Option<f64>,
    /// The controller event the VEN's ledger maps the VTN's event to.
    ledger_event_id: Option<u64>,
    /// The first sample with the allocation made for the event's budget and the metered
    /// draw within it, Unix ms.
    caps_ms: Option<u64>,
    /// When the controller held the job out, when Slurm showed it SUSPENDED, when it was
    /// running again (Unix ms); every job the controller held out during the event.
    suspended_ms: Option<u64>,
    slurm_suspended: bool,
    /// The job's Slurm `AdminComment` while suspended (why, as the controller wrote it).
    comment: String,
    /// Every compared policy's decision while the event was in force, job held out.
    snapshot: Option<Snapshot>,
    resumed_ms: Option<u64>,
    held: Vec<String>,
    /// Lowest cap the flex0 job's GPUs enforced from publication to the end, W.
    flex0_min_cap_w: Option<f64>,
    /// Metered draw every ~200 ms: (Unix ms, W).
    draw: Vec<(u64, f64)>,
    /// Reports the VEN sent to the VTN for the event, and their DEMAND values (kW).
    reports: usize,
    report_demand_kw: Vec<f64>,
}

impl Openadr {
    fn s_after_publish(&self, t_ms: Option<u64>) -> Option<f64> {
        t_ms.map(|t| (t as f64 - self.published_ms as f64) / 1000.0)
    }

    /// The samples from the event's start to its end: these are held to its budget.
    fn in_force(&self) -> Vec<(u64, f64)> {
        self.draw
            .iter()
            .copied()
            .filter(|&(t, _)| t >= self.start_ms && t < self.end_ms)
            .collect()
    }

    fn draw_max_w(&self) -> f64 {
        self.in_force().iter().map(|s| s.1).fold(0.0, f64::max)
    }

    fn draw_ok(&self) -> bool {
        !self.in_force().is_empty() && self.draw_max_w() <= self.target_w * (1.0 + DRAW_TOLERANCE)
    }

    fn through_ven(&self) -> bool {
        self.ctld_event_id.is_some()
            && self.ledger_event_id == self.ctld_event_id
            && self
                .ctld_target_w
                .is_some_and(|w| (w - self.target_w).abs() < 0.5)
    }

    /// Every promise of the OpenADR event.
    fn ok(&self) -> bool {
        self.through_ven()
            && self.caps_ms.is_some()
            && self.draw_ok()
            && self.suspended_ms.is_some()
            && self.slurm_suspended
            && self.held == [self.job.to_string()]
            && self.resumed_ms.is_some()
            && self.flex0_min_cap_w.is_some_and(|c| c >= DEFAULT_CAP_W)
            && self.reports > 0
    }
}

/// Whether the controller's allocation at some budget leaves the site short: a tier's
/// floor broken, or over the budget with every job at its lowest cap (what makes the
/// controller suspend jobs: `powerflex_controller_machine::preempt::short`).
fn short(d: &DecisionView) -> bool {
    d.allocation
        .as_ref()
        .is_some_and(|a| a.over_budget_w.0 > 0.0 || a.jobs.iter().any(|j| j.floor.is_broken()))
}

/// The lowest budget at which the controller's own allocation (`whatif --policy optimal`,
/// on its measured curves and the jobs' reports now) holds every floor, to 10 W by
/// bisection, and the allocation there.
fn floors_budget(stack: &Stack, base_w: f64) -> Result<(f64, DecisionView)> {
    let whatif = |w: f64| -> Result<DecisionView> {
        Ok(stack.try_ctl_json(&[
            "whatif",
            "--policy",
            "optimal",
            "--budget",
            &format!("{w:.0}W"),
        ])?)
    };
    let (mut lo, mut hi) = (0.0, base_w);
    let mut at_hi = whatif(hi)?;
    if short(&at_hi) {
        return Err(format!("even the base budget {} breaks a floor", Watts(base_w)).into());
    }
    while hi - lo > 10.0 {
        let mid = ((lo + hi) / 2.0).round();
        let d = whatif(mid)?;
        if short(&d) {
            lo = mid;
        } else {
            hi = mid;
            at_hi = d;
        }
    }
    Ok((hi, at_hi))
}

/// Phase 6: the second event, through OpenADR. The demo plays the utility at the VTN
/// (a program, then an event with an import capacity limit), the site's VEN
/// (`powerflex-grid`) brings it to the controller. Its depth comes from the running jobs'
/// floors: half-way between the least caps can hold with every floor kept and what
/// suspending the one job that allows it frees, so caps alone cannot hold it and one
/// suspension is enough. The meter is read every 200 ms until the job has resumed and
/// every GPU is back at its default cap; then the VEN and the VTN are stopped by PID.
fn openadr_event(demo: &mut Demo, jobs: &[Job]) -> Result<Openadr> {
    let ven = start_ven(demo)?;
    let depth = openadr_depth(demo, jobs)?;
    let published = publish_event(demo, &ven.utility, &ven.program_id, depth.target_w)?;
    let flex0: Vec<String> = jobs
        .iter()
        .filter(|j| j.spec.tier == "flex0")
        .map(|j| j.id.to_string())
        .collect();
    let samples_before = demo.meter.samples.len();
    let mut o = Openadr {
        vtn_event_id: published.vtn_event_id,
        ven_name: ven.ven_name,
        floors_w: depth.floors_w,
        job: depth.pausable.id,
        job_at_floor_w: depth.job_at_floor_w,
        job_idle_w: depth.job_idle_w,
        target_w: depth.target_w,
        published_ms: published.published_ms,
        start_ms: published.start_ms,
        end_ms: published.end_ms,
        at_ctld_ms: None,
        ctld_event_id: None,
        ctld_target_w: None,
        ledger_event_id: None,
        caps_ms: None,
        suspended_ms: None,
        slurm_suspended: false,
        comment: String::new(),
        snapshot: None,
        resumed_ms: None,
        held: Vec::new(),
        flex0_min_cap_w: None,
        draw: Vec::new(),
        reports: 0,
        report_demand_kw: Vec::new(),
    };
    follow_event(demo, &mut o, depth.pausable, &ven.ledger_path)?;
    o.flex0_min_cap_w = demo.meter.samples[samples_before..]
        .iter()
        .filter(|s| s.t_ms >= o.published_ms && s.t_ms < o.end_ms)
        .flat_map(|s| flex0.iter().filter_map(|j| s.caps.get(j).copied()))
        .reduce(f64::min);
    read_reports_and_stop(demo, &ven.utility, &mut o)?;
    mark_openadr_event(demo, &o);
    Ok(o)
}

/// What the VEN's start leaves for the rest of the OpenADR event: the utility's client
/// at the VTN, the program it publishes in, the VEN's name and its ledger.
struct VenUp {
    utility: vtn::Utility,
    program_id: String,
    ven_name: String,
    ledger_path: PathBuf,
}

/// Phase 6, first part: the VTN up (started in the background at the beginning), its
/// program, the VEN's credentials and `[grid.openadr]`, and powerflex-grid started and
/// registered.
fn start_ven(demo: &mut Demo) -> Result<VenUp> {
    let waited = Instant::now();
    demo.progress.say(
        "[6/8] grid event through OpenADR: the demo plays the utility at a local OpenADR 3 VTN; the site's VEN (powerflex-grid) follows it",
    );
    let began = demo.vtn.began.map_or(0.0, |b| b.elapsed().as_secs_f64());
    let bed = demo.vtn.ready()?;
    demo.progress.say(format!(
        "      VTN up at {} (started {began:.0} s ago in the background; waited {:.0} s for it here)",
        bed.url(),
        waited.elapsed().as_secs_f64()
    ));
    let utility = bed.utility();
    let program = utility
        .create_program(OPENADR_PROGRAM)
        .map_err(|e| format!("create the VTN program: {e}"))?;
    let program_id = program.id.to_string();
    // The VEN's credentials (root-only, as it demands) and the site's [grid.openadr].
    let creds = demo.stack.base.join("openadr-credentials.toml");
    write_site_key(
        &creds,
        &format!(
            "bearer_token = \"{}\"\n",
            bed.token("powerflex-demo-site", vtn::VEN_SCOPES)
        ),
    );
    let ven_name = "powerflex-demo-site".to_string();
    let (url, creds_s, state_s, name) = (
        bed.url(),
        creds.to_string_lossy().into_owned(),
        demo.stack
            .base
            .join("grid-state")
            .to_string_lossy()
            .into_owned(),
        ven_name.clone(),
    );
    edit_site_file(&demo.stack.site, move |raw| {
        raw.grid = Some(RawGrid {
            openadr: Some(RawOpenAdr {
                vtn_url: url,
                credentials_file: creds_s,
                ven_name: Some(name),
                programs: vec![OPENADR_PROGRAM.into()],
                poll_interval_s: Some(1),
                report_interval_s: Some(2),
                state_dir: Some(state_s),
                ..RawOpenAdr::default()
            }),
        })
    })
    .map_err(|e| format!("[grid.openadr] in the site config: {e}"))?;
    let _ = std::fs::copy(&demo.stack.site, demo.out.join("powerflex.toml"));
    let site = SiteConfig::from_toml_str(
        &std::fs::read_to_string(&demo.stack.site).map_err(|e| e.to_string())?,
    )
    .map_err(|e| format!("the site config: {e}"))?;
    let openadr = site
        .grid
        .openadr
        .ok_or("the site config has no [grid.openadr]")?;
    let ledger_path = powerflex_grid::ledger_path(&openadr);
    let ven_log = demo.out.join("grid.log");
    demo.ven = Some(
        VenProcess::start(
            &profile_dir().join("powerflex-grid"),
            &demo.stack.site,
            &ven_log,
        )
        .map_err(|e| e.to_string())?,
    );
    let registered = Instant::now();
    loop {
        let log = std::fs::read_to_string(&ven_log).unwrap_or_default();
        if log.contains("registered at the vtn") {
            break;
        }
        if !demo.ven.as_mut().is_some_and(VenProcess::running)
            || registered.elapsed() > Duration::from_secs(60)
        {
            return Err(format!(
                "powerflex-grid did not register at the VTN; its log ({}):\n{log}",
                ven_log.display()
            )
            .into());
        }
        std::thread::sleep(Duration::from_millis(200));
    }
    demo.progress.say(format!(
        "      powerflex-grid registered at the VTN as \"{ven_name}\", following program \"{OPENADR_PROGRAM}\" (poll every 1 s, reports every 2 s)"
    ));
    Ok(VenUp {
        utility,
        program_id,
        ven_name,
        ledger_path,
    })
}

/// How deep the OpenADR event cuts: the limit that needs exactly one suspension.
struct Depth<'a> {
    /// What the caps hold with every tier at its floor.
    floors_w: f64,
    /// The job whose suspension the limit needs.
    pausable: &'a Job,
    job_at_floor_w: f64,
    job_idle_w: f64,
    /// The limit the utility publishes.
    target_w: f64,
}

/// Phase 6, second part: the event's depth, from the floors of the jobs running now.
fn openadr_depth<'a>(demo: &Demo, jobs: &'a [Job]) -> Result<Depth<'a>> {
    let status: CtldStatus = demo.stack.try_ctl_json(&["status"])?;
    let (floors_w, at_floors) = floors_budget(&demo.stack, status.base_budget_w)?;
    let pausable = jobs
        .iter()
        .filter(|j| j.spec.suspend)
        .max_by(|a, b| a.spec.bound.total_cmp(&b.spec.bound))
        .ok_or("no job allows suspension")?;
    let job_at_floor_w = at_floors
        .allocation
        .as_ref()
        .and_then(|a| a.jobs.iter().find(|j| j.id == pausable.id.to_string()))
        .map(|j| j.power_w.0)
        .ok_or(format!("job {} is not in the allocation", pausable.id))?;
    let job_idle_w = f64::from(pausable.spec.nodes * pausable.spec.gpus_per_node)
        * DEFAULT_CAP_W
        * powerflex_decide::SUSPENDED_SHARE_OF_DEFAULT;
    let freed_w = job_at_floor_w - job_idle_w;
    if freed_w < 100.0 {
        return Err(format!(
            "suspending job {} would free only {} (at its floor {}, suspended ~{}): no depth needs exactly one suspension",
            pausable.id,
            Watts(freed_w),
            Watts(job_at_floor_w),
            Watts(job_idle_w)
        )
        .into());
    }
    let target_w = (floors_w - freed_w / 2.0).floor();
    demo.progress.say(format!(
        "      depth from the floors: caps hold every tier's floor (flex0 at {DEFAULT_CAP_W:.0} W) down to {}; job {} ({}) draws {} at its floor and ~{} suspended; limit {} needs exactly that one suspension",
        Watts(floors_w),
        pausable.id,
        pausable.spec.power_flex(),
        Watts(job_at_floor_w),
        Watts(job_idle_w),
        Watts(target_w)
    ));
    // The controller's own figure for the same depth (`status`: what the site can shed
    // now, from its last allocation), beside the one found by bisecting `whatif`.
    if let Some(reach) = status.shed_reach {
        demo.progress.say(format!(
            "      the controller's status says the same: caps alone hold every tier down to {} (bisected: {}), and {} with its {} preemptable job(s) held out",
            Watts(reach.caps_w),
            Watts(floors_w),
            Watts(reach.with_preemption_w),
            reach.preemptable_jobs
        ));
    }
    Ok(Depth {
        floors_w,
        pausable,
        job_at_floor_w,
        job_idle_w,
        target_w,
    })
}

/// The event as the VTN published it.
struct Published {
    vtn_event_id: String,
    published_ms: u64,
    start_ms: u64,
    end_ms: u64,
}

/// Phase 6, third part: the utility publishes the limit at the VTN.
fn publish_event(
    demo: &Demo,
    utility: &vtn::Utility,
    program_id: &str,
    target_w: f64,
) -> Result<Published> {
    // The utility publishes: one interval, an import capacity limit in kW, starting
    // OPENADR_LEAD_S from now.
    let duration_s = demo.cli.openadr_s;
    let published_ms = unix_ms();
    let start_ms = published_ms + OPENADR_LEAD_S * 1000;
    let end_ms = start_ms + duration_s * 1000;
    let event = utility
        .create_event(&event_request(
            program_id,
            "powerflex-demo-limit",
            &[vtn::Step {
                start_ms,
                duration_s,
                payload: Payload::ImportCapacityLimitKw(target_w / 1000.0),
            }],
        ))
        .map_err(|e| format!("publish the OpenADR event: {e}"))?;
    let vtn_event_id = event.id.to_string();
    demo.progress.say(format!(
        "      VTN published event {vtn_event_id}: IMPORT_CAPACITY_LIMIT {:.3} kW from {OPENADR_LEAD_S} s from now for {duration_s} s",
        target_w / 1000.0
    ));
    Ok(Published {
        vtn_event_id,
        published_ms,
        start_ms,
        end_ms,
    })
}

/// Phase 6, fourth part: the event followed from publication until its jobs are back
/// (or 90 s after its end): when the controller has it, when its caps hold, the job
/// suspended and resumed (in the controller and in Slurm), the comparison while in force,
/// and the meter all along.
fn follow_event(
    demo: &mut Demo,
    o: &mut Openadr,
    pausable: &Job,
    ledger_path: &Path,
) -> Result<()> {
    let (target_w, published_ms, start_ms, end_ms) =
        (o.target_w, o.published_ms, o.start_ms, o.end_ms);
    let deadline_ms = end_ms + 90_000;
    let mut last_sample = Instant::now() - Duration::from_secs(60);
    let mut last_said = Instant::now();
    let job_id = pausable.id.to_string();
    loop {
        let now = unix_ms();
        let draw_w = demo.stack.try_draw_w()?;
        o.draw.push((now, draw_w));
        if last_sample.elapsed() >= Duration::from_secs(1) {
            last_sample = Instant::now();
            demo.meter.sample(&demo.stack)?;
            let Some(status) = demo.meter.status.clone() else {
                std::thread::sleep(Duration::from_secs_f64(EVENT_SAMPLE_S));
                continue;
            };
            if o.ctld_event_id.is_none() {
                if let Some(e) = status.events.iter().find(|e| {
                    matches!(e.cut, Cut::Target { budget_w } if (budget_w - target_w).abs() < 0.5)
                }) {
                    o.at_ctld_ms = Some(now);
                    o.ctld_event_id = Some(e.id);
                    if let Cut::Target { budget_w } = e.cut {
                        o.ctld_target_w = Some(budget_w);
                    }
                    demo.progress.say(format!(
                        "      the controller has it as event {} ({:.1} s after publication)",
                        e.id,
                        (now - published_ms) as f64 / 1000.0
                    ));
                }
            }
            // The VEN's own record of which controller event is the VTN's (read while the
            // event is on: once it is over, the VEN forgets it).
            if o.ledger_event_id.is_none() && o.ctld_event_id.is_some() {
                if let Ok(ledger) = powerflex_grid::load_ledger(ledger_path) {
                    o.ledger_event_id = ledger.events.get(&o.vtn_event_id).and_then(|e| e.pf_id);
                }
            }
            if o.caps_ms.is_none()
                && o.ctld_event_id.is_some()
                && status
                    .allocated_budget_w
                    .is_some_and(|b| b <= target_w + 1.0)
                && draw_w <= target_w
            {
                o.caps_ms = Some(now);
                demo.progress.say(format!(
                    "      caps in force for {} ({:.1} s after publication; draw {})",
                    Watts(target_w),
                    (now - published_ms) as f64 / 1000.0,
                    Watts(draw_w)
                ));
            }
            for p in &status.preempted {
                if !o.held.contains(&p.job) {
                    o.held.push(p.job.clone());
                }
            }
            let held_now = status.preempted.iter().any(|p| p.job == job_id);
            if held_now && o.suspended_ms.is_none() {
                o.suspended_ms = Some(now);
                demo.progress.say(format!(
                    "      job {job_id} suspended by the controller ({:.1} s after publication{})",
                    (now - published_ms) as f64 / 1000.0,
                    if now < start_ms {
                        ", before the start"
                    } else {
                        ""
                    }
                ));
            }
            // What Slurm shows: the state, and the comment the controller writes for the
            // job's user and admins (`AdminComment`, a moment after the suspension; it is
            // read until it names the suspension or the job resumes).
            if o.suspended_ms.is_some()
                && o.resumed_ms.is_none()
                && (!o.slurm_suspended || !o.comment.contains("grid-cut"))
            {
                let info = demo.stack.cluster.job_info(pausable.id);
                let field = |key: &str| {
                    info.split_whitespace()
                        .find_map(|f| f.strip_prefix(key))
                        .unwrap_or("")
                        .to_string()
                };
                if field("JobState=") == "SUSPENDED" {
                    o.slurm_suspended = true;
                }
                let comment = field("AdminComment=");
                if !comment.is_empty() && comment != "(null)" {
                    o.comment = comment;
                }
            }
            // The comparison while the event is in force, once its caps have held a
            // moment (the suspended job is out of every policy's allocation alike).
            if o.snapshot.is_none()
                && held_now
                && o.caps_ms.is_some_and(|t| now >= t + 2_000)
                && now >= start_ms
                && now + 2_000 < end_ms
            {
                o.snapshot = Some(Snapshot::take(
                    &demo.stack,
                    "event 2 (OpenADR), in force, one job suspended; planned with what event 1 measured",
                    None,
                )?);
            }
            if o.suspended_ms.is_some()
                && o.resumed_ms.is_none()
                && !held_now
                && now >= end_ms
                && demo.stack.cluster.job_state(pausable.id).as_deref() == Some("RUNNING")
            {
                o.resumed_ms = Some(now);
                demo.progress.say(format!(
                    "      job {job_id} resumed {:.1} s after the event's end",
                    (now - end_ms) as f64 / 1000.0
                ));
            }
            let over = now >= end_ms
                && status.active_event.is_none()
                && (o.suspended_ms.is_none() || o.resumed_ms.is_some())
                && demo.stack.try_caps_w()?.iter().all(|&c| c >= DEFAULT_CAP_W);
            if over || now >= deadline_ms {
                break;
            }
            if last_said.elapsed() >= Duration::from_secs(10) {
                last_said = Instant::now();
                let phase = if now < start_ms {
                    "announced"
                } else if now < end_ms {
                    "in force"
                } else {
                    "over, jobs coming back"
                };
                demo.progress.say(format!(
                    "      OpenADR event {phase}: budget {}, draw {} (SIMULATED GPUs)",
                    Watts(status.budget_w),
                    Watts(draw_w)
                ));
            }
        }
        std::thread::sleep(Duration::from_secs_f64(EVENT_SAMPLE_S));
    }
    Ok(())
}

/// Phase 6, fifth part: the VEN's reports of the metered draw read back at the VTN; the
/// VEN and the VTN stopped.
fn read_reports_and_stop(demo: &mut Demo, utility: &vtn::Utility, o: &mut Openadr) -> Result<()> {
    // The VEN reported the metered draw to the VTN while the event was on.
    let reports = utility
        .reports(&o.vtn_event_id)
        .map_err(|e| format!("read the reports at the VTN: {e}"))?;
    o.reports = reports
        .iter()
        .filter(|r| r.content.client_name == o.ven_name)
        .count();
    for r in &reports {
        for res in &r.content.resources {
            for interval in &res.intervals {
                for p in interval
                    .payloads
                    .iter()
                    .filter(|p| p.value_type.0 == "DEMAND")
                {
                    for v in &p.values {
                        if let openleadr_wire::values_map::Value::Number(kw) = v {
                            o.report_demand_kw.push(*kw);
                        }
                    }
                }
            }
        }
    }
    if let Some(mut ven) = demo.ven.take() {
        ven.stop();
    }
    demo.vtn = VtnStart::default();
    demo.progress.say(format!(
        "      {} reports of the metered draw reached the VTN; powerflex-grid and the VTN stopped (SIGTERM, by PID)",
        o.reports
    ));
    Ok(())
}

/// Phase 6, last part: the OpenADR event's moments, marked on the plot.
fn mark_openadr_event(demo: &mut Demo, o: &Openadr) {
    let mut mark = |from_ms: u64, to_ms: Option<u64>, label: String| {
        demo.marks.push(Mark {
            from_ms,
            to_ms,
            label,
        })
    };
    mark(o.published_ms, None, "VTN published (OpenADR)".into());
    mark(
        o.start_ms,
        Some(o.end_ms),
        format!("event 2 (OpenADR): {}", Watts(o.target_w)),
    );
    if let Some(t) = o.caps_ms {
        mark(t, None, "caps in force".into());
    }
    if let Some(t) = o.suspended_ms {
        mark(t, None, format!("job {} suspended", o.job));
    }
    if let Some(t) = o.resumed_ms {
        mark(t, None, format!("job {} resumed", o.job));
    }
}

/// How the stack was left.
#[derive(Debug)]
struct Teardown {
    restored_by_agents: bool,
    all_default: bool,
    energy: Energy,
}

/// What the controller recorded of the jobs' energy, read before it stopped.
#[derive(Debug)]
struct Energy {
    /// The demo's jobs' records, in the demo's job order, as `powerflexctl accounting
    /// --format json` gave them.
    records: Vec<JobEnergyRecord>,
    /// Jobs with no record when the wait ended.
    missing: Vec<u32>,
    /// Where `powerflexctl accounting --plot` drew them, or why it could not.
    plot: std::result::Result<PathBuf, String>,
}

/// How long to wait for the jobs' records after they ended: the controller writes a
/// job's record once each of its nodes has sent its final share, and after 60 s without
/// one it writes what it has (naming the missing nodes).
const RECORDS_WAIT: Duration = Duration::from_secs(75);

/// The controller's record of every demo job, read the way a user reads them
/// (`powerflexctl accounting --format json`), and the energy plot drawn by
/// `powerflexctl accounting --plot`. A job without a record after [`RECORDS_WAIT`] is
/// named in `missing` (the demo then fails), not waited for forever.
fn energy_records(demo: &mut Demo, jobs: &[Job]) -> Energy {
    let ids: Vec<String> = jobs.iter().map(|j| j.id.to_string()).collect();
    let of_demo = |all: Vec<JobEnergyRecord>| -> Vec<JobEnergyRecord> {
        // Each job's latest revision (a final share that came late restates the run),
        // in the demo's order.
        ids.iter()
            .filter_map(|id| {
                all.iter()
                    .filter(|r| &r.job_id == id)
                    .max_by_key(|r| r.revision)
                    .cloned()
            })
            .collect()
    };
    let waited = demo.wait_for(
        "every job's energy record at the controller",
        RECORDS_WAIT,
        Duration::from_secs(10),
        |stack| {
            let all: Vec<JobEnergyRecord> = stack.try_ctl_json(&["accounting"])?;
            let mine = of_demo(all);
            Ok((mine.len() == ids.len()).then_some(mine))
        },
        |stack| {
            let have = stack
                .try_ctl_json::<Vec<JobEnergyRecord>>(&["accounting"])
                .map_or(0, |all| of_demo(all).len());
            format!("{have} of {} records written", ids.len())
        },
    );
    let records = match waited {
        Ok(records) => records,
        Err(e) => {
            demo.progress.say(format!("      {e}"));
            demo.stack
                .try_ctl_json::<Vec<JobEnergyRecord>>(&["accounting"])
                .map(of_demo)
                .unwrap_or_default()
        }
    };
    let missing = jobs
        .iter()
        .filter(|j| !records.iter().any(|r| r.job_id == j.id.to_string()))
        .map(|j| j.id)
        .collect();
    let path = demo.out.join("powerflex-energy.svg");
    let plot = demo
        .stack
        .try_ctl(&[
            "accounting",
            "--plot",
            &path.to_string_lossy(),
            "--title",
            "powerflex demo (SIMULATED GPUs): GPU energy per tier and energy saved (ESTIMATE)",
        ])
        .map(|_| path)
        .map_err(|e| e.to_string());
    // The log itself, beside the summary (the stack's directory is removed at the end).
    let log = demo
        .stack
        .base
        .join("ctld")
        .join(powerflex_controller::ctld::ACCOUNTING_LOG_FILE);
    let _ = std::fs::copy(&log, demo.out.join("job-energy.jsonl"));
    Energy {
        records,
        missing,
        plot,
    }
}

/// Phase 6: scancel every job, wait for the agents to restore the caps, then SIGTERM the
/// agents and the controller by PID and stop Slurm; every GPU must be at its default.
fn teardown(demo: &mut Demo, jobs: &[Job]) -> Result<Teardown> {
    demo.progress.say("[7/8] stopping: scancel every job, then the agents and the controller (SIGTERM, by PID), then Slurm");
    for job in jobs {
        demo.stack.cluster.run("scancel", &[&job.id.to_string()]);
    }
    for job in jobs {
        demo.stack
            .cluster
            .wait_job_done(job.id, Duration::from_secs(60));
    }
    let restored_by_agents = demo
        .wait_for(
            "the agents to restore every GPU's default cap",
            Duration::from_secs(30),
            Duration::from_secs(10),
            |stack| {
                Ok(stack
                    .try_caps_w()?
                    .iter()
                    .all(|&c| c == DEFAULT_CAP_W)
                    .then_some(true))
            },
            |_| "waiting for the epilogs".into(),
        )
        .unwrap_or(false);
    // Before the controller stops: its records of the jobs just ended.
    demo.progress.say(
        "      reading the jobs' energy records from the controller (powerflexctl accounting)",
    );
    let energy = energy_records(demo, jobs);
    demo.stack.shutdown();
    let all_default = demo.stack.try_caps_w()?.iter().all(|&c| c == DEFAULT_CAP_W);
    Ok(Teardown {
        restored_by_agents,
        all_default,
        energy,
    })
}

fn run_demo(cli: &Cli) -> Result<bool> {
    let progress = Progress {
        start: Instant::now(),
    };
    let mut demo = start(cli, progress)?;
    let jobs = submit(&mut demo)?;
    let calibration = calibrate(&mut demo, &jobs)?;
    let before = steady_state(&mut demo)?;
    let during = event(&mut demo, &jobs, &before)?;
    let grid = openadr_event(&mut demo, &jobs)?;
    let down = teardown(&mut demo, &jobs)?;
    let ok = report(&demo, &jobs, &calibration, &before, &during, &grid, &down)?;
    let _ = std::fs::remove_dir_all(&demo.stack.base);
    Ok(ok)
}

/// True relative throughput of `profile` at a per-GPU cap (its measured table where it
/// has one).
fn relative_at(profile: &Profile, cap_w: f64) -> f64 {
    profile
        .curve(&[cap_w])
        .first()
        .map_or(1.0, |p| p.throughput)
}

/// Highest draw and seconds over the budget (beyond the tolerance) among `samples`.
fn over_budget(samples: &[(f64, f64)], budget_w: f64) -> (f64, f64) {
    let peak = samples.iter().map(|s| s.1).fold(0.0, f64::max);
    let seconds = samples
        .windows(2)
        .filter(|w| w[0].1 > budget_w * (1.0 + DRAW_TOLERANCE))
        .map(|w| w[1].0 - w[0].0)
        .sum::<f64>();
    // An empty sum is -0.0; the summary says 0.
    (peak, seconds + 0.0)
}

/// One compared policy, scored on the true curves.
#[derive(Debug)]
struct ComparedRow {
    key: &'static str,
    what: &'static str,
    scored: Scored,
    /// Share of the gap from the equal split within the tiers to the oracle recovered;
    /// none for a policy that breaks a bound (or when there is no gap).
    gap: Option<f64>,
}

/// A snapshot's decisions scored on the profiles' TRUE curves against the oracle.
#[derive(Debug)]
struct Comparison {
    label: String,
    /// The budget the controller split among these jobs (the held job's draw, idle GPUs
    /// and the metered margin already off), W.
    budget_w: f64,
    /// Σ tokens/s of these jobs uncapped, on their true curves.
    uncapped_tokens_per_s: f64,
    rows: Vec<ComparedRow>,
    oracle: Scored,
}

impl Comparison {
    fn row(&self, key: &str) -> Option<&ComparedRow> {
        self.rows.iter().find(|r| r.key == key)
    }

    fn json(&self) -> serde_json::Value {
        let kept = |t: f64| round_to(t / self.uncapped_tokens_per_s * 100.0, 1);
        let row = |key: &str, what: &str, s: &Scored, gap: Option<f64>| {
            json!({
                "policy": key, "what": what,
                "tokens_per_s": round_to(s.tokens_per_s, 0),
                "kept_pct": kept(s.tokens_per_s),
                "gap_recovered_pct": gap.map(|g| round_to(g * 100.0, 1)),
                "power_true_w": round_to(s.power_w, 0),
                "caps_w": s.caps_w,
                "bounds_broken": s.bounds_broken.iter().map(|(job, slowdown)| json!({
                    "job": job, "slowdown_pct": round_to(slowdown * 100.0, 1),
                })).collect::<Vec<_>>(),
            })
        };
        let mut rows: Vec<serde_json::Value> = self
            .rows
            .iter()
            .map(|r| row(r.key, r.what, &r.scored, r.gap))
            .collect();
        rows.push(row(
            "oracle",
            "oracle: the true curves, tiers held",
            &self.oracle,
            Some(1.0),
        ));
        json!({
            "label": self.label, "budget_w": round_to(self.budget_w, 0),
            "uncapped_tokens_per_s": round_to(self.uncapped_tokens_per_s, 0),
            "scored_on": "the profiles' true curves (SIMULATED)",
            "gap_zero": "tier-equal", "rows": rows,
        })
    }

    fn render(&self) -> String {
        let kept = |t: f64| t / self.uncapped_tokens_per_s * 100.0;
        let bounds = |s: &Scored| {
            if s.bounds_broken.is_empty() {
                "all held".to_string()
            } else {
                format!(
                    "{} BROKEN ({})",
                    s.bounds_broken.len(),
                    s.bounds_broken
                        .iter()
                        .map(|(job, slowdown)| format!("job {job} {:.1} %", slowdown * 100.0))
                        .collect::<Vec<_>>()
                        .join(", ")
                )
            }
        };
        let mut rows: Vec<Vec<String>> = self
            .rows
            .iter()
            .map(|r| {
                vec![
                    r.what.to_string(),
                    format!("{:.0}", r.scored.tokens_per_s),
                    format!("{:.1} %", kept(r.scored.tokens_per_s)),
                    match (r.gap, r.scored.bounds_broken.is_empty()) {
                        (Some(g), _) => format!("{:.1} %", round_to(g * 100.0, 1)),
                        (None, false) => "n/a: breaks bounds".into(),
                        (None, true) => "-".into(),
                    },
                    Watts(r.scored.power_w).to_string(),
                    bounds(&r.scored),
                ]
            })
            .collect();
        rows.push(vec![
            "oracle: the true curves, tiers held".into(),
            format!("{:.0}", self.oracle.tokens_per_s),
            format!("{:.1} %", kept(self.oracle.tokens_per_s)),
            "100 %".into(),
            Watts(self.oracle.power_w).to_string(),
            bounds(&self.oracle),
        ]);
        format!(
            "\n== what the allocator buys: {} (budget {} for these jobs; every policy asked of the controller on its curves, scored on the profiles' TRUE curves; gap = share of the gap from the equal split within the tiers to the oracle recovered; SIMULATED)\n{}",
            self.label,
            Watts(self.budget_w),
            table(
                &["policy", "tokens/s", "of uncapped", "gap recovered", "power (true)", "tier bounds"],
                &rows
            )
        )
    }
}

/// Scores every decision of `snap` on the true curves of the jobs the controller
/// allocated (a job that changed phase before the snapshot on its new profile), and the
/// oracle on the same jobs and budget.
fn compare(
    demo: &Demo,
    jobs: &[Job],
    changes: &[PhaseChange],
    snap: &Snapshot,
) -> Result<Comparison> {
    let reference = snap
        .decision("tier-equal")
        .and_then(|d| d.allocation.as_ref())
        .ok_or(format!("{}: the controller made no allocation", snap.label))?;
    let grid: Vec<f64> = (20..=70).map(|c| f64::from(c) * 10.0).collect();
    let mut true_jobs = Vec::new();
    for allocated in &reference.jobs {
        let Some(job) = jobs.iter().find(|j| j.id.to_string() == allocated.id) else {
            continue;
        };
        let profile = match (job.spec.then, changes.iter().find(|c| c.job == job.id)) {
            (Some(to), Some(c)) if c.at_ms <= snap.at_ms => to,
            _ => job.spec.profile,
        };
        let profile = demo.library.find(profile).map_err(|e| e.to_string())?;
        let gpus = job.spec.nodes * job.spec.gpus_per_node;
        true_jobs.push(TrueJob::from_per_gpu(
            &allocated.id,
            &profile.curve(&grid),
            profile.tokens_per_s_per_gpu,
            gpus,
            Some(job.spec.bound),
        )?);
    }
    let caps_of = |d: &DecisionView| -> BTreeMap<String, f64> {
        d.allocation
            .iter()
            .flat_map(|a| a.jobs.iter())
            .map(|j| (j.id.clone(), j.cap_w.0))
            .collect()
    };
    let limits = CapLimits {
        min_w: Watts(200.0),
        max_w: Watts(DEFAULT_CAP_W),
        step_w: Watts(10.0),
    };
    let oracle = compare::oracle(&true_jobs, reference.budget_w.0, limits)?;
    let scored: Vec<(&'static str, &'static str, Scored)> = COMPARED
        .iter()
        .filter_map(|&(key, what, _)| {
            let d = snap.decision(key)?;
            Some((key, what, compare::score(key, &true_jobs, &caps_of(d))))
        })
        .collect();
    // The zero of the gap: the equal split within the tiers (see powerflex_core::compare).
    // A policy that breaks a bound buys tokens no tier-holding allocation may: it has no
    // share of that gap.
    let zero = scored
        .iter()
        .find(|(k, _, _)| *k == "tier-equal")
        .map(|(_, _, s)| s.clone())
        .ok_or("no tier-aware equal decision")?;
    let rows = scored
        .into_iter()
        .map(|(key, what, s)| ComparedRow {
            key,
            what,
            gap: if s.bounds_broken.is_empty() {
                compare::gap_recovered(&s, &zero, &oracle)
            } else {
                None
            },
            scored: s,
        })
        .collect();
    Ok(Comparison {
        label: snap.label.clone(),
        budget_w: reference.budget_w.0,
        uncapped_tokens_per_s: true_jobs
            .iter()
            .map(|j| j.curve.uncapped().throughput)
            .sum(),
        rows,
        oracle,
    })
}

/// The jobs' energy records for `summary.json`, every float already rounded for people
/// (`compare::tidy_floats`): the printout is made from this, so it says the same numbers.
fn energy_summary(energy: &Energy) -> serde_json::Value {
    let opt = |v: Option<f64>| v.map_or(serde_json::Value::Null, |v| json!(v));
    let jobs: Vec<serde_json::Value> = energy
        .records
        .iter()
        .map(|r| {
            json!({
                "job": r.job_id.parse::<u64>().map_or(json!(r.job_id), |n| json!(n)),
                "tier": r.tier, "gpus": r.gpus,
                "energy_j": r.energy_j, "energy_kwh": r.energy_kwh,
                "energy_source": r.energy_source.name(),
                "avg_power_w": r.avg_power_w, "peak_power_w": r.peak_power_w,
                "capped_pct": r.capped_pct, "event_s": r.event_s,
                "slowdown_pct": opt(r.slowdown_pct), "bound_pct": opt(r.bound_pct),
                "bound_held": r.bound_held,
                "saved_estimate_j": opt(r.saved_estimate_j),
                "incomplete_nodes": r.incomplete_nodes, "simulated": r.simulated,
                "summary_line": r.summary_line(),
            })
        })
        .collect();
    let by_tier: Vec<serde_json::Value> =
        powerflex_controller::energy_plot::by_tier(&energy.records)
            .iter()
            .map(|t| {
                json!({
                    "tier": t.tier, "jobs": t.jobs, "energy_j": t.energy_j,
                    "energy_kwh": t.energy_j / J_PER_KWH, "jobs_in_events": t.jobs_in_events,
                    "saved_in_events_estimate_j": t.saved_in_events_j,
                    "saved_outside_events_estimate_j": t.saved_outside_events_j,
                })
            })
            .collect();
    let total_j: f64 = energy.records.iter().map(|r| r.energy_j).sum();
    compare::tidy_floats(json!({
        "source": "the controller's records (powerflexctl accounting --format json); SIMULATED GPUs' energy counters",
        "jobs": jobs,
        "by_tier": by_tier,
        "total_j": total_j, "total_kwh": total_j / J_PER_KWH,
        "saved_estimate_j": energy.records.iter().filter_map(|r| r.saved_estimate_j).sum::<f64>(),
        "missing_jobs": energy.missing,
        "plot": energy.plot.as_ref().ok().map(|p| p.display().to_string()),
        "plot_error": energy.plot.as_ref().err(),
    }))
}

/// The energy table and each job's end-of-job line, from [`energy_summary`]'s rounded
/// figures (so every number printed is one `summary.json` holds).
fn print_energy(summary: &serde_json::Value, energy: &Energy) {
    let num = |v: &serde_json::Value| v.as_f64().map_or("-".to_string(), |x| format!("{x}"));
    let empty = Vec::new();
    let jobs = summary["jobs"].as_array().unwrap_or(&empty);
    let rows: Vec<Vec<String>> = jobs
        .iter()
        .map(|j| {
            vec![
                j["job"].to_string(),
                j["tier"].as_str().unwrap_or("-").to_string(),
                num(&j["energy_kwh"]),
                num(&j["energy_j"]),
                j["gpus"].to_string(),
                num(&j["avg_power_w"]),
                num(&j["peak_power_w"]),
                num(&j["capped_pct"]),
                num(&j["slowdown_pct"]),
                num(&j["bound_pct"]),
                match j["bound_held"].as_bool() {
                    Some(true) => "held".into(),
                    Some(false) => "BROKEN".into(),
                    None => "-".into(),
                },
                num(&j["event_s"]),
                num(&j["saved_estimate_j"]),
            ]
        })
        .collect();
    println!("\n== energy per job, from the controller's records (powerflexctl accounting --format json; the SIMULATED GPUs' energy counters over each job's hold; saved = ESTIMATE against running uncapped for the same work, from the job's measured curve)");
    print!(
        "{}",
        table(
            &[
                "job",
                "tier",
                "kWh",
                "J",
                "GPUs",
                "avg W",
                "peak W",
                "capped %",
                "slowdown %",
                "bound %",
                "bound",
                "in events s",
                "saved J (ESTIMATE)",
            ],
            &rows
        )
    );
    println!(
        "  total                            {} kWh ({} J); about {} J saved (ESTIMATE)",
        num(&summary["total_kwh"]),
        num(&summary["total_j"]),
        num(&summary["saved_estimate_j"])
    );
    for t in summary["by_tier"].as_array().unwrap_or(&empty) {
        println!(
            "  tier {:<27} {} kWh over {} jobs ({} in events); saved (ESTIMATE) {} J by jobs in events, {} J by the others",
            t["tier"].as_str().unwrap_or("-"),
            num(&t["energy_kwh"]),
            t["jobs"],
            t["jobs_in_events"],
            num(&t["saved_in_events_estimate_j"]),
            num(&t["saved_outside_events_estimate_j"])
        );
    }
    if !energy.missing.is_empty() {
        println!(
            "  NO RECORD for job(s) {:?} within {} s of their end",
            energy.missing,
            RECORDS_WAIT.as_secs()
        );
    }
    println!("\n== each job's end-of-job line, from the controller's record");
    for j in jobs {
        println!("  {}", j["summary_line"].as_str().unwrap_or("-"));
    }
    match &energy.plot {
        Ok(path) => println!(
            "\nenergy plot (powerflexctl accounting --plot: GPU energy per tier, energy saved as an ESTIMATE split by grid events): {}",
            path.display()
        ),
        Err(e) => println!("\nNO ENERGY PLOT: powerflexctl accounting --plot failed: {e}"),
    }
}

/// Phase 7: the tables, the plot and `summary.json`; true when every promise held.
fn report(
    demo: &Demo,
    jobs: &[Job],
    calibration: &Calibration,
    before: &Before,
    during: &During,
    grid: &Openadr,
    down: &Teardown,
) -> Result<bool> {
    let m = Measured {
        demo,
        jobs,
        calibration,
        before,
        during,
        grid,
        down,
    };
    let target_w = before.target_w;
    let plot = m.write_plot()?;
    let equal = during
        .snapshot
        .decision("tier-equal")
        .ok_or("no tier-aware equal decision")?;
    let comparisons = m.compare_all()?;
    let first = &comparisons[EVENT_ONE];
    let per_job = m.per_job(equal)?;
    let draw = m.judge_draw(target_w);
    let budget_w = f64::from(NODES * GPUS_PER_NODE) * DEFAULT_CAP_W;
    m.print_event_one(&per_job, &draw, first, budget_w);
    m.print_openadr();
    m.print_plot_and_caps(&plot);
    print_comparisons(&comparisons);
    let energy = energy_summary(&down.energy);
    print_energy(&energy, &down.energy);
    let energy_ok = down.energy.missing.is_empty()
        && down.energy.records.iter().all(|r| r.energy_j > 0.0)
        && down.energy.plot.is_ok();
    m.write_summary(&per_job, &draw, &comparisons, energy, budget_w)?;
    // One promise, one check: a job whose own record (what `accounting` and its
    // end-of-job line show) says its bound was not held fails the run, whatever the
    // demo's own window measured.
    let records_broken: Vec<String> = down
        .energy
        .records
        .iter()
        .filter(|r| r.bound_held == Some(false))
        .map(|r| r.summary_line())
        .collect();
    let ok = per_job.promises_held
        && records_broken.is_empty()
        && draw.draw_ok
        && draw.phases_ok
        && grid.ok()
        && !during.changes.is_empty()
        && down.restored_by_agents
        && down.all_default
        && energy_ok;
    m.print_verdict(ok, &records_broken);
    Ok(ok)
}

/// What the demo's phases measured: the report's input.
#[derive(Clone, Copy)]
struct Measured<'a> {
    demo: &'a Demo,
    jobs: &'a [Job],
    calibration: &'a Calibration,
    before: &'a Before,
    during: &'a During,
    grid: &'a Openadr,
    down: &'a Teardown,
}

/// What each job did before and during event 1, against its tier's promise.
struct PerJob {
    /// The per-job table's rows.
    rows: Vec<Vec<String>>,
    /// The calibration table's rows.
    cal_rows: Vec<Vec<String>>,
    /// Each job in `summary.json`.
    summary_jobs: Vec<serde_json::Value>,
    total_before: f64,
    total_during: f64,
    /// Every job within its bound, and flex0 never capped.
    promises_held: bool,
}

/// Event 1's draw against its budget, the phase changes' transients apart.
struct DrawVerdict {
    /// How long after a phase change's new load the draw is not judged, s.
    settle_window: f64,
    /// The samples judged: (s into the event, W).
    judged: Vec<(f64, f64)>,
    max_draw: f64,
    seconds_over: f64,
    mean_draw: f64,
    draw_ok: bool,
    /// Each phase change in `summary.json`.
    phase_summary: Vec<serde_json::Value>,
    phases_ok: bool,
}

impl Measured<'_> {
    /// The plot of the whole run (budget, metered draw, the caps the GPUs enforced,
    /// the marks), written next to the logs.
    fn write_plot(&self) -> Result<PathBuf> {
        let Measured { demo, .. } = *self;
        let plot = demo.out.join("powerflex-demo.svg");
        let svg = powerflex_controller::plot::render_svg_marked(
            &demo.meter.samples,
            "powerflex demo (SIMULATED GPUs): budget, metered draw and the caps the GPUs enforced",
            &demo.marks,
        )
        .map_err(|e| e.to_string())?;
        std::fs::write(&plot, svg).map_err(|e| format!("{}: {e}", plot.display()))?;

        Ok(plot)
    }

    /// Every policy scored on the true curves at event 1's budget (planned before it on
    /// the calibration walks alone, in the middle of its hold, and asked again after it
    /// with what it measured) and, when it was taken, while the OpenADR event was in
    /// force. The mid-hold comparison is at [`EVENT_ONE`].
    fn compare_all(&self) -> Result<Vec<Comparison>> {
        let Measured {
            demo,
            jobs,
            before,
            during,
            grid,
            ..
        } = *self;
        let comparisons = {
            let mut all = vec![
                compare(demo, jobs, &during.changes, &before.planned)?,
                compare(demo, jobs, &during.changes, &during.snapshot)?,
                compare(demo, jobs, &during.changes, &during.replay)?,
            ];
            if let Some(snap) = &grid.snapshot {
                all.push(compare(demo, jobs, &during.changes, snap)?);
            }
            all
        };
        Ok(comparisons)
    }

    /// Each job's tokens/s before and during event 1 from its step logs, its slowdown
    /// against its bound and against the equal split (`equal`), its PFI and its
    /// calibration's cost.
    fn per_job(&self, equal: &DecisionView) -> Result<PerJob> {
        let Measured {
            demo,
            jobs,
            calibration,
            before,
            during,
            ..
        } = *self;
        let cli = &demo.cli;
        let cap_in = |decision: &DecisionView, id: u32| -> Option<f64> {
            let jobs = &decision.allocation.as_ref()?.jobs;
            Some(jobs.iter().find(|j| j.id == id.to_string())?.cap_w.0)
        };
        let equal_cap = |id: u32| cap_in(equal, id);
        let mut rows = Vec::new();
        let mut summary_jobs = Vec::new();
        let mut cal_rows = Vec::new();
        let (mut total_before, mut total_during) = (0.0, 0.0);
        let mut promises_held = true;
        for job in jobs {
            let profile = demo
                .library
                .find(job.spec.profile)
                .map_err(|e| e.to_string())?;
            let id = job.id;
            let change = during.changes.iter().find(|c| c.job == id);
            // A job that changed phase is judged on its first phase: its tokens/s are of a
            // different workload afterwards.
            let during_to = change.map_or(during.to_ms, |c| c.at_ms);
            let scale = demo.time_scale();
            let (tps_before, b_lo, b_hi) =
                window(&demo.jobs_dir, id, before.from_ms, before.to_ms, scale)
                    .ok_or(format!("job {id}: no steps logged before the event"))?;
            let (tps_during, d_lo, d_hi) =
                window(&demo.jobs_dir, id, during.from_ms, during_to, scale)
                    .ok_or(format!("job {id}: no steps logged during the event"))?;
            let slowdown = 1.0 - tps_during / tps_before;
            let view = job_view(&before.jobs, id);
            // The first node's points: all the job's nodes walk together.
            let first_points = view.and_then(|v| v.points.values().next());
            let walked: Vec<f64> = first_points
                .map(|p| p.iter().map(|x| x.cap_w.0).collect())
                .unwrap_or_default();
            let measured_pfi = view
                .filter(|v| v.pfi_source == Some(PfiSource::Measured))
                .and_then(|v| v.pfi);
            // One standard error of that PFI, from the first node's curve: a shallow walk
            // (a flex1 job's) knows it far less well than a deep one.
            let pfi_sigma = view
                .and_then(|v| v.curve.values().next())
                .and_then(|curve| {
                    let points: Vec<powerflex_core::point::OperatingPoint> = curve
                        .iter()
                        .map(|p| powerflex_core::point::OperatingPoint {
                            cap_w: Watts(p.cap_w),
                            power_w: Watts(p.power_w),
                            throughput: p.throughput,
                        })
                        .collect();
                    let sigma: Vec<f64> = curve.iter().map(|p| p.throughput_sigma).collect();
                    powerflex_core::pfi::pfi_sigma(&points, &sigma)
                });
            let true_grid: &[f64] = if walked.len() >= 2 {
                &walked
            } else {
                &CALIBRATION_CAPS_W
            };
            let true_pfi = profile.pfi_on(true_grid);
            // A job the allocation does not steer runs the same under either policy.
            let eq_slowdown = match equal_cap(id) {
                Some(e) => 1.0 - relative_at(profile, e),
                None => slowdown,
            };
            total_before += tps_before;
            total_during += tps_during;
            // A job the controller held out in the judged window is judged on that, not on
            // its tokens/s: the hold keeps the promise only if the job allowed it
            // (`preempt=suspend`, what the demo submits it with).
            let held_out = during
                .held
                .iter()
                .find(|h| h.job == id && h.overlaps(during.from_ms, during_to));
            let within = match held_out {
                Some(h) => job.spec.suspend && h.how == Preempt::Suspend,
                None => {
                    slowdown <= job.spec.bound + SLOWDOWN_TOLERANCE
                        && (job.spec.tier != "flex0" || d_lo >= DEFAULT_CAP_W)
                }
            };
            promises_held &= within;
            let cal = calibration
                .jobs
                .iter()
                .find(|(seen, _)| *seen == id)
                .map(|(_, c)| c);
            let top = first_points.and_then(|p| p.first()).map(|p| p.throughput);
            let cost_uncapped_s = match (cal.map(|c| c.calibration_cost), top) {
                (Some(cost), Some(top)) if top > 0.0 => Some(cost / top * cli.time_scale),
                _ => None,
            };
            let calibration_s = cal.and_then(|c| c.calibration_s);
            let profile_text = match change {
                Some(c) => format!("{} → {}", c.from, c.to),
                None => job.spec.profile.to_string(),
            };
            rows.push(vec![
                id.to_string(),
                job.spec.tier.to_string(),
                profile.source.clone(),
                profile_text.clone(),
                format!("{}x{}", job.spec.nodes, job.spec.gpus_per_node),
                true_pfi.map_or("-".into(), |p| format!("{p:.2}")),
                measured_pfi.map_or("not walked".into(), |p| format!("{p:.2}")),
                caps_text(b_lo, b_hi),
                caps_text(d_lo, d_hi),
                format!("{tps_before:.0}"),
                format!("{tps_during:.0}"),
                format!("{:.1} %", slowdown * 100.0),
                match held_out {
                    Some(h) => format!(
                        "{:.0} %, held out ~{:.0} s ({}){}",
                        job.spec.bound * 100.0,
                        h.last_seen_ms.saturating_sub(h.since_ms) as f64 / 1000.0,
                        h.how,
                        if within { "" } else { " BROKEN: not allowed" }
                    ),
                    None => format!(
                        "{:.0} %{}",
                        job.spec.bound * 100.0,
                        if within { "" } else { " BROKEN" }
                    ),
                },
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
            cal_rows.push(vec![
                id.to_string(),
                job.spec.tier.to_string(),
                profile.source.clone(),
                job.spec.profile.to_string(),
                match (walked.first(), walked.last()) {
                    (Some(a), Some(b)) if walked.len() >= 2 => format!("{a}→{b} W"),
                    _ => "not walked (flex0)".into(),
                },
                calibration_s.map_or("-".into(), |s| format!("{s:.0} s")),
                cost_uncapped_s.map_or("-".into(), |s| format!("{s:.0} s")),
            ]);
            summary_jobs.push(json!({
                "job": id, "tier": job.spec.tier, "profile": job.spec.profile,
                "curve_source": profile.source, "real": profile.source == "real",
                "phase_change_to": change.map(|c| c.to),
                "nodes": job.spec.nodes, "gpus_per_node": job.spec.gpus_per_node,
                "power_flex": job.spec.power_flex(),
                "bound": job.spec.bound, "pfi_true": true_pfi, "pfi_measured": measured_pfi, "pfi_sigma": pfi_sigma,
                "caps_walked_w": walked, "cap_before_w": [b_lo, b_hi], "cap_during_w": [d_lo, d_hi],
                "tokens_per_s_before": tps_before, "tokens_per_s_during": tps_during, "slowdown": slowdown,
                "within_bound": within,
                "held_out_s": held_out.map(|h| h.last_seen_ms.saturating_sub(h.since_ms) as f64 / 1000.0),
                "held_out_how": held_out.map(|h| h.how.name()), "equal_cap_w": equal_cap(id), "equal_slowdown": eq_slowdown,
                "calibration_s": calibration_s, "calibration_cost_uncapped_s": cost_uncapped_s,
            }));
        }

        Ok(PerJob {
            rows,
            cal_rows,
            summary_jobs,
            total_before,
            total_during,
            promises_held,
        })
    }

    /// Event 1's draw judged against its budget, `target_w`.
    fn judge_draw(&self, target_w: f64) -> DrawVerdict {
        let Measured { demo, during, .. } = *self;
        // The draw is judged from the end of the settle to just before the ramp back, except
        // for two allocation periods after each phase change: the controller learns of the
        // new load from the agents' next reports and has those two periods to correct it
        // (`metered` mode's promise). That transient is reported on its own. A phase change
        // starts when the job's new load does — its second step's first logged step, not
        // the scancel of the first: between the two the job draws little (metered mode keeps
        // budgeting a walked job at its curve then, so its watts are not lent out and taken
        // back in a hurry when the new load starts).
        let settle_window = 2.0 * ALLOCATION_PERIOD_S;
        let load_at_s: Vec<f64> = during
            .changes
            .iter()
            .map(|c| {
                let first_step_ms = step_logs(&demo.jobs_dir, c.job)
                    .iter()
                    .filter(|p| p.to_string_lossy().ends_with("-1.csv"))
                    .filter_map(|p| read_steps(p).first().map(|s| s.unix_ms))
                    .min();
                match first_step_ms {
                    Some(ms) if ms > c.at_ms => c.at_s + (ms - c.at_ms) as f64 / 1000.0,
                    _ => c.at_s,
                }
            })
            .collect();
        let in_transient = |t: f64| {
            during
                .changes
                .iter()
                .zip(&load_at_s)
                .any(|(c, &load)| t >= c.at_s && t < load + settle_window)
        };
        let judged: Vec<(f64, f64)> = during
            .draw
            .iter()
            .copied()
            .filter(|&(t, _)| t >= during.from_s && !in_transient(t))
            .collect();
        let (max_draw, seconds_over) = over_budget(&judged, target_w);
        let mean_draw = judged.iter().map(|s| s.1).sum::<f64>() / judged.len().max(1) as f64;
        let draw_ok = max_draw <= target_w * (1.0 + DRAW_TOLERANCE);
        let mut phase_summary = Vec::new();
        let mut phases_ok = true;
        for (c, &load) in during.changes.iter().zip(&load_at_s) {
            let transient: Vec<(f64, f64)> = during
                .draw
                .iter()
                .copied()
                .filter(|&(t, _)| t >= c.at_s && t < load + settle_window)
                .collect();
            let after: Vec<(f64, f64)> = during
                .draw
                .iter()
                .copied()
                .filter(|&(t, _)| t >= load + settle_window)
                .collect();
            let (transient_peak, transient_over_s) = over_budget(&transient, target_w);
            let (after_max, after_over_s) = over_budget(&after, target_w);
            // The second phase must really have run: its step logs carry tokens.
            let second_tokens: u64 = step_logs(&demo.jobs_dir, c.job)
                .iter()
                .filter(|p| p.to_string_lossy().ends_with("-1.csv"))
                .map(|p| read_steps(p).last().map_or(0, |s| s.tokens))
                .sum();
            let ok = !after.is_empty()
                && after_max <= target_w * (1.0 + DRAW_TOLERANCE)
                && second_tokens > 0;
            phases_ok &= ok;
            phase_summary.push(json!({
                "job": c.job, "from": c.from, "to": c.to, "at_s": c.at_s, "load_at_s": load,
                "transient_peak_w": transient_peak, "transient_over_s": transient_over_s,
                "draw_max_after_two_periods_w": after_max, "samples_after": after.len(),
                "over_after_two_periods_s": after_over_s,
                "second_phase_tokens": second_tokens, "within_budget_after_two_periods": ok,
            }));
        }

        DrawVerdict {
            settle_window,
            judged,
            max_draw,
            seconds_over,
            mean_draw,
            draw_ok,
            phase_summary,
            phases_ok,
        }
    }

    /// The per-job and calibration tables, and the cluster's figures for event 1
    /// (`first`: the comparison at its budget).
    fn print_event_one(
        &self,
        per_job: &PerJob,
        draw: &DrawVerdict,
        first: &Comparison,
        budget_w: f64,
    ) {
        let Measured {
            demo,
            calibration,
            before,
            ..
        } = *self;
        let cli = &demo.cli;
        let target_w = before.target_w;
        let total_equal = score_of(first, "tier-equal");
        let total_optimal_true = score_of(first, "powerflex");
        println!("\n== per job (tokens/s per SIMULATED second, summed over the job's nodes; slowdown = 1 - during/before; curve: where the profile's curve comes from, `real` = a measured power-limit curve)");
        print!(
            "{}",
            table(
                &[
                    "job",
                    "tier",
                    "curve",
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
                &per_job.rows
            )
        );
        println!("\n== calibration (measured while the jobs trained; cost = tokens lost vs running uncapped, in seconds of uncapped training, simulated time)");
        print!(
            "{}",
            table(
                &[
                    "job",
                    "tier",
                    "curve",
                    "profile",
                    "caps walked",
                    "wall time",
                    "cost"
                ],
                &per_job.cal_rows
            )
        );
        let kept = |x: f64| x / per_job.total_before * 100.0;
        println!(
            "\n== cluster: {} SIMULATED H200 on {NODES} nodes",
            NODES * GPUS_PER_NODE
        );
        println!("  facility budget                 {}", Watts(budget_w));
        println!("  draw before the event           {}", Watts(before.draw_w));
        println!(
            "  grid event budget               {} ({:.0} % below the draw before)",
            Watts(target_w),
            cli.cut * 100.0
        );
        println!(
            "  draw during the event           mean {}, highest {} over {} samples ({:.1} s apart) after the ramp: {}",
            Watts(draw.mean_draw),
            Watts(draw.max_draw),
            draw.judged.len(),
            EVENT_SAMPLE_S,
            if draw.draw_ok { "within the budget" } else { "OVER THE BUDGET" }
        );
        for p in &draw.phase_summary {
            println!(
                "  phase change (job {}, {:.0} s in) {} -> {}: peak {} and {:.1} s over in the first {:.0} s; highest after: {}: {}",
                p["job"],
                p["at_s"].as_f64().unwrap_or(0.0),
                p["from"].as_str().unwrap_or(""),
                p["to"].as_str().unwrap_or(""),
                Watts(p["transient_peak_w"].as_f64().unwrap_or(0.0)),
                p["transient_over_s"].as_f64().unwrap_or(0.0),
                draw.settle_window,
                Watts(p["draw_max_after_two_periods_w"].as_f64().unwrap_or(0.0)),
                if p["within_budget_after_two_periods"] == true {
                    "within the budget"
                } else {
                    "OVER THE BUDGET (or the second phase never ran)"
                }
            );
        }
        if draw.seconds_over > 0.0 {
            println!("  seconds over the event budget   {:.1}", draw.seconds_over);
        }
        for h in &self.during.held {
            println!(
                "  job {} held out                 {} for ~{:.0} s: caps at every floor no longer met the budget (a phase change raises a floor); its tokens/s below count the hold",
                h.job,
                h.how,
                h.last_seen_ms.saturating_sub(h.since_ms) as f64 / 1000.0
            );
        }
        println!(
            "  tokens/s before                 {:.0}",
            per_job.total_before
        );
        println!(
            "  tokens/s during, powerflex      {:.0} ({:.1} % kept; measured by the jobs)",
            per_job.total_during,
            kept(per_job.total_during)
        );
        println!(
            "  powerflex vs the equal split     {:+.0} tokens/s ({:+.1} %) within the tiers; {:+.0} tokens/s ({:+.1} %) against the paper's equal-weight cut, which ignores them (scored on the true curves: see the tables below)",
            total_optimal_true - total_equal,
            (total_optimal_true / total_equal - 1.0) * 100.0,
            total_optimal_true - score_of(first, "paper-equal"),
            (total_optimal_true / score_of(first, "paper-equal") - 1.0) * 100.0
        );
        println!(
            "  calibration                     every curve measured {:.0} s after the jobs started",
            calibration.wall_s
        );
    }

    /// What the OpenADR event did, from publication to the reports at the VTN.
    fn print_openadr(&self) {
        let Measured { grid, .. } = *self;
        let after_pub = |t: Option<u64>| {
            grid.s_after_publish(t).map_or("never".to_string(), |s| {
                format!("{s:.1} s after publication")
            })
        };
        println!("\n== grid event 2, through OpenADR (SIMULATED GPUs; the demo plays the utility at a local VTN)");
        println!(
            "  depth from the floors            caps hold every floor down to {}; job {} draws {} at its floor, ~{} suspended -> limit {}",
            Watts(grid.floors_w),
            grid.job,
            Watts(grid.job_at_floor_w),
            Watts(grid.job_idle_w),
            Watts(grid.target_w)
        );
        println!(
            "  VTN published                    event {} (IMPORT_CAPACITY_LIMIT {:.3} kW, {} s ahead, {} s long)",
            grid.vtn_event_id,
            grid.target_w / 1000.0,
            OPENADR_LEAD_S,
            (grid.end_ms - grid.start_ms) / 1000
        );
        println!(
            "  at the controller                {}: event {}, mapped by powerflex-grid's ledger to {}: {}",
            after_pub(grid.at_ctld_ms),
            grid.ctld_event_id.map_or("none".into(), |i| i.to_string()),
            grid.ledger_event_id.map_or("none".into(), |i| i.to_string()),
            if grid.through_ven() { "through the VEN" } else { "NOT THROUGH THE VEN" }
        );
        println!(
            "  caps in force                    {}",
            after_pub(grid.caps_ms)
        );
        println!(
            "  job {} suspended                 {}{}; held out during the event: {:?}{}",
            grid.job,
            after_pub(grid.suspended_ms),
            if grid.slurm_suspended {
                format!(" (Slurm: SUSPENDED, comment \"{}\")", grid.comment)
            } else {
                " (NO SUSPENDED STATE SEEN IN SLURM)".to_string()
            },
            grid.held,
            if grid.held == [grid.job.to_string()] {
                ""
            } else {
                " NOT EXACTLY THAT JOB"
            }
        );
        println!(
            "  job {} resumed                   {}",
            grid.job,
            grid.resumed_ms.map_or("NEVER".to_string(), |t| format!(
                "{:.1} s after the event's end",
                (t as f64 - grid.end_ms as f64) / 1000.0
            ))
        );
        println!(
            "  draw while in force              highest {} against {} over {} samples ({:.1} s apart): {}",
            Watts(grid.draw_max_w()),
            Watts(grid.target_w),
            grid.in_force().len(),
            EVENT_SAMPLE_S,
            if grid.draw_ok() { "within the budget" } else { "OVER THE BUDGET" }
        );
        println!(
            "  flex0                            lowest cap {}: {}",
            grid.flex0_min_cap_w
                .map_or("?".into(), |c| format!("{c:.0} W")),
            if grid.flex0_min_cap_w.is_some_and(|c| c >= DEFAULT_CAP_W) {
                "untouched"
            } else {
                "CAPPED"
            }
        );
        println!(
            "  reports at the VTN               {} (DEMAND kW: {})",
            grid.reports,
            grid.report_demand_kw
                .iter()
                .map(|kw| format!("{kw:.2}"))
                .collect::<Vec<_>>()
                .join(", ")
        );
    }

    /// Where the plot is, and whether every GPU came back to its default cap.
    fn print_plot_and_caps(&self, plot: &Path) {
        let Measured { down, .. } = *self;
        println!(
            "\nplot (budget and metered draw over time; per-job caps as the GPUs enforced them, read back by the agents): {}",
            plot.display()
        );
        println!(
            "every simulated GPU at its default cap ({DEFAULT_CAP_W:.0} W) after the jobs ended: {}; after shutdown: {}",
            if down.restored_by_agents { "yes" } else { "NO" },
            if down.all_default { "yes" } else { "NO" }
        );
    }

    /// `summary.json`: what the report printed, as data.
    fn write_summary(
        &self,
        per_job: &PerJob,
        draw: &DrawVerdict,
        comparisons: &[Comparison],
        energy: serde_json::Value,
        budget_w: f64,
    ) -> Result<()> {
        let Measured {
            demo,
            jobs,
            calibration,
            before,
            during,
            grid,
            down,
            ..
        } = *self;
        let cli = &demo.cli;
        let target_w = before.target_w;
        let first = &comparisons[EVENT_ONE];
        let total_equal = score_of(first, "tier-equal");
        let total_optimal_true = score_of(first, "powerflex");
        let real_jobs: Vec<u32> = jobs
            .iter()
            .filter(|j| {
                demo.library
                    .find(j.spec.profile)
                    .is_ok_and(|p| p.source == "real")
            })
            .map(|j| j.id)
            .collect();
        let summary = json!({
            "simulated": true,
            "jobs": per_job.summary_jobs,
            "cluster": {
                "gpus": NODES * GPUS_PER_NODE, "nodes": NODES, "budget_w": budget_w,
                "draw_before_w": before.draw_w, "event_budget_w": target_w, "cut": cli.cut,
                "event_start_ms": during.start_ms, "event_end_ms": during.end_ms,
                "draw_during_mean_w": draw.mean_draw, "draw_during_max_w": draw.max_draw,
                "draw_samples": draw.judged.len(), "draw_sample_interval_s": EVENT_SAMPLE_S,
                "seconds_over_budget": draw.seconds_over,
                "tokens_per_s_before": per_job.total_before, "tokens_per_s_during": per_job.total_during,
                "tokens_per_s_equal": total_equal, "tokens_per_s_optimal_true": total_optimal_true,
                "calibration_wall_s": calibration.wall_s,
                "caps_restored_at_job_end": down.restored_by_agents, "caps_default_after_shutdown": down.all_default,
                "real_jobs": real_jobs, "phase_changes": draw.phase_summary,
                "plot_samples": demo.meter.samples.len(),
            },
            // The meter during the event, every ~200 ms: [s into the event, W].
            "draw_event": during.draw.iter().map(|&(t, w)| [t, w]).collect::<Vec<_>>(),
            "comparisons": comparisons.iter().map(Comparison::json).collect::<Vec<_>>(),
            "learning": Learning::of(comparisons).map(|l| l.json()),
            "openadr": {
                "vtn_event_id": grid.vtn_event_id, "ven_name": grid.ven_name, "program": OPENADR_PROGRAM,
                "floors_w": grid.floors_w, "job": grid.job, "job_at_floor_w": grid.job_at_floor_w,
                "job_idle_estimate_w": grid.job_idle_w, "target_w": grid.target_w,
                "published_ms": grid.published_ms, "start_ms": grid.start_ms, "end_ms": grid.end_ms,
                "ctld_event_id": grid.ctld_event_id, "ctld_target_w": grid.ctld_target_w,
                "ledger_event_id": grid.ledger_event_id, "through_ven": grid.through_ven(),
                "at_ctld_after_publish_s": grid.s_after_publish(grid.at_ctld_ms),
                "caps_in_force_after_publish_s": grid.s_after_publish(grid.caps_ms),
                "suspended_after_publish_s": grid.s_after_publish(grid.suspended_ms),
                "slurm_suspended": grid.slurm_suspended, "slurm_comment": grid.comment, "held": grid.held,
                "resumed_after_end_s": grid.resumed_ms.map(|t| (t as f64 - grid.end_ms as f64) / 1000.0),
                "flex0_min_cap_w": grid.flex0_min_cap_w,
                "draw_max_w": grid.draw_max_w(), "draw_samples": grid.in_force().len(),
                "within_budget": grid.draw_ok(),
                "reports": grid.reports, "report_demand_kw": grid.report_demand_kw,
                "ok": grid.ok(),
                // The meter from publication on: [Unix ms, W].
                "draw": grid.draw.iter().map(|&(t, w)| json!([t, w])).collect::<Vec<_>>(),
            },
            "controller_jobs_during": during.jobs,
            "energy": energy,
        });
        let summary_path = demo.out.join("summary.json");
        std::fs::write(
            &summary_path,
            serde_json::to_string_pretty(&compare::tidy_floats(summary))
                .map_err(|e| e.to_string())?,
        )
        .map_err(|e| format!("{}: {e}", summary_path.display()))?;
        println!("summary (JSON): {}", summary_path.display());
        Ok(())
    }

    /// One line: every promise held, or where to look.
    fn print_verdict(&self, ok: bool, records_broken: &[String]) {
        let Measured { demo, .. } = *self;
        for line in records_broken {
            println!("\nBROKEN, by the controller's own record: {line}");
        }
        if ok {
            println!("\nevery tier's promise held, the draw stayed within both events' budgets (through the phase change too), the OpenADR event arrived through the VEN and suspended and resumed exactly the job that allows it, flex0 was never capped, every GPU is back at its default cap, and the controller recorded every job's energy.");
        } else {
            println!(
                "\nFAILED: see the lines marked BROKEN, OVER or NO above; the daemons' logs are in {}",
                demo.out.display()
            );
        }
    }
}

/// A policy's tokens/s in a comparison (0 when it has no row).
fn score_of(c: &Comparison, key: &str) -> f64 {
    c.row(key).map_or(0.0, |r| r.scored.tokens_per_s)
}

/// What event 1's own windows bought: powerflex at event 1's budget, on the same jobs
/// and true curves, planned before the event (calibration walks alone) and in the middle
/// of its hold (with the windows measured since), before any job changed phase. The
/// second is what a second event at this budget would start from.
#[derive(Debug, Clone, PartialEq)]
struct Learning {
    planned_tokens_per_s: f64,
    planned_gap: Option<f64>,
    /// Jobs the plan on the walks alone slows past their bound on the true curves.
    planned_broken: Vec<(String, f64)>,
    measured_tokens_per_s: f64,
    measured_gap: Option<f64>,
    measured_broken: Vec<(String, f64)>,
}

impl Learning {
    /// None when either comparison lacks a powerflex row.
    fn of(comparisons: &[Comparison]) -> Option<Learning> {
        let planned = comparisons.first()?.row("powerflex")?;
        let measured = comparisons.get(EVENT_ONE)?.row("powerflex")?;
        Some(Learning {
            planned_tokens_per_s: planned.scored.tokens_per_s,
            planned_gap: planned.gap,
            planned_broken: planned.scored.bounds_broken.clone(),
            measured_tokens_per_s: measured.scored.tokens_per_s,
            measured_gap: measured.gap,
            measured_broken: measured.scored.bounds_broken.clone(),
        })
    }

    fn json(&self) -> serde_json::Value {
        let pct = |g: Option<f64>| g.map(|g| round_to(g * 100.0, 1));
        let broken = |b: &[(String, f64)]| {
            b.iter()
                .map(|(job, slowdown)| json!({"job": job, "slowdown_pct": round_to(slowdown * 100.0, 1)}))
                .collect::<Vec<_>>()
        };
        json!({
            "planned_tokens_per_s": round_to(self.planned_tokens_per_s, 0),
            "planned_gap_recovered_pct": pct(self.planned_gap),
            "planned_bounds_broken": broken(&self.planned_broken),
            "measured_tokens_per_s": round_to(self.measured_tokens_per_s, 0),
            "measured_gap_recovered_pct": pct(self.measured_gap),
            "measured_bounds_broken": broken(&self.measured_broken),
            "gain_tokens_per_s": round_to(self.measured_tokens_per_s - self.planned_tokens_per_s, 0),
        })
    }

    /// One plan, for people: its tokens/s and either its gap share or the bounds it
    /// breaks on the true curves.
    fn plan_text(tokens: f64, gap: Option<f64>, broken: &[(String, f64)]) -> String {
        if !broken.is_empty() {
            return format!(
                "{tokens:.0} tokens/s, but breaking {} on the true curves ({})",
                if broken.len() == 1 {
                    "a tier bound".to_string()
                } else {
                    format!("{} tier bounds", broken.len())
                },
                broken
                    .iter()
                    .map(|(job, slowdown)| format!("job {job} slowed {:.1} %", slowdown * 100.0))
                    .collect::<Vec<_>>()
                    .join(", ")
            );
        }
        match gap {
            // Rounded as the summary holds it, so the two read alike.
            Some(g) => format!(
                "{tokens:.0} tokens/s, every bound held, {:.1} % of the gap",
                round_to(g * 100.0, 1)
            ),
            None => format!("{tokens:.0} tokens/s, every bound held (no gap to recover)"),
        }
    }

    fn render(&self) -> String {
        let gain = self.measured_tokens_per_s - self.planned_tokens_per_s;
        let verdict = match (self.planned_broken.is_empty(), self.measured_broken.is_empty()) {
            (false, true) => "what event 1 measured kept a promise the calibration walks alone would have broken (below the walks' lowest cap a curve is a guess)".to_string(),
            (true, true) if gain > 0.0 => format!("what event 1 measured bought {gain:.0} tokens/s ({:+.1} %)", gain / self.planned_tokens_per_s.max(f64::MIN_POSITIVE) * 100.0),
            (true, true) => format!("what event 1 measured bought nothing here ({gain:.0} tokens/s)"),
            (_, false) => "what event 1 measured still leaves a bound broken on the true curves".to_string(),
        };
        format!(
            "\n  learning (a second event at event 1's budget, on the same jobs and true curves): planned on the calibration walks alone, powerflex keeps {}; with the windows event 1 measured in its first half, {}: {verdict}",
            Self::plan_text(self.planned_tokens_per_s, self.planned_gap, &self.planned_broken),
            Self::plan_text(self.measured_tokens_per_s, self.measured_gap, &self.measured_broken),
        )
    }
}

/// The policy comparisons, and what event 1's windows bought at its budget.
fn print_comparisons(comparisons: &[Comparison]) {
    for c in comparisons {
        print!("{}", c.render());
    }
    match Learning::of(comparisons) {
        Some(l) => println!("{}", l.render()),
        None => {
            println!("\n  learning: powerflex made no allocation at event 1's budget to compare")
        }
    }
}
