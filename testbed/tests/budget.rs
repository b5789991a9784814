//! The facility budget against the meter, one test per finding of issue 13, on a local
//! Slurm cluster with SIMULATED GPUs (docs/fault-matrix.md, "Workload drift"): a job that
//! idles then trains, a phase change to a heavier profile, a controller outage during a
//! cut below the fail-safe, a cap changed behind the agent, a missed epilog, and reports
//! that cannot be true. Each samples the metered draw every 50 ms
//! ([`Stack::watch_draw`]) and prints the highest overshoot and the seconds over budget.

use std::time::{Duration, Instant};

use powerflex_core::config::RawSiteConfig;
use powerflex_proto::link::{Body, JobReport};
use powerflex_proto::status::{AgentStatus, DecisionView, SiteJobStatus};
use powerflex_testbed::link_peer::{h200s, LinkPeer};
use powerflex_testbed::needs::{can_run, Need};
use powerflex_testbed::stack::{Stack, StackOptions, DEFAULT_CAP_W};
use powerflex_testbed::wait_until;

/// A training profile that draws 690 W per GPU uncapped.
const HEAVY: &str = "synthetic-compute-bound";
/// A training profile that draws 560 W per GPU uncapped (the flex0 example).
const LIGHT: &str = "synthetic-memory-bound";
const TRAIN: &str = "qwen3-30b-a3b-moe-ft-8g";
/// The stack's fail-safe cap (src/stack.rs writes it into the site config), W.
const FAILSAFE_CAP_W: f64 = 300.0;
/// The stack's allocation period.
const PERIOD: Duration = Duration::from_secs(1);
/// `metered` promises the draw back within the budget in two allocation periods; the
/// agents act on a lease at their next sample (every 250 ms in the stack).
const SETTLE: Duration = PERIOD
    .saturating_mul(2)
    .saturating_add(Duration::from_millis(250));

fn set_budget(stack: &Stack, budget_w: f64) {
    let set = powerflex_testbed::run(
        &stack.ctl,
        &[
            "budget",
            "set",
            &format!("{budget_w}W"),
            "--socket",
            &stack.socket.to_string_lossy(),
        ],
    );
    assert_eq!(set.code, Some(0), "{}", set.stderr);
}

/// The controller's jobs, once every one named in `ids` has a granted cap.
fn granted(stack: &Stack, ids: &[u32]) -> Option<Vec<SiteJobStatus>> {
    let jobs: Vec<SiteJobStatus> = stack.ctl_json(&["jobs"])?;
    ids.iter()
        .all(|id| {
            jobs.iter()
                .any(|j| j.job == id.to_string() && j.cap_w.is_some())
        })
        .then_some(jobs)
}

/// Waits until the jobs `ids` run and the controller has granted each a cap.
fn start_all(stack: &Stack, ids: &[u32]) {
    wait_until("the jobs run", Duration::from_secs(60), || {
        ids.iter().all(|&id| stack.running(id)).then_some(())
    });
    wait_until(
        "a cap granted to every job",
        Duration::from_secs(30),
        || granted(stack, ids).map(|_| ()),
    );
}

/// Whether every GPU of node `i` holds a job whose workload loads it (not idle).
fn node_busy(stack: &Stack, i: usize) -> bool {
    (0..stack.gpus_per_node).all(|g| stack.sims[i].reading(g).is_ok_and(|(_, r)| r.busy))
}

/// Submits a 4-GPU job on one node running `work` and returns its id.
fn submit(stack: &Stack, flex: &str, node: &str, work: &str) -> u32 {
    let node_flag = format!("--nodelist={node}");
    let wrap = format!(
        "srun bash -c 'POWERFLEX_SIM_DIR={}/sim/$SLURMD_NODENAME exec {} {work} > /dev/null'",
        stack.base.display(),
        stack.simjob.display()
    );
    stack
        .cluster
        .sbatch(
            &[
                "-N1",
                &node_flag,
                &format!("--gres=gpu:{}", stack.gpus_per_node),
                &format!("--power-flex={flex}"),
                "--wrap",
                &wrap,
            ],
            None,
        )
        .expect("sbatch")
}

/// Two jobs, one per node: `a` on n1 running `a_work` at `a_flex`, and a flex3 job on n2
/// that takes whatever the budget leaves.
fn two_jobs(stack: &Stack, a_flex: &str, a_work: &str) -> (u32, u32) {
    let a = submit(stack, a_flex, "n1", a_work);
    let b = submit(
        stack,
        "flex3,calibrate=off",
        "n2",
        &format!("--profile {TRAIN} --duration 20000 --time-scale 20"),
    );
    start_all(stack, &[a, b]);
    (a, b)
}

#[test]
fn a_job_idle_for_its_first_minute_then_training_at_full_power_keeps_the_budget() {
    if !can_run(&[Need::Root, Need::Slurm]) {
        return;
    }
    let budget_w = 4000.0;
    let stack = Stack::start(
        "b-idle",
        StackOptions {
            budget_w,
            ..StackOptions::default()
        },
    );
    // One simulated minute idle, at 4x: 15 s of the controller seeing the job draw idle
    // power (and giving its headroom to the other job), then 690 W per GPU uncapped.
    let (a, b) = two_jobs(
        &stack,
        "flex0,calibrate=off",
        &format!("--phases idle:60,{TRAIN}:20000 --time-scale 4"),
    );
    assert!(!node_busy(&stack, 0), "the job starts idle");
    let started = Instant::now();
    let watch = stack.assert_draw_settles(
        budget_w,
        Duration::from_secs(30),
        SETTLE,
        "idle for a minute, then training",
    );
    assert!(
        node_busy(&stack, 0),
        "the job trains after its idle minute ({:.0} s watched)",
        started.elapsed().as_secs_f64()
    );
    assert!(
        watch.highest_w > 0.9 * budget_w,
        "the budget is used once the job trains: {watch}"
    );
    stack.assert_draw_within(budget_w, Duration::from_secs(3), "training, settled");
    stack.ends_clean(&[a, b], Duration::from_secs(60));
}

#[test]
fn a_phase_change_to_a_heavier_profile_is_back_within_the_budget_in_two_periods() {
    if !can_run(&[Need::Root, Need::Slurm]) {
        return;
    }
    let budget_w = 4000.0;
    let stack = Stack::start(
        "b-phase",
        StackOptions {
            budget_w,
            ..StackOptions::default()
        },
    );
    // The case: a flex0 job drawing 560 W per GPU below its 700 W cap goes to
    // 690 W while a flex3 job runs on the headroom it left. 100 simulated s light at 4x.
    let (a, b) = two_jobs(
        &stack,
        "flex0,calibrate=off",
        &format!("--phases {LIGHT}:100,{HEAVY}:20000 --time-scale 4"),
    );
    // Slurm says RUNNING, and the controller grants a cap, once the step is registered:
    // before the simulated job has claimed its GPUs.
    wait_until(
        "the light phase trains on n1",
        Duration::from_secs(30),
        || node_busy(&stack, 0).then_some(()),
    );
    let light = stack.sims[0].reading(0).expect("reading").1;
    assert!(
        light.busy && light.power_mw < 580_000,
        "light phase first: {light:?}"
    );
    let watch = stack.assert_draw_settles(
        budget_w,
        Duration::from_secs(30),
        SETTLE,
        "phase change 560 W -> 690 W per GPU",
    );
    let gpu = stack.sims[0].gpu(0).expect("gpu");
    let profile = gpu.running().map(|w| w.profile.clone());
    assert_eq!(
        profile.as_deref(),
        Some(HEAVY),
        "the heavy phase ran in the watch"
    );
    println!(
        "phase change: highest overshoot {:.0} W, {:.2} s over budget",
        watch.overshoot_w.max(0.0),
        watch.over_s
    );
    stack.assert_draw_within(budget_w, Duration::from_secs(3), "heavy phase, settled");
    stack.ends_clean(&[a, b], Duration::from_secs(60));
}

#[test]
fn a_controller_outage_past_the_lease_during_a_cut_below_the_failsafe_keeps_the_cut() {
    if !can_run(&[Need::Root, Need::Slurm]) {
        return;
    }
    let lease_ttl_s = 5;
    let mut stack = Stack::start(
        "b-outage",
        StackOptions {
            lease_ttl_s,
            ..StackOptions::default()
        },
    );
    let (a, b) = two_jobs(
        &stack,
        "flex3,calibrate=off",
        &format!("--profile {TRAIN} --duration 20000 --time-scale 20"),
    );
    // The case: 1.9 kW for eight GPUs, caps below the 300 W fail-safe.
    let cut_w = 1900.0;
    set_budget(&stack, cut_w);
    wait_until(
        "every cap below the fail-safe",
        Duration::from_secs(30),
        || {
            let caps = stack.caps_w();
            (caps.iter().all(|&c| c < FAILSAFE_CAP_W) && stack.draw_w() <= cut_w * 1.01)
                .then_some(caps)
        },
    );
    let caps_before = stack.caps_w();
    stack.kill_ctld();
    // The lease runs out 5 s after its last renewal; watch it and 8 s past it.
    stack.assert_draw_within(
        cut_w,
        Duration::from_secs(lease_ttl_s + 8),
        "controller gone past its lease during a 1.9 kW cut",
    );
    let caps_after = stack.caps_w();
    for (before, after) in caps_before.iter().zip(&caps_after) {
        assert!(
            after <= before,
            "the fail-safe never raises a cap: {caps_before:?} -> {caps_after:?}"
        );
    }
    let failsafe = stack.agent_status(0).map(|s| s.failsafe);
    assert_eq!(failsafe, Some(true), "the agent says its lease ran out");
    assert!(
        stack.running(a) && stack.running(b),
        "powerflex kills no job"
    );
    stack.start_ctld();
    stack.assert_draw_within(cut_w, Duration::from_secs(5), "controller back");
    stack.ends_clean(&[a, b], Duration::from_secs(60));
}

/// Issue 21: a `systemctl restart powerflexd` during a 1.9 kW cut drew 4.3 kW for about
/// 3 s (the stopping agent restored every GPU to its default until the next one's first
/// tick). A rolling restart of every agent during a grid event, each stopped as an admin
/// stops it (SIGTERM) and started again, keeps the metered draw within the event's
/// budget at every 50 ms sample, and no GPU is raised to its default or the fail-safe.
#[test]
fn a_rolling_restart_of_every_agent_during_a_grid_event_keeps_the_draw_within_it() {
    if !can_run(&[Need::Root, Need::Slurm]) {
        return;
    }
    let mut stack = Stack::start("b-rolling", StackOptions::default());
    let (a, b) = two_jobs(
        &stack,
        "flex3,calibrate=off",
        &format!("--profile {TRAIN} --duration 20000 --time-scale 20"),
    );
    // A grid event to 1.9 kW for eight GPUs: caps below the 300 W fail-safe.
    let cut_w = 1900.0;
    let event = powerflex_testbed::run(
        &stack.ctl,
        &[
            "event",
            "add",
            "--target",
            &format!("{cut_w}W"),
            "--start",
            "now",
            "--duration",
            "10m",
            "--socket",
            &stack.socket.to_string_lossy(),
        ],
    );
    assert_eq!(event.code, Some(0), "{}", event.stderr);
    wait_until(
        "every cap below the fail-safe, the draw within the cut",
        Duration::from_secs(30),
        || {
            let caps = stack.caps_w();
            (caps.iter().all(|&c| c < FAILSAFE_CAP_W) && stack.draw_w() <= cut_w * 1.01)
                .then_some(())
        },
    );
    let caps_before = stack.caps_w();
    // The meter sampled every 50 ms from another thread, across every stop and start.
    let meter = stack.meter();
    let started = Instant::now();
    let done = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let watching = {
        let done = done.clone();
        std::thread::spawn(move || {
            meter.watch(cut_w, || !done.load(std::sync::atomic::Ordering::SeqCst))
        })
    };
    let mut highest_caps = caps_before.clone();
    for i in 0..stack.sims.len() {
        let status = stack.stop_agent(i).expect("the agent was running");
        assert!(status.success(), "a clean exit on SIGTERM: {status:?}");
        for (h, c) in highest_caps.iter_mut().zip(stack.caps_w()) {
            *h = h.max(c);
        }
        stack.start_agent(i);
        // Live again at the controller, with a lease: the next node's turn.
        wait_until(
            "the restarted agent leased again",
            Duration::from_secs(30),
            || {
                stack
                    .agent_status(i)
                    .filter(|s| !s.failsafe && !s.jobs.is_empty())
                    .map(|_| ())
            },
        );
        for _ in 0..20 {
            for (h, c) in highest_caps.iter_mut().zip(stack.caps_w()) {
                *h = h.max(c);
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }
    done.store(true, std::sync::atomic::Ordering::SeqCst);
    let watch = watching.join().expect("the meter thread");
    println!(
        "rolling restart of every agent during a {cut_w:.0} W event, {:.1} s: {watch}",
        started.elapsed().as_secs_f64()
    );
    assert!(watch.samples > 40, "{watch}");
    assert!(
        watch.over_s == 0.0,
        "the draw went over the event's budget: {watch}"
    );
    // Neither the default (700 W) nor the fail-safe (300 W) was written over the cut's
    // caps at any point read (after each stop, and for a second after each start).
    assert!(
        highest_caps.iter().all(|&c| c < FAILSAFE_CAP_W),
        "no cap raised to the fail-safe or the default: {caps_before:?} -> highest {highest_caps:?}"
    );
    assert!(
        stack.running(a) && stack.running(b),
        "powerflex kills no job"
    );
    stack.ends_clean(&[a, b], Duration::from_secs(60));
}

#[test]
fn a_cap_changed_behind_the_agent_is_restored_and_counted() {
    if !can_run(&[Need::Root, Need::Slurm]) {
        return;
    }
    let budget_w = 3000.0;
    let stack = Stack::start(
        "b-extcap",
        StackOptions {
            budget_w,
            ..StackOptions::default()
        },
    );
    let (a, b) = two_jobs(
        &stack,
        "flex3,calibrate=off",
        &format!("--profile {TRAIN} --duration 20000 --time-scale 20"),
    );
    wait_until(
        "the jobs capped within the budget",
        Duration::from_secs(30),
        || {
            (stack.caps_w().iter().all(|&c| c < DEFAULT_CAP_W) && stack.draw_w() <= budget_w * 1.01)
                .then_some(())
        },
    );
    let before = stack.agent_status(0).expect("agent status").cap_mismatches;
    let cap_mw = stack.sims[0].gpu(1).expect("gpu").power_limit_mw;
    // What `nvidia-smi -pl 700` does: root writes the limit through NVML, not the agent.
    let behind_mw = 700_000;
    stack.sims[0]
        .set_power_limit(1, behind_mw, 0)
        .expect("write behind the agent");
    let written = Instant::now();
    // The draw watched while the restore is timed, side by side.
    let (watch, restored) = std::thread::scope(|scope| {
        let watcher = scope.spawn(|| {
            stack.assert_draw_settles(
                budget_w,
                Duration::from_secs(4),
                Duration::from_secs(1),
                "a GPU's limit raised to 700 W behind the agent",
            )
        });
        // Restored: back below what was written behind the agent. Not "back to the cap
        // seen before": a reallocation in between may grant this GPU a little more than
        // that (seen in a clean-clone run: the draw back within the budget after 0.05 s,
        // the limit never again at or below the old cap), and the draw watch above
        // already holds the budget.
        let restored = wait_until("the limit restored", Duration::from_secs(10), || {
            let now_mw = stack.sims[0].gpu(1).ok()?.power_limit_mw;
            (now_mw < behind_mw).then_some((written.elapsed(), now_mw))
        });
        (watcher.join().expect("the draw watch"), restored)
    });
    let status: AgentStatus = wait_until(
        "the mismatch counted in the agent's status",
        Duration::from_secs(10),
        || stack.agent_status(0).filter(|s| s.cap_mismatches > before),
    );
    println!(
        "external cap change: restored after {:.2} s (polled every 100 ms) to {} mW (before: {cap_mw} mW), cap_mismatches {} -> {}, highest overshoot {:.0} W",
        restored.0.as_secs_f64(),
        restored.1,
        before,
        status.cap_mismatches,
        watch.overshoot_w.max(0.0)
    );
    stack.ends_clean(&[a, b], Duration::from_secs(60));
}

#[test]
fn a_missed_epilog_ends_the_job_by_its_processes_and_returns_its_gpus() {
    if !can_run(&[Need::Root, Need::Slurm]) {
        return;
    }
    let budget_w = 3000.0;
    let stack = Stack::start(
        "b-epilog",
        StackOptions {
            budget_w,
            ..StackOptions::default()
        },
    );
    let (a, b) = two_jobs(
        &stack,
        "flex3,calibrate=off",
        &format!("--profile {TRAIN} --duration 20000 --time-scale 20"),
    );
    wait_until("n1's GPUs capped", Duration::from_secs(30), || {
        stack.caps_w()[..stack.gpus_per_node as usize]
            .iter()
            .all(|&c| c < DEFAULT_CAP_W)
            .then_some(())
    });
    // The job's end cannot reach the agent: its socket's name is gone while the job ends
    // (as when a connect fails), so the plugin's end messages fail open and are lost.
    let socket = stack.agent_socket(0);
    let hidden = socket.with_extension("sock.hidden");
    std::fs::rename(&socket, &hidden).expect("hide the agent's socket");
    stack.cluster.run("scancel", &[&a.to_string()]);
    stack.cluster.wait_job_done(a, Duration::from_secs(60));
    std::fs::rename(&hidden, &socket).expect("restore the agent's socket");
    assert!(
        stack
            .agent_status(0)
            .is_some_and(|s| s.jobs.iter().any(|j| j.job == a.to_string())),
        "no epilog arrived: the agent still holds the job"
    );
    let ended = Instant::now();
    // The process scan finds the job's processes gone; after the grace (30 s by default)
    // the job is ended and its GPUs go back to their default.
    wait_until(
        "the job ended by the process scan",
        Duration::from_secs(90),
        || {
            let status = stack.agent_status(0)?;
            let gone = !status.jobs.iter().any(|j| j.job == a.to_string());
            let defaults = stack.caps_w()[..stack.gpus_per_node as usize]
                .iter()
                .all(|&c| c == DEFAULT_CAP_W);
            (gone && defaults).then_some(())
        },
    );
    println!(
        "missed epilog: job ended and GPUs back at default {:.1} s after the job's end",
        ended.elapsed().as_secs_f64()
    );
    stack.assert_draw_within(budget_w, Duration::from_secs(3), "after the missed epilog");
    assert!(stack.running(b), "powerflex kills no job");
    stack.ends_clean(&[b], Duration::from_secs(60));
}

/// A fake agent on the controller's link: a real link v2 session under the key the
/// controller derives for its node, as root on a compromised or broken node has.
struct FakeAgent(LinkPeer);

impl FakeAgent {
    fn connect(stack: &Stack, node: &str) -> FakeAgent {
        let text = std::fs::read_to_string(&stack.site).expect("site config");
        let raw = RawSiteConfig::from_toml_str(&text).expect("site config parses");
        let addr = raw
            .controller
            .listen
            .parse()
            .expect("the controller's link address");
        let key = std::fs::read(stack.base.join("site.key")).expect("site key");
        let peer = LinkPeer::connect(addr, key.trim_ascii(), node, h200s(node, 4))
            .unwrap_or_else(|e| panic!("{node} on the link: {e}"));
        FakeAgent(peer)
    }

    fn report(&mut self, jobs: Vec<JobReport>, power_w: f64) {
        self.0
            .send(&Body::Report {
                jobs,
                power_w,
                failsafe: false,
                cap_mismatches: 0,
                ended: Vec::new(),
                observe_only: false,
            })
            .expect("send");
    }
}

fn job_report(id: &str, gpus: u32, power_w: f64) -> JobReport {
    JobReport {
        job_id: id.into(),
        tier: "flex3".into(),
        gpus,
        cap_w: Some(700.0),
        power_w: Some(power_w),
        throughput: Some(1000.0),
        ..JobReport::default()
    }
}

#[test]
fn reports_with_nan_negative_power_and_a_huge_gpu_count_hurt_only_their_senders() {
    if !can_run(&[Need::Root, Need::Slurm]) {
        return;
    }
    // Room for the real jobs after the bad nodes are paid for at the most they may draw.
    let budget_w = 6000.0;
    let mut stack = Stack::start(
        "b-badrep",
        StackOptions {
            budget_w,
            nodes: 5,
            ..StackOptions::default()
        },
    );
    let (a, b) = two_jobs(
        &stack,
        "flex3,calibrate=off",
        &format!("--profile {TRAIN} --duration 20000 --time-scale 20"),
    );
    // Root on n3, n4 and n5: their agents stopped, each node's own key speaking for it
    // about jobs Slurm does place there (the controller believes a node about nothing
    // else, see attacks_link.rs): the bad values reach the validation layer.
    for i in 2..5 {
        stack.kill_agent(i);
    }
    let placed = |node: &str| -> String {
        let node_flag = format!("--nodelist={node}");
        stack
            .cluster
            .sbatch(
                &["-N1", &node_flag, "--gres=gpu:2", "--wrap", "sleep 600"],
                None,
            )
            .expect("sbatch")
            .to_string()
    };
    let (neg_job, huge_job) = (placed("n4"), placed("n5"));
    for job in [&neg_job, &huge_job] {
        let id: u32 = job.parse().expect("job id");
        wait_until("the placed job runs", Duration::from_secs(30), || {
            stack.running(id).then_some(())
        });
    }
    let mut nan = FakeAgent::connect(&stack, "n3");
    let mut negative = FakeAgent::connect(&stack, "n4");
    let mut huge = FakeAgent::connect(&stack, "n5");
    // NaN has no JSON form: it goes out as null where a number must be, and the whole
    // message is refused at the link.
    nan.report(vec![job_report("90001", 2, 400.0)], f64::NAN);
    let deadline = Instant::now() + Duration::from_secs(15);
    let mut decision: Option<DecisionView> = None;
    while Instant::now() < deadline {
        // Keep the fake nodes live (they must report within their lease).
        negative.report(vec![job_report(&neg_job, 2, -500.0)], 300.0);
        huge.report(vec![job_report(&huge_job, u32::MAX, 400.0)], 300.0);
        let d: Option<DecisionView> = stack.ctl_json(&["whatif"]);
        let listed = |node: &str| {
            d.as_ref()
                .is_some_and(|d| d.rejected.iter().any(|r| r.node == node))
        };
        if listed("n4") && listed("n5") {
            decision = d;
            break;
        }
        std::thread::sleep(Duration::from_millis(500));
    }
    let decision = decision.expect("the bad reports listed as rejected within 15 s");
    for r in &decision.rejected {
        println!("rejected: {} {:?}: {}", r.node, r.job, r.reason);
    }
    let negative_job = decision
        .rejected
        .iter()
        .find(|r| r.node == "n4")
        .expect("n4");
    assert_eq!(
        negative_job.job.as_deref(),
        Some(neg_job.as_str()),
        "left out job by job"
    );
    assert!(negative_job.reason.contains("power_w"), "{negative_job:?}");
    let huge_node = decision
        .rejected
        .iter()
        .find(|r| r.node == "n5")
        .expect("n5");
    assert!(huge_node.reason.contains("GPUs"), "{huge_node:?}");
    assert!(
        !decision.rejected.iter().any(|r| r.node == "n3"),
        "the NaN report never got in: {:?}",
        decision.rejected
    );
    // Every other node is still allocated: both real jobs in the allocation, capped.
    let allocation = decision.allocation.as_ref().expect("an allocation");
    for id in [a, b] {
        assert!(
            allocation.jobs.iter().any(|j| j.id == id.to_string()),
            "job {id} allocated: {allocation:?}"
        );
    }
    let jobs = granted(&stack, &[a, b]).expect("both jobs keep a granted cap");
    for j in jobs
        .iter()
        .filter(|j| j.job == a.to_string() || j.job == b.to_string())
    {
        let cap = j.cap_w.expect("granted");
        assert!(
            cap > FAILSAFE_CAP_W && cap < DEFAULT_CAP_W,
            "job {} allocated its share, not the fail-safe: {cap} W",
            j.job
        );
    }
    negative.report(vec![job_report(&neg_job, 2, -500.0)], 300.0);
    huge.report(vec![job_report(&huge_job, u32::MAX, 400.0)], 300.0);
    stack.assert_draw_within(budget_w, Duration::from_secs(4), "bad reports on the link");
    let log = std::fs::read_dir(&stack.base)
        .expect("stack dir")
        .filter_map(Result::ok)
        .filter(|e| e.file_name().to_string_lossy().starts_with("ctld-"))
        .filter_map(|e| std::fs::read_to_string(e.path()).ok())
        .collect::<String>();
    assert!(
        log.contains("agent message refused"),
        "the NaN report refused and logged"
    );
    for job in [&neg_job, &huge_job] {
        stack.cluster.run("scancel", &[job]);
    }
    stack.ends_clean(&[a, b], Duration::from_secs(60));
}
