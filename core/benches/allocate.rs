//! Allocation benchmark: time to allocate a facility budget across N jobs of 8 GPUs each,
//! per policy. Run with `cargo bench -p powerflex-core --bench allocate`; prints a table.
//!
//! Jobs are the paper's 29 workloads (physics fitted to their PFI, 6 caps 200–700 W),
//! drawn at random with random tiers (none of the bounds, flex1–flex3 mixed), budget at a
//! 30 % cut of Σ P_max, caps on a 1 W grid (NVML's effective granularity, the worst case).
//!
//! Then the same jobs under power domains: 100 racks, 10 rows, 2 feeds, every
//! limit binding (racks at 80 %, rows at 75 %, feeds at 72 % of their uncapped draw, the
//! site at 70 %), with the controller's own rule (`allocate_cautious_within`) beside the
//! plain policies, and the flat site's time for the same jobs. The rule runs with the
//! controller's caution (`power_z` 0: its metered loop corrects power every period).

use std::hint::black_box;
use std::time::{Duration, Instant};

use powerflex_core::allocate::{
    allocate, allocate_cautious, allocate_cautious_within, allocate_within, CapLimits, Caution,
    DomainLimit, JobSpec, Policy,
};
use powerflex_core::curve::CapCurve;
use powerflex_core::rng::SplitMix64;
use powerflex_core::units::{SlowdownFraction, Watts};
use powerflex_core::workload::{fit_h200, parse_paper_table, PfiTarget, H200_GRID_6};

const PAPER: &str = include_str!("../../data/paper_pfi_h200.csv");
const GPUS_PER_JOB: u32 = 8;
/// The caution `powerflex-ctld` allocates with (`powerflex_decide`'s `site_allocation`).
const CONTROLLER: Caution = Caution {
    power_z: 0.0,
    gain_z: 1.0,
};

fn jobs(n: usize, seed: u64) -> Vec<JobSpec> {
    let paper = parse_paper_table(PAPER).expect("paper table parses");
    let curves: Vec<CapCurve> = paper
        .iter()
        .map(|p| {
            let (physics, _, _) = fit_h200(PfiTarget {
                pfi: p.pfi,
                grid: p.paper_grid(),
                pfi_4cap: p.pfi_4cap,
                memory_heavy: p.memory_heavy(),
            });
            CapCurve::from_points(&physics.curve(
                &H200_GRID_6,
                GPUS_PER_JOB,
                p.uncapped_tokens_per_s(),
            ))
            .expect("curve")
        })
        .collect();
    let mut rng = SplitMix64::new(seed);
    let bounds = [0.10, 0.25, 0.50];
    (0..n)
        .map(|i| JobSpec {
            id: format!("job{i}"),
            gpus: GPUS_PER_JOB,
            curve: curves[rng.below(curves.len())].clone(),
            max_slowdown: Some(SlowdownFraction(bounds[rng.below(bounds.len())])),
            limits: CapLimits {
                min_w: Watts(200.0),
                max_w: Watts(700.0),
                step_w: Watts(1.0),
            },
            throughput_weight: 1.0,
        })
        .collect()
}

fn time_it(jobs: &[JobSpec], budget: Watts, policy: Policy) -> Duration {
    let runs = if jobs.len() >= 100_000 { 3 } else { 7 };
    let mut times: Vec<Duration> = (0..runs)
        .map(|_| {
            let start = Instant::now();
            let a = allocate(black_box(jobs), budget, policy).expect("allocation");
            black_box(a);
            start.elapsed()
        })
        .collect();
    times.sort();
    times[times.len() / 2]
}

/// Jobs spread evenly over 100 racks, 10 per row, 5 rows per feed; each domain's limit a
/// share of its jobs' uncapped draw. Racks first, then rows, then feeds.
fn domains(jobs: &[JobSpec]) -> Vec<DomainLimit> {
    let top = |members: &[(usize, f64)]| -> f64 {
        members
            .iter()
            .map(|&(i, _)| jobs[i].curve.uncapped().power_w.0)
            .sum()
    };
    let domain = |name: String, members: Vec<(usize, f64)>, share: f64| DomainLimit {
        limit: Watts(top(&members) * share),
        name,
        members,
    };
    let of = |pick: &dyn Fn(usize) -> bool| -> Vec<(usize, f64)> {
        (0..jobs.len())
            .filter(|&i| pick(i))
            .map(|i| (i, 1.0))
            .collect()
    };
    let rack = |i: usize| i * 100 / jobs.len();
    let mut out = Vec::new();
    for r in 0..100 {
        out.push(domain(format!("rack-{r}"), of(&|i| rack(i) == r), 0.80));
    }
    for row in 0..10 {
        out.push(domain(
            format!("row-{row}"),
            of(&|i| rack(i) / 10 == row),
            0.75,
        ));
    }
    for feed in 0..2 {
        out.push(domain(
            format!("feed-{feed}"),
            of(&|i| rack(i) / 50 == feed),
            0.72,
        ));
    }
    out
}

fn median(runs: usize, mut once: impl FnMut()) -> Duration {
    let mut times: Vec<Duration> = (0..runs)
        .map(|_| {
            let start = Instant::now();
            once();
            start.elapsed()
        })
        .collect();
    times.sort();
    times[times.len() / 2]
}

fn main() {
    println!("allocation time, median of repeated runs (8 GPUs per job, 30 % cut, 1 W cap grid)");
    println!(
        "{:>8} {:>8} {:>12} {:>12} {:>18}",
        "jobs", "GPUs", "optimal", "equal", "pfi-proportional"
    );
    for n in [100, 1_000, 10_000, 100_000] {
        let set = jobs(n, 42);
        let budget = Watts(
            0.7 * set
                .iter()
                .map(|j| j.curve.uncapped().power_w.0)
                .sum::<f64>(),
        );
        let ms = |d: Duration| format!("{:.2} ms", d.as_secs_f64() * 1e3);
        println!(
            "{:>8} {:>8} {:>12} {:>12} {:>18}",
            n,
            n * GPUS_PER_JOB as usize,
            ms(time_it(&set, budget, Policy::Optimal)),
            ms(time_it(&set, budget, Policy::Equal)),
            ms(time_it(&set, budget, Policy::PfiProportional)),
        );
    }
    println!();
    println!("with power domains: 100 racks, 10 rows, 2 feeds, every limit binding (median of repeated runs)");
    println!(
        "{:>8} {:>14} {:>14} {:>12} {:>22}",
        "jobs", "flat cautious", "domains: rule", "optimal", "equal"
    );
    for n in [1_000, 10_000, 100_000] {
        let set = jobs(n, 42);
        let budget = Watts(
            0.7 * set
                .iter()
                .map(|j| j.curve.uncapped().power_w.0)
                .sum::<f64>(),
        );
        let limits = domains(&set);
        let runs = if n >= 100_000 { 3 } else { 5 };
        let ms = |d: Duration| format!("{:.2} ms", d.as_secs_f64() * 1e3);
        let flat = median(runs, || {
            black_box(allocate_cautious(black_box(&set), budget, CONTROLLER).expect("flat"));
        });
        let rule = median(runs, || {
            black_box(
                allocate_cautious_within(black_box(&set), budget, &limits, CONTROLLER)
                    .expect("rule"),
            );
        });
        let optimal = median(runs, || {
            black_box(
                allocate_within(black_box(&set), budget, &limits, Policy::Optimal)
                    .expect("optimal"),
            );
        });
        let equal = median(runs, || {
            black_box(
                allocate_within(black_box(&set), budget, &limits, Policy::Equal).expect("equal"),
            );
        });
        println!(
            "{:>8} {:>14} {:>14} {:>12} {:>22}",
            n,
            ms(flat),
            ms(rule),
            ms(optimal),
            ms(equal)
        );
    }
}
