//! The agent's decisions, as a pure state machine: the control loop feeds it the time,
//! requests, progress and GPU readings, and executes the [`Action`]s it returns. No I/O,
//! no clock: tests drive it with a fake time.
//!
//! Per GPU the desired cap is:
//! - no job, or a job with `--power-flex=none`: the saved default;
//! - a managed job: its granted cap — the controller's lease while it lasts, then the
//!   site's fail-safe cap; in standalone mode the node budget's allocation; with neither,
//!   uncapped — lowered further while its calibration walk holds a level;
//!
//! one cap per job, the same on all its GPUs, clamped to each GPU's constraints and
//! written only when it changes.
//!
//! The types the machine keeps are here; what it does with them is in a child module per
//! input it handles (children, so [`Agent`]'s fields stay private to `control`):
//! - `step`: the one entry point, [`Agent::step`], and the inputs and outputs it takes
//!   and gives;
//! - `jobs`: registrations and ends; `progress`: progress reports; `lease`: the
//!   controller's leases; `readings`: what the GPUs and NVML report;
//! - `tick`: one control period; `caps`: which cap each GPU gets (grants, the fail-safe,
//!   fail-static through a restart and a stop); `standalone`: the node budget's split;
//! - `restart`: the state saved for the next run and taken back from it; `shares`: the
//!   accounting and the final shares kept for the controller; `snapshot`: the status;
//!   `settings`: the settings from the site config and their reload.

use std::collections::{BTreeMap, BTreeSet};

use serde::Serialize;

use powerflex_core::allocate::Policy;
use powerflex_core::config::UnregisteredGpuUse;
use powerflex_core::curve::CapCurve;
use powerflex_core::flex::{FlexRequest, Service, TierTable};
use powerflex_core::point::OperatingPoint;
use powerflex_core::{UnixMs, Watts};
use powerflex_proto::status::CurvePoint;

use crate::calibration::{Calibration, CalibrationSettings, ProgressLog};
use crate::gpu::{GpuIdentity, GpuSample};
use crate::usage::JobUsage;
use powerflex_proto::usage::NodeUsage;

mod caps;
mod jobs;
mod lease;
mod progress;
mod readings;
mod restart;
mod settings;
mod shares;
mod snapshot;
mod standalone;
mod step;
mod tick;

pub use snapshot::seen_by;
pub use step::{
    AdoptionCandidate, AgentInput, AgentOutput, CapWrite, CapWriteResult, ControlFacts,
    ControlReads, GpuProcesses, GpuReading, Reply, StartFacts, TickReads,
};

/// The step name a job taken back from its running processes (no record, no
/// registration) is registered under.
pub const ADOPTED_STEP: &str = "adopted";

/// Everything the state machine needs from the site config.
#[derive(Debug, Clone)]
pub struct AgentSettings {
    /// Slurm node name this agent serves.
    pub node: String,
    pub tiers: TierTable,
    pub default_service: Service,
    pub calibration: CalibrationSettings,
    /// Cap granularity, W per GPU.
    pub cap_step: Watts,
    /// Cap applied when the controller's lease runs out.
    pub failsafe_cap: Watts,
    /// Standalone mode: this node's GPU power budget.
    pub node_budget: Option<Watts>,
    pub policy: Policy,
    /// Controller mode: how long a lease lasts, seconds.
    pub lease_ttl_s: f64,
    /// Telemetry prior: PFI ≈ intercept + slope · DRAM copy product.
    pub prior_intercept: f64,
    pub prior_slope: f64,
    /// What the plugin puts in a job's `POWERFLEX_PROGRESS`.
    pub progress_address: String,
    /// A job seen with step daemons on this host whose daemons have all been gone this
    /// long is ended, epilog or not, s.
    pub job_end_grace_s: f64,
    /// Write limits (`agent.enforce`, default true). Off (observe mode): the agent
    /// measures, accounts and reports every job and takes the controller's leases, but
    /// never writes a limit; the caps it would write are in its status.
    pub enforce: bool,
    /// What a GPU used while no registered job holds it gets
    /// (`agent.unregistered_gpu_use`).
    pub unregistered_gpu_use: UnregisteredGpuUse,
}

/// Longest a final share is kept for the controller while it goes unacknowledged, ms:
/// a controller acknowledges one once its run's record is written (a minute or so
/// after the job's end), so a day covers a controller down for hours; past it the share
/// is dropped with a warning (the node's usage log has it). A controller older than
/// the acknowledgements never sends one: its agents re-send each share this long.
pub const UNACKED_FINAL_MAX_AGE_MS: u64 = 24 * 3_600_000;

/// The batch step as the SPANK plugin names it (`logic::step_name`).
pub const BATCH_STEP_NAME: &str = "batch";

/// Most unacknowledged final shares kept (a node ending many jobs while the controller
/// is away); beyond, the oldest is dropped with a warning.
pub const MAX_ENDED_KEPT: usize = 512;

use crate::saved::UnackedFinal;

/// A job still in calibration warm-up this long after registration is logged with
/// why, at most every [`WARMUP_LOG_EVERY_S`], s.
pub const WARMUP_LOG_AFTER_S: f64 = 30.0;
pub const WARMUP_LOG_EVERY_S: f64 = 30.0;

/// What the control loop must do.
#[derive(Debug, Clone, PartialEq)]
pub enum Action {
    /// Write a power limit (already clamped) to a GPU.
    SetCap { gpu: u32, cap: Watts },
    /// The persisted state changed: save it.
    Persist,
}

/// One GPU as the agent tracks it.
#[derive(Debug, Clone)]
pub struct GpuSlot {
    pub identity: GpuIdentity,
    /// The limit to restore: the GPU's limit when powerflex first saw it.
    pub saved_default: Watts,
    /// The limit last written (or read back at start).
    pub applied: Option<Watts>,
    /// Why the GPU is out of service, when it is.
    pub degraded: Option<String>,
    pub last: Option<GpuSample>,
    /// Since when (agent seconds) the limit read back has been the one in `last`: the
    /// power in `last` reflects that limit only once it has held for a while.
    pub cap_since: Option<f64>,
    /// The job using it.
    pub job: Option<String>,
    /// The most this GPU may be set to while a managed job uses it, until the
    /// controller's first current lease of this run: the limit it read back at the
    /// agent's start (controller mode). A restart or an upgrade never raises a running
    /// job's cap the previous run left (fail-static), whatever the state file says; only
    /// a lease decided now may.
    pub start_ceiling: Option<Watts>,
    /// Observe mode: the limit the agent would have written.
    pub would_cap: Option<Watts>,
    /// The processes NVML listed on the GPU at the last scan, with the job each belongs
    /// to by its ancestry (shown in status, so what NVML reported can be checked
    /// against what the agent made of it).
    pub nvml_processes: Vec<(u32, Option<String>)>,
    /// Since when (agent seconds) NVML has listed processes on this GPU while no
    /// registered job held it.
    pub unregistered_since: Option<f64>,
    /// Other jobs than the holder whose processes NVML lists on this GPU (foreign use).
    pub foreign_jobs: BTreeSet<String>,
    /// When (agent seconds) the limit was last found lowered behind the agent's back,
    /// the most recent first, at most [`OWNER_OVERRIDES`] within [`OWNER_WINDOW_S`].
    pub lowered_at: Vec<f64>,
    /// Another power manager (DPS, Mission Control's power steering, a BMC, an operator)
    /// holds this GPU's limit below the agent's. The agent stops writing it (see
    /// [`OWNER_OVERRIDES`]) until the limit rises past the one it is counted at or to the
    /// cap the agent wants, and the GPU counts outside its job at its enforced limit.
    pub owned_elsewhere: Option<OwnedElsewhere>,
    /// A GPU taken back from another manager is written no higher than the limit it was
    /// counted at, for this many more current leases (the controller's next one may have
    /// been decided before it heard the GPU was back in its job): (ceiling, leases left).
    pub take_back_ceiling: Option<(Watts, u8)>,
}

/// A GPU another power manager holds ([`GpuSlot::owned_elsewhere`]).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct OwnedElsewhere {
    /// Since when (agent seconds).
    pub since: f64,
    /// The limit it is counted at (the lowest read while held): the node's report counts
    /// it there, outside its job.
    pub counted: Watts,
}

/// Current leases a taken-back GPU stays at most at the limit it was counted at.
pub const TAKE_BACK_LEASES: u8 = 2;

/// Times within [`OWNER_WINDOW_S`] a GPU's limit must be found lowered below what the
/// agent wrote before the agent takes it as held by another power manager and stops
/// writing it: once is an operator's one-off (written back, as before), three times is
/// something that keeps setting it, which the agent must not fight. Only a lower limit is
/// yielded to; a higher one would carry the site over its budget and is always written
/// back.
pub const OWNER_OVERRIDES: usize = 3;

/// The window [`OWNER_OVERRIDES`] are counted in, s.
pub const OWNER_WINDOW_S: f64 = 120.0;

impl GpuSlot {
    /// The limit `found` on GPU `gpu` against the one the agent last wrote or read: a
    /// difference beyond half a watt was made behind the agent's back. A degraded GPU's
    /// record is not trusted, so it is never a mismatch.
    fn mismatch(&self, gpu: u32, found: Watts) -> Option<CapMismatch> {
        let expected = self.applied?;
        (self.degraded.is_none() && (expected.0 - found.0).abs() > 0.5).then_some(CapMismatch {
            gpu,
            expected,
            found,
        })
    }
}

/// A lease from the controller for this node, as the link delivers it: per-job caps for
/// `ttl_s`, and the cap for a job it does not name ([`Lease`] is what the agent keeps).
#[derive(Debug, Clone, PartialEq)]
pub struct LeaseMessage {
    pub caps: BTreeMap<String, Watts>,
    pub ttl_s: f64,
    pub start_cap: Option<Watts>,
    /// Jobs to walk again (their measurements left their curves).
    pub recalibrate: Vec<String>,
    /// Jobs that may be probed to learn their curves (on this node alone).
    pub learn: Vec<String>,
    /// Seconds to the next announced grid event's start, if one is scheduled.
    pub next_event_in_s: Option<f64>,
    /// A grid event is in force.
    pub event_in_force: bool,
    /// The sending controller's leadership epoch (0: a single controller): a lease from
    /// an epoch below the highest this agent has accepted is refused
    /// ([`LeaseRefused::StaleEpoch`]).
    pub epoch: u64,
}

/// Why the machine refused a lease, for the controller that sent it (the link answers
/// it with `Body::Fenced`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LeaseRefused {
    /// The lease comes from a controller whose leadership ended: this agent has
    /// accepted a lease of `accepted_epoch` from the one that took over since.
    StaleEpoch {
        lease_epoch: u64,
        accepted_epoch: u64,
    },
}

/// Who sent a progress report, as the kernel tells it: the process's uid and pid
/// (`SO_PEERCRED`), and the Slurm step it runs in, from its root-owned `slurmstepd`
/// ancestry (never from its environment).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReportSender {
    pub uid: u32,
    pub pid: u32,
    /// The job of the step the process runs in.
    pub step_job: String,
    /// The Slurm cluster of that step's daemon (its `SLURM_CONF`); `None` for the
    /// default config.
    pub cluster: Option<String>,
}

/// One job on this node.
#[derive(Debug, Clone)]
pub struct Job {
    pub id: String,
    pub uid: u32,
    pub request: FlexRequest,
    pub gpus: Vec<u32>,
    pub steps: BTreeSet<String>,
    pub log: ProgressLog,
    pub calibration: Calibration,
    /// The cap the budget grants (allocation or lease), when one applies.
    pub granted: Option<Watts>,
    pub registered_at: f64,
    /// Telemetry prior when there is no progress signal: (DRAM copy product, PFI).
    pub prior: Option<(f64, f64)>,
    /// Curve and PFI restored from a previous run of the agent.
    pub restored_pfi: Option<f64>,
    pub restored_points: Vec<OperatingPoint>,
    /// Whether the job's progress reports count tokens (`Some(true)`) or only steps;
    /// `None` before its first report. Tokens/s of different jobs add up; steps/s do not.
    pub counts_tokens: Option<bool>,
    /// When a step daemon of the job was last seen on this host (agent seconds); `None`
    /// before the first sighting.
    pub seen_alive_at: Option<f64>,
    /// The cluster of the step daemon that registered the job (its `SLURM_CONF`):
    /// `None` while unknown (registered by something other than a step daemon), and then
    /// the job is never judged by the step daemons seen on the host.
    pub cluster: Option<Option<String>>,
    /// When the agent last logged why the job is still warming up (agent seconds).
    pub warmup_logged_at: Option<f64>,
    /// Its energy and what its caps did, on this node.
    pub usage: JobUsage,
}

impl Job {
    /// The calibrated points: this run's walk, or the previous run's when this one has
    /// not walked.
    pub fn curve_points(&self) -> Vec<OperatingPoint> {
        self.points_of(&self.curve())
    }

    /// [`Job::curve_points`] from the curve already built by [`Job::curve`].
    fn points_of(&self, curve: &[CurvePoint]) -> Vec<OperatingPoint> {
        if curve.is_empty() {
            return self.restored_points.clone();
        }
        curve
            .iter()
            .map(|p| powerflex_proto::point::from_array([p.cap_w, p.power_w, p.throughput]))
            .collect()
    }

    /// The estimated curve, highest cap first, with each point's standard errors and
    /// windows (see [`Calibration::best_curve`]).
    pub fn curve(&self) -> Vec<CurvePoint> {
        self.curve_of(self.calibration.best_curve().as_ref())
    }

    /// [`Job::curve`] from the best curve already estimated (it is not cheap).
    fn curve_of(&self, best: Option<&CapCurve>) -> Vec<CurvePoint> {
        let Some(curve) = best else {
            return Vec::new();
        };
        let levels = self.calibration.best_levels();
        let sigma = curve.knot_sigma();
        curve
            .knots()
            .iter()
            .enumerate()
            .rev()
            .map(|(i, k)| CurvePoint {
                cap_w: k.cap_w.0,
                power_w: k.power_w.0,
                throughput: k.throughput,
                power_sigma_w: sigma.get(i).map_or(0.0, |s| s.power_w),
                throughput_sigma: sigma.get(i).map_or(0.0, |s| s.throughput),
                windows: levels
                    .iter()
                    .find(|l| (l.cap.0 - k.cap_w.0).abs() < 0.5)
                    .map_or(0, |l| l.windows as u32),
            })
            .collect()
    }
}

impl Job {
    fn managed(&self) -> bool {
        self.request.service.is_managed()
    }
}

/// A grant of caps from the controller, valid until `expires_at`.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Lease {
    pub caps: BTreeMap<String, Watts>,
    pub expires_at: f64,
    /// Per-GPU cap for a managed job the lease does not name (it started since).
    pub start_cap: Option<Watts>,
}

/// `powerflexd --sample-interval-ms` when not given.
pub const DEFAULT_SAMPLE_INTERVAL_MS: u64 = 1_000;

/// Processes of other jobs began to use a GPU a job holds: counted, logged and shown,
/// the GPU kept by its holder.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ForeignGpuUse {
    pub gpu: u32,
    pub holder: String,
    pub used_by: Vec<String>,
}

/// A GPU whose limit, read back, is not what the agent last wrote: something else
/// (`nvidia-smi -pl`, a GPU reset, a driver reload, a second agent) changed it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct CapMismatch {
    pub gpu: u32,
    /// What the agent last wrote, or last read back when nothing was written since, W.
    pub expected: Watts,
    /// What the GPU reads back, W.
    pub found: Watts,
}

/// Outcome of a registration, for the reply.
#[derive(Debug, Clone, PartialEq)]
pub struct Registered {
    /// The service in `--power-flex` form.
    pub tier: String,
    /// Where the job reports progress (`None` for unmanaged jobs).
    pub progress: Option<String>,
}

/// The agent's state.
#[derive(Debug, Clone)]
pub struct Agent {
    settings: AgentSettings,
    gpus: Vec<GpuSlot>,
    jobs: BTreeMap<String, Job>,
    lease: Option<Lease>,
    /// When the agent started (controller mode: the first lease is due by start + TTL).
    started_at: f64,
    /// Progress reports refused (wrong user, wrong job, malformed).
    progress_rejected: u64,
    /// Why the last site config reload was refused (the settings in force stayed).
    config_error: Option<String>,
    /// GPU limits found changed behind the agent's back (and written again).
    cap_mismatches: u64,
    /// Leases applied since the agent started (counted as the machine takes one; the
    /// edge publishes the status only after writing the caps and reading them back): the
    /// link reports at once when this rises, which confirms the new caps to the controller.
    leases_applied: u64,
    /// New steps that put a job's curve in question
    /// ([`crate::calibration::Calibration::question_curve`]): the link reports at once
    /// when this rises, so the controller plans the job on what physics guarantees
    /// before its new phase runs long at its old phase's cap.
    curve_questions: u64,
    /// Onsets of foreign use on held GPUs ([`ForeignGpuUse`]).
    gpu_foreign_use: u64,
    /// Times a GPU was found held by another power manager ([`OWNER_OVERRIDES`]).
    gpus_owned_elsewhere: u64,
    /// A GPU was found held elsewhere, or taken back, since the state was last saved.
    owned_changed: bool,
    /// Jobs the controller's last lease lets this agent probe (they run on this node
    /// alone); none in standalone mode, where a job's other nodes are unknown.
    learn: BTreeSet<String>,
    /// Controller mode, since the start: no current lease yet, so the limits read back
    /// at start bound every cap ([`GpuSlot::start_ceiling`]).
    awaiting_current_lease: bool,
    /// The controller's last lease said a grid event is in force.
    event_in_force: bool,
    /// Final shares of jobs ended here that the controller has not acknowledged, oldest
    /// first: persisted, and re-sent until acknowledged (see [`UnackedFinal`]).
    unacked: Vec<UnackedFinal>,
    /// The highest controller epoch a lease was accepted from (persisted, so a restart
    /// keeps refusing a controller that lost leadership before it).
    accepted_epoch: u64,
    /// Leases refused for their epoch since the agent started.
    leases_refused_epoch: u64,
    /// Final shares not yet written to the node's usage log.
    pending_records: Vec<NodeUsage>,
    /// The agent's sample (control) period, ms (`powerflexd --sample-interval-ms`): the
    /// jobs' time shares count spans of a few periods (see
    /// [`crate::usage::max_observation_gap_ms`]).
    sample_interval_ms: u64,
    /// When the edge next reads the GPUs, probes the degraded ones, reads the process
    /// table and the state is saved for the accounting (see [`step::TickReads`]).
    timers: step::Timers,
    /// A step wrote caps or asked for read-backs: the status is published by the step
    /// that takes their results, so it shows what the GPUs enforce.
    publish_owed: bool,
}

impl Agent {
    /// An agent for `gpus`, started at `now`, sampling every `sample_interval_ms`. It
    /// writes nothing until its first step, [`AgentInput::Start`], has told it what the
    /// previous run left and what the GPUs read.
    pub fn new(
        settings: AgentSettings,
        gpus: Vec<GpuIdentity>,
        sample_interval_ms: u64,
        now: UnixMs,
    ) -> Agent {
        let mut agent = Agent::with_defaults(settings, gpus, &BTreeMap::new(), now.as_secs_f64());
        agent.sample_interval_ms = sample_interval_ms;
        agent
    }

    /// An agent for `gpus`. `saved` holds default limits persisted by an earlier run (by
    /// UUID): a restart after a crash must not mistake a cap it left for the default.
    fn with_defaults(
        settings: AgentSettings,
        gpus: Vec<GpuIdentity>,
        saved: &BTreeMap<String, Watts>,
        now: f64,
    ) -> Agent {
        let settings_controller_mode = settings.node_budget.is_none();
        let gpus = gpus
            .into_iter()
            .map(|identity| GpuSlot {
                saved_default: saved
                    .get(&identity.uuid)
                    .copied()
                    .unwrap_or(identity.default_cap),
                identity,
                applied: None,
                degraded: None,
                last: None,
                cap_since: None,
                job: None,
                start_ceiling: None,
                would_cap: None,
                nvml_processes: Vec::new(),
                unregistered_since: None,
                foreign_jobs: BTreeSet::new(),
                lowered_at: Vec::new(),
                owned_elsewhere: None,
                take_back_ceiling: None,
            })
            .collect();
        Agent {
            settings,
            gpus,
            jobs: BTreeMap::new(),
            lease: None,
            started_at: now,
            progress_rejected: 0,
            config_error: None,
            cap_mismatches: 0,
            leases_applied: 0,
            curve_questions: 0,
            gpu_foreign_use: 0,
            gpus_owned_elsewhere: 0,
            owned_changed: false,
            learn: BTreeSet::new(),
            awaiting_current_lease: settings_controller_mode,
            event_in_force: false,
            unacked: Vec::new(),
            accepted_epoch: 0,
            leases_refused_epoch: 0,
            pending_records: Vec::new(),
            sample_interval_ms: DEFAULT_SAMPLE_INTERVAL_MS,
            timers: step::Timers::starting_at(now),
            publish_owed: false,
        }
    }

    fn controller_mode(&self) -> bool {
        self.settings.node_budget.is_none()
    }
}

// What `status` and the metrics show: the wire types, so the control socket sends what
// the loop built and clients read it back typed. Named here for what they are to the
// agent; everyone else names them by their one public path in `powerflex_proto::status`.
use powerflex_proto::status::{
    AgentGpuStatus as GpuView, AgentJobStatus as JobView, AgentStatus as Snapshot, GpuProcess,
};

/// A measured curve whose highest knot is below the GPUs' maximum cap (a walk from a
/// grant down), with a knot at the maximum that draws what the GPUs may (the cap on
/// each) and runs no faster than the highest measured knot. A curve is flat above its
/// highest knot, so without this the standalone allocator took a cap above the walk for
/// the power measured at its top, and the node drew up to its GPUs' maximum over the
/// budget (seen: 1,831 W on a 1,500 W node after a walk from 500 W). The knot claims no
/// speed that was not seen, so a cap rises above the walk only where the budget pays for
/// the bound.
fn bounded_above_top(curve: CapCurve, max_cap: Watts, gpus: usize) -> CapCurve {
    curve.with_knot_above(max_cap, Watts(max_cap.0 * gpus as f64))
}

#[cfg(test)]
mod tests;
