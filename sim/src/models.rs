//! Simulated device models. Units as NVML reports them: milliwatts, MHz, bytes.

/// A GPU model as the simulator presents it through NVML.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DeviceModel {
    /// Short name used in configs and `powerflex-sim init --model`.
    pub key: &'static str,
    /// What `nvmlDeviceGetName` returns.
    pub nvml_name: &'static str,
    /// `nvmlDeviceGetPowerManagementLimitConstraints`, mW.
    pub min_limit_mw: u32,
    pub max_limit_mw: u32,
    /// `nvmlDeviceGetPowerManagementDefaultLimit`, mW (the TDP).
    pub default_limit_mw: u32,
    /// Draw with no work, mW.
    pub idle_mw: u32,
    /// Total memory, bytes.
    pub memory_bytes: u64,
    /// Highest SM clock, MHz; the idle SM clock, MHz.
    pub max_sm_clock_mhz: u32,
    pub idle_sm_clock_mhz: u32,
    /// Memory clock, MHz: unchanged by power caps (arXiv 2609.11542, Fig. 6).
    pub memory_clock_mhz: u32,
    /// PCI device id reported in the PCI info.
    pub pci_device_id: u32,
}

const MIB: u64 = 1024 * 1024;

/// The models the simulator knows. Limits as NVIDIA ships the SXM parts: 200–700 W.
pub const MODELS: [DeviceModel; 2] = [
    DeviceModel {
        key: "H200",
        nvml_name: "NVIDIA H200",
        min_limit_mw: 200_000,
        max_limit_mw: 700_000,
        default_limit_mw: 700_000,
        idle_mw: 75_000,
        memory_bytes: 143_771 * MIB,
        max_sm_clock_mhz: 1980,
        idle_sm_clock_mhz: 345,
        memory_clock_mhz: 3201,
        pci_device_id: 0x2335_10DE,
    },
    DeviceModel {
        key: "H100",
        nvml_name: "NVIDIA H100 80GB HBM3",
        min_limit_mw: 200_000,
        max_limit_mw: 700_000,
        default_limit_mw: 700_000,
        idle_mw: 70_000,
        memory_bytes: 81_559 * MIB,
        max_sm_clock_mhz: 1980,
        idle_sm_clock_mhz: 345,
        memory_clock_mhz: 2619,
        pci_device_id: 0x2330_10DE,
    },
];

/// Looks a model up by key, case-insensitively.
pub fn find(key: &str) -> Option<&'static DeviceModel> {
    MODELS.iter().find(|m| m.key.eq_ignore_ascii_case(key))
}

/// The known keys, for error messages.
pub fn known_names() -> String {
    MODELS.iter().map(|m| m.key).collect::<Vec<_>>().join(", ")
}
