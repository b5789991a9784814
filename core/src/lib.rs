//! powerflex's pure core: every decision the product makes, and nothing else.
//!
//! This crate holds the `--power-flex` grammar and tier table, the site config, the
//! Power Flexibility Index (PFI, arXiv 2609.11542 Eq. 1), power–throughput curve
//! estimation, the allocation policies and the offline evaluation of those policies.
//!
//! It must not do I/O, spawn threads, read a clock, or link NVML or Slurm: the SPANK
//! plugin, the node agent, the controller and the CLI all embed it, and tests drive it
//! with plain values. Callers read files and sockets and hand the bytes in.
//!
//! Units: per-GPU power caps and job power are [`Watts`]; throughput is whatever rate the
//! job reports (tokens/s or steps/s) and is only ever compared with itself.

pub mod allocate;
pub mod calibration_design;
pub mod compare;
pub mod config;
pub mod curve;
pub mod curves_csv;
pub mod domains;
pub mod error;
pub mod evaluate;
pub mod flex;
pub mod gpus;
pub mod pfi;
pub mod point;
pub mod promise;
pub mod rng;
pub mod slurm_record;
pub mod time;
pub mod units;
pub mod workload;

pub use error::Error;
pub use time::UnixMs;
pub use units::Watts;
