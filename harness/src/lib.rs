//! A deterministic site harness, in the manner of raft-rs's `harness/` and TigerBeetle's
//! simulator: the controller's machine, N agent machines, the simulated GPUs' physics,
//! the jobs as Slurm runs them and an in-memory link, in one process on one fake clock.
//! Faults are inputs ([`site::Fault`]: a node cut off, a lease lost, a clock jump, an
//! agent or the controller restarted with or without its state); everything random comes
//! from a seed, so a run replays exactly and a failure replays from its seed.
//!
//! - [`site`]: the site and its loop (50 ms quanta, the meter sampled at each);
//! - [`controller`]: the controller's machine as `powerflex-ctld` drives it (the one
//!   module that names it);
//! - [`node`]: one agent machine as `powerflexd` drives it (the one module that calls it);
//! - [`physics`]: the simulated GPUs (the simulator's model and workload library);
//! - [`memory_link`]: messages with a delay and the real link's clock-skew refusal;
//! - [`meter`]: the meter's 50 ms samples;
//! - [`trace`]: the run folded into a digest;
//! - [`ab`]: the live A/B, one scenario under a policy, judged on the true curves.
//!
//! Pure like the machines: no files, sockets, threads or clocks (its `clippy.toml`
//! refuses them), so a 10,000-node site runs as fast as its machines decide.

pub mod ab;
pub mod controller;
pub mod memory_link;
pub mod meter;
pub mod node;
pub mod physics;
pub mod site;
pub mod trace;

/// Why a site could not be made or a request not carried out.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum HarnessError {
    #[error("site config: {0}")]
    Site(String),
    #[error("workload library: {0}")]
    Library(String),
    #[error("unknown workload profile {0:?}")]
    UnknownWorkload(String),
    #[error("no node with index {0}")]
    NoSuchNode(usize),
    #[error("node {node} has no GPU {gpu}")]
    NoSuchGpu { node: usize, gpu: u32 },
    #[error("node {node} has too few free GPUs for job {job}")]
    NoFreeGpus { node: usize, job: String },
}
