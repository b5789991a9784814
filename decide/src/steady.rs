//! When the caps in force stay: a new decision must buy enough to be worth a change.

use std::collections::BTreeMap;

use powerflex_core::allocate::{
    allocation_at_within, Allocation, DomainLimit, FloorStatus, JobSpec,
};
use powerflex_core::Watts;

/// A change of caps that buys less than this share of the site's objective is not made:
/// each change costs the job a settle at its new cap and blurs what the agent learns
/// there, and on a flat optimum the estimates' noise alone would swing a cap between
/// distant values (270 W and 600 W, period after period, in the demo without it).
pub const STEADY_GAIN: f64 = 0.005;

/// Standard deviations of the estimated gain a change must clear: at 2, the curves' noise
/// alone moves the caps in about one period in forty, not one in six as at 1.
pub const STEADY_Z: f64 = 2.0;

/// In a cut too deep for every floor, how much more the caps in force may break a tier's
/// floors (the sum of its broken jobs' slowdown past their bound) than a fresh split
/// before they give way to it: a tenth of a point, below what one window's noise moves an
/// estimate.
const STEADY_FLOOR_EXCESS: f64 = 0.001;

/// The most one-step cuts that bring caps in force back within the budget and every
/// domain: more than that is no trim but a new split.
const TRIM_STEPS: usize = 4;

/// The most the caps in force may be over the budget (or a domain over its limit), as a
/// share of it, to be trimmed: a hair, what a metered draw moves from one period to the
/// next. A budget that fell further (an event's ramp) is split afresh: trims that
/// followed it period by period would drift from the best split.
const TRIM_MAX_OVER: f64 = 0.0025;

/// A change of trimmed caps that buys more than this share of the site's objective is
/// made: trimmed caps have just had to move, and only a split of about the same worth
/// (two that would trade places) is not worth the move.
const TRIMMED_GAIN: f64 = 0.001;

/// Whether `a` is within `budget` and every domain's limit.
fn fits(a: &Allocation, budget: Watts, domains: &[DomainLimit]) -> bool {
    a.total_power_w.0 <= budget.0 + 1e-6
        && a.domains
            .iter()
            .zip(domains)
            .all(|(used, d)| used.power_w.0 <= d.limit.0 + 1e-6)
}

/// Whether `kept` breaks, in every tier (jobs of one bound), floors by no more in all
/// than `fresh` does, within [`STEADY_FLOOR_EXCESS`]: a split of the same tier's breach
/// between its jobs may stay, but no stricter tier may be worse off for a looser one (the
/// tiers give way loosest first, and a sum over all of them would not see the order).
fn breaks_no_more_per_tier(kept: &Allocation, fresh: &Allocation) -> bool {
    let excess = |j: &powerflex_core::allocate::JobAllocation| match j.floor {
        FloorStatus::Broken { excess } => excess,
        _ => 0.0,
    };
    let mut by_tier: Vec<(f64, f64)> = Vec::new();
    for (k, f) in kept.jobs.iter().zip(&fresh.jobs) {
        let Some(bound) = k.max_slowdown.map(|b| b.0) else {
            continue;
        };
        let delta = excess(k) - excess(f);
        match by_tier.iter_mut().find(|(b, _)| (*b - bound).abs() < 1e-9) {
            Some((_, sum)) => *sum += delta,
            None => by_tier.push((bound, delta)),
        }
    }
    by_tier.iter().all(|&(_, more)| more <= STEADY_FLOOR_EXCESS)
}

/// `kept`, or `kept` with at most [`TRIM_STEPS`] one-step cuts that bring it within the
/// budget and every domain: each cut on the job, among those whose power the overrun
/// passes through, that loses the least objective per watt it saves and keeps its floor.
/// `None` when that many cuts do not fit it.
fn trimmed_to_fit(
    kept: Allocation,
    specs: &[JobSpec],
    budget: Watts,
    domains: &[DomainLimit],
) -> Option<Allocation> {
    let over = |a: &Allocation| {
        let site = (a.total_power_w.0 - budget.0) / budget.0.max(1.0);
        a.domains
            .iter()
            .zip(domains)
            .map(|(used, d)| (used.power_w.0 - d.limit.0) / d.limit.0.max(1.0))
            .fold(site, f64::max)
    };
    if over(&kept) > TRIM_MAX_OVER {
        return None;
    }
    let mut current = kept;
    for _ in 0..TRIM_STEPS {
        if fits(&current, budget, domains) {
            return Some(current);
        }
        // The jobs a cut helps: every job when the site is over, else the members of an
        // overrun domain.
        let site_over = current.total_power_w.0 > budget.0 + 1e-6;
        let mut in_overrun = vec![site_over; specs.len()];
        for (used, d) in current.domains.iter().zip(domains) {
            if used.power_w.0 > d.limit.0 + 1e-6 {
                for &(member, _) in &d.members {
                    if let Some(flag) = in_overrun.get_mut(member) {
                        *flag = true;
                    }
                }
            }
        }
        let best = specs
            .iter()
            .zip(&current.jobs)
            .enumerate()
            .filter(|&(i, _)| in_overrun[i])
            .filter_map(|(i, (spec, job))| {
                let lower = (job.cap_w.0 - spec.limits.step_w.0).max(spec.limits.min_w.0);
                let (now, then) = (spec.curve.at(job.cap_w), spec.curve.at(Watts(lower)));
                let saved_w = now.power_w.0 - then.power_w.0;
                if lower >= job.cap_w.0 - 1e-9 || saved_w <= 0.0 {
                    return None;
                }
                let top = spec.curve.at(spec.limits.max_w).throughput;
                let keeps_floor = match spec.max_slowdown {
                    Some(bound) if top > 0.0 => 1.0 - then.throughput / top <= bound.0 + 1e-9,
                    _ => true,
                };
                let lost = spec.throughput_weight * (now.throughput - then.throughput);
                keeps_floor.then_some((i, lower, lost / saved_w))
            })
            .min_by(|a, b| a.2.total_cmp(&b.2))?;
        let mut caps: Vec<Watts> = current.jobs.iter().map(|j| j.cap_w).collect();
        caps[best.0] = Watts(best.1);
        current =
            allocation_at_within(specs, &caps, current.budget_w, domains, current.policy).ok()?;
    }
    fits(&current, budget, domains).then_some(current)
}

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
    // Caps in force a few watts over the budget (a draw that rose by a fraction of a per
    // cent, in metered mode) are trimmed by a step or two where it costs least, rather
    // than given up for a fresh split that moves other jobs too: two splits of nearly
    // equal worth would otherwise trade places every time the draws move (seen in CI:
    // two jobs on one node swapping 20 W per GPU every 1-5 s for 80 s).
    let was_over = !fits(&kept, budget, domains);
    let Some(kept) = trimmed_to_fit(kept, specs, budget, domains) else {
        return fresh;
    };
    let feasible = fresh.over_budget_w.0 == 0.0 && fresh.broken_floors().next().is_none();
    // Every floor held, or, in a cut too deep for every floor (the fresh split breaks one
    // too), only floors the fresh split breaks as well (the tiers give way in their
    // order, loosest first), by no more in all: otherwise two splits that each break a
    // floor by about as much trade places as the windows read at their caps move the
    // curves.
    let holds = if feasible {
        kept.broken_floors().next().is_none()
    } else {
        fresh.over_budget_w.0 == 0.0 && breaks_no_more_per_tier(&kept, &fresh)
    };
    // Worth a change: more than the fixed share, and more than the curves' own noise
    // could show.
    let gain = fresh.objective - kept.objective;
    let noise = STEADY_Z * powerflex_core::allocate::difference_sigma(specs, &fresh, &kept);
    // Trimmed caps must be worth keeping on their estimated objective alone: the curves'
    // noise does not shield them, since a budget they went over is the moment to use
    // what the windows read since the last split (kept whole within the noise, the live
    // A/B's dev set lost 0.8 points of its first event).
    let worth_a_change = if was_over {
        TRIMMED_GAIN * fresh.objective.abs()
    } else {
        (STEADY_GAIN * fresh.objective.abs()).max(noise)
    };
    // Only a budget that binds is worth holding caps for: when the fresh decision caps
    // no job, every job runs uncapped, and caps that leave a share of the budget unused
    // (it rose) give it back.
    let binding = fresh
        .jobs
        .iter()
        .zip(specs)
        .any(|(j, s)| j.cap_w.0 < s.limits.max_w.0 - 0.5);
    let uses_budget = kept.total_power_w.0 >= fresh.total_power_w.0 - STEADY_GAIN * budget.0;
    if holds && binding && uses_budget && gain <= worth_a_change {
        kept
    } else {
        fresh
    }
}
