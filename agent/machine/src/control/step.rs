//! The agent's one entry point, [`Agent::step`]: the I/O edge hands it what it observed
//! as typed [`AgentInput`]s, with the time as a [`UnixMs`], and gets back an
//! [`AgentOutput`]: what to do, in the order to do it.
//!
//! Some inputs carry facts only the edge can read: a registration comes with the
//! processes NVML lists on the GPUs it names, a tick with the GPUs' readings. Which facts
//! is the machine's call, asked before the input is built ([`Agent::control_reads`],
//! [`Agent::reads_due`]; both pure queries), and the edge reads exactly those. What the
//! edge did with an output (cap writes, read-backs) comes back as the inputs of a
//! follow-up step ([`AgentInput::CapWrites`], [`AgentInput::GpuSamples`]).
//!
//! Time inside the machine is `f64` seconds since the Unix epoch (calibration rates and
//! holds are in seconds), taken from the step's `UnixMs` in [`seconds`] and nowhere else.

use std::collections::{BTreeMap, BTreeSet};

use powerflex_core::flex::parse_power_flex;
use powerflex_core::gpus::parse_gpu_list;
use powerflex_core::{UnixMs, Watts};
use powerflex_proto::report::GpuInfo;
use powerflex_proto::usage::{FinalRef, NodeUsage};
use powerflex_proto::{ControlAnswer, ControlOp, ControlReply, ProgressReport};
use tracing::{error, info, info_span, warn};

use super::{
    Action, Agent, AgentSettings, CapMismatch, ForeignGpuUse, LeaseMessage, LeaseRefused,
    ReportSender, Snapshot, ADOPTED_STEP, BATCH_STEP_NAME,
};
use crate::gpu::{GpuError, GpuSample};
use crate::saved::PersistedState;
use crate::{JobKey, MachineError};

/// The machine's seconds at `now`: the one place `f64` time is made from a [`UnixMs`].
fn seconds(now: UnixMs) -> f64 {
    now.as_secs_f64()
}

/// A GPU's reading by its index, or why it failed.
pub type GpuReading = (u32, Result<GpuSample, GpuError>);

/// How often a degraded GPU is read to see whether it works again, s.
const DEGRADED_PROBE_S: f64 = 10.0;

/// How often the process table is read for jobs whose step daemons are gone, s.
const JOB_SCAN_INTERVAL_S: f64 = 2.0;

/// How often the state (with every job's running accounting) is saved at least, s: an
/// agent killed without warning loses at most this much of the time-based shares (the
/// energy counters lose nothing).
const USAGE_SAVE_INTERVAL_S: f64 = 10.0;

/// One thing the edge observed, for [`Agent::step`].
#[derive(Debug, Clone)]
pub enum AgentInput {
    /// The agent starts: what the previous run left and what the host shows now. The
    /// first input of the first step, before anything is written.
    Start(Box<StartFacts>),
    /// A control request from root (the plugin's slurmstepd, the epilog), with the facts
    /// [`Agent::control_reads`] asked for. Answered with a [`Reply::Control`].
    Control { op: ControlOp, facts: ControlFacts },
    /// A progress report as it came off the progress socket, stamped when it arrived
    /// (throughput is measured between arrivals, not between steps). Answered with a
    /// [`Reply::Progress`].
    Progress {
        received: UnixMs,
        sender: ReportSender,
        report: ProgressReport,
    },
    /// A progress line the socket refused before it reached the machine (unreadable, or
    /// from a process in no Slurm step): counted with the refused reports.
    ProgressRefused { reason: String, uid: u32, pid: u32 },
    /// An authenticated lease from the controller for this node.
    Lease(LeaseMessage),
    /// The controller recorded these final shares.
    Acked(Vec<FinalRef>),
    /// The lowest per-GPU cap an announced grid event's plan needs for each of these jobs
    /// (the lease's `walk_to_w`): their walks reach down to it, so that the event's caps
    /// land where the job was measured (pre-positioning). Sent with the lease that
    /// carries it, before it.
    PrePosition(BTreeMap<String, Watts>),
    /// GPU readings: a tick's, or the read-backs an output asked for.
    GpuSamples(Vec<GpuReading>),
    /// What became of an output's cap writes, in its order.
    CapWrites(Vec<CapWriteResult>),
    /// The jobs whose step daemons the process table shows now.
    JobsOnHost(BTreeSet<JobKey>),
    /// What NVML lists on the GPUs now.
    GpuProcesses(GpuProcesses),
    /// A sample period: calibrations advance, the budget is split, caps reconciled. The
    /// edge sends it with the readings [`Agent::reads_due`] asked for, before it.
    Tick,
    /// The site config was re-read (SIGHUP), or why it could not be.
    Reload(Result<AgentSettings, MachineError>),
    /// The agent stops: every GPU keeps the limit in force (every GPU back to its default
    /// with `release_jobs`, decommissioning), the state saved.
    Stop { release_jobs: bool },
}

/// What the previous run left and what the host shows at the agent's start.
#[derive(Debug, Clone, Default)]
pub struct StartFacts {
    /// The state file; `None` when missing or set aside as unusable (what this node
    /// managed is then unknown, and the running jobs Slurm records a tier for are taken
    /// back: [`StartFacts::adoptable`]).
    pub saved: Option<PersistedState>,
    /// Every GPU read before anything is written: in controller mode these limits bound
    /// the caps until a current lease (fail-static through a restart), and they end the
    /// holds of jobs that ended while the agent was down.
    pub samples: Vec<GpuReading>,
    /// The jobs whose step daemons run on the host; `None` when the process table could
    /// not be read (then every saved job counts as ended).
    pub jobs_on_host: Option<BTreeSet<JobKey>>,
    /// GPUs NVML lists processes on now: a job that ended while the agent was down is not
    /// charged what they draw for another.
    pub busy_gpus: BTreeSet<u32>,
    /// Read only when `saved` is `None`: the jobs whose processes run on this node's GPUs
    /// (by ancestry) with the tier Slurm records for them.
    pub adoptable: Vec<AdoptionCandidate>,
}

/// A job running on this node's GPUs, as the edge found it after a lost state file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AdoptionCandidate {
    pub job_id: String,
    /// The cluster of its step daemons (their `SLURM_CONF`).
    pub cluster: Option<String>,
    /// The owner of its processes, as the kernel records it.
    pub uid: u32,
    /// The GPUs its processes run on, by index (from NVML).
    pub gpus: Vec<String>,
    /// The tier Slurm records for it on this node (its `AdminComment`), if any.
    pub recorded_tier: Option<String>,
}

/// The facts a control request comes with (see [`Agent::control_reads`]).
#[derive(Debug, Clone, Default)]
pub struct ControlFacts {
    /// The requesting process is a step daemon (`slurmstepd`) of this cluster (its
    /// `SLURM_CONF`; `None` inside: the default config); `None`: not a step daemon.
    pub stepd_cluster: Option<Option<String>>,
    /// The requesting process (for the log).
    pub peer_pid: u32,
    /// The jobs whose step daemons run on the host, when [`ControlReads::process_table`]
    /// asked for them and the table could be read.
    pub jobs_on_host: Option<BTreeSet<JobKey>>,
    /// Per GPU of [`ControlReads::gpu_users`] whose processes NVML could list: the jobs
    /// they belong to, by ancestry (processes in no job left out).
    pub gpu_users: BTreeMap<u32, BTreeSet<JobKey>>,
    /// The readings of [`ControlReads::samples`].
    pub samples: Vec<GpuReading>,
}

/// What the edge reads before it hands the machine a control request.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ControlReads {
    /// The host's process table (its live jobs): a registration from a step daemon
    /// names GPUs another job holds, which may have ended with its end lost. Read only
    /// then: it is most of a registration's work, and slurmstepd waits for the answer.
    pub process_table: bool,
    /// GPUs whose processes NVML is asked for, each mapped to its job by ancestry.
    pub gpu_users: Vec<u32>,
    /// GPUs to read: a job's hold (and its energy) starts or ends now.
    pub samples: Vec<u32>,
}

/// What the edge reads for a tick (see [`Agent::reads_due`]).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TickReads {
    /// GPUs to read (degraded ones only now and then, to see whether they answer again).
    pub gpus: Vec<u32>,
    /// Read the process table ([`AgentInput::JobsOnHost`]) and list the processes on
    /// [`TickReads::gpu_processes`] ([`AgentInput::GpuProcesses`]).
    pub process_table: bool,
    /// GPUs whose processes to list (the ones not degraded).
    pub gpu_processes: Vec<u32>,
}

/// What NVML lists on the GPUs, read at one scan.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct GpuProcesses {
    /// Per GPU that NVML lists processes of Slurm jobs on, those jobs (processes in no
    /// job left out).
    pub jobs: BTreeMap<u32, BTreeSet<JobKey>>,
    /// Per GPU NVML could list, every process on it and the job it belongs to.
    pub processes: BTreeMap<u32, Vec<(u32, Option<String>)>>,
}

/// A limit to write (already clamped to the GPU's range).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct CapWrite {
    pub gpu: u32,
    pub cap: Watts,
}

/// What became of a [`CapWrite`]: the limit read just before it (`None` when it could
/// not be read), or why it failed.
#[derive(Debug, Clone, PartialEq)]
pub struct CapWriteResult {
    pub gpu: u32,
    pub cap: Watts,
    pub outcome: Result<Option<Watts>, GpuError>,
}

/// The answer to one input, by its index in the step's inputs.
#[derive(Debug, Clone, PartialEq)]
pub enum Reply {
    /// To an [`AgentInput::Control`] (boxed: a reply with a final share is large,
    /// progress verdicts are small and frequent).
    Control(Box<ControlReply>),
    /// To an [`AgentInput::Progress`]: accepted, or why not (sent to the reporter).
    Progress(Result<(), MachineError>),
    /// To an [`AgentInput::Lease`]: applied, or why not (the link tells the controller).
    Lease(Result<(), LeaseRefused>),
}

/// What one [`Agent::step`] asks the edge to do, in this order:
/// 1. `cap_writes`, then 2. `read_back` (their results are the inputs of a follow-up
///    step, [`AgentInput::CapWrites`] then [`AgentInput::GpuSamples`]);
/// 3. `persist` the state; 4. append `records` to the usage log (the state saved first
///    keeps them until the controller acknowledges them);
/// 5. send `replies` (a registration is answered once its GPUs are capped: slurmstepd
///    starts the tasks after it); 6. publish `snapshot`.
#[derive(Debug, Clone, Default)]
pub struct AgentOutput {
    pub cap_writes: Vec<CapWrite>,
    /// GPUs to read back after the writes: the controller holds other nodes' increases
    /// until this node's decreases are confirmed, so a lease's are read at once.
    pub read_back: Vec<u32>,
    pub persist: Option<PersistedState>,
    /// Final shares of jobs ended since the last step.
    pub records: Vec<NodeUsage>,
    pub replies: Vec<(usize, Reply)>,
    /// The status to publish; `None` while nothing a reader needs changed, or while cap
    /// writes are out (the follow-up step publishes what the GPUs enforce).
    pub snapshot: Option<Snapshot>,
}

impl AgentOutput {
    /// Adds the machine's cap writes (a later write to a GPU replaces an earlier one of
    /// this step); returns whether the state is to be saved.
    fn take(&mut self, actions: Vec<Action>) -> bool {
        let mut persist = false;
        for action in actions {
            match action {
                Action::SetCap { gpu, cap } => {
                    match self.cap_writes.iter_mut().find(|w| w.gpu == gpu) {
                        Some(w) => w.cap = cap,
                        None => self.cap_writes.push(CapWrite { gpu, cap }),
                    }
                }
                Action::Persist => persist = true,
            }
        }
        persist
    }
}

/// When the edge next reads for a tick, agent seconds.
#[derive(Debug, Clone)]
pub(super) struct Timers {
    next_sample: f64,
    next_probe: f64,
    next_job_scan: f64,
    next_usage_save: f64,
}

impl Timers {
    pub(super) fn starting_at(now: f64) -> Timers {
        Timers {
            next_sample: now,
            next_probe: now + DEGRADED_PROBE_S,
            next_job_scan: now,
            next_usage_save: now + USAGE_SAVE_INTERVAL_S,
        }
    }
}

/// Logs a limit found changed behind the agent's back (`then`: what the agent does).
fn log_mismatch(m: &CapMismatch, mismatches: u64, then: &str) {
    warn!(
        gpu = m.gpu,
        expected_w = m.expected.0,
        found_w = m.found.0,
        mismatches,
        then,
        "GPU limit changed behind the agent's back"
    );
}

impl Agent {
    /// Takes a batch of inputs at `now`, in order, and answers with what the edge must
    /// do (see [`AgentOutput`] for the order).
    pub fn step(&mut self, now: UnixMs, inputs: Vec<AgentInput>) -> AgentOutput {
        let now = seconds(now);
        let mut out = AgentOutput::default();
        let mut persist = false;
        let mut publish = false;
        for (index, input) in inputs.into_iter().enumerate() {
            match input {
                AgentInput::Start(facts) => {
                    self.start(now, *facts);
                    persist = true;
                    publish = true;
                }
                AgentInput::Control { op, facts } => {
                    let reply = self.control(now, op, facts, &mut out, &mut persist);
                    out.replies.push((index, Reply::Control(Box::new(reply))));
                    publish = true;
                }
                AgentInput::Progress {
                    received,
                    sender,
                    report,
                } => {
                    let verdict = self.report_progress(seconds(received), &sender, &report);
                    if let Err(e) = &verdict {
                        warn!(job_id = %report.job_id, pid = sender.pid, uid = sender.uid, error = %e, "progress report refused");
                    }
                    out.replies.push((index, Reply::Progress(verdict)));
                }
                AgentInput::ProgressRefused { reason, uid, pid } => {
                    self.progress_refused();
                    warn!(pid, uid, error = %reason, "progress report refused");
                }
                AgentInput::Lease(lease) => {
                    if let Err(refused) = self.check_epoch(lease.epoch) {
                        self.leases_refused_epoch += 1;
                        warn!(
                            lease_epoch = lease.epoch,
                            accepted_epoch = self.accepted_epoch,
                            refused = self.leases_refused_epoch,
                            "lease refused: its controller lost leadership to a later one (fenced)"
                        );
                        out.replies.push((index, Reply::Lease(Err(refused))));
                        publish = true;
                        continue;
                    }
                    if lease.epoch > self.accepted_epoch {
                        info!(
                            epoch = lease.epoch,
                            previous_epoch = self.accepted_epoch,
                            "a controller of a new leadership epoch steers this node"
                        );
                    }
                    out.replies.push((index, Reply::Lease(Ok(()))));
                    info!(
                        jobs = lease.caps.len(),
                        ttl_s = lease.ttl_s,
                        start_cap_w = lease.start_cap.map(|w| w.0),
                        "lease from the controller"
                    );
                    // Written now rather than at the next tick, and the written limits
                    // read back: the controller holds other nodes' increases until this
                    // node's decreases are confirmed.
                    let actions = self.apply_lease(now, lease);
                    for action in &actions {
                        if let Action::SetCap { gpu, .. } = action {
                            if !out.read_back.contains(gpu) {
                                out.read_back.push(*gpu);
                            }
                        }
                    }
                    out.take(actions);
                    // A restarted agent resumes this lease (see `PersistedLease`).
                    persist = true;
                    publish = true;
                }
                AgentInput::PrePosition(caps) => {
                    if self.pre_position(now, &caps) {
                        publish = true;
                    }
                }
                AgentInput::Acked(finals) => {
                    let dropped = self.acked(&finals);
                    if dropped > 0 {
                        info!(
                            acknowledged = dropped,
                            left = self.unacked.len(),
                            "the controller recorded this node's final shares"
                        );
                        persist = true;
                    }
                }
                AgentInput::GpuSamples(readings) => self.gpu_samples(now, readings),
                AgentInput::CapWrites(results) => self.cap_writes_done(now, results),
                AgentInput::JobsOnHost(alive) => {
                    for job_id in self.jobs_alive(now, &alive) {
                        warn!(job_id = %job_id, grace_s = self.settings.job_end_grace_s, "the job's step daemons are gone and its end never arrived; ending it");
                    }
                }
                AgentInput::GpuProcesses(listed) => {
                    self.nvml_processes_seen(now, &listed.processes);
                    for r in self.check_gpu_use(now, &listed) {
                        warn!(gpu = r.gpu, job_id = %r.holder, used_by = ?r.used_by, "other jobs' processes use this job's GPU; it stays the job's, capped as the job is");
                    }
                }
                AgentInput::Tick => {
                    self.advance_timers(now);
                    let actions = self.tick(now);
                    persist |= out.take(actions);
                    if now >= self.timers.next_usage_save && !self.jobs.is_empty() {
                        self.timers.next_usage_save = now + USAGE_SAVE_INTERVAL_S;
                        persist = true;
                    }
                    publish = true;
                }
                AgentInput::Reload(reload) => {
                    match self.reload(reload) {
                        Ok(()) => info!(
                            failsafe_cap_w = self.settings.failsafe_cap.0,
                            lease_ttl_s = self.settings.lease_ttl_s,
                            "site config reloaded"
                        ),
                        Err(e) => {
                            error!(error = %e, "site config reload refused; the settings in force stay")
                        }
                    }
                    publish = true;
                }
                AgentInput::Stop { release_jobs } => {
                    let actions = self.stop_actions(release_jobs);
                    if release_jobs {
                        info!(
                            "shutting down: restoring every GPU's default cap (--release-on-exit)"
                        );
                    } else {
                        info!("shutting down: every GPU keeps the limit in force for the next agent (fail-static)");
                    }
                    out.take(actions);
                    persist = true;
                }
            }
        }
        out.records = self.take_records();
        for share in &out.records {
            info!(
                job_id = %share.job_id,
                energy_j = share.energy_mj as f64 / 1000.0,
                source = share.energy_source.name(),
                gpus = share.gpus.len(),
                capped_s = share.capped_s,
                "job's final share on this node"
            );
        }
        // The records are kept in the state until the controller acknowledges them: it
        // is saved before they are appended, so a crash right after a job's end loses
        // none.
        if persist || !out.records.is_empty() {
            out.persist = Some(self.saved_state());
        }
        if !out.cap_writes.is_empty() || !out.read_back.is_empty() {
            self.publish_owed |= publish;
        } else if publish || std::mem::take(&mut self.publish_owed) {
            out.snapshot = Some(self.snapshot(now));
        }
        out
    }

    /// What the edge reads before it hands the machine `op` from a peer that is
    /// (`from_stepd`) or is not a step daemon.
    pub fn control_reads(&self, op: &ControlOp, from_stepd: bool) -> ControlReads {
        match op {
            ControlOp::Register { job_id, gpus, .. } => {
                let named: Vec<u32> = parse_gpu_list(&gpus.join(","))
                    .map(|refs| {
                        refs.iter()
                            .filter_map(|r| self.slot_of(r).map(|i| i as u32))
                            .collect()
                    })
                    .unwrap_or_default();
                let mut samples = self
                    .jobs
                    .get(job_id)
                    .map(|j| j.gpus.clone())
                    .unwrap_or_default();
                for &g in &named {
                    if !samples.contains(&g) {
                        samples.push(g);
                    }
                }
                samples.retain(|&g| self.gpus[g as usize].degraded.is_none());
                ControlReads {
                    process_table: from_stepd && self.gpus_held_by_others(job_id, gpus),
                    gpu_users: named,
                    samples,
                }
            }
            ControlOp::EndStep { job_id, step_id } if step_id == BATCH_STEP_NAME => ControlReads {
                samples: self.readable_gpus_of(job_id),
                ..ControlReads::default()
            },
            ControlOp::EndJob { job_id } => ControlReads {
                samples: self.readable_gpus_of(job_id),
                ..ControlReads::default()
            },
            ControlOp::EndStep { .. } | ControlOp::Status => ControlReads::default(),
        }
    }

    /// What the edge reads for a tick at `now`; `None` before the next sample is due.
    pub fn reads_due(&self, now: UnixMs) -> Option<TickReads> {
        let now = seconds(now);
        if now < self.timers.next_sample {
            return None;
        }
        // Degraded GPUs are probed now and then, not every sample: a GPU that answers
        // again (a fault cleared, a permission fixed) is managed again.
        let probe = now >= self.timers.next_probe;
        let healthy: Vec<u32> = (0..self.gpus.len() as u32)
            .filter(|&g| self.gpus[g as usize].degraded.is_none())
            .collect();
        Some(TickReads {
            gpus: if probe {
                (0..self.gpus.len() as u32).collect()
            } else {
                healthy.clone()
            },
            process_table: now >= self.timers.next_job_scan,
            gpu_processes: healthy,
        })
    }

    /// How many GPUs the agent manages (indices `0..gpu_count()`).
    pub fn gpu_count(&self) -> usize {
        self.gpus.len()
    }

    /// The node's GPUs as the controller link announces them (the default being the
    /// saved one: a cap a crashed run left is not the default).
    pub fn gpu_infos(&self) -> Vec<GpuInfo> {
        self.gpus
            .iter()
            .map(|g| GpuInfo {
                uuid: g.identity.uuid.clone(),
                name: g.identity.name.clone(),
                min_w: g.identity.min_cap.0,
                max_w: g.identity.max_cap.0,
                default_w: g.saved_default.0,
            })
            .collect()
    }

    /// The node this agent serves.
    pub fn node(&self) -> &str {
        &self.settings.node
    }

    fn readable_gpus_of(&self, job_id: &str) -> Vec<u32> {
        self.jobs
            .get(job_id)
            .map(|j| j.gpus.clone())
            .unwrap_or_default()
            .into_iter()
            .filter(|&g| self.gpus[g as usize].degraded.is_none())
            .collect()
    }

    /// The tick's timers at `now`: the sample, the probe of degraded GPUs and the scan of
    /// the process table each come round again after their period.
    fn advance_timers(&mut self, now: f64) {
        let t = &mut self.timers;
        t.next_sample = now + self.sample_interval_ms as f64 / 1000.0;
        if now >= t.next_probe {
            t.next_probe = now + DEGRADED_PROBE_S;
        }
        if now >= t.next_job_scan {
            t.next_job_scan = now + JOB_SCAN_INTERVAL_S;
        }
    }

    /// Readings of a tick or of read-backs.
    fn gpu_samples(&mut self, now: f64, readings: Vec<GpuReading>) {
        for (gpu, reading) in readings {
            let degraded = self
                .gpus
                .get(gpu as usize)
                .is_some_and(|g| g.degraded.is_some());
            match &reading {
                Err(e) if !degraded => {
                    warn!(gpu, error = %e, class = ?e.class, "GPU reading failed")
                }
                Ok(_) if degraded => info!(gpu, "degraded GPU answers again; managing it"),
                _ => {}
            }
            if let Some(m) = self.sampled(now, gpu, reading) {
                log_mismatch(&m, self.cap_mismatches, "writing it again");
            }
        }
    }

    /// The results of an output's cap writes.
    fn cap_writes_done(&mut self, now: f64, results: Vec<CapWriteResult>) {
        for r in results {
            match r.outcome {
                Ok(found) => {
                    let job = self.gpus.get(r.gpu as usize).and_then(|g| g.job.clone());
                    info!(
                        gpu = r.gpu,
                        cap_w = r.cap.0,
                        job = job.as_deref().unwrap_or("-"),
                        "cap applied"
                    );
                    if let Some(m) = self.cap_written(now, r.gpu, r.cap, found) {
                        log_mismatch(&m, self.cap_mismatches, "found as a new cap was written");
                    }
                }
                Err(e) => {
                    warn!(gpu = r.gpu, cap_w = r.cap.0, error = %e, class = ?e.class, "cap not applied");
                    self.cap_failed(&e);
                }
            }
        }
    }

    /// A control request, answered.
    fn control(
        &mut self,
        now: f64,
        op: ControlOp,
        facts: ControlFacts,
        out: &mut AgentOutput,
        persist: &mut bool,
    ) -> ControlReply {
        match op {
            ControlOp::Register {
                job_id,
                step_id,
                uid,
                node,
                gpus,
                flex,
            } => self.register_step(
                now,
                Registration {
                    job_id: &job_id,
                    step_id: &step_id,
                    uid,
                    node: &node,
                    gpus: &gpus,
                    flex: &flex,
                },
                facts,
                out,
                persist,
            ),
            ControlOp::EndStep { job_id, step_id } => {
                // The batch script's end makes the job's final share here (see
                // `Agent::end_step`): its energy is read up to now.
                self.apply_samples(now, &job_id, facts.samples);
                match self.end_step(&job_id, &step_id, now) {
                    Ok(ended_share) => {
                        info!(
                            job_id = %job_id,
                            step_id = %step_id,
                            job_ended = ended_share.is_some(),
                            "step ended"
                        );
                        *persist = true;
                        ControlReply::Done(ended_share.map_or(ControlAnswer::Empty, |share| {
                            ControlAnswer::StepEnded(Box::new(share))
                        }))
                    }
                    Err(e) => ControlReply::error(e.to_string()),
                }
            }
            ControlOp::EndJob { job_id } => {
                // The job's hold (and its energy) ends now.
                self.apply_samples(now, &job_id, facts.samples);
                let known = self.end_job(&job_id, now);
                info!(job_id = %job_id, known, "job ended; its GPUs return to default");
                *persist = true;
                ControlReply::ok()
            }
            ControlOp::Status => ControlReply::ok(),
        }
    }

    /// Readings of `job_id`'s GPUs taken for this request (its hold starts or ends now);
    /// a GPU no longer the job's is not read for it.
    fn apply_samples(&mut self, now: f64, job_id: &str, samples: Vec<GpuReading>) {
        let gpus = self
            .jobs
            .get(job_id)
            .map(|j| j.gpus.clone())
            .unwrap_or_default();
        for (gpu, reading) in samples {
            if gpus.contains(&gpu) && self.gpus[gpu as usize].degraded.is_none() {
                self.sampled(now, gpu, reading);
            }
        }
    }

    /// A step registers (from its slurmstepd, root): a job holding its GPUs with no step
    /// daemon left is ended (its end was lost), the job registered, other jobs' processes
    /// already on its GPUs noted as foreign use, its GPUs read (its hold starts now) and
    /// capped before the answer, since slurmstepd starts the tasks after it.
    fn register_step(
        &mut self,
        now: f64,
        step: Registration<'_>,
        facts: ControlFacts,
        out: &mut AgentOutput,
        persist: &mut bool,
    ) -> ControlReply {
        let Registration {
            job_id,
            step_id,
            uid,
            node,
            gpus,
            flex,
        } = step;
        let span = info_span!("job", job_id = %job_id);
        let _e = span.enter();
        // A live step daemon registers: a job holding these GPUs with no step daemon
        // left has ended (its end lost), and Slurm moved its GPUs on.
        if facts.stepd_cluster.is_some() {
            if let Some(alive) = &facts.jobs_on_host {
                for ended in self.hand_over_from_ended_jobs(now, job_id, gpus, alive) {
                    warn!(ended_job = %ended, step_id = %step_id, "a job holding these GPUs has no step daemon left (its end was lost); ended, its GPUs go to this job");
                }
            }
        }
        // Other jobs' processes already on a GPU this step names (a stray process of an
        // ended job, a debugger, a job run unmanaged) do not make the GPU theirs: the
        // names come from the variable slurmstepd writes for the step, so Slurm gave the
        // GPU to this job, and refusing it would leave the job running at the default.
        let foreign =
            self.other_jobs_on_claimed_gpus(job_id, gpus, &facts.stepd_cluster, &facts.gpu_users);
        let outcome = self.register(now, job_id, step_id, uid, node, gpus, flex);
        if outcome.is_ok() {
            for r in self.note_foreign_use_at_registration(foreign) {
                warn!(step_id = %step_id, gpu = r.gpu, used_by = ?r.used_by, "other jobs' processes already use a GPU Slurm gave this job; it is the job's, capped as the job is");
            }
        }
        match outcome {
            Ok(r) => {
                // The registering peer is the step's slurmstepd (root): its cluster tells
                // this job apart from same-numbered jobs of other clusters.
                if let Some(cluster) = facts.stepd_cluster {
                    self.set_job_cluster(job_id, cluster, now);
                }
                info!(step_id = %step_id, uid, tier = %r.tier, gpus = ?gpus, pid = facts.peer_pid, "step registered");
                // The job's hold of its GPUs (and its energy) starts now.
                self.apply_samples(now, job_id, facts.samples);
                // Capped before the answer: slurmstepd starts the tasks after this reply,
                // so they never run above the cap the job is granted (the fail-safe until
                // the controller has allocated it).
                let actions = self.tick(now);
                out.take(actions);
                *persist = true;
                ControlReply::Done(ControlAnswer::Registered {
                    tier: Some(r.tier),
                    progress: r.progress,
                })
            }
            Err(e) => {
                warn!(step_id = %step_id, error = %e, "registration refused");
                ControlReply::error(e.to_string())
            }
        }
    }

    /// The GPUs a registration of `job_id` names on which NVML lists processes of other
    /// jobs (`users`, by their ancestry), with those jobs. Processes in no job, and GPUs
    /// NVML cannot list, are left out: nothing is known of them.
    fn other_jobs_on_claimed_gpus(
        &self,
        job_id: &str,
        gpus: &[String],
        cluster: &Option<Option<String>>,
        users: &BTreeMap<u32, BTreeSet<JobKey>>,
    ) -> Vec<ForeignGpuUse> {
        let Ok(refs) = parse_gpu_list(&gpus.join(",")) else {
            return Vec::new();
        };
        let mine = |k: &JobKey| k.0 == job_id && cluster.as_ref().is_none_or(|c| &k.1 == c);
        refs.iter()
            .filter_map(|r| {
                let gpu = self.slot_of(r)? as u32;
                let others: Vec<String> = users
                    .get(&gpu)?
                    .iter()
                    .filter(|k| !mine(k))
                    .map(|(job, _)| job.clone())
                    .collect();
                (!others.is_empty()).then(|| ForeignGpuUse {
                    gpu,
                    holder: job_id.to_string(),
                    used_by: others,
                })
            })
            .collect()
    }

    /// The agent as it starts: the saved defaults, the GPUs' first readings, the
    /// previous run's jobs reconciled with what runs now (after a lost state file, the
    /// running jobs Slurm records a tier for taken back), the previous lease resumed.
    fn start(&mut self, now: f64, facts: StartFacts) {
        let StartFacts {
            saved,
            samples,
            jobs_on_host,
            busy_gpus,
            adoptable,
        } = facts;
        let state_lost = saved.is_none();
        if let Some(saved) = &saved {
            for slot in &mut self.gpus {
                if let Some(&default) = saved.saved_defaults.get(&slot.identity.uuid) {
                    slot.saved_default = default;
                }
                // Held by another power manager before the restart: still left to it.
                if let Some(&counted) = saved.owned_elsewhere.get(&slot.identity.uuid) {
                    slot.owned_elsewhere = Some(super::OwnedElsewhere {
                        since: now,
                        counted,
                    });
                }
            }
        }
        // Every GPU's limit is read before anything is written: in controller mode it
        // bounds the caps until a current lease arrives (fail-static through a restart).
        for (gpu, reading) in samples {
            self.sampled(now, gpu, reading);
        }
        info!(
            gpus = self.gpus.len(),
            mode = if self.controller_mode() {
                "controller"
            } else {
                "standalone"
            },
            "agent started"
        );
        let (saved_jobs, saved_finals, saved_lease, saved_epoch) = saved
            .map(|s| (s.jobs, s.unacked_finals, s.lease, s.controller_epoch))
            .unwrap_or_default();
        // Fencing survives a restart: a controller that lost leadership before it
        // stays refused.
        self.accepted_epoch = saved_epoch;
        // Final shares the controller had not acknowledged: re-sent from now on.
        self.unacked = saved_finals;
        // Jobs still running keep their GPUs; every other GPU goes back to its saved
        // default on the first tick. Whether a job still runs is what the host's step
        // daemons say, never a process's own environment.
        let busy: BTreeSet<String> = busy_gpus
            .iter()
            .filter_map(|&g| self.gpus.get(g as usize))
            .map(|g| g.identity.uuid.clone())
            .collect();
        // A process table that could not be read says nothing about which jobs ended:
        // every saved job is kept (its GPUs at the limits read back) until a tick reads
        // the table, rather than all released to their defaults as if none ran.
        let table_read = jobs_on_host.is_some();
        let live = match jobs_on_host {
            Some(live) => live,
            None => {
                warn!(
                    jobs = saved_jobs.len(),
                    "the host's step daemons could not be read at start: every job of the previous run is kept until they can be"
                );
                saved_jobs
                    .iter()
                    .map(|j| (j.job_id.clone(), j.cluster.clone()))
                    .collect()
            }
        };
        self.restore_saved_jobs(now, now, saved_jobs, &live, &busy);
        if !table_read {
            // Kept unseen: counted as seen now, so the first tick that reads the table
            // ends those that are gone (after the grace), rather than holding their GPUs
            // until a new job claims them.
            for id in live.iter().map(|(id, _)| id) {
                if let Some(job) = self.jobs.get_mut(id) {
                    job.seen_alive_at = Some(now);
                }
            }
        }
        if state_lost {
            self.adopt(now, adoptable);
        }
        // The previous run's lease, while it lasts, keeps the restored jobs at their
        // caps; once run out it still bounds the fail-safe (which never raises a job
        // above its last grant).
        if let Some(lease) = saved_lease {
            let left_s = lease.expires_unix_s - now;
            info!(
                jobs = lease.caps.len(),
                left_s = left_s.max(0.0),
                "resuming the previous run's lease"
            );
            self.restore_saved_lease(now, lease.caps, left_s, lease.start_cap_w.map(Watts));
        }
    }

    /// After a lost state file (missing, or set aside as corrupt): the jobs running on
    /// this node's GPUs, taken back as managed under the tier Slurm records for them (the
    /// controller's `AdminComment`, admins' only), rather than release their caps. Never
    /// on a normal restart (a job the saved state does not list was not managed), never
    /// under a tier Slurm does not record, never from the job's environment.
    fn adopt(&mut self, now: f64, candidates: Vec<AdoptionCandidate>) {
        let node = self.settings.node.clone();
        for job in candidates {
            if self.jobs.contains_key(&job.job_id) {
                continue;
            }
            let recorded = job
                .recorded_tier
                .filter(|t| parse_power_flex(t, &self.settings.tiers).is_ok());
            let Some(tier) = recorded else {
                warn!(job_id = %job.job_id, gpus = ?job.gpus, "job running on this node's GPUs without a record, and Slurm records no powerflex tier for it here; not taken back (its GPUs keep the limit they read back)");
                continue;
            };
            match self.register(
                now,
                &job.job_id,
                ADOPTED_STEP,
                job.uid,
                &node,
                &job.gpus,
                &tier,
            ) {
                Ok(_) => {
                    self.set_job_cluster(&job.job_id, job.cluster.clone(), now);
                    warn!(job_id = %job.job_id, gpus = ?job.gpus, tier, source = "Slurm's AdminComment", "job running on this node's GPUs without a record (state file lost); managing it again")
                }
                Err(e) => warn!(job_id = %job.job_id, error = %e, "cannot take back a running job"),
            }
        }
    }
}

/// What a step's registration names.
struct Registration<'a> {
    job_id: &'a str,
    step_id: &'a str,
    uid: u32,
    node: &'a str,
    gpus: &'a [String],
    flex: &'a str,
}
