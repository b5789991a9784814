//! The controller's decisions, pure: a state machine fed agent hellos and reports, admin
//! requests (with the caller's uid), allocation ticks and site config reloads, at a time
//! passed in as a [`UnixMs`]. It answers with what to do: leases per node, annotations, state
//! to persist, admin replies, what the metrics show and each allocation's history sample (the
//! history is served from [`super::history`], not from here). Nothing here sleeps, opens
//! a socket or touches a file; the edge (`powerflex_controller::ctld::run`) does all of that around it, and the tests
//! below drive it on a fake clock.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

use tracing::{debug, error, info, warn};

use powerflex_core::{UnixMs, Watts};
use powerflex_proto::admin::{AdminOp, AdminReply, Refusal};
use powerflex_proto::report::{validate_gpus, GpuInfo, JobReport};
use powerflex_proto::status::{
    CtldStatus, CurveSnapshot, HistorySample, LeadershipRole, LeadershipView,
};

use super::accounting::{self, Ledger};
pub use super::history::HISTORY;
use super::metrics::{EnergyTotals, MetricsSnapshot};
use super::owners::{self, OwnerMap, Owners};
pub use super::session::Session;
use super::state::{CtldState, Loaded, MAX_BUDGET_W};
use super::{annotate, learning, status, CtldSettings, SettingsReload};
use crate::placement::{bound_gpu_power, Placement, RefusedBecause};
use crate::preempt::{self, Action};
use crate::ramp::{look_ahead_ms, Ramp, RampPlan};
use crate::rollout::{LeaseOut, Rollout};
use crate::schedule::{active_event, effective_budget, Event, SteppedRamp};
use crate::site::{decide_holding, Decision, NodeView};
use powerflex_core::config::{JobPlacement, LeaseRollout};
use powerflex_proto::usage::FinalRef;
use powerflex_proto::usage::{JobEnergyRecord, NodeUsage};

/// Least time a node gets to confirm its decreases before it counts at its most, ms: an
/// agent applies a lease at once and reports within tens of milliseconds, but a busy host
/// or link can take longer than a short allocation period.
const MIN_CONFIRM_MS: u64 = 2_000;

/// How much a job's draw must rise between two reports of a node, under a cap that did
/// not rise and had held long enough for the draw to show it, to count as a new load: a
/// fraction of the earlier draw (the drift band; NVML's noise is about 1 %), and at
/// least [`DRAW_ROSE_MIN_W`] per GPU.
const DRAW_ROSE_FRACTION: f64 = 0.10;
const DRAW_ROSE_MIN_W: f64 = 10.0;
/// How long the cap must have held for a rising draw to be the job's and not the cap's, s
/// (the site's rule for a settled draw).
const DRAW_ROSE_CAP_HELD_S: f64 = 1.0;

/// Whether a job's draw rose from `old` to `new` (two reports of one node) under a cap
/// that did not rise: the job's load grew, not its cap.
fn draw_rose(old: &JobReport, new: &JobReport) -> bool {
    let (Some(from), Some(to)) = (old.power_w, new.power_w) else {
        return false;
    };
    let cap = |r: &JobReport| r.power_cap_w.or(r.cap_w);
    let cap_not_raised = match (cap(old), cap(new)) {
        (Some(a), Some(b)) => b <= a + 0.5,
        _ => false,
    };
    let settled = new
        .power_cap_steady_s
        .is_some_and(|s| s >= DRAW_ROSE_CAP_HELD_S);
    let gpus = f64::from(new.gpus.max(1));
    cap_not_raised
        && settled
        && to > from * (1.0 + DRAW_ROSE_FRACTION)
        && to - from > DRAW_ROSE_MIN_W * gpus
}

/// One input to [`Core::step`].
#[derive(Debug, Clone)]
pub enum Input {
    /// An agent (re)connected, with its GPUs.
    Hello { node: String, gpus: Vec<GpuInfo> },
    /// An agent's periodic report.
    Report {
        node: String,
        jobs: Vec<JobReport>,
        power_w: f64,
        /// Final shares of jobs that ended on the node (see [`accounting`]).
        ended: Vec<NodeUsage>,
        /// The node's agent writes no limit (`agent.enforce = false`).
        observe_only: bool,
    },
    /// An admin request from a caller with this uid (from the socket's peer credentials).
    Admin { op: AdminOp, uid: u32 },
    /// The site config was re-read.
    /// (Boxed: a config is large and rare, reports are small and frequent.)
    Reload(Box<SettingsReload>),
    /// The allocation period elapsed.
    Tick,
    /// Slurm's placement was read (`squeue`/`sinfo`), or why it could not be.
    Placement(Box<Result<Placement, String>>),
    /// The accounting database's writer changed state (shown by `status`).
    AccountingDb(powerflex_proto::status::AccountingDbView),
    /// Whether this controller steers, as its leadership (`[controller.ha]`) last
    /// decided: while not active it sends no lease and refuses admin changes.
    Leadership(LeadershipView),
    /// An agent refused this controller's lease for its epoch: a controller of a later
    /// epoch steers it. This one stops leasing that node (fenced by it); the rest of the
    /// site it goes on steering, as one node's word must not stop a site, unless it is a
    /// single controller that most of its nodes refuse (see `Core::fenced`).
    Fenced {
        node: String,
        lease_epoch: u64,
        accepted_epoch: u64,
    },
}

/// One node's lease.
#[derive(Debug, Clone, PartialEq)]
pub struct Lease {
    /// Job → per-GPU cap, W.
    pub caps: BTreeMap<String, f64>,
    /// Per-GPU cap for a job that starts before the next allocation names it, W.
    pub start_cap_w: f64,
    /// The node's jobs whose measurements left their curves: to be walked again.
    pub recalibrate: Vec<String>,
    /// The node's jobs that run on it alone: the agent may probe their curves (see
    /// `powerflex_proto::link::Body::Lease`).
    pub learn: Vec<String>,
    /// Seconds to the start of the next announced event, if one is scheduled: jobs
    /// still calibrating finish their walks before it (pre-positioning).
    pub next_event_in_s: Option<f64>,
    /// A grid event is in force (the jobs' accounting counts time in events).
    pub event_in_force: bool,
}

/// What one [`Core::step`] asks the I/O edge to do, in this order: persist, reply, lease,
/// annotate, publish metrics.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Output {
    /// The state to save before anything else: an admin change is acknowledged only once
    /// saved.
    pub persist: Option<CtldState>,
    /// One reply per [`Input::Admin`], with the input's index in the step's inputs.
    pub replies: Vec<(usize, AdminReply)>,
    /// Per node, valid for `lease_ttl_s`. Empty when nothing was allocated this step.
    pub leases: BTreeMap<String, Lease>,
    pub lease_ttl_s: f64,
    /// The leadership epoch every lease carries ([`CtldState::epoch`]).
    pub epoch: u64,
    /// This step stopped the controller steering (stepped down or fenced): the edge
    /// tells the connected agents, which look for the active controller.
    pub stopped_steering: bool,
    /// Nodes that fenced this controller in this step: the edge tells each (standby) so
    /// its agent looks for the controller it follows at once.
    pub send_on: Vec<String>,
    /// Job → `AdminComment` text, only for jobs whose text changed.
    pub annotations: Vec<(String, String)>,
    /// What the metrics show after an allocation (the edge renders the text).
    pub metrics: Option<MetricsSnapshot>,
    /// Suspensions, resumptions, requeues and releases for cuts deeper than caps reach,
    /// to run after the leases went out.
    pub preempt: Vec<Action>,
    /// A node reported a job Slurm's last placement does not list: read it again now
    /// rather than at the next poll.
    pub refresh_placement: bool,
    /// Energy records of jobs that ended, to append to the accounting log (before the
    /// annotations that show them in Slurm).
    pub job_records: Vec<JobEnergyRecord>,
    /// Per node, the final shares to acknowledge (`powerflex_proto::link::Body::Acked`)
    /// once `job_records` are written: their records hold them.
    pub final_acks: BTreeMap<String, Vec<FinalRef>>,
    /// This step's allocation as a history sample, for the history board
    /// ([`super::history`]): `history` requests are answered there, outside this loop.
    pub history: Option<Arc<HistorySample>>,
    /// The jobs' owners, when they changed this step: the board filters what a non-root
    /// caller reads of the history with them.
    pub owners: Option<Arc<OwnerMap>>,
}

/// The controller's state machine.
#[derive(Debug)]
pub struct Core {
    options: CtldSettings,
    state: CtldState,
    sessions: BTreeMap<String, Session>,
    /// Nodes known from before a restart whose first report has not arrived: until it
    /// does their jobs are unknown, and allocating without them would hand their watts
    /// to the jobs already reported while their old leases still hold their caps.
    awaiting: BTreeSet<String>,
    /// With the state lost, nothing is allocated before this.
    hold_until_ms: u64,
    /// With known nodes awaited, nothing is allocated before this (or all are back).
    grace_until_ms: u64,
    annotations: BTreeMap<String, String>,
    /// Allocations made since the start (each one a history sample, published by the
    /// I/O edge; the core keeps none).
    allocations: u64,
    /// Shared with the metrics snapshot the edge renders (not copied per allocation).
    last: Option<Arc<Decision>>,
    config_error: Option<String>,
    allocate_now: bool,
    dirty: bool,
    /// Decreases before increases (see [`crate::rollout`]).
    rollout: Rollout,
    /// Allocations made ahead of ramp-downs and held back on ramp-ups (see [`crate::ramp`]).
    ramp: Ramp,
    /// Each power domain's ramp, by name: `facility.max_ramp_w_per_s` bounds a domain's
    /// rise when its event ends as it bounds the site's.
    domain_ramps: BTreeMap<String, Ramp>,
    /// The last allocation's ramp plan.
    last_plan: Option<RampPlan>,
    /// Per job: its curve after calibration and after each event since (see
    /// [`learning::record`]).
    curve_history: BTreeMap<String, Vec<CurveSnapshot>>,
    /// Per power domain, its limit in force at the last allocation over the GPUs behind
    /// it, W: a job that starts before the next allocation names it starts no higher on
    /// any domain of its node's path (empty without domains).
    domain_start_cap_w: Vec<f64>,
    /// The event in force at the last allocation: when it ends, every job's curve is
    /// snapshotted.
    last_event: Option<u64>,
    /// Who owns the jobs reported now and within the history: a non-root admin caller
    /// reads only their own (see [`owners::need_to_know`]).
    owners: Owners,
    /// Slurm's last placement read (with `job_placement = "slurm"`). Shared, not copied:
    /// at 10,000 nodes it is megabytes, and every report is checked against it.
    placement: Option<std::sync::Arc<Placement>>,
    /// Why the last read of it failed, if it did (the last good one stays in force).
    placement_error: Option<String>,
    refresh_placement: bool,
    /// Jobs' energy shares and records (see [`accounting`]).
    ledger: Ledger,
    /// The accounting database's writer, as the I/O edge last reported it.
    accounting_db: Option<powerflex_proto::status::AccountingDbView>,
    /// Whether this controller steers, where that is in question (see
    /// [`Input::Leadership`], [`Input::Fenced`]); none: a single controller, steering.
    leadership: Option<LeadershipView>,
    /// Nodes whose agents refused this controller's leases for their epoch, with the
    /// epoch each follows: this core leases them no more (a new leadership builds a new
    /// core; a restart starts afresh).
    fenced_by: BTreeMap<String, u64>,
    /// Energy of the records written since the controller started, for the metrics.
    energy_totals: EnergyTotals,
}

impl Core {
    /// A controller started at `now_ms` with the state it loaded.
    pub fn new(options: CtldSettings, loaded: Loaded, now: UnixMs) -> Core {
        let now_ms = now.ms();
        let Loaded { state, lost } = loaded;
        // With the state lost, the nodes that hold leases are unknown: allocate nothing
        // for one lease, so every old lease has run out (its node at its fail-safe cap)
        // before new ones are handed out, and no node's watts are given twice.
        let hold_until_ms = if lost {
            warn!(
                hold_s = options.lease_ttl_s,
                "holding the first allocation until every old lease has run out"
            );
            now_ms + (options.lease_ttl_s * 1000.0) as u64
        } else {
            0
        };
        info!(
            budget_w = state.budget_w.map_or(options.base_budget.0, |w| w.0),
            events = state.events.len(),
            "controller started"
        );
        // Nodes known from before a restart count as silent (at their fail-safe cap)
        // until they reconnect, and no allocation is made until all have or half a lease
        // passed.
        let sessions: BTreeMap<String, Session> = state
            .nodes
            .iter()
            .map(|(node, gpus)| {
                let view = NodeView {
                    node: node.clone(),
                    gpus: gpus.clone(),
                    jobs: Vec::new(),
                    power_w: 0.0,
                    live: false,
                };
                (
                    node.clone(),
                    Session {
                        view,
                        last_seen_ms: 0,
                        reported: Vec::new(),
                        announced: gpus.clone(),
                        refused_reports: 0,
                        refused_gpus: 0,
                        observe_only: false,
                    },
                )
            })
            .collect();
        let awaiting: BTreeSet<String> = state.nodes.keys().cloned().collect();
        if !awaiting.is_empty() {
            info!(
                nodes = awaiting.len(),
                grace_s = options.lease_ttl_s / 2.0,
                "waiting for the known agents to reconnect before allocating"
            );
        }
        let options_slurm = options.job_placement == JobPlacement::Slurm;
        Core {
            grace_until_ms: now_ms + (options.lease_ttl_s * 500.0) as u64,
            options,
            state,
            sessions,
            awaiting,
            hold_until_ms,
            annotations: BTreeMap::new(),
            allocations: 0,
            last: None,
            config_error: None,
            allocate_now: true,
            dirty: false,
            rollout: Rollout::new(),
            ramp: Ramp::new(),
            domain_ramps: BTreeMap::new(),
            last_plan: None,
            curve_history: BTreeMap::new(),
            domain_start_cap_w: Vec::new(),
            last_event: None,
            owners: Owners::default(),
            placement: None,
            placement_error: None,
            refresh_placement: false,
            ledger: Ledger::new(options_slurm),
            accounting_db: None,
            leadership: None,
            fenced_by: BTreeMap::new(),
            energy_totals: EnergyTotals::default(),
        }
    }

    /// Whether this controller steers the site now: a single controller always, under
    /// `[controller.ha]` only while active, and never once fenced.
    pub fn steering(&self) -> bool {
        self.leadership
            .as_ref()
            .is_none_or(|l| l.role == LeadershipRole::Active)
    }

    /// An agent refused a lease for its epoch. Only a refusal of this controller's own
    /// epoch by a later one counts (a refusal of an older lease still in flight from
    /// before a takeover says nothing about this one), and it fences this controller for
    /// that node: it leases the node no more and counts it as silent. One node's word
    /// stops nothing else (its root can refuse its own leases anyway).
    ///
    /// A single controller (no `[controller.ha]`) has no database to ask: once more
    /// than half of the nodes it knows (connected, in Slurm's placement, or placed by
    /// the domains) refuse it, a controller of a later epoch steers
    /// the site and this one is a stale one (a rogue), and it stops steering entirely
    /// (FENCED), so it steers no node without an epoch memory either. Under
    /// `[controller.ha]` the leader row decides: the edge asks the database at once.
    /// Returns whether the node is newly fenced.
    fn fenced(&mut self, node: &str, lease_epoch: u64, accepted_epoch: u64, now_ms: u64) -> bool {
        let epoch = self.state.epoch;
        if lease_epoch != epoch || accepted_epoch <= epoch {
            debug!(
                node,
                lease_epoch,
                accepted_epoch,
                epoch,
                "an agent's epoch refusal of another epoch ignored"
            );
            return false;
        }
        if self
            .fenced_by
            .insert(node.to_string(), accepted_epoch)
            .is_some()
        {
            return false;
        }
        error!(
            node,
            epoch,
            accepted_epoch,
            "fenced: an agent follows a controller of a later epoch; this controller stops steering that node"
        );
        // Every node the controller knows of, not only those connected: Slurm's GPU
        // nodes and the nodes the domains place count too, so a lone node's refusal
        // (its root can forge one) while few have connected fences no site.
        let known = self
            .sessions
            .len()
            .max(self.fenced_by.len())
            .max(self.placement.as_ref().map_or(0, |p| {
                p.node_gpus.values().filter(|&&gpus| gpus > 0).count()
            }))
            .max(
                self.options
                    .site
                    .domains
                    .as_ref()
                    .map_or(0, |d| d.tree.node_count()),
            );
        if self.leadership.is_none() && 2 * self.fenced_by.len() > known {
            let highest = self
                .fenced_by
                .values()
                .copied()
                .max()
                .unwrap_or(accepted_epoch);
            error!(
                epoch,
                refused_by = self.fenced_by.len(),
                known,
                highest_epoch = highest,
                "fenced: most nodes follow a controller of a later epoch; this controller stops steering"
            );
            self.leadership = Some(LeadershipView {
                role: LeadershipRole::Fenced,
                name: None,
                epoch,
                holder: None,
                reason: Some(format!(
                    "{} of the {known} nodes it knows follow a controller of a later epoch (up to {highest}) than this one's {epoch}",
                    self.fenced_by.len()
                )),
                since_unix_ms: now_ms,
            });
        }
        true
    }

    /// Records read back from the accounting log at start: answered by `accounting`,
    /// never written again.
    pub fn load_records(&mut self, records: Vec<JobEnergyRecord>) {
        self.ledger.load(records);
    }

    /// Feeds a batch of inputs received together, then allocates once if any of them
    /// asked for it: a thousand agents connecting at once cost one allocation.
    pub fn step(&mut self, now: UnixMs, inputs: Vec<Input>) -> Output {
        let now_ms = now.ms();
        let mut out = Output {
            lease_ttl_s: self.options.lease_ttl_s,
            epoch: self.state.epoch,
            ..Output::default()
        };
        let steered = self.steering();
        for (index, input) in inputs.into_iter().enumerate() {
            match input {
                Input::Hello { node, gpus } => {
                    // A node that refused this controller is sent on again at once.
                    if self.fenced_by.contains_key(&node) {
                        out.send_on.push(node.clone());
                    }
                    self.hello(node, gpus, now_ms);
                }
                Input::Report {
                    node,
                    jobs,
                    power_w,
                    ended,
                    observe_only,
                } => {
                    self.report(&node, jobs, power_w, now_ms);
                    if let Some(s) = self.sessions.get_mut(&node) {
                        s.observe_only = observe_only;
                        self.final_shares(&node, ended, now_ms);
                    }
                }
                Input::Admin { op, .. } if op.changes_state() && !self.steering() => {
                    out.replies.push((index, self.not_active()));
                }
                Input::Admin { op, uid } => {
                    let changes = op.changes_state();
                    let reply = owners::need_to_know(self.admin(op, uid, now_ms), uid, |job| {
                        self.owners.of(job)
                    });
                    if reply.ok && changes {
                        self.allocate_now = true;
                    }
                    out.replies.push((index, reply));
                }
                Input::Reload(reload) => self.reload(*reload),
                Input::Tick => self.allocate_now = true,
                Input::Placement(read) => self.placement_read(*read),
                Input::AccountingDb(view) => self.accounting_db = Some(view),
                Input::Leadership(view) => {
                    let was = self.steering();
                    // Fenced stays fenced (a single controller most nodes refused).
                    if !self
                        .leadership
                        .as_ref()
                        .is_some_and(|l| l.role == LeadershipRole::Fenced)
                    {
                        self.leadership = Some(view);
                    }
                    if !was && self.steering() {
                        self.allocate_now = true;
                    }
                }
                Input::Fenced {
                    node,
                    lease_epoch,
                    accepted_epoch,
                } => {
                    if self.fenced(&node, lease_epoch, accepted_epoch, now_ms) {
                        out.send_on.push(node);
                    }
                }
            }
        }
        let steering_now = self.steering();
        out.stopped_steering = steered && !steering_now;
        if self.allocate_now && steering_now {
            self.allocate_now = false;
            self.allocate(now_ms, &mut out);
        }
        if !steering_now {
            // A controller that does not steer holds its decisions: it neither leases
            // nor releases, nor preempts (the active one does). The agents keep their
            // last lease's caps until it runs out, then fall to the fail-safe.
            self.allocate_now = false;
            self.rollout = Rollout::new();
            return self.finish_step(now_ms, out);
        }
        // Increases released by this step's confirmations go out with the leases. Only
        // now, after the whole batch: an allocation made in this step has replaced the
        // increases it found held (its own leases already carry what may rise), and an
        // increase released before it would overwrite a newer lease with an older one.
        let released = self.rollout.release_ready();
        if !released.is_empty() {
            info!(
                nodes = released.len(),
                "decreases confirmed; sending the held increases"
            );
        }
        if !released.is_empty() {
            let reporting = self.nodes_reporting_each_job();
            for released in released {
                let lease = self.lease_for(
                    &released.node,
                    self.last.as_deref(),
                    released.caps,
                    &reporting,
                    now_ms,
                );
                out.leases.insert(released.node, lease);
            }
        }
        self.finish_step(now_ms, out)
    }

    /// What every step ends with, steering or not: the state to save, the placement
    /// refresh, the energy records due.
    fn finish_step(&mut self, now_ms: u64, mut out: Output) -> Output {
        // A node that refused this controller's epoch gets no lease from it.
        out.leases
            .retain(|node, _| !self.fenced_by.contains_key(node));
        if std::mem::take(&mut self.dirty) {
            out.persist = Some(self.state.clone());
        }
        out.lease_ttl_s = self.options.lease_ttl_s;
        out.refresh_placement = std::mem::take(&mut self.refresh_placement);
        self.write_records(now_ms, &mut out);
        out
    }

    /// The refusal of an admin change while this controller does not steer.
    fn not_active(&self) -> AdminReply {
        let why = match &self.leadership {
            Some(l) => match (&l.holder, &l.reason) {
                (Some(holder), _) => format!(
                    "this controller is {}: the active controller is {holder}; send changes there",
                    l.role.name()
                ),
                (None, Some(reason)) => format!("this controller is {} ({reason})", l.role.name()),
                (None, None) => format!("this controller is {}", l.role.name()),
            },
            None => "this controller does not steer".to_string(),
        };
        AdminReply::refused(Refusal::NotActive, why)
    }

    /// A node's final shares: checked as a whole (a malformed list is refused, logged
    /// and counted against the node), then each taken where Slurm placed its run on the
    /// node (see [`accounting`]).
    fn final_shares(&mut self, node: &str, ended: Vec<NodeUsage>, now_ms: u64) {
        if ended.is_empty() {
            return;
        }
        if let Err(e) = powerflex_proto::report::validate_final_shares(&ended) {
            warn!(node, error = %e, "a node's final shares refused");
            if let Some(s) = self.sessions.get_mut(node) {
                s.refused_reports += 1;
            }
            return;
        }
        let placement = self.placement.clone();
        let refused = self.ledger.ended(node, ended, now_ms, |job| {
            placement
                .as_ref()
                .and_then(|p| p.jobs.get(job))
                .filter(|j| j.nodes.contains(node))
                .map(|j| j.uid)
        });
        for r in refused {
            // The agent re-sends it until acknowledged, or for a day: debug, not warn.
            debug!(node, job_id = %r.job_id, why = r.reason, "a node's final share refused");
        }
    }

    /// The energy records due now. (Not annotated: Slurm refuses `AdminComment` updates
    /// to a finished job; the running annotation carries the energy so far.)
    fn write_records(&mut self, now_ms: u64, out: &mut Output) {
        let placement = self.placement.clone();
        let records = self.ledger.due(now_ms, |job| {
            placement
                .as_ref()
                .and_then(|p| p.jobs.get(job))
                .map(|j| j.uid)
        });
        for record in &records {
            self.energy_totals.add(record);
        }
        for record in &records {
            info!(
                job_id = %record.job_id,
                energy_j = record.energy_j,
                nodes = record.nodes.len(),
                incomplete = record.incomplete_nodes.len(),
                "job energy record"
            );
        }
        out.job_records = records;
        out.final_acks = self.ledger.take_acks();
    }

    /// The status snapshot at `now_ms` (liveness as of the last allocation attempt).
    pub fn status(&self, now: UnixMs) -> CtldStatus {
        let now_ms = now.ms();
        let mut status = status::build(
            &self.state,
            self.options.base_budget,
            &self.sessions,
            self.last.as_deref(),
            self.config_error.as_deref(),
            &self.curve_history,
            now_ms,
        );
        // A job on several nodes shows the tier the allocation uses: the least flexible.
        let tier_of = crate::site::least_flexible_tiers(
            self.sessions.values().map(|s| &s.view),
            &self.options.site.tiers,
        );
        for job in &mut status.jobs {
            if let Some(tier) = tier_of.get(&job.job) {
                job.tier.clone_from(tier);
            }
        }
        status.slurm =
            self.checked_placement()
                .map(|p| powerflex_proto::status::SlurmPlacementView {
                    read_ms_ago: p.as_ref().map(|p| now_ms.saturating_sub(p.read_at_ms)),
                    jobs: p.as_ref().map_or(0, |p| p.jobs.len() as u32),
                    error: self.placement_error.clone(),
                });
        status.accounting_db.clone_from(&self.accounting_db);
        if let Some(site) = &self.options.site.domains {
            for node in &mut status.nodes {
                node.domain = site
                    .tree
                    .leaf_of(&node.node)
                    .map(|leaf| site.tree.domains()[leaf].name.clone());
            }
            status.domains = status::domains(
                site,
                &self.state,
                &self.sessions,
                self.last.as_deref(),
                |name| self.domain_base(name),
                now_ms,
            );
        }
        status.leadership.clone_from(&self.leadership);
        status.refused_by = self.fenced_by.clone();
        status
    }

    pub fn state(&self) -> &CtldState {
        &self.state
    }

    pub fn settings(&self) -> &CtldSettings {
        &self.options
    }

    /// Allocations made since the start.
    pub fn allocations(&self) -> u64 {
        self.allocations
    }

    fn hello(&mut self, node: String, gpus: Vec<GpuInfo>, now_ms: u64) {
        info!(node = %node, gpus = gpus.len(), "agent connected");
        let session = self
            .sessions
            .entry(node.clone())
            .or_insert_with(|| Session {
                view: NodeView {
                    node: node.clone(),
                    gpus: Vec::new(),
                    jobs: Vec::new(),
                    power_w: 0.0,
                    live: true,
                },
                last_seen_ms: 0,
                reported: Vec::new(),
                announced: Vec::new(),
                refused_reports: 0,
                refused_gpus: 0,
                observe_only: false,
            });
        session.announced = gpus;
        session.last_seen_ms = now_ms;
        self.believe(&node);
        self.allocate_now = true;
    }

    /// The placement the node's words are checked against: Slurm's, or none at all
    /// (`job_placement = "reports"`: every node believed). A shared handle, so the caller
    /// may hold it while it changes the sessions.
    fn checked_placement(&self) -> Option<Option<std::sync::Arc<Placement>>> {
        match self.options.job_placement {
            JobPlacement::Slurm => Some(self.placement.clone()),
            JobPlacement::Reports => None,
        }
    }

    /// Recomputes what is believed of `node` from what it last said and the placement:
    /// whether its set of jobs changed, and the jobs refused.
    fn believe(&mut self, node: &str) -> (bool, Vec<(String, RefusedBecause)>) {
        let checked = self.checked_placement();
        // Before Slurm's first answer, a node's GPUs are bounded by what it announced
        // before (the state file), and nothing is saved: its word alone is not kept.
        let known_gpus = self.state.nodes.get(node).map(Vec::len);
        let Some(s) = self.sessions.get_mut(node) else {
            return (false, Vec::new());
        };
        let unverified = matches!(checked, Some(None));
        let mut refused = Vec::new();
        let (jobs, gpus, refused_gpus) = match checked {
            None => (s.reported.clone(), s.announced.clone(), 0),
            Some(placement) => {
                let b = Placement::believe(placement.as_deref(), node, &s.reported, &s.announced);
                refused = b.refused;
                let (gpus, refused) = match (unverified, known_gpus) {
                    (true, Some(known)) => (
                        b.gpus.into_iter().take(known).collect::<Vec<_>>(),
                        s.announced.len().saturating_sub(known),
                    ),
                    _ => (b.gpus, b.gpus_refused),
                };
                (b.jobs, gpus, refused)
            }
        };
        let (gpus, clamped) = bound_gpu_power(&gpus, self.options.max_gpu_power_w);
        if clamped && s.view.gpus != gpus {
            warn!(
                node,
                max_gpu_power_w = self.options.max_gpu_power_w,
                "a node announced GPUs above the site's largest GPU model; counted at that model's limit"
            );
        }
        if refused_gpus > 0 && s.refused_gpus as usize != refused_gpus {
            let why = if unverified {
                "a node announced more GPUs than it had before, while Slurm's placement is not read yet; the rest are not counted"
            } else {
                "a node announced more GPUs than Slurm configures for it; the rest are not counted"
            };
            warn!(
                node,
                announced = s.announced.len(),
                believed = gpus.len(),
                "{why}"
            );
        }
        s.refused_gpus = refused_gpus as u32;
        let changed = s
            .view
            .jobs
            .iter()
            .map(|j| &j.job_id)
            .ne(jobs.iter().map(|j| &j.job_id));
        s.view.jobs = jobs;
        s.view.gpus = gpus.clone();
        // Only a list the committed state's own check accepts is kept: one it refuses
        // would make the whole state unloadable at the next start or takeover (every
        // event and budget with it). The node is still paid for (the allocation counts
        // a node whose GPUs fail that check as silent, at the most it may draw).
        if !unverified && self.state.nodes.get(node) != Some(&gpus) && validate_gpus(&gpus).is_ok()
        {
            self.state.nodes.insert(node.to_string(), gpus);
            self.dirty = true;
        }
        (changed, refused)
    }

    /// A new read of Slurm's placement: every node believed again against it.
    fn placement_read(&mut self, read: Result<Placement, String>) {
        match read {
            Ok(placement) => {
                if self.placement_error.take().is_some() {
                    info!(jobs = placement.jobs.len(), "Slurm's placement read again");
                }
                // Where each run is placed is remembered for its final shares, which
                // may come after Slurm has forgotten the job.
                self.ledger.placement(&placement.jobs);
                self.placement = Some(std::sync::Arc::new(placement));
                let nodes: Vec<String> = self.sessions.keys().cloned().collect();
                for node in nodes {
                    self.allocate_now |= self.believe(&node).0;
                }
            }
            Err(e) => {
                if self.placement_error.as_deref() != Some(e.as_str()) {
                    warn!(error = %e, "cannot read Slurm's placement; the last one read stays in force");
                }
                self.placement_error = Some(e);
            }
        }
    }

    fn report(&mut self, node: &str, jobs: Vec<JobReport>, power_w: f64, now_ms: u64) {
        // A report before a hello is dropped: the link only forwards reports from a
        // connection that said hello as this node.
        let Some(s) = self.sessions.get_mut(node) else {
            return;
        };
        let previous = s.view.jobs.clone();
        let previously_reported: BTreeSet<String> =
            s.reported.iter().map(|r| r.job_id.clone()).collect();
        s.reported = jobs;
        // What Slurm does not bear out is refused here, counted and logged, and never
        // reaches the allocation, the annotations, the preemptions or the status. Only a
        // change in the set of jobs needs a new allocation before the next tick.
        let (changed, refused) = self.believe(node);
        if !refused.is_empty() {
            // A job Slurm has not listed yet may just have started: read again now, once
            // per job newly reported (a node repeating a job Slurm does not know cannot
            // make the controller read Slurm every second).
            self.refresh_placement |= refused.iter().any(|(id, why)| {
                *why != RefusedBecause::NotOnThisNode && !previously_reported.contains(id)
            });
            if let Some(s) = self.sessions.get_mut(node) {
                let first = s.refused_reports == 0;
                // Before Slurm's first answer nobody is believed: no node's fault.
                s.refused_reports += refused
                    .iter()
                    .filter(|(_, why)| *why != RefusedBecause::NoPlacementYet)
                    .count() as u64;
                // Logged when a job first appears refused, not at every report.
                for (job_id, why) in &refused {
                    if *why != RefusedBecause::NoPlacementYet
                        && (first || !previously_reported.contains(job_id))
                    {
                        warn!(
                            node,
                            job_id,
                            why = why.label(),
                            "a node reported a job Slurm does not place on it; refused"
                        );
                    }
                }
            }
        }
        if let Some(s) = self.sessions.get(node) {
            self.ledger.running(node, s.view.jobs.iter(), now_ms);
        }
        let Some(s) = self.sessions.get_mut(node) else {
            return;
        };
        let jobs = &s.view.jobs;
        // The caps in force on the node, as its agent read them back: they confirm the
        // decreases a rollout waits for.
        let in_force: BTreeMap<String, f64> = jobs
            .iter()
            .filter_map(|j| {
                j.cap_w
                    .filter(|c| c.is_finite())
                    .map(|c| (j.job_id.clone(), c))
            })
            .collect();
        // A job whose draw rose under a cap that did not rise (a new phase, a new step
        // after an idle gap) makes every increase held for confirmation stale: it was
        // decided when that job drew less, and released now it would raise caps on
        // watts the job has just taken back. Budget first: drop them and allocate at
        // once on what the node says now.
        let rose = jobs.iter().find_map(|new| {
            let old = previous.iter().find(|o| o.job_id == new.job_id)?;
            draw_rose(old, new).then(|| (new.job_id.clone(), old.power_w, new.power_w))
        });
        s.view.power_w = power_w;
        s.last_seen_ms = now_ms;
        self.rollout.confirm(node, &in_force);
        if let Some((job_id, from_w, to_w)) = rose {
            info!(
                node,
                job_id,
                from_w,
                to_w,
                "a job's draw rose under an unchanged cap; held increases dropped, allocating now"
            );
            self.rollout.drop_held();
            self.allocate_now = true;
        }
        // An agent reports right after its hello; the first report after a restart
        // completes what the controller knows of the node.
        let first = self.awaiting.remove(node);
        self.allocate_now |= changed || first;
    }

    /// A valid config replaces the budget, policy, tiers and lease settings at once; the
    /// listen addresses, sockets, state directory, key and period need a restart. A
    /// refused one leaves the config in force and is reported by `status` until a valid
    /// one arrives.
    /// A re-read config's settings replace the ones in force, except what the edge set up
    /// at start (the period its ticker runs at, whether it reads Slurm's placement): those
    /// change only on restart. The edge says the same of its own addresses and paths.
    fn reload(&mut self, reload: SettingsReload) {
        match reload {
            Ok(new) => {
                let old = &self.options;
                if new.period != old.period || new.job_placement != old.job_placement {
                    warn!("site config reloaded; the allocation period and the Slurm placement setting change only on restart");
                }
                info!(
                    base_budget_w = new.base_budget.0,
                    policy = new.site.policy.name(),
                    lease_ttl_s = new.lease_ttl_s,
                    "site config reloaded"
                );
                self.options = CtldSettings {
                    period: old.period,
                    job_placement: old.job_placement,
                    ..new
                };
                // Budgets and events for domains the new config no longer declares are
                // kept (a rename back restores them) but cut nothing: say so.
                let orphans: BTreeSet<&str> = self
                    .state
                    .domain_budgets_w
                    .keys()
                    .map(String::as_str)
                    .chain(self.state.events.iter().filter_map(|e| e.domain.as_deref()))
                    .filter(|name| self.unknown_domain(name).is_some())
                    .collect();
                if !orphans.is_empty() {
                    warn!(domains = ?orphans, "budgets or events name domains the reloaded site config does not declare; they cut nothing");
                }
                for (name, budget) in &self.state.domain_budgets_w {
                    let limit = self.domain_limit(name);
                    if self.unknown_domain(name).is_none() && budget.0 > limit.0 {
                        warn!(
                            domain = %name,
                            budget_w = budget.0,
                            limit_w = limit.0,
                            "a domain's budget is above its reloaded limit; the limit is in force"
                        );
                    }
                }
                self.config_error = None;
                self.allocate_now = true;
            }
            Err(e) => {
                error!(error = %e, "site config reload refused; the previous config stays in force");
                self.config_error = Some(e);
            }
        }
    }

    /// None when the site config declares the power domain `name`; else the refusal
    /// that names the domains it does declare.
    fn unknown_domain(&self, name: &str) -> Option<AdminReply> {
        let declared: Vec<&str> = self
            .options
            .site
            .domains
            .as_ref()
            .map(|d| d.tree.domains().iter().map(|d| d.name.as_str()).collect())
            .unwrap_or_default();
        if declared.contains(&name) {
            return None;
        }
        let accepted = if declared.is_empty() {
            "none: the site config declares no [[domains]]".to_string()
        } else if declared.len() > 12 {
            format!(
                "{} and {} more (powerflexctl domains lists them)",
                declared[..12].join(", "),
                declared.len() - 12
            )
        } else {
            declared.join(", ")
        };
        Some(AdminReply::refused(
            Refusal::NoSuchDomain,
            format!(
                "no power domain {:?}; accepted: {accepted}",
                name.escape_default().to_string()
            ),
        ))
    }

    /// The site's settings with each power domain's limit as it stands over
    /// `[now_ms, now_ms + ahead_ms]`: its budget (an admin's, else its configured limit)
    /// less the deepest cut its events make at any step of that window, so caps are
    /// down before each step of a domain's ramp as they are for the site's.
    fn site_settings_at(&self, now_ms: u64, ahead_ms: u64) -> crate::site::SiteSettings {
        let mut site = self.options.site.clone();
        if let Some(domains) = site.domains.as_mut() {
            for (d, limit) in domains
                .tree
                .domains()
                .iter()
                .zip(domains.limits_w.iter_mut())
            {
                let base = self.domain_base(&d.name);
                let events = crate::schedule::of_domain(&self.state.events, Some(&d.name));
                *limit = crate::schedule::lowest_budget(
                    base,
                    &events,
                    now_ms,
                    now_ms.saturating_add(ahead_ms),
                )
                .0;
            }
        }
        site
    }

    fn admin(&mut self, op: AdminOp, uid: u32, now_ms: u64) -> AdminReply {
        if op.changes_state() && uid != 0 {
            return AdminReply::error("only root may change the budget or grid events");
        }
        if matches!(op, AdminOp::WhatIf { .. }) && uid != 0 {
            // Every job's curve and cap, and a whole allocation's work: not computed
            // only to be withheld.
            return AdminReply::error(
                "what-if shows every job's curve and cap: root only (run powerflexctl as root)",
            );
        }
        match op {
            AdminOp::Status => AdminReply {
                status: Some(self.status(UnixMs(now_ms))),
                ..AdminReply::ok()
            },
            // Answered by the admin threads from the history board, never in this loop
            // (issue 21): one that arrives here was sent by mistake, and the core keeps
            // no history to answer it with.
            AdminOp::History { .. } => {
                warn!("a history request reached the allocation loop; it is answered by the admin socket's threads");
                AdminReply::error("history is served by the admin socket, not the allocation loop")
            }
            AdminOp::Accounting {
                since_ms,
                until_ms,
                uid: of_uid,
                tier,
                job,
                after,
                account,
            } => {
                // A user asks for their own records only (need_to_know filters the rest).
                let of_uid = if uid == 0 { of_uid } else { Some(uid) };
                let records: Vec<JobEnergyRecord> = accounting::records_page(
                    self.ledger.recent(),
                    &accounting::RecordQuery {
                        since_ms,
                        until_ms,
                        uid: of_uid,
                        tier,
                        job,
                        after,
                        account,
                    },
                    powerflex_proto::admin::MAX_RECORDS_PER_REPLY,
                );
                AdminReply {
                    records: Some(records),
                    ..AdminReply::ok()
                }
            }
            AdminOp::BudgetSet { budget_w, domain } => {
                // Within what a committed state may hold (`CtldState::checked`): a budget
                // set here must load again after a restart or a takeover.
                if !(budget_w.is_finite() && budget_w > 0.0 && budget_w <= MAX_BUDGET_W) {
                    return AdminReply::error(format!(
                        "budget must be a positive power of at most {MAX_BUDGET_W} W (got {budget_w} W)"
                    ));
                }
                match domain {
                    None => {
                        info!(budget_w, "budget set");
                        self.state.budget_w = Some(Watts(budget_w));
                    }
                    Some(name) => {
                        if let Some(refused) = self.unknown_domain(&name) {
                            return refused;
                        }
                        // Never above the breaker the site config gives it.
                        let limit = self.domain_limit(&name);
                        if budget_w > limit.0 {
                            return AdminReply::error(format!(
                                "domain {name}'s budget may not exceed its limit in the site config; accepted: at most {limit} (set it to {limit} to give the domain its whole limit back)"
                            ));
                        }
                        info!(budget_w, domain = %name, "domain budget set");
                        self.state.domain_budgets_w.insert(name, Watts(budget_w));
                    }
                }
                self.dirty = true;
                AdminReply::ok()
            }
            AdminOp::EventAdd {
                cut,
                start_ms,
                duration_ms,
                ramp_ms,
                domain,
            } => {
                // The admin CLI checks its arguments, but the VEN passes on what a VTN
                // serves: the controller is where an event is accepted or not.
                if let Err(why) =
                    powerflex_proto::event::check_new_event(&cut, start_ms, duration_ms, ramp_ms)
                {
                    return AdminReply::refused(Refusal::EventOutOfRange, why);
                }
                if let Some(name) = &domain {
                    if let Some(refused) = self.unknown_domain(name) {
                        return refused;
                    }
                }
                let held = self
                    .state
                    .events
                    .iter()
                    .filter(|e| e.pending(now_ms))
                    .count();
                if held >= powerflex_proto::event::MAX_PENDING_EVENTS {
                    return AdminReply::refused(
                        Refusal::TooManyEvents,
                        format!(
                            "the controller holds {held} events already; accepted: at most {} at once (cancel one, or wait for one to end)",
                            powerflex_proto::event::MAX_PENDING_EVENTS
                        ),
                    );
                }
                self.state.next_event_id += 1;
                let event = Event {
                    id: self.state.next_event_id,
                    cut,
                    start_ms,
                    duration_ms,
                    ramp_ms,
                    domain,
                };
                info!(
                    id = event.id,
                    ?cut,
                    start_ms,
                    duration_ms,
                    ramp_ms,
                    "grid event added"
                );
                self.state.events.push(event);
                self.dirty = true;
                AdminReply {
                    event_id: Some(self.state.next_event_id),
                    ..AdminReply::ok()
                }
            }
            AdminOp::EventCancel { id } => {
                let before = self.state.events.len();
                self.state.events.retain(|e| e.id != id);
                if self.state.events.len() == before {
                    return AdminReply::refused(Refusal::NoSuchEvent, format!("no event {id}"));
                }
                info!(id, "grid event cancelled");
                self.dirty = true;
                AdminReply::ok()
            }
            AdminOp::ForgetNode { node } => {
                let ttl_ms = (self.options.lease_ttl_s * 1000.0) as u64;
                let known =
                    self.state.nodes.contains_key(&node) || self.sessions.contains_key(&node);
                if !known {
                    return AdminReply::refused(
                        Refusal::NoSuchNode,
                        format!("no node {node:?} is known; `powerflexctl status` lists them"),
                    );
                }
                if self.awaiting.contains(&node) {
                    return AdminReply::refused(
                        Refusal::NodeLive,
                        format!("node {node} is awaited after the controller's restart (its last lease may still hold its caps); try again once `powerflexctl nodes` shows it silent past a lease ({:.0} s)", self.options.lease_ttl_s),
                    );
                }
                if let Some(s) = self.sessions.get(&node) {
                    let ago_ms = now_ms.saturating_sub(s.last_seen_ms);
                    if s.last_seen_ms > 0 && ago_ms < ttl_ms {
                        return AdminReply::refused(
                            Refusal::NodeLive,
                            format!(
                                "node {node} reported {:.1} s ago; stop its agent and wait out its lease ({:.0} s) first: forgetting a live node would leave its GPUs out of the budget",
                                ago_ms as f64 / 1000.0,
                                self.options.lease_ttl_s
                            ),
                        );
                    }
                }
                warn!(node = %node, "node forgotten by an admin");
                self.sessions.remove(&node);
                self.awaiting.remove(&node);
                self.state.nodes.remove(&node);
                self.dirty = true;
                AdminReply::ok()
            }
            AdminOp::WhatIf {
                policy,
                budget_w,
                ignore_tiers,
            } => {
                let budget = match budget_w {
                    Some(w) if !(w.is_finite() && w > 0.0) => {
                        return AdminReply::error(format!(
                            "budget must be a positive power (got {w} W)"
                        ))
                    }
                    Some(w) => Watts(w),
                    None => effective_budget(
                        self.state.budget_w.unwrap_or(self.options.base_budget),
                        &crate::schedule::of_domain(&self.state.events, None),
                        now_ms,
                    ),
                };
                let mut views: Vec<NodeView> =
                    self.sessions.values().map(|s| s.view.clone()).collect();
                crate::site::apply_least_flexible_tiers(&mut views, &self.options.site.tiers);
                let settings = crate::site::SiteSettings {
                    policy,
                    tier_bounds: if ignore_tiers {
                        crate::site::TierBounds::Ignored
                    } else {
                        crate::site::TierBounds::Honoured
                    },
                    // The domains' limits in force now.
                    ..self.site_settings_at(now_ms, 0)
                };
                // Jobs held out of a deep cut stay out: another policy would not resume
                // them by itself.
                let held: crate::site::Held = self
                    .state
                    .preempted
                    .keys()
                    .map(|job| (job.clone(), None))
                    .collect();
                AdminReply {
                    what_if: Some(status::decision_view(&decide_holding(
                        &views, budget, &settings, &held,
                    ))),
                    ..AdminReply::ok()
                }
            }
        }
    }

    /// A node's lease with `caps`: `decision`'s start cap and the node's jobs to walk
    /// again (before any decision: the fail-safe cap, nothing to walk).
    /// How many live or silent nodes report each job, counted once per allocation: a
    /// lease's `learn` list asks it of every job it names, and a scan of every node per
    /// job made the allocation quadratic in the nodes (24 s at 10,000 in the site harness).
    fn nodes_reporting_each_job(&self) -> BTreeMap<&str, usize> {
        let mut count: BTreeMap<&str, usize> = BTreeMap::new();
        for session in self.sessions.values() {
            // A node that reports a job twice still counts once.
            let mut seen: BTreeSet<&str> = BTreeSet::new();
            for job in &session.view.jobs {
                if seen.insert(job.job_id.as_str()) {
                    *count.entry(job.job_id.as_str()).or_default() += 1;
                }
            }
        }
        count
    }

    /// The events that concern `node`: the site's, and those of the power domains it
    /// is in, each with the budget it cuts from.
    fn events_of_node(&self, node: &str) -> Vec<(Watts, &Event)> {
        let site_base = self.state.budget_w.unwrap_or(self.options.base_budget);
        let path: Vec<&str> = self
            .options
            .site
            .domains
            .as_ref()
            .map(|d| {
                d.tree
                    .path_of_node(node)
                    .into_iter()
                    .map(|i| d.tree.domains()[i].name.as_str())
                    .collect()
            })
            .unwrap_or_default();
        self.state
            .events
            .iter()
            .filter_map(|e| match e.domain.as_deref() {
                None => Some((site_base, e)),
                Some(name) if path.contains(&name) => Some((self.domain_base(name), e)),
                Some(_) => None,
            })
            .collect()
    }

    /// A power domain's budget before its events: an admin's, else its configured limit
    /// (0 for a domain the config no longer declares, which no event can name anyway).
    ///
    /// An admin's budget is at most the limit: `budget set --domain` refuses more, and a
    /// reload that lowers the limit below a budget set earlier (a breaker found smaller)
    /// puts the new limit in force, never the old budget.
    fn domain_base(&self, name: &str) -> Watts {
        let limit = self.domain_limit(name);
        self.state
            .domain_budgets_w
            .get(name)
            .map_or(limit, |&budget| Watts(budget.0.min(limit.0)))
    }

    /// A power domain's limit in the site config (0 for one it does not declare).
    fn domain_limit(&self, name: &str) -> Watts {
        self.options
            .site
            .domains
            .as_ref()
            .and_then(|d| d.tree.find(name).map(|i| d.tree.domains()[i].gpu_limit))
            .unwrap_or(Watts::ZERO)
    }

    /// The event in force now with the deepest cut of its own budget: the site's first,
    /// else a domain's (for the learning snapshots and the metrics).
    fn event_in_force_anywhere(&self, now_ms: u64) -> Option<u64> {
        let site_base = self.state.budget_w.unwrap_or(self.options.base_budget);
        let site_events = crate::schedule::of_domain(&self.state.events, None);
        active_event(site_base, &site_events, now_ms)
            .map(|e| e.id)
            .or_else(|| {
                self.state
                    .events
                    .iter()
                    .filter_map(|e| {
                        let domain = e.domain.as_deref()?;
                        let cut = e.cut_w(self.domain_base(domain).0, now_ms);
                        (cut > 0.0).then_some((cut, e.id))
                    })
                    .max_by(|a, b| a.0.total_cmp(&b.0))
                    .map(|(_, id)| id)
            })
    }

    fn lease_for(
        &self,
        node: &str,
        decision: Option<&Decision>,
        caps: BTreeMap<String, f64>,
        reporting: &BTreeMap<&str, usize>,
        now_ms: u64,
    ) -> Lease {
        let (start_cap_w, recalibrate) = match decision {
            Some(d) => (
                d.start_cap_w,
                d.drifted
                    .iter()
                    .filter(|x| caps.contains_key(&x.job))
                    .map(|x| x.job.clone())
                    .collect(),
            ),
            None => (self.options.site.failsafe_cap.0, Vec::new()),
        };
        // A job starting behind a tight domain starts at that domain's share, not the
        // site's.
        let start_cap_w = self
            .options
            .site
            .domains
            .as_ref()
            .map(|d| d.tree.path_of_node(node))
            .unwrap_or_default()
            .into_iter()
            .filter_map(|d| self.domain_start_cap_w.get(d).copied())
            .fold(start_cap_w, f64::min);
        // A job reported by one node only: a probe there slows no other node's windows.
        let learn = caps
            .keys()
            .filter(|job| reporting.get(job.as_str()) == Some(&1))
            .cloned()
            .collect();
        Lease {
            caps,
            start_cap_w,
            recalibrate,
            learn,
            // A domain's event concerns only the nodes behind it.
            next_event_in_s: next_event_in_s(
                self.events_of_node(node).into_iter().map(|(_, e)| e),
                now_ms,
            ),
            event_in_force: self
                .events_of_node(node)
                .iter()
                .any(|(base, e)| e.cut_w(base.0, now_ms) > 0.0),
        }
    }

    fn allocate(&mut self, now_ms: u64, out: &mut Output) {
        let ttl_ms = (self.options.lease_ttl_s * 1000.0) as u64;
        for s in self.sessions.values_mut() {
            s.view.live = now_ms.saturating_sub(s.last_seen_ms) < ttl_ms;
        }
        if now_ms < self.hold_until_ms {
            return;
        }
        // Slurm's first answer (a fraction of a second after the start) is awaited as the
        // known agents are: allocating before it would believe no job and hold every one
        // at the start cap until it came, while the old leases still hold their caps.
        let placement_due = self.options.job_placement == JobPlacement::Slurm
            && self.placement.is_none()
            && self.placement_error.is_none();
        if placement_due && now_ms < self.grace_until_ms {
            return;
        }
        if !self.awaiting.is_empty() {
            if now_ms < self.grace_until_ms {
                // Their old leases still hold every cap; nothing is lost by waiting.
                return;
            }
            warn!(nodes = ?self.awaiting, "agents known before the restart did not reconnect; counting them at their fail-safe cap");
            self.awaiting.clear();
        }
        let before = self.state.events.len();
        self.state.events.retain(|e| e.pending(now_ms));
        if self.state.events.len() != before {
            self.dirty = true;
        }
        let base = self.state.budget_w.unwrap_or(self.options.base_budget);
        // A node that has not confirmed the decreases it was sent within a period is
        // counted at the most it may draw (as a silent node) until it does.
        let period_ms = self.options.period.as_millis() as u64;
        let confirm_ms = period_ms.max(MIN_CONFIRM_MS);
        // Caps are set for the lowest step until the next allocation's caps are
        // confirmed, so each step down finds them already in force.
        let ahead_ms = look_ahead_ms(period_ms, confirm_ms);
        let plan = self.ramp.plan(
            base,
            &crate::schedule::of_domain(&self.state.events, None),
            now_ms,
            ahead_ms,
            self.options.max_ramp_w_per_s,
        );
        // Each power domain's limit over the same window (its own events' ramps), its
        // rise held to the site's ramp-rate limit as the site's is.
        let mut site = self.site_settings_at(now_ms, ahead_ms);
        if let Some(domains) = site.domains.as_mut() {
            for (d, limit) in domains
                .tree
                .domains()
                .iter()
                .zip(domains.limits_w.iter_mut())
            {
                let base = self.domain_base(&d.name);
                let events = crate::schedule::of_domain(&self.state.events, Some(&d.name));
                let plan = self.domain_ramps.entry(d.name.clone()).or_default().plan(
                    base,
                    &events,
                    now_ms,
                    ahead_ms,
                    self.options.max_ramp_w_per_s,
                );
                *limit = plan.allocate_w;
            }
        }
        self.domain_start_cap_w = match &site.domains {
            None => Vec::new(),
            Some(d) => {
                let mut gpus = vec![0usize; d.limits_w.len()];
                for s in self.sessions.values() {
                    for i in d.tree.path_of_node(&s.view.node) {
                        gpus[i] += s.view.gpus.len();
                    }
                }
                d.limits_w
                    .iter()
                    .zip(gpus)
                    .map(|(&limit, g)| {
                        if g == 0 {
                            f64::INFINITY
                        } else {
                            limit / g as f64
                        }
                    })
                    .collect()
            }
        };
        if plan.rate_limited {
            info!(
                allocate_w = plan.allocate_w,
                in_force_w = plan.in_force_w,
                "budget rise held to the ramp-rate limit"
            );
        }
        let in_force = Watts(plan.in_force_w);
        let budget = Watts(plan.allocate_w);
        self.last_plan = Some(plan);
        let stalled = self.rollout.stalled(now_ms, confirm_ms);
        if !stalled.is_empty() {
            warn!(nodes = ?stalled, "decreases not confirmed in time; counting those nodes at the most they may draw");
        }
        let mut views: Vec<NodeView> = self
            .sessions
            .values()
            .map(|s| {
                let mut view = s.view.clone();
                // A node that refused this controller's epoch is steered by another: it
                // is paid for as a silent node, at the most it may draw.
                view.live &=
                    !stalled.contains(&view.node) && !self.fenced_by.contains_key(&view.node);
                view
            })
            .collect();
        // A job on several nodes is as flexible as the least flexible of them says: the
        // decision, the preemptions and the annotations all read these views.
        crate::site::apply_least_flexible_tiers(&mut views, &self.options.site.tiers);
        // Caps first; where caps at every floor cannot meet the budget, jobs that allow
        // it are held out (crate::preempt), and given back once they fit again.
        // A domain's own event counts too: a job requeued for it is not released while
        // its domain is still cut.
        let domain_cut = site.domains.as_ref().is_some_and(|d| {
            d.tree
                .domains()
                .iter()
                .zip(&d.limits_w)
                .any(|(domain, &limit)| limit < self.domain_base(&domain.name).0 - 0.5)
        });
        let cut_ahead = plan.ahead_w < base.0 - 0.5 || plan.in_force_w < base.0 - 0.5 || domain_cut;
        // The caps in force stay while a new decision would buy too little to be worth a
        // change (site::decide_steady).
        let caps_in_force: BTreeMap<String, f64> = self
            .last
            .as_ref()
            .and_then(|d| d.allocation.as_ref())
            .map(|a| a.jobs.iter().map(|j| (j.id.clone(), j.cap_w.0)).collect())
            .unwrap_or_default();
        let preempt::Plan {
            decision,
            held,
            actions,
        } = {
            // Slurm's record says when a held job ended; before its first answer, none
            // has (a held job is never dropped on a node's silence).
            let placement = self.placement.as_ref();
            let in_slurm = |job: &str| {
                placement.is_none_or(|p| {
                    p.jobs.get(job).is_some_and(|j| {
                        j.state != powerflex_core::slurm_record::SlurmJobState::Ended
                    })
                })
            };
            let outlook = preempt::Outlook {
                cut_ahead,
                in_slurm: match self.options.job_placement {
                    JobPlacement::Slurm => Some(&in_slurm),
                    JobPlacement::Reports => None,
                },
            };
            preempt::plan(
                &views,
                budget,
                &site,
                &self.state.preempted,
                outlook,
                &caps_in_force,
                now_ms,
            )
        };
        // Observe mode enforces nothing: a job on an observe-only node is never held out
        // (what would happen is logged), so a site's first week suspends no one.
        let observed: BTreeSet<&str> = self
            .sessions
            .values()
            .filter(|s| s.observe_only)
            .flat_map(|s| s.view.jobs.iter().map(|j| j.job_id.as_str()))
            .collect();
        let (held, actions) = if observed.is_empty() {
            (held, actions)
        } else {
            let (kept, skipped): (Vec<Action>, Vec<Action>) = actions
                .into_iter()
                .partition(|a| !observed.contains(a.job()));
            for a in &skipped {
                let [what, job_id] = a.scontrol_args();
                info!(
                    job_id,
                    action = what,
                    "observe mode: would hold the job out; not done"
                );
            }
            let held = held
                .into_iter()
                .filter(|(job, _)| !observed.contains(job.as_str()))
                .collect();
            (held, kept)
        };
        for action in &actions {
            let [what, job_id] = action.scontrol_args();
            match action {
                Action::Suspend { .. } | Action::Requeue { .. } => {
                    warn!(
                        job_id,
                        action = what,
                        budget_w = budget.0,
                        "deep cut: caps at every floor cannot meet the budget; holding the job out"
                    );
                }
                Action::Resume { .. } | Action::Release { .. } => {
                    info!(
                        job_id,
                        action = what,
                        budget_w = budget.0,
                        "the budget holds every floor again; giving the job back"
                    );
                }
            }
        }
        if held != self.state.preempted {
            self.state.preempted = held;
            self.dirty = true;
        }
        out.preempt = actions;
        if let Some(a) = &decision.allocation {
            if a.over_budget_w.0 > 0.0 || a.broken_floors().next().is_some() {
                error!(
                    budget_w = budget.0,
                    short_w = a.over_budget_w.0,
                    broken = a.broken_floors().count(),
                    "the budget cannot hold every tier bound"
                );
            }
        }
        let sends: Vec<LeaseOut> = match self.options.lease_rollout {
            LeaseRollout::TwoStep => {
                let sends = self
                    .rollout
                    .begin(&decision.leases, decision.start_cap_w, now_ms);
                if self.rollout.holding_increases() {
                    info!("increases held until the decreases are confirmed");
                }
                sends
            }
            LeaseRollout::AtOnce => decision
                .leases
                .iter()
                .map(|(node, caps)| LeaseOut {
                    node: node.clone(),
                    caps: caps.clone(),
                })
                .collect(),
        };
        let reporting = self.nodes_reporting_each_job();
        out.leases = sends
            .into_iter()
            .map(|l| {
                let lease = self.lease_for(&l.node, Some(&decision), l.caps, &reporting, now_ms);
                (l.node, lease)
            })
            .collect();
        out.annotations = annotate::changes(
            &decision,
            &self.state.preempted,
            views.iter().flat_map(|v| v.jobs.iter()),
            &mut self.annotations,
        );
        // What a site wrote in a job's AdminComment stays, before powerflex's segment.
        if let Some(placement) = &self.placement {
            for (job, text) in &mut out.annotations {
                if let Some(j) = placement.jobs.get(job.as_str()) {
                    *text = accounting::merge_admin_comment(&j.admin_comment, text);
                }
            }
        }
        let draw = status::live_draw_w(&self.sessions);
        // The owners of the jobs this sample names, remembered while the history holds it
        // (and while a job is held out, for the status).
        self.owners.observe(
            self.sessions.values().flat_map(|s| s.view.jobs.iter()),
            now_ms,
        );
        let window_ms = (HISTORY as u64).saturating_mul(self.options.period.as_millis() as u64);
        let preempted = &self.state.preempted;
        self.owners
            .forget_before(now_ms.saturating_sub(window_ms), |job| {
                preempted.contains_key(job)
            });
        let caps: BTreeMap<String, f64> = decision
            .allocation
            .as_ref()
            .map(|a| a.jobs.iter().map(|j| (j.id.clone(), j.cap_w.0)).collect())
            .unwrap_or_default();
        let domains = self
            .options
            .site
            .domains
            .as_ref()
            .map(|site| {
                status::domains(
                    site,
                    &self.state,
                    &self.sessions,
                    Some(&decision),
                    |name| self.domain_base(name),
                    now_ms,
                )
            })
            .unwrap_or_default();
        out.history = Some(Arc::new(HistorySample {
            t_ms: now_ms,
            budget_w: in_force.0,
            draw_w: draw,
            caps,
            domains: domains
                .iter()
                .filter(|d| d.depth == 0 || d.event.is_some())
                .take(powerflex_proto::status::MAX_SAMPLED_DOMAINS)
                .map(|d| {
                    (
                        d.name.clone(),
                        powerflex_proto::status::DomainSample {
                            budget_w: d.budget_w,
                            draw_w: d.draw_w,
                        },
                    )
                })
                .collect(),
            simulated: self
                .sessions
                .values()
                .any(|s| s.view.live && s.view.gpus.iter().any(|g| g.name.contains("(simulated)"))),
        }));
        out.owners = self.owners.take_changed().map(Arc::new);
        self.allocations += 1;
        let event = self.event_in_force_anywhere(now_ms);
        learning::record(
            &mut self.curve_history,
            &self.sessions,
            self.last_event.filter(|e| event != Some(*e)),
            now_ms,
        );
        self.last_event = event;
        let decision = Arc::new(decision);
        out.metrics = Some(MetricsSnapshot {
            decision: Arc::clone(&decision),
            base,
            budget: in_force,
            allocated: budget,
            draw_w: draw,
            nodes: self
                .sessions
                .iter()
                .map(|(n, s)| (n.clone(), s.view.live))
                .collect(),
            refused: self
                .sessions
                .iter()
                .map(|(n, s)| (n.clone(), s.refused_reports))
                .collect(),
            event_active: event.is_some(),
            preempted: self.state.preempted.clone(),
            energy: self.energy_totals.clone(),
            accounting_db: self.accounting_db.clone(),
            domains,
        });
        self.last = Some(decision);
    }
}

/// Seconds from `now_ms` to the start of the next event not yet started, if any.
fn next_event_in_s<'a>(events: impl IntoIterator<Item = &'a Event>, now_ms: u64) -> Option<f64> {
    events
        .into_iter()
        .filter(|e| e.start_ms > now_ms)
        .map(|e| (e.start_ms - now_ms) as f64 / 1000.0)
        .min_by(f64::total_cmp)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ctld::history::HistoryBoard;
    use crate::site::SiteSettings;
    use powerflex_core::allocate::Policy;
    use powerflex_core::config::{BudgetMode, Objective};
    use powerflex_core::flex::TierTable;
    use powerflex_proto::admin::Cut;
    use powerflex_proto::status::{CurvePoint, ThroughputUnit};
    use std::time::Duration;

    /// A fake clock's start: an ordinary Unix time in ms.
    const T0: u64 = 1_800_000_000_000;
    const TTL_S: f64 = 30.0;

    fn options() -> CtldSettings {
        CtldSettings {
            base_budget: Watts(10_000.0),
            period: Duration::from_secs(10),
            lease_ttl_s: TTL_S,
            site: SiteSettings {
                tiers: TierTable::default_table(),
                policy: Policy::Optimal,
                cap_step: Watts(10.0),
                failsafe_cap: Watts(500.0),
                default_pfi: 1.3,
                budget_mode: BudgetMode::Metered { margin: 0.0 },
                objective: Objective::Tokens,
                tier_bounds: crate::site::TierBounds::Honoured,
                domains: None,
            },
            lease_rollout: LeaseRollout::TwoStep,
            max_ramp_w_per_s: None,
            job_placement: JobPlacement::Reports,
            max_gpu_power_w: 700.0,
        }
    }

    fn fresh() -> Core {
        Core::new(options(), Loaded::default(), UnixMs(T0))
    }

    fn gpus(n: u32) -> Vec<GpuInfo> {
        (0..n)
            .map(|i| GpuInfo {
                uuid: format!("GPU-{i}"),
                name: "NVIDIA H200".into(),
                min_w: 200.0,
                max_w: 700.0,
                default_w: 700.0,
            })
            .collect()
    }

    fn job(id: &str, pfi: Option<f64>) -> JobReport {
        JobReport {
            job_id: id.into(),
            tier: "flex2".into(),
            gpus: 4,
            cap_w: Some(700.0),
            // On its curve: 4 GPUs at 700 W.
            power_w: Some(2800.0),
            throughput: Some(1000.0),
            throughput_unit: Some(ThroughputUnit::Tokens),
            pfi,
            pfi_source: None,
            points: [700.0, 500.0, 300.0]
                .iter()
                .map(|&c| [c, c * 4.0, 1000.0 * (1.0 - (1.0 - c / 700.0) / 2.0)])
                .collect(),
            gpu_uuids: Vec::new(),
            power_cap_w: None,
            power_cap_steady_s: Some(10.0),
            calibrating: false,
            curve: Vec::new(),
            calibration_cost_pct: None,
            owner_uid: None,
            usage: None,
        }
    }

    /// Room for two of [`job`]'s 4-GPU jobs.
    fn hello(node: &str) -> Input {
        Input::Hello {
            node: node.into(),
            gpus: gpus(8),
        }
    }

    fn report(node: &str, jobs: Vec<JobReport>) -> Input {
        Input::Report {
            ended: Vec::new(),
            observe_only: false,
            node: node.into(),
            power_w: 2800.0 * jobs.len() as f64,
            jobs,
        }
    }

    fn admin(op: AdminOp, uid: u32) -> Input {
        Input::Admin { op, uid }
    }

    /// Root sets the site's budget (`domain: None`) or a domain's.
    fn budget_set(budget_w: f64, domain: Option<&str>) -> Input {
        admin(
            AdminOp::BudgetSet {
                budget_w,
                domain: domain.map(str::to_string),
            },
            0,
        )
    }

    fn slurm_placed(jobs: &[(&str, &[&str], u32)]) -> Input {
        use powerflex_core::slurm_record::{SlurmJob, SlurmJobState};
        Input::Placement(Box::new(Ok(Placement {
            jobs: jobs
                .iter()
                .map(|(id, nodes, uid)| {
                    (
                        id.to_string(),
                        SlurmJob {
                            nodes: nodes.iter().map(|n| n.to_string()).collect(),
                            uid: *uid,
                            state: SlurmJobState::OnItsNodes,
                            admin_comment: String::new(),
                            account: "physics".to_string(),
                            start_unix_s: Some(T0 / 1000 - 60),
                        },
                    )
                })
                .collect(),
            node_gpus: [("n1".to_string(), 8), ("n2".to_string(), 8)].into(),
            read_at_ms: T0,
        })))
    }

    fn usage(job: &str, node: &str, energy_mj: u64, ended: bool) -> NodeUsage {
        NodeUsage {
            job_id: job.into(),
            node: node.into(),
            uid: 0,
            tier: "flex2".into(),
            gpus: vec![],
            energy_mj,
            energy_source: powerflex_proto::usage::EnergySource::Counter,
            from_unix_ms: T0,
            to_unix_ms: T0 + 10_000,
            peak_power_w: 2800.0,
            observed_s: 10.0,
            capped_s: 5.0,
            event_s: 0.0,
            power_throttled_s: 0.0,
            throttle_known_s: 10.0,
            caps: vec![],
            slowdown_pct: Some(2.0),
            bound_pct: Some(25.0),
            bound_held: Some(true),
            saved_estimate_j: None,
            work: None,
            work_unit: None,
            pfi: Some(1.5),
            ended,
            simulated: true,
        }
    }

    /// Issue 23: a two-node job's shares become one record, owned by Slurm's uid, and
    /// read back by its owner only; while it runs its AdminComment keeps the site's text.
    #[test]
    fn a_job_s_nodes_shares_make_one_record_its_owner_reads() {
        const ALICE: u32 = 1001;
        const BOB: u32 = 1002;
        let mut core = Core::new(
            CtldSettings {
                job_placement: JobPlacement::Slurm,
                ..options()
            },
            Loaded::default(),
            UnixMs(T0),
        );
        let Input::Placement(mut placed) = slurm_placed(&[("101", &["n1", "n2"], ALICE)]) else {
            unreachable!()
        };
        if let Ok(p) = placed.as_mut() {
            if let Some(j) = p.jobs.get_mut("101") {
                j.admin_comment = "project=X".into();
            }
        }
        let running = |node: &str, mj: u64| {
            let mut j = job("101", None);
            j.owner_uid = Some(ALICE);
            j.usage = Some(usage("101", node, mj, false));
            j
        };
        let out = core.step(
            UnixMs(T0),
            vec![
                Input::Placement(placed),
                hello("n1"),
                hello("n2"),
                report("n1", vec![running("n1", 3_600_000)]),
                report("n2", vec![running("n2", 3_600_000)]),
                // n3 was never believed for job 101: its word is ignored.
                hello("n3"),
            ],
        );
        let (_, text) = out
            .annotations
            .iter()
            .find(|(j, _)| j == "101")
            .expect("annotated");
        assert!(
            text.starts_with("project=X | powerflex;tier=flex2;"),
            "{text}"
        );
        assert!(text.ends_with(";energy_kwh_so_far=0.0020"), "{text}");
        let ended = |node: &str, mj: u64| Input::Report {
            node: node.into(),
            jobs: vec![],
            power_w: 0.0,
            ended: vec![usage("101", node, mj, true)],
            observe_only: false,
        };
        let out = core.step(
            UnixMs(T0 + 11_000),
            vec![ended("n1", 4_000_000), ended("n3", 1 << 40)],
        );
        assert!(out.job_records.is_empty(), "n2's final share is awaited");
        assert!(
            out.final_acks.is_empty(),
            "nothing acknowledged before the record"
        );
        let out = core.step(UnixMs(T0 + 12_000), vec![ended("n2", 3_000_000)]);
        assert_eq!(out.job_records.len(), 1);
        let r = &out.job_records[0];
        assert_eq!((r.energy_j, r.uid, r.nodes.len()), (7_000.0, ALICE, 2));
        assert_eq!(r.account.as_deref(), Some("physics"), "Slurm's account");
        // Re-sent finals write nothing more.
        assert_eq!(
            r.run_start_unix_ms,
            Some(T0 - 60_000),
            "Slurm's start of the run"
        );
        // Both nodes' final shares are acknowledged with the record, n3's never.
        let acked: Vec<&String> = out.final_acks.keys().collect();
        assert_eq!(acked, ["n1", "n2"]);
        // Re-sent finals write nothing more, and are acknowledged again.
        let out = core.step(UnixMs(T0 + 13_000), vec![ended("n1", 4_000_000)]);
        assert!(out.job_records.is_empty());
        assert_eq!(out.final_acks.get("n1").map(Vec::len), Some(1));
        // A malformed list of final shares (too many) is refused whole, and counted.
        let flood = Input::Report {
            node: "n1".into(),
            jobs: vec![],
            power_w: 0.0,
            ended: vec![usage("101", "n1", 1, true); 17],
            observe_only: false,
        };
        let out = core.step(UnixMs(T0 + 13_500), vec![flood]);
        assert!(out.final_acks.is_empty() && out.job_records.is_empty());
        assert_eq!(core.sessions["n1"].refused_reports, 1);
        let ask = |uid| {
            admin(
                AdminOp::Accounting {
                    since_ms: None,
                    until_ms: None,
                    uid: None,
                    tier: None,
                    job: None,
                    account: None,
                    after: None,
                },
                uid,
            )
        };
        let out = core.step(UnixMs(T0 + 14_000), vec![ask(ALICE), ask(BOB), ask(0)]);
        let counts: Vec<usize> = out
            .replies
            .iter()
            .map(|(_, r)| r.records.as_ref().map_or(usize::MAX, Vec::len))
            .collect();
        assert_eq!(
            counts,
            vec![1, 0, 1],
            "alice's own, none of bob's, root all"
        );
    }

    /// Issue 21: root on n2 (n2's link key) reported n1's flex0 job as
    /// `flex3,preempt=requeue` with 5 kW GPUs, and the controller believed it.
    #[test]
    fn a_node_is_believed_only_about_the_jobs_slurm_places_on_it() {
        let mut core = Core::new(
            CtldSettings {
                job_placement: JobPlacement::Slurm,
                ..options()
            },
            Loaded::default(),
            UnixMs(T0),
        );
        let mut forged = job("101", None);
        forged.tier = "flex3,preempt=requeue".into();
        forged.owner_uid = Some(0);
        let mut fake_gpus = gpus(8);
        fake_gpus.extend(gpus(292).into_iter().map(|mut g| {
            g.uuid.push_str("-fake");
            g.max_w = 5000.0;
            g.default_w = 5000.0;
            g
        }));
        // Before Slurm answered: nothing believed, and a read asked for.
        let out = core.step(
            UnixMs(T0),
            vec![
                hello("n1"),
                report("n1", vec![job("101", None)]),
                Input::Hello {
                    node: "n2".into(),
                    gpus: fake_gpus,
                },
                report("n2", vec![forged.clone(), job("102", None)]),
            ],
        );
        assert!(out.refresh_placement);
        assert!(
            out.leases.is_empty(),
            "the first allocation waits for Slurm's first answer: {out:?}"
        );
        assert!(
            core.status(UnixMs(T0)).jobs.is_empty(),
            "no job believed before Slurm answered"
        );
        // Slurm: 101 on n1 (uid 1001), 102 on n2 (uid 1002).
        let out = core.step(
            UnixMs(T0 + 100),
            vec![slurm_placed(&[
                ("101", &["n1"], 1001),
                ("102", &["n2"], 1002),
            ])],
        );
        assert!(
            out.leases.contains_key("n1"),
            "allocated once Slurm answered: {out:?}"
        );
        let status = core.status(UnixMs(T0 + 100));
        let jobs: Vec<(&str, &[String], Option<u32>, &str)> = status
            .jobs
            .iter()
            .map(|j| {
                (
                    j.job.as_str(),
                    j.nodes.as_slice(),
                    j.owner_uid,
                    j.tier.as_str(),
                )
            })
            .collect();
        assert_eq!(
            jobs,
            [
                ("101", &["n1".to_string()][..], Some(1001), "flex2"),
                ("102", &["n2".to_string()][..], Some(1002), "flex2"),
            ],
            "n2's word about 101 is not taken; the owners are Slurm's"
        );
        let n2 = status.nodes.iter().find(|n| n.node == "n2").expect("n2");
        assert_eq!(
            (n2.gpus, n2.refused_gpus),
            (8, 292),
            "GPUs bounded by Slurm's gres"
        );
        // n2's lease never names n1's job; nothing is preempted or annotated for it there.
        let out = core.step(
            UnixMs(T0 + 200),
            vec![report("n2", vec![forged, job("102", None)]), Input::Tick],
        );
        if let Some(lease) = out.leases.get("n2") {
            assert!(!lease.caps.contains_key("101"), "{lease:?}");
        }
        let n2 = core
            .status(UnixMs(T0 + 200))
            .nodes
            .into_iter()
            .find(|n| n.node == "n2");
        assert_eq!(
            n2.map(|n| n.refused_reports),
            Some(1),
            "the forged report, read after Slurm answered, counted on its sender"
        );
        assert!(out.preempt.is_empty());
        assert!(out
            .annotations
            .iter()
            .all(|(job, text)| job != "101" || text.contains("tier=flex2")));
        // Slurm away: the last placement stays in force, and status says why.
        core.step(
            UnixMs(T0 + 300),
            vec![Input::Placement(Box::new(Err(
                "squeue: no answer within 5.0 s".into(),
            )))],
        );
        let status = core.status(UnixMs(T0 + 300));
        assert_eq!(status.jobs.len(), 2);
        let slurm = status.slurm.expect("placement shown");
        assert_eq!(slurm.jobs, 2);
        assert!(slurm.error.is_some_and(|e| e.contains("no answer")));
        // The job ended in Slurm: no longer believed, even while its node still reports it.
        core.step(
            UnixMs(T0 + 400),
            vec![slurm_placed(&[("102", &["n2"], 1002)])],
        );
        let ids: Vec<String> = core
            .status(UnixMs(T0 + 400))
            .jobs
            .into_iter()
            .map(|j| j.job)
            .collect();
        assert_eq!(ids, ["102"]);
    }

    #[test]
    fn an_admin_forgets_a_silent_node_but_not_a_live_one() {
        let mut core = running();
        let forget = |node: &str| AdminOp::ForgetNode { node: node.into() };
        let out = core.step(UnixMs(T0 + 10), vec![admin(forget("n1"), 0)]);
        assert_eq!(reply(&out).refusal, Some(Refusal::NodeLive), "{out:?}");
        let out = core.step(UnixMs(T0 + 10), vec![admin(forget("n9"), 0)]);
        assert_eq!(reply(&out).refusal, Some(Refusal::NoSuchNode));
        let later = T0 + (TTL_S * 1000.0) as u64 + 1_000;
        let out = core.step(UnixMs(later), vec![admin(forget("n1"), 1000)]);
        assert!(!reply(&out).ok, "root only");
        let out = core.step(
            UnixMs(later),
            vec![report("n2", vec![job("102", None)]), admin(forget("n1"), 0)],
        );
        assert!(reply(&out).ok, "{out:?}");
        assert!(!out.persist.expect("saved").nodes.contains_key("n1"));
        let nodes: Vec<String> = core
            .status(UnixMs(later))
            .nodes
            .into_iter()
            .map(|n| n.node)
            .collect();
        assert_eq!(nodes, ["n2"]);
    }

    /// Two nodes with one job each, allocated at T0.
    fn running() -> Core {
        let mut core = fresh();
        core.step(
            UnixMs(T0),
            vec![
                hello("n1"),
                report("n1", vec![job("101", None)]),
                hello("n2"),
                report("n2", vec![job("102", None)]),
            ],
        );
        core
    }

    fn allocations(core: &Core) -> u64 {
        core.allocations()
    }

    /// `core.step`, with what it made for the history published on `board`, as the I/O
    /// edge does.
    fn step_published(
        core: &mut Core,
        board: &HistoryBoard,
        now_ms: u64,
        inputs: Vec<Input>,
    ) -> Output {
        let mut out = core.step(UnixMs(now_ms), inputs);
        board.publish(out.history.take(), out.owners.take());
        out
    }

    fn reply(out: &Output) -> &AdminReply {
        assert_eq!(out.replies.len(), 1, "{out:?}");
        &out.replies[0].1
    }

    #[test]
    fn only_root_changes_the_budget_or_events_and_anyone_reads() {
        let mut core = running();
        for op in [
            AdminOp::BudgetSet {
                budget_w: 5000.0,
                domain: None,
            },
            AdminOp::EventAdd {
                cut: Cut::Reduce { fraction: 0.3 },
                start_ms: T0,
                duration_ms: 60_000,
                ramp_ms: 0,
                domain: None,
            },
            AdminOp::EventCancel { id: 1 },
        ] {
            let out = core.step(UnixMs(T0 + 1), vec![admin(op.clone(), 1000)]);
            let r = reply(&out);
            assert!(!r.ok, "{op:?}");
            assert_eq!(
                r.error.as_deref(),
                Some("only root may change the budget or grid events")
            );
            assert_eq!(out.persist, None, "a refused change saves nothing");
        }
        assert_eq!(core.state().budget_w, None);
        assert!(core.state().events.is_empty());
        let out = core.step(UnixMs(T0 + 2), vec![admin(AdminOp::Status, 1000)]);
        assert!(reply(&out).ok && reply(&out).status.is_some());

        let out = core.step(UnixMs(T0 + 3), vec![budget_set(5000.0, None)]);
        assert!(reply(&out).ok);
        assert_eq!(
            out.persist.as_ref().and_then(|s| s.budget_w),
            Some(Watts(5000.0))
        );
        assert!(out.metrics.is_some(), "a change is allocated at once");
        assert_eq!(core.status(UnixMs(T0 + 3)).budget_w, 5000.0);
        let out = core.step(UnixMs(T0 + 4), vec![budget_set(-1.0, None)]);
        assert!(reply(&out)
            .error
            .as_deref()
            .is_some_and(|e| e.contains("positive")));
    }

    #[test]
    fn events_are_numbered_validated_and_cancelled() {
        let mut core = running();
        let add = |duration_ms, ramp_ms| AdminOp::EventAdd {
            cut: Cut::Reduce { fraction: 0.3 },
            start_ms: T0,
            duration_ms,
            ramp_ms,
            domain: None,
        };
        let out = core.step(UnixMs(T0 + 1), vec![admin(add(0, 0), 0)]);
        assert!(reply(&out)
            .error
            .as_deref()
            .is_some_and(|e| e.contains("twice its ramp")));
        let out = core.step(UnixMs(T0 + 1), vec![admin(add(60_000, 30_001), 0)]);
        assert!(!reply(&out).ok);
        assert_eq!(reply(&out).refusal, Some(Refusal::EventOutOfRange));
        // What a VTN might serve, passed on by the VEN: refused, typed, never held.
        for cut in [
            Cut::Reduce { fraction: 7.0 },
            Cut::Reduce { fraction: -0.5 },
            Cut::Target { budget_w: -1.0 },
            Cut::Target {
                budget_w: f64::INFINITY,
            },
        ] {
            let op = AdminOp::EventAdd {
                cut,
                start_ms: T0,
                duration_ms: 60_000,
                ramp_ms: 0,
                domain: None,
            };
            let out = core.step(UnixMs(T0 + 1), vec![admin(op, 0)]);
            assert_eq!(
                reply(&out).refusal,
                Some(Refusal::EventOutOfRange),
                "{cut:?}"
            );
        }
        let out = core.step(UnixMs(T0 + 1), vec![admin(add(u64::MAX, 0), 0)]);
        assert_eq!(reply(&out).refusal, Some(Refusal::EventOutOfRange));
        assert!(core.state().events.is_empty());
        let out = core.step(
            UnixMs(T0 + 1),
            vec![admin(add(60_000, 0), 0), admin(add(60_000, 0), 0)],
        );
        let ids: Vec<Option<u64>> = out.replies.iter().map(|(_, r)| r.event_id).collect();
        assert_eq!(ids, [Some(1), Some(2)]);
        assert_eq!(out.persist.as_ref().map(|s| s.events.len()), Some(2));
        assert_eq!(
            core.status(UnixMs(T0 + 1)).budget_w,
            7000.0,
            "30 % off at once"
        );
        let out = core.step(
            UnixMs(T0 + 2),
            vec![admin(AdminOp::EventCancel { id: 7 }, 0)],
        );
        assert_eq!(reply(&out).error.as_deref(), Some("no event 7"));
        assert_eq!(reply(&out).refusal, Some(Refusal::NoSuchEvent));
        let out = core.step(
            UnixMs(T0 + 2),
            vec![admin(AdminOp::EventCancel { id: 1 }, 0)],
        );
        assert!(reply(&out).ok);
        assert_eq!(
            core.state().events.iter().map(|e| e.id).collect::<Vec<_>>(),
            [2]
        );
        // Bounded: once MAX_PENDING_EVENTS are held, the next is refused (typed), and
        // accepted again when one ends.
        let most = powerflex_proto::event::MAX_PENDING_EVENTS;
        let inputs: Vec<Input> = (1..most).map(|_| admin(add(60_000, 0), 0)).collect();
        let out = core.step(UnixMs(T0 + 3), inputs);
        assert!(out.replies.iter().all(|(_, r)| r.ok));
        let out = core.step(UnixMs(T0 + 3), vec![admin(add(120_000, 0), 0)]);
        assert_eq!(reply(&out).refusal, Some(Refusal::TooManyEvents));
        assert!(reply(&out)
            .error
            .as_deref()
            .is_some_and(|e| e.contains("256")));
        assert_eq!(core.state().events.len(), most);
        let out = core.step(UnixMs(T0 + 60_001), vec![admin(add(120_000, 0), 0)]);
        assert!(reply(&out).ok, "{:?}", reply(&out).error);
    }

    /// Pre-positioning (issue 16): every lease names the start of the next announced
    /// event, so that walks end before it; none once it has started, or with none.
    /// Two racks under one feed: n1 in rack-a, n2 in rack-b, 10 kW each, 20 kW the feed.
    /// The settings with a feed of 20 kW over rack-a (n1, 10 kW) and rack-b (n2,
    /// `rack_b_w`).
    fn with_racks(rack_b_w: f64) -> CtldSettings {
        use powerflex_core::domains::{DomainTree, RawDomain};
        let raw = |name: &str, parent: Option<&str>, nodes: Option<&str>, limit: f64| RawDomain {
            name: name.into(),
            parent: parent.map(Into::into),
            gpu_limit_w: limit,
            nodes: nodes.map(Into::into),
        };
        let tree = DomainTree::build(&[
            raw("feed-a", None, None, 20_000.0),
            raw("rack-a", Some("feed-a"), Some("n1"), 10_000.0),
            raw("rack-b", Some("feed-a"), Some("n2"), rack_b_w),
        ])
        .expect("valid");
        let mut o = options();
        o.site.domains = crate::site::SiteDomains::configured(&tree);
        o
    }

    fn racks() -> Core {
        let o = with_racks(10_000.0);
        let mut core = Core::new(o, Loaded::default(), UnixMs(T0));
        core.step(
            UnixMs(T0),
            vec![
                hello("n1"),
                report("n1", vec![job("101", None)]),
                hello("n2"),
                report("n2", vec![job("102", None)]),
            ],
        );
        core
    }

    /// A reload that lowers a domain's limit below the budget an admin set for it
    /// earlier (the breaker was smaller than configured) puts the new limit in force: the
    /// old budget never holds caps above the breaker.
    #[test]
    fn a_reload_below_a_domain_s_budget_puts_the_new_limit_in_force() {
        let mut core = racks();
        core.step(UnixMs(T0 + 10_000), vec![Input::Tick]);
        let out = core.step(
            UnixMs(T0 + 11_000),
            vec![budget_set(9_000.0, Some("rack-b"))],
        );
        assert!(reply(&out).ok);
        let lowered = with_racks(2_000.0);
        core.step(
            UnixMs(T0 + 12_000),
            vec![Input::Reload(Box::new(Ok(lowered)))],
        );
        core.step(
            UnixMs(T0 + 20_000),
            vec![
                report("n1", vec![job("101", None)]),
                report("n2", vec![job("102", None)]),
                Input::Tick,
            ],
        );
        let status = core.status(UnixMs(T0 + 20_000));
        let rack_b = status
            .domains
            .iter()
            .find(|d| d.name == "rack-b")
            .expect("rack-b");
        assert_eq!(rack_b.budget_w, 2_000.0, "{rack_b:?}");
        let cap = status
            .jobs
            .iter()
            .find(|j| j.job == "102")
            .and_then(|j| j.cap_w)
            .expect("job 102 capped");
        assert!(cap * 4.0 <= 2_000.0 + 1e-6, "job 102 at {cap} W × 4 GPUs");
        // The admin's budget is kept (a limit raised again brings it back).
        assert_eq!(
            core.state.domain_budgets_w.get("rack-b"),
            Some(&Watts(9_000.0))
        );
    }

    /// `facility.max_ramp_w_per_s` holds a domain's rise when its event ends, as it
    /// holds the site's.
    #[test]
    fn a_domain_s_rise_after_its_event_is_held_to_the_ramp_rate() {
        let mut core = racks();
        core.options.max_ramp_w_per_s = Some(20.0);
        let at_cap = |id: &str, cap_w: f64| JobReport {
            cap_w: Some(cap_w),
            power_w: Some(cap_w * 4.0),
            ..job(id, None)
        };
        let granted = |core: &Core, now: u64, job: &str| {
            core.status(UnixMs(now))
                .jobs
                .iter()
                .find(|j| j.job == job)
                .and_then(|j| j.cap_w)
                .unwrap_or_else(|| panic!("{job} granted at {}", now - T0))
        };
        core.step(UnixMs(T0 + 10_000), vec![Input::Tick]);
        let out = core.step(
            UnixMs(T0 + 15_000),
            vec![admin(
                AdminOp::EventAdd {
                    cut: Cut::Target { budget_w: 1200.0 },
                    start_ms: T0 + 15_000,
                    duration_ms: 20_000,
                    ramp_ms: 0,
                    domain: Some("rack-a".into()),
                },
                0,
            )],
        );
        assert!(reply(&out).ok);
        let cut = granted(&core, T0 + 15_000, "101");
        assert!(cut * 4.0 <= 1200.0 + 1e-6);
        core.step(
            UnixMs(T0 + 25_000),
            vec![
                report("n1", vec![at_cap("101", cut)]),
                report("n2", vec![at_cap("102", 700.0)]),
                Input::Tick,
            ],
        );
        // The caps the last allocation sent, confirmed; then 500 ms after the event's end:
        // at most 20 W/s more than the last allocation's.
        let cut = granted(&core, T0 + 25_000, "101");
        assert!(cut * 4.0 <= 1200.0 + 1e-6);
        core.step(
            UnixMs(T0 + 35_500),
            vec![
                report("n1", vec![at_cap("101", cut)]),
                report("n2", vec![at_cap("102", 700.0)]),
                Input::Tick,
            ],
        );
        let after = granted(&core, T0 + 35_500, "101");
        assert!(
            after * 4.0 <= 1200.0 + 20.0 * 10.5 + 1e-6,
            "rack-a rose to {} W",
            after * 4.0
        );
        assert_eq!(
            granted(&core, T0 + 35_500, "102"),
            700.0,
            "rack-b untouched"
        );
    }

    #[test]
    fn a_domain_event_cuts_its_own_nodes_and_nobody_else() {
        let mut core = racks();
        core.step(UnixMs(T0 + 10_000), vec![Input::Tick]);
        let add = |domain: &str| AdminOp::EventAdd {
            cut: Cut::Target { budget_w: 1200.0 },
            start_ms: T0 + 20_000,
            duration_ms: 600_000,
            ramp_ms: 0,
            domain: Some(domain.into()),
        };
        // A domain the config does not declare is refused, naming those it does.
        let out = core.step(UnixMs(T0 + 15_000), vec![admin(add("rack-z"), 0)]);
        let refused = reply(&out);
        assert_eq!(refused.refusal, Some(Refusal::NoSuchDomain));
        let why = refused.error.as_deref().unwrap_or_default();
        assert!(
            why.contains("rack-z") && why.contains("feed-a, rack-a, rack-b"),
            "{why}"
        );
        let out = core.step(UnixMs(T0 + 15_001), vec![admin(add("rack-a"), 0)]);
        assert!(reply(&out).ok);
        let out = core.step(UnixMs(T0 + 20_000), vec![Input::Tick]);
        let n1 = out.leases["n1"].clone();
        assert!(n1.caps["101"] * 4.0 <= 1200.0 + 1e-6, "rack-a cut: {n1:?}");
        assert!(n1.event_in_force);
        // A job starting on n1 starts at rack-a's share per GPU (1.2 kW over 8 GPUs).
        assert!(n1.start_cap_w <= 150.0 + 1e-9, "{n1:?}");
        if let Some(n2) = out.leases.get("n2") {
            assert_eq!(n2.caps["102"], 700.0, "rack-b untouched: {n2:?}");
            assert!(n2.start_cap_w > 150.0, "{n2:?}");
            assert!(!n2.event_in_force, "rack-b's node is outside the event");
        }
        let status = core.status(UnixMs(T0 + 20_000));
        assert_eq!(
            status.budget_w, 10_000.0,
            "the site's budget is not the rack's"
        );
        assert!(status.active_event.is_none());
        let names: Vec<&str> = status.domains.iter().map(|d| d.name.as_str()).collect();
        assert_eq!(names, ["feed-a", "rack-a", "rack-b"]);
        let rack_a = &status.domains[1];
        assert_eq!(rack_a.budget_w, 1200.0);
        assert_eq!(rack_a.event, Some(1));
        assert_eq!((rack_a.nodes, rack_a.live_nodes, rack_a.depth), (1, 1, 1));
        assert!(
            rack_a.planned_w.is_some_and(|w| w <= 1200.0 + 1e-6),
            "{rack_a:?}"
        );
        let rack_b = &status.domains[2];
        assert_eq!((rack_b.budget_w, rack_b.event), (10_000.0, None));
        assert_eq!(rack_b.parent.as_deref(), Some("feed-a"));
        // An admin's budget for rack-b cuts rack-b, and survives a restart (state).
        let out = core.step(
            UnixMs(T0 + 21_000),
            vec![budget_set(2000.0, Some("rack-b"))],
        );
        assert!(reply(&out).ok);
        assert_eq!(
            out.persist
                .as_ref()
                .map(|s| s.domain_budgets_w.get("rack-b").copied()),
            Some(Some(Watts(2000.0)))
        );
        // The nodes report again (within their lease, at the caps they were sent) and the
        // next period allocates.
        let at_cap = |id: &str, cap_w: f64| JobReport {
            cap_w: Some(cap_w),
            power_w: Some(cap_w * 4.0),
            ..job(id, None)
        };
        let rack_a_cap = n1.caps["101"];
        core.step(
            UnixMs(T0 + 30_000),
            vec![
                report("n1", vec![at_cap("101", rack_a_cap)]),
                report("n2", vec![at_cap("102", 700.0)]),
                Input::Tick,
            ],
        );
        let granted = |core: &Core, job: &str| {
            core.status(UnixMs(T0 + 30_000))
                .jobs
                .iter()
                .find(|j| j.job == job)
                .and_then(|j| j.cap_w)
                .expect("granted")
        };
        assert!(granted(&core, "102") * 4.0 <= 2000.0 + 1e-6);
        assert!(granted(&core, "101") * 4.0 <= 1200.0 + 1e-6);
        let out = core.step(
            UnixMs(T0 + 31_000),
            vec![budget_set(2000.0, Some("nowhere"))],
        );
        assert_eq!(reply(&out).refusal, Some(Refusal::NoSuchDomain));
        // Never above the breaker's limit.
        let out = core.step(
            UnixMs(T0 + 32_000),
            vec![budget_set(20_000.0, Some("rack-b"))],
        );
        let above = reply(&out);
        assert!(!above.ok);
        assert!(
            above
                .error
                .as_deref()
                .is_some_and(|e| e.contains("at most 10.0 kW")),
            "{above:?}"
        );
    }

    #[test]
    fn leases_announce_the_next_event_s_start() {
        let mut core = running();
        let out = core.step(UnixMs(T0 + 10_000), vec![Input::Tick]);
        assert!(out.leases.values().all(|l| l.next_event_in_s.is_none()));
        let add = |start_ms| AdminOp::EventAdd {
            cut: Cut::Reduce { fraction: 0.3 },
            start_ms,
            duration_ms: 600_000,
            ramp_ms: 0,
            domain: None,
        };
        let out = core.step(
            UnixMs(T0 + 20_000),
            vec![
                admin(add(T0 + 920_000), 0),
                admin(add(T0 + 320_000), 0),
                Input::Tick,
            ],
        );
        assert!(!out.leases.is_empty());
        for lease in out.leases.values() {
            assert_eq!(lease.next_event_in_s, Some(300.0), "the nearer one");
        }
        let out = core.step(UnixMs(T0 + 330_000), vec![Input::Tick]);
        for lease in out.leases.values() {
            assert_eq!(lease.next_event_in_s, Some(590.0), "the first has started");
        }
    }

    #[test]
    fn after_state_loss_nothing_is_allocated_for_one_lease() {
        let lost = Loaded {
            state: CtldState::default(),
            lost: true,
        };
        let mut core = Core::new(options(), lost, UnixMs(T0));
        let out = core.step(
            UnixMs(T0),
            vec![hello("n1"), report("n1", vec![job("101", None)])],
        );
        assert!(out.leases.is_empty() && out.metrics.is_none(), "{out:?}");
        let out = core.step(UnixMs(T0 + 29_999), vec![Input::Tick]);
        assert!(out.leases.is_empty());
        assert_eq!(allocations(&core), 0);
        // The agent kept reporting through the hold (silent, it would count as dead).
        let out = core.step(
            UnixMs(T0 + 30_000),
            vec![report("n1", vec![job("101", None)]), Input::Tick],
        );
        assert!(out.leases.contains_key("n1"), "{out:?}");
        assert_eq!(allocations(&core), 1);
    }

    fn restarted_with(nodes: &[&str]) -> Core {
        let state = CtldState {
            nodes: nodes.iter().map(|n| (n.to_string(), gpus(8))).collect(),
            ..CtldState::default()
        };
        Core::new(options(), Loaded { state, lost: false }, UnixMs(T0))
    }

    #[test]
    fn after_a_restart_the_known_agents_are_awaited() {
        let mut core = restarted_with(&["n1", "n2"]);
        let out = core.step(
            UnixMs(T0 + 100),
            vec![hello("n1"), report("n1", vec![job("101", None)])],
        );
        assert!(out.leases.is_empty(), "n2's old lease still holds its caps");
        assert_eq!(out.persist, None, "n1's GPUs are as saved");
        let out = core.step(
            UnixMs(T0 + 200),
            vec![hello("n2"), report("n2", vec![job("102", None)])],
        );
        assert_eq!(
            out.leases.keys().collect::<Vec<_>>(),
            ["n1", "n2"],
            "all back: allocated at once"
        );
    }

    #[test]
    fn after_a_restart_a_hello_without_its_report_is_not_enough() {
        let mut core = restarted_with(&["n1", "n2"]);
        // Both reconnect in one batch, but only n2's report came with it: n1's jobs are
        // unknown, and n2's jobs would get n1's watts.
        let out = core.step(
            UnixMs(T0 + 100),
            vec![
                hello("n1"),
                hello("n2"),
                report("n2", vec![job("102", None)]),
            ],
        );
        assert!(out.leases.is_empty(), "{out:?}");
        let out = core.step(UnixMs(T0 + 110), vec![report("n1", vec![job("101", None)])]);
        assert_eq!(out.leases.keys().collect::<Vec<_>>(), ["n1", "n2"]);
        assert!(
            out.leases["n1"].caps.contains_key("101") && out.leases["n2"].caps.contains_key("102")
        );
    }

    #[test]
    fn an_agent_that_stays_away_is_counted_at_its_failsafe_cap_after_half_a_lease() {
        let mut core = restarted_with(&["n1", "n2"]);
        let out = core.step(
            UnixMs(T0 + 100),
            vec![hello("n1"), report("n1", vec![job("101", None)])],
        );
        assert!(out.leases.is_empty());
        let out = core.step(UnixMs(T0 + 14_999), vec![Input::Tick]);
        assert!(out.leases.is_empty(), "within the grace");
        let out = core.step(UnixMs(T0 + 15_000), vec![Input::Tick]);
        assert_eq!(out.leases.keys().collect::<Vec<_>>(), ["n1"]);
        let status = core.status(UnixMs(T0 + 15_000));
        let n2 = status.nodes.iter().find(|n| n.node == "n2").expect("n2");
        assert!(!n2.live);
        // n2's 8 GPUs at the 500 W fail-safe cap come off the budget first.
        let out = core.step(
            UnixMs(T0 + 15_001),
            vec![admin(
                AdminOp::WhatIf {
                    policy: Policy::Optimal,
                    budget_w: None,
                    ignore_tiers: false,
                },
                0,
            )],
        );
        let d = reply(&out).what_if.as_ref().expect("decision");
        assert!(d.reserved_w >= 4000.0, "{d:?}");
    }

    #[test]
    fn a_batch_of_messages_costs_one_allocation() {
        let mut core = fresh();
        let mut inputs = Vec::new();
        for i in 0..200 {
            let node = format!("n{i:03}");
            inputs.push(hello(&node));
            inputs.push(report(&node, vec![job(&format!("{}", 1000 + i), None)]));
        }
        let out = core.step(UnixMs(T0), inputs);
        assert_eq!(allocations(&core), 1);
        assert_eq!(out.leases.len(), 200);
        assert_eq!(out.persist.map(|s| s.nodes.len()), Some(200), "saved once");
    }

    #[test]
    fn only_a_change_in_the_jobs_reallocates_before_the_tick() {
        let mut core = running();
        assert_eq!(allocations(&core), 1);
        let out = core.step(
            UnixMs(T0 + 1000),
            vec![report("n1", vec![job("101", None)])],
        );
        assert!(out.metrics.is_none() && out.leases.is_empty());
        assert_eq!(allocations(&core), 1);
        let out = core.step(
            UnixMs(T0 + 2000),
            vec![report("n1", vec![job("101", None), job("103", None)])],
        );
        assert!(out.leases["n1"].caps.contains_key("103"), "{out:?}");
        core.step(UnixMs(T0 + 10_000), vec![Input::Tick]);
        assert_eq!(allocations(&core), 3);
        // A report from a node that never said hello is dropped.
        let out = core.step(
            UnixMs(T0 + 10_001),
            vec![report("n9", vec![job("109", None)])],
        );
        assert!(out.leases.is_empty());
        assert!(core
            .status(UnixMs(T0 + 10_001))
            .nodes
            .iter()
            .all(|n| n.node != "n9"));
    }

    #[test]
    fn a_silent_node_goes_dead_after_its_lease_and_leases_carry_the_ttl() {
        let mut core = running();
        let out = core.step(
            UnixMs(T0 + 29_999),
            vec![report("n2", vec![job("102", None)]), Input::Tick],
        );
        assert_eq!(out.lease_ttl_s, TTL_S);
        let live = |core: &Core, now| {
            core.status(UnixMs(now))
                .nodes
                .iter()
                .map(|n| (n.node.clone(), n.live))
                .collect::<Vec<_>>()
        };
        assert_eq!(
            live(&core, T0 + 29_999),
            [("n1".into(), true), ("n2".into(), true)]
        );
        core.step(UnixMs(T0 + 30_000), vec![Input::Tick]);
        assert_eq!(
            live(&core, T0 + 30_000),
            [("n1".into(), false), ("n2".into(), true)]
        );
        let status = core.status(UnixMs(T0 + 30_000));
        assert_eq!(status.draw_w, 2800.0, "only live nodes' draw counts");
        assert_eq!(status.nodes[0].seen_ms_ago, 30_000);
        core.step(
            UnixMs(T0 + 31_000),
            vec![report("n1", vec![job("101", None)]), Input::Tick],
        );
        assert!(core.status(UnixMs(T0 + 31_000)).nodes[0].live);
    }

    fn leadership(role: LeadershipRole, epoch: u64, holder: Option<&str>) -> Input {
        Input::Leadership(LeadershipView {
            role,
            name: Some("ctld-a".into()),
            epoch,
            holder: holder.map(str::to_string),
            reason: None,
            since_unix_ms: T0,
        })
    }

    /// Issue 22: leases carry the state's epoch; a controller that is not active (a
    /// standby, one that stepped down) sends no lease and refuses changes, typed, and
    /// steers again at once when it is active.
    #[test]
    fn only_an_active_controller_leases_and_takes_changes() {
        let state = CtldState {
            epoch: 4,
            ..CtldState::default()
        };
        let mut core = Core::new(options(), Loaded { state, lost: false }, UnixMs(T0));
        let out = core.step(
            UnixMs(T0),
            vec![
                leadership(LeadershipRole::Standby, 4, Some("ctld-b")),
                hello("n1"),
                report("n1", vec![job("101", None)]),
                Input::Tick,
            ],
        );
        assert!(!core.steering());
        assert!(out.leases.is_empty(), "a standby leases nothing: {out:?}");
        let out = core.step(UnixMs(T0 + 1), vec![budget_set(5000.0, None)]);
        let r = reply(&out);
        assert_eq!(r.refusal, Some(Refusal::NotActive), "{r:?}");
        assert!(
            r.error.as_deref().is_some_and(|e| e.contains("ctld-b")),
            "{r:?}"
        );
        assert_eq!(out.persist, None);
        let out = core.step(UnixMs(T0 + 2), vec![admin(AdminOp::Status, 1000)]);
        let shown = reply(&out)
            .status
            .as_ref()
            .and_then(|s| s.leadership.clone());
        assert_eq!(shown.map(|l| l.role), Some(LeadershipRole::Standby));
        // Active: it allocates at once, and every lease carries its epoch.
        let out = core.step(
            UnixMs(T0 + 3),
            vec![leadership(LeadershipRole::Active, 4, None)],
        );
        assert!(core.steering());
        assert_eq!(out.epoch, 4);
        assert!(out.leases.contains_key("n1"), "{out:?}");
        // Stepping down stops it at once, and the edge is told to send the agents on.
        let out = core.step(
            UnixMs(T0 + 4),
            vec![
                leadership(LeadershipRole::SteppedDown, 4, None),
                Input::Tick,
            ],
        );
        assert!(out.stopped_steering && out.leases.is_empty(), "{out:?}");
    }

    /// Issue 22: an agent's refusal of this controller's epoch fences it for that node:
    /// no lease goes to it again, it is sent on (now and when it says hello again), and
    /// it is paid for as a silent node. One node's word stops nothing else (review
    /// finding). A single controller that more than half of the nodes it knows refuse
    /// is a stale one: it stops steering entirely (FENCED), so a node without an epoch
    /// memory is not steered by it either. A refusal of another epoch fences nothing.
    #[test]
    fn a_refusal_fences_a_controller_for_that_node_and_most_nodes_fence_a_single_one() {
        let state = CtldState {
            epoch: 2,
            ..CtldState::default()
        };
        let mut core = Core::new(options(), Loaded { state, lost: false }, UnixMs(T0));
        let out = core.step(
            UnixMs(T0),
            vec![
                hello("n1"),
                report("n1", vec![job("101", None)]),
                hello("n2"),
                report("n2", vec![job("102", None)]),
                hello("n3"),
                report("n3", vec![job("103", None)]),
            ],
        );
        assert_eq!(out.epoch, 2);
        assert_eq!(out.leases.len(), 3, "{out:?}");
        let fenced = |node: &str, lease_epoch, accepted_epoch| Input::Fenced {
            node: node.into(),
            lease_epoch,
            accepted_epoch,
        };
        // A stale refusal of an older lease (or by an agent behind this one) is not one.
        let out = core.step(
            UnixMs(T0 + 1),
            vec![fenced("n1", 1, 2), fenced("n1", 2, 2), Input::Tick],
        );
        assert!(out.send_on.is_empty() && out.leases.contains_key("n1"));
        // n1 follows epoch 3: sent on, leased no more, paid for as silent; n2 and n3 are
        // steered as before.
        let out = core.step(UnixMs(T0 + 2), vec![fenced("n1", 2, 3), Input::Tick]);
        assert!(core.steering() && !out.stopped_steering);
        assert_eq!(out.send_on, ["n1"]);
        assert!(!out.leases.contains_key("n1"), "{out:?}");
        assert!(out.leases.contains_key("n2") && out.leases.contains_key("n3"));
        let status = core.status(UnixMs(T0 + 2));
        assert!(status.leadership.is_none(), "one node of three: {status:?}");
        assert_eq!(status.refused_by.get("n1"), Some(&3));
        let decision = core.last.as_ref().expect("allocated");
        assert!(
            decision
                .allocation
                .as_ref()
                .is_some_and(|a| a.jobs.iter().all(|j| j.id != "101")),
            "n1's job is not steered by this controller"
        );
        // The same refusal again sends nothing new; its hello again sends it on again.
        let out = core.step(UnixMs(T0 + 3), vec![fenced("n1", 2, 3), Input::Tick]);
        assert!(out.send_on.is_empty() && !out.leases.contains_key("n1"));
        let out = core.step(UnixMs(T0 + 4), vec![hello("n1")]);
        assert_eq!(out.send_on, ["n1"]);
        // n2 too: two of the three nodes it knows follow a later controller, so this
        // single controller is a stale one and stops steering every node.
        let out = core.step(UnixMs(T0 + 5), vec![fenced("n2", 2, 4), Input::Tick]);
        assert!(!core.steering());
        assert!(out.stopped_steering && out.leases.is_empty(), "{out:?}");
        let l = core.status(UnixMs(T0 + 5)).leadership.expect("shown");
        assert_eq!((l.role, l.epoch), (LeadershipRole::Fenced, 2));
        assert!(
            l.reason
                .as_deref()
                .is_some_and(|r| r.contains("2 of the 3 nodes") && r.contains("up to 4")),
            "{l:?}"
        );
        // A node without an epoch memory is not steered by it, and no change is taken.
        let out = core.step(
            UnixMs(T0 + 6),
            vec![
                hello("n4"),
                report("n4", vec![job("104", None)]),
                Input::Tick,
            ],
        );
        assert!(out.leases.is_empty(), "{out:?}");
        let out = core.step(UnixMs(T0 + 7), vec![budget_set(9_000.0, None)]);
        assert!(!reply(&out).ok);
    }

    /// Under `[controller.ha]` the leader row, not the agents, says who leads: every
    /// node refusing the active controller fences it node by node (the edge asks the
    /// database at once), and never stands it by on its own.
    /// Adversarial review: the nodes a single controller knows include those the
    /// domains place (and Slurm's GPU nodes), not only those connected, so one node's
    /// forged refusal while it is the only one connected fences that node alone.
    #[test]
    fn one_node_refusing_first_fences_no_site_whose_domains_place_more() {
        use powerflex_core::domains::{DomainTree, RawDomain};
        let tree = DomainTree::build(&[RawDomain {
            name: "rack-a".into(),
            parent: None,
            gpu_limit_w: 100_000.0,
            nodes: Some("n[1-4]".into()),
        }])
        .expect("valid");
        let mut o = options();
        o.site.domains = crate::site::SiteDomains::configured(&tree);
        let mut core = Core::new(o, Loaded::default(), UnixMs(T0));
        core.step(
            UnixMs(T0),
            vec![hello("n1"), report("n1", vec![job("101", None)])],
        );
        let out = core.step(
            UnixMs(T0 + 1),
            vec![
                Input::Fenced {
                    node: "n1".into(),
                    lease_epoch: 0,
                    accepted_epoch: 1,
                },
                Input::Tick,
            ],
        );
        assert_eq!(out.send_on, ["n1"]);
        assert!(core.steering(), "1 of the 4 nodes the domains place");
        assert!(core.status(UnixMs(T0 + 1)).leadership.is_none());
        let out = core.step(
            UnixMs(T0 + 2),
            vec![
                hello("n2"),
                report("n2", vec![job("102", None)]),
                Input::Tick,
            ],
        );
        assert!(out.leases.contains_key("n2"), "{out:?}");
    }

    /// Adversarial review: a hello whose GPUs the committed state's check refuses is not
    /// kept in the state (the next start would refuse the whole state, events and
    /// budgets with it); the node is still paid for, as a silent one.
    #[test]
    fn a_hello_the_state_check_refuses_is_not_kept() {
        let mut core = Core::new(options(), Loaded::default(), UnixMs(T0));
        let mut bad = gpus(2);
        bad[1].name = "NVIDIA\u{0}H200".into();
        let out = core.step(
            UnixMs(T0),
            vec![
                hello("n1"),
                report("n1", vec![job("101", None)]),
                Input::Hello {
                    node: "n2".into(),
                    gpus: bad,
                },
                Input::Tick,
            ],
        );
        assert!(core.state.nodes.contains_key("n1"));
        assert!(
            !core.state.nodes.contains_key("n2"),
            "{:?}",
            core.state.nodes
        );
        let persisted = out.persist.expect("n1 kept");
        let text = serde_json::to_vec(&persisted).expect("encodes");
        assert!(CtldState::from_json(&text, UnixMs(T0)).is_ok());
        let decision = core.last.as_ref().expect("allocated");
        assert!(decision.reserved_w >= 2.0 * 700.0, "{decision:?}");
    }

    #[test]
    fn under_ha_refusals_fence_node_by_node_and_never_stand_the_leader_by() {
        let state = CtldState {
            epoch: 2,
            ..CtldState::default()
        };
        let mut core = Core::new(options(), Loaded { state, lost: false }, UnixMs(T0));
        core.step(
            UnixMs(T0),
            vec![
                leadership(LeadershipRole::Active, 2, None),
                hello("n1"),
                report("n1", vec![job("101", None)]),
                hello("n2"),
                report("n2", vec![job("102", None)]),
            ],
        );
        let fenced = |node: &str| Input::Fenced {
            node: node.into(),
            lease_epoch: 2,
            accepted_epoch: 3,
        };
        let out = core.step(
            UnixMs(T0 + 1),
            vec![fenced("n1"), fenced("n2"), Input::Tick],
        );
        assert!(core.steering() && !out.stopped_steering);
        assert!(out.leases.is_empty(), "{out:?}");
        let status = core.status(UnixMs(T0 + 1));
        assert_eq!(
            status.leadership.map(|l| l.role),
            Some(LeadershipRole::Active)
        );
        assert_eq!(status.refused_by.len(), 2);
    }

    #[test]
    fn an_event_that_ended_is_dropped_and_saved() {
        let mut core = running();
        let out = core.step(
            UnixMs(T0 + 1),
            vec![admin(
                AdminOp::EventAdd {
                    cut: Cut::Target { budget_w: 6000.0 },
                    start_ms: T0,
                    duration_ms: 10_000,
                    ramp_ms: 0,
                    domain: None,
                },
                0,
            )],
        );
        assert!(reply(&out).ok);
        assert_eq!(
            core.status(UnixMs(T0 + 5000)).active_event.map(|e| e.id),
            Some(1)
        );
        let out = core.step(UnixMs(T0 + 9_999), vec![Input::Tick]);
        assert_eq!(out.persist, None);
        let out = core.step(UnixMs(T0 + 10_000), vec![Input::Tick]);
        assert_eq!(out.persist.map(|s| s.events), Some(Vec::new()));
        assert!(core.status(UnixMs(T0 + 10_000)).events.is_empty());
        assert_eq!(core.status(UnixMs(T0 + 10_000)).budget_w, 10_000.0);
    }

    #[test]
    fn a_job_is_annotated_only_when_its_text_changes() {
        let mut core = fresh();
        let out = core.step(
            UnixMs(T0),
            vec![hello("n1"), report("n1", vec![job("101", None)])],
        );
        assert_eq!(out.annotations.len(), 1);
        let (id, text) = &out.annotations[0];
        assert_eq!(id, "101");
        assert!(
            text.starts_with("powerflex;tier=flex2;pfi=-;cap="),
            "{text}"
        );
        assert!(!text.contains(' '), "scontrol splits on spaces: {text}");
        let out = core.step(UnixMs(T0 + 10_000), vec![Input::Tick]);
        assert!(
            out.metrics.is_some() && out.annotations.is_empty(),
            "{out:?}"
        );
        let out = core.step(
            UnixMs(T0 + 20_000),
            vec![report("n1", vec![job("101", Some(1.5))]), Input::Tick],
        );
        assert_eq!(out.annotations.len(), 1);
        assert!(out.annotations[0].1.contains("pfi=1.50"), "{out:?}");
    }

    #[test]
    fn a_reload_changes_the_budget_at_once_and_not_what_needs_a_restart() {
        let mut core = running();
        let mut new = options();
        new.base_budget = Watts(8000.0);
        new.lease_ttl_s = 60.0;
        new.period = Duration::from_secs(1);
        new.job_placement = JobPlacement::Slurm;
        let out = core.step(UnixMs(T0 + 1), vec![Input::Reload(Box::new(Ok(new)))]);
        assert!(out.metrics.is_some(), "reallocated at once");
        assert_eq!(out.lease_ttl_s, 60.0);
        assert_eq!(core.status(UnixMs(T0 + 1)).base_budget_w, 8000.0);
        assert_eq!(core.settings().period, options().period);
        assert_eq!(core.settings().job_placement, options().job_placement);
        // A budget set by an admin still overrides the site config's.
        core.step(UnixMs(T0 + 2), vec![budget_set(9000.0, None)]);
        let mut again = options();
        again.base_budget = Watts(7000.0);
        core.step(UnixMs(T0 + 3), vec![Input::Reload(Box::new(Ok(again)))]);
        assert_eq!(core.status(UnixMs(T0 + 3)).budget_w, 9000.0);
    }

    #[test]
    fn a_refused_reload_keeps_the_config_and_is_reported_until_a_valid_one() {
        let mut core = running();
        let out = core.step(
            UnixMs(T0 + 1),
            vec![Input::Reload(Box::new(Err(
                "powerflex.toml: bad key".into()
            )))],
        );
        assert!(
            out.metrics.is_none(),
            "nothing changed, nothing to reallocate"
        );
        let status = core.status(UnixMs(T0 + 1));
        assert_eq!(
            status.config_error.as_deref(),
            Some("powerflex.toml: bad key")
        );
        assert_eq!(status.base_budget_w, 10_000.0);
        let error_for = |core: &mut Core, uid| {
            let out = core.step(UnixMs(T0 + 2), vec![admin(AdminOp::Status, uid)]);
            reply(&out)
                .status
                .as_ref()
                .and_then(|s| s.config_error.clone())
        };
        assert_eq!(
            error_for(&mut core, 0).as_deref(),
            Some("powerflex.toml: bad key")
        );
        // Anyone learns that a reload was refused; only root reads the config's words.
        assert_eq!(
            error_for(&mut core, 1000).as_deref(),
            Some(owners::CONFIG_ERROR_FOR_USERS)
        );
        core.step(UnixMs(T0 + 3), vec![Input::Reload(Box::new(Ok(options())))]);
        assert_eq!(core.status(UnixMs(T0 + 3)).config_error, None);
    }

    #[test]
    fn what_if_is_read_only() {
        let mut core = running();
        let before_state = core.state().clone();
        let before_status = core.status(UnixMs(T0 + 1));
        let out = core.step(
            UnixMs(T0 + 1),
            vec![admin(
                AdminOp::WhatIf {
                    policy: Policy::Equal,
                    budget_w: Some(3000.0),
                    ignore_tiers: false,
                },
                0,
            )],
        );
        let d = reply(&out).what_if.as_ref().expect("decision");
        assert_eq!(d.budget_w, 3000.0);
        assert_eq!(d.allocation.as_ref().map(|a| a.policy), Some(Policy::Equal));
        assert!(out.persist.is_none() && out.leases.is_empty() && out.metrics.is_none());
        assert_eq!(core.state(), &before_state);
        assert_eq!(core.status(UnixMs(T0 + 1)), before_status);
        assert_eq!(allocations(&core), 1);
        // Every job's curve and cap: root's only, refused before it is computed.
        let out = core.step(
            UnixMs(T0 + 3),
            vec![admin(
                AdminOp::WhatIf {
                    policy: Policy::Equal,
                    budget_w: None,
                    ignore_tiers: false,
                },
                1000,
            )],
        );
        assert!(reply(&out).what_if.is_none());
        let e = reply(&out).error.clone().expect("refused");
        assert!(e.contains("root only"), "{e}");
    }

    /// Issue 24: under a constant budget and steady jobs, caps settle. Four jobs whose
    /// throughput falls almost alike with the cap (a flat optimum: which one gives the
    /// watts barely matters) report curves that move by 1 % noise every period, as
    /// learned windows move an agent's estimate. The fresh decision (what `whatif` shows) swings caps; the caps sent
    /// change at most once per job per minute.
    #[test]
    fn caps_settle_under_a_steady_budget_while_the_fresh_decision_swings() {
        // Leases at once: these reports confirm no lease, and the subject is the decision.
        let at_once = CtldSettings {
            lease_rollout: LeaseRollout::AtOnce,
            ..options()
        };
        let mut core = Core::new(at_once, Loaded::default(), UnixMs(T0));
        let mut rng = powerflex_core::rng::SplitMix64::new(7);
        // (node, job, the share of its speed it loses from 700 W down to 0 W).
        let placement = [
            ("n1", "101", 0.50),
            ("n1", "102", 0.52),
            ("n2", "103", 0.48),
            ("n2", "104", 0.51),
        ];
        let mut caps: BTreeMap<String, f64> = BTreeMap::new();
        let reports = |caps: &BTreeMap<String, f64>, rng: &mut powerflex_core::rng::SplitMix64| {
            let mut by_node: BTreeMap<&str, Vec<JobReport>> = BTreeMap::new();
            for (node, id, loss) in placement {
                let cap = caps.get(id).copied().unwrap_or(700.0);
                let mut j = job(id, None);
                j.tier = "flex3".into();
                j.cap_w = Some(cap);
                j.power_cap_w = Some(cap);
                j.power_w = Some(4.0 * cap);
                // What it runs at now: its curve at the cap in force.
                j.throughput = Some(1000.0 * (1.0 - loss * (1.0 - cap / 700.0)));
                for p in &mut j.points {
                    p[2] =
                        1000.0 * (1.0 - loss * (1.0 - p[0] / 700.0)) * (1.0 + 0.01 * rng.normal());
                }
                // Its standard errors, as the agent states them: the noise they carry.
                j.curve = j
                    .points
                    .iter()
                    .rev()
                    .map(|p| CurvePoint {
                        cap_w: p[0],
                        power_w: p[1],
                        throughput: p[2],
                        power_sigma_w: 0.01 * p[1],
                        throughput_sigma: 0.01 * p[2],
                        windows: 40,
                    })
                    .collect();
                by_node.entry(node).or_default().push(j);
            }
            by_node
                .into_iter()
                .map(|(node, jobs)| {
                    let power_w = jobs.iter().filter_map(|j| j.power_w).sum();
                    Input::Report {
                        ended: Vec::new(),
                        observe_only: false,
                        node: node.into(),
                        power_w,
                        jobs,
                    }
                })
                .collect::<Vec<_>>()
        };
        let mut first = vec![hello("n1"), hello("n2")];
        first.extend(reports(&caps, &mut rng));
        first.push(budget_set(8000.0, None));
        core.step(UnixMs(T0), first);
        let period_ms = options().period.as_millis() as u64;
        let periods = 60u64;
        let (mut sent_changes, mut fresh_changes) = (0usize, 0usize);
        let mut last_fresh: Option<BTreeMap<String, f64>> = None;
        let mut last_sent: Option<BTreeMap<String, f64>> = None;
        for i in 1..=periods {
            let now = T0 + i * period_ms;
            let mut inputs = reports(&caps, &mut rng);
            inputs.push(Input::Tick);
            core.step(UnixMs(now), inputs);
            let sent: BTreeMap<String, f64> = core
                .last
                .as_ref()
                .and_then(|d| d.allocation.as_ref())
                .expect("an allocation")
                .jobs
                .iter()
                .map(|j| (j.id.clone(), j.cap_w.0))
                .collect();
            let out = core.step(
                UnixMs(now + 1),
                vec![admin(
                    AdminOp::WhatIf {
                        policy: Policy::Optimal,
                        budget_w: None,
                        ignore_tiers: false,
                    },
                    0,
                )],
            );
            let fresh: BTreeMap<String, f64> = reply(&out)
                .what_if
                .as_ref()
                .and_then(|d| d.allocation.as_ref())
                .expect("a decision")
                .jobs
                .iter()
                .map(|j| (j.id.clone(), j.cap_w.0))
                .collect();
            let changed = |a: &BTreeMap<String, f64>, b: &BTreeMap<String, f64>| {
                a.iter().filter(|(k, v)| b.get(*k) != Some(v)).count()
            };
            // The first two periods take the cut; count from then on.
            if i > 2 {
                if let Some(prev) = &last_sent {
                    sent_changes += changed(&sent, prev);
                }
                if let Some(prev) = &last_fresh {
                    fresh_changes += changed(&fresh, prev);
                }
            }
            let planned: f64 = sent.values().map(|c| 4.0 * c).sum();
            assert!(planned <= 8000.0 + 1e-6, "period {i}: {sent:?}");
            caps = sent.clone();
            last_sent = Some(sent);
            last_fresh = Some(fresh);
        }
        let minutes = (periods - 2) as f64 * period_ms as f64 / 60_000.0;
        let per_job_minute = |n: usize| n as f64 / placement.len() as f64 / minutes;
        assert!(
            per_job_minute(sent_changes) <= 1.0,
            "{sent_changes} cap changes sent in {minutes:.1} min"
        );
        assert!(
            fresh_changes > 3 * sent_changes.max(1),
            "the noise alone swings the fresh decision ({fresh_changes} changes) far more than the caps sent ({sent_changes})"
        );
    }

    #[test]
    fn history_keeps_one_sample_per_allocation() {
        let board = HistoryBoard::new();
        let mut core = fresh();
        step_published(
            &mut core,
            &board,
            T0,
            vec![
                hello("n1"),
                report("n1", vec![job("101", None)]),
                hello("n2"),
                report("n2", vec![job("102", None)]),
            ],
        );
        for i in 1..=3 {
            step_published(&mut core, &board, T0 + i * 5_000, vec![Input::Tick]);
        }
        // A step that allocates nothing adds no sample.
        let out = step_published(
            &mut core,
            &board,
            T0 + 15_001,
            vec![report("n1", vec![job("101", None)])],
        );
        assert!(out.history.is_none() && out.metrics.is_none());
        assert_eq!(allocations(&core), 4);
        let answered = board.answer(None, None, 0);
        let history = answered.history.as_ref().expect("history");
        assert_eq!(
            history.iter().map(|s| s.t_ms).collect::<Vec<_>>(),
            [T0, T0 + 5_000, T0 + 10_000, T0 + 15_000]
        );
        assert!(history
            .iter()
            .all(|s| s.caps.keys().eq(["101", "102"]) && s.budget_w == 10_000.0 && !s.simulated));
        // The core answers no history itself: it keeps none.
        let out = core.step(
            UnixMs(T0 + 15_002),
            vec![admin(
                AdminOp::History {
                    since_ms: None,
                    max_samples: None,
                },
                0,
            )],
        );
        assert!(!reply(&out).ok && reply(&out).history.is_none());
    }

    /// Issue 14, need-to-know: the owners the agents report decide what a non-root admin
    /// caller reads — in the status, the history (served from the board with the owners
    /// the core publishes), and after the job has left.
    #[test]
    fn a_user_reads_only_their_own_jobs_and_root_reads_all() {
        const ALICE: u32 = 1001;
        const BOB: u32 = 1002;
        let owned = |id: &str, uid: Option<u32>| {
            let mut j = job(id, None);
            j.owner_uid = uid;
            j
        };
        let board = HistoryBoard::new();
        let mut core = fresh();
        step_published(
            &mut core,
            &board,
            T0,
            vec![
                hello("n1"),
                report(
                    "n1",
                    vec![owned("101", Some(ALICE)), owned("102", Some(BOB))],
                ),
                hello("n2"),
                // An agent from before owners were reported.
                report("n2", vec![owned("103", None)]),
            ],
        );
        let jobs_for = |core: &mut Core, t: u64, uid: u32| -> Vec<String> {
            let out = core.step(UnixMs(t), vec![admin(AdminOp::Status, uid)]);
            let status = reply(&out).status.clone().expect("status");
            assert_eq!(status.jobs_of_uid, (uid != 0).then_some(uid));
            assert_eq!(status.nodes.len(), 2, "every caller sees the nodes");
            status.jobs.into_iter().map(|j| j.job).collect()
        };
        assert_eq!(jobs_for(&mut core, T0 + 1, 0), ["101", "102", "103"]);
        assert_eq!(jobs_for(&mut core, T0 + 1, ALICE), ["101"]);
        assert_eq!(jobs_for(&mut core, T0 + 1, BOB), ["102"]);
        assert!(jobs_for(&mut core, T0 + 1, 1003).is_empty());
        let caps_for = |uid: u32| -> Vec<String> {
            let history = board.answer(None, None, uid).history.expect("history");
            let mut jobs: Vec<String> = history
                .into_iter()
                .flat_map(|s| s.caps.into_keys())
                .collect();
            jobs.sort();
            jobs.dedup();
            jobs
        };
        assert_eq!(caps_for(ALICE), ["101"]);
        assert_eq!(caps_for(0), ["101", "102", "103"]);
        // Alice's job ends: it leaves the status, and she still reads its caps in the
        // history; bob still cannot.
        step_published(
            &mut core,
            &board,
            T0 + 10_000,
            vec![report("n1", vec![owned("102", Some(BOB))]), Input::Tick],
        );
        assert!(jobs_for(&mut core, T0 + 10_001, ALICE).is_empty());
        assert_eq!(caps_for(ALICE), ["101"]);
        assert_eq!(caps_for(BOB), ["102"]);
        // Two nodes naming different owners for one job: nobody's but root's.
        step_published(
            &mut core,
            &board,
            T0 + 20_000,
            vec![
                report("n1", vec![owned("104", Some(ALICE))]),
                report("n2", vec![owned("104", Some(BOB))]),
                Input::Tick,
            ],
        );
        assert!(jobs_for(&mut core, T0 + 20_001, ALICE).is_empty());
        assert!(jobs_for(&mut core, T0 + 20_001, BOB).is_empty());
        assert_eq!(jobs_for(&mut core, T0 + 20_001, 0), ["104"]);
        assert_eq!(caps_for(ALICE), ["101"]);
        assert_eq!(caps_for(BOB), ["102"]);
        assert_eq!(caps_for(0), ["101", "102", "103", "104"]);
    }

    /// A report of one 4-GPU job at `cap_w` (read back), drawing what its curve says.
    fn at_cap(node: &str, id: &str, tier: &str, cap_w: f64) -> Input {
        let mut j = job(id, None);
        j.tier = tier.into();
        j.cap_w = Some(cap_w);
        j.power_w = Some(cap_w * 4.0);
        Input::Report {
            ended: Vec::new(),
            observe_only: false,
            node: node.into(),
            power_w: cap_w * 4.0,
            jobs: vec![j],
        }
    }

    fn cap(out: &Output, node: &str, job: &str) -> Option<f64> {
        out.leases.get(node).and_then(|l| l.caps.get(job)).copied()
    }

    /// Issue 13: leases went to every node at once, so one node could raise its caps
    /// before another had lowered its own, and the site overshot at every reallocation.
    #[test]
    fn a_reallocation_lowers_first_and_raises_once_the_lowering_is_confirmed() {
        let mut core = fresh();
        two_jobs_at_500_w(&mut core, "flex3");
        // Both jobs settle at their caps and confirm them.
        let t = T0 + 1000;
        let out = core.step(UnixMs(t), vec![Input::Tick]);
        let (c1, c2) = (
            cap(&out, "n1", "101").expect("n1"),
            cap(&out, "n2", "102").expect("n2"),
        );
        let out = core.step(
            UnixMs(t + 100),
            vec![
                at_cap("n1", "101", "flex3", c1),
                at_cap("n2", "102", "flex3", c2),
            ],
        );
        assert!(
            out.leases.is_empty(),
            "nothing held, nothing released: {out:?}"
        );
        // Job 102 becomes unmovable (flex0): 101 must give it its watts.
        let out = core.step(
            UnixMs(t + 200),
            vec![at_cap("n2", "102", "flex0", c2), Input::Tick],
        );
        let lowered = cap(&out, "n1", "101").expect("n1 lowered at once");
        assert!(lowered < c1, "{out:?}");
        assert_eq!(
            cap(&out, "n2", "102"),
            Some(c2),
            "n2's rise is held: {out:?}"
        );
        // n1 still reports its old cap: nothing moves.
        let out = core.step(UnixMs(t + 300), vec![at_cap("n1", "101", "flex3", c1)]);
        assert!(out.leases.is_empty(), "{out:?}");
        // n1 confirms: n2's increase goes out.
        let out = core.step(UnixMs(t + 400), vec![at_cap("n1", "101", "flex3", lowered)]);
        let raised = cap(&out, "n2", "102").expect("released");
        assert!(raised > c2, "{out:?}");
        assert!(lowered * 4.0 + raised * 4.0 <= 4000.0 + 1e-6);
    }

    /// Issue 16: caps went down when a ramp's step took effect, so the meter sat above
    /// each new step until the agents had applied them. Now each allocation is made for
    /// the lowest step before the next one's caps are confirmed, and the rise after the
    /// event is held to the ramp-rate limit.
    #[test]
    fn ramps_are_met_ahead_going_down_and_held_to_the_rate_going_up() {
        let mut core = Core::new(
            CtldSettings {
                max_ramp_w_per_s: Some(50.0),
                ..options()
            },
            Loaded::default(),
            UnixMs(T0),
        );
        let sum = |out: &Output| -> f64 {
            out.leases
                .values()
                .flat_map(|l| l.caps.values())
                .map(|c| c * 4.0)
                .sum()
        };
        core.step(
            UnixMs(T0),
            vec![
                budget_set(5600.0, None),
                admin(
                    AdminOp::EventAdd {
                        cut: Cut::Reduce { fraction: 0.3 },
                        start_ms: T0 + 20_000,
                        duration_ms: 60_000,
                        ramp_ms: 10_000,
                        domain: None,
                    },
                    0,
                ),
                hello("n1"),
                at_cap("n1", "101", "flex3", 700.0),
                hello("n2"),
                at_cap("n2", "102", "flex3", 700.0),
            ],
        );
        // 5 s in, a 10 s period and 10 s to confirm: the allocation looks to 25 s, half
        // way down the ramp (5 steps of 168 W), while the budget in force is untouched.
        let out = core.step(UnixMs(T0 + 5_000), vec![Input::Tick]);
        let status = core.status(UnixMs(T0 + 5_000));
        assert_eq!(status.budget_w, 5600.0);
        assert_eq!(status.allocated_budget_w, Some(4760.0));
        assert!(sum(&out) <= 4760.0 + 1e-6, "{out:?}");
        assert_eq!(out.history.as_ref().map(|h| h.budget_w), Some(5600.0));
        // Through the event, every allocation is at or below every step it serves.
        let mut t = T0 + 5_000;
        while t < T0 + 80_000 {
            t += 10_000;
            core.step(UnixMs(t), vec![Input::Tick]);
            let allocated = core
                .status(UnixMs(t))
                .allocated_budget_w
                .expect("allocated");
            for at in (t..t + 20_000).step_by(100) {
                assert!(allocated <= core.status(UnixMs(at)).budget_w, "{t} {at}");
            }
        }
        // The full cut (3920 W) was allocated last at 65 s; from there 50 W/s, slower
        // than the event's own ramp back: 4420 W at 75 s, 4920 W at 85 s, after the end.
        let at_end = core
            .status(UnixMs(t))
            .allocated_budget_w
            .expect("allocated");
        assert_eq!((t - T0, at_end), (85_000, 4920.0));
        assert_eq!(core.status(UnixMs(t)).budget_w, 5600.0);
        core.step(UnixMs(t + 10_000), vec![Input::Tick]);
        assert_eq!(
            core.status(UnixMs(t + 10_000)).allocated_budget_w,
            Some(5420.0)
        );
        core.step(UnixMs(t + 20_000), vec![Input::Tick]);
        assert_eq!(
            core.status(UnixMs(t + 20_000)).allocated_budget_w,
            Some(5600.0)
        );
    }

    /// Issue 23: observe mode enforces nothing: the same deep cut holds no job out of a
    /// node whose agent writes no limit.
    #[test]
    fn a_cut_deeper_than_caps_holds_out_no_job_of_an_observe_only_node() {
        let mut core = fresh();
        let observing = |input: Input| match input {
            Input::Report {
                node,
                jobs,
                power_w,
                ended,
                ..
            } => Input::Report {
                node,
                jobs,
                power_w,
                ended,
                observe_only: true,
            },
            other => other,
        };
        core.step(
            UnixMs(T0),
            vec![
                budget_set(5600.0, None),
                hello("n1"),
                at_cap("n1", "101", "flex0", 700.0),
                hello("n2"),
                observing(at_cap("n2", "102", "flex3,preempt=suspend", 700.0)),
            ],
        );
        let out = core.step(
            UnixMs(T0 + 500),
            vec![admin(
                AdminOp::EventAdd {
                    cut: Cut::Target { budget_w: 3300.0 },
                    start_ms: T0 + 5_000,
                    duration_ms: 30_000,
                    ramp_ms: 0,
                    domain: None,
                },
                0,
            )],
        );
        assert!(out.preempt.is_empty(), "{:?}", out.preempt);
        assert!(core.status(UnixMs(T0 + 500)).preempted.is_empty());
    }

    /// Issue 16: a cut below every floor at the GPUs' minimum: the flex3 job that allows
    /// it is suspended ahead of the start (flex0 never), saved, annotated, exported, and
    /// resumed when the event is over.
    #[test]
    fn a_cut_deeper_than_caps_suspends_ahead_and_resumes_after() {
        let mut core = fresh();
        core.step(
            UnixMs(T0),
            vec![
                budget_set(5600.0, None),
                hello("n1"),
                at_cap("n1", "101", "flex0", 700.0),
                hello("n2"),
                at_cap("n2", "102", "flex3,preempt=suspend", 700.0),
            ],
        );
        // Announced 4.5 s ahead: the allocation the change triggers already suspends.
        let out = core.step(
            UnixMs(T0 + 500),
            vec![admin(
                AdminOp::EventAdd {
                    cut: Cut::Target { budget_w: 3300.0 },
                    start_ms: T0 + 5_000,
                    duration_ms: 30_000,
                    ramp_ms: 0,
                    domain: None,
                },
                0,
            )],
        );
        assert_eq!(
            out.preempt,
            [Action::Suspend { job: "102".into() }],
            "{out:?}"
        );
        assert_eq!(
            core.status(UnixMs(T0 + 500)).budget_w,
            5600.0,
            "not started yet"
        );
        assert_eq!(cap(&out, "n1", "101"), Some(700.0), "flex0 untouched");
        assert_eq!(
            cap(&out, "n2", "102"),
            Some(200.0),
            "held at its lowest cap"
        );
        let saved = out.persist.expect("saved");
        assert!(saved.preempted.contains_key("102"));
        assert!(out
            .annotations
            .iter()
            .any(|(job, text)| job == "102" && text.contains("suspended:grid-cut")));
        // The metrics show it held (the edge renders this as
        // `powerflex_job_preempted{job="102",how="suspend"} 1`).
        assert!(out.metrics.as_ref().is_some_and(|m| m
            .preempted
            .get("102")
            .is_some_and(|p| p.how == powerflex_core::flex::Preempt::Suspend)));
        let status = core.status(UnixMs(T0 + 500));
        assert_eq!(status.preempted.len(), 1);
        // Suspended: the job draws idle power at its lowest cap; nothing more to do.
        let mut idle = job("102", None);
        idle.tier = "flex3,preempt=suspend".into();
        idle.cap_w = Some(200.0);
        idle.power_cap_w = Some(200.0);
        idle.power_w = Some(300.0);
        let out = core.step(
            UnixMs(T0 + 10_000),
            vec![
                Input::Report {
                    ended: Vec::new(),
                    observe_only: false,
                    node: "n2".into(),
                    power_w: 300.0,
                    jobs: vec![idle.clone()],
                },
                Input::Tick,
            ],
        );
        assert!(out.preempt.is_empty(), "{out:?}");
        // Over at 35 s: resumed.
        let out = core.step(
            UnixMs(T0 + 36_000),
            vec![
                at_cap("n1", "101", "flex0", 700.0),
                Input::Report {
                    ended: Vec::new(),
                    observe_only: false,
                    node: "n2".into(),
                    power_w: 300.0,
                    jobs: vec![idle],
                },
                Input::Tick,
            ],
        );
        assert_eq!(out.preempt, [Action::Resume { job: "102".into() }]);
        assert!(core.state().preempted.is_empty());
    }

    #[test]
    fn a_node_that_does_not_confirm_is_counted_at_its_most() {
        let mut core = fresh();
        core.step(
            UnixMs(T0),
            vec![
                budget_set(6000.0, None),
                hello("n1"),
                at_cap("n1", "101", "flex3", 600.0),
                hello("n2"),
                at_cap("n2", "102", "flex3", 600.0),
            ],
        );
        let out = core.step(UnixMs(T0 + 100), vec![budget_set(3000.0, None)]);
        assert!(cap(&out, "n1", "101").is_some_and(|c| c < 600.0));
        // n2 confirms; n1 keeps reporting 600 W past the confirmation time.
        let c2 = cap(&out, "n2", "102").expect("n2");
        core.step(UnixMs(T0 + 200), vec![at_cap("n2", "102", "flex3", c2)]);
        let late = T0 + 100 + 10_000 + 1;
        let out = core.step(
            UnixMs(late),
            vec![at_cap("n1", "101", "flex3", 600.0), Input::Tick],
        );
        // n1 is counted as silent, at its GPUs' defaults: no lease for it, and n2 is cut
        // to what is left.
        assert!(!out.leases.contains_key("n1"), "{out:?}");
        assert!(core
            .last
            .as_ref()
            .is_some_and(|d| d.reserved_w >= 8.0 * 700.0));
    }

    #[test]
    fn at_once_sends_every_lease_immediately() {
        let mut core = Core::new(
            CtldSettings {
                lease_rollout: LeaseRollout::AtOnce,
                ..options()
            },
            Loaded::default(),
            UnixMs(T0),
        );
        two_jobs_at_500_w(&mut core, "flex0");
        let out = core.step(UnixMs(T0 + 100), vec![Input::Tick]);
        assert_eq!(
            cap(&out, "n2", "102"),
            Some(700.0),
            "raised without waiting: {out:?}"
        );
    }

    /// At T0: a 4 kW budget and two nodes, each with one job at 500 W: n1's job 101
    /// (flex3) and n2's job 102 (`tier_of_102`).
    fn two_jobs_at_500_w(core: &mut Core, tier_of_102: &str) {
        core.step(
            UnixMs(T0),
            vec![
                budget_set(4000.0, None),
                hello("n1"),
                at_cap("n1", "101", "flex3", 500.0),
                hello("n2"),
                at_cap("n2", "102", tier_of_102, 500.0),
            ],
        );
    }

    /// A report of a 4-GPU job on a prior (no walked curve) at `cap_w`, its cap held 10 s,
    /// drawing `per_gpu_w` per GPU.
    fn on_prior(node: &str, id: &str, tier: &str, cap_w: f64, per_gpu_w: f64) -> Input {
        let mut j = job(id, None);
        j.tier = tier.into();
        j.points = Vec::new();
        j.cap_w = Some(cap_w);
        j.power_cap_w = Some(cap_w);
        j.power_w = Some(per_gpu_w * 4.0);
        // Few tokens for its watts: the allocator holds it low while it may.
        j.throughput = Some(10.0);
        Input::Report {
            ended: Vec::new(),
            observe_only: false,
            node: node.into(),
            power_w: per_gpu_w * 4.0,
            jobs: vec![j],
        }
    }

    /// The demo's overshoot after a phase change, the rollout's part: an increase held
    /// for a decrease's confirmation went out when the decrease was confirmed, although
    /// the raised job's draw had risen since the allocation that decided it. Budget
    /// first: a job whose draw rose is never raised on the reports from before the rise,
    /// and a confirmation never sends an older lease over a newer allocation's.
    #[test]
    fn an_increase_held_for_a_confirmation_is_dropped_when_the_raised_jobs_draw_rises() {
        let budget = 4000.0;
        let mut core = fresh();
        // Job 102 runs light (at most 300 W per GPU) on a prior, and buys few tokens
        // with its watts: it is held low, the rest goes to job 101.
        core.step(
            UnixMs(T0),
            vec![
                budget_set(budget, None),
                hello("n1"),
                at_cap("n1", "101", "flex3", 500.0),
                hello("n2"),
                on_prior("n2", "102", "flex3", 500.0, 300.0),
            ],
        );
        let mut t = T0 + 1000;
        let out = core.step(UnixMs(t), vec![Input::Tick]);
        let c1 = cap(&out, "n1", "101").expect("n1");
        let c2 = cap(&out, "n2", "102").expect("n2");
        assert!(c2 < 700.0, "102 must start capped: {out:?}");
        core.step(
            UnixMs(t + 100),
            vec![
                at_cap("n1", "101", "flex3", c1),
                on_prior("n2", "102", "flex3", c2, 300.0_f64.min(c2)),
            ],
        );
        // 102 becomes unmovable (flex0): 101 is lowered at once, 102's rise held.
        t += 1000;
        let out = core.step(
            UnixMs(t),
            vec![
                on_prior("n2", "102", "flex0", c2, 300.0_f64.min(c2)),
                Input::Tick,
            ],
        );
        let lowered = cap(&out, "n1", "101").expect("n1 lowered");
        assert!(lowered < c1, "{out:?}");
        assert_eq!(cap(&out, "n2", "102"), Some(c2), "held: {out:?}");
        // Before n1 confirms, 102's load comes: it draws its cap under the cap it had.
        let out = core.step(
            UnixMs(t + 300),
            vec![on_prior("n2", "102", "flex0", c2, c2)],
        );
        assert!(
            out.metrics.is_some(),
            "a rise under an unchanged cap is allocated at once: {out:?}"
        );
        let relowered = cap(&out, "n1", "101").expect("n1 lowered again");
        // n1 confirms the first decrease. The increase decided while 102 was light must
        // not go out: at 700 W it draws 2.8 kW, and 101 is not yet down to make room.
        let out = core.step(UnixMs(t + 400), vec![at_cap("n1", "101", "flex3", lowered)]);
        if let Some(c) = cap(&out, "n2", "102") {
            assert!(
                lowered * 4.0 + c * 4.0 <= budget + 1e-6,
                "102 raised to {c} W with 101 still at {lowered} W: {out:?}"
            );
        }
        // Once 101 confirms the second decrease, 102 gets its full cap, within the budget.
        let out = core.step(
            UnixMs(t + 500),
            vec![at_cap("n1", "101", "flex3", relowered)],
        );
        let raised = cap(&out, "n2", "102").expect("released");
        assert_eq!(raised, 700.0, "flex0: {out:?}");
        assert!(relowered * 4.0 + raised * 4.0 <= budget + 1e-6, "{out:?}");
    }

    /// An allocation and a confirmation in one batch: the leases of the allocation go
    /// out, not the increase the confirmation would have released from the one before.
    #[test]
    fn a_confirmation_in_the_same_batch_as_an_allocation_does_not_send_the_older_lease() {
        let mut core = fresh();
        two_jobs_at_500_w(&mut core, "flex3");
        let t = T0 + 1000;
        let out = core.step(UnixMs(t), vec![Input::Tick]);
        let (c1, c2) = (
            cap(&out, "n1", "101").expect("n1"),
            cap(&out, "n2", "102").expect("n2"),
        );
        core.step(
            UnixMs(t + 100),
            vec![
                at_cap("n1", "101", "flex3", c1),
                at_cap("n2", "102", "flex3", c2),
            ],
        );
        let out = core.step(
            UnixMs(t + 200),
            vec![at_cap("n2", "102", "flex0", c2), Input::Tick],
        );
        let lowered = cap(&out, "n1", "101").expect("n1 lowered");
        // n1 confirms in the same batch as a cut to 3 kW.
        let out = core.step(
            UnixMs(t + 300),
            vec![
                at_cap("n1", "101", "flex3", lowered),
                budget_set(3000.0, None),
            ],
        );
        let n1 = cap(&out, "n1", "101").unwrap_or(lowered);
        let n2 = cap(&out, "n2", "102").unwrap_or(c2);
        assert!(
            n1 * 4.0 + n2 * 4.0 <= 3000.0 + 1e-6,
            "{n1} W and {n2} W sent under a 3 kW budget: {out:?}"
        );
    }
}
