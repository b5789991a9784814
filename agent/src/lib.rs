//! `powerflexd`, the node agent: the only process that touches GPU power.
//!
//! It runs as root on every GPU node, takes job start and end from the SPANK plugin and
//! the epilog, measures each job's power–throughput curve in its early steps, applies the
//! caps the controller (or, standalone, the node budget) grants, and puts every GPU back
//! to its default when a job ends — also when the agent stops or restarts after a crash.
//!
//! - [`backend`]: the GPU trait and its NVML implementation (the only code that uses
//!   `nvml-wrapper`);
//! - the decisions (calibration, caps, accounting) are the pure machine's, in its own
//!   crate: [`powerflex_agent_machine`], with no I/O dependency;
//! - [`server`], [`controller_link`], [`metrics`], [`persist`], [`run`]: sockets, the
//!   link to the controller, Prometheus, state on disk, and the control loop that ties
//!   them together.

pub mod backend;
pub mod controller_link;
pub mod metrics;
pub mod persist;
pub mod procs;
pub mod run;
pub mod server;
