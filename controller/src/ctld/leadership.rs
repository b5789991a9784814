//! Leadership under `[controller.ha]`, as the loop sees it: the leadership machine
//! ([`Leader`]), the database thread that runs its claims and saves ([`super::ha`]), and
//! the view last shown to the core. A takeover builds the core for the new epoch here.

use std::time::Duration;

use crossbeam_channel::Sender;
use tracing::{error, info};

use powerflex_controller_machine::controller::leader::{
    Leader, LeaderChange, LeaderInput, LeaderSettings,
};
use powerflex_controller_machine::controller::lease_row::{DbCopy, DbCopyChange};
use powerflex_controller_machine::error::MachineError;
use powerflex_daemon::clock::{BootClock, Clock};

use powerflex_controller_machine::controller::state::Loaded;

use super::{ha, Controller, CtldState, Inbound};

/// Leadership under `[controller.ha]`: the machine, its database thread, and the view
/// last shown to the core.
pub(super) struct Leadership {
    pub(super) leader: Leader,
    /// The leader's clock: every claim and save it sends is stamped with it.
    pub(super) clock: BootClock,
    pub(super) db: ha::HaDb,
    shown: Option<powerflex_proto::status::LeadershipView>,
    stop_within: Duration,
    /// Whether the database's copy of the state is behind this controller's.
    pub(super) copy: DbCopy,
}

impl Leadership {
    /// Leadership for `ha`, with its database thread answering on `to_loop`; `None`
    /// for a single controller, which always steers.
    pub(super) fn start(
        ha: Option<&ha::HaOptions>,
        to_loop: Sender<Inbound>,
    ) -> Result<Option<Leadership>, String> {
        let Some(ha) = ha else {
            return Ok(None);
        };
        // Leadership's deadlines count on the time since boot: on the wall clock, a step
        // back would stop the renewals and the step-down deadline both, while the row
        // lapsed on the database's clock and the standby took over (two controllers
        // steering); a monotonic clock that stops in a suspend would keep a resumed
        // leader leasing.
        let clock = BootClock::start();
        Ok(Some(Leadership {
            clock,
            leader: Leader::new(
                LeaderSettings {
                    name: ha.name.clone(),
                    ttl_ms: u64::try_from(ha.leader_ttl.as_millis()).unwrap_or(u64::MAX),
                },
                clock.now(),
            ),
            db: ha::HaDb::spawn(ha.clone(), to_loop)
                .map_err(|e| format!("cannot start the leadership database thread: {e}"))?,
            shown: None,
            stop_within: ha.timeout * 2,
            copy: DbCopy::default(),
        }))
    }

    /// Stops the database thread, waiting at most twice the database timeout.
    pub(super) fn stop(self) {
        self.db.stop(self.stop_within);
    }

    /// The view, when it changed since the core last had it. While active with the
    /// database's copy of the state stale, its reason says so (status shows it).
    pub(super) fn view_changed(&mut self) -> Option<powerflex_proto::status::LeadershipView> {
        let mut view = self.leader.view();
        if let Some(why) = self.copy.stale().filter(|_| self.leader.active()) {
            let stale = format!(
                "STATE NOT SAVED TO THE DATABASE ({why}): a standby taking over now would miss the latest changes; sent again with each renewal"
            );
            view.reason = Some(match view.reason {
                Some(r) => format!("{r}; {stale}"),
                None => stale,
            });
        }
        if self.shown.as_ref() == Some(&view) {
            return None;
        }
        self.shown = Some(view.clone());
        Some(view)
    }

    /// One input to the leadership machine, on its clock; when it makes this controller
    /// the active one, the core for the new epoch (see [`Leadership::take_over`]).
    pub(super) fn step(
        &mut self,
        input: LeaderInput,
        old: &Controller,
        latest: &mut CtldState,
        records: &[powerflex_proto::usage::JobEnergyRecord],
        now: powerflex_core::UnixMs,
    ) -> Option<Controller> {
        match self.leader.step(self.clock.now(), input) {
            LeaderChange::BecameActive { epoch, state, .. } => {
                Some(self.take_over(old, epoch, state, latest, records, now))
            }
            _ => None,
        }
    }

    /// A save's outcome: the database's copy is stale after a failure until a save is
    /// written (each said once in the log).
    pub(super) fn saved(&mut self, epoch: u64, outcome: Result<(), String>) {
        if !self.leader.active() || epoch != self.leader.epoch() {
            return;
        }
        match self.copy.saved(outcome.map_err(MachineError::Database)) {
            DbCopyChange::None => {}
            DbCopyChange::BecameStale(e) => error!(
                epoch,
                error = %e,
                "cannot save the controller state to the database: its copy is stale (a standby taking over now would miss the latest changes); sending it again with each renewal"
            ),
            DbCopyChange::Fresh => {
                info!(
                    epoch,
                    "controller state saved to the database again: its copy is fresh"
                )
            }
        }
    }

    /// A new core for leadership `epoch`, from the state the database committed (this
    /// process's newest, `latest`, when it holds none yet, a site's first leader, or
    /// when this process held leadership last and the database's copy is unreadable),
    /// checked, with the settings in force and the newest accounting records. It waits
    /// for the agents as after a restart (half a lease at most), while their last
    /// leases hold their caps.
    fn take_over(
        &mut self,
        old: &Controller,
        epoch: u64,
        state: Option<Box<CtldState>>,
        latest: &mut CtldState,
        records: &[powerflex_proto::usage::JobEnergyRecord],
        now: powerflex_core::UnixMs,
    ) -> Controller {
        let state = state.map_or_else(|| latest.clone(), |s| *s);
        // The database thread checked what it read and the loader the file; checked
        // here too, as the one place a takeover's state enters the core.
        let (mut state, lost) = match state.checked(now) {
            Ok(state) => (state, false),
            Err(e) => {
                error!(epoch, error = %e, "the state to take over with is out of range: not steered from; the grid events and nodes it held are lost");
                (CtldState::default(), true)
            }
        };
        state.epoch = epoch;
        self.copy.reset();
        info!(
            epoch,
            events = state.events.len(),
            nodes = state.nodes.len(),
            budget_w = state.budget_w.map(|w| w.0),
            "steering from the committed state"
        );
        // Committed under the new epoch at once: a save of the old epoch is fenced.
        self.db.save(self.clock.now(), epoch, 0, &state);
        *latest = state.clone();
        let mut core = Controller::new(old.settings().clone(), Loaded { state, lost }, now);
        core.load_records(records.to_vec());
        // Shown again to the new core before its first step.
        self.shown = None;
        core
    }
}
