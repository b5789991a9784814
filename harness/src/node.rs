//! One node's agent machine, driven as `powerflexd`'s edge (`agent/src/run.rs`) drives
//! it: through [`Agent::step`] alone. The edge's part is done here on the simulated
//! host instead of NVML and `/proc`: what a step needs is read first (the machine says
//! what, [`Agent::control_reads`] and [`Agent::reads_due`]), its cap writes go to the
//! simulated GPUs and come back with their read-backs in a follow-up step, its saves
//! become the node's disk, its status is the one the link reports from.
//!
//! The host ([`Host`]) is what the site knows of the node: the jobs whose step daemons
//! run there, the processes on each GPU, and the tier Slurm records for each job (which
//! the agent reads only to take jobs back after a lost state file). Not modelled:
//! degraded GPUs, reloads, progress lines the socket refuses before the machine,
//! processes on a GPU that belong to no Slurm job (so `agent.unregistered_gpu_use` is
//! not exercised here), job steps other than one per job, the usage log, and the JSON
//! round trip of the state file and the link's messages (the state stays a value; the
//! agent's own persistence tests and the `agent_state` fuzz target cover the file).

use std::collections::{BTreeMap, BTreeSet};

use powerflex_agent_machine::control::{
    AdoptionCandidate, Agent, AgentInput, AgentOutput, AgentSettings, CapWriteResult, ControlFacts,
    GpuProcesses, GpuReading, LeaseMessage, Reply, ReportSender, StartFacts,
};
use powerflex_agent_machine::gpu::{ErrorClass, GpuError, GpuIdentity};
use powerflex_agent_machine::saved::PersistedState;
use powerflex_agent_machine::JobKey;
use powerflex_core::config::SiteConfig;
use powerflex_core::{UnixMs, Watts};
use powerflex_proto::report::{GpuInfo, NodeReport};
use powerflex_proto::usage::FinalRef;
use powerflex_proto::{ControlOp, ControlReply, ProgressReport};

use crate::memory_link::LeaseBody;
use crate::physics::{h200, NodeGpus};
use crate::HarnessError;

/// The agent's state file: what a restart with its state loads.
pub type Disk = PersistedState;

/// The step every task of a harness job runs in (the harness has one step per job).
/// The step id of a job's first step on every node (its later phases may start others:
/// see [`crate::site::Phase::new_step`]).
pub const FIRST_STEP: &str = "0";

/// The agent's settings from the site config, as `powerflexd` reads them for its GPUs.
pub fn settings(site: &SiteConfig, node: &str) -> Result<AgentSettings, HarnessError> {
    AgentSettings::from_site(site, node, h200::NAME, "harness".to_string())
        .map_err(|e| HarnessError::Site(e.to_string()))
}

/// What the node's host shows: the site's record of it, from which the edge's reads
/// (the process table, NVML's process lists, Slurm's record) are answered.
#[derive(Debug, Clone, Default)]
pub struct Host {
    /// Jobs whose step daemons run on the node.
    pub live: BTreeSet<String>,
    /// Per GPU, the processes on it: (pid, job).
    pub processes: BTreeMap<u32, Vec<(u32, String)>>,
    /// Per job running here: its owner (the kernel's owner of its processes) and the
    /// tier Slurm records for it on this node (its `AdminComment`), as the agent would
    /// read them at its start.
    pub recorded: BTreeMap<String, (u32, Option<String>)>,
}

impl Host {
    fn jobs_on_host(&self) -> BTreeSet<JobKey> {
        self.live.iter().map(|j| (j.clone(), None)).collect()
    }

    /// The jobs whose processes use `gpu` (NVML's list mapped by ancestry).
    fn users_of(&self, gpu: u32) -> BTreeSet<JobKey> {
        self.processes
            .get(&gpu)
            .into_iter()
            .flatten()
            .map(|(_, job)| (job.clone(), None))
            .collect()
    }

    fn gpu_processes(&self, gpus: &[u32]) -> GpuProcesses {
        let mut found = GpuProcesses::default();
        for &gpu in gpus {
            let listed: Vec<(u32, Option<String>)> = self
                .processes
                .get(&gpu)
                .into_iter()
                .flatten()
                .map(|(pid, job)| (*pid, Some(job.clone())))
                .collect();
            let users = self.users_of(gpu);
            if !users.is_empty() {
                found.jobs.insert(gpu, users);
            }
            found.processes.insert(gpu, listed);
        }
        found
    }

    /// The jobs running on this node's GPUs, as the edge finds them after a lost state
    /// file (see `agent/src/run.rs`, `adoption_candidates`).
    fn adoption_candidates(&self) -> Vec<AdoptionCandidate> {
        let mut gpus_of: BTreeMap<&str, Vec<String>> = BTreeMap::new();
        for (gpu, processes) in &self.processes {
            for (_, job) in processes {
                let gpus = gpus_of.entry(job.as_str()).or_default();
                if !gpus.contains(&gpu.to_string()) {
                    gpus.push(gpu.to_string());
                }
            }
        }
        let mut candidates: Vec<AdoptionCandidate> = gpus_of
            .into_iter()
            .filter(|(job, _)| self.live.contains(*job))
            .map(|(job, gpus)| {
                let (uid, recorded_tier) = self.recorded.get(job).cloned().unwrap_or((0, None));
                AdoptionCandidate {
                    job_id: job.to_string(),
                    cluster: None,
                    uid,
                    gpus,
                    recorded_tier,
                }
            })
            .collect();
        // As the edge finds them: in the order of their first GPU.
        candidates.sort_by_key(|c| c.gpus.first().and_then(|g| g.parse::<u32>().ok()));
        candidates
    }
}

/// One progress line from a job's process.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TaskProgress {
    pub job_id: String,
    /// The process's owner, as the kernel tells the progress socket.
    pub uid: u32,
    pub pid: u32,
    /// Tokens so far (cumulative).
    pub tokens: u64,
}

/// A job's step as its step daemon registers it on this node.
#[derive(Debug, Clone, Copy)]
pub struct StepStart<'a> {
    pub job_id: &'a str,
    /// Slurm's step id.
    pub step_id: &'a str,
    /// Slurm's job uid.
    pub uid: u32,
    /// The job's GPUs on this node, by index.
    pub gpus: &'a [u32],
    /// The `--power-flex` value.
    pub flex: &'a str,
}

/// What the site must do after a call.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[must_use]
pub struct Effects {
    /// The agent saved its state ([`NodeAgent::disk`] is the new file).
    pub save: bool,
}

/// One node's agent.
#[derive(Debug)]
pub struct NodeAgent {
    agent: Agent,
    /// Site ms at the agent's start, and the node's wall clock then: the agent's clock
    /// runs steady from there, as `powerflexd`'s `SteadyClock` does, whatever the node's
    /// wall clock does later.
    started_ms: u64,
    wall_at_start_ms: u64,
    /// The status the machine last published.
    status: powerflex_proto::status::AgentStatus,
    /// The state file the machine last saved.
    saved: Disk,
    leases_reported: u64,
    turn: usize,
}

impl NodeAgent {
    /// The agent starting at `now_ms` on `gpus`, the node's wall clock reading `wall_ms`,
    /// from `disk` (none: no state file, or one set aside as unusable).
    pub fn start(
        settings: AgentSettings,
        gpus: &mut NodeGpus,
        disk: Option<&Disk>,
        host: &Host,
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
        let started = UnixMs(wall_ms);
        let mut agent = Agent::new(settings, identities, sample_interval_ms, started);
        let every: Vec<u32> = (0..gpus.gpus.len() as u32).collect();
        let facts = StartFacts {
            saved: disk.cloned(),
            // Every limit read before anything is written: it bounds the caps until a
            // current lease arrives (fail-static through a restart).
            samples: read(gpus, &every, now_ms),
            jobs_on_host: Some(host.jobs_on_host()),
            busy_gpus: host
                .processes
                .iter()
                .filter(|(_, p)| !p.is_empty())
                .map(|(g, _)| *g)
                .collect(),
            adoptable: if disk.is_none() {
                host.adoption_candidates()
            } else {
                Vec::new()
            },
        };
        let mut first = agent.step(started, vec![AgentInput::Start(Box::new(facts))]);
        let status = first
            .snapshot
            .take()
            .expect("the machine publishes its status at its start");
        let saved = first
            .persist
            .take()
            .expect("the machine saves its state at its start");
        let mut node = NodeAgent {
            agent,
            started_ms: now_ms,
            wall_at_start_ms: wall_ms,
            status,
            saved,
            leases_reported: 0,
            turn: 0,
        };
        let _ = node.finish(gpus, now_ms, first);
        node
    }

    /// The agent's clock at site time `now_ms`.
    fn clock(&self, now_ms: u64) -> UnixMs {
        UnixMs(self.wall_at_start_ms + now_ms.saturating_sub(self.started_ms))
    }

    /// Steps the machine on `inputs` and executes what it asks, follow-up steps included;
    /// returns the replies to `inputs` and whether the state was saved.
    fn drive(
        &mut self,
        gpus: &mut NodeGpus,
        now_ms: u64,
        inputs: Vec<AgentInput>,
    ) -> (Vec<(usize, Reply)>, Effects) {
        let mut out = self.agent.step(self.clock(now_ms), inputs);
        let replies = std::mem::take(&mut out.replies);
        let effects = self.finish(gpus, now_ms, out);
        (replies, effects)
    }

    /// Executes an output (cap writes, read-backs, then the follow-up step's own), keeps
    /// its save and its status.
    fn finish(&mut self, gpus: &mut NodeGpus, now_ms: u64, first: AgentOutput) -> Effects {
        let mut effects = Effects::default();
        let mut out = first;
        loop {
            let mut follow_up = Vec::new();
            if !out.cap_writes.is_empty() {
                let results = out
                    .cap_writes
                    .iter()
                    .map(|w| CapWriteResult {
                        gpu: w.gpu,
                        cap: w.cap,
                        outcome: match gpus.write(w.gpu, now_ms, w.cap.0) {
                            Some(before_w) => Ok(Some(Watts(before_w))),
                            None => Err(no_such_gpu(w.gpu)),
                        },
                    })
                    .collect();
                follow_up.push(AgentInput::CapWrites(results));
            }
            if !out.read_back.is_empty() {
                follow_up.push(AgentInput::GpuSamples(read(gpus, &out.read_back, now_ms)));
            }
            if let Some(state) = out.persist.take() {
                self.saved = state;
                effects.save = true;
            }
            if let Some(status) = out.snapshot.take() {
                self.status = status;
            }
            if follow_up.is_empty() {
                return effects;
            }
            out = self.agent.step(self.clock(now_ms), follow_up);
        }
    }

    /// A job's step registers from its step daemon on this node: refused (the reason),
    /// or registered with its GPUs read and capped before the answer.
    pub fn register(
        &mut self,
        gpus: &mut NodeGpus,
        host: &Host,
        now_ms: u64,
        step: &StepStart<'_>,
    ) -> Result<Effects, String> {
        let op = ControlOp::Register {
            job_id: step.job_id.to_string(),
            step_id: step.step_id.to_string(),
            uid: step.uid,
            node: self.agent.node().to_string(),
            gpus: step.gpus.iter().map(u32::to_string).collect(),
            flex: step.flex.to_string(),
        };
        let (replies, effects) = self.control(gpus, host, now_ms, op);
        match replies {
            Some(ControlReply::Done(_)) => Ok(effects),
            Some(ControlReply::Refused(why)) => Err(why),
            None => Err("the machine did not answer the registration".to_string()),
        }
    }

    /// The job's epilog reached the agent.
    pub fn end_job(
        &mut self,
        gpus: &mut NodeGpus,
        host: &Host,
        now_ms: u64,
        job_id: &str,
    ) -> Effects {
        let op = ControlOp::EndJob {
            job_id: job_id.to_string(),
        };
        self.control(gpus, host, now_ms, op).1
    }

    /// A control request from the node's step daemon (root), with the facts the
    /// machine asks for read from the host.
    fn control(
        &mut self,
        gpus: &mut NodeGpus,
        host: &Host,
        now_ms: u64,
        op: ControlOp,
    ) -> (Option<ControlReply>, Effects) {
        let reads = self.agent.control_reads(&op, true);
        let facts = ControlFacts {
            stepd_cluster: Some(None),
            peer_pid: 1,
            jobs_on_host: reads.process_table.then(|| host.jobs_on_host()),
            gpu_users: reads
                .gpu_users
                .iter()
                .map(|&g| (g, host.users_of(g)))
                .collect(),
            samples: read(gpus, &reads.samples, now_ms),
        };
        let (replies, effects) = self.drive(gpus, now_ms, vec![AgentInput::Control { op, facts }]);
        let reply = replies.into_iter().find_map(|(_, r)| match r {
            Reply::Control(reply) => Some(*reply),
            Reply::Progress(_) | Reply::Lease(_) => None,
        });
        (reply, effects)
    }

    /// Progress lines from the jobs' processes, each with its cumulative count of
    /// tokens, as they arrived now. A refusal is counted by the machine (and shown in its
    /// status).
    pub fn progress(&mut self, gpus: &mut NodeGpus, now_ms: u64, lines: &[TaskProgress]) {
        if lines.is_empty() {
            return;
        }
        let received = self.clock(now_ms);
        let inputs = lines
            .iter()
            .map(|line| AgentInput::Progress {
                received,
                sender: ReportSender {
                    uid: line.uid,
                    pid: line.pid,
                    step_job: line.job_id.clone(),
                    cluster: None,
                },
                report: ProgressReport {
                    v: powerflex_proto::VERSION,
                    job_id: line.job_id.clone(),
                    tokens: line.tokens,
                    steps: 0,
                },
            })
            .collect();
        let _ = self.drive(gpus, now_ms, inputs);
    }

    /// One turn of the edge's 50 ms loop: when a sample is due, what the machine asks
    /// read (the GPUs and, every few seconds, the process table and NVML's process
    /// lists), then its tick.
    pub fn sample_tick(&mut self, gpus: &mut NodeGpus, host: &Host, now_ms: u64) -> Effects {
        let Some(reads) = self.agent.reads_due(self.clock(now_ms)) else {
            return Effects::default();
        };
        let mut inputs = Vec::new();
        if reads.process_table {
            inputs.push(AgentInput::JobsOnHost(host.jobs_on_host()));
            inputs.push(AgentInput::GpuProcesses(
                host.gpu_processes(&reads.gpu_processes),
            ));
        }
        inputs.push(AgentInput::GpuSamples(read(gpus, &reads.gpus, now_ms)));
        inputs.push(AgentInput::Tick);
        self.drive(gpus, now_ms, inputs).1
    }

    /// A lease from the controller: written at once and read back.
    pub fn lease(&mut self, gpus: &mut NodeGpus, now_ms: u64, body: LeaseBody) -> Effects {
        let lease = LeaseMessage {
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
            // The harness's one controller steers alone: epoch 0, as a single
            // controller's leases carry.
            epoch: 0,
        };
        // As the real agent's edge does: the walks' new depth first, then the lease.
        let mut inputs = Vec::new();
        if !body.walk_to_w.is_empty() {
            inputs.push(AgentInput::PrePosition(
                body.walk_to_w
                    .into_iter()
                    .map(|(job, w)| (job, Watts(w)))
                    .collect(),
            ));
        }
        inputs.push(AgentInput::Lease(lease));
        self.drive(gpus, now_ms, inputs).1
    }

    /// The controller acknowledged these final shares.
    pub fn acked(&mut self, gpus: &mut NodeGpus, now_ms: u64, finals: &[FinalRef]) -> Effects {
        self.drive(gpus, now_ms, vec![AgentInput::Acked(finals.to_vec())])
            .1
    }

    /// Whether a lease was applied since the last report (the link reports at once).
    pub fn lease_unreported(&self) -> bool {
        self.status.leases_applied != self.leases_reported
    }

    /// The report the link sends now, from the published status as the link builds it.
    pub fn report(&mut self) -> NodeReport {
        self.leases_reported = self.status.leases_applied;
        let turn = self.turn;
        self.turn = self.turn.wrapping_add(1);
        NodeReport::of(&self.status, turn)
    }

    /// The GPUs the agent announces in its hello.
    pub fn hello(&self) -> Vec<GpuInfo> {
        self.agent.gpu_infos()
    }

    /// Stopping (SIGTERM): the GPUs without a running managed job back to their defaults;
    /// running jobs keep their caps for the next agent (fail-static).
    pub fn stop(&mut self, gpus: &mut NodeGpus, now_ms: u64) -> Effects {
        let stop = AgentInput::Stop {
            release_jobs: false,
        };
        self.drive(gpus, now_ms, vec![stop]).1
    }

    /// The state file as the machine last saved it.
    pub fn disk(&self) -> Disk {
        self.saved.clone()
    }

    /// The status the machine last published.
    pub fn snapshot(&self) -> &powerflex_proto::status::AgentStatus {
        &self.status
    }

    /// Whether the controller's lease has run out (at the last published status).
    pub fn failsafe(&self) -> bool {
        self.status.failsafe
    }
}

fn no_such_gpu(gpu: u32) -> GpuError {
    GpuError {
        index: gpu,
        class: ErrorClass::Permanent,
        message: "no such GPU".to_string(),
    }
}

/// Readings of `which`, as the edge's NVML backend gives them.
fn read(gpus: &mut NodeGpus, which: &[u32], now_ms: u64) -> Vec<GpuReading> {
    which
        .iter()
        .map(|&g| (g, gpus.read(g, now_ms).ok_or_else(|| no_such_gpu(g))))
        .collect()
}
