//! The node agent's machine: every decision `powerflexd` makes, with no I/O.
//!
//! - [`control`]: the node's GPUs and jobs, the caps each gets (from the controller's
//!   lease, or standalone from the node budget), registrations, ends, adoption after a
//!   restart, the fail-safe, the accounting's observations and the status snapshot;
//! - [`calibration`]: one job's power–throughput walk and its learning in operation;
//! - [`usage`]: one job's energy on this node, from the GPUs' counters;
//! - [`gpu`]: what a GPU is and reads, as NVML gives it to the edge;
//! - [`saved`]: what the agent keeps across a restart, as data;
//! - [`MachineError`]: what the machine refuses (a registration, a progress report, a
//!   reload), and why.
//!
//! One entry point, [`control::Agent::step`]: typed inputs in, what the edge must do
//! out (see [`control::AgentOutput`]). Time comes in as an argument
//! ([`powerflex_core::UnixMs`]), never from a clock; GPUs, sockets,
//! `/proc` and the state file are the edge's (`powerflex-agent`). The crate has no
//! dependency that does I/O, and its `clippy.toml` refuses the standard library's
//! (files, sockets, processes, clocks, environment), so that stays true.

pub mod calibration;
pub mod control;
mod error;
pub mod gpu;
pub mod saved;
pub mod usage;

pub use error::MachineError;

/// A job as this host can tell it apart: its id and the cluster of its step daemons
/// (the test clusters run several `slurmd -N` on one machine, and job ids repeat
/// between them).
pub type JobKey = (String, Option<String>);
