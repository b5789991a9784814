//! A physical model of a training job's power–throughput curve on one GPU model, and a fit
//! of that model to a published PFI. The simulated GPUs, the workload library and the
//! synthetic curves used by `powerflexctl evaluate` tests all come from here.
//!
//! The model, per GPU, with `s` the SM clock as a fraction of its maximum:
//! - power `P(s) = static_w + dynamic_w · g(s)`, where `g(s) = s^clock_exponent` above the
//!   voltage knee `knee_clock_fraction` (voltage falls with clock) and linear in `s` below
//!   it (voltage at its floor); the uncapped draw is `static_w + dynamic_w`;
//! - step time `(1 − memory_bound_fraction)/s + memory_bound_fraction`: under a cap the
//!   GPU lowers the SM clock and leaves the memory clock alone (arXiv 2609.11542, Fig. 6),
//!   so the memory-bound share of a step does not slow down;
//! - under a cap the GPU settles a little below the limit (`CAP_SETTLE_FRACTION`).
//!
//! Memory-bound jobs (large `memory_bound_fraction`) therefore shed power cheaply: high PFI.

use serde::{Deserialize, Serialize};

use crate::pfi::pfi;
use crate::point::OperatingPoint;
use crate::units::Watts;

/// Under a binding cap, realised power as a fraction of the cap.
pub const CAP_SETTLE_FRACTION: f64 = 0.985;

/// Parameters of one job's per-GPU physics. See the module docs for the model.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Physics {
    /// Power that does not scale with the SM clock (memory, fabric, leakage), W per GPU.
    pub static_w: f64,
    /// SM dynamic power at full clock, W per GPU.
    pub dynamic_w: f64,
    /// Exponent of dynamic power in the SM clock above the voltage knee.
    pub clock_exponent: f64,
    /// SM clock fraction below which voltage is at its floor and power is linear in clock.
    pub knee_clock_fraction: f64,
    /// Share of uncapped step time that does not depend on the SM clock.
    pub memory_bound_fraction: f64,
    /// Lowest SM clock fraction the GPU will run at.
    pub min_clock_fraction: f64,
}

/// The state of one GPU of a job at a given cap.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct GpuState {
    /// Realised power, W.
    pub power_w: Watts,
    /// Throughput relative to uncapped (1.0 = full speed).
    pub relative_throughput: f64,
    /// SM clock relative to its maximum.
    pub sm_clock_fraction: f64,
    /// Whether the power cap is what holds the clock down.
    pub cap_binding: bool,
}

impl Physics {
    /// Uncapped draw, W per GPU.
    pub fn uncapped_w(&self) -> f64 {
        self.static_w + self.dynamic_w
    }

    fn dynamic_share(&self, s: f64) -> f64 {
        let knee = self.knee_clock_fraction;
        let at_knee = knee.powf(self.clock_exponent);
        if s >= knee {
            s.powf(self.clock_exponent)
        } else {
            at_knee * s / knee
        }
    }

    fn clock_for_share(&self, share: f64) -> f64 {
        let knee = self.knee_clock_fraction;
        let at_knee = knee.powf(self.clock_exponent);
        if share >= at_knee {
            share.powf(1.0 / self.clock_exponent)
        } else {
            knee * share / at_knee
        }
    }

    /// One GPU's power, relative throughput and clock under per-GPU cap `cap`.
    pub fn at_cap(&self, cap: Watts) -> GpuState {
        let target = cap.0 * CAP_SETTLE_FRACTION;
        if self.uncapped_w() <= target {
            return GpuState {
                power_w: Watts(self.uncapped_w()),
                relative_throughput: 1.0,
                sm_clock_fraction: 1.0,
                cap_binding: false,
            };
        }
        let share = ((target - self.static_w) / self.dynamic_w).max(0.0);
        let s = self
            .clock_for_share(share)
            .clamp(self.min_clock_fraction, 1.0);
        let power = self.static_w + self.dynamic_w * self.dynamic_share(s);
        let m = self.memory_bound_fraction;
        GpuState {
            power_w: Watts(power),
            relative_throughput: 1.0 / ((1.0 - m) / s + m),
            sm_clock_fraction: s,
            cap_binding: true,
        }
    }

    /// A job's operating points on `caps_w` with `gpus` GPUs and uncapped throughput
    /// `uncapped_throughput`.
    pub fn curve(
        &self,
        caps_w: &[f64],
        gpus: u32,
        uncapped_throughput: f64,
    ) -> Vec<OperatingPoint> {
        caps_w
            .iter()
            .map(|&c| {
                let state = self.at_cap(Watts(c));
                OperatingPoint {
                    cap_w: Watts(c),
                    power_w: state.power_w * f64::from(gpus),
                    throughput: uncapped_throughput * state.relative_throughput,
                }
            })
            .collect()
    }

    /// PFI of this model on a cap grid (the highest cap is the uncapped point).
    pub fn pfi_on(&self, caps_w: &[f64]) -> Option<f64> {
        pfi(&self.curve(caps_w, 1, 1.0))
    }
}

/// A job's per-GPU curve given as a measured table rather than as [`Physics`]: power and
/// relative throughput at each measured cap, linearly interpolated between them (and flat
/// outside), so real shapes — knees, flat tops, non-monotone power — run through the
/// simulator and the whole stack unchanged.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MeasuredTable {
    /// Per-GPU caps, W, ascending.
    pub cap_w: Vec<f64>,
    /// Per-GPU realised power at each cap, W.
    pub power_w: Vec<f64>,
    /// Throughput at each cap relative to the highest cap's.
    pub relative_throughput: Vec<f64>,
}

impl MeasuredTable {
    /// A table from a job's measured points (summed over `gpus` GPUs, caps unique),
    /// mapped onto a GPU whose caps run from `min_cap_w` to `max_cap_w`: caps map affinely
    /// from the job's measured range, and power keeps its ratio to the cap (a job drawing
    /// 80 % of its cap draws 80 % of the mapped cap). `None` for fewer than two points or
    /// a non-positive value.
    pub fn scaled(
        points: &[OperatingPoint],
        gpus: u32,
        min_cap_w: f64,
        max_cap_w: f64,
    ) -> Option<MeasuredTable> {
        let mut pts = points.to_vec();
        pts.sort_by(|a, b| a.cap_w.0.total_cmp(&b.cap_w.0));
        let ok = |x: f64| x.is_finite() && x > 0.0;
        if pts.len() < 2
            || gpus == 0
            || !pts
                .iter()
                .all(|p| ok(p.cap_w.0) && ok(p.power_w.0) && ok(p.throughput))
        {
            return None;
        }
        let (lo, hi) = (pts[0].cap_w.0, pts[pts.len() - 1].cap_w.0);
        let t_top = pts[pts.len() - 1].throughput;
        let map = |c: f64| min_cap_w + (c - lo) / (hi - lo) * (max_cap_w - min_cap_w);
        Some(MeasuredTable {
            cap_w: pts.iter().map(|p| map(p.cap_w.0)).collect(),
            power_w: pts
                .iter()
                .map(|p| p.power_w.0 / f64::from(gpus) / p.cap_w.0 * map(p.cap_w.0))
                .collect(),
            relative_throughput: pts.iter().map(|p| p.throughput / t_top).collect(),
        })
    }

    /// Whether the columns line up and every value is usable.
    pub fn is_valid(&self) -> bool {
        let n = self.cap_w.len();
        n >= 1
            && self.power_w.len() == n
            && self.relative_throughput.len() == n
            && self.cap_w.windows(2).all(|w| w[0] < w[1])
            && self
                .cap_w
                .iter()
                .chain(&self.power_w)
                .chain(&self.relative_throughput)
                .all(|x| x.is_finite() && *x > 0.0)
    }

    /// Power and relative throughput under per-GPU cap `cap`; the clock comes from
    /// `physics` (a fit of the table's PFI), which only feeds telemetry.
    pub fn at_cap(&self, cap: Watts, physics: &Physics) -> GpuState {
        let n = self.cap_w.len();
        let c = cap.0;
        let (power, relative) = if n == 0 {
            (physics.at_cap(cap).power_w.0, 1.0)
        } else if c <= self.cap_w[0] {
            (self.power_w[0], self.relative_throughput[0])
        } else if c >= self.cap_w[n - 1] {
            (self.power_w[n - 1], self.relative_throughput[n - 1])
        } else {
            let hi = self.cap_w.partition_point(|&k| k < c);
            let f = (c - self.cap_w[hi - 1]) / (self.cap_w[hi] - self.cap_w[hi - 1]);
            let lerp = |v: &[f64]| v[hi - 1] + f * (v[hi] - v[hi - 1]);
            (lerp(&self.power_w), lerp(&self.relative_throughput))
        };
        let top = self.cap_w.last().copied().unwrap_or(c);
        GpuState {
            // Never above the cap: the GPU enforces it, whatever the table says.
            power_w: Watts(power.min(c)),
            relative_throughput: relative,
            sm_clock_fraction: physics.at_cap(cap).sm_clock_fraction,
            cap_binding: c < top,
        }
    }

    /// The table's operating points on `caps_w` for `gpus` GPUs.
    pub fn curve(&self, caps_w: &[f64], gpus: u32, physics: &Physics) -> Vec<OperatingPoint> {
        caps_w
            .iter()
            .map(|&c| {
                let s = self.at_cap(Watts(c), physics);
                OperatingPoint {
                    cap_w: Watts(c),
                    power_w: s.power_w * f64::from(gpus),
                    throughput: s.relative_throughput,
                }
            })
            .collect()
    }
}

/// The paper's full H200 cap grid, W per GPU.
pub const H200_GRID_6: [f64; 6] = [200.0, 300.0, 400.0, 500.0, 600.0, 700.0];
/// The paper's 4-cap grid, W per GPU.
pub const H200_GRID_4: [f64; 4] = [200.0, 500.0, 600.0, 700.0];

/// What a fit aims for: the PFI on the grid the job was measured on and, where
/// published, on the 4-cap grid.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PfiTarget {
    /// PFI on `grid`.
    pub pfi: f64,
    /// Per-GPU caps the PFI was measured on, W (the highest is the uncapped point).
    pub grid: &'static [f64],
    pub pfi_4cap: Option<f64>,
    /// Whether the job is memory-heavy (MoE, fine-tuning): only a hint for the shape
    /// when `pfi_4cap` is unknown.
    pub memory_heavy: bool,
}

/// Fits [`Physics`] for an H200-class GPU (700 W) so that its PFI on `target.grid` matches
/// `target.pfi`, and on the 4-cap grid `target.pfi_4cap` when given. Searches the
/// shape (clock exponent, voltage knee, uncapped draw) on a small grid and solves the
/// memory-bound fraction by bisection (PFI rises monotonically with it). Returns the best
/// fit and its PFIs on `target.grid` and on the 4-cap grid.
pub fn fit_h200(target: PfiTarget) -> (Physics, f64, f64) {
    const STATIC_W: f64 = 150.0;
    let exponents = [1.0, 1.25, 1.5, 2.0, 2.5, 3.0];
    let knees = [0.3, 0.45, 0.6, 0.75, 0.9];
    let uncapped = [560.0, 590.0, 620.0, 655.0, 690.0];
    let mut best: Option<(f64, Physics, f64, f64)> = None;
    for &e in &exponents {
        for &k in &knees {
            for &u in &uncapped {
                let base = Physics {
                    static_w: STATIC_W,
                    dynamic_w: u - STATIC_W,
                    clock_exponent: e,
                    knee_clock_fraction: k,
                    memory_bound_fraction: 0.0,
                    min_clock_fraction: 0.05,
                };
                let physics = solve_memory_fraction(base, target.pfi, target.grid);
                let p6 = physics.pfi_on(target.grid).unwrap_or(0.0);
                let p4 = physics.pfi_on(&H200_GRID_4).unwrap_or(0.0);
                let err = match target.pfi_4cap {
                    Some(t4) => 3.0 * (p6 - target.pfi).abs() + (p4 - t4).abs(),
                    // No 4-cap value: prefer a typical shape for the job class.
                    None => {
                        let (pref_e, pref_k, pref_u) = if target.memory_heavy {
                            (1.5, 0.75, 620.0)
                        } else {
                            (2.0, 0.9, 690.0)
                        };
                        3.0 * (p6 - target.pfi).abs()
                            + 0.01 * ((e - pref_e).abs() + (k - pref_k).abs() * 4.0)
                            + 0.0002 * (u - pref_u).abs()
                    }
                };
                if best.as_ref().is_none_or(|b| err < b.0) {
                    best = Some((err, physics, p6, p4));
                }
            }
        }
    }
    // The grids above are non-empty, so `best` is set; fall back to a plain dense job.
    match best {
        Some((_, physics, p6, p4)) => (physics, p6, p4),
        None => {
            let physics = solve_memory_fraction(
                Physics {
                    static_w: STATIC_W,
                    dynamic_w: 540.0,
                    clock_exponent: 2.0,
                    knee_clock_fraction: 0.9,
                    memory_bound_fraction: 0.0,
                    min_clock_fraction: 0.05,
                },
                target.pfi,
                target.grid,
            );
            let p6 = physics.pfi_on(target.grid).unwrap_or(0.0);
            let p4 = physics.pfi_on(&H200_GRID_4).unwrap_or(0.0);
            (physics, p6, p4)
        }
    }
}

fn solve_memory_fraction(base: Physics, target_pfi: f64, grid: &[f64]) -> Physics {
    let (mut lo, mut hi) = (0.0_f64, 0.97_f64);
    for _ in 0..50 {
        let mid = 0.5 * (lo + hi);
        let trial = Physics {
            memory_bound_fraction: mid,
            ..base
        };
        if trial.pfi_on(grid).unwrap_or(0.0) < target_pfi {
            lo = mid;
        } else {
            hi = mid;
        }
    }
    Physics {
        memory_bound_fraction: 0.5 * (lo + hi),
        ..base
    }
}

/// The lowest per-GPU cap at which a job is certain to run within `max_slowdown` of its
/// uncapped speed when nothing is known of its curve (before it is calibrated, or after
/// it changed phase), W.
///
/// The bound is the chord of a concave curve: a job's throughput under a cap rises with
/// the cap with diminishing returns (the SM clock falls with the cap, dynamic power falls
/// faster than the clock above the voltage knee and in proportion below it, and the
/// memory-bound share of a step does not slow at all), and is certainly at least 0 at
/// the GPU's lowest cap. A concave curve lies above its chord from `(min_cap_w, 0)` to
/// `(max_cap_w, T_max)`, so at cap `c` the slowdown is at most
/// `(max_cap_w − c) / (max_cap_w − min_cap_w)`; the cap where that equals the bound is
/// returned. A flat stretch at the bottom (a GPU at its lowest clock) only lifts the
/// curve above the chord. A bound below [`CHORD_MIN_BOUND`] gives the highest cap, as a
/// bound of 0 does; no cap is below the lowest.
pub fn chord_safe_cap_w(max_slowdown: f64, min_cap_w: f64, max_cap_w: f64) -> f64 {
    let bound = if max_slowdown.is_finite() {
        max_slowdown.clamp(0.0, 1.0)
    } else {
        0.0
    };
    if bound < CHORD_MIN_BOUND {
        return max_cap_w;
    }
    let lo = min_cap_w.min(max_cap_w);
    chord_cap_for_loss(bound, lo, max_cap_w, 0.0).clamp(lo, max_cap_w)
}

/// The most loss (1 − T/T_max) cap `cap_w` may cost a job whose curve is concave in the
/// cap above `zero_cap_w` (where it may make no progress at all) and which loses
/// `from_loss` at `from_cap_w`: one minus the chord from `(zero_cap_w, 0)` to that point.
/// At or above `from_cap_w` the chord says nothing beyond `from_loss`; at or below the
/// zero cap, everything may be lost.
pub fn chord_loss(cap_w: f64, zero_cap_w: f64, from_cap_w: f64, from_loss: f64) -> f64 {
    let from_loss = from_loss.clamp(0.0, 1.0);
    if cap_w >= from_cap_w {
        return from_loss;
    }
    if from_cap_w <= zero_cap_w || cap_w <= zero_cap_w {
        return 1.0;
    }
    (1.0 - (1.0 - from_loss) * (cap_w - zero_cap_w) / (from_cap_w - zero_cap_w)).clamp(0.0, 1.0)
}

/// The cap where [`chord_loss`] reaches `max_loss`: the lowest cap that chord shows
/// within it (`from_cap_w` itself when `from_loss` already reaches `max_loss`).
pub fn chord_cap_for_loss(max_loss: f64, zero_cap_w: f64, from_cap_w: f64, from_loss: f64) -> f64 {
    let (max_loss, from_loss) = (max_loss.clamp(0.0, 1.0), from_loss.clamp(0.0, 1.0));
    if from_loss >= max_loss || from_cap_w <= zero_cap_w {
        return from_cap_w;
    }
    zero_cap_w + (1.0 - max_loss) / (1.0 - from_loss) * (from_cap_w - zero_cap_w)
}

/// The smallest bound the chord is trusted for. Real measured curves are not smooth: one
/// of the library's (an RTX 6000 ShuffleNet job, flat within noise) reads 8 % slower at
/// 96 % of its top cap than at 84 % of it, so a cap the chord allows for a bound of a few
/// percent may read past it on such a curve. Bounds below the default table's tightest
/// capped tier (flex1, 10 %) are given the highest cap instead.
pub const CHORD_MIN_BOUND: f64 = 0.10;

#[cfg(test)]
mod tests {
    use super::*;

    /// Every profile of the simulator's library (the paper's fits, the synthetic ones and
    /// the real measured tables) at every tier bound: the chord's safe cap never slows
    /// the job past the bound on its true curve.
    #[test]
    fn the_chord_safe_cap_holds_every_bound_on_every_library_profile() {
        #[derive(Deserialize)]
        struct Profile {
            name: String,
            physics: Physics,
            #[serde(default)]
            table: Option<MeasuredTable>,
        }
        #[derive(Deserialize)]
        struct Library {
            profile: Vec<Profile>,
        }
        let library: Library =
            toml::from_str(include_str!("../../sim/profiles/library.toml")).expect("library");
        assert!(library.profile.len() >= 30, "{}", library.profile.len());
        let (min_cap, max_cap) = (200.0, 700.0);
        for p in &library.profile {
            let speed = |cap: f64| match &p.table {
                Some(t) => t.at_cap(Watts(cap), &p.physics).relative_throughput,
                None => p.physics.at_cap(Watts(cap)).relative_throughput,
            };
            let top = speed(max_cap);
            for pct in 0..=60 {
                let bound = f64::from(pct) / 100.0;
                let cap = chord_safe_cap_w(bound, min_cap, max_cap);
                assert!((min_cap..=max_cap).contains(&cap));
                if bound < CHORD_MIN_BOUND {
                    assert_eq!(cap, max_cap, "{pct} %");
                }
                let slowdown = 1.0 - speed(cap) / top;
                assert!(
                    slowdown <= bound + 1e-9,
                    "{}: {:.1} % slower at {cap:.0} W, bound {pct} %",
                    p.name,
                    100.0 * slowdown
                );
            }
        }
        assert_eq!(chord_safe_cap_w(0.0, min_cap, max_cap), max_cap);
        assert_eq!(chord_safe_cap_w(0.5, min_cap, max_cap), 450.0);
        assert_eq!(chord_safe_cap_w(0.1, min_cap, max_cap), 650.0);
        assert_eq!(chord_safe_cap_w(0.09, min_cap, max_cap), max_cap);
        assert_eq!(chord_safe_cap_w(2.0, min_cap, max_cap), min_cap);
        assert_eq!(chord_safe_cap_w(f64::NAN, min_cap, max_cap), max_cap);
    }

    #[test]
    fn cap_lowers_clock_and_power_never_exceeds_cap() {
        let physics = Physics {
            static_w: 150.0,
            dynamic_w: 530.0,
            clock_exponent: 2.0,
            knee_clock_fraction: 0.75,
            memory_bound_fraction: 0.3,
            min_clock_fraction: 0.05,
        };
        let mut last_t = 0.0;
        for cap in [200.0, 300.0, 400.0, 500.0, 600.0, 700.0] {
            let s = physics.at_cap(Watts(cap));
            assert!(s.power_w.0 <= cap + 1e-9, "cap {cap}: {s:?}");
            assert!(s.relative_throughput >= last_t);
            last_t = s.relative_throughput;
        }
        assert!(!physics.at_cap(Watts(700.0)).cap_binding);
        assert!(physics.at_cap(Watts(400.0)).cap_binding);
    }

    #[test]
    fn fits_paper_pfis_on_both_grids() {
        for (p6, p4) in [
            (1.22, Some(1.37)),
            (2.67, Some(3.32)),
            (1.24, Some(1.16)),
            (1.10, None),
        ] {
            let (_, got6, got4) = fit_h200(PfiTarget {
                pfi: p6,
                grid: &H200_GRID_6,
                pfi_4cap: p4,
                memory_heavy: false,
            });
            assert!((got6 - p6).abs() <= 0.03, "{p6}: got {got6}");
            if let Some(p4) = p4 {
                assert!((got4 - p4).abs() <= 0.05, "{p4}: got {got4}");
            }
        }
    }
}

/// One row of the paper's per-job PFI table (`paper_pfi_h200.csv`, Tables 6–9).
#[derive(Debug, Clone, PartialEq)]
pub struct PaperJob {
    pub group: String,
    pub arch: String,
    pub task: String,
    pub model: String,
    pub gpus: u32,
    pub variant: String,
    pub caps_measured: u32,
    pub pfi: f64,
    pub pfi_4cap: Option<f64>,
}

impl PaperJob {
    /// A name usable as a job id: `qwen3-30b-a3b-moe-ft-8g-seq2048-bs8`.
    pub fn name(&self) -> String {
        let raw = format!(
            "{}-{}-{}-{}g-{}",
            self.model, self.arch, self.task, self.gpus, self.variant
        );
        let mut name = String::new();
        for c in raw.chars() {
            let c = c.to_ascii_lowercase();
            if c.is_ascii_alphanumeric() || c == '.' {
                name.push(c);
            } else if !name.ends_with('-') {
                name.push('-');
            }
        }
        name.trim_end_matches('-').to_string()
    }

    /// Memory-heavy jobs: MoE, or fine-tuning (LoRA-style jobs move more bytes per FLOP).
    pub fn memory_heavy(&self) -> bool {
        self.arch == "moe" || self.task == "ft"
    }

    /// The per-GPU caps the paper measured this job at.
    pub fn paper_grid(&self) -> &'static [f64] {
        match self.caps_measured {
            0..=3 => &[200.0, 500.0, 700.0],
            4 | 5 => &H200_GRID_4,
            _ => &H200_GRID_6,
        }
    }

    /// Uncapped tokens/s for the whole job: 6·N_active FLOPs per token at a model-class
    /// utilisation of the H200's 989 dense BF16 TFLOP/s (40 % dense, 20 % MoE). A
    /// plausible scale, not a measurement.
    pub fn uncapped_tokens_per_s(&self) -> f64 {
        let active_params = active_parameters(&self.model);
        let mfu = if self.arch == "moe" { 0.20 } else { 0.40 };
        f64::from(self.gpus) * mfu * 989e12 / (6.0 * active_params)
    }
}

/// Active parameters per token of the models in the paper's tables (public model cards).
fn active_parameters(model: &str) -> f64 {
    let lower = model.to_ascii_lowercase();
    let table: [(&str, f64); 7] = [
        ("llama-3.1-70b", 70e9),
        ("qwen3-32b", 32e9),
        ("gpt-oss-20b", 3.6e9),
        ("qwen3-30b-a3b", 3.3e9),
        ("mistral-small-24b", 24e9),
        ("gemma-4-26b-a4b", 4e9),
        ("deepseek-v2-lite", 2.4e9),
    ];
    table
        .iter()
        .find(|(name, _)| lower.starts_with(name))
        .map_or(10e9, |(_, p)| *p)
}

/// Why the paper table did not parse.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum PaperTableError {
    #[error("line {line}: expected the header group,arch,task,model,gpus,variant,caps_measured,pfi,pfi_ci_low,pfi_ci_high,pfi_4cap")]
    Header { line: usize },
    #[error("line {line}, column {column}: \"{text}\" is not valid")]
    BadValue {
        line: usize,
        column: &'static str,
        text: String,
    },
}

/// Parses `paper_pfi_h200.csv`.
pub fn parse_paper_table(text: &str) -> Result<Vec<PaperJob>, PaperTableError> {
    const HEADER: &str =
        "group,arch,task,model,gpus,variant,caps_measured,pfi,pfi_ci_low,pfi_ci_high,pfi_4cap";
    let mut rows = text
        .lines()
        .enumerate()
        .filter(|(_, l)| !l.trim().is_empty());
    match rows.next() {
        Some((_, h)) if h.trim() == HEADER => {}
        Some((i, _)) => return Err(PaperTableError::Header { line: i + 1 }),
        None => return Err(PaperTableError::Header { line: 1 }),
    }
    let mut jobs = Vec::new();
    for (i, line) in rows {
        let line_no = i + 1;
        let f: Vec<&str> = line.split(',').map(str::trim).collect();
        let bad = |column: &'static str, text: &str| PaperTableError::BadValue {
            line: line_no,
            column,
            text: text.chars().take(40).collect(),
        };
        if f.len() != 11 {
            return Err(bad("(row)", line));
        }
        let gpus = f[4].parse::<u32>().map_err(|_| bad("gpus", f[4]))?;
        let caps = f[6]
            .parse::<u32>()
            .map_err(|_| bad("caps_measured", f[6]))?;
        let pfi = f[7]
            .parse::<f64>()
            .ok()
            .filter(|v| v.is_finite() && *v > 0.0)
            .ok_or_else(|| bad("pfi", f[7]))?;
        let pfi_4cap = if f[10].is_empty() {
            None
        } else {
            Some(
                f[10]
                    .parse::<f64>()
                    .ok()
                    .filter(|v| v.is_finite() && *v > 0.0)
                    .ok_or_else(|| bad("pfi_4cap", f[10]))?,
            )
        };
        jobs.push(PaperJob {
            group: f[0].to_string(),
            arch: f[1].to_string(),
            task: f[2].to_string(),
            model: f[3].to_string(),
            gpus,
            variant: f[5].to_string(),
            caps_measured: caps,
            pfi,
            pfi_4cap,
        });
    }
    Ok(jobs)
}

/// A synthetic "measured" curve for a paper job: the fitted physics on the paper's cap
/// grid for that job, with multiplicative gaussian measurement noise `noise` (the paper's
/// repeat-run noise is ~0.5 %). Labelled synthetic wherever it is written.
pub fn synthetic_record(
    job: &PaperJob,
    noise: f64,
    rng: &mut crate::rng::SplitMix64,
) -> crate::curves_csv::JobCurveRecord {
    let (physics, _, _) = fit_h200(PfiTarget {
        pfi: job.pfi,
        grid: job.paper_grid(),
        pfi_4cap: job.pfi_4cap,
        memory_heavy: job.memory_heavy(),
    });
    let points = physics
        .curve(job.paper_grid(), job.gpus, job.uncapped_tokens_per_s())
        .into_iter()
        .map(|p| OperatingPoint {
            cap_w: p.cap_w,
            power_w: p.power_w * (1.0 + noise * rng.normal()),
            throughput: p.throughput * (1.0 + noise * rng.normal()),
        })
        .collect();
    crate::curves_csv::JobCurveRecord {
        job: job.name(),
        gpus: Some(job.gpus),
        tier: None,
        // DRAM activity × copy utilisation rises with the memory-bound share; synthetic.
        dram_copy_product: Some((0.05 + 0.6 * physics.memory_bound_fraction).min(1.0)),
        points,
        sigma: Vec::new(),
    }
}
