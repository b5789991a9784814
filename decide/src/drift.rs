//! Whether a job's measurements left its measured curve.

use powerflex_core::curve::CapCurve;
use powerflex_core::Watts;

use crate::gather::SiteJob;
use powerflex_proto::status::Drift;

/// How far measured power may stray from a measured curve before the job counts as
/// drifted (a fraction); throughput may stray this much or three of the curve's standard
/// errors, whichever is wider.
pub const DRIFT_BAND: f64 = 0.10;
/// How long a cap must have held before the throughput, a rate over the agent's last
/// 10 s, is compared with the curve at that cap, s.
const THROUGHPUT_WINDOW_S: f64 = 10.0;

/// Whether `job`'s measurements at the cap in force left its measured `curve`'s band.
/// Priors (no measured curve) and jobs being walked are not judged: their curve is a
/// guess or incomplete, not a promise. A job whose new step put its curve in question
/// is judged on a draw above its curve only: its agent's first steady window after the
/// step answers the rest (its rate, and a draw below the curve, read across the step's
/// start, mix the two steps and the idle gap between them), but a new step that draws
/// more than its curve allows at a settled cap is a new phase at once, and is walked
/// again without waiting for that window.
pub(crate) fn drift(id: &str, job: &SiteJob, curve: &CapCurve) -> Option<Drift> {
    if curve.source() == powerflex_core::curve::CurveSource::Prior || job.calibrating {
        return None;
    }
    let cap = job.cap_now_w?;
    let predicted = curve.at(Watts(cap));
    // Below the lowest read cap the curve is a lower bound on throughput (see
    // `estimate_population`), not an estimate: a job faster than it there is what the
    // bound expects, and only one slower than it has left the curve.
    let lowest_read = curve.lowest_read_cap().0;
    let below_readings = cap < lowest_read - 0.5;
    // Below the readings the curve's power is the fitted model's guess, not a reading: a
    // draw off it there says nothing about the job (a real curve may draw 10 % more at
    // 200 W than the model carries down from a 230 W reading), and what the job does
    // draw is paid for at once by the metered correction. Only a measured cap is judged.
    let power_ratio = (!below_readings
        && job.power_steady
        && job.power_from_every_node
        && predicted.power_w.0 > 0.0)
        .then(|| job.power_w / predicted.power_w.0);
    let throughput_band = DRIFT_BAND.max(3.0 * curve.relative_uncertainty());
    let throughput_ratio = match job.throughput {
        Some(t) if job.cap_steady_s >= THROUGHPUT_WINDOW_S && predicted.throughput > 0.0 => {
            let ratio = t / predicted.throughput;
            (!below_readings || ratio < 1.0).then_some(ratio)
        }
        // The cap moved within the rate's window, so the rate mixes caps: still, a rate
        // beyond what the curve gives at any cap the job may have is drift (a new phase
        // does not wait for a steady cap: where caps move every few seconds, as in the
        // demo, a job would otherwise run its heavier phase on its lighter phase's curve
        // to the end).
        Some(t) => {
            // The slowest a cap may have made it: the physics bound at the lowest cap
            // (the chord from the GPUs' static draw), since the window's caps may have
            // gone anywhere down to it. Throughput in proportion to the cap is no bound
            // (it runs to zero at 0 W, not at the static draw): a job judged on it is
            // flagged for running as its true curve says (a real BERT curve at 200 W runs
            // 13 % under it), loses its curve and is planned on a prior past its bound.
            // A new phase that slows a job less than this waits for a cap held the
            // rate's window to show.
            let slowest = curve.throughput_bound_at(Watts(job.min_cap));
            let fastest = curve.at(Watts(job.max_cap)).throughput;
            if slowest > 0.0 && t < slowest * (1.0 - throughput_band) {
                Some(t / slowest)
            } else if fastest > 0.0 && t > fastest * (1.0 + throughput_band) {
                Some(t / fastest)
            } else {
                None
            }
        }
        None => None,
    };
    let out = if job.curve_in_question {
        power_ratio.is_some_and(|r| r > 1.0 + DRIFT_BAND)
    } else {
        power_ratio.is_some_and(|r| (r - 1.0).abs() > DRIFT_BAND)
            || throughput_ratio.is_some_and(|r| (r - 1.0).abs() > throughput_band)
    };
    out.then(|| Drift {
        job: id.to_string(),
        cap_w: cap,
        power_ratio,
        throughput_ratio,
    })
}
