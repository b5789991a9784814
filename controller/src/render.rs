//! Tables for people from the controller's typed answers: `powerflexctl status`, `jobs`,
//! `nodes`, `report`, `what-if` and `event list`. Pure: typed values in, text out.

use std::collections::BTreeMap;

use powerflex_core::allocate::FloorStatus;
use powerflex_core::point::OperatingPoint;
use powerflex_core::Watts;
use powerflex_proto::event::{Cut, Event};
use powerflex_proto::status::{CtldStatus, DecisionView, DomainStatus, NodeStatus, SiteJobStatus};
use powerflex_proto::usage::JobEnergyRecord;

use crate::table::Table;
use powerflex_controller_machine::schedule::{duration_text, utc_text};

fn watts(w: f64) -> String {
    Watts(w).to_string()
}

fn cap(w: Option<f64>) -> String {
    w.map_or("-".into(), |c| format!("{c:.0} W"))
}

fn whole(x: Option<f64>) -> String {
    x.map_or("-".into(), |t| format!("{t:.0}"))
}

/// A tier bound's state as a table cell: BROKEN stands out.
fn bound(floor: Option<&FloorStatus>) -> String {
    match floor {
        Some(FloorStatus::Broken { excess }) => format!("BROKEN by {:.1}%", excess * 100.0),
        Some(FloorStatus::Held) => "held".into(),
        Some(FloorStatus::None) => "none".into(),
        None => "-".into(),
    }
}

/// A cut as an operator reads it, saying what it is a share of: `30 % of the base
/// budget` (of the site's, or of the domain's its event names) or `down to 600 kW`.
fn cut_text(event: &Event) -> String {
    match event.cut {
        Cut::Reduce { fraction } => format!("{} of the base budget", share_text(fraction)),
        Cut::Target { budget_w } => format!("down to {}", Watts(budget_w)),
    }
}

/// A share as a percentage to two decimals, without trailing zeros: `30 %`, `12.5 %`.
pub fn share_text(fraction: f64) -> String {
    let pct = (fraction * 10_000.0).round() / 100.0;
    format!("{pct} %")
}

pub fn render_nodes(nodes: &[NodeStatus]) -> String {
    // The domain column only where the site has domains.
    let domains = nodes.iter().any(|n| n.domain.is_some());
    // The reserve column only where some node was never heard from.
    let unmanaged = nodes.iter().any(|n| n.unmanaged_reserve_w.is_some());
    let mut header = vec!["node", "gpus", "live", "power", "jobs"];
    if domains {
        header.push("domain");
    }
    if unmanaged {
        header.push("reserved");
    }
    let mut t = Table::new(header);
    for n in nodes {
        let mut row = vec![
            n.node.clone(),
            n.gpus.to_string(),
            if n.unmanaged_reserve_w.is_some() {
                "UNMANAGED".to_string()
            } else {
                n.live.to_string()
            },
            watts(n.power_w),
            n.jobs.to_string(),
        ];
        if domains {
            row.push(
                n.domain
                    .clone()
                    .unwrap_or_else(|| "NONE (config error)".into()),
            );
        }
        if unmanaged {
            row.push(n.unmanaged_reserve_w.map_or("-".into(), watts));
        }
        t.row(row);
    }
    t.render()
}

/// `powerflexctl domains`: the power domains as a tree, each with its limit, the budget
/// in force, the draw of its live nodes, the headroom, what the last allocation planned
/// through it, and whether it binds (its jobs' floors did not fit).
pub fn render_domains(domains: &[DomainStatus]) -> String {
    if domains.is_empty() {
        return "no power domains: the site config declares no [[domains]]\n".into();
    }
    let mut t = Table::new([
        "domain", "limit", "budget", "draw", "headroom", "planned", "nodes", "event", "binds",
    ]);
    for d in domains {
        t.row([
            format!("{}{}", "  ".repeat(d.depth as usize), d.name),
            watts(d.limit_w),
            watts(d.budget_w),
            watts(d.draw_w),
            watts(d.headroom_w),
            d.planned_w.map_or("-".into(), watts),
            format!("{}/{}", d.live_nodes, d.nodes),
            d.event.map_or("-".into(), |e| e.to_string()),
            match d.floors_over_w {
                Some(w) if w > 0.0 => format!("YES, floors over by {}", watts(w)),
                _ => "no".into(),
            },
        ]);
    }
    t.render()
}

pub fn render_jobs(jobs: &[SiteJobStatus]) -> String {
    let mut t = Table::new([
        "job",
        "tier",
        "nodes",
        "gpus",
        "PFI",
        "cap",
        "now",
        "uncapped",
        "bound",
        "curve",
        "calibration",
    ]);
    for j in jobs {
        t.row([
            j.job.clone(),
            j.tier.clone(),
            j.nodes.join(","),
            j.gpus.to_string(),
            j.pfi.map_or("-".into(), |p| format!("{p:.2}")),
            cap(j.cap_w),
            whole(j.throughput),
            whole(j.uncapped_throughput),
            bound(j.floor.as_ref()),
            match j.below_measured_w {
                Some(lowest) => format!(
                    "{}; lower bound below {lowest:.0} W",
                    drift_text(j.drift.as_ref())
                ),
                None => drift_text(j.drift.as_ref()),
            },
            // The walk's (and probes') token cost, % of the job's first-hour tokens.
            j.calibration_cost_pct
                .map_or("-".into(), |p| format!("{p:.2}%")),
        ]);
    }
    t.render()
}

/// `ok`, or how far the job's draw and throughput left its curve (`drifted: power ×1.30`).
fn drift_text(drift: Option<&powerflex_proto::status::Drift>) -> String {
    let Some(d) = drift else {
        return "ok".into();
    };
    let ratio = |name: &str, r: Option<f64>| r.map(|r| format!(" {name} x{r:.2}"));
    format!(
        "drifted:{}{}",
        ratio("power", d.power_ratio).unwrap_or_default(),
        ratio("speed", d.throughput_ratio).unwrap_or_default()
    )
}

/// One job's curve per node — each point with its standard error and the windows behind
/// it, and the slowdown against the uncapped point — then how the curve improved over
/// successive events (learning in operation). Nodes whose agent sent no uncertainty show
/// their points alone.
pub fn render_job_report(job: &SiteJobStatus) -> String {
    let mut out = format!(
        "job {}: tier {}, PFI {} ({}), cap {}\n",
        job.job,
        job.tier,
        job.pfi.map_or("-".into(), |p| format!("{p:.2}")),
        job.pfi_source.map_or("not measured", |s| s.name()),
        cap(job.cap_w),
    );
    if let Some(pct) = job.calibration_cost_pct {
        out.push_str(&format!(
            "calibration cost: {pct:.2} % of the job's first-hour tokens\n"
        ));
    }
    if let Some(energy_j) = job.energy_j {
        out.push_str(&format!(
            "energy so far: {} (GPU energy counters){}\n",
            powerflex_proto::usage::human_energy(energy_j),
            job.capped_pct
                .map_or(String::new(), |p| format!(", capped {p:.0} % of the time"))
        ));
    }
    if let Some(lowest) = job.below_measured_w {
        out.push_str(&format!(
            "BELOW ITS READINGS: its cap is below its lowest measured cap ({lowest:.0} W); there it is planned on a physics lower bound of its speed (the chord from the GPU's static draw to its lowest reading) until the agent's first window at the new cap\n"
        ));
    }
    let slowdown = |top: f64, t: f64| {
        if top > 0.0 {
            format!("{:.1}%", (1.0 - t / top) * 100.0)
        } else {
            "-".into()
        }
    };
    let mut t = Table::new([
        "node",
        "cap",
        "power",
        "throughput",
        "±",
        "slowdown",
        "windows",
    ]);
    for (node, points) in &job.points {
        if let Some(curve) = job.curve.get(node) {
            let top = curve.first().map_or(0.0, |p| p.throughput);
            for p in curve {
                t.row([
                    node.clone(),
                    format!("{:.0} W", p.cap_w),
                    watts(p.power_w),
                    format!("{:.1}", p.throughput),
                    format!("{:.1}", p.throughput_sigma),
                    slowdown(top, p.throughput),
                    p.windows.to_string(),
                ]);
            }
            continue;
        }
        let top = points.first().map_or(0.0, |p| p.throughput);
        for &OperatingPoint {
            cap_w,
            power_w,
            throughput,
        } in points
        {
            t.row([
                node.clone(),
                format!("{:.0} W", cap_w.0),
                watts(power_w.0),
                format!("{throughput:.1}"),
                "-".into(),
                slowdown(top, throughput),
                "-".into(),
            ]);
        }
    }
    out.push_str(&t.render());
    if !job.curve_history.is_empty() {
        out.push_str("curve over events (learning in operation):\n");
        let mut h = Table::new(["after", "node", "points", "windows", "mean ±"]);
        for s in &job.curve_history {
            h.row([
                s.after.to_string(),
                s.node.clone(),
                s.points.len().to_string(),
                s.windows().to_string(),
                format!("{:.2}%", 100.0 * s.mean_relative_sigma()),
            ]);
        }
        out.push_str(&h.render());
    }
    out
}

/// An ended job's energy record, for people.
pub fn render_job_record(r: &JobEnergyRecord) -> String {
    let mut out = format!("{}\n", r.summary_line());
    out.push_str(&format!(
        "job {} (uid {}), tier {}, ran {} to {} UTC; {:.0} J ({:.3} kWh), average {:.0} W, peak ≤ {:.0} W{}\n",
        r.job_id,
        r.uid,
        r.tier,
        utc_text(r.from_unix_ms),
        utc_text(r.to_unix_ms),
        r.energy_j,
        r.energy_kwh,
        r.avg_power_w,
        r.peak_power_w,
        r.tokens_per_j
            .map_or(String::new(), |t| format!(", {t:.1} tokens/J")),
    ));
    let mut t = Table::new([
        "node",
        "gpus",
        "energy",
        "source",
        "capped",
        "in events",
        "power-throttled",
        "slower",
        "bound",
    ]);
    for n in &r.nodes {
        let pct = |part: f64, base: f64| {
            if base > 0.0 {
                format!("{:.0}%", 100.0 * part / base)
            } else {
                "-".into()
            }
        };
        t.row([
            n.node.clone(),
            n.gpus.len().to_string(),
            powerflex_proto::usage::human_energy(n.energy_mj as f64 / 1000.0),
            n.energy_source.name().to_string(),
            pct(n.capped_s, n.observed_s),
            format!("{:.0}s", n.event_s),
            pct(n.power_throttled_s, n.throttle_known_s),
            n.slowdown_pct.map_or("-".into(), |s| format!("{s:.1}%")),
            powerflex_proto::usage::bound_cell(n.bound_held, n.bound_judgement),
        ]);
    }
    out.push_str(&t.render());
    if let Some(saved) = r.saved_estimate_j {
        out.push_str(&format!(
            "energy saved against uncapped for the same work: {} (ESTIMATE from the job's measured curve)\n",
            powerflex_proto::usage::human_energy(saved)
        ));
    }
    out
}

/// Energy records as `sreport` shows usage: one row per job, then totals.
pub fn render_accounting(records: &[JobEnergyRecord]) -> String {
    if records.is_empty() {
        return "no job energy records in that range\n".to_string();
    }
    let mut t = Table::new([
        "job",
        "uid",
        "tier",
        "ended (UTC)",
        "gpus",
        "kWh",
        "avg W",
        "capped",
        "slower",
        "bound",
        "source",
    ]);
    for r in records {
        t.row([
            r.job_id.clone(),
            r.uid.to_string(),
            r.tier.clone(),
            utc_text(r.to_unix_ms),
            r.gpus.to_string(),
            format!("{:.3}", r.energy_kwh),
            format!("{:.0}", r.avg_power_w),
            format!("{:.0}%", r.capped_pct),
            r.slowdown_pct.map_or("-".into(), |s| format!("{s:.1}%")),
            r.bound_cell(),
            r.energy_source.name().to_string(),
        ]);
    }
    let mut out = t.render();
    let total_j: f64 = records.iter().map(|r| r.energy_j).sum();
    let mut by_tier: BTreeMap<&str, (usize, f64)> = BTreeMap::new();
    for r in records {
        let e = by_tier.entry(r.tier.as_str()).or_insert((0, 0.0));
        e.0 += 1;
        e.1 += r.energy_j;
    }
    out.push_str(&format!(
        "total: {} jobs, {:.3} kWh{}\n",
        records.len(),
        total_j / powerflex_proto::usage::J_PER_KWH,
        if records.iter().any(|r| r.simulated) {
            " [SIMULATED GPUs]"
        } else {
            ""
        }
    ));
    for (tier, (n, j)) in by_tier {
        out.push_str(&format!(
            "  tier {tier}: {n} jobs, {:.3} kWh\n",
            j / powerflex_proto::usage::J_PER_KWH
        ));
    }
    out
}

/// Energy records as CSV (one row per job; figures in SI units).
pub fn accounting_csv(records: &[JobEnergyRecord]) -> String {
    let mut out = String::from(
        "job_id,uid,tier,from_unix_ms,to_unix_ms,gpus,energy_j,energy_kwh,energy_source,avg_power_w,peak_power_w,capped_pct,event_s,slowdown_pct,bound_pct,bound_held,saved_estimate_j,simulated,account,bound_past_s,bound_depth_pct\n",
    );
    let opt = |v: Option<f64>| v.map_or(String::new(), |v| format!("{v}"));
    for r in records {
        // Job ids hold no commas or quotes (validated on entry); a tier's commas become ;.
        out.push_str(&format!(
            "{},{},{},{},{},{},{},{},{},{},{},{},{},{},{},{},{},{},{},{},{}\n",
            r.job_id,
            r.uid,
            r.tier.replace(',', ";"),
            r.from_unix_ms,
            r.to_unix_ms,
            r.gpus,
            r.energy_j,
            r.energy_kwh,
            r.energy_source.name(),
            r.avg_power_w,
            r.peak_power_w,
            r.capped_pct,
            r.event_s,
            opt(r.slowdown_pct),
            opt(r.bound_pct),
            r.bound_held.map_or(String::new(), |b| b.to_string()),
            opt(r.saved_estimate_j),
            r.simulated,
            // Slurm's accounts are plain names; anything that would break a CSV cell goes.
            r.account
                .as_deref()
                .unwrap_or("")
                .replace([',', '"', '\n', '\r'], "_"),
            opt(r.bound_judgement.map(|j| j.past_s)),
            opt(r.bound_judgement.and_then(|j| j.depth_pct)),
        ));
    }
    out
}

pub fn render_whatif(d: &DecisionView) -> String {
    let a = d.allocation.as_ref();
    let mut out = format!(
        "policy {}: budget {}, of which {} not steered (idle GPUs, unmanaged jobs, silent nodes)\n",
        a.map_or("-", |a| a.policy.name()),
        watts(d.budget_w),
        watts(d.reserved_w)
    );
    let mut t = Table::new([
        "job",
        "cap",
        "power",
        "throughput",
        "slowdown",
        "bound",
        "floor",
    ]);
    for j in a.into_iter().flat_map(|a| &a.jobs) {
        t.row([
            j.id.clone(),
            cap(Some(j.cap_w.0)),
            watts(j.power_w.0),
            format!("{:.0}", j.throughput),
            format!("{:.1}%", j.slowdown * 100.0),
            j.max_slowdown
                .map_or("none".into(), |x| format!("{:.0}%", x.0 * 100.0)),
            bound(Some(&j.floor)),
        ]);
    }
    out.push_str(&t.render());
    match a {
        Some(a) => out.push_str(&format!(
            "managed jobs: power {}, short {}\n",
            watts(a.total_power_w.0),
            watts(a.over_budget_w.0)
        )),
        None => out.push_str("no managed jobs to allocate\n"),
    }
    out
}

/// The accounting database's line in `status`: quiet when it keeps up, loud when not.
/// The controller's leadership in one line (`[controller.ha]`, or fenced): upper case
/// when it does not steer, as the other warnings of the status are.
pub fn leadership_line(l: &powerflex_proto::status::LeadershipView) -> String {
    use powerflex_proto::status::LeadershipRole;
    let name = l.name.as_deref().unwrap_or("this controller");
    let mut line = match l.role {
        LeadershipRole::Active => format!("leadership: {name} active, epoch {}", l.epoch),
        role => format!(
            "LEADERSHIP: {name} {} (epoch {}), not steering",
            role.name().to_uppercase(),
            l.epoch
        ),
    };
    if let Some(holder) = &l.holder {
        line.push_str(&format!("; active: {holder}"));
    }
    if let Some(reason) = &l.reason {
        line.push_str(&format!("; {reason}"));
    }
    line.push('\n');
    line
}

/// What the site can shed now: the lowest budgets caps alone hold within every tier, and
/// with the preemptable jobs held out, each beside the draw.
fn shed_reach_line(reach: &powerflex_proto::status::ShedReach, draw_w: f64) -> String {
    let shed = |floor_w: f64| Watts((draw_w - floor_w).max(0.0));
    let mut line = format!(
        "can shed now: to {} by caps alone with every tier's bound held ({} below the draw)",
        Watts(reach.caps_w),
        shed(reach.caps_w)
    );
    if reach.preemptable_jobs > 0 {
        line.push_str(&format!(
            "; to {} with {} preemptable job{} held out ({} below the draw)",
            Watts(reach.with_preemption_w),
            reach.preemptable_jobs,
            if reach.preemptable_jobs == 1 { "" } else { "s" },
            shed(reach.with_preemption_w)
        ));
    } else {
        line.push_str("; no job's tier allows preemption");
    }
    line.push('\n');
    line
}

pub fn accounting_db_line(db: &powerflex_proto::status::AccountingDbView) -> String {
    let dropped = if db.dropped > 0 {
        format!(
            "; {} dropped from the queue (in the log, written at the next start)",
            db.dropped
        )
    } else {
        String::new()
    };
    match (&db.error, db.connected) {
        (None, true) => format!(
            "accounting database: connected since {} (schema {}), {} records written, {} pending{dropped}\n",
            utc_text(db.since_unix_ms),
            db.schema_version.map_or("?".to_string(), |v| v.to_string()),
            db.written,
            db.pending
        ),
        (None, false) => format!(
            "accounting database: connecting, {} records pending{dropped}\n",
            db.pending
        ),
        (Some(e), _) => format!(
            "ACCOUNTING DATABASE UNREACHABLE since {}: {e}; {} records pending (kept in the log, written when it answers){dropped}\n",
            utc_text(db.since_unix_ms),
            db.pending
        ),
    }
}

pub fn render_status(s: &CtldStatus) -> String {
    let mut out = format!(
        "budget {} (base {}), draw {}, headroom {}\n",
        watts(s.budget_w),
        watts(s.base_budget_w),
        watts(s.draw_w),
        watts(s.headroom_w)
    );
    if let Some(e) = &s.active_event {
        out.push_str(&format!("active event {}: {}\n", e.id, cut_text(e)));
    }
    // Only when it differs: ahead of a step down, or a rise held to the ramp-rate limit.
    if let Some(a) = s
        .allocated_budget_w
        .filter(|a| (a - s.budget_w).abs() >= 0.5)
    {
        out.push_str(&format!(
            "caps set for {} (ahead of a step down, or a rise held to max_ramp_w_per_s)\n",
            watts(a)
        ));
    }
    if let Some(e) = &s.config_error {
        out.push_str(&format!(
            "SITE CONFIG RELOAD REFUSED (the previous config stays in force): {e}\n"
        ));
    }
    let broken: Vec<String> = s
        .jobs
        .iter()
        .filter_map(|j| match j.floor {
            Some(FloorStatus::Broken { excess }) => {
                Some(format!("{} ({}) by {:.1}%", j.job, j.tier, excess * 100.0))
            }
            _ => None,
        })
        .collect();
    if !broken.is_empty() {
        out.push_str(&format!(
            "OVER THEIR BOUND ({} jobs; the budget cannot hold every tier): {}\n",
            broken.len(),
            broken.join(", ")
        ));
    }
    if !s.preempted.is_empty() {
        let held: Vec<String> = s
            .preempted
            .iter()
            .map(|p| {
                let how = if p.how == powerflex_core::flex::Preempt::Requeue {
                    "requeued"
                } else {
                    "suspended"
                };
                format!(
                    "{} {how} since {}",
                    p.job,
                    powerflex_controller_machine::schedule::utc_text(p.since_ms)
                )
            })
            .collect();
        out.push_str(&format!(
            "HELD OUT ({} jobs; caps at every floor could not meet the budget): {}\n",
            held.len(),
            held.join(", ")
        ));
    }
    let guessed: Vec<String> = s
        .jobs
        .iter()
        .filter_map(|j| {
            let lowest = j.below_measured_w?;
            Some(format!("{} ({} < {lowest:.0} W)", j.job, cap(j.cap_w)))
        })
        .collect();
    if !guessed.is_empty() {
        out.push_str(&format!(
            "BELOW THE READINGS ({} jobs; capped below their lowest measured cap, planned there on a physics lower bound of their speed until a window there lands): {}\n",
            guessed.len(),
            guessed.join(", ")
        ));
    }
    let binding: Vec<String> = s
        .domains
        .iter()
        .filter_map(|d| {
            let over = d.floors_over_w.filter(|&w| w > 0.0)?;
            Some(format!(
                "{} (floors over its {} by {})",
                d.name,
                watts(d.budget_w),
                watts(over)
            ))
        })
        .collect();
    if !binding.is_empty() {
        out.push_str(&format!(
            "DOMAIN BINDS ({}; its jobs give way, and only its jobs are held out): {}\n",
            binding.len(),
            binding.join(", ")
        ));
    }
    let cut: Vec<String> = s
        .domains
        .iter()
        .filter_map(|d| {
            Some(format!(
                "{} event {} (budget {})",
                d.name,
                d.event?,
                watts(d.budget_w)
            ))
        })
        .collect();
    if !cut.is_empty() {
        out.push_str(&format!("domain events in force: {}\n", cut.join(", ")));
    }
    if let Some(reserve) = s.unmanaged_reserve_w {
        let unheard: Vec<&str> = s
            .nodes
            .iter()
            .filter(|n| n.unmanaged_reserve_w.is_some())
            .map(|n| n.node.as_str())
            .collect();
        let more = unheard.len().saturating_sub(8);
        out.push_str(&format!(
            "UNMANAGED ({} nodes never heard from, each reserved at its GPUs times the largest GPU model's maximum): the budget is short by {}: {}{}\n",
            unheard.len(),
            watts(reserve),
            unheard[..unheard.len().min(8)].join(", "),
            if more > 0 {
                format!(" and {more} more")
            } else {
                String::new()
            }
        ));
    }
    if let Some(short) = s.over_budget_w.filter(|&w| w > 0.0) {
        out.push_str(&format!(
            "SHORT {}: every managed job is at its lowest cap\n",
            Watts(short)
        ));
    }
    if let Some(reach) = &s.shed_reach {
        out.push_str(&shed_reach_line(reach, s.draw_w));
    }
    if let Some(slurm) = &s.slurm {
        match (slurm.read_ms_ago, &slurm.error) {
            (None, error) => out.push_str(&format!(
                "SLURM PLACEMENT NOT READ YET: no job is believed until squeue answers{}\n",
                error.as_ref().map_or(String::new(), |e| format!(" ({e})"))
            )),
            (Some(ago), Some(e)) => out.push_str(&format!(
                "SLURM PLACEMENT STALE: read {:.0} s ago ({} jobs); the latest read failed: {e}\n",
                ago as f64 / 1000.0,
                slurm.jobs
            )),
            (Some(_), None) => {}
        }
    }
    if let Some(db) = &s.accounting_db {
        out.push_str(&accounting_db_line(db));
    }
    if let Some(l) = &s.leadership {
        out.push_str(&leadership_line(l));
    }
    if !s.refused_by.is_empty() {
        let nodes: Vec<String> = s
            .refused_by
            .iter()
            .take(8)
            .map(|(node, epoch)| format!("{node} (epoch {epoch})"))
            .collect();
        let more = s.refused_by.len().saturating_sub(nodes.len());
        out.push_str(&format!(
            "REFUSED BY {} node(s) that follow a controller of a later epoch; this controller steers them no more: {}{}\n",
            s.refused_by.len(),
            nodes.join(", "),
            if more > 0 {
                format!(" and {more} more")
            } else {
                String::new()
            }
        ));
    }
    let refused: Vec<String> = s
        .nodes
        .iter()
        .filter(|n| n.refused_reports > 0 || n.refused_gpus > 0)
        .map(|n| {
            format!(
                "{} ({} job reports Slurm does not place there, {} GPUs beyond its gres)",
                n.node, n.refused_reports, n.refused_gpus
            )
        })
        .collect();
    if !refused.is_empty() {
        out.push_str(&format!("REFUSED from {}\n", refused.join(", ")));
    }
    // Per tier: how many jobs and GPUs, the cap range, bounds broken.
    let mut tiers: BTreeMap<String, (usize, u64, f64, f64, usize)> = BTreeMap::new();
    for j in &s.jobs {
        let tier = j.tier.split(',').next().unwrap_or(&j.tier).to_string();
        let e = tiers
            .entry(tier)
            .or_insert((0, 0, f64::INFINITY, f64::NEG_INFINITY, 0));
        e.0 += 1;
        e.1 += u64::from(j.gpus);
        if let Some(cap) = j.cap_w {
            e.2 = e.2.min(cap);
            e.3 = e.3.max(cap);
        }
        e.4 += usize::from(j.floor.as_ref().is_some_and(FloorStatus::is_broken));
    }
    if !tiers.is_empty() {
        let mut t = Table::new(["tier", "jobs", "gpus", "caps", "bounds broken"]);
        for (tier, (n, gpus, lo, hi, broken)) in tiers {
            let caps = if lo.is_finite() {
                format!("{lo:.0}-{hi:.0} W")
            } else {
                "-".into()
            };
            t.row([
                tier,
                n.to_string(),
                gpus.to_string(),
                caps,
                broken.to_string(),
            ]);
        }
        out.push_str(&t.render());
        out.push('\n');
    }
    out.push_str(&render_nodes(&s.nodes));
    out.push('\n');
    if let Some(uid) = s.jobs_of_uid {
        out.push_str(&format!("{}\n", only_yours(uid)));
    }
    out.push_str(&render_jobs(&s.jobs));
    out
}

/// What a non-root caller is told about the job rows they read (need-to-know).
pub fn only_yours(uid: u32) -> String {
    format!("jobs of uid {uid} only (root sees every job)")
}

pub fn render_events(events: &[Event]) -> String {
    let mut t = Table::new(["id", "cut", "start", "duration", "ramp", "domain"]);
    for e in events {
        t.row([
            e.id.to_string(),
            cut_text(e),
            utc_text(e.start_ms),
            duration_text(e.duration_ms),
            duration_text(e.ramp_ms),
            e.domain.clone().unwrap_or_else(|| "(site)".into()),
        ]);
    }
    t.render()
}

#[cfg(test)]
mod tests {
    use super::*;
    use powerflex_core::allocate::{Allocation, JobAllocation, Maximised, Policy};
    use powerflex_core::units::SlowdownFraction;
    use powerflex_core::Watts;
    use powerflex_proto::status::{
        CurvePoint, CurveSnapshot, PfiSource, PreemptedView, SnapshotAfter,
    };

    fn job(id: &str, tier: &str, cap_w: Option<f64>, floor: Option<FloorStatus>) -> SiteJobStatus {
        SiteJobStatus {
            job: id.into(),
            tier: tier.into(),
            nodes: vec!["n1".into(), "n2".into()],
            gpus: 4,
            pfi: Some(1.434),
            pfi_source: Some(PfiSource::Measured),
            cap_w,
            floor,
            throughput: Some(1234.4),
            uncapped_throughput: Some(2000.0),
            power_w: 1800.0,
            points: BTreeMap::from([(
                "n1".to_string(),
                [[700.0, 2600.0, 2000.0], [400.0, 1500.0, 1500.0]]
                    .map(powerflex_proto::point::from_array)
                    .to_vec(),
            )]),
            curve: BTreeMap::new(),
            curve_history: Vec::new(),
            calibration_cost_pct: None,
            drift: None,
            owner_uid: Some(1000),
            below_measured_w: None,
            energy_j: None,
            capped_pct: None,
        }
    }

    fn status() -> CtldStatus {
        let event = Event {
            id: 3,
            cut: Cut::Reduce { fraction: 0.3 },
            start_ms: 1_000,
            duration_ms: 3_600_000,
            ramp_ms: 60_000,
            domain: None,
        };
        CtldStatus {
            base_budget_w: 10_000.0,
            budget_w: 7_000.0,
            allocated_budget_w: Some(7_000.0),
            preempted: Vec::new(),
            draw_w: 6_500.0,
            headroom_w: 500.0,
            active_event: Some(event.clone()),
            events: vec![event],
            over_budget_w: Some(0.0),
            shed_reach: None,
            nodes: vec![NodeStatus {
                node: "n1".into(),
                gpus: 8,
                live: true,
                power_w: 3_250.0,
                jobs: 2,
                seen_ms_ago: 400,
                refused_reports: 0,
                refused_gpus: 0,
                domain: None,
                unmanaged_reserve_w: None,
            }],
            jobs: vec![
                job("101", "flex2", Some(450.0), Some(FloorStatus::Held)),
                job(
                    "102",
                    "flex2,calibrate=off",
                    Some(300.0),
                    Some(FloorStatus::Broken { excess: 0.042 }),
                ),
                job("103", "flex0", None, None),
            ],
            config_error: None,
            jobs_of_uid: None,
            slurm: None,
            accounting_db: None,
            domains: Vec::new(),
            leadership: None,
            refused_by: Default::default(),
            unmanaged_reserve_w: None,
        }
    }

    #[test]
    fn status_names_the_budget_the_event_and_the_broken_bounds() {
        let text = render_status(&status());
        assert!(
            text.starts_with("budget 7000 W (base 10.0 kW), draw 6500 W, headroom 500 W\n"),
            "{text}"
        );
        assert!(
            text.contains("active event 3: 30 % of the base budget\n"),
            "{text}"
        );
        assert!(text.contains("OVER THEIR BOUND (1 jobs; the budget cannot hold every tier): 102 (flex2,calibrate=off) by 4.2%"), "{text}");
        assert!(!text.contains("SHORT"), "no shortfall: {text}");
        assert!(!text.contains("RELOAD REFUSED"), "{text}");
        // flex2 and flex2,calibrate=off are one tier: 2 jobs, 8 GPUs, caps 300-450 W, 1 broken.
        let tier_row = text
            .lines()
            .find(|l| l.starts_with("flex2 "))
            .expect("flex2 row");
        let cells: Vec<&str> = tier_row.split_whitespace().collect();
        assert_eq!(cells, ["flex2", "2", "8", "300-450", "W", "1"]);
        let flex0 = text
            .lines()
            .find(|l| l.starts_with("flex0 "))
            .expect("flex0 row");
        assert!(flex0.contains(" - "), "no cap yet: {flex0}");
        assert!(
            !text.contains("caps set for") && !text.contains("HELD OUT"),
            "{text}"
        );
    }

    /// The leadership line, quiet while active, loud (and naming the active
    /// controller and why) while not.
    #[test]
    fn status_says_whether_this_controller_steers() {
        use powerflex_proto::status::{LeadershipRole, LeadershipView};
        let mut s = status();
        assert!(
            !render_status(&s).contains("eadership"),
            "one controller: no line"
        );
        let view = |role, holder: Option<&str>, reason: Option<&str>| LeadershipView {
            role,
            name: Some("ctld-a".into()),
            epoch: 4,
            holder: holder.map(str::to_string),
            reason: reason.map(str::to_string),
            since_unix_ms: 0,
        };
        s.leadership = Some(view(LeadershipRole::Active, None, None));
        assert!(render_status(&s).contains("leadership: ctld-a active, epoch 4\n"));
        s.leadership = Some(view(LeadershipRole::Standby, Some("ctld-b"), None));
        assert!(render_status(&s)
            .contains("LEADERSHIP: ctld-a STANDBY (epoch 4), not steering; active: ctld-b\n"));
        s.leadership = Some(view(
            LeadershipRole::SteppedDown,
            None,
            Some("leadership not renewed for 4000 ms"),
        ));
        assert!(render_status(&s).contains(
            "LEADERSHIP: ctld-a STEPPED-DOWN (epoch 4), not steering; leadership not renewed for 4000 ms\n"
        ));
    }

    #[test]
    fn a_job_report_shows_its_curve_over_events_one_row_per_snapshot() {
        use powerflex_proto::status::{CurvePoint, CurveSnapshot, SnapshotAfter};
        let point = |cap_w: f64, windows: u32, sigma: f64| CurvePoint {
            cap_w,
            power_w: cap_w * 4.0,
            throughput: 1_000.0,
            power_sigma_w: 1.0,
            throughput_sigma: sigma,
            windows,
        };
        let snapshot = |after: SnapshotAfter, points: Vec<CurvePoint>| CurveSnapshot {
            t_ms: 1_796_144_400_000,
            after,
            node: "n1".into(),
            points,
        };
        let mut job = status().jobs[1].clone();
        assert!(
            !render_job_report(&job).contains("curve over events"),
            "none yet"
        );
        job.curve_history = vec![
            snapshot(SnapshotAfter::Calibrated, vec![point(700.0, 10, 20.0)]),
            snapshot(
                SnapshotAfter::Event(1),
                vec![point(700.0, 10, 20.0), point(530.0, 12, 10.0)],
            ),
            snapshot(
                SnapshotAfter::Event(2),
                vec![point(700.0, 10, 20.0), point(530.0, 30, 5.0)],
            ),
        ];
        let text = render_job_report(&job);
        assert!(
            text.contains("curve over events (learning in operation):"),
            "{text}"
        );
        let rows: Vec<Vec<&str>> = text
            .lines()
            .skip_while(|l| !l.starts_with("curve over events"))
            .skip(2)
            .map(|l| l.split_whitespace().collect())
            .collect();
        assert_eq!(
            rows,
            [
                vec!["calibrated", "n1", "1", "10", "2.00%"],
                vec!["event", "1", "n1", "2", "22", "1.50%"],
                vec!["event", "2", "n1", "2", "40", "1.25%"],
            ],
            "{text}"
        );
    }

    #[test]
    fn jobs_capped_below_their_measured_caps_are_named_as_running_on_the_guess() {
        let mut s = status();
        s.jobs[1].below_measured_w = Some(400.0);
        let text = render_status(&s);
        assert!(
            text.contains("BELOW THE READINGS (1 jobs; capped below their lowest measured cap, planned there on a physics lower bound of their speed until a window there lands): 102 (300 W < 400 W)"),
            "{text}"
        );
        assert!(!render_status(&status()).contains("BELOW THE READINGS"));
        assert!(render_jobs(&s.jobs).contains("lower bound below 400 W"));
        assert!(render_job_report(&s.jobs[1])
            .contains("BELOW ITS READINGS: its cap is below its lowest measured cap (400 W)"));
    }

    #[test]
    fn status_names_caps_set_ahead_and_jobs_held_out() {
        let mut s = status();
        s.allocated_budget_w = Some(6_500.0);
        s.preempted = vec![PreemptedView {
            job: "104".into(),
            how: powerflex_core::flex::Preempt::Suspend,
            since_ms: 1_796_144_400_000,
        }];
        let text = render_status(&s);
        assert!(
            text.contains(
                "caps set for 6500 W (ahead of a step down, or a rise held to max_ramp_w_per_s)\n"
            ),
            "{text}"
        );
        assert!(
            text.contains("HELD OUT (1 jobs; caps at every floor could not meet the budget): 104 suspended since 2026-12-01 17:00:00 UTC\n"),
            "{text}"
        );
    }

    #[test]
    fn a_user_s_status_says_it_lists_their_jobs_only() {
        let mut s = status();
        assert!(!render_status(&s).contains("only"), "root: no note");
        s.jobs_of_uid = Some(1000);
        let text = render_status(&s);
        assert!(
            text.contains("jobs of uid 1000 only (root sees every job)\n"),
            "{text}"
        );
    }

    #[test]
    fn a_refused_reload_and_a_shortfall_stand_out() {
        let mut s = status();
        s.config_error = Some("bad key".into());
        s.over_budget_w = Some(250.0);
        s.active_event = None;
        let text = render_status(&s);
        assert!(text.contains(
            "SITE CONFIG RELOAD REFUSED (the previous config stays in force): bad key\n"
        ));
        assert!(text.contains("SHORT 250 W: every managed job is at its lowest cap\n"));
        assert!(!text.contains("active event"));
    }

    #[test]
    fn what_the_site_can_shed_is_shown_beside_the_draw() {
        let mut s = status();
        s.draw_w = 14_600.0;
        s.shed_reach = Some(powerflex_proto::status::ShedReach {
            caps_w: 9467.0,
            with_preemption_w: 7612.0,
            preemptable_jobs: 1,
        });
        let text = render_status(&s);
        assert!(
            text.contains("can shed now: to 9467 W by caps alone with every tier's bound held (5133 W below the draw); to 7612 W with 1 preemptable job held out (6988 W below the draw)\n"),
            "{text}"
        );
        s.shed_reach = Some(powerflex_proto::status::ShedReach {
            caps_w: 9467.0,
            with_preemption_w: 9467.0,
            preemptable_jobs: 0,
        });
        assert!(render_status(&s).contains("; no job's tier allows preemption\n"));
    }

    #[test]
    fn jobs_and_nodes_show_every_field() {
        let s = status();
        let jobs = render_jobs(&s.jobs);
        let row: Vec<&str> = jobs
            .lines()
            .nth(2)
            .expect("102")
            .split_whitespace()
            .collect();
        assert_eq!(
            row,
            [
                "102",
                "flex2,calibrate=off",
                "n1,n2",
                "4",
                "1.43",
                "300",
                "W",
                "1234",
                "2000",
                "BROKEN",
                "by",
                "4.2%",
                "ok",
                "-",
            ]
        );
        let none: Vec<&str> = jobs
            .lines()
            .nth(3)
            .expect("103")
            .split_whitespace()
            .collect();
        assert_eq!(none[5..], ["-", "1234", "2000", "-", "ok", "-"]);
        let mut calibrated = s.jobs[0].clone();
        calibrated.calibration_cost_pct = Some(1.5);
        let text = render_jobs(&[calibrated]);
        let row = text.lines().nth(1).expect("row");
        assert!(row.trim_end().ends_with("1.50%"), "{row}");
        let nodes = render_nodes(&s.nodes);
        let row: Vec<&str> = nodes
            .lines()
            .nth(1)
            .expect("n1")
            .split_whitespace()
            .collect();
        assert_eq!(row, ["n1", "8", "true", "3250", "W", "2"]);
    }

    #[test]
    fn a_node_never_heard_from_is_unmanaged_with_what_the_budget_is_short() {
        let mut s = status();
        s.nodes.push(NodeStatus {
            node: "n2".into(),
            gpus: 4,
            live: false,
            power_w: 0.0,
            jobs: 0,
            seen_ms_ago: 0,
            refused_reports: 0,
            refused_gpus: 0,
            domain: None,
            unmanaged_reserve_w: Some(2800.0),
        });
        s.unmanaged_reserve_w = Some(2800.0);
        let text = render_status(&s);
        assert!(
            text.contains("UNMANAGED (1 nodes never heard from, each reserved at its GPUs times the largest GPU model's maximum): the budget is short by 2800 W: n2\n"),
            "{text}"
        );
        let nodes = render_nodes(&s.nodes);
        let rows: Vec<Vec<&str>> = nodes
            .lines()
            .map(|l| l.split_whitespace().collect())
            .collect();
        assert_eq!(rows[0].last(), Some(&"reserved"));
        assert_eq!(rows[1], ["n1", "8", "true", "3250", "W", "2", "-"]);
        assert_eq!(
            rows[2],
            ["n2", "4", "UNMANAGED", "0", "W", "0", "2800", "W"]
        );
        // Without one, neither the line nor the column.
        assert!(!render_status(&status()).contains("UNMANAGED"));
        assert!(!render_nodes(&status().nodes).contains("reserved"));
    }

    #[test]
    fn a_job_report_shows_its_points_and_slowdowns() {
        let text = render_job_report(&job("101", "flex2", Some(450.0), None));
        assert!(
            text.starts_with("job 101: tier flex2, PFI 1.43 (measured), cap 450 W\n"),
            "{text}"
        );
        let rows: Vec<Vec<&str>> = text
            .lines()
            .skip(2)
            .map(|l| l.split_whitespace().collect())
            .collect();
        assert_eq!(
            rows[0],
            ["n1", "700", "W", "2600", "W", "2000.0", "-", "0.0%", "-"]
        );
        assert_eq!(
            rows[1],
            ["n1", "400", "W", "1500", "W", "1500.0", "-", "25.0%", "-"]
        );
        let mut unmeasured = job("104", "flex1", None, None);
        unmeasured.pfi = None;
        unmeasured.pfi_source = None;
        let text = render_job_report(&unmeasured);
        assert!(
            text.starts_with("job 104: tier flex1, PFI - (not measured), cap -\n"),
            "{text}"
        );
    }

    #[test]
    fn a_job_report_shows_uncertainty_windows_and_the_curve_over_events() {
        let point = |cap_w: f64, throughput: f64, sigma: f64, windows: u32| CurvePoint {
            cap_w,
            power_w: cap_w * 4.0,
            throughput,
            power_sigma_w: 1.0,
            throughput_sigma: sigma,
            windows,
        };
        let mut j = job("101", "flex2", Some(450.0), None);
        j.calibration_cost_pct = Some(1.234);
        j.curve.insert(
            "n1".into(),
            vec![point(700.0, 2000.0, 4.0, 8), point(450.0, 1700.0, 2.5, 40)],
        );
        j.curve_history = vec![
            CurveSnapshot {
                t_ms: 1,
                after: SnapshotAfter::Calibrated,
                node: "n1".into(),
                points: vec![point(700.0, 2000.0, 4.0, 8), point(500.0, 1800.0, 16.0, 2)],
            },
            CurveSnapshot {
                t_ms: 2,
                after: SnapshotAfter::Event(3),
                node: "n1".into(),
                points: vec![
                    point(700.0, 2000.0, 4.0, 8),
                    point(500.0, 1800.0, 16.0, 2),
                    point(450.0, 1700.0, 2.5, 40),
                ],
            },
        ];
        let text = render_job_report(&j);
        assert!(
            text.contains("calibration cost: 1.23 % of the job's first-hour tokens"),
            "{text}"
        );
        let rows: Vec<Vec<&str>> = text
            .lines()
            .map(|l| l.split_whitespace().collect())
            .collect();
        assert!(
            rows.contains(&vec![
                "n1", "450", "W", "1800", "W", "1700.0", "2.5", "15.0%", "40"
            ]),
            "{text}"
        );
        assert!(
            rows.contains(&vec!["calibrated", "n1", "2", "10", "0.50%"]),
            "{text}"
        );
        assert!(
            rows.contains(&vec!["event", "3", "n1", "3", "50", "0.38%"]),
            "{text}"
        );
    }

    #[test]
    fn domains_are_drawn_as_a_tree_with_what_binds() {
        let domain = |name: &str, depth: u32, over: Option<f64>| DomainStatus {
            name: name.into(),
            parent: None,
            depth,
            limit_w: 20_000.0,
            budget_w: 15_000.0,
            draw_w: 12_000.0,
            headroom_w: 3_000.0,
            nodes: 4,
            live_nodes: 3,
            planned_w: Some(11_500.0),
            floors_over_w: over,
            event: (depth == 1).then_some(7),
            unmanaged_reserve_w: None,
        };
        let text = render_domains(&[domain("feed-a", 0, None), domain("rack-1", 1, Some(250.0))]);
        let lines: Vec<&str> = text.lines().collect();
        assert!(
            lines[0].starts_with("domain") && lines[0].contains("headroom"),
            "{text}"
        );
        assert!(lines[1].starts_with("feed-a "), "{text}");
        assert!(lines[2].starts_with("  rack-1"), "{text}");
        assert!(
            lines[2].contains("YES, floors over by 250 W") && lines[2].contains("3/4"),
            "{text}"
        );
        assert!(render_domains(&[]).contains("no [[domains]]"));
    }

    #[test]
    fn what_if_shows_each_job_and_the_totals() {
        let mut d = DecisionView {
            leases: BTreeMap::new(),
            budget_w: 5000.0,
            reserved_w: 300.0,
            allocation: Some(Allocation {
                policy: Policy::Equal,
                budget_w: Watts(4700.0),
                jobs: vec![JobAllocation {
                    id: "101".into(),
                    cap_w: Watts(450.0),
                    power_w: Watts(1800.0),
                    throughput: 1700.4,
                    slowdown: 0.15,
                    max_slowdown: Some(SlowdownFraction(0.25)),
                    floor: FloorStatus::Held,
                }],
                total_power_w: Watts(1800.0),
                objective: 1700.4,
                over_budget_w: Watts(0.0),
                domains: Vec::new(),
            }),
            rejected: Vec::new(),
            drifted: Vec::new(),
            start_cap_w: 500.0,
            objective: Maximised::TokensPerS,
        };
        let text = render_whatif(&d);
        assert!(
            text.starts_with("policy equal: budget 5000 W, of which 300 W not steered"),
            "{text}"
        );
        let row: Vec<&str> = text
            .lines()
            .nth(2)
            .expect("row")
            .split_whitespace()
            .collect();
        assert_eq!(
            row,
            ["101", "450", "W", "1800", "W", "1700", "15.0%", "25%", "held"]
        );
        assert!(
            text.ends_with("managed jobs: power 1800 W, short 0 W\n"),
            "{text}"
        );
        d.allocation = None;
        let text = render_whatif(&d);
        assert!(text.starts_with("policy -: "), "{text}");
        assert!(text.ends_with("no managed jobs to allocate\n"), "{text}");
    }

    #[test]
    fn events_list_their_cut_and_times() {
        let text = render_events(&status().events);
        let row: Vec<&str> = text
            .lines()
            .nth(1)
            .expect("row")
            .split_whitespace()
            .collect();
        assert_eq!(
            row,
            [
                "3",
                "30",
                "%",
                "of",
                "the",
                "base",
                "budget",
                "1970-01-01",
                "00:00:01",
                "UTC",
                "1h",
                "1m",
                "(site)"
            ]
        );
    }

    #[test]
    fn a_drifted_job_says_how_far_it_left_its_curve() {
        let mut j = job("7", "flex3", Some(400.0), None);
        j.drift = Some(powerflex_proto::status::Drift {
            job: "7".into(),
            cap_w: 400.0,
            power_ratio: Some(1.3),
            throughput_ratio: None,
        });
        let text = render_jobs(&[j]);
        assert!(text.contains("drifted: power x1.30"), "{text}");
    }
}
