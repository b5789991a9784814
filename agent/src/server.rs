//! The agent's sockets. Acceptor threads read one bounded line per request, check who
//! the peer is (`SO_PEERCRED`), and hand the request to the control loop through a
//! crossbeam channel; status is answered from the published snapshot, so a slow reader
//! never waits on (or delays) the control loop.
//!
//! - **Control socket** (`agent.socket`): register / end-step / end-job from root only
//!   (slurmstepd, the epilog); status from anyone. One request, one reply.
//! - **Progress socket** (beside it, `*.progress`): a training job's reports, one JSON
//!   line each. A report is accepted only from a process whose environment carries the
//!   reported job's `SLURM_JOB_ID` (read from `/proc/<pid>/environ`) and whose uid is the
//!   job owner's (checked by the control loop, which knows the owner). A refused report
//!   gets one error line and the connection is closed.

use std::io::{BufRead, BufReader, Write};
use std::os::unix::net::{UnixListener, UnixStream};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, RwLock};
use std::thread::JoinHandle;
use std::time::Duration;

use crossbeam_channel::{bounded, Sender};
use powerflex_proto::{ControlOp, ControlReply, ControlRequest, ProgressReport, MAX_LINE_BYTES};
use tracing::{debug, warn};

use crate::persist::process_job_id;

pub use powerflex_daemon::os::{peer_of, Peer};
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
        /// When the line arrived: the loop may handle it later, and throughput is
        /// measured between arrivals.
        received: std::time::Instant,
        verdict: Sender<Result<(), String>>,
    },
    /// A progress line refused before reaching the loop (counted there).
    ProgressRefused { reason: String, peer: Peer },
    /// An authenticated lease from the controller for this node: per-job caps for
    /// `ttl_s`, and the cap for a job it does not name.
    Lease {
        caps: std::collections::BTreeMap<String, powerflex_core::Watts>,
        ttl_s: f64,
        start_cap: Option<powerflex_core::Watts>,
        /// Jobs to walk again (their measurements left their curves).
        recalibrate: Vec<String>,
        /// Jobs that may be probed to learn their curves (on this node alone).
        learn: Vec<String>,
    },
}

/// The status snapshot, published by the control loop and read by anyone. The lock is
/// held only to swap or clone an `Arc`, never while work is done.
pub type SnapshotCell = Arc<RwLock<Arc<crate::control::Snapshot>>>;

/// Most connections served at once per socket; more are refused, not queued.
const MAX_CONNECTIONS: usize = 64;
/// How long a client may take to send its line, and the loop to answer it.
const IO_TIMEOUT: Duration = Duration::from_millis(1000);

/// Reads one request or report line of at most `MAX_LINE_BYTES`.
fn read_line(reader: &mut impl BufRead) -> Result<Option<String>, DaemonError> {
    lines::read_line(reader, MAX_LINE_BYTES)
}

fn reply(stream: &mut UnixStream, r: &ControlReply) {
    let _ = stream.write_all(r.to_line().as_bytes());
}

struct Slot(Arc<AtomicUsize>);

impl Drop for Slot {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

fn take_slot(active: &Arc<AtomicUsize>) -> Option<Slot> {
    if active.fetch_add(1, Ordering::SeqCst) >= MAX_CONNECTIONS {
        active.fetch_sub(1, Ordering::SeqCst);
        return None;
    }
    Some(Slot(active.clone()))
}

/// Serves the control socket until `shutdown`.
pub fn spawn_control(
    listener: UnixListener,
    tx: Sender<Inbound>,
    snapshot: SnapshotCell,
    shutdown: Arc<AtomicBool>,
) -> std::io::Result<JoinHandle<()>> {
    // A blocking accept: a request is served the moment it arrives (a polling accept
    // added up to 10 ms to every srun). `run` wakes it at shutdown by connecting.
    listener.set_nonblocking(false)?;
    let active = Arc::new(AtomicUsize::new(0));
    std::thread::Builder::new()
        .name("control-accept".into())
        .spawn(move || {
            while !shutdown.load(Ordering::SeqCst) {
                match listener.accept() {
                    Ok(_) if shutdown.load(Ordering::SeqCst) => break,
                    Ok((mut stream, _)) => {
                        let Some(slot) = take_slot(&active) else {
                            reply(
                                &mut stream,
                                &ControlReply::error("agent busy: too many connections"),
                            );
                            continue;
                        };
                        let (tx, snapshot) = (tx.clone(), snapshot.clone());
                        let _ = std::thread::Builder::new()
                            .name("control-conn".into())
                            .spawn(move || {
                                let _slot = slot;
                                serve_control(stream, &tx, &snapshot);
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

fn serve_control(mut stream: UnixStream, tx: &Sender<Inbound>, snapshot: &SnapshotCell) {
    let _ = stream.set_nonblocking(false);
    let _ = stream.set_read_timeout(Some(IO_TIMEOUT));
    let _ = stream.set_write_timeout(Some(IO_TIMEOUT));
    let peer = match peer_of(&stream) {
        Ok(p) => p,
        Err(e) => {
            reply(
                &mut stream,
                &ControlReply::error(format!("cannot identify the peer: {e}")),
            );
            return;
        }
    };
    let line = match stream
        .try_clone()
        .map_err(DaemonError::io_on(
            "cannot read from",
            "the control connection",
        ))
        .and_then(|r| read_line(&mut BufReader::new(r)))
    {
        Ok(Some(line)) => line,
        Ok(None) => return,
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
        let status = snap.map(|s| (*s).clone());
        reply(
            &mut stream,
            &ControlReply {
                status,
                ..ControlReply::ok()
            },
        );
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
    shutdown: Arc<AtomicBool>,
) -> std::io::Result<JoinHandle<()>> {
    // Blocking, as the control socket's; woken at shutdown the same way.
    listener.set_nonblocking(false)?;
    let active = Arc::new(AtomicUsize::new(0));
    std::thread::Builder::new()
        .name("progress-accept".into())
        .spawn(move || {
            while !shutdown.load(Ordering::SeqCst) {
                match listener.accept() {
                    Ok(_) if shutdown.load(Ordering::SeqCst) => break,
                    Ok((stream, _)) => {
                        let Some(slot) = take_slot(&active) else {
                            continue;
                        };
                        let (tx, shutdown) = (tx.clone(), shutdown.clone());
                        let _ = std::thread::Builder::new()
                            .name("progress-conn".into())
                            .spawn(move || {
                                let _slot = slot;
                                serve_progress(stream, &tx, &shutdown);
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

fn serve_progress(mut stream: UnixStream, tx: &Sender<Inbound>, shutdown: &AtomicBool) {
    let _ = stream.set_nonblocking(false);
    let _ = stream.set_read_timeout(Some(Duration::from_secs(1)));
    let _ = stream.set_write_timeout(Some(IO_TIMEOUT));
    let Ok(peer) = peer_of(&stream) else { return };
    let Ok(read_half) = stream.try_clone() else {
        return;
    };
    let mut reader = BufReader::new(read_half);
    // The job this connection's process belongs to, read once.
    let process_job = process_job_id(peer.pid);
    while !shutdown.load(Ordering::SeqCst) {
        let line = match read_line(&mut reader) {
            Ok(Some(line)) => line,
            Ok(None) => return,
            Err(e) if e.is_timeout() => continue,
            Err(e) => return refuse(&mut stream, tx, peer, e.to_string()),
        };
        let received = std::time::Instant::now();
        let report = match ProgressReport::from_line(&line) {
            Ok(r) => r,
            Err(e) => return refuse(&mut stream, tx, peer, e.to_string()),
        };
        if process_job.as_deref() != Some(report.job_id.as_str()) {
            let reason = format!(
                "process {} belongs to job {}, not job {}",
                peer.pid,
                process_job.as_deref().unwrap_or("(none)"),
                report.job_id
            );
            return refuse(&mut stream, tx, peer, reason);
        }
        let (verdict_tx, verdict_rx) = bounded(1);
        if tx
            .try_send(Inbound::Progress {
                report,
                peer,
                received,
                verdict: verdict_tx,
            })
            .is_err()
        {
            debug!("control loop busy: progress report dropped");
            continue;
        }
        if let Ok(Err(reason)) = verdict_rx.recv_timeout(IO_TIMEOUT) {
            // The loop refused (and counted) it.
            return write_error(&mut stream, &reason);
        }
    }
}
