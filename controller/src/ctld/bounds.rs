//! What the controller refuses, and how many connections it serves at once.
//!
//! - [`Refusals`]: a counter per refusal reason, shared by the link, the admin socket and
//!   the metrics server, exported as `powerflex_refusals_total{reason}`.
//! - [`AdminGate`]: admission on the admin socket (pure logic behind a mutex): at most
//!   [`AdminLimits::per_uid`] connections per non-root user and
//!   [`AdminLimits::unprivileged`] for all of them together, and a separate allowance for
//!   root, so no user can lock the site's operator out of `powerflexctl`.
//!
//! Requests are read with `powerflex_daemon::lines::DeadlineReader`: one deadline for a
//! whole request, not per `read(2)`, so a peer that trickles a byte at a time cannot hold
//! a thread.

use std::collections::BTreeMap;
use std::sync::{Mutex, PoisonError};
use std::time::Duration;

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

/// Why an admin connection was not admitted: the refusal reason and the message sent.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AdminRefusal {
    pub reason: &'static str,
    pub message: String,
}

/// Decides whether uid `uid` may open one more admin connection, given the connections
/// open now per uid.
pub fn admit(
    open: &BTreeMap<u32, usize>,
    uid: u32,
    limits: &AdminLimits,
) -> Result<(), AdminRefusal> {
    let mine = open.get(&uid).copied().unwrap_or(0);
    if uid == 0 {
        if mine >= limits.root {
            return Err(AdminRefusal {
                reason: "admin_cap",
                message: format!(
                    "controller busy: {mine} root admin connections open; at most {} at once",
                    limits.root
                ),
            });
        }
        return Ok(());
    }
    if mine >= limits.per_uid {
        return Err(AdminRefusal {
            reason: "admin_uid_cap",
            message: format!(
                "too many admin connections from uid {uid}: {mine} open; at most {} per user at once",
                limits.per_uid
            ),
        });
    }
    let unprivileged: usize = open.iter().filter(|(u, _)| **u != 0).map(|(_, n)| n).sum();
    if unprivileged >= limits.unprivileged {
        return Err(AdminRefusal {
            reason: "admin_cap",
            message: format!(
                "controller busy: {unprivileged} admin connections open; at most {} at once",
                limits.unprivileged
            ),
        });
    }
    Ok(())
}

/// [`admit`] over the connections open now, holding a place until the returned guard
/// drops.
#[derive(Debug, Default)]
pub struct AdminGate {
    open: Mutex<BTreeMap<u32, usize>>,
    limits: AdminLimits,
}

/// A place at the admin socket, given back on drop.
#[derive(Debug)]
pub struct AdminPlace {
    gate: std::sync::Arc<AdminGate>,
    uid: u32,
}

impl AdminGate {
    pub fn new(limits: AdminLimits) -> AdminGate {
        AdminGate {
            open: Mutex::new(BTreeMap::new()),
            limits,
        }
    }

    pub fn limits(&self) -> &AdminLimits {
        &self.limits
    }

    /// Admits one connection of `uid`, or says why not.
    pub fn enter(self: &std::sync::Arc<Self>, uid: u32) -> Result<AdminPlace, AdminRefusal> {
        let mut open = self.open.lock().unwrap_or_else(PoisonError::into_inner);
        admit(&open, uid, &self.limits)?;
        *open.entry(uid).or_default() += 1;
        Ok(AdminPlace {
            gate: self.clone(),
            uid,
        })
    }
}

impl Drop for AdminPlace {
    fn drop(&mut self) {
        let mut open = self
            .gate
            .open
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        if let Some(n) = open.get_mut(&self.uid) {
            *n = n.saturating_sub(1);
            if *n == 0 {
                open.remove(&self.uid);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn admission_caps_each_user_all_users_and_keeps_room_for_root() {
        let limits = AdminLimits {
            per_uid: 2,
            unprivileged: 3,
            root: 1,
            io_timeout: Duration::from_secs(1),
        };
        let mut open = BTreeMap::new();
        assert_eq!(admit(&open, 1000, &limits), Ok(()));
        open.insert(1000, 2);
        let refused = admit(&open, 1000, &limits).expect_err("per uid");
        assert_eq!(refused.reason, "admin_uid_cap");
        assert!(
            refused.message.contains("at most 2 per user"),
            "{}",
            refused.message
        );
        assert_eq!(admit(&open, 1001, &limits), Ok(()));
        open.insert(1001, 1);
        let refused = admit(&open, 1002, &limits).expect_err("all users");
        assert_eq!(refused.reason, "admin_cap");
        // Users filling their share leave root's.
        assert_eq!(admit(&open, 0, &limits), Ok(()));
        open.insert(0, 1);
        assert_eq!(
            admit(&open, 0, &limits).expect_err("root").reason,
            "admin_cap"
        );
    }

    #[test]
    fn the_gate_gives_places_back() {
        let gate = std::sync::Arc::new(AdminGate::new(AdminLimits {
            per_uid: 1,
            unprivileged: 1,
            root: 1,
            io_timeout: Duration::from_secs(1),
        }));
        let place = gate.enter(1000).expect("first");
        assert!(gate.enter(1000).is_err());
        drop(place);
        assert!(gate.enter(1000).is_ok());
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
