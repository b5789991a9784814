//! One measured (or estimated) operating point of a job, shared by the curves
//! ([`crate::curve`]) and the PFI ([`crate::pfi`]).

use serde::{Deserialize, Serialize};

use crate::units::Watts;

/// One operating point of a job: at per-GPU cap `cap_w`, the job's GPUs together drew
/// `power_w` and the job ran at `throughput` (tokens/s or steps/s, as the job reports).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct OperatingPoint {
    /// Per-GPU power cap, W.
    pub cap_w: Watts,
    /// The job's summed realised GPU power at that cap, W.
    pub power_w: Watts,
    /// The job's throughput at that cap, in the job's own unit (tokens/s or steps/s).
    pub throughput: f64,
}
