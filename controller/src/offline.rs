//! `powerflexctl`'s offline commands: they read files, compute with the core and render a
//! report; no daemon is involved.

use serde::Serialize;

use powerflex_core::curve::CapCurve;
use powerflex_core::curves_csv::{write_curves, JobCurveRecord};
use powerflex_core::evaluate::EvaluateReport;
use powerflex_core::pfi::pfi_on_grid;
use powerflex_core::point::OperatingPoint;
use powerflex_core::rng::SplitMix64;
use powerflex_core::workload::{parse_paper_table, synthetic_record, H200_GRID_4};

use crate::table::Table;
use powerflex_decide::{decide, NodeView, SiteSettings, TierBounds};

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
/// What `powerflexctl allocate` plans with: the controller's own allocation settings, the
/// service of jobs without a tier, the GPUs' cap limits and the noise it assumes.
#[derive(Debug, Clone)]
pub struct AllocateSetup {
    /// The settings the controller would allocate with (tiers, policy, cap step, budget
    /// mode, objective): the decision is `powerflex_decide::decide`'s, the controller's own.
    pub settings: SiteSettings,
    /// Service for jobs whose `tier` cell is empty.
    pub default_service: powerflex_core::flex::Service,
    /// Per-GPU cap limits; `None` = each job's own measured cap range.
    pub limits: Option<powerflex_core::allocate::CapLimits>,
    /// One standard error of a reading, as a fraction of its value, for points the file
    /// gives no `power_sigma_w`/`throughput_sigma` for.
    pub noise: f64,
}

/// The noise `allocate` assumes per reading without `--noise` or uncertainty columns:
/// the controller's own assumption for one measurement window (1 %).
pub const DEFAULT_ALLOCATE_NOISE: f64 = 0.01;

impl AllocateSetup {
    /// Without a site file: the default tiers, unmanaged when no tier is given, each job's
    /// measured cap range in 1 W steps, `policy`, the budget on the jobs' expected draw
    /// (metered, no margin) and total throughput as the objective.
    pub fn defaults(policy: powerflex_core::allocate::Policy) -> AllocateSetup {
        use powerflex_core::config::{BudgetMode, Objective};
        AllocateSetup {
            settings: SiteSettings {
                tiers: powerflex_core::flex::TierTable::default_table(),
                policy,
                cap_step: powerflex_core::Watts(1.0),
                // Reached only by a job without a curve, which a curves file cannot hold.
                failsafe_cap: powerflex_core::Watts(powerflex_core::curves_csv::MAX_CAP_W),
                default_pfi: powerflex_core::config::PredictorConfig::default().pfi_intercept,
                budget_mode: BudgetMode::Metered { margin: 0.0 },
                objective: Objective::Tokens,
                tier_bounds: TierBounds::Honoured,
                domains: None,
            },
            default_service: powerflex_core::flex::Service::Unmanaged,
            limits: None,
            noise: DEFAULT_ALLOCATE_NOISE,
        }
    }

    /// From a validated site config: the controller's settings for `gpu_model` (needed
    /// when the site has several), its default tier and the model's cap limits.
    pub fn from_site(
        site: &powerflex_core::config::SiteConfig,
        gpu_model: Option<&str>,
        policy: Option<powerflex_core::allocate::Policy>,
    ) -> Result<AllocateSetup, crate::CtlError> {
        let names: Vec<&str> = site.gpu_models.iter().map(|m| m.name.as_str()).collect();
        if gpu_model.is_none() && site.gpu_models.len() > 1 {
            return Err(crate::CtlError::Usage(format!(
                "the site config has several GPU models ({}); choose one with --gpu-model",
                names.join(", ")
            )));
        }
        let usage =
            |e: powerflex_decide::DecideError| crate::CtlError::Usage(format!("--gpu-model: {e}"));
        let mut settings = SiteSettings::from_site(site, gpu_model).map_err(usage)?;
        if let Some(policy) = policy {
            settings.policy = policy;
        }
        let model = powerflex_decide::site_gpu_model(site, gpu_model).map_err(usage)?;
        Ok(AllocateSetup {
            settings,
            default_service: site.tiers.default.clone(),
            limits: Some(powerflex_core::allocate::CapLimits {
                min_w: model.min_cap_w,
                max_w: model.max_cap_w,
                step_w: model.cap_step_w,
            }),
            noise: DEFAULT_ALLOCATE_NOISE,
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
    /// Power of the unmanaged jobs, taken off the budget first (as the controller
    /// reserves it in the site's budget mode), W.
    pub unmanaged_power_w: f64,
    /// The relative standard error assumed for points the file gives no uncertainty for.
    pub noise: f64,
    pub total_power_w: f64,
    pub total_throughput: f64,
    pub uncapped_throughput: f64,
    /// Shortfall even with every managed job at its lowest cap, W (0 when feasible).
    pub over_budget_w: f64,
    /// Jobs whose tier bound the budget could not hold.
    pub floors_broken: Vec<String>,
    pub jobs: Vec<AllocateRow>,
}

/// Most GPUs `allocate` plans for across a whole file: twice the 10,000-node × 8-GPU site
/// the controller is sized for. It builds one view per GPU, as the controller holds, so a
/// file of many jobs each claiming the most GPUs a row may name would otherwise cost
/// gigabytes before the first decision.
pub const MAX_ALLOCATE_GPUS: u64 = 160_000;

/// How many GPUs a job without a `gpus` cell has: the fewest whose caps can draw its
/// highest measured power (a reading may run 10 % over its cap while the limit settles).
fn gpus_of(record: &JobCurveRecord) -> u32 {
    record.gpus.unwrap_or_else(|| {
        let top = record.points.last();
        let (cap, power) = top.map_or((1.0, 0.0), |p| (p.cap_w.0, p.power_w.0));
        ((power / (1.1 * cap)).ceil() as u32).clamp(1, powerflex_core::curves_csv::MAX_JOB_GPUS)
    })
}

/// The views the controller would hold if each job of the file ran alone on nodes of its
/// own (at most [`MAX_GPUS_PER_NODE`] GPUs each, the job's power, throughput and variance
/// shared by GPU count), uncapped, with the file's points as its measured curve. Job ids
/// are `j<index>` (a file's names need not be valid Slurm ids).
fn views_of(records: &[JobCurveRecord], tiers: &[String], setup: &AllocateSetup) -> Vec<NodeView> {
    use powerflex_proto::report::{GpuInfo, JobReport, MAX_GPUS_PER_NODE};
    use powerflex_proto::status::CurvePoint;
    use powerflex_proto::usage::ThroughputUnit;
    let mut views = Vec::new();
    for (index, (r, tier)) in records.iter().zip(tiers).enumerate() {
        let (lowest, top) = match (r.points.first(), r.points.last()) {
            (Some(lo), Some(hi)) => (lo, hi),
            _ => continue,
        };
        let (min_w, max_w) = setup
            .limits
            .map_or((lowest.cap_w.0, top.cap_w.0), |l| (l.min_w.0, l.max_w.0));
        let gpus = gpus_of(r);
        // Each point's standard errors: the file's, else `noise` of its values.
        let sigma = |i: usize, p: &powerflex_core::point::OperatingPoint| {
            r.sigma.get(i).map_or(
                (setup.noise * p.power_w.0, setup.noise * p.throughput),
                |s| (s.power_w, s.throughput),
            )
        };
        let mut left = gpus;
        let mut part = 0;
        while left > 0 {
            let here = left.min(MAX_GPUS_PER_NODE as u32);
            left -= here;
            let share = f64::from(here) / f64::from(gpus);
            let sigma_share = share.sqrt();
            let curve: Vec<CurvePoint> = r
                .points
                .iter()
                .enumerate()
                .rev()
                .map(|(i, p)| {
                    let (sp, st) = sigma(i, p);
                    CurvePoint {
                        cap_w: p.cap_w.0,
                        power_w: p.power_w.0 * share,
                        throughput: p.throughput * share,
                        power_sigma_w: sp * sigma_share,
                        throughput_sigma: st * sigma_share,
                        windows: 1,
                    }
                })
                .collect();
            let node = format!("offline-{index}-{part}");
            views.push(NodeView {
                gpus: (0..here)
                    .map(|g| GpuInfo {
                        uuid: format!("{node}-gpu{g}"),
                        name: "from the curves file".into(),
                        min_w,
                        max_w,
                        default_w: max_w,
                    })
                    .collect(),
                jobs: vec![JobReport {
                    job_id: format!("j{index}"),
                    tier: tier.clone(),
                    gpus: here,
                    cap_w: Some(max_w),
                    power_w: Some(top.power_w.0 * share),
                    throughput: Some(top.throughput * share),
                    throughput_unit: Some(ThroughputUnit::Tokens),
                    points: r
                        .points
                        .iter()
                        .map(|p| OperatingPoint {
                            cap_w: p.cap_w,
                            power_w: powerflex_core::Watts(p.power_w.0 * share),
                            throughput: p.throughput * share,
                        })
                        .collect(),
                    power_cap_w: Some(max_w),
                    power_cap_steady_s: Some(f64::from(u32::MAX)),
                    curve,
                    ..JobReport::default()
                }],
                power_w: top.power_w.0 * share,
                live: true,
                node,
            });
            part += 1;
        }
    }
    views
}

/// Allocates `budget_w` across the jobs of a curves file, the way the controller would:
/// `powerflex_decide::decide` on views of the jobs running uncapped with the file's points as their
/// measured curves (the same estimator, the same cautious rule, the same budget
/// accounting), with the points' uncertainty from the file or `setup.noise`.
pub fn allocate_curves(
    records: &[JobCurveRecord],
    budget: powerflex_core::Watts,
    setup: &AllocateSetup,
) -> Result<AllocateReport, crate::CtlError> {
    use powerflex_core::allocate::FloorStatus;
    use powerflex_core::flex::{parse_power_flex, Calibrate, FlexRequest, Service};

    let mut services = Vec::with_capacity(records.len());
    for r in records {
        let service = match &r.tier {
            Some(text) => {
                parse_power_flex(text, &setup.settings.tiers)
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
    let total_gpus: u64 = records.iter().map(|r| u64::from(gpus_of(r))).sum();
    if total_gpus > MAX_ALLOCATE_GPUS {
        return Err(crate::CtlError::Usage(format!(
            "the file's jobs have {total_gpus} GPUs in all; allocate plans at most {MAX_ALLOCATE_GPUS} (a `gpus` cell, or a job's highest power over its highest cap, counts them)"
        )));
    }
    let tiers: Vec<String> = services
        .iter()
        .map(|service| {
            FlexRequest {
                service: service.clone(),
                calibrate: Calibrate::Auto,
                preempt: None,
            }
            .to_string()
        })
        .collect();
    let views = views_of(records, &tiers, setup);
    let decision = decide(&views, budget, &setup.settings);
    if let Some(refused) = decision.rejected.first() {
        let job = refused
            .job
            .as_deref()
            .and_then(|id| id.strip_prefix('j'))
            .and_then(|i| i.parse::<usize>().ok())
            .and_then(|i| records.get(i))
            .map_or_else(|| refused.node.clone(), |r| r.job.clone());
        return Err(crate::CtlError::Usage(format!(
            "job \"{job}\" cannot be planned: {}",
            refused.reason
        )));
    }
    let allocated: std::collections::BTreeMap<&str, &powerflex_core::allocate::JobAllocation> =
        decision
            .allocation
            .iter()
            .flat_map(|a| a.jobs.iter())
            .map(|j| (j.id.as_str(), j))
            .collect();
    let mut rows = Vec::with_capacity(records.len());
    let (mut total_power, mut total_t, mut uncapped_t) = (decision.reserved_w, 0.0, 0.0);
    for (index, ((r, service), tier)) in records.iter().zip(&services).zip(tiers).enumerate() {
        let top = r.points.last().copied();
        let (top_cap, top_power, t_top) =
            top.map_or((0.0, 0.0, 0.0), |p| (p.cap_w.0, p.power_w.0, p.throughput));
        let id = format!("j{index}");
        match (service, allocated.get(id.as_str())) {
            (Service::Bounded { .. }, Some(a)) => {
                total_power += a.power_w.0;
                total_t += a.throughput;
                // The slowdown is against the estimated curve's uncapped throughput.
                let uncapped = if a.slowdown < 1.0 {
                    a.throughput / (1.0 - a.slowdown)
                } else {
                    t_top
                };
                uncapped_t += uncapped;
                let (floor, excess) = match a.floor {
                    FloorStatus::None => ("none", None),
                    FloorStatus::Held => ("held", None),
                    FloorStatus::Broken { excess } => ("broken", Some(excess)),
                };
                rows.push(AllocateRow {
                    job: r.job.clone(),
                    tier,
                    gpus: Some(gpus_of(r)),
                    cap_w: a.cap_w.0,
                    power_w: a.power_w.0,
                    throughput: a.throughput,
                    uncapped_throughput: uncapped,
                    slowdown: a.slowdown,
                    max_slowdown: a.max_slowdown.map(|b| b.0),
                    floor,
                    floor_excess: excess,
                });
            }
            _ => {
                // Unmanaged (or nothing the controller would steer): it runs uncapped and
                // its power came off the budget first (`reserved_w`).
                total_t += t_top;
                uncapped_t += t_top;
                rows.push(AllocateRow {
                    job: r.job.clone(),
                    tier,
                    gpus: Some(gpus_of(r)),
                    cap_w: top_cap,
                    power_w: top_power,
                    throughput: t_top,
                    uncapped_throughput: t_top,
                    slowdown: 0.0,
                    max_slowdown: None,
                    floor: "none",
                    floor_excess: None,
                });
            }
        }
    }
    let over_budget = decision
        .allocation
        .as_ref()
        .map_or(0.0, |a| a.over_budget_w.0)
        + (decision.reserved_w - budget.0).max(0.0);
    Ok(AllocateReport {
        policy: setup.settings.policy.name().to_string(),
        budget_w: budget.0,
        unmanaged_power_w: decision.reserved_w,
        noise: setup.noise,
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
