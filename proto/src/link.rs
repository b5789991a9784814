//! Agent ↔ controller link: JSON lines over TCP, every message authenticated.
//!
//! Each line is an [`Envelope`]: the sender's node name (`"controller"` for the
//! controller), a sequence number, the sender's wall-clock time, the body, and an
//! HMAC-SHA256 over all of it keyed with the site key (a root-only file). A receiver
//! rejects a bad MAC (forged or corrupted), a sequence number not above the last one it
//! accepted from that sender (replayed), and a timestamp more than [`MAX_SKEW_MS`] from
//! its own clock (replayed later). Senders start their sequence at their start time in
//! milliseconds, so it keeps rising across restarts.
//!
//! Agent → controller: [`Body::Hello`] on connect, then [`Body::Report`] every allocation
//! period. Controller → agent: [`Body::Lease`] — per-job caps valid for `ttl_s`.

use hmac::{Hmac, Mac};
use serde::{Deserialize, Serialize};
use sha2::Sha256;

use crate::{ProtoError, MAX_LINE_BYTES, VERSION};

/// Largest accepted difference between a message's timestamp and the receiver's clock.
pub const MAX_SKEW_MS: u64 = 60_000;

/// Largest link message, bytes: reports carry curves of many jobs.
pub const MAX_LINK_LINE_BYTES: usize = 64 * MAX_LINE_BYTES;

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

/// A job as the agent reports it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
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
    pub throughput_unit: Option<crate::status::ThroughputUnit>,
    pub pfi: Option<f64>,
    pub pfi_source: Option<crate::status::PfiSource>,
    /// Calibrated points: [per-GPU cap W, job power W, throughput].
    pub points: Vec<[f64; 3]>,
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
    /// The estimated curve with per-point uncertainty, highest cap first (`points` are
    /// its values): the controller plans with how well each point is known.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub curve: Vec<crate::status::CurvePoint>,
    /// Calibration's token cost, percent of the job's first-hour tokens.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub calibration_cost_pct: Option<f64>,
}

/// What a message says.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "kebab-case", deny_unknown_fields)]
pub enum Body {
    Hello {
        gpus: Vec<GpuInfo>,
    },
    Report {
        jobs: Vec<JobReport>,
        power_w: f64,
        failsafe: bool,
        /// GPU limits the agent found changed behind its back (read back through NVML
        /// and not what it wrote) and wrote again, since the agent started.
        #[serde(default)]
        cap_mismatches: u64,
    },
    /// Per-job per-GPU caps, W, valid for `ttl_s` from receipt, for node `node` only.
    Lease {
        /// The node this lease is for: an agent refuses a lease naming another node.
        node: String,
        caps: std::collections::BTreeMap<String, f64>,
        ttl_s: f64,
        /// Per-GPU cap for a managed job the lease does not name yet (it started since
        /// the controller last allocated): the share the budget in force leaves a new
        /// job, so a job that starts during a cut does not start above it, W.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        start_cap_w: Option<f64>,
        /// Jobs whose measured power or throughput left their curve's band: the agent
        /// walks them again, at most as often as its rate limit allows.
        #[serde(default, skip_serializing_if = "Vec::is_empty")]
        recalibrate: Vec<String>,
        /// Jobs the agent may hold one cap step below their cap for a window, to learn
        /// their curve there: jobs on this node only (a probe on one node of a job
        /// spanning several would slow the job everywhere and mislabel the others'
        /// windows), while an event holds them below uncapped.
        #[serde(default, skip_serializing_if = "Vec::is_empty")]
        learn: Vec<String>,
    },
}

/// One authenticated message.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Envelope {
    pub v: u32,
    pub from: String,
    pub seq: u64,
    pub ts_ms: u64,
    pub body: Body,
    /// Hex HMAC-SHA256 of the envelope serialised with `mac` empty.
    pub mac: String,
}

type HmacSha256 = Hmac<Sha256>;

fn mac_of(key: &[u8], envelope: &Envelope) -> Result<HmacSha256, ProtoError> {
    let unsigned = Envelope {
        mac: String::new(),
        ..envelope.clone()
    };
    let text =
        serde_json::to_string(&unsigned).map_err(|e| ProtoError::Malformed(e.to_string()))?;
    let mut mac =
        HmacSha256::new_from_slice(key).map_err(|e| ProtoError::Malformed(e.to_string()))?;
    mac.update(text.as_bytes());
    Ok(mac)
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn unhex(text: &str) -> Option<Vec<u8>> {
    if text.len() % 2 != 0 {
        return None;
    }
    (0..text.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(text.get(i..i + 2)?, 16).ok())
        .collect()
}

/// Most GPUs one node may announce or one job may hold on one node.
pub const MAX_GPUS_PER_NODE: usize = 256;
/// Highest power limit or draw believed of one GPU, W (the largest accelerators today
/// are near 1.5 kW; anything above this is a broken or lying sender).
pub const MAX_GPU_POWER_W: f64 = 5_000.0;
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
fn check_range(field: &str, value: f64, lo: f64, hi: f64) -> Result<(), ProtoError> {
    if !value.is_finite() {
        return Err(invalid(field, format!("{value} is not a finite number")));
    }
    if value < lo || value > hi {
        return Err(invalid(field, format!("{value} is outside {lo}..={hi}")));
    }
    Ok(())
}

impl GpuInfo {
    /// Checks that the GPU's limits can be true: finite, `0 < min_w <= default_w <=
    /// max_w <= MAX_GPU_POWER_W`, a UUID of 1-128 printable characters.
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
        let field = |f: &str| format!("gpu {} {f}", self.uuid);
        check_range(
            &field("min_w"),
            self.min_w,
            f64::MIN_POSITIVE,
            MAX_GPU_POWER_W,
        )?;
        check_range(&field("max_w"), self.max_w, self.min_w, MAX_GPU_POWER_W)?;
        check_range(&field("default_w"), self.default_w, self.min_w, self.max_w)?;
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
    /// non-negative throughput, a PFI in (0, 100), at most [`MAX_POINTS_PER_JOB`] finite
    /// points. A report that fails is left out of the allocation; the rest of the node's
    /// jobs and every other node are still allocated.
    pub fn validate(&self, node_gpus: &[GpuInfo]) -> Result<(), ProtoError> {
        if !crate::valid_id(&self.job_id) {
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
            check_range(&job("cap_w"), cap, 0.0, MAX_GPU_POWER_W)?;
        }
        if let Some(p) = self.power_w {
            check_range(&job("power_w"), p, 0.0, most_w)?;
        }
        if let Some(cap) = self.power_cap_w {
            check_range(&job("power_cap_w"), cap, 0.0, MAX_GPU_POWER_W)?;
        }
        if let Some(s) = self.power_cap_steady_s {
            check_range(&job("power_cap_steady_s"), s, 0.0, f64::MAX)?;
        }
        if let Some(t) = self.throughput {
            check_range(&job("throughput"), t, 0.0, f64::MAX)?;
        }
        if let Some(pfi) = self.pfi {
            check_range(&job("pfi"), pfi, f64::MIN_POSITIVE, 100.0)?;
        }
        if self.points.len() > MAX_POINTS_PER_JOB {
            return Err(invalid(
                job("points"),
                format!("{} points; at most {MAX_POINTS_PER_JOB}", self.points.len()),
            ));
        }
        for p in &self.points {
            check_range(
                &job("point cap_w"),
                p[0],
                f64::MIN_POSITIVE,
                MAX_GPU_POWER_W,
            )?;
            check_range(&job("point power_w"), p[1], 0.0, most_w)?;
            check_range(&job("point throughput"), p[2], 0.0, f64::MAX)?;
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
        "node power_w",
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

/// Why a link message was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LinkError {
    #[error(transparent)]
    Proto(#[from] ProtoError),
    #[error("message from {from} fails authentication (wrong site key, or altered)")]
    BadMac { from: String },
    #[error("message from {from} replayed: sequence {seq} not above {last}")]
    Replayed { from: String, seq: u64, last: u64 },
    #[error(
        "message from {from} is {skew_ms} ms away from this host's clock (limit {MAX_SKEW_MS} ms)"
    )]
    Stale { from: String, skew_ms: u64 },
}

impl Envelope {
    /// Signs `body` from `from` with `seq` at `ts_ms`.
    pub fn seal(
        key: &[u8],
        from: &str,
        seq: u64,
        ts_ms: u64,
        body: Body,
    ) -> Result<Envelope, ProtoError> {
        let mut envelope = Envelope {
            v: VERSION,
            from: from.to_string(),
            seq,
            ts_ms,
            body,
            mac: String::new(),
        };
        envelope.mac = hex(&mac_of(key, &envelope)?.finalize().into_bytes());
        Ok(envelope)
    }

    pub fn to_line(&self) -> String {
        let mut line = serde_json::to_string(self).unwrap_or_default();
        line.push('\n');
        line
    }

    /// Parses a line and checks its MAC, freshness and sequence against `last_seq` (the
    /// last accepted from that sender, 0 for none) at the receiver's time `now_ms`.
    pub fn open(key: &[u8], line: &str, last_seq: u64, now_ms: u64) -> Result<Envelope, LinkError> {
        if line.len() > MAX_LINK_LINE_BYTES {
            return Err(ProtoError::TooLong(line.len()).into());
        }
        let envelope: Envelope = serde_json::from_str(line.trim_end())
            .map_err(|e| ProtoError::Malformed(e.to_string()))?;
        if envelope.v != VERSION {
            return Err(ProtoError::Version(envelope.v).into());
        }
        let claimed = unhex(&envelope.mac).ok_or_else(|| LinkError::BadMac {
            from: envelope.from.clone(),
        })?;
        // verify_slice compares in constant time.
        mac_of(key, &envelope)?
            .verify_slice(&claimed)
            .map_err(|_| LinkError::BadMac {
                from: envelope.from.clone(),
            })?;
        let skew = envelope.ts_ms.abs_diff(now_ms);
        if skew > MAX_SKEW_MS {
            return Err(LinkError::Stale {
                from: envelope.from.clone(),
                skew_ms: skew,
            });
        }
        if envelope.seq <= last_seq {
            return Err(LinkError::Replayed {
                from: envelope.from.clone(),
                seq: envelope.seq,
                last: last_seq,
            });
        }
        Ok(envelope)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const KEY: &[u8] = b"site key for tests";

    fn lease() -> Body {
        Body::Lease {
            node: "n1".into(),
            caps: [("42".to_string(), 450.0)].into(),
            ttl_s: 30.0,
            start_cap_w: Some(300.0),
            recalibrate: Vec::new(),
            learn: Vec::new(),
        }
    }

    #[test]
    fn sealed_messages_open_and_tampering_is_caught() {
        let e = Envelope::seal(KEY, "controller", 10, 1_000_000, lease()).expect("seal");
        let line = e.to_line();
        assert_eq!(Envelope::open(KEY, &line, 9, 1_000_500), Ok(e.clone()));
        assert!(matches!(
            Envelope::open(b"other key", &line, 0, 1_000_000),
            Err(LinkError::BadMac { .. })
        ));
        let altered = line.replace("450.0", "700.0");
        assert!(matches!(
            Envelope::open(KEY, &altered, 0, 1_000_000),
            Err(LinkError::BadMac { .. })
        ));
        assert!(matches!(
            Envelope::open(KEY, &line, 10, 1_000_000),
            Err(LinkError::Replayed { .. })
        ));
        assert!(matches!(
            Envelope::open(KEY, &line, 0, 1_000_000 + 61_000),
            Err(LinkError::Stale { .. })
        ));
        assert!(matches!(
            Envelope::open(KEY, "{", 0, 0),
            Err(LinkError::Proto(_))
        ));
        let unsigned = line.replace(&e.mac, "");
        assert!(matches!(
            Envelope::open(KEY, &unsigned, 0, 1_000_000),
            Err(LinkError::BadMac { .. })
        ));
    }

    /// The MAC covers the re-serialised envelope, so every float must survive
    /// text -> f64 -> text unchanged; serde_json's default (fast, approximate) float
    /// parser does not guarantee that, which once made reports with measured powers fail
    /// authentication at random.
    #[test]
    fn any_float_survives_the_round_trip_the_mac_depends_on() {
        use proptest::prelude::*;
        proptest!(|(power in 0.0f64..1e7, cap in 100.0f64..1000.0, t in 0.0f64..1e6)| {
            let body = Body::Report {
                jobs: vec![JobReport {
                    job_id: "1".into(),
                    tier: "flex1".into(),
                    gpus: 8,
                    cap_w: Some(cap),
                    power_w: Some(power),
                    throughput: Some(t),
                    throughput_unit: Some(crate::status::ThroughputUnit::Tokens),
                    pfi: Some(t / 1e6),
                    pfi_source: Some(crate::status::PfiSource::Measured),
                    points: vec![[cap, power, t]],
                    gpu_uuids: Vec::new(),
                    power_cap_w: Some(cap),
                    power_cap_steady_s: Some(t / 1e3),
                    calibrating: t > 5e5,
                    curve: Vec::new(),
                    calibration_cost_pct: None,
                }],
                power_w: power * 0.97,
                failsafe: false,
                cap_mismatches: 0,
            };
            let e = Envelope::seal(KEY, "n1", 2, 5_000, body).expect("seal");
            prop_assert_eq!(Envelope::open(KEY, &e.to_line(), 1, 5_000), Ok(e));
        });
    }

    fn gpu(uuid: &str) -> GpuInfo {
        GpuInfo {
            uuid: uuid.into(),
            name: "NVIDIA H200 (simulated)".into(),
            min_w: 200.0,
            max_w: 700.0,
            default_w: 700.0,
        }
    }

    fn job(id: &str, gpus: u32) -> JobReport {
        JobReport {
            job_id: id.into(),
            tier: "flex2".into(),
            gpus,
            cap_w: Some(500.0),
            power_w: Some(480.0 * f64::from(gpus)),
            throughput: Some(1000.0),
            throughput_unit: Some(crate::status::ThroughputUnit::Tokens),
            pfi: Some(1.4),
            pfi_source: Some(crate::status::PfiSource::Measured),
            points: vec![[700.0, 690.0 * f64::from(gpus), 1100.0]],
            gpu_uuids: Vec::new(),
            power_cap_w: Some(500.0),
            power_cap_steady_s: Some(3.0),
            calibrating: false,
            curve: Vec::new(),
            calibration_cost_pct: None,
        }
    }

    #[test]
    fn reports_that_cannot_be_true_are_refused_with_the_field_named() {
        let node: Vec<GpuInfo> = (0..4).map(|i| gpu(&format!("GPU-{i}"))).collect();
        assert_eq!(validate_gpus(&node), Ok(()));
        assert_eq!(job("7", 2).validate(&node), Ok(()));
        let refused = |j: JobReport| match j.validate(&node) {
            Err(ProtoError::Invalid { field, .. }) => field,
            other => panic!("expected a refusal, got {other:?}"),
        };
        let mut nan = job("7", 2);
        nan.power_w = Some(f64::NAN);
        assert_eq!(refused(nan), "job 7 power_w");
        let mut negative = job("7", 2);
        negative.power_w = Some(-500.0);
        assert_eq!(refused(negative), "job 7 power_w");
        assert_eq!(refused(job("7", u32::MAX)), "job 7 gpus");
        assert_eq!(refused(job("7", 0)), "job 7 gpus");
        let mut inf = job("7", 2);
        inf.throughput = Some(f64::INFINITY);
        assert_eq!(refused(inf), "job 7 throughput");
        let mut point = job("7", 2);
        point.points.push([f64::NAN, 1.0, 1.0]);
        assert_eq!(refused(point), "job 7 point cap_w");
        let mut pfi = job("7", 2);
        pfi.pfi = Some(0.0);
        assert_eq!(refused(pfi), "job 7 pfi");
        let mut foreign = job("7", 1);
        foreign.gpu_uuids = vec!["GPU-elsewhere".into()];
        assert_eq!(refused(foreign), "job 7 gpu_uuids");
        assert_eq!(job("../x", 1).validate(&node), Err(ProtoError::BadJobId));
    }

    #[test]
    fn node_totals_are_checked_without_overflow() {
        let node: Vec<GpuInfo> = (0..4).map(|i| gpu(&format!("GPU-{i}"))).collect();
        assert_eq!(
            validate_report_totals(&[job("1", 2), job("2", 2)], 1900.0, &node),
            Ok(())
        );
        // Two jobs whose counts add past u32::MAX, and more GPUs in jobs than the node has.
        assert!(
            validate_report_totals(&[job("1", u32::MAX), job("2", u32::MAX)], 100.0, &node)
                .is_err()
        );
        assert!(validate_report_totals(&[job("1", 3), job("2", 2)], 100.0, &node).is_err());
        assert!(validate_report_totals(&[job("1", 1), job("1", 1)], 100.0, &node).is_err());
        assert!(validate_report_totals(&[], -1.0, &node).is_err());
        assert!(validate_report_totals(&[], f64::NAN, &node).is_err());
        let mut a = job("1", 1);
        a.gpu_uuids = vec!["GPU-0".into()];
        let mut b = job("2", 1);
        b.gpu_uuids = vec!["GPU-0".into()];
        assert!(validate_report_totals(&[a, b], 100.0, &node).is_err());
    }

    #[test]
    fn impossible_gpus_are_refused() {
        let mut bad = gpu("GPU-0");
        bad.min_w = 0.0;
        assert!(bad.validate().is_err());
        let mut bad = gpu("GPU-0");
        bad.max_w = 100.0;
        assert!(bad.validate().is_err());
        let mut bad = gpu("GPU-0");
        bad.default_w = f64::NAN;
        assert!(bad.validate().is_err());
        assert!(validate_gpus(&[gpu("GPU-0"), gpu("GPU-0")]).is_err());
    }
}
