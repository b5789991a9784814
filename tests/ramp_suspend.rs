//! Cuts deeper than caps on a local Slurm cluster with SIMULATED
//! GPUs: what only Slurm shows, a job suspended or requeued through `scontrol` and
//! brought back. The ramp's own promise (no 50 ms sample above the stepped budget, down
//! or up, and the rebound within the rate limit) is logic, checked on the site harness's
//! fake clock: `harness/tests/ramp_suspend.rs`.
//!
//! The meter is every simulated GPU's power reading, summed, sampled every 50 ms. Its own
//! granularity, stated so the figures can be judged: 1 mW resolution; ±0.5 % noise per
//! GPU, fixed within each 100 ms; a reading never above the GPU's cap; and it follows a
//! cap the moment the cap is written (a real GPU settles in a few hundred ms, which the
//! controller's 2 s confirmation look-ahead is there to cover; this test does not prove
//! that part). Samples are compared with the stepped budget in force at the instant of
//! the sample, with no tolerance: the lower of the budget just before and just after the
//! reading, computed from the event the controller reports with the same function the
//! controller uses, and checked against the `budget_w` its status reports while the test
//! runs.

use powerflex_daemon::clock::unix_ms;
use std::time::{Duration, Instant};

use powerflex::needs::{can_run, Need};
use powerflex::stack::{Stack, StackOptions, DEFAULT_CAP_W};
use powerflex::wait_until;
use powerflex_controller_machine::schedule::effective_budget;
use powerflex_core::Watts;
use powerflex_proto::event::Event;
use powerflex_proto::status::{CtldStatus, SiteJobStatus};

/// A training profile that draws 690 W per GPU uncapped, and what its cap allows below.
const HEAVY: &str = "synthetic-compute-bound";

fn status(stack: &Stack) -> Option<CtldStatus> {
    stack.ctl_json(&["status"])
}

/// Waits until every job in `ids` runs and has a granted cap.
fn start_all(stack: &Stack, ids: &[u32]) {
    wait_until("the jobs run", Duration::from_secs(90), || {
        ids.iter().all(|&id| stack.running(id)).then_some(())
    });
    wait_until(
        "a cap granted to every job",
        Duration::from_secs(60),
        || {
            let jobs: Vec<SiteJobStatus> = stack.ctl_json(&["jobs"])?;
            ids.iter()
                .all(|id| {
                    jobs.iter()
                        .any(|j| j.job == id.to_string() && j.cap_w.is_some())
                })
                .then_some(())
        },
    );
}

fn add_event(stack: &Stack, args: &[&str]) -> Event {
    let socket = stack.socket.to_string_lossy().to_string();
    let mut all = vec!["event", "add"];
    all.extend_from_slice(args);
    all.extend_from_slice(&["--socket", &socket]);
    let add = powerflex::run(&stack.ctl, &all);
    assert_eq!(add.code, Some(0), "{}", add.stderr);
    let s = status(stack).expect("status");
    s.events.last().cloned().expect("the event")
}

/// One 50 ms sample of the meter against the stepped budget.
#[derive(Debug, Clone, Copy)]
struct Sample {
    t_ms: u64,
    draw_w: f64,
    budget_w: f64,
}

/// Samples the meter every 50 ms for `duration`, each against the budget in force
/// (`base_w` less `events`) at that instant; meanwhile checks that what the controller
/// reports as in force agrees. Returns the samples.
fn sample(stack: &Stack, base_w: f64, events: &[Event], duration: Duration) -> Vec<Sample> {
    let budget_at = |t: u64| effective_budget(Watts(base_w), events, t).0;
    let mut samples = Vec::new();
    let stop = std::sync::atomic::AtomicBool::new(false);
    std::thread::scope(|scope| {
        let checker = scope.spawn(|| {
            let mut checked = 0;
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                let before = unix_ms();
                let Some(s) = status(stack) else { continue };
                let after = unix_ms();
                let (lo, hi) = (
                    budget_at(before).min(budget_at(after)),
                    budget_at(before).max(budget_at(after)),
                );
                assert!(
                    s.budget_w >= lo - 0.5 && s.budget_w <= hi + 0.5,
                    "the controller reports {} W in force between {before} and {after}; the event says {lo}..{hi} W",
                    s.budget_w
                );
                checked += 1;
                std::thread::sleep(Duration::from_millis(300));
            }
            checked
        });
        let start = Instant::now();
        let mut next = start;
        while next < start + duration {
            let before = unix_ms();
            let draw_w = stack.draw_w();
            let after = unix_ms();
            samples.push(Sample {
                t_ms: after,
                draw_w,
                budget_w: budget_at(before).min(budget_at(after)),
            });
            next += Duration::from_millis(50);
            std::thread::sleep(next.saturating_duration_since(Instant::now()));
        }
        stop.store(true, std::sync::atomic::Ordering::Relaxed);
        let checked = checker.join().expect("status checker");
        assert!(
            checked >= 10,
            "the reported budget was checked {checked} times"
        );
    });
    samples
}

fn over(samples: &[Sample]) -> Vec<Sample> {
    samples
        .iter()
        .filter(|s| s.draw_w > s.budget_w)
        .copied()
        .collect()
}

/// A cut below what caps at every floor can reach: flex0 on one node, a flex3 job that
/// allows suspension and one that does not. Exactly the one that allows it is suspended
/// (before the start), the budget holds at every sample, flex0 is never capped, and the
/// job resumes when the event ends.
#[test]
fn a_cut_deeper_than_caps_suspends_the_right_job_and_resumes_it() {
    if !can_run(&[Need::Root, Need::Slurm]) {
        return;
    }
    let base_w = 8400.0;
    let stack = Stack::start(
        "rs-deep",
        StackOptions {
            nodes: 3,
            budget_w: base_w,
            ..StackOptions::default()
        },
    );
    let flex0 = stack.submit("flex0,calibrate=off", 1, 4, HEAVY);
    let pausable = stack.submit("flex3,calibrate=off,preempt=suspend", 1, 4, HEAVY);
    let steady = stack.submit("flex3,calibrate=off", 1, 4, HEAVY);
    start_all(&stack, &[flex0, pausable, steady]);
    wait_until(
        "every job loading its GPUs",
        Duration::from_secs(30),
        || (stack.draw_w() > 7500.0).then_some(()),
    );
    // The least caps can do with flex0 untouched: flex0 4 x 690 W, each flex3 job at the
    // GPUs' 200 W minimum (below its tier's floor), 4 x 200 W: 4360 W. With one flex3 job
    // suspended (4 GPUs at 75 W idle): 3860 W. At 4100 W one suspension is needed, and
    // only one job allows it.
    let target_w = 4100.0;
    let event = add_event(
        &stack,
        &[
            "--target",
            &format!("{target_w}W"),
            "--start",
            "+6s",
            "--duration",
            "30s",
        ],
    );
    let end_ms = event.start_ms + event.duration_ms;
    wait_until(
        "the pausable job suspended",
        Duration::from_secs(10),
        || (stack.cluster.job_state(pausable).as_deref() == Some("SUSPENDED")).then_some(()),
    );
    assert!(
        unix_ms() < event.start_ms,
        "suspended before the event starts"
    );
    let s = status(&stack).expect("status");
    assert_eq!(
        s.preempted
            .iter()
            .map(|p| p.job.as_str())
            .collect::<Vec<_>>(),
        [pausable.to_string().as_str()],
        "{:?}",
        s.preempted
    );
    let comment = stack.cluster.job_info(pausable);
    assert!(
        comment.contains("suspended:grid-cut-deeper-than-every-cap-floor"),
        "{comment}"
    );
    // Through the event: the budget at every sample, flex0 at its default cap, the
    // other two as they were.
    let until_end = Duration::from_millis(end_ms.saturating_sub(unix_ms()));
    let flex0_caps = std::thread::scope(|scope| {
        let watcher = scope.spawn(|| {
            let mut lowest = f64::MAX;
            let deadline = Instant::now() + until_end;
            while Instant::now() < deadline {
                let job = stack.ctl_json::<Vec<SiteJobStatus>>(&["jobs"]);
                if let Some(cap) = job
                    .iter()
                    .flatten()
                    .find(|j| j.job == flex0.to_string())
                    .and_then(|j| j.cap_w)
                {
                    lowest = lowest.min(cap);
                }
                std::thread::sleep(Duration::from_millis(500));
            }
            lowest
        });
        let samples = sample(&stack, base_w, std::slice::from_ref(&event), until_end);
        let over = over(&samples);
        let in_event: Vec<&Sample> = samples
            .iter()
            .filter(|s| s.t_ms >= event.start_ms)
            .collect();
        let highest = in_event.iter().map(|s| s.draw_w).fold(0.0, f64::max);
        println!(
            "deep cut to {target_w} W: {} samples, {} over the budget; highest draw in the event {highest:.0} W",
            samples.len(),
            over.len()
        );
        assert!(over.is_empty(), "{:?}", &over[..over.len().min(5)]);
        assert_eq!(
            stack.cluster.job_state(pausable).as_deref(),
            Some("SUSPENDED"),
            "held through the event"
        );
        assert!(stack.running(flex0) && stack.running(steady));
        watcher.join().expect("watcher")
    });
    assert_eq!(flex0_caps, DEFAULT_CAP_W, "flex0 never capped");
    wait_until("the pausable job resumed", Duration::from_secs(20), || {
        stack.running(pausable).then_some(())
    });
    wait_until("nothing held", Duration::from_secs(10), || {
        status(&stack)
            .is_some_and(|s| s.preempted.is_empty())
            .then_some(())
    });
    println!(
        "resumed {:.1} s after the end of the event",
        unix_ms().saturating_sub(end_ms) as f64 / 1000.0
    );
    stack.ends_clean(&[flex0, pausable, steady], Duration::from_secs(30));
}

/// The same deep cut with a job that allows requeueing instead: it goes back to the queue,
/// held there (its GPUs freed), the budget holds, and it is released and runs again when
/// the event is over.
#[test]
fn a_cut_deeper_than_caps_requeues_the_job_that_allows_it_and_releases_it_after() {
    if !can_run(&[Need::Root, Need::Slurm]) {
        return;
    }
    let base_w = 8400.0;
    let stack = Stack::start(
        "rs-requeue",
        StackOptions {
            nodes: 3,
            budget_w: base_w,
            ..StackOptions::default()
        },
    );
    let flex0 = stack.submit("flex0,calibrate=off", 1, 4, HEAVY);
    let requeueable = stack.submit("flex3,calibrate=off,preempt=requeue", 1, 4, HEAVY);
    let steady = stack.submit("flex3,calibrate=off", 1, 4, HEAVY);
    start_all(&stack, &[flex0, requeueable, steady]);
    wait_until(
        "every job loading its GPUs",
        Duration::from_secs(30),
        || (stack.draw_w() > 7500.0).then_some(()),
    );
    // As in the suspension test: 4360 W with every flex3 GPU at 200 W; 4100 W needs one
    // job out, and only one allows it.
    let target_w = 4100.0;
    let event = add_event(
        &stack,
        &[
            "--target",
            &format!("{target_w}W"),
            "--start",
            "+6s",
            "--duration",
            "25s",
        ],
    );
    let end_ms = event.start_ms + event.duration_ms;
    // Slurm shows a job requeued held as REQUEUE_HOLD, then PENDING with priority 0.
    let deadline = Instant::now() + Duration::from_secs(10);
    let mut info = String::new();
    while Instant::now() < deadline {
        info = stack.cluster.job_info(requeueable);
        let state = stack.cluster.job_state(requeueable).unwrap_or_default();
        if ["PENDING", "REQUEUE_HOLD", "REQUEUED"].contains(&state.as_str()) {
            break;
        }
        std::thread::sleep(Duration::from_millis(200));
    }
    println!("requeued: {info}");
    assert!(
        !stack.running(requeueable) && info.contains("Priority=0"),
        "requeued and held: {info}"
    );
    assert!(
        unix_ms() < event.start_ms,
        "requeued before the event starts"
    );
    let s = status(&stack).expect("status");
    assert_eq!(
        s.preempted
            .iter()
            .map(|p| (p.job.as_str(), p.how.name()))
            .collect::<Vec<_>>(),
        [(requeueable.to_string().as_str(), "requeue")]
    );
    let until_end = Duration::from_millis(end_ms.saturating_sub(unix_ms()));
    let samples = sample(&stack, base_w, std::slice::from_ref(&event), until_end);
    let over = over(&samples);
    println!(
        "requeue, deep cut to {target_w} W: {} samples, {} over the budget",
        samples.len(),
        over.len()
    );
    assert!(over.is_empty(), "{:?}", &over[..over.len().min(5)]);
    assert!(stack.running(flex0) && stack.running(steady));
    assert!(
        !stack.running(requeueable),
        "held through the event: {}",
        stack.cluster.job_info(requeueable)
    );
    wait_until("released at the end", Duration::from_secs(10), || {
        status(&stack)
            .is_some_and(|s| s.preempted.is_empty())
            .then_some(())
    });
    // Released at the end, its start brought forward over Slurm's requeue delay (about
    // two minutes after the requeue otherwise); then the scheduler starts it.
    wait_until(
        "the requeued job running again",
        Duration::from_secs(120),
        || stack.running(requeueable).then_some(()),
    );
    println!(
        "running again {:.1} s after the end of the event",
        unix_ms().saturating_sub(end_ms) as f64 / 1000.0
    );
    stack.ends_clean(&[flex0, requeueable, steady], Duration::from_secs(30));
}
