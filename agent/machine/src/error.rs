//! What the agent's machine refuses, and why. The messages go to the requester as they
//! are (the plugin's step, a reporting process, the admin's log and `status`), so each
//! names what was wrong and, where it helps, what to do.

use powerflex_core::flex::FlexError;
use powerflex_core::gpus::{GpuListError, GpuRef};

/// A refusal of the agent's machine.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum MachineError {
    /// The site config has no `[gpu_models.*]` section for the node's GPUs.
    #[error("no [gpu_models.*] section matches the GPU \"{gpu}\"; the config has: {}", .models.join(", "))]
    NoGpuModel { gpu: String, models: Vec<String> },
    /// The site config could not be read or taken (the edge's words: the file, and what
    /// was wrong in it).
    #[error("{0}")]
    SiteConfig(String),
    /// A reload would switch between standalone and controller mode.
    #[error(
        "switching between standalone (agent.node_budget_w) and controller mode needs a restart"
    )]
    ModeSwitchNeedsRestart,
    /// A registration for another node (the plugin's `socket=` points at the wrong agent).
    #[error("this agent serves node {serves}, not {asked}; check the plugin's socket= argument")]
    WrongNode { serves: String, asked: String },
    /// A registration's `--power-flex` value.
    #[error(transparent)]
    Flex(#[from] FlexError),
    /// A registration's GPU list.
    #[error(transparent)]
    GpuList(#[from] GpuListError),
    /// A registration names a GPU this node does not have.
    #[error("no GPU {gpu} on node {node}")]
    NoSuchGpu { gpu: GpuRef, node: String },
    /// A registration names a GPU another running job holds.
    #[error(
        "GPU {gpu} belongs to running job {owner}; a step may register only the GPUs Slurm gave it"
    )]
    GpuOfRunningJob { gpu: u32, owner: String },
    /// A step end or a progress report names a job this agent does not know.
    #[error("no job {0} on this node")]
    NoSuchJob(String),
    /// A progress report from a user other than the job's owner (or root).
    #[error("uid {uid} may not report for job {job_id} (owned by uid {owner})")]
    NotJobOwner {
        uid: u32,
        job_id: String,
        owner: u32,
    },
    /// A progress report from a step of another Slurm cluster than the job's step daemons
    /// (`cluster`: the reporter's; `None` for the default config).
    #[error("process {pid} runs in job {step_job} of another Slurm cluster ({}) than this node's job {job_id}", .cluster.as_deref().unwrap_or("the default config"))]
    OtherCluster {
        pid: u32,
        step_job: String,
        cluster: Option<String>,
        job_id: String,
    },
}
