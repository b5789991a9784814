//! The facility budget against the meter on a local Slurm cluster with SIMULATED GPUs,
//! where Slurm is the subject (docs/fault-matrix.md, "Workload drift"): a rolling restart
//! of every agent during a grid event, a missed epilog, and reports that cannot be true.
//! Each samples the metered draw every 50 ms ([`Stack::watch_draw`]) and prints the
//! highest overshoot and the seconds over budget.
//!
//! The budget checks whose subject is logic (a job that idles then trains, a
//! phase change to a heavier profile, a controller outage during a cut below the
//! fail-safe, a cap changed behind the agent) are checked on the site harness's fake
//! clock, with the same assertions: `harness/tests/budget.rs`.

use std::time::{Duration, Instant};

use powerflex::link_peer::{h200s, LinkPeer};
use powerflex::needs::{can_run, Need};
use powerflex::stack::{Stack, StackOptions, DEFAULT_CAP_W};
use powerflex::wait_until;
use powerflex_core::config::RawSiteConfig;
use powerflex_proto::link::Body;
use powerflex_proto::report::JobReport;
use powerflex_proto::status::{DecisionView, SiteJobStatus};

const TRAIN: &str = "qwen3-30b-a3b-moe-ft-8g";
/// The stack's fail-safe cap (src/stack.rs writes it into the site config), W.
const FAILSAFE_CAP_W: f64 = 300.0;
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

/// A `systemctl restart powerflexd` during a 1.9 kW cut must not lift the draw above the
/// cut: a stopping agent that restored every GPU to its default until the next one's
/// first tick would draw 4.3 kW for about 3 s. A rolling restart of every agent during a
/// grid event, each stopped as an admin stops it (SIGTERM) and started again, keeps the
/// metered draw within the event's budget at every 50 ms sample, and no GPU is raised to
/// its default or the fail-safe.
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
    let event = powerflex::run(
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
