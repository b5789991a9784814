//! The agent's side of the controller link (protocol: `powerflex_proto::link`, v2).
//!
//! One thread keeps a TCP connection to the controller. On each connection it runs the
//! handshake with this node's own key (its nonce, the controller's challenge, a session
//! key of both), then says hello (the node's GPUs), reports the node's jobs every
//! allocation period, and hands every authenticated lease for this node from the
//! controller to the control loop. A reader thread per connection turns bytes into
//! lines. On any failure the connection is dropped and the next controller address
//! tried (`controller.listen`, then `controller.standby_addresses`): a standby
//! answers a hello with `Body::Standby`, a controller whose leases this node refuses for
//! their epoch is told so (`Body::Fenced`), and one that sent no lease for
//! [`LinkOptions::silent_after`] is left (a frozen or cut-off controller keeps the
//! connection open without a word); an address that did not answer is set aside that
//! long while another may steer. Once every address has been tried, the next round
//! waits 1 s when some controller answered (a takeover is under way), or backs off
//! exponentially (1 s to 30 s) when none could be reached. Meanwhile the caps already
//! granted hold until their lease runs out, then the control loop applies the fail-safe
//! cap. Frames that fail authentication
//! (forged, or recorded on an earlier connection), are replayed, stale, or name another
//! node are logged and ignored.

use powerflex_daemon::clock::unix_ms;
use std::collections::BTreeMap;
use std::io::{BufReader, Write};
use std::net::{SocketAddr, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crossbeam_channel::{unbounded, Receiver, Sender};
use powerflex_core::Watts;
use powerflex_daemon::lines::read_line;
use powerflex_proto::link::{
    fresh_nonce, AgentHandshake, Body, LinkError, Session, MAX_HANDSHAKE_LINE_BYTES,
    MAX_LINK_LINE_BYTES,
};
use powerflex_proto::report::{GpuInfo, NodeReport};
use tracing::{info, warn};

use crate::server::{Inbound, SnapshotCell};
use powerflex_agent_machine::control::LeaseRefused;

/// What the link needs to know.
#[derive(Debug, Clone)]
pub struct LinkOptions {
    /// Every controller's link address, `controller.listen` first, then
    /// `controller.standby_addresses`: tried in turn until one steers.
    pub controllers: Vec<SocketAddr>,
    /// This node's own link key (contents of `agent.key_file`, made by `powerflexctl
    /// link-key` from the site key).
    pub key: Vec<u8>,
    pub node: String,
    pub report_period: Duration,
    pub gpus: Vec<GpuInfo>,
    /// With more than one controller address: a session in which no lease came for this
    /// long is left for the next address. A steering controller renews every lease each
    /// allocation period; one frozen or cut off by a partition keeps the connection open
    /// without a word (TCP notices only after many minutes) while a standby takes over.
    pub silent_after: Duration,
}

impl LinkOptions {
    /// [`LinkOptions::silent_after`] for a site: a quarter of the lease, and at least
    /// three allocation periods. A standby steers within half a lease of the active
    /// controller's end (`[controller.ha]`), so an agent that leaves at a quarter finds
    /// it before its last lease runs out.
    pub fn silence_for(lease_ttl: Duration, report_period: Duration) -> Duration {
        (lease_ttl / 4).max(report_period * 3)
    }
}

/// Longest wait for the controller's challenge after the agent's open.
pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(5);

/// What makes the link report at once rather than at its period: a lease applied (the
/// caps read back confirm it) and a new step that put a job's curve in question (the
/// controller plans that job anew).
fn report_at_once_counters(snapshot: &SnapshotCell) -> (u64, u64) {
    snapshot
        .read()
        .map(|s| (s.leases_applied, s.curve_questions))
        .unwrap_or((0, 0))
}

/// The report the link sends now: the status's ([`NodeReport::of`]) as `Body::Report`.
fn report(snapshot: &SnapshotCell, turn: usize) -> Body {
    // The status taken out of the lock first: the control loop publishes into it, and
    // waits for no report being built.
    let status = snapshot.read().map(|s| Arc::clone(&s));
    match status {
        Ok(status) => NodeReport::of(&status, turn).into(),
        // A loop that panicked while publishing: nothing to say but that the node is here.
        Err(_) => NodeReport::default().into(),
    }
}

/// Runs the link until `shutdown`.
pub fn spawn(
    options: LinkOptions,
    snapshot: SnapshotCell,
    tx: Sender<Inbound>,
    shutdown: Arc<AtomicBool>,
) -> std::io::Result<JoinHandle<()>> {
    std::thread::Builder::new().name("controller-link".into()).spawn(move || {
        let count = options.controllers.len();
        if count == 0 {
            warn!("no controller address; the link stays down");
            return;
        }
        let mut backoff = Duration::from_secs(1);
        let mut next = 0usize;
        // Per address: set aside until then after it did not answer (or went silent),
        // while another address may steer: a frozen controller accepts connections
        // and then says nothing, and would cost a handshake timeout every round.
        let mut set_aside: Vec<Option<Instant>> = vec![None; count];
        // When some address last answered (a standby that answers now may steer in a
        // moment: no backoff while one does), and how many were tried this round.
        let mut last_answer: Option<Instant> = None;
        let mut tried = 0usize;
        while !shutdown.load(Ordering::SeqCst) {
            let open = |aside: &[Option<Instant>], i: usize| {
                aside[i].is_none_or(|t| Instant::now() >= t)
            };
            let index = (0..count)
                .map(|k| (next + k) % count)
                .find(|&i| open(&set_aside, i))
                .unwrap_or(next % count);
            next = index + 1;
            let controller = options.controllers[index];
            let ended = match TcpStream::connect_timeout(&controller, Duration::from_secs(2)) {
                Ok(stream) => {
                    info!(%controller, "connected to the controller");
                    serve(stream, controller, &options, &snapshot, &tx, &shutdown)
                }
                Err(e) => {
                    warn!(%controller, error = %e, "cannot reach the controller");
                    Ended::Unresponsive
                }
            };
            match ended {
                Ended::Steered => {
                    backoff = Duration::from_secs(1);
                    warn!(%controller, "controller link lost; caps hold until their lease ends");
                }
                Ended::NotActive => {}
                Ended::Unresponsive if count > 1 => {
                    set_aside[index] = Some(Instant::now() + options.silent_after);
                }
                Ended::Unresponsive => {}
            }
            if ended != Ended::Unresponsive {
                last_answer = Some(Instant::now());
                set_aside[index] = None;
            }
            tried += 1;
            let open_now = (0..count).filter(|&i| open(&set_aside, i)).count().max(1);
            if tried < open_now {
                // The next address at once: the active controller may be there.
                continue;
            }
            let answered = last_answer.is_some_and(|t| t.elapsed() < options.silent_after);
            let wait = if answered { Duration::from_secs(1) } else { backoff };
            if !answered {
                warn!(retry_s = wait.as_secs(), "no controller reachable");
                backoff = (backoff * 2).min(Duration::from_secs(30));
            }
            tried = 0;
            let until = Instant::now() + wait;
            while Instant::now() < until && !shutdown.load(Ordering::SeqCst) {
                std::thread::sleep(Duration::from_millis(50));
            }
        }
    })
}

fn send(stream: &mut TcpStream, session: &mut Session, body: &Body) -> bool {
    match session.seal(body, unix_ms()) {
        Ok(line) => stream.write_all(line.as_bytes()).is_ok(),
        Err(e) => {
            warn!(error = %e, kind = body.kind(), "cannot seal a message to the controller");
            false
        }
    }
}

/// Runs the agent's half of the handshake on a fresh connection: sends this node's
/// open, waits up to [`HANDSHAKE_TIMEOUT`] for the controller's challenge. Every failure
/// is logged with what to check.
fn handshake(
    stream: &mut TcpStream,
    reader: &mut BufReader<TcpStream>,
    options: &LinkOptions,
) -> Option<Session> {
    let nonce = match fresh_nonce() {
        Ok(n) => n,
        Err(e) => {
            warn!(error = %e, "no link handshake");
            return None;
        }
    };
    let (state, open) = match AgentHandshake::start(&options.key, &options.node, nonce, unix_ms()) {
        Ok(started) => started,
        Err(e) => {
            warn!(error = %e, node = %options.node, "no link handshake");
            return None;
        }
    };
    if stream.write_all(open.as_bytes()).is_err() {
        return None;
    }
    let _ = reader.get_ref().set_read_timeout(Some(HANDSHAKE_TIMEOUT));
    let line = match read_line(reader, MAX_HANDSHAKE_LINE_BYTES) {
        Ok(Some(line)) => line,
        Ok(None) => {
            warn!(
                node = %options.node,
                "the controller closed the link during the handshake: check that agent.key_file holds this node's key (powerflexctl link-key --node {}) and that the controller speaks link version 2",
                options.node
            );
            return None;
        }
        Err(e) => {
            warn!(
                error = %e,
                timeout_s = HANDSHAKE_TIMEOUT.as_secs(),
                "no link version 2 challenge from the controller in time (a version 1 controller never answers); this agent accepts link version 2 only"
            );
            return None;
        }
    };
    let _ = reader.get_ref().set_read_timeout(None);
    match state.finish(&line, unix_ms()) {
        Ok(session) => Some(session),
        Err(e @ LinkError::Version { .. }) => {
            warn!(error = %e, "the controller speaks another link version; refused");
            None
        }
        Err(e) => {
            warn!(error = %e, "controller challenge refused");
            None
        }
    }
}

/// The first refusal among the machine's verdicts that have come back; verdicts not in
/// yet stay, those in (and those whose loop is gone) are dropped.
fn refused_lease(verdicts: &mut Vec<Receiver<Result<(), LeaseRefused>>>) -> Option<LeaseRefused> {
    let mut refused = None;
    verdicts.retain(|rx| match rx.try_recv() {
        Ok(Err(r)) => {
            refused.get_or_insert(r);
            false
        }
        Ok(Ok(())) | Err(crossbeam_channel::TryRecvError::Disconnected) => false,
        Err(crossbeam_channel::TryRecvError::Empty) => true,
    });
    refused
}

/// How a connection to a controller ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Ended {
    /// A session with a controller that steered (or might have): lost.
    Steered,
    /// The controller answered that it does not steer (a standby), or its leases were
    /// refused for their epoch (fenced).
    NotActive,
    /// No session (unreachable, or no handshake), or a session in which no lease came
    /// for [`LinkOptions::silent_after`].
    Unresponsive,
}

fn serve(
    mut stream: TcpStream,
    controller: SocketAddr,
    options: &LinkOptions,
    snapshot: &SnapshotCell,
    tx: &Sender<Inbound>,
    shutdown: &AtomicBool,
) -> Ended {
    let _ = stream.set_write_timeout(Some(Duration::from_secs(2)));
    let Ok(read_half) = stream.try_clone() else {
        return Ended::Unresponsive;
    };
    let mut reader = BufReader::new(read_half);
    let Some(mut session) = handshake(&mut stream, &mut reader, options) else {
        let _ = stream.shutdown(std::net::Shutdown::Both);
        return Ended::Unresponsive;
    };
    info!(node = %options.node, "link v2 session with the controller established");
    let (lines_tx, lines_rx) = unbounded::<String>();
    let reader = std::thread::spawn(move || {
        // A line longer than the limit ends the connection rather than memory.
        while let Ok(Some(line)) = read_line(&mut reader, MAX_LINK_LINE_BYTES) {
            if lines_tx.send(line).is_err() {
                return;
            }
        }
    });
    if !send(
        &mut stream,
        &mut session,
        &Body::Hello {
            gpus: options.gpus.clone(),
        },
    ) {
        let _ = stream.shutdown(std::net::Shutdown::Both);
        let _ = reader.join();
        return Ended::Unresponsive;
    }
    let mut next_report = Instant::now();
    let mut turn: usize = 0;
    let mut reported_counters = report_at_once_counters(snapshot);
    // The machine's verdicts on the leases handed to it, oldest first.
    let mut verdicts: Vec<Receiver<Result<(), LeaseRefused>>> = Vec::new();
    let mut ended = Ended::Steered;
    let mut last_lease = Instant::now();
    let followable = options.controllers.len() > 1;
    while !shutdown.load(Ordering::SeqCst) {
        if followable && last_lease.elapsed() >= options.silent_after {
            warn!(
                %controller,
                silent_s = last_lease.elapsed().as_secs_f64(),
                "no lease from this controller for a quarter of a lease; looking for the active controller"
            );
            ended = Ended::Unresponsive;
            break;
        }
        if let Some(refused) = refused_lease(&mut verdicts) {
            // Fencing: this controller lost leadership to a later one. It is told in
            // typed words (it steps down), and the agent looks for the active one.
            let LeaseRefused::StaleEpoch {
                lease_epoch,
                accepted_epoch,
            } = refused;
            let _ = send(
                &mut stream,
                &mut session,
                &Body::Fenced {
                    lease_epoch,
                    accepted_epoch,
                },
            );
            warn!(
                %controller,
                lease_epoch,
                accepted_epoch,
                "this controller's leases are refused for their epoch; looking for the active controller"
            );
            ended = Ended::NotActive;
            break;
        }
        // A lease just applied is confirmed at once (the caps read back are in the
        // report), not at the next period: the controller holds increases until then.
        // A job's curve put in question by a new step is told at once too.
        let counters = report_at_once_counters(snapshot);
        if counters != reported_counters {
            reported_counters = counters;
            next_report = Instant::now();
        }
        if Instant::now() >= next_report {
            next_report = Instant::now() + options.report_period;
            let body = report(snapshot, turn);
            turn = turn.wrapping_add(1);
            if !send(&mut stream, &mut session, &body) {
                break;
            }
        }
        match lines_rx.recv_timeout(Duration::from_millis(20)) {
            Ok(line) => match session.open(&line, unix_ms()) {
                Ok(body) => match body {
                    Body::Lease {
                        node,
                        caps,
                        ttl_s,
                        start_cap_w,
                        recalibrate,
                        learn,
                        next_event_in_s,
                        walk_to_w,
                        event_in_force,
                        epoch,
                    } => {
                        // A lease for another node (misrouted, or replayed from there)
                        // would set this node's caps from another node's share.
                        if node != options.node {
                            warn!(lease_node = %node, node = %options.node, "lease for another node refused");
                            continue;
                        }
                        let caps: BTreeMap<String, Watts> =
                            caps.into_iter().map(|(job, w)| (job, Watts(w))).collect();
                        let (verdict, verdict_rx) = crossbeam_channel::bounded(1);
                        let lease = powerflex_agent_machine::control::LeaseMessage {
                            caps,
                            ttl_s,
                            start_cap: start_cap_w.map(Watts),
                            recalibrate,
                            learn,
                            next_event_in_s,
                            event_in_force,
                            epoch,
                        };
                        let walk_to = walk_to_w
                            .into_iter()
                            .map(|(job, w)| (job, Watts(w)))
                            .collect();
                        if tx
                            .send(Inbound::Lease {
                                lease,
                                walk_to,
                                verdict,
                            })
                            .is_ok()
                        {
                            verdicts.push(verdict_rx);
                        }
                        last_lease = Instant::now();
                    }
                    Body::Standby { reason } => {
                        info!(%controller, %reason, "the controller does not steer; looking for the active controller");
                        ended = Ended::NotActive;
                        break;
                    }
                    Body::Acked { finals } => {
                        // Bounded and checked before it reaches the loop: a malformed
                        // acknowledgement drops nothing.
                        match powerflex_proto::report::validate_acks(&finals) {
                            Ok(()) => {
                                let _ = tx.send(Inbound::Acked { finals });
                            }
                            Err(e) => {
                                warn!(error = %e, "acknowledgement from the controller refused")
                            }
                        }
                    }
                    other => warn!(
                        kind = other.kind(),
                        "unexpected message from the controller ignored"
                    ),
                },
                Err(e) => warn!(error = %e, reason = e.reason(), "controller message refused"),
            },
            Err(crossbeam_channel::RecvTimeoutError::Timeout) => {}
            Err(crossbeam_channel::RecvTimeoutError::Disconnected) => break,
        }
    }
    let _ = stream.shutdown(std::net::Shutdown::Both);
    let _ = reader.join();
    ended
}
