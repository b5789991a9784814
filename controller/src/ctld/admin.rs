//! The admin socket (Unix): `powerflexctl` reads status (anyone) and changes the budget
//! and grid events (root only, by `SO_PEERCRED`). One request line, one reply line, in
//! the versioned protocol of `powerflex_proto::admin`.

use std::io::{BufRead, BufReader, Read, Write};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crossbeam_channel::{bounded, Sender};

use powerflex_proto::admin::{AdminOp, AdminReply, AdminRequest, MAX_ADMIN_REQUEST_BYTES};

use super::Inbound;

/// Accepts admin connections until `shutdown`, one thread per connection.
pub(crate) fn spawn(
    admin: UnixListener,
    tx: Sender<Inbound>,
    shutdown: Arc<AtomicBool>,
) -> JoinHandle<()> {
    std::thread::spawn(move || {
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
    })
}

fn serve_admin(mut stream: UnixStream, tx: &Sender<Inbound>) {
    let _ = stream.set_read_timeout(Some(Duration::from_secs(2)));
    let _ = stream.set_write_timeout(Some(Duration::from_secs(2)));
    let uid = powerflex_daemon::os::peer_of(&stream).map_or(u32::MAX, |p| p.uid);
    let mut line = String::new();
    let reply = match stream.try_clone().map(BufReader::new).and_then(|r| {
        r.take(MAX_ADMIN_REQUEST_BYTES as u64 + 1)
            .read_line(&mut line)
    }) {
        Err(e) => AdminReply::error(e.to_string()),
        Ok(_) => match AdminRequest::from_line(&line) {
            Err(e) => AdminReply::error(e.to_string()),
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
    let _ = stream.write_all(reply.to_line().as_bytes());
}

/// Sends one admin request to the controller at `socket` and returns its reply.
pub fn request(socket: &Path, op: &AdminOp) -> Result<AdminReply, String> {
    let mut stream = UnixStream::connect(socket)
        .map_err(|e| format!("cannot reach powerflex-ctld at {}: {e}", socket.display()))?;
    let _ = stream.set_read_timeout(Some(Duration::from_secs(10)));
    let line = AdminRequest::new(op.clone()).to_line();
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
