//! `powerflex-ctld`: the site controller's I/O edge.
//!
//! - **Agent link** (TCP, `controller.listen`): each connection says hello, then reports;
//!   every message must carry a valid HMAC under the site key with a rising sequence
//!   number per node (`powerflex_proto::link`). Leases go back every allocation period.
//! - **Admin socket** (Unix, `controller.admin_socket`): `powerflexctl` reads status
//!   (anyone) and changes the budget and grid events (root only, `SO_PEERCRED`).
//! - **Loop**: every `allocation_period_s`, the budget in force ([`crate::schedule`]) is
//!   split across every live node's jobs ([`crate::site`]) and each node gets its lease.
//! - **State** (budget override, events, next event id) is saved atomically on change;
//!   after a restart the controller resumes its events, and agents keep the caps of their
//!   unexpired leases meanwhile — nobody goes over budget in between.

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::os::unix::fs::PermissionsExt;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use crossbeam_channel::{bounded, select, tick, unbounded, Receiver, Sender};
use serde::{Deserialize, Serialize};
use tracing::{error, info, warn};

use powerflex_core::allocate::Policy;
use powerflex_core::Watts;
use powerflex_proto::link::{Body, Envelope, GpuInfo, JobReport, MAX_LINK_LINE_BYTES};

use crate::schedule::{active_event, effective_budget, Cut, Event};
use crate::site::{decide, Decision, NodeView, SiteSettings};

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
}

/// One allocation period, for `powerflexctl plot`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Sample {
    pub t_ms: u64,
    pub budget_w: f64,
    pub draw_w: f64,
    /// Job → per-GPU cap, W.
    pub caps: BTreeMap<String, f64>,
    /// Any live node's GPUs are simulated (their NVML names say so).
    #[serde(default)]
    pub simulated: bool,
}

/// Samples kept: an hour at a 1 s period, a day at the default 10 s... within memory.
const HISTORY: usize = 8640;

fn unix_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

/// What survives a restart.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CtldState {
    /// Budget set with `powerflexctl budget set`, overriding the site config's.
    pub budget_w: Option<Watts>,
    pub events: Vec<Event>,
    pub next_event_id: u64,
    /// Every node that has connected, with its GPUs. After a restart the controller
    /// waits for these (up to half a lease) before allocating: allocating with only the
    /// first agents to reconnect would hand them the others' watts while the others'
    /// old leases still hold their caps, and the site would go over budget.
    #[serde(default)]
    pub nodes: BTreeMap<String, Vec<GpuInfo>>,
}

const STATE_FILE: &str = "ctld-state.json";
/// The state before the last save: what a restart falls back on when the file is corrupt.
const PREVIOUS_STATE_FILE: &str = "ctld-state.prev.json";

fn read_state(path: &Path) -> Option<Result<CtldState, serde_json::Error>> {
    std::fs::read(path)
        .ok()
        .map(|bytes| serde_json::from_slice(&bytes))
}

/// The persisted state, and whether it was lost (corrupt, with no usable previous copy):
/// then the nodes and events it held are unknown.
fn load_state(dir: &Path) -> (CtldState, bool) {
    let path = dir.join(STATE_FILE);
    let previous = dir.join(PREVIOUS_STATE_FILE);
    match read_state(&path) {
        Some(Ok(state)) => return (state, false),
        None if !previous.exists() => return (CtldState::default(), false),
        None => {}
        Some(Err(e)) => {
            let moved = path.with_extension("json.corrupt");
            let _ = std::fs::rename(&path, &moved);
            error!(path = %path.display(), error = %e, moved = %moved.display(), "controller state corrupt");
        }
    }
    match read_state(&previous) {
        Some(Ok(state)) => {
            warn!(path = %previous.display(), "using the state saved before the last change; the last admin change may be missing");
            (state, false)
        }
        _ => {
            error!("no usable controller state: the grid events and nodes it held are lost; re-add the events (powerflexctl event list shows what is known)");
            (CtldState::default(), true)
        }
    }
}

fn save_state(dir: &Path, state: &CtldState) {
    let write = || -> std::io::Result<()> {
        std::fs::create_dir_all(dir)?;
        let tmp = dir.join(format!("{STATE_FILE}.tmp"));
        let mut f = std::fs::File::create(&tmp)?;
        f.write_all(&serde_json::to_vec_pretty(state).unwrap_or_default())?;
        f.sync_all()?;
        // Keep the state being replaced: the file in place is never missing, and a
        // restart that finds it corrupt falls back on the one before.
        let current = dir.join(STATE_FILE);
        if current.exists() {
            let previous = dir.join(PREVIOUS_STATE_FILE);
            let _ = std::fs::remove_file(&previous);
            std::fs::hard_link(&current, &previous)?;
        }
        std::fs::rename(&tmp, current)
    };
    if let Err(e) = write() {
        error!(error = %e, "cannot persist controller state");
    }
}

/// An admin request (one JSON line on the admin socket).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "kebab-case", deny_unknown_fields)]
pub enum AdminOp {
    Status,
    /// The recent budget, draw and caps, one sample per allocation period.
    History,
    BudgetSet {
        budget_w: f64,
    },
    EventAdd {
        cut: Cut,
        start_ms: u64,
        duration_ms: u64,
        ramp_ms: u64,
    },
    EventCancel {
        id: u64,
    },
    /// What `policy` would decide now, on the same curves and views as the controller's
    /// own allocation, at `budget_w` (default: the budget in force). Read-only.
    WhatIf {
        policy: String,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        budget_w: Option<f64>,
    },
}

impl AdminOp {
    /// Whether the request changes the controller's state (root only, and the
    /// allocation runs again at once).
    pub fn changes_state(&self) -> bool {
        !matches!(
            self,
            AdminOp::Status | AdminOp::History | AdminOp::WhatIf { .. }
        )
    }
}

/// The controller's answer.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct AdminReply {
    pub ok: bool,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub status: Option<serde_json::Value>,
}

impl AdminReply {
    fn ok(status: Option<serde_json::Value>) -> AdminReply {
        AdminReply {
            ok: true,
            error: None,
            status,
        }
    }
    fn error(message: impl Into<String>) -> AdminReply {
        AdminReply {
            ok: false,
            error: Some(message.into()),
            status: None,
        }
    }
}

enum Inbound {
    Hello {
        node: String,
        gpus: Vec<GpuInfo>,
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

struct Session {
    view: NodeView,
    last_seen_ms: u64,
    writer: Option<Sender<String>>,
}

/// A re-read site config (on SIGHUP): the new options, or why the file was refused.
pub type Reload = Result<CtldOptions, String>;

/// Runs the controller until `shutdown`. `reloads` brings re-read site configs: a valid
/// one replaces the budget, policy, tiers and lease settings at once (the listen
/// addresses, sockets, state directory, key and period need a restart); a refused one
/// leaves the config in force and is reported by `status` until a valid one arrives.
pub fn run(
    options: CtldOptions,
    shutdown: Arc<AtomicBool>,
    reloads: Receiver<Reload>,
) -> Result<(), String> {
    let mut options = options;
    let mut config_error: Option<String> = None;
    let (mut state, state_lost) = load_state(&options.state_dir);
    // With the state lost, the nodes that hold leases are unknown: allocate nothing for
    // one lease, so every old lease has run out (its node at its fail-safe cap) before
    // new ones are handed out, and no node's watts are given twice.
    let hold_until_ms = if state_lost {
        unix_ms() + (options.lease_ttl_s * 1000.0) as u64
    } else {
        0
    };
    if state_lost {
        warn!(
            hold_s = options.lease_ttl_s,
            "holding the first allocation until every old lease has run out"
        );
    }
    info!(
        budget_w = state.budget_w.map_or(options.base_budget.0, |w| w.0),
        events = state.events.len(),
        "controller started"
    );
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
    let last_seq: Arc<Mutex<BTreeMap<String, u64>>> = Arc::new(Mutex::new(BTreeMap::new()));

    let acceptors = {
        let (link_tx, link_shutdown, key, last_seq) = (
            tx.clone(),
            shutdown.clone(),
            options.key.clone(),
            last_seq.clone(),
        );
        let link_thread = std::thread::spawn(move || {
            while !link_shutdown.load(Ordering::SeqCst) {
                match link.accept() {
                    Ok((stream, peer)) => {
                        let (tx, key, last_seq, shutdown) = (
                            link_tx.clone(),
                            key.clone(),
                            last_seq.clone(),
                            link_shutdown.clone(),
                        );
                        std::thread::spawn(move || {
                            serve_agent(stream, peer, &tx, &key, &last_seq, &shutdown)
                        });
                    }
                    Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                        std::thread::sleep(Duration::from_millis(20))
                    }
                    Err(e) => {
                        warn!(error = %e, "agent link accept failed");
                        std::thread::sleep(Duration::from_millis(100));
                    }
                }
            }
        });
        let (tx, shutdown) = (tx.clone(), shutdown.clone());
        let admin_thread = std::thread::spawn(move || {
            while !shutdown.load(Ordering::SeqCst) {
                match admin.accept() {
                    Ok((stream, _)) => {
                        let tx = tx.clone();
                        std::thread::spawn(move || serve_admin(stream, &tx));
                    }
                    Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                        std::thread::sleep(Duration::from_millis(20))
                    }
                    Err(_) => std::thread::sleep(Duration::from_millis(100)),
                }
            }
        });
        [link_thread, admin_thread]
    };
    drop(tx);

    let mut sessions: BTreeMap<String, Session> = BTreeMap::new();
    let mut annotations: BTreeMap<String, String> = BTreeMap::new();
    let mut history: std::collections::VecDeque<Sample> = std::collections::VecDeque::new();
    let metrics: Arc<Mutex<String>> = Arc::new(Mutex::new(String::new()));
    if let Some(addr) = options.metrics_listen {
        let listener = TcpListener::bind(addr)
            .map_err(|e| format!("cannot listen on {addr} for metrics: {e}"))?;
        serve_metrics(listener, metrics.clone(), shutdown.clone());
    }
    let annotator = spawn_annotator();
    let mut seq = unix_ms();
    let mut last: Option<Decision> = None;
    // Nodes known from before a restart count as silent (at their fail-safe cap) until
    // they reconnect, and no allocation is made until all have or half a lease passed.
    for (node, gpus) in &state.nodes {
        sessions.insert(
            node.clone(),
            Session {
                view: NodeView {
                    node: node.clone(),
                    gpus: gpus.clone(),
                    jobs: Vec::new(),
                    power_w: 0.0,
                    live: false,
                },
                last_seen_ms: 0,
                writer: None,
            },
        );
    }
    let mut awaiting: std::collections::BTreeSet<String> = state.nodes.keys().cloned().collect();
    let grace_until_ms = unix_ms() + (options.lease_ttl_s * 500.0) as u64;
    if !awaiting.is_empty() {
        info!(
            nodes = awaiting.len(),
            grace_s = options.lease_ttl_s / 2.0,
            "waiting for the known agents to reconnect before allocating"
        );
    }
    let ticker = tick(options.period);
    let check = tick(Duration::from_millis(100));
    let mut allocate_now = true;
    while !shutdown.load(Ordering::SeqCst) {
        select! {
            recv(rx) -> msg => {
                let Ok(first) = msg else { break };
                // Drain what else is queued before allocating: a thousand agents
                // connecting at once then cost one allocation, not a thousand.
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
                            info!(node = %node, gpus = gpus.len(), "agent connected");
                            let s = sessions.entry(node.clone()).or_insert_with(|| Session {
                                view: NodeView { node: node.clone(), gpus: Vec::new(), jobs: Vec::new(), power_w: 0.0, live: true },
                                last_seen_ms: 0,
                                writer: None,
                            });
                            if state.nodes.get(&node) != Some(&gpus) {
                                state.nodes.insert(node.clone(), gpus.clone());
                                save_state(&options.state_dir, &state);
                            }
                            awaiting.remove(&node);
                            s.view.gpus = gpus;
                            s.writer = Some(writer);
                            s.last_seen_ms = unix_ms();
                            allocate_now = true;
                        }
                        Inbound::Report { node, jobs, power_w } => {
                            if let Some(s) = sessions.get_mut(&node) {
                                let changed = s.view.jobs.iter().map(|j| &j.job_id).ne(jobs.iter().map(|j| &j.job_id));
                                s.view.jobs = jobs;
                                s.view.power_w = power_w;
                                s.last_seen_ms = unix_ms();
                                allocate_now |= changed;
                            }
                        }
                        Inbound::Admin { op: AdminOp::History, reply, .. } => {
                            let samples: Vec<&Sample> = history.iter().collect();
                            let _ = reply.send(AdminReply::ok(serde_json::to_value(samples).ok()));
                        }
                        Inbound::Admin { op, uid, reply } => {
                            let changes = op.changes_state();
                            let answer = handle_admin(op, uid, &mut state, &options, &sessions, last.as_ref(), config_error.as_deref());
                            if answer.ok && changes {
                                allocate_now = true;
                            }
                            let _ = reply.send(answer);
                        }
                    }
                }
            }
            recv(reloads) -> reload => match reload {
                Ok(Ok(new)) => {
                    let needs_restart = new.listen != options.listen
                        || new.admin_socket != options.admin_socket
                        || new.state_dir != options.state_dir
                        || new.key != options.key
                        || new.period != options.period
                        || new.metrics_listen != options.metrics_listen;
                    if needs_restart {
                        warn!("site config reloaded; listen addresses, sockets, state directory, key and allocation period change only on restart");
                    }
                    info!(base_budget_w = new.base_budget.0, policy = new.site.policy.name(), lease_ttl_s = new.lease_ttl_s, "site config reloaded");
                    options = CtldOptions {
                        listen: options.listen,
                        admin_socket: options.admin_socket.clone(),
                        state_dir: options.state_dir.clone(),
                        key: options.key.clone(),
                        period: options.period,
                        metrics_listen: options.metrics_listen,
                        ..new
                    };
                    config_error = None;
                    allocate_now = true;
                }
                Ok(Err(e)) => {
                    error!(error = %e, "site config reload refused; the previous config stays in force");
                    config_error = Some(e);
                }
                Err(_) => {}
            },
            recv(ticker) -> _ => allocate_now = true,
            recv(check) -> _ => {}
        }
        if !allocate_now {
            continue;
        }
        allocate_now = false;
        let now = unix_ms();
        let ttl_ms = (options.lease_ttl_s * 1000.0) as u64;
        for s in sessions.values_mut() {
            s.view.live = now.saturating_sub(s.last_seen_ms) < ttl_ms;
        }
        if now < hold_until_ms {
            continue;
        }
        if !awaiting.is_empty() {
            if now < grace_until_ms {
                // Their old leases still hold every cap; nothing is lost by waiting.
                continue;
            }
            warn!(nodes = ?awaiting, "agents known before the restart did not reconnect; counting them at their fail-safe cap");
            awaiting.clear();
        }
        let before = state.events.len();
        state.events.retain(|e| e.pending(now));
        if state.events.len() != before {
            save_state(&options.state_dir, &state);
        }
        let base = state.budget_w.unwrap_or(options.base_budget);
        let budget = effective_budget(base, &state.events, now);
        let views: Vec<NodeView> = sessions.values().map(|s| s.view.clone()).collect();
        let decision = decide(&views, budget, &options.site);
        if let Some(a) = &decision.allocation {
            if a.over_budget_w.0 > 0.0 || a.broken_floors().next().is_some() {
                error!(
                    budget_w = budget.0,
                    short_w = a.over_budget_w.0,
                    broken = a.broken_floors().count(),
                    "the budget cannot hold every tier bound"
                );
            }
        }
        for (node, caps) in &decision.leases {
            let Some(writer) = sessions.get(node).and_then(|s| s.writer.clone()) else {
                continue;
            };
            seq = seq.max(unix_ms()) + 1;
            let body = Body::Lease {
                node: node.clone(),
                caps: caps.clone(),
                ttl_s: options.lease_ttl_s,
                start_cap_w: Some(decision.start_cap_w),
                recalibrate: decision
                    .drifted
                    .iter()
                    .filter(|d| caps.contains_key(&d.job))
                    .map(|d| d.job.clone())
                    .collect(),
            };
            if let Ok(e) = Envelope::seal(&options.key, "controller", seq, unix_ms(), body) {
                let _ = writer.try_send(e.to_line());
            }
        }
        annotate(&decision, &sessions, &mut annotations, &annotator);
        let draw: f64 = sessions
            .values()
            .filter(|s| s.view.live)
            .map(|s| s.view.power_w)
            .sum();
        let caps: BTreeMap<String, f64> = decision
            .allocation
            .as_ref()
            .map(|a| a.jobs.iter().map(|j| (j.id.clone(), j.cap_w.0)).collect())
            .unwrap_or_default();
        history.push_back(Sample {
            t_ms: now,
            budget_w: budget.0,
            draw_w: draw,
            caps,
            simulated: sessions
                .values()
                .any(|s| s.view.live && s.view.gpus.iter().any(|g| g.name.contains("(simulated)"))),
        });
        while history.len() > HISTORY {
            history.pop_front();
        }
        let text = render_metrics(
            &decision,
            base,
            budget,
            draw,
            &sessions,
            active_event(base, &state.events, now).is_some(),
        );
        *metrics.lock().unwrap_or_else(PoisonError::into_inner) = text;
        last = Some(decision);
    }
    for t in acceptors {
        let _ = t.join();
    }
    let _ = std::fs::remove_file(&options.admin_socket);
    Ok(())
}

fn render_metrics(
    decision: &Decision,
    base: Watts,
    budget: Watts,
    draw: f64,
    sessions: &BTreeMap<String, Session>,
    event: bool,
) -> String {
    use std::fmt::Write as _;
    let mut out = String::new();
    let mut gauge = |name: &str, help: &str, rows: Vec<(String, f64)>| {
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} gauge");
        for (labels, v) in rows {
            let _ = writeln!(out, "{name}{labels} {v}");
        }
    };
    gauge(
        "powerflex_budget_watts",
        "Facility GPU budget in force, W.",
        vec![(String::new(), budget.0)],
    );
    gauge(
        "powerflex_base_budget_watts",
        "Facility GPU budget without grid events, W.",
        vec![(String::new(), base.0)],
    );
    gauge(
        "powerflex_draw_watts",
        "Summed GPU draw reported by live agents, W.",
        vec![(String::new(), draw)],
    );
    gauge(
        "powerflex_event_active",
        "1 while a grid event cuts the budget.",
        vec![(String::new(), if event { 1.0 } else { 0.0 })],
    );
    gauge(
        "powerflex_node_live",
        "1 when the node's agent reported within its lease.",
        sessions
            .iter()
            .map(|(n, s)| {
                (
                    format!("{{node=\"{n}\"}}"),
                    if s.view.live { 1.0 } else { 0.0 },
                )
            })
            .collect(),
    );
    if let Some(a) = &decision.allocation {
        gauge(
            "powerflex_job_cap_watts",
            "Per-GPU cap granted to the job, W.",
            a.jobs
                .iter()
                .map(|j| (format!("{{job=\"{}\"}}", j.id), j.cap_w.0))
                .collect(),
        );
        gauge(
            "powerflex_floors_broken",
            "Jobs whose tier bound the budget cannot hold.",
            vec![(String::new(), a.broken_floors().count() as f64)],
        );
        gauge(
            "powerflex_over_budget_watts",
            "Shortfall with every job at its lowest cap, W.",
            vec![(String::new(), a.over_budget_w.0)],
        );
    }
    out
}

fn serve_metrics(listener: TcpListener, text: Arc<Mutex<String>>, shutdown: Arc<AtomicBool>) {
    let _ = listener.set_nonblocking(true);
    std::thread::spawn(move || {
        while !shutdown.load(Ordering::SeqCst) {
            match listener.accept() {
                Ok((mut stream, _)) => {
                    let _ = stream.set_nonblocking(false);
                    let _ = stream.set_read_timeout(Some(Duration::from_millis(500)));
                    let mut request = [0u8; 1024];
                    let read = stream.read(&mut request).unwrap_or(0);
                    let line = String::from_utf8_lossy(&request[..read]);
                    let path = line.split_whitespace().nth(1).unwrap_or("");
                    // Scrapers ask for /metrics; "/" too, for a person with curl.
                    let (status, body) = if path == "/metrics" || path == "/" {
                        (
                            "200 OK",
                            text.lock().unwrap_or_else(PoisonError::into_inner).clone(),
                        )
                    } else {
                        ("404 Not Found", "try /metrics\n".to_string())
                    };
                    let _ = write!(
                        stream,
                        "HTTP/1.1 {status}\r\nContent-Type: text/plain; version=0.0.4\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
                        body.len()
                    );
                }
                Err(_) => std::thread::sleep(Duration::from_millis(20)),
            }
        }
    });
}

/// Runs `scontrol update JobId=N AdminComment=...` for each queued job, so admins see
/// the job's tier, PFI and cap in `scontrol show job`. Where scontrol is missing or fails,
/// it says so once and carries on without: the annotation is a courtesy, not control.
fn spawn_annotator() -> Sender<(String, String)> {
    let (tx, rx) = unbounded::<(String, String)>();
    std::thread::spawn(move || {
        let mut warned = false;
        for (job, text) in &rx {
            let outcome = std::process::Command::new("scontrol")
                .args([
                    "update",
                    &format!("JobId={job}"),
                    &format!("AdminComment={text}"),
                ])
                .stdout(std::process::Stdio::null())
                .stderr(std::process::Stdio::null())
                .status();
            match outcome {
                Ok(s) if s.success() => {}
                // No scontrol on this host: stop trying, the queue just drains.
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                    if !warned {
                        info!(
                            "scontrol is not installed here; Slurm will not show powerflex's caps"
                        );
                    }
                    for _ in rx.iter() {}
                    return;
                }
                Ok(_) | Err(_) if !warned => {
                    warned = true;
                    info!(job_id = %job, "scontrol cannot annotate jobs here; Slurm will not show powerflex's caps");
                }
                _ => {}
            }
        }
    });
    tx
}

fn annotate(
    decision: &Decision,
    sessions: &BTreeMap<String, Session>,
    done: &mut BTreeMap<String, String>,
    annotator: &Sender<(String, String)>,
) {
    let Some(allocation) = &decision.allocation else {
        return;
    };
    let mut live: Vec<String> = Vec::new();
    for job in &allocation.jobs {
        let report = sessions
            .values()
            .flat_map(|s| s.view.jobs.iter())
            .find(|j| j.job_id == job.id);
        let tier = report.map_or("-", |r| r.tier.as_str());
        let pfi = report
            .and_then(|r| r.pfi)
            .map_or("-".to_string(), |p| format!("{p:.2}"));
        // No spaces: `scontrol show job` prints key=value pairs separated by spaces.
        let text = format!("powerflex;tier={tier};pfi={pfi};cap={:.0}W", job.cap_w.0);
        live.push(job.id.clone());
        if done.get(&job.id) != Some(&text) {
            done.insert(job.id.clone(), text.clone());
            let _ = annotator.send((job.id.clone(), text));
        }
    }
    done.retain(|id, _| live.contains(id));
}

fn handle_admin(
    op: AdminOp,
    uid: u32,
    state: &mut CtldState,
    options: &CtldOptions,
    sessions: &BTreeMap<String, Session>,
    last: Option<&Decision>,
    config_error: Option<&str>,
) -> AdminReply {
    let now = unix_ms();
    if op.changes_state() && uid != 0 {
        return AdminReply::error("only root may change the budget or grid events");
    }
    match op {
        AdminOp::Status | AdminOp::History => {
            let mut answer = status(state, options, sessions, last, now);
            answer["config_error"] = serde_json::json!(config_error);
            AdminReply::ok(Some(answer))
        }
        AdminOp::BudgetSet { budget_w } => {
            if !(budget_w.is_finite() && budget_w > 0.0) {
                return AdminReply::error(format!(
                    "budget must be a positive power (got {budget_w} W)"
                ));
            }
            info!(budget_w, "budget set");
            state.budget_w = Some(Watts(budget_w));
            save_state(&options.state_dir, state);
            AdminReply::ok(None)
        }
        AdminOp::EventAdd {
            cut,
            start_ms,
            duration_ms,
            ramp_ms,
        } => {
            if duration_ms == 0 || ramp_ms.saturating_mul(2) > duration_ms {
                return AdminReply::error("an event needs a duration longer than twice its ramp");
            }
            state.next_event_id += 1;
            let event = Event {
                id: state.next_event_id,
                cut,
                start_ms,
                duration_ms,
                ramp_ms,
            };
            info!(
                id = event.id,
                ?cut,
                start_ms,
                duration_ms,
                ramp_ms,
                "grid event added"
            );
            state.events.push(event);
            save_state(&options.state_dir, state);
            AdminReply::ok(Some(serde_json::json!({ "id": state.next_event_id })))
        }
        AdminOp::WhatIf { policy, budget_w } => {
            let Some(policy) = Policy::from_name(&policy) else {
                return AdminReply::error(format!(
                    "unknown policy {policy:?}; accepted: optimal, equal, pfi-proportional"
                ));
            };
            let budget = match budget_w {
                Some(w) if !(w.is_finite() && w > 0.0) => {
                    return AdminReply::error(format!(
                        "budget must be a positive power (got {w} W)"
                    ))
                }
                Some(w) => Watts(w),
                None => effective_budget(
                    state.budget_w.unwrap_or(options.base_budget),
                    &state.events,
                    now,
                ),
            };
            let views: Vec<NodeView> = sessions.values().map(|s| s.view.clone()).collect();
            let settings = SiteSettings {
                policy,
                ..options.site.clone()
            };
            AdminReply::ok(serde_json::to_value(decide(&views, budget, &settings)).ok())
        }
        AdminOp::EventCancel { id } => {
            let before = state.events.len();
            state.events.retain(|e| e.id != id);
            if state.events.len() == before {
                return AdminReply::error(format!("no event {id}"));
            }
            info!(id, "grid event cancelled");
            save_state(&options.state_dir, state);
            AdminReply::ok(None)
        }
    }
}

fn status(
    state: &CtldState,
    options: &CtldOptions,
    sessions: &BTreeMap<String, Session>,
    last: Option<&Decision>,
    now: u64,
) -> serde_json::Value {
    let base = state.budget_w.unwrap_or(options.base_budget);
    let budget = effective_budget(base, &state.events, now);
    let draw: f64 = sessions
        .values()
        .filter(|s| s.view.live)
        .map(|s| s.view.power_w)
        .sum();
    let caps: BTreeMap<String, f64> = last
        .and_then(|d| d.allocation.as_ref())
        .map(|a| a.jobs.iter().map(|j| (j.id.clone(), j.cap_w.0)).collect())
        .unwrap_or_default();
    let floors: BTreeMap<String, serde_json::Value> = last
        .and_then(|d| d.allocation.as_ref())
        .map(|a| {
            a.jobs
                .iter()
                .map(|j| {
                    (
                        j.id.clone(),
                        serde_json::to_value(j.floor).unwrap_or_default(),
                    )
                })
                .collect()
        })
        .unwrap_or_default();
    let mut jobs: BTreeMap<String, serde_json::Value> = BTreeMap::new();
    for s in sessions.values() {
        for j in &s.view.jobs {
            let entry = jobs.entry(j.job_id.clone()).or_insert_with(|| {
                serde_json::json!({
                    "job": j.job_id, "tier": j.tier, "nodes": [], "gpus": 0, "pfi": j.pfi,
                    "cap_w": caps.get(&j.job_id), "floor": floors.get(&j.job_id),
                    "throughput": j.throughput, "uncapped_throughput": j.points.first().map(|p| p[2]),
                    "pfi_source": j.pfi_source, "power_w": 0.0, "points": {},
                })
            });
            if let Some(n) = entry["nodes"].as_array_mut() {
                n.push(serde_json::Value::String(s.view.node.clone()));
            }
            entry["gpus"] =
                serde_json::json!(entry["gpus"].as_u64().unwrap_or(0) + u64::from(j.gpus));
            entry["power_w"] = serde_json::json!(
                entry["power_w"].as_f64().unwrap_or(0.0) + j.power_w.unwrap_or(0.0)
            );
            entry["points"][&s.view.node] = serde_json::json!(j.points);
        }
    }
    serde_json::json!({
        "base_budget_w": base.0,
        "budget_w": budget.0,
        "draw_w": draw,
        "headroom_w": budget.0 - draw,
        "active_event": active_event(base, &state.events, now),
        "events": state.events,
        "over_budget_w": last.and_then(|d| d.allocation.as_ref()).map(|a| a.over_budget_w.0),
        "nodes": sessions.values().map(|s| serde_json::json!({
            "node": s.view.node, "gpus": s.view.gpus.len(), "live": s.view.live, "power_w": s.view.power_w,
            "jobs": s.view.jobs.len(), "seen_ms_ago": now.saturating_sub(s.last_seen_ms),
        })).collect::<Vec<_>>(),
        "jobs": jobs.into_values().collect::<Vec<_>>(),
    })
}

fn serve_agent(
    stream: TcpStream,
    peer: std::net::SocketAddr,
    tx: &Sender<Inbound>,
    key: &[u8],
    last_seq: &Mutex<BTreeMap<String, u64>>,
    shutdown: &AtomicBool,
) {
    let Ok(mut write_half) = stream.try_clone() else {
        return;
    };
    let _ = write_half.set_write_timeout(Some(Duration::from_secs(2)));
    let (writer_tx, writer_rx): (Sender<String>, Receiver<String>) = unbounded();
    std::thread::spawn(move || {
        for line in writer_rx {
            if write_half.write_all(line.as_bytes()).is_err() {
                return;
            }
        }
    });
    let mut reader = BufReader::new(stream);
    let mut node: Option<String> = None;
    while !shutdown.load(Ordering::SeqCst) {
        let mut line = String::new();
        match (&mut reader)
            .take(MAX_LINK_LINE_BYTES as u64 + 1)
            .read_line(&mut line)
        {
            Ok(0) | Err(_) => return,
            Ok(_) if line.len() > MAX_LINK_LINE_BYTES => {
                warn!(%peer, "oversized message from an agent; connection closed");
                return;
            }
            Ok(_) => {}
        }
        // The sender claims a name; the MAC and its sequence decide whether to believe it.
        let claimed = serde_json::from_str::<serde_json::Value>(&line)
            .ok()
            .and_then(|v| v["from"].as_str().map(str::to_string))
            .unwrap_or_default();
        let previous = last_seq
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .get(&claimed)
            .copied()
            .unwrap_or(0);
        let envelope = match Envelope::open(key, &line, previous, unix_ms()) {
            Ok(e) => e,
            Err(e) => {
                warn!(%peer, error = %e, "agent message refused");
                continue;
            }
        };
        last_seq
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .insert(envelope.from.clone(), envelope.seq);
        match envelope.body {
            Body::Hello { gpus } => {
                node = Some(envelope.from.clone());
                let _ = tx.send(Inbound::Hello {
                    node: envelope.from,
                    gpus,
                    writer: writer_tx.clone(),
                });
            }
            Body::Report { jobs, power_w, .. }
                if node.as_deref() == Some(envelope.from.as_str()) =>
            {
                let _ = tx.send(Inbound::Report {
                    node: envelope.from,
                    jobs,
                    power_w,
                });
            }
            other => warn!(%peer, body = ?other, "unexpected message from an agent"),
        }
    }
}

fn serve_admin(mut stream: UnixStream, tx: &Sender<Inbound>) {
    let _ = stream.set_read_timeout(Some(Duration::from_secs(2)));
    let _ = stream.set_write_timeout(Some(Duration::from_secs(2)));
    let uid = powerflex_daemon::os::peer_of(&stream).map_or(u32::MAX, |p| p.uid);
    let mut line = String::new();
    let reply = match stream
        .try_clone()
        .map(BufReader::new)
        .and_then(|r| r.take(65_536).read_line(&mut line))
    {
        Err(e) => AdminReply::error(e.to_string()),
        Ok(_) => match serde_json::from_str::<AdminOp>(line.trim_end()) {
            Err(e) => AdminReply::error(format!("malformed admin request: {e}")),
            Ok(op) => {
                let (reply_tx, reply_rx) = bounded(1);
                if tx
                    .send_timeout(
                        Inbound::Admin {
                            op,
                            uid,
                            reply: reply_tx,
                        },
                        Duration::from_secs(2),
                    )
                    .is_err()
                {
                    AdminReply::error("controller busy")
                } else {
                    reply_rx
                        .recv_timeout(Duration::from_secs(5))
                        .unwrap_or_else(|_| AdminReply::error("controller did not answer in time"))
                }
            }
        },
    };
    let mut text = serde_json::to_string(&reply).unwrap_or_default();
    text.push('\n');
    let _ = stream.write_all(text.as_bytes());
}

/// Sends one admin request to the controller at `socket` and returns its reply.
pub fn request(socket: &Path, op: &AdminOp) -> Result<AdminReply, String> {
    let mut stream = UnixStream::connect(socket)
        .map_err(|e| format!("cannot reach powerflex-ctld at {}: {e}", socket.display()))?;
    let _ = stream.set_read_timeout(Some(Duration::from_secs(10)));
    let mut line = serde_json::to_string(op).map_err(|e| e.to_string())?;
    line.push('\n');
    stream
        .write_all(line.as_bytes())
        .map_err(|e| e.to_string())?;
    let started = Instant::now();
    let mut reply = String::new();
    BufReader::new(stream)
        .take(16 * 1024 * 1024)
        .read_line(&mut reply)
        .map_err(|e| {
            format!(
                "no answer from powerflex-ctld after {:.1} s: {e}",
                started.elapsed().as_secs_f64()
            )
        })?;
    serde_json::from_str(reply.trim_end())
        .map_err(|e| format!("bad answer from powerflex-ctld: {e}"))
}
