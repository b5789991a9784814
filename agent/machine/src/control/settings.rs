//! The agent's settings from the site config, and a reload of them (SIGHUP).

use powerflex_core::config::SiteConfig;

use super::{Agent, AgentSettings};
use crate::calibration::CalibrationSettings;
use crate::MachineError;

impl AgentSettings {
    /// The settings from a validated site config for `node`'s GPUs, named `gpu_name` by
    /// NVML: what `powerflexd` starts and reloads with, and what the site harness runs,
    /// so both run the same. Refused (with the models the config has) when no
    /// `[gpu_models.*]` section matches the GPU.
    pub fn from_site(
        site: &SiteConfig,
        node: &str,
        gpu_name: &str,
        progress_address: String,
    ) -> Result<AgentSettings, MachineError> {
        let model = site
            .gpu_model_for(gpu_name)
            .ok_or_else(|| MachineError::NoGpuModel {
                gpu: gpu_name.to_string(),
                models: site.gpu_models.iter().map(|m| m.name.clone()).collect(),
            })?;
        Ok(AgentSettings {
            node: node.to_string(),
            tiers: site.tiers.table.clone(),
            default_service: site.tiers.default.clone(),
            calibration: CalibrationSettings {
                grid: model.calibration_grid(),
                min_cap: model.min_cap_w,
                settle_s: site.agent.calibration_settle_s,
                hold_s: site.agent.calibration_hold_s,
                budget_fraction: site.agent.calibration_budget,
                expected_cut: site.facility.expected_cut,
                warmup_s: site.agent.calibration_warmup_s,
                steady_cv: 0.05,
                allowance: site.agent.calibration_allowance.0,
                no_signal_s: site.agent.calibration_warmup_s * 2.0,
                rewalk_after_s: site.agent.calibration_rewalk_after_s,
            },
            cap_step: model.cap_step_w,
            failsafe_cap: model.failsafe_cap_w,
            node_budget: site.agent.node_budget_w,
            policy: site.facility.policy,
            lease_ttl_s: site.controller.lease_ttl_s as f64,
            prior_intercept: site.predictor.pfi_intercept,
            prior_slope: site.predictor.pfi_per_dram_copy_product,
            progress_address,
            job_end_grace_s: site.agent.job_end_grace_s,
            enforce: site.agent.enforce,
            unregistered_gpu_use: site.agent.unregistered_gpu_use,
        })
    }
}

impl Agent {
    /// Applies re-read settings (SIGHUP). The node name, the progress address and the
    /// mode (standalone or controller) are fixed for the agent's life; new calibration
    /// settings apply to jobs registered from now on, the rest at the next tick.
    pub(super) fn reload(
        &mut self,
        new: Result<AgentSettings, MachineError>,
    ) -> Result<(), MachineError> {
        let checked = new.and_then(|new| {
            if new.node_budget.is_some() != self.settings.node_budget.is_some() {
                Err(MachineError::ModeSwitchNeedsRestart)
            } else {
                Ok(new)
            }
        });
        match checked {
            Ok(new) => {
                self.settings = AgentSettings {
                    node: self.settings.node.clone(),
                    progress_address: self.settings.progress_address.clone(),
                    ..new
                };
                self.config_error = None;
                Ok(())
            }
            Err(e) => {
                self.config_error = Some(e.to_string());
                Err(e)
            }
        }
    }
}
