//! The agent's calibration and learning state machine, closed loop on real measured
//! curves, on a fake clock: for every job of a curves file (default: the Zeus NSDI'23
//! dev set), a simulated job runs at the throughput its true curve gives at the cap the
//! agent holds, reporting progress every 0.5 s with per-report jitter; its GPUs' power
//! is the true curve's with 1 % noise per sample. The agent walks it by the default
//! design (window 30 s, settle 10 s, 2 % budget, expected cut 30 %), then two grid events
//! hold it 15 min each at the cap where its true power falls 20 %, with probes on.
//!
//! Prints, per phase: the token cost (on the true curve and as the agent accounted it,
//! fraction of first-hour tokens), the walk's duration, and the curve's error against
//! the truth over the caps the walk reached (mean absolute throughput error, fraction of
//! uncapped) and its mean stated uncertainty at the event's cap.
//!
//! `cargo run --release -p powerflex-agent --example closed_loop_learning [CURVES.csv]`

use powerflex_agent_machine::calibration::{Calibration, CalibrationSettings, Phase, ProgressLog};
use powerflex_core::curve::CapCurve;
use powerflex_core::curves_csv::parse_curves;
use powerflex_core::rng::SplitMix64;
use powerflex_core::Watts;

const REPORT_S: f64 = 0.5;
const TICK_S: f64 = 1.0;
/// Relative jitter of one report's count (a step's time varies): about 1 % per 30 s
/// window after pooling.
const REPORT_JITTER: f64 = 0.08;
const POWER_NOISE: f64 = 0.01;
const EVENT_S: f64 = 900.0;

struct Sim {
    truth: CapCurve,
    t: f64,
    count: f64,
    log: ProgressLog,
    rng: SplitMix64,
    /// Σ time × (1 − T(cap)/T_max) at caps below the top, s.
    lost_s: f64,
    held: Option<(Watts, f64)>,
}

impl Sim {
    /// Runs until `until` (or `stop`), the agent holding `cal.cap()` or `granted`.
    fn run(
        &mut self,
        cal: &mut Calibration,
        granted: Watts,
        until: f64,
        probe_step: Option<Watts>,
        stop: impl Fn(&Calibration) -> bool,
    ) {
        let top = self.truth.uncapped();
        let min_cap = self.truth.lowest().cap_w;
        let mut next_tick = self.t + TICK_S;
        while self.t < until && !stop(cal) {
            let cap = cal.cap().map_or(granted, |c| Watts(c.0.min(granted.0)));
            let p = self.truth.at(cap);
            self.t += REPORT_S;
            let jitter = 1.0 + REPORT_JITTER * self.rng.normal();
            self.count += (p.throughput * REPORT_S * jitter).max(0.0);
            self.log.record(self.t, self.count);
            self.lost_s += (1.0 - p.throughput / top.throughput).max(0.0) * REPORT_S;
            if self.t + 1e-9 >= next_tick {
                next_tick += TICK_S;
                if self.held.is_none_or(|(c, _)| (c.0 - cap.0).abs() > 0.5) {
                    self.held = Some((cap, self.t));
                }
                let power = Watts(p.power_w.0 * (1.0 + POWER_NOISE * self.rng.normal()));
                if cal.cap().is_some_and(|level| granted.0 < level.0 - 0.5) && cal.is_active() {
                    cal.held_below_level(self.t, granted);
                }
                cal.observe_operation(self.t, &self.log, Some(power), self.held);
                cal.check_probe(self.t, Some(granted));
                if let Some(step) = probe_step {
                    cal.consider_probe(self.t, granted, step, min_cap);
                }
                cal.tick(self.t, &self.log, Some(power));
            }
        }
    }
}

/// Mean |T̂ − T| / T_max over the true curve's caps in `lowest..=highest`.
fn curve_error(est: &CapCurve, truth: &CapCurve, lowest: Watts, highest: Watts) -> f64 {
    let top = truth.uncapped().throughput;
    let caps: Vec<f64> = truth
        .knots()
        .iter()
        .map(|k| k.cap_w.0)
        .filter(|c| *c >= lowest.0 - 0.5 && *c <= highest.0 + 0.5)
        .collect();
    caps.iter()
        .map(|&c| (est.at(Watts(c)).throughput - truth.at(Watts(c)).throughput).abs() / top)
        .sum::<f64>()
        / caps.len().max(1) as f64
}

fn main() -> Result<(), String> {
    let path = std::env::args()
        .nth(1)
        .unwrap_or_else(|| "data/curves/zeus_nsdi23_dev.csv".to_string());
    let text = std::fs::read_to_string(&path).map_err(|e| format!("{path}: {e}"))?;
    let records = parse_curves(&text).map_err(|e| format!("{path}: {e}"))?;
    let mut rows: Vec<[f64; 13]> = Vec::new();
    for (i, rec) in records.iter().enumerate() {
        let truth = CapCurve::from_points(&rec.points).map_err(|e| e.to_string())?;
        let mut grid: Vec<Watts> = rec.points.iter().map(|p| p.cap_w).collect();
        grid.reverse();
        let min_cap = grid.last().copied().unwrap_or(Watts(0.0));
        let settings = CalibrationSettings {
            grid,
            min_cap,
            settle_s: 10.0,
            hold_s: 30.0,
            warmup_s: 60.0,
            steady_cv: 0.2,
            allowance: 0.05,
            no_signal_s: 600.0,
            rewalk_after_s: powerflex_agent_machine::calibration::DEFAULT_REWALK_AFTER_S,
            budget_fraction: 0.02,
            expected_cut: 0.3,
        };
        let mut cal = Calibration::new(settings, Some(0.5), true, 0.0);
        let top = truth.uncapped();
        let mut sim = Sim {
            truth: truth.clone(),
            t: 0.0,
            count: 0.0,
            log: ProgressLog::default(),
            rng: SplitMix64::new(0x5eed + i as u64),
            lost_s: 0.0,
            held: None,
        };
        sim.run(&mut cal, top.cap_w, 6.0 * 3600.0, None, |c| !c.is_active());
        if cal.phase != Phase::Done {
            eprintln!("{}: not calibrated: {:?}", rec.job, cal.phase);
            continue;
        }
        let walk_cost_true = sim.lost_s / 3600.0;
        let walk_cost_agent = cal.cost_fraction().unwrap_or(f64::NAN);
        let walk_s = cal.duration_s().unwrap_or(f64::NAN);
        let lowest = cal.levels().last().map_or(top.cap_w, |l| l.cap);
        let walked = cal.curve().ok_or("curve")?;
        let err0 = curve_error(&walked, &truth, lowest, top.cap_w);
        // The event's cap: the highest cap whose true power is 20 % below uncapped.
        let grant = truth
            .knots()
            .iter()
            .rev()
            .find(|k| k.power_w.0 <= 0.8 * top.power_w.0)
            .map_or(truth.lowest().cap_w, |k| k.cap_w);
        let step = Watts(
            rec.points
                .windows(2)
                .map(|w| w[1].cap_w.0 - w[0].cap_w.0)
                .fold(f64::INFINITY, f64::min),
        );
        // The decision's neighbourhood: two cap steps either side of the event's cap.
        let (near_lo, near_hi) = (Watts(grant.0 - 2.0 * step.0), Watts(grant.0 + 2.0 * step.0));
        let near0 = curve_error(&walked, &truth, near_lo, near_hi);
        let sigma0 = walked
            .sigma_at(grant)
            .map_or(f64::NAN, |s| s.throughput / top.throughput);
        let mut errs = Vec::new();
        let mut near = Vec::new();
        let mut sigmas = Vec::new();
        for _ in 0..2 {
            let start = sim.t;
            // Back uncapped between events, then the event's hold.
            sim.run(&mut cal, top.cap_w, start + 600.0, Some(step), |_| false);
            sim.run(&mut cal, grant, start + 600.0 + EVENT_S, Some(step), |_| {
                false
            });
            let curve = cal.curve().ok_or("curve")?;
            errs.push(curve_error(&curve, &truth, lowest, top.cap_w));
            near.push(curve_error(&curve, &truth, near_lo, near_hi));
            sigmas.push(
                curve
                    .sigma_at(grant)
                    .map_or(f64::NAN, |s| s.throughput / top.throughput),
            );
        }
        let probe_cost = cal.probe_cost / (3600.0 * top.throughput);
        rows.push([
            walk_cost_true,
            walk_cost_agent,
            walk_s,
            err0,
            errs[0],
            errs[1],
            sigmas[0],
            sigmas[1],
            probe_cost,
            near0,
            near[0],
            near[1],
            sigma0,
        ]);
    }
    let n = rows.len() as f64;
    let mean = |k: usize| rows.iter().map(|r| r[k]).sum::<f64>() / n;
    let max = |k: usize| rows.iter().map(|r| r[k]).fold(f64::MIN, f64::max);
    println!(
        "{} jobs of {path} calibrated by the agent's design, closed loop",
        rows.len()
    );
    println!(
        "walk cost (true curve):     mean {:.2} %, max {:.2} % of first-hour tokens",
        100.0 * mean(0),
        100.0 * max(0)
    );
    println!(
        "walk cost (agent's account): mean {:.2} %, max {:.2} %",
        100.0 * mean(1),
        100.0 * max(1)
    );
    println!(
        "walk duration:              mean {:.0} s, max {:.0} s",
        mean(2),
        max(2)
    );
    println!(
        "curve error vs truth (mean |dT|/T_max over the caps walked): after walk {:.2} %, after event 1 {:.2} %, after event 2 {:.2} %",
        100.0 * mean(3),
        100.0 * mean(4),
        100.0 * mean(5)
    );
    println!(
        "curve error within two cap steps of the event's cap: after walk {:.2} %, after event 1 {:.2} %, after event 2 {:.2} %",
        100.0 * mean(9),
        100.0 * mean(10),
        100.0 * mean(11)
    );
    println!(
        "stated uncertainty at the event's cap (sigma/T_max): after walk {:.3} %, after event 1 {:.3} %, after event 2 {:.3} %",
        100.0 * mean(12),
        100.0 * mean(6),
        100.0 * mean(7)
    );
    println!(
        "probe cost over both events: mean {:.3} %, max {:.3} % of first-hour tokens",
        100.0 * mean(8),
        100.0 * max(8)
    );
    Ok(())
}
