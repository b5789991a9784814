//! The controller edge's own tests: a reload, the listeners served and stopped, the
//! history board beside the loop, and the link's bounds on real sockets.

use super::*;
use powerflex_admin_client::request;
use powerflex_core::allocate::Policy;
use powerflex_core::config::{BudgetMode, Objective};
use powerflex_core::flex::TierTable;
use powerflex_core::Watts;
use std::net::TcpListener;

/// A loopback address on a port below the ephemeral range: no outgoing connection or
/// `bind(:0)` elsewhere takes it while a test stops and checks it.
fn free_port() -> std::net::SocketAddr {
    (
        [127, 0, 0, 1],
        powerflex_daemon::test_ports::free_loopback_port(),
    )
        .into()
}

/// A controller on free loopback ports with its files under `dir`: 3200 W, a 10 s
/// period, hard budget, the default tiers.
fn test_options(dir: &std::path::Path, key: &[u8], metrics: std::net::SocketAddr) -> CtldOptions {
    CtldOptions {
        listen: free_port(),
        admin_socket: dir.join("ctld.sock"),
        state_dir: dir.join("state"),
        key: key.to_vec(),
        metrics_listen: Some(metrics),
        slurm_poll: Duration::from_secs(5),
        slurm_timeout: Duration::from_secs(5),
        records_db: None,
        ha: None,
        settings: CtldSettings {
            base_budget: Watts(3200.0),
            period: Duration::from_secs(10),
            lease_ttl_s: 30.0,
            site: powerflex_decide::SiteSettings {
                tiers: TierTable::default_table(),
                policy: Policy::Optimal,
                cap_step: Watts(10.0),
                failsafe_cap: Watts(500.0),
                default_pfi: 1.3,
                budget_mode: BudgetMode::Hard,
                objective: Objective::Tokens,
                tier_bounds: powerflex_decide::TierBounds::Honoured,
                domains: None,
            },
            lease_rollout: Default::default(),
            max_ramp_w_per_s: None,
            job_placement: powerflex_core::config::JobPlacement::Reports,
            max_gpu_power_w: 700.0,
        },
    }
}

/// A reload hands the machine the new settings, and only those: the edge's sockets,
/// paths and key stay as started (the machine keeps its period and placement).
#[test]
fn a_reload_passes_the_settings_and_keeps_the_edge_s_own() {
    let dir = std::env::temp_dir().join("pf-ctld-reload-settings");
    let in_force = test_options(&dir, b"site key", free_port());
    let mut new = in_force.clone();
    new.listen = free_port();
    new.key = b"another key".to_vec();
    new.settings.base_budget = Watts(8000.0);
    new.settings.lease_ttl_s = 60.0;
    let settings = settings_reload(&in_force, Ok(new)).expect("valid");
    assert_eq!(settings.base_budget, Watts(8000.0));
    assert_eq!(settings.lease_ttl_s, 60.0);
    assert_eq!(
        settings_reload(&in_force, Err("bad key".into()))
            .expect_err("refused")
            .to_string(),
        "bad key"
    );
}

/// The acceptors block in accept() (no polling): `run` must still end promptly when
/// asked, having woken them, and serve every socket until then.
#[test]
fn serves_admin_link_and_metrics_then_stops_promptly() {
    let dir = std::env::temp_dir().join(format!("pf-ctld-run-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let metrics = free_port();
    let options = test_options(&dir, b"site key for tests", metrics);
    let shutdown = Arc::new(AtomicBool::new(false));
    let (_reload_tx, reloads) = bounded::<Reload>(1);
    let (done_tx, done_rx) = bounded(1);
    let (opts, stop) = (options.clone(), shutdown.clone());
    std::thread::spawn(move || {
        let _ = done_tx.send(run(opts, stop, reloads));
    });

    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    let reply = loop {
        match request(&options.admin_socket, &AdminOp::Status) {
            Ok(reply) => break reply,
            Err(e) if std::time::Instant::now() > deadline => panic!("no controller: {e}"),
            Err(_) => std::thread::sleep(Duration::from_millis(20)),
        }
    };
    assert!(reply.is_ok(), "{reply:?}");
    assert_eq!(reply.status().expect("status").budget_w, 3200.0);
    // The link accepts (a line that is not a message is refused, the socket stays up).
    let mut agent = std::net::TcpStream::connect(options.listen).expect("link");
    std::io::Write::write_all(&mut agent, b"not a message\n").expect("send");
    // Metrics from the shared responder and catalog.
    let mut scrape = std::net::TcpStream::connect(metrics).expect("metrics");
    std::io::Write::write_all(&mut scrape, b"GET /metrics HTTP/1.0\r\n\r\n").expect("send");
    let mut text = String::new();
    std::io::Read::read_to_string(&mut scrape, &mut text).expect("scrape");
    assert!(text.contains("\npowerflex_budget_watts 3200\n"), "{text}");

    let asked = std::time::Instant::now();
    shutdown.store(true, Ordering::SeqCst);
    let result = done_rx
        .recv_timeout(Duration::from_secs(3))
        .expect("run ends within 3 s of shutdown (acceptors woken)");
    assert_eq!(result, Ok(()));
    assert!(asked.elapsed() < Duration::from_secs(3));
    assert!(
        !options.admin_socket.exists(),
        "socket removed on the way out"
    );
    // Both ports released: they can be bound again. (A connect that fails would
    // say less: a loopback connect whose source port equals its destination port
    // connects to itself.)
    for port in [options.listen, metrics] {
        TcpListener::bind(port).unwrap_or_else(|e| panic!("{port} still held: {e}"));
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// `history` is answered by the admin threads from the history board,
/// never by the allocation loop (whose core keeps no history and refuses it): over
/// the real admin socket, with one sample per allocation, filtered by the peer's
/// uid, pages as asked; and while a flood of history requests is in flight the
/// agent's reports go on being allocated, each new job named in the node's lease.
#[test]
fn history_is_served_from_the_board_while_allocations_go_on() {
    use powerflex_proto::admin::MAX_HISTORY_SAMPLES;
    use std::os::unix::fs::MetadataExt;

    let dir = std::env::temp_dir().join(format!("pf-ctld-history-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let options = test_options(&dir, b"site key for the history test", free_port());
    let shutdown = Arc::new(AtomicBool::new(false));
    let (_reload_tx, reloads) = bounded::<Reload>(1);
    let (opts, stop) = (options.clone(), shutdown.clone());
    let ctld = std::thread::spawn(move || run_bounded(opts, Bounds::default(), stop, reloads));
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while request(&options.admin_socket, &AdminOp::Status).is_err() {
        assert!(std::time::Instant::now() < deadline, "no controller");
        std::thread::sleep(Duration::from_millis(20));
    }
    // The controller made its socket as this process: its owner is the uid the admin
    // threads read from this test's connections.
    let me = std::fs::metadata(&options.admin_socket)
        .expect("the admin socket")
        .uid();
    let someone_else = if me == 4242 { 4243 } else { 4242 };
    let history = |since_ms: Option<u64>, max_samples: Option<u32>| {
        request(
            &options.admin_socket,
            &AdminOp::History {
                since_ms,
                max_samples,
            },
        )
    };

    // Three readers asking for the whole history over and over (with this test's
    // own requests, within the 4 connections a user may hold).
    let stop_reading = Arc::new(AtomicBool::new(false));
    let answered = Arc::new(std::sync::atomic::AtomicU64::new(0));
    let readers: Vec<_> = (0..3)
        .map(|_| {
            let (socket, stop, answered) = (
                options.admin_socket.clone(),
                stop_reading.clone(),
                answered.clone(),
            );
            std::thread::spawn(move || {
                let op = AdminOp::History {
                    since_ms: None,
                    max_samples: None,
                };
                while !stop.load(Ordering::SeqCst) {
                    let reply = request(&socket, &op).expect("the admin socket answers");
                    if !reply.is_ok() {
                        // The gate may still count a connection whose reply is out.
                        let error = reply.error_message().unwrap_or_default().to_string();
                        assert!(error.contains("admin connections"), "{error}");
                        continue;
                    }
                    let samples = reply.history().expect("a history reply carries one");
                    assert!(samples.len() <= MAX_HISTORY_SAMPLES as usize);
                    assert!(samples.windows(2).all(|w| w[0].t_ms < w[1].t_ms));
                    answered.fetch_add(1, Ordering::SeqCst);
                }
            })
        })
        .collect();
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while answered.load(Ordering::SeqCst) < 3 {
        assert!(std::time::Instant::now() < deadline, "no history answered");
        std::thread::sleep(Duration::from_millis(10));
    }

    // One node of 8 GPUs; its jobs come one at a time, each a change in its jobs that
    // the loop allocates at once (not at the 10 s tick). Odd jobs are this test's
    // uid's, even ones someone else's.
    let mut node =
        Peer::connect(options.listen, &options.key, "n1", h200s("n1", 8)).expect("n1 on the link");
    let owner = |id: usize| if id % 2 == 1 { me } else { someone_else };
    let job = |id: usize| JobReport {
        job_id: id.to_string(),
        tier: "flex2".into(),
        gpus: 2,
        cap_w: Some(400.0),
        power_w: Some(800.0),
        owner_uid: Some(owner(id)),
        ..JobReport::default()
    };
    let mut jobs: Vec<JobReport> = Vec::new();
    for id in 1..=4 {
        jobs.push(job(id));
        node.send(&Body::Report {
            power_w: 800.0 * jobs.len() as f64,
            jobs: jobs.clone(),
            failsafe: false,
            cap_mismatches: 0,
            ended: Vec::new(),
            observe_only: false,
        })
        .expect("report");
        loop {
            match node.recv(Duration::from_secs(10)) {
                Some(Ok(Body::Lease { caps, .. }))
                    if jobs.iter().all(|j| caps.contains_key(&j.job_id)) =>
                {
                    break
                }
                Some(Ok(_)) => {}
                Some(Err(e)) => panic!("a frame from the controller refused: {e}"),
                None => panic!("no lease naming job {id} while history was being read"),
            }
        }
    }
    stop_reading.store(true, Ordering::SeqCst);
    for reader in readers {
        reader.join().expect("every history answer was whole");
    }

    // The allocations, as the board holds them: each set of jobs the node reported
    // has its sample, with the caps this caller may read (all for root).
    let reply = history(None, None).expect("history");
    assert!(reply.is_ok(), "{reply:?}");
    let samples = reply.history().expect("history");
    assert!(samples.windows(2).all(|w| w[0].t_ms < w[1].t_ms));
    let readable = |up_to: usize| -> Vec<String> {
        (1..=up_to)
            .filter(|&id| me == 0 || owner(id) == me)
            .map(|id| id.to_string())
            .collect()
    };
    for up_to in 1..=4 {
        let expected = readable(up_to);
        assert!(
            samples
                .iter()
                .any(|s| s.caps.keys().cloned().collect::<Vec<_>>() == expected),
            "no sample with the caps of jobs {expected:?}: {samples:?}"
        );
    }
    // A page after the first sample is the next two, as in the overview.
    let page = history(Some(samples[0].t_ms), Some(2))
        .expect("a page")
        .history()
        .expect("history")
        .to_vec();
    assert_eq!(page, samples[1..3]);

    shutdown.store(true, Ordering::SeqCst);
    assert_eq!(ctld.join().expect("ctld"), Ok(()));
    let _ = std::fs::remove_dir_all(&dir);
}

/// One handshake as `node` on the link at `addr`: the session and the stream, or
/// why the controller would not have it.
fn handshake(
    addr: std::net::SocketAddr,
    site_key: &[u8],
    node: &str,
) -> Result<(std::net::TcpStream, powerflex_proto::link::Session), String> {
    handshake_with(addr, site_key, node, Vec::new())
}

/// [`handshake`], the hello announcing `gpus`.
fn handshake_with(
    addr: std::net::SocketAddr,
    site_key: &[u8],
    node: &str,
    gpus: Vec<GpuInfo>,
) -> Result<(std::net::TcpStream, powerflex_proto::link::Session), String> {
    use powerflex_proto::link::{fresh_nonce, node_key, AgentHandshake};
    use std::io::{BufRead, Write};
    let mut stream = std::net::TcpStream::connect(addr).map_err(|e| e.to_string())?;
    stream
        .set_read_timeout(Some(Duration::from_secs(5)))
        .map_err(|e| e.to_string())?;
    let key = node_key(site_key, node).map_err(|e| e.to_string())?;
    let (hs, open) = AgentHandshake::start(
        &key,
        node,
        fresh_nonce().map_err(|e| e.to_string())?,
        unix_ms(),
    )
    .map_err(|e| e.to_string())?;
    stream
        .write_all(open.as_bytes())
        .map_err(|e| e.to_string())?;
    let mut challenge = String::new();
    std::io::BufReader::new(stream.try_clone().map_err(|e| e.to_string())?)
        .read_line(&mut challenge)
        .map_err(|e| e.to_string())?;
    let mut session = hs
        .finish(&challenge, unix_ms())
        .map_err(|e| e.to_string())?;
    let hello = session
        .seal(&Body::Hello { gpus }, unix_ms())
        .map_err(|e| e.to_string())?;
    stream
        .write_all(hello.as_bytes())
        .map_err(|e| e.to_string())?;
    Ok((stream, session))
}

/// `n` H200s on `node` (200-700 W), as its agent announces them.
fn h200s(node: &str, n: usize) -> Vec<GpuInfo> {
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

/// An agent on the link driven by hand: it seals the frames it sends and opens the
/// controller's with the one session of its handshake.
struct Peer {
    stream: std::net::TcpStream,
    lines: std::io::BufReader<std::net::TcpStream>,
    session: powerflex_proto::link::Session,
}

impl Peer {
    /// Connects as `node`, announcing `gpus` (see [`handshake_with`]).
    fn connect(
        addr: std::net::SocketAddr,
        site_key: &[u8],
        node: &str,
        gpus: Vec<GpuInfo>,
    ) -> Result<Peer, String> {
        let (stream, session) = handshake_with(addr, site_key, node, gpus)?;
        let lines = std::io::BufReader::new(stream.try_clone().map_err(|e| e.to_string())?);
        Ok(Peer {
            stream,
            lines,
            session,
        })
    }

    /// Seals and sends `body` as the next frame.
    fn send(&mut self, body: &Body) -> Result<(), String> {
        let line = self
            .session
            .seal(body, unix_ms())
            .map_err(|e| e.to_string())?;
        std::io::Write::write_all(&mut self.stream, line.as_bytes()).map_err(|e| e.to_string())
    }

    /// The controller's next frame, opened (`None` at end of stream or after
    /// `timeout`).
    fn recv(
        &mut self,
        timeout: Duration,
    ) -> Option<Result<Body, powerflex_proto::link::LinkError>> {
        let _ = self.stream.set_read_timeout(Some(timeout));
        let mut line = String::new();
        match std::io::BufRead::read_line(&mut self.lines, &mut line) {
            Ok(0) | Err(_) => None,
            Ok(_) => Some(self.session.open(&line, unix_ms())),
        }
    }
}

/// Whether the controller ends `stream` within `within` (reads to end of stream).
fn closed_within(stream: &mut std::net::TcpStream, within: Duration) -> bool {
    use std::io::Read;
    let _ = stream.set_read_timeout(Some(within));
    let mut buf = [0u8; 4096];
    let until = std::time::Instant::now() + within;
    loop {
        match stream.read(&mut buf) {
            Ok(0) => return true,
            Ok(_) if std::time::Instant::now() < until => {}
            Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => return true,
            _ => return false,
        }
    }
}

/// Threads of this process serving agent sessions (named `link-<node>` and
/// `link-w-<node>`; the handshake thread is `link-handshake`). By name, since other
/// tests run in this process at the same time.
fn session_threads() -> usize {
    std::fs::read_dir("/proc/self/task")
        .map(|tasks| {
            tasks
                .flatten()
                .filter_map(|t| std::fs::read_to_string(t.path().join("comm")).ok())
                .filter(|name| {
                    let name = name.trim_end();
                    name.starts_with("link-") && name != "link-handshake"
                })
                .count()
        })
        .unwrap_or(0)
}

/// The link's bounds, in process with tight limits: a flood of idle connections costs
/// no thread and cannot keep an agent out; idle ones are closed at the deadline; one
/// session per node (a newer one replaces it), sessions capped; every refusal counted.
#[test]
fn the_link_bounds_unauthenticated_peers_and_sessions() {
    let dir = std::env::temp_dir().join(format!("pf-ctld-bounds-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let metrics = free_port();
    let options = test_options(&dir, b"site key for the bounds test", metrics);
    let bounds = Bounds {
        link: agent_link::LinkLimits {
            max_pending: 8,
            handshake_timeout: Duration::from_millis(500),
            max_sessions: 2,
            idle_timeout: Duration::from_secs(30),
        },
        admin: bounds::AdminLimits::default(),
    };
    let shutdown = Arc::new(AtomicBool::new(false));
    let (_reload_tx, reloads) = bounded::<Reload>(1);
    let (opts, stop) = (options.clone(), shutdown.clone());
    let ctld = std::thread::spawn(move || run_bounded(opts, bounds, stop, reloads));
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while request(&options.admin_socket, &AdminOp::Status).is_err() {
        assert!(std::time::Instant::now() < deadline, "no controller");
        std::thread::sleep(Duration::from_millis(20));
    }
    let flood: Vec<std::net::TcpStream> = (0..200)
        .filter_map(|_| std::net::TcpStream::connect(options.listen).ok())
        .collect();
    assert_eq!(flood.len(), 200);
    // An agent still gets in, past the full handshake table.
    let (mut n1, _) = handshake(options.listen, &options.key, "n1").expect("n1 during the flood");
    // n1's two session threads, and none for the 200 flooding peers.
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    while session_threads() < 2 && std::time::Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(20));
    }
    assert_eq!(session_threads(), 2, "n1's reader and writer only");
    let (_n2, _) = handshake(options.listen, &options.key, "n2").expect("n2");
    // A third node is over the session cap: closed after its hello.
    let (mut n3, _) = handshake(options.listen, &options.key, "n3").expect("n3's handshake");
    assert!(closed_within(&mut n3, Duration::from_secs(5)), "n3 refused");
    // n1 again: the new session replaces the old one, which is closed.
    let (_n1_again, _) = handshake(options.listen, &options.key, "n1").expect("n1 again");
    assert!(
        closed_within(&mut n1, Duration::from_secs(5)),
        "old n1 session ended"
    );
    // The idle flood is closed at the deadline, whatever was not evicted before.
    // (The others stay open: a peer that leaves by itself is no refusal.)
    let mut flood = flood;
    let last = flood.last_mut().expect("one");
    assert!(
        closed_within(last, Duration::from_secs(5)),
        "idle peer closed"
    );
    let scrape = || {
        let mut scrape = std::net::TcpStream::connect(metrics).expect("metrics");
        std::io::Write::write_all(&mut scrape, b"GET /metrics HTTP/1.0\r\n\r\n").expect("send");
        let mut text = String::new();
        std::io::Read::read_to_string(&mut scrape, &mut text).expect("scrape");
        text
    };
    let count_in = |text: &str, reason: &str| -> u64 {
        let prefix = format!("powerflex_refusals_total{{reason=\"{reason}\"}} ");
        text.lines()
            .find_map(|l| l.strip_prefix(&prefix))
            .and_then(|v| v.trim().parse().ok())
            .unwrap_or(0)
    };
    // Every flood connection loses its place to a newer one or meets the deadline
    // (which of the two depends on how fast this machine accepts; a connection the
    // kernel's full backlog held back is accepted, and refused, late).
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    let text = loop {
        let text = scrape();
        let refused = count_in(&text, "pending_cap") + count_in(&text, "handshake_timeout");
        if refused >= 200 || std::time::Instant::now() > deadline {
            break text;
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    let count = |reason: &str| count_in(&text, reason);
    assert!(
        count("pending_cap") + count("handshake_timeout") >= 200,
        "{text}"
    );
    assert!(count("pending_cap") >= 100, "{text}");
    drop(flood);
    assert_eq!(count("session_cap"), 1, "{text}");
    shutdown.store(true, Ordering::SeqCst);
    assert_eq!(ctld.join().expect("ctld"), Ok(()));
    let _ = std::fs::remove_dir_all(&dir);
}
