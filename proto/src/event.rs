//! A grid event as the admin protocol schedules it and the status shows it: its cut, its
//! window and its ramp's length, and what a new one must satisfy. What the ramp does to
//! the budget at each instant is the controller's schedule's
//! (`powerflex_controller_machine::schedule::SteppedRamp`).

use serde::{Deserialize, Serialize};

use crate::ProtoError;

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

/// The longest grid event the controller accepts, ms (a year and a day: a standing limit
/// longer than that is a budget, `budget-set`).
pub const MAX_EVENT_DURATION_MS: u64 = 366 * 86_400_000;

/// The most events the controller holds at once (started or ahead). A utility program
/// has a handful; the bound keeps a VTN serving thousands, or a script in a loop, from
/// growing every allocation's work without end.
pub const MAX_PENDING_EVENTS: usize = 256;

impl Cut {
    /// Whether the cut is one the controller can apply: a fraction in [0, 1], or a
    /// target of finitely many watts, zero or more. The reason names what is accepted.
    pub fn check(&self) -> Result<(), ProtoError> {
        match *self {
            Cut::Reduce { fraction } if !(0.0..=1.0).contains(&fraction) => {
                Err(ProtoError::ReductionOutOfRange { fraction })
            }
            Cut::Target { budget_w } if !budget_w.is_finite() || budget_w < 0.0 => {
                Err(ProtoError::TargetOutOfRange { budget_w })
            }
            _ => Ok(()),
        }
    }
}

/// Whether an event with these fields may be scheduled: a cut [`Cut::check`] accepts, a
/// positive duration of at most [`MAX_EVENT_DURATION_MS`] that ends before the end of
/// `u64` time, and a ramp of at most half the duration (in and out).
pub fn check_new_event(
    cut: &Cut,
    start_ms: u64,
    duration_ms: u64,
    ramp_ms: u64,
) -> Result<(), ProtoError> {
    cut.check()?;
    if duration_ms == 0 || ramp_ms.saturating_mul(2) > duration_ms {
        return Err(ProtoError::RampTooLong {
            duration_ms,
            ramp_ms,
        });
    }
    if duration_ms > MAX_EVENT_DURATION_MS {
        return Err(ProtoError::EventTooLong { duration_ms });
    }
    if start_ms.checked_add(duration_ms).is_none() {
        return Err(ProtoError::EventNeverEnds { start_ms });
    }
    Ok(())
}

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
    /// The power domain whose budget the event cuts; none: the site's budget.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub domain: Option<String>,
}

impl Event {
    pub fn end_ms(&self) -> u64 {
        self.start_ms.saturating_add(self.duration_ms)
    }

    /// Whether the event still matters at `now_ms` (not over).
    pub fn pending(&self, now_ms: u64) -> bool {
        now_ms < self.end_ms()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_events_the_controller_can_apply_are_accepted() {
        let reduce = |fraction| Cut::Reduce { fraction };
        let target = |budget_w| Cut::Target { budget_w };
        let hour = 3_600_000;
        assert_eq!(check_new_event(&reduce(0.3), 0, hour, 60_000), Ok(()));
        assert_eq!(check_new_event(&target(0.0), 0, hour, 0), Ok(()));
        assert_eq!(
            check_new_event(&reduce(1.0), 0, MAX_EVENT_DURATION_MS, 0),
            Ok(())
        );
        let refused = [
            (reduce(1.5), 0, hour, 0, "from 0 to 1"),
            (reduce(-0.1), 0, hour, 0, "from 0 to 1"),
            (reduce(f64::NAN), 0, hour, 0, "from 0 to 1"),
            (target(f64::INFINITY), 0, hour, 0, "finite"),
            (target(-1.0), 0, hour, 0, "0 W or more"),
            (reduce(0.3), 0, 0, 0, "longer than twice its ramp"),
            (
                reduce(0.3),
                0,
                hour,
                hour / 2 + 1,
                "longer than twice its ramp",
            ),
            (reduce(0.3), 0, u64::MAX, 0, "too long"),
            (reduce(0.3), 0, MAX_EVENT_DURATION_MS + 1, 0, "too long"),
            (reduce(0.3), u64::MAX - 5, hour, 0, "never ends"),
        ];
        for (cut, start_ms, duration_ms, ramp_ms, needle) in refused {
            let why = check_new_event(&cut, start_ms, duration_ms, ramp_ms)
                .expect_err(&format!("{cut:?} {start_ms} {duration_ms} {ramp_ms}"))
                .to_string();
            assert!(why.contains(needle), "{why}");
            assert!(why.contains("accepted") || why.contains("needs"), "{why}");
        }
    }
}
