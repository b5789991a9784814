//! Leases that cannot overshoot: decreases before increases, pure.
//!
//! A new allocation lowers some jobs' caps and raises others'. Sent to every node at once,
//! a node that raises before another has lowered puts the site over its budget for as
//! long as the slower node takes (its next tick, a slow link, a busy agent). So a change
//! goes out in two steps:
//!
//! 1. **Safe leases at once**: every node gets, per job, the lower of its new cap and the
//!    cap it may be running at now. Nothing rises.
//! 2. **Increases after the acknowledgements**: once every node that had a cap lowered
//!    reports, read back through NVML, caps at or below what it was sent, the nodes with
//!    increases get their full new lease.
//!
//! A node that does not acknowledge within the timeout is reported as stalled: the caller
//! counts it at the most it may draw (as a silent node) and allocates again, so the
//! increases that go out never assume a decrease that was not confirmed.
//!
//! What a node "may be running at" is an upper bound kept per job: raised as soon as a
//! higher cap is sent, lowered only when a report confirms the lower one. A job a lease
//! does not name runs at the lease's start cap (the agent's rule), so that is its bound.

use std::collections::{BTreeMap, BTreeSet};

/// Caps within this many watts of each other are the same cap.
const SAME_CAP_W: f64 = 0.5;

/// Per job, per-GPU caps, W.
pub type Caps = BTreeMap<String, f64>;

/// A lease to send to one node now.
#[derive(Debug, Clone, PartialEq)]
pub struct LeaseOut {
    pub node: String,
    pub caps: Caps,
}

/// The two-step rollout of allocations to nodes.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Rollout {
    /// Per node: the highest per-GPU cap each job may be running at now.
    may_run_at: BTreeMap<String, Caps>,
    /// Per node: the caps last sent.
    sent: BTreeMap<String, Caps>,
    /// Per node: the full lease waiting for the decreases to be confirmed.
    pending: BTreeMap<String, Caps>,
    /// Nodes whose lowered caps are not yet confirmed, and since when (ms).
    unconfirmed: BTreeMap<String, u64>,
}

impl Rollout {
    pub fn new() -> Rollout {
        Rollout::default()
    }

    /// Starts rolling out `targets` (per node, the caps of the new allocation) at
    /// `now_ms`. `start_cap_w` is the cap a job its lease does not name runs at. Returns
    /// the leases to send now: the targets with every increase held back while any
    /// decrease anywhere is unconfirmed.
    pub fn begin(
        &mut self,
        targets: &BTreeMap<String, Caps>,
        start_cap_w: f64,
        now_ms: u64,
    ) -> Vec<LeaseOut> {
        self.pending.clear();
        // Nodes no longer in the allocation have no lease to keep track of.
        self.may_run_at.retain(|node, _| targets.contains_key(node));
        self.sent.retain(|node, _| targets.contains_key(node));
        self.unconfirmed
            .retain(|node, _| targets.contains_key(node));
        let mut out = Vec::new();
        for (node, target) in targets {
            let bound = self.may_run_at.entry(node.clone()).or_default();
            let mut safe = Caps::new();
            let mut lowers = false;
            let mut raises = false;
            for (job, &cap) in target {
                let now_at = bound.get(job).copied().unwrap_or(start_cap_w);
                if cap > now_at + SAME_CAP_W {
                    raises = true;
                    safe.insert(job.clone(), now_at);
                } else {
                    // Any decrease, however small, is confirmed before a rise elsewhere
                    // counts on it.
                    if cap < now_at {
                        lowers = true;
                    }
                    // Within rounding of the cap in force: keep it, so nothing rises.
                    safe.insert(job.clone(), cap.min(now_at));
                }
            }
            // Jobs gone from the lease fall to the start cap on the agent.
            for (job, &now_at) in bound.iter() {
                if !target.contains_key(job) && start_cap_w < now_at {
                    lowers = true;
                }
            }
            for (job, cap) in &safe {
                // The bound rises with what is sent (never above the target) and falls
                // only when the node confirms.
                let entry = bound.entry(job.clone()).or_insert(start_cap_w);
                *entry = entry.max(*cap);
            }
            if lowers {
                self.unconfirmed.entry(node.clone()).or_insert(now_ms);
            }
            if raises {
                self.pending.insert(node.clone(), target.clone());
            }
            self.sent.insert(node.clone(), safe.clone());
            out.push(LeaseOut {
                node: node.clone(),
                caps: safe,
            });
        }
        // Nothing to wait for: the full leases replace the safe ones at once.
        // By node: a linear search per released lease would make this quadratic in nodes
        // (a tenth of a 10,000-node reallocation).
        let released = self.release();
        let mut at: std::collections::HashMap<String, usize> = out
            .iter()
            .enumerate()
            .map(|(k, l)| (l.node.clone(), k))
            .collect();
        for full in released {
            match at.get(&full.node) {
                Some(&k) => out[k] = full,
                None => {
                    at.insert(full.node.clone(), out.len());
                    out.push(full);
                }
            }
        }
        out
    }

    /// A node reported the per-GPU cap in force for each of its jobs (read back through
    /// NVML). Jobs at or below what was sent confirm it. Returns the leases that may go
    /// out now (the held increases, once nothing is unconfirmed).
    pub fn confirmed(&mut self, node: &str, caps_in_force: &Caps) -> Vec<LeaseOut> {
        self.confirm(node, caps_in_force);
        self.release()
    }

    /// [`Self::confirmed`] without releasing anything: the caller releases with
    /// [`Self::release_ready`] once it has seen everything it received together, so an
    /// increase decided on older reports never goes out past a newer one (or over the
    /// leases of an allocation made from it).
    pub fn confirm(&mut self, node: &str, caps_in_force: &Caps) {
        let (Some(sent), Some(bound)) = (self.sent.get(node), self.may_run_at.get_mut(node)) else {
            return;
        };
        let mut all = true;
        for (job, &cap) in sent {
            match caps_in_force.get(job) {
                Some(&now) if now <= cap + SAME_CAP_W => {
                    bound.insert(job.clone(), cap);
                }
                // A job the node does not report has ended there: it draws nothing.
                None => {
                    bound.remove(job);
                }
                Some(_) => all = false,
            }
        }
        bound.retain(|job, _| sent.contains_key(job));
        if all {
            self.unconfirmed.remove(node);
        }
    }

    /// The held increases, once every decrease they wait for is confirmed.
    pub fn release_ready(&mut self) -> Vec<LeaseOut> {
        self.release()
    }

    /// Drops the increases held for confirmation: the reports they were decided on no
    /// longer hold (a job's draw rose since), so they must not go out. The decreases
    /// already sent stay in force and are still confirmed as usual.
    pub fn drop_held(&mut self) {
        self.pending.clear();
    }

    /// Nodes whose lowered caps have gone unconfirmed for `timeout_ms` at `now_ms`. The
    /// caller counts them at the most they may draw and allocates again.
    pub fn stalled(&self, now_ms: u64, timeout_ms: u64) -> BTreeSet<String> {
        self.unconfirmed
            .iter()
            .filter(|(_, &since)| now_ms.saturating_sub(since) >= timeout_ms)
            .map(|(node, _)| node.clone())
            .collect()
    }

    /// Whether increases are waiting for confirmations.
    pub fn holding_increases(&self) -> bool {
        !self.pending.is_empty()
    }

    /// The highest cap each job of `node` may be running at now, per GPU, W.
    pub fn may_run_at(&self, node: &str) -> Option<&Caps> {
        self.may_run_at.get(node)
    }

    fn release(&mut self) -> Vec<LeaseOut> {
        if !self.unconfirmed.is_empty() || self.pending.is_empty() {
            return Vec::new();
        }
        let mut out = Vec::new();
        for (node, caps) in std::mem::take(&mut self.pending) {
            let bound = self.may_run_at.entry(node.clone()).or_default();
            for (job, &cap) in &caps {
                let entry = bound.entry(job.clone()).or_insert(cap);
                *entry = entry.max(cap);
            }
            self.sent.insert(node.clone(), caps.clone());
            out.push(LeaseOut { node, caps });
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn caps(pairs: &[(&str, f64)]) -> Caps {
        pairs.iter().map(|(j, c)| (j.to_string(), *c)).collect()
    }

    fn targets(nodes: &[(&str, Caps)]) -> BTreeMap<String, Caps> {
        nodes
            .iter()
            .map(|(n, c)| (n.to_string(), c.clone()))
            .collect()
    }

    fn lease<'a>(out: &'a [LeaseOut], node: &str) -> Option<&'a Caps> {
        out.iter().find(|l| l.node == node).map(|l| &l.caps)
    }

    /// The site draws at most Σ bound × GPUs at any moment of a rollout: check that the
    /// bound the rollout keeps never exceeds the budget when both ends are within it.
    #[test]
    fn increases_wait_until_every_decrease_is_confirmed() {
        let mut r = Rollout::new();
        // Period 1: a at 600 on n1, b at 300 on n2.
        let first = r.begin(
            &targets(&[("n1", caps(&[("a", 600.0)])), ("n2", caps(&[("b", 300.0)]))]),
            300.0,
            0,
        );
        // a rises from its start cap (300): held until nothing is unconfirmed; nothing
        // was lowered, so it goes out at once.
        assert_eq!(lease(&first, "n1"), Some(&caps(&[("a", 600.0)])));
        r.confirmed("n1", &caps(&[("a", 600.0)]));
        r.confirmed("n2", &caps(&[("b", 300.0)]));
        // Period 2: the budget moves 300 W per GPU from a to b.
        let second = r.begin(
            &targets(&[("n1", caps(&[("a", 300.0)])), ("n2", caps(&[("b", 600.0)]))]),
            300.0,
            1000,
        );
        assert_eq!(
            second.len(),
            2,
            "one safe lease per node, no increase yet: {second:?}"
        );
        assert_eq!(lease(&second, "n1"), Some(&caps(&[("a", 300.0)])));
        assert_eq!(lease(&second, "n2"), Some(&caps(&[("b", 300.0)])), "b held");
        assert!(r.holding_increases());
        // n2 confirming its own (unchanged) caps releases nothing: n1 has not confirmed.
        assert!(r.confirmed("n2", &caps(&[("b", 300.0)])).is_empty());
        // n1 reports it is still at 600 (its tick has not come): nothing yet.
        assert!(r.confirmed("n1", &caps(&[("a", 600.0)])).is_empty());
        // n1 confirms: b's increase goes out.
        let released = r.confirmed("n1", &caps(&[("a", 300.0)]));
        assert_eq!(
            released,
            vec![LeaseOut {
                node: "n2".into(),
                caps: caps(&[("b", 600.0)])
            }]
        );
        assert!(!r.holding_increases());
        assert_eq!(r.may_run_at("n2"), Some(&caps(&[("b", 600.0)])));
    }

    #[test]
    fn a_node_that_does_not_confirm_is_reported_stalled_after_the_timeout() {
        let mut r = Rollout::new();
        r.begin(&targets(&[("n1", caps(&[("a", 600.0)]))]), 300.0, 0);
        r.confirmed("n1", &caps(&[("a", 600.0)]));
        r.begin(
            &targets(&[("n1", caps(&[("a", 300.0)])), ("n2", caps(&[("b", 600.0)]))]),
            300.0,
            10_000,
        );
        assert!(r.stalled(11_000, 3_000).is_empty());
        assert_eq!(r.stalled(13_000, 3_000), BTreeSet::from(["n1".to_string()]));
        // The bound stays at 600 W for the unconfirmed job: the caller pays for it.
        assert_eq!(r.may_run_at("n1"), Some(&caps(&[("a", 600.0)])));
    }

    #[test]
    fn a_new_allocation_before_the_confirmation_keeps_the_old_bound() {
        let mut r = Rollout::new();
        r.begin(&targets(&[("n1", caps(&[("a", 600.0)]))]), 300.0, 0);
        r.confirmed("n1", &caps(&[("a", 600.0)]));
        r.begin(&targets(&[("n1", caps(&[("a", 400.0)]))]), 300.0, 1000);
        // Before n1 confirms 400, the next period wants 500: still an increase over
        // nothing confirmed below 600, so 500 goes out (below the 600 bound) and the
        // bound stays 600 until confirmed.
        let out = r.begin(&targets(&[("n1", caps(&[("a", 500.0)]))]), 300.0, 2000);
        assert_eq!(lease(&out, "n1"), Some(&caps(&[("a", 500.0)])));
        assert_eq!(r.may_run_at("n1"), Some(&caps(&[("a", 600.0)])));
        r.confirmed("n1", &caps(&[("a", 500.0)]));
        assert_eq!(r.may_run_at("n1"), Some(&caps(&[("a", 500.0)])));
    }

    #[test]
    fn jobs_that_leave_a_lease_fall_to_the_start_cap_and_count_as_a_decrease() {
        let mut r = Rollout::new();
        r.begin(&targets(&[("n1", caps(&[("a", 650.0)]))]), 300.0, 0);
        r.confirmed("n1", &caps(&[("a", 650.0)]));
        let out = r.begin(
            &targets(&[("n1", caps(&[])), ("n2", caps(&[("b", 650.0)]))]),
            300.0,
            1000,
        );
        assert_eq!(
            lease(&out, "n2"),
            Some(&caps(&[("b", 300.0)])),
            "b waits for a's end"
        );
        let released = r.confirmed("n1", &caps(&[]));
        assert_eq!(lease(&released, "n2"), Some(&caps(&[("b", 650.0)])));
    }

    /// Property: over random allocations and confirmation orders, no step of a rollout
    /// raises what the site may draw (Σ of the bounds) above the larger of what it may
    /// draw before that step and what the allocation being rolled out sums to. Both are
    /// within the budget the allocation was made for, so the rollout never overshoots.
    #[test]
    fn no_step_raises_the_bound_above_the_old_bound_or_the_new_allocation() {
        use proptest::prelude::*;
        proptest!(|(plan in proptest::collection::vec(
            (proptest::collection::vec(200.0f64..700.0, 4), proptest::collection::vec(0usize..4, 0..6)),
            2..6,
        ))| {
            let mut r = Rollout::new();
            let nodes = ["n0", "n1", "n2", "n3"];
            let start = 200.0;
            let bound = |r: &Rollout| -> f64 {
                nodes.iter().map(|n| {
                    let job = format!("j{n}");
                    r.may_run_at(n).and_then(|c| c.get(&job)).copied().unwrap_or(start)
                }).sum()
            };
            let mut in_force: BTreeMap<String, f64> = BTreeMap::new();
            for (step, (caps_now, confirm_order)) in plan.iter().enumerate() {
                let t: BTreeMap<String, Caps> = nodes
                    .iter()
                    .zip(caps_now)
                    .map(|(n, c)| (n.to_string(), caps(&[(&format!("j{n}"), *c)])))
                    .collect();
                let total: f64 = caps_now.iter().sum();
                let before = bound(&r);
                let mut sent_now = r.begin(&t, start, step as u64 * 1000);
                prop_assert!(bound(&r) <= before.max(total) + 1e-6, "begin: {} > max({before}, {total})", bound(&r));
                for &i in confirm_order {
                    // The agents apply what they were sent, then one confirms.
                    for l in sent_now.drain(..) {
                        for (job, cap) in &l.caps {
                            in_force.insert(job.clone(), *cap);
                        }
                    }
                    let node = nodes[i];
                    let job = format!("j{node}");
                    let now = in_force.get(&job).copied().unwrap_or(start);
                    let before = bound(&r);
                    sent_now.extend(r.confirmed(node, &caps(&[(&job, now)])));
                    prop_assert!(bound(&r) <= before.max(total) + 1e-6, "confirm: {} > max({before}, {total})", bound(&r));
                    // What the agents really enforce never exceeds the bound.
                    let real: f64 = nodes.iter().map(|n| in_force.get(&format!("j{n}")).copied().unwrap_or(start)).sum();
                    prop_assert!(real <= bound(&r) + 1e-6 || !sent_now.is_empty(), "real {real} above bound {}", bound(&r));
                }
            }
        });
    }
}
