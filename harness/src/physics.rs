//! The simulated GPUs' physics, pure: what each GPU draws under its cap, how fast its
//! job runs there, its energy counter, and the readings the agent takes of it.
//!
//! The model is the simulator's (`powerflex_core::workload`, which `powerflex-sim` runs
//! behind its NVML library): a loaded GPU draws its workload's demand at the cap, settled
//! a little below a binding one ([`powerflex_core::workload::CAP_SETTLE_FRACTION`]),
//! never above it; an idle GPU (no job, a job's idle phase, a suspended job) draws the
//! model's idle power; a reading carries the simulator's ±0.5 % noise; the counter
//! integrates the noise-free draw. The workloads are the simulator's own library
//! (`sim/profiles/library.toml`, compiled in).
//!
//! What the real simulator does that this does not: processes and their liveness (a job
//! here is loaded or idle because the site says so), NVML faults, and the files.

use std::collections::BTreeMap;

use serde::Deserialize;

use powerflex_core::rng::SplitMix64;
use powerflex_core::workload::{GpuState, MeasuredTable, Physics};
use powerflex_core::Watts;

use crate::HarnessError;

/// The simulated H200 (`sim/src/models.rs`): limits, idle draw and clocks.
pub mod h200 {
    /// What NVML names it, as the simulated NVML library does.
    pub const NAME: &str = "NVIDIA H200 (simulated)";
    pub const MIN_CAP_W: f64 = 200.0;
    pub const MAX_CAP_W: f64 = 700.0;
    pub const DEFAULT_CAP_W: f64 = 700.0;
    /// Draw with no work, W.
    pub const IDLE_W: f64 = 75.0;
    pub const MAX_SM_CLOCK_MHZ: f64 = 1980.0;
    pub const IDLE_SM_CLOCK_MHZ: u32 = 345;
}

/// Relative amplitude of a power reading's noise (uniform ±0.5 %, as the simulator's).
pub const POWER_NOISE: f64 = 0.005;

/// The simulator's workload library, compiled in: the same profiles the Slurm test bed's
/// simulated jobs run.
const LIBRARY_TOML: &str = include_str!("../../sim/profiles/library.toml");

/// One workload of the library: how a job's GPU draws and runs at each cap.
#[derive(Debug, Clone, PartialEq, Deserialize)]
pub struct Workload {
    pub name: String,
    pub physics: Physics,
    /// A measured table that decides power and throughput (the "real" profiles);
    /// `physics` then only feeds the clock.
    #[serde(default)]
    pub table: Option<MeasuredTable>,
    /// Uncapped throughput per GPU, tokens/s.
    pub tokens_per_s_per_gpu: f64,
}

impl Workload {
    /// One GPU's state under per-GPU cap `cap_w`.
    pub fn at_cap(&self, cap_w: f64) -> GpuState {
        match &self.table {
            Some(table) => table.at_cap(Watts(cap_w), &self.physics),
            None => self.physics.at_cap(Watts(cap_w)),
        }
    }
}

#[derive(Debug, Deserialize)]
struct Library {
    profile: Vec<Workload>,
}

/// The workload library by name.
#[derive(Debug, Clone)]
pub struct Workloads {
    by_name: BTreeMap<String, Workload>,
}

impl Workloads {
    /// The simulator's library.
    pub fn builtin() -> Result<Workloads, HarnessError> {
        let library: Library = toml::from_str(LIBRARY_TOML)
            .map_err(|e| HarnessError::Library(e.to_string().trim_end().to_string()))?;
        Ok(Workloads {
            by_name: library
                .profile
                .into_iter()
                .map(|w| (w.name.clone(), w))
                .collect(),
        })
    }

    pub fn get(&self, name: &str) -> Result<&Workload, HarnessError> {
        self.by_name
            .get(name)
            .ok_or_else(|| HarnessError::UnknownWorkload(name.to_string()))
    }
}

/// What a GPU runs.
#[derive(Debug, Clone, PartialEq)]
pub enum Load {
    /// Idle: no job, a job's idle phase, or a suspended job.
    Idle,
    /// Training with this workload.
    Train(Workload),
}

/// One simulated GPU.
#[derive(Debug, Clone)]
pub struct Gpu {
    pub uuid: String,
    /// The limit in force, W.
    pub cap_w: f64,
    load: Load,
    /// The physics at the cap and load in force (recomputed only when either changes:
    /// 80,000 GPUs are read twenty times a simulated second).
    state: Option<GpuState>,
    draw_w: f64,
    /// Energy at `checkpoint_ms`, mJ.
    energy_mj: f64,
    checkpoint_ms: u64,
}

impl Gpu {
    pub fn new(uuid: String, now_ms: u64) -> Gpu {
        let mut gpu = Gpu {
            uuid,
            cap_w: h200::DEFAULT_CAP_W,
            load: Load::Idle,
            state: None,
            draw_w: 0.0,
            energy_mj: 0.0,
            checkpoint_ms: now_ms,
        };
        gpu.settle();
        gpu
    }

    fn settle(&mut self) {
        match &self.load {
            Load::Idle => {
                self.state = None;
                self.draw_w = h200::IDLE_W.min(self.cap_w);
            }
            Load::Train(w) => {
                let state = w.at_cap(self.cap_w);
                // Never above the limit: the GPU enforces it, whatever the model says.
                self.draw_w = state.power_w.0.min(self.cap_w);
                self.state = Some(state);
            }
        }
    }

    /// Advances the counter to `now_ms` before what the GPU draws changes.
    fn checkpoint(&mut self, now_ms: u64) {
        self.energy_mj = self.energy_at(now_ms);
        self.checkpoint_ms = self.checkpoint_ms.max(now_ms);
    }

    fn energy_at(&self, now_ms: u64) -> f64 {
        let elapsed_ms = now_ms.saturating_sub(self.checkpoint_ms) as f64;
        self.energy_mj + self.draw_w * elapsed_ms
    }

    /// Noise-free draw, W: what the meter sums and the counter integrates.
    pub fn draw_w(&self) -> f64 {
        self.draw_w
    }

    pub fn load(&self) -> &Load {
        &self.load
    }

    /// Throughput relative to uncapped (1 when idle).
    pub fn relative_throughput(&self) -> f64 {
        self.state.map_or(1.0, |s| s.relative_throughput)
    }

    /// A new limit, clamped to the board's range as NVML does. Returns the change in
    /// draw, W.
    pub fn set_cap(&mut self, now_ms: u64, cap_w: f64) -> f64 {
        let cap_w = cap_w.clamp(h200::MIN_CAP_W, h200::MAX_CAP_W);
        if (cap_w - self.cap_w).abs() < 1e-9 {
            return 0.0;
        }
        self.checkpoint(now_ms);
        let before = self.draw_w;
        self.cap_w = cap_w;
        self.settle();
        self.draw_w - before
    }

    /// What the GPU runs from now. Returns the change in draw, W.
    pub fn set_load(&mut self, now_ms: u64, load: Load) -> f64 {
        if load == self.load {
            return 0.0;
        }
        self.checkpoint(now_ms);
        let before = self.draw_w;
        self.load = load;
        self.settle();
        self.draw_w - before
    }

    /// A reading at `now_ms`, as the agent's NVML backend gives it, with the simulator's
    /// noise (never above the limit).
    pub fn reading(
        &self,
        now_ms: u64,
        rng: &mut SplitMix64,
    ) -> powerflex_agent_machine::gpu::GpuSample {
        let unit = rng.next_f64() * 2.0 - 1.0;
        let power_w = (self.draw_w * (1.0 + POWER_NOISE * unit)).min(self.cap_w);
        let (sm_clock_mhz, gpu_util_pct, memory_util_pct, throttled) =
            match (&self.load, self.state) {
                (Load::Train(w), Some(s)) => {
                    let m = w.physics.memory_bound_fraction;
                    let f = s.sm_clock_fraction;
                    // The memory-bound share of a step grows as the SM clock falls.
                    let memory_share = m / (m + (1.0 - m) / f);
                    (
                        (h200::MAX_SM_CLOCK_MHZ * f).round() as u32,
                        100,
                        (100.0 * (0.15 + 0.8 * memory_share)).round() as u32,
                        s.cap_binding,
                    )
                }
                _ => (h200::IDLE_SM_CLOCK_MHZ, 0, 0, false),
            };
        powerflex_agent_machine::gpu::GpuSample {
            power: Watts(power_w),
            cap: Watts(self.cap_w),
            energy_mj: Some(self.energy_at(now_ms).max(0.0) as u64),
            power_throttled: Some(throttled),
            gpu_util_pct,
            memory_util_pct,
            sm_clock_mhz,
        }
    }
}

/// One node's GPUs, as the agent's NVML backend sees them: read with the simulator's
/// noise (from the node's own seeded stream), written clamped to the board's range.
#[derive(Debug, Clone)]
pub struct NodeGpus {
    pub gpus: Vec<Gpu>,
    noise: SplitMix64,
}

impl NodeGpus {
    /// `count` idle GPUs at their default limit, their UUIDs from the node's index (hex,
    /// as NVML's are); `seed` drives their readings' noise.
    pub fn new(node: usize, count: u32, seed: u64, now_ms: u64) -> NodeGpus {
        NodeGpus {
            gpus: (0..count)
                .map(|i| Gpu::new(format!("GPU-{node:08x}-{i:04x}"), now_ms))
                .collect(),
            noise: SplitMix64::new(seed),
        }
    }

    /// A reading of GPU `index` (`None`: no such GPU).
    pub fn read(
        &mut self,
        index: u32,
        now_ms: u64,
    ) -> Option<powerflex_agent_machine::gpu::GpuSample> {
        let gpu = self.gpus.get(index as usize)?;
        Some(gpu.reading(now_ms, &mut self.noise))
    }

    /// Writes a limit; returns the limit read just before (as the agent's backend does).
    pub fn write(&mut self, index: u32, now_ms: u64, cap_w: f64) -> Option<f64> {
        let gpu = self.gpus.get_mut(index as usize)?;
        let before = gpu.cap_w;
        gpu.set_cap(now_ms, cap_w);
        Some(before)
    }

    /// The node's noise-free draw, W.
    pub fn draw_w(&self) -> f64 {
        self.gpus.iter().map(Gpu::draw_w).sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_library_has_the_test_beds_profiles() {
        let library = Workloads::builtin().expect("library");
        let heavy = library.get("synthetic-compute-bound").expect("heavy");
        assert!((heavy.physics.uncapped_w() - 690.0).abs() < 1e-9);
        let light = library.get("synthetic-memory-bound").expect("light");
        assert!((light.physics.uncapped_w() - 560.0).abs() < 1e-9);
        let real = library
            .get("real-rtx6000-squad-bert-base-uncased-bs16-adamw")
            .expect("real");
        assert!(real.table.is_some());
        assert!(library.get("no-such-profile").is_err());
    }

    #[test]
    fn power_follows_the_cap_and_energy_integrates_it() {
        let library = Workloads::builtin().expect("library");
        let heavy = library
            .get("synthetic-compute-bound")
            .expect("heavy")
            .clone();
        let mut gpu = Gpu::new("GPU-0".into(), 0);
        assert_eq!(gpu.draw_w(), h200::IDLE_W);
        gpu.set_load(0, Load::Train(heavy));
        // 690 W wanted, the 700 W default limit settles it at 98.5 % of the cap.
        let full = gpu.draw_w();
        assert!((full - 689.5).abs() < 1e-9, "{full}");
        gpu.set_cap(1000, 400.0);
        assert!(
            gpu.draw_w() <= 400.0 && gpu.draw_w() > 390.0,
            "settles below"
        );
        assert!(gpu.relative_throughput() < 1.0);
        // 1 s at 690 W, then 1 s under the cap.
        let mut rng = SplitMix64::new(1);
        let e = gpu.reading(2000, &mut rng).energy_mj.expect("counter");
        let want = full * 1000.0 + gpu.draw_w() * 1000.0;
        assert!((e as f64 - want).abs() <= 1.0, "{e} vs {want}");
        let r = gpu.reading(2000, &mut rng);
        assert!(r.power.0 <= 400.0 && (r.power.0 - gpu.draw_w()).abs() <= 0.005 * 400.0);
        gpu.set_cap(3000, 100.0);
        assert_eq!(gpu.cap_w, h200::MIN_CAP_W, "clamped to the board's range");
    }
}
