//! The controller's decisions, pure: a state machine fed agent hellos and reports, admin
//! requests (with the caller's uid), allocation ticks and site config reloads, at a time
//! passed in as `now_ms`. It answers with what to do: leases per node, annotations, state
//! to persist, admin replies and the metrics text. Nothing here sleeps, opens a socket or
//! touches a file; [`super::run`] does all of that around it, and the tests below drive it
//! on a fake clock.

use std::collections::{BTreeMap, BTreeSet, VecDeque};

use tracing::{error, info, warn};

use powerflex_core::allocate::Policy;
use powerflex_core::Watts;
use powerflex_proto::admin::{AdminOp, AdminReply};
use powerflex_proto::link::{GpuInfo, JobReport};
use powerflex_proto::status::{CtldStatus, HistorySample};

use super::metrics::MetricsInput;
use super::state::{CtldState, Loaded};
use super::{annotate, metrics, status, CtldOptions, Reload};
use crate::schedule::{active_event, effective_budget, Event};
use crate::site::{decide, Decision, NodeView};

/// Samples kept: an hour at a 1 s period, a day at the default 10 s... within memory.
pub const HISTORY: usize = 8640;

/// What the controller knows of one node.
#[derive(Debug, Clone, PartialEq)]
pub struct Session {
    pub view: NodeView,
    /// When the node last said hello or reported (0: not since this controller started).
    pub last_seen_ms: u64,
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
    },
    /// An admin request from a caller with this uid (from the socket's peer credentials).
    Admin { op: AdminOp, uid: u32 },
    /// The site config was re-read.
    Reload(Reload),
    /// The allocation period elapsed.
    Tick,
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
    /// Per node: job → per-GPU cap, W, valid for `lease_ttl_s`. Empty when nothing was
    /// allocated this step.
    pub leases: BTreeMap<String, BTreeMap<String, f64>>,
    pub lease_ttl_s: f64,
    /// Job → `AdminComment` text, only for jobs whose text changed.
    pub annotations: Vec<(String, String)>,
    /// The metrics text after an allocation.
    pub metrics: Option<String>,
}

/// The controller's state machine.
#[derive(Debug)]
pub struct Core {
    options: CtldOptions,
    state: CtldState,
    sessions: BTreeMap<String, Session>,
    /// Nodes known from before a restart that have not said hello yet.
    awaiting: BTreeSet<String>,
    /// With the state lost, nothing is allocated before this.
    hold_until_ms: u64,
    /// With known nodes awaited, nothing is allocated before this (or all are back).
    grace_until_ms: u64,
    annotations: BTreeMap<String, String>,
    history: VecDeque<HistorySample>,
    last: Option<Decision>,
    config_error: Option<String>,
    allocate_now: bool,
    dirty: bool,
}

impl Core {
    /// A controller started at `now_ms` with the state it loaded.
    pub fn new(options: CtldOptions, loaded: Loaded, now_ms: u64) -> Core {
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
        Core {
            grace_until_ms: now_ms + (options.lease_ttl_s * 500.0) as u64,
            options,
            state,
            sessions,
            awaiting,
            hold_until_ms,
            annotations: BTreeMap::new(),
            history: VecDeque::new(),
            last: None,
            config_error: None,
            allocate_now: true,
            dirty: false,
        }
    }

    /// Feeds a batch of inputs received together, then allocates once if any of them
    /// asked for it: a thousand agents connecting at once cost one allocation.
    pub fn step(&mut self, now_ms: u64, inputs: Vec<Input>) -> Output {
        let mut out = Output {
            lease_ttl_s: self.options.lease_ttl_s,
            ..Output::default()
        };
        for (index, input) in inputs.into_iter().enumerate() {
            match input {
                Input::Hello { node, gpus } => self.hello(node, gpus, now_ms),
                Input::Report {
                    node,
                    jobs,
                    power_w,
                } => self.report(&node, jobs, power_w, now_ms),
                Input::Admin { op, uid } => {
                    let changes = op.changes_state();
                    let reply = self.admin(op, uid, now_ms);
                    if reply.ok && changes {
                        self.allocate_now = true;
                    }
                    out.replies.push((index, reply));
                }
                Input::Reload(reload) => self.reload(reload),
                Input::Tick => self.allocate_now = true,
            }
        }
        if self.allocate_now {
            self.allocate_now = false;
            self.allocate(now_ms, &mut out);
        }
        if std::mem::take(&mut self.dirty) {
            out.persist = Some(self.state.clone());
        }
        out.lease_ttl_s = self.options.lease_ttl_s;
        out
    }

    /// The status snapshot at `now_ms` (liveness as of the last allocation attempt).
    pub fn status(&self, now_ms: u64) -> CtldStatus {
        status::build(
            &self.state,
            self.options.base_budget,
            &self.sessions,
            self.last.as_ref(),
            self.config_error.as_deref(),
            now_ms,
        )
    }

    pub fn state(&self) -> &CtldState {
        &self.state
    }

    pub fn options(&self) -> &CtldOptions {
        &self.options
    }

    pub fn history(&self) -> impl Iterator<Item = &HistorySample> {
        self.history.iter()
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
            });
        if self.state.nodes.get(&node) != Some(&gpus) {
            self.state.nodes.insert(node.clone(), gpus.clone());
            self.dirty = true;
        }
        self.awaiting.remove(&node);
        session.view.gpus = gpus;
        session.last_seen_ms = now_ms;
        self.allocate_now = true;
    }

    fn report(&mut self, node: &str, jobs: Vec<JobReport>, power_w: f64, now_ms: u64) {
        // A report before a hello is dropped: the link only forwards reports from a
        // connection that said hello as this node.
        let Some(s) = self.sessions.get_mut(node) else {
            return;
        };
        // Only a change in the set of jobs needs a new allocation before the next tick.
        let changed = s
            .view
            .jobs
            .iter()
            .map(|j| &j.job_id)
            .ne(jobs.iter().map(|j| &j.job_id));
        s.view.jobs = jobs;
        s.view.power_w = power_w;
        s.last_seen_ms = now_ms;
        self.allocate_now |= changed;
    }

    /// A valid config replaces the budget, policy, tiers and lease settings at once; the
    /// listen addresses, sockets, state directory, key and period need a restart. A
    /// refused one leaves the config in force and is reported by `status` until a valid
    /// one arrives.
    fn reload(&mut self, reload: Reload) {
        match reload {
            Ok(new) => {
                let old = &self.options;
                let needs_restart = new.listen != old.listen
                    || new.admin_socket != old.admin_socket
                    || new.state_dir != old.state_dir
                    || new.key != old.key
                    || new.period != old.period
                    || new.metrics_listen != old.metrics_listen;
                if needs_restart {
                    warn!("site config reloaded; listen addresses, sockets, state directory, key and allocation period change only on restart");
                }
                info!(
                    base_budget_w = new.base_budget.0,
                    policy = new.site.policy.name(),
                    lease_ttl_s = new.lease_ttl_s,
                    "site config reloaded"
                );
                self.options = CtldOptions {
                    listen: old.listen,
                    admin_socket: old.admin_socket.clone(),
                    state_dir: old.state_dir.clone(),
                    key: old.key.clone(),
                    period: old.period,
                    metrics_listen: old.metrics_listen,
                    ..new
                };
                self.config_error = None;
                self.allocate_now = true;
            }
            Err(e) => {
                error!(error = %e, "site config reload refused; the previous config stays in force");
                self.config_error = Some(e);
            }
        }
    }

    fn admin(&mut self, op: AdminOp, uid: u32, now_ms: u64) -> AdminReply {
        if op.changes_state() && uid != 0 {
            return AdminReply::error("only root may change the budget or grid events");
        }
        match op {
            AdminOp::Status => AdminReply {
                status: Some(self.status(now_ms)),
                ..AdminReply::ok()
            },
            AdminOp::History => AdminReply {
                history: Some(self.history.iter().cloned().collect()),
                ..AdminReply::ok()
            },
            AdminOp::BudgetSet { budget_w } => {
                if !(budget_w.is_finite() && budget_w > 0.0) {
                    return AdminReply::error(format!(
                        "budget must be a positive power (got {budget_w} W)"
                    ));
                }
                info!(budget_w, "budget set");
                self.state.budget_w = Some(Watts(budget_w));
                self.dirty = true;
                AdminReply::ok()
            }
            AdminOp::EventAdd {
                cut,
                start_ms,
                duration_ms,
                ramp_ms,
            } => {
                if duration_ms == 0 || ramp_ms.saturating_mul(2) > duration_ms {
                    return AdminReply::error(
                        "an event needs a duration longer than twice its ramp",
                    );
                }
                self.state.next_event_id += 1;
                let event = Event {
                    id: self.state.next_event_id,
                    cut,
                    start_ms,
                    duration_ms,
                    ramp_ms,
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
                    return AdminReply::error(format!("no event {id}"));
                }
                info!(id, "grid event cancelled");
                self.dirty = true;
                AdminReply::ok()
            }
            AdminOp::WhatIf { policy, budget_w } => {
                let Some(policy) = Policy::from_name(&policy) else {
                    return AdminReply::error(format!(
                        "unknown policy {policy:?}; accepted: {}",
                        Policy::NAMES.join(", ")
                    ));
                };
                let budget = match budget_w {
                    Some(w) if !(w.is_finite() && w > 0.0) => {
                        return AdminReply::error(format!(
                            "budget must be a positive power (got {w} W)"
                        ))
                    }
                    Some(w) => Watts(w),
                    None => effective_budget(
                        self.state.budget_w.unwrap_or(self.options.base_budget),
                        &self.state.events,
                        now_ms,
                    ),
                };
                let views: Vec<NodeView> = self.sessions.values().map(|s| s.view.clone()).collect();
                let settings = crate::site::SiteSettings {
                    policy,
                    ..self.options.site.clone()
                };
                AdminReply {
                    what_if: Some(status::decision_view(&decide(&views, budget, &settings))),
                    ..AdminReply::ok()
                }
            }
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
        let budget = effective_budget(base, &self.state.events, now_ms);
        let views: Vec<NodeView> = self.sessions.values().map(|s| s.view.clone()).collect();
        let decision = decide(&views, budget, &self.options.site);
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
        out.leases = decision.leases.clone();
        out.annotations = annotate::changes(
            &decision,
            self.sessions.values().flat_map(|s| s.view.jobs.iter()),
            &mut self.annotations,
        );
        let draw = status::live_draw_w(&self.sessions);
        let caps: BTreeMap<String, f64> = decision
            .allocation
            .as_ref()
            .map(|a| a.jobs.iter().map(|j| (j.id.clone(), j.cap_w.0)).collect())
            .unwrap_or_default();
        self.history.push_back(HistorySample {
            t_ms: now_ms,
            budget_w: budget.0,
            draw_w: draw,
            caps,
            simulated: self
                .sessions
                .values()
                .any(|s| s.view.live && s.view.gpus.iter().any(|g| g.name.contains("(simulated)"))),
        });
        while self.history.len() > HISTORY {
            self.history.pop_front();
        }
        out.metrics = Some(metrics::render(&MetricsInput {
            decision: &decision,
            base,
            budget,
            draw_w: draw,
            nodes: self
                .sessions
                .iter()
                .map(|(n, s)| (n.as_str(), s.view.live))
                .collect(),
            event_active: active_event(base, &self.state.events, now_ms).is_some(),
        }));
        self.last = Some(decision);
    }
}
