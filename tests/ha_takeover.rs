//! A standby controller on a real PostgreSQL 16: two real
//! `powerflex-ctld` with `[controller.ha]` on one [`PgBed`], one real `powerflexd` on a
//! simulated node of 4 GPUs (the real NVML code path through the simulated library)
//! running a real simulated job (`powerflex-simjob`, [`REAL_PROFILE`], 620 W per GPU
//! uncapped), and three harness agents speaking the real link (no Slurm: the subject is
//! the controllers and the agents' following them).
//!
//! The harness agents follow the agent's rules for what this test checks: they try the
//! controllers' addresses in turn, move on at a `standby` answer, keep the highest epoch
//! they accepted a lease from and refuse a lower one with `fenced`, and hold their last
//! lease's caps until it runs out, then min(fail-safe, last grant). The real agent does
//! so by its own code (`controller.standby_addresses`, its machine's epoch).
//!
//! What is sampled every 50 ms, from before the first kill to the end:
//! - the site's **metered total**: the real node's metered draw (the sum of its
//!   simulated GPUs' power readings, its job held at its caps) plus the harness agents'
//!   caps × GPUs. The harness agents run no GPU: the cap they hold in force is their
//!   node's ceiling, counted as drawn. It must stay within the event's budget, beyond
//!   [`METER_TOLERANCE`] (the simulated readings' noise), at every sample;
//! - the **sum of caps in force**: the harness agents' caps × GPUs and the real node's
//!   GPU limits as its simulated NVML holds them (the promise `hard` mode makes), within
//!   the budget exactly;
//! - each node's cap, and the real node's limit on each GPU, for the "no cap raised"
//!   checks.
//!
//! Checked, fault rows 16 to 19 of `docs/fault-matrix.md`:
//! - the active controller killed with SIGKILL in the middle of a grid event: the standby
//!   takes over within half a lease TTL (the time is printed), from the committed state
//!   (the event still in force, the budget the event's); no node's cap rises before the
//!   new leader's first lease to it; the metered total and the sum of caps stay within
//!   the budget at every sample (before the kill, the real node's job is seen drawing at
//!   its caps, below what it draws uncapped); the old primary, started again, stands by
//!   and never steers;
//! - the database stopped: the active controller steps down (status says so) and no
//!   cap rises; when the database is back one controller steers again, the event still
//!   in force;
//! - the active controller frozen with SIGSTOP (a partition that resets no connection):
//!   the standby takes over, the agents leave the silent one for it within half a lease,
//!   no cap rises meanwhile, and the old leader, thawed, finds it lost leadership and
//!   never steers again;
//! - a rogue controller: the active one killed with SIGKILL and, at its address, a
//!   single controller started from a stale config (no `[controller.ha]`, so epoch 0,
//!   with the site's key and the base budget, far above the event's) before the standby
//!   takes over. The real agent, whose controller went away, reaches it first and
//!   refuses its leases for their epoch (its status counts them); none of its GPU limits
//!   rises meanwhile; the rogue, told `fenced`, says so (`status`: `FENCED`, and in its
//!   log) and stops steering; the standby then leases the node at epoch 5. The harness
//!   agents sit this phase out (stopped, their nodes holding their last lease, then
//!   min(fail-safe, last grant)) so that the refusal is the real agent's, and come back
//!   after it: the fenced rogue sends them on.

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader, Write};
use std::net::SocketAddr;
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use powerflex::ha_pair::{HarnessNode, Held, PairCtld, PairSite};
use powerflex::needs::{can_run, Need};
use powerflex::pg::PgBed;
use powerflex::site_config::SiteBuilder;
use powerflex::stack::METER_TOLERANCE;
use powerflex::{
    binary, free_loopback_port, profile_dir, run, wait_until, write_node_keys, write_site_key,
    Children,
};
use powerflex_daemon::os::{kill, Signal};
use powerflex_proto::status::{AgentStatus, LeadershipRole};
use powerflex_proto::{ControlOp, ControlReply, ControlRequest};
use powerflex_sim::state::Node;

const SITE_KEY: &str = "a site key for the standby controller test\n";
/// Harness agents; the real agent is one more node.
const NODES: usize = 3;
const GPUS: u32 = 4;
const FAILSAFE_W: f64 = 300.0;
/// Above every GPU uncapped (16 × 700 W), so the start is within it.
const BASE_BUDGET_W: f64 = 12_000.0;
/// The event's budget (`--target`).
const EVENT_BUDGET_W: f64 = 5_400.0;
/// The real agent's job.
const REAL_JOB: &str = "900";
/// What the real node's job runs (`powerflex-simjob`), and what it draws per GPU
/// uncapped (`powerflex-sim profiles`): well above the event's share, 5,400 W over 16
/// GPUs (337.5 W), so the event caps it.
const REAL_PROFILE: &str = "llama-3.1-70b-dense-pt-8g-compile";
const REAL_UNCAPPED_W: f64 = 620.0;
const LEASE_TTL_S: u64 = 20;
/// A session without a lease this long is left for the next address, as `powerflexd`
/// does (`LinkOptions::silence_for`: a quarter of the lease, at least three periods).
const SILENT_AFTER: Duration = Duration::from_secs(LEASE_TTL_S / 4);
const LEADER_TTL_S: u64 = 6;

/// Both controllers' site: the base budget, the test bed's H200s and fail-safe.
const SITE: PairSite = PairSite {
    budget_w: BASE_BUDGET_W,
    failsafe_w: FAILSAFE_W,
    lease_ttl_s: LEASE_TTL_S,
    leader_ttl_s: LEADER_TTL_S,
};

/// Harness node `n`: one 4-GPU flex3 job measured from 700 down to 300 W.
fn harness_node(node: usize) -> HarnessNode {
    HarnessNode {
        node,
        gpus: GPUS,
        tier: "flex3",
        points_w: &[700.0, 600.0, 500.0, 400.0, 300.0],
        site_key: SITE_KEY,
        silent_after: SILENT_AFTER,
    }
}

/// One controller of the pair.
/// One 50 ms sample.
struct Sample {
    at: Instant,
    /// Σ caps in force × GPUs: the harness agents' caps and the real node's GPU limits.
    caps_w: f64,
    /// The site's metered total: the real node's metered draw plus the harness agents'
    /// caps × GPUs (they run no GPU: what they hold in force is their ceiling).
    metered_w: f64,
    /// The real node's metered draw (its simulated GPUs' power readings).
    real_draw_w: f64,
    /// Each node's cap, the real node's highest GPU limit last.
    caps: Vec<f64>,
    /// The real node's GPU limits, by index.
    real_limits: Vec<f64>,
}

fn sampler(
    held: Vec<Arc<Mutex<Held>>>,
    real: RealNode,
    stop: Arc<AtomicBool>,
) -> std::thread::JoinHandle<Vec<Sample>> {
    std::thread::spawn(move || {
        let mut samples = Vec::new();
        while !stop.load(Ordering::SeqCst) {
            let at = Instant::now();
            let mut caps: Vec<f64> = held
                .iter()
                .map(|h| h.lock().expect("held").cap_in_force(at))
                .collect();
            let harness_w = caps.iter().sum::<f64>() * f64::from(GPUS);
            let (real_limits, real_draw_w) = real.meter();
            caps.push(real_limits.iter().copied().fold(0.0, f64::max));
            real.note_epoch();
            samples.push(Sample {
                at,
                caps_w: harness_w + real_limits.iter().sum::<f64>(),
                metered_w: harness_w + real_draw_w,
                real_draw_w,
                caps,
                real_limits,
            });
            std::thread::sleep(Duration::from_millis(50));
        }
        samples
    })
}

/// The real `powerflexd` on its simulated node: its GPU limits and power readings from
/// the simulated NVML's state, the epochs it accepted from its status (first seen when).
#[derive(Clone)]
struct RealNode {
    sim: PathBuf,
    socket: PathBuf,
    first_epoch: Arc<Mutex<BTreeMap<u64, Instant>>>,
}

impl RealNode {
    fn limits_w(&self) -> Vec<f64> {
        self.meter().0
    }

    /// The GPUs' limits, and the node's metered draw (the sum of their power readings),
    /// W: one reading of each GPU.
    fn meter(&self) -> (Vec<f64>, f64) {
        let node = Node::open(&self.sim).expect("the simulated node");
        let readings: Vec<_> = (0..GPUS)
            .map(|i| node.reading(i).expect("a reading").1)
            .collect();
        (
            readings
                .iter()
                .map(|r| f64::from(r.limit_mw) / 1000.0)
                .collect(),
            readings
                .iter()
                .map(|r| f64::from(r.power_mw) / 1000.0)
                .sum(),
        )
    }

    fn request(&self, op: ControlOp) -> Option<ControlReply> {
        let mut stream = UnixStream::connect(&self.socket).ok()?;
        stream.set_read_timeout(Some(Duration::from_secs(2))).ok()?;
        stream
            .write_all(ControlRequest::new(op).to_line().as_bytes())
            .ok()?;
        let mut line = String::new();
        BufReader::new(stream).read_line(&mut line).ok()?;
        ControlReply::from_line(&line).ok()
    }

    fn status(&self) -> Option<AgentStatus> {
        self.request(ControlOp::Status)?.status().cloned()
    }

    /// Records when the agent first showed each controller epoch.
    fn note_epoch(&self) {
        if let Some(status) = self.status() {
            self.first_epoch
                .lock()
                .expect("epochs")
                .entry(status.controller_epoch)
                .or_insert_with(Instant::now);
        }
    }

    fn first_at(&self, epoch: u64) -> Option<Instant> {
        self.note_epoch();
        self.first_epoch
            .lock()
            .expect("epochs")
            .get(&epoch)
            .copied()
    }
}

/// A single controller at `own` with the site's key and no `[controller.ha]` (epoch 0):
/// a stale config started by mistake. Its budget is the base one, above the event's.
fn rogue(base: &Path, own: SocketAddr) -> PairCtld {
    SITE.ctld(base, "ctld-rogue", own, |_| {})
}

/// When the last node (harness and real) got its first lease of `epoch`.
fn all_leased_at(held: &[Arc<Mutex<Held>>], real: &RealNode, epoch: u64) -> Option<Instant> {
    held.iter()
        .map(|h| h.lock().expect("held").first_lease.get(&epoch).copied())
        .chain(std::iter::once(real.first_at(epoch)))
        .collect::<Option<Vec<_>>>()
        .and_then(|t| t.into_iter().max())
}

fn sum_now(held: &[Arc<Mutex<Held>>], real: &RealNode) -> f64 {
    let now = Instant::now();
    held.iter()
        .map(|h| h.lock().expect("held").cap_in_force(now))
        .sum::<f64>()
        * f64::from(GPUS)
        + real.limits_w().iter().sum::<f64>()
}

/// Each node's cap now (the real node's highest GPU limit last), as the sampler has them.
fn caps_now(held: &[Arc<Mutex<Held>>], real: &RealNode) -> Vec<f64> {
    let now = Instant::now();
    held.iter()
        .map(|h| h.lock().expect("held").cap_in_force(now))
        .chain(std::iter::once(
            real.limits_w().iter().copied().fold(0.0, f64::max),
        ))
        .collect()
}

/// Starts the real agent for node `r0` on its simulated node, following `a` then `b`,
/// and its job ([`REAL_JOB`], [`REAL_PROFILE`] on its four GPUs).
fn start_real_agent(base: &Path, a: SocketAddr, b: SocketAddr) -> (Children, RealNode) {
    let sim = base.join("sim/r0");
    Node::init(&sim, "r0", "H200", GPUS, true).expect("simulated node");
    let config = base.join("agent.toml");
    SiteBuilder::new(BASE_BUDGET_W)
        .placement_from_reports()
        .h200(&[700.0, 600.0, 500.0, 400.0, 300.0], FAILSAFE_W)
        .controller(a, LEASE_TTL_S, 1)
        .key_file(&base.join("powerflex.key"))
        .agent_paths(
            &format!("{}/%n.sock", base.display()),
            &format!("{}/agent-state/%n", base.display()),
            &profile_dir().join("libpowerflex_sim_nvml.so"),
        )
        .edit(|raw| {
            raw.facility.budget_mode = Some("hard".into());
            raw.controller.standby_addresses = Some(vec![b.to_string()]);
        })
        .write(&config)
        .unwrap_or_else(|e| panic!("{e}"));
    write_node_keys(&binary("powerflexctl"), &config, &["r0"]);
    let socket = base.join("r0.sock");
    let log = std::fs::File::create(base.join("agent.log")).expect("agent log");
    let child = Command::new(binary("powerflexd"))
        .args(["--config", config.to_str().expect("utf-8")])
        .args(["--node", "r0", "--sample-interval-ms", "200"])
        .env("POWERFLEX_SIM_DIR", &sim)
        .env("RUST_LOG", "info")
        .stderr(log)
        .spawn()
        .expect("powerflexd");
    wait_until("the agent's socket", Duration::from_secs(20), || {
        UnixStream::connect(&socket).ok()
    });
    let real = RealNode {
        sim,
        socket,
        first_epoch: Arc::new(Mutex::new(BTreeMap::new())),
    };
    // As slurmstepd registers a step (root, on the control socket).
    let registered = real
        .request(ControlOp::Register {
            job_id: REAL_JOB.into(),
            step_id: "0".into(),
            uid: 4242,
            node: "r0".into(),
            gpus: (0..GPUS).map(|g| g.to_string()).collect(),
            flex: "flex3,calibrate=off".into(),
        })
        .expect("a reply");
    assert!(registered.is_ok(), "{registered:?}");
    // The job itself, on all four GPUs: a simulated training run paced by their caps.
    let job = Command::new(profile_dir().join("powerflex-simjob"))
        .args(["--profile", REAL_PROFILE, "--time-scale", "20"])
        .env("POWERFLEX_SIM_DIR", &real.sim)
        .env("SLURM_JOB_ID", REAL_JOB)
        .env("SLURM_JOB_GPUS", "0,1,2,3")
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(base.join("simjob.log")).expect("simjob log"))
        .spawn()
        .expect("powerflex-simjob");
    (Children(vec![job, child]), real)
}

#[test]
fn a_standby_takes_over_from_a_killed_leader_and_a_lost_database_raises_no_cap() {
    if !can_run(&[Need::Root, Need::Postgres]) {
        return;
    }
    let began = Instant::now();
    let phase = |what: &str| eprintln!("[{:6.1} s] {what}", began.elapsed().as_secs_f64());
    let base = std::env::temp_dir().join(format!("pf-ha-takeover-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&base);
    std::fs::create_dir_all(&base).expect("dir");
    let mut pg = PgBed::start(&base.join("db"), "powerflex", "powerflex")
        .unwrap_or_else(|e| panic!("PostgreSQL: {e}"));
    write_site_key(&base.join("powerflex.key"), SITE_KEY);
    let addr_a: SocketAddr = ([127, 0, 0, 1], free_loopback_port()).into();
    let addr_b: SocketAddr = ([127, 0, 0, 1], free_loopback_port()).into();
    let a = SITE.pair_member(&base, "ctld-a", addr_a, addr_b, &pg.url());
    let b = SITE.pair_member(&base, "ctld-b", addr_b, addr_a, &pg.url());
    phase("PostgreSQL up");

    // 1. A takes leadership (epoch 1), B stands by.
    let mut proc_a = a.start();
    wait_until("ctld-a active", Duration::from_secs(20), || {
        (a.role() == Some(LeadershipRole::Active)).then_some(())
    });
    let mut proc_b = b.start();
    wait_until("ctld-b standing by", Duration::from_secs(20), || {
        b.status()
            .and_then(|s| s.leadership)
            .filter(|l| l.role == LeadershipRole::Standby && l.holder.as_deref() == Some("ctld-a"))
    });
    phase("ctld-a active, ctld-b standing by");

    // 2. The agents find the active one, whichever address they try first.
    let stop = Arc::new(AtomicBool::new(false));
    let held: Vec<Arc<Mutex<Held>>> = (0..NODES)
        .map(|_| Arc::new(Mutex::new(Held::new(FAILSAFE_W))))
        .collect();
    // The harness agents stop for phase 9 (their own flag) and start again after it.
    let harness = |stop: &Arc<AtomicBool>| -> Vec<std::thread::JoinHandle<()>> {
        (0..NODES)
            .map(|n| {
                let order = if n % 2 == 0 {
                    vec![a.addr, b.addr]
                } else {
                    vec![b.addr, a.addr]
                };
                harness_node(n).follow(order, held[n].clone(), stop.clone())
            })
            .collect()
    };
    let harness_stop = Arc::new(AtomicBool::new(false));
    let agents = harness(&harness_stop);
    let (agent_proc, real) = start_real_agent(&base, a.addr, b.addr);
    wait_until(
        "every node leased by ctld-a",
        Duration::from_secs(30),
        || all_leased_at(&held, &real, 1),
    );
    phase("every node leased at epoch 1");

    // 3. A grid event, down to 5.4 kW: the caps come down to it.
    let out = run(
        &binary("powerflexctl"),
        &[
            "event",
            "add",
            "--target",
            "5400W",
            "--start",
            "now",
            "--duration",
            "30m",
            "--socket",
            a.socket().to_str().expect("utf-8"),
        ],
    );
    assert_eq!(out.code, Some(0), "event add: {}", out.stderr);
    // A change sent to the standby is refused, typed, naming the active one.
    let refused = run(
        &binary("powerflexctl"),
        &[
            "budget",
            "set",
            "8000W",
            "--socket",
            b.socket().to_str().expect("utf-8"),
        ],
    );
    assert!(
        refused.code != Some(0) && refused.stderr.contains("ctld-a"),
        "a standby takes no change: {} {}",
        refused.stdout,
        refused.stderr
    );
    wait_until("the caps within the event", Duration::from_secs(20), || {
        (sum_now(&held, &real) <= EVENT_BUDGET_W + 1e-6).then_some(())
    });
    phase("the event's caps in force");
    // The real node's job runs, held at its caps: they are below what it draws uncapped,
    // and its metered draw is at them (an idle node draws a fraction of them).
    let (real_caps_w, real_draw_w) = wait_until(
        "the real node's job drawing at its caps",
        Duration::from_secs(30),
        || {
            let (limits, draw) = real.meter();
            let caps: f64 = limits.iter().sum();
            (caps < REAL_UNCAPPED_W * f64::from(GPUS) * 0.9 && draw >= caps * 0.95)
                .then_some((caps, draw))
        },
    );
    eprintln!(
        "the real node's job: {real_draw_w:.0} W metered at caps of {real_caps_w:.0} W (uncapped it draws {:.0} W)",
        REAL_UNCAPPED_W * f64::from(GPUS)
    );
    let sampling = sampler(held.clone(), real.clone(), stop.clone());
    std::thread::sleep(Duration::from_secs(2));

    // 4. The active controller killed with SIGKILL, mid-event.
    let caps_at_kill = caps_now(&held, &real);
    let pid_a = proc_a.0[0].id();
    proc_a.0[0].kill().expect("SIGKILL ctld-a");
    let _ = proc_a.0[0].wait();
    let killed = Instant::now();
    phase(&format!("ctld-a (pid {pid_a}) killed with SIGKILL"));
    wait_until("ctld-b active", Duration::from_secs(20), || {
        (b.role() == Some(LeadershipRole::Active)).then_some(())
    });
    let active_s = killed.elapsed().as_secs_f64();
    let leased = wait_until(
        "every node leased by ctld-b",
        Duration::from_secs(20),
        || all_leased_at(&held, &real, 2),
    );
    let leased_s = leased.duration_since(killed).as_secs_f64();
    eprintln!(
        "takeover: ctld-b active {active_s:.2} s after the SIGKILL, every node leased at epoch 2 after {leased_s:.2} s (leadership TTL {LEADER_TTL_S} s, half a lease {:.1} s)",
        LEASE_TTL_S as f64 / 2.0
    );
    assert!(
        leased_s <= LEASE_TTL_S as f64 / 2.0,
        "takeover within half a lease TTL: {leased_s:.2} s"
    );
    let status_b = b.status().expect("ctld-b status");
    assert!(
        status_b.active_event.is_some(),
        "the event stays in force: {status_b:?}"
    );
    assert!(
        (status_b.budget_w - EVENT_BUDGET_W).abs() < 1.0,
        "ctld-b's budget is the event's: {}",
        status_b.budget_w
    );
    assert_eq!(status_b.leadership.as_ref().map(|l| l.epoch), Some(2));

    // 5. The old primary, started again: it finds ctld-b holding and never steers.
    proc_a = a.start();
    wait_until("ctld-a standing by", Duration::from_secs(20), || {
        a.status()
            .and_then(|s| s.leadership)
            .filter(|l| l.role == LeadershipRole::Standby && l.holder.as_deref() == Some("ctld-b"))
    });
    std::thread::sleep(Duration::from_secs(3));
    assert_eq!(a.role(), Some(LeadershipRole::Standby));
    phase("ctld-a restarted: standing by");

    // 6. The database stopped: ctld-b steps down before its leadership can lapse, and
    //    nothing steers while it is away.
    let caps_at_pause = caps_now(&held, &real);
    pg.pause();
    let paused = Instant::now();
    phase("PostgreSQL stopped");
    wait_until("ctld-b stepped down", Duration::from_secs(20), || {
        (b.role() == Some(LeadershipRole::SteppedDown)).then_some(())
    });
    let stepped_down_s = paused.elapsed().as_secs_f64();
    eprintln!("ctld-b stepped down {stepped_down_s:.2} s after the database stopped");
    assert!(
        stepped_down_s < LEADER_TTL_S as f64,
        "stepped down within the leadership TTL: {stepped_down_s:.2} s"
    );
    let text = run(
        &binary("powerflexctl"),
        &["status", "--socket", b.socket().to_str().expect("utf-8")],
    )
    .stdout;
    assert!(text.contains("STEPPED-DOWN"), "{text}");
    std::thread::sleep(Duration::from_secs(LEADER_TTL_S));
    assert_ne!(
        a.role(),
        Some(LeadershipRole::Active),
        "nobody steers without the database"
    );
    let leases_during_outage: u64 = held
        .iter()
        .map(|h| {
            h.lock()
                .expect("held")
                .leases_by_epoch
                .get(&3)
                .copied()
                .unwrap_or(0)
        })
        .sum();
    assert_eq!(leases_during_outage, 0);

    // 7. The database back: one controller steers again, epoch 3, the event in force.
    let resuming = Instant::now();
    pg.resume()
        .unwrap_or_else(|e| panic!("PostgreSQL again: {e}"));
    let accepting = Instant::now();
    phase("PostgreSQL back");
    let leased = wait_until(
        "every node leased at epoch 3",
        Duration::from_secs(40),
        || all_leased_at(&held, &real, 3),
    );
    let recovered_s = leased.saturating_duration_since(accepting).as_secs_f64();
    let restart_s = accepting.duration_since(resuming).as_secs_f64();
    let roles = (a.role(), b.role());
    let active = match roles {
        (Some(LeadershipRole::Active), _) => &a,
        (_, Some(LeadershipRole::Active)) => &b,
        other => panic!("no controller active after the database came back: {other:?}"),
    };
    assert!(
        !matches!(
            roles,
            (Some(LeadershipRole::Active), Some(LeadershipRole::Active))
        ),
        "one active controller: {roles:?}"
    );
    let status = active.status().expect("status");
    assert!(status.active_event.is_some(), "the event still in force");
    eprintln!(
        "recovered: {} active, every node leased at most {recovered_s:.2} s after the database accepted connections again (its restart took {restart_s:.2} s)",
        active.name
    );
    wait_until(
        "the caps within the event again",
        Duration::from_secs(10),
        || (sum_now(&held, &real) <= EVENT_BUDGET_W + 1e-6).then_some(()),
    );
    std::thread::sleep(Duration::from_secs(1));

    // 8. The active controller frozen (SIGSTOP: a partition that resets no connection,
    //    so no agent hears of it): the standby takes over, the agents leave the silent
    //    one for it; thawed, the old leader finds it lost leadership and never steers.
    let (frozen, other, frozen_pid) = if active.name == a.name {
        (&a, &b, proc_a.0[0].id())
    } else {
        (&b, &a, proc_b.0[0].id())
    };
    let caps_at_freeze = caps_now(&held, &real);
    kill(frozen_pid, Signal::STOP).expect("SIGSTOP");
    let froze = Instant::now();
    phase(&format!(
        "{} (pid {frozen_pid}) frozen with SIGSTOP",
        frozen.name
    ));
    wait_until(
        "the other controller active",
        Duration::from_secs(20),
        || (other.role() == Some(LeadershipRole::Active)).then_some(()),
    );
    let other_active_s = froze.elapsed().as_secs_f64();
    let leased = wait_until(
        "every node leased at epoch 4",
        Duration::from_secs(30),
        || all_leased_at(&held, &real, 4),
    );
    let frozen_leased_s = leased.duration_since(froze).as_secs_f64();
    eprintln!(
        "frozen leader: {} active {other_active_s:.2} s after the SIGSTOP, every node leased by it after {frozen_leased_s:.2} s",
        other.name
    );
    assert!(
        frozen_leased_s <= LEASE_TTL_S as f64 / 2.0,
        "every node follows the new leader within half a lease: {frozen_leased_s:.2} s"
    );
    kill(frozen_pid, Signal::CONT).expect("SIGCONT");
    phase(&format!("{} thawed", frozen.name));
    wait_until(
        "the thawed controller not steering",
        Duration::from_secs(10),
        || frozen.role().filter(|r| *r != LeadershipRole::Active),
    );
    for _ in 0..20 {
        assert_ne!(
            frozen.role(),
            Some(LeadershipRole::Active),
            "the thawed leader steers again"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    assert_eq!(other.role(), Some(LeadershipRole::Active));
    phase(&format!("{} not steering after the thaw", frozen.name));

    // 9. A rogue controller: the active one killed with SIGKILL and, at its address, a
    //    single controller started from a stale config (no `[controller.ha]`: epoch 0,
    //    the base budget, far above the event's) before the standby takes over. The
    //    real agent, whose controller went away, reaches it first and refuses its lease
    //    for its epoch: no cap rises, the rogue is told (`fenced`) and stops steering,
    //    and the standby then leases the node at a higher epoch. The harness agents sit
    //    this phase out (their nodes hold their last lease, then min(fail-safe, last
    //    grant), as the sampler counts them), so that the refusal is the real agent's.
    harness_stop.store(true, Ordering::SeqCst);
    for t in agents {
        t.join().expect("agent");
    }
    let (survivor, leader) = (frozen, other);
    let leader_proc = if leader.name == a.name {
        &mut proc_a
    } else {
        &mut proc_b
    };
    let caps_at_rogue = caps_now(&held, &real);
    let limits_at_rogue = real.limits_w();
    let leader_pid = leader_proc.0[0].id();
    leader_proc.0[0].kill().expect("SIGKILL");
    let _ = leader_proc.0[0].wait();
    let killed_again = Instant::now();
    let rogue = rogue(&base, leader.addr);
    let rogue_proc = rogue.start();
    let rogue_up_s = killed_again.elapsed().as_secs_f64();
    phase(&format!(
        "{} (pid {leader_pid}) killed with SIGKILL; ctld-rogue (no [controller.ha]) listening at its address {rogue_up_s:.2} s after",
        leader.name
    ));
    let (refused_at, at_refusal) = wait_until(
        "the real agent refusing a lease, or leased at epoch 5",
        Duration::from_secs(20),
        || {
            real.status()
                .filter(|s| s.leases_refused_epoch > 0 || s.controller_epoch > 4)
                .map(|s| (Instant::now(), s))
        },
    );
    assert!(
        at_refusal.leases_refused_epoch > 0,
        "the real agent never met the rogue before {} leased it (the rogue listening {rogue_up_s:.2} s after the SIGKILL): {at_refusal:?}",
        survivor.name
    );
    let refused_s = refused_at.duration_since(killed_again).as_secs_f64();
    wait_until("ctld-rogue fenced", Duration::from_secs(10), || {
        (rogue.role() == Some(LeadershipRole::Fenced)).then_some(())
    });
    let rogue_said = run(
        &binary("powerflexctl"),
        &[
            "status",
            "--socket",
            rogue.socket().to_str().expect("utf-8"),
        ],
    )
    .stdout;
    assert!(rogue_said.contains("FENCED"), "{rogue_said}");
    let rogue_log = rogue.log();
    assert!(
        rogue_log.lines().any(|l| l
            .contains("the agent refuses this controller's leases for their epoch")
            && l.contains("node=r0")),
        "{rogue_log}"
    );
    assert!(
        rogue_log.contains("fenced: an agent follows a controller of a later epoch"),
        "{rogue_log}"
    );
    phase("the real agent refused ctld-rogue's lease; ctld-rogue fenced");
    eprintln!(
        "rogue: the real agent refused its lease (epoch 0 < {}) {refused_s:.2} s after the SIGKILL; {}",
        at_refusal.controller_epoch,
        rogue_said
            .lines()
            .find(|l| l.contains("FENCED"))
            .unwrap_or_default()
    );
    // The harness agents back: the fenced rogue sends them on, the standby leases them.
    let agents = harness(&stop);
    wait_until("the standby active again", Duration::from_secs(20), || {
        (survivor.role() == Some(LeadershipRole::Active)).then_some(())
    });
    let survivor_active_s = killed_again.elapsed().as_secs_f64();
    wait_until(
        "every node leased at epoch 5",
        Duration::from_secs(30),
        || all_leased_at(&held, &real, 5),
    );
    let real_leased = real.first_at(5).expect("leased at epoch 5");
    let real_leased_s = real_leased.duration_since(killed_again).as_secs_f64();
    eprintln!(
        "after the rogue: {} active {survivor_active_s:.2} s after the SIGKILL, the real node leased by it at epoch 5 after {real_leased_s:.2} s",
        survivor.name
    );
    assert!(
        real_leased_s <= LEASE_TTL_S as f64 / 2.0,
        "the real node leased by the new leader within half a lease: {real_leased_s:.2} s"
    );
    let status = survivor.status().expect("status");
    assert_eq!(status.leadership.as_ref().map(|l| l.epoch), Some(5));
    assert!(status.active_event.is_some(), "the event still in force");
    assert_eq!(
        rogue.role(),
        Some(LeadershipRole::Fenced),
        "a fenced controller never steers again"
    );
    std::thread::sleep(Duration::from_secs(1));
    phase(&format!("{} steering at epoch 5", survivor.name));

    stop.store(true, Ordering::SeqCst);
    let samples = sampling.join().expect("sampler");
    for t in agents {
        t.join().expect("agent");
    }
    // The budget at every 50 ms sample from before the first kill to the end: the
    // metered total within the meter's tolerance, and the sum of caps within it exactly.
    let highest = |f: fn(&Sample) -> f64| samples.iter().map(f).fold(0.0, f64::max);
    let (highest_metered, highest_caps) = (highest(|s| s.metered_w), highest(|s| s.caps_w));
    let lowest_real = samples
        .iter()
        .map(|s| s.real_draw_w)
        .fold(f64::INFINITY, f64::min);
    let metered_over = samples
        .iter()
        .filter(|s| s.metered_w > EVENT_BUDGET_W * (1.0 + METER_TOLERANCE))
        .count();
    let caps_over = samples
        .iter()
        .filter(|s| s.caps_w > EVENT_BUDGET_W + 1e-6)
        .count();
    eprintln!(
        "{} samples at 50 ms over {:.1} s: highest metered total {highest_metered:.0} W and highest sum of caps {highest_caps:.0} W against the event's {EVENT_BUDGET_W:.0} W (the real node's draw {lowest_real:.0}-{:.0} W); {metered_over} metered and {caps_over} caps over",
        samples.len(),
        samples
            .last()
            .map_or(0.0, |l| l.at.duration_since(samples[0].at).as_secs_f64()),
        highest(|s| s.real_draw_w),
    );
    assert_eq!(metered_over, 0, "metered over the budget");
    assert_eq!(caps_over, 0, "caps over the budget");
    // No cap raised: before each node's first lease of the new leader, no node above the
    // cap it had at the kill, the freeze or the rogue's start; during the outage, none
    // above its cap at the stop.
    let first_at = |epoch: u64| -> Vec<Instant> {
        held.iter()
            .map(|h| h.lock().expect("held").first_lease[&epoch])
            .chain(std::iter::once(real.first_at(epoch).expect("leased")))
            .collect()
    };
    let windows = [
        ("during the takeover", killed, first_at(2), &caps_at_kill),
        ("during the outage", paused, first_at(3), &caps_at_pause),
        (
            "while its leader was frozen",
            froze,
            first_at(4),
            &caps_at_freeze,
        ),
        (
            "while the rogue steered",
            killed_again,
            first_at(5),
            &caps_at_rogue,
        ),
    ];
    for s in &samples {
        for (what, from, until, caps_then) in &windows {
            for (n, cap) in s.caps.iter().enumerate() {
                if s.at >= *from && s.at < until[n] {
                    assert!(
                        *cap <= caps_then[n] + 1e-6,
                        "node {n} raised {what}: {cap} > {} ({} W)",
                        caps_then[n],
                        s.caps_w
                    );
                }
            }
        }
    }
    // The real agent's GPUs, each, from the rogue's start to the standby's first lease:
    // no limit above what it was.
    let refusing: Vec<&Sample> = samples
        .iter()
        .filter(|s| s.at >= killed_again && s.at < real_leased)
        .collect();
    for s in &refusing {
        for (g, (now, then)) in s.real_limits.iter().zip(&limits_at_rogue).enumerate() {
            assert!(
                now <= &(then + 1e-6),
                "GPU {g} of the real node raised while it refused the rogue: {now} > {then}"
            );
        }
    }
    eprintln!(
        "the real node from the rogue's start to its epoch 5 lease: {} samples, GPU limits {:?} W at the start, at most {:.0} W",
        refusing.len(),
        limits_at_rogue,
        refusing
            .iter()
            .flat_map(|s| s.real_limits.iter().copied())
            .fold(0.0, f64::max)
    );
    assert!(
        refusing.iter().any(|s| s.at >= refused_at),
        "sampled after the refusal"
    );
    let refused: u64 = held.iter().map(|h| h.lock().expect("held").refused).sum();
    eprintln!("harness agents' leases refused for their epoch: {refused}");
    for h in &held {
        let h = h.lock().expect("held");
        assert!(
            h.leases_by_epoch.keys().all(|e| (1..=5).contains(e)) && h.epoch == 5,
            "leases only from the five leaderships, the last one kept: {:?}",
            h.leases_by_epoch
        );
    }
    assert!(a.log().contains("leadership taken") && b.log().contains("stepping down"));
    // The real agent followed every leadership, kept the newest epoch, and refused the
    // rogue's.
    let status = real.status().expect("the real agent's status");
    assert_eq!(status.controller_epoch, 5, "{status:?}");
    assert!(status.leases_refused_epoch > 0, "{status:?}");
    assert_eq!(status.mode, powerflex_proto::status::AgentMode::Controller);
    eprintln!(
        "the real agent: epoch {}, {} leases applied, {} refused for their epoch",
        status.controller_epoch, status.leases_applied, status.leases_refused_epoch
    );
    drop(agent_proc);
    drop(rogue_proc);
    drop(proc_a);
    drop(proc_b);
}
