//! `powerflex-ctld`: the site controller.
//!
//! The decisions are in [`core`], a pure state machine on a clock passed in; this module
//! is the I/O edge around it ([`run`]): it accepts agents on the [`link`] and admins on
//! the [`admin`] socket, ticks every allocation period, loads and saves the [`state`],
//! and carries out what the core answers — leases to agents, replies to admins,
//! [`annotate`] jobs in Slurm, [`metrics`] for Prometheus, samples on the [`history`]
//! board (whence the admin threads answer `history` requests, outside the loop).
//!
//! - **Loop**: every `allocation_period_s`, the budget in force ([`crate::schedule`]) is
//!   split across every live node's jobs ([`crate::site`]) and each node gets its lease.
//! - **Bounds** ([`bounds`], [`link::LinkLimits`]): the link carries unauthenticated
//!   peers through the handshake in one thread with a cap and a deadline, the admin socket
//!   admits a few connections per user with one deadline per request, the metrics server
//!   has a fixed pool; every refusal is counted in `powerflex_refusals_total{reason}`.
//! - **State** (budget override, events, next event id, known nodes) is saved atomically
//!   on change; after a restart the controller resumes its events, and agents keep the
//!   caps of their unexpired leases meanwhile — nobody goes over budget in between.

pub mod admin;
pub mod annotate;
pub mod bounds;
pub mod ha;
pub mod link;
pub mod metrics;
pub mod records_db;
pub mod state;

// The machine's modules, where the edge (and the tools) have always found them.
pub use powerflex_controller_machine::ctld::{
    accounting, core, history, learning, owners, session, status, CtldSettings, SettingsReload,
};

use std::collections::BTreeMap;
use std::net::TcpListener;
use std::os::unix::fs::PermissionsExt;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use crossbeam_channel::{bounded, select, tick, Receiver, Sender};
use tracing::{error, info, warn};

use powerflex_daemon::http::{HttpOptions, MetricsServer};
use powerflex_proto::admin::{AdminOp, AdminReply};
use powerflex_proto::link::{Body, GpuInfo, JobReport};

use powerflex_controller_machine::ctld::leader::{
    Leader, LeaderChange, LeaderInput, LeaderSettings,
};
use powerflex_controller_machine::ctld::lease_row::{DbCopy, DbCopyChange};

pub use self::core::{Core, Input, Lease, Output};
pub use self::state::CtldState;

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
    let new = reload?;
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
use powerflex_daemon::clock::{BootClock, Clock, WallClock};

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
    /// A read of Slurm's placement (see [`spawn_placement_reader`]).
    Placement(Result<crate::placement::Placement, String>),
    /// The leadership database answered (see [`ha`]).
    Leader(LeaderInput),
    /// A save of the state to the leadership database under `epoch` was written (`Ok`),
    /// or failed (see [`ha`]).
    Saved {
        epoch: u64,
        outcome: Result<(), String>,
    },
    /// An agent refused a lease for its epoch (`Body::Fenced`).
    Fenced {
        node: String,
        lease_epoch: u64,
        accepted_epoch: u64,
    },
}

/// Reads Slurm's placement (`squeue --json`, `sinfo --json`) every `poll`, and at once
/// (at most once a second) when the loop asks through the returned sender; each command
/// waits at most `timeout`. Runs until that sender is dropped. Slurm slow or away: the
/// error goes to the loop, which keeps the last placement it had.
fn spawn_placement_reader(
    to_loop: Sender<Inbound>,
    poll: Duration,
    timeout: Duration,
) -> std::io::Result<Sender<()>> {
    use powerflex_core::slurm_record::{
        parse_sinfo_gpus, parse_squeue_json, MAX_SLURM_OUTPUT_BYTES,
    };
    let (refresh_tx, refresh_rx) = bounded::<()>(1);
    std::thread::Builder::new()
        .name("slurm-placement".into())
        .spawn(move || loop {
            let started = std::time::Instant::now();
            let read = || -> Result<crate::placement::Placement, String> {
                let run = |program: &str| {
                    powerflex_daemon::command::output_within(
                        program,
                        &["--json"],
                        &[],
                        timeout,
                        MAX_SLURM_OUTPUT_BYTES,
                    )
                    .map_err(|e| e.to_string())
                };
                let jobs = parse_squeue_json(&run("squeue")?).map_err(|e| e.to_string())?;
                let node_gpus = parse_sinfo_gpus(&run("sinfo")?).map_err(|e| e.to_string())?;
                Ok(crate::placement::Placement {
                    jobs,
                    node_gpus,
                    read_at_ms: unix_ms(),
                })
            };
            if to_loop.send(Inbound::Placement(read())).is_err() {
                return;
            }
            // At most one read a second, however often the loop asks.
            let rest = Duration::from_secs(1).saturating_sub(started.elapsed());
            std::thread::sleep(rest);
            match refresh_rx.recv_timeout(poll.saturating_sub(Duration::from_secs(1))) {
                Ok(()) | Err(crossbeam_channel::RecvTimeoutError::Timeout) => {}
                Err(crossbeam_channel::RecvTimeoutError::Disconnected) => return,
            }
        })?;
    Ok(refresh_tx)
}

/// How many connections the controller serves at once, and for how long.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Bounds {
    pub link: link::LinkLimits,
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
    let refusals = Arc::new(bounds::Refusals::default());
    let loaded = state::load(&options.state_dir, clock.now());
    // The newest state this process steers from (as loaded, then as last persisted).
    // Under `[controller.ha]` it is where a first leader starts from when the database
    // holds no state yet, and what the process that held leadership last steers from
    // when the database's copy is unreadable; the database's state wins otherwise. It
    // is also what is sent again while the database's copy is stale.
    let mut latest = loaded.state.clone();
    let mut core = Core::new(options.settings.clone(), loaded, clock.now());
    let accounting_log = accounting_log(&options.state_dir);
    let mut logged = Vec::new();
    match accounting_log.read_all() {
        Ok(lines) => {
            logged = lines
                .iter()
                .filter_map(|l| serde_json::from_str(l).ok())
                .collect();
            if !logged.is_empty() {
                info!(
                    records = logged.len(),
                    "job energy records read back from the accounting log"
                );
            }
        }
        Err(e) => {
            warn!(error = %e, "cannot read the accounting log back; earlier records are not answered")
        }
    }
    // The core keeps only the newest records; the database gets what the whole log holds
    // and it lacks (see `records_db`).
    let newest = logged.len().saturating_sub(accounting::LOADED_RECORDS);
    let newest_records = logged[newest..].to_vec();
    core.load_records(newest_records.clone());
    let records_db = match &options.records_db {
        Some(db) => Some(
            records_db::RecordsDb::spawn(db.clone(), logged)
                .map_err(|e| format!("cannot start the accounting database writer: {e}"))?,
        ),
        None => None,
    };
    let mut shown_db_view: Option<powerflex_proto::status::AccountingDbView> = None;
    let (tx, rx) = bounded::<Inbound>(4096);
    // Whether the core steers: the link sends agents on while it does not.
    let steering = Arc::new(AtomicBool::new(options.ha.is_none()));
    // Leadership's deadlines count on the time since boot: on the wall clock, a step
    // back would stop the renewals and the step-down deadline both, while the row lapsed
    // on the database's clock and the standby took over (two controllers steering); a
    // monotonic clock that stops in a suspend would keep a resumed leader leasing.
    let leader_clock = BootClock::start();
    let mut leadership = match &options.ha {
        Some(ha) => Some(Leadership {
            clock: leader_clock,
            leader: Leader::new(
                LeaderSettings {
                    name: ha.name.clone(),
                    ttl_ms: u64::try_from(ha.leader_ttl.as_millis()).unwrap_or(u64::MAX),
                },
                leader_clock.now(),
            ),
            db: ha::HaDb::spawn(ha.clone(), tx.clone())
                .map_err(|e| format!("cannot start the leadership database thread: {e}"))?,
            shown: None,
            stop_within: ha.timeout * 2,
            copy: DbCopy::default(),
        }),
        None => None,
    };
    let link = TcpListener::bind(options.listen)
        .map_err(|e| format!("cannot listen on {}: {e}", options.listen))?;
    // Where to connect to wake the blocked accept at shutdown: the bound address, with
    // a wildcard one replaced by loopback.
    let mut link_wake = link
        .local_addr()
        .map_err(|e| format!("cannot read the address of {}: {e}", options.listen))?;
    if link_wake.ip().is_unspecified() {
        link_wake.set_ip(match link_wake {
            std::net::SocketAddr::V4(_) => std::net::Ipv4Addr::LOCALHOST.into(),
            std::net::SocketAddr::V6(_) => std::net::Ipv6Addr::LOCALHOST.into(),
        });
    }
    if let Some(parent) = options.admin_socket.parent() {
        std::fs::create_dir_all(parent).map_err(|e| format!("{}: {e}", parent.display()))?;
    }
    let _ = std::fs::remove_file(&options.admin_socket);
    let admin = UnixListener::bind(&options.admin_socket)
        .map_err(|e| format!("cannot bind {}: {e}", options.admin_socket.display()))?;
    let _ = std::fs::set_permissions(
        &options.admin_socket,
        std::fs::Permissions::from_mode(0o666),
    );
    let metrics_text: Arc<Mutex<String>> = Arc::new(Mutex::new(String::new()));
    let metrics_server = match options.metrics_listen {
        None => None,
        Some(addr) => {
            let listener = TcpListener::bind(addr)
                .map_err(|e| format!("cannot listen on {addr} for metrics: {e}"))?;
            let (text, counts) = (metrics_text.clone(), refusals.clone());
            let bad_requests = Arc::new(std::sync::atomic::AtomicU64::new(0));
            let bad = bad_requests.clone();
            Some(
                MetricsServer::spawn_counted(
                    listener,
                    HttpOptions::default(),
                    bad_requests,
                    move || {
                        let mut out = text.lock().unwrap_or_else(PoisonError::into_inner).clone();
                        out.push_str(
                            &counts.render(&[("metrics_bad_request", bad.load(Ordering::Relaxed))]),
                        );
                        out
                    },
                )
                .map_err(|e| format!("cannot serve metrics on {addr}: {e}"))?,
            )
        }
    };
    let link_acceptor = link::spawn(
        link,
        tx.clone(),
        options.key.clone(),
        limits.link,
        refusals.clone(),
        shutdown.clone(),
        steering.clone(),
    )
    .map_err(|e| format!("cannot start the agent link: {e}"))?;
    // The history is read by the admin threads and written by this loop only.
    let history_board = history::HistoryBoard::new();
    let admin_acceptor = admin::spawn(
        admin,
        tx.clone(),
        history_board.clone(),
        limits.admin,
        refusals.clone(),
        shutdown.clone(),
    )
    .map_err(|e| format!("cannot start the admin socket acceptor: {e}"))?;
    let placement_refresh = match options.settings.job_placement {
        powerflex_core::config::JobPlacement::Slurm => Some(
            spawn_placement_reader(tx.clone(), options.slurm_poll, options.slurm_timeout)
                .map_err(|e| format!("cannot start the Slurm placement reader: {e}"))?,
        ),
        powerflex_core::config::JobPlacement::Reports => None,
    };
    drop(tx);
    let annotator = annotate::spawn_annotator();
    let preemptor = annotate::spawn_preemptor();
    let mut writers: BTreeMap<String, Sender<Body>> = BTreeMap::new();
    let ticker = tick(options.settings.period);
    let check = tick(Duration::from_millis(100));
    // The first step allocates at once (or starts the hold after a restart).
    let mut inputs: Vec<Input> = Vec::new();
    let mut waiting: Vec<Option<Sender<AdminReply>>> = Vec::new();
    while !shutdown.load(Ordering::SeqCst) {
        if let Some(l) = &mut leadership {
            if let Some(new) = l.step(
                LeaderInput::Tick,
                &core,
                &mut latest,
                &newest_records,
                clock.now(),
            ) {
                core = new;
                writers.clear();
            }
            let now = l.clock.now();
            if let Some(claim) = l.leader.claim_due(now) {
                // A save that failed is sent again with each claim until one is written
                // (the database thread runs the claim first).
                if l.leader.active() && l.copy.resend_with_claim() {
                    l.db.save(now, l.leader.epoch(), &latest);
                }
                l.db.claim(now, claim);
            }
            if let Some(view) = l.view_changed() {
                // First in the batch: the core decides whether it steers before any
                // other input of this step.
                inputs.insert(0, Input::Leadership(view));
                waiting.insert(0, None);
            }
        }
        let now = clock.now();
        let mut out = core.step(now, std::mem::take(&mut inputs));
        steering.store(core.steering(), Ordering::SeqCst);
        if let Some(state) = out.persist.take() {
            state::save(&options.state_dir, &state);
            if let Some(l) = leadership.as_ref().filter(|l| l.leader.active()) {
                l.db.save(l.clock.now(), l.leader.epoch(), &state);
            }
            latest = state;
        }
        history_board.publish(out.history.take(), out.owners.take());
        for (index, reply) in out.replies {
            if let Some(Some(to)) = waiting.get(index) {
                let _ = to.send(reply);
            }
        }
        waiting.clear();
        for (node, lease) in out.leases {
            let Some(writer) = writers.get(&node) else {
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
                event_in_force: lease.event_in_force,
                epoch: out.epoch,
            });
        }
        for node in out.send_on.drain(..) {
            // It follows a controller of a later epoch: sent on to look for it.
            if let Some(writer) = writers.remove(&node) {
                let _ = writer.try_send(Body::Standby {
                    reason: "this node follows a controller of a later epoch".into(),
                });
            }
        }
        if out.stopped_steering {
            // The agents look for the controller that steers now; until they find it
            // their last lease holds their caps, then the fail-safe does.
            for writer in std::mem::take(&mut writers).into_values() {
                let _ = writer.try_send(Body::Standby {
                    reason: "this controller stopped steering".into(),
                });
            }
        }
        // Before the annotations that show them in Slurm: the log is the record (and the
        // database's journal: it gets each record after the log has it).
        let mut records_written = true;
        for record in out.job_records {
            match serde_json::to_string(&record) {
                Ok(line) => {
                    if let Err(e) = accounting_log.append(&line) {
                        records_written = false;
                        error!(job_id = %record.job_id, error = %e, "cannot append a job's energy record");
                    }
                }
                Err(e) => {
                    records_written = false;
                    error!(job_id = %record.job_id, error = %e, "cannot encode a job's energy record")
                }
            }
            if let Some(db) = &records_db {
                db.send(record);
            }
        }
        if let Some(db) = &records_db {
            let view = db.view();
            if shown_db_view.as_ref() != Some(&view) {
                shown_db_view = Some(view.clone());
                inputs.push(Input::AccountingDb(view));
                waiting.push(None);
            }
        }
        // Only once the records are in the log: an agent drops a final share when it is
        // acknowledged. A failed append acknowledges nothing this step, so the agents
        // keep theirs a while longer (the record itself stays answered from memory).
        if records_written {
            for (node, finals) in out.final_acks {
                let Some(writer) = writers.get(&node) else {
                    continue;
                };
                for chunk in finals.chunks(powerflex_proto::link::MAX_ACKS_PER_MESSAGE) {
                    let _ = writer.try_send(Body::Acked {
                        finals: chunk.to_vec(),
                    });
                }
            }
        }
        for annotation in out.annotations {
            let _ = annotator.send(annotation);
        }
        // After the leases: a job suspended is already held at its lowest cap.
        for action in out.preempt {
            let _ = preemptor.send(action);
        }
        if let Some(snapshot) = out.metrics {
            let text = metrics::render(&snapshot);
            *metrics_text.lock().unwrap_or_else(PoisonError::into_inner) = text;
        }
        if out.refresh_placement {
            if let Some(refresh) = &placement_refresh {
                let _ = refresh.try_send(());
            }
        }
        select! {
            recv(rx) -> msg => {
                let Ok(first) = msg else { break };
                // Drain what else is queued: the core allocates once for the batch.
                let mut batch = vec![first];
                while batch.len() < 8192 {
                    match rx.try_recv() {
                        Ok(more) => batch.push(more),
                        Err(_) => break,
                    }
                }
                for msg in batch {
                    match msg {
                        Inbound::Hello { node, gpus, writer } => {
                            writers.insert(node.clone(), writer);
                            inputs.push(Input::Hello { node, gpus });
                            waiting.push(None);
                        }
                        Inbound::Report {
                            node,
                            jobs,
                            power_w,
                            ended,
                            observe_only,
                        } => {
                            inputs.push(Input::Report {
                                node,
                                jobs,
                                power_w,
                                ended,
                                observe_only,
                            });
                            waiting.push(None);
                        }
                        Inbound::Admin { op, uid, reply } => {
                            inputs.push(Input::Admin { op, uid });
                            waiting.push(Some(reply));
                        }
                        Inbound::Placement(read) => {
                            inputs.push(Input::Placement(Box::new(read)));
                            waiting.push(None);
                        }
                        Inbound::Leader(input) => {
                            if let Some(l) = &mut leadership {
                                if let Some(new) = l.step(
                                    input,
                                    &core,
                                    &mut latest,
                                    &newest_records,
                                    clock.now(),
                                ) {
                                    core = new;
                                    writers.clear();
                                }
                            }
                        }
                        Inbound::Saved { epoch, outcome } => {
                            if let Some(l) = &mut leadership {
                                l.saved(epoch, outcome);
                            }
                        }
                        Inbound::Fenced {
                            node,
                            lease_epoch,
                            accepted_epoch,
                        } => {
                            if let Some(l) = &mut leadership {
                                l.leader.step(
                                    l.clock.now(),
                                    LeaderInput::Fenced {
                                        lease_epoch,
                                        accepted_epoch,
                                    },
                                );
                            }
                            inputs.push(Input::Fenced {
                                node,
                                lease_epoch,
                                accepted_epoch,
                            });
                            waiting.push(None);
                        }
                    }
                }
            }
            recv(reloads) -> reload => {
                if let Ok(reload) = reload {
                    inputs.push(Input::Reload(Box::new(settings_reload(&options, reload))));
                    waiting.push(None);
                }
            }
            recv(ticker) -> _ => {
                inputs.push(Input::Tick);
                waiting.push(None);
            }
            recv(check) -> _ => {}
        }
    }
    // The acceptors block in accept(): a connection to each wakes it to see the shutdown.
    shutdown.store(true, Ordering::SeqCst);
    let _ = std::net::TcpStream::connect_timeout(&link_wake, Duration::from_secs(1));
    let _ = UnixStream::connect(&options.admin_socket);
    for t in [link_acceptor, admin_acceptor] {
        let _ = t.join();
    }
    if let Some(server) = metrics_server {
        server.stop();
    }
    let _ = std::fs::remove_file(&options.admin_socket);
    if let Some(db) = records_db {
        db.stop();
    }
    if let Some(l) = leadership {
        l.db.stop(l.stop_within);
    }
    Ok(())
}

/// Leadership under `[controller.ha]`: the machine, its database thread, and the view
/// last shown to the core.
struct Leadership {
    leader: Leader,
    /// The leader's clock: every claim and save it sends is stamped with it.
    clock: BootClock,
    db: ha::HaDb,
    shown: Option<powerflex_proto::status::LeadershipView>,
    stop_within: Duration,
    /// Whether the database's copy of the state is behind this controller's.
    copy: DbCopy,
}

impl Leadership {
    /// The view, when it changed since the core last had it. While active with the
    /// database's copy of the state stale, its reason says so (status shows it).
    fn view_changed(&mut self) -> Option<powerflex_proto::status::LeadershipView> {
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
    fn step(
        &mut self,
        input: LeaderInput,
        old: &Core,
        latest: &mut CtldState,
        records: &[powerflex_proto::usage::JobEnergyRecord],
        now: powerflex_core::UnixMs,
    ) -> Option<Core> {
        match self.leader.step(self.clock.now(), input) {
            LeaderChange::BecameActive { epoch, state, .. } => {
                Some(self.take_over(old, epoch, state, latest, records, now))
            }
            _ => None,
        }
    }

    /// A save's outcome: the database's copy is stale after a failure until a save is
    /// written (each said once in the log).
    fn saved(&mut self, epoch: u64, outcome: Result<(), String>) {
        if !self.leader.active() || epoch != self.leader.epoch() {
            return;
        }
        match self.copy.saved(outcome) {
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
        old: &Core,
        epoch: u64,
        state: Option<Box<CtldState>>,
        latest: &mut CtldState,
        records: &[powerflex_proto::usage::JobEnergyRecord],
        now: powerflex_core::UnixMs,
    ) -> Core {
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
        self.db.save(self.clock.now(), epoch, &state);
        *latest = state.clone();
        let mut core = Core::new(old.settings().clone(), state::Loaded { state, lost }, now);
        core.load_records(records.to_vec());
        // Shown again to the new core before its first step.
        self.shown = None;
        core
    }
}

/// The controller's accounting log inside its state directory: one
/// [`powerflex_proto::usage::JobEnergyRecord`] per line, rotated at 64 MiB, 8 kept,
/// root's only (it names users' jobs).
pub const ACCOUNTING_LOG_FILE: &str = "job-energy.jsonl";

fn accounting_log(state_dir: &std::path::Path) -> powerflex_daemon::fsx::JsonLines {
    powerflex_daemon::fsx::JsonLines::new(state_dir.join(ACCOUNTING_LOG_FILE))
}

#[cfg(test)]
mod tests {
    use super::*;
    use powerflex_admin_client::request;
    use powerflex_core::allocate::Policy;
    use powerflex_core::config::{BudgetMode, Objective};
    use powerflex_core::flex::TierTable;
    use powerflex_core::Watts;

    /// A loopback address on a port below the ephemeral range: no outgoing connection or
    /// `bind(:0)` elsewhere takes it while a test stops and checks it.
    fn free_port() -> std::net::SocketAddr {
        (
            [127, 0, 0, 1],
            powerflex_daemon::test_ports::free_loopback_port(),
        )
            .into()
    }

    /// A controller on free loopback ports with its files under `dir`: 3200 W, a 10 s
    /// period, hard budget, the default tiers.
    fn test_options(
        dir: &std::path::Path,
        key: &[u8],
        metrics: std::net::SocketAddr,
    ) -> CtldOptions {
        CtldOptions {
            listen: free_port(),
            admin_socket: dir.join("ctld.sock"),
            state_dir: dir.join("state"),
            key: key.to_vec(),
            metrics_listen: Some(metrics),
            slurm_poll: Duration::from_secs(5),
            slurm_timeout: Duration::from_secs(5),
            records_db: None,
            ha: None,
            settings: CtldSettings {
                base_budget: Watts(3200.0),
                period: Duration::from_secs(10),
                lease_ttl_s: 30.0,
                site: crate::site::SiteSettings {
                    tiers: TierTable::default_table(),
                    policy: Policy::Optimal,
                    cap_step: Watts(10.0),
                    failsafe_cap: Watts(500.0),
                    default_pfi: 1.3,
                    budget_mode: BudgetMode::Hard,
                    objective: Objective::Tokens,
                    tier_bounds: crate::site::TierBounds::Honoured,
                    domains: None,
                },
                lease_rollout: Default::default(),
                max_ramp_w_per_s: None,
                job_placement: powerflex_core::config::JobPlacement::Reports,
                max_gpu_power_w: 700.0,
            },
        }
    }

    /// A reload hands the machine the new settings, and only those: the edge's sockets,
    /// paths and key stay as started (the machine keeps its period and placement).
    #[test]
    fn a_reload_passes_the_settings_and_keeps_the_edge_s_own() {
        let dir = std::env::temp_dir().join("pf-ctld-reload-settings");
        let in_force = test_options(&dir, b"site key", free_port());
        let mut new = in_force.clone();
        new.listen = free_port();
        new.key = b"another key".to_vec();
        new.settings.base_budget = Watts(8000.0);
        new.settings.lease_ttl_s = 60.0;
        let settings = settings_reload(&in_force, Ok(new)).expect("valid");
        assert_eq!(settings.base_budget, Watts(8000.0));
        assert_eq!(settings.lease_ttl_s, 60.0);
        assert_eq!(
            settings_reload(&in_force, Err("bad key".into())).expect_err("refused"),
            "bad key"
        );
    }

    /// The acceptors block in accept() (no polling): `run` must still end promptly when
    /// asked, having woken them, and serve every socket until then.
    #[test]
    fn serves_admin_link_and_metrics_then_stops_promptly() {
        let dir = std::env::temp_dir().join(format!("pf-ctld-run-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let metrics = free_port();
        let options = test_options(&dir, b"site key for tests", metrics);
        let shutdown = Arc::new(AtomicBool::new(false));
        let (_reload_tx, reloads) = bounded::<Reload>(1);
        let (done_tx, done_rx) = bounded(1);
        let (opts, stop) = (options.clone(), shutdown.clone());
        std::thread::spawn(move || {
            let _ = done_tx.send(run(opts, stop, reloads));
        });

        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        let reply = loop {
            match request(&options.admin_socket, &AdminOp::Status) {
                Ok(reply) => break reply,
                Err(e) if std::time::Instant::now() > deadline => panic!("no controller: {e}"),
                Err(_) => std::thread::sleep(Duration::from_millis(20)),
            }
        };
        assert!(reply.ok, "{reply:?}");
        assert_eq!(reply.status.expect("status").budget_w, 3200.0);
        // The link accepts (a line that is not a message is refused, the socket stays up).
        let mut agent = std::net::TcpStream::connect(options.listen).expect("link");
        std::io::Write::write_all(&mut agent, b"not a message\n").expect("send");
        // Metrics from the shared responder and catalog.
        let mut scrape = std::net::TcpStream::connect(metrics).expect("metrics");
        std::io::Write::write_all(&mut scrape, b"GET /metrics HTTP/1.0\r\n\r\n").expect("send");
        let mut text = String::new();
        std::io::Read::read_to_string(&mut scrape, &mut text).expect("scrape");
        assert!(text.contains("\npowerflex_budget_watts 3200\n"), "{text}");

        let asked = std::time::Instant::now();
        shutdown.store(true, Ordering::SeqCst);
        let result = done_rx
            .recv_timeout(Duration::from_secs(3))
            .expect("run ends within 3 s of shutdown (acceptors woken)");
        assert_eq!(result, Ok(()));
        assert!(asked.elapsed() < Duration::from_secs(3));
        assert!(
            !options.admin_socket.exists(),
            "socket removed on the way out"
        );
        // Both ports released: they can be bound again. (A connect that fails would
        // say less: a loopback connect whose source port equals its destination port
        // connects to itself.)
        for port in [options.listen, metrics] {
            TcpListener::bind(port).unwrap_or_else(|e| panic!("{port} still held: {e}"));
        }
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// Issue 21: `history` is answered by the admin threads from the history board,
    /// never by the allocation loop (whose core keeps no history and refuses it): over
    /// the real admin socket, with one sample per allocation, filtered by the peer's
    /// uid, pages as asked; and while a flood of history requests is in flight the
    /// agent's reports go on being allocated, each new job named in the node's lease.
    #[test]
    fn history_is_served_from_the_board_while_allocations_go_on() {
        use powerflex_proto::admin::MAX_HISTORY_SAMPLES;
        use std::os::unix::fs::MetadataExt;

        let dir = std::env::temp_dir().join(format!("pf-ctld-history-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let options = test_options(&dir, b"site key for the history test", free_port());
        let shutdown = Arc::new(AtomicBool::new(false));
        let (_reload_tx, reloads) = bounded::<Reload>(1);
        let (opts, stop) = (options.clone(), shutdown.clone());
        let ctld = std::thread::spawn(move || run_bounded(opts, Bounds::default(), stop, reloads));
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        while request(&options.admin_socket, &AdminOp::Status).is_err() {
            assert!(std::time::Instant::now() < deadline, "no controller");
            std::thread::sleep(Duration::from_millis(20));
        }
        // The controller made its socket as this process: its owner is the uid the admin
        // threads read from this test's connections.
        let me = std::fs::metadata(&options.admin_socket)
            .expect("the admin socket")
            .uid();
        let someone_else = if me == 4242 { 4243 } else { 4242 };
        let history = |since_ms: Option<u64>, max_samples: Option<u32>| {
            request(
                &options.admin_socket,
                &AdminOp::History {
                    since_ms,
                    max_samples,
                },
            )
        };

        // Three readers asking for the whole history over and over (with this test's
        // own requests, within the 4 connections a user may hold).
        let stop_reading = Arc::new(AtomicBool::new(false));
        let answered = Arc::new(std::sync::atomic::AtomicU64::new(0));
        let readers: Vec<_> = (0..3)
            .map(|_| {
                let (socket, stop, answered) = (
                    options.admin_socket.clone(),
                    stop_reading.clone(),
                    answered.clone(),
                );
                std::thread::spawn(move || {
                    let op = AdminOp::History {
                        since_ms: None,
                        max_samples: None,
                    };
                    while !stop.load(Ordering::SeqCst) {
                        let reply = request(&socket, &op).expect("the admin socket answers");
                        if !reply.ok {
                            // The gate may still count a connection whose reply is out.
                            let error = reply.error.unwrap_or_default();
                            assert!(error.contains("admin connections"), "{error}");
                            continue;
                        }
                        let samples = reply.history.expect("a history reply carries one");
                        assert!(samples.len() <= MAX_HISTORY_SAMPLES as usize);
                        assert!(samples.windows(2).all(|w| w[0].t_ms < w[1].t_ms));
                        answered.fetch_add(1, Ordering::SeqCst);
                    }
                })
            })
            .collect();
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        while answered.load(Ordering::SeqCst) < 3 {
            assert!(std::time::Instant::now() < deadline, "no history answered");
            std::thread::sleep(Duration::from_millis(10));
        }

        // One node of 8 GPUs; its jobs come one at a time, each a change in its jobs that
        // the loop allocates at once (not at the 10 s tick). Odd jobs are this test's
        // uid's, even ones someone else's.
        let mut node = Peer::connect(options.listen, &options.key, "n1", h200s("n1", 8))
            .expect("n1 on the link");
        let owner = |id: usize| if id % 2 == 1 { me } else { someone_else };
        let job = |id: usize| JobReport {
            job_id: id.to_string(),
            tier: "flex2".into(),
            gpus: 2,
            cap_w: Some(400.0),
            power_w: Some(800.0),
            owner_uid: Some(owner(id)),
            ..JobReport::default()
        };
        let mut jobs: Vec<JobReport> = Vec::new();
        for id in 1..=4 {
            jobs.push(job(id));
            node.send(&Body::Report {
                power_w: 800.0 * jobs.len() as f64,
                jobs: jobs.clone(),
                failsafe: false,
                cap_mismatches: 0,
                ended: Vec::new(),
                observe_only: false,
            })
            .expect("report");
            loop {
                match node.recv(Duration::from_secs(10)) {
                    Some(Ok(Body::Lease { caps, .. }))
                        if jobs.iter().all(|j| caps.contains_key(&j.job_id)) =>
                    {
                        break
                    }
                    Some(Ok(_)) => {}
                    Some(Err(e)) => panic!("a frame from the controller refused: {e}"),
                    None => panic!("no lease naming job {id} while history was being read"),
                }
            }
        }
        stop_reading.store(true, Ordering::SeqCst);
        for reader in readers {
            reader.join().expect("every history answer was whole");
        }

        // The allocations, as the board holds them: each set of jobs the node reported
        // has its sample, with the caps this caller may read (all for root).
        let reply = history(None, None).expect("history");
        assert!(reply.ok, "{reply:?}");
        let samples = reply.history.expect("history");
        assert!(samples.windows(2).all(|w| w[0].t_ms < w[1].t_ms));
        let readable = |up_to: usize| -> Vec<String> {
            (1..=up_to)
                .filter(|&id| me == 0 || owner(id) == me)
                .map(|id| id.to_string())
                .collect()
        };
        for up_to in 1..=4 {
            let expected = readable(up_to);
            assert!(
                samples
                    .iter()
                    .any(|s| s.caps.keys().cloned().collect::<Vec<_>>() == expected),
                "no sample with the caps of jobs {expected:?}: {samples:?}"
            );
        }
        // A page after the first sample is the next two, as in the overview.
        let page = history(Some(samples[0].t_ms), Some(2))
            .expect("a page")
            .history
            .expect("history");
        assert_eq!(page, samples[1..3]);

        shutdown.store(true, Ordering::SeqCst);
        assert_eq!(ctld.join().expect("ctld"), Ok(()));
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// One handshake as `node` on the link at `addr`: the session and the stream, or
    /// why the controller would not have it.
    fn handshake(
        addr: std::net::SocketAddr,
        site_key: &[u8],
        node: &str,
    ) -> Result<(std::net::TcpStream, powerflex_proto::link::Session), String> {
        handshake_with(addr, site_key, node, Vec::new())
    }

    /// [`handshake`], the hello announcing `gpus`.
    fn handshake_with(
        addr: std::net::SocketAddr,
        site_key: &[u8],
        node: &str,
        gpus: Vec<GpuInfo>,
    ) -> Result<(std::net::TcpStream, powerflex_proto::link::Session), String> {
        use powerflex_proto::link::{fresh_nonce, node_key, AgentHandshake};
        use std::io::{BufRead, Write};
        let mut stream = std::net::TcpStream::connect(addr).map_err(|e| e.to_string())?;
        stream
            .set_read_timeout(Some(Duration::from_secs(5)))
            .map_err(|e| e.to_string())?;
        let key = node_key(site_key, node).map_err(|e| e.to_string())?;
        let (hs, open) = AgentHandshake::start(
            &key,
            node,
            fresh_nonce().map_err(|e| e.to_string())?,
            unix_ms(),
        )
        .map_err(|e| e.to_string())?;
        stream
            .write_all(open.as_bytes())
            .map_err(|e| e.to_string())?;
        let mut challenge = String::new();
        std::io::BufReader::new(stream.try_clone().map_err(|e| e.to_string())?)
            .read_line(&mut challenge)
            .map_err(|e| e.to_string())?;
        let mut session = hs
            .finish(&challenge, unix_ms())
            .map_err(|e| e.to_string())?;
        let hello = session
            .seal(&Body::Hello { gpus }, unix_ms())
            .map_err(|e| e.to_string())?;
        stream
            .write_all(hello.as_bytes())
            .map_err(|e| e.to_string())?;
        Ok((stream, session))
    }

    /// `n` H200s on `node` (200-700 W), as its agent announces them.
    fn h200s(node: &str, n: usize) -> Vec<GpuInfo> {
        (0..n)
            .map(|g| GpuInfo {
                uuid: format!("GPU-{node}-{g}"),
                name: "NVIDIA H200".into(),
                min_w: 200.0,
                max_w: 700.0,
                default_w: 700.0,
            })
            .collect()
    }

    /// An agent on the link driven by hand: it seals the frames it sends and opens the
    /// controller's with the one session of its handshake.
    struct Peer {
        stream: std::net::TcpStream,
        lines: std::io::BufReader<std::net::TcpStream>,
        session: powerflex_proto::link::Session,
    }

    impl Peer {
        /// Connects as `node`, announcing `gpus` (see [`handshake_with`]).
        fn connect(
            addr: std::net::SocketAddr,
            site_key: &[u8],
            node: &str,
            gpus: Vec<GpuInfo>,
        ) -> Result<Peer, String> {
            let (stream, session) = handshake_with(addr, site_key, node, gpus)?;
            let lines = std::io::BufReader::new(stream.try_clone().map_err(|e| e.to_string())?);
            Ok(Peer {
                stream,
                lines,
                session,
            })
        }

        /// Seals and sends `body` as the next frame.
        fn send(&mut self, body: &Body) -> Result<(), String> {
            let line = self
                .session
                .seal(body, unix_ms())
                .map_err(|e| e.to_string())?;
            std::io::Write::write_all(&mut self.stream, line.as_bytes()).map_err(|e| e.to_string())
        }

        /// The controller's next frame, opened (`None` at end of stream or after
        /// `timeout`).
        fn recv(
            &mut self,
            timeout: Duration,
        ) -> Option<Result<Body, powerflex_proto::link::LinkError>> {
            let _ = self.stream.set_read_timeout(Some(timeout));
            let mut line = String::new();
            match std::io::BufRead::read_line(&mut self.lines, &mut line) {
                Ok(0) | Err(_) => None,
                Ok(_) => Some(self.session.open(&line, unix_ms())),
            }
        }
    }

    /// Whether the controller ends `stream` within `within` (reads to end of stream).
    fn closed_within(stream: &mut std::net::TcpStream, within: Duration) -> bool {
        use std::io::Read;
        let _ = stream.set_read_timeout(Some(within));
        let mut buf = [0u8; 4096];
        let until = std::time::Instant::now() + within;
        loop {
            match stream.read(&mut buf) {
                Ok(0) => return true,
                Ok(_) if std::time::Instant::now() < until => {}
                Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => return true,
                _ => return false,
            }
        }
    }

    /// Threads of this process serving agent sessions (named `link-<node>` and
    /// `link-w-<node>`; the handshake thread is `link-handshake`). By name, since other
    /// tests run in this process at the same time.
    fn session_threads() -> usize {
        std::fs::read_dir("/proc/self/task")
            .map(|tasks| {
                tasks
                    .flatten()
                    .filter_map(|t| std::fs::read_to_string(t.path().join("comm")).ok())
                    .filter(|name| {
                        let name = name.trim_end();
                        name.starts_with("link-") && name != "link-handshake"
                    })
                    .count()
            })
            .unwrap_or(0)
    }

    /// The link's bounds, in process with tight limits: a flood of idle connections costs
    /// no thread and cannot keep an agent out; idle ones are closed at the deadline; one
    /// session per node (a newer one replaces it), sessions capped; every refusal counted.
    #[test]
    fn the_link_bounds_unauthenticated_peers_and_sessions() {
        let dir = std::env::temp_dir().join(format!("pf-ctld-bounds-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let metrics = free_port();
        let options = test_options(&dir, b"site key for the bounds test", metrics);
        let bounds = Bounds {
            link: link::LinkLimits {
                max_pending: 8,
                handshake_timeout: Duration::from_millis(500),
                max_sessions: 2,
                idle_timeout: Duration::from_secs(30),
            },
            admin: bounds::AdminLimits::default(),
        };
        let shutdown = Arc::new(AtomicBool::new(false));
        let (_reload_tx, reloads) = bounded::<Reload>(1);
        let (opts, stop) = (options.clone(), shutdown.clone());
        let ctld = std::thread::spawn(move || run_bounded(opts, bounds, stop, reloads));
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        while request(&options.admin_socket, &AdminOp::Status).is_err() {
            assert!(std::time::Instant::now() < deadline, "no controller");
            std::thread::sleep(Duration::from_millis(20));
        }
        let flood: Vec<std::net::TcpStream> = (0..200)
            .filter_map(|_| std::net::TcpStream::connect(options.listen).ok())
            .collect();
        assert_eq!(flood.len(), 200);
        // An agent still gets in, past the full handshake table.
        let (mut n1, _) =
            handshake(options.listen, &options.key, "n1").expect("n1 during the flood");
        // n1's two session threads, and none for the 200 flooding peers.
        let deadline = std::time::Instant::now() + Duration::from_secs(5);
        while session_threads() < 2 && std::time::Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(20));
        }
        assert_eq!(session_threads(), 2, "n1's reader and writer only");
        let (_n2, _) = handshake(options.listen, &options.key, "n2").expect("n2");
        // A third node is over the session cap: closed after its hello.
        let (mut n3, _) = handshake(options.listen, &options.key, "n3").expect("n3's handshake");
        assert!(closed_within(&mut n3, Duration::from_secs(5)), "n3 refused");
        // n1 again: the new session replaces the old one, which is closed.
        let (_n1_again, _) = handshake(options.listen, &options.key, "n1").expect("n1 again");
        assert!(
            closed_within(&mut n1, Duration::from_secs(5)),
            "old n1 session ended"
        );
        // The idle flood is closed at the deadline, whatever was not evicted before.
        // (The others stay open: a peer that leaves by itself is no refusal.)
        let mut flood = flood;
        let last = flood.last_mut().expect("one");
        assert!(
            closed_within(last, Duration::from_secs(5)),
            "idle peer closed"
        );
        let scrape = || {
            let mut scrape = std::net::TcpStream::connect(metrics).expect("metrics");
            std::io::Write::write_all(&mut scrape, b"GET /metrics HTTP/1.0\r\n\r\n").expect("send");
            let mut text = String::new();
            std::io::Read::read_to_string(&mut scrape, &mut text).expect("scrape");
            text
        };
        let count_in = |text: &str, reason: &str| -> u64 {
            let prefix = format!("powerflex_refusals_total{{reason=\"{reason}\"}} ");
            text.lines()
                .find_map(|l| l.strip_prefix(&prefix))
                .and_then(|v| v.trim().parse().ok())
                .unwrap_or(0)
        };
        // Every flood connection loses its place to a newer one or meets the deadline
        // (which of the two depends on how fast this machine accepts; a connection the
        // kernel's full backlog held back is accepted, and refused, late).
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        let text = loop {
            let text = scrape();
            let refused = count_in(&text, "pending_cap") + count_in(&text, "handshake_timeout");
            if refused >= 200 || std::time::Instant::now() > deadline {
                break text;
            }
            std::thread::sleep(Duration::from_millis(100));
        };
        let count = |reason: &str| count_in(&text, reason);
        assert!(
            count("pending_cap") + count("handshake_timeout") >= 200,
            "{text}"
        );
        assert!(count("pending_cap") >= 100, "{text}");
        drop(flood);
        assert_eq!(count("session_cap"), 1, "{text}");
        shutdown.store(true, Ordering::SeqCst);
        assert_eq!(ctld.join().expect("ctld"), Ok(()));
        let _ = std::fs::remove_dir_all(&dir);
    }
}
