//! One node's agent machine, driven as `powerflexd`'s edge (`agent/src/run.rs` and
//! `agent/src/link.rs`) drives it: the only module of this crate that calls the agent's
//! machine, through a small interface of its own, so that the agent's coming single
//! `step(now, inputs) -> outputs` replaces the calls here and nothing else.
//!
//! Mirrored from the edge: the start (every GPU read before anything is written, the
//! saved jobs taken back when their step daemons still run, the saved lease resumed),
//! registrations (the job's GPUs read and capped before the answer), progress through the
//! sender checks, leases written at once and read back, the sample tick, the scan of live
//! jobs every two seconds, ends, acknowledgements, the report built from the status
//! snapshot, and a save wherever the edge saves. Not modelled: NVML's process lists (GPU
//! claims, unregistered use), adoption of jobs from Slurm's record after a lost state
//! file, degraded GPUs, reloads.

use std::collections::{BTreeMap, BTreeSet};

use powerflex_agent_machine::calibration::CalibrationSettings;
use powerflex_agent_machine::control::{
    Action, Agent, AgentSettings, LeaseMessage, ReportSender, Snapshot,
};
use powerflex_agent_machine::gpu::GpuIdentity;
use powerflex_agent_machine::saved::PersistedState;
use powerflex_agent_machine::JobKey;
use powerflex_core::config::SiteConfig;
use powerflex_core::Watts;
use powerflex_proto::report::{GpuInfo, JobReport, MAX_ENDED_PER_REPORT};
use powerflex_proto::usage::FinalRef;
use powerflex_proto::ProgressReport;

use crate::link::{LeaseBody, NodeReport};
use crate::physics::{h200, NodeGpus};
use crate::HarnessError;

/// The agent's state file: what a restart with its state loads.
pub type Disk = PersistedState;

/// How often the edge looks for jobs whose step daemons are gone, ms (`run.rs`).
const JOB_SCAN_INTERVAL_MS: u64 = 2_000;
/// How often the edge saves the state while jobs run, ms (`run.rs`).
const USAGE_SAVE_INTERVAL_MS: u64 = 10_000;

/// The agent's settings from the site config, as `powerflexd` reads them for its GPUs.
pub fn settings(site: &SiteConfig, node: &str) -> Result<AgentSettings, HarnessError> {
    let model = site
        .gpu_model_for(h200::NAME)
        .ok_or_else(|| HarnessError::Site(format!("no GPU model matches {}", h200::NAME)))?;
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
        progress_address: "harness".to_string(),
        job_end_grace_s: site.agent.job_end_grace_s,
        enforce: site.agent.enforce,
        unregistered_gpu_use: site.agent.unregistered_gpu_use,
    })
}

/// What the edge must do after a call.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[must_use]
pub struct Effects {
    /// Save the state now.
    pub save: bool,
    /// Send a report now (a lease was applied: the controller waits for its caps).
    pub report: bool,
}

/// One node's agent.
#[derive(Debug)]
pub struct NodeAgent {
    agent: Agent,
    /// Site ms at the agent's start: the agent's clock (seconds from here) is monotonic,
    /// whatever the node's wall clock does.
    started_ms: u64,
    leases_reported: u64,
    turn: usize,
    next_scan_ms: u64,
    next_usage_save_ms: u64,
}

impl NodeAgent {
    /// The agent starting at `now_ms` on `gpus`, the node's wall clock reading `wall_ms`,
    /// from `disk` (none: no state file); `live` are the jobs whose step daemons run on
    /// the node now.
    pub fn start(
        settings: AgentSettings,
        gpus: &mut NodeGpus,
        disk: Option<&Disk>,
        live: &BTreeSet<String>,
        sample_interval_ms: u64,
        now_ms: u64,
        wall_ms: u64,
    ) -> NodeAgent {
        let identities: Vec<GpuIdentity> = gpus
            .gpus
            .iter()
            .enumerate()
            .map(|(i, g)| GpuIdentity {
                index: i as u32,
                uuid: g.uuid.clone(),
                name: h200::NAME.to_string(),
                min_cap: Watts(h200::MIN_CAP_W),
                max_cap: Watts(h200::MAX_CAP_W),
                default_cap: Watts(h200::DEFAULT_CAP_W),
                simulated: true,
            })
            .collect();
        let saved_defaults: BTreeMap<String, Watts> =
            disk.map(|d| d.saved_defaults.clone()).unwrap_or_default();
        let mut agent = Agent::new(settings, identities, &saved_defaults, 0.0);
        agent.clock_origin_unix_s = wall_ms as f64 / 1000.0;
        agent.sample_interval_ms = sample_interval_ms;
        let mut node = NodeAgent {
            agent,
            started_ms: now_ms,
            leases_reported: 0,
            turn: 0,
            next_scan_ms: now_ms,
            next_usage_save_ms: now_ms + USAGE_SAVE_INTERVAL_MS,
        };
        // Every limit read before anything is written: it bounds the caps until a current
        // lease arrives (fail-static through a restart).
        node.sample_all(gpus, now_ms);
        if let Some(disk) = disk {
            node.agent.unacked = disk.unacked_finals.clone();
            let keys: BTreeSet<JobKey> = live.iter().map(|j| (j.clone(), None)).collect();
            // Every GPU of a live job runs its processes: not charged to an ended one.
            let busy: BTreeSet<String> = disk
                .jobs
                .iter()
                .filter(|j| live.contains(&j.job_id))
                .flat_map(|j| j.gpus.iter().cloned())
                .collect();
            node.agent
                .restore_saved_jobs(0.0, 0.0, disk.jobs.clone(), &keys, &busy);
            if let Some(lease) = &disk.lease {
                let left_s = lease.expires_unix_s - wall_ms as f64 / 1000.0;
                node.agent.restore_saved_lease(
                    0.0,
                    lease.caps.clone(),
                    left_s,
                    lease.start_cap_w.map(Watts),
                );
            }
        }
        node
    }

    fn now_s(&self, now_ms: u64) -> f64 {
        now_ms.saturating_sub(self.started_ms) as f64 / 1000.0
    }

    fn sample_all(&mut self, gpus: &mut NodeGpus, now_ms: u64) {
        let now = self.now_s(now_ms);
        for g in 0..gpus.gpus.len() as u32 {
            if let Some(sample) = gpus.read(g, now_ms) {
                let _ = self.agent.sampled(now, g, Ok(sample));
            }
        }
    }

    fn sample_job(&mut self, gpus: &mut NodeGpus, job_id: &str, now_ms: u64) {
        let now = self.now_s(now_ms);
        let mine: Vec<u32> = self
            .agent
            .jobs
            .get(job_id)
            .map(|j| j.gpus.clone())
            .unwrap_or_default();
        for g in mine {
            if let Some(sample) = gpus.read(g, now_ms) {
                let _ = self.agent.sampled(now, g, Ok(sample));
            }
        }
    }

    /// Executes the machine's actions on the GPUs; returns the GPUs written.
    fn execute(
        &mut self,
        actions: Vec<Action>,
        gpus: &mut NodeGpus,
        now_ms: u64,
    ) -> (Vec<u32>, bool) {
        let mut written = Vec::new();
        let mut save = false;
        for action in actions {
            match action {
                Action::SetCap { gpu, cap } => {
                    if let Some(found) = gpus.write(gpu, now_ms, cap.0) {
                        let _ = self.agent.cap_written(gpu, cap, Some(Watts(found)));
                        written.push(gpu);
                    }
                }
                Action::Persist => save = true,
            }
        }
        (written, save)
    }

    /// A job's step registers from its step daemon: refused, or registered with its GPUs
    /// read and capped before the answer.
    pub fn register(
        &mut self,
        gpus: &mut NodeGpus,
        now_ms: u64,
        job_id: &str,
        uid: u32,
        job_gpus: &[u32],
        flex: &str,
    ) -> Result<Effects, String> {
        let now = self.now_s(now_ms);
        let node = self.agent.settings.node.clone();
        let names: Vec<String> = job_gpus.iter().map(u32::to_string).collect();
        self.agent
            .register(now, job_id, "0", uid, &node, &names, flex)?;
        // Registered by a live step daemon of the site's one cluster.
        self.agent.set_job_cluster(job_id, None, now);
        self.sample_job(gpus, job_id, now_ms);
        let actions = self.agent.tick(now);
        let _ = self.execute(actions, gpus, now_ms);
        Ok(Effects {
            save: true,
            report: false,
        })
    }

    /// The job's epilog reached the agent.
    pub fn end_job(&mut self, gpus: &mut NodeGpus, now_ms: u64, job_id: &str) -> Effects {
        self.sample_job(gpus, job_id, now_ms);
        let now = self.now_s(now_ms);
        self.agent.end_job(job_id, now);
        let _ = self.agent.take_records();
        Effects {
            save: true,
            report: false,
        }
    }

    /// A progress line from one of the job's processes (owned by `uid`), with its
    /// cumulative count of tokens.
    pub fn progress(&mut self, now_ms: u64, job_id: &str, uid: u32, pid: u32, tokens: u64) {
        let now = self.now_s(now_ms);
        let sender = ReportSender {
            uid,
            pid,
            step_job: job_id.to_string(),
            cluster: None,
        };
        let report = ProgressReport {
            v: powerflex_proto::VERSION,
            job_id: job_id.to_string(),
            tokens,
            steps: 0,
        };
        // A refusal is counted by the machine (and shown in its status).
        let _ = self.agent.report_progress(now, &sender, &report);
    }

    /// One sample period: the live jobs every two seconds, every GPU read, the machine's
    /// tick executed.
    pub fn sample_tick(
        &mut self,
        gpus: &mut NodeGpus,
        now_ms: u64,
        live: &BTreeSet<String>,
    ) -> Effects {
        let now = self.now_s(now_ms);
        if now_ms >= self.next_scan_ms {
            self.next_scan_ms = now_ms + JOB_SCAN_INTERVAL_MS;
            let keys: BTreeSet<JobKey> = live.iter().map(|j| (j.clone(), None)).collect();
            let _ = self.agent.jobs_alive(now, &keys);
        }
        self.sample_all(gpus, now_ms);
        let actions = self.agent.tick(now);
        let (_, mut save) = self.execute(actions, gpus, now_ms);
        save |= !self.agent.take_records().is_empty();
        if now_ms >= self.next_usage_save_ms && !self.agent.jobs.is_empty() {
            self.next_usage_save_ms = now_ms + USAGE_SAVE_INTERVAL_MS;
            save = true;
        }
        Effects {
            save,
            report: false,
        }
    }

    /// A lease from the controller: written at once and read back, then reported.
    pub fn lease(&mut self, gpus: &mut NodeGpus, now_ms: u64, body: LeaseBody) -> Effects {
        let now = self.now_s(now_ms);
        let message = LeaseMessage {
            caps: body
                .caps
                .into_iter()
                .map(|(job, w)| (job, Watts(w)))
                .collect(),
            ttl_s: body.ttl_s,
            start_cap: body.start_cap_w.map(Watts),
            recalibrate: body.recalibrate,
            learn: body.learn,
            next_event_in_s: body.next_event_in_s,
            event_in_force: body.event_in_force,
        };
        let actions = self.agent.apply_lease(now, message);
        let (written, _) = self.execute(actions, gpus, now_ms);
        for g in written {
            if let Some(sample) = gpus.read(g, now_ms) {
                let _ = self.agent.sampled(now, g, Ok(sample));
            }
        }
        Effects {
            save: true,
            report: true,
        }
    }

    /// The controller acknowledged these final shares.
    pub fn acked(&mut self, finals: &[FinalRef]) -> Effects {
        Effects {
            save: self.agent.acked(finals) > 0,
            report: false,
        }
    }

    /// Whether a lease was applied since the last report.
    pub fn lease_unreported(&self) -> bool {
        self.agent.leases_applied != self.leases_reported
    }

    /// The report the link sends now, built from the status snapshot as the link does.
    pub fn report(&mut self, now_ms: u64) -> NodeReport {
        self.leases_reported = self.agent.leases_applied;
        let s = self.snapshot(now_ms);
        let turn = self.turn;
        self.turn = self.turn.wrapping_add(1);
        report_of(&s, turn)
    }

    /// The GPUs the agent announces in its hello.
    pub fn hello(&self) -> Vec<GpuInfo> {
        self.agent
            .gpus
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

    /// Stopping (SIGTERM): the GPUs without a running managed job back to their defaults;
    /// running jobs keep their caps for the next agent (fail-static).
    pub fn stop(&mut self, gpus: &mut NodeGpus, now_ms: u64) {
        let actions = self.agent.stop_actions(false);
        let _ = self.execute(actions, gpus, now_ms);
    }

    /// The state file's contents now.
    pub fn disk(&self) -> Disk {
        self.agent.saved_state()
    }

    pub fn snapshot(&self, now_ms: u64) -> Snapshot {
        self.agent.snapshot(self.now_s(now_ms))
    }

    /// Whether the controller's lease has run out.
    pub fn failsafe(&self, now_ms: u64) -> bool {
        self.agent.failsafe_active(self.now_s(now_ms))
    }

    /// The jobs the agent manages now.
    pub fn jobs(&self) -> impl Iterator<Item = &str> {
        self.agent.jobs.keys().map(String::as_str)
    }
}

/// The final shares one report carries: at most [`MAX_ENDED_PER_REPORT`], in turns.
fn finals_in_turn(
    unacked: &[powerflex_proto::usage::NodeUsage],
    turn: usize,
) -> Vec<powerflex_proto::usage::NodeUsage> {
    if unacked.len() <= MAX_ENDED_PER_REPORT {
        return unacked.to_vec();
    }
    let start = turn.wrapping_mul(MAX_ENDED_PER_REPORT) % unacked.len();
    unacked
        .iter()
        .cycle()
        .skip(start)
        .take(MAX_ENDED_PER_REPORT)
        .cloned()
        .collect()
}

/// A report from a snapshot, as `agent/src/link.rs` builds it: a GPU the agent cannot
/// steer counts at its cap, outside its job.
fn report_of(s: &Snapshot, turn: usize) -> NodeReport {
    let steerable =
        |g: &powerflex_agent_machine::control::GpuView| g.degraded.is_none() && g.power_w.is_some();
    let power_w: f64 = s
        .gpus
        .iter()
        .map(|g| {
            if steerable(g) {
                g.power_w.unwrap_or(0.0)
            } else {
                g.cap_w.unwrap_or(g.default_w)
            }
        })
        .sum();
    let jobs = s
        .jobs
        .iter()
        .map(|j| {
            let mine = || {
                s.gpus
                    .iter()
                    .filter(|g| g.job.as_deref() == Some(j.job.as_str()) && steerable(g))
            };
            let (gpus, power) = mine().fold((0u32, 0.0f64), |(n, p), g| {
                (n + 1, p + g.power_w.unwrap_or(0.0))
            });
            JobReport {
                job_id: j.job.clone(),
                tier: j.tier.clone(),
                gpus,
                cap_w: j.cap_w,
                power_w: (gpus > 0).then_some(power),
                throughput: j.throughput,
                throughput_unit: j.throughput_unit,
                pfi: j.pfi.or(j.prior_pfi),
                pfi_source: j.pfi_source,
                points: j.points.clone(),
                gpu_uuids: mine().map(|g| g.uuid.clone()).collect(),
                power_cap_w: j.power_cap_w,
                power_cap_steady_s: j.power_cap_steady_s,
                calibrating: j.calibrating,
                curve: j.curve.clone(),
                calibration_cost_pct: j.calibration_cost_pct,
                owner_uid: Some(j.uid),
                usage: j.usage.clone(),
            }
        })
        .collect();
    NodeReport {
        jobs,
        power_w,
        failsafe: s.failsafe,
        cap_mismatches: s.cap_mismatches,
        ended: finals_in_turn(&s.ended, turn),
        observe_only: !s.enforce,
    }
}
