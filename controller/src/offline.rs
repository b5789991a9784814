//! `powerflexctl`'s offline commands: they read files, compute with the core and render a
//! report; no daemon is involved.

use serde::Serialize;

use powerflex_core::curve::CapCurve;
use powerflex_core::curves_csv::{write_curves, JobCurveRecord};
use powerflex_core::evaluate::EvaluateReport;
use powerflex_core::pfi::pfi_on_grid;
use powerflex_core::rng::SplitMix64;
use powerflex_core::workload::{parse_paper_table, synthetic_record, H200_GRID_4};

use crate::table::Table;

/// One job's row in `powerflexctl pfi`.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct PfiRow {
    pub job: String,
    pub gpus: Option<u32>,
    /// Caps measured, W per GPU, ascending.
    pub caps_w: Vec<f64>,
    /// Uncapped (highest-cap) power, W.
    pub p_max_w: f64,
    /// Uncapped throughput, in the file's unit.
    pub t_max: f64,
    /// PFI on every measured cap (Eq. 1); null when undefined.
    pub pfi: Option<f64>,
    /// PFI on the paper's 4-cap grid (200/500/600/700 W) when those caps were measured.
    pub pfi_4cap: Option<f64>,
}

/// PFI per job, in file order.
pub fn pfi_rows(records: &[JobCurveRecord]) -> Vec<PfiRow> {
    records
        .iter()
        .map(|r| {
            let caps_w: Vec<f64> = r.points.iter().map(|p| p.cap_w.0).collect();
            let top = r.points.last().copied();
            let has_4cap = H200_GRID_4
                .iter()
                .all(|c| caps_w.iter().any(|m| (m - c).abs() < 0.5));
            PfiRow {
                job: r.job.clone(),
                gpus: r.gpus,
                p_max_w: top.map_or(0.0, |p| p.power_w.0),
                t_max: top.map_or(0.0, |p| p.throughput),
                pfi: powerflex_core::pfi::pfi(&r.points),
                pfi_4cap: if has_4cap {
                    pfi_on_grid(&r.points, &H200_GRID_4)
                } else {
                    None
                },
                caps_w,
            }
        })
        .collect()
}

fn opt(value: Option<f64>, decimals: usize) -> String {
    value.map_or("-".to_string(), |v| format!("{v:.decimals$}"))
}

/// Human table for `pfi`.
pub fn render_pfi(rows: &[PfiRow]) -> String {
    let mut t = Table::new(["job", "gpus", "caps", "P_max", "T_max", "PFI", "PFI(4cap)"]);
    for r in rows {
        let caps: Vec<String> = r.caps_w.iter().map(|c| format!("{c:.0}")).collect();
        t.row([
            r.job.clone(),
            r.gpus.map_or("-".to_string(), |g| g.to_string()),
            caps.join("/"),
            format!("{:.0} W", r.p_max_w),
            format!("{:.1}", r.t_max),
            opt(r.pfi, 2),
            opt(r.pfi_4cap, 2),
        ]);
    }
    t.render()
}

/// Human rendering of an evaluation.
pub fn render_evaluate(report: &EvaluateReport) -> String {
    let unit = if report.throughput == "raw" {
        "Σ tokens/s per workload"
    } else {
        "Σ T/T_max per workload"
    };
    let mut out = format!(
        "cut {:.0}% of Σ P_max, {} workloads × {} jobs, noise {:.1}% per window, {} calibration, seed {} ({unit})\n",
        report.cut * 100.0,
        report.workloads,
        report.jobs_per_workload,
        report.noise * 100.0,
        report.calibration,
        report.seed
    );
    let mut t = Table::new([
        "policy",
        "throughput",
        "vs equal",
        "gap (attainable)",
        "gap (power space)",
        "power/budget",
        "violations",
    ]);
    let pct = |g: Option<f64>| g.map_or("-".to_string(), |g| format!("{:.1}%", g * 100.0));
    /// policy, throughput, gap vs attainable, gap vs power space, power/budget, violations
    type Row<'a> = (&'a str, f64, Option<f64>, Option<f64>, f64, Option<usize>);
    let rows: [Row<'_>; 5] = [
        (
            "equal",
            report.equal,
            Some(0.0),
            Some(0.0),
            report.power_over_budget.equal,
            Some(report.budget_violations.equal),
        ),
        (
            "pfi_proportional",
            report.pfi_proportional,
            report.gap_recovered.pfi_proportional,
            report.gap_recovered_vs_power_space.pfi_proportional,
            report.power_over_budget.pfi_proportional,
            Some(report.budget_violations.pfi_proportional),
        ),
        (
            "optimal_calibrated",
            report.optimal_calibrated,
            report.gap_recovered.optimal_calibrated,
            report.gap_recovered_vs_power_space.optimal_calibrated,
            report.power_over_budget.optimal_calibrated,
            Some(report.budget_violations.optimal_calibrated),
        ),
        (
            "oracle (attainable)",
            report.oracle,
            Some(1.0),
            report.gap_recovered_vs_power_space.oracle,
            report.power_over_budget.oracle,
            Some(report.budget_violations.oracle),
        ),
        (
            "power-space optimum",
            report.power_space_optimum,
            None,
            Some(1.0),
            f64::NAN,
            None,
        ),
    ];
    for (name, value, gap, gap_space, power, violations) in rows {
        let vs_equal = if report.equal > 0.0 {
            format!("{:+.2}%", (value / report.equal - 1.0) * 100.0)
        } else {
            "-".to_string()
        };
        t.row([
            name.to_string(),
            format!("{value:.3}"),
            vs_equal,
            pct(gap),
            pct(gap_space),
            if power.is_finite() {
                format!("{power:.4}")
            } else {
                "-".to_string()
            },
            violations.map_or("-".to_string(), |v| v.to_string()),
        ]);
    }
    out.push_str(&t.render());
    let c = &report.calibration_cost;
    out.push_str(&format!(
        "calibration: {:.2} capped levels, {:.0} s per job; token cost {:.2}% of first-hour tokens on average, {:.2}% at most{}\n",
        c.mean_levels,
        c.mean_seconds,
        c.mean_fraction * 100.0,
        c.max_fraction * 100.0,
        c.budget_fraction
            .map_or(String::new(), |b| format!(" (budget {:.1}%)", b * 100.0))
    ));
    if report.kept_equal_workloads > 0 {
        out.push_str(&format!(
            "{} workload(s) kept the equal split: the optimal caps' expected gain was within its uncertainty\n",
            report.kept_equal_workloads
        ));
    }
    if report.infeasible_workloads > 0 {
        out.push_str(&format!(
            "{} workload(s) infeasible (budget below every job at its lowest cap), left out of the means\n",
            report.infeasible_workloads
        ));
    }
    if !report.events.is_empty() {
        let mut e = Table::new([
            "event",
            "optimal_calibrated",
            "gap (attainable)",
            "violations",
            "kept equal",
            "probe cost",
        ]);
        for row in &report.events {
            e.row([
                row.event.to_string(),
                format!("{:.3}", row.optimal_calibrated),
                pct(row.gap_recovered),
                row.budget_violations.to_string(),
                row.kept_equal.to_string(),
                format!("{:.3}%", row.probe_cost_fraction * 100.0),
            ]);
        }
        out.push_str(
            "\nlearning over events (each event's caps from everything measured before it):\n",
        );
        out.push_str(&e.render());
    }
    out
}

/// Synthetic curves for the paper's jobs (`synth-curves`): each job's fitted physics on
/// the caps the paper measured it at, with `noise` multiplicative measurement noise.
pub fn synth_curves(
    paper_csv: &str,
    noise: f64,
    seed: u64,
) -> Result<String, powerflex_core::Error> {
    let jobs = parse_paper_table(paper_csv)?;
    let mut rng = SplitMix64::new(seed);
    let records: Vec<JobCurveRecord> = jobs
        .iter()
        .map(|j| synthetic_record(j, noise, &mut rng))
        .collect();
    let mut out = format!(
        "# SIMULATED curves: powerflex's physics model fitted to the PFI of each job in the\n\
         # paper's table (arXiv 2609.11542), on the caps the paper measured, with {:.1}%\n\
         # measurement noise (seed {seed}). Not measurements.\n",
        noise * 100.0
    );
    out.push_str(&write_curves(&records));
    Ok(out)
}

/// The curve a record describes, taken as exact.
pub fn record_curve(record: &JobCurveRecord) -> Result<CapCurve, powerflex_core::Error> {
    Ok(CapCurve::from_points(&record.points)?)
}

/// Where `allocate` takes tiers, limits and the policy from.
#[derive(Debug, Clone)]
pub struct AllocateSetup {
    pub tiers: powerflex_core::flex::TierTable,
    /// Service for jobs whose `tier` cell is empty.
    pub default_service: powerflex_core::flex::Service,
    /// Per-GPU cap limits; `None` = each job's own measured cap range, 1 W steps.
    pub limits: Option<powerflex_core::allocate::CapLimits>,
    pub policy: powerflex_core::allocate::Policy,
}

impl AllocateSetup {
    /// Without a site file: the default tiers, unmanaged when no tier is given, each job's
    /// measured cap range, `policy`.
    pub fn defaults(policy: powerflex_core::allocate::Policy) -> AllocateSetup {
        AllocateSetup {
            tiers: powerflex_core::flex::TierTable::default_table(),
            default_service: powerflex_core::flex::Service::Unmanaged,
            limits: None,
            policy,
        }
    }

    /// From a validated site config; `gpu_model` picks the cap limits when the site has
    /// several models.
    pub fn from_site(
        site: &powerflex_core::config::SiteConfig,
        gpu_model: Option<&str>,
        policy: Option<powerflex_core::allocate::Policy>,
    ) -> Result<AllocateSetup, crate::CtlError> {
        let names: Vec<&str> = site.gpu_models.iter().map(|m| m.name.as_str()).collect();
        let model = match gpu_model {
            Some(name) => site
                .gpu_models
                .iter()
                .find(|m| m.name.eq_ignore_ascii_case(name))
                .ok_or_else(|| {
                    crate::CtlError::Usage(format!(
                        "--gpu-model \"{name}\" is not in the site config; it has: {}",
                        names.join(", ")
                    ))
                })?,
            None => match site.gpu_models.as_slice() {
                [only] => only,
                _ => {
                    return Err(crate::CtlError::Usage(format!(
                        "the site config has several GPU models ({}); choose one with --gpu-model",
                        names.join(", ")
                    )))
                }
            },
        };
        Ok(AllocateSetup {
            tiers: site.tiers.table.clone(),
            default_service: site.tiers.default.clone(),
            limits: Some(powerflex_core::allocate::CapLimits {
                min_w: model.min_cap_w,
                max_w: model.max_cap_w,
                step_w: model.cap_step_w,
            }),
            policy: policy.unwrap_or(site.facility.policy),
        })
    }
}

/// One job's line in `powerflexctl allocate`.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct AllocateRow {
    pub job: String,
    /// The job's service as written back in `--power-flex` form (`flex2`, `none`, …).
    pub tier: String,
    pub gpus: Option<u32>,
    /// Per-GPU cap, W.
    pub cap_w: f64,
    /// Expected summed power at that cap, W.
    pub power_w: f64,
    /// Expected throughput at that cap, in the file's unit.
    pub throughput: f64,
    /// Throughput when uncapped.
    pub uncapped_throughput: f64,
    /// 1 − throughput / uncapped throughput.
    pub slowdown: f64,
    /// The tier's bound (fraction), absent for unmanaged jobs.
    pub max_slowdown: Option<f64>,
    /// "held", "broken" or "none" (no bound).
    pub floor: &'static str,
    /// How far the slowdown exceeds the bound (fraction), when broken.
    pub floor_excess: Option<f64>,
}

/// The whole `allocate` report.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct AllocateReport {
    pub policy: String,
    pub budget_w: f64,
    /// Power of the unmanaged jobs, taken off the budget first, W.
    pub unmanaged_power_w: f64,
    pub total_power_w: f64,
    pub total_throughput: f64,
    pub uncapped_throughput: f64,
    /// Shortfall even with every managed job at its lowest cap, W (0 when feasible).
    pub over_budget_w: f64,
    /// Jobs whose tier bound the budget could not hold.
    pub floors_broken: Vec<String>,
    pub jobs: Vec<AllocateRow>,
}

/// Allocates `budget_w` across the jobs of a curves file.
pub fn allocate_curves(
    records: &[JobCurveRecord],
    budget: powerflex_core::Watts,
    setup: &AllocateSetup,
) -> Result<AllocateReport, crate::CtlError> {
    use powerflex_core::allocate::{allocate, CapLimits, FloorStatus, JobSpec};
    use powerflex_core::flex::{parse_power_flex, Service};

    let mut services = Vec::with_capacity(records.len());
    for r in records {
        let service = match &r.tier {
            Some(text) => {
                parse_power_flex(text, &setup.tiers)
                    .map_err(|source| crate::CtlError::BadTier {
                        job: r.job.clone(),
                        source,
                    })?
                    .service
            }
            None => setup.default_service.clone(),
        };
        services.push(service);
    }
    let mut specs = Vec::new();
    let mut unmanaged_power = 0.0;
    for (r, service) in records.iter().zip(&services) {
        let curve = CapCurve::from_points(&r.points).map_err(powerflex_core::Error::from)?;
        let limits = setup.limits.unwrap_or(CapLimits {
            min_w: curve.lowest().cap_w,
            max_w: curve.uncapped().cap_w,
            step_w: powerflex_core::Watts(1.0),
        });
        match service {
            Service::Unmanaged => {
                unmanaged_power += curve.at(limits.max_w).power_w.0;
            }
            Service::Bounded { max_slowdown, .. } => specs.push(JobSpec {
                id: r.job.clone(),
                gpus: r.gpus.unwrap_or(1),
                curve,
                max_slowdown: Some(*max_slowdown),
                limits,
                throughput_weight: 1.0,
            }),
        }
    }
    let managed_budget = powerflex_core::Watts((budget.0 - unmanaged_power).max(0.0));
    let allocation =
        allocate(&specs, managed_budget, setup.policy).map_err(powerflex_core::Error::from)?;
    let mut by_id = allocation.jobs.iter().zip(&specs);
    let mut rows = Vec::with_capacity(records.len());
    let (mut total_power, mut total_t, mut uncapped_t) = (unmanaged_power, 0.0, 0.0);
    for (r, service) in records.iter().zip(&services) {
        let tier = powerflex_core::flex::FlexRequest {
            service: service.clone(),
            calibrate: powerflex_core::flex::Calibrate::Auto,
            preempt: None,
        }
        .to_string();
        let top = r.points.last().copied();
        let t_top = top.map_or(0.0, |p| p.throughput);
        uncapped_t += t_top;
        match service {
            Service::Unmanaged => {
                total_t += t_top;
                rows.push(AllocateRow {
                    job: r.job.clone(),
                    tier,
                    gpus: r.gpus,
                    cap_w: top.map_or(0.0, |p| p.cap_w.0),
                    power_w: top.map_or(0.0, |p| p.power_w.0),
                    throughput: t_top,
                    uncapped_throughput: t_top,
                    slowdown: 0.0,
                    max_slowdown: None,
                    floor: "none",
                    floor_excess: None,
                });
            }
            Service::Bounded { .. } => {
                let Some((a, spec)) = by_id.next() else {
                    continue;
                };
                total_power += a.power_w.0;
                total_t += a.throughput;
                let (floor, excess) = match a.floor {
                    FloorStatus::None => ("none", None),
                    FloorStatus::Held => ("held", None),
                    FloorStatus::Broken { excess } => ("broken", Some(excess)),
                };
                rows.push(AllocateRow {
                    job: a.id.clone(),
                    tier,
                    gpus: r.gpus,
                    cap_w: a.cap_w.0,
                    power_w: a.power_w.0,
                    throughput: a.throughput,
                    uncapped_throughput: spec.curve.at(spec.limits.max_w).throughput,
                    slowdown: a.slowdown,
                    max_slowdown: a.max_slowdown.map(|b| b.0),
                    floor,
                    floor_excess: excess,
                });
            }
        }
    }
    let over_budget = allocation.over_budget_w.0 + (unmanaged_power - budget.0).max(0.0);
    Ok(AllocateReport {
        policy: setup.policy.name().to_string(),
        budget_w: budget.0,
        unmanaged_power_w: unmanaged_power,
        total_power_w: total_power,
        total_throughput: total_t,
        uncapped_throughput: uncapped_t,
        over_budget_w: over_budget,
        floors_broken: rows
            .iter()
            .filter(|r| r.floor == "broken")
            .map(|r| r.job.clone())
            .collect(),
        jobs: rows,
    })
}

/// Human rendering of `allocate`.
pub fn render_allocate(report: &AllocateReport) -> String {
    use powerflex_core::Watts;
    let mut t = Table::new([
        "job",
        "tier",
        "gpus",
        "cap",
        "power",
        "throughput",
        "slowdown",
        "bound",
        "floor",
    ]);
    for r in &report.jobs {
        t.row([
            r.job.clone(),
            r.tier.clone(),
            r.gpus.map_or("-".to_string(), |g| g.to_string()),
            format!("{:.0} W", r.cap_w),
            Watts(r.power_w).to_string(),
            format!("{:.1}", r.throughput),
            format!("{:.1}%", r.slowdown * 100.0),
            r.max_slowdown
                .map_or("-".to_string(), |b| format!("{:.0}%", b * 100.0)),
            match r.floor_excess {
                Some(e) => format!("BROKEN by {:.1}%", e * 100.0),
                None => r.floor.to_string(),
            },
        ]);
    }
    let mut out = t.render();
    let kept = if report.uncapped_throughput > 0.0 {
        report.total_throughput / report.uncapped_throughput * 100.0
    } else {
        100.0
    };
    out.push_str(&format!(
        "\npolicy {}: budget {}, draw {} ({} unmanaged), throughput {:.1} of {:.1} uncapped ({kept:.1}% kept)\n",
        report.policy,
        Watts(report.budget_w),
        Watts(report.total_power_w),
        Watts(report.unmanaged_power_w),
        report.total_throughput,
        report.uncapped_throughput,
    ));
    if report.over_budget_w > 0.0 {
        out.push_str(&format!(
            "BUDGET INFEASIBLE: short by {} with every managed job at its lowest cap\n",
            Watts(report.over_budget_w)
        ));
    }
    if !report.floors_broken.is_empty() {
        out.push_str(&format!(
            "TIER BOUNDS BROKEN for {} job(s): {}\n",
            report.floors_broken.len(),
            report.floors_broken.join(", ")
        ));
    }
    out
}
