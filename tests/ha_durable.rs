//! Effects after durability, and Slurm commands tied to the leadership that decided them,
//! on two real `powerflex-ctld` with `[controller.ha]` on one real PostgreSQL 16
//! ([`PgBed`]), two harness agents speaking the real link (each node one 4-GPU job that
//! allows suspension), and an `scontrol` on the controllers' `PATH` that logs each call
//! with its caller's PID (no Slurm: the subject is what the controllers run, and when).
//!
//! Every 50 ms the nodes' caps in force are sampled (a lease's caps until it runs out,
//! then min(fail-safe, last grant), as the agent holds them; the harness agents run no
//! GPU, so the caps in force are their draw's ceiling).
//!
//! Checked, fault rows 22 and 23 of `docs/fault-matrix.md`:
//! - saves refused by the database while leadership renewals succeed (a trigger on the
//!   state table): `budget set` on the leader is refused, naming the database, and no
//!   lease below the caps in force reaches a node; the budget in force stays the last
//!   committed one. Once saves succeed again a cut is acknowledged, its caps go out, and
//!   after the leader is killed the standby steers from it: the sampled caps never rise
//!   above the acknowledged budget across the failover;
//! - the leader frozen with SIGSTOP while its `scontrol suspend` runs with a second one
//!   queued: the standby takes over, and the old leader, thawed, runs no Slurm command
//!   of its leadership (its queued suspension is dropped).

use std::net::SocketAddr;
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use powerflex::ha_pair::{HarnessNode, Held, PairSite};
use powerflex::needs::{can_run, Need};
use powerflex::pg::PgBed;
use powerflex::{free_loopback_port, wait_until, write_site_key};
use powerflex_daemon::os::{kill, Signal};
use powerflex_proto::status::LeadershipRole;

const SITE_KEY: &str = "a site key for the durability test\n";
const NODES: usize = 2;
const GPUS: u32 = 4;
const FAILSAFE_W: f64 = 300.0;
/// Every GPU uncapped (8 × 700 W) is within it.
const BASE_BUDGET_W: f64 = 6_000.0;
/// The cut acknowledged once saves succeed: 250 W a GPU.
const CUT_W: f64 = 2_000.0;
const LEASE_TTL_S: u64 = 20;
const LEADER_TTL_S: u64 = 6;
/// A session without a lease this long is left for the next address (as `powerflexd`).
const SILENT_AFTER: Duration = Duration::from_secs(LEASE_TTL_S / 4);

/// Both controllers' site: the base budget, the test bed's H200s and fail-safe.
const SITE: PairSite = PairSite {
    budget_w: BASE_BUDGET_W,
    failsafe_w: FAILSAFE_W,
    lease_ttl_s: LEASE_TTL_S,
    leader_ttl_s: LEADER_TTL_S,
};

/// Harness node `n`: one 4-GPU job that allows suspension, measured from 700 down to 200 W.
fn harness_node(node: usize) -> HarnessNode {
    HarnessNode {
        node,
        gpus: GPUS,
        tier: "flex3,preempt=suspend",
        points_w: &[700.0, 600.0, 500.0, 400.0, 300.0, 200.0],
        site_key: SITE_KEY,
        silent_after: SILENT_AFTER,
    }
}

/// The sum of the nodes' caps in force × GPUs, every 50 ms: (when, W).
fn sampler(
    held: Vec<Arc<Mutex<Held>>>,
    stop: Arc<AtomicBool>,
) -> std::thread::JoinHandle<Vec<(Instant, f64)>> {
    std::thread::spawn(move || {
        let mut samples = Vec::new();
        while !stop.load(Ordering::SeqCst) {
            let at = Instant::now();
            let caps: f64 = held
                .iter()
                .map(|h| h.lock().expect("held").cap_in_force(at))
                .sum();
            samples.push((at, caps * f64::from(GPUS)));
            std::thread::sleep(Duration::from_millis(50));
        }
        samples
    })
}

/// An `scontrol` that appends `PPID ARGS` to `log` for each call; a suspension takes
/// 2 s, so that a second one queues behind it.
fn logging_scontrol(bin: &Path, log: &Path) {
    use std::os::unix::fs::PermissionsExt;
    std::fs::create_dir_all(bin).expect("bin");
    let script = bin.join("scontrol");
    std::fs::write(
        &script,
        format!(
            "#!/bin/sh\necho \"$PPID $*\" >> '{}'\n[ \"$1\" = suspend ] && sleep 2\nexit 0\n",
            log.display()
        ),
    )
    .expect("scontrol");
    std::fs::set_permissions(&script, std::fs::Permissions::from_mode(0o755)).expect("mode");
}

/// The suspensions `pid` ran, as the log has them.
fn suspensions_by(log: &Path, pid: u32) -> Vec<String> {
    std::fs::read_to_string(log)
        .unwrap_or_default()
        .lines()
        .filter(|l| l.starts_with(&format!("{pid} suspend")))
        .map(str::to_string)
        .collect()
}

/// The lowest cap any node accepted since `since`.
fn lowest_lease_since(held: &[Arc<Mutex<Held>>], since: Instant) -> Option<f64> {
    held.iter()
        .flat_map(|h| {
            h.lock()
                .expect("held")
                .leases
                .iter()
                .filter(|(at, _, _)| *at >= since)
                .map(|(_, _, c)| *c)
                .collect::<Vec<_>>()
        })
        .reduce(f64::min)
}

#[test]
fn nothing_takes_effect_before_it_is_committed_and_a_deposed_leader_runs_no_slurm_command() {
    if !can_run(&[Need::Root, Need::Postgres]) {
        return;
    }
    let began = Instant::now();
    let phase = |what: &str| eprintln!("[{:6.1} s] {what}", began.elapsed().as_secs_f64());
    let base = std::env::temp_dir().join(format!("pf-ha-durable-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&base);
    std::fs::create_dir_all(&base).expect("dir");
    let pg = PgBed::start(&base.join("db"), "powerflex", "powerflex")
        .unwrap_or_else(|e| panic!("PostgreSQL: {e}"));
    write_site_key(&base.join("powerflex.key"), SITE_KEY);
    let bin = base.join("bin");
    let slurm_log = base.join("scontrol.log");
    logging_scontrol(&bin, &slurm_log);
    let addr_a: SocketAddr = ([127, 0, 0, 1], free_loopback_port()).into();
    let addr_b: SocketAddr = ([127, 0, 0, 1], free_loopback_port()).into();
    let a = SITE.pair_member(&base, "ctld-a", addr_a, addr_b, &pg.url());
    let b = SITE.pair_member(&base, "ctld-b", addr_b, addr_a, &pg.url());

    // 1. A leads (epoch 1), B stands by, both nodes leased by A.
    let mut proc_a = a.start_with_path_first(&bin);
    wait_until("ctld-a active", Duration::from_secs(20), || {
        (a.role() == Some(LeadershipRole::Active)).then_some(())
    });
    let mut proc_b = b.start_with_path_first(&bin);
    wait_until("ctld-b standing by", Duration::from_secs(20), || {
        (b.role() == Some(LeadershipRole::Standby)).then_some(())
    });
    let stop = Arc::new(AtomicBool::new(false));
    let held: Vec<Arc<Mutex<Held>>> = (0..NODES)
        .map(|_| Arc::new(Mutex::new(Held::new(FAILSAFE_W))))
        .collect();
    let agents: Vec<_> = (0..NODES)
        .map(|n| harness_node(n).follow(vec![a.addr, b.addr], held[n].clone(), stop.clone()))
        .collect();
    wait_until(
        "both nodes leased by ctld-a",
        Duration::from_secs(20),
        || {
            held.iter()
                .all(|h| h.lock().expect("held").epoch == 1)
                .then_some(())
        },
    );
    let sampling = sampler(held.clone(), stop.clone());
    phase("ctld-a active, both nodes leased at epoch 1");

    // 2. Saves refused while renewals succeed: the change is refused, naming the
    // database, and no lease carries it.
    pg.query(
        "CREATE FUNCTION pf_refuse_save() RETURNS trigger AS $$ BEGIN RAISE EXCEPTION 'saves refused by the test'; END $$ LANGUAGE plpgsql;
         CREATE TRIGGER pf_refuse_save BEFORE INSERT OR UPDATE ON powerflex_ctld_state FOR EACH ROW EXECUTE FUNCTION pf_refuse_save();",
    )
    .unwrap_or_else(|e| panic!("{e}"));
    let refused_at = Instant::now();
    let out = a.ctl(&["budget", "set", &format!("{CUT_W}W")]);
    phase(&format!(
        "budget set while saves fail: exit {:?}: {}",
        out.code,
        out.stderr.trim()
    ));
    assert!(
        out.code != Some(0) && out.stderr.contains("saves refused by the test"),
        "a change that cannot be committed is refused with the cause: {} {}",
        out.stdout,
        out.stderr
    );
    // Refused while saves still fail, with the cause, the last committed budget in force.
    let again = a.ctl(&["budget", "set", "3000W"]);
    assert!(again.code != Some(0), "{}", again.stdout);
    std::thread::sleep(Duration::from_secs(3));
    let status = a.status().expect("status");
    assert_eq!(
        status.budget_w, BASE_BUDGET_W,
        "the committed budget in force"
    );
    assert_eq!(
        status.leadership.as_ref().map(|l| l.role),
        Some(LeadershipRole::Active),
        "renewals succeed meanwhile"
    );
    let lowest = lowest_lease_since(&held, refused_at);
    assert!(
        lowest.is_none_or(|c| c * f64::from(GPUS) * NODES as f64 > CUT_W + 1.0),
        "a lease carried the refused cut: {lowest:?} W a GPU"
    );
    pg.query("DROP TRIGGER pf_refuse_save ON powerflex_ctld_state;")
        .unwrap_or_else(|e| panic!("{e}"));
    phase("saves succeed again");

    // 3. The cut acknowledged once committed; its caps go out.
    let out = wait_until("budget set accepted", Duration::from_secs(20), || {
        let out = a.ctl(&["budget", "set", &format!("{CUT_W}W")]);
        (out.code == Some(0)).then_some(out)
    });
    let acknowledged = Instant::now();
    phase(&format!(
        "budget set once saves succeed: {}",
        out.stdout.trim()
    ));
    let committed = pg
        .query("SELECT state->>'budget_w' FROM powerflex_ctld_state")
        .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(
        committed.trim().parse::<f64>().ok(),
        Some(CUT_W),
        "acknowledged only once committed: {committed:?}"
    );
    wait_until("the cut's caps in force", Duration::from_secs(20), || {
        let now = Instant::now();
        let sum: f64 = held
            .iter()
            .map(|h| h.lock().expect("held").cap_in_force(now))
            .sum::<f64>()
            * f64::from(GPUS);
        (sum <= CUT_W + 1e-6).then_some(())
    });
    let cut_in_force = Instant::now();
    phase("the cut's caps in force");

    // 4. A cut deeper than every cap floor: A suspends both jobs, one call at a time.
    // Frozen with SIGSTOP during the first, the second queued behind it.
    let pid_a = proc_a.0[0].id();
    let out = a.ctl(&[
        "event",
        "add",
        "--target",
        "500W",
        "--start",
        "now",
        "--duration",
        "30m",
    ]);
    assert_eq!(out.code, Some(0), "event add: {}", out.stderr);
    wait_until("ctld-a's first suspension", Duration::from_secs(20), || {
        (!suspensions_by(&slurm_log, pid_a).is_empty()).then_some(())
    });
    kill(pid_a, Signal::STOP).expect("SIGSTOP");
    let frozen = Instant::now();
    phase(&format!(
        "ctld-a (pid {pid_a}) frozen during its first scontrol suspend"
    ));
    wait_until("ctld-b active", Duration::from_secs(30), || {
        (b.role() == Some(LeadershipRole::Active)).then_some(())
    });
    let took_over_s = frozen.elapsed().as_secs_f64();
    let status_b = b.status().expect("status");
    phase(&format!(
        "ctld-b active {took_over_s:.2} s after the SIGSTOP"
    ));
    assert_eq!(
        status_b.base_budget_w, CUT_W,
        "the acknowledged cut survives the failover"
    );
    assert_eq!(
        status_b.events.len(),
        1,
        "the acknowledged event survives the failover"
    );
    assert_eq!(
        status_b.preempted.len(),
        NODES,
        "the suspensions were committed before any ran: {:?}",
        status_b.preempted
    );
    kill(pid_a, Signal::CONT).expect("SIGCONT");
    let thawed = Instant::now();
    // Long enough for A's queued suspension (2 s behind the first) to have run.
    wait_until(
        "ctld-a thawed and not steering",
        Duration::from_secs(20),
        || {
            (a.role().is_some_and(|r| r != LeadershipRole::Active)
                && thawed.elapsed() >= Duration::from_secs(4))
            .then_some(())
        },
    );
    let by_a = suspensions_by(&slurm_log, pid_a);
    phase(&format!("ctld-a thawed; its suspensions: {by_a:?}"));
    assert_eq!(
        by_a.len(),
        1,
        "a thawed old leader ran a Slurm command of its leadership after losing it: {by_a:?}; log: {}",
        std::fs::read_to_string(&slurm_log).unwrap_or_default()
    );

    // The second was queued, and dropped by the thawed leader rather than never decided.
    let log_a = std::fs::read_to_string(a.dir.join("ctld.log")).unwrap_or_default();
    assert!(
        log_a.lines().any(|l| l
            .contains("not run: the leadership that decided it no longer steers")
            && l.contains("suspend")),
        "ctld-a's queued suspension dropped, and logged so"
    );

    stop.store(true, Ordering::SeqCst);
    for t in agents {
        t.join().expect("agent");
    }
    let samples = sampling.join().expect("sampler");
    let after_cut: Vec<&(Instant, f64)> = samples
        .iter()
        .filter(|(at, _)| *at >= cut_in_force)
        .collect();
    let highest = after_cut.iter().map(|(_, w)| *w).fold(0.0, f64::max);
    eprintln!(
        "{} samples every 50 ms; after the cut's caps were in force ({:.1} s after it was acknowledged), {} samples, the highest sum of caps {highest:.0} W (the acknowledged budget {CUT_W} W)",
        samples.len(),
        cut_in_force.duration_since(acknowledged).as_secs_f64(),
        after_cut.len()
    );
    assert!(
        highest <= CUT_W + 1e-6,
        "the acknowledged cut was undone across the failover: {highest} W"
    );
    // Stopped by PID and waited for (the `Children` guards kill and reap).
    for p in [&mut proc_a, &mut proc_b] {
        for c in &mut p.0 {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
    drop(pg);
    phase("done");
    let _ = std::fs::remove_dir_all(&base);
}
