//! A peer on the controller's agent link that the tests drive by hand: the real link v2
//! handshake and session of `powerflex_proto::link`, with the frames it sends and
//! receives exposed, so a test can play a broken or hostile agent, capture a lease off
//! the wire and replay it.

use std::io::{BufRead, BufReader, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::Duration;

use powerflex_proto::link::{
    fresh_nonce, node_key, AgentHandshake, Body, LinkError, Session, MAX_LINK_LINE_BYTES,
};
use powerflex_proto::report::GpuInfo;

/// Unix time, ms (the daemons' one clock reading).
pub use powerflex_daemon::clock::unix_ms;

/// `n` simulated H200s named after `node`, as an agent announces them.
pub fn h200s(node: &str, n: usize) -> Vec<GpuInfo> {
    (0..n)
        .map(|g| GpuInfo {
            uuid: format!("GPU-{node}-{g}"),
            name: "NVIDIA H200".into(),
            min_w: 200.0,
            max_w: 700.0,
            default_w: 700.0,
        })
        .collect()
}

/// One agent connection, after the handshake and its hello.
#[derive(Debug)]
pub struct LinkPeer {
    pub stream: TcpStream,
    reader: BufReader<TcpStream>,
    pub session: Session,
    pub node: String,
}

impl LinkPeer {
    /// Connects to `addr` as node `node` with `key` (the node's own key), runs the
    /// handshake and says hello with `gpus`.
    pub fn connect_with_key(
        addr: SocketAddr,
        key: &[u8],
        node: &str,
        gpus: Vec<GpuInfo>,
    ) -> Result<LinkPeer, String> {
        let mut stream = TcpStream::connect_timeout(&addr, Duration::from_secs(5))
            .map_err(|e| format!("cannot connect to {addr}: {e}"))?;
        stream
            .set_read_timeout(Some(Duration::from_secs(10)))
            .map_err(|e| e.to_string())?;
        let mut reader = BufReader::new(stream.try_clone().map_err(|e| e.to_string())?);
        let nonce = fresh_nonce().map_err(|e| e.to_string())?;
        let (state, open) =
            AgentHandshake::start(key, node, nonce, unix_ms()).map_err(|e| e.to_string())?;
        stream
            .write_all(open.as_bytes())
            .map_err(|e| format!("cannot send the open: {e}"))?;
        let mut challenge = String::new();
        reader
            .read_line(&mut challenge)
            .map_err(|e| format!("no challenge: {e}"))?;
        if challenge.is_empty() {
            return Err("the controller closed the connection instead of a challenge".into());
        }
        let session = state
            .finish(&challenge, unix_ms())
            .map_err(|e| e.to_string())?;
        let mut peer = LinkPeer {
            stream,
            reader,
            session,
            node: node.into(),
        };
        peer.send(&Body::Hello { gpus })
            .map_err(|e| format!("cannot say hello: {e}"))?;
        Ok(peer)
    }

    /// [`LinkPeer::connect_with_key`] with the key the controller derives for `node`
    /// from `site_key`.
    pub fn connect(
        addr: SocketAddr,
        site_key: &[u8],
        node: &str,
        gpus: Vec<GpuInfo>,
    ) -> Result<LinkPeer, String> {
        let key = node_key(site_key, node).map_err(|e| e.to_string())?;
        LinkPeer::connect_with_key(addr, &key, node, gpus)
    }

    /// The connection, its buffered reader and the session, for a harness that reads and
    /// writes from different threads (each with its own copy of the session: one seals,
    /// the other opens).
    pub fn into_parts(self) -> (TcpStream, BufReader<TcpStream>, Session) {
        (self.stream, self.reader, self.session)
    }

    /// Seals and sends `body` as the next frame.
    pub fn send(&mut self, body: &Body) -> std::io::Result<()> {
        let line = self
            .session
            .seal(body, unix_ms())
            .map_err(|e| std::io::Error::other(e.to_string()))?;
        self.stream.write_all(line.as_bytes())
    }

    /// The next line from the controller, as received (`None` at end of stream or after
    /// `timeout`).
    pub fn recv_line(&mut self, timeout: Duration) -> Option<String> {
        let _ = self.stream.set_read_timeout(Some(timeout));
        let mut line = String::new();
        match std::io::Read::take(&mut self.reader, MAX_LINK_LINE_BYTES as u64 + 1)
            .read_line(&mut line)
        {
            Ok(0) | Err(_) => None,
            Ok(_) => Some(line),
        }
    }

    /// The next frame, opened under this session.
    pub fn recv(&mut self, timeout: Duration) -> Option<Result<Body, LinkError>> {
        let line = self.recv_line(timeout)?;
        Some(self.session.open(&line, unix_ms()))
    }
}
