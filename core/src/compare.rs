//! What an allocation buys, scored on the jobs' TRUE curves: the demo's comparison of
//! powerflex against the paper's baselines, and the site harness's live A/B.
//!
//! A policy's caps come from somewhere else (the controller's `whatif`, on the curves it
//! measured, or the caps the live loop applied); here they are only scored, each on the
//! same footing: the profile's true curve at the cap, summed over the job's GPUs. Two
//! policies are computed here, both on the true curves with the tiers' bounds, so no
//! controller can move them: the oracle (the controller's optimiser, the most any
//! allocation could keep) and the tier-aware equal split (the zero of the gap).
//!
//! The paper's headline figure is the share of the equal→oracle gap a policy recovers:
//! `(T_policy − T_equal) / (T_oracle − T_equal)`. On a site with tiers the zero is the
//! equal split within the tiers: the paper's equal-weight cut ignores them and may keep
//! more tokens than any allocation that holds them (by cutting a flex0 job), so a share
//! measured from it says nothing of what holding the promises costs.

use std::collections::BTreeMap;

use crate::allocate::{allocate, CapLimits, JobSpec, Policy};
use crate::curve::CapCurve;
use crate::point::OperatingPoint;
use crate::units::{SlowdownFraction, Watts};

/// Slowdown beyond a bound that still counts as held: the true curve is scored at a cap
/// the controller chose on measured ones, and a few tenths of a percent are noise.
pub const BOUND_TOLERANCE: f64 = 0.005;

/// One job as the comparison sees it: its true curve and its tier's bound.
#[derive(Debug, Clone)]
pub struct TrueJob {
    pub id: String,
    pub gpus: u32,
    /// Per-GPU cap → the job's summed power (W) and tokens/s, from its profile.
    pub curve: CapCurve,
    /// The tier's bound (fraction of uncapped throughput); `None` = unmanaged.
    pub max_slowdown: Option<f64>,
}

impl TrueJob {
    /// The true curve of a job of `gpus` GPUs from one GPU's curve `per_gpu` (cap → that
    /// GPU's power and its throughput relative to uncapped, caps ascending) and its
    /// uncapped tokens/s per GPU, in tokens/s.
    pub fn from_per_gpu(
        id: &str,
        per_gpu: &[OperatingPoint],
        tokens_per_s_per_gpu: f64,
        gpus: u32,
        max_slowdown: Option<f64>,
    ) -> Result<TrueJob, String> {
        let g = f64::from(gpus);
        let scale = tokens_per_s_per_gpu * g;
        let points: Vec<OperatingPoint> = per_gpu
            .iter()
            .map(|p| OperatingPoint {
                cap_w: p.cap_w,
                power_w: Watts(p.power_w.0 * g),
                throughput: p.throughput * scale,
            })
            .collect();
        let curve = CapCurve::from_points(&points).map_err(|e| format!("{id}: {e}"))?;
        Ok(TrueJob {
            id: id.to_string(),
            gpus,
            curve,
            max_slowdown,
        })
    }

    /// The job uncapped: its highest cap's point.
    pub fn uncapped(&self) -> OperatingPoint {
        self.curve.uncapped()
    }
}

/// One policy's caps, scored.
#[derive(Debug, Clone, PartialEq)]
pub struct Scored {
    pub policy: String,
    /// Per-GPU cap per job, W.
    pub caps_w: BTreeMap<String, f64>,
    /// Σ tokens/s on the true curves.
    pub tokens_per_s: f64,
    /// Σ power on the true curves, W.
    pub power_w: f64,
    /// Jobs slowed beyond their tier's bound (plus [`BOUND_TOLERANCE`]) on their true
    /// curve, with the slowdown each got.
    pub bounds_broken: Vec<(String, f64)>,
}

/// Scores `caps_w` (a job without a cap runs uncapped) on the jobs' true curves.
pub fn score(policy: &str, jobs: &[TrueJob], caps_w: &BTreeMap<String, f64>) -> Scored {
    let (mut tokens, mut power, mut broken) = (0.0, 0.0, Vec::new());
    for job in jobs {
        let top = job.uncapped();
        let cap = caps_w.get(&job.id).copied().unwrap_or(top.cap_w.0);
        let at = job.curve.at(Watts(cap));
        tokens += at.throughput;
        power += at.power_w.0;
        let slowdown = 1.0 - at.throughput / top.throughput;
        if let Some(bound) = job.max_slowdown {
            if slowdown > bound + BOUND_TOLERANCE {
                broken.push((job.id.clone(), slowdown));
            }
        }
    }
    Scored {
        policy: policy.to_string(),
        caps_w: caps_w.clone(),
        tokens_per_s: tokens,
        power_w: power,
        bounds_broken: broken,
    }
}

/// The most any allocation could keep: the optimiser on the TRUE curves, every managed
/// job within `limits` and its tier's bound, Σ power within `budget_w` (less what the
/// unmanaged jobs draw uncapped).
pub fn oracle(jobs: &[TrueJob], budget_w: f64, limits: CapLimits) -> Result<Scored, String> {
    on_true_curves("oracle", jobs, budget_w, limits, Policy::Optimal)
}

/// The tier-aware equal split on the TRUE curves: every tier's floor first, then every
/// managed job's power cut by the same fraction of its uncapped power (the allocator's
/// `Policy::Equal`), Σ power within `budget_w` less what the unmanaged jobs draw. The
/// zero of the gap: what the site would do knowing nothing but the tiers, on curves no
/// controller measured.
pub fn equal_split(jobs: &[TrueJob], budget_w: f64, limits: CapLimits) -> Result<Scored, String> {
    on_true_curves("equal", jobs, budget_w, limits, Policy::Equal)
}

fn on_true_curves(
    name: &str,
    jobs: &[TrueJob],
    budget_w: f64,
    limits: CapLimits,
    policy: Policy,
) -> Result<Scored, String> {
    let unmanaged_w: f64 = jobs
        .iter()
        .filter(|j| j.max_slowdown.is_none())
        .map(|j| j.uncapped().power_w.0)
        .sum();
    let specs: Vec<JobSpec> = jobs
        .iter()
        .filter_map(|j| {
            Some(JobSpec {
                id: j.id.clone(),
                gpus: j.gpus,
                curve: j.curve.clone(),
                max_slowdown: Some(SlowdownFraction(j.max_slowdown?)),
                limits,
                throughput_weight: 1.0,
            })
        })
        .collect();
    let allocation = allocate(&specs, Watts((budget_w - unmanaged_w).max(0.0)), policy)
        .map_err(|e| e.to_string())?;
    let caps: BTreeMap<String, f64> = allocation
        .jobs
        .iter()
        .map(|j| (j.id.clone(), j.cap_w.0))
        .collect();
    Ok(score(name, jobs, &caps))
}

/// The share of the gap from `zero` to `oracle` that `scored` recovers (1 = all of it),
/// or `None` when the oracle keeps no more than `zero` (nothing to recover).
pub fn gap_recovered(scored: &Scored, zero: &Scored, oracle: &Scored) -> Option<f64> {
    let gap = oracle.tokens_per_s - zero.tokens_per_s;
    // Below a millionth of the total the gap is rounding, not a choice.
    (gap > 1e-6 * oracle.tokens_per_s.abs())
        .then(|| (scored.tokens_per_s - zero.tokens_per_s) / gap)
}

/// Rounds `x` to `decimals` places for people and for the summary file alike, so the two
/// say the same number (no `8.400694999999999`).
pub fn round_to(x: f64, decimals: i32) -> f64 {
    let scale = 10f64.powi(decimals);
    let r = (x * scale).round() / scale;
    // -0.0 reads as a sign error.
    if r == 0.0 {
        0.0
    } else {
        r
    }
}

/// Every float in `value` rounded for people: to 1 decimal from 100 up, 3 decimals from
/// 1 up, 4 significant digits below 1. Integers, strings and structure are untouched.
pub fn tidy_floats(value: serde_json::Value) -> serde_json::Value {
    use serde_json::Value;
    match value {
        Value::Number(n) if n.is_f64() => {
            let x = n.as_f64().unwrap_or(0.0);
            let magnitude = x.abs();
            let rounded = if magnitude >= 100.0 {
                round_to(x, 1)
            } else if magnitude >= 1.0 {
                round_to(x, 3)
            } else if magnitude > 0.0 {
                let digits = 3 - magnitude.log10().floor() as i32;
                round_to(x, digits)
            } else {
                0.0
            };
            serde_json::Number::from_f64(rounded).map_or(Value::Null, Value::Number)
        }
        Value::Array(items) => Value::Array(items.into_iter().map(tidy_floats).collect()),
        Value::Object(map) => {
            Value::Object(map.into_iter().map(|(k, v)| (k, tidy_floats(v))).collect())
        }
        other => other,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::workload::{MeasuredTable, Physics};

    /// The simulator's workload library (the profiles the demo's jobs run), read as
    /// far as the true curves need it.
    #[derive(serde::Deserialize)]
    struct Library {
        profile: Vec<Profile>,
    }

    #[derive(serde::Deserialize)]
    struct Profile {
        name: String,
        physics: Physics,
        #[serde(default)]
        table: Option<MeasuredTable>,
        tokens_per_s_per_gpu: f64,
    }

    fn grid() -> Vec<f64> {
        (20..=70).map(|c| f64::from(c) * 10.0).collect()
    }

    fn limits() -> CapLimits {
        CapLimits {
            min_w: Watts(200.0),
            max_w: Watts(700.0),
            step_w: Watts(10.0),
        }
    }

    fn job(id: &str, profile: &str, gpus: u32, bound: Option<f64>) -> TrueJob {
        let library: Library =
            toml::from_str(include_str!("../../sim/profiles/library.toml")).expect("library");
        let p = library
            .profile
            .iter()
            .find(|p| p.name == profile)
            .expect("profile");
        let per_gpu = match &p.table {
            Some(table) => table.curve(&grid(), 1, &p.physics),
            None => p.physics.curve(&grid(), 1, 1.0),
        };
        TrueJob::from_per_gpu(id, &per_gpu, p.tokens_per_s_per_gpu, gpus, bound).expect("curve")
    }

    #[test]
    fn the_oracle_keeps_every_bound_and_the_budget_and_beats_an_equal_cut() {
        let jobs = vec![
            job("1", "llama-3.1-70b-dense-pt-8g-compile", 4, Some(0.1)),
            job("2", "synthetic-memory-bound", 4, Some(0.5)),
            job("3", "qwen3-32b-dense-pt-8g-compile", 4, Some(0.25)),
        ];
        let uncapped: f64 = jobs.iter().map(|j| j.uncapped().power_w.0).sum();
        let budget = 0.7 * uncapped;
        let best = oracle(&jobs, budget, limits()).expect("oracle");
        assert!(best.bounds_broken.is_empty(), "{best:?}");
        assert!(best.power_w <= budget * (1.0 + 1e-9), "{best:?}");
        // The tier-aware equal split on the same true curves holds the bounds too, and
        // keeps no more than the oracle.
        let equal = equal_split(&jobs, budget, limits()).expect("equal");
        assert!(equal.bounds_broken.is_empty(), "{equal:?}");
        assert!(equal.power_w <= budget * (1.0 + 1e-9), "{equal:?}");
        assert!(best.tokens_per_s > equal.tokens_per_s, "{best:?} {equal:?}");
        let share = gap_recovered(&best, &equal, &best).expect("a gap");
        assert!((share - 1.0).abs() < 1e-12);
        assert_eq!(
            gap_recovered(&equal, &equal, &equal),
            None,
            "no gap, no share"
        );
        // One cut for every job, tiers ignored: the flex1 job's bound breaks.
        let even_caps = jobs.iter().map(|j| (j.id.clone(), 430.0)).collect();
        let even = score("even", &jobs, &even_caps);
        assert!(even.power_w <= budget, "{even:?}");
        assert_eq!(
            even.bounds_broken
                .iter()
                .map(|b| b.0.as_str())
                .collect::<Vec<_>>(),
            ["1"]
        );
    }

    #[test]
    fn a_cap_below_the_bound_counts_as_broken_and_unnamed_jobs_run_uncapped() {
        let jobs = vec![job("1", "llama-3.1-70b-dense-pt-8g-compile", 2, Some(0.0))];
        let low = score("x", &jobs, &[("1".to_string(), 300.0)].into());
        assert_eq!(low.bounds_broken.len(), 1, "{low:?}");
        let none = score("x", &jobs, &BTreeMap::new());
        assert!(none.bounds_broken.is_empty());
        assert_eq!(none.tokens_per_s, jobs[0].uncapped().throughput);
    }

    #[test]
    fn the_summary_file_holds_numbers_people_read() {
        let tidy = tidy_floats(serde_json::json!({
            "a": 8.400694999999999, "b": [10250.678, 0.012345678, 0.0], "n": 1764000000000u64,
            "s": "8.400694999999999",
        }));
        assert_eq!(
            tidy,
            serde_json::json!({
                "a": 8.401, "b": [10250.7, 0.01235, 0.0], "n": 1764000000000u64,
                "s": "8.400694999999999",
            })
        );
    }

    #[test]
    fn rounding_is_for_people_and_files_alike() {
        assert_eq!(round_to(8.400694999999999, 2), 8.4);
        assert_eq!(round_to(-0.0001, 1), 0.0);
        assert_eq!(round_to(1234.5678, 0), 1235.0);
    }
}
