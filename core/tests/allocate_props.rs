//! Invariants of the allocator on random job sets: what an admin relies on whatever the
//! curves look like.

use powerflex_core::allocate::{allocate, CapLimits, FloorStatus, JobSpec, Policy};
use powerflex_core::curve::CapCurve;
use powerflex_core::point::OperatingPoint;
use powerflex_core::units::{SlowdownFraction, Watts};
use proptest::prelude::*;

/// A random job: `caps` measured caps between 200 and 700 W per GPU, power following the
/// cap below a random uncapped draw, throughput rising with power (optionally with bumps,
/// to exercise non-concave curves).
fn job_strategy() -> impl Strategy<Value = JobSpec> {
    (
        1u32..=16,                                 // gpus
        300.0f64..=700.0,                          // uncapped draw per GPU
        prop::collection::vec(0.0f64..1.0, 2..=6), // throughput shape increments
        prop::option::of(prop::sample::select(vec![0.0, 0.10, 0.25, 0.50])),
        prop::sample::select(vec![1.0, 5.0, 10.0, 25.0]),
        100.0f64..100_000.0, // uncapped throughput
        any::<bool>(),       // normalised objective
    )
        .prop_map(|(gpus, uncapped, shape, bound, step, t_max, normalised)| {
            let n = shape.len() + 1;
            let caps: Vec<f64> = (0..n)
                .map(|i| 200.0 + 500.0 * i as f64 / (n - 1) as f64)
                .collect();
            let total: f64 = shape.iter().sum::<f64>().max(1e-6);
            let mut t = 0.2 * t_max;
            let mut points = vec![OperatingPoint {
                cap_w: Watts(caps[0]),
                power_w: Watts(caps[0].min(uncapped) * 0.985 * f64::from(gpus)),
                throughput: t,
            }];
            for (i, inc) in shape.iter().enumerate() {
                t += 0.8 * t_max * inc / total;
                let c = caps[i + 1];
                points.push(OperatingPoint {
                    cap_w: Watts(c),
                    power_w: Watts((c * 0.985).min(uncapped) * f64::from(gpus)),
                    throughput: t,
                });
            }
            let curve = CapCurve::from_points(&points).expect("valid curve");
            JobSpec {
                id: format!("job{gpus}-{uncapped:.0}"),
                gpus,
                throughput_weight: if normalised { 1.0 / t } else { 1.0 },
                curve,
                max_slowdown: bound.map(SlowdownFraction),
                limits: CapLimits {
                    min_w: Watts(200.0),
                    max_w: Watts(700.0),
                    step_w: Watts(step),
                },
            }
        })
}

fn jobs_and_budget() -> impl Strategy<Value = (Vec<JobSpec>, f64)> {
    prop::collection::vec(job_strategy(), 1..40).prop_flat_map(|jobs| {
        let max: f64 = jobs.iter().map(|j| j.curve.uncapped().power_w.0).sum();
        let min: f64 = jobs.iter().map(|j| j.curve.lowest().power_w.0).sum();
        (Just(jobs), (min * 0.8)..=(max * 1.05))
    })
}

fn on_grid(cap: f64, limits: &CapLimits) -> bool {
    let k = (cap - limits.min_w.0) / limits.step_w.0;
    (k - k.round()).abs() < 1e-6 || (cap - limits.max_w.0).abs() < 1e-9
}

fn floor_power(job: &JobSpec) -> f64 {
    // Power at the lowest grid cap where the bound holds on this curve.
    let Some(bound) = job.max_slowdown else {
        return job.curve.at(job.limits.min_w).power_w.0;
    };
    let top = job.curve.at(job.limits.max_w).throughput;
    let mut cap = job.limits.min_w.0;
    while cap < job.limits.max_w.0 {
        if job.curve.at(Watts(cap)).throughput >= (1.0 - bound.0) * top - 1e-9 {
            // monotone test curves: the first cap that holds is the floor
            return job.curve.at(Watts(cap)).power_w.0;
        }
        cap += job.limits.step_w.0;
    }
    job.curve.at(job.limits.max_w).power_w.0
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    #[test]
    fn power_within_budget_and_caps_on_grid((jobs, budget) in jobs_and_budget(),
                                            policy in prop::sample::select(vec![Policy::Optimal, Policy::Equal, Policy::PfiProportional])) {
        let a = allocate(&jobs, Watts(budget), policy).expect("allocation");
        prop_assert_eq!(a.jobs.len(), jobs.len());
        if a.over_budget_w.0 == 0.0 {
            prop_assert!(a.total_power_w.0 <= budget * (1.0 + 1e-9) + 1e-6,
                "power {} over budget {}", a.total_power_w.0, budget);
        }
        for (job, decided) in jobs.iter().zip(&a.jobs) {
            prop_assert!(decided.cap_w.0 >= job.limits.min_w.0 - 1e-9);
            prop_assert!(decided.cap_w.0 <= job.limits.max_w.0 + 1e-9);
            prop_assert!(on_grid(decided.cap_w.0, &job.limits), "cap {} off grid {:?}", decided.cap_w.0, job.limits);
        }
    }

    #[test]
    fn floors_hold_whenever_the_budget_pays_for_them((jobs, budget) in jobs_and_budget(),
                                                     policy in prop::sample::select(vec![Policy::Optimal, Policy::Equal, Policy::PfiProportional])) {
        let floors: f64 = jobs.iter().map(floor_power).sum();
        let a = allocate(&jobs, Watts(budget), policy).expect("allocation");
        if floors <= budget * (1.0 - 1e-9) {
            for j in &a.jobs {
                prop_assert!(!matches!(j.floor, FloorStatus::Broken { .. }), "{} broken with budget {} ≥ floors {}", j.id, budget, floors);
            }
        }
    }

    #[test]
    fn lower_tiers_give_way_first((jobs, budget) in jobs_and_budget()) {
        let a = allocate(&jobs, Watts(budget), Policy::Optimal).expect("allocation");
        for (broken_job, broken) in jobs.iter().zip(&a.jobs) {
            let (FloorStatus::Broken { .. }, Some(bound)) = (broken.floor, broken_job.max_slowdown) else { continue };
            // Every job that tolerates more slowdown is already at its lowest cap.
            for (job, decided) in jobs.iter().zip(&a.jobs) {
                if let Some(other) = job.max_slowdown {
                    if other.0 > bound.0 {
                        let lowest = job.limits.min_w.0.max(job.curve.lowest().cap_w.0);
                        prop_assert!(decided.cap_w.0 <= lowest + job.limits.step_w.0 + 1e-9,
                            "{} (bound {}) at {} W while {} (bound {}) is broken", job.id, other.0, decided.cap_w.0, broken.id, bound.0);
                    }
                }
            }
        }
    }

    #[test]
    fn optimal_never_below_the_other_policies((jobs, budget) in jobs_and_budget()) {
        let optimal = allocate(&jobs, Watts(budget), Policy::Optimal).expect("optimal");
        let equal = allocate(&jobs, Watts(budget), Policy::Equal).expect("equal");
        let pfi = allocate(&jobs, Watts(budget), Policy::PfiProportional).expect("pfi");
        let slack = 1e-9 * optimal.objective.abs().max(1.0);
        prop_assert!(optimal.objective + slack >= equal.objective, "optimal {} < equal {}", optimal.objective, equal.objective);
        prop_assert!(optimal.objective + slack >= pfi.objective, "optimal {} < pfi {}", optimal.objective, pfi.objective);
    }

    #[test]
    fn deterministic((jobs, budget) in jobs_and_budget()) {
        let a = allocate(&jobs, Watts(budget), Policy::Optimal).expect("a");
        let b = allocate(&jobs, Watts(budget), Policy::Optimal).expect("b");
        prop_assert_eq!(a, b);
    }
}

/// The greedy is optimal up to the rounding of one job to the cap grid: exhaustive search
/// over every combination of caps of three jobs never beats it by more than one cap
/// step's worth of throughput of one job.
#[test]
fn matches_exhaustive_search_on_small_cases() {
    let curve = |pfi: f64, gpus: u32| {
        CapCurve::from_pfi_prior(
            Watts(690.0 * f64::from(gpus)),
            1000.0,
            pfi,
            Watts(200.0),
            Watts(700.0),
            Watts(100.0),
        )
        .expect("prior")
    };
    let jobs: Vec<JobSpec> = [(1.1, 8), (1.6, 4), (2.5, 8)]
        .iter()
        .enumerate()
        .map(|(i, &(pfi, gpus))| JobSpec {
            id: format!("j{i}"),
            gpus,
            curve: curve(pfi, gpus),
            max_slowdown: None,
            limits: CapLimits {
                min_w: Watts(200.0),
                max_w: Watts(700.0),
                step_w: Watts(100.0),
            },
            throughput_weight: 1.0,
        })
        .collect();
    let caps = [200.0, 300.0, 400.0, 500.0, 600.0, 700.0];
    let total: f64 = jobs.iter().map(|j| j.curve.uncapped().power_w.0).sum();
    for cut in [0.1, 0.2, 0.3, 0.4, 0.5] {
        let budget = total * (1.0 - cut);
        let mut best = f64::MIN;
        for a in caps {
            for b in caps {
                for c in caps {
                    let chosen = [a, b, c];
                    let power: f64 = jobs
                        .iter()
                        .zip(chosen)
                        .map(|(j, c)| j.curve.at(Watts(c)).power_w.0)
                        .sum();
                    if power <= budget {
                        let value: f64 = jobs
                            .iter()
                            .zip(chosen)
                            .map(|(j, c)| j.curve.at(Watts(c)).throughput)
                            .sum();
                        best = best.max(value);
                    }
                }
            }
        }
        let one_step: f64 = jobs
            .iter()
            .flat_map(|j| {
                caps.windows(2).map(|w| {
                    j.curve.at(Watts(w[1])).throughput - j.curve.at(Watts(w[0])).throughput
                })
            })
            .fold(0.0, f64::max);
        let got = allocate(&jobs, Watts(budget), Policy::Optimal).expect("allocation");
        assert!(got.total_power_w.0 <= budget + 1e-6);
        assert!(
            got.objective >= best - one_step,
            "cut {cut}: greedy {} < exhaustive {best} by more than one step ({one_step})",
            got.objective
        );
    }
}
