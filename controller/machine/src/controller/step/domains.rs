//! The power domains' budgets and the events that cut them, as the allocation and the
//! leases see them.

use powerflex_core::Watts;

use crate::schedule::{active_event, SteppedRamp};
use powerflex_proto::event::Event;

use super::Controller;

impl Controller {
    /// The site's settings with each power domain's limit as it stands over
    /// `[now_ms, now_ms + ahead_ms]`: its budget (an admin's, else its configured limit)
    /// less the deepest cut its events make at any step of that window, so caps are
    /// down before each step of a domain's ramp as they are for the site's.
    pub(super) fn site_settings_at(
        &self,
        now_ms: u64,
        ahead_ms: u64,
    ) -> powerflex_decide::SiteSettings {
        let mut site = self.options.site.clone();
        if let Some(domains) = site.domains.as_mut() {
            for (d, limit) in domains
                .tree
                .domains()
                .iter()
                .zip(domains.limits_w.iter_mut())
            {
                let base = self.domain_base(&d.name);
                let events = crate::schedule::of_domain(&self.state.events, Some(&d.name));
                *limit = crate::schedule::lowest_budget(
                    base,
                    &events,
                    now_ms,
                    now_ms.saturating_add(ahead_ms),
                )
                .0;
            }
        }
        site
    }

    /// The events that concern `node`: the site's, and those of the power domains it
    /// is in, each with the budget it cuts from.
    pub(super) fn events_of_node(&self, node: &str) -> Vec<(Watts, &Event)> {
        let site_base = self.state.budget_w.unwrap_or(self.options.base_budget);
        let path: Vec<&str> = self
            .options
            .site
            .domains
            .as_ref()
            .map(|d| {
                d.tree
                    .path_of_node(node)
                    .into_iter()
                    .map(|i| d.tree.domains()[i].name.as_str())
                    .collect()
            })
            .unwrap_or_default();
        self.state
            .events
            .iter()
            .filter_map(|e| match e.domain.as_deref() {
                None => Some((site_base, e)),
                Some(name) if path.contains(&name) => Some((self.domain_base(name), e)),
                Some(_) => None,
            })
            .collect()
    }

    /// A power domain's budget before its events: an admin's, else its configured limit
    /// (0 for a domain the config no longer declares, which no event can name anyway).
    ///
    /// An admin's budget is at most the limit: `budget set --domain` refuses more, and a
    /// reload that lowers the limit below a budget set earlier (a breaker found smaller)
    /// puts the new limit in force, never the old budget.
    pub(super) fn domain_base(&self, name: &str) -> Watts {
        let limit = self.domain_limit(name);
        self.state
            .domain_budgets_w
            .get(name)
            .map_or(limit, |&budget| Watts(budget.0.min(limit.0)))
    }

    /// A power domain's limit in the site config (0 for one it does not declare).
    pub(super) fn domain_limit(&self, name: &str) -> Watts {
        self.options
            .site
            .domains
            .as_ref()
            .and_then(|d| d.tree.find(name).map(|i| d.tree.domains()[i].gpu_limit))
            .unwrap_or(Watts::ZERO)
    }

    /// The event in force now with the deepest cut of its own budget: the site's first,
    /// else a domain's (for the learning snapshots and the metrics).
    pub(super) fn event_in_force_anywhere(&self, now_ms: u64) -> Option<u64> {
        let site_base = self.state.budget_w.unwrap_or(self.options.base_budget);
        let site_events = crate::schedule::of_domain(&self.state.events, None);
        active_event(site_base, &site_events, now_ms)
            .map(|e| e.id)
            .or_else(|| {
                self.state
                    .events
                    .iter()
                    .filter_map(|e| {
                        let domain = e.domain.as_deref()?;
                        let cut = e.cut_w(self.domain_base(domain).0, now_ms);
                        (cut > 0.0).then_some((cut, e.id))
                    })
                    .max_by(|a, b| a.0.total_cmp(&b.0))
                    .map(|(_, id)| id)
            })
    }
}
