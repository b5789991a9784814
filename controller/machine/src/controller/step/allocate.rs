//! One allocation: the budget planned over the confirmation window, the decision and
//! its preemptions, the leases, annotations, history sample and metrics.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

use tracing::{error, info, warn};

use powerflex_core::allocate::Policy;
use powerflex_core::config::{JobPlacement, LeaseRollout};
use powerflex_core::Watts;
use powerflex_decide::{Decision, NodeView, SiteSettings};
use powerflex_proto::status::{DomainStatus, HistorySample};

use crate::controller::accounting;
use crate::controller::history::HISTORY;
use crate::controller::metrics::MetricsSnapshot;
use crate::controller::session::Session;
use crate::controller::unheard::Unheard;
use crate::controller::{annotate, learning, status};
use crate::preempt::Preempted;
use crate::preempt::{self, Action};
use crate::ramp::{look_ahead_ms, RampPlan};
use crate::rollout::LeaseOut;
use crate::schedule::SteppedRamp;
use powerflex_proto::event::{Cut, Event};

use super::{Controller, Lease, Output};

/// Least time a node gets to confirm its decreases before it counts at its most, ms: an
/// agent applies a lease at once and reports within tens of milliseconds, but a busy host
/// or link can take longer than a short allocation period.
const MIN_CONFIRM_MS: u64 = 2_000;

/// The budget one allocation is made for.
struct Window {
    /// The site's budget before its events (an admin's, else the configured one).
    base: Watts,
    /// The site's ramp over the window: what is in force now and what to allocate for.
    plan: RampPlan,
    /// The site's settings with each domain's limit over the window.
    site: SiteSettings,
    /// How long a node has to confirm its decreases, ms.
    confirm_ms: u64,
}

/// The budgets the metrics show of one allocation, W.
struct Budgets {
    base: Watts,
    in_force: Watts,
    allocated: Watts,
    draw_w: f64,
}

impl Controller {
    /// One allocation, once the controller may make one (`may_allocate`):
    /// the budget over the confirmation window, the decision with its preemptions, then
    /// what goes out (leases, annotations, the history sample, the metrics).
    pub(super) fn allocate(&mut self, now_ms: u64, out: &mut Output) {
        if !self.may_allocate(now_ms) {
            return;
        }
        self.drop_ended_events(now_ms);
        // Nodes the site names that never spoke: paid for at their worst case.
        let unheard = self.unheard();
        let Window {
            base,
            plan,
            site,
            confirm_ms,
        } = self.budget_window(now_ms, &unheard);
        let in_force = Watts(plan.in_force_w);
        let budget = Watts(plan.allocate_w);
        let stalled = self.rollout.stalled(now_ms, confirm_ms);
        if !stalled.is_empty() {
            warn!(nodes = ?stalled, "decreases not confirmed in time; counting those nodes at the most they may draw");
        }
        let views = self.allocation_views(&stalled, &unheard);
        self.event_caps_w = self.announced_event_caps(&views, &site, base, now_ms);
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
        let preempt::Plan {
            decision,
            held,
            actions,
        } = self.plan_preemptions(&views, budget, &site, cut_ahead, now_ms);
        let (held, actions) = self.spare_observed(held, actions);
        log_preemptions(&actions, budget);
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
        out.leases = self.send_leases(&decision, now_ms);
        out.annotations = self.annotations_of(&decision, &views);
        let draw = status::live_draw_w(&self.sessions);
        let domains = self.sample_history(&decision, in_force, draw, now_ms, out);
        self.allocations += 1;
        self.publish_metrics(
            decision,
            Budgets {
                base,
                in_force,
                allocated: budget,
                draw_w: draw,
            },
            domains,
            &unheard,
            now_ms,
            out,
        );
    }

    /// Whether an allocation may be made now, with each node's liveness brought up to
    /// `now_ms`: not while the state was lost and old leases may still hold caps, nor
    /// while Slurm's first placement or the agents known before a restart are awaited
    /// (at most half a lease).
    fn may_allocate(&mut self, now_ms: u64) -> bool {
        let ttl_ms = (self.options.lease_ttl_s * 1000.0) as u64;
        for s in self.sessions.values_mut() {
            s.view.live = now_ms.saturating_sub(s.last_seen_ms) < ttl_ms;
        }
        if now_ms < self.hold_until_ms {
            return false;
        }
        // Slurm's first answer (a fraction of a second after the start) is awaited as the
        // known agents are: allocating before it would believe no job and hold every one
        // at the start cap until it came, while the old leases still hold their caps.
        let placement_due = self.options.job_placement == JobPlacement::Slurm
            && self.placement.is_none()
            && self.placement_error.is_none();
        if placement_due && now_ms < self.grace_until_ms {
            return false;
        }
        if !self.awaiting.is_empty() {
            if now_ms < self.grace_until_ms {
                // Their old leases still hold every cap; nothing is lost by waiting.
                return false;
            }
            warn!(nodes = ?self.awaiting, "agents known before the restart did not reconnect; counting them at their fail-safe cap");
            self.awaiting.clear();
        }
        true
    }

    /// Events that ended are dropped from the state (and the state saved).
    fn drop_ended_events(&mut self, now_ms: u64) {
        let before = self.state.events.len();
        self.state.events.retain(|e| e.pending(now_ms));
        if self.state.events.len() != before {
            self.dirty = true;
        }
    }

    /// The budget this allocation is made for: the site's ramp plan over the window until
    /// the next allocation's caps are confirmed, and each domain's limit over the same
    /// window. Keeps the plan and each domain's start cap for the leases.
    fn budget_window(&mut self, now_ms: u64, unheard: &[Unheard]) -> Window {
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
        let site = self.domain_window(now_ms, ahead_ms);
        self.domain_start_cap_w = domain_start_caps(&site, &self.sessions, unheard);
        if plan.rate_limited {
            info!(
                allocate_w = plan.allocate_w,
                in_force_w = plan.in_force_w,
                "budget rise held to the ramp-rate limit"
            );
        }
        self.last_plan = Some(plan);
        Window {
            base,
            plan,
            site,
            confirm_ms,
        }
    }

    /// The site's settings with each power domain's limit over `[now_ms, now_ms +
    /// ahead_ms]` (its own events' ramps), its rise held to the site's ramp-rate limit as
    /// the site's is.
    fn domain_window(&mut self, now_ms: u64, ahead_ms: u64) -> SiteSettings {
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
        site
    }

    /// The nodes as this allocation sees them: a node that has not confirmed its
    /// decreases in time (`stalled`) or that refused this controller's epoch counts as
    /// silent, a node never heard from (`unheard`) as silent at its worst case, and a
    /// job on several nodes carries its least flexible tier.
    fn allocation_views(&self, stalled: &BTreeSet<String>, unheard: &[Unheard]) -> Vec<NodeView> {
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
            .chain(unheard.iter().map(|u| u.view(self.options.max_gpu_power_w)))
            .collect();
        // A job on several nodes is as flexible as the least flexible of them says: the
        // decision, the preemptions and the annotations all read these views.
        powerflex_decide::apply_least_flexible_tiers(&mut views, &self.options.site.tiers);
        views
    }

    /// The decision with its preemptions: caps first; where caps at every floor cannot
    /// meet the budget, jobs that allow it are held out (crate::preempt), and given back
    /// once they fit again (`cut_ahead`: a cut is in force or coming in the window).
    fn plan_preemptions(
        &self,
        views: &[NodeView],
        budget: Watts,
        site: &SiteSettings,
        cut_ahead: bool,
        now_ms: u64,
    ) -> preempt::Plan {
        // The caps in force stay while a new decision would buy too little to be worth a
        // change (`powerflex_decide::decide_steady`).
        let caps_in_force: BTreeMap<String, f64> = self
            .last
            .as_ref()
            .and_then(|d| d.allocation.as_ref())
            .map(|a| a.jobs.iter().map(|j| (j.id.clone(), j.cap_w.0)).collect())
            .unwrap_or_default();
        // Slurm's record says when a held job ended; before its first answer, none
        // has (a held job is never dropped on a node's silence).
        let placement = self.placement.as_ref();
        let in_slurm = |job: &str| {
            placement.is_none_or(|p| {
                p.jobs
                    .get(job)
                    .is_some_and(|j| j.state != powerflex_core::slurm_record::SlurmJobState::Ended)
            })
        };
        // Jobs someone else suspended (an admin's `scontrol suspend`): Slurm's record
        // says so, the nodes' reports cannot (a stopped job and one between two steps
        // draw alike). Without that record, none is known. Not one powerflex suspended:
        // held in its state, or, just resumed by it, still suspended in a record read
        // before the resume (its AdminComment says powerflex suspended it); that one is
        // allocated on its curve, as a job given back is.
        let suspended: BTreeSet<String> = match (self.options.job_placement, placement) {
            (JobPlacement::Slurm, Some(p)) => p
                .jobs
                .iter()
                .filter(|(id, j)| {
                    j.state == powerflex_core::slurm_record::SlurmJobState::Suspended
                        && !self.state.preempted.contains_key(*id)
                        && !super::slurm::held_by_powerflex(j, ";suspended:")
                })
                .map(|(id, _)| id.clone())
                .collect(),
            _ => BTreeSet::new(),
        };
        let outlook = preempt::Outlook {
            cut_ahead,
            in_slurm: match self.options.job_placement {
                JobPlacement::Slurm => Some(&in_slurm),
                JobPlacement::Reports => None,
            },
            suspended: &suspended,
        };
        preempt::plan(
            views,
            budget,
            site,
            &self.state.preempted,
            outlook,
            &caps_in_force,
            now_ms,
        )
    }

    /// `held` and `actions` without new holds on the jobs of observe-only nodes: observe
    /// mode enforces nothing, so such a job is not held out (what would happen is logged),
    /// and a site's first week suspends no one. A job already held stays held and tracked,
    /// and its resume or release goes out, whatever its node's mode now: a node switched to
    /// observe mode mid-cut must not leave its suspended job suspended for ever.
    fn spare_observed(
        &self,
        held: BTreeMap<String, Preempted>,
        actions: Vec<Action>,
    ) -> (BTreeMap<String, Preempted>, Vec<Action>) {
        let already = &self.state.preempted;
        let spared: BTreeSet<&str> = self
            .sessions
            .values()
            .filter(|s| s.observe_only)
            .flat_map(|s| s.view.jobs.iter().map(|j| j.job_id.as_str()))
            .filter(|job| !already.contains_key(*job))
            .collect();
        if spared.is_empty() {
            return (held, actions);
        }
        let (kept, skipped): (Vec<Action>, Vec<Action>) =
            actions.into_iter().partition(|a| !spared.contains(a.job()));
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
            .filter(|(job, _)| !spared.contains(job.as_str()))
            .collect();
        (held, kept)
    }

    /// The leases `decision` sends now: all of them at once, or the decreases first and
    /// the increases once those are confirmed (`lease_rollout`).
    fn send_leases(&mut self, decision: &Decision, now_ms: u64) -> BTreeMap<String, Lease> {
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
        sends
            .into_iter()
            .map(|l| {
                let lease = self.lease_for(&l.node, Some(decision), l.caps, &reporting, now_ms);
                (l.node, lease)
            })
            .collect()
    }

    /// The `AdminComment`s `decision` changes, each after what the site wrote there.
    fn annotations_of(&mut self, decision: &Decision, views: &[NodeView]) -> Vec<(String, String)> {
        let mut annotations = annotate::changes(
            decision,
            &self.state.preempted,
            views.iter().flat_map(|v| v.jobs.iter()),
            &mut self.annotations,
        );
        // What a site wrote in a job's AdminComment stays, before powerflex's segment.
        if let Some(placement) = &self.placement {
            for (job, text) in &mut annotations {
                if let Some(j) = placement.jobs.get(job.as_str()) {
                    *text = accounting::merge_admin_comment(&j.admin_comment, text);
                }
            }
        }
        annotations
    }

    /// This allocation's history sample and, when they changed, the jobs' owners (into
    /// `out`); returns the domains' status, which the metrics show too.
    fn sample_history(
        &mut self,
        decision: &Decision,
        in_force: Watts,
        draw: f64,
        now_ms: u64,
        out: &mut Output,
    ) -> Vec<DomainStatus> {
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
                    Some(decision),
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
        domains
    }

    /// The curves learned when an event ended, and what the metrics show of this
    /// allocation; `decision` becomes the last one.
    fn publish_metrics(
        &mut self,
        decision: Decision,
        budgets: Budgets,
        domains: Vec<DomainStatus>,
        unheard: &[Unheard],
        now_ms: u64,
        out: &mut Output,
    ) {
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
            base: budgets.base,
            budget: budgets.in_force,
            allocated: budgets.allocated,
            draw_w: budgets.draw_w,
            nodes: self
                .sessions
                .iter()
                .map(|(n, s)| (n.clone(), s.draw_known()))
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
            unmanaged_nodes: unheard.len() as u64,
            unmanaged_reserve_w: unheard.iter().map(|u| u.reserve_w).sum(),
        });
        self.last = Some(decision);
    }

    /// Per job: the lowest per-GPU cap the deepest site event announced and not yet
    /// started will need, W: the lower of the site policy's and the equal split's caps
    /// for every job, decided now on the event's budget (its cut at its hold) over the
    /// nodes as they are. Sent in the leases (`walk_to_w`) so that calibration walks
    /// reach those caps before the event (pre-positioning): a plan made on caps the
    /// walks never read rests on the curves' guess below them. Empty when no event is
    /// announced; a power domain's event is not planned for here.
    pub(super) fn announced_event_caps(
        &self,
        views: &[NodeView],
        site: &SiteSettings,
        base: Watts,
        now_ms: u64,
    ) -> BTreeMap<String, f64> {
        let budget = self
            .state
            .events
            .iter()
            .filter(|e| e.start_ms > now_ms && e.domain.is_none())
            .map(|e| match e.cut {
                Cut::Reduce { fraction } => base.0 * (1.0 - fraction.clamp(0.0, 1.0)),
                Cut::Target { budget_w } => budget_w.min(base.0),
            })
            .min_by(f64::total_cmp);
        let Some(budget) = budget else {
            return BTreeMap::new();
        };
        let mut caps: BTreeMap<String, f64> = BTreeMap::new();
        let equal = SiteSettings {
            policy: Policy::Equal,
            ..site.clone()
        };
        for settings in [site, &equal] {
            let decision = powerflex_decide::decide(views, Watts(budget), settings);
            for job in decision.allocation.iter().flat_map(|a| &a.jobs) {
                caps.entry(job.id.clone())
                    .and_modify(|c| *c = c.min(job.cap_w.0))
                    .or_insert(job.cap_w.0);
            }
        }
        caps
    }

    /// How many live or silent nodes report each job, counted once per allocation: a
    /// lease's `learn` list asks it of every job it names, and a scan of every node per
    /// job would make the allocation quadratic in the nodes (24 s at 10,000 in the site
    /// harness).
    pub(super) fn nodes_reporting_each_job(&self) -> BTreeMap<&str, usize> {
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

    /// A node's lease with `caps`: `decision`'s start cap and the node's jobs to walk
    /// again (before any decision: the fail-safe cap, nothing to walk).
    pub(super) fn lease_for(
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
        // The caps the next announced event needs of this node's jobs.
        let walk_to_w = caps
            .keys()
            .filter_map(|job| Some((job.clone(), *self.event_caps_w.get(job)?)))
            .collect();
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
            walk_to_w,
            event_in_force: self
                .events_of_node(node)
                .iter()
                .any(|(base, e)| e.cut_w(base.0, now_ms) > 0.0),
        }
    }
}

/// Each power domain's limit in force over the GPUs behind it, W: a job that starts
/// before the next allocation names it starts no higher on any domain of its node's path
/// (empty without domains).
fn domain_start_caps(
    site: &SiteSettings,
    sessions: &BTreeMap<String, Session>,
    unheard: &[Unheard],
) -> Vec<f64> {
    match &site.domains {
        None => Vec::new(),
        Some(d) => {
            let mut gpus = vec![0usize; d.limits_w.len()];
            for s in sessions.values() {
                for i in d.tree.path_of_node(&s.view.node) {
                    gpus[i] += s.view.gpus.len();
                }
            }
            // A node never heard from shares its domains' limits by its GPUs too.
            for u in unheard {
                for i in d.tree.path_of_node(&u.node) {
                    gpus[i] += u.gpus as usize;
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
    }
}

/// Logs each preemption as it is sent: a hold-out as a warning, a give-back as news.
fn log_preemptions(actions: &[Action], budget: Watts) {
    for action in actions {
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
}

/// Seconds from `now_ms` to the start of the next event not yet started, if any.
fn next_event_in_s<'a>(events: impl IntoIterator<Item = &'a Event>, now_ms: u64) -> Option<f64> {
    events
        .into_iter()
        .filter(|e| e.start_ms > now_ms)
        .map(|e| (e.start_ms - now_ms) as f64 / 1000.0)
        .min_by(f64::total_cmp)
}
