//! Which `AdminComment`s an allocation changes: each managed job's tier, PFI, cap and
//! energy so far, or why it is held out of a deep cut. The edge runs `scontrol` for each
//! (`powerflex_controller::ctld::annotate`).

use std::collections::{BTreeMap, BTreeSet};

use powerflex_proto::report::JobReport;

use crate::preempt::Preempted;
use powerflex_decide::Decision;

/// The annotations `decision` calls for that differ from those already made (`done`,
/// job → text, updated in place; jobs no longer allocated are forgotten). Pure.
pub fn changes<'a>(
    decision: &Decision,
    held: &'a BTreeMap<String, Preempted>,
    reports: impl Iterator<Item = &'a JobReport>,
    done: &mut BTreeMap<String, String>,
) -> Vec<(String, String)> {
    let Some(allocation) = &decision.allocation else {
        return Vec::new();
    };
    // Every node's report of each job, in report order: looked up per job below, where a
    // scan of every report per job made each allocation quadratic in the jobs.
    let mut by_job: BTreeMap<&str, Vec<&JobReport>> = BTreeMap::new();
    for report in reports {
        by_job
            .entry(report.job_id.as_str())
            .or_default()
            .push(report);
    }
    let reports_of = |id: &str| by_job.get(id).map_or(&[][..], Vec::as_slice);
    let mut out = Vec::new();
    let mut live: BTreeSet<&str> = BTreeSet::new();
    for (id, p) in held {
        let tier = reports_of(id).first().map_or("-", |r| r.tier.as_str());
        // What the user reads in `scontrol show job`: held, why, and until when.
        let how = match p.how {
            powerflex_core::flex::Preempt::Requeue => "requeued",
            _ => "suspended",
        };
        let text = format!(
            "powerflex;tier={tier};{how}:grid-cut-deeper-than-every-cap-floor;back-when-the-cut-ends"
        );
        live.insert(id);
        if done.get(id) != Some(&text) {
            done.insert(id.clone(), text.clone());
            out.push((id.clone(), text));
        }
    }
    for job in &allocation.jobs {
        let reports = reports_of(&job.id);
        let report = reports.first().copied();
        let tier = report.map_or("-", |r| r.tier.as_str());
        let pfi = report
            .and_then(|r| r.pfi)
            .map_or("-".to_string(), |p| format!("{p:.2}"));
        // Energy so far over the job's nodes, floored to two significant digits: the text
        // (and so an `scontrol update`) changes a few dozen times in a job's life, not at
        // every report. Slurm refuses updates once a job has finished, so this is the
        // last figure `sacct` shows; the exact one is the controller's record.
        let energy_mj: u64 = reports
            .iter()
            .filter_map(|j| j.usage.as_ref().map(|u| u.energy_mj))
            .fold(0u64, u64::saturating_add);
        let energy = if energy_mj > 0 {
            format!(
                ";energy_kwh_so_far={}",
                floor_two_digits(energy_mj as f64 / 1000.0 / powerflex_proto::usage::J_PER_KWH)
            )
        } else {
            String::new()
        };
        // No spaces: `scontrol show job` prints key=value pairs separated by spaces.
        let text = format!(
            "powerflex;tier={tier};pfi={pfi};cap={:.0}W{energy}",
            job.cap_w.0
        );
        live.insert(&job.id);
        if done.get(&job.id) != Some(&text) {
            done.insert(job.id.clone(), text.clone());
            out.push((job.id.clone(), text));
        }
    }
    done.retain(|id, _| live.contains(id.as_str()));
    out
}

/// `x` floored to two significant digits, without trailing noise (`0.0012`, `1.2`, `34`).
fn floor_two_digits(x: f64) -> String {
    if !(x.is_finite() && x > 0.0) {
        return "0".to_string();
    }
    let exponent = x.log10().floor() as i32 - 1;
    let scale = 10f64.powi(exponent);
    let floored = (x / scale).floor() * scale;
    let decimals = (-exponent).max(0) as usize;
    format!("{floored:.decimals$}")
}
