//! Wall-clock time as every powerflex process exchanges it: milliseconds since the Unix
//! epoch, in a `u64`. The link's timestamps, the controller's state and history, the
//! simulator's shared files and the tools all use this one reading, so two processes on
//! one host compare their times directly.
//!
//! A clock set before 1970 reads 0 rather than failing: callers treat an old time as
//! stale, which is the safe reading for leases and reports.

use std::time::{SystemTime, UNIX_EPOCH};

/// Now, in ms since the Unix epoch (0 if the clock is before it; saturating far after).
pub fn unix_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_after_the_project_began_and_never_goes_back_in_one_process() {
        // 2026-11-29, the first commit: a clock reading earlier is broken, not early.
        const PROJECT_BEGAN_MS: u64 = 1_795_910_400_000;
        let a = unix_ms();
        let b = unix_ms();
        assert!(a > PROJECT_BEGAN_MS, "{a}");
        assert!(b >= a.saturating_sub(1_000), "{a} then {b}");
    }
}
