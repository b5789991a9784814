//! Attacks on the agent ↔ controller link and on the controller's listeners, with the
//! real daemons on the local Slurm cluster (`src/stack.rs`):
//!
//! - a connection flood on the controller: thousands of idle and half-sent connections,
//!   while agents still connect, leases still flow and the controller's thread count
//!   stays bounded;
//! - a lease captured off the wire and replayed after a forced reconnect: refused, caps
//!   unchanged;
//! - a lease sealed for node A delivered to node B, a node's key used to speak for
//!   another node and to play the controller to another node: all refused;
//! - version 1 peers on either side: a clear refusal on both.
//!
//! The wire is observed and tampered with by a proxy the test puts between the agents
//! and the controller ([`Proxy`]): the agents keep the configured address, the
//! controller is restarted on another port behind it.

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::process::{Child, Command};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use powerflex::link_peer::{h200s, unix_ms, LinkPeer};
use powerflex::needs::{can_run, Need};
use powerflex::site_config::SiteBuilder;
use powerflex::stack::{Stack, StackOptions};
use powerflex::{free_loopback_port, run, wait_until, Children};
use powerflex_core::config::{RawSiteConfig, SiteConfig};
use powerflex_proto::link::{seal, unframe, Body, Header, CONTROLLER, MAX_HANDSHAKE_LINE_BYTES};
use powerflex_proto::status::NodeStatus;

/// A profile that draws 690 W per GPU uncapped, so every cut shows in the caps.
const HEAVY: &str = "synthetic-compute-bound";

fn site_config(stack: &Stack) -> SiteConfig {
    let text = std::fs::read_to_string(&stack.site).expect("site config");
    SiteConfig::from_toml_str(&text).expect("site config parses")
}

fn link_addr(stack: &Stack) -> SocketAddr {
    site_config(stack).controller.listen
}

fn site_key(stack: &Stack) -> Vec<u8> {
    std::fs::read(stack.base.join("site.key"))
        .expect("site key")
        .trim_ascii()
        .to_vec()
}

fn set_budget(stack: &Stack, watts: f64) {
    let set = run(
        &stack.ctl,
        &[
            "budget",
            "set",
            &format!("{watts}W"),
            "--socket",
            &stack.socket.to_string_lossy(),
        ],
    );
    assert_eq!(set.code, Some(0), "{}", set.stderr);
}

fn live_nodes(stack: &Stack) -> Vec<String> {
    stack
        .ctl_json::<Vec<NodeStatus>>(&["nodes"])
        .unwrap_or_default()
        .into_iter()
        .filter(|n| n.live)
        .map(|n| n.node)
        .collect()
}

/// Threads of process `pid` (from /proc).
fn threads(pid: u32) -> usize {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("Threads:"))
                .and_then(|n| n.trim().parse().ok())
        })
        .unwrap_or_else(|| panic!("cannot read the thread count of pid {pid}"))
}

/// The caps of node `i`'s GPUs, W.
fn node_caps(stack: &Stack, i: usize) -> Vec<f64> {
    let per = stack.gpus_per_node as usize;
    stack.caps_w()[i * per..(i + 1) * per].to_vec()
}

fn metrics(addr: SocketAddr) -> String {
    let mut s = TcpStream::connect(addr).expect("metrics");
    s.set_read_timeout(Some(Duration::from_secs(10)))
        .expect("timeout");
    s.write_all(b"GET /metrics HTTP/1.0\r\n\r\n").expect("send");
    let mut text = String::new();
    let _ = std::io::Read::read_to_string(&mut s, &mut text);
    text
}

/// `powerflex_refusals_total{reason="REASON"}` in a scrape, 0 when absent.
fn refusals(text: &str, reason: &str) -> u64 {
    let prefix = format!("powerflex_refusals_total{{reason=\"{reason}\"}} ");
    text.lines()
        .find_map(|l| l.strip_prefix(&prefix))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(0)
}

/// The body of a frame read off the wire, without checking it (the test is the
/// eavesdropper here).
fn peek_body(line: &str) -> Option<Body> {
    let (signed, _mac) = line.trim_end().rsplit_once(' ')?;
    let payload = signed.splitn(6, ' ').nth(5)?;
    serde_json::from_str(payload).ok()
}

/// Restarts the stack's controller listening on a new port, with metrics on `metrics`;
/// the agents' configured address is then free for a proxy. The returned child is the
/// new controller (ended by the test's guard).
fn move_ctld(stack: &mut Stack, metrics: SocketAddr) -> (SocketAddr, Child) {
    let agents_addr = link_addr(stack);
    stack.kill_ctld();
    let upstream: SocketAddr = ([127, 0, 0, 1], free_loopback_port()).into();
    let text = std::fs::read_to_string(&stack.site).expect("site config");
    let mut raw = RawSiteConfig::from_toml_str(&text).expect("site config parses");
    raw.controller.listen = upstream.to_string();
    raw.controller.metrics_listen = Some(metrics.to_string());
    let moved = stack.base.join("powerflex-ctld-moved.toml");
    std::fs::write(&moved, toml::to_string(&raw).expect("toml")).expect("moved config");
    let child = spawn_moved_ctld(stack);
    assert_ne!(agents_addr, upstream);
    (upstream, child)
}

/// Starts the controller with the moved config [`move_ctld`] wrote (again, after a
/// restart: its log starts over) and waits for its admin socket.
fn spawn_moved_ctld(stack: &Stack) -> Child {
    let moved = stack.base.join("powerflex-ctld-moved.toml");
    let child = Command::new(powerflex::profile_dir().join("powerflex-ctld"))
        .args(["--config", &moved.to_string_lossy()])
        .envs(stack.cluster.env())
        .stderr(std::fs::File::create(stack.base.join("ctld-moved.log")).expect("log"))
        .spawn()
        .expect("powerflex-ctld");
    let socket = stack.socket.clone();
    wait_until(
        "the moved controller's admin socket",
        Duration::from_secs(60),
        || {
            std::os::unix::net::UnixStream::connect(&socket)
                .ok()
                .map(|_| ())
        },
    );
    child
}

/// What the proxy does with a new agent connection.
#[derive(Debug, Clone)]
enum Mode {
    /// Forward both ways, recording what the controller sends.
    Forward,
    /// Answer the agent's open with a challenge sealed with `key` (someone holding that
    /// key playing the controller).
    Impersonate { key: Vec<u8> },
    /// Answer like a version 1 controller: a version 1 envelope.
    V1Controller,
}

/// One proxied agent connection.
struct Conn {
    node: Arc<Mutex<Option<String>>>,
    agent: TcpStream,
    ctld: Option<TcpStream>,
}

/// A man in the middle on the agents' configured address.
struct Proxy {
    mode: Arc<Mutex<Mode>>,
    conns: Arc<Mutex<Vec<Conn>>>,
    /// Lines the controller sent: (node, line), oldest first.
    down: Arc<Mutex<Vec<(String, String)>>>,
    accepted: Arc<AtomicU64>,
    stop: Arc<AtomicBool>,
}

impl Proxy {
    fn start(listen: SocketAddr, upstream: SocketAddr) -> Proxy {
        let listener = TcpListener::bind(listen).expect("the agents' address, for the proxy");
        let proxy = Proxy {
            mode: Arc::new(Mutex::new(Mode::Forward)),
            conns: Arc::new(Mutex::new(Vec::new())),
            down: Arc::new(Mutex::new(Vec::new())),
            accepted: Arc::new(AtomicU64::new(0)),
            stop: Arc::new(AtomicBool::new(false)),
        };
        let (mode, conns, down, accepted, stop) = (
            proxy.mode.clone(),
            proxy.conns.clone(),
            proxy.down.clone(),
            proxy.accepted.clone(),
            proxy.stop.clone(),
        );
        std::thread::spawn(move || {
            for agent in listener.incoming() {
                if stop.load(Ordering::SeqCst) {
                    return;
                }
                let Ok(agent) = agent else { continue };
                accepted.fetch_add(1, Ordering::SeqCst);
                let mode = mode.lock().unwrap_or_else(PoisonError::into_inner).clone();
                let node = Arc::new(Mutex::new(None));
                match mode {
                    Mode::Forward => {
                        let Ok(ctld) = TcpStream::connect(upstream) else {
                            continue;
                        };
                        pump_up(&agent, &ctld, node.clone());
                        pump_down(&ctld, &agent, node.clone(), down.clone());
                        conns
                            .lock()
                            .unwrap_or_else(PoisonError::into_inner)
                            .push(Conn {
                                node,
                                agent,
                                ctld: Some(ctld),
                            });
                    }
                    Mode::Impersonate { key } => {
                        impersonate(&agent, &key, node.clone());
                        conns
                            .lock()
                            .unwrap_or_else(PoisonError::into_inner)
                            .push(Conn {
                                node,
                                agent,
                                ctld: None,
                            });
                    }
                    Mode::V1Controller => {
                        let mut reply = agent.try_clone().expect("clone");
                        let mut reader = BufReader::new(agent.try_clone().expect("clone"));
                        std::thread::spawn(move || {
                            let mut open = String::new();
                            let _ = reader.read_line(&mut open);
                            // What a version 1 controller's leases looked like.
                            let _ = reply.write_all(
                                format!(
                                    "{{\"v\":1,\"from\":\"controller\",\"seq\":{},\"ts_ms\":{},\"body\":{{\"type\":\"lease\",\"node\":\"x\",\"caps\":{{}},\"ttl_s\":30.0}},\"mac\":\"{}\"}}\n",
                                    unix_ms(),
                                    unix_ms(),
                                    "0".repeat(64)
                                )
                                .as_bytes(),
                            );
                        });
                        conns
                            .lock()
                            .unwrap_or_else(PoisonError::into_inner)
                            .push(Conn {
                                node,
                                agent,
                                ctld: None,
                            });
                    }
                }
            }
        });
        proxy
    }

    fn set_mode(&self, mode: Mode) {
        *self.mode.lock().unwrap_or_else(PoisonError::into_inner) = mode;
    }

    /// Ends every proxied connection: the agents see the controller go away and
    /// reconnect.
    fn cut_all(&self) {
        for c in self
            .conns
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .drain(..)
        {
            let _ = c.agent.shutdown(std::net::Shutdown::Both);
            if let Some(ctld) = c.ctld {
                let _ = ctld.shutdown(std::net::Shutdown::Both);
            }
        }
    }

    /// Writes `line` to the newest connection of `node`'s agent, as if the controller
    /// had sent it.
    fn inject(&self, node: &str, line: &str) {
        let conns = self.conns.lock().unwrap_or_else(PoisonError::into_inner);
        let conn = conns
            .iter()
            .rev()
            .find(|c| {
                c.node
                    .lock()
                    .unwrap_or_else(PoisonError::into_inner)
                    .as_deref()
                    == Some(node)
            })
            .unwrap_or_else(|| panic!("no proxied connection of {node}"));
        (&conn.agent).write_all(line.as_bytes()).expect("inject");
    }

    /// The lines the controller sent to `node` so far.
    fn sent_to(&self, node: &str) -> Vec<String> {
        self.down
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .iter()
            .filter(|(n, _)| n == node)
            .map(|(_, l)| l.clone())
            .collect()
    }
}

impl Drop for Proxy {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        self.cut_all();
    }
}

/// The node an agent's first frame (its open) names.
fn node_of_open(line: &str) -> Option<String> {
    unframe(line, MAX_HANDSHAKE_LINE_BYTES)
        .ok()
        .map(|f| f.header.from)
}

fn pump_up(agent: &TcpStream, ctld: &TcpStream, node: Arc<Mutex<Option<String>>>) {
    let mut reader = BufReader::new(agent.try_clone().expect("clone"));
    let mut to = ctld.try_clone().expect("clone");
    std::thread::spawn(move || loop {
        let mut line = String::new();
        match reader.read_line(&mut line) {
            Ok(0) | Err(_) => {
                let _ = to.shutdown(std::net::Shutdown::Both);
                return;
            }
            Ok(_) => {}
        }
        let mut named = node.lock().unwrap_or_else(PoisonError::into_inner);
        if named.is_none() {
            *named = node_of_open(&line);
        }
        drop(named);
        if to.write_all(line.as_bytes()).is_err() {
            return;
        }
    });
}

fn pump_down(
    ctld: &TcpStream,
    agent: &TcpStream,
    node: Arc<Mutex<Option<String>>>,
    down: Arc<Mutex<Vec<(String, String)>>>,
) {
    let mut reader = BufReader::new(ctld.try_clone().expect("clone"));
    let mut to = agent.try_clone().expect("clone");
    std::thread::spawn(move || loop {
        let mut line = String::new();
        match reader.read_line(&mut line) {
            Ok(0) | Err(_) => {
                let _ = to.shutdown(std::net::Shutdown::Both);
                return;
            }
            Ok(_) => {}
        }
        let name = node
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
            .unwrap_or_default();
        down.lock()
            .unwrap_or_else(PoisonError::into_inner)
            .push((name, line.clone()));
        if to.write_all(line.as_bytes()).is_err() {
            return;
        }
    });
}

fn impersonate(agent: &TcpStream, key: &[u8], node: Arc<Mutex<Option<String>>>) {
    let mut reader = BufReader::new(agent.try_clone().expect("clone"));
    let mut to = agent.try_clone().expect("clone");
    let key = key.to_vec();
    std::thread::spawn(move || {
        let mut open = String::new();
        if reader.read_line(&mut open).is_err() {
            return;
        }
        let Some(name) = node_of_open(&open) else {
            return;
        };
        *node.lock().unwrap_or_else(PoisonError::into_inner) = Some(name.clone());
        let Some(Body::Open { nonce }) = peek_body(&open) else {
            return;
        };
        let challenge = seal(
            &key,
            &Header {
                from: CONTROLLER.into(),
                to: name,
                seq: 1,
                ts_ms: unix_ms(),
            },
            &Body::Challenge {
                agent_nonce: nonce,
                controller_nonce: "ab".repeat(16),
            },
            MAX_HANDSHAKE_LINE_BYTES,
        )
        .expect("seal");
        let _ = to.write_all(challenge.as_bytes());
        // Hold the connection; the agent decides.
        let mut rest = String::new();
        let _ = reader.read_line(&mut rest);
    });
}

/// The stacks here run in `hard` budget mode: the sum of caps is the budget, so the
/// caps a budget gives are fixed (no meter corrections) and a replayed lease shows.
fn hard_mode(site: SiteBuilder) -> SiteBuilder {
    site.edit(|raw| raw.facility.budget_mode = Some("hard".into()))
}

/// Waits until every GPU of node `i` holds the same cap, below `below_w`, unchanged for
/// 2 s (the allocation settled, not a job's start cap), and returns it.
fn steady_cap(stack: &Stack, i: usize, below_w: f64, what: &str) -> f64 {
    let mut since: Option<(f64, Instant)> = None;
    wait_until(what, Duration::from_secs(90), || {
        let caps = node_caps(stack, i);
        let first = *caps.first()?;
        if !(first < below_w && caps.iter().all(|c| *c == first)) {
            since = None;
            return None;
        }
        match since {
            Some((cap, at)) if cap == first => {
                (at.elapsed() >= Duration::from_secs(2)).then_some(first)
            }
            _ => {
                since = Some((first, Instant::now()));
                None
            }
        }
    })
}

/// Samples node `i`'s caps every 20 ms for `window`: none may be at `replayed_w`, the cap
/// a refused lease would have set (the controller's own leases keep coming meanwhile).
fn never_at(stack: &Stack, i: usize, replayed_w: f64, window: Duration, what: &str) {
    let until = Instant::now() + window;
    let mut samples = 0;
    while Instant::now() < until {
        let caps = node_caps(stack, i);
        assert!(
            caps.iter().all(|c| (c - replayed_w).abs() > 0.5),
            "{what}: caps {caps:?} took the refused lease's {replayed_w} W"
        );
        samples += 1;
        std::thread::sleep(Duration::from_millis(20));
    }
    println!("{what}: no cap at {replayed_w} W over {samples} samples");
}

#[test]
fn a_connection_flood_leaves_agents_connected_and_leases_flowing_with_bounded_threads() {
    if !can_run(&[Need::Root, Need::Slurm]) {
        return;
    }
    let mut stack = Stack::start(
        "al-flood",
        StackOptions {
            budget_w: 5600.0,
            site: Some(hard_mode),
            ..StackOptions::default()
        },
    );
    let mut guard = Children(Vec::new());
    let metrics_addr: SocketAddr = ([127, 0, 0, 1], free_loopback_port()).into();
    // The controller on its own port with metrics; the agents' address forwarded to it,
    // so the flood hits the controller itself (the proxy only forwards).
    let agents_addr = link_addr(&stack);
    let (upstream, ctld) = move_ctld(&mut stack, metrics_addr);
    let pid = ctld.id();
    guard.0.push(ctld);
    let _proxy = Proxy::start(agents_addr, upstream);
    wait_until("both agents live again", Duration::from_secs(60), || {
        (live_nodes(&stack).len() == 2).then_some(())
    });
    let a = stack.submit("flex3,calibrate=off", 1, 4, HEAVY);
    let b = stack.submit("flex3,calibrate=off", 1, 4, HEAVY);
    set_budget(&stack, 4000.0);
    let before_cap = steady_cap(&stack, 0, 700.0, "node 0 capped under 4 kW");
    let threads_before = threads(pid);

    // The flood: thousands of idle connections, half-sent frames and oversized lines,
    // opened as fast as the test can, and held.
    const IDLE: usize = 3000;
    let started = Instant::now();
    let mut held: Vec<TcpStream> = Vec::with_capacity(IDLE + 400);
    for i in 0..IDLE + 400 {
        let Ok(mut s) = TcpStream::connect_timeout(&upstream, Duration::from_millis(500)) else {
            continue;
        };
        if (IDLE..IDLE + 200).contains(&i) {
            let _ = s.write_all(b"pf2 n1 controller 1 ");
        } else if i >= IDLE + 200 {
            let _ = s.write_all(&vec![b'x'; 120 * 1024]);
        }
        held.push(s);
    }
    println!(
        "flood: {} connections opened in {:.1} s",
        held.len(),
        started.elapsed().as_secs_f64()
    );
    // And a churn of new ones for the rest of the test, so the handshake table stays full.
    let churning = Arc::new(AtomicBool::new(true));
    let churned = Arc::new(AtomicU64::new(0));
    let churn = {
        let (churning, churned) = (churning.clone(), churned.clone());
        std::thread::spawn(move || {
            let mut ring: std::collections::VecDeque<TcpStream> = Default::default();
            while churning.load(Ordering::SeqCst) {
                if let Ok(s) = TcpStream::connect_timeout(&upstream, Duration::from_millis(500)) {
                    ring.push_back(s);
                    churned.fetch_add(1, Ordering::Relaxed);
                }
                if ring.len() > 1000 {
                    ring.pop_front();
                }
            }
        })
    };

    // An agent still gets a session, in well under the handshake deadline.
    let key = site_key(&stack);
    let mut handshakes_ms = Vec::new();
    for i in 0..5 {
        let t = Instant::now();
        let peer = LinkPeer::connect(upstream, &key, &format!("probe{i}"), h200s("probe", 1));
        assert!(peer.is_ok(), "an agent during the flood: {:?}", peer.err());
        handshakes_ms.push(t.elapsed().as_millis());
    }
    println!("flood: probe handshakes took {handshakes_ms:?} ms");
    // A real agent restarted during the flood comes back.
    let node0 = stack.cluster.node_names()[0].clone();
    stack.kill_agent(0);
    wait_until("node 0 no longer live", Duration::from_secs(30), || {
        (!live_nodes(&stack).contains(&node0)).then_some(())
    });
    let restarted = Instant::now();
    stack.start_agent(0);
    wait_until(
        "node 0 live again during the flood",
        Duration::from_secs(60),
        || live_nodes(&stack).contains(&node0).then_some(()),
    );
    println!(
        "flood: a restarted agent was live again after {:.1} s",
        restarted.elapsed().as_secs_f64()
    );
    // Leases still flow: a lower budget reaches both nodes' caps.
    set_budget(&stack, 3000.0);
    let t = Instant::now();
    let after_cap = steady_cap(
        &stack,
        0,
        before_cap,
        "node 0 lowered under 3 kW during the flood",
    );
    steady_cap(
        &stack,
        1,
        before_cap,
        "node 1 lowered under 3 kW during the flood",
    );
    println!(
        "flood: a budget cut reached the caps in {:.1} s ({before_cap} W -> {after_cap} W)",
        t.elapsed().as_secs_f64()
    );
    let threads_during = threads(pid);
    println!("flood: controller threads {threads_before} before, {threads_during} during");
    // Two threads per authenticated session (the probes are sessions too, until they
    // drop), a few more for the admin and metrics servers: nothing per flooding socket.
    assert!(
        threads_during <= threads_before + 2 * 5 + 4,
        "controller threads grew from {threads_before} to {threads_during} under the flood"
    );
    churning.store(false, Ordering::SeqCst);
    let _ = churn.join();
    let text = metrics(metrics_addr);
    let (cap, timeout, oversize) = (
        refusals(&text, "pending_cap"),
        refusals(&text, "handshake_timeout"),
        refusals(&text, "oversize"),
    );
    println!(
        "flood: {} churned connections; refusals pending_cap={cap} handshake_timeout={timeout} oversize={oversize}",
        churned.load(Ordering::Relaxed)
    );
    assert!(cap >= 1000, "the handshake cap took slots back: {text}");
    assert!(
        timeout + cap >= IDLE as u64,
        "every idle connection was refused: {text}"
    );
    drop(held);
    assert!(
        stack.running(a) && stack.running(b),
        "powerflex kills no job"
    );
}

#[test]
fn replayed_misrouted_and_foreign_leases_are_refused_and_v1_peers_told_why() {
    if !can_run(&[Need::Root, Need::Slurm]) {
        return;
    }
    let mut stack = Stack::start(
        "al-replay",
        StackOptions {
            budget_w: 5600.0,
            site: Some(hard_mode),
            ..StackOptions::default()
        },
    );
    let mut guard = Children(Vec::new());
    let metrics_addr: SocketAddr = ([127, 0, 0, 1], free_loopback_port()).into();
    let agents_addr = link_addr(&stack);
    let (upstream, ctld) = move_ctld(&mut stack, metrics_addr);
    guard.0.push(ctld);
    let proxy = Proxy::start(agents_addr, upstream);
    wait_until(
        "both agents live through the proxy",
        Duration::from_secs(60),
        || (live_nodes(&stack).len() == 2).then_some(()),
    );
    let names = stack.cluster.node_names().to_vec();
    let (n1, n2) = (names[0].clone(), names[1].clone());
    let a = stack.submit("flex3,calibrate=off", 1, 4, HEAVY);
    let b = stack.submit("flex3,calibrate=off", 1, 4, HEAVY);

    // 1. Capture a real lease at a generous budget, then cut the budget.
    set_budget(&stack, 4400.0);
    let high = steady_cap(&stack, 0, 700.0, "node 0 capped under 4.4 kW");
    let captured = wait_until(
        "a lease to node 0 granting its cap",
        Duration::from_secs(30),
        || {
            proxy.sent_to(&n1).into_iter().rev().find(|l| {
            matches!(peek_body(l), Some(Body::Lease { caps, .. }) if caps.values().any(|c| (c - high).abs() < 1.0))
        })
        },
    );
    let captured_for_n2 = wait_until("a lease to node 1", Duration::from_secs(30), || {
        proxy
            .sent_to(&n2)
            .into_iter()
            .rev()
            .find(|l| matches!(peek_body(l), Some(Body::Lease { .. })))
    });
    let high_n2 = match peek_body(&captured_for_n2) {
        Some(Body::Lease { caps, .. }) => caps.values().next().copied().unwrap_or(700.0),
        _ => 700.0,
    };
    set_budget(&stack, 3000.0);
    let low = steady_cap(&stack, 0, high, "node 0 lowered under 3 kW");
    let low_n2 = steady_cap(&stack, 1, high_n2, "node 1 lowered under 3 kW");
    println!("replay: captured leases of {high} W and {high_n2} W per GPU; the caps now are {low} W and {low_n2} W");

    // 2. Force a reconnect; the old lease, replayed into the new connection, is refused.
    let accepted = proxy.accepted.load(Ordering::SeqCst);
    proxy.cut_all();
    wait_until(
        "both agents reconnected through the proxy",
        Duration::from_secs(60),
        || {
            (proxy.accepted.load(Ordering::SeqCst) >= accepted + 2 && live_nodes(&stack).len() == 2)
                .then_some(())
        },
    );
    // Wait for a fresh lease on the new connection, so the replay lands between two.
    let fresh = proxy.sent_to(&n1).len();
    wait_until(
        "a lease on the new connection",
        Duration::from_secs(30),
        || (proxy.sent_to(&n1).len() > fresh).then_some(()),
    );
    let refused_before = stack
        .logs(&format!("agent-{n1}"))
        .matches("fails authentication")
        .count();
    proxy.inject(&n1, &captured);
    steady_cap(&stack, 0, high, "node 0 settled after the reconnect");
    never_at(
        &stack,
        0,
        high,
        Duration::from_millis(2500),
        "after the replay",
    );
    let agent_log = stack.logs(&format!("agent-{n1}"));
    assert!(
        agent_log.matches("fails authentication").count() > refused_before,
        "the agent says why it refused the replay:\n{agent_log}"
    );

    // 2b. The same after the controller restarts (kill -9, by PID): its new nonces make
    // every frame of its previous life useless.
    let mut old = guard.0.pop().expect("the moved controller");
    let _ = old.kill();
    let _ = old.wait();
    let _ = std::fs::remove_file(&stack.socket);
    guard.0.push(spawn_moved_ctld(&stack));
    let before_restart = proxy.sent_to(&n1).len();
    wait_until(
        "node 0 leased by the restarted controller",
        Duration::from_secs(90),
        || {
            (live_nodes(&stack).len() == 2 && proxy.sent_to(&n1).len() > before_restart + 1)
                .then_some(())
        },
    );
    steady_cap(
        &stack,
        0,
        high,
        "node 0 settled after the controller's restart",
    );
    let refused_before = stack
        .logs(&format!("agent-{n1}"))
        .matches("fails authentication")
        .count();
    proxy.inject(&n1, &captured);
    never_at(
        &stack,
        0,
        high,
        Duration::from_millis(2500),
        "after the replay across a restart",
    );
    assert!(
        stack
            .logs(&format!("agent-{n1}"))
            .matches("fails authentication")
            .count()
            > refused_before,
        "the agent refused the lease from the controller's previous life"
    );

    // 3. A lease for node 0 delivered to node 1: refused, node 1's caps unchanged.
    proxy.inject(&n2, &captured);
    never_at(
        &stack,
        1,
        high,
        Duration::from_millis(2500),
        "after the misrouted lease",
    );
    let agent2_log = stack.logs(&format!("agent-{n2}"));
    assert!(
        agent2_log.contains("message routed controller -> ")
            || agent2_log.contains("fails authentication"),
        "node 1 says why it refused node 0's lease:\n{agent2_log}"
    );
    // And node 1's own old lease, replayed to itself after the reconnect: refused too.
    proxy.inject(&n2, &captured_for_n2);
    never_at(
        &stack,
        1,
        high_n2,
        Duration::from_millis(2500),
        "after node 1's replay",
    );

    // 4. Node 0's own key (what root on node 0 holds) cannot speak for node 1 ...
    let config = site_config(&stack);
    let key_n1 = powerflex_daemon::fsx::read_key_file(&config.agent.key_file(&n1))
        .expect("node 0's key file");
    let as_n2 = LinkPeer::connect_with_key(upstream, &key_n1, &n2, h200s(&n2, 4));
    assert!(
        as_n2.is_err(),
        "node 0's key must not open a session as node 1"
    );
    let ctld_log = std::fs::read_to_string(stack.base.join("ctld-moved.log")).expect("log");
    assert!(
        ctld_log.contains(&format!("message from {n2} fails authentication")),
        "{ctld_log}"
    );
    assert_eq!(
        live_nodes(&stack).len(),
        2,
        "node 1's real session is untouched"
    );
    // ... nor play the controller to node 1: its agent refuses the challenge.
    proxy.set_mode(Mode::Impersonate { key: key_n1 });
    proxy.cut_all();
    wait_until(
        "node 1 refuses a challenge sealed with node 0's key",
        Duration::from_secs(60),
        || {
            stack
                .logs(&format!("agent-{n2}"))
                .contains("controller challenge refused")
                .then_some(())
        },
    );
    never_at(
        &stack,
        1,
        700.0,
        Duration::from_millis(500),
        "while node 0's key plays the controller",
    );

    // 5. Version 1 peers. An agent of version 2 meeting a version 1 controller ...
    proxy.set_mode(Mode::V1Controller);
    proxy.cut_all();
    wait_until(
        "the agent refuses a version 1 controller",
        Duration::from_secs(60),
        || {
            stack
                .logs(&format!("agent-{n1}"))
                .contains("link version 1 refused; accepted: version 2")
                .then_some(())
        },
    );
    // ... and a version 1 agent meeting this controller: told in words it parses.
    let mut v1 = TcpStream::connect(upstream).expect("connect");
    v1.set_read_timeout(Some(Duration::from_secs(10)))
        .expect("timeout");
    v1.write_all(
        format!(
            "{{\"v\":1,\"from\":\"{n1}\",\"seq\":{},\"ts_ms\":{},\"body\":{{\"type\":\"hello\",\"gpus\":[]}},\"mac\":\"{}\"}}\n",
            unix_ms(),
            unix_ms(),
            "0".repeat(64)
        )
        .as_bytes(),
    )
    .expect("send");
    let mut answer = String::new();
    BufReader::new(v1)
        .read_line(&mut answer)
        .expect("an answer");
    let parsed: BTreeMap<String, serde_json::Value> =
        serde_json::from_str(answer.trim_end()).expect("a version 1 envelope");
    assert_eq!(
        parsed.get("v").and_then(|v| v.as_u64()),
        Some(2),
        "{answer}"
    );
    assert!(
        answer.contains("link version 1 refused; accepted: version 2"),
        "{answer}"
    );
    wait_until(
        "the controller logs the version 1 agent",
        Duration::from_secs(10),
        || {
            std::fs::read_to_string(stack.base.join("ctld-moved.log"))
                .ok()?
                .contains("agent speaking another link version refused")
                .then_some(())
        },
    );
    let text = metrics(metrics_addr);
    assert!(refusals(&text, "version") >= 1, "{text}");
    assert!(refusals(&text, "mac") >= 1, "{text}");
    println!(
        "refusals: version={} mac={}",
        refusals(&text, "version"),
        refusals(&text, "mac")
    );
    // Back to the real controller: both nodes live again; no job was hurt.
    proxy.set_mode(Mode::Forward);
    proxy.cut_all();
    wait_until("both agents live again", Duration::from_secs(60), || {
        (live_nodes(&stack).len() == 2).then_some(())
    });
    assert!(
        stack.running(a) && stack.running(b),
        "powerflex kills no job"
    );
}

/// Root on one GPU node holds that node's link key. It reports another user's flex0 job,
/// running on another node, as `flex3,preempt=requeue`, and announces hundreds of 5 kW
/// GPUs; believed, that would get the job requeued over and over and its GPUs capped to
/// 200 W. The controller believes a node only about the jobs Slurm places on it, and
/// counts a node's GPUs up to its gres.
#[test]
fn a_rogue_node_s_key_cannot_reach_a_job_slurm_placed_on_another_node() {
    if !can_run(&[Need::Root, Need::Slurm]) {
        return;
    }
    let mut stack = Stack::start(
        "a-rogue",
        StackOptions {
            // Room for every real GPU at its default: only a forged word could cut.
            budget_w: 6000.0,
            site: Some(hard_mode),
            ..StackOptions::default()
        },
    );
    let job = stack.submit("flex0", 1, 4, HEAVY);
    let victim = wait_until("the flex0 job managed", Duration::from_secs(60), || {
        let jobs: Vec<powerflex_proto::status::SiteJobStatus> = stack.ctl_json(&["jobs"])?;
        let j = jobs.into_iter().find(|j| j.job == job.to_string())?;
        j.nodes.first().cloned()
    });
    let names = stack.cluster.node_names().to_vec();
    let rogue_index = names
        .iter()
        .position(|n| *n != victim)
        .expect("another node");
    let rogue = names[rogue_index].clone();
    let victim_index = names.iter().position(|n| *n == victim).expect("victim");
    wait_until("the flex0 job uncapped", Duration::from_secs(30), || {
        node_caps(&stack, victim_index)
            .iter()
            .all(|&c| c == 700.0)
            .then_some(())
    });
    // Root on the rogue node: its agent stopped, its own key in hand.
    stack.kill_agent(rogue_index);
    let config = site_config(&stack);
    let key = powerflex_daemon::fsx::read_key_file(&config.agent.key_file(&rogue))
        .expect("the rogue node's key file");
    let fake_gpus: Vec<powerflex_proto::report::GpuInfo> = (0..300)
        .map(|g| powerflex_proto::report::GpuInfo {
            uuid: format!("GPU-fake-{g}"),
            name: "NVIDIA H200".into(),
            min_w: 200.0,
            max_w: 5000.0,
            default_w: 5000.0,
        })
        .collect();
    let mut peer = LinkPeer::connect_with_key(link_addr(&stack), &key, &rogue, fake_gpus)
        .expect("the rogue node's own session");
    let forged = powerflex_proto::report::JobReport {
        job_id: job.to_string(),
        tier: "flex3,preempt=requeue".into(),
        gpus: 4,
        cap_w: Some(700.0),
        power_w: Some(2800.0),
        throughput: Some(1.0),
        owner_uid: Some(0),
        ..Default::default()
    };
    // Fifteen seconds of forged reports, twice a second; the victim's GPUs sampled
    // every 50 ms meanwhile.
    let until = Instant::now() + Duration::from_secs(15);
    let mut next_report = Instant::now();
    let mut lowest_cap = f64::INFINITY;
    while Instant::now() < until {
        if Instant::now() >= next_report {
            peer.send(&Body::Report {
                jobs: vec![forged.clone()],
                power_w: 2800.0,
                failsafe: false,
                cap_mismatches: 0,
                ended: Vec::new(),
                observe_only: false,
            })
            .expect("report sent");
            next_report += Duration::from_millis(500);
            // Leases and anything else the controller sends are read and dropped.
            let _ = peer.recv_line(Duration::from_millis(1));
        }
        lowest_cap = lowest_cap.min(
            node_caps(&stack, victim_index)
                .into_iter()
                .fold(f64::INFINITY, f64::min),
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    let info = stack.cluster.job_info(job);
    assert!(stack.running(job), "the victim's job runs on: {info}");
    assert!(info.contains("Restarts=0"), "never requeued: {info}");
    assert!(
        !info.contains("tier=flex3"),
        "Slurm's record not re-tiered: {info}"
    );
    assert_eq!(lowest_cap, 700.0, "the flex0 job's GPUs were never capped");
    let nodes: Vec<NodeStatus> = stack.ctl_json(&["nodes"]).expect("nodes");
    let at_rogue = nodes
        .iter()
        .find(|n| n.node == rogue)
        .expect("the rogue node");
    assert_eq!(
        at_rogue.gpus, 4,
        "GPUs bounded by Slurm's gres: {at_rogue:?}"
    );
    assert_eq!(at_rogue.refused_gpus, 296, "{at_rogue:?}");
    assert!(
        at_rogue.refused_reports >= 20,
        "every forged report counted: {at_rogue:?}"
    );
    assert_eq!(at_rogue.jobs, 0, "{at_rogue:?}");
    let jobs: Vec<powerflex_proto::status::SiteJobStatus> =
        stack.ctl_json(&["jobs"]).expect("jobs");
    let row = jobs
        .iter()
        .find(|j| j.job == job.to_string())
        .expect("the job");
    assert_eq!(row.tier, "flex0");
    assert_eq!(row.nodes, std::slice::from_ref(&victim));
    let ctld_log = stack.logs("ctld");
    assert!(
        ctld_log.contains("a node reported a job Slurm does not place on it; refused")
            && ctld_log.contains(&rogue),
        "the controller says which node sent it:\n{ctld_log}"
    );
    drop(peer);
    stack.shutdown();
}
