//! Which GPUs a job was given, as Slurm and CUDA name them: `SLURM_STEP_GPUS` /
//! `SLURM_JOB_GPUS` (global indices, `0,1`) or `CUDA_VISIBLE_DEVICES` (indices or UUIDs,
//! `GPU-8f6c…`). The plugin, the agent and the simulated job all read these; one parser
//! serves them.

use std::fmt;

/// One GPU as a job's environment names it.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum GpuRef {
    /// A device index.
    Index(u32),
    /// A device UUID (`GPU-…` or `MIG-…`), as NVML reports it.
    Uuid(String),
}

impl fmt::Display for GpuRef {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            GpuRef::Index(i) => write!(f, "{i}"),
            GpuRef::Uuid(u) => f.write_str(u),
        }
    }
}

/// Most GPUs one list may name: well above any node, low enough to bound the work.
pub const MAX_GPUS: usize = 1024;

/// What is wrong with a GPU list.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum GpuListError {
    #[error("GPU list entry {position} (\"{text}\") is neither an index nor a GPU-/MIG- UUID")]
    BadEntry { position: usize, text: String },
    #[error("GPU list names more than {MAX_GPUS} GPUs")]
    TooMany,
}

/// Parses a comma-separated GPU list. Empty entries are skipped (Slurm writes none, but
/// hand-made environments do); duplicates are kept once, in first-seen order. `NoDevFiles`
/// (what CUDA is told when a job has no GPU) gives an empty list.
pub fn parse_gpu_list(text: &str) -> Result<Vec<GpuRef>, GpuListError> {
    let mut out: Vec<GpuRef> = Vec::new();
    let trimmed = text.trim();
    if trimmed.is_empty() || trimmed == "NoDevFiles" {
        return Ok(out);
    }
    for (position, entry) in trimmed.split(',').map(str::trim).enumerate() {
        if entry.is_empty() {
            continue;
        }
        let gpu = if let Ok(index) = entry.parse::<u32>() {
            GpuRef::Index(index)
        } else if (entry.starts_with("GPU-") || entry.starts_with("MIG-"))
            && entry.len() <= 96
            && entry[4..]
                .chars()
                .all(|c| c.is_ascii_hexdigit() || c == '-' || c == '/')
            && entry.len() > 4
        {
            GpuRef::Uuid(entry.to_string())
        } else {
            return Err(GpuListError::BadEntry {
                position: position + 1,
                text: entry
                    .chars()
                    .take(40)
                    .flat_map(char::escape_default)
                    .collect(),
            });
        };
        if !out.contains(&gpu) {
            if out.len() == MAX_GPUS {
                return Err(GpuListError::TooMany);
            }
            out.push(gpu);
        }
    }
    Ok(out)
}

/// Where a step's environment names its GPUs on this node, most specific first.
///
/// `SLURM_STEP_GPUS` is this step's GPUs on this node. `SLURM_JOB_GPUS` is right for the
/// batch and extern steps, but a multi-node job's `srun` steps inherit it from the batch
/// node, where it names *that* node's GPUs (seen with slurm-wlm 22.05: on the second node
/// `SLURM_JOB_GPUS=2,3` while `SLURM_STEP_GPUS=0,1`). `CUDA_VISIBLE_DEVICES` comes last:
/// with `ConstrainDevices=yes` it is renumbered from 0 inside the job's cgroup.
pub const GPU_ENV_VARS: [&str; 3] = ["SLURM_STEP_GPUS", "SLURM_JOB_GPUS", "CUDA_VISIBLE_DEVICES"];

/// The first non-empty value of [`GPU_ENV_VARS`]; `lookup` reads a variable
/// (`std::env::var` in production, spank_getenv in the plugin, a map in tests).
pub fn gpu_env_value(lookup: impl Fn(&str) -> Option<String>) -> Option<String> {
    GPU_ENV_VARS
        .iter()
        .filter_map(|name| lookup(name))
        .find(|value| !value.trim().is_empty())
}

/// The job's GPUs on this node from its environment (see [`GPU_ENV_VARS`]).
pub fn job_gpus_from_env(
    lookup: impl Fn(&str) -> Option<String>,
) -> Result<Vec<GpuRef>, GpuListError> {
    match gpu_env_value(lookup) {
        Some(value) => parse_gpu_list(&value),
        None => Ok(Vec::new()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_indices_and_uuids() {
        assert_eq!(
            parse_gpu_list("0,1, 3"),
            Ok(vec![GpuRef::Index(0), GpuRef::Index(1), GpuRef::Index(3)])
        );
        let uuid = "GPU-8f6c2a1b-0001-4d2e-9a7b-0123456789ab";
        assert_eq!(
            parse_gpu_list(&format!("{uuid},2")),
            Ok(vec![GpuRef::Uuid(uuid.into()), GpuRef::Index(2)])
        );
        assert_eq!(parse_gpu_list(""), Ok(vec![]));
        assert_eq!(parse_gpu_list("NoDevFiles"), Ok(vec![]));
        assert_eq!(
            parse_gpu_list("1,1,,2"),
            Ok(vec![GpuRef::Index(1), GpuRef::Index(2)])
        );
    }

    #[test]
    fn rejects_junk() {
        assert_eq!(
            parse_gpu_list("0,gpu1"),
            Err(GpuListError::BadEntry {
                position: 2,
                text: "gpu1".into()
            })
        );
        assert!(matches!(
            parse_gpu_list("-1"),
            Err(GpuListError::BadEntry { .. })
        ));
        assert!(matches!(
            parse_gpu_list("GPU-"),
            Err(GpuListError::BadEntry { .. })
        ));
        assert!(matches!(
            parse_gpu_list("GPU-zz"),
            Err(GpuListError::BadEntry { .. })
        ));
        let many: Vec<String> = (0..2000).map(|i| i.to_string()).collect();
        assert_eq!(parse_gpu_list(&many.join(",")), Err(GpuListError::TooMany));
    }

    #[test]
    fn slurm_job_gpus_wins_over_cuda_visible_devices() {
        let env = |name: &str| match name {
            "SLURM_JOB_GPUS" => Some("4,5".to_string()),
            "CUDA_VISIBLE_DEVICES" => Some("0,1".to_string()),
            _ => None,
        };
        assert_eq!(
            job_gpus_from_env(env),
            Ok(vec![GpuRef::Index(4), GpuRef::Index(5)])
        );
        let cuda_only = |name: &str| (name == "CUDA_VISIBLE_DEVICES").then(|| "1".to_string());
        assert_eq!(job_gpus_from_env(cuda_only), Ok(vec![GpuRef::Index(1)]));
        assert_eq!(job_gpus_from_env(|_| None), Ok(vec![]));
    }

    #[test]
    fn a_steps_own_gpus_win_over_the_batch_nodes() {
        // The second node of a multi-node job: SLURM_JOB_GPUS is the batch node's.
        let env = |name: &str| match name {
            "SLURM_STEP_GPUS" => Some("0,1".to_string()),
            "SLURM_JOB_GPUS" => Some("2,3".to_string()),
            "CUDA_VISIBLE_DEVICES" => Some("0,1".to_string()),
            _ => None,
        };
        assert_eq!(
            job_gpus_from_env(env),
            Ok(vec![GpuRef::Index(0), GpuRef::Index(1)])
        );
        let empty_step = |name: &str| match name {
            "SLURM_STEP_GPUS" => Some(String::new()),
            "SLURM_JOB_GPUS" => Some("2,3".to_string()),
            _ => None,
        };
        assert_eq!(gpu_env_value(empty_step).as_deref(), Some("2,3"));
    }
}
