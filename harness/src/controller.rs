//! The controller's machine (`powerflex_controller_machine::controller`), driven as
//! `powerflex-ctld`'s loop drives it: the only module of this crate that names the
//! controller's core.
//!
//! What the edge does that is modelled here: the options read from the site config
//! (`powerflex-ctld`'s `load_options`), the state saved when the core says so (the "disk"
//! the next start loads), leases and acknowledgements handed to the link, suspensions and
//! requeues handed to the site's Slurm, Slurm's placement read every `slurm_poll_s` and
//! when the core asks, the annotations written into the jobs' `AdminComment`. What is
//! not: the admin socket (admin requests come in as values), metrics and the accounting
//! log.

use std::collections::BTreeMap;

use powerflex_controller_machine::controller::state::{CtldState, Loaded};
use powerflex_controller_machine::controller::step::{self, Input, Output};
use powerflex_controller_machine::controller::CtldSettings;
use powerflex_controller_machine::placement::Placement;
use powerflex_core::config::SiteConfig;
use powerflex_core::UnixMs;
use powerflex_proto::admin::{AdminOp, AdminReply};
use powerflex_proto::status::CtldStatus;
use powerflex_proto::usage::FinalRef;

use crate::memory_link::LeaseBody;
use crate::HarnessError;
use powerflex_proto::report::NodeReport;

use powerflex_controller_machine::preempt::Action as Preempt;
use powerflex_controller_machine::schedule::effective_budget;
use powerflex_proto::event::Event;

/// The controller's state as saved: what a restart with its state loads.
pub type SavedState = CtldState;

/// What arrives at the controller in one step.
#[derive(Debug, Clone)]
pub enum Inbound {
    Hello {
        node: String,
        gpus: Vec<powerflex_proto::report::GpuInfo>,
    },
    Report {
        node: String,
        report: NodeReport,
    },
    /// An admin request, as root.
    Admin(AdminOp),
    /// Slurm's placement as the reader got it (`squeue --json`, `sinfo --json`).
    Placement(Box<Placement>),
    /// The allocation period elapsed.
    Tick,
}

/// What one step asks of the site.
#[derive(Debug, Clone, Default)]
pub struct Outbound {
    /// Per node.
    pub leases: BTreeMap<String, LeaseBody>,
    pub acks: BTreeMap<String, Vec<FinalRef>>,
    pub preempt: Vec<Preempt>,
    /// One reply per [`Inbound::Admin`], in order.
    pub replies: Vec<AdminReply>,
    /// The state to save, when it changed.
    pub persist: Option<SavedState>,
    /// The budget the allocation was made for (`None`: no allocation this step), W.
    pub allocated_w: Option<f64>,
    /// Job → the `AdminComment` to write (`scontrol update`).
    pub annotations: Vec<(String, String)>,
    /// Read Slurm's placement now, not at the next poll.
    pub refresh_placement: bool,
}

/// The controller's machine settings from the site config, as `powerflex-ctld` reads
/// them (its edge's addresses, paths, key, Slurm polling and database are not the
/// machine's).
pub fn options(site: &SiteConfig) -> Result<CtldSettings, HarnessError> {
    CtldSettings::from_site(site).map_err(|e| HarnessError::Site(e.to_string()))
}

/// How a controller starts.
#[derive(Debug, Clone)]
pub enum Start {
    /// The first start: no state file.
    Fresh,
    /// A restart that loads the state it saved last.
    Saved(SavedState),
    /// A restart whose state file is gone and has no usable copy: the nodes and events it
    /// held are unknown.
    Lost,
}

/// The controller's machine.
#[derive(Debug)]
pub struct Controller {
    core: step::Controller,
    base_budget_w: f64,
}

impl Controller {
    pub fn start(site: &SiteConfig, start: Start, now_ms: u64) -> Result<Controller, HarnessError> {
        let options = options(site)?;
        let base_budget_w = options.base_budget.0;
        let loaded = match start {
            Start::Fresh => Loaded::default(),
            Start::Saved(state) => Loaded { state, lost: false },
            Start::Lost => Loaded {
                state: CtldState::default(),
                lost: true,
            },
        };
        Ok(Controller {
            core: step::Controller::new(options, loaded, UnixMs(now_ms)),
            base_budget_w,
        })
    }

    /// One turn of the loop: the inputs that arrived together, at `now_ms`.
    pub fn step(&mut self, now_ms: u64, inbound: Vec<Inbound>) -> Outbound {
        let inputs: Vec<Input> = inbound
            .into_iter()
            .map(|i| match i {
                Inbound::Hello { node, gpus } => Input::Hello { node, gpus },
                Inbound::Report { node, report } => Input::Report {
                    node,
                    jobs: report.jobs,
                    power_w: report.power_w,
                    ended: report.ended,
                    observe_only: report.observe_only,
                },
                Inbound::Admin(op) => Input::Admin { op, uid: 0 },
                Inbound::Placement(read) => Input::Placement(Box::new(Ok(*read))),
                Inbound::Tick => Input::Tick,
            })
            .collect();
        let mut out: Output = self.core.step(UnixMs(now_ms), inputs);
        // The site's disk takes the state as the step asks (the site keeps `persist`):
        // durable at once, so what the machine held for it goes out in this same turn.
        if out.persist.is_some() {
            let later = self.core.step(
                UnixMs(now_ms),
                vec![Input::Durable {
                    version: out.persist_version,
                }],
            );
            for (index, ticket) in std::mem::take(&mut out.wait_replies) {
                if let Some((_, reply)) = later.late_replies.iter().find(|(t, _)| *t == ticket) {
                    out.replies.push((index, reply.clone()));
                }
            }
            out.replies.sort_by_key(|(index, _)| *index);
            out.leases.extend(later.leases);
            out.preempt.extend(later.preempt);
            out.annotations.extend(later.annotations);
        }
        let ttl_s = out.lease_ttl_s;
        Outbound {
            allocated_w: out.history.as_ref().map(|h| h.budget_w),
            leases: out
                .leases
                .into_iter()
                .map(|(node, lease)| {
                    (
                        node,
                        LeaseBody {
                            caps: lease.caps,
                            ttl_s,
                            start_cap_w: Some(lease.start_cap_w),
                            recalibrate: lease.recalibrate,
                            learn: lease.learn,
                            next_event_in_s: lease.next_event_in_s,
                            walk_to_w: lease.walk_to_w,
                            event_in_force: lease.event_in_force,
                        },
                    )
                })
                .collect(),
            acks: out.final_acks,
            preempt: out.preempt,
            replies: out.replies.into_iter().map(|(_, reply)| reply).collect(),
            persist: out.persist,
            annotations: out.annotations,
            refresh_placement: out.refresh_placement,
        }
    }

    pub fn status(&self, now_ms: u64) -> CtldStatus {
        self.core.status(UnixMs(now_ms))
    }

    /// The budget in force at `now_ms` by the controller's state (base or `budget set`,
    /// less the grid events' stepped cuts), W: what the meter is held to.
    pub fn budget_in_force_w(&self, now_ms: u64) -> f64 {
        let state = self.core.state();
        let base = state.budget_w.map_or(self.base_budget_w, |w| w.0);
        effective_budget(powerflex_core::Watts(base), &state.events, now_ms).0
    }

    /// The grid events the controller holds.
    pub fn events(&self) -> &[Event] {
        &self.core.state().events
    }

    /// Allocations made since the start.
    pub fn allocations(&self) -> u64 {
        self.core.allocations()
    }

    /// Whether the controller reads where jobs run from Slurm (`job_placement = "slurm"`,
    /// the default) rather than believing the nodes' reports.
    pub fn reads_slurm(&self) -> bool {
        self.core.settings().job_placement == powerflex_core::config::JobPlacement::Slurm
    }

    /// The allocation period, ms.
    pub fn period_ms(&self) -> u64 {
        self.core.settings().period.as_millis() as u64
    }
}
