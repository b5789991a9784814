//! The budget an allocation is made for, pure: ahead of ramp-downs, behind ramp-ups.
//!
//! The budget in force is a staircase ([`crate::schedule`]): during a ramp-down it drops one step
//! at a time. Caps sent when a step takes effect arrive late: the agent applies a lease at its next
//! sample, reports it back, and the draw settles a few hundred milliseconds later, so the meter
//! sits above the new step for up to a second or two (51 of 497 samples over, by up to 122 W, when
//! caps followed the steps). So each allocation is made for the lowest step of the window it will
//! be in force for (until the next allocation) plus the time a decrease takes to be applied and
//! confirmed ([`look_ahead_ms`]): the caps are down and confirmed before the step they serve takes
//! effect.
//!
//! Going up, the opposite: when an event ends (or a ramp-up steps, or an admin raises the
//! budget) every capped job speeds up at once, and the site's draw jumps by the whole cut.
//! A site may bound that rebound with `facility.max_ramp_w_per_s`: the budget allocated
//! rises at most that fast from the last one allocated, whatever the budget in force does.
//! Decreases are never slowed.

use powerflex_core::Watts;

use crate::schedule::{effective_budget, lowest_budget};
use powerflex_proto::event::Event;

/// What one allocation is made for.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RampPlan {
    /// The budget in force now (the stepped budget the grid sees), W.
    pub in_force_w: f64,
    /// The lowest budget in force before this allocation's caps may be replaced, W.
    pub ahead_w: f64,
    /// What the allocation is made for: `ahead_w`, held back on the way up by the
    /// ramp-rate limit, W.
    pub allocate_w: f64,
    /// Whether the ramp-rate limit held the allocation below `ahead_w`.
    pub rate_limited: bool,
}

/// How far ahead an allocation at `now` looks: until the next allocation (`period_ms`)
/// plus the time its decreases take to be applied and confirmed (`confirm_ms`), ms.
pub fn look_ahead_ms(period_ms: u64, confirm_ms: u64) -> u64 {
    period_ms.saturating_add(confirm_ms)
}

/// The state of the ramp: the last budget allocated for, and when.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Ramp {
    last: Option<(u64, f64)>,
}

impl Ramp {
    pub fn new() -> Ramp {
        Ramp::default()
    }

    /// The budget to allocate for at `now_ms`, looking `ahead_ms` ahead, rising at most
    /// `max_w_per_s` (None: no limit) from the last plan. Remembers the plan.
    pub fn plan(
        &mut self,
        base: Watts,
        events: &[Event],
        now_ms: u64,
        ahead_ms: u64,
        max_w_per_s: Option<f64>,
    ) -> RampPlan {
        let in_force_w = effective_budget(base, events, now_ms).0;
        let ahead_w = lowest_budget(base, events, now_ms, now_ms.saturating_add(ahead_ms)).0;
        let (allocate_w, rate_limited) = match (self.last, max_w_per_s) {
            (Some((then_ms, last_w)), Some(rate)) if ahead_w > last_w => {
                let dt_s = now_ms.saturating_sub(then_ms) as f64 / 1000.0;
                let most_w = last_w + rate * dt_s;
                if most_w < ahead_w {
                    (most_w, true)
                } else {
                    (ahead_w, false)
                }
            }
            _ => (ahead_w, false),
        };
        self.last = Some((now_ms, allocate_w));
        RampPlan {
            in_force_w,
            ahead_w,
            allocate_w,
            rate_limited,
        }
    }

    /// Forgets the last plan: the next one is not rate-limited (a new controller has no
    /// history to ramp from).
    pub fn reset(&mut self) {
        self.last = None;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use powerflex_proto::event::Cut;

    const T0: u64 = 1_800_000_000_000;

    fn event(start: u64, duration: u64, ramp: u64) -> Event {
        Event {
            id: 1,
            cut: Cut::Reduce { fraction: 0.3 },
            start_ms: start,
            duration_ms: duration,
            ramp_ms: ramp,
            domain: None,
        }
    }

    /// Allocating every `period` on a fake clock through a 30 % event with a 10 s ramp,
    /// the budget allocated is at or below the budget in force at every millisecond until
    /// the next allocation plus the confirmation time: caps are down before each step.
    #[test]
    fn every_step_down_is_allocated_for_before_it_takes_effect() {
        let base = Watts(10_000.0);
        let events = [event(T0 + 20_000, 60_000, 10_000)];
        for period in [1_000, 3_000, 10_000] {
            let ahead = look_ahead_ms(period, 2_000);
            let mut ramp = Ramp::new();
            let mut t = T0;
            while t < T0 + 100_000 {
                let plan = ramp.plan(base, &events, t, ahead, None);
                // The caps of this plan are in force (confirmed) from t + 2 s at the
                // latest until the next plan's are, t + period + 2 s.
                for at in (t..=t + ahead).step_by(50) {
                    let in_force = effective_budget(base, &events, at).0;
                    assert!(
                        plan.allocate_w <= in_force,
                        "period {period}: allocated at {} for {} W, {} W in force at {}",
                        t - T0,
                        plan.allocate_w,
                        in_force,
                        at - T0
                    );
                }
                assert!(plan.allocate_w <= plan.in_force_w);
                t += period;
            }
        }
    }

    #[test]
    fn an_event_announced_ahead_is_met_before_it_starts() {
        let base = Watts(10_000.0);
        // No ramp: the whole cut at the start.
        let events = [event(T0 + 5_000, 60_000, 0)];
        let mut ramp = Ramp::new();
        let plan = ramp.plan(base, &events, T0, 3_000, None);
        assert_eq!((plan.in_force_w, plan.allocate_w), (10_000.0, 10_000.0));
        let plan = ramp.plan(base, &events, T0 + 2_500, 3_000, None);
        assert_eq!(plan.in_force_w, 10_000.0, "not started");
        assert_eq!(plan.allocate_w, 7_000.0, "but the caps are down already");
    }

    #[test]
    fn the_rebound_rises_no_faster_than_the_limit() {
        let base = Watts(10_000.0);
        let events = [event(T0, 30_000, 0)];
        let mut ramp = Ramp::new();
        let rate = 200.0;
        let mut last = ramp.plan(base, &events, T0 + 10_000, 2_000, Some(rate));
        assert_eq!(last.allocate_w, 7_000.0);
        let mut t = T0 + 10_000;
        let mut reached = None;
        while t < T0 + 60_000 {
            t += 1_000;
            let plan = ramp.plan(base, &events, t, 2_000, Some(rate));
            assert!(
                plan.allocate_w - last.allocate_w <= rate * 1.0 + 1e-9,
                "at {}: {} after {}",
                t - T0,
                plan.allocate_w,
                last.allocate_w
            );
            assert!(plan.allocate_w <= plan.ahead_w);
            if plan.allocate_w == 10_000.0 && reached.is_none() {
                reached = Some(t - T0);
            }
            last = plan;
        }
        // The event ends at 30 s, and the budget rises only once it has; 3000 W at
        // 200 W/s is 15 s more.
        assert_eq!(reached, Some(44_000));
    }

    #[test]
    fn decreases_are_never_slowed_and_no_limit_means_none() {
        let base = Watts(10_000.0);
        let mut ramp = Ramp::new();
        ramp.plan(base, &[], T0, 2_000, Some(1.0));
        let cut = [event(T0 + 1_000, 60_000, 0)];
        let plan = ramp.plan(base, &cut, T0 + 500, 2_000, Some(1.0));
        assert_eq!(plan.allocate_w, 7_000.0);
        assert!(!plan.rate_limited);
        let plan = ramp.plan(base, &[], T0 + 1_000, 2_000, None);
        assert_eq!(plan.allocate_w, 10_000.0);
        ramp.reset();
        ramp.plan(base, &cut, T0 + 2_000, 2_000, Some(1.0));
        ramp.reset();
        let plan = ramp.plan(base, &[], T0 + 3_000, 2_000, Some(1.0));
        assert_eq!(plan.allocate_w, 10_000.0, "reset: nothing to ramp from");
    }
}
