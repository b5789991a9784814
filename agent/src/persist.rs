//! The agent's persisted state: what must survive a crash or restart — every GPU's saved
//! default limit, and the live jobs (so a restarted agent can tell which GPUs still
//! belong to a job and which must go back to their default). Written atomically
//! (temporary file, then rename); a corrupt or truncated file is reported and set
//! aside, never trusted.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use crate::procs::ProcTable;

use powerflex_daemon::fsx::{write_atomic, AtomicWrite};

/// File name inside the state directory.
pub const STATE_FILE: &str = "agent-state.json";

// The state file's contents are the machine's data (it builds them and restores from
// them); reading and writing the file is this module's.
use powerflex_agent_machine::saved::PersistedState;

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

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RunningJob {
    pub job_id: String,
    /// The cluster of its step daemons (their `SLURM_CONF`).
    pub cluster: Option<String>,
    /// The owner of its processes, as the kernel records it.
    pub uid: u32,
    /// The GPUs its processes run on, by index (from NVML, not from any variable).
    pub gpus: Vec<String>,
}

/// Jobs running on this node's GPUs, for an agent that lost its state file: it takes
/// them back rather than release their caps and break the site's budget.
///
/// Nothing here is taken from what a job's user can write: the GPUs are the ones NVML
/// lists the job's processes on (`gpu_pids`), a process belongs to a job only through
/// its root-owned `slurmstepd` ancestor (`table`), and `uid_of` reads a process's owner
/// from the kernel. A process with a forged `SLURM_JOB_ID`, or on no GPU of this node,
/// takes nothing back. The tier is not read here at all: the job's environment could
/// name any; it comes from Slurm's record ([`powerflex_core::slurm_record::recorded_tier`]).
pub fn running_jobs(
    table: &ProcTable,
    gpu_pids: &BTreeMap<u32, Vec<u32>>,
    uid_of: impl Fn(u32) -> Option<u32>,
) -> Vec<RunningJob> {
    let mut jobs: Vec<RunningJob> = Vec::new();
    for (&gpu, pids) in gpu_pids {
        for &pid in pids {
            let Some(step) = table.step_of(pid) else {
                continue;
            };
            let Some(uid) = table.get(pid).map(|p| p.uid).or_else(|| uid_of(pid)) else {
                continue;
            };
            let index = gpu.to_string();
            match jobs
                .iter_mut()
                .find(|j| j.job_id == step.job && j.cluster == step.cluster)
            {
                Some(j) if !j.gpus.contains(&index) => j.gpus.push(index),
                Some(_) => {}
                None => jobs.push(RunningJob {
                    job_id: step.job.clone(),
                    cluster: step.cluster.clone(),
                    uid,
                    gpus: vec![index],
                }),
            }
        }
    }
    jobs
}

/// Slurm's record of every job, from `squeue --json` run with a cluster's `SLURM_CONF`
/// (`cluster`), waiting at most `deadline`; read once per cluster when the agent takes
/// jobs back (Slurm 22.05's `squeue --json` ignores job filters). `None` when Slurm
/// cannot be asked in time or its answer is not understood (logged).
pub fn slurm_jobs(
    cluster: &Option<String>,
    deadline: std::time::Duration,
) -> Option<powerflex_core::slurm_record::SlurmJobs> {
    use powerflex_core::slurm_record::{self, MAX_SLURM_OUTPUT_BYTES};
    let envs: Vec<(&str, &str)> = cluster
        .as_deref()
        .map(|conf| vec![("SLURM_CONF", conf)])
        .unwrap_or_default();
    let read = powerflex_daemon::command::output_within(
        "squeue",
        &["--json"],
        &envs,
        deadline,
        MAX_SLURM_OUTPUT_BYTES,
    )
    .map_err(|e| e.to_string())
    .and_then(|out| slurm_record::parse_squeue_json(&out).map_err(|e| e.to_string()));
    match read {
        Ok(jobs) => Some(jobs),
        Err(e) => {
            tracing::warn!(error = %e, "cannot read Slurm's record of the jobs; none is taken back without it");
            None
        }
    }
}

/// The uid owning process `pid` (`/proc/PID`'s owner, set by the kernel).
pub fn process_uid(pid: u32) -> Option<u32> {
    use std::os::unix::fs::MetadataExt;
    std::fs::metadata(format!("/proc/{pid}"))
        .ok()
        .map(|m| m.uid())
}

#[cfg(test)]
mod tests {
    use super::*;
    use powerflex_agent_machine::saved::PersistedJob;
    use powerflex_core::Watts;

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
            points: [[700.0, 2650.3, 1000.0], [500.0, 1988.7, 912.5]]
                .map(powerflex_proto::point::from_array)
                .to_vec(),
            from_stepd: true,
            cluster: Some("/etc/slurm/slurm.conf".into()),
            usage: Some({
                let mut u = powerflex_agent_machine::usage::JobUsage::default();
                u.gpu_reading("GPU-1", 0, 1_000, Some(12_345), Watts(500.0));
                u.gpu_reading("GPU-1", 0, 2_000, Some(512_345), Watts(500.0));
                u
            }),
        });
        // A final share the controller has not acknowledged survives the restart.
        let share = state.jobs[0].usage.as_ref().expect("usage").share(
            "6", "n1", 1000, "flex2", None, None, None, None, true, false,
        );
        state
            .unacked_finals
            .push(powerflex_agent_machine::saved::UnackedFinal {
                ended_unix_ms: 3_000,
                share,
            });
        save(&dir, &state).expect("save");
        assert_eq!(load(&dir).expect("load"), Some(state));
        // It names jobs and their owners: root's to read only.
        use std::os::unix::fs::PermissionsExt;
        let mode = std::fs::metadata(state_path(&dir))
            .expect("meta")
            .permissions()
            .mode();
        assert_eq!(mode & 0o777, 0o600);
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

    /// Only processes of real steps are taken back, never by their environment: a
    /// `sleep` whose forged environment holds SLURM_JOB_ID, POWERFLEX_TIER,
    /// SLURMD_NODENAME and a GPU list must not become job 666 and take another job's
    /// GPUs.
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
        let found = running_jobs(&table, &gpu_pids, |_| None);
        let job = |id: &str, gpus: &[&str]| RunningJob {
            job_id: id.into(),
            cluster: Some("/c/slurm.conf".into()),
            uid: 1000,
            gpus: gpus.iter().map(|g| g.to_string()).collect(),
        };
        // Job 902 runs with no POWERFLEX_TIER: whether a job is managed is not the
        // environment's to say either (deleting the variable would uncap it).
        assert_eq!(found, vec![job("901", &["1", "3"]), job("902", &["4"])]);
    }
}
