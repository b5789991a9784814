//! The limits an allocation must fit: the site's budget over every job, and a power
//! domain's limit (a feed, a switchboard, a PDU, a rack: whatever has a breaker) over the
//! share of each of its jobs' power that flows through it.
//!
//! A site's domains form a tree, so their job sets are nested or disjoint (a laminar
//! family) as long as every job runs inside one leaf. The allocator then visits them
//! bottom-up, smallest first and the site last: a rack's floors give way inside the rack,
//! a rack's equal cut is as deep as the rack needs and no deeper, and the greedy's
//! marginal steps respect every limit on a job's path. A job spanning two racks puts a
//! share of its power in each (its GPUs' share); the family is then not laminar, and the
//! same rules still never exceed a limit, though the greedy may no longer be optimal.

use serde::{Deserialize, Serialize};

use crate::units::Watts;

use super::AllocationError;

/// A limit on the power through one part of the site, over the jobs it feeds.
#[derive(Debug, Clone, PartialEq)]
pub struct DomainLimit {
    /// The domain's name, as the site config gives it.
    pub name: String,
    /// Most power through the domain for the jobs allocated, W: its limit (or its event's
    /// budget) less what it reserves for what the allocation does not steer.
    pub limit: Watts,
    /// (index into the jobs allocated, share of that job's power through the domain, in
    /// (0, 1]).
    pub members: Vec<(usize, f64)>,
}

/// What an allocation puts through one domain (on the wire too: `what-if` and `status`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct DomainUse {
    pub name: String,
    /// The limit the allocation had to fit, W.
    pub limit_w: Watts,
    /// Power the decided caps put through the domain on the jobs' curves, W.
    pub power_w: Watts,
    /// By how much the floors of the domain's jobs exceeded its limit, W: the domain
    /// binds, and its jobs' tiers gave way (0 when their floors fit).
    pub floors_over_w: Watts,
    /// By how much the domain is over its limit even with every job in it at its lowest
    /// cap, W: only holding jobs out of it (preemption) can meet it (0 when caps can).
    pub lowest_over_w: Watts,
}

impl DomainUse {
    /// Whether the domain's floors did not fit its limit.
    pub fn binds(&self) -> bool {
        self.floors_over_w.0 > 0.0
    }
}

/// The site's budget (constraint 0, every job at share 1) and the domains' limits.
#[derive(Debug, Clone)]
pub(super) struct Room<'a> {
    domains: &'a [DomainLimit],
    /// Limit of each constraint, W: the site's budget, then each domain's.
    limits: Vec<f64>,
    /// The domains each job is in, as (constraint, share).
    of_job: Vec<Vec<(usize, f64)>>,
    /// Constraints in the order the bottom-up rules visit them: domains by size (a domain
    /// inside another has fewer jobs), the site last.
    bottom_up: Vec<usize>,
}

/// The site's constraint.
pub(super) const SITE: usize = 0;

impl<'a> Room<'a> {
    /// The room of `jobs` jobs under `budget` and `domains`, checked: every member a job,
    /// every share in (0, 1], every limit a finite, non-negative power.
    pub(super) fn new(
        jobs: usize,
        budget: Watts,
        domains: &'a [DomainLimit],
    ) -> Result<Room<'a>, AllocationError> {
        let mut limits = vec![budget.0];
        let mut of_job = vec![Vec::new(); jobs];
        for (k, d) in domains.iter().enumerate() {
            if !(d.limit.0.is_finite() && d.limit.0 >= 0.0) {
                return Err(AllocationError::BadDomain {
                    domain: d.name.clone(),
                    why: format!("limit {} W is not a finite, non-negative power", d.limit.0),
                });
            }
            let c = k + 1;
            for &(job, share) in &d.members {
                if job >= jobs {
                    return Err(AllocationError::BadDomain {
                        domain: d.name.clone(),
                        why: format!("member {job} is not one of the {jobs} jobs"),
                    });
                }
                if !(share > 0.0 && share <= 1.0) {
                    return Err(AllocationError::BadDomain {
                        domain: d.name.clone(),
                        why: format!("share {share} of job {job} is outside (0, 1]"),
                    });
                }
                if of_job[job].iter().any(|&(other, _)| other == c) {
                    return Err(AllocationError::BadDomain {
                        domain: d.name.clone(),
                        why: format!("job {job} is a member twice"),
                    });
                }
                of_job[job].push((c, share));
            }
            limits.push(d.limit.0);
        }
        let mut bottom_up: Vec<usize> = (1..limits.len()).collect();
        // Stable: domains of equal size keep the caller's order.
        bottom_up.sort_by_key(|&c| domains[c - 1].members.len());
        bottom_up.push(SITE);
        Ok(Room {
            domains,
            limits,
            of_job,
            bottom_up,
        })
    }

    pub(super) fn constraints(&self) -> usize {
        self.limits.len()
    }

    pub(super) fn limit(&self, c: usize) -> f64 {
        self.limits[c]
    }

    /// Constraints, smallest domain first, the site last.
    pub(super) fn bottom_up(&self) -> &[usize] {
        &self.bottom_up
    }

    /// The members of constraint `c` as (job, share): every job for the site.
    pub(super) fn members(&self, c: usize) -> Vec<(usize, f64)> {
        if c == SITE {
            (0..self.of_job.len()).map(|j| (j, 1.0)).collect()
        } else {
            self.domains[c - 1].members.clone()
        }
    }

    /// Power through each constraint when each job draws `power(job)`.
    pub(super) fn used(&self, power: impl Fn(usize) -> f64) -> Vec<f64> {
        let mut used = vec![0.0; self.limits.len()];
        for (job, domains) in self.of_job.iter().enumerate() {
            let p = power(job);
            used[SITE] += p;
            for &(c, share) in domains {
                used[c] += share * p;
            }
        }
        used
    }

    /// The most `job`'s power may rise while every constraint on it holds, given what
    /// each constraint already carries (`used`), W (negative when one is already over).
    pub(super) fn headroom(&self, job: usize, used: &[f64]) -> f64 {
        self.of_job[job]
            .iter()
            .fold(self.limits[SITE] - used[SITE], |room, &(c, share)| {
                room.min((self.limits[c] - used[c]) / share)
            })
    }

    /// Records a change of `extra` W in `job`'s power.
    pub(super) fn add(&self, job: usize, extra: f64, used: &mut [f64]) {
        used[SITE] += extra;
        for &(c, share) in &self.of_job[job] {
            used[c] += share * extra;
        }
    }

    /// This room with each constraint's limit lowered by `margin(c)` W (at most half of
    /// it), for planning under uncertain power.
    pub(super) fn with_margins(&self, margin: impl Fn(usize) -> f64) -> Room<'a> {
        let mut planned = self.clone();
        for (c, limit) in planned.limits.iter_mut().enumerate() {
            let m = margin(c);
            let m = if m.is_finite() && m > 0.0 { m } else { 0.0 };
            *limit = (*limit - m.min(0.5 * *limit)).max(0.0);
        }
        planned
    }

    /// The domains' use by `power` per job, with how far over each one's floors went.
    pub(super) fn uses(
        &self,
        power: impl Fn(usize) -> f64,
        over: &[super::Over],
    ) -> Vec<DomainUse> {
        let used = self.used(power);
        self.domains
            .iter()
            .enumerate()
            .map(|(k, d)| DomainUse {
                name: d.name.clone(),
                limit_w: Watts(self.limits[k + 1]),
                power_w: Watts(used[k + 1]),
                floors_over_w: Watts(over.get(k + 1).map_or(0.0, |o| o.floors_w)),
                lowest_over_w: Watts(over.get(k + 1).map_or(0.0, |o| o.lowest_w)),
            })
            .collect()
    }
}
