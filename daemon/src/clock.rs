//! Wall-clock time as every powerflex process exchanges it: milliseconds since the Unix
//! epoch, in a `u64`. The link's timestamps, the controller's state and history, the
//! simulator's shared files and the tools all use this one reading, so two processes on
//! one host compare their times directly.
//!
//! A clock set before 1970 reads 0 rather than failing: callers treat an old time as
//! stale, which is the safe reading for leases and reports.
//!
//! The daemons' edges read `now` through the [`Clock`] trait and hand it to their
//! machines as a [`UnixMs`]: [`WallClock`] follows the wall clock (the controller: grid
//! events are set in wall time), [`SteadyClock`] is anchored to it once and then counts a
//! monotonic clock (the agent: an NTP step must not expire or stretch a lease), and
//! [`BootClock`] counts the time since boot, suspend included (the controller's
//! leadership deadlines). The site
//! harness gives the machines a fake one instead.

use std::time::{Instant, SystemTime, UNIX_EPOCH};

pub use powerflex_core::UnixMs;

/// Where an I/O edge reads `now` for its machine.
pub trait Clock: Send + Sync + std::fmt::Debug {
    fn now(&self) -> UnixMs;
}

/// The wall clock: [`unix_ms`] at every reading.
#[derive(Debug, Clone, Copy, Default)]
pub struct WallClock;

impl Clock for WallClock {
    fn now(&self) -> UnixMs {
        UnixMs(unix_ms())
    }
}

/// The wall clock read once, then a monotonic clock: it never steps back or jumps with
/// the wall clock, and stays within the system's drift of it.
#[derive(Debug, Clone, Copy)]
pub struct SteadyClock {
    anchor_wall: UnixMs,
    anchor: Instant,
}

impl SteadyClock {
    pub fn start() -> SteadyClock {
        SteadyClock {
            anchor_wall: UnixMs(unix_ms()),
            anchor: Instant::now(),
        }
    }
}

impl Clock for SteadyClock {
    fn now(&self) -> UnixMs {
        let elapsed = u64::try_from(self.anchor.elapsed().as_millis()).unwrap_or(u64::MAX);
        self.anchor_wall.plus_ms(elapsed)
    }
}

/// The wall clock read once, then the time since boot (`CLOCK_BOOTTIME`): like
/// [`SteadyClock`] it never steps with the wall clock, and unlike it it counts the time
/// the host spent suspended. For deadlines that must pass while a host sleeps (a
/// controller's leadership: its row lapses on the database's clock meanwhile).
#[derive(Debug, Clone, Copy)]
pub struct BootClock {
    anchor_wall: UnixMs,
    anchor_boot_ms: u64,
}

impl BootClock {
    pub fn start() -> BootClock {
        BootClock {
            anchor_wall: UnixMs(unix_ms()),
            anchor_boot_ms: boot_ms(),
        }
    }
}

impl Clock for BootClock {
    fn now(&self) -> UnixMs {
        self.anchor_wall
            .plus_ms(boot_ms().saturating_sub(self.anchor_boot_ms))
    }
}

/// Milliseconds since boot, suspend included (`CLOCK_BOOTTIME`).
fn boot_ms() -> u64 {
    let t = rustix::time::clock_gettime(rustix::time::ClockId::Boottime);
    let secs = u64::try_from(t.tv_sec).unwrap_or(0);
    let ms = u64::try_from(t.tv_nsec).unwrap_or(0) / 1_000_000;
    secs.saturating_mul(1_000).saturating_add(ms)
}

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

    #[test]
    fn the_boot_clock_starts_at_the_wall_clock_and_never_goes_back() {
        let wall = WallClock.now();
        let boot = BootClock::start();
        let first = boot.now();
        assert!(first.ms_since(wall) < 1_000, "{wall} then {first}");
        std::thread::sleep(std::time::Duration::from_millis(20));
        let second = boot.now();
        assert!(second.ms_since(first) >= 20, "{first} then {second}");
    }

    #[test]
    fn the_steady_clock_starts_at_the_wall_clock_and_never_goes_back() {
        let wall = WallClock.now();
        let steady = SteadyClock::start();
        let first = steady.now();
        assert!(first.ms_since(wall) < 1_000, "{wall} then {first}");
        std::thread::sleep(std::time::Duration::from_millis(20));
        let second = steady.now();
        assert!(second.ms_since(first) >= 20, "{first} then {second}");
    }
}
