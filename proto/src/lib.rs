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

/// Why a line is not a valid message.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ProtoError {
    #[error("message of {0} bytes exceeds the {MAX_LINE_BYTES}-byte limit")]
    TooLong(usize),
    #[error("malformed message: {0}")]
    Malformed(String),
    #[error("unsupported protocol version {0}; this agent speaks version {VERSION}")]
    Version(u32),
    #[error("job_id must be 1-64 characters of digits, letters, '_' or '.'")]
    BadJobId,
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
        let id_ok = !report.job_id.is_empty()
            && report.job_id.len() <= 64
            && report
                .job_id
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '.');
        if !id_ok {
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
