//! powerflex's wire types. Small on purpose: the SPANK plugin links this crate.
//!
//! Every message is one line of JSON (`\n`-terminated, at most [`MAX_LINE_BYTES`]) with a
//! protocol version `v`, so any language can speak it with its standard library.
//!
//! ## Progress reports (training job → node agent)
//! A job reports how far it got; the agent turns reports into throughput. The address is
//! in the job's environment as `POWERFLEX_PROGRESS` (a Unix stream socket path). The job
//! connects, writes one line per report, and may keep the connection open. Counters are
//! cumulative since the job started, so a lost line loses nothing:
//! ```json
//! {"v":1,"job_id":"4242","tokens":1048576,"steps":128}
//! ```
//! `tokens` may be 0 for jobs that only count steps. The agent accepts a report only from
//! a process of the job's own user that belongs to the job (see the agent's docs).

use serde::{Deserialize, Serialize};

/// Environment variable carrying the progress address into the job.
pub const PROGRESS_ENV: &str = "POWERFLEX_PROGRESS";

/// Longest accepted line, bytes (newline included).
pub const MAX_LINE_BYTES: usize = 4096;

/// Longest accepted agent reply, bytes: a node's status lists every GPU and every job
/// with its curve (points, their uncertainty and windows), which outgrows a request line
/// on a busy node. Replies come from the root-owned agent, requests from anyone, so
/// only requests keep the small limit.
pub const MAX_REPLY_BYTES: usize = 64 * MAX_LINE_BYTES;

/// Version of the line protocol this crate speaks.
pub const VERSION: u32 = 1;

/// One progress report.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ProgressReport {
    /// Protocol version; 1.
    pub v: u32,
    /// Slurm job id of the reporting job.
    pub job_id: String,
    /// Tokens processed since the job started (cumulative).
    pub tokens: u64,
    /// Optimizer steps completed since the job started (cumulative).
    pub steps: u64,
}

/// Why a line is not a valid message, or a value one would carry is refused.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum ProtoError {
    #[error("message of {0} bytes exceeds the {MAX_LINE_BYTES}-byte limit")]
    TooLong(usize),
    #[error("reply of {0} bytes exceeds the {MAX_REPLY_BYTES}-byte limit")]
    ReplyTooLong(usize),
    #[error("malformed message: {0}")]
    Malformed(String),
    #[error("unsupported protocol version {0}; this agent speaks version {VERSION}")]
    Version(u32),
    #[error("job_id must be 1-64 characters of digits, letters, '_' or '.'")]
    BadJobId,
    /// A well-formed message whose values cannot be true (NaN, a negative power, more
    /// GPUs than a node holds, ...).
    #[error("invalid {field}: {reason}")]
    Invalid { field: String, reason: String },
    /// A grid event's reduction outside [0, 1].
    #[error("a reduction of {fraction} is out of range; accepted: a fraction from 0 to 1")]
    ReductionOutOfRange { fraction: f64 },
    /// A grid event's target budget that is negative or not finite.
    #[error("a target budget of {budget_w} W is out of range; accepted: 0 W or more, finite")]
    TargetOutOfRange { budget_w: f64 },
    /// A grid event whose ramps in and out do not fit in its duration.
    #[error(
        "an event needs a duration longer than twice its ramp (got {duration_ms} ms and a {ramp_ms} ms ramp)"
    )]
    RampTooLong { duration_ms: u64, ramp_ms: u64 },
    /// A grid event longer than [`event::MAX_EVENT_DURATION_MS`].
    #[error(
        "an event of {} s is too long; accepted: at most {} s (a standing limit is a budget: budget-set)",
        duration_ms / 1000,
        event::MAX_EVENT_DURATION_MS / 1000
    )]
    EventTooLong { duration_ms: u64 },
    /// A grid event whose end is past the end of `u64` milliseconds.
    #[error(
        "an event starting at {start_ms} ms never ends in Unix milliseconds; accepted: a real date"
    )]
    EventNeverEnds { start_ms: u64 },
    /// A curve snapshot's origin that is neither `calibrated` nor `event <id>`.
    #[error("unknown snapshot origin {0:?}: expected \"calibrated\" or \"event <id>\"")]
    SnapshotOrigin(String),
}

impl ProgressReport {
    /// The report as one line, newline included.
    pub fn to_line(&self) -> String {
        // Serialising plain strings and integers cannot fail.
        let mut line = serde_json::to_string(self).unwrap_or_default();
        line.push('\n');
        line
    }

    /// Parses and validates one line (trailing newline optional).
    pub fn from_line(line: &str) -> Result<ProgressReport, ProtoError> {
        if line.len() > MAX_LINE_BYTES {
            return Err(ProtoError::TooLong(line.len()));
        }
        let report: ProgressReport = serde_json::from_str(line.trim_end_matches(['\n', '\r']))
            .map_err(|e| ProtoError::Malformed(e.to_string()))?;
        if report.v != VERSION {
            return Err(ProtoError::Version(report.v));
        }
        if !valid_job_id(&report.job_id) {
            return Err(ProtoError::BadJobId);
        }
        Ok(report)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip() {
        let r = ProgressReport {
            v: 1,
            job_id: "4242".into(),
            tokens: 1 << 20,
            steps: 128,
        };
        assert_eq!(
            r.to_line(),
            "{\"v\":1,\"job_id\":\"4242\",\"tokens\":1048576,\"steps\":128}\n"
        );
        assert_eq!(ProgressReport::from_line(&r.to_line()), Ok(r));
    }

    #[test]
    fn rejects_bad_lines() {
        assert!(matches!(
            ProgressReport::from_line("{"),
            Err(ProtoError::Malformed(_))
        ));
        assert_eq!(
            ProgressReport::from_line("{\"v\":2,\"job_id\":\"1\",\"tokens\":0,\"steps\":0}"),
            Err(ProtoError::Version(2))
        );
        assert_eq!(
            ProgressReport::from_line("{\"v\":1,\"job_id\":\"../x\",\"tokens\":0,\"steps\":0}"),
            Err(ProtoError::BadJobId)
        );
        assert!(matches!(
            ProgressReport::from_line("{\"v\":1,\"job_id\":\"1\",\"tokens\":-1,\"steps\":0}"),
            Err(ProtoError::Malformed(_))
        ));
        assert!(matches!(
            ProgressReport::from_line(
                "{\"v\":1,\"job_id\":\"1\",\"tokens\":0,\"steps\":0,\"x\":1}"
            ),
            Err(ProtoError::Malformed(_))
        ));
        assert_eq!(
            ProgressReport::from_line(&"x".repeat(5000)),
            Err(ProtoError::TooLong(5000))
        );
    }
}

/// ## Job control (SPANK plugin / epilog → node agent)
/// One request line, one reply line, over the agent's control socket. Only root peers may
/// register or end jobs (the agent checks `SO_PEERCRED`); anyone may ask for status.
/// ```json
/// {"v":1,"op":"register","job_id":"4242","step_id":"0","uid":1000,"node":"n1","gpus":["0","1"],"flex":"flex2"}
/// {"v":1,"op":"end-step","job_id":"4242","step_id":"0"}
/// {"v":1,"op":"end-job","job_id":"4242"}
/// {"v":1,"op":"status"}
/// ```
/// Replies: `{"v":1,"ok":true,...}` or `{"v":1,"ok":false,"error":"..."}`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "kebab-case", deny_unknown_fields)]
pub enum ControlOp {
    /// A job step starts on this node (every step registers; the first one creates the job).
    Register {
        job_id: String,
        step_id: String,
        /// The job owner's uid: progress reports are accepted only from this user.
        uid: u32,
        /// Slurm node name (`slurmd -N`), to catch a request sent to the wrong agent.
        node: String,
        /// GPUs as the job's environment names them: indices or UUIDs.
        gpus: Vec<String>,
        /// The `--power-flex` value (empty: the site default).
        flex: String,
    },
    /// A step ended (its GPUs stay with the job until the job ends).
    EndStep { job_id: String, step_id: String },
    /// The job ended: its GPUs go back to their default caps.
    EndJob { job_id: String },
    /// Snapshot of the agent's state.
    Status,
}

/// A control request: protocol version plus the operation.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ControlRequest {
    pub v: u32,
    #[serde(flatten)]
    pub op: ControlOp,
}

/// The agent's answer to a control request: refused with the reason, or done with what
/// the operation asks back. On the wire it is one object, `{"v":1,"ok":true,...}` with the
/// answer's fields or `{"v":1,"ok":false,"error":"..."}`, the form every agent and plugin
/// release reads and writes (private wire structs map between the two).
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(try_from = "ControlReplyWire")]
pub enum ControlReply {
    /// The request was refused; the text says why, for people (the plugin logs it).
    Refused(String),
    /// The request was carried out.
    Done(ControlAnswer),
}

/// What a carried-out control request answers with.
#[derive(Debug, Clone, PartialEq)]
pub enum ControlAnswer {
    /// Nothing to carry back: `end-job`, an `end-step` that ended no final share here, or
    /// a `status` the agent had no snapshot for.
    Empty,
    /// For `register`: the service the job got, in `--power-flex` form, and the address
    /// to put in the job's `POWERFLEX_PROGRESS` (none for an unmanaged job). Both are
    /// optional on the wire; a reply with neither reads as [`ControlAnswer::Empty`].
    Registered {
        tier: Option<String>,
        progress: Option<String>,
    },
    /// For `status`: the agent's snapshot.
    Status(Box<status::AgentStatus>),
    /// For `end-step` of a job's batch step: the job's final share on this node, which
    /// the batch step's end ended (the line the plugin appends to the job's output is
    /// made from it). Other steps, unknown jobs, and older agents answer
    /// [`ControlAnswer::Empty`].
    StepEnded(Box<usage::NodeUsage>),
}

/// A [`ControlReply`] as it is read: `ok`, `error` when refused, and the answer's
/// fields. Unknown fields are ignored, so a field a newer agent adds does not make its
/// replies unreadable to an older plugin.
#[derive(Deserialize)]
struct ControlReplyWire {
    // Read (and required) as every release has; not checked, as before.
    #[allow(dead_code)]
    v: u32,
    ok: bool,
    #[serde(default)]
    error: Option<String>,
    #[serde(default)]
    progress: Option<String>,
    #[serde(default)]
    tier: Option<String>,
    #[serde(default)]
    status: Option<Box<status::AgentStatus>>,
    #[serde(default)]
    ended_share: Option<Box<usage::NodeUsage>>,
}

/// A [`ControlReply`] as it is written: the same fields in the same order, each absent
/// when it has nothing to say.
#[derive(Serialize)]
struct ControlReplyWireRef<'a> {
    v: u32,
    ok: bool,
    #[serde(skip_serializing_if = "Option::is_none")]
    error: Option<&'a str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    progress: Option<&'a str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    tier: Option<&'a str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    status: Option<&'a status::AgentStatus>,
    #[serde(skip_serializing_if = "Option::is_none")]
    ended_share: Option<&'a usage::NodeUsage>,
}

impl TryFrom<ControlReplyWire> for ControlReply {
    type Error = ProtoError;

    fn try_from(wire: ControlReplyWire) -> Result<ControlReply, ProtoError> {
        if !wire.ok {
            // A refusal without a reason (no agent sends one) reads as the word the
            // plugin has always shown for it.
            return Ok(ControlReply::Refused(
                wire.error.unwrap_or_else(|| "refused".into()),
            ));
        }
        let registered = wire.progress.is_some() || wire.tier.is_some();
        let answers = usize::from(registered)
            + usize::from(wire.status.is_some())
            + usize::from(wire.ended_share.is_some());
        if answers > 1 {
            return Err(ProtoError::Invalid {
                field: "reply".into(),
                reason: "it carries the answers of more than one operation".into(),
            });
        }
        let answer = if registered {
            ControlAnswer::Registered {
                tier: wire.tier,
                progress: wire.progress,
            }
        } else if let Some(status) = wire.status {
            ControlAnswer::Status(status)
        } else if let Some(share) = wire.ended_share {
            ControlAnswer::StepEnded(share)
        } else {
            ControlAnswer::Empty
        };
        Ok(ControlReply::Done(answer))
    }
}

impl Serialize for ControlReply {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        let mut wire = ControlReplyWireRef {
            v: VERSION,
            ok: true,
            error: None,
            progress: None,
            tier: None,
            status: None,
            ended_share: None,
        };
        match self {
            ControlReply::Refused(why) => {
                wire.ok = false;
                wire.error = Some(why);
            }
            ControlReply::Done(ControlAnswer::Empty) => {}
            ControlReply::Done(ControlAnswer::Registered { tier, progress }) => {
                wire.tier = tier.as_deref();
                wire.progress = progress.as_deref();
            }
            ControlReply::Done(ControlAnswer::Status(status)) => wire.status = Some(status),
            ControlReply::Done(ControlAnswer::StepEnded(share)) => wire.ended_share = Some(share),
        }
        wire.serialize(serializer)
    }
}

impl ControlReply {
    /// Done, with nothing to carry back.
    pub fn ok() -> ControlReply {
        ControlReply::Done(ControlAnswer::Empty)
    }

    /// Refused, for the reason `message` gives.
    pub fn error(message: impl Into<String>) -> ControlReply {
        ControlReply::Refused(message.into())
    }

    /// Whether the request was carried out.
    pub fn is_ok(&self) -> bool {
        matches!(self, ControlReply::Done(_))
    }

    /// Why the request was refused; none when it was carried out.
    pub fn error_message(&self) -> Option<&str> {
        match self {
            ControlReply::Refused(why) => Some(why),
            ControlReply::Done(_) => None,
        }
    }

    /// What the request answered with; none when it was refused.
    pub fn answer(&self) -> Option<&ControlAnswer> {
        match self {
            ControlReply::Done(answer) => Some(answer),
            ControlReply::Refused(_) => None,
        }
    }

    /// A `register` answer's progress address.
    pub fn progress(&self) -> Option<&str> {
        match self.answer()? {
            ControlAnswer::Registered { progress, .. } => progress.as_deref(),
            _ => None,
        }
    }

    /// A `register` answer's service, in `--power-flex` form.
    pub fn tier(&self) -> Option<&str> {
        match self.answer()? {
            ControlAnswer::Registered { tier, .. } => tier.as_deref(),
            _ => None,
        }
    }

    /// A `status` answer's snapshot.
    pub fn status(&self) -> Option<&status::AgentStatus> {
        match self.answer()? {
            ControlAnswer::Status(status) => Some(status),
            _ => None,
        }
    }

    /// An `end-step` answer's final share.
    pub fn ended_share(&self) -> Option<&usage::NodeUsage> {
        match self.answer()? {
            ControlAnswer::StepEnded(share) => Some(share),
            _ => None,
        }
    }

    pub fn to_line(&self) -> String {
        let mut line =
            serde_json::to_string(self).unwrap_or_else(|_| "{\"v\":1,\"ok\":false}".into());
        line.push('\n');
        line
    }

    pub fn from_line(line: &str) -> Result<ControlReply, ProtoError> {
        if line.len() > MAX_REPLY_BYTES {
            return Err(ProtoError::ReplyTooLong(line.len()));
        }
        serde_json::from_str(line.trim_end()).map_err(|e| ProtoError::Malformed(e.to_string()))
    }
}

/// Whether `id` can name a job (or a step) anywhere powerflex takes one: 1 to 64 ASCII
/// letters, digits, `_` or `.` (Slurm's job ids, array jobs included).
pub fn valid_job_id(id: &str) -> bool {
    !id.is_empty()
        && id.len() <= 64
        && id
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '.')
}

impl ControlRequest {
    pub fn new(op: ControlOp) -> ControlRequest {
        ControlRequest { v: VERSION, op }
    }

    pub fn to_line(&self) -> String {
        let mut line = serde_json::to_string(self).unwrap_or_default();
        line.push('\n');
        line
    }

    /// Parses and validates one request line.
    pub fn from_line(line: &str) -> Result<ControlRequest, ProtoError> {
        if line.len() > MAX_LINE_BYTES {
            return Err(ProtoError::TooLong(line.len()));
        }
        let request: ControlRequest = serde_json::from_str(line.trim_end_matches(['\n', '\r']))
            .map_err(|e| ProtoError::Malformed(e.to_string()))?;
        if request.v != VERSION {
            return Err(ProtoError::Version(request.v));
        }
        let ids_ok = match &request.op {
            ControlOp::Register {
                job_id,
                step_id,
                gpus,
                node,
                flex,
                ..
            } => {
                valid_job_id(job_id)
                    && valid_job_id(step_id)
                    && gpus.len() <= 1024
                    && node.len() <= 256
                    && flex.len() <= MAX_LINE_BYTES
            }
            ControlOp::EndStep { job_id, step_id } => valid_job_id(job_id) && valid_job_id(step_id),
            ControlOp::EndJob { job_id } => valid_job_id(job_id),
            ControlOp::Status => true,
        };
        if !ids_ok {
            return Err(ProtoError::BadJobId);
        }
        Ok(request)
    }
}

#[cfg(test)]
mod control_tests {
    use super::*;

    #[test]
    fn requests_round_trip_and_validate() {
        let r = ControlRequest::new(ControlOp::Register {
            job_id: "42".into(),
            step_id: "batch".into(),
            uid: 1000,
            node: "n1".into(),
            gpus: vec!["0".into(), "1".into()],
            flex: "flex2".into(),
        });
        assert_eq!(ControlRequest::from_line(&r.to_line()), Ok(r));
        let line = "{\"v\":1,\"op\":\"end-job\",\"job_id\":\"42\"}";
        assert_eq!(
            ControlRequest::from_line(line),
            Ok(ControlRequest::new(ControlOp::EndJob {
                job_id: "42".into()
            }))
        );
        assert!(matches!(
            ControlRequest::from_line("{\"v\":1,\"op\":\"reboot\"}"),
            Err(ProtoError::Malformed(_))
        ));
        assert_eq!(
            ControlRequest::from_line("{\"v\":1,\"op\":\"end-job\",\"job_id\":\"a b\"}"),
            Err(ProtoError::BadJobId)
        );
        let reply = ControlReply::error("nope");
        assert_eq!(ControlReply::from_line(&reply.to_line()), Ok(reply));
        // A busy node's status outgrows a request line; a reply may, up to its own limit.
        let long = ControlReply::error("x".repeat(3 * MAX_LINE_BYTES));
        assert_eq!(ControlReply::from_line(&long.to_line()), Ok(long));
        let huge = "x".repeat(MAX_REPLY_BYTES + 1);
        assert_eq!(
            ControlReply::from_line(&huge),
            Err(ProtoError::ReplyTooLong(MAX_REPLY_BYTES + 1))
        );
    }
}

#[cfg(test)]
mod reply_wire_tests {
    use super::*;

    const STATUS: &str = r#"{"node":"n1","mode":"standalone","failsafe":false,"degraded":false,"progress_rejected":0,"config_error":null,"cap_mismatches":0,"leases_applied":0,"controller_epoch":0,"leases_refused_epoch":0,"gpu_claims_refused":0,"enforce":true,"gpus":[],"jobs":[]}"#;
    const SHARE: &str = r#"{"job_id":"42","node":"n1","uid":1000,"tier":"flex2","gpus":[],"energy_mj":12000,"energy_source":"counter","from_unix_ms":1,"to_unix_ms":2,"peak_power_w":700.0,"observed_s":1.0,"capped_s":0.5,"event_s":0.0,"power_throttled_s":0.0,"throttle_known_s":1.0,"caps":[],"pfi":null,"ended":true}"#;

    /// Lines as agents of the current release write them, each with the typed reply it
    /// reads as: the typed form reads each and writes it back byte for byte.
    #[test]
    fn the_release_s_reply_lines_read_and_write_back_unchanged() {
        let status: status::AgentStatus = serde_json::from_str(STATUS).expect("status");
        let share: usage::NodeUsage = serde_json::from_str(SHARE).expect("share");
        let samples = [
            (
                r#"{"v":1,"ok":false,"error":"agent busy"}"#.to_string(),
                ControlReply::Refused("agent busy".into()),
            ),
            (r#"{"v":1,"ok":true}"#.to_string(), ControlReply::ok()),
            (
                r#"{"v":1,"ok":true,"progress":"/run/powerflex/n1.progress","tier":"flex2"}"#
                    .to_string(),
                ControlReply::Done(ControlAnswer::Registered {
                    tier: Some("flex2".into()),
                    progress: Some("/run/powerflex/n1.progress".into()),
                }),
            ),
            (
                r#"{"v":1,"ok":true,"tier":"none"}"#.to_string(),
                ControlReply::Done(ControlAnswer::Registered {
                    tier: Some("none".into()),
                    progress: None,
                }),
            ),
            (
                format!(r#"{{"v":1,"ok":true,"status":{STATUS}}}"#),
                ControlReply::Done(ControlAnswer::Status(Box::new(status))),
            ),
            (
                format!(r#"{{"v":1,"ok":true,"ended_share":{SHARE}}}"#),
                ControlReply::Done(ControlAnswer::StepEnded(Box::new(share))),
            ),
        ];
        for (line, typed) in samples {
            assert_eq!(ControlReply::from_line(&line), Ok(typed.clone()), "{line}");
            assert_eq!(typed.to_line(), format!("{line}\n"));
        }
    }

    #[test]
    fn a_reply_reads_as_the_older_plugin_read_it() {
        // Fields a newer agent adds are ignored; a refusal's payload is not an answer.
        let newer = ControlReply::from_line(r#"{"v":1,"ok":true,"later":[1]}"#);
        assert_eq!(newer, Ok(ControlReply::ok()));
        let refused =
            ControlReply::from_line(r#"{"v":1,"ok":false,"error":"no GPU 7","tier":"flex2"}"#)
                .expect("reads");
        assert_eq!(refused.error_message(), Some("no GPU 7"));
        assert_eq!(refused.tier(), None);
        // No reason given: the word the plugin has always shown.
        assert_eq!(
            ControlReply::from_line(r#"{"v":1,"ok":false}"#),
            Ok(ControlReply::error("refused"))
        );
        // Every release sends a version: a line without one is not a reply.
        assert!(matches!(
            ControlReply::from_line(r#"{"ok":true}"#),
            Err(ProtoError::Malformed(_))
        ));
        // Two operations' answers in one reply make no sense to anyone.
        let both = format!(r#"{{"v":1,"ok":true,"tier":"flex2","status":{STATUS}}}"#);
        assert!(matches!(
            ControlReply::from_line(&both),
            Err(ProtoError::Malformed(_))
        ));
    }
}

pub mod admin;
pub mod event;
#[cfg(feature = "link")]
pub mod link;
pub mod point;
pub mod report;
pub mod status;
pub mod usage;
