//! `powerflex-ctld`: the site controller.
//!
//! The decisions are in [`core`], a pure state machine on a clock passed in; this module
//! is the I/O edge around it ([`run`]): it accepts agents on the [`link`] and admins on
//! the [`admin`] socket, ticks every allocation period, loads and saves the [`state`],
//! and carries out what the core answers — leases to agents, replies to admins,
//! [`annotate`] jobs in Slurm, [`metrics`] for Prometheus.
//!
//! - **Loop**: every `allocation_period_s`, the budget in force ([`crate::schedule`]) is
//!   split across every live node's jobs ([`crate::site`]) and each node gets its lease.
//! - **State** (budget override, events, next event id, known nodes) is saved atomically
//!   on change; after a restart the controller resumes its events, and agents keep the
//!   caps of their unexpired leases meanwhile — nobody goes over budget in between.

pub mod admin;
pub mod annotate;
pub mod core;
pub mod link;
pub mod metrics;
pub mod state;
pub mod status;

use std::collections::BTreeMap;
use std::net::TcpListener;
use std::os::unix::fs::PermissionsExt;
use std::os::unix::net::UnixListener;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use crossbeam_channel::{bounded, select, tick, Receiver, Sender};

use powerflex_core::Watts;
use powerflex_proto::admin::{AdminOp, AdminReply};
use powerflex_proto::link::{Body, Envelope, GpuInfo, JobReport};

pub use self::admin::request;
pub use self::core::{Core, Input, Lease, Output};
pub use self::state::CtldState;
use crate::site::SiteSettings;

/// Where the controller listens and keeps its state.
#[derive(Debug, Clone)]
pub struct CtldOptions {
    pub listen: std::net::SocketAddr,
    pub admin_socket: PathBuf,
    pub state_dir: PathBuf,
    pub key: Vec<u8>,
    pub base_budget: Watts,
    pub period: Duration,
    pub lease_ttl_s: f64,
    pub site: SiteSettings,
    /// Loopback address for Prometheus metrics, if any.
    pub metrics_listen: Option<std::net::SocketAddr>,
    /// How new allocations reach the nodes (decreases first, or all at once).
    pub lease_rollout: powerflex_core::config::LeaseRollout,
}

/// A re-read site config (on SIGHUP): the new options, or why the file was refused.
pub type Reload = Result<CtldOptions, String>;

pub(crate) fn unix_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

/// What the link and admin threads hand the loop.
pub(crate) enum Inbound {
    Hello {
        node: String,
        gpus: Vec<GpuInfo>,
        /// Lines to this agent's connection.
        writer: Sender<String>,
    },
    Report {
        node: String,
        jobs: Vec<JobReport>,
        power_w: f64,
    },
    Admin {
        op: AdminOp,
        uid: u32,
        reply: Sender<AdminReply>,
    },
}

/// Runs the controller until `shutdown`. `reloads` brings re-read site configs: a valid
/// one replaces the budget, policy, tiers and lease settings at once (the listen
/// addresses, sockets, state directory, key and period need a restart); a refused one
/// leaves the config in force and is reported by `status` until a valid one arrives.
pub fn run(
    options: CtldOptions,
    shutdown: Arc<AtomicBool>,
    reloads: Receiver<Reload>,
) -> Result<(), String> {
    let loaded = state::load(&options.state_dir);
    let mut core = Core::new(options.clone(), loaded, unix_ms());
    let (tx, rx) = bounded::<Inbound>(4096);
    let link = TcpListener::bind(options.listen)
        .map_err(|e| format!("cannot listen on {}: {e}", options.listen))?;
    link.set_nonblocking(true).map_err(|e| e.to_string())?;
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
    admin.set_nonblocking(true).map_err(|e| e.to_string())?;
    let acceptors = [
        link::spawn(link, tx.clone(), options.key.clone(), shutdown.clone()),
        admin::spawn(admin, tx.clone(), shutdown.clone()),
    ];
    drop(tx);

    let metrics_text: Arc<Mutex<String>> = Arc::new(Mutex::new(String::new()));
    if let Some(addr) = options.metrics_listen {
        let listener = TcpListener::bind(addr)
            .map_err(|e| format!("cannot listen on {addr} for metrics: {e}"))?;
        metrics::serve(listener, metrics_text.clone(), shutdown.clone());
    }
    let annotator = annotate::spawn_annotator();
    let mut writers: BTreeMap<String, Sender<String>> = BTreeMap::new();
    let mut seq = unix_ms();
    let ticker = tick(options.period);
    let check = tick(Duration::from_millis(100));
    // The first step allocates at once (or starts the hold after a restart).
    let mut inputs: Vec<Input> = Vec::new();
    let mut waiting: Vec<Option<Sender<AdminReply>>> = Vec::new();
    while !shutdown.load(Ordering::SeqCst) {
        let out = core.step(unix_ms(), std::mem::take(&mut inputs));
        if let Some(state) = &out.persist {
            state::save(&options.state_dir, state);
        }
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
            seq = seq.max(unix_ms()) + 1;
            let body = Body::Lease {
                node,
                caps: lease.caps,
                ttl_s: out.lease_ttl_s,
                start_cap_w: Some(lease.start_cap_w),
                recalibrate: lease.recalibrate,
            };
            if let Ok(e) = Envelope::seal(&options.key, "controller", seq, unix_ms(), body) {
                let _ = writer.try_send(e.to_line());
            }
        }
        for annotation in out.annotations {
            let _ = annotator.send(annotation);
        }
        if let Some(text) = out.metrics {
            *metrics_text.lock().unwrap_or_else(PoisonError::into_inner) = text;
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
                        Inbound::Report { node, jobs, power_w } => {
                            inputs.push(Input::Report { node, jobs, power_w });
                            waiting.push(None);
                        }
                        Inbound::Admin { op, uid, reply } => {
                            inputs.push(Input::Admin { op, uid });
                            waiting.push(Some(reply));
                        }
                    }
                }
            }
            recv(reloads) -> reload => {
                if let Ok(reload) = reload {
                    inputs.push(Input::Reload(reload));
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
    for t in acceptors {
        let _ = t.join();
    }
    let _ = std::fs::remove_file(&options.admin_socket);
    Ok(())
}
