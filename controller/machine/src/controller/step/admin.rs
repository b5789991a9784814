//! Admin requests: who may ask what, and each operation's answer.

use tracing::{info, warn};

use powerflex_core::allocate::Policy;
use powerflex_core::{UnixMs, Watts};
use powerflex_decide::{decide_holding, NodeView};
use powerflex_proto::admin::{AdminAnswer, AdminOp, AdminReply, Refusal};
use powerflex_proto::event::Cut;
use powerflex_proto::usage::JobEnergyRecord;

use crate::controller::accounting::{self};
use crate::controller::state::MAX_BUDGET_W;
use crate::controller::status;
use crate::schedule::effective_budget;
use powerflex_proto::event::Event;

use super::Controller;

impl Controller {
    /// The refusal of an admin change while this controller does not steer.
    pub(super) fn not_active(&self) -> AdminReply {
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

    /// None when the site config declares the power domain `name`; else the refusal
    /// that names the domains it does declare.
    pub(super) fn unknown_domain(&self, name: &str) -> Option<AdminReply> {
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

    /// The answer to an admin request from `uid`: who may ask it first, then the
    /// operation's own answer.
    pub(super) fn admin(&mut self, op: AdminOp, uid: u32, now_ms: u64) -> AdminReply {
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
            AdminOp::Status => {
                AdminReply::Done(AdminAnswer::Status(Box::new(self.status(UnixMs(now_ms)))))
            }
            // Answered by the admin threads from the history board, never in this loop:
            // one that arrives here was sent by mistake, and the step keeps no history
            // to answer it with.
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
            } => self.accounting_page(&accounting::RecordQuery {
                since_ms,
                until_ms,
                // A user asks for their own records only (need_to_know filters the rest).
                uid: if uid == 0 { of_uid } else { Some(uid) },
                tier,
                job,
                after,
                account,
            }),
            AdminOp::BudgetSet { budget_w, domain } => self.set_budget(budget_w, domain),
            AdminOp::EventAdd {
                cut,
                start_ms,
                duration_ms,
                ramp_ms,
                domain,
            } => self.add_event(cut, start_ms, duration_ms, ramp_ms, domain, now_ms),
            AdminOp::EventCancel { id } => self.cancel_event(id),
            AdminOp::ForgetNode { node } => self.forget_node(node, now_ms),
            AdminOp::WhatIf {
                policy,
                budget_w,
                ignore_tiers,
            } => self.what_if(
                policy.unwrap_or(self.settings().site.policy),
                budget_w,
                ignore_tiers,
                now_ms,
            ),
        }
    }

    /// The accounting records `query` selects, a page at most.
    fn accounting_page(&self, query: &accounting::RecordQuery) -> AdminReply {
        let records: Vec<JobEnergyRecord> = accounting::records_page(
            self.ledger.recent(),
            query,
            powerflex_proto::admin::MAX_RECORDS_PER_REPLY,
        );
        AdminReply::Done(AdminAnswer::Records(records))
    }

    /// Root sets the site's budget (`domain: None`) or a power domain's.
    fn set_budget(&mut self, budget_w: f64, domain: Option<String>) -> AdminReply {
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

    /// Root adds a grid event, numbered here (its id in the reply).
    fn add_event(
        &mut self,
        cut: Cut,
        start_ms: u64,
        duration_ms: u64,
        ramp_ms: u64,
        domain: Option<String>,
        now_ms: u64,
    ) -> AdminReply {
        // The admin CLI checks its arguments, but the VEN passes on what a VTN
        // serves: the controller is where an event is accepted or not.
        if let Err(why) =
            powerflex_proto::event::check_new_event(&cut, start_ms, duration_ms, ramp_ms)
        {
            return AdminReply::refused(Refusal::EventOutOfRange, why.to_string());
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
        AdminReply::Done(AdminAnswer::EventAdded(self.state.next_event_id))
    }

    /// Root cancels grid event `id`.
    fn cancel_event(&mut self, id: u64) -> AdminReply {
        let before = self.state.events.len();
        self.state.events.retain(|e| e.id != id);
        if self.state.events.len() == before {
            return AdminReply::refused(Refusal::NoSuchEvent, format!("no event {id}"));
        }
        info!(id, "grid event cancelled");
        self.dirty = true;
        AdminReply::ok()
    }

    /// Root forgets a node that is silent past its lease (decommissioned, renamed).
    fn forget_node(&mut self, node: String, now_ms: u64) -> AdminReply {
        let ttl_ms = (self.options.lease_ttl_s * 1000.0) as u64;
        let known = self.state.nodes.contains_key(&node) || self.sessions.contains_key(&node);
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

    /// What the allocation would be with `policy` and `budget_w` (the budget in force
    /// when `None`), without changing anything.
    fn what_if(
        &self,
        policy: Policy,
        budget_w: Option<f64>,
        ignore_tiers: bool,
        now_ms: u64,
    ) -> AdminReply {
        let budget = match budget_w {
            Some(w) if !(w.is_finite() && w > 0.0) => {
                return AdminReply::error(format!("budget must be a positive power (got {w} W)"))
            }
            Some(w) => Watts(w),
            None => effective_budget(
                self.state.budget_w.unwrap_or(self.options.base_budget),
                &crate::schedule::of_domain(&self.state.events, None),
                now_ms,
            ),
        };
        let max_gpu_w = self.options.max_gpu_power_w;
        let mut views: Vec<NodeView> = self
            .sessions
            .values()
            .map(|s| s.view.clone())
            .chain(self.unheard().iter().map(|u| u.view(max_gpu_w)))
            .collect();
        powerflex_decide::apply_least_flexible_tiers(&mut views, &self.options.site.tiers);
        let settings = powerflex_decide::SiteSettings {
            policy,
            tier_bounds: if ignore_tiers {
                powerflex_decide::TierBounds::Ignored
            } else {
                powerflex_decide::TierBounds::Honoured
            },
            // The domains' limits in force now.
            ..self.site_settings_at(now_ms, 0)
        };
        // Jobs held out of a deep cut stay out: another policy would not resume
        // them by itself.
        let held: powerflex_decide::Held = self
            .state
            .preempted
            .keys()
            .map(|job| (job.clone(), None))
            .collect();
        AdminReply::Done(AdminAnswer::WhatIf(Box::new(status::decision_view(
            &decide_holding(&views, budget, &settings, &held),
        ))))
    }
}
