//! One simulated node's GPUs, kept as files so that every process on the machine — the
//! agent setting caps, the simulated job reading them, a test sampling power — sees the
//! same GPUs.
//!
//! Layout of a node's state directory (root's, mode 0755):
//! - `node.json` — node name, device model, GPU count, creation time (the "driver load");
//! - `gpu<i>.limit` — the GPU's power limit, mW: written only by root (through
//!   `nvmlDeviceSetPowerManagementLimit`), in a directory only root may write, as on real
//!   hardware where NVML refuses a non-root limit write;
//! - `shared/` (mode 0777) — what simulated jobs, which run as their users, must write:
//!   - `gpu<i>.json` — identity, energy checkpoint, the workload running on it, an
//!     injected fault (its `power_limit_mw` is a copy; `gpu<i>.limit` is what counts);
//!   - `gpu<i>.lock` (mode 0666) — `flock` target serialising read-modify-write.
//!
//! A user can therefore edit another job's simulated workload or energy counter (a
//! simulation artefact: a real GPU's process list and counters are the driver's), but not
//! a power limit.
//!
//! Readers never lock: writers replace files by `rename(2)`, so a reader sees the old or
//! the new file whole. Power is not stored but computed at read time from the limit and
//! the workload; energy is stored as a checkpoint (mJ at a time) advanced at every change
//! of what the GPU draws, and read as checkpoint + power × elapsed time.

use std::fs;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use powerflex_core::workload::{MeasuredTable, Physics};
use powerflex_core::Watts;
use powerflex_daemon::fsx::{self, AtomicWrite};
use powerflex_daemon::os::FileLock;

use crate::models::{self, DeviceModel};
use crate::SimError;

/// The environment variable naming a node's state directory; `%n` = `SLURMD_NODENAME`.
pub const STATE_DIR_ENV: &str = "POWERFLEX_SIM_DIR";

/// Relative amplitude of the power-reading noise (uniform ±0.5 %).
pub const POWER_NOISE: f64 = 0.005;

/// Wall-clock milliseconds since the Unix epoch (shared by every process on the host).
pub use powerflex_daemon::clock::unix_ms;

/// A node's description, `node.json`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NodeInfo {
    /// Always true: everything under this directory is simulated.
    pub simulated: bool,
    pub node: String,
    pub model: String,
    pub gpu_count: u32,
    /// When the node was made: energy counters count from here, like from driver load.
    pub created_unix_ms: u64,
}

/// A fault the simulator injects on one GPU, as a real driver would report it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Fault {
    /// The GPU fell off the bus: every call on it fails with `NVML_ERROR_GPU_IS_LOST`.
    GpuLost,
    /// Every call on it times out: `NVML_ERROR_TIMEOUT`.
    Timeout,
    /// Setting its power limit fails with `NVML_ERROR_NO_PERMISSION`, even as root.
    NoPermission,
}

impl Fault {
    pub const NAMES: [&'static str; 3] = ["gpu-lost", "timeout", "no-permission"];

    pub fn from_name(name: &str) -> Option<Fault> {
        match name {
            "gpu-lost" => Some(Fault::GpuLost),
            "timeout" => Some(Fault::Timeout),
            "no-permission" => Some(Fault::NoPermission),
            _ => None,
        }
    }
}

/// Work running on a GPU: a simulated training job's share of it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Workload {
    pub job_id: String,
    /// The process that claimed the GPU; a claim whose process is gone is ignored.
    pub pid: u32,
    pub profile: String,
    pub physics: Physics,
    /// A measured table that decides power and throughput instead of `physics` (which then
    /// only feeds clock telemetry); absent for physics profiles.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub table: Option<MeasuredTable>,
    pub memory_used_bytes: u64,
    /// The job holds the GPU but runs nothing on it (a phase of data loading, setup or
    /// waiting): it draws the idle power, like an idle GPU, yet stays claimed so the job
    /// keeps it and NVML lists its process.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub idle: bool,
}

/// One GPU's stored state, `gpu<i>.json`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct GpuState {
    pub index: u32,
    pub uuid: String,
    pub serial: String,
    pub pci_bus_id: String,
    pub power_limit_mw: u32,
    /// Energy at `checkpoint_unix_ms`, mJ since the node was made.
    pub energy_mj: f64,
    pub checkpoint_unix_ms: u64,
    /// Whether the GPU was under load at the checkpoint: the counter integrates the draw
    /// of that state until the next checkpoint, so it never runs backwards when a
    /// workload's process dies or is stopped without a write (a real counter is
    /// monotonic). The next reading that sees the load changed checkpoints
    /// ([`Node::reading`]).
    #[serde(default)]
    pub loaded_at_checkpoint: bool,
    pub workload: Option<Workload>,
    pub fault: Option<Fault>,
}

/// What a GPU reports at one instant.
#[derive(Debug, Clone, PartialEq)]
pub struct GpuReading {
    /// Power draw, mW (with ±0.5 % noise, never above the limit).
    pub power_mw: u32,
    /// Noise-free draw, mW: what the energy counter integrates.
    pub steady_power_mw: u32,
    pub energy_mj: u64,
    pub limit_mw: u32,
    pub sm_clock_mhz: u32,
    pub memory_clock_mhz: u32,
    /// GPU and memory utilisation over the last sample period, percent.
    pub gpu_util_pct: u32,
    pub memory_util_pct: u32,
    pub memory_used_bytes: u64,
    pub temperature_c: u32,
    /// Whether the power cap is what holds the clock down.
    pub power_capped: bool,
    pub busy: bool,
    /// The job on the GPU, when one is running.
    pub job_id: Option<String>,
    /// Throughput relative to uncapped for the running workload (1.0 when idle).
    pub relative_throughput: f64,
}

fn is_alive(pid: u32) -> bool {
    pid != 0 && Path::new(&format!("/proc/{pid}")).exists()
}

/// Whether process `pid` is stopped (SIGSTOP, as `scontrol suspend` sends): the state
/// letter in `/proc/PID/stat`, after the command name's closing parenthesis (a name may
/// itself contain one).
fn is_stopped(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .ok()
        .and_then(|stat| {
            let rest = stat.get(stat.rfind(')')? + 1..)?;
            rest.split_whitespace().next().map(|s| s == "T" || s == "t")
        })
        .unwrap_or(false)
}

/// A cheap, stable hash (FNV-1a), for identities and reading noise.
fn fnv1a(parts: &[&[u8]]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for part in parts {
        for &b in *part {
            h ^= u64::from(b);
            h = h.wrapping_mul(0x0000_0100_0000_01b3);
        }
        h ^= 0xff;
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    h
}

impl GpuState {
    fn new(node: &str, index: u32, model: &DeviceModel, now: u64) -> GpuState {
        let h = fnv1a(&[node.as_bytes(), &index.to_le_bytes()]);
        let h2 = fnv1a(&[&h.to_le_bytes()]);
        GpuState {
            index,
            uuid: format!(
                "GPU-{:08x}-{:04x}-{:04x}-{:04x}-{:012x}",
                h >> 32,
                (h >> 16) & 0xffff,
                h & 0xffff,
                h2 >> 48,
                h2 & 0xffff_ffff_ffff
            ),
            serial: format!("SIM{:010}", h % 10_000_000_000),
            pci_bus_id: format!("00000000:{:02X}:00.0", 0x18 + index * 0x10),
            power_limit_mw: model.default_limit_mw,
            energy_mj: 0.0,
            checkpoint_unix_ms: now,
            loaded_at_checkpoint: false,
            workload: None,
            fault: None,
        }
    }

    /// The workload actually running (its process alive).
    pub fn running(&self) -> Option<&Workload> {
        self.workload.as_ref().filter(|w| is_alive(w.pid))
    }

    /// The running workload when it puts load on the GPU: not in an idle phase, and not
    /// stopped (a job Slurm suspended with `scontrol suspend` gets SIGSTOP, launches no
    /// kernels, and its GPUs fall to idle draw while it keeps them).
    fn loaded(&self) -> Option<&Workload> {
        self.running().filter(|w| !w.idle && !is_stopped(w.pid))
    }

    /// Noise-free draw, mW, and the physics state behind it.
    fn steady(&self, model: &DeviceModel) -> (u32, Option<powerflex_core::workload::GpuState>) {
        self.draw_under(model, self.loaded())
    }

    /// Noise-free draw, mW, with `load` running on the GPU (none: idle).
    fn draw_under(
        &self,
        model: &DeviceModel,
        load: Option<&Workload>,
    ) -> (u32, Option<powerflex_core::workload::GpuState>) {
        match load {
            None => (model.idle_mw.min(self.power_limit_mw), None),
            Some(w) => {
                let cap = Watts(f64::from(self.power_limit_mw) / 1000.0);
                let state = match &w.table {
                    Some(table) => table.at_cap(cap, &w.physics),
                    None => w.physics.at_cap(cap),
                };
                let mw = (state.power_w.0 * 1000.0).round() as u32;
                (mw.min(self.power_limit_mw), Some(state))
            }
        }
    }

    /// The draw the energy counter integrates since the checkpoint, mW: that of the load
    /// state recorded there (see [`GpuState::loaded_at_checkpoint`]).
    fn counted_draw_mw(&self, model: &DeviceModel) -> u32 {
        let load = self
            .workload
            .as_ref()
            .filter(|w| self.loaded_at_checkpoint && !w.idle);
        self.draw_under(model, load).0
    }

    /// Whether the load changed since the checkpoint without a write (a process died or
    /// was stopped or continued).
    fn load_changed(&self) -> bool {
        self.loaded().is_some() != self.loaded_at_checkpoint
    }

    /// Energy at `now`, mJ.
    fn energy_at(&self, model: &DeviceModel, now: u64) -> f64 {
        let mw = self.counted_draw_mw(model);
        let elapsed = now.saturating_sub(self.checkpoint_unix_ms) as f64;
        self.energy_mj + f64::from(mw) * elapsed / 1000.0
    }

    /// Advances the energy checkpoint to `now` (before changing what the GPU draws).
    fn checkpoint(&mut self, model: &DeviceModel, now: u64) {
        self.energy_mj = self.energy_at(model, now);
        self.checkpoint_unix_ms = self.checkpoint_unix_ms.max(now);
        self.loaded_at_checkpoint = self.loaded().is_some();
    }

    /// What the GPU reports at `now`.
    pub fn reading(&self, model: &DeviceModel, now: u64) -> GpuReading {
        let (steady_mw, physics) = self.steady(model);
        // ±0.5 % noise, fixed within each 100 ms so repeated reads in a sample agree.
        let bucket = now / 100;
        let h = fnv1a(&[self.uuid.as_bytes(), &bucket.to_le_bytes()]);
        let unit = (h >> 11) as f64 / (1u64 << 53) as f64 * 2.0 - 1.0;
        let noisy = (f64::from(steady_mw) * (1.0 + POWER_NOISE * unit)).round() as u32;
        let power_mw = noisy.min(self.power_limit_mw);
        let running = self.running();
        let (sm, gpu_util, mem_util, capped, relative) = match (self.loaded(), physics) {
            (Some(w), Some(p)) => {
                let m = w.physics.memory_bound_fraction;
                let s = p.sm_clock_fraction;
                // Share of step time in memory-bound work grows as the SM clock falls.
                let memory_share = m / (m + (1.0 - m) / s);
                (
                    (f64::from(model.max_sm_clock_mhz) * s).round() as u32,
                    100,
                    (100.0 * (0.15 + 0.8 * memory_share)).round() as u32,
                    p.cap_binding,
                    p.relative_throughput,
                )
            }
            _ => (model.idle_sm_clock_mhz, 0, 0, false, 1.0),
        };
        GpuReading {
            power_mw,
            steady_power_mw: steady_mw,
            energy_mj: self.energy_at(model, now).max(0.0) as u64,
            limit_mw: self.power_limit_mw,
            sm_clock_mhz: sm,
            memory_clock_mhz: model.memory_clock_mhz,
            gpu_util_pct: gpu_util,
            memory_util_pct: mem_util,
            memory_used_bytes: running.map_or(512 * 1024 * 1024, |w| w.memory_used_bytes),
            temperature_c: (30.0 + 0.075 * f64::from(power_mw) / 1000.0).round() as u32,
            power_capped: capped,
            busy: self.loaded().is_some(),
            job_id: running.map(|w| w.job_id.clone()),
            relative_throughput: relative,
        }
    }
}

/// One simulated node: its directory and description.
#[derive(Debug, Clone)]
pub struct Node {
    dir: PathBuf,
    info: NodeInfo,
    model: &'static DeviceModel,
}

fn io_err(path: &Path) -> impl FnOnce(std::io::Error) -> SimError + '_ {
    move |source| SimError::Io {
        path: path.display().to_string(),
        source,
    }
}

/// Writes `bytes` to `path` atomically: a temporary file beside it, then rename.
///
/// No fsync: readers in other processes see the whole old or the whole new file either
/// way, which is all a GPU's state needs (a real GPU's limits do not survive a power loss
/// either), and a cap write should cost what NVML's does, not a disk flush. World-readable:
/// every simulated job and the agent (another user) read it.
fn write_atomic(path: &Path, bytes: &[u8]) -> Result<(), SimError> {
    fsx::write_atomic(path, bytes, AtomicWrite::fast().with_mode(0o644)).map_err(SimError::from)
}

/// The subdirectory simulated jobs (their users) write: see the module docs.
pub const SHARED_DIR: &str = "shared";

/// Writes a GPU's limit file: root's, world-readable.
fn write_limit(path: &Path, limit_mw: u32) -> Result<(), SimError> {
    write_atomic(path, format!("{limit_mw}\n").as_bytes())
}

fn set_mode(path: &Path, mode: u32) -> Result<(), SimError> {
    use std::os::unix::fs::PermissionsExt;
    fs::set_permissions(path, fs::Permissions::from_mode(mode)).map_err(io_err(path))
}

/// Resolves the state directory from the environment: `POWERFLEX_SIM_DIR`, with `%n`
/// replaced by `SLURMD_NODENAME`.
pub fn dir_from_env() -> Result<PathBuf, SimError> {
    let raw = std::env::var(STATE_DIR_ENV).map_err(|_| SimError::NoStateDir)?;
    if raw.is_empty() {
        return Err(SimError::NoStateDir);
    }
    if raw.contains("%n") {
        let node = std::env::var("SLURMD_NODENAME").map_err(|_| SimError::NoNodeName)?;
        return Ok(PathBuf::from(raw.replace("%n", &node)));
    }
    Ok(PathBuf::from(raw))
}

impl Node {
    /// Makes a node of `gpu_count` GPUs of `model` in `dir`, all idle at the default limit.
    pub fn init(
        dir: &Path,
        node: &str,
        model: &str,
        gpu_count: u32,
        force: bool,
    ) -> Result<Node, SimError> {
        let model = models::find(model).ok_or_else(|| SimError::UnknownModel(model.to_string()))?;
        let info_path = dir.join("node.json");
        if info_path.exists() && !force {
            return Err(SimError::Exists {
                path: dir.display().to_string(),
            });
        }
        let shared = dir.join(SHARED_DIR);
        fs::create_dir_all(&shared).map_err(io_err(&shared))?;
        if force {
            // A re-made node starts clean: drop GPUs beyond the new count too.
            for d in [dir, shared.as_path()] {
                if let Ok(entries) = fs::read_dir(d) {
                    for entry in entries.flatten() {
                        let name = entry.file_name();
                        let name = name.to_string_lossy();
                        if name.starts_with("gpu")
                            && (name.ends_with(".json")
                                || name.ends_with(".limit")
                                || name.ends_with(".energy.log"))
                        {
                            let _ = fs::remove_file(entry.path());
                        }
                    }
                }
            }
        }
        set_mode(dir, 0o755)?;
        set_mode(&shared, 0o777)?;
        let now = unix_ms();
        let info = NodeInfo {
            simulated: true,
            node: node.to_string(),
            model: model.key.to_string(),
            gpu_count,
            created_unix_ms: now,
        };
        for index in 0..gpu_count {
            let gpu = GpuState::new(node, index, model, now);
            let path = shared.join(format!("gpu{index}.json"));
            write_atomic(&path, &to_json(&gpu, &path)?)?;
            write_limit(&dir.join(format!("gpu{index}.limit")), gpu.power_limit_mw)?;
            let lock = shared.join(format!("gpu{index}.lock"));
            drop(FileLock::acquire(&lock)?);
            set_mode(&lock, 0o666)?;
        }
        write_atomic(&info_path, &to_json(&info, &info_path)?)?;
        let node = Node {
            dir: dir.to_path_buf(),
            info,
            model,
        };
        for index in 0..gpu_count {
            node.log_checkpoint(index, &node.gpu(index)?);
            let log = node.energy_log_path(index);
            set_mode(&log, 0o666)?;
        }
        Ok(node)
    }

    /// Opens an existing node.
    pub fn open(dir: &Path) -> Result<Node, SimError> {
        let info_path = dir.join("node.json");
        let text = fs::read(&info_path).map_err(|source| SimError::NotANode {
            path: dir.display().to_string(),
            source,
        })?;
        let info: NodeInfo = serde_json::from_slice(&text).map_err(|e| SimError::Corrupt {
            path: info_path.display().to_string(),
            message: e.to_string(),
        })?;
        let model =
            models::find(&info.model).ok_or_else(|| SimError::UnknownModel(info.model.clone()))?;
        Ok(Node {
            dir: dir.to_path_buf(),
            info,
            model,
        })
    }

    /// Opens the node named by `POWERFLEX_SIM_DIR`.
    pub fn open_from_env() -> Result<Node, SimError> {
        Node::open(&dir_from_env()?)
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    pub fn info(&self) -> &NodeInfo {
        &self.info
    }

    pub fn model(&self) -> &'static DeviceModel {
        self.model
    }

    pub fn gpu_count(&self) -> u32 {
        self.info.gpu_count
    }

    fn gpu_path(&self, index: u32) -> Result<PathBuf, SimError> {
        if index >= self.info.gpu_count {
            return Err(SimError::NoSuchGpu {
                index,
                count: self.info.gpu_count,
            });
        }
        Ok(self.dir.join(SHARED_DIR).join(format!("gpu{index}.json")))
    }

    fn limit_path(&self, index: u32) -> PathBuf {
        self.dir.join(format!("gpu{index}.limit"))
    }

    /// Reads one GPU's stored state, with the limit from root's `gpu<i>.limit`.
    pub fn gpu(&self, index: u32) -> Result<GpuState, SimError> {
        let path = self.gpu_path(index)?;
        let bytes = fs::read(&path).map_err(io_err(&path))?;
        let mut gpu: GpuState = serde_json::from_slice(&bytes).map_err(|e| SimError::Corrupt {
            path: path.display().to_string(),
            message: e.to_string(),
        })?;
        let limit = self.limit_path(index);
        let text = fs::read_to_string(&limit).map_err(io_err(&limit))?;
        gpu.power_limit_mw = text.trim().parse().map_err(|_| SimError::Corrupt {
            path: limit.display().to_string(),
            message: format!("not a limit in mW: {:?}", text.trim()),
        })?;
        Ok(gpu)
    }

    /// The index of the GPU with `uuid`.
    pub fn index_of_uuid(&self, uuid: &str) -> Result<u32, SimError> {
        for index in 0..self.info.gpu_count {
            if self.gpu(index)?.uuid == uuid {
                return Ok(index);
            }
        }
        Err(SimError::NoSuchUuid(uuid.to_string()))
    }

    /// What GPU `index` reports now.
    pub fn reading(&self, index: u32) -> Result<(GpuState, GpuReading), SimError> {
        let mut gpu = self.gpu(index)?;
        if gpu.load_changed() {
            // The load changed without a write (its process died, or was stopped or
            // continued): checkpoint now, so the counter integrates the new draw from
            // here on. A reader that may not write (another user) reads on; the counter
            // stays monotonic either way.
            if self.update(index, |_| Ok(())).is_ok() {
                gpu = self.gpu(index)?;
            }
        }
        let reading = gpu.reading(self.model, unix_ms());
        Ok((gpu, reading))
    }

    fn energy_log_path(&self, index: u32) -> PathBuf {
        self.dir
            .join(SHARED_DIR)
            .join(format!("gpu{index}.energy.log"))
    }

    /// GPU `index`'s energy counter at `at_unix_ms`, mJ, recomputed from the log of its
    /// checkpoints (each: time, counter, the draw integrated from there): what the
    /// counter read or would have read then, for tests that check what an agent
    /// attributed. `None` before the first logged checkpoint or without a log.
    pub fn energy_at_unix_ms(&self, index: u32, at_unix_ms: u64) -> Result<Option<f64>, SimError> {
        let path = self.energy_log_path(index);
        let text = match fs::read_to_string(&path) {
            Ok(t) => t,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
            Err(e) => return Err(io_err(&path)(e)),
        };
        let mut best: Option<(u64, f64, u32)> = None;
        for line in text.lines() {
            let mut fields = line.split_whitespace();
            let parsed = (|| {
                let t: u64 = fields.next()?.parse().ok()?;
                let e: f64 = fields.next()?.parse().ok()?;
                let mw: u32 = fields.next()?.parse().ok()?;
                Some((t, e, mw))
            })();
            // A line cut short by a crash mid-append is skipped.
            let Some((t, e, mw)) = parsed else { continue };
            if t <= at_unix_ms && best.is_none_or(|(bt, _, _)| t >= bt) {
                best = Some((t, e, mw));
            }
        }
        Ok(best.map(|(t, e, mw)| e + f64::from(mw) * (at_unix_ms - t) as f64 / 1000.0))
    }

    /// Changes GPU `index` under its lock: the energy checkpoint is advanced first, so
    /// the change affects only energy from now on.
    pub fn update<T>(
        &self,
        index: u32,
        change: impl FnOnce(&mut GpuState) -> Result<T, SimError>,
    ) -> Result<T, SimError> {
        let path = self.gpu_path(index)?;
        let _lock = FileLock::acquire(&self.dir.join(SHARED_DIR).join(format!("gpu{index}.lock")))?;
        let mut gpu = self.gpu(index)?;
        gpu.checkpoint(self.model, unix_ms());
        let result = change(&mut gpu)?;
        gpu.loaded_at_checkpoint = gpu.loaded().is_some();
        write_atomic(&path, &to_json(&gpu, &path)?)?;
        self.log_checkpoint(index, &gpu);
        Ok(result)
    }

    /// Appends the checkpoint just written to the GPU's energy log (under its lock), so a
    /// test can recompute the counter at any past instant ([`Node::energy_at_unix_ms`]).
    /// Best effort: the log is a test aid, never what the counter reads.
    fn log_checkpoint(&self, index: u32, gpu: &GpuState) {
        use std::io::Write;
        use std::os::unix::fs::OpenOptionsExt;
        let path = self.energy_log_path(index);
        let line = format!(
            "{} {:.3} {}\n",
            gpu.checkpoint_unix_ms,
            gpu.energy_mj,
            gpu.counted_draw_mw(self.model)
        );
        // Every simulated job (its user) appends to it, as to the GPU's state file.
        let opened = fs::OpenOptions::new()
            .create(true)
            .append(true)
            .mode(0o666)
            .open(&path);
        if let Ok(mut file) = opened {
            let _ = file.write_all(line.as_bytes());
        }
    }

    /// `nvmlDeviceSetPowerManagementLimit`: root only, within the constraints.
    pub fn set_power_limit(&self, index: u32, limit_mw: u32, euid: u32) -> Result<(), SimError> {
        let gpu = self.gpu(index)?;
        match gpu.fault {
            Some(Fault::GpuLost | Fault::Timeout | Fault::NoPermission) => {
                return Err(SimError::Fault {
                    index,
                    fault: gpu.fault.unwrap_or(Fault::GpuLost),
                })
            }
            None => {}
        }
        if euid != 0 {
            return Err(SimError::NoPermission);
        }
        let (min_mw, max_mw) = (self.model.min_limit_mw, self.model.max_limit_mw);
        if !(min_mw..=max_mw).contains(&limit_mw) {
            return Err(SimError::LimitOutOfRange {
                requested_mw: limit_mw,
                min_mw,
                max_mw,
            });
        }
        let limit = self.limit_path(index);
        self.update(index, |gpu| {
            // Under the GPU's lock, after the energy checkpoint at the old limit.
            write_limit(&limit, limit_mw)?;
            gpu.power_limit_mw = limit_mw;
            Ok(())
        })
    }

    /// Puts `workload` on the GPUs `indices`. A GPU held by another live process is
    /// refused; a claim left by a dead process is replaced.
    pub fn claim(&self, indices: &[u32], workload: &Workload) -> Result<(), SimError> {
        for &index in indices {
            self.update(index, |gpu| {
                if let Some(other) = gpu.running() {
                    if other.pid != workload.pid {
                        return Err(SimError::Busy {
                            index,
                            job_id: other.job_id.clone(),
                            pid: other.pid,
                        });
                    }
                }
                gpu.workload = Some(workload.clone());
                Ok(())
            })?;
        }
        Ok(())
    }

    /// Takes the workload of process `pid` off every GPU it holds.
    pub fn release(&self, pid: u32) -> Result<u32, SimError> {
        let mut released = 0;
        for index in 0..self.info.gpu_count {
            let holds = self
                .gpu(index)?
                .workload
                .as_ref()
                .is_some_and(|w| w.pid == pid);
            if holds {
                self.update(index, |gpu| {
                    gpu.workload = None;
                    Ok(())
                })?;
                released += 1;
            }
        }
        Ok(released)
    }

    /// Injects (or with `None` clears) a fault on GPU `index`.
    pub fn set_fault(&self, index: u32, fault: Option<Fault>) -> Result<(), SimError> {
        self.update(index, |gpu| {
            gpu.fault = fault;
            Ok(())
        })
    }
}

fn to_json<T: Serialize>(value: &T, path: &Path) -> Result<Vec<u8>, SimError> {
    serde_json::to_vec_pretty(value).map_err(|e| SimError::Corrupt {
        path: path.display().to_string(),
        message: e.to_string(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn scratch(name: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("pf-sim-{name}-{}", std::process::id()));
        let _ = fs::remove_dir_all(&dir);
        dir
    }

    fn physics() -> Physics {
        Physics {
            static_w: 150.0,
            dynamic_w: 530.0,
            clock_exponent: 2.0,
            knee_clock_fraction: 0.75,
            memory_bound_fraction: 0.3,
            min_clock_fraction: 0.05,
        }
    }

    #[test]
    fn init_open_and_identities() {
        let dir = scratch("init");
        let node = Node::init(&dir, "n1", "h200", 4, false).expect("init");
        assert_eq!(node.gpu_count(), 4);
        assert!(matches!(
            Node::init(&dir, "n1", "H200", 4, false),
            Err(SimError::Exists { .. })
        ));
        let again = Node::open(&dir).expect("open");
        assert_eq!(again.model().nvml_name, "NVIDIA H200");
        let a = again.gpu(0).expect("gpu0");
        let b = again.gpu(1).expect("gpu1");
        assert_ne!(a.uuid, b.uuid);
        assert!(
            a.uuid.starts_with("GPU-") && a.uuid.len() == 40,
            "{}",
            a.uuid
        );
        assert_eq!(again.index_of_uuid(&b.uuid).expect("found"), 1);
        assert!(matches!(
            again.gpu(4),
            Err(SimError::NoSuchGpu { index: 4, count: 4 })
        ));
        // Another node name gives other UUIDs.
        let other = Node::init(&scratch("init-other"), "n2", "H200", 1, false).expect("init");
        assert_ne!(other.gpu(0).expect("gpu").uuid, a.uuid);
        let _ = fs::remove_dir_all(&dir);
    }

    #[test]
    fn limits_need_root_and_range() {
        let dir = scratch("limits");
        let node = Node::init(&dir, "n1", "H200", 1, false).expect("init");
        assert!(matches!(
            node.set_power_limit(0, 500_000, 1000),
            Err(SimError::NoPermission)
        ));
        assert!(matches!(
            node.set_power_limit(0, 150_000, 0),
            Err(SimError::LimitOutOfRange {
                requested_mw: 150_000,
                ..
            })
        ));
        node.set_power_limit(0, 450_000, 0).expect("set");
        assert_eq!(node.gpu(0).expect("gpu").power_limit_mw, 450_000);
        node.set_fault(0, Some(Fault::NoPermission)).expect("fault");
        assert!(matches!(
            node.set_power_limit(0, 500_000, 0),
            Err(SimError::Fault { .. })
        ));
        let _ = fs::remove_dir_all(&dir);
    }

    #[test]
    fn busy_gpu_draws_its_demand_never_above_the_cap() {
        let dir = scratch("busy");
        let node = Node::init(&dir, "n1", "H200", 1, false).expect("init");
        let workload = Workload {
            job_id: "42".into(),
            pid: std::process::id(),
            profile: "test".into(),
            physics: physics(),
            table: None,
            memory_used_bytes: 100 << 30,
            idle: false,
        };
        node.claim(&[0], &workload).expect("claim");
        let (_, uncapped) = node.reading(0).expect("reading");
        assert!(uncapped.busy && !uncapped.power_capped);
        assert_eq!(uncapped.steady_power_mw, 680_000, "{uncapped:?}");
        node.set_power_limit(0, 300_000, 0).expect("cap");
        for _ in 0..20 {
            let (_, r) = node.reading(0).expect("reading");
            assert!(r.power_mw <= 300_000, "{r:?}");
            assert!(r.power_capped && r.sm_clock_fraction_ok(uncapped.sm_clock_mhz));
            assert_eq!(
                r.memory_clock_mhz, uncapped.memory_clock_mhz,
                "memory clock stays"
            );
            assert!(r.relative_throughput < 1.0);
        }
        assert_eq!(node.release(std::process::id()).expect("release"), 1);
        let (_, idle) = node.reading(0).expect("reading");
        assert!(!idle.busy);
        assert_eq!(idle.steady_power_mw, 75_000);
        let _ = fs::remove_dir_all(&dir);
    }

    #[test]
    fn an_idle_phase_holds_the_gpu_at_idle_power_and_a_new_claim_switches_the_load() {
        let dir = scratch("phase");
        let node = Node::init(&dir, "n1", "H200", 1, false).expect("init");
        let mut w = Workload {
            job_id: "7".into(),
            pid: std::process::id(),
            profile: "idle".into(),
            physics: physics(),
            table: None,
            memory_used_bytes: 1,
            idle: true,
        };
        node.claim(&[0], &w).expect("claim idle");
        let (gpu, idle) = node.reading(0).expect("reading");
        assert!(!idle.busy, "{idle:?}");
        assert_eq!(idle.steady_power_mw, 75_000);
        assert_eq!(idle.job_id.as_deref(), Some("7"), "the job keeps its GPU");
        assert!(gpu.running().is_some());
        // The same process claims again with load: the phase changes in place.
        w.idle = false;
        node.claim(&[0], &w).expect("claim loaded");
        let (_, loaded) = node.reading(0).expect("reading");
        assert!(loaded.busy);
        assert_eq!(loaded.steady_power_mw, 680_000, "{loaded:?}");
        let _ = fs::remove_dir_all(&dir);
    }

    /// `scontrol suspend` stops a job's processes: its GPUs fall to idle draw and stay
    /// its own; resumed, the load is back.
    #[test]
    fn a_stopped_job_draws_idle_power_and_keeps_its_gpu() {
        use std::process::Command;
        let dir = scratch("stopped");
        let node = Node::init(&dir, "n1", "H200", 1, false).expect("init");
        let mut child = Command::new("sleep").arg("60").spawn().expect("sleep");
        let pid = child.id();
        let w = Workload {
            job_id: "9".into(),
            pid,
            profile: "test".into(),
            physics: physics(),
            table: None,
            memory_used_bytes: 1,
            idle: false,
        };
        node.claim(&[0], &w).expect("claim");
        assert!(node.reading(0).expect("reading").1.busy);
        let signal = |sig: &str| {
            let ok = Command::new("kill")
                .args([sig, &pid.to_string()])
                .status()
                .expect("kill");
            assert!(ok.success());
        };
        signal("-STOP");
        // The kernel marks the process stopped once the signal is delivered.
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
        while !is_stopped(pid) && std::time::Instant::now() < deadline {
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
        let (gpu, stopped) = node.reading(0).expect("reading");
        assert!(!stopped.busy, "{stopped:?}");
        assert_eq!(stopped.steady_power_mw, 75_000);
        assert_eq!(stopped.job_id.as_deref(), Some("9"), "still the job's GPU");
        assert!(gpu.running().is_some());
        signal("-CONT");
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
        while is_stopped(pid) && std::time::Instant::now() < deadline {
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
        assert!(node.reading(0).expect("reading").1.busy, "resumed");
        let _ = child.kill();
        let _ = child.wait();
        let _ = fs::remove_dir_all(&dir);
    }

    #[test]
    fn the_counter_never_runs_backwards_when_a_workload_dies_and_its_log_recomputes_it() {
        let dir = scratch("monotonic");
        let node = Node::init(&dir, "n1", "H200", 1, false).expect("init");
        let mut child = std::process::Command::new("sleep")
            .arg("30")
            .spawn()
            .expect("sleep");
        let workload = Workload {
            job_id: "7".into(),
            pid: child.id(),
            profile: "test".into(),
            physics: physics(),
            table: None,
            memory_used_bytes: 1 << 30,
            idle: false,
        };
        node.claim(&[0], &workload).expect("claim");
        std::thread::sleep(std::time::Duration::from_millis(200));
        let (_, loaded) = node.reading(0).expect("reading");
        assert!(loaded.busy);
        child.kill().expect("kill");
        child.wait().expect("reaped");
        // The counter must not fall when the job ends: recomputing it at idle draw over
        // the whole time since the claim would make it do so.
        let mut last = loaded.energy_mj;
        for _ in 0..5 {
            std::thread::sleep(std::time::Duration::from_millis(20));
            let (_, r) = node.reading(0).expect("reading");
            assert!(!r.busy);
            assert!(r.energy_mj >= last, "{} then {}", last, r.energy_mj);
            last = r.energy_mj;
        }
        // The log gives the counter at any instant: at a reading's own time it is what
        // that reading says, to the millisecond's draw.
        let now = unix_ms();
        let (gpu, r) = node.reading(0).expect("reading");
        let from_log = node
            .energy_at_unix_ms(0, now)
            .expect("log")
            .expect("logged");
        let slack = f64::from(gpu.counted_draw_mw(node.model())) * 2.0 / 1000.0 + 1.0;
        assert!(
            (from_log - r.energy_mj as f64).abs() <= slack,
            "log {from_log} reading {}",
            r.energy_mj
        );
        assert_eq!(node.energy_at_unix_ms(0, 0).expect("log"), None);
        let _ = fs::remove_dir_all(&dir);
    }

    #[test]
    fn energy_integrates_power_over_time() {
        let model = models::find("H200").expect("model");
        let mut gpu = GpuState::new("n1", 0, model, 1_000);
        // Idle 75 W for 2 s = 150 J = 150,000 mJ.
        assert_eq!(gpu.reading(model, 3_000).energy_mj, 150_000);
        gpu.checkpoint(model, 3_000);
        gpu.power_limit_mw = 60_000; // below idle: the limit holds the draw
        assert_eq!(gpu.reading(model, 4_000).energy_mj, 150_000 + 60_000);
        // A clock going backwards never makes energy fall.
        gpu.checkpoint(model, 2_000);
        assert!(gpu.reading(model, 2_500).energy_mj >= 150_000);
    }

    #[test]
    fn claims_of_dead_processes_are_ignored_and_replaced() {
        let dir = scratch("dead");
        let node = Node::init(&dir, "n1", "H200", 1, false).expect("init");
        let mut w = Workload {
            job_id: "1".into(),
            pid: u32::MAX - 1, // no such process
            profile: "test".into(),
            physics: physics(),
            table: None,
            memory_used_bytes: 1,
            idle: false,
        };
        node.claim(&[0], &w).expect("claim");
        assert!(!node.reading(0).expect("reading").1.busy);
        w.pid = std::process::id();
        node.claim(&[0], &w).expect("dead claim replaced");
        let mut other = w.clone();
        other.pid = 1; // init: alive, another process
        assert!(matches!(
            node.claim(&[0], &other),
            Err(SimError::Busy { .. })
        ));
        let _ = fs::remove_dir_all(&dir);
    }

    #[test]
    fn concurrent_writers_and_readers_never_see_a_torn_gpu() {
        let dir = scratch("concurrent");
        let node = Node::init(&dir, "n1", "H200", 1, false).expect("init");
        std::thread::scope(|scope| {
            for t in 0..4u32 {
                let node = node.clone();
                scope.spawn(move || {
                    for i in 0..50u32 {
                        let mw = 200_000 + (t * 50 + i) * 1_000;
                        node.update(0, |gpu| {
                            gpu.power_limit_mw = mw;
                            gpu.serial = format!("w{t}-{i}");
                            Ok(())
                        })
                        .expect("update");
                    }
                });
            }
            for _ in 0..2 {
                let node = node.clone();
                scope.spawn(move || {
                    for _ in 0..200 {
                        // Every read parses: a reader sees the old file or the new one whole.
                        let gpu = node.gpu(0).expect("whole file");
                        assert!(
                            (200_000..=400_000).contains(&gpu.power_limit_mw)
                                || gpu.power_limit_mw == 700_000
                        );
                    }
                });
            }
        });
        // 200 serialised read-modify-writes, none lost: the energy checkpoint only grows.
        let gpu = node.gpu(0).expect("gpu");
        assert!(gpu.serial.starts_with('w'));
        let _ = fs::remove_dir_all(&dir);
    }

    trait ClockCheck {
        fn sm_clock_fraction_ok(&self, uncapped_mhz: u32) -> bool;
    }

    impl ClockCheck for GpuReading {
        fn sm_clock_fraction_ok(&self, uncapped_mhz: u32) -> bool {
            self.sm_clock_mhz < uncapped_mhz
        }
    }

    /// Simulated jobs run as their users and must write the GPU files, but
    /// the simulated GPUs must not become a way around NVML's root-only limit write.
    #[test]
    fn what_jobs_write_never_sets_a_limit() {
        use std::os::unix::fs::PermissionsExt;
        let dir = scratch("limits");
        let node = Node::init(&dir, "n1", "H200", 2, true).expect("init");
        let mode = |p: &Path| fs::metadata(p).expect("meta").permissions().mode() & 0o7777;
        assert_eq!(mode(&dir), 0o755, "only root writes the node directory");
        assert_eq!(mode(&dir.join(SHARED_DIR)), 0o777);
        assert_eq!(mode(&dir.join(SHARED_DIR).join("gpu0.lock")), 0o666);
        // A job's write of the shared file, limit field included, changes no limit.
        node.update(0, |gpu| {
            gpu.power_limit_mw = 1;
            Ok(())
        })
        .expect("a job's write");
        assert_eq!(node.gpu(0).expect("gpu").power_limit_mw, 700_000);
        assert!(
            matches!(
                node.set_power_limit(0, 450_000, 1000),
                Err(SimError::NoPermission)
            ),
            "a user's NVML call"
        );
        node.set_power_limit(0, 450_000, 0).expect("root's");
        assert_eq!(node.gpu(0).expect("gpu").power_limit_mw, 450_000);
        assert_eq!(
            fs::read_to_string(dir.join("gpu0.limit")).expect("limit"),
            "450000\n"
        );
        assert_eq!(node.gpu(1).expect("gpu").power_limit_mw, 700_000);
        let _ = fs::remove_dir_all(&dir);
    }
}
