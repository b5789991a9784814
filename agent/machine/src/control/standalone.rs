//! Standalone mode (`agent.node_budget_w`): the node budget split across the node's
//! managed jobs by the controller's own decision ([`powerflex_decide`]),
//! on a one-node view of the agent's jobs and GPUs, as the controller would see this node
//! report. One allocator for both modes: a rule changed there applies here.
//!
//! Two choices keep what standalone mode has always promised:
//! - **The budget counts draw, not limits** (`BudgetMode::Metered`, no margin): the
//!   GPUs outside managed jobs (idle, unmanaged, unread) come off the budget at what they
//!   draw (an unread one at its maximum), and the managed jobs share the rest, so a
//!   budget is spent rather than held back for idle GPUs at their default limit.
//! - **No cap rises on a guess.** There is no site meter here to correct a curve a period
//!   later, so a curve walked from a grant down carries a knot at the GPUs' maximum that
//!   draws what the GPUs may ([`super::bounded_above_top`]), and the view says nothing of
//!   how long a cap has held: the decision then takes a job drawing more than its curve
//!   at its word (its curve is scaled up) but never one drawing less (which would scale
//!   that bound down).

use powerflex_core::config::{BudgetMode, Objective};
use powerflex_core::point::OperatingPoint;
use powerflex_core::Watts;
use powerflex_decide::{decide, NodeView, SiteSettings, TierBounds};
use powerflex_proto::report::JobReport;
use powerflex_proto::status::PfiSource;

use super::{bounded_above_top, Agent, Job};

impl Agent {
    /// Standalone mode: splits the node budget across the managed jobs (each decided
    /// job's grant; a job the decision leaves out keeps its last one).
    pub(super) fn allocate_node_budget(&mut self, budget: Watts) {
        let settings = SiteSettings {
            tiers: self.settings.tiers.clone(),
            policy: self.settings.policy,
            cap_step: self.settings.cap_step,
            failsafe_cap: self.settings.failsafe_cap,
            default_pfi: self.settings.prior_intercept,
            budget_mode: BudgetMode::Metered { margin: 0.0 },
            objective: Objective::RelativeSpeed,
            tier_bounds: TierBounds::Honoured,
            domains: None,
        };
        let view = self.node_view();
        let decision = decide(std::slice::from_ref(&view), budget, &settings);
        for rejected in &decision.rejected {
            tracing::debug!(job_id = ?rejected.job, reason = %rejected.reason, "a job left out of the node budget's split");
        }
        let Some(caps) = decision.leases.get(&view.node) else {
            return;
        };
        for (id, cap_w) in caps {
            if let Some(job) = self.jobs.get_mut(id) {
                job.granted = Some(Watts(*cap_w));
            }
        }
    }

    /// This node as the controller would see its report: every GPU, the draw (an unread
    /// GPU at its maximum), and each managed job with GPUs.
    fn node_view(&self) -> NodeView {
        let draw_w = |g: u32| {
            let slot = &self.gpus[g as usize];
            slot.last.map_or(slot.identity.max_cap.0, |s| s.power.0)
        };
        NodeView {
            node: self.settings.node.clone(),
            gpus: self.gpu_infos(),
            jobs: self
                .jobs
                .values()
                .filter(|j| j.managed() && !j.gpus.is_empty())
                .map(|j| self.job_report(j, j.gpus.iter().map(|&g| draw_w(g)).sum()))
                .collect(),
            power_w: (0..self.gpus.len() as u32).map(draw_w).sum(),
            live: true,
        }
    }

    /// One managed job as the allocation reads it: its measured curve (bounded above its
    /// walk, see the module's doc), else the PFI a prior is planned on.
    fn job_report(&self, job: &Job, power_w: f64) -> JobReport {
        let first = &self.gpus[job.gpus[0] as usize].identity;
        let best = job.calibration.best_curve();
        let points: Vec<OperatingPoint> = best
            .clone()
            .map(|c| bounded_above_top(c, first.max_cap, job.gpus.len()))
            .map(|c| c.knots().to_vec())
            .unwrap_or_default();
        let (pfi, pfi_source) = match (job.restored_pfi, job.prior) {
            (Some(pfi), _) => (Some(pfi), Some(PfiSource::Measured)),
            (None, Some((_, prior))) => (Some(prior), Some(PfiSource::Prior)),
            (None, None) => (None, None),
        };
        JobReport {
            job_id: job.id.clone(),
            tier: job.request.to_string(),
            gpus: job.gpus.len() as u32,
            cap_w: self.gpus[job.gpus[0] as usize].applied.map(|w| w.0),
            power_w: Some(power_w),
            // Relative speed: a prior's uncapped speed is 1, a measured curve's its own.
            throughput: None,
            throughput_unit: None,
            pfi,
            pfi_source,
            points,
            gpu_uuids: job
                .gpus
                .iter()
                .map(|&g| self.gpus[g as usize].identity.uuid.clone())
                .collect(),
            power_cap_w: self.job_sampled_cap(job).map(|w| w.0),
            // Unsaid on purpose: a draw below the curve is never taken to lower it.
            power_cap_steady_s: None,
            calibrating: job.calibration.remeasuring() || job.calibration.probing(),
            curve_in_question: job.calibration.curve_in_question(),
            // The measured points' uncertainties, for the cautious optimal policy.
            curve: job.curve_of(best.as_ref()),
            calibration_cost_pct: None,
            owner_uid: None,
            usage: None,
        }
    }
}
