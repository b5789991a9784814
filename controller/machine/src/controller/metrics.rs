//! What the metrics show of one allocation, and the energy counters behind them. The
//! edge renders the text (`powerflex_controller::ctld::metrics`): the machine only says
//! what to show.

use std::collections::BTreeMap;
use std::sync::Arc;

use powerflex_core::Watts;
use powerflex_proto::status::AccountingDbView;
use powerflex_proto::usage::JobEnergyRecord;

use crate::preempt::Preempted;
use powerflex_decide::Decision;

/// Most distinct values of one label in the energy families; the rest are summed under
/// [`OTHER_LABEL`] (a site with thousands of accounts must not explode the series).
pub const MAX_LABEL_VALUES: usize = 64;
/// The label value past [`MAX_LABEL_VALUES`], and for a job without a Slurm account.
pub const OTHER_LABEL: &str = "other";

/// Energy of the records written since the controller started, per tier and per Slurm
/// account: Prometheus counters (a restart starts them again, as counters do). No label
/// names a user.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct EnergyTotals {
    pub by_tier: BTreeMap<String, TierEnergy>,
    /// Account → J.
    pub by_account: BTreeMap<String, f64>,
}

/// One tier's records.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct TierEnergy {
    pub records: u64,
    pub energy_j: f64,
    /// The records' saved-energy ESTIMATES, J.
    pub saved_estimate_j: f64,
}

/// `key`, or [`OTHER_LABEL`] once `map` holds [`MAX_LABEL_VALUES`] other keys.
fn bounded_label<V>(map: &BTreeMap<String, V>, key: &str) -> String {
    if map.contains_key(key) || map.len() < MAX_LABEL_VALUES - 1 {
        key.to_string()
    } else {
        OTHER_LABEL.to_string()
    }
}

impl EnergyTotals {
    /// Counts a run's first record. A later revision (a final share that came late)
    /// restates the whole run: counting it too would count the run twice, so the
    /// counters keep the first figures (the record and the database have the latest).
    pub fn add(&mut self, r: &JobEnergyRecord) {
        if r.revision > 1 {
            return;
        }
        let energy = if r.energy_j.is_finite() {
            r.energy_j.max(0.0)
        } else {
            0.0
        };
        let tier = bounded_label(&self.by_tier, &r.tier);
        let t = self.by_tier.entry(tier).or_default();
        t.records += 1;
        t.energy_j += energy;
        t.saved_estimate_j += r
            .saved_estimate_j
            .filter(|s| s.is_finite() && *s > 0.0)
            .unwrap_or(0.0);
        let account = r
            .account
            .as_deref()
            .filter(|a| !a.is_empty())
            .unwrap_or(OTHER_LABEL);
        let account = bounded_label(&self.by_account, account);
        *self.by_account.entry(account).or_default() += energy;
    }
}

/// What the metrics show of one allocation: owned, so the edge renders it after the
/// step (the decision is shared with the step's last one, not copied).
#[derive(Debug, Clone, PartialEq)]
pub struct MetricsSnapshot {
    pub decision: Arc<Decision>,
    pub base: Watts,
    /// The budget in force.
    pub budget: Watts,
    /// What the allocation was made for (see [`crate::ramp`]).
    pub allocated: Watts,
    pub draw_w: f64,
    /// Node → live.
    pub nodes: Vec<(String, bool)>,
    /// Per node, the job reports refused since start (Slurm does not place the job there).
    pub refused: Vec<(String, u64)>,
    pub event_active: bool,
    /// Jobs held out of a deep cut.
    pub preempted: BTreeMap<String, Preempted>,
    /// Energy of the jobs' records since start.
    pub energy: EnergyTotals,
    /// The accounting database's writer, where the site has one.
    pub accounting_db: Option<AccountingDbView>,
    /// The power domains as the allocation saw them (none without `[[domains]]`).
    pub domains: Vec<powerflex_proto::status::DomainStatus>,
    /// Nodes Slurm or the domains name whose agents were never heard from (UNMANAGED).
    pub unmanaged_nodes: u64,
    /// What the allocation reserved for them, W.
    pub unmanaged_reserve_w: f64,
}
