//! A grid event as the admin protocol schedules it and the status shows it: its cut, its
//! window and its stepped ramp ([`Event::depth`]).

use serde::{Deserialize, Serialize};

/// What an event does to the budget.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case", deny_unknown_fields)]
pub enum Cut {
    /// Remove this fraction (0–1) of the base budget.
    Reduce { fraction: f64 },
    /// Bring the budget down to this many watts (never up: a target above the base cuts
    /// nothing).
    Target { budget_w: f64 },
}

/// How long each step of an event's ramp holds, ms: the budget in force moves in steps
/// of this length during a ramp (see [`Event::depth`]).
pub const RAMP_STEP_MS: u64 = 1000;

/// A scheduled grid event. Times are Unix milliseconds.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Event {
    pub id: u64,
    pub cut: Cut,
    pub start_ms: u64,
    pub duration_ms: u64,
    /// Time over which the cut ramps in after `start_ms` and out before the end.
    pub ramp_ms: u64,
}

impl Event {
    pub fn end_ms(&self) -> u64 {
        self.start_ms.saturating_add(self.duration_ms)
    }

    /// How much of the cut applies at `now_ms` (0 to 1): the stepped ramp. The cut grows
    /// in steps of [`RAMP_STEP_MS`] after the start (the first step one step after it)
    /// and shrinks the same way before the end (the last step ends at the end), so the
    /// budget in force is a staircase the grid, the controller and a meter can all check
    /// against, never above the linear ramp during the ramp-down.
    pub fn depth(&self, now_ms: u64) -> f64 {
        if now_ms < self.start_ms || now_ms >= self.end_ms() {
            return 0.0;
        }
        if self.ramp_ms == 0 {
            return 1.0;
        }
        let ramp = self.ramp_ms as f64;
        let steps_in = (now_ms - self.start_ms) / RAMP_STEP_MS;
        let steps_out = (self.end_ms() - now_ms).div_ceil(RAMP_STEP_MS);
        let depth_in = (steps_in.saturating_mul(RAMP_STEP_MS)) as f64 / ramp;
        let depth_out = (steps_out.saturating_mul(RAMP_STEP_MS)) as f64 / ramp;
        depth_in.min(depth_out).min(1.0)
    }

    /// The times in `(from_ms, to_ms]` at which this event's depth may change: the
    /// start, each step of the ramps and the end. Between two of them the budget it leaves
    /// is constant, so the lowest budget over a window is found at these and `from_ms`.
    pub fn changes_in(&self, from_ms: u64, to_ms: u64) -> Vec<u64> {
        let mut out = Vec::new();
        let steps = self.ramp_ms.div_ceil(RAMP_STEP_MS);
        let mut push = |t: u64| {
            if t > from_ms && t <= to_ms {
                out.push(t);
            }
        };
        push(self.start_ms);
        push(self.end_ms());
        if steps == 0 {
            return out;
        }
        // Only the steps inside the window: a ramp may be hours of 1 s steps.
        let lo = from_ms.saturating_sub(self.start_ms) / RAMP_STEP_MS;
        let hi = (to_ms.saturating_sub(self.start_ms) / RAMP_STEP_MS).min(steps);
        for k in lo..=hi {
            push(self.start_ms.saturating_add(k * RAMP_STEP_MS));
        }
        let lo = self.end_ms().saturating_sub(to_ms) / RAMP_STEP_MS;
        let hi = (self.end_ms().saturating_sub(from_ms) / RAMP_STEP_MS + 1).min(steps);
        for k in lo..=hi {
            push(self.end_ms().saturating_sub(k * RAMP_STEP_MS));
        }
        out
    }

    /// Watts this event removes from `base_w` at `now_ms`.
    pub fn cut_w(&self, base_w: f64, now_ms: u64) -> f64 {
        let full = match self.cut {
            Cut::Reduce { fraction } => base_w * fraction.clamp(0.0, 1.0),
            Cut::Target { budget_w } => (base_w - budget_w).max(0.0),
        };
        full * self.depth(now_ms)
    }

    /// Whether the event still matters at `now_ms` (not over).
    pub fn pending(&self, now_ms: u64) -> bool {
        now_ms < self.end_ms()
    }
}
