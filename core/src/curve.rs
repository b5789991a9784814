//! Power–throughput curves: what a job draws and how fast it runs at each per-GPU cap.
//!
//! A [`CapCurve`] is piecewise linear in the cap between knots. Between two measured caps
//! both power and throughput are interpolated linearly, so in the (power, throughput)
//! plane the curve is the polyline through the knots. Outside the knots it is flat: below
//! the lowest knot a job is assumed to draw (and run) exactly as at that knot — a job never
//! draws less than its power at its lowest known cap, so no policy can bank savings that
//! were never measured; above the highest knot it runs uncapped.
//!
//! [`estimate_curve`] turns sparse, noisy calibration points into a curve that is monotone
//! (throughput and power never rise as the cap falls) and concave in (power, throughput)
//! where the noise allows; [`estimate_population`] additionally shrinks each job's shape
//! toward the population's, by how much its own points can be trusted. That shrinkage is
//! what keeps the optimiser from chasing noise: a job whose points cannot be told apart
//! from the average is treated as average, and a set of average jobs is allocated exactly
//! as the equal-weight baseline would allocate it.

use serde::{Deserialize, Serialize};

use crate::units::Watts;

// The point type is the PFI's as much as the curve's: it lives in its own module, so
// neither of the two imports the other back.
use crate::point::OperatingPoint;

/// Where a curve's numbers came from; consumers label results accordingly.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum CurveSource {
    /// Measured points taken as exact (offline files, the evaluation's true curves).
    Measured,
    /// Fitted from noisy calibration points.
    Estimated,
    /// Built from a PFI alone (telemetry predictor or a site default): a guess.
    Prior,
}

/// Why a set of points does not make a curve.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum CurveError {
    #[error("a curve needs at least one point")]
    Empty,
    #[error("point at cap {cap_w} W has a non-finite or non-positive value (cap, power and throughput must be > 0)")]
    NotPositive { cap_w: f64 },
    #[error("cap {cap_w} W appears twice; each cap may be measured once")]
    DuplicateCap { cap_w: f64 },
    #[error("a PFI prior needs PFI > 0, P_max > 0 and T_max > 0 (got PFI {pfi}, P_max {p_max_w} W, T_max {t_max})")]
    BadPrior { pfi: f64, p_max_w: f64, t_max: f64 },
}

/// A job's power and throughput as functions of its per-GPU cap.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(try_from = "CapCurveWire")]
pub struct CapCurve {
    knots: Vec<OperatingPoint>,
    source: CurveSource,
    /// One standard deviation of the throughput estimate, as a fraction of uncapped
    /// throughput (0 for exact curves).
    relative_uncertainty: f64,
    /// Knots below this cap are extrapolated, not read; `None` = all knots were read.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    extrapolated_below_w: Option<Watts>,
    /// One standard deviation of each knot's estimate, in knot order; empty when the
    /// curve carries no per-point uncertainty (exact curves, priors, older estimates).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    knot_sigma: Vec<KnotSigma>,
    /// A lower bound on the throughput at each knot, in knot order: what the allocator
    /// sets tier floors and weighs its choices on (see [`CapCurve::throughput_bound_at`]).
    /// Empty when the knots' own throughput is the bound (exact curves, priors, curves
    /// estimated from windows without smoothing).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    lower_throughput: Vec<f64>,
}

/// The standard error of one knot: how far its power and throughput may be from the
/// truth, from the spread of the measurement windows behind it.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct KnotSigma {
    /// One standard deviation of the summed power, W.
    pub power_w: f64,
    /// One standard deviation of the throughput, in the job's throughput unit.
    pub throughput: f64,
}

impl CapCurve {
    /// A curve through `points` taken as exact (sorted by cap; caps must be unique).
    pub fn from_points(points: &[OperatingPoint]) -> Result<CapCurve, CurveError> {
        CapCurve::with_source(points, CurveSource::Measured, 0.0)
    }

    /// A curve through `points` with a stated source and uncertainty.
    pub fn with_source(
        points: &[OperatingPoint],
        source: CurveSource,
        relative_uncertainty: f64,
    ) -> Result<CapCurve, CurveError> {
        if points.is_empty() {
            return Err(CurveError::Empty);
        }
        for p in points {
            let ok = |x: f64| x.is_finite() && x > 0.0;
            if !(ok(p.cap_w.0) && ok(p.power_w.0) && ok(p.throughput)) {
                return Err(CurveError::NotPositive { cap_w: p.cap_w.0 });
            }
        }
        let mut knots = points.to_vec();
        knots.sort_by(|a, b| a.cap_w.0.total_cmp(&b.cap_w.0));
        for pair in knots.windows(2) {
            if pair[0].cap_w.0 == pair[1].cap_w.0 {
                return Err(CurveError::DuplicateCap {
                    cap_w: pair[0].cap_w.0,
                });
            }
        }
        Ok(CapCurve {
            knots,
            source,
            relative_uncertainty,
            extrapolated_below_w: None,
            knot_sigma: Vec::new(),
            lower_throughput: Vec::new(),
        })
    }

    /// A prior curve for a job known only by its uncapped point and PFI: power follows the
    /// cap (P = P_max · cap / max_cap, never above P_max) and throughput loses
    /// `(1 − P/P_max) / PFI`, so the curve's PFI on any grid is exactly `pfi`. Knots every
    /// `step_w` from `min_cap` to `max_cap`.
    pub fn from_pfi_prior(
        p_max: Watts,
        t_max: f64,
        pfi: f64,
        min_cap: Watts,
        max_cap: Watts,
        knot_step: Watts,
    ) -> Result<CapCurve, CurveError> {
        let valid = |x: f64| x.is_finite() && x > 0.0;
        if !(valid(pfi) && valid(p_max.0) && valid(t_max)) {
            return Err(CurveError::BadPrior {
                pfi,
                p_max_w: p_max.0,
                t_max,
            });
        }
        let step = knot_step.0.max(1.0);
        let mut knots = Vec::new();
        let mut cap = max_cap.0;
        while cap > min_cap.0 + 1e-9 {
            knots.push(prior_point(p_max, t_max, pfi, Watts(cap), max_cap));
            cap -= step;
        }
        knots.push(prior_point(p_max, t_max, pfi, min_cap, max_cap));
        CapCurve::with_source(&knots, CurveSource::Prior, 0.25)
    }

    pub fn knots(&self) -> &[OperatingPoint] {
        &self.knots
    }

    pub fn source(&self) -> CurveSource {
        self.source
    }

    pub fn relative_uncertainty(&self) -> f64 {
        self.relative_uncertainty
    }

    /// The lowest cap whose knot was read rather than extrapolated.
    pub fn lowest_read_cap(&self) -> Watts {
        self.extrapolated_below_w.unwrap_or(self.lowest().cap_w)
    }

    /// The uncapped point: the highest cap known.
    pub fn uncapped(&self) -> OperatingPoint {
        // `knots` is never empty (checked at construction).
        self.knots[self.knots.len() - 1]
    }

    /// The lowest cap known.
    pub fn lowest(&self) -> OperatingPoint {
        self.knots[0]
    }

    /// Where `cap` falls among the knots: at or below the first, at or above the last, or
    /// between knot `hi - 1` and knot `hi`, a fraction `f` of the way.
    fn locate(&self, cap: f64) -> Place {
        let n = self.knots.len();
        if cap <= self.knots[0].cap_w.0 {
            return Place::Knot(0);
        }
        if cap >= self.knots[n - 1].cap_w.0 {
            return Place::Knot(n - 1);
        }
        // First knot with cap >= c; it exists and is > 0 because first.cap < c < last.cap.
        let hi = self.knots.partition_point(|k| k.cap_w.0 < cap);
        let (a, b) = (self.knots[hi - 1].cap_w.0, self.knots[hi].cap_w.0);
        Place::Between(hi, (cap - a) / (b - a))
    }

    /// Power and throughput at per-GPU cap `cap` (flat outside the knots).
    pub fn at(&self, cap: Watts) -> OperatingPoint {
        match self.locate(cap.0) {
            Place::Knot(i) => OperatingPoint {
                cap_w: cap,
                ..self.knots[i]
            },
            Place::Between(hi, f) => {
                let (a, b) = (self.knots[hi - 1], self.knots[hi]);
                OperatingPoint {
                    cap_w: cap,
                    power_w: Watts(a.power_w.0 + f * (b.power_w.0 - a.power_w.0)),
                    throughput: a.throughput + f * (b.throughput - a.throughput),
                }
            }
        }
    }

    /// Power at per-GPU cap `cap` with the throughput the job is known to reach there at
    /// least: the curve's lower bound where it carries one (an estimate smoothed across
    /// jobs or extended below its readings), interpolated between knots as
    /// [`CapCurve::at`] is, and never above the estimate itself. A tier's floor is a
    /// promise, so it is set on this, not on the estimate.
    pub fn at_lower_bound(&self, cap: Watts) -> OperatingPoint {
        if self.lower_throughput.len() != self.knots.len() {
            return self.at(cap);
        }
        // One search for both, as the allocator asks this for every cap it weighs.
        let (point, bound) = match self.locate(cap.0) {
            Place::Knot(i) => (self.knots[i], self.lower_throughput[i]),
            Place::Between(hi, f) => {
                let (a, b) = (self.knots[hi - 1], self.knots[hi]);
                let (la, lb) = (self.lower_throughput[hi - 1], self.lower_throughput[hi]);
                let point = OperatingPoint {
                    cap_w: cap,
                    power_w: Watts(a.power_w.0 + f * (b.power_w.0 - a.power_w.0)),
                    throughput: a.throughput + f * (b.throughput - a.throughput),
                };
                (point, la + f * (lb - la))
            }
        };
        OperatingPoint {
            cap_w: cap,
            power_w: point.power_w,
            throughput: bound.min(point.throughput),
        }
    }

    /// The throughput of [`CapCurve::at_lower_bound`].
    pub fn throughput_bound_at(&self, cap: Watts) -> f64 {
        self.at_lower_bound(cap).throughput
    }

    /// Per-knot standard errors, in knot order (empty when unknown).
    pub fn knot_sigma(&self) -> &[KnotSigma] {
        &self.knot_sigma
    }

    /// Standard error of power and throughput at `cap`, interpolated between knots the
    /// way the values are; `None` when the curve carries no per-point uncertainty.
    pub fn sigma_at(&self, cap: Watts) -> Option<KnotSigma> {
        if self.knot_sigma.len() != self.knots.len() {
            return None;
        }
        let c = cap.0;
        let n = self.knots.len();
        if c <= self.knots[0].cap_w.0 {
            return Some(self.knot_sigma[0]);
        }
        if c >= self.knots[n - 1].cap_w.0 {
            return Some(self.knot_sigma[n - 1]);
        }
        let hi = self.knots.partition_point(|k| k.cap_w.0 < c);
        let (a, b) = (self.knots[hi - 1].cap_w.0, self.knots[hi].cap_w.0);
        let f = (c - a) / (b - a);
        let (sa, sb) = (self.knot_sigma[hi - 1], self.knot_sigma[hi]);
        Some(KnotSigma {
            power_w: sa.power_w + f * (sb.power_w - sa.power_w),
            throughput: sa.throughput + f * (sb.throughput - sa.throughput),
        })
    }

    /// This curve with every knot's power raised by `z` of its standard errors: what an
    /// optimiser should plan with when it picks among noisy curves, because it favours
    /// exactly the jobs whose noise flatters their savings. Unchanged without per-knot
    /// uncertainty or for a `z` that is not a positive number.
    pub fn with_power_margin(&self, z: f64) -> CapCurve {
        if self.knot_sigma.len() != self.knots.len() || !(z.is_finite() && z > 0.0) {
            return self.clone();
        }
        let mut out = self.clone();
        for (k, s) in out.knots.iter_mut().zip(&self.knot_sigma) {
            k.power_w = Watts(k.power_w.0 + z * s.power_w);
        }
        // Raising each knot by its own error can break monotonicity in the cap.
        for i in (0..out.knots.len().saturating_sub(1)).rev() {
            let above = out.knots[i + 1].power_w.0;
            if out.knots[i].power_w.0 > above {
                out.knots[i].power_w = Watts(above);
            }
        }
        out
    }

    /// The PFI of the knots (Eq. 1).
    pub fn pfi(&self) -> Option<f64> {
        crate::pfi::pfi(&self.knots)
    }

    /// This curve with each knot's standard errors from `sigma(cap)`: for a curve shaped
    /// here from points whose uncertainty was measured elsewhere (the node agents'
    /// windows), so that [`crate::allocate::allocate_cautious`] can weigh it.
    pub fn with_knot_sigma(&self, sigma: impl Fn(Watts) -> KnotSigma) -> CapCurve {
        let mut curve = self.clone();
        curve.knot_sigma = self.knots.iter().map(|k| sigma(k.cap_w)).collect();
        curve
    }

    /// This curve with one more knot above its highest, at `cap_w` drawing `power_w` and
    /// running as fast as the highest knot: for a curve measured only up to a cap below
    /// the GPUs' maximum, whose flat extension above its top would claim the cap costs no
    /// more power. The new knot's standard error is the highest knot's. Unchanged when
    /// `cap_w` is not above the highest knot or `power_w` is not a positive number.
    pub fn with_knot_above(&self, cap_w: Watts, power_w: Watts) -> CapCurve {
        let Some(top) = self.knots.last().copied() else {
            return self.clone();
        };
        if cap_w.0 <= top.cap_w.0 + 0.5 || !power_w.0.is_finite() || power_w.0 <= 0.0 {
            return self.clone();
        }
        let mut curve = self.clone();
        curve.knots.push(OperatingPoint {
            cap_w,
            power_w: Watts(power_w.0.max(top.power_w.0)),
            throughput: top.throughput,
        });
        if let Some(&last) = curve.knot_sigma.last() {
            curve.knot_sigma.push(last);
        }
        if let Some(&last) = curve.lower_throughput.last() {
            curve.lower_throughput.push(last);
        }
        curve
    }

    /// This curve with one more knot above its highest, for a job never read above that
    /// knot (walked or learned only under a cut): at `cap_w` drawing `power_w` (at least
    /// the highest knot's) and running `throughput_at_most`, the most the job may run
    /// uncapped. Slowdown is judged against the uncapped rate, so a tier floor set
    /// against the highest reading (the flat extension) is set against too little and
    /// lets a cut past the bound; against the most the uncapped rate may be, with the
    /// throughput between the highest reading and it taken along their chord (the least
    /// a concave curve runs there relative to that top), the floor holds. This flatters
    /// what a raise buys: a job planned on it must not be traded on (see
    /// `allocate_cautious_doubting`'s `in_doubt`). Unchanged when `cap_w` is not above
    /// the highest knot, or `power_w` or `throughput_at_most` is not a positive number.
    pub fn with_unread_top(
        &self,
        cap_w: Watts,
        power_w: Watts,
        throughput_at_most: f64,
    ) -> CapCurve {
        let Some(top) = self.knots.last().copied() else {
            return self.clone();
        };
        let positive = |x: f64| x.is_finite() && x > 0.0;
        if cap_w.0 <= top.cap_w.0 + 0.5 || !positive(power_w.0) || !positive(throughput_at_most) {
            return self.clone();
        }
        let mut curve = self.clone();
        let throughput = throughput_at_most.max(top.throughput);
        curve.knots.push(OperatingPoint {
            cap_w,
            power_w: Watts(power_w.0.max(top.power_w.0)),
            throughput,
        });
        if curve.lower_throughput.len() + 1 == curve.knots.len() {
            curve.lower_throughput.push(throughput);
        }
        if let Some(&last) = curve.knot_sigma.last() {
            curve.knot_sigma.push(last);
        }
        curve
    }

    /// The same curve with each knot's power replaced by `power(cap_w, power_w)` (kept
    /// above 1 mW), throughput, source and uncertainty unchanged: the controller's
    /// correction of a job's power by what it measures, or the bound `cap × GPUs` the
    /// hard budget mode allocates on.
    pub fn map_power(&self, power: impl Fn(Watts, Watts) -> Watts) -> CapCurve {
        let mut curve = self.clone();
        for k in &mut curve.knots {
            let p = power(k.cap_w, k.power_w).0;
            k.power_w = Watts(if p.is_finite() {
                p.max(1e-3)
            } else {
                k.power_w.0
            });
        }
        curve
    }
}

/// Where a cap falls among a curve's knots (see `CapCurve::locate`).
enum Place {
    /// At knot `i`'s values: the knot itself, or outside the knots, where a curve is flat.
    Knot(usize),
    /// Between knot `hi - 1` and knot `hi`, this fraction of the way.
    Between(usize, f64),
}

/// A curve as it arrives over the wire or from disk, validated into a [`CapCurve`].
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct CapCurveWire {
    knots: Vec<OperatingPoint>,
    source: CurveSource,
    relative_uncertainty: f64,
    #[serde(default)]
    extrapolated_below_w: Option<Watts>,
    #[serde(default)]
    knot_sigma: Vec<KnotSigma>,
    #[serde(default)]
    lower_throughput: Vec<f64>,
}

impl TryFrom<CapCurveWire> for CapCurve {
    type Error = CurveError;

    fn try_from(wire: CapCurveWire) -> Result<CapCurve, CurveError> {
        let mut curve = CapCurve::with_source(&wire.knots, wire.source, wire.relative_uncertainty)?;
        curve.extrapolated_below_w = wire.extrapolated_below_w.filter(|w| w.0.is_finite());
        let usable = |x: f64| x.is_finite() && x >= 0.0;
        if wire.knot_sigma.len() == curve.knots.len()
            && wire
                .knot_sigma
                .iter()
                .all(|s| usable(s.power_w) && usable(s.throughput))
        {
            // Knots were sorted by cap; the wire lists sigmas in the wire's knot order.
            let mut paired: Vec<(OperatingPoint, KnotSigma)> =
                wire.knots.iter().copied().zip(wire.knot_sigma).collect();
            paired.sort_by(|a, b| a.0.cap_w.0.total_cmp(&b.0.cap_w.0));
            curve.knot_sigma = paired.into_iter().map(|(_, s)| s).collect();
        }
        // A bound is kept only when it is one for every knot: usable and not above it.
        if wire.lower_throughput.len() == curve.knots.len() {
            let mut paired: Vec<(OperatingPoint, f64)> = wire
                .knots
                .iter()
                .copied()
                .zip(wire.lower_throughput)
                .collect();
            paired.sort_by(|a, b| a.0.cap_w.0.total_cmp(&b.0.cap_w.0));
            if paired
                .iter()
                .all(|(k, b)| b.is_finite() && *b > 0.0 && *b <= k.throughput)
            {
                curve.lower_throughput = paired.into_iter().map(|(_, b)| b).collect();
            }
        }
        Ok(curve)
    }
}

fn prior_point(p_max: Watts, t_max: f64, pfi: f64, cap: Watts, max_cap: Watts) -> OperatingPoint {
    let power = (p_max.0 * cap.0 / max_cap.0).min(p_max.0);
    let power_cut = 1.0 - power / p_max.0;
    let throughput = t_max * (1.0 - power_cut / pfi).max(0.01);
    OperatingPoint {
        cap_w: cap,
        power_w: Watts(power),
        throughput,
    }
}

/// Weighted pool-adjacent-violators: the non-decreasing sequence closest to `values` in
/// weighted least squares.
pub(crate) fn isotonic_non_decreasing(values: &[f64], weights: &[f64]) -> Vec<f64> {
    // Blocks of (weighted mean, total weight, count).
    let mut blocks: Vec<(f64, f64, usize)> = Vec::with_capacity(values.len());
    for (&v, &w) in values.iter().zip(weights) {
        blocks.push((v, w, 1));
        while blocks.len() >= 2 {
            let n = blocks.len();
            let (m2, w2, c2) = blocks[n - 1];
            let (m1, w1, c1) = blocks[n - 2];
            if m1 <= m2 {
                break;
            }
            let w = w1 + w2;
            let mean = if w > 0.0 {
                (m1 * w1 + m2 * w2) / w
            } else {
                (m1 + m2) / 2.0
            };
            blocks.truncate(n - 2);
            blocks.push((mean, w, c1 + c2));
        }
    }
    blocks
        .into_iter()
        .flat_map(|(m, _, c)| std::iter::repeat_n(m, c))
        .collect()
}

/// Turns one job's calibration points (possibly repeated caps, noisy) into a curve.
///
/// `relative_noise` is one standard deviation of a single reading of power or throughput,
/// as a fraction (the agent measures it from the spread of its steady-state samples).
/// Steps: average repeated caps; force power and throughput to be non-decreasing in the
/// cap (isotonic regression); then make throughput concave in power — the slope
/// dT/dP may only fall as power rises — when the concave fit stays within 2.5 σ of every
/// point, i.e. where the data allow it.
pub fn estimate_curve(
    observations: &[OperatingPoint],
    relative_noise: f64,
) -> Result<CapCurve, CurveError> {
    finish_curve(average_readings(observations)?, relative_noise)
}

/// Estimates a curve from measurement windows — one reading per window, several per cap —
/// keeping the shape the data support and carrying each point's uncertainty.
///
/// - Each cap's point is the mean of its windows.
/// - Its standard error comes from the spread of the windows: the relative variance is
///   pooled over all of the job's caps (a cap read twice says little about its own
///   spread) and blended with `prior_noise` (one window's relative standard deviation as
///   the measuring side believes it) weighted as two degrees of freedom, so one or two
///   unlucky windows neither claim certainty nor panic the allocator.
/// - Power and throughput are each made non-decreasing in the cap by weighted isotonic
///   regression (pool-adjacent-violators, weights = windows / variance), because a lower
///   cap cannot make a job faster or draw more: a rise is noise. Nothing else is imposed:
///   no concavity (real curves have knees), no smoothing across caps (real curves have
///   flat tops), so with enough windows the estimate converges to the measured curve.
///
/// The curve spans only the caps read; below the lowest one it is flat (see
/// [`CapCurve::at`]), so no policy banks savings that were never measured.
pub fn estimate_from_windows(
    windows: &[OperatingPoint],
    prior_noise: f64,
) -> Result<CapCurve, CurveError> {
    if windows.is_empty() {
        return Err(CurveError::Empty);
    }
    for p in windows {
        let ok = |x: f64| x.is_finite() && x > 0.0;
        if !(ok(p.cap_w.0) && ok(p.power_w.0) && ok(p.throughput)) {
            return Err(CurveError::NotPositive { cap_w: p.cap_w.0 });
        }
    }
    let prior = if prior_noise.is_finite() && prior_noise > 0.0 {
        prior_noise
    } else {
        0.0
    };
    let mut sorted = windows.to_vec();
    sorted.sort_by(|a, b| a.cap_w.0.total_cmp(&b.cap_w.0));
    // Groups of windows at one cap: (cap, readings).
    let mut groups: Vec<(f64, Vec<OperatingPoint>)> = Vec::new();
    for p in sorted {
        match groups.last_mut() {
            Some((cap, members)) if (*cap - p.cap_w.0).abs() < 1e-9 => members.push(p),
            _ => groups.push((p.cap_w.0, vec![p])),
        }
    }
    let mean = |xs: &[OperatingPoint], f: fn(&OperatingPoint) -> f64| {
        xs.iter().map(f).sum::<f64>() / xs.len() as f64
    };
    let power_of: fn(&OperatingPoint) -> f64 = |p| p.power_w.0;
    let rate_of: fn(&OperatingPoint) -> f64 = |p| p.throughput;
    let (mut ss_p, mut ss_t, mut dof) = (0.0, 0.0, 0.0);
    let mut means = Vec::with_capacity(groups.len());
    for (cap, members) in &groups {
        let (mp, mt) = (mean(members, power_of), mean(members, rate_of));
        for m in members {
            ss_p += ((m.power_w.0 - mp) / mp).powi(2);
            ss_t += ((m.throughput - mt) / mt).powi(2);
        }
        dof += (members.len() - 1) as f64;
        means.push((*cap, mp, mt, members.len() as f64));
    }
    const PRIOR_DOF: f64 = 2.0;
    let pooled = |ss: f64| ((ss + PRIOR_DOF * prior * prior) / (dof + PRIOR_DOF)).sqrt();
    let (rel_p, rel_t) = (pooled(ss_p), pooled(ss_t));
    let weights: Vec<f64> = means.iter().map(|m| m.3).collect();
    let power = isotonic_non_decreasing(&means.iter().map(|m| m.1).collect::<Vec<_>>(), &weights);
    let rate = isotonic_non_decreasing(&means.iter().map(|m| m.2).collect::<Vec<_>>(), &weights);
    let knots: Vec<OperatingPoint> = means
        .iter()
        .zip(power.iter().zip(&rate))
        .map(|(m, (&p, &t))| OperatingPoint {
            cap_w: Watts(m.0),
            power_w: Watts(p),
            throughput: t,
        })
        .collect();
    let knot_sigma = means
        .iter()
        .zip(power.iter().zip(&rate))
        .map(|(m, (&p, &t))| KnotSigma {
            power_w: rel_p * p / m.3.sqrt(),
            throughput: rel_t * t / m.3.sqrt(),
        })
        .collect();
    let windows_per_cap = weights.iter().sum::<f64>() / weights.len() as f64;
    let mut curve = CapCurve::with_source(
        &knots,
        CurveSource::Estimated,
        rel_t / windows_per_cap.sqrt(),
    )?;
    curve.knot_sigma = knot_sigma;
    Ok(curve)
}

/// Calibration readings with repeated caps averaged, sorted by cap.
#[derive(Debug, Clone)]
struct Readings {
    caps: Vec<f64>,
    power: Vec<f64>,
    throughput: Vec<f64>,
    /// Readings averaged into each entry.
    weight: Vec<f64>,
}

fn average_readings(observations: &[OperatingPoint]) -> Result<Readings, CurveError> {
    if observations.is_empty() {
        return Err(CurveError::Empty);
    }
    for p in observations {
        let ok = |x: f64| x.is_finite() && x > 0.0;
        if !(ok(p.cap_w.0) && ok(p.power_w.0) && ok(p.throughput)) {
            return Err(CurveError::NotPositive { cap_w: p.cap_w.0 });
        }
    }
    let mut sorted = observations.to_vec();
    sorted.sort_by(|a, b| a.cap_w.0.total_cmp(&b.cap_w.0));
    let mut r = Readings {
        caps: Vec::new(),
        power: Vec::new(),
        throughput: Vec::new(),
        weight: Vec::new(),
    };
    for p in &sorted {
        match r.caps.last() {
            Some(&last) if (last - p.cap_w.0).abs() < 1e-9 => {
                let i = r.caps.len() - 1;
                let w = r.weight[i];
                r.power[i] = (r.power[i] * w + p.power_w.0) / (w + 1.0);
                r.throughput[i] = (r.throughput[i] * w + p.throughput) / (w + 1.0);
                r.weight[i] = w + 1.0;
            }
            _ => {
                r.caps.push(p.cap_w.0);
                r.power.push(p.power_w.0);
                r.throughput.push(p.throughput);
                r.weight.push(1.0);
            }
        }
    }
    Ok(r)
}

/// Monotone and (where the noise allows) concave knots from readings.
fn finish_curve(r: Readings, relative_noise: f64) -> Result<CapCurve, CurveError> {
    let power = isotonic_non_decreasing(&r.power, &r.weight);
    let monotone = isotonic_non_decreasing(&r.throughput, &r.weight);
    let t_top = monotone[monotone.len() - 1];
    let concave = concave_in_power(&power, &monotone);
    let tolerance = 2.5 * relative_noise.max(1e-4) * t_top;
    let within_noise = concave
        .iter()
        .zip(&monotone)
        .all(|(c, m)| (c - m).abs() <= tolerance);
    let throughput = if within_noise { concave } else { monotone };
    let knots: Vec<OperatingPoint> = r
        .caps
        .iter()
        .zip(power.iter().zip(&throughput))
        .map(|(&c, (&p, &t))| OperatingPoint {
            cap_w: Watts(c),
            power_w: Watts(p),
            throughput: t,
        })
        .collect();
    let points_per_knot = r.weight.iter().sum::<f64>() / r.weight.len() as f64;
    CapCurve::with_source(
        &knots,
        CurveSource::Estimated,
        relative_noise * (2.0 / points_per_knot).sqrt(),
    )
}

/// Adds knots at the grid caps that lie between two knots at or above `lowest_read`.
///
/// Linear interpolation between sparse readings sits *below* a concave curve (a chord),
/// so an optimiser working on it prefers to send some jobs to one reading and others to
/// the next, where spreading the cut evenly would have done better. A monotone cubic
/// (Fritsch–Carlson) through the knots in (power, throughput) estimates the bulge from
/// the neighbouring slopes; the new knot is kept between the chord and the tangent lines
/// of the neighbouring segments, the region any concave curve through the readings
/// must pass. Power at the new cap is the larger of linear interpolation and the fitted
/// power model: where the cap starts to bind between two readings, the chord would
/// promise savings the job does not deliver.
fn densify(
    curve: CapCurve,
    grid: &[Watts],
    lowest_read: f64,
    model: Option<PowerModel>,
) -> CapCurve {
    let knots = curve.knots.clone();
    let n = knots.len();
    if n < 3 || grid.is_empty() {
        return curve;
    }
    let x: Vec<f64> = knots.iter().map(|k| k.power_w.0).collect();
    let y: Vec<f64> = knots.iter().map(|k| k.throughput).collect();
    if x.windows(2).any(|w| w[1] <= w[0]) {
        return curve; // flat power somewhere: no shape to interpolate in power
    }
    let secant: Vec<f64> = (0..n - 1)
        .map(|i| (y[i + 1] - y[i]) / (x[i + 1] - x[i]))
        .collect();
    let mut slope = vec![0.0; n];
    // Ends: the one-sided three-point estimate, kept shape-preserving (Fritsch–Carlson):
    // zero if it turns against the end secant, at most three times it.
    let end_slope = |h_near: f64, h_far: f64, s_near: f64, s_far: f64| -> f64 {
        let d = ((2.0 * h_near + h_far) * s_near - h_near * s_far) / (h_near + h_far);
        if d * s_near <= 0.0 {
            0.0
        } else if (s_near * s_far <= 0.0) && d.abs() > 3.0 * s_near.abs() {
            3.0 * s_near
        } else {
            d
        }
    };
    slope[0] = end_slope(x[1] - x[0], x[2] - x[1], secant[0], secant[1]);
    slope[n - 1] = end_slope(
        x[n - 1] - x[n - 2],
        x[n - 2] - x[n - 3],
        secant[n - 2],
        secant[n - 3],
    );
    for i in 1..n - 1 {
        let (a, b) = (secant[i - 1], secant[i]);
        if a > 0.0 && b > 0.0 {
            let (h0, h1) = (x[i] - x[i - 1], x[i + 1] - x[i]);
            let (w1, w2) = (2.0 * h1 + h0, h1 + 2.0 * h0);
            slope[i] = (w1 + w2) / (w1 / a + w2 / b);
        }
    }
    let mut grid: Vec<f64> = grid.iter().map(|g| g.0).filter(|g| g.is_finite()).collect();
    grid.sort_by(f64::total_cmp);
    grid.dedup();
    let mut out = Vec::with_capacity(n + grid.len());
    for i in 0..n - 1 {
        out.push(knots[i]);
        let (a, b) = (knots[i], knots[i + 1]);
        if a.cap_w.0 < lowest_read - 1e-9 {
            continue;
        }
        for &g in &grid {
            if g <= a.cap_w.0 + 1e-9 || g >= b.cap_w.0 - 1e-9 {
                continue;
            }
            let f = (g - a.cap_w.0) / (b.cap_w.0 - a.cap_w.0);
            let chord_power = a.power_w.0 + f * (b.power_w.0 - a.power_w.0);
            let model_power = model.map_or(chord_power, |m| m.at(g));
            let p = chord_power.max(model_power).min(b.power_w.0);
            let h = x[i + 1] - x[i];
            let t = (p - x[i]) / h;
            let (t2, t3) = (t * t, t * t * t);
            let cubic = (2.0 * t3 - 3.0 * t2 + 1.0) * y[i]
                + (t3 - 2.0 * t2 + t) * h * slope[i]
                + (-2.0 * t3 + 3.0 * t2) * y[i + 1]
                + (t3 - t2) * h * slope[i + 1];
            let chord = y[i] + t * (y[i + 1] - y[i]);
            let mut ceiling = y[i + 1];
            if i > 0 {
                ceiling = ceiling.min(y[i] + secant[i - 1] * (p - x[i]));
            }
            if i + 2 < n {
                ceiling = ceiling.min(y[i + 1] - secant[i + 1] * (x[i + 1] - p));
            }
            let value = cubic.min(ceiling).max(chord);
            out.push(OperatingPoint {
                cap_w: Watts(g),
                power_w: Watts(p),
                throughput: value,
            });
        }
    }
    out.push(knots[n - 1]);
    CapCurve {
        knots: out,
        knot_sigma: Vec::new(),
        lower_throughput: Vec::new(),
        ..curve
    }
}

/// The power model a GPU under a cap follows: it draws a fixed fraction of the cap while
/// the cap binds, and its uncapped draw above that — `P(c) = min(slope · c, plateau)`.
#[derive(Debug, Clone, Copy, PartialEq)]
struct PowerModel {
    /// Summed power per watt of per-GPU cap while the cap binds (≈ GPUs × 0.98).
    slope: f64,
    /// Uncapped summed power, W.
    plateau: f64,
}

impl PowerModel {
    fn at(&self, cap: f64) -> f64 {
        (self.slope * cap).min(self.plateau)
    }
}

/// Least-squares fit (in relative error) of [`PowerModel`] to readings. Each split is a
/// hypothesis — the lowest `j` caps bind, the rest sit on the plateau (all or none may
/// bind) — fitted in closed form and scored on the full model; the best score wins.
fn fit_power_model(r: &Readings) -> Option<PowerModel> {
    let n = r.caps.len();
    let weighted_mean = |range: std::ops::Range<usize>, f: &dyn Fn(usize) -> f64| {
        let w: f64 = range.clone().map(|i| r.weight[i]).sum();
        range.map(|i| f(i) * r.weight[i]).sum::<f64>() / w
    };
    let mut best: Option<(f64, PowerModel)> = None;
    for binding in 0..=n {
        let model = if binding == 0 {
            // Nothing binds: flat at the mean draw.
            PowerModel {
                slope: f64::INFINITY,
                plateau: weighted_mean(0..n, &|i| r.power[i]),
            }
        } else {
            let slope = weighted_mean(0..binding, &|i| r.power[i] / r.caps[i]);
            let plateau = if binding == n {
                slope * r.caps[n - 1]
            } else {
                weighted_mean(binding..n, &|i| r.power[i])
            };
            PowerModel { slope, plateau }
        };
        let sse: f64 = (0..n)
            .map(|i| {
                let fitted = model.at(r.caps[i]);
                r.weight[i] * ((r.power[i] - fitted) / fitted).powi(2)
            })
            .sum();
        if sse.is_finite() && best.as_ref().is_none_or(|(b, _)| sse < *b) {
            best = Some((sse, model));
        }
    }
    best.map(|(_, m)| m)
}

/// Estimates every job's curve from its calibration points, pooling what the population
/// says about how much the jobs' power readings can be trusted.
///
/// Power: each job's readings are fitted with the cap-following model
/// `P(c) = min(slope · c, plateau)`; across the population, the spread of readings around
/// their fits beyond what `relative_noise` explains is the model's own error τ². Each
/// reading then moves toward its fit by σ² / (σ² + τ²): all the way when the model
/// explains the data (noise is averaged out across a job's caps), not at all when jobs
/// depart from it. This matters because the optimiser favours jobs whose noise flatters
/// their savings; the less noise left in power, the less budget that bias can eat.
///
/// Below its lowest reading a job's curve is extended to `min_cap_w` (when lower): power
/// from the fitted model, throughput on the chord from `zero_throughput_w` (where the job
/// may make no progress at all) to the lowest reading (see `extend_down`). Throughput is
/// concave in power above a GPU's static draw, so with the anchor at or above that draw
/// the chord is a lower bound, not a guess. The curve marks where the extrapolation
/// starts; the allocator goes there only when the budget cannot be met above it, and the
/// job's first learned window there replaces the bound.
///
/// Each curve also carries a lower bound on its throughput at every knot
/// ([`CapCurve::throughput_bound_at`]), for the tier floors: the smoothing toward the
/// population, the concave fit and the shape-preserving knots between readings all may
/// lift throughput above what was measured, and a floor set there understates a steep
/// knee's slowdown. The bound at a read cap is the job's own readings made monotone, less
/// one standard error of its ratio to the top reading; between read caps their chord
/// (throughput is concave in power, and power concave in the cap); below the lowest,
/// the chord from the anchor.
/// Throughput and the rest follow [`estimate_curve`].
pub fn estimate_population(jobs: &[JobReadings], relative_noise: f64) -> Vec<CapCurve> {
    // A noise level that is not a number is treated as none: no pooling, no shrinkage.
    let relative_noise = if relative_noise.is_finite() && relative_noise > 0.0 {
        relative_noise
    } else {
        0.0
    };
    let observations: Vec<&[OperatingPoint]> = jobs.iter().map(|j| j.points.as_slice()).collect();
    let readings: Vec<Option<Readings>> = observations
        .iter()
        .map(|obs| average_readings(obs).ok())
        .collect();
    // The readings as measured, for the lower bounds: smoothing below moves them.
    let measured = readings.clone();
    let models: Vec<Option<PowerModel>> = readings
        .iter()
        .map(|r| r.as_ref().and_then(fit_power_model))
        .collect();
    let noise_var = relative_noise * relative_noise;
    // Pooled excess residual variance: E[e²] = σ²/w · (1 − 2/n) + τ² for a 2-parameter fit.
    let (mut excess, mut count) = (0.0, 0.0);
    for (r, m) in readings.iter().zip(&models) {
        if let (Some(r), Some(m)) = (r, m) {
            let n = r.caps.len() as f64;
            if n <= 2.0 {
                continue;
            }
            for i in 0..r.caps.len() {
                let e = (r.power[i] - m.at(r.caps[i])) / m.at(r.caps[i]);
                excess += e * e - noise_var / r.weight[i] * (1.0 - 2.0 / n);
                count += 1.0;
            }
        }
    }
    let model_var = if count > 0.0 {
        (excess / count).max(0.0)
    } else {
        f64::INFINITY
    };
    let smoothed = readings
        .into_iter()
        .zip(&models)
        .map(|(r, m)| {
            let mut r = r?;
            if let Some(m) = m {
                for i in 0..r.caps.len() {
                    let reading_var = noise_var / r.weight[i];
                    let keep = if model_var.is_finite() && model_var + reading_var > 0.0 {
                        model_var / (model_var + reading_var)
                    } else {
                        1.0
                    };
                    let fitted = m.at(r.caps[i]);
                    r.power[i] = fitted + keep * (r.power[i] - fitted);
                }
            }
            Some(r)
        })
        .collect::<Vec<Option<Readings>>>();
    let smoothed = shrink_throughput(smoothed, relative_noise);
    smoothed
        .into_iter()
        .zip(measured)
        .zip(jobs)
        .zip(&models)
        .map(|(((r, raw), job), model)| match (r, raw) {
            (Some(mut r), Some(raw)) => {
                let lowest_read = r.caps[0];
                let anchor_w = usable_anchor(job.zero_throughput_w);
                extend_down(&mut r, *model, job.min_cap_w.0, anchor_w, job.gpus);
                finish_curve(r, relative_noise)
                    .map(|curve| {
                        let curve = CapCurve {
                            extrapolated_below_w: (curve.lowest().cap_w.0 < lowest_read)
                                .then_some(Watts(lowest_read)),
                            ..densify(curve, &job.cap_grid_w, lowest_read, *model)
                        };
                        with_lower_bound(curve, &raw, anchor_w, relative_noise)
                    })
                    .unwrap_or_else(|_| fallback_curve(&job.points))
            }
            _ => fallback_curve(&job.points),
        })
        .collect()
}

/// One job's calibration readings and the lowest cap its GPUs accept.
#[derive(Debug, Clone, PartialEq)]
pub struct JobReadings {
    pub points: Vec<OperatingPoint>,
    /// Lowest per-GPU cap the job may be given, W.
    pub min_cap_w: Watts,
    /// The caps the site calibrates on (its cap grid), W per GPU. Where the job was not
    /// read at one of them, the curve gets a knot there by shape-preserving
    /// interpolation (see `densify`); empty = no such knots.
    pub cap_grid_w: Vec<Watts>,
    /// Summed power of the job's GPUs at or below which it may make no progress at all,
    /// W: the anchor of the chord that bounds its throughput below its lowest reading.
    /// It must be at least the GPUs' static draw (what they draw at their lowest clock
    /// under the job's load), where throughput starts to rise concavely with power; any
    /// higher value is a safe, more pessimistic anchor. 0 W (or no usable number) makes
    /// the chord run to the origin: throughput in proportion to power, which is a bound
    /// only for a GPU with no static draw.
    pub zero_throughput_w: Watts,
    /// The job's GPUs: no cap lets the job draw more than the cap on each of them, which
    /// bounds its power below its readings where the readings show no cap binding.
    /// 0 = unknown (the fitted power model alone).
    pub gpus: u32,
}

/// Standard errors by which a read cap's bound sits below its reading.
const BOUND_Z: f64 = 1.0;

fn usable_anchor(w: Watts) -> f64 {
    if w.0.is_finite() && w.0 > 0.0 {
        w.0
    } else {
        0.0
    }
}

/// `curve` with its throughput lower bound at every knot (see [`estimate_population`]):
/// from `raw`, the job's readings as measured (averaged per cap, sorted by cap), and the
/// chord from `(anchor_w, 0)` below the lowest of them.
fn with_lower_bound(
    mut curve: CapCurve,
    raw: &Readings,
    anchor_w: f64,
    relative_noise: f64,
) -> CapCurve {
    let n = raw.caps.len();
    let monotone = isotonic_non_decreasing(&raw.throughput, &raw.weight);
    let (raw_top, weight_top) = (monotone[n - 1], raw.weight[n - 1]);
    let t_top = curve.uncapped().throughput;
    if !(raw_top.is_finite() && raw_top > 0.0 && t_top > 0.0) {
        return curve;
    }
    // Each read cap's share of the top reading, less one standard error of that ratio
    // (its own reading's noise and the top's); the top itself is the reference, exact.
    let share: Vec<f64> = (0..n)
        .map(|i| {
            if i == n - 1 {
                return 1.0;
            }
            let se = relative_noise * (1.0 / raw.weight[i] + 1.0 / weight_top).sqrt();
            (monotone[i] / raw_top * (1.0 - BOUND_Z * se)).max(0.0)
        })
        .collect();
    let lowest_read = raw.caps[0];
    let p0 = curve.at(Watts(lowest_read)).power_w.0;
    let floor = 1e-6 * t_top;
    let bound = |k: &OperatingPoint| -> f64 {
        let c = k.cap_w.0;
        let b = if c < lowest_read - 1e-9 {
            // The chord from the anchor, where throughput is certainly ≥ 0, to the
            // lowest reading's bound, at the power the cap lets through.
            if p0 > anchor_w {
                share[0] * t_top * (k.power_w.0 - anchor_w) / (p0 - anchor_w)
            } else {
                0.0
            }
        } else if c >= raw.caps[n - 1] {
            t_top
        } else {
            let hi = raw.caps.partition_point(|&x| x < c);
            if hi == 0 {
                share[0] * t_top
            } else {
                let (a, b) = (raw.caps[hi - 1], raw.caps[hi]);
                let f = if b > a { (c - a) / (b - a) } else { 1.0 };
                (share[hi - 1] + f * (share[hi] - share[hi - 1])) * t_top
            }
        };
        b.max(floor).min(k.throughput)
    };
    curve.lower_throughput = curve.knots.iter().map(bound).collect();
    curve
}

/// Adds a reading at `min_cap` below the lowest one (see [`estimate_population`]):
/// power from the fitted model (never above the lowest reading's), throughput on the
/// chord from `(anchor_w, 0)` to the lowest reading. Where that chord reaches zero above
/// the power at `min_cap`, a second reading marks where it does, so that interpolation in
/// the cap follows the chord rather than a line above it.
fn extend_down(
    r: &mut Readings,
    model: Option<PowerModel>,
    min_cap: f64,
    anchor_w: f64,
    gpus: u32,
) {
    let (c_lo, p_lo, t_lo) = (r.caps[0], r.power[0], r.throughput[0]);
    if !(min_cap.is_finite() && min_cap > 0.0 && min_cap < c_lo * 0.999) {
        return;
    }
    let modelled = match model {
        Some(m) if m.slope.is_finite() => m.at(min_cap).min(p_lo),
        // Nothing bound in the readings: nothing is saved below them either, until the
        // cap itself binds (below).
        Some(_) => p_lo,
        None => p_lo * min_cap / c_lo,
    };
    // No cap lets a GPU draw more than the cap: where the readings never bound, the
    // cap starts to bind at `p_lo / gpus`, and a reading there keeps the power between
    // it and the lowest reading flat, as it is.
    let power = if gpus > 0 {
        let g = f64::from(gpus);
        let binds_at = p_lo / g;
        if modelled > min_cap * g && binds_at > min_cap * 1.0001 && binds_at < c_lo * 0.9999 {
            r.caps.insert(0, binds_at);
            r.power.insert(0, p_lo);
            r.throughput.insert(0, t_lo);
            r.weight.insert(0, r.weight[0]);
        }
        modelled.min(min_cap * g)
    } else {
        modelled
    };
    // The knot the chord runs to: the one just inserted, if any, has the lowest
    // reading's power and throughput.
    let c_lo = r.caps[0];
    let floor = 1e-6 * t_lo;
    let chord = |p: f64| {
        if p_lo > anchor_w {
            (t_lo * (p - anchor_w) / (p_lo - anchor_w)).max(floor)
        } else {
            floor
        }
    };
    let weight = r.weight[0];
    if power < anchor_w && p_lo > anchor_w {
        let f = (anchor_w - power) / (p_lo - power);
        let crossing = min_cap + f * (c_lo - min_cap);
        if crossing > min_cap * 1.0001 && crossing < c_lo * 0.9999 {
            r.caps.insert(0, crossing);
            r.power.insert(0, anchor_w);
            r.throughput.insert(0, floor);
            r.weight.insert(0, weight);
        }
    }
    r.caps.insert(0, min_cap);
    r.power.insert(0, power);
    r.throughput.insert(0, chord(power));
    r.weight.insert(0, weight);
}

/// Fewest jobs for which population statistics are worth computing.
const MIN_POPULATION: usize = 8;

/// Empirical-Bayes shrinkage of each job's normalised throughput readings toward the
/// population's curve.
///
/// In normalised coordinates (p = P/P_top, t = T/T_top) each job's deviation from the
/// population curve t̄(p) is modelled as `(1 − p)·δ_job + residual`: a job-level shift
/// (a more or less flexible job, the bulk of what differs between jobs) plus a per-cap
/// shape term. Both are shrunk toward zero by signal / (signal + noise), with the signal
/// variances estimated from the spread across jobs beyond what the reading noise
/// explains. A job whose readings cannot be told apart from the population's is treated
/// as the population — and a set of identical curves is allocated exactly as the
/// equal-weight baseline allocates, which is the hedge the optimiser needs.
fn shrink_throughput(
    mut jobs: Vec<Option<Readings>>,
    relative_noise: f64,
) -> Vec<Option<Readings>> {
    let usable = jobs.iter().flatten().filter(|r| r.caps.len() >= 2).count();
    let noise_var = 2.0 * relative_noise * relative_noise; // t is a ratio of two readings
    if usable < MIN_POPULATION || noise_var <= 0.0 {
        return jobs;
    }
    // Normalised capped points of every job.
    let normalised = |r: &Readings| -> Vec<(f64, f64)> {
        let n = r.caps.len();
        let (p_top, t_top) = (r.power[n - 1], r.throughput[n - 1]);
        (0..n - 1)
            .map(|i| (r.power[i] / p_top, r.throughput[i] / t_top))
            .collect()
    };
    let mut pooled: Vec<(f64, f64)> = jobs.iter().flatten().flat_map(&normalised).collect();
    pooled.push((1.0, 1.0));
    pooled.sort_by(|a, b| a.0.total_cmp(&b.0));
    let fitted = isotonic_non_decreasing(
        &pooled.iter().map(|p| p.1).collect::<Vec<_>>(),
        &vec![1.0; pooled.len()],
    );
    let xs: Vec<f64> = pooled.iter().map(|p| p.0).collect();
    let mean_curve = |p: f64| -> f64 {
        let i = xs.partition_point(|&x| x < p);
        if i == 0 {
            return fitted[0];
        }
        if i >= xs.len() {
            return fitted[xs.len() - 1];
        }
        let (x0, x1) = (xs[i - 1], xs[i]);
        if x1 - x0 <= 1e-12 {
            return fitted[i];
        }
        fitted[i - 1] + (p - x0) / (x1 - x0) * (fitted[i] - fitted[i - 1])
    };
    // Per job: the shift δ by weighted least squares, and the per-point residuals.
    struct Fit {
        delta: f64,
        delta_var: f64,
        points: Vec<(f64, f64, f64)>, // (p, deviation, residual)
    }
    let fits: Vec<Option<Fit>> = jobs
        .iter()
        .map(|r| {
            let r = r.as_ref()?;
            let pts = normalised(r);
            let sxx: f64 = pts.iter().map(|(p, _)| (1.0 - p).powi(2)).sum();
            if pts.is_empty() || sxx <= 1e-9 {
                return None;
            }
            let devs: Vec<(f64, f64)> = pts.iter().map(|&(p, t)| (p, t - mean_curve(p))).collect();
            let delta = devs.iter().map(|(p, d)| (1.0 - p) * d).sum::<f64>() / sxx;
            // Each t = T/T_top carries its own reading's noise and the top reading's,
            // which is common to all of a job's points: Var δ̂ = σ²(Σ a²t² + (Σ a t)²)
            // with a = (1 − p)/Σ(1 − p)².
            let reading_var = noise_var / 2.0;
            let own: f64 = pts.iter().map(|(p, t)| ((1.0 - p) / sxx * t).powi(2)).sum();
            let common: f64 = pts.iter().map(|(p, t)| (1.0 - p) / sxx * t).sum();
            Some(Fit {
                delta,
                delta_var: reading_var * (own + common * common),
                points: devs
                    .iter()
                    .map(|&(p, d)| (p, d, d - (1.0 - p) * delta))
                    .collect(),
            })
        })
        .collect();
    let present: Vec<&Fit> = fits.iter().flatten().collect();
    let n = present.len() as f64;
    let delta_signal = (present
        .iter()
        .map(|f| f.delta * f.delta - f.delta_var)
        .sum::<f64>()
        / n)
        .max(0.0);
    let (mut resid_sum, mut resid_count) = (0.0, 0.0);
    for f in &present {
        let k = f.points.len() as f64;
        for &(_, _, e) in &f.points {
            resid_sum += e * e - noise_var * (1.0 - 1.0 / k);
            resid_count += 1.0;
        }
    }
    let resid_signal = if resid_count > 0.0 {
        (resid_sum / resid_count).max(0.0)
    } else {
        0.0
    };
    for (r, fit) in jobs.iter_mut().zip(&fits) {
        let (Some(r), Some(fit)) = (r.as_mut(), fit) else {
            continue;
        };
        let keep_delta = delta_signal / (delta_signal + fit.delta_var);
        let keep_resid = resid_signal / (resid_signal + noise_var);
        let n_caps = r.caps.len();
        let t_top = r.throughput[n_caps - 1];
        for (i, &(p, _, resid)) in fit.points.iter().enumerate() {
            let t = mean_curve(p) + (1.0 - p) * fit.delta * keep_delta + resid * keep_resid;
            r.throughput[i] = t.max(1e-6) * t_top;
        }
    }
    jobs
}

/// A concave (in power) version of a non-decreasing throughput sequence: slopes between
/// consecutive points are made non-increasing by pooling (weighted by the power step),
/// which keeps the total rise; the curve is anchored at the uncapped point, the one every
/// decision is measured against.
fn concave_in_power(power: &[f64], throughput: &[f64]) -> Vec<f64> {
    let n = power.len();
    if n < 3 {
        return throughput.to_vec();
    }
    let mut slopes = Vec::with_capacity(n - 1);
    let mut widths = Vec::with_capacity(n - 1);
    for i in 0..n - 1 {
        let dp = power[i + 1] - power[i];
        let dt = throughput[i + 1] - throughput[i];
        if dp <= 1e-9 {
            // No power difference: a concave curve cannot rise here; keep the step as is.
            return throughput.to_vec();
        }
        slopes.push(dt / dp);
        widths.push(dp);
    }
    // Concave ⇔ slopes non-increasing in power ⇔ reversed slopes non-decreasing.
    let reversed: Vec<f64> = slopes.iter().rev().copied().collect();
    let reversed_w: Vec<f64> = widths.iter().rev().copied().collect();
    let mut fitted = isotonic_non_decreasing(&reversed, &reversed_w);
    fitted.reverse();
    let mut out = vec![0.0; n];
    out[n - 1] = throughput[n - 1];
    for i in (0..n - 1).rev() {
        out[i] = out[i + 1] - fitted[i] * widths[i];
    }
    out
}

/// A curve for a job whose points are unusable: flat at the highest valid reading, so no
/// policy expects to save anything by capping it.
fn fallback_curve(obs: &[OperatingPoint]) -> CapCurve {
    let top = obs
        .iter()
        .filter(|p| {
            let ok = |x: f64| x.is_finite() && x > 0.0;
            ok(p.cap_w.0) && ok(p.power_w.0) && ok(p.throughput)
        })
        .max_by(|a, b| a.cap_w.0.total_cmp(&b.cap_w.0))
        .copied()
        .unwrap_or(OperatingPoint {
            cap_w: Watts(1.0),
            power_w: Watts(1.0),
            throughput: 1.0,
        });
    CapCurve {
        knots: vec![top],
        source: CurveSource::Prior,
        relative_uncertainty: 1.0,
        extrapolated_below_w: None,
        knot_sigma: Vec::new(),
        lower_throughput: Vec::new(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_knot_above_the_top_costs_its_power_and_gains_no_speed() {
        let p = |cap: f64, power: f64, throughput: f64| OperatingPoint {
            cap_w: Watts(cap),
            power_w: Watts(power),
            throughput,
        };
        let walked =
            CapCurve::from_points(&[p(300.0, 590.0, 0.68), p(500.0, 985.0, 1.0)]).expect("curve");
        // Flat above the top: 700 W would cost what 500 W does.
        assert_eq!(walked.at(Watts(700.0)).power_w, Watts(985.0));
        let bounded = walked.with_knot_above(Watts(700.0), Watts(1400.0));
        assert_eq!(bounded.at(Watts(700.0)).power_w, Watts(1400.0));
        assert_eq!(bounded.at(Watts(700.0)).throughput, 1.0);
        assert!((bounded.at(Watts(600.0)).power_w.0 - 1192.5).abs() < 1e-9);
        assert_eq!(bounded.at(Watts(400.0)), walked.at(Watts(400.0)));
        assert_eq!(bounded.lowest_read_cap(), walked.lowest_read_cap());
        // Nothing to add at or below the top, or for a power that is no number.
        assert_eq!(walked.with_knot_above(Watts(500.0), Watts(1400.0)), walked);
        assert_eq!(
            walked.with_knot_above(Watts(700.0), Watts(f64::NAN)),
            walked
        );
        // Never below the top's power.
        let low = walked.with_knot_above(Watts(700.0), Watts(10.0));
        assert_eq!(low.at(Watts(700.0)).power_w, Watts(985.0));
    }

    fn pt(cap: f64, power: f64, throughput: f64) -> OperatingPoint {
        OperatingPoint {
            cap_w: Watts(cap),
            power_w: Watts(power),
            throughput,
        }
    }

    #[test]
    fn interpolates_linearly_and_is_flat_outside() {
        let curve = CapCurve::from_points(&[pt(700.0, 5600.0, 100.0), pt(300.0, 2400.0, 60.0)])
            .expect("curve");
        let mid = curve.at(Watts(500.0));
        assert!((mid.power_w.0 - 4000.0).abs() < 1e-9);
        assert!((mid.throughput - 80.0).abs() < 1e-9);
        assert_eq!(curve.at(Watts(200.0)).power_w, Watts(2400.0));
        assert_eq!(curve.at(Watts(800.0)).throughput, 100.0);
    }

    #[test]
    fn rejects_bad_points() {
        assert_eq!(CapCurve::from_points(&[]), Err(CurveError::Empty));
        assert_eq!(
            CapCurve::from_points(&[pt(700.0, 1.0, 1.0), pt(700.0, 2.0, 2.0)]),
            Err(CurveError::DuplicateCap { cap_w: 700.0 })
        );
        assert_eq!(
            CapCurve::from_points(&[pt(700.0, f64::NAN, 1.0)]),
            Err(CurveError::NotPositive { cap_w: 700.0 })
        );
    }

    #[test]
    fn isotonic_pools_violators() {
        let fitted = isotonic_non_decreasing(&[1.0, 3.0, 2.0, 4.0], &[1.0; 4]);
        assert_eq!(fitted, vec![1.0, 2.5, 2.5, 4.0]);
    }

    #[test]
    fn estimate_is_monotone_in_cap() {
        // Throughput at 500 W read higher than at 600 W: noise, not physics.
        let obs = [
            pt(700.0, 5600.0, 100.0),
            pt(600.0, 4800.0, 96.0),
            pt(500.0, 4000.0, 97.0),
            pt(300.0, 2400.0, 60.0),
        ];
        let curve = estimate_curve(&obs, 0.01).expect("curve");
        let t: Vec<f64> = curve.knots().iter().map(|k| k.throughput).collect();
        assert!(t.windows(2).all(|w| w[0] <= w[1] + 1e-12), "{t:?}");
        assert_eq!(curve.source(), CurveSource::Estimated);
    }

    #[test]
    fn estimate_keeps_real_non_concavity_beyond_noise() {
        // A knee far larger than 1 % noise: concavity would move points by ~20 %; kept.
        let obs = [
            pt(700.0, 700.0, 100.0),
            pt(600.0, 600.0, 99.0),
            pt(500.0, 500.0, 98.0),
            pt(400.0, 400.0, 60.0),
            pt(300.0, 300.0, 55.0),
        ];
        let curve = estimate_curve(&obs, 0.01).expect("curve");
        assert!((curve.at(Watts(400.0)).throughput - 60.0).abs() < 1e-9);
    }

    #[test]
    fn windows_estimate_keeps_knees_and_carries_uncertainty() {
        // A knee at 500 W and a rise at 600 W that is noise (faster at a lower cap).
        let truth = [
            (300.0, 55.0),
            (400.0, 60.0),
            (500.0, 98.0),
            (600.0, 101.0),
            (700.0, 100.0),
        ];
        let windows = |n: usize| -> Vec<OperatingPoint> {
            truth
                .iter()
                .flat_map(|&(c, t)| {
                    (0..n).map(move |i| {
                        let wiggle = if i % 2 == 0 { 1.01 } else { 0.99 };
                        pt(c, c * wiggle, t * wiggle)
                    })
                })
                .collect()
        };
        let few = estimate_from_windows(&windows(2), 0.01).expect("curve");
        let many = estimate_from_windows(&windows(8), 0.01).expect("curve");
        let t: Vec<f64> = few.knots().iter().map(|k| k.throughput).collect();
        assert!(t.windows(2).all(|w| w[0] <= w[1]), "monotone: {t:?}");
        assert!((t[1] - 60.0).abs() < 1e-9, "the knee is kept: {t:?}");
        assert!(
            (t[3] - 100.5).abs() < 1e-9 && (t[4] - 100.5).abs() < 1e-9,
            "{t:?}"
        );
        let (s_few, s_many) = (
            few.sigma_at(Watts(500.0)).expect("sigma"),
            many.sigma_at(Watts(500.0)).expect("sigma"),
        );
        assert!(
            s_many.throughput < 0.6 * s_few.throughput,
            "{s_few:?} {s_many:?}"
        );
        assert!(s_few.power_w > 0.0);
        // The margin raises power by its errors and keeps it monotone.
        let raised = few.with_power_margin(1.0);
        for (r, k) in raised.knots().iter().zip(few.knots()) {
            assert!(r.power_w.0 >= k.power_w.0 - 1e-9);
        }
        // Serialised and back, the uncertainty travels with the knots.
        let text = serde_json::to_string(&few).expect("json");
        assert_eq!(serde_json::from_str::<CapCurve>(&text).expect("back"), few);
    }

    #[test]
    fn prior_reproduces_its_pfi() {
        let curve = CapCurve::from_pfi_prior(
            Watts(5600.0),
            1000.0,
            1.6,
            Watts(200.0),
            Watts(700.0),
            Watts(100.0),
        )
        .expect("prior");
        assert_eq!(curve.source(), CurveSource::Prior);
        assert!((curve.pfi().expect("pfi") - 1.6).abs() < 1e-9);
        assert_eq!(curve.knots().len(), 6);
    }

    fn readings(caps: &[f64], power: &[f64]) -> Readings {
        Readings {
            caps: caps.to_vec(),
            power: power.to_vec(),
            throughput: vec![1.0; caps.len()],
            weight: vec![1.0; caps.len()],
        }
    }

    #[test]
    fn power_model_finds_slope_and_plateau() {
        // 8 GPUs at 0.985·cap while binding, 560 W/GPU uncapped: knee at ~568 W.
        let caps = [300.0, 400.0, 600.0, 700.0];
        let power: Vec<f64> = caps
            .iter()
            .map(|c| (c * 0.985 * 8.0_f64).min(4480.0))
            .collect();
        let m = fit_power_model(&readings(&caps, &power)).expect("model");
        assert!((m.slope - 7.88).abs() < 1e-9, "{m:?}");
        assert!((m.plateau - 4480.0).abs() < 1e-9, "{m:?}");
        // Every cap binding: the plateau sits at the top cap.
        let all: Vec<f64> = caps.iter().map(|c| c * 0.985 * 8.0).collect();
        let m = fit_power_model(&readings(&caps, &all)).expect("model");
        assert!((m.at(700.0) - 700.0 * 0.985 * 8.0).abs() < 1e-6);
    }

    fn noisy_population(
        n: usize,
        noise: f64,
        pfi_of: impl Fn(usize) -> f64,
        seed: u64,
    ) -> (Vec<JobReadings>, Vec<CapCurve>) {
        let mut rng = crate::rng::SplitMix64::new(seed);
        let mut jobs = Vec::new();
        let mut truths = Vec::new();
        for i in 0..n {
            let truth = CapCurve::from_pfi_prior(
                Watts(5600.0),
                1000.0,
                pfi_of(i),
                Watts(200.0),
                Watts(700.0),
                Watts(100.0),
            )
            .expect("prior");
            let points = [300.0, 400.0, 600.0, 700.0]
                .iter()
                .map(|&c| {
                    let t = truth.at(Watts(c));
                    OperatingPoint {
                        cap_w: Watts(c),
                        power_w: t.power_w * (1.0 + noise * rng.normal()),
                        throughput: t.throughput * (1.0 + noise * rng.normal()),
                    }
                })
                .collect();
            jobs.push(JobReadings {
                points,
                min_cap_w: Watts(200.0),
                // 8 GPUs at 200 W: at or above their static draw.
                zero_throughput_w: Watts(1600.0),
                gpus: 8,
                cap_grid_w: Vec::new(),
            });
            truths.push(truth);
        }
        (jobs, truths)
    }

    fn mean_abs_error(curves: &[CapCurve], truths: &[CapCurve], cap: f64, power: bool) -> f64 {
        curves
            .iter()
            .zip(truths)
            .map(|(c, t)| {
                let (e, tr) = (c.at(Watts(cap)), t.at(Watts(cap)));
                if power {
                    (e.power_w.0 / tr.power_w.0 - 1.0).abs()
                } else {
                    (e.throughput / c.uncapped().throughput
                        - tr.throughput / t.uncapped().throughput)
                        .abs()
                }
            })
            .sum::<f64>()
            / curves.len() as f64
    }

    #[test]
    fn population_estimate_beats_each_job_alone() {
        // Identical jobs, 2 % noise: pooling must cut the error of power and of the
        // normalised throughput at a capped point.
        let (jobs, truths) = noisy_population(60, 0.02, |_| 1.5, 3);
        let alone: Vec<CapCurve> = jobs
            .iter()
            .map(|j| estimate_curve(&j.points, 0.02).expect("curve"))
            .collect();
        let pooled = estimate_population(&jobs, 0.02);
        for cap in [400.0, 600.0] {
            let (a, p) = (
                mean_abs_error(&alone, &truths, cap, true),
                mean_abs_error(&pooled, &truths, cap, true),
            );
            assert!(p < 0.7 * a, "power at {cap}: pooled {p} vs alone {a}");
            let (a, p) = (
                mean_abs_error(&alone, &truths, cap, false),
                mean_abs_error(&pooled, &truths, cap, false),
            );
            assert!(p < 0.7 * a, "throughput at {cap}: pooled {p} vs alone {a}");
        }
    }

    #[test]
    fn population_keeps_real_differences() {
        // Very different jobs read with little noise: shrinkage must not erase them.
        let (jobs, truths) = noisy_population(40, 0.002, |i| if i % 2 == 0 { 1.1 } else { 2.6 }, 5);
        let pooled = estimate_population(&jobs, 0.002);
        let err = mean_abs_error(&pooled, &truths, 400.0, false);
        assert!(err < 0.01, "normalised throughput error {err}");
    }

    #[test]
    fn extension_below_the_lowest_reading_is_marked_and_pessimistic() {
        let (jobs, truths) = noisy_population(10, 0.0, |_| 1.5, 1);
        let pooled = estimate_population(&jobs, 0.0);
        for (c, t) in pooled.iter().zip(&truths) {
            assert_eq!(c.lowest().cap_w, Watts(200.0));
            assert_eq!(c.lowest_read_cap(), Watts(300.0));
            assert!(c.at(Watts(200.0)).throughput <= t.at(Watts(200.0)).throughput + 1e-9);
        }
    }

    #[test]
    fn densify_adds_knots_between_chord_and_tangents() {
        // A concave curve read at 300/400/600/700 W; the grid also has 500 W.
        let t = |p: f64| 1000.0 * (1.0 - (1.0 - p / 5600.0).powi(2));
        let caps = [300.0, 400.0, 600.0, 700.0];
        let points: Vec<OperatingPoint> = caps
            .iter()
            .map(|&c| OperatingPoint {
                cap_w: Watts(c),
                power_w: Watts(8.0 * c),
                throughput: t(8.0 * c),
            })
            .collect();
        let jobs = vec![JobReadings {
            points,
            min_cap_w: Watts(300.0),
            // 8 GPUs at 200 W: at or above their static draw.
            zero_throughput_w: Watts(1600.0),
            gpus: 8,
            cap_grid_w: [300.0, 400.0, 500.0, 600.0, 700.0].map(Watts).to_vec(),
        }];
        let curve = &estimate_population(&jobs, 0.0)[0];
        let knot = curve
            .knots()
            .iter()
            .find(|k| k.cap_w == Watts(500.0))
            .expect("knot at 500 W");
        let chord = (t(3200.0) + t(4800.0)) / 2.0;
        assert!(
            knot.throughput > chord,
            "{} should bulge above the chord {chord}",
            knot.throughput
        );
        assert!(
            (knot.throughput - t(4000.0)).abs() < (t(4000.0) - chord) * 0.5,
            "close to the truth"
        );
        assert_eq!(knot.power_w, Watts(4000.0));
    }

    fn three_readings() -> Vec<OperatingPoint> {
        vec![
            pt(300.0, 2400.0, 500.0),
            pt(400.0, 3200.0, 900.0),
            pt(700.0, 5600.0, 1000.0),
        ]
    }

    #[test]
    fn extension_follows_the_chord_from_the_anchor() {
        // Throughput proportional to power (500 × 2000 / 2400 ≈ 417 at 250 W) is no bound:
        // the job makes no progress at its GPUs' static draw, taken here at 1600 W.
        let jobs = vec![JobReadings {
            points: three_readings(),
            min_cap_w: Watts(200.0),
            cap_grid_w: Vec::new(),
            zero_throughput_w: Watts(1600.0),
            gpus: 8,
        }];
        let curve = &estimate_population(&jobs, 0.0)[0];
        let chord = 500.0 * (2000.0 - 1600.0) / (2400.0 - 1600.0);
        let at = curve.at(Watts(250.0)).throughput;
        assert!(
            (at - chord).abs() < 1e-3,
            "{at} vs {chord}: {:?}",
            curve.knots()
        );
        let bound = curve.throughput_bound_at(Watts(250.0));
        assert!((bound - chord).abs() < 1e-3, "{bound} vs {chord}");
        assert!(curve.at(Watts(200.0)).throughput < 1e-3);
        assert_eq!(curve.lowest_read_cap(), Watts(300.0));
    }

    #[test]
    fn an_anchor_above_the_lowest_cap_s_draw_adds_the_chord_s_zero() {
        // At 200 W the job draws 1600 W, below the 2000 W anchor: no progress promised
        // up to 250 W (2000 W), the chord from there to the lowest reading above it.
        let jobs = vec![JobReadings {
            points: three_readings(),
            min_cap_w: Watts(200.0),
            cap_grid_w: Vec::new(),
            zero_throughput_w: Watts(2000.0),
            gpus: 8,
        }];
        let curve = &estimate_population(&jobs, 0.0)[0];
        assert!(curve.throughput_bound_at(Watts(240.0)) < 1e-3);
        let chord = 500.0 * (2200.0 - 2000.0) / (2400.0 - 2000.0);
        let bound = curve.throughput_bound_at(Watts(275.0));
        assert!(
            (bound - chord).abs() < 1e-3,
            "{bound} vs {chord}: {curve:?}"
        );
    }

    #[test]
    fn the_bound_at_read_caps_never_lifts_a_reading_toward_the_population() {
        // Exact readings, but a stated noise of 1 %: shrinkage moves each job toward the
        // population; the bound stays at or below what each job measured, less a standard
        // error of its ratio to the top.
        let (mut jobs, _) = noisy_population(12, 0.0, |i| 0.8 + 0.4 * i as f64, 3);
        // One job with a steep knee: 30 % slower at 600 W already.
        jobs[5].points = vec![
            pt(300.0, 2400.0, 300.0),
            pt(400.0, 3200.0, 450.0),
            pt(600.0, 4800.0, 700.0),
            pt(700.0, 5600.0, 1000.0),
        ];
        let curves = estimate_population(&jobs, 0.01);
        for (job, curve) in jobs.iter().zip(&curves) {
            let top = job.points.iter().map(|p| p.throughput).fold(0.0, f64::max);
            let bound_top = curve.throughput_bound_at(Watts(700.0));
            for p in &job.points {
                if p.cap_w.0 >= 700.0 {
                    continue;
                }
                let measured = p.throughput / top;
                let bound = curve.throughput_bound_at(p.cap_w) / bound_top;
                let se = 0.01 * 2f64.sqrt();
                assert!(
                    bound <= measured * (1.0 - se) + 1e-9,
                    "cap {}: bound {bound} above measured {measured}",
                    p.cap_w.0
                );
            }
        }
    }

    #[test]
    fn densify_accepts_a_descending_grid() {
        let points: Vec<OperatingPoint> = [300.0, 400.0, 600.0, 700.0]
            .iter()
            .map(|&c| OperatingPoint {
                cap_w: Watts(c),
                power_w: Watts(8.0 * c),
                throughput: 1000.0 * (1.0 - (1.0 - c / 700.0).powi(2)),
            })
            .collect();
        let jobs = vec![JobReadings {
            points,
            min_cap_w: Watts(300.0),
            // 8 GPUs at 200 W: at or above their static draw.
            zero_throughput_w: Watts(1600.0),
            gpus: 8,
            cap_grid_w: [700.0, 550.0, 500.0, 500.0, 450.0, 300.0]
                .map(Watts)
                .to_vec(),
        }];
        let curve = &estimate_population(&jobs, 0.0)[0];
        let caps: Vec<f64> = curve.knots().iter().map(|k| k.cap_w.0).collect();
        assert_eq!(caps, vec![300.0, 400.0, 450.0, 500.0, 550.0, 600.0, 700.0]);
    }

    #[test]
    fn unusable_readings_never_make_a_curve_that_panics() {
        let jobs = vec![JobReadings {
            points: vec![
                OperatingPoint {
                    cap_w: Watts(f64::NAN),
                    power_w: Watts(5000.0),
                    throughput: 100.0,
                },
                OperatingPoint {
                    cap_w: Watts(700.0),
                    power_w: Watts(5600.0),
                    throughput: 1000.0,
                },
            ],
            min_cap_w: Watts(200.0),
            // 8 GPUs at 200 W: at or above their static draw.
            zero_throughput_w: Watts(1600.0),
            gpus: 8,
            cap_grid_w: Vec::new(),
        }];
        for noise in [0.01, f64::NAN, -1.0] {
            let curve = &estimate_population(&jobs, noise)[0];
            let at = curve.at(Watts(500.0));
            assert!(at.power_w.0.is_finite() && at.throughput.is_finite());
        }
    }

    #[test]
    fn deserialising_validates() {
        let good = CapCurve::from_points(&[pt(700.0, 5600.0, 100.0), pt(300.0, 2400.0, 60.0)])
            .expect("curve");
        let text = serde_json::to_string(&good).expect("json");
        assert_eq!(serde_json::from_str::<CapCurve>(&text).expect("back"), good);
        let empty = r#"{"knots":[],"source":"measured","relative_uncertainty":0.0}"#;
        assert!(serde_json::from_str::<CapCurve>(empty).is_err());
    }
}
