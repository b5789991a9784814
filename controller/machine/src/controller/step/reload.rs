//! A re-read site config: its settings put in force, or its refusal kept for `status`.

use std::collections::BTreeSet;

use tracing::{error, info, warn};

use crate::controller::{CtldSettings, SettingsReload};

use super::Controller;

impl Controller {
    /// A valid config replaces the budget, policy, tiers and lease settings at once; the
    /// listen addresses, sockets, state directory, key and period need a restart. A
    /// refused one leaves the config in force and is reported by `status` until a valid
    /// one arrives.
    /// A re-read config's settings replace the ones in force, except what the edge set up
    /// at start (the period its ticker runs at, whether it reads Slurm's placement): those
    /// change only on restart. The edge says the same of its own addresses and paths.
    pub(super) fn reload(&mut self, reload: SettingsReload) {
        match reload {
            Ok(new) => {
                let old = &self.options;
                if new.period != old.period || new.job_placement != old.job_placement {
                    warn!("site config reloaded; the allocation period and the Slurm placement setting change only on restart");
                }
                info!(
                    base_budget_w = new.base_budget.0,
                    policy = new.site.policy.name(),
                    lease_ttl_s = new.lease_ttl_s,
                    "site config reloaded"
                );
                self.options = CtldSettings {
                    period: old.period,
                    job_placement: old.job_placement,
                    ..new
                };
                // Budgets and events for domains the new config no longer declares are
                // kept (a rename back restores them) but cut nothing: say so.
                let orphans: BTreeSet<&str> = self
                    .state
                    .domain_budgets_w
                    .keys()
                    .map(String::as_str)
                    .chain(self.state.events.iter().filter_map(|e| e.domain.as_deref()))
                    .filter(|name| self.unknown_domain(name).is_some())
                    .collect();
                if !orphans.is_empty() {
                    warn!(domains = ?orphans, "budgets or events name domains the reloaded site config does not declare; they cut nothing");
                }
                for (name, budget) in &self.state.domain_budgets_w {
                    let limit = self.domain_limit(name);
                    if self.unknown_domain(name).is_none() && budget.0 > limit.0 {
                        warn!(
                            domain = %name,
                            budget_w = budget.0,
                            limit_w = limit.0,
                            "a domain's budget is above its reloaded limit; the limit is in force"
                        );
                    }
                }
                self.config_error = None;
                self.allocate_now = true;
            }
            Err(e) => {
                error!(error = %e, "site config reload refused; the previous config stays in force");
                self.config_error = Some(e.to_string());
            }
        }
    }
}
