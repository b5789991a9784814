//! The GPUs as the agent sees them: a small trait with one production implementation on
//! `nvml-wrapper`. Power is [`Watts`] here; milliwatts exist only inside [`NvmlBackend`],
//! converted in one place. The simulated GPUs are reached through the *same* backend,
//! with the simulated library's path as `nvml_library` — there is no simulated backend
//! in this crate, so tests run the production code path.

use std::ffi::OsStr;

use nvml_wrapper::error::NvmlError;
use nvml_wrapper::Nvml;
use powerflex_core::Watts;

// The GPU's types belong to the agent's pure machine, which decides on them; this edge
// only fills them from NVML.
use powerflex_agent_machine::gpu::{ErrorClass, GpuError, GpuIdentity, GpuSample};

/// How the test bed's simulated GPUs end their names.
pub const SIMULATED_NAME_SUFFIX: &str = "(simulated)";

/// The GPU operations the agent needs.
pub trait GpuBackend: Send {
    /// Every GPU on the node.
    fn discover(&mut self) -> Result<Vec<GpuIdentity>, GpuError>;
    /// A reading of GPU `index`.
    fn sample(&mut self, index: u32) -> Result<GpuSample, GpuError>;
    /// Sets GPU `index`'s power limit (the caller clamps to the GPU's constraints) and
    /// returns the limit found on the GPU just before the write (`None` when it could not
    /// be read): a change made behind the agent's back between two samples would
    /// otherwise be overwritten by a new grant unseen.
    fn set_cap(&mut self, index: u32, cap: Watts) -> Result<Option<Watts>, GpuError>;
    /// Process ids with a compute context on GPU `index` (NVML's running processes).
    fn running_pids(&mut self, index: u32) -> Result<Vec<u32>, GpuError>;
}

/// Production backend: NVML through `nvml-wrapper`, initialised once per process.
pub struct NvmlBackend {
    nvml: Nvml,
}

impl std::fmt::Debug for NvmlBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("NvmlBackend")
    }
}

fn classify(e: &NvmlError) -> ErrorClass {
    match e {
        NvmlError::GpuLost | NvmlError::ResetRequired => ErrorClass::DeviceLost,
        NvmlError::Timeout
        | NvmlError::InUse
        | NvmlError::InsufficientMemory
        | NvmlError::NoData
        | NvmlError::Unknown => ErrorClass::Transient,
        _ => ErrorClass::Permanent,
    }
}

fn err(index: u32, e: NvmlError) -> GpuError {
    GpuError {
        index,
        class: classify(&e),
        message: format!("{e}"),
    }
}

fn watts(mw: u32) -> Watts {
    Watts(f64::from(mw) / 1000.0)
}

impl NvmlBackend {
    /// Loads NVML: the library at `library` (a path or soname), or the system's
    /// `libnvidia-ml.so.1` when `None`.
    pub fn open(library: Option<&std::path::Path>) -> Result<NvmlBackend, String> {
        let nvml = match library {
            Some(path) => Nvml::builder().lib_path(OsStr::new(path)).init(),
            None => Nvml::init(),
        }
        .map_err(|e| match library {
            Some(p) => format!("cannot initialise NVML from {}: {e}", p.display()),
            None => format!("cannot initialise NVML (libnvidia-ml.so.1): {e}"),
        })?;
        Ok(NvmlBackend { nvml })
    }
}

impl GpuBackend for NvmlBackend {
    fn discover(&mut self) -> Result<Vec<GpuIdentity>, GpuError> {
        let count = self.nvml.device_count().map_err(|e| err(u32::MAX, e))?;
        let mut gpus = Vec::with_capacity(count as usize);
        for index in 0..count {
            let d = self
                .nvml
                .device_by_index(index)
                .map_err(|e| err(index, e))?;
            let constraints = d
                .power_management_limit_constraints()
                .map_err(|e| err(index, e))?;
            let name = d.name().map_err(|e| err(index, e))?;
            gpus.push(GpuIdentity {
                index,
                uuid: d.uuid().map_err(|e| err(index, e))?,
                simulated: name.ends_with(SIMULATED_NAME_SUFFIX),
                name,
                min_cap: watts(constraints.min_limit),
                max_cap: watts(constraints.max_limit),
                default_cap: watts(
                    d.power_management_limit_default()
                        .map_err(|e| err(index, e))?,
                ),
            });
        }
        Ok(gpus)
    }

    fn sample(&mut self, index: u32) -> Result<GpuSample, GpuError> {
        let d = self
            .nvml
            .device_by_index(index)
            .map_err(|e| err(index, e))?;
        let util = d.utilization_rates().map_err(|e| err(index, e))?;
        Ok(GpuSample {
            power: watts(d.power_usage().map_err(|e| err(index, e))?),
            // The limit as set (what the agent writes and must find again), not the enforced
            // one, which other constraints may lower below it.
            cap: watts(d.power_management_limit().map_err(|e| err(index, e))?),
            // A GPU without the counter (NotSupported) is still read; any other failure
            // of it is the device's, like the other readings'.
            energy_mj: match d.total_energy_consumption() {
                Ok(mj) => Some(mj),
                Err(NvmlError::NotSupported) => None,
                Err(e) => return Err(err(index, e)),
            },
            power_throttled: d.current_throttle_reasons().ok().map(|r| {
                r.intersects(
                    nvml_wrapper::bitmasks::device::ThrottleReasons::SW_POWER_CAP
                        | nvml_wrapper::bitmasks::device::ThrottleReasons::HW_POWER_BRAKE_SLOWDOWN,
                )
            }),
            gpu_util_pct: util.gpu,
            memory_util_pct: util.memory,
            // A GPU without the clock reading still has every other reading.
            sm_clock_mhz: d
                .clock_info(nvml_wrapper::enum_wrappers::device::Clock::SM)
                .unwrap_or(0),
        })
    }

    fn running_pids(&mut self, index: u32) -> Result<Vec<u32>, GpuError> {
        let d = self
            .nvml
            .device_by_index(index)
            .map_err(|e| err(index, e))?;
        Ok(d.running_compute_processes()
            .map_err(|e| err(index, e))?
            .into_iter()
            .map(|p| p.pid)
            .collect())
    }

    fn set_cap(&mut self, index: u32, cap: Watts) -> Result<Option<Watts>, GpuError> {
        let mut d = self
            .nvml
            .device_by_index(index)
            .map_err(|e| err(index, e))?;
        // A failed read does not stop the write: the cap matters more than the count.
        let found = d.power_management_limit().ok().map(watts);
        let mw = (cap.0 * 1000.0).round().clamp(0.0, f64::from(u32::MAX)) as u32;
        d.set_power_management_limit(mw)
            .map_err(|e| err(index, e))?;
        Ok(found)
    }
}
