//! The allocator under nested power domains: a site budget over a row, the row
//! over two racks, each rack over its jobs, and a job outside the row. On REAL measured
//! curves (the Zeus NSDI'23 dev set in `data/curves`), the optimal policy is checked
//! against exhaustive search over every combination of grid caps, every policy against
//! every limit, and a rack that cannot pay its jobs' floors against the promise that its
//! neighbours do not pay for it.

use powerflex_core::allocate::{
    allocate, allocate_cautious_within, allocate_within, Allocation, CapLimits, Caution,
    DomainLimit, FloorStatus, JobSpec, Policy,
};
use powerflex_core::curve::CapCurve;
use powerflex_core::curves_csv::{parse_curves, JobCurveRecord};
use powerflex_core::units::{SlowdownFraction, Watts};
use proptest::prelude::*;

/// The dev set's curves, each as the allocator sees a job on it: its measured caps on a
/// 25 W grid (both GPU models' curves are measured every 25 W).
fn dev_curves() -> Vec<JobCurveRecord> {
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../data/curves/zeus_nsdi23_dev.csv"
    );
    let text = std::fs::read_to_string(path).expect("the dev curves");
    parse_curves(&text).expect("parsed")
}

fn spec(record: &JobCurveRecord, id: usize, bound: Option<f64>) -> JobSpec {
    let lowest = record.points.first().expect("a point").cap_w;
    let highest = record.uncapped().expect("a point").cap_w;
    JobSpec {
        id: format!("j{id}"),
        gpus: record.gpus.unwrap_or(1),
        curve: CapCurve::from_points(&record.points).expect("curve"),
        max_slowdown: bound.map(SlowdownFraction),
        limits: CapLimits {
            min_w: lowest,
            max_w: highest,
            step_w: Watts(25.0),
        },
        throughput_weight: 1.0 / record.uncapped().expect("a point").throughput,
    }
}

/// Every grid cap of a job: every step from its lowest cap, and its highest (off the
/// step grid on a GPU whose maximum is, such as the RTX6000's 260 W).
fn grid(job: &JobSpec) -> Vec<f64> {
    let mut caps = Vec::new();
    let mut c = job.limits.min_w.0;
    while c <= job.limits.max_w.0 + 1e-9 {
        caps.push(c);
        c += job.limits.step_w.0;
    }
    if caps
        .last()
        .is_some_and(|&last| last < job.limits.max_w.0 - 1e-9)
    {
        caps.push(job.limits.max_w.0);
    }
    caps
}

/// The tree of the tests: rack A = jobs 0, 1; rack B = jobs 2, 3; the row = racks A and
/// B; job 4 sits outside the row, under the site only. Limits as shares of each domain's
/// uncapped draw.
fn tree(jobs: &[JobSpec], rack_a: f64, rack_b: f64, row: f64) -> Vec<DomainLimit> {
    let top = |members: &[usize]| -> f64 {
        members
            .iter()
            .map(|&i| jobs[i].curve.uncapped().power_w.0)
            .sum()
    };
    let domain = |name: &str, members: &[usize], share: f64| DomainLimit {
        name: name.into(),
        limit: Watts(top(members) * share),
        members: members.iter().map(|&i| (i, 1.0)).collect(),
    };
    vec![
        domain("rack-a", &[0, 1], rack_a),
        domain("rack-b", &[2, 3], rack_b),
        domain("row-1", &[0, 1, 2, 3], row),
    ]
}

/// Power through each domain (and the site, last) at `caps`.
fn through(jobs: &[JobSpec], domains: &[DomainLimit], caps: &[f64]) -> Vec<f64> {
    let power: Vec<f64> = jobs
        .iter()
        .zip(caps)
        .map(|(j, &c)| j.curve.at(Watts(c)).power_w.0)
        .collect();
    let mut out: Vec<f64> = domains
        .iter()
        .map(|d| d.members.iter().map(|&(i, s)| s * power[i]).sum())
        .collect();
    out.push(power.iter().sum());
    out
}

/// The best Σ weight · throughput over every combination of grid caps that fits every
/// limit (and, when `floors`, holds every tier bound), by exhaustive search.
fn exhaustive_best(jobs: &[JobSpec], budget: f64, domains: &[DomainLimit]) -> Option<f64> {
    let grids: Vec<Vec<f64>> = jobs.iter().map(grid).collect();
    let mut index = vec![0usize; jobs.len()];
    let mut best: Option<f64> = None;
    loop {
        let caps: Vec<f64> = index.iter().zip(&grids).map(|(&k, g)| g[k]).collect();
        let used = through(jobs, domains, &caps);
        let fits = used[..domains.len()]
            .iter()
            .zip(domains)
            .all(|(u, d)| *u <= d.limit.0 + 1e-6)
            && used[domains.len()] <= budget + 1e-6;
        let holds = jobs.iter().zip(&caps).all(|(j, &c)| match j.max_slowdown {
            None => true,
            Some(b) => {
                let top = j.curve.at(j.limits.max_w).throughput;
                j.curve.at(Watts(c)).throughput >= (1.0 - b.0) * top - 1e-9
            }
        });
        if fits && holds {
            let value: f64 = jobs
                .iter()
                .zip(&caps)
                .map(|(j, &c)| j.curve.at(Watts(c)).throughput * j.throughput_weight)
                .sum();
            best = Some(best.map_or(value, |b: f64| b.max(value)));
        }
        // Next combination (odometer).
        let mut k = 0;
        loop {
            if k == index.len() {
                return best;
            }
            index[k] += 1;
            if index[k] < grids[k].len() {
                break;
            }
            index[k] = 0;
            k += 1;
        }
    }
}

/// The most one grid step is worth to any job: the greedy may leave up to one step per
/// binding limit unspent when it rounds to the grid.
fn one_step(jobs: &[JobSpec]) -> f64 {
    jobs.iter()
        .flat_map(|j| {
            grid(j)
                .windows(2)
                .map(|w| {
                    (j.curve.at(Watts(w[1])).throughput - j.curve.at(Watts(w[0])).throughput)
                        * j.throughput_weight
                })
                .collect::<Vec<_>>()
        })
        .fold(0.0, f64::max)
}

fn assert_within_limits(a: &Allocation, budget: f64, domains: &[DomainLimit]) {
    assert!(
        a.total_power_w.0 <= budget + 1e-6,
        "site: {} W over a budget of {budget} W",
        a.total_power_w.0
    );
    assert_eq!(a.domains.len(), domains.len());
    for (used, d) in a.domains.iter().zip(domains) {
        assert_eq!(used.name, d.name);
        assert!(
            used.power_w.0 <= d.limit.0 + 1e-6,
            "{}: {} W through a limit of {} W ({:?})",
            d.name,
            used.power_w.0,
            d.limit.0,
            a.policy
        );
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(48))]

    /// On real curves, with every limit binding in turn, the optimal policy keeps within
    /// one grid step per limit of the best any combination of grid caps can do, and no
    /// policy puts more through any domain than its limit.
    #[test]
    fn optimal_matches_exhaustive_search_and_every_policy_holds_every_limit(
        picks in prop::collection::vec(0usize..120, 5),
        rack_a in 0.55f64..1.05,
        rack_b in 0.55f64..1.05,
        row in 0.55f64..1.05,
        site in 0.55f64..1.05,
    ) {
        let curves = dev_curves();
        let jobs: Vec<JobSpec> = picks
            .iter()
            .enumerate()
            .map(|(i, &k)| spec(&curves[k % curves.len()], i, None))
            .collect();
        let domains = tree(&jobs, rack_a, rack_b, row);
        let lowest: f64 = jobs.iter().map(|j| j.curve.at(j.limits.min_w).power_w.0).sum();
        let top: f64 = jobs.iter().map(|j| j.curve.uncapped().power_w.0).sum();
        let budget = (top * site).max(lowest);
        // Limits that every job's lowest cap fits, so a feasible answer exists.
        let domains: Vec<DomainLimit> = domains
            .into_iter()
            .map(|d| {
                let floor: f64 = d
                    .members
                    .iter()
                    .map(|&(i, _)| jobs[i].curve.at(jobs[i].limits.min_w).power_w.0)
                    .sum();
                DomainLimit { limit: Watts(d.limit.0.max(floor)), ..d }
            })
            .collect();
        for policy in [Policy::Optimal, Policy::Equal, Policy::PfiProportional] {
            let a = allocate_within(&jobs, Watts(budget), &domains, policy).expect("allocation");
            assert_within_limits(&a, budget, &domains);
        }
        let optimal = allocate_within(&jobs, Watts(budget), &domains, Policy::Optimal).expect("optimal");
        let best = exhaustive_best(&jobs, budget, &domains).expect("the lowest caps fit");
        let steps = (domains.len() + 1) as f64 * one_step(&jobs);
        prop_assert!(
            optimal.objective >= best - steps - 1e-9,
            "greedy {} < exhaustive {best} by more than {} (one step per limit)",
            optimal.objective,
            steps
        );
        prop_assert!(optimal.objective <= best + 1e-9, "greedy {} beats every grid combination {best}", optimal.objective);
        // Never below the other policies under the same limits.
        for policy in [Policy::Equal, Policy::PfiProportional] {
            let other = allocate_within(&jobs, Watts(budget), &domains, policy).expect("other");
            prop_assert!(optimal.objective + 1e-9 >= other.objective);
        }
    }

    /// The cautious rule the controller runs keeps every limit too.
    #[test]
    fn the_cautious_rule_holds_every_limit(
        picks in prop::collection::vec(0usize..120, 5),
        rack_a in 0.6f64..1.0,
        rack_b in 0.6f64..1.0,
        row in 0.6f64..1.0,
    ) {
        let curves = dev_curves();
        let jobs: Vec<JobSpec> = picks
            .iter()
            .enumerate()
            .map(|(i, &k)| spec(&curves[k % curves.len()], i, Some(0.5)))
            .collect();
        let domains = tree(&jobs, rack_a, rack_b, row);
        let top: f64 = jobs.iter().map(|j| j.curve.uncapped().power_w.0).sum();
        let c = allocate_cautious_within(&jobs, Watts(top), &domains, Caution::default()).expect("cautious");
        if c.allocation.domains.iter().all(|d| d.lowest_over_w.0 == 0.0) {
            assert_within_limits(&c.allocation, top, &domains);
        }
    }
}

/// Limits that do not bind change nothing: the same caps as without domains.
#[test]
fn loose_domains_decide_as_the_flat_site() {
    let curves = dev_curves();
    let jobs: Vec<JobSpec> = (0..5)
        .map(|i| spec(&curves[i * 23], i, Some(0.25)))
        .collect();
    let domains = tree(&jobs, 1.5, 1.5, 1.5);
    let top: f64 = jobs.iter().map(|j| j.curve.uncapped().power_w.0).sum();
    for policy in [Policy::Optimal, Policy::Equal, Policy::PfiProportional] {
        let flat = allocate(&jobs, Watts(top * 0.8), policy).expect("flat");
        let nested = allocate_within(&jobs, Watts(top * 0.8), &domains, policy).expect("nested");
        assert_eq!(
            flat.jobs, nested.jobs,
            "{policy:?}: loose limits moved a cap"
        );
        assert!(nested.domains.iter().all(|d| !d.binds()));
    }
}

/// A rack that cannot pay its jobs' floors: the allocation says that rack binds and by
/// how much, its jobs give way inside it, and the other rack's jobs (and the job outside
/// the row) keep their bounds.
#[test]
fn a_rack_short_of_its_floors_binds_alone() {
    let curves = dev_curves();
    // Every job bound to 10 % slowdown: a rack at 55 % of its uncapped draw cannot pay it
    // on these curves (the lowest caps draw ~40 % of uncapped).
    let jobs: Vec<JobSpec> = (0..5)
        .map(|i| spec(&curves[i * 17 + 3], i, Some(0.10)))
        .collect();
    let domains = tree(&jobs, 0.55, 1.0, 1.0);
    let top: f64 = jobs.iter().map(|j| j.curve.uncapped().power_w.0).sum();
    let a = allocate_within(&jobs, Watts(top), &domains, Policy::Optimal).expect("allocation");
    assert_within_limits(&a, top, &domains);
    let rack_a = &a.domains[0];
    assert_eq!(rack_a.name, "rack-a");
    assert!(rack_a.binds(), "rack-a binds: {rack_a:?}");
    let floors: f64 = (0..2)
        .map(|i| {
            let j = &jobs[i];
            let top_t = j.curve.uncapped().throughput;
            let floor_cap = grid(j)
                .into_iter()
                .find(|&c| j.curve.at(Watts(c)).throughput >= 0.9 * top_t - 1e-9)
                .expect("a floor");
            j.curve.at(Watts(floor_cap)).power_w.0
        })
        .sum();
    assert!(
        (rack_a.floors_over_w.0 - (floors - domains[0].limit.0)).abs() < 1.0,
        "by how much: {} W reported, {} W by hand",
        rack_a.floors_over_w.0,
        floors - domains[0].limit.0
    );
    assert_eq!(rack_a.lowest_over_w, Watts(0.0), "caps alone can meet it");
    assert!(
        a.jobs[..2].iter().any(|j| j.floor.is_broken()),
        "rack-a's jobs gave way: {:?}",
        a.jobs
    );
    for j in &a.jobs[2..] {
        assert_eq!(
            j.floor,
            FloorStatus::Held,
            "{} outside rack-a paid for it",
            j.id
        );
    }
    for other in &a.domains[1..] {
        assert!(!other.binds(), "{} binds: {other:?}", other.name);
    }
}

/// A rack short even with its jobs at their lowest caps: the shortfall is reported on that
/// rack (what only holding a job out of it can meet), not on the site.
#[test]
fn a_rack_below_its_lowest_caps_reports_the_shortfall() {
    let curves = dev_curves();
    let jobs: Vec<JobSpec> = (0..5).map(|i| spec(&curves[i * 11], i, None)).collect();
    let mut domains = tree(&jobs, 1.0, 1.0, 1.0);
    let lowest_b: f64 = (2..4)
        .map(|i| jobs[i].curve.at(jobs[i].limits.min_w).power_w.0)
        .sum();
    domains[1].limit = Watts(lowest_b - 50.0);
    let top: f64 = jobs.iter().map(|j| j.curve.uncapped().power_w.0).sum();
    let a = allocate_within(&jobs, Watts(top), &domains, Policy::Optimal).expect("allocation");
    assert!(
        (a.domains[1].lowest_over_w.0 - 50.0).abs() < 1e-6,
        "{:?}",
        a.domains[1]
    );
    assert_eq!(a.over_budget_w, Watts(0.0), "the site itself is not short");
    for (decided, job) in a.jobs[2..4].iter().zip(&jobs[2..4]) {
        assert_eq!(
            decided.cap_w, job.limits.min_w,
            "rack-b's jobs at their lowest"
        );
    }
}

/// Domains that name a job that is not there, or a share outside (0, 1], are refused with
/// the domain's name.
#[test]
fn malformed_domains_are_refused_by_name() {
    let curves = dev_curves();
    let jobs: Vec<JobSpec> = (0..2).map(|i| spec(&curves[i], i, None)).collect();
    for (members, limit) in [
        (vec![(5usize, 1.0f64)], 100.0f64),
        (vec![(0, 0.0)], 100.0),
        (vec![(0, 1.5)], 100.0),
        (vec![(0, 1.0), (0, 1.0)], 100.0),
        (vec![(0, 1.0)], f64::NAN),
        (vec![(0, 1.0)], -1.0),
    ] {
        let d = DomainLimit {
            name: "pdu-7".into(),
            limit: Watts(limit),
            members,
        };
        let e = allocate_within(&jobs, Watts(1000.0), &[d], Policy::Optimal).expect_err("refused");
        assert!(e.to_string().contains("pdu-7"), "{e}");
    }
}
