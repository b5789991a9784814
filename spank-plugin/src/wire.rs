//! One request and one reply over the agent's Unix socket, all within one deadline.
//!
//! `UnixStream::connect` blocks while the listener's backlog is full: an agent stopped
//! with SIGSTOP, wedged, or flooded hangs every step launch and epilog in slurmstepd,
//! and a `PrologEpilogTimeout` then drains the node. Socket timeouts do not help either:
//! they bound each `read`/`write` call, not the exchange, so a peer that trickles bytes
//! holds the step for as long as it likes. Here the socket is non-blocking from the start,
//! `connect` is retried until the deadline (Linux answers `EAGAIN` at once when the
//! backlog is full), and every wait is a `poll` for what is left of the one deadline.

use std::io::{Read, Write};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::time::{Duration, Instant};

/// How long to wait before trying a connect again while the backlog is full.
const CONNECT_RETRY: Duration = Duration::from_millis(2);

/// Sends `line` to the Unix socket at `path` and reads one `\n`-terminated reply of at
/// most `max_reply` bytes, all before `budget` has passed. Errors say which part failed.
pub fn exchange_within(
    path: &Path,
    line: &[u8],
    max_reply: usize,
    budget: Duration,
) -> Result<String, String> {
    let deadline = Instant::now() + budget;
    let shown = path.display();
    let mut stream = connect_before(path, deadline)
        .map_err(|e| format!("cannot reach the powerflex agent at {shown}: {e}"))?;
    write_before(&mut stream, line, deadline)
        .map_err(|e| format!("cannot send to the powerflex agent at {shown}: {e}"))?;
    read_line_before(&mut stream, max_reply, deadline)
        .map_err(|e| format!("no answer from the powerflex agent at {shown}: {e}"))
}

/// Sends `line` to the Unix socket at `path` without waiting for an answer, all before
/// `budget` has passed: for notices (a step or job ended) whose answer changes nothing the
/// plugin does. The line is small enough to sit in the socket's buffer, so an agent that
/// is stopped but listening gets it when it runs again, and one whose backlog is full
/// costs at most `budget`.
pub fn send_within(path: &Path, line: &[u8], budget: Duration) -> Result<(), String> {
    let deadline = Instant::now() + budget;
    let shown = path.display();
    let mut stream = connect_before(path, deadline)
        .map_err(|e| format!("cannot reach the powerflex agent at {shown}: {e}"))?;
    write_before(&mut stream, line, deadline)
        .map_err(|e| format!("cannot send to the powerflex agent at {shown}: {e}"))
}

fn timed_out() -> std::io::Error {
    std::io::Error::new(std::io::ErrorKind::TimedOut, "deadline passed")
}

fn left(deadline: Instant) -> std::io::Result<Duration> {
    deadline
        .checked_duration_since(Instant::now())
        .filter(|d| !d.is_zero())
        .ok_or_else(timed_out)
}

/// A non-blocking connected stream, or an error once `deadline` passes.
fn connect_before(path: &Path, deadline: Instant) -> std::io::Result<UnixStream> {
    use std::os::unix::ffi::OsStrExt;
    let bytes = path.as_os_str().as_bytes();
    // SAFETY: sockaddr_un is plain data; all-zero is a valid value.
    let mut addr: libc::sockaddr_un = unsafe { std::mem::zeroed() };
    if bytes.len() >= addr.sun_path.len() || bytes.contains(&0) {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidInput,
            "socket path too long or holds a NUL byte",
        ));
    }
    addr.sun_family = libc::AF_UNIX as libc::sa_family_t;
    for (dst, src) in addr.sun_path.iter_mut().zip(bytes) {
        *dst = *src as libc::c_char;
    }
    // SAFETY: plain socket(2) call; the result is checked before use.
    let fd = unsafe {
        libc::socket(
            libc::AF_UNIX,
            libc::SOCK_STREAM | libc::SOCK_NONBLOCK | libc::SOCK_CLOEXEC,
            0,
        )
    };
    if fd < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: fd is a fresh descriptor this function owns.
    let owned = unsafe { OwnedFd::from_raw_fd(fd) };
    let len = std::mem::size_of::<libc::sockaddr_un>() as libc::socklen_t;
    loop {
        // SAFETY: addr is a valid sockaddr_un of `len` bytes; fd is open.
        let rc = unsafe {
            libc::connect(
                owned.as_raw_fd(),
                std::ptr::addr_of!(addr).cast::<libc::sockaddr>(),
                len,
            )
        };
        if rc == 0 {
            return Ok(UnixStream::from(owned));
        }
        let err = std::io::Error::last_os_error();
        match err.raw_os_error() {
            Some(libc::EINTR) => continue,
            // The listener's backlog is full: try again until the deadline.
            Some(libc::EAGAIN) => {
                let wait = left(deadline)?.min(CONNECT_RETRY);
                std::thread::sleep(wait);
            }
            Some(libc::EINPROGRESS) => {
                wait_for(owned.as_raw_fd(), libc::POLLOUT, deadline)?;
                let mut so_error: libc::c_int = 0;
                let mut size = std::mem::size_of::<libc::c_int>() as libc::socklen_t;
                // SAFETY: so_error and size are valid for writes of their sizes.
                let rc = unsafe {
                    libc::getsockopt(
                        owned.as_raw_fd(),
                        libc::SOL_SOCKET,
                        libc::SO_ERROR,
                        std::ptr::addr_of_mut!(so_error).cast(),
                        &mut size,
                    )
                };
                if rc != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                if so_error != 0 {
                    return Err(std::io::Error::from_raw_os_error(so_error));
                }
                return Ok(UnixStream::from(owned));
            }
            _ => return Err(err),
        }
    }
}

/// Waits until `fd` is ready for `events` or the deadline passes.
fn wait_for(fd: libc::c_int, events: libc::c_short, deadline: Instant) -> std::io::Result<()> {
    loop {
        let ms = left(deadline)?.as_millis().clamp(1, i32::MAX as u128) as libc::c_int;
        let mut pfd = libc::pollfd {
            fd,
            events,
            revents: 0,
        };
        // SAFETY: one valid pollfd.
        let rc = unsafe { libc::poll(&mut pfd, 1, ms) };
        if rc > 0 {
            return Ok(());
        }
        if rc < 0 {
            let err = std::io::Error::last_os_error();
            if err.kind() != std::io::ErrorKind::Interrupted {
                return Err(err);
            }
        }
        // rc == 0: poll's own timeout; the loop re-checks the deadline.
    }
}

fn write_before(
    stream: &mut UnixStream,
    mut data: &[u8],
    deadline: Instant,
) -> std::io::Result<()> {
    while !data.is_empty() {
        match stream.write(data) {
            Ok(0) => return Err(std::io::ErrorKind::WriteZero.into()),
            Ok(n) => data = &data[n..],
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                wait_for(stream.as_raw_fd(), libc::POLLOUT, deadline)?
            }
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

fn read_line_before(
    stream: &mut UnixStream,
    max: usize,
    deadline: Instant,
) -> std::io::Result<String> {
    let mut reply = Vec::with_capacity(256);
    let mut buf = [0u8; 1024];
    loop {
        match stream.read(&mut buf) {
            Ok(0) => {
                return Err(std::io::Error::new(
                    std::io::ErrorKind::UnexpectedEof,
                    "connection closed before a reply",
                ))
            }
            Ok(n) => {
                reply.extend_from_slice(&buf[..n]);
                if let Some(end) = reply.iter().position(|&b| b == b'\n') {
                    reply.truncate(end + 1);
                    return String::from_utf8(reply).map_err(|_| {
                        std::io::Error::new(std::io::ErrorKind::InvalidData, "reply is not UTF-8")
                    });
                }
                if reply.len() > max {
                    return Err(std::io::Error::new(
                        std::io::ErrorKind::InvalidData,
                        format!("reply longer than {max} bytes"),
                    ));
                }
            }
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                wait_for(stream.as_raw_fd(), libc::POLLIN, deadline)?
            }
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::net::UnixListener;

    fn socket_path(name: &str) -> std::path::PathBuf {
        let dir = std::env::temp_dir().join(format!("pf-wire-{}-{name}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("dir");
        dir.join("agent.sock")
    }

    /// The extra time an exchange may take beyond its budget (the bound).
    const SLACK: Duration = Duration::from_millis(50);

    #[test]
    fn an_agent_that_answers_is_heard() {
        let path = socket_path("ok");
        let listener = UnixListener::bind(&path).expect("bind");
        let server = std::thread::spawn(move || {
            let (mut s, _) = listener.accept().expect("accept");
            let mut got = [0u8; 6];
            s.read_exact(&mut got).expect("read");
            s.write_all(b"pong\n").expect("reply");
        });
        let reply =
            exchange_within(&path, b"ping\n\n", 4096, Duration::from_secs(2)).expect("reply");
        assert_eq!(reply, "pong\n");
        server.join().expect("server");
    }

    #[test]
    fn an_agent_that_accepts_and_never_answers_costs_at_most_the_budget() {
        let path = socket_path("mute");
        let listener = UnixListener::bind(&path).expect("bind");
        let holder = std::thread::spawn(move || {
            let (s, _) = listener.accept().expect("accept");
            std::thread::sleep(Duration::from_millis(800));
            drop(s);
        });
        let budget = Duration::from_millis(150);
        let started = Instant::now();
        let err = exchange_within(&path, b"ping\n", 4096, budget).expect_err("no reply");
        let took = started.elapsed();
        assert!(took <= budget + SLACK, "took {took:?}");
        assert!(err.contains("no answer"), "{err}");
        holder.join().expect("holder");
    }

    /// The backlog of a listener that never accepts (an agent stopped with SIGSTOP, or
    /// wedged) fills; connect then blocks forever in blocking mode.
    #[test]
    fn a_full_backlog_costs_at_most_the_budget() {
        let path = socket_path("full");
        let listener = UnixListener::bind(&path).expect("bind");
        // Fill the backlog with connections nobody accepts.
        let mut held = Vec::new();
        let started = Instant::now();
        loop {
            match connect_before(&path, Instant::now() + Duration::from_millis(20)) {
                Ok(s) => held.push(s),
                Err(_) => break,
            }
            assert!(
                held.len() < 100_000 && started.elapsed() < Duration::from_secs(20),
                "backlog never filled"
            );
        }
        let budget = Duration::from_millis(150);
        let started = Instant::now();
        let err = exchange_within(&path, b"ping\n", 4096, budget).expect_err("backlog full");
        let took = started.elapsed();
        assert!(took <= budget + SLACK, "took {took:?}");
        assert!(err.contains("cannot reach"), "{err}");
        drop(listener);
    }

    #[test]
    fn a_peer_that_trickles_bytes_cannot_stretch_the_exchange() {
        let path = socket_path("trickle");
        let listener = UnixListener::bind(&path).expect("bind");
        let server = std::thread::spawn(move || {
            let (mut s, _) = listener.accept().expect("accept");
            for _ in 0..40 {
                if s.write_all(b"x").is_err() {
                    return;
                }
                std::thread::sleep(Duration::from_millis(20));
            }
        });
        let budget = Duration::from_millis(150);
        let started = Instant::now();
        assert!(exchange_within(&path, b"ping\n", 4096, budget).is_err());
        assert!(
            started.elapsed() <= budget + SLACK,
            "took {:?}",
            started.elapsed()
        );
        server.join().expect("server");
    }

    /// A stopped agent (listening, not accepting) still gets a notice: it waits in the
    /// socket's buffer until the agent runs again, and the sender does not wait for it.
    #[test]
    fn a_notice_to_a_stopped_agent_is_delivered_when_it_runs_again() {
        let path = socket_path("notice");
        let listener = UnixListener::bind(&path).expect("bind");
        send_within(&path, b"end job 7\n", Duration::from_millis(20)).expect("sent");
        // The agent "resumes" only now, after the sender has gone.
        let (mut s, _) = listener.accept().expect("accept");
        let mut got = String::new();
        s.read_to_string(&mut got).expect("read");
        assert_eq!(got, "end job 7\n");
    }

    #[test]
    fn no_agent_fails_at_once() {
        let path = socket_path("none");
        let started = Instant::now();
        let err =
            exchange_within(&path, b"ping\n", 4096, Duration::from_secs(2)).expect_err("none");
        assert!(started.elapsed() < Duration::from_millis(100));
        assert!(err.contains("cannot reach"), "{err}");
        let long = std::path::PathBuf::from(format!("/tmp/{}", "x".repeat(200)));
        assert!(exchange_within(&long, b"ping\n", 4096, Duration::from_secs(1)).is_err());
    }
}
