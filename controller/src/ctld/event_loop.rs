//! The controller's loop: each turn it gives the core what arrived since the last step
//! (with the time), carries out the core's answer, and waits for the next input, tick or
//! reload. Every decision is the core's; this only moves messages between it and the
//! threads of [`super::services`].

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use crossbeam_channel::{select, tick, Receiver, Sender};

use powerflex_controller_machine::controller::history::HistoryBoard;
use powerflex_controller_machine::controller::leader::LeaderInput;
use powerflex_controller_machine::error::MachineError;
use powerflex_daemon::clock::Clock;
use powerflex_proto::admin::AdminReply;
use powerflex_proto::link::Body;

use super::journal::Journal;
use super::leadership::Leadership;
use super::scontrol::SlurmGate;
use super::services::Services;
use super::{
    settings_reload, state_file, Controller, CtldOptions, CtldState, Inbound, Input, Output, Reload,
};

/// The most queued messages one step takes: the core allocates once for the batch.
const MAX_BATCH: usize = 8192;

/// What the loop holds between steps.
pub(super) struct EventLoop<'a> {
    pub(super) options: &'a CtldOptions,
    pub(super) clock: &'a dyn Clock,
    pub(super) core: Controller,
    /// The newest state this process steers from (as loaded, then as last persisted).
    /// Under `[controller.ha]` it is where a first leader starts from when the database
    /// holds no state yet, and what the process that held leadership last steers from
    /// when the database's copy is unreadable; the database's state wins otherwise. It
    /// is also what is sent again while the database's copy is stale.
    pub(super) latest: CtldState,
    /// The machine's version of `latest` (0: as loaded or taken over).
    pub(super) latest_version: u64,
    pub(super) leadership: Option<Leadership>,
    pub(super) journal: Journal,
    pub(super) services: Services,
    /// Read by the admin threads, written by this loop only.
    pub(super) history: HistoryBoard,
    /// Whether the core steers: the link sends agents on while it does not.
    pub(super) steering: Arc<AtomicBool>,
    /// Each connected agent's session, which seals what is sent to it.
    pub(super) writers: BTreeMap<String, Sender<Body>>,
    /// The next step's inputs, and beside each the admin waiting for its reply.
    pub(super) inputs: Vec<Input>,
    pub(super) waiting: Vec<Option<Sender<AdminReply>>>,
    /// Admins whose change is answered once its state is durable, by the core's ticket.
    pub(super) tickets: BTreeMap<u64, Sender<AdminReply>>,
    /// Which leadership's Slurm commands may run now (moved after every step).
    pub(super) slurm_gate: SlurmGate,
}

impl EventLoop<'_> {
    /// Steps until `shutdown` or until every sender of `inbound` is gone. The first step
    /// allocates at once (or starts the hold after a restart).
    pub(super) fn run(
        &mut self,
        inbound: &Receiver<Inbound>,
        reloads: &Receiver<Reload>,
        shutdown: &AtomicBool,
    ) {
        let ticker = tick(self.options.settings.period);
        let check = tick(Duration::from_millis(100));
        while !shutdown.load(Ordering::SeqCst) {
            self.lead();
            let out = self
                .core
                .step(self.clock.now(), std::mem::take(&mut self.inputs));
            self.steering.store(self.core.steering(), Ordering::SeqCst);
            self.move_gate();
            self.carry_out(out);
            // What the step's answer brought back (a save's outcome) is taken at once.
            if !self.inputs.is_empty() {
                continue;
            }
            select! {
                recv(inbound) -> msg => {
                    let Ok(first) = msg else { break };
                    self.receive(first);
                    for _ in 1..MAX_BATCH {
                        match inbound.try_recv() {
                            Ok(more) => self.receive(more),
                            Err(_) => break,
                        }
                    }
                }
                recv(reloads) -> reload => {
                    if let Ok(reload) = reload {
                        let settings = settings_reload(self.options, reload);
                        self.push(Input::Reload(Box::new(settings)), None);
                    }
                }
                recv(ticker) -> _ => self.push(Input::Tick, None),
                recv(check) -> _ => {}
            }
        }
    }

    /// Opens the Slurm commands' gate to the leadership that steers now, until its
    /// step-down deadline, or closes it.
    fn move_gate(&self) {
        let epoch = self.core.state().epoch;
        match &self.leadership {
            _ if !self.core.steering() => self.slurm_gate.close(),
            None => self.slurm_gate.open(epoch, None),
            Some(l) => match l.leader.steering_until() {
                Some(until) if l.leader.active() && l.leader.epoch() == epoch => {
                    self.slurm_gate.open(epoch, Some(until));
                }
                _ => self.slurm_gate.close(),
            },
        }
    }

    /// Queues an input for the next step, with the admin waiting for its reply if any.
    fn push(&mut self, input: Input, reply: Option<Sender<AdminReply>>) {
        self.inputs.push(input);
        self.waiting.push(reply);
    }

    /// Leadership's turn before each step: its tick (which may make this controller the
    /// active one), the claim and the save due, and its view when it changed.
    fn lead(&mut self) {
        self.leader_input(LeaderInput::Tick);
        let Some(l) = &mut self.leadership else {
            return;
        };
        let now = l.clock.now();
        if let Some(claim) = l.leader.claim_due(now) {
            // A save that failed is sent again with each claim until one is written
            // (the database thread runs the claim first).
            if l.leader.active() && l.copy.resend_with_claim() {
                l.db.save(now, l.leader.epoch(), self.latest_version, &self.latest);
            }
            l.db.claim(now, claim);
        }
        if let Some(view) = l.view_changed() {
            // First in the batch: the core decides whether it steers before any other
            // input of this step.
            self.inputs.insert(0, Input::Leadership(view));
            self.waiting.insert(0, None);
        }
    }

    /// One input to the leadership machine; a takeover replaces the core, and the agents'
    /// sessions reconnect to the new one.
    fn leader_input(&mut self, input: LeaderInput) {
        let Some(l) = &mut self.leadership else {
            return;
        };
        let now = self.clock.now();
        if let Some(new) = l.step(
            input,
            &self.core,
            &mut self.latest,
            self.journal.newest(),
            now,
        ) {
            self.core = new;
            self.latest_version = 0;
            self.writers.clear();
            // The old core's held changes were never confirmed durable (a core that
            // stops steering answers its own; this covers any left).
            for (_, to) in std::mem::take(&mut self.tickets) {
                let _ = to.send(AdminReply::refused(
                    powerflex_proto::admin::Refusal::NotDurable,
                    "leadership changed before the change was saved: see `powerflexctl status` for the state in force",
                ));
            }
        }
    }

    /// Carries out one step's answer, in the order its parts depend on each other.
    fn carry_out(&mut self, mut out: Output) {
        // Durable first: without `[controller.ha]` once the state file is synced, with it
        // once the database commits (its thread answers `Inbound::Saved`). What the core
        // holds for it goes out at the step it is told.
        let mut durable = None;
        if let Some(state) = out.persist.take() {
            let version = out.persist_version;
            let file = state_file::save(&self.options.state_dir, &state);
            match &self.leadership {
                None => {
                    durable = Some(match file {
                        Ok(()) => Input::Durable { version },
                        Err(error) => Input::NotDurable { version, error },
                    });
                }
                Some(l) if l.leader.active() => {
                    l.db.save(l.clock.now(), l.leader.epoch(), version, &state);
                }
                // Not steering: nothing decided on it is carried out.
                Some(_) => {}
            }
            self.latest = state;
            self.latest_version = version;
        }
        self.history.publish(out.history.take(), out.owners.take());
        for (index, reply) in std::mem::take(&mut out.replies) {
            if let Some(Some(to)) = self.waiting.get(index) {
                let _ = to.send(reply);
            }
        }
        for (index, ticket) in std::mem::take(&mut out.wait_replies) {
            if let Some(to) = self.waiting.get_mut(index).and_then(Option::take) {
                self.tickets.insert(ticket, to);
            }
        }
        for (ticket, reply) in std::mem::take(&mut out.late_replies) {
            if let Some(to) = self.tickets.remove(&ticket) {
                let _ = to.send(reply);
            }
        }
        self.waiting.clear();
        if let Some(input) = durable {
            self.push(input, None);
        }
        self.send_leases(&mut out);
        self.send_agents_on(&mut out);
        // Before the annotations that show them in Slurm: the log is the record (and the
        // database's journal: it gets each record after the log has it).
        let records_written = self.journal.write(std::mem::take(&mut out.job_records));
        if let Some(view) = self.journal.db_view_changed() {
            self.push(Input::AccountingDb(view), None);
        }
        // Only once the records are in the log: an agent drops a final share when it is
        // acknowledged. A failed append acknowledges nothing this step, so the agents
        // keep theirs a while longer (the record itself stays answered from memory).
        if records_written {
            self.acknowledge_finals(&mut out);
        }
        // Each tied to the leadership that decided it: dropped unrun once it ends.
        for annotation in out.annotations {
            self.services.annotate(out.epoch, annotation);
        }
        // After the leases: a job suspended is already held at its lowest cap.
        for action in out.preempt {
            self.services.preempt(out.epoch, action);
        }
        if let Some(snapshot) = out.metrics {
            self.services.show_metrics(&snapshot);
        }
        if out.refresh_placement {
            self.services.refresh_placement();
        }
    }

    fn send_leases(&mut self, out: &mut Output) {
        for (node, lease) in std::mem::take(&mut out.leases) {
            let Some(writer) = self.writers.get(&node) else {
                continue;
            };
            // Sealed by the node's session, under its session key.
            let _ = writer.try_send(Body::Lease {
                node,
                caps: lease.caps,
                ttl_s: out.lease_ttl_s,
                start_cap_w: Some(lease.start_cap_w),
                recalibrate: lease.recalibrate,
                learn: lease.learn,
                next_event_in_s: lease.next_event_in_s,
                walk_to_w: lease.walk_to_w,
                event_in_force: lease.event_in_force,
                epoch: out.epoch,
            });
        }
    }

    /// Agents that follow a controller of a later epoch, or every agent when this one
    /// stopped steering, are told to look for the controller that steers now; until they
    /// find it their last lease holds their caps, then the fail-safe does.
    fn send_agents_on(&mut self, out: &mut Output) {
        for node in out.send_on.drain(..) {
            if let Some(writer) = self.writers.remove(&node) {
                let _ = writer.try_send(Body::Standby {
                    reason: "this node follows a controller of a later epoch".into(),
                });
            }
        }
        if out.stopped_steering {
            for writer in std::mem::take(&mut self.writers).into_values() {
                let _ = writer.try_send(Body::Standby {
                    reason: "this controller stopped steering".into(),
                });
            }
        }
    }

    fn acknowledge_finals(&mut self, out: &mut Output) {
        for (node, finals) in std::mem::take(&mut out.final_acks) {
            let Some(writer) = self.writers.get(&node) else {
                continue;
            };
            for chunk in finals.chunks(powerflex_proto::report::MAX_ACKS_PER_MESSAGE) {
                let _ = writer.try_send(Body::Acked {
                    finals: chunk.to_vec(),
                });
            }
        }
    }

    /// One message from the link, admin, Slurm or leadership threads.
    fn receive(&mut self, msg: Inbound) {
        match msg {
            Inbound::Hello { node, gpus, writer } => {
                self.writers.insert(node.clone(), writer);
                self.push(Input::Hello { node, gpus }, None);
            }
            Inbound::Report {
                node,
                jobs,
                power_w,
                ended,
                observe_only,
            } => self.push(
                Input::Report {
                    node,
                    jobs,
                    power_w,
                    ended,
                    observe_only,
                },
                None,
            ),
            Inbound::Admin { op, uid, reply } => self.push(Input::Admin { op, uid }, Some(reply)),
            Inbound::Placement(read) => self.push(
                Input::Placement(Box::new(read.map_err(MachineError::SlurmRead))),
                None,
            ),
            Inbound::Leader(input) => self.leader_input(input),
            Inbound::Saved {
                epoch,
                version,
                outcome,
            } => {
                let core_epoch = self.core.state().epoch;
                let Some(l) = &mut self.leadership else {
                    return;
                };
                // Only a save of the leadership this core steers with answers for its
                // versions (a takeover's core counts its own from 0).
                let ours = l.leader.active() && epoch == l.leader.epoch() && epoch == core_epoch;
                let input = match &outcome {
                    Ok(()) => Input::Durable { version },
                    // The database thread's error names the database already.
                    Err(error) => Input::NotDurable {
                        version,
                        error: error.clone(),
                    },
                };
                l.saved(epoch, outcome);
                if ours {
                    self.push(input, None);
                }
            }
            Inbound::Fenced {
                node,
                lease_epoch,
                accepted_epoch,
            } => {
                if let Some(l) = &mut self.leadership {
                    l.leader.step(
                        l.clock.now(),
                        LeaderInput::Fenced {
                            lease_epoch,
                            accepted_epoch,
                        },
                    );
                }
                self.push(
                    Input::Fenced {
                        node,
                        lease_epoch,
                        accepted_epoch,
                    },
                    None,
                );
            }
        }
    }
}
