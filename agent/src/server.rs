//! The agent's sockets. Acceptor threads read one bounded line per request, check who
//! the peer is (`SO_PEERCRED`), and hand the request to the control loop through a
//! crossbeam channel; status is answered from the published snapshot, so a slow reader
//! never waits on (or delays) the control loop.
//!
//! - **Control socket** (`agent.socket`): register / end-step / end-job from root only
//!   (slurmstepd, the epilog); status from anyone, and a non-root reader sees only their
//!   own jobs. One request, one reply.
//! - **Progress socket** (beside it, `*.progress`): a training job's reports, one JSON
//!   line each. A report is accepted only from a process that descends from the reported
//!   job's root-owned `slurmstepd` ([`crate::procs`]; never from the sender's own
//!   environment) and whose uid is the job owner's (checked by the control loop, which
//!   knows the owner). A refused report gets one error line and the connection is closed.
//!
//! Both sockets admit connections through `powerflex_daemon::gate`: a cap on all connections, a cap
//! per uid, and (on the control socket) slots only root may take, so one user holding
//! idle connections cannot starve other jobs' progress or slurmstepd's registrations. A
//! connection that sends nothing for its socket's idle limit is closed. Every refusal
//! and every idle close is counted ([`ServerStats`], exported as metrics).

use std::collections::VecDeque;
use std::io::{BufRead, BufReader, Write};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, RwLock};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crossbeam_channel::{bounded, Receiver, Sender, TryRecvError};
use powerflex_proto::{
    ControlAnswer, ControlOp, ControlReply, ControlRequest, ProgressReport, MAX_LINE_BYTES,
};
use tracing::{debug, warn};

use crate::procs::{step_of_pid, StepId};

use powerflex_daemon::gate::{Gate, GateLimits, Place, Refusal};
use powerflex_daemon::os::{peer_of, Peer};
use powerflex_daemon::{lines, DaemonError};

/// What the acceptors hand to the control loop.
#[derive(Debug)]
pub enum Inbound {
    Control {
        request: ControlRequest,
        peer: Peer,
        reply: Sender<ControlReply>,
    },
    Progress {
        report: ProgressReport,
        peer: Peer,
        /// The step the sending process runs in, from its ancestry (its root-owned
        /// `slurmstepd`), never from its environment.
        sender: StepId,
        /// When the line arrived: the loop may handle it later, and throughput is
        /// measured between arrivals.
        received: std::time::Instant,
        verdict: Sender<Result<(), String>>,
    },
    /// A progress line refused before reaching the loop (counted there).
    ProgressRefused { reason: String, peer: Peer },
    /// An authenticated lease from the controller for this node (see
    /// [`powerflex_agent_machine::control::LeaseMessage`]), with where the machine's verdict goes: a
    /// lease refused for its epoch is answered to the controller by the link.
    Lease {
        lease: powerflex_agent_machine::control::LeaseMessage,
        /// The lease's `walk_to_w`: the caps an announced event's plan needs per job
        /// (applied before the lease, as
        /// [`powerflex_agent_machine::control::AgentInput::PrePosition`]).
        walk_to: std::collections::BTreeMap<String, powerflex_core::Watts>,
        verdict: Sender<Result<(), powerflex_agent_machine::control::LeaseRefused>>,
    },
    /// The controller acknowledged these final shares (checked and bounded by the link):
    /// their records are written.
    Acked {
        finals: Vec<powerflex_proto::usage::FinalRef>,
    },
}

/// The status snapshot, published by the control loop and read by anyone. The lock is
/// held only to swap or clone an `Arc`, never while work is done.
pub type SnapshotCell = Arc<RwLock<Arc<powerflex_proto::status::AgentStatus>>>;

/// How long a client may take to send its line, and the loop to answer it.
const IO_TIMEOUT: Duration = Duration::from_millis(1000);

/// How soon a progress connection with reports awaiting the loop's verdict looks again:
/// a refused report is answered (and its connection closed) within this.
const VERDICT_POLL: Duration = Duration::from_millis(20);

/// Reports of one progress connection the control loop may hold unanswered; beyond
/// them the connection goes on reading (and stamping) its reports, but skips them until
/// the loop catches up.
const MAX_REPORTS_IN_FLIGHT: usize = 16;

/// Reads one request or report line of at most `MAX_LINE_BYTES`.
fn read_line(reader: &mut impl BufRead) -> Result<Option<String>, DaemonError> {
    lines::read_line(reader, MAX_LINE_BYTES)
}

fn reply(stream: &mut UnixStream, r: &ControlReply) {
    let _ = stream.write_all(r.to_line().as_bytes());
}

/// Who may hold how many connections to one socket at once.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ConnLimits {
    /// Connections served at once; more are refused, not queued.
    pub total: usize,
    /// Connections one non-root uid may hold at once.
    pub per_uid: usize,
    /// Of `total`, slots only root may take (slurmstepd's registrations, the epilog).
    pub reserved_for_root: usize,
    /// A connection that sends no complete line for this long is closed.
    pub idle: Duration,
}

impl ConnLimits {
    /// The admission limits: one pool, `reserved_for_root` of it root's alone.
    pub const fn gate(&self) -> GateLimits {
        GateLimits::shared(self.total, self.per_uid, self.reserved_for_root)
    }
}

/// The control socket: one request per connection. Registrations come from root and
/// must never wait behind users' status requests, so half the slots are root's.
pub const CONTROL_LIMITS: ConnLimits = ConnLimits {
    total: 64,
    per_uid: 4,
    reserved_for_root: 32,
    idle: IO_TIMEOUT,
};

/// The progress socket: long-lived connections, usually one per job (rank 0), at most
/// one per GPU. 16 per uid covers a user with two 8-GPU jobs on one node reporting from
/// every rank; 256 in all covers 16 such users. A job whose steps take longer than the
/// idle limit reconnects at its next report (the client library does).
pub const PROGRESS_LIMITS: ConnLimits = ConnLimits {
    total: 256,
    per_uid: 16,
    reserved_for_root: 0,
    idle: Duration::from_secs(300),
};

/// Connection refusals and idle closes of one socket, for the metrics.
#[derive(Debug, Default)]
pub struct SocketStats {
    pub refused_full: AtomicU64,
    pub refused_per_uid: AtomicU64,
    /// Connections closed for sending nothing within the idle limit.
    pub timed_out: AtomicU64,
    /// Progress reports read and never handed to the control loop: held back while the
    /// loop held 16 of their connection's reports, then superseded by a newer one
    /// (progress is cumulative: the newer count carries them).
    pub reports_skipped: AtomicU64,
}

/// The metric label of a refusal: a user over their own cap (`per_uid`), or no place
/// open to the peer (`full`).
fn refusal_label(why: Refusal) -> &'static str {
    match why {
        Refusal::UidFull { .. } => "per_uid",
        Refusal::Full { .. } | Refusal::UsersFull { .. } | Refusal::RootFull { .. } => "full",
    }
}

impl SocketStats {
    fn refused(&self, why: Refusal) {
        match refusal_label(why) {
            "per_uid" => &self.refused_per_uid,
            _ => &self.refused_full,
        }
        .fetch_add(1, Ordering::Relaxed);
    }
}

/// Both sockets' counters, shared by the acceptors and the metrics server.
#[derive(Debug, Default)]
pub struct ServerStats {
    pub control: SocketStats,
    pub progress: SocketStats,
}

/// Identifies an accepted connection's peer and admits it, or refuses it (counted,
/// logged at debug: a flood must not flood the log too).
fn admit(
    stream: &UnixStream,
    gate: &Arc<Gate>,
    stats: &SocketStats,
    socket: &'static str,
) -> Result<(Peer, Place), String> {
    let peer = peer_of(stream).map_err(|e| format!("cannot identify the peer: {e}"))?;
    match gate.enter(peer.uid) {
        Ok(place) => Ok((peer, place)),
        Err(why) => {
            stats.refused(why);
            debug!(
                socket,
                pid = peer.pid,
                uid = peer.uid,
                reason = refusal_label(why),
                "connection refused"
            );
            Err(match why {
                Refusal::UidFull { uid, open } => format!(
                    "agent busy: uid {uid} holds {open} connections to this socket, the most one user may"
                ),
                _ => "agent busy: too many connections".to_string(),
            })
        }
    }
}

/// Serves the control socket until `shutdown`.
pub fn spawn_control(
    listener: UnixListener,
    tx: Sender<Inbound>,
    snapshot: SnapshotCell,
    stats: Arc<ServerStats>,
    shutdown: Arc<AtomicBool>,
) -> std::io::Result<JoinHandle<()>> {
    // A blocking accept: a request is served the moment it arrives (a polling accept
    // added up to 10 ms to every srun). `run` wakes it at shutdown by connecting.
    listener.set_nonblocking(false)?;
    let gate = Gate::new(CONTROL_LIMITS.gate());
    std::thread::Builder::new()
        .name("control-accept".into())
        .spawn(move || {
            while !shutdown.load(Ordering::SeqCst) {
                match listener.accept() {
                    Ok(_) if shutdown.load(Ordering::SeqCst) => break,
                    Ok((mut stream, _)) => {
                        let (peer, place) = match admit(&stream, &gate, &stats.control, "control") {
                            Ok(admitted) => admitted,
                            Err(why) => {
                                // Never block the acceptor on a refused peer.
                                let _ = stream.set_nonblocking(true);
                                reply(&mut stream, &ControlReply::error(why));
                                continue;
                            }
                        };
                        let (tx, snapshot, stats) = (tx.clone(), snapshot.clone(), stats.clone());
                        let _ = std::thread::Builder::new()
                            .name("control-conn".into())
                            .spawn(move || {
                                let _place = place;
                                serve_control(stream, peer, &tx, &snapshot, &stats.control);
                            });
                    }
                    Err(e) => {
                        warn!(error = %e, "control socket accept failed");
                        std::thread::sleep(Duration::from_millis(100));
                    }
                }
            }
        })
}

fn serve_control(
    mut stream: UnixStream,
    peer: Peer,
    tx: &Sender<Inbound>,
    snapshot: &SnapshotCell,
    stats: &SocketStats,
) {
    let _ = stream.set_nonblocking(false);
    let _ = stream.set_write_timeout(Some(IO_TIMEOUT));
    let line = match stream
        .try_clone()
        .map_err(DaemonError::io_on(
            "cannot read from",
            "the control connection",
        ))
        .and_then(|r| {
            // The whole request within the idle limit, not each read: a peer trickling
            // a byte a second would otherwise hold its slot for an hour.
            read_line(&mut BufReader::new(lines::DeadlineReader::new(
                &r,
                CONTROL_LIMITS.idle,
            )))
        }) {
        Ok(Some(line)) => line,
        Ok(None) => return,
        Err(e) if e.is_timeout() => {
            stats.timed_out.fetch_add(1, Ordering::Relaxed);
            debug!(
                pid = peer.pid,
                uid = peer.uid,
                "control connection sent no request in time"
            );
            return;
        }
        Err(e) => {
            warn!(pid = peer.pid, uid = peer.uid, error = %e, "control request refused");
            reply(&mut stream, &ControlReply::error(e.to_string()));
            return;
        }
    };
    let request = match ControlRequest::from_line(&line) {
        Ok(r) => r,
        Err(e) => {
            warn!(pid = peer.pid, uid = peer.uid, error = %e, "malformed control request");
            reply(&mut stream, &ControlReply::error(e.to_string()));
            return;
        }
    };
    if request.op == ControlOp::Status {
        let snap = snapshot.read().map(|s| Arc::clone(&s)).ok();
        // Need-to-know: a user sees their own jobs only; root (admins, tests) sees all.
        let answer = snap.map_or(ControlAnswer::Empty, |s| {
            ControlAnswer::Status(Box::new(powerflex_agent_machine::control::seen_by(
                &s, peer.uid,
            )))
        });
        reply(&mut stream, &ControlReply::Done(answer));
        return;
    }
    if peer.uid != 0 {
        warn!(
            pid = peer.pid,
            uid = peer.uid,
            "non-root peer tried to change job state"
        );
        reply(
            &mut stream,
            &ControlReply::error("only root (slurmstepd, the job epilog) may register or end jobs"),
        );
        return;
    }
    let (reply_tx, reply_rx) = bounded(1);
    if tx
        .send_timeout(
            Inbound::Control {
                request,
                peer,
                reply: reply_tx,
            },
            IO_TIMEOUT,
        )
        .is_err()
    {
        reply(&mut stream, &ControlReply::error("agent busy"));
        return;
    }
    let answer = reply_rx
        .recv_timeout(IO_TIMEOUT)
        .unwrap_or_else(|_| ControlReply::error("agent did not answer in time"));
    reply(&mut stream, &answer);
}

/// Serves the progress socket until `shutdown`.
pub fn spawn_progress(
    listener: UnixListener,
    tx: Sender<Inbound>,
    stats: Arc<ServerStats>,
    shutdown: Arc<AtomicBool>,
) -> std::io::Result<JoinHandle<()>> {
    // Blocking, as the control socket's; woken at shutdown the same way.
    listener.set_nonblocking(false)?;
    let gate = Gate::new(PROGRESS_LIMITS.gate());
    std::thread::Builder::new()
        .name("progress-accept".into())
        .spawn(move || {
            while !shutdown.load(Ordering::SeqCst) {
                match listener.accept() {
                    Ok(_) if shutdown.load(Ordering::SeqCst) => break,
                    Ok((mut stream, _)) => {
                        let (peer, place) = match admit(&stream, &gate, &stats.progress, "progress")
                        {
                            Ok(admitted) => admitted,
                            Err(why) => {
                                let _ = stream.set_nonblocking(true);
                                write_error(&mut stream, &why);
                                continue;
                            }
                        };
                        let (tx, shutdown, stats) = (tx.clone(), shutdown.clone(), stats.clone());
                        let _ = std::thread::Builder::new()
                            .name("progress-conn".into())
                            .spawn(move || {
                                let _place = place;
                                // The step this connection's process runs in, from its
                                // ancestry, read once: the kernel keeps a process's parent
                                // chain, the process cannot rewrite it.
                                let sender = step_of_pid(Path::new("/proc"), peer.pid);
                                serve_progress(
                                    stream,
                                    peer,
                                    sender,
                                    &tx,
                                    &stats.progress,
                                    &shutdown,
                                );
                            });
                    }
                    Err(e) => {
                        warn!(error = %e, "progress socket accept failed");
                        std::thread::sleep(Duration::from_millis(100));
                    }
                }
            }
        })
}

fn write_error(stream: &mut UnixStream, reason: &str) {
    let _ = stream.write_all(ControlReply::error(reason).to_line().as_bytes());
}

/// Refuses a report the control loop has not seen (so the loop counts it too).
fn refuse(stream: &mut UnixStream, tx: &Sender<Inbound>, peer: Peer, reason: String) {
    write_error(stream, &reason);
    let _ = tx.try_send(Inbound::ProgressRefused { reason, peer });
}

fn serve_progress(
    mut stream: UnixStream,
    peer: Peer,
    sender: Option<StepId>,
    tx: &Sender<Inbound>,
    stats: &SocketStats,
    shutdown: &AtomicBool,
) {
    let _ = stream.set_nonblocking(false);
    let _ = stream.set_write_timeout(Some(IO_TIMEOUT));
    let Ok(read_half) = stream.try_clone() else {
        return;
    };
    let mut reader = BufReader::new(read_half);
    let mut last_line = Instant::now();
    // Reports handed to the control loop whose verdicts have not come back, oldest
    // first. Each line is read (and its arrival time taken) as soon as it comes, never
    // after the loop's verdict on the one before: a loop busy for 200 ms would otherwise
    // stamp every report queued behind it late, and a rate measured from arrival times
    // would read slow (on a loaded machine, measured PFIs come out 10 % off that way).
    let mut pending: VecDeque<Receiver<Result<(), String>>> = VecDeque::new();
    // The newest report read while the loop held MAX_REPORTS_IN_FLIGHT of this
    // connection's, with its arrival time: handed on once the loop answers, unless a
    // newer one comes first (progress is cumulative, so the newer one carries it).
    let mut held: Option<(ProgressReport, StepId, Instant)> = None;
    let mut partial = Vec::new();
    let mut read_timeout = None;
    while !shutdown.load(Ordering::SeqCst) {
        // A refused report ends the connection with its reason.
        if let Err(reason) = collect_verdicts(&mut pending) {
            return write_error(&mut stream, &reason);
        }
        if pending.len() < MAX_REPORTS_IN_FLIGHT {
            if let Some((report, sender, received)) = held.take() {
                hand_on(tx, &mut pending, report, peer, sender, received);
            }
        }
        // Short reads while verdicts are due, so a refusal is answered within
        // VERDICT_POLL; otherwise within a second, so shutdown and the idle limit are
        // noticed. A line cut by a timeout goes on at the next read.
        let timeout = if pending.is_empty() {
            Duration::from_secs(1)
        } else {
            VERDICT_POLL
        };
        if read_timeout != Some(timeout) {
            let _ = stream.set_read_timeout(Some(timeout));
            read_timeout = Some(timeout);
        }
        let line = match lines::read_line_resuming(&mut reader, &mut partial, MAX_LINE_BYTES) {
            Ok(Some(line)) => line,
            Ok(None) => {
                // The peer sent its last line (and may wait for an answer): a report held
                // back goes on if the loop has room, and the reports still awaiting the
                // loop get their verdicts, within IO_TIMEOUT in all.
                if let Err(reason) = collect_verdicts(&mut pending) {
                    return write_error(&mut stream, &reason);
                }
                if let Some((report, sender, received)) = held.take() {
                    if pending.len() < MAX_REPORTS_IN_FLIGHT {
                        hand_on(tx, &mut pending, report, peer, sender, received);
                    } else {
                        stats.reports_skipped.fetch_add(1, Ordering::Relaxed);
                    }
                }
                let deadline = Instant::now() + IO_TIMEOUT;
                for verdict in pending {
                    let left = deadline.saturating_duration_since(Instant::now());
                    if let Ok(Err(reason)) = verdict.recv_timeout(left) {
                        return write_error(&mut stream, &reason);
                    }
                }
                return;
            }
            Err(e) if e.is_timeout() => {
                if last_line.elapsed() >= PROGRESS_LIMITS.idle {
                    stats.timed_out.fetch_add(1, Ordering::Relaxed);
                    debug!(
                        pid = peer.pid,
                        uid = peer.uid,
                        "idle progress connection closed"
                    );
                    return;
                }
                continue;
            }
            Err(e) => return refuse(&mut stream, tx, peer, e.to_string()),
        };
        let received = Instant::now();
        last_line = received;
        let report = match ProgressReport::from_line(&line) {
            Ok(r) => r,
            Err(e) => return refuse(&mut stream, tx, peer, e.to_string()),
        };
        let Some(sender) = sender.clone().filter(|s| s.job == report.job_id) else {
            let reason = format!(
                "process {} runs in {}, not in job {}: a report counts only from the job's own processes (descendants of its slurmstepd)",
                peer.pid,
                sender
                    .as_ref()
                    .map_or("no Slurm job".to_string(), |s| format!("job {}", s.job)),
                report.job_id
            );
            return refuse(&mut stream, tx, peer, reason);
        };
        // Verdicts that came back while this line was read free their places first.
        if let Err(reason) = collect_verdicts(&mut pending) {
            return write_error(&mut stream, &reason);
        }
        // A loop this far behind gets no more of this connection's reports until it
        // answers some (one connection cannot fill the loop's queue). The reader never
        // waits for it: a reader that waited read the queued reports in a clump once the
        // loop caught up, and a rate taken from such arrival times read hundreds of times
        // too fast (the clumps looked like the job's pace, the waits like pauses). The
        // newest report is held back, stamped; an older one held is superseded (progress
        // is cumulative: the newer count carries it).
        let superseded = held.is_some();
        if pending.len() >= MAX_REPORTS_IN_FLIGHT {
            held = Some((report, sender, received));
        } else {
            held = None;
            hand_on(tx, &mut pending, report, peer, sender, received);
        }
        if superseded {
            stats.reports_skipped.fetch_add(1, Ordering::Relaxed);
            debug!(
                in_flight = pending.len(),
                "control loop behind: a held-back progress report superseded"
            );
        }
    }
}

/// Takes the verdicts the control loop has given, oldest first, up to the first still
/// due; a refusal's reason is returned, and ends the connection.
fn collect_verdicts(pending: &mut VecDeque<Receiver<Result<(), String>>>) -> Result<(), String> {
    while let Some(verdict) = pending.front() {
        match verdict.try_recv() {
            Ok(Err(reason)) => return Err(reason),
            Err(TryRecvError::Empty) => break,
            Ok(Ok(())) | Err(TryRecvError::Disconnected) => {
                pending.pop_front();
            }
        }
    }
    Ok(())
}

/// Hands one stamped report to the control loop and keeps its verdict's receiver. A
/// full loop queue drops it: progress is cumulative, the next report carries it.
fn hand_on(
    tx: &Sender<Inbound>,
    pending: &mut VecDeque<Receiver<Result<(), String>>>,
    report: ProgressReport,
    peer: Peer,
    sender: StepId,
    received: Instant,
) {
    let (verdict_tx, verdict_rx) = bounded(1);
    if tx
        .try_send(Inbound::Progress {
            report,
            peer,
            sender,
            received,
            verdict: verdict_tx,
        })
        .is_err()
    {
        debug!("control loop busy: progress report dropped");
        return;
    }
    pending.push_back(verdict_rx);
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Step 0 of job 7, the sender of the progress tests' reports.
    fn job_7_step() -> StepId {
        StepId {
            job: "7".into(),
            step: "0".into(),
            cluster: None,
        }
    }

    /// One progress report line of job 7 with `tokens` so far.
    fn report_line(tokens: u64) -> String {
        format!("{{\"v\":1,\"job_id\":\"7\",\"tokens\":{tokens},\"steps\":1}}\n")
    }

    /// A client that sends its line and closes its side at once still gets the loop's
    /// refusal (seen in `only_root_changes_jobs_and_progress_must_come_from_the_job`).
    #[test]
    fn a_refusal_reaches_a_client_that_sent_its_last_line() {
        let (mut job, agent_end) = UnixStream::pair().expect("socket pair");
        let (tx, rx) = bounded(16);
        let stats = SocketStats::default();
        let shutdown = AtomicBool::new(false);
        let step = job_7_step();
        let peer = Peer { pid: 1, uid: 1000 };
        std::thread::scope(|scope| {
            scope.spawn(|| serve_progress(agent_end, peer, Some(step), &tx, &stats, &shutdown));
            job.write_all(report_line(1).as_bytes()).expect("write");
            job.shutdown(std::net::Shutdown::Write).expect("shutdown");
            let Ok(Inbound::Progress { verdict, .. }) = rx.recv_timeout(Duration::from_secs(5))
            else {
                panic!("a progress report");
            };
            // The loop answers after the connection has seen the end of the stream.
            std::thread::sleep(Duration::from_millis(100));
            verdict
                .send(Err("uid 1000 may not report for job 7".into()))
                .expect("verdict");
            let mut answer = String::new();
            BufReader::new(&job)
                .read_line(&mut answer)
                .expect("error line");
            assert!(answer.contains("may not report"), "{answer}");
        });
    }

    /// The connection reads the next report without waiting for the loop's verdict on
    /// the last: a connection that waited would, behind a busy loop, stamp every report
    /// queued behind it late, and the measured rates (and PFIs) would come out wrong on
    /// a loaded machine.
    #[test]
    fn a_report_is_stamped_when_it_arrives_not_when_the_loop_is_free() {
        let (mut job, agent_end) = UnixStream::pair().expect("socket pair");
        let (tx, rx) = bounded(16);
        let stats = SocketStats::default();
        let shutdown = AtomicBool::new(false);
        let peer = Peer { pid: 1, uid: 1000 };
        let step = job_7_step();
        std::thread::scope(|scope| {
            scope.spawn(|| serve_progress(agent_end, peer, Some(step), &tx, &stats, &shutdown));
            let line = report_line;
            // Three reports 100 ms apart, the third in two writes around a pause longer
            // than the connection's short read.
            let sent = Instant::now();
            job.write_all(line(100).as_bytes()).expect("write");
            std::thread::sleep(Duration::from_millis(100));
            job.write_all(line(200).as_bytes()).expect("write");
            std::thread::sleep(Duration::from_millis(100));
            let third = line(300);
            job.write_all(&third.as_bytes()[..10]).expect("write");
            std::thread::sleep(Duration::from_millis(60));
            job.write_all(&third.as_bytes()[10..]).expect("write");
            // A loop busy for 400 ms per report: a connection waiting for each verdict
            // would read the second report only after the first verdict, 400 ms late.
            let mut stamps = Vec::new();
            let mut verdicts = Vec::new();
            for _ in 0..3 {
                let Ok(Inbound::Progress {
                    report,
                    received,
                    verdict,
                    ..
                }) = rx.recv_timeout(Duration::from_secs(5))
                else {
                    panic!("a progress report");
                };
                stamps.push((report.tokens, received.duration_since(sent)));
                verdicts.push(verdict);
                std::thread::sleep(Duration::from_millis(400));
            }
            assert_eq!(
                stamps.iter().map(|s| s.0).collect::<Vec<_>>(),
                [100, 200, 300],
                "every report, the split one whole"
            );
            assert!(
                stamps[2].1 < Duration::from_millis(600),
                "stamped on arrival, not after the verdicts: {stamps:?}"
            );
            // A refusal still ends the connection with its reason.
            verdicts[0].send(Ok(())).expect("verdict");
            verdicts[1]
                .send(Err("no job 7 on this node".into()))
                .expect("verdict");
            let mut answer = String::new();
            BufReader::new(&job)
                .read_line(&mut answer)
                .expect("error line");
            assert!(answer.contains("no job 7 on this node"), "{answer}");
        });
    }

    /// Sets the flag when dropped, so a failed assertion ends the connection's thread
    /// at once instead of after the idle limit.
    struct ShutdownOnDrop<'a>(&'a AtomicBool);

    impl Drop for ShutdownOnDrop<'_> {
        fn drop(&mut self) {
            self.0.store(true, Ordering::SeqCst);
        }
    }

    #[test]
    fn a_loop_far_behind_never_holds_the_reader_and_gets_the_newest_report_after() {
        let (mut job, agent_end) = UnixStream::pair().expect("socket pair");
        let (tx, rx) = bounded(64);
        let stats = SocketStats::default();
        let shutdown = AtomicBool::new(false);
        let peer = Peer { pid: 1, uid: 1000 };
        let step = job_7_step();
        std::thread::scope(|scope| {
            scope.spawn(|| serve_progress(agent_end, peer, Some(step), &tx, &stats, &shutdown));
            let _stop = ShutdownOnDrop(&shutdown);
            let line = report_line;
            // A loop that answers nothing while the job sends 20 reports.
            let mut sent = Vec::new();
            for k in 1..=20u64 {
                sent.push(Instant::now());
                job.write_all(line(k * 100).as_bytes()).expect("write");
                std::thread::sleep(Duration::from_millis(10));
            }
            let mut verdicts = Vec::new();
            while let Ok(Inbound::Progress {
                report, verdict, ..
            }) = rx.recv_timeout(Duration::from_millis(300))
            {
                assert!(report.tokens <= 1600, "only the first 16 are handed on");
                verdicts.push(verdict);
            }
            assert_eq!(verdicts.len(), MAX_REPORTS_IN_FLIGHT);
            // The reader went on reading: 17 was held back, then superseded by 18, 19
            // and 20 in turn.
            assert_eq!(stats.reports_skipped.load(Ordering::Relaxed), 3);
            // The loop catches up a second after the backlog began: the newest report
            // held back comes with the time it arrived, then the next ones as they
            // arrive, not in a clump behind the backlog.
            std::thread::sleep(Duration::from_millis(700));
            for v in verdicts {
                v.send(Ok(())).expect("verdict");
            }
            for k in 21..=23u64 {
                sent.push(Instant::now());
                job.write_all(line(k * 100).as_bytes()).expect("write");
                std::thread::sleep(Duration::from_millis(100));
            }
            let mut got = Vec::new();
            while let Ok(Inbound::Progress {
                report, received, ..
            }) = rx.recv_timeout(Duration::from_secs(2))
            {
                got.push((report.tokens, received));
            }
            let tokens: Vec<u64> = got.iter().map(|g| g.0).collect();
            // 21 may be read before the reader sees the verdicts: then it supersedes 20.
            assert!(
                tokens == [2000, 2100, 2200, 2300] || tokens == [2100, 2200, 2300],
                "{tokens:?}"
            );
            for (tokens, received) in got {
                let at = sent[(tokens / 100 - 1) as usize];
                assert!(received >= at, "stamped after it was sent");
                // Stamped on arrival: the loop sat on 16 reports for a second, and a
                // report stamped when it was handed on would be that late.
                assert!(
                    received.duration_since(at) < Duration::from_millis(500),
                    "report {tokens} stamped {:?} after it was sent",
                    received.duration_since(at)
                );
            }
        });
    }

    #[test]
    fn shipped_limits_leave_room_for_others() {
        for l in [CONTROL_LIMITS, PROGRESS_LIMITS] {
            assert!(l.per_uid < l.total - l.reserved_for_root, "{l:?}");
        }
        const { assert!(CONTROL_LIMITS.reserved_for_root > 0) };
        // The pool's shape: users up to total − reserved, root anywhere in it.
        assert_eq!(
            CONTROL_LIMITS.gate(),
            GateLimits {
                per_uid: 4,
                users: 32,
                root: 64,
                total: 64
            }
        );
        assert_eq!(PROGRESS_LIMITS.gate().users, PROGRESS_LIMITS.total);
    }
}
