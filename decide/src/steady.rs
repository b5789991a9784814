//! When the caps in force stay: a new decision must buy enough to be worth a change.

use std::collections::BTreeMap;

use powerflex_core::allocate::{allocation_at_within, Allocation, DomainLimit, JobSpec};
use powerflex_core::Watts;

/// A change of caps that buys less than this share of the site's objective is not made:
/// each change costs the job a settle at its new cap and blurs what the agent learns
/// there, and on a flat optimum the estimates' noise alone would swing a cap between
/// distant values (270 W and 600 W, period after period, in the demo without it).
pub const STEADY_GAIN: f64 = 0.005;

/// Standard deviations of the estimated gain a change must clear: at 2, the curves' noise
/// alone moves the caps in about one period in forty, not one in six as at 1.
pub const STEADY_Z: f64 = 2.0;

/// `fresh`, or the caps `in_force` when they are as good as the rule of
/// [`decide_steady`](crate::decide_steady) asks.
pub(crate) fn keep_steady(
    fresh: Allocation,
    specs: &[JobSpec],
    in_doubt: &[bool],
    budget: Watts,
    domains: &[DomainLimit],
    in_force: &BTreeMap<String, f64>,
) -> Allocation {
    if in_force.is_empty() || in_force.len() != specs.len() {
        return fresh;
    }
    let Some(caps) = specs
        .iter()
        .map(|s| in_force.get(&s.id).map(|&c| Watts(c)))
        .collect::<Option<Vec<Watts>>>()
    else {
        return fresh;
    };
    if fresh.jobs.iter().zip(&caps).all(|(j, c)| j.cap_w == *c) {
        return fresh;
    }
    // A job whose curve is in doubt gets its equal-split cap, not the cap a curve it has
    // left once earned it. A step either way is not a move: the equal split shifts by a
    // step with the others' draws from one period to the next, and a job on a prior whose
    // cap changes is budgeted at its prior until its draw shows the new cap (cap x GPUs
    // against a draw of half that for a job that draws little): a cap flipping by a step
    // every period swings the whole allocation with it (600 W in the live A/B).
    let doubt_moves =
        fresh
            .jobs
            .iter()
            .zip(&caps)
            .zip(specs)
            .enumerate()
            .any(|(i, ((j, c), s))| {
                in_doubt.get(i).copied().unwrap_or(false)
                    && (j.cap_w.0 - c.0).abs() > s.limits.step_w.0 + 0.5
            });
    if doubt_moves {
        return fresh;
    }
    let Ok(kept) = allocation_at_within(specs, &caps, fresh.budget_w, domains, fresh.policy) else {
        return fresh;
    };
    let feasible = fresh.over_budget_w.0 == 0.0 && fresh.broken_floors().next().is_none();
    // Within the budget and within every domain's limit (as the fresh decision had them).
    let fits = kept.total_power_w.0 <= budget.0 + 1e-6
        && kept
            .domains
            .iter()
            .zip(domains)
            .all(|(used, d)| used.power_w.0 <= d.limit.0 + 1e-6);
    let holds = kept.broken_floors().next().is_none();
    // Worth a change: more than the fixed share, and more than the curves' own noise
    // could show.
    let gain = fresh.objective - kept.objective;
    let noise = STEADY_Z * powerflex_core::allocate::difference_sigma(specs, &fresh, &kept);
    // Only a budget that binds is worth holding caps for: when the fresh decision caps
    // no job, every job runs uncapped, and caps that leave a share of the budget unused
    // (it rose) give it back.
    let binding = fresh
        .jobs
        .iter()
        .zip(specs)
        .any(|(j, s)| j.cap_w.0 < s.limits.max_w.0 - 0.5);
    let uses_budget = kept.total_power_w.0 >= fresh.total_power_w.0 - STEADY_GAIN * budget.0;
    if feasible
        && fits
        && holds
        && binding
        && uses_budget
        && gain <= (STEADY_GAIN * fresh.objective.abs()).max(noise)
    {
        kept
    } else {
        fresh
    }
}
