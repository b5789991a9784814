//! Simulated GPUs for powerflex's development, CI and demo. Everything here is SIMULATED.
//!
//! We simulate the *driver*, not our own code: the `powerflex-sim-nvml` library exports the
//! NVML C functions on top of this crate, so the agent runs the same `nvml-wrapper` code path
//! in tests as on real H200s. This crate holds what that library and the tools around it
//! share:
//! - [`state`]: one node's GPUs as files in a state directory (`POWERFLEX_SIM_DIR`, `%n` =
//!   Slurm node name, since `slurmd -N` nodes share a host), safe for concurrent readers and
//!   writers in different processes (atomic rename; `flock` around read-modify-write);
//! - [`models`]: device models (H200 SXM, H100 SXM) with NVML's units and limits;
//! - [`steplog`]: the CSV step log of `powerflex-simjob`, read by the demo;
//! - [`profiles`]: the workload library — one profile per job of the paper's table, fitted
//!   to its PFI, plus a compute-bound and a memory-bound synthetic one;

//!
//! Physics (`powerflex_core::workload::Physics`): a busy GPU draws its workload's demand at
//! the current cap, never above the limit; under a cap the SM clock falls and the memory
//! clock stays; energy integrates power over real elapsed time.

pub mod models;
pub mod profiles;
pub mod state;
pub mod steplog;

/// Errors of the simulator. Each maps to the NVML return code a real driver would give.
#[derive(Debug, thiserror::Error)]
pub enum SimError {
    #[error("POWERFLEX_SIM_DIR is not set; point it at a simulated node's state directory (made by `powerflex-sim init`)")]
    NoStateDir,
    #[error("POWERFLEX_SIM_DIR contains %n but SLURMD_NODENAME is not set")]
    NoNodeName,
    #[error(
        "{path}: not a simulated node (run `powerflex-sim init --dir {path}` first): {source}"
    )]
    NotANode {
        path: String,
        #[source]
        source: std::io::Error,
    },
    #[error("{path}: {message}")]
    Corrupt { path: String, message: String },
    #[error(transparent)]
    Plumbing(#[from] powerflex_daemon::DaemonError),
    #[error("{path}: {source}")]
    Io {
        path: String,
        #[source]
        source: std::io::Error,
    },
    #[error("no GPU with index {index}; this node has {count}")]
    NoSuchGpu { index: u32, count: u32 },
    #[error("no GPU with UUID {0} on this node")]
    NoSuchUuid(String),
    #[error("unknown device model \"{0}\"; known: {known}", known = models::known_names())]
    UnknownModel(String),
    #[error("power limit {requested_mw} mW is outside {min_mw}..={max_mw} mW")]
    LimitOutOfRange {
        requested_mw: u32,
        min_mw: u32,
        max_mw: u32,
    },
    #[error("setting a power limit needs root")]
    NoPermission,
    #[error("injected fault on GPU {index}: {fault:?}")]
    Fault { index: u32, fault: state::Fault },
    #[error("{path} already holds a simulated node; use --force to recreate it")]
    Exists { path: String },
    #[error("GPU {index} is claimed by job {job_id} (pid {pid})")]
    Busy {
        index: u32,
        job_id: String,
        pid: u32,
    },
}
