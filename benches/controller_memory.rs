//! The controller's memory per node and per job, and one full reallocation, at site
//! scale: the controller's core (`powerflex_controller_machine::controller::step::Controller`, what
//! `powerflex-ctld` runs) fed every node's hello and report, then ticked, under 100 racks,
//! 10 rows and 2 feeds of `[[domains]]`. Memory is the process's resident set (what an
//! admin's `ps` shows) after the core's first allocation less before it, each size in a
//! fresh process (the bench runs itself once per size), the agents' messages dropped: the
//! core's sessions, last decision, curves and history, plus what the allocator keeps.
//!
//! `cargo bench -p powerflex --bench controller_memory`

use std::process::Command;
use std::time::{Duration, Instant};

use powerflex_controller_machine::controller::step::{Controller, Input};
use powerflex_controller_machine::controller::CtldSettings;
use powerflex_core::allocate::Policy;
use powerflex_core::domains::{DomainTree, RawDomain};
use powerflex_core::flex::TierTable;
use powerflex_core::{UnixMs, Watts};
use powerflex_decide::{SiteDomains, SiteSettings};
use powerflex_proto::report::{GpuInfo, JobReport};

/// The process's resident memory, bytes (`VmRSS` in /proc/self/status).
fn rss_bytes() -> usize {
    let status = std::fs::read_to_string("/proc/self/status").expect("/proc/self/status");
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<usize>().ok())
        .map(|kb| kb * 1024)
        .expect("VmRSS")
}

const GPUS_PER_NODE: u32 = 8;
const MAX_CAP_W: f64 = 700.0;
const TIERS: [&str; 3] = ["flex1", "flex2", "flex3"];

fn gpus(node: usize) -> Vec<GpuInfo> {
    (0..GPUS_PER_NODE)
        .map(|g| GpuInfo {
            uuid: format!("GPU-{node:05}-{g}"),
            name: "NVIDIA H200 (simulated)".into(),
            min_w: 200.0,
            max_w: MAX_CAP_W,
            default_w: MAX_CAP_W,
        })
        .collect()
}

/// A job's report with four measured caps, as an agent sends it after calibration.
fn job(id: usize, gpus: u32) -> JobReport {
    let curvature = 0.2 + 0.8 * ((id * 7919) % 1000) as f64 / 1000.0;
    let throughput = |cap: f64| 1000.0 * (1.0 - curvature * (1.0 - cap / MAX_CAP_W).powi(2));
    JobReport {
        job_id: (100_000 + id).to_string(),
        tier: TIERS[id % TIERS.len()].into(),
        gpus,
        cap_w: Some(MAX_CAP_W),
        power_w: Some(0.9 * MAX_CAP_W * f64::from(gpus)),
        throughput: Some(throughput(MAX_CAP_W)),
        throughput_unit: Some(powerflex_proto::usage::ThroughputUnit::Tokens),
        pfi: None,
        pfi_source: Some(powerflex_proto::status::PfiSource::Measured),
        points: [700.0, 600.0, 500.0, 400.0]
            .iter()
            .map(|&c| [c, 0.9 * c * f64::from(gpus), throughput(c)])
            .map(powerflex_proto::point::from_array)
            .collect(),
        gpu_uuids: Vec::new(),
        power_cap_w: Some(MAX_CAP_W),
        power_cap_steady_s: Some(10.0),
        calibrating: false,
        curve_in_question: false,
        curve: Vec::new(),
        calibration_cost_pct: None,
        owner_uid: None,
        usage: None,
    }
}

/// 2 feeds, 10 rows, 100 racks over nodes `n0..n{nodes-1}`, every limit at 85 % of its
/// GPUs' maximum.
fn domains(nodes: usize) -> SiteDomains {
    let per_rack = nodes / 100;
    let limit = |n: usize| 0.85 * (n * GPUS_PER_NODE as usize) as f64 * MAX_CAP_W;
    let mut raw = Vec::new();
    for f in 0..2 {
        raw.push(RawDomain {
            name: format!("feed-{f}"),
            parent: None,
            gpu_limit_w: limit(nodes / 2),
            nodes: None,
        });
    }
    for r in 0..10 {
        raw.push(RawDomain {
            name: format!("row-{r}"),
            parent: Some(format!("feed-{}", r / 5)),
            gpu_limit_w: limit(nodes / 10),
            nodes: None,
        });
    }
    for k in 0..100 {
        raw.push(RawDomain {
            name: format!("rack-{k}"),
            parent: Some(format!("row-{}", k / 10)),
            gpu_limit_w: limit(per_rack),
            nodes: Some(format!("n[{}-{}]", k * per_rack, (k + 1) * per_rack - 1)),
        });
    }
    let tree = DomainTree::build(&raw).expect("the tree");
    SiteDomains::configured(&tree).expect("domains")
}

/// Heap bytes the core holds with `nodes` nodes of `jobs_per_node` jobs each, after its
/// first allocation; and the median time of a tick's full reallocation.
fn measure(nodes: usize, jobs_per_node: usize) -> (usize, Duration) {
    let gpus_per_job = GPUS_PER_NODE / jobs_per_node as u32;
    let before = rss_bytes();
    let settings = CtldSettings {
        base_budget: Watts(0.75 * (nodes * GPUS_PER_NODE as usize) as f64 * MAX_CAP_W),
        period: Duration::from_secs(10),
        lease_ttl_s: 60.0,
        site: SiteSettings {
            tiers: TierTable::default_table(),
            policy: Policy::Optimal,
            cap_step: Watts(10.0),
            failsafe_cap: Watts(300.0),
            default_pfi: 1.3,
            budget_mode: powerflex_core::config::BudgetMode::default(),
            objective: powerflex_core::config::Objective::RelativeSpeed,
            tier_bounds: powerflex_decide::TierBounds::Honoured,
            domains: Some(domains(nodes)),
        },
        lease_rollout: Default::default(),
        max_ramp_w_per_s: None,
        job_placement: powerflex_core::config::JobPlacement::Reports,
        max_gpu_power_w: MAX_CAP_W,
    };
    let t0 = 1_800_000_000_000u64;
    let mut core = Controller::new(settings, Default::default(), UnixMs(t0));
    let inputs: Vec<Input> = (0..nodes)
        .flat_map(|n| {
            let jobs: Vec<JobReport> = (0..jobs_per_node)
                .map(|j| job(n * jobs_per_node + j, gpus_per_job))
                .collect();
            let power_w = jobs.iter().filter_map(|j| j.power_w).sum();
            [
                Input::Hello {
                    node: format!("n{n}"),
                    gpus: gpus(n),
                },
                Input::Report {
                    node: format!("n{n}"),
                    jobs,
                    power_w,
                    ended: Vec::new(),
                    observe_only: false,
                },
            ]
        })
        .collect();
    let out = core.step(UnixMs(t0), inputs);
    assert!(out.history.is_some(), "the first step allocates");
    drop(out);
    let held = rss_bytes().saturating_sub(before);
    let mut times: Vec<Duration> = (1..=3)
        .map(|k| {
            let started = Instant::now();
            let out = core.step(UnixMs(t0 + k), vec![Input::Tick]);
            let took = started.elapsed();
            assert!(out.history.is_some(), "a tick allocates");
            took
        })
        .collect();
    times.sort();
    (held, times[1])
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    // One size, in this process: `--one NODES JOBS_PER_NODE` prints "bytes ms".
    if let Some(at) = args.iter().position(|a| a == "--one") {
        let nodes: usize = args[at + 1].parse().expect("nodes");
        let per_node: usize = args[at + 2].parse().expect("jobs per node");
        let (bytes, took) = measure(nodes, per_node);
        println!("{bytes} {}", took.as_secs_f64() * 1000.0);
        return;
    }
    println!("controller core, 100 racks / 10 rows / 2 feeds of [[domains]], 8 GPUs per node");
    println!(
        "{:>7} {:>9} {:>8} {:>12} {:>14}",
        "nodes", "jobs/node", "jobs", "RSS MiB", "reallocation"
    );
    let me = std::env::current_exe().expect("this bench");
    let mut rows = Vec::new();
    for (nodes, per_node) in [(1_000, 1), (10_000, 1), (10_000, 4), (10_000, 8)] {
        let out = Command::new(&me)
            .args(["--one", &nodes.to_string(), &per_node.to_string()])
            .output()
            .expect("run one size");
        let text = String::from_utf8_lossy(&out.stdout);
        let mut fields = text.split_whitespace();
        let bytes: usize = fields.next().and_then(|b| b.parse().ok()).expect("bytes");
        let ms: f64 = fields.next().and_then(|m| m.parse().ok()).expect("ms");
        println!(
            "{:>7} {:>9} {:>8} {:>12.1} {:>11.0} ms",
            nodes,
            per_node,
            nodes * per_node,
            bytes as f64 / (1 << 20) as f64,
            ms
        );
        rows.push((nodes, per_node, bytes));
    }
    // Per node and per job, from the sites of one job per node and of eight.
    let one = rows[1].2 as f64;
    let eight = rows[3].2 as f64;
    let per_job = (eight - one) / (10_000.0 * 7.0);
    let per_node = one / 10_000.0 - per_job;
    println!(
        "per job {:.1} KiB, per node besides its jobs {:.1} KiB (from 10,000 nodes with 1 and 8 jobs each)",
        per_job / 1024.0,
        per_node / 1024.0
    );
}
