//! Per-job energy and what the caps did to the job: one node's share as the agent
//! measured it ([`NodeUsage`]), and the job's record summed over its nodes at its end
//! ([`JobEnergyRecord`], versioned: the JSON-lines log and `powerflexctl accounting`
//! read it).
//!
//! Energy comes from each GPU's total-energy counter (`nvmlDeviceGetTotalEnergyConsumption`,
//! mJ), read when the job's hold of the GPU began and at each sample since: the job is
//! charged the counter's advance over exactly the time it held the GPU. Only a GPU
//! without the counter is charged power × time instead, and its share says so
//! ([`EnergySource::Integrated`]).

use serde::{Deserialize, Serialize};

pub use powerflex_core::promise::BoundJudgement;

/// The version of [`JobEnergyRecord`] this crate writes. A reader refuses a record of a
/// newer version rather than misread it. Version 2 added `run_start_unix_ms` and
/// `revision` (a requeued job's runs, late final shares); a version 1 record reads with
/// neither (one run, revision 1).
pub const RECORD_VERSION: u32 = 2;

/// What a job's throughput counts per second.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum ThroughputUnit {
    Tokens,
    Steps,
}

impl ThroughputUnit {
    pub fn name(self) -> &'static str {
        match self {
            ThroughputUnit::Tokens => "tokens",
            ThroughputUnit::Steps => "steps",
        }
    }
}

/// Where a figure of energy comes from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum EnergySource {
    /// Every GPU's hardware energy counter, over the time the job held it.
    Counter,
    /// Power readings × time on GPUs without the counter (an approximation).
    Integrated,
    /// Counters on some GPUs or spans, power × time on the rest.
    Mixed,
}

impl EnergySource {
    /// The source of a sum of figures from `a` and `b`.
    pub fn combine(a: EnergySource, b: EnergySource) -> EnergySource {
        if a == b {
            a
        } else {
            EnergySource::Mixed
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            EnergySource::Counter => "counter",
            EnergySource::Integrated => "integrated",
            EnergySource::Mixed => "mixed",
        }
    }
}

/// One GPU's hold by a job on one node.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct GpuEnergy {
    pub uuid: String,
    pub index: u32,
    /// The first and last reading of the hold, Unix ms.
    pub from_unix_ms: u64,
    pub to_unix_ms: u64,
    /// The energy counter at those readings, mJ, when the GPU has one (across a counter
    /// reset, the last segment's).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub counter_from_mj: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub counter_to_mj: Option<u64>,
    /// Energy charged to the job on this GPU, mJ.
    pub energy_mj: u64,
    pub source: EnergySource,
}

/// Time spent at one per-GPU cap.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CapTime {
    /// The per-GPU limit in force, W (rounded to the watt).
    pub cap_w: f64,
    pub seconds: f64,
}

/// One node's share of a job, as its agent measured it: running totals while the job
/// runs, final once `ended`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NodeUsage {
    pub job_id: String,
    pub node: String,
    /// The job's owner (Slurm's job uid, from the registration).
    pub uid: u32,
    /// The job's service in `--power-flex` form.
    pub tier: String,
    pub gpus: Vec<GpuEnergy>,
    /// The sum over `gpus`, mJ.
    pub energy_mj: u64,
    pub energy_source: EnergySource,
    /// First and last reading of any of the job's GPUs here, Unix ms.
    pub from_unix_ms: u64,
    pub to_unix_ms: u64,
    /// Highest summed draw of the job's GPUs here in one sample, W.
    pub peak_power_w: f64,
    /// Time the job was followed sample by sample, s: the base of the shares below (a
    /// gap, such as an agent restart, counts in energy but not here).
    pub observed_s: f64,
    /// Time with a GPU of the job limited below its default, s.
    pub capped_s: f64,
    /// Time while the controller said a grid event was in force, s.
    pub event_s: f64,
    /// Time with a GPU of the job reporting its clocks held back by a power cap or
    /// power brake (NVML's clock-event reasons), s, of `throttle_known_s` in which the
    /// reasons could be read.
    pub power_throttled_s: f64,
    pub throttle_known_s: f64,
    /// Time at each per-GPU cap, highest first (at most [`MAX_CAP_TIMES`]; closer caps
    /// merged beyond).
    pub caps: Vec<CapTime>,
    /// The job's slowdown from its caps, percent of its uncapped throughput: its measured
    /// curve at the caps it ran at, weighted by time. None without a measured curve.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub slowdown_pct: Option<f64>,
    /// The tier's bound, percent (none for tiers without one).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bound_pct: Option<f64>,
    /// Whether the bound held: no measurement window here read the job slower than its
    /// bound against the same phase uncapped ([`powerflex_core::promise`]). None before
    /// a window was judged, or for a tier without a bound.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bound_held: Option<bool>,
    /// The windows judged, and when the bound did not hold, how long and how deep it was
    /// broken. Absent in shares from older agents.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bound_judgement: Option<BoundJudgement>,
    /// Energy saved against running uncapped for the same work, J: an ESTIMATE from the
    /// job's measured curve (the uncapped draw over the time the work would have taken
    /// uncapped, less the curve's draw at the caps held).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub saved_estimate_j: Option<f64>,
    /// Work reported by the job's processes here over the hold (tokens, else steps).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub work: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub work_unit: Option<ThroughputUnit>,
    pub pfi: Option<f64>,
    /// The job's hold of its GPUs here is over: these are final.
    pub ended: bool,
    /// The node's GPUs are simulated.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub simulated: bool,
}

/// Most [`CapTime`] entries a share keeps.
pub const MAX_CAP_TIMES: usize = 32;

/// A job's record at its end, summed over its nodes.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct JobEnergyRecord {
    /// [`RECORD_VERSION`] when written.
    pub version: u32,
    /// Whether any of the job's GPUs is simulated (the test bed's GPUs say so in their
    /// serial): then every figure here is a simulation's.
    pub simulated: bool,
    pub job_id: String,
    pub uid: u32,
    /// The Slurm account the job was charged to, from Slurm's record (none when Slurm
    /// named none, or the controller reads no placement).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub account: Option<String>,
    pub tier: String,
    /// When the record was written, Unix ms.
    pub written_unix_ms: u64,
    pub from_unix_ms: u64,
    pub to_unix_ms: u64,
    pub gpus: u32,
    pub energy_j: f64,
    pub energy_kwh: f64,
    pub energy_source: EnergySource,
    /// Energy over the job's span, W.
    pub avg_power_w: f64,
    /// The sum of each node's peak, W: an upper bound of the job's peak draw (nodes peak
    /// at different samples).
    pub peak_power_w: f64,
    /// Shares of observed time, percent (the highest over the job's nodes for capped,
    /// events and throttling: any node slowed holds the job back).
    pub capped_pct: f64,
    pub event_s: f64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub power_throttled_pct: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub slowdown_pct: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bound_pct: Option<f64>,
    /// See [`NodeUsage::bound_held`]: every node's windows held.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bound_held: Option<bool>,
    /// The nodes' judgements merged (they measure the same time: the longest time past
    /// the bound and the deepest window). Absent in records from older releases.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bound_judgement: Option<BoundJudgement>,
    /// ESTIMATE (see [`NodeUsage::saved_estimate_j`]), summed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub saved_estimate_j: Option<f64>,
    /// Tokens per joule, where the job reports tokens on every node.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tokens_per_j: Option<f64>,
    pub pfi: Option<f64>,
    /// Nodes whose final share never arrived (their agent gone): their last running
    /// share is used, and the record is then a lower bound.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub incomplete_nodes: Vec<String>,
    pub nodes: Vec<NodeUsage>,
    /// Which run of the job this is: Slurm's start time of the run (`squeue`'s
    /// `start_time`), Unix ms. A requeued job keeps its id and gets a new start time, so
    /// each run has its own record. None when the controller does not read Slurm
    /// (`job_placement = "reports"`) and in version 1 records.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub run_start_unix_ms: Option<u64>,
    /// 1 for a run's first record; a final share that arrives after it (an agent that
    /// was down when the job ended sends it at its next start) makes the run's record
    /// again, complete, with the next revision. The latest revision of a run is its
    /// record.
    #[serde(default = "first_revision", skip_serializing_if = "is_first_revision")]
    pub revision: u32,
}

fn first_revision() -> u32 {
    1
}

fn is_first_revision(r: &u32) -> bool {
    *r == 1
}

/// Most GPUs a share may name (one node's; the link's `MAX_GPUS_PER_NODE` is this).
pub const MAX_SHARE_GPUS: usize = 256;
/// Highest draw believed of one GPU, W (the link's `MAX_GPU_POWER_W` is this).
pub const MAX_SHARE_GPU_POWER_W: f64 = 5_000.0;

/// Longest job id, tier, node name or GPU UUID a share may carry, bytes.
pub const MAX_SHARE_TEXT_BYTES: usize = 256;

fn invalid(field: String, reason: impl Into<String>) -> crate::ProtoError {
    crate::ProtoError::Invalid {
        field,
        reason: reason.into(),
    }
}

fn check_figure(field: &str, value: f64) -> Result<(), crate::ProtoError> {
    if value.is_finite() && value >= 0.0 {
        Ok(())
    } else {
        Err(invalid(
            field.to_string(),
            format!("{value}; accepted: a finite number >= 0"),
        ))
    }
}

impl NodeUsage {
    /// Checks that a share from a peer can be true: a valid job id, at most
    /// [`MAX_SHARE_GPUS`] GPUs with 1-128 printable-character UUIDs, at
    /// most [`MAX_CAP_TIMES`] caps, every figure finite and non-negative, a peak within
    /// what its GPUs can draw, `from_unix_ms <= to_unix_ms`, texts of at most
    /// [`MAX_SHARE_TEXT_BYTES`]. Sums over shares saturate, so no value can overflow
    /// them.
    pub fn validate(&self) -> Result<(), crate::ProtoError> {
        if !crate::valid_job_id(&self.job_id) {
            return Err(crate::ProtoError::BadJobId);
        }
        let field = |f: &str| format!("share of job {} {f}", self.job_id);
        if self.tier.len() > MAX_SHARE_TEXT_BYTES || self.node.len() > MAX_SHARE_TEXT_BYTES {
            return Err(invalid(
                field("tier/node"),
                format!("longer than {MAX_SHARE_TEXT_BYTES} bytes"),
            ));
        }
        if self.gpus.len() > MAX_SHARE_GPUS {
            return Err(invalid(
                field("gpus"),
                format!("{} GPUs; at most {}", self.gpus.len(), MAX_SHARE_GPUS),
            ));
        }
        for g in &self.gpus {
            if g.uuid.is_empty()
                || g.uuid.len() > 128
                || !g.uuid.chars().all(|c| c.is_ascii_graphic())
            {
                return Err(invalid(
                    field("gpu uuid"),
                    "1-128 printable ASCII characters",
                ));
            }
            if g.from_unix_ms > g.to_unix_ms {
                return Err(invalid(field("gpu from_unix_ms"), "after its to_unix_ms"));
            }
        }
        if self.caps.len() > MAX_CAP_TIMES {
            return Err(invalid(
                field("caps"),
                format!("{} entries; at most {MAX_CAP_TIMES}", self.caps.len()),
            ));
        }
        if self.from_unix_ms > self.to_unix_ms {
            return Err(invalid(field("from_unix_ms"), "after its to_unix_ms"));
        }
        let most_w = MAX_SHARE_GPU_POWER_W * self.gpus.len().max(1) as f64;
        if self.peak_power_w > most_w {
            return Err(invalid(
                field("peak_power_w"),
                format!("{} W; at most {most_w} W for its GPUs", self.peak_power_w),
            ));
        }
        for (name, v) in [
            ("peak_power_w", self.peak_power_w),
            ("observed_s", self.observed_s),
            ("capped_s", self.capped_s),
            ("event_s", self.event_s),
            ("power_throttled_s", self.power_throttled_s),
            ("throttle_known_s", self.throttle_known_s),
        ] {
            check_figure(&field(name), v)?;
        }
        // Shares of observed time are parts of it (a part beyond its whole would make an
        // infinite percentage of a tiny whole), and times stay within years a database
        // can hold.
        let within = |part: f64, whole: f64| part <= whole * (1.0 + 1e-9) + 1e-6;
        for (name, part, whole) in [
            ("capped_s", self.capped_s, self.observed_s),
            ("event_s", self.event_s, self.observed_s),
            ("throttle_known_s", self.throttle_known_s, self.observed_s),
            (
                "power_throttled_s",
                self.power_throttled_s,
                self.throttle_known_s,
            ),
        ] {
            if !within(part, whole) {
                return Err(invalid(
                    field(name),
                    format!("{part} s is more than the {whole} s it is a share of"),
                ));
            }
        }
        if self.to_unix_ms > MAX_UNIX_MS || self.gpus.iter().any(|g| g.to_unix_ms > MAX_UNIX_MS) {
            return Err(invalid(
                field("to_unix_ms"),
                format!("after the year 9999 (at most {MAX_UNIX_MS} ms)"),
            ));
        }
        for c in &self.caps {
            check_figure(&field("cap cap_w"), c.cap_w)?;
            check_figure(&field("cap seconds"), c.seconds)?;
        }
        if let Some(j) = self.bound_judgement {
            for (name, v) in [
                ("bound_judgement judged_s", j.judged_s),
                ("bound_judgement past_s", j.past_s),
            ] {
                check_figure(&field(name), v)?;
            }
            if let Some(d) = j.depth_pct {
                check_figure(&field("bound_judgement depth_pct"), d)?;
            }
        }
        for (name, v) in [
            ("slowdown_pct", self.slowdown_pct),
            ("bound_pct", self.bound_pct),
            ("work", self.work),
            ("pfi", self.pfi),
        ] {
            if let Some(v) = v {
                check_figure(&field(name), v)?;
            }
        }
        // An estimate may be negative (capping cost energy), never NaN or infinite.
        if let Some(v) = self.saved_estimate_j.filter(|v| !v.is_finite()) {
            return Err(invalid(
                field("saved_estimate_j"),
                format!("{v} is not finite"),
            ));
        }
        Ok(())
    }
}

/// The latest time a share may name, Unix ms (9999-12-31T23:59:59.999Z).
pub const MAX_UNIX_MS: u64 = 253_402_300_799_999;

/// Joules per kilowatt-hour.
pub const J_PER_KWH: f64 = 3.6e6;

impl JobEnergyRecord {
    /// The job's record from its nodes' shares. `incomplete_nodes` names shares that
    /// are not final. None for no shares.
    pub fn from_shares(
        shares: Vec<NodeUsage>,
        incomplete_nodes: Vec<String>,
        written_unix_ms: u64,
    ) -> Option<JobEnergyRecord> {
        let simulated = shares.iter().any(|s| s.simulated);
        let first = shares.first()?.clone();
        // Saturating: a node's figure, however large, never wraps the others' away.
        let energy_mj = shares
            .iter()
            .fold(0u64, |sum, s| sum.saturating_add(s.energy_mj));
        let energy_j = energy_mj as f64 / 1000.0;
        let from = shares.iter().map(|s| s.from_unix_ms).min().unwrap_or(0);
        let to = shares.iter().map(|s| s.to_unix_ms).max().unwrap_or(from);
        let span_s = to.saturating_sub(from) as f64 / 1000.0;
        let source = shares
            .iter()
            .map(|s| s.energy_source)
            .reduce(EnergySource::combine)
            .unwrap_or(EnergySource::Counter);
        let share = |part: fn(&NodeUsage) -> f64, base: fn(&NodeUsage) -> f64| {
            shares
                .iter()
                .filter(|s| base(s) > 0.0)
                .map(|s| 100.0 * part(s) / base(s))
                .fold(None, |m: Option<f64>, v| Some(m.map_or(v, |m| m.max(v))))
        };
        let all_some = |f: fn(&NodeUsage) -> Option<f64>| -> Option<Vec<f64>> {
            shares.iter().map(f).collect()
        };
        let tokens_per_j = match (
            shares
                .iter()
                .all(|s| s.work_unit == Some(ThroughputUnit::Tokens)),
            all_some(|s| s.work),
        ) {
            (true, Some(work)) if energy_j > 0.0 => Some(work.iter().sum::<f64>() / energy_j),
            _ => None,
        };
        Some(JobEnergyRecord {
            version: RECORD_VERSION,
            simulated,
            job_id: first.job_id.clone(),
            uid: first.uid,
            account: None,
            tier: first.tier.clone(),
            written_unix_ms,
            from_unix_ms: from,
            to_unix_ms: to,
            gpus: shares.iter().map(|s| s.gpus.len() as u32).sum(),
            energy_j,
            energy_kwh: energy_j / J_PER_KWH,
            energy_source: source,
            avg_power_w: if span_s > 0.0 { energy_j / span_s } else { 0.0 },
            peak_power_w: shares.iter().map(|s| s.peak_power_w).sum(),
            capped_pct: share(|s| s.capped_s, |s| s.observed_s).unwrap_or(0.0),
            event_s: shares.iter().map(|s| s.event_s).fold(0.0, f64::max),
            power_throttled_pct: share(|s| s.power_throttled_s, |s| s.throttle_known_s),
            slowdown_pct: shares
                .iter()
                .filter_map(|s| s.slowdown_pct)
                .fold(None, |m: Option<f64>, v| Some(m.map_or(v, |m| m.max(v)))),
            bound_pct: first.bound_pct,
            bound_held: shares
                .iter()
                .filter_map(|s| s.bound_held)
                .reduce(|a, b| a && b),
            bound_judgement: shares
                .iter()
                .filter_map(|s| s.bound_judgement)
                .reduce(|a, b| a.merge(&b)),
            saved_estimate_j: all_some(|s| s.saved_estimate_j).map(|v| v.iter().sum()),
            tokens_per_j,
            pfi: shares.iter().find_map(|s| s.pfi),
            incomplete_nodes,
            nodes: shares,
            run_start_unix_ms: None,
            revision: 1,
        })
    }

    /// Whether the bound held, in the words every surface prints: "held", "NOT held (12.3
    /// points past it at worst, for 40 s)", or "(no window judged)"; a record from an
    /// older release, without the judgement, says only held or NOT held.
    pub fn bound_text(&self) -> String {
        match (
            self.bound_held,
            self.bound_judgement.and_then(|j| j.verdict_text()),
        ) {
            (Some(false), Some(text)) | (Some(true), Some(text)) => text,
            (Some(true), None) => "held".into(),
            (Some(false), None) => "NOT held".into(),
            (None, _) => "(no window judged)".into(),
        }
    }

    /// The bound's table cell: "held", "BROKEN +6.5 pt 40 s" (depth past the bound, time
    /// past it), or "-" before a window was judged.
    pub fn bound_cell(&self) -> String {
        bound_cell(self.bound_held, self.bound_judgement)
    }

    /// The line a job's user reads at its end, e.g. "powerflex: 12.4 kWh on 8 GPUs,
    /// capped 63 % of the time, 4.1 % slower, bound 25 % held".
    pub fn summary_line(&self) -> String {
        self.summary_of(&format!("job {}", self.job_id))
    }

    /// [`JobEnergyRecord::summary_line`] with `subject` (what the figures are of) after
    /// "powerflex: ".
    fn summary_of(&self, subject: &str) -> String {
        let mut line = format!(
            "powerflex: {subject} used {} on {} GPU{} ({}), capped {:.0} % of the time",
            human_energy(self.energy_j),
            self.gpus,
            if self.gpus == 1 { "" } else { "s" },
            self.energy_source.name(),
            self.capped_pct
        );
        if let Some(s) = self.slowdown_pct {
            line.push_str(&format!(", {s:.1} % slower"));
        }
        if let Some(b) = self.bound_pct {
            line.push_str(&format!(", bound {b:.0} % {}", self.bound_text()));
        }
        if let Some(saved) = self.saved_estimate_j.filter(|s| *s > 0.0) {
            line.push_str(&format!(", about {} saved (estimate)", human_energy(saved)));
        }
        if !self.incomplete_nodes.is_empty() {
            line.push_str(&format!(
                " [incomplete: no final figures from {}]",
                self.incomplete_nodes.join(",")
            ));
        }
        if self.simulated {
            line.push_str(" [SIMULATED GPUs]");
        }
        line
    }
}

/// See [`JobEnergyRecord::bound_cell`]; a record from an older release says BROKEN alone.
pub fn bound_cell(held: Option<bool>, judgement: Option<BoundJudgement>) -> String {
    match (held, judgement) {
        (Some(true), _) => "held".into(),
        (Some(false), Some(j)) => format!(
            "BROKEN +{:.1} pt {:.0} s",
            j.depth_pct.unwrap_or(0.0),
            j.past_s
        ),
        (Some(false), None) => "BROKEN".into(),
        (None, _) => "-".into(),
    }
}

impl NodeUsage {
    /// The line appended to the job's own output when its hold on this node ends: this
    /// share's figures in the words of [`JobEnergyRecord::summary_line`]. `job_nodes` is
    /// the job's node count as Slurm gives it; above one, the line says that it is this
    /// node's share and where the whole job's record is, since the other nodes' shares
    /// end on their own nodes and are summed only at the controller.
    pub fn end_line(&self, job_nodes: u32) -> String {
        let Some(record) = JobEnergyRecord::from_shares(vec![self.clone()], Vec::new(), 0) else {
            // from_shares is None only for no shares; one was given.
            return String::new();
        };
        if job_nodes > 1 {
            record.summary_of(&format!(
                "job {} on {} (this node's share of {job_nodes} nodes; the whole job: powerflexctl report --job {})",
                self.job_id, self.node, self.job_id
            ))
        } else {
            record.summary_line()
        }
    }
}

/// Energy for people: kWh from 0.1 kWh up, else Wh, else J.
pub fn human_energy(joules: f64) -> String {
    if joules >= 0.1 * J_PER_KWH {
        format!("{:.2} kWh", joules / J_PER_KWH)
    } else if joules >= 3600.0 {
        format!("{:.1} Wh", joules / 3600.0)
    } else {
        format!("{joules:.0} J")
    }
}

/// A node's final share of one job, as an acknowledgement names it: the job, and the
/// start of the node's hold of it (the share's own `from_unix_ms`, which a requeued
/// run of the same job id on the same node does not share).
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FinalRef {
    pub job_id: String,
    pub from_unix_ms: u64,
}

impl FinalRef {
    /// The reference to `share`.
    pub fn of(share: &NodeUsage) -> FinalRef {
        FinalRef {
            job_id: share.job_id.clone(),
            from_unix_ms: share.from_unix_ms,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn share(node: &str, energy_mj: u64, ended: bool) -> NodeUsage {
        NodeUsage {
            job_id: "7".into(),
            node: node.into(),
            uid: 1000,
            tier: "flex2".into(),
            gpus: vec![GpuEnergy {
                uuid: format!("GPU-{node}"),
                index: 0,
                from_unix_ms: 1_000,
                to_unix_ms: 11_000,
                counter_from_mj: Some(5),
                counter_to_mj: Some(5 + energy_mj),
                energy_mj,
                source: EnergySource::Counter,
            }],
            energy_mj,
            energy_source: EnergySource::Counter,
            from_unix_ms: 1_000,
            to_unix_ms: 11_000,
            peak_power_w: 500.0,
            observed_s: 10.0,
            capped_s: if node == "n1" { 5.0 } else { 2.0 },
            event_s: 0.0,
            power_throttled_s: 1.0,
            throttle_known_s: 10.0,
            caps: vec![],
            slowdown_pct: Some(3.0),
            bound_pct: Some(25.0),
            bound_held: Some(true),
            bound_judgement: Some(BoundJudgement {
                judged_s: 10.0,
                past_s: 0.0,
                depth_pct: None,
            }),
            saved_estimate_j: Some(100.0),
            work: Some(1e6),
            work_unit: Some(ThroughputUnit::Tokens),
            pfi: Some(3.0),
            ended,
            simulated: node == "n1",
        }
    }

    #[test]
    fn a_record_sums_its_nodes_exactly_and_says_what_it_is() {
        let r = JobEnergyRecord::from_shares(
            vec![share("n1", 4_000_123, true), share("n2", 3_000_001, true)],
            vec![],
            20_000,
        )
        .expect("record");
        assert_eq!(r.energy_j, 7_000.124);
        assert_eq!(r.gpus, 2);
        assert_eq!(r.avg_power_w, 700.0124);
        assert_eq!(r.capped_pct, 50.0);
        assert_eq!(r.power_throttled_pct, Some(10.0));
        assert_eq!(r.saved_estimate_j, Some(200.0));
        assert_eq!(r.tokens_per_j, Some(2e6 / 7_000.124));
        let line = r.summary_line();
        assert!(line.contains("1.9 Wh on 2 GPUs (counter)"), "{line}");
        assert!(
            line.contains("capped 50 %") && line.contains("bound 25 % held"),
            "{line}"
        );
        assert!(line.ends_with("[SIMULATED GPUs]"), "{line}");
        let text = serde_json::to_string(&r).expect("json");
        let back: JobEnergyRecord = serde_json::from_str(&text).expect("parse");
        assert_eq!(back, r);
        assert!(JobEnergyRecord::from_shares(vec![], vec![], 0).is_none());
    }

    #[test]
    fn a_version_1_record_reads_as_the_first_revision_of_one_run() {
        let mut r =
            JobEnergyRecord::from_shares(vec![share("n1", 1, true)], vec![], 0).expect("record");
        let mut v1 = serde_json::to_value(&r).expect("json");
        v1["version"] = 1.into();
        let back: JobEnergyRecord = serde_json::from_value(v1).expect("a v1 record reads");
        assert_eq!((back.revision, back.run_start_unix_ms), (1, None));
        r.revision = 2;
        r.run_start_unix_ms = Some(5_000);
        let text = serde_json::to_string(&r).expect("json");
        assert!(text.contains("\"revision\":2") && text.contains("\"run_start_unix_ms\":5000"));
        assert_eq!(
            serde_json::from_str::<JobEnergyRecord>(&text).expect("v2"),
            r
        );
    }

    #[test]
    fn a_share_from_a_peer_is_bounded_and_finite() {
        assert!(
            share("n1", u64::MAX - 5, true).validate().is_ok(),
            "sums saturate"
        );
        let bad = |f: fn(&mut NodeUsage)| {
            let mut s = share("n1", 1, true);
            f(&mut s);
            s.validate().expect_err("refused").to_string()
        };
        assert!(bad(|s| s.job_id = "7; rm".into()).contains("job_id"));
        assert!(bad(|s| s.observed_s = f64::NAN).contains("observed_s"));
        assert!(bad(|s| s.capped_s = -1.0).contains("capped_s"));
        // A part beyond its whole (an infinite percentage of a tiny whole) is refused.
        assert!(bad(|s| {
            s.observed_s = 5e-324;
            s.capped_s = 1.0;
        })
        .contains("capped_s"));
        assert!(
            bad(|s| s.power_throttled_s = s.throttle_known_s + 1.0).contains("power_throttled_s")
        );
        assert!(bad(|s| s.to_unix_ms = 10_000_000_000_000_000).contains("9999"));
        assert!(bad(|s| s.peak_power_w = 1e12).contains("peak_power_w"));
        assert!(bad(|s| s.from_unix_ms = s.to_unix_ms + 1).contains("from_unix_ms"));
        assert!(bad(|s| s.tier = "x".repeat(MAX_SHARE_TEXT_BYTES + 1)).contains("longer"));
        assert!(bad(|s| s.saved_estimate_j = Some(f64::INFINITY)).contains("saved_estimate_j"));
        assert!(bad(|s| {
            let g = s.gpus[0].clone();
            s.gpus = vec![g; MAX_SHARE_GPUS + 1];
        })
        .contains("at most"));
        assert!(bad(|s| {
            s.caps = vec![
                CapTime {
                    cap_w: 1.0,
                    seconds: 1.0
                };
                MAX_CAP_TIMES + 1
            ];
        })
        .contains("at most"));
    }

    #[test]
    fn a_node_that_broke_the_bound_marks_the_job() {
        let mut bad = share("n2", 1, true);
        bad.bound_held = Some(false);
        bad.bound_judgement = Some(BoundJudgement {
            judged_s: 10.0,
            past_s: 4.0,
            depth_pct: Some(6.5),
        });
        bad.work_unit = Some(ThroughputUnit::Steps);
        let r = JobEnergyRecord::from_shares(vec![share("n1", 1, true), bad], vec!["n2".into()], 0)
            .expect("record");
        assert_eq!(r.bound_held, Some(false));
        assert_eq!(r.tokens_per_j, None, "steps do not make tokens");
        assert!(
            r.summary_line()
                .contains("bound 25 % NOT held (6.5 points past it at worst, for 4 s)"),
            "{}",
            r.summary_line()
        );
        assert!(r.summary_line().contains("incomplete"));
        assert_eq!(human_energy(12.4 * J_PER_KWH), "12.40 kWh");
    }

    #[test]
    fn the_end_line_is_this_node_s_share_and_says_so_on_a_multi_node_job() {
        let mut s = share("n1", 7_000_124, true);
        s.slowdown_pct = Some(4.06);
        s.simulated = false;
        assert_eq!(
            s.end_line(1),
            "powerflex: job 7 used 1.9 Wh on 1 GPU (counter), capped 50 % of the time, 4.1 % slower, bound 25 % held, about 100 J saved (estimate)"
        );
        s.simulated = true;
        let line = s.end_line(3);
        assert!(
            line.starts_with(
                "powerflex: job 7 on n1 (this node's share of 3 nodes; the whole job: powerflexctl report --job 7) used 1.9 Wh on 1 GPU"
            ),
            "{line}"
        );
        assert!(line.ends_with("[SIMULATED GPUs]"), "{line}");
        assert!(!line.contains('\n'), "one line: {line}");
    }
}
