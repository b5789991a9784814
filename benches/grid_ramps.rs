//! Ramps and deep cuts against the meter, on a local Slurm cluster with
//! SIMULATED H200s (4 per node), the real plugin, agents and controller (allocation period
//! 1 s, agents sampling every 250 ms):
//!
//! 1. A 30 % event with a 10 s ramp announced 8 s ahead, two flex3 jobs drawing 690 W per
//!    GPU, `max_ramp_w_per_s = 100`: the meter (every GPU's reading, summed) sampled every
//!    50 ms against the stepped budget in force at that instant; the rebound after it.
//! 2. The deepest cut held with flex0 untouched: flex0 + two flex3 jobs on three nodes,
//!    the budget stepped down 200 W at a time (3 s to settle, 2 s sampled), once with the
//!    flex3 jobs `preempt=never` and once `preempt=suspend`.
//!
//! The meter's granularity: 1 mW, ±0.5 % noise per GPU fixed per 100 ms, never above the
//! cap, following a cap at once (a real GPU takes a few hundred ms). Run:
//! `cargo bench -p powerflex --bench grid_ramps` (root; needs slurm-wlm).

use powerflex_daemon::clock::unix_ms;
use std::time::{Duration, Instant};

use powerflex::site_config::SiteBuilder;
use powerflex::stack::{Stack, StackOptions};
use powerflex::wait_until;
use powerflex_controller_machine::schedule::effective_budget;
use powerflex_core::allocate::FloorStatus;
use powerflex_core::Watts;
use powerflex_proto::event::Event;
use powerflex_proto::status::{CtldStatus, SiteJobStatus};

const HEAVY: &str = "synthetic-compute-bound";
const RATE_W_PER_S: f64 = 100.0;

fn ctl(stack: &Stack, args: &[&str]) {
    let socket = stack.socket.to_string_lossy().to_string();
    let mut all = args.to_vec();
    all.extend_from_slice(&["--socket", &socket]);
    let out = powerflex::run(&stack.ctl, &all);
    assert_eq!(out.code, Some(0), "powerflexctl {args:?}: {}", out.stderr);
}

fn start_all(stack: &Stack, ids: &[u32], min_draw_w: f64) {
    wait_until("the jobs run", Duration::from_secs(90), || {
        ids.iter().all(|&id| stack.running(id)).then_some(())
    });
    wait_until(
        "caps granted and the GPUs loaded",
        Duration::from_secs(60),
        || {
            let jobs: Vec<SiteJobStatus> = stack.ctl_json(&["jobs"])?;
            let granted = ids.iter().all(|id| {
                jobs.iter()
                    .any(|j| j.job == id.to_string() && j.cap_w.is_some())
            });
            (granted && stack.draw_w() > min_draw_w).then_some(())
        },
    );
}

/// (time, draw, budget in force) every 50 ms for `duration`.
fn sample(
    stack: &Stack,
    budget_at: impl Fn(u64) -> f64,
    duration: Duration,
) -> Vec<(u64, f64, f64)> {
    let mut out = Vec::new();
    let start = Instant::now();
    let mut next = start;
    while next < start + duration {
        let before = unix_ms();
        let draw = stack.draw_w();
        let after = unix_ms();
        out.push((after, draw, budget_at(before).min(budget_at(after))));
        next += Duration::from_millis(50);
        std::thread::sleep(next.saturating_duration_since(Instant::now()));
    }
    out
}

fn ramp() {
    let base_w = 5600.0;
    let stack = Stack::start(
        "bench-ramp",
        StackOptions {
            budget_w: base_w,
            site: Some(|b: SiteBuilder| {
                b.edit(|raw| raw.facility.max_ramp_w_per_s = Some(RATE_W_PER_S))
            }),
            ..StackOptions::default()
        },
    );
    let jobs = [
        stack.submit("flex3,calibrate=off", 1, 4, HEAVY),
        stack.submit("flex3,calibrate=off", 1, 4, HEAVY),
    ];
    start_all(&stack, &jobs, 5000.0);
    ctl(
        &stack,
        &[
            "event",
            "add",
            "--reduce",
            "30%",
            "--of",
            "base",
            "--start",
            "+8s",
            "--duration",
            "40s",
            "--ramp",
            "10s",
        ],
    );
    let status: CtldStatus = stack.ctl_json(&["status"]).expect("status");
    let event: Event = status.events.last().cloned().expect("event");
    let (start, end) = (event.start_ms, event.start_ms + event.duration_ms);
    let events = [event.clone()];
    let budget_at = |t: u64| effective_budget(Watts(base_w), &events, t).0;
    let left = Duration::from_millis(end.saturating_sub(unix_ms())) + Duration::from_secs(24);
    let samples = sample(&stack, budget_at, left);
    let ramp_ms = event.ramp_ms;
    let phase = |lo: u64, hi: u64| -> (usize, usize, f64) {
        let s: Vec<_> = samples.iter().filter(|s| s.0 >= lo && s.0 < hi).collect();
        let over = s.iter().filter(|s| s.1 > s.2).count();
        let highest = s.iter().map(|s| s.1 - s.2).fold(f64::MIN, f64::max);
        (s.len(), over, highest)
    };
    println!("A 30 % event (5600 W → 3920 W) with a 10 s ramp announced 8 s ahead; two flex3 jobs drawing 690 W per GPU on 8 GPUs; max_ramp_w_per_s = {RATE_W_PER_S}. Every 50 ms, the draw against the stepped budget in force:\n");
    println!("| phase | samples | over the stepped budget | highest draw − budget |");
    println!("| --- | --- | --- | --- |");
    for (name, lo, hi) in [
        ("8 s before the start", start - 8_000, start),
        ("ramp down (10 steps of 168 W)", start, start + ramp_ms),
        ("held at 3920 W", start + ramp_ms, end - ramp_ms),
        ("ramp up (10 steps)", end - ramp_ms, end),
        ("24 s after the end", end, end + 24_000),
    ] {
        let (n, over, highest) = phase(lo, hi);
        println!("| {name} | {n} | {over} | {highest:+.0} W |");
    }
    // The rebound: the draw's rise over every window of at least 1 s from the start of
    // the ramp up.
    let after: Vec<_> = samples.iter().filter(|s| s.0 >= end - ramp_ms).collect();
    let mut peak = 0.0f64;
    for (i, a) in after.iter().enumerate() {
        for b in &after[i + 1..] {
            let w = (b.0 - a.0) as f64 / 1000.0;
            if w >= 1.0 {
                peak = peak.max((b.1 - a.1) / w);
            }
        }
    }
    let low = after.first().map_or(0.0, |s| s.1);
    let settled = after.iter().rev().take(40).map(|s| s.1).sum::<f64>() / 40.0;
    let reached = after
        .iter()
        .find(|s| s.1 >= low + 0.95 * (settled - low))
        .map_or(f64::NAN, |s| (s.0 - after[0].0) as f64 / 1000.0);
    println!(
        "\nRebound from {low:.0} W to {settled:.0} W: 95 % of it in {reached:.1} s, {:.0} W/s on average against the {RATE_W_PER_S} W/s limit; the highest rise over any window of at least 1 s: {peak:.0} W/s (caps move once per 1 s period, in 10 W steps per GPU).",
        0.95 * (settled - low) / reached
    );
}

/// One configuration of the deep-cut staircase: the deepest budget held.
fn deep(preempt: &str) -> Vec<String> {
    let base_w = 8400.0;
    let stack = Stack::start(
        &format!("bench-deep-{preempt}"),
        StackOptions {
            nodes: 3,
            budget_w: base_w,
            ..StackOptions::default()
        },
    );
    let flex0 = stack.submit("flex0,calibrate=off", 1, 4, HEAVY);
    let flex3 = format!("flex3,calibrate=off,preempt={preempt}");
    let others = [
        stack.submit(&flex3, 1, 4, HEAVY),
        stack.submit(&flex3, 1, 4, HEAVY),
    ];
    start_all(&stack, &[flex0, others[0], others[1]], 7500.0);
    let uncapped = stack.draw_w();
    let mut rows = Vec::new();
    let mut deepest_every_floor: Option<f64> = None;
    let mut deepest_flex0: Option<f64> = None;
    let mut budget = 6000.0;
    while budget >= 2600.0 {
        ctl(&stack, &["budget", "set", &format!("{budget}W")]);
        std::thread::sleep(Duration::from_secs(3));
        let samples = sample(&stack, |_| budget, Duration::from_secs(2));
        let over = samples.iter().filter(|s| s.1 > s.2).count();
        let highest = samples.iter().map(|s| s.1).fold(0.0, f64::max);
        let status: CtldStatus = stack.ctl_json(&["status"]).expect("status");
        let flex0_node = status
            .jobs
            .iter()
            .find(|j| j.job == flex0.to_string())
            .and_then(|j| j.nodes.first().cloned())
            .expect("flex0's node");
        let i = stack
            .cluster
            .node_names()
            .iter()
            .position(|n| *n == flex0_node)
            .expect("node");
        let flex0_caps_w: Vec<f64> = (0..stack.gpus_per_node)
            .map(|g| f64::from(stack.sims[i].gpu(g).expect("gpu").power_limit_mw) / 1000.0)
            .collect();
        let untouched = flex0_caps_w.iter().all(|&c| c == 700.0);
        let broken = status
            .jobs
            .iter()
            .filter(|j| matches!(j.floor, Some(FloorStatus::Broken { .. })))
            .count();
        let held = over == 0 && untouched && stack.running(flex0);
        if held {
            deepest_flex0 = Some(budget);
            if broken == 0 {
                deepest_every_floor = Some(budget);
            }
        }
        rows.push(format!(
            "| {preempt} | {budget:.0} W | {:.0} % | {highest:.0} W | {over} of {} | {} | {broken} | {} |",
            100.0 * (1.0 - budget / uncapped),
            samples.len(),
            if untouched { "700 W" } else { "CAPPED" },
            status.preempted.len(),
        ));
        budget -= 200.0;
    }
    rows.push(format!(
        "| **{preempt}: deepest held** | every floor: {} · flex0 untouched, the meter within the budget: {} | of {uncapped:.0} W uncapped | | | | | |",
        deepest_every_floor.map_or("none".into(), |b| format!("{b:.0} W ({:.0} % cut)", 100.0 * (1.0 - b / uncapped))),
        deepest_flex0.map_or("none".into(), |b| format!("{b:.0} W ({:.0} % cut)", 100.0 * (1.0 - b / uncapped))),
    ));
    rows
}

fn main() {
    ramp();
    println!("\nThe deepest cut held with flex0 untouched: flex0 and two flex3 jobs (4 GPUs each, 690 W per GPU uncapped) on three nodes; the budget stepped down 200 W at a time, 3 s to settle, then 2 s sampled every 50 ms. \"held\": no sample over the budget, flex0's GPUs at 700 W and running.\n");
    println!("| flex3 jobs | budget | cut | highest draw | samples over | flex0 caps | floors broken | jobs held out |");
    println!("| --- | --- | --- | --- | --- | --- | --- | --- |");
    for preempt in ["never", "suspend"] {
        for row in deep(preempt) {
            println!("{row}");
        }
    }
}
