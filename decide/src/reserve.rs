//! What the allocation leaves for what it does not steer (held jobs, jobs without a
//! usable curve, nodes no domain places) and the limit each power domain leaves it.

use std::collections::BTreeMap;

use powerflex_core::allocate::{DomainLimit, JobSpec};
use powerflex_core::config::BudgetMode;
use powerflex_core::Watts;

use crate::gather::SiteJob;
use crate::{Held, NodeView, SiteDomains, SiteSettings};
use powerflex_proto::status::Rejected;

/// What the managed jobs the allocation does not steer may draw, W: a held job at its
/// count (or its lowest cap), a job without a usable range or curve at its default
/// (hard budget) or its draw (metered).
pub(crate) fn unsteered_reserve_w(
    jobs: &BTreeMap<String, SiteJob>,
    specs: &[JobSpec],
    held: &Held,
    settings: &SiteSettings,
) -> BTreeMap<String, f64> {
    let steered: std::collections::BTreeSet<&str> = specs.iter().map(|s| s.id.as_str()).collect();
    let mut reserved: BTreeMap<String, f64> = BTreeMap::new();
    // A managed job the allocation does not steer (no usable range or curve) still
    // draws: pay for it before the others.
    for (id, job) in jobs {
        let w = if let Some(count) = held.get(id.as_str()) {
            let lowest_w = job.min_cap * f64::from(job.gpus);
            match (count, settings.budget_mode) {
                (Some(w), _) => *w,
                (None, BudgetMode::Hard) => lowest_w,
                (None, BudgetMode::Metered { .. }) => job.power_w.min(lowest_w),
            }
        } else if !steered.contains(id.as_str()) {
            match settings.budget_mode {
                BudgetMode::Hard => job.default_w,
                BudgetMode::Metered { .. } => job.power_w,
            }
        } else {
            continue;
        };
        reserved.insert(id.clone(), w);
    }
    reserved
}

/// Each of `job`'s nodes with the share of its GPUs (so of its power) there.
fn node_shares(job: &SiteJob) -> impl Iterator<Item = (&str, f64)> + '_ {
    let gpus = f64::from(job.gpus.max(1));
    job.nodes
        .iter()
        .zip(&job.node_gpus)
        .map(move |(node, &g)| (node.as_str(), f64::from(g) / gpus))
}

/// The limits the allocation must fit in each power domain: its limit in force (less the
/// metered margin, as the site's budget), less what it reserves for what the allocation
/// does not steer behind it (nodes and jobs by their GPUs' share), over the steered jobs'
/// shares of power through it.
pub(crate) fn domain_limits(
    domains: &SiteDomains,
    jobs: &BTreeMap<String, SiteJob>,
    specs: &[JobSpec],
    reserved_at: &BTreeMap<String, f64>,
    reserved_jobs: &BTreeMap<String, f64>,
    settings: &SiteSettings,
) -> Vec<DomainLimit> {
    let tree = &domains.tree;
    let n = tree.domains().len();
    let mut reserve = vec![0.0; n];
    for (node, w) in reserved_at {
        for d in tree.path_of_node(node) {
            reserve[d] += w;
        }
    }
    for (id, w) in reserved_jobs {
        let Some(job) = jobs.get(id) else { continue };
        for (node, share) in node_shares(job) {
            for d in tree.path_of_node(node) {
                reserve[d] += share * w;
            }
        }
    }
    let mut members: Vec<Vec<(usize, f64)>> = vec![Vec::new(); n];
    for (i, spec) in specs.iter().enumerate() {
        let Some(job) = jobs.get(&spec.id) else {
            continue;
        };
        let mut through: BTreeMap<usize, f64> = BTreeMap::new();
        for (node, share) in node_shares(job) {
            for d in tree.path_of_node(node) {
                *through.entry(d).or_default() += share;
            }
        }
        for (d, share) in through {
            members[d].push((i, share.clamp(f64::MIN_POSITIVE, 1.0)));
        }
    }
    tree.domains()
        .iter()
        .zip(members)
        .enumerate()
        .map(|(d, (domain, members))| {
            let limit = domains
                .limits_w
                .get(d)
                .copied()
                .unwrap_or(domain.gpu_limit.0);
            let usable = match settings.budget_mode {
                BudgetMode::Hard => limit,
                BudgetMode::Metered { margin } => limit * (1.0 - margin.clamp(0.0, 1.0)),
            };
            DomainLimit {
                name: domain.name.clone(),
                limit: Watts((usable - reserve[d]).max(0.0)),
                members,
            }
        })
        .collect()
}

/// The jobs on nodes no leaf domain places, held at their lowest caps (where the site
/// has domains): the breaker they draw through is unknown, so they get no more until the
/// config places their node. Each such node is named in `rejected`.
pub(crate) fn hold_unplaced(
    nodes: &[NodeView],
    jobs: &BTreeMap<String, SiteJob>,
    settings: &SiteSettings,
    held: &Held,
    rejected: &mut Vec<Rejected>,
) -> Option<Held> {
    let domains = settings.domains.as_ref()?;
    let unplaced: Vec<&str> = nodes
        .iter()
        .filter(|n| domains.tree.leaf_of(&n.node).is_none())
        .map(|n| n.node.as_str())
        .collect();
    if unplaced.is_empty() {
        return None;
    }
    for node in &unplaced {
        rejected.push(Rejected {
            node: (*node).to_string(),
            job: None,
            reason: "the node is in no leaf of the site's [[domains]] (a configuration error): \
                     its jobs are held at their lowest caps until a leaf's nodes name it"
                .to_string(),
        });
    }
    let mut with_unplaced = held.clone();
    for (id, job) in jobs {
        if job.nodes.iter().any(|n| unplaced.contains(&n.as_str())) {
            with_unplaced.entry(id.clone()).or_insert(None);
        }
    }
    Some(with_unplaced)
}
