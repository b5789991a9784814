//! `powerflex-ctld`: the site controller.
//!
//! The decisions are in [`core`], a pure state machine on a clock passed in; this module
//! is the I/O edge around it ([`run`]): it accepts agents on the [`agent_link`] and admins on
//! the [`admin`] socket, ticks every allocation period, loads and saves the [`state_file`],
//! and carries out what the core answers — leases to agents, replies to admins,
//! [`scontrol`] annotates jobs in Slurm, [`metrics_text`] for Prometheus, samples on the [`powerflex_controller_machine::controller::history`]
//! board (whence the admin threads answer `history` requests, outside the loop).
//!
//! - **Loop**: every `allocation_period_s`, the budget in force ([`powerflex_controller_machine::schedule`]) is
//!   split across every live node's jobs ([`powerflex_decide`]) and each node gets its lease.
//! - **Bounds** ([`bounds`], [`agent_link::LinkLimits`]): the link carries unauthenticated
//!   peers through the handshake in one thread with a cap and a deadline, the admin socket
//!   admits a few connections per user with one deadline per request, the metrics server
//!   has a fixed pool; every refusal is counted in `powerflex_refusals_total{reason}`.
//! - **State** (budget override, events, next event id, known nodes) is saved atomically
//!   on change; after a restart the controller resumes its events, and agents keep the
//!   caps of their unexpired leases meanwhile — nobody goes over budget in between.

pub mod admin;
pub mod agent_link;
pub mod bounds;
mod event_loop;
pub mod ha;
mod journal;
mod leadership;
pub mod metrics_text;
pub mod records_db;
pub mod scontrol;
mod services;
pub mod state_file;

use powerflex_controller_machine::controller::{CtldSettings, SettingsReload};

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use crossbeam_channel::{bounded, Receiver, Sender};
use tracing::warn;

use powerflex_controller_machine::controller::history::HistoryBoard;
use powerflex_controller_machine::controller::leader::LeaderInput;
use powerflex_proto::admin::{AdminOp, AdminReply};
use powerflex_proto::link::Body;
use powerflex_proto::report::{GpuInfo, JobReport};

use powerflex_controller_machine::controller::state::CtldState;
use powerflex_controller_machine::controller::step::{Controller, Input, Output};
use powerflex_controller_machine::error::MachineError;

/// Where the controller listens and keeps its state (the edge's), and what its machine is
/// configured with ([`CtldSettings`]).
#[derive(Debug, Clone)]
pub struct CtldOptions {
    pub listen: std::net::SocketAddr,
    pub admin_socket: PathBuf,
    pub state_dir: PathBuf,
    pub key: Vec<u8>,
    /// Loopback address for Prometheus metrics, if any.
    pub metrics_listen: Option<std::net::SocketAddr>,
    /// How often Slurm's placement is read, and the longest wait for it.
    pub slurm_poll: Duration,
    pub slurm_timeout: Duration,
    /// The accounting database, where the site has one (see [`records_db`]).
    pub records_db: Option<records_db::RecordsDbOptions>,
    /// `[controller.ha]`: leadership and state in PostgreSQL (see [`ha`]); `None`: one
    /// controller, its state in `state_dir` alone.
    pub ha: Option<ha::HaOptions>,
    /// The machine's settings: budget, period, lease TTL, allocation, ramps, placement.
    pub settings: CtldSettings,
}

/// A re-read site config (on SIGHUP): the new options, or why the file was refused.
pub type Reload = Result<CtldOptions, String>;

/// What a re-read config changes: the machine's settings (the machine keeps its period
/// and placement setting), never the edge's sockets, paths, key or database, which
/// change only on restart; this says so when the file changed them.
fn settings_reload(in_force: &CtldOptions, reload: Reload) -> SettingsReload {
    let new = reload.map_err(MachineError::Config)?;
    let needs_restart = new.listen != in_force.listen
        || new.admin_socket != in_force.admin_socket
        || new.state_dir != in_force.state_dir
        || new.key != in_force.key
        || new.metrics_listen != in_force.metrics_listen
        || new.slurm_poll != in_force.slurm_poll
        || new.slurm_timeout != in_force.slurm_timeout
        || new.records_db != in_force.records_db
        || new.ha != in_force.ha;
    if needs_restart {
        warn!("site config reloaded; listen addresses, sockets, state directory, key, Slurm polling, accounting database and [controller.ha] settings change only on restart");
    }
    Ok(new.settings)
}

pub(crate) use powerflex_daemon::clock::unix_ms;
use powerflex_daemon::clock::{Clock, WallClock};

/// What the link and admin threads hand the loop.
pub(crate) enum Inbound {
    Hello {
        node: String,
        gpus: Vec<GpuInfo>,
        /// Messages to this agent's session (sealed there).
        writer: Sender<Body>,
    },
    Report {
        node: String,
        jobs: Vec<JobReport>,
        power_w: f64,
        ended: Vec<powerflex_proto::usage::NodeUsage>,
        observe_only: bool,
    },
    Admin {
        op: AdminOp,
        uid: u32,
        reply: Sender<AdminReply>,
    },
    /// A read of Slurm's placement (see [`services`]).
    Placement(Result<powerflex_controller_machine::placement::Placement, String>),
    /// The leadership database answered (see [`ha`]).
    Leader(LeaderInput),
    /// A save of the machine's state `version` to the leadership database under `epoch`
    /// was committed (`Ok`: durable), or failed (see [`ha`]).
    Saved {
        epoch: u64,
        version: u64,
        outcome: Result<(), String>,
    },
    /// An agent refused a lease for its epoch (`Body::Fenced`).
    Fenced {
        node: String,
        lease_epoch: u64,
        accepted_epoch: u64,
    },
}

/// How many connections the controller serves at once, and for how long.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Bounds {
    pub link: agent_link::LinkLimits,
    pub admin: bounds::AdminLimits,
}

/// [`run_bounded`] with the default [`Bounds`].
pub fn run(
    options: CtldOptions,
    shutdown: Arc<AtomicBool>,
    reloads: Receiver<Reload>,
) -> Result<(), String> {
    run_bounded(options, Bounds::default(), shutdown, reloads)
}

/// Runs the controller until `shutdown`. `reloads` brings re-read site configs: a valid
/// one replaces the budget, policy, tiers and lease settings at once (the listen
/// addresses, sockets, state directory, key and period need a restart); a refused one
/// leaves the config in force and is reported by `status` until a valid one arrives.
pub fn run_bounded(
    options: CtldOptions,
    limits: Bounds,
    shutdown: Arc<AtomicBool>,
    reloads: Receiver<Reload>,
) -> Result<(), String> {
    run_on_clock(options, limits, &WallClock, shutdown, reloads)
}

/// [`run_bounded`] with the machine's time read from `clock` (the wall clock in
/// production: grid events are set in wall time). The link's frame stamps stay on the
/// wall clock, which is what the agents compare them with.
pub fn run_on_clock(
    options: CtldOptions,
    limits: Bounds,
    clock: &dyn Clock,
    shutdown: Arc<AtomicBool>,
    reloads: Receiver<Reload>,
) -> Result<(), String> {
    let loaded = state_file::load(&options.state_dir, clock.now());
    let latest = loaded.state.clone();
    let mut core = Controller::new(options.settings.clone(), loaded, clock.now());
    let journal = journal::Journal::open(&options, &mut core)?;
    let (tx, rx) = bounded::<Inbound>(4096);
    let steering = Arc::new(AtomicBool::new(options.ha.is_none()));
    let leadership = leadership::Leadership::start(options.ha.as_ref(), tx.clone())?;
    // Slurm commands' deadlines are on the leadership's clock (see `scontrol::SlurmGate`).
    let slurm_gate = scontrol::SlurmGate::closed(
        leadership
            .as_ref()
            .map_or_else(powerflex_daemon::clock::BootClock::start, |l| l.clock),
    );
    let history = HistoryBoard::new();
    let services = services::Services::start(
        &options,
        limits,
        tx,
        history.clone(),
        shutdown.clone(),
        steering.clone(),
        slurm_gate.clone(),
    )?;
    let mut event_loop = event_loop::EventLoop {
        options: &options,
        clock,
        core,
        latest,
        latest_version: 0,
        leadership,
        journal,
        services,
        history,
        steering,
        writers: BTreeMap::new(),
        inputs: Vec::new(),
        waiting: Vec::new(),
        tickets: BTreeMap::new(),
        slurm_gate,
    };
    event_loop.run(&rx, &reloads, &shutdown);
    shutdown.store(true, Ordering::SeqCst);
    let event_loop::EventLoop {
        services,
        journal,
        leadership,
        ..
    } = event_loop;
    services.stop();
    journal.stop();
    if let Some(l) = leadership {
        l.stop();
    }
    Ok(())
}

/// The controller's accounting log inside its state directory: one
/// [`powerflex_proto::usage::JobEnergyRecord`] per line, rotated at 64 MiB, 8 kept,
/// root's only (it names users' jobs).
pub const ACCOUNTING_LOG_FILE: &str = "job-energy.jsonl";

fn accounting_log(state_dir: &std::path::Path) -> powerflex_daemon::fsx::JsonLines {
    powerflex_daemon::fsx::JsonLines::new(state_dir.join(ACCOUNTING_LOG_FILE))
}

#[cfg(test)]
mod tests;
