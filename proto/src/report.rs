//! What a node agent reports to the controller, and the checks the controller makes of
//! it before believing a word: the GPUs it announces ([`GpuInfo`]), its jobs
//! ([`JobReport`]), the final shares of ended jobs and their acknowledgements. Plain
//! data: the link (`crate::link`, behind the `link` feature) seals and carries it.

use serde::{Deserialize, Serialize};

use crate::status::{AgentGpuStatus, AgentStatus};
use crate::usage::FinalRef;
use crate::ProtoError;

/// A GPU as the agent announces it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct GpuInfo {
    pub uuid: String,
    pub name: String,
    pub min_w: f64,
    pub max_w: f64,
    pub default_w: f64,
}

/// A job as the agent reports it. `Default` is for building reports field by field
/// (tests, harnesses): an empty job id and tier are refused by the controller.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct JobReport {
    pub job_id: String,
    /// The job's service in `--power-flex` form.
    pub tier: String,
    pub gpus: u32,
    /// Per-GPU cap now, W.
    pub cap_w: Option<f64>,
    /// Summed GPU power now, W.
    pub power_w: Option<f64>,
    pub throughput: Option<f64>,
    /// What `throughput` counts per second on this node.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub throughput_unit: Option<crate::usage::ThroughputUnit>,
    pub pfi: Option<f64>,
    pub pfi_source: Option<crate::status::PfiSource>,
    /// Calibrated points, highest cap first (on the wire as [`crate::point`] writes
    /// them).
    #[serde(with = "crate::point::arrays")]
    pub points: Vec<powerflex_core::point::OperatingPoint>,
    /// UUIDs of the job's GPUs on this node (the ones `gpus` counts), so the controller
    /// takes the job's cap range from its own GPUs, not from every GPU of the node.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub gpu_uuids: Vec<String>,
    /// The per-GPU limit the GPUs read back in the samples that gave `power_w` (which
    /// `cap_w`, the last limit written, may not yet be), W.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub power_cap_w: Option<f64>,
    /// How long that limit had held when `power_w` was sampled, seconds: a draw sampled
    /// just after a cap change does not yet show what the job draws at the new cap.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub power_cap_steady_s: Option<f64>,
    /// The agent is walking the job's calibration now (its cap is the walk's level, and
    /// its points are not yet a whole curve).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub calibrating: bool,
    /// A new step put the job's curve in question on this node (see
    /// [`crate::status::AgentJobStatus::curve_in_question`]). Absent from older agents.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub curve_in_question: bool,
    /// The estimated curve with per-point uncertainty, highest cap first (`points` are
    /// its values): the controller plans with how well each point is known.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub curve: Vec<crate::status::CurvePoint>,
    /// Calibration's token cost, percent of the job's first-hour tokens.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub calibration_cost_pct: Option<f64>,
    /// The job's owner, a Unix uid, as the agent learnt it from a source the user cannot
    /// write: the registration from the step's root `slurmstepd` (Slurm's job uid), or
    /// the kernel's owner of the job's processes when the agent took the job back after
    /// a restart. Never from the job's environment or its progress reports. The
    /// controller shows a non-root admin caller only the jobs they own; none (an agent
    /// from before this field) means unknown, and such a job is shown to root only.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub owner_uid: Option<u32>,
    /// The job's energy and what its caps did on this node so far (running totals).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub usage: Option<crate::usage::NodeUsage>,
}

/// A node's report to the controller, as the agent builds it from its status: the link
/// carries its fields as `Body::Report`, and the site harness hands it over in memory.
/// `Default`: a node that says only that it is there.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct NodeReport {
    pub jobs: Vec<JobReport>,
    /// The node's GPUs' draw, W (a GPU the agent cannot steer counted at its cap).
    pub power_w: f64,
    /// The controller's lease ran out and the fail-safe cap applies.
    pub failsafe: bool,
    pub cap_mismatches: u64,
    /// Final shares not yet acknowledged, at most [`MAX_ENDED_PER_REPORT`].
    pub ended: Vec<crate::usage::NodeUsage>,
    pub observe_only: bool,
}

impl NodeReport {
    /// The report of an agent whose status is `status`; `turn` counts the reports sent,
    /// and picks which final shares this one carries when more are unacknowledged than
    /// one report holds.
    ///
    /// A GPU the agent cannot read or set right now (degraded, or its last sample
    /// failed) keeps drawing under the last limit it accepted: it counts at that cap,
    /// outside its job, so the controller pays for it first and splits the rest over the
    /// GPUs it can steer. Otherwise a lower budget would reach only the healthy GPUs and
    /// the stuck one would carry the site over it.
    pub fn of(status: &AgentStatus, turn: usize) -> NodeReport {
        // A GPU another power manager holds is not steered either: it counts at the limit
        // it reads, outside its job.
        let steerable =
            |g: &AgentGpuStatus| g.degraded.is_none() && g.power_w.is_some() && !g.owned_elsewhere;
        let power_w = status
            .gpus
            .iter()
            .map(|g| match (steerable(g), g.power_w) {
                (true, Some(w)) => w,
                _ => g.cap_w.unwrap_or(g.default_w),
            })
            .sum();
        let jobs = status
            .jobs
            .iter()
            .map(|j| {
                let mine: Vec<&AgentGpuStatus> = status
                    .gpus
                    .iter()
                    .filter(|g| g.job.as_deref() == Some(j.job.as_str()) && steerable(g))
                    .collect();
                let drawn_w: f64 = mine.iter().filter_map(|g| g.power_w).sum();
                JobReport {
                    job_id: j.job.clone(),
                    tier: j.tier.clone(),
                    gpus: mine.len() as u32,
                    cap_w: j.cap_w,
                    power_w: (!mine.is_empty()).then_some(drawn_w),
                    throughput: j.throughput,
                    throughput_unit: j.throughput_unit,
                    pfi: j.pfi.or(j.prior_pfi),
                    pfi_source: j.pfi_source,
                    points: j.points.clone(),
                    gpu_uuids: mine.iter().map(|g| g.uuid.clone()).collect(),
                    power_cap_w: j.power_cap_w,
                    power_cap_steady_s: j.power_cap_steady_s,
                    calibrating: j.calibrating,
                    curve_in_question: j.curve_in_question,
                    curve: j.curve.clone(),
                    calibration_cost_pct: j.calibration_cost_pct,
                    // Slurm's job uid from the root slurmstepd's registration (or the
                    // kernel's owner of the job's processes, for a job taken back): the
                    // controller shows the job to this user and root only.
                    owner_uid: Some(j.uid),
                    usage: j.usage.clone(),
                }
            })
            .collect();
        NodeReport {
            jobs,
            power_w,
            failsafe: status.failsafe,
            cap_mismatches: status.cap_mismatches,
            // Unacknowledged final shares, re-sent until the controller acknowledges them.
            ended: finals_in_turn(&status.ended, turn),
            observe_only: !status.enforce,
        }
    }
}

/// The final shares one report carries: at most [`MAX_ENDED_PER_REPORT`] of the
/// unacknowledged ones, in turns from `turn` (each report the next ones), so a share
/// the controller never takes does not keep the others out.
fn finals_in_turn(
    unacked: &[crate::usage::NodeUsage],
    turn: usize,
) -> Vec<crate::usage::NodeUsage> {
    if unacked.len() <= MAX_ENDED_PER_REPORT {
        return unacked.to_vec();
    }
    let start = turn.wrapping_mul(MAX_ENDED_PER_REPORT) % unacked.len();
    unacked
        .iter()
        .cycle()
        .skip(start)
        .take(MAX_ENDED_PER_REPORT)
        .cloned()
        .collect()
}

/// Most final shares one report carries: an agent with more unacknowledged ones sends
/// them in turns, report after report.
pub const MAX_ENDED_PER_REPORT: usize = 16;

/// Most final shares one acknowledgement (the link's `acked` message) names.
pub const MAX_ACKS_PER_MESSAGE: usize = 256;

/// Checks the final shares of one report: at most [`MAX_ENDED_PER_REPORT`], each final
/// and valid ([`crate::usage::NodeUsage::validate`]).
pub fn validate_final_shares(shares: &[crate::usage::NodeUsage]) -> Result<(), ProtoError> {
    if shares.len() > MAX_ENDED_PER_REPORT {
        return Err(invalid(
            "ended",
            format!(
                "{} final shares; at most {MAX_ENDED_PER_REPORT} per report",
                shares.len()
            ),
        ));
    }
    for share in shares {
        if !share.ended {
            return Err(invalid(
                format!("ended share of job {}", share.job_id),
                "not final (ended = false)",
            ));
        }
        share.validate()?;
    }
    Ok(())
}

/// Checks an acknowledgement: at most [`MAX_ACKS_PER_MESSAGE`] references, each with a
/// valid job id.
pub fn validate_acks(finals: &[FinalRef]) -> Result<(), ProtoError> {
    if finals.len() > MAX_ACKS_PER_MESSAGE {
        return Err(invalid(
            "acked finals",
            format!(
                "{} references; at most {MAX_ACKS_PER_MESSAGE} per message",
                finals.len()
            ),
        ));
    }
    if finals.iter().any(|f| !crate::valid_job_id(&f.job_id)) {
        return Err(ProtoError::BadJobId);
    }
    Ok(())
}

/// Most GPUs one node may announce or one job may hold on one node.
pub const MAX_GPUS_PER_NODE: usize = crate::usage::MAX_SHARE_GPUS;
/// Highest power limit or draw believed of one GPU, W (the largest accelerators today
/// are near 1.5 kW; anything above this is a broken or lying sender).
pub const MAX_GPU_POWER_W: f64 = crate::usage::MAX_SHARE_GPU_POWER_W;
/// Most jobs one node may report, and most calibrated points per job.
pub const MAX_JOBS_PER_NODE: usize = 256;
pub const MAX_POINTS_PER_JOB: usize = 256;

fn invalid(field: impl Into<String>, reason: impl Into<String>) -> ProtoError {
    ProtoError::Invalid {
        field: field.into(),
        reason: reason.into(),
    }
}

/// `value` must be finite and within `[lo, hi]`.
///
/// The field's name is written only for an error: every report is checked again in every
/// allocation, and formatting each field's name up front was most of that check's cost.
fn check_range(
    field: impl FnOnce() -> String,
    value: f64,
    lo: f64,
    hi: f64,
) -> Result<(), ProtoError> {
    if !value.is_finite() {
        return Err(invalid(field(), format!("{value} is not a finite number")));
    }
    if value < lo || value > hi {
        return Err(invalid(
            field(),
            format!(
                "{value} is out of range; accepted: {}",
                accepted_range(lo, hi)
            ),
        ));
    }
    Ok(())
}

/// `lo..=hi` in words, as a refusal says it: `f64::MIN_POSITIVE` is "above 0" and
/// `f64::MAX` no upper bound, rather than the 300-digit numbers they print as.
fn accepted_range(lo: f64, hi: f64) -> String {
    let low = if lo == f64::MIN_POSITIVE {
        "above 0".to_string()
    } else {
        format!("at least {lo}")
    };
    if hi == f64::MAX {
        low
    } else {
        format!("{low} and at most {hi}")
    }
}

impl GpuInfo {
    /// Checks that the GPU's limits can be true: finite, `0 < min_w <= default_w <=
    /// max_w <= MAX_GPU_POWER_W`, a UUID of 1-128 printable characters, a name of at most
    /// 256 bytes without control characters.
    pub fn validate(&self) -> Result<(), ProtoError> {
        if self.uuid.is_empty()
            || self.uuid.len() > 128
            || !self.uuid.chars().all(|c| c.is_ascii_graphic())
        {
            return Err(invalid("gpu uuid", "1-128 printable ASCII characters"));
        }
        if self.name.len() > 256 {
            return Err(invalid("gpu name", "longer than 256 bytes"));
        }
        // NVML's names are printable; a control character (NUL above all, which
        // PostgreSQL's jsonb refuses) would make the state that keeps it unsavable.
        if self.name.chars().any(char::is_control) {
            return Err(invalid("gpu name", "holds a control character"));
        }
        let field = |f: &str| format!("gpu {} {f}", self.uuid);
        check_range(
            || field("min_w"),
            self.min_w,
            f64::MIN_POSITIVE,
            MAX_GPU_POWER_W,
        )?;
        check_range(|| field("max_w"), self.max_w, self.min_w, MAX_GPU_POWER_W)?;
        check_range(
            || field("default_w"),
            self.default_w,
            self.min_w,
            self.max_w,
        )?;
        Ok(())
    }
}

/// Checks an agent's hello: at most [`MAX_GPUS_PER_NODE`] valid GPUs, no UUID twice.
pub fn validate_gpus(gpus: &[GpuInfo]) -> Result<(), ProtoError> {
    if gpus.len() > MAX_GPUS_PER_NODE {
        return Err(invalid(
            "gpus",
            format!("{} GPUs; at most {MAX_GPUS_PER_NODE} per node", gpus.len()),
        ));
    }
    let mut seen = std::collections::BTreeSet::new();
    for g in gpus {
        g.validate()?;
        if !seen.insert(g.uuid.as_str()) {
            return Err(invalid("gpus", format!("GPU {} announced twice", g.uuid)));
        }
    }
    Ok(())
}

impl JobReport {
    /// Checks that the report can be true of a job on a node with `node_gpus`: a valid job
    /// id, `1..=node_gpus` GPUs (its UUIDs, when given, among the node's and as many as
    /// `gpus`), finite non-negative power within what its GPUs can draw, finite
    /// non-negative throughput, a finite PFI above 0, at most [`MAX_POINTS_PER_JOB`] finite
    /// points. A report that fails is left out of the allocation; the rest of the node's
    /// jobs and every other node are still allocated.
    pub fn validate(&self, node_gpus: &[GpuInfo]) -> Result<(), ProtoError> {
        if !crate::valid_job_id(&self.job_id) {
            return Err(ProtoError::BadJobId);
        }
        let job = |f: &str| format!("job {} {f}", self.job_id);
        if self.tier.len() > 256 {
            return Err(invalid(job("tier"), "longer than 256 bytes"));
        }
        if self.gpus == 0 || self.gpus as usize > node_gpus.len() {
            return Err(invalid(
                job("gpus"),
                format!(
                    "{} GPUs on a node that announced {}",
                    self.gpus,
                    node_gpus.len()
                ),
            ));
        }
        if !self.gpu_uuids.is_empty() {
            if self.gpu_uuids.len() != self.gpus as usize {
                return Err(invalid(
                    job("gpu_uuids"),
                    format!("{} UUIDs for {} GPUs", self.gpu_uuids.len(), self.gpus),
                ));
            }
            for uuid in &self.gpu_uuids {
                if !node_gpus.iter().any(|g| &g.uuid == uuid) {
                    return Err(invalid(
                        job("gpu_uuids"),
                        format!("{uuid} is not a GPU this node announced"),
                    ));
                }
            }
        }
        let most_w = MAX_GPU_POWER_W * f64::from(self.gpus);
        if let Some(cap) = self.cap_w {
            check_range(|| job("cap_w"), cap, 0.0, MAX_GPU_POWER_W)?;
        }
        if let Some(p) = self.power_w {
            check_range(|| job("power_w"), p, 0.0, most_w)?;
        }
        if let Some(cap) = self.power_cap_w {
            check_range(|| job("power_cap_w"), cap, 0.0, MAX_GPU_POWER_W)?;
        }
        if let Some(s) = self.power_cap_steady_s {
            check_range(|| job("power_cap_steady_s"), s, 0.0, f64::MAX)?;
        }
        if let Some(t) = self.throughput {
            check_range(|| job("throughput"), t, 0.0, f64::MAX)?;
        }
        // Any finite positive PFI is a curve the physics allows: a job that keeps nearly
        // all its speed when capped (a flat curve) measures a PFI in the hundreds or
        // thousands, and it is the cheapest job to cut, not one to leave unsteered.
        if let Some(pfi) = self.pfi {
            check_range(|| job("pfi"), pfi, f64::MIN_POSITIVE, f64::MAX)?;
        }
        if self.points.len() > MAX_POINTS_PER_JOB {
            return Err(invalid(
                job("points"),
                format!("{} points; at most {MAX_POINTS_PER_JOB}", self.points.len()),
            ));
        }
        for p in &self.points {
            check_range(
                || job("point cap_w"),
                p.cap_w.0,
                f64::MIN_POSITIVE,
                MAX_GPU_POWER_W,
            )?;
            check_range(|| job("point power_w"), p.power_w.0, 0.0, most_w)?;
            check_range(|| job("point throughput"), p.throughput, 0.0, f64::MAX)?;
        }
        Ok(())
    }
}

/// Checks a report's node-level figures: at most [`MAX_JOBS_PER_NODE`] jobs, no job twice,
/// a finite draw within what the node's GPUs can draw, and no more GPUs in jobs than the
/// node has. The jobs themselves are checked one by one ([`JobReport::validate`]).
pub fn validate_report_totals(
    jobs: &[JobReport],
    power_w: f64,
    node_gpus: &[GpuInfo],
) -> Result<(), ProtoError> {
    if jobs.len() > MAX_JOBS_PER_NODE {
        return Err(invalid(
            "jobs",
            format!("{} jobs; at most {MAX_JOBS_PER_NODE} per node", jobs.len()),
        ));
    }
    check_range(
        || "node power_w".into(),
        power_w,
        0.0,
        MAX_GPU_POWER_W * node_gpus.len().max(1) as f64,
    )?;
    let mut seen = std::collections::BTreeSet::new();
    let mut uuids = std::collections::BTreeSet::new();
    let mut gpus_in_jobs: u64 = 0;
    for j in jobs {
        if !seen.insert(j.job_id.as_str()) {
            return Err(invalid("jobs", format!("job {} reported twice", j.job_id)));
        }
        gpus_in_jobs += u64::from(j.gpus);
        for uuid in &j.gpu_uuids {
            if !uuids.insert(uuid.as_str()) {
                return Err(invalid("jobs", format!("GPU {uuid} reported in two jobs")));
            }
        }
    }
    if gpus_in_jobs > node_gpus.len() as u64 {
        return Err(invalid(
            "jobs",
            format!(
                "{gpus_in_jobs} GPUs in jobs on a node that announced {}",
                node_gpus.len()
            ),
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn final_share(job_id: usize) -> crate::usage::NodeUsage {
        serde_json::from_str(&format!(
            r#"{{"job_id":"{job_id}","node":"n1","uid":1,"tier":"flex2","gpus":[],"energy_mj":1,
            "energy_source":"counter","from_unix_ms":1,"to_unix_ms":2,"peak_power_w":0.0,
            "observed_s":0.0,"capped_s":0.0,"event_s":0.0,"power_throttled_s":0.0,
            "throttle_known_s":0.0,"caps":[],"pfi":null,"ended":true}}"#
        ))
        .expect("a final share")
    }

    #[test]
    fn every_unacknowledged_share_goes_out_in_turn() {
        let few: Vec<_> = (0..3).map(final_share).collect();
        assert_eq!(finals_in_turn(&few, 7), few, "all, when they fit");
        let many: Vec<_> = (0..40).map(final_share).collect();
        let mut seen = std::collections::BTreeSet::new();
        for turn in 0..3 {
            let sent = finals_in_turn(&many, turn);
            assert_eq!(sent.len(), MAX_ENDED_PER_REPORT);
            seen.extend(sent.into_iter().map(|s| s.job_id));
        }
        assert_eq!(seen.len(), 40, "three reports carry all forty");
        assert_eq!(
            finals_in_turn(&many, usize::MAX).len(),
            MAX_ENDED_PER_REPORT
        );
    }

    fn flat_job(pfi: f64) -> JobReport {
        serde_json::from_str(&format!(
            r#"{{"job_id":"7","tier":"flex1","gpus":1,"cap_w":700.0,"power_w":690.0,
            "throughput":100.0,"pfi":{pfi},"pfi_source":null,"points":[]}}"#
        ))
        .expect("a job report")
    }

    /// A flat curve (the job keeps its speed when capped) measures a PFI in the hundreds
    /// or thousands: its report is planned on, not refused. A PFI of 0 or below is
    /// refused, and the refusal says what is accepted in words, not as a 300-digit number.
    #[test]
    fn a_flat_curve_s_large_pfi_is_accepted_and_a_refusal_reads_in_words() {
        let gpus = [GpuInfo {
            uuid: "GPU-1".into(),
            name: "H200".into(),
            min_w: 200.0,
            max_w: 700.0,
            default_w: 700.0,
        }];
        for pfi in [1.0, 131.0, 995.0, 1045.0, 1e9] {
            assert_eq!(flat_job(pfi).validate(&gpus), Ok(()), "PFI {pfi}");
        }
        for pfi in [0.0, -1.0] {
            let refused = flat_job(pfi).validate(&gpus).expect_err("refused");
            let text = refused.to_string();
            assert!(text.contains("accepted: above 0"), "{text}");
            assert!(text.len() < 120, "{text}");
        }
    }
}
