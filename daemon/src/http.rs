//! The `/metrics` responder both daemons serve on loopback.
//!
//! A fixed number of worker threads block in `accept` on one listener (no thread per
//! connection, no polling), each connection gets read and write timeouts, and the
//! request head is parsed by `httparse` and capped in size. `GET /metrics` (and `GET /`,
//! for a person with curl) answer 200 with the text the render closure returns; other
//! paths 404, other methods 405, unparsable requests 400. Every answer closes the
//! connection: a scraper comes every few seconds, keep-alive buys nothing.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use tracing::warn;

use crate::DaemonError;

/// Largest request head read, bytes; a scrape request is a few hundred.
pub const MAX_REQUEST_BYTES: usize = 8192;

/// The Prometheus text format's content type.
pub const CONTENT_TYPE: &str = "text/plain; version=0.0.4; charset=utf-8";

/// How the responder runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HttpOptions {
    /// Worker threads, hence connections served at once; more wait in the backlog.
    pub workers: usize,
    /// Longest a client may take to send its request head, and to take the answer
    /// (each, for the whole of it, not per read).
    pub io_timeout: Duration,
}

impl Default for HttpOptions {
    fn default() -> HttpOptions {
        HttpOptions {
            workers: 2,
            io_timeout: Duration::from_millis(1000),
        }
    }
}

/// A running responder; [`MetricsServer::stop`] (or drop) ends its workers.
#[derive(Debug)]
pub struct MetricsServer {
    listener: TcpListener,
    local_addr: SocketAddr,
    stopping: Arc<AtomicBool>,
    workers: Vec<JoinHandle<()>>,
}

type Render = dyn Fn() -> String + Send + Sync;

impl MetricsServer {
    /// Serves `render()`'s text on `listener` from `options.workers` threads.
    pub fn spawn(
        listener: TcpListener,
        options: HttpOptions,
        render: impl Fn() -> String + Send + Sync + 'static,
    ) -> Result<MetricsServer, DaemonError> {
        MetricsServer::spawn_counted(listener, options, Arc::new(AtomicU64::new(0)), render)
    }

    /// [`MetricsServer::spawn`], adding one to `refused` for every request answered 400
    /// (malformed, oversized, or not sent within the timeout), so the daemon can export it.
    pub fn spawn_counted(
        listener: TcpListener,
        options: HttpOptions,
        refused: Arc<AtomicU64>,
        render: impl Fn() -> String + Send + Sync + 'static,
    ) -> Result<MetricsServer, DaemonError> {
        let local_addr = listener.local_addr().map_err(DaemonError::io(
            "cannot read the address of",
            "the metrics listener",
        ))?;
        listener
            .set_nonblocking(false)
            .map_err(DaemonError::io("cannot configure", local_addr))?;
        let render: Arc<Render> = Arc::new(render);
        let stopping = Arc::new(AtomicBool::new(false));
        let mut workers = Vec::new();
        for i in 0..options.workers.max(1) {
            let listener = listener
                .try_clone()
                .map_err(DaemonError::io("cannot share", local_addr))?;
            let (render, stopping, refused) = (render.clone(), stopping.clone(), refused.clone());
            let worker = std::thread::Builder::new()
                .name(format!("metrics-{i}"))
                .spawn(move || serve(&listener, &*render, &stopping, &refused, options.io_timeout))
                .map_err(DaemonError::io("cannot start a thread for", local_addr))?;
            workers.push(worker);
        }
        Ok(MetricsServer {
            listener,
            local_addr,
            stopping,
            workers,
        })
    }

    /// Where it listens (the port, when bound to port 0).
    pub fn local_addr(&self) -> SocketAddr {
        self.local_addr
    }

    /// Ends the workers and waits for them.
    pub fn stop(mut self) {
        self.close();
    }

    fn close(&mut self) {
        self.stopping.store(true, Ordering::SeqCst);
        // shutdown(2) on a listening socket wakes every thread blocked in accept (Linux
        // answers them EINVAL); the workers see `stopping` and return.
        let _ = rustix::net::shutdown(&self.listener, rustix::net::Shutdown::Both);
        for worker in self.workers.drain(..) {
            let _ = worker.join();
        }
    }
}

impl Drop for MetricsServer {
    fn drop(&mut self) {
        self.close();
    }
}

fn serve(
    listener: &TcpListener,
    render: &Render,
    stopping: &AtomicBool,
    refused: &AtomicU64,
    io_timeout: Duration,
) {
    loop {
        let accepted = listener.accept();
        if stopping.load(Ordering::SeqCst) {
            return;
        }
        match accepted {
            Ok((stream, _)) => {
                if answer(stream, render, io_timeout) == Route::BadRequest {
                    refused.fetch_add(1, Ordering::Relaxed);
                }
            }
            Err(e) => {
                // Out of descriptors and the like: say so, and do not spin on it.
                warn!(error = %e, "metrics accept failed");
                std::thread::sleep(Duration::from_millis(100));
            }
        }
    }
}

/// What a request head asks for.
#[derive(Debug, PartialEq, Eq)]
enum Route {
    Metrics,
    NotFound,
    BadMethod,
    BadRequest,
}

fn route(head: &[u8]) -> Route {
    let mut headers = [httparse::EMPTY_HEADER; 32];
    let mut request = httparse::Request::new(&mut headers);
    match request.parse(head) {
        Ok(httparse::Status::Complete(_)) => {}
        _ => return Route::BadRequest,
    }
    let path = request.path.unwrap_or("");
    // The query string does not select anything here.
    let path = path.split('?').next().unwrap_or("");
    match (request.method, path) {
        (Some("GET"), "/metrics" | "/") => Route::Metrics,
        (Some("GET"), _) => Route::NotFound,
        _ => Route::BadMethod,
    }
}

/// Reads the request head (up to the blank line) within the deadline.
fn read_head(stream: &mut TcpStream, io_timeout: Duration) -> Option<Vec<u8>> {
    let deadline = Instant::now() + io_timeout;
    let mut head = Vec::with_capacity(512);
    let mut chunk = [0u8; 1024];
    while !head.windows(4).any(|w| w == b"\r\n\r\n") {
        let left = deadline.checked_duration_since(Instant::now())?;
        stream
            .set_read_timeout(Some(left.max(Duration::from_millis(1))))
            .ok()?;
        let n = stream.read(&mut chunk).ok()?;
        if n == 0 {
            break;
        }
        head.extend_from_slice(chunk.get(..n)?);
        if head.len() > MAX_REQUEST_BYTES {
            return None;
        }
    }
    Some(head)
}

fn answer(mut stream: TcpStream, render: &Render, io_timeout: Duration) -> Route {
    let _ = stream.set_write_timeout(Some(io_timeout));
    let route = match read_head(&mut stream, io_timeout) {
        Some(head) => route(&head),
        None => Route::BadRequest,
    };
    let (status, body) = match &route {
        Route::Metrics => ("200 OK", render()),
        Route::NotFound => ("404 Not Found", "try /metrics\n".to_string()),
        Route::BadMethod => ("405 Method Not Allowed", "only GET\n".to_string()),
        Route::BadRequest => ("400 Bad Request", "malformed or slow request\n".to_string()),
    };
    let head = format!(
        "HTTP/1.1 {status}\r\nContent-Type: {CONTENT_TYPE}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
        body.len()
    );
    let _ = stream
        .write_all(head.as_bytes())
        .and_then(|()| stream.write_all(body.as_bytes()));
    route
}

#[cfg(test)]
mod tests {
    use super::*;

    fn get(addr: SocketAddr, request: &[u8]) -> String {
        let mut s = TcpStream::connect(addr).expect("connect");
        s.set_read_timeout(Some(Duration::from_secs(5)))
            .expect("timeout");
        s.write_all(request).expect("send");
        let mut out = String::new();
        let _ = s.read_to_string(&mut out);
        out
    }

    fn server(options: HttpOptions) -> MetricsServer {
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
        MetricsServer::spawn(listener, options, || "powerflex_budget_watts 1\n".into())
            .expect("spawn")
    }

    #[test]
    fn answers_metrics_and_refuses_the_rest() {
        let s = server(HttpOptions::default());
        let ok = get(s.local_addr(), b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n");
        assert!(ok.starts_with("HTTP/1.1 200 OK\r\n"), "{ok}");
        assert!(ok.contains("Content-Length: 25\r\n"), "{ok}");
        assert!(ok.ends_with("\r\n\r\npowerflex_budget_watts 1\n"), "{ok}");
        assert!(get(s.local_addr(), b"GET /?x=1 HTTP/1.0\r\n\r\n").starts_with("HTTP/1.1 200"));
        assert!(get(s.local_addr(), b"GET /nope HTTP/1.0\r\n\r\n").starts_with("HTTP/1.1 404"));
        assert!(get(s.local_addr(), b"POST /metrics HTTP/1.0\r\n\r\n").starts_with("HTTP/1.1 405"));
        assert!(get(s.local_addr(), b"\x00\x01garbage\r\n\r\n").starts_with("HTTP/1.1 400"));
        s.stop();
    }

    #[test]
    fn a_silent_client_times_out_and_does_not_hold_the_only_worker() {
        let s = server(HttpOptions {
            workers: 1,
            io_timeout: Duration::from_millis(200),
        });
        let started = Instant::now();
        // Connects and says nothing: the one worker gives up on it after the timeout.
        let mut silent = TcpStream::connect(s.local_addr()).expect("connect");
        silent
            .set_read_timeout(Some(Duration::from_secs(5)))
            .expect("timeout");
        let ok = get(s.local_addr(), b"GET /metrics HTTP/1.0\r\n\r\n");
        assert!(ok.starts_with("HTTP/1.1 200"), "{ok}");
        let mut answer = String::new();
        let _ = silent.read_to_string(&mut answer);
        assert!(answer.starts_with("HTTP/1.1 400"), "{answer}");
        assert!(started.elapsed() < Duration::from_secs(3));

        // A head that never ends is cut at the size limit, not read forever.
        let mut flood = TcpStream::connect(s.local_addr()).expect("connect");
        let _ = flood.write_all(&vec![b'a'; MAX_REQUEST_BYTES + 2048]);
        flood
            .set_read_timeout(Some(Duration::from_secs(5)))
            .expect("timeout");
        let mut answer = String::new();
        let _ = flood.read_to_string(&mut answer);
        assert!(answer.starts_with("HTTP/1.1 400"), "{answer}");
        s.stop();
    }

    #[test]
    fn refused_requests_are_counted() {
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
        let refused = Arc::new(AtomicU64::new(0));
        let s =
            MetricsServer::spawn_counted(listener, HttpOptions::default(), refused.clone(), || {
                "x 1\n".into()
            })
            .expect("spawn");
        assert!(get(s.local_addr(), b"GET /metrics HTTP/1.0\r\n\r\n").starts_with("HTTP/1.1 200"));
        assert_eq!(refused.load(Ordering::Relaxed), 0);
        assert!(get(s.local_addr(), b"\x00garbage\r\n\r\n").starts_with("HTTP/1.1 400"));
        // The worker counts once the answer is out: wait for it, with a deadline.
        let deadline = Instant::now() + Duration::from_secs(5);
        while refused.load(Ordering::Relaxed) == 0 && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(5));
        }
        assert_eq!(refused.load(Ordering::Relaxed), 1);
        s.stop();
    }

    #[test]
    fn stop_ends_workers_blocked_in_accept() {
        let s = server(HttpOptions {
            workers: 3,
            io_timeout: Duration::from_millis(200),
        });
        let addr = s.local_addr();
        let started = Instant::now();
        s.stop();
        assert!(started.elapsed() < Duration::from_secs(2));
        // Nobody answers any more.
        let answered = TcpStream::connect(addr)
            .ok()
            .map(|mut c| {
                let _ = c.set_read_timeout(Some(Duration::from_millis(300)));
                let _ = c.write_all(b"GET /metrics HTTP/1.0\r\n\r\n");
                let mut out = String::new();
                let _ = c.read_to_string(&mut out);
                out
            })
            .unwrap_or_default();
        assert!(!answered.contains("200 OK"), "{answered}");
    }
}
