//! The admin socket (Unix): `powerflexctl` reads status (anyone; a non-root caller reads
//! the site and their own jobs, see [`powerflex_controller_machine::controller::owners`]) and changes the budget and grid
//! events (root only, by `SO_PEERCRED`). One request line, one reply line, in the
//! versioned protocol of `powerflex_proto::admin`. Connections are admitted by
//! `powerflex_daemon::gate` (a few per user, an allowance of root's own); a refused one gets
//! a reply saying why, and the request must arrive within one deadline.
//!
//! `history` is answered here, on the connection's thread, from the
//! [`HistoryBoard`]: the one request whose answer grows with the site is kept out of the
//! allocation loop. Every other request is the core's.

use std::io::{BufReader, Write};
use std::os::unix::net::{UnixListener, UnixStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

use crossbeam_channel::{bounded, Sender};
use tracing::warn;

use powerflex_daemon::lines;

use powerflex_proto::admin::{AdminOp, AdminReply, AdminRequest, MAX_ADMIN_REQUEST_BYTES};

use super::bounds::{admin_refusal, AdminLimits, Refusals};
use super::Inbound;
use powerflex_controller_machine::controller::history::HistoryBoard;
use powerflex_daemon::gate::Gate;
use powerflex_daemon::lines::DeadlineReader;

/// Accepts admin connections until `shutdown`, one thread per admitted connection (so at
/// most `limits.unprivileged + limits.root`). The accept blocks; [`super::run`] wakes it
/// at shutdown by connecting to the socket itself.
pub(crate) fn spawn(
    admin: UnixListener,
    tx: Sender<Inbound>,
    history: HistoryBoard,
    limits: AdminLimits,
    refusals: Arc<Refusals>,
    shutdown: Arc<AtomicBool>,
) -> std::io::Result<JoinHandle<()>> {
    let gate = Gate::new(limits.gate());
    std::thread::Builder::new()
        .name("admin-accept".into())
        .spawn(move || loop {
            let accepted = admin.accept();
            if shutdown.load(Ordering::SeqCst) {
                return;
            }
            match accepted {
                Ok((mut stream, _)) => {
                    let uid = powerflex_daemon::os::peer_of(&stream).map_or(u32::MAX, |p| p.uid);
                    let _ = stream.set_write_timeout(Some(limits.io_timeout));
                    let place = match gate.enter(uid) {
                        Ok(place) => place,
                        Err(refusal) => {
                            // Refused in the acceptor, without a thread: a short reply
                            // into an empty socket buffer, bounded by the write timeout.
                            let (reason, message) = admin_refusal(refusal, &limits);
                            refusals.count(reason);
                            let _ =
                                stream.write_all(AdminReply::error(message).to_line().as_bytes());
                            continue;
                        }
                    };
                    let (tx, history, counts) = (tx.clone(), history.clone(), refusals.clone());
                    let spawned =
                        std::thread::Builder::new()
                            .name("admin".into())
                            .spawn(move || {
                                // The place is held until the reply is out.
                                let _place = place;
                                serve_admin(stream, uid, &tx, &history, &counts, &limits);
                            });
                    if let Err(e) = spawned {
                        refusals.count("admin_cap");
                        warn!(error = %e, "cannot start an admin thread; connection refused");
                    }
                }
                Err(e) => {
                    // Out of descriptors and the like: say so, and do not spin on it.
                    warn!(error = %e, "admin socket accept failed");
                    std::thread::sleep(Duration::from_millis(100));
                }
            }
        })
}

fn serve_admin(
    mut stream: UnixStream,
    uid: u32,
    tx: &Sender<Inbound>,
    history: &HistoryBoard,
    refusals: &Refusals,
    limits: &AdminLimits,
) {
    let _ = stream.set_write_timeout(Some(limits.io_timeout));
    let read = lines::read_line(
        &mut BufReader::new(DeadlineReader::new(&stream, limits.io_timeout)),
        MAX_ADMIN_REQUEST_BYTES,
    );
    let reply = match read {
        Err(e) if e.is_timeout() => {
            refusals.count("admin_timeout");
            AdminReply::error(format!(
                "admin request not received within {} ms",
                limits.io_timeout.as_millis()
            ))
        }
        Err(e) => AdminReply::error(format!("admin request: {e}")),
        Ok(None) => return,
        Ok(Some(line)) => match AdminRequest::from_line(&line) {
            Err(e) => AdminReply::error(e.to_string()),
            // From the board, filtered for `uid` there: never queued to the core.
            Ok(AdminRequest {
                op:
                    AdminOp::History {
                        since_ms,
                        max_samples,
                    },
                ..
            }) => history.answer(since_ms, max_samples, uid),
            Ok(request) => {
                let (reply_tx, reply_rx) = bounded(1);
                if tx
                    .send_timeout(
                        Inbound::Admin {
                            op: request.op,
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
    // What a non-root caller may read was decided by the core, which knows the jobs'
    // owners, or for the history by the board with the owners the core last published
    // (both by `powerflex_controller_machine::controller::owners`).
    let _ = stream.write_all(reply.to_line().as_bytes());
}
