//! What an allocation is told: the nodes as the caller knows them ([`NodeView`]) and
//! the site's settings ([`SiteSettings`]), from a site config or by hand.

use std::sync::Arc;

use powerflex_core::allocate::Policy;
use powerflex_core::config::{BudgetMode, Objective};
use powerflex_core::domains::DomainTree;
use powerflex_core::flex::TierTable;
use powerflex_core::Watts;
use powerflex_proto::report::{GpuInfo, JobReport};

use crate::DecideError;

/// What the controller knows of one node.
#[derive(Debug, Clone, PartialEq)]
pub struct NodeView {
    pub node: String,
    pub gpus: Vec<GpuInfo>,
    pub jobs: Vec<JobReport>,
    /// The node's summed GPU draw in its last report, W.
    pub power_w: f64,
    /// Whether the node reported within its lease (a silent node is at its fail-safe cap).
    pub live: bool,
}

/// Site settings the allocation needs.
#[derive(Debug, Clone)]
pub struct SiteSettings {
    pub tiers: TierTable,
    pub policy: Policy,
    pub cap_step: Watts,
    pub failsafe_cap: Watts,
    /// PFI assumed for a job with neither a measured curve nor a prior.
    pub default_pfi: f64,
    /// What the budget bounds: measured draw (with a margin) or the sum of caps.
    pub budget_mode: BudgetMode,
    /// What the allocation maximises.
    pub objective: Objective,
    /// Whether the tiers' slowdown bounds constrain the allocation. Only a what-if asks
    /// for [`TierBounds::Ignored`]: the paper's baselines cut every job alike, whatever
    /// its tier, and the comparison counts the bounds they break.
    pub tier_bounds: TierBounds,
    /// The site's power domains and the limit in force in each (none: one budget).
    pub domains: Option<SiteDomains>,
}

/// The power domains an allocation must fit, with the limit in force in each.
#[derive(Debug, Clone, PartialEq)]
pub struct SiteDomains {
    pub tree: Arc<DomainTree>,
    /// Per domain, in the tree's order: the limit in force now, W (its configured limit,
    /// or lower while an event or an admin's budget for it holds).
    pub limits_w: Vec<f64>,
}

impl SiteDomains {
    /// The tree with every domain at its configured limit; none for a site without
    /// domains.
    pub fn configured(tree: &DomainTree) -> Option<SiteDomains> {
        (!tree.is_empty()).then(|| SiteDomains {
            limits_w: tree.domains().iter().map(|d| d.gpu_limit.0).collect(),
            tree: Arc::new(tree.clone()),
        })
    }
}

/// Whether an allocation honours the tiers' bounds.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum TierBounds {
    /// Every managed job's cap keeps its tier's slowdown bound (the controller's rule).
    #[default]
    Honoured,
    /// Bounds left out, as the paper's equal-weight and PFI-proportional rules do.
    Ignored,
}

impl SiteSettings {
    /// The settings a validated site config gives the allocation: what `powerflex-ctld`
    /// runs with and what `powerflexctl allocate --site` plans with, so both decide
    /// alike. `gpu_model` picks the model whose cap step and fail-safe apply (the first
    /// when `None`).
    pub fn from_site(
        site: &powerflex_core::config::SiteConfig,
        gpu_model: Option<&str>,
    ) -> Result<SiteSettings, DecideError> {
        let model = site_gpu_model(site, gpu_model)?;
        Ok(SiteSettings {
            tiers: site.tiers.table.clone(),
            policy: site.facility.policy,
            cap_step: model.cap_step_w,
            failsafe_cap: model.failsafe_cap_w,
            default_pfi: site.predictor.pfi_intercept,
            budget_mode: site.facility.budget_mode,
            objective: site.facility.objective,
            tier_bounds: TierBounds::Honoured,
            domains: SiteDomains::configured(&site.domains),
        })
    }
}

/// The site's GPU model named `gpu_model` (any case), or its first when `None`.
pub fn site_gpu_model<'a>(
    site: &'a powerflex_core::config::SiteConfig,
    gpu_model: Option<&str>,
) -> Result<&'a powerflex_core::config::GpuModelConfig, DecideError> {
    match gpu_model {
        Some(name) => site
            .gpu_models
            .iter()
            .find(|m| m.name.eq_ignore_ascii_case(name))
            .ok_or_else(|| DecideError::UnknownGpuModel {
                name: name.to_string(),
                known: site.gpu_models.iter().map(|m| m.name.clone()).collect(),
            }),
        None => site.gpu_models.first().ok_or(DecideError::NoGpuModel),
    }
}
