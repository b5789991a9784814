//! The agent's I/O edge: binds the sockets, runs the control loop, executes the state
//! machine's actions on the GPU backend, persists, and restores every GPU on the way out.
//!
//! Threads: one acceptor per socket (plus a short-lived thread per connection), the
//! metrics server, and the control loop, which `select!`s over inbound requests and a
//! tick; crossbeam channels between them, no async runtime.

use std::collections::BTreeMap;
use std::net::TcpListener;
use std::os::unix::fs::PermissionsExt;
use std::os::unix::net::UnixListener;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, RwLock};
use std::time::{Duration, Instant};

use crossbeam_channel::{bounded, select, tick, Receiver};
use powerflex_core::Watts;
use powerflex_daemon::os::FileLock;
use powerflex_proto::{ControlOp, ControlReply};
use tracing::{error, info, info_span, warn};

use crate::backend::GpuBackend;
use crate::control::{Action, Agent, AgentSettings, ReportSender};
use crate::persist;
use crate::server::{self, Inbound, SnapshotCell};
use powerflex_core::flex::parse_power_flex;

/// Where the agent listens and keeps its state.
#[derive(Debug, Clone)]
pub struct RunOptions {
    pub control_socket: PathBuf,
    pub progress_socket: PathBuf,
    pub state_dir: PathBuf,
    pub metrics_listen: Option<std::net::SocketAddr>,
    /// How often GPUs are sampled and caps reconciled.
    pub sample_interval: Duration,
    /// The controller link (controller mode with a readable site key), or none.
    pub link: Option<crate::link::LinkOptions>,
    /// On exit, every GPU back to its default, the GPUs of running jobs too
    /// (decommissioning a node). Off: running jobs keep their caps (fail-static).
    pub release_on_exit: bool,
    /// Append each job's final share here to `<state_dir>/usage.jsonl`.
    pub usage_log: bool,
}

/// The node's log of jobs' final shares, inside the state directory.
pub const USAGE_LOG_FILE: &str = "usage.jsonl";

/// How often the state (with every job's running accounting) is saved at least, s: an
/// agent killed without warning loses at most this much of the time-based shares (the
/// energy counters lose nothing).
const USAGE_SAVE_INTERVAL_S: f64 = 10.0;

/// Why the agent could not start or stopped with an error.
#[derive(Debug, thiserror::Error)]
pub enum AgentError {
    #[error("{0}")]
    Gpu(#[from] crate::backend::GpuError),
    #[error("{0}")]
    Plumbing(#[from] powerflex_daemon::DaemonError),
    /// Another agent holds the node's instance lock.
    #[error("another powerflexd{} holds {lock}; one agent runs per node: stop it first (systemctl stop powerflexd), or give this one another agent.state_dir and sockets", match .pid { Some(pid) => format!(" (pid {pid})"), None => String::new() })]
    AlreadyRunning { lock: String, pid: Option<u32> },
    #[error("{what} {path}: {source}")]
    Io {
        what: &'static str,
        path: String,
        #[source]
        source: std::io::Error,
    },
}

fn bind_unix(path: &Path, what: &'static str) -> Result<UnixListener, AgentError> {
    let io = |source| AgentError::Io {
        what,
        path: path.display().to_string(),
        source,
    };
    if let Some(parent) = path.parent() {
        std::fs::create_dir_all(parent).map_err(io)?;
    }
    // A socket file left by a crashed agent: nobody can be listening on it (we hold the
    // node), so it is replaced.
    match std::fs::remove_file(path) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(io(e)),
    }
    let listener = UnixListener::bind(path).map_err(io)?;
    // Anyone may connect; who may do what is checked per request (SO_PEERCRED).
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o666)).map_err(io)?;
    Ok(listener)
}

/// The lock file in the state directory that one running agent holds.
pub const INSTANCE_LOCK_FILE: &str = "powerflexd.lock";

/// Takes the node's instance lock (`flock`, released by the kernel if the agent dies) and
/// records this agent's pid in it; refuses when another agent holds it.
fn lock_instance(state_dir: &Path) -> Result<FileLock, AgentError> {
    std::fs::create_dir_all(state_dir).map_err(|source| AgentError::Io {
        what: "cannot create the state directory",
        path: state_dir.display().to_string(),
        source,
    })?;
    let path = state_dir.join(INSTANCE_LOCK_FILE);
    let Some(lock) = FileLock::try_acquire(&path)? else {
        return Err(AgentError::AlreadyRunning {
            lock: path.display().to_string(),
            pid: FileLock::holder_pid(&path),
        });
    };
    lock.record_pid(&path)?;
    Ok(lock)
}

fn unix_s() -> f64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs_f64())
        .unwrap_or(0.0)
}

/// What NVML lists on the GPUs, read at one scan.
#[derive(Debug, Default)]
struct GpuUse {
    /// Per GPU that NVML lists processes of Slurm jobs on, those jobs (processes in no
    /// job left out).
    jobs: std::collections::BTreeMap<u32, std::collections::BTreeSet<crate::procs::JobKey>>,
    /// Per GPU NVML could list, every process on it and the job it belongs to (for
    /// status).
    processes: std::collections::BTreeMap<u32, Vec<(u32, Option<String>)>>,
}

/// The processes NVML lists on each GPU and the jobs they belong to, by their ancestry in
/// `table`. GPUs whose list NVML cannot give (and degraded ones) are left out.
fn gpu_use(backend: &mut dyn GpuBackend, agent: &Agent, table: &crate::procs::ProcTable) -> GpuUse {
    let mut found = GpuUse::default();
    for gpu in 0..agent.gpus.len() as u32 {
        if agent.gpus[gpu as usize].degraded.is_some() {
            continue;
        }
        let Ok(pids) = backend.running_pids(gpu) else {
            continue;
        };
        let mut jobs = std::collections::BTreeSet::new();
        let mut processes = Vec::with_capacity(pids.len());
        for pid in pids {
            let key = table.step_of(pid).map(|s| s.job_key());
            processes.push((pid, key.as_ref().map(|k| k.0.clone())));
            jobs.extend(key);
        }
        if !jobs.is_empty() {
            found.jobs.insert(gpu, jobs);
        }
        found.processes.insert(gpu, processes);
    }
    found
}

/// Of the GPUs a registration names, the first on which NVML lists processes of
/// other jobs (by their ancestry) and none of `job_id`'s: Slurm gives a GPU to one job
/// at a time, so such a claim was made with words (variables the user exported), not by
/// Slurm. Processes in no job, and GPUs NVML cannot list, are no evidence either way.
fn gpus_used_by_others(
    backend: &mut dyn GpuBackend,
    agent: &Agent,
    gpus: &[String],
    job_id: &str,
    cluster: &Option<Option<String>>,
) -> Option<crate::control::GpuClaimRefused> {
    let refs = powerflex_core::gpus::parse_gpu_list(&gpus.join(",")).ok()?;
    for r in refs {
        let Some(gpu) = agent.gpus.iter().position(|g| match &r {
            powerflex_core::gpus::GpuRef::Index(i) => g.identity.index == *i,
            powerflex_core::gpus::GpuRef::Uuid(u) => &g.identity.uuid == u,
        }) else {
            continue;
        };
        let Ok(pids) = backend.running_pids(gpu as u32) else {
            continue;
        };
        let users: std::collections::BTreeSet<crate::procs::JobKey> = pids
            .into_iter()
            .filter_map(|pid| crate::procs::step_of_pid(Path::new("/proc"), pid))
            .map(|s| s.job_key())
            .collect();
        let mine =
            |k: &crate::procs::JobKey| k.0 == job_id && cluster.as_ref().is_none_or(|c| &k.1 == c);
        if !users.is_empty() && !users.iter().any(mine) {
            return Some(crate::control::GpuClaimRefused {
                gpu: gpu as u32,
                claimed_by: job_id.to_string(),
                used_by: users.into_iter().map(|(job, _)| job).collect(),
            });
        }
    }
    None
}

/// Handles one message from the sockets or the controller link, and publishes what a
/// reader needs at once.
fn serve(
    msg: Inbound,
    agent: &mut Agent,
    backend: &mut dyn GpuBackend,
    snapshot: &SnapshotCell,
    options: &RunOptions,
    clock: Instant,
) {
    // Progress is frequent and changes nothing a reader needs at once: it is published
    // with the next tick. Job changes are published right away.
    let job_change = matches!(msg, Inbound::Control { .. } | Inbound::Lease { .. });
    let started = Instant::now();
    let what = inbound_kind(&msg);
    let now = || clock.elapsed().as_secs_f64();
    handle(msg, agent, backend, now(), clock, &options.state_dir);
    record_usage(agent, &options.state_dir, options.usage_log);
    if job_change {
        publish(snapshot, agent, now());
    }
    note_if_slow(started, what);
}

/// Control requests served one after another before the loop takes one turn of
/// anything else.
const MAX_CONTROL_IN_A_ROW: u32 = 8;

/// Work of one loop turn past which the agent says so: registrations wait behind it
/// (slurmstepd gives up on its answer after the plugin's deadline, 150 ms by default).
const SLOW_TURN: Duration = Duration::from_millis(100);

/// Warns when one turn of the control loop took longer than [`SLOW_TURN`].
fn note_if_slow(started: Instant, what: &'static str) {
    let took = started.elapsed();
    if took > SLOW_TURN {
        warn!(
            took_ms = took.as_millis() as u64,
            what, "the control loop was busy: registrations and reports waited"
        );
    }
}

fn inbound_kind(msg: &Inbound) -> &'static str {
    match msg {
        Inbound::Control { .. } => "control request",
        Inbound::Progress { .. } => "progress report",
        Inbound::ProgressRefused { .. } => "refused progress report",
        Inbound::Lease { .. } => "lease",
        Inbound::Acked { .. } => "acknowledged finals",
    }
}

/// How often the agent looks for jobs whose step daemons are gone, s.
const JOB_SCAN_INTERVAL_S: f64 = 2.0;

/// Whether the last state save failed. A full or read-only `/var` fails every save (each
/// change and every usage interval): logged once when saves start failing, and once when
/// they work again, rather than at each one. One agent per process.
static SAVES_FAILING: AtomicBool = AtomicBool::new(false);

fn save(state_dir: &Path, agent: &Agent) {
    match persist::save(state_dir, &agent.saved_state()) {
        Err(e) if !SAVES_FAILING.swap(true, Ordering::Relaxed) => error!(
            error = %e,
            "cannot persist agent state; the caps in force stay, and the next saves are tried without a line each until one works"
        ),
        Err(e) => tracing::debug!(error = %e, "cannot persist agent state (still)"),
        Ok(()) if SAVES_FAILING.swap(false, Ordering::Relaxed) => {
            info!("agent state persisted again")
        }
        Ok(()) => {}
    }
}

/// Appends the final shares of jobs ended since the last call to the node's usage log,
/// logs each, and saves the state, which keeps them until the controller acknowledges
/// them (a crash right after a job's end loses none).
fn record_usage(agent: &mut Agent, state_dir: &Path, enabled: bool) {
    let records = agent.take_records();
    if records.is_empty() {
        return;
    }
    save(state_dir, agent);
    let log = powerflex_daemon::fsx::JsonLines::new(state_dir.join(USAGE_LOG_FILE));
    for share in records {
        info!(
            job_id = %share.job_id,
            energy_j = share.energy_mj as f64 / 1000.0,
            source = share.energy_source.name(),
            gpus = share.gpus.len(),
            capped_s = share.capped_s,
            "job's final share on this node"
        );
        if !enabled {
            continue;
        }
        match serde_json::to_string(&share) {
            Ok(line) => {
                if let Err(e) = log.append(&line) {
                    error!(job_id = %share.job_id, error = %e, "cannot append to the usage log");
                }
            }
            Err(e) => error!(job_id = %share.job_id, error = %e, "cannot encode a job's share"),
        }
    }
}

/// Reads the GPUs of `job_id` now, so its accounting starts or ends at this instant.
fn sample_job_gpus(agent: &mut Agent, backend: &mut dyn GpuBackend, job_id: &str, now: f64) {
    let gpus: Vec<u32> = agent
        .jobs
        .get(job_id)
        .map(|j| j.gpus.clone())
        .unwrap_or_default();
    for gpu in gpus {
        if agent.gpus[gpu as usize].degraded.is_some() {
            continue;
        }
        let sample = backend.sample(gpu);
        agent.sampled(now, gpu, sample);
    }
}

/// Logs a limit found changed behind the agent's back (`then`: what the agent does about it).
fn log_mismatch(m: &crate::control::CapMismatch, mismatches: u64, then: &str) {
    warn!(
        gpu = m.gpu,
        expected_w = m.expected.0,
        found_w = m.found.0,
        mismatches,
        then,
        "GPU limit changed behind the agent's back"
    );
}

fn execute(
    actions: Vec<Action>,
    agent: &mut Agent,
    backend: &mut dyn GpuBackend,
    state_dir: &Path,
) {
    for action in actions {
        match action {
            Action::SetCap { gpu, cap } => {
                let job = agent.gpus.get(gpu as usize).and_then(|g| g.job.clone());
                match backend.set_cap(gpu, cap) {
                    Ok(found) => {
                        info!(
                            gpu,
                            cap_w = cap.0,
                            job = job.as_deref().unwrap_or("-"),
                            "cap applied"
                        );
                        if let Some(m) = agent.cap_written(gpu, cap, found) {
                            log_mismatch(
                                &m,
                                agent.cap_mismatches,
                                "found as a new cap was written",
                            );
                        }
                    }
                    Err(e) => {
                        warn!(gpu, cap_w = cap.0, error = %e, class = ?e.class, "cap not applied");
                        agent.cap_failed(&e);
                    }
                }
            }
            Action::Persist => save(state_dir, agent),
        }
    }
}

/// The agent as it starts: the GPUs found and read before anything is written, the
/// previous run's state reconciled with what runs now, the previous lease resumed, and
/// the state saved.
fn start_up(
    settings: AgentSettings,
    options: &RunOptions,
    backend: &mut dyn GpuBackend,
    clock: Instant,
) -> Result<Agent, AgentError> {
    let now = || clock.elapsed().as_secs_f64();
    let identities = backend.discover()?;
    let saved = match persist::load(&options.state_dir) {
        Ok(state) => state,
        Err(e) => {
            error!(error = %e, "persisted state unusable; starting from the GPUs' own defaults");
            None
        }
    };
    // No state file, or one set aside as corrupt: what this node managed is unknown.
    let state_lost = saved.is_none();
    let saved_lease = saved.as_ref().and_then(|s| s.lease.clone());
    let saved_defaults: BTreeMap<String, Watts> = saved
        .as_ref()
        .map(|s| s.saved_defaults.clone())
        .unwrap_or_default();
    let mut agent = Agent::new(settings, identities, &saved_defaults, now());
    agent.clock_origin_unix_s = unix_s() - now();
    agent.sample_interval_ms =
        u64::try_from(options.sample_interval.as_millis()).unwrap_or(u64::MAX);
    // Read every GPU's limit before anything is written: in controller mode it bounds
    // the caps until a current lease arrives (fail-static through a restart). These
    // readings also end the holds of jobs that ended while the agent was down.
    let first_read_at = now();
    for gpu in 0..agent.gpus.len() as u32 {
        let sample = backend.sample(gpu);
        agent.sampled(now(), gpu, sample);
    }
    info!(
        gpus = agent.gpus.len(),
        mode = if agent.settings.node_budget.is_some() {
            "standalone"
        } else {
            "controller"
        },
        "agent started"
    );

    // Reconcile after a crash or restart: jobs still running keep their GPUs; every
    // other GPU goes back to its saved default on the first tick. Whether a job still
    // runs is what the host's step daemons say (root's `slurmstepd [J.*]`), never a
    // process's own environment.
    let table = match crate::procs::ProcTable::read(Path::new("/proc")) {
        Ok(table) => Some(table),
        Err(e) => {
            warn!(error = %e, "cannot read /proc to tell running jobs from ended ones");
            None
        }
    };
    let live = table.as_ref().map(|t| t.live_jobs()).unwrap_or_default();
    let (saved_jobs, saved_finals) = saved
        .map(|s| (s.jobs, s.unacked_finals))
        .unwrap_or_default();
    // Final shares the controller had not acknowledged: re-sent from now on.
    agent.unacked = saved_finals;
    // GPUs running some job's processes now (by UUID): a job that ended while the agent
    // was down is not charged what they draw for another.
    let busy: std::collections::BTreeSet<String> = (0..agent.gpus.len() as u32)
        .filter(|&g| backend.running_pids(g).is_ok_and(|pids| !pids.is_empty()))
        .map(|g| agent.gpus[g as usize].identity.uuid.clone())
        .collect();
    agent.restore_saved_jobs(now(), first_read_at, saved_jobs, &live, &busy);
    if state_lost {
        adopt_from_slurm(&mut agent, backend, table.as_ref(), now());
    }
    // The previous run's lease, while it lasts, keeps the restored jobs at their caps;
    // once run out it still bounds the fail-safe (which never raises a job above its
    // last grant).
    if let Some(lease) = saved_lease {
        let left_s = lease.expires_unix_s - unix_s();
        info!(
            jobs = lease.caps.len(),
            left_s = left_s.max(0.0),
            "resuming the previous run's lease"
        );
        agent.restore_saved_lease(now(), lease.caps, left_s, lease.start_cap_w.map(Watts));
    }
    save(&options.state_dir, &agent);

    Ok(agent)
}

/// After a lost state file (missing, or set aside as corrupt): the jobs running on this
/// node's GPUs, taken back as managed under the tier Slurm records for them.
fn adopt_from_slurm(
    agent: &mut Agent,
    backend: &mut dyn GpuBackend,
    table: Option<&crate::procs::ProcTable>,
    now: f64,
) {
    // Jobs running on this node's GPUs that a lost (missing or corrupt) state file no
    // longer lists: take back those Slurm records as managed, under the tier it records
    // (the controller's AdminComment, admins' only), rather than release their caps. Never
    // on a normal restart (a job the saved state does not list was not managed: a `none`
    // job, or one whose registration failed), never under a tier Slurm does not record,
    // never from the job's environment. Which job a GPU's process belongs to comes from
    // its ancestry (`persist::running_jobs`).
    let node = agent.settings.node.clone();
    let gpu_pids: std::collections::BTreeMap<u32, Vec<u32>> = (0..agent.gpus.len() as u32)
        .filter_map(|g| backend.running_pids(g).ok().map(|pids| (g, pids)))
        .filter(|(_, pids)| !pids.is_empty())
        .collect();
    let running = table
        .map(|t| persist::running_jobs(t, &gpu_pids, persist::process_uid))
        .unwrap_or_default();
    // One read of Slurm's record per cluster, for every job to take back.
    let mut slurm_records: BTreeMap<
        Option<String>,
        Option<powerflex_core::slurm_record::SlurmJobs>,
    > = BTreeMap::new();
    for job in running {
        if agent.jobs.contains_key(&job.job_id) {
            continue;
        }
        let record = slurm_records
            .entry(job.cluster.clone())
            .or_insert_with(|| persist::slurm_jobs(&job.cluster, Duration::from_secs(5)));
        let recorded = record
            .as_ref()
            .and_then(|jobs| persist::recorded_tier(jobs, &job.job_id, &node))
            .filter(|t| parse_power_flex(t, &agent.settings.tiers).is_ok());
        let Some(tier) = recorded else {
            warn!(job_id = %job.job_id, gpus = ?job.gpus, "job running on this node's GPUs without a record, and Slurm records no powerflex tier for it here; not taken back (its GPUs keep the limit they read back)");
            continue;
        };
        match agent.register(
            now,
            &job.job_id,
            crate::control::ADOPTED_STEP,
            job.uid,
            &node,
            &job.gpus,
            &tier,
        ) {
            Ok(_) => {
                agent.set_job_cluster(&job.job_id, job.cluster.clone(), now);
                warn!(job_id = %job.job_id, gpus = ?job.gpus, tier, source = "Slurm's AdminComment", "job running on this node's GPUs without a record (state file lost); managing it again")
            }
            Err(e) => warn!(job_id = %job.job_id, error = %e, "cannot take back a running job"),
        }
    }
}

/// How often a degraded GPU is read to see whether it works again, seconds.
const DEGRADED_PROBE_S: f64 = 10.0;

/// Runs the agent until `shutdown` is set, then puts the GPUs without a running job back
/// to their defaults (see [`crate::control::Agent::stop_actions`]).
///
/// `reloads` brings re-read site configs (SIGHUP): see [`Agent::reload`]; a refused one
/// is logged and shown by `status` (`config_error`), and the settings in force stay.
pub fn run(
    settings: AgentSettings,
    options: RunOptions,
    mut backend: Box<dyn GpuBackend>,
    shutdown: Arc<AtomicBool>,
    reloads: Receiver<Result<AgentSettings, String>>,
) -> Result<(), AgentError> {
    let span = info_span!("powerflexd", node = %settings.node);
    let _enter = span.enter();
    let clock = Instant::now();
    let now = || clock.elapsed().as_secs_f64();

    // Before anything else touches the GPUs, the state or the sockets: a second agent
    // would unlink the first one's live sockets and fight it over the caps.
    let _instance = lock_instance(&options.state_dir)?;
    let mut agent = start_up(settings, &options, backend.as_mut(), clock)?;

    let snapshot: SnapshotCell = Arc::new(RwLock::new(Arc::new(agent.snapshot(now()))));
    let (tx, rx) = bounded::<Inbound>(1024);
    let (control_tx, mut control_rx) = bounded::<Inbound>(64);
    let edges = spawn_edges(&options, &agent, &snapshot, tx, control_tx, &shutdown)?;

    let ticker = tick(Duration::from_millis(50));
    let mut timers = Timers::default();
    let mut control_in_a_row = 0;
    while !shutdown.load(Ordering::SeqCst) {
        // Control requests (registrations, step and job ends) come first: slurmstepd
        // waits for each answer within the plugin's deadline, while progress, stamped
        // when it arrived, loses nothing by waiting a turn. A burst of steps may not
        // starve the samples, leases and progress, though: after a few in a row, one
        // turn of everything else.
        if control_in_a_row < MAX_CONTROL_IN_A_ROW {
            if let Ok(msg) = control_rx.try_recv() {
                control_in_a_row += 1;
                serve(
                    msg,
                    &mut agent,
                    backend.as_mut(),
                    &snapshot,
                    &options,
                    clock,
                );
                continue;
            }
        }
        control_in_a_row = 0;
        select! {
            recv(control_rx) -> msg => match msg {
                Ok(msg) => serve(msg, &mut agent, backend.as_mut(), &snapshot, &options, clock),
                Err(_) => control_rx = crossbeam_channel::never(),
            },
            recv(rx) -> msg => {
                let Ok(msg) = msg else { break };
                serve(msg, &mut agent, backend.as_mut(), &snapshot, &options, clock);
            }
            recv(reloads) -> reload => {
                if let Ok(reload) = reload {
                    match agent.reload(reload) {
                        Ok(()) => info!(
                            failsafe_cap_w = agent.settings.failsafe_cap.0,
                            lease_ttl_s = agent.settings.lease_ttl_s,
                            "site config reloaded"
                        ),
                        Err(e) => error!(error = %e, "site config reload refused; the settings in force stay"),
                    }
                    publish(&snapshot, &agent, now());
                }
            }
            recv(ticker) -> _ => {
                let t = now();
                if t >= timers.next_sample {
                    sample_tick(&mut agent, backend.as_mut(), &mut timers, t, &options, &snapshot);
                }
            }
        }
    }
    shut_down(&mut agent, backend.as_mut(), &options, &shutdown, edges);
    Ok(())
}

/// Stopping: the GPUs without a running job back to their defaults (every GPU with
/// `--release-on-exit`), the accounting and state saved, the edge threads woken and
/// joined, the sockets removed.
fn shut_down(
    agent: &mut Agent,
    backend: &mut dyn GpuBackend,
    options: &RunOptions,
    shutdown: &AtomicBool,
    edges: Edges,
) {
    let actions = agent.stop_actions(options.release_on_exit);
    if options.release_on_exit {
        info!("shutting down: restoring every GPU's default cap (--release-on-exit)");
    } else {
        info!(
            gpus_released = actions.len(),
            "shutting down: GPUs without a job back to their defaults; running jobs keep their caps for the next agent"
        );
    }
    execute(actions, agent, backend, &options.state_dir);
    record_usage(agent, &options.state_dir, options.usage_log);
    save(&options.state_dir, agent);
    shutdown.store(true, Ordering::SeqCst);
    // The accept threads block in accept(): a connection wakes each to see the shutdown.
    let _ = std::os::unix::net::UnixStream::connect(&options.control_socket);
    let _ = std::os::unix::net::UnixStream::connect(&options.progress_socket);
    for t in edges.threads {
        let _ = t.join();
    }
    if let Some(metrics) = edges.metrics {
        metrics.stop();
    }
    let _ = std::fs::remove_file(&options.control_socket);
    let _ = std::fs::remove_file(&options.progress_socket);
}

/// The threads around the control loop: the control and progress sockets, the
/// metrics listener and the controller link, each sending into the loop's channels.
struct Edges {
    threads: Vec<std::thread::JoinHandle<()>>,
    metrics: Option<powerflex_daemon::http::MetricsServer>,
}

fn spawn_edges(
    options: &RunOptions,
    agent: &Agent,
    snapshot: &SnapshotCell,
    tx: crossbeam_channel::Sender<Inbound>,
    control_tx: crossbeam_channel::Sender<Inbound>,
    shutdown: &Arc<AtomicBool>,
) -> Result<Edges, AgentError> {
    let stats = Arc::new(server::ServerStats::default());
    let control = bind_unix(&options.control_socket, "control socket")?;
    let progress = bind_unix(&options.progress_socket, "progress socket")?;
    let mut threads = vec![
        server::spawn_control(
            control,
            control_tx,
            snapshot.clone(),
            stats.clone(),
            Arc::clone(shutdown),
        )
        .map_err(|source| AgentError::Io {
            what: "thread for",
            path: options.control_socket.display().to_string(),
            source,
        })?,
        server::spawn_progress(progress, tx.clone(), stats.clone(), Arc::clone(shutdown)).map_err(
            |source| AgentError::Io {
                what: "thread for",
                path: options.progress_socket.display().to_string(),
                source,
            },
        )?,
    ];
    let mut metrics = None;
    if let Some(addr) = options.metrics_listen {
        let listener = TcpListener::bind(addr).map_err(|source| AgentError::Io {
            what: "metrics listener",
            path: addr.to_string(),
            source,
        })?;
        metrics = Some(crate::metrics::spawn(
            listener,
            snapshot.clone(),
            stats.clone(),
        )?);
    }
    if let Some(mut link) = options.link.clone() {
        link.gpus = agent
            .gpus
            .iter()
            .map(|g| powerflex_proto::link::GpuInfo {
                uuid: g.identity.uuid.clone(),
                name: g.identity.name.clone(),
                min_w: g.identity.min_cap.0,
                max_w: g.identity.max_cap.0,
                default_w: g.saved_default.0,
            })
            .collect();
        let addr = link.controller.to_string();
        threads.push(
            crate::link::spawn(link, snapshot.clone(), tx.clone(), Arc::clone(shutdown)).map_err(
                |source| AgentError::Io {
                    what: "thread for the controller link to",
                    path: addr,
                    source,
                },
            )?,
        );
    }
    Ok(Edges { threads, metrics })
}

/// When the control loop next samples the GPUs, probes the degraded ones, scans the
/// process table for ended jobs and saves the accounting, agent seconds.
#[derive(Debug)]
struct Timers {
    next_sample: f64,
    next_probe: f64,
    next_job_scan: f64,
    next_usage_save: f64,
}

impl Default for Timers {
    fn default() -> Timers {
        Timers {
            next_sample: 0.0,
            next_probe: DEGRADED_PROBE_S,
            next_job_scan: 0.0,
            next_usage_save: USAGE_SAVE_INTERVAL_S,
        }
    }
}

/// One sample period: the GPUs read (the degraded ones now and then), ended jobs and
/// GPU use found from the process table every few seconds, the machine's tick executed,
/// the accounting recorded and the status published.
fn sample_tick(
    agent: &mut Agent,
    backend: &mut dyn GpuBackend,
    timers: &mut Timers,
    t: f64,
    options: &RunOptions,
    snapshot: &SnapshotCell,
) {
    let started = Instant::now();
    timers.next_sample = t + options.sample_interval.as_secs_f64();
    // Degraded GPUs are probed now and then, not every sample: a GPU that
    // answers again (a fault cleared, a permission fixed) is managed again,
    // and its default restored when its job is gone.
    let probe = t >= timers.next_probe;
    if probe {
        timers.next_probe = t + DEGRADED_PROBE_S;
    }
    // Jobs whose end never reached the agent: their step daemons are gone.
    if t >= timers.next_job_scan {
        timers.next_job_scan = t + JOB_SCAN_INTERVAL_S;
        match crate::procs::ProcTable::read(Path::new("/proc")) {
            Ok(table) => {
                for job_id in agent.jobs_alive(t, &table.live_jobs()) {
                    warn!(job_id = %job_id, grace_s = agent.settings.job_end_grace_s, "the job's step daemons are gone and its end never arrived; ending it");
                }
                let used = gpu_use(backend, agent, &table);
                agent.nvml_processes_seen(t, &used.processes);
                for r in agent.check_gpu_use(t, &used.jobs) {
                    warn!(gpu = r.gpu, claimed_by = %r.claimed_by, used_by = ?r.used_by, "GPU claim refused: other jobs' processes use this GPU and the claimant's do not");
                }
            }
            Err(e) => warn!(error = %e, "cannot read /proc to find ended jobs"),
        }
    }
    for gpu in 0..agent.gpus.len() as u32 {
        let degraded = agent.gpus[gpu as usize].degraded.is_some();
        if degraded && !probe {
            continue;
        }
        let sample = backend.sample(gpu);
        match &sample {
            Err(e) if !degraded => {
                warn!(gpu, error = %e, class = ?e.class, "GPU reading failed")
            }
            Ok(_) if degraded => info!(gpu, "degraded GPU answers again; managing it"),
            _ => {}
        }
        if let Some(m) = agent.sampled(t, gpu, sample) {
            log_mismatch(&m, agent.cap_mismatches, "writing it again");
        }
    }
    let actions = agent.tick(t);
    execute(actions, agent, backend, &options.state_dir);
    record_usage(agent, &options.state_dir, options.usage_log);
    if t >= timers.next_usage_save && !agent.jobs.is_empty() {
        timers.next_usage_save = t + USAGE_SAVE_INTERVAL_S;
        save(&options.state_dir, agent);
    }
    publish(snapshot, agent, t);
    note_if_slow(started, "sample");
}

fn publish(cell: &SnapshotCell, agent: &Agent, now: f64) {
    let fresh = Arc::new(agent.snapshot(now));
    if let Ok(mut slot) = cell.write() {
        *slot = fresh;
    }
}

/// A control request from the plugin or the epilog (root), answered: a step's
/// registration, a step's or a job's end, a status ping.
fn handle_control(
    request: powerflex_proto::ControlRequest,
    peer: crate::server::Peer,
    agent: &mut Agent,
    backend: &mut dyn GpuBackend,
    now: f64,
    state_dir: &Path,
) -> ControlReply {
    match request.op {
        ControlOp::Register {
            job_id,
            step_id,
            uid,
            node,
            gpus,
            flex,
        } => register_step(
            agent,
            backend,
            now,
            state_dir,
            peer,
            Registration {
                job_id: &job_id,
                step_id: &step_id,
                uid,
                node: &node,
                gpus: &gpus,
                flex: &flex,
            },
        ),
        ControlOp::EndStep { job_id, step_id } => {
            if step_id == crate::control::BATCH_STEP_NAME {
                // The batch script's end makes the job's final share here
                // (see `Agent::end_step`): its energy is read up to now.
                sample_job_gpus(agent, backend, &job_id, now);
            }
            match agent.end_step(&job_id, &step_id, now) {
                Ok(ended_share) => {
                    info!(
                        job_id = %job_id,
                        step_id = %step_id,
                        job_ended = ended_share.is_some(),
                        "step ended"
                    );
                    save(state_dir, agent);
                    ControlReply {
                        ended_share,
                        ..ControlReply::ok()
                    }
                }
                Err(e) => ControlReply::error(e),
            }
        }
        ControlOp::EndJob { job_id } => {
            // The job's hold (and its energy) ends now.
            sample_job_gpus(agent, backend, &job_id, now);
            let known = agent.end_job(&job_id, now);
            info!(job_id = %job_id, known, "job ended; its GPUs return to default");
            save(state_dir, agent);
            ControlReply::ok()
        }
        ControlOp::Status => ControlReply::ok(),
    }
}

/// What a step's registration names.
struct Registration<'a> {
    job_id: &'a str,
    step_id: &'a str,
    uid: u32,
    node: &'a str,
    gpus: &'a [String],
    flex: &'a str,
}

/// A step registers (from its slurmstepd, root): the GPUs checked against what runs on
/// them, the job registered, its GPUs read (its hold starts now) and capped before the
/// answer, since slurmstepd starts the tasks after it.
fn register_step(
    agent: &mut Agent,
    backend: &mut dyn GpuBackend,
    now: f64,
    state_dir: &Path,
    peer: crate::server::Peer,
    step: Registration<'_>,
) -> ControlReply {
    let Registration {
        job_id,
        step_id,
        uid,
        node,
        gpus,
        flex,
    } = step;
    let span = info_span!("job", job_id = %job_id);
    let _e = span.enter();
    // The registering peer is the step's slurmstepd (root): its cluster
    // tells this job apart from same-numbered jobs of other clusters.
    let cluster = crate::procs::stepd_cluster(Path::new("/proc"), peer.pid);
    // A live step daemon registers: a job holding these GPUs with no step
    // daemon left has ended (its end lost), and Slurm moved its GPUs on.
    // The whole process table is read only then: it is most of a
    // registration's work, and slurmstepd waits for the answer.
    if cluster.is_some() && agent.gpus_held_by_others(job_id, gpus) {
        if let Ok(table) = crate::procs::ProcTable::read(Path::new("/proc")) {
            for ended in agent.hand_over_from_ended_jobs(now, job_id, gpus, &table.live_jobs()) {
                warn!(ended_job = %ended, step_id = %step_id, "a job holding these GPUs has no step daemon left (its end was lost); ended, its GPUs go to this job");
            }
        }
    }
    let in_use = gpus_used_by_others(backend, agent, gpus, job_id, &cluster);
    let outcome = match in_use {
        Some(refusal) => {
            agent.gpu_claims_refused += 1;
            warn!(step_id = %step_id, gpu = refusal.gpu, used_by = ?refusal.used_by, "GPU claim refused at registration: other jobs' processes run on it");
            Err(format!(
                "GPU {} runs processes of job {}: a step may register only the GPUs Slurm gave it",
                refusal.gpu,
                refusal.used_by.join(", ")
            ))
        }
        None => agent.register(now, job_id, step_id, uid, node, gpus, flex),
    };
    match outcome {
        Ok(r) => {
            if let Some(cluster) = cluster {
                agent.set_job_cluster(job_id, cluster, now);
            }
            info!(step_id = %step_id, uid, tier = %r.tier, gpus = ?gpus, pid = peer.pid, "step registered");
            // The job's hold of its GPUs (and its energy) starts now.
            sample_job_gpus(agent, backend, job_id, now);
            // Cap the job's GPUs before answering: slurmstepd starts the
            // tasks after this reply, so they never run above the cap
            // the job is granted (the fail-safe until the controller
            // has allocated it).
            let actions = agent.tick(now);
            execute(actions, agent, backend, state_dir);
            save(state_dir, agent);
            ControlReply {
                progress: r.progress,
                tier: Some(r.tier),
                ..ControlReply::ok()
            }
        }
        Err(e) => {
            warn!(step_id = %step_id, error = %e, "registration refused");
            ControlReply::error(e)
        }
    }
}

fn handle(
    msg: Inbound,
    agent: &mut Agent,
    backend: &mut dyn GpuBackend,
    now: f64,
    clock: Instant,
    state_dir: &Path,
) {
    match msg {
        Inbound::Control {
            request,
            peer,
            reply,
        } => {
            let answer = handle_control(request, peer, agent, backend, now, state_dir);
            let _ = reply.send(answer);
        }
        Inbound::Progress {
            report,
            peer,
            sender,
            received,
            verdict,
        } => {
            let at = received.saturating_duration_since(clock).as_secs_f64();
            let from = ReportSender {
                uid: peer.uid,
                pid: peer.pid,
                step_job: sender.job,
                cluster: sender.cluster,
            };
            let outcome = agent.report_progress(at, &from, &report);
            if let Err(e) = &outcome {
                warn!(job_id = %report.job_id, pid = peer.pid, uid = peer.uid, error = %e, "progress report refused");
            }
            let _ = verdict.send(outcome);
        }
        Inbound::Lease(lease) => {
            info!(
                jobs = lease.caps.len(),
                ttl_s = lease.ttl_s,
                start_cap_w = lease.start_cap.map(|w| w.0),
                "lease from the controller"
            );
            // Written now rather than at the next tick, and the written limits read
            // back: the controller holds other nodes' increases until this node's
            // decreases are confirmed, so the confirmation should not wait a period.
            let actions = agent.apply_lease(now, lease);
            let written: Vec<u32> = actions
                .iter()
                .filter_map(|a| match a {
                    Action::SetCap { gpu, .. } => Some(*gpu),
                    Action::Persist => None,
                })
                .collect();
            execute(actions, agent, backend, state_dir);
            for gpu in written {
                let sample = backend.sample(gpu);
                agent.sampled(now, gpu, sample);
            }
            // A restarted agent resumes this lease (see persist::PersistedLease).
            save(state_dir, agent);
        }
        Inbound::Acked { finals } => {
            let dropped = agent.acked(&finals);
            if dropped > 0 {
                info!(
                    acknowledged = dropped,
                    left = agent.unacked.len(),
                    "the controller recorded this node's final shares"
                );
                save(state_dir, agent);
            }
        }
        Inbound::ProgressRefused { reason, peer } => {
            agent.progress_refused();
            warn!(pid = peer.pid, uid = peer.uid, error = %reason, "progress report refused");
        }
    }
}
