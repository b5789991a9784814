//! The controller's state machine: [`step::Controller`], its inputs and outputs, and what
//! it keeps.
//!
//! `powerflex-ctld`'s I/O edge (`powerflex_controller::ctld`) reads the agents' link, the admin
//! socket, Slurm and the state file, hands what it read to [`step::Controller::step`] with the
//! time, and carries out the [`step::Output`]: persist, reply, lease, annotate, preempt, publish.
//! Everything the controller decides is here, so the site harness can run it with many agent
//! machines on a fake clock.
//!
//! - [`step`]: the step itself (hellos, reports, admin requests, ticks, reloads, Slurm's
//!   placement → leases, replies, state to save, annotations, preemptions, records);
//! - [`session`]: what the controller knows of one agent;
//! - [`unheard`]: the nodes Slurm or the domains name whose agents it never heard from
//!   (UNMANAGED), paid for at their worst case;
//! - [`status`], [`learning`], [`owners`]: what `status` shows, the curves each event
//!   taught, and who may read which job;
//! - [`accounting`]: the jobs' energy shares and records;
//! - [`annotate`]: which `AdminComment`s changed;
//! - [`metrics`]: what the metrics show of one allocation (the edge renders the text);
//! - [`history`]: the board the admin threads answer `history` from;
//! - [`state`]: what survives a restart (the edge reads and writes the file);
//! - [`leader`]: whether this controller steers under `[controller.ha]`, and with which
//!   epoch (the edge runs the claims in PostgreSQL).

pub mod accounting;
pub mod annotate;
pub mod history;
pub mod leader;
pub mod learning;
pub mod lease_row;
pub mod metrics;
pub mod owners;
pub mod session;
pub mod state;
pub mod status;
pub mod step;
pub mod unheard;

use std::time::Duration;

use powerflex_core::config::{JobPlacement, LeaseRollout, SiteConfig};
use powerflex_core::Watts;

use powerflex_decide::SiteSettings;

use crate::error::MachineError;

/// What the controller's machine is configured with: the site config's decisions, none
/// of the edge's addresses, sockets, paths or keys.
#[derive(Debug, Clone)]
pub struct CtldSettings {
    pub base_budget: Watts,
    /// The allocation period (changes only on restart: the edge's ticker runs at it).
    pub period: Duration,
    pub lease_ttl_s: f64,
    pub site: SiteSettings,
    /// How new allocations reach the nodes (decreases first, or all at once).
    pub lease_rollout: LeaseRollout,
    /// The fastest the allocated budget may rise, W/s (`None`: no limit; see
    /// [`crate::ramp`]).
    pub max_ramp_w_per_s: Option<f64>,
    /// Where the controller learns which jobs run where (see [`crate::placement`]);
    /// changes only on restart (the edge starts or does not start the Slurm reader).
    pub job_placement: JobPlacement,
    /// The highest `max_cap_w` of the site's GPU models, W: no announced GPU counts for
    /// more (see [`crate::placement::bound_gpu_power`]).
    pub max_gpu_power_w: f64,
}

impl CtldSettings {
    /// The machine's settings from a validated site config: what `powerflex-ctld` starts
    /// and reloads with, and what the site harness runs, so both run the same.
    pub fn from_site(site: &SiteConfig) -> Result<CtldSettings, MachineError> {
        Ok(CtldSettings {
            base_budget: site.facility.gpu_budget_w,
            period: Duration::from_secs(site.controller.allocation_period_s),
            lease_ttl_s: site.controller.lease_ttl_s as f64,
            lease_rollout: site.controller.lease_rollout,
            max_ramp_w_per_s: site.facility.max_ramp_w_per_s,
            job_placement: site.controller.job_placement,
            max_gpu_power_w: site
                .gpu_models
                .iter()
                .map(|m| m.max_cap_w.0)
                .fold(0.0, f64::max),
            site: SiteSettings::from_site(site, None)?,
        })
    }
}

/// A re-read site config's settings (on SIGHUP), or why the file was refused.
pub type SettingsReload = Result<CtldSettings, MachineError>;
