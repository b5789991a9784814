//! The agent's persisted state: what must survive a crash or restart — every GPU's saved
//! default limit, and the live jobs (so a restarted agent can tell which GPUs still
//! belong to a job and which must go back to their default). Written atomically
//! (temporary file, then rename); a corrupt or truncated file is reported and set
//! aside, never trusted.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use crate::procs::ProcTable;
use serde::{Deserialize, Serialize};

use powerflex_core::Watts;
use powerflex_daemon::fsx::{write_atomic, AtomicWrite};

/// File name inside the state directory.
pub const STATE_FILE: &str = "agent-state.json";

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
    /// The calibrated points, [per-GPU cap W, job power W, throughput], so a restarted
    /// agent hands the controller the same curve (without them it would plan on a prior
    /// and could mispredict the job's draw). Absent in files from older agents.
    #[serde(default)]
    pub points: Vec<[f64; 3]>,
    /// Whether the job was registered by a step daemon, and that daemon's cluster
    /// (`SLURM_CONF`): what tells it apart from jobs of the same id of other clusters on
    /// the host. Absent in files from older agents (then unknown).
    #[serde(default)]
    pub from_stepd: bool,
    #[serde(default)]
    pub cluster: Option<String>,
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

/// Why the state could not be read or written.
#[derive(Debug, thiserror::Error)]
pub enum PersistError {
    #[error("{path}: {source}")]
    Io {
        path: String,
        #[source]
        source: std::io::Error,
    },
    #[error("{0}")]
    Write(powerflex_daemon::DaemonError),
    #[error("{path} is corrupt ({message}); moved aside to {moved}")]
    Corrupt {
        path: String,
        message: String,
        moved: String,
    },
}

pub fn state_path(dir: &Path) -> PathBuf {
    dir.join(STATE_FILE)
}

/// Loads the state; `Ok(None)` when there is none yet. A file that does not parse is
/// renamed to `*.corrupt` and reported, so the agent starts from what NVML says.
pub fn load(dir: &Path) -> Result<Option<PersistedState>, PersistError> {
    let path = state_path(dir);
    let bytes = match std::fs::read(&path) {
        Ok(b) => b,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(source) => {
            return Err(PersistError::Io {
                path: path.display().to_string(),
                source,
            })
        }
    };
    match serde_json::from_slice::<PersistedState>(&bytes) {
        Ok(state) => Ok(Some(state)),
        Err(e) => {
            let moved = path.with_extension("json.corrupt");
            let _ = std::fs::rename(&path, &moved);
            Err(PersistError::Corrupt {
                path: path.display().to_string(),
                message: e.to_string(),
                moved: moved.display().to_string(),
            })
        }
    }
}

/// Saves the state atomically.
pub fn save(dir: &Path, state: &PersistedState) -> Result<(), PersistError> {
    std::fs::create_dir_all(dir).map_err(|source| PersistError::Io {
        path: dir.display().to_string(),
        source,
    })?;
    let bytes = serde_json::to_vec_pretty(state).unwrap_or_default();
    // No fsync: the state must survive the agent's crash (the page cache does), not the
    // node's — a rebooted node's GPUs come back at their defaults anyway. An fsync here
    // sat on the registration path of every job step. Root-only: it names jobs and uids.
    let how = AtomicWrite::fast().with_mode(0o600);
    write_atomic(&state_path(dir), &bytes, how).map_err(PersistError::Write)
}

/// Whether any process on this host belongs to Slurm job `job_id` (its environment has
/// `SLURM_JOB_ID=<job_id>`). Used after a restart to tell live jobs from ended ones,
/// and to check who sends progress. Needs root to read other users' environments.
pub fn job_has_process(job_id: &str) -> bool {
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return false;
    };
    entries
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<u32>().ok())
        .any(|pid| process_job_id(pid).as_deref() == Some(job_id))
}

/// The `SLURM_JOB_ID` in process `pid`'s environment, if readable.
pub fn process_job_id(pid: u32) -> Option<String> {
    let environ = std::fs::read(format!("/proc/{pid}/environ")).ok()?;
    environ
        .split(|&b| b == 0)
        .find_map(|var| var.strip_prefix(b"SLURM_JOB_ID="))
        .map(|v| String::from_utf8_lossy(v).into_owned())
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RunningJob {
    pub job_id: String,
    /// The cluster of its step daemons (their `SLURM_CONF`).
    pub cluster: Option<String>,
    pub uid: u32,
    /// The GPUs its processes run on, by index (from NVML, not from any variable).
    pub gpus: Vec<String>,
    /// Its `--power-flex` service as the plugin exported it into its tasks
    /// (`POWERFLEX_TIER`).
    pub flex: String,
}

/// What the agent reads of a process to take its job back: its uid and the
/// `POWERFLEX_TIER` the plugin put in its environment (absent: an unmanaged job).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ProcessFacts {
    pub uid: u32,
    pub tier: Option<String>,
}

/// Managed jobs running on this node's GPUs, for an agent that lost its state file: it
/// takes them back rather than release their caps and break the site's budget.
///
/// Nothing here is taken from what a job's user can write, except the tier the job
/// was submitted with: the GPUs are the ones NVML lists the job's processes on
/// (`gpu_pids`), and a process belongs to a job only through its root-owned
/// `slurmstepd` ancestor (`table`). A process with a forged `SLURM_JOB_ID`, or on no
/// GPU of this node, takes nothing back. `facts` reads a process's uid and tier.
pub fn running_managed_jobs(
    table: &ProcTable,
    gpu_pids: &BTreeMap<u32, Vec<u32>>,
    facts: impl Fn(u32) -> Option<ProcessFacts>,
) -> Vec<RunningJob> {
    let mut jobs: Vec<RunningJob> = Vec::new();
    for (&gpu, pids) in gpu_pids {
        for &pid in pids {
            let Some(step) = table.step_of(pid) else {
                continue;
            };
            let Some(ProcessFacts {
                uid,
                tier: Some(flex),
            }) = facts(pid)
            else {
                continue;
            };
            let job = match jobs
                .iter_mut()
                .find(|j| j.job_id == step.job && j.cluster == step.cluster)
            {
                Some(j) => j,
                None => {
                    jobs.push(RunningJob {
                        job_id: step.job.clone(),
                        cluster: step.cluster.clone(),
                        uid,
                        gpus: Vec::new(),
                        flex,
                    });
                    let last = jobs.len() - 1;
                    &mut jobs[last]
                }
            };
            let index = gpu.to_string();
            if !job.gpus.contains(&index) {
                job.gpus.push(index);
            }
        }
    }
    jobs
}

/// [`ProcessFacts`] of `pid` from `/proc` (needs root for other users' processes).
pub fn process_facts(pid: u32) -> Option<ProcessFacts> {
    use std::os::unix::fs::MetadataExt;
    let uid = std::fs::metadata(format!("/proc/{pid}")).ok()?.uid();
    let environ = std::fs::read(format!("/proc/{pid}/environ")).ok()?;
    let tier = environ
        .split(|&b| b == 0)
        .find_map(|var| var.strip_prefix(b"POWERFLEX_TIER="))
        .map(|v| String::from_utf8_lossy(v).into_owned());
    Some(ProcessFacts { uid, tier })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip_and_corruption() {
        let dir = std::env::temp_dir().join(format!("pf-persist-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        assert!(load(&dir).expect("empty").is_none());
        let mut state = PersistedState {
            node: "n1".into(),
            ..Default::default()
        };
        state.saved_defaults.insert("GPU-1".into(), Watts(700.0));
        state.jobs.push(PersistedJob {
            job_id: "7".into(),
            uid: 1000,
            flex: "flex2".into(),
            gpus: vec!["GPU-1".into()],
            steps: vec!["0".into()],
            pfi: Some(1.4),
            points: vec![[700.0, 2650.3, 1000.0], [500.0, 1988.7, 912.5]],
            from_stepd: true,
            cluster: Some("/etc/slurm/slurm.conf".into()),
        });
        save(&dir, &state).expect("save");
        assert_eq!(load(&dir).expect("load"), Some(state));
        // A file from an agent that did not save points still loads.
        std::fs::write(
            state_path(&dir),
            br#"{"node":"n1","saved_defaults":{},"jobs":[{"job_id":"7","uid":0,"flex":"flex1","gpus":[],"steps":[],"pfi":null}]}"#,
        )
        .expect("write");
        let old = load(&dir).expect("load").expect("state");
        assert!(old.jobs[0].points.is_empty());
        std::fs::write(state_path(&dir), b"{\"node\": \"n1\", \"saved_def").expect("truncate");
        assert!(matches!(load(&dir), Err(PersistError::Corrupt { .. })));
        assert!(load(&dir).expect("moved aside").is_none());
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn finds_its_own_job_id() {
        // This test process has no SLURM_JOB_ID (cargo does not set one).
        assert_eq!(
            process_job_id(std::process::id()),
            std::env::var("SLURM_JOB_ID").ok()
        );
    }

    /// Issue 14: the agent adopted any process whose environment held SLURM_JOB_ID,
    /// POWERFLEX_TIER, SLURMD_NODENAME and a GPU list; a `sleep` with a forged
    /// environment became job 666 and took another job's GPUs.
    #[test]
    fn only_processes_of_real_steps_on_this_nodes_gpus_are_taken_back() {
        use crate::procs::ProcEntry;
        let stepd = |pid, title: &str, conf: &str| ProcEntry {
            pid,
            ppid: 1,
            uid: 0,
            title: title.into(),
            exe_is_slurmstepd: true,
            slurm_conf: Some(conf.into()),
        };
        let user = |pid, ppid, title: &str| ProcEntry {
            pid,
            ppid,
            uid: 1000,
            title: title.into(),
            exe_is_slurmstepd: false,
            slurm_conf: None,
        };
        let table = ProcTable::from_entries([
            stepd(100, "slurmstepd: [901.0]", "/c/slurm.conf"),
            user(101, 100, "train rank 0"),
            user(102, 100, "train rank 1"),
            stepd(200, "slurmstepd: [902.0]", "/c/slurm.conf"),
            user(201, 200, "unmanaged job"),
            // Forged: a user's process claiming job 666 in its environment, and a user
            // process titled like a step daemon.
            user(300, 1, "sleep 1000"),
            user(400, 1, "slurmstepd: [667.0]"),
            user(401, 400, "sleep 1000"),
        ]);
        let gpu_pids = BTreeMap::from([
            (1, vec![101]),
            (3, vec![101, 102]),
            (4, vec![201]),
            (5, vec![300]),
            (6, vec![401]),
        ]);
        let facts = |pid: u32| {
            Some(ProcessFacts {
                uid: 1000,
                tier: match pid {
                    201 => None,
                    _ => Some("flex2".into()),
                },
            })
        };
        let found = running_managed_jobs(&table, &gpu_pids, facts);
        assert_eq!(
            found,
            vec![RunningJob {
                job_id: "901".into(),
                cluster: Some("/c/slurm.conf".into()),
                uid: 1000,
                gpus: vec!["1".into(), "3".into()],
                flex: "flex2".into(),
            }]
        );
    }
}
