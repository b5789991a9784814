//! What the agent keeps across a restart, as data: the GPUs' saved defaults, the jobs it
//! manages (with their curves and accounting), the controller's last lease and the final
//! shares not yet acknowledged. The machine hands it out to save
//! ([`crate::control::AgentOutput::persist`]) and restores from it at its start
//! ([`crate::control::StartFacts::saved`]); the agent's edge writes and reads the file
//! (atomically, mode 0600).

use std::collections::BTreeMap;

use powerflex_core::point::OperatingPoint;
use powerflex_core::Watts;
use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PersistedJob {
    pub job_id: String,
    pub uid: u32,
    /// The job's service in `--power-flex` form.
    pub flex: String,
    /// GPU UUIDs (stable across agent restarts, unlike nothing else).
    pub gpus: Vec<String>,
    pub steps: Vec<String>,
    /// PFI measured by the calibration, when done.
    pub pfi: Option<f64>,
    /// The calibrated points, so a restarted agent hands the controller the same curve
    /// (without them it would plan on a prior and could mispredict the job's draw). Saved
    /// as the `[cap W, power W, throughput]` arrays every release reads
    /// ([`powerflex_proto::point`]). Absent in files from older agents.
    #[serde(default, with = "powerflex_proto::point::arrays")]
    pub points: Vec<OperatingPoint>,
    /// Whether the job was registered by a step daemon, and that daemon's cluster
    /// (`SLURM_CONF`): what tells it apart from jobs of the same id of other clusters on
    /// the host. Absent in files from older agents (then unknown).
    #[serde(default)]
    pub from_stepd: bool,
    #[serde(default)]
    pub cluster: Option<String>,
    /// The job's accounting so far (energy counters at the hold's start, time shares),
    /// so a restart loses none of it. Absent in files from older agents.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub usage: Option<crate::usage::JobUsage>,
}

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PersistedState {
    pub node: String,
    /// GPU UUID → the limit to restore, W.
    pub saved_defaults: BTreeMap<String, Watts>,
    pub jobs: Vec<PersistedJob>,
    /// The controller's last lease, so a restarted agent keeps its jobs at the granted
    /// caps until the next lease instead of raising them to the default (which would put
    /// the site over budget). Absent in files from older agents.
    #[serde(default)]
    pub lease: Option<PersistedLease>,
    /// Final shares of ended jobs the controller has not acknowledged yet, so a restart
    /// re-sends them rather than losing them. Absent in files from older agents.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub unacked_finals: Vec<UnackedFinal>,
    /// The highest controller leadership epoch a lease was accepted from: a restarted
    /// agent still refuses the leases of a controller that lost leadership.
    /// Absent in files from older agents and under a single controller (0).
    #[serde(default, skip_serializing_if = "is_zero")]
    pub controller_epoch: u64,
    /// GPU UUID → the limit it is counted at, for each GPU another power manager holds
    /// lower than the agent (`GpuSlot::owned_elsewhere`): a restarted agent leaves
    /// it alone rather than fight it three times more. Absent in files from older agents,
    /// and when no GPU is held elsewhere (an older agent refuses a file that has it).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub owned_elsewhere: BTreeMap<String, Watts>,
}

fn is_zero(n: &u64) -> bool {
    *n == 0
}

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PersistedLease {
    /// Job → per-GPU cap.
    pub caps: BTreeMap<String, Watts>,
    /// Wall-clock expiry, seconds since the Unix epoch.
    pub expires_unix_s: f64,
    /// Per-GPU cap for a job the lease does not name. Absent in older files.
    #[serde(default)]
    pub start_cap_w: Option<f64>,
}

/// A job's final share on this node that the controller has not acknowledged yet:
/// kept in the state file, re-sent in every report (in turns, see
/// `powerflex_proto::report::MAX_ENDED_PER_REPORT`) until acknowledged.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct UnackedFinal {
    /// When the job ended here, Unix ms.
    pub ended_unix_ms: u64,
    pub share: powerflex_proto::usage::NodeUsage,
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A job as the current release saves it: the next reads it, and writes the same.
    #[test]
    fn a_saved_job_s_points_read_and_write_as_the_release_s_arrays() {
        let line = r#"{"job_id":"42","uid":1000,"flex":"flex2","gpus":["GPU-a"],"steps":["0"],"pfi":1.4,"points":[[700.0,1300.0,5200.5],[400.0,790.0,4100.0]],"from_stepd":true,"cluster":null}"#;
        let job: PersistedJob = serde_json::from_str(line).expect("reads");
        assert_eq!(
            job.points,
            [
                OperatingPoint {
                    cap_w: Watts(700.0),
                    power_w: Watts(1300.0),
                    throughput: 5200.5
                },
                OperatingPoint {
                    cap_w: Watts(400.0),
                    power_w: Watts(790.0),
                    throughput: 4100.0
                }
            ]
        );
        assert_eq!(serde_json::to_string(&job).expect("writes"), line);
        // A file from before points were saved reads with none.
        let older = r#"{"job_id":"42","uid":1000,"flex":"flex2","gpus":[],"steps":[],"pfi":null}"#;
        let job: PersistedJob = serde_json::from_str(older).expect("reads");
        assert!(job.points.is_empty());
    }
}
