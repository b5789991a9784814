//! Effects after durability: nothing this controller decides takes effect, and no admin
//! change is acknowledged, before the state that records it is durable (the state file
//! written and synced, or under `[controller.ha]` committed to the leadership database).
//!
//! Each state handed to the edge to save ([`super::Output::persist`]) carries a version
//! ([`super::Output::persist_version`]); the edge answers [`super::Input::Durable`] once
//! that version is durable, or [`super::Input::NotDurable`] when it could not be made so.
//! Until then the leases, the Slurm commands and the `AdminComment`s of any step whose
//! state differs in effect from the last durable one (budget, domain budgets, pending
//! events, held jobs) are held here, and each admin change's reply waits for the version
//! that records it. A failover in that window finds the committed state and the world
//! agree: the old leader's cut, suspension or requeue never reached an agent or Slurm.
//!
//! A failed save puts the last durable state back in force: the held effects are
//! dropped, the replies they wait on answered with a refusal that names the cause, and
//! every admin change refused with that reason until a save is durable again. The next
//! allocation decides again from the durable state (its own decisions held the same way).

use std::collections::{BTreeMap, VecDeque};

use powerflex_core::Watts;
use powerflex_proto::event::Event;

use tracing::{error, info};

use powerflex_proto::admin::{AdminReply, Refusal};

use crate::controller::state::CtldState;
use crate::preempt::{Action, Preempted};

use super::{Controller, Lease, Output};

/// The most saved states awaiting the edge's word at once: the edge writes only the
/// newest of those queued, so older ones are answered by a newer version's durability.
const MAX_IN_FLIGHT: usize = 64;

/// What of a state decides leases and Slurm commands: its budgets, events and held jobs
/// (the nodes known, megabytes at a large site, are not kept twice).
#[derive(Debug, Clone, Default, PartialEq)]
struct Effects {
    budget_w: Option<Watts>,
    domain_budgets_w: BTreeMap<String, Watts>,
    events: Vec<Event>,
    next_event_id: u64,
    preempted: BTreeMap<String, Preempted>,
}

impl Effects {
    fn of(state: &CtldState) -> Effects {
        Effects {
            budget_w: state.budget_w,
            domain_budgets_w: state.domain_budgets_w.clone(),
            events: state.events.clone(),
            next_event_id: state.next_event_id,
            preempted: state.preempted.clone(),
        }
    }
}

/// What the durability of the state holds back, and why.
#[derive(Debug, Default)]
pub(super) struct Durability {
    /// What the newest state known durable decides from: as loaded (a state file or a
    /// committed row), then as the edge last confirmed.
    durable: Effects,
    durable_version: u64,
    /// The newest version handed to the edge to save.
    version: u64,
    /// Versions handed out and not yet answered, with what their states decide from.
    in_flight: VecDeque<(u64, Effects)>,
    /// Why the newest save failed, until a later one is durable: admin changes are
    /// refused with it meanwhile.
    save_error: Option<String>,
    held: Held,
    next_ticket: u64,
}

/// Effects decided on a state not durable yet.
#[derive(Debug, Default)]
struct Held {
    leases: BTreeMap<String, Lease>,
    preempt: Vec<Action>,
    annotations: Vec<(String, String)>,
    /// (ticket, the version the reply waits for, the reply).
    replies: Vec<(u64, u64, AdminReply)>,
}

impl Durability {
    /// Starting from `loaded`, which is durable (read from where it was saved).
    pub(super) fn new(loaded: &CtldState) -> Durability {
        Durability {
            durable: Effects::of(loaded),
            ..Durability::default()
        }
    }

    /// Why admin changes are refused now, if they are.
    pub(super) fn save_error(&self) -> Option<&str> {
        self.save_error.as_deref()
    }

    /// Whether the newest state handed out is durable.
    fn all_durable(&self) -> bool {
        self.durable_version >= self.version
    }
}

/// Whether `a` and `b` lead to the same leases and Slurm commands at `now_ms`: the same
/// budgets, the same events still pending and the same held jobs. The nodes known and
/// events that ended differ without changing what a leader decides from them.
fn same_effects(a: &CtldState, b: &Effects, now_ms: u64) -> bool {
    a.budget_w == b.budget_w
        && a.domain_budgets_w == b.domain_budgets_w
        && a.preempted == b.preempted
        && a.events
            .iter()
            .filter(|e| e.pending(now_ms))
            .eq(b.events.iter().filter(|e| e.pending(now_ms)))
}

/// The refusal of an admin change that is not durable, naming the cause.
fn not_durable(error: &str) -> AdminReply {
    AdminReply::refused(
        Refusal::NotDurable,
        format!(
            "the controller cannot save its state ({error}): the change is not made; the last saved state stays in force until a save succeeds"
        ),
    )
}

impl Controller {
    /// The refusal of a new admin change while the state cannot be saved, if it cannot.
    pub(super) fn refuse_while_not_durable(&self) -> Option<AdminReply> {
        self.durability.save_error().map(not_durable)
    }

    /// The edge made `version` durable: it and every older version are the durable
    /// state now.
    pub(super) fn durable(&mut self, version: u64) {
        let d = &mut self.durability;
        if version <= d.durable_version {
            return;
        }
        let mut newest = None;
        while d.in_flight.front().is_some_and(|(v, _)| *v <= version) {
            newest = d.in_flight.pop_front();
        }
        // A version no longer in flight (dropped past the bound) is durable all the same;
        // its state is at least the oldest one still held, which is not known here:
        // only the version moves, and the state follows with the next confirmation.
        if let Some((_, state)) = newest.filter(|(v, _)| *v == version) {
            d.durable = state;
        }
        d.durable_version = version;
        if d.save_error.take().is_some() {
            info!(
                version,
                "controller state saved again: admin changes are accepted"
            );
        }
    }

    /// The edge could not make `version` durable (`error` says why). When it is the
    /// newest, the last durable state is put back in force: what was decided from the
    /// newer one is dropped, never carried out.
    pub(super) fn not_durable(
        &mut self,
        version: u64,
        error: String,
        now_ms: u64,
        out: &mut Output,
    ) {
        let d = &mut self.durability;
        d.in_flight.retain(|(v, _)| *v > version);
        if version < d.version || version <= d.durable_version {
            // A newer save is on its way and answers for this one.
            return;
        }
        if d.save_error.as_deref() != Some(error.as_str()) {
            error!(version, error = %error, "cannot make the controller state durable: its changes are not carried out, and admin changes are refused until a save succeeds");
        }
        for (ticket, _, _) in std::mem::take(&mut d.held.replies) {
            out.late_replies.push((ticket, not_durable(&error)));
        }
        d.save_error = Some(error);
        self.drop_held();
        if !same_effects(&self.state, &self.durability.durable, now_ms) {
            let durable = &self.durability.durable;
            self.state.budget_w = durable.budget_w;
            self.state.domain_budgets_w = durable.domain_budgets_w.clone();
            self.state.events = durable.events.clone();
            // Never lower: an id handed out once is not handed out again.
            self.state.next_event_id = self.state.next_event_id.max(durable.next_event_id);
            self.state.preempted = durable.preempted.clone();
            // Saved again, so that what a retry writes is what is in force (never the
            // change that was refused).
            self.dirty = true;
        }
    }

    /// Drops every held lease, Slurm command and annotation (the annotations are made
    /// again by the next allocation that calls for them). The rollout forgets the
    /// decreases it was waiting on: the nodes never got them, so they cannot confirm them.
    pub(super) fn drop_held(&mut self) {
        self.rollout = crate::rollout::Rollout::new();
        let held = &mut self.durability.held;
        held.leases.clear();
        held.preempt.clear();
        for (job, _) in held.annotations.drain(..) {
            self.annotations.remove(&job);
        }
    }

    /// A controller that stopped steering carries nothing out: its held effects are
    /// dropped and the admins still waiting told it stopped (their change may or may not
    /// be in the committed state the next leader steers from).
    pub(super) fn drop_held_on_stepping_down(&mut self, out: &mut Output) {
        let why = self.not_active();
        for (ticket, _, _) in std::mem::take(&mut self.durability.held.replies) {
            out.late_replies.push((ticket, why.clone()));
        }
        self.drop_held();
    }

    /// At the end of a step: the state to save gets its version, the replies to this
    /// step's admin changes wait for it, and the step's effects go out only when the
    /// state they were decided on is durable in effect; held ones go out once it is.
    pub(super) fn hold_until_durable(
        &mut self,
        now_ms: u64,
        changes: Vec<(usize, AdminReply)>,
        out: &mut Output,
    ) {
        let d = &mut self.durability;
        if let Some(state) = &out.persist {
            d.version += 1;
            out.persist_version = d.version;
            if d.in_flight.len() == MAX_IN_FLIGHT {
                d.in_flight.pop_front();
            }
            d.in_flight.push_back((d.version, Effects::of(state)));
        }
        for (index, reply) in changes {
            if d.all_durable() {
                out.replies.push((index, reply));
            } else {
                let ticket = d.next_ticket;
                d.next_ticket += 1;
                out.wait_replies.push((index, ticket));
                d.held.replies.push((ticket, d.version, reply));
            }
        }
        let durable_version = d.durable_version;
        let (ready, waiting): (Vec<_>, Vec<_>) = std::mem::take(&mut d.held.replies)
            .into_iter()
            .partition(|(_, v, _)| *v <= durable_version);
        d.held.replies = waiting;
        out.late_replies
            .extend(ready.into_iter().map(|(ticket, _, reply)| (ticket, reply)));
        let held = &mut d.held;
        if same_effects(&self.state, &d.durable, now_ms) {
            // Released under this step's own decisions: a newer lease replaces a held one,
            // and held commands run before this step's.
            for (node, lease) in std::mem::take(&mut held.leases) {
                out.leases.entry(node).or_insert(lease);
            }
            let mut preempt = std::mem::take(&mut held.preempt);
            preempt.append(&mut out.preempt);
            out.preempt = preempt;
            let mut annotations = std::mem::take(&mut held.annotations);
            annotations.append(&mut out.annotations);
            out.annotations = annotations;
        } else {
            held.leases.append(&mut out.leases);
            held.preempt.append(&mut out.preempt);
            held.annotations.append(&mut out.annotations);
        }
    }
}
