//! Time as both daemons' machines take it: [`UnixMs`], milliseconds since the Unix epoch.
//!
//! The controller's machine and the agent's machine are handed `now` as a `UnixMs` by
//! their I/O edge (which reads an injected clock, `powerflex_daemon::clock::Clock`), and
//! the site harness hands them a fake one. One type means one conversion to seconds, one
//! saturating subtraction, and no `f64` seconds from an `Instant` on one side and `u64`
//! milliseconds on the other.
//!
//! It is a count, not a calendar: the edge decides whether it follows the wall clock
//! (the controller, whose grid events are set in wall time) or is anchored to it once at
//! start and then steady (the agent, whose leases must not jump with an NTP step).

use std::fmt;

use serde::{Deserialize, Serialize};

/// A point in time: milliseconds since 1970-01-01T00:00:00Z.
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default, Serialize, Deserialize,
)]
#[serde(transparent)]
pub struct UnixMs(pub u64);

impl UnixMs {
    /// The epoch itself: the reading of a clock set before 1970, treated as stale.
    pub const EPOCH: UnixMs = UnixMs(0);

    /// Whole milliseconds since the epoch.
    pub fn ms(self) -> u64 {
        self.0
    }

    /// Seconds since the epoch, for rates and the like.
    pub fn as_secs_f64(self) -> f64 {
        self.0 as f64 / 1000.0
    }

    /// The instant `s` seconds after the epoch, rounded to the nearest millisecond; a
    /// negative, NaN or infinite `s` saturates (to the epoch, or to the far end).
    pub fn from_secs_f64(s: f64) -> UnixMs {
        if s.is_nan() || s <= 0.0 {
            return UnixMs::EPOCH;
        }
        let ms = (s * 1000.0).round();
        if ms >= u64::MAX as f64 {
            UnixMs(u64::MAX)
        } else {
            UnixMs(ms as u64)
        }
    }

    /// `ms` milliseconds later, saturating.
    pub fn plus_ms(self, ms: u64) -> UnixMs {
        UnixMs(self.0.saturating_add(ms))
    }

    /// `s` seconds later (rounded to the ms), saturating; a negative or NaN `s` adds
    /// nothing.
    pub fn plus_secs(self, s: f64) -> UnixMs {
        self.plus_ms(UnixMs::from_secs_f64(s).0)
    }

    /// Milliseconds from `earlier` to `self`, 0 when `earlier` is not earlier.
    pub fn ms_since(self, earlier: UnixMs) -> u64 {
        self.0.saturating_sub(earlier.0)
    }

    /// Seconds from `earlier` to `self`, negative when `earlier` is later.
    pub fn secs_since(self, earlier: UnixMs) -> f64 {
        if self >= earlier {
            (self.0 - earlier.0) as f64 / 1000.0
        } else {
            -((earlier.0 - self.0) as f64 / 1000.0)
        }
    }
}

impl fmt::Display for UnixMs {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} ms", self.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn seconds_round_trip_to_the_millisecond() {
        let t = UnixMs(1_795_910_400_123);
        assert_eq!(UnixMs::from_secs_f64(t.as_secs_f64()), t);
        assert_eq!(t.plus_secs(1.5), UnixMs(1_795_910_401_623));
    }

    #[test]
    fn differences_saturate_or_sign_instead_of_wrapping() {
        let a = UnixMs(1_000);
        let b = UnixMs(3_500);
        assert_eq!(b.ms_since(a), 2_500);
        assert_eq!(a.ms_since(b), 0);
        assert_eq!(b.secs_since(a), 2.5);
        assert_eq!(a.secs_since(b), -2.5);
        assert_eq!(UnixMs(u64::MAX).plus_ms(1), UnixMs(u64::MAX));
    }

    #[test]
    fn nonsense_seconds_saturate() {
        assert_eq!(UnixMs::from_secs_f64(f64::NAN), UnixMs::EPOCH);
        assert_eq!(UnixMs::from_secs_f64(-3.0), UnixMs::EPOCH);
        assert_eq!(UnixMs::from_secs_f64(f64::INFINITY), UnixMs(u64::MAX));
        assert_eq!(UnixMs(10).plus_secs(f64::NAN), UnixMs(10));
    }
}
