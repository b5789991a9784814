//! The threads and sockets around the loop: the agent link, the admin socket, the
//! metrics server, Slurm's placement reader and the `scontrol` runners. Started together
//! before the loop's first step, stopped together after its last.

use std::net::{SocketAddr, TcpListener};
use std::os::unix::fs::PermissionsExt;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::thread::JoinHandle;
use std::time::Duration;

use crossbeam_channel::{bounded, Sender};

use powerflex_controller_machine::controller::history::HistoryBoard;
use powerflex_controller_machine::controller::metrics::MetricsSnapshot;
use powerflex_daemon::http::{HttpOptions, MetricsServer};

use super::bounds::Refusals;
use super::{admin, agent_link, metrics_text, scontrol, unix_ms, Bounds, CtldOptions, Inbound};
use powerflex_controller_machine::preempt::Action;

/// What the loop hands on to the threads, and what it stops at the end.
pub(super) struct Services {
    /// Where to connect to wake the link's blocked accept at shutdown.
    link_wake: SocketAddr,
    admin_socket: PathBuf,
    link_acceptor: JoinHandle<()>,
    admin_acceptor: JoinHandle<()>,
    metrics_server: Option<MetricsServer>,
    /// The text the metrics server answers with, replaced after each allocation.
    metrics_text: Arc<Mutex<String>>,
    /// Asks Slurm's placement reader for a read now (`None`: placement from reports).
    placement_refresh: Option<Sender<()>>,
    /// A job's new `AdminComment`: (job id, text), with the epoch that decided it.
    annotator: Sender<scontrol::Decided<(String, String)>>,
    preemptor: Sender<scontrol::Decided<Action>>,
}

impl Services {
    /// Binds every listener and starts every thread; each hands what it receives to the
    /// loop on `to_loop`. The link passes agents on to another controller while
    /// `steering` is false.
    pub(super) fn start(
        options: &CtldOptions,
        limits: Bounds,
        to_loop: Sender<Inbound>,
        history: HistoryBoard,
        shutdown: Arc<AtomicBool>,
        steering: Arc<AtomicBool>,
        slurm_gate: scontrol::SlurmGate,
    ) -> Result<Services, String> {
        let refusals = Arc::new(Refusals::default());
        let link = TcpListener::bind(options.listen)
            .map_err(|e| format!("cannot listen on {}: {e}", options.listen))?;
        let link_wake = wake_address(&link, options.listen)?;
        let admin_listener = bind_admin_socket(&options.admin_socket)?;
        let metrics_text: Arc<Mutex<String>> = Arc::new(Mutex::new(String::new()));
        let metrics_server = match options.metrics_listen {
            None => None,
            Some(addr) => Some(serve_metrics(addr, metrics_text.clone(), refusals.clone())?),
        };
        let link_acceptor = agent_link::spawn(
            link,
            to_loop.clone(),
            options.key.clone(),
            limits.link,
            refusals.clone(),
            shutdown.clone(),
            steering,
        )
        .map_err(|e| format!("cannot start the agent link: {e}"))?;
        let admin_acceptor = admin::spawn(
            admin_listener,
            to_loop.clone(),
            history,
            limits.admin,
            refusals,
            shutdown,
        )
        .map_err(|e| format!("cannot start the admin socket acceptor: {e}"))?;
        let placement_refresh = match options.settings.job_placement {
            powerflex_core::config::JobPlacement::Slurm => Some(
                spawn_placement_reader(to_loop, options.slurm_poll, options.slurm_timeout)
                    .map_err(|e| format!("cannot start the Slurm placement reader: {e}"))?,
            ),
            powerflex_core::config::JobPlacement::Reports => None,
        };
        Ok(Services {
            link_wake,
            admin_socket: options.admin_socket.clone(),
            link_acceptor,
            admin_acceptor,
            metrics_server,
            metrics_text,
            placement_refresh,
            annotator: scontrol::spawn_annotator(slurm_gate.clone()),
            preemptor: scontrol::spawn_preemptor(slurm_gate),
        })
    }

    /// The metrics the server answers with from now on.
    pub(super) fn show_metrics(&self, snapshot: &MetricsSnapshot) {
        let text = metrics_text::render(snapshot);
        *self
            .metrics_text
            .lock()
            .unwrap_or_else(PoisonError::into_inner) = text;
    }

    /// Asks for a read of Slurm's placement now (when placement comes from Slurm).
    pub(super) fn refresh_placement(&self) {
        if let Some(refresh) = &self.placement_refresh {
            let _ = refresh.try_send(());
        }
    }

    /// Queues an `AdminComment` decided under leadership `epoch`.
    pub(super) fn annotate(&self, epoch: u64, annotation: (String, String)) {
        let _ = self.annotator.send(scontrol::Decided {
            epoch,
            what: annotation,
        });
    }

    /// Queues a suspension, resumption, requeue or release decided under `epoch`.
    pub(super) fn preempt(&self, epoch: u64, action: Action) {
        let _ = self.preemptor.send(scontrol::Decided {
            epoch,
            what: action,
        });
    }

    /// Stops the acceptors (they block in accept(): a connection to each wakes it to see
    /// `shutdown`, which the caller has set) and the metrics server, and removes the
    /// admin socket. The placement reader and the `scontrol` runners end when their
    /// channels close.
    pub(super) fn stop(self) {
        let _ = std::net::TcpStream::connect_timeout(&self.link_wake, Duration::from_secs(1));
        let _ = UnixStream::connect(&self.admin_socket);
        for t in [self.link_acceptor, self.admin_acceptor] {
            let _ = t.join();
        }
        if let Some(server) = self.metrics_server {
            server.stop();
        }
        let _ = std::fs::remove_file(&self.admin_socket);
    }
}

/// Where to connect to wake the link's blocked accept at shutdown: the bound address,
/// with a wildcard one replaced by loopback.
fn wake_address(link: &TcpListener, listen: SocketAddr) -> Result<SocketAddr, String> {
    let mut wake = link
        .local_addr()
        .map_err(|e| format!("cannot read the address of {listen}: {e}"))?;
    if wake.ip().is_unspecified() {
        wake.set_ip(match wake {
            SocketAddr::V4(_) => std::net::Ipv4Addr::LOCALHOST.into(),
            SocketAddr::V6(_) => std::net::Ipv6Addr::LOCALHOST.into(),
        });
    }
    Ok(wake)
}

/// The admin socket, open to every local user: the admin threads tell root from the
/// others by the peer's credentials, not by the socket's mode.
fn bind_admin_socket(path: &std::path::Path) -> Result<UnixListener, String> {
    if let Some(parent) = path.parent() {
        std::fs::create_dir_all(parent).map_err(|e| format!("{}: {e}", parent.display()))?;
    }
    let _ = std::fs::remove_file(path);
    let admin =
        UnixListener::bind(path).map_err(|e| format!("cannot bind {}: {e}", path.display()))?;
    let _ = std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o666));
    Ok(admin)
}

/// The metrics server on `addr`: the loop's latest text, then the refusal counters.
fn serve_metrics(
    addr: SocketAddr,
    text: Arc<Mutex<String>>,
    refusals: Arc<Refusals>,
) -> Result<MetricsServer, String> {
    let listener =
        TcpListener::bind(addr).map_err(|e| format!("cannot listen on {addr} for metrics: {e}"))?;
    let bad_requests = Arc::new(AtomicU64::new(0));
    let bad = bad_requests.clone();
    MetricsServer::spawn_counted(listener, HttpOptions::default(), bad_requests, move || {
        let mut out = text.lock().unwrap_or_else(PoisonError::into_inner).clone();
        out.push_str(&refusals.render(&[("metrics_bad_request", bad.load(Ordering::Relaxed))]));
        out
    })
    .map_err(|e| format!("cannot serve metrics on {addr}: {e}"))
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
            let read = || -> Result<powerflex_controller_machine::placement::Placement, String> {
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
                Ok(powerflex_controller_machine::placement::Placement {
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
