"""A client we did not write: NVIDIA's Python NVML bindings (nvidia-ml-py) against the
simulated library. Run by tests/pynvml.rs with LD_LIBRARY_PATH pointing at a directory
where libnvidia-ml.so.1 is the simulator. Prints one JSON document."""
import json
import sys

import pynvml

out = {}
pynvml.nvmlInit()
out["driver"] = pynvml.nvmlSystemGetDriverVersion()
count = pynvml.nvmlDeviceGetCount()
out["count"] = count
gpus = []
for i in range(count):
    h = pynvml.nvmlDeviceGetHandleByIndex(i)
    lo, hi = pynvml.nvmlDeviceGetPowerManagementLimitConstraints(h)
    mem = pynvml.nvmlDeviceGetMemoryInfo(h)
    gpus.append({
        "name": pynvml.nvmlDeviceGetName(h),
        "uuid": pynvml.nvmlDeviceGetUUID(h),
        "power_mw": pynvml.nvmlDeviceGetPowerUsage(h),
        "limit_mw": pynvml.nvmlDeviceGetPowerManagementLimit(h),
        "default_mw": pynvml.nvmlDeviceGetPowerManagementDefaultLimit(h),
        "enforced_mw": pynvml.nvmlDeviceGetEnforcedPowerLimit(h),
        "min_mw": lo,
        "max_mw": hi,
        "energy_mj": pynvml.nvmlDeviceGetTotalEnergyConsumption(h),
        "memory_total": mem.total,
        "by_uuid_index": pynvml.nvmlDeviceGetIndex(
            pynvml.nvmlDeviceGetHandleByUUID(pynvml.nvmlDeviceGetUUID(h))),
    })
out["gpus"] = gpus

h0 = pynvml.nvmlDeviceGetHandleByIndex(0)
pynvml.nvmlDeviceSetPowerManagementLimit(h0, 350000)
out["after_set_mw"] = pynvml.nvmlDeviceGetPowerManagementLimit(h0)
try:
    pynvml.nvmlDeviceSetPowerManagementLimit(h0, 50000)
    out["out_of_range"] = "accepted"
except pynvml.NVMLError as e:
    out["out_of_range"] = e.value
try:
    pynvml.nvmlDeviceGetHandleByIndex(count)
    out["bad_index"] = "accepted"
except pynvml.NVMLError as e:
    out["bad_index"] = e.value
pynvml.nvmlShutdown()
json.dump(out, sys.stdout)
