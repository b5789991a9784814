//! The agent's persisted state: what must survive a crash or restart — every GPU's saved
//! default limit, and the live jobs (so a restarted agent can tell which GPUs still
//! belong to a job and which must go back to their default). Written atomically
//! (temporary file, then rename); a corrupt or truncated file is reported and set
//! aside, never trusted.

use std::collections::BTreeMap;
use std::io::Write;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use powerflex_core::Watts;

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
    let io = |path: &Path| {
        let path = path.display().to_string();
        move |source| PersistError::Io { path, source }
    };
    std::fs::create_dir_all(dir).map_err(io(dir))?;
    let path = state_path(dir);
    let tmp = dir.join(format!("{STATE_FILE}.tmp"));
    let bytes = serde_json::to_vec_pretty(state).unwrap_or_default();
    let mut file = std::fs::File::create(&tmp).map_err(io(&tmp))?;
    file.write_all(&bytes).map_err(io(&tmp))?;
    // No fsync: the state must survive the agent's crash (the page cache does), not the
    // node's — a rebooted node's GPUs come back at their defaults anyway. An fsync here
    // sat on the registration path of every job step.
    std::fs::rename(&tmp, &path).map_err(io(&path))
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

/// A managed job found running on this node's GPUs by its processes' environments.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RunningJob {
    pub job_id: String,
    pub uid: u32,
    /// The GPUs its processes name (indices or UUIDs), deduplicated.
    pub gpus: Vec<String>,
    /// Its `--power-flex` service as the plugin exported it (`POWERFLEX_TIER`).
    pub flex: String,
}

/// Managed jobs with processes on `node`, from `/proc/<pid>/environ`: a process counts
/// when it has `SLURM_JOB_ID`, `SLURMD_NODENAME=node` (several `slurmd -N` may share a
/// host), `POWERFLEX_TIER` (set by the plugin for managed steps only) and a GPU list.
/// Lets an agent that lost its state file take back the jobs still running, instead of
/// releasing their caps and breaking the site's budget. Needs root.
pub fn running_managed_jobs(node: &str) -> Vec<RunningJob> {
    use std::os::unix::fs::MetadataExt;
    let mut jobs: Vec<RunningJob> = Vec::new();
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return jobs;
    };
    for pid in entries
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<u32>().ok())
    {
        let Ok(environ) = std::fs::read(format!("/proc/{pid}/environ")) else {
            continue;
        };
        let vars: BTreeMap<&[u8], &[u8]> = environ
            .split(|&b| b == 0)
            .filter_map(|var| {
                let eq = var.iter().position(|&b| b == b'=')?;
                Some((&var[..eq], &var[eq + 1..]))
            })
            .collect();
        let text = |name: &str| {
            vars.get(name.as_bytes())
                .map(|v| String::from_utf8_lossy(v).into_owned())
        };
        let (Some(job_id), Some(flex)) = (text("SLURM_JOB_ID"), text("POWERFLEX_TIER")) else {
            continue;
        };
        if text("SLURMD_NODENAME").as_deref() != Some(node) {
            continue;
        }
        let Some(gpus) = powerflex_core::gpus::gpu_env_value(text) else {
            continue;
        };
        let Ok(uid) = std::fs::metadata(format!("/proc/{pid}")).map(|m| m.uid()) else {
            continue;
        };
        let job = match jobs.iter_mut().find(|j| j.job_id == job_id) {
            Some(j) => j,
            None => {
                jobs.push(RunningJob {
                    job_id,
                    uid,
                    gpus: Vec::new(),
                    flex,
                });
                jobs.last_mut().expect("just pushed")
            }
        };
        for g in gpus.split(',').map(str::trim).filter(|g| !g.is_empty()) {
            if !job.gpus.iter().any(|known| known == g) {
                job.gpus.push(g.to_string());
            }
        }
    }
    jobs
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

    #[test]
    fn running_managed_jobs_are_found_by_their_processes_environment() {
        let node = format!("pf-test-node-{}", std::process::id());
        let spawn = |job: &str, tier: Option<&str>, gpus: &str| {
            let mut c = std::process::Command::new("sleep");
            c.arg("30")
                .env("SLURM_JOB_ID", job)
                .env("SLURMD_NODENAME", &node)
                .env("SLURM_STEP_GPUS", gpus)
                .env("SLURM_JOB_GPUS", "7");
            if let Some(t) = tier {
                c.env("POWERFLEX_TIER", t);
            }
            c.spawn().expect("sleep")
        };
        let mut children = vec![
            spawn("901", Some("flex2"), "1,3"),
            spawn("901", Some("flex2"), "3,5"),
            spawn("902", None, "0"), // unmanaged: no POWERFLEX_TIER
        ];
        let found = running_managed_jobs(&node);
        for c in &mut children {
            let _ = c.kill();
            let _ = c.wait();
        }
        assert_eq!(found.len(), 1, "{found:?}");
        assert_eq!(found[0].job_id, "901");
        assert_eq!(found[0].flex, "flex2");
        assert_eq!(
            found[0].gpus,
            vec!["1", "3", "5"],
            "the step's GPUs, merged"
        );
        assert!(running_managed_jobs("no-such-node")
            .iter()
            .all(|j| j.job_id != "901"));
    }
}
