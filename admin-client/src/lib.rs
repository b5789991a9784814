//! The client side of `powerflex-ctld`'s admin socket: one request line out, one reply
//! line back, in the versioned protocol of [`powerflex_proto::admin`]. `powerflexctl`
//! and `powerflex-grid` (the VEN) both speak through [`request`], so neither links the
//! controller's library for it, and both read the same typed failures.
//!
//! Blocking, with a read deadline: an async caller runs it on a blocking thread.

use std::io::{BufReader, Write as _};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::time::{Duration, Instant};

use powerflex_daemon::lines;
use powerflex_proto::admin::{AdminOp, AdminReply, AdminRequest};

/// How long the controller has to answer one request. Its admin loop answers from its
/// state within milliseconds; a status of a large site is still well inside this.
pub const REPLY_TIMEOUT: Duration = Duration::from_secs(10);

/// Largest reply read, bytes: a status of a large site is a few MiB.
pub const MAX_ADMIN_REPLY_BYTES: usize = 16 * 1024 * 1024;

/// Why no reply came back. The controller's own refusals are not errors here: they come
/// back as an [`AdminReply::Refused`] with the reason.
#[derive(Debug, thiserror::Error)]
pub enum AdminClientError {
    #[error("cannot reach powerflex-ctld at {socket}: {source}")]
    Connect {
        socket: String,
        #[source]
        source: std::io::Error,
    },
    #[error("cannot send the request to powerflex-ctld at {socket}: {source}")]
    Send {
        socket: String,
        #[source]
        source: std::io::Error,
    },
    #[error("no answer from powerflex-ctld after {waited_s:.1} s: {source}")]
    NoAnswer {
        waited_s: f64,
        #[source]
        source: powerflex_daemon::DaemonError,
    },
    #[error("powerflex-ctld closed the connection without answering")]
    Closed,
    #[error("bad answer from powerflex-ctld: {0}")]
    BadReply(#[source] serde_json::Error),
}

/// Sends `op` to the controller at `socket` and returns its reply.
pub fn request(socket: &Path, op: &AdminOp) -> Result<AdminReply, AdminClientError> {
    let named = || socket.display().to_string();
    let mut stream = UnixStream::connect(socket).map_err(|source| AdminClientError::Connect {
        socket: named(),
        source,
    })?;
    // Setting a timeout fails only for a zero duration.
    let _ = stream.set_read_timeout(Some(REPLY_TIMEOUT));
    let line = AdminRequest::new(op.clone()).to_line();
    stream
        .write_all(line.as_bytes())
        .map_err(|source| AdminClientError::Send {
            socket: named(),
            source,
        })?;
    let started = Instant::now();
    let reply = lines::read_line(&mut BufReader::new(stream), MAX_ADMIN_REPLY_BYTES)
        .map_err(|source| AdminClientError::NoAnswer {
            waited_s: started.elapsed().as_secs_f64(),
            source,
        })?
        .ok_or(AdminClientError::Closed)?;
    serde_json::from_str(reply.trim_end()).map_err(AdminClientError::BadReply)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::BufRead as _;
    use std::os::unix::net::UnixListener;

    /// A one-connection server on a real socket that answers the request line it reads
    /// with `answer` (None: closes without answering).
    fn serve_once(answer: Option<String>) -> (tempdir::Dir, std::thread::JoinHandle<String>) {
        let dir = tempdir::Dir::new();
        let listener = UnixListener::bind(dir.path.join("ctld.sock")).expect("bind");
        let server = std::thread::spawn(move || {
            let (stream, _) = listener.accept().expect("accept");
            let mut reader = std::io::BufReader::new(stream.try_clone().expect("clone"));
            let mut request = String::new();
            reader.read_line(&mut request).expect("request line");
            if let Some(answer) = answer {
                (&stream).write_all(answer.as_bytes()).expect("answer");
            }
            request
        });
        (dir, server)
    }

    mod tempdir {
        /// A directory under the system's temporary directory, removed when dropped.
        pub struct Dir {
            pub path: std::path::PathBuf,
        }
        impl Dir {
            pub fn new() -> Dir {
                use std::sync::atomic::{AtomicU32, Ordering};
                static NEXT: AtomicU32 = AtomicU32::new(0);
                let path = std::env::temp_dir().join(format!(
                    "pf-admin-client-{}-{}",
                    std::process::id(),
                    NEXT.fetch_add(1, Ordering::Relaxed)
                ));
                let _ = std::fs::remove_dir_all(&path);
                std::fs::create_dir_all(&path).expect("temp dir");
                Dir { path }
            }
        }
        impl Drop for Dir {
            fn drop(&mut self) {
                let _ = std::fs::remove_dir_all(&self.path);
            }
        }
    }

    #[test]
    fn a_request_line_goes_out_and_the_typed_reply_comes_back() {
        let reply = AdminReply::error("nothing to see");
        let (dir, server) = serve_once(Some(reply.to_line()));
        let got = request(&dir.path.join("ctld.sock"), &AdminOp::Status).expect("reply");
        assert_eq!(got, reply);
        let sent = server.join().expect("server");
        assert_eq!(sent, AdminRequest::new(AdminOp::Status).to_line());
    }

    #[test]
    fn each_failure_says_what_went_wrong() {
        let dir = tempdir::Dir::new();
        let missing = dir.path.join("none.sock");
        let err = request(&missing, &AdminOp::Status).expect_err("no server");
        assert!(matches!(err, AdminClientError::Connect { .. }), "{err}");
        assert!(err.to_string().contains("none.sock"), "{err}");

        let (dir, server) = serve_once(None);
        let err = request(&dir.path.join("ctld.sock"), &AdminOp::Status).expect_err("closed");
        assert!(matches!(err, AdminClientError::Closed), "{err}");
        server.join().expect("server");

        let (dir, server) = serve_once(Some("not json\n".into()));
        let err = request(&dir.path.join("ctld.sock"), &AdminOp::Status).expect_err("bad");
        assert!(matches!(err, AdminClientError::BadReply(_)), "{err}");
        server.join().expect("server");
    }
}
