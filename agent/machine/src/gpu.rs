//! A GPU as the agent's machine sees it: what it is, one reading of it, and how a failed
//! NVML operation is to be treated. The agent's edge (`powerflex_agent::backend`) fills
//! these from NVML; the machine decides on them and never calls NVML.

use powerflex_core::Watts;

/// What a GPU is and which caps it accepts.
#[derive(Debug, Clone, PartialEq)]
pub struct GpuIdentity {
    pub index: u32,
    pub uuid: String,
    pub name: String,
    pub min_cap: Watts,
    pub max_cap: Watts,
    /// The board's default limit (what "restore" writes back).
    pub default_cap: Watts,
    /// A simulated GPU (the test bed's, whose names end in "(simulated)"): every figure
    /// the agent reports from it is labelled simulated.
    pub simulated: bool,
}

/// One reading of a GPU.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct GpuSample {
    pub power: Watts,
    /// The limit in force (enforced limit).
    pub cap: Watts,
    /// Energy since driver load, mJ; none on a GPU without the counter (pre-Volta
    /// boards), whose jobs are then charged power × time.
    pub energy_mj: Option<u64>,
    /// Whether the clocks are held back by a power cap or power brake now (NVML's clock
    /// event reasons); none where NVML cannot say.
    pub power_throttled: Option<bool>,
    /// Utilisation over the last sample period, percent.
    pub gpu_util_pct: u32,
    pub memory_util_pct: u32,
    /// SM clock now, MHz (0 where NVML cannot say): what a cap slows.
    pub sm_clock_mhz: u32,
}

/// How an NVML failure should be treated; classified once, here.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ErrorClass {
    /// Retrying will not help (no permission, unsupported, bad argument): mark the GPU
    /// degraded and stop writing to it.
    Permanent,
    /// The GPU fell off the bus: degraded until the agent restarts.
    DeviceLost,
    /// Worth retrying on the next tick (timeout, busy driver).
    Transient,
}

/// A failed GPU operation.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[error("GPU {index}: {message}")]
pub struct GpuError {
    pub index: u32,
    pub class: ErrorClass,
    pub message: String,
}
