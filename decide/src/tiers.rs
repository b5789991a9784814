//! One tier per job across its nodes: the least flexible any of them reports.

use std::collections::BTreeMap;

use powerflex_core::flex::parse_power_flex;

use crate::NodeView;

/// Per job reported by more than one live node, the least flexible of what they report,
/// part by part: unmanaged (`none`) if any node says so; else the smallest slowdown
/// bound, with the mildest `preempt=` any node's report allows (each report's own, or
/// the site's default for its tier). A tier the site does not know counts for nothing.
/// Every reporting node runs the job (the placement check), but none of them alone may
/// make it more flexible, more preemptible or managed at all than the others say.
pub fn least_flexible_tiers<'a>(
    nodes: impl IntoIterator<Item = &'a NodeView>,
    tiers: &powerflex_core::flex::TierTable,
) -> BTreeMap<String, String> {
    use powerflex_core::flex::{FlexRequest, Preempt};
    let rank = |p: Preempt| match p {
        Preempt::Never => 0,
        Preempt::Suspend => 1,
        Preempt::Requeue => 2,
    };
    let mut requests: BTreeMap<&str, Vec<FlexRequest>> = BTreeMap::new();
    let mut seen: BTreeMap<&str, usize> = BTreeMap::new();
    for node in nodes.into_iter().filter(|n| n.live) {
        for report in &node.jobs {
            *seen.entry(&report.job_id).or_default() += 1;
            if let Ok(request) = parse_power_flex(&report.tier, tiers) {
                requests.entry(&report.job_id).or_default().push(request);
            }
        }
    }
    let mut out = BTreeMap::new();
    for (id, reqs) in requests {
        if seen.get(id).is_none_or(|n| *n < 2) {
            continue;
        }
        if reqs.iter().any(|r| !r.service.is_managed()) {
            out.insert(id.to_string(), "none".to_string());
            continue;
        }
        let bound = |r: &FlexRequest| r.service.max_slowdown().map_or(0.0, |b| b.0);
        let Some(tightest) = reqs.iter().min_by(|a, b| bound(a).total_cmp(&bound(b))) else {
            continue;
        };
        let mildest = reqs
            .iter()
            .map(|r| tiers.preempt_for(r))
            .min_by_key(|p| rank(*p))
            .unwrap_or(Preempt::Never);
        let mut combined = tightest.clone();
        if tiers.preempt_for(&combined) != mildest && bound(&combined) > 0.0 {
            combined.preempt = Some(mildest);
        }
        out.insert(id.to_string(), combined.to_string());
    }
    out
}

/// Rewrites each report of a job on several nodes to the job's least flexible tier
/// ([`least_flexible_tiers`]): done once on the views every decision reads (the
/// allocation, the preemptions, the annotations, `whatif`), not inside each of them.
pub fn apply_least_flexible_tiers(views: &mut [NodeView], tiers: &powerflex_core::flex::TierTable) {
    let tier_of = least_flexible_tiers(views.iter(), tiers);
    for report in views.iter_mut().flat_map(|v| v.jobs.iter_mut()) {
        if let Some(tier) = tier_of.get(&report.job_id) {
            report.tier.clone_from(tier);
        }
    }
}
