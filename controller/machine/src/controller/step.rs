//! The controller's decisions, pure: a state machine fed agent hellos and reports, admin
//! requests (with the caller's uid), allocation ticks and site config reloads, at a time
//! passed in as a [`UnixMs`]. It answers with what to do: leases per node, annotations,
//! state to persist, admin replies, what the metrics show and each allocation's history
//! sample (the history is served from [`super::history`], not from here). Nothing here
//! sleeps, opens a socket or touches a file; the edge (`powerflex_controller::ctld::run`)
//! does all of that around it, and the tests drive it on a fake clock.
//!
//! This file holds the machine's types and the step that dispatches each input; each
//! kind of input is handled in a child module: `agents` (hellos, epoch refusals),
//! `report` (reports and final shares), `slurm` (Slurm's placement), `admin`
//! (admin requests), `reload` (a re-read site config), and `allocate` (ticks: one
//! allocation), with `domains` for the power domains' budgets they share.

mod admin;
mod agents;
mod allocate;
mod domains;
mod durable;
mod reload;
mod report;
mod slurm;
#[cfg(test)]
mod tests;

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

use tracing::{info, warn};

use powerflex_core::config::JobPlacement;
use powerflex_core::UnixMs;
use powerflex_decide::{Decision, NodeView};
use powerflex_proto::admin::{AdminOp, AdminReply};
use powerflex_proto::report::{GpuInfo, JobReport};
use powerflex_proto::status::{
    CtldStatus, CurveSnapshot, HistorySample, LeadershipRole, LeadershipView, NodeStatus,
};
use powerflex_proto::usage::{FinalRef, JobEnergyRecord, NodeUsage};

use crate::controller::accounting::Ledger;
use crate::controller::metrics::{EnergyTotals, MetricsSnapshot};
use crate::controller::owners::{self, OwnerMap, Owners};
use crate::controller::session::Session;
use crate::controller::state::{CtldState, Loaded};
use crate::controller::unheard::Unheard;
use crate::controller::{status, CtldSettings, SettingsReload};
use crate::error::MachineError;
use crate::placement::Placement;
use crate::preempt::Action;
use crate::ramp::{Ramp, RampPlan};
use crate::rollout::Rollout;

/// One input to [`Controller::step`].
#[derive(Debug, Clone)]
pub enum Input {
    /// An agent (re)connected, with its GPUs.
    Hello { node: String, gpus: Vec<GpuInfo> },
    /// An agent's periodic report.
    Report {
        node: String,
        jobs: Vec<JobReport>,
        power_w: f64,
        /// Final shares of jobs that ended on the node (see [`super::accounting`]).
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
    Placement(Box<Result<Placement, MachineError>>),
    /// The accounting database's writer changed state (shown by `status`).
    AccountingDb(powerflex_proto::status::AccountingDbView),
    /// Whether this controller steers, as its leadership (`[controller.ha]`) last
    /// decided: while not active it sends no lease and refuses admin changes.
    Leadership(LeadershipView),
    /// An agent refused this controller's lease for its epoch: a controller of a later
    /// epoch steers it. This one stops leasing that node (fenced by it); the rest of the
    /// site it goes on steering, as one node's word must not stop a site, unless it is a
    /// single controller that most of its nodes refuse (see `Controller::fenced`).
    Fenced {
        node: String,
        lease_epoch: u64,
        accepted_epoch: u64,
    },
    /// The state of [`Output::persist_version`] `version` (and every older one) is
    /// durable: the state file written and synced, or under `[controller.ha]` committed
    /// to the leadership database. What was held for it goes out (see the `durable` step).
    Durable { version: u64 },
    /// The state of `version` could not be made durable (`error` says why): the last
    /// durable state is put back in force and admin changes are refused until a later
    /// version is durable.
    NotDurable { version: u64, error: String },
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
    /// Per job of the node: the lowest per-GPU cap the next announced site event's plan
    /// needs, W (the announced event's plan): its walk reaches down to it,
    /// so the event's caps land where the job was measured. Empty while no event is
    /// announced.
    pub walk_to_w: BTreeMap<String, f64>,
    /// A grid event is in force (the jobs' accounting counts time in events).
    pub event_in_force: bool,
}

/// What one [`Controller::step`] asks the I/O edge to do, in this order: persist, reply, lease,
/// annotate, publish metrics. The leases, Slurm commands and annotations of a state not
/// yet durable are held in the machine until it is (see the `durable` step), so everything here
/// may be carried out at once; the edge answers the save with [`Input::Durable`].
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Output {
    /// The state to save before anything else: an admin change is acknowledged only once
    /// saved.
    pub persist: Option<CtldState>,
    /// The version of `persist`, which [`Input::Durable`] names once it is durable.
    pub persist_version: u64,
    /// The replies to this step's [`Input::Admin`]s, each with the input's index in the
    /// step's inputs; an admin change's reply waits for its state to be durable (see
    /// `wait_replies`).
    pub replies: Vec<(usize, AdminReply)>,
    /// The admins of this step (by input index) whose change is answered once its state
    /// is durable, each under a ticket that `late_replies` names.
    pub wait_replies: Vec<(usize, u64)>,
    /// Replies to admins who waited, by ticket: done once durable, or refused when the
    /// state could not be saved or the controller stopped steering first.
    pub late_replies: Vec<(u64, AdminReply)>,
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
pub struct Controller {
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
    /// I/O edge; the step keeps none).
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
    /// Per job: the lowest per-GPU cap the next announced site event's plan needs, W,
    /// as of the last allocation (empty while none is announced).
    event_caps_w: BTreeMap<String, f64>,
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
    /// Jobs' energy shares and records (see [`super::accounting`]).
    ledger: Ledger,
    /// The accounting database's writer, as the I/O edge last reported it.
    accounting_db: Option<powerflex_proto::status::AccountingDbView>,
    /// Whether this controller steers, where that is in question (see
    /// [`Input::Leadership`], [`Input::Fenced`]); none: a single controller, steering.
    leadership: Option<LeadershipView>,
    /// Nodes whose agents refused this controller's leases for their epoch, with the
    /// epoch each follows: this controller leases them no more (a new leadership builds
    /// a new one; a restart starts afresh).
    fenced_by: BTreeMap<String, u64>,
    /// Energy of the records written since the controller started, for the metrics.
    energy_totals: EnergyTotals,
    /// What waits for the state to be durable (see [`durable`]).
    durability: durable::Durability,
    /// Jobs Slurm shows held by powerflex that the state does not hold: resumed or
    /// released by the next step that steers (see `Controller::placement_read`).
    orphans: Vec<Action>,
    /// Jobs this controller has given back so (once each, while Slurm lists them).
    reconciled: BTreeSet<String>,
}

impl Controller {
    /// A controller started at `now_ms` with the state it loaded.
    pub fn new(options: CtldSettings, loaded: Loaded, now: UnixMs) -> Controller {
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
                (node.clone(), Session::new(view, gpus.clone()))
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
        let durability = durable::Durability::new(&state);
        Controller {
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
            event_caps_w: BTreeMap::new(),
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
            durability,
            orphans: Vec::new(),
            reconciled: BTreeSet::new(),
        }
    }

    /// Whether this controller steers the site now: a single controller always, under
    /// `[controller.ha]` only while active, and never once fenced.
    pub fn steering(&self) -> bool {
        self.leadership
            .as_ref()
            .is_none_or(|l| l.role == LeadershipRole::Active)
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
        // This step's accepted admin changes: answered once their state is durable.
        let mut changes = Vec::new();
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
                Input::Admin { op, uid } if op.changes_state() && uid == 0 => {
                    match self.refuse_while_not_durable() {
                        Some(refused) => out.replies.push((index, refused)),
                        None => {
                            let reply = self.admin(op, uid, now_ms);
                            if reply.is_ok() {
                                self.allocate_now = true;
                                changes.push((index, reply));
                            } else {
                                out.replies.push((index, reply));
                            }
                        }
                    }
                }
                Input::Admin { op, uid } => {
                    let reply = owners::need_to_know(self.admin(op, uid, now_ms), uid, |job| {
                        self.owners.of(job)
                    });
                    out.replies.push((index, reply));
                }
                Input::Reload(reload) => self.reload(*reload),
                Input::Tick => {
                    self.allocate_now = true;
                    // While saves fail, each period tries one again: its success is
                    // what lets admin changes in.
                    if self.durability.save_error().is_some() {
                        self.dirty = true;
                    }
                }
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
                Input::Durable { version } => self.durable(version),
                Input::NotDurable { version, error } => {
                    self.not_durable(version, error, now_ms, &mut out);
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
            // Given back by whichever controller steers (this one, should it lead again).
            for orphan in self.orphans.drain(..) {
                self.reconciled.remove(orphan.job());
            }
            self.drop_held_on_stepping_down(&mut out);
            for (index, _) in changes {
                out.replies.push((index, self.not_active()));
            }
            return self.finish_step(now_ms, Vec::new(), out);
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
        // Slurm's own record of jobs held by powerflex that this leader does not hold (a
        // deposed leader's suspension, or one decided on a state that was never saved).
        out.preempt.append(&mut self.orphans);
        self.finish_step(now_ms, changes, out)
    }

    /// What every step ends with, steering or not: the state to save, what waits for it
    /// to be durable, the placement refresh, the energy records due.
    fn finish_step(
        &mut self,
        now_ms: u64,
        changes: Vec<(usize, AdminReply)>,
        mut out: Output,
    ) -> Output {
        if std::mem::take(&mut self.dirty) {
            out.persist = Some(self.state.clone());
        }
        self.hold_until_durable(now_ms, changes, &mut out);
        // A node that refused this controller's epoch gets no lease from it.
        out.leases
            .retain(|node, _| !self.fenced_by.contains_key(node));
        out.lease_ttl_s = self.options.lease_ttl_s;
        out.refresh_placement = std::mem::take(&mut self.refresh_placement);
        self.write_records(now_ms, &mut out);
        out
    }

    /// The nodes Slurm's placement (where the controller reads it) or the power domains
    /// name whose agents this controller has never heard from, each with its reserve
    /// (see [`super::unheard`]).
    pub fn unheard(&self) -> Vec<Unheard> {
        let placement = self.checked_placement().flatten();
        let domain_nodes = self
            .options
            .site
            .domains
            .iter()
            .flat_map(|d| d.tree.domains().iter())
            .flat_map(|d| d.nodes.iter().map(String::as_str));
        super::unheard::unheard(
            placement.as_deref(),
            domain_nodes,
            &self.sessions,
            self.options.max_gpu_power_w,
        )
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
        let tier_of = powerflex_decide::least_flexible_tiers(
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
        let unheard = self.unheard();
        if !unheard.is_empty() {
            status.unmanaged_reserve_w = Some(unheard.iter().map(|u| u.reserve_w).sum());
            status.nodes.extend(unheard.iter().map(|u| NodeStatus {
                node: u.node.clone(),
                gpus: u.gpus,
                live: false,
                power_w: 0.0,
                jobs: 0,
                // Never seen: as long ago as a node this controller has not seen since
                // it started.
                seen_ms_ago: now_ms,
                refused_reports: 0,
                refused_gpus: 0,
                domain: None,
                unmanaged_reserve_w: Some(u.reserve_w),
            }));
            status.nodes.sort_by(|a, b| a.node.cmp(&b.node));
        }
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
            // Its nodes count the unheard ones too (never live): a domain's draw is
            // known only once every node behind it reports.
            let mut reserve: BTreeMap<&str, (u32, f64)> = BTreeMap::new();
            for u in &unheard {
                for d in site.tree.path_of_node(&u.node) {
                    let r = reserve
                        .entry(site.tree.domains()[d].name.as_str())
                        .or_default();
                    r.0 += 1;
                    r.1 += u.reserve_w;
                }
            }
            for d in &mut status.domains {
                if let Some(&(nodes, w)) = reserve.get(d.name.as_str()) {
                    d.nodes += nodes;
                    d.unmanaged_reserve_w = Some(w);
                }
            }
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
}
