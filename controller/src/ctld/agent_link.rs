//! The agent link (TCP, protocol `powerflex_proto::link` v2), bounded.
//!
//! - **Handshakes in one thread.** A single thread accepts and carries every connection
//!   through the handshake (open → challenge → hello under the session key) with
//!   non-blocking sockets and `poll(2)`: an unauthenticated peer costs a descriptor and at
//!   most [`MAX_HANDSHAKE_LINE_BYTES`] of buffer, never a thread. At most
//!   [`LinkLimits::max_pending`] wait at once; a newer connection takes the place of the
//!   oldest one that has not yet shown a valid open (a flood cannot keep an agent out,
//!   since an agent's handshake takes one round trip). Each must finish within
//!   [`LinkLimits::handshake_timeout`].
//! - **Threads only for authenticated nodes.** After its hello, a node gets a reader and
//!   a writer thread, at most [`LinkLimits::max_sessions`] sessions in all and one per
//!   node (a new session replaces the node's old one). A session silent for
//!   [`LinkLimits::idle_timeout`] ends.
//! - Every refusal is counted by reason ([`Refusals`]) and logged.

use std::collections::BTreeMap;
use std::io::{BufReader, Cursor, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::os::fd::AsFd;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crossbeam_channel::{bounded, Receiver, RecvTimeoutError, Sender};
use rustix::event::{PollFd, PollFlags, Timespec};
use tracing::{debug, info, warn};

use powerflex_daemon::{lines, DaemonError};
use powerflex_proto::link::{
    controller_accept, fresh_nonce, v1_refusal_line, Body, LinkError, Session,
    MAX_HANDSHAKE_LINE_BYTES, MAX_LINK_LINE_BYTES,
};

use super::bounds::Refusals;
use super::{unix_ms, Inbound};

/// Bounds on the agent link.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LinkLimits {
    /// Connections in the handshake at once.
    pub max_pending: usize,
    /// Longest a connection may take from accept to its hello under the session key.
    pub handshake_timeout: Duration,
    /// Authenticated sessions at once (one per node; two threads each).
    pub max_sessions: usize,
    /// A session that sends nothing for this long ends (agents report every allocation
    /// period).
    pub idle_timeout: Duration,
}

impl Default for LinkLimits {
    fn default() -> LinkLimits {
        LinkLimits {
            max_pending: 512,
            handshake_timeout: Duration::from_secs(5),
            max_sessions: 4096,
            idle_timeout: Duration::from_secs(120),
        }
    }
}

/// Leases queued for one agent at most; more means it stopped reading.
const WRITER_QUEUE: usize = 64;

/// What the link thread shares with the sessions it starts.
struct Shared {
    tx: Sender<Inbound>,
    refusals: Arc<Refusals>,
    limits: LinkLimits,
    shutdown: Arc<AtomicBool>,
    /// Live sessions (reader threads).
    live: AtomicUsize,
    /// Whether this controller steers: while not, an agent's hello is answered
    /// `standby` and the connection closed.
    steering: Arc<AtomicBool>,
    /// The current session of each node: its id and a handle to end it.
    current: Mutex<BTreeMap<String, (u64, TcpStream)>>,
    next_id: std::sync::atomic::AtomicU64,
}

/// Accepts agents until `shutdown` (see the module docs). [`super::run`] wakes the
/// thread at shutdown by connecting to the listener.
pub(crate) fn spawn(
    link: TcpListener,
    tx: Sender<Inbound>,
    site_key: Vec<u8>,
    limits: LinkLimits,
    refusals: Arc<Refusals>,
    shutdown: Arc<AtomicBool>,
    steering: Arc<AtomicBool>,
) -> std::io::Result<JoinHandle<()>> {
    link.set_nonblocking(true)?;
    let shared = Arc::new(Shared {
        tx,
        refusals,
        limits,
        shutdown,
        steering,
        live: AtomicUsize::new(0),
        current: Mutex::new(BTreeMap::new()),
        next_id: std::sync::atomic::AtomicU64::new(1),
    });
    std::thread::Builder::new()
        .name("link-handshake".into())
        .spawn(move || {
            handshakes(&link, &site_key, &shared);
            // Shutting down: end the sessions too (their readers block in read).
            for (_, (_, stream)) in shared
                .current
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .iter()
            {
                let _ = stream.shutdown(std::net::Shutdown::Both);
            }
        })
}

/// Where a connection is in the handshake.
enum Stage {
    /// Waiting for the agent's open.
    Open,
    /// Challenge sent; waiting for the hello under this session.
    Hello(Session),
}

struct Pending {
    stream: TcpStream,
    peer: SocketAddr,
    buf: Vec<u8>,
    deadline: Instant,
    accepted: Instant,
    stage: Stage,
}

/// What became of a pending connection after its bytes were read.
enum Next {
    Wait,
    Close,
    /// Authenticated: the session, the node's GPUs, and bytes after the hello.
    Ready(Session, Vec<powerflex_proto::report::GpuInfo>, Vec<u8>),
}

fn handshakes(listener: &TcpListener, site_key: &[u8], shared: &Arc<Shared>) {
    let mut pending: Vec<Pending> = Vec::new();
    loop {
        if shared.shutdown.load(Ordering::SeqCst) {
            return;
        }
        let now = Instant::now();
        let wait = pending
            .iter()
            .map(|p| p.deadline.saturating_duration_since(now))
            .min();
        let mut ready = vec![false; pending.len()];
        let listener_ready = {
            let mut fds: Vec<PollFd<'_>> = Vec::with_capacity(pending.len() + 1);
            fds.push(PollFd::new(listener, PollFlags::IN));
            for p in &pending {
                fds.push(PollFd::from_borrowed_fd(p.stream.as_fd(), PollFlags::IN));
            }
            let timeout = wait.and_then(|w| Timespec::try_from(w).ok());
            match rustix::event::poll(&mut fds, timeout.as_ref()) {
                Ok(_) => {}
                Err(rustix::io::Errno::INTR) => continue,
                Err(e) => {
                    warn!(error = %e, "agent link poll failed");
                    std::thread::sleep(Duration::from_millis(100));
                    continue;
                }
            }
            for (i, fd) in fds.iter().enumerate().skip(1) {
                ready[i - 1] = !fd.revents().is_empty();
            }
            fds.first().is_some_and(|fd| !fd.revents().is_empty())
        };
        if shared.shutdown.load(Ordering::SeqCst) {
            return;
        }
        // Serve the waiting connections first, then drop the expired, then accept.
        let mut keep = Vec::with_capacity(pending.len());
        for (mut p, is_ready) in pending.into_iter().zip(ready) {
            let next = if is_ready {
                advance(&mut p, site_key, shared)
            } else {
                Next::Wait
            };
            match next {
                Next::Wait if Instant::now() >= p.deadline => {
                    shared.refusals.count("handshake_timeout");
                    debug!(peer = %p.peer, "agent link handshake not finished in time; closed");
                }
                Next::Wait => keep.push(p),
                Next::Close => {}
                Next::Ready(session, gpus, rest) => start_session(p, session, gpus, rest, shared),
            }
        }
        pending = keep;
        if listener_ready {
            accept_all(listener, &mut pending, shared);
        }
    }
}

fn accept_all(listener: &TcpListener, pending: &mut Vec<Pending>, shared: &Shared) {
    // A bounded batch per wake, so waiting handshakes are served between batches.
    for _ in 0..256 {
        match listener.accept() {
            Ok((stream, peer)) => {
                if shared.shutdown.load(Ordering::SeqCst) {
                    return;
                }
                if stream.set_nonblocking(true).is_err() {
                    continue;
                }
                let _ = stream.set_nodelay(true);
                if pending.len() >= shared.limits.max_pending.max(1) {
                    // Take back the place of the oldest connection that has not shown a
                    // valid open (else the oldest of all): a flood of idle connections
                    // then costs only its own members their place.
                    let victim = pending
                        .iter()
                        .enumerate()
                        .filter(|(_, p)| matches!(p.stage, Stage::Open))
                        .min_by_key(|(_, p)| p.accepted)
                        .or_else(|| pending.iter().enumerate().min_by_key(|(_, p)| p.accepted))
                        .map(|(i, _)| i);
                    if let Some(i) = victim {
                        let gone = pending.swap_remove(i);
                        shared.refusals.count("pending_cap");
                        debug!(peer = %gone.peer, pending = shared.limits.max_pending, "agent link handshake slot taken back for a newer connection");
                    }
                }
                let now = Instant::now();
                pending.push(Pending {
                    stream,
                    peer,
                    buf: Vec::new(),
                    deadline: now + shared.limits.handshake_timeout,
                    accepted: now,
                    stage: Stage::Open,
                });
            }
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => return,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => {
                // Out of descriptors and the like: say so; the next poll retries.
                warn!(error = %e, "agent link accept failed");
                return;
            }
        }
    }
}

/// Reads what a pending connection sent and moves its handshake on.
fn advance(p: &mut Pending, site_key: &[u8], shared: &Shared) -> Next {
    let mut chunk = [0u8; 16 * 1024];
    loop {
        match p.stream.read(&mut chunk) {
            Ok(0) => return Next::Close,
            Ok(n) => p.buf.extend_from_slice(chunk.get(..n).unwrap_or_default()),
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => break,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(_) => return Next::Close,
        }
        // Lines are taken out below; past one whole frame's worth, stop reading.
        if p.buf.len() > MAX_HANDSHAKE_LINE_BYTES {
            break;
        }
    }
    while let Some(end) = p.buf.iter().position(|b| *b == b'\n') {
        let line_bytes: Vec<u8> = p.buf.drain(..=end).collect();
        let line = String::from_utf8_lossy(&line_bytes);
        match std::mem::replace(&mut p.stage, Stage::Open) {
            Stage::Open => {
                let nonce = match fresh_nonce() {
                    Ok(n) => n,
                    Err(e) => {
                        warn!(error = %e, "agent link handshake impossible");
                        return Next::Close;
                    }
                };
                match controller_accept(site_key, &line, nonce, unix_ms()) {
                    Ok((session, challenge)) => {
                        // The challenge is a few hundred bytes into an empty send
                        // buffer: it goes at once, or the peer is not a live agent.
                        if p.stream.write_all(challenge.as_bytes()).is_err() {
                            return Next::Close;
                        }
                        p.stage = Stage::Hello(session);
                    }
                    Err(e) => return refuse(p, &e, shared),
                }
            }
            Stage::Hello(mut session) => {
                match session.open_limited(&line, unix_ms(), MAX_HANDSHAKE_LINE_BYTES) {
                    Ok(Body::Hello { gpus }) => {
                        return Next::Ready(session, gpus, std::mem::take(&mut p.buf))
                    }
                    Ok(other) => {
                        let e = LinkError::Unexpected {
                            expected: "hello",
                            got: other.kind(),
                        };
                        return refuse(p, &e, shared);
                    }
                    Err(e) => return refuse(p, &e, shared),
                }
            }
        }
    }
    if p.buf.len() > MAX_HANDSHAKE_LINE_BYTES {
        let e = LinkError::TooLarge {
            bytes: p.buf.len(),
            limit_bytes: MAX_HANDSHAKE_LINE_BYTES,
        };
        return refuse(p, &e, shared);
    }
    Next::Wait
}

fn refuse(p: &mut Pending, e: &LinkError, shared: &Shared) -> Next {
    shared.refusals.count(e.reason());
    if matches!(e, LinkError::Version { .. }) {
        // Tell a version 1 agent in words it parses, then close.
        let _ = p.stream.write_all(v1_refusal_line().as_bytes());
        warn!(peer = %p.peer, error = %e, "agent speaking another link version refused");
    } else {
        warn!(peer = %p.peer, error = %e, reason = e.reason(), "agent link handshake refused");
    }
    Next::Close
}

fn start_session(
    mut p: Pending,
    mut session: Session,
    gpus: Vec<powerflex_proto::report::GpuInfo>,
    rest: Vec<u8>,
    shared: &Arc<Shared>,
) {
    let node = session.peer().to_string();
    if !shared.steering.load(Ordering::SeqCst) {
        // A standby (or one that stepped down) answers an authenticated agent in typed
        // words, so it moves on to its next controller address at once.
        if let Ok(line) = session.seal(
            &Body::Standby {
                reason: "this controller is not active".into(),
            },
            unix_ms(),
        ) {
            let _ = p.stream.set_nonblocking(false);
            let _ = p.stream.set_write_timeout(Some(Duration::from_secs(1)));
            let _ = p.stream.write_all(line.as_bytes());
        }
        debug!(peer = %p.peer, %node, "agent sent on: this controller does not steer");
        let _ = p.stream.shutdown(std::net::Shutdown::Both);
        return;
    }
    // A node's new session replaces its old one, so it never counts against the cap.
    let replacing = shared
        .current
        .lock()
        .unwrap_or_else(PoisonError::into_inner)
        .contains_key(&node);
    if !replacing && shared.live.load(Ordering::SeqCst) >= shared.limits.max_sessions {
        shared.refusals.count("session_cap");
        warn!(peer = %p.peer, %node, max_sessions = shared.limits.max_sessions, "agent session refused: the controller serves this many at once");
        return;
    }
    let (Ok(read_half), Ok(handle)) = (p.stream.try_clone(), p.stream.try_clone()) else {
        return;
    };
    if read_half.set_nonblocking(false).is_err() {
        return;
    }
    let id = shared
        .next_id
        .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    if let Some((_, old)) = shared
        .current
        .lock()
        .unwrap_or_else(PoisonError::into_inner)
        .insert(node.clone(), (id, handle))
    {
        // One session per node: the newer one (it proved the key just now) wins.
        let _ = old.shutdown(std::net::Shutdown::Both);
    }
    shared.live.fetch_add(1, Ordering::SeqCst);
    let shared2 = Arc::clone(shared);
    let peer = p.peer;
    let write_half = p.stream;
    let spawned = std::thread::Builder::new()
        .name(format!("link-{node}"))
        .spawn(move || {
            serve_session(
                read_half, write_half, peer, session, gpus, rest, id, &shared2,
            );
            shared2.live.fetch_sub(1, Ordering::SeqCst);
        });
    if let Err(e) = spawned {
        // Out of threads: refuse this session, keep serving the others.
        shared.live.fetch_sub(1, Ordering::SeqCst);
        shared.refusals.count("session_cap");
        warn!(error = %e, "cannot start an agent session thread; refused");
    }
}

#[allow(clippy::too_many_arguments)]
fn serve_session(
    read_half: TcpStream,
    write_half: TcpStream,
    peer: SocketAddr,
    session: Session,
    gpus: Vec<powerflex_proto::report::GpuInfo>,
    rest: Vec<u8>,
    id: u64,
    shared: &Shared,
) {
    let node = session.peer().to_string();
    let _ = read_half.set_read_timeout(Some(shared.limits.idle_timeout));
    let _ = write_half.set_nonblocking(false);
    let _ = write_half.set_write_timeout(Some(Duration::from_secs(2)));
    let (writer_tx, writer_rx): (Sender<Body>, Receiver<Body>) = bounded(WRITER_QUEUE);
    let ended = Arc::new(AtomicBool::new(false));
    let writer = {
        let (mut sealer, ended) = (session.clone(), ended.clone());
        let mut stream = write_half;
        std::thread::Builder::new()
            .name(format!("link-w-{node}"))
            .spawn(move || loop {
                match writer_rx.recv_timeout(Duration::from_millis(500)) {
                    Ok(body) => {
                        let Ok(line) = sealer.seal(&body, unix_ms()) else {
                            continue;
                        };
                        if stream.write_all(line.as_bytes()).is_err() {
                            let _ = stream.shutdown(std::net::Shutdown::Both);
                            return;
                        }
                    }
                    Err(RecvTimeoutError::Timeout) if ended.load(Ordering::SeqCst) => return,
                    Err(RecvTimeoutError::Timeout) => {}
                    Err(RecvTimeoutError::Disconnected) => return,
                }
            })
    };
    let Ok(writer) = writer else {
        shared.refusals.count("session_cap");
        return;
    };
    info!(%peer, %node, "agent authenticated (link v2 session)");
    let _ = shared.tx.send(Inbound::Hello {
        node: node.clone(),
        gpus,
        writer: writer_tx,
    });
    let mut opener = session;
    let mut reader = BufReader::new(Cursor::new(rest).chain(read_half));
    // The highest lease epoch whose refusal this connection passed on: the node is
    // fenced for this controller from the first, so a refusal of that epoch or an older
    // one says nothing new, and a node repeating or varying them must not fill the log
    // or the loop's queue. (The leader asks the database about its own epoch once.)
    let mut refused_up_to: Option<u64> = None;
    while !shared.shutdown.load(Ordering::SeqCst) {
        let line = match lines::read_line(&mut reader, MAX_LINK_LINE_BYTES) {
            Ok(Some(line)) => line,
            Ok(None) => break,
            Err(e @ DaemonError::LineTooLong { .. }) => {
                shared.refusals.count("oversize");
                warn!(%peer, %node, error = %e, "oversized message from an agent; connection closed");
                break;
            }
            Err(e) => {
                debug!(%peer, %node, error = %e, "agent connection ended");
                break;
            }
        };
        match opener.open(&line, unix_ms()) {
            Ok(Body::Report {
                jobs,
                power_w,
                ended,
                observe_only,
                ..
            }) => {
                let _ = shared.tx.send(Inbound::Report {
                    node: node.clone(),
                    jobs,
                    power_w,
                    ended,
                    observe_only,
                });
            }
            Ok(Body::Fenced {
                lease_epoch,
                accepted_epoch,
            }) => {
                if refused_up_to.is_some_and(|up_to| lease_epoch <= up_to) {
                    continue;
                }
                refused_up_to = Some(lease_epoch);
                warn!(%peer, %node, lease_epoch, accepted_epoch, "the agent refuses this controller's leases for their epoch");
                let _ = shared.tx.send(Inbound::Fenced {
                    node: node.clone(),
                    lease_epoch,
                    accepted_epoch,
                });
            }
            Ok(other) => {
                shared.refusals.count("unexpected");
                warn!(%peer, %node, kind = other.kind(), "unexpected message from an agent ignored");
            }
            Err(e) => {
                // Within a session a bad frame is tampering on the path: end it; the agent
                // reconnects with a fresh handshake.
                shared.refusals.count(e.reason());
                warn!(%peer, %node, error = %e, reason = e.reason(), "agent message refused; connection closed");
                break;
            }
        }
    }
    ended.store(true, Ordering::SeqCst);
    let mut current = shared
        .current
        .lock()
        .unwrap_or_else(PoisonError::into_inner);
    if let Some((current_id, stream)) = current.get(&node) {
        if *current_id == id {
            let _ = stream.shutdown(std::net::Shutdown::Both);
            current.remove(&node);
        }
    }
    drop(current);
    let _ = writer.join();
}
