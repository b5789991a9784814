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

use std::collections::{BTreeMap, BTreeSet};

use serde::Serialize;

use powerflex_core::allocate::Policy;
use powerflex_core::config::{SiteConfig, UnregisteredGpuUse};
use powerflex_core::curve::CapCurve;
use powerflex_core::flex::{parse_power_flex, Calibrate, FlexRequest, Service, TierTable};
use powerflex_core::gpus::{parse_gpu_list, GpuRef};
use powerflex_core::{UnixMs, Watts};
use powerflex_proto::status::{AgentMode, CalibrationState, CurvePoint, PfiSource, ThroughputUnit};

use crate::calibration::{Calibration, CalibrationSettings, Phase, ProgressLog, Recorded};
use crate::gpu::{ErrorClass, GpuError, GpuIdentity, GpuSample};
use crate::saved::{PersistedJob, PersistedLease, PersistedState};
use crate::usage::{JobUsage, Observation};
use crate::JobKey;
use powerflex_proto::usage::FinalRef;
use powerflex_proto::usage::NodeUsage;
use powerflex_proto::ProgressReport;

mod standalone;
mod step;
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

impl AgentSettings {
    /// The settings from a validated site config for `node`'s GPUs, named `gpu_name` by
    /// NVML: what `powerflexd` starts and reloads with, and what the site harness runs,
    /// so both run the same. Refused (with the models the config has) when no
    /// `[gpu_models.*]` section matches the GPU.
    pub fn from_site(
        site: &SiteConfig,
        node: &str,
        gpu_name: &str,
        progress_address: String,
    ) -> Result<AgentSettings, String> {
        let model = site.gpu_model_for(gpu_name).ok_or_else(|| {
            format!(
                "no [gpu_models.*] section matches the GPU \"{gpu_name}\"; the config has: {}",
                site.gpu_models
                    .iter()
                    .map(|m| m.name.as_str())
                    .collect::<Vec<_>>()
                    .join(", ")
            )
        })?;
        Ok(AgentSettings {
            node: node.to_string(),
            tiers: site.tiers.table.clone(),
            default_service: site.tiers.default.clone(),
            calibration: CalibrationSettings {
                grid: model.calibration_grid(),
                settle_s: site.agent.calibration_settle_s,
                hold_s: site.agent.calibration_hold_s,
                budget_fraction: site.agent.calibration_budget,
                expected_cut: site.facility.expected_cut,
                warmup_s: site.agent.calibration_warmup_s,
                steady_cv: 0.05,
                allowance: site.agent.calibration_allowance.0,
                no_signal_s: site.agent.calibration_warmup_s * 2.0,
                rewalk_after_s: site.agent.calibration_rewalk_after_s,
            },
            cap_step: model.cap_step_w,
            failsafe_cap: model.failsafe_cap_w,
            node_budget: site.agent.node_budget_w,
            policy: site.facility.policy,
            lease_ttl_s: site.controller.lease_ttl_s as f64,
            prior_intercept: site.predictor.pfi_intercept,
            prior_slope: site.predictor.pfi_per_dram_copy_product,
            progress_address,
            job_end_grace_s: site.agent.job_end_grace_s,
            enforce: site.agent.enforce,
            unregistered_gpu_use: site.agent.unregistered_gpu_use,
        })
    }
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

pub use crate::saved::UnackedFinal;

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
}

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
    pub restored_points: Vec<[f64; 3]>,
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
    /// The calibrated points, [per-GPU cap W, job power W, throughput]: this run's walk,
    /// or the previous run's when this one has not walked.
    pub fn curve_points(&self) -> Vec<[f64; 3]> {
        self.points_of(&self.curve())
    }

    /// [`Job::curve_points`] from the curve already built by [`Job::curve`].
    fn points_of(&self, curve: &[CurvePoint]) -> Vec<[f64; 3]> {
        if curve.is_empty() {
            return self.restored_points.clone();
        }
        curve
            .iter()
            .map(|p| [p.cap_w, p.power_w, p.throughput])
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

/// A job's claim of a GPU that other jobs' processes use and its own do not.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GpuClaimRefused {
    pub gpu: u32,
    pub claimed_by: String,
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
    /// GPU claims refused because other jobs' processes use the GPU.
    gpu_claims_refused: u64,
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
    /// Applies re-read settings (SIGHUP). The node name, the progress address and the
    /// mode (standalone or controller) are fixed for the agent's life; new calibration
    /// settings apply to jobs registered from now on, the rest at the next tick.
    fn reload(&mut self, new: Result<AgentSettings, String>) -> Result<(), String> {
        let checked = new.and_then(|new| {
            if new.node_budget.is_some() != self.settings.node_budget.is_some() {
                Err("switching between standalone (agent.node_budget_w) and controller mode needs a restart".to_string())
            } else {
                Ok(new)
            }
        });
        match checked {
            Ok(new) => {
                self.settings = AgentSettings {
                    node: self.settings.node.clone(),
                    progress_address: self.settings.progress_address.clone(),
                    ..new
                };
                self.config_error = None;
                Ok(())
            }
            Err(e) => {
                self.config_error = Some(e.clone());
                Err(e)
            }
        }
    }

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
            gpu_claims_refused: 0,
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

    /// The job's share on this node now (`ended`: final).
    fn share(&self, job: &Job, ended: bool) -> NodeUsage {
        self.share_on(job, job.calibration.best_curve(), ended)
    }

    /// [`Agent::share`] on the job's best curve, already estimated.
    fn share_on(&self, job: &Job, best: Option<CapCurve>, ended: bool) -> NodeUsage {
        let curve = best.or_else(|| {
            let points: Vec<powerflex_core::curve::OperatingPoint> = job
                .restored_points
                .iter()
                .map(|p| powerflex_core::curve::OperatingPoint {
                    cap_w: Watts(p[0]),
                    power_w: Watts(p[1]),
                    throughput: p[2],
                })
                .collect();
            CapCurve::from_points(&points).ok()
        });
        let work = job.counts_tokens.map(|tokens| {
            (
                job.usage.work_seen,
                if tokens {
                    ThroughputUnit::Tokens
                } else {
                    ThroughputUnit::Steps
                },
            )
        });
        let simulated = job
            .gpus
            .iter()
            .any(|&g| self.gpus[g as usize].identity.simulated)
            || job.usage.gpus.keys().any(|u| {
                self.gpus
                    .iter()
                    .any(|g| &g.identity.uuid == u && g.identity.simulated)
            });
        job.usage.share(
            &job.id,
            &self.settings.node,
            job.uid,
            &job.request.to_string(),
            curve.as_ref(),
            job.request.service.max_slowdown().map(|b| 100.0 * b.0),
            job.calibration.pfi().or(job.restored_pfi),
            work,
            ended,
            simulated,
        )
    }

    /// Ends `job_id` here: its GPUs are freed and its final share kept for the
    /// controller and the node's usage log.
    fn finish_job(&mut self, job_id: &str, now: f64) -> bool {
        self.close_share(job_id, now);
        if self.jobs.remove(job_id).is_none() {
            return false;
        }
        for slot in &mut self.gpus {
            if slot.job.as_deref() == Some(job_id) {
                slot.job = None;
            }
        }
        true
    }

    /// Keeps `share` (final) for the controller until it acknowledges it, and for the
    /// node's usage log.
    fn keep_final(&mut self, now: f64, share: NodeUsage) {
        let reference = FinalRef::of(&share);
        self.unacked.retain(|u| FinalRef::of(&u.share) != reference);
        while self.unacked.len() >= MAX_ENDED_KEPT {
            let dropped = self.unacked.remove(0);
            tracing::warn!(
                job_id = %dropped.share.job_id,
                kept = MAX_ENDED_KEPT,
                "too many final shares unacknowledged by the controller; the oldest is dropped (the usage log has it)"
            );
        }
        self.unacked.push(UnackedFinal {
            ended_unix_ms: UnixMs::from_secs_f64(now).ms(),
            share: share.clone(),
        });
        self.pending_records.push(share);
    }

    /// The controller acknowledged these final shares (their records are written): they
    /// are no longer re-sent. Returns how many were dropped (then the state is to be
    /// saved).
    fn acked(&mut self, finals: &[FinalRef]) -> usize {
        let before = self.unacked.len();
        self.unacked
            .retain(|u| !finals.contains(&FinalRef::of(&u.share)));
        before - self.unacked.len()
    }

    /// Drops the unacknowledged final shares older than [`UNACKED_FINAL_MAX_AGE_MS`] at
    /// `now`; returns how many.
    fn expire_unacked(&mut self, now: f64) -> usize {
        let now_ms = UnixMs::from_secs_f64(now).ms();
        let before = self.unacked.len();
        self.unacked.retain(|u| {
            let keep = now_ms.saturating_sub(u.ended_unix_ms) < UNACKED_FINAL_MAX_AGE_MS;
            if !keep {
                tracing::warn!(
                    job_id = %u.share.job_id,
                    max_age_h = UNACKED_FINAL_MAX_AGE_MS / 3_600_000,
                    "a final share was never acknowledged by the controller; dropped (the usage log has it)"
                );
            }
            keep
        });
        before - self.unacked.len()
    }

    /// What the agent keeps across a restart (see [`crate::saved`]): its GPUs' saved
    /// defaults, its jobs with their curves and accounting, the lease with its expiry on
    /// the wall clock, and the final shares not yet acknowledged.
    fn saved_state(&self) -> PersistedState {
        PersistedState {
            node: self.settings.node.clone(),
            saved_defaults: self
                .gpus
                .iter()
                .map(|g| (g.identity.uuid.clone(), g.saved_default))
                .collect(),
            jobs: self
                .jobs
                .values()
                .map(|j| PersistedJob {
                    job_id: j.id.clone(),
                    uid: j.uid,
                    flex: j.request.to_string(),
                    gpus: j
                        .gpus
                        .iter()
                        .map(|&g| self.gpus[g as usize].identity.uuid.clone())
                        .collect(),
                    steps: j.steps.iter().cloned().collect(),
                    pfi: j.calibration.pfi().or(j.restored_pfi),
                    points: j.curve_points(),
                    from_stepd: j.cluster.is_some(),
                    cluster: j.cluster.clone().flatten(),
                    usage: Some(j.usage.clone()),
                })
                .collect(),
            lease: self.lease.as_ref().map(|l| PersistedLease {
                caps: l.caps.clone(),
                expires_unix_s: l.expires_at,
                start_cap_w: l.start_cap.map(|w| w.0),
            }),
            unacked_finals: self.unacked.clone(),
            controller_epoch: self.accepted_epoch,
        }
    }

    /// After a restart: the previous run's jobs that still run (`live`: the jobs whose
    /// step daemons the host shows, by id and cluster) are managed again with their
    /// curves and accounting (no second walk); a job that ended while the agent was down
    /// gets its final share from its saved hold and the counters read at
    /// `first_read_at` (a GPU in `busy` now runs another job's processes and is not
    /// charged to it), and its GPUs go back to their defaults at the first tick.
    fn restore_saved_jobs(
        &mut self,
        now: f64,
        first_read_at: f64,
        jobs: Vec<PersistedJob>,
        live: &BTreeSet<JobKey>,
        busy: &BTreeSet<String>,
    ) {
        for job in jobs {
            // A job registered by a step daemon is told apart from other clusters' jobs
            // of the same id by that daemon's cluster; an older file's job by its id.
            let running = live.iter().any(|(id, cluster)| {
                id == &job.job_id && (!job.from_stepd || cluster == &job.cluster)
            });
            if !running {
                tracing::info!(job_id = %job.job_id, "job from the previous run has ended; its GPUs return to default");
                if let Some(usage) = job.usage.clone() {
                    let share = self.ended_while_down(
                        first_read_at,
                        &job.job_id,
                        job.uid,
                        &job.flex,
                        &job.points,
                        job.pfi,
                        usage,
                        busy,
                    );
                    tracing::info!(job_id = %job.job_id, energy_j = share.energy_mj as f64 / 1000.0, "final share of a job that ended while the agent was down");
                }
                continue;
            }
            let steps = if job.steps.is_empty() {
                vec!["0".to_string()]
            } else {
                job.steps.clone()
            };
            let node = self.settings.node.clone();
            for step in steps {
                if let Err(e) = self.register(
                    now,
                    &job.job_id,
                    &step,
                    job.uid,
                    &node,
                    &job.gpus,
                    &job.flex,
                ) {
                    tracing::warn!(job_id = %job.job_id, error = %e, "cannot restore job");
                }
            }
            if let Some(j) = self.jobs.get_mut(&job.job_id) {
                j.restored_pfi = job.pfi;
                j.restored_points = job.points.clone();
                if job.from_stepd {
                    j.cluster = Some(job.cluster.clone());
                }
                // The curve survives the restart: no second walk, no point of one
                // replacing it.
                j.calibration.restore(&job.points);
                // So does its accounting: the counters ran on, and the next readings
                // charge the restart's gap to the job.
                if let Some(mut usage) = job.usage.clone() {
                    usage.resumed();
                    j.usage = usage;
                }
                tracing::info!(job_id = %job.job_id, "job from the previous run is still running; managing it again");
            }
        }
    }

    /// A job of the previous run (from the state file) that ended while the agent was
    /// down: its final share from its persisted hold and a fresh reading of each of its
    /// GPUs' counters (the readings at start, taken at agent time `read_at`). A GPU that
    /// now runs another job's processes (`busy`, by UUID) is not read again: the job is
    /// charged up to its last persisted reading there, never another job's energy.
    #[allow(clippy::too_many_arguments)]
    fn ended_while_down(
        &mut self,
        read_at: f64,
        job_id: &str,
        uid: u32,
        flex: &str,
        points: &[[f64; 3]],
        pfi: Option<f64>,
        mut usage: JobUsage,
        busy: &BTreeSet<String>,
    ) -> NodeUsage {
        usage.resumed();
        let at_ms = UnixMs::from_secs_f64(read_at).ms();
        let holds: Vec<(String, bool)> = usage
            .gpus
            .iter()
            .map(|(uuid, h)| (uuid.clone(), h.released))
            .collect();
        for (uuid, released) in holds {
            if released || busy.contains(&uuid) {
                continue;
            }
            let Some(slot) = self.gpus.iter().find(|g| g.identity.uuid == uuid) else {
                continue;
            };
            if let Some(sample) = slot.last {
                usage.gpu_reading(
                    &uuid,
                    slot.identity.index,
                    at_ms,
                    sample.energy_mj,
                    sample.power,
                );
            }
        }
        let request = if flex.trim().is_empty() {
            None
        } else {
            parse_power_flex(flex, &self.settings.tiers).ok()
        };
        let curve = CapCurve::from_points(
            &points
                .iter()
                .map(|p| powerflex_core::curve::OperatingPoint {
                    cap_w: Watts(p[0]),
                    power_w: Watts(p[1]),
                    throughput: p[2],
                })
                .collect::<Vec<_>>(),
        )
        .ok();
        let simulated = usage.gpus.keys().any(|u| {
            self.gpus
                .iter()
                .any(|g| &g.identity.uuid == u && g.identity.simulated)
        });
        let share = usage.share(
            job_id,
            &self.settings.node,
            uid,
            flex,
            curve.as_ref(),
            request
                .as_ref()
                .and_then(|r| r.service.max_slowdown())
                .map(|b| 100.0 * b.0),
            pfi,
            None,
            true,
            simulated,
        );
        self.keep_final(read_at, share.clone());
        share
    }

    /// Drops jobs left without GPUs (another job took them all), ending each.
    fn finish_jobs_without_gpus(&mut self, keep: Option<&str>, now: f64) {
        let empty: Vec<String> = self
            .jobs
            .values()
            .filter(|j| j.gpus.is_empty() && Some(j.id.as_str()) != keep)
            .map(|j| j.id.clone())
            .collect();
        for id in empty {
            self.finish_job(&id, now);
        }
    }

    /// The final shares of jobs ended since the last call, to append to the node's
    /// usage log.
    fn take_records(&mut self) -> Vec<NodeUsage> {
        std::mem::take(&mut self.pending_records)
    }

    /// The final shares the controller has not acknowledged, oldest first.
    fn unacked_finals(&self) -> Vec<NodeUsage> {
        self.unacked.iter().map(|u| u.share.clone()).collect()
    }

    /// The slot of the GPU a registration names, by index or UUID.
    fn slot_of(&self, gpu: &GpuRef) -> Option<usize> {
        self.gpus.iter().position(|g| match gpu {
            GpuRef::Index(i) => g.identity.index == *i,
            GpuRef::Uuid(u) => &g.identity.uuid == u,
        })
    }

    fn controller_mode(&self) -> bool {
        self.settings.node_budget.is_none()
    }

    /// Registers a job step. Every step of a job registers; the first creates the job.
    #[allow(clippy::too_many_arguments)]
    fn register(
        &mut self,
        now: f64,
        job_id: &str,
        step_id: &str,
        uid: u32,
        node: &str,
        gpus: &[String],
        flex: &str,
    ) -> Result<Registered, String> {
        if node != self.settings.node {
            return Err(format!(
                "this agent serves node {}, not {node}; check the plugin's socket= argument",
                self.settings.node
            ));
        }
        let request = if flex.trim().is_empty() {
            FlexRequest {
                service: self.settings.default_service.clone(),
                calibrate: Calibrate::Auto,
                preempt: None,
            }
        } else {
            parse_power_flex(flex, &self.settings.tiers).map_err(|e| e.to_string())?
        };
        let refs = parse_gpu_list(&gpus.join(",")).map_err(|e| e.to_string())?;
        let mut indices = Vec::new();
        for r in &refs {
            match self.slot_of(r) {
                Some(i) => indices.push(i as u32),
                None => return Err(format!("no GPU {r} on node {}", self.settings.node)),
            }
        }
        // Slurm gives a GPU to one job at a time: a step naming a GPU of a job that is
        // still running names GPUs Slurm did not give it. Checked before anything is
        // recorded, so a refused step changes nothing.
        for &g in &indices {
            let slot = &self.gpus[g as usize];
            let running_owner = slot
                .job
                .as_ref()
                .filter(|o| o.as_str() != job_id)
                .and_then(|o| self.jobs.get(o))
                .filter(|o| {
                    o.seen_alive_at
                        .is_some_and(|t| now - t < self.settings.job_end_grace_s)
                });
            if let Some(owner) = running_owner {
                return Err(format!(
                    "GPU {} belongs to running job {}; a step may register only the GPUs Slurm gave it",
                    slot.identity.index, owner.id
                ));
            }
        }
        let tier = request.to_string();
        let managed = request.service.is_managed();
        let settings = self.settings.calibration.clone();
        let bound = request.service.max_slowdown().map(|b| b.0);
        let calibrate = request.calibrate == Calibrate::Auto;
        // A job taken back after a lost state file runs under the site's most flexible
        // tier (`persist::adoption_tier`); its next step's registration, from slurmstepd,
        // carries the tier it was submitted with, and that one holds from then on.
        if let Some(job) = self.jobs.get_mut(job_id) {
            let only_adopted = job.steps.len() == 1 && job.steps.contains(ADOPTED_STEP);
            if only_adopted && job.request != request {
                job.request = request.clone();
                job.calibration =
                    Calibration::new(settings.clone(), bound, calibrate && managed, now);
            }
        }
        let job = self.jobs.entry(job_id.to_string()).or_insert_with(|| Job {
            id: job_id.to_string(),
            uid,
            request: request.clone(),
            gpus: Vec::new(),
            steps: BTreeSet::new(),
            log: ProgressLog::default(),
            calibration: Calibration::new(settings, bound, calibrate && managed, now),
            granted: None,
            registered_at: now,
            prior: None,
            restored_pfi: None,
            restored_points: Vec::new(),
            counts_tokens: None,
            seen_alive_at: None,
            cluster: None,
            warmup_logged_at: None,
            usage: JobUsage::default(),
        });
        job.steps.insert(step_id.to_string());
        for i in indices {
            if !job.gpus.contains(&i) {
                job.gpus.push(i);
            }
        }
        let job_gpus = job.gpus.clone();
        for &g in &job_gpus {
            let slot = &mut self.gpus[g as usize];
            if let Some(other) = slot.job.as_ref().filter(|o| o.as_str() != job_id) {
                // Slurm gives a GPU to one job at a time: the other job's end was missed.
                // Its hold of the GPU ends here, so the counter's advance from now is
                // this job's only.
                let other = other.clone();
                let uuid = slot.identity.uuid.clone();
                if let Some(o) = self.jobs.get_mut(&other) {
                    o.gpus.retain(|x| *x != g);
                    o.usage.release_gpu(&uuid);
                }
            }
            self.gpus[g as usize].job = Some(job_id.to_string());
        }
        self.finish_jobs_without_gpus(Some(job_id), now);
        Ok(Registered {
            tier,
            progress: managed.then(|| self.settings.progress_address.clone()),
        })
    }

    /// A step ended. The job keeps its GPUs (other steps) until it ends. When the step is
    /// the batch script, Slurm completes the job (slurmstepd's `batch_finish` reports the
    /// script's end and slurmctld then stops the job's steps on every node): the job's
    /// final share here is made now and returned — the figures of the line at the end of
    /// the job's output, equal to the share the controller records. Its GPUs keep their
    /// caps until the job's end (the extern step's, or its step daemons gone): a step still
    /// running while Slurm stops it (a trapped SIGTERM, up to `KillWait`) draws no more
    /// than its cap.
    fn end_step(
        &mut self,
        job_id: &str,
        step_id: &str,
        now: f64,
    ) -> Result<Option<NodeUsage>, String> {
        // The share stays among the unacknowledged ones until the controller has its
        // record: a cancel's race (extern step first) is a second or so, well inside.
        let ended_here = |agent: &Agent| {
            agent
                .unacked
                .iter()
                .rev()
                .find(|u| u.share.job_id == job_id)
                .map(|u| u.share.clone())
        };
        let Some(job) = self.jobs.get_mut(job_id) else {
            // A cancelled job's steps end together: the extern step's end (or the scan
            // of step daemons) may have ended the job a moment before its batch step's
            // end arrives. Its final share is the same either way.
            if step_id == BATCH_STEP_NAME {
                if let Some(share) = ended_here(self) {
                    return Ok(Some(share));
                }
            }
            return Err(format!("no job {job_id} on this node"));
        };
        job.steps.remove(step_id);
        if step_id != BATCH_STEP_NAME {
            return Ok(None);
        }
        self.close_share(job_id, now);
        Ok(ended_here(self))
    }

    /// Makes the job's final share here (once), keeping the job and its caps.
    fn close_share(&mut self, job_id: &str, now: f64) {
        let Some(job) = self.jobs.get(job_id).filter(|j| !j.usage.closed) else {
            return;
        };
        let share = self.share(job, true);
        if let Some(job) = self.jobs.get_mut(job_id) {
            job.usage.closed = true;
        }
        self.keep_final(now, share);
    }

    /// The job ended: its GPUs return to their defaults on the next tick. Ending an
    /// unknown job is not an error (every epilog calls it, calibrated or not).
    fn end_job(&mut self, job_id: &str, now: f64) -> bool {
        self.finish_job(job_id, now)
    }

    /// The cluster of the step daemon that registered `job_id` (see [`Job::cluster`]),
    /// seen at `now`: a registration from a live step daemon is a sighting of the job, so
    /// a job that ends before the next scan of the host's processes is still ended by it.
    fn set_job_cluster(&mut self, job_id: &str, cluster: Option<String>, now: f64) {
        if let Some(job) = self.jobs.get_mut(job_id) {
            job.cluster = Some(cluster);
            job.seen_alive_at = Some(now);
        }
    }

    /// The jobs with step daemons on this host now (from the agent's `/proc` reader). A job seen
    /// alive before whose daemons have all been gone for `job_end_grace_s` has ended
    /// without its epilog reaching the agent (a busy agent, a failed connect, an empty
    /// `SLURMD_NODENAME`): it is ended here, and its GPUs go back to their defaults at the
    /// next tick. A job never seen alive (registered from elsewhere, or before the first
    /// scan) is left to its epilog. Returns the jobs ended.
    fn jobs_alive(&mut self, now: f64, alive: &BTreeSet<JobKey>) -> Vec<String> {
        let grace = self.settings.job_end_grace_s;
        let mut gone = Vec::new();
        for job in self.jobs.values_mut() {
            let Some(cluster) = &job.cluster else {
                continue;
            };
            if alive.contains(&(job.id.clone(), cluster.clone())) {
                job.seen_alive_at = Some(now);
            } else if job.seen_alive_at.is_some_and(|t| now - t >= grace) {
                gone.push(job.id.clone());
            }
        }
        for id in &gone {
            self.end_job(id, now);
        }
        gone
    }

    /// Whether another job of a known cluster holds one of `gpus` here: only then can a
    /// registration find a job whose end was lost ([`Agent::hand_over_from_ended_jobs`]).
    fn gpus_held_by_others(&self, job_id: &str, gpus: &[String]) -> bool {
        let Ok(refs) = parse_gpu_list(&gpus.join(",")) else {
            return false;
        };
        refs.iter().any(|r| {
            self.slot_of(r)
                .and_then(|i| self.gpus[i].job.as_ref())
                .filter(|holder| holder.as_str() != job_id)
                .and_then(|holder| self.jobs.get(holder))
                .is_some_and(|j| j.cluster.is_some())
        })
    }

    /// Before a step of `job_id`, registered by a live root `slurmstepd`, claims `gpus`:
    /// a job that holds one of them but has no step daemon left on the host (`alive`,
    /// read just now) has ended, its end lost (no `PrologFlags=Contain`, a missed
    /// epilog). Slurm gave its GPUs to the new job, so it is ended now rather than after
    /// `job_end_grace_s`, and the new job is not refused as "belongs to running job A"
    /// (then run unmanaged, and uncapped once A was ended). A holder of unknown cluster
    /// (registered by something other than a step daemon) is left alone. Returns the jobs
    /// ended.
    fn hand_over_from_ended_jobs(
        &mut self,
        now: f64,
        job_id: &str,
        gpus: &[String],
        alive: &BTreeSet<JobKey>,
    ) -> Vec<String> {
        let Ok(refs) = parse_gpu_list(&gpus.join(",")) else {
            return Vec::new();
        };
        let mut ended = Vec::new();
        for r in &refs {
            let Some(slot) = self.slot_of(r).map(|i| &self.gpus[i]) else {
                continue;
            };
            let Some(holder) = slot.job.as_ref().filter(|h| h.as_str() != job_id) else {
                continue;
            };
            let Some(cluster) = self.jobs.get(holder).and_then(|j| j.cluster.clone()) else {
                continue;
            };
            if !alive.contains(&(holder.clone(), cluster)) && !ended.contains(holder) {
                ended.push(holder.clone());
            }
        }
        for id in &ended {
            self.end_job(id, now);
        }
        ended
    }

    /// The processes NVML lists on each GPU now, with the job each belongs to (from
    /// the agent's `/proc` reader; `None` for a process in no job). A GPU missing from `listed`
    /// (NVML could not list it) shows none rather than an old list.
    ///
    /// A GPU no registered job holds, with processes on it, is in unregistered use (a job
    /// whose registration failed, a process outside Slurm, a job's process on a GPU it
    /// did not register): with `agent.unregistered_gpu_use = "failsafe"` the next tick
    /// holds it at the fail-safe cap until NVML lists none. A GPU NVML could not list
    /// counts as unused: a listing that keeps failing (a driver that stopped supporting
    /// it) must not strand the cap.
    fn nvml_processes_seen(
        &mut self,
        now: f64,
        listed: &BTreeMap<u32, Vec<(u32, Option<String>)>>,
    ) {
        let failsafe = self.settings.failsafe_cap;
        let capping = self.settings.unregistered_gpu_use == UnregisteredGpuUse::Failsafe;
        for (gpu, slot) in self.gpus.iter_mut().enumerate() {
            let processes = listed.get(&(gpu as u32)).cloned().unwrap_or_default();
            slot.nvml_processes = processes.clone();
            let unregistered = slot.job.is_none() && !processes.is_empty();
            match (slot.unregistered_since, unregistered) {
                (None, true) => {
                    slot.unregistered_since = Some(now);
                    tracing::warn!(
                        gpu,
                        pids = ?processes.iter().map(|p| p.0).collect::<Vec<_>>(),
                        jobs = ?processes.iter().filter_map(|p| p.1.clone()).collect::<Vec<_>>(),
                        cap_w = if capping { failsafe.0 } else { slot.saved_default.0 },
                        "processes use a GPU no registered job holds"
                    );
                }
                (Some(since), false) => {
                    slot.unregistered_since = None;
                    tracing::info!(
                        gpu,
                        lasted_s = now - since,
                        "the GPU's unregistered use ended"
                    );
                }
                _ => {}
            }
        }
    }

    /// What NVML says uses each GPU, as jobs (from the agent's `/proc` reader: the job each running
    /// process belongs to; processes in no job are left out). A GPU registered to a job
    /// none of whose processes use it, while another job's do, was claimed with words
    /// (e.g. GPU variables the user exported in a step Slurm gave no GPUs): the claim is
    /// refused, the GPU leaves that job and returns to its default at the next tick.
    /// Returns the refusals, to log and count.
    fn check_gpu_use(
        &mut self,
        now: f64,
        used_by: &BTreeMap<u32, BTreeSet<JobKey>>,
    ) -> Vec<GpuClaimRefused> {
        let mut refused = Vec::new();
        for (&gpu, users) in used_by {
            let Some(slot) = self.gpus.get_mut(gpu as usize) else {
                continue;
            };
            let Some(claimant) = slot.job.clone() else {
                continue;
            };
            // A claimant of unknown cluster cannot be compared with what runs.
            let Some(cluster) = self.jobs.get(&claimant).and_then(|j| j.cluster.clone()) else {
                continue;
            };
            if users.is_empty() || users.contains(&(claimant.clone(), cluster)) {
                continue;
            }
            slot.job = None;
            let uuid = slot.identity.uuid.clone();
            if let Some(job) = self.jobs.get_mut(&claimant) {
                job.gpus.retain(|g| *g != gpu);
                // Its hold ends with the claim: were the GPU given back later, the span
                // in between (another job's) is not charged to it.
                job.usage.release_gpu(&uuid);
            }
            refused.push(GpuClaimRefused {
                gpu,
                claimed_by: claimant,
                used_by: users.iter().map(|(job, _)| job.clone()).collect(),
            });
        }
        self.finish_jobs_without_gpus(None, now);
        self.gpu_claims_refused += refused.len() as u64;
        refused
    }

    /// A progress report as it came off the progress socket: accepted when `sender` may
    /// report for the job it names (its owner or root, from a step of the same Slurm
    /// cluster as the job's step daemons), then recorded (see [`Self::progress`]). A
    /// refusal is counted, and its reason goes back to the sender.
    fn report_progress(
        &mut self,
        now: f64,
        sender: &ReportSender,
        report: &ProgressReport,
    ) -> Result<(), String> {
        let outcome = match self.jobs.get(&report.job_id) {
            None => Err(format!("no job {} on this node", report.job_id)),
            Some(job) if job.uid != sender.uid && sender.uid != 0 => Err(format!(
                "uid {} may not report for job {} (owned by uid {})",
                sender.uid, report.job_id, job.uid
            )),
            // Same id, another cluster on this host (the test clusters): not this job.
            Some(Job {
                cluster: Some(cluster),
                ..
            }) if *cluster != sender.cluster => Err(format!(
                "process {} runs in job {} of another Slurm cluster ({}) than this node's job {}",
                sender.pid,
                sender.step_job,
                sender.cluster.as_deref().unwrap_or("the default config"),
                report.job_id
            )),
            Some(_) => self.progress(now, &report.job_id, sender.pid, report.tokens, report.steps),
        };
        if outcome.is_err() {
            self.progress_rejected += 1;
        }
        outcome
    }

    /// A progress line the socket refused before it reached the machine (unreadable,
    /// or from a process in no Slurm step): counted with the refused reports.
    fn progress_refused(&mut self) {
        self.progress_rejected += 1;
    }

    /// A progress report from a verified process of `job_id`; `source` is the sending
    /// process (each reporter's counter is followed on its own, see [`ProgressLog`]).
    fn progress(
        &mut self,
        now: f64,
        job_id: &str,
        source: u32,
        tokens: u64,
        steps: u64,
    ) -> Result<(), String> {
        let job = self
            .jobs
            .get_mut(job_id)
            .ok_or_else(|| format!("no job {job_id} on this node"))?;
        let count = if tokens > 0 {
            tokens as f64
        } else {
            steps as f64
        };
        match job.log.record_from(now, source, count) {
            Recorded::First | Recorded::Forward => {}
            Recorded::NewReporter { reporters } => tracing::info!(
                job_id,
                pid = source,
                reporters,
                "another process reports this job's progress; each reporter's progress counts from its first report"
            ),
            // Rate-limited: a reporter that keeps resetting its counter must not flood
            // the log.
            Recorded::Restarted { from, to }
                if job.log.restarts <= 3 || job.log.restarts.is_power_of_two() =>
            {
                tracing::warn!(
                    job_id,
                    pid = source,
                    from,
                    to,
                    restarts = job.log.restarts,
                    "a reporter's progress count went backwards (its counter restarted); its progress counts again from here"
                )
            }
            Recorded::Restarted { .. } => {}
        }
        job.counts_tokens = Some(tokens > 0);
        Ok(())
    }

    /// Applies a lease from the controller (authenticated and bounded by the link): the
    /// event flag, the walks to repeat, the walks to end before an announced event, the
    /// caps and the jobs that may be probed. Returns what writes the caps now; the edge
    /// writes them and reads the written GPUs back.
    fn apply_lease(&mut self, now: f64, lease: LeaseMessage) -> Vec<Action> {
        self.accepted_epoch = self.accepted_epoch.max(lease.epoch);
        self.event_in_force = lease.event_in_force;
        for job_id in self.recalibrate(now, &lease.recalibrate) {
            tracing::info!(job_id = %job_id, "measurements left the job's curve: calibrating it again");
        }
        if let Some(in_s) = lease.next_event_in_s {
            // Walks end before an announced event (pre-positioning, issue 16).
            self.event_ahead(now, in_s);
        }
        self.set_lease(now, lease.caps, lease.ttl_s, lease.start_cap);
        self.learn = lease.learn.into_iter().collect();
        self.leases_applied += 1;
        self.tick(now)
    }

    /// Whether a lease of `epoch` may be applied: not when a controller of a higher
    /// epoch has steered this node (fencing). Equal epochs pass: the same controller's
    /// next lease, or the single controller's (epoch 0).
    fn check_epoch(&self, epoch: u64) -> Result<(), LeaseRefused> {
        if epoch < self.accepted_epoch {
            Err(LeaseRefused::StaleEpoch {
                lease_epoch: epoch,
                accepted_epoch: self.accepted_epoch,
            })
        } else {
            Ok(())
        }
    }

    /// Installs a lease from the controller, valid for `ttl_s` (never longer than the
    /// site's lease TTL, whatever the message says). `start_cap` is the per-GPU cap for a
    /// managed job the lease does not name. A lease already expired (`ttl_s <= 0`, e.g.
    /// the previous run's after a restart) grants nothing, but its caps still bound the
    /// fail-safe: it never raises a job above its last grant.
    fn set_lease(
        &mut self,
        now: f64,
        caps: BTreeMap<String, Watts>,
        ttl_s: f64,
        start_cap: Option<Watts>,
    ) {
        self.install_lease(now, caps, ttl_s, start_cap, true);
    }

    /// The previous run's lease, from the state file: its caps bound the fail-safe and,
    /// while unexpired, grant what they granted, but it is not a current lease: the
    /// limits read back at start still bound every cap until the controller speaks.
    fn restore_saved_lease(
        &mut self,
        now: f64,
        caps: BTreeMap<String, Watts>,
        ttl_s: f64,
        start_cap: Option<Watts>,
    ) {
        self.install_lease(now, caps, ttl_s, start_cap, false);
    }

    fn install_lease(
        &mut self,
        now: f64,
        caps: BTreeMap<String, Watts>,
        ttl_s: f64,
        start_cap: Option<Watts>,
        current: bool,
    ) {
        let ttl = if ttl_s.is_finite() && ttl_s > 0.0 {
            ttl_s.min(self.settings.lease_ttl_s)
        } else {
            0.0
        };
        let valid = |w: &Watts| w.0.is_finite() && w.0 >= 0.0;
        if current && ttl > 0.0 {
            // A current lease decides the caps from now on: the limits read back at
            // start no longer bound them.
            self.awaiting_current_lease = false;
            for slot in &mut self.gpus {
                slot.start_ceiling = None;
            }
        }
        self.lease = Some(Lease {
            caps: caps.into_iter().filter(|(_, w)| valid(w)).collect(),
            expires_at: now + ttl,
            start_cap: start_cap.filter(valid),
        });
    }

    /// The controller announces a grid event starting `in_s` seconds from now: every
    /// job's calibration walk ends before it (see [`Calibration::finish_by`]).
    fn event_ahead(&mut self, now: f64, in_s: f64) {
        if !(in_s.is_finite() && in_s >= 0.0) {
            return;
        }
        for job in self.jobs.values_mut() {
            job.calibration.finish_by(now, now + in_s);
        }
    }

    /// The controller found these jobs' measurements outside their curves: walk each of
    /// them again where its calibration allows (see [`Calibration::rewalk`]). Returns the
    /// jobs whose walk started.
    ///
    /// A walk starts at the job's grant and judges each level's slowdown against its top
    /// level: one started during a cut (the grant below the GPUs' maximum) would take
    /// the grant's speed for the uncapped one and call caps within the tier's bound that
    /// are not (seen in the demo: 54 % slower on the true curve, bound 25 %). So a repeated
    /// walk waits until the job's grant is its GPUs' maximum; the controller asks again
    /// every allocation while the job stays off its curve.
    fn recalibrate(&mut self, now: f64, jobs: &[String]) -> Vec<String> {
        let mut started = Vec::new();
        for id in jobs {
            let Some(job) = self.jobs.get(id) else {
                continue;
            };
            let Some(&first) = job.gpus.first() else {
                continue;
            };
            let max_cap = self.gpus[first as usize].identity.max_cap;
            let uncapped = self
                .granted_cap(now, job)
                .is_none_or(|g| g.0 >= max_cap.0 - 0.5);
            if !uncapped {
                continue;
            }
            if let Some(job) = self.jobs.get_mut(id) {
                if job.calibration.rewalk(now) {
                    started.push(id.clone());
                }
            }
        }
        started
    }

    /// Records a GPU reading (or its failure). The limit read back is what the GPU
    /// enforces from now on, whatever the agent last wrote: when they differ, something
    /// else changed it, and the next tick writes the agent's cap again. That mismatch is
    /// returned (to log) and counted (metrics, status, the controller's report).
    fn sampled(
        &mut self,
        now: f64,
        gpu: u32,
        result: Result<GpuSample, GpuError>,
    ) -> Option<CapMismatch> {
        let at_ms = UnixMs::from_secs_f64(now).ms();
        let slot = self.gpus.get_mut(gpu as usize)?;
        match result {
            Ok(s) => {
                let same_cap = slot.last.is_some_and(|l| (l.cap.0 - s.cap.0).abs() <= 0.5);
                if !same_cap {
                    slot.cap_since = Some(now);
                }
                slot.last = Some(s);
                if let Some(job) = slot.job.as_ref().and_then(|j| self.jobs.get_mut(j)) {
                    job.usage.gpu_reading(
                        &slot.identity.uuid,
                        slot.identity.index,
                        at_ms,
                        s.energy_mj,
                        s.power,
                    );
                }
                if self.awaiting_current_lease && slot.start_ceiling.is_none() {
                    slot.start_ceiling = Some(s.cap);
                }
                let mismatch = slot.mismatch(gpu, s.cap);
                // After a fault, or a change behind the agent's back, the limit on the
                // GPU is what it reads, not what was last written.
                slot.applied = Some(s.cap);
                slot.degraded = None;
                if mismatch.is_some() {
                    self.cap_mismatches += 1;
                }
                mismatch
            }
            Err(e) => {
                slot.last = None;
                slot.cap_since = None;
                if e.class != ErrorClass::Transient {
                    slot.degraded = Some(e.message);
                }
                None
            }
        }
    }

    /// A cap write succeeded; `found` is the limit read just before it (`None` when it
    /// could not be read). A limit other than the last one written or read was changed
    /// behind the agent's back since its last sample: counted and returned like a
    /// sampled one (a new grant written first would otherwise hide it).
    fn cap_written(&mut self, gpu: u32, cap: Watts, found: Option<Watts>) -> Option<CapMismatch> {
        let slot = self.gpus.get_mut(gpu as usize)?;
        let mismatch = found.and_then(|found| slot.mismatch(gpu, found));
        slot.applied = Some(cap);
        if mismatch.is_some() {
            self.cap_mismatches += 1;
        }
        mismatch
    }

    /// A cap write failed: a permanent or lost-device failure degrades that GPU only.
    fn cap_failed(&mut self, e: &GpuError) {
        if let Some(slot) = self.gpus.get_mut(e.index as usize) {
            if e.class != ErrorClass::Transient {
                slot.degraded = Some(e.message.clone());
            }
        }
    }

    /// The limit the job's GPUs read back in the samples that gave [`Self::job_power`], when
    /// they all agree.
    fn job_sampled_cap(&self, job: &Job) -> Option<Watts> {
        let mut caps = job
            .gpus
            .iter()
            .map(|&g| self.gpus[g as usize].last.map(|s| s.cap));
        let first = caps.next()??;
        caps.all(|c| c.is_some_and(|c| (c.0 - first.0).abs() <= 0.5))
            .then_some(first)
    }

    fn job_power(&self, job: &Job) -> Option<Watts> {
        let mut total = 0.0;
        for &g in &job.gpus {
            total += self.gpus[g as usize].last?.power.0;
        }
        Some(Watts(total))
    }

    /// The per-GPU cap the job should run at now (before calibration lowers it).
    fn granted_cap(&self, now: f64, job: &Job) -> Option<Watts> {
        if !job.managed() {
            return None;
        }
        if self.controller_mode() {
            let failsafe = self.settings.failsafe_cap;
            // A job the controller has not granted a cap yet (it started since the last
            // lease) runs at the lease's start cap, never above the fail-safe: the budget
            // was split without it, and uncapped it could carry the site over.
            // When the lease runs out, every job falls to the fail-safe cap, or stays at
            // its last grant when that is lower: the fail-safe never raises a cap (a cut
            // below it must hold while the controller is away).
            return Some(match &self.lease {
                Some(lease) => {
                    let unnamed = lease.start_cap.map_or(failsafe, |s| s.min(failsafe));
                    match lease.caps.get(&job.id).copied() {
                        Some(cap) if now < lease.expires_at => cap,
                        Some(cap) => cap.min(failsafe),
                        None => unnamed,
                    }
                }
                None => failsafe,
            });
        }
        job.granted
    }

    /// Whether the controller's lease has run out (controller mode only).
    fn failsafe_active(&self, now: f64) -> bool {
        self.controller_mode()
            && match &self.lease {
                Some(lease) => now >= lease.expires_at,
                None => now - self.started_at >= self.settings.lease_ttl_s,
            }
    }

    /// One control period: advance calibrations, allocate, and return the cap writes
    /// needed to reach the desired caps.
    fn tick(&mut self, now: f64) -> Vec<Action> {
        let mut changed = false;
        let ids: Vec<String> = self.jobs.keys().cloned().collect();
        for id in &ids {
            let power = self.jobs.get(id).and_then(|j| self.job_power(j));
            let memory_util: Option<f64> = self.jobs.get(id).and_then(|j| {
                let utils: Vec<f64> = j
                    .gpus
                    .iter()
                    .filter_map(|&g| {
                        self.gpus[g as usize]
                            .last
                            .map(|s| f64::from(s.memory_util_pct) / 100.0)
                    })
                    .collect();
                (!utils.is_empty()).then(|| utils.iter().sum::<f64>() / utils.len() as f64)
            });
            // The job's mean SM clock now, when every GPU of it says.
            let sm_clock: Option<f64> = self.jobs.get(id).and_then(|j| {
                let clocks: Option<Vec<f64>> = j
                    .gpus
                    .iter()
                    .map(|&g| {
                        self.gpus[g as usize]
                            .last
                            .map(|s| f64::from(s.sm_clock_mhz))
                            .filter(|&c| c > 0.0)
                    })
                    .collect();
                clocks
                    .filter(|c| !c.is_empty())
                    .map(|c| c.iter().sum::<f64>() / c.len() as f64)
            });
            let (intercept, slope) = (self.settings.prior_intercept, self.settings.prior_slope);
            let held_below = self.jobs.get(id).and_then(|j| {
                match (j.calibration.cap(), self.granted_cap(now, j)) {
                    (Some(level), Some(granted)) if granted.0 < level.0 - 0.5 => Some(granted),
                    _ => None,
                }
            });
            // The cap the job's GPUs read back, and since when it has held on all of them.
            let held = self.jobs.get(id).and_then(|j| {
                let cap = self.job_sampled_cap(j)?;
                let since = j
                    .gpus
                    .iter()
                    .map(|&g| self.gpus[g as usize].cap_since)
                    .try_fold(f64::NEG_INFINITY, |late, s| s.map(|s| late.max(s)))?;
                Some((cap, since))
            });
            let granted = self.jobs.get(id).and_then(|j| self.granted_cap(now, j));
            let probe_floor = self.jobs.get(id).and_then(|j| {
                let first = self.gpus.get(*j.gpus.first()? as usize)?;
                Some(first.identity.min_cap)
            });
            let may_probe = self.controller_mode() && self.learn.contains(id);
            let step = self.settings.cap_step;
            if let Some(job) = self.jobs.get_mut(id) {
                // Before anything below can end the walk (a grant held below its level
                // does), so every end is seen and logged.
                let before = job.calibration.phase.clone();
                if let Some(granted) = held_below {
                    job.calibration.held_below_level(now, granted);
                }
                job.calibration
                    .observe_operation(now, &job.log, power, held);
                job.calibration.check_probe(now, granted);
                if let (true, Some(granted), Some(floor)) = (may_probe, granted, probe_floor) {
                    job.calibration.consider_probe(now, granted, step, floor);
                }
                if let Some(mhz) = sm_clock {
                    job.calibration.observe_clock(now, mhz);
                }
                // Each window the walk reads is logged: a curve that came out wrong (a
                // rate far off, a flat top) can then be traced to the window that made it.
                if let Some(window) = job.calibration.tick(now, &job.log, power) {
                    tracing::info!(
                        job_id = %job.id,
                        cap_w = window.cap.0,
                        power_w = window.power.0,
                        throughput = window.throughput,
                        relative_noise = window.relative_noise,
                        "calibration window read"
                    );
                }
                if job.calibration.phase != before {
                    changed = true;
                    match &job.calibration.phase {
                        Phase::Done => tracing::info!(
                            job_id = %job.id,
                            levels = job.calibration.levels().len(),
                            pfi = job.calibration.pfi(),
                            "calibration walk done"
                        ),
                        Phase::Skipped(why) => tracing::info!(
                            job_id = %job.id,
                            why = why.as_str(),
                            "calibration walk skipped"
                        ),
                        Phase::NoSignal => tracing::info!(
                            job_id = %job.id,
                            waited_s = now - job.calibration.registered_at,
                            "no progress report yet: planned on the telemetry prior until the job reports"
                        ),
                        Phase::Warmup if before == Phase::NoSignal => {
                            // Planned as every job that reports is until its walk ends
                            // (the site's prior), not on a telemetry reading frozen now.
                            job.prior = None;
                            tracing::info!(
                                job_id = %job.id,
                                waited_s = now - job.calibration.registered_at,
                                "the job's first progress report came: calibrating it"
                            )
                        }
                        Phase::Walking { .. } | Phase::Warmup => {}
                    }
                }
                // A warm-up that lasts says why, now and then: one that never ended
                // (issue: the demo's job 3) left nothing in the log to tell why.
                // Counted from the first report when it came late (after NoSignal), so
                // a job that just began reporting is not logged as long in warm-up.
                let warming_since = job
                    .log
                    .first_time()
                    .map_or(job.calibration.registered_at, |t| {
                        t.max(job.calibration.registered_at)
                    });
                if job.calibration.phase == Phase::Warmup
                    && now - warming_since >= WARMUP_LOG_AFTER_S
                    && job
                        .warmup_logged_at
                        .is_none_or(|t| now - t >= WARMUP_LOG_EVERY_S)
                {
                    job.warmup_logged_at = Some(now);
                    tracing::info!(
                        job_id = %job.id,
                        waited_s = now - warming_since,
                        reporters = job.log.reporters(now, 10.0),
                        counter_restarts = job.log.restarts,
                        why = job.calibration.waiting.as_deref().unwrap_or("-"),
                        "calibration still warming up"
                    );
                }
                // No progress signal: the paper's telemetry predictor as a prior. NVML has
                // no DRAM-active counter, so its memory utilisation (the memory-copy
                // share) stands in for both factors of the DRAM copy product.
                if job.calibration.on_telemetry_prior() {
                    if let Some(u) = memory_util {
                        let dcp = u * u;
                        job.prior = Some((dcp, intercept + slope * dcp));
                    }
                }
            }
        }
        self.observe_usage(now);
        if let Some(budget) = self.settings.node_budget {
            self.allocate_node_budget(budget);
        }
        let mut actions = Vec::new();
        let failsafe_now = self.failsafe_active(now);
        for gpu in 0..self.gpus.len() {
            let slot = &self.gpus[gpu];
            if slot.degraded.is_some() {
                continue;
            }
            let job = slot.job.as_ref().and_then(|j| self.jobs.get(j));
            let desired = match job {
                None if slot.unregistered_since.is_some()
                    && self.settings.unregistered_gpu_use == UnregisteredGpuUse::Failsafe =>
                {
                    Watts(slot.saved_default.0.min(self.settings.failsafe_cap.0))
                }
                None => slot.saved_default,
                Some(job) if !job.managed() => slot.saved_default,
                Some(job) => {
                    let granted = self.granted_cap(now, job).unwrap_or(slot.identity.max_cap);
                    match job.calibration.cap() {
                        Some(level) => granted.min(level),
                        None => granted,
                    }
                }
            };
            // Until a current lease arrives, no GPU rises above what it read back at start:
            // the previous run's cap holds through a restart, for the jobs this agent
            // manages and for any it could not take back (a lost or stale state file).
            // A GPU of no managed job is released once the lease would have run out
            // anyway (the fail-safe regime, where idle GPUs are at their default); a
            // managed job's GPU only by a current lease.
            let managed = job.is_some_and(|j| j.managed());
            let held = self.awaiting_current_lease && (managed || !failsafe_now);
            let desired = match slot.start_ceiling {
                Some(ceiling) if held => Watts(desired.0.min(ceiling.0)),
                // Its limit was never read (a transient error at start): a managed job's
                // GPU gets no more than the fail-safe (a write that can only lower what
                // the budget counted); any other GPU is not written until it is read.
                None if held && managed => Watts(desired.0.min(self.settings.failsafe_cap.0)),
                None if held => continue,
                _ => desired,
            };
            let desired = clamp(desired, &slot.identity);
            if !self.settings.enforce {
                // Observe mode: what would be written is shown, never written.
                self.gpus[gpu].would_cap = Some(desired);
                continue;
            }
            if slot.applied.is_none_or(|a| (a.0 - desired.0).abs() > 0.5) {
                actions.push(Action::SetCap {
                    gpu: gpu as u32,
                    cap: desired,
                });
            }
        }
        // Final shares the controller never acknowledged go after a day (the state
        // file then drops them too).
        changed |= self.expire_unacked(now) > 0;
        if changed {
            actions.push(Action::Persist);
        }
        actions
    }

    /// One observation of every job for its accounting (see [`crate::usage`]).
    fn observe_usage(&mut self, now: f64) {
        let at_unix_ms = UnixMs::from_secs_f64(now).ms();
        let max_gap_ms = crate::usage::max_observation_gap_ms(self.sample_interval_ms);
        let ids: Vec<String> = self.jobs.keys().cloned().collect();
        for id in ids {
            let Some(job) = self.jobs.get(&id) else {
                continue;
            };
            let samples: Vec<(&GpuSlot, Option<GpuSample>)> = job
                .gpus
                .iter()
                .map(|&g| (&self.gpus[g as usize], self.gpus[g as usize].last))
                .collect();
            let capped = samples
                .iter()
                .any(|(slot, s)| s.is_some_and(|s| s.cap.0 < slot.saved_default.0 - 0.5));
            let power_throttled = samples
                .iter()
                .map(|(_, s)| s.and_then(|s| s.power_throttled))
                .collect::<Option<Vec<bool>>>()
                .filter(|v| !v.is_empty())
                .map(|v| v.iter().any(|t| *t));
            let observation = Observation {
                at_unix_ms,
                power_w: self.job_power(job).map(|w| w.0),
                cap_w: self.job_sampled_cap(job).map(|w| w.0),
                capped,
                in_event: self.event_in_force,
                power_throttled,
            };
            let work = job.log.last().map_or(0.0, |(_, w)| w);
            if let Some(job) = self.jobs.get_mut(&id) {
                job.usage.observe(observation, max_gap_ms);
                job.usage.work_reported(work);
            }
        }
    }

    /// Cap writes for a stop (fail-static): every healthy GPU without a managed job goes
    /// back to its saved default; the GPUs of running managed jobs keep the cap in force,
    /// so a `systemctl restart` or an upgrade during a cut never over-draws the site (as a
    /// BMC keeps its last limit through an outage). The next agent takes them over from
    /// the state file and the limits it reads back. With `release_jobs` (decommissioning:
    /// `powerflexd --release-on-exit`), every GPU goes back to its default.
    fn stop_actions(&self, release_jobs: bool) -> Vec<Action> {
        if !self.settings.enforce {
            return Vec::new();
        }
        self.gpus
            .iter()
            .filter(|g| g.degraded.is_none())
            .filter(|g| {
                release_jobs
                    || !g
                        .job
                        .as_ref()
                        .and_then(|j| self.jobs.get(j))
                        .is_some_and(Job::managed)
            })
            .map(|g| Action::SetCap {
                gpu: g.identity.index,
                cap: clamp(g.saved_default, &g.identity),
            })
            .collect()
    }

    /// The status snapshot (also the metrics' source).
    fn snapshot(&self, now: f64) -> Snapshot {
        Snapshot {
            node: self.settings.node.clone(),
            mode: if self.controller_mode() {
                AgentMode::Controller
            } else {
                AgentMode::Standalone
            },
            failsafe: self.failsafe_active(now),
            degraded: self.gpus.iter().any(|g| g.degraded.is_some()),
            progress_rejected: self.progress_rejected,
            config_error: self.config_error.clone(),
            cap_mismatches: self.cap_mismatches,
            leases_applied: self.leases_applied,
            controller_epoch: self.accepted_epoch,
            leases_refused_epoch: self.leases_refused_epoch,
            gpu_claims_refused: self.gpu_claims_refused,
            enforce: self.settings.enforce,
            ended: self.unacked_finals(),
            gpus: self
                .gpus
                .iter()
                .map(|g| GpuView {
                    index: g.identity.index,
                    uuid: g.identity.uuid.clone(),
                    name: g.identity.name.clone(),
                    default_w: g.saved_default.0,
                    cap_w: g.applied.map(|w| w.0),
                    power_w: g.last.map(|s| s.power.0),
                    energy_j: g
                        .last
                        .and_then(|s| s.energy_mj)
                        .map(|mj| mj as f64 / 1000.0),
                    job: g.job.clone(),
                    degraded: g.degraded.clone(),
                    would_cap_w: g.would_cap.map(|w| w.0),
                    min_w: Some(g.identity.min_cap.0),
                    max_w: Some(g.identity.max_cap.0),
                    power_throttled: g.last.and_then(|s| s.power_throttled),
                    processes: g
                        .nvml_processes
                        .iter()
                        .map(|(pid, job)| GpuProcess {
                            pid: *pid,
                            job: job.clone(),
                        })
                        .collect(),
                    unregistered_use: g.unregistered_since.is_some(),
                })
                .collect(),
            jobs: self
                .jobs
                .values()
                .map(|j| {
                    let cal = &j.calibration;
                    // Estimated once: the curve shown, its points and the accounting's
                    // all read it.
                    let best = cal.best_curve();
                    let curve = j.curve_of(best.as_ref());
                    let (state, reason) = match &cal.phase {
                        Phase::Warmup => (CalibrationState::Warmup, cal.waiting.clone()),
                        Phase::Walking { .. } => (CalibrationState::Walking, None),
                        Phase::Done => (CalibrationState::Done, None),
                        Phase::Skipped(why) => (CalibrationState::Skipped, Some(why.clone())),
                        // Not walked until it reports; status shows it as skipped, with
                        // the reason saying a report starts it.
                        Phase::NoSignal => (CalibrationState::Skipped, cal.waiting.clone()),
                    };
                    let rate = match j.log.last() {
                        Some((t, _)) if now - t < 30.0 => j.log.rate(now - 10.0, now).map(|r| r.0),
                        _ => None,
                    };
                    JobView {
                        job: j.id.clone(),
                        uid: j.uid,
                        tier: j.request.to_string(),
                        gpus: j
                            .gpus
                            .iter()
                            .map(|&g| self.gpus[g as usize].identity.index)
                            .collect(),
                        steps: j.steps.iter().cloned().collect(),
                        cap_w: j
                            .gpus
                            .first()
                            .and_then(|&g| self.gpus[g as usize].applied.map(|w| w.0)),
                        granted_w: self.granted_cap(now, j).map(|w| w.0),
                        calibration: state,
                        calibration_note: reason,
                        calibration_level_w: cal.cap().map(|w| w.0),
                        calibration_s: cal.duration_s(),
                        calibration_cost: cal.cost,
                        calibration_cost_pct: cal.cost_fraction().map(|f| 100.0 * f),
                        points: j.points_of(&curve),
                        curve,
                        learned_windows: cal.windows.iter().filter(|w| w.learned).count() as u32,
                        pfi: cal.pfi().or(j.restored_pfi),
                        pfi_source: if cal.pfi().is_some() || j.restored_pfi.is_some() {
                            Some(PfiSource::Measured)
                        } else if j.prior.is_some() {
                            Some(PfiSource::Prior)
                        } else {
                            None
                        },
                        prior_pfi: j.prior.map(|p| p.1),
                        throughput: rate,
                        throughput_unit: j.counts_tokens.map(|tokens| {
                            if tokens {
                                ThroughputUnit::Tokens
                            } else {
                                ThroughputUnit::Steps
                            }
                        }),
                        power_w: self.job_power(j).map(|w| w.0),
                        power_cap_w: self.job_sampled_cap(j).map(|w| w.0),
                        // A probe holds the job below its grant: its draw and speed
                        // there are not a drift from its curve at the grant.
                        calibrating: cal.is_active() || cal.probing(),
                        curve_implausible: cal.implausible.clone(),
                        power_cap_steady_s: j
                            .gpus
                            .iter()
                            .map(|&g| self.gpus[g as usize].cap_since.map(|t| now - t))
                            .try_fold(f64::INFINITY, |low, s| s.map(|s| low.min(s)))
                            .filter(|s| s.is_finite()),
                        usage: Some(self.share_on(j, best, false)),
                    }
                })
                .collect(),
        }
    }
}

fn clamp(cap: Watts, identity: &GpuIdentity) -> Watts {
    Watts(cap.0.clamp(identity.min_cap.0, identity.max_cap.0))
}

/// What `status` and the metrics show: the wire types, so the control socket sends what
/// the loop built and clients read it back typed.
pub use powerflex_proto::status::{
    AgentGpuStatus as GpuView, AgentJobStatus as JobView, AgentStatus as Snapshot, GpuProcess,
};

/// The status `uid` may see (need-to-know): root sees everything; anyone else sees
/// the node's GPUs and counters, and of the jobs only their own (another user's job
/// ids, tiers and throughput are not theirs to know; the GPU rows keep the power a
/// GPU draws but not whose job runs on it, nor the processes NVML lists on it outside
/// their own jobs).
pub fn seen_by(status: &Snapshot, uid: u32) -> Snapshot {
    let mut seen = status.clone();
    if uid == 0 {
        return seen;
    }
    seen.jobs.retain(|j| j.uid == uid);
    seen.ended.retain(|u| u.uid == uid);
    let theirs = |id: &String| seen.jobs.iter().any(|j| &j.job == id);
    for gpu in &mut seen.gpus {
        if gpu.job.as_ref().is_some_and(|id| !theirs(id)) {
            gpu.job = None;
        }
        // Another user's process ids on a GPU tell what they run; processes in no job
        // are not this user's to know either.
        gpu.processes
            .retain(|p| p.job.as_ref().is_some_and(&theirs));
    }
    seen
}

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
mod tests {
    use super::*;
    use crate::calibration::CalibrationSettings;
    use powerflex_proto::ControlOp;

    fn gpu(index: u32) -> GpuIdentity {
        GpuIdentity {
            index,
            uuid: format!("GPU-{index:08x}-0000-0000-0000-000000000000"),
            name: "NVIDIA H200".into(),
            min_cap: Watts(200.0),
            max_cap: Watts(700.0),
            default_cap: Watts(700.0),
            simulated: false,
        }
    }

    fn settings(node_budget: Option<Watts>) -> AgentSettings {
        AgentSettings {
            node: "n1".into(),
            tiers: TierTable::default_table(),
            default_service: Service::Unmanaged,
            calibration: CalibrationSettings {
                grid: [700.0, 600.0, 500.0].map(Watts).to_vec(),
                settle_s: 1.0,
                hold_s: 2.0,
                warmup_s: 1.0,
                steady_cv: 0.05,
                allowance: 0.05,
                no_signal_s: 10.0,
                rewalk_after_s: crate::calibration::DEFAULT_REWALK_AFTER_S,
                budget_fraction: 0.02,
                expected_cut: 0.3,
            },
            cap_step: Watts(10.0),
            failsafe_cap: Watts(500.0),
            node_budget,
            policy: Policy::Optimal,
            lease_ttl_s: 30.0,
            prior_intercept: 1.2,
            prior_slope: 1.5,
            progress_address: "/run/powerflex/n1.progress".into(),
            job_end_grace_s: 30.0,
            enforce: true,
            unregistered_gpu_use: UnregisteredGpuUse::Failsafe,
        }
    }

    fn agent(node_budget: Option<Watts>) -> Agent {
        let mut a = Agent::with_defaults(
            settings(node_budget),
            (0..4).map(gpu).collect(),
            &BTreeMap::new(),
            0.0,
        );
        for g in 0..4 {
            a.sampled(
                0.0,
                g,
                Ok(GpuSample {
                    power: Watts(650.0),
                    cap: Watts(700.0),
                    energy_mj: Some(0),
                    power_throttled: None,
                    gpu_util_pct: 100,
                    memory_util_pct: 40,
                    sm_clock_mhz: 1980,
                }),
            );
        }
        a
    }

    fn caps(actions: &[Action]) -> Vec<(u32, f64)> {
        actions
            .iter()
            .filter_map(|a| match a {
                Action::SetCap { gpu, cap } => Some((*gpu, cap.0)),
                Action::Persist => None,
            })
            .collect()
    }

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
            .contains("serves node n1"));
        assert!(a
            .register(0.0, "8", "0", 0, "n1", &["9".into()], "flex2")
            .expect_err("no gpu")
            .contains("no GPU 9"));
        assert!(a
            .register(0.0, "8", "0", 0, "n1", &["0".into()], "gold")
            .expect_err("tier")
            .contains("unknown tier"));
        let none = a
            .register(0.0, "9", "0", 0, "n1", &["0".into()], "")
            .expect("default service");
        assert_eq!((none.tier.as_str(), none.progress), ("none", None));
    }

    fn sample_at(cap_w: f64) -> Result<GpuSample, GpuError> {
        Ok(GpuSample {
            power: Watts(cap_w - 20.0),
            cap: Watts(cap_w),
            energy_mj: Some(0),
            power_throttled: None,
            gpu_util_pct: 100,
            memory_util_pct: 40,
            sm_clock_mhz: 1980,
        })
    }

    /// A lease for job 7 at `cap_w` per GPU from a controller of `epoch`.
    fn lease_of_epoch(cap_w: f64, epoch: u64) -> AgentInput {
        AgentInput::Lease(LeaseMessage {
            caps: BTreeMap::from([("7".to_string(), Watts(cap_w))]),
            ttl_s: 30.0,
            start_cap: None,
            recalibrate: Vec::new(),
            learn: Vec::new(),
            next_event_in_s: None,
            event_in_force: true,
            epoch,
        })
    }

    /// An agent of two GPUs at 700 W started at 0 s from `saved`, job 7 on both.
    fn started_with(saved: Option<PersistedState>) -> Agent {
        let mut a = Agent::new(settings(None), (0..2).map(gpu).collect(), 250, UnixMs(0));
        a.step(
            UnixMs(0),
            vec![AgentInput::Start(Box::new(StartFacts {
                saved,
                samples: vec![(0, sample_at(700.0)), (1, sample_at(700.0))],
                jobs_on_host: Some(BTreeSet::new()),
                ..StartFacts::default()
            }))],
        );
        a.register(
            0.0,
            "7",
            "0",
            0,
            "n1",
            &["0".into(), "1".into()],
            "flex2,calibrate=off",
        )
        .expect("registered");
        a
    }

    /// Issue 22, fencing: an agent keeps the highest controller epoch it accepted a
    /// lease from, refuses a lease from a lower one (typed, for the link to tell that
    /// controller) without touching a cap, and keeps refusing it after a restart.
    #[test]
    fn a_lease_from_a_lower_epoch_is_refused_and_a_restart_keeps_refusing_it() {
        let mut a = started_with(None);
        let out = a.step(UnixMs(1_000), vec![lease_of_epoch(450.0, 3)]);
        assert_eq!(out.replies, vec![(0, Reply::Lease(Ok(())))]);
        let written: Vec<(u32, f64)> = out.cap_writes.iter().map(|w| (w.gpu, w.cap.0)).collect();
        assert_eq!(written, vec![(0, 450.0), (1, 450.0)]);
        for w in &out.cap_writes {
            a.cap_written(w.gpu, w.cap, None);
        }
        // The old leader, still running, sends a higher cap: refused, nothing written.
        let out = a.step(UnixMs(2_000), vec![lease_of_epoch(700.0, 2)]);
        assert_eq!(
            out.replies,
            vec![(
                0,
                Reply::Lease(Err(LeaseRefused::StaleEpoch {
                    lease_epoch: 2,
                    accepted_epoch: 3
                }))
            )]
        );
        assert!(out.cap_writes.is_empty(), "{:?}", out.cap_writes);
        assert_eq!(
            a.lease.as_ref().map(|l| l.caps.get("7").copied()),
            Some(Some(Watts(450.0)))
        );
        assert_eq!(a.snapshot(2.0).leases_refused_epoch, 1);
        // The same epoch goes on steering; a later one takes over.
        let out = a.step(
            UnixMs(3_000),
            vec![lease_of_epoch(440.0, 3), lease_of_epoch(430.0, 5)],
        );
        assert_eq!(
            out.replies,
            vec![(0, Reply::Lease(Ok(()))), (1, Reply::Lease(Ok(())))]
        );
        let saved = out.persist.expect("the new epoch is saved");
        assert_eq!(saved.controller_epoch, 5);
        assert_eq!(a.snapshot(3.0).controller_epoch, 5);
        // A restart from the saved state still refuses epoch 3.
        let mut b = started_with(Some(saved));
        let out = b.step(UnixMs(4_000), vec![lease_of_epoch(700.0, 3)]);
        assert!(matches!(
            out.replies.as_slice(),
            [(
                0,
                Reply::Lease(Err(LeaseRefused::StaleEpoch {
                    accepted_epoch: 5,
                    ..
                }))
            )]
        ));
        assert!(out.cap_writes.is_empty());
        // A single controller's agent (epoch 0 throughout) saves no epoch at all.
        let mut c = started_with(None);
        let out = c.step(UnixMs(1_000), vec![lease_of_epoch(450.0, 0)]);
        assert_eq!(out.replies, vec![(0, Reply::Lease(Ok(())))]);
        let text = serde_json::to_string(&out.persist.expect("saved")).expect("json");
        assert!(!text.contains("controller_epoch"), "{text}");
    }

    /// Issue 21: a restart during a cut below the fail-safe wrote the fail-safe over the
    /// lower caps the previous run left; a stop restored every GPU, running jobs' too.
    #[test]
    fn a_restart_raises_no_running_job_s_cap_until_a_current_lease_and_a_stop_keeps_them() {
        let mut a = Agent::with_defaults(
            settings(None),
            (0..4).map(gpu).collect(),
            &BTreeMap::new(),
            0.0,
        );
        // The previous run left GPUs 0 and 1 (job 7's) at 300 W, GPU 2 at 400 W with no
        // job left on it, GPU 3 at its default.
        for (g, cap) in [(0, 300.0), (1, 300.0), (2, 400.0), (3, 700.0)] {
            a.sampled(0.0, g, sample_at(cap));
        }
        a.register(
            0.0,
            "7",
            "0",
            0,
            "n1",
            &["0".into(), "1".into()],
            "flex2,calibrate=off",
        )
        .expect("restored");
        // Past the lease TTL with no lease: the fail-safe (500 W) would raise job 7.
        let set = caps(&a.tick(40.0));
        assert!(
            !set.iter().any(|&(g, _)| g < 2),
            "job 7 kept at 300 W: {set:?}"
        );
        assert!(
            set.contains(&(2, 700.0)),
            "a GPU of no job goes back to default: {set:?}"
        );
        // The previous run's lease, expired or not, from the state file: still no raise.
        a.set_lease(
            41.0,
            BTreeMap::from([("7".to_string(), Watts(600.0))]),
            0.0,
            None,
        );
        assert!(!caps(&a.tick(42.0)).iter().any(|&(g, _)| g < 2));
        a.restore_saved_lease(
            42.0,
            BTreeMap::from([("7".to_string(), Watts(600.0))]),
            20.0,
            None,
        );
        assert!(
            !caps(&a.tick(42.5)).iter().any(|&(g, _)| g < 2),
            "a saved lease is not current"
        );
        // A stop now leaves job 7's GPUs alone and puts the others back.
        let stop = caps(&a.stop_actions(false));
        assert_eq!(stop, vec![(2, 700.0), (3, 700.0)]);
        assert_eq!(
            caps(&a.stop_actions(true)).len(),
            4,
            "--release-on-exit: all"
        );
        // A current lease decides: job 7 may rise.
        a.set_lease(
            43.0,
            BTreeMap::from([("7".to_string(), Watts(600.0))]),
            30.0,
            None,
        );
        let set = caps(&a.tick(44.0));
        assert!(
            set.contains(&(0, 600.0)) && set.contains(&(1, 600.0)),
            "{set:?}"
        );
    }

    /// A GPU whose limit could not be read at start (a transient NVML error): a managed
    /// job on it gets no more than the fail-safe until a current lease; a GPU of no job
    /// is not written until it is read.
    #[test]
    fn a_gpu_unread_at_start_is_held_to_the_failsafe_or_left_alone() {
        let mut a = Agent::with_defaults(
            settings(None),
            (0..4).map(gpu).collect(),
            &BTreeMap::new(),
            0.0,
        );
        let transient = |g| GpuError {
            index: g,
            class: ErrorClass::Transient,
            message: "timeout".into(),
        };
        for g in 0..4 {
            a.sampled(0.0, g, Err(transient(g)));
        }
        a.register(0.0, "7", "0", 0, "n1", &["0".into()], "flex2,calibrate=off")
            .expect("registered");
        let set = caps(&a.tick(1.0));
        assert_eq!(
            set,
            vec![(0, 500.0)],
            "job 7's GPU at the fail-safe, the idle ones untouched"
        );
    }

    /// Issue 24 (seen in the demo): a job walked again during a cut walked from its grant
    /// down and took the grant's speed for the uncapped one.
    #[test]
    fn a_repeated_walk_waits_until_the_job_is_granted_its_uncapped_cap() {
        let mut a = agent(None);
        a.register(1.0, "7", "0", 0, "n1", &["0".into(), "1".into()], "flex2")
            .expect("registered");
        // Walked before (as after a restart): its calibration is done.
        a.jobs
            .get_mut("7")
            .expect("job")
            .calibration
            .restore(&[[700.0, 1300.0, 1000.0], [500.0, 1000.0, 900.0]]);
        let lease = |a: &mut Agent, now: f64, cap: f64| {
            a.set_lease(
                now,
                BTreeMap::from([("7".to_string(), Watts(cap))]),
                30.0,
                None,
            )
        };
        lease(&mut a, 2.0, 450.0);
        assert!(
            a.recalibrate(3.0, &["7".to_string()]).is_empty(),
            "not during a cut"
        );
        lease(&mut a, 4.0, 700.0);
        assert_eq!(
            a.recalibrate(5.0, &["7".to_string()]),
            ["7"],
            "once uncapped"
        );
    }

    fn reading(
        cap_w: f64,
        power_w: f64,
        energy_mj: u64,
        throttled: bool,
    ) -> Result<GpuSample, GpuError> {
        Ok(GpuSample {
            power: Watts(power_w),
            cap: Watts(cap_w),
            energy_mj: Some(energy_mj),
            power_throttled: Some(throttled),
            gpu_util_pct: 100,
            memory_util_pct: 40,
            sm_clock_mhz: 1980,
        })
    }

    #[test]
    fn a_job_is_charged_its_own_gpus_counters_over_its_hold_and_its_end_is_final() {
        let mut a = agent(None);
        a.register(
            1001.0,
            "7",
            "0",
            1000,
            "n1",
            &["0".into(), "1".into()],
            "flex2",
        )
        .expect("7");
        a.register(1001.0, "8", "0", 2000, "n1", &["2".into()], "none")
            .expect("8");
        // The readings at registration start each hold.
        for g in 0..3 {
            a.sampled(
                1001.0,
                g,
                reading(700.0, 650.0, 10_000 * u64::from(g + 1), false),
            );
        }
        a.tick(1001.0);
        a.event_in_force = true;
        for (t, e) in [(1002.0, 500_000u64), (1003.0, 1_000_000)] {
            for g in 0..3 {
                a.sampled(
                    t,
                    g,
                    reading(500.0, 480.0, 10_000 * u64::from(g + 1) + e, true),
                );
            }
            a.tick(t);
        }
        let running = a.snapshot(1003.0);
        let seven = running.jobs.iter().find(|j| j.job == "7").expect("7");
        let share = seven.usage.as_ref().expect("usage");
        // GPUs 0 and 1 each advanced 1,000,000 mJ over the hold; GPU 2 is job 8's.
        assert_eq!(share.energy_mj, 2_000_000);
        assert_eq!(share.gpus.len(), 2);
        assert_eq!(
            (share.from_unix_ms, share.to_unix_ms),
            (1_001_000, 1_003_000)
        );
        assert!(!share.ended);
        assert_eq!(
            share.peak_power_w, 1300.0,
            "two GPUs at 650 W before the cut"
        );
        // Capped, in an event and throttled from the 2 s observation to the 3 s one.
        assert_eq!(
            (share.capped_s, share.event_s, share.power_throttled_s),
            (1.0, 1.0, 1.0)
        );
        assert!(a.end_job("7", 1003.5));
        // Job 7's GPUs read after its end are no longer its.
        a.sampled(1004.0, 0, reading(700.0, 100.0, 9_999_999, false));
        let ended = a.unacked_finals();
        assert_eq!(ended.len(), 1);
        assert!(ended[0].ended && ended[0].energy_mj == 2_000_000 && ended[0].uid == 1000);
        assert_eq!(a.take_records().len(), 1);
        assert!(a.take_records().is_empty(), "a record is logged once");
        // Kept, and re-sent, until the controller acknowledges it: an hour on, still.
        a.tick(3_604.0);
        assert_eq!(a.unacked_finals(), ended);
        assert_eq!(a.acked(&[FinalRef::of(&ended[0])]), 1);
        assert!(
            a.unacked_finals().is_empty(),
            "acknowledged: no longer sent"
        );
        assert_eq!(
            a.acked(&[FinalRef::of(&ended[0])]),
            0,
            "a repeat ack is harmless"
        );
        // Job 8 (none) is accounted too.
        let eight = a.snapshot(1004.0);
        let eight = eight.jobs.iter().find(|j| j.job == "8").expect("8");
        assert_eq!(eight.usage.as_ref().expect("usage").energy_mj, 1_000_000);
    }

    /// Issue 23: the line at the end of a batch job's output is made from the share
    /// its batch step's end returns, which must be the final share the controller gets.
    #[test]
    fn the_batch_step_s_end_makes_the_job_s_final_share_and_keeps_its_caps_to_its_end() {
        let mut a = agent(None);
        let gpus = ["0".to_string(), "1".to_string()];
        a.register(1001.0, "7", "batch", 1000, "n1", &gpus, "flex2")
            .expect("batch");
        a.register(1001.5, "7", "0", 1000, "n1", &gpus, "flex2")
            .expect("step 0");
        for (t, e) in [(1001.0, 0u64), (1002.0, 400_000), (1003.0, 900_000)] {
            for g in 0..2 {
                a.sampled(t, g, reading(700.0, 450.0, 5_000 + e, false));
            }
            a.tick(t);
        }
        // An srun step's end leaves the job (and its hold) in place.
        assert_eq!(a.end_step("7", "0", 1003.0), Ok(None));
        assert!(a.jobs.contains_key("7"));
        let share = a
            .end_step("7", "batch", 1003.2)
            .expect("known")
            .expect("the batch step's end ends the job");
        assert!(share.ended);
        assert_eq!(share.energy_mj, 1_800_000);
        assert_eq!(share.uid, 1000);
        // The job keeps its GPUs, at their caps, while Slurm stops what is left of it.
        assert!(a.jobs.contains_key("7"), "held until the job's end");
        assert_eq!(a.gpus[0].job.as_deref(), Some("7"));
        assert_eq!(
            a.unacked_finals(),
            vec![share.clone()],
            "what the controller gets"
        );
        // A second batch end, and the job's end that follows, make no second share.
        a.sampled(1003.3, 0, reading(700.0, 450.0, 5_000 + 950_000, false));
        assert_eq!(a.end_step("7", "batch", 1003.3), Ok(Some(share.clone())));
        assert!(a.end_job("7", 1003.4), "the job's end releases its GPUs");
        assert_eq!(a.gpus[0].job, None);
        assert_eq!(a.unacked_finals(), vec![share.clone()], "one final share");
        assert_eq!(a.take_records(), vec![share]);
        // A cancelled job: the extern step's end came first; the batch step's end still
        // gets the final share.
        a.register(1004.0, "9", "batch", 1000, "n1", &gpus, "flex2")
            .expect("9");
        assert!(a.end_job("9", 1005.0));
        let late = a
            .end_step("9", "batch", 1005.1)
            .expect("ended here")
            .expect("share");
        assert!(late.ended && late.job_id == "9");
        assert!(
            a.end_step("9", "0", 1005.1).is_err(),
            "no job 9 for other steps"
        );
        assert!(a.end_step("8", "batch", 1005.1).is_err(), "never here");
    }

    #[test]
    fn observe_mode_writes_no_limit_and_shows_what_it_would_write() {
        let mut s = settings(None);
        s.enforce = false;
        let mut a = Agent::with_defaults(s, (0..2).map(gpu).collect(), &BTreeMap::new(), 0.0);
        for g in 0..2 {
            a.sampled(0.0, g, reading(700.0, 650.0, 0, false));
        }
        a.register(1.0, "7", "0", 0, "n1", &["0".into()], "flex3")
            .expect("registered");
        a.set_lease(
            1.0,
            BTreeMap::from([("7".to_string(), Watts(450.0))]),
            30.0,
            None,
        );
        assert!(caps(&a.tick(1.0)).is_empty(), "no limit written");
        let snap = a.snapshot(1.0);
        assert!(!snap.enforce);
        // What NVML said, for comparison with NVML's other clients (scripts/gpu-observe.sh).
        assert_eq!(
            (snap.gpus[0].min_w, snap.gpus[0].max_w),
            (Some(200.0), Some(700.0))
        );
        assert_eq!(snap.gpus[0].power_throttled, Some(false));
        assert_eq!(snap.gpus[0].would_cap_w, Some(450.0));
        assert_eq!(snap.gpus[1].would_cap_w, Some(700.0));
        // Lease expiry, the fail-safe and a stop write nothing either.
        assert!(caps(&a.tick(100.0)).is_empty());
        assert!(a.stop_actions(true).is_empty());
        // One reload switches to enforcing.
        let mut on = settings(None);
        on.enforce = true;
        a.reload(Ok(on)).expect("reload");
        a.set_lease(
            101.0,
            BTreeMap::from([("7".to_string(), Watts(450.0))]),
            30.0,
            None,
        );
        assert_eq!(caps(&a.tick(101.0)), vec![(0, 450.0)]);
    }

    #[test]
    fn caps_are_written_once_and_restored_at_job_end() {
        let mut a = agent(None);
        // Nothing to do at the start: every GPU already at its default.
        assert!(caps(&a.tick(1.0)).is_empty());
        a.register(1.0, "7", "0", 0, "n1", &["0".into(), "1".into()], "flex3")
            .expect("registered");
        // Lease arrives: job 7 at 450 W on both GPUs, in one go.
        a.set_lease(
            2.0,
            BTreeMap::from([("7".to_string(), Watts(450.0))]),
            30.0,
            None,
        );
        let first = caps(&a.tick(2.0));
        assert_eq!(first, vec![(0, 450.0), (1, 450.0)]);
        for (g, c) in first {
            a.cap_written(g, Watts(c), None);
        }
        assert!(caps(&a.tick(3.0)).is_empty(), "written only on change");
        assert!(a.end_job("7", 0.0));
        assert_eq!(caps(&a.tick(4.0)), vec![(0, 700.0), (1, 700.0)]);
        assert!(!a.end_job("7", 0.0), "ending twice is harmless");
    }

    /// A restart restores from what the previous run saved: a job whose step daemons
    /// still run (by id and cluster) is managed again, with its tier and steps; one that
    /// ended while the agent was down, or whose id now belongs to another cluster's job,
    /// gets its final share and leaves its GPUs to go back to their defaults.
    #[test]
    fn a_restart_manages_the_saved_jobs_that_still_run_and_closes_the_others() {
        let mut before = agent(None);
        let conf = |c: &str| Some(format!("/etc/{c}/slurm.conf"));
        for (job, gpu, cluster) in [("1", "0", "a"), ("2", "1", "a"), ("3", "2", "b")] {
            before
                .register(
                    0.0,
                    job,
                    "0",
                    1000,
                    "n1",
                    &[gpu.into()],
                    "flex2,calibrate=off",
                )
                .expect("registered");
            before.set_job_cluster(job, conf(cluster), 0.0);
        }
        let saved = before.saved_state();
        assert_eq!(saved.jobs.len(), 3);
        let mut after = agent(None);
        // Job 1 runs on; job 2 is gone; job 3's id now names a job of cluster "a".
        let live = BTreeSet::from([("1".to_string(), conf("a")), ("3".to_string(), conf("a"))]);
        after.restore_saved_jobs(5.0, 5.0, saved.jobs, &live, &BTreeSet::new());
        assert_eq!(after.jobs.keys().collect::<Vec<_>>(), ["1"]);
        assert_eq!(after.jobs["1"].cluster, Some(conf("a")));
        assert_eq!(after.jobs["1"].request.to_string(), "flex2,calibrate=off");
        let closed: BTreeSet<&str> = after
            .unacked
            .iter()
            .map(|u| u.share.job_id.as_str())
            .collect();
        assert_eq!(closed, BTreeSet::from(["2", "3"]));
        assert!(after.unacked.iter().all(|u| u.share.ended));
        // Their GPUs (1 and 2) belong to no job: the first tick leaves them at their
        // defaults (read back at 700 W here, so nothing to write).
        assert!(after.gpus[1].job.is_none() && after.gpus[2].job.is_none());
        let written = caps(&after.tick(6.0));
        assert!(
            !written.iter().any(|(g, _)| *g == 1 || *g == 2),
            "{written:?}"
        );
    }

    /// A job silent past `no_signal_s` is planned on the telemetry prior; its first
    /// report starts its calibration and drops that prior, so it is planned as every
    /// reporting job is until its walk ends, not on a reading frozen at that moment.
    #[test]
    fn a_late_first_report_ends_the_telemetry_prior() {
        let mut a = agent(None);
        a.register(0.0, "4", "0", 1000, "n1", &["0".into()], "flex2")
            .expect("registered");
        a.tick(1.0);
        assert!(
            a.jobs["4"].prior.is_none(),
            "within no_signal_s: no prior yet"
        );
        a.tick(11.0);
        assert_eq!(a.jobs["4"].calibration.phase, Phase::NoSignal);
        assert!(
            a.jobs["4"].prior.is_some(),
            "planned on the telemetry prior"
        );
        a.progress(12.0, "4", 77, 1000, 1).expect("report");
        a.tick(12.0);
        assert_eq!(a.jobs["4"].calibration.phase, Phase::Warmup);
        assert!(a.jobs["4"].prior.is_none());
    }

    /// A lease message is applied whole, at once: its caps come back as writes (the
    /// controller waits for this node's decreases), the event flag and the jobs that may
    /// be probed are taken, and it is counted.
    #[test]
    fn a_lease_message_is_applied_at_once() {
        let mut a = agent(None);
        a.register(
            0.0,
            "7",
            "0",
            0,
            "n1",
            &["0".into(), "1".into()],
            "flex2,calibrate=off",
        )
        .expect("registered");
        let written = caps(&a.tick(1.0));
        for (g, c) in written {
            a.cap_written(g, Watts(c), None);
        }
        let actions = a.apply_lease(
            2.0,
            LeaseMessage {
                caps: BTreeMap::from([("7".to_string(), Watts(450.0))]),
                ttl_s: 30.0,
                start_cap: Some(Watts(500.0)),
                recalibrate: vec!["7".into()],
                learn: vec!["7".into()],
                next_event_in_s: None,
                event_in_force: true,
                epoch: 0,
            },
        );
        assert_eq!(caps(&actions), vec![(0, 450.0), (1, 450.0)]);
        assert!(a.event_in_force);
        assert!(a.learn.contains("7"));
        assert_eq!(a.leases_applied, 1);
        assert_eq!(
            a.lease.as_ref().map(|l| (l.expires_at, l.start_cap)),
            Some((32.0, Some(Watts(500.0))))
        );
    }

    #[test]
    fn a_job_the_lease_does_not_cover_runs_at_the_failsafe_cap() {
        let mut a = agent(None);
        a.register(0.0, "7", "0", 0, "n1", &["0".into()], "flex2,calibrate=off")
            .expect("registered");
        a.set_lease(
            1.0,
            BTreeMap::from([("7".to_string(), Watts(600.0))]),
            3600.0,
            None,
        );
        assert_eq!(caps(&a.tick(2.0)), vec![(0, 600.0)]);
        a.cap_written(0, Watts(600.0), None);
        // Job 8 starts after the lease (the controller is away): not uncapped.
        a.register(3.0, "8", "0", 0, "n1", &["1".into()], "flex2,calibrate=off")
            .expect("registered");
        assert_eq!(caps(&a.tick(4.0)), vec![(1, 500.0)]);
    }

    #[test]
    fn a_reload_keeps_the_node_and_mode_and_reports_a_refusal() {
        let mut a = agent(None);
        let mut new = a.settings.clone();
        new.failsafe_cap = Watts(250.0);
        new.node = "elsewhere".into();
        assert!(a.reload(Ok(new.clone())).is_ok());
        assert_eq!(a.settings.failsafe_cap, Watts(250.0));
        assert_eq!(
            a.settings.node, "n1",
            "the node is fixed for the agent's life"
        );
        new.node_budget = Some(Watts(1000.0));
        assert!(a.reload(Ok(new)).is_err(), "a mode switch needs a restart");
        assert!(a.reload(Err("bad file".into())).is_err());
        assert_eq!(a.snapshot(0.0).config_error.as_deref(), Some("bad file"));
        assert_eq!(
            a.settings.failsafe_cap,
            Watts(250.0),
            "the settings in force stay"
        );
    }

    #[test]
    fn lease_expiry_brings_the_failsafe_cap() {
        let mut a = agent(None);
        a.register(0.0, "7", "0", 0, "n1", &["2".into()], "flex2,calibrate=off")
            .expect("registered");
        assert_eq!(
            caps(&a.tick(10.0)),
            vec![(2, 500.0)],
            "no cap granted yet: the fail-safe cap, not the GPU's maximum"
        );
        assert!(
            !a.failsafe_active(10.0),
            "the link itself is not yet overdue"
        );
        a.cap_written(2, Watts(500.0), None);
        assert!(
            caps(&a.tick(31.0)).is_empty(),
            "no lease within the TTL: still fail-safe"
        );
        assert!(a.failsafe_active(31.0));
        a.cap_written(2, Watts(500.0), None);
        a.set_lease(
            40.0,
            BTreeMap::from([("7".to_string(), Watts(600.0))]),
            3600.0,
            None,
        );
        assert_eq!(caps(&a.tick(41.0)), vec![(2, 600.0)]);
        a.cap_written(2, Watts(600.0), None);
        assert_eq!(
            caps(&a.tick(71.0)),
            vec![(2, 500.0)],
            "lease over: fail-safe again"
        );
    }

    #[test]
    fn degraded_gpus_are_left_alone() {
        let mut a = agent(None);
        a.register(0.0, "7", "0", 0, "n1", &["0".into(), "1".into()], "flex3")
            .expect("registered");
        a.sampled(
            0.0,
            1,
            Err(GpuError {
                index: 1,
                class: ErrorClass::DeviceLost,
                message: "GPU is lost".into(),
            }),
        );
        a.set_lease(
            1.0,
            BTreeMap::from([("7".to_string(), Watts(400.0))]),
            30.0,
            None,
        );
        assert_eq!(caps(&a.tick(1.0)), vec![(0, 400.0)]);
        assert!(a.snapshot(1.0).degraded);
        a.sampled(
            0.0,
            2,
            Err(GpuError {
                index: 2,
                class: ErrorClass::Transient,
                message: "timeout".into(),
            }),
        );
        assert!(
            a.gpus[2].degraded.is_none(),
            "a transient error does not degrade"
        );
        // The lost GPU answers again (a probe): it is managed again, from the limit it
        // reads, and gets the job's cap.
        a.sampled(
            0.0,
            1,
            Ok(GpuSample {
                power: Watts(650.0),
                cap: Watts(700.0),
                ..a.gpus[0].last.expect("a sample of GPU 0")
            }),
        );
        assert!(a.gpus[1].degraded.is_none());
        assert!(caps(&a.tick(2.0)).contains(&(1, 400.0)));
    }

    #[test]
    fn standalone_budget_is_shared_and_unmanaged_jobs_untouched() {
        let mut a = agent(Some(Watts(2000.0)));
        a.register(
            0.0,
            "7",
            "0",
            0,
            "n1",
            &["0".into(), "1".into()],
            "flex3,calibrate=off",
        )
        .expect("managed");
        a.register(0.0, "8", "0", 0, "n1", &["2".into()], "none")
            .expect("unmanaged");
        let decided = caps(&a.tick(1.0));
        // GPUs 2 (unmanaged) and 3 (idle) draw 650 W each: 700 W left for job 7's two GPUs.
        assert!(
            decided.iter().all(|&(g, _)| g == 0 || g == 1),
            "{decided:?}"
        );
        let cap = decided[0].1;
        assert!((200.0..=350.0).contains(&cap), "{decided:?}");
        assert_eq!(decided[0].1, decided[1].1);
    }

    /// Seen: 1,831 W on a 1,500 W node after a walk from 500 W. A curve walked from a
    /// grant down is flat above its top, and the allocation took a cap above the walk
    /// for the power measured at its top: a cap rises above the walk only where the
    /// budget pays for what the GPUs may then draw.
    #[test]
    fn a_curve_walked_from_a_grant_down_lets_no_cap_rise_on_a_guess() {
        // GPUs 2 and 3 idle at 650 W each: 1,100 W of 2,400 W left for job 7's two GPUs.
        let mut a = agent(Some(Watts(2400.0)));
        a.register(
            0.0,
            "7",
            "0",
            0,
            "n1",
            &["0".into(), "1".into()],
            "flex3,calibrate=off",
        )
        .expect("managed");
        // Walked from 500 W down: 960 W at 500 W, speed rising to it.
        let walked = [
            [500.0, 960.0, 100.0],
            [400.0, 780.0, 90.0],
            [300.0, 590.0, 75.0],
        ];
        a.jobs.get_mut("7").expect("7").calibration.restore(&walked);
        let decided = caps(&a.tick(1.0));
        let cap = decided
            .iter()
            .find(|&&(g, _)| g == 0)
            .map(|&(_, c)| c)
            .expect("job 7 capped");
        assert_eq!(decided.iter().filter(|&&(g, _)| g == 1).count(), 1);
        // Above the walk its GPUs may draw up to the cap each: from 960 W at 500 W to
        // 1,400 W at 700 W. 1,100 W pays for no more than ~563 W.
        let bound_w = |c: f64| 960.0 + (c - 500.0) / 200.0 * 440.0;
        assert!(
            cap >= 500.0,
            "the budget pays for the walk's top: {decided:?}"
        );
        assert!(
            bound_w(cap) <= 1100.0,
            "a cap above what the budget pays: {decided:?}"
        );
    }

    /// The step the edge drives: a registration from a step daemon is refused when
    /// another job's processes run on a GPU it names; one that is not is capped before
    /// its answer, and the status waits for the caps' results.
    #[test]
    fn a_registration_through_the_step_is_checked_capped_then_answered() {
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
            gpu_users: BTreeMap::from([(0, BTreeSet::from([("9".to_string(), None)]))]),
            ..ControlFacts::default()
        };
        let out = a.step(UnixMs(1_000), vec![AgentInput::Control { op, facts }]);
        let Some((0, Reply::Control(reply))) = out.replies.first() else {
            panic!("one answer: {:?}", out.replies);
        };
        assert!(!reply.ok && reply.error.as_deref().is_some_and(|e| e.contains("job 9")));
        assert!(out.cap_writes.is_empty() && a.jobs.is_empty());
        assert_eq!(a.gpu_claims_refused, 1);

        let facts = ControlFacts {
            stepd_cluster: Some(None),
            samples: vec![(1, sample_at(700.0))],
            ..ControlFacts::default()
        };
        let out = a.step(
            UnixMs(2_000),
            vec![AgentInput::Control {
                op: register("7", "1"),
                facts,
            }],
        );
        assert!(matches!(out.replies.as_slice(), [(0, Reply::Control(r))] if r.ok));
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

    /// Issue: two jobs cut below the fail-safe went back up to it when the controller
    /// died, and the site went over its budget.
    #[test]
    fn the_failsafe_never_raises_a_cap() {
        let mut a = agent(None);
        a.register(0.0, "7", "0", 0, "n1", &["0".into()], "flex3,calibrate=off")
            .expect("registered");
        a.set_lease(
            1.0,
            BTreeMap::from([("7".to_string(), Watts(250.0))]),
            30.0,
            None,
        );
        assert_eq!(caps(&a.tick(2.0)), vec![(0, 250.0)]);
        a.cap_written(0, Watts(250.0), None);
        assert!(
            caps(&a.tick(40.0)).is_empty(),
            "lease over: stays at 250 W, below the 500 W fail-safe"
        );
        assert!(a.failsafe_active(40.0));
        // A grant above the fail-safe still falls to it.
        a.set_lease(
            41.0,
            BTreeMap::from([("7".to_string(), Watts(650.0))]),
            30.0,
            None,
        );
        assert_eq!(caps(&a.tick(42.0)), vec![(0, 650.0)]);
        a.cap_written(0, Watts(650.0), None);
        assert_eq!(caps(&a.tick(80.0)), vec![(0, 500.0)]);
    }

    #[test]
    fn a_job_starting_during_a_cut_starts_at_the_leases_start_cap() {
        let mut a = agent(None);
        a.set_lease(0.0, BTreeMap::new(), 30.0, Some(Watts(300.0)));
        a.register(1.0, "8", "0", 0, "n1", &["1".into()], "flex2,calibrate=off")
            .expect("registered");
        assert_eq!(caps(&a.tick(2.0)), vec![(1, 300.0)]);
        a.cap_written(1, Watts(300.0), None);
        assert!(
            caps(&a.tick(40.0)).is_empty(),
            "and stays there when the lease lapses"
        );
        // A start cap above the fail-safe is held to it.
        a.set_lease(41.0, BTreeMap::new(), 30.0, Some(Watts(650.0)));
        assert_eq!(caps(&a.tick(42.0)), vec![(1, 500.0)]);
        // Nonsense in a lease is ignored, never applied.
        a.set_lease(
            43.0,
            BTreeMap::from([("8".to_string(), Watts(f64::NAN))]),
            30.0,
            Some(Watts(-1.0)),
        );
        a.cap_written(1, Watts(500.0), None);
        assert!(caps(&a.tick(44.0)).is_empty());
    }

    /// Job 7 on GPU 0 under a lease of 450 W, its cap to be written.
    fn job_7_capped_at_450() -> Agent {
        let mut a = agent(None);
        a.register(0.0, "7", "0", 0, "n1", &["0".into()], "flex3,calibrate=off")
            .expect("registered");
        a.set_lease(
            0.0,
            BTreeMap::from([("7".to_string(), Watts(450.0))]),
            30.0,
            None,
        );
        assert_eq!(caps(&a.tick(1.0)), vec![(0, 450.0)]);
        a
    }

    /// Issue: `nvidia-smi -pl`, a GPU reset or a second agent changed a limit and the
    /// agent, comparing with its own last write, never noticed.
    #[test]
    fn a_limit_changed_behind_the_agents_back_is_found_counted_and_written_again() {
        let mut a = job_7_capped_at_450();
        a.cap_written(0, Watts(450.0), None);
        let sample = a.gpus[0].last.expect("a sample of GPU 0");
        let same = a.sampled(
            0.0,
            0,
            Ok(GpuSample {
                cap: Watts(450.0),
                ..sample
            }),
        );
        assert_eq!(same, None);
        let found = a.sampled(
            0.0,
            0,
            Ok(GpuSample {
                cap: Watts(700.0),
                ..sample
            }),
        );
        assert_eq!(
            found,
            Some(CapMismatch {
                gpu: 0,
                expected: Watts(450.0),
                found: Watts(700.0)
            })
        );
        assert_eq!(a.cap_mismatches, 1);
        assert_eq!(a.snapshot(2.0).cap_mismatches, 1);
        assert_eq!(caps(&a.tick(2.0)), vec![(0, 450.0)], "written again");
        a.cap_written(0, Watts(450.0), None);
        // An idle GPU reset to another limit goes back to its default too.
        let idle = a.gpus[3].last.expect("a sample of GPU 3");
        assert!(a
            .sampled(
                0.0,
                3,
                Ok(GpuSample {
                    cap: Watts(300.0),
                    ..idle
                })
            )
            .is_some());
        assert_eq!(caps(&a.tick(3.0)), vec![(3, 700.0)]);
    }

    /// Seen in a clean-clone run: a new grant was written between the change behind the
    /// agent's back and the next sample, so the sample found the agent's own write and
    /// the change was never counted.
    #[test]
    fn a_limit_changed_behind_the_agents_back_is_found_when_a_new_cap_is_written() {
        let mut a = job_7_capped_at_450();
        assert_eq!(
            a.cap_written(0, Watts(450.0), Some(Watts(700.0))),
            None,
            "the default, read by the last sample"
        );
        a.set_lease(
            1.5,
            BTreeMap::from([("7".to_string(), Watts(500.0))]),
            30.0,
            None,
        );
        assert_eq!(caps(&a.tick(2.0)), vec![(0, 500.0)]);
        // The limit read just before writing 500 W: somebody set 700 W.
        assert_eq!(
            a.cap_written(0, Watts(500.0), Some(Watts(700.0))),
            Some(CapMismatch {
                gpu: 0,
                expected: Watts(450.0),
                found: Watts(700.0)
            })
        );
        assert_eq!(a.cap_mismatches, 1);
        // The write itself is what the next sample must find.
        let sample = a.gpus[0].last.expect("a sample of GPU 0");
        let next = a.sampled(
            3.0,
            0,
            Ok(GpuSample {
                cap: Watts(500.0),
                ..sample
            }),
        );
        assert_eq!(next, None);
        // A limit that could not be read before the write counts nothing.
        assert_eq!(a.cap_written(0, Watts(500.0), None), None);
        assert_eq!(a.cap_mismatches, 1);
    }

    /// Issue 13: a job whose epilog never reached the agent stayed registered, capped
    /// and paid for, forever.
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

    /// Issue 21: without `PrologFlags=Contain`, or with the end-of-job notice lost, the
    /// next job on a GPU was refused as "belongs to running job A", then ran unmanaged.
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

    /// Issue 14: a step Slurm gave no GPUs, with GPU variables the user exported, took
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
            .expect_err("GPU 1 is job 7's");
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

    #[test]
    fn a_gpu_used_only_by_another_jobs_processes_leaves_the_claimant() {
        let mut a = agent(None);
        a.register(
            0.0,
            "66",
            "0",
            1000,
            "n1",
            &["0".into(), "1".into()],
            "flex3",
        )
        .expect("registered");
        a.set_job_cluster("66", None, 0.0);
        // NVML: GPU 0 runs a process of job 7 (not registered: an unmanaged job), GPU 1
        // a process of 66 itself.
        let used = BTreeMap::from([
            (0, BTreeSet::from([("7".to_string(), None)])),
            (1, BTreeSet::from([("66".to_string(), None)])),
        ]);
        let refused = a.check_gpu_use(0.0, &used);
        assert_eq!(
            refused,
            vec![GpuClaimRefused {
                gpu: 0,
                claimed_by: "66".into(),
                used_by: vec!["7".into()]
            }]
        );
        assert_eq!(a.gpus[0].job, None, "back to its default at the next tick");
        assert_eq!(a.jobs["66"].gpus, vec![1]);
        assert_eq!(a.snapshot(1.0).gpu_claims_refused, 1);
        assert!(caps(&a.tick(1.0)).iter().all(|&(g, _)| g != 0));
    }

    /// Review defect 5: final shares are kept until acknowledged (bounded in count and
    /// age), and a job that ended while the agent was down gets one at the next start.
    #[test]
    fn unacknowledged_final_shares_are_bounded_and_a_job_ended_while_down_gets_one() {
        let mut a = agent(None);
        let mut b = agent(None);
        b.register(1000.0, "1", "0", 1, "n1", &["0".into()], "flex2")
            .expect("job");
        let base = b.share(&b.jobs["1"], true);
        for i in 0..(MAX_ENDED_KEPT + 3) {
            let mut s = base.clone();
            s.from_unix_ms = i as u64;
            a.keep_final(1001.0, s);
        }
        assert_eq!(a.unacked.len(), MAX_ENDED_KEPT, "the oldest dropped beyond");
        assert_eq!(a.unacked[0].share.from_unix_ms, 3);
        let day_s = (UNACKED_FINAL_MAX_AGE_MS / 1000) as f64;
        a.tick(1001.0 + day_s - 1.0);
        assert_eq!(a.unacked.len(), MAX_ENDED_KEPT, "within a day: kept");
        let actions = a.tick(1001.0 + day_s);
        assert!(a.unacked.is_empty(), "a day unacknowledged: dropped");
        assert!(
            actions.contains(&Action::Persist),
            "and the state saved without them"
        );

        // The previous run's job 7 held GPUs 0 and 1; the agent was down when it ended.
        let mut before = agent(None);
        before
            .register(
                1000.0,
                "7",
                "0",
                1000,
                "n1",
                &["0".into(), "1".into()],
                "flex2",
            )
            .expect("7");
        before.sampled(1001.0, 0, reading(700.0, 600.0, 1_000_000, false));
        before.sampled(1001.0, 1, reading(700.0, 600.0, 2_000_000, false));
        let usage = before.jobs["7"].usage.clone();
        // Restarted 100 s later: the counters ran on. GPU 1 now runs another job's
        // processes: its span is closed at its last persisted reading.
        let mut a = agent(None);
        a.sampled(1101.0, 0, reading(700.0, 100.0, 1_500_000, false));
        a.sampled(1101.0, 1, reading(700.0, 600.0, 9_000_000, false));
        let busy = BTreeSet::from([a.gpus[1].identity.uuid.clone()]);
        let share = a.ended_while_down(1101.0, "7", 1000, "flex2", &[], None, usage, &busy);
        assert!(share.ended);
        assert_eq!(share.energy_mj, 500_000, "GPU 0's advance; none of GPU 1's");
        assert_eq!(share.to_unix_ms, 1_101_000);
        assert_eq!(
            share.bound_pct,
            Some(25.0),
            "the tier's bound from its flex"
        );
        assert_eq!(a.unacked_finals(), vec![share.clone()]);
        assert_eq!(a.take_records(), vec![share]);
    }

    /// Issue 23 review, defect 4: a refused claim kept its hold, and taking the GPU back
    /// charged the job the counter's advance while another job used it.
    #[test]
    fn a_refused_or_stolen_gpu_ends_its_hold_and_a_retake_charges_only_its_own_spans() {
        let mut a = agent(None);
        a.register(
            1000.0,
            "66",
            "0",
            1000,
            "n1",
            &["0".into(), "1".into()],
            "flex3",
        )
        .expect("registered");
        a.set_job_cluster("66", None, 1000.0);
        for (t, e) in [(1000.0, 0u64), (1001.0, 100_000)] {
            a.sampled(t, 0, reading(700.0, 100.0, e, false));
            a.sampled(t, 1, reading(700.0, 100.0, e, false));
        }
        let used = BTreeMap::from([(0, BTreeSet::from([("7".to_string(), None)]))]);
        assert_eq!(a.check_gpu_use(1001.0, &used).len(), 1);
        // GPU 0 runs job 7's work: its counter runs on, not 66's.
        a.sampled(1005.0, 0, reading(700.0, 600.0, 5_000_000, false));
        a.sampled(1005.0, 1, reading(700.0, 100.0, 500_000, false));
        // 66 takes GPU 0 back (a new step of it names it, job 7 gone).
        a.register(1006.0, "66", "1", 1000, "n1", &["0".into()], "flex3")
            .expect("back");
        a.sampled(1006.0, 0, reading(700.0, 100.0, 5_100_000, false));
        a.sampled(1007.0, 0, reading(700.0, 100.0, 5_300_000, false));
        a.sampled(1007.0, 1, reading(700.0, 100.0, 600_000, false));
        let share = a.share(&a.jobs["66"], false);
        // GPU 0: 100,000 before the refusal and 200,000 since the retake; GPU 1: 600,000.
        assert_eq!(share.energy_mj, 100_000 + 200_000 + 600_000);
        // Another job given a GPU (the holder's end missed) ends the holder's span too.
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

    /// Issue 21: a job whose registration failed, or a process outside Slurm, ran its
    /// GPU at the default, uncapped through a grid event.
    #[test]
    fn a_gpu_used_by_no_registered_job_is_held_at_the_failsafe_until_its_processes_go() {
        let mut a = agent(Some(Watts(2800.0)));
        let tick = |a: &mut Agent, t: f64| {
            let set = caps(&a.tick(t));
            for &(g, c) in &set {
                a.cap_written(g, Watts(c), None);
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

    /// Only the job's owner or root may report its progress, and only from a step of
    /// the job's own Slurm cluster (the test clusters share one host and repeat job
    /// ids); every refusal is counted, and nothing refused reaches the job's log.
    #[test]
    fn progress_is_taken_only_from_the_jobs_owner_or_root_of_its_cluster() {
        let mut a = agent(Some(Watts(2800.0)));
        a.register(0.0, "1", "0", 1000, "n1", &["0".into()], "flex1")
            .expect("job 1");
        a.set_job_cluster("1", Some("/etc/slurm-a/slurm.conf".into()), 0.0);
        let report = |tokens| ProgressReport {
            v: 1,
            job_id: "1".into(),
            tokens,
            steps: tokens / 1000,
        };
        let sender = |uid, cluster: Option<&str>| ReportSender {
            uid,
            pid: 4000 + uid,
            step_job: "1".into(),
            cluster: cluster.map(str::to_string),
        };
        let ours = Some("/etc/slurm-a/slurm.conf");
        assert_eq!(
            a.report_progress(1.0, &sender(1000, ours), &report(1000)),
            Ok(())
        );
        assert_eq!(
            a.report_progress(1.1, &sender(0, ours), &report(2000)),
            Ok(())
        );
        let refused = [
            a.report_progress(1.2, &sender(1001, ours), &report(9_000_000)),
            a.report_progress(
                1.3,
                &sender(1000, Some("/etc/slurm-b/slurm.conf")),
                &report(9_000_000),
            ),
            a.report_progress(1.4, &sender(1000, None), &report(9_000_000)),
            a.report_progress(
                1.5,
                &sender(1000, ours),
                &ProgressReport {
                    job_id: "2".into(),
                    ..report(9_000_000)
                },
            ),
        ];
        let reasons: Vec<String> = refused
            .into_iter()
            .map(|r| r.expect_err("refused"))
            .collect();
        assert!(
            reasons[0].contains("uid 1001 may not report for job 1"),
            "{reasons:?}"
        );
        assert!(reasons[1].contains("another Slurm cluster"), "{reasons:?}");
        assert!(reasons[2].contains("the default config"), "{reasons:?}");
        assert!(reasons[3].contains("no job 2"), "{reasons:?}");
        a.progress_refused();
        assert_eq!(a.progress_rejected, 5);
        assert_eq!(
            a.jobs["1"].log.last().map(|(_, count)| count),
            Some(1000.0),
            "only the two accepted reports counted: owner's 1000, then root's own counter from its first report"
        );
    }

    /// Issue 14 item 7: any local user read every job's id, uid, tier and throughput
    /// from the agent's status.
    #[test]
    fn a_user_sees_only_their_own_jobs_and_root_sees_all() {
        let mut a = agent(Some(Watts(2800.0)));
        a.register(0.0, "1", "0", 1000, "n1", &["0".into()], "flex1")
            .expect("job 1");
        a.register(
            0.0,
            "2",
            "0",
            1001,
            "n1",
            &["1".into(), "2".into()],
            "flex2",
        )
        .expect("job 2");
        // NVML lists job 1's process and one in no job on GPU 0, job 2's on GPU 1.
        a.nvml_processes_seen(
            1.0,
            &BTreeMap::from([
                (0, vec![(11, Some("1".to_string())), (99, None)]),
                (1, vec![(12, Some("2".to_string()))]),
            ]),
        );
        let all = a.snapshot(1.0);
        assert_eq!(all.gpus[0].processes.len(), 2, "root sees every process");
        let mine = super::seen_by(&all, 1000);
        assert_eq!(
            mine.gpus[0].processes,
            vec![GpuProcess {
                pid: 11,
                job: Some("1".into())
            }],
            "only the user's own jobs' processes"
        );
        assert!(mine.gpus[1].processes.is_empty());
        assert_eq!(
            mine.jobs.iter().map(|j| j.job.as_str()).collect::<Vec<_>>(),
            ["1"]
        );
        assert_eq!(mine.gpus.len(), 4, "the node's GPUs stay visible");
        assert_eq!(mine.gpus[0].job.as_deref(), Some("1"));
        assert!(
            mine.gpus[1..].iter().all(|g| g.job.is_none()),
            "{:?}",
            mine.gpus
        );
        assert!(super::seen_by(&all, 4242).jobs.is_empty());
        assert_eq!(super::seen_by(&all, 0), all);
        // Ended jobs' final shares are their owners' too.
        assert!(a.end_job("2", 2.0));
        let all = a.snapshot(2.0);
        assert_eq!(all.ended.len(), 1);
        assert!(super::seen_by(&all, 1000).ended.is_empty());
        assert_eq!(super::seen_by(&all, 1001).ended.len(), 1);
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

    /// Drives job "3" (flex3, GPUs 0-3) on a fake clock: two ranks report every 50 ms,
    /// each its own cumulative tokens (40 000 a step, a step every 50 ms), the second
    /// `lag_steps` steps behind the first and heard 10 ms after it. Returns the phase and
    /// the warm-up note after `seconds`.
    fn two_reporters(lag_steps: u64, seconds: f64) -> (Phase, Option<String>, Agent) {
        let mut a = agent(None);
        a.register(
            0.0,
            "3",
            "batch",
            0,
            "n1",
            &["0".into(), "1".into(), "2".into(), "3".into()],
            "flex3",
        )
        .expect("batch step");
        a.register(
            0.1,
            "3",
            "0",
            0,
            "n1",
            &["0".into(), "1".into(), "2".into(), "3".into()],
            "flex3",
        )
        .expect("step 0");
        a.set_lease(
            0.1,
            BTreeMap::from([("3".to_string(), Watts(700.0))]),
            3600.0,
            None,
        );
        let mut next_tick = 0.5;
        for k in 0..(seconds / 0.05) as u64 {
            let t = 0.2 + k as f64 * 0.05;
            a.progress(t, "3", 4101, 40_000 * (k + lag_steps), k + lag_steps)
                .expect("rank 0");
            if k >= lag_steps {
                a.progress(t + 0.01, "3", 4202, 40_000 * (k - lag_steps), k - lag_steps)
                    .expect("rank 1");
            }
            if t >= next_tick {
                a.tick(t);
                next_tick += 0.5;
            }
        }
        let job = &a.jobs["3"];
        (
            job.calibration.phase.clone(),
            job.calibration.waiting.clone(),
            a,
        )
    }

    /// The demo's job 3 stayed in warm-up on n2 for its whole 240 s wait: a second rank's
    /// reports, one step behind the first, reached the same agent, and every switch
    /// between the two made the count go backwards, which cleared the log, so it never
    /// held the five steady seconds warm-up waits for.
    #[test]
    fn two_ranks_reporting_to_one_agent_do_not_keep_the_job_in_warm_up() {
        for lag_steps in [1, 3, 0] {
            let (phase, waiting, a) = two_reporters(lag_steps, 60.0);
            let cal = &a.jobs["3"].calibration;
            assert!(
                cal.started_at.is_some_and(|t| t < 10.0),
                "lag {lag_steps}: the walk never started; {phase:?}: {waiting:?}"
            );
            assert_eq!(a.jobs["3"].log.reporters(60.0, 10.0), 2);
            assert_eq!(a.jobs["3"].log.restarts, 0, "no counter went backwards");
        }
    }

    /// A warm-up that has not ended says why, in status.
    #[test]
    fn a_job_in_warm_up_says_what_it_waits_for() {
        let mut a = agent(None);
        a.register(0.0, "9", "0", 0, "n1", &["0".into()], "flex3")
            .expect("registered");
        a.tick(1.0);
        let note = |a: &Agent| {
            a.snapshot(0.0)
                .jobs
                .iter()
                .find(|j| j.job == "9")
                .and_then(|j| j.calibration_note.clone())
                .unwrap_or_default()
        };
        assert_eq!(note(&a), "no progress report yet");
        // Reports every 50 ms whose rate halves and doubles every 1.5 s: never steady.
        let mut count = 0u64;
        for k in 0..200u64 {
            let t = 1.0 + k as f64 * 0.05;
            count += if (k / 30) % 2 == 0 { 100 } else { 50 };
            a.progress(t, "9", 77, count, k).expect("report");
            if k % 10 == 0 {
                a.tick(t);
            }
        }
        assert_eq!(a.jobs["9"].calibration.phase, Phase::Warmup);
        let why = note(&a);
        assert!(
            why.starts_with("waiting for steady progress: the rate varies"),
            "{why}"
        );
    }
}
