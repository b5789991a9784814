//! The agent's I/O edge: binds the sockets and runs the control loop. Every decision is
//! the machine's ([`Agent::step`]); the loop reads what a step needs (GPUs, `/proc`,
//! Slurm's record at a start after a lost state file), builds its inputs, and executes
//! its outputs: cap writes, read-backs, the state saved, the usage log appended, replies
//! sent, the status published.
//!
//! Threads: one acceptor per socket (plus a short-lived thread per connection), the
//! metrics server, and the control loop, which `select!`s over inbound requests and a
//! tick; crossbeam channels between them, no async runtime. Time comes from the
//! injected [`Clock`] (`RunOptions::clock`), never from the loop itself.

use std::collections::{BTreeMap, BTreeSet};
use std::net::TcpListener;
use std::os::unix::fs::PermissionsExt;
use std::os::unix::net::UnixListener;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, RwLock};
use std::time::{Duration, Instant};

use crossbeam_channel::{bounded, select, tick, Receiver, Sender};
use powerflex_agent_machine::MachineError;
use powerflex_daemon::clock::{Clock, UnixMs};
use powerflex_daemon::os::FileLock;
use powerflex_proto::ControlReply;
use tracing::{error, info, info_span, warn};

use crate::backend::GpuBackend;
use crate::persist;
use crate::procs::ProcTable;
use crate::server::{self, Inbound, SnapshotCell};
use powerflex_agent_machine::control::{
    AdoptionCandidate, Agent, AgentInput, AgentOutput, AgentSettings, CapWriteResult, ControlFacts,
    GpuProcesses, GpuReading, Reply, ReportSender, StartFacts, TickReads,
};

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
    pub link: Option<crate::controller_link::LinkOptions>,
    /// On exit, every GPU back to its default, the GPUs of running jobs too
    /// (decommissioning a node). Off: running jobs keep their caps (fail-static).
    pub release_on_exit: bool,
    /// Append each job's final share here to `<state_dir>/usage.jsonl`.
    pub usage_log: bool,
    /// Where the loop reads `now` for the machine: `SteadyClock` in `powerflexd` (a
    /// lease must not expire or stretch with an NTP step).
    pub clock: Arc<dyn Clock>,
}

/// The node's log of jobs' final shares, inside the state directory.
pub const USAGE_LOG_FILE: &str = "usage.jsonl";

/// Why the agent could not start or stopped with an error.
#[derive(Debug, thiserror::Error)]
pub enum AgentError {
    #[error("{0}")]
    Gpu(#[from] powerflex_agent_machine::gpu::GpuError),
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

/// Where `/proc` is: the process table tells jobs apart by their step daemons.
fn proc_root() -> &'static Path {
    Path::new("/proc")
}

/// The jobs whose step daemons the host shows now, or `None` (logged) when the process
/// table cannot be read.
fn read_process_table(why: &str) -> Option<ProcTable> {
    match ProcTable::read(proc_root()) {
        Ok(table) => Some(table),
        Err(e) => {
            warn!(error = %e, why, "cannot read /proc");
            None
        }
    }
}

/// What NVML lists on `gpus`, each process mapped to its job by its ancestry in
/// `table`. GPUs whose list NVML cannot give are left out.
fn gpu_processes(backend: &mut dyn GpuBackend, gpus: &[u32], table: &ProcTable) -> GpuProcesses {
    let mut found = GpuProcesses::default();
    for &gpu in gpus {
        let Ok(pids) = backend.running_pids(gpu) else {
            continue;
        };
        let mut jobs = BTreeSet::new();
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

fn read_gpus(backend: &mut dyn GpuBackend, gpus: &[u32]) -> Vec<GpuReading> {
    gpus.iter().map(|&g| (g, backend.sample(g))).collect()
}

/// Whether the last state save failed. A full or read-only `/var` fails every save (each
/// change and every usage interval): logged once when saves start failing, and once when
/// they work again, rather than at each one. One agent per process.
static SAVES_FAILING: AtomicBool = AtomicBool::new(false);

fn save(state_dir: &Path, state: &powerflex_agent_machine::saved::PersistedState) {
    match persist::save(state_dir, state) {
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

/// Appends jobs' final shares to the node's usage log.
fn append_records(state_dir: &Path, records: &[powerflex_proto::usage::NodeUsage]) {
    let log = powerflex_daemon::fsx::JsonLines::new(state_dir.join(USAGE_LOG_FILE));
    for share in records {
        match serde_json::to_string(share) {
            Ok(line) => {
                if let Err(e) = log.append(&line) {
                    error!(job_id = %share.job_id, error = %e, "cannot append to the usage log");
                }
            }
            Err(e) => error!(job_id = %share.job_id, error = %e, "cannot encode a job's share"),
        }
    }
}

/// Who waits for the answer to an input.
enum Responder {
    Control(Sender<ControlReply>),
    Progress(Sender<Result<(), String>>),
    Lease(Sender<Result<(), powerflex_agent_machine::control::LeaseRefused>>),
}

impl Responder {
    fn send(self, reply: Reply) {
        match (self, reply) {
            (Responder::Control(tx), Reply::Control(r)) => {
                let _ = tx.send(*r);
            }
            (Responder::Progress(tx), Reply::Progress(r)) => {
                // The reporter is told why in the machine's words.
                let _ = tx.send(r.map_err(|e| e.to_string()));
            }
            (Responder::Lease(tx), Reply::Lease(r)) => {
                let _ = tx.send(r);
            }
            (_, reply) => error!(
                ?reply,
                "the machine answered an input with the wrong kind of reply"
            ),
        }
    }
}

/// The control loop's state: the machine and what its outputs are executed on.
struct Edge<'a> {
    agent: Agent,
    backend: &'a mut dyn GpuBackend,
    options: &'a RunOptions,
    snapshot: SnapshotCell,
}

impl Edge<'_> {
    fn now(&self) -> UnixMs {
        self.options.clock.now()
    }

    /// Steps the machine on `inputs` and executes what it asks, in its order; cap
    /// writes and read-backs go back to it in a follow-up step. `responders[i]` waits
    /// for the answer to `inputs[i]`.
    fn drive(&mut self, inputs: Vec<AgentInput>, mut responders: Vec<Option<Responder>>) {
        let mut inputs = inputs;
        loop {
            let now = self.now();
            let out = self.agent.step(now, inputs);
            let follow_up = self.write_and_read_back(&out);
            self.finish(out, &mut responders);
            if follow_up.is_empty() {
                return;
            }
            inputs = follow_up;
            responders = Vec::new();
        }
    }

    /// An output's cap writes, then its read-backs; their results as the inputs of the
    /// follow-up step.
    fn write_and_read_back(&mut self, out: &AgentOutput) -> Vec<AgentInput> {
        let mut follow_up = Vec::new();
        if !out.cap_writes.is_empty() {
            let results = out
                .cap_writes
                .iter()
                .map(|w| CapWriteResult {
                    gpu: w.gpu,
                    cap: w.cap,
                    outcome: self.backend.set_cap(w.gpu, w.cap),
                })
                .collect();
            follow_up.push(AgentInput::CapWrites(results));
        }
        if !out.read_back.is_empty() {
            follow_up.push(AgentInput::GpuSamples(read_gpus(
                self.backend,
                &out.read_back,
            )));
        }
        follow_up
    }

    /// The rest of an output, after its writes: the state saved, the records appended,
    /// the replies sent, the status published.
    fn finish(&mut self, out: AgentOutput, responders: &mut [Option<Responder>]) {
        if let Some(state) = &out.persist {
            save(&self.options.state_dir, state);
        }
        if self.options.usage_log && !out.records.is_empty() {
            append_records(&self.options.state_dir, &out.records);
        }
        for (index, reply) in out.replies {
            if let Some(responder) = responders.get_mut(index).and_then(Option::take) {
                responder.send(reply);
            }
        }
        if let Some(status) = out.snapshot {
            if let Ok(mut slot) = self.snapshot.write() {
                *slot = Arc::new(status);
            }
        }
    }

    /// Handles one message from the sockets or the controller link.
    fn serve(&mut self, msg: Inbound) {
        let started = Instant::now();
        let what = inbound_kind(&msg);
        let (input, responder) = match msg {
            Inbound::Control {
                request,
                peer,
                reply,
            } => {
                let facts = self.control_facts(&request.op, peer.pid);
                (
                    AgentInput::Control {
                        op: request.op,
                        facts,
                    },
                    Responder::Control(reply),
                )
            }
            Inbound::Progress {
                report,
                peer,
                sender,
                received,
                verdict,
            } => (
                AgentInput::Progress {
                    received: self.arrived_at(received),
                    sender: ReportSender {
                        uid: peer.uid,
                        pid: peer.pid,
                        step_job: sender.job,
                        cluster: sender.cluster,
                    },
                    report,
                },
                Responder::Progress(verdict),
            ),
            Inbound::ProgressRefused { reason, peer } => {
                let input = AgentInput::ProgressRefused {
                    reason,
                    uid: peer.uid,
                    pid: peer.pid,
                };
                self.drive(vec![input], Vec::new());
                return note_if_slow(started, what);
            }
            Inbound::Lease {
                lease,
                walk_to,
                verdict,
            } => {
                if !walk_to.is_empty() {
                    self.drive(vec![AgentInput::PrePosition(walk_to)], Vec::new());
                }
                (AgentInput::Lease(lease), Responder::Lease(verdict))
            }
            Inbound::Acked { finals } => {
                self.drive(vec![AgentInput::Acked(finals)], Vec::new());
                return note_if_slow(started, what);
            }
        };
        self.drive(vec![input], vec![Some(responder)]);
        note_if_slow(started, what);
    }

    /// When a report stamped `received` by the progress socket arrived, on the clock
    /// the machine runs on.
    fn arrived_at(&self, received: Instant) -> UnixMs {
        let waited_ms = u64::try_from(received.elapsed().as_millis()).unwrap_or(u64::MAX);
        UnixMs(self.now().ms().saturating_sub(waited_ms))
    }

    /// Reads what the machine needs to decide a control request from `peer_pid`.
    fn control_facts(&mut self, op: &powerflex_proto::ControlOp, peer_pid: u32) -> ControlFacts {
        // The registering peer is the step's slurmstepd (root) when it is one.
        let stepd_cluster = crate::procs::stepd_cluster(proc_root(), peer_pid);
        let reads = self.agent.control_reads(op, stepd_cluster.is_some());
        let jobs_on_host = reads
            .process_table
            .then(|| ProcTable::read(proc_root()).ok())
            .flatten()
            .map(|t| t.live_jobs());
        let mut gpu_users = BTreeMap::new();
        for &gpu in &reads.gpu_users {
            let Ok(pids) = self.backend.running_pids(gpu) else {
                continue;
            };
            let users: BTreeSet<powerflex_agent_machine::JobKey> = pids
                .into_iter()
                .filter_map(|pid| crate::procs::step_of_pid(proc_root(), pid))
                .map(|s| s.job_key())
                .collect();
            gpu_users.insert(gpu, users);
        }
        ControlFacts {
            stepd_cluster,
            peer_pid,
            jobs_on_host,
            gpu_users,
            samples: read_gpus(self.backend, &reads.samples),
        }
    }

    /// One sample period, when one is due: what the machine asks read (the GPUs, and
    /// every few seconds the process table and NVML's processes), then its tick.
    fn sample_if_due(&mut self) {
        let Some(reads) = self.agent.reads_due(self.now()) else {
            return;
        };
        let started = Instant::now();
        let TickReads {
            gpus,
            process_table,
            gpu_processes: listed,
        } = reads;
        let mut inputs = Vec::new();
        if process_table {
            if let Some(table) = read_process_table("to find ended jobs") {
                inputs.push(AgentInput::JobsOnHost(table.live_jobs()));
                inputs.push(AgentInput::GpuProcesses(gpu_processes(
                    self.backend,
                    &listed,
                    &table,
                )));
            }
        }
        inputs.push(AgentInput::GpuSamples(read_gpus(self.backend, &gpus)));
        inputs.push(AgentInput::Tick);
        self.drive(inputs, Vec::new());
        note_if_slow(started, "sample");
    }
}

/// What the agent reads as it starts, for the machine's first step: the previous run's
/// state, every GPU read before anything is written, the host's jobs and, after a lost
/// state file, the running jobs Slurm records a tier for.
fn start_facts(agent: &Agent, options: &RunOptions, backend: &mut dyn GpuBackend) -> StartFacts {
    let saved = match persist::load(&options.state_dir) {
        Ok(state) => state,
        Err(e) => {
            error!(error = %e, "persisted state unusable; starting from the GPUs' own defaults");
            None
        }
    };
    let gpus: Vec<u32> = (0..agent.gpu_count() as u32).collect();
    let samples = read_gpus(backend, &gpus);
    let table = read_process_table("to tell running jobs from ended ones");
    let gpu_pids: BTreeMap<u32, Vec<u32>> = gpus
        .iter()
        .filter_map(|&g| backend.running_pids(g).ok().map(|pids| (g, pids)))
        .filter(|(_, pids)| !pids.is_empty())
        .collect();
    let adoptable = match (&saved, &table) {
        (None, Some(table)) => adoption_candidates(agent.node(), table, &gpu_pids),
        _ => Vec::new(),
    };
    StartFacts {
        samples,
        jobs_on_host: table.as_ref().map(ProcTable::live_jobs),
        busy_gpus: gpu_pids.keys().copied().collect(),
        adoptable,
        saved,
    }
}

/// The jobs running on this node's GPUs (which job a GPU's process belongs to comes
/// from its ancestry, see `persist::running_jobs`), each with the tier Slurm records for
/// it here: one read of Slurm's record per cluster.
fn adoption_candidates(
    node: &str,
    table: &ProcTable,
    gpu_pids: &BTreeMap<u32, Vec<u32>>,
) -> Vec<AdoptionCandidate> {
    let mut slurm_records: BTreeMap<
        Option<String>,
        Option<powerflex_core::slurm_record::SlurmJobs>,
    > = BTreeMap::new();
    persist::running_jobs(table, gpu_pids, persist::process_uid)
        .into_iter()
        .map(|job| {
            let record = slurm_records
                .entry(job.cluster.clone())
                .or_insert_with(|| persist::slurm_jobs(&job.cluster, Duration::from_secs(5)));
            let recorded_tier = record.as_ref().and_then(|jobs| {
                powerflex_core::slurm_record::recorded_tier(jobs, &job.job_id, node)
            });
            AdoptionCandidate {
                job_id: job.job_id,
                cluster: job.cluster,
                uid: job.uid,
                gpus: job.gpus,
                recorded_tier,
            }
        })
        .collect()
}

/// Runs the agent until `shutdown` is set, then leaves every GPU at the limit in force
/// (see [`AgentInput::Stop`]).
///
/// `reloads` brings re-read site configs (SIGHUP); a refused one is logged and shown by
/// `status` (`config_error`), and the settings in force stay.
pub fn run(
    settings: AgentSettings,
    options: RunOptions,
    mut backend: Box<dyn GpuBackend>,
    shutdown: Arc<AtomicBool>,
    reloads: Receiver<Result<AgentSettings, String>>,
) -> Result<(), AgentError> {
    let span = info_span!("powerflexd", node = %settings.node);
    let _enter = span.enter();

    // Before anything else touches the GPUs, the state or the sockets: a second agent
    // would unlink the first one's live sockets and fight it over the caps.
    let _instance = lock_instance(&options.state_dir)?;
    let identities = backend.discover()?;
    let sample_interval_ms = u64::try_from(options.sample_interval.as_millis()).unwrap_or(u64::MAX);
    let mut agent = Agent::new(
        settings,
        identities,
        sample_interval_ms,
        options.clock.now(),
    );
    let facts = start_facts(&agent, &options, backend.as_mut());
    let started = agent.step(
        options.clock.now(),
        vec![AgentInput::Start(Box::new(facts))],
    );
    let Some(first_status) = started.snapshot.clone() else {
        unreachable!("the machine publishes its status at its start");
    };
    let snapshot: SnapshotCell = Arc::new(RwLock::new(Arc::new(first_status)));
    let mut edge = Edge {
        agent,
        backend: backend.as_mut(),
        options: &options,
        snapshot: snapshot.clone(),
    };
    let follow_up = edge.write_and_read_back(&started);
    edge.finish(started, &mut []);
    if !follow_up.is_empty() {
        edge.drive(follow_up, Vec::new());
    }

    let (tx, rx) = bounded::<Inbound>(1024);
    let (control_tx, mut control_rx) = bounded::<Inbound>(64);
    let edges = spawn_edges(&options, &edge.agent, &snapshot, tx, control_tx, &shutdown)?;

    let ticker = tick(Duration::from_millis(50));
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
                edge.serve(msg);
                continue;
            }
        }
        control_in_a_row = 0;
        select! {
            recv(control_rx) -> msg => match msg {
                Ok(msg) => edge.serve(msg),
                Err(_) => control_rx = crossbeam_channel::never(),
            },
            recv(rx) -> msg => {
                let Ok(msg) = msg else { break };
                edge.serve(msg);
            }
            recv(reloads) -> reload => {
                if let Ok(reload) = reload {
                    let reload = reload.map_err(MachineError::SiteConfig);
                    edge.drive(vec![AgentInput::Reload(reload)], Vec::new());
                }
            }
            recv(ticker) -> _ => edge.sample_if_due(),
        }
    }
    shut_down(&mut edge, &shutdown, edges);
    Ok(())
}

/// Stopping: every GPU left at the limit in force (back to its default only with
/// `--release-on-exit`), the accounting and state saved, the edge threads woken and
/// joined, the sockets removed.
fn shut_down(edge: &mut Edge<'_>, shutdown: &AtomicBool, edges: Edges) {
    let release_jobs = edge.options.release_on_exit;
    edge.drive(vec![AgentInput::Stop { release_jobs }], Vec::new());
    let options = edge.options;
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
        link.gpus = agent.gpu_infos();
        let addr = link
            .controllers
            .iter()
            .map(ToString::to_string)
            .collect::<Vec<_>>()
            .join(", ");
        threads.push(
            crate::controller_link::spawn(link, snapshot.clone(), tx.clone(), Arc::clone(shutdown))
                .map_err(|source| AgentError::Io {
                    what: "thread for the controller link to",
                    path: addr,
                    source,
                })?,
        );
    }
    Ok(Edges { threads, metrics })
}
