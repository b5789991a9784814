//! The Power Flexibility Index, exactly as arXiv 2609.11542 Eq. 1.
//!
//! `PFI = mean over capped points i with T_i < T_max of (1 − P_i/P_max) / (1 − T_i/T_max)`
//! where (T_max, P_max) is the uncapped point (the highest cap measured) and P is the job's
//! summed *realised* GPU power, not the cap. PFI > 1 sheds power cheaply; PFI < 1 is elastic.
//! Values are comparable only on the same cap grid and GPU model.

use crate::point::OperatingPoint;

/// PFI of a set of measured points, or `None` when it is undefined: fewer than two points,
/// no capped point slower than the uncapped one, or a non-positive uncapped power or
/// throughput.
pub fn pfi(points: &[OperatingPoint]) -> Option<f64> {
    let uncapped = points
        .iter()
        .max_by(|a, b| a.cap_w.0.total_cmp(&b.cap_w.0))?;
    let p_max = uncapped.power_w.0;
    let t_max = uncapped.throughput;
    if p_max <= 0.0 || t_max <= 0.0 {
        return None;
    }
    let ratios: Vec<f64> = points
        .iter()
        .filter(|p| p.cap_w.0 < uncapped.cap_w.0 && p.throughput < t_max)
        .map(|p| (1.0 - p.power_w.0 / p_max) / (1.0 - p.throughput / t_max))
        .collect();
    if ratios.is_empty() {
        return None;
    }
    Some(ratios.iter().sum::<f64>() / ratios.len() as f64)
}

/// One standard error of [`pfi`] from each point's standard error of throughput
/// (`throughput_sigma[i]` for `points[i]`; power's is left out: the realised draw is
/// read far more precisely than the job's rate). Each term `(1 − P/P_max) / (1 − T/T_max)`
/// divides by the loss, so a shallow walk's PFI is known far less well than a deep
/// one's: a 0.35 % error in the rate is a 17 % error in the term of a level losing 2 %.
/// `None` where [`pfi`] is, or the lengths differ.
pub fn pfi_sigma(points: &[OperatingPoint], throughput_sigma: &[f64]) -> Option<f64> {
    if points.len() != throughput_sigma.len() {
        return None;
    }
    pfi(points)?;
    let (top, top_sigma) = points
        .iter()
        .zip(throughput_sigma)
        .max_by(|a, b| a.0.cap_w.0.total_cmp(&b.0.cap_w.0))?;
    let (p_max, t_max) = (top.power_w.0, top.throughput);
    let mut variance = 0.0;
    let mut n = 0.0;
    for (p, s) in points.iter().zip(throughput_sigma) {
        if p.cap_w.0 >= top.cap_w.0 || p.throughput >= t_max {
            continue;
        }
        let loss = 1.0 - p.throughput / t_max;
        let term = (1.0 - p.power_w.0 / p_max) / loss;
        // d(1 − T/T_max) from T's and T_max's errors.
        let loss_sigma = (s.powi(2) + (p.throughput / t_max * top_sigma).powi(2)).sqrt() / t_max;
        variance += (term * loss_sigma / loss).powi(2);
        n += 1.0;
    }
    (n > 0.0 && variance.is_finite()).then(|| variance.sqrt() / n)
}

/// PFI restricted to the given per-GPU caps (plus the uncapped point), e.g. the paper's
/// 4-cap grid 200/500/600/700 W. Caps match within half a watt.
pub fn pfi_on_grid(points: &[OperatingPoint], caps_w: &[f64]) -> Option<f64> {
    let top = points.iter().map(|p| p.cap_w.0).fold(f64::MIN, f64::max);
    let chosen: Vec<OperatingPoint> = points
        .iter()
        .filter(|p| p.cap_w.0 == top || caps_w.iter().any(|c| (c - p.cap_w.0).abs() < 0.5))
        .copied()
        .collect();
    pfi(&chosen)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::units::Watts;

    fn pt(cap: f64, power: f64, throughput: f64) -> OperatingPoint {
        OperatingPoint {
            cap_w: Watts(cap),
            power_w: Watts(power),
            throughput,
        }
    }

    /// A shallow level's PFI term is known far less well than a deep one's.
    #[test]
    fn the_pfi_s_error_grows_as_the_losses_shrink() {
        let shallow = [pt(700.0, 2800.0, 1000.0), pt(650.0, 2660.0, 990.0)];
        let deep = [pt(700.0, 2800.0, 1000.0), pt(400.0, 1600.0, 800.0)];
        let sigma = [2.0, 2.0];
        let s = pfi_sigma(&shallow, &sigma).expect("sigma");
        let d = pfi_sigma(&deep, &sigma).expect("sigma");
        // Shallow: term 5, loss 1 % known to 0.28 %: 1.4. Deep: term 2.14, 0.3 %: 0.03.
        assert!(
            (s - 5.0 * (2.0f64.powi(2) + (0.99 * 2.0f64).powi(2)).sqrt() / 1000.0 / 0.01).abs()
                < 1e-9,
            "{s}"
        );
        assert!(d < s / 20.0, "{d} vs {s}");
        assert_eq!(pfi_sigma(&shallow, &[2.0]), None);
        assert_eq!(pfi_sigma(&[pt(700.0, 2800.0, 1000.0)], &[2.0]), None);
    }

    #[test]
    fn hand_computed_two_caps() {
        // 8 GPUs: uncapped 5600 W, 1000 tok/s.
        // cap 500: P 4000 (−28.57 %), T 900 (−10 %) → 2.857
        // cap 300: P 2400 (−57.14 %), T 600 (−40 %) → 1.4286
        let points = [
            pt(700.0, 5600.0, 1000.0),
            pt(500.0, 4000.0, 900.0),
            pt(300.0, 2400.0, 600.0),
        ];
        let expected = ((1.0 - 4000.0 / 5600.0) / 0.1 + (1.0 - 2400.0 / 5600.0) / 0.4) / 2.0;
        let got = pfi(&points).expect("defined");
        assert!((got - expected).abs() < 1e-12, "{got} vs {expected}");
        assert!((got - 2.142_857).abs() < 1e-5);
    }

    #[test]
    fn linear_job_has_pfi_one() {
        let points = [
            pt(700.0, 700.0, 70.0),
            pt(350.0, 350.0, 35.0),
            pt(200.0, 200.0, 20.0),
        ];
        assert!((pfi(&points).expect("defined") - 1.0).abs() < 1e-12);
    }

    #[test]
    fn points_as_fast_as_uncapped_are_excluded() {
        // A memory-bound job drawing 520 W loses nothing at cap 600: that point is excluded,
        // so only cap 400 counts: (1 - 400/520) / (1 - 0.9) = 2.3077.
        let points = [
            pt(700.0, 520.0, 100.0),
            pt(600.0, 519.0, 100.0),
            pt(400.0, 400.0, 90.0),
        ];
        let got = pfi(&points).expect("defined");
        assert!((got - (1.0 - 400.0 / 520.0) / 0.1).abs() < 1e-12);
    }

    #[test]
    fn undefined_cases() {
        assert_eq!(pfi(&[]), None);
        assert_eq!(pfi(&[pt(700.0, 700.0, 1.0)]), None);
        assert_eq!(pfi(&[pt(700.0, 700.0, 1.0), pt(600.0, 600.0, 1.0)]), None);
        assert_eq!(pfi(&[pt(700.0, 0.0, 1.0), pt(600.0, 600.0, 0.5)]), None);
    }

    #[test]
    fn grid_restriction_uses_only_named_caps() {
        let points = [
            pt(700.0, 700.0, 100.0),
            pt(600.0, 600.0, 95.0),
            pt(400.0, 400.0, 70.0),
            pt(200.0, 200.0, 40.0),
        ];
        let on_grid = pfi_on_grid(&points, &[200.0, 600.0]).expect("defined");
        let expected = ((1.0 - 600.0 / 700.0) / 0.05 + (1.0 - 200.0 / 700.0) / 0.6) / 2.0;
        assert!((on_grid - expected).abs() < 1e-12);
    }
}
