//! What the controller refuses, and how many connections it serves at once.
//!
//! - [`Refusals`]: a counter per refusal reason, shared by the link, the admin socket and
//!   the metrics server, exported as `powerflex_refusals_total{reason}`.
//! - [`AdminLimits`]: admission on the admin socket (`powerflex_daemon::gate`, with
//!   [`AdminLimits::gate`]'s separate allowances): at most [`AdminLimits::per_uid`]
//!   connections per non-root user and [`AdminLimits::unprivileged`] for all of them
//!   together, and a separate allowance for root, so no user can lock the site's operator
//!   out of `powerflexctl`; [`admin_refusal`] words each refusal.
//!
//! Requests are read with `powerflex_daemon::lines::DeadlineReader`: one deadline for a
//! whole request, not per `read(2)`, so a peer that trickles a byte at a time cannot hold
//! a thread.

use std::collections::BTreeMap;
use std::sync::{Mutex, PoisonError};
use std::time::Duration;

use powerflex_daemon::gate::{GateLimits, Refusal};
use powerflex_daemon::prom::{catalog, TextWriter};

/// Refusal counters by reason (see `powerflex_daemon::prom::catalog::REFUSALS_TOTAL`).
#[derive(Debug, Default)]
pub struct Refusals {
    counts: Mutex<BTreeMap<&'static str, u64>>,
}

impl Refusals {
    /// Counts one refusal for `reason`.
    pub fn count(&self, reason: &'static str) {
        *self
            .counts
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .entry(reason)
            .or_default() += 1;
    }

    /// The count for `reason`.
    pub fn get(&self, reason: &str) -> u64 {
        self.counts
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .get(reason)
            .copied()
            .unwrap_or(0)
    }

    /// The `powerflex_refusals_total` family, with `extra` counts (kept elsewhere) added.
    pub fn render(&self, extra: &[(&'static str, u64)]) -> String {
        let mut counts = self
            .counts
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone();
        for (reason, n) in extra {
            *counts.entry(reason).or_default() += n;
        }
        let mut w = TextWriter::new();
        w.family(
            &catalog::REFUSALS_TOTAL,
            counts.iter().map(|(reason, n)| ([*reason], *n as f64)),
        );
        w.finish()
    }
}

/// How many admin connections the controller serves at once.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AdminLimits {
    /// Per non-root uid.
    pub per_uid: usize,
    /// All non-root uids together.
    pub unprivileged: usize,
    /// Root's own allowance, apart from everyone else's.
    pub root: usize,
    /// Longest a client may take to send its request, and to take the reply (each).
    pub io_timeout: Duration,
}

impl Default for AdminLimits {
    fn default() -> AdminLimits {
        AdminLimits {
            per_uid: 4,
            unprivileged: 32,
            root: 8,
            io_timeout: Duration::from_secs(2),
        }
    }
}

impl AdminLimits {
    /// The admission limits: users and root each their own allowance.
    pub const fn gate(&self) -> GateLimits {
        GateLimits::separate(self.per_uid, self.unprivileged, self.root)
    }
}

/// The refusal counter's reason and the reply's message for an admin connection the gate
/// refused.
pub fn admin_refusal(refusal: Refusal, limits: &AdminLimits) -> (&'static str, String) {
    match refusal {
        Refusal::UidFull { uid, open } => (
            "admin_uid_cap",
            format!(
                "too many admin connections from uid {uid}: {open} open; at most {} per user at once",
                limits.per_uid
            ),
        ),
        Refusal::RootFull { open } => (
            "admin_cap",
            format!(
                "controller busy: {open} root admin connections open; at most {} at once",
                limits.root
            ),
        ),
        Refusal::UsersFull { open } => (
            "admin_cap",
            format!(
                "controller busy: {open} admin connections open; at most {} at once",
                limits.unprivileged
            ),
        ),
        // Not reached with separate allowances (users and root each stop first); worded
        // for the socket as a whole should the shape change.
        Refusal::Full { open } => (
            "admin_cap",
            format!(
                "controller busy: {open} admin connections open in all; at most {} at once",
                limits.unprivileged + limits.root
            ),
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The gate's logic is `powerflex_daemon::gate`'s (tested there); what is the
    /// controller's is the wording and the counter label of each refusal.
    #[test]
    fn each_refusal_says_what_stopped_it() {
        let limits = AdminLimits {
            per_uid: 2,
            unprivileged: 3,
            root: 1,
            io_timeout: Duration::from_secs(1),
        };
        let gate = powerflex_daemon::gate::Gate::new(limits.gate());
        let _a = gate.enter(1000).expect("first");
        let _b = gate.enter(1000).expect("second");
        let (reason, message) = admin_refusal(gate.enter(1000).expect_err("per uid"), &limits);
        assert_eq!(reason, "admin_uid_cap");
        assert!(
            message.contains("from uid 1000: 2 open; at most 2 per user"),
            "{message}"
        );
        let _c = gate.enter(1001).expect("third user place");
        let (reason, message) = admin_refusal(gate.enter(1002).expect_err("users"), &limits);
        assert_eq!(reason, "admin_cap");
        assert!(
            message.contains("3 admin connections open; at most 3"),
            "{message}"
        );
        let _root = gate.enter(0).expect("root's own allowance");
        let (reason, message) = admin_refusal(gate.enter(0).expect_err("root"), &limits);
        assert_eq!(reason, "admin_cap");
        assert!(
            message.contains("1 root admin connections open; at most 1"),
            "{message}"
        );
    }

    #[test]
    fn refusals_render_as_one_counter_family() {
        let r = Refusals::default();
        r.count("mac");
        r.count("mac");
        r.count("version");
        assert_eq!(r.get("mac"), 2);
        let text = r.render(&[("metrics_bad_request", 3)]);
        assert!(
            text.contains("# TYPE powerflex_refusals_total counter\n"),
            "{text}"
        );
        assert!(
            text.contains("powerflex_refusals_total{reason=\"mac\"} 2\n"),
            "{text}"
        );
        assert!(
            text.contains("powerflex_refusals_total{reason=\"version\"} 1\n"),
            "{text}"
        );
        assert!(
            text.contains("powerflex_refusals_total{reason=\"metrics_bad_request\"} 3\n"),
            "{text}"
        );
    }
}
