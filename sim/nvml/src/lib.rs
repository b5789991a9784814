//! An NVML-compatible shared library over powerflex's SIMULATED GPUs.
//!
//! It exports the NVML C functions the node agent uses and the ones an ordinary NVML
//! client needs to find devices, with the names the real `libnvidia-ml.so.1` exports
//! (`_v2` variants included), NVML's units (mW, mJ, MHz, bytes) and NVML's return codes.
//! `nvml-wrapper` loads it with `Nvml::builder().lib_path(...)`; NVIDIA's Python bindings
//! load it as `libnvidia-ml.so.1` from `LD_LIBRARY_PATH` (a symlink to this file).
//!
//! Which node's GPUs it shows is chosen at `nvmlInit*` by `POWERFLEX_SIM_DIR` (`%n` =
//! `SLURMD_NODENAME`); see `powerflex_sim::state`. Device names end in "(simulated)".
//!
//! Rules every entry point follows: no panic crosses the C boundary (each body runs under
//! `catch_unwind` and a panic becomes `NVML_ERROR_UNKNOWN`); null out-pointers are
//! `NVML_ERROR_INVALID_ARGUMENT`; calls before `nvmlInit*` are `NVML_ERROR_UNINITIALIZED`.

// This crate is an FFI boundary: it must take raw pointers from C callers.
#![allow(unsafe_code)]
#![allow(non_snake_case)]
// NVML's C names, as the bindings spell them.
#![allow(non_upper_case_globals)]
// Every export is `unsafe extern "C"`: its safety contract is NVML's own (valid device
// handles from this library, out-pointers to caller-owned values, buffers of the stated
// length), stated once here rather than on each of the forty functions.
#![allow(clippy::missing_safety_doc)]

use std::ffi::{c_char, c_uint, c_ulonglong, CStr};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::{Mutex, PoisonError};

use nvml_wrapper_sys::bindings::*;
use powerflex_sim::state::{Fault, GpuReading, GpuState, Node};
use powerflex_sim::SimError;

/// Driver version the library reports (a real 550-series number, so clients that parse
/// it keep working; the device names carry the "simulated" label).
const DRIVER_VERSION: &str = "550.54.15";
const NVML_VERSION: &str = "12.550.54.15";

/// Most devices one simulated node may have.
const MAX_DEVICES: usize = 64;

/// Handles are addresses inside this array: distinct, stable, and checkable.
static HANDLES: [u8; MAX_DEVICES] = [0; MAX_DEVICES];

/// Library state: the init reference count and the node opened by the first init.
static STATE: Mutex<Option<(u32, Node)>> = Mutex::new(None);

type Code = nvmlReturn_t;

const SUCCESS: Code = nvmlReturn_enum_NVML_SUCCESS;
const INVALID: Code = nvmlReturn_enum_NVML_ERROR_INVALID_ARGUMENT;

/// Runs `body`, turning a panic into `NVML_ERROR_UNKNOWN`.
fn guard(body: impl FnOnce() -> Code) -> Code {
    catch_unwind(AssertUnwindSafe(body)).unwrap_or(nvmlReturn_enum_NVML_ERROR_UNKNOWN)
}

fn sim_code(e: &SimError) -> Code {
    match e {
        SimError::NoStateDir
        | SimError::NoNodeName
        | SimError::NotANode { .. }
        | SimError::UnknownModel(_) => nvmlReturn_enum_NVML_ERROR_DRIVER_NOT_LOADED,
        SimError::NoSuchGpu { .. } | SimError::LimitOutOfRange { .. } => INVALID,
        SimError::NoSuchUuid(_) => nvmlReturn_enum_NVML_ERROR_NOT_FOUND,
        SimError::NoPermission => nvmlReturn_enum_NVML_ERROR_NO_PERMISSION,
        SimError::Fault { fault, .. } => fault_code(*fault),
        SimError::Busy { .. } => nvmlReturn_enum_NVML_ERROR_IN_USE,
        SimError::Corrupt { .. }
        | SimError::Io { .. }
        | SimError::Plumbing(_)
        | SimError::Exists { .. } => nvmlReturn_enum_NVML_ERROR_UNKNOWN,
    }
}

fn fault_code(fault: Fault) -> Code {
    match fault {
        Fault::GpuLost => nvmlReturn_enum_NVML_ERROR_GPU_IS_LOST,
        Fault::Timeout => nvmlReturn_enum_NVML_ERROR_TIMEOUT,
        Fault::NoPermission => nvmlReturn_enum_NVML_ERROR_NO_PERMISSION,
    }
}

fn node() -> Result<Node, Code> {
    STATE
        .lock()
        .unwrap_or_else(PoisonError::into_inner)
        .as_ref()
        .map(|(_, node)| node.clone())
        .ok_or(nvmlReturn_enum_NVML_ERROR_UNINITIALIZED)
}

fn handle_for(index: u32) -> nvmlDevice_t {
    HANDLES
        .as_ptr()
        .wrapping_add(index as usize)
        .cast_mut()
        .cast()
}

fn index_of(device: nvmlDevice_t) -> Option<u32> {
    let base = HANDLES.as_ptr() as usize;
    let offset = (device as usize).checked_sub(base)?;
    (offset < MAX_DEVICES).then_some(offset as u32)
}

/// The node and the GPU state behind `device`, with device faults applied: a lost GPU
/// or a timing-out one fails every call, as a real driver's would.
fn device_state(device: nvmlDevice_t) -> Result<(Node, GpuState), Code> {
    let node = node()?;
    let index = index_of(device).ok_or(INVALID)?;
    let gpu = node.gpu(index).map_err(|e| sim_code(&e))?;
    match gpu.fault {
        Some(f @ (Fault::GpuLost | Fault::Timeout)) => Err(fault_code(f)),
        _ => Ok((node, gpu)),
    }
}

fn reading(device: nvmlDevice_t) -> Result<(Node, GpuState, GpuReading), Code> {
    let (node, gpu) = device_state(device)?;
    let r = gpu.reading(node.model(), powerflex_sim::state::unix_ms());
    Ok((node, gpu, r))
}

/// Writes `value` through `out` when the pointer is usable.
fn put<T>(out: *mut T, value: T) -> Code {
    if out.is_null() {
        return INVALID;
    }
    // SAFETY: the caller passed a non-null pointer to a `T` it owns, per the NVML API.
    unsafe { out.write(value) };
    SUCCESS
}

/// Copies `text` and a NUL into the caller's buffer of `length` bytes.
fn put_str(buffer: *mut c_char, length: c_uint, text: &str) -> Code {
    if buffer.is_null() {
        return INVALID;
    }
    let bytes = text.as_bytes();
    if bytes.len() + 1 > length as usize {
        return nvmlReturn_enum_NVML_ERROR_INSUFFICIENT_SIZE;
    }
    // SAFETY: `buffer` holds `length` bytes (NVML API contract) and we write at most
    // `bytes.len() + 1 <= length` of them.
    unsafe {
        std::ptr::copy_nonoverlapping(bytes.as_ptr(), buffer.cast::<u8>(), bytes.len());
        buffer.add(bytes.len()).write(0);
    }
    SUCCESS
}

fn read_cstr<'a>(text: *const c_char) -> Option<&'a str> {
    if text.is_null() {
        return None;
    }
    // SAFETY: non-null, NUL-terminated per the NVML API contract.
    unsafe { CStr::from_ptr(text) }.to_str().ok()
}

/// Runs `f` on a device's reading, storing what it returns through `out`.
fn with_reading<T>(
    device: nvmlDevice_t,
    out: *mut T,
    f: impl FnOnce(&Node, &GpuState, &GpuReading) -> T,
) -> Code {
    guard(|| {
        if out.is_null() {
            return INVALID;
        }
        match reading(device) {
            Ok((node, gpu, r)) => put(out, f(&node, &gpu, &r)),
            Err(code) => code,
        }
    })
}

fn init() -> Code {
    guard(|| {
        let mut state = STATE.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some((count, _)) = state.as_mut() {
            *count += 1;
            return SUCCESS;
        }
        match Node::open_from_env() {
            Ok(node) if node.gpu_count() as usize <= MAX_DEVICES => {
                *state = Some((1, node));
                SUCCESS
            }
            Ok(_) => nvmlReturn_enum_NVML_ERROR_UNKNOWN,
            Err(e) => sim_code(&e),
        }
    })
}

// ----- library -------------------------------------------------------------------------

#[no_mangle]
pub unsafe extern "C" fn nvmlInit_v2() -> Code {
    init()
}

#[no_mangle]
pub unsafe extern "C" fn nvmlInit() -> Code {
    init()
}

#[no_mangle]
pub unsafe extern "C" fn nvmlInitWithFlags(_flags: c_uint) -> Code {
    init()
}

#[no_mangle]
pub unsafe extern "C" fn nvmlShutdown() -> Code {
    guard(|| {
        let mut state = STATE.lock().unwrap_or_else(PoisonError::into_inner);
        match state.as_mut() {
            None => nvmlReturn_enum_NVML_ERROR_UNINITIALIZED,
            Some((count, _)) if *count > 1 => {
                *count -= 1;
                SUCCESS
            }
            Some(_) => {
                *state = None;
                SUCCESS
            }
        }
    })
}

#[no_mangle]
pub unsafe extern "C" fn nvmlErrorString(result: Code) -> *const c_char {
    let text: &'static CStr = match result {
        nvmlReturn_enum_NVML_SUCCESS => c"Success",
        nvmlReturn_enum_NVML_ERROR_UNINITIALIZED => c"Uninitialized",
        nvmlReturn_enum_NVML_ERROR_INVALID_ARGUMENT => c"Invalid Argument",
        nvmlReturn_enum_NVML_ERROR_NOT_SUPPORTED => c"Not Supported",
        nvmlReturn_enum_NVML_ERROR_NO_PERMISSION => c"Insufficient Permissions",
        nvmlReturn_enum_NVML_ERROR_ALREADY_INITIALIZED => c"Already Initialized",
        nvmlReturn_enum_NVML_ERROR_NOT_FOUND => c"Not Found",
        nvmlReturn_enum_NVML_ERROR_INSUFFICIENT_SIZE => c"Insufficient Size",
        nvmlReturn_enum_NVML_ERROR_DRIVER_NOT_LOADED => {
            c"Driver Not Loaded (simulated: set POWERFLEX_SIM_DIR to a node made by powerflex-sim init)"
        }
        nvmlReturn_enum_NVML_ERROR_TIMEOUT => c"Timeout",
        nvmlReturn_enum_NVML_ERROR_GPU_IS_LOST => c"GPU is lost",
        nvmlReturn_enum_NVML_ERROR_IN_USE => c"In use by another client",
        nvmlReturn_enum_NVML_ERROR_ARGUMENT_VERSION_MISMATCH => c"Argument version mismatch",
        _ => c"Unknown Error",
    };
    text.as_ptr()
}

#[no_mangle]
pub unsafe extern "C" fn nvmlSystemGetDriverVersion(version: *mut c_char, length: c_uint) -> Code {
    guard(|| match node() {
        Ok(_) => put_str(version, length, DRIVER_VERSION),
        Err(code) => code,
    })
}

#[no_mangle]
pub unsafe extern "C" fn nvmlSystemGetNVMLVersion(version: *mut c_char, length: c_uint) -> Code {
    guard(|| put_str(version, length, NVML_VERSION))
}

// ----- enumeration ---------------------------------------------------------------------

#[no_mangle]
pub unsafe extern "C" fn nvmlDeviceGetCount_v2(count: *mut c_uint) -> Code {
    guard(|| match node() {
        Ok(node) => put(count, node.gpu_count()),
        Err(code) => code,
    })
}

#[no_mangle]
pub unsafe extern "C" fn nvmlDeviceGetCount(count: *mut c_uint) -> Code {
    unsafe { nvmlDeviceGetCount_v2(count) }
}

#[no_mangle]
pub unsafe extern "C" fn nvmlDeviceGetHandleByIndex_v2(
    index: c_uint,
    device: *mut nvmlDevice_t,
) -> Code {
    guard(|| {
        let node = match node() {
            Ok(n) => n,
            Err(code) => return code,
        };
        if device.is_null() || index >= node.gpu_count() {
            return INVALID;
        }
        match node.gpu(index) {
            Ok(gpu) if gpu.fault == Some(Fault::GpuLost) => nvmlReturn_enum_NVML_ERROR_GPU_IS_LOST,
            Ok(_) => put(device, handle_for(index)),
            Err(e) => sim_code(&e),
        }
    })
}

#[no_mangle]
pub unsafe extern "C" fn nvmlDeviceGetHandleByIndex(
    index: c_uint,
    device: *mut nvmlDevice_t,
) -> Code {
    unsafe { nvmlDeviceGetHandleByIndex_v2(index, device) }
}

/// Finds the device whose `field` equals `wanted`.
fn handle_by(
    wanted: *const c_char,
    device: *mut nvmlDevice_t,
    field: impl Fn(&GpuState, &str) -> bool,
) -> Code {
    guard(|| {
        let node = match node() {
            Ok(n) => n,
            Err(code) => return code,
        };
        let Some(wanted) = read_cstr(wanted) else {
            return INVALID;
        };
        if device.is_null() {
            return INVALID;
        }
        for index in 0..node.gpu_count() {
            match node.gpu(index) {
                Ok(gpu) if field(&gpu, wanted) => return put(device, handle_for(index)),
                Ok(_) => {}
                Err(e) => return sim_code(&e),
            }
        }
        nvmlReturn_enum_NVML_ERROR_NOT_FOUND
    })
}

#[no_mangle]
pub unsafe extern "C" fn nvmlDeviceGetHandleByUUID(
    uuid: *const c_char,
    device: *mut nvmlDevice_t,
) -> Code {
    handle_by(uuid, device, |gpu, wanted| gpu.uuid == wanted)
}

#[no_mangle]
pub unsafe extern "C" fn nvmlDeviceGetHandleBySerial(
    serial: *const c_char,
    device: *mut nvmlDevice_t,
) -> Code {
    handle_by(serial, device, |gpu, wanted| gpu.serial == wanted)
}

/// PCI bus ids match however the domain is written (`0000:18:00.0`, `00000000:18:00.0`).
fn same_bus_id(a: &str, b: &str) -> bool {
    let norm = |s: &str| -> String {
        let s = s.to_ascii_lowercase();
        match s.split_once(':') {
            Some((domain, rest)) if rest.contains(':') => {
                format!(
                    "{:08x}:{rest}",
                    u32::from_str_radix(domain, 16).unwrap_or(u32::MAX)
                )
            }
            _ => format!("00000000:{s}"),
        }
    };
    norm(a) == norm(b)
}

#[no_mangle]
pub unsafe extern "C" fn nvmlDeviceGetHandleByPciBusId_v2(
    bus_id: *const c_char,
    device: *mut nvmlDevice_t,
) -> Code {
    handle_by(bus_id, device, |gpu, wanted| {
        same_bus_id(&gpu.pci_bus_id, wanted)
    })
}

#[no_mangle]
pub unsafe extern "C" fn nvmlDeviceGetHandleByPciBusId(
    bus_id: *const c_char,
    device: *mut nvmlDevice_t,
) -> Code {
    unsafe { nvmlDeviceGetHandleByPciBusId_v2(bus_id, device) }
}

// ----- identity ------------------------------------------------------------------------

fn with_text(
    device: nvmlDevice_t,
    buffer: *mut c_char,
    length: c_uint,
    text: impl FnOnce(&Node, &GpuState) -> String,
) -> Code {
    guard(|| match device_state(device) {
        Ok((node, gpu)) => put_str(buffer, length, &text(&node, &gpu)),
        Err(code) => code,
    })
}

#[no_mangle]
pub unsafe extern "C" fn nvmlDeviceGetName(
    device: nvmlDevice_t,
    name: *mut c_char,
    length: c_uint,
) -> Code {
    with_text(device, name, length, |node, _| {
        format!("{} (simulated)", node.model().nvml_name)
    })
}

#[no_mangle]
pub unsafe extern "C" fn nvmlDeviceGetUUID(
    device: nvmlDevice_t,
    uuid: *mut c_char,
    length: c_uint,
) -> Code {
    with_text(device, uuid, length, |_, gpu| gpu.uuid.clone())
}

#[no_mangle]
pub unsafe extern "C" fn nvmlDeviceGetSerial(
    device: nvmlDevice_t,
    serial: *mut c_char,
    length: c_uint,
) -> Code {
    with_text(device, serial, length, |_, gpu| gpu.serial.clone())
}

#[no_mangle]
pub unsafe extern "C" fn nvmlDeviceGetIndex(device: nvmlDevice_t, index: *mut c_uint) -> Code {
    guard(|| match device_state(device) {
        Ok((_, gpu)) => put(index, gpu.index),
        Err(code) => code,
    })
}

fn fill_chars<const N: usize>(text: &str) -> [c_char; N] {
    let mut out = [0 as c_char; N];
    for (slot, byte) in out.iter_mut().zip(text.bytes().take(N - 1)) {
        *slot = byte as c_char;
    }
    out
}

#[no_mangle]
pub unsafe extern "C" fn nvmlDeviceGetPciInfo_v3(
    device: nvmlDevice_t,
    pci: *mut nvmlPciInfo_t,
) -> Code {
    guard(|| match device_state(device) {
        Ok((node, gpu)) => {
            let mut parts = gpu.pci_bus_id.split([':', '.']);
            let mut next = || {
                parts
                    .next()
                    .and_then(|p| u32::from_str_radix(p, 16).ok())
                    .unwrap_or(0)
            };
            let (domain, bus, dev) = (next(), next(), next());
            let legacy = format!("{:04x}:{:02x}:{:02x}.0", domain, bus, dev).to_ascii_uppercase();
            put(
                pci,
                nvmlPciInfo_t {
                    busIdLegacy: fill_chars::<16>(&legacy),
                    domain,
                    bus,
                    device: dev,
                    pciDeviceId: node.model().pci_device_id,
                    pciSubSystemId: 0x1845_10DE,
                    busId: fill_chars::<32>(&gpu.pci_bus_id),
                },
            )
        }
        Err(code) => code,
    })
}

// ----- power ---------------------------------------------------------------------------

#[no_mangle]
pub unsafe extern "C" fn nvmlDeviceGetPowerUsage(device: nvmlDevice_t, power: *mut c_uint) -> Code {
    with_reading(device, power, |_, _, r| r.power_mw)
}

#[no_mangle]
pub unsafe extern "C" fn nvmlDeviceGetTotalEnergyConsumption(
    device: nvmlDevice_t,
    energy: *mut c_ulonglong,
) -> Code {
    with_reading(device, energy, |_, _, r| r.energy_mj)
}

#[no_mangle]
pub unsafe extern "C" fn nvmlDeviceGetPowerManagementLimit(
    device: nvmlDevice_t,
    limit: *mut c_uint,
) -> Code {
    with_reading(device, limit, |_, gpu, _| gpu.power_limit_mw)
}

#[no_mangle]
pub unsafe extern "C" fn nvmlDeviceGetEnforcedPowerLimit(
    device: nvmlDevice_t,
    limit: *mut c_uint,
) -> Code {
    // No other limiter in the simulation: the enforced limit is the set one.
    with_reading(device, limit, |_, gpu, _| gpu.power_limit_mw)
}

#[no_mangle]
pub unsafe extern "C" fn nvmlDeviceGetPowerManagementDefaultLimit(
    device: nvmlDevice_t,
    limit: *mut c_uint,
) -> Code {
    with_reading(device, limit, |node, _, _| node.model().default_limit_mw)
}

#[no_mangle]
pub unsafe extern "C" fn nvmlDeviceGetPowerManagementLimitConstraints(
    device: nvmlDevice_t,
    min_limit: *mut c_uint,
    max_limit: *mut c_uint,
) -> Code {
    guard(|| {
        if min_limit.is_null() || max_limit.is_null() {
            return INVALID;
        }
        match device_state(device) {
            Ok((node, _)) => {
                put(min_limit, node.model().min_limit_mw);
                put(max_limit, node.model().max_limit_mw)
            }
            Err(code) => code,
        }
    })
}

#[no_mangle]
pub unsafe extern "C" fn nvmlDeviceGetPowerManagementMode(
    device: nvmlDevice_t,
    mode: *mut nvmlEnableState_t,
) -> Code {
    with_reading(device, mode, |_, _, _| {
        nvmlEnableState_enum_NVML_FEATURE_ENABLED
    })
}

#[no_mangle]
pub unsafe extern "C" fn nvmlDeviceSetPowerManagementLimit(
    device: nvmlDevice_t,
    limit: c_uint,
) -> Code {
    guard(|| {
        let (node, gpu) = match device_state(device) {
            Ok(v) => v,
            Err(code) => return code,
        };
        // SAFETY: geteuid has no preconditions and cannot fail.
        let euid = unsafe { libc::geteuid() };
        match node.set_power_limit(gpu.index, limit, euid) {
            Ok(()) => SUCCESS,
            Err(e) => sim_code(&e),
        }
    })
}

// ----- clocks, utilisation, memory, temperature ------------------------------------------

#[no_mangle]
pub unsafe extern "C" fn nvmlDeviceGetClockInfo(
    device: nvmlDevice_t,
    kind: nvmlClockType_t,
    clock: *mut c_uint,
) -> Code {
    guard(|| match reading(device) {
        Ok((_, _, r)) => match kind {
            nvmlClockType_enum_NVML_CLOCK_GRAPHICS | nvmlClockType_enum_NVML_CLOCK_SM => {
                put(clock, r.sm_clock_mhz)
            }
            nvmlClockType_enum_NVML_CLOCK_MEM => put(clock, r.memory_clock_mhz),
            nvmlClockType_enum_NVML_CLOCK_VIDEO => put(clock, r.sm_clock_mhz * 9 / 10),
            _ => INVALID,
        },
        Err(code) => code,
    })
}

#[no_mangle]
pub unsafe extern "C" fn nvmlDeviceGetMaxClockInfo(
    device: nvmlDevice_t,
    kind: nvmlClockType_t,
    clock: *mut c_uint,
) -> Code {
    guard(|| match device_state(device) {
        Ok((node, _)) => {
            let m = node.model();
            match kind {
                nvmlClockType_enum_NVML_CLOCK_GRAPHICS | nvmlClockType_enum_NVML_CLOCK_SM => {
                    put(clock, m.max_sm_clock_mhz)
                }
                nvmlClockType_enum_NVML_CLOCK_MEM => put(clock, m.memory_clock_mhz),
                nvmlClockType_enum_NVML_CLOCK_VIDEO => put(clock, m.max_sm_clock_mhz * 9 / 10),
                _ => INVALID,
            }
        }
        Err(code) => code,
    })
}

#[no_mangle]
pub unsafe extern "C" fn nvmlDeviceGetUtilizationRates(
    device: nvmlDevice_t,
    utilization: *mut nvmlUtilization_t,
) -> Code {
    with_reading(device, utilization, |_, _, r| nvmlUtilization_t {
        gpu: r.gpu_util_pct,
        memory: r.memory_util_pct,
    })
}

#[no_mangle]
pub unsafe extern "C" fn nvmlDeviceGetMemoryInfo(
    device: nvmlDevice_t,
    memory: *mut nvmlMemory_t,
) -> Code {
    with_reading(device, memory, |node, _, r| {
        let total = node.model().memory_bytes;
        nvmlMemory_t {
            total,
            free: total.saturating_sub(r.memory_used_bytes),
            used: r.memory_used_bytes,
        }
    })
}

/// The processes with a compute context on the GPU: the simulated job's process while
/// it runs. NVML's contract: with `infos` null or `*count` too small, the needed count
/// goes to `*count` and the answer is `NVML_ERROR_INSUFFICIENT_SIZE` (`NVML_SUCCESS`
/// with 0 when nothing runs).
#[no_mangle]
pub unsafe extern "C" fn nvmlDeviceGetComputeRunningProcesses_v3(
    device: nvmlDevice_t,
    count: *mut c_uint,
    infos: *mut nvmlProcessInfo_t,
) -> Code {
    guard(|| {
        if count.is_null() {
            return INVALID;
        }
        let (_, gpu) = match device_state(device) {
            Ok(v) => v,
            Err(code) => return code,
        };
        let running: Vec<nvmlProcessInfo_t> = gpu
            .running()
            .map(|w| nvmlProcessInfo_t {
                pid: w.pid,
                usedGpuMemory: w.memory_used_bytes,
                // Not a MIG device: NVML's "invalid" instance ids.
                gpuInstanceId: u32::MAX,
                computeInstanceId: u32::MAX,
            })
            .into_iter()
            .collect();
        // SAFETY: non-null pointer to the caller's count.
        let room = unsafe { *count } as usize;
        put(count, running.len() as c_uint);
        if running.is_empty() {
            return SUCCESS;
        }
        if infos.is_null() || room < running.len() {
            return nvmlReturn_enum_NVML_ERROR_INSUFFICIENT_SIZE;
        }
        for (i, info) in running.into_iter().enumerate() {
            // SAFETY: the caller's array holds `room` >= running.len() entries.
            unsafe { infos.add(i).write(info) };
        }
        SUCCESS
    })
}

#[no_mangle]
pub unsafe extern "C" fn nvmlDeviceGetMemoryInfo_v2(
    device: nvmlDevice_t,
    memory: *mut nvmlMemory_v2_t,
) -> Code {
    guard(|| {
        if memory.is_null() {
            return INVALID;
        }
        // SAFETY: non-null pointer to the caller's struct; `version` is its first field.
        let version = unsafe { (*memory).version };
        if version >> 24 != 2 {
            return nvmlReturn_enum_NVML_ERROR_ARGUMENT_VERSION_MISMATCH;
        }
        match reading(device) {
            Ok((node, _, r)) => {
                let total = node.model().memory_bytes;
                let reserved = total / 200;
                put(
                    memory,
                    nvmlMemory_v2_t {
                        version,
                        total,
                        reserved,
                        free: total.saturating_sub(r.memory_used_bytes + reserved),
                        used: r.memory_used_bytes,
                    },
                )
            }
            Err(code) => code,
        }
    })
}

#[no_mangle]
pub unsafe extern "C" fn nvmlDeviceGetTemperature(
    device: nvmlDevice_t,
    sensor: nvmlTemperatureSensors_t,
    temp: *mut c_uint,
) -> Code {
    guard(|| {
        if sensor != nvmlTemperatureSensors_enum_NVML_TEMPERATURE_GPU {
            return INVALID;
        }
        match reading(device) {
            Ok((_, _, r)) => put(temp, r.temperature_c),
            Err(code) => code,
        }
    })
}

fn throttle_reasons(r: &GpuReading) -> c_ulonglong {
    let mut reasons = 0u64;
    if !r.busy {
        reasons |= u64::from(nvmlClocksThrottleReasonGpuIdle);
    }
    if r.power_capped {
        reasons |= u64::from(nvmlClocksThrottleReasonSwPowerCap);
    }
    reasons
}

#[no_mangle]
pub unsafe extern "C" fn nvmlDeviceGetCurrentClocksThrottleReasons(
    device: nvmlDevice_t,
    reasons: *mut c_ulonglong,
) -> Code {
    with_reading(device, reasons, |_, _, r| throttle_reasons(r))
}

#[no_mangle]
pub unsafe extern "C" fn nvmlDeviceGetCurrentClocksEventReasons(
    device: nvmlDevice_t,
    reasons: *mut c_ulonglong,
) -> Code {
    unsafe { nvmlDeviceGetCurrentClocksThrottleReasons(device, reasons) }
}

#[no_mangle]
pub unsafe extern "C" fn nvmlDeviceGetSupportedClocksThrottleReasons(
    device: nvmlDevice_t,
    reasons: *mut c_ulonglong,
) -> Code {
    with_reading(device, reasons, |_, _, _| {
        u64::from(nvmlClocksThrottleReasonGpuIdle | nvmlClocksThrottleReasonSwPowerCap)
    })
}

#[no_mangle]
pub unsafe extern "C" fn nvmlDeviceGetSupportedClocksEventReasons(
    device: nvmlDevice_t,
    reasons: *mut c_ulonglong,
) -> Code {
    unsafe { nvmlDeviceGetSupportedClocksThrottleReasons(device, reasons) }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bus_ids_match_across_domain_widths() {
        assert!(same_bus_id("00000000:18:00.0", "0000:18:00.0"));
        assert!(same_bus_id("00000000:18:00.0", "00000000:18:00.0"));
        assert!(!same_bus_id("00000000:18:00.0", "0000:28:00.0"));
    }

    #[test]
    fn handles_round_trip_and_reject_strangers() {
        for i in [0u32, 7, 63] {
            assert_eq!(index_of(handle_for(i)), Some(i));
        }
        assert_eq!(index_of(std::ptr::null_mut()), None);
        let stranger = 0x1000usize as nvmlDevice_t;
        assert_eq!(index_of(stranger), None);
    }

    #[test]
    fn strings_respect_buffer_size() {
        let mut buf = [0 as c_char; 4];
        assert_eq!(
            put_str(buf.as_mut_ptr(), 4, "abcd"),
            nvmlReturn_enum_NVML_ERROR_INSUFFICIENT_SIZE
        );
        assert_eq!(put_str(buf.as_mut_ptr(), 4, "abc"), SUCCESS);
        assert_eq!(buf[3], 0);
        assert_eq!(put_str(std::ptr::null_mut(), 4, "a"), INVALID);
    }
}
