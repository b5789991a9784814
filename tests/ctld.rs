//! powerflex-ctld with real agents on simulated GPUs: budget changes and grid events reach
//! every node's caps, the draw stays within the budget, and a restarted controller resumes.

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use powerflex::needs::{can_run, Need};
use powerflex::site_config::SiteBuilder;
use powerflex::{
    binary, cargo_build, free_loopback_port, profile_dir, run, wait_until, write_node_keys,
    write_site_key, Children,
};
use powerflex_proto::status::{CtldStatus, DecisionView, NodeStatus};
use powerflex_sim::state::Node;

fn draw_w(nodes: &[Node]) -> f64 {
    nodes
        .iter()
        .flat_map(|n| {
            (0..n.gpu_count())
                .map(move |g| f64::from(n.reading(g).expect("reading").1.power_mw) / 1000.0)
        })
        .sum()
}

fn caps_w(nodes: &[Node]) -> Vec<f64> {
    nodes
        .iter()
        .flat_map(|n| {
            (0..n.gpu_count())
                .map(move |g| f64::from(n.gpu(g).expect("gpu").power_limit_mw) / 1000.0)
        })
        .collect()
}

/// A minimal HTTP/1.1 GET over loopback; returns the whole response.
fn http_get(port: u16, path: &str) -> String {
    use std::io::{Read as _, Write as _};
    let mut stream = std::net::TcpStream::connect(("127.0.0.1", port)).expect("metrics port");
    stream
        .set_read_timeout(Some(Duration::from_secs(5)))
        .expect("timeout");
    write!(
        stream,
        "GET {path} HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n"
    )
    .expect("request");
    let mut response = String::new();
    let _ = stream.read_to_string(&mut response);
    response
}

fn start_ctld(config: &Path, log: &Path) -> Child {
    Command::new(binary("powerflex-ctld"))
        .args(["--config", config.to_str().expect("utf-8")])
        .stderr(std::fs::File::create(log).expect("log"))
        .spawn()
        .expect("powerflex-ctld")
}

#[test]
fn budget_and_events_reach_every_node_and_survive_a_controller_restart() {
    if !can_run(&[Need::Root]) {
        return;
    }
    cargo_build(&[
        "-p",
        "powerflex-sim-nvml",
        "-p",
        "powerflex-sim",
        "-p",
        "powerflex-agent",
        "--bins",
        "--lib",
        "--examples",
    ]);
    let base = std::env::temp_dir().join(format!("pf-ctld-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&base);
    std::fs::create_dir_all(&base).expect("dir");
    std::fs::set_permissions(&base, std::fs::Permissions::from_mode(0o755)).expect("chmod");
    let key = base.join("powerflex.key");
    write_site_key(&key, "a site key for the controller tests\n");
    let port = free_loopback_port();
    let metrics_port = free_loopback_port();
    let config = base.join("powerflex.toml");
    SiteBuilder::new(100000.0)
        .placement_from_reports()
        .h200(&[700.0, 600.0], 500.0)
        .controller(([127, 0, 0, 1], port).into(), 6, 1)
        .key_file(&key)
        .controller_paths(&base.join("ctld.sock"), &base.join("ctld-state"))
        .controller_metrics(([127, 0, 0, 1], metrics_port).into())
        .agent_paths(
            &format!("{}/%n.sock", base.display()),
            &format!("{}/state/%n", base.display()),
            &profile_dir().join("libpowerflex_sim_nvml.so"),
        )
        .write(&config)
        .unwrap_or_else(|e| panic!("{e}"));
    write_node_keys(&binary("powerflexctl"), &config, &["n1", "n2"]);
    let mut procs = Children(Vec::new());
    procs.0.push(start_ctld(&config, &base.join("ctld.log")));
    let admin = base.join("ctld.sock");
    wait_until("the admin socket", Duration::from_secs(20), || {
        admin.exists().then_some(())
    });

    let mut nodes = Vec::new();
    for name in ["n1", "n2"] {
        let node = Node::init(&base.join("sim").join(name), name, "H200", 4, true).expect("sim");
        procs.0.push(
            Command::new(binary("powerflexd"))
                .args([
                    "--config",
                    config.to_str().expect("utf-8"),
                    "--node",
                    name,
                    "--sample-interval-ms",
                    "250",
                ])
                .env("POWERFLEX_SIM_DIR", node.dir())
                .stderr(std::fs::File::create(base.join(format!("agent-{name}.log"))).expect("log"))
                .spawn()
                .expect("agent"),
        );
        let sock = base.join(format!("{name}.sock"));
        wait_until("agent socket", Duration::from_secs(20), || {
            std::os::unix::net::UnixStream::connect(&sock)
                .is_ok()
                .then_some(())
        });
        let client = profile_dir().join("examples/socket_client");
        let reg = format!(
            "{{\"v\":1,\"op\":\"register\",\"job_id\":\"77\",\"step_id\":\"0\",\"uid\":65534,\"node\":\"{name}\",\"gpus\":[\"0\",\"1\",\"2\",\"3\"],\"flex\":\"flex3,calibrate=off\"}}"
        );
        let out = Command::new(&client)
            .args([sock.to_str().expect("utf-8"), &reg])
            .output()
            .expect("client");
        assert!(
            String::from_utf8_lossy(&out.stdout).contains("\"ok\":true"),
            "{}",
            String::from_utf8_lossy(&out.stdout)
        );
        procs.0.push(
            Command::new(profile_dir().join("powerflex-simjob"))
                .args([
                    "--profile",
                    "llama-3.1-70b-dense-pt-8g-compile",
                    "--time-scale",
                    "20",
                ])
                .env("POWERFLEX_SIM_DIR", node.dir())
                .env("SLURM_JOB_ID", "77")
                .env("SLURM_JOB_GPUS", "0,1,2,3")
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .spawn()
                .expect("simjob"),
        );
        nodes.push(node);
    }
    let ctl = binary("powerflexctl");
    let socket = admin.to_str().expect("utf-8").to_string();
    let ctl_run = |args: &[&str]| {
        let mut a: Vec<&str> = args.to_vec();
        a.extend(["--socket", &socket]);
        run(&ctl, &a)
    };
    // Both agents connect; the job spans both nodes.
    wait_until("both nodes live in status", Duration::from_secs(20), || {
        let out = ctl_run(&["status", "--format", "json"]);
        let s: CtldStatus = serde_json::from_str(&out.stdout).ok()?;
        let live = s.nodes.iter().filter(|n| n.live).count();
        (live == 2 && s.jobs.first()?.gpus == 8).then_some(())
    });

    // A budget cut: one cap on all 8 GPUs, draw within the budget.
    let set = ctl_run(&["budget", "set", "3.2kW"]);
    assert_eq!(set.code, Some(0), "{}", set.stderr);
    // (A job no lease names yet waits at the 500 W fail-safe cap: that is not the cut.)
    let cap = wait_until("the cut on every GPU", Duration::from_secs(15), || {
        let caps = caps_w(&nodes);
        (caps.iter().all(|&c| c == caps[0]) && caps[0] * 8.0 <= 3200.0 + 1e-6).then_some(caps[0])
    });
    assert!(cap < 500.0, "8 x {cap} W");
    wait_until("draw within 3.2 kW", Duration::from_secs(10), || {
        (draw_w(&nodes) <= 3200.0 * 1.005).then_some(())
    });

    // A grid event now: half the budget.
    let add = ctl_run(&[
        "event",
        "add",
        "--reduce",
        "50%",
        "--of",
        "base",
        "--start",
        "now",
        "--duration",
        "10m",
    ]);
    assert_eq!(add.code, Some(0), "{}", add.stderr);
    wait_until("the event's caps", Duration::from_secs(15), || {
        caps_w(&nodes)
            .iter()
            .all(|&c| c * 8.0 <= 1600.0 + 1e-6)
            .then_some(())
    });
    wait_until("draw within 1.6 kW", Duration::from_secs(10), || {
        (draw_w(&nodes) <= 1600.0 * 1.005).then_some(())
    });

    // kill -9 the controller mid-event: caps hold on their leases; restarted, it resumes.
    procs.0[0].kill().expect("kill");
    let _ = procs.0[0].wait();
    std::thread::sleep(Duration::from_secs(2));
    assert!(
        draw_w(&nodes) <= 1600.0 * 1.005,
        "leases hold while the controller is down"
    );
    procs.0[0] = start_ctld(&config, &base.join("ctld2.log"));
    wait_until(
        "the event resumed after restart",
        Duration::from_secs(20),
        || {
            let out = ctl_run(&["status", "--format", "json"]);
            let s: CtldStatus = serde_json::from_str(&out.stdout).ok()?;
            (s.active_event.map(|e| e.id) == Some(1) && s.budget_w <= 1600.0 + 1e-6).then_some(())
        },
    );
    for _ in 0..10 {
        assert!(
            draw_w(&nodes) <= 1600.0 * 1.005,
            "never over budget across the restart"
        );
        std::thread::sleep(Duration::from_millis(200));
    }

    // Only root changes the budget; malformed input is refused with a message.
    let as_nobody = Command::new("setpriv")
        .args(["--reuid=65534", "--regid=65534", "--clear-groups"])
        .arg(&ctl)
        .args(["budget", "set", "100kW", "--socket", &socket])
        .output()
        .expect("setpriv");
    assert_eq!(as_nobody.status.code(), Some(1));
    assert!(
        String::from_utf8_lossy(&as_nobody.stderr).contains("only root"),
        "{}",
        String::from_utf8_lossy(&as_nobody.stderr)
    );
    let bad = ctl_run(&["event", "add", "--reduce", "150%", "--duration", "1h"]);
    assert_eq!(bad.code, Some(2), "a bad value is a usage error");
    assert!(bad.stderr.contains("bad reduction"), "{}", bad.stderr);
    let cancel = ctl_run(&["event", "cancel", "1"]);
    assert_eq!(cancel.code, Some(0), "{}", cancel.stderr);
    wait_until(
        "caps back up after the event",
        Duration::from_secs(15),
        || {
            caps_w(&nodes)
                .iter()
                .all(|&c| c * 8.0 > 1600.0 + 1.0)
                .then_some(())
        },
    );

    // `--reduce` without `--of` is a share of the draw now, sent as the target it makes
    // and said in the reply.
    let read: CtldStatus =
        serde_json::from_str(&ctl_run(&["status", "--format", "json"]).stdout).expect("status");
    // Not for an event that starts later (the draw then is not the draw now).
    let later = ctl_run(&[
        "event",
        "add",
        "--reduce",
        "25%",
        "--start",
        "+1h",
        "--duration",
        "1h",
    ]);
    assert_ne!(later.code, Some(0), "{}", later.stdout);
    assert!(later.stderr.contains("starts later"), "{}", later.stderr);
    let add = ctl_run(&[
        "event",
        "add",
        "--reduce",
        "25%",
        "--start",
        "now",
        "--duration",
        "1h",
    ]);
    assert_eq!(add.code, Some(0), "{}", add.stderr);
    // Nor while an event cuts the draw already.
    let again = ctl_run(&["event", "add", "--reduce", "10%", "--duration", "1h"]);
    assert_ne!(again.code, Some(0), "{}", again.stdout);
    assert!(again.stderr.contains("in force"), "{}", again.stderr);
    assert!(
        add.stdout.contains("25 % below the draw now"),
        "{}",
        add.stdout
    );
    let listed: Vec<powerflex_proto::event::Event> =
        serde_json::from_str(&ctl_run(&["events", "--format", "json"]).stdout).expect("events");
    let [planned] = &listed[..] else {
        panic!("one event: {listed:?}");
    };
    let powerflex_proto::event::Cut::Target { budget_w } = planned.cut else {
        panic!("a share of the draw is sent as its target: {planned:?}");
    };
    let expected = 0.75 * read.draw_w;
    assert!(
        (budget_w - expected).abs() <= 0.05 * expected,
        "{budget_w} W against 75 % of the {} W draw",
        read.draw_w
    );
    let cancel = ctl_run(&["event", "cancel", &planned.id.to_string()]);
    assert_eq!(cancel.code, Some(0), "{}", cancel.stderr);

    // The views an admin reads.
    let status = ctl_run(&["status"]);
    assert!(
        status.stdout.starts_with("budget 3200 W") && status.stdout.contains("flex3"),
        "{}",
        status.stdout
    );
    let jobs = ctl_run(&["jobs"]);
    assert!(
        jobs.stdout.contains("77") && jobs.stdout.contains("n1,n2"),
        "{}",
        jobs.stdout
    );
    let nodes_out = ctl_run(&["nodes", "--format", "json"]);
    let listed: Vec<NodeStatus> = serde_json::from_str(&nodes_out.stdout).expect("json");
    assert_eq!(listed.len(), 2);
    let report = ctl_run(&["report", "--job", "77"]);
    assert!(
        report
            .stdout
            .starts_with("job 77: tier flex3,calibrate=off"),
        "{}",
        report.stdout
    );
    assert_eq!(ctl_run(&["report", "--job", "999"]).code, Some(1));
    let events = ctl_run(&["events", "--format", "json"]);
    assert_eq!(events.stdout.trim(), "[]", "the cancelled event is gone");

    // Need-to-know: job 77 was registered (by root, as slurmstepd does) for
    // uid 65534. A non-root caller sees the site and only their own jobs, and no what-if
    // (it shows every job's curve and cap).
    let as_uid = |uid: u32, args: &[&str]| {
        Command::new("setpriv")
            .args([
                &format!("--reuid={uid}"),
                &format!("--regid={uid}"),
                "--clear-groups",
            ])
            .arg(&ctl)
            .args(args)
            .args(["--socket", &socket])
            .output()
            .expect("setpriv")
    };
    let as_nobody = |args: &[&str]| as_uid(65534, args);
    let whatif = as_nobody(&["whatif", "--policy", "equal", "--format", "json"]);
    assert_eq!(whatif.status.code(), Some(1));
    assert!(
        String::from_utf8_lossy(&whatif.stderr).contains("root only"),
        "{}",
        String::from_utf8_lossy(&whatif.stderr)
    );
    let status = as_nobody(&["status", "--format", "json"]);
    let seen: CtldStatus = serde_json::from_slice(&status.stdout).expect("json");
    let ids: Vec<&str> = seen.jobs.iter().map(|j| j.job.as_str()).collect();
    assert_eq!(ids, ["77"], "the owner sees their job");
    assert_eq!(seen.jobs[0].owner_uid, Some(65534));
    assert_eq!(seen.jobs_of_uid, Some(65534));
    assert!(!seen.nodes.is_empty() && seen.budget_w > 0.0, "{seen:?}");
    let report = as_nobody(&["report", "--job", "77"]);
    assert!(
        String::from_utf8_lossy(&report.stdout).starts_with("job 77: tier flex3"),
        "{}",
        String::from_utf8_lossy(&report.stderr)
    );
    let other = as_uid(65533, &["status", "--format", "json"]);
    let seen: CtldStatus = serde_json::from_slice(&other.stdout).expect("json");
    assert!(seen.jobs.is_empty(), "another user sees no job: {seen:?}");
    assert_eq!(
        seen.nodes.iter().map(|n| n.jobs).sum::<u32>(),
        2,
        "node counts stay"
    );
    let report = as_uid(65533, &["report", "--job", "77"]);
    assert_eq!(report.status.code(), Some(1));
    assert!(
        String::from_utf8_lossy(&report.stderr).contains("no job 77 of uid 65533"),
        "{}",
        String::from_utf8_lossy(&report.stderr)
    );

    // What equal-weight would do at half the budget, on the same curves: read-only, and
    // nothing changes on the GPUs.
    let whatif = ctl_run(&[
        "whatif", "--policy", "equal", "--budget", "1.6kW", "--format", "json",
    ]);
    assert_eq!(whatif.code, Some(0), "{}", whatif.stderr);
    let decision: DecisionView = serde_json::from_str(&whatif.stdout).expect("json");
    let allocation = decision.allocation.as_ref().expect("an allocation");
    assert_eq!(allocation.policy.name(), "equal", "{decision:?}");
    assert_eq!(decision.budget_w, 1600.0, "{decision:?}");
    let planned = allocation.total_power_w.0 + decision.reserved_w;
    assert!(planned <= 1600.0 + 1e-6, "{decision:?}");
    let job77 = allocation
        .jobs
        .iter()
        .find(|j| j.id == "77")
        .expect("job 77 in the what-if");
    assert!(job77.cap_w.0 < 700.0, "{job77:?}");
    let after: CtldStatus =
        serde_json::from_str(&ctl_run(&["status", "--format", "json"]).stdout).expect("json");
    assert_eq!(
        after.budget_w, 3200.0,
        "a what-if applies nothing: {after:?}"
    );
    let table = ctl_run(&["whatif", "--policy", "optimal"]);
    assert!(
        table.stdout.starts_with("policy optimal: budget 3200 W") && table.stdout.contains("77"),
        "{}",
        table.stdout
    );
    let unknown = ctl_run(&["whatif", "--policy", "fastest"]);
    assert_eq!(unknown.code, Some(2), "a bad value is a usage error");
    assert!(
        unknown
            .stderr
            .contains("possible values: optimal, equal, pfi-proportional"),
        "{}",
        unknown.stderr
    );

    // Prometheus text on loopback: the budget in force and the job's cap.
    let metrics = http_get(metrics_port, "/metrics");
    assert!(metrics.starts_with("HTTP/1.1 200"), "{metrics}");
    assert!(metrics.contains("powerflex_budget_watts 3200"), "{metrics}");
    assert!(
        metrics.contains("powerflex_job_granted_cap_watts{job=\"77\"}"),
        "{metrics}"
    );
    // The agent's name for the cap it applied carries {node,job,tier}: the controller's
    // grant must not reuse it with another label set.
    assert!(!metrics.contains("powerflex_job_cap_watts"), "{metrics}");
    assert!(http_get(metrics_port, "/nope").starts_with("HTTP/1.1 404"));

    // The plot: an SVG of the history since the restart (kept in memory) with the job's caps.
    let svg_path = base.join("history.svg");
    let plot = ctl_run(&["plot", "--out", svg_path.to_str().expect("utf-8")]);
    assert_eq!(plot.code, Some(0), "{}", plot.stderr);
    assert!(plot.stdout.contains("1 jobs"), "{}", plot.stdout);
    let svg = std::fs::read_to_string(&svg_path).expect("svg written");
    assert!(svg.starts_with("<svg") && svg.contains(">job 77<") && svg.contains("SIMULATED"));
    assert!(svg.matches("<polyline").count() >= 3, "{svg}");
    let png = ctl_run(&["plot", "--out", "x.png"]);
    assert_eq!(png.code, Some(2), "a bad value is a usage error");
    assert!(png.stderr.contains("only SVG"), "{}", png.stderr);

    // A handshake sealed with another key is refused and logged.
    use std::io::{BufRead as _, Write as _};
    let wrong_key = powerflex::link_peer::LinkPeer::connect_with_key(
        ([127, 0, 0, 1], port).into(),
        b"not the node key at all, no no no",
        "n1",
        Vec::new(),
    );
    assert!(wrong_key.is_err(), "a wrong key gets no session");
    wait_until(
        "the forged handshake in the log",
        Duration::from_secs(10),
        || {
            std::fs::read_to_string(base.join("ctld2.log"))
                .ok()?
                .contains("fails authentication")
                .then_some(())
        },
    );

    // A correctly sealed frame sent twice on its session: the copy is a replay, refused
    // and logged, and the session ends.
    let key_bytes = std::fs::read(&key).expect("key");
    let mut ghost = powerflex::link_peer::LinkPeer::connect(
        ([127, 0, 0, 1], port).into(),
        key_bytes.trim_ascii(),
        "ghost",
        Vec::new(),
    )
    .expect("a session under the derived key");
    let report = ghost
        .session
        .seal(
            &powerflex_proto::link::Body::Report {
                jobs: vec![],
                power_w: 0.0,
                failsafe: false,
                cap_mismatches: 0,
                ended: Vec::new(),
                observe_only: false,
            },
            powerflex::link_peer::unix_ms(),
        )
        .expect("seal");
    ghost.stream.write_all(report.as_bytes()).expect("send");
    ghost.stream.write_all(report.as_bytes()).expect("replay");
    wait_until("the replay in the log", Duration::from_secs(10), || {
        let log = std::fs::read_to_string(base.join("ctld2.log")).ok()?;
        log.contains("message from ghost replayed").then_some(())
    });

    // A version 1 agent's hello: refused in words it reads, and logged.
    let mut v1 = std::net::TcpStream::connect(("127.0.0.1", port)).expect("connect");
    v1.set_read_timeout(Some(Duration::from_secs(10)))
        .expect("timeout");
    v1.write_all(b"{\"v\":1,\"from\":\"n9\",\"seq\":1,\"ts_ms\":1,\"body\":{\"type\":\"hello\",\"gpus\":[]},\"mac\":\"00\"}\n")
        .expect("send");
    let mut answer = String::new();
    std::io::BufReader::new(v1)
        .read_line(&mut answer)
        .expect("an answer");
    assert!(
        answer.contains("link version 1 refused; accepted: version 2"),
        "{answer}"
    );
    wait_until("the v1 refusal in the log", Duration::from_secs(10), || {
        let log = std::fs::read_to_string(base.join("ctld2.log")).ok()?;
        log.contains("link version 1 refused").then_some(())
    });

    // An agent that disappears: after its lease it counts at its fail-safe cap and the
    // rest of the budget goes to the live node.
    procs.0[3].kill().expect("kill agent n2");
    let _ = procs.0[3].wait();
    wait_until("n2 silent", Duration::from_secs(20), || {
        let out = ctl_run(&["nodes", "--format", "json"]);
        let nodes: Vec<NodeStatus> = serde_json::from_str(&out.stdout).ok()?;
        nodes
            .iter()
            .any(|n| n.node == "n2" && !n.live)
            .then_some(())
    });
    let _ = std::fs::remove_dir_all(PathBuf::from(&base).join("sim"));
}
