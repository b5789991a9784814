//! The agent link (TCP): each connection says hello, then reports; every message must
//! carry a valid HMAC under the site key with a rising sequence number per node
//! (`powerflex_proto::link`). Leases go back over the same connection.

use std::collections::BTreeMap;
use std::io::{BufReader, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::thread::JoinHandle;
use std::time::Duration;

use crossbeam_channel::{unbounded, Receiver, Sender};
use serde::Deserialize;
use tracing::{debug, warn};

use powerflex_daemon::{lines, DaemonError};
use powerflex_proto::link::{Body, Envelope, MAX_LINK_LINE_BYTES};

use super::{unix_ms, Inbound};

/// Accepts agent connections until `shutdown`, one thread per connection. The accept
/// blocks (an agent's hello is served the moment it arrives); [`super::run`] wakes it at
/// shutdown by connecting to the listener itself.
pub(crate) fn spawn(
    link: TcpListener,
    tx: Sender<Inbound>,
    key: Vec<u8>,
    shutdown: Arc<AtomicBool>,
) -> std::io::Result<JoinHandle<()>> {
    let last_seq: Arc<Mutex<BTreeMap<String, u64>>> = Arc::new(Mutex::new(BTreeMap::new()));
    std::thread::Builder::new()
        .name("link-accept".into())
        .spawn(move || loop {
            let accepted = link.accept();
            if shutdown.load(Ordering::SeqCst) {
                return;
            }
            match accepted {
                Ok((stream, peer)) => {
                    let (tx, key, last_seq, shutdown) =
                        (tx.clone(), key.clone(), last_seq.clone(), shutdown.clone());
                    std::thread::spawn(move || {
                        serve_agent(stream, peer, &tx, &key, &last_seq, &shutdown)
                    });
                }
                Err(e) => {
                    // Out of descriptors and the like: say so, and do not spin on it.
                    warn!(error = %e, "agent link accept failed");
                    std::thread::sleep(Duration::from_millis(100));
                }
            }
        })
}

/// The sender a message claims, read before its MAC is checked (to find its last
/// sequence number); the MAC decides whether to believe it.
#[derive(Deserialize)]
struct Claimed {
    #[serde(default)]
    from: String,
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
        let line = match lines::read_line(&mut reader, MAX_LINK_LINE_BYTES) {
            Ok(Some(line)) => line,
            Ok(None) => return,
            Err(e @ DaemonError::LineTooLong { .. }) => {
                warn!(%peer, error = %e, "oversized message from an agent; connection closed");
                return;
            }
            Err(e) => {
                debug!(%peer, error = %e, "agent connection ended");
                return;
            }
        };
        let claimed = serde_json::from_str::<Claimed>(&line)
            .map(|c| c.from)
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
