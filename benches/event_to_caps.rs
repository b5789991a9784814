//! Controller scale benchmark: how long from `powerflexctl event add --start now`
//! until every node of a 1,000-node × 8-GPU site holds its new cap, and how long one
//! allocation takes at 10,000 jobs.
//!
//! Part 1 runs the real `powerflex-ctld` and `powerflexctl` binaries on loopback. The
//! 1,000 agents are a lightweight harness in this process that speaks the real link
//! protocol (HMAC-sealed Hello, Reports every period with calibrated curves, Leases read
//! back): real powerflexd processes would need 1,000 simulated NVML trees and 1,000
//! processes on a 2-CPU machine, and add only the NVML set call, which the agent
//! benchmark covers. "Applied" here = the node's harness received a lease with its new
//! cap. Each trial: event add (−30 %) → all caps cut, then event cancel → all caps back.
//!
//! Part 2 times `powerflex_decide::decide` (the controller's allocation step, pure) in process at
//! 1,000 and 10,000 jobs.
//!
//! Part 3 times a whole core step (`Controller::step` on a tick: allocation, hold-out
//! planning, leases, metrics, the history sample) at 1,000 and 2,000 jobs, alone and
//! while threads answer `history` requests from a full history board as the admin
//! threads do, and how long one such answer takes (work kept outside the step, so a
//! flood of readers cannot hold it up). `-- core-step` runs part 3 alone.
//!
//! Run: `cargo bench -p powerflex --bench event_to_caps` (SIMULATED site).

use powerflex_daemon::clock::unix_ms;
use std::io::{BufRead, Write};
use std::net::TcpStream;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use powerflex::binary;
use powerflex::link_peer::LinkPeer;
use powerflex::site_config::SiteBuilder;
use powerflex_controller_machine::controller::history::{HistoryBoard, HISTORY};
use powerflex_controller_machine::controller::step::{Controller, Input};
use powerflex_controller_machine::controller::CtldSettings;
use powerflex_core::allocate::Policy;
use powerflex_core::config::RawGpuModel;
use powerflex_core::flex::TierTable;
use powerflex_core::{UnixMs, Watts};
use powerflex_decide::{decide, NodeView, SiteSettings};
use powerflex_proto::link::{Body, Session};
use powerflex_proto::report::{GpuInfo, JobReport};

/// Site sizes measured, nodes.
const NODE_COUNTS: [usize; 3] = [10, 100, 1000];
const GPUS_PER_NODE: usize = 8;
const MAX_CAP_W: f64 = 700.0;
const MIN_CAP_W: f64 = 200.0;
/// The base budget per GPU (5 MW for 1,000 nodes of 8): below the uncapped draw.
const BASE_BUDGET_PER_GPU_W: f64 = 625.0;
const CUT: f64 = 0.30;
const TRIALS: usize = 5;
const KEY: &[u8] = b"benchmark site key, loopback only";
/// The harness's GPUs draw this share of their cap (busy training; the curve points say the same).
const DRAW_PER_CAP: f64 = 0.97;
const TIERS: [&str; 4] = ["flex0", "flex1", "flex2", "flex3"];

fn gpu_info(node: usize, gpu: usize) -> GpuInfo {
    GpuInfo {
        uuid: format!("GPU-bench-{node:04}-{gpu}"),
        name: "NVIDIA H200 (simulated)".into(),
        min_w: MIN_CAP_W,
        max_w: MAX_CAP_W,
        default_w: MAX_CAP_W,
    }
}

/// A job's calibrated points, [per-GPU cap, job power, throughput]: a concave curve whose
/// curvature varies by job, so PFIs spread from ~0.55 to ~0.95 like the paper's library.
fn job_report(job: usize, gpus: u32, cap_w: f64) -> JobReport {
    let curvature = 0.2 + 0.8 * ((job * 7919) % 1000) as f64 / 1000.0;
    let throughput = |cap: f64| 1000.0 * (1.0 - curvature * (1.0 - cap / MAX_CAP_W).powi(2));
    let points = [700.0, 600.0, 500.0, 400.0]
        .iter()
        .map(|&c| [c, c * DRAW_PER_CAP * f64::from(gpus), throughput(c)])
        .map(powerflex_proto::point::from_array)
        .collect();
    JobReport {
        job_id: format!("{}", 100_000 + job),
        tier: TIERS[job % TIERS.len()].into(),
        gpus,
        cap_w: Some(cap_w),
        power_w: Some(cap_w * DRAW_PER_CAP * f64::from(gpus)),
        throughput: Some(throughput(cap_w)),
        throughput_unit: Some(powerflex_proto::usage::ThroughputUnit::Tokens),
        pfi: None,
        pfi_source: Some(powerflex_proto::status::PfiSource::Measured),
        points,
        gpu_uuids: Vec::new(),
        power_cap_w: Some(cap_w),
        power_cap_steady_s: Some(10.0),
        calibrating: false,
        curve_in_question: false,
        curve: Vec::new(),
        calibration_cost_pct: None,
        owner_uid: None,
        usage: None,
    }
}

/// One harness node: its connection and session, and the last lease it got.
struct HarnessNode {
    /// The connection and the session that seals on it.
    writer: Mutex<(TcpStream, Session)>,
    /// f64 bits of the cap in the last lease.
    cap_bits: AtomicU64,
    /// Nanoseconds since the benchmark's epoch at which the last lease arrived.
    lease_at_ns: AtomicU64,
}

impl HarnessNode {
    fn send(&self, body: Body) {
        let mut writer = self.writer.lock().expect("writer");
        let (stream, session) = &mut *writer;
        let line = session.seal(&body, unix_ms()).expect("seal");
        let _ = stream.write_all(line.as_bytes());
    }
    fn cap_w(&self) -> f64 {
        f64::from_bits(self.cap_bits.load(Ordering::SeqCst))
    }
    fn report(&self, index: usize) {
        let cap = self.cap_w();
        self.send(Body::Report {
            jobs: vec![job_report(index, GPUS_PER_NODE as u32, cap)],
            power_w: cap * DRAW_PER_CAP * GPUS_PER_NODE as f64,
            failsafe: false,
            cap_mismatches: 0,
            ended: Vec::new(),
            observe_only: false,
        });
    }
}

fn start_ctld(dir: &Path, port: u16, base_budget_w: f64) -> Child {
    let key = dir.join("site.key");
    std::fs::write(&key, KEY).expect("key");
    // The controller refuses a key others can read, like a real site's.
    std::fs::set_permissions(&key, std::os::unix::fs::PermissionsExt::from_mode(0o600))
        .expect("chmod");
    let config = dir.join("powerflex.toml");
    SiteBuilder::new(base_budget_w)
        .placement_from_reports()
        .gpu_model(
            "H200",
            RawGpuModel {
                min_cap_w: MIN_CAP_W,
                max_cap_w: MAX_CAP_W,
                cap_step_w: 5.0,
                calibration_caps_w: vec![700.0, 600.0, 500.0, 400.0],
                failsafe_cap_w: 500.0,
            },
        )
        .controller(([127, 0, 0, 1], port).into(), 60, 10)
        .key_file(&key)
        .controller_paths(&dir.join("ctld.sock"), &dir.join("state"))
        .write(&config)
        .unwrap_or_else(|e| panic!("{e}"));
    Command::new(binary("powerflex-ctld"))
        .args(["--config", config.to_str().expect("utf-8")])
        .env("RUST_LOG", "warn")
        .stderr(std::fs::File::create(dir.join("ctld.log")).expect("log"))
        .stdout(Stdio::null())
        .spawn()
        .expect("powerflex-ctld")
}

fn ctl(dir: &Path, args: &[&str]) -> String {
    let socket = dir.join("ctld.sock");
    // Built before the first timed call (see main), so this costs no cargo run.
    let out = Command::new(binary("powerflexctl"))
        .args(args)
        .args(["--socket", socket.to_str().expect("utf-8")])
        .output()
        .expect("powerflexctl");
    assert!(
        out.status.success(),
        "powerflexctl {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// Waits until every node got a lease after `since_ns` and `done(caps)` holds; returns
/// the elapsed time from `since`.
fn wait_all(
    nodes: &[Arc<HarnessNode>],
    epoch: Instant,
    since: Instant,
    done: impl Fn(&[f64]) -> bool,
) -> Duration {
    let since_ns = since.duration_since(epoch).as_nanos() as u64;
    loop {
        let fresh = nodes
            .iter()
            .all(|n| n.lease_at_ns.load(Ordering::SeqCst) >= since_ns);
        let caps: Vec<f64> = nodes.iter().map(|n| n.cap_w()).collect();
        if fresh && done(&caps) {
            let last = nodes
                .iter()
                .map(|n| n.lease_at_ns.load(Ordering::SeqCst))
                .max()
                .unwrap_or(since_ns);
            return Duration::from_nanos(last.saturating_sub(since_ns));
        }
        if since.elapsed() > Duration::from_secs(60) {
            let stale = nodes
                .iter()
                .filter(|n| n.lease_at_ns.load(Ordering::SeqCst) < since_ns)
                .count();
            panic!(
                "caps never settled: {stale} nodes without a new lease, draw {:.0} W",
                caps.iter().sum::<f64>() * GPUS_PER_NODE as f64 * DRAW_PER_CAP
            );
        }
        std::thread::sleep(Duration::from_millis(1));
    }
}

fn site_settings() -> SiteSettings {
    SiteSettings {
        tiers: TierTable::default_table(),
        policy: Policy::Optimal,
        cap_step: Watts(5.0),
        failsafe_cap: Watts(500.0),
        default_pfi: 0.8,
        budget_mode: powerflex_core::config::BudgetMode::default(),
        objective: powerflex_core::config::Objective::Tokens,
        tier_bounds: powerflex_decide::TierBounds::Honoured,
        domains: None,
    }
}

fn event_to_caps(node_count: usize) -> Vec<(Duration, Duration)> {
    let base_budget_w = (node_count * GPUS_PER_NODE) as f64 * BASE_BUDGET_PER_GPU_W;
    let dir = std::env::temp_dir().join(format!("pf-ctld-bench-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("dir");
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("port");
    let mut ctld = start_ctld(&dir, port, base_budget_w);
    let admin = dir.join("ctld.sock");
    let started = Instant::now();
    while !admin.exists() {
        assert!(
            started.elapsed() < Duration::from_secs(30),
            "ctld did not start; see {}",
            dir.join("ctld.log").display()
        );
        std::thread::sleep(Duration::from_millis(20));
    }

    let epoch = Instant::now();
    eprintln!(
        "connecting {node_count} harness agents ({} GPUs) ...",
        node_count * GPUS_PER_NODE
    );
    let nodes: Vec<Arc<HarnessNode>> = (0..node_count)
        .map(|i| {
            let name = format!("bench{i:04}");
            let (stream, reader, session) = LinkPeer::connect(
                ([127, 0, 0, 1], port).into(),
                KEY,
                &name,
                (0..GPUS_PER_NODE).map(|g| gpu_info(i, g)).collect(),
            )
            .expect("a link session with the controller")
            .into_parts();
            let mut opener = session.clone();
            let node = Arc::new(HarnessNode {
                writer: Mutex::new((stream, session)),
                cap_bits: AtomicU64::new(MAX_CAP_W.to_bits()),
                lease_at_ns: AtomicU64::new(0),
            });
            let (reading, job) = (node.clone(), format!("{}", 100_000 + i));
            std::thread::Builder::new()
                .stack_size(64 * 1024)
                .spawn(move || {
                    for line in reader.lines() {
                        let Ok(line) = line else { return };
                        let Ok(body) = opener.open(&line, unix_ms()) else {
                            continue;
                        };
                        if let Body::Lease { caps, .. } = body {
                            if let Some(&cap) = caps.get(&job) {
                                reading.cap_bits.store(cap.to_bits(), Ordering::SeqCst);
                                reading
                                    .lease_at_ns
                                    .store(epoch.elapsed().as_nanos() as u64, Ordering::SeqCst);
                            }
                        }
                    }
                })
                .expect("reader thread");
            node.report(i);
            node
        })
        .collect();
    // Agents report every period (the real ones every allocation period); reports keep
    // the nodes live and carry the draw the caps produce.
    let reporting = Arc::new(std::sync::atomic::AtomicBool::new(true));
    let reporter = {
        let (nodes, reporting) = (nodes.clone(), reporting.clone());
        std::thread::spawn(move || {
            while reporting.load(Ordering::SeqCst) {
                for (i, n) in nodes.iter().enumerate() {
                    n.report(i);
                }
                std::thread::sleep(Duration::from_secs(2));
            }
        })
    };
    // The budget bounds the draw (what the facility meter sees), not the caps' sum.
    let base_total = |caps: &[f64]| caps.iter().sum::<f64>() * GPUS_PER_NODE as f64 * DRAW_PER_CAP;
    let first = wait_all(&nodes, epoch, epoch, |caps| {
        base_total(caps) <= base_budget_w + 1e-6
    });
    eprintln!(
        "all {node_count} nodes leased within {:.0} ms of connecting; draw {:.0} kW of {:.0} kW",
        first.as_secs_f64() * 1e3,
        base_total(&nodes.iter().map(|n| n.cap_w()).collect::<Vec<_>>()) / 1e3,
        base_budget_w / 1e3
    );
    let before: Vec<f64> = nodes.iter().map(|n| n.cap_w()).collect();

    let mut results = Vec::new();
    for trial in 1..=TRIALS {
        let cut_budget = base_budget_w * (1.0 - CUT);
        let t0 = Instant::now();
        let reply = ctl(
            &dir,
            &[
                "event",
                "add",
                "--reduce",
                "30%",
                "--of",
                "base",
                "--start",
                "now",
                "--duration",
                "1h",
            ],
        );
        let cut = wait_all(&nodes, epoch, t0, |caps| {
            base_total(caps) <= cut_budget + 1e-6
        });
        let id = reply
            .split_whitespace()
            .nth(1)
            .expect("event id in the reply")
            .to_string();
        let t1 = Instant::now();
        ctl(&dir, &["event", "cancel", &id]);
        // Restored: the cut lifted, the draw back to at least what it was before (within
        // 1 % of the budget) and within the base budget. Not the same caps to the watt:
        // the first leases are a start that later allocations improve on, and a steady
        // allocation keeps caps that a new decision would change for too little.
        let before_w = base_total(&before);
        let restore = wait_all(&nodes, epoch, t1, |caps| {
            let w = base_total(caps);
            w <= base_budget_w + 1e-6 && w >= before_w - 0.01 * base_budget_w
        });
        eprintln!(
            "trial {trial}/{TRIALS}: draw cut to {:.0} kW in {:.0} ms, restored in {:.0} ms",
            cut_budget / 1e3,
            cut.as_secs_f64() * 1e3,
            restore.as_secs_f64() * 1e3
        );
        results.push((cut, restore));
    }
    reporting.store(false, Ordering::SeqCst);
    let _ = reporter.join();
    let _ = ctld.kill();
    let _ = ctld.wait();
    let _ = std::fs::remove_dir_all(&dir);
    results
}

/// Nodes of `gpus_per_job` × `jobs_per_node` GPUs, one job per slot, all calibrated.
fn synthetic_site(jobs: usize, jobs_per_node: usize) -> Vec<NodeView> {
    let gpus_per_job = (GPUS_PER_NODE / jobs_per_node) as u32;
    (0..jobs.div_ceil(jobs_per_node))
        .map(|n| {
            let jobs: Vec<JobReport> = (n * jobs_per_node..((n + 1) * jobs_per_node).min(jobs))
                .map(|j| job_report(j, gpus_per_job, MAX_CAP_W))
                .collect();
            NodeView {
                node: format!("n{n:05}"),
                gpus: (0..GPUS_PER_NODE).map(|g| gpu_info(n, g)).collect(),
                power_w: jobs.iter().filter_map(|j| j.power_w).sum(),
                jobs,
                live: true,
            }
        })
        .collect()
}

fn time_decide(jobs: usize, jobs_per_node: usize) -> (usize, Duration, f64) {
    let views = synthetic_site(jobs, jobs_per_node);
    let gpus = views.len() * GPUS_PER_NODE;
    let budget = Watts(gpus as f64 * MAX_CAP_W * 0.7);
    let settings = site_settings();
    let _ = decide(&views, budget, &settings);
    let mut times: Vec<Duration> = (0..7)
        .map(|_| {
            let t = Instant::now();
            let d = decide(&views, budget, &settings);
            let elapsed = t.elapsed();
            assert_eq!(d.allocation.map(|a| a.jobs.len()), Some(jobs));
            elapsed
        })
        .collect();
    times.sort();
    let granted: f64 = decide(&views, budget, &settings)
        .leases
        .values()
        .flat_map(|l| l.values())
        .sum();
    (gpus, times[times.len() / 2], granted)
}

/// Users owning the synthetic site's jobs in part 3 (job `j` is uid `1000 + j % USERS`).
const USERS: u32 = 100;
/// Threads answering `history` in part 3, as many as the admin socket serves one user.
const HISTORY_READERS: usize = 4;

/// Part 3: a core step at `jobs` jobs, its median alone and while [`HISTORY_READERS`]
/// threads ask the board for the history's overview as one of [`USERS`] users (the
/// flood any local user can send; each answer picks 2,000 samples of a cap per job and
/// keeps the user's), and the median answer. On a machine with fewer cores than readers
/// plus the loop, what the step loses is CPU time: the readers hold the board's lock
/// only to pick pointers.
fn time_core_step_with_history_readers(
    jobs: usize,
    jobs_per_node: usize,
) -> (Duration, Duration, Duration) {
    let mut views = synthetic_site(jobs, jobs_per_node);
    for (j, job) in views.iter_mut().flat_map(|v| v.jobs.iter_mut()).enumerate() {
        job.owner_uid = Some(1000 + j as u32 % USERS);
    }
    let gpus = views.len() * GPUS_PER_NODE;
    let options = CtldSettings {
        // Part 1's budget: within every tier's floor, so no job is held out (planning
        // hold-outs re-decides once per job held, a different cost).
        base_budget: Watts(gpus as f64 * BASE_BUDGET_PER_GPU_W),
        period: Duration::from_secs(10),
        lease_ttl_s: 30.0,
        site: site_settings(),
        lease_rollout: Default::default(),
        max_ramp_w_per_s: None,
        job_placement: powerflex_core::config::JobPlacement::Reports,
        max_gpu_power_w: MAX_CAP_W,
    };
    let t0 = unix_ms();
    let mut core = Controller::new(options, Default::default(), UnixMs(t0));
    let inputs: Vec<Input> = views
        .into_iter()
        .flat_map(|v| {
            [
                Input::Hello {
                    node: v.node.clone(),
                    gpus: v.gpus,
                },
                Input::Report {
                    node: v.node,
                    jobs: v.jobs,
                    power_w: v.power_w,
                    ended: Vec::new(),
                    observe_only: false,
                },
            ]
        })
        .collect();
    let board = HistoryBoard::new();
    let out = core.step(UnixMs(t0), inputs);
    let sample = out.history.expect("the first step allocates");
    assert_eq!(sample.caps.len(), jobs);
    // A full board: the sample shared HISTORY times (one sample's memory, a full
    // history's work for the readers).
    board.publish(None, out.owners);
    for _ in 0..HISTORY {
        board.publish(Some(sample.clone()), None);
    }
    // Ticks 1 ms apart: every node stays live and no decrease waits long enough to stall.
    let mut now_ms = t0;
    let mut step = |core: &mut Controller| {
        now_ms += 1;
        let started = Instant::now();
        let out = core.step(UnixMs(now_ms), vec![Input::Tick]);
        let elapsed = started.elapsed();
        assert!(out.history.is_some(), "a tick allocates");
        board.publish(out.history, out.owners);
        elapsed
    };
    let median = |mut v: Vec<Duration>| {
        v.sort();
        v[v.len() / 2]
    };
    let _ = step(&mut core);
    let alone = median((0..7).map(|_| step(&mut core)).collect());
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let readers: Vec<_> = (0..HISTORY_READERS)
        .map(|_| {
            let (board, stop) = (board.clone(), stop.clone());
            std::thread::spawn(move || {
                let mut answers = Vec::new();
                while !stop.load(Ordering::SeqCst) {
                    let started = Instant::now();
                    let reply = board.answer(None, None, 1000);
                    answers.push(started.elapsed());
                    assert_eq!(
                        reply.history().map(|h| h.len()),
                        Some(powerflex_proto::admin::MAX_HISTORY_SAMPLES as usize)
                    );
                }
                answers
            })
        })
        .collect();
    // Once every reader is answering (each picked its first page at least).
    std::thread::sleep(Duration::from_millis(200));
    let with_readers = median((0..7).map(|_| step(&mut core)).collect());
    stop.store(true, Ordering::SeqCst);
    let answers: Vec<Duration> = readers
        .into_iter()
        .flat_map(|r| r.join().expect("reader"))
        .collect();
    (alone, with_readers, median(answers))
}

fn main() {
    // Build (and record as built) both binaries up front: a cargo run inside a timed
    // trial would be counted as controller latency.
    binary("powerflex-ctld");
    binary("powerflexctl");
    let median = |mut v: Vec<Duration>| {
        v.sort();
        v[v.len() / 2]
    };
    let ms = |d: Duration| d.as_secs_f64() * 1e3;
    // `cargo bench --bench event_to_caps -- core-step`: part 3 alone.
    if std::env::args().any(|a| a == "core-step") {
        core_step_part();
        return;
    }
    let mut rows = Vec::new();
    for nodes in NODE_COUNTS {
        let trials = event_to_caps(nodes);
        let cuts: Vec<Duration> = trials.iter().map(|t| t.0).collect();
        let restores: Vec<Duration> = trials.iter().map(|t| t.1).collect();
        rows.push(format!(
            "| {nodes} | {} | {:.0} ms | {:.0} ms | {:.0} ms | {:.0} ms |",
            nodes * GPUS_PER_NODE,
            ms(median(cuts.clone())),
            ms(*cuts.iter().max().expect("trials")),
            ms(median(restores.clone())),
            ms(*restores.iter().max().expect("trials")),
        ));
    }
    println!("Grid event to caps: the real powerflex-ctld and powerflexctl on loopback, harness agents speaking the real link protocol (SIMULATED GPUs, 8 per node), {TRIALS} trials per size; `event add --reduce 30% --start now` until every node's lease brings the draw within the cut budget, and `event cancel` until every cap is back.\n");
    println!("| nodes | GPUs | event → caps cut, median | max | cancel → restored, median | max |");
    println!("| --- | --- | --- | --- | --- | --- |");
    for row in rows {
        println!("{row}");
    }
    println!("\nOne allocation (`powerflex_decide::decide`, in process), budget 70 % of the uncapped draw:\n");
    println!("| jobs | GPUs | median |");
    println!("| --- | --- | --- |");
    for (jobs, per_node) in [(100, 1), (1_000, 1), (10_000, 8)] {
        let (gpus, t, _) = time_decide(jobs, per_node);
        println!("| {jobs} | {gpus} | {:.1} ms |", ms(t));
    }
    core_step_part();
}

/// Part 3: a core step at 1,000 and 2,000 jobs, alone and beside history readers.
fn core_step_part() {
    let ms = |d: Duration| d.as_secs_f64() * 1e3;
    for jobs in [1_000, 2_000] {
        core_step_row(jobs, ms);
    }
}

fn core_step_row(jobs: usize, ms: impl Fn(Duration) -> f64) {
    let (alone, with_readers, answer) = time_core_step_with_history_readers(jobs, 8);
    println!("\nOne core step (`Controller::step`, a tick, in process) at {jobs} jobs, alone and while {HISTORY_READERS} threads answer `history` without pause from a full board ({HISTORY} samples of every job's cap) as one of {USERS} users. The answers run outside the step: the step takes the board's lock once, to publish its sample, and shares the machine's cores with the readers:\n");
    println!("| step alone, median | step with readers, median | one history answer, median |");
    println!("| --- | --- | --- |");
    println!(
        "| {:.1} ms | {:.1} ms | {:.0} ms |",
        ms(alone),
        ms(with_readers),
        ms(answer)
    );
}
